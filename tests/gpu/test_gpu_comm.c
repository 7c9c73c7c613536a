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
 *   - at -O0 (f32 gradients) two ranks end with the bytes of one GPU with two micro-steps;
 *   - the FP8 reduction (comm:grad=e5m2 at -O1, e4m3 at -O0: bf16 and f32 accumulators, two
 *     buckets): each rank runs its micro-step once without the reduction and keeps its own
 *     gradients, then again with it (the same batch from zeroed accumulators: the same
 *     gradients) and keeps what the reduction left; both ranks must hold the same bytes, and
 *     those must be, bit for bit, what the host reference (runtime/comm_fp8.c) computes from
 *     the two ranks' own gradients, rounded to the accumulators' formats. Four steps of it end
 *     with the same bytes on both ranks, with the reduction during the backward and after it.
 *   - sharded states (--shard-states, cuda/exec_shard.c) against the unsharded data-parallel
 *     step, at -O1 (f32 masters, FP8 weight copies whose amaxes the ranks agree on), -O2 (e4m3
 *     states with range expansion, groups of 128) and -O3 (companded 8-bit states, split
 *     masters), with clipping active in every step (max_norm far below the gradient norm):
 *     after STEPS steps rank 0 gathers the shards, and its persistent arena (weights, FP8
 *     copies, masters, states with their side values, scales, histories, gradients), every
 *     step's gradient norm and loss on each rank must be the unsharded run's bytes; both ranks
 *     must hold the same weights; each rank's device arena must be the plan's per-GPU size
 *     (rt_shard_plan) up to alignment. The norm is summed over fixed chunks the shards respect,
 *     so it, the clip coefficient and the weights are the unsharded ones bit for bit. Also with
 *     two micro-steps, with the reductions after the backward and with the model's clipping.
 *   - sharded gradients (--shard-states=2, cuda/exec_grads.c): with one micro-step, the same
 *     bytes as the unsharded run at O1..O3 (clipping active); with two micro-steps (another
 *     order of the sums, runtime/comm_grads.c) the ranks equal and the weights within 0.25 of
 *     the update of the unsharded run's (the bound's reason is at the test).
 *   - sharded weights (--shard-states=3, cuda/exec_gather.c: each layer's weights gathered into
 *     layer buffers while the step runs: bf16 at -O0, the e4m3 copies at -O1, at -O3 the
 *     forward's e4m3 quantizes, made of the ranks' shards, and the bf16 weights in the
 *     backward): with one micro-step and clipping active, rank 0's gathered arena, every
 *     step's norm and loss and a last evaluation's (the forward list, with its own gathers)
 *     are the unsharded run's on each rank at -O0, -O1 and -O3; with two micro-steps stage 3
 *     is stage 2's bytes (the same sums and norm, the same weights gathered); each rank's
 *     device arena is the plan's per-GPU size.
 * Every run also ends with an evaluation forward after its arena is written; each rank writes
 * its losses (every step's, then the evaluation's) to OUT.loss, every step's gradient norm to
 * OUT.norm and its initial weights to OUT.w0.
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
#include "passes.h"

#ifndef GPU_IR_DIR
#define GPU_IR_DIR "."
#endif
#define STEPS 4
#define SKIP_STATUS 77

static char dir[] = "/tmp/fp8c-test-gpu-comm-XXXXXX";
/* The ranks' graphs' max_norm (set before forking them): CLIP_MODEL the model's (1.0), 0 no
 * clipping, CLIP_ACTIVE one far below gpt2_tiny's gradient norm, so that every step clips (the
 * runs write each step's norm, and the tests check that it is above). */
#define CLIP_MODEL (-1.0)
#define CLIP_ACTIVE 1e-3
static double max_norm = CLIP_MODEL;

/* the IR directory: $FP8C_GPU_IR_DIR (a build carried to another machine), else the build's */
static const char *ir_dir(void) {
    const char *d = getenv("FP8C_GPU_IR_DIR");
    return d && *d ? d : GPU_IR_DIR;
}

