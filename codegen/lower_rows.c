/* lower_rows.c — the heads that work row by row, column by column, or over a whole tensor.
 *
 * Most of the step's non-GEMM work is a norm, a softmax, a gather or a reduction; each is
 * lowered here to kernels of the shapes lower_kernels.c's essay lists:
 *   rows              one item per row (layernorm, RMSNorm and their backward, softmax, cross
 *                     entropy, embedding): the columns in CG_LOOP_ROW loops, their sums and
 *                     maxima as CG_REDUCE, each output element handed to emit_out, so that a
 *                     fused group's elementwise nodes take it over before it is stored;
 *   column sums       bias and norm-weight gradients (column_sums): blocks of 64 columns,
 *                     rows in chunks of 64, the chunks' sums added in order;
 *   whole tensors     squared norms, amax and the scales made from it: partial results per
 *                     chunk into scratch (chunk_partials), one item that combines them in
 *                     order (combine_partials, which lower_adamw.c uses as well);
 *   shape ops         slice, pad, transpose, concat, constants and assignments: copies.
 * The formulas are the reference executor's, in f32 where the reference sums in f64. They sit
 * in one file because they share the row and column helpers and the transient scratch. */
#include "lower_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- rows: norms, softmax */

/* Opens the row loop of a row kernel: returns the column; *at gets the position. */
int open_cols(CgKernel *k, int row, int64_t C, At *at)
{
    int c = row_loop(k, ic(k, 0), ic(k, C));
    *at = (At){.idx = iadd(k, imul(k, row, ic(k, C)), c), .row = row, .col = c, .cols = C};
    return c;
}


enum { MAX_LANES = 16 };

/* lane[j] = fmaxf(lane[j], buf[row, base + j]) for j < n (n <= MAX_LANES) */
static void max_into_lanes(CgKernel *k, int lane, int buf, int row, int64_t C, int base, int64_t n)
{
    int j = row_loop(k, ic(k, 0), ic(k, n));
    int c = iadd(k, base, j);
    At at = {.idx = iadd(k, imul(k, row, ic(k, C)), c), .row = row, .col = c, .cols = C};
    lset(k, lane, j, e2(k, CG_FMAX, lget(k, lane, j), load_at(k, buf, at)));
    end(k);
}

/* The max of row `row` of buf (C columns), as fmaxf over MAX_LANES lanes and then over the
 * lanes: an elementwise max vectorizes, a max reduction does not (LLVM 14 vectorizes maxnum
 * reductions only under no-NaNs flags, which its C API cannot set), and a scalar max loop
 * was a third of a cross-entropy row's time over gpt2_tiny's 256 logits. */
static int row_max_in_lanes(CgKernel *k, int buf, int row, int64_t C)
{
    int lane = cg_local(k, MAX_LANES, -INFINITY);
    int64_t whole = C / MAX_LANES * MAX_LANES;
    if (whole) {
        int base = imul(k, seq_loop(k, ic(k, 0), ic(k, whole / MAX_LANES)), ic(k, MAX_LANES));
        max_into_lanes(k, lane, buf, row, C, base, MAX_LANES);
        end(k);
    }
    if (C > whole) max_into_lanes(k, lane, buf, row, C, ic(k, whole), C - whole);
    int j = row_loop(k, ic(k, 0), ic(k, MAX_LANES));
    int m = reduce_max(k, lget(k, lane, j));
    end(k);
    return m;
}

/* mean (0 for rmsnorm) and rstd = 1 / sqrt(var + eps) of row `row` of x (C columns). */
static void norm_stats(CgKernel *k, int xb, int row, int64_t C, bool centered, double eps,
                       int *mean, int *rstd)
{
    At at;
    int m = fc(k, 0.0f);
    if (centered) {
        open_cols(k, row, C, &at);
        int s = reduce_sum(k, load_at(k, xb, at));
        end(k);
        m = fdiv(k, s, fc(k, (float)C));
    }
    open_cols(k, row, C, &at);
    int d = fsub(k, load_at(k, xb, at), m);
    int ss = reduce_sum(k, fmul(k, d, d));
    end(k);
    int var = fadd(k, fdiv(k, ss, fc(k, (float)C)), fc(k, (float)eps));
    *mean = m;
    *rstd = fdiv(k, fc(k, 1.0f), e1(k, CG_SQRT, var));
}

static bool is_layernorm(OpKind op)
{
    return op == OP_LAYERNORM || op == OP_LAYERNORM_BWD_X || op == OP_LAYERNORM_BWD_W;
}

