/* exec_gather.c — the executor's sharded weights (fp8c build --gpus N --shard-states=3).
 *
 * Stage 3 on top of exec_grads.c's stage 2: the device's persistent arena keeps only this
 * rank's shard of each weight the GEMMs read, and of its FP8 copy (exec_shard_layout cuts the
 * rest, as it cuts the states), and the step gathers each layer's weights into a layer buffer
 * while it runs. runtime/comm_weights.c plans what is gathered, when and into which buffer
 * (rt_gather_plan: per phase, layer k issued at layer k-1's first reader, the buffers taken
 * greedily); this file runs that plan.
 *
 * What travels. A weight's shards are its update's (rt_shard_of over the update's group), so
 * they are not the equal contiguous pieces ncclAllGather wants: a gather is one NCCL group
 * holding a broadcast per shard, from its owner into the shard's place in the buffer, as
 * stage 1 broadcasts the new weights. At -O1/-O2 the update's e4m3 copies travel (their
 * delayed scale already agreed by the update's amax all-reduce), at -O0 the bf16 weights,
 * from the owners' persistent shards. At -O3 the forward quantizes each weight per tensor to
 * e4m3 with the scale of its current amax; that quantize's result is gathered in e4m3: on
 * NCCL's stream, each rank finds its shard's amax (ck_gather_amax), an all-reduce (max) of
 * that one f32 gives every rank the whole tensor's amax, the scale follows as QUANT_SCALE
 * stores it (ck_gather_scale), each owner quantizes its shard into its place in the buffer
 * with the step's own quantize kernel, and the codes are broadcast. A maximum does not depend
 * on the split and quantizing is elementwise, so the buffer holds the unsharded quantize's
 * bytes. The QUANT_SCALE's place in the list copies the gathered scale into its result, and
 * the QUANTIZE's launch stays in the list cut to no elements: block 0 still writes the
 * inverse scales that fold_inverse_scales gave it for the GEMMs. The scale is computed in the
 * gather area, not in the QUANT_SCALE's result, whose bytes the memory plan may still lend to
 * another tensor at the prefetch. The backward quantizes again with the forward's scale (as
 * one GPU does), and its quantizes write the layouts the backward's GEMMs read: both at once
 * (transposed=1), or the copy and its transpose in one cast-transpose launch. Neither can be
 * made of row-major shards without a transpose kernel, so the backward gathers the bf16
 * weight (the plan's e4m3 bytes twice) and runs the step's own quantize on it, with the
 * gathered scale; so does a forward quantize whose launch does more than quantize (a
 * cast-transpose that also writes the transposed copy, as GPT-2 d12's c_fc and c_proj have).
 *
 * Addresses. The lists that run gathers (evaluation: the forward; the micro-step: forward and
 * backward) are resolved with e->gather_list set: a host address inside a gathered tensor
 * then maps into the buffer of the gather that holds it for the node being resolved (the
 * latest gather of its layer issued in that node's phase), so every GEMM, transpose and
 * quantize reads the buffer, unchanged, as stage 2's backward writes bucket buffers. While
 * resolving, each gather notes the first and last launch that read it; exec_gather_check then
 * refuses a plan that would read a gathered tensor outside its gather or hand a buffer to the
 * next gather before the previous one's last reader (the plan's windows are node positions,
 * and a GEMM epilogue runs at its group's last node).
 *
 * Running. Before launch i of a list: each gather issued there records an event on the
 * executor's stream, and NCCL's stream (exec_comm.c's) waits for it, so the gather follows
 * every launch before it, among them the last reader of what its buffer held; then its
 * kernels and collectives, then its own event; and before the first launch that reads a
 * gather the executor's stream waits for that event. So layer k's gather runs while layer k-1
 * computes. The gather's kernels have a last-block ticket and block maxima of their own (they
 * run beside the step's). At the end of the list NCCL's stream is joined back (exec_comm.c's
 * comm_done). The lists are captured in CUDA graphs from their second run on, the first one
 * setting up NCCL's connections outside any capture.
 *
 * The update writes each rank's shard of the weight and copy (stage 1's restricted launches);
 * no broadcast follows for gathered weights (exec_shard.c skips them), since the next step
 * gathers them. Checkpoints: the weights and copies are sharded tensors of exec_shard.c, so
 * cuda_exec_gather sends their shards to rank 0's mirror, and pushes copy each rank's shard. */
