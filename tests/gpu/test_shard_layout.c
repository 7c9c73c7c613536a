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
 * accumulators cut too, and the bucket buffers the backward writes in. What the host cannot show (the kernels over their shards,
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

static void check_graph(const char *name) {
    Arena *arena = arena_new();
    Graph *g = load_graph(arena, name);
    assert_non_null(g);
    RtMemory mem;
    assert_true(rt_memory_bind(g, &mem));
    MemSummary m;
    memplan_summarize(g, &m);
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
    Graph *g = load_graph(arena, name);
    assert_non_null(g);
    RtMemory mem;
    assert_true(rt_memory_bind(g, &mem));
    MemSummary m;
    memplan_summarize(g, &m);
    RtShardPlan sp;
    rt_shard_plan(g, m.by_role, world, &sp);
    assert_int_equal(sp.stage, 2);
    CudaExec *e = calloc(1, sizeof *e);
    assert_non_null(e);
    e->g = g;
    e->host = mem;
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
    exec_grads_close(e);
    exec_shard_close(e);
    free(e);
    rt_memory_free(&mem);
    arena_free(arena);
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
 * scale, and each SQNORM reads the shard of its gradient. */
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
                                       cmocka_unit_test(test_grad_buffers), cmocka_unit_test(test_unsharded)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
