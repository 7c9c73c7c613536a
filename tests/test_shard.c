/* test_shard.c — sharded optimizer state (--shard-states) without GPUs: the arithmetic and the
 * host reference of the sharded step.
 *
 * - Shards (rt_shard_of): in rank order they cover every element once, start on multiples of
 *   the update's group, and no rank holds more than rank 0; the group of every level's updates
 *   is the gradient norm's chunk (4096 elements), a multiple of the codecs' (O2 128, O3 32).
 * - The norm does not depend on N: each rank's chunk sums of its shard at their places in a
 *   buffer of zeros, the buffers summed as the all-reduce sums them, then the chunks' sums in
 *   order, give one rank's bits, on 1 to 8 ranks (and in every update below); shards cut off
 *   the chunks (the codecs' groups alone) give other bits (the control).
 * - Why the groups matter (a control that must fail): a codec encoding two pieces cut inside
 *   a group stores other bytes than the whole tensor's; cut on a group boundary, the same.
 * - The sharded update: gpt2_tiny's update phase on the reference executor, once whole and once
 *   as N ranks each updating its shard (ref_update_shard, the copy's amax the ranks' maximum),
 *   from the same state with random gradients: every byte of both arenas equal, at O0..O3,
 *   for AdamW, Lion and SGD, on 2, 3 and 4 ranks. The sum of squares of every gradient the
 *   ranks take from their shards is the whole one bit for bit.
 * - Checkpoints keep whole tensors: two sharded steps on 2 ranks whose states live only in the
 *   ranks' shard buffers (scattered after each step, the whole storage wiped, gathered for the
 *   save), saved, loaded on 3 ranks and on one process, one more step each: the same bytes as
 *   three whole steps.
 * - The plan: GPT-2 d48 (1.56 B parameters) at -O3 on 4 GPUs keeps 4.81 bytes a parameter
 *   per GPU (7.25 on one: the bf16 weights and gradients whole, the rest in quarters), its
 *   per-GPU categories are the whole ones divided as the shards divide them, and the
 *   reduce-scatter sends (N-1)/N of the gradients; with --shard-states=2, 3.31 (the gradients
 *   in quarters too), plus the bucket buffers in the step arena.
 * - Stage 2 (--shard-states=2), the sums: a step's gradients summed as the ranks do it (each
 *   keeping only its shard of each accumulator; each micro-step a bucket buffer of zeros but
 *   for the rank's own range, which starts at its running sum, its backward's gradient added,
 *   then the owners' reduction, ref_reduce_to_owner) against the same sums written whole in
 *   the documented order (runtime/comm_grads.c), then the sharded update against the whole
 *   one: every byte equal, at O0..O3 on 2, 3 and 4 ranks with 1 and 2 micro-steps. One micro-
 *   step on two ranks is stage 1's sum bit for bit; two micro-steps are not (the control: the
 *   comparison sees another order).
 * - Stage 2, the buffers (rt_grad_slots): every bucket in a buffer that holds it, buckets that
 *   share one never live at once (one was sent before the other's first write), together
 *   smaller than the gradients (GPT-2 d12 at O0..O3).
 *
 * The seed is printed; FP8C_TEST_SEED=n repeats a run. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "compiler.h"
#include "rt.h"
#include "test_files.h"
#include "test_rng.h"
#include "test_state.h"

static unsigned seed;

static Graph *compile(Arena *a, const char *model, int level, const char *optim, int gpus,
                      int shard, int64_t batch, int64_t seq, const Define *defines, int n_defines)
{
    BuildOptions o = {0};
    o.front.batch = batch;
    o.front.seq = seq;
    o.front.defines = defines;
    o.front.n_defines = n_defines;
    o.passes.opt_level = level;
    o.passes.optimizer = optim;
    o.passes.gpus = gpus;
    o.passes.shard_states = shard;
    o.passes.verify = true;
    Graph *g = pipeline_compile(a, model, &o);
    assert_non_null(g);
    return g;
}

static Graph *tiny(Arena *a, int level, const char *optim, int gpus, int shard)
{
    return compile(a, FP8C_SOURCE_DIR "/models/gpt2_tiny.model", level, optim, gpus, shard, 2, 32, NULL, 0);
}

/* ---------------------------------------------------------------- arithmetic */

static void test_shard_ranges(void **state)
{
    (void)state;
    const int64_t sizes[] = {0, 1, 5, 31, 32, 33, 100, 128, 768, 1600, 4097, 38597376};
    const int64_t groups[] = {1, 32, 128};
    for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++)
        for (size_t b = 0; b < sizeof groups / sizeof *groups; b++)
            for (int ranks = 1; ranks <= 8; ranks++) {
                int64_t n = sizes[a], g = groups[b], at = 0, most = rt_shard_of(n, g, ranks, 0).len;
                for (int r = 0; r < ranks; r++) {
                    RtShard s = rt_shard_of(n, g, ranks, r);
                    assert_int_equal(s.off, at);
                    assert_true(s.len >= 0 && s.len <= most);
                    assert_true(s.off % g == 0 || s.len == 0);
                    at += s.len;
                }
                assert_int_equal(at, n);
                /* balanced: rank 0 holds at most one group more than an even share */
                assert_true(most <= (n + ranks - 1) / ranks + g - 1);
            }
}

