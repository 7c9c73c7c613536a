/* comm_shard.c — sharded optimizer state (--shard-states): which elements each rank updates.
 *
 * With N ranks and --shard-states every rank keeps the bf16 weights and the gradient
 * accumulators whole (the forward and backward read and write them) and 1/N of what only the
 * update reads: the master weights and the optimizer states (Adam m and v, Lion's and SGD's
 * momentum) with their codecs' side values. A step then reduce-scatters the gradients (rank r
 * receives the sum of its shard only, in place in its accumulator), updates its shard, and
 * all-gathers the new weights (and, at the levels that keep them, the e4m3 weight copies the
 * FP8 GEMMs read). This is ZeRO stage 1. With --shard-states=2 (stage 2) the accumulators
 * are sharded as well, on the same boundaries: a rank keeps only its shard's sum, and the
 * backward writes into transient bucket buffers (comm_grads.c has that half). With
 * --shard-states=3 (stage 3) the weights the GEMMs read (and their FP8 copies) are cut on the
 * same boundaries too, and gathered per layer while the step runs (comm_weights.c).
 *
 * Shards are per tensor, not of one flat buffer: shard r of a parameter of n elements is
 * [r S, (r+1) S) clipped to n, with S = ceil(n / N) rounded up to the update's group. The
 * group is the least common multiple of what each tensor the update touches needs a boundary
 * to fall on and of the gradient norm's chunk (IR_SQNORM_CHUNK, 4096 elements: each rank then
 * sums whole chunks of the gradient's squares, the same chunks one rank sums, so the norm and
 * the clip coefficient do not depend on N): 128 for O2's e4m3 expand codec, 32 for O3's
 * companded states, both dividing the chunk (the side values
 * are per group of consecutive elements, so a shard that starts on a group boundary owns
 * whole groups and encodes them exactly as the whole tensor would), 1 for f32, bf16, the split
 * master and a per-tensor scaled copy. A tensor scaled per row or per block would need its
 * scales cut with it; none of the levels keeps such a state, and such an update is not split
 * (rank 0 owns it whole) rather than split wrongly. Per tensor keeps every kernel of the
 * update as it is (a shard is a contiguous run of its tensor's elements and of its side
 * values), and what else the update needs of a whole tensor is a small all-reduce: the
 * weight's amax for the FP8 copy's delayed scale (max) and the gradient's chunk sums of squares
 * for the norm (a sum, one f64 a chunk, each nonzero on its owner only: cuda/exec_shard.c).
 *
 * The arithmetic is here, once, for the plan, the checkpoint's gather and scatter, the host
 * reference of the sharded update (ref_update_shard) and the executors. */
#include <string.h>

#include "rt.h"

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

int64_t rt_shard_unit(const Tensor *t) {
    int64_t n = ir_numel(t);
    const Format *f = &t->fmt;
    if (f->codec == CODEC_SPLIT) return 1;
    if (f->codec != CODEC_PLAIN) return codec_group_size(f->codec);
    if (f->scaling == SCALE_NONE || f->scaling == SCALE_PER_TENSOR) return 1;
    return n > 0 ? n : 1;   /* scales per row or block: not split (see above) */
}

/* The tensors an update reads and writes elementwise (ops.def: ADAMW, LION, SGD). */
static int update_tensors(const Node *u, const Tensor **out) {
    int k = 0, states = ir_update_lr_index(u);   /* param, grad, then the states */
    for (int i = 0; i < states; i++) out[k++] = &u->in[i]->t;
    int at = ir_adamw_master_index(u);
    if (at >= 0) out[k++] = &u->in[at]->t;
    at = ir_adamw_copy_index(u);
    if (at >= 0) out[k++] = &u->in[at]->t;
    return k;
}

/* The gradient's norm is summed in chunks of IR_SQNORM_CHUNK elements (ir.h): starting from
 * that unit puts every shard boundary on a chunk boundary, so each rank sums whole chunks and
 * the norm is the same on any number of ranks. It is a multiple of the codecs' groups. */
