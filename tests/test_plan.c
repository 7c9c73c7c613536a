/* test_plan.c — the precision plan's numbers against an independent count.
 *
 * The persistent bytes of each role are recomputed here from the parameter shapes and the level
 * table of DESIGN.md §4 (element sizes, codec group sizes and their per-group side values), not
 * from the plan's own code, and must agree to the byte; the peak of the step must fall from
 * each level to the next (and again with gradient release) on GPT-2 d12 at batch 32 x 1024,
 * and O3's must be at most 0.6 of O0's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compiler.h"
#include "rt.h"

static Graph *compile_level(Arena *a, const char *model, int level, bool release, int64_t batch, int64_t seq)
{
    BuildOptions o = {0};
    o.front.batch = batch;
    o.front.seq = seq;
    o.passes.opt_level = level;
    o.passes.grad_release = release;
    o.passes.verify = true;
    Graph *g = pipeline_compile(a, model, &o);
    assert_non_null(g);
    return g;
}

/* Independent per-role byte counts from the parameters alone. */
typedef struct { int64_t weights, master, grads, m, v, scales, copies; } Expect;

static int64_t groups(int64_t n, int64_t g) { return (n + g - 1) / g; }

/* Whether an FP8 GEMM of the forward reads weight p (itself, a quantized copy, or the copy
 * its update writes). */
static bool read_by_fp8_gemm(const Graph *g, const Node *p)
{
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *mm = g->nodes[i];
        if (mm->op != OP_MATMUL || !IR_IATTR(mm, MATMUL, fp8) || mm->phase != PHASE_FORWARD) continue;
        for (int j = 0; j < 2; j++) {
            const Node *x = mm->in[j];
            if (x == p || (x->op == OP_QUANTIZE && x->in[0] == p) || (x->op == OP_STATE && x->grad_of == p))
                return true;
        }
    }
    return false;
}

static Expect expected_bytes(const Graph *g, int level, bool release)
{
    Expect e = {0};
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *p = g->nodes[i];
        if (p->op != OP_PARAM) continue;
        int64_t n = ir_numel(&p->t);
        /* below O3 the update writes next step's e4m3 copy of each FP8 GEMM weight (1 byte an
         * element), with its f32 scale */
        if ((level == 1 || level == 2) && !release && read_by_fp8_gemm(g, p)) e.copies += n, e.scales += 4;
        e.weights += 2 * n;                                    /* bf16 at every level */
        e.master += level < 3 ? 4 * n : n;                     /* f32, or the i8 correction */
        if (!release) e.grads += (level == 0 ? 4 : 2) * n;    /* f32 at O0, bf16 above */
        if (level < 2) {
            e.m += 4 * n, e.v += 4 * n;
        } else if (level == 2) {                               /* e4m3 + (c, k) per 128 */
            e.m += n, e.v += n, e.scales += 2 * 2 * 4 * groups(n, 128);
        } else {                                               /* i8 / u8 + absmax per 32 */
            e.m += n, e.v += n, e.scales += 2 * 4 * groups(n, 32);
        }
    }
    return e;
}

static void check_level(int level, bool release)
{
    Arena *a = arena_new();
    Graph *g = compile_level(a, FP8C_SOURCE_DIR "/models/gpt2.model", level, release, 4, 64);
    MemSummary m;
    memplan_summarize(g, &m);
    Expect e = expected_bytes(g, level, release);
    assert_int_equal(m.by_role[ROLE_PARAM], e.weights);
    assert_int_equal(m.by_role[ROLE_MASTER], e.master);
    assert_int_equal(m.by_role[ROLE_GRAD], e.grads);
    assert_int_equal(m.by_role[ROLE_ADAM_M], e.m);
    assert_int_equal(m.by_role[ROLE_ADAM_V], e.v);
    assert_int_equal(m.by_role[ROLE_SCALE], e.scales);
    assert_int_equal(m.by_role[ROLE_WEIGHT_COPY], e.copies);
    /* the arena holds all of it (alignment may add a little) */
    int64_t sum = e.weights + e.master + e.grads + e.m + e.v + e.scales + e.copies;
    assert_true(m.persistent >= sum);
    assert_true(m.persistent < sum + 256 * 4 * (int64_t)g->n_nodes);
    double per_param = (double)m.persistent / (double)m.n_params;
    static const double design[4] = {18, 16.6, 10.6, 7};   /* O1, O2: + the FP8 weight copies */
    double want = release ? 5 : design[level];
    print_message("-O%d%s: %.3f bytes per parameter (design: about %.1f)\n", level,
                  release ? " --grad-release" : "", per_param, want);
    assert_true(per_param > want - 0.01 && per_param < want + 0.5);
    arena_free(a);
}

static void test_bytes_per_param_o0(void **s) { (void)s; check_level(0, false); }
static void test_bytes_per_param_o1(void **s) { (void)s; check_level(1, false); }
static void test_bytes_per_param_o2(void **s) { (void)s; check_level(2, false); }
static void test_bytes_per_param_o3(void **s) { (void)s; check_level(3, false); }
static void test_bytes_per_param_release(void **s) { (void)s; check_level(3, true); }

/* The step's peak falls at every level on GPT-2 d12, batch 32 x 1024, where each level saves
 * the same values (save.cheap=1, save.attention_inputs=1: what the formats alone do); with
 * the levels' own choices (-O0 makes cheap values again, as PyTorch's compiled graphs do; -O3
 * attention's q, k, v) the FP8 levels still fall from -O1 on, and -O0 takes less than -O1. */
