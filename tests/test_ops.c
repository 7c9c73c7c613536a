/* test_ops.c — the reference executor: every differentiable op against finite differences,
 * AdamW against a hand computation, thread-count independence, exact rounding into stored
 * formats, scaled formats, quantization ops and parameter init.
 *
 * Gradient checks build the op and the backward ops that autodiff would emit for it by hand,
 * take loss = sum(out * R) for a random R (so dy = R), and compare the analytic gradient of
 * each input with central differences: inputs are perturbed in f32 by h = 1e-2 (the actual
 * step is measured after rounding) and the loss is summed in f64. The tolerance, stated once,
 * is a relative error of the whole gradient vector ||g - g_fd|| / ||g_fd|| < 1e-2; correct
 * ops land near 1e-5, a wrong sign, index or factor lands near 1. Data are fresh random
 * values each run; the seed is printed (FP8C_TEST_SEED=n repeats a run). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ref_internal.h"
#include "test_rng.h"

#define FD_STEP 1e-2
#define FD_TOL 1e-2

static const SrcLoc here = {"test_ops.c", 1, 1};

/* ---------------------------------------------------------------- building test graphs */

typedef struct {
    int64_t i[IR_MAX_IATTR];
    double f[IR_MAX_FATTR];
} Attrs;

typedef struct {
    Arena *arena;
    Graph *g;
    Phase phase;            /* given to the nodes built next */
    void *bufs[256];
    int n_bufs;
} TG;

static TG *tg_new(void)
{
    TG *t = calloc(1, sizeof *t);
    t->arena = arena_new();
    t->g = ir_graph_new(t->arena);
    t->phase = PHASE_FORWARD;
    return t;
}

static void tg_free(TG *t)
{
    for (int i = 0; i < t->n_bufs; i++) free(t->bufs[i]);
    arena_free(t->arena);
    free(t);
}

static void tg_bind(TG *t, Node *n)
{
    if (n->t.fmt.elem == FMT_VOID) return;
    size_t bytes = (size_t)ir_numel(&n->t) * (size_t)fmt_elem_bytes(n->t.fmt.elem);
    assert_true(t->n_bufs < 256);
    n->t.data = t->bufs[t->n_bufs++] = calloc(1, bytes ? bytes : 1);
}

/* An f32 input of random normal values times `scale`. */
static Node *tg_input(TG *t, const char *name, float scale, int rank, const int64_t *dims)
{
    Node *n = ir_leaf(t->g, OP_INPUT, name, ROLE_INPUT, FMT_F32, rank, dims, here);
    tg_bind(t, n);
    float *x = n->t.data;
    for (int64_t i = 0; i < ir_numel(&n->t); i++) x[i] = scale * rng_normal();
    return n;
}

/* i32 ids in [0, hi), with probability p_ignore of -1 */
static Node *tg_ids(TG *t, const char *name, int64_t hi, double p_ignore, int rank,
                    const int64_t *dims)
{
    Node *n = ir_leaf(t->g, OP_INPUT, name, ROLE_INPUT, FMT_I32, rank, dims, here);
    tg_bind(t, n);
    int32_t *x = n->t.data;
    for (int64_t i = 0; i < ir_numel(&n->t); i++)
        x[i] = rng_uniform() < p_ignore ? -1 : (int32_t)rng_int(0, hi);
    return n;
}

static Node *tg_node_v(TG *t, OpKind op, Attrs at, int n_in, Node *const *in)
{
    Node *n = ir_add(t->g, op, n_in, in, here);
    memcpy(n->iattr, at.i, sizeof at.i);
    memcpy(n->fattr, at.f, sizeof at.f);
    n->phase = t->phase;
    const char *err = ir_infer_shape(n, t->arena);
    if (err) fail_msg("%s: %s", ir_op_info(op)->text, err);
    tg_bind(t, n);
    return n;
}

#define NODE(t, op, at, ...)                                                                  \
    tg_node_v(t, op, at, (int)(sizeof((Node *[]){__VA_ARGS__}) / sizeof(Node *)),             \
              (Node *[]){__VA_ARGS__})
#define NOATTR ((Attrs){{0}, {0}})
#define IA(...) ((Attrs){.i = {__VA_ARGS__}})
#define FA(...) ((Attrs){.f = {__VA_ARGS__}})

static Node *tg_reshape(TG *t, Node *x, int rank, const int64_t *dims)
{
    Node *n = ir_add1(t->g, OP_RESHAPE, x, here);
    n->phase = t->phase;
    ir_set_shape(n, rank, dims);
    const char *err = ir_infer_shape(n, t->arena);
    if (err) fail_msg("reshape: %s", err);
    tg_bind(t, n);
    return n;
}

/* dy for out: a random input of out's shape (loss = sum(out * R)); later nodes are backward */
static Node *tg_backward(TG *t, Node *out)
{
    Node *r = tg_input(t, "R", 1.0f, out->t.rank, out->t.dims);
    t->phase = PHASE_BACKWARD;
    return r;
}

/* ---------------------------------------------------------------- finite differences */

static double loss_of(TG *t, Node *out, Node *r)
{
    ref_run_phase(t->g, PHASE_FORWARD);
    float *y = ref_load(&out->t), *w = ref_load(&r->t);
    double s = 0;
    for (int64_t i = 0; i < ir_numel(&out->t); i++) s += (double)y[i] * w[i];
    free(y);
    free(w);
    return s;
}

/* ||g - g_fd|| / ||g_fd|| for the gradient gx of input x (f32) */
static double fd_error(TG *t, Node *out, Node *r, Node *x, Node *gx)
{
    assert_int_equal(ir_numel(&x->t), ir_numel(&gx->t));
    ref_run_phase(t->g, PHASE_FORWARD);
    ref_run_phase(t->g, PHASE_BACKWARD);
    float *ga = ref_load(&gx->t);
    float *xd = x->t.data;
    double num = 0, den = 0;
    for (int64_t i = 0; i < ir_numel(&x->t); i++) {
        float orig = xd[i], xp = (float)(orig + FD_STEP), xm = (float)(orig - FD_STEP);
        xd[i] = xp;
        double lp = loss_of(t, out, r);
        xd[i] = xm;
        double lm = loss_of(t, out, r);
        xd[i] = orig;
        double fd = (lp - lm) / ((double)xp - (double)xm);
        num += (ga[i] - fd) * (ga[i] - fd);
        den += fd * fd;
    }
    free(ga);
    ref_run_phase(t->g, PHASE_FORWARD);
    return sqrt(num) / (sqrt(den) > 1e-30 ? sqrt(den) : 1e-30);
}

static void check_grad(TG *t, Node *out, Node *r, Node *x, Node *gx, const char *what)
{
    double e = fd_error(t, out, r, x, gx);
    printf("    %-34s rel err %.2e\n", what, e);
    if (!(e < FD_TOL)) fail_msg("%s: gradient relative error %.3e >= %.0e", what, e, FD_TOL);
}

/* ---------------------------------------------------------------- gradient checks */

static void test_grad_matmul(void **state)
{
    (void)state;
    const int64_t M = 7, K = 5, N = 11;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            TG *t = tg_new();
            int64_t a3[3] = {1, M, K}, a2[2] = {K, M}, b_kn[2] = {K, N}, b_nk[2] = {N, K};
            Node *a = ta ? tg_input(t, "a", 1, 2, a2) : tg_input(t, "a", 1, 3, a3);
            Node *b = tb ? tg_input(t, "b", 1, 2, b_nk) : tg_input(t, "b", 1, 2, b_kn);
            Node *c = NODE(t, OP_MATMUL, IA(ta, tb), a, b);
            Node *dc = tg_backward(t, c);
            Node *da, *db;
            if (!ta && !tb) {
                da = NODE(t, OP_MATMUL, IA(0, 1), dc, b);
                db = NODE(t, OP_MATMUL, IA(1, 0), a, dc);
            } else if (!ta && tb) {
                da = NODE(t, OP_MATMUL, IA(0, 0), dc, b);
                db = NODE(t, OP_MATMUL, IA(1, 0), dc, a);
            } else if (ta && !tb) {
                da = NODE(t, OP_MATMUL, IA(0, 1), b, dc);
                db = NODE(t, OP_MATMUL, IA(0, 0), a, dc);
            } else {
                da = NODE(t, OP_MATMUL, IA(1, 1), b, dc);
                db = NODE(t, OP_MATMUL, IA(1, 1), dc, a);
            }
            char what[64];
            snprintf(what, sizeof what, "matmul ta=%d tb=%d dA", ta, tb);
            check_grad(t, c, dc, a, da, what);
            snprintf(what, sizeof what, "matmul ta=%d tb=%d dB", ta, tb);
            check_grad(t, c, dc, b, db, what);
            tg_free(t);
        }
}

