#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod driver;
mod error;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys::{CUdevice, CUdevice_attribute, CUmem_advise};
use tensor_wasm_mem_core::{
    Advice, Advisor, Allocation, Capabilities, DEFAULT_STREAM, DeviceId, ErrorType, IsolationLevel,
    Location, ManagedAllocator, Stream, StreamProvider, TenantId,
};

pub use error::{CudarcError, DriverError};

/// Where the driver library comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DriverSource {
    /// The system's `libcuda` (found by name, as cudarc searches for it).
    #[default]
    System,
    /// The system's `libcuda` if one loads; otherwise the library at this path, which must have
    /// the SONAME `libcuda.so.1` (it is loaded first, so cudarc's search by name finds it). Used
    /// to run on a simulated driver where there is no GPU; on a GPU machine the real driver wins.
    SystemOr(PathBuf),
}

/// Entry-point and device facts read at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device.
    pub id: DeviceId,
    /// Its name.
    pub name: String,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`.
    pub concurrent_managed_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`.
    pub pageable_memory_access: bool,
}

/// The driver library: found (and, for [`DriverSource::SystemOr`], preloaded) once per process.
static PRELOADED: OnceLock<Result<(), String>> = OnceLock::new();

fn locate(source: &DriverSource) -> Result<(), CudarcError> {
    if driver::library_present() {
        return Ok(());
    }
    let DriverSource::SystemOr(path) = source else {
        return Err(CudarcError::DriverNotFound(
            "libcuda did not load by any of cudarc's names (is the NVIDIA driver installed, \
             and on the loader path?)"
                .into(),
        ));
    };
    let preloaded = PRELOADED.get_or_init(|| preload(path));
    preloaded.clone().map_err(CudarcError::DriverNotFound)?;
    if driver::library_present() {
        Ok(())
    } else {
        Err(CudarcError::DriverNotFound(format!(
            "{} loaded, but libcuda is still not found by name: its SONAME must be libcuda.so.1",
            path.display()
        )))
    }
}

fn preload(path: &Path) -> Result<(), String> {
    // SAFETY: loading a library runs its initialisers; the caller chose this driver library.
    match unsafe { libloading::Library::new(path) } {
        Ok(lib) => {
            // Keep it loaded for the life of the process: cudarc's own handle refers to it by
            // SONAME.
            std::mem::forget(lib);
            Ok(())
        }
        Err(e) => Err(format!(
            "no system libcuda, and {} did not load: {e}",
            path.display()
        )),
    }
}

#[derive(Debug)]
struct Device {
    info: DeviceInfo,
    cu: CUdevice,
    primary: usize,
    /// The stream zeroing runs on.
    scrub_stream: usize,
}

#[derive(Debug)]
struct StreamRecord {
    tenant: TenantId,
    context: usize,
    level: IsolationLevel,
}

#[derive(Debug, Default)]
struct State {
    /// base -> (len, device index)
    allocations: HashMap<u64, (usize, usize)>,
    streams: HashMap<u64, StreamRecord>,
    /// tenant -> (context, live streams in it)
    contexts: HashMap<TenantId, (usize, u64)>,
    stats: CudarcStats,
}

/// Counters of a [`CudarcBackend`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudarcStats {
    /// Allocations alive.
    pub live_allocations: u64,
    /// Bytes in them.
    pub live_bytes: u64,
    /// Streams alive (the shared default stream not counted).
    pub live_streams: u64,
    /// Per-tenant contexts alive.
    pub live_contexts: u64,
    /// Allocations, streams and contexts still alive when the backend dropped (then freed).
    pub leaked_at_drop: u64,
}

/// CUDA managed memory through cudarc.
///
/// Start-up never panics: a missing driver, a driver lacking an entry point, no device, or a
/// device without managed memory is a typed [`CudarcError`].
pub struct CudarcBackend {
    devices: Vec<Device>,
    caps: Capabilities,
    version: i32,
    state: Mutex<State>,
}

impl fmt::Debug for CudarcBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudarcBackend")
            .field("driver_version", &self.version)
            .field(
                "devices",
                &self.devices.iter().map(|d| &d.info).collect::<Vec<_>>(),
            )
            .field("capabilities", &self.caps)
            .finish_non_exhaustive()
    }
}

