/* test_gpu_nvrtc.c — the GPU kernels of every model at every level compile (no GPU needed).
 *
 * For each model in models/ and each of -O0..-O3, the full pipeline runs, every node is
 * planned for the GPU and the resulting module goes through NVRTC for sm_90a. A rejected
 * module fails the test with NVRTC's log and the numbered source (nvrtc.c prints both); a
 * graph with a node the GPU backend cannot plan fails too, naming the node. Shapes are small
 * (batch 2, sequence 64): kernels depend on formats and ops, not on sizes, except attention's
 * head dimension, which is the model's own. The same graphs lowered to the kernel IR
 * (codegen.h, fused) and rendered by cuda/cg_render.c must compile too. Compiled modules are
 * cached in the build tree. FP8C_TEST_FILTER=name runs the tests of that name only. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compiler.h"
#include "gpu.h"

/* GEMMs that cuda_plan_epilogues gives a fused epilogue: with a bias, with a C term, and
 * with C the tensor written (an accumulation in place); bias gradients that their
 * gradient's quantize sums (fuse_bias_grads: the sum's own place runs nothing); and norms
 * whose backward runs as one pass (fuse_norm_grads) */
typedef struct {
    int gemms, bias, c, in_place, bias_grads, norm_grads;
} EpilogueCount;

static EpilogueCount count_epilogues(Graph *g, Arena *a) {
    EpilogueCount n = {0};
    char why[512];
    CuNodePlan *plain = cuda_plan_graph(g, a, why, sizeof why);
    if (!plain) return n;
    CuNodePlan *fused = cuda_plan_epilogues(g, plain, a);
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *m = g->nodes[i];
        if (m->op == OP_QUANTIZE && fused[i].n_launch == 2 &&
            strstr(fused[i].launch[1].body, "ck_colsum_final"))
            n.bias_grads++;
        for (int k = 0; k < fused[i].n_launch; k++)
            n.norm_grads += strstr(fused[i].launch[k].body, "ck_norm_bwd_fused") != NULL ||
                            strstr(fused[i].launch[k].body, "ck_norm_bwd_block") != NULL;   /* rows over 512 */
        if (!fused[i].members) continue;
        for (int k = 0; k < fused[i].n_launch; k++) {
            const CuGemm *gm = &fused[i].launch[k].gemm;
            if (fused[i].launch[k].kind != CU_GEMM) continue;
            n.gemms++;
            n.bias += gm->bias.node != NULL;
            n.c += gm->c.node != NULL;
            n.in_place += gm->c.node != NULL && gm->c.node == gm->d.node;
        }
    }
    return n;
}

/* The model at `path` through the whole pipeline at batch 2 x 64 and -O`level`, with
 * `rule` (a --precision rule) when given; NULL on errors */
static Graph *compile_model_choosing(Arena *a, const char *path, int level, const char *rule, const Choice *choice) {
    BuildOptions o;
    memset(&o, 0, sizeof o);
    o.choices = choice;
    o.n_choices = choice ? 1 : 0;
    o.front.batch = 2;
    o.front.seq = 64;
    o.passes.opt_level = level;
    const char *rules[1] = {rule};
    if (rule) {
        o.passes.overrides = rules;
        o.passes.n_overrides = 1;
    }
    diag_reset();
    Graph *g = pipeline_compile(a, path, &o);
    return g && !diag_error_count() ? g : NULL;
}

static Graph *compile_model(Arena *a, const char *path, int level, const char *rule) {
    return compile_model_choosing(a, path, level, rule, NULL);
}

/* gpt2_tiny through the whole pipeline (compile_model), asserted to compile */
static Graph *tiny_model(Arena *a, int level, const char *rule) {
    char path[4500];
    snprintf(path, sizeof path, "%s/models/gpt2_tiny.model", FP8C_SOURCE_DIR);
    Graph *g = compile_model(a, path, level, rule);
    assert_non_null(g);
    return g;
}

/* g's GPU module goes through NVRTC */
static void assert_module_compiles(const Graph *g) {
    CudaBinary bin;
    bool skipped = false;
    char why[512];
    assert_true(cuda_compile_graph(g, &bin, &skipped, why, sizeof why));
    assert_false(skipped);
    cuda_binary_free(&bin);
}

/* models/MODEL.model at batch x seq and -O`level`, through the whole pipeline */
static Graph *compile_shape(Arena *a, const char *model, int batch, int seq, int level) {
    char path[4500];
    snprintf(path, sizeof path, "%s/models/%s.model", FP8C_SOURCE_DIR, model);
    BuildOptions o;
    memset(&o, 0, sizeof o);
    o.front.batch = batch;
    o.front.seq = seq;
    o.passes.opt_level = level;
    diag_reset();
    Graph *g = pipeline_compile(a, path, &o);
    assert_true(g && !diag_error_count());
    return g;
}

static void test_every_model_every_level(void **state) {
    (void)state;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/models", FP8C_SOURCE_DIR);
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *de;
    int graphs = 0, failures = 0;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len < 7 || strcmp(de->d_name + len - 6, ".model")) continue;
        char path[4500];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        for (int level = 0; level <= 3; level++) {
            Arena *a = arena_new();
            Graph *g = compile_model(a, path, level, NULL);
            if (!g) {
                printf("  %-20s O%d: the pipeline failed\n", de->d_name, level);
                failures++;
                arena_free(a);
                continue;
            }
            CudaBinary bin;
            bool skipped = false;
            char why[512] = "";
            bool ok = cuda_compile_graph(g, &bin, &skipped, why, sizeof why);
            graphs++;
            if (!ok || skipped) {
                printf("  %-20s O%d: %s\n", de->d_name, level,
                       skipped ? why : "NVRTC rejected the module (source and log above)");
                failures++;
            } else {
                printf("  %-20s O%d: %zu bytes of sm_90a cubin%s\n", de->d_name, level,
                       bin.cubin_size, bin.cached ? " (cached)" : "");
            }
            cuda_binary_free(&bin);
            /* GPT-2's linear layers carry biases, two of them feed residual adds, and weight
             * gradients accumulate: each kind must reach cuBLASLt's epilogue */
            EpilogueCount ec = count_epilogues(g, a);
            printf("  %-20s O%d: %d GEMM epilogues (%d bias, %d C, %d in place), %d bias gradients summed by "
                   "their gradient's quantize, %d norm backwards in one pass\n", de->d_name, level, ec.gemms, ec.bias,
                   ec.c, ec.in_place, ec.bias_grads, ec.norm_grads);
            /* every model's norms take the residual stream's gradient: the fused backward applies */
            if ((!strncmp(de->d_name, "gpt2", 4) || !strncmp(de->d_name, "llama", 5)) && ec.norm_grads == 0) {
                printf("  %-20s O%d: expected norm backwards run as one pass\n", de->d_name, level);
                failures++;
            }
            if (!strncmp(de->d_name, "gpt2", 4) && level > 0 && ec.bias_grads == 0) {
                printf("  %-20s O%d: expected the bias gradients with their gradient's quantize\n", de->d_name, level);
                failures++;
            }
            if (!strncmp(de->d_name, "gpt2", 4) && (ec.bias == 0 || ec.c == ec.in_place || ec.in_place == 0)) {
                printf("  %-20s O%d: expected bias, residual and accumulating epilogues\n", de->d_name, level);
                failures++;
            }
            CgLowerOptions lo = {.fuse = true, .gemm_f32 = false};
            CgProgram *prog = cg_lower(g, a, &lo);
            if (!prog) {
                printf("  %-20s O%d: the kernel IR lowering failed\n", de->d_name, level);
                failures++;
            } else {
                char *src = cuda_render_cg_program(prog, a);
                if (!cuda_compile_source(src, "kernel-ir.cu", &bin)) {
                    printf("  %-20s O%d: NVRTC rejected the kernel IR module (source and log above)\n",
                           de->d_name, level);
                    failures++;
                } else {
                    printf("  %-20s O%d: kernel IR, %d kernels, %d bodies: %zu bytes of cubin%s\n", de->d_name,
                           level, prog->n_kernels, prog->n_funcs, bin.cubin_size, bin.cached ? " (cached)" : "");
                }
                cuda_binary_free(&bin);
            }
            arena_free(a);
        }
    }
    closedir(d);
    assert_true(graphs > 0);
    if (failures) fail_msg("%d of %d model graphs have GPU kernels that do not compile", failures, graphs);
}

/* Lion and SGD (plain and Nesterov momentum) at -O0..-O3: every update planned as
 * ck_momentum_coded over the level's momentum format (f32, e4m3 range expansion with the FP8
 * weight copy, companded i8 with the split master), and both modules through NVRTC. */
static void test_optimizers_every_level(void **state) {
    (void)state;
    const char *names[3] = {"lion", "sgd", "sgd"};
    char path[4500];
    snprintf(path, sizeof path, "%s/models/gpt2_tiny.model", FP8C_SOURCE_DIR);
    for (int o = 0; o < 3; o++) {
        for (int level = 0; level <= 3; level++) {
            Arena *a = arena_new();
            BuildOptions bo;
            memset(&bo, 0, sizeof bo);
            bo.front.batch = 2;
            bo.front.seq = 64;
            bo.passes.opt_level = level;
            bo.passes.optimizer = names[o];
            bo.passes.nesterov = o == 2;
            diag_reset();
            Graph *g = pipeline_compile(a, path, &bo);
            assert_non_null(g);
            assert_int_equal(diag_error_count(), 0);
            char why[512];
            CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
            if (!plans) fail_msg("%s O%d: %s", names[o], level, why);
            int updates = 0;
            for (int i = 0; i < g->n_nodes; i++) {
                if (g->nodes[i]->op != (o ? OP_SGD : OP_LION)) continue;
                updates++;
                assert_true(plans[i].n_launch >= 1);
                assert_non_null(strstr(plans[i].launch[0].body, "ck_momentum_coded"));
            }
            assert_true(updates > 0);
            assert_module_compiles(g);
            CgLowerOptions lo = {.fuse = true, .gemm_f32 = false};
            CgProgram *prog = cg_lower(g, a, &lo);
            assert_non_null(prog);
            CudaBinary bin;
            assert_true(cuda_compile_source(cuda_render_cg_program(prog, a), "kernel-ir.cu", &bin));
            printf("  gpt2_tiny %-12s O%d: %d updates, both modules compile\n", o == 2 ? "sgd nesterov" : names[o],
                   level, updates);
            cuda_binary_free(&bin);
            arena_free(a);
        }
    }
}

/* FP8 GEMMs with grouped scales: forward GEMMs (rows, or 1x128 tiles against 128x128 weight
 * blocks) and, with blocks, the input gradient's (tiles along the output features against the
 * weight's blocks read transposed) run on cuBLASLt with its scale modes; the precision pass
 * gives the weight gradients (the head's too, which the rule reaches) per-tensor operands; an
 * input gradient against row-scaled weights
 * (scales across its contraction) decodes both operands to f32. */
typedef struct {
    int fp8_gemms, grouped_fwd, grouped_bwd, per_tensor, decoded;
} GroupedCount;

static GroupedCount count_grouped(const char *rule) {
    GroupedCount c = {0};
    Arena *a = arena_new();
    char why[512];
    Graph *g = tiny_model(a, 1, rule);
    CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
    assert_non_null(plans);
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->op != OP_MATMUL || !IR_IATTR(n, MATMUL, fp8)) continue;
        c.fp8_gemms++;
        bool grouped = false, fp8 = false;
        for (int k = 0; k < plans[i].n_launch; k++) {
            const CuLaunch *l = &plans[i].launch[k];
            if (l->kind != CU_GEMM || l->gemm.scales < 0) continue;
            fp8 = true;
            grouped = l->gemm.scale_a != CU_SCALE_TENSOR && l->gemm.scale_b != CU_SCALE_TENSOR;
        }
        c.grouped_fwd += grouped && n->phase == PHASE_FORWARD;
        c.grouped_bwd += grouped && n->phase != PHASE_FORWARD;
        c.per_tensor += fp8 && !grouped;
        c.decoded += !fp8;
    }
    printf("  %-28s %d FP8 GEMMs: cuBLASLt scale modes %d forward, %d backward; %d per tensor; "
           "%d decoded\n", rule, c.fp8_gemms, c.grouped_fwd, c.grouped_bwd, c.per_tensor, c.decoded);
    arena_free(a);
    return c;
}

static void test_grouped_scales_plan(void **state) {
    (void)state;
    /* gpt2_tiny: 4 layers of 4 linear layers and the output head (a gemm: rule covers all
     * three GEMMs of each): 17 forward GEMMs, 17 input gradients, 17 weight gradients in FP8 */
    GroupedCount blk = count_grouped("gemm:*=e4m3:block128");
    assert_int_equal(blk.fp8_gemms, 51);
    assert_int_equal(blk.grouped_fwd, 17);
    assert_int_equal(blk.grouped_bwd, 17);
    assert_int_equal(blk.per_tensor, 17);
    assert_int_equal(blk.decoded, 0);
    GroupedCount row = count_grouped("gemm:*=e4m3:row");
    assert_int_equal(row.grouped_fwd, 17);
    assert_int_equal(row.grouped_bwd, 0);
    assert_int_equal(row.decoded, 17);
}

/* The FP8 GEMMs of gpt2_tiny -O1 in Hopper's fast accumulation: forward ones, and with
 * cuda.grad_fast_accum=1 the gradients' too, each GEMM launch's flag as the plan sets it */
