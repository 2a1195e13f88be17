//! `DriverApi` on the simulated machine: the entry points, as libcuda's.

use super::*;

// SAFETY: `alloc_managed` returns a fresh private anonymous mapping of at least `bytes` bytes
// (page aligned, so aligned to MIN_ALIGN), host memory the simulated device "accesses" by being
// the host, never overlapping another live one; `zero` writes zeros to exactly the range, checked
// inside a live allocation, and returns once they are visible (it runs the zeroing stream);
// `device_facts` reports the configuration.
unsafe impl DriverApi for ModelDriver {
    type Error = ModelError;

    fn device_count(&self) -> u32 {
        self.config.device_count
    }

    fn device_facts(&self, _device: DeviceId) -> DeviceFacts {
        DeviceFacts {
            concurrent_managed_access: self.config.concurrent_managed_access,
            pageable_memory_access: self.config.pageable_memory_access,
            pageable_uses_host_page_tables: false,
            host_registration: self.config.host_registration,
        }
    }

    fn allocations_come_zeroed(&self) -> bool {
        !self.config.poison_fresh_allocations
    }

    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> bool {
        let count = self.config.device_count;
        self.config.peer_access && device != peer && device.0 < count && peer.0 < count
    }

    fn memory_info(&self) -> Result<Option<(u64, u64)>, ModelError> {
        let mut state = self.state();
        let device = self.enter(&mut state, Call::MemGetInfo, true)?;
        let total = self.config.device_memory_bytes;
        let used = state.used.get(device as usize).copied().unwrap_or(0);
        Ok(Some((total.saturating_sub(used), total)))
    }

    fn primary_context(&self, device: DeviceId) -> DriverContext {
        let state = self.state();
        DriverContext::from_raw(state.primaries.get(device.0 as usize).copied().unwrap_or(0))
    }

    fn push_current(&self, context: DriverContext) -> Result<(), ModelError> {
        let context = context.raw();
        let mut state = self.state();
        self.enter(&mut state, Call::CtxPush, false)?;
        if state.contexts.get(&context).is_none_or(|c| c.inactive) {
            return Err(error(Call::CtxPush, code::INVALID_CONTEXT));
        }
        drop(state);
        self.with_stack(|s| s.push(context));
        Ok(())
    }