static void test_peak_falls(void **s)
{
    (void)s;
    int64_t peak[2][5];
    for (int own = 0; own < 2; own++)
        for (int level = 0; level <= 4; level++) {
            Arena *a = arena_new();
            Choice same[2] = {{"save.cheap", "1"}, {"save.attention_inputs", "1"}};
            BuildOptions o = {0};
            o.front.batch = 32, o.front.seq = 1024;
            o.passes.opt_level = level < 4 ? level : 3;
            o.passes.grad_release = level == 4;
            o.passes.verify = true;
            o.choices = own ? NULL : same, o.n_choices = own ? 0 : 2;
            Graph *g = pipeline_compile(a, FP8C_SOURCE_DIR "/models/gpt2.model", &o);
            assert_non_null(g);
            MemSummary m;
            memplan_summarize(g, &m);
            peak[own][level] = m.persistent + m.transient;
            print_message("peak %s%s: %.3f GiB\n",
                          level < 4 ? (const char *[]){"O0", "O1", "O2", "O3"}[level] : "O3+release",
                          own ? " (the level's own choices)" : "", (double)peak[own][level] / (1 << 30));
            arena_free(a);
        }
    for (int level = 1; level <= 4; level++) assert_true(peak[0][level] < peak[0][level - 1]);
    for (int level = 2; level <= 4; level++) assert_true(peak[1][level] < peak[1][level - 1]);
    assert_true(peak[1][0] < peak[0][0] && peak[1][0] < peak[1][1]);
    assert_true(peak[1][3] < peak[0][3]);
    /* the most compressed level, as built, at most 0.6 of the peak of the baseline's formats
     * with every value saved */
    assert_true((double)peak[1][3] <= 0.6 * (double)peak[0][0]);
}

/* A level override by rule: lm_head-like exceptions and FP8 formats reach the tensors. */
static void test_rules_reach_tensors(void **s)
{
    (void)s;
    Arena *a = arena_new();
    BuildOptions o = {0};
    o.front.batch = 2, o.front.seq = 16;
    o.passes.opt_level = 2;
    o.passes.verify = true;
    const char *rules[] = {"wpe.weight=f32", "gemm:h.0.*=bf16", "*:adam_v=f32"};
    o.passes.overrides = rules;
    o.passes.n_overrides = 3;
    Graph *g = pipeline_compile(a, FP8C_SOURCE_DIR "/models/gpt2_tiny.model", &o);
    assert_non_null(g);
    assert_int_equal(ir_find(g, "wpe.weight")->t.fmt.elem, FMT_F32);
    assert_int_equal(ir_find(g, "h.0.attn.c_attn.weight:adam_v")->t.fmt.elem, FMT_F32);
    assert_int_equal(ir_find(g, "h.0.attn.c_attn.weight:adam_m")->t.fmt.elem, FMT_E4M3);
    int fp8_in_h0 = 0, fp8_in_h1 = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->op != OP_MATMUL) continue;
        for (int j = 0; j < 2; j++) {
            Node *w = n->in[j]->op == OP_QUANTIZE ? n->in[j]->in[0] : n->in[j];
            if (w->t.role == ROLE_WEIGHT_COPY) w = w->grad_of;   /* written by its update */
            if (w->op != OP_PARAM) continue;
            if (!strncmp(w->t.name, "h.0.", 4)) fp8_in_h0 += IR_IATTR(n, MATMUL, fp8) != 0;
            if (!strncmp(w->t.name, "h.1.", 4)) fp8_in_h1 += IR_IATTR(n, MATMUL, fp8) != 0;
        }
    }
    assert_int_equal(fp8_in_h0, 0);
    assert_true(fp8_in_h1 > 0);
    arena_free(a);
}

/* "*=f32" with "value:*=f32" leaves no reduced precision anywhere at -O0: every floating-point
 * tensor of the step is f32 (no master copies either, the parameters being f32 already). A
 * value: rule with bf16 for one block brings bf16 back there only. */
static void test_value_rules(void **s)
{
    (void)s;
    for (int variant = 0; variant < 2; variant++) {
        Arena *a = arena_new();
        BuildOptions o = {0};
        o.front.batch = 2, o.front.seq = 16;
        o.passes.verify = true;
        const char *rules[] = {"*=f32", "value:*=f32", "value:h.1.*=bf16"};
        o.passes.overrides = rules;
        o.passes.n_overrides = variant ? 3 : 2;
        Graph *g = pipeline_compile(a, FP8C_SOURCE_DIR "/models/gpt2_tiny.model", &o);
        assert_non_null(g);
        int bf16 = 0, bf16_outside_h1 = 0, masters = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            const Tensor *t = &g->nodes[i]->t;
            if (t->fmt.elem == FMT_BF16) {
                bf16++;
                bf16_outside_h1 += !t->name || strncmp(t->name, "h.1.", 4) != 0;
            }
            masters += t->role == ROLE_MASTER;
        }
        assert_int_equal(masters, 0);
        if (variant == 0) assert_int_equal(bf16, 0);
        else assert_true(bf16 > 0 && bf16_outside_h1 == 0);
        arena_free(a);
    }
}

/* ---------------------------------------------------------------- the kernel program
 * `fp8c plan --kernels` lists the program each device runs. Its GEMM lines, summed per phase,
 * must carry the products of every matmul of the graph: 2 M N K from the nodes' shapes
 * (K = sqrt(|A| |B| / |C|)), counted here, not by the listing's code. */
static double listed_gemm_gflop(const char *text, const char *phase)
{
    double sum = 0;
    for (const char *line = text; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        int idx;
        char ph[16], kind[16], gf[32];
        if (sscanf(line, "%d %15s %15s", &idx, ph, kind) != 3 || strcmp(ph, phase) || strcmp(kind, "gemm")) continue;
        const char *end = strchr(line, '\n');
        const char *last = end ? end : line + strlen(line);
        while (last > line && last[-1] == ' ') last--;
        const char *first = last;
        while (first > line && first[-1] != ' ') first--;
        snprintf(gf, sizeof gf, "%.*s", (int)(last - first), first);
        sum += atof(gf);
    }
    return sum;
}

