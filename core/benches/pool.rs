//! Slot pool: acquire + release, with and without a scrub of the touched window.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use tensor_wasm_mem_core::doc_support::HeapAllocator;
use tensor_wasm_mem_core::{DeviceId, PoolConfig, SizeClass, SlotPool};

fn pool(c: &mut Criterion) {
    let pool = Arc::new(
        SlotPool::new(
            HeapAllocator::new(),
            PoolConfig::new(
                DeviceId(0),
                [SizeClass::new(1 << 20, 64), SizeClass::new(16 << 20, 8)],
            ),
        )
        .expect("pool"),
    );
    let mut group = c.benchmark_group("slot_pool");
    group.bench_function("acquire_release_untouched", |b| {
        b.iter(|| black_box(pool.acquire(black_box(1 << 20), 0).expect("slot")));
    });
    for (name, visible) in [("scrub_64KiB", 64 << 10), ("scrub_1MiB", 1 << 20)] {
        group.bench_function(format!("acquire_release_{name}"), |b| {
            b.iter(|| black_box(pool.acquire(black_box(1 << 20), visible).expect("slot")));
        });
    }
    group.bench_function("acquire_release_larger_class", |b| {
        b.iter(|| black_box(pool.acquire(black_box(2 << 20), 0).expect("slot")));
    });
    group.finish();
}

criterion_group!(benches, pool);
criterion_main!(benches);
