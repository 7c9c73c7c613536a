/* lower_kernels.c — graph nodes become kernels.
 *
 * Every node that computes something becomes one or a few kernels of the kernel IR
 * (codegen.h), in schedule order, so that an executor running the kernels of a phase in order
 * runs the step the graph describes. The shapes of the kernels follow the reference executor's
 * split of the work, which is also how a GPU splits it:
 *   elementwise ops   one item per element (or per row when an operand broadcasts, so that the
 *                     broadcast index is the column, not a division per element);
 *   row ops           one item per row (norms, softmax, cross entropy, embedding, rope), the
 *                     columns in CG_LOOP_ROW loops with their sums and maxima as CG_REDUCE;
 *   column sums       one item per block of 64 columns, rows in a sequential loop, summed in
 *                     chunks of 64 rows (bias and norm-weight gradients); with four chunks
 *                     or more, the chunks' sums first, one item per (chunk, block), then
 *                     added in order per block;
 *   whole-tensor      partial results per chunk into a scratch array, then one item that
 *   reductions        combines them in order (squared norms, amax, the mean loss);
 *   attention         k (and for the backward v, q, dy) transposed per head into f32
 *                     scratch padded with zeros to whole blocks of 16 keys, then one item
 *                     per block of up to 8 query rows of a head: scores against the
 *                     transposed keys in whole blocks (keys past a row masked to -inf), each
 *                     key loaded once for all the rows; softmax; the weighted sum of v, each
 *                     v row loaded once for all the rows. The backward in two such kernels:
 *                     dq per block of query rows (keeping each row's log-sum-exp and dy.o),
 *                     dk and dv per block of key rows. One row per item, over keys 0..t,
 *                     left vectorized loops of variable length with scalar remainders and
 *                     loaded every key once per row: blocks run 2.4x to 2.9x faster (gpt2_tiny
 *                     and GPT-2 d12 at T = 128, one thread);
 *   GEMM              a call (CG_KERNEL_GEMM), with f32 conversions around it when asked.
 *
 * Fusion (fuse.c) is applied here: a group is lowered from its head (the one non-
 * elementwise node, if any), and wherever the head's kernel has an output element, the
 * group's elementwise nodes compute the root's element from it inline (emit_out, value_at);
 * a group of elementwise nodes alone is one elementwise kernel for the root.
 *
 * Numerics follow the reference executor op by op (the same formulas, in f32; the reference
 * accumulates reductions in f64, which is where the stated tolerances come from). Loads and
 * stores go through each tensor's format; AdamW reads and writes coded optimizer states
 * through their codes and side values and does the codecs' math itself. A node that touches
 * a format no kernel handles (a coded state read by anything but AdamW) becomes a
 * CG_KERNEL_REF kernel: the reference executor runs it. */
#include "codegen.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NONE CG_NONE

enum { COL_BLOCK = 64, ROW_CHUNK = 64, REDUCE_CHUNK = 4096, MEMO_MAX = 64 };

/* attention: keys (or queries) in blocks of KEY_BLOCK; up to ATTN_ROWS rows per item, with
 * at most ATTN_LOCALS f32 of locals per item, summed into at most ATTN_ACC f32 per pass */
enum { KEY_BLOCK = 16, ATTN_ROWS = 8, ATTN_ACC = 256, ATTN_LOCALS = 10240 };

static const float GELU_C = 0.7978845608028654f;   /* sqrt(2 / pi), as the reference */
static const float GELU_A = 0.044715f;

typedef struct {
    const Graph *g;
    CgProgram *p;
    const CgLowerOptions *o;
    int *group;             /* node index -> root index, -1 none */
    /* the group being lowered */
    int root;
    Node *head;
    Node *memo_node[MEMO_MAX];
    int memo_val[MEMO_MAX];
    int n_memo;
    int transient;          /* the scratch that values passed from one kernel to the next share:
                               GEMMs' C, column sums' chunk sums (NONE: none yet) */
    bool *read_through;     /* per node: a TRANSPOSE its GEMMs read through (no kernel) */
} Lower;

/* A position in the output view of the kernel: flat index, and row and column when known. */
typedef struct {
    int idx, row, col;
    int64_t cols;
} At;

static bool format_is_plain(const Format *f)
{
    return f->scaling == SCALE_NONE && f->codec == CODEC_PLAIN;
}

/* ---------------------------------------------------------------- emission shorthands */

static int e1(CgKernel *k, CgOp op, int a) { return cg_emit(k, op, a, NONE, NONE, NONE); }
static int e2(CgKernel *k, CgOp op, int a, int b) { return cg_emit(k, op, a, b, NONE, NONE); }
static int e3(CgKernel *k, CgOp op, int a, int b, int c) { return cg_emit(k, op, a, b, c, NONE); }
static int fc(CgKernel *k, double f) { return cg_fconst(k, f); }
static int ic(CgKernel *k, int64_t i) { return cg_iconst(k, i); }
static void body(CgKernel *k) { e1(k, CG_BODY, NONE); }
static int item(CgKernel *k) { return e1(k, CG_ITEM, NONE); }
static void end(CgKernel *k) { e1(k, CG_END, NONE); }
static int row_loop(CgKernel *k, int lo, int hi) { return cg_loop(k, CG_LOOP_ROW, lo, hi); }
static int seq_loop(CgKernel *k, int lo, int hi) { return cg_loop(k, CG_LOOP_SEQ, lo, hi); }
static int iadd(CgKernel *k, int a, int b) { return e2(k, CG_IADD, a, b); }
static int imul(CgKernel *k, int a, int b) { return e2(k, CG_IMUL, a, b); }
static int fadd(CgKernel *k, int a, int b) { return e2(k, CG_FADD, a, b); }
static int fsub(CgKernel *k, int a, int b) { return e2(k, CG_FSUB, a, b); }
static int fmul(CgKernel *k, int a, int b) { return e2(k, CG_FMUL, a, b); }
static int fdiv(CgKernel *k, int a, int b) { return e2(k, CG_FDIV, a, b); }
static int lget(CgKernel *k, int l, int i) { return e2(k, CG_LGET, l, i); }
static void lset(CgKernel *k, int l, int i, int v) { e3(k, CG_LSET, l, i, v); }
static int ld(CgKernel *k, int buf, int idx) { return cg_load(k, buf, idx, NONE, NONE); }
static int flt(CgKernel *k, int a, int b) { return e2(k, CG_FLT, a, b); }
static int fabs_of(CgKernel *k, int a) { return e1(k, CG_FABS, a); }
static int fneg(CgKernel *k, int a) { return e1(k, CG_FNEG, a); }
static int select_of(CgKernel *k, int c, int a, int b) { return e3(k, CG_SELECT, c, a, b); }
static int both(CgKernel *k, int a, int b) { return e2(k, CG_AND, a, b); }
static int ilt(CgKernel *k, int a, int b) { return e2(k, CG_ILT, a, b); }

static int64_t rows_of(const Tensor *t)
{
    int64_t r = 1;
    for (int i = 0; i + 1 < t->rank; i++) r *= t->dims[i];
    return r;
}

static int64_t cols_of(const Tensor *t) { return t->rank ? t->dims[t->rank - 1] : 1; }

