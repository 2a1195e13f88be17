//! Per-tenant device memory pools with a real cap.

use alloc::sync::Arc;
use core::fmt;

use hashbrown::HashMap;

use crate::device::DeviceId;
use crate::driver::DriverPool;
use crate::error::{Error, ErrorType, Operation};
use crate::ledger::{Purpose, Reservation, TenantId, TenantKey, TenantLedger};
use crate::stream::Stream;

/// How to make a device memory pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevicePoolConfig {
    /// The driver-side maximum size of the pool in bytes (`0`: no driver-side maximum; the
    /// tenant's ledger is the ceiling either way).
    pub max_bytes: u64,
    /// How many freed bytes the pool may keep instead of giving them back to the driver.
    pub release_threshold: u64,
}

/// A pool handle: the backend's pool (a typed driver handle), its device and tenant. Not
/// `Clone`: destroyed once.
#[derive(Debug, PartialEq, Eq)]
pub struct PoolHandle {
    pool: DriverPool,
    device: DeviceId,
    tenant: TenantKey,
}

impl PoolHandle {
    /// Builds a handle (for backends).
    #[must_use]
    pub const fn new(pool: DriverPool, device: DeviceId, tenant: TenantKey) -> Self {
        Self {
            pool,
            device,
            tenant,
        }
    }

    /// The driver pool.
    #[must_use]
    pub const fn driver_pool(&self) -> DriverPool {
        self.pool
    }

    /// The pool's value for a foreign call (`CUmemoryPool` as an integer).
    #[must_use]
    pub const fn raw(&self) -> u64 {
        self.pool.raw()
    }

    /// The device.
    #[must_use]
    pub const fn device(&self) -> DeviceId {
        self.device
    }

    /// The id of the tenant it was made for.
    #[must_use]
    pub const fn tenant(&self) -> TenantId {
        self.tenant.id()
    }

    /// The identity of the tenant it was made for (what backends check).
    #[must_use]
    pub const fn tenant_key(&self) -> TenantKey {
        self.tenant
    }
}

/// A device-only buffer from a pool: a device pointer and a length. Not `Clone`: freed once.
/// It grants no host access (device memory is not host-accessible).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct PoolAllocation {
    ptr: u64,
    len: usize,
}

impl PoolAllocation {
    /// Builds a handle (for backends).
    #[must_use]
    pub const fn new(ptr: u64, len: usize) -> Self {
        Self { ptr, len }
    }

    /// The device pointer.
    #[must_use]
    pub const fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The length in bytes.
    #[must_use]
    pub const fn len(&self) -> usize {
        self.len
    }

    /// `true` for an empty buffer (never handed out).
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The most bytes a device pool's figures may say the driver reserves (1 EiB, past any
/// device's memory): a read past it is a driver's error
/// ([`Error::ImplausiblePoolFigures`]), treated as a read that failed, never charged.
pub const MAX_POOL_BYTES: u64 = 1 << 60;

/// Figures of one pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevicePoolStats {
    /// Bytes allocated from the pool and not freed.
    pub live_bytes: u64,
    /// The most ever live at once.
    pub peak_bytes: u64,
    /// Bytes the driver holds for the pool (live plus kept free memory).
    pub reserved_bytes: u64,
    /// Allocations alive.
    pub live_allocations: u64,
}

/// Stream-ordered device memory pools.
///
/// Implementors guarantee that [`pool_allocate`](Self::pool_allocate) returns memory of at least
/// `bytes` bytes, zero-filled in stream order, disjoint from every other live allocation, and
/// that [`destroy_pool`](Self::destroy_pool) frees what is still allocated from the pool.
/// Backends without pools answer every call with an error of kind `Unsupported`.
pub trait DevicePools: ErrorType {
    /// Makes a pool on `device` for `tenant`.
    fn create_pool(
        &self,
        tenant: TenantKey,
        device: DeviceId,
        config: &DevicePoolConfig,
    ) -> Result<PoolHandle, Self::Error>;

    /// Allocates `bytes` (non-zero) from `pool`, ordered on `stream`, zero-filled.
    fn pool_allocate(
        &self,
        pool: &PoolHandle,
        bytes: usize,
        stream: &Stream,
    ) -> Result<PoolAllocation, Self::Error>;

    /// Frees an allocation of `pool`, ordered on `stream`.
    fn pool_free(
        &self,
        pool: &PoolHandle,
        allocation: PoolAllocation,
        stream: &Stream,
    ) -> Result<(), Self::Error>;

    /// Gives freed memory back to the driver until the pool holds at most `keep_bytes` (or what
    /// is live).
    fn trim_pool(&self, pool: &PoolHandle, keep_bytes: u64) -> Result<(), Self::Error>;

    /// The pool's figures.
    fn pool_stats(&self, pool: &PoolHandle) -> Result<DevicePoolStats, Self::Error>;

    /// Destroys the pool, freeing what is still allocated from it.
    fn destroy_pool(&self, pool: PoolHandle) -> Result<(), Self::Error>;

    /// [`destroy_pool`](Self::destroy_pool), handing over `charges`: what the pool's tenant
    /// still pays for blocks whose free was refused at teardown. A charge is given back only
    /// when what it pays for is really gone: with the pool, whenever that is (now, when its
    /// last call in flight tears it down, a later retry, or a recovery's reset of its device),
    /// and stranded ([`Reservation::strand`]) where the backend gives the pool up for good.
    /// The default destroys now: the charges go back if the destroy succeeds, and are
    /// stranded if it fails (the backend may still hold the blocks).
    fn destroy_pool_charged(
        &self,
        pool: PoolHandle,
        charges: alloc::vec::Vec<Reservation>,
    ) -> Result<(), Self::Error> {
        let destroyed = self.destroy_pool(pool);
        if destroyed.is_err() {
            charges.into_iter().for_each(Reservation::strand);
        }
        destroyed
    }

