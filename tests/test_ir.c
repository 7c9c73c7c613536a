/* test_ir.c — the IR core: shape rules, the textual IR round trip, reader errors, verifier. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ir.h"

static char *print_to_string(const Graph *g)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    ir_print(g, f);
    fclose(f);
    return buf;
}

static const SrcLoc here = {"test.model", 3, 7};

/* A small transformer-ish forward graph: embedding, layernorm, linear, attention, loss. */
static Graph *build_sample(Arena *a)
{
    Graph *g = ir_graph_new(a);
    g->model_name = "sample";
    g->batch = 2, g->seq = 5;
    int64_t bt[2] = {2, 5}, vd[2] = {11, 8}, c[1] = {8}, w3[2] = {24, 8};
    Node *tok = ir_leaf(g, OP_INPUT, "tokens", ROLE_INPUT, FMT_I32, 2, bt, here);
    Node *tgt = ir_leaf(g, OP_INPUT, "targets", ROLE_INPUT, FMT_I32, 2, bt, here);
    Node *wte = ir_leaf(g, OP_PARAM, "wte.weight", ROLE_PARAM, FMT_F32, 2, vd, here);
    IR_FATTR(wte, PARAM, std) = 0.02;
    IR_IATTR(wte, PARAM, decay) = 1;
    Node *lw = ir_leaf(g, OP_PARAM, "ln.weight", ROLE_PARAM, FMT_F32, 1, c, here);
    IR_IATTR(lw, PARAM, init) = 2;
    Node *lb = ir_leaf(g, OP_PARAM, "ln.bias", ROLE_PARAM, FMT_F32, 1, c, here);
    IR_IATTR(lb, PARAM, init) = 1;
    Node *wq = ir_leaf(g, OP_PARAM, "attn.weight", ROLE_PARAM, FMT_F32, 2, w3, here);
    Node *x = ir_add2(g, OP_EMBEDDING, wte, tok, here);
    Node *ln_in[3] = {x, lw, lb};
    Node *ln = ir_add(g, OP_LAYERNORM, 3, ln_in, here);
    IR_FATTR(ln, LAYERNORM, eps) = 1e-5;
    Node *qkv = ir_add2(g, OP_MATMUL, ln, wq, here);
    IR_IATTR(qkv, MATMUL, trans_b) = 1;
    Node *parts[3];
    for (int i = 0; i < 3; i++) {
        parts[i] = ir_add1(g, OP_SLICE, qkv, here);
        IR_IATTR(parts[i], SLICE, axis) = 2, IR_IATTR(parts[i], SLICE, start) = 8 * i, IR_IATTR(parts[i], SLICE, size) = 8;
    }
    Node *att = ir_add(g, OP_ATTENTION, 3, parts, here);
    IR_IATTR(att, ATTENTION, heads) = 2, IR_IATTR(att, ATTENTION, kv_heads) = 2, IR_FATTR(att, ATTENTION, scale) = 0.5;
    Node *logits = ir_add2(g, OP_MATMUL, att, wte, here);
    IR_IATTR(logits, MATMUL, trans_b) = 1;
    Node *loss = ir_add2(g, OP_CROSS_ENTROPY, logits, tgt, here);
    loss->t.name = "loss";
    loss->t.role = ROLE_OUTPUT;
    for (int i = 0; i < g->n_nodes; i++) {
        const char *err = ir_infer_shape(g->nodes[i], a);
        assert_null(err);
    }
    return g;
}

static void test_shapes(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = build_sample(a);
    Node *logits = g->nodes[g->n_nodes - 2];
    assert_int_equal(logits->t.rank, 3);
    assert_int_equal(logits->t.dims[0], 2);
    assert_int_equal(logits->t.dims[1], 5);
    assert_int_equal(logits->t.dims[2], 11);
    assert_int_equal(g->nodes[g->n_nodes - 1]->t.rank, 0);
    assert_int_equal(ir_verify(g, NULL), 0);
    arena_free(a);
}

