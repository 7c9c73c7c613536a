/* ref_quant.c — scales and amax histories: the explicit scaling work of the step.
 *
 * The scaling pass turns each scaled format into ops: QUANT_SCALE finds a tensor's amax and the
 * scales that fit it into its element type now (current scaling); AMAX_RECORD pushes a
 * tensor's amax into a history and DELAYED_SCALE turns the history into the scale for the next
 * step (delayed scaling, TransformerEngine). QUANTIZE needs no code of its own: its value is
 * its input, and storing it through its scaled format is the quantization (ref_tensor.c).
 *
 * Conventions, shared with the generated kernels:
 *  - amax is the largest |x|, ignoring NaN (as CUDA's fmaxf does), keeping infinities;
 *  - a QUANT_SCALE whose amax is 0 or not finite gives scale 1 (nothing to fit, or nothing
 *    that can fit); DELAYED_SCALE in that case keeps the previous scale (TransformerEngine);
 *  - a history holds the most recent amax at index 0, older ones after it. */
#include "ref_internal.h"

#include <math.h>
#include <stdlib.h>

static double scale_for(ElemType e, double amax, int64_t margin)
{
    return (double)num_elem_max(e) / amax / ldexp(1.0, (int)margin);
}

static bool amax_usable(double amax) { return amax > 0 && isfinite(amax); }

/* A whole tensor's amax is one pass over every weight, each update and at start-up, so it is
 * split across the threads: each fixed chunk's maximum, then the maximum of those. A maximum
 * that skips NaN does not depend on the order it is taken in (all values are >= +0 after
 * fabsf, and fmaxf returns the other operand when one is NaN), so the result is the bytes of
 * the serial loop for any thread count. */
enum { AMAX_CHUNK = 1 << 16 };

typedef struct {
    const float *x;
    float *partial;     /* per chunk */
} AmaxJob;

static void amax_range(void *ctx, int64_t lo, int64_t hi)
{
    const AmaxJob *j = ctx;
    float m = 0;
    for (int64_t i = lo; i < hi; i++) m = fmaxf(m, fabsf(j->x[i]));
    j->partial[lo / AMAX_CHUNK] = m;
}

float ref_amax(const float *x, int64_t n)
{
    int64_t chunks = (n + AMAX_CHUNK - 1) / AMAX_CHUNK;
    float one, *partial = chunks > 1 ? malloc(sizeof(float) * (size_t)chunks) : &one;
    IR_ASSERT(partial);
    AmaxJob j = {.x = x, .partial = partial};
    ref_parallel_ranges(n, AMAX_CHUNK, amax_range, &j);
    float m = 0;
    for (int64_t c = 0; c < chunks; c++) m = fmaxf(m, partial[c]);
    if (partial != &one) free(partial);
    return m;
}

/* (x) attrs elem, scaling, group, margin -> the scales, laid out as ref_scale_map says */
void ref_quant_scale(const Node *n, const float *const *x, float *y)
{
    const Tensor *t = &n->in[0]->t;
    ElemType e = (ElemType)IR_IATTR(n, QUANT_SCALE, elem);
    Scaling kind = (Scaling)IR_IATTR(n, QUANT_SCALE, scaling);
    int64_t group = IR_IATTR(n, QUANT_SCALE, group), margin = IR_IATTR(n, QUANT_SCALE, margin);
    if (e <= FMT_VOID || e >= FMT_COUNT) ref_die_node(n, "bad element type %d", (int)e);
    if (kind <= SCALE_NONE || kind >= SCALE_COUNT || (fmt_scaling_info(kind)->block_cols < 0 && group <= 0))
        ref_die_node(n, "bad scaling %d (group %lld)", (int)kind, (long long)group);
    RefScaleMap m = ref_scale_map(kind, (int)group, ref_rows(t), ref_cols(t));
    if (ir_numel(&n->t) != m.count)
        ref_die_node(n, "result has %lld elements, the %s scales %lld", (long long)ir_numel(&n->t),
                     fmt_scaling_name(kind), (long long)m.count);
    float *amax = calloc((size_t)m.count, sizeof(float));
    IR_ASSERT(amax);
    for (int64_t r = 0; r < m.rows; r++)
        for (int64_t c = 0; c < m.cols; c++) {
            int64_t k = ref_scale_index(&m, r, c);
            amax[k] = fmaxf(amax[k], fabsf(x[0][r * m.cols + c]));
        }
    for (int64_t k = 0; k < m.count; k++)
        y[k] = amax_usable(amax[k]) ? (float)scale_for(e, amax[k], margin) : 1.0f;
    free(amax);
}