#include <stdlib.h>
#include <string.h>

#include "exec_internal.h"

/* the gather area after the buffers: the gather kernels' ticket, their block maxima, then
 * each e4m3 item's amax and scale */
enum { GATHER_TICKET = 0, GATHER_PARTS = 256, GATHER_SCALARS = GATHER_PARTS + 8 * 1024 };

/* The forward's e4m3 quantize of weight w that a gather may carry as codes (its QUANT_SCALE,
 * else NULL): per tensor, its scale a QUANT_SCALE of w, one layout, the quantize's and the
 * QUANT_SCALE's plans their own, the quantize's one kernel; every reader reads the quantize
 * itself (no view of it). */
static const Node *e4m3_scale(const CudaExec *e, const RtGatherItem *it, const Node *w) {
    const Node *q = it->target, *qs = q->op == OP_QUANTIZE && q->n_in == 2 ? q->in[1] : NULL;
    if (!qs || it->phase != PHASE_FORWARD || qs->op != OP_QUANT_SCALE || qs->in[0] != w || q->in[0] != w ||
        IR_IATTR(qs, QUANT_SCALE, scaling) != SCALE_PER_TENSOR || q->t.fmt.scaling != SCALE_PER_TENSOR ||
        q->t.fmt.elem != FMT_E4M3 || ir_transposed_offset(q) || ir_amax_parts_offset(q) || !e->plans)
        return NULL;
    const CuNodePlan *pq = &e->plans[q->index], *ps = &e->plans[qs->index];
    if (pq->n_launch != 1 || pq->launch[0].kind != CU_KERNEL || pq->members || pq->alone || pq->n_absorbed ||
        pq->launch[0].ref[0].node != q || pq->launch[0].ref[1].node != w || pq->launch[0].ref[2].node ||
        qs->phase != PHASE_FORWARD || ps->n_launch < 1 || ps->members || ps->alone || ps->n_absorbed)
        return NULL;
    for (int i = 0; i < e->g->n_nodes; i++)
        for (int k = 0; k < e->g->nodes[i]->n_in; k++)
            if (e->g->nodes[i]->in[k] == q && !rt_has_storage(e->g->nodes[i])) return NULL;
    return qs;
}

static bool add_item(CudaExec *e, int *cap, int gather, const Node *t, const Node *w, const Node *scale,
                     const Node *update) {
    for (int k = e->gathers[gather].first_item; k < e->n_gather_items; k++)
        if (e->gather_items[k].tensor == t) return true;   /* one place a gather */
    if (!grow((void **)&e->gather_items, cap, e->n_gather_items, sizeof *e->gather_items)) return false;
    ExecGatherItem *x = &e->gather_items[e->n_gather_items++];
    memset(x, 0, sizeof *x);
    ExecGather *ga = &e->gathers[gather];
    x->gather = gather;
    x->tensor = t;
    x->host = t->t.data;
    x->eb = fmt_elem_bytes(t->t.fmt.elem);
    x->n = ir_numel(&t->t);
    x->bytes = x->n * x->eb;
    x->weight = w;
    x->weight_at = (const char *)w->t.data - (const char *)e->host.persistent;
    x->weight_eb = fmt_elem_bytes(w->t.fmt.elem);
    x->group = rt_shard_group(update);
    x->scale = scale;
    x->scale_at[GATHER_EVAL] = x->scale_at[GATHER_MICRO] = -1;
    int64_t at = x->host - (scale ? (const char *)e->host.step : (const char *)e->host.persistent);
    x->buf_at = align_up(ga->bytes) + at % ALIGN;   /* the host offset's alignment */
    ga->bytes = x->buf_at + x->bytes;
    ga->n_items++;
    IR_ASSERT(ir_numel(&w->t) == x->n && x->weight_at >= 0 && x->weight_at + x->n * x->weight_eb <= e->host.persistent_bytes);
    return true;
}

