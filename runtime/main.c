/* main.c — the entry point of every training binary that `fp8c build` links.
 *
 * The compiler embeds the planned graph's textual IR between the symbols fp8c_artifact and
 * fp8c_artifact_end (an assembler .incbin written by compiler/emit.c, NUL-terminated), so the
 * binary carries its whole plan and needs no compiler, no model file and no other file at run
 * time. This file only connects the pieces: flags first (a bad flag costs nothing), then the
 * artifact, then the training program of train.c. It is kept out of libfp8c_rt so that tests
 * link the runtime without an artifact. */
#include <string.h>

#include "rt.h"
#ifdef FP8C_HAVE_CUDA
#include "gpu.h"
#endif

extern const char fp8c_artifact[];
extern const char fp8c_artifact_end[];
#ifdef FP8C_HAVE_CUDA
/* the GPU kernels (a cubin for sm_90a) that emit.c embeds beside the artifact; empty when the
 * compiler had no NVRTC or the graph has nodes the GPU cannot run */
extern const char fp8c_cubin[];
extern const char fp8c_cubin_end[];
#endif

/* What --help adds about the model inside this binary. */
static void main_describe(const Graph *g) {
    printf("\nmodel %s, -O%d, batch %lld x %lld tokens, %s, default lr %g, memory %lld bytes\n",
           g->model_name ? g->model_name : "?", g->opt_level, (long long)g->batch,
           (long long)g->seq, ir_optim_name(g->optim.kind), g->optim.lr,
           (long long)(g->persistent_bytes + g->transient_bytes));
}

int main(int argc, char **argv) {
    rt_set_program_name(argv[0]);
#ifdef FP8C_HAVE_CUDA
    rt_device_register(cuda_rt_device(fp8c_cubin, (size_t)(fp8c_cubin_end - fp8c_cubin)));
#endif
    /* the CPU kernels fp8c compiled into this binary, when it did: "cpu" runs them */
    if (rt_cpu_kernels_device()) rt_device_register(rt_cpu_kernels_device());
    TrainOptions o;
    int args = rt_parse_args(argc, argv, &o);
    if (args == RT_ARGS_ERROR) return 2;
    /* a device asked for by name that cannot run here is a bad flag: say so before anything */
    if (args == RT_ARGS_OK && strcmp(o.device, "auto") != 0 && o.gpus <= 1 &&
        !rt_device_select(o.device))
        return 2;   /* (--gpus N > 1 starts no GPU here: its ranks, forked later, probe it) */

    Arena *arena = arena_new();
    const char *text = fp8c_artifact;
    if (strlen(text) != (size_t)(fp8c_artifact_end - fp8c_artifact - 1)) {
        rt_error("the embedded artifact is damaged (a NUL byte inside its text)");
        return 1;
    }
    Graph *g = ir_read(arena, "artifact", text);
    if (!g) {
        rt_error("the embedded artifact does not read back (%d errors above)", diag_error_count());
        return 1;
    }
    if (args == RT_ARGS_HELP) {
        rt_usage(stdout, argv[0]);
        main_describe(g);
        arena_free(arena);
        return rt_stdout_flush() ? 0 : 1;
    }
    if (!rt_tune_apply(g)) {
        arena_free(arena);
        return 1;
    }
    int status = rt_train(g, &o);
    arena_free(arena);
    /* --generate writes its tokens to stdout: a full disk there is an error, not status 0 */
    if (!rt_stdout_flush() && status == 0) status = 1;
    return status;
}