static void count_fast(bool grads, int *fwd, int *bwd, int *bwd_all) {
    Arena *a = arena_new();
    char why[512];
    Graph *g = tiny_model(a, 1, NULL);
    if (grads) ir_set_choice(g, "cuda.grad_fast_accum", "1");
    CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
    assert_non_null(plans);
    *fwd = *bwd = *bwd_all = 0;
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < plans[i].n_launch; k++) {
            const CuLaunch *l = &plans[i].launch[k];
            if (l->kind != CU_GEMM || l->gemm.scales < 0) continue;
            bool forward = g->nodes[i]->phase == PHASE_FORWARD;
            *fwd += forward && l->gemm.fast_accum;
            *bwd += !forward && l->gemm.fast_accum;
            *bwd_all += !forward;
        }
    arena_free(a);
}

static void test_grad_fast_accum_choice(void **state) {
    (void)state;
    int fwd0, bwd0, all0, fwd1, bwd1, all1;
    count_fast(false, &fwd0, &bwd0, &all0);
    count_fast(true, &fwd1, &bwd1, &all1);
    printf("  gpt2_tiny -O1: %d forward FP8 GEMMs fast; of %d gradient ones %d by default, %d with "
           "cuda.grad_fast_accum=1\n", fwd0, all0, bwd0, bwd1);
    assert_true(fwd0 > 0 && all0 > 0);
    assert_int_equal(bwd0, 0);
    assert_int_equal(fwd1, fwd0);
    assert_int_equal(all1, all0);
    assert_int_equal(bwd1, all1);   /* every gradient GEMM of -O1 is per tensor */
}

/* Producers fused with the quantize of their value (spec.c, fuse_producer_quantizes): the
 * producer's plan stores only block maxima (CkAmaxOnly), its quantize's plan runs the same
 * kernel into the FP8 copy (CkThrough), reading the producer's own inputs. In gpt2_tiny every
 * layer's two layernorms and its GELU feed an FP8 GEMM alone: 12 pairs at each FP8 level. */
static bool plan_calls(const CuNodePlan *p, const char *what) {
    for (int k = 0; k < p->n_launch; k++)
        if (p->launch[k].kind == CU_KERNEL && strstr(p->launch[k].body, what)) return true;
    return false;
}

static void test_producer_quantize_plan(void **state) {
    (void)state;
    for (int level = 1; level <= 3; level++) {
        Arena *a = arena_new();
        char why[512];
        Graph *g = tiny_model(a, level, NULL);
        CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
        assert_non_null(plans);
        int pairs = 0, lone = 0, norms = 0, gelus = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *n = g->nodes[i];
            if (plan_calls(&plans[i], "CkAmaxOnly<")) lone++;
            /* a GELU's or a norm's copy may be written with its transposed copy
             * (fuse_cast_transposes: CkLdUnary, CkLdNorm, ck_norm_t) */
            bool norm_t = plan_calls(&plans[i], "ck_norm_t<");
            if (!plan_calls(&plans[i], "CkThrough<") && !plan_calls(&plans[i], "CkLdUnary<") &&
                !plan_calls(&plans[i], "CkLdNorm<") && !norm_t)
                continue;
            const Node *y = n->in[0];
            assert_int_equal(n->op, OP_QUANTIZE);
            assert_true(plan_calls(&plans[y->index], "CkAmaxOnly<"));
            /* t[0] is the FP8 copy, the inputs are the producer's (ck_norm_t: its own order) */
            const CuLaunch *l = &plans[i].launch[0];
            assert_ptr_equal(l->ref[0].node, n);
            for (int k = 0; k < y->n_in && !norm_t; k++) assert_ptr_equal(l->ref[1 + k].node, y->in[k]);
            pairs++;
            norms += y->op == OP_LAYERNORM;
            gelus += y->op == OP_GELU;
        }
        printf("  gpt2_tiny O%d: %d producers write their FP8 copy (%d layernorms, %d GELUs)\n", level, pairs,
               norms, gelus);
        assert_int_equal(pairs, 12);
        assert_int_equal(norms, 8);
        assert_int_equal(gelus, 4);
        assert_int_equal(lone, pairs);
        assert_module_compiles(g);   /* with the fused kernels */
        arena_free(a);
    }
}

/* Transposed FP8 copies written by the launch that writes the copy (spec_fuse.c,
 * fuse_cast_transposes): the plan of the TRANSPOSE and, where two quantizes make the same
 * bytes, of the second runs nothing, and the first's one launch (ck_quantize_t, or ck_norm_t
 * for a norm writing its copy by bands of rows) writes the transpose's tensor (its argument
 * i[1] or i[2]). A norm's copy is written by ck_quantize_t's tiles from the statistics its
 * amax pass kept (CkLdNorm, CkRowStats: that pass's own storage, t[i[2]]), by bands with
 * fuse.norm_stats=0.
 * Where the schedule puts the transposes depends on the sizes: in GPT-2 d12 at batch 32 x
 * 1024 -O1 each layer's transposes of the attention output's copy (made twice), of the GELU's
 * and of the two layernorms' (producers writing their own copies) come right after the
 * copies, 48 in all; in gpt2_tiny at batch 2 x 64 the backward's quantizes of the attention
 * outputs (-O1) and of the weights (-O3, 16) write theirs, and -O2 none. */
typedef struct {
    int fused, gelus, norms, tiles, twice, left;   /* norms: by bands of rows; tiles: norms' by tiles */
} CastCount;

static CastCount count_cast_transposes(const Graph *g, const CuNodePlan *plans) {
    CastCount n = {0, 0, 0, 0, 0, 0};
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *q = g->nodes[i], *t = NULL;
        if (q->op == OP_TRANSPOSE && plans[i].n_launch) n.left++;
        for (int k = 0; k < plans[i].n_absorbed; k++)
            if (plans[i].absorbed[k]->op == OP_TRANSPOSE) t = plans[i].absorbed[k];
        if (!t) continue;
        assert_int_equal(q->op, OP_QUANTIZE);
        assert_int_equal(plans[i].n_launch, 1);
        assert_int_equal(plans[t->index].n_launch, 0);
        const CuLaunch *l = &plans[i].launch[0];
        assert_true(strstr(l->body, "ck_quantize_t<") || strstr(l->body, "ck_norm_t<"));
        assert_ptr_equal(l->ref[0].node, q);
        assert_ptr_equal(l->ref[l->args.i[strstr(l->body, "ck_norm_t<") ? 2 : 1]].node, t);
        if (t->in[0] != q) {   /* the same bytes: the same value, scale and format */
            const Node *c = t->in[0];
            assert_ptr_equal(c->in[0], q->in[0]);
            assert_ptr_equal(c->t.fmt.scale, q->t.fmt.scale);
            assert_int_equal(c->t.fmt.elem, q->t.fmt.elem);
            assert_int_equal(plans[c->index].n_launch, 0);
            n.twice++;
        }
        n.gelus += plan_calls(&plans[i], "CkLdUnary<OP_GELU");
        n.norms += plan_calls(&plans[i], "ck_norm_t<");
        if (plan_calls(&plans[i], "CkLdNorm<")) {   /* the statistics the norm's own pass keeps */
            const Node *y = q->in[0];
            assert_ptr_equal(l->ref[l->args.i[2]].node, y);
            assert_int_equal(plans[y->index].n_launch, 1);
            assert_non_null(strstr(plans[y->index].launch[0].body, ", CkRowStats>(a)"));
            n.tiles++;
        }
        n.fused++;
    }
    return n;
}

static void test_cast_transpose_plan(void **state) {
    (void)state;
    Arena *a = arena_new();
    char why[512], path[4500];
    snprintf(path, sizeof path, "%s/models/gpt2.model", FP8C_SOURCE_DIR);
    BuildOptions o;
    memset(&o, 0, sizeof o);
    o.front.batch = 32;
    o.front.seq = 1024;
    o.passes.opt_level = 1;
    diag_reset();
    Graph *g = pipeline_compile(a, path, &o);
    assert_true(g && !diag_error_count());
    CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
    assert_non_null(plans);
    CastCount d12 = count_cast_transposes(g, plans);
    printf("  gpt2 d12 O1 batch 32 x 1024: %d transposes written with their copy (%d by a GELU, %d by a "
           "layernorm's tiles, %d by a first quantize of the same bytes), %d left\n", d12.fused, d12.gelus,
           d12.tiles, d12.twice, d12.left);
    assert_int_equal(d12.fused, 48);
    assert_int_equal(d12.gelus, 12);
    assert_int_equal(d12.tiles, 24);
    assert_int_equal(d12.norms, 0);
    assert_int_equal(d12.twice, 12);
    ir_set_choice(g, "fuse.norm_stats", "0");   /* the bands of rows */
    d12 = count_cast_transposes(g, cuda_plan_graph(g, a, why, sizeof why));
    assert_int_equal(d12.fused, 48);
    assert_int_equal(d12.tiles, 0);
    assert_int_equal(d12.norms, 24);
    printf("  fuse.norm_stats=0: %d by a layernorm's bands\n", d12.norms);
    arena_free(a);
    /* Llama's RMSNorms write their copies in both layouts too: by tiles, and with
     * fuse.norm_stats=0 by bands of 16 rows of 2048 (ck_norm_t) */
    a = arena_new();
    snprintf(path, sizeof path, "%s/models/llama.model", FP8C_SOURCE_DIR);
    o.front.batch = 4;
    o.front.seq = 2048;
    diag_reset();
    g = pipeline_compile(a, path, &o);
    assert_true(g && !diag_error_count());
    plans = cuda_plan_graph(g, a, why, sizeof why);
    assert_non_null(plans);
    CastCount llama = count_cast_transposes(g, plans);
    printf("  llama O1 batch 4 x 2048: %d transposes written with their copy (%d by an RMSNorm's tiles), %d left\n",
           llama.fused, llama.tiles, llama.left);
    assert_int_equal(llama.tiles, 44);
    assert_module_compiles(g);
    ir_set_choice(g, "fuse.norm_stats", "0");
    plans = cuda_plan_graph(g, a, why, sizeof why);
    llama = count_cast_transposes(g, plans);
    assert_int_equal(llama.norms, 44);
    assert_int_equal(llama.tiles, 0);
    for (int i = 0; i < g->n_nodes; i++)
        if (plan_calls(&plans[i], "ck_norm_t<")) assert_non_null(strstr(plans[i].launch[0].body, ", 8, 16, "));
    arena_free(a);
    /* the tiny model's four layers: at every FP8 level each layer's GELU and (at -O1, -O2) two
     * layernorms write their copy with its transpose (the copies saved as the transposed copy,
     * passes/layout.c), and plain quantizes the rest (attention's output; at -O3 the weights'
     * copies made at each use) */
    static const int expect[4] = {0, 16, 16, 24};
    for (int level = 1; level <= 3; level++) {
        a = arena_new();
        g = tiny_model(a, level, NULL);
        plans = cuda_plan_graph(g, a, why, sizeof why);
        assert_non_null(plans);
        CastCount n = count_cast_transposes(g, plans);
        printf("  gpt2_tiny O%d: %d transposes written with their copy (%d by a GELU, %d by a layernorm's bands, "
               "%d by its tiles, %d by a first quantize of the same bytes), %d left\n", level, n.fused, n.gelus,
               n.norms, n.tiles, n.twice, n.left);
        assert_int_equal(n.fused, expect[level]);
        assert_module_compiles(g);
        arena_free(a);
    }
}

/* A GEMM's dequantization scales computed by an earlier launch (spec_scales.c,
 * fold_inverse_scales), checked by running the plans' launch order on the host: the launches
 * of the micro-step (every forward and backward node, in order) and of the evaluation (the
 * forward nodes, each with its plan or the one it runs alone). Every node counts the
 * plans that write it (the plan that does its work: its node, an absorbed node or a
 * member); a launch with inverse jobs records, per slot, which scale nodes it read and their
 * counts; a GEMM that reads a slot must find it recorded, from its own operands' scales
 * (cuBLAS's A side first), with the counts unchanged since: the scales it would have
 * divided itself. Counts the folded GEMMs and the invscale launches left. */
typedef struct {
    int folded, left;
} InverseCount;

static InverseCount check_inverse_order(const Graph *g, const CuNodePlan *plans, bool eval) {
    InverseCount n = {0, 0};
    int64_t bytes = cuda_plan_descale_bytes(g, plans), n_slots = bytes / 128 + 1;
    int *writes = calloc((size_t)g->n_nodes, sizeof *writes);
    const Node **from = calloc((size_t)(2 * n_slots), sizeof *from);
    int *at = calloc((size_t)(2 * n_slots), sizeof *at);
    assert_true(writes && from && at);
    for (int64_t s = 0; s < 2 * n_slots; s++) at[s] = -1;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *m = g->nodes[i];
        if (m->phase == PHASE_UPDATE || (eval && m->phase != PHASE_FORWARD)) continue;
        const CuNodePlan *p = eval && plans[i].alone ? plans[i].alone : &plans[i];
        for (int k = 0; k < p->n_launch; k++) {
            const CuLaunch *l = &p->launch[k];
            if (l->scale_amax) writes[l->scale_to->index]++;   /* block 0 makes it first (ck_entry) */
            for (int j = 0; j < l->n_inv; j++) {
                int64_t slot = l->inv_slot[j] / 128;
                assert_true(l->inv_slot[j] % 128 == 0 && l->inv_slot[j] + 128 <= bytes);
                for (int h = 0; h < 2; h++) {
                    from[2 * slot + h] = l->inv_from[2 * j + h];
                    at[2 * slot + h] = l->inv_from[2 * j + h] ? writes[l->inv_from[2 * j + h]->index] : -1;
                }
            }
            if (l->kind == CU_KERNEL && !strncmp(l->fn, "invscale", 8)) n.left++;
            if (l->kind != CU_GEMM || !l->gemm.descaled) continue;
            const CuGemm *gm = &l->gemm;
            int64_t slot = gm->descales / 128;
            const Node *want[2] = {gm->a.node->t.fmt.scale, gm->b.node->t.fmt.scale};
            for (int h = 0; h < 2; h++) {
                assert_ptr_equal(from[2 * slot + h], want[h]);
                assert_int_equal(at[2 * slot + h], writes[want[h]->index]);
            }
            n.folded++;
        }
        /* this plan's writes count after its launches' reads (a hook writes none of its scales
         * but the one it makes from an amax, above) */
        if (p->n_launch) {
            writes[p->node->index]++;
            for (int k = 0; k < p->n_absorbed; k++)
                if (!(p->n_launch == 1 && p->launch[0].scale_to == p->absorbed[k] && p->launch[0].scale_amax))
                    writes[p->absorbed[k]->index]++;
            for (int k = 0; k < p->n_members; k++)
                if (p->members[k] != p->node) writes[p->members[k]->index]++;
        }
    }
    free(writes);
    free(from);
    free(at);
    return n;
}

