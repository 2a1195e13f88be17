//! A table grown one element at a time holds more host memory than its elements (its storage
//! grows by doubling): the charge per element covers what the host really holds, measured with
//! a counting allocator (the hostile review of issue 29 found 8,388,608 B held for 4,194,312 B
//! charged at 8 bytes an element).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

use common::*;
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module, Store};
use tensor_wasm_mem_wasmtime::{ChargeMode, TenantStore, instantiate, new_store};

/// The heap bytes live now, over the whole test binary.
static LIVE: AtomicI64 = AtomicI64::new(0);

struct Counting;

// SAFETY: every call forwards to the system allocator with the caller's arguments; the counter
// is only arithmetic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's contract is `System.alloc`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's contract is `System.dealloc`'s.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's contract is `System.realloc`'s.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Grows a table to `total` elements `step` at a time: the heap bytes it added, and what the
/// tenant is charged for the table.
fn grow_table(step: u32, total: u32) -> (i64, u64) {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 64 << 20);
    let mut store: Store<TenantStore<MockBackend>> = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let module = Module::new(
        &engine,
        format!(
            r#"(module (table $t 0 funcref)
                 (func (export "go") (local $n i32)
                   (block $out (loop $again
                     (br_if $out (i32.ge_u (local.get $n) (i32.const {total})))
                     (drop (table.grow $t (ref.null func) (i32.const {step})))
                     (local.set $n (i32.add (local.get $n) (i32.const {step})))
                     (br $again)))))"#
        ),
    )
    .unwrap();
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
    let go = func::<_, (), ()>(&mut store, &instance, "go");
    let before = LIVE.load(Ordering::Relaxed);
    go.call(&mut store, ()).unwrap();
    let grown = LIVE.load(Ordering::Relaxed) - before;
    (grown, tenant.stats().table_bytes)
}

#[test]
fn a_tables_charge_covers_the_host_memory_it_holds() {
    let total = (1 << 19) + 1;
    for step in [total, 1] {
        let (held, charged) = grow_table(step, total);
        assert!(
            u64::try_from(held).unwrap_or(0) <= charged,
            "grown {step} at a time: {held} B held, {charged} B charged"
        );
    }
}
