//! Modules and kernels, events, and the pool and mapping helpers the driver entry points share.

use super::*;

impl ModelDriver {
    /// `cuModuleLoadData`: any image loads (its code is not read); its functions are the
    /// simulated [`Kernel`]s.
    pub fn load_module(&self) -> Result<Module, ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::ModuleLoad, true)?;
        let handle = state.handle();
        let context = self.current();
        state.modules.insert(handle, context);
        Ok(Module(handle))
    }

    /// `cuModuleGetFunction`: `CUDA_ERROR_NOT_FOUND` for a name that is no simulated kernel.
    pub fn get_function(&self, module: Module, name: &str) -> Result<Function, ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::ModuleGetFunction, true)?;
        if !state.modules.contains_key(&module.0) {
            return Err(error(Call::ModuleGetFunction, code::INVALID_HANDLE));
        }
        let kernel =
            Kernel::by_name(name).ok_or(error(Call::ModuleGetFunction, code::NOT_FOUND))?;
        let handle = state.handle();
        state.functions.insert(
            handle,
            FunctionRecord {
                module: module.0,
                kernel,
            },
        );
        Ok(Function(handle))
    }

    /// `cuLaunchKernel` on `stream`, in its context: queued, and run when the device gets to it.
    /// Wrong argument counts and overflowing lengths are refused at the call; memory outside
    /// every live allocation is found when it runs (an illegal address: the context is poisoned,
    /// its queued work abandoned, and every later call in it answers
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`).
    ///
    /// # Safety
    ///
    /// As for a kernel launch: when it runs, nothing else may access the bytes it touches (no
    /// Rust reference to them, no host view such as Wasmtime's `Memory::data`), typically
    /// because the memory is held by a device-access scope that waits for the stream.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        function: Function,
        args: &[u64],
    ) -> Result<(), ModelError> {
        let kernel = self.state().functions.get(&function.0).map(|f| f.kernel);
        // SAFETY: the caller's contract is this call's.
        unsafe { self.launch_kernel(stream.into(), kernel, args) }
    }

    /// [`launch`](Self::launch) of `kernel` (`None`: an unknown function handle).
    ///
    /// # Safety
    ///
    /// As for [`launch`](Self::launch).
    pub(super) unsafe fn launch_kernel(
        &self,
        stream: On,
        kernel: Option<Kernel>,
        args: &[u64],
    ) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::Launch, false)?;
        let queue = Self::queue_of(&state, Call::Launch, stream)?;
        Self::check_poison(&state, Call::Launch, stream.context)?;
        let kernel = kernel.ok_or(error(Call::Launch, code::INVALID_HANDLE))?;
        if args.len() != kernel.arity() {
            return Err(error(Call::Launch, code::INVALID_VALUE));
        }
        let mut all = [0u64; 4];
        all[..args.len()].copy_from_slice(args);
        let spans = kernel
            .spans(all)
            .ok_or(error(Call::Launch, code::INVALID_VALUE))?;
        if spans.iter().any(|&(a, n)| a.checked_add(n).is_none()) {
            return Err(error(Call::Launch, code::INVALID_VALUE));
        }
        state.enqueue(queue, Work::Kernel { kernel, args: all });
        self.settle(&mut state, queue);
        Self::check_poison(&state, Call::Launch, stream.context)
    }

    /// The simulated `fill` kernel over `device_ptr..device_ptr + len` with `byte`, launched on
    /// `stream` (a `cuLaunchKernel` of `fill`, without a module to load first).
    ///
    /// # Safety
    ///
    /// As for [`launch`](Self::launch).
    pub unsafe fn enqueue_fill(
        &self,
        stream: &Stream,
        device_ptr: u64,
        len: usize,
        byte: u8,
    ) -> Result<(), ModelError> {
        let args = [device_ptr, len as u64, u64::from(byte)];
        // SAFETY: the caller's contract is `launch`'s.
        unsafe { self.launch_kernel(stream.into(), Some(Kernel::Fill), &args) }
    }

    /// `cuEventCreate`.
    ///
    /// The event belongs to the calling thread's current context, if one is: it is recorded
    /// only on that context's streams (`CUDA_ERROR_INVALID_HANDLE` elsewhere), while a stream of
    /// any context may wait on it. With no context current (the Rust API's convenience) it
    /// belongs to none and any stream may record it.
    pub fn event_create(&self) -> Result<Event, ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::EventCreate, false)?;
        let owner = self.current();
        let handle = state.handle();
        state.events.insert(
            handle,
            EventRecord {
                owner,
                ..EventRecord::default()
            },
        );
        state.stats.live_events += 1;
        Ok(Event(handle))
    }

    pub(super) fn event(
        state: &mut State,
        call: Call,
        event: Event,
    ) -> Result<&mut EventRecord, ModelError> {
        state
            .events
            .get_mut(&event.0)
            .ok_or(error(call, code::INVALID_HANDLE))
    }

    /// `cuEventRecord`: the event completes when `stream` gets to this point.
    pub fn event_record(&self, event: Event, stream: &Stream) -> Result<(), ModelError> {
        self.record_on(event, stream.into())
    }

    pub(super) fn record_on(&self, event: Event, stream: On) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::EventRecord, false)?;
        let queue = Self::queue_of(&state, Call::EventRecord, stream)?;
        Self::check_poison(&state, Call::EventRecord, stream.context)?;
        let e = Self::event(&mut state, Call::EventRecord, event)?;
        if e.owner != 0 && e.owner != stream.context {
            return Err(error(Call::EventRecord, code::INVALID_HANDLE));
        }
        e.recorded += 1;
        e.queue = Some(queue);
        e.context = stream.context;
        let generation = e.recorded;
        state.enqueue(
            queue,
            Work::Signal {
                event: event.0,
                generation,
            },
        );
        self.settle(&mut state, queue);
        Ok(())
    }

    /// `cuStreamWaitEvent`: work queued on `stream` after this waits for the event's latest
    /// record (an event never recorded: nothing to wait for).
    pub fn stream_wait_event(&self, stream: &Stream, event: Event) -> Result<(), ModelError> {
        self.wait_on(stream.into(), event)
    }

    pub(super) fn wait_on(&self, stream: On, event: Event) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::StreamWaitEvent, false)?;
        let queue = Self::queue_of(&state, Call::StreamWaitEvent, stream)?;
        Self::check_poison(&state, Call::StreamWaitEvent, stream.context)?;
        let e = Self::event(&mut state, Call::StreamWaitEvent, event)?;
        let (generation, source) = (e.recorded, e.queue.filter(|_| e.completed < e.recorded));
        state.enqueue(
            queue,
            Work::Wait {
                event: event.0,
                generation,
                source,
            },
        );
        self.settle(&mut state, queue);
        Ok(())
    }

    /// `cuEventQuery`: `true` once the device reached the latest record (`CUDA_ERROR_NOT_READY`
    /// is `false` here).
    pub fn event_query(&self, event: Event) -> Result<bool, ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::EventQuery, false)?;
        let e = Self::event(&mut state, Call::EventQuery, event)?;
        let (done, context) = (e.completed >= e.recorded, e.context);
        if context != 0 {
            // A fault in the record's context is the event's answer, as the driver gives it.
            Self::check_poison(&state, Call::EventQuery, context)?;
        }
        Ok(done)
    }

    /// `cuEventSynchronize`: runs the event's stream up to its latest record.
    pub fn event_synchronize(&self, event: Event) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::EventSynchronize, false)?;
        loop {
            let e = Self::event(&mut state, Call::EventSynchronize, event)?;
            let (done, context, queue) = (e.completed >= e.recorded, e.context, e.queue);
            if context != 0 {
                Self::check_poison(&state, Call::EventSynchronize, context)?;
            }
            let Some(queue) = queue.filter(|_| !done) else {
                return Ok(());
            };
            if !state.run_one(queue) {
                // Abandoned by a fault: the record will never be reached.
                let context = state.queue_context(queue).unwrap_or(0);
                return Self::check_poison(&state, Call::EventSynchronize, context);
            }
        }
    }

    /// `cuEventDestroy_v2` (a wait already queued on it still completes).
    pub fn event_destroy(&self, event: Event) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::EventDestroy, false)?;
        state
            .events
            .remove(&event.0)
            .ok_or(error(Call::EventDestroy, code::INVALID_HANDLE))?;
        state.stats.live_events -= 1;
        Ok(())
    }

    /// `cuMemAllocFromPoolAsync`, zero-filled in stream order when `zero` (the `DriverApi`
    /// contract), else holding what the block held (the driver's own behaviour).
    pub(super) fn pool_alloc_inner(
        &self,
        pool: u64,
        bytes: usize,
        stream: u64,
        zero: bool,
    ) -> Result<u64, ModelError> {
        let call = Call::PoolAlloc;
        let mut state = self.state();
        let device = self.enter(&mut state, call, true)?;
        let context = self.current();
        let queue = Self::queue_in(&state, call, context, stream)?;
        let mapped = bytes
            .checked_next_multiple_of(self.page)
            .filter(|_| bytes > 0)
            .ok_or(error(call, code::INVALID_VALUE))?;
        let reuse = match state.pools.get(&pool) {
            // Only a block whose free has run is reused (a free still queued on another stream
            // is not ordered before this stream's work; an event between them would be), and
            // only one no queued work targets any more.
            Some(p) if !p.destroyed && p.device == device => p
                .cached
                .iter()
                .position(|b| b.mapped == mapped && !state.pending_over(b.address, b.end(), None)),
            Some(p) if !p.destroyed => return Err(error(call, code::INVALID_CONTEXT)),
            _ => return Err(error(call, code::INVALID_HANDLE)),
        };
        let p = state
            .pools
            .get_mut(&pool)
            .ok_or(error(call, code::INVALID_HANDLE))?;
        let reused = reuse.map(|i| p.cached.swap_remove(i));
        let address = match reused {
            Some(block) => block.address,
            None => {
                if p.max_bytes != 0 && p.reserved.saturating_add(mapped as u64) > p.max_bytes {
                    return Err(error(call, code::OUT_OF_MEMORY));
                }
                let ptr = self.map_device(&mut state, call, device, mapped)?;
                let p = state
                    .pools
                    .get_mut(&pool)
                    .ok_or(error(call, code::INVALID_HANDLE))?;
                p.reserved += mapped as u64;
                state.stats.pool_reserved_bytes += mapped as u64;
                ptr.as_ptr() as usize
            }
        };
        if let Some(p) = state.pools.get_mut(&pool) {
            p.live += 1;
        }
        state
            .allocations
            .insert(address, Self::new_record(bytes, mapped, device, Some(pool)));
        state.stats.live_pool_allocations += 1;
        if zero {
            state.enqueue(
                queue,
                Work::Memset {
                    start: address,
                    end: address + bytes,
                    value: 0,
                },
            );
            self.settle(&mut state, queue);
        }
        Ok(address as u64)
    }

    pub(super) fn new_record(len: usize, mapped: usize, device: u32, pool: Option<u64>) -> Record {
        Record {
            len,
            mapped,
            device,
            pool,
            hints: HintMaps::default(),
        }
    }

    /// Maps `mapped` bytes of device memory on `device`, or answers out-of-memory.
    pub(super) fn map_device(
        &self,
        state: &mut State,
        call: Call,
        device: u32,
        mapped: usize,
    ) -> Result<core::ptr::NonNull<u8>, ModelError> {
        let used = state.used[device as usize];
        if used.saturating_add(mapped as u64) > self.config.device_memory_bytes {
            return Err(error(call, code::OUT_OF_MEMORY));
        }
        let ptr = host::map(mapped).map_err(|errno| ModelError::HostMapFailed {
            requested: mapped as u64,
            errno,
        })?;
        state.used[device as usize] += mapped as u64;
        Ok(ptr)
    }
}
