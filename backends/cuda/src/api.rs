//! The driver entry points the backends call, with raw-integer results, and how a table of them
//! is made: loaded from a library at run time, or from symbols linked at link time.

use std::ffi::{c_int, c_void};

/// An opaque driver handle (`CUcontext`, `CUstream`, `CUmemoryPool`).
pub type Handle = *mut c_void;

/// `CUmemLocationType` values, and the host's ordinal in the CUDA 11 forms of advice and
/// prefetch: the one table of them (the simulated libcuda reads it too).
pub mod location {
    /// `CU_MEM_LOCATION_TYPE_DEVICE`.
    pub const DEVICE: u32 = 1;
    /// `CU_MEM_LOCATION_TYPE_HOST`.
    pub const HOST: u32 = 2;
    /// `CU_MEM_LOCATION_TYPE_HOST_NUMA`.
    pub const HOST_NUMA: u32 = 3;
    /// `CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT`.
    pub const HOST_NUMA_CURRENT: u32 = 4;
    /// `CU_DEVICE_CPU`: the host, in the CUDA 11 forms of advise and prefetch.
    pub const DEVICE_CPU: i32 = -1;
}

/// `CUdevice_attribute` values this project reads: the one table of them (the simulated
/// libcuda answers the same numbers).
pub mod attr {
    /// `CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`.
    pub const UNIFIED_ADDRESSING: u32 = 41;
    /// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
    pub const COMPUTE_CAPABILITY_MAJOR: u32 = 75;
    /// `CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY`.
    pub const MANAGED_MEMORY: u32 = 83;
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`.
    pub const PAGEABLE_MEMORY_ACCESS: u32 = 88;
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`.
    pub const CONCURRENT_MANAGED_ACCESS: u32 = 89;
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`.
    pub const CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: u32 = 91;
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED`.
    pub const HOST_REGISTER_SUPPORTED: u32 = 99;
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES`.
    pub const PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES: u32 = 100;
}

/// `CUmemLocation` (CUDA 12.2+): a location type and an id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemLocation {
    /// 1 device, 2 host (`CUmemLocationType`).
    pub kind: u32,
    /// The device ordinal (0 for the host).
    pub id: c_int,
}

impl MemLocation {
    /// The host (`None`) or device `n` (`Some(n)`).
    #[must_use]
    pub const fn of(device: Option<i32>) -> Self {
        match device {
            Some(id) => Self {
                kind: location::DEVICE,
                id,
            },
            None => Self {
                kind: location::HOST,
                id: 0,
            },
        }
    }
}

/// `CUmemPoolProps` (the CUDA 12.6 layout; `maxSize` is read by CUDA 12.2 and later).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemPoolProps {
    /// `CUmemAllocationType`: 1 = pinned.
    pub alloc_type: u32,
    /// `CUmemAllocationHandleType`: 0 = none.
    pub handle_types: u32,
    /// Where the pool's memory lives.
    pub location: MemLocation,
    /// Windows only.
    pub win32_security_attributes: *mut c_void,
    /// The most the pool may reserve (0: no maximum).
    pub max_size: usize,
    /// Usage flags.
    pub usage: u16,
    /// Must be zero.
    pub reserved: [u8; 54],
}

/// Calls `$callback` with the entry points of a table, in two groups (the stream-ordered pools
/// are optional), each `name(argument types);` (the result is always the raw `CUresult`).
#[doc(hidden)]
#[macro_export]
macro_rules! __cuda_entries {
    ($($callback:tt)+) => {
        $($callback)+! {
            Entries {
            cuInit(u32);
            cuDriverGetVersion(*mut ::std::ffi::c_int);
            cuDeviceGetCount(*mut ::std::ffi::c_int);
            cuDeviceGet(*mut ::std::ffi::c_int, ::std::ffi::c_int);
            cuDeviceGetAttribute(*mut ::std::ffi::c_int, u32, ::std::ffi::c_int);
            cuDeviceGetName(*mut ::std::ffi::c_char, ::std::ffi::c_int, ::std::ffi::c_int);
            cuDeviceCanAccessPeer(*mut ::std::ffi::c_int, ::std::ffi::c_int, ::std::ffi::c_int);
            cuDevicePrimaryCtxRetain(*mut $crate::Handle, ::std::ffi::c_int);
            cuDevicePrimaryCtxRelease_v2(::std::ffi::c_int);
            cuDevicePrimaryCtxReset_v2(::std::ffi::c_int);
            cuMemGetInfo_v2(*mut usize, *mut usize);
            cuCtxPushCurrent_v2($crate::Handle);
            cuCtxPopCurrent_v2(*mut $crate::Handle);
            cuCtxCreate_v2(*mut $crate::Handle, u32, ::std::ffi::c_int);
            cuCtxDestroy_v2($crate::Handle);
            cuMemAllocManaged(*mut u64, usize, u32);
            cuMemFree_v2(u64);
            cuMemsetD8Async(u64, u8, usize, $crate::Handle);
            cuMemHostRegister_v2(*mut ::std::ffi::c_void, usize, u32);
            cuMemHostUnregister(*mut ::std::ffi::c_void);
            cuStreamCreate(*mut $crate::Handle, u32);
            cuStreamDestroy_v2($crate::Handle);
            cuStreamSynchronize($crate::Handle);
            }
            PoolEntries {
            cuMemPoolCreate(*mut $crate::Handle, *const $crate::MemPoolProps);
            cuMemPoolDestroy($crate::Handle);
            cuMemAllocFromPoolAsync(*mut u64, usize, $crate::Handle, $crate::Handle);
            cuMemFreeAsync(u64, $crate::Handle);
            cuMemPoolTrimTo($crate::Handle, usize);
            cuMemPoolSetAttribute($crate::Handle, u32, *mut ::std::ffi::c_void);
            cuMemPoolGetAttribute($crate::Handle, u32, *mut ::std::ffi::c_void);
            }
        }
    };
}

macro_rules! entries_struct {
    ($($group:ident { $($name:ident($($arg:ty),*);)* })*) => {$(
        /// Driver entry points, each returning the raw `CUresult`.
        #[allow(non_snake_case, missing_docs)]
        #[derive(Clone, Copy, Debug)]
        pub struct $group {
            $(pub $name: unsafe extern "C" fn($($arg),*) -> u32,)*
        }

        impl $group {
            /// Looks every entry point up in `lib`; the first one missing is the error.
            ///
            /// # Safety
            ///
            /// `lib` must be a CUDA driver: each symbol is taken to have the signature above.
            unsafe fn load(lib: &libloading::Library) -> Result<Self, &'static str> {
                Ok(Self {
                    $($name: {
                        // SAFETY: the symbol is libcuda's entry point of that name, whose C
                        // signature is the one declared (a `CUresult` is a C enum: an int).
                        let symbol = unsafe {
                            lib.get::<unsafe extern "C" fn($($arg),*) -> u32>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                        };
                        *symbol.map_err(|_| stringify!($name))?
                    },)*
                })
            }
        }
    )*};
}

crate::__cuda_entries!(entries_struct);

/// The entry points of advice and prefetch: the `_v2` forms (CUDA 12.2+, a `CUmemLocation`) or
/// the CUDA 11 forms (a device ordinal, `-1` for the host).
#[derive(Clone, Copy, Debug)]
pub enum HintEntries {
    /// `cuMemAdvise_v2`, `cuMemPrefetchAsync_v2`.
    V2 {
        /// `cuMemAdvise_v2`.
        advise: unsafe extern "C" fn(u64, usize, u32, MemLocation) -> u32,
        /// `cuMemPrefetchAsync_v2`.
        prefetch: unsafe extern "C" fn(u64, usize, MemLocation, u32, Handle) -> u32,
    },
    /// `cuMemAdvise`, `cuMemPrefetchAsync`.
    V1 {
        /// `cuMemAdvise`.
        advise: unsafe extern "C" fn(u64, usize, u32, c_int) -> u32,
        /// `cuMemPrefetchAsync`.
        prefetch: unsafe extern "C" fn(u64, usize, c_int, Handle) -> u32,
    },
}

/// A table of driver entry points with raw-integer results: what the backends call, so that a
/// code no binding's enum knows is an error with its integer, never undefined behaviour.
#[derive(Clone, Copy, Debug)]
pub struct Api {
    /// Everything but advice, prefetch and pools.
    pub entries: Entries,
    /// Advice and prefetch.
    pub hints: HintEntries,
    /// Stream-ordered pools, where the driver has them.
    pub pools: Option<PoolEntries>,
}

/// Why a library is not a driver this crate can use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadError {
    /// No library of that name loaded.
    NotFound(String),
    /// The library lacks an entry point.
    MissingSymbol(&'static str),
}

impl Api {
    /// Loads the table from the driver library that loads by the name `name` (kept loaded for
    /// the rest of the process), with the `_v2` forms of advice and prefetch (the CUDA 11 forms
    /// on a driver before 12.2). A driver without stream-ordered pools loads with
    /// `pools = None`.
    ///
    /// # Safety
    ///
    /// The library of that name must be a CUDA driver (its symbols are taken to have the
    /// driver's signatures); loading it runs its initialisers.
    pub unsafe fn load(name: &str) -> Result<&'static Self, LoadError> {
        // One table per library name for the process: a backend started again reuses it.
        static LOADED: std::sync::Mutex<Vec<(String, &'static Api)>> =
            std::sync::Mutex::new(Vec::new());
        let mut loaded = LOADED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(&(_, api)) = loaded.iter().find(|(n, _)| n == name) {
            return Ok(api);
        }
        // SAFETY: guaranteed by the caller.
        let api = unsafe { Self::load_uncached(name) }?;
        loaded.push((name.to_owned(), api));
        Ok(api)
    }

    /// [`load`](Self::load) without the cache.
    ///
    /// # Safety
    ///
    /// As [`load`](Self::load).
    unsafe fn load_uncached(name: &str) -> Result<&'static Self, LoadError> {
        // SAFETY: guaranteed by the caller.
        let lib = unsafe { libloading::Library::new(name) }
            .map_err(|e| LoadError::NotFound(format!("{name}: {e}")))?;
        // The table's pointers live as long as the process: so does the library.
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        // SAFETY: `lib` is a CUDA driver by the caller's contract.
        let entries = unsafe { Entries::load(lib) }.map_err(LoadError::MissingSymbol)?;
        // SAFETY: as above; a driver without pools has none of them.
        let pools = unsafe { PoolEntries::load(lib) }.ok();
        let hints = Self::load_hints(lib)?;
        Ok(Box::leak(Box::new(Self {
            entries,
            hints,
            pools,
        })))
    }

    /// The `_v2` forms of advice and prefetch where the driver has both (CUDA 12.2+), else the
    /// CUDA 11 forms; neither pair complete: the first missing `_v2` entry point is the error.
    fn load_hints(lib: &libloading::Library) -> Result<HintEntries, LoadError> {
        type AdviseV2 = unsafe extern "C" fn(u64, usize, u32, MemLocation) -> u32;
        type PrefetchV2 = unsafe extern "C" fn(u64, usize, MemLocation, u32, Handle) -> u32;
        type AdviseV1 = unsafe extern "C" fn(u64, usize, u32, c_int) -> u32;
        type PrefetchV1 = unsafe extern "C" fn(u64, usize, c_int, Handle) -> u32;
        // Each lookup: the driver's entry point of that name has the C signature declared; the
        // symbol is only looked up here.
        // SAFETY: as just said.
        let advise_v2 = unsafe { lib.get::<AdviseV2>(b"cuMemAdvise_v2\0") }.map(|s| *s);
        // SAFETY: as above.
        let prefetch_v2 = unsafe { lib.get::<PrefetchV2>(b"cuMemPrefetchAsync_v2\0") }.map(|s| *s);
        if let (Ok(advise), Ok(prefetch)) = (&advise_v2, &prefetch_v2) {
            return Ok(HintEntries::V2 {
                advise: *advise,
                prefetch: *prefetch,
            });
        }
        // SAFETY: as above.
        let advise_v1 = unsafe { lib.get::<AdviseV1>(b"cuMemAdvise\0") }.map(|s| *s);
        // SAFETY: as above.
        let prefetch_v1 = unsafe { lib.get::<PrefetchV1>(b"cuMemPrefetchAsync\0") }.map(|s| *s);
        match (advise_v1, prefetch_v1) {
            (Ok(advise), Ok(prefetch)) => Ok(HintEntries::V1 { advise, prefetch }),
            _ if advise_v2.is_err() => Err(LoadError::MissingSymbol("cuMemAdvise_v2")),
            _ => Err(LoadError::MissingSymbol("cuMemPrefetchAsync_v2")),
        }
    }
}

/// Builds an [`Api`] from the driver's symbols linked at link time (`-lcuda`), with the CUDA 11
/// forms of advice and prefetch and stream-ordered pools (CUDA 11.2+): declares them in the
/// calling crate, with raw-integer results. Expands to a `&'static Api`.
#[macro_export]
macro_rules! linked_api {
    () => {
        $crate::__cuda_entries!($crate::__linked_api)
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __linked_api {
    (
        Entries { $($name:ident($($arg:ty),*);)* }
        PoolEntries { $($pool:ident($($pool_arg:ty),*);)* }
    ) => {{
        #[link(name = "cuda")]
        unsafe extern "C" {
            $(fn $name($(_: $arg),*) -> u32;)*
            $(fn $pool($(_: $pool_arg),*) -> u32;)*
            fn cuMemAdvise(_: u64, _: usize, _: u32, _: ::std::ffi::c_int) -> u32;
            fn cuMemPrefetchAsync(_: u64, _: usize, _: ::std::ffi::c_int, _: $crate::Handle)
            -> u32;
        }
        static API: $crate::Api = $crate::Api {
            entries: $crate::Entries { $($name,)* },
            hints: $crate::HintEntries::V1 {
                advise: cuMemAdvise,
                prefetch: cuMemPrefetchAsync,
            },
            pools: Some($crate::PoolEntries { $($pool,)* }),
        };
        &API
    }};
}