static void test_kernel_program_flops(void **state)
{
    (void)state;
    Arena *a = arena_new();
    Graph *g = compile_level(a, FP8C_SOURCE_DIR "/models/gpt2_tiny.model", 1, false, 4, 64);
    double want[PHASE_COUNT] = {0};
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *m = g->nodes[i];
        if (m->op != OP_MATMUL) continue;
        double c = (double)ir_numel(&m->t), k = sqrt((double)ir_numel(&m->in[0]->t) * (double)ir_numel(&m->in[1]->t) / c);
        assert_true(fabs(k - rint(k)) < 1e-9);
        want[m->phase] += 2 * c * k / 1e9;
    }
    assert_true(want[PHASE_FORWARD] > 0 && want[PHASE_BACKWARD] > 0);
    const char *devices[] = {"cpu", "cuda"};
    for (int d = 0; d < 2; d++) {
        char *text = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&text, &len);
        bool ok = plan_print_kernels(g, devices[d], f);
        fclose(f);
        if (!ok && d == 1) {   /* built without the CUDA toolkit: said so, and nothing to check */
            free(text);
            continue;
        }
        assert_true(ok);
        for (int ph = PHASE_FORWARD; ph <= PHASE_BACKWARD; ph++) {
            double got = listed_gemm_gflop(text, ir_phase_name((Phase)ph));
            printf("  %-4s %-8s GEMM GFLOP listed %.6g, counted %.6g\n", devices[d], ir_phase_name((Phase)ph), got,
                   want[ph]);
            assert_true(fabs(got - want[ph]) <= 1e-3 * want[ph]);
        }
        free(text);
    }
    arena_free(a);
}

/* ---------------------------------------------------------------- rules, executed */

/* --recipe: its rules go before `rules` (NULL: none) */
static const NamedRecipe *step_recipe;

/* gpt2_tiny's step at -O<level> under rules, run once (forward, backward, update) on the
 * reference executor from its initial parameters; NULL when the rules are refused, with the
 * diagnostics in errors (if given). */
static Graph *step_with_rules(Arena *a, int level, const char **rules, int n_rules, RtMemory *mem,
                              char *errors, size_t errors_size)
{
    BuildOptions o = {0};
    o.front.batch = 2, o.front.seq = 16;
    o.passes.opt_level = level;
    o.passes.verify = true;
    o.passes.overrides = rules;
    o.passes.n_overrides = n_rules;
    o.passes.recipe = step_recipe;
    char *text = NULL;
    size_t size = 0;
    FILE *capture = open_memstream(&text, &size);
    diag_reset();
    diag_set_stream(capture);
    Graph *g = pipeline_compile(a, FP8C_SOURCE_DIR "/models/gpt2_tiny.model", &o);
    diag_set_stream(NULL);
    fclose(capture);
    if (errors) snprintf(errors, errors_size, "%s", text ? text : "");
    free(text);
    if (!g) return NULL;
    assert_true(rt_memory_bind(g, mem));
    rt_init_params(g, 11);
    Node *ids[2] = {ir_find(g, "tokens"), ir_find(g, "targets")};
    for (int k = 0; k < 2; k++) {
        int64_t n = ir_numel(&ids[k]->t);
        float *x = malloc(sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < n; i++) x[i] = (float)((i * 37 + k * 11) % 256);
        ref_store(&ids[k]->t, x);
        free(x);
    }
    ref_run_phase(g, PHASE_FORWARD);
    ref_run_phase(g, PHASE_BACKWARD);
    const char *scalars[] = {"lr", "step", "grad_scale"};
    const float values[] = {1e-3f, 1, 1};
    for (int k = 0; k < 3; k++) {
        Node *n = ir_find(g, scalars[k]);
        if (n) ref_store(&n->t, &values[k]);
    }
    ref_run_phase(g, PHASE_UPDATE);
    return g;
}

/* What a GEMM operand is made from: through quantize, transpose, cast and reshape nodes to
 * the parameter (a weight copy stands for its parameter), or the value itself. */
static const Node *operand_source(const Node *x)
{
    while ((x->op == OP_QUANTIZE || x->op == OP_TRANSPOSE || x->op == OP_CAST || x->op == OP_RESHAPE) && x->n_in)
        x = x->in[0];
    if (x->op == OP_STATE && x->t.role == ROLE_WEIGHT_COPY) x = x->grad_of;
    return x;
}

static bool is_fp8(ElemType e) { return e == FMT_E4M3 || e == FMT_E5M2; }

/* FP8 GEMMs of the step by kind (0 forward, 1 input gradient, 2 weight gradient), each checked
 * against the formats of the operands the reference executor read: FP8 exactly where the plan
 * says so; with delayed, every FP8 operand scaled from an amax history that the step filled;
 * with all_e4m3, no e5m2 operand. */
typedef struct { int fp8[3], all[3], copies; } GemmCount;

/* The forward GEMM that the backward's copy mm (passes/recompute.c, -O3) makes again: the one
 * of the same weight; the copy must run as it does. */
static void check_copy_runs_as_forward(const Graph *g, const Node *mm)
{
    Uses *uses = ir_fill_uses(g);
    const char *weight, *other;
    assert_string_equal(precision_gemm_kind(mm, uses, &weight), "fwd");
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *f = g->nodes[i];
        if (f->op != OP_MATMUL || f->phase != PHASE_FORWARD) continue;
        if (strcmp(precision_gemm_kind(f, uses, &other), "fwd") || strcmp(weight, other)) continue;
        assert_int_equal(IR_IATTR(mm, MATMUL, fp8), IR_IATTR(f, MATMUL, fp8));
        assert_int_equal(IR_IATTR(mm, MATMUL, history), IR_IATTR(f, MATMUL, history));
        return;
    }
    fail_msg("no forward GEMM of %s for the backward's copy %%%d", weight, mm->id);
}

