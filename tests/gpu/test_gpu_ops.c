/* test_gpu_ops.c — every GPU kernel against the reference executor, on fresh random data.
 *
 * All cases live in one graph, so that the kernel module is compiled once (NVRTC, cached).
 * Each case is one node whose inputs are random leaves in the formats under test; the node
 * runs on the GPU (its output poisoned first, so an unwritten element shows as NaN), then the
 * same node runs in the reference executor from the same input bytes, and the results — the
 * node's tensor and every operand it updates in place — are compared after decoding.
 *
 * Bounds (normalized error, see gpu_test.h), by what may legitimately differ:
 *   0       copies, casts, quantization, slices, embeddings, f32 adds, in-place accumulation,
 *           scales and amax histories: the same f32 operations in the same order, and the
 *           conversions agree bit for bit (ir/numerics.c);
 *   2e-5    f32 results of reductions and attention (f64 sums in another order; attention in
 *           f32 with f32 exp against the reference's f64);
 *   1e-2    bf16 results (a few elements one bf16 step, 2^-8 relative, apart), FP8 GEMMs
 *           (cuBLASLt accumulates in f32, the reference in f64; then bf16), and the
 *           tensor-core attention (P and dS are bf16 operands there: 2-3e-3 measured), on
 *           mma.sync or (attn.wgmma) on warpgroup MMA;
 *   5e-4    an FP8 GEMM with an f32 result (the FP8 tensor cores' accumulation);
 *   0.1     FP8 results of computed values (one e4m3 step is 2^-3 relative).
 * AdamW's coded states (O2/O3) are held to coded_check.h's bounds (the kernel's codecs are f32,
 * codecs.c's f64): codes at most one step apart, side values that agree, each group's decoded
 * values within 0.1 normalized. A split master compares decoded (hi + lo ulp(hi) / 256) within
 * its case's bound. Every update computes in f32 (the reference in f64), so what it rounds to
 * bf16 or FP8 (the weights, the split master's bf16 half, bf16 states, the weights' FP8 copy)
 * may be one step off where the two straddle a rounding point: at most 1% + 4 elements (a test
 * of 818 weights once saw one element a step off: normalized 3.6e-5 over the 2e-5 bound).
 * The gpu label keeps this out of CI; without a GPU it prints "skipped: no GPU" and passes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gpu_test.h"
#include "coded_check.h"

enum { MAX_CASES = 320 };

typedef struct {
    const char *name;
    Node *node;
    double tol;         /* < 0: by the result's element type */
    const char *group;
} Case;

static Arena *arena;
static Graph *graph;
static Case cases[MAX_CASES];
static int n_cases;
static RtMemory mem;
static CudaExec *exec;
static const char *group_now;
static const SrcLoc here = {"test_gpu_ops.c", 1, 1};

/* ---------------------------------------------------------------- building */

/* How fill_leaf fills an input leaf: the magnitude of its values (negative: that one value
 * everywhere), for token ids their bound and the share of ignored (-1) targets, and whether
 * the values are positive. Input leaves have no attributes in ops.def, so the cases keep these
 * beside the graph, by node id. */
typedef struct {
    float mag;
    int64_t ids;
    double ignore;
    bool positive;
} Fill;
static Fill *fills;
static int n_fills;

static Fill *fill_of(const Node *n) {
    if (n->id >= n_fills) {
        int grown = n->id + 256;
        Fill *more = realloc(fills, sizeof *fills * (size_t)grown);
        assert_non_null(more);
        memset(more + n_fills, 0, sizeof *more * (size_t)(grown - n_fills));
        fills = more, n_fills = grown;
    }
    return &fills[n->id];
}

static Node *leaf_fmt(const char *name, ElemType e, Scaling sc, int group, Node *scale, float mag,
                      int rank, const int64_t *dims) {
    Node *n = ir_leaf(graph, OP_INPUT, name, ROLE_INPUT, e, rank, dims, here);
    n->t.fmt.scaling = sc;
    n->t.fmt.group = group;
    n->t.fmt.recipe = sc != SCALE_NONE ? RECIPE_CURRENT : RECIPE_NONE;
    n->t.fmt.scale = scale;
    fill_of(n)->mag = mag;
    return n;
}

#define DIMS(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (const int64_t[]){__VA_ARGS__}

static Node *leaf(ElemType e, float mag, int rank, const int64_t *dims) {
    return leaf_fmt("x", e, SCALE_NONE, 0, NULL, mag, rank, dims);
}

/* token ids or targets in [0, hi), a fraction p_ignore of them -1 */
static Node *ids(int64_t hi, double p_ignore, int rank, const int64_t *dims) {
    Node *n = leaf(FMT_I32, 0, rank, dims);
    fill_of(n)->ids = hi;
    fill_of(n)->ignore = p_ignore;
    n->t.name = "ids";
    return n;
}

/* a scale tensor of `count` positive values around 448 / (4 mag) */
static Node *scales(int64_t rows, int64_t cols, float mag) {
    Node *n = cols ? leaf(FMT_F32, 0, DIMS(rows, cols)) : rows ? leaf(FMT_F32, 0, DIMS(rows))
                   : ir_leaf(graph, OP_INPUT, "s", ROLE_INPUT, FMT_F32, 0, NULL, here);
    n->t.role = ROLE_SCALE;
    n->t.name = "scale";
    fill_of(n)->mag = mag;
    return n;
}

static Node *op_v(OpKind op, ElemType e, const int64_t *ia, const double *fa, int n_in, Node *const *in) {
    Node *n = ir_add(graph, op, n_in, in, here);
    if (ia) memcpy(n->iattr, ia, sizeof n->iattr);
    if (fa) memcpy(n->fattr, fa, sizeof n->fattr);
    const char *err = ir_infer_shape(n, arena);
    if (err) fail_msg("%s: %s", ir_op_info(op)->text, err);
    if (n->t.fmt.elem != FMT_VOID) n->t.fmt = fmt_plain(e);
    return n;
}
#define IN(...) (int)(sizeof((Node *[]){__VA_ARGS__}) / sizeof(Node *)), (Node *[]){__VA_ARGS__}
#define I(...) ((const int64_t[IR_MAX_IATTR]){__VA_ARGS__})
#define Fa(...) ((const double[IR_MAX_FATTR]){__VA_ARGS__})

static Node *add_case(const char *name, double tol, Node *n) {
    assert_true(n_cases < MAX_CASES);
    cases[n_cases++] = (Case){name, n, tol, group_now};
    n->t.name = name;
    return n;
}

/* ---------------------------------------------------------------- the cases */

static void build_elementwise(void) {
    group_now = "elementwise";
    int64_t B = gt_int(1, 4), T = gt_int(1, 70), C = 16 * gt_int(1, 12), H = 2, D = C / H;
    Node *x = leaf(FMT_BF16, 1, DIMS(B, T, C)), *y = leaf(FMT_BF16, 1, DIMS(B, T, C));
    Node *bias = leaf(FMT_BF16, 1, DIMS(C)), *xf = leaf(FMT_F32, 1, DIMS(B, T, C));
    Node *yf = leaf(FMT_F32, 1, DIMS(B, T, C));
    Node *s0 = ir_leaf(graph, OP_INPUT, "s0", ROLE_INPUT, FMT_F32, 0, NULL, here);
    fill_of(s0)->mag = 1;
    add_case("add bias bf16", 0, op_v(OP_ADD, FMT_BF16, NULL, NULL, IN(x, bias)));
    add_case("sub f32", 0, op_v(OP_SUB, FMT_F32, NULL, NULL, IN(xf, yf)));
    add_case("mul scalar bf16", 0, op_v(OP_MUL, FMT_BF16, NULL, NULL, IN(x, s0)));
    add_case("scale f32->bf16", 0, op_v(OP_SCALE, FMT_BF16, NULL, Fa(0.37), IN(xf)));
    add_case("add_n 3", 0, op_v(OP_ADD_N, FMT_BF16, NULL, NULL, IN(x, y, xf)));
    Node *many[23];
    for (int i = 0; i < 23; i++) many[i] = i % 3 ? x : leaf(FMT_F32, 1, DIMS(B, T, C));
    add_case("add_n 23", 0, op_v(OP_ADD_N, FMT_F32, NULL, NULL, 23, many));
    add_case("gelu bf16", 1e-2, op_v(OP_GELU, FMT_BF16, NULL, NULL, IN(x)));
    add_case("gelu_bwd f32", 2e-5, op_v(OP_GELU_BWD, FMT_F32, NULL, NULL, IN(yf, xf)));
    /* GELU in its logistic form (ops.cuh, ck_gelu_exp2) against the f64 reference, over the
     * tails too (x up to about +-16): an f32 emulation of it with ex2's 2^-22 error measured
     * 3e-8 and 6e-8 normalized */
    Node *xw = leaf(FMT_F32, 4, DIMS(B, T, C));
    add_case("gelu f32 wide", 1e-6, op_v(OP_GELU, FMT_F32, NULL, NULL, IN(xw)));
    add_case("gelu_bwd f32 wide", 1e-6, op_v(OP_GELU_BWD, FMT_F32, NULL, NULL, IN(yf, xw)));
    add_case("silu f32", 2e-5, op_v(OP_SILU, FMT_F32, NULL, NULL, IN(xf)));
    add_case("silu_bwd bf16", 1e-2, op_v(OP_SILU_BWD, FMT_BF16, NULL, NULL, IN(y, x)));
    add_case("cast f32->bf16", 0, op_v(OP_CAST, FMT_BF16, NULL, NULL, IN(xf)));
    Node *st = scales(0, 0, 1);
    Node *q = add_case("quantize e4m3 tensor", 0, op_v(OP_QUANTIZE, FMT_E4M3, NULL, NULL, IN(xf, st)));
    q->t.fmt.scaling = SCALE_PER_TENSOR, q->t.fmt.recipe = RECIPE_CURRENT, q->t.fmt.scale = st;
    Node *sr = scales(B * T, 0, 1);
    q = add_case("quantize e5m2 row", 0, op_v(OP_QUANTIZE, FMT_E5M2, NULL, NULL, IN(x, sr)));
    q->t.fmt.scaling = SCALE_PER_ROW, q->t.fmt.recipe = RECIPE_CURRENT, q->t.fmt.scale = sr;
    Node *sg = scales(B * T, C / 16, 1);
    q = add_case("quantize e4m3 group 16", 0, op_v(OP_QUANTIZE, FMT_E4M3, NULL, NULL, IN(x, sg)));
    q->t.fmt.scaling = SCALE_PER_GROUP, q->t.fmt.group = 16, q->t.fmt.recipe = RECIPE_CURRENT,
    q->t.fmt.scale = sg;
    Node *st2 = scales(0, 0, 1);
    Node *x8 = leaf_fmt("x8", FMT_E4M3, SCALE_PER_TENSOR, 0, st2, 1, DIMS(B, T, C));
    add_case("cast e4m3->f32", 0, op_v(OP_CAST, FMT_F32, NULL, NULL, IN(x8)));
    /* the layout pass's copies: FP8 codes moved under their scale, and a wider element type */
    Node *x8t = add_case("transpose e4m3 tensor", 0, op_v(OP_TRANSPOSE, FMT_E4M3, NULL, NULL, IN(x8)));
    x8t->t.fmt = x8->t.fmt;
    add_case("transpose bf16", 0, op_v(OP_TRANSPOSE, FMT_BF16, NULL, NULL, IN(x)));
    add_case("slice", 0, op_v(OP_SLICE, FMT_BF16, I(2, D / 2, D), NULL, IN(x)));
    /* whole vectors (ck_slice's vector path): columns from a multiple of 16, and positions */
    add_case("slice, vectors", 0, op_v(OP_SLICE, FMT_BF16, I(2, C / 2, C / 2), NULL, IN(x)));
    add_case("slice positions f32", 0, op_v(OP_SLICE, FMT_F32, I(1, T / 2, T - T / 2), NULL, IN(xf)));
    Node *sl = leaf(FMT_BF16, 1, DIMS(B, T, D));
    add_case("pad", 0, op_v(OP_PAD, FMT_BF16, I(2, C - D, C), NULL, IN(sl)));
    add_case("concat 3", 0, op_v(OP_CONCAT, FMT_F32, I(2), NULL, IN(x, xf, sl)));
    Node *parts[17];
    for (int i = 0; i < 17; i++) parts[i] = leaf(i % 2 ? FMT_BF16 : FMT_F32, 1, DIMS(gt_int(1, 9), C));
    add_case("concat 17 rows", 0, op_v(OP_CONCAT, FMT_BF16, I(0), NULL, 17, parts));
    int64_t V = gt_int(20, 300);
    Node *table = leaf(FMT_BF16, 1, DIMS(V, C)), *tok = ids(V, 0, DIMS(B, T));
    add_case("embedding", 0, op_v(OP_EMBEDDING, FMT_BF16, NULL, NULL, IN(table, tok)));
    add_case("rope", 1e-6, op_v(OP_ROPE, FMT_F32, I(D, 0), Fa(10000.0), IN(xf)));
    add_case("rope inverse bf16", 1e-2, op_v(OP_ROPE, FMT_BF16, I(D, 1), Fa(500000.0), IN(x)));
    /* heads of 6: pairs that vectors of 8 would split, the element-wise path */
    Node *x6 = leaf(FMT_BF16, 1, DIMS(B, T, 12));
    add_case("rope heads of 6", 1e-2, op_v(OP_ROPE, FMT_BF16, I(6, 0), Fa(10000.0), IN(x6)));
    Node *c = op_v(OP_CONST, FMT_BF16, NULL, Fa(0.3), 0, NULL);
    ir_set_shape(c, 2, (const int64_t[]){T, C});
    add_case("const", 0, c);
}

/* A cross entropy and its backward right after it (fuse_ce_one_pass), and a twin pair of the
 * same inputs with the one pass switched off at its backward, whose backward reads the
 * forward's logsumexps (fuse_ce_lse): test_ce_one_pass wants the twin's bits. All four nodes
 * take the same loss choices (ce.threads, ce.exp2, ce.shared, ce.ring through their "@ID" forms; NULL
 * keeps a default), as a build's global choice gives them. */
typedef enum { CE_IN_REGISTERS, CE_IN_SHARED, CE_READ_TWICE, CE_IN_RING } CeHeld;
typedef struct {
    const char *name;
    Node *f, *b, *f2, *b2;
    CeHeld held;   /* where the one pass keeps a row between its logsumexp and its gradient */
} CePair;
static CePair ce_pairs[24];
static int n_ce_pairs;

typedef struct {
    const char *threads, *exp2, *shared, *ring;
} CeChoice;
static const CeChoice ce_default = {NULL, NULL, NULL, NULL};

static void ce_choose(const Node *n, CeChoice c) {
    const char *names[4] = {"ce.threads", "ce.exp2", "ce.shared", "ce.ring"};
    const char *values[4] = {c.threads, c.exp2, c.shared, c.ring};
    for (int k = 0; k < 4; k++)
        if (values[k]) ir_set_choice(graph, arena_printf(arena, "%s@%d", names[k], n->id), values[k]);
}

static void ce_pair_chosen(const char *name, ElemType e, int64_t R, int64_t V, CeHeld held, Node *dl, CeChoice c) {
    assert_true(n_ce_pairs < (int)(sizeof ce_pairs / sizeof *ce_pairs));
    Node *lg = leaf(e, 3, DIMS(R, V)), *tg = ids(V, 0.1, DIMS(R));
    CePair *p = &ce_pairs[n_ce_pairs++];
    p->name = name, p->held = held;
    p->f = add_case(arena_printf(arena, "cross_entropy, %s", name), 2e-5,
                    op_v(OP_CROSS_ENTROPY, FMT_F32, NULL, NULL, IN(lg, tg)));
    p->b = add_case(arena_printf(arena, "cross_entropy_bwd, %s", name), e == FMT_F32 ? 2e-5 : 1e-2,
                    op_v(OP_CROSS_ENTROPY_BWD, e, NULL, NULL, IN(dl, p->f->in[0], tg)));
    p->f2 = op_v(OP_CROSS_ENTROPY, FMT_F32, NULL, NULL, IN(lg, tg));
    p->b2 = op_v(OP_CROSS_ENTROPY_BWD, e, NULL, NULL, IN(dl, lg, tg));
    ir_set_choice(graph, arena_printf(arena, "fuse.ce_one_pass@%d", p->b2->id), "0");
    Node *all[4] = {p->f, p->b, p->f2, p->b2};
    for (int k = 0; k < 4; k++) ce_choose(all[k], c);
}

/* a pair in blocks of 1024 threads with expf (ce.threads=1024, ce.exp2=0): held in registers
 * where the row fits, else read twice */
static void ce_pair(const char *name, ElemType e, int64_t R, int64_t V, bool held, Node *dl) {
    static const CeChoice ce_1024 = {"1024", "0", NULL, NULL};
    ce_pair_chosen(name, e, R, V, held ? CE_IN_REGISTERS : CE_READ_TWICE, dl, ce_1024);
}

