/* test_shard_weights.c — sharded weights (--shard-states=3, ZeRO stage 3) without GPUs: the
 * gather plan and a host model of the ranks' step.
 *
 * - The plan (rt_gather_plan): gpt2_tiny at -O0..-O3 on 2, 3 and 4 ranks: every gathered
 *   weight is gathered in the forward and in the backward, in e4m3 at -O1..-O3 (the per-tensor
 *   scaled copies the GEMMs read) and bf16 at -O0; every node that reads a gathered tensor
 *   runs inside its gather's window [first, last], the gather is issued no later than its
 *   first reader and, after a phase's first layer, at the previous layer's first reader (the
 *   prefetch); two gathers in one buffer never live at once; each item fits its buffer.
 * - The host model of a rank's micro-step: rank r's persistent storage holds only its shard of
 *   each gathered weight (and of its FP8 copy), every other byte of them NaN. The reference
 *   executor runs the micro-step node by node; at each gather's issue the model assembles the
 *   layer in a buffer of its own from the ranks' shards as the collective would (FP8 weights:
 *   each rank's shard amax, their maximum, the scale from it, each owner's shard quantized
 *   with it; copies and bf16 weights: the owners' bytes), points the readers there until the
 *   gather's last reader has run, and then fills the buffer with NaN. The loss and every
 *   gradient must be the bytes of the unsharded micro-step on the same data, at -O0..-O3 on 2,
 *   3 and 4 ranks: the gathered copies are the unsharded step's bit for bit because the scale
 *   comes from the same amax and quantizing is elementwise. A control must fail: the model with
 *   one gather left out gives another loss (it reads NaN).
 * - The update on the shards: with every gathered weight NaN outside the rank's shard, each
 *   rank's sharded update writes its shard of the new weights and copies; put together they
 *   are the whole update's bytes (stage 1's check, now with nothing outside the shard).
 * - The plan's figures: GPT-2 d48 -O3 on 4 GPUs keeps at most 2 bytes a parameter per GPU.
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

static unsigned seed;

static Graph *compile(Arena *a, const char *model, int level, int gpus, int shard, int64_t batch, int64_t seq,
                      const Define *defines, int n_defines)
{
    BuildOptions o = {0};
    o.front.batch = batch;
    o.front.seq = seq;
    o.front.defines = defines;
    o.front.n_defines = n_defines;
    o.passes.opt_level = level;
    o.passes.gpus = gpus;
    o.passes.shard_states = shard;
    o.passes.verify = true;
    Graph *g = pipeline_compile(a, model, &o);
    assert_non_null(g);
    return g;
}

static Graph *tiny(Arena *a, int level, int gpus, int shard)
{
    return compile(a, FP8C_SOURCE_DIR "/models/gpt2_tiny.model", level, gpus, shard, 2, 32, NULL, 0);
}

static bool reads(const Node *n, const Node *x)
{
    for (int k = 0; k < n->n_in; k++)
        if (n->in[k] == x) return true;
    return false;
}

/* ---------------------------------------------------------------- the gather plan */

