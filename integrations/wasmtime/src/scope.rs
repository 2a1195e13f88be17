//! The device-access scope: a kernel's window onto a guest's memory, safe by construction.
//!
//! [`DeviceAccess::open`] takes the Store mutably, so no guest code runs while a kernel may
//! read or write the memory; it checks every range the kernel will use before anything is
//! queued, prefetches exactly those ranges to the tenant's device on the tenant's own stream
//! (where the device migrates pages), and hands out device pointers that live as long as the
//! scope, with the stream to launch on. [`DeviceAccess::close`] (or dropping the scope, on an
//! error or a panic path) waits for the stream before the Store is usable again, so the guest
//! never sees the memory while the kernel may still write it, and sees every write once it
//! runs.
//!
//! ```
//! use std::sync::Arc;
//! use tensor_wasm_mem_wasmtime::mock::MockBackend;
//! use tensor_wasm_mem_wasmtime::core::IsolationLevel;
//! use tensor_wasm_mem_wasmtime::*;
//!
//! let backend = Arc::new(MockBackend::default());
//! let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend)).build()?;
//! let engine = creator.engine()?;
//! let tenant = Tenant::new(1, "t1", 1 << 20, IsolationLevel::StreamIsolated);
//! let mut store = new_store(&engine, TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()));
//! let module = wasmtime::Module::new(&engine, r#"(module (memory (export "memory") 1))"#)?;
//! let instance = instantiate(&mut store, &wasmtime::Linker::new(&engine), &module)?;
//! let memory = instance.get_memory(&mut store, "memory").unwrap();
//!
//! let scope = DeviceAccess::open(&mut store, &creator, &memory, &[AccessRange::read_write(0, 4096)])?;
//! let slice = scope.slice(0).unwrap();
//! // Launch a kernel on `scope.stream()` over `slice.device_ptr()..+slice.len()`; here, the
//! // mock's simulated kernel:
//! // SAFETY: the scope holds the Store: nothing else touches these bytes until it waits.
//! unsafe { backend.driver().enqueue_fill(scope.stream(), slice.device_ptr(), slice.len(), 7)? };
//! scope.close()?; // waits for the kernel; the Store is the guest's again
//! assert_eq!(memory.data(&store)[4095], 7);
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, Range};

use tensor_wasm_mem_core::{
    Advice, DeviceId, DeviceSlice, Location, ManagedAllocator, Stream, StreamProvider,
};
use wasmtime::{Memory, Store};

use crate::Backend;
use crate::error::TwmError;
use crate::guest::{EndScopeWork, GuestContext, HasGuestContext};
use crate::lifecycle::ScopedMemory;
use crate::memory::{GuestSlice, MemoryView, TensorWasmMemoryCreator, guest_range};

/// How a kernel uses a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Read only: may be advised read-mostly for the scope ([`ScopeOptions::read_mostly`]).
    Read,
    /// Written (its old contents need not reach the device, but are prefetched all the same).
    Write,
    /// Read and written.
    ReadWrite,
}

impl Access {
    /// Whether the kernel may write.
    #[must_use]
    pub const fn writes(self) -> bool {
        !matches!(self, Self::Read)
    }
}

/// A guest range (offset and length in the guest's address space) and how a kernel uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AccessRange {
    /// Guest offset of the first byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// How the kernel uses it.
    pub access: Access,
}

impl AccessRange {
    /// `offset..offset + len`, read only.
    #[must_use]
    pub const fn read(offset: u64, len: u64) -> Self {
        Self {
            offset,
            len,
            access: Access::Read,
        }
    }

    /// `offset..offset + len`, written only.
    #[must_use]
    pub const fn write(offset: u64, len: u64) -> Self {
        Self {
            offset,
            len,
            access: Access::Write,
        }
    }

    /// `offset..offset + len`, read and written.
    #[must_use]
    pub const fn read_write(offset: u64, len: u64) -> Self {
        Self {
            offset,
            len,
            access: Access::ReadWrite,
        }
    }
}

/// What opening and closing a scope does besides checking and waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScopeOptions {
    /// Prefetch every range to the tenant's device on open (where the device migrates pages:
    /// concurrent managed access). Default: on.
    pub prefetch: bool,
    /// Advise read-only ranges read-mostly for the scope (unset again on close). Default: off.
    pub read_mostly: bool,
    /// On close, after the wait, prefetch written ranges back to the host (for a guest that
    /// reads the results at once). Default: off.
    pub write_back: bool,
}