static void test_inverse_scales_plan(void **state) {
    (void)state;
    char why[512];
    static const struct {
        const char *model;
        int batch, seq, level, folded, left;
    } cases[] = {
        {"gpt2", 32, 1024, 1, 144, 0}, {"gpt2", 32, 1024, 3, 156, 0}, {"llama", 4, 2048, 1, 462, 0},
        {"gpt2_tiny", 2, 64, 1, -1, -1}, {"gpt2_tiny", 2, 64, 2, -1, -1}, {"gpt2_tiny", 2, 64, 3, -1, -1},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        Arena *a = arena_new();
        Graph *g = compile_shape(a, cases[c].model, cases[c].batch, cases[c].seq, cases[c].level);
        CuNodePlan *plans = cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a);
        InverseCount micro = check_inverse_order(g, plans, false), eval = check_inverse_order(g, plans, true);
        printf("  %s O%d batch %d x %d: %d GEMMs read scales an earlier launch made (%d in the evaluation), %d "
               "invscale launches left\n", cases[c].model, cases[c].level, cases[c].batch, cases[c].seq,
               micro.folded, eval.folded, micro.left);
        assert_true(micro.folded > 0 && eval.folded > 0);
        if (cases[c].folded >= 0) {
            assert_int_equal(micro.folded, cases[c].folded);
            assert_int_equal(micro.left, cases[c].left);
        }
        /* switched off, every GEMM makes its own */
        ir_set_choice(g, "fuse.inverse_scales", "0");
        plans = cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a);
        InverseCount off = check_inverse_order(g, plans, false);
        assert_int_equal(off.folded, 0);
        assert_int_equal(off.left, micro.folded + micro.left);
        ir_set_choice(g, "fuse.inverse_scales", "1");
        if (!strcmp(cases[c].model, "gpt2_tiny")) assert_module_compiles(g);
        arena_free(a);
    }
}

/* Attention's result scale made by its own launches (spec_scales.c, fold_attention_scales): per
 * folded scale, the scale's node has no launch left; the attention's plan absorbed it, and its
 * launches that store the result (the forward's one; the backward's dq pass, then its dk/dv
 * pass) carry the scale in t[11], the margin in f[2], and the largest value of the element
 * type in f[1] on the last of them only (the one that stores the scale), never on the
 * statistics' launches. Counted for GPT-2 d12 at -O1 and -O3 (each layer's y and packed
 * dq|dk|dv) and Llama 1.1B at -O1 (y: its dq, dk, dv go through RoPE's backward before their
 * scale); switched off, every one of those scales has its pass again. */
static int check_attention_scales(const Graph *g, const CuNodePlan *plans) {
    int folded = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const CuNodePlan *p = &plans[i];
        const Node *n = g->nodes[i];
        if (n->op != OP_ATTENTION && n->op != OP_ATTENTION_BWD) continue;
        const Node *qs = NULL;
        for (int k = 0; k < p->n_absorbed; k++)
            if (p->absorbed[k]->op == OP_QUANT_SCALE) qs = p->absorbed[k];
        if (!qs) continue;
        assert_ptr_equal(qs->in[0], n);
        assert_int_equal(plans[qs->index].n_launch, 0);
        int writers = 0, last = -1;
        for (int k = 0; k < p->n_launch; k++) {
            const CuLaunch *l = &p->launch[k];
            if (l->ref[11].node != qs) {
                assert_null(l->ref[11].node);
                continue;
            }
            assert_true(strstr(l->body, "_fwd<") || strstr(l->body, "_dq<") || strstr(l->body, "_dkv<"));
            assert_true(l->args.f[2] == (double)IR_IATTR(qs, QUANT_SCALE, margin));
            writers++;
            last = k;
        }
        assert_int_equal(writers, n->op == OP_ATTENTION ? 1 : 2);
        for (int k = 0; k < p->n_launch; k++)
            if (p->launch[k].ref[11].node == qs)
                assert_true(k == last ? p->launch[k].args.f[1] > 0 : p->launch[k].args.f[1] == 0);
        folded++;
    }
    return folded;
}

static int attention_scale_passes(const Graph *g, const CuNodePlan *plans) {
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *x = g->nodes[i]->op == OP_QUANT_SCALE ? g->nodes[i]->in[0] : NULL;
        if (x && (x->op == OP_ATTENTION || x->op == OP_ATTENTION_BWD) && plans[i].n_launch) n++;
    }
    return n;
}

static void test_attention_scales_plan(void **state) {
    (void)state;
    char why[512];
    static const struct {
        const char *model;
        int batch, seq, level, folded;
    } cases[] = {
        {"gpt2", 32, 1024, 1, 24}, {"gpt2", 32, 1024, 3, 24}, {"llama", 4, 2048, 1, 22}, {"gpt2_tiny", 2, 64, 1, 8},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        Arena *a = arena_new();
        Graph *g = compile_shape(a, cases[c].model, cases[c].batch, cases[c].seq, cases[c].level);
        CuNodePlan *plans = cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a);
        int folded = check_attention_scales(g, plans), left = attention_scale_passes(g, plans);
        printf("  %s O%d batch %d x %d: %d attention scales made by the attention's launches, %d passes left\n",
               cases[c].model, cases[c].level, cases[c].batch, cases[c].seq, folded, left);
        assert_int_equal(folded, cases[c].folded);
        ir_set_choice(g, "fuse.attention_scales", "0");
        plans = cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a);
        assert_int_equal(check_attention_scales(g, plans), 0);
        assert_int_equal(attention_scale_passes(g, plans), folded + left);
        ir_set_choice(g, "fuse.attention_scales", "1");
        if (!strcmp(cases[c].model, "gpt2_tiny")) assert_module_compiles(g);
        arena_free(a);
    }
}

/* Per-tensor scales stored by the last block of the launch that leaves their value's block
 * maxima (spec_scales.c, fold_amax_scales): per folded scale, the scale's node has no launch
 * left and the producer's plan absorbed it; the launch carries the scale node, the largest
 * value of the scale's element type and its margin, writes the value's maxima (t[0], its
 * offset), runs a one-dimensional unbatched grid, and no launch runs between its plan and the
 * scale's place. The qsparts launches left are counted too; switched off, every folded scale
 * has its launch again. */
typedef struct {
    int folded, left;
} AmaxScaleCount;

static AmaxScaleCount check_amax_scales(const Graph *g, const CuNodePlan *plans) {
    AmaxScaleCount n = {0, 0};
    for (int i = 0; i < g->n_nodes; i++) {
        const CuNodePlan *p = &plans[i];
        for (int k = 0; k < p->n_launch; k++) {
            const CuLaunch *l = &p->launch[k];
            if (l->kind == CU_KERNEL && !strncmp(l->fn, "qsparts", 7)) n.left++;
            const Node *qs = l->scale_to;
            if (!qs) assert_null(l->args.scale_to);
            if (!qs || l->scale_amax) continue;   /* none, or made from an amax (check_state_scales) */
            assert_int_equal(qs->op, OP_QUANT_SCALE);
            assert_int_equal(IR_IATTR(qs, QUANT_SCALE, scaling), SCALE_PER_TENSOR);
            assert_true(qs->index > i && plans[qs->index].n_launch == 0);
            for (int j = i + 1; j < qs->index; j++) assert_int_equal(plans[j].n_launch, 0);
            bool absorbed = false;
            for (int j = 0; j < p->n_absorbed; j++) absorbed |= p->absorbed[j] == qs;
            assert_true(absorbed);
            assert_ptr_equal(l->ref[0].node, qs->in[0]);
            assert_int_equal(l->args.i[CK_AMAX_AT], ir_amax_parts_offset(qs->in[0]));
            assert_true(l->args.scale_max == (double)num_elem_max((ElemType)IR_IATTR(qs, QUANT_SCALE, elem)));
            assert_int_equal(l->args.scale_margin, IR_IATTR(qs, QUANT_SCALE, margin));
            assert_true(l->grid[1] == 1 && !l->batch && !p->members && !p->alone);
            n.folded++;
        }
    }
    return n;
}

static void test_amax_scales_plan(void **state) {
    (void)state;
    char why[512];
    static const struct {
        const char *model;
        int batch, seq, level, folded, left;
    } cases[] = {
        {"llama", 4, 2048, 1, 220, 0}, {"llama", 4, 2048, 3, 220, 0}, {"gpt2", 32, 1024, 1, 72, 0},
        {"gpt2", 32, 1024, 3, 72, 0}, {"gpt2_tiny", 2, 64, 1, 17, 7},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        Arena *a = arena_new();
        Graph *g = compile_shape(a, cases[c].model, cases[c].batch, cases[c].seq, cases[c].level);
        CuNodePlan *plans = cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a);
        AmaxScaleCount on = check_amax_scales(g, plans);
        ir_set_choice(g, "fuse.amax_scales", "0");
        plans = cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a);
        AmaxScaleCount off = check_amax_scales(g, plans);
        printf("  %s O%d batch %d x %d: %d scales stored by their producer's launch, %d qsparts launches left "
               "(off: %d)\n", cases[c].model, cases[c].level, cases[c].batch, cases[c].seq, on.folded, on.left, off.left);
        assert_int_equal(off.folded, 0);
        assert_int_equal(off.left, on.folded + on.left);
        if (cases[c].folded >= 0) {
            assert_int_equal(on.folded, cases[c].folded);
            assert_int_equal(on.left, cases[c].left);
        }
        ir_set_choice(g, "fuse.amax_scales", "1");
        arena_free(a);
    }
    /* every model at every level compiles either way (the kernels' code is the same: the scale
     * is the launch's argument) */
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/models", FP8C_SOURCE_DIR);
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len < 7 || strcmp(de->d_name + len - 6, ".model")) continue;
        char path[4500];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        for (int level = 0; level <= 3; level++)
            for (int k = 0; k < 2; k++) {
                Arena *a = arena_new();
                Choice choice = {"fuse.amax_scales", k ? "0" : "1"};
                Graph *g = compile_model_choosing(a, path, level, NULL, &choice);
                assert_non_null(g);
                AmaxScaleCount n = check_amax_scales(g, cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a));
                if (k) assert_int_equal(n.folded, 0);
                printf("  %-20s O%d fuse.amax_scales=%s: %d folded, %d qsparts left\n", de->d_name, level, choice.value,
                       n.folded, n.left);
                assert_module_compiles(g);
                arena_free(a);
            }
    }
    closedir(d);
}

/* Per-tensor scales of a stored amax made by the copy they scale (spec_scales.c,
 * fold_state_scales): per folded scale, the scale's node has no launch left and the copy's
 * plan absorbed it; the launch is the plan's only one, a ck_copy or ck_quantize_t of a
 * QUANTIZE scaled by that node, carrying the amax (a persistent f32 scalar, the scale's
 * input), the largest value of the scale's element type and its margin; no launch between
 * the scale's place and the copy's names the scale among its tensors or their scales, and
 * none of the update runs between. The ck_quant_scale_tensor launches of such scales left are
 * counted too; switched off, every folded scale has its launch again. */
typedef struct {
    int folded, left;
} StateScaleCount;

static bool launch_names(const CuLaunch *l, const Node *x) {
    if (l->kind == CU_GEMM) {
        const CuRef *r[] = {&l->gemm.a, &l->gemm.b, &l->gemm.c, &l->gemm.d, &l->gemm.bias, &l->gemm.aux};
        for (size_t q = 0; q < sizeof r / sizeof *r; q++)
            if (r[q]->node && (r[q]->node == x || r[q]->node->t.fmt.scale == x)) return true;
        return false;
    }
    for (int k = 0; k < CK_MAX_TENSORS; k++)
        if (l->ref[k].node && (l->ref[k].node == x || (l->ref_scale[k] && l->ref[k].node->t.fmt.scale == x)))
            return true;
    for (int k = 0; k < 2 * l->n_inv; k++)
        if (l->inv_from[k] == x) return true;
    return l->scale_to == x;
}

