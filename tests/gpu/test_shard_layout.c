/* test_shard_layout.c — the device arena of --shard-states (cuda/exec_shard.c), without a GPU.
 *
 * The sharded step keeps the host mirror whole and cuts the other ranks' shards of the masters,
 * optimizer states and codec side values out of the device's persistent arena. The layout is
 * computed from the graph and the host mirror alone, so it is checked here, with no driver, on
 * the sharded test graphs of gpt2_tiny (-O1, -O2, -O3) for 2 and 3 ranks, every rank:
 *   - every sharded tensor has on the device exactly its rank's range (rt_shard_of's elements,
 *     the codec's side values of its groups), contiguous, at an address with the host offset's
 *     alignment modulo 256 (the kernels' vector paths see the same alignment as unsharded);
 *   - every byte of the host arena that is not another rank's shard is on the device, each
 *     piece inside the allocation;
 *   - rank 0 cuts exactly what the plan says it saves (rt_shard_plan), and the alignment
 *     costs less than 512 bytes a kept run.
 * And the update list's launches restricted to the shards (exec_shard_prepare), from the
 * plans the executor would launch. For --shard-states=2 (exec_grads.c) the same, with the
 * accumulators cut too, and the bucket buffers the backward writes in; for --shard-states=3
 * (exec_gather.c) the weights cut, their layer buffers, and every read of a gathered weight in
 * the evaluation and micro-step lists rewritten to its gather's buffer. What the host cannot show (the kernels over their shards,
 * the collectives, the captured graph) is test_gpu_comm's, on two GPUs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "exec_internal.h"
#include "passes.h"

#ifndef GPU_IR_DIR
#define GPU_IR_DIR "."
#endif

static Graph *load_graph(Arena *arena, const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.ir", GPU_IR_DIR, name);
    int64_t size;
    uint8_t *bytes = rt_read_file(path, &size);
    char *text = bytes ? malloc((size_t)size + 1) : NULL;
    if (!text) {
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

typedef struct {
    int64_t bytes, outside;
} Pieces;

static bool count_piece(CudaExec *e, char *host, CUdeviceptr dev, int64_t bytes, void *ctx) {
    (void)host;
    Pieces *p = ctx;
    p->bytes += bytes;
    p->outside += dev < e->persistent || dev + (CUdeviceptr)bytes > e->persistent + (CUdeviceptr)e->persistent_alloc;
    return true;
}

/* Graph `name` read into `arena`, its memory bound on the host (*mem) and its plan summed up
 * (*m): what every layout below starts from */
static Graph *bound_graph(Arena *arena, const char *name, RtMemory *mem, MemSummary *m) {
    Graph *g = load_graph(arena, name);
    assert_non_null(g);
    assert_true(rt_memory_bind(g, mem));
    memplan_summarize(g, m);
    return g;
}

static void check_graph(const char *name) {
    Arena *arena = arena_new();
    RtMemory mem;
    MemSummary m;
    Graph *g = bound_graph(arena, name, &mem, &m);
    for (int world = 2; world <= 3; world++) {
        RtShardPlan sp;
        rt_shard_plan(g, m.by_role, world, &sp);
        for (int rank = 0; rank < world; rank++) {
            CudaExec *e = calloc(1, sizeof *e);
            assert_non_null(e);
            e->g = g;
            e->host = mem;
            int64_t dev = exec_shard_layout(e, world, rank);
            assert_true(e->shard && dev > 0);
            e->persistent = (CUdeviceptr)1 << 40;   /* any 256-aligned base: nothing is dereferenced */
            e->persistent_alloc = dev;
            int64_t wrong = 0;
            for (int i = 0; i < e->n_shard_tensors; i++) {
                const ExecShardTensor *t = &e->shard_tensors[i];
                const ExecShardUpdate *u = &e->shard_updates[t->update];
                RtShard s = rt_shard_of(u->n, u->group, world, rank);
                int64_t lo = t->codec ? codec_param_count(t->codec, s.off) * 4 : s.off * t->eb;
                int64_t hi = t->codec ? codec_param_count(t->codec, s.off + s.len) * 4 : (s.off + s.len) * t->eb;
                Pieces p = {0, 0};
                assert_true(exec_pieces(e, "a state", (char *)mem.persistent + t->at, t->bytes, count_piece, &p));
                wrong += p.bytes != hi - lo || p.outside;
                if (hi > lo) {
                    CUdeviceptr d0 = exec_shard_map(e, t->at + lo), d1 = exec_shard_map(e, t->at + hi - 1);
                    wrong += d1 - d0 != (CUdeviceptr)(hi - lo - 1);
                    wrong += (int64_t)((d0 - e->persistent) % 256) != (t->at + lo) % 256;
                }
            }
            Pieces all = {0, 0};
            assert_true(exec_pieces(e, "the arena", mem.persistent, mem.persistent_bytes, count_piece, &all));
            int64_t cut = mem.persistent_bytes - all.bytes, pad = dev - all.bytes;
            printf("  %s, rank %d of %d: %d sharded tensors in %d kept runs; %lld of %lld bytes on the device "
                   "(%lld cut, the plan's rank 0 saves %lld; %lld of alignment)\n",
                   name, rank, world, e->n_shard_tensors, e->n_shard_segs, (long long)dev,
                   (long long)mem.persistent_bytes, (long long)cut, (long long)sp.saved, (long long)pad);
            assert_int_equal(wrong, 0);
            assert_int_equal(all.outside, 0);
            if (rank == 0) assert_int_equal(cut, sp.saved);
            assert_true(pad >= 0 && pad < 512 * (int64_t)e->n_shard_segs);
            exec_shard_close(e);
            free(e);
        }
    }
    rt_memory_free(&mem);
    arena_free(arena);
}