void lower_norm(Lower *L, Node *n)
{
    bool ln = is_layernorm(n->op), fwd = n->op == OP_LAYERNORM || n->op == OP_RMSNORM;
    Node *xn = n->in[fwd ? 0 : 1];
    int64_t R = rows_of(&xn->t), C = cols_of(&xn->t);
    double eps = IR_FATTR(n, LAYERNORM, eps);      /* every norm op has it first */
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_BLOCK, R, 6 * C);
    body(k);
    int row = item(k);
    int xb = cg_buf_tensor(k, xn, true, false);
    int mean, rstd;
    norm_stats(k, xb, row, C, ln, eps, &mean, &rstd);
    At at;
    if (fwd) {
        int wb = cg_buf_tensor(k, n->in[1], true, false);
        int bb = ln ? cg_buf_tensor(k, n->in[2], true, false) : NONE;
        int c = open_cols(k, row, C, &at);
        int y = fmul(k, fmul(k, fsub(k, load_at(k, xb, at), mean), rstd), ld(k, wb, c));
        if (ln) y = fadd(k, y, ld(k, bb, c));
        emit_out(L, k, n, y, at);
        end(k);
        return;
    }
    /* dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w (no mean(g) for rms) */
    int dyb = cg_buf_tensor(k, n->in[0], true, false), wb = cg_buf_tensor(k, n->in[2], true, false);
    int c = open_cols(k, row, C, &at);
    int g = fmul(k, load_at(k, dyb, at), ld(k, wb, c));
    int xh = fmul(k, fsub(k, load_at(k, xb, at), mean), rstd);
    int sg = reduce_sum(k, g), sgx = reduce_sum(k, fmul(k, g, xh));
    end(k);
    int mg = ln ? fdiv(k, sg, fc(k, (float)C)) : fc(k, 0.0f);
    int mgx = fdiv(k, sgx, fc(k, (float)C));
    c = open_cols(k, row, C, &at);
    g = fmul(k, load_at(k, dyb, at), ld(k, wb, c));
    xh = fmul(k, fsub(k, load_at(k, xb, at), mean), rstd);
    int dx = fmul(k, rstd, fsub(k, fsub(k, g, mg), fmul(k, xh, mgx)));
    emit_out(L, k, n, dx, at);
    end(k);
}

/* Scratch of `floats` elements for a value that one kernel writes and the next one reads: a
 * GEMM's C (read by its epilogue kernel) or a column sum's chunk sums. Kernels run in order,
 * so all such values share one array, as large as the largest: a step's GEMMs then write into
 * memory the last one left in cache, and the scratch a step needs is one C, not one per GEMM
 * (gpt2_tiny at batch 16 x 128: the 4 MiB of its largest C). */
int transient_scratch(Lower *L, int64_t floats)
{
    if (L->transient == NONE) L->transient = cg_scratch_new(L->p, floats);
    if (L->p->scratch[L->transient] < floats) L->p->scratch[L->transient] = floats;
    return L->transient;
}

/* Column sums of f(r, c) over rows, for blocks of COL_BLOCK columns: rows summed in order in
 * chunks of ROW_CHUNK whose sums are then added in order. The callback emits f inside the
 * column loop; the kernels are kernel(L, LOOP, n, NULL) and, when split, n's "chunks" first.
 *
 * Few column blocks would leave most threads idle (a norm's weight gradient at C = 128 has
 * two), so where there are SPLIT_CHUNKS chunks or more, one kernel writes each (chunk, block)
 * sum to scratch, one item each, and a second adds a block's chunk sums in order: the same
 * additions in the same order as one item per block, so the same bits, with parallelism
 * along the rows. The cut depends on the shape alone, never on the thread count. */
enum { SPLIT_CHUNKS = 4 };

typedef int (*ColTermFn)(Lower *L, CgKernel *k, void *ctx, int row, int col, int64_t cols);

/* part[c] += f(r, c0 + c) for the rows of chunk ch in order, c < w */
static void add_chunk(Lower *L, CgKernel *k, int part, int ch, int c0, int w, int64_t R, int64_t C,
                      ColTermFn term, void *ctx)
{
    int r0 = imul(k, ch, ic(k, ROW_CHUNK));
    int r = seq_loop(k, r0, e2(k, CG_IMIN, iadd(k, r0, ic(k, ROW_CHUNK)), ic(k, R)));
    int cc = row_loop(k, ic(k, 0), w);
    lset(k, part, cc, fadd(k, lget(k, part, cc), term(L, k, ctx, r, iadd(k, c0, cc), C)));
    end(k);
    end(k);
}

