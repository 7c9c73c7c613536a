/* test_passes.c — the core passes: golden files on textual IR, and properties.
 *
 * Golden files. tests/golden/passes/NAME.ir is one file that keeps input and expected output
 * side by side: the input IR, a comment line `# RUN: pass1,pass2` naming the passes to run
 * (through pass_find/pass_run, with ir_verify after each; `+grad_release` among them turns that
 * option on for the passes after it, `+gpus=N` makes the build data parallel over N GPUs,
 * `+shard_states` shards its optimizer state (--shard-states), `+shard_states=2` its
 * gradients too (--shard-states=2),
 * `+fp8_any_shape` keeps FP8 GEMMs whose K or N are not
 * multiples of 16 (the golden graphs are 8 wide); the level is the graph's opt=; a line `# RULES: r1 r2`
 * gives precision rules as --precision flags would), and after a line `# EXPECT:` the
 * text ir_print writes once they ran, verbatim. Only the text before `# EXPECT:` is read as
 * input (ir_read skips the `#` lines). With FP8C_UPDATE_GOLDEN=1 the expected part is
 * rewritten from what the passes produce now; review that diff like code before committing.
 *
 * Properties, on fresh random data each run (the seed is printed; FP8C_TEST_SEED repeats it):
 * - autodiff: every parameter's gradient, computed by the reference executor on the backward
 *   graph, matches central finite differences of the loss (normalized error < 1e-2 per
 *   parameter, f32 storage) on a tiny MLP and on two graphs that use every backward rule;
 * - memplan: on a GPT-2-shaped training step no two tensors that are live at the same time
 *   overlap, aliases share their root's place, offsets are aligned, the step arena is at most
 *   the sum of its tensors and at least the peak of live bytes;
 * - schedule: operands come first, leaves first, the update last, every in-place op after the
 *   other readers of what it overwrites, also from a shuffled order; and it never raises the
 *   peak of live bytes over the order it was given;
 * - dce keeps outputs, in-place ops, state and inputs, and removes dead nodes. */
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
#include <unistd.h>

#include "passes.h"
#include "compiler.h"
#include "rt.h"

#ifndef FP8C_SOURCE_DIR
#define FP8C_SOURCE_DIR "."
#endif

static const SrcLoc here = {"test.model", 1, 1};

/* ---------------------------------------------------------------- helpers */

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    assert_non_null(s);
    size_t got = fread(s, 1, (size_t)n, f);
    s[got] = 0;
    fclose(f);
    return s;
}

static char *print_to_string(const Graph *g)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    ir_print(g, f);
    fclose(f);
    return buf;
}

/* Runs "a,b,c" through the registry with verification; false if a pass failed. */
/* Runs the named passes; `rules`, when not NULL, is a space-separated list of precision rules
 * (a golden file's `# RULES:` line), given to the passes as --precision flags would be. */
static bool run_passes_with(Graph *g, const char *list, const char *rules)
{
    PassOptions opt = {.verify = true};
    const char *overrides[16];
    char rule_buf[512];
    if (rules) {
        snprintf(rule_buf, sizeof rule_buf, "%s", rules);
        for (char *r = strtok(rule_buf, " \t"); r && opt.n_overrides < 16; r = strtok(NULL, " \t"))
            overrides[opt.n_overrides++] = r;
        opt.overrides = overrides;
    }
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *name = strtok(buf, ", \t"); name; name = strtok(NULL, ", \t")) {
        if (!strcmp(name, "+grad_release")) {   /* an option for the passes that follow */
            opt.grad_release = true;
            continue;
        }
        if (!strncmp(name, "+gpus=", 6)) {   /* a data-parallel build (comm.c) */
            opt.gpus = atoi(name + 6);
            continue;
        }
        if (!strncmp(name, "+shard_states", 13)) {   /* --shard-states[=2] (comm.c) */
            opt.shard_states = name[13] == '=' ? atoi(name + 14) : 1;
            continue;
        }
        if (!strcmp(name, "+fp8_any_shape")) {   /* FP8 GEMMs on shapes below 16 (precision.c) */
            opt.fp8_any_shape = true;
            continue;
        }
        const PassInfo *p = pass_find(name);
        if (!p) {
            fprintf(stderr, "unknown pass '%s'\n", name);
            return false;
        }
        if (!pass_run(g, p, &opt)) return false;
    }
    return true;
}

static bool run_passes(Graph *g, const char *list) { return run_passes_with(g, list, NULL); }

static uint64_t rng_state;

static uint64_t rng_next(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1DULL;
}

static double rng_uniform(void) { return ((double)(rng_next() >> 11) + 0.5) / 9007199254740992.0; }

static double rng_normal(void)
{
    return sqrt(-2.0 * log(rng_uniform())) * cos(6.283185307179586 * rng_uniform());
}

static void seed_rng(void)
{
    static bool done;
    if (done) return;
    const char *env = getenv("FP8C_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
    if (!seed) seed = 1;
    printf("test_passes: seed %llu (FP8C_TEST_SEED repeats it)\n", (unsigned long long)seed);
    rng_state = seed;
    done = true;
}

/* ---- building graphs by hand */

static Node *leaf(Graph *g, OpKind op, const char *name, Role role, ElemType e, int rank,
                  const int64_t *dims)
{
    return ir_leaf(g, op, name, role, e, rank, dims, here);
}

static Node *param(Graph *g, const char *name, int rank, const int64_t *dims)
{
    Node *p = leaf(g, OP_PARAM, name, ROLE_PARAM, FMT_F32, rank, dims);
    IR_IATTR(p, PARAM, decay) = rank >= 2;   /* decay matrices */
    return p;
}

static Node *fin(Graph *g, Node *n)
{
    const char *err = ir_infer_shape(n, g->arena);
    if (err) fail_msg("shape of %s: %s", ir_op_info(n->op)->text, err);
    return n;
}

static Node *op1(Graph *g, OpKind k, Node *a) { return fin(g, ir_add1(g, k, a, here)); }
static Node *op2(Graph *g, OpKind k, Node *a, Node *b) { return fin(g, ir_add2(g, k, a, b, here)); }

static Node *op3(Graph *g, OpKind k, Node *a, Node *b, Node *c, double f0)
{
    Node *in[3] = {a, b, c};
    Node *n = ir_add(g, k, 3, in, here);
    IR_FATTR(n, LAYERNORM, eps) = f0;
    return fin(g, n);
}

static Node *matmul(Graph *g, Node *a, Node *b, int ta, int tb)
{
    Node *n = ir_add2(g, OP_MATMUL, a, b, here);
    IR_IATTR(n, MATMUL, trans_a) = ta;
    IR_IATTR(n, MATMUL, trans_b) = tb;
    return fin(g, n);
}

static Node *slice(Graph *g, Node *a, int axis, int64_t start, int64_t size)
{
    Node *n = ir_add1(g, OP_SLICE, a, here);
    IR_IATTR(n, SLICE, axis) = axis, IR_IATTR(n, SLICE, start) = start, IR_IATTR(n, SLICE, size) = size;
    return fin(g, n);
}

static Node *scale(Graph *g, Node *a, double alpha)
{
    Node *n = ir_add1(g, OP_SCALE, a, here);
    IR_FATTR(n, SCALE, alpha) = alpha;
    return fin(g, n);
}

static Node *reshape(Graph *g, Node *a, int rank, const int64_t *dims)
{
    Node *n = ir_add1(g, OP_RESHAPE, a, here);
    ir_set_shape(n, rank, dims);
    return fin(g, n);
}

static Node *attention(Graph *g, Node *q, Node *k, Node *v, int heads, int kv_heads, double sc)
{
    Node *in[3] = {q, k, v};
    Node *n = ir_add(g, OP_ATTENTION, 3, in, here);
    IR_IATTR(n, ATTENTION, heads) = heads, IR_IATTR(n, ATTENTION, kv_heads) = kv_heads, IR_FATTR(n, ATTENTION, scale) = sc;
    return fin(g, n);
}

static Node *rope(Graph *g, Node *a, int head_dim)
{
    Node *n = ir_add1(g, OP_ROPE, a, here);
    IR_IATTR(n, ROPE, head_dim) = head_dim;
    IR_FATTR(n, ROPE, theta) = 10000.0;
    return fin(g, n);
}

static void set_loss(Node *n)
{
    n->t.name = "loss";
    n->t.role = ROLE_OUTPUT;
}

static Node *linear(Graph *g, Node *x, const char *name, int64_t out, int64_t in, bool bias)
{
    char buf[128];
    snprintf(buf, sizeof buf, "%s.weight", name);
    Node *w = param(g, buf, 2, (int64_t[]){out, in});
    Node *y = matmul(g, x, w, 0, 1);
    if (!bias) return y;
    snprintf(buf, sizeof buf, "%s.bias", name);
    return op2(g, OP_ADD, y, param(g, buf, 1, (int64_t[]){out}));
}

static Node *layernorm(Graph *g, Node *x, const char *name, int64_t c)
{
    char w[128], b[128];
    snprintf(w, sizeof w, "%s.weight", name);
    snprintf(b, sizeof b, "%s.bias", name);
    return op3(g, OP_LAYERNORM, x, param(g, w, 1, &c), param(g, b, 1, &c), 1e-5);
}

/* A GPT-2 shaped training model: token and position embeddings, pre-norm blocks with a fused
 * qkv projection cut by slices, causal attention, GELU MLP, final norm, tied lm head. */
static Graph *build_gpt2(Arena *a, int layers, int64_t B, int64_t T, int64_t C, int heads, int64_t V)
{
    Graph *g = ir_graph_new(a);
    g->model_name = "gpt2-tiny";
    g->batch = B, g->seq = T;
    g->optim = (OptimSpec){.present = true, .lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .clip = 1.0};
    Node *tok = leaf(g, OP_INPUT, "tokens", ROLE_INPUT, FMT_I32, 2, (int64_t[]){B, T});
    Node *tgt = leaf(g, OP_INPUT, "targets", ROLE_INPUT, FMT_I32, 2, (int64_t[]){B, T});
    Node *wte = param(g, "wte.weight", 2, (int64_t[]){V, C});
    Node *wpe = param(g, "wpe.weight", 2, (int64_t[]){2 * T, C});
    Node *x = op2(g, OP_ADD, op2(g, OP_EMBEDDING, wte, tok), slice(g, wpe, 0, 0, T));
    char name[64];
    for (int l = 0; l < layers; l++) {
        snprintf(name, sizeof name, "h.%d.ln_1", l);
        Node *h = layernorm(g, x, name, C);
        snprintf(name, sizeof name, "h.%d.attn.c_attn", l);
        Node *qkv = linear(g, h, name, 3 * C, C, true);
        Node *q = slice(g, qkv, 2, 0, C), *k = slice(g, qkv, 2, C, C), *v = slice(g, qkv, 2, 2 * C, C);
        Node *att = attention(g, q, k, v, heads, heads, 1.0 / sqrt((double)(C / heads)));
        snprintf(name, sizeof name, "h.%d.attn.c_proj", l);
        x = op2(g, OP_ADD, x, linear(g, att, name, C, C, true));
        snprintf(name, sizeof name, "h.%d.ln_2", l);
        h = layernorm(g, x, name, C);
        snprintf(name, sizeof name, "h.%d.mlp.c_fc", l);
        Node *u = op1(g, OP_GELU, linear(g, h, name, 4 * C, C, true));
        snprintf(name, sizeof name, "h.%d.mlp.c_proj", l);
        x = op2(g, OP_ADD, x, linear(g, u, name, C, 4 * C, true));
    }
    Node *hf = layernorm(g, x, "ln_f", C);
    Node *logits = matmul(g, hf, wte, 0, 1);
    set_loss(op2(g, OP_CROSS_ENTROPY, logits, tgt));
    return g;
}

/* ---- running graphs on the reference executor */

static void bind_all(Graph *g)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Tensor *t = &g->nodes[i]->t;
        size_t bytes = (size_t)(ir_numel(t) * fmt_elem_bytes(t->fmt.elem));
        t->data = bytes ? calloc(1, bytes) : NULL;
    }
}

