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

#include "compiler.h"

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
        if (mm->op != OP_MATMUL || !mm->iattr[2] || mm->phase != PHASE_FORWARD) continue;
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

/* The step's peak falls at every level on GPT-2 d12, batch 32 x 1024. */
static void test_peak_falls(void **s)
{
    (void)s;
    int64_t peak[5];
    for (int level = 0; level <= 4; level++) {
        Arena *a = arena_new();
        Graph *g = compile_level(a, FP8C_SOURCE_DIR "/models/gpt2.model", level < 4 ? level : 3, level == 4, 32, 1024);
        MemSummary m;
        memplan_summarize(g, &m);
        peak[level] = m.persistent + m.transient;
        print_message("peak %s: %.3f GiB\n", level < 4 ? (const char *[]){"O0", "O1", "O2", "O3"}[level] : "O3+release",
                      (double)peak[level] / (1 << 30));
        arena_free(a);
    }
    for (int level = 1; level <= 4; level++) assert_true(peak[level] < peak[level - 1]);
    /* DESIGN.md's promise for the most compressed level: at most 0.6 of O0's peak */
    assert_true((double)peak[3] <= 0.6 * (double)peak[0]);
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
            if (!strncmp(w->t.name, "h.0.", 4)) fp8_in_h0 += n->iattr[2] != 0;
            if (!strncmp(w->t.name, "h.1.", 4)) fp8_in_h1 += n->iattr[2] != 0;
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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
