/* ref_ops.c — elementwise, shape, row and gather ops of the reference executor.
 *
 * Every op here is either elementwise (one output from one position of each input), a row op
 * (an output row from the same input row: norms, softmax, cross entropy), or a column
 * reduction over rows (sum_rows, the weight gradients of norms, the embedding gradient). That
 * fixes how work is split: elementwise and row ops by ranges of outputs, column reductions by
 * ranges of columns with the rows summed in order inside one task. Each output is therefore
 * computed in the same order whatever the thread count.
 *
 * Elementwise math is f32, like the kernels generated for the GPU; reductions (means,
 * variances, softmax sums, log-sum-exp, column sums) accumulate in f64. Backward ops recompute
 * the statistics they need from x, as the IR has no saved mean or rstd. */
#include "ref_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct Job Job;
typedef void (*RangeFn)(const Job *j, int64_t lo, int64_t hi);

/* One shape for every op of this file: which fields an op uses is said at its RangeFn. */
struct Job {
    const Node *n;
    const float *const *x;
    float *y;
    int64_t rows, cols, nb;
    double *mean, *rstd;            /* per-row statistics, for the two-sweep norm gradients */
    double *row_loss;               /* cross entropy: per-row loss, NAN for ignored rows */
    const int64_t *order, *first;   /* embedding_bwd: rows grouped by id, in row order */
    RangeFn fn;
    int64_t grain, total;
};

static void range_task(void *ctx, int64_t t)
{
    const Job *j = ctx;
    int64_t lo = t * j->grain, hi = lo + j->grain < j->total ? lo + j->grain : j->total;
    j->fn(j, lo, hi);
}

/* Runs fn over [0, total) in ranges of about `work` units of work each (cost = per item). */
static void run_ranges(Job *j, RangeFn fn, int64_t total, int64_t cost_per_item)
{
    const int64_t work = 1 << 15;
    j->fn = fn;
    j->total = total;
    j->grain = cost_per_item >= work ? 1 : work / (cost_per_item > 0 ? cost_per_item : 1);
    ref_parallel_for((total + j->grain - 1) / j->grain, range_task, j);
}

static double *alloc_f64(int64_t n)
{
    double *p = malloc(sizeof(double) * (size_t)(n ? n : 1));
    IR_ASSERT(p);
    return p;
}

static void check_numel(const Node *n, int k, int64_t want)
{
    int64_t have = ir_numel(&n->in[k]->t);
    if (have != want)
        ref_die_node(n, "input %d has %lld elements, expected %lld", k, (long long)have,
                     (long long)want);
}

/* ---------------------------------------------------------------- elementwise */

/* ADD, SUB, MUL: y = a op b[i mod nb], b a suffix of a's shape or a scalar. */
static void binary_range(const Job *j, int64_t lo, int64_t hi)
{
    const float *a = j->x[0], *b = j->x[1];
    int64_t k = lo % j->nb;
    for (int64_t i = lo; i < hi; i++) {
        switch (j->n->op) {
        case OP_ADD: j->y[i] = a[i] + b[k]; break;
        case OP_SUB: j->y[i] = a[i] - b[k]; break;
        default: j->y[i] = a[i] * b[k]; break;
        }
        if (++k == j->nb) k = 0;
    }
}

void ref_binary(const Node *n, const float *const *x, float *y)
{
    int64_t na = ir_numel(&n->in[0]->t), nb = ir_numel(&n->in[1]->t);
    if (nb == 0 || na % nb != 0 || ir_numel(&n->t) != na)
        ref_die_node(n, "cannot broadcast %lld elements onto %lld", (long long)nb, (long long)na);
    Job j = {.n = n, .x = x, .y = y, .nb = nb};
    run_ranges(&j, binary_range, na, 1);
}

void ref_scale(const Node *n, const float *const *x, float *y)
{
    float alpha = (float)IR_FATTR(n, SCALE, alpha);
    int64_t count = ir_numel(&n->t);
    check_numel(n, 0, count);
    for (int64_t i = 0; i < count; i++) y[i] = alpha * x[0][i];
}

void ref_add_n(const Node *n, const float *const *x, float *y)
{
    int64_t count = ir_numel(&n->t);
    for (int k = 0; k < n->n_in; k++) check_numel(n, k, count);
    for (int64_t i = 0; i < count; i++) {
        double s = 0;
        for (int k = 0; k < n->n_in; k++) s += x[k][i];
        y[i] = (float)s;
    }
}