static StateScaleCount check_state_scales(const Graph *g, const CuNodePlan *plans) {
    StateScaleCount n = {0, 0};
    for (int i = 0; i < g->n_nodes; i++) {
        const CuNodePlan *p = &plans[i];
        const Node *m = g->nodes[i];
        if (m->op == OP_QUANT_SCALE && p->n_launch == 1 && !strncmp(p->launch[0].body, "ck_quant_scale_tensor<", 22) &&
            ir_numel(&m->in[0]->t) == 1 && ir_role_is_persistent(m->in[0]->t.role))
            n.left++;
        for (int k = 0; k < p->n_launch; k++) {
            const CuLaunch *l = &p->launch[k];
            if (!l->scale_amax) {
                assert_null(l->args.scale_amax);
                continue;
            }
            const Node *qs = l->scale_to;
            assert_non_null(qs);
            assert_int_equal(qs->op, OP_QUANT_SCALE);
            assert_int_equal(IR_IATTR(qs, QUANT_SCALE, scaling), SCALE_PER_TENSOR);
            assert_ptr_equal(l->scale_amax, qs->in[0]);
            assert_true(ir_numel(&qs->in[0]->t) == 1 && qs->in[0]->t.fmt.elem == FMT_F32 &&
                        ir_role_is_persistent(qs->in[0]->t.role));
            assert_true(qs->index < i && plans[qs->index].n_launch == 0);
            assert_true(p->n_launch == 1 && !p->members && !l->batch);
            assert_true(!strncmp(l->body, "ck_copy<", 8) || !strncmp(l->body, "ck_quantize_t<", 14));
            assert_int_equal(p->node->op, OP_QUANTIZE);
            assert_ptr_equal(p->node->t.fmt.scale, qs);
            assert_ptr_equal(l->ref[0].node, p->node);
            assert_int_equal(p->node->phase, qs->phase);
            bool absorbed = false;
            for (int j = 0; j < p->n_absorbed; j++) absorbed |= p->absorbed[j] == qs;
            assert_true(absorbed);
            assert_true(l->args.scale_max == (double)num_elem_max((ElemType)IR_IATTR(qs, QUANT_SCALE, elem)));
            assert_int_equal(l->args.scale_margin, IR_IATTR(qs, QUANT_SCALE, margin));
            for (int j = qs->index + 1; j < i; j++) {
                assert_int_not_equal(g->nodes[j]->phase, PHASE_UPDATE);
                const CuNodePlan *b = plans[j].alone ? plans[j].alone : &plans[j];
                for (int h = 0; h < plans[j].n_launch; h++) assert_false(launch_names(&plans[j].launch[h], qs));
                for (int h = 0; h < b->n_launch; h++) assert_false(launch_names(&b->launch[h], qs));
            }
            n.folded++;
        }
    }
    return n;
}

static void test_state_scales_plan(void **state) {
    (void)state;
    char why[512];
    static const struct {
        const char *model;
        int batch, seq, level, folded;
    } cases[] = {
        {"gpt2", 32, 1024, 3, 48}, {"llama", 4, 2048, 3, 154}, {"llama", 4, 2048, 1, 0}, {"gpt2_tiny", 2, 64, 3, 16},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        Arena *a = arena_new();
        Graph *g = compile_shape(a, cases[c].model, cases[c].batch, cases[c].seq, cases[c].level);
        StateScaleCount on = check_state_scales(g, cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a));
        ir_set_choice(g, "fuse.state_scales", "0");
        StateScaleCount off = check_state_scales(g, cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a));
        printf("  %s O%d batch %d x %d: %d scales made by the copies they scale, %d launches left (off: %d)\n",
               cases[c].model, cases[c].level, cases[c].batch, cases[c].seq, on.folded, on.left, off.left);
        assert_int_equal(on.folded, cases[c].folded);
        assert_int_equal(off.folded, 0);
        assert_int_equal(off.left, on.folded + on.left);
        ir_set_choice(g, "fuse.state_scales", "1");
        if (!strcmp(cases[c].model, "gpt2_tiny")) assert_module_compiles(g);
        arena_free(a);
    }
}

/* The integer template argument k (0: the first) of a launch's call, "ck_norm<1, 3, 1536, F<..":
 * -1 where it has no such argument */
static long template_int(const char *body, int k) {
    const char *p = strchr(body, '<');
    for (int i = 0; p && i < k; i++) p = strchr(p + 1, ',');
    if (!p) return -1;
    char *end;
    long v = strtol(p + 1, &end, 10);
    return end == p + 1 ? -1 : v;
}

/* Each norm launch of gpt2_tiny -O1 (the layernorms' amax passes, their FP8 copies in both
 * layouts, the fused backwards), its slot bytes ST and its dynamic shared memory: with
 * norm.stage (the default) every one stages its rows, ST a row of x's vectors (128 columns,
 * bf16: 512 bytes; the backward's rows of the widest of x, dy and the other term, all three
 * staged) and the rings in its shared memory, the amax pass in a grid of 4 rows a warp; with
 * norm.stage=0 none does; with norm.stage@ID=0 only that node's launches do not (the copies
 * by bands of rows: fuse.norm_stats=0). The module compiles either way. Llama 1.1B's rows of 2048 stage too, the backward without the other
 * term (all three would leave room for one block an SM); every staged launch leaves room for
 * two blocks an SM. */
typedef struct {
    int launches, staged, bwd_tensors;   /* the most tensors a backward stages */
} NormStages;
static NormStages norm_stages(const Graph *g, const CuNodePlan *plans, const Node *only_off, int64_t rows) {
    NormStages n = {0, 0, 0};
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < plans[i].n_launch; k++) {
            const CuLaunch *l = &plans[i].launch[k];
            bool plain = strstr(l->body, "ck_norm<") != NULL, band = strstr(l->body, "ck_norm_t<") != NULL,
                 bwd = strstr(l->body, "ck_norm_bwd_fused<") != NULL, off = only_off && plans[i].node == only_off;
            if (!plain && !band && !bwd) continue;
            long nv = template_int(l->body, bwd ? 2 : 1), st = template_int(l->body, plain ? 2 : 3);
            n.launches++;
            if (st > 0) {
                n.staged++;
                assert_false(off);
                assert_int_equal(st % (nv * 512), 0);   /* a row of bf16 (or wider) vectors */
                unsigned sums = bwd ? (unsigned)(4 * (1 + template_int(l->body, 1)) * nv * 32 * 8 * 4) : 0;
                unsigned tile = band ? (unsigned)(template_int(l->body, 2) * (nv * 256 + 16)) : 0;
                int tensors = bwd ? (int)l->args.i[3] : 1;
                if (bwd) {   /* x and dy, and the other term where there is one (the layers') */
                    assert_true(tensors == 2 || tensors == 3);
                    if (tensors > n.bwd_tensors) n.bwd_tensors = tensors;
                }
                assert_int_equal(l->smem, sums + 2 * (unsigned)st * (l->block / 32) * (unsigned)tensors);
                assert_true(2 * (l->smem + tile + 1024) <= 227 * 1024);
                if (plain) assert_int_equal(l->grid[0], (rows + 31) / 32);   /* 4 rows a warp, 8 warps */
                if (bwd) assert_int_equal(l->grid[0], (rows + 3) / 4 < 1024 ? (rows + 3) / 4 : 1024);   /* unstaged's */
            } else {
                assert_int_equal(st, 0);
                if (!bwd) assert_int_equal(l->smem, 0);
            }
        }
    return n;
}
static void test_norm_stage_plan(void **state) {
    (void)state;
    char path[4500], why[512];
    snprintf(path, sizeof path, "%s/models/gpt2_tiny.model", FP8C_SOURCE_DIR);
    Arena *a = arena_new();
    Graph *g = compile_model_choosing(a, path, 1, NULL, NULL);
    assert_non_null(g);
    ir_set_choice(g, "fuse.norm_stats", "0");   /* the copies by bands of rows (ck_norm_t), staged too */
    NormStages on = norm_stages(g, cuda_plan_graph(g, a, why, sizeof why), NULL, 2 * 64);
    /* 9 layernorms, each a backward; the 8 of the layers an amax pass and a copy, the last a
     * bf16 value */
    assert_int_equal(on.launches, 9 + 8 + 9);
    assert_int_equal(on.staged, on.launches);
    assert_int_equal(on.bwd_tensors, 3);
    ir_set_choice(g, "norm.stage", "0");
    NormStages off = norm_stages(g, cuda_plan_graph(g, a, why, sizeof why), NULL, 2 * 64);
    assert_int_equal(off.launches, on.launches);
    assert_int_equal(off.staged, 0);
    assert_module_compiles(g);
    ir_set_choice(g, "norm.stage", "1");
    const Node *ln = NULL;
    for (int i = 0; i < g->n_nodes && !ln; i++)
        if (g->nodes[i]->op == OP_LAYERNORM) ln = g->nodes[i];
    assert_non_null(ln);
    char name[64];
    snprintf(name, sizeof name, "norm.stage@%d", ln->id);
    ir_set_choice(g, name, "0");
    NormStages one = norm_stages(g, cuda_plan_graph(g, a, why, sizeof why), ln, 2 * 64);
    assert_true(one.staged < on.staged && one.staged >= on.staged - 2);
    arena_free(a);

    /* every value in f32 (the Hugging Face checks' builds): the last layernorm's backward, with
     * no other term, and the layers' have one body, so one set of launch bounds */
    a = arena_new();
    BuildOptions o;
    memset(&o, 0, sizeof o);
    o.front.batch = 2;
    o.front.seq = 16;
    const char *f32[2] = {"*=f32", "value:*=f32"};
    o.passes.overrides = f32;
    o.passes.n_overrides = 2;
    diag_reset();
    g = pipeline_compile(a, path, &o);
    assert_true(g && !diag_error_count());
    CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < plans[i].n_launch; k++)
            for (int j = i; j < g->n_nodes; j++)
                for (int m = j == i ? k + 1 : 0; m < plans[j].n_launch; m++)
                    if (!strcmp(plans[i].launch[k].body, plans[j].launch[m].body))
                        assert_int_equal(plans[i].launch[k].min_blocks, plans[j].launch[m].min_blocks);
    assert_module_compiles(g);
    arena_free(a);

    /* Llama's backward takes a block a row by default (test_norm_block_plan), so its rows
     * stage with norm.bwd_block=0 */
    a = arena_new();
    g = compile_shape(a, "llama", 4, 2048, 1);
    ir_set_choice(g, "norm.bwd_block", "0");
    NormStages llama = norm_stages(g, cuda_plan_graph(g, a, why, sizeof why), NULL, 4 * 2048);
    printf("  llama O1 batch 4 x 2048: %d of %d norm launches staged, the backward's %d tensors\n", llama.staged,
           llama.launches, llama.bwd_tensors);
    assert_int_equal(llama.staged, llama.launches);
    assert_int_equal(llama.bwd_tensors, 2);
    arena_free(a);
}

/* The fused norm backward of rows over 1024 columns, a block a row (spec_ops.c,
 * norm_grads_block; ck_norm_bwd_block). Per model: the normbwd launches a block a row, and
 * those a warp a row, by default and with norm.bwd_block=0. Llama 1.1B at batch 4 x 2048
 * -O1: the 44 fused of its 45 (22 layers x 2 and the last) a block a row, a vector a thread
 * (256 threads, rows of 2048), a grid of 512, launch bounds of four blocks an SM; with the
 * choice off all 44 a warp a row. GPT-2 d12's 25 (rows of 768) in blocks of 96 threads, nine an SM, a grid
 * of 1024 (the block maxima's slots). GPT-2 d48's rows of 1600 (LayerNorm, a bias: HB 1) in blocks of 224 threads; Llama
 * 7B's rows of 4096 two vectors a thread. Each of those compiles (two layers each, -O1 and
 * -O3: x an FP8 copy scaled per group). */
typedef struct {
    int block, warps;
} NormBlocks;
static NormBlocks norm_blocks(const Graph *g, const CuNodePlan *plans, int64_t rows, int ln, int vpt,
                              unsigned threads) {
    NormBlocks n = {0, 0};
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < plans[i].n_launch; k++) {
            const CuLaunch *l = &plans[i].launch[k];
            if (strstr(l->body, "ck_norm_bwd_fused<")) n.warps++;
            if (!strstr(l->body, "ck_norm_bwd_block<")) continue;
            n.block++;
            assert_int_equal(template_int(l->body, 0), ln);
            assert_int_equal(template_int(l->body, 1), ln);   /* LayerNorm has a bias */
            assert_int_equal(template_int(l->body, 2), vpt);
            assert_int_equal(l->block, threads);
            unsigned blocks = vpt == 1 ? (threads >= 128 ? 1024 : 896) / threads : 0;
            int64_t grid = 128 * (blocks ? blocks : 4) < 1024 ? 128 * (blocks ? blocks : 4) : 1024;
            assert_int_equal(l->grid[0], rows < grid ? rows : grid);
            assert_int_equal(l->smem, 0);
            assert_int_equal(l->min_blocks, blocks);
        }
    return n;
}
/* models/MODEL.model with the defines, at batch x seq and -Olevel, with the choice NAME=VALUE
 * (none where value is NULL), asserted to compile */