int64_t rt_shard_group(const Node *update) {
    const Tensor *ts[8];
    int k = update_tensors(update, ts);
    int64_t g = IR_SQNORM_CHUNK, n = ir_numel(&update->in[0]->t);
    if (g >= n) return n > 0 ? n : 1;
    for (int i = 0; i < k; i++) {
        int64_t u = rt_shard_unit(ts[i]);
        g = g / gcd64(g, u) * u;
        if (g >= n) return n > 0 ? n : 1;
    }
    return g;
}

RtShard rt_shard_of(int64_t n, int64_t group, int ranks, int rank) {
    IR_ASSERT(group > 0 && ranks > 0 && rank >= 0 && rank < ranks);
    int64_t s = (n + ranks - 1) / ranks;
    s = (s + group - 1) / group * group;
    int64_t lo = (int64_t)rank * s, hi = lo + s;
    lo = lo < n ? lo : n;
    hi = hi < n ? hi : n;
    return (RtShard){lo, hi - lo};
}

int64_t rt_shard_bytes(const Tensor *t, int64_t len) {
    int64_t b = len * fmt_elem_bytes(t->fmt.elem);
    if (t->fmt.codec != CODEC_PLAIN && t->fmt.codec != CODEC_SPLIT)
        b += codec_param_count(t->fmt.codec, len) * (int64_t)sizeof(float);
    return b;
}

void rt_shard_copy(const Tensor *t, RtShard s, void *whole, float *whole_params, void *part,
                   float *part_params, bool to_whole) {
    int64_t eb = fmt_elem_bytes(t->fmt.elem);
    IR_ASSERT(s.off % rt_shard_unit(t) == 0 || s.len == 0);
    char *w = (char *)whole + s.off * eb;
    if (to_whole) memcpy(w, part, (size_t)(s.len * eb));
    else memcpy(part, w, (size_t)(s.len * eb));
    if (t->fmt.codec == CODEC_PLAIN || t->fmt.codec == CODEC_SPLIT) return;
    int64_t at = codec_param_count(t->fmt.codec, s.off), count = codec_param_count(t->fmt.codec, s.len);
    if (to_whole) memcpy(whole_params + at, part_params, sizeof(float) * (size_t)count);
    else memcpy(part_params, whole_params + at, sizeof(float) * (size_t)count);
}

/* The persistent tensor (the STATE or PARAM node) behind an update's operand: the gradient's
 * accumulator behind its all_reduce, itself otherwise. */
static const Node *state_of(const Node *x) {
    while (x->op == OP_ALL_REDUCE || x->op == OP_ACCUMULATE) x = x->in[0];
    return x;
}

static bool shard_all(const Graph *g) {
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_ALL_REDUCE && IR_IATTR(g->nodes[i], ALL_REDUCE, shard)) return true;
    return false;
}

bool rt_shard_states(const Graph *g) { return shard_all(g); }

/* Rank 0's share of tensor t of an update split in groups of `group`: the most any rank
 * keeps (shards are filled in rank order). */
static void shard_saving(const Tensor *t, int64_t group, int ranks, Role role, RtShardPlan *p) {
    int64_t n = ir_numel(t), len = rt_shard_of(n, group, ranks, 0).len;
    int64_t whole = n * fmt_elem_bytes(t->fmt.elem), part = len * fmt_elem_bytes(t->fmt.elem);
    p->per_gpu[role] -= whole - part;
    if (t->fmt.codec != CODEC_PLAIN && t->fmt.codec != CODEC_SPLIT && t->fmt.scale) {
        Role r = t->fmt.scale->t.role;
        p->per_gpu[r] -= (codec_param_count(t->fmt.codec, n) - codec_param_count(t->fmt.codec, len)) *
                         (int64_t)sizeof(float);
    }
}

