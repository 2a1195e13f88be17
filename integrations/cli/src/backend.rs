//! The backends this build of `twm` can use, chosen with `--backend`.
//!
//! Without `--backend`, the first of the integration's `backends::ENABLED` that this build has
//! (see the table in docs/BACKENDS.md).

use std::fmt;

/// A backend compiled into this `twm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// Real GPUs through cudarc (the system's libcuda, loaded at run time).
    #[cfg(feature = "cudarc")]
    Cudarc,
    /// Real GPUs through cust (libcuda linked at link time).
    #[cfg(feature = "cust")]
    Cust,
    /// The simulated device in host memory.
    #[cfg(feature = "mock")]
    Mock,
    /// The reserved cuda-oxide slot (every operation answers NotYetWired).
    #[cfg(feature = "cuda-oxide")]
    #[value(name = "cuda-oxide")]
    CudaOxide,
}

impl BackendKind {
    /// The default backend of this build: the first of
    /// [`backends::ENABLED`](tensor_wasm_mem_wasmtime::backends::ENABLED), the one place the
    /// order of precedence is written.
    ///
    /// `ENABLED` lists the integration's features as cargo unified them (a test build may turn
    /// on more there than this `twm` has): the first that is a backend of this build wins.
    pub fn preferred() -> Self {
        tensor_wasm_mem_wasmtime::backends::ENABLED
            .iter()
            .find_map(|name| <Self as clap::ValueEnum>::from_str(name, false).ok())
            .expect("every backend feature of twm turns on the integration's feature of that name")
    }

