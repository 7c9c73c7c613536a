/* ref_attn.c — causal attention (grouped-query) and rotary positions, forward and backward.
 *
 * Attention is computed in blocks of query rows, as products with the packed GEMM (in f64,
 * ref_gemm_f64): S = Q K^T over the keys up to the block's last row, a causal softmax per row
 * in f64, O = P V. The backward recomputes P from q and k (the IR saves only q, k, v), as
 * FlashAttention does, and forms dP = dO V^T, dS = P (dP - rowsum(P dP)) scale, dQ = dS K,
 * dK += dS^T Q, dV += P^T dO. P and dS are rounded to f32 once, as the operands of the
 * products; every sum is f64 and every result is rounded to f32 once at the end.
 *
 * Keys past a row's position get P = 0 exactly; adding 0 * v to an f64 sum leaves it as it
 * was (for finite v), so a row's result does not depend on the block it was computed in.
 *
 * Layout: q (B, T, H*D), k and v (B, T, Hkv*D), or the three packed side by side in one
 * (B, T, (H + 2 Hkv) D) tensor; query head h reads kv head h / (H / Hkv).
 *
 * Threads: the forward splits by (batch, head, block of query rows): each output row is its
 * own. The backward splits by (batch, kv head): one task owns dk and dv of its kv head and dq
 * of the query heads that read it, and adds the blocks' contributions in a fixed order. */
#include "ref_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { QB = 64 };   /* query rows per block */

typedef struct {
    const Node *n;
    int64_t B, T, H, Hkv, D, group;
    double scale;
    const float *q, *k, *v, *dy;
    int64_t qs, ks, vs;     /* row strides of q, k, v: their widths, or the packed width */
    float *y;
} AttnJob;

/* A packed (B, T, (H + 2 Hkv) D) q|k|v: q, k and v are column ranges of it, read in place
 * with its width as their row stride. */
static void attn_setup_packed(AttnJob *a, const Node *n, const float *qkv)
{
    const Tensor *xt = &n->in[n->op == OP_ATTENTION ? 0 : 1]->t;
    memset(a, 0, sizeof *a);
    a->n = n;
    a->H = IR_IATTR(n, ATTENTION, heads);
    a->Hkv = IR_IATTR(n, ATTENTION, kv_heads);
    a->scale = IR_FATTR(n, ATTENTION, scale);
    if (xt->rank != 3 || a->H <= 0 || a->Hkv <= 0 || a->H % a->Hkv ||
        xt->dims[2] % (a->H + 2 * a->Hkv))
        ref_die_node(n, "packed q|k|v must be (B, T, (heads + 2 kv_heads) head_dim)");
    a->B = xt->dims[0];
    a->T = xt->dims[1];
    a->D = xt->dims[2] / (a->H + 2 * a->Hkv);
    a->group = a->H / a->Hkv;
    a->q = qkv;
    a->k = qkv + a->H * a->D;
    a->v = a->k + a->Hkv * a->D;
    a->qs = a->ks = a->vs = xt->dims[2];
}

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
    a->H = IR_IATTR(n, ATTENTION_BWD, heads);
    a->Hkv = IR_IATTR(n, ATTENTION_BWD, kv_heads);
    a->scale = IR_FATTR(n, ATTENTION_BWD, scale);
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
    a->qs = a->H * a->D;
    a->ks = a->vs = a->Hkv * a->D;
}

/* Scratch of one block: S (or dP) in f64, P and dS in f32, a (rows, D) f64 result. */
typedef struct {
    double *s, *o;
    float *p, *ds;
} Block;

static Block block_alloc(const AttnJob *a)
{
    Block w;
    w.s = malloc(sizeof(double) * (size_t)(QB * a->T + QB * a->D));
    w.p = malloc(sizeof(float) * (size_t)(2 * QB * a->T));
    IR_ASSERT(w.s && w.p);
    w.o = w.s + QB * a->T;
    w.ds = w.p + QB * a->T;
    return w;
}

static void block_free(Block *w)
{
    free(w->s);
    free(w->p);
}

