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
    default: return "unknown result";
    }
}

#endif /* TWM_H */