static void unbind_all(Graph *g)
{
    for (int i = 0; i < g->n_nodes; i++) {
        free(g->nodes[i]->t.data);
        g->nodes[i]->t.data = NULL;
    }
}

/* Parameters ~ normal(0, std), float inputs ~ normal(0, 1), integer inputs uniform in [0, limit). */
static void fill_random(Graph *g, double std, int64_t id_limit)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->op != OP_PARAM && n->op != OP_INPUT) continue;
        int64_t count = ir_numel(&n->t);
        float *x = malloc(sizeof(float) * (size_t)count);
        for (int64_t j = 0; j < count; j++) {
            if (!fmt_elem_is_float(n->t.fmt.elem))
                x[j] = (float)(rng_next() % (uint64_t)id_limit);
            else
                x[j] = (float)(rng_normal() * (n->op == OP_PARAM ? std : 1.0));
        }
        ref_store(&n->t, x);
        free(x);
    }
}

static double loss_now(Graph *g, Node *loss)
{
    ref_run_phase(g, PHASE_FORWARD);
    float *l = ref_load(&loss->t);
    double v = l[0];
    free(l);
    return v;
}

/* Differentiates g, runs the backward once, and compares every parameter's gradient with
 * central differences of the loss. Returns the largest normalized error over the parameters
 * and checks that every parameter got a gradient. */
static double gradient_error(Graph *g, double std, int64_t id_limit, double h)
{
    int n_fwd = g->n_nodes;
    assert_true(run_passes(g, "autodiff"));
    bind_all(g);
    fill_random(g, std, id_limit);
    Node *loss = ir_find(g, "loss");
    loss_now(g, loss);
    ref_run_phase(g, PHASE_BACKWARD);

    double worst = 0;
    for (int i = 0; i < n_fwd; i++) {
        Node *p = g->nodes[i];
        if (p->op != OP_PARAM) continue;
        char name[160];
        snprintf(name, sizeof name, "%s.grad", p->t.name);
        Node *d = ir_find(g, name);
        if (!d) fail_msg("parameter %s got no gradient", p->t.name);
        assert_ptr_equal(d->grad_of, p);
        assert_true(ir_same_shape(&d->t, &p->t));
        float *grad = ref_load(&d->t);
        float *w = ref_load(&p->t);
        int64_t count = ir_numel(&p->t);
        double diff2 = 0, ref2 = 0;
        for (int64_t j = 0; j < count; j++) {
            float keep = w[j];
            w[j] = keep + (float)h;
            ref_store(&p->t, w);
            double lp = loss_now(g, loss);
            w[j] = keep - (float)h;
            ref_store(&p->t, w);
            double lm = loss_now(g, loss);
            w[j] = keep;
            ref_store(&p->t, w);
            double fd = (lp - lm) / (2 * h);
            diff2 += (grad[j] - fd) * (grad[j] - fd);
            ref2 += fd * fd;
        }
        /* the floor keeps a parameter whose gradient is ~0 from dividing noise by noise */
        double err = sqrt(diff2) / fmax(sqrt(ref2), 1e-3 * sqrt((double)count));
        if (err > worst) worst = err;
        printf("  %-22s |grad| %.4e  normalized error %.2e\n", p->t.name, sqrt(ref2), err);
        free(grad);
        free(w);
    }
    unbind_all(g);
    return worst;
}

/* ---------------------------------------------------------------- golden files */

static bool golden_one(const char *dir, const char *file, bool update)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    char *text = read_text(path);
    assert_non_null(text);
    char *expect = strstr(text, "\n# EXPECT:\n");
    if (!expect) {
        fprintf(stderr, "%s: no '# EXPECT:' line\n", path);
        free(text);
        return false;
    }
    expect[1] = 0;   /* text is now the input part, ending in a newline */
    const char *expected = expect + strlen("\n# EXPECT:\n");
    const char *run = strstr(text, "# RUN:");
    if (!run) {
        fprintf(stderr, "%s: no '# RUN:' line\n", path);
        free(text);
        return false;
    }
    char passes[256];
    size_t len = strcspn(run + 6, "\n");
    snprintf(passes, sizeof passes, "%.*s", (int)len, run + 6);

    char rules[512] = "";
    const char *rl = strstr(text, "# RULES:");
    if (rl) snprintf(rules, sizeof rules, "%.*s", (int)strcspn(rl + 8, "\n"), rl + 8);

    Arena *a = arena_new();
    Graph *g = ir_read(a, file, text);
    bool ok = g != NULL;
    char *got = NULL;
    if (!ok) fprintf(stderr, "%s: the input does not read\n", path);
    if (ok && !run_passes_with(g, passes, rl ? rules : NULL)) {
        fprintf(stderr, "%s: a pass failed\n", path);
        ok = false;
    }
    if (ok) got = print_to_string(g);
    if (ok && update) {
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        fprintf(f, "%s# EXPECT:\n%s", text, got);
        fclose(f);
    } else if (ok && strcmp(got, expected) != 0) {
        const char *x = got, *y = expected, *xl = got, *yl = expected;
        int line = 1;
        for (; *x && *x == *y; x++, y++)
            if (*x == '\n') line++, xl = x + 1, yl = y + 1;
        fprintf(stderr, "%s: output line %d differs from the expected one\n  got:      %.*s\n  expected: %.*s\n",
                path, line, (int)strcspn(xl, "\n"), xl, (int)strcspn(yl, "\n"), yl);
        fprintf(stderr, "--- full output ---\n%s", got);
        ok = false;
    }
    free(got);
    arena_free(a);
    free(text);
    return ok;
}

static int compare_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void test_golden(void **state)
{
    (void)state;
    const char *dir = FP8C_SOURCE_DIR "/tests/golden/passes";
    bool update = getenv("FP8C_UPDATE_GOLDEN") && strcmp(getenv("FP8C_UPDATE_GOLDEN"), "1") == 0;
    DIR *d = opendir(dir);
    assert_non_null(d);
    char *names[256];
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        size_t len = strlen(e->d_name);
        if (len > 3 && strcmp(e->d_name + len - 3, ".ir") == 0 && n < 256) names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, compare_names);
    int failed = 0;
    for (int i = 0; i < n; i++) {
        bool ok = golden_one(dir, names[i], update);
        printf("  %-28s %s\n", names[i], ok ? (update ? "updated" : "ok") : "FAILED");
        failed += !ok;
        free(names[i]);
    }
    assert_true(n >= 9);
    assert_int_equal(failed, 0);
}

/* ---------------------------------------------------------------- registry */