static const double GELU_C = 0.7978845608028654;   /* sqrt(2 / pi) */
static const double GELU_A = 0.044715;

/* GELU, SILU: y = f(x); GELU_BWD, SILU_BWD: y = dy * f'(x) with inputs (dy, x). In f64 with
 * one rounding: tanh(u) = sign(u) (1 - e) / (1 + e) and sigmoid from e, e = exp(-2|u|) or
 * exp(-|x|), so that one vectorized exp (ref_math.c) does the transcendental work. The
 * arithmetic is written four lanes at a time (GCC vector extensions), since -O2 does not
 * vectorize these loops by itself; no multiply-add is contracted, so lanes and scalars agree. */
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4i __attribute__((vector_size(32)));

enum { UNARY_BLK = 256 };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))   /* AVX2 alone: wider, no FMA, same bits */
#endif
static void unary_range(const Job *j, int64_t lo, int64_t hi)
{
    OpKind op = j->n->op;
    bool bwd = op == OP_GELU_BWD || op == OP_SILU_BWD, gelu = op == OP_GELU || op == OP_GELU_BWD;
    const float *x = j->x[bwd ? 1 : 0], *dy = bwd ? j->x[0] : NULL;
    const v4i sign_bit = {INT64_MIN, INT64_MIN, INT64_MIN, INT64_MIN};
    const v4d one = {1, 1, 1, 1}, zero = {0, 0, 0, 0};
    double xv[UNARY_BLK], e[UNARY_BLK], r[UNARY_BLK];
    for (int64_t b0 = lo; b0 < hi; b0 += UNARY_BLK) {
        int64_t w = hi - b0 < UNARY_BLK ? hi - b0 : UNARY_BLK, w4 = (w + 3) & ~(int64_t)3;
        for (int64_t i = 0; i < w4; i++) xv[i] = i < w ? x[b0 + i] : 0.0;
        for (int64_t i = 0; i < w4; i += 4) {
            v4d v, u;
            memcpy(&v, xv + i, sizeof v);
            u = gelu ? GELU_C * (v + GELU_A * v * v * v) : v;
            u = (v4d)((v4i)u & ~sign_bit) * (gelu ? -2.0 : -1.0);   /* -2|u| or -|x| */
            memcpy(e + i, &u, sizeof u);
        }
        ref_exp_nonpositive(e, w4);
        for (int64_t i = 0; i < w4; i += 4) {
            v4d v, ev, out;
            memcpy(&v, xv + i, sizeof v);
            memcpy(&ev, e + i, sizeof ev);
            if (gelu) {
                v4d u = GELU_C * (v + GELU_A * v * v * v);
                v4d t = (one - ev) / (one + ev);
                t = (v4d)(((v4i)t & ~sign_bit) | ((v4i)u & sign_bit));   /* copysign(t, u) */
                if (op == OP_GELU) {
                    out = 0.5 * v * (one + t);
                } else {
                    v4d du = GELU_C * (one + 3.0 * GELU_A * v * v);
                    out = 0.5 * (one + t) + 0.5 * v * (one - t * t) * du;
                }
            } else {
                v4i neg = v < zero;                                 /* s = (v >= 0 ? 1 : e) / (1 + e) */
                v4d num = (v4d)(((v4i)one & ~neg) | ((v4i)ev & neg));
                v4d sg = num / (one + ev);
                out = op == OP_SILU ? v * sg : sg * (one + v * (one - sg));
            }
            memcpy(r + i, &out, sizeof out);
        }
        for (int64_t i = 0; i < w; i++) j->y[b0 + i] = (float)(bwd ? dy[b0 + i] * r[i] : r[i]);
    }
}

void ref_unary(const Node *n, const float *const *x, float *y)
{
    int64_t count = ir_numel(&n->t);
    for (int k = 0; k < n->n_in; k++) check_numel(n, k, count);
    Job j = {.n = n, .x = x, .y = y};
    run_ranges(&j, unary_range, count, 20);
}

/* ---------------------------------------------------------------- shape */

void ref_copy(const Node *n, const float *const *x, float *y)
{
    int64_t count = ir_numel(&n->t);
    check_numel(n, 0, count);
    memcpy(y, x[0], sizeof(float) * (size_t)count);
}