/* gradient of a broadcast operand: dy summed over the dims it was broadcast along */
static Node *reduce_to(TG *t, Node *dy, Node *like)
{
    int64_t nb = ir_numel(&like->t), rows[2] = {ir_numel(&dy->t) / nb, nb};
    Node *flat = tg_reshape(t, dy, 2, rows);
    Node *s = NODE(t, OP_SUM_ROWS, NOATTR, flat);
    return tg_reshape(t, s, like->t.rank, like->t.dims);
}

static void test_grad_binary(void **state)
{
    (void)state;
    const int64_t shape[3] = {2, 3, 4};
    const struct { int rank; int64_t dims[3]; } bshapes[] = {{3, {2, 3, 4}}, {1, {4}}, {2, {3, 4}}, {0, {0}}};
    const OpKind ops[] = {OP_ADD, OP_SUB, OP_MUL};
    for (int o = 0; o < 3; o++)
        for (int s = 0; s < 4; s++) {
            TG *t = tg_new();
            Node *a = tg_input(t, "a", 1, 3, shape);
            Node *b = tg_input(t, "b", 1, bshapes[s].rank, bshapes[s].dims);
            Node *y = NODE(t, ops[o], NOATTR, a, b);
            Node *dy = tg_backward(t, y);
            Node *da, *db;
            if (ops[o] == OP_MUL) {
                da = NODE(t, OP_MUL, NOATTR, dy, b);
                db = reduce_to(t, NODE(t, OP_MUL, NOATTR, dy, a), b);
            } else {
                da = NODE(t, OP_SCALE, FA(1.0), dy);
                db = reduce_to(t, ops[o] == OP_SUB ? NODE(t, OP_SCALE, FA(-1.0), dy) : dy, b);
            }
            char what[64];
            snprintf(what, sizeof what, "%s b rank %d: da", ir_op_info(ops[o])->text, bshapes[s].rank);
            check_grad(t, y, dy, a, da, what);
            snprintf(what, sizeof what, "%s b rank %d: db", ir_op_info(ops[o])->text, bshapes[s].rank);
            check_grad(t, y, dy, b, db, what);
            tg_free(t);
        }
}

static void test_grad_pointwise(void **state)
{
    (void)state;
    const int64_t shape[2] = {6, 7};
    const OpKind fwd[] = {OP_SCALE, OP_GELU, OP_SILU, OP_RESHAPE, OP_ADD_N};
    for (int k = 0; k < 5; k++) {
        TG *t = tg_new();
        Node *x = tg_input(t, "x", 2, 2, shape), *y, *dx;
        if (fwd[k] == OP_RESHAPE) {
            int64_t d[3] = {3, 2, 7};
            y = tg_reshape(t, x, 3, d);
        } else if (fwd[k] == OP_ADD_N) {
            Node *z = tg_input(t, "z", 1, 2, shape);
            y = NODE(t, OP_ADD_N, NOATTR, x, z, x);
        } else {
            y = NODE(t, fwd[k], FA(-1.7), x);
        }
        Node *dy = tg_backward(t, y);
        switch (fwd[k]) {
        case OP_SCALE: dx = NODE(t, OP_SCALE, FA(-1.7), dy); break;
        case OP_GELU: dx = NODE(t, OP_GELU_BWD, NOATTR, dy, x); break;
        case OP_SILU: dx = NODE(t, OP_SILU_BWD, NOATTR, dy, x); break;
        case OP_RESHAPE: dx = tg_reshape(t, dy, 2, shape); break;
        default: dx = NODE(t, OP_SCALE, FA(2.0), dy); break;   /* x appears twice */
        }
        check_grad(t, y, dy, x, dx, ir_op_info(fwd[k])->text);
        tg_free(t);
    }
}

static void test_grad_norms(void **state)
{
    (void)state;
    const int64_t shape[3] = {2, 3, 8}, c[1] = {8};
    for (int ln = 0; ln < 2; ln++) {
        TG *t = tg_new();
        Node *x = tg_input(t, "x", 1.5f, 3, shape);
        float *xd = x->t.data;
        for (int64_t i = 0; i < ir_numel(&x->t); i++) xd[i] += 0.7f;   /* a non-zero mean */
        Node *w = tg_input(t, "w", 1, 1, c), *b = ln ? tg_input(t, "b", 1, 1, c) : NULL;
        Node *y = ln ? NODE(t, OP_LAYERNORM, FA(1e-5), x, w, b) : NODE(t, OP_RMSNORM, FA(1e-5), x, w);
        Node *dy = tg_backward(t, y);
        Node *dx = NODE(t, ln ? OP_LAYERNORM_BWD_X : OP_RMSNORM_BWD_X, FA(1e-5), dy, x, w);
        Node *dw = NODE(t, ln ? OP_LAYERNORM_BWD_W : OP_RMSNORM_BWD_W, FA(1e-5), dy, x);
        check_grad(t, y, dy, x, dx, ln ? "layernorm dx" : "rmsnorm dx");
        check_grad(t, y, dy, w, dw, ln ? "layernorm dw" : "rmsnorm dw");
        if (ln) check_grad(t, y, dy, b, NODE(t, OP_SUM_ROWS, NOATTR, dy), "layernorm db (sum_rows)");
        tg_free(t);
    }
}

static void test_grad_softmax(void **state)
{
    (void)state;
    const int64_t shape[3] = {2, 3, 9};
    TG *t = tg_new();
    Node *x = tg_input(t, "x", 2, 3, shape);
    Node *y = NODE(t, OP_SOFTMAX, NOATTR, x);
    Node *dy = tg_backward(t, y);
    check_grad(t, y, dy, x, NODE(t, OP_SOFTMAX_BWD, NOATTR, dy, y), "softmax");
    tg_free(t);
}

static void test_grad_embedding(void **state)
{
    (void)state;
    const int64_t V = 7, table_dims[2] = {V, 5}, id_dims[2] = {3, 4};
    TG *t = tg_new();
    Node *table = tg_input(t, "table", 1, 2, table_dims);
    Node *ids = tg_ids(t, "ids", V, 0, 2, id_dims);   /* 12 ids out of 7: repeats */
    Node *y = NODE(t, OP_EMBEDDING, NOATTR, table, ids);
    Node *dy = tg_backward(t, y);
    check_grad(t, y, dy, table, NODE(t, OP_EMBEDDING_BWD, IA(V), dy, ids), "embedding (scatter-add)");
    tg_free(t);
}

static void test_grad_cross_entropy(void **state)
{
    (void)state;
    const int64_t V = 7, logit_dims[3] = {2, 5, V}, tgt_dims[2] = {2, 5};
    TG *t = tg_new();
    Node *logits = tg_input(t, "logits", 2, 3, logit_dims);
    Node *tgt = tg_ids(t, "targets", V, 0.3, 2, tgt_dims);
    int32_t *td = tgt->t.data;
    td[0] = -1, td[1] = 3;   /* at least one ignored row and one counted row */
    Node *loss = NODE(t, OP_CROSS_ENTROPY, NOATTR, logits, tgt);
    Node *dl = tg_backward(t, loss);
    Node *dlogits = NODE(t, OP_CROSS_ENTROPY_BWD, NOATTR, dl, logits, tgt);
    check_grad(t, loss, dl, logits, dlogits, "cross_entropy (ignored rows)");

    /* the loss itself: mean over the counted rows of logsumexp - logit[target] */
    ref_run_phase(t->g, PHASE_FORWARD);
    const float *l = logits->t.data;
    double sum = 0;
    int valid = 0;
    for (int r = 0; r < 10; r++) {
        if (td[r] < 0) continue;
        double m = -INFINITY, s = 0;
        for (int c = 0; c < V; c++) m = fmax(m, l[r * V + c]);
        for (int c = 0; c < V; c++) s += exp(l[r * V + c] - m);
        sum += m + log(s) - l[r * V + td[r]];
        valid++;
    }
    assert_float_equal(*(float *)loss->t.data, sum / valid, 1e-5 * fabs(sum / valid) + 1e-6);
    /* ignored rows get no gradient */
    ref_run_phase(t->g, PHASE_BACKWARD);
    for (int c = 0; c < V; c++) assert_true(((float *)dlogits->t.data)[c] == 0.0f);
    tg_free(t);
}

