#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub use tensor_wasm_mem_model::{
    Call, Event, Function, HeldCall, Hints, Kernel, ModelConfig, ModelDriver, ModelDropReport,
    ModelError, ModelStats, Module, code,
};

/// The simulated device backend: the core's [`DriverBackend`] (the code the cudarc and cust
/// backends run) over the simulated driver [`ModelDriver`]. Every check, table and counter is
/// `DriverBackend`'s; the driver's rules (contexts, streams whose work completes later, pools,
/// kernels, sticky faults) are the model's. Reach the model's inspection and fault injection
/// through [`DriverBackend::driver`].
pub type MockBackend = DriverBackend<ModelDriver>;

/// How the simulated machine looks: the model's configuration.
pub type MockConfig = ModelConfig;

/// The mock backend's error: the model's.
pub type MockError = ModelError;

pub use tensor_wasm_mem_core::DriverBackend;

/// A mock backend over a fresh simulated machine as `config` describes.
#[must_use]
pub fn with_config(config: MockConfig) -> MockBackend {
    MockBackend::new(ModelDriver::new(config))
}
