//! Faults and recovery of a [`DriverBackend`]: a device whose primary context a kernel poisoned
//! is fenced, and recovered with a reset of that context once nothing of ours there is in use.
//!
//! A sticky fault (`CUDA_ERROR_ILLEGAL_ADDRESS` and its kin, [`ErrorKind::ContextLost`]) makes
//! every later call in its context fail. Seen in a device's primary context (where every
//! managed allocation, pool, scrub and the shared and stream-isolated tenants' streams live),
//! it **fences** the device: no new allocation, stream, pool or host attachment there, no
//! advice, prefetch or zeroing, and frees are not sent to the driver (refused, so the owner
//! keeps the allocation and, in the Wasmtime integration, its charge). Seen in a
//! context-isolated tenant's own context, it is that tenant's alone: the context goes with the
//! tenant's last stream, as before, and nothing else is fenced.
//!
//! [`DriverBackend::recover`] resets the primary context (`cuDevicePrimaryCtxReset`) once
//! nothing of ours in it is in use: every allocation there given up (its free was refused, by
//! the fence or by the driver), no stream of it or pool on the device handed out. What the reset
//! destroyed leaves the tables: streams and pools outright, allocations as *lost* records keyed
//! by their address and generation, so the owner's later `free` (or `detach_host`) succeeds
//! without a driver call and an address the driver hands out again after the reset is never
//! mistaken for the old allocation. The device then takes work again.

use alloc::sync::Weak;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::allocator::{Allocation, IdleHolder};
use crate::device::DeviceId;
use crate::driver::{DriverApi, DriverBackend, Life, Refusal, State};
use crate::error::{BackendError, ErrorKind};
use crate::host::HostAccess;

/// A device's fault record in a [`DriverBackend`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceHealth {
    /// Fenced: its primary context faulted and has not been reset yet.
    pub fenced: bool,
    /// A recovery is resetting it now.
    pub resetting: bool,
    /// Faults seen in its primary context (each fences it once).
    pub faults: u64,
    /// Resets of its primary context that succeeded.
    pub recoveries: u64,
}

/// What one [`DriverBackend::recover`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recovery {
    /// The device whose primary context was reset.
    pub device: DeviceId,
    /// Allocations (and registered host ranges) the reset destroyed: their owners' later frees
    /// succeed without a driver call.
    pub allocations: u64,
    /// Bytes in them.
    pub bytes: u64,
    /// Retired streams (destroys the driver had refused) the reset destroyed.
    pub streams: u64,
    /// Retired pools the reset destroyed.
    pub pools: u64,
}

/// Lock-free counts that let the hot paths skip the fault checks when nothing ever faulted, and
/// each device's gate.
#[derive(Debug, Default)]
pub(super) struct Faulted {
    /// Devices fenced now.
    fenced: AtomicU64,
    /// Lost records held.
    lost: AtomicU64,
    /// Resets that succeeded, all devices together.
    recoveries: AtomicU64,
    /// Per device: the calls a reset must not overlap.
    gates: alloc::vec::Vec<Gate>,
    /// Per device: the last fault number claimed ([`ManagedAllocator::claim_fault`]).
    ///
    /// [`ManagedAllocator::claim_fault`]: crate::ManagedAllocator::claim_fault
    claims: alloc::vec::Vec<AtomicU64>,
    /// What holds memory of ours idle and lets it go on a fenced device, asked by each
    /// recovery before it counts what is in use ([`ManagedAllocator::watch_idle`]).
    ///
    /// [`ManagedAllocator::watch_idle`]: crate::ManagedAllocator::watch_idle
    idle: spin::Mutex<alloc::vec::Vec<Weak<dyn IdleHolder>>>,
}

impl Faulted {
    pub(super) fn new(devices: u32) -> Self {
        Self {
            gates: (0..devices).map(|_| Gate::default()).collect(),
            claims: (0..devices).map(|_| AtomicU64::new(0)).collect(),
            ..Self::default()
        }
    }
}

