/* lower_attn.c — rope and attention as kernels.
 *
 * Rope is a row op with a cos/sin table made here (in double, as the reference, rounded once).
 * Attention is the one head whose cost grows with T^2, so its kernels are shaped for reuse
 * rather than written as a row op: k (and for the backward v, q, dy) transposed per head into
 * f32 scratch padded with zeros to whole blocks of 16 keys, then one item per block of up to
 * 8 query rows of a head: scores against the transposed keys in whole blocks (keys past a
 * row masked to -inf), each key loaded once for all the rows; softmax; the weighted sum of v,
 * each v row loaded once for all the rows. The backward is two such kernels: dq per block of
 * query rows (keeping each row's log-sum-exp and dy.o), dk and dv per block of key rows.
 * One row per item, over keys 0..t, left vectorized loops of variable length with scalar
 * remainders and loaded every key once per row: blocks run 2.4x to 2.9x faster (gpt2_tiny
 * and GPT-2 d12 at T = 128, one thread). The locals an item keeps are bounded (ATTN_LOCALS,
 * ATTN_ACC in lower_kernels.h), so long rows of D take several passes. */
#include "lower_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- rope and attention */

/* Pairs (2i, 2i+1) of each head turn by p * theta^(-2i/D); the cos/sin table is the
 * reference's (ir_rope_table, f64), rounded once to f32. */
void lower_rope(Lower *L, Node *n)
{
    int64_t D = IR_IATTR(n, ROPE, head_dim), C = cols_of(&n->t), T = n->t.dims[n->t.rank - 2];
    int64_t R = rows_of(&n->t), half = D / 2;
    double sign = IR_IATTR(n, ROPE, inverse) ? -1.0 : 1.0, theta = IR_FATTR(n, ROPE, theta);
    double *exact = malloc(sizeof(double) * (size_t)(T * D > 0 ? T * D : 1));
    float *cs = malloc(sizeof(float) * (size_t)(T * D > 0 ? T * D : 1));
    IR_ASSERT(exact && cs);
    ir_rope_table(T, D, theta, exact);
    for (int64_t j = 0; j < T * half; j++) {
        cs[2 * j] = (float)exact[2 * j];
        cs[2 * j + 1] = (float)(sign * exact[2 * j + 1]);
    }
    int table = cg_const_new(L->p, cs, T * D);
    free(exact);
    free(cs);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_BLOCK, R, 6 * C);
    body(k);
    int row = item(k);
    int xb = cg_buf_tensor(k, n->in[0], true, false), tb = cg_buf_const(k, table, T * D);
    int pos = e2(k, CG_IMOD, row, ic(k, T));
    int i2 = row_loop(k, ic(k, 0), ic(k, C / 2));
    int c = imul(k, i2, ic(k, 2));
    int ti = imul(k, iadd(k, imul(k, pos, ic(k, half)), e2(k, CG_IMOD, i2, ic(k, half))), ic(k, 2));
    int co = ld(k, tb, ti), si = ld(k, tb, iadd(k, ti, ic(k, 1)));
    At a0 = {.idx = iadd(k, imul(k, row, ic(k, C)), c), .row = row, .col = c, .cols = C};
    int c1 = iadd(k, c, ic(k, 1));
    At a1 = {.idx = iadd(k, a0.idx, ic(k, 1)), .row = row, .col = c1, .cols = C};
    int x0 = load_at(k, xb, a0), x1 = load_at(k, xb, a1);
    emit_out(L, k, n, fsub(k, fmul(k, x0, co), fmul(k, x1, si)), a0);
    emit_out(L, k, n, fadd(k, fmul(k, x0, si), fmul(k, x1, co)), a1);
    end(k);
}

/* q, k, v as separate tensors (q (B, T, H D), k and v (B, T, Hkv D)) or packed in one
 * (B, T, (H + 2 Hkv) D): each is a node, a column offset and a row stride. */
typedef struct {
    int64_t B, T, H, Hkv, D, group;
    int64_t Tp;             /* T rounded up to KEY_BLOCK: the row length of transposed scratch */
    float scale;
    Node *q, *k, *v;
    int64_t qoff, koff, voff, qstride, kvstride;
} AttnShape;

