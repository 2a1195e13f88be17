#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

#[path = "../../cuda-common/cuda_driver.rs"]
mod cuda;
mod driver;
mod error;

use std::fmt;

use cust::sys;
use tensor_wasm_mem_core::{Advice, DeviceId, DriverApi, DriverBackend, Location};

pub use cuda::DeviceInfo;
pub use error::CustError;
/// A driver call that failed.
pub use tensor_wasm_mem_core::CudaCallError as DriverError;

/// The CUDA driver through cust's bindings: the raw calls [`DriverBackend`] builds the backend on.
pub struct CustDriver {
    devices: cuda::Devices,
}

/// The cust backend: [`DriverBackend`] on [`CustDriver`].
pub type CustBackend = DriverBackend<CustDriver>;

impl fmt::Debug for CustDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CustDriver")
            .field("driver_version", &self.devices.version())
            .field("devices", &self.devices.infos().collect::<Vec<_>>())
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
        Ok(Self {
            devices: cuda::Devices::start()?,
        })
    }

    /// The driver version (`cuDriverGetVersion`).
    #[must_use]
    pub fn driver_version(&self) -> i32 {
        self.devices.version()
    }

    /// The devices driven.
    pub fn devices(&self) -> impl Iterator<Item = &DeviceInfo> {
        self.devices.infos()
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

// SAFETY: the shared calls (`cuda::common_driver_api`): `alloc_managed` returns what
// cuMemAllocManaged returned (attached globally) for exactly `bytes` bytes: managed memory, host-
// and device-accessible at that address, aligned far beyond MIN_ALIGN, disjoint from other live
// allocations; `zero` is cuMemsetD8Async of exactly the range followed by a synchronise; device
// facts are read from the device attributes.
unsafe impl DriverApi for CustDriver {
    type Error = CustError;

    cuda::common_driver_api!(CustError);

    fn advise(&self, ptr: u64, len: usize, advice: Advice) -> Result<(), CustError> {
        // Advice without a location ignores the device argument.
        let device = advice.location().map_or(0, device_number);
        Ok(driver::advise(ptr, len, cuda::advice(advice), device)?)
    }

    fn prefetch(&self, ptr: u64, len: usize, to: Location, stream: u64) -> Result<(), CustError> {
        Ok(driver::prefetch(
            ptr,
            len,
            device_number(to),
            stream as usize,
        )?)
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