static void column_sums(Lower *L, Node *out, int64_t R, int64_t C, ColTermFn term, void *ctx)
{
    int64_t blocks = (C + COL_BLOCK - 1) / COL_BLOCK, chunks = (R + ROW_CHUNK - 1) / ROW_CHUNK;
    bool split = chunks >= SPLIT_CHUNKS;
    int sums = NONE;
    if (split) {
        sums = transient_scratch(L, chunks * C);
        CgKernel *k = kernel(L, CG_KERNEL_LOOP, out, "chunks");
        shape(k, CG_PAR_THREAD, chunks * blocks, ROW_CHUNK * COL_BLOCK * 3);
        body(k);
        int ch = e2(k, CG_IDIV, item(k), ic(k, blocks));
        int c0 = imul(k, e2(k, CG_ISUB, item(k), imul(k, ch, ic(k, blocks))), ic(k, COL_BLOCK));
        int w = e2(k, CG_IMIN, ic(k, COL_BLOCK), e2(k, CG_ISUB, ic(k, C), c0));
        int part = cg_local(k, COL_BLOCK, 0.0);
        add_chunk(L, k, part, ch, c0, w, R, C, term, ctx);
        int sb = cg_buf_scratch(k, sums, chunks * C, false, true);
        int cc = row_loop(k, ic(k, 0), w);
        cg_store(k, sb, iadd(k, imul(k, ch, ic(k, C)), iadd(k, c0, cc)), lget(k, part, cc), NONE, NONE);
        end(k);
    }
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, out, NULL);
    shape(k, CG_PAR_THREAD, blocks, split ? chunks * COL_BLOCK * 2 : R * COL_BLOCK * 3);
    body(k);
    int c0 = imul(k, item(k), ic(k, COL_BLOCK));
    int w = e2(k, CG_IMIN, ic(k, COL_BLOCK), e2(k, CG_ISUB, ic(k, C), c0));
    int total = cg_local(k, COL_BLOCK, 0.0), part = split ? NONE : cg_local(k, COL_BLOCK, 0.0);
    int sb = split ? cg_buf_scratch(k, sums, chunks * C, true, false) : NONE;
    int ch = seq_loop(k, ic(k, 0), ic(k, chunks));
    int cc;
    if (split) {
        cc = row_loop(k, ic(k, 0), w);
        int at = iadd(k, imul(k, ch, ic(k, C)), iadd(k, c0, cc));
        lset(k, total, cc, fadd(k, lget(k, total, cc), ld(k, sb, at)));
        end(k);
    } else {
        cc = row_loop(k, ic(k, 0), w);
        lset(k, part, cc, fc(k, 0.0f));
        end(k);
        add_chunk(L, k, part, ch, c0, w, R, C, term, ctx);
        cc = row_loop(k, ic(k, 0), w);
        lset(k, total, cc, fadd(k, lget(k, total, cc), lget(k, part, cc)));
        end(k);
    }
    end(k);
    int ob = cg_buf_tensor(k, out, false, true);
    cc = row_loop(k, ic(k, 0), w);
    cg_store(k, ob, iadd(k, c0, cc), lget(k, total, cc), NONE, NONE);
    end(k);
}

static int sum_rows_term(Lower *L, CgKernel *k, void *ctx, int row, int col, int64_t C)
{
    (void)L;
    Node *x = ctx;
    int xb = cg_buf_tensor(k, x, true, false);
    return cg_load(k, xb, iadd(k, imul(k, row, ic(k, C)), col), row, col);
}

void lower_sum_rows(Lower *L, Node *n)
{
    Node *x = n->in[0];
    column_sums(L, n, rows_of(&x->t), cols_of(&x->t), sum_rows_term, x);
}

typedef struct {
    Node *dy, *x;
    int stats;              /* scratch: mean, rstd per row */
    int64_t R;
} NormW;

static int norm_w_term(Lower *L, CgKernel *k, void *ctx, int row, int col, int64_t C)
{
    (void)L;
    NormW *w = ctx;
    int dyb = cg_buf_tensor(k, w->dy, true, false), xb = cg_buf_tensor(k, w->x, true, false);
    int sb = cg_buf_scratch(k, w->stats, 2 * w->R, true, false);
    int idx = iadd(k, imul(k, row, ic(k, C)), col);
    int mean = ld(k, sb, imul(k, row, ic(k, 2)));
    int rstd = ld(k, sb, iadd(k, imul(k, row, ic(k, 2)), ic(k, 1)));
    int xh = fmul(k, fsub(k, cg_load(k, xb, idx, row, col), mean), rstd);
    return fmul(k, cg_load(k, dyb, idx, row, col), xh);
}

/* dw = sum over rows of dy * xhat: the row statistics first, then column sums. */
void lower_norm_w(Lower *L, Node *n)
{
    NormW w = {.dy = n->in[0], .x = n->in[1]};
    int64_t R = rows_of(&w.x->t), C = cols_of(&w.x->t);
    w.R = R;
    w.stats = cg_scratch_new(L->p, 2 * R);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, "stats");
    shape(k, CG_PAR_BLOCK, R, 3 * C);
    body(k);
    int row = item(k);
    int xb = cg_buf_tensor(k, w.x, true, false), sb = cg_buf_scratch(k, w.stats, 2 * R, false, true);
    int mean, rstd;
    norm_stats(k, xb, row, C, is_layernorm(n->op), IR_FATTR(n, LAYERNORM, eps), &mean, &rstd);
    cg_store(k, sb, imul(k, row, ic(k, 2)), mean, NONE, NONE);
    cg_store(k, sb, iadd(k, imul(k, row, ic(k, 2)), ic(k, 1)), rstd, NONE, NONE);
    column_sums(L, n, R, C, norm_w_term, &w);
}