static void test_groups_of_each_level(void **state)
{
    (void)state;
    /* the norm's chunk (4096), of which the codecs' groups (O2 128, O3 32) are divisors */
    const int64_t want[4] = {IR_SQNORM_CHUNK, IR_SQNORM_CHUNK, IR_SQNORM_CHUNK, IR_SQNORM_CHUNK};
    for (int level = 0; level <= 3; level++) {
        Arena *a = arena_new();
        Graph *g = tiny(a, level, "adamw", 2, true);
        assert_true(rt_shard_states(g));
        int updates = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            Node *n = g->nodes[i];
            if (n->op == OP_ALL_REDUCE) assert_int_equal(IR_IATTR(n, ALL_REDUCE, shard), 1);
            if (!ir_op_is_update(n->op)) continue;
            updates++;
            int64_t numel = ir_numel(&n->in[0]->t), g_want = want[level] < numel ? want[level] : numel;
            if (rt_shard_group(n) != g_want)
                fail_msg("-O%d %s: group %lld, want %lld", level, n->in[0]->t.name,
                         (long long)rt_shard_group(n), (long long)g_want);
        }
        assert_true(updates > 0);
        Graph *plain = tiny(a, level, "adamw", 2, false);
        assert_false(rt_shard_states(plain));
        arena_free(a);
    }
}

/* A codec's groups are of consecutive elements from the tensor's start: encoding pieces cut on
 * a group boundary stores the whole tensor's bytes, cut inside a group it does not. */
static void test_cuts_inside_a_group_differ(void **state)
{
    (void)state;
    const Codec codecs[] = {CODEC_EXPAND, CODEC_COMPAND, CODEC_SQRT};
    enum { N = 512 };
    rng_state = seed;
    for (size_t c = 0; c < sizeof codecs / sizeof *codecs; c++) {
        Codec k = codecs[c];
        int64_t G = codec_group_size(k);
        float x[N];
        for (int i = 0; i < N; i++) {
            float v = (float)(rng_normal() * pow(10, (int)(i / G) % 5 - 2));
            x[i] = k == CODEC_SQRT ? v * v : v;
        }
        uint8_t whole[N], parts[N];
        float pw[N], pp[N];
        codec_encode(k, x, whole, pw, N);
        for (int cut_inside = 0; cut_inside < 2; cut_inside++) {
            int64_t cut = 2 * G + (cut_inside ? G / 2 : 0);
            memset(parts, 0, sizeof parts);
            memset(pp, 0, sizeof pp);
            float p2[N];
            codec_encode(k, x, parts, pp, cut);
            codec_encode(k, x + cut, parts + cut, p2, N - cut);
            bool same = !memcmp(whole, parts, N) &&
                        !memcmp(pw, pp, sizeof(float) * (size_t)codec_param_count(k, cut));
            if (!cut_inside) {
                same = same && !memcmp(pw + codec_param_count(k, cut), p2,
                                       sizeof(float) * (size_t)codec_param_count(k, N - cut));
                if (!same) fail_msg("%s: pieces cut on a group boundary stored other bytes", fmt_codec_name(k));
            } else if (same) {
                fail_msg("%s: pieces cut inside a group stored the whole tensor's bytes: the "
                         "comparison could not see a misplaced shard", fmt_codec_name(k));
            }
        }
    }
}

/* ---------------------------------------------------------------- the sharded update */

static void set_scalar(Graph *g, const char *name, float v)
{
    Node *n = ir_find(g, name);
    assert_non_null(n);
    ref_store(&n->t, &v);
}

/* Every gradient accumulator filled with fresh random values (about the size of real ones). */
static void random_grads(Graph *g)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->t.role != ROLE_GRAD || n->n_in || !n->t.data) continue;
        int64_t count = ir_numel(&n->t);
        float *x = malloc(sizeof(float) * (size_t)count);
        for (int64_t k = 0; k < count; k++) x[k] = (float)(0.02 * rng_normal());
        ref_store(&n->t, x);
        free(x);
    }
}

/* The update whose gradient operand is (an all_reduce of) accumulator-reading node x. */
static Node *update_of_grad(Graph *g, const Node *x)
{
    for (int i = 0; i < g->n_nodes; i++)
        if (ir_op_is_update(g->nodes[i]->op) && g->nodes[i]->in[1] == x) return g->nodes[i];
    return NULL;
}

/* The sum of squares of x[0 .. n) as `ranks` ranks take it with --shard-states
 * (cuda/exec_shard.c): each rank's chunk sums of its shard (ref_sqnorm_chunks, from the
 * shard's start) at their places in a buffer of zeros, the ranks' buffers added (what the
 * all-reduce does; in rank order, or the reverse), then the chunks' sums in order. With
 * boundaries on chunks this is the whole tensor's computation; off them (the control) a
 * shard's chunks are not the tensor's. */
static float sharded_sqnorm(const float *x, int64_t n, int64_t group, int ranks, bool reverse, double *f64)
{
    int64_t chunks = (n + IR_SQNORM_CHUNK - 1) / IR_SQNORM_CHUNK + ranks;   /* room for the control's */
    double *sum = calloc((size_t)chunks, sizeof(double)), *mine = calloc((size_t)chunks, sizeof(double));
    assert_true(sum && mine);
    for (int k = 0; k < ranks; k++) {
        int r = reverse ? ranks - 1 - k : k;
        RtShard s = rt_shard_of(n, group, ranks, r);
        memset(mine, 0, sizeof(double) * (size_t)chunks);
        int64_t first = (s.off + IR_SQNORM_CHUNK - 1) / IR_SQNORM_CHUNK;   /* off a chunk: the next place */
        if (s.len) ref_sqnorm_chunks(x + s.off, s.len, mine + first);
        for (int64_t c = 0; c < chunks; c++) sum[c] += mine[c];
    }
    float y = ref_sqnorm_sum(sum, chunks);
    *f64 = 0;   /* the sum before its rounding to f32, which hides most differences of order */
    for (int64_t c = 0; c < chunks; c++) *f64 += sum[c];
    free(sum);
    free(mine);
    return y;
}