static AttnShape attn_shape(Node *n, int first)
{
    AttnShape s = {.H = IR_IATTR(n, ATTENTION, heads), .Hkv = IR_IATTR(n, ATTENTION, kv_heads),
                   .scale = (float)IR_FATTR(n, ATTENTION, scale)};   /* ATTENTION_BWD too */
    bool packed = n->n_in - ir_attention_bwd_reads_y(n) == first + 1;
    s.q = n->in[first];
    s.B = s.q->t.dims[0];
    s.T = s.q->t.dims[1];
    s.Tp = (s.T + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    s.D = packed ? s.q->t.dims[2] / (s.H + 2 * s.Hkv) : s.q->t.dims[2] / s.H;
    s.group = s.H / s.Hkv;
    if (packed) {
        s.k = s.v = s.q;
        s.qstride = s.kvstride = (s.H + 2 * s.Hkv) * s.D;
        s.koff = s.H * s.D;
        s.voff = (s.H + s.Hkv) * s.D;
    } else {
        s.k = n->in[first + 1];
        s.v = n->in[first + 2];
        s.qstride = s.H * s.D;
        s.kvstride = s.Hkv * s.D;
    }
    return s;
}

/* Rows per item: ATTN_ROWS, fewer when the item's locals (`locals` f32 per row) would pass
 * ATTN_LOCALS (40 KiB), which keeps a GPU block's locals within its 48 KiB of shared memory. */
static int64_t rows_per_item(int64_t locals)
{
    int64_t R = ATTN_ROWS;
    while (R > 1 && R * locals > ATTN_LOCALS) R /= 2;
    return R;
}

/* Rows per pass of a weighted sum of rows of D: their sums (G D f32) stay in registers, 16 of
 * the 32 that AVX-512 has (the CPU kernels use 512-bit vectors where there are). More spilled
 * and shuffled registers in the inner loop when it was 4 rows of 64 at 256 bits (GPT-2 d12's
 * forward); at 512 bits, 8 rows of 32 in one pass instead of two made gpt2_tiny's attention
 * kernels about 7% faster, and GPT-2 d12's step is unchanged at 4 rows of 64. An AVX2 CPU has
 * 16 registers of 256 bits: there they spill. At least two rows: with one, LLVM unrolls
 * gpt2_tiny's loop over d completely and leaves it scalar (3x slower kernels). */
static int64_t rows_per_pass(int64_t R, int64_t D)
{
    int64_t G = R;
    while (G > 2 && G * D > ATTN_ACC) G /= 2;
    return G;
}

/* x's heads transposed into f32 scratch: (B, heads, D, Tp) from rows of x at column offset
 * `off` with row stride `stride`, the columns T..Tp-1 zero. Score loops then run over keys
 * (or queries) with unit stride, in whole blocks of KEY_BLOCK without reading past the
 * scratch, and bf16 or FP8 inputs are decoded once instead of once per use. */
static int transpose_heads(Lower *L, Node *n, Node *x, const char *what, const AttnShape *s,
                           int64_t heads, int64_t off, int64_t stride)
{
    int64_t size = s->B * heads * s->D * s->Tp;
    int t = cg_scratch_new(L->p, size);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, what);
    shape(k, CG_PAR_BLOCK, s->B * heads * s->D, 3 * s->Tp);
    int zero = fc(k, 0.0f);
    body(k);
    int it = item(k);
    int bh = e2(k, CG_IDIV, it, ic(k, s->D)), d = e2(k, CG_IMOD, it, ic(k, s->D));
    int b = e2(k, CG_IDIV, bh, ic(k, heads)), h = e2(k, CG_IMOD, bh, ic(k, heads));
    int xb = cg_buf_tensor(k, x, true, false), tb = cg_buf_scratch(k, t, size, false, true);
    int col = iadd(k, ic(k, off), iadd(k, imul(k, h, ic(k, s->D)), d));
    int j = row_loop(k, ic(k, 0), ic(k, s->Tp));
    int jx = s->Tp > s->T ? e2(k, CG_IMIN, j, ic(k, s->T - 1)) : j;
    int v = ld(k, xb, iadd(k, imul(k, iadd(k, imul(k, b, ic(k, s->T)), jx), ic(k, stride)), col));
    if (s->Tp > s->T) v = select_of(k, ilt(k, j, ic(k, s->T)), v, zero);
    cg_store(k, tb, iadd(k, imul(k, it, ic(k, s->Tp)), j), v, NONE, NONE);
    end(k);
    return t;
}

