/* saxpy.c: a guest launches the host's "saxpy" kernel (y = a * x + y over n floats) on its
 * own arrays, then checks every element. Prints one line; exits 0 when the result is right,
 * 1 when it is wrong, and the launch's own code (as 100 - code) when the host refused it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twm.h"

int main(void) {
    const uint32_t n = 100000;
    float *x = malloc(n * sizeof *x);
    float *y = malloc(n * sizeof *y);
    if (!x || !y) {
        return 2;
    }
    for (uint32_t i = 0; i < n; i++) {
        x[i] = (float)i;
        y[i] = 1.0f;
    }
    int32_t saxpy = twm_kernel("saxpy", strlen("saxpy"));
    if (saxpy < 0) {
        printf("saxpy: %s\n", twm_strerror(saxpy));
        return 100 - saxpy;
    }
    twm_arg args[] = {TWM_F32(2.0f), TWM_BUFFER(x, n * sizeof *x), TWM_BUFFER(y, n * sizeof *y),
                      TWM_U32(n)};
    int32_t rc = twm_launch(saxpy, args, 4);
    if (rc != TWM_OK) {
        printf("launch: %s\n", twm_strerror(rc));
        return 100 - rc;
    }
    /* A launch the kernel's signature forbids: y written while it is also x. */
    twm_arg aliased[] = {TWM_F32(2.0f), TWM_BUFFER(y, n * sizeof *y), TWM_BUFFER(y, n * sizeof *y),
                         TWM_U32(n)};
    int32_t refused = twm_launch(saxpy, aliased, 4);
    uint32_t wrong = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (y[i] != 2.0f * (float)i + 1.0f) {
            wrong++;
        }
    }
    printf("saxpy over %u floats: %u wrong; an aliased launch: %s\n", n, wrong,
           twm_strerror(refused));
    return wrong == 0 && refused == TWM_ERR_BAD_ARGUMENTS ? 0 : 1;
}
