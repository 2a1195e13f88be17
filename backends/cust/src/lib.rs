#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod driver;
mod error;

use std::fmt;

use cust::sys::{CUdevice, CUdevice_attribute, CUmem_advise};
use tensor_wasm_mem_core::{Advice, DeviceFacts, DeviceId, DriverApi, DriverBackend, Location};

pub use error::{CustError, DriverError};

/// Facts about one device, read at start-up.
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

#[derive(Debug)]
struct Device {
    info: DeviceInfo,
    cu: CUdevice,
    primary: usize,
    scrub_stream: usize,
}

/// The CUDA driver through cust's bindings: the raw calls [`DriverBackend`] builds the backend on.
pub struct CustDriver {
    devices: Vec<Device>,
    version: i32,
}

/// The cust backend: [`DriverBackend`] on [`CustDriver`].
pub type CustBackend = DriverBackend<CustDriver>;

impl fmt::Debug for CustDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CustDriver")
            .field("driver_version", &self.version)
            .field(
                "devices",
                &self.devices.iter().map(|d| &d.info).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// Starts the cust backend. (libcuda is linked at link time: a binary using this backend does
/// not load at all without a `libcuda.so.1`.)
pub fn start() -> Result<CustBackend, CustError> {
    CustDriver::start().map(DriverBackend::new)
}

impl CustDriver {
    /// Initialises the driver and retains every device's primary context.
    pub fn start() -> Result<Self, CustError> {
        match driver::init() {
            Err(e) if e.code == 100 => return Err(CustError::NoDevice),
            other => other?,
        }
        let version = driver::driver_version()?;
        let count = driver::device_count()?;
        if count <= 0 {
            return Err(CustError::NoDevice);
        }
        // Devices pushed so far are released by `Drop` if a later one fails.
        let mut this = Self {
            devices: Vec::new(),
            version,
        };
        for ordinal in 0..count {
            let id = DeviceId(ordinal as u32);
            let cu = driver::device(ordinal)?;
            if !driver::attribute(cu, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)? {
                return Err(CustError::NoManagedMemory { device: id });
            }
            let info = DeviceInfo {
                id,
                name: driver::device_name(cu)?,
                concurrent_managed_access: driver::attribute(
                    cu,
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
                )?,
                pageable_memory_access: driver::attribute(
                    cu,
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
                )?,
            };
            let primary = driver::primary_context_retain(cu)?;
            let scrub_stream =
                match driver::set_current(primary).and_then(|()| driver::stream_create()) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = driver::primary_context_release(cu);
                        return Err(e.into());
                    }
                };
            this.devices.push(Device {
                info,
                cu,
                primary,
                scrub_stream,
            });
        }
        Ok(this)
    }

    /// The driver version (`cuDriverGetVersion`).
    #[must_use]
    pub fn driver_version(&self) -> i32 {
        self.version
    }

    /// The devices driven.
    pub fn devices(&self) -> impl Iterator<Item = &DeviceInfo> {
        self.devices.iter().map(|d| &d.info)
    }

    fn device(&self, id: DeviceId) -> &Device {
        // `DriverBackend` checks every device id against `device_count` before asking.
        &self.devices[id.0 as usize]
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

/// The CUDA 11 device-number form of a location: `-1` (`CU_DEVICE_CPU`) for the host, `n` for
/// device `n`. Every `Location` the core has maps exactly; what the CUDA 12 `CUmemLocation` adds
/// (host NUMA nodes) has no form here, and would be lost if `Location` grew it.
pub fn device_number(location: Location) -> i32 {
    match location {
        Location::Host => driver::DEVICE_CPU,
        Location::Device(d) => d.0 as i32,
    }
}

// SAFETY: `alloc_managed` returns what cuMemAllocManaged returned (attached globally) for exactly
// `bytes` bytes: managed memory, host- and device-accessible at that address, aligned far beyond
// MIN_ALIGN, disjoint from other live allocations; `zero` is cuMemsetD8Async of exactly the range
// followed by a synchronise; device facts are read from the device attributes.
unsafe impl DriverApi for CustDriver {
    type Error = CustError;

    fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    fn device_facts(&self, device: DeviceId) -> DeviceFacts {
        let info = &self.device(device).info;
        DeviceFacts {
            concurrent_managed_access: info.concurrent_managed_access,
            pageable_memory_access: info.pageable_memory_access,
        }
    }

    fn primary_context(&self, device: DeviceId) -> u64 {
        self.device(device).primary as u64
    }

    fn set_current(&self, context: u64) -> Result<(), CustError> {
        Ok(driver::set_current(context as usize)?)
    }

    fn alloc_managed(&self, _device: DeviceId, bytes: usize) -> Result<u64, CustError> {
        Ok(driver::alloc_managed(bytes)?)
    }

    unsafe fn free(&self, ptr: u64) -> Result<(), CustError> {
        // SAFETY: guaranteed by the caller.
        Ok(unsafe { driver::free(ptr) }?)
    }

    unsafe fn zero(&self, device: DeviceId, ptr: u64, len: usize) -> Result<(), CustError> {
        // SAFETY: guaranteed by the caller; the zeroing stream belongs to the device's primary
        // context, which is current.
        Ok(unsafe { driver::zero(ptr, len, self.device(device).scrub_stream) }?)
    }

    fn advise(&self, ptr: u64, len: usize, advice: Advice) -> Result<(), CustError> {
        // Advice without a location ignores the device argument.
        let device = advice.location().map_or(0, device_number);
        Ok(driver::advise(ptr, len, cu_advice(advice), device)?)
    }

    fn prefetch(&self, ptr: u64, len: usize, to: Location, stream: u64) -> Result<(), CustError> {
        Ok(driver::prefetch(
            ptr,
            len,
            device_number(to),
            stream as usize,
        )?)
    }

    fn stream_create(&self) -> Result<u64, CustError> {
        Ok(driver::stream_create()? as u64)
    }

    fn stream_destroy(&self, stream: u64) -> Result<(), CustError> {
        Ok(driver::stream_destroy(stream as usize)?)
    }

    fn synchronize(&self, stream: u64) -> Result<(), CustError> {
        Ok(driver::synchronize(stream as usize)?)
    }

    fn context_create(&self, device: DeviceId) -> Result<u64, CustError> {
        Ok(driver::context_create(self.device(device).cu)? as u64)
    }

    fn context_destroy(&self, context: u64) -> Result<(), CustError> {
        Ok(driver::context_destroy(context as usize)?)
    }
}

impl Drop for CustDriver {
    fn drop(&mut self) {
        for d in &self.devices {
            let _ = driver::set_current(d.primary);
            let _ = driver::stream_destroy(d.scrub_stream);
            let _ = driver::primary_context_release(d.cu);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_map_onto_device_numbers() {
        assert_eq!(device_number(Location::Host), -1);
        assert_eq!(device_number(Location::Device(DeviceId(3))), 3);
    }
}
