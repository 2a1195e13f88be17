//! Device memory pools of a [`DriverBackend`]: the records and [`DevicePools`].
//!
//! As with streams, every driver call on a pool holds a [`PoolUse`] (the record's `busy` count):
//! a destroy that comes meanwhile retires the pool at once (no new use starts) and the last use
//! to finish tears it down, so no allocation is ever made from, or lost to, a destroyed pool.

use alloc::vec::Vec;

use hashbrown::HashMap;

use crate::device::DeviceId;
use crate::driver::{
    DriverApi, DriverBackend, DriverContext, DriverPool, DriverStream, Life, Refusal,
};
use crate::ledger::{Reservation, TenantKey};
use crate::pools::{DevicePoolConfig, DevicePoolStats, DevicePools, PoolAllocation, PoolHandle};
use crate::stream::Stream;

/// A device memory pool of ours.
#[derive(Debug)]
pub(super) struct PoolRecord {
    pub(super) device: DeviceId,
    pub(super) tenant: TenantKey,
    /// Device pointer -> each live allocation.
    pub(super) live: HashMap<u64, PoolBlock>,
    live_bytes: u64,
    peak_bytes: u64,
    /// Driver calls using the pool now.
    busy: u32,
    life: Life,
    /// What its tenant still pays for blocks the driver has not given back (handed over by
    /// [`DevicePools::destroy_pool_charged`]): dropped (the bytes go back) when the pool is
    /// really gone, by a destroy or a recovery's reset, stranded if this backend drops without
    /// destroying it.
    pub(super) charges: Vec<Reservation>,
}

impl PoolRecord {
    /// Retired after a refused destroy, and in no call: a reset of its device may take it.
    pub(super) fn is_retired_and_idle(&self) -> bool {
        self.life == Life::Failed && self.busy == 0
    }
}

/// A live allocation from a device pool: its length, and the stream it was allocated on (the
/// stream its work is ordered on, so its free at teardown is ordered after that work), named by
/// handle, tenant and context so that a handle value reused by another stream never matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PoolBlock {
    len: usize,
    pub(super) stream: DriverStream,
    pub(super) tenant: Option<TenantKey>,
    pub(super) context: DriverContext,
}

/// One driver call's use of a pool: the pool cannot be torn down until it is dropped. It is
/// counted in its device's gate until then (a teardown by the last user included), so no
/// reset overlaps it.
struct PoolUse<'b, D: DriverApi> {
    backend: &'b DriverBackend<D>,
    raw: DriverPool,
    /// Dropped after `drop` ran (fields drop after the body).
    _call: super::recovery::DeviceCall<'b>,
}

impl<D: DriverApi> Drop for PoolUse<'_, D> {
    fn drop(&mut self) {
        let last = {
            let mut state = self.backend.state.lock();
            let Some(record) = state.pools.get_mut(&self.raw) else {
                return;
            };
            record.busy = record.busy.saturating_sub(1);
            if record.busy > 0 || record.life != Life::Releasing {
                return;
            }
            state.pools.remove(&self.raw)
        };
        if let Some(record) = last {
            // A destroy came while this call ran: the last user does it; a failure is counted.
            let _ = self.backend.release_pool(self.raw, record);
        }
    }
}