/* The update phase as `ranks` ranks run it: each update in shards, the copy's amax the
 * maximum of the ranks', the other nodes (scales) as before. Each norm's sum of squares as
 * the ranks take it must be the whole one bit for bit (the clip coefficient then is too). */
static void run_update_sharded(Graph *g, int ranks)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->phase != PHASE_UPDATE) continue;
        if (n->op == OP_SQNORM) {
            ref_exec_node(n);
            Node *u = update_of_grad(g, n->in[0]);
            if (!u) continue;
            float *x = ref_load(&n->in[0]->t), *whole = ref_load(&n->t);
            int64_t count = ir_numel(&n->in[0]->t), group = rt_shard_group(u);
            for (int reverse = 0; reverse < 2; reverse++) {
                double f64;
                float y = sharded_sqnorm(x, count, group, ranks, reverse, &f64);
                if (memcmp(&y, whole, sizeof y))
                    fail_msg("%s on %d ranks: the ranks' sum of squares %.9g, the whole one %.9g",
                             u->in[0]->t.name, ranks, (double)y, (double)whole[0]);
            }
            free(x);
            free(whole);
            continue;
        }
        if (!ir_op_is_update(n->op)) {
            ref_exec_node(n);
            continue;
        }
        int64_t count = ir_numel(&n->in[0]->t), group = rt_shard_group(n);
        float amax = 0;
        for (int r = 0; r < ranks; r++) {
            RtShard s = rt_shard_of(count, group, ranks, r);
            float a = 0;
            if (s.len) ref_update_shard(n, s.off, s.len, &a);
            amax = fmaxf(amax, a);
        }
        int at = ir_update_amax_index(n);
        if (at >= 0) ref_store(&n->in[at]->t, &amax);
    }
}

typedef struct {
    RtMemory mem;
    void *p0, *s0;      /* a snapshot of both arenas */
} Snap;

static void snap_take(Snap *s)
{
    s->p0 = malloc((size_t)s->mem.persistent_bytes);
    s->s0 = malloc((size_t)(s->mem.step_bytes ? s->mem.step_bytes : 1));
    memcpy(s->p0, s->mem.persistent, (size_t)s->mem.persistent_bytes);
    memcpy(s->s0, s->mem.step, (size_t)s->mem.step_bytes);
}

static void snap_restore(Snap *s)
{
    memcpy(s->mem.persistent, s->p0, (size_t)s->mem.persistent_bytes);
    memcpy(s->mem.step, s->s0, (size_t)s->mem.step_bytes);
}

/* One step's update: whole, then sharded over `ranks` from the same state; both arenas equal. */
static void check_update(int level, const char *optim, int ranks)
{
    Arena *a = arena_new();
    Graph *g = tiny(a, level, optim, ranks, true);
    Snap s = {0};
    assert_true(rt_memory_bind(g, &s.mem));
    rt_init_params(g, seed);
    rng_state = seed + (unsigned)(17 * level + ranks);
    set_scalar(g, "lr", 3e-3f);
    set_scalar(g, "grad_scale", 0.5f);
    /* a first whole step, so that the states and copies hold something */
    set_scalar(g, "step", 1);
    random_grads(g);
    ref_run_phase(g, PHASE_UPDATE);
    set_scalar(g, "step", 2);
    random_grads(g);
    snap_take(&s);
    ref_run_phase(g, PHASE_UPDATE);
    uint8_t *pw = malloc((size_t)s.mem.persistent_bytes), *sw = malloc((size_t)(s.mem.step_bytes + 1));
    memcpy(pw, s.mem.persistent, (size_t)s.mem.persistent_bytes);
    memcpy(sw, s.mem.step, (size_t)s.mem.step_bytes);
    snap_restore(&s);
    run_update_sharded(g, ranks);
    const char *bad = state_where_differs(g, pw, s.mem.persistent, s.mem.persistent_bytes);
    if (bad) fail_msg("-O%d %s on %d ranks: %s differs from the whole update", level, optim, ranks, bad);
    if (memcmp(sw, s.mem.step, (size_t)s.mem.step_bytes))
        fail_msg("-O%d %s on %d ranks: the step arena differs from the whole update's", level, optim, ranks);
    free(pw);
    free(sw);
    free(s.p0);
    free(s.s0);
    rt_memory_free(&s.mem);
    arena_free(a);
}

/* The norm does not depend on the number of ranks, for sizes around the chunk and large
 * ones, on 1 to 8 ranks, with values over 24 binades (so that another order of the additions
 * shows): shards on the chunks (what rt_shard_group gives every update) sum to the whole
 * tensor's bits, in f32 and already in f64 before that rounding. The control: shards on the codecs' groups alone (1, 32, 128: the rule before
 * the norm's chunk joined it) give other f64 bits somewhere (the f32 rounding hides most). */