static Graph *shaped_model(Arena *a, const char *model, const Define *defs, int n_defs, int batch, int seq, int level,
                           const char *name, const char *value) {
    char path[4500];
    snprintf(path, sizeof path, "%s/models/%s.model", FP8C_SOURCE_DIR, model);
    BuildOptions o;
    memset(&o, 0, sizeof o);
    o.front.defines = defs;
    o.front.n_defines = n_defs;
    o.front.batch = batch;
    o.front.seq = seq;
    o.passes.opt_level = level;
    Choice c = {name, value};
    o.choices = value ? &c : NULL;
    o.n_choices = value ? 1 : 0;
    diag_reset();
    Graph *g = pipeline_compile(a, path, &o);
    assert_true(g && !diag_error_count());
    return g;
}
static Graph *norm_model(Arena *a, const char *model, const Define *defs, int n_defs, int batch, int seq, int level,
                         const char *block) {
    return shaped_model(a, model, defs, n_defs, batch, seq, level, "norm.bwd_block", block);
}
static void test_norm_block_plan(void **state) {
    (void)state;
    char why[512];
    for (int k = 0; k < 2; k++) {
        Arena *a = arena_new();
        Graph *g = norm_model(a, "llama", NULL, 0, 4, 2048, 1, k ? "0" : "1");
        NormBlocks n = norm_blocks(g, cuda_plan_graph(g, a, why, sizeof why), 4 * 2048, 0, 1, 256);
        printf("  llama O1 batch 4 x 2048, norm.bwd_block=%d: %d backwards a block a row, %d a warp a row\n", !k,
               n.block, n.warps);
        /* 44 of the 45 norm backwards fused: the first of the backward runs unfused, since the
         * memory plan lays its sum with the residual's gradient partly over its dy (which
         * fuse_norm_grads refuses: the one pass would write rows it has yet to read) */
        assert_int_equal(n.block, k ? 0 : 44);
        assert_int_equal(n.warps, k ? 44 : 0);
        arena_free(a);
    }
    Arena *a = arena_new();
    Graph *g = compile_shape(a, "gpt2", 32, 1024, 1);
    NormBlocks d12 = norm_blocks(g, cuda_plan_graph(g, a, why, sizeof why), 32 * 1024, 1, 1, 96);
    assert_int_equal(d12.block, 25);
    assert_int_equal(d12.warps, 0);
    arena_free(a);

    static const Define d48[] = {{"layers", "2"}, {"dim", "1600"}, {"heads", "25"}};
    static const Define l7b[] = {{"layers", "2"}, {"dim", "4096"}, {"heads", "32"}, {"kv_heads", "8"},
                                 {"hidden", "11008"}, {"vocab", "512"}};
    for (int level = 1; level <= 3; level += 2) {
        a = arena_new();
        g = norm_model(a, "gpt2", d48, 3, 2, 64, level, "1");
        NormBlocks n = norm_blocks(g, cuda_plan_graph(g, a, why, sizeof why), 2 * 64, 1, 1, 224);
        assert_int_equal(n.block, 5);
        assert_int_equal(n.warps, 0);
        assert_module_compiles(g);
        arena_free(a);
        a = arena_new();
        g = norm_model(a, "llama", l7b, 6, 2, 64, level, "1");
        n = norm_blocks(g, cuda_plan_graph(g, a, why, sizeof why), 2 * 64, 0, 2, 256);
        printf("  O%d: d48's rows of 1600 and 7B's of 4096 a block a row, each compiled\n", level);
        assert_int_equal(n.block, 5);
        assert_int_equal(n.warps, 0);
        assert_module_compiles(g);
        arena_free(a);
    }
}

/* SwiGLU's elementwise producers inside their readers (spec_fuse.c, fuse_inline_elementwise),
 * Llama 1.1B at batch 4 x 2048, -O1: each layer's silu(gate) and its copy in the backward
 * (save.activations=0) run no launch, and both products that read them (the forward's
 * silu(gate) * up, the backward's dy * silu(gate)) compute them from gate; the backward's dy * up runs no launch, and the silu gradient computes it from dy and
 * up. With fuse.inline_elementwise=0 every one of them is a launch of its own again, and
 * both programs compile (a two-layer Llama at -O0 to -O3). */
typedef struct {
    int act_idle, act_read, prod_idle, prod_read;
} InlineCount;

static InlineCount count_inlined(const Graph *g, const CuNodePlan *plans) {
    InlineCount c = {0};
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        const CuNodePlan *p = &plans[i];
        const char *body = p->n_launch == 1 ? p->launch[0].body : "";
        if (n->op == OP_SILU && p->n_launch == 0) c.act_idle++;
        if (n->op == OP_MUL && strstr(body, "CkAct<OP_SILU")) c.act_read++;
        if (n->op == OP_MUL && p->n_launch == 0 && n->phase == PHASE_BACKWARD) c.prod_idle++;
        if (n->op == OP_SILU_BWD && strstr(body, "ck_unary_bin<OP_SILU_BWD, OP_MUL")) c.prod_read++;
    }
    return c;
}

static void test_inline_elementwise_plan(void **state) {
    (void)state;
    Arena *a = arena_new();
    char why[512];
    Graph *g = compile_shape(a, "llama", 4, 2048, 1);
    InlineCount on = count_inlined(g, cuda_plan_graph(g, a, why, sizeof why));
    ir_set_choice(g, "fuse.inline_elementwise", "0");
    InlineCount off = count_inlined(g, cuda_plan_graph(g, a, why, sizeof why));
    printf("  llama O1 batch 4 x 2048: %d silu idle, %d products reading gate; %d products idle, %d silu "
           "gradients computing them (off: %d, %d, %d, %d)\n",
           on.act_idle, on.act_read, on.prod_idle, on.prod_read, off.act_idle, off.act_read, off.prod_idle,
           off.prod_read);
    assert_int_equal(on.act_idle, 44);
    assert_int_equal(on.act_read, 44);
    assert_int_equal(on.prod_idle, 22);
    assert_int_equal(on.prod_read, 22);
    assert_int_equal(off.act_idle + off.act_read + off.prod_idle + off.prod_read, 0);
    arena_free(a);

    char path[4500];
    snprintf(path, sizeof path, "%s/models/llama.model", FP8C_SOURCE_DIR);
    for (int level = 0; level <= 3; level++)
        for (int k = 0; k < 2; k++) {
            a = arena_new();
            BuildOptions o;
            memset(&o, 0, sizeof o);
            static const Define defs[] = {{"layers", "2"},   {"dim", "128"},    {"heads", "2"},
                                          {"kv_heads", "1"}, {"hidden", "320"}, {"vocab", "256"}};
            o.front.defines = defs;
            o.front.n_defines = 6;
            o.front.batch = 2;
            o.front.seq = 64;
            o.passes.opt_level = level;
            Choice c = {"fuse.inline_elementwise", k ? "0" : "1"};
            o.choices = &c;
            o.n_choices = 1;
            diag_reset();
            g = pipeline_compile(a, path, &o);
            assert_true(g && !diag_error_count());
            InlineCount n = count_inlined(g, cuda_plan_graph(g, a, why, sizeof why));
            printf("  llama, 2 layers, O%d, fuse.inline_elementwise=%s: %d silu idle, %d products idle\n", level, c.value,
                   n.act_idle, n.prod_idle);
            if (k) assert_int_equal(n.act_idle + n.act_read + n.prod_idle + n.prod_read, 0);
            else assert_int_equal(n.prod_idle, 2);
            assert_module_compiles(g);
            arena_free(a);
        }
}

/* GELU in cuBLASLt's epilogues (spec.c, gemm_gelu and epilogue_of). gpt2_tiny has one GELU a
 * layer, four layers:
 *  - -O0: each c_fc GEMM computes its GELU (GELU_AUX_BIAS: D the GELU, aux the bias add that the
 *    backward keeps), and each GELU backward runs in the GEMM that makes its dy (DGELU,
 *    reading the kept input);
 *  - -O1: the GELU's value is quantized with its current amax (the GELU kernel writes the
 *    copy itself) and the GEMMs of the backward are FP8: neither is fused;
 *  - -O1 with delayed scaling: the c_fc GEMM writes the GELU's e4m3 copy through the delayed
 *    scale and leaves its amax for the history, whose record runs right after it over that
 *    one value; the GELU, its copy and its record run nothing of their own.
 * The choice fuse.gemm_gelu=0 (a tuning record's, or --choice) turns all of it off. */
typedef struct {
    int gelu, dgelu, fp8_result;
} GeluCount;

static GeluCount count_gelu_epilogues(int level, const char *rule, bool gelu_off) {
    GeluCount c = {0};
    Arena *a = arena_new();
    char why[512];
    Graph *g = tiny_model(a, level, rule);
    if (gelu_off) ir_set_choice(g, "fuse.gemm_gelu", "0");
    CuNodePlan *plain = cuda_plan_graph(g, a, why, sizeof why);
    assert_non_null(plain);
    CuNodePlan *fused = cuda_plan_epilogues(g, plain, a);
    for (int i = 0; i < g->n_nodes; i++) {
        const CuNodePlan *p = &fused[i];
        int at = 0;
        while (p->members && at < p->n_launch && p->launch[at].kind != CU_GEMM) at++;
        if (!p->members || at == p->n_launch) continue;
        const CuGemm *gm = &p->launch[at].gemm;
        const Node *last = p->members[p->n_members - 1];
        if (gm->act == CU_ACT_DGELU) {
            /* the group is the matmul and GELU's backward, which reads the kept input */
            assert_int_equal(p->n_members, 2);
            assert_int_equal(last->op, OP_GELU_BWD);
            assert_ptr_equal(gm->d.node, last);
            assert_ptr_equal(gm->aux.node, last->in[1]);
            assert_ptr_equal(last->in[0], p->members[0]);
            c.dgelu++;
        }
        if (gm->act != CU_ACT_GELU) continue;
        c.gelu++;
        /* aux is the bias add, read by the GELU and kept for the backward */
        const Node *h = gm->aux.node;
        assert_non_null(h);
        assert_int_equal(h->op, OP_ADD);
        assert_non_null(gm->bias.node);
        int y_at = -1;
        for (int k = 0; k < p->n_members; k++)
            if (p->members[k]->op == OP_GELU) y_at = k;
        assert_true(y_at > 0);
        const Node *y = p->members[y_at];
        assert_ptr_equal(y->in[0], h);
        for (int k = 0; k < p->n_members; k++)   /* every other member runs nothing */
            if (p->members[k]->index != i) assert_int_equal(fused[p->members[k]->index].n_launch, 0);
        if (gm->dscale.node) {
            /* D is the GELU's delayed FP8 copy; the record takes the amax over one part */
            const Node *q = gm->d.node;
            assert_int_equal(q->op, OP_QUANTIZE);
            assert_ptr_equal(q->in[0], y);
            assert_int_equal(q->t.fmt.recipe, RECIPE_DELAYED);
            assert_int_equal(gm->dtype, q->t.fmt.elem);
            assert_ptr_equal(gm->dscale.node, q->t.fmt.scale);
            assert_true(gm->amax >= 0);
            assert_true(p->n_launch >= 2);
            const CuLaunch *rec = &p->launch[p->n_launch - 1];
            assert_non_null(strstr(rec->body, "ck_amax_record_final"));
            assert_int_equal(rec->scratch, gm->amax);
            assert_int_equal(rec->args.i[0], 1);
            assert_int_equal(p->n_members, y_at + 3);
            c.fp8_result++;
        } else {
            assert_ptr_equal(gm->d.node, y);
            assert_int_equal(gm->dtype, FMT_BF16);
        }
    }
    printf("  gpt2_tiny O%d%s%s: %d GEMMs compute a GELU (%d of them into its FP8 copy), %d GELU backwards\n", level,
           rule ? " " : "", rule ? rule : "", c.gelu, c.fp8_result, c.dgelu);
    assert_module_compiles(g);   /* the fused plans use the kernels of the nodes' own plans */
    arena_free(a);
    return c;
}

static void test_gelu_epilogue_plan(void **state) {
    (void)state;
    GeluCount o0 = count_gelu_epilogues(0, NULL, false);
    assert_int_equal(o0.gelu, 4);
    assert_int_equal(o0.fp8_result, 0);
    assert_int_equal(o0.dgelu, 4);
    GeluCount o1 = count_gelu_epilogues(1, NULL, false);
    assert_int_equal(o1.gelu, 0);
    assert_int_equal(o1.dgelu, 0);
    GeluCount delayed = count_gelu_epilogues(1, "gemm:*=e4m3:delayed16", false);
    assert_int_equal(delayed.gelu, 4);
    assert_int_equal(delayed.fp8_result, 4);
    assert_int_equal(delayed.dgelu, 0);
    GeluCount off = count_gelu_epilogues(0, NULL, true);
    assert_int_equal(off.gelu + off.dgelu, 0);
}

/* The kernel program of g as text: every node's launches, their functions and bodies, the
 * nodes each plan absorbed or fused. */
static char *program_text(Graph *g, Arena *a) {
    char why[512];
    CuNodePlan *plain = cuda_plan_graph(g, a, why, sizeof why);
    assert_non_null(plain);
    CuNodePlan *plans = cuda_plan_epilogues(g, plain, a);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    for (int i = 0; i < g->n_nodes; i++) {
        const CuNodePlan *p = &plans[i];
        fprintf(f, "%d: %d launches, %d absorbed, %d members", i, p->n_launch, p->n_absorbed, p->n_members);
        for (int k = 0; k < p->n_launch; k++)
            fprintf(f, " [%s %s %lld %lld %lld]", p->launch[k].fn, p->launch[k].body, (long long)p->launch[k].args.i[0],
                    (long long)p->launch[k].args.i[1], (long long)p->launch[k].args.i[2]);
        fputc('\n', f);
    }
    fclose(f);
    return buf;
}

/* GPT-2's loss in chunks (chunk_loss.c) at every level: each chunk's cross entropy and its
 * backward run as one pass over the logits (fuse_ce_one_pass), by default (CE_ROWS_DEFAULT) in
 * blocks of 512 threads holding two rows of 50304 bf16 logits in shared memory, a block an SM
 * walking its rows, with ex2; the forward keeps its own launches for the evaluation phase. */