static void build_rows(void) {
    group_now = "rows";
    int64_t R = gt_int(1, 300), C = gt_int(1, 200) + 64;
    Node *x = leaf(FMT_BF16, 2, DIMS(R, C)), *dy = leaf(FMT_BF16, 1, DIMS(R, C));
    Node *w = leaf(FMT_F32, 1, DIMS(C)), *b = leaf(FMT_F32, 1, DIMS(C));
    add_case("layernorm", 1e-2, op_v(OP_LAYERNORM, FMT_BF16, NULL, Fa(1e-5), IN(x, w, b)));
    /* rows in whole vectors, up to 2 x 8 x 256 elements: held in registers */
    int64_t C8 = 8 * gt_int(1, 512);
    Node *x8 = leaf(FMT_BF16, 2, DIMS(R, C8)), *w8 = leaf(FMT_BF16, 1, DIMS(C8)), *b8 = leaf(FMT_BF16, 1, DIMS(C8));
    add_case("layernorm, vector rows", 1e-2, op_v(OP_LAYERNORM, FMT_BF16, NULL, Fa(1e-5), IN(x8, w8, b8)));
    add_case("rmsnorm f32, vector rows", 2e-5, op_v(OP_RMSNORM, FMT_F32, NULL, Fa(1e-6), IN(x8, w8)));
    add_case("rmsnorm f32", 2e-5, op_v(OP_RMSNORM, FMT_F32, NULL, Fa(1e-6), IN(x, w)));
    add_case("layernorm_bwd_x", 1e-2, op_v(OP_LAYERNORM_BWD_X, FMT_BF16, NULL, Fa(1e-5), IN(dy, x, w)));
    /* the weight gradients read a dy of their own: with the dy and x of a *_BWD_X case the pair
     * may run as one fused pass at the later node's place (fuse_norm_grads, where the row
     * length allows it: C is drawn at random), and a case run alone at the other place would
     * then run nothing; build_norm_grads tests the fused pass */
    Node *dyg = leaf(FMT_BF16, 1, DIMS(R, C));
    add_case("layernorm_bwd_w", 2e-5, op_v(OP_LAYERNORM_BWD_W, FMT_F32, NULL, Fa(1e-5), IN(dyg, x)));
    add_case("rmsnorm_bwd_x f32", 2e-5, op_v(OP_RMSNORM_BWD_X, FMT_F32, NULL, Fa(1e-6), IN(dy, x, w)));
    add_case("rmsnorm_bwd_w bf16", 1e-2, op_v(OP_RMSNORM_BWD_W, FMT_BF16, NULL, Fa(1e-6), IN(dyg, x)));
    Node *dy8 = leaf(FMT_BF16, 1, DIMS(R, C8)), *dyw = leaf(FMT_BF16, 1, DIMS(R, C8));
    /* a dy of its own: with the same dy and x the two would run as one fused pass (below) */
    add_case("layernorm_bwd_w, vector columns", 2e-5, op_v(OP_LAYERNORM_BWD_W, FMT_F32, NULL, Fa(1e-5), IN(dyw, x8)));
    add_case("layernorm_bwd_x, vector rows", 1e-2, op_v(OP_LAYERNORM_BWD_X, FMT_BF16, NULL, Fa(1e-5), IN(dy8, x8, w8)));
    Node *xs = leaf(FMT_F32, 3, DIMS(R, 77));
    Node *sm = add_case("softmax", 2e-5, op_v(OP_SOFTMAX, FMT_F32, NULL, NULL, IN(xs)));
    Node *dys = leaf(FMT_F32, 1, DIMS(R, 77));
    add_case("softmax_bwd", 2e-5, op_v(OP_SOFTMAX_BWD, FMT_F32, NULL, NULL, IN(dys, sm)));
    int64_t V = gt_int(2, 700);
    Node *logits = leaf(FMT_BF16, 3, DIMS(R, V)), *tgt = ids(V, 0.1, DIMS(R));
    add_case("cross_entropy", 2e-5, op_v(OP_CROSS_ENTROPY, FMT_F32, NULL, NULL, IN(logits, tgt)));
    Node *dl = ir_leaf(graph, OP_INPUT, "dl", ROLE_INPUT, FMT_F32, 0, NULL, here);
    fill_of(dl)->mag = 1;
    add_case("cross_entropy_bwd", 1e-2, op_v(OP_CROSS_ENTROPY_BWD, FMT_BF16, NULL, NULL, IN(dl, logits, tgt)));
    /* a backward right after its forward runs with it as one pass over the logits (spec_fuse.c,
     * fuse_ce_one_pass), at 1024 threads each row held in registers where it fits: these pairs
     * run in this order, nothing between. Rows of a multiple of 8 logits are read 8 a load; GPT-2's 50304 bf16
     * logits and 20000 f32 ones fill 1024-thread blocks held in registers, f32 rows of 50304 and
     * the unpadded 50257 do not fit (read again from L2, 8 or 1 a load); over a thousand rows
     * (the count of valid targets in several steps, more blocks than threads) */
    int64_t V8 = 8 * gt_int(2, 300), RV = gt_int(1, 40), RM = gt_int(1025, 2100), VM = 8 * gt_int(2, 40);
    ce_pair("vector rows", FMT_BF16, R, V8, true, dl);
    ce_pair("50304 logits", FMT_BF16, RV, 50304, true, dl);
    ce_pair("20000 f32 logits", FMT_F32, RV, 20000, true, dl);
    ce_pair("50304 f32 logits", FMT_F32, RV, 50304, false, dl);
    ce_pair("50257 logits", FMT_BF16, RV, 50257, false, dl);
    ce_pair("many rows", FMT_BF16, RM, VM, true, dl);
    /* the loss's choices: smaller blocks with rows in shared memory (at most 110 KiB a row:
     * GPT-2's bf16 rows, Llama 2's, f32 rows of 20000), two a block that walks its rows (the
     * default, ce.ring) or one (ce.ring=0), or read twice (ce.shared=0, f32 rows of 50304, rows
     * not in whole vectors), ex2.approx for the exponentials in each way of holding a row;
     * rows under 16384 logits keep 256 threads and their registers (1000) or are read twice,
     * one a load (77); over a thousand rows of 16392 (blocks of 256 count the targets in steps;
     * in a ring, each block walks several rows, ignored ones among them) */
    CeChoice s512x = {"512", "1", NULL, NULL}, s256 = {"256", NULL, NULL, NULL}, s256x = {"256", "1", NULL, NULL};
    CeChoice o512x = {"512", "1", NULL, "0"}, o256x = {"256", "1", NULL, "0"};
    CeChoice l2_512x = {"512", "1", "0", NULL}, r1024x = {"1024", "1", NULL, NULL};
    int64_t RS = gt_int(1025, 1600);
    ce_pair_chosen("50304 logits, the default", FMT_BF16, RV, 50304, CE_IN_RING, dl, ce_default);
    ce_pair_chosen("50304 logits, 512 shared ex2", FMT_BF16, RV, 50304, CE_IN_RING, dl, s512x);
    ce_pair_chosen("50304 logits, 512 a row ex2", FMT_BF16, RV, 50304, CE_IN_SHARED, dl, o512x);
    ce_pair_chosen("50304 logits, 256 shared", FMT_BF16, RV, 50304, CE_IN_RING, dl, s256);
    ce_pair_chosen("50304 logits, 512 twice ex2", FMT_BF16, RV, 50304, CE_READ_TWICE, dl, l2_512x);
    ce_pair_chosen("50304 logits, 1024 ex2", FMT_BF16, RV, 50304, CE_IN_REGISTERS, dl, r1024x);
    ce_pair_chosen("32000 logits, 256 shared ex2", FMT_BF16, RV, 32000, CE_IN_RING, dl, s256x);
    ce_pair_chosen("20000 f32 logits, 512 shared ex2", FMT_F32, RV, 20000, CE_IN_RING, dl, s512x);
    ce_pair_chosen("20000 f32 logits, 512 a row ex2", FMT_F32, RV, 20000, CE_IN_SHARED, dl, o512x);
    ce_pair_chosen("50304 f32 logits, 512 ex2", FMT_F32, RV, 50304, CE_READ_TWICE, dl, s512x);
    ce_pair_chosen("50257 logits, 512 ex2", FMT_BF16, RV, 50257, CE_READ_TWICE, dl, s512x);
    ce_pair_chosen("1000 logits, ex2", FMT_BF16, R, 1000, CE_IN_REGISTERS, dl, s512x);
    ce_pair_chosen("77 f32 logits, ex2", FMT_F32, R, 77, CE_READ_TWICE, dl, s512x);
    ce_pair_chosen("many rows, 256 shared ex2", FMT_BF16, RS, 16392, CE_IN_RING, dl, s256x);
    ce_pair_chosen("many rows, 256 a row ex2", FMT_BF16, RS, 16392, CE_IN_SHARED, dl, o256x);
    /* long f32 rows (80 and 128 KB), backwards on their own */
    Node *tgt20 = ids(20000, 0.1, DIMS(RV)), *tgt32 = ids(32768, 0.1, DIMS(RV));
    Node *l20 = leaf(FMT_F32, 3, DIMS(RV, 20000)), *l32 = leaf(FMT_F32, 3, DIMS(RV, 32768));
    add_case("cross_entropy_bwd, 20000 f32 logits", 2e-5,
             op_v(OP_CROSS_ENTROPY_BWD, FMT_F32, NULL, NULL, IN(dl, l20, tgt20)));
    add_case("cross_entropy_bwd, 32768 f32 logits", 2e-5,
             op_v(OP_CROSS_ENTROPY_BWD, FMT_F32, NULL, NULL, IN(dl, l32, tgt32)));
    int64_t R2 = gt_int(1, 5000);
    Node *big = leaf(FMT_BF16, 1, DIMS(R2, C));
    add_case("sum_rows", 2e-5, op_v(OP_SUM_ROWS, FMT_F32, NULL, NULL, IN(big)));
    Node *big8 = leaf(FMT_BF16, 1, DIMS(R2, C8));
    add_case("sum_rows, vector columns", 2e-5, op_v(OP_SUM_ROWS, FMT_F32, NULL, NULL, IN(big8)));
    add_case("sqnorm", 2e-5, op_v(OP_SQNORM, FMT_F32, NULL, NULL, IN(big)));
    int64_t Ve = gt_int(2, 60);
    Node *tk = ids(Ve, 0, DIMS(R2));
    Node *dye = leaf(FMT_BF16, 1, DIMS(R2, C));
    add_case("embedding_bwd", 2e-5, op_v(OP_EMBEDDING_BWD, FMT_F32, I(Ve), NULL, IN(dye, tk)));
    /* a few ids of thousands of rows each (sorted through the bitmap), rows wider than a block */
    int64_t R3 = gt_int(2000, 6000), C3 = gt_int(257, 700);
    Node *tk3 = ids(3, 0, DIMS(R3));
    add_case("embedding_bwd, frequent ids", 2e-5,
             op_v(OP_EMBEDDING_BWD, FMT_F32, I(3), NULL, IN(leaf(FMT_BF16, 1, DIMS(R3, C3)), tk3)));
    /* the same in whole vectors of columns: a frequent id's rows are cut among a block's warps */
    int64_t C5 = 8 * gt_int(33, 100);
    Node *tk5 = ids(5, 0, DIMS(R3));
    add_case("embedding_bwd, frequent ids, vector rows", 2e-5,
             op_v(OP_EMBEDDING_BWD, FMT_F32, I(5), NULL, IN(leaf(FMT_BF16, 1, DIMS(R3, C5)), tk5)));
    /* more rows than the bitmap holds: every bucket ranked */
    int64_t R4 = 32 * 4096 + gt_int(1, 3000);
    Node *tk4 = ids(40, 0, DIMS(R4));
    add_case("embedding_bwd, rows past the bitmap", 2e-5,
             op_v(OP_EMBEDDING_BWD, FMT_F32, I(40), NULL, IN(leaf(FMT_BF16, 1, DIMS(R4, 8)), tk4)));
}

static void build_quant(void) {
    group_now = "scaling";
    int64_t R = gt_int(1, 300), C = 16 * gt_int(1, 20);
    Node *x = leaf(FMT_BF16, 3, DIMS(R, C));
    add_case("quant_scale tensor", 0, op_v(OP_QUANT_SCALE, FMT_F32, I(FMT_E4M3, SCALE_PER_TENSOR, 0, 0), NULL, IN(x)));
    add_case("quant_scale row", 0, op_v(OP_QUANT_SCALE, FMT_F32, I(FMT_E5M2, SCALE_PER_ROW, 0, 1), NULL, IN(x)));
    add_case("quant_scale group", 0, op_v(OP_QUANT_SCALE, FMT_F32, I(FMT_E4M3, SCALE_PER_GROUP, 16, 0), NULL, IN(x)));
    add_case("quant_scale block", 0, op_v(OP_QUANT_SCALE, FMT_F32, I(FMT_E4M3, SCALE_BLOCK_128, 0, 0), NULL, IN(x)));
    Node *hist = leaf(FMT_F32, 1, DIMS(8));
    hist->t.role = ROLE_AMAX_HISTORY;
    add_case("amax_record", 0, op_v(OP_AMAX_RECORD, FMT_F32, NULL, NULL, IN(hist, x)));
    Node *state = ir_leaf(graph, OP_INPUT, "state", ROLE_INPUT, FMT_F32, 0, NULL, here);
    fill_of(state)->mag = 1;
    Node *hist2 = leaf(FMT_F32, 1, DIMS(16));
    add_case("delayed_scale", 0, op_v(OP_DELAYED_SCALE, FMT_F32, I(FMT_E4M3, 0, 1), NULL, IN(state, hist2)));
}

/* ---------------------------------------------------------------- block maxima
 * A value with amax=1 (ops.def) gets its per-tensor scale from the block maxima its producer
 * left after it. Each pair runs the producer and then the scale on the GPU: the value must
 * match the reference's within its format's bound, and the scale must equal, bit for bit, the
 * reference's scale of the value the GPU stored. The pairs cover the vector and scalar paths,
 * grids capped at the slot count (more blocks of work than slots: the kernels stride), the
 * pass that writes the maxima after an ADD_N of more inputs than one launch takes, and the
 * binary ops (SwiGLU's product, a residual or bias add). */
typedef struct {
    const char *name;
    Node *producer, *scale;
} AmaxPair;
static AmaxPair amax_pairs[20];
static int n_amax_pairs;

static void amax_pair(const char *name, Node *p, ElemType e) {
    assert_true(n_amax_pairs < 20);
    ir_set_keeps_amax(p);
    p->t.name = name;
    Node *q = op_v(OP_QUANT_SCALE, FMT_F32, I(e, SCALE_PER_TENSOR, 0, 0), NULL, IN(p));
    amax_pairs[n_amax_pairs++] = (AmaxPair){name, p, q};
}

static void build_amax(void) {
    int64_t R = gt_int(1, 300), C = 8 * gt_int(1, 40);
    Node *x = leaf(FMT_BF16, 2, DIMS(R, C)), *y = leaf(FMT_BF16, 2, DIMS(R, C));
    Node *xf = leaf(FMT_F32, 2, DIMS(R, C)), *wf = leaf(FMT_F32, 1, DIMS(C));
    amax_pair("gelu", op_v(OP_GELU, FMT_BF16, NULL, NULL, IN(x)), FMT_E4M3);
    int64_t Ro = gt_int(1, 50), Co = 2 * gt_int(1, 50) + 1;   /* odd rows: the scalar path */
    Node *xo = leaf(FMT_BF16, 2, DIMS(Ro, Co)), *yo = leaf(FMT_BF16, 2, DIMS(Ro, Co));
    amax_pair("gelu_bwd, odd columns", op_v(OP_GELU_BWD, FMT_BF16, NULL, NULL, IN(yo, xo)), FMT_E5M2);
    Node *big = leaf(FMT_BF16, 2, DIMS(1100, 2048));
    amax_pair("gelu, 2.25M elements", op_v(OP_GELU, FMT_BF16, NULL, NULL, IN(big)), FMT_E4M3);
    int64_t Rn = 8192 + gt_int(1, 2000), Cn = 8 * gt_int(1, 16);   /* more warps than slots */
    Node *xn = leaf(FMT_BF16, 1, DIMS(Rn, Cn)), *dyn = leaf(FMT_BF16, 1, DIMS(Rn, Cn));
    Node *w = leaf(FMT_BF16, 1, DIMS(Cn)), *b = leaf(FMT_BF16, 1, DIMS(Cn));
    amax_pair("layernorm, 8K+ rows", op_v(OP_LAYERNORM, FMT_BF16, NULL, Fa(1e-5), IN(xn, w, b)), FMT_E4M3);
    amax_pair("layernorm_bwd_x, 8K+ rows", op_v(OP_LAYERNORM_BWD_X, FMT_BF16, NULL, Fa(1e-5), IN(dyn, xn, w)),
              FMT_E5M2);
    amax_pair("rmsnorm f32", op_v(OP_RMSNORM, FMT_F32, NULL, Fa(1e-6), IN(xf, wf)), FMT_E4M3);
    amax_pair("add_n 3", op_v(OP_ADD_N, FMT_BF16, NULL, NULL, IN(x, y, xf)), FMT_E5M2);
    /* SwiGLU's product and residual adds: binary ops, vector path, and scalar with a bias */
    amax_pair("mul (SwiGLU's product)", op_v(OP_MUL, FMT_BF16, NULL, NULL, IN(x, y)), FMT_E4M3);
    Node *bo = leaf(FMT_BF16, 1, DIMS(Co));
    amax_pair("add of a bias, odd columns", op_v(OP_ADD, FMT_BF16, NULL, NULL, IN(xo, bo)), FMT_E4M3);
    Node *big2 = leaf(FMT_BF16, 2, DIMS(1100, 2048));
    amax_pair("sub, 2.25M elements", op_v(OP_SUB, FMT_BF16, NULL, NULL, IN(big, big2)), FMT_E5M2);
    Node *many[23];
    for (int i = 0; i < 23; i++) many[i] = i % 2 ? x : y;
    amax_pair("add_n 23 (a pass after it)", op_v(OP_ADD_N, FMT_BF16, NULL, NULL, 23, many), FMT_E5M2);
    /* a grouped-query attention's backward: dv sliced out of the packed dq|dk|dv (whole
     * vectors, and odd columns: the scalar path), dk rotated back by RoPE (vectors, and heads
     * of 6: the scalar path) */
    int64_t Tq = gt_int(2, 300), Dh = 8 * gt_int(1, 8);
    Node *dqkv = leaf(FMT_BF16, 2, DIMS(Tq, 6 * Dh));
    amax_pair("slice dv of dq|dk|dv", op_v(OP_SLICE, FMT_BF16, I(1, 5 * Dh, Dh), NULL, IN(dqkv)), FMT_E5M2);
    amax_pair("slice, odd columns", op_v(OP_SLICE, FMT_BF16, I(1, 1, Co - 2), NULL, IN(xo)), FMT_E5M2);
    Node *dk = leaf(FMT_BF16, 3, DIMS(2, Tq, 2 * Dh)), *dk6 = leaf(FMT_BF16, 3, DIMS(2, Tq, 12));
    amax_pair("rope inverse (dk)", op_v(OP_ROPE, FMT_BF16, I(Dh, 1), Fa(10000.0), IN(dk)), FMT_E5M2);
    amax_pair("rope inverse, heads of 6", op_v(OP_ROPE, FMT_BF16, I(6, 1), Fa(10000.0), IN(dk6)), FMT_E5M2);
}