static Graph *load_graph(Arena *arena, const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.ir", ir_dir(), name);
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

/* A rank's graph, bound, initialized, compiled and open on its GPU (and its communicator where
 * world > 1), with the inputs a step feeds. */
typedef struct {
    Graph *g;
    RtMemory mem;
    CudaBinary bin;
    const RtDevice *dev;
    Node *tokens, *targets, *lr, *step, *grad_scale, *loss;
    int64_t vocab;
} Rank;

/* 0, or the exit status that says what failed: 10 the graph, 11 its inputs or memory, 12 the
 * compile, 13 the communicator, 14 the device */
static int rank_open(Rank *r, const char *ir, int rank, int world, const char *comm_file) {
    Graph *g = r->g = load_graph(arena_new(), ir);
    if (!g) return 10;
    for (int i = 0; max_norm >= 0 && i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_CLIP_COEF) IR_FATTR(g->nodes[i], CLIP_COEF, max_norm) = max_norm;
    r->tokens = ir_find(g, "tokens"), r->targets = ir_find(g, "targets");
    r->lr = ir_find(g, "lr"), r->step = ir_find(g, "step"), r->grad_scale = ir_find(g, "grad_scale");
    r->loss = ir_find(g, "loss");
    r->vocab = INT64_MAX;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->op == OP_EMBEDDING && n->in[1] == r->tokens && n->in[0]->t.dims[0] < r->vocab)
            r->vocab = n->in[0]->t.dims[0];
    }
    if (!r->tokens || !r->targets || r->vocab == INT64_MAX || !rt_memory_bind(g, &r->mem)) return 11;
    rt_init_params(g, 1234);
    bool skipped = false;
    char why[512] = "";
    if (!cuda_compile_graph(g, &r->bin, &skipped, why, sizeof why) || skipped) {
        fprintf(stderr, "%s: cannot compile: %s\n", ir, why);
        return 12;
    }
    r->dev = cuda_rt_device(r->bin.cubin, r->bin.cubin_size);
    if (world > 1 && !r->dev->comm_open(rank, world, comm_file, 60)) return 13;
    if (!r->dev->open(g, &r->mem)) return 14;
    return 0;
}

/* A sharded rank's device arena against the plan's per-GPU figure (rank 0 keeps the most):
 * the executor's line says how many bytes its persistent arena takes. */
static bool sharded_memory_as_planned(const Rank *r, int rank, int world) {
    const char *d = r->dev->describe(), *at = strstr(d, "persistent arena ");
    long long dev = 0, whole = 0;
    if (!at || sscanf(at, "persistent arena %lld bytes on this GPU, %lld whole", &dev, &whole) != 2) {
        printf("  rank %d: the executor did not shard (%s)\n", rank, d);
        return false;
    }
    MemSummary m;
    memplan_summarize(r->g, &m);
    RtShardPlan sp;
    rt_shard_plan(r->g, m.by_role, world, &sp);
    int updates = 0;
    for (int i = 0; i < r->g->n_nodes; i++) updates += ir_op_is_update(r->g->nodes[i]->op);
    long long slack = 512LL * (8 * updates + 1);   /* each kept run starts on its alignment mod 256 */
    printf("  rank %d: persistent arena %lld bytes on the GPU of %lld whole; the plan's rank 0 saves %lld\n",
           rank, dev, whole, (long long)sp.saved);
    return dev < whole && (rank != 0 || llabs((whole - dev) - sp.saved) <= slack);
}

/* the bytes of the weights (PARAM tensors), one after another, from the host mirror */
static bool write_weights(const char *path, Graph *g) {
    FILE *f = fopen(path, "wb");
    bool ok = f != NULL;
    for (int i = 0; ok && i < g->n_nodes; i++) {
        const Tensor *t = &g->nodes[i]->t;
        if (g->nodes[i]->op == OP_PARAM && t->data)
            ok = fwrite(t->data, 1, (size_t)(ir_numel(t) * fmt_elem_bytes(t->fmt.elem)), f) ==
                 (size_t)(ir_numel(t) * fmt_elem_bytes(t->fmt.elem));
    }
    if (f) ok = fclose(f) == 0 && ok;
    return ok;
}

/* the scalar loss, from the device */
static float read_loss(const RtDevice *dev, Node *loss) {
    Tensor *t = &loss->t;
    if (!dev->pull(&t, 1)) return 0;
    float *v = ref_load(t), x = v[0];
    free(v);
    return x;
}

/* One process of a run: rank `rank` of `world` with `accum` micro-steps, or (world 1) one GPU.
 * Writes the persistent arena after the last step to `out` (with sharded states: after
 * gathering them to rank 0, whose file then holds every rank's shards), its weights to out.w,
 * the initial weights to out.w0, every step's loss and the evaluation's to out.loss and every
 * step's gradient norm to out.norm. Returns an exit status. */
