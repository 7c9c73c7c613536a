/* lower_kernels.h — what the files of the lowering share (codegen/lower_*.c).
 *
 * cg_lower (lower_kernels.c) walks the fusion groups in schedule order and hands each head to
 * the file that lowers its kind of op: lower_rows.c (norms, softmax, gathers, cross entropy,
 * whole-tensor reductions and scales, shape ops), lower_attn.c (rope and attention) and
 * lower_adamw.c (clipping and the updates over coded states); elementwise groups, the
 * GEMM and the dispatch stay in lower_kernels.c. They share the state of one lowering
 * (Lower), the emission shorthands below, and the epilogue every head calls where it has an
 * output element (emit_out). Internal to codegen/: nothing outside includes it. */
#ifndef FP8C_LOWER_KERNELS_H
#define FP8C_LOWER_KERNELS_H

#include "codegen.h"

#define NONE CG_NONE

enum { COL_BLOCK = 64, ROW_CHUNK = 64, REDUCE_CHUNK = 4096, MEMO_MAX = 64 };

/* attention: keys (or queries) in blocks of KEY_BLOCK; up to ATTN_ROWS rows per item, with
 * at most ATTN_LOCALS f32 of locals per item, summed into at most ATTN_ACC f32 per pass */
enum { KEY_BLOCK = 16, ATTN_ROWS = 8, ATTN_ACC = 256, ATTN_LOCALS = 10240 };

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


static inline bool format_is_plain(const Format *f)
{
    return f->scaling == SCALE_NONE && f->codec == CODEC_PLAIN;
}

/* ---------------------------------------------------------------- emission shorthands */

static inline int e1(CgKernel *k, CgOp op, int a) { return cg_emit(k, op, a, NONE, NONE, NONE); }
static inline int e2(CgKernel *k, CgOp op, int a, int b) { return cg_emit(k, op, a, b, NONE, NONE); }
static inline int e3(CgKernel *k, CgOp op, int a, int b, int c) { return cg_emit(k, op, a, b, c, NONE); }
static inline int fc(CgKernel *k, double f) { return cg_fconst(k, f); }
static inline int ic(CgKernel *k, int64_t i) { return cg_iconst(k, i); }
static inline void body(CgKernel *k) { e1(k, CG_BODY, NONE); }
static inline int item(CgKernel *k) { return e1(k, CG_ITEM, NONE); }
static inline void end(CgKernel *k) { e1(k, CG_END, NONE); }
static inline int row_loop(CgKernel *k, int lo, int hi) { return cg_loop(k, CG_LOOP_ROW, lo, hi); }
static inline int seq_loop(CgKernel *k, int lo, int hi) { return cg_loop(k, CG_LOOP_SEQ, lo, hi); }
static inline int iadd(CgKernel *k, int a, int b) { return e2(k, CG_IADD, a, b); }
static inline int imul(CgKernel *k, int a, int b) { return e2(k, CG_IMUL, a, b); }
static inline int fadd(CgKernel *k, int a, int b) { return e2(k, CG_FADD, a, b); }
static inline int fsub(CgKernel *k, int a, int b) { return e2(k, CG_FSUB, a, b); }
static inline int fmul(CgKernel *k, int a, int b) { return e2(k, CG_FMUL, a, b); }
static inline int fdiv(CgKernel *k, int a, int b) { return e2(k, CG_FDIV, a, b); }
static inline int lget(CgKernel *k, int l, int i) { return e2(k, CG_LGET, l, i); }
static inline void lset(CgKernel *k, int l, int i, int v) { e3(k, CG_LSET, l, i, v); }
static inline int ld(CgKernel *k, int buf, int idx) { return cg_load(k, buf, idx, NONE, NONE); }
static inline int flt(CgKernel *k, int a, int b) { return e2(k, CG_FLT, a, b); }
static inline int fabs_of(CgKernel *k, int a) { return e1(k, CG_FABS, a); }
static inline int fneg(CgKernel *k, int a) { return e1(k, CG_FNEG, a); }
static inline int select_of(CgKernel *k, int c, int a, int b) { return e3(k, CG_SELECT, c, a, b); }
static inline int both(CgKernel *k, int a, int b) { return e2(k, CG_AND, a, b); }
static inline int ilt(CgKernel *k, int a, int b) { return e2(k, CG_ILT, a, b); }
static inline int reduce_sum(CgKernel *k, int v) { return cg_reduce(k, CG_RED_SUM, v); }
static inline int reduce_max(CgKernel *k, int v) { return cg_reduce(k, CG_RED_MAX, v); }

