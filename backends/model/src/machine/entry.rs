//! What the simulated libcuda's C ABI (`tests/cuda-sim`, a thin shell over this model) needs
//! beyond `DriverApi`: the entry points in the driver's own form (a raw stream handle meaning the
//! caller's current context for the default stream, `cuCtxCreate` pushing its context, pool
//! memory that is not zeroed), and inspection by address.

use tensor_wasm_mem_core::{DeviceId, DriverApi, DriverContext, Location};

use super::{On, Work, error};
use crate::{Call, Event, Function, Hints, Kernel, ModelDriver, ModelError, Module, code};

impl ModelDriver {
    /// The device of a live context.
    #[must_use]
    pub fn context_device(&self, context: u64) -> Option<DeviceId> {
        self.state()
            .contexts
            .get(&context)
            .map(|c| DeviceId(c.device))
    }

    /// Marks `device`'s primary context active or not (the C shell: retained by someone, or
    /// released by its last holder). Inactive, it cannot be made current and calls in it answer
    /// `CUDA_ERROR_INVALID_CONTEXT`. `false` for a device the machine does not have.
    pub fn set_primary_active(&self, device: DeviceId, active: bool) -> bool {
        let mut state = self.state();
        let Some(&primary) = state.primaries.get(device.0 as usize) else {
            return false;
        };
        match state.contexts.get_mut(&primary) {
            Some(c) => {
                c.inactive = !active;
                true
            }
            None => false,
        }
    }

    /// `cuCtxSetCurrent`: `context` replaces the top of the calling thread's context stack (or
    /// is pushed on an empty one); 0 pops the top.
    pub fn set_current(&self, context: u64) -> Result<(), ModelError> {
        let usable = self
            .state()
            .contexts
            .get(&context)
            .is_some_and(|c| !c.inactive);
        if context != 0 && !usable {
            return Err(error(Call::CtxPush, code::INVALID_CONTEXT));
        }
        self.with_stack(|s| match (s.last_mut(), context) {
            (Some(_), 0) => {
                s.pop();
            }
            (Some(top), _) => *top = context,
            (None, 0) => {}
            (None, _) => s.push(context),
        });
        Ok(())
    }

    /// `cuCtxCreate`: a new context on `device`, pushed on the calling thread's stack.
    pub fn context_create_pushed(&self, device: DeviceId) -> Result<u64, ModelError> {
        let context = self.context_create(device)?.raw();
        self.with_stack(|s| s.push(context));
        Ok(context)
    }

    /// `cuCtxDestroy`: as [`DriverApi::context_destroy`], and popped from the calling thread's
    /// stack if it is current there (anywhere else in a stack it stays, dangling, and later
    /// calls there fail with `CUDA_ERROR_INVALID_CONTEXT`), as the driver documents.
    pub fn context_destroy_popping(&self, context: u64) -> Result<(), ModelError> {
        self.context_destroy(DriverContext::from_raw(context))?;
        self.with_stack(|s| {
            if s.last() == Some(&context) {
                s.pop();
            }
        });
        Ok(())
    }

    /// The stream a raw handle names: its own context for a stream, the calling thread's
    /// current context for the default stream (0).
    fn on_raw(&self, call: Call, stream: u64) -> Result<On, ModelError> {
        let context = if stream == 0 {
            self.current()
        } else {
            let state = self.state();
            match state.streams.get(&stream) {
                Some(s) if !s.internal => s.context,
                _ => return Err(error(call, code::INVALID_HANDLE)),
            }
        };
        Ok(On {
            context,
            raw: stream,
        })
    }

    /// `cuMemsetD8Async`: sets `ptr..ptr + len` (inside one allocation) to `value` when
    /// `stream` (of the current context) gets to it.
    ///
    /// # Safety
    ///
    /// As for a kernel launch: when it runs, nothing else may access those bytes.
    pub unsafe fn memset_async(
        &self,
        ptr: u64,
        value: u8,
        len: usize,
        stream: u64,
    ) -> Result<(), ModelError> {
        let call = Call::Memset;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let queue = Self::queue_in(&state, call, self.current(), stream)?;
        let invalid = error(call, code::INVALID_VALUE);
        let start = usize::try_from(ptr).map_err(|_| invalid)?;
        let end = start.checked_add(len).ok_or(invalid)?;
        if state.containing(start, end).is_none() || len == 0 {
            return Err(invalid);
        }
        state.enqueue(queue, Work::Memset { start, end, value });
        self.settle(&mut state, queue);
        Ok(())
    }