static GemmCount count_executed_gemms(const Graph *g, bool delayed, bool all_e4m3)
{
    GemmCount c = {{0}, {0}, 0};
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *mm = g->nodes[i];
        if (mm->op != OP_MATMUL) continue;
        if (ir_is_recomputed(mm)) {
            check_copy_runs_as_forward(g, mm);
            c.copies++;
            continue;
        }
        int kind = 2;
        if (mm->phase == PHASE_FORWARD) kind = 0;
        else
            for (int j = 0; j < 2; j++)
                if (operand_source(mm->in[j])->op == OP_PARAM) kind = 1;
        c.all[kind]++;
        c.fp8[kind] += IR_IATTR(mm, MATMUL, fp8) != 0;
        for (int j = 0; j < 2; j++) {
            const Node *x = mm->in[j];
            assert_int_equal(is_fp8(x->t.fmt.elem), IR_IATTR(mm, MATMUL, fp8) != 0);
            if (!is_fp8(x->t.fmt.elem)) continue;
            if (all_e4m3) assert_int_equal(x->t.fmt.elem, FMT_E4M3);
            while (x->op == OP_TRANSPOSE) x = x->in[0];
            if (!delayed) continue;
            assert_int_equal(x->op, OP_QUANTIZE);
            assert_int_equal(x->t.fmt.recipe, RECIPE_DELAYED);
            const Node *s = x->in[1];
            assert_int_equal(s->op, OP_STATE);
            const Node *hist = NULL;
            for (int k = 0; k < g->n_nodes && !hist; k++)
                if (g->nodes[k]->op == OP_DELAYED_SCALE && g->nodes[k]->in[0] == s) hist = g->nodes[k]->in[1];
            assert_non_null(hist);
            float *h = ref_load(&hist->t);
            assert_true(h[0] > 0);   /* this step's amax, recorded */
            free(h);
        }
    }
    return c;
}

/* gemm: rules reach all three GEMMs of a linear layer (forward, input gradient, weight
 * gradient); gemm.fwd:, gemm.dgrad: and gemm.wgrad: reach one each. gpt2_tiny has 16 linear
 * layers and the head, whose weight is the embedding: 17 GEMMs of each kind. */
static void test_gemm_rules_reach_every_gemm(void **s)
{
    (void)s;
    struct {
        const char *rules[2];
        int level;
        int fp8[3];
        bool delayed, e4m3;
    } cases[] = {
        {{"gemm:h.0.*=bf16"}, 1, {12, 12, 12}, false, false},
        {{"gemm:*=bf16"}, 1, {0, 0, 0}, false, false},
        {{"gemm:*=e4m3:delayed16"}, 1, {17, 17, 17}, true, true},
        {{"gemm:*=e4m3:delayed16"}, 0, {17, 17, 17}, true, true},
        {{"gemm:*=e4m3:delayed16"}, 3, {17, 17, 17}, true, true},
        {{"gemm.dgrad:*=bf16"}, 3, {16, 0, 16}, false, false},
        {{"gemm.fwd:h.0.*=bf16"}, 3, {12, 16, 16}, false, false},
        {{"gemm.wgrad:*=bf16"}, 1, {16, 16, 0}, false, false},
        {{"gemm:*=e5m2", "gemm.dgrad:h.1.*=bf16"}, 0, {17, 13, 17}, false, false},
        {{"gemm.fwd:h.*.mlp.*=bf16", "gemm.wgrad:wte.weight=e4m3"}, 1, {8, 16, 17}, false, false},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        Arena *a = arena_new();
        RtMemory mem;
        int n_rules = cases[k].rules[1] ? 2 : 1;
        char errors[1024];
        Graph *g = step_with_rules(a, cases[k].level, cases[k].rules, n_rules, &mem, errors, sizeof errors);
        if (!g) fail_msg("%s: %s", cases[k].rules[0], errors);
        GemmCount c = count_executed_gemms(g, cases[k].delayed, cases[k].e4m3);
        print_message("-O%d %s %s: FP8 GEMMs %d/%d forward, %d/%d dgrad, %d/%d wgrad; %d forward copies\n",
                      cases[k].level, cases[k].rules[0], n_rules > 1 ? cases[k].rules[1] : "", c.fp8[0], c.all[0],
                      c.fp8[1], c.all[1], c.fp8[2], c.all[2], c.copies);
        /* -O3 makes attention's q, k, v again in the backward: one copy of each layer's GEMM */
        assert_int_equal(c.copies, cases[k].level == 3 ? 4 : 0);
        for (int kind = 0; kind < 3; kind++) {
            assert_int_equal(c.all[kind], 17);
            assert_int_equal(c.fp8[kind], cases[k].fp8[kind]);
        }
        rt_memory_free(&mem);
        arena_free(a);
    }
}

/* Grouped scales (:row, :block128) reach the forward and input-gradient GEMMs; the weight
 * gradient x^T dy contracts over the tokens, across which rows and tiles are laid out, so the
 * rule gives it per-tensor scales (docs/precision.md), also the head's. */
static void test_grouped_rules_give_wgrad_per_tensor(void **s)
{
    (void)s;
    const char *rules[][1] = {{"gemm:*=e4m3:block128"}, {"gemm:*=e4m3:row"}};
    const int grouped[] = {3, 2};
    for (int k = 0; k < 2; k++) {
        Arena *a = arena_new();
        RtMemory mem;
        Graph *g = step_with_rules(a, 1, rules[k], 1, &mem, NULL, 0);
        assert_non_null(g);
        int modes[3][4] = {{0}};
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *mm = g->nodes[i];
            if (mm->op != OP_MATMUL) continue;
            int kind = mm->phase == PHASE_FORWARD ? 0 : 2;
            for (int j = 0; j < 2 && kind == 2; j++)
                if (operand_source(mm->in[j])->op == OP_PARAM) kind = 1;
            modes[kind][IR_IATTR(mm, MATMUL, fp8)]++;
        }
        print_message("%s: forward %d grouped, dgrad %d grouped, wgrad %d per tensor\n", rules[k][0],
                      modes[0][grouped[k]], modes[1][grouped[k]], modes[2][1]);
        assert_int_equal(modes[0][grouped[k]], 17);
        assert_int_equal(modes[1][grouped[k]], 17);
        assert_int_equal(modes[2][1], 17);
        rt_memory_free(&mem);
        arena_free(a);
    }
}