void rt_shard_plan(const Graph *g, const int64_t *by_role, int ranks, RtShardPlan *p) {
    memset(p, 0, sizeof *p);
    p->ranks = ranks;
    memcpy(p->per_gpu, by_role, sizeof p->per_gpu);
    p->stage = rt_shard_stage(g);
    p->on = p->stage > 0 && ranks > 1;
    RtGatherPlan gp;
    rt_gather_plan(g, ranks, &gp);
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *u = g->nodes[i];
        if (!ir_op_is_update(u->op)) continue;
        int64_t n = ir_numel(&u->in[0]->t), group = rt_shard_group(u);
        int64_t wb = n * fmt_elem_bytes(u->in[0]->t.fmt.elem);
        /* stage 3: a gathered weight (and its copy) is not broadcast after its update */
        const RtGatherWeight *gw = rt_gather_weight(&gp, u->in[0]);
        p->updates++;
        if (!gw) p->weight_bytes += wb;
        p->grad_bytes += ir_numel(&u->in[1]->t) * fmt_elem_bytes(u->in[1]->t.fmt.elem);
        p->norm_values += (ir_numel(&u->in[1]->t) + IR_SQNORM_CHUNK - 1) / IR_SQNORM_CHUNK;
        int at = ir_adamw_copy_index(u);
        if (at >= 0 && !gw) p->copy_bytes += ir_numel(&u->in[at]->t) * fmt_elem_bytes(u->in[at]->t.fmt.elem);
        if (ir_update_amax_index(u) >= 0) p->amax_values++;   /* the copy's, or O3's weight amax */
        if (group >= n && n > 0) p->whole_updates++;
        if (group > p->group) p->group = group < n ? group : p->group;
        if (!p->on) continue;
        if (gw) {
            shard_saving(&u->in[0]->t, group, ranks, ROLE_PARAM, p);
            if (at >= 0) shard_saving(&u->in[at]->t, group, ranks, ROLE_WEIGHT_COPY, p);
        }
        /* the states and the master: 1/N each; the accumulator too at stage 2 */
        if (p->stage >= 2) shard_saving(&state_of(u->in[1])->t, group, ranks, ROLE_GRAD, p);
        int states = ir_update_lr_index(u);
        for (int k = 2; k < states; k++) shard_saving(&u->in[k]->t, group, ranks, state_of(u->in[k])->t.role, p);
        int m = ir_adamw_master_index(u);
        if (m >= 0) shard_saving(&u->in[m]->t, group, ranks, state_of(u->in[m])->t.role, p);
    }
    for (int r = 0; r < ROLE_COUNT; r++) p->saved += by_role[r] - p->per_gpu[r];
    p->gathered_weights = gp.n_weights;
    p->whole_params = gp.whole_params;
    p->whole_matrices = gp.whole_matrices;
    p->whole_param_bytes = gp.whole_bytes;
    p->gather_buffers = gp.n_buffers;
    p->gather_buffer_bytes = p->on ? gp.buffer_bytes : 0;
    p->gathered_fp8 = gp.gathered_fp8;
    p->gathered_bf16 = gp.gathered_bf16;
    p->sent_gather_fp8 = gp.sent_fp8;
    p->sent_gather_bf16 = gp.sent_bf16;
    p->gather_amax_values = gp.amax_values;
    rt_gather_plan_free(&gp);
    if (!p->on) return;
    if (p->stage >= 2) p->grad_buffer_bytes = rt_grad_buffer_bytes(g);
    /* per GPU per step, ring algorithms: a reduce-scatter or an all-gather moves (N-1)/N of
     * the whole, an all-reduce twice that */
    int64_t n1 = ranks - 1;
    p->sent_reduce_scatter = p->grad_bytes * n1 / ranks;
    p->sent_gather_weights = p->weight_bytes * n1 / ranks;
    p->sent_gather_copies = p->copy_bytes * n1 / ranks;
    p->sent_scalars = 2 * n1 * ((int64_t)sizeof(double) * p->norm_values + (int64_t)sizeof(float) * p->amax_values) / ranks;
    p->sent_gather_scalars = 2 * n1 * (int64_t)sizeof(float) * p->gather_amax_values / ranks;
}
