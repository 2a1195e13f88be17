//! Kernels for guests: a registry of trusted kernels the embedder controls, and the `twm`
//! imports through which a guest launches them on its own memory, every argument checked.
//!
//! The embedder registers each kernel under a name with a [`KernelSignature`] (its buffer and
//! scalar parameters, and how its launch shape follows from them) and a [`KernelLauncher`]:
//! the embedder's own code that launches it (a PTX or cubin function through cudarc or cust, or
//! a simulated kernel, [`simulated`]). A guest never sees code or device pointers: it looks a
//! kernel up by name and launches it with its own offsets.
//!
//! # The guest ABI (module `twm`)
//!
//! ```wat
//! (import "twm" "kernel" (func (param i32 i32) (result i32)))     ;; name_ptr name_len -> handle
//! (import "twm" "launch" (func (param i32 i32 i32) (result i32))) ;; handle args_ptr nargs
//! ```
//!
//! `kernel` answers a handle (`>= 0`) for a registered name, or [`TWM_ERR_UNKNOWN_KERNEL`].
//! `launch` reads `nargs` arguments of 16 bytes each at `args_ptr` (two little-endian `u64`s):
//! a buffer is `(offset, bytes)` into the guest's memory, a scalar `(value, 0)` (an `f32` as its
//! bits). Before anything is queued, every argument is checked: the count and each one's kind
//! against the signature ([`TWM_ERR_BAD_ARGUMENTS`]), each buffer against the memory's current
//! size ([`TWM_ERR_OUT_OF_RANGE`](crate::TWM_ERR_OUT_OF_RANGE),
//! [`TWM_ERR_OVERFLOW`](crate::TWM_ERR_OVERFLOW)) and its length against the signature (a whole
//! number of elements; a fixed count, or the count a scalar argument gives), and every buffer a
//! kernel writes against every other buffer (no overlap). The buffers are then resolved to
//! device pointers, prefetched to the memory's device where the device migrates pages, and the
//! kernel is launched on the tenant's stream, on that device.
//!
//! **The memory model is synchronous:** `launch` returns when the kernel is done (the stream
//! waited for). The guest is inside the call and its Store is held for its whole length, so no
//! guest code runs, and the memory cannot grow, be dropped, scrubbed or handed to another
//! tenant while the kernel may touch it; a launch on a memory that grew sees its new size. A
//! kernel that fails is [`TWM_ERR_KERNEL_FAULT`], counted in the tenant's `kernel_failures`; a
//! kernel that *faults* (an illegal address: sticky for its context, as a GPU's) loses the
//! context, and the guest traps with [`TwmError::DeviceLost`], as does every later `twm` call of
//! a tenant whose device state is lost (its device fenced until
//! [`recover`](crate::TensorWasmMemoryCreator::recover)); a tenant past its launches in flight
//! (over all its Stores and threads) is [`TWM_ERR_BUSY`]. A bad call never traps and never
//! touches memory outside the guest's.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tensor_wasm_mem_core::{DeviceId, Location, Stream};
use wasmtime::Caller;

use crate::Backend;
use crate::error::TwmError;
use crate::guest::{GuestContext, HasGuestContext};
use crate::memory::MemoryView;
use crate::scope::Access;

/// No kernel of that name or handle is registered.
pub const TWM_ERR_UNKNOWN_KERNEL: i32 = -8;
/// The arguments do not match the kernel's signature (count, kind, length), or a buffer it
/// writes overlaps another.
pub const TWM_ERR_BAD_ARGUMENTS: i32 = -9;
/// The kernel failed on the device (a fault is sticky for its context).
pub const TWM_ERR_KERNEL_FAULT: i32 = -10;
/// The tenant has as many launches in flight as it may.
pub const TWM_ERR_BUSY: i32 = -11;
/// The tenant's device state was lost to a kernel fault. Never reaches a guest: the host call
/// traps with [`TwmError::DeviceLost`] instead.
pub(crate) const TWM_ERR_DEVICE_LOST: i32 = -12;
/// The wait for a guest's kernel failed and it may still run. Never reaches a guest: the host
/// call traps with [`TwmError::WorkMayRun`] instead (and the Store's memories are kept).
pub(crate) const WORK_MAY_RUN: i32 = -13;

/// The most arguments a kernel takes.
pub const MAX_KERNEL_ARGS: usize = 32;

/// The longest kernel name, in bytes.
pub const MAX_KERNEL_NAME: usize = 256;

/// A scalar parameter's type: how its `u64` is read (a narrower value must fit).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scalar {
    /// An unsigned 32-bit integer.
    U32,
    /// An unsigned 64-bit integer.
    U64,
    /// A 32-bit float, as its bits.
    F32,
}

/// How long a buffer must be, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferLength {
    /// Any whole number of elements.
    Any,
    /// Exactly this many.
    Elements(u64),
    /// As many as the scalar argument at this index says.
    Arg(usize),
}

/// One parameter of a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelParam {
    /// A buffer in the guest's memory: how the kernel uses it, its element size in bytes, and
    /// its length.
    Buffer {
        /// Read, written, or both.
        access: Access,
        /// Bytes per element (at least 1).
        element_bytes: u32,
        /// How many elements.
        length: BufferLength,
    },
    /// A value.
    Scalar(Scalar),
}