static void test_layout(void **state) {
    (void)state;
    check_graph("gpt2_tiny_zero_O1");
    check_graph("gpt2_tiny_zero_O2");
    check_graph("gpt2_tiny_zero_O3");
    check_graph("gpt2_tiny_zero2_O1");   /* stage 2: the accumulators cut as well */
    check_graph("gpt2_tiny_zero2_O2");
    check_graph("gpt2_tiny_zero2_O3");
    check_graph("gpt2_tiny_zero3_O0");   /* stage 3: the gathered weights and copies cut as well */
    check_graph("gpt2_tiny_zero3_O1");
    check_graph("gpt2_tiny_zero3_O3");
}

/* A host-only executor of graph `name` as the set-up of a rank of `world` sees it before the layout:
 * the graph read into `arena`, its memory bound on the host, the per-GPU plan of stage `stage`
 * in *sp (checked), e->g and e->host filled. */
static CudaExec *open_layout(Arena *arena, const char *name, int world, int stage, RtShardPlan *sp) {
    RtMemory mem;
    MemSummary m;
    Graph *g = bound_graph(arena, name, &mem, &m);
    rt_shard_plan(g, m.by_role, world, sp);
    assert_int_equal(sp->stage, stage);
    CudaExec *e = calloc(1, sizeof *e);
    assert_non_null(e);
    e->g = g;
    e->host = mem;
    return e;
}

/* what open_layout and the layout opened, closed: the executor's parts, the host memory, the
 * graph's arena */
static void close_layout(CudaExec *e, Arena *arena) {
    exec_gather_close(e);
    exec_grads_close(e);
    exec_shard_close(e);
    rt_memory_free(&e->host);
    free(e);
    arena_free(arena);
}

/* --shard-states=2 (exec_grads.c): the bucket buffers as the executor lays them out from its
 * launch plans, for every rank of 2 and 3. Checked: every gradient has a place in its bucket's
 * buffer, inside the buffers, aligned as its host offset is modulo 256, and no two gradients of
 * buffers live at once overlap; buffers shared by buckets are handed on only after a send
 * (the launch plans' first writes and roots); the executor's buffers take no more than the
 * plan's figure (rt_shard_plan), which uses the graph's bounds; the micro list, resolved with
 * the accumulators mapped to the buffers, writes no accumulator outside them, and the
 * accumulators in the persistent arena are this rank's shard only. */