static const char *node_label(const Lower *L, const Node *n)
{
    if (n->t.name) return n->t.name;
    return arena_printf(L->p->arena, "%s.%d", ir_op_info(n->op)->text, n->id);
}

static CgKernel *kernel(Lower *L, CgKernelKind kind, const Node *n, const char *suffix)
{
    const char *name = node_label(L, n);
    if (suffix) name = arena_printf(L->p->arena, "%s:%s", name, suffix);
    return cg_kernel_new(L->p, kind, name, n->phase);
}

/* Rows of work for `items` items of about `cost` scalar operations each. */
static void shape(CgKernel *k, CgParallel par, int64_t items, int64_t cost)
{
    k->par = par;
    k->items = items;
    k->cost = cost > 0 ? cost : 1;
}

/* The tensor a node's value is stored in: in-place ops write their first operand. */
static Node *store_target(Node *n)
{
    return n->op == OP_ACCUMULATE || n->op == OP_ASSIGN ? n->in[0] : n;
}

/* Row and column hints for a buffer whose view is the kernel's view (else none). */
static void hints(CgKernel *k, int buf, At at, int *row, int *col)
{
    const CgBuf *b = &k->bufs[buf];
    bool same = at.row != NONE && b->cols == at.cols;
    *row = same ? at.row : NONE;
    *col = same ? at.col : NONE;
}

static int load_at(CgKernel *k, int buf, At at)
{
    int r, c;
    hints(k, buf, at, &r, &c);
    return cg_load(k, buf, at.idx, r, c);
}

static void store_at(CgKernel *k, int buf, At at, int v)
{
    int r, c;
    hints(k, buf, at, &r, &c);
    cg_store(k, buf, at.idx, v, r, c);
}

/* The index of a broadcast operand of nb elements at position `at` (nb divides the numel). */
static int bcast_index(CgKernel *k, int64_t nb, At at)
{
    if (nb == 1) return ic(k, 0);
    if (at.row != NONE) {
        if (nb == at.cols) return at.col;
        if (at.cols % nb == 0) return e2(k, CG_IMOD, at.col, ic(k, nb));
        if (nb % at.cols == 0)
            return iadd(k, imul(k, e2(k, CG_IMOD, at.row, ic(k, nb / at.cols)), ic(k, at.cols)), at.col);
    }
    return e2(k, CG_IMOD, at.idx, ic(k, nb));
}

/* ---------------------------------------------------------------- elementwise values */

static int value_at(Lower *L, CgKernel *k, Node *n, At at);

static bool in_group(const Lower *L, const Node *n)
{
    return n->index >= 0 && n->index < L->g->n_nodes && L->g->nodes[n->index] == n &&
           L->group[n->index] == L->root;
}

/* Input j of an elementwise node at `at`: inline when it is the same size, else broadcast. */
static int operand(Lower *L, CgKernel *k, Node *n, int j, At at)
{
    Node *x = n->in[j];
    int64_t nb = ir_numel(&x->t), na = ir_numel(&n->t);
    if (nb == na) return value_at(L, k, x, at);
    IR_ASSERT(!in_group(L, x));
    int buf = cg_buf_tensor(k, x, true, false);
    return ld(k, buf, bcast_index(k, nb, at));
}

static int elementwise_math(Lower *L, CgKernel *k, Node *n, At at)
{
    switch (n->op) {
    case OP_ADD: return fadd(k, operand(L, k, n, 0, at), operand(L, k, n, 1, at));
    case OP_SUB: return fsub(k, operand(L, k, n, 0, at), operand(L, k, n, 1, at));
    case OP_MUL: return fmul(k, operand(L, k, n, 0, at), operand(L, k, n, 1, at));
    case OP_SCALE: return fmul(k, fc(k, (float)IR_FATTR(n, SCALE, alpha)), operand(L, k, n, 0, at));
    case OP_ADD_N: {
        int s = operand(L, k, n, 0, at);
        for (int j = 1; j < n->n_in; j++) s = fadd(k, s, operand(L, k, n, j, at));
        return s;
    }
    case OP_GELU: {
        /* 0.5f * v * (1.0f + tanhf(GELU_C * (v + GELU_A * v * v * v))), in this order */
        int v = operand(L, k, n, 0, at);
        int cube = fmul(k, fmul(k, fmul(k, fc(k, GELU_A), v), v), v);
        int t = e1(k, CG_TANH, fmul(k, fc(k, GELU_C), fadd(k, v, cube)));
        return fmul(k, fmul(k, fc(k, 0.5f), v), fadd(k, fc(k, 1.0f), t));
    }
    case OP_GELU_BWD: {
        int dy = operand(L, k, n, 0, at), v = operand(L, k, n, 1, at);
        int cube = fmul(k, fmul(k, fmul(k, fc(k, GELU_A), v), v), v);
        int t = e1(k, CG_TANH, fmul(k, fc(k, GELU_C), fadd(k, v, cube)));
        int du = fmul(k, fc(k, GELU_C),
                      fadd(k, fc(k, 1.0f), fmul(k, fmul(k, fc(k, 3.0f * GELU_A), v), v)));
        int left = fmul(k, fc(k, 0.5f), fadd(k, fc(k, 1.0f), t));
        int right = fmul(k, fmul(k, fmul(k, fc(k, 0.5f), v), fsub(k, fc(k, 1.0f), fmul(k, t, t))), du);
        return fmul(k, dy, fadd(k, left, right));
    }
    case OP_SILU: {
        int v = operand(L, k, n, 0, at);
        return fdiv(k, v, fadd(k, fc(k, 1.0f), e1(k, CG_EXP, e1(k, CG_FNEG, v))));
    }
    case OP_SILU_BWD: {
        int dy = operand(L, k, n, 0, at), v = operand(L, k, n, 1, at);
        int s = fdiv(k, fc(k, 1.0f), fadd(k, fc(k, 1.0f), e1(k, CG_EXP, e1(k, CG_FNEG, v))));
        int d = fadd(k, fc(k, 1.0f), fmul(k, v, fsub(k, fc(k, 1.0f), s)));
        return fmul(k, fmul(k, dy, s), d);
    }
    case OP_CAST: case OP_QUANTIZE: case OP_RESHAPE: return operand(L, k, n, 0, at);
    case OP_ACCUMULATE: {
        int acc = cg_buf_tensor(k, n->in[0], true, true);
        return fadd(k, load_at(k, acc, at), operand(L, k, n, 1, at));
    }
    default: IR_ASSERT(!"not an elementwise op");
    }
    return NONE;
}

/* The value of n at `at`: computed inline for members of the group being lowered (rounded to
 * n's format, as storing and reloading it would), loaded for everything else. */
