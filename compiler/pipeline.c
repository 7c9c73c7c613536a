/* pipeline.c — the whole compiler in one function.
 *
 * Read pipeline_compile top to bottom and you have read fp8c: the model file becomes a forward
 * graph, autodiff appends the backward, the optimizer pass appends the update, and the passes
 * of passes.def then decide formats, scales, order and memory. Each step is a plain call; the
 * pass registry (passes/registry.c) adds verification and --print-ir-after around each one. */
#include "compiler.h"

#include <string.h>

static bool run_named(Graph *g, const char *name, const BuildOptions *o, bool *stop)
{
    if (*stop) return true;
    const PassInfo *p = pass_find(name);
    IR_ASSERT(p != NULL);
    bool ok = pass_run(g, p, &o->passes);
    if (o->stop_after && strcmp(o->stop_after, name) == 0) *stop = true;
    return ok;
}

Graph *pipeline_compile(Arena *a, const char *path, const BuildOptions *o)
{
    /* text -> AST -> forward graph with a loss; shapes checked, parameters named */
    Graph *g = front_compile_file(a, path, &o->front);
    if (!g) return NULL;
    g->opt_level = o->passes.opt_level;
    for (int i = 0; i < o->n_choices; i++) ir_set_choice(g, o->choices[i].name, o->choices[i].value);
    if (o->passes.print_after && !strcmp(o->passes.print_after, "all")) {
        printf("# IR after front\n");
        ir_print(g, stdout);
    }
    if (o->passes.verify && ir_verify(g, "front")) return NULL;
    bool stop = o->stop_after && !strcmp(o->stop_after, "front");

    /* training: backward for every parameter, then the AdamW update with clipping */
    if (!run_named(g, "simplify", o, &stop)) return NULL;
    if (!run_named(g, "chunk_loss", o, &stop)) return NULL;
    if (!run_named(g, "autodiff", o, &stop)) return NULL;
    if (!run_named(g, "optimizer", o, &stop)) return NULL;
    if (!run_named(g, "release", o, &stop)) return NULL;   /* only with --grad-release */
    if (!run_named(g, "recompute", o, &stop)) return NULL;   /* only with save.cheap=0, save.activations=0 or save.attention_inputs=0 */
    if (!run_named(g, "dce", o, &stop)) return NULL;

    /* precision: a format for every tensor, then scales and quantization where formats change */
    if (!run_named(g, "precision", o, &stop)) return NULL;
    if (!run_named(g, "scaling", o, &stop)) return NULL;
    if (!run_named(g, "layout", o, &stop)) return NULL;   /* transposed FP8 copies */

    /* several GPUs: each gradient averaged over them before the update (only with --gpus N) */
    if (!run_named(g, "comm", o, &stop)) return NULL;

    /* order and memory: the launch list, then one offset per tensor in two arenas */
    if (!run_named(g, "schedule", o, &stop)) return NULL;
    if (!run_named(g, "sums", o, &stop)) return NULL;
    if (!run_named(g, "memplan", o, &stop)) return NULL;

    /* kernels: which nodes run as one (after memplan, which decides whether delaying a node
     * into its consumer's kernel is safe; the planned graph itself stays unchanged) */
    if (!run_named(g, "fuse", o, &stop)) return NULL;
    return g;
}
