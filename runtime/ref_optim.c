/* ref_optim.c — gradient accumulation, norms and the optimizer updates (AdamW, Lion, SGD with
 * momentum) of the reference executor.
 *
 * These are the ops of the update phase (and ACCUMULATE, which ends each micro-step). Two kinds
 * of them write into their inputs: ACCUMULATE adds into the accumulator's storage, and an update
 * (ADAMW, LION, SGD) changes param, its states (AdamW: m, v; Lion, SGD: m) and master, and
 * zeroes the gradient (and, where the scaling pass gave it the weight's FP8 copy, writes next
 * step's copy and the weights' amax; at O3, the weights' amax alone). They decode and encode
 * every one of those tensors through its own format, so an e4m3 Adam moment or a bf16 gradient
 * accumulator is rounded exactly where the GPU's fused update would round it; values inside
 * one update (the new m and v feeding the step) stay unrounded, as in registers.
 *
 * ref_update_shard runs one rank's shard of an update (--shard-states, runtime/comm_shard.c):
 * the ranks' shards together compute the whole update's bytes, given the same clip and the
 * maximum of their weight amaxes; tests/test_shard.c holds them to it bit for bit.
 * ref_reduce_to_owner is a micro-step's sum into one rank's shard of an accumulator
 * (--shard-states=2, runtime/comm_grads.c), in the order documented there.
 *
 * SQNORM sums squares in f64 over the fixed chunks of ir.h (IR_SQNORM_CHUNK elements from the
 * tensor's start) and then adds the chunk sums in order, as the GPU kernels do (each chunk in
 * its own order there): the result is the same for any thread count, and for any split of the
 * tensor on chunk boundaries, which is how --shard-states cuts it (rt_shard_group). */
#include "ref_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *x;
    int64_t n;
    double *partial;
} SqJob;

static void sqnorm_task(void *ctx, int64_t c)
{
    SqJob *j = ctx;
    int64_t lo = c * IR_SQNORM_CHUNK, hi = lo + IR_SQNORM_CHUNK < j->n ? lo + IR_SQNORM_CHUNK : j->n;
    double s = 0;
    for (int64_t i = lo; i < hi; i++) s += (double)j->x[i] * j->x[i];
    j->partial[c] = s;
}

void ref_sqnorm_chunks(const float *x, int64_t n, double *out)
{
    SqJob j = {.x = x, .n = n, .partial = out};
    ref_parallel_for((n + IR_SQNORM_CHUNK - 1) / IR_SQNORM_CHUNK, sqnorm_task, &j);
}

float ref_sqnorm_sum(const double *chunks, int64_t count)
{
    double s = 0;
    for (int64_t c = 0; c < count; c++) s += chunks[c];
    return (float)s;
}

void ref_sqnorm(const Node *n, const float *const *x, float *y)
{
    int64_t count = ir_numel(&n->in[0]->t), chunks = (count + IR_SQNORM_CHUNK - 1) / IR_SQNORM_CHUNK;
    double *partial = calloc((size_t)(chunks ? chunks : 1), sizeof(double));
    IR_ASSERT(partial);
    ref_sqnorm_chunks(x[0], count, partial);
    y[0] = ref_sqnorm_sum(partial, chunks);
    free(partial);
}

void ref_clip_coef(const Node *n, const float *const *x, float *y)
{
    double max_norm = IR_FATTR(n, CLIP_COEF, max_norm), norm = x[0][0];
    y[0] = max_norm > 0 ? (float)fmin(1.0, max_norm / (norm + 1e-6)) : 1.0f;
}

/* (grad_scale, sqnorms..) -> sqrt(sum of every element of the sqnorms) * grad_scale */
void ref_grad_norm(const Node *n, const float *const *x, float *y)
{
    double s = 0;
    for (int k = 1; k < n->n_in; k++) {
        int64_t m = ir_numel(&n->in[k]->t);
        for (int64_t i = 0; i < m; i++) s += x[k][i];
    }
    y[0] = (float)(sqrt(s) * x[0][0]);
}