/* The step with one command-line rule is refused: one error, on the command line, holding
 * `why` (and the rule's own text where names_rule). */
static void expect_rule_refused(const char *rule, const char *why, bool names_rule)
{
    Arena *a = arena_new();
    RtMemory mem;
    char errors[2048];
    const char *rules[] = {rule};
    Graph *g = step_with_rules(a, 1, rules, 1, &mem, errors, sizeof errors);
    print_message("%s: %s", rule, errors);
    assert_null(g);
    assert_non_null(strstr(errors, "<command line>: error:"));
    if (names_rule) assert_non_null(strstr(errors, rule));
    assert_non_null(strstr(errors, why));
    assert_int_equal(diag_error_count(), 1);   /* once per rule, not once per tensor */
    arena_free(a);
}

/* A rule that matches nothing in the step is refused at the rule, whatever its kind, rather
 * than obeyed in name only: most often it is a misspelt name. */
static void test_unmatched_rules_refused(void **s)
{
    (void)s;
    const char *refused[][2] = {
        {"h.*.attn.c_attn.wieght=f32", "matches no parameter or optimizer state"},
        {"tokens=f32", "matches no parameter or optimizer state"},
        {"gemm:h.*.mlp.c_fc.wieght=bf16", "matches no GEMM"},
        {"gemm.wgrad:h.9.*=bf16", "matches no GEMM"},
        {"saved:h.*.mpl=bf16", "matches no value the backward reads"},
        {"value:loss=bf16", "matches no value stored in 16 bits"},
    };
    for (size_t k = 0; k < sizeof refused / sizeof refused[0]; k++)
        expect_rule_refused(refused[k][0], refused[k][1], true);
}

/* A policy file that cannot be read is an error naming it, not an empty policy: a directory
 * opens as a file would and fails only when read. */
static void test_policy_directory_refused(void **s)
{
    (void)s;
    char dir[] = "/tmp/fp8c-test-policy-dir-XXXXXX";
    assert_non_null(mkdtemp(dir));
    Arena *a = arena_new();
    BuildOptions o = {0};
    o.front.batch = 2, o.front.seq = 16;
    o.passes.policy_file = dir;
    char *text = NULL;
    size_t size = 0;
    FILE *capture = open_memstream(&text, &size);
    diag_reset();
    diag_set_stream(capture);
    Graph *g = pipeline_compile(a, FP8C_SOURCE_DIR "/models/gpt2_tiny.model", &o);
    diag_set_stream(NULL);
    fclose(capture);
    print_message("%s", text);
    assert_null(g);
    char want[256];
    snprintf(want, sizeof want, "%s: error: cannot read the policy file: ", dir);
    assert_non_null(strstr(text, want));
    assert_int_equal(diag_error_count(), 1);
    free(text);
    rmdir(dir);
    arena_free(a);
}

/* Rules for stored tensors either hold on the reference executor's tensors after a step or are
 * refused where they are written: an FP8 Adam state keeps a scale for each group of 128 (the
 * range-expansion codec, whose side values the update wrote), and forms the update cannot
 * store as labelled are errors naming the rule, not formats that differ from their label. */