static void test_shape_errors_name_dims(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = ir_graph_new(a);
    int64_t x3[3] = {8, 64, 768}, b1[1] = {512}, w[2] = {100, 700};
    Node *x = ir_leaf(g, OP_INPUT, "x", ROLE_INPUT, FMT_F32, 3, x3, here);
    Node *b = ir_leaf(g, OP_PARAM, "b", ROLE_PARAM, FMT_F32, 1, b1, here);
    Node *m = ir_leaf(g, OP_PARAM, "w", ROLE_PARAM, FMT_F32, 2, w, here);
    const char *err = ir_infer_shape(ir_add2(g, OP_ADD, x, b, here), a);
    assert_non_null(err);
    assert_non_null(strstr(err, "768"));
    assert_non_null(strstr(err, "512"));
    Node *mm = ir_add2(g, OP_MATMUL, x, m, here);
    IR_IATTR(mm, MATMUL, trans_b) = 1;
    err = ir_infer_shape(mm, a);
    assert_non_null(err);
    assert_non_null(strstr(err, "inner dims 768 and 700"));
    Node *at_in[3] = {x, x, x};
    Node *at = ir_add(g, OP_ATTENTION, 3, at_in, here);
    IR_IATTR(at, ATTENTION, heads) = 7, IR_IATTR(at, ATTENTION, kv_heads) = 7;
    err = ir_infer_shape(at, a);
    assert_non_null(err);
    assert_non_null(strstr(err, "does not divide"));
    arena_free(a);
}

static void test_roundtrip(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = build_sample(a);
    g->optim = (OptimSpec){.present = true, .lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .clip = 1.0};
    /* a scaled format with a forward reference, and a memory plan entry */
    Node *sc = g->nodes[5];
    sc->t.fmt.elem = FMT_E4M3;
    sc->t.fmt.scaling = SCALE_PER_GROUP;
    sc->t.fmt.group = 16;
    sc->t.fmt.recipe = RECIPE_DELAYED;
    sc->t.fmt.history = 16;
    sc->t.fmt.history_max = true;
    sc->t.fmt.scale = g->nodes[g->n_nodes - 1];
    sc->t.offset = 4096;
    sc->t.bytes = 192;
    g->nodes[3]->grad_of = g->nodes[2];
    ir_set_choice(g, "loss.chunks", "4");
    ir_set_choice(g, "fuse.bias_grads@7", "0");
    ir_set_choice(g, "loss.chunks", "8");   /* replaces, does not add */
    char *first = print_to_string(g);
    Arena *b = arena_new();
    Graph *h = ir_read(b, "roundtrip.ir", first);
    assert_non_null(h);
    char *second = print_to_string(h);
    assert_string_equal(first, second);
    assert_int_equal(h->n_nodes, g->n_nodes);
    assert_true(h->optim.present);
    assert_true(h->optim.lr == 6e-4);
    assert_ptr_equal(h->nodes[5]->t.fmt.scale, h->nodes[h->n_nodes - 1]);
    assert_int_equal(h->n_choices, 2);
    assert_string_equal(ir_choice(h, "loss.chunks"), "8");
    assert_int_equal(ir_choice_int(h, "loss.chunks", 0), 8);
    assert_int_equal(ir_choice_int(h, "cpu.threads", 3), 3);
    assert_null(ir_choice(h, "loss"));
    free(first);
    free(second);
    arena_free(a);
    arena_free(b);
}