void ref_accumulate(Node *n)
{
    Tensor *acc = &n->in[0]->t;
    const Tensor *g = &n->in[1]->t;
    int64_t count = ir_numel(acc);
    if (ir_numel(g) != count || ir_numel(&n->t) != count)
        ref_die_node(n, "accumulator has %lld elements, gradient %lld", (long long)count,
                     (long long)ir_numel(g));
    float *a = ref_load(acc), *d = ref_load(g);
    for (int64_t i = 0; i < count; i++) a[i] += d[i];
    ref_store(acc, a);
    /* the result is the accumulator; a result bound to storage of its own gets the value too */
    if (n->t.data && n->t.data != acc->data) ref_store(&n->t, a);
    free(a);
    free(d);
}

/* ---------------------------------------------------------------- the updates */

enum { A_PARAM, A_GRAD, A_M, A_V };

typedef struct {
    OpKind op;
    float *w, *g, *m, *v;       /* decoded; w is the master when there is one; v: AdamW only */
    double lr, gmul, b1, b2, eps, wd, inv_bc1, inv_bc2;   /* 1 / (1 - beta^step) */
    bool nesterov;
    int64_t n;
} UpdateJob;

/* g is the mean gradient times the clip coefficient (gmul = grad_scale * clip). AdamW and
 * Lion decay the weight decoupled from the gradient; SGD adds PyTorch's L2 term to it. */
static void update_task(void *ctx, int64_t c)
{
    UpdateJob *j = ctx;
    int64_t lo = c * 4096, hi = lo + 4096 < j->n ? lo + 4096 : j->n;
    for (int64_t i = lo; i < hi; i++) {
        double g = j->g[i] * j->gmul, w = j->w[i], m;
        switch (j->op) {
        case OP_ADAMW: {
            m = j->b1 * j->m[i] + (1 - j->b1) * g;
            double v = j->b2 * j->v[i] + (1 - j->b2) * g * g;
            double mhat = m * j->inv_bc1, vhat = v * j->inv_bc2;
            w -= j->lr * (mhat / (sqrt(vhat) + j->eps) + j->wd * w);
            j->v[i] = (float)v;
            break;
        }
        case OP_LION: {
            double d = j->b1 * j->m[i] + (1 - j->b1) * g;
            double sign = d > 0 ? 1 : d < 0 ? -1 : 0;
            w -= j->lr * (sign + j->wd * w);
            m = j->b2 * j->m[i] + (1 - j->b2) * g;
            break;
        }
        default: {          /* OP_SGD */
            g += j->wd * w;
            m = j->b1 * j->m[i] + g;
            w -= j->lr * (j->nesterov ? g + j->b1 * m : m);
            break;
        }
        }
        j->m[i] = (float)m;
        j->w[i] = (float)w;
        j->g[i] = 0;
    }
}

/* The amax of the weights just stored, for the next update's scale (or at O3 the next step's
 * per-use scales): into amax_state, or (a shard's, which the ranks' maximum makes the
 * tensor's) into *amax_out; and where there is one (copy), their FP8 copy as the forward would
 * quantize them (through the copy's format and scale). */
static void store_copy(const Node *n, const Tensor *param, Tensor *copy, Tensor *amax_state,
                       float *amax_out)
{
    if (ir_numel(amax_state) != 1) ref_die_node(n, "the copy's amax must be a scalar");
    float *w = ref_load(param);
    float amax = ref_amax(w, ir_numel(param));
    if (copy) ref_store(copy, w);
    if (amax_out) *amax_out = amax;
    else ref_store(amax_state, &amax);
    free(w);
}

/* ---------------------------------------------------------------- shards (--shard-states)
 * A shard of an update is elements [off, off+len) of each tensor it touches: a view with the
 * shard's length, its storage offset into the tensor's, and for a group codec its groups'
 * side values, which a shard starting on a group boundary owns whole (runtime/comm_shard.c).
 * The step is elementwise, so a shard's update is the whole update's restricted to it. */
typedef struct {
    Tensor t;
    Node params;
} ShardView;

