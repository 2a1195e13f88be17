//! A model of the tenant's books, against the real thing: random sequences of Stores made and
//! dropped, instantiations, memory and table growths (overflowing deltas included, 32- and
//! 64-bit tables), device pool blocks allocated and freed (refused frees included), releases
//! the driver refuses (frees of managed memory, unregistrations of registered guarded memory),
//! retries, and tenants dropped, for two tenants on two devices. After every
//! step each tenant's charges equal what is really held for it (its memories alive and kept,
//! its tables, its pool blocks), the driver holds exactly those memories, a tenant nobody holds
//! any more is really gone, and each device's totals are the sum over its tenants. At the end,
//! what the driver still refuses is charged to its tenant for good.

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, Weak};

use common::PAGE;
use proptest::prelude::*;
use tensor_wasm_mem_core::{
    DeviceId, DevicePoolConfig, HostAccess, IsolationLevel, Operation, PoolAllocation, StreamLease,
    TenantBudgets, TenantDevicePool,
};
use tensor_wasm_mem_mock::{MockBackend, MockConfig, with_config};
use tensor_wasm_mem_wasmtime::wasmtime::{Engine, Instance, Linker, Module, Store};
use tensor_wasm_mem_wasmtime::{
    Backing, ChargeMode, Placement, PlacementPolicy, TABLE_ELEMENT_BYTES, Tenant, TenantStore,
    TensorWasmMemoryCreator, instantiate, new_store,
};

type Data = TenantStore<MockBackend>;
type Pool = TenantDevicePool<Arc<MockBackend>>;
type Lease = StreamLease<Arc<MockBackend>>;

const CAP: u64 = 16 * PAGE as u64;
/// Every memory is `(memory 1 8)`: it holds 8 pages.
const HELD: u64 = 8 * PAGE as u64;
const T32_MAX: u64 = 100;
const T64_MAX: u64 = 1 << 20;

const GUEST: &str = r#"(module
  (memory (export "memory") 1 8)
  (table $a 1 100 funcref)
  (table $b i64 1 funcref)
  (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0)))
  (func (export "grow32") (param i32) (result i32) (table.grow $a (ref.null func) (local.get 0)))
  (func (export "grow64") (param i64) (result i64) (table.grow $b (ref.null func) (local.get 0))))"#;

#[derive(Clone, Debug)]
enum Op {
    NewStore(usize),
    Instantiate(usize),
    Grow(usize, i32),
    Grow32(usize, i32),
    Grow64(usize, i64),
    DropStore(usize),
    RefuseReleases(u64),
    Retry,
    PoolAlloc(usize, u64),
    PoolFree(usize, usize, bool),
    DropTenant(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0..2usize;
    let store = 0..4usize;
    prop_oneof![
        slot.clone().prop_map(Op::NewStore),
        store.clone().prop_map(Op::Instantiate),
        (store.clone(), prop::sample::select(vec![0, 1, 2, 7, -1]))
            .prop_map(|(s, d)| Op::Grow(s, d)),
        (store.clone(), prop::sample::select(vec![0, 1, 50, 99, -1]))
            .prop_map(|(s, d)| Op::Grow32(s, d)),
        (
            store.clone(),
            prop::sample::select(vec![0i64, 1, 1000, (1 << 20) - 2, -1])
        )
            .prop_map(|(s, d)| Op::Grow64(s, d)),
        store.prop_map(Op::DropStore),
        (1..4u64).prop_map(Op::RefuseReleases),
        Just(Op::Retry),
        (slot.clone(), prop::sample::select(vec![4096u64, 65536]))
            .prop_map(|(t, b)| Op::PoolAlloc(t, b)),
        (slot.clone(), 0..3usize, any::<bool>()).prop_map(|(t, i, r)| Op::PoolFree(t, i, r)),
        slot.prop_map(Op::DropTenant),
    ]
}

/// One tenant object, as the model sees it.
struct TenantModel {
    weak: Weak<Tenant>,
    device: DeviceId,
    /// Held by the test (`None` once dropped).
    held: Option<Arc<Tenant>>,
    pool: Option<(Pool, Lease)>,
    blocks: Vec<PoolAllocation>,
}

/// One Store, as the model sees it.
struct StoreModel {
    store: Store<Data>,
    tenant: usize,
    instance: Option<Instance>,
    pages: u64,
    /// Attached ranges of a registered guarded memory: one per growth.
    chunks: u64,
    t32: u64,
    t64: u64,
    /// Table bytes charged to the Store's books (kept after a failed instantiation).
    table_bytes: u64,
}

/// A memory whose release the driver refused, as the creator keeps it.
#[derive(Clone, Copy, Debug)]
struct Kept {
    tenant: usize,
    bytes: u64,
    /// Unregistrations still owed (registered guarded memory); 1 for a managed free.
    releases: u64,
}

struct World {
    backend: Arc<MockBackend>,
    /// Managed memory (releases are frees) or registered guarded memory (unregistrations).
    registered: bool,
    placement: Placement,
    creator: Option<TensorWasmMemoryCreator<MockBackend>>,
    engine: Engine,
    module: Module,
    tenants: Vec<TenantModel>,
    /// The tenant object of each slot now.
    slots: [Option<usize>; 2],
    stores: Vec<Option<StoreModel>>,
    /// Memories whose release was refused, in the creator's order.
    kept: VecDeque<Kept>,
    /// Releases the driver will still refuse.
    refusals: u64,
    next_id: u64,
}

impl World {
    fn new(registered: bool) -> Self {
        let backend = Arc::new(with_config(MockConfig {
            device_count: 2,
            host_registration: true,
            ..MockConfig::default()
        }));
        let backing = if registered {
            Backing::Guarded(HostAccess::Registered)
        } else {
            Backing::Managed
        };
        let placement = Placement::new(
            [(DeviceId(0), 1 << 30), (DeviceId(1), 1 << 30)],
            PlacementPolicy::LeastHeld,
        )
        .unwrap();
        let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
            .all_devices()
            .backing(backing)
            .build()
            .unwrap();
        let engine = creator.engine().unwrap();
        let module = Module::new(&engine, GUEST).unwrap();
        Self {
            backend,
            registered,
            placement,
            creator: Some(creator),
            engine,
            module,
            tenants: Vec::new(),
            slots: [None, None],
            stores: (0..4).map(|_| None).collect(),
            kept: VecDeque::new(),
            refusals: 0,
            next_id: 1,
        }
    }

