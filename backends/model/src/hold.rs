//! Calls held after they took effect, released by a test: how races are staged without time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::Call;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// The next call of the entry point will be held.
    Armed,
    /// A call took effect and its caller waits, the machine unlocked.
    Holding,
    /// The test let it go.
    Released,
}

/// The held calls of one machine.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    calls: Mutex<Vec<(Call, Stage)>>,
    changed: Condvar,
}

impl Holds {
    fn lock(&self) -> MutexGuard<'_, Vec<(Call, Stage)>> {
        self.calls.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Arms a hold of the next call of `call`.
    pub(crate) fn arm(&self, call: Call) {
        self.lock().push((call, Stage::Armed));
    }

    /// Where a call of `call` has taken effect (the machine unlocked): holds its caller here
    /// while a hold is armed for it, until the test releases it.
    pub(crate) fn reached(&self, call: Call) {
        let mut calls = self.lock();
        let Some(i) = calls
            .iter()
            .position(|&(c, stage)| c == call && stage == Stage::Armed)
        else {
            return;
        };
        calls[i].1 = Stage::Holding;
        self.changed.notify_all();
        while let Some(i) = calls
            .iter()
            .position(|&(c, stage)| c == call && stage != Stage::Armed)
        {
            if calls[i].1 == Stage::Released {
                calls.swap_remove(i);
                self.changed.notify_all();
                return;
            }
            calls = self
                .changed
                .wait(calls)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits until a call of `call` is held (it took effect and its caller has not returned);
    /// `false` if none was within `limit` (a bound for a broken test, not a timing).
    pub(crate) fn wait_held(&self, call: Call, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut calls = self.lock();
        loop {
            if calls
                .iter()
                .any(|&(c, stage)| c == call && stage == Stage::Holding)
            {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            calls = self
                .changed
                .wait_timeout(calls, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Lets a held call of `call` return (and disarms one not reached yet).
    pub(crate) fn release(&self, call: Call) {
        let mut calls = self.lock();
        if let Some(i) = calls
            .iter()
            .position(|&(c, stage)| c == call && stage == Stage::Holding)
        {
            calls[i].1 = Stage::Released;
        } else if let Some(i) = calls
            .iter()
            .position(|&(c, stage)| c == call && stage == Stage::Armed)
        {
            calls.swap_remove(i);
        }
        self.changed.notify_all();
    }

    /// Disarms every hold and lets every held call go.
    pub(crate) fn clear(&self) {
        let mut calls = self.lock();
        calls.retain(|&(_, stage)| stage != Stage::Armed);
        for (_, stage) in calls.iter_mut() {
            *stage = Stage::Released;
        }
        self.changed.notify_all();
    }
}

/// A hold armed by [`ModelDriver::hold_next`](crate::ModelDriver::hold_next): wait for the call
/// to be held, then release it. Dropping it releases the call too, so a failing test never
/// leaves a thread parked in the driver. Holds are matched by entry point, not by caller: arm
/// one hold per entry point at a time, and never make the held call on the thread that must
/// release it (it would wait for itself).
#[derive(Debug)]
#[must_use = "the call is released when this is dropped"]
pub struct HeldCall {
    holds: Arc<Holds>,
    call: Call,
    released: AtomicBool,
}

impl HeldCall {
    pub(crate) fn new(holds: Arc<Holds>, call: Call) -> Self {
        holds.arm(call);
        Self {
            holds,
            call,
            released: AtomicBool::new(false),
        }
    }

    /// Waits until the call has taken effect and its caller is held; `false` if it was not
    /// within `limit` (a bound for a broken test, never a timing the test relies on).
    #[must_use]
    pub fn wait(&self, limit: Duration) -> bool {
        self.holds.wait_held(self.call, limit)
    }

    /// Lets the held call return to its caller (or disarms the hold if it was never reached);
    /// once.
    pub fn release(&self) {
        if !self.released.swap(true, Ordering::AcqRel) {
            self.holds.release(self.call);
        }
    }
}

impl Drop for HeldCall {
    fn drop(&mut self) {
        self.release();
    }
}