static int run_rank(const char *ir, int rank, int world, int accum, const char *comm_file, const char *out) {
    Rank r;
    int status = rank_open(&r, ir, rank, world, comm_file);
    if (status) return status;
    Graph *g = r.g;
    const RtDevice *dev = r.dev;
    Node *tokens = r.tokens, *targets = r.targets, *lr = r.lr, *step = r.step, *grad_scale = r.grad_scale;
    int64_t vocab = r.vocab;
    bool sharded = world > 1 && rt_shard_states(g);
    if (sharded && !sharded_memory_as_planned(&r, rank, world)) return 17;
    Node *io[2] = {tokens, targets}, *scalars[3] = {lr, step, grad_scale};
    Tensor *ts[3];
    float losses[STEPS + 1], norms[STEPS];
    Node *norm = ir_find(g, "grad_norm");
    bool ok = r.loss != NULL && norm != NULL;
    char w0[600];   /* the initial weights (the host's, before the first push of the step) */
    snprintf(w0, sizeof w0, "%s.w0", out);
    ok = ok && write_weights(w0, g);
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
        losses[s] = ok ? read_loss(dev, r.loss) : 0;   /* the last micro-step's */
        ok = ok && dev->run_phase(g, PHASE_UPDATE);
        norms[s] = ok ? read_loss(dev, norm) : 0;      /* the step's gradient norm, as logged */
    }
    Tensor **pers = malloc(sizeof *pers * (size_t)g->n_nodes);
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *x = g->nodes[i];
        if (ir_role_is_persistent(x->t.role) && x->t.fmt.elem != FMT_VOID && !ir_op_is_inplace(x->op))
            pers[n++] = &x->t;
    }
    if (sharded) ok = ok && dev->gather && dev->gather(pers, n);   /* every rank: a collective */
    ok = ok && dev->pull(pers, n);
    free(pers);
    if (ok) {
        FILE *f = fopen(out, "wb");
        ok = f && fwrite(r.mem.persistent, 1, (size_t)r.mem.persistent_bytes, f) == (size_t)r.mem.persistent_bytes;
        if (f) ok = fclose(f) == 0 && ok;
        char path[600];
        snprintf(path, sizeof path, "%s.w", out);
        ok = ok && write_weights(path, g);
    }
    /* an evaluation forward (every rank: with --shard-states=3 it gathers) on step 0's batch */
    feed_batch(tokens, targets, vocab, 0, rt_global_micro(rank, accum, 0));
    ts[0] = &io[0]->t, ts[1] = &io[1]->t;
    ok = ok && dev->push(ts, 2) && dev->run_phase(g, PHASE_FORWARD);
    losses[STEPS] = ok ? read_loss(dev, r.loss) : 0;
    if (ok) {
        char path[600];
        snprintf(path, sizeof path, "%s.loss", out);
        FILE *f = fopen(path, "wb");
        ok = f && fwrite(losses, sizeof losses, 1, f) == 1;
        if (f) ok = fclose(f) == 0 && ok;
        snprintf(path, sizeof path, "%s.norm", out);
        f = fopen(path, "wb");
        ok = ok && f && fwrite(norms, sizeof norms, 1, f) == 1;
        if (f) ok = fclose(f) == 0 && ok;
    }
    dev->close();
    cuda_binary_free(&r.bin);
    return ok ? 0 : 15;
}

/* The accumulators each ALL_REDUCE sums, in the order the buckets send them. */
static int reduced_accumulators(Graph *g, RtCommPlan *cp, Tensor **out) {
    if (!rt_comm_plan(g, cp)) return -1;
    for (int i = 0; i < cp->n_reduce; i++) {
        Node *acc = cp->reduce[i]->in[0];
        while (acc->op == OP_ACCUMULATE) acc = acc->in[0];
        out[i] = &acc->t;
    }
    return cp->n_reduce;
}

/* f32 values of tensors ts[0 .. n) (host mirrors), one after another, to path */
static bool write_values(const char *path, Tensor **ts, int n) {
    FILE *f = fopen(path, "wb");
    bool ok = f != NULL;
    for (int i = 0; ok && i < n; i++) {
        float *v = ref_load(ts[i]);
        ok = fwrite(v, sizeof *v, (size_t)ir_numel(ts[i]), f) == (size_t)ir_numel(ts[i]);
        free(v);
    }
    if (f) ok = fclose(f) == 0 && ok;
    return ok;
}

/* One rank of the FP8 reduction's check: step 1's micro-step without the reduction (its own
 * gradients to out.pre), the accumulators zeroed, the same micro-step with the reduction
 * (out.post). Returns an exit status. */