static void test_registry(void **state)
{
    (void)state;
    int count = 0;
    const PassInfo *t = pass_table(&count);
    assert_true(count >= 7);
    for (int i = 0; i < count; i++) assert_ptr_equal(pass_find(t[i].name), &t[i]);
    assert_null(pass_find("no-such-pass"));
    assert_string_equal(pass_find("memplan")->requires, "schedule");

    /* --print-ir-after: the IR goes to stdout after a header naming the pass */
    Arena *a = arena_new();
    Graph *g = build_gpt2(a, 1, 1, 4, 8, 2, 16);
    fflush(stdout);
    char tmpl[] = "/tmp/fp8c_passes_XXXXXX";
    int fd = mkstemp(tmpl);
    assert_true(fd >= 0);
    int saved = dup(1);
    dup2(fd, 1);
    PassOptions opt = {.verify = true, .print_after = "autodiff"};
    bool ok1 = pass_run(g, pass_find("autodiff"), &opt);
    bool ok2 = pass_run(g, pass_find("optimizer"), &opt);
    opt.print_after = "all";
    bool ok3 = pass_run(g, pass_find("dce"), &opt);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    close(fd);
    char *out = read_text(tmpl);
    unlink(tmpl);
    assert_true(ok1 && ok2 && ok3);
    assert_non_null(out);
    assert_true(strncmp(out, "# IR after autodiff\n# fp8c ir\n", 30) == 0);
    assert_null(strstr(out, "# IR after optimizer"));
    assert_non_null(strstr(out, "# IR after dce\n"));
    assert_non_null(strstr(out, "name=\"wte.weight.grad\""));
    free(out);
    arena_free(a);
}

static char *capture_errors(Graph *g, const char *passes, bool *ok)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    diag_set_stream(f);
    int before = diag_error_count();
    *ok = run_passes(g, passes);
    fclose(f);
    diag_set_stream(NULL);
    assert_true(*ok || diag_error_count() > before);
    return buf;
}

static void test_user_errors(void **state)
{
    (void)state;
    Arena *a = arena_new();
    bool ok;

    Graph *g = build_gpt2(a, 1, 1, 4, 8, 2, 16);
    g->optim.present = false;
    char *msg = capture_errors(g, "autodiff,optimizer", &ok);
    assert_false(ok);
    assert_non_null(strstr(msg, "error: the model has no optimizer clause"));
    free(msg);

    g = ir_graph_new(a);
    Node *w = param(g, "w", 1, (int64_t[]){4});
    op1(g, OP_GELU, w);
    msg = capture_errors(g, "autodiff", &ok);
    assert_false(ok);
    assert_non_null(strstr(msg, "'loss'"));
    free(msg);

    g = ir_graph_new(a);
    w = param(g, "w", 1, (int64_t[]){4});
    set_loss(op1(g, OP_GELU, w));
    msg = capture_errors(g, "autodiff", &ok);
    assert_false(ok);
    assert_non_null(strstr(msg, "test.model:1:1: error: the loss must be a scalar"));
    free(msg);

    g = ir_graph_new(a);
    w = param(g, "w", 1, (int64_t[]){4});
    Node *x = leaf(g, OP_INPUT, "x", ROLE_INPUT, FMT_F32, 1, (int64_t[]){4});
    set_loss(op1(g, OP_SQNORM, op2(g, OP_GELU_BWD, x, w)));
    msg = capture_errors(g, "autodiff", &ok);
    assert_false(ok);
    assert_non_null(strstr(msg, "cannot differentiate 'gelu_bwd'"));
    free(msg);
    arena_free(a);
}

/* ---------------------------------------------------------------- autodiff vs differences */

static void test_autodiff_mlp_finite_differences(void **state)
{
    (void)state;
    seed_rng();
    Arena *a = arena_new();
    Graph *g = ir_graph_new(a);
    Node *x = leaf(g, OP_INPUT, "x", ROLE_INPUT, FMT_F32, 2, (int64_t[]){6, 5});
    Node *t = leaf(g, OP_INPUT, "targets", ROLE_INPUT, FMT_I32, 1, (int64_t[]){6});
    Node *h = op1(g, OP_GELU, linear(g, x, "fc1", 7, 5, true));
    Node *logits = linear(g, h, "fc2", 4, 7, true);
    set_loss(op2(g, OP_CROSS_ENTROPY, logits, t));
    double err = gradient_error(g, 0.7, 4, 2e-3);
    printf("  tiny MLP: worst normalized error %.2e (tolerance 1e-2)\n", err);
    assert_true(err < 1e-2);
    arena_free(a);
}

/* A small transformer block: embedding + (T,C) positions, layernorm, fused q|k|v with
 * grouped-query heads and rope, attention, residuals, rmsnorm, a gated SiLU MLP whose two
 * halves are slices of one projection, tied lm head. */
static void test_autodiff_block_finite_differences(void **state)
{
    (void)state;
    seed_rng();
    Arena *a = arena_new();
    Graph *g = ir_graph_new(a);
    const int64_t B = 2, T = 4, C = 8, V = 11, D = 4;   /* heads 2, kv_heads 1 */
    Node *tok = leaf(g, OP_INPUT, "tokens", ROLE_INPUT, FMT_I32, 2, (int64_t[]){B, T});
    Node *tgt = leaf(g, OP_INPUT, "targets", ROLE_INPUT, FMT_I32, 2, (int64_t[]){B, T});
    Node *wte = param(g, "wte", 2, (int64_t[]){V, C});
    Node *wpe = param(g, "wpe", 2, (int64_t[]){T, C});
    Node *x = op2(g, OP_ADD, op2(g, OP_EMBEDDING, wte, tok), wpe);
    Node *h = layernorm(g, x, "ln", C);
    Node *qkv = linear(g, h, "qkv", C + 2 * D, C, false);
    Node *q = rope(g, slice(g, qkv, 2, 0, C), D);
    Node *k = rope(g, slice(g, qkv, 2, C, D), D);
    Node *v = slice(g, qkv, 2, C + D, D);
    Node *att = attention(g, q, k, v, 2, 1, 0.5);
    x = op2(g, OP_ADD, x, linear(g, att, "proj", C, C, true));
    Node *r = op2(g, OP_RMSNORM, x, param(g, "rms", 1, (int64_t[]){C}));
    IR_FATTR(r, RMSNORM, eps) = 1e-6;
    Node *u = linear(g, r, "up", 2 * C, C, false);
    Node *gate = op2(g, OP_MUL, op1(g, OP_SILU, slice(g, u, 2, 0, C)), slice(g, u, 2, C, C));
    Node *down = matmul(g, gate, param(g, "down", 2, (int64_t[]){C, C}), 0, 0);
    x = op2(g, OP_ADD, x, down);
    set_loss(op2(g, OP_CROSS_ENTROPY, matmul(g, x, wte, 0, 1), tgt));
    /* h = 1e-2: the loss is stored as f32, and its rounding (about 1e-7 of 2.4) over 2h is
     * noise of 5e-5 in each difference, 2% of the small gated-MLP gradients at h = 2e-3 (two
     * seeds in two hundred passed 1e-2); at 1e-2 two hundred seeds stay under 2.4e-3 and the
     * differences' own error (h^2) is far below that */
    double err = gradient_error(g, 0.5, V, 1e-2);
    printf("  transformer block: worst normalized error %.2e (tolerance 1e-2)\n", err);
    assert_true(err < 1e-2);
    arena_free(a);
}

/* Attention on one packed q|k|v operand (grouped-query: 2 heads, 1 kv head): its gradient is
 * attention_bwd's packed result itself. */
static void test_autodiff_packed_attention_finite_differences(void **state)
{
    (void)state;
    seed_rng();
    Arena *a = arena_new();
    Graph *g = ir_graph_new(a);
    const int64_t B = 2, T = 5, C = 8, D = 4;
    Node *x = leaf(g, OP_INPUT, "x", ROLE_INPUT, FMT_F32, 3, (int64_t[]){B, T, C});
    Node *tgt = leaf(g, OP_INPUT, "targets", ROLE_INPUT, FMT_I32, 2, (int64_t[]){B, T});
    Node *qkv = linear(g, x, "qkv", C + 2 * D, C, true);
    Node *att = ir_add1(g, OP_ATTENTION, qkv, here);
    IR_IATTR(att, ATTENTION, heads) = 2, IR_IATTR(att, ATTENTION, kv_heads) = 1, IR_FATTR(att, ATTENTION, scale) = 0.5;
    fin(g, att);
    set_loss(op2(g, OP_CROSS_ENTROPY, linear(g, att, "head", 6, C, false), tgt));
    double err = gradient_error(g, 0.5, 6, 2e-3);
    printf("  packed attention: worst normalized error %.2e (tolerance 1e-2)\n", err);
    assert_true(err < 1e-2);
    Node *bwd = NULL;
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_ATTENTION_BWD) bwd = g->nodes[i];
    assert_non_null(bwd);
    assert_int_equal(bwd->n_in, 2);
    arena_free(a);
}

/* The other rules: (T,C) and scalar broadcasting in mul/sub, softmax, reshape, concat, cast,
 * matmul with every transpose combination, overlapping slices (pads), pad, sum_rows,
 * add_n, scale and sqnorm. */
