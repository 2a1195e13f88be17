//! Making a machine, its fault and hold controls, the context stack, and what tests inspect.

use super::*;

impl ModelDriver {
    /// A simulated machine as `config` describes. Its `device_count` is taken within 1 (a
    /// driver backend does not start without a device) and [`MAX_DEVICES`](crate::MAX_DEVICES)
    /// (each device has tables of its own: a count from a command line must not size them).
    #[must_use]
    pub fn new(config: ModelConfig) -> Self {
        let config = ModelConfig {
            device_count: config.device_count.clamp(1, crate::MAX_DEVICES),
            ..config
        };
        let mut state = State {
            used: vec![0; config.device_count as usize],
            failed_devices: vec![None; config.device_count as usize],
            pageable: config.pageable_memory_access,
            ..State::default()
        };
        for device in 0..config.device_count {
            let primary = state.handle();
            state.contexts.insert(
                primary,
                Context {
                    device,
                    primary: true,
                    poisoned: false,
                    inactive: false,
                },
            );
            state.primaries.push(primary);
            let scrub = state.handle();
            state.streams.insert(
                scrub,
                StreamRecord {
                    context: primary,
                    internal: true,
                },
            );
            state.scrub_streams.push(scrub);
        }
        let state = Arc::new(Mutex::new(state));
        let worker = config
            .worker_interval
            .filter(|_| config.deferred_streams)
            .map(|interval| Worker::start(&state, interval));
        Self {
            id: MACHINES.fetch_add(1, Ordering::Relaxed),
            config,
            page: host::page_size(),
            worker,
            state,
            holds: Arc::default(),
            drop_report: ModelDropReport::default(),
        }
    }

