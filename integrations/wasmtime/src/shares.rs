//! How many of a creator's pool slots each tenant holds, and the most it may, per size class:
//! one tenant cannot take every slot of a pool it shares, nor every slot of one of its classes.

use hashbrown::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::TwmError;
use crate::tenancy::Tenant;

/// A creator's per-tenant slot counts, per size class (pooled creators only): a tenant's share
/// of each class is counted apart, so taking every slot of the largest class (where every
/// memory that declares no maximum goes) is refused as it would be in a pool of one class.
#[derive(Debug)]
pub(crate) struct PoolShares {
    /// The classes' slot sizes, ascending, and the most slots of each one tenant may hold.
    limits: Vec<(u64, usize)>,
    /// Slots held, by (tenant, class's slot size) (keyed by the tenant's allocation: a tenant
    /// alive while it holds a slot, since each share holds it).
    held: Mutex<HashMap<(usize, u64), usize>>,
}

/// One slot counted against its tenant's share: given back when dropped, so it moves with the
/// charge of the memory that holds the slot (kept with it if the backend refuses the release).
#[derive(Debug)]
pub(crate) struct SlotShare {
    shares: Arc<PoolShares>,
    tenant: Arc<Tenant>,
    class: u64,
}

impl PoolShares {
    /// Shares of a pool of `classes` (slot size as the pool lays it out, slots): `per_tenant`
    /// slots of each class, or half of each class's slots (at least one) by default.
    pub(crate) fn new(
        classes: impl IntoIterator<Item = (u64, usize)>,
        per_tenant: Option<usize>,
    ) -> Arc<Self> {
        let mut limits: Vec<(u64, usize)> = Vec::new();
        for (bytes, slots) in classes {
            match limits.iter_mut().find(|(b, _)| *b == bytes) {
                Some((_, n)) => *n = n.saturating_add(slots),
                None => limits.push((bytes, slots)),
            }
        }
        for (_, n) in &mut limits {
            *n = per_tenant.unwrap_or(*n / 2).max(1);
        }
        limits.sort_unstable();
        Arc::new(Self {
            limits,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// The share of the largest class (where memories that declare no maximum go).
    pub(crate) fn limit(&self) -> usize {
        self.limits.last().map_or(1, |&(_, n)| n)
    }

    /// The class a slot of `bytes` belongs to: the smallest whose slots hold it.
    fn class_of(&self, bytes: u64) -> (u64, usize) {
        self.limits
            .iter()
            .copied()
            .find(|&(b, _)| b >= bytes)
            .or_else(|| self.limits.last().copied())
            .unwrap_or((bytes, 1))
    }

    fn key(tenant: &Arc<Tenant>) -> usize {
        Arc::as_ptr(tenant) as usize
    }

    /// Refuses, before the pool is asked, a memory of `capacity` bytes whose tenant holds its
    /// whole share of every class that could serve it (those whose slots hold it), so a tenant
    /// at its share takes no slot even for a moment; [`take`](Self::take) counts the slot the
    /// pool then chose.
    pub(crate) fn check(&self, tenant: &Arc<Tenant>, capacity: u64) -> Result<(), TwmError> {
        let key = Self::key(tenant);
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let mut full = None;
        for &(class, limit) in self.limits.iter().filter(|&&(b, _)| b >= capacity) {
            let count = held.get(&(key, class)).copied().unwrap_or(0);
            if count < limit {
                return Ok(());
            }
            full.get_or_insert((count, limit));
        }
        match full {
            Some((held, share)) => Err(TwmError::PoolShare {
                tenant_name: tenant.name().to_string(),
                held,
                share,
            }),
            // No class holds it: the pool refuses it, typed.
            None => Ok(()),
        }
    }

    /// Counts one more slot of `slot_bytes` for `tenant`, or refuses with
    /// [`TwmError::PoolShare`] at its share of that class.
    pub(crate) fn take(
        self: &Arc<Self>,
        tenant: &Arc<Tenant>,
        slot_bytes: u64,
    ) -> Result<SlotShare, TwmError> {
        let (class, limit) = self.class_of(slot_bytes);
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry((Self::key(tenant), class)).or_insert(0);
        if *count >= limit {
            return Err(TwmError::PoolShare {
                tenant_name: tenant.name().to_string(),
                held: *count,
                share: limit,
            });
        }
        *count += 1;
        Ok(SlotShare {
            shares: Arc::clone(self),
            tenant: Arc::clone(tenant),
            class,
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
        let key = (PoolShares::key(&self.tenant), self.class);
        if let Some(count) = held.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&key);
            }
        }
    }
}