/// One device's driver calls in flight that a reset of its primary context must not overlap (a
/// call between its check of the fence and its record's insertion, a release between taking a
/// record out and putting it back, any call with the primary context current), and whether a
/// reset runs. A call counts itself in, then looks for a reset; a recovery marks its reset, then
/// looks for calls (both sequentially consistent): one of the two always sees the other.
#[derive(Debug, Default)]
pub(super) struct Gate {
    calls: AtomicU64,
    resetting: AtomicBool,
}

/// A reset under way, marked in its device's [`Gate`]: the mark goes with [`end`](Self::end),
/// or when the recovery unwinds (a panic in the driver's reset never leaves the gate shut).
struct Resetting<'g>(&'g AtomicBool);

impl Resetting<'_> {
    fn end(self) {
        self.0.store(false, Ordering::SeqCst);
        core::mem::forget(self);
    }
}

impl Drop for Resetting<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// A driver call counted in its device's [`Gate`] until dropped.
#[derive(Debug)]
pub(super) struct DeviceCall<'b>(&'b Gate);

impl Drop for DeviceCall<'_> {
    fn drop(&mut self) {
        self.0.calls.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An allocation a reset destroyed, until its owner frees it.
#[derive(Clone, Copy, Debug)]
pub(super) struct LostRecord {
    pub(super) len: usize,
    pub(super) host: Option<HostAccess>,
}

/// What of ours in a device's primary context is still in use (a recovery waits for none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct InUse {
    allocations: u64,
    streams: u64,
    pools: u64,
}

impl State {
    /// What of ours in `device`'s primary context is in use: allocations not given up (pageable
    /// host ranges are the host's and survive a reset), streams handed out or in a call, pools
    /// in service or in a call.
    fn in_use_on(&self, device: DeviceId, primary: crate::driver::DriverContext) -> InUse {
        InUse {
            allocations: self
                .allocations
                .values()
                .filter(|r| r.device == device && r.host != Some(HostAccess::Pageable))
                .filter(|r| !r.abandoned)
                .count() as u64,
            streams: self
                .streams
                .values()
                .filter(|r| r.context == primary && (r.life != Life::Failed || r.busy > 0))
                .count() as u64,
            pools: self
                .pools
                .values()
                .filter(|r| r.device == device && !r.is_retired_and_idle())
                .count() as u64,
        }
    }

    /// Takes out of the tables what a reset of `device`'s primary context destroyed (checked
    /// to be in use by no one): allocations become lost records.
    fn forget_reset(
        &mut self,
        device: DeviceId,
        primary: crate::driver::DriverContext,
        released: &mut alloc::vec::Vec<crate::ledger::Reservation>,
    ) -> Recovery {
        let mut recovery = Recovery {
            device,
            allocations: 0,
            bytes: 0,
            streams: 0,
            pools: 0,
        };
        let gone: alloc::vec::Vec<u64> = self
            .allocations
            .iter()
            .filter(|(_, r)| r.device == device && r.host != Some(HostAccess::Pageable))
            .map(|(&a, _)| a)
            .collect();
        for address in gone {
            let Some(record) = self.allocations.remove(&address) else {
                continue;
            };
            match record.host {
                None => {
                    self.stats.live_allocations -= 1;
                    self.stats.live_bytes -= record.len as u64;
                }
                Some(access) => self.stats.count_host(access, record.len, false),
            }
            recovery.allocations += 1;
            recovery.bytes += record.len as u64;
            if record.orphaned {
                // Its owner is gone for good: nothing will ever free it, so nothing waits.
                continue;
            }
            self.lost.insert(
                (address, record.generation),
                LostRecord {
                    len: record.len,
                    host: record.host,
                },
            );
            self.stats.lost_allocations += 1;
            self.stats.lost_bytes += record.len as u64;
        }
        let before = self.streams.len();
        self.streams.retain(|_, r| r.context != primary);
        recovery.streams = (before - self.streams.len()) as u64;
        self.stats.live_streams -= recovery.streams;
        let before = self.pools.len();
        let mut blocks = 0;
        self.pools.retain(|_, r| {
            let keep = r.device != device;
            if !keep {
                blocks += r.live.len() as u64;
                // Destroyed with the pool: what its tenant paid for them goes back (dropped
                // by the caller, outside the lock).
                released.append(&mut r.charges);
            }
            keep
        });
        recovery.pools = (before - self.pools.len()) as u64;
        self.stats.live_pools -= recovery.pools;
        self.stats.live_pool_allocations -= blocks;
        self.stats.pending_releases = self
            .stats
            .pending_releases
            .saturating_sub(recovery.streams + recovery.pools);
        recovery
    }
}