static void test_state_rules_hold_or_are_refused(void **s)
{
    (void)s;
    const char *refused[][2] = {
        {"*:adam_m=e4m3", "scale"},
        {"*:adam_m=e4m3:tensor", "scale"},
        {"*:adam_m=e4m3:group128", "scale"},
        {"*:adam_v=e5m2:expand", "e4m3"},
        {"*:adam_m=e4m3:expand:group64", "128"},
        {"*:adam_m=u8:compand", "i8"},
        {"*:adam_v=i8", "codec"},
        {"h.*.weight=e4m3", "parameter"},
        {"*:grad=e5m2", "gradient"},
    };
    for (size_t k = 0; k < sizeof refused / sizeof refused[0]; k++)
        expect_rule_refused(refused[k][0], refused[k][1], true);
    /* GEMM rules: what a GEMM cannot do, and numbers out of range, are refused too */
    const char *refused_forms[][2] = {
        {"gemm:*=e4m3:group128", "gemm: rule"},
        {"gemm:*=e4m3:expand", "gemm: rule"},
        {"gemm:*=f32", "bf16"},
        {"gemm:*=e4m3:delayed2000000000", "1024"},
        {"saved:*=e4m3:group99999999999", "group"},
        {"gemm:*=e4m3:static1e40", "finite"},
        {"gemm:*=e4m3:margin40", "margin"},
    };
    for (size_t k = 0; k < sizeof refused_forms / sizeof refused_forms[0]; k++)
        expect_rule_refused(refused_forms[k][0], refused_forms[k][1], false);

    /* in a policy file, the error points at the rule's line and column */
    char path[] = "/tmp/fp8c-test-policy-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *pf = fdopen(fd, "w");
    fprintf(pf, "# states\n  *:adam_m=e4m3:group128   # COAT without its codec\n");
    fclose(pf);
    Arena *pa = arena_new();
    BuildOptions o = {0};
    o.front.batch = 2, o.front.seq = 16;
    o.passes.opt_level = 2;
    o.passes.policy_file = path;
    char *text = NULL;
    size_t size = 0;
    FILE *capture = open_memstream(&text, &size);
    diag_reset();
    diag_set_stream(capture);
    assert_null(pipeline_compile(pa, FP8C_SOURCE_DIR "/models/gpt2_tiny.model", &o));
    diag_set_stream(NULL);
    fclose(capture);
    char want[256];
    snprintf(want, sizeof want, "%s:2:3: error: '*:adam_m=e4m3:group128'", path);
    print_message("%s", text);
    assert_non_null(strstr(text, want));
    free(text);
    unlink(path);
    arena_free(pa);

    /* what is accepted is what the step stores */
    const char *accepted[] = {"*:adam_m=e4m3:expand", "*:adam_v=e4m3:expand:group128", "*:adam_m=i8:compand"};
    for (size_t k = 0; k < sizeof accepted / sizeof accepted[0]; k++) {
        Arena *a = arena_new();
        RtMemory mem;
        const char *rules[] = {accepted[k]};
        Graph *g = step_with_rules(a, 1, rules, 1, &mem, NULL, 0);
        assert_non_null(g);
        const Node *m = ir_find(g, k == 1 ? "h.0.mlp.c_fc.weight:adam_v" : "h.0.mlp.c_fc.weight:adam_m");
        const Format *f = &m->t.fmt;
        assert_int_equal(f->elem, codec_elem(f->codec));
        assert_int_equal(f->group, codec_group_size(f->codec));
        assert_non_null(f->scale);
        int64_t n = ir_numel(&m->t);
        float *x = ref_load(&m->t), *p = ref_load(&f->scale->t);
        int64_t zero = 0;
        for (int64_t i = 0; i < n; i++) zero += x[i] == 0;
        print_message("%s: %s %s, %lld of %lld zero after a step, first group's side value %g\n", accepted[k],
                      fmt_elem_name(f->elem), fmt_codec_name(f->codec), (long long)zero, (long long)n, p[0]);
        assert_true(p[0] > 0);
        assert_true(zero < n / 100);   /* the scale keeps m and v off zero */
        free(x);
        free(p);
        rt_memory_free(&mem);
        arena_free(a);
    }
}

/* op(A) (M x K) times op(B) (K x N) of a GEMM, from its operands' 2-D views. */
static void gemm_mnk(const Node *mm, int64_t *M, int64_t *N, int64_t *K)
{
    const Tensor *a = &mm->in[0]->t, *b = &mm->in[1]->t;
    int64_t ca = a->dims[a->rank - 1], ra = ir_numel(a) / ca;
    int64_t cb = b->dims[b->rank - 1], rb = ir_numel(b) / cb;
    *M = IR_IATTR(mm, MATMUL, trans_a) ? ca : ra;
    *K = IR_IATTR(mm, MATMUL, trans_a) ? ra : ca;
    *N = IR_IATTR(mm, MATMUL, trans_b) ? rb : cb;
}

/* cuBLASLt's FP8 GEMMs need K and N to be multiples of 16, and the GPU backend runs them only
 * where M is one too: an FP8 GEMM the plan would make with another M, K or N is planned in
 * bf16, and the plan says which and why. mlp.model with hidden = 200 at -O1: every GEMM of the
 * blocks falls back (each has 200 as its M, N or K); at 3 x 5 tokens too; with hidden = 256
 * nothing does at 2 x 16, and at 3 x 1000 every
 * GEMM does (3,000 tokens: the forward and input gradients' M, the weight gradients' K). The
 * head is bf16 anyway. */
static void test_unaligned_gemms_fall_back(void **s)
{
    (void)s;
    struct { const char *hidden; int64_t batch, seq; int fallbacks, fp8; } cases[] = {
        {"200", 2, 16, 12, 0}, {"200", 3, 5, 12, 0}, {"256", 2, 16, 0, 12}, {"256", 3, 1000, 12, 0},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        Arena *a = arena_new();
        Define d = {"hidden", cases[k].hidden};
        BuildOptions o = {0};
        o.front.batch = cases[k].batch, o.front.seq = cases[k].seq;
        o.front.defines = &d, o.front.n_defines = 1;
        o.passes.opt_level = 1;
        o.passes.verify = true;
        Graph *g = pipeline_compile(a, FP8C_SOURCE_DIR "/models/mlp.model", &o);
        assert_non_null(g);
        int fallbacks = 0, fp8 = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *mm = g->nodes[i];
            if (mm->op != OP_MATMUL) continue;
            int64_t M, N, K;
            gemm_mnk(mm, &M, &N, &K);
            bool aligned = K % 16 == 0 && N % 16 == 0 && M % 16 == 0;
            bool unaligned_attr = IR_IATTR(mm, MATMUL, unaligned) != 0;
            fallbacks += unaligned_attr;
            fp8 += IR_IATTR(mm, MATMUL, fp8) != 0;
            if (IR_IATTR(mm, MATMUL, fp8)) assert_true(aligned);
            bool head = operand_source(mm->in[1]) == ir_find(g, "head.weight") ||
                        mm->in[0]->op == OP_CROSS_ENTROPY_BWD || mm->in[1]->op == OP_CROSS_ENTROPY_BWD;
            assert_int_equal(unaligned_attr, !aligned && !head);   /* the head is bf16 anyway */
            for (int j = 0; j < 2 && !IR_IATTR(mm, MATMUL, fp8); j++) assert_false(is_fp8(mm->in[j]->t.fmt.elem));
        }
        char *text = NULL;
        size_t size = 0;
        FILE *f = open_memstream(&text, &size);
        plan_print(g, false, f);
        fclose(f);
        print_message("hidden %s at %lld x %lld: %d GEMMs fell back to bf16, %d FP8\n", cases[k].hidden,
                      (long long)cases[k].batch, (long long)cases[k].seq, fallbacks, fp8);
        assert_int_equal(fallbacks, cases[k].fallbacks);
        assert_int_equal(fp8, cases[k].fp8);
        const char *section = strstr(text, "GEMMs planned in bf16");
        if (cases[k].fallbacks) {
            assert_non_null(section);
            assert_non_null(strstr(section, "layers.*.fc1.weight"));
            assert_non_null(strstr(section, cases[k].hidden[1] == '0' ? "x 200" : "K = 3000"));
        } else {
            assert_null(section);
        }
        if (k == 0) print_message("%s", section);
        free(text);
        arena_free(a);
    }
}