impl<D: DriverApi> DriverBackend<D> {
    /// Starts a use of a pool handle of ours (live; device and tenant must match).
    fn pool_use(&self, pool: &PoolHandle) -> Result<PoolUse<'_, D>, Refusal> {
        let call = self.enter(pool.device(), true)?;
        let mut state = self.state.lock();
        match state.pools.get_mut(&pool.driver_pool()) {
            Some(r)
                if r.life == Life::Live
                    && r.device == pool.device()
                    && r.tenant == pool.tenant_key() =>
            {
                r.busy += 1;
                Ok(PoolUse {
                    backend: self,
                    raw: pool.driver_pool(),
                    _call: call,
                })
            }
            _ => Err(Refusal::UnknownPool {
                pool: pool.driver_pool(),
            }),
        }
    }

    /// Refuses a stream that is not the pool's tenant's (or the shared default stream), or is
    /// on another device.
    fn check_pool_stream(
        pool: &PoolHandle,
        stream: &Stream,
        using_device: DeviceId,
        using_tenant: Option<TenantKey>,
    ) -> Result<(), Refusal> {
        let tenant_ok = using_tenant.is_none_or(|t| t == pool.tenant_key());
        if tenant_ok && using_device == pool.device() {
            Ok(())
        } else {
            Err(Refusal::ForeignStream {
                stream: stream.driver_stream(),
                pool: pool.driver_pool(),
            })
        }
    }

    /// Frees the live blocks of a pool no one uses any more (its record already out of the
    /// table), each ordered on its own stream while that stream lives, then destroys the pool.
    /// What the driver refuses goes back into the table, retired, counted and retried at drop.
    fn release_pool(&self, raw: DriverPool, mut record: PoolRecord) -> Result<(), D::Error> {
        if self.is_fenced(record.device) {
            // Not sent to a lost context: retired, for the recovery's reset to destroy.
            let device = record.device;
            return Err(self.keep_pool(raw, record, Refusal::DeviceFenced { device }.into()));
        }
        let blocks: Vec<(u64, PoolBlock)> = record.live.iter().map(|(&p, &b)| (p, b)).collect();
        for (ptr, block) in blocks {
            if let Err(e) = self.free_block_at_teardown(record.device, ptr, block) {
                return Err(self.keep_pool(raw, record, e));
            }
            record.live.remove(&ptr);
            record.live_bytes -= block.len as u64;
            self.state.lock().stats.live_pool_allocations -= 1;
        }
        if let Err(e) = self.in_primary(record.device, |d| d.pool_destroy(raw)) {
            return Err(self.keep_pool(raw, record, e));
        }
        self.state.lock().stats.live_pools -= 1;
        // Gone: what its tenant paid for its blocks goes back (outside the lock).
        drop(record);
        Ok(())
    }

    /// Frees a pool block with no stream of the caller's: on the block's own stream while it
    /// lives (ordered after the work there), else on the default stream of the pool's device (a
    /// released stream was waited for: its work is done).
    fn free_block_at_teardown(
        &self,
        device: DeviceId,
        ptr: u64,
        block: PoolBlock,
    ) -> Result<(), D::Error> {
        let using = block
            .tenant
            .and_then(|t| self.stream_use_if(block.stream, t, block.context));
        let (context, stream) = match &using {
            Some(u) => (u.context, u.raw()),
            None => (self.driver.primary_context(device), DriverStream::DEFAULT),
        };
        self.in_context(context, |d| d.pool_free(ptr, stream))
    }

    /// Takes a live block of `pool` out of its record (before the driver frees it: once freed,
    /// the driver may hand the same address to another thread at once).
    fn take_block(&self, pool: &PoolHandle, ptr: u64, len: usize) -> Result<PoolBlock, Refusal> {
        let mut state = self.state.lock();
        let r = state
            .pools
            .get_mut(&pool.driver_pool())
            .ok_or(Refusal::UnknownPool {
                pool: pool.driver_pool(),
            })?;
        match r.live.get(&ptr) {
            Some(&b) if b.len == len => {
                r.live.remove(&ptr);
                r.live_bytes -= len as u64;
                Ok(b)
            }
            _ => Err(Refusal::UnknownPool {
                pool: pool.driver_pool(),
            }),
        }
    }

    /// Settles a block's free: counted out, or (refused) back in its pool's record.
    fn settle_block(
        &self,
        pool: &PoolHandle,
        ptr: u64,
        block: PoolBlock,
        freed: Result<(), D::Error>,
    ) -> Result<(), D::Error> {
        let mut state = self.state.lock();
        match freed {
            Ok(()) => {
                state.stats.live_pool_allocations -= 1;
                Ok(())
            }
            Err(e) => {
                // Still the pool's (whose record the caller's use keeps): freed at teardown.
                if let Some(r) = state.pools.get_mut(&pool.driver_pool()) {
                    r.live.insert(ptr, block);
                    r.live_bytes += block.len as u64;
                }
                state.release_failed(false);
                Err(e)
            }
        }
    }

    /// Puts a pool whose teardown the driver refused back into the table, retired.
    fn keep_pool(&self, raw: DriverPool, record: PoolRecord, error: D::Error) -> D::Error {
        let mut state = self.state.lock();
        state.pools.insert(
            raw,
            PoolRecord {
                busy: 0,
                life: Life::Failed,
                ..record
            },
        );
        state.release_failed(true);
        error
    }
}

impl<D: DriverApi> DevicePools for DriverBackend<D> {
    fn create_pool(
        &self,
        tenant: TenantKey,
        device: DeviceId,
        config: &DevicePoolConfig,
    ) -> Result<PoolHandle, D::Error> {
        let _call = self.enter(device, false)?;
        let raw = self.in_primary(device, |d| {
            d.pool_create(device, config.max_bytes, config.release_threshold)
        })?;
        let mut state = self.state.lock();
        state.pools.insert(
            raw,
            PoolRecord {
                device,
                tenant,
                live: HashMap::new(),
                live_bytes: 0,
                peak_bytes: 0,
                busy: 0,
                life: Life::Live,
                charges: Vec::new(),
            },
        );
        state.stats.live_pools += 1;
        Ok(PoolHandle::new(raw, device, tenant))
    }