static void test_autodiff_ops_finite_differences(void **state)
{
    (void)state;
    seed_rng();
    Arena *a = arena_new();
    Graph *g = ir_graph_new(a);
    Node *x = leaf(g, OP_INPUT, "x", ROLE_INPUT, FMT_F32, 3, (int64_t[]){2, 3, 4});
    Node *p1 = param(g, "p1", 2, (int64_t[]){3, 4});
    Node *s = param(g, "s", 0, NULL);
    Node *y = op2(g, OP_SUB, op2(g, OP_MUL, x, p1), s);
    y = op2(g, OP_MUL, op1(g, OP_SOFTMAX, y), s);
    Node *r = reshape(g, y, 2, (int64_t[]){6, 4});
    Node *z = matmul(g, r, param(g, "p2", 2, (int64_t[]){4, 5}), 0, 0);          /* (6, 5) */
    Node *cin[2] = {z, op1(g, OP_CAST, scale(g, z, -0.5))};
    Node *c = ir_add(g, OP_CONCAT, 2, cin, here);
    IR_IATTR(c, CONCAT, axis) = 1;
    fin(g, c);                                                                    /* (6, 10) */
    Node *w = matmul(g, c, param(g, "p3", 2, (int64_t[]){6, 3}), 1, 0);          /* (10, 3) */
    Node *ww = matmul(g, param(g, "p4", 2, (int64_t[]){3, 7}), w, 1, 1);         /* (7, 10) */
    Node *v = matmul(g, ww, param(g, "p5", 2, (int64_t[]){2, 10}), 0, 1);       /* (7, 2) */
    Node *pad = ir_add1(g, OP_PAD, v, here);
    IR_IATTR(pad, PAD, axis) = 0, IR_IATTR(pad, PAD, start) = 1, IR_IATTR(pad, PAD, size) = 9;
    fin(g, pad);                                                                  /* (9, 2) */
    Node *o1 = slice(g, ww, 1, 0, 6), *o2 = slice(g, ww, 1, 4, 6);               /* overlap */
    Node *sr = op1(g, OP_SUM_ROWS, op2(g, OP_MUL, o1, o2));                       /* (6) */
    Node *parts[3] = {op1(g, OP_SQNORM, pad), op1(g, OP_SQNORM, sr), op1(g, OP_SQNORM, v)};
    Node *sum = fin(g, ir_add(g, OP_ADD_N, 3, parts, here));
    set_loss(scale(g, sum, 0.25));
    double err = gradient_error(g, 0.5, 1, 2e-3);
    printf("  op zoo: worst normalized error %.2e (tolerance 1e-2)\n", err);
    assert_true(err < 1e-2);
    arena_free(a);
}

/* ---------------------------------------------------------------- memory and order */

static int64_t aligned(int64_t x) { return (x + 255) / 256 * 256; }

static Node *root_of(Node *n)
{
    Node *a;
    while ((a = memplan_alias_of(n))) n = a;
    return n;
}

/* Lifetimes as memplan defines them, recomputed here: from the defining step (inputs: 0) to
 * the last reader of any value sharing the storage (outputs: the end). */
static void lifetimes(const Graph *g, int *first, int *last)
{
    int n = g->n_nodes;
    for (int i = 0; i < n; i++) {
        first[i] = g->nodes[i]->op == OP_INPUT ? 0 : i;
        last[i] = i;
    }
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        int r = root_of(v)->index;
        if (first[i] < first[r]) first[r] = first[i];
        if (i > last[r]) last[r] = i;
        if (v->t.role == ROLE_OUTPUT) last[r] = n - 1;
        for (int j = 0; j < v->n_in; j++) {
            int x = root_of(v->in[j])->index;
            if (i > last[x]) last[x] = i;
        }
    }
    /* a copy that may rerun its producer reads the producer's inputs (memplan.c) */
    Uses *uses = ir_fill_uses((Graph *)g);
    for (int i = 0; i < n; i++) {
        const Node *q = g->nodes[i];
        if (!ir_quantize_may_rerun_producer(q, uses)) continue;
        for (int k = 0; k < q->in[0]->n_in; k++) {
            int x = root_of(q->in[0]->in[k])->index;
            if (i > last[x]) last[x] = i;
        }
    }
    /* a forward copy's transposed copy, made in the forward, is born with the copy (the GPU
     * writes both in the copy's launch: passes/layout.c, memplan.c) */
    for (int i = 0; i < n; i++) {
        const Node *t = g->nodes[i], *x = t->n_in ? t->in[0] : NULL;
        if (t->op != OP_TRANSPOSE || t->phase != PHASE_FORWARD || x->op != OP_QUANTIZE || x->phase != PHASE_FORWARD)
            continue;
        int r = root_of((Node *)t)->index;
        if (x->index < first[r]) first[r] = x->index;
    }
    /* a scaled tensor's scale and amax tensors are read and written with it */
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        Node *refs[2] = {v->t.fmt.scale, v->t.fmt.amax};
        int r = root_of(v)->index;
        for (int k = 0; k < 2; k++) {
            if (!refs[k]) continue;
            int x = root_of(refs[k])->index;
            if (first[r] < first[x]) first[x] = first[r];
            if (last[r] > last[x]) last[x] = last[r];
        }
    }
}

static bool in_step_arena(const Node *v)
{
    return !memplan_alias_of(v) && !ir_role_is_persistent(v->t.role) &&
           ir_numel(&v->t) * fmt_elem_bytes(v->t.fmt.elem) > 0;
}

/* The largest sum of live step-arena bytes over the order: a lower bound of any packing. */
static int64_t live_peak(const Graph *g)
{
    int n = g->n_nodes;
    int *first = malloc(sizeof(int) * (size_t)n), *last = malloc(sizeof(int) * (size_t)n);
    lifetimes(g, first, last);
    int64_t peak = 0;
    for (int t = 0; t < n; t++) {
        int64_t live = 0;
        for (int i = 0; i < n; i++)
            if (in_step_arena(g->nodes[i]) && first[i] <= t && t <= last[i])
                live += ir_numel(&g->nodes[i]->t) * fmt_elem_bytes(g->nodes[i]->t.fmt.elem);
        if (live > peak) peak = live;
    }
    free(first);
    free(last);
    return peak;
}

static void check_schedule(const Graph *g)
{
    bool leaves_done = false, updating = false;
    Uses *uses = ir_fill_uses(g);
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *v = g->nodes[i];
        assert_int_equal(v->index, i);
        for (int j = 0; j < v->n_in; j++) assert_true(v->in[j]->index < i);
        bool is_leaf = v->op == OP_INPUT || v->op == OP_PARAM || v->op == OP_STATE || v->op == OP_CONST;
        if (is_leaf) {
            assert_false(leaves_done);
            continue;
        }
        leaves_done = true;
        /* forward and backward may interleave; the update comes after both */
        if (v->phase == PHASE_UPDATE) updating = true;
        else assert_false(updating);
        if (!ir_op_is_inplace(v->op)) continue;
        for (int j = 0; j < v->n_in; j++) {
            if (!ir_mutates_input(v, j)) continue;
            /* every other reader of the overwritten value, or of a view of it, comes first */
            const Node *x = v->in[j];
            const Uses *u = &uses[x->index];
            for (int k = 0; k < u->n; k++) {
                const Node *r = u->list[k];
                if (r != v) assert_true(r->index < i);
                if (r->op == OP_RESHAPE && memplan_alias_of(r) == x) {
                    const Uses *ru = &uses[r->index];
                    for (int m = 0; m < ru->n; m++) assert_true(ru->list[m]->index < i);
                }
            }
        }
    }
    assert_int_equal(ir_verify(g, "test"), 0);
}

static void check_memplan(const Graph *g)
{
    int n = g->n_nodes;
    int *first = malloc(sizeof(int) * (size_t)n), *last = malloc(sizeof(int) * (size_t)n);
    lifetimes(g, first, last);
    int64_t sum = 0, checked = 0;
    for (int i = 0; i < n; i++) {
        const Node *v = g->nodes[i];
        /* numel x element size; an attention that keeps its logsumexp stores it after y, a
         * value with amax=1 the 1024 block maxima of its producer after 256-byte alignment */
        int64_t bytes = ir_numel(&v->t) * fmt_elem_bytes(v->t.fmt.elem);
        if (v->op == OP_ATTENTION && IR_IATTR(v, ATTENTION, lse))
            bytes = (bytes + 15) / 16 * 16 + v->t.dims[0] * IR_IATTR(v, ATTENTION, heads) * v->t.dims[1] * 4;
        if (ir_keeps_amax(v)) bytes = (bytes + 255) / 256 * 256 + 1024 * 4;
        /* a quantize that keeps its transposed copy: twice the bytes, the copy 256-aligned */
        if (v->op == OP_QUANTIZE && IR_IATTR(v, QUANTIZE, transposed)) bytes = (bytes + 255) / 256 * 256 + bytes;
        assert_int_equal(v->t.bytes, bytes);
        if (memplan_alias_of(v)) {
            assert_int_equal(v->t.offset, root_of((Node *)v)->t.offset);
            continue;
        }
        if (bytes == 0) continue;
        assert_true(v->t.offset >= 0);
        assert_int_equal(v->t.offset % 256, 0);
        bool pers = ir_role_is_persistent(v->t.role);
        assert_true(v->t.offset + bytes <= (pers ? g->persistent_bytes : g->transient_bytes));
        if (!pers) sum += aligned(bytes);
        for (int j = 0; j < i; j++) {
            const Node *w = g->nodes[j];
            int64_t wb = ir_numel(&w->t) * fmt_elem_bytes(w->t.fmt.elem);
            if (memplan_alias_of(w) || wb == 0 || ir_role_is_persistent(w->t.role) != pers) continue;
            bool overlap_time = pers || (first[i] <= last[j] && first[j] <= last[i]);
            if (!overlap_time) continue;
            bool overlap_mem = v->t.offset < w->t.offset + wb && w->t.offset < v->t.offset + bytes;
            if (overlap_mem)
                fail_msg("%%%d [%lld,+%lld) live %d..%d overlaps %%%d [%lld,+%lld) live %d..%d", v->id,
                         (long long)v->t.offset, (long long)bytes, first[i], last[i], w->id,
                         (long long)w->t.offset, (long long)wb, first[j], last[j]);
            checked++;
        }
    }
    assert_true(checked > 0);
    assert_true(g->transient_bytes <= sum);
    assert_true(g->transient_bytes >= live_peak(g));
    MemSummary m;
    memplan_summarize(g, &m);
    assert_int_equal(m.persistent, g->persistent_bytes);
    assert_int_equal(m.transient, g->transient_bytes);
    int64_t total_pers = 0;
    for (int r = 0; r < ROLE_COUNT; r++)
        if (ir_role_is_persistent((Role)r)) total_pers += m.by_role[r];
    assert_true(total_pers <= m.persistent);
    free(first);
    free(last);
}

