//! A hostile guest or tenant against the `twm` host functions, the kernels and the device-access
//! scope: the edges a red team tried (2026-12-06) that held, kept so they keep holding. (Its two
//! findings are tests beside what they fixed: `kernels.rs` and `first_hour.rs`.)

mod common;

use std::sync::Arc;

use tensor_wasm_mem_wasmtime::kernels::{
    self, TWM_ERR_BAD_ARGUMENTS, TWM_ERR_BUSY, TWM_ERR_UNKNOWN_KERNEL,
};
use tensor_wasm_mem_wasmtime::prelude::*;
use tensor_wasm_mem_wasmtime::{
    AccessRange, DeviceAccess, ScopeOptions, TWM_ERR_OUT_OF_RANGE, TWM_ERR_OVERFLOW,
};

use common::kernel_guest::{ARGS, Data, Guest, creator_with, guest_of};

fn guest_src(memory: &str) -> String {
    format!(
        r#"(module
  (import "twm" "kernel" (func $kernel (param i32 i32) (result i32)))
  (import "twm" "launch" (func $launch (param i32 i32 i32) (result i32)))
  (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  {memory}
  (func (export "kernel") (param i32 i32) (result i32) (call $kernel (local.get 0) (local.get 1)))
  (func (export "launch") (param i32 i32 i32) (result i32)
    (call $launch (local.get 0) (local.get 1) (local.get 2)))
  (func (export "advise") (param i32 i32 i32 i32) (result i32)
    (call $advise (local.get 0) (local.get 1) (local.get 2) (local.get 3)))
  (func (export "prefetch") (param i32 i32 i32) (result i32)
    (call $prefetch (local.get 0) (local.get 1) (local.get 2)))
  (func (export "launch_many") (param i32 i32 i32 i32) (result i32)
    (local $r i32)
    (block $done
      (loop $l
        (br_if $done (i32.eqz (local.get 3)))
        (local.set $r (call $launch (local.get 0) (local.get 1) (local.get 2)))
        (br_if $done (i32.ne (local.get $r) (i32.const 0)))
        (local.set 3 (i32.sub (local.get 3) (i32.const 1)))
        (br $l)))
    (local.get $r)))"#
    )
}

fn guest_with(creator: &TensorWasmMemoryCreator<MockBackend>, memory: &str) -> Guest {
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    guest_of(creator, &guest_src(memory), &tenant)
}

fn guest(creator: &TensorWasmMemoryCreator<MockBackend>) -> Guest {
    guest_with(creator, r#"(memory (export "memory") 1 4)"#)
}

impl Guest {
    fn kernel_raw(&mut self, ptr: i32, len: i32) -> i32 {
        self.call::<(i32, i32), i32>("kernel", (ptr, len)).unwrap()
    }
}

/// A zero-length buffer ending exactly at the memory's end, and a buffer ending exactly there:
/// accepted, nothing past the end written.
#[test]
fn buffers_at_the_very_end() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest(&creator);
    let fill = g.kernel("fill");
    let page = 65_536u64;
    assert_eq!(g.launch(fill, &[(page, 0), (7, 0)]), 0);
    assert_eq!(g.launch(fill, &[(page - 16, 16), (9, 0)]), 0);
    assert_eq!(
        g.launch(fill, &[(page - 16, 17), (9, 0)]),
        TWM_ERR_OUT_OF_RANGE
    );
    assert_eq!(
        g.launch(fill, &[(page + 1, 0), (9, 0)]),
        TWM_ERR_OUT_OF_RANGE
    );
    let data = g.memory.data(&g.store);
    assert_eq!(data[page as usize - 17], 0);
    assert!(data[page as usize - 16..].iter().all(|&b| b == 9));
    // Grow, and the byte past the old end is still zero.
    let grown = g.memory.grow(&mut g.store, 1).unwrap();
    assert_eq!(grown, 1);
    assert_eq!(g.memory.data(&g.store)[page as usize], 0);
}