static int value_at(Lower *L, CgKernel *k, Node *n, At at)
{
    for (int i = 0; i < L->n_memo; i++)
        if (L->memo_node[i] == n) return L->memo_val[i];
    int v;
    if (in_group(L, n) && n != L->head) {
        v = elementwise_math(L, k, n, at);
        if (n->index != L->root && !(n->t.fmt.elem == FMT_F32 && format_is_plain(&n->t.fmt))) {
            int buf = cg_buf_tensor(k, n, false, false);
            int r, c;
            hints(k, buf, at, &r, &c);
            v = cg_round(k, buf, at.idx, v, r, c);
        }
    } else {
        IR_ASSERT(n != L->head);   /* a head's value is set by emit_out */
        v = load_at(k, cg_buf_tensor(k, n, true, false), at);
    }
    IR_ASSERT(L->n_memo < MEMO_MAX);
    L->memo_node[L->n_memo] = n;
    L->memo_val[L->n_memo++] = v;
    return v;
}

/* A head has computed its value v at `at`: store it, or hand it to the group's elementwise
 * nodes and store the root's value instead. */
static void emit_out(Lower *L, CgKernel *k, Node *head, int v, At at)
{
    Node *root = L->g->nodes[L->root];
    L->n_memo = 0;
    if (root != head) {
        /* the consumers see the head's value as the plan stores it */
        if (!(head->t.fmt.elem == FMT_F32 && format_is_plain(&head->t.fmt))) {
            int hb = cg_buf_tensor(k, head, false, false), r, c;
            hints(k, hb, at, &r, &c);
            v = cg_round(k, hb, at.idx, v, r, c);
        }
        L->memo_node[0] = head;
        L->memo_val[0] = v;
        L->n_memo = 1;
        v = value_at(L, k, root, at);
    }
    int buf = cg_buf_tensor(k, store_target(root), root->op == OP_ACCUMULATE, true);
    store_at(k, buf, at, v);
    L->n_memo = 0;
}

/* A group of elementwise nodes alone (a root with inline producers, or one node). */
static void lower_elementwise(Lower *L, Node *root)
{
    int64_t n = ir_numel(&root->t), cols = cols_of(&root->t), rows = rows_of(&root->t);
    /* broadcasting anywhere in the group: one item per row, the operand index is the column */
    bool bcast = false;
    int members = 0;
    for (int i = 0; i <= L->root; i++) {
        Node *m = L->g->nodes[i];
        if (L->group[i] != L->root) continue;
        members++;
        for (int j = 0; j < m->n_in; j++)
            if (ir_numel(&m->in[j]->t) != ir_numel(&m->t) && !(m->op == OP_QUANTIZE && j == 1))
                bcast = true;
    }
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, root, NULL);
    body(k);
    At at = {.row = NONE, .col = NONE, .cols = cols};
    if (bcast && cols > 1) {
        shape(k, CG_PAR_BLOCK, rows, cols * 4 * members);
        at.row = item(k);
        at.col = row_loop(k, ic(k, 0), ic(k, cols));
        at.idx = iadd(k, imul(k, at.row, ic(k, cols)), at.col);
    } else {
        shape(k, CG_PAR_THREAD, n, 4 * members);
        at.idx = item(k);
    }
    L->n_memo = 0;
    int v = value_at(L, k, root, at);
    int buf = cg_buf_tensor(k, store_target(root), root->op == OP_ACCUMULATE, true);
    store_at(k, buf, at, v);
    if (bcast && cols > 1) end(k);
}

/* ---------------------------------------------------------------- rows: norms, softmax */

/* Opens the row loop of a row kernel: returns the column; *at gets the position. */
static int open_cols(CgKernel *k, int row, int64_t C, At *at)
{
    int c = row_loop(k, ic(k, 0), ic(k, C));
    *at = (At){.idx = iadd(k, imul(k, row, ic(k, C)), c), .row = row, .col = c, .cols = C};
    return c;
}

static int reduce_sum(CgKernel *k, int v) { return cg_reduce(k, CG_RED_SUM, v); }
static int reduce_max(CgKernel *k, int v) { return cg_reduce(k, CG_RED_MAX, v); }

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

static void lower_norm(Lower *L, Node *n)
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
static int transient_scratch(Lower *L, int64_t floats)
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

static void lower_sum_rows(Lower *L, Node *n)
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
static void lower_norm_w(Lower *L, Node *n)
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

static void lower_softmax(Lower *L, Node *n)
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

static void lower_embedding(Lower *L, Node *n)
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
static void lower_embedding_bwd(Lower *L, Node *n)
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

static void lower_cross_entropy(Lower *L, Node *n)
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
static int chunk_partials(Lower *L, Node *n, Node *x, bool square, int *chunks_out)
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
static CgKernel *combine_partials(Lower *L, Node *n, int part, int chunks, bool sum, int *v)
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

static void lower_sqnorm(Lower *L, Node *n)
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

static void lower_quant_scale(Lower *L, Node *n)
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
static void lower_amax_record(Lower *L, Node *n)
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

static void lower_delayed_scale(Lower *L, Node *n)
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
static void lower_slice(Lower *L, Node *n)
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
static void lower_transpose(Lower *L, Node *n)
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
static void lower_concat(Lower *L, Node *n)
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

static void lower_const(Lower *L, Node *n)
{
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, ir_numel(&n->t), 1);
    int v = fc(k, (float)IR_FATTR(n, CONST, value));
    body(k);
    cg_store(k, cg_buf_tensor(k, n, false, true), item(k), v, NONE, NONE);
}

static void lower_assign(Lower *L, Node *n)
{
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, ir_numel(&n->in[0]->t), 2);
    body(k);
    int i = item(k);
    int v = ld(k, cg_buf_tensor(k, n->in[1], true, false), i);
    cg_store(k, cg_buf_tensor(k, n->in[0], false, true), i, v, NONE, NONE);
}

/* ---------------------------------------------------------------- rope and attention */

/* Pairs (2i, 2i+1) of each head turn by p * theta^(-2i/D); the cos/sin table is computed here
 * in double, as the reference does, and rounded once to f32. */
static void lower_rope(Lower *L, Node *n)
{
    int64_t D = IR_IATTR(n, ROPE, head_dim), C = cols_of(&n->t), T = n->t.dims[n->t.rank - 2];
    int64_t R = rows_of(&n->t), half = D / 2;
    double sign = IR_IATTR(n, ROPE, inverse) ? -1.0 : 1.0, theta = IR_FATTR(n, ROPE, theta);
    float *cs = malloc(sizeof(float) * (size_t)(T * D > 0 ? T * D : 1));
    IR_ASSERT(cs);
    for (int64_t p = 0; p < T; p++)
        for (int64_t i = 0; i < half; i++) {
            double ang = (double)p * pow(theta, -2.0 * (double)i / (double)D);
            cs[(p * half + i) * 2] = (float)cos(ang);
            cs[(p * half + i) * 2 + 1] = (float)(sign * sin(ang));
        }
    int table = cg_const_new(L->p, cs, T * D);
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
static void lower_attention(Lower *L, Node *n)
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
static void lower_attention_bwd(Lower *L, Node *n)
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

/* ---------------------------------------------------------------- optimizer */

static void lower_clip_coef(Lower *L, Node *n)
{
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, 1, 10);
    body(k);
    double max_norm = IR_FATTR(n, CLIP_COEF, max_norm);
    int y = fc(k, 1.0f);
    if (max_norm > 0) {
        int norm = ld(k, cg_buf_tensor(k, n->in[0], true, false), ic(k, 0));
        y = e2(k, CG_FMIN, fc(k, 1.0f), fdiv(k, fc(k, (float)max_norm), fadd(k, norm, fc(k, 1e-6f))));
    }
    cg_store(k, cg_buf_tensor(k, n, false, true), ic(k, 0), y, NONE, NONE);
}

