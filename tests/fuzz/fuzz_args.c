/* fuzz_args.c — the training binary's command line: rt_parse_args on an argv split from the
 * input at NUL bytes and newlines. (fp8c's own flags are parsed in compiler/main.c, which
 * exits on the first bad one: that parser is not callable from here.) */
#include "rt.h"
#include "fuzz_util.h"

enum { MAX_ARGS = 64 };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > FUZZ_MAX_INPUT) return -1;
    rt_set_error_stream(fuzz_null());
    char *text = fuzz_text(data, size);
    char *argv[MAX_ARGS + 2] = {"train"};
    int argc = 1;
    char *p = text, *end = text + size;
    while (p < end && argc <= MAX_ARGS) {
        char *q = p;
        while (q < end && *q != '\0' && *q != '\n') q++;
        *q = '\0';
        argv[argc++] = p;
        p = q + 1;
    }
    argv[argc] = NULL;
    TrainOptions o;
    rt_parse_args(argc, argv, &o);
    rt_clear_error();
    free(text);
    return 0;
}