/* ---------------------------------------------------------------- transposed copies
 * A QUANTIZE with transposed=1 writes its result and, after it, the transposed copy that the
 * FP8 GEMMs reading it transposed take. The result must equal the reference's bytes, the copy
 * must be the result's bytes transposed (a wide shape, 16-byte path; an odd one, element
 * path), and a weight-gradient GEMM reading the copy must match the reference. */
static Node *quant_t[2];

static void build_quant_transposed(void) {
    int64_t M = 16 * gt_int(2, 20), N = 16 * gt_int(2, 20), K = 16 * gt_int(2, 20);
    int64_t shapes[2][2] = {{M, N}, {2 * gt_int(1, 60) + 1, 2 * gt_int(1, 60) + 1}};
    for (int k = 0; k < 2; k++) {
        Node *x = leaf(FMT_BF16, 1, DIMS(shapes[k][0], shapes[k][1]));
        Node *st = scales(0, 0, 1);
        Node *q = op_v(OP_QUANTIZE, FMT_E5M2, I(1), NULL, IN(x, st));
        q->t.fmt.scaling = SCALE_PER_TENSOR, q->t.fmt.recipe = RECIPE_CURRENT, q->t.fmt.scale = st;
        q->t.name = k ? "quantize e5m2, odd shape, transposed kept" : "quantize e5m2, transposed kept";
        quant_t[k] = q;
    }
    group_now = "gemm";
    Node *sx = scales(0, 0, 1);
    Node *x8 = leaf_fmt("x8", FMT_E4M3, SCALE_PER_TENSOR, 0, sx, 1, DIMS(M, K));
    add_case("matmul e5m2^T (kept copy) x e4m3", 5e-4, op_v(OP_MATMUL, FMT_F32, I(1, 0), NULL, IN(quant_t[0], x8)));
}

static void test_quantize_transposed(void **s) {
    (void)s;
    int failed = 0;
    for (int k = 0; k < 2; k++) {
        Node *q = quant_t[k];
        int64_t R = q->t.dims[0], C = q->t.dims[1], off = ir_transposed_offset(q);
        assert_true(off > 0);
        Tensor copy = q->t;   /* the host mirror's bytes of the transposed copy */
        copy.data = (char *)q->t.data + off;
        Tensor *out[2] = {&q->t, &copy};
        unsigned char *gpu = malloc((size_t)(2 * R * C));
        bool ok = cuda_exec_run_node(exec, q) && cuda_exec_pull(exec, out, 2);
        if (ok) {
            memcpy(gpu, q->t.data, (size_t)(R * C));
            memcpy(gpu + R * C, copy.data, (size_t)(R * C));
            ref_exec_node(q);
        }
        int64_t bad_y = 0, bad_t = 0;
        for (int64_t r = 0; ok && r < R; r++)
            for (int64_t c = 0; c < C; c++) {
                bad_y += gpu[r * C + c] != ((unsigned char *)q->t.data)[r * C + c];
                bad_t += gpu[R * C + c * R + r] != gpu[r * C + c];
            }
        printf("  %-40s [%lld x %lld] result bytes differing %lld, copy bytes not transposed %lld%s\n",
               q->t.name, (long long)R, (long long)C, (long long)bad_y, (long long)bad_t,
               ok && !bad_y && !bad_t ? "" : "  FAIL");
        failed += !ok || bad_y || bad_t;
        free(gpu);
        if (!cuda_exec_push(exec, out, 1)) failed++;
    }
    if (failed) fail_msg("%d transposed quantizations differ", failed);
}

/* ---------------------------------------------------------------- cast-transpose in the quantize
 * A TRANSPOSE of a per-tensor FP8 copy is written by the launch that writes the copy
 * (spec_fuse.c, fuse_cast_transposes), which is then the only one to run: a plain quantize
 * (16-byte path), the second of two quantizes of the same value through the same scale (the
 * first writes both; an odd shape, element path), a GELU and a layernorm that write their
 * own copy (fuse_producer_quantizes: the block maxima first, then the copy computed from the
 * inputs; the layernorm's by 64 x 64 tiles from the row statistics its first pass kept), and
 * an RMSNorm of rows longer than 1280 (tiles too); the same two norms again with the choice
 * fuse.norm_stats=0, by bands of 32 and 16 rows (ck_norm_t).
 * The copy must be the reference's bytes (for the GELU, whose value the GPU computes in f32,
 * within the FP8 bound of a computed value, its scale within 1e-2), the transposed copy
 * exactly the copy's bytes transposed. */
typedef struct {
    const char *name;
    Node *run[5];   /* the nodes in schedule order */
    int n_run;
    Node *copy, *t;   /* the copy that the fused launch writes, the TRANSPOSE */
    Node *scale;      /* made by the case (the GELU's), or NULL */
    const char *fn;   /* the fused launch's kernel: quantt, or normt (bands of rows) */
} CastT;
#define N_CAST_T 7
static CastT cast_t[N_CAST_T];

static Node *per_tensor_copy(Node *x, Node *sc, ElemType e) {
    Node *q = op_v(OP_QUANTIZE, e, NULL, NULL, IN(x, sc));
    q->t.fmt.scaling = SCALE_PER_TENSOR, q->t.fmt.recipe = RECIPE_CURRENT, q->t.fmt.scale = sc;
    return q;
}
static Node *transpose_of(Node *q) {
    Node *t = op_v(OP_TRANSPOSE, q->t.fmt.elem, NULL, NULL, IN(q));
    t->t.fmt = q->t.fmt;
    return t;
}

/* A norm (LN: a layernorm with its bias, else an RMSNorm) of fresh (R, C) rows writing its FP8
 * copy, whose transpose the case checks */
static CastT norm_cast_t(const char *name, bool ln, int64_t R, int64_t C) {
    Node *x = leaf(FMT_BF16, 2, DIMS(R, C)), *w = leaf(FMT_BF16, 1, DIMS(C));
    Node *y = ln ? op_v(OP_LAYERNORM, FMT_BF16, NULL, Fa(1e-5), IN(x, w, leaf(FMT_BF16, 1, DIMS(C))))
                 : op_v(OP_RMSNORM, FMT_BF16, NULL, Fa(1e-5), IN(x, w));
    ir_set_keeps_amax(y);
    Node *s = op_v(OP_QUANT_SCALE, FMT_F32, I(FMT_E4M3, SCALE_PER_TENSOR, 0, 0), NULL, IN(y));
    Node *q = per_tensor_copy(y, s, FMT_E4M3), *t = transpose_of(q);
    return (CastT){name, {y, s, q, t}, 4, q, t, s, NULL};
}

static void build_cast_transposes(void) {
    int64_t R = 16 * gt_int(2, 40), C = 16 * gt_int(2, 40);
    Node *x = leaf(FMT_BF16, 1, DIMS(R, C)), *st = scales(0, 0, 1);
    Node *q = per_tensor_copy(x, st, FMT_E4M3);
    cast_t[0] = (CastT){"quantize + transpose", {q, transpose_of(q)}, 2, q, NULL, NULL, NULL};
    cast_t[0].t = cast_t[0].run[1];
    int64_t Ro = 2 * gt_int(1, 60) + 1, Co = 2 * gt_int(1, 60) + 1;
    Node *xo = leaf(FMT_BF16, 1, DIMS(Ro, Co)), *so = scales(0, 0, 1);
    Node *q1 = per_tensor_copy(xo, so, FMT_E5M2), *q2 = per_tensor_copy(xo, so, FMT_E5M2), *t2 = transpose_of(q2);
    cast_t[1] = (CastT){"two quantizes + transpose, odd shape", {q1, q2, t2}, 3, q1, t2, NULL, NULL};
    Node *h = leaf(FMT_BF16, 2, DIMS(R, 3 * C));
    Node *y = op_v(OP_GELU, FMT_BF16, NULL, NULL, IN(h));
    ir_set_keeps_amax(y);
    Node *sy = op_v(OP_QUANT_SCALE, FMT_F32, I(FMT_E4M3, SCALE_PER_TENSOR, 0, 0), NULL, IN(y));
    Node *qy = per_tensor_copy(y, sy, FMT_E4M3), *ty = transpose_of(qy);
    cast_t[2] = (CastT){"gelu's copy + transpose", {y, sy, qy, ty}, 4, qy, ty, sy, NULL};
    /* a layernorm writing its copy: rows of whole vectors, a multiple of 32 (the bands' rows) */
    int64_t Rn = 32 * gt_int(1, 40), Cn = 16 * gt_int(1, 80);
    cast_t[3] = norm_cast_t("layernorm's copy + transpose", true, Rn, Cn);
    /* rows longer than 1280 (Llama's 2048, GPT-2 d48's 1600): bands of 16 rows, here an odd
     * number of them */
    int64_t Rw = 16 * (2 * gt_int(1, 20) + 1), Cw = 16 * gt_int(81, 128);
    cast_t[4] = norm_cast_t("rmsnorm's copy + transpose, long rows", false, Rw, Cw);
    /* the two norms again, by bands of rows */
    cast_t[5] = norm_cast_t("layernorm's copy + transpose, bands", true, Rn, Cn);
    cast_t[6] = norm_cast_t("rmsnorm's copy + transpose, long rows, bands", false, Rw, Cw);
    for (int k = 5; k < 7; k++)
        ir_set_choice(graph, arena_printf(arena, "fuse.norm_stats@%d", cast_t[k].run[0]->id), "0");
    for (int k = 0; k < N_CAST_T; k++) {
        cast_t[k].copy->t.name = cast_t[k].name;
        cast_t[k].fn = k >= 5 ? "normt" : "quantt";
    }
}

/* one quantt launch, at the copy's place; nothing at the transpose's (or the second copy's) */
static bool cast_t_fused(const CuNodePlan *plans, const CastT *c) {
    int launches = 0;
    for (int i = 0; i < c->n_run; i++)
        if (c->run[i] != c->copy && c->run[i] != c->scale && c->run[i]->op != OP_GELU &&
            c->run[i]->op != OP_LAYERNORM && c->run[i]->op != OP_RMSNORM)
            launches += plans[c->run[i]->index].n_launch;
    const CuNodePlan *pq = &plans[c->copy->index];
    return launches == 0 && pq->n_launch == 1 && !strncmp(pq->launch[0].fn, c->fn, strlen(c->fn));
}

static void test_cast_transposes(void **s) {
    (void)s;
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int failed = 0;
    for (int k = 0; k < N_CAST_T; k++) {
        CastT *c = &cast_t[k];
        bool fused = cast_t_fused(plans, c);
        Node *q = c->copy;
        int64_t R = q->t.dims[0], C = q->t.dims[1];
        Tensor *out[3] = {&q->t, &c->t->t, c->scale ? &c->scale->t : NULL};
        int n_out = c->scale ? 3 : 2;
        for (int j = 0; j < n_out; j++) memset(out[j]->data, 0xFF, (size_t)gt_bytes(out[j]));   /* poisoned */
        bool ok = cuda_exec_push(exec, out, n_out);
        for (int i = 0; ok && i < c->n_run; i++) ok = cuda_exec_run_node(exec, c->run[i]);
        ok = ok && cuda_exec_pull(exec, out, n_out);
        unsigned char *gq = malloc((size_t)(R * C)), *gt = malloc((size_t)(R * C));
        float gs = c->scale ? *(float *)c->scale->t.data : 0.0f;
        memcpy(gq, q->t.data, (size_t)(R * C));
        memcpy(gt, c->t->t.data, (size_t)(R * C));
        int64_t bad_t = 0, bad_q = 0;
        double e = 0;
        if (ok) {
            for (int i = 0; i < c->n_run; i++)
                if (c->run[i]->op != OP_TRANSPOSE) ref_exec_node(c->run[i]);
            for (int64_t r = 0; r < R; r++)
                for (int64_t j = 0; j < C; j++) bad_t += gt[j * R + r] != gq[r * C + j];
            if (c->scale) {   /* computed in f32 on the GPU (GELU; the norm's statistics), f64 in the reference */
                Tensor as_gpu = q->t;
                as_gpu.data = gq;
                float *a = ref_load(&as_gpu), *r = ref_load(&q->t);
                double max_abs;
                e = gt_norm_error(a, r, R * C, &max_abs);
                free(a);
                free(r);
                float rs = *(float *)c->scale->t.data;
                if (!(fabsf(gs - rs) <= 1e-2f * rs)) e = -1;
            } else {
                for (int64_t i = 0; i < R * C; i++) bad_q += gq[i] != ((unsigned char *)q->t.data)[i];
            }
        }
        bool pass = ok && fused && !bad_t && !bad_q && e >= 0 && e <= 0.1;
        printf("  %-40s [%lld x %lld] %s, copy bytes differing %lld (err %.2e), transposed bytes off %lld%s\n",
               c->name, (long long)R, (long long)C, fused ? "one launch" : "NOT FUSED", (long long)bad_q, e,
               (long long)bad_t, pass ? "" : "  FAIL");
        failed += !pass;
        free(gq);
        free(gt);
    }
    arena_free(pa);
    if (failed) fail_msg("%d cast-transposes differ", failed);
}

/* ---------------------------------------------------------------- a norm's backward in one pass
 * The nodes of a norm's backward that read the same dy and x — the input gradient, the weight's
 * and the bias's gradients, and the ADD_N of the input gradient and another term — run as one
 * fused pass (spec_fuse.c, fuse_norm_grads): the other nodes' places run nothing. Run in
 * order, every result must match the reference, over fresh rows: rows of up to 512 take a
 * warp each (ck_norm_bwd_fused), longer ones a block each (ck_norm_bwd_block, the choice
 * norm.bwd_block) or, with the choice off for the node, a warp each again. A LayerNorm of 384
 * with its sum (the other term first); GPT-2 d12's 768 (blocks of 96 threads) with its sum,
 * and again a warp a row with the other term second; a Llama-length RMSNorm with no sum; a
 * LayerNorm of GPT-2 d48's 1600 (200 vectors in blocks of 224 threads) with its sum (the
 * other term second); an RMSNorm of 4096 (two vectors a thread) with a sum; the Llama-length
 * RMSNorm with a sum, a warp a row. */
typedef struct {
    const char *name, *kernel;
    Node *members[4];   /* in schedule order */
    int n;
} NormGroup;
enum { NORM_GROUPS = 7 };
static NormGroup norm_groups[NORM_GROUPS];

static void build_norm_grads(void) {
    /* more rows than a grid of blocks a row has blocks (1024 at most): blocks take two rows
     * or three, whose block sums alternate between two slots */
    int64_t R = gt_int(1200, 3000);
    static const struct {
        const char *name, *kernel;
        int64_t C;
        bool ln;
        int sum;   /* 0: none, 1: the other term first, 2: second */
        bool warps;
    } shapes[NORM_GROUPS] = {
        {"layernorm 384 backward + bias + sum", "ck_norm_bwd_fused<", 384, true, 1, false},
        {"layernorm 768 backward + bias + sum", "ck_norm_bwd_block<", 768, true, 1, false},
        {"layernorm 768 backward + bias + sum, a warp a row", "ck_norm_bwd_fused<", 768, true, 2, true},
        {"rmsnorm 2048 backward", "ck_norm_bwd_block<", 2048, false, 0, false},
        {"layernorm 1600 backward + bias + sum", "ck_norm_bwd_block<", 1600, true, 2, false},
        {"rmsnorm 4096 backward + sum", "ck_norm_bwd_block<", 4096, false, 1, false},
        {"rmsnorm 2048 backward + sum, a warp a row", "ck_norm_bwd_fused<", 2048, false, 1, true},
    };
    for (int k = 0; k < NORM_GROUPS; k++) {
        bool ln = shapes[k].ln;
        int64_t C = shapes[k].C;
        Node *x = leaf(FMT_BF16, 2, DIMS(R, C)), *dy = leaf(FMT_BF16, 1, DIMS(R, C));
        Node *w = leaf(FMT_BF16, 1, DIMS(C));
        NormGroup *g = &norm_groups[k];
        g->name = shapes[k].name, g->kernel = shapes[k].kernel;
        g->members[g->n++] = op_v(ln ? OP_LAYERNORM_BWD_W : OP_RMSNORM_BWD_W, FMT_BF16, NULL,
                                  Fa(ln ? 1e-5 : 1e-6), IN(dy, x));
        Node *bx = g->members[g->n++] = op_v(ln ? OP_LAYERNORM_BWD_X : OP_RMSNORM_BWD_X, FMT_BF16, NULL,
                                             Fa(ln ? 1e-5 : 1e-6), IN(dy, x, w));
        if (shapes[k].sum) {
            Node *other = leaf(FMT_BF16, 1, DIMS(R, C));
            g->members[g->n++] = shapes[k].sum == 1 ? op_v(OP_ADD_N, FMT_BF16, NULL, NULL, IN(other, bx))
                                                   : op_v(OP_ADD_N, FMT_BF16, NULL, NULL, IN(bx, other));
        }
        if (ln) g->members[g->n++] = op_v(OP_SUM_ROWS, FMT_F32, NULL, NULL, IN(dy));
        if (shapes[k].warps) ir_set_choice(graph, arena_printf(arena, "norm.bwd_block@%d", bx->id), "0");
    }
}