    fn creator(&self) -> &TensorWasmMemoryCreator<MockBackend> {
        self.creator.as_ref().unwrap()
    }

    /// The tenant object of `slot`, admitted on device `slot` if there is none.
    fn tenant(&mut self, slot: usize) -> usize {
        if let Some(t) = self.slots[slot] {
            return t;
        }
        let device = DeviceId(slot as u32);
        let tenant = self
            .placement
            .admit_on(
                device,
                self.next_id,
                format!("t{}", self.next_id),
                TenantBudgets::for_cap(CAP),
                IsolationLevel::StreamIsolated,
            )
            .unwrap();
        self.next_id += 1;
        self.tenants.push(TenantModel {
            weak: Arc::downgrade(&tenant),
            device,
            held: Some(tenant),
            pool: None,
            blocks: Vec::new(),
        });
        let t = self.tenants.len() - 1;
        self.slots[slot] = Some(t);
        t
    }

    /// A memory's release: each free or unregistration the driver is asked for is refused
    /// while refusals are pending, and every one is asked (the memory is kept, owing the
    /// refused ones).
    fn release(&mut self, mut memory: Kept) {
        // Every release is asked, whatever the others answer (a guarded memory offers every
        // chunk); the refused ones stay owed, and the memory kept with its charge.
        let mut refused = 0;
        for _ in 0..memory.releases {
            if self.refusals > 0 {
                self.refusals -= 1;
                refused += 1;
            }
        }
        if refused > 0 {
            memory.releases = refused;
            self.kept.push_back(memory);
        }
    }

    /// The creator tries its kept memories again, in order.
    fn retry(&mut self) {
        for memory in std::mem::take(&mut self.kept) {
            self.release(memory);
        }
    }

    /// What releasing a memory of `pages` pages in `chunks` attached ranges asks the driver.
    fn memory(&self, tenant: usize, pages: u64, chunks: u64) -> Kept {
        Kept {
            tenant,
            bytes: pages * PAGE as u64,
            releases: if self.registered { chunks } else { 1 },
        }
    }

    /// Expected touched bytes of tenant object `t` now.
    fn touched(&self, t: usize) -> u64 {
        self.live_stores(t)
            .map(|s| s.pages * PAGE as u64 + s.table_bytes)
            .sum::<u64>()
            + self
                .kept
                .iter()
                .filter(|k| k.tenant == t)
                .map(|k| k.bytes)
                .sum::<u64>()
            + self.pool_bytes(t)
    }