impl Default for ScopeOptions {
    fn default() -> Self {
        Self {
            prefetch: true,
            read_mostly: false,
            write_back: false,
        }
    }
}

/// One checked range of an open scope: a [`GuestSlice`] (device pointer and length) that lives
/// as long as the scope's borrow, and how the kernel may use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScopedSlice<'a> {
    slice: GuestSlice<'a>,
    access: Access,
}

impl<'a> ScopedSlice<'a> {
    /// How the kernel may use it.
    #[must_use]
    pub const fn access(&self) -> Access {
        self.access
    }
}

impl<'a> std::ops::Deref for ScopedSlice<'a> {
    type Target = GuestSlice<'a>;

    fn deref(&self) -> &GuestSlice<'a> {
        &self.slice
    }
}

struct Entry {
    range: Range<usize>,
    access: Access,
    slice: DeviceSlice,
}

/// Makes a type invariant in `'a` (neither a longer nor a shorter lifetime converts to it).
type Invariant<'a> = fn(&'a ()) -> &'a ();

/// An open device-access scope over one guest memory: holds the Store exclusively for `'s`
/// (invariant in `'s`: a scope over a longer-lived Store is not a scope over this one). See
/// `docs/SAFETY.md` section 5 for the contract.
///
/// A scope that is forgotten (`mem::forget`) skips its wait: launching a kernel is unsafe, and
/// its contract includes closing or dropping the scope; [`run`](Self::run) cannot be made to
/// skip it. A forgotten scope holds no memory, slot, stream or charge (it refers to its memory
/// weakly): what it leaks is its own few hundred bytes, and its device work lasts until its
/// Store goes.
///
/// An open scope is device work ([`ManagedAllocator::begin_device_work`]): no recovery resets
/// its device's primary context under the kernels launched in it (a recovery meanwhile is
/// refused, the scope counted among the calls in flight), and no scope opens on a fenced
/// device. A forgotten scope's device work ends when its Store's guest context goes: with the
/// Store, or later where the embedder keeps the Store's data (`Store::into_data`).
pub struct DeviceAccess<'s, T: 'static, B: Backend> {
    _store: PhantomData<(&'s mut Store<T>, Invariant<'s>)>,
    memory: ScopedMemory<B>,
    /// The Store's guest stream, borrowed from its guest context for the scope's life (the
    /// scope holds the Store's borrow): the stream itself, never a copy of its handle.
    stream: &'s Stream,
    /// The Store's guest context, which holds the scope's device work (so a forgotten scope's
    /// ends with the Store).
    guest: &'s GuestContext<B>,
    device: DeviceId,
    entries: Vec<Entry>,
    /// Ranges this scope advised read-mostly (unset on close).
    advised: Vec<Range<usize>>,
    write_back: bool,
    open: bool,
}

impl<T: 'static, B: Backend> fmt::Debug for DeviceAccess<'_, T, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceAccess")
            .field("stream", &self.stream.raw())
            .field("device", &self.device)
            .field("ranges", &self.entries.len())
            .field("open", &self.open)
            .finish_non_exhaustive()
    }
}

impl<'s, T: HasGuestContext<B>, B: Backend> DeviceAccess<'s, T, B> {
    /// Opens a scope over `ranges` of `memory` with the default [`ScopeOptions`].
    pub fn open(
        store: &'s mut Store<T>,
        creator: &TensorWasmMemoryCreator<B>,
        memory: &Memory,
        ranges: &[AccessRange],
    ) -> Result<Self, TwmError> {
        Self::open_with(store, creator, memory, ranges, ScopeOptions::default())
    }

