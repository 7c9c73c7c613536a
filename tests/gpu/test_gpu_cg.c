/* test_gpu_cg.c — the kernel IR rendered to CUDA C (cuda/cg_render.c), kernel by kernel,
 * against the reference executor.
 *
 * For each graph the training-step test reads (tests/gpu/CMakeLists.txt writes them), the
 * graph is lowered to the kernel IR with fusion, exactly as the CPU backend lowers it, and
 * its loop kernels are rendered and compiled by NVRTC. Then the step runs kernel by kernel in
 * program order: each loop kernel on the GPU, its graph nodes in the reference executor from
 * the same bytes, and every graph tensor the kernel writes is compared (normalized error,
 * gpu_test.h). GEMM and reference kernels run in the reference only; a GEMM whose result goes
 * to scratch (for its group's epilogue kernel) is computed on the host as the reference
 * computes the matmul (ref_gemm on the decoded operands) and copied into the device's scratch,
 * so the epilogue reads the product the reference reads. The GPU's results are copied aside
 * and the host mirror gets its own bytes back before the reference runs: an output may share
 * storage with an input (in-place accumulation, a planned reuse), and the reference must not
 * read the GPU's result there. After each kernel the device takes the reference's bytes, so
 * an error is charged to the kernel that made it.
 * Bounds by the written tensor's format: f32 1e-4 (f32 sums in the kernel, f64 in the
 * reference), bf16 2e-2, FP8 and 8-bit codes 0.15, i32 exact. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gpu_test.h"
#include "ref_internal.h"

#ifndef GPU_IR_DIR
#define GPU_IR_DIR "."
#endif

static double bound_for(ElemType e) {
    switch (e) {
    case FMT_F32: return 1e-4;
    case FMT_BF16: case FMT_F16: return 2e-2;
    case FMT_I32: return 0;
    default: return 0.15;
    }
}

static void feed_inputs(Graph *g) {
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->op != OP_INPUT) continue;
        int64_t count = ir_numel(&n->t);
        float *x = malloc(sizeof(float) * (size_t)(count ? count : 1));
        int64_t vocab = 256;
        for (int j = 0; j < g->n_nodes; j++)
            if (g->nodes[j]->op == OP_EMBEDDING && g->nodes[j]->in[1] == n) vocab = g->nodes[j]->in[0]->t.dims[0];
        for (int64_t k = 0; k < count; k++)
            x[k] = n->t.fmt.elem == FMT_I32 ? (float)gt_int(0, vocab) : n->t.name && !strcmp(n->t.name, "lr") ? 1e-3f : 1.0f;
        ref_store(&n->t, x);
        free(x);
    }
}

/* A GEMM kernel that writes scratch: C = op(A) @ op(B) in f32 from the host's operands, as
 * ref_matmul computes it, into the device's copy of that scratch array. */
static bool gemm_to_scratch(CudaCg *c, const CgKernel *k) {
    const CgGemm *m = &k->gemm;
    const CgBuf *ab = &k->bufs[m->a], *bb = &k->bufs[m->b], *cb = &k->bufs[m->c];
    if (cb->node || cb->scratch == CG_NONE) return true;   /* the reference writes the tensor */
    if (!ab->node || !bb->node || m->accumulate) {
        printf("  kernel %s: GEMM operands in scratch or accumulating into scratch: not checked here\n", k->name);
        return false;
    }
    float *a = ref_load(&ab->node->t), *b = ref_load(&bb->node->t);
    int64_t count = m->M * m->N;
    float *out = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1));
    bool ok = a && b && out;
    if (ok) {
        ref_gemm(m->M, m->N, m->K, a, m->trans_a ? m->M : m->K, m->trans_a, b, m->trans_b ? m->K : m->N,
                 m->trans_b, out);
        ok = cuda_cg_write_scratch(c, cb->scratch, out, count);
    }
    free(a);
    free(b);
    free(out);
    return ok;
}

static bool compile_only;   /* FP8C_TEST_COMPILE_ONLY=1: compile the modules (fill the cache) */

