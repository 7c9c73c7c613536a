/* ref_exec.c — the reference executor: one node at a time, every value through its format.
 *
 * This is the ground truth the GPU and LLVM backends are compared with, and the engine of the
 * CPU training run. Each node's inputs are decoded to f32 (ref_load_view in ref_tensor.c), a
 * kernel computes the result in f32 with f64 accumulation in its reductions, and the result is
 * rounded into its storage format (ref_store). Keeping the rounding at the storage boundary,
 * exactly where a GPU kernel would convert, is what makes a bf16 activation or an e4m3 saved
 * tensor behave here as on the device.
 *
 * This file is the top of the executor: it dispatches to the kernels (ref_ops.c, ref_gemm.c,
 * ref_attn.c, ref_optim.c, ref_quant.c), which read and write tensors through ref_tensor.c and
 * never call back here. */
#include "ref_internal.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------- dispatch */

static void exec_const(Node *n)
{
    int64_t count = ir_numel(&n->t);
    float *y = malloc(sizeof(float) * (size_t)(count ? count : 1));
    IR_ASSERT(y);
    for (int64_t i = 0; i < count; i++) y[i] = (float)IR_FATTR(n, CONST, value);
    ref_store(&n->t, y);
    free(y);
}

void ref_exec_node(Node *n)
{
    switch (n->op) {
    case OP_INPUT: case OP_PARAM: case OP_STATE: return;   /* hold their data already */
    case OP_CONST: exec_const(n); return;
    case OP_ACCUMULATE: ref_accumulate(n); return;         /* in place */
    case OP_ADAMW: case OP_LION: case OP_SGD: ref_update(n); return;
    case OP_AMAX_RECORD: ref_amax_record(n); return;
    case OP_DELAYED_SCALE: ref_delayed_scale(n); return;
    case OP_ALL_REDUCE: return;                            /* one rank: the mean is the value */
    case OP_ASSIGN: {                                      /* in place: state = value */
        float *v = ref_load(&n->in[1]->t);
        ref_store(&n->in[0]->t, v);
        free(v);
        return;
    }
    default: break;
    }

    enum { MAX_STACK_INPUTS = 16 };
    const float *stack_x[MAX_STACK_INPUTS];
    float *stack_owned[MAX_STACK_INPUTS];
    const float **x = stack_x;
    float **owned = stack_owned;
    if (n->n_in > MAX_STACK_INPUTS) {
        x = malloc(sizeof *x * (size_t)n->n_in);
        owned = malloc(sizeof *owned * (size_t)n->n_in);
        IR_ASSERT(x && owned);
    }
    for (int i = 0; i < n->n_in; i++) x[i] = ref_load_view(&n->in[i]->t, &owned[i]);
    int64_t count = ir_numel(&n->t);
    float *y = malloc(sizeof(float) * (size_t)(count ? count : 1));
    IR_ASSERT(y);
    const float *const *cx = x;

    switch (n->op) {
    case OP_ADD: case OP_SUB: case OP_MUL: ref_binary(n, cx, y); break;
    case OP_SCALE: ref_scale(n, cx, y); break;
    case OP_ADD_N: ref_add_n(n, cx, y); break;
    case OP_GELU: case OP_GELU_BWD: case OP_SILU: case OP_SILU_BWD: ref_unary(n, cx, y); break;
    case OP_CAST: case OP_RESHAPE: ref_copy(n, cx, y); break;
    case OP_SLICE: case OP_PAD: ref_slice(n, cx, y); break;
    case OP_CONCAT: ref_concat(n, cx, y); break;
    case OP_TRANSPOSE: ref_transpose(n, cx, y); break;
    case OP_MATMUL: ref_matmul(n, cx, y); break;
    case OP_SUM_ROWS: ref_sum_rows(n, cx, y); break;
    case OP_SQNORM: ref_sqnorm(n, cx, y); break;
    case OP_LAYERNORM: case OP_LAYERNORM_BWD_X: case OP_LAYERNORM_BWD_W:
    case OP_RMSNORM: case OP_RMSNORM_BWD_X: case OP_RMSNORM_BWD_W: ref_norm(n, cx, y); break;
    case OP_SOFTMAX: case OP_SOFTMAX_BWD: ref_softmax(n, cx, y); break;
    case OP_EMBEDDING: ref_embedding(n, cx, y); break;
    case OP_EMBEDDING_BWD: ref_embedding_bwd(n, cx, y); break;
    case OP_CROSS_ENTROPY: case OP_CROSS_ENTROPY_BWD: ref_cross_entropy(n, cx, y); break;
    case OP_ROPE: ref_rope(n, cx, y); break;
    case OP_ATTENTION: ref_attention(n, cx, y); break;
    case OP_ATTENTION_BWD: ref_attention_bwd(n, cx, y); break;
    case OP_CLIP_COEF: ref_clip_coef(n, cx, y); break;
    case OP_GRAD_NORM: ref_grad_norm(n, cx, y); break;
    case OP_QUANT_SCALE: ref_quant_scale(n, cx, y); break;
    case OP_QUANTIZE:
        /* the value is x; the result's format (scale = in[1]) does the quantizing */
        if (n->t.fmt.scaling != SCALE_NONE && n->t.fmt.scale != n->in[1])
            ref_die_node(n, "the result's scale tensor is not its second operand");
        ref_copy(n, cx, y);
        break;
    case OP_INPUT: case OP_PARAM: case OP_STATE: case OP_CONST:
    case OP_ACCUMULATE: case OP_ADAMW: case OP_LION: case OP_SGD: case OP_AMAX_RECORD: case OP_DELAYED_SCALE: case OP_ASSIGN:
    case OP_ALL_REDUCE: case OP_COUNT:
        IR_ASSERT(!"handled above");
    }

    ref_store(&n->t, y);
    free(y);
    for (int i = 0; i < n->n_in; i++) free(owned[i]);
    if (x != stack_x) {
        free(x);
        free(owned);
    }
}

