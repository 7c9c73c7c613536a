/* ref_attn.c — causal attention (grouped-query) and rotary positions, forward and backward.
 *
 * Attention is computed row by row as its definition reads: scores of query t against keys
 * 0..t, a softmax, a weighted sum of values; the backward recomputes the probabilities from
 * q and k (the IR saves only q, k, v), as FlashAttention does. Nothing is tiled for the
 * softmax, so the reference has exactly one rounding story: f32 inputs, f64 scores, f64
 * softmax sums, f64 accumulation of every output, one rounding to f32 at the end.
 *
 * Layout: q (B, T, H*D), k and v (B, T, Hkv*D); query head h reads kv head h / (H / Hkv).
 * Keys and values are first transposed per (batch, kv head) to (D, T), so that the score
 * loops run over keys with unit stride and vectorize without reordering any sum.
 *
 * Threads: the forward splits by (batch, head, block of query rows): each output row is its
 * own. The backward splits by (batch, kv head): one task owns dk and dv of its kv head and dq
 * of the query heads that read it, and sums over heads and rows in a fixed order. */
#include "ref_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { ROWS_PER_TASK = 32 };

typedef struct {
    const Node *n;
    int64_t B, T, H, Hkv, D, group;
    double scale;
    const float *q, *k, *v, *dy;
    float *kt, *vt;         /* (B, Hkv, D, T): k and v transposed per kv head */
    float *y;
} AttnJob;

static void attn_setup(AttnJob *a, const Node *n, const float *q, const float *k,
                       const float *v)
{
    const Tensor *qt = &n->in[n->op == OP_ATTENTION ? 0 : 1]->t;
    const Tensor *kt = &n->in[n->op == OP_ATTENTION ? 1 : 2]->t;
    const Tensor *vt = &n->in[n->op == OP_ATTENTION ? 2 : 3]->t;
    if (qt->rank != 3 || kt->rank != 3 || vt->rank != 3)
        ref_die_node(n, "q, k, v must be (B, T, heads * head_dim)");
    memset(a, 0, sizeof *a);
    a->n = n;
    a->B = qt->dims[0];
    a->T = qt->dims[1];
    a->H = n->iattr[0];
    a->Hkv = n->iattr[1];
    a->scale = n->fattr[0];
    if (a->H <= 0 || a->Hkv <= 0 || a->H % a->Hkv != 0 || qt->dims[2] % a->H != 0)
        ref_die_node(n, "heads %lld, kv_heads %lld do not divide q's %lld columns",
                     (long long)a->H, (long long)a->Hkv, (long long)qt->dims[2]);
    a->D = qt->dims[2] / a->H;
    a->group = a->H / a->Hkv;
    for (int i = 0; i < 2; i++) {
        const Tensor *t = i ? vt : kt;
        if (t->dims[0] != a->B || t->dims[1] != a->T || t->dims[2] != a->Hkv * a->D)
            ref_die_node(n, "%s is not (%lld, %lld, %lld)", i ? "v" : "k", (long long)a->B,
                         (long long)a->T, (long long)(a->Hkv * a->D));
    }
    a->q = q;
    a->k = k;
    a->v = v;
}

static float *transpose_kv(const AttnJob *a, const float *src)
{
    int64_t T = a->T, D = a->D, cols = a->Hkv * D;
    float *dst = malloc(sizeof(float) * (size_t)(a->B * T * cols > 0 ? a->B * T * cols : 1));
    IR_ASSERT(dst);
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t g = 0; g < a->Hkv; g++) {
            float *out = dst + (b * a->Hkv + g) * D * T;
            for (int64_t t = 0; t < T; t++) {
                const float *row = src + (b * T + t) * cols + g * D;
                for (int64_t d = 0; d < D; d++) out[d * T + t] = row[d];
            }
        }
    return dst;
}

