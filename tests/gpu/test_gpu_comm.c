/* test_gpu_comm.c — data parallel on two GPUs: the gradient sums, in buckets during the
 * backward or after it, against one GPU.
 *
 * Needs two GPUs and NCCL; with fewer it prints "skipped" and passes. Each run is a set of
 * child processes (a rank each, as a training binary's --gpus N forks them; this process never
 * touches CUDA, which would not survive the fork), driving the GPU device through the same
 * RtDevice calls as runtime/train.c: the ranks meet through a file, run STEPS steps of
 * gpt2_tiny (the micro-step of each rank reads the batch of global micro-step r, its last
 * micro-step runs through run_last_micro_step), and each writes its persistent arena after
 * the last update. The GEMM algorithms are the heuristic's first (FP8C_CUDA_TUNE=0), so that
 * separate runs are comparable bit for bit. Checked:
 *   - the two ranks end with the same bytes (weights, optimizer state, scales): every rank
 *     applied the same update;
 *   - sums in buckets during the backward (comm.overlap, two buckets of 1 MiB or more) and
 *     sums after it (comm.overlap=0) end with the same bytes, at -O1 (bf16 gradients): the
 *     overlap changes when the sums run, not what they compute;
 *   - at -O0 (f32 gradients) two ranks end with the bytes of one GPU with two micro-steps.
 * STEPS is 4, so the last micro-step runs uncaptured once, is captured, and is replayed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "gpu_test.h"

#ifndef GPU_IR_DIR
#define GPU_IR_DIR "."
#endif
#define STEPS 4
#define SKIP_STATUS 77

static char dir[] = "/tmp/fp8c-test-gpu-comm-XXXXXX";

static Graph *load_graph(Arena *arena, const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.ir", GPU_IR_DIR, name);
    int64_t size;
    uint8_t *bytes = rt_read_file(path, &size);
    char *text = bytes ? malloc((size_t)size + 1) : NULL;
    if (!text) {
        fprintf(stderr, "cannot read %s\n", path);
        free(bytes);
        return NULL;
    }
    memcpy(text, bytes, (size_t)size);
    text[size] = 0;
    free(bytes);
    Graph *g = ir_read(arena, path, text);
    free(text);
    return g;
}

static void feed(Node *n, double v) {
    if (!n) return;
    float x = (float)v;
    ref_store(&n->t, &x);
}

/* the batch of global micro-step k of step s: a function of (s, k) only */
static void feed_batch(Node *tokens, Node *targets, int64_t vocab, int step, int k) {
    int64_t n = ir_numel(&tokens->t);
    float *t = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
    uint64_t h = 0x9e3779b97f4a7c15ull * (uint64_t)(1 + step * 131 + k);
    for (int64_t i = 0; i < n; i++) {
        h ^= h >> 31, h *= 0xbf58476d1ce4e5b9ull, h ^= h >> 29, h += 0x94d049bb133111ebull;
        t[i] = (float)(h % (uint64_t)vocab);
        y[i] = (float)((h >> 32) % (uint64_t)vocab);
    }
    ref_store(&tokens->t, t);
    ref_store(&targets->t, y);
    free(t);
    free(y);
}

/* One process of a run: rank `rank` of `world` with `accum` micro-steps, or (world 1) one GPU.
 * Writes the persistent arena after the last step to `out`. Returns an exit status. */
static int run_rank(const char *ir, int rank, int world, int accum, const char *comm_file, const char *out) {
    Arena *arena = arena_new();
    Graph *g = load_graph(arena, ir);
    if (!g) return 10;
    Node *tokens = ir_find(g, "tokens"), *targets = ir_find(g, "targets");
    Node *lr = ir_find(g, "lr"), *step = ir_find(g, "step"), *grad_scale = ir_find(g, "grad_scale");
    int64_t vocab = INT64_MAX;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->op == OP_EMBEDDING && n->in[1] == tokens && n->in[0]->t.dims[0] < vocab)
            vocab = n->in[0]->t.dims[0];
    }
    RtMemory mem;
    if (!tokens || !targets || vocab == INT64_MAX || !rt_memory_bind(g, &mem)) return 11;
    rt_init_params(g, 1234);
    CudaBinary bin;
    bool skipped = false;
    char why[512] = "";
    if (!cuda_compile_graph(g, &bin, &skipped, why, sizeof why) || skipped) {
        fprintf(stderr, "%s: cannot compile: %s\n", ir, why);
        return 12;
    }
    const RtDevice *dev = cuda_rt_device(bin.cubin, bin.cubin_size);
    if (world > 1 && !dev->comm_open(rank, world, comm_file, 60)) return 13;
    if (!dev->open(g, &mem)) return 14;
    Node *io[2] = {tokens, targets}, *scalars[3] = {lr, step, grad_scale};
    Tensor *ts[3];
    bool ok = true;
    for (int s = 0; ok && s < STEPS; s++) {
        feed(lr, 1e-3);
        feed(step, s + 1);
        feed(grad_scale, rt_grad_scale(accum, world));
        for (int k = 0; k < 3; k++) ts[k] = &scalars[k]->t;
        ok = dev->push(ts, 3);
        for (int m = 0; ok && m < accum; m++) {
            feed_batch(tokens, targets, vocab, s, rt_global_micro(rank, accum, m));
            ts[0] = &io[0]->t, ts[1] = &io[1]->t;
            ok = dev->push(ts, 2) &&
                 (m + 1 == accum ? dev->run_last_micro_step(g) : dev->run_micro_step(g));
        }
        ok = ok && dev->run_phase(g, PHASE_UPDATE);
    }
    Tensor **pers = malloc(sizeof *pers * (size_t)g->n_nodes);
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *x = g->nodes[i];
        if (ir_role_is_persistent(x->t.role) && x->t.fmt.elem != FMT_VOID && !ir_op_is_inplace(x->op))
            pers[n++] = &x->t;
    }
    ok = ok && dev->pull(pers, n);
    free(pers);
    if (ok) {
        FILE *f = fopen(out, "wb");
        ok = f && fwrite(mem.persistent, 1, (size_t)mem.persistent_bytes, f) == (size_t)mem.persistent_bytes;
        if (f) ok = fclose(f) == 0 && ok;
    }
    dev->close();
    cuda_binary_free(&bin);
    return ok ? 0 : 15;
}