/* The plan says what save.cheap=0 recomputes: GPT-2 tiny's two norms and GELU a layer (and the
 * final norm, whose output the whole head reads), and the bytes they would take saved, in the
 * text and in --json; the default plan says nothing. */
static void test_plan_shows_recomputed(void **s)
{
    (void)s;
    for (int v = 0; v < 2; v++) {
        Arena *a = arena_new();
        Choice c = {"save.cheap", "0"};
        BuildOptions o = {0};
        o.front.batch = 4, o.front.seq = 64;
        o.passes.opt_level = 1;
        o.choices = v ? &c : NULL, o.n_choices = v;
        Graph *g = pipeline_compile(a, FP8C_SOURCE_DIR "/models/gpt2_tiny.model", &o);
        assert_non_null(g);
        int64_t saved_bytes = 0;
        int layers = 0, copies = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *x = g->nodes[i];
            layers += x->op == OP_GELU && x->phase == PHASE_FORWARD;
            if (x->phase == PHASE_FORWARD || x->t.role != ROLE_ACTIVATION) continue;
            copies++;
            saved_bytes += ir_storage_bytes(x);
        }
        assert_int_equal(copies, v ? 3 * layers + 1 : 0);
        for (int json = 0; json < 2; json++) {
            char *text = NULL;
            size_t size = 0;
            FILE *f = open_memstream(&text, &size);
            plan_print(g, json, f);
            fclose(f);
            char want[128];
            if (json) snprintf(want, sizeof want, "\"recomputed\": %d, \"recomputed_bytes\": %lld", copies,
                               (long long)saved_bytes);
            else snprintf(want, sizeof want, "save.cheap=0): %d values", copies);
            if (v || json) {
                if (!strstr(text, want)) fail_msg("want '%s' in:\n%s", want, text);
            } else {
                assert_null(strstr(text, "recomputed in the backward"));
            }
            free(text);
        }
        assert_true(v ? saved_bytes > 0 : saved_bytes == 0);
        arena_free(a);
    }
}

/* The output head stays bf16 at every level (docs/precision.md), also a head with a bias
 * (mlp.model's linear(x, head.weight, head.bias)): its forward, input gradient and weight
 * gradient; the other GEMMs of the step stay FP8. */
static void test_head_with_bias_stays_bf16(void **s)
{
    (void)s;
    Arena *a = arena_new();
    BuildOptions o = {0};
    o.front.batch = 2, o.front.seq = 16;
    o.passes.opt_level = 1;
    o.passes.verify = true;
    Graph *g = pipeline_compile(a, FP8C_SOURCE_DIR "/models/mlp.model", &o);
    assert_non_null(g);
    const Node *head = ir_find(g, "head.weight");
    int head_gemms = 0, fp8_elsewhere = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *mm = g->nodes[i];
        if (mm->op != OP_MATMUL) continue;
        bool is_head = false;
        for (int j = 0; j < 2; j++)
            is_head |= operand_source(mm->in[j]) == head || mm->in[j]->op == OP_CROSS_ENTROPY_BWD;
        if (is_head) {
            head_gemms++;
            assert_int_equal(IR_IATTR(mm, MATMUL, fp8), 0);
        } else {
            fp8_elsewhere += IR_IATTR(mm, MATMUL, fp8) != 0;
        }
    }
    assert_int_equal(head_gemms, 3);
    assert_int_equal(fp8_elsewhere, 12);
    arena_free(a);
}

/* ---------------------------------------------------------------- recipes */

/* Each recipe, built on its level and run for one step on the reference executor, gives the
 * formats its name stands for (docs/recipes.md): the GEMMs' operands and scales, the Adam
 * states, the master, and whether saved activations are FP8 in groups. */
typedef struct {
    const char *name;
    int fp8_gemms;              /* of the 17 forward GEMMs */
    int fwd_mode;               /* MATMUL's fp8 attribute on those: 1 tensor, 2 row, 3 block */
    bool e4m3_only, delayed;
    ElemType master, m, v;
    Codec master_codec, m_codec, v_codec;
    bool grouped_saved;         /* saved activations in FP8 groups (COAT's mixed granularity) */
} RecipeExpect;