static void lower_grad_norm(Lower *L, Node *n)
{
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, 1, 2 * n->n_in);
    body(k);
    int s = fc(k, 0.0f);
    for (int j = 1; j < n->n_in; j++) {
        int64_t m = ir_numel(&n->in[j]->t);
        int xb = cg_buf_tensor(k, n->in[j], true, false);
        for (int64_t i = 0; i < m; i++) s = fadd(k, s, ld(k, xb, ic(k, i)));
    }
    int gs = ld(k, cg_buf_tensor(k, n->in[0], true, false), ic(k, 0));
    cg_store(k, cg_buf_tensor(k, n, false, true), ic(k, 0), fmul(k, e1(k, CG_SQRT, s), gs), NONE, NONE);
}

/* ---------------------------------------------------------------- AdamW
 *
 * ref_optim.c's update in f32: the step's scalars and bias corrections in the prologue, then
 * per element g, m, v, the weight. With plain states that is an elementwise kernel. At O2/O3
 * m and v are stored through the optimizer-state codecs of ir/codecs.c, whose groups share
 * side values (amax, the range-expansion exponent k) that depend on every new element of the
 * group, so the update is a block kernel: an item is a chunk of C consecutive elements (the
 * larger of the two states' group sizes, so that every group lies in one item) and runs
 *   1. a row loop over the chunk: decode m, v and the master, the AdamW step, store the
 *      weight (splitting a split master), zero the gradient, keep the new m and v in locals;
 *   2. per coded state and group: a row loop of reductions for the group's statistics, the
 *      side values, and a row loop that encodes and stores the codes.
 * It is the GPU library's ck_adamw_coded (a warp per 128 elements) in kernel-IR form.
 *
 * The codec formulas are codecs.c's, in f32 where codecs.c computes in f64: powers are
 * exp(k log y), and quotients like z/(2 - |z|) with z = q/127 are q/(254 - |q|). The
 * statistics that select a value (the group max, the smallest nonzero magnitude, the max of
 * sqrt(v)) are exact, so for the same new m and v the side values c, amax and p are bit for
 * bit the reference's and k = log(28672) / log(c/lo) is within an ulp or two; codes differ
 * only where the f32 and f64 values straddle a rounding point of the code, by one step. In a
 * real step the new m and v themselves differ from ref_adamw's f64 ones in their last bits,
 * most where m's two terms cancel; a group whose smallest element cancelled gets a slightly
 * different k and is encoded (and later decoded) with it. A split master decodes exactly in
 * f32 (its unit ulp(hi)/256 is a power of two made from hi's exponent bits), so it is
 * bit-identical wherever the f32 weight is. Non-finite values follow codecs.c: a group
 * holding a NaN keeps NaN as its max (an infinity: inf), codes of zero, and decodes to NaN.
 * tests/test_codegen.c states and checks the bounds. */

enum { A_PARAM, A_GRAD, A_M, A_V, A_LR, A_STEP, A_CLIP, A_GRAD_SCALE, A_MASTER };

/* codecs.c's range expansion: the group's range becomes e4m3's normal range 448 / 2^-6, and
 * k is capped at 16 */
#define EXPAND_RANGE 28672.0
#define EXPAND_K_MAX 16.0

/* An Adam moment as the update kernel sees it. */
typedef struct {
    Codec codec;            /* CODEC_PLAIN: loaded and stored through the tensor's format */
    int64_t group;          /* elements sharing side values; 1 when plain */
    int buf;                /* the tensor, or its codes */
    int side;               /* the side values (f32, codec_params_per_group per group) */
    int p0, p1;             /* the item's group's side values, when the group is the chunk */
    int local;              /* the chunk's new values, until they are encoded */
} Moment;

typedef struct {
    double b1, b2, eps, wd;
    int lr, gmul, bc1, bc2;     /* prologue values */
    int param, grad;
    int master;                 /* a plain master's tensor, a split master's codes, or NONE */
    bool split;
    int copy;                   /* the weights' FP8 copy for the next step, or NONE */
    Moment m, v;
} Adam;


/* signbit(x), -0 and NaNs with the sign set included */
static int sign_bit(CgKernel *k, int x) { return e2(k, CG_ILT, ic(k, 0x7FFFFFFF), e1(k, CG_FBITS, x)); }

/* x^y for x >= 0 (0 when x = 0, y > 0) */
static int power(CgKernel *k, int x, int y) { return e1(k, CG_EXP, fmul(k, y, e1(k, CG_LOG, x))); }

/* 0 < x < inf */
static int positive_finite(CgKernel *k, int x)
{
    return both(k, flt(k, fc(k, 0.0), x), flt(k, x, fc(k, INFINITY)));
}

/* 2^e for e in [-126, 127] */
static int pow2(CgKernel *k, int e)
{
    return e1(k, CG_BITSF, imul(k, iadd(k, e, ic(k, 127)), ic(k, 1 << 23)));
}

/* A split master's unit ulp(hi)/256 = 2^(b - 142) for the bf16 value hi, b its biased exponent
 * (1 for zero and subnormals): codecs.c's ldexpf(1, split_ulp_exp(hi) - 8). It runs from
 * 2^-141 to 2^113, so it is made as a product of two normal powers of two (exact, subnormal
 * at the bottom). */
static int split_unit(CgKernel *k, int hi)
{
    int b = e2(k, CG_IMOD, e2(k, CG_IDIV, e1(k, CG_FBITS, hi), ic(k, 1 << 23)), ic(k, 256));
    b = e2(k, CG_IMAX, b, ic(k, 1));
    int half = e2(k, CG_IDIV, b, ic(k, 2));
    int s = e2(k, CG_ISUB, half, ic(k, 71)), t = e2(k, CG_ISUB, e2(k, CG_ISUB, b, ic(k, 71)), half);
    return fmul(k, pow2(k, s), pow2(k, t));
}

static Moment moment_of(CgKernel *k, Node *x)
{
    Moment s = {.codec = x->t.fmt.codec, .group = 1, .side = NONE, .p0 = NONE, .p1 = NONE, .local = NONE};
    if (s.codec == CODEC_PLAIN) {
        s.buf = cg_buf_tensor(k, x, true, true);
        return s;
    }
    s.group = codec_group_size(s.codec);
    s.buf = cg_buf_codes(k, x, true, true);
    s.side = cg_buf_tensor(k, x->t.fmt.scale, true, true);
    return s;
}

/* Side value j of group gi. */
static int side_at(CgKernel *k, const Moment *s, int gi, int j)
{
    int64_t per = codec_params_per_group(s->codec);
    return ld(k, s->side, iadd(k, imul(k, gi, ic(k, per)), ic(k, j)));
}