int64_t exec_gather_layout(CudaExec *e) {
    Graph *g = e->g;
    e->gather_list = -1;
    e->shard_weights = e->shard_grads && rt_shard_stage(g) >= 3;
    if (!e->shard_weights) return 0;
    RtGatherPlan p;
    if (!rt_gather_plan(g, e->shard_world, &p)) goto oom;
    e->gathers = calloc((size_t)(p.n_gathers ? p.n_gathers : 1), sizeof *e->gathers);
    e->gather_slot_at = calloc((size_t)(p.n_buffers ? p.n_buffers : 1), sizeof *e->gather_slot_at);
    int64_t *slot_bytes = calloc((size_t)(p.n_buffers ? p.n_buffers : 1), sizeof *slot_bytes);
    bool ok = e->gathers && e->gather_slot_at && slot_bytes;
    int cap = 0;
    for (int j = 0; ok && j < p.n_gathers; j++) {
        ExecGather *ga = &e->gathers[j];
        ga->phase = p.gathers[j].phase;
        ga->issue = p.gathers[j].issue;
        ga->buffer = p.gathers[j].buffer;
        ga->first_item = e->n_gather_items;
        for (int l = 0; l < GATHER_LISTS; l++) ga->issue_at[l] = ga->read_from[l] = ga->read_to[l] = -1;
        e->n_gathers = j + 1;
        for (int k = 0; ok && k < p.n_items; k++) {
            const RtGatherItem *it = &p.items[k];
            if (it->gather != j) continue;
            const RtGatherWeight *w = &p.weights[it->weight];
            if (it->target->op != OP_QUANTIZE) {   /* a copy or a bf16 weight, as kept */
                ok = add_item(e, &cap, j, it->target, it->target, NULL, w->update);
                continue;
            }
            /* a quantize per use: the forward's e4m3 codes, else the bf16 weight */
            const Node *qs = e4m3_scale(e, it, w->param);
            ok = add_item(e, &cap, j, qs ? it->target : w->param, w->param, qs, w->update);
        }
        if (ok && ga->bytes > slot_bytes[ga->buffer]) slot_bytes[ga->buffer] = ga->bytes;
    }
    int64_t at = 0;
    for (int b = 0; ok && b < p.n_buffers; b++) {
        e->gather_slot_at[b] = at;
        at += align_up(slot_bytes[b]);
    }
    e->n_gather_slots = p.n_buffers;
    e->gather_buf_bytes = at;
    int scalars = 0;   /* the e4m3 items' amax and scale */
    for (int k = 0; ok && k < e->n_gather_items; k++)
        if (e->gather_items[k].scale) e->gather_items[k].scalars_at = at + GATHER_SCALARS + 8 * scalars++;
    free(slot_bytes);
    rt_gather_plan_free(&p);
    if (!ok) goto oom;
    return at + GATHER_SCALARS + align_up(8 * (int64_t)scalars);
oom:
    rt_error("out of memory");
    return -1;
}

static bool in_list(const ExecGather *ga, int list) { return list == GATHER_MICRO || ga->phase == PHASE_FORWARD; }

