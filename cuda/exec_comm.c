/* exec_comm.c — the executor's gradient reduction: NCCL sums, overlapped with the backward.
 *
 * A data-parallel step sums every gradient accumulator over the ranks (the graph's ALL_REDUCE
 * nodes, passes/comm.c) in buckets (runtime/comm_buckets.c: runs of gradients in the order the
 * backward finishes them, about 25 MiB each). With the choice comm.overlap on (the default)
 * the last micro-step of a step runs its own list: the micro-step's launches, with each
 * bucket's sums enqueued on a stream of their own (NCCL's) at the place where the bucket's last
 * accumulator is written. An event recorded on the executor's stream there, and waited on by
 * NCCL's stream, orders the bucket after its accumulations and before nothing else, so NCCL
 * moves the last layers' gradients while the first layers' backward still runs; a last event,
 * recorded on NCCL's stream at the end and waited on by the executor's, makes everything
 * after the micro-step (the gradient check, the update) wait for every bucket. The earlier
 * micro-steps of a step (--grad-accum) run the plain list: their accumulators are not final.
 *
 * The list is captured in a CUDA graph like the others, from its second run on: NCCL (2.9 and
 * later) can be captured, and a capture may fork to another stream and join back through
 * events, but NCCL's first collectives of a size set up connections, which must not run
 * inside a capture, so the first run launches directly. Where a bucket's accumulator is
 * written is read from the launch plans, not the node order: an accumulation that a GEMM's
 * epilogue or a quantize's bias-gradient fusion does runs where that launch runs, which may
 * be after the ACCUMULATE node's own place.
 *
 * The sums are the same bits either way and every run: the same buckets, each gradient its
 * own ncclAllReduce in the same order, on the same ranks. comm.overlap=0 (fp8c build
 * --choice) keeps the sums at the start of the update, one NCCL group, for comparison. With
 * --shard-states each gradient's sum goes to its shards' owners instead (exec_shard.c), in
 * the same buckets at the same places; with --shard-states=2 from bucket buffers that this
 * list opens before their first writes, and in every micro-step (exec_grads.c).
 *
 * With comm:grad=e5m2 (or e4m3) a bucket is not summed by NCCL but reduced in FP8
 * (runtime/comm_fp8.c: amax, shared scale, quantize, all-to-all of shards, sum in rank order,
 * second scale, all-gather): five kernels of kernels/comm.cuh and four collectives, all
 * enqueued on the same stream where NCCL's sum would be (NCCL's own with overlap), so the
 * reduction overlaps with the backward exactly as the sums do. Its buffers (codes sent,
 * received and gathered, the summed shard, the maxima) are one device allocation sized for the
 * largest bucket and shared by all buckets, which run one after another on that stream; the
 * last-block ticket and block maxima are the reduction's own, since its kernels run beside
 * the backward's. Every rank decodes the same gathered bytes, so the ranks stay equal. */
#include <stdlib.h>
#include <string.h>

#include "exec_internal.h"

static bool exec_fp8_open(CudaExec *e);

/* Whether plan p's launches compute node n (its own node, an epilogue's member, or work a
 * launch absorbed). */
static bool plan_computes(const CuNodePlan *p, const Node *own, const Node *n) {
    if ((p->node ? p->node : own) == n) return true;
    for (int k = 0; k < p->n_members; k++)
        if (p->members[k] == n) return true;
    for (int k = 0; k < p->n_absorbed; k++)
        if (p->absorbed[k] == n) return true;
    return false;
}

/* Whether a node that plan p's launches compute, or one of its operands, shares bytes with
 * the accumulator acc: the launches then read or write what NCCL is summing in place. */