/* Element i of a moment (codecs.c's *_decode); p0, p1 its group's side values. */
static int moment_decode(CgKernel *k, const Moment *s, int i, int p0, int p1)
{
    int q = ld(k, s->buf, i);
    switch (s->codec) {
    case CODEC_PLAIN: return q;
    case CODEC_EXPAND: {            /* sign(d) c (|d| / 448)^(1/k) */
        int y = fdiv(k, fabs_of(k, q), fc(k, 448.0));
        int a = fmul(k, p0, e1(k, CG_EXP, fdiv(k, e1(k, CG_LOG, y), p1)));
        return select_of(k, sign_bit(k, q), fneg(k, a), a);
    }
    case CODEC_COMPAND:             /* amax z / (2 - |z|), z = q/127 */
        return fmul(k, p0, fdiv(k, q, fsub(k, fc(k, 254.0), fabs_of(k, q))));
    case CODEC_SQRT: {              /* (p z / (2 - z))^2, z = q/255 */
        int r = fmul(k, fdiv(k, q, fsub(k, fc(k, 510.0), q)), p0);
        return fmul(k, r, r);
    }
    default: IR_ASSERT(!"moment_decode: not a moment codec");
    }
    return NONE;
}

/* Encodes the new values local[lo..hi) of a moment, group gi, into codes base + lo.. (codecs.c's
 * *_encode): the group's statistics, its side values, its codes. */
static void moment_encode(CgKernel *k, const Moment *s, int base, int lo, int hi, int gi)
{
    int zero = fc(k, 0.0);
    bool sq = s->codec == CODEC_SQRT, ex = s->codec == CODEC_EXPAND;
    int j = row_loop(k, lo, hi);
    int x = lget(k, s->local, j);
    int a = sq ? select_of(k, flt(k, zero, x), e1(k, CG_SQRT, x), zero) : fabs_of(k, x);
    int amax = reduce_max(k, a);
    int nan = reduce_max(k, select_of(k, e2(k, CG_FEQ, x, x), zero, fc(k, 1.0)));
    /* the smallest nonzero magnitude, as the max of its negation (-inf when none) */
    int neg_min = ex ? reduce_max(k, select_of(k, flt(k, zero, a), fneg(k, a), fc(k, -INFINITY))) : NONE;
    end(k);
    /* a NaN anywhere wins the max, as in codec_absmax */
    int c = select_of(k, flt(k, zero, nan), fc(k, NAN), amax);
    int finite = positive_finite(k, c);
    int side0 = imul(k, gi, ic(k, codec_params_per_group(s->codec)));
    cg_store(k, s->side, side0, c, NONE, NONE);
    int kk = NONE;
    if (ex) {
        /* k = log(28672) / log(c / lo) when c > 0 and c / lo > 1, else 1; at most 16 */
        int ratio = fdiv(k, c, fneg(k, neg_min));
        int spread = both(k, flt(k, zero, c), flt(k, fc(k, 1.0), ratio));
        kk = select_of(k, spread, fdiv(k, fc(k, log(EXPAND_RANGE)), e1(k, CG_LOG, ratio)), fc(k, 1.0));
        kk = e2(k, CG_FMIN, kk, fc(k, EXPAND_K_MAX));
        cg_store(k, s->side, iadd(k, side0, ic(k, 1)), kk, NONE, NONE);
    }
    j = row_loop(k, lo, hi);
    x = lget(k, s->local, j);
    int q;
    switch (s->codec) {
    case CODEC_EXPAND: {            /* e4m3(448 sign(x) |x/c|^k) */
        int y = fmul(k, fc(k, 448.0), power(k, fdiv(k, fabs_of(k, x), c), kk));
        y = select_of(k, finite, y, zero);
        q = select_of(k, sign_bit(k, x), fneg(k, y), y);
        break;
    }
    case CODEC_COMPAND: {           /* round(127 2y / (1 + |y|)), y = x / amax */
        int y = select_of(k, finite, fdiv(k, x, c), zero);
        q = fmul(k, fc(k, 127.0), fdiv(k, fmul(k, fc(k, 2.0), y), fadd(k, fc(k, 1.0), fabs_of(k, y))));
        break;
    }
    case CODEC_SQRT: {              /* round(255 2y / (1 + y)), y = sqrt(v) / p; v > 0: >= 1 */
        int pos = both(k, finite, flt(k, zero, x));
        int y = select_of(k, pos, fdiv(k, e1(k, CG_SQRT, x), c), zero);
        int r = fmul(k, fc(k, 255.0), fdiv(k, fmul(k, fc(k, 2.0), y), fadd(k, fc(k, 1.0), y)));
        /* rint(r) < 1 exactly when r <= 0.5 (the tie rounds to the even 0) */
        q = select_of(k, both(k, pos, e2(k, CG_FLE, r, fc(k, 0.5))), fc(k, 1.0), r);
        break;
    }
    default: IR_ASSERT(!"moment_encode: not a moment codec");
    }
    cg_store(k, s->buf, iadd(k, base, j), q, NONE, NONE);   /* the store rounds and clamps */
    end(k);
}

/* The weight of element i: the master (split: hi + lo ulp(hi)/256, exact), else the param. */
static int weight_load(CgKernel *k, const Adam *A, int i)
{
    if (!A->split) return ld(k, A->master != NONE ? A->master : A->param, i);
    int hi = ld(k, A->param, i);
    return fadd(k, hi, fmul(k, ld(k, A->master, i), split_unit(k, hi)));
}

static void weight_store(CgKernel *k, const Adam *A, int i, int w)
{
    if (A->split) {
        /* hi = bf16(w), the weight the forward reads; lo = rint((w - hi) / unit), exact before
         * the rounding, 0 where hi is not finite */
        int hi = cg_round(k, A->param, i, w, NONE, NONE);
        int r = fdiv(k, fsub(k, w, hi), split_unit(k, hi));
        cg_store(k, A->param, i, w, NONE, NONE);
        cg_store(k, A->master, i, select_of(k, flt(k, fabs_of(k, hi), fc(k, INFINITY)), r, fc(k, 0.0)), NONE, NONE);
        if (A->copy != NONE) cg_store(k, A->copy, i, hi, NONE, NONE);
        return;
    }
    if (A->master != NONE) cg_store(k, A->master, i, w, NONE, NONE);
    cg_store(k, A->param, i, w, NONE, NONE);   /* through param's format: round(master) */
    /* the copy quantizes the weight as stored, as the forward would */
    if (A->copy != NONE) cg_store(k, A->copy, i, cg_round(k, A->param, i, w, NONE, NONE), NONE, NONE);
}

/* The step of element i from its old moments: stores the weight and a zero gradient and
 * returns the new moments (adamw_task). */
static void adamw_element(CgKernel *k, const Adam *A, int i, int m_old, int v_old, int *m_new, int *v_new)
{
    int g = fmul(k, ld(k, A->grad, i), A->gmul);
    int m = fadd(k, fmul(k, fc(k, A->b1), m_old), fmul(k, fc(k, 1 - A->b1), g));
    int v = fadd(k, fmul(k, fc(k, A->b2), v_old), fmul(k, fmul(k, fc(k, 1 - A->b2), g), g));
    int mhat = fdiv(k, m, A->bc1), vhat = fdiv(k, v, A->bc2);
    int w = weight_load(k, A, i);
    int upd = fadd(k, fdiv(k, mhat, fadd(k, e1(k, CG_SQRT, vhat), fc(k, A->eps))), fmul(k, fc(k, A->wd), w));
    w = fsub(k, w, fmul(k, A->lr, upd));
    cg_store(k, A->grad, i, fc(k, 0.0), NONE, NONE);
    weight_store(k, A, i, w);
    *m_new = m;
    *v_new = v;
}

