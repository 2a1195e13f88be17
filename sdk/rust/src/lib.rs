#![doc = include_str!("../README.md")]
#![no_std]
#![forbid(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]

use core::fmt;

/// The host's result codes (the guest ABI of module `twm`).
pub mod codes {
    /// Done.
    pub const OK: i32 = 0;
    /// The range ends past the memory's current size.
    pub const ERR_OUT_OF_RANGE: i32 = -1;
    /// `ptr + len` wraps the 32-bit address space.
    pub const ERR_OVERFLOW: i32 = -2;
    /// No such advice code.
    pub const ERR_UNKNOWN_ADVICE: i32 = -3;
    /// A location below `-1`, or a device that does not exist.
    pub const ERR_UNKNOWN_DEVICE: i32 = -4;
    /// The backend (driver) failed.
    pub const ERR_BACKEND: i32 = -5;
    /// No exported `memory`, or one that is not device-visible.
    pub const ERR_NOT_DEVICE_MEMORY: i32 = -6;
    /// The memory's backing or device cannot do this (advice on registered host memory).
    pub const ERR_UNSUPPORTED: i32 = -7;
    /// No kernel of that name or handle.
    pub const ERR_UNKNOWN_KERNEL: i32 = -8;
    /// Arguments that do not match the kernel's signature.
    pub const ERR_BAD_ARGUMENTS: i32 = -9;
    /// The kernel failed on the device.
    pub const ERR_KERNEL_FAULT: i32 = -10;
    /// The tenant has as many launches in flight as it may.
    pub const ERR_BUSY: i32 = -11;
    /// The guest code of the host location.
    pub const LOCATION_HOST: i32 = -1;
}

/// Where memory should be (or is accessed from).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// The host (CPU).
    Host,
    /// GPU `n`.
    Device(u32),
}

impl Location {
    /// The guest ABI code: `-1` for the host, `n` for device `n` (saturating at `i32::MAX`).
    #[must_use]
    pub const fn code(self) -> i32 {
        match self {
            Self::Host => codes::LOCATION_HOST,
            Self::Device(n) => {
                if n > i32::MAX as u32 {
                    i32::MAX
                } else {
                    n as i32
                }
            }
        }
    }
}

/// A memory-advice hint (`cudaMemAdvise`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Advice {
    /// Mostly read: the driver may keep read-only copies where it is read.
    SetReadMostly,
    /// Undoes [`SetReadMostly`](Self::SetReadMostly).
    UnsetReadMostly,
    /// Prefer to keep the pages at this location.
    SetPreferredLocation(Location),
    /// Undoes [`SetPreferredLocation`](Self::SetPreferredLocation).
    UnsetPreferredLocation,
    /// The pages will be accessed from this location: keep a mapping there.
    SetAccessedBy(Location),
    /// Undoes [`SetAccessedBy`](Self::SetAccessedBy).
    UnsetAccessedBy(Location),
}

impl Advice {
    /// The guest ABI code of the advice.
    #[must_use]
    pub const fn code(self) -> i32 {
        match self {
            Self::SetReadMostly => 0,
            Self::UnsetReadMostly => 1,
            Self::SetPreferredLocation(_) => 2,
            Self::UnsetPreferredLocation => 3,
            Self::SetAccessedBy(_) => 4,
            Self::UnsetAccessedBy(_) => 5,
        }
    }

    /// The location argument sent with it (the host for advice that takes none).
    #[must_use]
    pub const fn location(self) -> Location {
        match self {
            Self::SetPreferredLocation(l) | Self::SetAccessedBy(l) | Self::UnsetAccessedBy(l) => l,
            Self::SetReadMostly | Self::UnsetReadMostly | Self::UnsetPreferredLocation => {
                Location::Host
            }
        }
    }
}