    /// Frees an allocation of `pool` at teardown, when the caller has no stream of its own to
    /// order it on: the backend orders the free after the work queued on the stream the
    /// allocation was made on (while that stream lives), or on a stream of its own in the
    /// pool's context. No default: only the backend knows its contexts and streams, and a
    /// handle made up here would name a stream no one owns.
    fn pool_free_at_teardown(
        &self,
        pool: &PoolHandle,
        allocation: PoolAllocation,
    ) -> Result<(), Self::Error>;
}

macro_rules! forward_pools {
    ($($ty:ty),*) => {$(
        impl<T: DevicePools + ?Sized> DevicePools for $ty {
            fn create_pool(
                &self,
                tenant: TenantKey,
                device: DeviceId,
                config: &DevicePoolConfig,
            ) -> Result<PoolHandle, Self::Error> {
                T::create_pool(self, tenant, device, config)
            }
            fn pool_allocate(
                &self,
                pool: &PoolHandle,
                bytes: usize,
                stream: &Stream,
            ) -> Result<PoolAllocation, Self::Error> {
                T::pool_allocate(self, pool, bytes, stream)
            }
            fn pool_free(
                &self,
                pool: &PoolHandle,
                allocation: PoolAllocation,
                stream: &Stream,
            ) -> Result<(), Self::Error> {
                T::pool_free(self, pool, allocation, stream)
            }
            fn trim_pool(&self, pool: &PoolHandle, keep_bytes: u64) -> Result<(), Self::Error> {
                T::trim_pool(self, pool, keep_bytes)
            }
            fn pool_stats(&self, pool: &PoolHandle) -> Result<DevicePoolStats, Self::Error> {
                T::pool_stats(self, pool)
            }
            fn destroy_pool(&self, pool: PoolHandle) -> Result<(), Self::Error> {
                T::destroy_pool(self, pool)
            }
            fn destroy_pool_charged(
                &self,
                pool: PoolHandle,
                charges: alloc::vec::Vec<Reservation>,
            ) -> Result<(), Self::Error> {
                T::destroy_pool_charged(self, pool, charges)
            }
            fn pool_free_at_teardown(
                &self,
                pool: &PoolHandle,
                allocation: PoolAllocation,
            ) -> Result<(), Self::Error> {
                T::pool_free_at_teardown(self, pool, allocation)
            }
        }
    )*};
}

forward_pools!(&T, alloc::boxed::Box<T>, alloc::sync::Arc<T>);

/// A tenant's device memory pool with the tenant's cap as its ceiling.
///
/// A tenant's GPU work needs device-only buffers besides its linear memory (scratch space,
/// tensors a kernel writes). Drivers offer stream-ordered memory pools for that, but a pool's
/// "release threshold" only says how much *freed* memory the pool keeps: it is no ceiling.
/// [`TenantDevicePool`] is the ceiling: every byte is charged to the tenant's one
/// [`TenantLedger`] ledger (the same cap as its linear memories, [`Purpose::DevicePool`]) before
/// the driver is asked. The driver's own pool maximum ([`DevicePoolConfig::max_bytes`],
/// `CUmemPoolProps.maxSize` where the driver has it) is a second line behind the ledger.
///
/// **What is charged is what the driver holds.** A driver hands out whole blocks (the
/// simulated one rounds each allocation up to a page; CUDA reserves a pool's memory in chunks
/// of megabytes) and keeps freed blocks for reuse up to the release threshold. So besides the
/// bytes each live allocation asked for, the tenant pays for the rest of what the driver
/// reserves for its pool ([`DevicePoolStats::reserved_bytes`]): after every allocation, free,
/// trim and read of the figures, the pool's *kept* charge is brought to the reserved bytes
/// less the live ones. An allocation whose rounding the tenant cannot pay for is given back
/// and refused ([`Error::Denied`]), and the pool trimmed to what is paid for; a freed block
/// stays charged while the pool keeps it, and is given back by a trim ([`trim`](Self::trim))
/// or the driver's release above the threshold, at the next call that reads the figures. A
/// tenant whose cap is below the driver's chunk cannot allocate from a pool at all: it would
/// hold more than its cap.
///
/// **Scrubbing.** Pools are per tenant, so memory a tenant frees returns to its own pool and is
/// only ever reused by the same tenant. But a pool gives memory back to the driver (trimming, or
/// above its release threshold), and the driver may hand those pages to another tenant's pool:
/// so every [`DevicePools::pool_allocate`] returns memory zero-filled (stream-ordered, before any
/// later work on the stream), whatever the driver gave it.
///
/// Backends without pools (cust 0.3 has no pool API; the reserved cuda-oxide slot) answer every
/// call with an error of kind [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported).
///
/// Dropping it frees every allocation still live (each ordered after the work on the stream it
/// was made on), destroys the pool and gives every byte back to the ledger.
pub struct TenantDevicePool<P: DevicePools> {
    backend: P,
    tenant: Arc<TenantLedger>,
    pool: Option<PoolHandle>,
    books: spin::Mutex<PoolBooks>,
}