/* Each malformed line must be reported at its line and column. */
static void test_reader_errors(void **state)
{
    (void)state;
    static const struct { const char *text; const char *expect; } cases[] = {
        {"%0 = nosuchop() : f32[2] role=input phase=forward\n", "bad.ir:1:6: error: unknown op"},
        {"%0 = add(%5, %6) : f32[2] role=activation phase=forward\n", "bad.ir:1:10: error: this operand is not defined"},
        {"%0 = input() : f33[2] role=input phase=forward\n", "bad.ir:1:16: error: unknown element type"},
        {"%0 = input() : f32[2 role=input\n", "bad.ir:1:22: error: expected ','"},
        {"# ok\n%0 = input() : f32[2] role=nobody\n", "bad.ir:2:28: error: unknown role"},
        {"%0 = input() : f32[0] role=input phase=forward\n", "bad.ir:1:21: error: dims must be positive"},
        {"%0 = input() : f32[2] fmt{scale=%9} role=input phase=forward\n", "bad.ir:1:33: error: no node %9"},
        {"%0 = input() : f32[2] role=input phase=forward\n%0 = input() : f32[2] role=input\n", "bad.ir:2:5: error: this node number is defined twice"},
        {"%0 = gelu() : f32[2] role=input\n", "bad.ir:1:6: error: gelu takes 1 operands, not 0"},
        {"hello\n", "bad.ir:1:1: error: expected a node"},
        {"%99999999999 = input() : f32[2] role=input phase=forward\n", "bad.ir:1:2: error: node numbers run from 0 to 2147483646"},
        {"%-1 = input() : f32[2] role=input phase=forward\n", "bad.ir:1:2: error: node numbers run from 0"},
        {"%0 = input() : f32[2] role=input phase=forward\n%1 = gelu(%4294967296) : f32[2] role=activation phase=forward\n",
         "bad.ir:2:12: error: node numbers run from 0"},
        {"%0 = input() : f32[2] fmt{scale=%4294967296} role=input phase=forward\n", "bad.ir:1:34: error: node numbers run from 0"},
        {"%0 = input() : f32[99999999999,99999999999] role=input phase=forward\n", "bad.ir:1:16: error: f32[99999999999,99999999999] has more than 2^40 elements"},
        {"choice loss.chunks 4\nchoice loss.chunks 2\n", "bad.ir:2:21: error: this choice is set twice"},
        {"choice loss.chunks\n", "bad.ir:1:19: error: expected a choice's name and value"},
        {"choice loss.chunks 4 x!\n", "bad.ir:1:22: error: unexpected text at the end of the line"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *buf = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&buf, &len);
        diag_set_stream(f);
        diag_reset();
        Arena *a = arena_new();
        Graph *g = ir_read(a, "bad.ir", cases[i].text);
        fclose(f);
        diag_set_stream(NULL);
        if (g != NULL || strstr(buf, cases[i].expect) == NULL || strchr(buf, '^') == NULL)
            fail_msg("case %zu: expected '%s', got:\n%s", i, cases[i].expect, buf);
        free(buf);
        arena_free(a);
    }
    diag_reset();
}

/* Node numbers are names, not sizes: a graph whose numbers are sparse and large reads like any
 * other (the reader keeps them in a map, not in a table as long as the largest). */
static void test_reader_large_ids(void **state)
{
    (void)state;
    const char *text = "%2000000000 = input() : f32[2] role=input phase=forward\n"
                       "%7 = gelu(%2000000000) : f32[2] role=activation phase=forward\n"
                       "%2147483646 = gelu(%7) : f32[2] role=activation phase=forward\n";
    Arena *a = arena_new();
    Graph *g = ir_read(a, "ids.ir", text);
    assert_non_null(g);
    assert_int_equal(g->n_nodes, 3);
    assert_ptr_equal(g->nodes[2]->in[0], g->nodes[1]);
    assert_ptr_equal(g->nodes[1]->in[0], g->nodes[0]);
    assert_int_equal(g->next_id, 2147483647);
    arena_free(a);
}

/* ir_verify's count of problems, with its report (on stderr) kept out of the test output */
static int verify_quietly(const Graph *g)
{
    FILE *devnull = fopen("/dev/null", "w");
    FILE *saved = stderr;
    stderr = devnull;
    int problems = ir_verify(g, "test");
    stderr = saved;
    fclose(devnull);
    return problems;
}