static void test_norm_grads_fused(void **s) {
    (void)s;
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int failed = 0;
    for (int k = 0; k < NORM_GROUPS; k++) {
        NormGroup *g = &norm_groups[k];
        int fused = 0;
        for (int i = 0; i < g->n; i++) {
            const CuNodePlan *p = &plans[g->members[i]->index];
            for (int l = 0; l < p->n_launch; l++) fused += strstr(p->launch[l].body, g->kernel) != NULL;
        }
        /* the results: every member's but the input gradient's, which the sum took */
        Tensor *out[4];
        const char *what[4];
        int n_out = 0;
        for (int i = 0; i < g->n; i++)
            if (i + 1 == g->n || g->members[i + 1]->op != OP_ADD_N) {
                what[n_out] = ir_op_info(g->members[i]->op)->text;
                out[n_out++] = &g->members[i]->t;
            }
        void *gpu[4];
        for (int j = 0; j < n_out; j++) memset(out[j]->data, 0xFF, (size_t)gt_bytes(out[j]));   /* poisoned */
        bool ok = cuda_exec_push(exec, out, n_out);
        for (int i = 0; ok && i < g->n; i++) ok = cuda_exec_run_node(exec, g->members[i]);
        ok = ok && cuda_exec_pull(exec, out, n_out);
        for (int j = 0; j < n_out; j++) {
            gpu[j] = malloc((size_t)gt_bytes(out[j]));
            memcpy(gpu[j], out[j]->data, (size_t)gt_bytes(out[j]));
        }
        for (int i = 0; ok && i < g->n; i++) ref_exec_node(g->members[i]);
        bool pass = ok && fused == 1;
        printf("  %-44s %s\n", g->name, fused == 1 ? g->kernel : "NOT FUSED AS EXPECTED  FAIL");
        for (int j = 0; ok && j < n_out; j++) {
            Tensor as_gpu = *out[j];
            as_gpu.data = gpu[j];
            float *a = ref_load(&as_gpu), *r = ref_load(out[j]);
            double max_abs, e = gt_norm_error(a, r, ir_numel(out[j]), &max_abs);
            /* bf16 results: a rounding apart at most; the column sums add in another order */
            bool one = e >= 0 && e <= 1e-2;
            printf("    %-38s %s[%lld] err %.2e (bound 1e-02)%s\n", what[j],
                   fmt_elem_name(out[j]->fmt.elem), (long long)ir_numel(out[j]), e, one ? "" : "  FAIL");
            pass = pass && one;
            free(a);
            free(r);
        }
        for (int j = 0; j < n_out; j++) free(gpu[j]);
        failed += !pass;
    }
    arena_free(pa);
    if (failed) fail_msg("%d fused norm backwards differ from the reference", failed);
}

/* ---------------------------------------------------------------- group scales made by the quantize
 * A QUANTIZE into per-group (or 1 x 128 tile) scales whose QUANT_SCALE reads the same x runs
 * both as one launch at the quantize's place (spec.c, fuse_group_quantizes): the scale's own
 * run does nothing, the quantize's writes the scales and the codes. Both must be the
 * reference's bytes: whole-vector groups (a thread per vector, shuffles), a 1 x 128 tile, and
 * rows whose last group is short (a thread per group). */
typedef struct {
    const char *name;
    Node *scale, *q;
} GroupPair;
static GroupPair group_pairs[3];

static void build_quant_group_fused(void) {
    int64_t R = gt_int(1, 300);
    struct { const char *name; Scaling kind; int G; int64_t C; ElemType se; } p[3] = {
        {"group 16, e8m0 scales", SCALE_PER_GROUP, 16, 16 * gt_int(1, 100), FMT_E8M0},
        {"1x128 tiles, f32 scales", SCALE_TILE_1x128, 128, 128 * gt_int(1, 8), FMT_F32},
        {"group 16, short last group", SCALE_PER_GROUP, 16, 16 * gt_int(1, 40) + 8, FMT_E8M0},
    };
    for (int k = 0; k < 3; k++) {
        Node *x = leaf(FMT_BF16, 3, DIMS(R, p[k].C));
        Node *sc = op_v(OP_QUANT_SCALE, p[k].se, I(FMT_E4M3, p[k].kind, p[k].G, 1), NULL, IN(x));
        Node *q = op_v(OP_QUANTIZE, FMT_E4M3, NULL, NULL, IN(x, sc));
        q->t.fmt.scaling = p[k].kind, q->t.fmt.group = p[k].kind == SCALE_PER_GROUP ? p[k].G : 0;
        q->t.fmt.recipe = RECIPE_CURRENT, q->t.fmt.scale = sc;
        group_pairs[k] = (GroupPair){p[k].name, sc, q};
    }
}

static void test_quantize_group_fused(void **s) {
    (void)s;
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int failed = 0;
    for (int k = 0; k < 3; k++) {
        GroupPair *c = &group_pairs[k];
        const CuNodePlan *ps = &plans[c->scale->index], *pq = &plans[c->q->index];
        bool fused = ps->n_launch == 0 && pq->n_launch == 1 && !strncmp(pq->launch[0].fn, "qgroup", 6);
        Tensor *out[2] = {&c->q->t, &c->scale->t};
        int64_t nb[2] = {gt_bytes(out[0]), gt_bytes(out[1])};
        unsigned char *gpu[2];
        for (int j = 0; j < 2; j++) {
            gpu[j] = malloc((size_t)nb[j]);
            memset(out[j]->data, 0xFF, (size_t)nb[j]);   /* poisoned: every byte must be written */
        }
        bool ok = cuda_exec_push(exec, out, 2) && cuda_exec_run_node(exec, c->scale) &&
                  cuda_exec_run_node(exec, c->q) && cuda_exec_pull(exec, out, 2);
        int64_t bad[2] = {0, 0};
        if (ok) {
            for (int j = 0; j < 2; j++) memcpy(gpu[j], out[j]->data, (size_t)nb[j]);
            ref_exec_node(c->scale);
            ref_exec_node(c->q);
            for (int j = 0; j < 2; j++)
                for (int64_t i = 0; i < nb[j]; i++) bad[j] += gpu[j][i] != ((unsigned char *)out[j]->data)[i];
        }
        bool pass = ok && fused && !bad[0] && !bad[1];
        printf("  %-40s [%lld x %lld] %s, code bytes differing %lld, scale bytes differing %lld%s\n", c->name,
               (long long)c->q->t.dims[0], (long long)c->q->t.dims[1], fused ? "one launch" : "NOT FUSED",
               (long long)bad[0], (long long)bad[1], pass ? "" : "  FAIL");
        failed += !pass;
        for (int j = 0; j < 2; j++) free(gpu[j]);
        if (!cuda_exec_push(exec, out, 2)) failed++;
    }
    arena_free(pa);
    if (failed) fail_msg("%d fused group quantizations differ from the reference", failed);
}

/* ---------------------------------------------------------------- input copies written by their reader
 * A GELU, SiLU or norm whose input x has a quantize into per-group scales right before it
 * (with its scales made in the same launch) writes that copy itself, from the x it reads
 * (spec_fuse.c, fuse_input_group_copies): the quantize runs nothing, the activation's launch
 * writes the copy, its scales and its own result. The copy and scales must be the
 * reference's bytes, the result within the bf16 bound: whole-vector groups (shuffles across
 * lanes), 1 x 128 tiles, and rows whose last group is short (a group a thread or lane). A
 * norm whose rows are whole vectors stages them through shared memory (spec_ops.c,
 * norm_stage: the launch has dynamic shared memory); rows of exactly a warp's vectors (768,
 * 2048) take the staged loop without column tests. */
typedef struct {
    const char *name;
    Node *scale, *q, *y;
    bool staged;   /* a norm expected to stage its rows */
} InputCopy;
enum { N_INPUT_COPIES = 8 };
static InputCopy input_copies[N_INPUT_COPIES];

static void build_input_copies(void) {
    int64_t R = gt_int(1, 300);
    struct { const char *name; OpKind op; Scaling kind; int G; int64_t C; ElemType se; bool staged; } p[N_INPUT_COPIES] = {
        {"gelu, group 16, e8m0 scales", OP_GELU, SCALE_PER_GROUP, 16, 16 * gt_int(1, 100), FMT_E8M0, false},
        {"silu, 1x128 tiles, f32 scales", OP_SILU, SCALE_TILE_1x128, 128, 128 * gt_int(1, 8), FMT_F32, false},
        {"gelu, group 16, short last group", OP_GELU, SCALE_PER_GROUP, 16, 16 * gt_int(1, 40) + 8, FMT_E8M0, false},
        {"layernorm, group 16 (staged rows)", OP_LAYERNORM, SCALE_PER_GROUP, 16, 16 * gt_int(1, 48), FMT_E8M0, true},
        {"rmsnorm, 1x128 tiles (staged rows)", OP_RMSNORM, SCALE_TILE_1x128, 128, 128 * gt_int(1, 6), FMT_F32, true},
        {"layernorm, short last group", OP_LAYERNORM, SCALE_PER_GROUP, 16, 16 * gt_int(1, 40) + 8, FMT_E8M0, false},
        {"layernorm, group 16, rows of 768", OP_LAYERNORM, SCALE_PER_GROUP, 16, 768, FMT_E8M0, true},
        {"rmsnorm, group 16, rows of 2048", OP_RMSNORM, SCALE_PER_GROUP, 16, 2048, FMT_E8M0, true},
    };
    for (int k = 0; k < N_INPUT_COPIES; k++) {
        Node *x = leaf(FMT_BF16, 3, DIMS(R, p[k].C));
        Node *sc = op_v(OP_QUANT_SCALE, p[k].se, I(FMT_E4M3, p[k].kind, p[k].G, 1), NULL, IN(x));
        Node *q = op_v(OP_QUANTIZE, FMT_E4M3, NULL, NULL, IN(x, sc));
        q->t.fmt.scaling = p[k].kind, q->t.fmt.group = p[k].kind == SCALE_PER_GROUP ? p[k].G : 0;
        q->t.fmt.recipe = RECIPE_CURRENT, q->t.fmt.scale = sc;
        Node *y;
        if (p[k].op == OP_GELU || p[k].op == OP_SILU) {
            y = op_v(p[k].op, FMT_BF16, NULL, NULL, IN(x));
        } else {
            Node *w = leaf(FMT_BF16, 1, DIMS(p[k].C));
            if (p[k].op == OP_LAYERNORM) {
                Node *b = leaf(FMT_BF16, 1, DIMS(p[k].C));
                y = op_v(OP_LAYERNORM, FMT_BF16, NULL, Fa(1e-5), IN(x, w, b));
            } else {
                y = op_v(OP_RMSNORM, FMT_BF16, NULL, Fa(1e-6), IN(x, w));
            }
        }
        input_copies[k] = (InputCopy){p[k].name, sc, q, y, p[k].staged};
    }
}

/* Runs `nodes` (graph order; the plans that fusion emptied run nothing) on the GPU and then on
 * the reference executor, from the same inputs, their outputs out[] poisoned first (every byte
 * must be written). bad[j]: the bytes of out[j] that differ from the reference's, for all but
 * the last; *err: the last output's normalized error. The reference's outputs go back to the
 * device for the cases after. False where a GPU call failed. */
static bool run_against_ref(Node *const *nodes, int n_nodes, Tensor *const *out, int n_out, int64_t *bad,
                            double *err) {
    int64_t nb[8];
    unsigned char *gpu[8];
    assert_true(n_out <= 8);
    for (int j = 0; j < n_out; j++) {
        nb[j] = gt_bytes(out[j]);
        gpu[j] = malloc((size_t)nb[j]);
        memset(out[j]->data, 0xFF, (size_t)nb[j]);
    }
    bool ok = cuda_exec_push(exec, out, n_out);
    for (int j = 0; j < n_nodes && ok; j++)
        if (nodes[j]) ok = cuda_exec_run_node(exec, nodes[j]);
    ok = ok && cuda_exec_pull(exec, out, n_out);
    *err = -1;
    if (ok) {
        for (int j = 0; j < n_out; j++) memcpy(gpu[j], out[j]->data, (size_t)nb[j]);
        for (int j = 0; j < n_nodes; j++)
            if (nodes[j]) ref_exec_node(nodes[j]);
        for (int j = 0; j < n_out - 1; j++) {
            bad[j] = 0;
            for (int64_t i = 0; i < nb[j]; i++) bad[j] += gpu[j][i] != ((unsigned char *)out[j]->data)[i];
        }
        Tensor y_gpu = *out[n_out - 1];
        y_gpu.data = gpu[n_out - 1];
        float *a = ref_load(&y_gpu), *r = ref_load(out[n_out - 1]);
        double max_abs;
        *err = gt_norm_error(a, r, ir_numel(out[n_out - 1]), &max_abs);
        free(a);
        free(r);
        ok = cuda_exec_push(exec, out, n_out);
    }
    for (int j = 0; j < n_out; j++) free(gpu[j]);
    return ok;
}

static void test_input_copies(void **s) {
    (void)s;
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int failed = 0;
    for (int k = 0; k < N_INPUT_COPIES; k++) {
        InputCopy *c = &input_copies[k];
        const CuNodePlan *pq = &plans[c->q->index], *py = &plans[c->y->index];
        bool fused = pq->n_launch == 0 && plans[c->scale->index].n_launch == 0 && py->n_launch == 1 &&
                     (strstr(py->launch[0].body, "ck_unary_group<") || strstr(py->launch[0].body, "ck_norm_group<")) &&
                     (py->launch[0].smem > 0) == c->staged;
        Tensor *out[3] = {&c->q->t, &c->scale->t, &c->y->t};
        Node *nodes[3] = {c->scale, c->q, c->y};
        int64_t bad[2] = {0, 0};
        double err;
        bool ok = run_against_ref(nodes, 3, out, 3, bad, &err);
        bool pass = ok && fused && !bad[0] && !bad[1] && err >= 0 && err <= 1e-2;
        printf("  %-42s [%lld x %lld] %s, code bytes differing %lld, scale bytes differing %lld, result err %.2e%s\n",
               c->name, (long long)c->q->t.dims[0], (long long)c->q->t.dims[1],
               fused ? (c->staged ? "one staged launch" : "one launch") : "NOT PLANNED AS EXPECTED",
               (long long)bad[0], (long long)bad[1], err, pass ? "" : "  FAIL");
        failed += !pass;
    }
    arena_free(pa);
    if (failed) fail_msg("%d activations writing their input's group copy differ from the reference", failed);
}

/* ---------------------------------------------------------------- a product writing its inputs' group copies
 * An ADD, SUB or MUL whose inputs (or, for an activation that only it reads, the activation's
 * input) have quantizes into per-group scales writes those copies itself (spec_fuse.c,
 * fuse_product_group_copies): SwiGLU's silu(gate) * up with gate's copy before the SiLU and
 * up's after the product, as Llama's -O3 schedule has them; both inputs in 1 x 128 tiles; one
 * input's copy only; and rows whose last group is short (the element-at-a-time path). The
 * copies and scales must be the reference's bytes, the product within the bf16 bound. */
typedef struct {
    const char *name;
    Node *act, *scale[2], *q[2], *y;
} ProductCopy;
enum { N_PRODUCT_COPIES = 4 };
static ProductCopy product_copies[N_PRODUCT_COPIES];

/* the group copy of x: its QUANT_SCALE and QUANTIZE */
static void group_copy(Node *x, Scaling kind, int G, ElemType se, Node **scale, Node **q) {
    *scale = op_v(OP_QUANT_SCALE, se, I(FMT_E4M3, kind, G, 1), NULL, IN(x));
    *q = op_v(OP_QUANTIZE, FMT_E4M3, NULL, NULL, IN(x, *scale));
    (*q)->t.fmt.scaling = kind, (*q)->t.fmt.group = kind == SCALE_PER_GROUP ? G : 0;
    (*q)->t.fmt.recipe = RECIPE_CURRENT, (*q)->t.fmt.scale = *scale;
}

static void build_product_copies(void) {
    int64_t R = gt_int(1, 300);
    struct {
        const char *name; OpKind op, act; Scaling kind; int G; int64_t C; ElemType se; bool copy[2];
    } p[N_PRODUCT_COPIES] = {
        {"silu(gate) * up, group 16 (SwiGLU)", OP_MUL, OP_SILU, SCALE_PER_GROUP, 16, 16 * gt_int(1, 100), FMT_E8M0, {true, true}},
        {"a * b, 1x128 tiles, f32 scales", OP_MUL, OP_CONST, SCALE_TILE_1x128, 128, 128 * gt_int(1, 8), FMT_F32, {true, true}},
        {"gelu(x) + b, x's copy only", OP_ADD, OP_GELU, SCALE_PER_GROUP, 16, 16 * gt_int(1, 100), FMT_E8M0, {true, false}},
        {"a - b, b's copy, short last group", OP_SUB, OP_CONST, SCALE_PER_GROUP, 16, 16 * gt_int(1, 40) + 8, FMT_E8M0, {false, true}},
    };
    for (int k = 0; k < N_PRODUCT_COPIES; k++) {
        ProductCopy *c = &product_copies[k];
        memset(c, 0, sizeof *c);
        c->name = p[k].name;
        Node *x[2] = {leaf(FMT_BF16, 3, DIMS(R, p[k].C)), leaf(FMT_BF16, 3, DIMS(R, p[k].C))}, *in0 = x[0];
        if (p[k].copy[0]) group_copy(x[0], p[k].kind, p[k].G, p[k].se, &c->scale[0], &c->q[0]);
        if (p[k].act != OP_CONST) in0 = c->act = op_v(p[k].act, FMT_BF16, NULL, NULL, IN(x[0]));
        c->y = op_v(p[k].op, FMT_BF16, NULL, NULL, IN(in0, x[1]));
        /* the second input's copy after the product: the product writes it early */
        if (p[k].copy[1]) group_copy(x[1], p[k].kind, p[k].G, p[k].se, &c->scale[1], &c->q[1]);
    }
}