/// How a launch's grid and blocks follow from its arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LaunchShape {
    /// The same grid and block for every launch.
    Fixed {
        /// Blocks in the grid (x, y, z).
        grid: [u32; 3],
        /// Threads in a block (x, y, z).
        block: [u32; 3],
    },
    /// One thread per element: blocks of `block` threads, as many as `count` (the scalar
    /// argument at that index) needs.
    PerElement {
        /// Threads in a block.
        block: u32,
        /// The index of the scalar argument that counts the elements.
        count: usize,
    },
}

/// A kernel's declared parameters and launch shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelSignature {
    /// Its parameters, in order.
    pub params: Vec<KernelParam>,
    /// Its launch shape.
    pub shape: LaunchShape,
}

impl KernelSignature {
    /// Refuses a signature that could not be checked: too many parameters, a zero element
    /// size, or a length or count that names no scalar argument.
    fn check(&self) -> Result<(), TwmError> {
        let bad = |reason: &'static str| Err(TwmError::KernelSignature(reason));
        if self.params.len() > MAX_KERNEL_ARGS {
            return bad("more than 32 parameters");
        }
        let scalar = |i: usize| matches!(self.params.get(i), Some(KernelParam::Scalar(_)));
        for p in &self.params {
            if let KernelParam::Buffer {
                element_bytes,
                length,
                ..
            } = p
            {
                if *element_bytes == 0 {
                    return bad("a buffer of zero-byte elements");
                }
                if let BufferLength::Arg(i) = length
                    && !scalar(*i)
                {
                    return bad("a buffer length that names no scalar argument");
                }
            }
        }
        match self.shape {
            LaunchShape::PerElement { block: 0, .. } => bad("a block of zero threads"),
            LaunchShape::PerElement { count, .. } if !scalar(count) => {
                bad("a launch count that names no scalar argument")
            }
            LaunchShape::Fixed { grid, block } if grid.contains(&0) || block.contains(&0) => {
                bad("an empty grid or block")
            }
            _ => Ok(()),
        }
    }
}

/// A checked launch, handed to a [`KernelLauncher`]: everything resolved, nothing queued yet.
/// Only this layer makes one (after its checks), so a launcher may trust what it says: its
/// pointers are the guest's own, checked, and the guest's Store is held until the stream is
/// waited for.
#[derive(Debug)]
pub struct Launch<'a> {
    device: DeviceId,
    stream: &'a Stream,
    args: &'a [u64],
    buffers: &'a [(u64, u64)],
    grid: [u32; 3],
    block: [u32; 3],
}

impl Launch<'_> {
    /// The device of the guest's memory (and of the stream).
    #[must_use]
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The tenant's stream: launch on it (its context is [`Stream::context`]).
    #[must_use]
    pub fn stream(&self) -> &Stream {
        self.stream
    }

    /// One value per parameter: a buffer's device pointer, a scalar's value.
    #[must_use]
    pub fn args(&self) -> &[u64] {
        self.args
    }

    /// Each buffer parameter's `(device pointer, bytes)`, in parameter order.
    #[must_use]
    pub fn buffers(&self) -> &[(u64, u64)] {
        self.buffers
    }

    /// Blocks in the grid.
    #[must_use]
    pub fn grid(&self) -> [u32; 3] {
        self.grid
    }

    /// Threads in a block.
    #[must_use]
    pub fn block(&self) -> [u32; 3] {
        self.block
    }
}

/// The embedder's code that launches one registered kernel on a checked [`Launch`]: queue it on
/// `launch.stream` (the layer waits for the stream after). Any function or closure of this
/// shape is one.
pub trait KernelLauncher<B: Backend>: Send + Sync + 'static {
    /// Queues the kernel. An error is reported to the guest as [`TWM_ERR_KERNEL_FAULT`] and to
    /// the tenant's figures as a kernel failure.
    fn launch(&self, backend: &B, launch: &Launch<'_>) -> Result<(), TwmError>;

    /// `device`'s primary context was reset after a kernel fault (a creator's recovery,
    /// docs/SAFETY.md section 6b): every module and function this launcher loaded there is
    /// gone. Forget them (load them again on the next launch there); never use them. Called
    /// after each recovery of a device this launcher's creator serves (whoever recovered it:
    /// this creator, or another on the same backend), after the reset, before any guest
    /// launches there through this creator again; a launcher shared by several creators hears
    /// of one recovery from each, so forgetting must be idempotent. The default does nothing, right for a launcher that
    /// caches nothing per context.
    ///
    /// It may call back into the creator on the same thread (retry its releases, instantiate,
    /// recover another device): other threads that reach the creator meanwhile wait until
    /// every launcher has heard, and a guest launch made from inside this call (a start
    /// function's) is refused, the guest trapping as on a lost device, since it could reach a
    /// launcher not told yet. It must not wait for another thread that uses the creator: that
    /// thread may be waiting for this call to end. A launcher that panics here leaves the
    /// recovery to be told again, to every launcher, on the creator's next call.
    fn device_recovered(&self, backend: &B, device: DeviceId) {
        let _ = (backend, device);
    }
}