bool exec_gather_at(CudaExec *e, int list, int node, int launch) {
    e->gather_list = list;
    e->gather_node = node;
    e->gather_launch = launch;
    e->gather_zeroed = false;
    if (list < 0) return false;
    for (int j = 0; j < e->n_gathers; j++) {
        ExecGather *ga = &e->gathers[j];
        if (in_list(ga, list) && ga->issue == node && ga->issue_at[list] < 0) ga->issue_at[list] = launch;
    }
    const Node *n = e->g->nodes[node];
    bool taken = false;
    for (int k = 0; k < e->n_gather_items; k++) {
        ExecGatherItem *x = &e->gather_items[k];
        ExecGather *ga = &e->gathers[x->gather];
        if (!x->scale || !in_list(ga, list)) continue;
        e->gather_zeroed = e->gather_zeroed || x->tensor == n;
        if (x->scale != n || ga->issue_at[list] < 0) continue;
        /* the QUANT_SCALE's place: the gathered scale copied into its result, a read */
        x->scale_at[list] = launch;
        if (ga->read_from[list] < 0) ga->read_from[list] = launch;
        if (launch > ga->read_to[list]) ga->read_to[list] = launch;
        taken = true;
    }
    return taken;
}

bool exec_gather_map(const CudaExec *e, const Tensor *t, CUdeviceptr *out) {
    if (!e->shard_weights || e->gather_list < 0 || !t->data) return false;
    int list = e->gather_list;
    Phase phase = e->g->nodes[e->gather_node]->phase;
    const char *c = t->data;
    const ExecGatherItem *hit = NULL;
    bool inside = false;
    for (int k = 0; k < e->n_gather_items; k++) {
        const ExecGatherItem *x = &e->gather_items[k];
        bool in_it = x->scale ? t == &x->tensor->t : c >= x->host && c < x->host + x->bytes;
        if (!in_it) continue;
        inside = true;
        const ExecGather *ga = &e->gathers[x->gather];
        /* its phase's latest gather issued no later than the node (gathers are in issue order) */
        if (ga->phase == phase && ga->issue_at[list] >= 0 && ga->issue <= e->gather_node) hit = x;
    }
    if (!inside) return false;
    CudaExec *m = (CudaExec *)e;   /* what the resolution learns: the reads of each gather */
    if (!hit) {
        /* an e4m3 item's QUANTIZE reads its weight, over no elements: nothing to hold */
        if (!m->gather_miss && !e->gather_zeroed) m->gather_miss = e->g->nodes[e->gather_node];
        return false;
    }
    ExecGather *ga = &m->gathers[hit->gather];
    if (ga->read_from[list] < 0) ga->read_from[list] = e->gather_launch;
    if (e->gather_launch > ga->read_to[list]) ga->read_to[list] = e->gather_launch;
    *out = e->gather_buf + (CUdeviceptr)(e->gather_slot_at[ga->buffer] + hit->buf_at + (c - hit->host));
    return true;
}

/* an e4m3 item's QUANTIZE launches in list L: over no elements (their inverse scales only) */
static void zero_quantizes(CudaExec *e, ExecList *L) {
    for (int i = 0; i < L->n; i++)
        for (int k = 0; k < e->n_gather_items; k++)
            if (e->gather_items[k].scale && L->l[i].node == e->gather_items[k].tensor && L->l[i].kind == CU_KERNEL)
                for (int t = 0; t < CK_MAX_TENSORS; t++) L->l[i].args.t[t].n = 0;
}

