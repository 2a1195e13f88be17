//! Guest-pointer resolution, through the embedder API and the guest ABI, against the model:
//! a range resolves only inside the memory's current size, without overflow; anything else is a
//! typed error or a documented code, never a panic.
#![no_main]

use std::sync::{Arc, OnceLock};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tensor_wasm_mem_core::IsolationLevel;
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::wasmtime::{Engine, Linker, Module};
use tensor_wasm_mem_wasmtime::*;

const PAGE: u64 = 65536;
const GUEST: &str = r#"(module
  (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1 4)
  (func (export "advise") (param i32 i32 i32 i32) (result i32)
    (call $advise (local.get 0) (local.get 1) (local.get 2) (local.get 3)))
  (func (export "prefetch") (param i32 i32 i32) (result i32)
    (call $prefetch (local.get 0) (local.get 1) (local.get 2)))
  (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0))))"#;

struct Setup {
    creator: TensorWasmMemoryCreator<MockBackend>,
    engine: Engine,
    linker: Linker<TenantStore<MockBackend>>,
    module: Module,
    tenant: Arc<Tenant>,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
            .build()
            .unwrap();
        let engine = creator.engine().unwrap();
        let mut linker = Linker::new(&engine);
        add_to_linker(&mut linker).unwrap();
        let module = Module::new(&engine, GUEST).unwrap();
        let tenant = Tenant::new(1, "fuzz", u64::MAX, IsolationLevel::StreamIsolated);
        Setup {
            creator,
            engine,
            linker,
            module,
            tenant,
        }
    })
}

#[derive(Arbitrary, Debug)]
enum Op {
    Grow(u8),
    Resolve(u64, u64),
    Advise(i32, i32, i32, i32),
    Prefetch(i32, i32, i32),
}

fuzz_target!(|ops: Vec<Op>| {
    let s = setup();
    let mut store = new_store(
        &s.engine,
        TenantStore::new(&s.creator, &s.tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &s.linker, &s.module).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    let grow = instance.get_typed_func::<i32, i32>(&mut store, "grow").unwrap();
    let advise = instance
        .get_typed_func::<(i32, i32, i32, i32), i32>(&mut store, "advise")
        .unwrap();
    let prefetch = instance
        .get_typed_func::<(i32, i32, i32), i32>(&mut store, "prefetch")
        .unwrap();
    let base = memory.data_ptr(&store) as u64;
    let mut pages = 1u64;
    for op in ops.into_iter().take(64) {
        let size = pages * PAGE;
        match op {
            Op::Grow(n) => {
                let got = grow.call(&mut store, i32::from(n)).unwrap();
                if pages + u64::from(n) <= 4 {
                    assert_eq!(got, pages as i32);
                    pages += u64::from(n);
                } else {
                    assert_eq!(got, -1);
                }
            }
            Op::Resolve(offset, len) => {
                let inside = offset.checked_add(len).is_some_and(|end| end <= size);
                match s.creator.resolve(&store, &memory, offset, len) {
                    Ok(slice) => {
                        assert!(inside);
                        assert_eq!(slice.device_ptr, base + offset);
                    }
                    Err(TwmError::GuestRange(_)) => assert!(!inside),
                    Err(e) => panic!("unexpected {e}"),
                }
            }
            Op::Advise(ptr, len, advice, location) => {
                let code = advise.call(&mut store, (ptr, len, advice, location)).unwrap();
                let end = u64::from(ptr as u32) + u64::from(len as u32);
                let expected = if end > 1 << 32 {
                    TWM_ERR_OVERFLOW
                } else if location < -1 || location > 0 {
                    TWM_ERR_UNKNOWN_DEVICE
                } else if !(0..=5).contains(&advice) {
                    TWM_ERR_UNKNOWN_ADVICE
                } else if end > size {
                    TWM_ERR_OUT_OF_RANGE
                } else {
                    TWM_OK
                };
                assert_eq!(code, expected, "advise({ptr}, {len}, {advice}, {location})");
            }
            Op::Prefetch(ptr, len, location) => {
                let code = prefetch.call(&mut store, (ptr, len, location)).unwrap();
                let end = u64::from(ptr as u32) + u64::from(len as u32);
                let expected = if end > 1 << 32 {
                    TWM_ERR_OVERFLOW
                } else if location < -1 || location > 0 {
                    TWM_ERR_UNKNOWN_DEVICE
                } else if end > size {
                    TWM_ERR_OUT_OF_RANGE
                } else {
                    TWM_OK
                };
                assert_eq!(code, expected, "prefetch({ptr}, {len}, {location})");
            }
        }
    }
    drop(store);
    assert_eq!(s.tenant.stats().live_bytes, 0);
});