    /// Opens a scope over `ranges` of `memory`. Every range is checked first (inside the
    /// memory's current size, without overflow; the memory this creator's, device-accessible,
    /// and this Store's): a refusal queues nothing and makes no stream. Then the tenant's
    /// stream is taken (the Store's guest stream) and the ranges prefetched and advised as
    /// `options` say. An error while doing so closes what was opened and is returned.
    pub fn open_with(
        store: &'s mut Store<T>,
        creator: &TensorWasmMemoryCreator<B>,
        memory: &Memory,
        ranges: &[AccessRange],
        options: ScopeOptions,
    ) -> Result<Self, TwmError> {
        let view = MemoryView::of(&*store, memory)?;
        let (scoped, size) = creator.scoped(view)?;
        // The Store's borrow moves into the guest context's: the scope keeps the stream it
        // lends for as long as it holds the Store.
        let store: &'s mut Store<T> = store;
        let guest = store.data_mut().guest_context();
        if let (Some(theirs), Some(ours)) = (scoped.books(), guest.books())
            && !std::sync::Arc::ptr_eq(&theirs, ours)
        {
            return Err(TwmError::ForeignMemory);
        }
        let mut entries = Vec::with_capacity(ranges.len());
        for r in ranges {
            let range = guest_range(r.offset, r.len, size)?;
            let slice = scoped.slice(&range)?;
            entries.push(Entry {
                range,
                access: r.access,
                slice,
            });
        }
        let (stream, guest) = guest.scope_parts().map_err(TwmError::backend)?;
        let device = scoped.device();
        crate::guest::same_device(device, stream.device())?;
        // Device work until the scope closes: no recovery resets the primary context under
        // the kernels launched in it; refused on a fenced device. Counted on the backend of
        // the memory (the Store's guest context must use the same).
        if !std::sync::Arc::ptr_eq(guest.creator().backend(), creator.backend()) {
            return Err(TwmError::ForeignMemory);
        }
        guest.begin_scope_work(device)?;
        let mut scope = Self {
            _store: PhantomData,
            memory: scoped,
            stream,
            guest,
            device,
            entries,
            advised: Vec::new(),
            write_back: options.write_back,
            open: true,
        };
        if let Err(e) = scope.prepare(&options, creator) {
            // Whatever was queued is waited for; the first error is the answer.
            let _ = scope.finish();
            return Err(e);
        }
        Ok(scope)
    }

    fn prepare(
        &mut self,
        options: &ScopeOptions,
        creator: &TensorWasmMemoryCreator<B>,
    ) -> Result<(), TwmError> {
        // Pages move (and hints mean something) only on memory that migrates: managed memory,
        // or guarded memory with pageable access, on a device with concurrent managed access.
        // Registered host memory is read where it is: nothing to prefetch or advise.
        let caps = creator.capabilities();
        let migrates = caps.concurrent_managed_access && caps.managed;
        for i in 0..self.entries.len() {
            let (range, access) = (self.entries[i].range.clone(), self.entries[i].access);
            if range.is_empty() {
                continue;
            }
            if options.read_mostly && caps.managed && access == Access::Read {
                self.memory.advise(&range, Advice::SetReadMostly)?;
                self.advised.push(range.clone());
            }
            if options.prefetch && migrates {
                let to = Location::Device(self.device);
                self.memory.prefetch(&range, to, self.stream)?;
            }
        }
        Ok(())
    }
}

impl<T: HasGuestContext<B>, B: Backend> DeviceAccess<'_, T, B> {
    /// Opens a scope, runs `f` in it, and closes it: the form that cannot skip the wait. `f`
    /// gets a [`RunScope`], which only `run` can make and which lends the scope by shared
    /// reference (and [`host_bytes_mut`](RunScope::host_bytes_mut)): `f` cannot swap the
    /// scope for another, nor give it up, so the wait always happens
    /// (`tests/ui/run_scope_cannot_be_replaced.rs`, `tests/ui/run_scopes_cannot_be_swapped.rs`). (A scope from [`open`](Self::open) that is
    /// leaked with `mem::forget` never waits: see [`DeviceAccess`].) `f`'s result comes back
    /// once the stream has been waited for; an error of the open or of the wait is returned
    /// instead.
    pub fn run<R>(
        store: &mut Store<T>,
        creator: &TensorWasmMemoryCreator<B>,
        memory: &Memory,
        ranges: &[AccessRange],
        options: ScopeOptions,
        f: impl FnOnce(&mut RunScope<'_, T, B>) -> R,
    ) -> Result<R, TwmError> {
        let scope = DeviceAccess::open_with(store, creator, memory, ranges, options)?;
        let mut run = RunScope {
            scope,
            _brand: PhantomData,
        };
        let out = f(&mut run);
        run.scope.close()?;
        Ok(out)
    }

    /// [`run`](Self::run) for a closure that can fail: its error and the scope's compose into
    /// one `Result` (`E: From<TwmError>`), so the caller writes one `?`, not two. The scope is
    /// closed (the stream waited for) whether `f` fails or not; an error of `f` wins over one of
    /// the wait.
    pub fn try_run<R, E: From<TwmError>>(
        store: &mut Store<T>,
        creator: &TensorWasmMemoryCreator<B>,
        memory: &Memory,
        ranges: &[AccessRange],
        options: ScopeOptions,
        f: impl FnOnce(&mut RunScope<'_, T, B>) -> Result<R, E>,
    ) -> Result<R, E> {
        let scope = DeviceAccess::open_with(store, creator, memory, ranges, options)?;
        let mut run = RunScope {
            scope,
            _brand: PhantomData,
        };
        let out = f(&mut run);
        let closed = run.scope.close();
        match (out, closed) {
            (Err(e), _) => Err(e),
            (Ok(_), Err(wait)) => Err(wait.into()),
            (Ok(result), Ok(())) => Ok(result),
        }
    }
}

/// The open scope [`DeviceAccess::run`] lends its closure: every reading method of the scope
/// (through `Deref`) and [`host_bytes_mut`](Self::host_bytes_mut). Only `run` makes one, and
/// it never hands out the scope mutably, so the closure cannot replace or forget it: `run`
/// closes the very scope it opened. Invariant in `'scope`, unique to the call.
pub struct RunScope<'scope, T: 'static, B: Backend> {
    scope: DeviceAccess<'scope, T, B>,
    _brand: PhantomData<Invariant<'scope>>,
}

impl<'scope, T: 'static, B: Backend> Deref for RunScope<'scope, T, B> {
    type Target = DeviceAccess<'scope, T, B>;

    fn deref(&self) -> &Self::Target {
        &self.scope
    }
}