/// Why the host refused a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Error {
    /// The range ends past the memory's current size.
    OutOfRange,
    /// The range wraps the 32-bit address space (or is longer than it).
    Overflow,
    /// The host does not know the advice.
    UnknownAdvice,
    /// No such device.
    UnknownDevice,
    /// The backend (driver) failed.
    Backend,
    /// The guest's memory is not device-visible (or not exported as `memory`).
    NotDeviceMemory,
    /// The memory's backing or device cannot do this.
    Unsupported,
    /// No kernel of that name or handle.
    UnknownKernel,
    /// Arguments that do not match the kernel's signature.
    BadArguments,
    /// The kernel failed on the device.
    KernelFault,
    /// The tenant has as many launches in flight as it may.
    Busy,
    /// A code this SDK does not know (a newer host).
    Other(i32),
}

impl Error {
    /// The error for a host result code (`None` for [`codes::OK`]).
    #[must_use]
    pub const fn from_code(code: i32) -> Option<Self> {
        Some(match code {
            codes::OK => return None,
            codes::ERR_OUT_OF_RANGE => Self::OutOfRange,
            codes::ERR_OVERFLOW => Self::Overflow,
            codes::ERR_UNKNOWN_ADVICE => Self::UnknownAdvice,
            codes::ERR_UNKNOWN_DEVICE => Self::UnknownDevice,
            codes::ERR_BACKEND => Self::Backend,
            codes::ERR_NOT_DEVICE_MEMORY => Self::NotDeviceMemory,
            codes::ERR_UNSUPPORTED => Self::Unsupported,
            codes::ERR_UNKNOWN_KERNEL => Self::UnknownKernel,
            codes::ERR_BAD_ARGUMENTS => Self::BadArguments,
            codes::ERR_KERNEL_FAULT => Self::KernelFault,
            codes::ERR_BUSY => Self::Busy,
            other => Self::Other(other),
        })
    }

    /// The host result code.
    #[must_use]
    pub const fn code(self) -> i32 {
        match self {
            Self::OutOfRange => codes::ERR_OUT_OF_RANGE,
            Self::Overflow => codes::ERR_OVERFLOW,
            Self::UnknownAdvice => codes::ERR_UNKNOWN_ADVICE,
            Self::UnknownDevice => codes::ERR_UNKNOWN_DEVICE,
            Self::Backend => codes::ERR_BACKEND,
            Self::NotDeviceMemory => codes::ERR_NOT_DEVICE_MEMORY,
            Self::Unsupported => codes::ERR_UNSUPPORTED,
            Self::UnknownKernel => codes::ERR_UNKNOWN_KERNEL,
            Self::BadArguments => codes::ERR_BAD_ARGUMENTS,
            Self::KernelFault => codes::ERR_KERNEL_FAULT,
            Self::Busy => codes::ERR_BUSY,
            Self::Other(c) => c,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OutOfRange => f.write_str("range past the end of memory"),
            Self::Overflow => f.write_str("range overflows"),
            Self::UnknownAdvice => f.write_str("unknown advice"),
            Self::UnknownDevice => f.write_str("unknown device"),
            Self::Backend => f.write_str("backend failed"),
            Self::NotDeviceMemory => f.write_str("memory is not device-visible"),
            Self::Unsupported => f.write_str("not supported by this memory"),
            Self::UnknownKernel => f.write_str("unknown kernel"),
            Self::BadArguments => f.write_str("arguments do not match the kernel"),
            Self::KernelFault => f.write_str("the kernel failed"),
            Self::Busy => f.write_str("too many launches in flight"),
            Self::Other(c) => write!(f, "host result {c}"),
        }
    }
}

impl core::error::Error for Error {}