    fn held(&self, t: usize) -> u64 {
        self.memories(t) * HELD
            + self.live_stores(t).map(|s| s.table_bytes).sum::<u64>()
            + self.pool_bytes(t)
    }

    fn memories(&self, t: usize) -> u64 {
        self.live_stores(t).filter(|s| s.instance.is_some()).count() as u64
            + self.kept.iter().filter(|k| k.tenant == t).count() as u64
    }

    fn pool_bytes(&self, t: usize) -> u64 {
        self.tenants[t].blocks.iter().map(|b| b.len() as u64).sum()
    }

    fn live_stores(&self, t: usize) -> impl Iterator<Item = &StoreModel> {
        self.stores.iter().flatten().filter(move |s| s.tenant == t)
    }

    fn alive(&self, t: usize) -> bool {
        let m = &self.tenants[t];
        m.held.is_some()
            || self.live_stores(t).next().is_some()
            || self.kept.iter().any(|k| k.tenant == t)
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::NewStore(slot) => self.new_store(slot),
            Op::Instantiate(s) => self.instantiate(s),
            Op::Grow(s, delta) => self.grow(s, delta),
            Op::Grow32(s, delta) => self.grow32(s, delta),
            Op::Grow64(s, delta) => self.grow64(s, delta),
            Op::DropStore(s) => self.drop_store(s),
            Op::RefuseReleases(k) => {
                let release = if self.registered {
                    Operation::DetachHost
                } else {
                    Operation::Free
                };
                for n in 1..=k {
                    assert!(self.backend.driver().fail_nth(release, self.refusals + n));
                }
                self.refusals += k;
            }
            Op::Retry => {
                self.retry();
                assert_eq!(self.creator().retry_releases(), self.kept.len() as u64);
            }
            Op::PoolAlloc(slot, bytes) => self.pool_alloc(slot, bytes),
            Op::PoolFree(slot, i, refused) => self.pool_free(slot, i, refused),
            Op::DropTenant(slot) => {
                if let Some(t) = self.slots[slot].take() {
                    let m = &mut self.tenants[t];
                    m.held = None;
                    // The pool frees its blocks and goes (no pool free is refused here).
                    m.pool = None;
                    m.blocks.clear();
                }
            }
        }
    }

    fn new_store(&mut self, slot: usize) {
        let t = self.tenant(slot);
        let Some(i) = self.stores.iter().position(Option::is_none) else {
            return;
        };
        let tenant = self.tenants[t].held.clone().unwrap();
        let data = TenantStore::new(self.creator(), &tenant, ChargeMode::Touched, ());
        self.stores[i] = Some(StoreModel {
            store: new_store(&self.engine, data),
            tenant: t,
            instance: None,
            pages: 0,
            chunks: 0,
            t32: 0,
            t64: 0,
            table_bytes: 0,
        });
    }

    fn instantiate(&mut self, s: usize) {
        let Some(model) = &self.stores[s] else { return };
        if model.instance.is_some() {
            return;
        }
        let t = model.tenant;
        // Wasmtime makes the memory (one page), then the two tables (one element each); the
        // creator tries its kept memories first.
        let touched = self.touched(t);
        let memory_fits = touched + PAGE as u64 <= CAP;
        let tables_fit = touched + PAGE as u64 + 2 * TABLE_ELEMENT_BYTES <= CAP;
        let first_table_fits = touched + PAGE as u64 + TABLE_ELEMENT_BYTES <= CAP;
        if memory_fits {
            self.retry();
        }
        let model = self.stores[s].as_mut().unwrap();
        let result = instantiate(&mut model.store, &Linker::new(&self.engine), &self.module);
        assert_eq!(result.is_ok(), memory_fits && tables_fit, "{result:?}");
        match result {
            Ok(instance) => {
                model.instance = Some(instance);
                (model.pages, model.chunks, model.t32, model.t64) = (1, 1, 1, 1);
                model.table_bytes = 2 * TABLE_ELEMENT_BYTES;
            }
            Err(_) if memory_fits => {
                // A table was refused after the memory was made: the memory goes (a free),
                // the table granted before stays charged with the Store.
                if first_table_fits {
                    model.table_bytes += TABLE_ELEMENT_BYTES;
                }
                let memory = self.memory(t, 1, 1);
                self.release(memory);
            }
            Err(_) => {}
        }
    }