impl<B: Backend, F> KernelLauncher<B> for F
where
    F: Fn(&B, &Launch<'_>) -> Result<(), TwmError> + Send + Sync + 'static,
{
    fn launch(&self, backend: &B, launch: &Launch<'_>) -> Result<(), TwmError> {
        self(backend, launch)
    }
}

struct Entry<B: Backend> {
    name: String,
    signature: KernelSignature,
    launcher: Arc<dyn KernelLauncher<B>>,
}

/// The kernels guests of a creator may launch ([`CreatorBuilder::kernels`]), and how many
/// launches one tenant may have in flight at once.
///
/// [`CreatorBuilder::kernels`]: crate::CreatorBuilder::kernels
pub struct KernelRegistry<B: Backend> {
    entries: Vec<Entry<B>>,
    max_in_flight: u32,
}

impl<B: Backend> fmt::Debug for KernelRegistry<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelRegistry")
            .field(
                "kernels",
                &self.entries.iter().map(|e| &e.name).collect::<Vec<_>>(),
            )
            .field("max_in_flight", &self.max_in_flight)
            .finish()
    }
}

impl<B: Backend> Default for KernelRegistry<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> KernelRegistry<B> {
    /// Tells every launcher (once each, however many kernels share it) that `device`'s primary
    /// context was reset ([`KernelLauncher::device_recovered`]).
    pub(crate) fn device_recovered(&self, backend: &B, device: DeviceId) {
        let mut told: Vec<*const ()> = Vec::new();
        for entry in &self.entries {
            let key = Arc::as_ptr(&entry.launcher).cast::<()>();
            if !told.contains(&key) {
                told.push(key);
                entry.launcher.device_recovered(backend, device);
            }
        }
    }

    /// An empty registry; a tenant may have 4 launches in flight.
    #[must_use]
    pub fn new() -> Self {
        Self {
            entries: Vec::new(),
            max_in_flight: 4,
        }
    }

    /// At most `launches` launches of one tenant in flight at once (over all its Stores and
    /// threads; at least 1).
    #[must_use]
    pub fn max_in_flight(mut self, launches: u32) -> Self {
        self.max_in_flight = launches.max(1);
        self
    }

    /// Registers `launcher` under `name` with `signature`. A name given twice, or a signature
    /// that could not be checked, is [`TwmError::KernelSignature`].
    pub fn register(
        &mut self,
        name: &str,
        signature: KernelSignature,
        launcher: impl KernelLauncher<B>,
    ) -> Result<&mut Self, TwmError> {
        signature.check()?;
        if name.is_empty() || name.len() > MAX_KERNEL_NAME {
            return Err(TwmError::KernelSignature("a name empty or over 256 bytes"));
        }
        if self.entries.iter().any(|e| e.name == name) {
            return Err(TwmError::KernelSignature("a name registered twice"));
        }
        self.entries.push(Entry {
            name: name.to_owned(),
            signature,
            launcher: Arc::new(launcher),
        });
        Ok(self)
    }

    /// The names registered, in handle order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.name.as_str())
    }

    fn handle(&self, name: &[u8]) -> Option<i32> {
        let i = self
            .entries
            .iter()
            .position(|e| e.name.as_bytes() == name)?;
        i32::try_from(i).ok()
    }
}

/// A tenant's launch figures, shared by its Stores' guest contexts.
#[derive(Debug, Default)]
pub(crate) struct KernelCounters {
    pub(crate) launches: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) failures: AtomicU64,
    /// Host calls that found the tenant's device state lost to a kernel fault (each trapped).
    pub(crate) device_lost: AtomicU64,
    /// Launches whose own wait saw a sticky fault first (the device was not fenced before).
    pub(crate) faults: AtomicU64,
    in_flight: AtomicU32,
}

impl KernelCounters {
    /// `launches` kept in flight by a Store whose kernels may have run on (their waits
    /// refused: [`InFlight::keep`]) go back: nothing it launched runs any more.
    pub(crate) fn give_back_in_flight(&self, launches: u32) {
        if launches > 0 {
            self.in_flight.fetch_sub(launches, Ordering::AcqRel);
        }
    }
}

/// One launch of a tenant in flight, given back when dropped.
struct InFlight<'a>(&'a KernelCounters);

impl<'a> InFlight<'a> {
    fn take(counters: &'a KernelCounters, most: u32) -> Result<Self, i32> {
        let mut now = counters.in_flight.load(Ordering::Acquire);
        loop {
            if now >= most {
                return Err(TWM_ERR_BUSY);
            }
            match counters.in_flight.compare_exchange_weak(
                now,
                now + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(Self(counters)),
                Err(seen) => now = seen,
            }
        }
    }
}

impl InFlight<'_> {
    /// Keeps the launch in flight past this guard: its kernel may still run (its wait was
    /// refused). The Store's guest context gives it back once its stream is waited for
    /// ([`KernelCounters::give_back_in_flight`]).
    fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Reads `len` bytes of the guest's memory at `ptr` (unsigned 32-bit), range-checked.
fn guest_bytes<T>(
    caller: &Caller<'_, T>,
    memory: &wasmtime::Memory,
    ptr: i32,
    len: u64,
) -> Result<Vec<u8>, i32> {
    let start = u64::from(ptr as u32);
    let end = start
        .checked_add(len)
        .filter(|&e| e <= 1 << 32)
        .ok_or(crate::TWM_ERR_OVERFLOW)?;
    let data = memory.data(caller);
    let range = usize::try_from(start).map_err(|_| crate::TWM_ERR_OUT_OF_RANGE)?
        ..usize::try_from(end).map_err(|_| crate::TWM_ERR_OUT_OF_RANGE)?;
    data.get(range)
        .map(<[u8]>::to_vec)
        .ok_or(crate::TWM_ERR_OUT_OF_RANGE)
}