static void test_grad_rope(void **state)
{
    (void)state;
    const int64_t shape[3] = {2, 5, 4 * 6};
    TG *t = tg_new();
    Node *x = tg_input(t, "x", 1, 3, shape);
    Node *y = NODE(t, OP_ROPE, ((Attrs){.i = {6, 0}, .f = {100.0}}), x);
    Node *dy = tg_backward(t, y);
    Node *dx = NODE(t, OP_ROPE, ((Attrs){.i = {6, 1}, .f = {100.0}}), dy);
    check_grad(t, y, dy, x, dx, "rope (backward = inverse)");
    /* position 0 is not rotated; position 1 turns pair 0 by exactly 1 radian */
    ref_run_phase(t->g, PHASE_FORWARD);
    const float *xi = x->t.data, *yo = y->t.data;
    assert_true(memcmp(xi, yo, sizeof(float) * 24) == 0);
    double c1 = cos(1.0), s1 = sin(1.0);
    assert_float_equal(yo[24], xi[24] * c1 - xi[25] * s1, 1e-6);
    assert_float_equal(yo[25], xi[24] * s1 + xi[25] * c1, 1e-6);
    tg_free(t);
}

static void test_grad_attention(void **state)
{
    (void)state;
    const int64_t B = 2, T = 7, H = 4, Hkv = 2, D = 4;
    const int64_t qd[3] = {B, T, H * D}, kd[3] = {B, T, Hkv * D};
    TG *t = tg_new();
    Node *q = tg_input(t, "q", 1, 3, qd), *k = tg_input(t, "k", 1, 3, kd), *v = tg_input(t, "v", 1, 3, kd);
    Attrs at = {.i = {H, Hkv}, .f = {0.6}};
    Node *y = NODE(t, OP_ATTENTION, at, q, k, v);
    Node *dy = tg_backward(t, y);
    Node *g = NODE(t, OP_ATTENTION_BWD, at, dy, q, k, v);
    Node *dq = NODE(t, OP_SLICE, IA(2, 0, H * D), g);
    Node *dk = NODE(t, OP_SLICE, IA(2, H * D, Hkv * D), g);
    Node *dv = NODE(t, OP_SLICE, IA(2, (H + Hkv) * D, Hkv * D), g);
    check_grad(t, y, dy, q, dq, "attention GQA dq");
    check_grad(t, y, dy, k, dk, "attention GQA dk");
    check_grad(t, y, dy, v, dv, "attention GQA dv");

    /* the packed form (one (B, T, (H + 2 Hkv) D) operand) gives the same bits both ways */
    Node *qkv = NODE(t, OP_CONCAT, IA(2), q, k, v);
    Node *yp = NODE(t, OP_ATTENTION, at, qkv);
    Node *gp = NODE(t, OP_ATTENTION_BWD, at, dy, qkv);
    ref_run_phase(t->g, PHASE_FORWARD);
    ref_run_phase(t->g, PHASE_BACKWARD);
    assert_memory_equal(yp->t.data, y->t.data, sizeof(float) * (size_t)ir_numel(&y->t));
    assert_memory_equal(gp->t.data, g->t.data, sizeof(float) * (size_t)ir_numel(&g->t));

    /* causality: the first row of each head is its first value row */
    ref_run_phase(t->g, PHASE_FORWARD);
    const float *yo = y->t.data, *vo = v->t.data;
    for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D; d++)
            assert_float_equal(yo[h * D + d], vo[(h / (H / Hkv)) * D + d], 1e-6);
    tg_free(t);
}

static void test_grad_shape_ops(void **state)
{
    (void)state;
    const int64_t xd[3] = {3, 6, 4}, ad[3] = {3, 2, 4}, bd[3] = {3, 5, 4};
    TG *t = tg_new();
    Node *x = tg_input(t, "x", 1, 3, xd);
    Node *s = NODE(t, OP_SLICE, IA(1, 2, 3), x);
    Node *ds = tg_backward(t, s);
    check_grad(t, s, ds, x, NODE(t, OP_PAD, IA(1, 2, 6), ds), "slice (backward pad)");
    tg_free(t);

    t = tg_new();
    x = tg_input(t, "x", 1, 3, xd);
    Node *p = NODE(t, OP_PAD, IA(2, 1, 7), x);
    Node *dp = tg_backward(t, p);
    check_grad(t, p, dp, x, NODE(t, OP_SLICE, IA(2, 1, 4), dp), "pad (backward slice)");
    tg_free(t);

    t = tg_new();
    Node *a = tg_input(t, "a", 1, 3, ad), *b = tg_input(t, "b", 1, 3, bd);
    Node *c = NODE(t, OP_CONCAT, IA(1), a, b, a);
    Node *dc = tg_backward(t, c);
    Node *da = NODE(t, OP_ADD, NOATTR, NODE(t, OP_SLICE, IA(1, 0, 2), dc), NODE(t, OP_SLICE, IA(1, 7, 2), dc));
    check_grad(t, c, dc, a, da, "concat (twice) da");
    check_grad(t, c, dc, b, NODE(t, OP_SLICE, IA(1, 2, 5), dc), "concat db");
    tg_free(t);

    t = tg_new();
    x = tg_input(t, "x", 1, 3, xd);
    Node *n2 = NODE(t, OP_SQNORM, NOATTR, x);
    Node *dn = tg_backward(t, n2);
    check_grad(t, n2, dn, x, NODE(t, OP_MUL, NOATTR, NODE(t, OP_SCALE, FA(2.0), x), dn), "sqnorm");
    tg_free(t);
}

/* ---------------------------------------------------------------- forward values
 * Finite differences check backward against forward; these check the forward itself against
 * its definition evaluated directly in f64 with libm, as normalized error ||y - y_ref|| /
 * ||y_ref|| < 1e-6 (the executor rounds its results to f32 once, about 6e-8). */

static void expect_close(const char *what, const float *y, const double *want, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += (y[i] - want[i]) * (y[i] - want[i]);
        den += want[i] * want[i];
    }
    double e = sqrt(num / (den > 0 ? den : 1e-300));
    printf("    %-34s rel err %.2e\n", what, e);
    if (!(e < 1e-6)) fail_msg("%s: forward relative error %.3e >= 1e-6", what, e);
}

static void test_forward_values(void **state)
{
    (void)state;
    const int64_t B = 2, T = 13, H = 6, Hkv = 2, D = 5;
    const int64_t qd[3] = {B, T, H * D}, kd[3] = {B, T, Hkv * D}, xd[2] = {9, 11}, c[1] = {11};
    TG *t = tg_new();
    Node *q = tg_input(t, "q", 1, 3, qd), *k = tg_input(t, "k", 1, 3, kd), *v = tg_input(t, "v", 1, 3, kd);
    double scale = 0.3 + rng_uniform();
    Node *att = NODE(t, OP_ATTENTION, ((Attrs){.i = {H, Hkv}, .f = {scale}}), q, k, v);
    Node *x = tg_input(t, "x", 2, 2, xd), *w = tg_input(t, "w", 1, 1, c), *b = tg_input(t, "b", 1, 1, c);
    Node *ln = NODE(t, OP_LAYERNORM, FA(1e-5), x, w, b);
    Node *rms = NODE(t, OP_RMSNORM, FA(1e-5), x, w);
    Node *sm = NODE(t, OP_SOFTMAX, NOATTR, x);
    Node *ge = NODE(t, OP_GELU, NOATTR, x);
    Node *si = NODE(t, OP_SILU, NOATTR, x);
    ref_run_phase(t->g, PHASE_FORWARD);

    const float *qv = q->t.data, *kv = k->t.data, *vv = v->t.data;
    double *want = calloc((size_t)(B * T * H * D), sizeof(double));
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < T; i++) {
                int64_t g = h / (H / Hkv);
                double sc[13], m = -INFINITY, sum = 0;
                for (int64_t j = 0; j <= i; j++) {
                    double dot = 0;
                    for (int64_t d = 0; d < D; d++)
                        dot += (double)qv[((bb * T + i) * H + h) * D + d] * kv[((bb * T + j) * Hkv + g) * D + d];
                    sc[j] = dot * scale;
                    m = fmax(m, sc[j]);
                }
                for (int64_t j = 0; j <= i; j++) sum += exp(sc[j] - m);
                for (int64_t d = 0; d < D; d++) {
                    double o = 0;
                    for (int64_t j = 0; j <= i; j++) o += exp(sc[j] - m) / sum * vv[((bb * T + j) * Hkv + g) * D + d];
                    want[((bb * T + i) * H + h) * D + d] = o;
                }
            }
    expect_close("attention (GQA, causal)", att->t.data, want, B * T * H * D);
    free(want);

    const float *xv = x->t.data, *wv = w->t.data, *bv = b->t.data;
    double wl[99], wr[99], ws[99], wg[99], wsi[99];
    for (int r = 0; r < 9; r++) {
        const float *row = xv + r * 11;
        double mean = 0, var = 0, ms = 0, mx = -INFINITY, se = 0;
        for (int i = 0; i < 11; i++) mean += row[i] / 11.0, ms += (double)row[i] * row[i] / 11.0, mx = fmax(mx, row[i]);
        for (int i = 0; i < 11; i++) var += (row[i] - mean) * (row[i] - mean) / 11.0, se += exp(row[i] - mx);
        for (int i = 0; i < 11; i++) {
            double u = row[i];
            wl[r * 11 + i] = (u - mean) / sqrt(var + 1e-5) * wv[i] + bv[i];
            wr[r * 11 + i] = u / sqrt(ms + 1e-5) * wv[i];
            ws[r * 11 + i] = exp(u - mx) / se;
            wg[r * 11 + i] = 0.5 * u * (1 + tanh(sqrt(2 / M_PI) * (u + 0.044715 * u * u * u)));
            wsi[r * 11 + i] = u / (1 + exp(-u));
        }
    }
    expect_close("layernorm", ln->t.data, wl, 99);
    expect_close("rmsnorm", rms->t.data, wr, 99);
    expect_close("softmax", sm->t.data, ws, 99);
    expect_close("gelu (tanh)", ge->t.data, wg, 99);
    expect_close("silu", si->t.data, wsi, 99);
    tg_free(t);
}