static void test_loss_one_pass_plan(void **state) {
    (void)state;
    char path[4500];
    snprintf(path, sizeof path, "%s/models/gpt2.model", FP8C_SOURCE_DIR);
    Choice chunks = {"loss.chunks", "2"};
    for (int level = 0; level <= 3; level++) {
        Arena *a = arena_new();
        Graph *g = compile_model_choosing(a, path, level, NULL, &chunks);
        assert_non_null(g);
        char why[256];
        CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
        assert_non_null(plans);
        int pairs = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            if (g->nodes[i]->op != OP_CROSS_ENTROPY_BWD) continue;
            const CuNodePlan *b = &plans[i], *f = &plans[i - 1];
            assert_int_equal(g->nodes[i - 1]->op, OP_CROSS_ENTROPY);
            assert_int_equal(b->n_launch, 1);
            assert_non_null(strstr(b->launch[0].body, "ck_ce_fused<-2, 1, F<FMT_BF16, SCALE_NONE>, F<FMT_BF16, SCALE_NONE>"));
            assert_int_equal(b->launch[0].block, 512);
            assert_int_equal(b->launch[0].smem, 2 * 50304 * 2);
            assert_int_equal(b->launch[0].per_sm, 1);
            assert_int_equal(f->n_launch, 0);
            assert_non_null(f->alone);
            assert_int_equal(f->alone->n_launch, 2);
            pairs++;
        }
        printf("  gpt2 -O%d: %d loss chunks in one pass each\n", level, pairs);
        assert_int_equal(pairs, 2);
        arena_free(a);
    }
}

/* The loss's choices (ce.threads, ce.exp2, ce.shared, ce.ring; spec_ops.c, ce_rows_chosen), one
 * per loss chunk of GPT-2 at -O1 through their "@ID" forms, so that one module holds every
 * variant and compiles: 512 threads with two rows a block in shared memory and ex2 (196 KiB,
 * a block an SM, walking its rows), 512 with the row in shared memory (98 KiB, two blocks an
 * SM), 256 read twice, 1024 in registers with ex2, and 512 with ex2 unfused (the forward's rows
 * and the backward's gradient); the forward runs as its backward does. */
static void test_loss_choices_plan(void **state) {
    (void)state;
    char path[4500];
    snprintf(path, sizeof path, "%s/models/gpt2.model", FP8C_SOURCE_DIR);
    Choice chunks = {"loss.chunks", "8"};
    Arena *a = arena_new();
    Graph *g = compile_model_choosing(a, path, 1, NULL, &chunks);
    assert_non_null(g);
    enum { N = 5 };
    static const struct {
        const char *threads, *exp2, *shared, *ring, *one_pass;
        const char *body;   /* the backward's last launch starts so */
        unsigned block, smem, per_sm;
    } want[N] = {
        {"512", "1", "1", "1", "1", "ck_ce_fused<-2, 1, F<FMT_BF16, SCALE_NONE>", 512, 2 * 50304 * 2, 1},
        {"512", "1", "1", "0", "1", "ck_ce_fused<-1, 1, F<FMT_BF16, SCALE_NONE>", 512, 50304 * 2, 0},
        {"256", "0", "0", "1", "1", "ck_ce_fused<0, 0, F<FMT_BF16, SCALE_NONE>", 256, 0, 0},
        {"1024", "1", "1", "1", "1", "ck_ce_fused<7, 1, F<FMT_BF16, SCALE_NONE>", 1024, 0, 0},
        {"512", "1", "1", "1", "0", "ck_ce_bwd<1, F<FMT_BF16, SCALE_NONE>", 512, 0, 0},
    };
    int k = 0;
    for (int i = 1; i < g->n_nodes && k < N; i++) {
        const Node *b = g->nodes[i], *f = g->nodes[i - 1];
        if (b->op != OP_CROSS_ENTROPY_BWD) continue;
        for (int j = 0; j < 2; j++) {
            const Node *n = j ? b : f;
            ir_set_choice(g, arena_printf(a, "ce.threads@%d", n->id), want[k].threads);
            ir_set_choice(g, arena_printf(a, "ce.exp2@%d", n->id), want[k].exp2);
            ir_set_choice(g, arena_printf(a, "ce.shared@%d", n->id), want[k].shared);
            ir_set_choice(g, arena_printf(a, "ce.ring@%d", n->id), want[k].ring);
        }
        ir_set_choice(g, arena_printf(a, "fuse.ce_one_pass@%d", b->id), want[k].one_pass);
        k++;
    }
    assert_int_equal(k, N);
    char why[256];
    CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
    assert_non_null(plans);
    k = 0;
    for (int i = 1; i < g->n_nodes && k < N; i++) {
        if (g->nodes[i]->op != OP_CROSS_ENTROPY_BWD) continue;
        const CuNodePlan *b = &plans[i], *f = &plans[i - 1];
        const CuLaunch *l = &b->launch[b->n_launch - 1];
        printf("  chunk %d: %s, %u threads, %u bytes of shared memory, %u blocks an SM at most\n", k, l->body,
               l->block, l->smem, l->per_sm);
        assert_non_null(strstr(l->body, want[k].body));
        assert_int_equal(l->block, want[k].block);
        assert_int_equal(l->smem, want[k].smem);
        assert_int_equal(l->per_sm, want[k].per_sm);
        const CuNodePlan *fw = f->n_launch ? f : f->alone;   /* the forward's own launches */
        assert_non_null(fw);
        assert_int_equal(fw->launch[0].block, want[k].block);
        assert_non_null(strstr(fw->launch[0].body, !strcmp(want[k].exp2, "1") ? "ck_ce_rows<1," : "ck_ce_rows<0,"));
        k++;
    }
    assert_module_compiles(g);
    arena_free(a);
}

/* Each fusion of the CUDA plan has a switch in the graph's choice table (the tuner's hook in
 * spec.c): turned off, the program of gpt2_tiny changes at some level (and is the default's
 * when left on), and it still compiles. The loss's logsumexp is shared only where its forward
 * and backward do not run as one pass. */
static void test_fusion_switches(void **state) {
    (void)state;
    static const char *const kinds[] = {"fuse.producer_quantizes", "fuse.bias_grads", "fuse.group_quantizes", "fuse.input_group_copies",
                                        "fuse.ce_one_pass", "fuse.ce_lse", "fuse.gemm_epilogues",
                                        "fuse.gemm_gelu", "fuse.cast_transposes", "fuse.norm_stats", "fuse.inverse_scales",
                                        "fuse.attention_scales", "fuse.amax_scales"};
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        int changed_at = -1;
        for (int level = 0; level <= 3 && changed_at < 0; level++) {
            Arena *a = arena_new();
            /* the loss's backward runs right after its forward where the loss is in chunks */
            char path[4500];
            snprintf(path, sizeof path, "%s/models/gpt2_tiny.model", FP8C_SOURCE_DIR);
            Choice chunks = {"loss.chunks", "2"};
            bool loss = !strncmp(kinds[k], "fuse.ce_", 8);
            Graph *g = compile_model_choosing(a, path, level, NULL, loss ? &chunks : NULL);
            assert_non_null(g);
            if (!strcmp(kinds[k], "fuse.ce_lse")) ir_set_choice(g, "fuse.ce_one_pass", "0");
            char *on = program_text(g, a);
            ir_set_choice(g, kinds[k], "1");
            char *on_again = program_text(g, a);
            assert_string_equal(on, on_again);
            ir_set_choice(g, kinds[k], "0");
            char *off = program_text(g, a);
            if (strcmp(on, off)) {
                changed_at = level;
                assert_module_compiles(g);
            }
            free(on), free(on_again), free(off);
            arena_free(a);
        }
        printf("  %s=0 changes gpt2_tiny's program at -O%d\n", kinds[k], changed_at);
        assert_true(changed_at >= 0);
    }
}

/* attn.wgmma is on unless set to 0: by default the attentions of GPT-2 (head dim 64) and
 * Llama (64, grouped-query), forward and backward, run on warpgroup MMA at some level; with 0
 * they run on mma.sync, every other launch of the program stays as it was, and both modules
 * compile. attn.wgmma_bwd=0 moves only the backward's dq and dk/dv passes back. */
static void test_attention_wgmma_choice(void **state) {
    (void)state;
    static const char *const models[] = {"gpt2", "llama"};
    for (size_t m = 0; m < sizeof models / sizeof *models; m++) {
        int chosen_at = -1;
        for (int level = 0; level <= 3 && chosen_at < 0; level++) {
            Arena *a = arena_new();
            char path[4500];
            snprintf(path, sizeof path, "%s/models/%s.model", FP8C_SOURCE_DIR, models[m]);
            Graph *g = compile_model_choosing(a, path, level, NULL, NULL);
            assert_non_null(g);
            char *dflt = program_text(g, a);
            ir_set_choice(g, "attn.wgmma", "1");
            char *on = program_text(g, a);
            assert_string_equal(dflt, on);
            ir_set_choice(g, "attn.wgmma", "0");
            char *off = program_text(g, a);
            assert_null(strstr(off, "ck_attn_wg_"));
            ir_set_choice(g, "attn.wgmma", "1");
            ir_set_choice(g, "attn.wgmma_bwd", "0");
            char *fwd_only = program_text(g, a);
            ir_set_choice(g, "attn.wgmma_bwd", "1");
            assert_null(strstr(fwd_only, "ck_attn_wg_dq<"));
            assert_null(strstr(fwd_only, "ck_attn_wg_dkv<"));
            if (strstr(on, "ck_attn_wg_fwd<")) {
                assert_non_null(strstr(on, "ck_attn_wg_dq<"));
                assert_non_null(strstr(on, "ck_attn_wg_dkv<"));
                assert_non_null(strstr(fwd_only, "ck_attn_wg_fwd<"));
                ir_set_choice(g, "attn.wgmma", "0");
                assert_module_compiles(g);
                ir_set_choice(g, "attn.wgmma", "1");
                chosen_at = level;
                /* line by line, only attention launches differ */
                char *save_off = NULL, *save_on = NULL;
                char *lo = strtok_r(off, "\n", &save_off), *ln = strtok_r(on, "\n", &save_on);
                for (; lo && ln; lo = strtok_r(NULL, "\n", &save_off), ln = strtok_r(NULL, "\n", &save_on))
                    if (strcmp(lo, ln)) assert_non_null(strstr(ln, "ck_attn_wg_"));
                assert_true(!lo && !ln);
                assert_module_compiles(g);
            }
            free(dflt), free(off), free(on), free(fwd_only);
            arena_free(a);
        }
        printf("  attn.wgmma=1 runs %s's attention on warpgroup MMA at -O%d\n", models[m], chosen_at);
        assert_true(chosen_at >= 0);
    }
}

/* attn.dq_in_dkv=1: GPT-2's and Llama's (grouped-query) attention backward at -O1 run no dq
 * pass, their dk/dv pass computes dq (its template's last argument 1) after a statistics pass
 * that zeroes its counters, every other launch stays as it was, and the module compiles. */
static void test_attention_dq_in_dkv_choice(void **state) {
    (void)state;
    static const char *const models[] = {"gpt2", "llama"};
    for (size_t m = 0; m < sizeof models / sizeof *models; m++) {
        Arena *a = arena_new();
        char path[4500];
        snprintf(path, sizeof path, "%s/models/%s.model", FP8C_SOURCE_DIR, models[m]);
        Graph *g = compile_model_choosing(a, path, 1, NULL, NULL);
        assert_non_null(g);
        char *two = program_text(g, a);
        assert_non_null(strstr(two, "ck_attn_wg_dq<"));
        ir_set_choice(g, "attn.dq_in_dkv", "1");
        char *one = program_text(g, a);
        assert_null(strstr(one, "ck_attn_wg_dq<"));
        int changed = 0;   /* program_text: a line a node, its launches in it */
        char *save_two = NULL, *save_one = NULL;
        char *lt = strtok_r(two, "\n", &save_two), *lo = strtok_r(one, "\n", &save_one);
        for (; lt && lo; lt = strtok_r(NULL, "\n", &save_two), lo = strtok_r(NULL, "\n", &save_one)) {
            if (!strcmp(lt, lo)) continue;
            assert_non_null(strstr(lt, "ck_attn_wg_dq<"));
            assert_non_null(strstr(lo, "ck_attn_wg_dkv<"));
            assert_non_null(strstr(lo, "ck_attn_saved_stats<"));
            const char *end = strstr(strstr(lo, "ck_attn_wg_dkv<"), ">(a)");
            assert_true(end && !strncmp(end - 3, ", 1", 3));
            changed++;
        }
        assert_true(!lt && !lo);
        assert_true(changed > 0);
        assert_module_compiles(g);
        printf("  attn.dq_in_dkv=1: %s -O1, %d attention backwards without a dq pass\n", models[m], changed);
        arena_free(a);
    }
}

/* The last integer template argument of a launch's body ("..., 4>(a)"), -1 where none */
static long last_template_int(const char *body) {
    const char *end = strstr(body, ">(a)"), *p = end;
    while (p && p > body && p[-1] >= '0' && p[-1] <= '9') p--;
    return p && p < end ? strtol(p, NULL, 10) : -1;
}

/* Whether a dq pass's body zeroes the dk/dv pass's tickets: its ZERO argument 1, the last
 * argument or the one before the saved y's format (YS) */