/* P (rows t0..t1-1, keys 0..t1-1) of query head h, kv head g, batch b */
static void block_probs(const AttnJob *a, Block *w, int64_t b, int64_t h, int64_t t0, int64_t t1)
{
    int64_t T = a->T, D = a->D, n = t1, g = h / a->group;
    ref_gemm_f64(t1 - t0, n, D, a->q + (b * T + t0) * a->qs + h * D, a->qs, false,
                 a->k + b * T * a->ks + g * D, a->ks, true, w->s, n, false);
    for (int64_t i = 0; i < t1 - t0; i++) {
        int64_t t = t0 + i;
        double *s = w->s + i * n, m = -INFINITY, sum = 0;
        float *p = w->p + i * n;
        for (int64_t j = 0; j <= t; j++) {
            s[j] *= a->scale;
            m = s[j] > m ? s[j] : m;
        }
        for (int64_t j = 0; j <= t; j++) s[j] -= m;
        ref_exp_nonpositive(s, t + 1);
        for (int64_t j = 0; j <= t; j++) sum += s[j];
        for (int64_t j = 0; j <= t; j++) p[j] = (float)(s[j] / sum);
        for (int64_t j = t + 1; j < n; j++) p[j] = 0;
    }
}

static void attn_fwd_task(void *ctx, int64_t task)
{
    const AttnJob *a = ctx;
    int64_t T = a->T, D = a->D, blocks = (T + QB - 1) / QB;
    int64_t bh = task / blocks, t0 = (task % blocks) * QB;
    int64_t b = bh / a->H, h = bh % a->H, g = h / a->group;
    int64_t t1 = t0 + QB < T ? t0 + QB : T, qcols = a->H * D;
    Block w = block_alloc(a);
    block_probs(a, &w, b, h, t0, t1);
    ref_gemm_f64(t1 - t0, D, t1, w.p, t1, false, a->v + b * T * a->vs + g * D, a->vs, false,
                 w.o, D, false);
    for (int64_t i = 0; i < t1 - t0; i++)
        for (int64_t d = 0; d < D; d++)
            a->y[(b * T + t0 + i) * qcols + h * D + d] = (float)w.o[i * D + d];
    block_free(&w);
}

void ref_attention(const Node *n, const float *const *x, float *y)
{
    AttnJob a;
    if (n->n_in == 1) attn_setup_packed(&a, n, x[0]);
    else attn_setup(&a, n, x[0], x[1], x[2]);
    if (ir_numel(&n->t) != a.B * a.T * a.H * a.D) ref_die_node(n, "result is not q-shaped");
    a.y = y;
    ref_parallel_for(a.B * a.H * ((a.T + QB - 1) / QB), attn_fwd_task, &a);
}

/* One (batch, kv head): dk, dv of that head and dq of its query heads, packed into y. */
static void attn_bwd_task(void *ctx, int64_t task)
{
    const AttnJob *a = ctx;
    int64_t T = a->T, D = a->D, b = task / a->Hkv, g = task % a->Hkv;
    int64_t qcols = a->H * D, kvcols = a->Hkv * D, ycols = (a->H + 2 * a->Hkv) * D;
    const float *kb = a->k + b * T * a->ks + g * D, *vb = a->v + b * T * a->vs + g * D;
    double *dk = calloc((size_t)(2 * T * D), sizeof(double)), *dv = dk + T * D;
    IR_ASSERT(dk);
    Block w = block_alloc(a);
    for (int64_t h = g * a->group; h < (g + 1) * a->group; h++)
        for (int64_t t0 = 0; t0 < T; t0 += QB) {
            int64_t t1 = t0 + QB < T ? t0 + QB : T, rows = t1 - t0, n = t1;
            const float *qb = a->q + (b * T + t0) * a->qs + h * D;
            const float *dyb = a->dy + (b * T + t0) * qcols + h * D;
            block_probs(a, &w, b, h, t0, t1);
            /* dP = dO V^T;  dS = P (dP - sum_j P dP) scale */
            ref_gemm_f64(rows, n, D, dyb, qcols, false, vb, a->vs, true, w.s, n, false);
            for (int64_t i = 0; i < rows; i++) {
                const double *dp = w.s + i * n;
                const float *p = w.p + i * n;
                float *ds = w.ds + i * n;
                double sum = 0;
                for (int64_t j = 0; j <= t0 + i; j++) sum += (double)p[j] * dp[j];
                for (int64_t j = 0; j <= t0 + i; j++)
                    ds[j] = (float)(p[j] * (dp[j] - sum) * a->scale);
                for (int64_t j = t0 + i + 1; j < n; j++) ds[j] = 0;
            }
            /* dQ = dS K;  dK += dS^T Q;  dV += P^T dO */
            ref_gemm_f64(rows, D, n, w.ds, n, false, kb, a->ks, false, w.o, D, false);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t d = 0; d < D; d++)
                    a->y[(b * T + t0 + i) * ycols + h * D + d] = (float)w.o[i * D + d];
            ref_gemm_f64(n, D, rows, w.ds, n, true, qb, a->qs, false, dk, D, true);
            ref_gemm_f64(n, D, rows, w.p, n, true, dyb, qcols, false, dv, D, true);
        }
    for (int64_t t = 0; t < T; t++) {
        float *out = a->y + (b * T + t) * ycols + qcols + g * D;
        for (int64_t d = 0; d < D; d++) {
            out[d] = (float)dk[t * D + d];
            out[kvcols + d] = (float)dv[t * D + d];
        }
    }
    block_free(&w);
    free(dk);
}