/* ---------------------------------------------------------------- AdamW */

static Node *leaf_fill(TG *t, OpKind op, const char *name, Role role, ElemType e, int rank,
                       const int64_t *dims, const float *values)
{
    Node *n = ir_leaf(t->g, op, name, role, e, rank, dims, here);
    tg_bind(t, n);
    ref_store(&n->t, values);
    return n;
}

/* AdamW's first eight operands: param, grad, m, v (f32 states of 1-D dims) and the scalars
 * lr, step, clip, grad_scale (k[0..3]) */
static void adamw_operands(TG *t, Node *param, const int64_t *dims, const float *g, const float *m,
                           const float *v, const float k[4], Node **in)
{
    static const char *const scalars[4] = {"lr", "step", "clip", "grad_scale"};
    in[0] = param;
    in[1] = leaf_fill(t, OP_STATE, "w:grad", ROLE_GRAD, FMT_F32, 1, dims, g);
    in[2] = leaf_fill(t, OP_STATE, "w:adam_m", ROLE_ADAM_M, FMT_F32, 1, dims, m);
    in[3] = leaf_fill(t, OP_STATE, "w:adam_v", ROLE_ADAM_V, FMT_F32, 1, dims, v);
    for (int i = 0; i < 4; i++) in[4 + i] = leaf_fill(t, OP_INPUT, scalars[i], ROLE_INPUT, FMT_F32, 0, NULL, &k[i]);
}

static void test_adamw(void **state)
{
    (void)state;
    for (int with_master = 0; with_master < 2; with_master++) {
        enum { N = 37 };
        const int64_t dims[1] = {N};
        float w[N], g[N], m[N], v[N];
        for (int i = 0; i < N; i++) {
            w[i] = rng_normal(), g[i] = rng_normal(), m[i] = 0.1f * rng_normal();
            v[i] = 0.01f * (float)rng_uniform();
        }
        float lr = 1e-2f * (float)(1 + rng_uniform()), step = (float)rng_int(1, 20);
        float clip = (float)(0.5 + 0.5 * rng_uniform()), gs = 0.25f;
        double b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
        TG *t = tg_new();
        ElemType pe = with_master ? FMT_BF16 : FMT_F32;
        Node *param = leaf_fill(t, OP_PARAM, "w", ROLE_PARAM, pe, 1, dims, w);
        Node *in[9];
        adamw_operands(t, param, dims, g, m, v, (float[4]){lr, step, clip, gs}, in);
        in[8] = with_master ? leaf_fill(t, OP_STATE, "w:master", ROLE_MASTER, FMT_F32, 1, dims, w) : NULL;
        Node *up = tg_node_v(t, OP_ADAMW, ((Attrs){.f = {b1, b2, eps, wd}}), 8 + with_master, in);
        ref_exec_node(up);
        const float *pw = NULL;
        float *pr = ref_load(&param->t);
        if (with_master) pw = in[8]->t.data;
        for (int i = 0; i < N; i++) {
            double gg = (double)g[i] * gs * clip;
            double mm = b1 * m[i] + (1 - b1) * gg, vv = b2 * v[i] + (1 - b2) * gg * gg;
            double mh = mm / (1 - pow(b1, step)), vh = vv / (1 - pow(b2, step));
            double ww = w[i] - lr * (mh / (sqrt(vh) + eps) + wd * w[i]);
            assert_float_equal(((float *)in[2]->t.data)[i], mm, 1e-6 * fabs(mm) + 1e-9);
            assert_float_equal(((float *)in[3]->t.data)[i], vv, 1e-6 * fabs(vv) + 1e-12);
            assert_true(((float *)in[1]->t.data)[i] == 0.0f);
            if (with_master) {
                assert_float_equal(pw[i], ww, 1e-6 * fabs(ww) + 1e-7);
                assert_true(pr[i] == num_round(FMT_BF16, pw[i]));
            } else {
                assert_float_equal(pr[i], ww, 1e-6 * fabs(ww) + 1e-7);
            }
        }
        free(pr);
        tg_free(t);
    }
}

/* Lion and SGD with momentum against their formulas in f64, on fresh random data: with and
 * without weight decay, with and without a master (a bf16 parameter rounds the master's new
 * value), SGD with and without Nesterov momentum; the gradient is zeroed, and the operands the
 * update writes are param, grad, m and the master:
 *   g = grad grad_scale clip
 *   Lion: w -= lr (sign(b1 m + (1 - b1) g) + wd w), m = b2 m + (1 - b2) g
 *   SGD:  g += wd w, m = mu m + g, w -= lr (nesterov ? g + mu m : m) */
static void test_momentum_updates(void **state)
{
    (void)state;
    for (int k = 0; k < 16; k++) {
        bool lion = k & 1, decay = k & 2, with_master = k & 4, nesterov = k & 8;
        if (lion && nesterov) continue;
        enum { N = 53 };
        const int64_t dims[1] = {N};
        float w[N], g[N], m[N];
        for (int i = 0; i < N; i++) w[i] = rng_normal(), g[i] = rng_normal(), m[i] = 0.1f * rng_normal();
        g[5] = 0, m[5] = 0;   /* Lion: sign(0) = 0, the weight moves by its decay alone */
        float lr = 1e-2f * (float)(1 + rng_uniform()), step = (float)rng_int(1, 20);
        float clip = (float)(0.5 + 0.5 * rng_uniform()), gs = 0.25f;
        double b1 = lion ? 0.9 : 0.8 + 0.15 * rng_uniform(), b2 = 0.99, wd = decay ? 0.1 : 0.0;
        TG *t = tg_new();
        Node *param = leaf_fill(t, OP_PARAM, "w", ROLE_PARAM, with_master ? FMT_BF16 : FMT_F32, 1, dims, w);
        static const char *const scalars[4] = {"lr", "step", "clip", "grad_scale"};
        const float kv[4] = {lr, step, clip, gs};
        Node *in[8] = {param, leaf_fill(t, OP_STATE, "w:grad", ROLE_GRAD, FMT_F32, 1, dims, g),
                       leaf_fill(t, OP_STATE, "w:momentum", ROLE_ADAM_M, FMT_F32, 1, dims, m)};
        for (int i = 0; i < 4; i++) in[3 + i] = leaf_fill(t, OP_INPUT, scalars[i], ROLE_INPUT, FMT_F32, 0, NULL, &kv[i]);
        in[7] = with_master ? leaf_fill(t, OP_STATE, "w:master", ROLE_MASTER, FMT_F32, 1, dims, w) : NULL;
        Node *up = lion ? tg_node_v(t, OP_LION, ((Attrs){.f = {b1, b2, wd}}), 7 + with_master, in)
                        : tg_node_v(t, OP_SGD, ((Attrs){.i = {0, nesterov}, .f = {b1, wd}}), 7 + with_master, in);
        assert_int_equal(ir_update_states(up), 1);
        assert_int_equal(ir_update_lr_index(up), 3);
        assert_int_equal(ir_adamw_master_index(up), with_master ? 7 : -1);
        assert_int_equal(ir_adamw_copy_index(up), -1);
        for (int i = 0; i < up->n_in; i++) assert_int_equal(ir_mutates_input(up, i), i <= 2 || i == 7);
        ref_exec_node(up);
        float *pr = ref_load(&param->t);
        const float *pw = with_master ? in[7]->t.data : NULL, *mr = in[2]->t.data;
        int moved = 0;
        for (int i = 0; i < N; i++) {
            double gg = (double)g[i] * gs * clip, mm, ww = w[i];
            if (lion) {
                double d = b1 * m[i] + (1 - b1) * gg;
                ww -= lr * ((d > 0) - (d < 0) + wd * w[i]);
                mm = b2 * m[i] + (1 - b2) * gg;
            } else {
                gg += wd * w[i];
                mm = b1 * m[i] + gg;
                ww -= lr * (nesterov ? gg + b1 * mm : mm);
            }
            assert_float_equal(mr[i], mm, 1e-6 * fabs(mm) + 1e-9);
            assert_true(((float *)in[1]->t.data)[i] == 0.0f);
            if (with_master) {
                assert_float_equal(pw[i], ww, 1e-6 * fabs(ww) + 1e-7);
                assert_true(pr[i] == num_round(FMT_BF16, pw[i]));
            } else {
                assert_float_equal(pr[i], ww, 1e-6 * fabs(ww) + 1e-7);
            }
            moved += fabs(ww - w[i]) > 0.01 * lr;
        }
        assert_true(moved > N / 2);   /* the formulas moved the weights: a real step was checked */
        free(pr);
        tg_free(t);
    }
}