static int run_rank_fp8(const char *ir, int rank, int world, const char *comm_file, const char *out) {
    Rank r;
    int status = rank_open(&r, ir, rank, world, comm_file);
    if (status) return status;
    Graph *g = r.g;
    const RtDevice *dev = r.dev;
    Node *tokens = r.tokens, *targets = r.targets, *lr = r.lr, *step = r.step, *grad_scale = r.grad_scale;
    RtCommPlan cp;
    Tensor **acc = malloc(sizeof *acc * (size_t)g->n_nodes);
    int n_acc = acc ? reduced_accumulators(g, &cp, acc) : -1;
    if (n_acc <= 0) return 15;
    feed(lr, 1e-3);
    feed(step, 1);
    feed(grad_scale, rt_grad_scale(1, world));
    Tensor *ts[3] = {&lr->t, &step->t, &grad_scale->t}, *io[2] = {&tokens->t, &targets->t};
    char path[600];
    feed_batch(tokens, targets, r.vocab, 0, rt_global_micro(rank, 1, 0));
    bool ok = dev->push(ts, 3) && dev->push(io, 2) && dev->run_micro_step(g) && dev->pull(acc, n_acc);
    snprintf(path, sizeof path, "%s.pre", out);
    ok = ok && write_values(path, acc, n_acc) && dev->zero(acc, n_acc) && dev->push(io, 2) &&
         dev->run_last_micro_step(g) && dev->pull(acc, n_acc);
    snprintf(path, sizeof path, "%s.post", out);
    ok = ok && write_values(path, acc, n_acc);
    rt_comm_plan_free(&cp);
    free(acc);
    dev->close();
    cuda_binary_free(&r.bin);
    return ok ? 0 : 16;
}

/* The two ranks' reduced gradients against the host reference, bucket by bucket. */
static bool fp8_matches_reference(const char *ir, const char *name) {
    Arena *arena = arena_new();
    Graph *g = load_graph(arena, ir);
    RtCommPlan cp;
    Tensor **acc = g ? malloc(sizeof *acc * (size_t)g->n_nodes) : NULL;
    int n_acc = acc ? reduced_accumulators(g, &cp, acc) : -1;
    if (n_acc <= 0) return false;
    float *pre[2], *post[2];
    int64_t bytes[4] = {0};
    for (int r = 0; r < 2; r++) {
        char path[600];
        snprintf(path, sizeof path, "%s/%s.%d.pre", dir, name, r);
        pre[r] = (float *)rt_read_file(path, &bytes[r]);
        snprintf(path, sizeof path, "%s/%s.%d.post", dir, name, r);
        post[r] = (float *)rt_read_file(path, &bytes[2 + r]);
    }
    bool ok = pre[0] && pre[1] && post[0] && post[1] && bytes[0] == bytes[2] && bytes[1] == bytes[0] &&
              bytes[3] == bytes[0] && memcmp(post[0], post[1], (size_t)bytes[0]) == 0;
    if (!ok) printf("  %s: the two ranks' reduced gradients differ (or are missing)\n", name);
    int64_t at = 0, differ = 0, total = 0, changed = 0;
    for (int b = 0; ok && b < cp.n_buckets; b++) {
        const RtBucket *k = &cp.buckets[b];
        float *out = malloc(sizeof *out * (size_t)k->elems);
        const float *x[2] = {pre[0] + at, pre[1] + at};
        rt_comm_fp8_reduce(cp.wire, 2, k->elems, x, out);
        int64_t e = 0;
        for (int i = k->first; i < k->first + k->count; i++) {
            ElemType elem = acc[i]->fmt.elem;
            for (int64_t j = 0; j < ir_numel(acc[i]); j++, e++) {
                float want = num_round(elem, out[e]), got = post[0][at + e];
                changed += got != pre[0][at + e];
                if (memcmp(&want, &got, sizeof want)) {
                    if (differ++ < 5)
                        printf("  %s: bucket %d, %s[%lld]: GPU %.9g, host %.9g (ranks' own %.9g, %.9g)\n", name,
                               b, acc[i]->name ? acc[i]->name : "?", (long long)j, got, want, x[0][e], x[1][e]);
                }
            }
        }
        at += k->elems;
        total += k->elems;
        free(out);
    }
    printf("  %s: %lld gradient elements in %d buckets, %lld differ from the host reference; "
           "%lld changed by the reduction\n", name, (long long)total, cp.n_buckets, (long long)differ,
           (long long)changed);
    for (int r = 0; r < 2; r++) free(pre[r]), free(post[r]);
    rt_comm_plan_free(&cp);
    free(acc);
    arena_free(arena);
    return ok && differ == 0 && total > 0 && changed > 0;
}