void lower_softmax(Lower *L, Node *n)
{
    int64_t R = rows_of(&n->t), C = cols_of(&n->t);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_BLOCK, R, 20 * C);
    body(k);
    int row = item(k);
    At at;
    if (n->op == OP_SOFTMAX_BWD) {
        int dyb = cg_buf_tensor(k, n->in[0], true, false), yb = cg_buf_tensor(k, n->in[1], true, false);
        open_cols(k, row, C, &at);
        int s = reduce_sum(k, fmul(k, load_at(k, dyb, at), load_at(k, yb, at)));
        end(k);
        open_cols(k, row, C, &at);
        int dx = fmul(k, load_at(k, yb, at), fsub(k, load_at(k, dyb, at), s));
        emit_out(L, k, n, dx, at);
        end(k);
        return;
    }
    int xb = cg_buf_tensor(k, n->in[0], true, false);
    int m = row_max_in_lanes(k, xb, row, C);
    open_cols(k, row, C, &at);
    int s = reduce_sum(k, e1(k, CG_EXP, fsub(k, load_at(k, xb, at), m)));
    end(k);
    open_cols(k, row, C, &at);
    int y = fdiv(k, e1(k, CG_EXP, fsub(k, load_at(k, xb, at), m)), s);
    emit_out(L, k, n, y, at);
    end(k);
}

/* ---------------------------------------------------------------- gathers */

/* An id loaded as f32, truncated and clamped into [0, limit): bad ids never read outside a
 * tensor (the runtime checks its data against the vocabulary before it trains). */
static int clamp_id(CgKernel *k, int f, int64_t limit)
{
    return e2(k, CG_IMAX, ic(k, 0), e2(k, CG_IMIN, e1(k, CG_FTOI, f), ic(k, limit - 1)));
}

void lower_embedding(Lower *L, Node *n)
{
    Node *table = n->in[0], *ids = n->in[1];
    int64_t V = table->t.dims[0], C = table->t.dims[1], R = ir_numel(&ids->t);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_BLOCK, R, 2 * C);
    body(k);
    int row = item(k);
    int tb = cg_buf_tensor(k, table, true, false), idb = cg_buf_tensor(k, ids, true, false);
    int id = clamp_id(k, ld(k, idb, row), V);
    At at;
    int c = open_cols(k, row, C, &at);
    int v = cg_load(k, tb, iadd(k, imul(k, id, ic(k, C)), c), id, c);
    emit_out(L, k, n, v, at);
    end(k);
}

/* dtable[v] = sum of dy over the rows whose id is v, in row order: a counting sort of the rows
 * by id (one sequential item), then one item per vocabulary row. The sort's arrays are f32
 * scratch holding integers (exact below 2^24). */
void lower_embedding_bwd(Lower *L, Node *n)
{
    Node *dy = n->in[0], *ids = n->in[1];
    int64_t V = n->t.dims[0], C = n->t.dims[1], R = ir_numel(&ids->t);
    int first = cg_scratch_new(L->p, V + 1), order = cg_scratch_new(L->p, R);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, "sort");
    shape(k, CG_PAR_THREAD, 1, 3 * (R + V));
    body(k);
    int fb = cg_buf_scratch(k, first, V + 1, true, true), ob = cg_buf_scratch(k, order, R, false, true);
    int idb = cg_buf_tensor(k, ids, true, false);
    int v = seq_loop(k, ic(k, 0), ic(k, V + 1));
    cg_store(k, fb, v, fc(k, 0.0f), NONE, NONE);
    end(k);
    int r = seq_loop(k, ic(k, 0), ic(k, R));           /* counts, shifted by one */
    int slot = iadd(k, clamp_id(k, ld(k, idb, r), V), ic(k, 1));
    cg_store(k, fb, slot, fadd(k, ld(k, fb, slot), fc(k, 1.0f)), NONE, NONE);
    end(k);
    v = seq_loop(k, ic(k, 0), ic(k, V));                /* prefix sums: first[v] */
    int next = iadd(k, v, ic(k, 1));
    cg_store(k, fb, next, fadd(k, ld(k, fb, next), ld(k, fb, v)), NONE, NONE);
    end(k);
    r = seq_loop(k, ic(k, 0), ic(k, R));                /* stable placement, first[] as fill */
    slot = clamp_id(k, ld(k, idb, r), V);
    int at = ld(k, fb, slot);
    cg_store(k, ob, e1(k, CG_FTOI, at), e1(k, CG_ITOF, r), NONE, NONE);
    cg_store(k, fb, slot, fadd(k, at, fc(k, 1.0f)), NONE, NONE);
    end(k);
    /* first[v] is now the end of v's rows, i.e. the start of v+1's: shift back by one */
    v = seq_loop(k, ic(k, 0), ic(k, V));
    int w = e2(k, CG_ISUB, ic(k, V), v);                /* V .. 1 */
    cg_store(k, fb, w, ld(k, fb, e2(k, CG_ISUB, w, ic(k, 1))), NONE, NONE);
    end(k);
    cg_store(k, fb, ic(k, 0), fc(k, 0.0f), NONE, NONE);

    k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_BLOCK, V, 4 * C + 2 * C * (R / (V ? V : 1) + 1));
    body(k);
    int vv = item(k);
    fb = cg_buf_scratch(k, first, V + 1, true, false);
    ob = cg_buf_scratch(k, order, R, true, false);
    int dyb = cg_buf_tensor(k, dy, true, false), yb = cg_buf_tensor(k, n, false, true);
    int acc = cg_local(k, C, 0.0);
    int lo = e1(k, CG_FTOI, ld(k, fb, vv)), hi = e1(k, CG_FTOI, ld(k, fb, iadd(k, vv, ic(k, 1))));
    int j = seq_loop(k, lo, hi);
    int rr = e1(k, CG_FTOI, ld(k, ob, j));
    int c = row_loop(k, ic(k, 0), ic(k, C));
    lset(k, acc, c, fadd(k, lget(k, acc, c), cg_load(k, dyb, iadd(k, imul(k, rr, ic(k, C)), c), rr, c)));
    end(k);
    end(k);
    c = row_loop(k, ic(k, 0), ic(k, C));
    cg_store(k, yb, iadd(k, imul(k, vv, ic(k, C)), c), lget(k, acc, c), vv, c);
    end(k);
}

