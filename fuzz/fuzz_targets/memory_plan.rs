//! `MemoryPlan` never panics or overflows, and every plan it makes keeps its invariants.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tensor_wasm_mem_core::{
    HARD_MAX_LINEAR_MEMORY_BYTES, MemoryPlan, MemoryType, PlanLimits, WASM_PAGE_SIZE,
};

#[derive(Arbitrary, Debug)]
struct Input {
    minimum_pages: u64,
    maximum_pages: Option<u64>,
    page_size_log2: u8,
    memory64: bool,
    limit: u64,
    default_maximum: u64,
    minimum_bytes: usize,
    maximum_bytes: Option<usize>,
    byte_pages: bool,
}

fuzz_target!(|input: Input| {
    let limits = PlanLimits::new(input.limit)
        .and_then(|l| l.with_default_maximum(input.default_maximum))
        .unwrap_or_default();
    assert!(limits.per_memory_limit() <= HARD_MAX_LINEAR_MEMORY_BYTES);
    let ty = MemoryType {
        minimum_pages: input.minimum_pages,
        maximum_pages: input.maximum_pages,
        page_size_log2: input.page_size_log2,
        memory64: input.memory64,
    };
    let page = if input.byte_pages { 1 } else { WASM_PAGE_SIZE };
    for plan in [
        MemoryPlan::new(&ty, &limits),
        MemoryPlan::from_bytes(input.minimum_bytes, input.maximum_bytes, page, &limits),
    ]
    .into_iter()
    .flatten()
    {
        assert!(plan.initial_bytes() <= plan.capacity_bytes());
        assert!(plan.capacity_bytes() <= limits.per_memory_limit());
        assert!(plan.capacity_bytes() <= HARD_MAX_LINEAR_MEMORY_BYTES);
        if let Some(max) = plan.declared_maximum_bytes() {
            assert!(u128::from(plan.capacity_bytes()) <= max.max(u128::from(plan.initial_bytes())));
        }
        assert!(plan.can_grow_to(plan.capacity_bytes()));
        assert!(!plan.can_grow_to(plan.capacity_bytes() + 1));
    }
});