static void check_plan(int level, int ranks)
{
    Arena *a = arena_new();
    Graph *g = tiny(a, level, ranks, 3);
    RtGatherPlan p;
    assert_true(rt_gather_plan(g, ranks, &p));
    if (p.n_weights == 0) fail_msg("-O%d: nothing gathered", level);
    for (int w = 0; w < p.n_weights; w++) {
        int phases = 0;
        for (int k = 0; k < p.n_items; k++) {
            const RtGatherItem *it = &p.items[k];
            if (it->weight != w) continue;
            phases |= it->phase == PHASE_FORWARD ? 1 : it->phase == PHASE_BACKWARD ? 2 : 4;
            ElemType want = level == 0 ? FMT_BF16 : FMT_E4M3;
            if (it->wire != want)
                fail_msg("-O%d: %s gathered in %s", level, p.weights[w].param->t.name, fmt_elem_name(it->wire));
        }
        if (phases != 3) fail_msg("-O%d: %s is not gathered once in the forward and once in the backward",
                                  level, p.weights[w].param->t.name);
    }
    for (int k = 0; k < p.n_items; k++) {
        const RtGatherItem *it = &p.items[k];
        const RtGather *ga = &p.gathers[it->gather];
        if (it->at + it->buffer_bytes > p.buffer_bytes_each[ga->buffer])
            fail_msg("-O%d: an item of layer %s overflows its buffer", level, p.layers[ga->layer]);
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *n = g->nodes[i];
            bool made = n == it->target && it->target->op == OP_QUANTIZE;   /* the gather stands in */
            if (n->phase != it->phase || !(reads(n, it->target) || made)) continue;
            if (i < ga->first || i > ga->last || ga->issue > i)
                fail_msg("-O%d: node %d reads %s outside its gather [%d, %d] (issued at %d)", level, i,
                         it->target->t.name ? it->target->t.name : "?", ga->first, ga->last, ga->issue);
        }
    }
    for (int j = 0; j < p.n_gathers; j++) {
        const RtGather *ga = &p.gathers[j];
        if (j > 0 && p.gathers[j - 1].phase == ga->phase && ga->issue != p.gathers[j - 1].first)
            fail_msg("-O%d: layer %s is not prefetched at the previous layer's first reader", level,
                     p.layers[ga->layer]);
        for (int k = 0; k < j; k++)
            if (p.gathers[k].buffer == ga->buffer && p.gathers[k].last >= ga->issue)
                fail_msg("-O%d: layers %s and %s share a buffer while both live", level,
                         p.layers[p.gathers[k].layer], p.layers[ga->layer]);
    }
    printf("  -O%d on %d ranks: %d weights gathered in %d gathers, %d buffers, %lld bytes; %d kept whole\n",
           level, ranks, p.n_weights, p.n_gathers, p.n_buffers, (long long)p.buffer_bytes, p.whole_params);
    rt_gather_plan_free(&p);
    arena_free(a);
}

static void test_gather_plan(void **state)
{
    (void)state;
    for (int level = 0; level <= 3; level++)
        for (int ranks = 2; ranks <= 4; ranks++) check_plan(level, ranks);
}

/* ---------------------------------------------------------------- the host model of a rank */

static void set_scalar(Graph *g, const char *name, float v)
{
    Node *n = ir_find(g, name);
    assert_non_null(n);
    ref_store(&n->t, &v);
}

static void random_tokens(Graph *g, const char *name, int vocab)
{
    Node *n = ir_find(g, name);
    assert_non_null(n);
    int64_t count = ir_numel(&n->t);
    float *x = malloc(sizeof(float) * (size_t)count);
    for (int64_t k = 0; k < count; k++) x[k] = (float)(rng_next() % (unsigned)vocab);
    ref_store(&n->t, x);
    free(x);
}

static void rank_inputs(Graph *g, unsigned data_seed)
{
    rng_state = data_seed;
    random_tokens(g, "tokens", 256);
    random_tokens(g, "targets", 256);
}

static void zero_grads(Graph *g)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->t.role == ROLE_GRAD && !n->n_in && n->t.data) memset(n->t.data, 0, (size_t)rt_storage_bytes(n));
    }
}

static RtShard shard_of(const RtGatherWeight *w, int ranks, int r)
{
    return rt_shard_of(ir_numel(&w->param->t), rt_shard_group(w->update), ranks, r);
}

/* Every byte of t outside shard s: NaN (0xff is NaN in bf16 and in e4m3). */
static void wipe_outside(Tensor *t, RtShard s)
{
    int64_t eb = fmt_elem_bytes(t->fmt.elem), all = ir_numel(t) * eb;
    memset(t->data, 0xff, (size_t)(s.off * eb));
    memset((char *)t->data + (s.off + s.len) * eb, 0xff, (size_t)(all - (s.off + s.len) * eb));
}

typedef struct {
    Graph *g;
    RtMemory mem;
    RtGatherPlan p;
    int ranks, rank;
    char *others;        /* the other ranks' persistent storage: a snapshot with every shard */
    char *buffers;       /* the gathers' buffers */
    void **home;         /* per item: its target's own storage */
    float *scale;        /* per item: the scale its gather found (FP8 in the forward) */
    int skip_gather;     /* the control: this gather is left out (-1: none) */
} Model;

