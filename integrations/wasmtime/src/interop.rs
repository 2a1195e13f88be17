//! A driver library's own types over an open device-access scope, for an embedder whose kernels
//! are written with that library.
//!
//! # cudarc (feature `cudarc`)
//!
//! `cudarc::CudarcScope::new` (unsafe: cudarc hands the stream out as an `Arc`, which a caller
//! could clone past the scope) borrows an open [`DeviceAccess`](crate::DeviceAccess): cudarc's context for the
//! scope's device (its primary context, retained by cudarc and released when dropped), the
//! tenant's stream as a *borrowed* `CudaStream` (dropping it destroys nothing), and each range as
//! a `CudaSlice` that cudarc never frees (a `cudarc::GuestCudaSlice`, tied to the scope's
//! borrow, so none outlives the scope; writing needs a range opened for writing). Launch with
//! cudarc's own API (`launch_builder`) on that stream; the scope's close waits for it.
//!
//! Where cudarc cannot borrow what the scope holds, the answer is a typed
//! [`TwmError::Interop`](crate::TwmError::Interop): a context-isolated tenant's stream lives in a context of the tenant's
//! own, which cudarc can only take ownership of (`CudaContext::from_raw_context` destroys it on
//! drop), so those tenants launch with raw driver calls on [`DeviceAccess::stream`](crate::DeviceAccess::stream) instead.
//!
//! The layer's own driver calls keep to raw integers; what cudarc's calls return is cudarc's
//! `DriverError`, as for any cudarc program.
//!
//! # cust
//!
//! cust 0.3 has no way to borrow a stream or memory it did not create (`Stream` and
//! `DeviceBuffer` own and destroy theirs), so there is no cust view: a cust embedder launches
//! with the scope's raw stream and device pointers (see `tests/tests/guest_kernels.rs`).

#[cfg(feature = "cudarc")]
#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
pub mod cudarc {
    //! cudarc's types over an open scope (see the [module docs](super)).

    use std::marker::PhantomData;
    use std::mem::ManuallyDrop;
    use std::sync::Arc;

    use tensor_wasm_mem_cudarc::cudarc::driver::{
        CudaContext, CudaSlice, CudaStream, CudaViewMut, DeviceRepr,
    };

    use crate::{Access, Backend, DeviceAccess, TwmError};

