/* exec_grads.c — the executor's sharded gradients (fp8c build --gpus N --shard-states=2).
 *
 * Stage 2 on top of exec_shard.c's stage 1: the device's persistent arena keeps only this
 * rank's shard of each gradient accumulator (exec_shard_layout cuts the rest, as it cuts the
 * states), and the backward writes its gradients into bucket buffers instead, which lie in the
 * step allocation after the workspace. runtime/comm_grads.c has the reasons, the order of the
 * sums and the placement of the buffers (rt_grad_slots); this file runs them.
 *
 * Addresses. Every launch of the micro-step list is resolved while e->map_grads is set:
 * a host address inside an accumulator then maps into the accumulator's place in its
 * bucket's buffer (exec_grads_map), so the GEMM epilogues and kernels that accumulate write
 * there, unchanged. The update list, the finite checks, the pushes and pulls are resolved
 * without it and see the persistent shard.
 *
 * A micro-step (every micro-step: each one is reduced) runs exec_comm.c's overlapped list with
 * two things added:
 *   - where a bucket's first write comes (bucket_open: before the launches of the first node
 *     whose launches write one of its accumulators, or of the graph's own earlier bound), the
 *     bucket opens: the executor's stream waits for the reduction of the buffer's previous
 *     bucket of this micro-step (an event recorded on NCCL's stream), zeroes the bucket's part
 *     of the buffer, and copies this rank's shard accumulators into their ranges, so that its
 *     backward adds its gradient to its running sum;
 *   - where the bucket leaves (exec_comm.c's bucket_at), each gradient goes as one ncclReduce
 *     per shard from the buffer to the owner's shard accumulator (a group), and the buffer's
 *     event is recorded after it.
 * The micro-step is captured in a CUDA graph from its second run on, like stage 1's last one.
 * The update zeroes each shard accumulator as it reads it (the update kernel's own zeroing),
 * so the next step's first micro-step starts from zero. */
#include <stdlib.h>
#include <string.h>

#include "exec_internal.h"

/* The persistent accumulator (STATE node) behind a gradient's ALL_REDUCE. */
static const Node *accumulator(const Node *reduce) {
    const Node *a = reduce->in[0];
    while (a->op == OP_ACCUMULATE || a->op == OP_ALL_REDUCE) a = a->in[0];
    return a;
}

static const Node *update_reading(const Graph *g, const Node *reduce) {
    for (int i = 0; i < g->n_nodes; i++)
        if (ir_op_is_update(g->nodes[i]->op) && g->nodes[i]->in[1] == reduce) return g->nodes[i];
    return NULL;
}

/* Each bucket's first write and the node after which it is sent, as node positions: the
 * earlier of the launch plans' first touch and the graph's own bound (rt_grad_bucket_span),
 * and exec_comm.c's roots. */
static bool bucket_span(CudaExec *e, const RtCommPlan *cp, int *open, int *sent) {
    Graph *g = e->g;
    rt_grad_bucket_span(g, cp, open, sent);
    if (!cuda_comm_bucket_roots(g, e->plans, cp, sent)) return false;
    for (int b = 0; b < cp->n_buckets; b++) {
        const RtBucket *k = &cp->buckets[b];
        for (int j = 0; j < open[b]; j++) {
            if (g->nodes[j]->phase == PHASE_UPDATE || !e->plans[j].n_launch) continue;
            bool writes = false;
            for (int i = k->first; i < k->first + k->count && !writes; i++)
                writes = exec_plan_touches(&e->plans[j], g->nodes[j], accumulator(cp->reduce[i]));
            if (writes) {
                open[b] = j;
                break;
            }
        }
        if (sent[b] < 0) sent[b] = open[b];   /* no launch writes it: it leaves where it opens */
    }
    return true;
}