static void test_norm_independent_of_ranks(void **state)
{
    (void)state;
    const int64_t sizes[] = {1, 4095, 4096, 4097, 3 * 4096 + 5, 100003, (1 << 20) + 7};
    rng_state = seed + 91;
    int split = 0, control_differs = 0;
    for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++) {
        int64_t n = sizes[a];
        float *x = malloc(sizeof(float) * (size_t)n);
        assert_non_null(x);
        for (int64_t i = 0; i < n; i++) x[i] = (float)(rng_normal() * ldexp(1.0, (int)rng_int(-12, 12)));
        int64_t chunks = (n + IR_SQNORM_CHUNK - 1) / IR_SQNORM_CHUNK;
        double *parts = calloc((size_t)chunks, sizeof(double)), whole64 = 0;
        ref_sqnorm_chunks(x, n, parts);
        float whole = ref_sqnorm_sum(parts, chunks);
        for (int64_t c = 0; c < chunks; c++) whole64 += parts[c];
        free(parts);
        for (int ranks = 1; ranks <= 8; ranks++) {
            int64_t group = IR_SQNORM_CHUNK < n ? IR_SQNORM_CHUNK : n;
            split += rt_shard_of(n, group, ranks, 1 % ranks).len > 0 && ranks > 1;
            for (int reverse = 0; reverse < 2; reverse++) {
                double y64;
                float y = sharded_sqnorm(x, n, group, ranks, reverse, &y64);
                if (memcmp(&y, &whole, sizeof y) || memcmp(&y64, &whole64, sizeof y64))
                    fail_msg("%lld elements on %d ranks: %.9g, one rank %.9g", (long long)n, ranks, (double)y,
                             (double)whole);
            }
            const int64_t old_groups[] = {1, 32, 128};
            for (int k = 0; k < 3 && ranks > 1; k++) {
                double y64;
                sharded_sqnorm(x, n, old_groups[k], ranks, false, &y64);
                control_differs += memcmp(&y64, &whole64, sizeof y64) != 0;
            }
        }
        free(x);
    }
    printf("the norm on 1..8 ranks: one rank's bits (%d cases split); shards off the chunks: %d cases differ\n",
           split, control_differs);
    assert_true(split > 20);
    assert_true(control_differs > 0);
}

static void test_sharded_update_is_the_whole_update(void **state)
{
    (void)state;
    const char *optims[] = {"adamw", "lion", "sgd"};
    for (int level = 0; level <= 3; level++)
        for (int o = 0; o < 3; o++)
            for (int ranks = 2; ranks <= 4; ranks++) check_update(level, optims[o], ranks);
}

/* ---------------------------------------------------------------- checkpoints */

/* The persistent tensors a checkpoint holds (train.c's list: storage of their own, once). */
static int saved_tensors(Graph *g, Tensor **ts)
{
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *x = g->nodes[i];
        if (!ir_role_is_persistent(x->t.role) || !rt_has_storage(x)) continue;
        bool view = false;
        for (int k = 0; k < n; k++) view |= x->t.offset >= 0 && ts[k]->offset == x->t.offset;
        if (view) continue;
        if (!x->t.name) x->t.name = arena_printf(g->arena, "node.%d", x->id);
        ts[n++] = &x->t;
    }
    return n;
}

/* The sharded tensors of each update (gradient accumulator, states, master), as the ranks
 * keep them: scattered into `ranks` buffers, the whole storage wiped, gathered back. What a
 * rank does not own is lost in between, so anything the step read outside a rank's shard
 * would show. */
static void through_rank_buffers(Graph *g, int ranks)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *u = g->nodes[i];
        if (!ir_op_is_update(u->op)) continue;
        Tensor *ts[6];
        int k = 0;
        const Node *acc = u->in[1];
        while (acc->op == OP_ALL_REDUCE || acc->op == OP_ACCUMULATE) acc = acc->in[0];
        ts[k++] = (Tensor *)&acc->t;
        for (int j = 2; j < ir_update_lr_index(u); j++) ts[k++] = &u->in[j]->t;
        if (ir_adamw_master_index(u) >= 0) ts[k++] = &u->in[ir_adamw_master_index(u)]->t;
        int64_t count = ir_numel(&u->in[0]->t), group = rt_shard_group(u);
        for (int j = 0; j < k; j++) {
            Tensor *t = ts[j];
            bool coded = t->fmt.codec != CODEC_PLAIN && t->fmt.codec != CODEC_SPLIT;
            float *params = coded ? t->fmt.scale->t.data : NULL;
            void *part[8];
            float *part_params[8];
            for (int r = 0; r < ranks; r++) {
                RtShard s = rt_shard_of(count, group, ranks, r);
                part[r] = malloc((size_t)rt_shard_bytes(t, s.len) + 1);
                part_params[r] = coded ? malloc(sizeof(float) * (size_t)(codec_param_count(t->fmt.codec, s.len) + 1)) : NULL;
                rt_shard_copy(t, s, t->data, params, part[r], part_params[r], false);
            }
            memset(t->data, 0xA5, (size_t)(count * fmt_elem_bytes(t->fmt.elem)));
            if (coded) memset(params, 0xA5, sizeof(float) * (size_t)codec_param_count(t->fmt.codec, count));
            for (int r = 0; r < ranks; r++) {
                rt_shard_copy(t, rt_shard_of(count, group, ranks, r), t->data, params, part[r],
                              part_params[r], true);
                free(part[r]);
                free(part_params[r]);
            }
        }
    }
}

typedef struct {
    Arena *a;
    Graph *g;
    RtMemory mem;
} Run;