/* A fusion's switch: the site's own entry first, then the kind's, else on. */
static void test_choice_switches(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = build_sample(a);
    Node *site = g->nodes[4], *other = g->nodes[5];
    assert_true(ir_choice_on(g, "fuse.ce_lse", site));
    ir_set_choice(g, "fuse.ce_lse", "0");
    assert_false(ir_choice_on(g, "fuse.ce_lse", site));
    assert_false(ir_choice_on(g, "fuse.ce_lse", NULL));
    char name[64];
    snprintf(name, sizeof name, "fuse.ce_lse@%d", site->id);
    ir_set_choice(g, name, "1");
    assert_true(ir_choice_on(g, "fuse.ce_lse", site));
    assert_false(ir_choice_on(g, "fuse.ce_lse", other));
    assert_true(ir_choice_name_ok("gemm@12.0") && !ir_choice_name_ok("a b") && !ir_choice_name_ok(""));
    assert_true(ir_choice_value_ok("0a1f") && !ir_choice_value_ok("x=y"));
    char f1[17], f2[17];
    ir_fingerprint("NVIDIA H200; 132 SMs", f1);
    ir_fingerprint("NVIDIA H100; 132 SMs", f2);
    assert_int_equal(strlen(f1), 16);
    assert_string_not_equal(f1, f2);
    arena_free(a);
}

static void test_verify_catches_inplace_order(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = ir_graph_new(a);
    int64_t d[1] = {4};
    Node *acc = ir_leaf(g, OP_STATE, "w:grad", ROLE_GRAD, FMT_F32, 1, d, here);
    Node *gr = ir_leaf(g, OP_INPUT, "g", ROLE_INPUT, FMT_F32, 1, d, here);
    Node *accum = ir_add2(g, OP_ACCUMULATE, acc, gr, here);
    assert_null(ir_infer_shape(accum, a));
    /* a reader of the raw state after the in-place update is an error */
    Node *late = ir_add1(g, OP_SQNORM, acc, here);
    assert_null(ir_infer_shape(late, a));
    assert_int_equal(verify_quietly(g), 1);
    /* reading through the update's result is fine */
    late->in[0] = accum;
    assert_int_equal(ir_verify(g, "test"), 0);
    arena_free(a);
}

/* Persistent names are checkpoint keys: a repeated one is found among many, in time linear or
 * nearly so in their number (comparing every pair took minutes on a 256-layer model). */
static void test_verify_unique_names_at_scale(void **state)
{
    (void)state;
    enum { N = 40000 };
    Arena *a = arena_new();
    Graph *g = ir_graph_new(a);
    int64_t d[1] = {4};
    srand((unsigned)time(NULL));
    int twin = rand() % N;
    char name[32];
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "h.%d.weight", i);
        ir_leaf(g, OP_PARAM, arena_strdup(a, name), ROLE_PARAM, FMT_F32, 1, d, here);
    }
    clock_t t0 = clock();
    assert_int_equal(ir_verify(g, "test"), 0);
    double seconds = (double)(clock() - t0) / CLOCKS_PER_SEC;
    assert_true(seconds < 1.0);
    snprintf(name, sizeof name, "h.%d.weight", twin);
    ir_leaf(g, OP_STATE, arena_strdup(a, name), ROLE_ADAM_M, FMT_F32, 1, d, here);
    assert_int_equal(verify_quietly(g), 1);
    arena_free(a);
}

static void test_verify_catches_shape_change(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = build_sample(a);
    g->nodes[6]->t.dims[2] = 9;   /* a pass "changed" the embedding's width */
    assert_true(verify_quietly(g) > 0);
    arena_free(a);
}

static void test_uses_and_filter(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = build_sample(a);
    Uses *u = ir_fill_uses(g);
    Node *wte = ir_find(g, "wte.weight");
    assert_non_null(wte);
    assert_int_equal(u[wte->index].n, 2);   /* embedding and the tied head */
    bool *keep = calloc((size_t)g->n_nodes, 1);
    for (int i = 0; i < g->n_nodes; i++) keep[i] = g->nodes[i]->op != OP_INPUT || i == 0;
    keep[1] = true;
    ir_filter(g, keep);
    for (int i = 0; i < g->n_nodes; i++) assert_int_equal(g->nodes[i]->index, i);
    free(keep);
    arena_free(a);
}