void ref_attention_bwd(const Node *n, const float *const *x, float *y)
{
    AttnJob a;
    /* y (ir_attention_bwd_reads_y) is not needed: the probabilities are recomputed */
    if (n->n_in - ir_attention_bwd_reads_y(n) == 2) attn_setup_packed(&a, n, x[1]);
    else attn_setup(&a, n, x[1], x[2], x[3]);
    if (ir_numel(&n->in[0]->t) != a.B * a.T * a.H * a.D) ref_die_node(n, "dy is not q-shaped");
    if (ir_numel(&n->t) != a.B * a.T * (a.H + 2 * a.Hkv) * a.D)
        ref_die_node(n, "result is not (B, T, (heads + 2 kv_heads) head_dim)");
    a.dy = x[0];
    a.y = y;
    ref_parallel_for(a.B * a.Hkv, attn_bwd_task, &a);
}

/* ---------------------------------------------------------------- rope */

/* Pairs (2i, 2i+1) of each head turn by t * theta^(-2i/D); inverse=1 turns back, which is
 * also the backward (a rotation's transpose is its inverse). */
void ref_rope(const Node *n, const float *const *x, float *y)
{
    const Tensor *t = &n->t;
    int64_t D = IR_IATTR(n, ROPE, head_dim);
    double sign = IR_IATTR(n, ROPE, inverse) ? -1.0 : 1.0, theta = IR_FATTR(n, ROPE, theta);
    if (t->rank < 2) ref_die_node(n, "rope needs (.., T, heads * head_dim)");
    int64_t C = t->dims[t->rank - 1], T = t->dims[t->rank - 2];
    int64_t B = ir_numel(t) / (C * T > 0 ? C * T : 1);
    if (D <= 0 || D % 2 != 0 || C % D != 0)
        ref_die_node(n, "head_dim %lld does not split %lld columns into even heads",
                     (long long)D, (long long)C);
    if (ir_numel(&n->in[0]->t) != ir_numel(t)) ref_die_node(n, "result is not x-shaped");
    double *cs = malloc(sizeof(double) * (size_t)(T * D > 0 ? T * D : 1));   /* (T, D/2) cos, sin */
    IR_ASSERT(cs);
    ir_rope_table(T, D, theta, cs);
    for (int64_t b = 0; b < B; b++)
        for (int64_t p = 0; p < T; p++) {
            const float *in = x[0] + (b * T + p) * C;
            float *out = y + (b * T + p) * C;
            const double *row = cs + p * D;
            for (int64_t c = 0; c < C; c += 2) {
                int64_t i = (c % D) / 2;
                double co = row[2 * i], si = sign * row[2 * i + 1], x0 = in[c], x1 = in[c + 1];
                out[c] = (float)(x0 * co - x1 * si);
                out[c + 1] = (float)(x0 * si + x1 * co);
            }
        }
    free(cs);
}