    fn pool_allocate(
        &self,
        pool: &PoolHandle,
        bytes: usize,
        stream: &Stream,
    ) -> Result<PoolAllocation, D::Error> {
        if bytes == 0 {
            return Err(Refusal::ZeroSize.into());
        }
        let _pool_use = self.pool_use(pool)?;
        let using = self.stream_use(stream.key())?;
        Self::check_pool_stream(pool, stream, using.device, using.tenant)?;
        let ptr = self.in_context(using.context, |d| {
            d.pool_alloc(pool.driver_pool(), bytes, using.raw())
        })?;
        let block = PoolBlock {
            len: bytes,
            stream: using.raw(),
            tenant: using.tenant,
            context: using.context,
        };
        let mut state = self.state.lock();
        // The pool's record stays while this call holds its use.
        let mut retired = false;
        if let Some(r) = state.pools.get_mut(&pool.driver_pool()) {
            r.live.insert(ptr, block);
            r.live_bytes += bytes as u64;
            r.peak_bytes = r.peak_bytes.max(r.live_bytes);
            retired = r.life != Life::Live;
            state.stats.live_pool_allocations += 1;
        }
        if retired {
            // Destroyed meanwhile: the block is the pool's, freed by its teardown (this call's
            // use may be the last); the caller must not get it.
            return Err(Refusal::UnknownPool {
                pool: pool.driver_pool(),
            }
            .into());
        }
        Ok(PoolAllocation::new(ptr, bytes))
    }

    fn pool_free(
        &self,
        pool: &PoolHandle,
        allocation: PoolAllocation,
        stream: &Stream,
    ) -> Result<(), D::Error> {
        let _pool_use = self.pool_use(pool)?;
        let using = self.stream_use(stream.key())?;
        Self::check_pool_stream(pool, stream, using.device, using.tenant)?;
        let ptr = allocation.device_ptr();
        let block = self.take_block(pool, ptr, allocation.len())?;
        let freed = self.in_context(using.context, |d| d.pool_free(ptr, using.raw()));
        self.settle_block(pool, ptr, block, freed)
    }

    fn pool_free_at_teardown(
        &self,
        pool: &PoolHandle,
        allocation: PoolAllocation,
    ) -> Result<(), D::Error> {
        let _pool_use = self.pool_use(pool)?;
        let ptr = allocation.device_ptr();
        let block = self.take_block(pool, ptr, allocation.len())?;
        let freed = self.free_block_at_teardown(pool.device(), ptr, block);
        self.settle_block(pool, ptr, block, freed)
    }

    fn trim_pool(&self, pool: &PoolHandle, keep_bytes: u64) -> Result<(), D::Error> {
        let _pool_use = self.pool_use(pool)?;
        self.in_primary(pool.device(), |d| {
            d.pool_trim(pool.driver_pool(), keep_bytes)
        })
    }

    fn pool_stats(&self, pool: &PoolHandle) -> Result<DevicePoolStats, D::Error> {
        let _pool_use = self.pool_use(pool)?;
        let reserved = self.in_primary(pool.device(), |d| d.pool_reserved(pool.driver_pool()))?;
        let state = self.state.lock();
        let r = state
            .pools
            .get(&pool.driver_pool())
            .ok_or(Refusal::UnknownPool {
                pool: pool.driver_pool(),
            })?;
        Ok(DevicePoolStats {
            live_bytes: r.live_bytes,
            peak_bytes: r.peak_bytes,
            reserved_bytes: reserved,
            live_allocations: r.live.len() as u64,
        })
    }

    fn destroy_pool(&self, pool: PoolHandle) -> Result<(), D::Error> {
        self.destroy_pool_charged(pool, Vec::new())
    }

    fn destroy_pool_charged(
        &self,
        pool: PoolHandle,
        charges: Vec<Reservation>,
    ) -> Result<(), D::Error> {
        // A reset must not overlap the teardown: it would destroy the pool under its calls,
        // and a refused destroy would then put back a record of a pool the reset destroyed. A
        // recovery under way while this pool is live cannot reset (the pool is in use): it
        // gives up at once, and the teardown goes on.
        let _call = match self.enter_teardown(pool.device()) {
            Ok(call) => call,
            Err(refusal) => {
                charges.into_iter().for_each(Reservation::strand);
                return Err(refusal.into());
            }
        };
        // Decided under the lock: a pool in use is retired (no new use starts) and torn down
        // by its last user; an idle one leaves the table now. The charges go with the record.
        let record = {
            let mut state = self.state.lock();
            let Some(r) = state.pools.get_mut(&pool.driver_pool()).filter(|r| {
                r.life == Life::Live && r.device == pool.device() && r.tenant == pool.tenant_key()
            }) else {
                drop(state);
                charges.into_iter().for_each(Reservation::strand);
                return Err(Refusal::UnknownPool {
                    pool: pool.driver_pool(),
                }
                .into());
            };
            r.charges.extend(charges);
            if r.busy > 0 {
                r.life = Life::Releasing;
                return Ok(());
            }
            state.pools.remove(&pool.driver_pool())
        };
        match record {
            Some(record) => self.release_pool(pool.driver_pool(), record),
            None => Ok(()),
        }
    }
}