    /// The stable name.
    pub const fn name(self) -> &'static str {
        match self {
            #[cfg(feature = "cudarc")]
            Self::Cudarc => "cudarc",
            #[cfg(feature = "cust")]
            Self::Cust => "cust",
            #[cfg(feature = "mock")]
            Self::Mock => "mock",
            #[cfg(feature = "cuda-oxide")]
            Self::CudaOxide => "cuda-oxide",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a backend says about its driver, for `twm probe`.
pub trait DescribeDriver {
    /// One line: which driver, which devices.
    fn driver(&self) -> String;
}

impl DescribeDriver for tensor_wasm_mem_mock::MockBackend {
    fn driver(&self) -> String {
        let n = tensor_wasm_mem_core::ManagedAllocator::device_count(self);
        format!("simulated machine of {n} device(s) in host memory (no driver)")
    }
}

/// The backend over the CUDA driver: cudarc's and cust's are one type (two ways to reach one
/// driver, one error), so it is described once, whichever of the two features is on.
#[cfg(feature = "cudarc")]
type CudaBackend = tensor_wasm_mem_wasmtime::backends::cudarc::CudarcBackend;
#[cfg(all(feature = "cust", not(feature = "cudarc")))]
type CudaBackend = tensor_wasm_mem_wasmtime::backends::cust::CustBackend;

#[cfg(any(feature = "cudarc", feature = "cust"))]
impl DescribeDriver for CudaBackend {
    fn driver(&self) -> String {
        let d = self.driver();
        let names: Vec<_> = d.devices().map(|i| i.name.clone()).collect();
        format!("CUDA driver {} ({})", d.driver_version(), names.join(", "))
    }
}

#[cfg(feature = "cuda-oxide")]
impl DescribeDriver for tensor_wasm_mem_wasmtime::backends::cuda_oxide::CudaOxideBackend {
    fn driver(&self) -> String {
        "reserved slot: not wired to any driver".into()
    }
}

/// How the simulated machine's devices reach host memory (`--simulate-host-access`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SimulatedHostAccess {
    /// Neither pageable memory access nor host registration (the default).
    #[default]
    None,
    /// Pageable memory access (HMM): any host memory is device-accessible.
    Pageable,
    /// Host registration only (`cuMemHostRegister`).
    Registered,
    /// Both.
    Both,
}

/// The simulated machine a command asks for (`--devices N`, `--simulate-host-access`): the
/// mock's, which a real driver refuses (it reports its own devices and attributes).
#[derive(Clone, Copy, Debug)]
// Read by the simulated backend only: a build without `mock` makes one and ignores it.
#[cfg_attr(not(feature = "mock"), allow(dead_code))]
pub struct SimulatedMachine {
    /// Devices.
    pub devices: u32,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS` of each.
    pub pageable: bool,
    /// Host registration on each.
    pub registration: bool,
}

/// The kernels a backend offers guests under `twm run --kernels builtin`: the simulated
/// device's (`kernels::builtin`); a real driver's kernels are the embedder's own, so none.
pub trait BuiltinKernels: tensor_wasm_mem_wasmtime::Backend + Sized {
    /// The built-in registry, if this backend has one.
    fn builtin_kernels() -> Option<tensor_wasm_mem_wasmtime::kernels::KernelRegistry<Self>> {
        None
    }

    /// The builder, recovering a fenced device when its last user goes where that is safe
    /// without the embedder's word (the simulated machine); unchanged elsewhere.
    fn recover_automatically(
        builder: tensor_wasm_mem_wasmtime::CreatorBuilder<Self>,
    ) -> tensor_wasm_mem_wasmtime::CreatorBuilder<Self> {
        builder
    }
}

#[cfg(feature = "mock")]
impl BuiltinKernels for tensor_wasm_mem_mock::MockBackend {
    fn builtin_kernels() -> Option<tensor_wasm_mem_wasmtime::kernels::KernelRegistry<Self>> {
        Some(tensor_wasm_mem_wasmtime::kernels::builtin())
    }

    fn recover_automatically(
        builder: tensor_wasm_mem_wasmtime::CreatorBuilder<Self>,
    ) -> tensor_wasm_mem_wasmtime::CreatorBuilder<Self> {
        builder.recover_simulated_automatically()
    }
}

#[cfg(any(feature = "cudarc", feature = "cust"))]
impl BuiltinKernels for CudaBackend {}

#[cfg(feature = "cuda-oxide")]
impl BuiltinKernels for tensor_wasm_mem_wasmtime::backends::cuda_oxide::CudaOxideBackend {}

/// The most devices `--devices` simulates.
pub const MAX_DEVICES: u32 = 64;

/// Parses `--devices`: 1 to [`MAX_DEVICES`], checked before anything is made.
pub fn parse_devices(text: &str) -> Result<u32, String> {
    match text.trim().parse::<u64>() {
        Ok(n) if (1..=u64::from(MAX_DEVICES)).contains(&n) => Ok(n as u32),
        _ => Err(format!(
            "{text:?} is not a device count from 1 to {MAX_DEVICES}"
        )),
    }
}

/// The simulated machine of `--devices` and `--simulate-host-access`; either is refused for a
/// backend other than the mock.
pub fn simulated_machine(
    kind: BackendKind,
    devices: Option<u32>,
    host: Option<SimulatedHostAccess>,
) -> Result<SimulatedMachine, crate::run::Failure> {
    let simulated = kind.name() == "mock";
    let refuse = |flag: &str, what: &str| {
        Err(crate::run::Failure::Usage(format!(
            "{flag} sets the simulated machine (--backend mock); the {kind} backend reports the \
             {what} the driver has"
        )))
    };
    if devices.is_some() && !simulated {
        return refuse("--devices", "devices");
    }
    if host.is_some() && !simulated {
        return refuse("--simulate-host-access", "host access");
    }
    if devices == Some(0) {
        return Err(crate::run::Failure::Usage(
            "--devices needs at least one device".into(),
        ));
    }
    let host = host.unwrap_or_default();
    Ok(SimulatedMachine {
        devices: devices.unwrap_or(1),
        pageable: matches!(
            host,
            SimulatedHostAccess::Pageable | SimulatedHostAccess::Both
        ),
        registration: matches!(
            host,
            SimulatedHostAccess::Registered | SimulatedHostAccess::Both
        ),
    })
}

/// Calls `$body` with `$b` bound to an `Arc` of the chosen backend (the body returns
/// `Result<_, Failure>`), or returns the failure that says why the backend did not start.
/// `$sim` is the simulated machine ([`simulated_machine`]).
#[macro_export]
macro_rules! with_backend {
    ($kind:expr, $sim:expr, |$b:ident| $body:expr) => {{
        let sim: $crate::backend::SimulatedMachine = $sim;
        // Read by the simulated backend only (a build without `mock` has none).
        let _ = &sim;
        match $kind {
            #[cfg(feature = "cudarc")]
            $crate::backend::BackendKind::Cudarc => {
                match tensor_wasm_mem_wasmtime::backends::start_cudarc() {
                    Ok(backend) => {
                        let $b = std::sync::Arc::new(backend);
                        $body
                    }
                    Err(e) => Err($crate::run::Failure::Other(e.to_string())),
                }
            }
            #[cfg(feature = "cust")]
            $crate::backend::BackendKind::Cust => {
                match tensor_wasm_mem_wasmtime::backends::start_cust() {
                    Ok(backend) => {
                        let $b = std::sync::Arc::new(backend);
                        $body
                    }
                    Err(e) => Err($crate::run::Failure::Other(e.to_string())),
                }
            }
            #[cfg(feature = "mock")]
            $crate::backend::BackendKind::Mock => {
                let config = tensor_wasm_mem_mock::MockConfig {
                    device_count: sim.devices,
                    pageable_memory_access: sim.pageable,
                    host_registration: sim.registration,
                    ..tensor_wasm_mem_mock::MockConfig::default()
                };
                let $b = std::sync::Arc::new(tensor_wasm_mem_mock::with_config(config));
                $body
            }
            #[cfg(feature = "cuda-oxide")]
            $crate::backend::BackendKind::CudaOxide => {
                let $b = std::sync::Arc::new(
                    tensor_wasm_mem_wasmtime::backends::cuda_oxide::CudaOxideBackend::new(),
                );
                $body
            }
        }
    }};
}