/* AdamW that writes the weight's FP8 copy for the next step (scaling.c): the update phase first
 * turns the amax of the weights the step read into the copy's scale (448 / amax), then AdamW
 * stores the new bf16 weights, their e4m3 copy through that scale, and their amax. The first
 * copy, before any step, is current scaling of the initial weights. */
static void test_adamw_fp8_copy(void **state)
{
    (void)state;
    enum { N = 301 };
    const int64_t dims[1] = {N};
    float w[N], g[N], zero[N] = {0};
    for (int i = 0; i < N; i++) w[i] = 0.05f * rng_normal(), g[i] = rng_normal();
    float lr = 1e-3f, step = 1, clip = 1, gs = 1, amax_read = 0.2f + 0.1f * (float)rng_uniform(), one = 1;
    TG *t = tg_new();
    t->phase = PHASE_UPDATE;
    Node *param = leaf_fill(t, OP_PARAM, "w", ROLE_PARAM, FMT_BF16, 1, dims, w);
    Node *scale = leaf_fill(t, OP_STATE, "w:e4m3.scale", ROLE_SCALE, FMT_F32, 0, NULL, &one);
    Node *amax = leaf_fill(t, OP_STATE, "w:e4m3.amax", ROLE_AMAX_HISTORY, FMT_F32, 0, NULL, &amax_read);
    Node *copy = ir_leaf(t->g, OP_STATE, "w:e4m3", ROLE_WEIGHT_COPY, FMT_E4M3, 1, dims, here);
    copy->t.fmt = (Format){.elem = FMT_E4M3, .scaling = SCALE_PER_TENSOR, .recipe = RECIPE_DELAYED, .history = 1,
                           .scale = scale};
    tg_bind(t, copy);
    Node *ds = NODE(t, OP_DELAYED_SCALE, IA(FMT_E4M3, 0, 0), scale, amax);
    ds->t.data = scale->t.data;   /* in place, as the memory plan has it */
    Node *in[12];
    adamw_operands(t, param, dims, g, zero, zero, (float[4]){lr, step, clip, gs}, in);
    in[8] = leaf_fill(t, OP_STATE, "w:master", ROLE_MASTER, FMT_F32, 1, dims, w);
    in[9] = copy, in[10] = ds, in[11] = amax;
    Node *up = tg_node_v(t, OP_ADAMW, ((Attrs){.i = {1}, .f = {0.9, 0.95, 1e-8, 0}}), 12, in);
    assert_int_equal(ir_adamw_master_index(up), 8);
    assert_int_equal(ir_adamw_copy_index(up), 9);
    for (int i = 0; i < 12; i++)
        assert_int_equal(ir_mutates_input(up, i), i <= 3 || i == 8 || i == 9 || i == 11);

    for (int first = 0; first < 2; first++) {
        if (first) {
            ref_adamw_first_copy(up);   /* from the weights as they are now */
        } else {
            ref_exec_node(ds);
            ref_exec_node(up);
        }
        float *nw = ref_load(&param->t), *q = ref_load(&copy->t), *sv = ref_load(&scale->t), *am = ref_load(&amax->t);
        float biggest = 0;
        for (int i = 0; i < N; i++) biggest = fmaxf(biggest, fabsf(nw[i]));
        /* the step: the scale from the amax read before it; the first copy: from these weights */
        float want_scale = (float)(448.0 / (first ? biggest : amax_read));
        assert_float_equal(sv[0], want_scale, 1e-6 * want_scale);
        assert_true(am[0] == biggest);
        int moved = 0;
        for (int i = 0; i < N; i++) {
            if (!first) moved += fabsf(nw[i] - w[i]) > 0.5e-3f;   /* lr-sized Adam steps */
            double want = num_round(FMT_E4M3, nw[i] * sv[0]) / sv[0];
            assert_float_equal(q[i], want, 1e-6 * fabs(want));
        }
        if (!first) assert_true(moved > N / 2);
        if (first)   /* current scaling: the largest weight takes e4m3's largest value */
            for (int i = 0; i < N; i++)
                if (fabsf(nw[i]) == biggest) assert_float_equal(fabsf(q[i]) * sv[0], 448.0, 448.0 * 1e-6);
        free(nw), free(q), free(sv), free(am);
    }
    tg_free(t);
}

/* ACCUMULATE adds into its accumulator through the accumulator's format (a bf16 accumulator
 * holds round(acc + g)); ASSIGN stores a value into a state through the state's format. */
static void test_inplace_ops(void **state)
{
    (void)state;
    enum { N = 300 };
    const int64_t dims[2] = {20, 15};
    float acc0[N], g[N], v[N];
    for (int i = 0; i < N; i++) acc0[i] = rng_normal(), g[i] = 1e-2f * rng_normal(), v[i] = rng_normal();
    TG *t = tg_new();
    Node *acc = leaf_fill(t, OP_STATE, "w:grad", ROLE_GRAD, FMT_BF16, 2, dims, acc0);
    Node *gn = leaf_fill(t, OP_INPUT, "g", ROLE_INPUT, FMT_F32, 2, dims, g);
    Node *st = leaf_fill(t, OP_STATE, "s", ROLE_SCALE, FMT_BF16, 2, dims, acc0);
    Node *vn = leaf_fill(t, OP_INPUT, "v", ROLE_INPUT, FMT_F32, 2, dims, v);
    float *before = ref_load(&acc->t);
    Node *a = ir_add2(t->g, OP_ACCUMULATE, acc, gn, here);
    assert_null(ir_infer_shape(a, t->arena));
    a->t.data = acc->t.data;   /* the result aliases the accumulator, as the memory plan has it */
    Node *as = ir_add2(t->g, OP_ASSIGN, st, vn, here);
    assert_null(ir_infer_shape(as, t->arena));
    as->t.data = st->t.data;
    ref_run_phase(t->g, PHASE_FORWARD);
    float *after = ref_load(&acc->t), *sv = ref_load(&st->t);
    for (int i = 0; i < N; i++) {
        assert_true(after[i] == num_round(FMT_BF16, before[i] + g[i]));
        assert_true(sv[i] == num_round(FMT_BF16, v[i]));
    }
    free(before);
    free(after);
    free(sv);
    tg_free(t);
}

/* ---------------------------------------------------------------- threads */

static void *snapshot(const Node *n)
{
    size_t bytes = (size_t)ir_numel(&n->t) * (size_t)fmt_elem_bytes(n->t.fmt.elem);
    void *p = malloc(bytes);
    memcpy(p, n->t.data, bytes);
    return p;
}