/* Whether the kernels can update n's states: plain, or moments through a group codec whose
 * side values fit (the chunk holds whole groups of both), or a split master of a bf16 param. */
static bool adamw_codecs_supported(const Node *n)
{
    for (int j = 0; j < n->n_in; j++)
        if (j != A_M && j != A_V && j != ir_adamw_master_index(n) && n->in[j]->t.fmt.codec != CODEC_PLAIN)
            return false;
    int64_t gm = 1, gv = 1;
    for (int j = A_M; j <= A_V; j++) {
        const Format *f = &n->in[j]->t.fmt;
        if (f->codec == CODEC_PLAIN) continue;
        if (f->codec != CODEC_EXPAND && f->codec != CODEC_COMPAND && f->codec != CODEC_SQRT) return false;
        if (f->elem != codec_elem(f->codec) || !f->scale || f->scale->t.fmt.elem != FMT_F32 ||
            f->scale->t.fmt.codec != CODEC_PLAIN || f->scale->t.fmt.scaling != SCALE_NONE ||
            ir_numel(&f->scale->t) != codec_param_count(f->codec, ir_numel(&n->in[j]->t)))
            return false;
        *(j == A_M ? &gm : &gv) = codec_group_size(f->codec);
    }
    int64_t C = gm > gv ? gm : gv;
    if (C % gm || C % gv) return false;
    int at_master = ir_adamw_master_index(n), at_copy = ir_adamw_copy_index(n);
    if (at_copy >= 0 && !format_is_plain(&n->in[at_copy + 2]->t.fmt)) return false;
    if (at_master >= 0 && n->in[at_master]->t.fmt.codec != CODEC_PLAIN) {
        const Format *f = &n->in[at_master]->t.fmt;
        return f->codec == CODEC_SPLIT && f->elem == FMT_I8 && f->scaling == SCALE_NONE &&
               n->in[A_PARAM]->t.fmt.elem == FMT_BF16 && format_is_plain(&n->in[A_PARAM]->t.fmt);
    }
    return true;
}

static void lower_adamw_update(Lower *L, Node *n)
{
    int at_master = ir_adamw_master_index(n), at_copy = ir_adamw_copy_index(n);
    Node *master = at_master >= 0 ? n->in[at_master] : NULL;
    Adam A = {.b1 = IR_FATTR(n, ADAMW, beta1), .b2 = IR_FATTR(n, ADAMW, beta2), .eps = IR_FATTR(n, ADAMW, eps),
              .wd = IR_FATTR(n, ADAMW, weight_decay), .master = NONE,
              .copy = NONE};
    A.split = master && master->t.fmt.codec == CODEC_SPLIT;
    int64_t N = ir_numel(&n->in[A_PARAM]->t);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    A.lr = ld(k, cg_buf_tensor(k, n->in[A_LR], true, false), ic(k, 0));
    int step = ld(k, cg_buf_tensor(k, n->in[A_STEP], true, false), ic(k, 0));
    int clip = ld(k, cg_buf_tensor(k, n->in[A_CLIP], true, false), ic(k, 0));
    int gsc = ld(k, cg_buf_tensor(k, n->in[A_GRAD_SCALE], true, false), ic(k, 0));
    A.gmul = fmul(k, gsc, clip);
    /* 1 - beta^step as exp(step * log(beta)), log taken here in double */
    A.bc1 = A.b1 == 0 ? fc(k, 1.0) : fsub(k, fc(k, 1.0), e1(k, CG_EXP, fmul(k, step, fc(k, log(A.b1)))));
    A.bc2 = A.b2 == 0 ? fc(k, 1.0) : fsub(k, fc(k, 1.0), e1(k, CG_EXP, fmul(k, step, fc(k, log(A.b2)))));
    body(k);
    A.param = cg_buf_tensor(k, n->in[A_PARAM], !master || A.split, true);
    A.grad = cg_buf_tensor(k, n->in[A_GRAD], true, true);
    A.m = moment_of(k, n->in[A_M]);
    A.v = moment_of(k, n->in[A_V]);
    if (master) A.master = A.split ? cg_buf_codes(k, master, true, true) : cg_buf_tensor(k, master, true, true);
    if (at_copy >= 0) A.copy = cg_buf_tensor(k, n->in[at_copy], false, true);
    int m, v;

    if (A.m.group == 1 && A.v.group == 1) {
        /* plain moments: one item per element */
        shape(k, CG_PAR_THREAD, N, A.split ? 50 : 30);
        int i = item(k);
        int m_old = ld(k, A.m.buf, i), v_old = ld(k, A.v.buf, i);
        adamw_element(k, &A, i, m_old, v_old, &m, &v);
        cg_store(k, A.m.buf, i, m, NONE, NONE);
        cg_store(k, A.v.buf, i, v, NONE, NONE);
        return;
    }

    /* coded moments: one item per chunk of C elements, whole groups of both */
    int64_t C = A.m.group > A.v.group ? A.m.group : A.v.group;
    shape(k, CG_PAR_BLOCK, (N + C - 1) / C, 120 * C);
    int it = item(k), base = imul(k, it, ic(k, C));
    int len = N % C == 0 ? ic(k, C) : e2(k, CG_IMIN, ic(k, C), e2(k, CG_ISUB, ic(k, N), base));
    Moment *ms[2] = {&A.m, &A.v};
    for (int s = 0; s < 2; s++) {
        Moment *x = ms[s];
        if (x->codec == CODEC_PLAIN) continue;
        x->local = cg_local(k, C, 0.0);
        if (x->group == C) {        /* the item's group: its side values once */
            x->p0 = side_at(k, x, it, 0);
            if (codec_params_per_group(x->codec) > 1) x->p1 = side_at(k, x, it, 1);
        }
    }
    int j = row_loop(k, ic(k, 0), len);
    int i = iadd(k, base, j), old[2];
    for (int s = 0; s < 2; s++) {
        Moment *x = ms[s];
        int p0 = x->p0, p1 = x->p1;
        if (x->codec != CODEC_PLAIN && x->group != C) {
            int gi = e2(k, CG_IDIV, i, ic(k, x->group));
            p0 = side_at(k, x, gi, 0);
            if (codec_params_per_group(x->codec) > 1) p1 = side_at(k, x, gi, 1);
        }
        old[s] = moment_decode(k, x, i, p0, p1);
    }
    adamw_element(k, &A, i, old[0], old[1], &m, &v);
    int now[2] = {m, v};
    for (int s = 0; s < 2; s++) {
        if (ms[s]->codec == CODEC_PLAIN) cg_store(k, ms[s]->buf, i, now[s], NONE, NONE);
        else lset(k, ms[s]->local, j, now[s]);
    }
    end(k);
    for (int s = 0; s < 2; s++) {
        Moment *x = ms[s];
        if (x->codec == CODEC_PLAIN) continue;
        if (x->group == C) {
            moment_encode(k, x, base, ic(k, 0), len, it);
            continue;
        }
        /* smaller groups: one after the other */
        int64_t G = x->group;
        int groups = N % C == 0 ? ic(k, C / G) : e2(k, CG_IDIV, iadd(k, len, ic(k, G - 1)), ic(k, G));
        int sg = seq_loop(k, ic(k, 0), groups);
        int lo = imul(k, sg, ic(k, G));
        int hi = e2(k, CG_IMIN, iadd(k, lo, ic(k, G)), len);
        moment_encode(k, x, base, lo, hi, iadd(k, imul(k, it, ic(k, C / G)), sg));
        end(k);
    }
}