static void test_recipes_plan_what_they_say(void **s)
{
    (void)s;
    const RecipeExpect want[] = {
        {"tensorwise", 17, 1, false, false, FMT_F32, FMT_F32, FMT_F32, CODEC_PLAIN, CODEC_PLAIN, CODEC_PLAIN, false},
        {"hybrid", 17, 1, false, false, FMT_F32, FMT_F32, FMT_F32, CODEC_PLAIN, CODEC_PLAIN, CODEC_PLAIN, false},
        {"e4m3", 17, 1, true, false, FMT_F32, FMT_F32, FMT_F32, CODEC_PLAIN, CODEC_PLAIN, CODEC_PLAIN, false},
        {"rowwise", 17, 2, true, false, FMT_F32, FMT_F32, FMT_F32, CODEC_PLAIN, CODEC_PLAIN, CODEC_PLAIN, false},
        {"rowwise_with_gw_hp", 17, 2, true, false, FMT_F32, FMT_F32, FMT_F32, CODEC_PLAIN, CODEC_PLAIN, CODEC_PLAIN, false},
        {"blockwise", 17, 3, true, false, FMT_F32, FMT_F32, FMT_F32, CODEC_PLAIN, CODEC_PLAIN, CODEC_PLAIN, false},
        {"delayed", 17, 1, false, true, FMT_F32, FMT_F32, FMT_F32, CODEC_PLAIN, CODEC_PLAIN, CODEC_PLAIN, false},
        {"msamp-o1", 17, 1, false, false, FMT_F32, FMT_F32, FMT_F32, CODEC_PLAIN, CODEC_PLAIN, CODEC_PLAIN, false},
        {"msamp-o2", 17, 1, false, false, FMT_F16, FMT_E4M3, FMT_F16, CODEC_PLAIN, CODEC_EXPAND, CODEC_PLAIN, false},
        {"coat", 16, 1, false, false, FMT_F32, FMT_E4M3, FMT_E4M3, CODEC_PLAIN, CODEC_EXPAND, CODEC_EXPAND, true},
        {"flashoptim", 0, 0, false, false, FMT_I8, FMT_I8, FMT_U8, CODEC_SPLIT, CODEC_COMPAND, CODEC_SQRT, false},
    };
    int n_recipes;
    const NamedRecipe *all = precision_recipes(&n_recipes);
    int checked = 0;
    for (int r = 0; r < n_recipes; r++) {
        const RecipeExpect *e = NULL;
        for (size_t k = 0; k < sizeof want / sizeof want[0]; k++)
            if (!strcmp(want[k].name, all[r].name)) e = &want[k];
        if (all[r].refused) {   /* nothing to build: the driver refuses it with the reason */
            assert_null(e);
            assert_null(all[r].rules[0]);
            continue;
        }
        if (!e) fail_msg("recipe %s has no expectation in this test", all[r].name);
        assert_ptr_equal(precision_find_recipe(e->name), &all[r]);
        Arena *a = arena_new();
        RtMemory mem;
        char errors[2048];
        step_recipe = &all[r];
        Graph *g = step_with_rules(a, all[r].level, NULL, 0, &mem, errors, sizeof errors);
        step_recipe = NULL;
        if (!g) fail_msg("--recipe %s: %s", e->name, errors);
        GemmCount c = count_executed_gemms(g, e->delayed, e->e4m3_only);
        int modes[4] = {0}, grouped_saved = 0, history = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *n = g->nodes[i];
            if (n->op == OP_MATMUL && n->phase == PHASE_FORWARD) modes[IR_IATTR(n, MATMUL, fp8)]++;
            if (n->t.role == ROLE_SAVED && is_fp8(n->t.fmt.elem) && n->t.fmt.scaling == SCALE_PER_GROUP)
                grouped_saved++;
            if (n->op == OP_QUANTIZE && n->t.fmt.recipe == RECIPE_DELAYED) history = n->t.fmt.history;
        }
        print_message("%-18s -O%d: FP8 GEMMs %d/%d forward (mode %d: %d), %d grouped saved, history %d\n",
                      e->name, g->opt_level, c.fp8[0], c.all[0], e->fwd_mode, modes[e->fwd_mode],
                      grouped_saved, history);
        assert_int_equal(g->opt_level, all[r].level);
        assert_int_equal(c.fp8[0], e->fp8_gemms);
        if (e->fp8_gemms) assert_int_equal(modes[e->fwd_mode], e->fp8_gemms);
        assert_int_equal(grouped_saved > 0, e->grouped_saved);
        if (e->delayed) assert_int_equal(history, 1024);
        if (!strcmp(e->name, "rowwise_with_gw_hp")) assert_int_equal(c.fp8[2], 0);
        else if (e->fp8_gemms) assert_int_equal(c.fp8[2], c.fp8[0]);
        const char *p = "h.0.mlp.c_fc.weight";
        const struct { const char *suffix; ElemType elem; Codec codec; } states[] = {
            {"master", e->master, e->master_codec}, {"adam_m", e->m, e->m_codec}, {"adam_v", e->v, e->v_codec}};
        for (int k = 0; k < 3; k++) {
            char name[96];
            snprintf(name, sizeof name, "%s:%s", p, states[k].suffix);
            const Node *t = ir_find(g, name);
            if (!t) fail_msg("--recipe %s: no %s", e->name, name);
            if (t->t.fmt.elem != states[k].elem || t->t.fmt.codec != states[k].codec)
                fail_msg("--recipe %s: %s is %s (codec %d), expected %s (codec %d)", e->name, name,
                         fmt_elem_name(t->t.fmt.elem), t->t.fmt.codec, fmt_elem_name(states[k].elem),
                         states[k].codec);
        }
        rt_memory_free(&mem);
        arena_free(a);
        checked++;
    }
    assert_int_equal(checked, (int)(sizeof want / sizeof want[0]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bytes_per_param_o0),
        cmocka_unit_test(test_bytes_per_param_o1),
        cmocka_unit_test(test_bytes_per_param_o2),
        cmocka_unit_test(test_bytes_per_param_o3),
        cmocka_unit_test(test_bytes_per_param_release),
        cmocka_unit_test(test_peak_falls),
        cmocka_unit_test(test_kernel_program_flops),
        cmocka_unit_test(test_rules_reach_tensors),
        cmocka_unit_test(test_value_rules),
        cmocka_unit_test(test_gemm_rules_reach_every_gemm),
        cmocka_unit_test(test_grouped_rules_give_wgrad_per_tensor),
        cmocka_unit_test(test_state_rules_hold_or_are_refused),
        cmocka_unit_test(test_unmatched_rules_refused),
        cmocka_unit_test(test_policy_directory_refused),
        cmocka_unit_test(test_unaligned_gemms_fall_back),
        cmocka_unit_test(test_head_with_bias_stays_bf16),
        cmocka_unit_test(test_plan_shows_recomputed),
        cmocka_unit_test(test_recipes_plan_what_they_say),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