/* ---------------------------------------------------------------- cross entropy */

/* Number of valid targets (>= 0) into scratch[0]. */
static int count_valid(Lower *L, Node *n, Node *targets, int64_t R)
{
    int cnt = cg_scratch_new(L->p, 1);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, "count");
    shape(k, CG_PAR_THREAD, 1, 2 * R);
    body(k);
    int tb = cg_buf_tensor(k, targets, true, false), cb = cg_buf_scratch(k, cnt, 1, false, true);
    int r = seq_loop(k, ic(k, 0), ic(k, R));
    int valid = e2(k, CG_FLE, fc(k, 0.0f), ld(k, tb, r));
    int s = reduce_sum(k, e3(k, CG_SELECT, valid, fc(k, 1.0f), fc(k, 0.0f)));
    end(k);
    cg_store(k, cb, ic(k, 0), s, NONE, NONE);
    return cnt;
}

/* log-sum-exp of row `row` of the logits (V columns) */
static int row_lse(CgKernel *k, int lb, int row, int64_t V)
{
    At at;
    int m = row_max_in_lanes(k, lb, row, V);
    open_cols(k, row, V, &at);
    int s = reduce_sum(k, e1(k, CG_EXP, fsub(k, load_at(k, lb, at), m)));
    end(k);
    return fadd(k, m, e1(k, CG_LOG, s));
}

void lower_cross_entropy(Lower *L, Node *n)
{
    bool bwd = n->op == OP_CROSS_ENTROPY_BWD;
    Node *logits = n->in[bwd ? 1 : 0], *targets = n->in[bwd ? 2 : 1];
    int64_t R = rows_of(&logits->t), V = cols_of(&logits->t);
    if (bwd) {
        int cnt = count_valid(L, n, targets, R);
        CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
        shape(k, CG_PAR_BLOCK, R, 30 * V);
        int cb = cg_buf_scratch(k, cnt, 1, true, false), db = cg_buf_tensor(k, n->in[0], true, false);
        int count = ld(k, cb, ic(k, 0));
        int coef = e3(k, CG_SELECT, e2(k, CG_FLT, fc(k, 0.0f), count),
                      fdiv(k, ld(k, db, ic(k, 0)), count), fc(k, 0.0f));
        body(k);
        int row = item(k);
        int lb = cg_buf_tensor(k, logits, true, false), tb = cg_buf_tensor(k, targets, true, false);
        int tv = ld(k, tb, row);
        int valid = e2(k, CG_FLE, fc(k, 0.0f), tv);
        int t = clamp_id(k, tv, V);
        int lse = row_lse(k, lb, row, V);
        At at;
        int c = open_cols(k, row, V, &at);
        int p = e1(k, CG_EXP, fsub(k, load_at(k, lb, at), lse));
        int hot = e3(k, CG_SELECT, e2(k, CG_IEQ, c, t), fc(k, 1.0f), fc(k, 0.0f));
        int d = fmul(k, coef, fsub(k, p, hot));
        emit_out(L, k, n, e3(k, CG_SELECT, valid, d, fc(k, 0.0f)), at);
        end(k);
        return;
    }
    /* per-row losses (0 for ignored rows) and validity, then their mean in one item */
    int losses = cg_scratch_new(L->p, 2 * R);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, "rows");
    shape(k, CG_PAR_BLOCK, R, 20 * V);
    body(k);
    int row = item(k);
    int lb = cg_buf_tensor(k, logits, true, false), tb = cg_buf_tensor(k, targets, true, false);
    int sb = cg_buf_scratch(k, losses, 2 * R, false, true);
    int tv = ld(k, tb, row);
    int valid = e2(k, CG_FLE, fc(k, 0.0f), tv);
    int t = clamp_id(k, tv, V);
    int lse = row_lse(k, lb, row, V);
    int loss = fsub(k, lse, cg_load(k, lb, iadd(k, imul(k, row, ic(k, V)), t), row, t));
    cg_store(k, sb, imul(k, row, ic(k, 2)), e3(k, CG_SELECT, valid, loss, fc(k, 0.0f)), NONE, NONE);
    cg_store(k, sb, iadd(k, imul(k, row, ic(k, 2)), ic(k, 1)),
             e3(k, CG_SELECT, valid, fc(k, 1.0f), fc(k, 0.0f)), NONE, NONE);

    k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, 1, 4 * R);
    body(k);
    sb = cg_buf_scratch(k, losses, 2 * R, true, false);
    int yb = cg_buf_tensor(k, n, false, true);
    int64_t chunks = (R + ROW_CHUNK - 1) / ROW_CHUNK;
    int ch = seq_loop(k, ic(k, 0), ic(k, chunks));
    int r0 = imul(k, ch, ic(k, ROW_CHUNK));
    int r = seq_loop(k, r0, e2(k, CG_IMIN, iadd(k, r0, ic(k, ROW_CHUNK)), ic(k, R)));
    int ls = reduce_sum(k, ld(k, sb, imul(k, r, ic(k, 2))));
    int vs = reduce_sum(k, ld(k, sb, iadd(k, imul(k, r, ic(k, 2)), ic(k, 1))));
    end(k);
    int total = reduce_sum(k, ls), count = reduce_sum(k, vs);
    end(k);
    int mean = e3(k, CG_SELECT, e2(k, CG_FLT, fc(k, 0.0f), count), fdiv(k, total, count), fc(k, 0.0f));
    cg_store(k, yb, ic(k, 0), mean, NONE, NONE);
}