static void test_threads_bit_identical(void **state)
{
    (void)state;
    TG *t = tg_new();
    const int64_t ad[2] = {131, 75}, bd[2] = {75, 203}, bt[2] = {203, 75};
    const int64_t qd[3] = {3, 45, 4 * 16}, kd[3] = {3, 45, 2 * 16};
    Node *a = tg_input(t, "a", 1, 2, ad), *b = tg_input(t, "b", 1, 2, bd), *bT = tg_input(t, "bT", 1, 2, bt);
    Node *outs[8];
    int n_out = 0;
    outs[n_out++] = NODE(t, OP_MATMUL, IA(0, 0), a, b);
    outs[n_out++] = NODE(t, OP_MATMUL, IA(0, 1), a, bT);
    outs[n_out++] = NODE(t, OP_MATMUL, IA(1, 0), outs[1], outs[0]);
    outs[n_out++] = NODE(t, OP_MATMUL, IA(1, 1), bT, outs[0]);
    Node *q = tg_input(t, "q", 1, 3, qd), *k = tg_input(t, "k", 1, 3, kd), *v = tg_input(t, "v", 1, 3, kd);
    Attrs at = {.i = {4, 2}, .f = {0.25}};
    Node *y = outs[n_out++] = NODE(t, OP_ATTENTION, at, q, k, v);
    outs[n_out++] = NODE(t, OP_ATTENTION_BWD, at, y, q, k, v);
    outs[n_out++] = NODE(t, OP_SQNORM, NOATTR, outs[0]);
    outs[n_out++] = NODE(t, OP_LAYERNORM_BWD_W, FA(1e-5), outs[0], outs[0]);

    int saved = ref_threads();
    void *first[8];
    const int counts[] = {1, 2, 3};
    for (int c = 0; c < 3; c++) {
        ref_set_threads(counts[c]);
        for (int i = 0; i < n_out; i++) memset(outs[i]->t.data, 0, sizeof(float) * (size_t)ir_numel(&outs[i]->t));
        ref_run_phase(t->g, PHASE_FORWARD);
        for (int i = 0; i < n_out; i++) {
            if (c == 0) {
                first[i] = snapshot(outs[i]);
                continue;
            }
            size_t bytes = sizeof(float) * (size_t)ir_numel(&outs[i]->t);
            if (memcmp(first[i], outs[i]->t.data, bytes) != 0)
                fail_msg("%s differs between 1 and %d threads", ir_op_info(outs[i]->op)->text, counts[c]);
        }
    }
    for (int i = 0; i < n_out; i++) free(first[i]);
    ref_set_threads(saved);
    tg_free(t);
}

/* The packed GEMM against a plain triple loop in f64, on sizes around the register tiles. */
static void gemm_check_sizes(void)
{
    /* M, N, K: below, at and across the 6 x 8 and 12 x 8 register tiles and the 512-long K
     * blocks; 300 x 300 x 40 makes the packed B large enough for the column-panel-outer order */
    const int64_t sizes[][3] = {{1, 1, 1}, {6, 8, 3}, {13, 17, 29}, {64, 33, 200}, {5, 300, 2},
                                {7, 9, 512}, {25, 10, 1100}, {30, 300, 300}};
    for (int s = 0; s < 8; s++) {
        int64_t M = sizes[s][0], N = sizes[s][1], K = sizes[s][2];
        float *A = malloc(sizeof(float) * (size_t)(M * K)), *B = malloc(sizeof(float) * (size_t)(K * N));
        float *C = malloc(sizeof(float) * (size_t)(M * N));
        for (int64_t i = 0; i < M * K; i++) A[i] = rng_normal();
        for (int64_t i = 0; i < K * N; i++) B[i] = rng_normal();
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                /* the same buffers read as (M,K)/(K,M) and (K,N)/(N,K) */
                TG *t = tg_new();
                int64_t adims[2] = {ta ? K : M, ta ? M : K}, bdims[2] = {tb ? N : K, tb ? K : N};
                Node *a = ir_leaf(t->g, OP_INPUT, "a", ROLE_INPUT, FMT_F32, 2, adims, here);
                Node *b = ir_leaf(t->g, OP_INPUT, "b", ROLE_INPUT, FMT_F32, 2, bdims, here);
                a->t.data = A, b->t.data = B;
                Node *c = NODE(t, OP_MATMUL, IA(ta, tb), a, b);
                ref_exec_node(c);
                memcpy(C, c->t.data, sizeof(float) * (size_t)(M * N));
                for (int64_t i = 0; i < M; i++)
                    for (int64_t j = 0; j < N; j++) {
                        double acc = 0;
                        for (int64_t kk = 0; kk < K; kk++)
                            acc += (double)(ta ? A[kk * M + i] : A[i * K + kk]) *
                                   (double)(tb ? B[j * K + kk] : B[kk * N + j]);
                        /* both sum exact products in f64 in k order: equal after rounding */
                        if (C[i * N + j] != (float)acc)
                            fail_msg("gemm %lldx%lldx%lld ta=%d tb=%d: C[%lld,%lld] = %.9g, expected %.9g",
                                     (long long)M, (long long)N, (long long)K, ta, tb, (long long)i,
                                     (long long)j, C[i * N + j], (float)acc);
                    }
                tg_free(t);
            }
        free(A);
        free(B);
        free(C);
    }
}

/* ... with each register tile this machine has (12 x 8 needs AVX-512, 6 x 8 runs anywhere) */
static void test_gemm_accuracy(void **state)
{
    (void)state;
    gemm_check_sizes();
    ref_gemm_set_tile_rows(6);
    gemm_check_sizes();
    ref_gemm_set_tile_rows(0);
}

/* ---------------------------------------------------------------- formats */

/* A result stored as bf16 (or e4m3) holds exactly the f32 result rounded to it. */
static void test_rounded_outputs(void **state)
{
    (void)state;
    const ElemType elems[] = {FMT_BF16, FMT_F16, FMT_E4M3, FMT_E5M2};
    for (int e = 0; e < 4; e++) {
        TG *t = tg_new();
        const int64_t ad[2] = {9, 20}, bd[2] = {20, 13}, c[1] = {13};
        Node *a = tg_input(t, "a", 1, 2, ad), *b = tg_input(t, "b", 1, 2, bd);
        Node *w = tg_input(t, "w", 1, 1, c), *bias = tg_input(t, "bias", 1, 1, c);
        Node *outs[3], *rounded[3];
        outs[0] = NODE(t, OP_MATMUL, NOATTR, a, b);
        outs[1] = NODE(t, OP_GELU, NOATTR, outs[0]);
        outs[2] = NODE(t, OP_LAYERNORM, FA(1e-5), outs[0], w, bias);
        for (int i = 0; i < 3; i++) {
            Node *r = ir_add(t->g, outs[i]->op, outs[i]->n_in, outs[i]->in, here);
            memcpy(r->iattr, outs[i]->iattr, sizeof r->iattr);
            memcpy(r->fattr, outs[i]->fattr, sizeof r->fattr);
            assert_null(ir_infer_shape(r, t->arena));
            r->t.fmt = fmt_plain(elems[e]);
            tg_bind(t, r);
            rounded[i] = r;
        }
        ref_run_phase(t->g, PHASE_FORWARD);
        for (int i = 0; i < 3; i++) {
            float *got = ref_load(&rounded[i]->t);
            const float *exact = outs[i]->t.data;
            for (int64_t k = 0; k < ir_numel(&outs[i]->t); k++)
                if (got[k] != num_round(elems[e], exact[k]))
                    fail_msg("%s as %s: element %lld is %.9g, round(%.9g) = %.9g",
                             ir_op_info(outs[i]->op)->text, fmt_elem_name(elems[e]), (long long)k,
                             got[k], exact[k], num_round(elems[e], exact[k]));
            free(got);
        }
        tg_free(t);
    }
}

/* Scaled formats: a store then a load gives round(x * s) / s with the right scale per element. */
static void test_scaled_roundtrip(void **state)
{
    (void)state;
    const Scaling kinds[] = {SCALE_PER_TENSOR, SCALE_PER_ROW, SCALE_PER_GROUP, SCALE_TILE_1x128,
                             SCALE_BLOCK_128};
    const int64_t dims[3] = {2, 150, 300};
    for (int kidx = 0; kidx < 5; kidx++) {
        TG *t = tg_new();
        Scaling kind = kinds[kidx];
        int64_t rows = 300, cols = 300, group = 16;
        int64_t sd[2];
        int sr;
        switch (kind) {
        case SCALE_PER_TENSOR: sr = 0; break;
        case SCALE_PER_ROW: sr = 1, sd[0] = rows; break;
        case SCALE_PER_GROUP: sr = 2, sd[0] = rows, sd[1] = (cols + group - 1) / group; break;
        case SCALE_TILE_1x128: sr = 2, sd[0] = rows, sd[1] = 3; break;
        default: sr = 2, sd[0] = 3, sd[1] = 3; break;
        }
        Node *sc = ir_leaf(t->g, OP_STATE, "scale", ROLE_SCALE, FMT_F32, sr, sd, here);
        tg_bind(t, sc);
        float *s = sc->t.data;
        for (int64_t i = 0; i < ir_numel(&sc->t); i++) s[i] = ldexpf(1.0f, (int)rng_int(-3, 8)) * (float)(0.5 + rng_uniform());
        Node *x = tg_input(t, "x", 1, 3, dims);
        Node *q = ir_leaf(t->g, OP_STATE, "q", ROLE_SAVED, FMT_E4M3, 3, dims, here);
        q->t.fmt.scaling = kind;
        q->t.fmt.group = (int)group;
        q->t.fmt.scale = sc;
        tg_bind(t, q);
        ref_store(&q->t, x->t.data);
        float *back = ref_load(&q->t);
        const float *xv = x->t.data;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) {
                int64_t k;
                switch (kind) {
                case SCALE_PER_TENSOR: k = 0; break;
                case SCALE_PER_ROW: k = r; break;
                case SCALE_PER_GROUP: k = r * sd[1] + c / group; break;
                case SCALE_TILE_1x128: k = r * 3 + c / 128; break;
                default: k = (r / 128) * 3 + c / 128; break;
                }
                float want = num_round(FMT_E4M3, xv[r * cols + c] * s[k]) / s[k];
                if (back[r * cols + c] != want)
                    fail_msg("%s: (%lld, %lld) reads %.9g, expected %.9g", fmt_scaling_name(kind),
                             (long long)r, (long long)c, back[r * cols + c], want);
            }
        free(back);
        tg_free(t);
    }
}