    /// The report of this machine's drop (what was still mapped then), readable once it has
    /// gone.
    #[must_use]
    pub fn drop_report(&self) -> ModelDropReport {
        self.drop_report.clone()
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        // Every update of the state is complete before anything that can panic; keep serving.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A snapshot of the counters.
    #[must_use]
    pub fn stats(&self) -> ModelStats {
        self.state().stats.clone()
    }

    /// Makes the `n`-th call from now (`n = 1`: the next) of the entry point `DriverBackend`
    /// calls for `op` fail: with `CUDA_ERROR_OUT_OF_MEMORY` for `Allocate`,
    /// `CUDA_ERROR_UNKNOWN` otherwise. `false` for an operation with no entry point of its own.
    pub fn fail_nth(&self, op: Operation, n: u64) -> bool {
        let Some(call) = Call::for_operation(op) else {
            return false;
        };
        let code = if op == Operation::Allocate {
            code::OUT_OF_MEMORY
        } else {
            code::UNKNOWN
        };
        self.fail_call(call, n, code);
        true
    }

    /// Makes the `n`-th call of `call` from now answer `code`: any integer, including codes no
    /// CUDA enum knows (to prove they are reported, not undefined behaviour).
    pub fn fail_call(&self, call: Call, n: u64, code: u32) {
        let mut state = self.state();
        let done = state.stats.entry_calls(call);
        state.faults.push(Fault {
            call,
            nth: done.saturating_add(n.max(1)),
            code,
        });
    }

    /// Fails `device` as a whole: from now on every call there (in a context of that device, or
    /// creating a context or pool on it) answers `code`, except teardown
    /// ([`Call::is_teardown`]: frees, destroys, pops, synchronises), until
    /// [`restore_device`](Self::restore_device). Other devices go on. (A real lost device,
    /// `CUDA_ERROR_ECC_UNCORRECTABLE` or an Xid, also fails teardown; the model keeps it working
    /// so tests can prove nothing of the other tenants leaks.) `false` for a device the machine
    /// does not have.
    pub fn fail_device(&self, device: DeviceId, code: u32) -> bool {
        let mut state = self.state();
        match state.failed_devices.get_mut(device.0 as usize) {
            Some(slot) => {
                *slot = Some(code);
                true
            }
            None => false,
        }
    }

    /// Undoes [`fail_device`](Self::fail_device).
    pub fn restore_device(&self, device: DeviceId) {
        if let Some(slot) = self.state().failed_devices.get_mut(device.0 as usize) {
            *slot = None;
        }
    }

    /// The code a call of `call` on `device` answers because the device is failed, if it is.
    pub(super) fn device_down(state: &State, call: Call, device: u32) -> Result<(), ModelError> {
        match state.failed_devices.get(device as usize).copied().flatten() {
            Some(code) if !call.is_teardown() => Err(error(call, code)),
            _ => Ok(()),
        }
    }

    /// Removes every pending injected failure and hold (and lets held calls return).
    pub fn clear_faults(&self) {
        self.state().faults.clear();
        self.holds.clear();
    }

    /// Holds the next call of the entry point `call` after it took effect, with the machine
    /// unlocked (a slow driver, or a thread preempted right after the call), until
    /// the [`HeldCall`](crate::HeldCall) is released (or dropped): races are staged by the
    /// test, not by time. The calls that can be held: `AllocManaged`, `Free`, `PoolFree`,
    /// `PoolTrim`, `PoolDestroy` and `PrimaryCtxReset` (a hold on any other is never reached).
    pub fn hold_next(&self, call: Call) -> crate::HeldCall {
        crate::HeldCall::new(Arc::clone(&self.holds), call)
    }

    /// Holds the next call of `call` as [`hold_next`](Self::hold_next) does, until
    /// [`release_held`](Self::release_held) (for a caller that names calls, not handles: the
    /// simulated libcuda's controls).
    pub fn arm_hold(&self, call: Call) {
        self.holds.arm(call);
    }

    /// Waits until a call of `call` is held by [`hold_next`](Self::hold_next); `false` if none
    /// was within `limit` (a bound for a broken test, never a timing the test relies on).
    #[must_use]
    pub fn wait_held(&self, call: Call, limit: Duration) -> bool {
        self.holds.wait_held(call, limit)
    }

    /// Lets a held call of `call` return to its caller (or disarms a hold not reached yet).
    pub fn release_held(&self, call: Call) {
        self.holds.release(call);
    }

    /// Counts a call, answers an injected failure if one is due, and checks that the calling
    /// thread's current context is live and usable (for `needs_context` calls): its device.
    pub(super) fn enter(
        &self,
        state: &mut State,
        call: Call,
        needs_context: bool,
    ) -> Result<u32, ModelError> {
        state.stats.calls[call.index()] += 1;
        let nth = state.stats.calls[call.index()];
        if let Some(i) = state
            .faults
            .iter()
            .position(|f| f.call == call && f.nth == nth)
        {
            let fault = state.faults.swap_remove(i);
            state.stats.injected_failures += 1;
            return Err(error(call, fault.code));
        }
        if !needs_context {
            return Ok(0);
        }
        let current = self.current();
        match state.contexts.get(&current) {
            Some(c) if c.inactive => Err(error(call, code::INVALID_CONTEXT)),
            Some(c) if c.poisoned => Err(error(call, code::ILLEGAL_ADDRESS)),
            Some(c) => Self::device_down(state, call, c.device).map(|()| c.device),
            None => Err(error(call, code::INVALID_CONTEXT)),
        }
    }

    /// Holds the caller while a hold is armed for `call` (called with the state unlocked).
    pub(super) fn late_return(&self, call: Call) {
        self.holds.reached(call);
    }

    /// Runs `f` on the calling thread's context stack of this machine. A thread whose
    /// thread-locals are being torn down (a driver call from a TLS destructor) has an empty stack
    /// that keeps nothing, rather than a panic.
    pub(super) fn with_stack<T>(&self, f: impl FnOnce(&mut Vec<u64>) -> T) -> T {
        let mut f = Some(f);
        let result = STACKS.try_with(|stacks| {
            let f = f.take().expect("called once");
            let mut stacks = stacks.borrow_mut();
            let i = match stacks.iter().position(|(id, _)| *id == self.id) {
                Some(i) => i,
                None => {
                    stacks.push((self.id, Vec::new()));
                    stacks.len() - 1
                }
            };
            let result = f(&mut stacks[i].1);
            if stacks[i].1.is_empty() {
                stacks.swap_remove(i);
            }
            result
        });
        match (result, f) {
            (Ok(result), _) => result,
            (Err(_), Some(f)) => f(&mut Vec::new()),
            (Err(_), None) => unreachable!("the stack's closure runs only if the stack exists"),
        }
    }

    /// The calling thread's current context of this machine (0: none).
    #[must_use]
    pub fn current(&self) -> u64 {
        self.with_stack(|s| s.last().copied().unwrap_or(0))
    }

    /// The depth of the calling thread's context stack of this machine.
    #[must_use]
    pub fn context_depth(&self) -> usize {
        self.with_stack(|s| s.len())
    }

    /// The queue a stream handle of the current context names (0: its legacy default stream).
    pub(super) fn queue_in(
        state: &State,
        call: Call,
        context: u64,
        stream: u64,
    ) -> Result<Queue, ModelError> {
        if stream == DEFAULT_STREAM {
            return Ok(Queue::Default(context));
        }
        match state.streams.get(&stream) {
            Some(s) if s.context == context => Ok(Queue::Stream(stream)),
            _ => Err(error(call, code::INVALID_HANDLE)),
        }
    }

    /// The queue of a `Stream` handed out by `DriverBackend` over this machine, checked live.
    pub(super) fn queue_of(state: &State, call: Call, stream: On) -> Result<Queue, ModelError> {
        if !state.contexts.contains_key(&stream.context) {
            return Err(error(call, code::INVALID_CONTEXT));
        }
        Self::queue_in(state, call, stream.context, stream.raw)
    }

    pub(super) fn check_poison(state: &State, call: Call, context: u64) -> Result<(), ModelError> {
        match state.contexts.get(&context) {
            Some(c) if c.poisoned => Err(error(call, code::ILLEGAL_ADDRESS)),
            Some(c) => Self::device_down(state, call, c.device),
            None => Err(error(call, code::INVALID_CONTEXT)),
        }
    }

    /// Runs `queue` now if streams are not deferred.
    pub(super) fn settle(&self, state: &mut State, queue: Queue) {
        if !self.config.deferred_streams {
            state.drain(queue);
        }
    }

    pub(super) fn location(&self, call: Call, location: Location) -> Result<(), ModelError> {
        match location {
            Location::Device(d) if d.0 >= self.config.device_count => {
                Err(error(call, code::INVALID_DEVICE))
            }
            _ => Ok(()),
        }
    }

    /// What advice and prefetch may name at `ptr..ptr + len` (non-empty): the managed
    /// allocation holding it (`Some(base)`), or, with pageable memory access, host memory
    /// outside every allocation (`None`).
    pub(super) fn advisable(
        &self,
        state: &State,
        call: Call,
        ptr: u64,
        len: usize,
    ) -> Result<Option<usize>, ModelError> {
        let invalid = error(call, code::INVALID_VALUE);
        let start = usize::try_from(ptr).map_err(|_| invalid)?;
        let end = start.checked_add(len).ok_or(invalid)?;
        if len == 0 {
            return Err(invalid);
        }
        match state.allocations.range(..end).next_back() {
            Some((&base, r)) if start >= base && end <= base + r.len && r.pool.is_none() => {
                Ok(Some(base))
            }
            // Overlapping an allocation without lying inside it, or a pool block.
            Some((&base, r)) if start < base + r.len => Err(invalid),
            _ if self.config.pageable_memory_access => Ok(None),
            _ => Err(invalid),
        }
    }

    /// The hint maps `allocation` is read through and the offset of its base in them: its own
    /// record, or the system memory's (pageable memory access) for attached host memory.
    pub(super) fn hint_maps<'s>(
        &self,
        state: &'s State,
        allocation: &Allocation,
    ) -> Result<(&'s HintMaps, usize), ModelError> {
        let base = allocation.as_ptr() as usize;
        allocation
            .range(0, 1)
            .map_err(|e| ModelError::Refused(e.into()))?;
        match state.allocations.get(&base) {
            Some(r) if r.len == allocation.len() => Ok((&r.hints, 0)),
            None if self.config.pageable_memory_access
                && state.containing(base, base).is_none() =>
            {
                Ok((&state.system, base))
            }
            _ => Err(error(Call::Advise, code::INVALID_VALUE)),
        }
    }