bool exec_plan_touches(const CuNodePlan *p, const Node *own, const Node *acc) {
    const Node *nodes[2 + 16];
    int n = 0;
    nodes[n++] = p->node ? p->node : own;
    for (int k = 0; k < p->n_members && n < 16; k++) nodes[n++] = p->members[k];
    for (int k = 0; k < p->n_absorbed && n < 16; k++) nodes[n++] = p->absorbed[k];
    for (int k = 0; k < n; k++) {
        if (fuse_nodes_overlap(nodes[k], acc)) return true;
        for (int i = 0; i < nodes[k]->n_in; i++)
            if (fuse_nodes_overlap(nodes[k]->in[i], acc)) return true;
    }
    return false;
}

bool cuda_comm_bucket_roots(const Graph *g, const CuNodePlan *plans, const RtCommPlan *cp, int *root) {
    int last_micro = -1;
    for (int j = 0; j < g->n_nodes; j++)
        if (g->nodes[j]->phase != PHASE_UPDATE && plans[j].n_launch) last_micro = j;
    for (int b = 0; b < cp->n_buckets; b++) {
        const RtBucket *k = &cp->buckets[b];
        int at = b ? root[b - 1] : -1;   /* in order: a bucket never leaves before the one before it */
        for (int i = k->first; i < k->first + k->count; i++) {
            const Node *acc = cp->reduce[i]->in[0];
            int found = -1;
            for (int j = 0; j < g->n_nodes; j++)
                if (g->nodes[j]->phase != PHASE_UPDATE && plans[j].n_launch &&
                    plan_computes(&plans[j], g->nodes[j], acc))
                    found = j;
            if (found < 0) found = last_micro;   /* not found: after the whole backward */
            if (found > at) at = found;
        }
        /* and after any later launch that still reads or writes one of its accumulators (none
         * in the graphs the compiler makes: the ACCUMULATE is the last to touch its state in
         * the micro-step; this keeps a future fusion from racing with NCCL) */
        for (int j = last_micro; j > at; j--) {
            if (g->nodes[j]->phase == PHASE_UPDATE || !plans[j].n_launch) continue;
            bool touches = false;
            for (int i = k->first; i < k->first + k->count && !touches; i++)
                touches = exec_plan_touches(&plans[j], g->nodes[j], cp->reduce[i]->in[0]);
            if (touches) {
                at = j;
                break;
            }
        }
        root[b] = at;
    }
    return true;
}

bool exec_comm_open(CudaExec *e, const int *micro_end) {
    Graph *g = e->g;
    if (!cuda_nccl_active()) return true;
    if (!rt_comm_plan(g, &e->comm)) {
        rt_error("out of memory");
        return false;
    }
    /* the sums in the order they are sent (the buckets'), each one tensor */
    e->reduce = calloc((size_t)(e->comm.n_reduce ? e->comm.n_reduce : 1), sizeof *e->reduce);
    if (!e->reduce) return false;
    for (int i = 0; i < e->comm.n_reduce; i++) {
        const Node *n = e->comm.reduce[i];
        ExecReduce *r = &e->reduce[i];
        r->node = n;
        r->count = ir_numel(&n->t);
        r->elem = n->t.fmt.elem;
        if (!exec_map_tensor(e, &n->t, &r->p)) return false;
    }
    e->n_reduce = e->comm.n_reduce;
    if (e->n_reduce && e->comm.wire != FMT_VOID && !exec_fp8_open(e)) return false;
    e->overlap = e->n_reduce && rt_comm_overlap(g) && !e->tune_report;
    if (!e->overlap) return true;
    int *root = malloc(sizeof *root * (size_t)e->comm.n_buckets);
    e->bucket_at = malloc(sizeof *e->bucket_at * (size_t)e->comm.n_buckets);
    if (!root || !e->bucket_at) {
        free(root);
        return false;
    }
    cuda_comm_bucket_roots(g, e->plans, &e->comm, root);
    for (int b = 0; b < e->comm.n_buckets; b++)
        e->bucket_at[b] = root[b] >= 0 ? micro_end[root[b]] : 0;
    free(root);
    return CU_CHECK(CU(cuStreamCreate)(&e->comm_stream, CU_STREAM_NON_BLOCKING)) &&
           CU_CHECK(CU(cuEventCreate)(&e->comm_ready, CU_EVENT_DISABLE_TIMING)) &&
           CU_CHECK(CU(cuEventCreate)(&e->comm_done, CU_EVENT_DISABLE_TIMING));
}