/// Kernel names: huge, negative, non-UTF-8, empty, exactly 256 bytes, pointer at the end.
#[test]
fn hostile_kernel_names() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest(&creator);
    assert_eq!(g.kernel_raw(0, -1), TWM_ERR_OUT_OF_RANGE);
    assert_eq!(g.kernel_raw(-1, 2), TWM_ERR_OVERFLOW);
    assert_eq!(g.kernel_raw(65_536, 0), TWM_ERR_UNKNOWN_KERNEL);
    assert_eq!(g.kernel_raw(65_537, 0), TWM_ERR_OUT_OF_RANGE);
    assert_eq!(g.kernel_raw(0, 0), TWM_ERR_UNKNOWN_KERNEL);
    g.memory
        .write(&mut g.store, 0, &[0xff, 0xfe, b'f', 0xc0])
        .unwrap();
    assert_eq!(g.kernel_raw(0, 4), TWM_ERR_UNKNOWN_KERNEL);
    assert_eq!(g.kernel_raw(0, 60_000), TWM_ERR_UNKNOWN_KERNEL);
    // "fill" followed by a NUL: no kernel.
    g.memory.write(&mut g.store, 0, b"fill\0").unwrap();
    assert_eq!(g.kernel_raw(0, 5), TWM_ERR_UNKNOWN_KERNEL);
    // Handles that are no kernel's.
    for h in [-1, 4, i32::MAX, i32::MIN] {
        assert_eq!(g.launch(h, &[]), TWM_ERR_UNKNOWN_KERNEL, "{h}");
    }
}

/// Argument blocks: negative counts, more than 32, a block straddling the end, a block at the
/// end with no arguments.
#[test]
fn hostile_argument_blocks() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest(&creator);
    let fill = g.kernel("fill");
    let launch = |g: &mut Guest, ptr: i32, n: i32| -> i32 {
        g.call::<(i32, i32, i32), i32>("launch", (fill, ptr, n))
            .unwrap()
    };
    assert_eq!(launch(&mut g, 0, -1), TWM_ERR_BAD_ARGUMENTS);
    assert_eq!(launch(&mut g, 0, i32::MIN), TWM_ERR_BAD_ARGUMENTS);
    assert_eq!(launch(&mut g, 0, 33), TWM_ERR_BAD_ARGUMENTS);
    assert_eq!(launch(&mut g, 65_536 - 16, 2), TWM_ERR_OUT_OF_RANGE);
    assert_eq!(launch(&mut g, -16, 2), TWM_ERR_OVERFLOW);
    assert_eq!(launch(&mut g, 65_536, 0), TWM_ERR_BAD_ARGUMENTS);
    assert_eq!(launch(&mut g, -1, 0), TWM_ERR_OUT_OF_RANGE);
    // A scalar with a non-zero second word, a scalar past u32.
    assert_eq!(g.launch(fill, &[(0, 16), (1, 1)]), TWM_ERR_BAD_ARGUMENTS);
    assert_eq!(
        g.launch(fill, &[(0, 16), (1 << 32, 0)]),
        TWM_ERR_BAD_ARGUMENTS
    );
    // The argument block itself as the buffer a kernel writes (the kernel reads nothing of it
    // after the check, so this is allowed, and harmless).
    assert_eq!(g.launch(fill, &[(ARGS, 32), (3, 0)]), 0);
    // saxpy with n = u32::MAX: the length 4n cannot be in a 4-page memory.
    let saxpy = g.kernel("saxpy");
    let n = u64::from(u32::MAX);
    assert_eq!(
        g.launch(saxpy, &[(0, 0), (4096, 4 * n), (8192, 4 * n), (n, 0)]),
        TWM_ERR_OVERFLOW
    );
    // saxpy with n = 0: zero-length buffers at the same offset (no overlap).
    assert_eq!(g.launch(saxpy, &[(0, 0), (4096, 0), (4096, 0), (0, 0)]), 0);
    let stats = g.tenant.stats();
    assert_eq!(stats.kernel_failures, 0);
}