static void check_buffers(const char *name, int world, int rank) {
    Arena *arena = arena_new();
    RtShardPlan sp;
    CudaExec *e = open_layout(arena, name, world, 2, &sp);
    Graph *g = e->g;
    RtMemory mem = e->host;
    char why[256] = "";
    e->plans = cuda_plan_graph(g, arena, why, sizeof why);
    assert_non_null(e->plans);
    e->persistent_alloc = exec_shard_layout(e, world, rank);
    int64_t bytes = exec_grads_layout(e);
    assert_true(e->shard_grads && bytes > 0);
    e->persistent = (CUdeviceptr)1 << 40;
    e->grad_buf = (CUdeviceptr)1 << 41;
    RtCommPlan cp;
    assert_true(rt_comm_plan(g, &cp));
    assert_int_equal(e->n_grads, cp.n_reduce);
    int wrong = 0;
    for (int i = 0; i < e->n_grads; i++) {
        const ExecGrad *x = &e->grads[i];
        wrong += x->buf_at < 0 || x->buf_at + x->bytes > bytes || x->buf_at % 256 != x->at % 256;
        /* an address inside the accumulator maps to its place while the micro list is resolved */
        CUdeviceptr d = 0;
        e->map_grads = true;
        wrong += !exec_grads_map(e, x->at + x->bytes - 1, &d) || d != e->grad_buf + (CUdeviceptr)(x->buf_at + x->bytes - 1);
        e->map_grads = false;
        wrong += exec_grads_map(e, x->at, &d);
        for (int j = 0; j < i; j++) {
            const ExecGrad *y = &e->grads[j];
            bool same_bucket = x->bucket == y->bucket;
            bool same_slot = e->grad_slots.slot[x->bucket] == e->grad_slots.slot[y->bucket];
            bool overlap = x->buf_at < y->buf_at + y->bytes && y->buf_at < x->buf_at + x->bytes;
            wrong += overlap && (same_bucket || !same_slot);
        }
    }
    /* the persistent arena keeps this rank's shard of each accumulator only */
    Pieces all = {0, 0};
    for (int i = 0; i < e->n_grads; i++) {
        const ExecGrad *x = &e->grads[i];
        RtShard s = rt_shard_of(x->n, x->group, world, rank);
        Pieces p = {0, 0};
        assert_true(exec_pieces(e, "a gradient", (char *)mem.persistent + x->at, x->bytes, count_piece, &p));
        wrong += p.bytes != s.len * x->eb;
        all.bytes += p.bytes;
    }
    printf("  %s, rank %d of %d: %d gradients in %d buckets, %d buffers of %lld bytes (the plan: %lld; the "
           "gradients %lld, this rank's shards %lld); %d wrong\n",
           name, rank, world, e->n_grads, cp.n_buckets, e->grad_slots.n_slots, (long long)bytes,
           (long long)sp.grad_buffer_bytes, (long long)cp.bytes, (long long)all.bytes, wrong);
    assert_int_equal(wrong, 0);
    assert_true(bytes <= sp.grad_buffer_bytes);
    if (cp.n_buckets > 2) assert_true(bytes < cp.bytes);
    rt_comm_plan_free(&cp);
    close_layout(e, arena);
}

static void test_grad_buffers(void **state) {
    (void)state;
    static const char *const names[] = {"gpt2_tiny_zero2_O1", "gpt2_tiny_zero2_O2", "gpt2_tiny_zero2_O3"};
    for (int k = 0; k < 3; k++)
        for (int world = 2; world <= 3; world++)
            for (int rank = 0; rank < world; rank++) check_buffers(names[k], world, rank);
}

/* The update list as cuda_exec_open builds it for a sharded executor (one launch per node,
 * argument blocks resolved to device addresses; no module is loaded, so no function), the
 * gradients' sums as exec_comm_open lists them; then exec_shard_prepare restricts the launches
 * to the rank's shards. Checked: it accepts the compiler's update phase at -O1..-O3, every
 * update kernel's elementwise tensors start at the rank's shard on the device and count its
 * elements (a codec's side values from the shard's first group), the copy keeps its one
 * scale, and each SQNORM reads the shard of its gradient, which starts on a norm chunk, and
 * writes its chunks' sums at their places among the tensor's, which its last launch (after
 * the all-reduce) adds whole. */