/// `twm.kernel(name_ptr, name_len)`: the handle of a registered kernel.
pub(crate) fn kernel_call<B: Backend, T: HasGuestContext<B>>(
    caller: &mut Caller<'_, T>,
    ptr: i32,
    len: i32,
) -> Result<i32, i32> {
    let registry = caller
        .data_mut()
        .guest_context()
        .creator()
        .kernels()
        .ok_or(TWM_ERR_UNKNOWN_KERNEL)?;
    let memory = crate::guest::guest_memory(caller)?;
    let len = u64::from(len as u32);
    // The whole range is checked; a name longer than any registered one is no kernel's.
    check_guest_range(caller, &memory, u64::from(ptr as u32), len)?;
    if len > MAX_KERNEL_NAME as u64 {
        return Err(TWM_ERR_UNKNOWN_KERNEL);
    }
    let name = guest_bytes(caller, &memory, ptr, len)?;
    registry.handle(&name).ok_or(TWM_ERR_UNKNOWN_KERNEL)
}

/// The checked arguments of one launch: a value per parameter, each buffer's guest range and
/// access, and the launch shape.
struct Checked {
    values: Vec<u64>,
    ranges: Vec<(u64, u64, Access)>,
    /// Each buffer's element size: its offset must be a multiple (a misaligned element makes
    /// a correct kernel fault, and a fault is sticky for its context's every tenant).
    elements: Vec<u64>,
    grid: [u32; 3],
    block: [u32; 3],
}

/// Checks `raw` (`(a, b)` per parameter) against `signature`: kinds, scalar widths, buffer
/// lengths, overlaps, shape. Ranges against the memory are checked when resolved.
fn check_args(signature: &KernelSignature, raw: &[(u64, u64)]) -> Result<Checked, i32> {
    if raw.len() != signature.params.len() {
        return Err(TWM_ERR_BAD_ARGUMENTS);
    }
    let scalar = |i: usize| -> Result<u64, i32> {
        match (signature.params.get(i), raw.get(i)) {
            (Some(KernelParam::Scalar(_)), Some(&(v, _))) => Ok(v),
            _ => Err(TWM_ERR_BAD_ARGUMENTS),
        }
    };
    let mut values = Vec::with_capacity(raw.len());
    let mut ranges = Vec::new();
    let mut elements = Vec::new();
    for (param, &(a, b)) in signature.params.iter().zip(raw) {
        match *param {
            KernelParam::Scalar(ty) => {
                let fits = match ty {
                    Scalar::U64 => true,
                    Scalar::U32 | Scalar::F32 => u32::try_from(a).is_ok(),
                };
                if b != 0 || !fits {
                    return Err(TWM_ERR_BAD_ARGUMENTS);
                }
                values.push(a);
            }
            KernelParam::Buffer {
                access,
                element_bytes,
                length,
            } => {
                let element = u64::from(element_bytes);
                if b % element != 0 {
                    return Err(TWM_ERR_BAD_ARGUMENTS);
                }
                let wanted = match length {
                    BufferLength::Any => None,
                    BufferLength::Elements(n) => Some(n),
                    BufferLength::Arg(i) => Some(scalar(i)?),
                };
                if wanted.is_some_and(|n| n.checked_mul(element) != Some(b)) {
                    return Err(TWM_ERR_BAD_ARGUMENTS);
                }
                values.push(0);
                ranges.push((a, b, access));
                elements.push(element);
            }
        }
    }
    let (grid, block) = match signature.shape {
        LaunchShape::Fixed { grid, block } => (grid, block),
        LaunchShape::PerElement { block, count } => {
            let n = scalar(count)?;
            let blocks = u32::try_from(n.div_ceil(u64::from(block)).max(1))
                .map_err(|_| TWM_ERR_BAD_ARGUMENTS)?;
            ([blocks, 1, 1], [block, 1, 1])
        }
    };
    Ok(Checked {
        values,
        ranges,
        elements,
        grid,
        block,
    })
}

/// Checks `offset..offset + len` against the guest's memory as the other `twm` calls do: an
/// end past the address space (2^32 for a 32-bit memory, 2^64 for a 64-bit one) is
/// [`TWM_ERR_OVERFLOW`](crate::TWM_ERR_OVERFLOW), an end past the current size
/// [`TWM_ERR_OUT_OF_RANGE`](crate::TWM_ERR_OUT_OF_RANGE).
fn check_guest_range<T>(
    caller: &Caller<'_, T>,
    memory: &wasmtime::Memory,
    offset: u64,
    len: u64,
) -> Result<(), i32> {
    let end = offset.checked_add(len).ok_or(crate::TWM_ERR_OVERFLOW)?;
    if !memory.ty(caller).is_64() && end > 1 << 32 {
        return Err(crate::TWM_ERR_OVERFLOW);
    }
    if end > memory.data_size(caller) as u64 {
        return Err(crate::TWM_ERR_OUT_OF_RANGE);
    }
    Ok(())
}