/* AdamW's update, then, where it writes the weights' FP8 copy, their amax for the next step's
 * scale (in chunks, combined in order, as AMAX_RECORD does). */
static void lower_adamw(Lower *L, Node *n)
{
    lower_adamw_update(L, n);
    int at_copy = ir_adamw_copy_index(n);
    if (at_copy < 0) return;
    int chunks, amax;
    int part = chunk_partials(L, n, n->in[A_PARAM], false, &chunks);
    CgKernel *k = combine_partials(L, n, part, chunks, false, &amax);
    cg_store(k, cg_buf_tensor(k, n->in[at_copy + 2], false, true), ic(k, 0), amax, NONE, NONE);
}

/* ---------------------------------------------------------------- GEMM */

/* A copy of x decoded into f32 scratch: one elementwise kernel. */
static int widen(Lower *L, Node *n, Node *x, const char *what)
{
    int64_t N = ir_numel(&x->t);
    int s = cg_scratch_new(L->p, N);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, what);
    shape(k, CG_PAR_THREAD, N, 2);
    body(k);
    int i = item(k);
    int v = ld(k, cg_buf_tensor(k, x, true, false), i);
    cg_store(k, cg_buf_scratch(k, s, N, false, true), i, v, NONE, NONE);
    return s;
}

static bool plain_f32(const Node *n)
{
    return n->t.fmt.elem == FMT_F32 && format_is_plain(&n->t.fmt);
}

/* Operands the CPU GEMM widens itself while packing (rt_cpu_gemm_mixed): float types,
 * unscaled or with one scale per tensor. */
static bool gemm_reads(const Node *x)
{
    const Format *f = &x->t.fmt;
    bool elem = f->elem == FMT_F32 || f->elem == FMT_BF16 || f->elem == FMT_F16 ||
                f->elem == FMT_E4M3 || f->elem == FMT_E5M2;
    return elem && f->codec == CODEC_PLAIN &&
           (f->scaling == SCALE_NONE || f->scaling == SCALE_PER_TENSOR);
}


/* A GEMM operand: a transpose read through is its input with the operand's flag flipped. */
static Node *gemm_operand(const Lower *L, Node *x, bool *trans)
{
    if (x->index < 0 || !L->read_through[x->index]) return x;
    *trans = !*trans;
    return x->in[0];
}

static void lower_matmul(Lower *L, Node *n)
{
    bool ta = IR_IATTR(n, MATMUL, trans_a) != 0, tb = IR_IATTR(n, MATMUL, trans_b) != 0;
    Node *A = gemm_operand(L, n->in[0], &ta), *B = gemm_operand(L, n->in[1], &tb), *root = L->g->nodes[L->root];
    int64_t ar = rows_of(&A->t), ac = cols_of(&A->t), br = rows_of(&B->t), bc = cols_of(&B->t);
    CgGemm gm = {.M = ta ? ac : ar, .K = ta ? ar : ac, .N = tb ? br : bc, .trans_a = ta,
                 .trans_b = tb, .epilogue = NONE};
    bool f32 = L->o->gemm_f32;
    int sa = f32 && !gemm_reads(A) ? widen(L, n, A, "a") : NONE;
    int sb = f32 && !gemm_reads(B) ? widen(L, n, B, "b") : NONE;
    /* where C goes: the tensor itself, straight into a plain f32 accumulator, or scratch
     * followed by the group's epilogue */
    bool alone = root == n;
    bool into_acc = root->op == OP_ACCUMULATE && root->in[1] == n && plain_f32(root->in[0]) &&
                    plain_f32(n);
    int sc = NONE;
    if (f32 && !(alone && plain_f32(n)) && !into_acc) sc = transient_scratch(L, gm.M * gm.N);
    if (!f32 && !alone && !into_acc) sc = transient_scratch(L, gm.M * gm.N);

    CgKernel *k = kernel(L, CG_KERNEL_GEMM, n, NULL);
    shape(k, CG_PAR_THREAD, 1, 2 * gm.M * gm.N * gm.K);
    gm.a = sa != NONE ? cg_buf_scratch(k, sa, ir_numel(&A->t), true, false) : cg_buf_tensor(k, A, true, false);
    gm.b = sb != NONE ? cg_buf_scratch(k, sb, ir_numel(&B->t), true, false) : cg_buf_tensor(k, B, true, false);
    if (into_acc) {
        gm.accumulate = true;
        gm.c = cg_buf_tensor(k, root->in[0], true, true);
    } else if (sc != NONE) {
        gm.c = cg_buf_scratch(k, sc, gm.M * gm.N, false, true);
    } else {
        gm.c = cg_buf_tensor(k, n, false, true);
    }
    k->gemm = gm;
    if (sc == NONE) return;

    /* the epilogue: C's rows through the group's elementwise nodes into the root */
    CgKernel *gemm = k;
    k = kernel(L, CG_KERNEL_LOOP, n, "epilogue");
    gemm->gemm.epilogue = k->id;
    shape(k, CG_PAR_BLOCK, gm.M, 4 * gm.N);
    body(k);
    int row = item(k);
    int cb = cg_buf_scratch(k, sc, gm.M * gm.N, true, false);
    At at;
    open_cols(k, row, gm.N, &at);
    emit_out(L, k, n, ld(k, cb, at.idx), at);
    end(k);
}

/* ---------------------------------------------------------------- dispatch */

/* Formats the kernels handle: plain codecs everywhere, and the optimizer-state codecs where
 * AdamW updates them (lower_adamw decodes and encodes them itself). */
static bool node_supported(const Node *n)
{
    if (n->t.fmt.codec != CODEC_PLAIN) return false;
    if (n->op == OP_ADAMW) return adamw_codecs_supported(n);
    for (int j = 0; j < n->n_in; j++)
        if (n->in[j]->t.fmt.codec != CODEC_PLAIN) return false;
    return true;
}

static void lower_ref(Lower *L, Node *root)
{
    CgKernel *k = kernel(L, CG_KERNEL_REF, root, NULL);
    for (int i = 0; i <= L->root; i++)
        if (L->group[i] == L->root) k->n_nodes++;
    k->nodes = arena_alloc(L->p->arena, sizeof(Node *) * (size_t)k->n_nodes);
    k->n_nodes = 0;
    for (int i = 0; i <= L->root; i++)
        if (L->group[i] == L->root) k->nodes[k->n_nodes++] = L->g->nodes[i];
}