static void run_open(Run *r, int level, int ranks)
{
    r->a = arena_new();
    r->g = tiny(r->a, level, "adamw", ranks, ranks > 1);
    assert_true(rt_memory_bind(r->g, &r->mem));
    rt_init_params(r->g, seed);
    set_scalar(r->g, "lr", 3e-3f);
    set_scalar(r->g, "grad_scale", 0.5f);
}

static void run_close(Run *r)
{
    rt_memory_free(&r->mem);
    arena_free(r->a);
}

/* Step `step` with the gradients of rng(seed, step), on `ranks` ranks (1: whole). */
static void run_step(Run *r, int step, int ranks)
{
    rng_state = seed * 31u + (unsigned)step;
    set_scalar(r->g, "step", (float)step);
    random_grads(r->g);
    if (ranks > 1) {
        through_rank_buffers(r->g, ranks);
        run_update_sharded(r->g, ranks);
        through_rank_buffers(r->g, ranks);
    } else {
        ref_run_phase(r->g, PHASE_UPDATE);
    }
}

static void save(Run *r, const char *path)
{
    Tensor *ts[4096];
    int n = saved_tensors(r->g, ts);
    assert_true(rt_ckpt_save(path, ts, n, NULL, 0));
}

static void load(Run *r, const char *path)
{
    Tensor *ts[4096];
    int n = saved_tensors(r->g, ts), n_meta = 0;
    CkptMeta meta[8];
    if (!rt_ckpt_load(path, ts, n, meta, 8, &n_meta)) fail_msg("load %s: %s", path, rt_last_error());
}

static void test_checkpoint_reshards(void **state)
{
    (void)state;
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/fp8c-test-shard-XXXXXX");
    assert_non_null(mkdtemp(tmp_dir));
    for (int level = 0; level <= 3; level += 3) {
        /* three whole steps, the reference */
        Run whole;
        run_open(&whole, level, 1);
        for (int step = 1; step <= 3; step++) run_step(&whole, step, 1);
        /* two steps on 2 ranks, saved */
        char path[600];
        snprintf(path, sizeof path, "%s/two-ranks-O%d.safetensors", tmp_dir, level);
        Run two;
        run_open(&two, level, 2);
        for (int step = 1; step <= 2; step++) run_step(&two, step, 2);
        save(&two, path);
        run_close(&two);
        /* resumed on 3 ranks, and on one process built without --gpus */
        const int resume[2] = {3, 1};
        for (int k = 0; k < 2; k++) {
            Run r;
            run_open(&r, level, resume[k]);
            load(&r, path);
            run_step(&r, 3, resume[k]);
            assert_int_equal(r.mem.persistent_bytes, whole.mem.persistent_bytes);
            const char *bad = state_where_differs(r.g, whole.mem.persistent, r.mem.persistent, r.mem.persistent_bytes);
            if (bad)
                fail_msg("-O%d: saved on 2 ranks, resumed on %d: %s differs from three whole steps",
                         level, resume[k], bad);
            run_close(&r);
        }
        run_close(&whole);
    }
    remove_tree(tmp_dir);
}

/* ---------------------------------------------------------------- the plan */

static void test_plan_of_d48_on_four_gpus(void **state)
{
    (void)state;
    static const Define d48[] = {{"layers", "48"}, {"dim", "1600"}, {"heads", "25"}};
    Arena *a = arena_new();
    Graph *g = compile(a, FP8C_SOURCE_DIR "/models/gpt2.model", 3, NULL, 4, true, 8, 1024, d48, 3);
    MemSummary m;
    memplan_summarize(g, &m);
    RtShardPlan sp;
    rt_shard_plan(g, m.by_role, 4, &sp);
    assert_true(sp.on);
    double one = (double)m.persistent / (double)m.n_params;
    double per_gpu = (double)(m.persistent - sp.saved) / (double)m.n_params;
    printf("GPT-2 d48 -O3: %lld parameters, %.3f bytes a parameter on one GPU, %.3f per GPU of 4\n",
           (long long)m.n_params, one, per_gpu);
    assert_true(fabs(one - 7.25) < 0.01);
    /* stage 1: the weights and gradients whole, the masters and states in quarters (up to the
     * groups' rounding). Issue 22's 3.5 needs the gradients in quarters too (stage 2). */
    assert_int_equal(sp.per_gpu[ROLE_PARAM], m.by_role[ROLE_PARAM]);
    assert_int_equal(sp.per_gpu[ROLE_GRAD], m.by_role[ROLE_GRAD]);
    /* rank 0 holds at most a norm chunk (4096 elements) more than a quarter of each tensor */
    double slack = (double)sp.updates * IR_SQNORM_CHUNK / (double)m.n_params;
    const Role quartered[] = {ROLE_MASTER, ROLE_ADAM_M, ROLE_ADAM_V};
    for (size_t k = 0; k < sizeof quartered / sizeof *quartered; k++) {
        double q = (double)sp.per_gpu[quartered[k]] / (double)m.by_role[quartered[k]];
        if (q < 0.25 || q > 0.25 + slack)
            fail_msg("%s: %.5f of one GPU's on each of 4 (at most %.5f)", ir_role_name(quartered[k]), q, 0.25 + slack);
    }
    assert_true(fabs(per_gpu - (2 + 2 + (7.25 - 4) / 4)) < 0.01);
    /* the reduce-scatter and the weights' all-gather each send 3/4 of the bf16 bytes */
    assert_int_equal(sp.sent_reduce_scatter, m.by_role[ROLE_GRAD] * 3 / 4);
    assert_int_equal(sp.sent_gather_weights, m.by_role[ROLE_PARAM] * 3 / 4);
    assert_int_equal(sp.copy_bytes, 0);   /* O3 keeps no FP8 copies */
    /* stage 2: the gradients in quarters as well, issue 22's <= 3.5 bytes a parameter, and
     * the backward's bucket buffers in the step arena, a few buckets' worth */
    Graph *two = compile(a, FP8C_SOURCE_DIR "/models/gpt2.model", 3, NULL, 4, 2, 8, 1024, d48, 3);
    memplan_summarize(two, &m);
    rt_shard_plan(two, m.by_role, 4, &sp);
    assert_true(sp.on && sp.stage == 2);
    double q = (double)sp.per_gpu[ROLE_GRAD] / (double)m.by_role[ROLE_GRAD];
    if (q < 0.25 || q > 0.25 + slack) fail_msg("stage 2: gradients %.5f of one GPU's on each of 4", q);
    assert_int_equal(sp.per_gpu[ROLE_PARAM], m.by_role[ROLE_PARAM]);
    double stage2 = (double)(m.persistent - sp.saved) / (double)m.n_params;
    printf("stage 2: %.3f bytes a parameter per GPU of 4, %.1f MiB of gradient buffers (%.1f%% of the "
           "gradients)\n", stage2, (double)sp.grad_buffer_bytes / (1 << 20),
           100.0 * (double)sp.grad_buffer_bytes / (double)m.by_role[ROLE_GRAD]);
    assert_true(stage2 <= 3.5);
    assert_true(fabs(stage2 - (2 + (7.25 - 2) / 4)) < 0.01);
    assert_true(sp.grad_buffer_bytes > 0 && sp.grad_buffer_bytes < m.by_role[ROLE_GRAD] / 8);
    assert_int_equal(sp.sent_reduce_scatter, m.by_role[ROLE_GRAD] * 3 / 4);
    /* without the flag each GPU keeps everything */
    Graph *plain = compile(a, FP8C_SOURCE_DIR "/models/gpt2.model", 3, NULL, 4, false, 8, 1024, d48, 3);
    memplan_summarize(plain, &m);
    rt_shard_plan(plain, m.by_role, 4, &sp);
    assert_false(sp.on);
    assert_int_equal(sp.saved, 0);
    arena_free(a);
}

