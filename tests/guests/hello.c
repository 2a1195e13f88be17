/* hello.c: a WASI command that prints its arguments, one environment variable and, if the
 * host preopened /data, the first line of /data/in.txt; `exit=N` as an argument makes it exit
 * with status N. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    int status = 0;
    printf("argc=%d\n", argc);
    for (int i = 1; i < argc; i++) {
        printf("argv[%d]=%s\n", i, argv[i]);
        if (strncmp(argv[i], "exit=", 5) == 0) {
            status = atoi(argv[i] + 5);
        }
    }
    const char *greeting = getenv("TWM_GREETING");
    printf("TWM_GREETING=%s\n", greeting ? greeting : "(unset)");
    FILE *f = fopen("/data/in.txt", "r");
    if (f) {
        char line[128] = {0};
        if (fgets(line, sizeof line, f)) {
            line[strcspn(line, "\n")] = 0;
            printf("in.txt=%s\n", line);
        }
        fclose(f);
    }
    fflush(stdout);
    return status;
}
