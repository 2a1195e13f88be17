//! Time and work limits on guest code: a deadline per call (epoch interruption) and fuel.
//!
//! Both are Wasmtime's own mechanisms, switched on in the engine's Config by the creator
//! ([`CreatorBuilder::interruption`](crate::CreatorBuilder::interruption)); both cost a little
//! in every guest loop (a check at each loop header and function entry: `twm bench` measures
//! it), so both are off by default.
//!
//! - **Deadlines.** An [`EpochTicker`] advances its engine's epoch on a thread of its own;
//!   [`EpochTicker::call_within`] gives one call on a Store a deadline. Guest code past it traps
//!   with [`Trap::Interrupt`] ([`is_timeout`] says so). One ticker
//!   serves every Store of its engine, so every tenant's call can have a deadline of its own.
//! - **Fuel.** [`call_with_fuel`] gives one call a budget of Wasm work; spent, the guest traps
//!   with [`Trap::OutOfFuel`].
//!
//! A Store made by [`new_store`](crate::new_store) (or given its limiter by
//! [`install_limiter`](crate::install_limiter)) starts with no deadline and unlimited fuel, so
//! switching these on stops nothing until a call asks for a limit.
//!
//! **What a deadline cannot interrupt:** host code. A guest blocked in a host call (a WASI
//! `poll_oneoff` sleeping, a read on a pipe) is interrupted only when the call returns to guest
//! code. A host that must bound wall-clock time whatever the guest calls keeps a watchdog of its
//! own (`twm run --timeout` ends the process, docs/SAFETY.md).
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tensor_wasm_mem_wasmtime::core::IsolationLevel;
//! use tensor_wasm_mem_wasmtime::mock::MockBackend;
//! use tensor_wasm_mem_wasmtime::deadline::{EpochTicker, Interruption, is_timeout};
//! use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
//! use tensor_wasm_mem_wasmtime::{
//!     ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, instantiate, new_store,
//! };
//!
//! let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
//!     .interruption(Interruption::EPOCHS)
//!     .build()?;
//! let engine = creator.engine()?;
//! let ticker = EpochTicker::start(&engine, Duration::from_millis(1))?;
//! let module = Module::new(&engine, r#"(module (func (export "spin") (loop (br 0))))"#)?;
//! let tenant = Tenant::new(1, "alice", 64 << 20, IsolationLevel::StreamIsolated);
//! let mut store = new_store(&engine, TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()));
//! let instance = instantiate(&mut store, &Linker::new(&engine), &module)?;
//! let spin = instance.get_typed_func::<(), ()>(&mut store, "spin")?;
//! let error = ticker
//!     .call_within(&mut store, Duration::from_millis(20), |store| spin.call(store, ()))
//!     .unwrap_err();
//! assert!(is_timeout(&error));
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use wasmtime::{AsContextMut, Config, Engine, Store, Trap};

use crate::TwmError;

/// "No deadline": far enough that no ticker reaches it (a tick a microsecond: 146,000 years),
/// small enough that Wasmtime's `current + delta` cannot overflow.
pub const NO_DEADLINE: u64 = u64::MAX / 4;

/// The shortest and longest tick an [`EpochTicker`] accepts.
pub const TICK_RANGE: (Duration, Duration) = (Duration::from_micros(100), Duration::from_secs(1));

/// Which of Wasmtime's interruption mechanisms an engine compiles into guest code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Interruption {
    /// Epoch interruption: deadlines ([`EpochTicker`]).
    pub epochs: bool,
    /// Fuel: budgets of Wasm work ([`call_with_fuel`]).
    pub fuel: bool,
}

impl Interruption {
    /// Neither (the default: no cost in guest loops).
    pub const NONE: Self = Self {
        epochs: false,
        fuel: false,
    };
    /// Deadlines only.
    pub const EPOCHS: Self = Self {
        epochs: true,
        fuel: false,
    };
    /// Fuel only.
    pub const FUEL: Self = Self {
        epochs: false,
        fuel: true,
    };
    /// Both.
    pub const BOTH: Self = Self {
        epochs: true,
        fuel: true,
    };

    /// Switches the mechanisms on in `config` (and off where `self` says so).
    pub fn configure(self, config: &mut Config) -> &mut Config {
        config
            .epoch_interruption(self.epochs)
            .consume_fuel(self.fuel)
    }
}

/// Gives a fresh Store no deadline and unlimited fuel (what a Store made by
/// [`new_store`](crate::new_store) gets): with interruption on, Wasmtime's own defaults (a
/// deadline already past, no fuel) would stop its first instruction.
pub(crate) fn unlimited<T: 'static>(mut store: impl AsContextMut<Data = T>) {
    let mut context = store.as_context_mut();
    context.set_epoch_deadline(NO_DEADLINE);
    // Asked of the engine, not of the Store: a Store without fuel answers with an error that
    // Wasmtime formats and allocates, once per Store.
    if context.engine().get_consume_fuel() {
        let _ = context.set_fuel(u64::MAX);
    }
}