/* `world` children, rank r writing DIR/NAME.r; true when all ended with status 0 */
static bool run_world(const char *ir, const char *name, int world, int accum) {
    char comm_file[512];
    snprintf(comm_file, sizeof comm_file, "%s/%s.id", dir, name);
    unlink(comm_file);
    pid_t pids[8];
    fflush(NULL);
    for (int r = 0; r < world; r++) {
        char out[512];
        snprintf(out, sizeof out, "%s/%s.%d", dir, name, r);
        pids[r] = fork();
        if (pids[r] == 0) _exit(run_rank(ir, r, world, accum, comm_file, out));
    }
    bool ok = true;
    for (int r = 0; r < world; r++) {
        int st = 0;
        waitpid(pids[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            printf("  %s: rank %d of %d ended with status %d\n", name, r, world,
                   WIFEXITED(st) ? WEXITSTATUS(st) : -1);
            ok = false;
        }
    }
    return ok;
}

static bool same_file(const char *a, const char *b) {
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s", dir, a);
    snprintf(pb, sizeof pb, "%s/%s", dir, b);
    int64_t na = 0, nb = 0;
    uint8_t *x = rt_read_file(pa, &na), *y = rt_read_file(pb, &nb);
    bool same = x && y && na == nb && memcmp(x, y, (size_t)na) == 0;
    int64_t differ = 0;
    for (int64_t i = 0; x && y && na == nb && i < na; i++) differ += x[i] != y[i];
    if (!same) printf("  %s and %s differ (%lld of %lld bytes)\n", a, b, (long long)differ, (long long)na);
    free(x);
    free(y);
    return same;
}

/* Two GPUs and NCCL here? Asked in a child: CUDA must not start in this process. The child
 * also compiles the graphs' modules once, so that the ranks find them in the cache. */
static bool two_gpus(void) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        char why[512] = "";
        if (!cuda_load(why, sizeof why) || cuda_device_count() < 2) {
            printf("test_gpu_comm: skipped: not two GPUs here (%s)\n", *why ? why : "one GPU");
            fflush(stdout);
            _exit(SKIP_STATUS);
        }
        const char *names[] = {"gpt2_tiny_dp_O1", "gpt2_tiny_dp_serial_O1", "gpt2_tiny_dp_O0"};
        for (int i = 0; i < 3; i++) {
            Arena *arena = arena_new();
            Graph *g = load_graph(arena, names[i]);
            CudaBinary bin;
            bool skipped = false;
            if (!g || !cuda_compile_graph(g, &bin, &skipped, why, sizeof why) || skipped) _exit(1);
            bool nccl = cuda_rt_device(bin.cubin, bin.cubin_size)->comm_probe(2, why, sizeof why);
            cuda_binary_free(&bin);
            arena_free(arena);
            if (!nccl) {
                printf("test_gpu_comm: skipped: %s\n", why);
                fflush(stdout);
                _exit(SKIP_STATUS);
            }
        }
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == SKIP_STATUS) return false;
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    return true;
}

static void test_two_ranks(void **state) {
    (void)state;
    if (!two_gpus()) return;
    /* -O1, bf16 gradients: the ranks agree, and overlap on and off compute the same bits */
    assert_true(run_world("gpt2_tiny_dp_O1", "overlap", 2, 1));
    assert_true(same_file("overlap.0", "overlap.1"));
    assert_true(run_world("gpt2_tiny_dp_serial_O1", "serial", 2, 1));
    assert_true(same_file("serial.0", "serial.1"));
    assert_true(same_file("overlap.0", "serial.0"));
    /* with two micro-steps per rank as well */
    assert_true(run_world("gpt2_tiny_dp_O1", "overlap_a2", 2, 2));
    assert_true(same_file("overlap_a2.0", "overlap_a2.1"));
    assert_true(run_world("gpt2_tiny_dp_serial_O1", "serial_a2", 2, 2));
    assert_true(same_file("overlap_a2.0", "serial_a2.0"));
    /* -O0, f32 gradients: two ranks are one GPU with two micro-steps, bit for bit */
    assert_true(run_world("gpt2_tiny_dp_O0", "ranks_O0", 2, 1));
    assert_true(run_world("gpt2_tiny_dp_O0", "one_O0", 1, 2));
    assert_true(same_file("ranks_O0.0", "ranks_O0.1"));
    assert_true(same_file("ranks_O0.0", "one_O0.0"));
}

int main(void) {
    setenv("FP8C_CUDA_TUNE", "0", 1);   /* the heuristic's first algorithm: runs comparable */
    if (!mkdtemp(dir)) return 1;
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_two_ranks)};
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) rc = rc ? rc : 1;
    return rc;
}