/// A memory64 guest: offsets past 4 GiB and near u64::MAX.
#[test]
fn memory64_guest() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest_with(&creator, r#"(memory (export "memory") i64 1 4)"#);
    let fill = g.kernel("fill");
    assert!(fill >= 0);
    let page = 65_536u64;
    assert_eq!(g.launch(fill, &[(page - 8, 8), (5, 0)]), 0);
    assert_eq!(
        g.launch(fill, &[(1 << 32, 8), (5, 0)]),
        TWM_ERR_OUT_OF_RANGE
    );
    assert_eq!(
        g.launch(fill, &[(u64::MAX - 8, 8), (5, 0)]),
        TWM_ERR_OUT_OF_RANGE
    );
    assert_eq!(
        g.launch(fill, &[(u64::MAX - 7, 8), (5, 0)]),
        TWM_ERR_OVERFLOW
    );
    assert_eq!(
        g.launch(fill, &[(u64::MAX, 0), (5, 0)]),
        TWM_ERR_OUT_OF_RANGE
    );
    let inc = g.kernel("increment");
    assert_eq!(
        g.launch(inc, &[(u64::MAX - (1 << 20), 1 << 20),]),
        TWM_ERR_OUT_OF_RANGE
    );
}

/// advise / prefetch: zero lengths, at the end, wrapping, unknown locations and advice.
#[test]
fn advise_and_prefetch_edges() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest(&creator);
    let page = 65_536;
    let mut codes = Vec::new();
    for (ptr, len) in [
        (0, 0),
        (page, 0),
        (page - 1, 1),
        (page, 1),
        (-1, 1),
        (-1, 0),
        (0, -1),
    ] {
        let a = g
            .call::<(i32, i32, i32, i32), i32>("advise", (ptr, len, 0, 0))
            .unwrap();
        let p = g
            .call::<(i32, i32, i32), i32>("prefetch", (ptr, len, 0))
            .unwrap();
        let h = g
            .call::<(i32, i32, i32), i32>("prefetch", (ptr, len, -1))
            .unwrap();
        codes.push(((ptr, len), a, p, h));
    }
    for &((ptr, len), a, p, h) in &codes {
        let end = u64::from(ptr as u32) + u64::from(len as u32);
        let want = if end > 1 << 32 {
            TWM_ERR_OVERFLOW
        } else if end > page as u64 {
            TWM_ERR_OUT_OF_RANGE
        } else {
            0
        };
        assert_eq!((a, p, h), (want, want, want), "({ptr}, {len})");
    }
    // Odd advice and locations.
    for (advice, location) in [
        (6, 0),
        (-1, 0),
        (i32::MAX, 0),
        (0, -2),
        (2, 7),
        (4, i32::MAX),
    ] {
        let a = g
            .call::<(i32, i32, i32, i32), i32>("advise", (0, 16, advice, location))
            .unwrap();
        assert!(a < 0, "advice {advice} at {location}: {a}");
    }
}

/// Many launches in a row: the figures count each, and the in-flight count goes back each time
/// (with a cap of 1 in flight, every one of them is admitted).
#[test]
fn repeated_launches_give_their_in_flight_back() {
    let creator = creator_with(kernels::builtin().max_in_flight(1));
    let mut g = guest(&creator);
    let fill = g.kernel("fill");
    g.write_args(ARGS, &[(4096, 4096), (1, 0)]);
    let r = g
        .call::<(i32, i32, i32, i32), i32>("launch_many", (fill, ARGS as i32, 2, 20_000))
        .unwrap();
    assert_eq!(r, 0);
    assert_eq!(g.tenant.stats().launches, 20_000);
    // A launch that is refused after its buffers resolve, and one that faults: in flight goes back.
    let poke = g.kernel("poke");
    let trap = g
        .try_launch(poke, &[(4096, 4), (9, 0), (1, 0)])
        .expect_err("traps");
    assert!(
        matches!(
            trap.downcast_ref::<TwmError>(),
            Some(TwmError::DeviceLost { .. })
        ),
        "{trap:#}"
    );
    // The device recovers once the launch ends (recover_automatically); the tenant may launch
    // again in a fresh Store.
    drop(g);
    let mut g = guest(&creator);
    let fill = g.kernel("fill");
    assert_ne!(g.launch(fill, &[(4096, 16), (1, 0)]), TWM_ERR_BUSY);
}