static void check_launches(const char *name, int world, int rank) {
    Arena *arena = arena_new();
    Graph *g = load_graph(arena, name);
    assert_non_null(g);
    RtMemory mem;
    assert_true(rt_memory_bind(g, &mem));
    CudaExec *e = calloc(1, sizeof *e);
    assert_non_null(e);
    e->g = g;
    e->host = mem;
    e->persistent_alloc = exec_shard_layout(e, world, rank);
    e->persistent = (CUdeviceptr)1 << 40;
    char why[256] = "";
    CuNodePlan *plans = cuda_plan_graph(g, arena, why, sizeof why);
    assert_non_null(plans);
    e->reduce = calloc((size_t)g->n_nodes, sizeof *e->reduce);
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->op == OP_ALL_REDUCE) {
            ExecReduce *r = &e->reduce[e->n_reduce++];
            r->node = n;
            r->count = ir_numel(&n->t);
            r->elem = n->t.fmt.elem;
            assert_true(exec_map_tensor(e, &n->t, &r->p));
        }
        if (n->phase != PHASE_UPDATE) continue;
        for (int k = 0; k < plans[i].n_launch; k++) {
            const CuLaunch *l = &plans[i].launch[k];
            ExecLaunch x;
            memset(&x, 0, sizeof x);
            x.kind = l->kind;
            x.node = n;
            x.fn = l->fn;
            assert_int_equal(l->kind, CU_KERNEL);
            assert_true(exec_resolve(e, l, &x.args, 0));
            assert_true(list_push(&e->lists[LIST_UPDATE], &x));
        }
    }
    assert_true(exec_shard_prepare(e));
    int checked = 0, wrong = 0;
    int64_t norm_at = 0;
    const Node *prev = NULL;
    for (int i = 0; i < e->lists[LIST_UPDATE].n; i++) {
        const ExecLaunch *x = &e->lists[LIST_UPDATE].l[i];
        const Node *n = x->node;
        bool first = n != prev;
        prev = n;
        if (!first || (!ir_op_is_update(n->op) && n->op != OP_SQNORM)) continue;
        const Node *u = n;
        if (n->op == OP_SQNORM)
            for (int k = 0; k < e->n_shard_updates; k++)
                if (e->shard_updates[k].node->in[1] == n->in[0]) u = e->shard_updates[k].node;
        assert_true(ir_op_is_update(u->op));
        RtShard s = rt_shard_of(ir_numel(&u->in[0]->t), rt_shard_group(u), world, rank);
        int at[12], count = 0;
        if (n->op == OP_SQNORM) {
            at[count++] = -1;   /* t[1]: the gradient */
            /* its chunk sums at their places among the tensor's in the all-reduced buffer, the
             * last launch over all of them, after the all-reduce */
            int64_t chunks = (ir_numel(&n->in[0]->t) + IR_SQNORM_CHUNK - 1) / IR_SQNORM_CHUNK;
            wrong += s.len && s.off % IR_SQNORM_CHUNK;
            wrong += (uintptr_t)x->args.scratch != e->norm_chunks + (CUdeviceptr)(8 * (norm_at + s.off / IR_SQNORM_CHUNK));
            const ExecLaunch *last = &e->lists[LIST_UPDATE].l[i + 1];
            wrong += last->node != n || !e->norm_final[i + 1] || last->args.i[0] != chunks ||
                     (uintptr_t)last->args.scratch != e->norm_chunks + (CUdeviceptr)(8 * norm_at);
            norm_at += chunks;
        } else {
            for (int j = 0; j < ir_update_lr_index(u); j++) at[count++] = j;
            if (ir_adamw_master_index(u) >= 0) at[count++] = ir_adamw_master_index(u);
            if (ir_adamw_copy_index(u) >= 0) at[count++] = ir_adamw_copy_index(u);
        }
        for (int c = 0; c < count; c++) {
            int k = at[c] < 0 ? 1 : at[c];
            const Node *m = at[c] < 0 ? n->in[0] : u->in[k];
            const CkTensor *t = &x->args.t[k];
            int64_t eb = fmt_elem_bytes(m->t.fmt.elem);
            int64_t off = (const char *)m->t.data - (const char *)mem.persistent + s.off * eb;
            wrong += t->n != s.len || (uintptr_t)t->p != (uintptr_t)exec_shard_map(e, off);
            const Format *f = &m->t.fmt;
            if (f->codec != CODEC_PLAIN && f->codec != CODEC_SPLIT && f->scale) {
                int64_t soff = (const char *)f->scale->t.data - (const char *)mem.persistent +
                               codec_param_count(f->codec, s.off) * (int64_t)sizeof(float);
                wrong += (uintptr_t)t->s != (uintptr_t)exec_shard_map(e, soff);
            } else if (f->scaling == SCALE_PER_TENSOR && f->scale) {
                CUdeviceptr whole;
                assert_true(exec_map_tensor(e, &f->scale->t, &whole));
                wrong += (uintptr_t)t->s != (uintptr_t)whole;
            }
            checked++;
        }
    }
    printf("  %s, rank %d of %d: %d update launches restricted to the shard, %d tensors checked, %d wrong\n",
           name, rank, world, e->n_shard_updates, checked, wrong);
    assert_int_equal(wrong, 0);
    assert_true(checked > 3 * e->n_shard_updates);
    assert_int_equal(e->n_sqnorms, e->n_shard_updates);
    assert_int_equal(norm_at, e->n_norm_chunks);
    free(e->lists[LIST_UPDATE].l);
    free(e->reduce);
    exec_shard_close(e);
    free(e);
    rt_memory_free(&mem);
    arena_free(arena);
}