bool exec_gather_check(CudaExec *e) {
    e->gather_list = -1;
    e->gather_zeroed = false;
    if (!e->shard_weights) return true;
    if (e->gather_miss) {
        const Node *n = e->gather_miss;
        rt_error("CUDA executor: --shard-states=3: %s %%%d %s reads a sharded weight where no gather holds it",
                 ir_op_info(n->op)->text, n->id, n->t.name ? n->t.name : "");
        return false;
    }
    for (int l = 0; l < GATHER_LISTS; l++)
        for (int j = 0; j < e->n_gathers; j++) {
            const ExecGather *ga = &e->gathers[j];
            if (!in_list(ga, l)) continue;
            if (ga->issue_at[l] < 0) {
                rt_error("CUDA executor: --shard-states=3: a gather is never issued (its node %d is not in the list)",
                         ga->issue);
                return false;
            }
            for (int k = ga->first_item; k < ga->first_item + ga->n_items; k++)
                if (e->gather_items[k].scale && e->gather_items[k].scale_at[l] < 0) {
                    rt_error("CUDA executor: --shard-states=3: the scale of '%s' is gathered, and nothing copies it",
                             e->gather_items[k].weight->t.name ? e->gather_items[k].weight->t.name : "");
                    return false;
                }
            /* the next gather into its buffer in this list starts after its last reader */
            for (int k = j + 1; ga->read_to[l] >= 0 && k < e->n_gathers; k++) {
                const ExecGather *next = &e->gathers[k];
                if (next->buffer != ga->buffer || next->issue_at[l] < 0) continue;
                if (next->issue_at[l] <= ga->read_to[l]) {
                    rt_error("CUDA executor: --shard-states=3: a layer buffer is gathered into at launch %d "
                             "while launch %d still reads the layer before", next->issue_at[l], ga->read_to[l]);
                    return false;
                }
                break;
            }
        }
    zero_quantizes(e, &e->lists[LIST_EVAL]);
    zero_quantizes(e, &e->lists[LIST_MICRO]);
    return true;
}

/* CkTensor t as the elements [s.off, s.off + s.len) of a tensor at device address p */
static void shard_tensor(CkTensor *t, CUdeviceptr p, int64_t len) {
    t->p = (void *)(uintptr_t)p;
    t->n = len;
    t->rows = 1;
    t->cols = len;
}

/* An e4m3 item's kernels on NCCL's stream: their functions and argument blocks, fixed for
 * the run (the rank's shard, its place in the buffer, the gather area's slots). */
static bool open_e4m3(CudaExec *e, ExecGatherItem *x) {
    const Node *q = x->tensor;
    const CuLaunch *qa = &e->plans[q->index].launch[0];
    if (!exec_get_function(e, q, qa->fn, qa->smem, &x->fn_quantize)) return false;
    RtShard s = rt_shard_of(x->n, x->group, e->shard_world, e->shard_rank);
    CUdeviceptr area = e->gather_buf, amax = area + (CUdeviceptr)x->scalars_at, scale = amax + sizeof(float);
    CUdeviceptr mine = exec_shard_map(e, x->weight_at + s.off * x->weight_eb);
    CUdeviceptr slot = e->gather_buf + (CUdeviceptr)(e->gather_slot_at[e->gathers[x->gather].buffer] + x->buf_at);
    unsigned *ticket = (unsigned *)(uintptr_t)(area + (CUdeviceptr)(e->gather_buf_bytes + GATHER_TICKET));
    /* the shard quantized with the scale found here into its place in the buffer, by the
     * step's own kernel */
    if (!exec_resolve(e, qa, &x->quantize_args, e->scratch)) return false;
    shard_tensor(&x->quantize_args.t[0], slot + (CUdeviceptr)(s.off * x->eb), s.len);
    x->quantize_args.t[0].s = (const void *)(uintptr_t)scale;
    shard_tensor(&x->quantize_args.t[1], mine, s.len);
    memset(x->quantize_args.inv_from, 0, sizeof x->quantize_args.inv_from);   /* the list's launch writes them */
    memset(x->quantize_args.inv_to, 0, sizeof x->quantize_args.inv_to);
    x->quantize_args.ticket = ticket;
    x->grid_quantize = qa->grid[0];
    x->block_quantize = qa->block;
    CuNodePlan plan;
    if (!cuda_plan_gather(x->scale, e->arena, &plan) || plan.n_launch != 2) {
        rt_error("CUDA executor: --shard-states=3: no e4m3 gather for '%s'", x->weight->t.name ? x->weight->t.name : "");
        return false;
    }
    if (!exec_get_function(e, x->scale, plan.launch[0].fn, 0, &x->fn_amax) ||
        !exec_get_function(e, x->scale, plan.launch[1].fn, 0, &x->fn_scale))
        return false;
    /* the shard's amax: its block maxima in the gather area's own */
    x->amax_args = plan.launch[0].args;
    shard_tensor(&x->amax_args.t[0], amax, 1);
    shard_tensor(&x->amax_args.t[1], mine, s.len);
    x->amax_args.scratch = (void *)(uintptr_t)(area + (CUdeviceptr)(e->gather_buf_bytes + GATHER_PARTS));
    x->amax_args.ticket = ticket;
    x->grid_amax = plan.launch[0].grid[0];
    x->block_amax = plan.launch[0].block;
    IR_ASSERT(x->amax_args.i[0] == x->grid_amax && 4 * (int64_t)x->grid_amax <= GATHER_SCALARS - GATHER_PARTS);
    /* the scale from the ranks' maximum */
    x->scale_args = plan.launch[1].args;
    shard_tensor(&x->scale_args.t[0], scale, 1);
    shard_tensor(&x->scale_args.t[1], amax, 1);
    x->scale_args.ticket = ticket;
    x->block_scale = plan.launch[1].block;
    return true;
}