/* An item's block of rows: rows t0 .. t0 + R - 1 of one (b, head) of a (B, heads, T) grid.
 * When R does not divide T, the last block's rows past T repeat row T - 1 and store nothing
 * (their stores run in loops of live() iterations), so every index stays in bounds.
 * Items take a head's blocks in turn, so that its transposed block stays in cache (block-
 * major order made gpt2_tiny's dq 1.2x slower at one thread), and the costliest block first
 * (`last_first` when the last rows see the most keys): the pool's threads take tasks in item
 * order, so they then finish together. */
typedef struct {
    int64_t R, T;
    int b, h, t0;
    int t[ATTN_ROWS];       /* min(t0 + r, T - 1) */
    int end;                /* min(t0 + R, T): one past the block's last row */
} RowBlock;

static RowBlock row_block(CgKernel *k, const AttnShape *s, int it, int64_t heads, int64_t R,
                          bool last_first)
{
    int64_t blocks = (s->T + R - 1) / R;
    RowBlock r = {.R = R, .T = s->T};
    int bh = e2(k, CG_IDIV, it, ic(k, blocks)), blk = e2(k, CG_IMOD, it, ic(k, blocks));
    if (last_first) blk = e2(k, CG_ISUB, ic(k, blocks - 1), blk);
    r.t0 = imul(k, blk, ic(k, R));
    r.b = e2(k, CG_IDIV, bh, ic(k, heads));
    r.h = e2(k, CG_IMOD, bh, ic(k, heads));
    bool whole = s->T % R == 0;
    for (int64_t i = 0; i < R; i++) {
        int t = iadd(k, r.t0, ic(k, i));
        r.t[i] = whole ? t : e2(k, CG_IMIN, t, ic(k, s->T - 1));
    }
    int end = iadd(k, r.t0, ic(k, R));
    r.end = whole ? end : e2(k, CG_IMIN, end, ic(k, s->T));
    return r;
}

/* `len` when row i of the block exists, else 0 */
static int live(CgKernel *k, const RowBlock *r, int64_t i, int64_t len)
{
    if (r->T % r->R == 0) return ic(k, len);
    int left = e2(k, CG_ISUB, ic(k, r->T), iadd(k, r->t0, ic(k, i)));
    int one = e2(k, CG_IMIN, e2(k, CG_IMAX, left, ic(k, 0)), ic(k, 1));
    return imul(k, one, ic(k, len));
}

/* D values buf[base + d], as separate values: the score loops use them as constants */
static int *load_row(Lower *L, CgKernel *k, int buf, int base, int64_t D)
{
    int *v = arena_alloc(L->p->arena, sizeof *v * (size_t)D);
    for (int64_t d = 0; d < D; d++) v[d] = ld(k, buf, iadd(k, base, ic(k, d)));
    return v;
}

/* The element (b, j, g, 0) of k or v: the base of key j without k's or v's column offset. */
static int kv_row(CgKernel *k, const AttnShape *s, int b, int g, int j)
{
    return iadd(k, imul(k, iadd(k, imul(k, b, ic(k, s->T)), j), ic(k, s->kvstride)),
                imul(k, g, ic(k, s->D)));
}

/* Opens a sequential loop over the blocks [b0, b1) of KEY_BLOCK keys and a row loop over a
 * block's keys, and returns the key; two ends close them. The row loop's trip count is the
 * constant KEY_BLOCK, so LLVM vectorizes it whole, with no scalar remainder. */
static int open_blocks(CgKernel *k, int b0, int b1)
{
    int jb = seq_loop(k, b0, b1);
    int lo = imul(k, jb, ic(k, KEY_BLOCK));
    return row_loop(k, lo, iadd(k, lo, ic(k, KEY_BLOCK)));
}

/* out[i] = sum over d of x[i][d] tb[base + d Tp + j] for the R rows, inside a loop over j:
 * dot products against column j of a transposed (D, Tp) block, unrolled over d so that the
 * sums stay in registers, and each element loaded once for all R rows. */
