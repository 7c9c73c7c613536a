/* test_parser.c — the model language: the models in models/, the language's meaning on small
 * programs, and the golden error cases of tests/golden/errors/.
 *
 * A golden error case is a model file that carries its expected diagnostics in comments:
 *     # args: --batch 2 --seq 8 -D dim=big      (optional; this is the default without -D)
 *     # expect: 12:7: error: duplicate parameter 'w'
 *     # expect: 11:7: note: 'w' was first declared here
 *     # expect: <command line>: error: ...      (no place in the file)
 *     # expect: error: ...                      (the file as a whole)
 * The test compiles the file, captures what diag printed, and requires exactly the expected
 * error and note lines, in order, each line with a place followed by the source line and a
 * caret under the expected column. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ast.h"
#include "compiler.h"

/* ---------------------------------------------------------------- helpers */

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *t = malloc((size_t)n + 1);
    assert_int_equal(fread(t, 1, (size_t)n, f), (size_t)n);
    t[n] = 0;
    fclose(f);
    return t;
}

/* One compilation with diagnostics captured in `diag_text` (free it). */
typedef struct {
    Arena *arena;
    Graph *g;
    char *diag_text;
    int errors;
} Compiled;

static Compiled compile_with(const char *path, const char *text, int64_t batch, int64_t seq,
                             const Define *defs, int n_defs)
{
    Compiled c = {.arena = arena_new()};
    size_t len = 0;
    FILE *out = open_memstream(&c.diag_text, &len);
    diag_set_stream(out);
    diag_reset();
    FrontOptions o = {.batch = batch, .seq = seq, .defines = defs, .n_defines = n_defs};
    c.g = text ? front_compile_text(c.arena, path, text, &o) : front_compile_file(c.arena, path, &o);
    c.errors = diag_error_count();
    fclose(out);
    diag_set_stream(NULL);
    diag_reset();
    return c;
}

static Compiled compile_model(const char *path, int64_t batch, int64_t seq, const Define *defs, int n_defs)
{
    return compile_with(path, NULL, batch, seq, defs, n_defs);
}

static Compiled compile_source(const char *text, int64_t batch, int64_t seq)
{
    return compile_with("inline.model", text, batch, seq, NULL, 0);
}

static void compiled_free(Compiled *c)
{
    arena_free(c->arena);
    free(c->diag_text);
}

static void require_ok(const Compiled *c, const char *what)
{
    if (!c->g || c->errors) fail_msg("%s does not compile:\n%s", what, c->diag_text);
}

static int64_t count_params(const Graph *g, int *n_tensors)
{
    int64_t total = 0;
    *n_tensors = 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_PARAM) {
            total += ir_numel(&g->nodes[i]->t);
            ++*n_tensors;
        }
    return total;
}

static Node *param(const Graph *g, const char *name)
{
    Node *n = ir_find(g, name);
    if (!n || n->op != OP_PARAM) fail_msg("no parameter '%s'", name);
    return n;
}

static void assert_dims(const Node *n, int rank, int64_t d0, int64_t d1, int64_t d2)
{
    const int64_t want[3] = {d0, d1, d2};
    if (n->t.rank != rank) fail_msg("%s: rank %d, expected %d", n->t.name ? n->t.name : "node", n->t.rank, rank);
    for (int i = 0; i < rank; i++)
        if (n->t.dims[i] != want[i])
            fail_msg("%s: dim %d is %lld, expected %lld", n->t.name ? n->t.name : "node", i,
                     (long long)n->t.dims[i], (long long)want[i]);
}

static int count_op(const Graph *g, OpKind op)
{
    int k = 0;
    for (int i = 0; i < g->n_nodes; i++) k += g->nodes[i]->op == op;
    return k;
}

/* Every forward graph: one loss, a scalar named "loss", every node placed in the file. */
static void check_forward_graph(const Graph *g, const char *path)
{
    int losses = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        assert_int_equal(n->phase, PHASE_FORWARD);
        assert_true(n->loc.line > 0);
        assert_string_equal(n->loc.file, path);
        for (int j = 0; j < n->n_in; j++) assert_true(n->in[j]->index < n->index);
        if (n->op == OP_PARAM) {
            assert_int_equal(n->t.role, ROLE_PARAM);
            assert_int_equal(n->t.fmt.elem, FMT_F32);
        }
        if (n->op == OP_INPUT) assert_int_equal(n->t.role, ROLE_INPUT);
        if (n->t.name && !strcmp(n->t.name, "loss")) {
            losses++;
            assert_int_equal(n->t.role, ROLE_OUTPUT);
            assert_int_equal(n->t.rank, 0);
        }
    }
    assert_int_equal(losses, 1);
    assert_int_equal(ir_verify(g, "front"), 0);
}

/* ---------------------------------------------------------------- GPT-2 */

/* Parameters of GPT-2 by the formula: per layer 12 d^2 (attention 4 d^2, MLP 8 d^2) and
 * 13 d (biases 3d + d + 4d + d, two LayerNorms 4d); embeddings; the final LayerNorm. */