static void test_update_launches(void **state) {
    (void)state;
    static const char *const names[] = {"gpt2_tiny_zero_O1",  "gpt2_tiny_zero_O2",  "gpt2_tiny_zero_O3",
                                        "gpt2_tiny_zero2_O1", "gpt2_tiny_zero2_O2", "gpt2_tiny_zero2_O3"};
    for (int k = 0; k < 6; k++)
        for (int rank = 0; rank < 2; rank++) check_launches(names[k], 2, rank);
}

/* --shard-states=3 (exec_gather.c): the gathered weights, their layer buffers and the lists
 * that read them, as cuda_exec_open resolves the evaluation and micro-step lists (the plans
 * with their GEMM epilogues; a GEMM's operands through ref_ptr, a kernel's through
 * exec_resolve; no driver). Checked, for every rank of 2 and 3:
 *   - each gathered weight (and FP8 copy) of the plan is a sharded tensor, on the device as
 *     its rank's shard only;
 *   - each gather's items lie inside its buffer, apart, with the host offset's alignment, and
 *     the buffers take no more than the plan's figure beyond that alignment;
 *   - every operand of every launch of both lists that lies in a gathered tensor resolves into
 *     the buffer of the gather (per the plan, independently of the executor's choices) of its
 *     layer in the launch's phase issued latest before it, at the tensor's place there: the
 *     plan's target (a copy, a bf16 weight, the forward's e4m3 quantize), but for the
 *     backward's quantizes, which read the gathered bf16 weight; the forward, the backward and
 *     the evaluation all read gathered tensors;
 *   - at -O3 every forward gather carries e4m3 codes: no launch of the weight's QUANT_SCALE is
 *     in either list (its place copies the gathered scale, after the gather's wait), and the
 *     QUANTIZE's launches run over no elements;
 *   - exec_gather_check accepts the lists; and refuses them (the controls) when a gather is
 *     never issued (its readers then read no buffer) or when the next gather of the same
 *     phase is put into the buffer its predecessor's readers still read. */
typedef struct {
    int reads, quantize_reads, eval_reads, backward_reads, wrong;
    bool quiet;   /* the controls: misplaced reads are what they expect */
} GatherReads;

/* What the plan's item k puts in its buffer, as the executor is to gather it. */
static const Node *plan_target(const RtGatherPlan *gp, int k) {
    const RtGatherItem *it = &gp->items[k];
    bool backward_quantize = it->target->op == OP_QUANTIZE && it->phase == PHASE_BACKWARD;
    return backward_quantize ? gp->weights[it->weight].param : it->target;
}

/* The expected device address of node t's tensor (at byte offset) read by node i (phase ph),
 * or 0 when it is not a gathered tensor; *bad when it is and no gather of the plan holds it
 * there. A weight or copy is gathered bytes of the persistent arena; a quantize, the very
 * tensor (its step-arena bytes serve others at other times). */
static CUdeviceptr expected_read(const CudaExec *e, const RtGatherPlan *gp, int i, Phase ph, const Node *t, bool *bad) {
    const char *c = t->t.data;
    for (int k = 0; k < e->n_gather_items; k++) {
        const ExecGatherItem *x = &e->gather_items[k];
        if (x->tensor->op == OP_QUANTIZE ? t != x->tensor : c < x->host || c >= x->host + x->bytes) continue;
        int best = -1;
        for (int j = 0; j < gp->n_gathers; j++)
            if (gp->gathers[j].phase == ph && gp->gathers[j].issue <= i) {
                bool holds = false;
                for (int m = 0; m < gp->n_items; m++) holds = holds || (gp->items[m].gather == j && plan_target(gp, m) == x->tensor);
                if (holds) best = j;
            }
        if (best < 0) {
            *bad = true;
            return 0;
        }
        for (int m = 0; m < e->n_gather_items; m++)
            if (e->gather_items[m].gather == best && e->gather_items[m].tensor == x->tensor)
                return e->gather_buf + (CUdeviceptr)(e->gather_slot_at[gp->gathers[best].buffer] +
                                                     e->gather_items[m].buf_at + (c - x->host));
        *bad = true;
        return 0;
    }
    return 0;
}