static void test_product_copies(void **s) {
    (void)s;
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int failed = 0;
    for (int k = 0; k < N_PRODUCT_COPIES; k++) {
        ProductCopy *c = &product_copies[k];
        const CuNodePlan *py = &plans[c->y->index];
        bool fused = py->n_launch == 1 && strstr(py->launch[0].body, "ck_binary_group<") &&
                     (!c->act || plans[c->act->index].n_launch == 0);
        Tensor *out[5];
        int n_out = 0;
        for (int j = 0; j < 2; j++) {
            if (!c->q[j]) continue;
            fused &= plans[c->q[j]->index].n_launch == 0 && plans[c->scale[j]->index].n_launch == 0;
            out[n_out++] = &c->q[j]->t;
            out[n_out++] = &c->scale[j]->t;
        }
        out[n_out++] = &c->y->t;
        /* every node in graph order: the fused launch at the product's place, the others empty */
        Node *order[6] = {c->scale[0], c->q[0], c->act, c->y, c->scale[1], c->q[1]};
        int64_t bad[4] = {0, 0, 0, 0}, total = 0;
        double err;
        bool ok = run_against_ref(order, 6, out, n_out, bad, &err);
        for (int j = 0; j < n_out - 1; j++) total += bad[j];
        bool pass = ok && fused && !total && err >= 0 && err <= 1e-2;
        printf("  %-40s [%lld x %lld] %s, copy and scale bytes differing %lld, result err %.2e%s\n", c->name,
               (long long)c->y->t.dims[0], (long long)c->y->t.dims[1], fused ? "one launch" : "NOT FUSED",
               (long long)total, err, pass ? "" : "  FAIL");
        failed += !pass;
    }
    arena_free(pa);
    if (failed) fail_msg("%d products writing their inputs' group copies differ from the reference", failed);
}

static bool run_amax_pair(const AmaxPair *c) {
    Tensor *t[2] = {&c->producer->t, &c->scale->t};
    int64_t nb = gt_bytes(t[0]);
    void *gpu_value = malloc((size_t)nb);
    float gpu_scale;
    memset(t[0]->data, 0xFF, (size_t)nb);
    bool ok = cuda_exec_push(exec, t, 1) && cuda_exec_run_node(exec, c->producer) &&
              cuda_exec_run_node(exec, c->scale) && cuda_exec_pull(exec, t, 2);
    if (!ok) {
        free(gpu_value);
        return false;
    }
    memcpy(gpu_value, t[0]->data, (size_t)nb);
    memcpy(&gpu_scale, t[1]->data, 4);
    ref_exec_node(c->producer);
    Tensor as_gpu = *t[0];
    as_gpu.data = gpu_value;
    float *a = ref_load(&as_gpu), *r = ref_load(t[0]);
    double max_abs, e = gt_norm_error(a, r, ir_numel(t[0]), &max_abs);
    double tol = t[0]->fmt.elem == FMT_F32 ? 2e-5 : 1e-2;
    bool value_ok = e >= 0 && e <= tol;
    free(a);
    free(r);
    memcpy(t[0]->data, gpu_value, (size_t)nb);   /* the reference's scale of the GPU's value */
    ref_exec_node(c->scale);
    float ref_scale;
    memcpy(&ref_scale, t[1]->data, 4);
    bool scale_ok = memcmp(&gpu_scale, &ref_scale, 4) == 0;
    printf("  %-40s value err %.2e (bound %.0e), scale gpu %.9g ref %.9g%s\n", c->name, e, tol,
           (double)gpu_scale, (double)ref_scale, value_ok && scale_ok ? "" : "  FAIL");
    free(gpu_value);
    return value_ok && scale_ok;
}

static void test_amax_parts(void **s) {
    (void)s;
    int failed = 0;
    for (int i = 0; i < n_amax_pairs; i++)
        if (!run_amax_pair(&amax_pairs[i])) failed++;
    assert_true(n_amax_pairs > 0);
    if (failed) fail_msg("%d of %d block-maxima scales differ from the reference", failed, n_amax_pairs);
}

/* Lion and SGD with momentum (ck_momentum_coded): plain and coded momentum (range expansion,
 * companding), no master, a plain master, a split master, the FP8 copy; every tensor of its
 * own, since the cases write into them. scal: lr, step, clip, grad_scale. */
static void build_momentum_updates(Node *const *scal) {
    int64_t R = gt_int(1, 100), C = gt_int(1, 300);
    for (int lion = 0; lion <= 1; lion++) {
        OpKind op = lion ? OP_LION : OP_SGD;
        const double *fa = lion ? Fa(0.9, 0.99, 0.1) : Fa(0.9, 0.01);
        char name[96];
        /* plain momentum, no master (an f32 parameter updated in place) */
        Node *p = leaf(FMT_F32, 1, DIMS(R, C)), *g = leaf(FMT_BF16, 1, DIMS(R, C));
        Node *m = leaf(FMT_F32, 0.1f, DIMS(R, C));
        snprintf(name, sizeof name, "%s", lion ? "lion" : "sgd");
        add_case(arena_printf(arena, "%s", name), 2e-5,
                 op_v(op, FMT_VOID, lion ? NULL : I(0, 0), fa, IN(p, g, m, scal[0], scal[1], scal[2], scal[3])));
        /* a plain master, the FP8 copy; SGD with Nesterov momentum */
        Node *cs = scales(0, 0, 1), *amax = leaf(FMT_F32, 1, 0, NULL);
        Node *copy = leaf_fmt("copy", FMT_E4M3, SCALE_PER_TENSOR, 0, cs, 1, DIMS(R, C));
        /* the momentum in f32, as the levels without a codec keep it: in bf16 an element that
         * the f32 update and the reference's f64 round to neighbouring values is a whole bf16
         * step apart, and one such element of 20k is 2e-5 of the norm */
        Node *p3 = leaf(FMT_BF16, 1, DIMS(R, C)), *m3 = leaf(FMT_F32, 0.1f, DIMS(R, C));
        Node *w3 = leaf(FMT_F32, 1, DIMS(R, C)), *g3 = leaf(FMT_BF16, 1, DIMS(R, C));
        add_case(arena_printf(arena, "%s master, FP8 copy", lion ? "lion" : "sgd nesterov"), 2e-5,
                 op_v(op, FMT_VOID, lion ? I(1) : I(1, 1), fa,
                      IN(p3, g3, m3, scal[0], scal[1], scal[2], scal[3], w3, copy, cs, amax)));
        /* coded momentum: range expansion with a plain master (O2), companding with a split
         * master (O3); any length, and a multiple of 8 past a few chunks of 256 */
        for (int cs_i = 0; cs_i < 4; cs_i++) {
            Codec cd = cs_i % 2 ? CODEC_COMPAND : CODEC_EXPAND;
            int64_t nc = cs_i < 2 ? gt_int(1, 1000) : 8 * gt_int(100, 400);
            Node *side = scales(codec_param_count(cd, nc), 0, 1);
            Node *mc = leaf_fmt("m", codec_elem(cd), SCALE_PER_GROUP, codec_group_size(cd), side, 0.1f, DIMS(nc));
            mc->t.fmt.codec = cd;
            mc->t.fmt.recipe = RECIPE_NONE;
            Node *pc = leaf(FMT_BF16, 1, DIMS(nc)), *gc = leaf(FMT_BF16, 1, DIMS(nc)), *wc;
            if (cd == CODEC_EXPAND) {
                wc = leaf(FMT_F32, 1, DIMS(nc));
            } else {
                wc = leaf(FMT_I8, 60, DIMS(nc));
                wc->t.fmt.codec = CODEC_SPLIT;
            }
            add_case(arena_printf(arena, "%s %s momentum, %s master, %lld", lion ? "lion" : "sgd",
                                  cd == CODEC_EXPAND ? "expand" : "compand", cd == CODEC_EXPAND ? "f32" : "split",
                                  (long long)nc),
                     2e-5, op_v(op, FMT_VOID, lion ? NULL : I(0, cs_i >= 2), fa,
                                IN(pc, gc, mc, scal[0], scal[1], scal[2], scal[3], wc)));
            if (cd != CODEC_COMPAND) continue;
            /* O3's split master with the new weights' amax (copy=2) */
            Node *pa = leaf(FMT_BF16, 1, DIMS(nc)), *ga = leaf(FMT_BF16, 1, DIMS(nc));
            Node *wa = leaf(FMT_I8, 60, DIMS(nc)), *amax_a = leaf(FMT_F32, 1, 0, NULL);
            wa->t.fmt.codec = CODEC_SPLIT;
            add_case(arena_printf(arena, "%s compand momentum, split master, weight amax, %lld", lion ? "lion" : "sgd",
                                  (long long)nc),
                     2e-5, op_v(op, FMT_VOID, lion ? I(2) : I(2, cs_i >= 2), fa,
                                IN(pa, ga, mc, scal[0], scal[1], scal[2], scal[3], wa, amax_a)));
        }
    }
}

static void build_optimizer(void) {
    group_now = "optimizer";
    int64_t R = gt_int(1, 100), C = gt_int(1, 300);
    Node *acc = leaf(FMT_BF16, 1, DIMS(R, C)), *g = leaf(FMT_BF16, 1, DIMS(R, C));
    add_case("accumulate bf16", 0, op_v(OP_ACCUMULATE, FMT_BF16, NULL, NULL, IN(acc, g)));
    Node *scal[4];
    double vals[4] = {1e-3, 3, 0.7, 0.5};
    for (int i = 0; i < 4; i++) {
        scal[i] = ir_leaf(graph, OP_INPUT, "k", ROLE_INPUT, FMT_F32, 0, NULL, here);
        fill_of(scal[i])->mag = -(float)vals[i];   /* negative: a fixed value */
    }
    Node *p = leaf(FMT_BF16, 1, DIMS(R, C)), *gr = leaf(FMT_BF16, 1, DIMS(R, C));
    Node *m = leaf(FMT_F32, 0.1f, DIMS(R, C)), *v = leaf(FMT_F32, 0.01f, DIMS(R, C));
    fill_of(v)->positive = true;
    add_case("adamw", 2e-5, op_v(OP_ADAMW, FMT_VOID, NULL, Fa(0.9, 0.95, 1e-8, 0.1),
                                 IN(p, gr, m, v, scal[0], scal[1], scal[2], scal[3])));
    Node *p2 = leaf(FMT_BF16, 1, DIMS(C)), *g2 = leaf(FMT_F32, 1, DIMS(C));
    Node *m2 = leaf(FMT_BF16, 0.1f, DIMS(C)), *v2 = leaf(FMT_F32, 0.01f, DIMS(C));
    Node *w2 = leaf(FMT_F32, 1, DIMS(C));
    fill_of(v2)->positive = true;
    add_case("adamw master", 2e-5, op_v(OP_ADAMW, FMT_VOID, NULL, Fa(0.9, 0.999, 1e-8, 0.0),
                                        IN(p2, g2, m2, v2, scal[0], scal[1], scal[2], scal[3], w2)));
    /* the weights' e4m3 copy for the next step (O1, O2): through a given scale, e4m3's
     * saturation included (|w| up to about 4 x 112), and the new weights' amax */
    Node *cs = scales(0, 0, 1), *amax = leaf(FMT_F32, 1, 0, NULL);
    Node *copy = leaf_fmt("copy", FMT_E4M3, SCALE_PER_TENSOR, 0, cs, 1, DIMS(R, C));
    Node *p3 = leaf(FMT_BF16, 1, DIMS(R, C)), *m3 = leaf(FMT_F32, 0.1f, DIMS(R, C));
    Node *v3 = leaf(FMT_F32, 0.01f, DIMS(R, C)), *w3 = leaf(FMT_F32, 1, DIMS(R, C));
    Node *g3 = leaf(FMT_BF16, 1, DIMS(R, C));   /* the cases zero their gradients: one of its own */
    fill_of(v3)->positive = true;
    add_case("adamw master, FP8 copy", 2e-5, op_v(OP_ADAMW, FMT_VOID, I(1), Fa(0.9, 0.95, 1e-8, 0.1),
             IN(p3, g3, m3, v3, scal[0], scal[1], scal[2], scal[3], w3, copy, cs, amax)));
    /* O3's copy=2: no copy, the new weights' amax alone (the next step's per-use scales) */
    Node *p4 = leaf(FMT_BF16, 1, DIMS(R, C)), *m4 = leaf(FMT_F32, 0.1f, DIMS(R, C));
    Node *v4 = leaf(FMT_F32, 0.01f, DIMS(R, C)), *w4 = leaf(FMT_F32, 1, DIMS(R, C));
    Node *g4 = leaf(FMT_BF16, 1, DIMS(R, C)), *amax4 = leaf(FMT_F32, 1, 0, NULL);
    fill_of(v4)->positive = true;
    add_case("adamw master, weight amax", 2e-5, op_v(OP_ADAMW, FMT_VOID, I(2), Fa(0.9, 0.95, 1e-8, 0.1),
             IN(p4, g4, m4, v4, scal[0], scal[1], scal[2], scal[3], w4, amax4)));
    /* coded states (O2: range expansion; O3: companded m, sqrt v, split master), at a size of
     * any length (every access element by element) and at a multiple of 8 past a few chunks of
     * 256 (wide accesses, then a short last chunk) */
    Codec codecs[2][2] = {{CODEC_EXPAND, CODEC_EXPAND}, {CODEC_COMPAND, CODEC_SQRT}};
    for (int cs_i = 0; cs_i < 4; cs_i++) {
        int c = cs_i % 2;
        int64_t nc = cs_i < 2 ? gt_int(1, 1000) : 8 * gt_int(100, 400);
        Node *st[2];
        for (int k = 0; k < 2; k++) {
            Codec cd = codecs[c][k];
            Node *side = scales(codec_param_count(cd, nc), 0, 1);
            st[k] = leaf_fmt(k ? "v" : "m", codec_elem(cd), SCALE_PER_GROUP, codec_group_size(cd), side,
                             k ? 0.01f : 0.1f, DIMS(nc));
            st[k]->t.fmt.codec = cd;
            st[k]->t.fmt.recipe = RECIPE_NONE;
            fill_of(st[k])->positive = k;   /* v positive */
        }
        Node *pc = leaf(FMT_BF16, 1, DIMS(nc)), *gc = leaf(FMT_BF16, 1, DIMS(nc));
        if (c == 0) {
            Node *wc = leaf(FMT_F32, 1, DIMS(nc));
            add_case("adamw expand states", 2e-5, op_v(OP_ADAMW, FMT_VOID, NULL, Fa(0.9, 0.95, 1e-8, 0.1),
                     IN(pc, gc, st[0], st[1], scal[0], scal[1], scal[2], scal[3], wc)));
            Node *cc = leaf_fmt("copy", FMT_E4M3, SCALE_PER_TENSOR, 0, cs, 1, DIMS(nc));
            Node *pc2 = leaf(FMT_BF16, 1, DIMS(nc)), *wc2 = leaf(FMT_F32, 1, DIMS(nc));
            Node *amax2 = leaf(FMT_F32, 1, 0, NULL), *gc2 = leaf(FMT_BF16, 1, DIMS(nc));
            add_case("adamw expand states, FP8 copy", 2e-5, op_v(OP_ADAMW, FMT_VOID, I(1), Fa(0.9, 0.95, 1e-8, 0.1),
                     IN(pc2, gc2, st[0], st[1], scal[0], scal[1], scal[2], scal[3], wc2, cc, cs, amax2)));
        } else {
            Node *lo = leaf(FMT_I8, 60, DIMS(nc));
            lo->t.fmt.codec = CODEC_SPLIT;
            add_case("adamw compand/sqrt, split master", 2e-5, op_v(OP_ADAMW, FMT_VOID, NULL, Fa(0.9, 0.95, 1e-8, 0.1),
                     IN(pc, gc, st[0], st[1], scal[0], scal[1], scal[2], scal[3], lo)));
            /* as O3 has it: the update finds the new weights' amax too (copy=2) */
            Node *lo2 = leaf(FMT_I8, 60, DIMS(nc)), *pc2 = leaf(FMT_BF16, 1, DIMS(nc));
            Node *gc2 = leaf(FMT_BF16, 1, DIMS(nc)), *amax2 = leaf(FMT_F32, 1, 0, NULL);
            lo2->t.fmt.codec = CODEC_SPLIT;
            add_case("adamw compand/sqrt, split master, weight amax", 2e-5,
                     op_v(OP_ADAMW, FMT_VOID, I(2), Fa(0.9, 0.95, 1e-8, 0.1),
                          IN(pc2, gc2, st[0], st[1], scal[0], scal[1], scal[2], scal[3], lo2, amax2)));
        }
    }
    build_momentum_updates(scal);
    Node *norm = ir_leaf(graph, OP_INPUT, "norm", ROLE_INPUT, FMT_F32, 0, NULL, here);
    fill_of(norm)->mag = 4;
    fill_of(norm)->positive = true;
    add_case("clip_coef", 0, op_v(OP_CLIP_COEF, FMT_F32, NULL, Fa(1.0), IN(norm)));
    Node *sq[6];
    sq[0] = scal[3];
    for (int i = 1; i < 6; i++) {
        sq[i] = ir_leaf(graph, OP_INPUT, "sq", ROLE_INPUT, FMT_F32, 0, NULL, here);
        fill_of(sq[i])->mag = 2;
        fill_of(sq[i])->positive = true;
    }
    add_case("grad_norm", 2e-5, op_v(OP_GRAD_NORM, FMT_F32, NULL, NULL, 6, sq));
}