static int64_t gpt2_params(int64_t L, int64_t d, int64_t vocab, int64_t ctx)
{
    return 12 * L * d * d + 13 * L * d + vocab * d + ctx * d + 2 * d;
}

static void check_gpt2_names(const Graph *g, int layers, int64_t d)
{
    static const char *const per_layer[] = {
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
        "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
        "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"};
    char name[96];
    for (int l = 0; l < layers; l++)
        for (size_t k = 0; k < sizeof per_layer / sizeof per_layer[0]; k++) {
            snprintf(name, sizeof name, "h.%d.%s", l, per_layer[k]);
            Node *p = param(g, name);
            bool is_ln = strstr(name, "ln_") != NULL;
            /* decay: the matrices, but not LayerNorm weights */
            assert_int_equal(IR_IATTR(p, PARAM, decay), strstr(name, ".weight") && !is_ln);
            if (is_ln) assert_int_equal(IR_IATTR(p, PARAM, init), strstr(name, "weight") ? 2 : 1);
        }
    snprintf(name, sizeof name, "h.%d.attn.c_attn.weight", layers - 1);
    assert_dims(param(g, name), 2, 3 * d, d, 0);
    snprintf(name, sizeof name, "h.%d.mlp.c_proj.weight", layers - 1);
    Node *proj = param(g, name);
    assert_dims(proj, 2, d, 4 * d, 0);
    assert_int_equal(IR_IATTR(proj, PARAM, init), 0);
    assert_float_equal(IR_FATTR(proj, PARAM, std), 0.02 / sqrt(2.0 * layers), 1e-12);
    assert_int_equal(IR_IATTR(param(g, "wte.weight"), PARAM, decay), 1);
    assert_int_equal(IR_IATTR(param(g, "wpe.weight"), PARAM, decay), 0);
    param(g, "ln_f.weight");
    param(g, "ln_f.bias");
    int n;
    count_params(g, &n);
    assert_int_equal(n, 12 * layers + 4);   /* and no other parameter */
}

static void test_gpt2_small(void **state)
{
    (void)state;
    const char *path = "models/gpt2.model";
    Compiled c = compile_model(path, 4, 64, NULL, 0);
    require_ok(&c, path);
    int n;
    assert_int_equal(count_params(c.g, &n), gpt2_params(12, 768, 50304, 1024));
    check_gpt2_names(c.g, 12, 768);
    check_forward_graph(c.g, path);
    assert_string_equal(c.g->model_name, "gpt2");
    assert_int_equal(c.g->batch, 4);
    assert_int_equal(c.g->seq, 64);
    assert_true(c.g->optim.present);
    assert_float_equal(c.g->optim.lr, 6e-4, 1e-15);
    assert_float_equal(c.g->optim.beta2, 0.95, 1e-15);
    assert_float_equal(c.g->optim.weight_decay, 0.1, 1e-15);
    assert_float_equal(c.g->optim.clip, 1.0, 1e-15);

    /* the head is tied: the logits matmul reads the embedding table, transposed */
    Node *loss = ir_find(c.g, "loss");
    assert_int_equal(loss->op, OP_CROSS_ENTROPY);
    Node *logits = loss->in[0];
    assert_int_equal(logits->op, OP_MATMUL);
    assert_ptr_equal(logits->in[1], param(c.g, "wte.weight"));
    assert_int_equal(IR_IATTR(logits, MATMUL, trans_b), 1);
    assert_dims(logits, 3, 4, 64, 50304);
    /* activations are named after the variable or the scope that holds them, for
     * precision policies (saved:h.*.attn.y=...) */
    assert_int_equal(ir_find(c.g, "h.4.attn.y")->op, OP_ATTENTION);
    assert_int_equal(ir_find(c.g, "h.4.attn.k")->op, OP_SLICE);
    assert_int_equal(IR_IATTR(ir_find(c.g, "h.4.attn.k"), SLICE, start), 768);
    assert_int_equal(ir_find(c.g, "h.11.ln_2")->op, OP_LAYERNORM);
    Node *h11 = ir_find(c.g, "h.11");
    assert_int_equal(h11->op, OP_ADD);
    assert_ptr_equal(ir_find(c.g, "ln_f")->in[0], h11);
    assert_int_equal(count_op(c.g, OP_ATTENTION), 12);
    assert_int_equal(count_op(c.g, OP_GELU), 12);
    assert_int_equal(count_op(c.g, OP_LAYERNORM), 25);
    for (int i = 0; i < c.g->n_nodes; i++) {
        Node *a = c.g->nodes[i];
        if (a->op != OP_ATTENTION) continue;
        assert_int_equal(IR_IATTR(a, ATTENTION, heads), 12);
        assert_int_equal(IR_IATTR(a, ATTENTION, kv_heads), 12);
        assert_float_equal(IR_FATTR(a, ATTENTION, scale), 1 / sqrt(64.0), 1e-12);
    }
    compiled_free(&c);
}