/// Bytes a call under way counts in [`PoolBooks::outside`], taken out again when it ends
/// ([`end`](Self::end)), or, should a backend panic mid-call, when it unwinds (the charge it
/// counted drops with it then, and the next read of the figures charges what the driver
/// holds).
struct Outside<'a> {
    books: &'a spin::Mutex<PoolBooks>,
    bytes: u64,
}

impl<'a> Outside<'a> {
    /// Counts `bytes` in `books` (held: the guard of `lock`) until the call ends.
    fn count(lock: &'a spin::Mutex<PoolBooks>, books: &mut PoolBooks, bytes: u64) -> Self {
        books.outside += bytes;
        books.changes += 1;
        Self { books: lock, bytes }
    }

    /// `more` bytes counted besides (in the books too).
    fn grow(&mut self, more: u64) {
        self.books.lock().outside += more;
        self.bytes += more;
    }

    /// Takes the bytes out and runs `f` in the same hold of the lock (the charge moves from
    /// `outside` to where `f` puts it at once).
    fn end(mut self, f: impl FnOnce(&mut PoolBooks)) {
        // Taken out once: should `f` unwind, the guard's drop takes out nothing more.
        let bytes = core::mem::take(&mut self.bytes);
        let mut books = self.books.lock();
        books.outside -= bytes;
        books.changes += 1;
        f(&mut books);
    }
}

impl Drop for Outside<'_> {
    fn drop(&mut self) {
        let mut books = self.books.lock();
        books.outside -= self.bytes;
        books.changes += 1;
    }
}

/// What a tenant's pool charges: each live allocation's bytes, and the rest of what the
/// driver reserves for the pool (its rounding, and the blocks it keeps).
#[derive(Debug)]
struct PoolBooks {
    /// device pointer -> the ledger charge for it (the bytes it asked for).
    live: HashMap<u64, Reservation>,
    /// The sum of `live`'s charges.
    live_bytes: u64,
    /// Charges of calls under way, held apart from `live` and `kept`: an allocation's before
    /// its block joins `live`, a free's while the driver frees.
    outside: u64,
    /// The driver's reserved bytes beyond `live_bytes` and `outside`, as last read.
    kept: Reservation,
    /// Counts changes to `live` and `outside`: a read of the driver's reserved bytes made
    /// before a change may be stale, and is trusted to grow `kept`, never to shrink it.
    changes: u64,
    /// The last read found the driver holding more for the pool than the tenant could pay for
    /// within its limits (a refused allocation's block whose free the stream has not reached),
    /// charged past them, or could not read the figures at all: the next allocation settles
    /// first (trimming what the driver can let go), and asks the driver for nothing while the
    /// tenant is still past its limits or the figures unread.
    unpaid: bool,
}

impl PoolBooks {
    /// The driver's figures could not be read, or not believed: the pool may hold more than
    /// is paid for, so nothing more is asked of the driver until a read says otherwise. It
    /// counts as a change, so a read older than this one cannot clear the mark.
    fn unread(&mut self) {
        self.unpaid = true;
        self.changes += 1;
    }

    fn insert(&mut self, ptr: u64, charge: Reservation) {
        self.live_bytes += charge.bytes();
        self.changes += 1;
        if let Some(old) = self.live.insert(ptr, charge) {
            // The driver handed out an address this pool still records: a free it refused
            // was done after all. That block's charge stays with what the pool keeps (the
            // next read of the driver's figures settles it).
            self.live_bytes -= old.bytes();
            let _ = self.kept.absorb(old);
        }
    }

    fn remove(&mut self, ptr: u64) -> Option<Reservation> {
        let charge = self.live.remove(&ptr)?;
        self.live_bytes -= charge.bytes();
        self.changes += 1;
        Some(charge)
    }
}

impl<P: DevicePools> fmt::Debug for TenantDevicePool<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantDevicePool")
            .field("tenant", &self.tenant.id())
            .field("pool", &self.pool)
            .field("live_allocations", &self.books.lock().live.len())
            .finish_non_exhaustive()
    }
}

impl<P: DevicePools> TenantDevicePool<P> {
    /// Makes a pool for `tenant` on `device`.
    pub fn new(
        backend: P,
        tenant: Arc<TenantLedger>,
        device: DeviceId,
        config: &DevicePoolConfig,
    ) -> Result<Self, Error<P::Error>> {
        let pool = backend
            .create_pool(tenant.key(), device, config)
            .map_err(|e| Error::backend(Operation::CreatePool, e))?;
        let kept = tenant.empty_reservation(Purpose::DevicePool);
        Ok(Self {
            backend,
            tenant,
            pool: Some(pool),
            books: spin::Mutex::new(PoolBooks {
                live: HashMap::new(),
                live_bytes: 0,
                outside: 0,
                kept,
                changes: 0,
                unpaid: false,
            }),
        })
    }

    /// Reads the driver's figures and brings the kept charge to its reserved bytes less the
    /// bytes charged elsewhere (the live allocations, and those of calls under way). If the
    /// tenant cannot pay for more, the pool is first trimmed to what is paid for (kept blocks
    /// the driver can let go: a block whose free the stream has not reached yet stays) and read
    /// again. What is still unpaid is then [`Error::Denied`] (the charge as it was), or, with
    /// `force`, charged past the tenant's limits: the tenant holds it, and is denied everything
    /// else until it goes.
    fn settle(&self, force: bool) -> Result<DevicePoolStats, Error<P::Error>> {
        match self.settle_once(false) {
            Ok(stats) if !self.books.lock().unpaid => Ok(stats),
            // Unread: the driver lets go of what it keeps all the same (best effort), so that
            // blocks it holds unpaid for do not stay while the figures cannot be read.
            Err(e) if !matches!(e, Error::Denied(_)) => {
                let _ = self.let_go_of_kept();
                Err(e)
            }
            // Past what the tenant can pay for (or still charged past its limits): the driver
            // lets go of every block it keeps for the pool, and the books are read again.
            _ => {
                let trimmed = self.let_go_of_kept();
                let settled = self.settle_once(force);
                trimmed.map_err(|e| Error::backend(Operation::TrimPool, e))?;
                settled
            }
        }
    }