/* (history (H), x): history shifts by one and history[0] = amax(x); the result is history */
void ref_amax_record(Node *n)
{
    Tensor *h = &n->in[0]->t;
    const Tensor *xt = &n->in[1]->t;
    int64_t H = ir_numel(h), count = ir_numel(xt);
    if (H < 1) ref_die_node(n, "empty amax history");
    float *hist = ref_load(h), *x = ref_load(xt);
    for (int64_t i = H - 1; i > 0; i--) hist[i] = hist[i - 1];
    hist[0] = ref_amax(x, count);
    ref_store(h, hist);
    if (n->t.data && n->t.data != h->data) ref_store(&n->t, hist);
    free(hist);
    free(x);
}

/* (scale state, history) attrs elem, margin, use_max: the scale from the history, in place */
void ref_delayed_scale(Node *n)
{
    Tensor *st = &n->in[0]->t;
    const Tensor *ht = &n->in[1]->t;
    if (ir_numel(st) != 1) ref_die_node(n, "the scale must be a scalar");
    int64_t H = ir_numel(ht);
    if (H < 1) ref_die_node(n, "empty amax history");
    float *hist = ref_load(ht), *s = ref_load(st);
    double amax = hist[0];
    if (IR_IATTR(n, DELAYED_SCALE, use_max))
        for (int64_t i = 1; i < H; i++) amax = fmax(amax, hist[i]);
    if (amax_usable(amax)) s[0] = (float)scale_for((ElemType)IR_IATTR(n, DELAYED_SCALE, elem), amax, IR_IATTR(n, DELAYED_SCALE, margin));
    ref_store(st, s);
    if (n->t.data && n->t.data != st->data) ref_store(&n->t, s);
    free(hist);
    free(s);
}

/* ---------------------------------------------------------------- gathers (--shard-states=3)
 * A rank's part of a weight gathered in FP8 (runtime/comm_weights.c): its shard's amax, the
 * scale from the ranks' largest (the whole tensor's amax: a maximum does not depend on how
 * the elements are split), and its shard stored through the quantize's format with that
 * scale, at the shard's place in the whole copy. Storing is elementwise, so the pieces put
 * together are the bytes of the whole quantize. */
float ref_shard_amax(const Tensor *w, RtShard s)
{
    float *x = ref_load(w), amax = ref_amax(x + s.off, s.len);
    free(x);
    return amax;
}

float ref_scale_from_amax(const Node *qs, float amax)
{
    if (IR_IATTR(qs, QUANT_SCALE, scaling) != SCALE_PER_TENSOR)
        ref_die_node(qs, "a gathered FP8 weight needs one scale per tensor");
    ElemType e = (ElemType)IR_IATTR(qs, QUANT_SCALE, elem);
    return amax_usable(amax) ? (float)scale_for(e, amax, IR_IATTR(qs, QUANT_SCALE, margin)) : 1.0f;
}

void ref_quantize_shard(const Node *q, RtShard s, float scale, void *out)
{
    if (q->op != OP_QUANTIZE || q->t.fmt.scaling != SCALE_PER_TENSOR)
        ref_die_node(q, "a gathered FP8 weight is a quantize with one scale per tensor");
    if (!s.len) return;
    float *x = ref_load(&q->in[0]->t);
    Node sc = *q->in[1];
    sc.t.data = &scale;
    Tensor part = q->t;
    part.rank = 1;
    part.dims[0] = s.len;
    part.data = (char *)out + s.off * fmt_elem_bytes(q->t.fmt.elem);
    part.fmt.scale = &sc;
    ref_store(&part, x + s.off);
    free(x);
}