    fn pop_current(&self) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::CtxPop, false)?;
        drop(state);
        self.with_stack(|s| s.pop())
            .map(|_| ())
            .ok_or(error(Call::CtxPop, code::INVALID_CONTEXT))
    }

    fn alloc_managed(&self, device: DeviceId, bytes: usize) -> Result<u64, ModelError> {
        let call = Call::AllocManaged;
        let mut state = self.state();
        let current = self.enter(&mut state, call, true)?;
        if current != device.0 {
            return Err(error(call, code::INVALID_CONTEXT));
        }
        let mapped = bytes
            .checked_next_multiple_of(self.page)
            .filter(|_| bytes > 0)
            .ok_or(error(call, code::INVALID_VALUE))?;
        let ptr = self.map_device(&mut state, call, current, mapped)?;
        if self.config.poison_fresh_allocations {
            // SAFETY: a fresh mapping of `mapped >= bytes` bytes that only we know.
            unsafe { ptr.as_ptr().write_bytes(0xA5, bytes) };
        }
        let address = ptr.as_ptr() as usize;
        state
            .allocations
            .insert(address, Self::new_record(bytes, mapped, current, None));
        let stats = &mut state.stats;
        stats.allocations += 1;
        stats.live_allocations += 1;
        stats.live_bytes += bytes as u64;
        stats.peak_bytes = stats.peak_bytes.max(stats.live_bytes);
        drop(state);
        self.late_return(call);
        Ok(address as u64)
    }

    unsafe fn free(&self, ptr: u64) -> Result<(), ModelError> {
        let call = Call::Free;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let address = usize::try_from(ptr).map_err(|_| error(call, code::INVALID_VALUE))?;
        if state
            .allocations
            .get(&address)
            .is_none_or(|r| r.pool.is_some())
        {
            return Err(error(call, code::INVALID_VALUE));
        }
        let record = state
            .allocations
            .remove(&address)
            .ok_or(error(call, code::INVALID_VALUE))?;
        let pending = state.pending_over(address, address + record.len, None);
        if pending {
            // What is still queued over it finds no memory when it runs (a kernel faults).
            state.stats.frees_over_pending_work += 1;
        }
        state.used[record.device as usize] -= record.mapped as u64;
        state.stats.frees += 1;
        state.stats.live_allocations -= 1;
        state.stats.live_bytes -= record.len as u64;
        if pending {
            state.quarantine.push(Mapping {
                address,
                mapped: record.mapped,
            });
        } else if let Some(p) = core::ptr::NonNull::new(address as *mut u8) {
            // SAFETY: the mapping made for this allocation (taken out of the table just now);
            // the caller guarantees it is not used afterwards, and no queued work targets it.
            unsafe { host::unmap(p, record.mapped) };
        }
        drop(state);
        self.late_return(call);
        Ok(())
    }

    unsafe fn zero(&self, device: DeviceId, ptr: u64, len: usize) -> Result<(), ModelError> {
        let call = Call::Memset;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let invalid = error(call, code::INVALID_VALUE);
        let start = usize::try_from(ptr).map_err(|_| invalid)?;
        let end = start.checked_add(len).ok_or(invalid)?;
        if state.containing(start, end).is_none() || len == 0 {
            return Err(invalid);
        }
        let scrub = *state
            .scrub_streams
            .get(device.0 as usize)
            .ok_or(error(call, code::INVALID_DEVICE))?;
        let queue = Queue::Stream(scrub);
        state.enqueue(
            queue,
            Work::Memset {
                start,
                end,
                value: 0,
            },
        );
        // The zeroing waits for its stream (and only for it).
        state.drain(queue);
        Ok(())
    }

    fn advise(&self, ptr: u64, len: usize, advice: Advice) -> Result<(), ModelError> {
        let call = Call::Advise;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let base = self.advisable(&state, call, ptr, len)?;
        if let Some(location) = advice.location() {
            self.location(call, location)?;
        }
        let start = ptr as usize;
        match base {
            Some(base) => {
                let record = state
                    .allocations
                    .get_mut(&base)
                    .ok_or(error(call, code::INVALID_VALUE))?;
                record.hints.apply(start - base..start - base + len, advice);
            }
            None => state.system.apply(start..start + len, advice),
        }
        Ok(())
    }

    fn prefetch(
        &self,
        ptr: u64,
        len: usize,
        to: Location,
        stream: DriverStream,
    ) -> Result<(), ModelError> {
        let stream = stream.raw();
        let call = Call::Prefetch;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let context = self.current();
        let queue = Self::queue_in(&state, call, context, stream)?;
        self.advisable(&state, call, ptr, len)?;
        self.location(call, to)?;
        if matches!(to, Location::Device(_)) && !self.config.concurrent_managed_access {
            return Err(error(call, code::NOT_SUPPORTED));
        }
        let start = ptr as usize;
        state.enqueue(
            queue,
            Work::Prefetch {
                start,
                end: start + len,
                to,
            },
        );
        self.settle(&mut state, queue);
        Ok(())
    }

    fn scrub_stream(&self, device: DeviceId) -> DriverStream {
        let state = self.state();
        DriverStream::from_raw(
            state
                .scrub_streams
                .get(device.0 as usize)
                .copied()
                .unwrap_or(0),
        )
    }

    fn stream_create(&self) -> Result<DriverStream, ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::StreamCreate, true)?;
        let context = self.current();
        let handle = state.handle();
        state.streams.insert(
            handle,
            StreamRecord {
                context,
                internal: false,
            },
        );
        state.stats.live_streams += 1;
        state.stats.streams_created += 1;
        Ok(DriverStream::from_raw(handle))
    }

    /// Work still queued completes (the driver finishes it after the call returns; the model
    /// runs it here), then the stream goes. In a context a kernel fault poisoned, it answers the
    /// sticky `CUDA_ERROR_ILLEGAL_ADDRESS` and the stream stays, until the context is destroyed.
    fn stream_destroy(&self, stream: DriverStream) -> Result<(), ModelError> {
        let stream = stream.raw();
        let call = Call::StreamDestroy;
        let mut state = self.state();
        self.enter(&mut state, call, false)?;
        let context = match state.streams.get(&stream) {
            Some(s) if !s.internal => s.context,
            _ => return Err(error(call, code::INVALID_HANDLE)),
        };
        // After a kernel fault every call in the context answers the sticky error, destroys
        // included; only destroying the context itself (which takes its streams) recovers.
        Self::check_poison(&state, call, context)?;
        state.drain(Queue::Stream(stream));
        state.streams.remove(&stream);
        state.stats.live_streams -= 1;
        state.stats.streams_destroyed += 1;
        Ok(())
    }

    fn synchronize(&self, stream: DriverStream) -> Result<(), ModelError> {
        let stream = stream.raw();
        let call = Call::StreamSynchronize;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let context = self.current();
        let queue = Self::queue_in(&state, call, context, stream)?;
        state.drain(queue);
        Self::check_poison(&state, call, context)
    }

    fn context_create(&self, device: DeviceId) -> Result<DriverContext, ModelError> {
        let call = Call::CtxCreate;
        let mut state = self.state();
        self.enter(&mut state, call, false)?;
        if device.0 >= self.config.device_count {
            return Err(error(call, code::INVALID_DEVICE));
        }
        Self::device_down(&state, call, device.0)?;
        let handle = state.handle();
        state.contexts.insert(
            handle,
            Context {
                device: device.0,
                primary: false,
                poisoned: false,
                inactive: false,
            },
        );
        state.stats.live_contexts += 1;
        state.stats.contexts_created += 1;
        // `cuCtxCreate` pushes the new context; the contract is to leave the stack as it was,
        // so the push and its pop cancel out.
        Ok(DriverContext::from_raw(handle))
    }

    /// Destroys a non-primary context with its streams. The device first finishes the work the
    /// context queued (a wait on another stream for one of its events is then satisfied); a
    /// poisoned context's abandoned work only gives back its pool blocks and reaches its records.
    fn context_destroy(&self, context: DriverContext) -> Result<(), ModelError> {
        let context = context.raw();
        let call = Call::CtxDestroy;
        let mut state = self.state();
        self.enter(&mut state, call, false)?;
        match state.contexts.get(&context) {
            Some(c) if !c.primary => {}
            _ => return Err(error(call, code::INVALID_CONTEXT)),
        }
        let streams: Vec<u64> = state
            .streams
            .iter()
            .filter(|(_, s)| s.context == context)
            .map(|(&h, _)| h)
            .collect();
        // The device finishes what the context queued before it goes (a poisoned context's
        // work was abandoned at the fault); whatever is left still gives back its pool blocks
        // and reaches its event records, so no wait elsewhere waits forever.
        let poisoned = state.contexts.get(&context).is_some_and(|c| c.poisoned);
        for queue in streams
            .iter()
            .map(|&s| Queue::Stream(s))
            .chain([Queue::Default(context)])
        {
            if !poisoned {
                state.drain(queue);
            }
            for work in state.queues.remove(&queue).unwrap_or_default() {
                match work {
                    Work::PoolFree { ptr } => state.release_pool_block(ptr),
                    Work::Signal { event, generation } => state.signal(event, generation),
                    _ => {}
                }
            }
        }
        for s in streams {
            state.streams.remove(&s);
            state.stats.live_streams -= 1;
            state.stats.streams_destroyed += 1;
        }
        state.contexts.remove(&context);
        state.stats.live_contexts -= 1;
        state.stats.contexts_destroyed += 1;
        Ok(())
    }

    fn host_register(&self, ptr: u64, len: usize) -> Result<(), ModelError> {
        let call = Call::HostRegister;
        let mut state = self.state();
        let device = self.enter(&mut state, call, true)?;
        if !self.config.host_registration {
            return Err(error(call, code::NOT_SUPPORTED));
        }
        let invalid = error(call, code::INVALID_VALUE);
        let start = usize::try_from(ptr).map_err(|_| invalid)?;
        let end = start.checked_add(len).ok_or(invalid)?;
        if len == 0 || !start.is_multiple_of(self.page) || !len.is_multiple_of(self.page) {
            return Err(invalid);
        }
        if state.registration_overlaps(start, end) {
            return Err(error(call, code::HOST_MEMORY_ALREADY_REGISTERED));
        }
        // Device memory is not host memory to pin, and pinning needs every page mapped
        // readable and writable (a PROT_NONE guard cannot be pinned).
        let over_allocation = state
            .allocations
            .range(..end)
            .next_back()
            .is_some_and(|(&b, r)| start < b + r.mapped);
        if over_allocation || !host::accessible(start, len) {
            return Err(invalid);
        }
        state.registered.insert(start, Registration { len, device });
        state.stats.registered_ranges += 1;
        state.stats.registered_bytes += len as u64;
        Ok(())
    }

    unsafe fn host_unregister(&self, ptr: u64) -> Result<(), ModelError> {
        let call = Call::HostUnregister;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let start = usize::try_from(ptr).map_err(|_| error(call, code::INVALID_VALUE))?;
        let record = state
            .registered
            .remove(&start)
            .ok_or(error(call, code::HOST_MEMORY_NOT_REGISTERED))?;
        if state.pending_over(start, start + record.len, None) {
            state.stats.unregisters_over_pending_work += 1;
        }
        state.stats.registered_ranges -= 1;
        state.stats.registered_bytes -= record.len as u64;
        Ok(())
    }

    unsafe fn reset_primary_context(&self, device: DeviceId) -> Result<(), ModelError> {
        // SAFETY: the caller's contract is the reset's.
        unsafe { self.reset_primary(device) }.map(|_| ())
    }

    fn pool_create(
        &self,
        device: DeviceId,
        max_bytes: u64,
        release_threshold: u64,
    ) -> Result<DriverPool, ModelError> {
        let call = Call::PoolCreate;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        if device.0 >= self.config.device_count {
            return Err(error(call, code::INVALID_DEVICE));
        }
        Self::device_down(&state, call, device.0)?;
        let handle = state.handle();
        state.pools.insert(
            handle,
            Pool {
                device: device.0,
                max_bytes,
                release_threshold,
                reserved: 0,
                live: 0,
                cached: Vec::new(),
                destroyed: false,
            },
        );
        state.stats.live_pools += 1;
        Ok(DriverPool::from_raw(handle))
    }

    /// Kept blocks are given back; blocks still allocated (or with frees queued) keep the pool
    /// until their frees run, as the driver documents.
    fn pool_destroy(&self, pool: DriverPool) -> Result<(), ModelError> {
        let pool = pool.raw();
        let call = Call::PoolDestroy;
        let mut state = self.state();
        self.enter(&mut state, call, false)?;
        match state.pools.get_mut(&pool) {
            Some(p) if !p.destroyed => p.destroyed = true,
            _ => return Err(error(call, code::INVALID_HANDLE)),
        }
        state.trim(pool, 0);
        state.stats.live_pools -= 1;
        if state.pools.get(&pool).is_some_and(|p| p.live == 0) {
            state.pools.remove(&pool);
        }
        drop(state);
        self.late_return(call);
        Ok(())
    }

    fn pool_alloc(
        &self,
        pool: DriverPool,
        bytes: usize,
        stream: DriverStream,
    ) -> Result<u64, ModelError> {
        // The contract: zero-filled in stream order.
        self.pool_alloc_inner(pool.raw(), bytes, stream.raw(), true)
    }

    fn pool_free(&self, ptr: u64, stream: DriverStream) -> Result<(), ModelError> {
        let stream = stream.raw();
        let call = Call::PoolFree;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let context = self.current();
        let queue = Self::queue_in(&state, call, context, stream)?;
        let address = usize::try_from(ptr).map_err(|_| error(call, code::INVALID_VALUE))?;
        if state
            .allocations
            .get(&address)
            .is_none_or(|r| r.pool.is_none())
            || state
                .queues
                .values()
                .flatten()
                .any(|w| matches!(w, Work::PoolFree { ptr } if *ptr == address))
        {
            return Err(error(call, code::INVALID_VALUE));
        }
        state.enqueue(queue, Work::PoolFree { ptr: address });
        state.stats.live_pool_allocations -= 1;
        self.settle(&mut state, queue);
        drop(state);
        self.late_return(call);
        Ok(())
    }

    fn pool_trim(&self, pool: DriverPool, keep_bytes: u64) -> Result<(), ModelError> {
        let pool = pool.raw();
        let call = Call::PoolTrim;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        if state.pools.get(&pool).is_none_or(|p| p.destroyed) {
            return Err(error(call, code::INVALID_HANDLE));
        }
        state.trim(pool, keep_bytes);
        drop(state);
        self.late_return(call);
        Ok(())
    }

    fn pool_reserved(&self, pool: DriverPool) -> Result<u64, ModelError> {
        let pool = pool.raw();
        let call = Call::PoolReserved;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        match state.pools.get(&pool) {
            Some(p) if !p.destroyed => Ok(p.reserved),
            _ => Err(error(call, code::INVALID_HANDLE)),
        }
    }
}
