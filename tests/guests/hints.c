/* hints.c: the twm SDK on real buffers: advice and prefetch that succeed, and each way a call
 * can be refused, with the code the host must answer. Prints one line per call; exits 0 when
 * every answer is the expected one, 1 otherwise. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "twm.h"

static int failures = 0;

static void expect(const char *what, int32_t got, int32_t want) {
    printf("%-28s %3d (%s)\n", what, got, twm_strerror(got));
    if (got != want) {
        printf("  expected %d (%s)\n", want, twm_strerror(want));
        failures++;
    }
}

int main(void) {
    size_t n = 256 * 1024;
    float *weights = malloc(n * sizeof *weights);
    if (!weights) {
        return 2;
    }
    for (size_t i = 0; i < n; i++) {
        weights[i] = (float)i;
    }
    size_t bytes = n * sizeof *weights;
    expect("read_mostly", twm_advise(weights, bytes, TWM_ADVICE_SET_READ_MOSTLY, TWM_LOCATION_HOST), TWM_OK);
    expect("preferred_location dev0",
           twm_advise(weights, bytes, TWM_ADVICE_SET_PREFERRED_LOCATION, TWM_LOCATION_DEVICE(0)), TWM_OK);
    expect("accessed_by host", twm_advise(weights, bytes, TWM_ADVICE_SET_ACCESSED_BY, TWM_LOCATION_HOST), TWM_OK);
    expect("prefetch to dev0", twm_prefetch(weights, bytes, TWM_LOCATION_DEVICE(0)), TWM_OK);
    expect("prefetch to host", twm_prefetch(weights, bytes, TWM_LOCATION_HOST), TWM_OK);

    uintptr_t end = (uintptr_t)__builtin_wasm_memory_size(0) * 65536;
    expect("past the end", twm_prefetch((void *)(end - 16), 4096, TWM_LOCATION_HOST), TWM_ERR_OUT_OF_RANGE);
    expect("wrapping range", twm_prefetch_raw(0xFFFFF000u, 0x2000u, TWM_LOCATION_HOST), TWM_ERR_OVERFLOW);
    expect("unknown device", twm_prefetch(weights, 64, TWM_LOCATION_DEVICE(99)), TWM_ERR_UNKNOWN_DEVICE);
    expect("unknown advice", twm_advise(weights, 64, 17, TWM_LOCATION_HOST), TWM_ERR_UNKNOWN_ADVICE);
    printf("%s\n", failures ? "FAILED" : "all as expected");
    return failures ? 1 : 0;
}