/* GPT-2 XL: 25 heads of 64 (not a power of two), 48 layers. */
static void test_gpt2_xl(void **state)
{
    (void)state;
    const Define defs[] = {{"layers", "48"}, {"dim", "1600"}, {"heads", "25"}};
    Compiled c = compile_model("models/gpt2.model", 2, 1024, defs, 3);
    require_ok(&c, "gpt2.model -D layers=48 -D dim=1600 -D heads=25");
    int n;
    int64_t total = count_params(c.g, &n);
    assert_int_equal(total, gpt2_params(48, 1600, 50304, 1024));
    assert_true(total > 1500000000 && total < 1600000000);   /* "1.5B" */
    check_gpt2_names(c.g, 48, 1600);
    for (int i = 0; i < c.g->n_nodes; i++)
        if (c.g->nodes[i]->op == OP_ATTENTION) {
            assert_int_equal(IR_IATTR(c.g->nodes[i], ATTENTION, heads), 25);
            assert_float_equal(IR_FATTR(c.g->nodes[i], ATTENTION, scale), 0.125, 1e-12);
        }
    compiled_free(&c);
}

static void test_gpt2_tiny(void **state)
{
    (void)state;
    Compiled c = compile_model("models/gpt2_tiny.model", 4, 256, NULL, 0);
    require_ok(&c, "gpt2_tiny.model");
    int n;
    assert_int_equal(count_params(c.g, &n), gpt2_params(4, 128, 256, 256));
    check_gpt2_names(c.g, 4, 128);
    check_forward_graph(c.g, "models/gpt2_tiny.model");
    /* the context is 256 positions: a longer sequence is a compile error at the slice */
    Compiled too_long = compile_model("models/gpt2_tiny.model", 4, 257, NULL, 0);
    assert_null(too_long.g);
    assert_non_null(strstr(too_long.diag_text, "exceeds its length 256"));
    compiled_free(&too_long);
    compiled_free(&c);
}

/* ---------------------------------------------------------------- Llama */

static int64_t llama_params(int64_t L, int64_t d, int64_t heads, int64_t kv_heads, int64_t hidden, int64_t vocab)
{
    int64_t hd = d / heads;
    int64_t attn = d * d + 2 * d * kv_heads * hd + d * d;
    int64_t mlp = 3 * d * hidden;
    return L * (attn + mlp + 2 * d) + d + 2 * vocab * d;
}