    /// Has the driver let go of every block it keeps for the pool (trimmed to what the live
    /// allocations and the calls under way need).
    fn let_go_of_kept(&self) -> Result<(), P::Error> {
        let needed = {
            let books = self.books.lock();
            books.live_bytes + books.outside
        };
        self.backend.trim_pool(self.handle(), needed)
    }

    fn settle_once(&self, force: bool) -> Result<DevicePoolStats, Error<P::Error>> {
        let changes = self.books.lock().changes;
        let stats = match self.backend.pool_stats(self.handle()) {
            Ok(stats) if stats.reserved_bytes > MAX_POOL_BYTES => {
                // No device holds that much: a driver's error, not memory.
                self.books.lock().unread();
                return Err(Error::ImplausiblePoolFigures {
                    reserved: stats.reserved_bytes,
                });
            }
            Ok(stats) => stats,
            Err(e) => {
                self.books.lock().unread();
                return Err(Error::backend(Operation::PoolStats, e));
            }
        };
        let mut books = self.books.lock();
        // A read older than a change to what is charged elsewhere may be missing a block
        // another call just got: it grows the kept charge, never shrinks it.
        let fresh = books.changes == changes;
        let elsewhere = books.live_bytes + books.outside;
        let target = stats.reserved_bytes.saturating_sub(elsewhere);
        let kept = books.kept.bytes();
        if target > kept {
            if let Err(denied) = books.kept.try_grow(target - kept) {
                books.unpaid = true;
                if !force {
                    return Err(denied.into());
                }
                if books.kept.grow_past_limits(target - kept).is_err() {
                    // More than the tenant's books can count, with what it holds elsewhere
                    // (other pools, say): a driver's error, as above.
                    books.unread();
                    return Err(Error::ImplausiblePoolFigures {
                        reserved: stats.reserved_bytes,
                    });
                }
                books.unpaid = true;
                return Ok(stats);
            }
        } else if fresh {
            books.kept.shrink_to(target);
        }
        if fresh {
            books.unpaid = !self.tenant.within_limits();
        }
        Ok(stats)
    }

    fn handle(&self) -> &PoolHandle {
        // `Some` from construction until drop.
        self.pool.as_ref().unwrap_or_else(|| unreachable!())
    }

    /// The tenant.
    pub fn tenant(&self) -> &Arc<TenantLedger> {
        &self.tenant
    }