    /// cudarc's context and the tenant's stream, borrowed from an open scope for `'a`.
    #[derive(Debug)]
    pub struct CudarcScope<'a> {
        context: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        slices: Vec<(u64, u64, Access)>,
        _scope: PhantomData<&'a ()>,
    }

    impl<'a> CudarcScope<'a> {
        /// cudarc's view of `scope`: its device's context (as cudarc's `CudaContext`, which
        /// binds it to the calling thread: cudarc's rule, and the calling thread's current
        /// context afterwards), the tenant's stream (borrowed) and its ranges.
        ///
        /// A context-isolated tenant's scope is [`TwmError::Interop`] (see the module docs).
        ///
        /// # Safety
        ///
        /// cudarc's API lets its values be used beyond what a borrow can hold, so the caller
        /// promises two things:
        /// - every cudarc operation on the slices and views (kernel launches, copies, memsets)
        ///   is queued on [`stream`](Self::stream): the scope's close waits for that stream
        ///   only, and work on any other stream could still write the guest's memory after the
        ///   close (under the host's view of it, or in the next tenant's slot);
        /// - no clone of [`stream`](Self::stream) (an `Arc`, as cudarc's launch builder needs),
        ///   nor anything cudarc made from it or from the slices (events, views, owned copies),
        ///   is kept past the scope's close: the tenant's stream is then released, and its handle
        ///   stale (the driver may hand the same value to another tenant's stream).
        pub unsafe fn new<T: 'static, B: Backend>(
            scope: &'a DeviceAccess<'_, T, B>,
        ) -> Result<Self, TwmError> {
            let ordinal = scope.device().0 as usize;
            // A driver failure keeps its code and kind (a lost context is `ContextLost`).
            let context = CudaContext::new(ordinal).map_err(|e| {
                TwmError::backend(tensor_wasm_mem_cudarc::CudarcError::Driver(
                    tensor_wasm_mem_cudarc::DriverError {
                        call: "cuDevicePrimaryCtxRetain (cudarc's CudaContext::new)",
                        code: e.0 as u32,
                    },
                ))
            })?;
            let raw_context = context.cu_ctx() as usize as u64;
            if scope.stream().context() != raw_context {
                return Err(TwmError::Interop(
                    "the tenant's stream is in a context of its own (context isolation), which \
                     cudarc cannot borrow: launch on DeviceAccess::stream with raw driver calls"
                        .into(),
                ));
            }
            // Everything cudarc makes here runs on the one stream the scope waits for: no event
            // tracking (cudarc's own ordering across streams) is needed, and without it making a
            // slice calls nothing that could fail (cudarc unwraps its event creation).
            // SAFETY: only this `CudaContext` value is affected (every cudarc object made from
            // it), and by the contract above all its work is on the tenant's one stream.
            unsafe { context.disable_event_tracking() };
            let raw_stream = scope.stream().raw() as usize as *mut _;
            // SAFETY: the stream is the tenant's live stream in `context` (checked just now);
            // the scope keeps it alive for `'a` (it is released after the scope closes, which
            // needs this borrow to have ended), and every `Arc` of the wrapper is dropped with
            // `Self`, whose lifetime is the borrow's. Work submitted through cudarc is ordered on
            // that same stream, and the scope's close waits for it.
            let stream = unsafe { context.wrap_borrowed_stream(raw_stream) };
            let slices = scope
                .slices()
                .map(|s| (s.device_ptr(), s.len() as u64, s.access()))
                .collect();
            Ok(Self {
                context,
                stream,
                slices,
                _scope: PhantomData,
            })
        }

        /// cudarc's context of the scope's device.
        #[must_use]
        pub fn context(&self) -> &Arc<CudaContext> {
            &self.context
        }

        /// The tenant's stream, borrowed: launch on it.
        #[must_use]
        pub fn stream(&self) -> &Arc<CudaStream> {
            &self.stream
        }

        /// Range `i` of the scope as a `CudaSlice<E>` of `len / size_of::<E>()` elements (the
        /// range's length must be a multiple), for reading; `None` for no such range. `E` is a
        /// type every byte pattern is a value of (`bytemuck::AnyBitPattern`: `u8`, `f32`,
        /// `u32`..., not `bool`): the guest wrote the bytes.
        pub fn slice<E: DeviceRepr + bytemuck::AnyBitPattern>(
            &self,
            i: usize,
        ) -> Option<Result<GuestCudaSlice<'_, E>, TwmError>> {
            self.view(i, false)
        }

        /// Range `i` as [`slice`](Self::slice) does, for writing: a range opened write or
        /// read-write ([`Access`]); a read-only one is [`TwmError::Interop`]. Two calls give two
        /// writable views of one range, as two kernels may write one buffer: ordering them is
        /// the stream's (both on [`stream`](Self::stream)), not the borrow checker's.
        pub fn slice_mut<E: DeviceRepr + bytemuck::AnyBitPattern>(
            &self,
            i: usize,
        ) -> Option<Result<GuestCudaSlice<'_, E>, TwmError>> {
            self.view(i, true)
        }

        fn view<E: DeviceRepr + bytemuck::AnyBitPattern>(
            &self,
            i: usize,
            write: bool,
        ) -> Option<Result<GuestCudaSlice<'_, E>, TwmError>> {
            let &range = self.slices.get(i)?;
            Some(self.upgrade(i, range, write))
        }

        /// Range `i`, `(ptr, bytes, access)`, as a `CudaSlice<E>`, checked for `write`, whole
        /// elements and alignment.
        fn upgrade<E: DeviceRepr + bytemuck::AnyBitPattern>(
            &self,
            i: usize,
            (ptr, bytes, access): (u64, u64, Access),
            write: bool,
        ) -> Result<GuestCudaSlice<'_, E>, TwmError> {
            if write && access == Access::Read {
                return Err(TwmError::Interop(format!("range {i} was opened read-only")));
            }
            let size = std::mem::size_of::<E>() as u64;
            if size == 0 || bytes % size != 0 {
                return Err(TwmError::Interop(format!(
                    "range {i} ({bytes} bytes) is not a whole number of {size}-byte elements"
                )));
            }
            let align = std::mem::align_of::<E>() as u64;
            if ptr % align != 0 {
                return Err(TwmError::Interop(format!(
                    "range {i} starts at an address not aligned to {align} bytes"
                )));
            }
            let len = usize::try_from(bytes / size)
                .map_err(|_| TwmError::Interop(format!("range {i} is too long")))?;
            // SAFETY: `ptr..ptr + bytes` is a checked range of the guest's live memory, valid
            // for the scope's borrow (which the returned value keeps); `E` is plain data that
            // every byte pattern is a valid value of (`AnyBitPattern`: guest memory holds what
            // the guest wrote, so not `bool`, whose byte 2 would be undefined behaviour). The
            // slice is never freed by cudarc: `GuestCudaSlice` leaks it when dropped.
            let slice = unsafe { self.stream.upgrade_device_ptr::<E>(ptr, len) };
            Ok(GuestCudaSlice {
                slice: ManuallyDrop::new(slice),
                writable: write,
                _scope: PhantomData,
            })
        }
    }

    /// A range of guest memory as cudarc's `CudaSlice<E>`, valid while its scope is open, never
    /// freed by cudarc (the guest's memory is the layer's). Pass [`get`](Self::get) to cudarc's
    /// launch builder for a kernel that reads it, `&mut` [`view_mut`](Self::view_mut) for one
    /// that writes it. The slice itself is never handed out mutably: a `&mut CudaSlice` could
    /// be swapped for another, and the guest's memory would then escape the scope as a slice
    /// cudarc frees.
    #[derive(Debug)]
    pub struct GuestCudaSlice<'a, E> {
        slice: ManuallyDrop<CudaSlice<E>>,
        writable: bool,
        _scope: PhantomData<&'a ()>,
    }

    impl<E> GuestCudaSlice<'_, E> {
        /// The slice, for cudarc calls that read it.
        #[must_use]
        pub fn get(&self) -> &CudaSlice<E> {
            &self.slice
        }

        /// A mutable view of the slice, for cudarc calls that write it (a kernel argument,
        /// `memcpy_htod`): `None` for a read-only range.
        pub fn view_mut(&mut self) -> Option<CudaViewMut<'_, E>> {
            if self.writable {
                Some(self.slice.as_view_mut())
            } else {
                None
            }
        }
    }

    impl<E> Drop for GuestCudaSlice<'_, E> {
        fn drop(&mut self) {
            // SAFETY: taken once, here, and never used again.
            let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
            // The device pointer is the guest's memory: never freed by cudarc.
            let _ = slice.leak();
        }
    }
}