static void build_gemm(void) {
    group_now = "gemm";
    int64_t M = 16 * gt_int(1, 20), N = 16 * gt_int(1, 20), K = 16 * gt_int(1, 20);
    Node *a = leaf(FMT_BF16, 1, DIMS(M, K)), *bt = leaf(FMT_BF16, 1, DIMS(N, K));
    Node *b = leaf(FMT_BF16, 1, DIMS(K, N)), *at = leaf(FMT_BF16, 1, DIMS(K, M));
    add_case("matmul bf16 NT", 1e-2, op_v(OP_MATMUL, FMT_BF16, I(0, 1), NULL, IN(a, bt)));
    add_case("matmul bf16 NN", 1e-2, op_v(OP_MATMUL, FMT_BF16, I(0, 0), NULL, IN(a, b)));
    add_case("matmul bf16 TN->f32", 2e-5, op_v(OP_MATMUL, FMT_F32, I(1, 0), NULL, IN(at, b)));
    add_case("matmul bf16 TT", 1e-2, op_v(OP_MATMUL, FMT_BF16, I(1, 1), NULL, IN(at, bt)));
    Node *af = leaf(FMT_F32, 1, DIMS(M, K)), *bf = leaf(FMT_F32, 1, DIMS(K, N));
    add_case("matmul f32", 2e-5, op_v(OP_MATMUL, FMT_F32, I(0, 0), NULL, IN(af, bf)));
    Node *sa = scales(0, 0, 1), *sb = scales(0, 0, 1), *sc = scales(0, 0, 1), *sd = scales(0, 0, 1);
    Node *a8 = leaf_fmt("a8", FMT_E4M3, SCALE_PER_TENSOR, 0, sa, 1, DIMS(M, K));
    Node *b8t = leaf_fmt("b8", FMT_E4M3, SCALE_PER_TENSOR, 0, sb, 1, DIMS(N, K));
    add_case("matmul e4m3 x e4m3 (forward)", 1e-2, op_v(OP_MATMUL, FMT_BF16, I(0, 1, 1), NULL, IN(a8, b8t)));
    Node *g8 = leaf_fmt("g8", FMT_E5M2, SCALE_PER_TENSOR, 0, sc, 1, DIMS(M, N));
    Node *w8 = leaf_fmt("w8", FMT_E4M3, SCALE_PER_TENSOR, 0, sd, 1, DIMS(N, K));
    add_case("matmul e5m2 x e4m3 (dgrad)", 1e-2, op_v(OP_MATMUL, FMT_BF16, I(0, 0, 1), NULL, IN(g8, w8)));
    /* Hopper's FP8 MMA accumulates with fewer bits than f32 (measured 8.6e-5 on an H100 here,
     * 2026-11-22); the f64 reference sees the difference through an f32 result */
    add_case("matmul e5m2^T x e4m3 (wgrad)", 5e-4, op_v(OP_MATMUL, FMT_F32, I(1, 0, 1), NULL, IN(g8, a8)));
    int64_t m = gt_int(1, 40), k = gt_int(1, 40), n = gt_int(1, 40);
    Node *sgr = scales(m, (k + 15) / 16, 1);
    Node *ag = leaf_fmt("ag", FMT_E4M3, SCALE_PER_GROUP, 16, sgr, 1, DIMS(m, k));
    Node *bo = leaf(FMT_BF16, 1, DIMS(n, k));
    add_case("matmul e4m3 group x bf16 (fallback)", 2e-5, op_v(OP_MATMUL, FMT_F32, I(0, 1), NULL, IN(ag, bo)));
    /* grouped scales through cuBLASLt (rows; DeepSeek-V3's 1x128 tiles and 128x128 blocks),
     * k past a whole 128 at random; the product in bf16 */
    int64_t gm = 16 * gt_int(2, 20), gn = 16 * gt_int(2, 20), gk = 16 * gt_int(9, 30);
    int64_t kb = (gk + 127) / 128, nb = (gn + 127) / 128, mb = (gm + 127) / 128;
    Node *xr = leaf_fmt("xr", FMT_E4M3, SCALE_PER_ROW, 0, scales(gm, 0, 1), 1, DIMS(gm, gk));
    Node *wr = leaf_fmt("wr", FMT_E4M3, SCALE_PER_ROW, 0, scales(gn, 0, 1), 1, DIMS(gn, gk));
    add_case("matmul e4m3 rows x rows", 1e-2, op_v(OP_MATMUL, FMT_BF16, I(0, 1), NULL, IN(xr, wr)));
    Node *xt = leaf_fmt("xt", FMT_E4M3, SCALE_TILE_1x128, 128, scales(gm, kb, 1), 1, DIMS(gm, gk));
    Node *wb = leaf_fmt("wb", FMT_E4M3, SCALE_BLOCK_128, 128, scales(nb, kb, 1), 1, DIMS(gn, gk));
    Node *wt = leaf_fmt("wt", FMT_E4M3, SCALE_TILE_1x128, 128, scales(gn, kb, 1), 1, DIMS(gn, gk));
    Node *xb = leaf_fmt("xb", FMT_E4M3, SCALE_BLOCK_128, 128, scales(mb, kb, 1), 1, DIMS(gm, gk));
    add_case("matmul e4m3 1x128 x 128x128 (forward)", 1e-2, op_v(OP_MATMUL, FMT_BF16, I(0, 1), NULL, IN(xt, wb)));
    add_case("matmul e4m3 1x128 x 1x128", 1e-2, op_v(OP_MATMUL, FMT_BF16, I(0, 1), NULL, IN(xt, wt)));
    add_case("matmul e4m3 128x128 x 1x128", 1e-2, op_v(OP_MATMUL, FMT_BF16, I(0, 1), NULL, IN(xb, wt)));
    /* dgrad: dy (m, n) in tiles along n times w (n, k) in blocks, w read transposed */
    Node *gt = leaf_fmt("gt", FMT_E4M3, SCALE_TILE_1x128, 128, scales(gm, nb, 1), 1, DIMS(gm, gn));
    Node *wbk = leaf_fmt("wbk", FMT_E4M3, SCALE_BLOCK_128, 128, scales(nb, kb, 1), 1, DIMS(gn, gk));
    add_case("matmul e4m3 1x128 x 128x128^T (dgrad)", 1e-2, op_v(OP_MATMUL, FMT_BF16, I(0, 0), NULL, IN(gt, wbk)));
    /* wgrad: tiles across the contraction, which cuBLASLt cannot scale: the f32 fallback */
    add_case("matmul e4m3 1x128^T x 1x128 (fallback)", 2e-5, op_v(OP_MATMUL, FMT_F32, I(1, 0), NULL, IN(gt, xt)));
    Node *so = scales(0, 0, 1);
    Node *mo = add_case("matmul -> e4m3 (store)", 0.1, op_v(OP_MATMUL, FMT_E4M3, I(0, 1), NULL, IN(a, bt)));
    mo->t.fmt.scaling = SCALE_PER_TENSOR, mo->t.fmt.recipe = RECIPE_STATIC, mo->t.fmt.scale = so;
}

/* the attentions planned with attn.wgmma=1 (their site's choice; the others are set to 0),
 * whose forward (or the backward's rerun of it) must then run on warpgroup MMA */
static Node *wgmma_nodes[32];
static int n_wgmma_nodes;
/* At head dim 64 the wgmma forward may overlap its softmax with its P V product (the choice
 * attn.fwd_pipeline=1): each such attention and backward has a twin over the same inputs
 * planned with it, and the two must give the same bits. */
typedef struct {
    Node *pipe, *plain;
} PipeTwin;
static PipeTwin pipe_twins[16];
static int n_pipe_twins;
/* At head dim 64, with the forward's statistics saved, the dk/dv pass may compute dq too, its
 * parts summed in a fixed order (the choice attn.dq_in_dkv=1): each such backward has a twin
 * planned so, a case of its own against the reference, which must also repeat bit for bit. */
static Node *dq_in_dkv_nodes[8];
static int n_dq_in_dkv;
/* The dk/dv pass with each key tile's steps in parts (the choice attn.dkv_parts), the parts'
 * sums added in a fixed order: each wgmma backward has such a twin, a case of its own against
 * the reference, which must also repeat bit for bit; 8 parts where the backward reruns the
 * forward (more parts than a short key tile has steps: some parts take none), 3 where it reads
 * the forward's statistics. */
typedef struct {
    Node *node;
    int parts;
} PartsCase;
static PartsCase dkv_parts_nodes[16];
static int n_dkv_parts;
/* The forward with a producer warpgroup (the choice attn.fwd_ws = its consumer warpgroups): each
 * such attention and backward (which reruns the forward) is a case of its own against the
 * reference, and must run that kernel. At head dim 64 also with key tiles of 128
 * (attn.fwd_keys) and the pipelined walk (attn.fwd_pipeline). */
typedef struct {
    Node *node;
    int64_t D;
    int wgs, tma;     /* consumer warpgroups; the producer's loads by TMA (attn.fwd_tma) */
    int keys, pipe;   /* keys of a tile (attn.fwd_keys); the pipelined walk (attn.fwd_pipeline) */
} WsCase;
static WsCase ws_nodes[128];
static int n_ws_nodes;

static void build_attention(void) {
    group_now = "attention";
    struct { int64_t B, T, H, Hkv, D; ElemType e; bool packed, wgmma; } cfg[] = {
        {gt_int(1, 3), gt_int(1, 150), 4, 2, 64, FMT_BF16, false, false},
        {1, gt_int(60, 200), 2, 2, 128, FMT_F32, false, false},
        {2, gt_int(1, 130), 4, 4, 32, FMT_BF16, true, false},
        {1, 64, 6, 1, 16, FMT_F32, true, false},
        /* tensor cores at the largest head dim, T past a whole tile, GQA over a packed q|k|v */
        {gt_int(1, 3), 64 * gt_int(1, 4) + gt_int(1, 64), 6, 2, 128, FMT_BF16, true, false},
        {1, gt_int(1, 260), 3, 1, 96, FMT_BF16, false, false},
        /* warpgroup MMA: 128-row blocks, so T below, at and past whole blocks and tiles;
         * both head dims, GQA, packed and separate q, k, v */
        {1, 1000, 4, 2, 64, FMT_BF16, false, true},
        {2, 77, 6, 2, 128, FMT_BF16, true, true},
        {gt_int(1, 2), 128 * gt_int(1, 3), 2, 2, 64, FMT_BF16, true, true},
        {1, gt_int(1, 400), 4, 1, 128, FMT_BF16, false, true},
        {1, 1000, 2, 1, 128, FMT_BF16, false, true},
    };
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        int64_t B = cfg[c].B, T = cfg[c].T, H = cfg[c].H, Hkv = cfg[c].Hkv, D = cfg[c].D;
        ElemType e = cfg[c].e;
        double tol = e == FMT_F32 ? 2e-5 : 1e-2;
        double scale = 1.0 / sqrt((double)D);
        Node *dy = leaf(e, 1, DIMS(B, T, H * D));
        const char *wg = cfg[c].wgmma ? " wgmma" : "";
        char *fw = arena_printf(arena, "attention T%lld H%lld/%lld D%lld %s%s%s", (long long)T,
                                (long long)H, (long long)Hkv, (long long)D, fmt_elem_name(e),
                                cfg[c].packed ? " packed" : "", wg);
        char *bw = arena_printf(arena, "attention_bwd T%lld H%lld/%lld D%lld %s%s%s", (long long)T,
                                (long long)H, (long long)Hkv, (long long)D, fmt_elem_name(e),
                                cfg[c].packed ? " packed" : "", wg);
        /* each configuration twice: the backward recomputing the forward's statistics, and
         * (lse=1) reading the logsumexp the forward stored after y, with y itself */
        for (int lse = 0; lse < 2; lse++) {
            const char *how = lse ? ", lse saved" : "";
            Node *y, *bwd;
            if (cfg[c].packed) {
                Node *qkv = leaf(e, 1, DIMS(B, T, (H + 2 * Hkv) * D));
                y = add_case(arena_printf(arena, "%s%s", fw, how), tol,
                             op_v(OP_ATTENTION, e, I(H, Hkv, lse), Fa(scale), IN(qkv)));
                bwd = add_case(arena_printf(arena, "%s%s", bw, how), tol,
                               lse ? op_v(OP_ATTENTION_BWD, e, I(H, Hkv), Fa(scale), IN(dy, qkv, y))
                                   : op_v(OP_ATTENTION_BWD, e, I(H, Hkv), Fa(scale), IN(dy, qkv)));
            } else {
                Node *q = leaf(e, 1, DIMS(B, T, H * D)), *k = leaf(e, 1, DIMS(B, T, Hkv * D));
                Node *v = leaf(e, 1, DIMS(B, T, Hkv * D));
                y = add_case(arena_printf(arena, "%s%s", fw, how), tol,
                             op_v(OP_ATTENTION, e, I(H, Hkv, lse), Fa(scale), IN(q, k, v)));
                bwd = add_case(arena_printf(arena, "%s%s", bw, how), tol,
                               lse ? op_v(OP_ATTENTION_BWD, e, I(H, Hkv), Fa(scale), IN(dy, q, k, v, y))
                                   : op_v(OP_ATTENTION_BWD, e, I(H, Hkv), Fa(scale), IN(dy, q, k, v)));
            }
            /* attn.wgmma is on by default: the other configurations keep mma.sync (or attn.cuh) */
            if (!cfg[c].wgmma) {
                ir_set_choice(graph, arena_printf(arena, "attn.wgmma@%d", y->id), "0");
                ir_set_choice(graph, arena_printf(arena, "attn.wgmma@%d", bwd->id), "0");
                continue;
            }
            /* the backward's dq and dk/dv passes on wgmma too (attn.wgmma_bwd is on by
             * default); with lse saved it reads the forward's statistics and reruns nothing */
            /* with lse saved, the blocks in groups of three heads (attn.head_group=3; the
             * shapes' heads leave a short last group in most: every tile still computed once)
             * and the dk/dv steps in two parts of 32 queries (attn.dkv_split=2, the default);
             * without, the dk/dv steps whole (attn.dkv_split=1), so that both are checked */
            Node *sites[2] = {y, bwd};
            for (int k = 0; k < 2; k++) {
                assert_true(n_wgmma_nodes < (int)(sizeof wgmma_nodes / sizeof *wgmma_nodes));
                wgmma_nodes[n_wgmma_nodes++] = sites[k];
                ir_set_choice(graph, arena_printf(arena, "attn.wgmma@%d", sites[k]->id), "1");
                ir_set_choice(graph, arena_printf(arena, "attn.fwd_ws@%d", sites[k]->id), "0");
                if (lse) {
                    ir_set_choice(graph, arena_printf(arena, "attn.head_group@%d", sites[k]->id), "3");
                    ir_set_choice(graph, arena_printf(arena, "attn.dkv_split@%d", sites[k]->id), "2");
                } else {
                    ir_set_choice(graph, arena_printf(arena, "attn.dkv_split@%d", sites[k]->id), "1");
                }
                /* the forward (and the backward's rerun of it) with a producer warpgroup
                 * (attn.fwd_ws): its own case against the reference, at head dim 64 with three
                 * and two consumer warpgroups, at 128 with two; the first of them also with
                 * the producer's loads by TMA (attn.fwd_tma) */
                /* at head dim 64 the first of them also with key tiles of 128, walked plainly
                 * and pipelined, and pipelined with tiles of 64; with two consumer warpgroups,
                 * tiles of 128 pipelined; without TMA, the same */
                WsCase forms[12];
                int n_forms = 0;
                for (int wgs = D == 64 ? 3 : 2; wgs >= 2; wgs--)
                    for (int tma = 0; tma < 2; tma++) {
                        bool first = wgs == (D == 64 ? 3 : 2);
                        if ((sites[k]->op == OP_ATTENTION_BWD && (lse || !first)) || (tma && !first)) break;
                        forms[n_forms++] = (WsCase){NULL, D, wgs, tma, 64, 0};
                        if (D != 64 || !first || !tma) continue;
                        forms[n_forms++] = (WsCase){NULL, D, 3, 1, 128, 0};
                        forms[n_forms++] = (WsCase){NULL, D, 3, 1, 128, 1};
                        forms[n_forms++] = (WsCase){NULL, D, 3, 1, 64, 1};
                        forms[n_forms++] = (WsCase){NULL, D, 3, 0, 128, 1};
                        if (sites[k]->op == OP_ATTENTION) forms[n_forms++] = (WsCase){NULL, D, 2, 1, 128, 1};
                    }
                for (int f = 0; f < n_forms; f++) {
                    WsCase form = forms[f];
                    Node *ws = add_case(arena_printf(arena, "%s%s, producer warpgroup%s, %d consumers%s%s",
                                                     sites[k]->op == OP_ATTENTION ? fw : bw, how,
                                                     form.tma ? " (TMA)" : "", form.wgs, form.keys == 128 ? ", 128 keys" : "",
                                                     form.pipe ? ", pipelined" : ""),
                                        tol, op_v(sites[k]->op, e, sites[k]->iattr, sites[k]->fattr,
                                                  sites[k]->n_in, sites[k]->in));
                    ir_set_choice(graph, arena_printf(arena, "attn.wgmma@%d", ws->id), "1");
                    ir_set_choice(graph, arena_printf(arena, "attn.fwd_ws@%d", ws->id),
                                  arena_printf(arena, "%d", form.wgs));
                    ir_set_choice(graph, arena_printf(arena, "attn.fwd_tma@%d", ws->id), form.tma ? "1" : "0");
                    ir_set_choice(graph, arena_printf(arena, "attn.fwd_keys@%d", ws->id),
                                  arena_printf(arena, "%d", form.keys));
                    ir_set_choice(graph, arena_printf(arena, "attn.fwd_pipeline@%d", ws->id), form.pipe ? "1" : "0");
                    assert_true(n_ws_nodes < (int)(sizeof ws_nodes / sizeof *ws_nodes));
                    form.node = ws;
                    ws_nodes[n_ws_nodes++] = form;
                }
                if (sites[k]->op == OP_ATTENTION_BWD) {
                    int parts = lse ? 3 : 8;
                    Node *cut = add_case(arena_printf(arena, "%s%s, dk/dv in %d parts", bw, how, parts), tol,
                                         op_v(OP_ATTENTION_BWD, e, sites[k]->iattr, sites[k]->fattr, sites[k]->n_in,
                                              sites[k]->in));
                    ir_set_choice(graph, arena_printf(arena, "attn.wgmma@%d", cut->id), "1");
                    ir_set_choice(graph, arena_printf(arena, "attn.fwd_ws@%d", cut->id), "0");
                    ir_set_choice(graph, arena_printf(arena, "attn.dkv_split@%d", cut->id), lse ? "2" : "1");
                    ir_set_choice(graph, arena_printf(arena, "attn.dkv_parts@%d", cut->id),
                                  arena_printf(arena, "%d", parts));
                    assert_true(n_dkv_parts < (int)(sizeof dkv_parts_nodes / sizeof *dkv_parts_nodes));
                    dkv_parts_nodes[n_dkv_parts++] = (PartsCase){cut, parts};
                }
                if (D != 64) continue;
                Node *twin = op_v(sites[k]->op, e, sites[k]->iattr, sites[k]->fattr, sites[k]->n_in, sites[k]->in);
                twin->t.name = arena_printf(arena, "%s, pipelined", sites[k]->t.name);
                ir_set_choice(graph, arena_printf(arena, "attn.wgmma@%d", twin->id), "1");
                ir_set_choice(graph, arena_printf(arena, "attn.fwd_pipeline@%d", twin->id), "1");
                ir_set_choice(graph, arena_printf(arena, "attn.fwd_ws@%d", twin->id), "0");
                if (lse) {   /* as its plain twin's, so that only the pipeline differs */
                    ir_set_choice(graph, arena_printf(arena, "attn.head_group@%d", twin->id), "3");
                    ir_set_choice(graph, arena_printf(arena, "attn.dkv_split@%d", twin->id), "2");
                } else {
                    ir_set_choice(graph, arena_printf(arena, "attn.dkv_split@%d", twin->id), "1");
                }
                assert_true(n_pipe_twins < (int)(sizeof pipe_twins / sizeof *pipe_twins));
                pipe_twins[n_pipe_twins++] = (PipeTwin){twin, sites[k]};
                if (sites[k]->op != OP_ATTENTION_BWD || !lse) continue;
                /* the dk/dv steps whole in one configuration, in two parts in the others */
                Node *one = add_case(arena_printf(arena, "%s, dq in dk/dv", bw), tol,
                                     op_v(OP_ATTENTION_BWD, e, sites[k]->iattr, sites[k]->fattr, sites[k]->n_in,
                                          sites[k]->in));
                ir_set_choice(graph, arena_printf(arena, "attn.wgmma@%d", one->id), "1");
                ir_set_choice(graph, arena_printf(arena, "attn.dq_in_dkv@%d", one->id), "1");
                ir_set_choice(graph, arena_printf(arena, "attn.dkv_split@%d", one->id), n_dq_in_dkv ? "2" : "1");
                assert_true(n_dq_in_dkv < (int)(sizeof dq_in_dkv_nodes / sizeof *dq_in_dkv_nodes));
                dq_in_dkv_nodes[n_dq_in_dkv++] = one;
            }
        }
    }
    /* no choice set at T 2048: plan_attention's rule takes key tiles of 128 on the producer
     * warpgroup (three consumers, TMA), as for Llama 1.1B's forwards */
    int64_t T = 2048, H = 4, Hkv = 2, D = 64;
    Node *q = leaf(FMT_BF16, 1, DIMS(1, T, H * D)), *k = leaf(FMT_BF16, 1, DIMS(1, T, Hkv * D));
    Node *v = leaf(FMT_BF16, 1, DIMS(1, T, Hkv * D));
    Node *y = add_case("attention T2048 H4/2 D64 bf16, lse saved, the rule's key tiles", 1e-2,
                       op_v(OP_ATTENTION, FMT_BF16, I(H, Hkv, 1), Fa(1.0 / sqrt((double)D)), IN(q, k, v)));
    assert_true(n_ws_nodes < (int)(sizeof ws_nodes / sizeof *ws_nodes));
    ws_nodes[n_ws_nodes++] = (WsCase){y, D, 3, 1, 128, 0};
}