/* p[0..t] = softmax over keys 0..t of scale * q_t . k_j (kt: this kv head's (D, T)) */
static void attn_probs(const AttnJob *a, const float *qrow, const float *kt, int64_t t,
                       double *p)
{
    int64_t T = a->T, n = t + 1;
    for (int64_t j = 0; j < n; j++) p[j] = 0;
    for (int64_t d = 0; d < a->D; d++) {
        double qd = qrow[d];
        const float *kd = kt + d * T;
        for (int64_t j = 0; j < n; j++) p[j] += qd * kd[j];
    }
    double m = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        p[j] *= a->scale;
        m = p[j] > m ? p[j] : m;
    }
    double s = 0;
    for (int64_t j = 0; j < n; j++) {
        p[j] = exp(p[j] - m);
        s += p[j];
    }
    double inv = 1.0 / s;
    for (int64_t j = 0; j < n; j++) p[j] *= inv;
}

static void attn_fwd_task(void *ctx, int64_t task)
{
    const AttnJob *a = ctx;
    int64_t T = a->T, D = a->D, blocks = (T + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    int64_t bh = task / blocks, t0 = (task % blocks) * ROWS_PER_TASK;
    int64_t b = bh / a->H, h = bh % a->H, g = h / a->group;
    int64_t t1 = t0 + ROWS_PER_TASK < T ? t0 + ROWS_PER_TASK : T;
    int64_t qcols = a->H * D, kvcols = a->Hkv * D;
    const float *kt = a->kt + (b * a->Hkv + g) * D * T;
    double *p = malloc(sizeof(double) * (size_t)(T + D));
    IR_ASSERT(p);
    double *acc = p + T;
    for (int64_t t = t0; t < t1; t++) {
        attn_probs(a, a->q + (b * T + t) * qcols + h * D, kt, t, p);
        memset(acc, 0, sizeof(double) * (size_t)D);
        for (int64_t j = 0; j <= t; j++) {
            const float *vj = a->v + (b * T + j) * kvcols + g * D;
            for (int64_t d = 0; d < D; d++) acc[d] += p[j] * vj[d];
        }
        float *out = a->y + (b * T + t) * qcols + h * D;
        for (int64_t d = 0; d < D; d++) out[d] = (float)acc[d];
    }
    free(p);
}

void ref_attention(const Node *n, const float *const *x, float *y)
{
    AttnJob a;
    attn_setup(&a, n, x[0], x[1], x[2]);
    if (ir_numel(&n->t) != a.B * a.T * a.H * a.D) ref_die_node(n, "result is not q-shaped");
    a.y = y;
    a.kt = transpose_kv(&a, a.k);
    int64_t blocks = (a.T + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    ref_parallel_for(a.B * a.H * blocks, attn_fwd_task, &a);
    free(a.kt);
}

/* One (batch, kv head): dk, dv of that head and dq of its query heads, packed into y. */
static void attn_bwd_task(void *ctx, int64_t task)
{
    const AttnJob *a = ctx;
    int64_t T = a->T, D = a->D, b = task / a->Hkv, g = task % a->Hkv;
    int64_t qcols = a->H * D, kvcols = a->Hkv * D, ycols = (a->H + 2 * a->Hkv) * D;
    const float *kt = a->kt + (b * a->Hkv + g) * D * T, *vt = a->vt + (b * a->Hkv + g) * D * T;
    double *buf = calloc((size_t)(2 * T * D + 2 * T + D), sizeof(double));
    IR_ASSERT(buf);
    double *dk = buf, *dv = dk + T * D, *p = dv + T * D, *ds = p + T, *dq = ds + T;
    for (int64_t h = g * a->group; h < (g + 1) * a->group; h++)
        for (int64_t t = 0; t < T; t++) {
            const float *qrow = a->q + (b * T + t) * qcols + h * D;
            const float *dyrow = a->dy + (b * T + t) * qcols + h * D;
            attn_probs(a, qrow, kt, t, p);
            /* dp_j = dy_t . v_j;  ds_j = p_j (dp_j - sum_i p_i dp_i) */
            for (int64_t j = 0; j <= t; j++) ds[j] = 0;
            for (int64_t d = 0; d < D; d++) {
                double dyd = dyrow[d];
                const float *vd = vt + d * T;
                for (int64_t j = 0; j <= t; j++) ds[j] += dyd * vd[j];
            }
            double sum = 0;
            for (int64_t j = 0; j <= t; j++) sum += p[j] * ds[j];
            for (int64_t j = 0; j <= t; j++) ds[j] = p[j] * (ds[j] - sum) * a->scale;
            /* dq_t = sum_j ds_j k_j;  dk_j += ds_j q_t;  dv_j += p_j dy_t */
            memset(dq, 0, sizeof(double) * (size_t)D);
            for (int64_t j = 0; j <= t; j++) {
                const float *kj = a->k + (b * T + j) * kvcols + g * D;
                double *dkj = dk + j * D, *dvj = dv + j * D;
                for (int64_t d = 0; d < D; d++) {
                    dq[d] += ds[j] * kj[d];
                    dkj[d] += ds[j] * qrow[d];
                    dvj[d] += p[j] * dyrow[d];
                }
            }
            float *out = a->y + (b * T + t) * ycols + h * D;
            for (int64_t d = 0; d < D; d++) out[d] = (float)dq[d];
        }
    for (int64_t t = 0; t < T; t++) {
        float *out = a->y + (b * T + t) * ycols + qcols + g * D;
        for (int64_t d = 0; d < D; d++) {
            out[d] = (float)dk[t * D + d];
            out[kvcols + d] = (float)dv[t * D + d];
        }
    }
    free(buf);
}

void ref_attention_bwd(const Node *n, const float *const *x, float *y)
{
    AttnJob a;
    attn_setup(&a, n, x[1], x[2], x[3]);
    if (ir_numel(&n->in[0]->t) != a.B * a.T * a.H * a.D) ref_die_node(n, "dy is not q-shaped");
    if (ir_numel(&n->t) != a.B * a.T * (a.H + 2 * a.Hkv) * a.D)
        ref_die_node(n, "result is not (B, T, (heads + 2 kv_heads) head_dim)");
    a.dy = x[0];
    a.y = y;
    a.kt = transpose_kv(&a, a.k);
    a.vt = transpose_kv(&a, a.v);
    ref_parallel_for(a.B * a.Hkv, attn_bwd_task, &a);
    free(a.kt);
    free(a.vt);
}

/* ---------------------------------------------------------------- rope */

/* Pairs (2i, 2i+1) of each head turn by t * theta^(-2i/D); inverse=1 turns back, which is
 * also the backward (a rotation's transpose is its inverse). */
void ref_rope(const Node *n, const float *const *x, float *y)
{
    const Tensor *t = &n->t;
    int64_t D = n->iattr[0];
    double sign = n->iattr[1] ? -1.0 : 1.0, theta = n->fattr[0];
    if (t->rank < 2) ref_die_node(n, "rope needs (.., T, heads * head_dim)");
    int64_t C = t->dims[t->rank - 1], T = t->dims[t->rank - 2], B = ir_numel(t) / (C * T > 0 ? C * T : 1);
    if (D <= 0 || D % 2 != 0 || C % D != 0)
        ref_die_node(n, "head_dim %lld does not split %lld columns into even heads",
                     (long long)D, (long long)C);
    if (ir_numel(&n->in[0]->t) != ir_numel(t)) ref_die_node(n, "result is not x-shaped");
    double *cs = malloc(sizeof(double) * (size_t)(T * D > 0 ? T * D : 1));   /* (T, D/2) cos, sin */
    IR_ASSERT(cs);
    for (int64_t p = 0; p < T; p++)
        for (int64_t i = 0; i < D / 2; i++) {
            double ang = (double)p * pow(theta, -2.0 * (double)i / (double)D);
            cs[(p * (D / 2) + i) * 2] = cos(ang);
            cs[(p * (D / 2) + i) * 2 + 1] = sign * sin(ang);
        }
    for (int64_t b = 0; b < B; b++)
        for (int64_t p = 0; p < T; p++) {
            const float *in = x[0] + (b * T + p) * C;
            float *out = y + (b * T + p) * C;
            const double *row = cs + p * D;
            for (int64_t c = 0; c < C; c += 2) {
                int64_t i = (c % D) / 2;
                double co = row[2 * i], si = row[2 * i + 1], x0 = in[c], x1 = in[c + 1];
                out[c] = (float)(x0 * co - x1 * si);
                out[c + 1] = (float)(x0 * si + x1 * co);
            }
        }
    free(cs);
}
