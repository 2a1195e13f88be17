//! Placement of tenants across devices: a [`Placement`] knows each device's capacity for
//! tenants, picks the device for a new tenant by its [`PlacementPolicy`] (or takes the one the
//! embedder names), and refuses with [`TwmError::Unplaceable`] when no device can take it.
//!
//! Capacity is admission control on caps: a device takes a tenant while the caps (touched
//! budgets) of the tenants placed there, plus the new one's, fit in its capacity (by default its
//! memory as the driver reports it; an embedder may overcommit by giving more, since managed
//! memory is demand-paged). What a tenant committed goes back when its ledger drops (the last
//! of the [`Tenant`], its device pools and any clone of its [`TenantLedger`]).
//!
//! [`TenantLedger`]: tensor_wasm_mem_core::TenantLedger A device can be marked unavailable (drained, or failed): it takes no new
//! tenant, and its tenants go on as they can.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tensor_wasm_mem_core::{
    DeviceId, IsolationLevel, LedgerGroup, ManagedAllocator, TenantBudgets,
};

use crate::error::TwmError;
use crate::tenancy::Tenant;

/// How a [`Placement`] picks the device of a new tenant among those that can take it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlacementPolicy {
    /// The device whose tenants hold the fewest bytes now (the held bytes of their ledgers:
    /// memory slots or allocations, tables, device pools, summed as they change in a
    /// [`LedgerGroup`] per device, so a decision costs the same however many tenants there
    /// are). A device counts at least its committed caps: a tenant just placed holds nothing
    /// until it instantiates, and a burst of admissions must not all go to one device. Ties go
    /// to the fewest committed bytes, then the lowest ordinal.
    #[default]
    LeastHeld,
    /// Each device in turn, skipping those that cannot take the tenant.
    RoundRobin,
}

impl PlacementPolicy {
    /// A stable name (`least-held`, `round-robin`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::LeastHeld => "least-held",
            Self::RoundRobin => "round-robin",
        }
    }
}

/// One device's share of a [`Placement`], as [`Placement::devices`] reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DevicePlacement {
    /// The device.
    pub device: DeviceId,
    /// Whether it takes new tenants.
    pub available: bool,
    /// Fenced after a kernel fault in its primary context (a placement that
    /// [watches fences](Placement::watch_fences) admits no tenant to it until it recovers).
    pub fenced: bool,
    /// Caps it may hold in bytes.
    pub capacity_bytes: u64,
    /// Caps of the tenants placed on it, in bytes.
    pub committed_bytes: u64,
    /// Tenants placed on it, alive now.
    pub tenants: u64,
    /// Tenants ever placed on it.
    pub placed: u64,
    /// Bytes its tenants hold now (their ledgers' held bytes).
    pub held_bytes: u64,
    /// Bytes its tenants have touched now (their ledgers' live bytes).
    pub touched_bytes: u64,
}

#[derive(Debug)]
struct Slot {
    device: DeviceId,
    available: bool,
    capacity: u64,
    placed: u64,
    /// The running totals of its tenants' ledgers: members, committed caps, held and touched
    /// bytes, for as long as each ledger lives (a device pool or a clone of the ledger can
    /// outlive the `Tenant`).
    group: Arc<LedgerGroup>,
}

impl Slot {
    fn room(&self) -> u64 {
        self.capacity.saturating_sub(self.group.committed_bytes())
    }

    fn takes(&self, cap: u64) -> bool {
        self.available && cap <= self.room()
    }
}

#[derive(Debug)]
struct State {
    slots: Vec<Slot>,
    next: usize,
    refusals: u64,
}

/// Places tenants on devices: see [`PlacementPolicy`], and `docs/SCALING.md` for the policies, their costs and the metrics.
///
/// ```
/// use tensor_wasm_mem_wasmtime::core::{DeviceId, IsolationLevel, TenantBudgets};
/// use tensor_wasm_mem_wasmtime::{Placement, PlacementPolicy};
///
/// // Two devices that each take 1 GiB of caps.
/// let placement = Placement::new(
///     [(DeviceId(0), 1 << 30), (DeviceId(1), 1 << 30)],
///     PlacementPolicy::RoundRobin,
/// )?;
/// let budgets = TenantBudgets::for_cap(768 << 20);
/// let a = placement.admit(1, "a", budgets, IsolationLevel::StreamIsolated)?;
/// let b = placement.admit(2, "b", budgets, IsolationLevel::StreamIsolated)?;
/// assert_eq!((a.device(), b.device()), (DeviceId(0), DeviceId(1)));
/// // Neither device has 768 MiB of room left.
/// assert!(placement.admit(3, "c", budgets, IsolationLevel::StreamIsolated).is_err());
/// drop(a); // its commitment goes back
/// assert_eq!(placement.admit(3, "c", budgets, IsolationLevel::StreamIsolated)?.device(), DeviceId(0));
/// # Ok::<(), tensor_wasm_mem_wasmtime::TwmError>(())
/// ```
pub struct Placement {
    policy: PlacementPolicy,
    state: Arc<Mutex<State>>,
    /// Whether a device is fenced now (a backend's `device_fenced`), when watched.
    fences: Option<Fences>,
}