    /// Allocates `bytes` (zero-filled, ordered on `stream`), charging the tenant first: past its
    /// cap this is [`Error::Denied`] and the driver is never asked. Once the driver has it, the
    /// rest of what the driver now reserves for the pool is charged too; if the tenant cannot
    /// pay for that (the driver's rounding took it past its cap), the allocation is freed
    /// (ordered on `stream`), the pool trimmed to what is paid for, and this is
    /// [`Error::Denied`]. A block the driver still holds after that (its free not reached
    /// yet) stays charged, past the cap if need be, until it goes.
    pub fn allocate(
        &self,
        bytes: usize,
        stream: &Stream,
    ) -> Result<PoolAllocation, Error<P::Error>> {
        // Blocks held unpaid for (or figures unread): they go, or are read, first.
        if self.books.lock().unpaid {
            self.settle(true)?;
        }
        // Paid first from what the pool keeps (the driver may hand a kept block out again),
        // the rest charged anew; counted apart (`outside`) until it joins the live ones.
        let (mut charge, mut outside) = {
            let mut books = self.books.lock();
            let charge = books.kept.split(bytes as u64);
            let outside = Outside::count(&self.books, &mut books, charge.bytes());
            (charge, outside)
        };
        let carved = charge.bytes();
        // The carved part goes back to what the pool keeps, the rest back to the tenant.
        let undo = |mut charge: Reservation, outside: Outside<'_>| {
            outside.end(|books| drop(books.kept.absorb(charge.split(carved))));
        };
        match charge.try_grow(bytes as u64 - carved) {
            Ok(()) => outside.grow(bytes as u64 - carved),
            Err(denied) => {
                undo(charge, outside);
                return Err(denied.into());
            }
        }
        let allocation = match self.backend.pool_allocate(self.handle(), bytes, stream) {
            Ok(allocation) => allocation,
            Err(e) => {
                undo(charge, outside);
                // The driver may have reserved memory all the same (a chunk mapped, then its
                // zero-fill refused): read what it holds.
                let _ = self.settle(true);
                return Err(Error::backend(Operation::PoolAllocate, e));
            }
        };
        outside.end(|books| books.insert(allocation.device_ptr(), charge));
        let refused = match self.settle(false) {
            Ok(_) => return Ok(allocation),
            Err(e) => e,
        };
        // The driver holds more for the pool than the tenant pays for: the allocation goes
        // back. Its free settles the books again: what the driver still holds for the pool
        // (this block, until the stream gets to its free) stays charged, past the cap if need
        // be. A refused free leaves the block live and charged in the pool's record, freed
        // when the pool goes (the caller never had it).
        let _ = self.free(allocation, stream);
        Err(refused)
    }

    /// Frees an allocation of this pool (ordered on `stream`). An allocation this pool does
    /// not hold is refused before the driver is asked.
    ///
    /// The charge leaves the pool's record *before* the driver frees: once the driver has the
    /// block back it may hand the same address to another thread's [`allocate`](Self::allocate)
    /// at once, whose record must not be touched by this call. If the driver refuses the free,
    /// the charge goes back into the record (the block is still the tenant's, and is freed when
    /// the pool drops).
    ///
    /// A freed block stays charged while the driver keeps it for the pool (under the release
    /// threshold): its charge joins the pool's kept charge, which follows the driver's reserved
    /// bytes from then on.
    pub fn free(&self, allocation: PoolAllocation, stream: &Stream) -> Result<(), Error<P::Error>> {
        let ptr = allocation.device_ptr();
        let taken = {
            let mut books = self.books.lock();
            let ours = books
                .live
                .get(&ptr)
                .is_some_and(|c| c.bytes() == allocation.len() as u64);
            ours.then(|| books.remove(ptr)).flatten().map(|charge| {
                // Counted apart while the driver frees: still charged, and no one else's.
                let outside = Outside::count(&self.books, &mut books, charge.bytes());
                (charge, outside)
            })
        };
        let Some((charge, outside)) = taken else {
            return Err(Error::UnknownPoolAllocation { ptr });
        };
        let freed = self.backend.pool_free(self.handle(), allocation, stream);
        outside.end(|books| match freed {
            // Same tenant and purpose: never handed back.
            Ok(()) => drop(books.kept.absorb(charge)),
            Err(_) => books.insert(ptr, charge),
        });
        // Down to what the driver still holds (a refused free too: the driver's rounding of
        // the block it kept); a refused read keeps the charge (too much, never too little)
        // until the next.
        let _ = self.settle(true);
        freed.map_err(|e| Error::backend(Operation::PoolFree, e))
    }

    /// Gives freed memory back to the driver, keeping at most `keep_bytes`, and the tenant's
    /// charge for what went.
    pub fn trim(&self, keep_bytes: u64) -> Result<(), Error<P::Error>> {
        self.backend
            .trim_pool(self.handle(), keep_bytes)
            .map_err(|e| Error::backend(Operation::TrimPool, e))?;
        let _ = self.settle(true);
        Ok(())
    }

    /// The pool's figures (and the tenant's charge brought to them).
    pub fn stats(&self) -> Result<DevicePoolStats, Error<P::Error>> {
        self.settle(true)
    }

    /// Bytes charged to the tenant for this pool: what its live allocations asked for, and
    /// the rest of what the driver reserved for it when last read (with what calls under way
    /// hold).
    #[must_use]
    pub fn charged_bytes(&self) -> u64 {
        let books = self.books.lock();
        books.live_bytes + books.outside + books.kept.bytes()
    }
}

