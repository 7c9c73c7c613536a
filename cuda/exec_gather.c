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
 * holding a broadcast per shard, from its owner's persistent shard into the shard's place in
 * the buffer, as stage 1 broadcasts the new weights. At -O1/-O2 that is the update's e4m3
 * copy (delayed scale, already agreed by the update's amax all-reduce), at -O0 the bf16
 * weight. At -O3 the plan gathers the weight's per-use e4m3 quantize (each rank's shard
 * quantized with the scale of the all-reduced amax); this executor gathers the bf16 weight
 * there instead and runs the step's own QUANT_SCALE and QUANTIZE launches on the gathered
 * copy: the same bits (the quantize reads the whole weight, as on one GPU), every kernel and
 * fusion of the build unchanged (the backward's quantize writes both layouts, which a gather
 * of row-major codes would have to transpose again), at twice the plan's bytes on the wire.
 *
 * Addresses. The lists that run gathers (evaluation: the forward; the micro-step: forward and
 * backward) are resolved with e->gather_list set: a host address inside a gathered tensor
 * then maps into the buffer of the gather that holds it for the node being resolved (the
 * latest gather of its layer issued in that node's phase), so every GEMM, transpose and
 * quantize reads the buffer, unchanged, as stage 2's backward writes bucket buffers. While
 * resolving, each gather notes the first and last launch that read it; exec_gather_check then
 * refuses a plan that would read a weight outside its gather or hand a buffer to the next
 * gather before the previous one's last reader (the plan's windows are node positions, and a
 * GEMM epilogue runs at its group's last node).
 *
 * Running. Before launch i of a list: each gather issued there records an event on the
 * executor's stream, and NCCL's stream (exec_comm.c's) waits for it, so the gather follows
 * every launch before it, among them the last reader of what its buffer held; then its group
 * of broadcasts, then its own event; and before the first launch that reads a gather the
 * executor's stream waits for that event. So layer k's gather runs while layer k-1 computes.
 * At the end of the list NCCL's stream is joined back (exec_comm.c's comm_done). The lists
 * are captured in CUDA graphs from their second run on, the first one setting up NCCL's
 * connections outside any capture.
 *
 * The update writes each rank's shard of the weight and copy (stage 1's restricted launches);
 * no broadcast follows for gathered weights (exec_shard.c skips them), since the next step
 * gathers them. Checkpoints: the weights and copies are sharded tensors of exec_shard.c, so
 * cuda_exec_gather sends their shards to rank 0's mirror, and pushes copy each rank's shard. */
#include <stdlib.h>
#include <string.h>

#include "exec_internal.h"

static bool add_item(CudaExec *e, int *cap, int gather, const Node *t, const Node *update) {
    for (int k = e->gathers[gather].first_item; k < e->n_gather_items; k++)
        if (e->gather_items[k].tensor == t) return true;   /* one place a gather */
    if (!grow((void **)&e->gather_items, cap, e->n_gather_items, sizeof *e->gather_items)) return false;
    ExecGatherItem *x = &e->gather_items[e->n_gather_items++];
    ExecGather *ga = &e->gathers[gather];
    x->gather = gather;
    x->tensor = t;
    x->at = (const char *)t->t.data - (const char *)e->host.persistent;
    x->eb = fmt_elem_bytes(t->t.fmt.elem);
    x->n = ir_numel(&t->t);
    x->bytes = x->n * x->eb;
    x->group = rt_shard_group(update);
    x->buf_at = align_up(ga->bytes) + x->at % ALIGN;   /* the host offset's alignment */
    ga->bytes = x->buf_at + x->bytes;
    ga->n_items++;
    IR_ASSERT(x->at >= 0 && x->at + x->bytes <= e->host.persistent_bytes);
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
            /* a quantize per use (-O3): its weight, which the step's own launches quantize */
            const Node *t = it->target->op == OP_QUANTIZE ? w->param : it->target;
            ok = add_item(e, &cap, j, t, w->update);
        }
        if (ok && ga->bytes > slot_bytes[ga->buffer]) slot_bytes[ga->buffer] = ga->bytes;
    }
    int64_t at = 0;
    for (int b = 0; ok && b < p.n_buffers; b++) {
        e->gather_slot_at[b] = at;
        at += align_up(slot_bytes[b]);
    }
    e->n_gather_slots = p.n_buffers;
    free(slot_bytes);
    rt_gather_plan_free(&p);
    if (!ok) goto oom;
    return at;