/* ---------------------------------------------------------------- whole-tensor reductions */

/* Partial reductions of f(x[i]) over chunks of REDUCE_CHUNK elements into a scratch array;
 * returns the scratch, *chunks its length. */
int chunk_partials(Lower *L, Node *n, Node *x, bool square, int *chunks_out)
{
    int64_t N = ir_numel(&x->t), chunks = (N + REDUCE_CHUNK - 1) / REDUCE_CHUNK;
    if (chunks < 1) chunks = 1;
    int part = cg_scratch_new(L->p, chunks);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, "partial");
    shape(k, CG_PAR_BLOCK, chunks, 2 * REDUCE_CHUNK);
    body(k);
    int it = item(k);
    int xb = cg_buf_tensor(k, x, true, false), pb = cg_buf_scratch(k, part, chunks, false, true);
    int lo = imul(k, it, ic(k, REDUCE_CHUNK));
    int hi = e2(k, CG_IMIN, iadd(k, lo, ic(k, REDUCE_CHUNK)), ic(k, N));
    int i = row_loop(k, lo, hi);
    int v = ld(k, xb, i);
    int r = square ? reduce_sum(k, fmul(k, v, v)) : reduce_max(k, e1(k, CG_FABS, v));
    end(k);
    cg_store(k, pb, it, r, NONE, NONE);
    *chunks_out = (int)chunks;
    return part;
}

/* A kernel of one item that combines the partials in order; returns it, positioned after the
 * combined value *v was emitted. */
CgKernel *combine_partials(Lower *L, Node *n, int part, int chunks, bool sum, int *v)
{
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, 1, 2 * chunks);
    body(k);
    int pb = cg_buf_scratch(k, part, chunks, true, false);
    int c = seq_loop(k, ic(k, 0), ic(k, chunks));
    int r = sum ? reduce_sum(k, ld(k, pb, c)) : reduce_max(k, ld(k, pb, c));
    end(k);
    *v = r;
    return k;
}

void lower_sqnorm(Lower *L, Node *n)
{
    int chunks, v;
    int part = chunk_partials(L, n, n->in[0], true, &chunks);
    CgKernel *k = combine_partials(L, n, part, chunks, true, &v);
    cg_store(k, cg_buf_tensor(k, n, false, true), ic(k, 0), v, NONE, NONE);
}

/* max(elem) / amax / 2^margin, or `otherwise` when amax is 0 or not finite */
static int scale_from_amax(CgKernel *k, ElemType e, int64_t margin, int amax, int otherwise)
{
    int usable = e2(k, CG_AND, e2(k, CG_FLT, fc(k, 0.0f), amax), e2(k, CG_FLT, amax, fc(k, INFINITY)));
    int s = fmul(k, fdiv(k, fc(k, num_elem_max(e)), amax), fc(k, ldexp(1.0, -(int)margin)));
    return e3(k, CG_SELECT, usable, s, otherwise);
}