static void *others_of(Model *m, const Tensor *t)
{
    return m->others + ((char *)t->data - (char *)m->mem.persistent);
}

/* Gather j: each item assembled from the ranks' shards in its place in the buffer. */
static void gather(Model *m, int j)
{
    const RtGatherPlan *p = &m->p;
    for (int k = 0; k < p->n_items; k++) {
        const RtGatherItem *it = &p->items[k];
        if (it->gather != j) continue;
        const RtGatherWeight *w = &p->weights[it->weight];
        Node *target = (Node *)it->target;
        char *dst = m->buffers + p->buffer_at[p->gathers[j].buffer] + it->at;
        memset(dst, 0xff, (size_t)it->buffer_bytes);
        Tensor *param = (Tensor *)&w->param->t;
        void *mine = param->data, *theirs = others_of(m, param);
        if (target->op == OP_QUANTIZE) {
            const Node *qs = target->in[1];
            float scale;
            if (qs->op == OP_QUANT_SCALE && qs->in[0] == w->param) {   /* the forward: the amax */
                float amax = 0;
                for (int r = 0; r < m->ranks; r++) {
                    param->data = r == m->rank ? mine : theirs;
                    amax = fmaxf(amax, ref_shard_amax(param, shard_of(w, m->ranks, r)));   /* all-reduce max */
                }
                scale = ref_scale_from_amax(qs, amax);
            } else {   /* the backward: the forward's scale, which every rank holds */
                float *s = ref_load(&target->in[1]->t);
                scale = s[0];
                free(s);
            }
            m->scale[k] = scale;
            for (int r = 0; r < m->ranks; r++) {   /* each owner quantizes its shard */
                param->data = r == m->rank ? mine : theirs;
                ref_quantize_shard(target, shard_of(w, m->ranks, r), scale, dst);
            }
            param->data = mine;
        } else {   /* the owners' bytes as they keep them */
            int64_t eb = fmt_elem_bytes(target->t.fmt.elem);
            for (int r = 0; r < m->ranks; r++) {
                RtShard s = shard_of(w, m->ranks, r);
                const char *src = r == m->rank ? (char *)target->t.data : (char *)others_of(m, &target->t);
                memcpy(dst + s.off * eb, src + s.off * eb, (size_t)(s.len * eb));
            }
        }
        m->home[k] = target->t.data;
        target->t.data = dst;
    }
}

static void release(Model *m, int j)
{
    const RtGatherPlan *p = &m->p;
    for (int k = 0; k < p->n_items; k++) {
        const RtGatherItem *it = &p->items[k];
        if (it->gather != j) continue;
        ((Node *)it->target)->t.data = m->home[k];
        memset(m->buffers + p->buffer_at[p->gathers[j].buffer] + it->at, 0xff, (size_t)it->buffer_bytes);
    }
}

/* What node n is to the model: the quantize or quant_scale a gather stands in for (k: its item). */
static int made_by_gather(const Model *m, const Node *n, bool *is_scale)
{
    for (int k = 0; k < m->p.n_items; k++) {
        const Node *t = m->p.items[k].target;
        if (t->op != OP_QUANTIZE) continue;
        if (n == t) {
            *is_scale = false;
            return k;
        }
        if (n == t->in[1] && n->op == OP_QUANT_SCALE && n->in[0] == t->in[0]) {
            *is_scale = true;
            return k;
        }
    }
    return -1;
}

/* Rank m->rank's micro-step with its shards only, the gathers as the plan places them. */
static void sharded_micro_step(Model *m)
{
    Graph *g = m->g;
    for (int w = 0; w < m->p.n_weights; w++) {
        const RtGatherWeight *gw = &m->p.weights[w];
        RtShard s = shard_of(gw, m->ranks, m->rank);
        wipe_outside((Tensor *)&gw->param->t, s);
        if (gw->copy) wipe_outside((Tensor *)&gw->copy->t, s);
    }
    memset(m->buffers, 0xff, (size_t)m->p.buffer_bytes);
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->phase == PHASE_UPDATE) continue;
        for (int j = 0; j < m->p.n_gathers; j++)
            if (m->p.gathers[j].issue == i && j != m->skip_gather) gather(m, j);
        bool is_scale = false;
        int k = made_by_gather(m, n, &is_scale);
        if (k >= 0 && m->p.items[k].gather != m->skip_gather) {
            if (is_scale) ref_store(&n->t, &m->scale[k]);   /* the all-reduced amax's scale */
        } else {
            ref_exec_node(n);
        }
        for (int j = 0; j < m->p.n_gathers; j++)
            if (m->p.gathers[j].last == i && j != m->skip_gather) release(m, j);
    }
}