static int norm_axis(const Node *n, int64_t axis, int rank)
{
    if (axis < 0) axis += rank;
    if (axis < 0 || axis >= rank) ref_die_node(n, "axis %lld out of range", (long long)axis);
    return (int)axis;
}

/* The tensor as (outer, len, inner) around `axis`. */
static void split_at(const Tensor *t, int axis, int64_t *outer, int64_t *len, int64_t *inner)
{
    *outer = *inner = 1;
    for (int i = 0; i < axis; i++) *outer *= t->dims[i];
    for (int i = axis + 1; i < t->rank; i++) *inner *= t->dims[i];
    *len = t->dims[axis];
}

/* SLICE: y = x[.., start:start+len_y, ..]; PAD: y = zeros, y[.., start:start+len_x, ..] = x. */
void ref_slice(const Node *n, const float *const *x, float *y)
{
    const Tensor *in = &n->in[0]->t;
    int axis = norm_axis(n, IR_IATTR(n, SLICE, axis), n->t.rank);      /* PAD too */
    int64_t start = IR_IATTR(n, SLICE, start), outer, inner, ly, lx, o2, i2;
    split_at(&n->t, axis, &outer, &ly, &inner);
    if (in->rank != n->t.rank)
        ref_die_node(n, "input rank %d, result rank %d", in->rank, n->t.rank);
    split_at(in, axis, &o2, &lx, &i2);
    if (o2 != outer || i2 != inner) ref_die_node(n, "shapes differ off the axis");
    bool pad = n->op == OP_PAD;
    int64_t len = pad ? lx : ly;
    if (start < 0 || start + len > (pad ? ly : lx))
        ref_die_node(n, "range [%lld, %lld) outside an axis of %lld", (long long)start,
                     (long long)(start + len), (long long)(pad ? ly : lx));
    if (pad) memset(y, 0, sizeof(float) * (size_t)ir_numel(&n->t));
    for (int64_t o = 0; o < outer; o++) {
        const float *src = x[0] + (o * lx + (pad ? 0 : start)) * inner;
        float *dst = y + (o * ly + (pad ? start : 0)) * inner;
        memcpy(dst, src, sizeof(float) * (size_t)(len * inner));
    }
}

void ref_concat(const Node *n, const float *const *x, float *y)
{
    int axis = norm_axis(n, IR_IATTR(n, CONCAT, axis), n->t.rank);
    int64_t outer, ly, inner, at = 0;
    split_at(&n->t, axis, &outer, &ly, &inner);
    for (int k = 0; k < n->n_in; k++) {
        int64_t o2, lx, i2;
        split_at(&n->in[k]->t, axis, &o2, &lx, &i2);
        if (o2 != outer || i2 != inner || at + lx > ly)
            ref_die_node(n, "input %d does not fit the result", k);
        for (int64_t o = 0; o < outer; o++)
            memcpy(y + (o * ly + at) * inner, x[k] + o * lx * inner,
                   sizeof(float) * (size_t)(lx * inner));
        at += lx;
    }
    if (at != ly)
        ref_die_node(n, "inputs fill %lld of %lld along the axis", (long long)at, (long long)ly);
}

/* TRANSPOSE: x as (rows, C) -> (C, rows). The result's format is x's (a scaled copy shares x's
 * scale), so the stored codes are x's, moved. */
void ref_transpose(const Node *n, const float *const *x, float *y)
{
    const Tensor *in = &n->in[0]->t;
    int64_t C = in->rank ? in->dims[in->rank - 1] : 1, R = C ? ir_numel(in) / C : 0;
    if (n->t.rank != 2 || n->t.dims[0] != C || n->t.dims[1] != R)
        ref_die_node(n, "the result is not (%lld, %lld)", (long long)C, (long long)R);
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) y[c * R + r] = x[0][r * C + c];
}

/* ---------------------------------------------------------------- column reductions */

/* y[c] = sum over rows of x[r, c], for a range of columns. */
static void sum_rows_range(const Job *j, int64_t lo, int64_t hi)
{
    double acc[64];
    for (int64_t c0 = lo; c0 < hi; c0 += 64) {
        int64_t w = hi - c0 < 64 ? hi - c0 : 64;
        memset(acc, 0, sizeof acc);
        for (int64_t r = 0; r < j->rows; r++) {
            const float *row = j->x[0] + r * j->cols + c0;
            for (int64_t c = 0; c < w; c++) acc[c] += row[c];
        }
        for (int64_t c = 0; c < w; c++) j->y[c0 + c] = (float)acc[c];
    }
}