impl<P: DevicePools> Drop for TenantDevicePool<P> {
    /// Frees every allocation still live (the backend orders each free after the work on the
    /// stream the allocation was made on: [`DevicePools::pool_free_at_teardown`]), then
    /// destroys the pool, which retries what the backend refused to free, handing it every
    /// charge the pool carries ([`DevicePools::destroy_pool_charged`]): the live blocks', and
    /// what the driver kept for the pool. They go back when the pool is really gone (a driver
    /// backend keeps a pool whose destroy is refused, and a recovery's reset destroys it,
    /// after a kernel fault), and stay with the tenant for good ([`Reservation::strand`])
    /// where it never goes.
    fn drop(&mut self) {
        let Some(pool) = self.pool.take() else {
            return;
        };
        let (live, kept) = {
            let books = &mut *self.books.lock();
            let kept = core::mem::replace(
                &mut books.kept,
                self.tenant.empty_reservation(Purpose::DevicePool),
            );
            let live: alloc::vec::Vec<(u64, Reservation)> = books.live.drain().collect();
            (live, kept)
        };
        // What the driver kept for the pool goes with the pool: back when it is really gone.
        let mut charges = alloc::vec![kept];
        for (ptr, charge) in live {
            // A `PoolAllocation` is rebuilt from what this pool handed out; its length is the
            // charge.
            let allocation = PoolAllocation::new(ptr, charge.bytes() as usize);
            match self.backend.pool_free_at_teardown(&pool, allocation) {
                // The driver may keep the block for the pool until it goes: so does its charge.
                Ok(()) => {
                    if let Err(charge) = charges[0].absorb(charge) {
                        charges.push(charge);
                    }
                }
                Err(_) => charges.push(charge),
            }
        }
        // Every charge goes with the pool: back when it is really gone.
        let _ = self.backend.destroy_pool_charged(pool, charges);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{BackendError, ErrorKind, ErrorType};
    use crate::isolation::IsolationLevel;
    use alloc::string::ToString;

    /// A driver-less pool: hands out increasing addresses, fails when told to.
    #[derive(Default)]
    struct Counting {
        next: spin::Mutex<u64>,
        live: spin::Mutex<u64>,
        fail: spin::Mutex<bool>,
        /// Allocations the driver was asked for.
        asked: spin::Mutex<u64>,
        /// What the driver says it reserves for the pool.
        reserved: spin::Mutex<u64>,
        /// `pool_stats` fails.
        stats_fail: spin::Mutex<bool>,
        /// `destroy_pool` fails.
        destroy_fail: spin::Mutex<bool>,
        /// `pool_allocate` fails.
        allocate_fail: spin::Mutex<bool>,
        /// `pool_free` fails.
        free_fail: spin::Mutex<bool>,
        /// What the last trim was asked to keep.
        trimmed_to: spin::Mutex<Option<u64>>,
        /// Runs once, inside the next `pool_stats`, before it reads (another call beside it).
        beside: spin::Mutex<Option<alloc::boxed::Box<dyn FnOnce() + Send + Sync>>>,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("counting pool failed")]
    struct Failed;

    impl BackendError for Failed {
        fn kind(&self) -> ErrorKind {
            ErrorKind::OutOfMemory
        }
    }

    impl ErrorType for Counting {
        type Error = Failed;
    }

    impl DevicePools for Counting {
        fn create_pool(
            &self,
            tenant: TenantKey,
            device: DeviceId,
            _: &DevicePoolConfig,
        ) -> Result<PoolHandle, Failed> {
            Ok(PoolHandle::new(
                crate::DriverPool::from_raw(1),
                device,
                tenant,
            ))
        }
        fn pool_allocate(
            &self,
            _: &PoolHandle,
            bytes: usize,
            _: &Stream,
        ) -> Result<PoolAllocation, Failed> {
            *self.asked.lock() += 1;
            if *self.fail.lock() || *self.allocate_fail.lock() {
                return Err(Failed);
            }
            let mut next = self.next.lock();
            *next += 0x1000;
            *self.live.lock() += 1;
            Ok(PoolAllocation::new(*next, bytes))
        }
        fn pool_free(&self, _: &PoolHandle, _: PoolAllocation, _: &Stream) -> Result<(), Failed> {
            if *self.fail.lock() || *self.free_fail.lock() {
                return Err(Failed);
            }
            *self.live.lock() -= 1;
            Ok(())
        }
        // Work here completes before each call returns: nothing to order the free after.
        fn pool_free_at_teardown(&self, _: &PoolHandle, _: PoolAllocation) -> Result<(), Failed> {
            if *self.fail.lock() {
                return Err(Failed);
            }
            *self.live.lock() -= 1;
            Ok(())
        }
        fn trim_pool(&self, _: &PoolHandle, keep: u64) -> Result<(), Failed> {
            *self.trimmed_to.lock() = Some(keep);
            Ok(())
        }
        fn pool_stats(&self, _: &PoolHandle) -> Result<DevicePoolStats, Failed> {
            let beside = self.beside.lock().take();
            if let Some(beside) = beside {
                beside();
            }
            if *self.stats_fail.lock() {
                return Err(Failed);
            }
            Ok(DevicePoolStats {
                live_allocations: *self.live.lock(),
                reserved_bytes: *self.reserved.lock(),
                ..DevicePoolStats::default()
            })
        }
        fn destroy_pool(&self, _: PoolHandle) -> Result<(), Failed> {
            if *self.fail.lock() || *self.destroy_fail.lock() {
                return Err(Failed);
            }
            // Frees what is still allocated, as the trait asks.
            *self.live.lock() = 0;
            Ok(())
        }
    }

    /// A tenant with a cap of 100 bytes, its shared stream, and its pool on `backend`.
    fn tenant_pool<P: DevicePools>(backend: P) -> (Arc<TenantLedger>, Stream, TenantDevicePool<P>) {
        let tenant = Arc::new(TenantLedger::new(TenantId(4), 100, IsolationLevel::Shared));
        let stream = Stream::new(
            crate::DriverStream::DEFAULT,
            crate::DriverContext::from_raw(0),
            IsolationLevel::Shared,
            tenant.key(),
        );
        let pool = TenantDevicePool::new(
            backend,
            Arc::clone(&tenant),
            DeviceId(0),
            &DevicePoolConfig::default(),
        )
        .unwrap();
        (tenant, stream, pool)
    }

    #[test]
    fn the_ledger_is_the_ceiling_and_drop_gives_everything_back() {
        let backend = Counting::default();
        let (tenant, stream, pool) = tenant_pool(&backend);
        let a = pool.allocate(60, &stream).unwrap();
        let err = pool.allocate(41, &stream).unwrap_err();
        assert!(matches!(err, Error::Denied(_)));
        assert_eq!(
            *backend.live.lock(),
            1,
            "denied before the driver was asked"
        );
        *backend.fail.lock() = true;
        let err = pool.allocate(10, &stream).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfMemory);
        assert!(err.to_string().contains("pool_allocate"), "{err}");
        assert_eq!(
            tenant.stats().touched_bytes,
            60,
            "a failed allocation leaves no charge"
        );
        *backend.fail.lock() = false;
        let _b = pool.allocate(40, &stream).unwrap();
        assert_eq!(tenant.stats().device_pool_bytes, 100);
        pool.free(a, &stream).unwrap();
        assert_eq!(tenant.stats().touched_bytes, 40);
        drop(pool);
        assert_eq!(tenant.stats().touched_bytes, 0);
        assert_eq!(*backend.live.lock(), 0, "drop freed the live allocation");
    }