static void test_memplan_gpt2(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = build_gpt2(a, 2, 2, 16, 32, 4, 64);
    assert_true(run_passes(g, "autodiff,optimizer,dce"));
    int64_t before = live_peak(g);
    assert_true(run_passes(g, "schedule"));
    check_schedule(g);
    int64_t after = live_peak(g);
    assert_true(run_passes(g, "memplan"));
    check_memplan(g);
    MemSummary m;
    memplan_summarize(g, &m);
    printf("  gpt2-tiny: %d nodes, %lld params, persistent %lld B, step arena %lld B, live peak %lld B "
           "(input order %lld B)\n",
           g->n_nodes, (long long)m.n_params, (long long)g->persistent_bytes,
           (long long)g->transient_bytes, (long long)after, (long long)before);
    assert_true(after <= before);
    /* without the precision pass, the accumulator, Adam m and v of every parameter are f32 */
    assert_int_equal(m.by_role[ROLE_GRAD], 4 * m.n_params);
    assert_int_equal(m.by_role[ROLE_ADAM_M], 4 * m.n_params);
    assert_int_equal(m.by_role[ROLE_ADAM_V], 4 * m.n_params);
    arena_free(a);
}

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The whole pipeline's work follows the graph, not the batch: GPT-2 at batch 8388608 x 1 (a
 * 2.7 TB step, whose loss once split into 6,283 chunks and 80,000 nodes and took minutes to
 * schedule and plan) has at most 256 loss chunks more than at 32 x 1024 and plans in seconds;
 * a 96-layer GPT-2 plans in seconds too. Both plans keep the schedule's and memplan's rules. */
static void test_plan_time_follows_the_graph(void **state)
{
    (void)state;
    struct { int64_t batch, seq; const char *layers; double limit; } cases[] = {
        {32, 1024, NULL, 30}, {8388608, 1, NULL, 30}, {4, 64, "96", 30},
    };
    int n_nodes[3];
    for (int k = 0; k < 3; k++) {
        Arena *a = arena_new();
        Define d = {"layers", cases[k].layers};
        BuildOptions o = {0};
        o.front.batch = cases[k].batch, o.front.seq = cases[k].seq;
        o.front.defines = &d, o.front.n_defines = cases[k].layers ? 1 : 0;
        o.passes.opt_level = 1;
        double t0 = seconds_now();
        Graph *g = pipeline_compile(a, FP8C_SOURCE_DIR "/models/gpt2.model", &o);
        double t = seconds_now() - t0;
        assert_non_null(g);
        n_nodes[k] = g->n_nodes;
        printf("  gpt2%s%s at %lld x %lld: %d nodes, planned in %.2f s\n", cases[k].layers ? " layers=" : "",
               cases[k].layers ? cases[k].layers : "", (long long)cases[k].batch, (long long)cases[k].seq,
               g->n_nodes, t);
        assert_true(t < cases[k].limit);
        check_schedule(g);
        if (k == 1) check_memplan(g);
        arena_free(a);
    }
    assert_true(n_nodes[1] <= n_nodes[0] + 256 * 16);
}

/* model compiled at `level` for batch x seq with the choices given (none where n is 0), checked
 * after every pass where `verify`; NULL where the compiler refuses it */
static Graph *compile_with(Arena *a, const char *model, int level, int64_t batch, int64_t seq, const Choice *choices,
                           int n, bool verify)
{
    BuildOptions o = {0};
    o.front.batch = batch, o.front.seq = seq;
    o.passes.opt_level = level;
    o.passes.verify = verify;
    o.choices = n ? choices : NULL, o.n_choices = n;
    return pipeline_compile(a, model, &o);
}

/* The loss's chunk count follows the choice table's loss.chunks (a tuning record's winner)
 * when it is set, else the 400 MiB rule: GPT-2 at 8 x 1024 has 2 chunks by the rule (8192 rows
 * of 50304 logits in bf16 are 824 MB), 1 leaves the head whole, 5 gives five chunks whose rows
 * add up to the batch's. */
static void test_chunk_loss_follows_the_choice(void **state)
{
    (void)state;
    const char *values[] = {NULL, "1", "5"};
    int64_t want[] = {2, 1, 5};
    for (int k = 0; k < 3; k++) {
        Arena *a = arena_new();
        Choice c = {"loss.chunks", values[k]};
        Graph *g = compile_with(a, FP8C_SOURCE_DIR "/models/gpt2.model", 1, 8, 1024, &c, values[k] ? 1 : 0, false);
        assert_non_null(g);
        int64_t chunks = 0, rows = 0;
        for (int i = 0; i < g->n_nodes; i++)
            if (g->nodes[i]->op == OP_CROSS_ENTROPY) {
                chunks++;
                const Tensor *logits = &g->nodes[i]->in[0]->t;
                rows += ir_numel(logits) / logits->dims[logits->rank - 1];
            }
        printf("  loss.chunks=%s: %lld chunks\n", values[k] ? values[k] : "(rule)", (long long)chunks);
        assert_int_equal(chunks, want[k]);
        assert_int_equal(rows, 8 * 1024);
        if (values[k]) assert_string_equal(ir_choice(g, "loss.chunks"), values[k]);
        arena_free(a);
    }
}

/* save.attention_y overrides the level's keeping of attention's output: at -O2 and -O3 (which
 * keep it) 0 makes each attention backward rerun the forward instead of reading y and the
 * forward's logsumexp; at -O1, where y is kept anyway, 0 is refused. */
static void test_attention_y_follows_the_choice(void **state)
{
    (void)state;
    const struct { int level; const char *value; int reads_y; } cases[] = {
        {3, NULL, 1}, {3, "0", 0}, {2, NULL, 1}, {2, "0", 0}, {1, "1", 1}, {1, "0", -1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        Arena *a = arena_new();
        Choice c = {"save.attention_y", cases[k].value};
        int errors = diag_error_count();
        Graph *g = compile_with(a, FP8C_SOURCE_DIR "/models/gpt2_tiny.model", cases[k].level, 2, 32, &c,
                                cases[k].value ? 1 : 0, false);
        if (cases[k].reads_y < 0) {
            assert_null(g);
            assert_int_equal(diag_error_count(), errors + 1);
            arena_free(a);
            continue;
        }
        assert_non_null(g);
        int bwd = 0, reading = 0;
        for (int i = 0; i < g->n_nodes; i++)
            if (g->nodes[i]->op == OP_ATTENTION_BWD) bwd++, reading += ir_attention_bwd_reads_y(g->nodes[i]);
        printf("  -O%d save.attention_y=%s: %d of %d attention backwards read y\n", cases[k].level,
               cases[k].value ? cases[k].value : "(level)", reading, bwd);
        assert_true(bwd > 0);
        assert_int_equal(reading, cases[k].reads_y ? bwd : 0);
        arena_free(a);
    }
}

/* A forward copy that the backward reads only transposed is saved as its transposed copy, made
 * right after it in the forward, whose bytes the memory plan keeps from the copy's place on
 * (check_memplan's lifetimes hold it to that): GPT-2 d12 at batch 32 x 1024 -O3 with the loss
 * in 25 chunks, a plan where the transposed copy of one GELU would otherwise take bytes that
 * are still live at the copy, where the GPU writes both. Each layer's second layernorm and GELU
 * are saved so; the first layernorm's copy the backward also reads as it is, to make q, k, v
 * again. */
static void test_transposed_copies_born_with_their_copy(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Choice c = {"loss.chunks", "25"};
    Graph *g = compile_with(a, FP8C_SOURCE_DIR "/models/gpt2.model", 3, 32, 1024, &c, 1, true);
    assert_non_null(g);
    check_memplan(g);
    int early = 0;
    for (int i = 0; i < g->n_nodes; i++)
        early += g->nodes[i]->op == OP_TRANSPOSE && g->nodes[i]->phase == PHASE_FORWARD;
    printf("  gpt2 d12 -O3, 25 loss chunks: %d copies saved transposed\n", early);
    assert_int_equal(early, 12 * 2);
    arena_free(a);
}

/* save.attention_inputs=0 (passes/recompute.c): attention's backward reads copies of q, k, v
 * made in the backward, each placed (passes/schedule.c) after the other operands of its reader
 * exist, so that the copies live only around it: no forward value is read by an attention
 * backward any more, nothing new is saved, and the peak goes down. Llama 1.1B at batch 4 x
 * 2048 -O0 (its five projection nodes a layer: q and k with RoPE, v) and GPT-2 d12 at batch 32
 * -O3 (packed q|k|v with its bias), where the copies also keep the forward's logsumexp in use
 * at -O1 (the backward's statistics match the forward's: the same values). */
static void recompute_attention_inputs_case(const char *model, int level, int batch, int seq, int want_copies,
                                            int64_t want_saved_less)
{
    int64_t peak[2];
    for (int v = 0; v < 2; v++) {
        Arena *a = arena_new();
        /* the cheap values saved (-O0 makes them again by default): only q, k, v copied */
        Choice c[2] = {{"save.attention_inputs", v ? "0" : "1"}, {"save.cheap", "1"}};
        Graph *g = compile_with(a, model, level, batch, seq, c, 2, true);
        assert_non_null(g);
        int copies = 0, bwd = 0, reads_y = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *n = g->nodes[i];
            copies += ir_is_recomputed(n);
            if (n->op != OP_ATTENTION_BWD) continue;
            bwd++;
            reads_y += ir_attention_bwd_reads_y(n);
            int qkv = n->n_in - 1 - ir_attention_bwd_reads_y(n);
            for (int k = 1; k <= qkv; k++) {
                const Node *x = n->in[k];
                while (x->op == OP_RESHAPE || x->op == OP_SLICE) x = x->in[0];
                if (v) assert_true(ir_is_recomputed(x));
                else assert_int_equal(x->phase, PHASE_FORWARD);
            }
        }
        assert_int_equal(copies, v ? want_copies : 0);
        if (level == 1) assert_int_equal(reads_y, bwd);   /* the forward's lse, with copies too */
        peak[v] = g->persistent_bytes + live_peak(g);
        arena_free(a);
    }
    printf("  %s -O%d: peak %.2f GiB saved, %.2f GiB recomputed\n", strrchr(model, '/') + 1, level,
           peak[0] / 1073741824.0, peak[1] / 1073741824.0);
    assert_true(peak[1] < peak[0] - want_saved_less);
}