void lower_quant_scale(Lower *L, Node *n)
{
    Node *x = n->in[0];
    ElemType e = (ElemType)IR_IATTR(n, QUANT_SCALE, elem);
    Scaling kind = (Scaling)IR_IATTR(n, QUANT_SCALE, scaling);
    int64_t margin = IR_IATTR(n, QUANT_SCALE, margin), R = rows_of(&x->t), C = cols_of(&x->t);
    if (kind == SCALE_PER_TENSOR) {
        int chunks, amax;
        int part = chunk_partials(L, n, x, false, &chunks);
        CgKernel *k = combine_partials(L, n, part, chunks, false, &amax);
        cg_store(k, cg_buf_tensor(k, n, false, true), ic(k, 0),
                 scale_from_amax(k, e, margin, amax, fc(k, 1.0f)), NONE, NONE);
        return;
    }
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    body(k);
    int xb = cg_buf_tensor(k, x, true, false), yb = cg_buf_tensor(k, n, false, true);
    int it = item(k), amax;
    if (kind == SCALE_PER_ROW) {
        shape(k, CG_PAR_BLOCK, R, 2 * C);
        At at;
        open_cols(k, it, C, &at);
        amax = reduce_max(k, e1(k, CG_FABS, load_at(k, xb, at)));
        end(k);
    } else if (kind == SCALE_PER_GROUP || kind == SCALE_TILE_1x128) {
        int64_t G = fmt_scaling_group(kind, (int)IR_IATTR(n, QUANT_SCALE, group)), ncg = (C + G - 1) / G;
        shape(k, CG_PAR_BLOCK, R * ncg, 2 * G);
        int r = e2(k, CG_IDIV, it, ic(k, ncg)), gi = e2(k, CG_IMOD, it, ic(k, ncg));
        int c0 = imul(k, gi, ic(k, G));
        int c = row_loop(k, c0, e2(k, CG_IMIN, iadd(k, c0, ic(k, G)), ic(k, C)));
        amax = reduce_max(k, e1(k, CG_FABS, cg_load(k, xb, iadd(k, imul(k, r, ic(k, C)), c), r, c)));
        end(k);
    } else {
        IR_ASSERT(kind == SCALE_BLOCK_128);
        int64_t nrb = (R + 127) / 128, ncb = (C + 127) / 128;
        shape(k, CG_PAR_BLOCK, nrb * ncb, 2 * 128 * 128);
        int rb = e2(k, CG_IDIV, it, ic(k, ncb)), cb = e2(k, CG_IMOD, it, ic(k, ncb));
        int m = cg_local(k, 1, 0.0);
        int r0 = imul(k, rb, ic(k, 128)), c0 = imul(k, cb, ic(k, 128));
        int r = seq_loop(k, r0, e2(k, CG_IMIN, iadd(k, r0, ic(k, 128)), ic(k, R)));
        int c = row_loop(k, c0, e2(k, CG_IMIN, iadd(k, c0, ic(k, 128)), ic(k, C)));
        int rm = reduce_max(k, e1(k, CG_FABS, cg_load(k, xb, iadd(k, imul(k, r, ic(k, C)), c), r, c)));
        end(k);
        lset(k, m, ic(k, 0), e2(k, CG_FMAX, lget(k, m, ic(k, 0)), rm));
        end(k);
        amax = lget(k, m, ic(k, 0));
    }
    cg_store(k, yb, it, scale_from_amax(k, e, margin, amax, fc(k, 1.0f)), NONE, NONE);
}

/* (history (H), x): the history shifts by one and history[0] = amax(x), in place */
void lower_amax_record(Lower *L, Node *n)
{
    Node *h = n->in[0];
    int64_t H = ir_numel(&h->t);
    int chunks, amax;
    int part = chunk_partials(L, n, n->in[1], false, &chunks);
    CgKernel *k = combine_partials(L, n, part, chunks, false, &amax);
    k->cost += H;
    int hb = cg_buf_tensor(k, h, true, true);
    int i = seq_loop(k, ic(k, 0), ic(k, H - 1));
    int to = e2(k, CG_ISUB, ic(k, H - 1), i);
    cg_store(k, hb, to, ld(k, hb, e2(k, CG_ISUB, to, ic(k, 1))), NONE, NONE);
    end(k);
    cg_store(k, hb, ic(k, 0), amax, NONE, NONE);
}

void lower_delayed_scale(Lower *L, Node *n)
{
    Node *st = n->in[0], *h = n->in[1];
    int64_t H = ir_numel(&h->t);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, 1, H + 10);
    body(k);
    int sb = cg_buf_tensor(k, st, true, true), hb = cg_buf_tensor(k, h, true, false);
    int amax;
    if (IR_IATTR(n, DELAYED_SCALE, use_max)) {
        int i = seq_loop(k, ic(k, 0), ic(k, H));
        amax = reduce_max(k, ld(k, hb, i));
        end(k);
        /* the reference starts from history[0], so a NaN there wins as it does there */
        int h0 = ld(k, hb, ic(k, 0));
        amax = e3(k, CG_SELECT, e2(k, CG_FEQ, h0, h0), amax, h0);
    } else {
        amax = ld(k, hb, ic(k, 0));
    }
    int old = ld(k, sb, ic(k, 0));
    cg_store(k, sb, ic(k, 0), scale_from_amax(k, (ElemType)IR_IATTR(n, DELAYED_SCALE, elem), IR_IATTR(n, DELAYED_SCALE, margin), amax, old),
             NONE, NONE);
}

/* ---------------------------------------------------------------- shape ops */

/* The tensor as (outer, len, inner) around `axis`. */
static void split_at(const Tensor *t, int64_t axis, int64_t *outer, int64_t *len, int64_t *inner)
{
    if (axis < 0) axis += t->rank;
    *outer = *inner = 1;
    for (int i = 0; i < axis; i++) *outer *= t->dims[i];
    for (int i = (int)axis + 1; i < t->rank; i++) *inner *= t->dims[i];
    *len = t->dims[axis];
}

/* SLICE and PAD: rows of `len * inner` contiguous elements per outer index. Few long rows (the
 * position table's gradient, a pad along axis 0, is one row of every position) are cut into
 * parts of at least SLICE_PART elements, so that the threads share them. */