bool exec_gather_open(CudaExec *e) {
    if (!e->shard_weights) return true;
    if (!e->comm_stream) {
        rt_error("CUDA executor: --shard-states=3 gathers on NCCL's stream, which this run does not have");
        return false;
    }
    if (!CU_CHECK(CU(cuEventCreate)(&e->gather_ready, CU_EVENT_DISABLE_TIMING))) return false;
    for (int j = 0; j < e->n_gathers; j++)
        if (!CU_CHECK(CU(cuEventCreate)(&e->gathers[j].done, CU_EVENT_DISABLE_TIMING))) return false;
    for (int k = 0; k < e->n_gather_items; k++)
        if (e->gather_items[k].scale && !open_e4m3(e, &e->gather_items[k])) return false;
    /* the ticket at zero, the maxima and scalars too */
    CUdeviceptr area = e->gather_buf + (CUdeviceptr)e->gather_buf_bytes;
    return CU_CHECK(CU(cuMemsetD8Async)(area, 0, GATHER_SCALARS, e->stream)) && cuda_exec_sync(e);
}

static bool launch_on(CUfunction f, unsigned grid, unsigned block, const CkArgs *a, CUstream stream) {
    void *params[] = {(void *)a};
    return CU_CHECK(CU(cuLaunchKernel)(f, grid, 1, 1, block, 1, 1, 0, stream, params, NULL));
}

/* Gather j on NCCL's stream, after everything the executor's stream has enqueued so far: the
 * e4m3 items' amaxes, their maximum over the ranks, scales and shards quantized into the
 * buffer; then a broadcast of each shard from its owner into its place in the buffer (an
 * e4m3 item's from the owner's place there, the others' from its persistent shard). */