int64_t exec_grads_layout(CudaExec *e) {
    Graph *g = e->g;
    e->shard_grads = e->shard && rt_shard_stage(g) >= 2;
    if (!e->shard_grads) return 0;
    RtCommPlan cp;
    if (!rt_comm_plan(g, &cp)) goto oom;
    int nb = cp.n_buckets ? cp.n_buckets : 1;
    int *open = malloc(sizeof *open * (size_t)nb), *sent = malloc(sizeof *sent * (size_t)nb);
    e->grads = calloc((size_t)(cp.n_reduce ? cp.n_reduce : 1), sizeof *e->grads);
    e->open_node = calloc((size_t)nb, sizeof *e->open_node);
    bool ok = open && sent && e->grads && e->open_node && bucket_span(e, &cp, open, sent) &&
              rt_grad_slots(&cp, open, sent, &e->grad_slots);
    for (int b = 0; ok && b < cp.n_buckets; b++) e->open_node[b] = open[b];
    for (int i = 0; ok && i < cp.n_reduce; i++) {
        const Node *r = cp.reduce[i], *u = update_reading(g, r), *acc = accumulator(r);
        ExecGrad *x = &e->grads[i];
        int b = 0;
        while (b + 1 < cp.n_buckets && cp.buckets[b + 1].first <= i) b++;
        x->bucket = b;
        x->at = (const char *)acc->t.data - (const char *)e->host.persistent;
        x->eb = fmt_elem_bytes(acc->t.fmt.elem);
        x->bytes = ir_numel(&acc->t) * x->eb;
        x->elem = acc->t.fmt.elem;
        x->buf_at = e->grad_slots.slot_at[e->grad_slots.slot[b]] + e->grad_slots.at[i];
        if (!u) {
            rt_error("CUDA executor: --shard-states=2: the gradient of '%s' feeds no update",
                     r->grad_of && r->grad_of->t.name ? r->grad_of->t.name : "unnamed");
            ok = false;
            break;
        }
        x->n = ir_numel(&acc->t);
        x->group = rt_shard_group(u);
        IR_ASSERT(x->at >= 0 && x->at + x->bytes <= e->host.persistent_bytes);
    }
    e->n_grads = ok ? cp.n_reduce : 0;
    free(open);
    free(sent);
    rt_comm_plan_free(&cp);
    if (!ok) return -1;
    return e->grad_slots.bytes;
oom:
    rt_error("out of memory");
    return -1;
}

bool exec_grads_map(const CudaExec *e, int64_t off, CUdeviceptr *out) {
    if (!e->map_grads) return false;
    for (int i = 0; i < e->n_grads; i++) {
        const ExecGrad *x = &e->grads[i];
        if (off >= x->at && off < x->at + x->bytes) {
            *out = e->grad_buf + (CUdeviceptr)(x->buf_at + (off - x->at));
            return true;
        }
    }
    return false;
}

bool exec_grads_open(CudaExec *e, const int *micro_end) {
    if (!e->shard_grads) return true;
    if (!e->overlap || !e->bucket_at) {
        rt_error("CUDA executor: --shard-states=2 reduces each bucket while the backward runs, which "
                 "this run does not (FP8C_TUNE_GEMMS times the GEMMs without the reductions)");
        return false;
    }
    int nb = e->comm.n_buckets;
    e->bucket_open = malloc(sizeof *e->bucket_open * (size_t)(nb ? nb : 1));
    e->slot_sent = calloc((size_t)(e->grad_slots.n_slots ? e->grad_slots.n_slots : 1), sizeof *e->slot_sent);
    e->slot_busy = calloc((size_t)(e->grad_slots.n_slots ? e->grad_slots.n_slots : 1), sizeof *e->slot_busy);
    if (!e->bucket_open || !e->slot_sent || !e->slot_busy) return false;
    for (int b = 0; b < nb; b++) {
        int j = e->open_node[b];
        e->bucket_open[b] = j > 0 ? micro_end[j - 1] : 0;   /* before node j's launches */
        if (e->bucket_open[b] > e->bucket_at[b]) e->bucket_open[b] = e->bucket_at[b];
    }
    for (int k = 0; k < e->grad_slots.n_slots; k++)
        if (!CU_CHECK(CU(cuEventCreate)(&e->slot_sent[k], CU_EVENT_DISABLE_TIMING))) return false;
    for (int i = 0; i < e->n_grads; i++) {
        ExecGrad *x = &e->grads[i];
        RtShard s = rt_shard_of(x->n, x->group, e->shard_world, e->shard_rank);
        x->mine = s;
        Tensor probe = {.name = "a shard accumulator"};
        probe.data = (char *)e->host.persistent + x->at + s.off * x->eb;
        probe.rank = 1;
        probe.dims[0] = s.len;
        if (s.len && !exec_map_tensor(e, &probe, &x->shard)) return false;
    }
    return true;
}