oom:
    rt_error("out of memory");
    return -1;
}

void exec_gather_at(CudaExec *e, int list, int node, int launch) {
    e->gather_list = list;
    e->gather_node = node;
    e->gather_launch = launch;
    if (list < 0) return;
    for (int j = 0; j < e->n_gathers; j++) {
        ExecGather *ga = &e->gathers[j];
        bool in_list = list == GATHER_MICRO || ga->phase == PHASE_FORWARD;
        if (in_list && ga->issue == node && ga->issue_at[list] < 0) ga->issue_at[list] = launch;
    }
}

bool exec_gather_map(const CudaExec *e, int64_t off, CUdeviceptr *out) {
    if (!e->shard_weights || e->gather_list < 0) return false;
    int list = e->gather_list;
    Phase phase = e->g->nodes[e->gather_node]->phase;
    const ExecGatherItem *hit = NULL;
    bool inside = false;
    for (int k = 0; k < e->n_gather_items; k++) {
        const ExecGatherItem *x = &e->gather_items[k];
        if (off < x->at || off >= x->at + x->bytes) continue;
        inside = true;
        const ExecGather *ga = &e->gathers[x->gather];
        /* its phase's latest gather issued no later than the node (gathers are in issue order) */
        if (ga->phase == phase && ga->issue_at[list] >= 0 && ga->issue <= e->gather_node) hit = x;
    }
    if (!inside) return false;
    CudaExec *m = (CudaExec *)e;   /* what the resolution learns: the reads of each gather */
    if (!hit) {
        if (!m->gather_miss) m->gather_miss = e->g->nodes[e->gather_node];
        return false;
    }
    ExecGather *ga = &m->gathers[hit->gather];
    if (ga->read_from[list] < 0) ga->read_from[list] = e->gather_launch;
    ga->read_to[list] = e->gather_launch;
    *out = e->gather_buf + (CUdeviceptr)(e->gather_slot_at[ga->buffer] + hit->buf_at + (off - hit->at));
    return true;
}

bool exec_gather_check(CudaExec *e) {
    e->gather_list = -1;
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
            bool in_list = l == GATHER_MICRO || ga->phase == PHASE_FORWARD;
            if (in_list && ga->issue_at[l] < 0) {
                rt_error("CUDA executor: --shard-states=3: a gather is never issued (its node %d is not in the list)",
                         ga->issue);
                return false;
            }
            /* the next gather into its buffer in this list starts after its last reader */
            for (int k = j + 1; in_list && ga->read_to[l] >= 0 && k < e->n_gathers; k++) {
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
    return true;
}

/* Gather j on NCCL's stream, after everything the executor's stream has enqueued so far: a
 * broadcast of each shard from its owner's persistent shard into its place in the buffer. */
static bool issue(CudaExec *e, int j) {
    const ExecGather *ga = &e->gathers[j];
    CUdeviceptr buf = e->gather_buf + (CUdeviceptr)e->gather_slot_at[ga->buffer];
    bool ok = CU_CHECK(CU(cuEventRecord)(e->gather_ready, e->stream)) &&
              CU_CHECK(CU(cuStreamWaitEvent)(e->comm_stream, e->gather_ready, 0)) && cuda_nccl_group(true);
    for (int k = ga->first_item; ok && k < ga->first_item + ga->n_items; k++) {
        const ExecGatherItem *x = &e->gather_items[k];
        for (int q = 0; ok && q < e->shard_world; q++) {
            RtShard s = rt_shard_of(x->n, x->group, e->shard_world, q);
            if (!s.len) continue;
            CUdeviceptr mine = q == e->shard_rank ? exec_shard_map(e, x->at + s.off * x->eb) : 0;
            ok = cuda_nccl_broadcast_bytes_to(mine, buf + (CUdeviceptr)(x->buf_at + s.off * x->eb), s.len * x->eb, q,
                                              e->comm_stream);
        }
    }
    ok = cuda_nccl_group(false) && ok;
    return ok && CU_CHECK(CU(cuEventRecord)(ga->done, e->comm_stream));
}

bool exec_gather_before(CudaExec *e, int list, int i) {
    bool ok = true;
    for (int j = 0; ok && e->shard_weights && j < e->n_gathers; j++) {
        if (e->gathers[j].issue_at[list] == i) ok = issue(e, j);
        if (ok && e->gathers[j].read_from[list] == i)
            ok = CU_CHECK(CU(cuStreamWaitEvent)(e->stream, e->gathers[j].done, 0));
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