static bool issue(CudaExec *e, int j) {
    const ExecGather *ga = &e->gathers[j];
    CUstream st = e->comm_stream;
    CUdeviceptr buf = e->gather_buf + (CUdeviceptr)e->gather_slot_at[ga->buffer];
    const ExecGatherItem *items = e->gather_items + ga->first_item;
    bool ok = CU_CHECK(CU(cuEventRecord)(e->gather_ready, e->stream)) &&
              CU_CHECK(CU(cuStreamWaitEvent)(st, e->gather_ready, 0));
    bool amaxes = false;
    for (int k = 0; ok && k < ga->n_items; k++)
        if (items[k].scale) {
            amaxes = true;
            ok = launch_on(items[k].fn_amax, items[k].grid_amax, items[k].block_amax, &items[k].amax_args, st);
        }
    if (ok && amaxes) {
        ok = cuda_nccl_group(true);
        for (int k = 0; ok && k < ga->n_items; k++)
            if (items[k].scale)
                ok = cuda_nccl_all_reduce_max_f32(e->gather_buf + (CUdeviceptr)items[k].scalars_at, 1, st);
        ok = cuda_nccl_group(false) && ok;
    }
    for (int k = 0; ok && k < ga->n_items; k++)
        if (items[k].scale)
            ok = launch_on(items[k].fn_scale, 1, items[k].block_scale, &items[k].scale_args, st) &&
                 launch_on(items[k].fn_quantize, items[k].grid_quantize, items[k].block_quantize,
                           &items[k].quantize_args, st);
    ok = ok && cuda_nccl_group(true);
    for (int k = 0; ok && k < ga->n_items; k++) {
        const ExecGatherItem *x = &items[k];
        for (int q = 0; ok && q < e->shard_world; q++) {
            RtShard s = rt_shard_of(x->n, x->group, e->shard_world, q);
            if (!s.len) continue;
            CUdeviceptr at = buf + (CUdeviceptr)(x->buf_at + s.off * x->eb);
            if (x->scale) {
                ok = cuda_nccl_broadcast_bytes(at, s.len * x->eb, q, st);
            } else {
                CUdeviceptr mine = q == e->shard_rank ? exec_shard_map(e, x->weight_at + s.off * x->weight_eb) : 0;
                ok = cuda_nccl_broadcast_bytes_to(mine, at, s.len * x->eb, q, st);
            }
        }
    }
    ok = cuda_nccl_group(false) && ok;
    return ok && CU_CHECK(CU(cuEventRecord)(ga->done, st));
}

bool exec_gather_before(CudaExec *e, int list, int i) {
    bool ok = true;
    for (int j = 0; ok && e->shard_weights && j < e->n_gathers; j++) {
        if (e->gathers[j].issue_at[list] == i) ok = issue(e, j);
        if (ok && e->gathers[j].read_from[list] == i)
            ok = CU_CHECK(CU(cuStreamWaitEvent)(e->stream, e->gathers[j].done, 0));
    }
    for (int k = 0; ok && e->shard_weights && k < e->n_gather_items; k++) {
        const ExecGatherItem *x = &e->gather_items[k];
        if (!x->scale || x->scale_at[list] != i) continue;
        CUdeviceptr to;   /* the QUANT_SCALE's result: the gathered scale */
        ok = exec_map_tensor(e, &x->scale->t, &to) &&
             CU_CHECK(CU(cuMemcpyDtoDAsync_v2)(to, e->gather_buf + (CUdeviceptr)(x->scalars_at + sizeof(float)),
                                               sizeof(float), e->stream));
    }
    return ok;
}

static bool launch_eval(CudaExec *e, void *unused) {
    (void)unused;
    ExecList *L = &e->lists[LIST_EVAL];
    bool ok = true;
    for (int i = 0; ok && i < L->n; i++) ok = exec_gather_before(e, GATHER_EVAL, i) && exec_launch(e, &L->l[i]);
    return ok && CU_CHECK(CU(cuEventRecord)(e->comm_done, e->comm_stream)) &&
           CU_CHECK(CU(cuStreamWaitEvent)(e->stream, e->comm_done, 0));
}

bool exec_gather_run_eval(CudaExec *e) {
    ExecList *L = &e->lists[LIST_EVAL];
    cuda_nccl_arm("the forward with its weight gathers");
    bool ok;
    if (!e->graphs || e->sync_each || e->profile || !e->eval_warm) {
        e->eval_warm = true;   /* NCCL has set up its connections for these gathers */
        ok = launch_eval(e, NULL);
    } else {
        ok = exec_replay(e, L, launch_eval, NULL);
    }
    ok = ok && exec_finish(e, "forward");
    cuda_nccl_disarm();
    return ok;
}

void exec_gather_close(CudaExec *e) {
    for (int j = 0; j < e->n_gathers; j++)
        if (e->gathers[j].done) CU(cuEventDestroy_v2)(e->gathers[j].done);
    if (e->gather_ready) CU(cuEventDestroy_v2)(e->gather_ready);
    free(e->gathers);
    free(e->gather_items);
    free(e->gather_slot_at);
}