void exec_comm_close(CudaExec *e) {
    if (e->last.exec) CU(cuGraphExecDestroy)(e->last.exec);
    if (e->last.graph) CU(cuGraphDestroy)(e->last.graph);
    if (e->comm_stream) CU(cuStreamSynchronize)(e->comm_stream);
    if (e->comm_ready) CU(cuEventDestroy_v2)(e->comm_ready);
    if (e->comm_done) CU(cuEventDestroy_v2)(e->comm_done);
    if (e->comm_stream) CU(cuStreamDestroy_v2)(e->comm_stream);
    if (e->comm_mem) CU(cuMemFree_v2)(e->comm_mem);
    free(e->comm_args);
    free(e->bucket_at);
    free(e->reduce);
    rt_comm_plan_free(&e->comm);
}

/* ---------------------------------------------------------------- the FP8 reduction */

/* Sets up the FP8 reduction: the kernels' functions, the buffers, each bucket's segments
 * (its accumulators, as one array) and argument block. */
static bool exec_fp8_open(CudaExec *e) {
    const RtCommPlan *cp = &e->comm;
    const Node *first = cp->reduce[0];
    int ranks = cuda_nccl_world(), rank = cuda_nccl_rank();
    CuNodePlan plan;
    if (!cuda_plan_comm(first, e->arena, &plan)) {
        rt_error("CUDA executor: no FP8 reduction for a wire of %s",
                 fmt_elem_name((ElemType)IR_IATTR(first, ALL_REDUCE, wire)));
        return false;
    }
    for (int k = 0; k < COMM_KERNELS; k++)
        if (!exec_get_function(e, first, plan.launch[k].fn, 0, &e->comm_fn[k])) return false;
    int64_t shard = 0;
    for (int b = 0; b < cp->n_buckets; b++) {
        int64_t s = rt_comm_fp8_shard(cp->buckets[b].elems, ranks);
        if (s > shard) shard = s;
    }
    /* [amax: 2 f32, ticket at 64][block maxima][segments][sums: shard f32][send][recv][gather] */
    int64_t wire = fmt_elem_bytes(cp->wire);
    int64_t at_parts = ALIGN, at_segs = at_parts + align_up(COMM_MAX_BLOCKS * (int64_t)sizeof(float));
    int64_t at_sums = at_segs + align_up(cp->n_reduce * (int64_t)sizeof(CkSegment));
    int64_t at_send = at_sums + align_up(shard * (int64_t)sizeof(float));
    int64_t codes = align_up(ranks * shard * wire);
    int64_t at_recv = at_send + codes, at_gather = at_recv + codes;
    e->comm_mem_bytes = at_gather + codes;
    CkSegment *segs = calloc((size_t)cp->n_reduce, sizeof *segs);
    e->comm_args = calloc((size_t)cp->n_buckets, sizeof *e->comm_args);
    if (!segs || !e->comm_args) {
        free(segs);
        rt_error("out of memory");
        return false;
    }
    if (CU(cuMemAlloc_v2)(&e->comm_mem, (size_t)e->comm_mem_bytes) != CUDA_SUCCESS) {
        e->comm_mem = 0;
        free(segs);
        rt_error("the FP8 gradient reduction (comm:grad=%s) needs %.1f MiB more on the GPU for "
                 "its buffers, which it does not have", fmt_elem_name(cp->wire),
                 (double)e->comm_mem_bytes / (1 << 20));
        return false;
    }
    CUdeviceptr m = e->comm_mem;
    bool ok = true;
    for (int b = 0; ok && b < cp->n_buckets; b++) {
        const RtBucket *k = &cp->buckets[b];
        int64_t start = 0;
        for (int i = k->first; i < k->first + k->count; i++) {
            const ExecReduce *r = &e->reduce[i];
            if (r->elem != FMT_F32 && r->elem != FMT_BF16 && r->elem != FMT_F16) {
                rt_error("CUDA executor: the FP8 reduction reads f32, bf16 or f16 gradients, not %s",
                         fmt_elem_name(r->elem));
                ok = false;
                break;
            }
            segs[i] = (CkSegment){(void *)(uintptr_t)r->p, start, r->count, (int)r->elem, 0};
            start += r->count;
        }
        CkArgs *a = &e->comm_args[b];
        a->t[0].p = (void *)(uintptr_t)(m + (CUdeviceptr)at_segs + (CUdeviceptr)(k->first * (int64_t)sizeof(CkSegment)));
        a->t[1].p = (void *)(uintptr_t)(m + (CUdeviceptr)at_send);
        a->t[2].p = (void *)(uintptr_t)(m + (CUdeviceptr)at_recv);
        a->t[3].p = (void *)(uintptr_t)(m + (CUdeviceptr)at_sums);
        a->t[4].p = (void *)(uintptr_t)(m + (CUdeviceptr)at_gather);
        a->t[5].p = (void *)(uintptr_t)m;
        a->i[0] = k->count;
        a->i[1] = k->elems;
        a->i[2] = rt_comm_fp8_shard(k->elems, ranks);
        a->i[3] = ranks;
        a->i[4] = rank;
        a->f[0] = plan.launch[COMM_QUANTIZE].args.f[0];
        a->scratch = (void *)(uintptr_t)(m + (CUdeviceptr)at_parts);
        a->ticket = (unsigned *)(uintptr_t)(m + 64);
    }
    ok = ok && CU_CHECK(CU(cuMemsetD8Async)(m, 0, (size_t)e->comm_mem_bytes, e->stream)) &&
         CU_CHECK(CU(cuStreamSynchronize)(e->stream)) &&
         CU_CHECK(CU(cuMemcpyHtoD_v2)(m + (CUdeviceptr)at_segs, segs, sizeof *segs * (size_t)cp->n_reduce));
    free(segs);
    return ok;
}