static inline int64_t rows_of(const Tensor *t)
{
    int64_t r = 1;
    for (int i = 0; i + 1 < t->rank; i++) r *= t->dims[i];
    return r;
}

static inline int64_t cols_of(const Tensor *t) { return t->rank ? t->dims[t->rank - 1] : 1; }

static inline const char *node_label(const Lower *L, const Node *n)
{
    if (n->t.name) return n->t.name;
    return arena_printf(L->p->arena, "%s.%d", ir_op_info(n->op)->text, n->id);
}

static inline CgKernel *kernel(Lower *L, CgKernelKind kind, const Node *n, const char *suffix)
{
    const char *name = node_label(L, n);
    if (suffix) name = arena_printf(L->p->arena, "%s:%s", name, suffix);
    return cg_kernel_new(L->p, kind, name, n->phase);
}

/* Rows of work for `items` items of about `cost` scalar operations each. */
static inline void shape(CgKernel *k, CgParallel par, int64_t items, int64_t cost)
{
    k->par = par;
    k->items = items;
    k->cost = cost > 0 ? cost : 1;
}

/* The tensor a node's value is stored in: in-place ops write their first operand. */
static inline Node *store_target(Node *n)
{
    return n->op == OP_ACCUMULATE || n->op == OP_ASSIGN ? n->in[0] : n;
}

/* Row and column hints for a buffer whose view is the kernel's view (else none). */
static inline void hints(CgKernel *k, int buf, At at, int *row, int *col)
{
    const CgBuf *b = &k->bufs[buf];
    bool same = at.row != NONE && b->cols == at.cols;
    *row = same ? at.row : NONE;
    *col = same ? at.col : NONE;
}

static inline int load_at(CgKernel *k, int buf, At at)
{
    int r, c;
    hints(k, buf, at, &r, &c);
    return cg_load(k, buf, at.idx, r, c);
}

static inline void store_at(CgKernel *k, int buf, At at, int v)
{
    int r, c;
    hints(k, buf, at, &r, &c);
    cg_store(k, buf, at.idx, v, r, c);
}

/* The index of a broadcast operand of nb elements at position `at` (nb divides the numel). */
static inline int bcast_index(CgKernel *k, int64_t nb, At at)
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

/* ---------------------------------------------------------------- lower_kernels.c */

/* Where a head's kernel has output element `at` with value v: the group's elementwise nodes
 * compute the root's element from it inline, and the root's store (or the head's own). */
void emit_out(Lower *L, CgKernel *k, Node *head, int v, At at);

/* ---------------------------------------------------------------- lower_rows.c */

/* Opens the row loop of a row kernel: returns the column; *at gets the position. */
int open_cols(CgKernel *k, int row, int64_t C, At *at);
/* The scratch that values passed from one kernel to the next share (a GEMM's C, column sums'
 * chunk sums), grown to hold `floats`. */
int transient_scratch(Lower *L, int64_t floats);
/* Partial reductions over chunks of REDUCE_CHUNK elements into a scratch array, and the one
 * item that combines them in order. */
int chunk_partials(Lower *L, Node *n, Node *x, bool square, int *chunks_out);
CgKernel *combine_partials(Lower *L, Node *n, int part, int chunks, bool sum, int *v);
void lower_norm(Lower *L, Node *n);
void lower_norm_w(Lower *L, Node *n);
void lower_sum_rows(Lower *L, Node *n);
void lower_softmax(Lower *L, Node *n);
void lower_embedding(Lower *L, Node *n);
void lower_embedding_bwd(Lower *L, Node *n);
void lower_cross_entropy(Lower *L, Node *n);
void lower_sqnorm(Lower *L, Node *n);
void lower_quant_scale(Lower *L, Node *n);
void lower_amax_record(Lower *L, Node *n);
void lower_delayed_scale(Lower *L, Node *n);
void lower_slice(Lower *L, Node *n);
void lower_transpose(Lower *L, Node *n);
void lower_concat(Lower *L, Node *n);
void lower_const(Lower *L, Node *n);
void lower_assign(Lower *L, Node *n);

/* ---------------------------------------------------------------- lower_attn.c */

void lower_rope(Lower *L, Node *n);
void lower_attention(Lower *L, Node *n);
void lower_attention_bwd(Lower *L, Node *n);

/* ---------------------------------------------------------------- lower_adamw.c */

void lower_clip_coef(Lower *L, Node *n);
void lower_grad_norm(Lower *L, Node *n);
/* Whether the update's kernel handles the codecs of n's states (else the reference runs it). */
bool adamw_codecs_supported(const Node *n);
void lower_adamw(Lower *L, Node *n);

#endif