/// Refuses a launch whose buffers overlap where one of them is written.
fn check_overlaps(ranges: &[(u64, u64, Access)]) -> Result<(), i32> {
    for (i, &(a, n, access)) in ranges.iter().enumerate() {
        for &(c, m, other) in &ranges[i + 1..] {
            let overlap = n > 0 && m > 0 && a < c.saturating_add(m) && c < a.saturating_add(n);
            if overlap && (access.writes() || other.writes()) {
                return Err(TWM_ERR_BAD_ARGUMENTS);
            }
        }
    }
    Ok(())
}

/// Reads the `nargs` 16-byte arguments at `ptr`.
fn read_args<T>(
    caller: &Caller<'_, T>,
    memory: &wasmtime::Memory,
    ptr: i32,
    nargs: i32,
) -> Result<Vec<(u64, u64)>, i32> {
    let n = usize::try_from(nargs).map_err(|_| TWM_ERR_BAD_ARGUMENTS)?;
    if n > MAX_KERNEL_ARGS {
        return Err(TWM_ERR_BAD_ARGUMENTS);
    }
    let bytes = guest_bytes(caller, memory, ptr, n as u64 * 16)?;
    Ok(bytes
        .chunks_exact(16)
        .map(|c| {
            let word = |i: usize| {
                let mut w = [0u8; 8];
                w.copy_from_slice(&c[i..i + 8]);
                u64::from_le_bytes(w)
            };
            (word(0), word(8))
        })
        .collect())
}

/// `twm.launch(handle, args_ptr, nargs)`: checks, resolves, launches on the tenant's stream
/// and waits. See the [module docs](self).
pub(crate) fn launch_call<B: Backend, T: HasGuestContext<B>>(
    caller: &mut Caller<'_, T>,
    handle: i32,
    args_ptr: i32,
    nargs: i32,
) -> Result<(), i32> {
    let context = caller.data_mut().guest_context();
    let counters = Arc::clone(context.kernel_counters());
    let registry = context.creator().kernels().ok_or(TWM_ERR_UNKNOWN_KERNEL);
    let result = registry
        .map_err(NotRun::from)
        .and_then(|r| prepare_and_launch(caller, &r, handle, args_ptr, nargs, &counters));
    let counter = match result {
        Ok(()) => &counters.launches,
        Err(NotRun::Failed(_)) => &counters.failures,
        Err(NotRun::Refused(_)) => &counters.refused,
    };
    counter.fetch_add(1, Ordering::AcqRel);
    result.map_err(NotRun::code)
}

/// Why a launch did not complete, with the guest's code: turned away before anything was
/// queued (counted in the tenant's `refused_launches`: a bad argument, too many in flight, a
/// device lost before the launch), or failed once launched (its `kernel_failures`). A
/// neighbour's fault that fences the device before this launch runs is not this tenant's
/// kernel failure.
#[derive(Clone, Copy, Debug)]
enum NotRun {
    Refused(i32),
    Failed(i32),
}

impl NotRun {
    fn code(self) -> i32 {
        match self {
            Self::Refused(code) | Self::Failed(code) => code,
        }
    }
}

impl From<i32> for NotRun {
    fn from(code: i32) -> Self {
        Self::Refused(code)
    }
}

fn prepare_and_launch<B: Backend, T: HasGuestContext<B>>(
    caller: &mut Caller<'_, T>,
    registry: &KernelRegistry<B>,
    handle: i32,
    args_ptr: i32,
    nargs: i32,
    counters: &KernelCounters,
) -> Result<(), NotRun> {
    let entry = usize::try_from(handle)
        .ok()
        .and_then(|i| registry.entries.get(i))
        .ok_or(TWM_ERR_UNKNOWN_KERNEL)?;
    let memory = crate::guest::guest_memory(caller)?;
    let raw = read_args(caller, &memory, args_ptr, nargs)?;
    let mut checked = check_args(&entry.signature, &raw)?;
    let creator = caller.data_mut().guest_context().creator().clone();
    let view = MemoryView::of(&*caller, &memory).map_err(|e| crate::guest::code_for(&e))?;
    let device = creator
        .memory_device(view)
        .map_err(|e| crate::guest::code_for(&e))?;
    check_buffers(caller, &memory, &checked)?;
    let mut buffers = Vec::with_capacity(checked.ranges.len());
    for &(offset, len, _) in &checked.ranges {
        let slice = creator
            .resolve_at(view, offset, len)
            .map_err(|e| crate::guest::code_for(&e))?;
        buffers.push((slice.device_ptr, len));
    }
    let mut next = buffers.iter();
    for (param, value) in entry.signature.params.iter().zip(&mut checked.values) {
        if let KernelParam::Buffer { .. } = param
            && let Some(&(ptr, _)) = next.next()
        {
            *value = ptr;
        }
    }
    let in_flight = InFlight::take(counters, registry.max_in_flight)?;
    let context: &mut GuestContext<B> = caller.data_mut().guest_context();
    let stream = context
        .stream()
        .map_err(|e| crate::guest::code_for(&TwmError::backend(e)))?
        .stream();
    crate::guest::same_device(device, stream.device()).map_err(|e| crate::guest::code_for(&e))?;
    for &(offset, len, _) in &checked.ranges {
        // Pages go to the device where it migrates them; elsewhere this is refused as
        // unsupported, and the kernel reaches them where they are.
        let _ = creator.prefetch_at(view, offset, len, Location::Device(device), stream);
    }
    let launch = Launch {
        device,
        stream,
        args: &checked.values,
        buffers: &buffers,
        grid: checked.grid,
        block: checked.block,
    };
    let launched = launch_and_wait(&creator, &*entry.launcher, &launch, counters);
    if matches!(launched, Err(NotRun::Failed(WORK_MAY_RUN))) {
        // The kernel may still run: it keeps its place among the tenant's launches in flight
        // until the Store's stream is waited for.
        caller.data_mut().guest_context().launch_may_run();
        in_flight.keep();
    }
    launched
}