static void test_llama(void **state)
{
    (void)state;
    const char *path = "models/llama.model";
    Compiled c = compile_model(path, 1, 128, NULL, 0);
    require_ok(&c, path);
    int n;
    int64_t total = count_params(c.g, &n);
    assert_int_equal(total, llama_params(22, 2048, 32, 4, 5632, 32000));
    assert_int_equal(n, 22 * 9 + 3);
    check_forward_graph(c.g, path);

    static const char *const per_layer[] = {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"};
    char name[96];
    for (int l = 0; l < 22; l++)
        for (size_t k = 0; k < sizeof per_layer / sizeof per_layer[0]; k++) {
            snprintf(name, sizeof name, "model.layers.%d.%s", l, per_layer[k]);
            Node *p = param(c.g, name);
            assert_int_equal(IR_IATTR(p, PARAM, decay), strstr(name, "_proj") != NULL);
        }
    assert_dims(param(c.g, "model.layers.21.self_attn.k_proj.weight"), 2, 4 * 64, 2048, 0);
    assert_dims(param(c.g, "model.layers.0.mlp.down_proj.weight"), 2, 2048, 5632, 0);
    assert_int_equal(IR_IATTR(param(c.g, "model.embed_tokens.weight"), PARAM, decay), 0);
    assert_int_equal(IR_IATTR(param(c.g, "lm_head.weight"), PARAM, decay), 1);
    param(c.g, "model.norm.weight");
    for (int i = 0; i < c.g->n_nodes; i++) {
        const Node *x = c.g->nodes[i];
        assert_true(!x->t.name || !strstr(x->t.name, "bias"));
        if (x->op == OP_ATTENTION) {
            assert_int_equal(IR_IATTR(x, ATTENTION, heads), 32);
            assert_int_equal(IR_IATTR(x, ATTENTION, kv_heads), 4);
            assert_dims(x->in[1], 3, 1, 128, 256);
        }
        if (x->op == OP_ROPE) assert_int_equal(IR_IATTR(x, ROPE, head_dim), 64);
    }
    assert_int_equal(count_op(c.g, OP_ROPE), 44);
    assert_int_equal(count_op(c.g, OP_SILU), 22);
    assert_int_equal(count_op(c.g, OP_RMSNORM), 45);
    /* untied: the head reads lm_head, not the embedding */
    Node *logits = ir_find(c.g, "loss")->in[0];
    assert_ptr_equal(logits->in[1], param(c.g, "lm_head.weight"));
    compiled_free(&c);

    /* Llama-2-7B through -D: 6.74B */
    const Define defs[] = {{"layers", "32"}, {"dim", "4096"}, {"kv_heads", "32"}, {"hidden", "11008"}};
    c = compile_model(path, 1, 16, defs, 4);
    require_ok(&c, "llama.model as Llama-2-7B");
    assert_int_equal(count_params(c.g, &n), llama_params(32, 4096, 32, 32, 11008, 32000));
    assert_int_equal(count_params(c.g, &n), 6738415616);
    compiled_free(&c);
}

/* ---------------------------------------------------------------- MLP */

static void test_mlp(void **state)
{
    (void)state;
    const char *path = "models/mlp.model";
    Compiled c = compile_model(path, 8, 16, NULL, 0);
    require_ok(&c, path);
    int64_t vocab = 256, d = 64, h = 256, L = 2;
    int64_t layer = 2 * d + h * d + h + d * h + d;
    int n;
    assert_int_equal(count_params(c.g, &n), vocab * d + L * layer + vocab * d + vocab);
    param(c.g, "layers.1.fc2.weight");
    param(c.g, "head.bias");
    assert_int_equal(IR_IATTR(param(c.g, "layers.0.norm.weight"), PARAM, decay), 0);   /* default: rank >= 2 */
    assert_int_equal(IR_IATTR(param(c.g, "layers.0.fc1.weight"), PARAM, decay), 1);
    check_forward_graph(c.g, path);
    assert_float_equal(c.g->optim.weight_decay, 0.01, 1e-15);
    assert_float_equal(c.g->optim.beta2, 0.999, 1e-15);   /* PyTorch's default */
    compiled_free(&c);
}

/* A model with ~20k parameters lowers in time near-linear in them. Each `param` used to scan
 * every node of the graph for a computed tensor of the same name, which made this model
 * (3,334 layers of 6 parameters, 43k nodes) take seconds in the front end alone and
 * grew with the square of its size; now a table of computed names answers at once and it
 * takes well under a tenth of a second. The bound is generous (slow machines, sanitizers),
 * and still far below what the quadratic version needed (2.8 s on the machine that measured
 * both, where this takes 0.04 s). */
static void test_many_params(void **state)
{
    (void)state;
    const char *path = "models/mlp.model";
    const Define defs[] = {{"layers", "3334"}, {"dim", "4"}, {"hidden", "4"}};
    clock_t t0 = clock();
    Compiled c = compile_model(path, 1, 1, defs, 3);
    double seconds = (double)(clock() - t0) / CLOCKS_PER_SEC;
    require_ok(&c, path);
    int n;
    count_params(c.g, &n);
    assert_int_equal(n, 6 * 3334 + 3);
    param(c.g, "layers.3333.fc2.bias");
    print_message("front end: %d parameters, %d nodes in %.3f s of CPU\n", n, c.g->n_nodes, seconds);
    assert_true(seconds < 0.5);
    compiled_free(&c);
}

/* Every model: it compiles, and printing its syntax tree and parsing that again gives the
 * same text (the printer and the parser agree on the whole language they use). */
static void test_models_round_trip(void **state)
{
    (void)state;
    DIR *dir = opendir("models");
    assert_non_null(dir);
    int models = 0;
    for (struct dirent *e; (e = readdir(dir));) {
        size_t len = strlen(e->d_name);
        if (len < 7 || strcmp(e->d_name + len - 6, ".model")) continue;
        char path[512];
        snprintf(path, sizeof path, "models/%s", e->d_name);
        Compiled c = compile_model(path, 2, 16, NULL, 0);
        require_ok(&c, path);
        compiled_free(&c);

        char *text = read_text(path);
        char *once = NULL, *twice = NULL;
        size_t n1 = 0, n2 = 0;
        Arena *a = arena_new();
        AstVec prog;
        assert_true(ast_parse(a, path, text, &prog));
        FILE *f = open_memstream(&once, &n1);
        ast_print(&prog, f);
        fclose(f);
        assert_true(ast_parse(a, "printed", once, &prog));
        f = open_memstream(&twice, &n2);
        ast_print(&prog, f);
        fclose(f);
        assert_string_equal(once, twice);
        arena_free(a);
        free(once);
        free(twice);
        free(text);
        models++;
    }
    closedir(dir);
    assert_true(models >= 4);
}

/* ---------------------------------------------------------------- meaning */

#define PRELUDE                                          \
    "config dim = 8, vocab = 16\n"                       \
    "input tokens: i32[B, T]\n"                          \
    "input targets: i32[B, T]\n"                         \
    "param wte.weight: [vocab, dim] = normal(0.02)\n"    \
    "x = embedding(wte.weight, tokens)\n"

#define LOSS "loss cross_entropy(linear(y, wte.weight), targets)\n"

static void test_numbers(void **state)
{
    (void)state;
    /* exact integer quotients stay integers; inexact ones are reals; % and precedence */
    Compiled c = compile_source(PRELUDE
                                "config a = dim / 2 * 3 - 10 % 4, b = 7 / 2, c = -(2 - 5) * 2\n"
                                "param w: [a, c] = normal(b / sqrt(49))\n"
                                "y = linear(x, wte.weight) + 0 * gelu(linear(linear(x, w, b=c * 0 + 0 * zz), w))\n",
                                2, 3);
    assert_null(c.g);   /* `zz` is unknown; the error names it and nothing else */
    assert_int_equal(c.errors, 1);
    assert_non_null(strstr(c.diag_text, "unknown name 'zz'"));
    compiled_free(&c);

    c = compile_source(PRELUDE
                       "config a = dim / 2 * 3 - 10 % 4, b = 7 / 2, c = -(2 - 5) * 2\n"
                       "param w: [a, c] = normal(b / sqrt(49))\n"
                       "y = 0.5 * x - 1\n" LOSS,
                       2, 3);
    assert_null(c.g);   /* w is never read by the loss, and would never train */
    assert_int_equal(c.errors, 1);
    assert_non_null(strstr(c.diag_text, "inline.model:7:7: error: parameter 'w' does not affect the loss\n"));
    compiled_free(&c);

    c = compile_source(PRELUDE
                       "config a = dim / 2 * 3 - 10 % 4, b = 7 / 2, c = -(2 - 5) * 2\n"
                       "param w: [a, c] = normal(b / sqrt(49))\n"
                       "y = x + 0 * linear(slice(x, axis=-1, start=2, size=c), w)[0]\n",
                       2, 3);
    assert_null(c.g);   /* indexing is not in the language: a syntax error */
    assert_non_null(strstr(c.diag_text, "unexpected '['"));
    compiled_free(&c);

    c = compile_source(PRELUDE
                       "config a = dim / 2 * 3 - 10 % 4, b = 7 / 2, c = -(2 - 5) * 2\n"
                       "param w: [a, c] = normal(b / sqrt(49))\n"
                       "h = linear(slice(x, axis=-1, start=2, size=c), w)\n"
                       "y = x + 0.25 * slice(h, axis=2, start=0, size=dim)\n" LOSS,
                       2, 3);
    require_ok(&c, "arithmetic");
    Node *w = param(c.g, "w");
    assert_dims(w, 2, 10, 6, 0);                 /* 8/2*3 - 10%4 = 10; -(2-5)*2 = 6 */
    assert_float_equal(IR_FATTR(w, PARAM, std), 0.5, 1e-12); /* 7/2 = 3.5, / sqrt(49) */
    int scales = 0;
    for (int i = 0; i < c.g->n_nodes; i++) {
        Node *n = c.g->nodes[i];
        if (n->op == OP_SCALE) {
            scales++;
            assert_float_equal(IR_FATTR(n, SCALE, alpha), 0.25, 0);
        }
        if (n->op == OP_SLICE && n->in[0]->op == OP_EMBEDDING) {
            assert_int_equal(IR_IATTR(n, SLICE, axis), 2);    /* axis -1 of a rank-3 tensor */
            assert_int_equal(IR_IATTR(n, SLICE, start), 2);
            assert_dims(n, 3, 2, 3, 6);
        }
    }
    assert_int_equal(scales, 1);
    compiled_free(&c);
}

/* tensor - number and number - tensor: an added constant, with a negation where needed */
static void test_tensor_scalar_ops(void **state)
{
    (void)state;
    Compiled c = compile_source(PRELUDE "y = 1 - x / 4\n" LOSS, 2, 3);
    require_ok(&c, "1 - x / 4");
    Node *loss = ir_find(c.g, "loss");
    Node *y = loss->in[0]->in[0];                /* linear(y, ..) is a matmul of y */
    assert_int_equal(y->op, OP_ADD);
    assert_int_equal(y->in[1]->op, OP_CONST);
    assert_int_equal(y->in[1]->t.rank, 0);
    assert_float_equal(IR_FATTR(y->in[1], CONST, value), 1.0, 0);
    Node *neg = y->in[0];
    assert_int_equal(neg->op, OP_SCALE);
    assert_float_equal(IR_FATTR(neg, SCALE, alpha), -1.0, 0);
    assert_int_equal(neg->in[0]->op, OP_SCALE);
    assert_float_equal(IR_FATTR(neg->in[0], SCALE, alpha), 0.25, 0);
    compiled_free(&c);

    /* a bias written first still broadcasts: the operands of + are put in order */
    c = compile_source(PRELUDE "param b: [dim] = zeros\ny = b + x * b\n" LOSS, 2, 3);
    require_ok(&c, "b + x * b");
    y = ir_find(c.g, "loss")->in[0]->in[0];
    assert_int_equal(y->op, OP_ADD);
    assert_int_equal(y->in[0]->op, OP_MUL);
    assert_ptr_equal(y->in[1], param(c.g, "b"));
    assert_ptr_equal(y->in[0]->in[1], param(c.g, "b"));
    compiled_free(&c);
}

/* Scopes: `as` paths with index expressions nest; a call without `as` declares in its caller's
 * scope; a block reads a parameter of the top level by its full name. */
static void test_scopes(void **state)
{
    (void)state;
    Compiled c = compile_source(PRELUDE
                                "block inner(a) {\n"
                                "    param w: [dim, dim] = normal(0.02)\n"
                                "    return linear(a, w) + 0 * embedding(wte.weight, tokens)\n"
                                "}\n"
                                "block plain(a) {\n"
                                "    param g: [dim] = ones\n"
                                "    return rmsnorm(a, g)\n"
                                "}\n"
                                "block outer(a) {\n"
                                "    a = plain(a)\n"
                                "    return inner(a) as mix\n"
                                "}\n"
                                "for i in 1..3 {\n"
                                "    x = outer(x) as blocks[i * 2 + 1].sub\n"
                                "}\n"
                                "y = plain(x)\n" LOSS,
                                1, 4);
    require_ok(&c, "scopes");
    param(c.g, "blocks.3.sub.g");
    param(c.g, "blocks.3.sub.mix.w");
    param(c.g, "blocks.5.sub.g");
    param(c.g, "blocks.5.sub.mix.w");
    param(c.g, "g");
    int n;
    count_params(c.g, &n);
    assert_int_equal(n, 6);
    assert_int_equal(IR_IATTR(param(c.g, "g"), PARAM, init), 2);
    compiled_free(&c);
}

/* A parameter's name is its own: computed tensors that took the name before it was declared
 * (here twice, by two calls of a block at the top level) give it up. */
static void test_param_takes_name(void **state)
{
    (void)state;
    Compiled c = compile_source(PRELUDE
                                "block twice(a) {\n"
                                "    t = a * 2\n"
                                "    return t\n"
                                "}\n"
                                "u = twice(x)\n"
                                "v = twice(u)\n"
                                "param t: [dim] = ones\n"
                                "y = rmsnorm(v, t)\n" LOSS,
                                1, 4);
    require_ok(&c, "param takes name");
    int named = 0;
    for (int i = 0; i < c.g->n_nodes; i++)
        if (c.g->nodes[i]->t.name && !strcmp(c.g->nodes[i]->t.name, "t")) named++;
    assert_int_equal(named, 1);
    assert_int_equal(ir_find(c.g, "t")->op, OP_PARAM);
    assert_int_equal(count_op(c.g, OP_SCALE), 2);
    compiled_free(&c);
}

/* Several results: split by count and by sizes, and a block that returns two values. */
#define TWO                                                                              \
    "block two(a) {\n    p, q = split(a, 2)\n    return q, p\n}\n"                  \
    "u, v = two(x)\n"                                                                  \
    "r, s, t = split(x, 2, 1, 5)\n"

static void test_tuples(void **state)
{
    (void)state;
    Compiled c = compile_source(PRELUDE TWO "y = x + 0 * (r + s + t)\n" LOSS, 2, 3);
    assert_null(c.g);   /* r, s, t have widths 2, 1 and 5 */
    assert_int_equal(c.errors, 1);
    assert_non_null(strstr(c.diag_text, "cannot add f32[2,3,2] and f32[2,3,1]: dim 2 is 2 and 1"));
    compiled_free(&c);

    c = compile_source(PRELUDE TWO
                       "param pw: [dim, 4] = zeros\n"
                       "param tw: [dim, 5] = zeros\n"
                       "y = x + linear(u - v, pw) * linear(t, tw)\n" LOSS,
                       2, 3);
    require_ok(&c, "tuples");
    int slices = 0;
    for (int i = 0; i < c.g->n_nodes; i++) {
        Node *n = c.g->nodes[i];
        if (n->op != OP_SLICE) continue;
        slices++;
        assert_int_equal(n->in[0]->op, OP_EMBEDDING);
        assert_int_equal(IR_IATTR(n, SLICE, axis), 2);
        assert_true(IR_IATTR(n, SLICE, start) == 0 || IR_IATTR(n, SLICE, start) == 4 || IR_IATTR(n, SLICE, start) == 3);
    }
    assert_int_equal(slices, 3);    /* u, v and t; r and s do not reach the loss */
    Node *sub = NULL;
    for (int i = 0; i < c.g->n_nodes; i++)
        if (c.g->nodes[i]->op == OP_SUB) sub = c.g->nodes[i];
    assert_non_null(sub);
    assert_int_equal(IR_IATTR(sub->in[0], SLICE, start), 4);  /* u is the second half: the block swapped */
    assert_int_equal(IR_IATTR(sub->in[1], SLICE, start), 0);
    assert_dims(sub, 3, 2, 3, 4);
    compiled_free(&c);
}

static void test_defines(void **state)
{
    (void)state;
    const char *src = "config layers = 2, dim = 8, std = 0.5\n"
                      "input tokens: i32[B, T]\ninput targets: i32[B, T]\n"
                      "param wte.weight: [16, dim] = normal(std)\n"
                      "x = embedding(wte.weight, tokens)\n"
                      "block f(a) {\n    param w: [dim, dim] = zeros\n    return a + linear(a, w)\n}\n"
                      "for i in 0..layers {\n    x = f(x) as h[i]\n}\n"
                      "loss cross_entropy(linear(x, wte.weight), targets)\n";
    const Define defs[] = {{"layers", "5"}, {"std", "1"}, {"dim", "4"}, {"layers", "3"}};
    Compiled c = compile_with("defines.model", src, 2, 2, defs, 4);
    require_ok(&c, "defines");
    int n;
    assert_int_equal(count_params(c.g, &n), 16 * 4 + 3 * 4 * 4);   /* the last -D wins */
    assert_float_equal(IR_FATTR(param(c.g, "wte.weight"), PARAM, std), 1.0, 0);  /* an integer for a real */
    param(c.g, "h.2.w");
    assert_string_equal(c.g->model_name, "defines");                /* from the file name */
    assert_false(c.g->optim.present);
    compiled_free(&c);

    /* several bad -D at once: each is reported */
    const Define bad[] = {{"layer", "2"}, {"dim", "4x"}, {"layers", "1e3"}, {"std", ""}};
    c = compile_with("defines.model", src, 2, 2, bad, 4);
    assert_null(c.g);
    assert_int_equal(c.errors, 4);
    assert_non_null(strstr(c.diag_text, "<command line>: error: -D layer=2: the model has no config 'layer' (did you mean 'layers'?)\n"));
    assert_non_null(strstr(c.diag_text, "<command line>: error: -D dim=4x: '4x' is not a number\n"));
    assert_non_null(strstr(c.diag_text, "<command line>: error: -D layers=1e3: config 'layers' is an integer\n"));
    assert_non_null(strstr(c.diag_text, "<command line>: error: -D std=: '' is not a number\n"));
    compiled_free(&c);
}

static void test_missing_file(void **state)
{
    (void)state;
    Compiled c = compile_model("models/no_such.model", 1, 1, NULL, 0);
    assert_null(c.g);
    assert_int_equal(c.errors, 1);
    assert_non_null(strstr(c.diag_text, "models/no_such.model: error: cannot open the model: "));
    compiled_free(&c);
}

/* A UTF-8 byte-order mark before the model is skipped: the model compiles as without it, and
 * an error's column counts from the first character after it. A mark anywhere else is an
 * error. */
static void test_byte_order_mark(void **state)
{
    (void)state;
    char *plain = read_text("models/gpt2_tiny.model");
    size_t n = strlen(plain);
    char *marked = malloc(n + 4);
    assert_non_null(marked);
    memcpy(marked, "\xef\xbb\xbf", 3);
    memcpy(marked + 3, plain, n + 1);
    Compiled a = compile_source(plain, 2, 16), b = compile_source(marked, 2, 16);
    assert_non_null(a.g);
    assert_non_null(b.g);
    assert_int_equal(b.errors, 0);
    assert_int_equal(a.g->n_nodes, b.g->n_nodes);
    compiled_free(&a);
    compiled_free(&b);
    free(marked);
    free(plain);

    Compiled c = compile_source("\xef\xbb\xbfparam w: f32[4]\n", 1, 1);
    assert_null(c.g);
    assert_int_equal(c.errors, 1);
    assert_non_null(strstr(c.diag_text, "inline.model:1:16: error: unexpected end of line"));
    compiled_free(&c);

    Compiled d = compile_source("model m\n\xef\xbb\xbfparam w: f32[4] = zeros\n", 1, 1);
    assert_null(d.g);
    assert_true(d.errors >= 1);
    assert_non_null(strstr(d.diag_text, "inline.model:2:1: error: unexpected byte 0xef"));
    compiled_free(&d);
}

/* Text that is not even close to the language: no crash, errors only. */
static void test_garbage(void **state)
{
    (void)state;
    static const char *const inputs[] = {
        "", "\n\n", "}}}}", "((((((((", "block", "for i in", "\"", "x = = = =\n", "\x01\x02\xff",
        "block f( { return } }", "model\nmodel m\nmodel m\n", "param : [] =", "loss loss loss",
        "config a = 1 / 0.0\n", "input t: f32[99999999999999999999]\n", "x = -(-(-(-(1))))\n",
        "block f(a) {\n return g(a)\n}\nblock g(a) {\n return f(a)\n}\nloss f(1)\n",
    };
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++) {
        Compiled c = compile_source(inputs[i], 2, 2);
        assert_null(c.g);
        assert_true(c.errors >= 1);
        assert_non_null(strstr(c.diag_text, "error: "));
        compiled_free(&c);
    }
}