    /// What the driver reserves for the pool beyond the live allocations is charged; an
    /// allocation whose reservation the tenant cannot pay for is given back and refused, and
    /// no allocation asks the driver until the pool is paid for again.
    #[test]
    fn what_the_driver_reserves_is_charged() {
        let backend = Counting::default();
        let (tenant, stream, pool) = tenant_pool(&backend);
        *backend.reserved.lock() = 60;
        let a = pool.allocate(10, &stream).unwrap();
        assert_eq!(
            (pool.charged_bytes(), tenant.stats().touched_bytes),
            (60, 60)
        );
        // The driver took 120 for the next 20: past the cap of 100.
        *backend.reserved.lock() = 120;
        let err = pool.allocate(20, &stream).unwrap_err();
        assert!(matches!(err, Error::Denied(_)), "{err}");
        assert_eq!(*backend.live.lock(), 1, "given back");
        // The driver holds 120 for the pool still (the block's free not reached): charged,
        // past the cap, until it goes.
        assert_eq!(tenant.stats().touched_bytes, 120);
        assert!(!tenant.within_limits());
        assert!(tenant.try_reserve(1).is_err(), "nothing else meanwhile");
        let asked = *backend.asked.lock();
        assert!(matches!(pool.allocate(5, &stream), Err(Error::Denied(_))));
        assert_eq!(
            *backend.asked.lock(),
            asked,
            "unpaid: the driver is not asked"
        );
        // The driver let the block go: paid for again, served again (from what it keeps).
        *backend.reserved.lock() = 60;
        let c = pool.allocate(20, &stream).unwrap();
        assert_eq!(*backend.asked.lock(), asked + 1);
        assert!(tenant.within_limits());
        assert_eq!(pool.charged_bytes(), 60, "two live, the rest kept");
        pool.free(c, &stream).unwrap();
        assert_eq!(
            pool.charged_bytes(),
            60,
            "a freed block stays charged while kept"
        );
        *backend.reserved.lock() = 16;
        pool.trim(0).unwrap();
        assert_eq!(pool.charged_bytes(), 16, "down to what the driver holds");
        assert_eq!(tenant.stats().touched_bytes, 16);
        pool.free(a, &stream).unwrap();
        drop(pool);
        assert_eq!(
            tenant.stats().touched_bytes,
            0,
            "kept bytes go with the pool"
        );
    }

    /// What the driver holds after a call that failed is charged all the same: a refused
    /// allocation whose free is refused too, and a driver allocation that failed after the
    /// driver reserved memory.
    #[test]
    fn what_the_driver_holds_after_a_failure_is_charged() {
        let backend = Counting::default();
        let (tenant, stream, pool) = tenant_pool(&backend);
        *backend.reserved.lock() = 60;
        let _a = pool.allocate(10, &stream).unwrap();
        *backend.reserved.lock() = 120;
        *backend.free_fail.lock() = true;
        assert!(matches!(pool.allocate(20, &stream), Err(Error::Denied(_))));
        assert_eq!(
            *backend.live.lock(),
            2,
            "its free was refused: the driver holds it"
        );
        assert_eq!(tenant.stats().touched_bytes, 120, "charged past the cap");
        *backend.free_fail.lock() = false;
        drop(pool);
        assert_eq!(tenant.stats().touched_bytes, 0);

        let (tenant, stream, pool) = tenant_pool(&backend);
        *backend.reserved.lock() = 60;
        let _a = pool.allocate(10, &stream).unwrap();
        *backend.reserved.lock() = 90;
        *backend.allocate_fail.lock() = true;
        assert!(pool.allocate(5, &stream).is_err());
        assert_eq!(
            tenant.stats().touched_bytes,
            90,
            "what the failed call left reserved"
        );
    }

    /// A driver that will not say what it reserves cannot be paid for: the allocation it
    /// made is given back, and no other is asked of it until it says.
    #[test]
    fn an_unread_pool_asks_the_driver_for_nothing_more() {
        let backend = Counting::default();
        let (tenant, stream, pool) = tenant_pool(&backend);
        *backend.stats_fail.lock() = true;
        let err = pool.allocate(1, &stream).unwrap_err();
        assert!(err.to_string().contains("pool_stats"), "{err}");
        assert_eq!((*backend.asked.lock(), *backend.live.lock()), (1, 0));
        assert_eq!(
            *backend.trimmed_to.lock(),
            Some(0),
            "unread, the driver lets go of what it keeps"
        );
        assert!(pool.allocate(1, &stream).is_err());
        assert_eq!(*backend.asked.lock(), 1, "not asked again");
        *backend.stats_fail.lock() = false;
        let a = pool.allocate(1, &stream).unwrap();
        assert_eq!(*backend.asked.lock(), 2);
        pool.free(a, &stream).unwrap();
        drop(pool);
        assert_eq!(tenant.stats().touched_bytes, 0);
    }

    /// A driver that says it reserves more than any device holds is not believed: its figure
    /// is never charged (it would take the tenant's meters past what they count), the read
    /// counts as failed, and no allocation is asked of the driver until a read is sane.
    #[test]
    fn implausible_figures_are_not_charged() {
        let backend = Counting::default();
        let (tenant, stream, pool) = tenant_pool(&backend);
        let a = pool.allocate(10, &stream).unwrap();
        for reserved in [u64::MAX, u64::MAX - 5, MAX_POOL_BYTES + 1] {
            *backend.reserved.lock() = reserved;
            let err = pool.allocate(1, &stream).unwrap_err();
            assert!(
                matches!(err, Error::ImplausiblePoolFigures { reserved: r } if r == reserved),
                "{err}"
            );
            assert_eq!(err.kind(), ErrorKind::Driver);
            // The live allocation, and the block of the one given back, which stays charged
            // while the driver may keep it (its figures unread): nothing more, nothing wrapped.
            let stats = tenant.stats();
            assert_eq!((stats.touched_bytes, stats.touched_peak_bytes), (11, 11));
            assert_eq!((stats.held_bytes, stats.device_pool_bytes), (11, 11));
            assert_eq!(*backend.live.lock(), 1, "the allocation it made went back");
            let asked = *backend.asked.lock();
            assert!(pool.allocate(1, &stream).is_err());
            assert_eq!(*backend.asked.lock(), asked, "not asked while unread");
            assert!(pool.stats().is_err());
        }
        *backend.reserved.lock() = 16;
        let b = pool.allocate(1, &stream).unwrap();
        assert!(tenant.within_limits());
        pool.free(b, &stream).unwrap();
        pool.free(a, &stream).unwrap();
        drop(pool);
        assert_eq!(tenant.stats().touched_bytes, 0);
    }