/* ---------------------------------------------------------------- stage 2: the sums */

/* x rounded to an accumulator's element type (bf16 round to nearest even, or f32) */
static float acc_round(ElemType e, float x)
{
    return e == FMT_BF16 ? num_bf16_to_f32(num_f32_to_bf16(x)) : x;
}

/* The accumulator (its STATE node) an update reads through its all_reduce. */
static Tensor *accumulator_of(Node *u)
{
    Node *acc = u->in[1];
    while (acc->op == OP_ALL_REDUCE || acc->op == OP_ACCUMULATE) acc = acc->in[0];
    return &acc->t;
}

/* Rank r's gradient of micro-step m for update number k, as the backward rounds it into an
 * accumulator (fresh random values each (step, k, r, m)). */
static float *rank_grad(const Tensor *acc, unsigned step, int k, int r, int m)
{
    int64_t n = ir_numel(acc);
    float *x = malloc(sizeof(float) * (size_t)n);
    rng_state = seed * 131u + step * 7919u + (unsigned)k * 104729u + (unsigned)r * 31u + (unsigned)m;
    for (int64_t i = 0; i < n; i++) x[i] = acc_round(acc->fmt.elem, (float)(0.02 * rng_normal()));
    return x;
}

/* A micro-step's sums, whole, in comm_grads.c's order, written out element by element: the
 * owner q of element i (its update's shard) adds its own gradient to the running sum, then
 * the other ranks' in rank order after q, each addition rounded. Or (stage1) stage 1's order:
 * each rank's micro-steps summed in its own accumulator first, then the ranks in rank order
 * (K = 1: one sum over the ranks). Returns the whole accumulators' new values in place. */
static void sums_whole(Graph *g, int ranks, int K, unsigned step, bool stage1)
{
    int k = 0;
    for (int i = 0; i < g->n_nodes; i++, k += ir_op_is_update(g->nodes[i - 1]->op)) {
        Node *u = g->nodes[i];
        if (!ir_op_is_update(u->op)) continue;
        Tensor *acc = accumulator_of(u);
        ElemType e = acc->fmt.elem;
        int64_t n = ir_numel(acc), group = rt_shard_group(u);
        float *a = calloc((size_t)n, sizeof(float));
        float **own = calloc((size_t)ranks, sizeof *own);   /* stage 1: each rank's accumulator */
        for (int r = 0; r < ranks; r++) own[r] = calloc((size_t)n, sizeof(float));
        for (int m = 0; m < K; m++) {
            float **gr = malloc(sizeof *gr * (size_t)ranks);
            for (int r = 0; r < ranks; r++) gr[r] = rank_grad(acc, step, k, r, m);
            for (int q = 0; q < ranks; q++) {
                RtShard s = rt_shard_of(n, group, ranks, q);
                for (int64_t x = s.off; x < s.off + s.len; x++) {
                    if (stage1) {
                        for (int r = 0; r < ranks; r++) own[r][x] = acc_round(e, own[r][x] + gr[r][x]);
                        continue;
                    }
                    float v = acc_round(e, a[x] + gr[q][x]);
                    for (int j = 1; j < ranks; j++) v = acc_round(e, v + gr[(q + j) % ranks][x]);
                    a[x] = v;
                }
            }
            for (int r = 0; r < ranks; r++) free(gr[r]);
            free(gr);
        }
        if (stage1)
            for (int64_t x = 0; x < n; x++) {
                float v = own[0][x];
                for (int r = 1; r < ranks; r++) v = acc_round(e, v + own[r][x]);
                a[x] = v;
            }
        ref_store(acc, a);
        for (int r = 0; r < ranks; r++) free(own[r]);
        free(own);
        free(a);
    }
}