/// Turns a host result into a `Result`.
fn result(code: i32) -> Result<(), Error> {
    match Error::from_code(code) {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// The guest ABI form of a slice: its 32-bit address and length.
fn range<T>(data: &[T]) -> Result<(u32, u32), Error> {
    let len = u32::try_from(core::mem::size_of_val(data)).map_err(|_| Error::Overflow)?;
    let ptr = u32::try_from(data.as_ptr() as usize).unwrap_or(u32::MAX);
    Ok((ptr, len))
}

/// Applies `advice` to the memory of `data`.
pub fn advise<T>(data: &[T], advice: Advice) -> Result<(), Error> {
    let (ptr, len) = range(data)?;
    result(imports::advise(
        ptr,
        len,
        advice.code(),
        advice.location().code(),
    ))
}

/// Prefetches the memory of `data` to `to`, on the instance's stream.
pub fn prefetch<T>(data: &[T], to: Location) -> Result<(), Error> {
    let (ptr, len) = range(data)?;
    result(imports::prefetch(ptr, len, to.code()))
}

/// A kernel the host registered, found by [`kernel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel(i32);

/// One launch argument: a buffer of this guest's memory, or a scalar (the ABI's 16 bytes). It
/// borrows its buffer for `'a`, so the buffer outlives the launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arg<'a> {
    a: u64,
    b: u64,
    _buffer: core::marker::PhantomData<&'a [u8]>,
}

impl<'a> Arg<'a> {
    const fn new(a: u64, b: u64) -> Self {
        Self {
            a,
            b,
            _buffer: core::marker::PhantomData,
        }
    }

    /// A buffer the kernel only reads.
    #[must_use]
    pub fn buffer<T>(data: &'a [T]) -> Self {
        Self::new(
            data.as_ptr() as usize as u64,
            core::mem::size_of_val(data) as u64,
        )
    }

    /// A buffer the kernel may write.
    #[must_use]
    pub fn buffer_mut<T>(data: &'a mut [T]) -> Self {
        Self::new(
            data.as_ptr() as usize as u64,
            core::mem::size_of_val(data) as u64,
        )
    }

    /// An unsigned 32-bit scalar.
    #[must_use]
    pub const fn u32(value: u32) -> Self {
        Self::new(value as u64, 0)
    }

    /// An unsigned 64-bit scalar.
    #[must_use]
    pub const fn u64(value: u64) -> Self {
        Self::new(value, 0)
    }

    /// A 32-bit float scalar (its bits).
    #[must_use]
    pub fn f32(value: f32) -> Self {
        Self::u32(value.to_bits())
    }
}

/// The kernel the host registered as `name`.
pub fn kernel(name: &str) -> Result<Kernel, Error> {
    let (ptr, len) = range(name.as_bytes())?;
    let handle = imports::kernel(ptr, len);
    if handle >= 0 {
        Ok(Kernel(handle))
    } else {
        Err(Error::from_code(handle).unwrap_or(Error::Other(handle)))
    }
}

/// Launches `kernel` with `args` and waits for it (the host checks every buffer against this
/// guest's memory and the kernel's signature before anything runs).
///
/// # Safety
///
/// Every buffer the kernel's signature says it writes must be given with [`Arg::buffer_mut`]
/// (the host writes it while this call runs): a written buffer given as [`Arg::buffer`] would
/// be written through a shared borrow. The SDK cannot know the host's signatures.
pub unsafe fn launch(kernel: Kernel, args: &[Arg<'_>]) -> Result<(), Error> {
    let (ptr, _) = range(args)?;
    let n = u32::try_from(args.len()).map_err(|_| Error::Overflow)?;
    result(imports::launch(kernel.0, ptr, n))
}

/// One call as the host would receive it: `(function, ptr, len, advice, location)`; `advice`
/// is `-1` for `prefetch`.
pub type Call = (&'static str, u32, u32, i32, i32);

/// The last call made through the stubs (on targets other than wasm32; `None` on wasm32, where
/// the host receives the calls).
#[must_use]
pub fn last_call() -> Option<Call> {
    imports::last_call()
}

#[cfg(target_arch = "wasm32")]
mod imports {
    #[link(wasm_import_module = "twm")]
    unsafe extern "C" {
        #[link_name = "advise"]
        fn twm_advise(ptr: u32, len: u32, advice: i32, location: i32) -> i32;
        #[link_name = "prefetch"]
        fn twm_prefetch(ptr: u32, len: u32, location: i32) -> i32;
        #[link_name = "kernel"]
        fn twm_kernel(name: u32, len: u32) -> i32;
        #[link_name = "launch"]
        fn twm_launch(kernel: i32, args: u32, nargs: u32) -> i32;
    }

    pub(crate) fn kernel(name: u32, len: u32) -> i32 {
        // SAFETY: the host reads `len` bytes at `name`, checked against the guest's memory.
        unsafe { twm_kernel(name, len) }
    }

    pub(crate) fn launch(kernel: i32, args: u32, nargs: u32) -> i32 {
        // SAFETY: the host reads and checks the arguments; buffers are the guest's own, and
        // the call returns when the kernel is done.
        unsafe { twm_launch(kernel, args, nargs) }
    }

    pub(crate) fn advise(ptr: u32, len: u32, advice: i32, location: i32) -> i32 {
        // SAFETY: the host function takes four integers and checks the range itself; it never
        // touches memory outside the guest's.
        unsafe { twm_advise(ptr, len, advice, location) }
    }

    pub(crate) fn prefetch(ptr: u32, len: u32, location: i32) -> i32 {
        // SAFETY: as `advise`.
        unsafe { twm_prefetch(ptr, len, location) }
    }

    pub(crate) fn last_call() -> Option<super::Call> {
        None
    }
}

#[cfg(not(target_arch = "wasm32"))]
mod imports {
    //! Host stubs: answer `OK` and record the call (the pointer is the host address, truncated
    //! to 32 bits as on wasm32 it would not need to be).
    use core::sync::atomic::{AtomicI32, AtomicU8, AtomicU32, Ordering};

    static FUNCTION: AtomicU8 = AtomicU8::new(0);
    static PTR: AtomicU32 = AtomicU32::new(0);
    static LEN: AtomicU32 = AtomicU32::new(0);
    static ADVICE: AtomicI32 = AtomicI32::new(0);
    static LOCATION: AtomicI32 = AtomicI32::new(0);

    fn record(function: u8, ptr: u32, len: u32, advice: i32, location: i32) -> i32 {
        PTR.store(ptr, Ordering::Relaxed);
        LEN.store(len, Ordering::Relaxed);
        ADVICE.store(advice, Ordering::Relaxed);
        LOCATION.store(location, Ordering::Relaxed);
        FUNCTION.store(function, Ordering::Release);
        super::codes::OK
    }

    pub(crate) fn advise(ptr: u32, len: u32, advice: i32, location: i32) -> i32 {
        record(1, ptr, len, advice, location)
    }

    pub(crate) fn prefetch(ptr: u32, len: u32, location: i32) -> i32 {
        record(2, ptr, len, -1, location)
    }

    /// No host kernels off wasm32.
    pub(crate) fn kernel(_name: u32, _len: u32) -> i32 {
        super::codes::ERR_UNKNOWN_KERNEL
    }

    pub(crate) fn launch(_kernel: i32, _args: u32, _nargs: u32) -> i32 {
        super::codes::ERR_UNKNOWN_KERNEL
    }

    pub(crate) fn last_call() -> Option<super::Call> {
        let name = match FUNCTION.load(Ordering::Acquire) {
            1 => "advise",
            2 => "prefetch",
            _ => return None,
        };
        Some((
            name,
            PTR.load(Ordering::Relaxed),
            LEN.load(Ordering::Relaxed),
            ADVICE.load(Ordering::Relaxed),
            LOCATION.load(Ordering::Relaxed),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_become_byte_ranges_and_codes() {
        let data = [0u32; 10];
        prefetch(&data, Location::Device(3)).unwrap();
        let (name, _, len, advice, location) = last_call().unwrap();
        assert_eq!((name, len, advice, location), ("prefetch", 40, -1, 3));
        advise(&data[..2], Advice::SetAccessedBy(Location::Host)).unwrap();
        let (name, _, len, advice, location) = last_call().unwrap();
        assert_eq!((name, len, advice, location), ("advise", 8, 4, -1));
    }

    #[test]
    fn codes_round_trip() {
        for code in -11..=0 {
            match Error::from_code(code) {
                None => assert_eq!(code, codes::OK),
                Some(e) => assert_eq!(e.code(), code),
            }
        }
        assert_eq!(Error::from_code(-42), Some(Error::Other(-42)));
        assert_eq!(Location::Device(u32::MAX).code(), i32::MAX);
    }
}
