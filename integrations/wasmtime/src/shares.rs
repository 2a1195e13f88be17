//! How many of a creator's pool slots each tenant holds, and the most it may: one tenant cannot
//! take every slot of a pool it shares.

use hashbrown::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::TwmError;
use crate::tenancy::Tenant;

/// A creator's per-tenant slot counts (pooled creators only).
#[derive(Debug)]
pub(crate) struct PoolShares {
    /// The most slots one tenant may hold at once.
    limit: usize,
    /// Slots held, by tenant (keyed by its allocation: a tenant alive while it holds a slot,
    /// since each share holds it).
    held: Mutex<HashMap<usize, usize>>,
}

/// One slot counted against its tenant's share: given back when dropped, so it moves with the
/// charge of the memory that holds the slot (kept with it if the backend refuses the release).
#[derive(Debug)]
pub(crate) struct SlotShare {
    shares: Arc<PoolShares>,
    tenant: Arc<Tenant>,
}

impl PoolShares {
    pub(crate) fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit: limit.max(1),
            held: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    fn key(tenant: &Arc<Tenant>) -> usize {
        Arc::as_ptr(tenant) as usize
    }

    /// Counts one more slot for `tenant`, or refuses with [`TwmError::PoolShare`] at its share.
    pub(crate) fn take(self: &Arc<Self>, tenant: &Arc<Tenant>) -> Result<SlotShare, TwmError> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(Self::key(tenant)).or_insert(0);
        if *count >= self.limit {
            return Err(TwmError::PoolShare {
                tenant_name: tenant.name().to_string(),
                held: *count,
                share: self.limit,
            });
        }
        *count += 1;
        Ok(SlotShare {
            shares: Arc::clone(self),
            tenant: Arc::clone(tenant),
        })
    }
}

impl Drop for SlotShare {
    fn drop(&mut self) {
        let mut held = self
            .shares
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let key = PoolShares::key(&self.tenant);
        if let Some(count) = held.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&key);
            }
        }
    }
}
