/* grow.c: allocates (and touches) the number of MiB given as its argument, 1 MiB at a time, so
 * its linear memory grows. A failed malloc (a failed memory.grow: the tenant's cap said no) is
 * the program's own error path: a message and exit status 12, not a trap. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Kept where the optimiser cannot drop them. */
unsigned char *volatile chunks[4096];

int main(int argc, char **argv) {
    int want = argc > 1 ? atoi(argv[1]) : 8;
    if (want < 0 || want > 4096) {
        fprintf(stderr, "grow: 0..4096 MiB\n");
        return 2;
    }
    unsigned long sum = 0;
    for (int i = 0; i < want; i++) {
        unsigned char *chunk = malloc(1 << 20);
        chunks[i] = chunk;
        if (!chunk) {
            fprintf(stderr, "grow: malloc failed after %d MiB\n", i);
            printf("allocated %d of %d MiB\n", i, want);
            return 12;
        }
        memset(chunk, i + 1, 1 << 20);
        sum += ((volatile unsigned char *)chunk)[12345];
    }
    printf("allocated %d of %d MiB (checksum %lu), memory is %lu pages\n", want, want, sum,
           (unsigned long)__builtin_wasm_memory_size(0));
    return 0;
}