static int check_graph(const char *path) {
    int64_t size;
    uint8_t *bytes = rt_read_file(path, &size);
    char *text = bytes ? malloc((size_t)size + 1) : NULL;
    if (!text) return 1;
    memcpy(text, bytes, (size_t)size);
    text[size] = 0;
    free(bytes);
    Arena *arena = arena_new();
    Graph *g = ir_read(arena, path, text);
    free(text);
    RtMemory mem;
    if (!g || !rt_memory_bind(g, &mem)) {
        arena_free(arena);
        return 1;
    }
    rt_init_params(g, gt_next());
    feed_inputs(g);
    int failures = 0, checked = 0;
    CgLowerOptions lo = {.fuse = true, .gemm_f32 = false};
    CgProgram *p = cg_lower(g, arena, &lo);
    if (compile_only) {
        CudaBinary b;
        bool ok = p && cuda_compile_source(cuda_render_cg_program(p, arena), "kernel-ir.cu", &b);
        printf("  %s: kernel IR module %s\n", path, ok ? "compiled" : "FAILED");
        if (ok) cuda_binary_free(&b);
        rt_memory_free(&mem);
        arena_free(arena);
        return ok ? 0 : 1;
    }
    CudaBinary lib, bin;
    bool skipped = false;
    char why[512] = "";
    CudaExec *e = NULL;
    CudaCg *c = NULL;
    if (!p || !cuda_compile_graph(g, &lib, &skipped, why, sizeof why) || skipped) {
        printf("  %s: cannot set up (%s)\n", path, p ? why : "lowering failed");
        failures++;
        goto done;
    }
    e = cuda_exec_open(g, &mem, lib.cubin, lib.cubin_size);
    cuda_binary_free(&lib);
    char *src = cuda_render_cg_program(p, arena);
    if (!e || !cuda_compile_source(src, "kernel-ir.cu", &bin)) {
        failures++;
        goto done;
    }
    c = cuda_cg_open(e, p, bin.cubin, bin.cubin_size);
    cuda_binary_free(&bin);
    if (!c) {
        failures++;
        goto done;
    }
    /* each node runs in the reference once, at the last kernel that lists it */
    int *last = malloc(sizeof(int) * (size_t)g->n_nodes);
    for (int i = 0; i < g->n_nodes; i++) {
        last[i] = -1;
        g->nodes[i]->pass_data = NULL;
    }
    ir_renumber(g);
    for (int k = 0; k < p->n_kernels; k++)
        for (int j = 0; j < p->kernels[k]->n_nodes; j++) last[p->kernels[k]->nodes[j]->index] = k;
    double worst[FMT_COUNT] = {0};
    for (int k = 0; k < p->n_kernels && failures < 20; k++) {
        CgKernel *kern = p->kernels[k];
        Tensor *out[64];
        int n_out = 0;
        for (int b = 0; b < kern->n_bufs && n_out < 64; b++)
            if (kern->bufs[b].node && kern->bufs[b].written && kern->bufs[b].node->t.fmt.elem != FMT_VOID)
                out[n_out++] = &kern->bufs[b].node->t;
        void *gpu[64] = {0}, *host[64] = {0};
        bool loop = kern->kind == CG_KERNEL_LOOP;
        if (kern->kind == CG_KERNEL_GEMM && !gemm_to_scratch(c, kern)) {
            printf("  %s: GEMM kernel %s: cannot hand its result to the GPU\n", path, kern->name);
            failures++;
            break;
        }
        if (loop) {
            for (int j = 0; j < n_out; j++) {
                host[j] = malloc((size_t)gt_bytes(out[j]) + 1);
                memcpy(host[j], out[j]->data, (size_t)gt_bytes(out[j]));
            }
            bool ran_ok = cuda_cg_run_kernel(c, kern) && cuda_exec_pull(e, out, n_out);
            for (int j = 0; j < n_out; j++) {
                gpu[j] = malloc((size_t)gt_bytes(out[j]) + 1);
                memcpy(gpu[j], out[j]->data, (size_t)gt_bytes(out[j]));
            }
            for (int j = n_out - 1; j >= 0; j--) {   /* the host's bytes back for the reference */
                memcpy(out[j]->data, host[j], (size_t)gt_bytes(out[j]));
                free(host[j]);
            }
            if (!ran_ok) {
                printf("  %s: kernel %s failed on the GPU\n", path, kern->name);
                for (int j = 0; j < n_out; j++) free(gpu[j]);
                failures++;
                break;
            }
        }
        /* the reference for the nodes this kernel completes, then the device takes its bytes.
         * The group runs at its root's place: its fused intermediates (every member but the
         * root, read only inside the group) get private storage, because the memory plan may
         * have handed their slots to tensors made since (which the group still reads). */
        Tensor *touched[256];
        int n_touched = 0;
        Node *root = kern->n_nodes ? kern->nodes[kern->n_nodes - 1] : NULL;
        void *slot[256] = {0};
        for (int j = 0; j < kern->n_nodes && j < 256; j++) {
            Node *n = kern->nodes[j];
            if (last[n->index] != k || n == root || n->t.fmt.elem == FMT_VOID || !n->t.data ||
                n->t.fmt.codec != CODEC_PLAIN)
                continue;
            slot[j] = n->t.data;
            n->t.data = calloc(1, (size_t)gt_bytes(&n->t) + 16);
        }
        for (int j = 0; j < kern->n_nodes; j++) {
            Node *n = kern->nodes[j];
            if (last[n->index] != k) continue;
            ref_exec_node(n);
            if (n->t.fmt.elem != FMT_VOID && n_touched < 256 && !(j < 256 && slot[j])) touched[n_touched++] = &n->t;
            for (int i = 0; i < n->n_in && n_touched < 256; i++)
                if (ir_mutates_input(n, i)) {
                    touched[n_touched++] = &n->in[i]->t;
                    const Format *f = &n->in[i]->t.fmt;
                    if (f->codec != CODEC_PLAIN && f->codec != CODEC_SPLIT && f->scale && n_touched < 256)
                        touched[n_touched++] = &f->scale->t;
                }
        }
        for (int j = 0; j < kern->n_nodes && j < 256; j++)
            if (slot[j]) {
                free(kern->nodes[j]->t.data);
                kern->nodes[j]->t.data = slot[j];
            }
        for (int j = 0; loop && j < n_out; j++) {
            bool ran = false;   /* compare only what the reference computed here */
            for (int t = 0; t < n_touched; t++) ran |= touched[t] == out[j];
            if (ran && out[j]->fmt.codec == CODEC_PLAIN) {
                Tensor gt = *out[j];
                gt.data = gpu[j];
                float *ga = ref_load(&gt), *ra = ref_load(out[j]);
                double max_abs, err = gt_norm_error(ga, ra, ir_numel(out[j]), &max_abs);
                ElemType el = out[j]->fmt.elem;
                checked++;
                if (err > worst[el]) worst[el] = err;
                double bound = bound_for(el);
                if (err < 0 || (bound == 0 ? err != 0 : err > bound)) {
                    printf("  %s: kernel %s (%s) writes %s %s[%lld]: err %.2e > %.0e\n", path, kern->name,
                           kern->par == CG_PAR_BLOCK ? "block" : "thread", out[j]->name ? out[j]->name : "?",
                           fmt_elem_name(el), (long long)ir_numel(out[j]), err, bound);
                    failures++;
                }
                free(ga);
                free(ra);
            }
            free(gpu[j]);
        }
        if (!cuda_exec_push(e, touched, n_touched)) {
            failures++;
            break;
        }
    }
    free(last);
    printf("  %-22s %d kernels (%d bodies), %d outputs compared, worst f32 %.1e bf16 %.1e e4m3 %.1e e5m2 %.1e%s\n",
           strrchr(path, '/') ? strrchr(path, '/') + 1 : path, p->n_kernels, p->n_funcs, checked,
           worst[FMT_F32], worst[FMT_BF16], worst[FMT_E4M3], worst[FMT_E5M2], failures ? "  FAIL" : "");
done:
    cuda_cg_close(c);
    cuda_exec_close(e);
    rt_memory_free(&mem);
    arena_free(arena);
    return failures ? 1 : 0;
}

static void test_kernel_ir(void **state) {
    (void)state;
    const char *dir = getenv("FP8C_GPU_IR_DIR");
    if (!dir || !*dir) dir = GPU_IR_DIR;
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *de;
    int graphs = 0, failed = 0;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len < 4 || strcmp(de->d_name + len - 3, ".ir")) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        graphs++;
        failed += check_graph(path);
    }
    closedir(d);
    assert_true(graphs > 0);
    if (failed) fail_msg("%d of %d graphs have rendered kernels that differ from the reference", failed, graphs);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *only = getenv("FP8C_TEST_COMPILE_ONLY");
    compile_only = only && !strcmp(only, "1");
    if (!compile_only) gt_require_gpu("test_gpu_cg");
    gt_seed();
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_kernel_ir)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