typedef struct {
    uint8_t *grads;
    float loss;
} Result;

static int64_t grads_bytes(Graph *g)
{
    int64_t b = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->t.role == ROLE_GRAD && !n->n_in && n->t.data) b += rt_storage_bytes(n);
    }
    return b;
}

static Result result_of(Graph *g)
{
    Result r = {malloc((size_t)grads_bytes(g) + 1), 0};
    int64_t at = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->t.role != ROLE_GRAD || n->n_in || !n->t.data) continue;
        memcpy(r.grads + at, n->t.data, (size_t)rt_storage_bytes(n));
        at += rt_storage_bytes(n);
    }
    float *l = ref_load(&ir_find(g, "loss")->t);
    r.loss = l[0];
    free(l);
    return r;
}

static void check_micro_step(int level, int ranks)
{
    Arena *a = arena_new();
    Model m = {.g = tiny(a, level, ranks, 3), .ranks = ranks, .skip_gather = -1};
    Graph *g = m.g;
    assert_true(rt_memory_bind(g, &m.mem));
    rt_init_params(g, seed);
    assert_true(rt_gather_plan(g, ranks, &m.p));
    size_t pb = (size_t)m.mem.persistent_bytes;
    uint8_t *start = malloc(pb);
    memcpy(start, m.mem.persistent, pb);
    m.others = malloc(pb);
    m.buffers = malloc((size_t)m.p.buffer_bytes + 1);
    m.home = calloc((size_t)m.p.n_items + 1, sizeof(void *));
    m.scale = calloc((size_t)m.p.n_items + 1, sizeof(float));
    int64_t gb = grads_bytes(g);
    for (int r = 0; r < ranks; r++) {
        /* the unsharded micro-step on rank r's data (the inputs live in the step arena, where
         * the backward reuses their place: written before each run) */
        unsigned data_seed = seed * 7u + (unsigned)(100 * level + 10 * ranks + r);
        memcpy(m.mem.persistent, start, pb);
        rank_inputs(g, data_seed);
        zero_grads(g);
        ref_run_micro_step(g);
        Result whole = result_of(g);
        /* rank r with its shards only */
        memcpy(m.mem.persistent, start, pb);
        memcpy(m.others, start, pb);
        rank_inputs(g, data_seed);
        zero_grads(g);
        m.rank = r;
        sharded_micro_step(&m);
        Result mine = result_of(g);
        if (memcmp(&whole.loss, &mine.loss, sizeof(float)) || memcmp(whole.grads, mine.grads, (size_t)gb))
            fail_msg("-O%d rank %d of %d: loss %.9g, gradients %s; the unsharded step: loss %.9g", level, r,
                     ranks, (double)mine.loss, memcmp(whole.grads, mine.grads, (size_t)gb) ? "differ" : "equal",
                     (double)whole.loss);
        /* the control: one gather left out, and the step reads NaN */
        if (r == 0) {
            memcpy(m.mem.persistent, start, pb);
            rank_inputs(g, data_seed);
            zero_grads(g);
            m.skip_gather = 0;
            sharded_micro_step(&m);
            m.skip_gather = -1;
            Result bad = result_of(g);
            if (!memcmp(&whole.loss, &bad.loss, sizeof(float)) && !memcmp(whole.grads, bad.grads, (size_t)gb))
                fail_msg("-O%d: the step without layer %s's gather gave the same bytes", level,
                         m.p.layers[m.p.gathers[0].layer]);
            free(bad.grads);
        }
        free(whole.grads);
        free(mine.grads);
    }
    printf("  -O%d on %d ranks: every rank's loss and gradients are the unsharded micro-step's\n", level, ranks);
    free(start);
    free(m.others);
    free(m.buffers);
    free(m.home);
    free(m.scale);
    rt_gather_plan_free(&m.p);
    rt_memory_free(&m.mem);
    arena_free(a);
}