static void dots(CgKernel *k, int64_t R, int **x, int tb, int base, int j, int64_t D,
                 int64_t Tp, int *out)
{
    int at = iadd(k, base, j);
    for (int64_t d = 0; d < D; d++) {
        int y = ld(k, tb, iadd(k, at, ic(k, d * Tp)));
        for (int64_t i = 0; i < R; i++)
            out[i] = d ? e3(k, CG_FMA, x[i][d], y, out[i]) : fmul(k, x[i][d], y);
    }
}

/* acc[i][d] += w[i] buf[base + d] for the R rows: one row of v (or k, q, dy) loaded once for
 * all R rows (the loop is over d, vectorized; the caller's loop over keys is sequential) */
static void accumulate(CgKernel *k, int64_t R, const int *acc, const int *w, int buf, int base,
                       int64_t D)
{
    int d = row_loop(k, ic(k, 0), ic(k, D));
    int y = ld(k, buf, iadd(k, base, d));
    for (int64_t i = 0; i < R; i++) lset(k, acc[i], d, e3(k, CG_FMA, w[i], y, lget(k, acc[i], d)));
    end(k);
}

/* acc[i] = sum over the block's keys j of p[i][j] times kv head g's row j (at column off of
 * buf: v in the forward's P V, k in dq's dS K), for the R rows of r, G rows at a time: locals
 * of s->D floats that the caller reads and stores. */
static void weighted_kv_rows(CgKernel *k, const AttnShape *s, const RowBlock *r, int g, int64_t G,
                             const int *p, int buf, int64_t off, int *acc)
{
    int w[ATTN_ROWS];
    for (int64_t i = 0; i < r->R; i++) acc[i] = cg_local(k, s->D, 0.0);
    for (int64_t i0 = 0; i0 < r->R; i0 += G) {
        int j = seq_loop(k, ic(k, 0), r->end);
        for (int64_t i = i0; i < i0 + G; i++) w[i] = lget(k, p[i], j);
        accumulate(k, G, acc + i0, w + i0, buf, iadd(k, kv_row(k, s, r->b, g, j), ic(k, off)), s->D);
        end(k);
    }
}

/* m[i] = the max of sc[i][j] over the keys j of `blocks` KEY_BLOCKs: fmaxf into KEY_BLOCK
 * lanes, then over the lanes. An elementwise max vectorizes; a max reduction over the keys
 * would not (LLVM 14 vectorizes maxnum reductions only under no-NaNs flags, which its C API
 * cannot set), and it would keep the score loop around it scalar too. */
static void row_max(CgKernel *k, int64_t R, const int *sc, int blocks, int *m)
{
    int lane[ATTN_ROWS];
    for (int64_t i = 0; i < R; i++) lane[i] = cg_local(k, KEY_BLOCK, -INFINITY);
    int jb = seq_loop(k, ic(k, 0), blocks);
    int base = imul(k, jb, ic(k, KEY_BLOCK));
    int jj = row_loop(k, ic(k, 0), ic(k, KEY_BLOCK));
    for (int64_t i = 0; i < R; i++)
        lset(k, lane[i], jj, e2(k, CG_FMAX, lget(k, lane[i], jj), lget(k, sc[i], iadd(k, base, jj))));
    end(k);
    end(k);
    jj = row_loop(k, ic(k, 0), ic(k, KEY_BLOCK));
    for (int64_t i = 0; i < R; i++) m[i] = reduce_max(k, lget(k, lane[i], jj));
    end(k);
}

/* The unnormalized softmax of R rows of masked scores, in place: m_i = max_j p[i][j], then
 * p[i][j] = exp(p[i][j] - m_i) over the blocks, l_i = sum_j p[i][j] and, where dp is given,
 * dsum_i = sum_j p[i][j] dp[i][j] (the backward's dy . o before normalizing). The sums go into
 * KEY_BLOCK lanes, added up once after the blocks: a sum per block was a horizontal reduction
 * of a vector for every row and block (a fifth of the dq kernel's time in shuffles). */