/// A backend's answer to "is this device fenced now".
type Fences = Arc<dyn Fn(DeviceId) -> bool + Send + Sync>;

impl fmt::Debug for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Placement")
            .field("policy", &self.policy)
            .field("devices", &self.devices())
            .finish()
    }
}

/// Checks a device set: not empty, no device twice.
pub(crate) fn check_device_set(devices: &[DeviceId]) -> Result<(), TwmError> {
    if devices.is_empty() {
        return Err(TwmError::Devices("no device named"));
    }
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].contains(d) {
            return Err(TwmError::Devices("a device is named twice"));
        }
    }
    Ok(())
}

impl Placement {
    /// A placement over `devices`, each with the caps (bytes) it may hold. An empty list, or a
    /// device named twice, is [`TwmError::Devices`].
    pub fn new(
        devices: impl IntoIterator<Item = (DeviceId, u64)>,
        policy: PlacementPolicy,
    ) -> Result<Self, TwmError> {
        let slots: Vec<Slot> = devices
            .into_iter()
            .map(|(device, capacity)| Slot {
                device,
                available: true,
                capacity,
                placed: 0,
                group: Arc::default(),
            })
            .collect();
        let ids: Vec<DeviceId> = slots.iter().map(|s| s.device).collect();
        check_device_set(&ids)?;
        Ok(Self {
            policy,
            state: Arc::new(Mutex::new(State {
                slots,
                next: 0,
                refusals: 0,
            })),
            fences: None,
        })
    }

    /// A placement over every device of `backend`, each taking as many bytes of caps as it has
    /// memory (as [`ManagedAllocator::device_report`] says). A device whose memory the backend
    /// cannot report (a failed `cuMemGetInfo`, or a backend with no figures) starts unavailable
    /// with no capacity: use [`new`](Self::new) to give capacities yourself.
    pub fn for_backend<B: ManagedAllocator + ?Sized>(
        backend: &B,
        policy: PlacementPolicy,
    ) -> Result<Self, TwmError> {
        let totals: Vec<(DeviceId, Option<u64>)> = (0..backend.device_count())
            .map(|d| {
                let device = DeviceId(d);
                let total = backend.device_report(device).and_then(|r| r.total_bytes);
                (device, total)
            })
            .collect();
        let this = Self::new(totals.iter().map(|(d, t)| (*d, t.unwrap_or(0))), policy)?;
        for (device, total) in totals {
            if total.is_none() {
                this.set_available(device, false)?;
            }
        }
        Ok(this)
    }