/* The same sums as the ranks of a stage-2 step make them (cuda/exec_grads.c's data flow):
 * each rank keeps only its shard of each accumulator, in a buffer of its own; each micro-step
 * each rank's bucket buffer starts at zero except its own shard's range, which starts at its
 * running sum; its backward adds its gradient (rounded, as an accumulation rounds); then each
 * owner's shard is the reduction of the ranks' buffers over that range (ref_reduce_to_owner).
 * The whole accumulator is garbage meanwhile and is put together from the shards at the end. */
static void sums_sharded(Graph *g, int ranks, int K, unsigned step)
{
    int k = 0;
    for (int i = 0; i < g->n_nodes; i++, k += ir_op_is_update(g->nodes[i - 1]->op)) {
        Node *u = g->nodes[i];
        if (!ir_op_is_update(u->op)) continue;
        Tensor *acc = accumulator_of(u);
        int64_t n = ir_numel(acc), group = rt_shard_group(u), eb = fmt_elem_bytes(acc->fmt.elem);
        void *mine[8], *slot[8];
        for (int r = 0; r < ranks; r++) {
            RtShard s = rt_shard_of(n, group, ranks, r);
            mine[r] = calloc((size_t)(s.len + 1), (size_t)eb);   /* zeroed after the last update */
            slot[r] = malloc((size_t)(n * eb));
        }
        memset(acc->data, 0xA5, (size_t)(n * eb));
        for (int m = 0; m < K; m++) {
            for (int r = 0; r < ranks; r++) {
                RtShard s = rt_shard_of(n, group, ranks, r);
                memset(slot[r], 0, (size_t)(n * eb));
                memcpy((char *)slot[r] + s.off * eb, mine[r], (size_t)(s.len * eb));
                Tensor t = *acc;
                t.data = slot[r];
                float *x = ref_load(&t), *d = rank_grad(acc, step, k, r, m);
                for (int64_t j = 0; j < n; j++) x[j] += d[j];
                ref_store(&t, x);
                free(x);
                free(d);
            }
            for (int q = 0; q < ranks; q++)
                ref_reduce_to_owner(acc, rt_shard_of(n, group, ranks, q), q, ranks, slot, mine[q]);
        }
        for (int r = 0; r < ranks; r++) {
            RtShard s = rt_shard_of(n, group, ranks, r);
            memcpy((char *)acc->data + s.off * eb, mine[r], (size_t)(s.len * eb));
            free(mine[r]);
            free(slot[r]);
        }
    }
}

/* One stage-2 step from the same state: whole (the documented order, then the whole update)
 * against sharded (the ranks' data flow, then each rank's shard of the update); every byte of
 * both arenas equal. With K = 1 on two ranks the sums are also stage 1's, bit for bit; with
 * K = 2 they are not (the control: another order gives other bytes somewhere). */
static void check_stage2(int level, const char *optim, int ranks, int K)
{
    Arena *a = arena_new();
    Graph *g = tiny(a, level, optim, ranks, 2);
    assert_int_equal(rt_shard_stage(g), 2);
    Snap s = {0};
    assert_true(rt_memory_bind(g, &s.mem));
    rt_init_params(g, seed);
    set_scalar(g, "lr", 3e-3f);
    set_scalar(g, "grad_scale", 1.0f / (float)(ranks * K));
    set_scalar(g, "step", 1);   /* a first whole step, so that the states hold something */
    sums_whole(g, ranks, K, 1, false);
    ref_run_phase(g, PHASE_UPDATE);
    set_scalar(g, "step", 2);
    snap_take(&s);
    sums_whole(g, ranks, K, 2, false);
    int64_t pb = s.mem.persistent_bytes;
    uint8_t *grads = malloc((size_t)pb), *pw = malloc((size_t)pb), *sw = malloc((size_t)(s.mem.step_bytes + 1));
    memcpy(grads, s.mem.persistent, (size_t)pb);
    ref_run_phase(g, PHASE_UPDATE);
    memcpy(pw, s.mem.persistent, (size_t)pb);
    memcpy(sw, s.mem.step, (size_t)s.mem.step_bytes);
    /* stage 1's order from the same state */
    snap_restore(&s);
    sums_whole(g, ranks, K, 2, true);
    const char *other = state_where_differs(g, grads, s.mem.persistent, pb);
    if (K == 1 && ranks == 2 && other)
        fail_msg("-O%d on 2 ranks: the stage-2 sum of %s differs from stage 1's", level, other);
    if (K > 1 && !other)
        fail_msg("-O%d on %d ranks, %d micro-steps: stage 1's order gave the same bytes: the "
                 "comparison could not see a wrong order", level, ranks, K);
    /* the ranks' way */
    snap_restore(&s);
    sums_sharded(g, ranks, K, 2);
    const char *bad = state_where_differs(g, grads, s.mem.persistent, pb);
    if (bad) fail_msg("-O%d %s on %d ranks, %d micro-steps: the sharded sum of %s differs", level, optim, ranks, K, bad);
    through_rank_buffers(g, ranks);
    run_update_sharded(g, ranks);
    through_rank_buffers(g, ranks);
    bad = state_where_differs(g, pw, s.mem.persistent, pb);
    if (bad) fail_msg("-O%d %s on %d ranks, %d micro-steps: %s differs from the whole step", level, optim, ranks, K, bad);
    if (memcmp(sw, s.mem.step, (size_t)s.mem.step_bytes))
        fail_msg("-O%d %s on %d ranks: the step arena differs from the whole step's", level, optim, ranks);
    free(grads);
    free(pw);
    free(sw);
    free(s.p0);
    free(s.s0);
    rt_memory_free(&s.mem);
    arena_free(a);
}