static void exp_rows(CgKernel *k, int64_t R, const int *p, int blocks, const int *dp, int *m, int *l,
                     int *dsum)
{
    int sum[ATTN_ROWS], sum2[ATTN_ROWS];
    row_max(k, R, p, blocks, m);
    for (int64_t i = 0; i < R; i++) {
        sum[i] = cg_local(k, KEY_BLOCK, 0.0);
        if (dp) sum2[i] = cg_local(k, KEY_BLOCK, 0.0);
    }
    int base = imul(k, seq_loop(k, ic(k, 0), blocks), ic(k, KEY_BLOCK));
    int jj = row_loop(k, ic(k, 0), ic(k, KEY_BLOCK));
    int j = iadd(k, base, jj);
    for (int64_t i = 0; i < R; i++) {
        int e = e1(k, CG_EXP, fsub(k, lget(k, p[i], j), m[i]));
        lset(k, p[i], j, e);
        lset(k, sum[i], jj, fadd(k, lget(k, sum[i], jj), e));
        if (dp) lset(k, sum2[i], jj, fadd(k, lget(k, sum2[i], jj), fmul(k, e, lget(k, dp[i], j))));
    }
    end(k);
    end(k);
    jj = row_loop(k, ic(k, 0), ic(k, KEY_BLOCK));
    for (int64_t i = 0; i < R; i++) {
        l[i] = reduce_sum(k, lget(k, sum[i], jj));
        if (dp) dsum[i] = reduce_sum(k, lget(k, sum2[i], jj));
    }
    end(k);
}

/* causal softmax(q k^T * scale) v: k transposed per kv head, then one item per block of R
 * query rows of a head (the top of the file says why blocks):
 *   scores   s_ij = scale q_i . k_j for the keys of the block's whole KEY_BLOCKs, j past row
 *            i set to -inf (their exp is exactly 0), and each row's max;
 *   softmax  p_ij = exp(s_ij - m_i) and l_i = sum_j p_ij;
 *   output   sum_j p_ij v_j / l_i, keys up to the block's last row, each v_j loaded once. */
void lower_attention(Lower *L, Node *n)
{
    AttnShape s = attn_shape(n, 0);
    int64_t R = rows_per_item(s.Tp + s.D + 2 * KEY_BLOCK), G = rows_per_pass(R, s.D);
    int kt = transpose_heads(L, n, s.k, "kt", &s, s.Hkv, s.koff, s.kvstride);
    int64_t ktn = s.B * s.Hkv * s.D * s.Tp;
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_BLOCK, s.B * s.H * ((s.T + R - 1) / R), R * (s.T / 2 + KEY_BLOCK) * (2 * s.D + 20));
    int scale = fc(k, s.scale), ninf = fc(k, -INFINITY);
    body(k);
    RowBlock r = row_block(k, &s, item(k), s.H, R, true);
    int g = e2(k, CG_IDIV, r.h, ic(k, s.group));
    int qb = cg_buf_tensor(k, s.q, true, false), vb = cg_buf_tensor(k, s.v, true, false);
    int ktb = cg_buf_scratch(k, kt, ktn, true, false);
    int zero = ic(k, 0);
    int blocks = e2(k, CG_IDIV, iadd(k, r.end, ic(k, KEY_BLOCK - 1)), ic(k, KEY_BLOCK));
    int kbase = imul(k, iadd(k, imul(k, r.b, ic(k, s.Hkv)), g), ic(k, s.D * s.Tp));
    int *q[ATTN_ROWS], sc[ATTN_ROWS], m[ATTN_ROWS], l[ATTN_ROWS];
    int row[ATTN_ROWS], acc[ATTN_ROWS], dot[ATTN_ROWS];
    for (int64_t i = 0; i < R; i++) {
        row[i] = iadd(k, imul(k, r.b, ic(k, s.T)), r.t[i]);
        int base = iadd(k, imul(k, row[i], ic(k, s.qstride)), ic(k, s.qoff));
        q[i] = load_row(L, k, qb, iadd(k, base, imul(k, r.h, ic(k, s.D))), s.D);
        sc[i] = cg_local(k, s.Tp, 0.0);
    }
    int j = open_blocks(k, zero, blocks);
    dots(k, R, q, ktb, kbase, j, s.D, s.Tp, dot);
    for (int64_t i = 0; i < R; i++) {
        int v = select_of(k, ilt(k, r.t[i], j), ninf, fmul(k, dot[i], scale));
        lset(k, sc[i], j, v);
    }
    end(k);
    end(k);
    exp_rows(k, R, sc, blocks, NULL, m, l, NULL);
    weighted_kv_rows(k, &s, &r, g, G, sc, vb, s.voff, acc);
    for (int64_t i = 0; i < R; i++) {
        int d = row_loop(k, zero, live(k, &r, i, s.D));
        int col = iadd(k, imul(k, r.h, ic(k, s.D)), d);
        At at = {.idx = iadd(k, imul(k, row[i], ic(k, s.H * s.D)), col), .row = row[i], .col = col,
                 .cols = s.H * s.D};
        emit_out(L, k, n, fdiv(k, lget(k, acc[i], d), l[i]), at);
        end(k);
    }
}