static void test_recompute_attention_inputs(void **state)
{
    (void)state;
    recompute_attention_inputs_case(FP8C_SOURCE_DIR "/models/llama.model", 0, 4, 2048, 22 * 5, 1 << 29);
    recompute_attention_inputs_case(FP8C_SOURCE_DIR "/models/gpt2.model", 3, 32, 1024, 12 * 2, 1 << 30);
    recompute_attention_inputs_case(FP8C_SOURCE_DIR "/models/gpt2.model", 1, 32, 1024, 12 * 2, 1 << 30);
}

/* save.cheap=0 (passes/recompute.c): no cheap producer (elementwise op or norm) is read by the
 * backward any more, each has a copy in the backward that those readers read, nothing new is
 * saved, and the step's peak goes down. Llama 1.1B at batch 4 x 2048, -O0: 30.76 GiB of plan
 * with them saved (above PyTorch's measured 26.32), 25.85 recomputed. */
static void test_recompute_cheap_producers(void **state)
{
    (void)state;
    int64_t peak[2];
    int copies = 0, saved[2] = {0, 0};
    for (int v = 0; v < 2; v++) {
        Arena *a = arena_new();
        Choice c = {"save.cheap", v ? "0" : "1"};
        Graph *g = compile_with(a, FP8C_SOURCE_DIR "/models/llama.model", 0, 4, 2048, &c, 1, true);
        assert_non_null(g);
        Uses *uses = ir_fill_uses(g);
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *n = g->nodes[i];
            bool cheap = n->op == OP_SILU || n->op == OP_MUL || n->op == OP_RMSNORM;
            saved[v] += n->t.role == ROLE_SAVED;
            if (!cheap) continue;
            bool read_back = false;
            for (int k = 0; k < uses[i].n; k++) read_back |= uses[i].list[k]->phase != PHASE_FORWARD;
            if (n->phase == PHASE_FORWARD && v) assert_false(read_back);
            if (n->phase != PHASE_FORWARD && n->t.role == ROLE_ACTIVATION) {   /* a copy */
                assert_true(v);
                copies++;
                assert_non_null(strstr(n->t.name ? n->t.name : ":recomputed", ":recomputed"));
            }
        }
        peak[v] = g->persistent_bytes + live_peak(g);
        arena_free(a);
    }
    printf("  llama -O0: peak %.2f GiB saved, %.2f GiB recomputed; %d copies; %d saved values -> %d\n",
           peak[0] / 1073741824.0, peak[1] / 1073741824.0, copies, saved[0], saved[1]);
    assert_int_equal(copies, 22 * 4);   /* per layer two norms, silu(gate) and the product */
    assert_true(saved[1] < saved[0]);
    assert_true(peak[1] < peak[0] - 4 * (int64_t)1073741824);
}

/* save.activations=0 (passes/recompute.c; the default at -O2 and -O3): SwiGLU's silu(gate),
 * read by the backward only in dy * silu(gate), is not saved: that product reads a copy made
 * in the backward from gate's saved FP8 copy, the forward SiLU is read by the forward product
 * alone, and one saved FP8 copy a layer (and its scales) goes. Llama 1.1B at batch 4 x 2048,
 * -O3; GPT-2 d12, whose GELU the backward reads in a GEMM, keeps the same graph. */
static int activation_copies(const Graph *g, int64_t *saved_bytes)
{
    Uses *uses = ir_fill_uses(g);
    int copies = 0;
    *saved_bytes = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->t.role == ROLE_SAVED) *saved_bytes += n->t.bytes;
        if (n->op != OP_SILU && n->op != OP_GELU) continue;
        if (n->phase != PHASE_FORWARD) {
            assert_true(ir_is_recomputed(n));
            /* its input: the saved FP8 copy of the forward activation's input */
            assert_int_equal(n->in[0]->t.role, ROLE_SAVED);
            assert_int_equal(n->in[0]->t.fmt.scaling, SCALE_PER_GROUP);
            for (int k = 0; k < uses[i].n; k++) assert_int_equal(uses[i].list[k]->op, OP_MUL);
            copies++;
        }
    }
    return copies;
}

static void test_recompute_activations(void **state)
{
    (void)state;
    int64_t saved[2], peak[2];
    int copies[2];
    for (int v = 0; v < 2; v++) {
        Arena *a = arena_new();
        Choice c = {"save.activations", v ? "0" : "1"};
        Graph *g = compile_with(a, FP8C_SOURCE_DIR "/models/llama.model", 3, 4, 2048, &c, 1, true);
        assert_non_null(g);
        copies[v] = activation_copies(g, &saved[v]);
        peak[v] = g->persistent_bytes + live_peak(g);
        /* the forward SiLU: read by its product alone once it is made again */
        Uses *uses = ir_fill_uses(g);
        for (int i = 0; i < g->n_nodes; i++)
            if (g->nodes[i]->op == OP_SILU && g->nodes[i]->phase == PHASE_FORWARD && v)
                assert_int_equal(uses[i].n, 1);
        arena_free(a);
    }
    printf("  llama -O3: %d activations made again; saved %.2f -> %.2f GiB, peak %.2f -> %.2f GiB\n", copies[1],
           saved[0] / 1073741824.0, saved[1] / 1073741824.0, peak[0] / 1073741824.0, peak[1] / 1073741824.0);
    assert_int_equal(copies[0], 0);
    assert_int_equal(copies[1], 22);
    /* per layer an e4m3 copy of 4 x 2048 x 5632 and its e8m0 scales of 1x16 groups */
    int64_t per_layer = 4 * 2048 * 5632 + 4 * 2048 * 5632 / 16;
    assert_true(saved[0] - saved[1] >= 22 * per_layer);
    assert_true(peak[1] < peak[0]);
    /* the default at -O3 is 0, and GPT-2's GELU (read back by a GEMM) is never copied */
    Arena *a = arena_new();
    Graph *g = compile_with(a, FP8C_SOURCE_DIR "/models/llama.model", 3, 4, 2048, NULL, 0, true);
    int64_t bytes;
    assert_int_equal(activation_copies(g, &bytes), 22);
    assert_int_equal(bytes, saved[1]);
    arena_free(a);
    a = arena_new();
    g = compile_with(a, FP8C_SOURCE_DIR "/models/gpt2.model", 3, 32, 1024, NULL, 0, true);
    assert_int_equal(activation_copies(g, &bytes), 0);
    arena_free(a);
}

/* The schedule also repairs an order that is only topological: shuffled, with in-place
 * updates placed before other readers of what they overwrite. */
static void test_schedule_from_shuffled_order(void **state)
{
    (void)state;
    seed_rng();
    Arena *a = arena_new();
    Graph *g = build_gpt2(a, 2, 2, 8, 16, 2, 32);
    assert_true(run_passes(g, "autodiff,optimizer"));
    int n = g->n_nodes;
    int *preds = calloc((size_t)n, sizeof(int));
    Node **order = malloc(sizeof(Node *) * (size_t)n), **ready = malloc(sizeof(Node *) * (size_t)n);
    Uses *uses = ir_fill_uses(g);
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        for (int j = 0; j < v->n_in; j++)
            if (j == 0 || v->in[j] != v->in[j - 1]) preds[i]++;
    }
    /* a random topological order (Kahn's algorithm picking a random ready node) */
    int n_ready = 0, placed = 0;
    for (int i = 0; i < n; i++)
        if (!preds[i]) ready[n_ready++] = g->nodes[i];
    while (n_ready) {
        int k = (int)(rng_next() % (uint64_t)n_ready);
        Node *v = ready[k];
        ready[k] = ready[--n_ready];
        order[placed++] = v;
        const Uses *u = &uses[v->index];
        for (int j = 0; j < u->n; j++) {
            Node *r = u->list[j];
            int times = 0;
            for (int m = 0; m < r->n_in; m++)
                if (r->in[m] == v && (m == 0 || r->in[m - 1] != v)) times++;
            preds[r->index] -= times;
            if (preds[r->index] == 0) ready[n_ready++] = r;
        }
    }
    assert_int_equal(placed, n);
    memcpy(g->nodes, order, sizeof(Node *) * (size_t)n);
    ir_renumber(g);
    assert_true(run_passes(g, "schedule,memplan"));
    check_schedule(g);
    check_memplan(g);
    free(preds);
    free(order);
    free(ready);
    arena_free(a);
}