enum { SLICE_PART = 4096, SLICE_ITEMS = 64 };
void lower_slice(Lower *L, Node *n)
{
    bool pad = n->op == OP_PAD;
    Node *x = n->in[0];
    int64_t outer, ly, inner, o2, lx, i2, start = IR_IATTR(n, SLICE, start);   /* PAD too */
    split_at(&n->t, IR_IATTR(n, SLICE, axis), &outer, &ly, &inner);
    split_at(&x->t, IR_IATTR(n, SLICE, axis), &o2, &lx, &i2);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    int64_t span = ly * inner;   /* output elements per outer index */
    int64_t parts = outer >= SLICE_ITEMS ? 1 : (SLICE_ITEMS + outer - 1) / outer;
    if (parts > (span + SLICE_PART - 1) / SLICE_PART) parts = (span + SLICE_PART - 1) / SLICE_PART;
    if (parts < 1) parts = 1;
    int64_t part = (span + parts - 1) / parts;
    shape(k, CG_PAR_BLOCK, outer * parts, 2 * part);
    body(k);
    int it = item(k), o = it, lo = ic(k, 0), hi = ic(k, span);
    if (parts > 1) {
        o = e2(k, CG_IDIV, it, ic(k, parts));
        lo = imul(k, e2(k, CG_IMOD, it, ic(k, parts)), ic(k, part));
        hi = e2(k, CG_IMIN, iadd(k, lo, ic(k, part)), ic(k, span));
    }
    int xb = cg_buf_tensor(k, x, true, false);
    int j = row_loop(k, lo, hi);
    At at = {.idx = iadd(k, imul(k, o, ic(k, span)), j), .row = NONE, .col = NONE,
             .cols = cols_of(&n->t)};
    int v;
    if (!pad) {
        v = ld(k, xb, iadd(k, imul(k, o, ic(k, lx * inner)), iadd(k, j, ic(k, start * inner))));
    } else {
        int rel = e2(k, CG_ISUB, j, ic(k, start * inner));
        int inside = e2(k, CG_AND, e2(k, CG_ILT, ic(k, -1), rel), e2(k, CG_ILT, rel, ic(k, lx * inner)));
        int src = e2(k, CG_IMAX, ic(k, 0), e2(k, CG_IMIN, rel, ic(k, lx * inner - 1)));
        v = e3(k, CG_SELECT, inside, ld(k, xb, iadd(k, imul(k, o, ic(k, lx * inner)), src)), fc(k, 0.0f));
    }
    emit_out(L, k, n, v, at);
    end(k);
}

/* TRANSPOSE: x as (R, C) -> (C, R), one item per result row (a column of x). Loads decode
 * and the store encodes in the same format and scale, which gives back each code. */
void lower_transpose(Lower *L, Node *n)
{
    Node *x = n->in[0];
    int64_t C = n->t.dims[0], R = n->t.dims[1];
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_BLOCK, C, 2 * R);
    body(k);
    int o = item(k);
    int xb = cg_buf_tensor(k, x, true, false);
    int j = row_loop(k, ic(k, 0), ic(k, R));
    At at = {.idx = iadd(k, imul(k, o, ic(k, R)), j), .row = NONE, .col = NONE, .cols = R};
    emit_out(L, k, n, ld(k, xb, iadd(k, imul(k, j, ic(k, C)), o)), at);
    end(k);
}

/* CONCAT: one copy kernel per input, each writing its part of the result. */
void lower_concat(Lower *L, Node *n)
{
    int64_t outer, ly, inner, at = 0;
    split_at(&n->t, IR_IATTR(n, CONCAT, axis), &outer, &ly, &inner);
    for (int q = 0; q < n->n_in; q++) {
        Node *x = n->in[q];
        int64_t o2, lx, i2;
        split_at(&x->t, IR_IATTR(n, CONCAT, axis), &o2, &lx, &i2);
        CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, arena_printf(L->p->arena, "part%d", q));
        shape(k, CG_PAR_BLOCK, outer, 2 * lx * inner);
        body(k);
        int o = item(k);
        int xb = cg_buf_tensor(k, x, true, false), yb = cg_buf_tensor(k, n, false, true);
        int j = row_loop(k, ic(k, 0), ic(k, lx * inner));
        int v = ld(k, xb, iadd(k, imul(k, o, ic(k, lx * inner)), j));
        cg_store(k, yb, iadd(k, imul(k, o, ic(k, ly * inner)), iadd(k, j, ic(k, at * inner))), v,
                 NONE, NONE);
        end(k);
        at += lx;
    }
}

void lower_const(Lower *L, Node *n)
{
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, ir_numel(&n->t), 1);
    int v = fc(k, (float)IR_FATTR(n, CONST, value));
    body(k);
    cg_store(k, cg_buf_tensor(k, n, false, true), item(k), v, NONE, NONE);
}

void lower_assign(Lower *L, Node *n)
{
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, ir_numel(&n->in[0]->t), 2);
    body(k);
    int i = item(k);
    int v = ld(k, cg_buf_tensor(k, n->in[1], true, false), i);
    cg_store(k, cg_buf_tensor(k, n->in[0], false, true), i, v, NONE, NONE);
}