/* One kernel of the FP8 reduction over `items` elements (a grid-stride loop, at most
 * COMM_MAX_BLOCKS blocks: the block maxima's slots). */
static bool comm_launch(CudaExec *e, int kernel, const CkArgs *a, int64_t items, CUstream stream) {
    int64_t blocks = (items + 4 * COMM_THREADS - 1) / (4 * COMM_THREADS);
    blocks = blocks < 1 ? 1 : blocks > COMM_MAX_BLOCKS ? COMM_MAX_BLOCKS : blocks;
    void *params[] = {(void *)a};
    return CU_CHECK(CU(cuLaunchKernel)(e->comm_fn[kernel], (unsigned)blocks, 1, 1, COMM_THREADS, 1, 1, 0,
                                       stream, params, NULL));
}

/* Bucket b reduced in FP8 on `stream`: runtime/comm_fp8.c's steps, in its order. */
static bool exec_fp8_bucket(CudaExec *e, int b, CUstream stream) {
    const CkArgs *a = &e->comm_args[b];
    int64_t elems = a->i[1], shard = a->i[2];
    CUdeviceptr amax = (CUdeviceptr)(uintptr_t)a->t[5].p;
    return comm_launch(e, COMM_AMAX, a, elems, stream) &&
           cuda_nccl_all_reduce_max_f32(amax, 1, stream) &&
           comm_launch(e, COMM_QUANTIZE, a, elems, stream) &&
           cuda_nccl_all_to_all_bytes((CUdeviceptr)(uintptr_t)a->t[1].p, (CUdeviceptr)(uintptr_t)a->t[2].p,
                                      shard, stream) &&
           comm_launch(e, COMM_SUM, a, shard, stream) &&
           cuda_nccl_all_reduce_max_f32(amax + sizeof(float), 1, stream) &&
           comm_launch(e, COMM_REQUANTIZE, a, shard, stream) &&
           cuda_nccl_all_gather_bytes((CUdeviceptr)(uintptr_t)a->t[4].p, shard, stream) &&
           comm_launch(e, COMM_UNPACK, a, elems, stream);
}