impl CudarcBackend {
    /// Starts on the system's CUDA driver.
    pub fn new() -> Result<Self, CudarcError> {
        Self::with_driver(&DriverSource::System)
    }

    /// Starts on the driver `source` names.
    pub fn with_driver(source: &DriverSource) -> Result<Self, CudarcError> {
        locate(source)?;
        if let Some(symbol) = driver::missing_symbol() {
            return Err(CudarcError::MissingSymbol { symbol });
        }
        match driver::init() {
            Err(e) if e.result == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => {
                return Err(CudarcError::NoDevice);
            }
            other => other?,
        }
        let version = driver::driver_version()?;
        let count = driver::device_count()?;
        if count <= 0 {
            return Err(CudarcError::NoDevice);
        }
        let mut backend = Self {
            devices: Vec::new(),
            caps: Capabilities {
                host_accessible: true,
                device_accessible: true,
                managed: true,
                comes_zeroed: false,
                guard_pages: false,
                concurrent_managed_access: true,
                pageable_memory_access: true,
            },
            version,
            state: Mutex::new(State::default()),
        };
        // Devices pushed so far are released by `Drop` if a later one fails.
        for ordinal in 0..count {
            let id = DeviceId(ordinal as u32);
            let cu = driver::device(ordinal)?;
            let attr = |a| driver::attribute(cu, a).map(|v| v != 0);
            if !attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)? {
                return Err(CudarcError::NoManagedMemory { device: id });
            }
            let info = DeviceInfo {
                id,
                name: driver::device_name(cu)?,
                concurrent_managed_access: attr(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
                )?,
                pageable_memory_access: attr(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
                )?,
            };
            backend.caps.concurrent_managed_access &= info.concurrent_managed_access;
            backend.caps.pageable_memory_access &= info.pageable_memory_access;
            let primary = driver::primary_context_retain(cu)?;
            let scrub_stream = driver::set_current(primary).and_then(|()| driver::stream_create());
            let scrub_stream = match scrub_stream {
                Ok(s) => s,
                Err(e) => {
                    let _ = driver::primary_context_release(cu);
                    return Err(e.into());
                }
            };
            backend.devices.push(Device {
                info,
                cu,
                primary,
                scrub_stream,
            });
        }
        Ok(backend)
    }

    /// The driver version (`cuDriverGetVersion`, e.g. 12080).
    #[must_use]
    pub fn driver_version(&self) -> i32 {
        self.version
    }

    /// The devices driven.
    pub fn devices(&self) -> impl Iterator<Item = &DeviceInfo> {
        self.devices.iter().map(|d| &d.info)
    }

    /// A snapshot of the counters.
    #[must_use]
    pub fn stats(&self) -> CudarcStats {
        self.state().stats
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn device(&self, id: DeviceId) -> Result<&Device, CudarcError> {
        self.devices
            .get(id.0 as usize)
            .ok_or(CudarcError::InvalidDevice {
                device: id,
                count: self.devices.len() as u32,
            })
    }

    /// The device ordinal a location names (`None`: the host), checked.
    fn location(&self, location: Location) -> Result<Option<i32>, CudarcError> {
        match location {
            Location::Host => Ok(None),
            Location::Device(id) => self.device(id).map(|_| Some(id.0 as i32)),
        }
    }

    /// The device index of a live allocation of ours, after checking the range.
    fn checked(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(usize, std::ops::Range<usize>), CudarcError> {
        let address = allocation.device_ptr();
        let device = match self.state().allocations.get(&address) {
            Some(&(l, d)) if l == allocation.len() => d,
            _ => return Err(CudarcError::UnknownAllocation { address }),
        };
        Ok((device, allocation.range(offset, len)?))
    }

    /// The context a stream handle belongs to, if this backend handed it out.
    fn stream_context(&self, stream: &Stream) -> Result<usize, CudarcError> {
        if stream.raw() == DEFAULT_STREAM {
            if stream.is_shared() {
                return Ok(self.devices[0].primary);
            }
        } else if let Some(r) = self.state().streams.get(&stream.raw())
            && r.tenant == stream.tenant()
            && r.context as u64 == stream.context()
        {
            return Ok(r.context);
        }
        Err(CudarcError::UnknownStream { raw: stream.raw() })
    }
}

impl ErrorType for CudarcBackend {
    type Error = CudarcError;
}

// SAFETY: `allocate` returns what cuMemAllocManaged returned for exactly `bytes` bytes (managed
// memory is host- and device-accessible through the same address, aligned far beyond MIN_ALIGN,
// disjoint from other allocations); `zero` checks the range against our allocation table before
// the driver writes; capabilities are read from the devices (comes_zeroed is false: the driver
// does not zero; no guard pages).
unsafe impl ManagedAllocator for CudarcBackend {
    fn capabilities(&self) -> Capabilities {
        self.caps
    }

    fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    fn allocate(&self, device: DeviceId, bytes: usize) -> Result<Allocation, CudarcError> {
        if bytes == 0 {
            return Err(CudarcError::InvalidArgument("allocation size is zero"));
        }
        let d = self.device(device)?;
        driver::set_current(d.primary)?;
        let address = driver::alloc_managed(bytes)?;
        let Some(ptr) = NonNull::new(address as usize as *mut u8) else {
            return Err(CudarcError::InvalidArgument(
                "the driver returned a null pointer",
            ));
        };
        let mut state = self.state();
        state
            .allocations
            .insert(address, (bytes, device.0 as usize));
        state.stats.live_allocations += 1;
        state.stats.live_bytes += bytes as u64;
        // SAFETY: a fresh managed allocation of `bytes` bytes, owned by this handle until freed.
        Ok(unsafe { Allocation::from_raw_parts(ptr, bytes, device) })
    }

    unsafe fn free(&self, allocation: Allocation) -> Result<(), CudarcError> {
        let (device, _) = self.checked(&allocation, 0, 0)?;
        let address = allocation.device_ptr();
        driver::set_current(self.devices[device].primary)?;
        // SAFETY: `address` is the base of a live allocation of ours (checked above), and the
        // caller guarantees it is not used afterwards.
        unsafe { driver::free(address) }?;
        let mut state = self.state();
        if let Some((len, _)) = state.allocations.remove(&address) {
            state.stats.live_allocations -= 1;
            state.stats.live_bytes -= len as u64;
        }
        Ok(())
    }

    unsafe fn zero(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), CudarcError> {
        let (device, range) = self.checked(allocation, offset, len)?;
        if range.is_empty() {
            return Ok(());
        }
        let d = &self.devices[device];
        driver::set_current(d.primary)?;
        // SAFETY: the range lies inside a live allocation of ours (checked); the caller
        // guarantees nothing else accesses it meanwhile.
        unsafe {
            driver::zero(
                allocation.device_ptr() + range.start as u64,
                range.len(),
                d.scrub_stream,
            )
        }?;
        Ok(())
    }
}

fn cu_advice(advice: Advice) -> CUmem_advise {
    match advice {
        Advice::SetReadMostly => CUmem_advise::CU_MEM_ADVISE_SET_READ_MOSTLY,
        Advice::UnsetReadMostly => CUmem_advise::CU_MEM_ADVISE_UNSET_READ_MOSTLY,
        Advice::SetPreferredLocation(_) => CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
        Advice::UnsetPreferredLocation => CUmem_advise::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION,
        Advice::SetAccessedBy(_) => CUmem_advise::CU_MEM_ADVISE_SET_ACCESSED_BY,
        Advice::UnsetAccessedBy(_) => CUmem_advise::CU_MEM_ADVISE_UNSET_ACCESSED_BY,
    }
}

impl Advisor for CudarcBackend {
    fn advise(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
        advice: Advice,
    ) -> Result<(), CudarcError> {
        let (device, range) = self.checked(allocation, offset, len)?;
        let target = match advice.location() {
            Some(l) => self.location(l)?,
            None => None,
        };
        if range.is_empty() {
            return Ok(());
        }
        driver::set_current(self.devices[device].primary)?;
        driver::advise(
            allocation.device_ptr() + range.start as u64,
            range.len(),
            cu_advice(advice),
            target,
        )?;
        Ok(())
    }

    fn prefetch(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
        to: Location,
        stream: &Stream,
    ) -> Result<(), CudarcError> {
        let (_, range) = self.checked(allocation, offset, len)?;
        let target = self.location(to)?;
        if let Location::Device(device) = to
            && !self.devices[device.0 as usize]
                .info
                .concurrent_managed_access
        {
            return Err(CudarcError::Unsupported {
                device,
                what: "prefetch to the device (no concurrent managed access)",
            });
        }
        let context = self.stream_context(stream)?;
        if range.is_empty() {
            return Ok(());
        }
        driver::set_current(context)?;
        driver::prefetch(
            allocation.device_ptr() + range.start as u64,
            range.len(),
            target,
            stream.raw() as usize,
        )?;
        Ok(())
    }
}

impl StreamProvider for CudarcBackend {
    fn acquire_stream(
        &self,
        tenant: TenantId,
        level: IsolationLevel,
    ) -> Result<Stream, CudarcError> {
        let device = &self.devices[0];
        let context = match level {
            IsolationLevel::Shared => {
                return Ok(Stream::new(
                    DEFAULT_STREAM,
                    device.primary as u64,
                    level,
                    tenant,
                ));
            }
            IsolationLevel::StreamIsolated => device.primary,
            IsolationLevel::ContextIsolated => {
                let existing = self.state().contexts.get(&tenant).map(|c| c.0);
                match existing {
                    Some(ctx) => ctx,
                    None => {
                        let ctx = driver::context_create(device.cu)?;
                        let mut state = self.state();
                        state.contexts.insert(tenant, (ctx, 0));
                        state.stats.live_contexts += 1;
                        ctx
                    }
                }
            }
        };
        let created = driver::set_current(context).and_then(|()| driver::stream_create());
        let mut state = self.state();
        let raw = match created {
            Ok(raw) => raw,
            Err(e) => {
                // A context made for this stream alone goes again.
                if let Some(&(ctx, 0)) = state.contexts.get(&tenant)
                    && level == IsolationLevel::ContextIsolated
                {
                    state.contexts.remove(&tenant);
                    state.stats.live_contexts -= 1;
                    let _ = driver::context_destroy(ctx);
                }
                return Err(e.into());
            }
        };
        if level == IsolationLevel::ContextIsolated
            && let Some(entry) = state.contexts.get_mut(&tenant)
        {
            entry.1 += 1;
        }
        state.streams.insert(
            raw as u64,
            StreamRecord {
                tenant,
                context,
                level,
            },
        );
        state.stats.live_streams += 1;
        Ok(Stream::new(raw as u64, context as u64, level, tenant))
    }

    fn release_stream(&self, stream: Stream) -> Result<(), CudarcError> {
        let context = self.stream_context(&stream)?;
        if stream.raw() == DEFAULT_STREAM {
            return Ok(());
        }
        driver::set_current(context)?;
        driver::stream_destroy(stream.raw() as usize)?;
        let mut state = self.state();
        let Some(record) = state.streams.remove(&stream.raw()) else {
            return Ok(());
        };
        state.stats.live_streams -= 1;
        if record.level == IsolationLevel::ContextIsolated {
            let last = match state.contexts.get_mut(&record.tenant) {
                Some(entry) => {
                    entry.1 -= 1;
                    entry.1 == 0
                }
                None => false,
            };
            if last {
                state.contexts.remove(&record.tenant);
                state.stats.live_contexts -= 1;
                drop(state);
                driver::set_current(self.devices[0].primary)?;
                driver::context_destroy(record.context)?;
            }
        }
        Ok(())
    }

    fn synchronize(&self, stream: &Stream) -> Result<(), CudarcError> {
        let context = self.stream_context(stream)?;
        driver::set_current(context)?;
        driver::synchronize(stream.raw() as usize)?;
        Ok(())
    }
}

impl Drop for CudarcBackend {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let mut leaked = 0;
        for (raw, record) in state.streams.drain() {
            let _ = driver::set_current(record.context);
            let _ = driver::stream_destroy(raw as usize);
            leaked += 1;
        }
        for (_, (ctx, _)) in state.contexts.drain() {
            let _ = driver::context_destroy(ctx);
            leaked += 1;
        }
        for (address, (_, device)) in state.allocations.drain() {
            let _ = driver::set_current(self.devices[device].primary);
            // SAFETY: a live allocation of ours; the backend is going away, and with it every
            // handle that could use the memory (their lifetimes are bounded by the backend).
            let _ = unsafe { driver::free(address) };
            leaked += 1;
        }
        state.stats.leaked_at_drop += leaked;
        for d in &self.devices {
            let _ = driver::set_current(d.primary);
            let _ = driver::stream_destroy(d.scrub_stream);
            let _ = driver::primary_context_release(d.cu);
        }
    }
}