/// A launch whose wait the driver keeps refusing may still run: it keeps its place among the
/// tenant's launches in flight until its Store's stream is waited for, so another Store of the
/// tenant cannot launch past the cap meanwhile (a red team: the place went back at once, while
/// the kernel could still run).
#[test]
fn a_launch_that_may_still_run_keeps_its_place_in_flight() {
    use tensor_wasm_mem_mock::Call;
    let creator = creator_with(kernels::builtin().max_in_flight(1));
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    let src = guest_src(r#"(memory (export "memory") 1 4)"#);
    let mut a = guest_of(&creator, &src, &tenant);
    let mut b = guest_of(&creator, &src, &tenant);
    let (fill_a, fill_b) = (a.kernel("fill"), b.kernel("fill"));
    // The launch's wait refused three times: the kernel may still run, the guest traps.
    for n in 1..=3 {
        creator
            .backend()
            .driver()
            .fail_call(Call::StreamSynchronize, n, 999);
    }
    let trap = a
        .try_launch(fill_a, &[(4096, 4096), (1, 0)])
        .expect_err("traps");
    assert!(
        matches!(
            trap.downcast_ref::<TwmError>(),
            Some(TwmError::WorkMayRun { .. })
        ),
        "{trap:#}"
    );
    assert_eq!(
        b.launch(fill_b, &[(4096, 16), (1, 0)]),
        TWM_ERR_BUSY,
        "the tenant's one launch in flight is still taken"
    );
    // The Store goes: its stream is waited for (the driver answers now), and the place goes
    // back.
    drop(a);
    assert_eq!(b.launch(fill_b, &[(4096, 16), (1, 0)]), 0);
}

/// Nested ranges (sorted by start, one that starts earlier and ends later than the next two)
/// are refused as overlapping.
#[test]
fn host_slices_mut_nested_ranges() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest(&creator);
    let memory = g.memory;
    let ranges = [
        AccessRange::read_write(0, 100),
        AccessRange::read_write(10, 5),
        AccessRange::read_write(50, 10),
    ];
    let refused = DeviceAccess::run(
        &mut g.store,
        &creator,
        &memory,
        &ranges,
        ScopeOptions::default(),
        |scope| scope.host_slices_mut::<u8>().is_err(),
    )
    .unwrap();
    assert!(refused);
}

/// A scope over a zero-length range at the very end and past the end.
#[test]
fn scope_edges() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest(&creator);
    let memory = g.memory;
    let page = 65_536u64;
    for (r, ok) in [
        (AccessRange::read_write(page, 0), true),
        (AccessRange::read_write(page - 1, 1), true),
        (AccessRange::read_write(page, 1), false),
        (AccessRange::read_write(u64::MAX, 1), false),
        (AccessRange::read_write(1, u64::MAX), false),
    ] {
        let opened = DeviceAccess::open(&mut g.store, &creator, &memory, &[r]).map(|s| s.close());
        assert_eq!(opened.is_ok(), ok, "{r:?}: {opened:?}");
    }
}

/// A start function that launches a kernel (inside `instantiate`): it runs, and is counted
/// once.
#[test]
fn launch_from_a_start_function() {
    let creator = creator_with(kernels::builtin().max_in_flight(1));
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    let engine = creator.engine().unwrap();
    let mut linker: Linker<Data> = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let src = r#"(module
      (import "twm" "kernel" (func $kernel (param i32 i32) (result i32)))
      (import "twm" "launch" (func $launch (param i32 i32 i32) (result i32)))
      (memory (export "memory") 1)
      (global $r (export "r") (mut i32) (i32.const 99))
      (data (i32.const 0) "fill")
      ;; args at 1024: buffer (4096, 4096), scalar (7, 0)
      (data (i32.const 1024) "\00\10\00\00\00\00\00\00\00\10\00\00\00\00\00\00\07\00\00\00\00\00\00\00\00\00\00\00\00\00\00\00")
      (func $start
        (global.set $r (call $launch (call $kernel (i32.const 0) (i32.const 4)) (i32.const 1024) (i32.const 2))))
      (start $start))"#;
    let module = Module::new(&engine, src).unwrap();
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    let r = instance
        .get_global(&mut store, "r")
        .unwrap()
        .get(&mut store)
        .i32()
        .unwrap();
    assert_eq!(r, 0, "the start function's launch ran");
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    assert!(memory.data(&store)[4096..8192].iter().all(|&b| b == 7));
    assert_eq!(tenant.stats().launches + tenant.stats().refused_launches, 1);
}