impl<D: DriverApi> DriverBackend<D> {
    /// `true` for the first claim of `device`'s fault number `fault` (see
    /// [`ManagedAllocator::claim_fault`](crate::ManagedAllocator::claim_fault)); `false` for a
    /// device this backend does not have.
    pub(super) fn claim_fault(&self, device: DeviceId, fault: u64) -> bool {
        self.faulted
            .claims
            .get(device.0 as usize)
            .is_some_and(|last| last.fetch_max(fault, Ordering::AcqRel) < fault)
    }

    /// `device`'s fault record (a device it does not have: healthy, nothing counted).
    pub(super) fn health(&self, device: DeviceId) -> DeviceHealth {
        let mut health = self
            .state
            .lock()
            .devices
            .get(device.0 as usize)
            .copied()
            .unwrap_or_default();
        // A reset's one mark is its gate's.
        health.resetting = self
            .faulted
            .gates
            .get(device.0 as usize)
            .is_some_and(|g| g.resetting.load(Ordering::SeqCst));
        health
    }

    /// Starts device work of the caller's own on `device` (a kernel launch): counted in the
    /// device's gate, so no reset overlaps it, until [`end_work`](Self::end_work). Refused on
    /// a fenced device and while a reset runs.
    pub(super) fn begin_work(&self, device: DeviceId) -> Result<(), Refusal> {
        let call = self.enter(device, false)?;
        // Counted until `end_work`, which the caller's guard makes.
        core::mem::forget(call);
        Ok(())
    }

    /// Ends device work [`begin_work`](Self::begin_work) started on `device`.
    pub(super) fn end_work(&self, device: DeviceId) {
        if let Some(gate) = self.faulted.gates.get(device.0 as usize) {
            gate.calls.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Resets that succeeded so far, all devices together (one atomic load).
    pub(super) fn recoveries_so_far(&self) -> u64 {
        self.faulted.recoveries.load(Ordering::Acquire)
    }

    /// Whether `device` is fenced (its primary context faulted and is not reset yet).
    pub(super) fn is_fenced(&self, device: DeviceId) -> bool {
        if self.faulted.fenced.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.state
            .lock()
            .devices
            .get(device.0 as usize)
            .is_some_and(|h| h.fenced)
    }

    /// [`enter`](Self::enter) for a teardown that consumes its handle (a stream's release, a
    /// pool's destroy), fenced devices included: a reset under way is waited out, not refused.
    /// A refusal would leave a record that no one can release any more (the handle is gone)
    /// and that every later recovery counts in use, so the device would stay fenced for good;
    /// the reset is short, and one that found this call in flight gives up at once.
    pub(super) fn enter_teardown(&self, device: DeviceId) -> Result<DeviceCall<'_>, Refusal> {
        loop {
            match self.enter(device, true) {
                Err(Refusal::Recovering { .. }) => core::hint::spin_loop(),
                entered => return entered,
            }
        }
    }

    /// Enters `device` for a driver call a reset must not overlap, until the returned guard
    /// drops: refused while a reset runs ([`Refusal::Recovering`]) and, unless `fenced_too` (a
    /// release, which handles the fence itself), while the device is fenced
    /// ([`Refusal::DeviceFenced`]: the start of anything new there).
    pub(super) fn enter(
        &self,
        device: DeviceId,
        fenced_too: bool,
    ) -> Result<DeviceCall<'_>, Refusal> {
        self.check_device(device)?;
        let Some(gate) = self.faulted.gates.get(device.0 as usize) else {
            return Err(Refusal::InvalidDevice {
                device,
                count: self.faulted.gates.len() as u32,
            });
        };
        gate.calls.fetch_add(1, Ordering::SeqCst);
        let call = DeviceCall(gate);
        if gate.resetting.load(Ordering::SeqCst) {
            return Err(Refusal::Recovering { device });
        }
        if !fenced_too && self.is_fenced(device) {
            return Err(Refusal::DeviceFenced { device });
        }
        Ok(call)
    }