static void test_dce_keeps_roots(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = build_gpt2(a, 1, 1, 4, 8, 2, 16);
    assert_true(run_passes(g, "autodiff,optimizer"));
    /* dead additions: an unread chain, an unread constant, an unread state */
    Node *dead = op1(g, OP_GELU, ir_find(g, "wte.weight"));
    dead = scale(g, dead, 3.0);
    Node *cst = leaf(g, OP_CONST, NULL, ROLE_ACTIVATION, FMT_F32, 1, (int64_t[]){5});
    Node *st = leaf(g, OP_STATE, "extra.state", ROLE_AMAX_HISTORY, FMT_F32, 1, (int64_t[]){4});
    int before = g->n_nodes;
    int n_roots = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *v = g->nodes[i];
        v->pass_data = NULL;
        if (v->t.role == ROLE_OUTPUT || ir_op_is_inplace(v->op) || v->op == OP_PARAM ||
            v->op == OP_STATE || v->op == OP_INPUT) {
            v->pass_data = v;   /* marks a root */
            n_roots++;
        }
    }
    assert_true(run_passes(g, "dce"));
    int kept_roots = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        assert_ptr_not_equal(g->nodes[i], dead);
        assert_ptr_not_equal(g->nodes[i], cst);
        if (g->nodes[i]->pass_data) kept_roots++;
    }
    assert_int_equal(kept_roots, n_roots);
    assert_int_equal(g->n_nodes, before - 3);
    assert_non_null(ir_find(g, "extra.state"));
    assert_ptr_equal(ir_find(g, "extra.state"), st);
    assert_non_null(ir_find(g, "loss"));
    assert_non_null(ir_find(g, "grad_norm"));
    /* nothing left that nobody reads, apart from roots */
    Uses *uses = ir_fill_uses(g);
    for (int i = 0; i < g->n_nodes; i++)
        if (!g->nodes[i]->pass_data) assert_true(uses[i].n > 0);
    arena_free(a);
}

/* The optimizer's structure on a real-shaped model: one accumulator, m and v per parameter
 * with a gradient, weight decay on matrices only, clipping from the model's clause. */
static void test_optimizer_states(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = build_gpt2(a, 2, 1, 4, 8, 2, 16);
    int params = 0;
    for (int i = 0; i < g->n_nodes; i++) params += g->nodes[i]->op == OP_PARAM;
    assert_true(run_passes(g, "autodiff,optimizer"));
    int adamw = 0, accum = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *v = g->nodes[i];
        if (v->op == OP_ACCUMULATE) {
            accum++;
            assert_int_equal(v->phase, PHASE_BACKWARD);
            assert_int_equal(v->in[0]->t.role, ROLE_GRAD);
            assert_ptr_equal(v->in[1]->grad_of, v->grad_of);
        }
        if (v->op != OP_ADAMW) continue;
        adamw++;
        Node *p = v->in[0];
        char name[160];
        snprintf(name, sizeof name, "%s:adam_m", p->t.name);
        assert_ptr_equal(v->in[2], ir_find(g, name));
        snprintf(name, sizeof name, "%s:adam_v", p->t.name);
        assert_ptr_equal(v->in[3], ir_find(g, name));
        assert_int_equal(v->in[1]->op, OP_ACCUMULATE);
        assert_ptr_equal(v->in[4], ir_find(g, "lr"));
        assert_ptr_equal(v->in[7], ir_find(g, "grad_scale"));
        assert_int_equal(v->in[6]->op, OP_CLIP_COEF);
        assert_true(IR_FATTR(v->in[6], CLIP_COEF, max_norm) == 1.0);
        assert_true(IR_FATTR(v, ADAMW, weight_decay) == (p->t.rank >= 2 ? 0.1 : 0.0));
        assert_int_equal(v->phase, PHASE_UPDATE);
    }
    assert_int_equal(adamw, params);
    assert_int_equal(accum, params);
    Node *norm = ir_find(g, "grad_norm");
    assert_non_null(norm);
    assert_int_equal(norm->t.role, ROLE_OUTPUT);
    assert_int_equal(norm->n_in, params + 1);
    arena_free(a);
}

/* The same properties on what the whole compiler makes of the bundled models, at every
 * precision level (scaled FP8 formats with their scale and amax tensors, in-place amax and
 * scale updates, gradient release). */
/* The layout pass's promise: every FP8 GEMM reads its per-tensor and 128 x 128-block operands k-contiguous
 * (A as (M, K), B as (N, K)), directly, through a transposed copy its quantize keeps, or through
 * a TRANSPOSE: of the backward, or of the forward right after a forward copy that the backward
 * reads only so, saved in the copy's place (one layout of it kept across the step, never two);
 * returns how many TRANSPOSE nodes the graph has. */
static int check_fp8_gemm_layouts(const Graph *g)
{
    int transposes = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->op == OP_TRANSPOSE) {
            transposes++;
            const Node *x = n->in[0];
            assert_int_equal(n->t.fmt.elem, x->t.fmt.elem);
            if (n->t.fmt.scaling == SCALE_BLOCK_128) {   /* its block grid transposed with it */
                assert_int_equal(n->t.fmt.scale->op, OP_TRANSPOSE);
                assert_ptr_equal(n->t.fmt.scale->in[0], x->t.fmt.scale);
            } else {
                assert_ptr_equal(n->t.fmt.scale, x->t.fmt.scale);
            }
            assert_int_equal(n->t.dims[0], x->t.dims[x->t.rank - 1]);
            if (n->phase == PHASE_FORWARD) {
                assert_int_equal(n->t.role, ROLE_SAVED);
                assert_int_equal(x->op, OP_QUANTIZE);
                assert_int_equal(x->phase, PHASE_FORWARD);
                assert_int_equal(x->t.role, ROLE_ACTIVATION);
                for (int k = 0; k < g->n_nodes; k++)   /* the backward reads x only so */
                    for (int j = 0; j < g->nodes[k]->n_in; j++)
                        if (g->nodes[k]->in[j] == x && g->nodes[k] != n)
                            assert_int_equal(g->nodes[k]->phase, PHASE_FORWARD);
            } else {
                assert_int_equal(n->t.role, ROLE_GRAD_TEMP);   /* not kept across the step */
            }
        }
        if (n->op != OP_MATMUL || !IR_IATTR(n, MATMUL, fp8)) continue;
        for (int j = 0; j < 2; j++) {
            const Node *x = n->in[j];
            if (x->t.fmt.scaling != SCALE_PER_TENSOR && x->t.fmt.scaling != SCALE_BLOCK_128) continue;
            bool transposed = j == 0 ? IR_IATTR(n, MATMUL, trans_a) != 0 : IR_IATTR(n, MATMUL, trans_b) == 0;
            if (transposed && !(x->op == OP_QUANTIZE && IR_IATTR(x, QUANTIZE, transposed)))
                fail_msg("node %%%d reads operand %d (%%%d) transposed without a copy", n->id, j, x->id);
        }
    }
    return transposes;
}

/* The FP8 copies that updates write for the next step (scaling.c): where the level has them
 * (O1, O2 without gradient release), every forward FP8 GEMM that reads a trained weight per
 * tensor reads its copy, a persistent e4m3 state whose scale the update phase makes from the
 * weights' amax before the weight's AdamW writes the copy and the next amax; no pass over a
 * weight remains. Elsewhere there are none. Returns the number of copies. */
static int check_weight_copies(const Graph *g, bool expected)
{
    int copies = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->op == OP_QUANT_SCALE && n->in[0]->op == OP_PARAM && expected && IR_IATTR(n, QUANT_SCALE, scaling) == SCALE_PER_TENSOR)
            fail_msg("%%%d: a pass over weight %s remains", n->id, n->in[0]->t.name);
        if (n->op == OP_ADAMW && IR_IATTR(n, ADAMW, copy) == 1) {
            assert_true(expected);
            int c = ir_adamw_copy_index(n);
            const Node *copy = n->in[c], *scale = n->in[c + 1], *amax = n->in[c + 2];
            assert_int_equal(copy->t.role, ROLE_WEIGHT_COPY);
            assert_ptr_equal(copy->grad_of, n->in[0]);
            assert_int_equal(copy->t.fmt.elem, FMT_E4M3);
            assert_int_equal(copy->t.fmt.scaling, SCALE_PER_TENSOR);
            assert_int_equal(scale->op, OP_DELAYED_SCALE);
            assert_int_equal(scale->phase, PHASE_UPDATE);
            assert_ptr_equal(scale->in[0], copy->t.fmt.scale);
            assert_ptr_equal(scale->in[1], amax);
            assert_true(scale->index < n->index);
            assert_true(ir_role_is_persistent(amax->t.role) && ir_role_is_persistent(copy->t.fmt.scale->t.role));
            copies++;
        }
        if (n->op != OP_MATMUL || !IR_IATTR(n, MATMUL, fp8) || n->phase != PHASE_FORWARD) continue;
        for (int j = 0; j < 2; j++) {
            const Node *x = n->in[j];
            const Node *w = x->op == OP_QUANTIZE ? x->in[0] : x->t.role == ROLE_WEIGHT_COPY ? x->grad_of : NULL;
            if (!w || w->op != OP_PARAM || x->t.fmt.scaling != SCALE_PER_TENSOR) continue;
            if (expected && x->t.role != ROLE_WEIGHT_COPY)
                fail_msg("%%%d reads weight %s quantized in the forward", n->id, w->t.name);
            if (!expected) assert_int_equal(x->op, OP_QUANTIZE);
        }
    }
    if (expected) assert_true(copies > 0);
    return copies;
}