static void test_sharded_micro_step_is_the_whole_one(void **state)
{
    (void)state;
    for (int level = 0; level <= 3; level++)
        for (int ranks = 2; ranks <= 4; ranks++) check_micro_step(level, ranks);
}

/* ---------------------------------------------------------------- the update on the shards */

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

/* Rank r's update phase: every update over its shard only (ref_update_shard; the copy is
 * encoded with the delayed scale every rank holds; the amax it finds is what stage 1
 * all-reduces for the next step's scale, which this check does not reach). */
static void update_as_rank(Graph *g, int ranks, int r)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->phase != PHASE_UPDATE) continue;
        if (!ir_op_is_update(n->op)) {
            ref_exec_node(n);
            continue;
        }
        RtShard s = rt_shard_of(ir_numel(&n->in[0]->t), rt_shard_group(n), ranks, r);
        float a = 0;
        if (s.len) ref_update_shard(n, s.off, s.len, &a);
    }
}

static void check_update(int level, int ranks)
{
    Arena *a = arena_new();
    Graph *g = tiny(a, level, ranks, 3);
    RtMemory mem;
    assert_true(rt_memory_bind(g, &mem));
    rt_init_params(g, seed);
    RtGatherPlan p;
    assert_true(rt_gather_plan(g, ranks, &p));
    rng_state = seed + (unsigned)(31 * level + ranks);
    set_scalar(g, "lr", 3e-3f);
    set_scalar(g, "grad_scale", 0.5f);
    set_scalar(g, "step", 1);
    random_grads(g);
    size_t pb = (size_t)mem.persistent_bytes;
    uint8_t *start = malloc(pb), *whole = malloc(pb), *put = malloc(pb);
    memcpy(start, mem.persistent, pb);
    ref_run_phase(g, PHASE_UPDATE);
    memcpy(whole, mem.persistent, pb);
    memcpy(put, whole, pb);
    for (int r = 0; r < ranks; r++) {
        memcpy(mem.persistent, start, pb);
        for (int w = 0; w < p.n_weights; w++) {   /* rank r keeps only its shards */
            RtShard s = shard_of(&p.weights[w], ranks, r);
            wipe_outside((Tensor *)&p.weights[w].param->t, s);
            if (p.weights[w].copy) wipe_outside((Tensor *)&p.weights[w].copy->t, s);
        }
        update_as_rank(g, ranks, r);
        for (int w = 0; w < p.n_weights; w++) {   /* its shards of the new weights and copies */
            const RtGatherWeight *gw = &p.weights[w];
            RtShard s = shard_of(gw, ranks, r);
            const Tensor *ts[2] = {&gw->param->t, gw->copy ? &gw->copy->t : NULL};
            for (int k = 0; k < 2; k++) {
                if (!ts[k]) continue;
                int64_t eb = fmt_elem_bytes(ts[k]->fmt.elem), at = (char *)ts[k]->data - (char *)mem.persistent;
                memcpy(put + at + s.off * eb, (char *)ts[k]->data + s.off * eb, (size_t)(s.len * eb));
            }
        }
    }
    /* the shards put together are the whole update's new weights and FP8 copies */
    for (int w = 0; w < p.n_weights; w++) {
        const RtGatherWeight *gw = &p.weights[w];
        const Tensor *ts[2] = {&gw->param->t, gw->copy ? &gw->copy->t : NULL};
        for (int k = 0; k < 2; k++) {
            if (!ts[k]) continue;
            int64_t at = (char *)ts[k]->data - (char *)mem.persistent;
            if (memcmp(put + at, whole + at, (size_t)(ir_numel(ts[k]) * fmt_elem_bytes(ts[k]->fmt.elem))))
                fail_msg("-O%d on %d ranks: %s put together from the shards differs from the whole update",
                         level, ranks, ts[k]->name);
        }
    }
    free(start);
    free(whole);
    free(put);
    rt_gather_plan_free(&p);
    rt_memory_free(&mem);
    arena_free(a);
}