void ref_sum_rows(const Node *n, const float *const *x, float *y)
{
    const Tensor *in = &n->in[0]->t;
    Job j = {.n = n, .x = x, .y = y, .rows = ref_rows(in), .cols = ref_cols(in)};
    if (ir_numel(&n->t) != j.cols) ref_die_node(n, "result is not (%lld)", (long long)j.cols);
    run_ranges(&j, sum_rows_range, j.cols, j.rows);
}

/* ---------------------------------------------------------------- norms */

static bool is_layernorm(OpKind op)
{
    return op == OP_LAYERNORM || op == OP_LAYERNORM_BWD_X || op == OP_LAYERNORM_BWD_W;
}

/* mean (0 for rmsnorm) and 1/sqrt(var + eps) (mean square for rmsnorm) of one row */
static void row_stats(const float *x, int64_t C, bool centered, double eps, double *mean,
                      double *rstd)
{
    double m = 0, v = 0;
    if (centered) {
        for (int64_t c = 0; c < C; c++) m += x[c];
        m /= (double)C;
    }
    for (int64_t c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
    *mean = m;
    *rstd = 1.0 / sqrt(v / (double)C + eps);
}

/* Inputs by op: LAYERNORM (x, w, b), RMSNORM (x, w), *_BWD_X (dy, x, w), *_BWD_W (dy, x). */
static void norm_rows_range(const Job *j, int64_t lo, int64_t hi)
{
    OpKind op = j->n->op;
    bool ln = is_layernorm(op), fwd = op == OP_LAYERNORM || op == OP_RMSNORM;
    double eps = IR_FATTR(j->n, LAYERNORM, eps);       /* every norm op has it first */
    int64_t C = j->cols;
    for (int64_t r = lo; r < hi; r++) {
        const float *x = (fwd ? j->x[0] : j->x[1]) + r * C;
        double mean, rstd;
        row_stats(x, C, ln, eps, &mean, &rstd);
        if (op == OP_LAYERNORM_BWD_W || op == OP_RMSNORM_BWD_W) {
            j->mean[r] = mean;
            j->rstd[r] = rstd;
            continue;
        }
        float *y = j->y + r * C;
        if (fwd) {
            const float *w = j->x[1], *b = ln ? j->x[2] : NULL;
            for (int64_t c = 0; c < C; c++)
                y[c] = (float)((x[c] - mean) * rstd * w[c] + (b ? b[c] : 0.0));
            continue;
        }
        /* dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w (no mean(g) for rms) */
        const float *dy = j->x[0] + r * C, *w = j->x[2];
        double sg = 0, sgx = 0;
        for (int64_t c = 0; c < C; c++) {
            double g = (double)dy[c] * w[c], xh = (x[c] - mean) * rstd;
            sg += g;
            sgx += g * xh;
        }
        double mg = ln ? sg / (double)C : 0.0, mgx = sgx / (double)C;
        for (int64_t c = 0; c < C; c++) {
            double g = (double)dy[c] * w[c], xh = (x[c] - mean) * rstd;
            y[c] = (float)(rstd * (g - mg - xh * mgx));
        }
    }
}

/* dw[c] = sum over rows of dy * xhat, for a range of columns (statistics from the first sweep) */
static void norm_dw_range(const Job *j, int64_t lo, int64_t hi)
{
    for (int64_t c = lo; c < hi; c++) {
        double acc = 0;
        for (int64_t r = 0; r < j->rows; r++) {
            const float *dy = j->x[0] + r * j->cols, *x = j->x[1] + r * j->cols;
            acc += dy[c] * ((x[c] - j->mean[r]) * j->rstd[r]);
        }
        j->y[c] = (float)acc;
    }
}

void ref_norm(const Node *n, const float *const *x, float *y)
{
    OpKind op = n->op;
    bool fwd = op == OP_LAYERNORM || op == OP_RMSNORM;
    bool dw = op == OP_LAYERNORM_BWD_W || op == OP_RMSNORM_BWD_W;
    const Tensor *xt = &n->in[fwd ? 0 : 1]->t;
    Job j = {.n = n, .x = x, .y = y, .rows = ref_rows(xt), .cols = ref_cols(xt)};
    int64_t count = j.rows * j.cols;
    check_numel(n, 0, count);
    check_numel(n, 1, fwd ? j.cols : count);
    if (n->n_in > 2) check_numel(n, 2, j.cols);
    if (ir_numel(&n->t) != (dw ? j.cols : count)) ref_die_node(n, "result has the wrong size");
    if (!dw) {
        run_ranges(&j, norm_rows_range, j.rows, 4 * j.cols);
        return;
    }
    j.mean = alloc_f64(j.rows);
    j.rstd = alloc_f64(j.rows);
    run_ranges(&j, norm_rows_range, j.rows, 2 * j.cols);
    run_ranges(&j, norm_dw_range, j.cols, j.rows);
    free(j.mean);
    free(j.rstd);
}

/* ---------------------------------------------------------------- softmax */

/* SOFTMAX (x) -> y; SOFTMAX_BWD (dy, y) -> dx = y * (dy - sum(dy * y)) */
static void softmax_range(const Job *j, int64_t lo, int64_t hi)
{
    int64_t C = j->cols;
    for (int64_t r = lo; r < hi; r++) {
        float *y = j->y + r * C;
        if (j->n->op == OP_SOFTMAX_BWD) {
            const float *dy = j->x[0] + r * C, *p = j->x[1] + r * C;
            double s = 0;
            for (int64_t c = 0; c < C; c++) s += (double)dy[c] * p[c];
            for (int64_t c = 0; c < C; c++) y[c] = (float)(p[c] * (dy[c] - s));
            continue;
        }
        const float *x = j->x[0] + r * C;
        float m = -INFINITY;
        for (int64_t c = 0; c < C; c++) m = x[c] > m ? x[c] : m;
        double s = 0;
        for (int64_t c = 0; c < C; c++) s += exp((double)x[c] - m);
        for (int64_t c = 0; c < C; c++) y[c] = (float)(exp((double)x[c] - m) / s);
    }
}

void ref_softmax(const Node *n, const float *const *x, float *y)
{
    const Tensor *t = &n->t;
    Job j = {.n = n, .x = x, .y = y, .rows = ref_rows(t), .cols = ref_cols(t)};
    for (int k = 0; k < n->n_in; k++) check_numel(n, k, ir_numel(t));
    run_ranges(&j, softmax_range, j.rows, 20 * j.cols);
}

/* ---------------------------------------------------------------- embedding */

static void embedding_range(const Job *j, int64_t lo, int64_t hi)
{
    int64_t V = j->nb, C = j->cols;
    for (int64_t r = lo; r < hi; r++) {
        int64_t id = ref_id(j->n, j->x[1][r], V, "token id");
        memcpy(j->y + r * C, j->x[0] + id * C, sizeof(float) * (size_t)C);
    }
}

void ref_embedding(const Node *n, const float *const *x, float *y)
{
    const Tensor *table = &n->in[0]->t;
    if (table->rank != 2) ref_die_node(n, "table is not (V, C)");
    Job j = {.n = n, .x = x, .y = y, .nb = table->dims[0], .cols = table->dims[1],
             .rows = ir_numel(&n->in[1]->t)};
    if (ir_numel(&n->t) != j.rows * j.cols) ref_die_node(n, "result is not (.., C)");
    run_ranges(&j, embedding_range, j.rows, j.cols);
}

/* dtable[v] = sum of dy over the rows whose id is v, those rows taken in order */
static void embedding_bwd_range(const Job *j, int64_t lo, int64_t hi)
{
    int64_t C = j->cols;
    double *acc = alloc_f64(C);
    for (int64_t v = lo; v < hi; v++) {
        memset(acc, 0, sizeof(double) * (size_t)C);
        for (int64_t k = j->first[v]; k < j->first[v + 1]; k++) {
            const float *dy = j->x[0] + j->order[k] * C;
            for (int64_t c = 0; c < C; c++) acc[c] += dy[c];
        }
        for (int64_t c = 0; c < C; c++) j->y[v * C + c] = (float)acc[c];
    }
    free(acc);
}

void ref_embedding_bwd(const Node *n, const float *const *x, float *y)
{
    if (n->t.rank != 2) ref_die_node(n, "result is not (V, C)");
    int64_t V = n->t.dims[0], C = n->t.dims[1], R = ir_numel(&n->in[1]->t);
    check_numel(n, 0, R * C);
    /* counting sort of the rows by id, stable, so each id's rows are summed in row order */
    int64_t *first = calloc((size_t)V + 1, sizeof(int64_t));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(R ? R : 1));
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)(V + 1));
    IR_ASSERT(first && order && fill);
    for (int64_t r = 0; r < R; r++) first[ref_id(n, x[1][r], V, "token id") + 1]++;
    for (int64_t v = 0; v < V; v++) first[v + 1] += first[v];
    memcpy(fill, first, sizeof(int64_t) * (size_t)(V + 1));
    for (int64_t r = 0; r < R; r++) order[fill[(int64_t)x[1][r]]++] = r;
    Job j = {.n = n, .x = x, .y = y, .cols = C, .order = order, .first = first};
    run_ranges(&j, embedding_bwd_range, V, C + 1);
    free(first);
    free(order);
    free(fill);
}

