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
/// the driver is asked, and given back when freed. The driver's own pool maximum
/// ([`DevicePoolConfig::max_bytes`], `CUmemPoolProps.maxSize` where the driver has it) is a second
/// line behind the ledger.
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
    /// device pointer -> the ledger charge for it
    live: spin::Mutex<HashMap<u64, Reservation>>,
}

impl<P: DevicePools> fmt::Debug for TenantDevicePool<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantDevicePool")
            .field("tenant", &self.tenant.id())
            .field("pool", &self.pool)
            .field("live_allocations", &self.live.lock().len())
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
        Ok(Self {
            backend,
            tenant,
            pool: Some(pool),
            live: spin::Mutex::new(HashMap::new()),
        })
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
    /// cap this is [`Error::Denied`] and the driver is never asked.
    pub fn allocate(
        &self,
        bytes: usize,
        stream: &Stream,
    ) -> Result<PoolAllocation, Error<P::Error>> {
        let charge = self
            .tenant
            .try_reserve_for(bytes as u64, Purpose::DevicePool)?;
        // On failure `charge` drops here: no ledger charge is left.
        let allocation = self
            .backend
            .pool_allocate(self.handle(), bytes, stream)
            .map_err(|e| Error::backend(Operation::PoolAllocate, e))?;
        self.live.lock().insert(allocation.device_ptr(), charge);
        Ok(allocation)
    }

    /// Frees an allocation of this pool (ordered on `stream`) and gives its bytes back to the
    /// ledger. An allocation this pool does not hold is refused before the driver is asked.
    ///
    /// The charge leaves the pool's record *before* the driver frees: once the driver has the
    /// block back it may hand the same address to another thread's [`allocate`](Self::allocate)
    /// at once, whose record must not be touched by this call. If the driver refuses the free,
    /// the charge goes back into the record (the block is still the tenant's, and is freed when
    /// the pool drops).
    pub fn free(&self, allocation: PoolAllocation, stream: &Stream) -> Result<(), Error<P::Error>> {
        let ptr = allocation.device_ptr();
        let charge = {
            let mut live = self.live.lock();
            match live.get(&ptr) {
                Some(c) if c.bytes() == allocation.len() as u64 => live.remove(&ptr),
                _ => None,
            }
        };
        let Some(charge) = charge else {
            return Err(Error::UnknownPoolAllocation { ptr });
        };
        match self.backend.pool_free(self.handle(), allocation, stream) {
            Ok(()) => {
                drop(charge);
                Ok(())
            }
            Err(e) => {
                self.live.lock().insert(ptr, charge);
                Err(Error::backend(Operation::PoolFree, e))
            }
        }
    }

    /// Gives freed memory back to the driver, keeping at most `keep_bytes`.
    pub fn trim(&self, keep_bytes: u64) -> Result<(), Error<P::Error>> {
        self.backend
            .trim_pool(self.handle(), keep_bytes)
            .map_err(|e| Error::backend(Operation::TrimPool, e))
    }

    /// The pool's figures.
    pub fn stats(&self) -> Result<DevicePoolStats, Error<P::Error>> {
        self.backend
            .pool_stats(self.handle())
            .map_err(|e| Error::backend(Operation::PoolStats, e))
    }
}

impl<P: DevicePools> Drop for TenantDevicePool<P> {
    /// Frees every allocation still live (the backend orders each free after the work on the
    /// stream the allocation was made on: [`DevicePools::pool_free_at_teardown`]) and gives its
    /// bytes back, then destroys the pool, which retries what the backend refused to free,
    /// handing it the refused blocks' charges ([`DevicePools::destroy_pool_charged`]): they go
    /// back when the pool is really gone (a driver backend keeps a pool whose destroy is
    /// refused, and a recovery's reset destroys it, after a kernel fault), and stay with the
    /// tenant for good ([`Reservation::strand`]) where it never goes.
    fn drop(&mut self) {
        let Some(pool) = self.pool.take() else {
            return;
        };
        let live: alloc::vec::Vec<(u64, Reservation)> = self.live.lock().drain().collect();
        let mut refused = alloc::vec::Vec::new();
        for (ptr, charge) in live {
            // A `PoolAllocation` is rebuilt from what this pool handed out; its length is the
            // charge.
            let allocation = PoolAllocation::new(ptr, charge.bytes() as usize);
            match self.backend.pool_free_at_teardown(&pool, allocation) {
                Ok(()) => drop(charge),
                Err(_) => refused.push(charge),
            }
        }
        // The refused blocks' charges go with the pool: back when it is really gone.
        let _ = self.backend.destroy_pool_charged(pool, refused);
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
            if *self.fail.lock() {
                return Err(Failed);
            }
            let mut next = self.next.lock();
            *next += 0x1000;
            *self.live.lock() += 1;
            Ok(PoolAllocation::new(*next, bytes))
        }
        fn pool_free(&self, _: &PoolHandle, _: PoolAllocation, _: &Stream) -> Result<(), Failed> {
            if *self.fail.lock() {
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
        fn trim_pool(&self, _: &PoolHandle, _: u64) -> Result<(), Failed> {
            Ok(())
        }
        fn pool_stats(&self, _: &PoolHandle) -> Result<DevicePoolStats, Failed> {
            Ok(DevicePoolStats {
                live_allocations: *self.live.lock(),
                ..DevicePoolStats::default()
            })
        }
        fn destroy_pool(&self, _: PoolHandle) -> Result<(), Failed> {
            if *self.fail.lock() {
                return Err(Failed);
            }
            // Frees what is still allocated, as the trait asks.
            *self.live.lock() = 0;
            Ok(())
        }
    }

    /// A tenant with a cap of 100 bytes, its shared stream, and its pool on `backend`.
    fn tenant_pool(backend: &Counting) -> (Arc<TenantLedger>, Stream, TenantDevicePool<&Counting>) {
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