/* whether node n is the QUANTIZE of an e4m3 item (its launch reads the weight over nothing) */
static bool e4m3_quantize(const CudaExec *e, const Node *n) {
    for (int k = 0; k < e->n_gather_items; k++)
        if (e->gather_items[k].scale && e->gather_items[k].tensor == n) return true;
    return false;
}

static void check_read(const CudaExec *e, const RtGatherPlan *gp, int i, bool eval, const Node *t, int64_t offset,
                       CUdeviceptr got, GatherReads *r) {
    if (!t || !t->t.data) return;
    const Node *n = e->g->nodes[i];
    bool bad = false;
    CUdeviceptr want = expected_read(e, gp, i, n->phase, t, &bad);
    if (bad && e4m3_quantize(e, n)) return;   /* the weight, read over no elements */
    if (!want && !bad) return;
    want += (CUdeviceptr)offset;
    r->reads++;
    r->quantize_reads += n->op == OP_QUANTIZE;
    r->eval_reads += eval;
    r->backward_reads += n->phase == PHASE_BACKWARD;
    if ((bad || got != want) && !r->quiet)
        printf("    %s %%%d reads %s at %#llx, not %#llx\n", ir_op_info(n->op)->text, n->id,
               t->t.name ? t->t.name : "", (unsigned long long)got, (unsigned long long)want);
    r->wrong += bad || got != want;
}

/* The launches of plan p at node i into list L (eval or micro), resolved and checked. */
static void resolve_node(CudaExec *e, const RtGatherPlan *gp, int i, const CuNodePlan *p, bool eval, ExecList *L,
                         GatherReads *r) {
    for (int k = 0; k < p->n_launch; k++) {
        const CuLaunch *l = &p->launch[k];
        ExecLaunch x;
        memset(&x, 0, sizeof x);
        x.kind = l->kind;
        x.node = e->g->nodes[i];
        x.fn = l->fn;
        bool ok = true;
        if (l->kind == CU_GEMM) {
            const CuRef *ops[] = {&l->gemm.a, &l->gemm.b, &l->gemm.c, &l->gemm.bias};
            for (int o = 0; o < 4; o++) {
                if (!ops[o]->node) continue;
                CUdeviceptr d = ref_ptr(e, ops[o], &ok);
                check_read(e, gp, i, eval, ops[o]->node, ops[o]->offset, d, r);
            }
        } else {
            ok = exec_resolve(e, l, &x.args, 0);
            for (int t = 0; t < CK_MAX_TENSORS; t++)
                if (l->ref[t].node) check_read(e, gp, i, eval, l->ref[t].node, 0, (CUdeviceptr)(uintptr_t)x.args.t[t].p, r);
        }
        r->wrong += !ok || !list_push(L, &x);
    }
}

/* cuda_exec_open's loop over the nodes, for the two lists that read gathered tensors */
static bool resolve_lists(CudaExec *e, const RtGatherPlan *gp, GatherReads *r) {
    e->gather_miss = NULL;
    for (int j = 0; j < e->n_gathers; j++)
        for (int l = 0; l < GATHER_LISTS; l++)
            e->gathers[j].issue_at[l] = e->gathers[j].read_from[l] = e->gathers[j].read_to[l] = -1;
    for (int k = 0; k < e->n_gather_items; k++)
        e->gather_items[k].scale_at[GATHER_EVAL] = e->gather_items[k].scale_at[GATHER_MICRO] = -1;
    ExecList *ev = &e->lists[LIST_EVAL], *mi = &e->lists[LIST_MICRO];
    ev->n = mi->n = 0;
    for (int i = 0; i < e->g->n_nodes; i++) {
        const Node *n = e->g->nodes[i];
        bool taken = exec_gather_at(e, GATHER_EVAL, i, ev->n);
        if (n->phase == PHASE_FORWARD && !taken)
            resolve_node(e, gp, i, e->plans[i].alone ? e->plans[i].alone : &e->plans[i], true, ev, r);
        taken = exec_gather_at(e, GATHER_MICRO, i, mi->n);
        if (n->phase != PHASE_UPDATE && e->plans[i].n_launch && !taken) resolve_node(e, gp, i, &e->plans[i], false, mi, r);
        exec_gather_at(e, -1, 0, 0);
    }
    return exec_gather_check(e);
}