/// Launches on the checked `launch` and waits for its stream, whatever the launcher does; a
/// fault this launch's wait is the first to see is counted against the tenant.
fn launch_and_wait<B: Backend>(
    creator: &crate::TensorWasmMemoryCreator<B>,
    launcher: &dyn KernelLauncher<B>,
    launch: &Launch<'_>,
    counters: &KernelCounters,
) -> Result<(), NotRun> {
    let backend = creator.backend();
    // Device work of the layer's own: no reset of the primary context overlaps the launch and
    // its wait (the launcher's modules there stay valid while it runs). Refused on a fenced
    // device: the tenant's device state is lost, the guest traps.
    if let Err(e) = creator.begin_device_work(launch.device) {
        tracing::debug!(error = %e, "twm: a launch on a fenced device");
        return Err(NotRun::Refused(TWM_ERR_DEVICE_LOST));
    }
    // Ended after the wait (also while unwinding); on a fenced device the automatic recovery
    // it held back runs then.
    let _work = EndWork(creator, launch.device);
    // A recovery of the device by anyone since the creator last looked: the launchers hear
    // of it before they launch there (none can come now until the work ends).
    creator.settle();
    if creator.telling_launchers_here() {
        // A launcher told of a recovery called back into the creator, and this launch came
        // from there: a launcher after it may not have heard yet. Refused, as on a lost device.
        tracing::debug!("twm: a launch from inside a launcher's device_recovered: refused");
        return Err(NotRun::Refused(TWM_ERR_DEVICE_LOST));
    }
    // A fault this launch's wait sees happened during it (the work began on a healthy device,
    // and no recovery comes until it ends): counted against this tenant if no other launch
    // claimed it first (its kernel is the suspect). A context-isolated tenant's context is its
    // own: any fault there is its own.
    let own_context =
        launch.stream.level() == tensor_wasm_mem_core::IsolationLevel::ContextIsolated;
    // The stream is waited for whatever the launcher does: answers an error after queueing
    // work, or panics (the guard waits while unwinding, before the in-flight count goes): the
    // guest never runs, nor its memory goes, while work it launched still writes.
    let wait = WaitOnDrop {
        backend: &**backend,
        stream: launch.stream,
    };
    let launched = launcher.launch(backend, launch);
    let waited = wait.now();
    // A lost context is the answer whichever of the two saw it (a launcher that failed after
    // queueing the kernel does not hide the fault its wait saw): the fault is counted.
    let lost = |r: &Result<(), TwmError>| {
        r.as_ref()
            .is_err_and(|e| e.kind() == tensor_wasm_mem_core::ErrorKind::ContextLost)
    };
    if let Err(e) = &waited
        && !lost(&waited)
    {
        // Refused with a plain error, three tries: the kernel may still run, and the guest must
        // not go on over memory it may write (the host call traps).
        tracing::warn!(error = %e, "twm: waiting for a guest's kernel failed: it may still run");
        return Err(NotRun::Failed(WORK_MAY_RUN));
    }
    let result = if lost(&waited) && !lost(&launched) {
        waited
    } else {
        launched.and(waited)
    };
    result.map_err(|e| {
        let code = launch_failure(&e);
        if code == TWM_ERR_DEVICE_LOST {
            let faults = backend.device_health(launch.device).faults;
            if own_context || creator.claim_fault(launch.device, faults) {
                counters.faults.fetch_add(1, Ordering::AcqRel);
            }
        }
        NotRun::Failed(code)
    })
}

/// Ends the device work a launch began, when dropped (also while unwinding).
struct EndWork<'a, B: Backend>(&'a crate::TensorWasmMemoryCreator<B>, DeviceId);

impl<B: Backend> Drop for EndWork<'_, B> {
    fn drop(&mut self) {
        self.0.end_device_work(self.1);
    }
}

/// The code of a launch that failed: a fault loses its context for good (the guest traps),
/// anything else is the kernel's failure.
fn launch_failure(e: &TwmError) -> i32 {
    tracing::debug!(error = %e, "twm: a guest's kernel failed");
    if e.kind() == tensor_wasm_mem_core::ErrorKind::ContextLost {
        TWM_ERR_DEVICE_LOST
    } else {
        TWM_ERR_KERNEL_FAULT
    }
}