static void test_stage2_step_is_the_whole_step(void **state)
{
    (void)state;
    /* the sums do not depend on the optimizer, whose sharded update is checked above with
     * every optimizer: AdamW everywhere, Lion and SGD on 3 ranks with 2 micro-steps */
    const char *optims[] = {"adamw", "lion", "sgd"};
    for (int level = 0; level <= 3; level++)
        for (int o = 0; o < 3; o++)
            for (int ranks = 2; ranks <= 4; ranks++)
                for (int K = 1; K <= 2; K++)
                    if (!o || (ranks == 3 && K == 2)) check_stage2(level, optims[o], ranks, K);
}

/* ---------------------------------------------------------------- stage 2: the buffers */

/* The bucket buffers of --shard-states=2 (rt_grad_slots): every bucket has one that holds it,
 * a buffer passes from one bucket to the next only once the first was sent before the next's
 * first write, and together they are smaller than the gradients. */
static void check_slots(Graph *g, const char *what)
{
    RtCommPlan cp;
    assert_true(rt_comm_plan(g, &cp));
    int n = cp.n_buckets;
    int *open = malloc(sizeof *open * (size_t)n), *sent = malloc(sizeof *sent * (size_t)n);
    rt_grad_bucket_span(g, &cp, open, sent);
    RtGradSlots s;
    assert_true(rt_grad_slots(&cp, open, sent, &s));
    for (int b = 0; b < n; b++) {
        const RtBucket *k = &cp.buckets[b];
        assert_true(open[b] <= sent[b]);
        assert_true(s.slot[b] >= 0 && s.slot[b] < s.n_slots);
        int64_t end = 0;
        for (int i = k->first; i < k->first + k->count; i++) {
            assert_true(s.at[i] >= end && s.at[i] % RT_GRAD_ALIGN == 0);
            end = s.at[i] + ir_numel(&cp.reduce[i]->t) * fmt_elem_bytes(cp.reduce[i]->t.fmt.elem);
        }
        assert_true(end <= s.slot_bytes[s.slot[b]]);
        /* two buckets of one buffer: one was sent before the other's first write */
        for (int c = 0; c < b; c++)
            if (s.slot[c] == s.slot[b] && !(sent[c] < open[b] || sent[b] < open[c]))
                fail_msg("%s: buckets %d [%d, %d] and %d [%d, %d] share buffer %d", what, c, open[c], sent[c], b,
                         open[b], sent[b], s.slot[b]);
    }
    int64_t sum = 0;
    for (int k = 0; k < s.n_slots; k++) {
        assert_int_equal(s.slot_at[k], sum);
        sum += s.slot_bytes[k];
    }
    assert_int_equal(s.bytes, sum);
    assert_int_equal(rt_grad_buffer_bytes(g), s.bytes);
    printf("  %s: %d buckets, %lld bytes of gradients, in %d buffers of %lld bytes together\n", what, n,
           (long long)cp.bytes, s.n_slots, (long long)s.bytes);
    if (n > 2) assert_true(s.bytes < cp.bytes);
    rt_grad_slots_free(&s);
    rt_comm_plan_free(&cp);
    free(open);
    free(sent);
}

static void test_grad_buffers(void **state)
{
    (void)state;
    static const Define d12[] = {{"layers", "12"}, {"dim", "768"}, {"heads", "12"}};
    for (int level = 0; level <= 3; level++) {
        Arena *a = arena_new();
        char what[64];
        snprintf(what, sizeof what, "gpt2_tiny -O%d", level);
        check_slots(tiny(a, level, "adamw", 2, 2), what);
        snprintf(what, sizeof what, "GPT-2 d12 -O%d", level);
        check_slots(compile(a, FP8C_SOURCE_DIR "/models/gpt2.model", level, NULL, 2, 2, 8, 1024, d12, 3), what);
        arena_free(a);
    }
}

int main(void)
{
    const char *env = getenv("FP8C_TEST_SEED");
    seed = env && *env ? (unsigned)strtoul(env, NULL, 10) : (unsigned)time(NULL) ^ (unsigned)getpid();
    printf("test_shard: seed %u\n", seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shard_ranges),
        cmocka_unit_test(test_groups_of_each_level),
        cmocka_unit_test(test_cuts_inside_a_group_differ),
        cmocka_unit_test(test_norm_independent_of_ranks),
        cmocka_unit_test(test_sharded_update_is_the_whole_update),
        cmocka_unit_test(test_checkpoint_reshards),
        cmocka_unit_test(test_plan_of_d48_on_four_gpus),
        cmocka_unit_test(test_stage2_step_is_the_whole_step),
        cmocka_unit_test(test_grad_buffers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