static void check_gathers(const char *name, int world, int rank) {
    Arena *arena = arena_new();
    RtShardPlan sp;
    CudaExec *e = open_layout(arena, name, world, 3, &sp);
    Graph *g = e->g;
    RtMemory mem = e->host;
    char why[256] = "";
    CuNodePlan *node_plans = cuda_plan_graph(g, arena, why, sizeof why);
    assert_non_null(node_plans);
    e->plans = cuda_plan_epilogues(g, node_plans, arena);
    e->persistent_alloc = exec_shard_layout(e, world, rank);
    assert_true(e->shard && e->persistent_alloc > 0);
    assert_true(exec_grads_layout(e) > 0);
    int64_t bytes = exec_gather_layout(e);
    assert_true(e->shard_weights && bytes > e->gather_buf_bytes);
    e->persistent = (CUdeviceptr)1 << 40;
    e->step = (CUdeviceptr)1 << 41;
    e->grad_buf = (CUdeviceptr)1 << 42;
    e->gather_buf = (CUdeviceptr)1 << 43;
    RtGatherPlan gp;
    assert_true(rt_gather_plan(g, world, &gp));
    assert_int_equal(e->n_gathers, gp.n_gathers);
    int wrong = 0;
    /* the weights and copies: sharded tensors, the rank's shard only on the device */
    for (int w = 0; w < gp.n_weights; w++) {
        const Node *ts[2] = {gp.weights[w].param, gp.weights[w].copy};
        for (int c = 0; c < 2 && ts[c]; c++) {
            int64_t at = (const char *)ts[c]->t.data - (const char *)mem.persistent;
            bool listed = false;
            for (int k = 0; k < e->n_shard_tensors; k++) listed = listed || e->shard_tensors[k].at == at;
            RtShard s = rt_shard_of(ir_numel(&ts[c]->t), rt_shard_group(gp.weights[w].update), world, rank);
            Pieces p = {0, 0};
            assert_true(exec_pieces(e, "a weight", ts[c]->t.data, tensor_bytes(&ts[c]->t), count_piece, &p));
            wrong += !listed || p.bytes != s.len * fmt_elem_bytes(ts[c]->t.fmt.elem);
        }
    }
    /* the items in their buffers; at -O3 the forward's items e4m3 codes */
    int64_t items_bytes = 0;
    int e4m3 = 0, forward_quantizes = 0;
    for (int k = 0; k < gp.n_items; k++)
        forward_quantizes += gp.items[k].target->op == OP_QUANTIZE && gp.items[k].phase == PHASE_FORWARD;
    for (int k = 0; k < e->n_gather_items; k++) {
        const ExecGatherItem *x = &e->gather_items[k];
        const ExecGather *ga = &e->gathers[x->gather];
        int64_t end = ga->buffer + 1 < e->n_gather_slots ? e->gather_slot_at[ga->buffer + 1] : e->gather_buf_bytes;
        const char *arena_at = x->scale ? (const char *)mem.step : (const char *)mem.persistent;
        wrong += x->buf_at % 256 != (x->host - arena_at) % 256 || e->gather_slot_at[ga->buffer] + x->buf_at + x->bytes > end;
        for (int j = 0; j < k; j++) {
            const ExecGatherItem *y = &e->gather_items[j];
            wrong += y->gather == x->gather && x->buf_at < y->buf_at + y->bytes && y->buf_at < x->buf_at + x->bytes;
        }
        items_bytes += x->bytes;
        e4m3 += x->scale != NULL;
                wrong += x->scale && (x->eb != 1 || ga->phase != PHASE_FORWARD);
    }
    GatherReads r = {0};
    bool accepted = resolve_lists(e, &gp, &r);
    /* e4m3: no QUANT_SCALE launched, its place the scale's copy after the wait; the QUANTIZE
     * over no elements */
    int zeroed = 0;
    for (int k = 0; k < e->n_gather_items; k++) {
        const ExecGatherItem *x = &e->gather_items[k];
        if (!x->scale) continue;
        const ExecGather *ga = &e->gathers[x->gather];
        for (int l = 0; l < GATHER_LISTS; l++)
            wrong += x->scale_at[l] < 0 || ga->read_from[l] < 0 || ga->read_from[l] > x->scale_at[l];
        for (int l = LIST_EVAL; l <= LIST_MICRO; l++)
            for (int i = 0; i < e->lists[l].n; i++) {
                const ExecLaunch *y = &e->lists[l].l[i];
                wrong += y->node == x->scale;
                if (y->node == x->tensor) {
                    zeroed++;
                    wrong += y->args.t[0].n != 0 || y->args.t[1].n != 0;
                }
            }
    }
    printf("  %s, rank %d of %d: %d gathers of %d items (%d in e4m3 of the plan's %d forward quantizes; %lld bytes) "
           "in %d buffers of %lld bytes (the plan: %lld); %d reads of gathered tensors (%d in the evaluation, %d in the "
           "backward, %d by quantizes), %d quantize launches over no elements, %d wrong%s\n",
           name, rank, world, e->n_gathers, e->n_gather_items, e4m3, forward_quantizes, (long long)items_bytes,
           e->n_gather_slots, (long long)e->gather_buf_bytes, (long long)sp.gather_buffer_bytes, r.reads, r.eval_reads,
           r.backward_reads, r.quantize_reads, zeroed, r.wrong + wrong, accepted ? "" : " (refused)");
    assert_int_equal(wrong + r.wrong, 0);
    assert_true(accepted);
    assert_true(r.reads > 0 && r.eval_reads > 0 && r.backward_reads > 0);
    assert_int_equal(e4m3, forward_quantizes);
    if (strstr(name, "_O3")) assert_true(e4m3 > 0 && r.quantize_reads > 0);
    assert_int_equal(zeroed, 2 * e4m3);   /* in the evaluation and in the micro-step */
    /* the plan's buffers, but for the alignment; at -O3 the backward's items are the bf16
     * weights (2 bytes an element) where the plan counts e4m3 quantizes of one layout */
    int64_t planned = sp.gather_buffer_bytes * (strstr(name, "_O3") ? 2 : 1);
    assert_true(e->gather_buf_bytes <= planned + 256 * (int64_t)e->n_gather_items);
    for (int j = 0; j < e->n_gathers; j++)   /* every gather read in the micro-step, after its issue */
        assert_true(e->gathers[j].read_from[GATHER_MICRO] >= e->gathers[j].issue_at[GATHER_MICRO] &&
                    e->gathers[j].issue_at[GATHER_MICRO] >= 0);
    /* control 1: a gather never issued leaves its readers without a buffer */
    int issue = e->gathers[1].issue;
    e->gathers[1].issue = g->n_nodes;
    GatherReads r1 = {.quiet = true};
    assert_false(resolve_lists(e, &gp, &r1));
    e->gathers[1].issue = issue;
    /* control 2: the next layer of a phase in the buffer the previous one is still read from */
    int j = 0;
    while (j + 1 < e->n_gathers && e->gathers[j + 1].phase != e->gathers[j].phase) j++;
    assert_true(j + 1 < e->n_gathers);
    int buffer = e->gathers[j + 1].buffer;
    e->gathers[j + 1].buffer = e->gathers[j].buffer;
    GatherReads r2 = {.quiet = true};
    assert_false(resolve_lists(e, &gp, &r2));
    e->gathers[j + 1].buffer = buffer;
    GatherReads r3 = {0};
    assert_true(resolve_lists(e, &gp, &r3));
    rt_gather_plan_free(&gp);
    free(e->lists[LIST_EVAL].l);
    free(e->lists[LIST_MICRO].l);
    close_layout(e, arena);
}