impl<T: 'static, B: Backend> RunScope<'_, T, B> {
    /// [`DeviceAccess::host_bytes_mut`] of the scope.
    pub fn host_bytes_mut(&mut self, i: usize) -> Result<Option<&mut [u8]>, TwmError> {
        self.scope.host_bytes_mut(i)
    }

    /// [`DeviceAccess::host_slices_mut`] of the scope.
    pub fn host_slices_mut<P: bytemuck::Pod>(&mut self) -> Result<Option<Vec<&mut [P]>>, TwmError> {
        self.scope.host_slices_mut()
    }
}

impl<T: 'static, B: Backend> fmt::Debug for RunScope<'_, T, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RunScope").field(&self.scope).finish()
    }
}

impl<T: 'static, B: Backend> DeviceAccess<'_, T, B> {
    /// The `i`-th range (in the order given), as device pointers valid while the scope is open.
    #[must_use]
    pub fn slice(&self, i: usize) -> Option<ScopedSlice<'_>> {
        self.entries.get(i).map(|e| ScopedSlice {
            slice: GuestSlice::new(e.slice),
            access: e.access,
        })
    }

    /// Every range, in the order given.
    pub fn slices(&self) -> impl ExactSizeIterator<Item = ScopedSlice<'_>> + '_ {
        self.entries.iter().map(|e| ScopedSlice {
            slice: GuestSlice::new(e.slice),
            access: e.access,
        })
    }

    /// The bytes of the `i`-th range on the host, for a kernel that runs on the CPU (a
    /// fallback, or the simulated device): first waits for the stream, so no kernel launched on
    /// it is still writing them. `None` for an unknown index or a backing the host cannot
    /// access. One range at a time (the scope is borrowed mutably), so two overlapping ranges
    /// never give two mutable views.
    pub fn host_bytes_mut(&mut self, i: usize) -> Result<Option<&mut [u8]>, TwmError> {
        let Some(range) = self.entries.get(i).map(|e| e.range.clone()) else {
            return Ok(None);
        };
        let Some(ptr) = self.memory.host_ptr(range.start) else {
            return Ok(None);
        };
        self.memory
            .backend()?
            .synchronize(self.stream)
            .map_err(TwmError::backend)?;
        // SAFETY: the backing is host-accessible and `range` was checked to lie inside the
        // memory's visible size when the scope opened; the memory cannot shrink or go while the
        // scope holds its Store (and its buffer); the Store is held exclusively, so neither the
        // guest nor Wasmtime touches these bytes, and `&mut self` excludes any other view given
        // out by this scope; the stream was just waited for.
        Ok(Some(unsafe {
            std::slice::from_raw_parts_mut(ptr, range.len())
        }))
    }

    /// Every range on the host at once, as slices of `P` (bytes, `f32`, `u32`... any
    /// [`bytemuck::Pod`] type), in the order given, for a kernel that runs on the CPU: first
    /// waits for the stream. The ranges must not overlap ([`TwmError::OverlappingRanges`]),
    /// and each must be aligned to `P` and a whole number of them ([`TwmError::HostView`]).
    /// `None` for a backing the host cannot access.
    pub fn host_slices_mut<P: bytemuck::Pod>(&mut self) -> Result<Option<Vec<&mut [P]>>, TwmError> {
        // The non-empty ranges by start: two of them overlap only if some range overlaps the
        // next one in this order. (An empty range holds no byte, so it overlaps nothing; left
        // in the order it would stand between two ranges that overlap and hide them.)
        let mut order: Vec<usize> = (0..self.entries.len())
            .filter(|&i| !self.entries[i].range.is_empty())
            .collect();
        order.sort_by_key(|&i| self.entries[i].range.start);
        for pair in order.windows(2) {
            let (a, b) = (&self.entries[pair[0]].range, &self.entries[pair[1]].range);
            if b.start < a.end {
                return Err(TwmError::OverlappingRanges {
                    first: pair[0].min(pair[1]),
                    second: pair[0].max(pair[1]),
                });
            }
        }
        let mut bases = Vec::with_capacity(self.entries.len());
        for entry in &self.entries {
            let Some(ptr) = self.memory.host_ptr(entry.range.start) else {
                return Ok(None);
            };
            bases.push((ptr, entry.range.len()));
        }
        self.memory
            .backend()?
            .synchronize(self.stream)
            .map_err(TwmError::backend)?;
        bases
            .into_iter()
            .enumerate()
            .map(|(i, (ptr, len))| {
                // SAFETY: as in `host_bytes_mut`: each range lies inside the memory's visible
                // size, checked when the scope opened; the memory cannot shrink or go while the
                // scope holds its Store; the stream was just waited for; and the ranges were
                // checked pairwise disjoint above, so no byte is in two of these slices, and
                // `&mut self` excludes every other view this scope lends.
                let bytes = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
                bytemuck::try_cast_slice_mut(bytes).map_err(|e| TwmError::HostView {
                    range: i,
                    element: std::any::type_name::<P>(),
                    reason: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// The tenant's stream: launch the kernels that use the ranges on it.
    #[must_use]
    pub fn stream(&self) -> &Stream {
        self.stream
    }

    /// The device the memory and the stream are on.
    #[must_use]
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Waits for the stream (every kernel launched on it), undoes the scope's read-mostly
    /// advice, prefetches written ranges back to the host if asked, and gives the Store back. A
    /// failure of the kernel reported by the driver at the wait is returned typed; the Store is
    /// given back all the same.
    pub fn close(mut self) -> Result<(), TwmError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<(), TwmError> {
        if !self.open {
            return Ok(());
        }
        self.open = false;
        // Whatever the wait says (or if it panics): nothing the scope queued runs any more, or
        // the device is fenced and it never will; the work ends after the wait.
        let _end = EndScopeWork::of(self.guest);
        self.wait_and_undo()
    }

    fn wait_and_undo(&mut self) -> Result<(), TwmError> {
        let backend = self.memory.backend()?;
        let waited = self.wait(&*backend);
        let mut result = waited;
        for range in std::mem::take(&mut self.advised) {
            let unset = self.memory.advise(&range, Advice::UnsetReadMostly);
            result = result.and(unset);
        }
        if self.write_back && result.is_ok() && backend.capabilities().concurrent_managed_access {
            for e in self
                .entries
                .iter()
                .filter(|e| e.access.writes() && !e.range.is_empty())
            {
                let back = self.memory.prefetch(&e.range, Location::Host, self.stream);
                result = result.and(back);
            }
            // Whatever was queued is waited for, even after a failed prefetch.
            let waited = self.wait(&*backend);
            result = result.and(waited);
        }
        result
    }

    /// Waits for the stream, trying again after a refusal that may pass
    /// (`lifecycle::wait_for_work`). A wait still refused (not a lost context, whose work never
    /// runs) leaves work that may still write the memory: the Store's memories are then kept
    /// when it goes, never scrubbed for another tenant under it.
    fn wait(&self, backend: &B) -> Result<(), TwmError> {
        crate::lifecycle::wait_for_work(backend, self.stream.key()).map_err(|e| {
            if tensor_wasm_mem_core::BackendError::kind(&e)
                != tensor_wasm_mem_core::ErrorKind::ContextLost
            {
                self.guest.work_may_run();
            }
            TwmError::backend(e)
        })
    }
}

impl<T: 'static, B: Backend> Drop for DeviceAccess<'_, T, B> {
    /// Waits as [`close`](DeviceAccess::close) does (on an error or a panic path too), so the
    /// Store is never given back while a kernel may still write its memory.
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::warn!(error = %e, "twm: closing a device-access scope failed");
        }
    }
}