/* The executor's bf16 loops against the numerics library: every bf16 value decoded, and
 * edge values plus 2^22 random f32 bit patterns encoded. (All 2^32 agree; that sweep takes a
 * minute, too long for every run.) */
static void test_bf16_fast_path(void **state)
{
    (void)state;
    enum { N = 1 << 22 };
    uint16_t *h = malloc(sizeof(uint16_t) * N);
    float *f = malloc(sizeof(float) * N);
    for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    ref_bf16_decode(h, f, 65536);
    for (uint32_t i = 0; i < 65536; i++) {
        float want = num_bf16_to_f32((uint16_t)i);
        assert_memory_equal(&f[i], &want, sizeof want);
    }
    const uint32_t edges[] = {0, 0x80000000u, 1, 0x807FFFFFu, 0x7F7FFFFFu, 0x7F7F8000u, 0x7F7F7FFFu,
                              0x7F800000u, 0xFF800000u, 0x7F800001u, 0xFFC00000u, 0x3F808000u,
                              0x3F818000u, 0x3F80FFFFu, 0x00008000u, 0x00018000u};
    int ne = (int)(sizeof edges / sizeof edges[0]);
    for (int i = 0; i < N; i++) {
        uint32_t u = i < ne ? edges[i] : (uint32_t)rng_next();
        memcpy(&f[i], &u, sizeof u);
    }
    ref_bf16_encode(f, h, N);
    for (int i = 0; i < N; i++)
        if (h[i] != num_f32_to_bf16(f[i])) {
            uint32_t u;
            memcpy(&u, &f[i], sizeof u);
            fail_msg("bf16 of %08x: %04x, numerics says %04x", u, h[i], num_f32_to_bf16(f[i]));
        }
    free(h);
    free(f);
}

/* ---------------------------------------------------------------- quantization ops */

static void test_quant_ops(void **state)
{
    (void)state;
    TG *t = tg_new();
    const int64_t xd[2] = {5, 40}, hd[1] = {4};
    Node *x = tg_input(t, "x", 3, 2, xd);
    float *xv = x->t.data;
    for (int c = 0; c < 40; c++) xv[2 * 40 + c] = 0;   /* a zero row: scale 1 */
    Node *rowscale = NODE(t, OP_QUANT_SCALE, IA(FMT_E4M3, SCALE_PER_ROW, 0, 1), x);
    Node *grpscale = NODE(t, OP_QUANT_SCALE, IA(FMT_E5M2, SCALE_PER_GROUP, 16, 0), x);
    Node *qx = ir_add2(t->g, OP_QUANTIZE, x, rowscale, here);
    assert_null(ir_infer_shape(qx, t->arena));
    qx->t.fmt.elem = FMT_E4M3, qx->t.fmt.scaling = SCALE_PER_ROW, qx->t.fmt.scale = rowscale;
    tg_bind(t, qx);
    float h0[4] = {1, 2, 3, 4};
    Node *hist = leaf_fill(t, OP_STATE, "hist", ROLE_AMAX_HISTORY, FMT_F32, 1, hd, h0);
    Node *rec = NODE(t, OP_AMAX_RECORD, NOATTR, hist, x);
    float one = 1.0f;
    Node *sc = leaf_fill(t, OP_STATE, "scale", ROLE_SCALE, FMT_F32, 0, NULL, &one);
    Node *ds = NODE(t, OP_DELAYED_SCALE, IA(FMT_E4M3, 2, 1), sc, rec);
    (void)ds;
    ref_run_phase(t->g, PHASE_FORWARD);

    double all = 0;
    for (int r = 0; r < 5; r++) {
        double amax = 0;
        for (int c = 0; c < 40; c++) amax = fmax(amax, fabs(xv[r * 40 + c]));
        all = fmax(all, amax);
        float want = amax > 0 ? (float)(448.0 / amax / 2.0) : 1.0f;
        assert_true(((float *)rowscale->t.data)[r] == want);
        for (int g = 0; g < 3; g++) {
            double ga = 0;
            for (int c = g * 16; c < 40 && c < g * 16 + 16; c++) ga = fmax(ga, fabs(xv[r * 40 + c]));
            float gw = ga > 0 ? (float)(57344.0 / ga) : 1.0f;
            assert_true(((float *)grpscale->t.data)[r * 3 + g] == gw);
        }
        for (int c = 0; c < 40; c++) {
            float q = num_e4m3_to_f32(((uint8_t *)qx->t.data)[r * 40 + c]);
            assert_true(q == num_round(FMT_E4M3, xv[r * 40 + c] * want));
        }
    }
    const float *hv = hist->t.data;
    assert_true(hv[0] == (float)all && hv[1] == 1 && hv[2] == 2 && hv[3] == 3);
    double hmax = fmax(all, 3.0);
    assert_true(*(float *)sc->t.data == (float)(448.0 / hmax / 4.0));
    tg_free(t);
}

/* ---------------------------------------------------------------- init */

static void test_init_params(void **state)
{
    (void)state;
    uint64_t seed = rng_next();
    int saved_threads = ref_threads();
    const int64_t big[2] = {300, 200}, small[1] = {64};
    float *ref = NULL;
    for (int order = 0; order < 2; order++) {
        TG *t = tg_new();
        Node *ones = NULL, *w = NULL, *master = NULL, *grad = NULL, *scale = NULL;
        for (int k = 0; k < 2; k++) {
            if ((k == 0) == (order == 0)) {
                w = ir_leaf(t->g, OP_PARAM, "h.0.mlp.c_fc.weight", ROLE_PARAM, FMT_BF16, 2, big, here);
                IR_FATTR(w, PARAM, std) = 0.02;
                tg_bind(t, w);
            } else {
                ones = ir_leaf(t->g, OP_PARAM, "ln_f.weight", ROLE_PARAM, FMT_F32, 1, small, here);
                IR_IATTR(ones, PARAM, init) = 2;
                tg_bind(t, ones);
            }
        }
        master = ir_leaf(t->g, OP_STATE, "h.0.mlp.c_fc.weight:master", ROLE_MASTER, FMT_F32, 2, big, here);
        master->grad_of = w;
        grad = ir_leaf(t->g, OP_STATE, "h.0.mlp.c_fc.weight:grad", ROLE_GRAD, FMT_F32, 2, big, here);
        scale = ir_leaf(t->g, OP_STATE, "s", ROLE_SCALE, FMT_F32, 0, NULL, here);
        tg_bind(t, master), tg_bind(t, grad), tg_bind(t, scale);
        float *gv = grad->t.data;
        for (int64_t i = 0; i < ir_numel(&grad->t); i++) gv[i] = 1;
        ref_set_threads(order + 1);
        rt_init_params(t->g, seed);

        const float *mv = master->t.data;
        float *wv = ref_load(&w->t);
        double s1 = 0, s2 = 0;
        int64_t n = ir_numel(&w->t);
        for (int64_t i = 0; i < n; i++) {
            assert_true(wv[i] == num_round(FMT_BF16, mv[i]));
            assert_true(gv[i] == 0);
            s1 += mv[i], s2 += (double)mv[i] * mv[i];
        }
        double mean = s1 / n, sd = sqrt(s2 / n - mean * mean);
        /* 60000 samples: the mean is within 5 standard errors, the deviation within 3% */
        assert_true(fabs(mean) < 5 * 0.02 / sqrt((double)n));
        assert_true(fabs(sd - 0.02) < 0.02 * 0.03);
        for (int i = 0; i < 64; i++) assert_true(((float *)ones->t.data)[i] == 1.0f);
        assert_true(*(float *)scale->t.data == 1.0f);
        if (order == 0) {
            ref = malloc(sizeof(float) * (size_t)n);
            memcpy(ref, mv, sizeof(float) * (size_t)n);
        } else {
            /* node order and thread count changed; the values did not */
            assert_memory_equal(ref, mv, sizeof(float) * (size_t)n);
        }
        free(wv);
        tg_free(t);
    }
    free(ref);
    ref_set_threads(saved_threads);
}