/* ---------------------------------------------------------------- the buckets */

/* reduce[first .. first+count) summed over the ranks on `stream`, as one NCCL group */
static bool exec_sum_group(CudaExec *e, int first, int count, CUstream stream) {
    if (e->shard_grads) return exec_grads_reduce(e, first, count, stream);   /* from the buffers */
    if (e->shard) return exec_shard_reduce(e, first, count, stream);   /* to each shard's owner */
    if (!cuda_nccl_group(true)) return false;
    bool ok = true;
    for (int i = first; ok && i < first + count; i++)
        ok = cuda_nccl_all_reduce_sum(e->reduce[i].p, e->reduce[i].count, e->reduce[i].elem, stream);
    return cuda_nccl_group(false) && ok;
}

bool exec_run_reduce(CudaExec *e) {
    if (e->n_reduce && e->comm.wire != FMT_VOID) {
        bool ok = true;
        for (int b = 0; ok && b < e->comm.n_buckets; b++) ok = exec_fp8_bucket(e, b, e->stream);
        return ok;
    }
    return !e->n_reduce || exec_sum_group(e, 0, e->n_reduce, e->stream);
}

/* Bucket b on NCCL's stream, after everything the executor's stream has enqueued so far. */
static bool exec_send_bucket(CudaExec *e, int b) {
    const RtBucket *k = &e->comm.buckets[b];
    return CU_CHECK(CU(cuEventRecord)(e->comm_ready, e->stream)) &&
           CU_CHECK(CU(cuStreamWaitEvent)(e->comm_stream, e->comm_ready, 0)) &&
           (e->comm.wire != FMT_VOID ? exec_fp8_bucket(e, b, e->comm_stream)
                                     : exec_sum_group(e, k->first, k->count, e->comm_stream));
}

/* The micro-step's launches with the buckets between them, then the join. With
 * --shard-states=2 each bucket's buffer is opened before its first write (exec_grads.c); with
 * =3 the layers' gathers are issued and waited for between the launches too (exec_gather.c). */
static bool exec_launch_last(CudaExec *e, void *unused) {
    (void)unused;
    ExecList *L = &e->lists[LIST_MICRO];
    bool ok = true;
    int b = 0;
    exec_grads_begin(e);
    for (int i = 0; ok && i <= L->n; i++) {
        for (; ok && b < e->comm.n_buckets && e->bucket_at[b] <= i; b++) ok = exec_send_bucket(e, b);
        for (int o = 0; ok && e->shard_grads && o < e->comm.n_buckets; o++)
            if (e->bucket_open[o] == i) ok = exec_grads_open_bucket(e, o);
        if (ok && i < L->n) ok = exec_gather_before(e, GATHER_MICRO, i) && exec_launch(e, &L->l[i]);
    }
    return ok && CU_CHECK(CU(cuEventRecord)(e->comm_done, e->comm_stream)) &&
           CU_CHECK(CU(cuStreamWaitEvent)(e->stream, e->comm_done, 0));
}

static bool exec_run_last(CudaExec *e) {
    ExecList *G = &e->last;
    if (!e->graphs || e->sync_each || e->profile || !e->last_warm) {
        e->last_warm = true;   /* NCCL has set up its connections for these sizes */
        return exec_launch_last(e, NULL);
    }
    return exec_replay(e, G, exec_launch_last, NULL);
}

bool cuda_exec_run_last_micro_step(CudaExec *e) {
    if (!e->overlap) return cuda_exec_run_micro_step(e);
    e->touched++;   /* the gradients change (cuda_exec_all_finite) */
    cuda_nccl_arm("the last micro-step with its gradient all-reduce");
    bool ok = exec_run_last(e) && exec_finish(e, "micro-step");
    cuda_nccl_disarm();
    e->reduced = ok;
    return ok;
}

int cuda_exec_buckets(const CudaExec *e) { return e->overlap ? e->comm.n_buckets : 0; }
