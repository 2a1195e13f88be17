//! The shell's C contract, called directly (one test: the state is process-wide). The driver's
//! rules themselves are the model's, tested there.

#![allow(clippy::multiple_unsafe_ops_per_block)]

use std::ptr::null_mut;

use super::*;

fn ok(code: u32) {
    assert_eq!(code, code::SUCCESS);
}

#[test]
fn the_c_abi_over_the_model() {
    // SAFETY: every pointer passed below is valid for what the entry point writes; the kernel
    // runs over memory nothing else touches.
    unsafe {
        twm_sim_reset();
        assert_eq!(cuDeviceGetCount(&mut 0), code::NOT_INITIALIZED);
        let mut version = 0;
        ok(cuDriverGetVersion(&mut version));
        assert_eq!(version, 12080, "answered before cuInit, as the driver does");
        ok(twm_sim_configure(&SimConfig {
            device_count: 2,
            deferred: 1,
            ..SimConfig::DEFAULT
        }));
        assert_eq!(cuInit(1), code::INVALID_VALUE);
        ok(cuInit(0));
        let mut n = 0;
        ok(cuDeviceGetCount(&mut n));
        assert_eq!(n, 2);
        let mut v = 0;
        ok(cuDeviceGetAttribute(&mut v, attr::MANAGED_MEMORY, 1));
        assert_eq!(v, 1);
        assert_eq!(
            cuDeviceGetAttribute(&mut v, attr::MANAGED_MEMORY, 2),
            code::INVALID_DEVICE
        );

        // Memory needs a current context.
        let mut ptr = 0u64;
        assert_eq!(cuMemAllocManaged(&mut ptr, 4096, 1), code::INVALID_CONTEXT);
        let mut ctx = null_mut();
        // A primary context is active only while retained.
        ok(cuDevicePrimaryCtxRetain(&mut ctx, 1));
        ok(cuDevicePrimaryCtxRelease_v2(1));
        assert_eq!(cuCtxPushCurrent_v2(ctx), code::INVALID_CONTEXT, "released");
        assert_eq!(
            cuDevicePrimaryCtxRelease_v2(1),
            code::INVALID_CONTEXT,
            "no reference"
        );
        ok(cuDevicePrimaryCtxRetain(&mut ctx, 1));
        ok(cuCtxPushCurrent_v2(ctx));
        ok(cuMemAllocManaged(&mut ptr, 4096, 1));
        assert_eq!(twm_sim_context_depth(), 1);

        // Stream work lands when the stream is synchronised, not at the call.
        let mut stream = null_mut();
        ok(cuStreamCreate(&mut stream, 1));
        ok(cuMemsetD8Async(ptr, 7, 4096, stream));
        assert_eq!((ptr as *const u8).read_volatile(), 0);
        let mut event = null_mut();
        ok(cuEventCreate(&mut event, 0));
        ok(cuEventRecord(event, stream));
        assert_eq!(cuEventQuery(event), code::NOT_READY);
        ok(cuStreamSynchronize(stream));
        ok(cuEventQuery(event));
        assert_eq!((ptr as *const u8).add(4095).read_volatile(), 7);

        // A kernel: `fill(u64 data, u64 len, u32 value)`.
        let mut module = null_mut();
        ok(cuModuleLoadData(&mut module, c"image".as_ptr().cast()));
        let mut fill = null_mut();
        ok(cuModuleGetFunction(&mut fill, module, c"fill".as_ptr()));
        let (mut data, mut len, mut value) = (ptr, 16u64, 9u32);
        let mut params: [*mut c_void; 3] = [
            (&raw mut data).cast(),
            (&raw mut len).cast(),
            (&raw mut value).cast(),
        ];
        let launch = |params: &mut [*mut c_void; 3], grid: u32, block: u32| {
            cuLaunchKernel(
                fill,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                null_mut(),
            )
        };
        assert_eq!(
            launch(&mut params, 0, 1),
            code::INVALID_VALUE,
            "an empty grid"
        );
        assert_eq!(
            launch(&mut params, 1, 1025),
            code::INVALID_VALUE,
            "too many threads"
        );
        ok(launch(&mut params, 1, 1));
        ok(cuStreamSynchronize(stream));
        assert_eq!((ptr as *const u8).add(15).read_volatile(), 9);
        assert_eq!((ptr as *const u8).add(16).read_volatile(), 7);

        // Any code can be injected, including one no CUDA enum knows; the shell passes it on.
        assert_eq!(
            twm_sim_fail_nth(c"cuMemAdvice_v2".as_ptr(), 1, 1),
            code::NOT_FOUND,
            "a typo"
        );
        let name = c"cuMemAdvise_v2";
        ok(twm_sim_fail_nth(name.as_ptr(), 1, 4242));
        let device = MemLocation {
            kind: LOCATION_DEVICE,
            id: 1,
        };
        assert_eq!(cuMemAdvise_v2(ptr, 4096, 3, device), 4242);
        ok(cuMemAdvise_v2(ptr, 4096, 3, device));
        assert_eq!(twm_sim_calls(name.as_ptr()), 2);
        let mut hints = SimHints {
            read_mostly: 0,
            preferred: 0,
            accessed_by: 0,
            resident: 0,
        };
        ok(twm_sim_hints(ptr, &mut hints));
        assert_eq!(hints.preferred, 1);
        let mut text: *const c_char = c"stale".as_ptr();
        assert_eq!(cuGetErrorName(4242, &mut text), code::INVALID_VALUE);
        assert!(text.is_null(), "an unknown code's name is NULL");
        ok(cuGetErrorName(code::ILLEGAL_ADDRESS, &mut text));
        assert_eq!(CStr::from_ptr(text), c"CUDA_ERROR_ILLEGAL_ADDRESS");

        // An event belongs to the context it was made in: recorded on another's stream it is
        // refused; a stream of any context may wait on it.
        let mut other = null_mut();
        ok(cuCtxCreate_v2(&mut other, 0, 1));
        let mut theirs = null_mut();
        ok(cuStreamCreate(&mut theirs, 1));
        assert_eq!(cuEventRecord(event, theirs), code::INVALID_HANDLE);
        ok(cuStreamWaitEvent(theirs, event, 0));
        ok(cuCtxDestroy_v2(other));
        assert_eq!(
            cuEventCreate(&mut null_mut(), 0),
            code::SUCCESS,
            "still in the primary"
        );

        // A kernel outside every allocation: an illegal address, sticky for the context.
        let mut wild = 0x10u64;
        params[0] = (&raw mut wild).cast();
        ok(cuLaunchKernel(
            fill,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            null_mut(),
        ));
        assert_eq!(cuStreamSynchronize(stream), code::ILLEGAL_ADDRESS);
        assert_eq!(cuMemAllocManaged(&mut 0, 4096, 1), code::ILLEGAL_ADDRESS);

        let mut stats = SimStats::default();
        ok(twm_sim_stats(&mut stats));
        assert_eq!(
            (
                stats.live_allocations,
                stats.live_streams,
                stats.primary_refs
            ),
            (1, 1, 1)
        );
        assert!(stats.failed_calls >= 4 && stats.injected == 1);
        twm_sim_reset();
        assert_eq!(twm_sim_context_depth(), 0);
        ok(twm_sim_configure(&SimConfig::DEFAULT));
    }
}