/* ---------------------------------------------------------------- data */

static void fill_leaf(Node *n) {
    int64_t count = ir_numel(&n->t);
    float *x = malloc(sizeof(float) * (size_t)(count ? count : 1));
    assert_non_null(x);
    const Fill *fl = fill_of(n);
    float mag = fl->mag;
    for (int64_t i = 0; i < count; i++) {
        if (n->t.fmt.elem == FMT_I32) {
            x[i] = gt_uniform() < fl->ignore ? -1.0f : (float)gt_int(0, fl->ids);
        } else if (n->t.role == ROLE_SCALE) {
            x[i] = (float)(448.0 / (4.0 * mag) * (0.5 + gt_uniform()));
        } else if (n->t.fmt.codec == CODEC_SPLIT) {
            x[i] = rintf(mag * gt_normal());
        } else if (mag < 0) {
            x[i] = -mag;                                  /* a fixed value */
        } else {
            float v = mag * gt_normal();
            x[i] = fl->positive ? fabsf(v) : v;
        }
    }
    if (n->t.fmt.codec == CODEC_SPLIT) num_encode(FMT_I8, x, n->t.data, count);
    else ref_store(&n->t, x);
    free(x);
}

static int setup(void **state) {
    (void)state;
    gt_seed();
    arena = arena_new();
    graph = ir_graph_new(arena);
    graph->model_name = "gpu_ops";
    build_elementwise();
    build_rows();
    build_quant();
    build_amax();
    build_optimizer();
    build_gemm();
    build_quant_transposed();
    build_quant_group_fused();
    build_input_copies();
    build_product_copies();
    build_cast_transposes();
    build_norm_grads();
    build_attention();
    if (!rt_memory_bind(graph, &mem)) return -1;
    /* scales before the tensors stored through them */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < graph->n_nodes; i++) {
            Node *n = graph->nodes[i];
            if (n->op == OP_INPUT && (n->t.role == ROLE_SCALE) == (pass == 0)) fill_leaf(n);
        }
    CudaBinary bin;
    bool skipped = false;
    char why[512] = "";
    if (!cuda_compile_graph(graph, &bin, &skipped, why, sizeof why)) return -1;
    if (skipped) {
        fprintf(stderr, "the GPU backend cannot run a case: %s\n", why);
        return -1;
    }
    printf("kernel module: %zu bytes of cubin%s\n", bin.cubin_size, bin.cached ? " (cached)" : "");
    exec = cuda_exec_open(graph, &mem, bin.cubin, bin.cubin_size);
    cuda_binary_free(&bin);
    return exec ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    cuda_exec_close(exec);
    rt_memory_free(&mem);
    arena_free(arena);
    free(fills);
    return 0;
}

/* ---------------------------------------------------------------- running */

static double tol_for(const Case *c, const Tensor *t) {
    if (c->tol >= 0) return c->tol;
    return t->fmt.elem == FMT_F32 ? 2e-5 : t->fmt.elem == FMT_BF16 ? 1e-2 : 0.1;
}

/* The tensors a node writes: its result, and operands it updates in place (with the side
 * values of coded states, which their re-encoding rewrites). */
static int outputs_of(Node *n, Tensor **out) {
    int k = 0;
    if (n->t.fmt.elem != FMT_VOID && !ir_op_is_inplace(n->op)) out[k++] = &n->t;
    for (int i = 0; i < n->n_in; i++)
        if (ir_mutates_input(n, i)) {
            out[k++] = &n->in[i]->t;
            const Format *f = &n->in[i]->t.fmt;
            if (f->codec != CODEC_PLAIN && f->codec != CODEC_SPLIT && f->scale) out[k++] = &f->scale->t;
        }
    return k;
}

/* decoded values of t's bytes `data`; a coded state reads its side values from the copy of
 * the outputs it was written with (the same index in `side`), a split correction as i8 */
static float *decode_as(Tensor *const *out, int n_out, void *const *copies, int k) {
    Tensor t = *out[k];
    t.data = copies[k];
    Node side;
    if (t.fmt.codec == CODEC_SPLIT) t.fmt = fmt_plain(FMT_I8);
    if (t.fmt.codec != CODEC_PLAIN && t.fmt.scale) {
        side = *t.fmt.scale;
        for (int j = 0; j < n_out; j++)
            if (out[j] == &t.fmt.scale->t) side.t.data = copies[j];
        t.fmt.scale = &side;
    }
    return ref_load(&t);
}

/* Whether t is an optimizer state in one of the 8-bit codecs (ir/codecs.c). */
static bool coded_state(const Tensor *t) {
    Codec c = t->fmt.codec;
    return (c == CODEC_EXPAND || c == CODEC_COMPAND || c == CODEC_SQRT) && t->fmt.scale;
}

/* The output whose side values out[k] holds, or -1. */
static int coded_side_of(Tensor *const *out, int n_out, int k) {
    for (int j = 0; j < n_out; j++)
        if (j != k && coded_state(out[j]) && &out[j]->fmt.scale->t == out[k]) return j;
    return -1;
}

/* What an update rounds to 16 or 8 bits from values it computes in f32 (the reference in f64):
 * its bf16 weights (with a split master, the master's high half), bf16 states and the weights'
 * FP8 copy; not its gradient, which it zeroes, nor coded states, which have rules of their own.
 * Where the f32 value and the f64 one straddle a rounding point they land a step apart. */
static bool split_hi(const Node *n, const Tensor *t) {
    if (!ir_op_is_update(n->op) || t == &n->in[1]->t || coded_state(t) || t->fmt.codec == CODEC_SPLIT)
        return false;
    if (t == &n->in[0]->t && n->in[0]->t.fmt.codec == CODEC_SPLIT) return false;
    int bytes = fmt_elem_bytes(t->fmt.elem);
    if (bytes != 2 && bytes != 1) return false;
    for (int i = 0; i < n->n_in; i++)
        if (&n->in[i]->t == t && ir_mutates_input(n, i)) return true;
    return false;
}

static int out_index(Tensor *const *out, int n_out, const Tensor *t) {
    for (int j = 0; j < n_out; j++)
        if (out[j] == t) return j;
    return -1;
}

/* out[k] of an AdamW over coded states or a split master, GPU bytes gpu[] against the
 * reference's ref[] (the file's opening comment gives the bounds) */
static bool compare_coded(const Case *c, const Node *n, Tensor *const *out, int n_out, void *const *gpu,
                          void *const *ref, int k) {
    const Tensor *t = out[k];
    int64_t count = ir_numel(t);
    if (coded_state(t)) {
        int s = out_index(out, n_out, &t->fmt.scale->t);
        assert_true(s >= 0);
        CodedStats st = {0};
        coded_check(c->name, t, gpu[k], gpu[s], ref[k], ref[s], &CODED_STEP_BOUNDS, &st);
        printf("  %-40s %-10s %s[%lld] codes %lld one step off, %lld of %lld groups moved, err %.2e\n", c->name,
               t->name ? t->name : "state", fmt_elem_name(t->fmt.elem), (long long)count, (long long)st.off,
               (long long)st.moved, (long long)st.groups, st.err);
        return true;
    }
    if (split_hi(n, t)) {   /* bf16 or FP8: at most one step apart, at most 1% + 4 elements */
        int64_t off = 0;
        int bits = 8 * fmt_elem_bytes(t->fmt.elem);
        const char *what = t == &n->in[0]->t ? "weight" : t->name ? t->name : "operand";
        for (int64_t i = 0; i < count; i++) {
            uint32_t a = bits == 16 ? ((const uint16_t *)gpu[k])[i] : ((const uint8_t *)gpu[k])[i];
            uint32_t b = bits == 16 ? ((const uint16_t *)ref[k])[i] : ((const uint8_t *)ref[k])[i];
            int64_t d = llabs(sm_order(a, bits) - sm_order(b, bits));
            if (d > 1) {
                printf("  %-40s %s[%lld] gpu 0x%04x ref 0x%04x  FAIL\n", c->name, what, (long long)i, a, b);
                return false;
            }
            off += d;
        }
        bool pass = off <= 4 + count / 100;
        printf("  %-40s %-10s %s[%lld] %lld one step off%s\n", c->name, what, fmt_elem_name(t->fmt.elem),
               (long long)count, (long long)off, pass ? "" : "  FAIL");
        return pass;
    }
    /* the split master's correction: the master decoded from both halves */
    int hi = out_index(out, n_out, &n->in[0]->t);
    assert_true(hi >= 0);
    float *a = malloc(sizeof(float) * (size_t)count), *r = malloc(sizeof(float) * (size_t)count);
    codec_split_decode(gpu[hi], gpu[k], a, count);
    codec_split_decode(ref[hi], ref[k], r, count);
    double max_abs, e = gt_norm_error(a, r, count, &max_abs);
    bool pass = e >= 0 && e <= tol_for(c, t);
    printf("  %-40s %-10s master[%lld] err %.2e (bound %.0e)%s\n", c->name, "split", (long long)count, e,
           tol_for(c, t), pass ? "" : "  FAIL");
    free(a);
    free(r);
    return pass;
}

static bool run_case(const Case *c) {
    Node *n = c->node;
    Tensor *out[16];
    int n_out = outputs_of(n, out);
    void *before[16], *gpu[16];
    for (int k = 0; k < n_out; k++) {
        size_t bytes = (size_t)gt_bytes(out[k]);
        before[k] = malloc(bytes + 1);
        gpu[k] = malloc(bytes + 1);
        memcpy(before[k], out[k]->data, bytes);
        /* poison what the node writes from scratch: an element it skips reads back as NaN */
        if (out[k] == &n->t) memset(out[k]->data, 0xFF, bytes);
    }
    bool ok = cuda_exec_push(exec, out, n_out) && cuda_exec_run_node(exec, n) && cuda_exec_pull(exec, out, n_out);
    for (int k = 0; k < n_out; k++) {
        size_t bytes = (size_t)gt_bytes(out[k]);
        memcpy(gpu[k], out[k]->data, bytes);
        memcpy(out[k]->data, before[k], bytes);
    }
    if (ok) ref_exec_node(n);
    void *now[16];
    for (int j = 0; j < n_out; j++) now[j] = out[j]->data;
    for (int k = 0; ok && k < n_out; k++) {
        if (coded_side_of(out, n_out, k) >= 0) continue;   /* compared with its state */
        if (coded_state(out[k]) || out[k]->fmt.codec == CODEC_SPLIT || split_hi(n, out[k])) {
            ok = compare_coded(c, n, out, n_out, gpu, now, k);
            continue;
        }
        float *a = decode_as(out, n_out, gpu, k), *r = decode_as(out, n_out, now, k);
        double max_abs, e = gt_norm_error(a, r, ir_numel(out[k]), &max_abs);
        double tol = tol_for(c, out[k]);
        /* the largest |weight| an update stored: of weights that may be a bf16 step off */
        int at_amax = ir_op_is_update(n->op) ? ir_update_amax_index(n) : -1;
        if (at_amax >= 0 && out[k] == &n->in[at_amax]->t) tol = 0x1p-7;
        bool pass = e >= 0 && (tol == 0 ? e == 0 : e <= tol);
        printf("  %-40s %-10s %s[%lld] err %.2e (bound %.0e)%s\n", c->name,
               out[k] == &n->t ? "result" : (out[k]->name ? out[k]->name : "operand"),
               fmt_elem_name(out[k]->fmt.elem), (long long)ir_numel(out[k]), e, tol,
               pass ? "" : "  FAIL");
        if (!pass) {
            for (int64_t i = 0, shown = 0; i < ir_numel(out[k]) && shown < 5; i++)
                if (!(a[i] == r[i]) && !(a[i] != a[i] && r[i] != r[i])) {
                    printf("      [%lld] gpu %.9g ref %.9g\n", (long long)i, a[i], r[i]);
                    shown++;
                }
            ok = false;
        }
        free(a);
        free(r);
    }
    /* the device goes on from the reference's state */
    if (!cuda_exec_push(exec, out, n_out)) ok = false;
    for (int k = 0; k < n_out; k++) {
        free(before[k]);
        free(gpu[k]);
    }
    return ok;
}

static void run_group(const char *group) {
    int failed = 0, ran = 0;
    for (int i = 0; i < n_cases; i++)
        if (!strcmp(cases[i].group, group)) {
            ran++;
            if (!run_case(&cases[i])) failed++;
        }
    assert_true(ran > 0);
    if (failed) fail_msg("%d of %d %s cases differ from the reference", failed, ran, group);
}

static void test_elementwise(void **s) { (void)s; run_group("elementwise"); }
static void test_rows(void **s) { (void)s; run_group("rows"); }