/* FP8C_REF_PROFILE=1: wall and CPU time (all threads) per op kind, printed to stderr at exit.
 * The reference runs the CPU training, and this is the first thing to look at when a step is
 * slow; on a shared machine the CPU column is the one that does not count other people. */
static struct {
    bool on, checked;
    double wall[OP_COUNT], cpu[OP_COUNT];
    int64_t calls[OP_COUNT];
} profile;

static double clock_seconds(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void profile_print(void)
{
    double wall = 0, cpu = 0;
    for (int k = 0; k < OP_COUNT; k++) wall += profile.wall[k], cpu += profile.cpu[k];
    fprintf(stderr, "reference executor profile: %.3f s wall, %.3f s CPU in ops\n", wall, cpu);
    for (;;) {
        int best = -1;
        for (int k = 0; k < OP_COUNT; k++)
            if (profile.calls[k] && (best < 0 || profile.cpu[k] > profile.cpu[best])) best = k;
        if (best < 0) break;
        fprintf(stderr, "  %-18s %8.3f s wall %8.3f s CPU %5.1f%% %7lld calls\n",
                ir_op_info((OpKind)best)->text, profile.wall[best], profile.cpu[best],
                cpu > 0 ? 100 * profile.cpu[best] / cpu : 0.0, (long long)profile.calls[best]);
        profile.calls[best] = 0;
    }
}

static void run_node(Node *n)
{
    if (!profile.checked) {
        const char *env = getenv("FP8C_REF_PROFILE");
        profile.on = env && *env && strcmp(env, "0") != 0;
        profile.checked = true;
        if (profile.on) atexit(profile_print);
    }
    if (!profile.on) {
        ref_exec_node(n);
        return;
    }
    double w0 = clock_seconds(CLOCK_MONOTONIC), c0 = clock_seconds(CLOCK_PROCESS_CPUTIME_ID);
    ref_exec_node(n);
    profile.wall[n->op] += clock_seconds(CLOCK_MONOTONIC) - w0;
    profile.cpu[n->op] += clock_seconds(CLOCK_PROCESS_CPUTIME_ID) - c0;
    profile.calls[n->op]++;
}

void ref_run_phase(Graph *g, Phase phase)
{
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->phase == phase) run_node(g->nodes[i]);
}

void ref_run_micro_step(Graph *g)
{
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->phase != PHASE_UPDATE) run_node(g->nodes[i]);
}