/// Checks the launch's buffers against the guest's memory as it is now (range, overflow), their
/// alignment, and the overlaps the signature forbids.
fn check_buffers<T>(
    caller: &Caller<'_, T>,
    memory: &wasmtime::Memory,
    checked: &Checked,
) -> Result<(), i32> {
    for &(offset, len, _) in &checked.ranges {
        check_guest_range(caller, memory, offset, len)?;
    }
    // Whole elements at aligned offsets (memories start page-aligned, so the device address is
    // aligned too): a misaligned load would fault a correct kernel, for the whole context.
    if checked
        .ranges
        .iter()
        .zip(&checked.elements)
        .any(|(&(offset, _, _), &element)| offset % element != 0)
    {
        return Err(TWM_ERR_BAD_ARGUMENTS);
    }
    check_overlaps(&checked.ranges)
}

/// Waits for a stream when dropped (a launcher's panic unwinding), or [`now`](Self::now).
struct WaitOnDrop<'a, B: Backend> {
    backend: &'a B,
    stream: &'a Stream,
}

impl<B: Backend> WaitOnDrop<'_, B> {
    /// Waits now (a refusal that may pass tried again: `lifecycle::wait_for_work`), with the
    /// driver's answer.
    fn now(self) -> Result<(), TwmError> {
        let waited = crate::lifecycle::wait_for_work(self.backend, self.stream.key())
            .map_err(TwmError::backend);
        std::mem::forget(self);
        waited
    }
}

impl<B: Backend> Drop for WaitOnDrop<'_, B> {
    fn drop(&mut self) {
        if let Err(e) = crate::lifecycle::wait_for_work(self.backend, self.stream.key()) {
            tracing::warn!(error = %e, "twm: waiting for a guest's stream after a launcher's panic failed");
        }
    }
}