static bool dq_zeroes_tickets(const char *body) {
    if (last_template_int(body) == 1) return true;
    const char *ys = NULL;   /* the last format argument, ", F<..>" */
    for (const char *p = strstr(body, ", F<"); p; p = strstr(p + 1, ", F<")) ys = p;
    return ys && ys - body > 3 && !strncmp(ys - 3, ", 1", 3) && strchr(ys, '>') == strstr(ys, ">>(a)");
}

/* models/MODEL.model at -O1 (default shapes) in *g and its CUDA plans */
static CuNodePlan *o1_plans(Arena *a, const char *model, Graph **g) {
    char path[4500], why[512];
    snprintf(path, sizeof path, "%s/models/%s.model", FP8C_SOURCE_DIR, model);
    *g = compile_model_choosing(a, path, 1, NULL, NULL);
    assert_non_null(*g);
    CuNodePlan *plans = cuda_plan_graph(*g, a, why, sizeof why);
    assert_non_null(plans);
    return plans;
}

/* Every gradient norm (SQNORM) of GPT-2's and Llama's update at -O1 ends in a launch that sets
 * the executor's finite-check flag (CuLaunch.check_flag, ck_sqnorm_final), and the update
 * starts with them (delayed scales aside): the executor runs them as the gradients' check
 * (cuda_exec_all_finite). */
static void test_sqnorm_finite_check(void **state) {
    (void)state;
    static const char *const models[] = {"gpt2", "llama"};
    for (size_t m = 0; m < sizeof models / sizeof *models; m++) {
        Arena *a = arena_new();
        Graph *g;
        CuNodePlan *plans = o1_plans(a, models[m], &g);
        int norms = 0, grads = 0;
        bool leading = true;
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *n = g->nodes[i];
            if (n->t.role == ROLE_GRAD && n->op != OP_ACCUMULATE && ir_role_is_persistent(n->t.role)) grads++;
            if (n->phase != PHASE_UPDATE || !plans[i].n_launch || n->op == OP_DELAYED_SCALE) continue;
            if (n->op != OP_SQNORM) {
                leading = false;
                continue;
            }
            assert_true(leading);
            const CuLaunch *last = &plans[i].launch[plans[i].n_launch - 1];
            assert_true(last->check_flag);
            assert_non_null(strstr(last->body, "ck_sqnorm_final<"));
            for (int k = 0; k + 1 < plans[i].n_launch; k++) assert_false(plans[i].launch[k].check_flag);
            norms++;
        }
        assert_int_equal(norms, grads);
        printf("  %s -O1: %d gradient norms lead the update, each its gradient's finite check\n", models[m], norms);
        arena_free(a);
    }
}

/* The attention backward's statistics where the forward kept y and its logsumexp: GPT-2's and
 * Llama's (grouped-query) at -O1 are made by the wgmma dq pass (y as its t[5], the logsumexp's
 * offset after y as i[11], y's format as the template's last argument), and no statistics pass
 * runs; with attn.wgmma_bwd=0 the mma.sync passes read them from the light pass again. */
static void test_attention_stats_in_dq(void **state) {
    (void)state;
    static const char *const models[] = {"gpt2", "llama"};
    for (size_t m = 0; m < sizeof models / sizeof *models; m++) {
        Arena *a = arena_new();
        Graph *g;
        CuNodePlan *plans = o1_plans(a, models[m], &g);
        int found = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *n = g->nodes[i];
            if (n->op != OP_ATTENTION_BWD) continue;
            assert_true(ir_attention_bwd_reads_y(n));
            const Node *y = n->in[n->n_in - 1];
            assert_true(ir_attention_lse_offset(y) > 0);
            const CuLaunch *dq = NULL;
            for (int k = 0; k < plans[i].n_launch; k++) {
                assert_null(strstr(plans[i].launch[k].body, "ck_attn_saved_stats<"));
                if (strstr(plans[i].launch[k].body, "ck_attn_wg_dq<")) dq = &plans[i].launch[k];
            }
            assert_non_null(dq);
            assert_ptr_equal(dq->ref[5].node, y);
            assert_int_equal(dq->args.i[11], ir_attention_lse_offset(y));
            assert_int_equal(last_template_int(dq->body), -1);   /* ends with y's format */
            found++;
        }
        assert_true(found > 0);
        assert_module_compiles(g);
        ir_set_choice(g, "attn.wgmma_bwd", "0");
        char *tc = program_text(g, a);
        assert_non_null(strstr(tc, "ck_attn_saved_stats<"));
        assert_null(strstr(tc, "ck_attn_wg_dq<"));
        free(tc);
        printf("  %s -O1: %d attention backwards make their statistics in the dq pass\n", models[m], found);
        arena_free(a);
    }
}

/* A key tile's dk/dv steps in parts (attn.dkv_parts; spec_attn.c's dkv_parts, attn_wgmma.cuh's
 * PARTS). Llama 1.1B at batch 4 x 2048 -O1, by the balance rule: every attention backward's
 * dk/dv pass in 4 parts, a grid of 4 x 4 kv heads x 32 key tiles x 4, after a dq pass that
 * zeroes the tickets (its ZERO, 1: dq_zeroes_tickets), with scratch for lse and Dt, the tickets and the parts'
 * sums; with attn.dkv_parts=1, the 512 blocks and the dq pass of before. GPT-2 d12 at 32 x
 * 1024 and d48's shape at 8 x 1024 whole by the rule (their longest blocks take 16 steps).
 * A two-layer Llama with 2 and 8 parts compiles. */
static int dkv_parts_planned(const Graph *g, const CuNodePlan *plans, unsigned grid, int parts) {
    int found = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        if (g->nodes[i]->op != OP_ATTENTION_BWD) continue;
        const CuLaunch *dq = NULL, *dkv = NULL;
        for (int k = 0; k < plans[i].n_launch; k++) {
            if (strstr(plans[i].launch[k].body, "ck_attn_wg_dq<")) dq = &plans[i].launch[k];
            if (strstr(plans[i].launch[k].body, "ck_attn_wg_dkv<")) dkv = &plans[i].launch[k];
        }
        assert_non_null(dq);
        assert_non_null(dkv);
        assert_int_equal(dkv->grid[0], grid);
        if (parts > 1) {
            assert_int_equal(last_template_int(dkv->body), parts);
            assert_true(dq_zeroes_tickets(dq->body));
        } else {
            /* no PARTS argument: the split's template ends ", 2, 0" (dkv_split 2, no ONE) */
            const char *end = strstr(dkv->body, ">(a)");
            assert_true(end && !strncmp(end - 6, ", 2, 0", 6));
        }
        found++;
    }
    return found;
}
static void test_attention_dkv_parts(void **state) {
    (void)state;
    char why[512];
    static const char *const llama_parts[] = {NULL, "1"};
    for (int k = 0; k < 2; k++) {
        Arena *a = arena_new();
        Graph *g = shaped_model(a, "llama", NULL, 0, 4, 2048, 1, "attn.dkv_parts", llama_parts[k]);
        CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
        assert_non_null(plans);
        int parts = k ? 1 : 4, found = dkv_parts_planned(g, plans, 4 * 4 * 32 * parts, parts);
        assert_int_equal(found, 22);
        for (int i = 0; i < g->n_nodes && !k; i++) {
            if (g->nodes[i]->op != OP_ATTENTION_BWD) continue;
            /* lse and Dt (2 B H T floats), 256-byte aligned tickets, 4 parts of 64 x 64 x 2 floats a tile */
            int64_t need = 2 * 4 * 32 * 2048 * 4 + (4 * 4 * 32 * 4 + 255) / 256 * 256 + 4 * 4 * 32 * 4 * 64 * 128 * 4;
            assert_true(plans[i].scratch_bytes >= need);
        }
        printf("  llama O1 batch 4 x 2048, attn.dkv_parts %s: %d dk/dv passes in %d parts\n",
               llama_parts[k] ? llama_parts[k] : "by the rule", found, parts);
        arena_free(a);
    }
    Arena *a = arena_new();
    Graph *g = compile_shape(a, "gpt2", 32, 1024, 1);
    assert_int_equal(dkv_parts_planned(g, cuda_plan_graph(g, a, why, sizeof why), 32 * 12 * 16, 1), 12);
    arena_free(a);
    static const Define d48[] = {{"layers", "2"}, {"dim", "1600"}, {"heads", "25"}};
    a = arena_new();
    g = shaped_model(a, "gpt2", d48, 3, 8, 1024, 1, NULL, NULL);
    assert_int_equal(dkv_parts_planned(g, cuda_plan_graph(g, a, why, sizeof why), 8 * 25 * 16, 1), 2);
    arena_free(a);
    static const Define two[] = {{"layers", "2"}};
    static const char *const forced[] = {"2", "8"};
    for (int k = 0; k < 2; k++) {
        a = arena_new();
        g = shaped_model(a, "llama", two, 1, 2, 200, 1, "attn.dkv_parts", forced[k]);
        int parts = k ? 8 : 2;
        /* 2 x 4 kv heads x 4 key tiles of 64 (T 200) */
        assert_int_equal(dkv_parts_planned(g, cuda_plan_graph(g, a, why, sizeof why), 2 * 4 * 4 * parts, parts), 2);
        assert_module_compiles(g);
        printf("  a two-layer llama, attn.dkv_parts=%d: compiled\n", parts);
        arena_free(a);
    }
}

/* attn.fwd_ws=3 or 2: GPT-2's and Llama's (grouped-query) attention forwards at -O1 and -O3
 * run on the warp-specialized kernel with that many consumer warpgroups and a producer
 * warpgroup (128 threads each); every other launch stays as it was, and the module compiles;
 * with attn.fwd_tma=1 too, each such launch asks the executor for three tensor maps, and its
 * module compiles; so it does with key tiles of 128, pipelined (attn.fwd_keys, attn.fwd_pipeline). */
static void test_attention_fwd_ws_choice(void **state) {
    (void)state;
    static const char *const models[] = {"gpt2", "llama"};
    static const char *const wgs[] = {"3", "2"};
    for (size_t m = 0; m < sizeof models / sizeof *models; m++)
        for (int level = 1; level <= 3; level += 2)
            for (size_t w = 0; w < sizeof wgs / sizeof *wgs; w++) {
                Arena *a = arena_new();
                char path[4500], kernel[64];
                snprintf(path, sizeof path, "%s/models/%s.model", FP8C_SOURCE_DIR, models[m]);
                snprintf(kernel, sizeof kernel, "ck_attn_ws_fwd<64, %s, 0, ", wgs[w]);
                Graph *g = compile_model_choosing(a, path, level, NULL, NULL);
                assert_non_null(g);
                char *plain = program_text(g, a);
                ir_set_choice(g, "attn.fwd_ws", wgs[w]);
                char *ws = program_text(g, a);
                int changed = 0;   /* program_text: a line a node, its launches in it */
                char *save_p = NULL, *save_w = NULL;
                char *lp = strtok_r(plain, "\n", &save_p), *lw = strtok_r(ws, "\n", &save_w);
                for (; lp && lw; lp = strtok_r(NULL, "\n", &save_p), lw = strtok_r(NULL, "\n", &save_w)) {
                    if (!strcmp(lp, lw)) continue;
                    assert_non_null(strstr(lp, "ck_attn_wg_fwd<"));
                    assert_null(strstr(lw, "ck_attn_wg_fwd<"));
                    assert_non_null(strstr(lw, kernel));
                    changed++;
                }
                assert_true(!lp && !lw);
                assert_true(changed > 0);
                char why[512];
                CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
                assert_non_null(plans);
                int launches = 0;
                for (int i = 0; i < g->n_nodes; i++)
                    for (int k = 0; k < plans[i].n_launch; k++)
                        if (strstr(plans[i].launch[k].body, "ck_attn_ws_fwd<")) {
                            assert_int_equal(plans[i].launch[k].block, 128 * (atoi(wgs[w]) + 1));
                            launches++;
                        }
                assert_int_equal(launches, changed);
                assert_module_compiles(g);
                /* with attn.fwd_tma=1 the same launches load by TMA: three tensor maps each */
                ir_set_choice(g, "attn.fwd_tma", "1");
                snprintf(kernel, sizeof kernel, "ck_attn_ws_fwd<64, %s, 1, ", wgs[w]);
                plans = cuda_plan_graph(g, a, why, sizeof why);
                assert_non_null(plans);
                int tma = 0;
                for (int i = 0; i < g->n_nodes; i++)
                    for (int k = 0; k < plans[i].n_launch; k++)
                        if (strstr(plans[i].launch[k].body, kernel)) {
                            assert_int_equal(plans[i].launch[k].tma, 3);
                            tma++;
                        }
                assert_int_equal(tma, changed);
                assert_module_compiles(g);
                /* with attn.fwd_keys=128 and attn.fwd_pipeline=1: key tiles of 128, pipelined */
                ir_set_choice(g, "attn.fwd_keys", "128");
                ir_set_choice(g, "attn.fwd_pipeline", "1");
                snprintf(kernel, sizeof kernel, "ck_attn_ws_fwd<64, %s, 1, 128, 1, ", wgs[w]);
                plans = cuda_plan_graph(g, a, why, sizeof why);
                assert_non_null(plans);
                int keys = 0;
                for (int i = 0; i < g->n_nodes; i++)
                    for (int k = 0; k < plans[i].n_launch; k++) keys += strstr(plans[i].launch[k].body, kernel) != NULL;
                assert_int_equal(keys, changed);
                assert_module_compiles(g);
                printf("  attn.fwd_ws=%s: %s -O%d, %d attention nodes on the warp-specialized forward\n", wgs[w],
                       models[m], level, changed);
                arena_free(a);
            }
}