/* where the one pass of the launch body `body` keeps a row (ck_ce_fused's NV) */
static CeHeld ce_held_of(const char *body) {
    return strstr(body, "ck_ce_fused<-2,")   ? CE_IN_RING
           : strstr(body, "ck_ce_fused<-1,") ? CE_IN_SHARED
           : strstr(body, "ck_ce_fused<0,")  ? CE_READ_TWICE
                                             : CE_IN_REGISTERS;
}

/* How many of ce_pairs are not planned as one pass holding the row where they should (each
 * prints a line); no GPU needed */
static int ce_pairs_misplanned(void) {
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int wrong = 0;
    for (int k = 0; k < n_ce_pairs; k++) {
        const CuNodePlan *pb = &plans[ce_pairs[k].b->index];
        const char *body = pb->n_launch == 1 ? pb->launch[0].body : "";
        if (!strstr(body, "ck_ce_fused<") || ce_held_of(body) != ce_pairs[k].held)
            printf("%s: not planned as expected: %s\n", ce_pairs[k].name, body), wrong++;
    }
    arena_free(pa);
    return wrong;
}

/* The cross entropies of ce_pairs as one pass: the backward's launch writes the loss and the
 * gradient (the forward runs nothing of its own; alone, its own launches), both against the
 * reference, and with the bits of the twin pair that runs unfused (the forward's logsumexps
 * read by the backward, its coefficient a launch of its own). */
static void test_ce_one_pass(void **s) {
    (void)s;
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int failed = 0;
    for (int k = 0; k < n_ce_pairs; k++) {
        const CePair *p = &ce_pairs[k];
        const CuNodePlan *pf = &plans[p->f->index], *pb = &plans[p->b->index], *pb2 = &plans[p->b2->index];
        const char *body = pb->n_launch == 1 ? pb->launch[0].body : "";
        bool fused = strstr(body, "ck_ce_fused<") && pf->n_launch == 0 && pf->alone && pf->alone->n_launch == 2;
        CeHeld held = ce_held_of(body);
        bool twin = pb2->n_launch == 2 && pb2->launch[1].args.i[2] > 0 && plans[p->f2->index].n_launch == 2;
        Tensor *out[4] = {&p->f->t, &p->b->t, &p->f2->t, &p->b2->t};
        void *gpu[4];
        for (int j = 0; j < 4; j++) memset(out[j]->data, 0xFF, (size_t)gt_bytes(out[j]));   /* poisoned */
        bool ok = cuda_exec_push(exec, out, 4) && cuda_exec_run_node(exec, p->b) &&
                  cuda_exec_run_node(exec, p->f2) && cuda_exec_run_node(exec, p->b2) && cuda_exec_pull(exec, out, 4);
        for (int j = 0; j < 4; j++) {
            gpu[j] = malloc((size_t)gt_bytes(out[j]));
            memcpy(gpu[j], out[j]->data, (size_t)gt_bytes(out[j]));
        }
        bool same = ok && !memcmp(gpu[0], gpu[2], (size_t)gt_bytes(out[0])) &&
                    !memcmp(gpu[1], gpu[3], (size_t)gt_bytes(out[1]));
        if (ok) ref_exec_node(p->f), ref_exec_node(p->b);
        bool pass = ok && fused && held == p->held && twin && same;
        static const char *const where[] = {" in registers", " in shared memory", " read twice",
                                            " in a ring of two rows"};
        printf("  %-40s %s%s, %s%s\n", p->name, fused ? "one pass" : "NOT FUSED", fused ? where[held] : "",
               same ? "the unfused bits" : "NOT THE UNFUSED BITS", pass ? "" : "  FAIL");
        for (int j = 0; ok && j < 2; j++) {
            Tensor as_gpu = *out[j];
            as_gpu.data = gpu[j];
            float *a = ref_load(&as_gpu), *r = ref_load(out[j]);
            double max_abs, e = gt_norm_error(a, r, ir_numel(out[j]), &max_abs);
            double tol = j == 0 || out[j]->fmt.elem == FMT_F32 ? 2e-5 : 1e-2;
            bool good = e >= 0 && e <= tol;
            printf("  %-40s %-10s %s[%lld] err %.2e (bound %.0e)%s\n", p->name, j ? "gradient" : "loss",
                   fmt_elem_name(out[j]->fmt.elem), (long long)ir_numel(out[j]), e, tol, good ? "" : "  FAIL");
            pass = pass && good;
            free(a);
            free(r);
        }
        if (!cuda_exec_push(exec, out, 2)) pass = false;   /* the device goes on from the reference's state */
        for (int j = 0; j < 4; j++) free(gpu[j]);
        failed += !pass;
    }
    arena_free(pa);
    if (failed) fail_msg("%d of %d cross-entropy pairs in one pass fail", failed, n_ce_pairs);
}
static void test_scaling(void **s) { (void)s; run_group("scaling"); }
static void test_optimizer(void **s) { (void)s; run_group("optimizer"); }
static void test_gemm(void **s) { (void)s; run_group("gemm"); }
/* Whether one of the launches of plan p runs `kernel` (a template's name and its "<"). */
static bool plan_runs(const CuNodePlan *p, const char *kernel) {
    for (int l = 0; l < p->n_launch; l++)
        if (strstr(p->launch[l].body, kernel)) return true;
    return false;
}

/* How many of wgmma_nodes are not planned on warpgroup MMA (each prints a line): a forward
 * runs ck_attn_wg_fwd; a backward ck_attn_wg_dq and ck_attn_wg_dkv, and ck_attn_wg_fwd for its
 * statistics unless it reads the ones the forward saved. */
static int wgmma_unplanned(void) {
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int missing = 0;
    for (int i = 0; i < n_wgmma_nodes; i++) {
        const Node *n = wgmma_nodes[i];
        const CuNodePlan *p = &plans[n->index];
        const char *fwd = "ck_attn_wg_fwd<";   /* not pipelined unless chosen (pipe_twins) */
        bool ok = n->op == OP_ATTENTION ? plan_runs(p, fwd)
                                        : plan_runs(p, "ck_attn_wg_dq<") && plan_runs(p, "ck_attn_wg_dkv<") &&
                                              (ir_attention_bwd_reads_y(n) || plan_runs(p, fwd));
        if (!ok) printf("%s: not planned on warpgroup MMA\n", n->t.name), missing++;
    }
    arena_free(pa);
    return missing;
}

static void test_attention(void **s) {
    (void)s;
    assert_true(n_wgmma_nodes > 0);
    assert_int_equal(wgmma_unplanned(), 0);
    run_group("attention");
}

/* Runs nodes[0], then nodes[1] (one node twice, or twins over the same inputs), each with its
 * outputs set to 0xFF first, and counts in *differ the bytes of their outputs that differ, of
 * *bytes; false where a run failed or the two have different outputs. */
static bool runs_differ(Node *const nodes[2], int64_t *bytes, int64_t *differ) {
    Tensor *out[2][8];
    int n_out[2];
    unsigned char *got[2][8] = {{0}};
    for (int t = 0; t < 2; t++) n_out[t] = outputs_of(nodes[t], out[t]);
    bool ok = n_out[0] == n_out[1];
    for (int t = 0; ok && t < 2; t++) {
        for (int j = 0; j < n_out[t]; j++) memset(out[t][j]->data, 0xFF, (size_t)gt_bytes(out[t][j]));
        ok = cuda_exec_push(exec, out[t], n_out[t]) && cuda_exec_run_node(exec, nodes[t]) &&
             cuda_exec_pull(exec, out[t], n_out[t]);
        for (int j = 0; ok && j < n_out[t]; j++) {
            got[t][j] = malloc((size_t)gt_bytes(out[t][j]));
            memcpy(got[t][j], out[t][j]->data, (size_t)gt_bytes(out[t][j]));
        }
    }
    *bytes = *differ = 0;
    for (int j = 0; ok && j < n_out[0]; j++) {
        *bytes += gt_bytes(out[0][j]);
        for (int64_t i = 0; i < gt_bytes(out[0][j]); i++) *differ += got[0][j][i] != got[1][j][i];
    }
    for (int t = 0; t < 2; t++)
        for (int j = 0; j < 8; j++) free(got[t][j]);
    return ok;
}

/* Whether node n, planned as its test expects (planned), gives the same bytes from two runs;
 * a line says what was seen. */
static bool repeats(Node *n, bool planned) {
    Node *twice[2] = {n, n};
    int64_t differ = 0, bytes = 0;
    bool pass = planned && runs_differ(twice, &bytes, &differ) && differ == 0;
    printf("  %-70s %lld bytes, %lld differ between runs%s\n", n->t.name, (long long)bytes, (long long)differ,
           pass ? "" : planned ? "  FAIL" : "  FAIL (not planned as expected)");
    return pass;
}

/* dq_in_dkv_nodes: planned with no dq pass and a dk/dv pass that computes dq (its template's
 * last argument 1), and the same bits from two runs (the parts of dq are summed in a fixed
 * order; test_attention compared them with the reference) */
static void test_attention_dq_in_dkv(void **s) {
    (void)s;
    assert_true(n_dq_in_dkv > 0);
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int failed = 0;
    for (int k = 0; k < n_dq_in_dkv; k++) {
        Node *n = dq_in_dkv_nodes[k];
        const CuNodePlan *p = &plans[n->index];
        bool planned = !plan_runs(p, "ck_attn_wg_dq<") && !plan_runs(p, "ck_attn_tc_dq<");
        for (int l = 0; l < p->n_launch && planned; l++) {
            const char *body = p->launch[l].body;
            if (strncmp(body, "ck_attn_wg_dkv<", 15)) continue;
            const char *end = strstr(body, ">(a)");
            planned = end && end - body > 3 && !strncmp(end - 3, ", 1", 3);
        }
        planned = planned && plan_runs(p, "ck_attn_wg_dkv<");
        failed += !repeats(n, planned);
    }
    arena_free(pa);
    if (failed) fail_msg("%d backwards with dq in the dk/dv pass failed", failed);
}

/* dkv_parts_nodes: planned with the dk/dv pass in that many parts (its template's last
 * argument) after a dq pass that zeroes the tickets (its ZERO argument 1: the last, or the one
 * before the saved y's format where the dq pass makes the statistics), and the same bits from
 * two runs (test_attention compared them with the reference) */
static void test_attention_dkv_parts(void **s) {
    (void)s;
    assert_true(n_dkv_parts > 0);
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int failed = 0;
    for (int k = 0; k < n_dkv_parts; k++) {
        const CuNodePlan *p = &plans[dkv_parts_nodes[k].node->index];
        char dkv[16];
        snprintf(dkv, sizeof dkv, ", %d>(a)", dkv_parts_nodes[k].parts);
        bool planned_dkv = false, planned_dq = false;
        for (int l = 0; l < p->n_launch; l++) {
            const char *body = p->launch[l].body;
            if (!strncmp(body, "ck_attn_wg_dkv<", 15)) planned_dkv = strstr(body, dkv) != NULL;
            if (!strncmp(body, "ck_attn_wg_dq<", 14)) {
                const char *ys = NULL;   /* the last format argument, ", F<..>" */
                for (const char *q = strstr(body, ", F<"); q; q = strstr(q + 1, ", F<")) ys = q;
                planned_dq = strstr(body, ", 1>(a)") ||
                             (ys && ys - body > 3 && !strncmp(ys - 3, ", 1", 3) && strchr(ys, '>') == strstr(ys, ">>(a)"));
            }
        }
        failed += !repeats(dkv_parts_nodes[k].node, planned_dkv && planned_dq);
    }
    arena_free(pa);
    if (failed) fail_msg("%d backwards with the dk/dv steps in parts failed", failed);
}

/* ws_nodes: planned on the forward with a producer warpgroup and that many consumer warpgroups
 * (for a backward, its rerun of the forward), and the same bits from two runs (test_attention
 * compared them with the reference) */
static void test_attention_producer_warp(void **s) {
    (void)s;
    assert_true(n_ws_nodes > 0);
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int failed = 0;
    for (int k = 0; k < n_ws_nodes; k++) {
        Node *n = ws_nodes[k].node;
        const CuNodePlan *p = &plans[n->index];
        char kernel[64];
        snprintf(kernel, sizeof kernel, "ck_attn_ws_fwd<%lld, %d, %d, %d, %d,", (long long)ws_nodes[k].D,
                 ws_nodes[k].wgs, ws_nodes[k].tma, ws_nodes[k].keys, ws_nodes[k].pipe);
        failed += !repeats(n, plan_runs(p, kernel) && !plan_runs(p, "ck_attn_wg_fwd<"));
    }
    arena_free(pa);
    if (failed) fail_msg("%d attentions with a producer warpgroup failed", failed);
}

/* pipe_twins: the same bits with and without the pipelined forward (each output of the node:
 * y, or dq, dk, dv; their planned kernels checked too) */
static void test_attention_pipeline(void **s) {
    (void)s;
    assert_true(n_pipe_twins > 0);
    Arena *pa = arena_new();
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
    assert_non_null(plans);
    int failed = 0;
    for (int k = 0; k < n_pipe_twins; k++) {
        Node *nodes[2] = {pipe_twins[k].pipe, pipe_twins[k].plain};
        bool planned = plan_runs(&plans[nodes[1]->index], "ck_attn_wg_") &&
                       !plan_runs(&plans[nodes[1]->index], "ck_attn_wg_fwd_pipe<") &&
                       (nodes[0]->op != OP_ATTENTION || plan_runs(&plans[nodes[0]->index], "ck_attn_wg_fwd_pipe<"));
        int64_t differ = 0, bytes = 0;
        bool ok = planned && runs_differ(nodes, &bytes, &differ);
        bool pass = ok && differ == 0;
        printf("  %-60s %lld bytes, %lld differ%s\n", nodes[0]->t.name, (long long)bytes, (long long)differ,
               pass ? "" : planned ? "  FAIL" : "  FAIL (not planned as expected)");
        failed += !pass;
    }
    arena_free(pa);
    if (failed) fail_msg("%d pipelined attentions differ from their twins", failed);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* FP8C_TEST_COMPILE_ONLY=1: build the cases and compile their module, no GPU needed */
    const char *only = getenv("FP8C_TEST_COMPILE_ONLY");
    if (only && !strcmp(only, "1")) {
        gt_seed();
        arena = arena_new();
        graph = ir_graph_new(arena);
        graph->model_name = "gpu_ops";
        build_elementwise(), build_rows(), build_quant(), build_amax(), build_optimizer(), build_gemm(),
            build_quant_transposed(), build_quant_group_fused(), build_input_copies(), build_product_copies(), build_cast_transposes(), build_norm_grads(),
            build_attention();
        /* the memory plan too: the fusions it allows launch kernels of their own */
        if (!rt_memory_bind(graph, &mem)) return 1;
        CudaBinary bin;
        bool skipped = false;
        char why[512] = "";
        if (!cuda_compile_graph(graph, &bin, &skipped, why, sizeof why) || skipped) {
            printf("cannot compile the cases: %s\n", why);
            return 1;
        }
        printf("%d cases, %zu bytes of cubin\n", n_cases, bin.cubin_size);
        Arena *pa = arena_new();
        CuNodePlan *plans = cuda_plan_graph(graph, pa, why, sizeof why);
        int fused = 0;
        for (int k = 0; plans && k < N_CAST_T; k++) fused += cast_t_fused(plans, &cast_t[k]);
        printf("cast-transposes planned as one launch: %d of %d\n", fused, N_CAST_T);
        int copies = 0;
        for (int k = 0; plans && k < N_INPUT_COPIES; k++) {
            const CuNodePlan *py = &plans[input_copies[k].y->index];
            copies += plans[input_copies[k].q->index].n_launch == 0 && py->n_launch == 1 &&
                      (py->launch[0].smem > 0) == input_copies[k].staged;
        }
        printf("input group copies written by their reader: %d of %d\n", copies, N_INPUT_COPIES);
        int products = 0;
        for (int k = 0; plans && k < N_PRODUCT_COPIES; k++) {
            const ProductCopy *c = &product_copies[k];
            bool one = plans[c->y->index].n_launch == 1 && strstr(plans[c->y->index].launch[0].body, "ck_binary_group<") &&
                       (!c->act || !plans[c->act->index].n_launch);
            for (int j = 0; j < 2; j++) one &= !c->q[j] || !plans[c->q[j]->index].n_launch;
            products += one;
        }
        printf("products writing their inputs' group copies: %d of %d\n", products, N_PRODUCT_COPIES);
        arena_free(pa);
        int unplanned = wgmma_unplanned(), misplanned = ce_pairs_misplanned();
        printf("cross-entropy pairs planned as expected: %d of %d\n", n_ce_pairs - misplanned, n_ce_pairs);
        return fused == N_CAST_T && copies == N_INPUT_COPIES && products == N_PRODUCT_COPIES && !unplanned && !misplanned ? 0 : 1;
    }
    gt_require_gpu("test_gpu_ops");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_elementwise), cmocka_unit_test(test_rows), cmocka_unit_test(test_ce_one_pass),
        cmocka_unit_test(test_scaling),     cmocka_unit_test(test_quantize_transposed),
        cmocka_unit_test(test_quantize_group_fused), cmocka_unit_test(test_input_copies),
        cmocka_unit_test(test_product_copies),
        cmocka_unit_test(test_cast_transposes),
        cmocka_unit_test(test_norm_grads_fused),
        cmocka_unit_test(test_optimizer),
        cmocka_unit_test(test_gemm),        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_attention_pipeline),
        cmocka_unit_test(test_attention_dq_in_dkv),
        cmocka_unit_test(test_attention_dkv_parts),
        cmocka_unit_test(test_attention_producer_warp),
        cmocka_unit_test(test_amax_parts),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