static void test_tables(void **state)
{
    (void)state;
    OpKind op;
    for (int i = 0; i < OP_COUNT; i++) {
        assert_true(ir_op_from_name(ir_op_info((OpKind)i)->text, &op));
        assert_int_equal(op, i);
    }
    ElemType e;
    for (int i = 0; i < FMT_COUNT; i++) {
        assert_true(fmt_elem_from_name(fmt_elem_name((ElemType)i), &e));
        assert_int_equal(e, i);
    }
    assert_int_equal(fmt_elem_bytes(FMT_BF16), 2);
    assert_int_equal(fmt_elem_bytes(FMT_E4M3), 1);
    assert_true(ir_role_is_persistent(ROLE_ADAM_V));
    assert_false(ir_role_is_persistent(ROLE_SAVED));
    assert_int_equal(ir_op_info(OP_ADAMW)->n_fattr, 4);
    assert_string_equal(ir_op_info(OP_MATMUL)->iattr_names[1], "trans_b");
}

/* ops.def's CLASS column: every op has a class, the ops that run no kernel have no operands or
 * are the collective, and an op that updates an operand in place is no head and, but for the
 * gradient accumulation that fusion keeps at the end of a group, no elementwise member. */
static void test_op_classes(void **state)
{
    (void)state;
    int per_class[CLASS_COUNT] = {0};
    for (int i = 0; i < OP_COUNT; i++) {
        OpKind op = (OpKind)i;
        OpClass c = ir_op_class(op);
        assert_true(c >= 0 && c < CLASS_COUNT);
        assert_int_equal(c, ir_op_info(op)->cls);
        per_class[c]++;
        if (c == CLASS_HELD) assert_int_equal(ir_op_info(op)->arity, 0);
        if (ir_op_is_inplace(op) && op != OP_ACCUMULATE)
            assert_true(c == CLASS_ALONE || c == CLASS_COLLECTIVE);
    }
    for (int c = 0; c < CLASS_COUNT; c++) assert_true(per_class[c] > 0);
    assert_int_equal(ir_op_class(OP_PARAM), CLASS_HELD);
    assert_int_equal(ir_op_class(OP_ALL_REDUCE), CLASS_COLLECTIVE);
    assert_int_equal(ir_op_class(OP_GELU), CLASS_ELEMWISE);
    assert_int_equal(ir_op_class(OP_MATMUL), CLASS_HEAD);
    assert_int_equal(ir_op_class(OP_SUM_ROWS), CLASS_ALONE);
}

/* Attributes by name: every name of the op table reads and writes the slot the textual IR
 * gives it, and the values the reader sets by name come back through the accessors. */