    /// A driver call in `context` answered `error`: if it is a sticky fault and `context` is a
    /// device's primary context, the device is fenced (counted once per fault).
    pub(super) fn note_fault(&self, context: crate::driver::DriverContext, error: &D::Error) {
        if error.kind() != ErrorKind::ContextLost {
            return;
        }
        let count = self.driver.device_count();
        let device = (0..count)
            .map(DeviceId)
            .find(|&d| self.driver.primary_context(d) == context);
        let mut state = self.state.lock();
        let State {
            devices,
            contexts,
            stats,
            ..
        } = &mut *state;
        match device {
            Some(device) => {
                if let Some(health) = devices.get_mut(device.0 as usize)
                    && !health.fenced
                {
                    health.fenced = true;
                    health.faults += 1;
                    stats.faults += 1;
                    stats.fenced_devices += 1;
                    self.faulted.fenced.fetch_add(1, Ordering::AcqRel);
                }
            }
            // A context-isolated tenant's own context: that tenant's alone (it goes with the
            // tenant's last stream).
            None => {
                if let Some(entry) = contexts.values_mut().find(|e| e.context == Some(context))
                    && !entry.lost
                {
                    entry.lost = true;
                    stats.faults += 1;
                }
            }
        }
    }

    /// A lost allocation's record (destroyed by a reset), taken out if `allocation` names it:
    /// its free or detach then succeeds without a driver call.
    pub(super) fn take_lost(&self, allocation: &Allocation, host: bool) -> bool {
        if self.faulted.lost.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.remove_lost(&mut self.state.lock(), allocation, Some(host))
    }

    /// Takes `allocation`'s lost record out of `state` if there is one (of host memory or not,
    /// as `host` says; `None`: either), counted out: `true` if it was there.
    pub(super) fn remove_lost(
        &self,
        state: &mut State,
        allocation: &Allocation,
        host: Option<bool>,
    ) -> bool {
        let key = (allocation.device_ptr(), allocation.generation());
        match state.lost.get(&key) {
            Some(r) if r.len == allocation.len() && host.is_none_or(|h| r.host.is_some() == h) => {
                state.lost.remove(&key);
                state.stats.lost_allocations -= 1;
                state.stats.lost_bytes -= allocation.len() as u64;
                self.faulted.lost.fetch_sub(1, Ordering::AcqRel);
                true
            }
            _ => false,
        }
    }

    /// Registers an [`IdleHolder`] (see [`ManagedAllocator::watch_idle`]); holders gone are
    /// dropped from the list on the way.
    ///
    /// [`ManagedAllocator::watch_idle`]: crate::ManagedAllocator::watch_idle
    pub(super) fn watch_idle(&self, holder: Weak<dyn IdleHolder>) {
        let mut idle = self.faulted.idle.lock();
        idle.retain(|h| h.strong_count() > 0);
        idle.push(holder);
    }