/// A [`KernelLauncher`] for a kernel of the simulated device (the mock backend): the model's
/// `kernel` by name, its arguments made by `args` from the checked [`Launch`]. Its module is
/// loaded (and its function found) on first use, in the stream's context.
///
/// # Safety
///
/// `args` must give the kernel only pointers and lengths within the launch's
/// [`buffers`](Launch::buffers) (and write only through those the signature says are
/// written): the simulated kernel runs on the memory it is given, as a GPU's would.
#[cfg(feature = "mock")]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
pub unsafe fn simulated(
    kernel: &'static str,
    args: impl Fn(&Launch<'_>) -> Vec<u64> + Send + Sync + 'static,
) -> impl KernelLauncher<tensor_wasm_mem_mock::MockBackend> {
    Simulated {
        kernel,
        args,
        functions: std::sync::Mutex::new(std::collections::HashMap::new()),
    }
}

/// The most functions a [`simulated`] launcher keeps found (one per device, context and
/// recovery): past it, it forgets them all and finds them again as launches come.
#[cfg(feature = "mock")]
const SIMULATED_FUNCTIONS_KEPT: usize = 256;

/// Keeps `value` found for `key`. Contexts come and go (a context-isolated tenant's, one per
/// Store): a cache that only grew would keep an entry per context ever seen, so past
/// [`SIMULATED_FUNCTIONS_KEPT`] it starts again (a miss only finds the function again).
#[cfg(feature = "mock")]
fn remember<K: Eq + std::hash::Hash, V>(
    cache: &mut std::collections::HashMap<K, V>,
    key: K,
    value: V,
) {
    if cache.len() >= SIMULATED_FUNCTIONS_KEPT {
        cache.clear();
    }
    cache.insert(key, value);
}

#[cfg(all(test, feature = "mock"))]
mod tests {
    /// However many contexts a launcher sees, it keeps a bounded number of functions, and the
    /// one just found.
    #[test]
    fn the_simulated_launchers_cache_is_bounded() {
        let mut cache = std::collections::HashMap::new();
        for context in 0..(3 * super::SIMULATED_FUNCTIONS_KEPT as u64) {
            super::remember(&mut cache, context, context);
            assert!(cache.len() <= super::SIMULATED_FUNCTIONS_KEPT);
            assert_eq!(cache.get(&context), Some(&context));
        }
    }
}

/// The launcher [`simulated`] makes.
#[cfg(feature = "mock")]
struct Simulated<F> {
    kernel: &'static str,
    args: F,
    /// The function found per (device, context, recoveries of the device): a module belongs to
    /// the context it was loaded in (as on a GPU), and a reset of a primary context unloads
    /// every module in it. A recovery forgets the device's older entries.
    functions: std::sync::Mutex<
        std::collections::HashMap<(DeviceId, u64, u64), tensor_wasm_mem_mock::Function>,
    >,
}

#[cfg(feature = "mock")]
impl<F> KernelLauncher<tensor_wasm_mem_mock::MockBackend> for Simulated<F>
where
    F: Fn(&Launch<'_>) -> Vec<u64> + Send + Sync + 'static,
{
    fn launch(
        &self,
        backend: &tensor_wasm_mem_mock::MockBackend,
        launch: &Launch<'_>,
    ) -> Result<(), TwmError> {
        use tensor_wasm_mem_core::{DriverApi, DriverContext, ManagedAllocator};
        let driver = backend.driver();
        let key = (
            launch.device(),
            launch.stream().context(),
            backend.device_health(launch.device()).recoveries,
        );
        let cached = self.functions().get(&key).copied();
        let function = match cached {
            Some(f) => f,
            None => {
                // Loading a module needs a context current: the stream's.
                driver
                    .push_current(DriverContext::from_raw(key.1))
                    .map_err(TwmError::backend)?;
                let loaded = driver
                    .load_module()
                    .and_then(|m| driver.get_function(m, self.kernel));
                driver.pop_current().map_err(TwmError::backend)?;
                // Only a function found is kept: a failure is tried again next time.
                let found = loaded.map_err(TwmError::backend)?;
                remember(&mut self.functions(), key, found);
                found
            }
        };
        // SAFETY: the guest's Store is held by the host call for the whole launch, which waits
        // for the stream before returning: nothing else touches the buffers meanwhile; every
        // buffer was checked inside the guest's memory, and `args` keeps to them (the caller
        // of `simulated` promised).
        unsafe { driver.launch(launch.stream(), function, &(self.args)(launch)) }
            .map_err(TwmError::backend)
    }

    fn device_recovered(&self, backend: &tensor_wasm_mem_mock::MockBackend, device: DeviceId) {
        use tensor_wasm_mem_core::ManagedAllocator;
        let now = backend.device_health(device).recoveries;
        self.functions()
            .retain(|&(d, _, recoveries), _| d != device || recoveries >= now);
    }
}

#[cfg(feature = "mock")]
impl<F> Simulated<F> {
    fn functions(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        std::collections::HashMap<(DeviceId, u64, u64), tensor_wasm_mem_mock::Function>,
    > {
        self.functions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A buffer of bytes of any length, accessed as `access` (the built-in kernels' buffers).
#[cfg(feature = "mock")]
fn bytes(access: Access) -> KernelParam {
    KernelParam::Buffer {
        access,
        element_bytes: 1,
        length: BufferLength::Any,
    }
}

/// One block of 256 threads (the built-in byte kernels' shape).
#[cfg(feature = "mock")]
const ONE_BLOCK: LaunchShape = LaunchShape::Fixed {
    grid: [1, 1, 1],
    block: [256, 1, 1],
};

/// `poke(buf, index, value)`: a byte buffer written, two `u32` scalars, one block.
#[cfg(feature = "mock")]
fn poke_signature() -> KernelSignature {
    KernelSignature {
        params: vec![
            bytes(Access::Write),
            KernelParam::Scalar(Scalar::U32),
            KernelParam::Scalar(Scalar::U32),
        ],
        shape: ONE_BLOCK,
    }
}

/// The simulated kernels `twm run --kernels builtin` offers (mock backend): `fill(buf, value)`
/// (bytes), `increment(buf)` (bytes), `saxpy(a, x, y, n)`: `y[i] = a * x[i] + y[i]` over `n`
/// `f32`s (`a` an `f32`, `x` read, `y` read and written, one thread an element); and
/// `poke(buf, index, value)`: `buf[index] = value` (a byte) behind a device-side
/// `assert(index < len)`, so an index past the buffer faults the tenant's context (as
/// `CUDA_ERROR_ASSERT` does on a GPU) without writing: the way a tenant's data makes a trusted
/// kernel fault (docs/RELIABILITY.md, recovery).
#[cfg(feature = "mock")]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
pub fn builtin() -> KernelRegistry<tensor_wasm_mem_mock::MockBackend> {
    let floats = |access| KernelParam::Buffer {
        access,
        element_bytes: 4,
        length: BufferLength::Arg(3),
    };
    let one = ONE_BLOCK;
    let mut registry = KernelRegistry::new();
    let registered = registry
        .register(
            "fill",
            KernelSignature {
                params: vec![bytes(Access::Write), KernelParam::Scalar(Scalar::U32)],
                shape: one,
            },
            // SAFETY: `fill` writes its one buffer: its pointer and byte length.
            unsafe { simulated("fill", |l| vec![l.args()[0], l.buffers()[0].1, l.args()[1]]) },
        )
        .and_then(|r| {
            r.register(
                "increment",
                KernelSignature {
                    params: vec![bytes(Access::ReadWrite)],
                    shape: one,
                },
                // SAFETY: `increment` writes its one buffer: its pointer and byte length.
                unsafe { simulated("increment", |l| vec![l.args()[0], l.buffers()[0].1]) },
            )
        })
        .and_then(|r| {
            r.register(
                "saxpy",
                KernelSignature {
                    params: vec![
                        KernelParam::Scalar(Scalar::F32),
                        floats(Access::Read),
                        floats(Access::ReadWrite),
                        KernelParam::Scalar(Scalar::U32),
                    ],
                    shape: LaunchShape::PerElement {
                        block: 256,
                        count: 3,
                    },
                },
                // SAFETY: `axpy(a, x, y, n)` reads `n` floats of `x` and writes `n` of `y`,
                // both checked to be `n` floats long.
                unsafe { simulated("axpy", |l| l.args().to_vec()) },
            )
        })
        .and_then(|r| {
            r.register(
                "poke",
                poke_signature(),
                // SAFETY: `poke(data, len, index, value)` writes one byte of its buffer (its
                // pointer and byte length), or fails its device-side assert when `index` is
                // past the end and writes nothing.
                unsafe {
                    simulated("poke", |l| {
                        vec![l.args()[0], l.buffers()[0].1, l.args()[1], l.args()[2]]
                    })
                },
            )
        })
        .map(|_| ());
    debug_assert!(registered.is_ok(), "the built-in signatures are valid");
    registry
}