/* ---------------------------------------------------------------- cross entropy */

/* log-sum-exp of one row, in f64 */
static double row_lse(const float *l, int64_t V)
{
    float m = -INFINITY;
    for (int64_t c = 0; c < V; c++) m = l[c] > m ? l[c] : m;
    double s = 0;
    for (int64_t c = 0; c < V; c++) s += exp((double)l[c] - m);
    return m + log(s);
}

/* target < 0: the row is ignored (padding) */
static bool target_valid(const Job *j, int64_t r, int64_t *t)
{
    float v = j->x[j->n->op == OP_CROSS_ENTROPY ? 1 : 2][r];
    if (v < 0) return false;
    *t = ref_id(j->n, v, j->cols, "target");
    return true;
}

static void ce_loss_range(const Job *j, int64_t lo, int64_t hi)
{
    for (int64_t r = lo; r < hi; r++) {
        int64_t t;
        const float *l = j->x[0] + r * j->cols;
        j->row_loss[r] = target_valid(j, r, &t) ? row_lse(l, j->cols) - l[t] : NAN;
    }
}

/* dlogits = dloss / n_valid * (softmax - onehot(target)); ignored rows get 0 */
static void ce_grad_range(const Job *j, int64_t lo, int64_t hi)
{
    int64_t V = j->cols;
    double coef = j->mean[0];
    for (int64_t r = lo; r < hi; r++) {
        int64_t t;
        const float *l = j->x[1] + r * V;
        float *d = j->y + r * V;
        if (!target_valid(j, r, &t)) {
            memset(d, 0, sizeof(float) * (size_t)V);
            continue;
        }
        double lse = row_lse(l, V);
        for (int64_t c = 0; c < V; c++)
            d[c] = (float)(coef * (exp((double)l[c] - lse) - (c == t ? 1.0 : 0.0)));
    }
}