static void test_update_on_the_shards(void **state)
{
    (void)state;
    for (int level = 0; level <= 3; level++)
        for (int ranks = 2; ranks <= 4; ranks++) check_update(level, ranks);
}

/* ---------------------------------------------------------------- the plan's figures */

static void test_plan_of_d48_on_four_gpus(void **state)
{
    (void)state;
    static const Define d48[] = {{"layers", "48"}, {"dim", "1600"}, {"heads", "25"}};
    Arena *a = arena_new();
    Graph *g = compile(a, FP8C_SOURCE_DIR "/models/gpt2.model", 3, 4, 3, 8, 1024, d48, 3);
    MemSummary m;
    memplan_summarize(g, &m);
    RtShardPlan sp;
    rt_shard_plan(g, m.by_role, 4, &sp);
    assert_true(sp.on && sp.stage == 3);
    double per_gpu = (double)(m.persistent - sp.saved) / (double)m.n_params;
    RtGatherPlan p;
    assert_true(rt_gather_plan(g, 4, &p));
    int64_t matrices = 0, largest_layer = 0;
    for (int w = 0; w < p.n_weights; w++) matrices += ir_numel(&p.weights[w].param->t);
    for (int j = 0; j < p.n_gathers; j++)
        if (p.gathers[j].bytes_buffer > largest_layer) largest_layer = p.gathers[j].bytes_buffer;
    printf("GPT-2 d48 -O3 on 4 GPUs, --shard-states=3: %.3f bytes a parameter per GPU; %d weights "
           "gathered (%lld parameters), %d kept whole (%.1f MiB); %.2f GiB gathered in e4m3 a micro-step, "
           "%.2f GiB sent per GPU; %d layer buffers, %.1f MiB\n",
           per_gpu, p.n_weights, (long long)matrices, p.whole_params, (double)p.whole_bytes / (1 << 20),
           (double)p.gathered_fp8 / (1 << 30), (double)p.sent_fp8 / (1 << 30), p.n_buffers,
           (double)p.buffer_bytes / (1 << 20));
    assert_true(per_gpu <= 2.0);
    /* the four matrices of each of the 48 layers, the embeddings and vectors whole */
    assert_int_equal(p.n_weights, 4 * 48);
    assert_int_equal(p.whole_matrices, 2);
    /* whole weights on every GPU, a quarter of the gathered ones (shards are rank 0's, the most) */
    int64_t want = p.whole_bytes;
    for (int w = 0; w < p.n_weights; w++) {
        const Node *pm = p.weights[w].param;
        want += rt_shard_of(ir_numel(&pm->t), rt_shard_group(p.weights[w].update), 4, 0).len * 2;
    }
    assert_int_equal(sp.per_gpu[ROLE_PARAM], want);
    /* at -O3 every gathered weight travels as its e4m3 copy, twice a micro-step, 3/4 of it sent */
    assert_int_equal(p.gathered_fp8, 2 * matrices);
    assert_int_equal(p.gathered_bf16, 0);
    assert_int_equal(p.sent_fp8, 2 * matrices * 3 / 4);
    assert_int_equal(p.amax_values, 4 * 48);
    /* two buffers: the layer that computes and the one prefetched */
    assert_int_equal(p.n_buffers, 2);
    assert_int_equal(p.buffer_bytes, 2 * largest_layer);
    assert_int_equal(sp.gather_buffer_bytes, p.buffer_bytes);
    rt_gather_plan_free(&p);
    arena_free(a);
}

int main(void)
{
    const char *env = getenv("FP8C_TEST_SEED");
    seed = env && *env ? (unsigned)strtoul(env, NULL, 10) : (unsigned)time(NULL) ^ (unsigned)getpid();
    printf("test_shard_weights: seed %u\n", seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gather_plan),
        cmocka_unit_test(test_sharded_micro_step_is_the_whole_one),
        cmocka_unit_test(test_update_on_the_shards),
        cmocka_unit_test(test_plan_of_d48_on_four_gpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