static void test_named_attributes(void **state)
{
    (void)state;
    const OpInfo *mm = ir_op_info(OP_MATMUL);
    assert_int_equal(mm->n_iattr, IATTR_MATMUL_COUNT_);
    assert_int_equal(mm->n_fattr, FATTR_MATMUL_COUNT_);
    const int index[] = {IATTR_MATMUL_trans_a, IATTR_MATMUL_trans_b, IATTR_MATMUL_fp8,
                         IATTR_MATMUL_history, IATTR_MATMUL_grad_e4m3, IATTR_MATMUL_recent,
                         IATTR_MATMUL_margin, IATTR_MATMUL_unaligned};
    const char *const names[] = {"trans_a", "trans_b", "fp8", "history", "grad_e4m3", "recent",
                                 "margin", "unaligned"};
    for (int i = 0; i < 8; i++) assert_string_equal(mm->iattr_names[index[i]], names[i]);
    assert_string_equal(mm->fattr_names[FATTR_MATMUL_static_scale], "static_scale");
    assert_int_equal(ir_op_info(OP_INPUT)->n_iattr, 0);
    assert_int_equal(ir_op_info(OP_ADAMW)->n_fattr, FATTR_ADAMW_COUNT_);

    /* random values through the reader, back through the accessors and the printer */
    srand((unsigned)time(NULL));
    int trans_b = rand() % 2, history = 1 + rand() % 64, margin = rand() % 4;
    double scale = 0.25 * (1 + rand() % 16);
    char text[512];
    snprintf(text, sizeof text,
             "%%0 = input() : f32[32,16] role=input phase=forward\n"
             "%%1 = param() : f32[16,16] role=param phase=forward name=\"w\"\n"
             "%%2 = matmul(%%0, %%1) trans_b=%d fp8=1 history=%d margin=%d static_scale=%g "
             ": f32[32,16] role=activation phase=forward\n",
             trans_b, history, margin, scale);
    Arena *a = arena_new();
    Graph *g = ir_read(a, "named.ir", text);
    assert_non_null(g);
    Node *n = g->nodes[2];
    assert_int_equal(IR_IATTR(n, MATMUL, trans_a), 0);
    assert_int_equal(IR_IATTR(n, MATMUL, trans_b), trans_b);
    assert_int_equal(IR_IATTR(n, MATMUL, fp8), GEMM_FP8_TENSOR);
    assert_int_equal(IR_IATTR(n, MATMUL, history), history);
    assert_int_equal(IR_IATTR(n, MATMUL, margin), margin);
    assert_float_equal(IR_FATTR(n, MATMUL, static_scale), scale, 0);
    IR_IATTR(n, MATMUL, unaligned) = 1;
    IR_IATTR(n, MATMUL, fp8) = GEMM_BF16;
    char *printed = print_to_string(g);
    assert_non_null(strstr(printed, "unaligned=1"));
    assert_null(strstr(printed, "fp8="));
    free(printed);

    /* an op of the family (PAD has SLICE's attributes in SLICE's places) reads through the
     * other's name; an op without the attribute stops the program with a message */
    int64_t three[1] = {3};
    Node *x = ir_leaf(g, OP_INPUT, "x", ROLE_INPUT, FMT_F32, 1, three, here);
    Node *pad = ir_add1(g, OP_PAD, x, here);
    int64_t start = rand() % 5;
    IR_IATTR(pad, SLICE, start) = start;
    assert_int_equal(IR_IATTR(pad, PAD, start), start);
    Node *add = ir_add2(g, OP_ADD, x, x, here);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        freopen("/dev/null", "w", stderr);
        (void)IR_IATTR(add, MATMUL, fp8);
        _exit(0);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_false(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    arena_free(a);
}

/* The scaling table: on random 2-D views, the grid of scales of each granularity is the one
 * its definition gives (DESIGN.md: one per tensor, per row, per 1 x G group, per 1 x 128 tile,
 * per 128 x 128 block, rounding up), rule words name their rows, and the GEMM modes give
 * activations and weights the granularities of their recipes. */
static void test_scaling_table(void **state)
{
    (void)state;
    srand((unsigned)time(NULL) ^ 0x5ca1e);
    for (int trial = 0; trial < 200; trial++) {
        int64_t rows = rand() % 700, cols = 1 + rand() % 700, G = 1 + rand() % 64;
        ScaleGrid t = fmt_scale_grid(SCALE_PER_TENSOR, 0, rows, cols);
        assert_int_equal(t.grid_rows * t.grid_cols, 1);
        ScaleGrid r = fmt_scale_grid(SCALE_PER_ROW, 0, rows, cols);
        assert_int_equal(r.grid_rows, rows);
        assert_int_equal(r.grid_cols, 1);
        assert_int_equal(r.block_cols, cols);
        ScaleGrid g = fmt_scale_grid(SCALE_PER_GROUP, G, rows, cols);
        assert_int_equal(g.grid_rows, rows);
        assert_int_equal(g.grid_cols, (cols + G - 1) / G);
        assert_int_equal(g.block_cols, G);
        ScaleGrid tile = fmt_scale_grid(SCALE_TILE_1x128, 0, rows, cols);
        assert_int_equal(tile.grid_rows, rows);
        assert_int_equal(tile.grid_cols, (cols + 127) / 128);
        ScaleGrid b = fmt_scale_grid(SCALE_BLOCK_128, 0, rows, cols);
        assert_int_equal(b.grid_rows, (rows + 127) / 128);
        assert_int_equal(b.grid_cols, (cols + 127) / 128);
        assert_int_equal(b.block_rows * b.block_cols, 128 * 128);
    }
    const struct { const char *rule; Scaling s; } words[] = {
        {"tensor", SCALE_PER_TENSOR}, {"row", SCALE_PER_ROW}, {"tile128", SCALE_TILE_1x128},
        {"block128", SCALE_BLOCK_128}};
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
        Scaling s = SCALE_NONE;
        assert_true(fmt_scaling_from_rule(words[i].rule, &s));
        assert_int_equal(s, words[i].s);
    }
    Scaling s;
    assert_false(fmt_scaling_from_rule("group", &s));
    assert_false(fmt_scaling_from_rule("", &s));
    assert_int_equal(fmt_scaling_group(SCALE_TILE_1x128, 0), 128);
    assert_int_equal(fmt_scaling_group(SCALE_PER_GROUP, 16), 16);
    assert_int_equal(fmt_scaling_group(SCALE_BLOCK_128, 0), 0);
    assert_int_equal(fmt_gemm_operand_scaling(GEMM_FP8_TENSOR, true), SCALE_PER_TENSOR);
    assert_int_equal(fmt_gemm_operand_scaling(GEMM_FP8_ROW, false), SCALE_PER_ROW);
    assert_int_equal(fmt_gemm_operand_scaling(GEMM_FP8_BLOCK, false), SCALE_TILE_1x128);
    assert_int_equal(fmt_gemm_operand_scaling(GEMM_FP8_BLOCK, true), SCALE_BLOCK_128);
    assert_int_equal(fmt_gemm_mode_of(SCALE_BLOCK_128), GEMM_FP8_BLOCK);
    assert_int_equal(fmt_gemm_mode_of(SCALE_TILE_1x128), GEMM_FP8_BLOCK);
    assert_int_equal(fmt_gemm_mode_of(SCALE_PER_ROW), GEMM_FP8_ROW);
    assert_int_equal(fmt_gemm_mode_of(SCALE_PER_GROUP), GEMM_FP8_TENSOR);
    assert_true(fmt_scaling_info(SCALE_BLOCK_128)->transposable);
    assert_false(fmt_scaling_info(SCALE_TILE_1x128)->transposable);
    assert_string_equal(fmt_scaling_info(SCALE_BLOCK_128)->cublaslt, "BLK128x128_32F");
    assert_string_equal(fmt_scaling_name(SCALE_TILE_1x128), "tile1x128");
}