/* ---------------------------------------------------------------- golden errors */

typedef struct {
    char *args;             /* "# args:" line, or NULL */
    char *expect[32];
    int n_expect;
} Golden;

static void golden_read(const char *text, Golden *g)
{
    memset(g, 0, sizeof *g);
    for (const char *p = text; *p;) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len > 10 && !strncmp(p, "# expect: ", 10)) {
            assert_true(g->n_expect < 32);
            g->expect[g->n_expect++] = strndup(p + 10, len - 10);
        } else if (len > 8 && !strncmp(p, "# args: ", 8)) {
            g->args = strndup(p + 8, len - 8);
        }
        p = e ? e + 1 : p + len;
    }
}

/* "--batch 2 --seq 8 -D a=b" */
static void golden_args(char *args, int64_t *batch, int64_t *seq, Define *defs, int *n_defs)
{
    *batch = 2, *seq = 8, *n_defs = 0;
    if (!args) return;
    *batch = *seq = 0;
    for (char *save = NULL, *w = strtok_r(args, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
        char *v = strtok_r(NULL, " ", &save);
        if (!v) fail_msg("# args: '%s' needs a value", w);
        if (!strcmp(w, "--batch")) {
            *batch = atoll(v);
        } else if (!strcmp(w, "--seq")) {
            *seq = atoll(v);
        } else if (!strcmp(w, "-D")) {
            char *eq = strchr(v, '=');
            if (!eq) fail_msg("# args: -D %s needs name=value", v);
            *eq = 0;
            defs[(*n_defs)++] = (Define){v, eq + 1};
        } else {
            fail_msg("# args: unknown flag '%s'", w);
        }
    }
}

/* Splits captured diagnostics into lines; returns the count. */
static int split_lines(char *text, char **lines, int max)
{
    int n = 0;
    for (char *p = text; *p && n < max;) {
        lines[n++] = p;
        char *e = strchr(p, '\n');
        if (!e) break;
        *e = 0;
        p = e + 1;
    }
    return n;
}

static bool is_diag_line(const char *l)
{
    return strstr(l, ": error: ") || strstr(l, ": note: ");
}

/* Checks one golden case; returns false after printing what differs. */
static bool golden_check(const char *path)
{
    char *text = read_text(path);
    Golden gd;
    golden_read(text, &gd);
    free(text);
    if (gd.n_expect == 0) {
        print_error("%s: no '# expect:' line\n", path);
        return false;
    }
    int64_t batch, seq;
    Define defs[8];
    int n_defs;
    golden_args(gd.args, &batch, &seq, defs, &n_defs);
    Compiled c = compile_model(path, batch, seq, defs, n_defs);
    char *shown = strdup(c.diag_text ? c.diag_text : "");
    char *lines[512];
    int n = split_lines(c.diag_text, lines, 512);

    bool ok = c.g == NULL && c.errors > 0;
    int k = 0, expected_errors = 0;
    for (int i = 0; i < n && ok; i++) {
        if (!is_diag_line(lines[i])) continue;
        if (k == gd.n_expect) {
            ok = false;
            break;
        }
        const char *want = gd.expect[k++];
        char full[1024];
        int line = 0, col = 0;
        if (want[0] >= '0' && want[0] <= '9') {
            snprintf(full, sizeof full, "%s:%s", path, want);
            sscanf(want, "%d:%d", &line, &col);
        } else if (want[0] == '<') {
            snprintf(full, sizeof full, "%s", want);
        } else {
            snprintf(full, sizeof full, "%s: %s", path, want);
        }
        if (strcmp(lines[i], full)) {
            ok = false;
            break;
        }
        if (line > 0) {
            /* the source line, then a caret under column `col` */
            ok = i + 2 < n && !is_diag_line(lines[i + 1]) && strncmp(lines[i + 2], "    ", 4) == 0;
            if (ok) {
                const char *caret = lines[i + 2] + 4;
                ok = (int)strlen(caret) == col && caret[col - 1] == '^';
                for (int j = 0; ok && j < col - 1; j++) ok = caret[j] == ' ' || caret[j] == '\t';
            }
        }
    }
    for (int i = 0; i < gd.n_expect; i++) expected_errors += strstr(gd.expect[i], "error: ") != NULL;
    ok = ok && k == gd.n_expect && c.errors == expected_errors;
    if (!ok) {
        print_error("%s: diagnostics differ (%d errors); expected:\n", path, c.errors);
        for (int i = 0; i < gd.n_expect; i++) print_error("  %s\n", gd.expect[i]);
        print_error("got:\n%s\n", shown);
    }
    for (int i = 0; i < gd.n_expect; i++) free(gd.expect[i]);
    free(gd.args);
    free(shown);
    compiled_free(&c);
    return ok;
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void test_golden_errors(void **state)
{
    (void)state;
    const char *dirname = "tests/golden/errors";
    DIR *dir = opendir(dirname);
    assert_non_null(dir);
    char *names[256];
    int n = 0;
    for (struct dirent *e; (e = readdir(dir)) && n < 256;) {
        size_t len = strlen(e->d_name);
        if (len > 6 && !strcmp(e->d_name + len - 6, ".model"))
            names[n++] = strdup(e->d_name);
    }
    closedir(dir);
    qsort(names, (size_t)n, sizeof names[0], by_name);
    int failed = 0;
    for (int i = 0; i < n; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dirname, names[i]);
        failed += !golden_check(path);
        free(names[i]);
    }
    print_message("%d golden error cases, %d failed\n", n, failed);
    assert_true(n >= 30);
    assert_int_equal(failed, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpt2_small),
        cmocka_unit_test(test_gpt2_xl),
        cmocka_unit_test(test_gpt2_tiny),
        cmocka_unit_test(test_llama),
        cmocka_unit_test(test_mlp),
        cmocka_unit_test(test_many_params),
        cmocka_unit_test(test_models_round_trip),
        cmocka_unit_test(test_numbers),
        cmocka_unit_test(test_tensor_scalar_ops),
        cmocka_unit_test(test_scopes),
        cmocka_unit_test(test_param_takes_name),
        cmocka_unit_test(test_tuples),
        cmocka_unit_test(test_defines),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_byte_order_mark),
        cmocka_unit_test(test_garbage),
        cmocka_unit_test(test_golden_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