static void lower_head(Lower *L, Node *h)
{
    switch (h->op) {
    case OP_MATMUL: lower_matmul(L, h); return;
    case OP_LAYERNORM: case OP_RMSNORM: case OP_LAYERNORM_BWD_X: case OP_RMSNORM_BWD_X:
        lower_norm(L, h);
        return;
    case OP_LAYERNORM_BWD_W: case OP_RMSNORM_BWD_W: lower_norm_w(L, h); return;
    case OP_SOFTMAX: case OP_SOFTMAX_BWD: lower_softmax(L, h); return;
    case OP_EMBEDDING: lower_embedding(L, h); return;
    case OP_EMBEDDING_BWD: lower_embedding_bwd(L, h); return;
    case OP_CROSS_ENTROPY: case OP_CROSS_ENTROPY_BWD: lower_cross_entropy(L, h); return;
    case OP_SUM_ROWS: lower_sum_rows(L, h); return;
    case OP_SQNORM: lower_sqnorm(L, h); return;
    case OP_QUANT_SCALE: lower_quant_scale(L, h); return;
    case OP_AMAX_RECORD: lower_amax_record(L, h); return;
    case OP_DELAYED_SCALE: lower_delayed_scale(L, h); return;
    case OP_SLICE: case OP_PAD: lower_slice(L, h); return;
    case OP_CONCAT: lower_concat(L, h); return;
    case OP_TRANSPOSE: lower_transpose(L, h); return;
    case OP_CONST: lower_const(L, h); return;
    case OP_ASSIGN: lower_assign(L, h); return;
    case OP_ROPE: lower_rope(L, h); return;
    case OP_ATTENTION: lower_attention(L, h); return;
    case OP_ATTENTION_BWD: lower_attention_bwd(L, h); return;
    case OP_CLIP_COEF: lower_clip_coef(L, h); return;
    case OP_GRAD_NORM: lower_grad_norm(L, h); return;
    case OP_ADAMW: lower_adamw(L, h); return;
    default: IR_ASSERT(!"lower_head: not a head op");
    }
}

static void lower_group(Lower *L, int root_index)
{
    Node *root = L->g->nodes[root_index];
    L->root = root_index;
    L->head = NULL;
    L->n_memo = 0;
    bool supported = true;
    for (int i = 0; i <= root_index; i++) {
        if (L->group[i] != root_index) continue;
        Node *m = L->g->nodes[i];
        supported &= node_supported(m);
        if (!cg_op_is_elementwise(m->op)) {
            IR_ASSERT(L->head == NULL);
            L->head = m;
        }
    }
    int first = L->p->n_kernels;
    if (!supported) lower_ref(L, root);
    else if (!L->head) lower_elementwise(L, root);
    else lower_head(L, L->head);
    /* every kernel of the group runs in the root's phase and lists the group's nodes */
    int n_nodes = 0;
    for (int i = 0; i <= root_index; i++) n_nodes += L->group[i] == root_index;
    for (int q = first; q < L->p->n_kernels; q++) {
        CgKernel *k = L->p->kernels[q];
        k->phase = root->phase;
        if (k->kind == CG_KERNEL_REF) continue;
        k->nodes = arena_alloc(L->p->arena, sizeof(Node *) * (size_t)n_nodes);
        k->n_nodes = 0;
        for (int i = 0; i <= root_index; i++)
            if (L->group[i] == root_index) k->nodes[k->n_nodes++] = L->g->nodes[i];
    }
}

/* Transposed copies that the CPU GEMM need not have. The layout pass gives FP8 GEMMs
 * operands with k along their rows (what FP8 tensor cores take), so the backward transposes
 * saved activations and weight copies; the CPU GEMM packs its operands in either layout, so
 * there it reads the transpose's input with the operand's flag flipped, and the transpose
 * runs no kernel (at -O1, gpt2_tiny at batch 16 x 128: 8 MiB of e4m3 moved per step, ~9 ms on
 * two cores). A transpose qualifies when every reader is a GEMM, its input is one the GEMM
 * reads in place with the same format and scale, nothing references it as a scale, and its
 * input, and the input's scale, keep their values until each reading GEMM's group has run
 * (which its kernels, not the reference, run). */
static void find_read_through(Lower *L)
{
    const Graph *g = L->g;
    L->read_through = arena_alloc(L->p->arena, sizeof(bool) * (size_t)(g->n_nodes + 1));
    memset(L->read_through, 0, sizeof(bool) * (size_t)(g->n_nodes + 1));
    if (!L->o->gemm_f32) return;
    Uses *uses = NULL;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *t = g->nodes[i];
        if (t->op != OP_TRANSPOSE || L->group[i] != i || !gemm_reads(t->in[0])) continue;
        Node *x = t->in[0];
        const Format *ft = &t->t.fmt, *fx = &x->t.fmt;
        if (ft->elem != fx->elem || ft->codec != fx->codec || ft->scaling != fx->scaling || ft->scale != fx->scale ||
            ir_role_is_persistent(t->t.role) || t->t.role == ROLE_OUTPUT)
            continue;
        bool ok = !fuse_referenced_by_format(g, t);
        for (int j = 0; j < i && ok; j++) ok = L->group[j] != i;   /* nothing fused into it */
        if (!ok) continue;
        if (!uses) uses = ir_fill_uses(g);
        const Uses *u = &uses[i];
        ok = u->n > 0;
        for (int j = 0; j < u->n && ok; j++) {
            const Node *c = u->list[j];
            int root = L->group[c->index];
            ok = c->op == OP_MATMUL && c->n_in == 2 && root >= 0 && fuse_value_survives(g, x, i, root + 1) &&
                 (!fx->scale || fuse_value_survives(g, fx->scale, i, root + 1));
            for (int m = 0; m <= root && ok; m++)   /* kernels, not the reference, run the group */
                ok = L->group[m] != root || node_supported(g->nodes[m]);
        }
        if (ok) {
            L->read_through[i] = true;
            L->group[i] = -1;
        }
    }
}

CgProgram *cg_lower(const Graph *g, Arena *a, const CgLowerOptions *o)
{
    static const CgLowerOptions defaults = {.fuse = true, .gemm_f32 = true};
    if (!o) o = &defaults;
    for (int i = 0; i < g->n_nodes; i++) IR_ASSERT(g->nodes[i]->index == i);
    Lower L = {.g = g, .o = o, .p = cg_program_new(a, g), .transient = NONE};
    if (o->fuse) {
        L.group = fuse_plan(g, a);
    } else {
        L.group = arena_alloc(a, sizeof(int) * (size_t)(g->n_nodes + 1));
        for (int i = 0; i < g->n_nodes; i++) L.group[i] = cg_node_runs_kernel(g->nodes[i]) ? i : -1;
    }
    find_read_through(&L);
    for (int i = 0; i < g->n_nodes; i++)
        if (L.group[i] == i) lower_group(&L, i);
    int bad = 0;
    for (int i = 0; i < L.p->n_kernels; i++) bad += cg_kernel_verify(L.p->kernels[i]);
    if (bad) return NULL;
    cg_program_finish(L.p);
    return L.p;
}