void ref_cross_entropy(const Node *n, const float *const *x, float *y)
{
    bool bwd = n->op == OP_CROSS_ENTROPY_BWD;
    const Tensor *logits = &n->in[bwd ? 1 : 0]->t;
    Job j = {.n = n, .x = x, .y = y, .rows = ref_rows(logits), .cols = ref_cols(logits)};
    check_numel(n, bwd ? 2 : 1, j.rows);
    const float *targets = x[bwd ? 2 : 1];
    int64_t valid = 0;
    for (int64_t r = 0; r < j.rows; r++) valid += targets[r] >= 0;
    if (bwd) {
        check_numel(n, 0, 1);
        double mean_coef = valid ? (double)x[0][0] / (double)valid : 0.0;
        j.mean = &mean_coef;
        if (ir_numel(&n->t) != j.rows * j.cols) ref_die_node(n, "result is not logits-shaped");
        run_ranges(&j, ce_grad_range, j.rows, 20 * j.cols);
        return;
    }
    if (ir_numel(&n->t) != 1) ref_die_node(n, "result is not a scalar");
    j.row_loss = alloc_f64(j.rows);
    run_ranges(&j, ce_loss_range, j.rows, 20 * j.cols);
    double sum = 0;
    for (int64_t r = 0; r < j.rows; r++)
        if (targets[r] >= 0) sum += j.row_loss[r];
    y[0] = valid ? (float)(sum / (double)valid) : 0.0f;
    free(j.row_loss);
}