    /// Asks every live [`IdleHolder`] to let go what it holds idle on fenced devices, with no
    /// lock of ours held (a holder frees, and a holder dropped here may free at its drop).
    fn let_idle_go(&self) {
        let holders: alloc::vec::Vec<_> = {
            let mut idle = self.faulted.idle.lock();
            idle.retain(|h| h.strong_count() > 0);
            idle.iter().filter_map(Weak::upgrade).collect()
        };
        for holder in holders {
            holder.let_go_if_fenced();
        }
    }

    /// Recovers a fenced `device`: resets its primary context (`cuDevicePrimaryCtxReset`),
    /// takes what the reset destroyed out of the tables (allocations become lost records, see
    /// `docs/SAFETY.md` section 6b), and lifts the fence. `Ok(None)` for a device that is not fenced.
    ///
    /// Refused with [`Refusal::StillInUse`] while anything of ours in the context is in use (an
    /// allocation not given up, a stream or pool handed out, a call using one): the owners
    /// release them first (their frees are refused while the device is fenced, which gives them
    /// up); with [`Refusal::Recovering`] while another call recovers it. If the reset fails the
    /// device stays fenced, and a later call tries again.
    ///
    /// # Safety
    ///
    /// The reset destroys everything made in the device's primary context, not only what this
    /// backend made: nothing else in the process may use what it made there afterwards (an
    /// embedder's modules, functions, events and streams loaded through cudarc or another
    /// binding, a kernel launcher's cached modules, another backend's allocations on the
    /// device), or it must make them again. What this backend made is handled.
    pub unsafe fn recover(&self, device: DeviceId) -> Result<Option<Recovery>, D::Error> {
        self.check_device(device)?;
        if self.is_fenced(device) {
            self.let_idle_go();
        }
        let primary = self.driver.primary_context(device);
        let gate = &self.faulted.gates[device.0 as usize];
        let resetting;
        {
            let state = self.state.lock();
            if !state.devices[device.0 as usize].fenced {
                return Ok(None);
            }
            // Marked (by this call only): no new call starts from here on; those in flight are
            // waited for by the caller's retry. With none in flight the tables are still, and
            // what is in use is counted.
            if gate.resetting.swap(true, Ordering::SeqCst) {
                return Err(Refusal::Recovering { device }.into());
            }
            resetting = Resetting(&gate.resetting);
            let calls = gate.calls.load(Ordering::SeqCst);
            let in_use = state.in_use_on(device, primary);
            if calls > 0 || in_use != InUse::default() {
                resetting.end();
                return Err(Refusal::StillInUse {
                    device,
                    allocations: in_use.allocations,
                    streams: in_use.streams,
                    pools: in_use.pools,
                    calls,
                }
                .into());
            }
        }
        // SAFETY: nothing of ours in the context is in use (checked above, and the gate keeps
        // anything new from starting there): every allocation in it was given up by a free
        // whose caller promised not to use it again, no stream or pool is handed out, no call of
        // ours is in flight; nothing else uses the context (this call's contract).
        let reset = unsafe { self.driver.reset_primary_context(device) };
        let mut state = self.state.lock();
        if let Err(e) = reset {
            resetting.end();
            return Err(e);
        }
        let lost_before = state.stats.lost_allocations;
        let mut released = alloc::vec::Vec::new();
        let recovery = state.forget_reset(device, primary, &mut released);
        // Lost records made (an orphaned allocation leaves none).
        self.faulted
            .lost
            .fetch_add(state.stats.lost_allocations - lost_before, Ordering::AcqRel);
        self.faulted.fenced.fetch_sub(1, Ordering::AcqRel);
        state.generation += 1;
        let health = &mut state.devices[device.0 as usize];
        health.fenced = false;
        health.recoveries += 1;
        state.stats.fenced_devices -= 1;
        state.stats.recoveries += 1;
        self.faulted.recoveries.fetch_add(1, Ordering::AcqRel);
        // The fence goes before the gate opens: no call slips in between to a fenced refusal.
        resetting.end();
        drop(state);
        // The charges of the pools the reset destroyed go back, outside the lock.
        drop(released);
        Ok(Some(recovery))
    }
}