/* Bucket b's buffer, before its first write: free of its previous bucket, zero, and this
 * rank's running sums in its own ranges. */
bool exec_grads_open_bucket(CudaExec *e, int b) {
    int k = e->grad_slots.slot[b];
    bool ok = true;
    if (e->slot_busy[k]) ok = CU_CHECK(CU(cuStreamWaitEvent)(e->stream, e->slot_sent[k], 0));
    e->slot_busy[k] = true;
    const RtBucket *kb = &e->comm.buckets[b];
    const ExecGrad *first = &e->grads[kb->first], *last = &e->grads[kb->first + kb->count - 1];
    int64_t bytes = last->buf_at + last->bytes - first->buf_at;
    ok = ok && CU_CHECK(CU(cuMemsetD8Async)(e->grad_buf + (CUdeviceptr)first->buf_at, 0, (size_t)bytes, e->stream));
    for (int i = kb->first; ok && i < kb->first + kb->count; i++) {
        const ExecGrad *x = &e->grads[i];
        if (x->mine.len)
            ok = CU_CHECK(CU(cuMemcpyDtoDAsync_v2)(e->grad_buf + (CUdeviceptr)(x->buf_at + x->mine.off * x->eb),
                                                   x->shard, (size_t)(x->mine.len * x->eb), e->stream));
    }
    return ok;
}

/* reduce[first .. first+count) (one bucket): each shard from the buffers to its owner's shard
 * accumulator, one group; then the buffer's event. */
bool exec_grads_reduce(CudaExec *e, int first, int count, CUstream stream) {
    if (!cuda_nccl_group(true)) return false;
    bool ok = true;
    for (int i = first; ok && i < first + count; i++) {
        const ExecGrad *x = &e->grads[i];
        CUdeviceptr buf = e->grad_buf + (CUdeviceptr)x->buf_at;
        for (int q = 0; ok && q < e->shard_world; q++) {
            RtShard s = rt_shard_of(x->n, x->group, e->shard_world, q);
            if (!s.len) continue;
            CUdeviceptr send = buf + (CUdeviceptr)(s.off * x->eb);
            ok = cuda_nccl_reduce_sum_to(send, q == e->shard_rank ? x->shard : send, s.len, x->elem, q, stream);
        }
    }
    ok = cuda_nccl_group(false) && ok;
    if (ok && count) ok = CU_CHECK(CU(cuEventRecord)(e->slot_sent[e->grad_slots.slot[e->grads[first].bucket]], stream));
    return ok;
}

bool exec_grads_restrict_check(CudaExec *e, const Tensor *t, CkTensor *a) {
    int64_t at = (const char *)t->data - (const char *)e->host.persistent;
    for (int i = 0; i < e->n_grads; i++) {
        const ExecGrad *x = &e->grads[i];
        if (x->at != at) continue;
        a->p = (void *)(uintptr_t)x->shard;
        a->n = x->mine.len;
        a->rows = 1;
        a->cols = x->mine.len;
        return true;
    }
    rt_error("CUDA executor: --shard-states=2: '%s' is checked for non-finite values, and no update reads it",
             t->name ? t->name : "unnamed");
    return false;
}

void exec_grads_begin(CudaExec *e) {
    if (e->shard_grads) memset(e->slot_busy, 0, sizeof *e->slot_busy * (size_t)e->grad_slots.n_slots);
}

void exec_grads_close(CudaExec *e) {
    for (int k = 0; e->slot_sent && k < e->grad_slots.n_slots; k++)
        if (e->slot_sent[k]) CU(cuEventDestroy_v2)(e->slot_sent[k]);
    free(e->slot_sent);
    free(e->slot_busy);
    free(e->bucket_open);
    free(e->open_node);
    free(e->grads);
    rt_grad_slots_free(&e->grad_slots);
}