    /// Admits no tenant to a device `backend` has fenced after a kernel fault (see
    /// [`ManagedAllocator::device_fenced`]), until it recovers; its tenants are not moved.
    #[must_use]
    pub fn watch_fences<B: ManagedAllocator + Send + Sync + 'static>(
        mut self,
        backend: Arc<B>,
    ) -> Self {
        self.fences = Some(Arc::new(move |device| backend.device_fenced(device)));
        self
    }

    fn fenced(&self, device: DeviceId) -> bool {
        self.fences.as_ref().is_some_and(|f| f(device))
    }

    /// Whether slot `i` takes a tenant of `cap` now.
    fn takes(&self, state: &State, i: usize, cap: u64) -> bool {
        let slot = &state.slots[i];
        slot.takes(cap) && !self.fenced(slot.device)
    }

    /// The policy.
    #[must_use]
    pub fn policy(&self) -> PlacementPolicy {
        self.policy
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new tenant with `budgets` at `isolation`, on the device the policy picks among those
    /// that can take its cap; [`TwmError::Unplaceable`] if none can.
    pub fn admit(
        &self,
        id: u64,
        name: impl Into<String>,
        budgets: TenantBudgets,
        isolation: IsolationLevel,
    ) -> Result<Arc<Tenant>, TwmError> {
        let name = name.into();
        let mut state = self.state();
        let cap = budgets.touched_bytes;
        let count = state.slots.len();
        let chosen = match self.policy {
            PlacementPolicy::RoundRobin => (0..count)
                .map(|k| (state.next + k) % count)
                .find(|&i| self.takes(&state, i, cap)),
            PlacementPolicy::LeastHeld => {
                let mut best: Option<(u64, u64, usize)> = None;
                for i in 0..count {
                    if !self.takes(&state, i, cap) {
                        continue;
                    }
                    // A new tenant holds nothing until it instantiates: it counts by its cap
                    // until it holds more, so a burst of admissions spreads.
                    let slot = &state.slots[i];
                    let committed = slot.group.committed_bytes();
                    let key = (slot.group.held_bytes().max(committed), committed, i);
                    if best.is_none_or(|b| key < b) {
                        best = Some(key);
                    }
                }
                best.map(|(_, _, i)| i)
            }
        };
        match chosen {
            Some(i) => {
                state.next = (i + 1) % count;
                Ok(self.place(&mut state, i, id, name, budgets, isolation))
            }
            None => Err(self.refuse(&mut state, name, cap)),
        }
    }

    /// A new tenant on `device`, as the embedder chooses; [`TwmError::UnknownDevice`] for a
    /// device this placement does not know, [`TwmError::Unplaceable`] if that device is
    /// unavailable or has no room for the cap.
    pub fn admit_on(
        &self,
        device: DeviceId,
        id: u64,
        name: impl Into<String>,
        budgets: TenantBudgets,
        isolation: IsolationLevel,
    ) -> Result<Arc<Tenant>, TwmError> {
        let name = name.into();
        let mut state = self.state();
        let Some(i) = state.slots.iter().position(|s| s.device == device) else {
            return Err(TwmError::UnknownDevice {
                device,
                count: state.slots.len() as u32,
            });
        };
        if !self.takes(&state, i, budgets.touched_bytes) {
            return Err(self.refuse(&mut state, name, budgets.touched_bytes));
        }
        Ok(self.place(&mut state, i, id, name, budgets, isolation))
    }

    fn place(
        &self,
        state: &mut State,
        i: usize,
        id: u64,
        name: String,
        budgets: TenantBudgets,
        isolation: IsolationLevel,
    ) -> Arc<Tenant> {
        let slot = &mut state.slots[i];
        slot.placed += 1;
        let tenant = Arc::new(Tenant::make(
            id,
            name,
            budgets,
            isolation,
            vec![slot.device],
            Some(Arc::clone(&slot.group)),
        ));
        tracing::debug!(
            device = slot.device.0,
            tenant = id,
            cap = budgets.touched_bytes,
            "twm: tenant placed"
        );
        tenant
    }

    fn refuse(&self, state: &mut State, tenant_name: String, cap: u64) -> TwmError {
        state.refusals += 1;
        let available = state
            .slots
            .iter()
            .filter(|s| s.available && !self.fenced(s.device));
        TwmError::Unplaceable {
            tenant_name,
            cap,
            devices: state.slots.len() as u32,
            available: available.clone().count() as u32,
            largest_room: available.map(Slot::room).max().unwrap_or(0),
        }
    }

    /// Marks `device` as taking new tenants or not (drained, or failed); its tenants are not
    /// moved. [`TwmError::UnknownDevice`] for a device this placement does not know.
    pub fn set_available(&self, device: DeviceId, available: bool) -> Result<(), TwmError> {
        let mut state = self.state();
        let count = state.slots.len() as u32;
        let slot = state
            .slots
            .iter_mut()
            .find(|s| s.device == device)
            .ok_or(TwmError::UnknownDevice { device, count })?;
        slot.available = available;
        Ok(())
    }

    /// Admissions refused so far.
    #[must_use]
    pub fn refusals(&self) -> u64 {
        self.state().refusals
    }

    /// Each device's share now, in the order given.
    #[must_use]
    pub fn devices(&self) -> Vec<DevicePlacement> {
        self.state()
            .slots
            .iter()
            .map(|slot| DevicePlacement {
                device: slot.device,
                available: slot.available,
                fenced: self.fenced(slot.device),
                capacity_bytes: slot.capacity,
                committed_bytes: slot.group.committed_bytes(),
                tenants: slot.group.members(),
                placed: slot.placed,
                held_bytes: slot.group.held_bytes(),
                touched_bytes: slot.group.touched_bytes(),
            })
            .collect()
    }
}