static void test_gathers(void **state) {
    (void)state;
    static const char *const names[] = {"gpt2_tiny_zero3_O0", "gpt2_tiny_zero3_O1", "gpt2_tiny_zero3_O3"};
    for (int k = 0; k < 3; k++)
        for (int world = 2; world <= 3; world++)
            for (int rank = 0; rank < world; rank++) check_gathers(names[k], world, rank);
}

/* Without --shard-states, or on one rank, the device arena is the host's. */
static void test_unsharded(void **state) {
    (void)state;
    Arena *arena = arena_new();
    const char *names[] = {"gpt2_tiny_dp_O1", "gpt2_tiny_zero_O1"};
    for (int k = 0; k < 2; k++) {
        Graph *g = load_graph(arena, names[k]);
        assert_non_null(g);
        RtMemory mem;
        assert_true(rt_memory_bind(g, &mem));
        CudaExec *e = calloc(1, sizeof *e);
        e->g = g;
        e->host = mem;
        assert_int_equal(exec_shard_layout(e, k ? 1 : 2, 0), mem.persistent_bytes);
        assert_false(e->shard);
        exec_shard_close(e);
        free(e);
        rt_memory_free(&mem);
    }
    arena_free(arena);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_layout), cmocka_unit_test(test_update_launches),
                                       cmocka_unit_test(test_grad_buffers), cmocka_unit_test(test_gathers),
                                       cmocka_unit_test(test_unsharded)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