/// Whether `error` is a deadline's interruption ([`Trap::Interrupt`]).
#[must_use]
pub fn is_timeout(error: &wasmtime::Error) -> bool {
    error.downcast_ref::<Trap>() == Some(&Trap::Interrupt)
}

/// Whether `error` is a fuel budget spent ([`Trap::OutOfFuel`]).
#[must_use]
pub fn is_out_of_fuel(error: &wasmtime::Error) -> bool {
    error.downcast_ref::<Trap>() == Some(&Trap::OutOfFuel)
}

/// Runs `call` on `store` with `fuel` units of Wasm work (about one per instruction); spent,
/// the guest traps with [`Trap::OutOfFuel`]. Afterwards the Store's fuel is unlimited again.
/// An engine without fuel ([`Interruption::fuel`] off) is [`TwmError::Interruption`].
pub fn call_with_fuel<T: 'static, R>(
    store: &mut Store<T>,
    fuel: u64,
    call: impl FnOnce(&mut Store<T>) -> wasmtime::Result<R>,
) -> wasmtime::Result<R> {
    store
        .set_fuel(fuel)
        .map_err(|_| TwmError::Interruption("the engine consumes no fuel"))?;
    let result = call(store);
    store.set_fuel(u64::MAX)?;
    result
}

struct Stop {
    stopped: Mutex<bool>,
    wake: Condvar,
}

/// Advances an engine's epoch every tick on a thread of its own, until dropped (the drop stops
/// and joins the thread). One per engine serves every Store of it.
pub struct EpochTicker {
    engine: Engine,
    tick: Duration,
    stop: Arc<Stop>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for EpochTicker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochTicker")
            .field("tick", &self.tick)
            .finish_non_exhaustive()
    }
}

impl EpochTicker {
    /// Starts ticking `engine`'s epoch every `tick` (within [`TICK_RANGE`], else
    /// [`TwmError::Interruption`]; so is a thread the system will not start).
    pub fn start(engine: &Engine, tick: Duration) -> Result<Self, TwmError> {
        if !(TICK_RANGE.0..=TICK_RANGE.1).contains(&tick) {
            return Err(TwmError::Interruption(
                "an epoch tick must be between 100 microseconds and 1 second",
            ));
        }
        let stop = Arc::new(Stop {
            stopped: Mutex::new(false),
            wake: Condvar::new(),
        });
        let (ticking, signal) = (engine.clone(), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("twm-epoch-ticker".into())
            .spawn(move || {
                let mut stopped = signal
                    .stopped
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let mut next = Instant::now() + tick;
                while !*stopped {
                    let now = Instant::now();
                    if now < next {
                        // A wait may end early (a spurious wakeup): a tick is never early.
                        stopped = signal
                            .wake
                            .wait_timeout(stopped, next - now)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                        continue;
                    }
                    ticking.increment_epoch();
                    // The next tick is a whole tick after this one, never on a fixed schedule:
                    // after a late wakeup (a loaded machine) a schedule would catch up with a
                    // burst of ticks, and a deadline set just before it would fire early.
                    next = now + tick;
                }
            })
            .map_err(|_| TwmError::Interruption("the epoch ticker's thread did not start"))?;
        Ok(Self {
            engine: engine.clone(),
            tick,
            stop,
            thread: Some(thread),
        })
    }

    /// The tick.
    #[must_use]
    pub fn tick(&self) -> Duration {
        self.tick
    }

    /// The epoch ticks a deadline `within` from now is set at: `within` in ticks, rounded up,
    /// plus one, since the next tick may come at any moment after the deadline is set. So a
    /// deadline never fires before `within`, and at most a tick after.
    #[must_use]
    pub fn ticks_for(&self, within: Duration) -> u64 {
        let ticks = within.as_nanos().div_ceil(self.tick.as_nanos()) + 1;
        u64::try_from(ticks).unwrap_or(NO_DEADLINE).min(NO_DEADLINE)
    }

    /// Runs `call` on `store` with a deadline `within` from now: guest code still running then
    /// traps with [`Trap::Interrupt`] ([`is_timeout`]), never before `within`, about a tick
    /// after at most. Afterwards the Store has no deadline again. A Store of another engine is [`TwmError::Interruption`].
    /// The engine must compile epoch checks ([`Interruption::epochs`], set by the creator that
    /// configured it): Wasmtime does not say whether it does, and without them no deadline
    /// fires.
    pub fn call_within<T: 'static, R>(
        &self,
        store: &mut Store<T>,
        within: Duration,
        call: impl FnOnce(&mut Store<T>) -> wasmtime::Result<R>,
    ) -> wasmtime::Result<R> {
        if !Engine::same(store.engine(), &self.engine) {
            return Err(TwmError::Interruption("the Store belongs to another engine").into());
        }
        store.set_epoch_deadline(self.ticks_for(within));
        let result = call(store);
        store.set_epoch_deadline(NO_DEADLINE);
        result
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        *self
            .stop
            .stopped
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = true;
        self.stop.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            // The thread only ticks and waits: it cannot panic, and a join error would have
            // nothing left to clean up.
            let _ = thread.join();
        }
    }
}
