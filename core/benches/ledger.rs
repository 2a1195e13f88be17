//! Tenant ledger: reserve + release, uncontended and with a denial.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use tensor_wasm_mem_core::{IsolationLevel, TenantId, TenantLedger};

fn ledger(c: &mut Criterion) {
    let tenant = Arc::new(TenantLedger::new(
        TenantId(1),
        1 << 30,
        IsolationLevel::StreamIsolated,
    ));
    let mut group = c.benchmark_group("tenant_ledger");
    group.bench_function("reserve_release", |b| {
        b.iter(|| black_box(tenant.try_reserve(black_box(65536)).expect("granted")));
    });
    group.bench_function("reserve_grow_release", |b| {
        b.iter(|| {
            let mut r = tenant.try_reserve(black_box(65536)).expect("granted");
            r.try_grow(black_box(65536)).expect("granted");
            black_box(r)
        });
    });
    group.bench_function("denied", |b| {
        b.iter(|| black_box(tenant.try_reserve(black_box(2 << 30)).is_err()));
    });
    group.finish();
}

criterion_group!(benches, ledger);
criterion_main!(benches);