/* The backward recomputes the probabilities from q and k (the IR keeps no softmax), after
 * transposing k, v, q and dy per head, in two kernels of row blocks like the forward's:
 *   dq     per block of R query rows i: s_ij and dp_ij = dy_i . v_j in one pass over the keys
 *          (masked as in the forward), p_ij = exp(s_ij - m_i) / l_i, D_i = sum_j p_ij dp_ij,
 *          ds_ij = p_ij (dp_ij - D_i) scale, dq_i = sum_j ds_ij k_j; lse_i = m_i + log l_i
 *          and D_i kept for
 *   dk dv  per block of R key rows j of a kv head: over the query heads of its kv head and the
 *          query rows t >= j (whole KEY_BLOCKs from the block's first row, t < j or t >= T
 *          set to 0), p_jt = exp(s_jt - lse_t), ds_jt = p_jt (dp_jt - D_t) scale,
 *          dk_j = sum_t ds_jt q_t, dv_j = sum_t p_jt dy_t
 * and writes dq | dk | dv into the packed result. */
void lower_attention_bwd(Lower *L, Node *n)
{
    AttnShape s = attn_shape(n, 1);
    Node *dyn = n->in[0];
    int64_t rows = s.B * s.H * s.T, Y = (s.H + 2 * s.Hkv) * s.D;
    int64_t ktn = s.B * s.Hkv * s.D * s.Tp, qtn = s.B * s.H * s.D * s.Tp;
    int kt = transpose_heads(L, n, s.k, "kt", &s, s.Hkv, s.koff, s.kvstride);
    int vt = transpose_heads(L, n, s.v, "vt", &s, s.Hkv, s.voff, s.kvstride);
    int qt = transpose_heads(L, n, s.q, "qt", &s, s.H, s.qoff, s.qstride);
    int dyt = transpose_heads(L, n, dyn, "dyt", &s, s.H, 0, s.H * s.D);
    int lse_s = cg_scratch_new(L->p, rows), dt_s = cg_scratch_new(L->p, rows);
    int *x[ATTN_ROWS], *y[ATTN_ROWS], p[ATTN_ROWS], dp[ATTN_ROWS];
    int m[ATTN_ROWS], l[ATTN_ROWS], dsum[ATTN_ROWS], inv[ATTN_ROWS];
    int row[ATTN_ROWS], acc[ATTN_ROWS], acc2[ATTN_ROWS], w[ATTN_ROWS], w2[ATTN_ROWS];
    int dot[ATTN_ROWS], dot2[ATTN_ROWS];

    /* dq, with each row's lse and D */
    int64_t R = rows_per_item(2 * s.Tp + s.D + 3 * KEY_BLOCK), G = rows_per_pass(R, s.D);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, "dq");
    shape(k, CG_PAR_BLOCK, s.B * s.H * ((s.T + R - 1) / R), R * (s.T / 2 + KEY_BLOCK) * (3 * s.D + 30));
    int scale = fc(k, s.scale), ninf = fc(k, -INFINITY);
    body(k);
    RowBlock r = row_block(k, &s, item(k), s.H, R, true);
    int g = e2(k, CG_IDIV, r.h, ic(k, s.group));
    int qb = cg_buf_tensor(k, s.q, true, false), kb = cg_buf_tensor(k, s.k, true, false);
    int dyb = cg_buf_tensor(k, dyn, true, false), yb = cg_buf_tensor(k, n, false, true);
    int ktb = cg_buf_scratch(k, kt, ktn, true, false), vtb = cg_buf_scratch(k, vt, ktn, true, false);
    int lb = cg_buf_scratch(k, lse_s, rows, false, true), db = cg_buf_scratch(k, dt_s, rows, false, true);
    int zero = ic(k, 0);
    int blocks = e2(k, CG_IDIV, iadd(k, r.end, ic(k, KEY_BLOCK - 1)), ic(k, KEY_BLOCK));
    int kbase = imul(k, iadd(k, imul(k, r.b, ic(k, s.Hkv)), g), ic(k, s.D * s.Tp));
    int hd = imul(k, r.h, ic(k, s.D));
    for (int64_t i = 0; i < R; i++) {
        row[i] = iadd(k, imul(k, r.b, ic(k, s.T)), r.t[i]);
        int qrow = iadd(k, imul(k, row[i], ic(k, s.qstride)), ic(k, s.qoff));
        x[i] = load_row(L, k, qb, iadd(k, qrow, hd), s.D);
        y[i] = load_row(L, k, dyb, iadd(k, imul(k, row[i], ic(k, s.H * s.D)), hd), s.D);
        p[i] = cg_local(k, s.Tp, 0.0);
        dp[i] = cg_local(k, s.Tp, 0.0);
    }
    int j = open_blocks(k, zero, blocks);
    dots(k, R, x, ktb, kbase, j, s.D, s.Tp, dot);
    dots(k, R, y, vtb, kbase, j, s.D, s.Tp, dot2);
    for (int64_t i = 0; i < R; i++) {
        int v = select_of(k, ilt(k, r.t[i], j), ninf, fmul(k, dot[i], scale));
        lset(k, p[i], j, v);
        lset(k, dp[i], j, dot2[i]);
    }
    end(k);
    end(k);
    exp_rows(k, R, p, blocks, dp, m, l, dsum);
    for (int64_t i = 0; i < R; i++) {
        inv[i] = fdiv(k, fc(k, 1.0f), l[i]);
        dsum[i] = fmul(k, dsum[i], inv[i]);
    }
    j = open_blocks(k, zero, blocks);
    for (int64_t i = 0; i < R; i++) {
        int pj = fmul(k, lget(k, p[i], j), inv[i]);
        lset(k, dp[i], j, fmul(k, fmul(k, pj, fsub(k, lget(k, dp[i], j), dsum[i])), scale));
    }
    end(k);
    end(k);
    weighted_kv_rows(k, &s, &r, g, G, dp, kb, s.koff, acc);
    int sbase = imul(k, iadd(k, imul(k, r.b, ic(k, s.H)), r.h), ic(k, s.T));
    for (int64_t i = 0; i < R; i++) {
        int d = row_loop(k, zero, live(k, &r, i, s.D));
        int col = iadd(k, hd, d);
        cg_store(k, yb, iadd(k, imul(k, row[i], ic(k, Y)), col), lget(k, acc[i], d), row[i], col);
        end(k);
        int one = row_loop(k, zero, live(k, &r, i, 1));
        int at = iadd(k, iadd(k, sbase, r.t[i]), one);
        cg_store(k, lb, at, fadd(k, m[i], e1(k, CG_LOG, l[i])), NONE, NONE);
        cg_store(k, db, at, dsum[i], NONE, NONE);
        end(k);
    }

    /* dk, dv: one item per block of R key rows of a kv head */
    R = rows_per_item(2 * s.Tp + 2 * s.D);
    G = rows_per_pass(R, s.D);
    k = kernel(L, CG_KERNEL_LOOP, n, "dkv");
    shape(k, CG_PAR_BLOCK, s.B * s.Hkv * ((s.T + R - 1) / R),
          R * s.group * (s.T / 2 + KEY_BLOCK) * (4 * s.D + 40));
    scale = fc(k, s.scale);
    int fzero = fc(k, 0.0f);
    body(k);
    r = row_block(k, &s, item(k), s.Hkv, R, false);
    g = r.h;
    qb = cg_buf_tensor(k, s.q, true, false);
    kb = cg_buf_tensor(k, s.k, true, false);
    int vb = cg_buf_tensor(k, s.v, true, false);
    dyb = cg_buf_tensor(k, dyn, true, false);
    yb = cg_buf_tensor(k, n, false, true);
    int qtb = cg_buf_scratch(k, qt, qtn, true, false), dytb = cg_buf_scratch(k, dyt, qtn, true, false);
    lb = cg_buf_scratch(k, lse_s, rows, true, false);
    db = cg_buf_scratch(k, dt_s, rows, true, false);
    zero = ic(k, 0);
    int tend = ic(k, s.T);
    int first = e2(k, CG_IDIV, r.t0, ic(k, KEY_BLOCK)), last = ic(k, s.Tp / KEY_BLOCK);
    for (int64_t i = 0; i < R; i++) {
        int kv = kv_row(k, &s, r.b, g, r.t[i]);
        x[i] = load_row(L, k, kb, iadd(k, kv, ic(k, s.koff)), s.D);
        y[i] = load_row(L, k, vb, iadd(k, kv, ic(k, s.voff)), s.D);
        acc[i] = cg_local(k, s.D, 0.0);
        acc2[i] = cg_local(k, s.D, 0.0);
        p[i] = cg_local(k, s.Tp, 0.0);
        dp[i] = cg_local(k, s.Tp, 0.0);
    }
    int hh = seq_loop(k, zero, ic(k, s.group));
    int h = iadd(k, imul(k, g, ic(k, s.group)), hh);
    int bh = iadd(k, imul(k, r.b, ic(k, s.H)), h);
    int tbase = imul(k, bh, ic(k, s.D * s.Tp));     /* this head's (D, Tp) block */
    sbase = imul(k, bh, ic(k, s.T));                /* its rows of lse and D */
    int t = open_blocks(k, first, last);
    dots(k, R, x, qtb, tbase, t, s.D, s.Tp, dot);
    dots(k, R, y, dytb, tbase, t, s.D, s.Tp, dot2);
    int inside = s.Tp > s.T ? ilt(k, t, tend) : NONE;
    int tx = s.Tp > s.T ? e2(k, CG_IMIN, t, ic(k, s.T - 1)) : t;
    int lse = ld(k, lb, iadd(k, sbase, tx)), dt = ld(k, db, iadd(k, sbase, tx));
    for (int64_t i = 0; i < R; i++) {
        int pt = e1(k, CG_EXP, fsub(k, fmul(k, dot[i], scale), lse));
        int dst = fmul(k, fmul(k, pt, fsub(k, dot2[i], dt)), scale);
        int keep = e1(k, CG_NOT, ilt(k, t, r.t[i]));
        if (inside != NONE) keep = both(k, keep, inside);
        lset(k, p[i], t, select_of(k, keep, pt, fzero));
        lset(k, dp[i], t, select_of(k, keep, dst, fzero));
    }
    end(k);
    end(k);
    hd = imul(k, h, ic(k, s.D));
    for (int64_t i0 = 0; i0 < R; i0 += G) {
        t = seq_loop(k, r.t0, tend);
        int trow = iadd(k, imul(k, r.b, ic(k, s.T)), t);
        for (int64_t i = i0; i < i0 + G; i++) w[i] = lget(k, dp[i], t);
        int qrow = iadd(k, imul(k, trow, ic(k, s.qstride)), ic(k, s.qoff));
        accumulate(k, G, acc + i0, w + i0, qb, iadd(k, qrow, hd), s.D);
        end(k);
    }
    for (int64_t i0 = 0; i0 < R; i0 += G) {
        t = seq_loop(k, r.t0, tend);
        int trow = iadd(k, imul(k, r.b, ic(k, s.T)), t);
        for (int64_t i = i0; i < i0 + G; i++) w2[i] = lget(k, p[i], t);
        accumulate(k, G, acc2 + i0, w2 + i0, dyb, iadd(k, imul(k, trow, ic(k, s.H * s.D)), hd), s.D);
        end(k);
    }
    end(k);
    for (int64_t i = 0; i < R; i++) {
        int yrow = iadd(k, imul(k, r.b, ic(k, s.T)), r.t[i]);
        int d = row_loop(k, zero, live(k, &r, i, s.D));
        int col = iadd(k, ic(k, s.H * s.D), iadd(k, imul(k, g, ic(k, s.D)), d));
        cg_store(k, yb, iadd(k, imul(k, yrow, ic(k, Y)), col), lget(k, acc[i], d), yrow, col);
        int col2 = iadd(k, col, ic(k, s.Hkv * s.D));
        cg_store(k, yb, iadd(k, imul(k, yrow, ic(k, Y)), col2), lget(k, acc2[i], d), yrow, col2);
        end(k);
    }
}
