//! Links the core into a `#![no_std]` static library with its own panic handler and allocator.
#![no_std]

extern crate alloc;

use core::alloc::{GlobalAlloc, Layout};
use core::panic::PanicInfo;
use core::sync::atomic::{AtomicUsize, Ordering};

use tensor_wasm_mem_core::{
    IsolationLevel, MemoryPlan, MemoryType, PlanLimits, TenantLedger, TenantId,
};

/// A bump allocator over a static arena: enough to prove linking, never meant to run long.
struct Arena;

const ARENA_BYTES: usize = 1 << 16;
static mut ARENA: [u8; ARENA_BYTES] = [0; ARENA_BYTES];
static NEXT: AtomicUsize = AtomicUsize::new(0);

// SAFETY: hands out disjoint, suitably aligned pieces of a static arena, or null when it is
// exhausted; never frees.
unsafe impl GlobalAlloc for Arena {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let base = core::ptr::addr_of_mut!(ARENA) as usize;
        let mut start = 0;
        let claimed = NEXT.fetch_update(Ordering::AcqRel, Ordering::Acquire, |next| {
            start = (base + next).next_multiple_of(layout.align()) - base;
            let end = start.checked_add(layout.size())?;
            (end <= ARENA_BYTES).then_some(end)
        });
        match claimed {
            Ok(_) => (base + start) as *mut u8,
            Err(_) => core::ptr::null_mut(),
        }
    }

    unsafe fn dealloc(&self, _ptr: *mut u8, _layout: Layout) {}
}

#[global_allocator]
static GLOBAL: Arena = Arena;

#[panic_handler]
fn panic(_: &PanicInfo<'_>) -> ! {
    loop {}
}

/// Exercises the plan and the ledger so they are linked in.
#[unsafe(no_mangle)]
pub extern "C" fn twm_no_std_smoke(pages: u64) -> u64 {
    let Ok(plan) = MemoryPlan::new(&MemoryType::wasm32(pages, None), &PlanLimits::default()) else {
        return 0;
    };
    let tenant = alloc::sync::Arc::new(TenantLedger::new(
        TenantId(1),
        plan.capacity_bytes(),
        IsolationLevel::default(),
    ));
    match tenant.try_reserve(plan.initial_bytes()) {
        Ok(r) => r.bytes(),
        Err(_) => 0,
    }
}