    fn call<P, R>(&mut self, s: usize, name: &str, arg: P) -> Option<(R, usize)>
    where
        P: tensor_wasm_mem_wasmtime::wasmtime::WasmParams,
        R: tensor_wasm_mem_wasmtime::wasmtime::WasmResults,
    {
        let model = self.stores[s].as_mut()?;
        let instance = model.instance?;
        let f = instance
            .get_typed_func::<P, R>(&mut model.store, name)
            .unwrap();
        Some((f.call(&mut model.store, arg).unwrap(), model.tenant))
    }

    fn grow(&mut self, s: usize, delta: i32) {
        let Some(model) = &self.stores[s] else { return };
        let (pages, t) = (model.pages, model.tenant);
        let delta_pages = u64::from(delta as u32);
        let fits = pages + delta_pages <= 8 && self.touched(t) + delta_pages * PAGE as u64 <= CAP;
        let Some((old, _)) = self.call::<i32, i32>(s, "grow", delta) else {
            return;
        };
        if fits {
            assert_eq!(old as u64, pages);
            let model = self.stores[s].as_mut().unwrap();
            model.pages += delta_pages;
            model.chunks += u64::from(delta_pages > 0);
        } else {
            assert_eq!(old, -1);
        }
    }

    fn grow32(&mut self, s: usize, delta: i32) {
        let Some(model) = &self.stores[s] else { return };
        let (len, t) = (model.t32, model.tenant);
        let extra = u64::from(delta as u32);
        let fits = len + extra <= T32_MAX && self.touched(t) + extra * TABLE_ELEMENT_BYTES <= CAP;
        let Some((old, _)) = self.call::<i32, i32>(s, "grow32", delta) else {
            return;
        };
        let model = self.stores[s].as_mut().unwrap();
        if fits {
            assert_eq!(old as u64, len);
            model.t32 += extra;
            model.table_bytes += extra * TABLE_ELEMENT_BYTES;
        } else {
            assert_eq!(old, -1);
        }
    }

    fn grow64(&mut self, s: usize, delta: i64) {
        let Some(model) = &self.stores[s] else { return };
        let (len, t) = (model.t64, model.tenant);
        let extra = delta as u64;
        // `old + delta` overflowing is reported as a failed growth: nothing to give back.
        let fits = len.checked_add(extra).is_some_and(|new| new <= T64_MAX)
            && self.touched(t) + extra.saturating_mul(TABLE_ELEMENT_BYTES) <= CAP;
        let Some((old, _)) = self.call::<i64, i64>(s, "grow64", delta) else {
            return;
        };
        let model = self.stores[s].as_mut().unwrap();
        if fits {
            assert_eq!(old as u64, len);
            model.t64 += extra;
            model.table_bytes += extra * TABLE_ELEMENT_BYTES;
        } else {
            assert_eq!(old, -1);
        }
    }

    fn drop_store(&mut self, s: usize) {
        let Some(model) = self.stores[s].take() else {
            return;
        };
        let memory = model
            .instance
            .map(|_| self.memory(model.tenant, model.pages, model.chunks));
        drop(model);
        if let Some(memory) = memory {
            self.release(memory);
        }
    }

    fn pool_alloc(&mut self, slot: usize, bytes: u64) {
        let t = self.tenant(slot);
        let fits = self.touched(t) + bytes <= CAP;
        let backend = Arc::clone(&self.backend);
        let m = &mut self.tenants[t];
        let tenant = m.held.as_ref().unwrap();
        if m.pool.is_none() {
            let pool = TenantDevicePool::new(
                Arc::clone(&backend),
                Arc::clone(tenant.ledger()),
                m.device,
                &DevicePoolConfig::default(),
            )
            .unwrap();
            let lease = StreamLease::acquire_on(
                backend,
                tenant.ledger().key(),
                IsolationLevel::StreamIsolated,
                m.device,
            )
            .unwrap();
            m.pool = Some((pool, lease));
        }
        let (pool, lease) = m.pool.as_ref().unwrap();
        match pool.allocate(bytes as usize, lease.stream()) {
            Ok(block) => {
                assert!(fits);
                m.blocks.push(block);
            }
            Err(e) => assert!(!fits && e.kind().is_denial(), "{e}"),
        }
    }