/* The growable string: random pieces, some formatted far past any fixed line buffer, come out
 * in order and whole; the text stays NUL-terminated and "" while empty. */
static void test_strbuf(void **state)
{
    (void)state;
    srand((unsigned)time(NULL) ^ 0x5b);
    StrBuf b = {0};
    assert_string_equal(strbuf_text(&b), "");
    size_t cap = 1 << 20, len = 0;
    char *want = malloc(cap);
    char *piece = malloc(20000);
    assert_non_null(want);
    assert_non_null(piece);
    for (int i = 0; i < 300; i++) {
        int n = rand() % 3 == 0 ? rand() % 9000 : rand() % 40;
        for (int k = 0; k < n; k++) piece[k] = (char)('a' + rand() % 26);
        piece[n] = 0;
        int x = rand();
        switch (i % 3) {
        case 0: strbuf_add(&b, piece); break;
        case 1: strbuf_addn(&b, piece, (size_t)n); break;
        default: strbuf_printf(&b, "<%d:%s>", x, piece); break;
        }
        len += (size_t)(i % 3 == 2 ? snprintf(want + len, cap - len, "<%d:%s>", x, piece)
                                   : snprintf(want + len, cap - len, "%s", piece));
        assert_true(len < cap);
    }
    assert_false(b.failed);
    assert_int_equal(b.len, len);
    assert_string_equal(strbuf_text(&b), want);
    strbuf_free(&b);
    assert_null(b.buf);
    assert_string_equal(strbuf_text(&b), "");
    free(want);
    free(piece);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tables),
        cmocka_unit_test(test_op_classes),
        cmocka_unit_test(test_named_attributes),
        cmocka_unit_test(test_scaling_table),
        cmocka_unit_test(test_strbuf),
        cmocka_unit_test(test_shapes),
        cmocka_unit_test(test_shape_errors_name_dims),
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_reader_errors),
        cmocka_unit_test(test_reader_large_ids),
        cmocka_unit_test(test_choice_switches),
        cmocka_unit_test(test_verify_catches_inplace_order),
        cmocka_unit_test(test_verify_catches_shape_change),
        cmocka_unit_test(test_verify_unique_names_at_scale),
        cmocka_unit_test(test_uses_and_filter),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