    /// The hints in force at `offset` of `allocation` (managed, or attached host memory with
    /// pageable memory access).
    pub fn hints(&self, allocation: &Allocation, offset: usize) -> Result<Hints, ModelError> {
        let state = self.state();
        let (maps, base) = self.hint_maps(&state, allocation)?;
        allocation
            .range(offset, 1)
            .map_err(|e| ModelError::Refused(e.into()))?;
        Ok(maps.at(base + offset))
    }

    /// Advice and residency ranges the driver tracks now, over every allocation and the system
    /// memory (pageable memory access): what hints can make it hold.
    #[must_use]
    pub fn hint_ranges(&self) -> usize {
        let state = self.state();
        state.system.ranges()
            + state
                .allocations
                .values()
                .map(|r| r.hints.ranges())
                .sum::<usize>()
    }

    /// The host ranges registered now, as `(base, len)` in address order.
    #[must_use]
    pub fn registered_ranges(&self) -> Vec<(usize, usize)> {
        let state = self.state();
        state.registered.iter().map(|(&b, r)| (b, r.len)).collect()
    }

    /// Where `offset` of `allocation` was last prefetched to, by work that has run (`None`:
    /// never).
    pub fn residency(
        &self,
        allocation: &Allocation,
        offset: usize,
    ) -> Result<Option<Location>, ModelError> {
        let state = self.state();
        let (maps, base) = self.hint_maps(&state, allocation)?;
        allocation
            .range(offset, 1)
            .map_err(|e| ModelError::Refused(e.into()))?;
        Ok(maps.residency.get(base + offset).copied())
    }

    /// Work items queued and not yet run, over all streams.
    #[must_use]
    pub fn pending_work(&self) -> usize {
        self.state().queues.values().map(VecDeque::len).sum()
    }

    /// Bytes the device's memory holds now (managed allocations and pool reservations).
    #[must_use]
    pub fn device_bytes_used(&self, device: DeviceId) -> u64 {
        self.state()
            .used
            .get(device.0 as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Whether a kernel fault poisoned `context` (sticky until it is destroyed).
    #[must_use]
    pub fn is_poisoned(&self, context: u64) -> bool {
        self.state()
            .contexts
            .get(&context)
            .is_some_and(|c| c.poisoned)
    }

    /// Runs the oldest work item queued on `stream`, as the device would get to it
    /// (deterministic stepping for tests); `false` if nothing was queued.
    pub fn step(&self, stream: &Stream) -> Result<bool, ModelError> {
        let mut state = self.state();
        let queue = Self::queue_of(&state, Call::StreamSynchronize, stream.into())?;
        Ok(state.run_one(queue))
    }
}
