/*
 * twm.h: the tensor-wasm-mem host functions for C guests (clang --target=wasm32-wasi).
 *
 * A guest whose linear memory lives in CUDA managed memory can tell the host how it will use
 * its buffers: prefetch a range to a device (or back to the host) before a kernel runs on it,
 * and set memory-advice hints. Every call checks its range against the guest's own memory and
 * answers a code; a bad call never traps.
 *
 *     #include "twm.h"
 *     float *x = malloc(n * sizeof *x);
 *     int rc = twm_prefetch(x, n * sizeof *x, TWM_LOCATION_DEVICE(0));
 *     if (rc != TWM_OK) fprintf(stderr, "prefetch: %s\n", twm_strerror(rc));
 *
 * The values here are the host's own (integrations/wasmtime/src/guest.rs); a test in
 * integrations/wasmtime/tests/sdk.rs checks every one of them against it.
 */
#ifndef TWM_H
#define TWM_H

#include <stddef.h>
#include <stdint.h>

/* Results. */
#define TWM_OK 0
#define TWM_ERR_OUT_OF_RANGE (-1)      /* the range ends past the memory's current size */
#define TWM_ERR_OVERFLOW (-2)          /* ptr + len wraps the 32-bit address space */
#define TWM_ERR_UNKNOWN_ADVICE (-3)    /* no such advice code */
#define TWM_ERR_UNKNOWN_DEVICE (-4)    /* a location below -1, or no such device */
#define TWM_ERR_BACKEND (-5)           /* the backend (driver) failed */
#define TWM_ERR_NOT_DEVICE_MEMORY (-6) /* no exported `memory`, or not device-visible */
#define TWM_ERR_UNSUPPORTED (-7)       /* the memory's backing or device cannot do this */
#define TWM_ERR_UNKNOWN_KERNEL (-8)    /* no kernel of that name or handle */
#define TWM_ERR_BAD_ARGUMENTS (-9)     /* arguments that do not match the kernel's signature */
#define TWM_ERR_KERNEL_FAULT (-10)     /* the kernel failed on the device */
#define TWM_ERR_BUSY (-11)             /* the tenant has as many launches in flight as it may */

/* Advice (cudaMemAdvise). */
#define TWM_ADVICE_SET_READ_MOSTLY 0
#define TWM_ADVICE_UNSET_READ_MOSTLY 1
#define TWM_ADVICE_SET_PREFERRED_LOCATION 2
#define TWM_ADVICE_UNSET_PREFERRED_LOCATION 3
#define TWM_ADVICE_SET_ACCESSED_BY 4
#define TWM_ADVICE_UNSET_ACCESSED_BY 5

/* Locations: the host, or device n (n >= 0). */
#define TWM_LOCATION_HOST (-1)
#define TWM_LOCATION_DEVICE(n) ((int32_t)(n))

/* The raw imports (module "twm"): unsigned 32-bit pointer and length. */
__attribute__((import_module("twm"), import_name("advise")))
int32_t twm_advise_raw(uint32_t ptr, uint32_t len, int32_t advice, int32_t location);

__attribute__((import_module("twm"), import_name("prefetch")))
int32_t twm_prefetch_raw(uint32_t ptr, uint32_t len, int32_t location);

/* Applies `advice` (TWM_ADVICE_*) to the `len` bytes at `ptr`, for `location` (used by the
 * preferred-location and accessed-by advice, ignored by read-mostly). */
static inline int32_t twm_advise(const void *ptr, size_t len, int32_t advice, int32_t location) {
    if (len > UINT32_MAX) {
        return TWM_ERR_OVERFLOW;
    }
    return twm_advise_raw((uint32_t)(uintptr_t)ptr, (uint32_t)len, advice, location);
}

/* Prefetches the `len` bytes at `ptr` to `location` on the instance's stream. */
static inline int32_t twm_prefetch(const void *ptr, size_t len, int32_t location) {
    if (len > UINT32_MAX) {
        return TWM_ERR_OVERFLOW;
    }
    return twm_prefetch_raw((uint32_t)(uintptr_t)ptr, (uint32_t)len, location);
}

/* Kernels the host registered: look one up by name, then launch it on buffers of this guest's
 * own memory and scalars. The launch returns when the kernel is done. */
__attribute__((import_module("twm"), import_name("kernel")))
int32_t twm_kernel_raw(uint32_t name, uint32_t len);

__attribute__((import_module("twm"), import_name("launch")))
int32_t twm_launch_raw(int32_t kernel, uint32_t args, uint32_t nargs);

/* One launch argument: a buffer (its address and bytes), or a scalar (its value, 0). */
typedef struct {
    uint64_t a;
    uint64_t b;
} twm_arg;

#define TWM_BUFFER(ptr, bytes) ((twm_arg){(uint64_t)(uintptr_t)(ptr), (uint64_t)(bytes)})
#define TWM_U32(v) ((twm_arg){(uint64_t)(uint32_t)(v), 0})
#define TWM_U64(v) ((twm_arg){(uint64_t)(v), 0})
static inline twm_arg TWM_F32(float v) {
    union {
        float f;
        uint32_t u;
    } bits = {v};
    return (twm_arg){bits.u, 0};
}

/* The handle of the kernel the host registered as `name` (>= 0), or TWM_ERR_UNKNOWN_KERNEL. */
static inline int32_t twm_kernel(const char *name, size_t len) {
    if (len > UINT32_MAX) {
        return TWM_ERR_OVERFLOW;
    }
    return twm_kernel_raw((uint32_t)(uintptr_t)name, (uint32_t)len);
}

/* Launches `kernel` with `nargs` arguments and waits for it. */
static inline int32_t twm_launch(int32_t kernel, const twm_arg *args, uint32_t nargs) {
    return twm_launch_raw(kernel, (uint32_t)(uintptr_t)args, nargs);
}

/* A short description of a result code. */
static inline const char *twm_strerror(int32_t code) {
    switch (code) {
    case TWM_OK: return "ok";
    case TWM_ERR_OUT_OF_RANGE: return "range past the end of memory";
    case TWM_ERR_OVERFLOW: return "range overflows";
    case TWM_ERR_UNKNOWN_ADVICE: return "unknown advice";
    case TWM_ERR_UNKNOWN_DEVICE: return "unknown device";
    case TWM_ERR_BACKEND: return "backend failed";
    case TWM_ERR_NOT_DEVICE_MEMORY: return "memory is not device-visible";
    case TWM_ERR_UNSUPPORTED: return "not supported by this memory";
    case TWM_ERR_UNKNOWN_KERNEL: return "unknown kernel";
    case TWM_ERR_BAD_ARGUMENTS: return "arguments do not match the kernel";
    case TWM_ERR_KERNEL_FAULT: return "the kernel failed";
    case TWM_ERR_BUSY: return "too many launches in flight";
    default: return "unknown result";
    }
}

#endif /* TWM_H */