static bool run_world_fp8(const char *ir, const char *name) {
    char comm_file[512];
    snprintf(comm_file, sizeof comm_file, "%s/%s.id", dir, name);
    unlink(comm_file);
    pid_t pids[2];
    fflush(NULL);
    for (int r = 0; r < 2; r++) {
        char out[512];
        snprintf(out, sizeof out, "%s/%s.%d", dir, name, r);
        pids[r] = fork();
        if (pids[r] == 0) _exit(run_rank_fp8(ir, r, 2, comm_file, out));
    }
    bool ok = true;
    for (int r = 0; r < 2; r++) {
        int st = 0;
        waitpid(pids[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            printf("  %s: rank %d ended with status %d\n", name, r, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
            ok = false;
        }
    }
    return ok;
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

/* The normalized error ||b - a|| / ||a - base|| of the weights in files DIR/a and DIR/b
 * (write_weights of graph ir's parameters), decoded through their formats: relative to the
 * weights (base NULL) or to the update from DIR/base; -1 when they cannot be read. */
static double weights_error(const char *ir, const char *a, const char *b, const char *base) {
    Arena *arena = arena_new();
    Graph *g = load_graph(arena, ir);
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s", dir, a);
    snprintf(pb, sizeof pb, "%s/%s", dir, b);
    int64_t na = 0, nb = 0, n0 = 0;
    uint8_t *x = rt_read_file(pa, &na), *y = rt_read_file(pb, &nb), *z = NULL;
    if (base) {
        char p0[512];
        snprintf(p0, sizeof p0, "%s/%s", dir, base);
        z = rt_read_file(p0, &n0);
    }
    double num = 0, den = 0;
    bool ok = g && x && y && na == nb && (!base || (z && n0 == na));
    int64_t at = 0;
    for (int i = 0; ok && i < g->n_nodes; i++) {
        Tensor *t = &g->nodes[i]->t;
        if (g->nodes[i]->op != OP_PARAM) continue;
        int64_t bytes = ir_numel(t) * fmt_elem_bytes(t->fmt.elem);
        if (at + bytes > na) {
            ok = false;
            break;
        }
        Tensor ta = *t, tb = *t, t0 = *t;
        ta.data = x + at, tb.data = y + at, t0.data = z ? z + at : x + at;
        ta.fmt.scale = tb.fmt.scale = t0.fmt.scale = NULL;   /* the weights are bf16 or f32, unscaled */
        float *va = ref_load(&ta), *vb = ref_load(&tb), *v0 = ref_load(&t0);
        for (int64_t j = 0; j < ir_numel(t); j++) {
            double d = z ? (double)va[j] - v0[j] : va[j];
            num += ((double)vb[j] - va[j]) * ((double)vb[j] - va[j]);
            den += d * d;
        }
        free(va);
        free(vb);
        free(v0);
        at += bytes;
    }
    free(x);
    free(y);
    free(z);
    arena_free(arena);
    return ok && at == na && den > 0 ? sqrt(num / den) : -1;
}

static const char *const graph_names[] = {"gpt2_tiny_dp_O1", "gpt2_tiny_dp_serial_O1", "gpt2_tiny_dp_O0",
                                          "gpt2_tiny_dp_e5m2_O1", "gpt2_tiny_dp_e5m2_serial_O1",
                                          "gpt2_tiny_dp_e4m3_O0", "gpt2_tiny_zero_O1", "gpt2_tiny_zero_serial_O1",
                                          "gpt2_tiny_dp_O2", "gpt2_tiny_zero_O2", "gpt2_tiny_dp_O3",
                                          "gpt2_tiny_zero_O3", "gpt2_tiny_zero2_O1", "gpt2_tiny_zero2_O2",
                                          "gpt2_tiny_zero2_O3", "gpt2_tiny_zero3_O0", "gpt2_tiny_zero3_O1",
                                          "gpt2_tiny_zero3_O3", "gpt2_tiny_dp_passes_O3"};
enum { N_GRAPHS = sizeof graph_names / sizeof graph_names[0] };

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
        for (int i = 0; i < N_GRAPHS; i++) {
            Arena *arena = arena_new();
            Graph *g = load_graph(arena, graph_names[i]);
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

static void test_fp8_reduction(void **state) {
    (void)state;
    if (!two_gpus()) return;
    /* the kernels against the host reference, bit for bit: bf16 and f32 accumulators */
    assert_true(run_world_fp8("gpt2_tiny_dp_e5m2_O1", "fp8_e5m2"));
    assert_true(fp8_matches_reference("gpt2_tiny_dp_e5m2_O1", "fp8_e5m2"));
    assert_true(run_world_fp8("gpt2_tiny_dp_e4m3_O0", "fp8_e4m3"));
    assert_true(fp8_matches_reference("gpt2_tiny_dp_e4m3_O0", "fp8_e4m3"));
    /* training: the ranks stay equal; during the backward or after it, the same bits */
    assert_true(run_world("gpt2_tiny_dp_e5m2_O1", "e5m2_overlap", 2, 1));
    assert_true(same_file("e5m2_overlap.0", "e5m2_overlap.1"));
    assert_true(run_world("gpt2_tiny_dp_e5m2_serial_O1", "e5m2_serial", 2, 1));
    assert_true(same_file("e5m2_serial.0", "e5m2_serial.1"));
    assert_true(same_file("e5m2_overlap.0", "e5m2_serial.0"));
}

/* Whether every step of run DIR/NAME clipped: its gradient norms (rank 0's, NAME.0.norm;
 * same_runs compares every rank's) above CLIP_ACTIVE, and finite. */
static bool clipped_every_step(const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.0.norm", dir, name);
    int64_t n = 0;
    float *v = (float *)rt_read_file(path, &n);
    bool ok = v && n == STEPS * (int64_t)sizeof(float);
    for (int s = 0; ok && s < STEPS; s++) ok = isfinite(v[s]) && v[s] > CLIP_ACTIVE;
    printf("  %s: gradient norms", name);
    for (int s = 0; v && s < n / (int64_t)sizeof(float); s++) printf(" %.6g", (double)v[s]);
    printf(" (clipped to %g: %s)\n", CLIP_ACTIVE, ok ? "every step" : "NOT every step");
    free(v);
    return ok;
}

/* Runs DIR/A and DIR/B (two ranks each) ended with the same bytes: rank 0's persistent arena
 * (with sharded states gathered to it: weights, copies, masters, states with their side values,
 * scales, histories), every rank's gradient norms and losses, and, where each rank of B holds
 * the whole weights (`replicated`: not with sharded weights, where rank 1 holds its shard and
 * rank 0's gathered arena has them all), B's ranks the same weights. */
static bool same_runs(const char *a, const char *b, bool replicated) {
    static const char *const what[] = {"%s.0", "%s.0.norm", "%s.1.norm", "%s.0.loss", "%s.1.loss"};
    bool ok = true;
    for (size_t k = 0; k < sizeof what / sizeof *what; k++) {
        char x[96], y[96];
        snprintf(x, sizeof x, what[k], a);
        snprintf(y, sizeof y, what[k], b);
        ok = same_file(x, y) && ok;
    }
    if (!replicated) return ok;
    char x[96], y[96];
    snprintf(x, sizeof x, "%s.0.w", b);
    snprintf(y, sizeof y, "%s.1.w", b);
    return same_file(x, y) && ok;
}

/* For each of three levels: gpt2_tiny's unsharded data-parallel step (graph `dp`_LEVEL, run
 * `whole`_LEVEL) and the step of graph `graph`_LEVEL (run `sharded`_LEVEL) on two ranks,
 * clipping every step: the same bytes of every file they write (same_runs: rank 0's gathered
 * arena, every rank's norms and losses). */
static void sharded_equals_whole(const char *const dps[3], const char *graph, const char *whole, const char *sharded,
                                 const char *what, const char *const levels[3], bool replicated) {
    for (int k = 0; k < 3; k++) {
        char dp[64], zero[64], dp_name[32], zero_name[32];
        snprintf(dp, sizeof dp, "%s_%s", dps[k], levels[k]);
        snprintf(zero, sizeof zero, "%s_%s", graph, levels[k]);
        snprintf(dp_name, sizeof dp_name, "%s_%s", whole, levels[k]);
        snprintf(zero_name, sizeof zero_name, "%s_%s", sharded, levels[k]);
        printf("  %s: %s against the unsharded step, clipping every step\n", levels[k], what);
        assert_true(run_world(dp, dp_name, 2, 1));
        assert_true(run_world(zero, zero_name, 2, 1));
        assert_true(clipped_every_step(dp_name));
        assert_true(same_runs(dp_name, zero_name, replicated));
    }
}

/* --shard-states against the unsharded step, with clipping active (every step's coefficient
 * about 1e-3 / the norm, so that it matters in every weight: Adam's eps is then no longer
 * negligible beside the clipped gradient). The gradient norm is summed over fixed chunks that
 * the shards respect (cuda/exec_shard.c), so it is the unsharded norm bit for bit, and with it
 * the clip coefficient and every weight: rank 0's gathered arena, the ranks' norms and losses
 * must be the unsharded run's bytes, at -O1 (f32 masters, FP8 weight copies whose amaxes the
 * ranks agree on), -O2 (e4m3 states, groups of 128) and -O3 (companded states, split masters);
 * also with two micro-steps, and with the reductions after the backward. Each rank's device
 * arena is the plan's per-GPU size (run_rank). */
static void test_sharded_states(void **state) {
    (void)state;
    if (!two_gpus()) return;
    max_norm = CLIP_ACTIVE;
    static const char *const levels[] = {"O1", "O2", "O3"};
    static const char *const dps[] = {"gpt2_tiny_dp", "gpt2_tiny_dp", "gpt2_tiny_dp"};
    sharded_equals_whole(dps, "gpt2_tiny_zero", "whole", "shard", "sharded states", levels, true);
    /* two micro-steps a rank; the reductions after the backward */
    assert_true(run_world("gpt2_tiny_dp_O1", "whole_a2", 2, 2));
    assert_true(run_world("gpt2_tiny_zero_O1", "shard_a2", 2, 2));
    assert_true(same_runs("whole_a2", "shard_a2", true));
    assert_true(run_world("gpt2_tiny_zero_serial_O1", "shard_serial", 2, 1));
    assert_true(same_runs("shard_O1", "shard_serial", true));
    /* the model's own clipping (max_norm 1, active or not): the same bits */
    max_norm = CLIP_MODEL;
    assert_true(run_world("gpt2_tiny_dp_O1", "whole_clip", 2, 1));
    assert_true(run_world("gpt2_tiny_zero_O1", "shard_clip", 2, 1));
    assert_true(same_runs("whole_clip", "shard_clip", true));
}

/* --shard-states=2 (cuda/exec_grads.c): the accumulators sharded too, the backward writing
 * bucket buffers that are reduced into the owners' shards every micro-step. With one
 * micro-step on two ranks the sums are stage 1's (runtime/comm_grads.c), and the norm is the
 * unsharded norm, so with clipping active rank 0's gathered arena, the norms and the losses
 * must be the unsharded run's bytes at O1..O3. With two micro-steps the sums are another order
 * of the same additions (each micro-step's ranks, then the micro-steps, where one GPU's
 * accumulator takes its micro-steps and then the ranks): the ranks equal, and the weights
 * near the unsharded run's. Making the orders equal would need whole accumulators, which is
 * what stage 2 does away with. The bound is relative to the update (||w_b - w_a|| /
 * ||w_a - w_0||, w_0 the initial weights), as test_gpu_train.c bounds one update: 0.25.
 * Adam's step is about lr * sign(m) / (|m| / sqrt(v)), so an element whose summed gradient is
 * near zero can step either way under another rounding of its sum, and 4 steps move the
 * weights by a few lr only: relative to the weights the same difference is 10 to 100 times
 * smaller and says nothing (the first run on two H200s: 3.5e-3 of the weights, with clipping
 * off). A sum lost or counted twice moves the update by its own size (about 1). */
static void test_sharded_grads(void **state) {
    (void)state;
    if (!two_gpus()) return;
    max_norm = CLIP_ACTIVE;
    static const char *const levels[] = {"O1", "O2", "O3"};
    static const char *const dps[] = {"gpt2_tiny_dp", "gpt2_tiny_dp", "gpt2_tiny_dp"};
    sharded_equals_whole(dps, "gpt2_tiny_zero2", "whole2", "grads", "sharded gradients", levels, true);
    /* two micro-steps a rank: each reduced into the shards, another order of the sums */
    assert_true(run_world("gpt2_tiny_dp_O1", "whole2_a2", 2, 2));
    assert_true(run_world("gpt2_tiny_zero2_O1", "grads_a2", 2, 2));
    assert_true(same_file("grads_a2.0.w", "grads_a2.1.w"));
    assert_true(same_file("grads_a2.0.norm", "grads_a2.1.norm"));
    double err = weights_error("gpt2_tiny_dp_O1", "whole2_a2.0.w", "grads_a2.0.w", "whole2_a2.0.w0");
    double err_w = weights_error("gpt2_tiny_dp_O1", "whole2_a2.0.w", "grads_a2.0.w", NULL);
    printf("  O1, two micro-steps, clipping every step: sharded gradients against whole, the weights' "
           "difference %.3g of the update (%.3g of the weights)\n", err, err_w);
    assert_true(err >= 0 && err <= 0.25);
    max_norm = CLIP_MODEL;
}

/* --shard-states=3 (cuda/exec_gather.c): each rank keeps its shard of the weights the GEMMs
 * read (and of their FP8 copies) and gathers each layer into a layer buffer while the forward
 * and the backward run; the update writes the shards and broadcasts nothing of them. The
 * gathered bytes are the owners' bytes, and the norm is summed as in stage 1 and 2, so nothing
 * the step computes changes: with one micro-step and clipping active, rank 0's gathered arena
 * (weights, copies, masters, states, scales, histories), each rank's norms and losses (every
 * step's and the evaluation's, whose forward list gathers on its own) must be the unsharded
 * run's, at -O0 (bf16 gathers), -O1 (the update's e4m3 copies) and -O3 (the forward's e4m3
 * quantizes, each owner's shard quantized with the scale of the ranks' largest amax; the
 * backward's bf16). At -O3 the unsharded step compared is the one that finds each per-use
 * scale by a pass over the weight (scale.weight_amax=0), as stage 3 does: the amax the update
 * found (the default) is a persistent value a weight more in its arena, with the same bits of
 * every scale. Stage 3 sums the gradients as stage 2 does, so with two micro-steps it must end
 * with stage 2's bytes. */
static void test_sharded_weights(void **state) {
    (void)state;
    if (!two_gpus()) return;
    max_norm = CLIP_ACTIVE;
    static const char *const levels[] = {"O0", "O1", "O3"};
    static const char *const dps[] = {"gpt2_tiny_dp", "gpt2_tiny_dp", "gpt2_tiny_dp_passes"};
    sharded_equals_whole(dps, "gpt2_tiny_zero3", "whole3", "weights", "sharded weights", levels, false);
    /* two micro-steps a rank: stage 2's order of the sums, so stage 2's bytes */
    assert_true(run_world("gpt2_tiny_zero2_O1", "grads3_a2", 2, 2));
    assert_true(run_world("gpt2_tiny_zero3_O1", "weights_a2", 2, 2));
    assert_true(same_runs("grads3_a2", "weights_a2", false));
    max_norm = CLIP_MODEL;
}

int main(void) {
    setenv("FP8C_CUDA_TUNE", "0", 1);   /* the heuristic's first algorithm: runs comparable */
    /* FP8C_TEST_COMPILE_ONLY=1: compile the graphs' modules into the cache (no GPU needed), so
     * that a build carried to the GPU machine finds them there */
    const char *only = getenv("FP8C_TEST_COMPILE_ONLY");
    if (only && !strcmp(only, "1")) {
        for (int i = 0; i < N_GRAPHS; i++) {
            Arena *arena = arena_new();
            Graph *g = load_graph(arena, graph_names[i]);
            CudaBinary bin;
            bool skipped = false;
            char why[512] = "";
            if (!g || !cuda_compile_graph(g, &bin, &skipped, why, sizeof why) || skipped) {
                printf("test_gpu_comm: %s does not compile: %s\n", graph_names[i], why);
                return 1;
            }
            printf("test_gpu_comm: %s: %zu bytes of cubin%s\n", graph_names[i], bin.cubin_size,
                   bin.cached ? " (cached)" : "");
            cuda_binary_free(&bin);
            arena_free(arena);
        }
        return 0;
    }
    if (!mkdtemp(dir)) return 1;
    /* FP8C_TEST_FILTER=test_sharded_*: the sharded tests (multi_gpu_check.sh section 7) */
    const char *filter = getenv("FP8C_TEST_FILTER");
    if (filter && *filter) cmocka_set_test_filter(filter);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_two_ranks), cmocka_unit_test(test_fp8_reduction),
                                       cmocka_unit_test(test_sharded_states), cmocka_unit_test(test_sharded_grads),
                                       cmocka_unit_test(test_sharded_weights)};
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) rc = rc ? rc : 1;
    return rc;
}
