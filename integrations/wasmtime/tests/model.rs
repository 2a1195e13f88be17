//! Guest-pointer resolution against a plain model: random growth and random (offset, len)
//! queries, through the embedder API and through the guest ABI; proptest shrinks a failure to a
//! minimal sequence.

mod common;

use common::*;
use proptest::prelude::*;
use tensor_wasm_mem_core::IsolationLevel;
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::*;

const GUEST: &str = r#"(module
  (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1 8)
  (func (export "advise") (param i32 i32) (result i32)
    (call $advise (local.get 0) (local.get 1) (i32.const 0) (i32.const -1)))
  (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0))))"#;

#[derive(Clone, Debug)]
enum Op {
    Grow(u32),
    Resolve(u64, u64),
    GuestAdvise(u32, u32),
}

/// Offsets and lengths near the interesting edges: 0, page boundaries, the 32-bit edge, u64::MAX.
fn edgy() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..16,
        (0u64..=8).prop_flat_map(|p| (p * PAGE as u64).saturating_sub(4)..=p * PAGE as u64 + 4),
        Just(u64::from(u32::MAX)),
        Just(1u64 << 32),
        (u64::MAX - 8)..=u64::MAX,
        any::<u64>(),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u32..4).prop_map(Op::Grow),
        (edgy(), edgy()).prop_map(|(o, l)| Op::Resolve(o, l)),
        (edgy(), edgy()).prop_map(|(o, l)| Op::GuestAdvise(o as u32, l as u32)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn resolution_matches_the_model(ops in proptest::collection::vec(op(), 1..30)) {
        let backend = mock();
        let creator = fresh(&backend);
        let engine = creator.engine().unwrap();
        let mut linker = Linker::new(&engine);
        add_to_linker(&mut linker).unwrap();
        let tenant = Tenant::new(1, "model", 1 << 30, IsolationLevel::Shared);
        let mut store = new_store(&engine, TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()));
        let module = Module::new(&engine, GUEST).unwrap();
        let instance = instantiate(&mut store, &linker, &module).unwrap();
        let memory = instance.get_memory(&mut store, "memory").unwrap();
        let grow = instance.get_typed_func::<i32, i32>(&mut store, "grow").unwrap();
        let advise = instance.get_typed_func::<(i32, i32), i32>(&mut store, "advise").unwrap();
        let base = memory.data_ptr(&store) as u64;
        let mut pages = 1u64; // the model
        for op in ops {
            match op {
                Op::Grow(n) => {
                    let got = grow.call(&mut store, n as i32).unwrap();
                    if pages + u64::from(n) <= 8 {
                        prop_assert_eq!(got, pages as i32);
                        pages += u64::from(n);
                    } else {
                        prop_assert_eq!(got, -1);
                    }
                }
                Op::Resolve(offset, len) => {
                    let size = pages * PAGE as u64;
                    let inside = offset.checked_add(len).is_some_and(|end| end <= size);
                    match creator.resolve(&store, &memory, offset, len) {
                        Ok(slice) => {
                            prop_assert!(inside, "resolved {}+{} outside {}", offset, len, size);
                            prop_assert_eq!(slice.device_ptr(), base + offset);
                            prop_assert_eq!(slice.len() as u64, len);
                        }
                        Err(TwmError::GuestRange(_)) => prop_assert!(!inside),
                        Err(other) => prop_assert!(false, "unexpected error {}", other),
                    }
                }
                Op::GuestAdvise(ptr, len) => {
                    let size = pages * PAGE as u64;
                    let end = u64::from(ptr) + u64::from(len);
                    let expected = if end > 1 << 32 {
                        TWM_ERR_OVERFLOW
                    } else if end > size {
                        TWM_ERR_OUT_OF_RANGE
                    } else {
                        TWM_OK
                    };
                    prop_assert_eq!(advise.call(&mut store, (ptr as i32, len as i32)).unwrap(), expected);
                }
            }
            prop_assert_eq!(memory.data_size(&store) as u64, pages * PAGE as u64);
            prop_assert_eq!(tenant.stats().touched_bytes, pages * PAGE as u64);
        }
    }
}
