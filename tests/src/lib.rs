//! The conformance suite every tensor-wasm-mem backend must pass.
//!
//! A backend joins by implementing [`Harness`] (how to make a fresh instance, and which of its
//! counters and fault knobs the suite may use), then expanding [`conformance!`] once in a
//! module of `tests/tests/conformance.rs` and adding its cases to that file's `main`:
//!
//! ```ignore
//! mod with_mock {
//!     tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::MockHarness);
//! }
//! // in main: runner::trials("with_mock", with_mock::cases()),
//! ```
//!
//! Each case is one test, `with_<harness>::<case>`, run by [`runner`] (libtest-mimic): a case
//! that needs a control the backend lacks calls [`runner::skip`] and returns, and is reported as
//! ignored with its reason (never as passed). `KnoblessMockHarness` runs the suite as a real
//! driver would, with none of the optional controls.
#![deny(missing_docs)]

pub mod books;
pub mod guests;
pub mod harness;
pub mod kernels;
pub mod races;
pub mod recovery;
pub mod runner;
pub mod sim;
pub mod suite;

pub use harness::Harness;
/// The core, for the macros.
pub use tensor_wasm_mem_core as core;

/// Expands to `cases()`: every conformance case (of [`suite`], [`books`] and [`races`]) on
/// `$harness`, for the [`runner`]. The one list of the suite's cases.
#[macro_export]
macro_rules! conformance {
    ($harness:ty) => {
        /// Every conformance case on this harness, by name (run by [`runner`]).
        pub fn cases() -> ::std::vec::Vec<$crate::runner::Case> {
            ::std::vec![
                (
                    "recover_after_a_fault_in_shared_work",
                    $crate::recovery::recover_after_a_fault_in_shared_work::<$harness> as fn()
                ),
                (
                    "recover_after_a_fault_in_stream_isolated_work",
                    $crate::recovery::recover_after_a_fault_in_stream_isolated_work::<$harness>
                        as fn()
                ),
                (
                    "recover_a_context_isolated_fault_is_the_tenants_alone",
                    $crate::recovery::recover_a_context_isolated_fault_is_the_tenants_alone::<
                        $harness,
                    > as fn()
                ),
                (
                    "recover_through_a_second_fault_and_a_refused_reset",
                    $crate::recovery::recover_through_a_second_fault_and_a_refused_reset::<$harness>
                        as fn()
                ),
                (
                    "recover_waits_for_a_call_in_flight",
                    $crate::recovery::recover_waits_for_a_call_in_flight::<$harness> as fn()
                ),
                (
                    "recover_one_device_of_two",
                    $crate::recovery::recover_one_device_of_two::<$harness> as fn()
                ),
                (
                    "capabilities_are_honest",
                    $crate::suite::capabilities_are_honest::<$harness> as fn()
                ),
                (
                    "attached_host_memory_follows_the_drivers_rules",
                    $crate::suite::attached_host_memory_follows_the_drivers_rules::<$harness>
                        as fn()
                ),
                (
                    "pageable_host_memory_takes_advice_and_prefetch",
                    $crate::suite::pageable_host_memory_takes_advice_and_prefetch::<$harness>
                        as fn()
                ),
                (
                    "allocate_write_zero_free",
                    $crate::suite::allocate_write_zero_free::<$harness> as fn()
                ),
                (
                    "allocate_zero_bytes_is_refused",
                    $crate::suite::allocate_zero_bytes_is_refused::<$harness> as fn()
                ),
                (
                    "allocate_unknown_device_is_refused",
                    $crate::suite::allocate_unknown_device_is_refused::<$harness> as fn()
                ),
                (
                    "allocate_too_much_is_out_of_memory",
                    $crate::suite::allocate_too_much_is_out_of_memory::<$harness> as fn()
                ),
                (
                    "allocations_are_aligned_and_disjoint",
                    $crate::suite::allocations_are_aligned_and_disjoint::<$harness> as fn()
                ),
                (
                    "zero_rejects_bad_ranges",
                    $crate::suite::zero_rejects_bad_ranges::<$harness> as fn()
                ),
                (
                    "free_gives_memory_back",
                    $crate::suite::free_gives_memory_back::<$harness> as fn()
                ),
                (
                    "buffer_growth_never_moves_the_base",
                    $crate::suite::buffer_growth_never_moves_the_base::<$harness> as fn()
                ),
                (
                    "buffer_window_reads_zero",
                    $crate::suite::buffer_window_reads_zero::<$harness> as fn()
                ),
                (
                    "advise_accepts_every_valid_range",
                    $crate::suite::advise_accepts_every_valid_range::<$harness> as fn()
                ),
                (
                    "advise_rejects_out_of_range",
                    $crate::suite::advise_rejects_out_of_range::<$harness> as fn()
                ),
                (
                    "advise_rejects_overflow",
                    $crate::suite::advise_rejects_overflow::<$harness> as fn()
                ),
                (
                    "advise_rejects_unknown_device",
                    $crate::suite::advise_rejects_unknown_device::<$harness> as fn()
                ),
                (
                    "prefetch_accepts_every_valid_range",
                    $crate::suite::prefetch_accepts_every_valid_range::<$harness> as fn()
                ),
                (
                    "prefetch_rejects_out_of_range",
                    $crate::suite::prefetch_rejects_out_of_range::<$harness> as fn()
                ),
                (
                    "prefetch_rejects_overflow",
                    $crate::suite::prefetch_rejects_overflow::<$harness> as fn()
                ),
                (
                    "prefetch_rejects_unknown_device",
                    $crate::suite::prefetch_rejects_unknown_device::<$harness> as fn()
                ),
                (
                    "shared_stream_is_shared",
                    $crate::suite::shared_stream_is_shared::<$harness> as fn()
                ),
                (
                    "isolated_streams_are_distinct_and_released",
                    $crate::suite::isolated_streams_are_distinct_and_released::<$harness> as fn()
                ),
                (
                    "context_isolation_is_per_tenant",
                    $crate::suite::context_isolation_is_per_tenant::<$harness> as fn()
                ),
                (
                    "unknown_streams_are_refused",
                    $crate::suite::unknown_streams_are_refused::<$harness> as fn()
                ),
                (
                    "pool_reuse_scrubs",
                    $crate::suite::pool_reuse_scrubs::<$harness> as fn()
                ),
                (
                    "reset_hints_restores_a_fresh_allocation",
                    $crate::suite::reset_hints_restores_a_fresh_allocation::<$harness> as fn()
                ),
                (
                    "pool_reuse_resets_hints",
                    $crate::suite::pool_reuse_resets_hints::<$harness> as fn()
                ),
                (
                    "pool_reuse_never_exhausts",
                    $crate::suite::pool_reuse_never_exhausts::<$harness> as fn()
                ),
                (
                    "pool_exhaustion_is_typed",
                    $crate::suite::pool_exhaustion_is_typed::<$harness> as fn()
                ),
                (
                    "tenants_never_see_each_others_bytes",
                    $crate::suite::tenants_never_see_each_others_bytes::<$harness> as fn()
                ),
                (
                    "device_slices_stay_in_the_window",
                    $crate::suite::device_slices_stay_in_the_window::<$harness> as fn()
                ),
                (
                    "injected_allocate_failure_rolls_back",
                    $crate::suite::injected_allocate_failure_rolls_back::<$harness> as fn()
                ),
                (
                    "injected_zero_failure_rolls_back",
                    $crate::suite::injected_zero_failure_rolls_back::<$harness> as fn()
                ),
                (
                    "injected_advise_failure_rolls_back",
                    $crate::suite::injected_advise_failure_rolls_back::<$harness> as fn()
                ),
                (
                    "injected_prefetch_failure_rolls_back",
                    $crate::suite::injected_prefetch_failure_rolls_back::<$harness> as fn()
                ),
                (
                    "injected_stream_failure_rolls_back",
                    $crate::suite::injected_stream_failure_rolls_back::<$harness> as fn()
                ),
                (
                    "injected_free_failure_is_reported",
                    $crate::suite::injected_free_failure_is_reported::<$harness> as fn()
                ),
                (
                    "failures_at_every_step_leave_nothing",
                    $crate::suite::failures_at_every_step_leave_nothing::<$harness> as fn()
                ),
                (
                    "device_pool_cap_is_the_tenant_cap",
                    $crate::suite::device_pool_cap_is_the_tenant_cap::<$harness> as fn()
                ),
                (
                    "device_pool_shares_the_cap_with_linear_memory",
                    $crate::suite::device_pool_shares_the_cap_with_linear_memory::<$harness>
                        as fn()
                ),
                (
                    "device_pool_tenants_do_not_share_a_ceiling",
                    $crate::suite::device_pool_tenants_do_not_share_a_ceiling::<$harness> as fn()
                ),
                (
                    "device_pool_failed_allocation_leaves_no_charge",
                    $crate::suite::device_pool_failed_allocation_leaves_no_charge::<$harness>
                        as fn()
                ),
                (
                    "device_pool_drop_frees_everything",
                    $crate::suite::device_pool_drop_frees_everything::<$harness> as fn()
                ),
                (
                    "device_pool_memory_comes_zeroed",
                    $crate::suite::device_pool_memory_comes_zeroed::<$harness> as fn()
                ),
                (
                    "device_pool_driver_maximum_is_a_second_line",
                    $crate::suite::device_pool_driver_maximum_is_a_second_line::<$harness>
                        as fn()
                ),
                (
                    "device_pool_trim_gives_memory_back",
                    $crate::suite::device_pool_trim_gives_memory_back::<$harness> as fn()
                ),
                (
                    "a_refused_free_keeps_its_charge",
                    $crate::books::a_refused_free_keeps_its_charge::<$harness> as fn()
                ),
                (
                    "recover_gives_a_faulted_stores_charge_back",
                    $crate::books::recover_gives_a_faulted_stores_charge_back::<$harness> as fn()
                ),
                (
                    "recover_waits_for_a_store_the_embedder_keeps",
                    $crate::books::recover_waits_for_a_store_the_embedder_keeps::<$harness>
                        as fn()
                ),
                (
                    "a_refused_unregister_keeps_its_charge",
                    $crate::books::a_refused_unregister_keeps_its_charge::<$harness> as fn()
                ),
                (
                    "context_first_stream_race_gives_one_context",
                    $crate::races::context_first_stream_race_gives_one_context::<$harness>
                        as fn()
                ),
                (
                    "context_storm_keeps_every_stream_usable",
                    $crate::races::context_storm_keeps_every_stream_usable::<$harness> as fn()
                ),
                (
                    "tenants_sharing_an_id_are_isolated",
                    $crate::races::tenants_sharing_an_id_are_isolated::<$harness> as fn()
                ),
                (
                    "device_pool_cap_holds_when_a_free_returns_late",
                    $crate::races::device_pool_cap_holds_when_a_free_returns_late::<$harness>
                        as fn()
                ),
                (
                    "device_pool_cap_holds_under_contention",
                    $crate::races::device_pool_cap_holds_under_contention::<$harness> as fn()
                ),
                (
                    "failed_stream_destroy_stays_counted_until_drop",
                    $crate::races::failed_stream_destroy_stays_counted_until_drop::<$harness>
                        as fn()
                ),
                (
                    "failed_context_destroy_stays_counted_until_drop",
                    $crate::races::failed_context_destroy_stays_counted_until_drop::<$harness>
                        as fn()
                ),
                (
                    "failed_pool_destroy_stays_counted_until_drop",
                    $crate::races::failed_pool_destroy_stays_counted_until_drop::<$harness>
                        as fn()
                ),
                (
                    "context_stack_is_left_as_it_was",
                    $crate::races::context_stack_is_left_as_it_was::<$harness> as fn()
                ),
                (
                    "device_pool_refuses_another_tenants_stream",
                    $crate::races::device_pool_refuses_another_tenants_stream::<$harness> as fn()
                ),
                (
                    "streams_are_made_on_the_device_named",
                    $crate::suite::streams_are_made_on_the_device_named::<$harness> as fn()
                ),
                (
                    "unknown_driver_code_is_a_typed_error",
                    $crate::suite::unknown_driver_code_is_a_typed_error::<$harness> as fn()
                ),
                (
                    "kernel_writes_land_when_the_stream_is_synchronised",
                    $crate::suite::kernel_writes_land_when_the_stream_is_synchronised::<$harness>
                        as fn()
                ),
                (
                    "scrub_is_ordered_after_the_tenants_pending_work",
                    $crate::suite::scrub_is_ordered_after_the_tenants_pending_work::<$harness>
                        as fn()
                ),
                (
                    "free_while_a_prefetch_is_queued_is_seen",
                    $crate::suite::free_while_a_prefetch_is_queued_is_seen::<$harness> as fn()
                ),
                (
                    "pool_block_is_reused_on_another_stream_only_after_an_event",
                    $crate::suite::pool_block_is_reused_on_another_stream_only_after_an_event::<
                        $harness,
                    > as fn()
                ),
            ]
        }
    };
}