static Tensor *shard_view(const Node *n, Tensor *t, int64_t off, int64_t len, ShardView *v)
{
    if (!t || (off == 0 && len == ir_numel(t))) return t;
    int64_t unit = rt_shard_unit(t);
    if (off % unit || (len % unit && off + len != ir_numel(t)))
        ref_die_node(n, "a shard [%lld, %lld) of '%s' does not fall on its groups of %lld",
                     (long long)off, (long long)(off + len), t->name ? t->name : "unnamed", (long long)unit);
    v->t = *t;
    v->t.rank = 1;
    v->t.dims[0] = len;
    v->t.bytes = len * fmt_elem_bytes(t->fmt.elem);
    v->t.data = t->data ? (char *)t->data + off * fmt_elem_bytes(t->fmt.elem) : NULL;
    if (t->fmt.codec != CODEC_PLAIN && t->fmt.codec != CODEC_SPLIT) {
        const Tensor *p = &t->fmt.scale->t;
        v->params = *t->fmt.scale;
        v->params.t.rank = 1;
        v->params.t.dims[0] = codec_param_count(t->fmt.codec, len);
        v->params.t.data = (float *)p->data + codec_param_count(t->fmt.codec, off);
        v->t.fmt.scale = &v->params;
    }
    return &v->t;
}

void ref_adamw_first_copy(Node *n)
{
    int at = ir_adamw_copy_index(n), at_amax = ir_update_amax_index(n);
    if (at_amax < 0) return;
    if (at < 0) {   /* copy=2: the amax alone */
        store_copy(n, &n->in[A_PARAM]->t, NULL, &n->in[at_amax]->t, NULL);
        return;
    }
    Node *scale = n->in[at + 1];
    Tensor *amax = &n->in[at + 2]->t;
    if (scale->op != OP_DELAYED_SCALE || scale->in[1]->t.data != amax->data)
        ref_die_node(n, "the copy's scale is not made from its amax");
    float *w = ref_load(&n->in[A_PARAM]->t);
    float m = ref_amax(w, ir_numel(&n->in[A_PARAM]->t));
    free(w);
    ref_store(amax, &m);
    ref_delayed_scale(scale);
    store_copy(n, &n->in[A_PARAM]->t, &n->in[at]->t, amax, NULL);
}

static double scalar_in(Node *n, int k)
{
    const Tensor *t = &n->in[k]->t;
    if (ir_numel(t) != 1) ref_die_node(n, "input %d must be a scalar", k);
    float *x = ref_load(t);
    double v = x[0];
    free(x);
    return v;
}

/* ADAMW, LION, SGD (ops.def): every tensor decoded through its format, the step in f64, every
 * tensor encoded again (the new states through their codecs, the weight through a split master
 * or its format, then its FP8 copy). */