    /// `cuMemAllocFromPoolAsync` as the driver does it: the block holds whatever it held (the
    /// `DriverApi` form zero-fills it).
    pub fn pool_alloc_async(
        &self,
        pool: u64,
        bytes: usize,
        stream: u64,
    ) -> Result<u64, ModelError> {
        self.pool_alloc_inner(pool, bytes, stream, false)
    }

    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` of a live pool.
    pub fn pool_release_threshold(&self, pool: u64) -> Result<u64, ModelError> {
        match self.state().pools.get(&pool) {
            Some(p) if !p.destroyed => Ok(p.release_threshold),
            _ => Err(error(Call::PoolReserved, code::INVALID_HANDLE)),
        }
    }

    /// Sets `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` of a live pool.
    pub fn set_pool_release_threshold(&self, pool: u64, bytes: u64) -> Result<(), ModelError> {
        match self.state().pools.get_mut(&pool) {
            Some(p) if !p.destroyed => {
                p.release_threshold = bytes;
                Ok(())
            }
            _ => Err(error(Call::PoolCreate, code::INVALID_HANDLE)),
        }
    }

    /// `cuModuleUnload`: its functions go with it.
    pub fn unload_module(&self, module: Module) -> Result<(), ModelError> {
        let mut state = self.state();
        if state.modules.remove(&module.raw()).is_none() {
            return Err(error(Call::ModuleLoad, code::INVALID_HANDLE));
        }
        state.functions.retain(|_, f| f.module != module.raw());
        Ok(())
    }

    /// [`launch`](Self::launch) on a raw stream handle (0: the current context's default
    /// stream).
    ///
    /// # Safety
    ///
    /// As for [`launch`](Self::launch).
    pub unsafe fn launch_raw(
        &self,
        stream: u64,
        function: Function,
        args: &[u64],
    ) -> Result<(), ModelError> {
        let on = self.on_raw(Call::Launch, stream)?;
        let kernel = self
            .state()
            .functions
            .get(&function.raw())
            .map(|f| f.kernel);
        // SAFETY: the caller's contract is this call's.
        unsafe { self.launch_kernel(on, kernel, args) }
    }

    /// The simulated kernel a live function handle names.
    #[must_use]
    pub fn function_kernel(&self, function: Function) -> Option<Kernel> {
        self.state()
            .functions
            .get(&function.raw())
            .map(|f| f.kernel)
    }

    /// [`event_record`](Self::event_record) on a raw stream handle.
    pub fn event_record_raw(&self, event: Event, stream: u64) -> Result<(), ModelError> {
        self.record_on(event, self.on_raw(Call::EventRecord, stream)?)
    }

    /// [`stream_wait_event`](Self::stream_wait_event) on a raw stream handle.
    pub fn stream_wait_event_raw(&self, stream: u64, event: Event) -> Result<(), ModelError> {
        self.wait_on(self.on_raw(Call::StreamWaitEvent, stream)?, event)
    }

    /// The hints in force at `ptr`, inside a live managed allocation, and where it was last
    /// prefetched to by work that has run.
    pub fn hints_at(&self, ptr: u64) -> Result<(Hints, Option<Location>), ModelError> {
        let state = self.state();
        let invalid = error(Call::Advise, code::INVALID_VALUE);
        let at = usize::try_from(ptr).map_err(|_| invalid)?;
        match state.allocations.range(..=at).next_back() {
            Some((&base, r)) if at < base + r.len && r.pool.is_none() => Ok((
                r.hints.at(at - base),
                r.hints.residency.get(at - base).copied(),
            )),
            _ => Err(invalid),
        }
    }
}
