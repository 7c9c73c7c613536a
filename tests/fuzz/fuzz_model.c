/* fuzz_model.c — the model language: front_compile_text, then the passes of pipeline.c with
 * ir_verify after each, on a small batch and sequence so that one input stays cheap. */
#include "compiler.h"
#include "rt.h"
#include "fuzz_util.h"

static const char *const passes[] = {
    "simplify", "chunk_loss", "autodiff", "optimizer", "release", "dce", "precision",
    "scaling",  "layout",     "schedule", "sums",      "memplan", "fuse",
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > FUZZ_MAX_INPUT) return -1;
    diag_set_stream(fuzz_null());
    rt_set_error_stream(fuzz_null());
    char *text = fuzz_text(data, size);
    Arena *a = arena_new();
    FrontOptions fo = {.batch = 2, .seq = 8};
    Graph *g = front_compile_text(a, "fuzz.model", text, &fo);
    if (g && ir_verify(g, "front") == 0) {
        PassOptions po = {.opt_level = 2, .verify = true};
        g->opt_level = po.opt_level;
        for (size_t i = 0; i < sizeof passes / sizeof passes[0]; i++)
            if (!pass_run(g, pass_find(passes[i]), &po)) break;
        if (getenv("FP8C_FUZZ_VERBOSE")) fprintf(stderr, "planned: %d nodes\n", g->n_nodes);
    }
    arena_free(a);
    free(text);
    diag_reset();
    return 0;
}