/* O3's per-use weight copies (scaling.c, scale_from_update): where expected, every per-tensor
 * scale of a trained weight that a forward FP8 GEMM reads is quant_scale of a persistent f32
 * amax state, which that weight's update (copy=2, no copy) writes; no such scale reads the
 * weight itself, and the backward's copies of the weight take the forward's scale. Elsewhere
 * no update has copy=2. Returns the number of weights so served. */
static int check_weight_amaxes(const Graph *g, bool expected)
{
    int served = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (ir_op_is_update(n->op) && IR_IATTR(n, ADAMW, copy) == 2) {
            assert_true(expected);
            assert_int_equal(ir_adamw_copy_index(n), -1);
            const Node *amax = n->in[ir_update_amax_index(n)];
            assert_int_equal(amax->op, OP_STATE);
            assert_true(ir_role_is_persistent(amax->t.role));
            assert_int_equal(amax->t.fmt.elem, FMT_F32);
            assert_int_equal(ir_numel(&amax->t), 1);
            assert_ptr_equal(amax->grad_of, n->in[0]);
            assert_true(ir_mutates_input(n, ir_update_amax_index(n)));
            served++;
        }
        if (n->op != OP_MATMUL || !IR_IATTR(n, MATMUL, fp8)) continue;
        for (int j = 0; j < 2; j++) {
            const Node *x = n->in[j];
            while (x->op == OP_TRANSPOSE) x = x->in[0];
            if (x->op != OP_QUANTIZE || x->in[0]->op != OP_PARAM || x->t.fmt.scaling != SCALE_PER_TENSOR) continue;
            const Node *s = x->t.fmt.scale;
            assert_int_equal(s->op, OP_QUANT_SCALE);
            if (!expected) continue;
            if (s->in[0]->op == OP_PARAM)
                fail_msg("%%%d: the scale of weight %s is a pass over it", s->id, s->in[0]->t.name);
            assert_int_equal(s->phase, PHASE_FORWARD);
            const Node *u = NULL;
            for (int k = 0; k < g->n_nodes && !u; k++)
                if (ir_op_is_update(g->nodes[k]->op) && g->nodes[k]->in[0] == x->in[0]) u = g->nodes[k];
            assert_non_null(u);
            assert_int_equal(IR_IATTR(u, ADAMW, copy), 2);
            assert_ptr_equal(s->in[0], u->in[ir_update_amax_index(u)]);
        }
    }
    if (expected) assert_true(served > 0);
    return served;
}

static void test_pipeline_models(void **state)
{
    (void)state;
    static const char *const models[] = {"gpt2_tiny", "llama", "mlp"};
    static const Define llama_small[] = {{"layers", "2"}, {"dim", "64"}, {"heads", "4"},
                                         {"kv_heads", "2"}, {"hidden", "128"}, {"vocab", "256"}};
    for (int m = 0; m < 3; m++)
        for (int level = 0; level <= 4; level++) {
            char path[512];
            snprintf(path, sizeof path, "%s/models/%s.model", FP8C_SOURCE_DIR, models[m]);
            BuildOptions o = {0};
            o.front.batch = 2;
            o.front.seq = 16;
            if (m == 1) {
                o.front.defines = llama_small;
                o.front.n_defines = 6;
            }
            o.passes.opt_level = level < 4 ? level : 3;
            o.passes.grad_release = level == 4;   /* O3 with gradient release */
            o.passes.verify = true;
            Arena *a = arena_new();
            Graph *g = pipeline_compile(a, path, &o);
            if (!g) fail_msg("%s -O%d%s does not compile", models[m], o.passes.opt_level,
                             level == 4 ? " --grad-release" : "");
            check_schedule(g);
            check_memplan(g);
            check_weight_copies(g, level == 1 || level == 2);
            check_weight_amaxes(g, level == 3);   /* not with --grad-release (level 4) */
            /* FP8 levels: each layer's weight copies and saved inputs are transposed for dx and dW */
            int transposes = check_fp8_gemm_layouts(g);
            if (o.passes.opt_level == 0) assert_int_equal(transposes, 0);
            else if (m == 0) assert_true(transposes >= 4 * 4);
            /* attention's backward reads y and the forward's logsumexp at every level (O2 and
             * O3 keep y as FlashAttention's saved output), and at O3 copies of q, k, v that the
             * backward makes again (passes/recompute.c) */
            const PrecisionLevel *lv = precision_level(o.passes.opt_level);
            bool y_kept = !lv->fp8_saved || lv->attention_y_kept;
            assert_true(y_kept);
            assert_int_equal(lv->attention_inputs_remade, o.passes.opt_level == 3);
            /* -O0 makes norms' and elementwise ops' outputs again in the backward (save.cheap) */
            assert_int_equal(lv->cheap_remade, o.passes.opt_level == 0);
            int copies = 0;
            for (int i = 0; i < g->n_nodes; i++)
                copies += ir_is_recomputed(g->nodes[i]) && g->nodes[i]->op != OP_MATMUL;
            if (lv->cheap_remade) assert_true(copies > 0);
            for (int i = 0; i < g->n_nodes; i++) {
                const Node *p = g->nodes[i];
                if (p->op != OP_ATTENTION_BWD) continue;
                assert_int_equal(ir_attention_bwd_reads_y(p), y_kept);
                const Node *q = p->in[1];
                while (q->op == OP_RESHAPE || q->op == OP_SLICE) q = q->in[0];
                assert_int_equal(ir_is_recomputed(q), lv->attention_inputs_remade);
                if (!ir_attention_bwd_reads_y(p)) continue;
                const Node *y = p->in[p->n_in - 1];
                assert_int_equal(y->op, OP_ATTENTION);
                assert_int_equal(IR_IATTR(y, ATTENTION, lse), 1);
                assert_true(ir_attention_lse_offset(y) >= ir_numel(&y->t) * fmt_elem_bytes(y->t.fmt.elem));
            }
            printf("  %-9s -O%d%-15s %5d nodes  persistent %9lld B  step arena %9lld B (live peak %lld B)\n", models[m],
                   o.passes.opt_level, level == 4 ? " --grad-release" : "", g->n_nodes,
                   (long long)g->persistent_bytes, (long long)g->transient_bytes, (long long)live_peak(g));
            arena_free(a);
        }
    /* DeepSeek-V3's recipe: the input gradient reads each weight's 128 x 128 blocks transposed,
     * through a transposed copy whose block grid is transposed with it */
    char path[512];
    snprintf(path, sizeof path, "%s/models/gpt2_tiny.model", FP8C_SOURCE_DIR);
    static const char *block_rule[] = {"gemm:*=e4m3:block128"};
    BuildOptions o = {0};
    o.front.batch = 2;
    o.front.seq = 128;
    o.passes.opt_level = 1;
    o.passes.overrides = block_rule;
    o.passes.n_overrides = 1;
    o.passes.verify = true;
    Arena *a = arena_new();
    Graph *g = pipeline_compile(a, path, &o);
    assert_non_null(g);
    check_fp8_gemm_layouts(g);
    assert_int_equal(check_weight_copies(g, false), 0);   /* 128 x 128 blocks: quantized in the forward */
    int block_copies = 0;
    for (int i = 0; i < g->n_nodes; i++)
        block_copies += g->nodes[i]->op == OP_TRANSPOSE && g->nodes[i]->t.fmt.scaling == SCALE_BLOCK_128;
    assert_true(block_copies >= 4 * 4);   /* four weights a layer, four layers (and the head) */
    arena_free(a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden),
        cmocka_unit_test(test_registry),
        cmocka_unit_test(test_user_errors),
        cmocka_unit_test(test_autodiff_mlp_finite_differences),
        cmocka_unit_test(test_autodiff_block_finite_differences),
        cmocka_unit_test(test_autodiff_ops_finite_differences),
        cmocka_unit_test(test_autodiff_packed_attention_finite_differences),
        cmocka_unit_test(test_optimizer_states),
        cmocka_unit_test(test_memplan_gpt2),
        cmocka_unit_test(test_plan_time_follows_the_graph),
        cmocka_unit_test(test_chunk_loss_follows_the_choice),
        cmocka_unit_test(test_attention_y_follows_the_choice),
        cmocka_unit_test(test_recompute_cheap_producers), cmocka_unit_test(test_recompute_activations),
        cmocka_unit_test(test_recompute_attention_inputs),
        cmocka_unit_test(test_transposed_copies_born_with_their_copy),
        cmocka_unit_test(test_schedule_from_shuffled_order),
        cmocka_unit_test(test_dce_keeps_roots),
        cmocka_unit_test(test_pipeline_models),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
