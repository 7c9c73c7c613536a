/* fuzz_ir.c — the textual IR reader (`fp8c opt`, the pass golden files): ir_read, then
 * ir_verify on what it accepted. */
#include "ir.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > FUZZ_MAX_INPUT) return -1;
    diag_set_stream(fuzz_null());
    char *text = fuzz_text(data, size);
    Arena *a = arena_new();
    Graph *g = ir_read(a, "fuzz.ir", text);
    if (g) ir_verify(g, "read");
    arena_free(a);
    free(text);
    diag_reset();
    return 0;
}