/// Two tenants in neighbouring pool slots: A's kernels over its whole memory, ending exactly at
/// its end, never reach B's slot; A's memory declared smaller than its slot.
#[test]
fn pool_neighbours_are_untouched() {
    let backend = Arc::new(MockBackend::default());
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(4 * 65_536, 2)],
        ))
        .kernels(kernels::builtin())
        .build()
        .unwrap();
    let mut a = guest_with(&creator, r#"(memory (export "memory") 1 4)"#);
    let tb = Tenant::new(2, "b", 1 << 20, IsolationLevel::StreamIsolated);
    let engine = creator.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let module = Module::new(&engine, guest_src(r#"(memory (export "memory") 4 4)"#)).unwrap();
    let mut sb = new_store(
        &engine,
        TenantStore::new(&creator, &tb, ChargeMode::Touched, ()),
    );
    let ib = instantiate(&mut sb, &linker, &module).unwrap();
    let mb = ib.get_memory(&mut sb, "memory").unwrap();
    mb.data_mut(&mut sb).fill(0x5A);
    let fill = a.kernel("fill");
    let inc = a.kernel("increment");
    let page = 65_536u64;
    assert_eq!(a.launch(fill, &[(2048, page - 2048), (0xEE, 0)]), 0);
    assert_eq!(a.launch(inc, &[(2048, page - 2048)]), 0);
    assert_eq!(
        a.launch(fill, &[(2048, page - 2047), (0xEE, 0)]),
        TWM_ERR_OUT_OF_RANGE
    );
    // Past the memory but inside the slot: refused.
    assert_eq!(
        a.launch(fill, &[(page, page), (0xEE, 0)]),
        TWM_ERR_OUT_OF_RANGE
    );
    assert!(mb.data(&sb).iter().all(|&b| b == 0x5A));
    // A grows into the rest of its slot: the new pages are zero.
    assert_eq!(a.memory.grow(&mut a.store, 3).unwrap(), 1);
    assert!(
        a.memory.data(&a.store)[page as usize..]
            .iter()
            .all(|&b| b == 0)
    );
}

/// memory64 declarations past every limit: refused typed at instantiation, no panic.
#[test]
fn memory64_huge_declarations() {
    let creator = creator_with(kernels::builtin());
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    let engine = creator.engine().unwrap();
    let mut linker: Linker<Data> = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    // (declaration, made): a minimum past the tenant's 1 MiB cap is refused, typed; a huge
    // maximum is not (growth is what the cap and the limits bound).
    for (decl, made) in [
        ("(memory (export \"memory\") i64 65537)", false),
        ("(memory (export \"memory\") i64 0x1000000000000)", false),
        ("(memory (export \"memory\") i64 1 0x1000000000000)", true),
        ("(memory (export \"memory\") i64 17)", false),
    ] {
        // Past what Wasm allows: Wasmtime's own refusal is fine.
        let Ok(module) = Module::new(&engine, format!("(module {decl})")) else {
            continue;
        };
        let mut store = new_store(
            &engine,
            TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
        );
        match instantiate(&mut store, &linker, &module) {
            Ok(instance) => {
                assert!(made, "{decl}: instantiated");
                let memory = instance.get_memory(&mut store, "memory").unwrap();
                assert!(
                    memory.grow(&mut store, 16).is_err(),
                    "{decl}: grown past the cap"
                );
            }
            Err(e) => {
                assert!(!made, "{decl}: {e:#}");
                assert!(e.downcast_ref::<TwmError>().is_some(), "{decl}: {e:#}");
            }
        }
    }
}