/* attn.fwd_keys=128 on Llama at T 2048: every attention forward (and the backward's rerun of
 * it, at -O3) on the producer warpgroup's kernel with key tiles of 128, three consumer
 * warpgroups and TMA loads where attn.fwd_ws and attn.fwd_tma are not set, its result's scale
 * still folded in (no scale pass left), and the module compiles. Not set, the rule's: the same
 * at T 2048, ck_attn_wg_fwd at T 1024; attn.fwd_keys=64 keeps ck_attn_wg_fwd at T 2048. */
static void test_attention_fwd_keys_choice(void **state) {
    (void)state;
    static const struct { int level, seq; const char *keys; bool ws; } cases[] = {
        {1, 2048, "128", true}, {3, 2048, "128", true}, {1, 2048, NULL, true}, {3, 2048, NULL, true},
        {1, 2048, "64", false}, {1, 1024, NULL, false}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        Arena *a = arena_new();
        Graph *g = compile_shape(a, "llama", 1, cases[c].seq, cases[c].level);
        if (cases[c].keys) ir_set_choice(g, "attn.fwd_keys", cases[c].keys);
        char why[512];
        CuNodePlan *plans = cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a);
        assert_non_null(plans);
        int ws = 0, wg = 0;
        for (int i = 0; i < g->n_nodes; i++)
            for (int k = 0; k < plans[i].n_launch; k++) {
                const CuLaunch *l = &plans[i].launch[k];
                if (strstr(l->body, "ck_attn_ws_fwd<64, 3, 1, 128, 0, ")) {
                    assert_int_equal(l->block, 512);
                    assert_int_equal(l->tma, 3);
                    ws++;
                }
                wg += strstr(l->body, "ck_attn_wg_fwd<") != NULL;
            }
        int folded = check_attention_scales(g, plans);
        printf("  llama T %d -O%d%s%s: %d forwards on key tiles of 128, %d on ck_attn_wg_fwd, %d scales folded\n",
               cases[c].seq, cases[c].level, cases[c].keys ? ", attn.fwd_keys=" : "", cases[c].keys ? cases[c].keys : "",
               ws, wg, folded);
        assert_true(cases[c].ws ? ws > 0 && wg == 0 : ws == 0 && wg > 0);
        if (cases[c].level == 1) assert_int_equal(folded, 22);
        if (c == 0) assert_module_compiles(g);
        arena_free(a);
    }
}

/* The kernels of the FP8 gradient reduction (kernels/comm.cuh): a data-parallel build with
 * comm:grad=e5m2 or e4m3 puts its five entry points in the module, for bf16 gradients (-O1)
 * and f32 ones (-O0), and NVRTC compiles them; without the rule there are none. */
static void test_fp8_comm_kernels(void **state) {
    (void)state;
    static const struct { const char *rule; int level; const char *sum; } cases[] = {
        {"comm:grad=e5m2", 1, "ck_comm_sum<FMT_E5M2>"}, {"comm:grad=e4m3", 1, "ck_comm_sum<FMT_E4M3>"},
        {"comm:grad=e5m2", 0, "ck_comm_sum<FMT_E5M2>"}, {NULL, 1, NULL}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        Arena *a = arena_new();
        char path[4500];
        snprintf(path, sizeof path, "%s/models/gpt2_tiny.model", FP8C_SOURCE_DIR);
        BuildOptions o;
        memset(&o, 0, sizeof o);
        o.front.batch = 2;
        o.front.seq = 64;
        o.passes.opt_level = cases[c].level;
        o.passes.gpus = 2;
        const char *rules[1] = {cases[c].rule};
        o.passes.overrides = rules;
        o.passes.n_overrides = cases[c].rule ? 1 : 0;
        diag_reset();
        Graph *g = pipeline_compile(a, path, &o);
        assert_true(g && !diag_error_count());
        char why[512];
        CuNodePlan *plans = cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a);
        assert_non_null(plans);
        char *text = cuda_render_module(g, plans, a, NULL);
        int reduce = 0, planned = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            if (g->nodes[i]->op != OP_ALL_REDUCE) continue;
            reduce++;
            CuNodePlan p;
            if (!cuda_plan_comm(g->nodes[i], a, &p)) continue;
            planned++;
            assert_int_equal(p.n_launch, COMM_KERNELS);
            for (int k = 0; k < p.n_launch; k++) assert_non_null(strstr(text, p.launch[k].fn));
        }
        assert_true(reduce > 0);
        if (!cases[c].rule) {
            assert_int_equal(planned, 0);
            assert_null(strstr(text, "ck_comm_amax(a)"));   /* no entry point (the library has the code) */
        } else {
            assert_int_equal(planned, reduce);
            assert_non_null(strstr(text, cases[c].sum));
            assert_module_compiles(g);
            printf("  %s at -O%d: the FP8 reduction's kernels compile\n", cases[c].rule, cases[c].level);
        }
        arena_free(a);
    }
}

/* The update's batched runs as `fp8c plan --kernels` finds them from the memory plan's offsets
 * (cuda_batch_runs): at -O1 every weight copy's delayed scale is in one run and every AdamW in
 * a run of its op; runs hold update nodes of one op only, at least two with launches; and the
 * program's listing shows each run as one line a kernel, "delayed_scale x N". */
static void test_update_batch_runs(void **state) {
    (void)state;
    Arena *a = arena_new();
    Graph *g = compile_shape(a, "gpt2", 2, 64, 1);
    char why[512];
    CuNodePlan *plans = cuda_plan_epilogues(g, cuda_plan_graph(g, a, why, sizeof why), a);
    assert_non_null(plans);
    int *run = arena_alloc(a, sizeof *run * (size_t)g->n_nodes);
    cuda_batch_runs(g, plans, cuda_plan_storage_at, run);
    int scales = 0, adamw = 0, scale_runs = 0, in_runs_scales = 0, in_runs_adamw = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        scales += g->nodes[i]->op == OP_DELAYED_SCALE && plans[i].n_launch;
        adamw += g->nodes[i]->op == OP_ADAMW && plans[i].n_launch;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        if (!run[i]) continue;
        int members = 0;
        for (int m = i; m < i + run[i]; m++) {
            assert_int_equal(g->nodes[m]->phase, PHASE_UPDATE);
            if (!plans[m].n_launch) continue;
            assert_int_equal(g->nodes[m]->op, g->nodes[i]->op);
            members++;
        }
        assert_true(members >= 2);
        scale_runs += g->nodes[i]->op == OP_DELAYED_SCALE;
        if (g->nodes[i]->op == OP_DELAYED_SCALE) in_runs_scales += members;
        if (g->nodes[i]->op == OP_ADAMW) in_runs_adamw += members;
        i += run[i] - 1;
    }
    assert_int_equal(scales, 48);   /* four weights of each of 12 layers keep an FP8 copy */
    assert_int_equal(scale_runs, 1);
    assert_int_equal(in_runs_scales, scales);
    assert_int_equal(in_runs_adamw, adamw);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    assert_non_null(f);
    assert_true(cuda_print_program(g, a, f, why, sizeof why));
    fclose(f);
    assert_non_null(strstr(text, "delayed_scale x 48"));
    printf("  GPT-2 -O1: %d delayed scales in one run, %d AdamW nodes in runs\n", scales, adamw);
    free(text);
    arena_free(a);
}

/* The blob of several cubins a binary carries (module_set.c): what goes in comes out, byte for
 * byte and 16-byte aligned; one cubin alone is itself; a set cut short, of another version
 * or of more modules than the reader takes is refused, never read past its end. */
static void test_module_set(void **state) {
    (void)state;
    enum { N = 3 };
    static const size_t lens[N] = {1000, 17, 4096};
    unsigned char *mods[N];
    for (int k = 0; k < N; k++) {
        mods[k] = malloc(lens[k]);
        assert_non_null(mods[k]);
        for (size_t i = 0; i < lens[k]; i++) mods[k][i] = (unsigned char)(31 * k + 7 * i + 1);
    }
    size_t size = 0;
    unsigned char *set = cuda_module_set_pack((const void *const *)mods, lens, N, &size);
    assert_non_null(set);
    const void *got[CUDA_MAX_MODULES];
    size_t got_sizes[CUDA_MAX_MODULES];
    assert_int_equal(cuda_module_set_split(set, size, got, got_sizes, CUDA_MAX_MODULES), N);
    for (int k = 0; k < N; k++) {
        assert_int_equal(got_sizes[k], lens[k]);
        assert_memory_equal(got[k], mods[k], lens[k]);
        assert_int_equal(((const unsigned char *)got[k] - set) % 16, 0);
    }
    /* one cubin (an ELF file) is taken whole */
    assert_int_equal(cuda_module_set_split(mods[0], lens[0], got, got_sizes, CUDA_MAX_MODULES), 1);
    assert_ptr_equal(got[0], mods[0]);
    assert_int_equal(got_sizes[0], lens[0]);
    /* cut short anywhere inside the last module, or inside the header: refused */
    assert_int_equal(cuda_module_set_split(set, size - 16 - 16, got, got_sizes, CUDA_MAX_MODULES), -1);
    assert_int_equal(cuda_module_set_split(set, 20, got, got_sizes, CUDA_MAX_MODULES), -1);
    assert_int_equal(cuda_module_set_split(set, size, got, got_sizes, N - 1), -1);   /* more than max */
    set[8] = 2;   /* another version */
    assert_int_equal(cuda_module_set_split(set, size, got, got_sizes, CUDA_MAX_MODULES), -1);
    free(set);
    for (int k = 0; k < N; k++) free(mods[k]);

    /* a graph's kernels: CUDA_MODULE_PARTS cubins, each kernel in exactly one of them */
    Arena *a = arena_new();
    Graph *g = tiny_model(a, 1, NULL);
    CudaBinary bin;
    bool skipped = false;
    char why[512];
    assert_true(cuda_compile_graph(g, &bin, &skipped, why, sizeof why));
    assert_false(skipped);
    int n = cuda_module_set_split(bin.cubin, bin.cubin_size, got, got_sizes, CUDA_MAX_MODULES);
    assert_int_equal(n, bin.n_kernels < CUDA_MODULE_PARTS ? bin.n_kernels : CUDA_MODULE_PARTS);
    for (int k = 0; k < n; k++) assert_memory_equal(got[k], "\x7f" "ELF", 4);
    char *parts[CUDA_MODULE_PARTS];
    int kernels = 0;
    CuNodePlan *plans = cuda_plan_graph(g, a, why, sizeof why);
    assert_non_null(plans);
    int n_parts = cuda_render_module_parts(g, plans, a, parts, &kernels);
    assert_int_equal(n_parts, n);   /* the cubins the blob holds: one a part */
    assert_int_equal(kernels, bin.n_kernels);
    char *whole = cuda_render_module(g, plans, a, NULL);
    int entries = 0;
    for (int p = 0; p < n_parts; p++)
        for (const char *e = strstr(parts[p], "extern \"C\" __global__"); e; e = strstr(e + 1, "extern \"C\" __global__")) {
            const char *end = strchr(e, '\n');
            assert_non_null(end);
            char line[4096];
            size_t len = (size_t)(end - e) < sizeof line - 1 ? (size_t)(end - e) : sizeof line - 1;
            memcpy(line, e, len);
            line[len] = 0;
            assert_non_null(strstr(whole, line));
            for (int q = 0; q < n_parts; q++)
                if (q != p) assert_null(strstr(parts[q], line));
            entries++;
        }
    assert_int_equal(entries, kernels);
    printf("  gpt2_tiny -O1: %d kernels in %d modules\n", kernels, n);
    cuda_binary_free(&bin);
    arena_free(a);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (getenv("FP8C_TEST_FILTER")) cmocka_set_test_filter(getenv("FP8C_TEST_FILTER"));   /* one test by name */
    if (!cuda_compiler_available()) {
        printf("test_gpu_nvrtc: skipped: fp8c was built without NVRTC\n");
        return 0;
    }
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_module_set),
                                       cmocka_unit_test(test_update_batch_runs),
                                       cmocka_unit_test(test_fp8_comm_kernels),
                                       cmocka_unit_test(test_grouped_scales_plan),
                                       cmocka_unit_test(test_producer_quantize_plan),
                                       cmocka_unit_test(test_cast_transpose_plan),
                                       cmocka_unit_test(test_inverse_scales_plan),
                                       cmocka_unit_test(test_attention_scales_plan),
                                       cmocka_unit_test(test_amax_scales_plan),
                                       cmocka_unit_test(test_state_scales_plan),
                                       cmocka_unit_test(test_norm_stage_plan),
        cmocka_unit_test(test_norm_block_plan),
                                       cmocka_unit_test(test_inline_elementwise_plan),
                                       cmocka_unit_test(test_gelu_epilogue_plan),
                                       cmocka_unit_test(test_loss_one_pass_plan),
                                       cmocka_unit_test(test_loss_choices_plan),
                                       cmocka_unit_test(test_fusion_switches),
                                       cmocka_unit_test(test_attention_wgmma_choice),
                                       cmocka_unit_test(test_attention_dq_in_dkv_choice),
                                       cmocka_unit_test(test_attention_dkv_parts),
                                       cmocka_unit_test(test_attention_stats_in_dq),
                                       cmocka_unit_test(test_sqnorm_finite_check),
                                       cmocka_unit_test(test_attention_fwd_ws_choice),
                                       cmocka_unit_test(test_attention_fwd_keys_choice),
                                       cmocka_unit_test(test_grad_fast_accum_choice),
                                       cmocka_unit_test(test_optimizers_every_level),
                                       cmocka_unit_test(test_every_model_every_level)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