    /// A read that fails while an older one is under way marks the pool unread, and the older
    /// read, answering after it, does not clear the mark: the next allocation reads first.
    #[test]
    fn a_read_beside_a_failed_one_does_not_clear_its_mark() {
        use alloc::boxed::Box;
        let backend = Arc::new(Counting::default());
        let (_tenant, stream, pool) = tenant_pool(Arc::clone(&backend));
        let pool = Arc::new(pool);
        // The call beside the read reaches the backend and the pool without owning them.
        let (b, p) = (Arc::downgrade(&backend), Arc::downgrade(&pool));
        *backend.beside.lock() = Some(Box::new(move || {
            let (Some(backend), Some(pool)) = (b.upgrade(), p.upgrade()) else {
                return;
            };
            *backend.stats_fail.lock() = true;
            assert!(pool.stats().is_err(), "the read beside fails");
            *backend.stats_fail.lock() = false;
            // Every read after the older one fails too: only the older read says anything.
            let b = Arc::downgrade(&backend);
            *backend.beside.lock() = Some(Box::new(move || {
                if let Some(backend) = b.upgrade() {
                    *backend.stats_fail.lock() = true;
                }
            }));
        }));
        // Stale, its answer cannot clear the mark (a fresh read must: it fails).
        let _ = pool.stats();
        assert!(pool.allocate(1, &stream).is_err());
        assert_eq!(
            *backend.asked.lock(),
            0,
            "still unread: the driver is not asked"
        );
        *backend.stats_fail.lock() = false;
        let a = pool.allocate(1, &stream).unwrap();
        pool.free(a, &stream).unwrap();
    }

    /// The most a pool's figures may say is believed, and charged past the cap; pools whose
    /// figures add up to more than the tenant's books can count are refused as implausible
    /// too, and charge nothing: sixteen pools at the most do not wrap the books (before, the
    /// sixteenth brought every meter back to zero and the tenant within its cap).
    #[test]
    fn plausible_figures_that_add_up_to_more_than_the_books_count_are_refused() {
        let backend = Counting::default();
        let (tenant, _stream, first) = tenant_pool(&backend);
        *backend.reserved.lock() = MAX_POOL_BYTES;
        first.stats().unwrap();
        assert_eq!(first.charged_bytes(), MAX_POOL_BYTES, "believed, charged");
        assert!(!tenant.within_limits());
        let mut pools = alloc::vec![first];
        let mut refused = 0;
        for _ in 1..16 {
            let pool = TenantDevicePool::new(
                &backend,
                Arc::clone(&tenant),
                DeviceId(0),
                &DevicePoolConfig::default(),
            )
            .unwrap();
            match pool.stats() {
                Ok(_) => assert_eq!(pool.charged_bytes(), MAX_POOL_BYTES),
                Err(err) => {
                    assert!(
                        matches!(err, Error::ImplausiblePoolFigures { reserved } if reserved == MAX_POOL_BYTES),
                        "{err}"
                    );
                    assert_eq!(pool.charged_bytes(), 0);
                    refused += 1;
                }
            }
            pools.push(pool);
            let charged: u64 = pools.iter().map(TenantDevicePool::charged_bytes).sum();
            assert_eq!(tenant.stats().touched_bytes, charged, "never wrapped");
            assert!(!tenant.within_limits());
        }
        assert_eq!(refused, 1, "the sixteenth would have wrapped");
        *backend.reserved.lock() = 0;
        for pool in &pools {
            pool.trim(0).unwrap();
        }
        assert_eq!(tenant.stats().touched_bytes, 0);
        drop(pools);
        assert!(tenant.within_limits());
    }

    /// A block freed at teardown may stay with the pool: when the pool's destroy is refused,
    /// its charge stays with the tenant too.
    #[test]
    fn a_refused_destroy_keeps_the_charge_of_blocks_freed_at_teardown() {
        let backend = Counting::default();
        let (tenant, stream, pool) = tenant_pool(&backend);
        let _a = pool.allocate(60, &stream).unwrap();
        *backend.destroy_fail.lock() = true;
        drop(pool);
        assert_eq!(*backend.live.lock(), 0, "freed at teardown");
        assert_eq!(
            tenant.stats().touched_bytes,
            60,
            "the pool was not destroyed"
        );
    }

    #[test]
    fn a_refused_destroy_keeps_the_tenant_charged() {
        let backend = Counting::default();
        let (tenant, stream, pool) = tenant_pool(&backend);
        let _a = pool.allocate(60, &stream).unwrap();
        let err = pool
            .free(PoolAllocation::new(0xbad, 60), &stream)
            .unwrap_err();
        assert!(
            matches!(err, Error::UnknownPoolAllocation { ptr: 0xbad }),
            "{err}"
        );
        *backend.fail.lock() = true;
        drop(pool);
        assert_eq!(
            tenant.stats().touched_bytes,
            60,
            "the driver still holds the block: still charged"
        );
    }
}