static void update_range(Node *n, int64_t off, int64_t len, float *copy_amax)
{
    int copies = ir_update_tail(n), at_lr = ir_update_lr_index(n);
    bool adam = n->op == OP_ADAMW;
    if (n->n_in - copies != at_lr + 4 && n->n_in - copies != at_lr + 5)
        ref_die_node(n, adam ? "takes (param, grad, m, v, lr, step, clip, grad_scale[, master][, copy, scale, amax | , amax])"
                             : "takes (param, grad, m, lr, step, clip, grad_scale[, master][, copy, scale, amax | , amax])");
    Tensor *param = &n->in[A_PARAM]->t, *grad = &n->in[A_GRAD]->t;
    Tensor *mt = &n->in[A_M]->t, *vt = adam ? &n->in[A_V]->t : NULL;
    int at_master = ir_adamw_master_index(n), at_copy = ir_adamw_copy_index(n);
    Tensor *master = at_master >= 0 ? &n->in[at_master]->t : NULL;
    Tensor *copy = at_copy >= 0 ? &n->in[at_copy]->t : NULL;
    UpdateJob j = {.op = n->op, .n = ir_numel(param)};
    const Tensor *same[] = {grad, mt, vt, master, copy};
    for (int k = 0; k < 5; k++)
        if (same[k] && ir_numel(same[k]) != j.n)
            ref_die_node(n, "'%s' has %lld elements, the parameter %lld",
                         same[k]->name ? same[k]->name : "unnamed", (long long)ir_numel(same[k]),
                         (long long)j.n);
    if (off < 0 || len < 0 || off + len > j.n)
        ref_die_node(n, "a shard [%lld, %lld) of %lld elements", (long long)off, (long long)(off + len),
                     (long long)j.n);
    ShardView views[6];
    param = shard_view(n, param, off, len, &views[0]);
    grad = shard_view(n, grad, off, len, &views[1]);
    mt = shard_view(n, mt, off, len, &views[2]);
    vt = shard_view(n, vt, off, len, &views[3]);
    master = shard_view(n, master, off, len, &views[4]);
    copy = shard_view(n, copy, off, len, &views[5]);
    j.n = len;
    UpdateHparams hp = ir_update_hparams(n);
    j.b1 = hp.b1, j.b2 = hp.b2, j.eps = hp.eps, j.wd = hp.wd, j.nesterov = hp.nesterov;
    double step = scalar_in(n, at_lr + 1);
    if (!(step >= 1)) ref_die_node(n, "step %g: steps count from 1", step);
    j.lr = scalar_in(n, at_lr);
    j.gmul = scalar_in(n, at_lr + 3) * scalar_in(n, at_lr + 2);
    if (adam) {
        j.inv_bc1 = 1 / (1 - pow(j.b1, step));
        j.inv_bc2 = 1 / (1 - pow(j.b2, step));
    }

    bool split = master && master->fmt.codec == CODEC_SPLIT;
    if (split && (param->fmt.elem != FMT_BF16 || master->fmt.elem != FMT_I8))
        ref_die_node(n, "a split master needs a bf16 parameter and an i8 correction");
    if (split) {
        j.w = malloc(sizeof(float) * (size_t)(j.n ? j.n : 1));
        IR_ASSERT(j.w);
        ref_split_decode(param->data, master->data, j.w, j.n);
    } else {
        j.w = ref_load(master ? master : param);
    }
    j.g = ref_load(grad);
    j.m = ref_load(mt);
    j.v = vt ? ref_load(vt) : NULL;
    ref_parallel_for((j.n + 4095) / 4096, update_task, &j);
    ref_store(mt, j.m);
    if (vt) ref_store(vt, j.v);
    ref_store(grad, j.g);
    if (split) {
        ref_split_encode(j.w, param->data, master->data, j.n);   /* hi = bf16(w) is the weight */
    } else {
        if (master) ref_store(master, j.w);
        ref_store(param, j.w);     /* through param's format: round(master) when there is one */
    }
    if (copies) store_copy(n, param, copy, &n->in[ir_update_amax_index(n)]->t, copy_amax);
    free(j.w);
    free(j.g);
    free(j.m);
    free(j.v);
}

void ref_update(Node *n) { update_range(n, 0, ir_numel(&n->in[A_PARAM]->t), NULL); }

void ref_update_shard(Node *n, int64_t off, int64_t len, float *copy_amax)
{
    float unused;
    update_range(n, off, len, copy_amax ? copy_amax : &unused);
}

/* The slice [s.off, s.off + s.len) of a whole buffer in acc's format, as a tensor of its own. */
static Tensor slice_of(const Tensor *acc, RtShard s, void *whole)
{
    Tensor t = *acc;
    t.rank = 1;
    t.dims[0] = s.len;
    t.data = (char *)whole + s.off * fmt_elem_bytes(acc->fmt.elem);
    return t;
}

void ref_reduce_to_owner(const Tensor *acc, RtShard s, int owner, int ranks, void *const *slots, void *out)
{
    if (!s.len) return;
    Tensor sum = slice_of(acc, (RtShard){0, s.len}, out);
    Tensor mine = slice_of(acc, s, slots[owner]);
    float *x = ref_load(&mine);
    for (int j = 1; j < ranks; j++) {
        Tensor other = slice_of(acc, s, slots[(owner + j) % ranks]);
        float *y = ref_load(&other);
        for (int64_t k = 0; k < s.len; k++) x[k] += y[k];
        ref_store(&sum, x);            /* each addition rounded to the accumulator's format */
        free(x);
        x = ref_load(&sum);
        free(y);
    }
    ref_store(&sum, x);
    free(x);
}