    fn pool_free(&mut self, slot: usize, i: usize, refused: bool) {
        let Some(t) = self.slots[slot] else { return };
        let m = &mut self.tenants[t];
        if i >= m.blocks.len() {
            return;
        }
        let (pool, lease) = m.pool.as_ref().unwrap();
        if refused {
            assert!(self.backend.driver().fail_nth(Operation::PoolFree, 1));
            let block = PoolAllocation::new(m.blocks[i].device_ptr(), m.blocks[i].len());
            assert!(
                pool.free(block, lease.stream()).is_err(),
                "refused: still the tenant's"
            );
        } else {
            let block = m.blocks.remove(i);
            pool.free(block, lease.stream()).unwrap();
        }
    }

    fn check(&self, step: &str) {
        let mut devices = [(0u64, 0u64, 0u64); 2];
        for (t, m) in self.tenants.iter().enumerate() {
            let Some(tenant) = m.weak.upgrade() else {
                assert!(!self.alive(t), "{step}: tenant {t} gone too early");
                continue;
            };
            assert!(
                self.alive(t),
                "{step}: tenant {t} kept alive by nothing it holds"
            );
            let s = tenant.stats();
            assert_eq!(
                s.touched_bytes,
                self.touched(t),
                "{step}: tenant {t} touched"
            );
            assert_eq!(s.held_bytes, self.held(t), "{step}: tenant {t} held");
            assert_eq!(
                s.live_memories,
                self.memories(t),
                "{step}: tenant {t} memories"
            );
            assert!(
                s.touched_peak_bytes <= CAP,
                "{step}: tenant {t} passed its cap"
            );
            let d = &mut devices[m.device.0 as usize];
            *d = (d.0 + 1, d.1 + s.touched_bytes, d.2 + s.held_bytes);
        }
        for (d, placed) in self.placement.devices().iter().enumerate() {
            assert_eq!(
                (placed.tenants, placed.touched_bytes, placed.held_bytes),
                devices[d],
                "{step}: device {d}'s totals are its tenants' sum"
            );
        }
        assert_eq!(
            self.driver_holds(),
            self.expected_holds(),
            "{step}: what the driver holds"
        );
        assert_eq!(
            self.creator().stats().kept_memories,
            self.kept.len() as u64,
            "{step}"
        );
    }

    /// Memories (managed) or attached ranges (registered) the driver holds now.
    fn driver_holds(&self) -> u64 {
        let stats = self.backend.stats();
        if self.registered {
            stats.attached_host_ranges
        } else {
            stats.live_allocations
        }
    }

    /// What the driver should hold: every live memory, and what kept ones still owe.
    fn expected_holds(&self) -> u64 {
        let live = self
            .stores
            .iter()
            .flatten()
            .filter(|s| s.instance.is_some());
        if self.registered {
            live.map(|s| s.chunks).sum::<u64>() + self.kept.iter().map(|k| k.releases).sum::<u64>()
        } else {
            live.count() as u64 + self.kept.len() as u64
        }
    }

    /// Drops everything; the creator tries its kept memories a last time, and what the driver
    /// still refuses stays charged to its tenant for good.
    fn finish(mut self) {
        for s in 0..self.stores.len() {
            self.drop_store(s);
        }
        self.retry();
        let holds = self.expected_holds();
        let stranded: Vec<Kept> = self.kept.drain(..).collect();
        let tenants: Vec<Option<Arc<Tenant>>> =
            self.tenants.iter().map(|m| m.weak.upgrade()).collect();
        for m in &mut self.tenants {
            m.pool = None;
            m.blocks.clear();
        }
        drop(self.creator.take());
        drop((self.engine, self.module));
        for (t, tenant) in tenants.iter().enumerate() {
            let Some(tenant) = tenant else { continue };
            let bytes: u64 = stranded
                .iter()
                .filter(|k| k.tenant == t)
                .map(|k| k.bytes)
                .sum();
            let count = stranded.iter().filter(|k| k.tenant == t).count() as u64;
            let s = tenant.stats();
            assert_eq!(s.touched_bytes, bytes, "stranded touched of tenant {t}");
            assert_eq!(s.held_bytes, count * HELD, "stranded held of tenant {t}");
            assert_eq!(
                s.stranded_bytes,
                count * HELD,
                "stranded bytes are held bytes"
            );
        }
        let stats = self.backend.stats();
        let held_now = if self.registered {
            stats.attached_host_ranges
        } else {
            stats.live_allocations
        };
        assert_eq!(held_now, holds, "what the driver still holds");
        self.backend.driver().clear_faults();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn the_books_balance_after_every_step(
        registered in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut world = World::new(registered);
        for (i, op) in ops.iter().enumerate() {
            world.apply(op);
            world.check(&format!("step {i} {op:?}"));
        }
        world.finish();
    }
}