/* ---------------------------------------------------------------- loud failures */

/* Runs fn in a child process; it must exit with a failure status, not succeed or crash. */
static void expect_die(void (*fn)(void), const char *what)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (!freopen("/dev/null", "w", stderr)) _exit(0);
        fn();
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) != 0) && !(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT))
        fail_msg("%s: did not stop with an error (status %d)", what, st);
}

static void die_unbound(void)
{
    TG *t = tg_new();
    const int64_t d[1] = {4};
    Node *a = ir_leaf(t->g, OP_INPUT, "a", ROLE_INPUT, FMT_F32, 1, d, here);
    Node *y = ir_add1(t->g, OP_GELU, a, here);
    ir_infer_shape(y, t->arena);
    tg_bind(t, y);
    ref_exec_node(y);
}

static void die_codec(void)
{
    TG *t = tg_new();
    const int64_t d[1] = {4};
    Node *a = tg_input(t, "a", 1, 1, d);
    a->t.fmt.codec = CODEC_SPLIT;   /* a split master is read only next to its parameter */
    float *x = ref_load(&a->t);
    free(x);
}

static void die_bad_id(void)
{
    TG *t = tg_new();
    const int64_t td[2] = {3, 2}, id[1] = {4};
    Node *table = tg_input(t, "table", 1, 2, td);
    Node *ids = tg_ids(t, "ids", 3, 0, 1, id);
    ((int32_t *)ids->t.data)[2] = 3;
    ref_exec_node(NODE(t, OP_EMBEDDING, NOATTR, table, ids));
}

/* The pool runs every task of an op exactly once, and all of them before ref_parallel_for
 * returns: ops of many sizes back to back (fewer tasks than threads, more, many more), with
 * tasks of uneven length so that threads take from each other's ranges, at thread counts up
 * to more than this machine has cores (where some are off the CPU mid-op). A task nested in a
 * task runs serially, on the calling thread. */
typedef struct {
    int64_t n;
    _Atomic int *runs;          /* per task: times it ran in this op */
    const int *spin;            /* per task: how long it works */
    _Atomic int nested_runs;
} PoolOp;

static void pool_nested_task(void *ctx, int64_t i)
{
    (void)i;
    atomic_fetch_add(&((PoolOp *)ctx)->nested_runs, 1);
}

static void pool_task(void *ctx, int64_t i)
{
    PoolOp *op = ctx;
    assert_true(i >= 0 && i < op->n);
    volatile float x = 1;
    for (int k = 0; k < op->spin[i]; k++) x = x * 1.0000001f;
    if (i == op->n - 1) ref_parallel_for(3, pool_nested_task, op);
    atomic_fetch_add(&op->runs[i], 1);
}

static void test_pool_runs_each_task_once(void **state)
{
    (void)state;
    int saved = ref_threads();
    enum { MOST = 4000 };
    _Atomic int *runs = calloc(MOST, sizeof *runs);
    int *spin = malloc(MOST * sizeof *spin);
    assert_non_null(runs);
    assert_non_null(spin);
    const int threads[] = {2, 3, 8, 17};
    const int64_t sizes[] = {2, 3, 5, 16, 17, 64, 100, 1000, MOST};
    for (int t = 0; t < 4; t++) {
        ref_set_threads(threads[t]);
        for (int rep = 0; rep < 40; rep++)
            for (int s = 0; s < 9; s++) {
                PoolOp op = {.n = sizes[s], .runs = runs, .spin = spin};
                atomic_init(&op.nested_runs, 0);
                for (int64_t i = 0; i < op.n; i++) {
                    atomic_store(&runs[i], 0);
                    spin[i] = rng_uniform() < 0.1 ? (int)rng_int(0, 20000) : (int)rng_int(0, 50);
                }
                ref_parallel_for(op.n, pool_task, &op);
                for (int64_t i = 0; i < op.n; i++)
                    if (atomic_load(&runs[i]) != 1)
                        fail_msg("%d threads, op of %lld tasks: task %lld ran %d times", threads[t],
                                 (long long)op.n, (long long)i, atomic_load(&runs[i]));
                assert_int_equal(atomic_load(&op.nested_runs), 3);
            }
    }
    free(runs);
    free(spin);
    ref_set_threads(saved);
}

static void test_loud_failures(void **state)
{
    (void)state;
    expect_die(die_unbound, "reading an unbound tensor");
    expect_die(die_codec, "reading a split master alone");
    expect_die(die_bad_id, "a token id outside the table");
}

/* ---------------------------------------------------------------- timings (FP8C_BENCH=1) */

static double clock_s(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* best wall time of `reps` runs, and the process CPU time of that run (on a shared machine
 * the wall time counts other people's work too; CPU time / threads shows what ours costs) */
static double time_graph(TG *t, int reps, double *cpu)
{
    ref_run_phase(t->g, PHASE_FORWARD);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double w0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
        ref_run_phase(t->g, PHASE_FORWARD);
        double w = clock_s(CLOCK_MONOTONIC) - w0;
        if (w < best) best = w, *cpu = clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
    }
    return best;
}

static void test_bench(void **state)
{
    (void)state;
    if (!getenv("FP8C_BENCH")) skip();
    const int64_t mm[][3] = {{64, 256, 768}, {4096, 128, 512}};   /* M x K x N */
    double cpu;
    for (int i = 0; i < 2; i++) {
        TG *t = tg_new();
        int64_t ad[2] = {mm[i][0], mm[i][1]}, bd[2] = {mm[i][2], mm[i][1]};
        Node *a = tg_input(t, "a", 1, 2, ad), *b = tg_input(t, "b", 1, 2, bd);
        NODE(t, OP_MATMUL, IA(0, 1), a, b);
        double s = time_graph(t, 5, &cpu);
        printf("    matmul %lldx%lldx%lld (MxKxN, trans_b): %.2f ms wall, %.2f ms CPU, %.1f GFLOP/s "
               "wall, %d threads\n", (long long)mm[i][0], (long long)mm[i][1], (long long)mm[i][2],
               s * 1e3, cpu * 1e3, 2.0 * (double)(mm[i][0] * mm[i][1] * mm[i][2]) / s * 1e-9,
               ref_threads());
        tg_free(t);
    }
    TG *t = tg_new();
    const int64_t qd[3] = {16, 256, 128};
    Node *q = tg_input(t, "q", 1, 3, qd), *k = tg_input(t, "k", 1, 3, qd), *v = tg_input(t, "v", 1, 3, qd);
    Attrs at = {.i = {4, 4}, .f = {1 / sqrt(32.0)}};
    Node *y = NODE(t, OP_ATTENTION, at, q, k, v);
    NODE(t, OP_ATTENTION_BWD, at, y, q, k, v);
    double s = time_graph(t, 3, &cpu);
    printf("    attention B=16 T=256 H=4 D=32 forward+backward: %.2f ms wall, %.2f ms CPU, %d threads\n",
           s * 1e3, cpu * 1e3, ref_threads());
    tg_free(t);
}

int main(void)
{
    const char *env = getenv("FP8C_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    rng_state = seed;
    printf("test_ops: seed %llu (FP8C_TEST_SEED=%llu repeats this run)\n", (unsigned long long)seed,
           (unsigned long long)seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_grad_matmul),
        cmocka_unit_test(test_grad_binary),
        cmocka_unit_test(test_grad_pointwise),
        cmocka_unit_test(test_grad_norms),
        cmocka_unit_test(test_grad_softmax),
        cmocka_unit_test(test_grad_embedding),
        cmocka_unit_test(test_grad_cross_entropy),
        cmocka_unit_test(test_grad_rope),
        cmocka_unit_test(test_grad_attention),
        cmocka_unit_test(test_grad_shape_ops),
        cmocka_unit_test(test_forward_values),
        cmocka_unit_test(test_adamw),
        cmocka_unit_test(test_adamw_fp8_copy),
        cmocka_unit_test(test_momentum_updates),
        cmocka_unit_test(test_inplace_ops),
        cmocka_unit_test(test_threads_bit_identical),
        cmocka_unit_test(test_gemm_accuracy),
        cmocka_unit_test(test_rounded_outputs),
        cmocka_unit_test(test_scaled_roundtrip),
        cmocka_unit_test(test_bf16_fast_path),
        cmocka_unit_test(test_quant_ops),
        cmocka_unit_test(test_init_params),
        cmocka_unit_test(test_pool_runs_each_task_once),
        cmocka_unit_test(test_loud_failures),
        cmocka_unit_test(test_bench),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
