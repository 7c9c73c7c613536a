/* exec_shard.c — the executor's sharded step (fp8c build --gpus N --shard-states).
 *
 * Each rank keeps the bf16 weights, their FP8 copies and the gradient accumulators whole (the
 * forward and backward read and write all of them) and its shard of what only the update
 * reads: the master weights and the optimizer states with their codecs' side values
 * (runtime/comm_shard.c has the arithmetic: per tensor, shard r of n elements is [r S,
 * (r+1) S) clipped to n, S = ceil(n / N) rounded up to the update's group). This is ZeRO
 * stage 1; with --shard-states=2 the accumulators are cut to the rank's shard as well, and
 * exec_grads.c gives the backward bucket buffers to write in (stage 2); with =3 the weights
 * the GEMMs read (and their FP8 copies) too, which exec_gather.c gathers into layer buffers
 * while the step runs (stage 3).
 *
 * Memory. The host mirror stays the plan's whole persistent arena (host memory is not what
 * runs short, and checkpoints, initialization and resumption keep working on whole tensors);
 * the device's persistent arena is that arena with the bytes this rank does not own cut out:
 * a list of kept segments of the host arena, each at a device offset that keeps its start's
 * alignment modulo 256 (so every vector access the whole layout allows stays allowed). A
 * host address maps to the device through the segment that holds it; an address in a cut
 * (a shard of another rank's) maps to where it would be if its tensor's next kept bytes were
 * in place, which only the launches rewritten below ever form, and never dereference.
 * Pushes, pulls and zeroing copy the kept pieces of a tensor only.
 *
 * The step. The backward is unchanged. The gradients go to NCCL in the same buckets, at the
 * same places, as the unsharded sums (exec_comm.c), but each tensor's sum goes as one
 * ncclReduce per rank, to the shard's owner (a group of them): per-tensor shards with group
 * padding do not fit ncclReduceScatter's equal, contiguous pieces, and a reduce to one root
 * adds the same values in a fixed order every run. On two ranks a shard's sum is the one
 * addition the all-reduce makes, so the sharded run computes the unsharded run's bits. The
 * update list then runs in three pieces with collectives between them:
 *   1. the launches up to the last SQNORM but each SQNORM's last, each SQNORM's first launch
 *      over this rank's shard of its (reduced) gradient; then an all-reduce (sum) of the
 *      norm's chunk sums, f64; then the SQNORMs' last launches. A SQNORM sums the squares of
 *      fixed chunks of IR_SQNORM_CHUNK elements (ir.h), a chunk's sum depending on its
 *      elements alone, and then the chunks' sums in chunk order (ck_sqnorm_chunks,
 *      ck_sqnorm_final). A shard starts on a chunk boundary (rt_shard_group), so this rank's
 *      first launch writes exactly the whole tensor's sums of the chunks it owns, into its
 *      slots of one buffer of every tensor's chunk sums that is zero elsewhere; the all-reduce
 *      adds zeros to each slot but its owner's, which is exact in any order, so every rank
 *      holds the unsharded run's chunk sums, and the last launch adds them as one GPU does.
 *      The norm and the clip coefficient are then one GPU's bits, for any number of ranks.
 *   2. the launches up to the last update (ADAMW, LION, SGD), each update's kernel over its
 *      shard: its argument block's tensors start at the shard and hold its count (the codecs'
 *      side values from the shard's first group: a shard starts on a group boundary, so the
 *      groups are the whole tensor's); then an all-reduce (max) of each FP8 weight copy's amax,
 *      so every rank's delayed scale agrees (at O3 of each weight's amax, which the next
 *      step's scales read), and a group of broadcasts from each shard's owner
 *      of the new bf16 weights and (O1/O2) the e4m3 copies, which every rank encoded with that
 *      same scale (at stage 3 only of the weights kept whole: a gathered weight stays as its
 *      owners' shards until the next step gathers it); and the gradient accumulators zeroed
 *      whole (the kernel zeroes its shard, the rest still holds this rank's own share).
 *   3. the rest of the update.
 * The whole update is captured in one CUDA graph from its second run on (the first run lets
 * NCCL set up its connections outside any capture), as the last micro-step is.
 *
 * Checkpoints keep whole tensors: cuda_exec_gather, called by every rank, sends each rank's
 * shards of the states and masters (and the accumulators at stage 2, the weights and copies
 * at stage 3) to rank 0's host mirror. Loading needs nothing: every rank
 * reads the whole tensors into its mirror and pushes its shards, on any number of ranks. */
#include <stdlib.h>
#include <string.h>

#include "exec_internal.h"

/* ---------------------------------------------------------------- the layout */

/* the norm's chunks of a tensor of n elements (ir.h; an empty one has one, of nothing) */
static int64_t chunks_of(int64_t n) { return n > 0 ? (n + IR_SQNORM_CHUNK - 1) / IR_SQNORM_CHUNK : 1; }

/* The byte range [lo, hi) of the host persistent arena that rank r keeps of sharded tensor t */
static void tensor_range(const CudaExec *e, const ExecShardTensor *t, int r, int64_t *lo, int64_t *hi) {
    const ExecShardUpdate *u = &e->shard_updates[t->update];
    RtShard s = rt_shard_of(u->n, u->group, e->shard_world, r);
    if (t->codec != CODEC_PLAIN) {
        *lo = t->at + codec_param_count(t->codec, s.off) * (int64_t)sizeof(float);
        *hi = t->at + codec_param_count(t->codec, s.off + s.len) * (int64_t)sizeof(float);
    } else {
        *lo = t->at + s.off * t->eb;
        *hi = t->at + (s.off + s.len) * t->eb;
    }
}

static bool push_tensor(CudaExec *e, int *cap, int update, const Tensor *t, bool side) {
    if (!grow((void **)&e->shard_tensors, cap, e->n_shard_tensors, sizeof *e->shard_tensors)) return false;
    ExecShardTensor *x = &e->shard_tensors[e->n_shard_tensors++];
    const Tensor *at = side ? &t->fmt.scale->t : t;
    x->update = update;
    x->at = (const char *)at->data - (const char *)e->host.persistent;
    x->bytes = tensor_bytes(at);
    x->codec = side ? t->fmt.codec : CODEC_PLAIN;
    x->eb = fmt_elem_bytes(t->fmt.elem);
    IR_ASSERT(x->at >= 0 && x->at + x->bytes <= e->host.persistent_bytes);
    return true;
}

typedef struct {
    int64_t lo, hi;
} Cut;

static int cut_cmp(const void *a, const void *b) {
    int64_t x = ((const Cut *)a)->lo, y = ((const Cut *)b)->lo;
    return x < y ? -1 : x > y;
}

int64_t exec_shard_layout(CudaExec *e, int world, int rank) {
    Graph *g = e->g;
    e->shard = rt_shard_states(g) && world > 1;
    if (!e->shard) return e->host.persistent_bytes;
    e->shard_world = world;
    e->shard_rank = rank;
    /* the norm's chunk sums, all-reduced in one buffer (exec.c puts it in aux) */
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_SQNORM && g->nodes[i]->phase == PHASE_UPDATE)
            e->n_norm_chunks += chunks_of(ir_numel(&g->nodes[i]->in[0]->t));
    /* --shard-states=3: the weights the step gathers (and their FP8 copies) are cut too */
    RtGatherPlan gp;
    if (!rt_gather_plan(g, world, &gp)) goto oom;
    /* the updates and the tensors they shard */
    int cap_u = 0, cap_t = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *u = g->nodes[i];
        if (!ir_op_is_update(u->op)) continue;
        if (!grow((void **)&e->shard_updates, &cap_u, e->n_shard_updates, sizeof *e->shard_updates)) goto oom;
        int k = e->n_shard_updates++;
        ExecShardUpdate *x = &e->shard_updates[k];
        memset(x, 0, sizeof *x);
        x->node = u;
        x->n = ir_numel(&u->in[0]->t);
        x->group = rt_shard_group(u);
        x->mine = rt_shard_of(x->n, x->group, e->shard_world, e->shard_rank);
        x->reduce = -1;
        int states = ir_update_lr_index(u), master = ir_adamw_master_index(u);
        if (rt_shard_stage(g) >= 2) {   /* --shard-states=2: the accumulator too (exec_grads.c) */
            const Node *acc = u->in[1];
            while (acc->op == OP_ALL_REDUCE || acc->op == OP_ACCUMULATE) acc = acc->in[0];
            if (!push_tensor(e, &cap_t, k, &acc->t, false)) goto oom;
        }
        const RtGatherWeight *gw = rt_gather_weight(&gp, u->in[0]);
        if (gw) {   /* --shard-states=3: the weight and its copy (exec_gather.c) */
            x->gathered = true;
            if (!push_tensor(e, &cap_t, k, &u->in[0]->t, false)) goto oom;
            if (gw->copy && !push_tensor(e, &cap_t, k, &gw->copy->t, false)) goto oom;
        }
        for (int s = 2; s <= states; s++) {
            const Tensor *t = s < states ? &u->in[s]->t : master >= 0 ? &u->in[master]->t : NULL;
            if (!t) continue;
            if (!push_tensor(e, &cap_t, k, t, false)) goto oom;
            if (t->fmt.codec != CODEC_PLAIN && t->fmt.codec != CODEC_SPLIT && t->fmt.scale &&
                !push_tensor(e, &cap_t, k, t, true))
                goto oom;
        }
    }
    /* only its update may read a sharded tensor (its other bytes are not on this GPU): the
     * compiler's graphs have no other reader; one that had would get addresses of nothing.
     * (A stage-2 accumulator is read and written by the micro-step in its bucket buffer,
     * exec_grads.c, and in the update by its norm and its update, both cut to the shard; a
     * stage-3 weight or copy by the forward and backward in a layer buffer, exec_gather.c,
     * which refuses a read no gather holds, and in the update by its update only.) */
    bool *kept_whole = calloc((size_t)(g->n_nodes ? g->n_nodes : 1), sizeof *kept_whole);
    bool *gathered = calloc((size_t)(g->n_nodes ? g->n_nodes : 1), sizeof *gathered);
    if (!kept_whole || !gathered) {
        free(kept_whole);
        goto oom;
    }
    for (int k = 0; k < e->n_shard_updates; k++) {
        const Node *u = e->shard_updates[k].node;
        int states = ir_update_lr_index(u), master = ir_adamw_master_index(u);
        for (int s = 2; s < states; s++) kept_whole[u->in[s]->index] = true;
        if (master >= 0) kept_whole[u->in[master]->index] = true;
    }
    for (int w = 0; w < gp.n_weights; w++) {
        gathered[gp.weights[w].param->index] = true;
        if (gp.weights[w].copy) gathered[gp.weights[w].copy->index] = true;
    }
    rt_gather_plan_free(&gp);
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (ir_op_is_update(n->op)) continue;
        for (int k = 0; k < n->n_in; k++) {
            bool state = kept_whole[n->in[k]->index], weight = gathered[n->in[k]->index] && n->phase == PHASE_UPDATE;
            if (state || weight) {
                rt_error("CUDA executor: --shard-states: %s %%%d reads the sharded %s %s outside its update",
                         ir_op_info(n->op)->text, n->id, state ? "state" : "weight",
                         n->in[k]->t.name ? n->in[k]->t.name : "");
                free(kept_whole);
                free(gathered);
                return -1;
            }
        }
    }
    free(kept_whole);
    free(gathered);
    /* the cuts: every sharded tensor but this rank's range of it */
    Cut *cuts = calloc((size_t)(2 * e->n_shard_tensors + 1), sizeof *cuts);
    if (!cuts) goto oom;
    int n_cuts = 0;
    for (int i = 0; i < e->n_shard_tensors; i++) {
        const ExecShardTensor *t = &e->shard_tensors[i];
        int64_t lo, hi;
        tensor_range(e, t, e->shard_rank, &lo, &hi);
        if (lo > t->at) cuts[n_cuts++] = (Cut){t->at, lo};
        if (t->at + t->bytes > hi) cuts[n_cuts++] = (Cut){hi, t->at + t->bytes};
    }
    qsort(cuts, (size_t)n_cuts, sizeof *cuts, cut_cmp);
    /* the kept segments between them, each at a device offset with its start's alignment */
    int cap_s = 0;
    int64_t at = 0, dev = 0;
    for (int i = 0; i <= n_cuts; i++) {
        int64_t end = i < n_cuts ? cuts[i].lo : e->host.persistent_bytes;
        if (end > at) {
            if (!grow((void **)&e->shard_segs, &cap_s, e->n_shard_segs, sizeof *e->shard_segs)) {
                free(cuts);
                goto oom;
            }
            int64_t d = align_up(dev) + at % ALIGN;
            e->shard_segs[e->n_shard_segs++] = (ExecSegment){at, end, d};
            dev = d + (end - at);
        }
        if (i < n_cuts && cuts[i].hi > at) at = cuts[i].hi;
    }
    free(cuts);
    return dev ? dev : ALIGN;
oom:
    rt_gather_plan_free(&gp);
    rt_error("out of memory");
    return -1;
}

/* The device address of byte `off` of the host persistent arena (see the top). */
CUdeviceptr exec_shard_map(const CudaExec *e, int64_t off) {
    int lo = 0, hi = e->n_shard_segs;   /* the first segment that ends after off */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (e->shard_segs[mid].hi <= off) lo = mid + 1;
        else hi = mid;
    }
    if (lo < e->n_shard_segs) {
        const ExecSegment *s = &e->shard_segs[lo];
        return e->persistent + (CUdeviceptr)(s->dev + (off - s->lo));   /* may lie before s: a cut */
    }
    if (!e->n_shard_segs) return e->persistent;
    const ExecSegment *s = &e->shard_segs[e->n_shard_segs - 1];   /* the end of the arena */
    return e->persistent + (CUdeviceptr)(s->dev + (off - s->lo));
}

bool exec_pieces(CudaExec *e, const char *name, const void *p, int64_t bytes, ExecPieceFn fn, void *ctx) {
    const char *c = p, *hp = e->host.persistent;
    if (!bytes) return true;
    if (!e->shard || !hp || c < hp || c >= hp + e->host.persistent_bytes) {
        CUdeviceptr d;
        Tensor probe = {.data = (void *)(uintptr_t)p, .name = name};
        return exec_map_tensor(e, &probe, &d) && fn(e, (char *)(uintptr_t)p, d, bytes, ctx);
    }
    int64_t lo = c - hp, hi = lo + bytes;
    for (int i = 0; i < e->n_shard_segs; i++) {
        const ExecSegment *s = &e->shard_segs[i];
        int64_t a = s->lo > lo ? s->lo : lo, b = s->hi < hi ? s->hi : hi;
        if (a >= b) continue;
        if (!fn(e, (char *)(uintptr_t)(hp + a), e->persistent + (CUdeviceptr)(s->dev + (a - s->lo)), b - a, ctx))
            return false;
    }
    return true;
}

/* ---------------------------------------------------------------- the update's launches */

/* t[k] of a launch restricted to elements [off, off+len) of node m's tensor */
static bool restrict_tensor(CudaExec *e, CkTensor *a, const Node *m, RtShard s) {
    const Tensor *t = &m->t;
    int64_t eb = fmt_elem_bytes(t->fmt.elem);
    CUdeviceptr p;
    Tensor part = *t;
    part.data = (char *)t->data + s.off * eb;
    if (!exec_map_tensor(e, &part, &p)) return false;
    a->p = (void *)(uintptr_t)p;
    a->n = s.len;
    a->rows = 1;
    a->cols = s.len;
    if (t->fmt.codec != CODEC_PLAIN && t->fmt.codec != CODEC_SPLIT && t->fmt.scale) {
        Tensor side = t->fmt.scale->t;
        side.data = (float *)side.data + codec_param_count(t->fmt.codec, s.off);
        if (!exec_map_tensor(e, &side, &p)) return false;
        a->s = (const void *)(uintptr_t)p;
    }
    return true;
}

static int update_of(const CudaExec *e, const Node *n) {
    for (int k = 0; k < e->n_shard_updates; k++)
        if (e->shard_updates[k].node == n) return k;
    return -1;
}

bool exec_shard_prepare(CudaExec *e) {
    if (!e->shard) return true;
    ExecList *L = &e->lists[LIST_UPDATE];
    /* each update's gradient sum, whole tensors on the device */
    for (int k = 0; k < e->n_shard_updates; k++) {
        ExecShardUpdate *u = &e->shard_updates[k];
        const Node *n = u->node;
        for (int i = 0; i < e->n_reduce; i++)
            if (e->reduce[i].node == n->in[1]) u->reduce = i;
        if (u->reduce < 0) {
            rt_error("CUDA executor: --shard-states: the update of '%s' reads no summed gradient",
                     n->in[0]->t.name ? n->in[0]->t.name : "unnamed");
            return false;
        }
        int at = ir_adamw_copy_index(n);
        const Tensor *acc = &n->in[1]->t;
        u->grad_bytes = ir_numel(acc) * fmt_elem_bytes(acc->fmt.elem);
        u->param_eb = fmt_elem_bytes(n->in[0]->t.fmt.elem);
        if (!exec_map_tensor(e, &n->in[1]->t, &u->grad) || !exec_map_tensor(e, &n->in[0]->t, &u->param))
            return false;
        if (at >= 0) {
            u->copy_eb = fmt_elem_bytes(n->in[at]->t.fmt.elem);
            if (!exec_map_tensor(e, &n->in[at]->t, &u->copy)) return false;
        }
        int at_amax = ir_update_amax_index(n);   /* the copy's, or O3's weight amax alone */
        if (at_amax >= 0 && !exec_map_tensor(e, &n->in[at_amax]->t, &u->amax)) return false;
        if (ir_numel(&n->in[0]->t) != u->n || ir_numel(acc) != u->n) {
            rt_error("CUDA executor: --shard-states: '%s' and its gradient differ in size",
                     n->in[0]->t.name ? n->in[0]->t.name : "unnamed");
            return false;
        }
    }
    /* the norm's chunk sums: each SQNORM's at its place in one buffer (in aux, exec_shard_layout) */
    e->norm_final = calloc((size_t)(L->n ? L->n : 1), sizeof *e->norm_final);
    if (!e->norm_final) return false;
    /* the launches: each SQNORM's first over its gradient's shard, its last over the tensor's
     * chunk sums, each update's first over its shard; the pieces end after the last of each */
    e->norm_end = e->upd_end = -1;
    int64_t norm_at = 0;
    const Node *prev = NULL;
    for (int i = 0; i < L->n; i++) {
        ExecLaunch *x = &L->l[i];
        const Node *n = x->node;
        bool first = n != prev;
        prev = n;
        if (x->batched) {
            rt_error("CUDA executor: --shard-states: a batched launch in the update");
            return false;
        }
        if (n->op == OP_SQNORM) {
            if (e->upd_end >= 0) {
                rt_error("CUDA executor: --shard-states: a gradient norm after an update");
                return false;
            }
            e->norm_end = i + 1;
            const Node *grad = n->in[0];
            int64_t chunks = chunks_of(ir_numel(&grad->t));
            if (!first) {   /* the last launch: the chunk sums added in order */
                if (i + 1 < L->n && L->l[i + 1].node == n) {
                    rt_error("CUDA executor: --shard-states: a gradient norm planned in more than two launches");
                    return false;
                }
                if (x->args.i[0] != chunks) {
                    rt_error("CUDA executor: --shard-states: a gradient norm's last launch adds %lld sums of %lld",
                             (long long)x->args.i[0], (long long)chunks);
                    return false;
                }
                x->args.scratch = (void *)(uintptr_t)(e->norm_chunks + (CUdeviceptr)((norm_at - chunks) * 8));
                e->norm_final[i] = true;
                continue;
            }
            int k = -1;
            for (int j = 0; j < e->n_shard_updates && k < 0; j++)
                if (e->shard_updates[j].node->in[1] == grad) k = j;
            if (k < 0 || x->args.t[1].n != ir_numel(&grad->t)) {
                rt_error("CUDA executor: --shard-states: the norm of a gradient no update reads");
                return false;
            }
            RtShard s = e->shard_updates[k].mine;
            if (s.len && s.off % IR_SQNORM_CHUNK) {
                rt_error("CUDA executor: --shard-states: the shard of '%s' starts inside a norm chunk",
                         grad->t.name ? grad->t.name : "unnamed");
                return false;
            }
            if (!restrict_tensor(e, &x->args.t[1], grad, s)) return false;
            /* this rank's chunks, at their places among the tensor's */
            x->args.scratch = (void *)(uintptr_t)(e->norm_chunks + (CUdeviceptr)((norm_at + s.off / IR_SQNORM_CHUNK) * 8));
            int64_t warps = x->block >= 32 ? x->block / 32 : 1,
                    blocks = (chunks_of(s.len) + warps - 1) / warps;   /* a warp a chunk */
            if (blocks < 1) blocks = 1;
            if (blocks < x->grid[0]) x->grid[0] = (unsigned)blocks;
            norm_at += chunks;
            e->n_sqnorms++;
            continue;
        }
        int k = update_of(e, n);
        if (k < 0) continue;
        e->upd_end = i + 1;
        if (!first) continue;
        if (e->norm_end < 0 || x->args.t[0].n != e->shard_updates[k].n) {
            rt_error("CUDA executor: --shard-states: the update of '%s' is not planned as one elementwise kernel "
                     "after the gradient norm", n->in[0]->t.name ? n->in[0]->t.name : "unnamed");
            return false;
        }
        RtShard s = e->shard_updates[k].mine;
        int states = ir_update_lr_index(n), master = ir_adamw_master_index(n), copy = ir_adamw_copy_index(n);
        for (int j = 0; j < states; j++)
            if (!restrict_tensor(e, &x->args.t[j], n->in[j], s)) return false;
        if (master >= 0 && !restrict_tensor(e, &x->args.t[master], n->in[master], s)) return false;
        if (copy >= 0) {
            const void *scale = x->args.t[copy].s;   /* per tensor: the whole tensor's one scale */
            if (!restrict_tensor(e, &x->args.t[copy], n->in[copy], s)) return false;
            x->args.t[copy].s = scale;
        }
    }
    /* a reader of a norm in the first piece would run before the last launches (deferred) */
    for (int i = 0; i < e->norm_end; i++)
        for (int k = 0; k < L->l[i].node->n_in; k++)
            if (L->l[i].node->op != OP_SQNORM && L->l[i].node->in[k]->op == OP_SQNORM) {
                rt_error("CUDA executor: --shard-states: %s %%%d reads a gradient norm before all are summed",
                         ir_op_info(L->l[i].node->op)->text, L->l[i].node->id);
                return false;
            }
    if (e->norm_end < 0 || e->upd_end < 0 || e->n_sqnorms != e->n_shard_updates || norm_at != e->n_norm_chunks) {
        rt_error("CUDA executor: --shard-states: the update has %d gradient norms for %d updates",
                 e->n_sqnorms, e->n_shard_updates);
        return false;
    }
    return true;
}

/* ---------------------------------------------------------------- collectives */

/* reduce[first .. first+count): each gradient's shards summed to their owners, one group */
bool exec_shard_reduce(CudaExec *e, int first, int count, CUstream stream) {
    if (!cuda_nccl_group(true)) return false;
    bool ok = true;
    for (int i = first; ok && i < first + count; i++) {
        const ExecReduce *r = &e->reduce[i];
        const ExecShardUpdate *u = NULL;
        for (int k = 0; k < e->n_shard_updates && !u; k++)
            if (e->shard_updates[k].reduce == i) u = &e->shard_updates[k];
        if (!u) {   /* a sum no update reads (none in the graphs the compiler makes): whole */
            ok = cuda_nccl_all_reduce_sum(r->p, r->count, r->elem, stream);
            continue;
        }
        int64_t eb = fmt_elem_bytes(r->elem);
        for (int q = 0; ok && q < e->shard_world; q++) {
            RtShard s = rt_shard_of(u->n, u->group, e->shard_world, q);
            if (s.len) ok = cuda_nccl_reduce_sum(r->p + (CUdeviceptr)(s.off * eb), s.len, r->elem, q, stream);
        }
    }
    return cuda_nccl_group(false) && ok;
}

/* the first piece, the norm's chunk sums of every rank in every rank's buffer, the last launches */
static bool launch_norms(CudaExec *e) {
    ExecList *L = &e->lists[LIST_UPDATE];
    if (!CU_CHECK(CU(cuMemsetD8Async)(e->norm_chunks, 0, (size_t)e->n_norm_chunks * 8, e->stream))) return false;
    for (int i = 0; i < e->norm_end; i++)
        if (!e->norm_final[i] && !exec_launch(e, &L->l[i])) return false;
    if (e->n_norm_chunks && !cuda_nccl_all_reduce_sum_f64(e->norm_chunks, e->n_norm_chunks, e->stream)) return false;
    for (int i = 0; i < e->norm_end; i++)
        if (e->norm_final[i] && !exec_launch(e, &L->l[i])) return false;
    return true;
}

/* the copies' amaxes agreed, the new weights and copies from their owners, the gradients zeroed */
static bool gather_weights(CudaExec *e) {
    bool ok = cuda_nccl_group(true);
    for (int k = 0; ok && k < e->n_shard_updates; k++)
        if (e->shard_updates[k].amax) ok = cuda_nccl_all_reduce_max_f32(e->shard_updates[k].amax, 1, e->stream);
    ok = cuda_nccl_group(false) && ok;
    ok = ok && cuda_nccl_group(true);
    for (int k = 0; ok && k < e->n_shard_updates; k++) {
        const ExecShardUpdate *u = &e->shard_updates[k];
        if (u->gathered) continue;   /* --shard-states=3: kept as shards, gathered by the step */
        for (int q = 0; ok && q < e->shard_world; q++) {
            RtShard s = rt_shard_of(u->n, u->group, e->shard_world, q);
            if (!s.len) continue;
            ok = cuda_nccl_broadcast_bytes(u->param + (CUdeviceptr)(s.off * u->param_eb), s.len * u->param_eb, q,
                                           e->stream);
            if (ok && u->copy)
                ok = cuda_nccl_broadcast_bytes(u->copy + (CUdeviceptr)(s.off * u->copy_eb), s.len * u->copy_eb, q,
                                               e->stream);
        }
    }
    ok = cuda_nccl_group(false) && ok;
    /* stage 2 keeps only the shard, which the update kernel zeroed as it read it */
    for (int k = 0; ok && !e->shard_grads && k < e->n_shard_updates; k++)
        ok = CU_CHECK(CU(cuMemsetD8Async)(e->shard_updates[k].grad, 0, (size_t)e->shard_updates[k].grad_bytes,
                                          e->stream));
    return ok;
}

static bool launch_range(CudaExec *e, int from, int to) {
    ExecList *L = &e->lists[LIST_UPDATE];
    for (int i = from; i < to; i++)
        if (!exec_launch(e, &L->l[i])) return false;
    return true;
}

static bool launch_update(CudaExec *e, void *unused) {
    (void)unused;
    return launch_norms(e) && launch_range(e, e->norm_end, e->upd_end) &&
           gather_weights(e) && launch_range(e, e->upd_end, e->lists[LIST_UPDATE].n);
}

bool exec_shard_run_update(CudaExec *e) {
    ExecList *G = &e->shard_graph;
    if (!e->graphs || e->sync_each || e->profile || !e->shard_warm) {
        e->shard_warm = true;   /* NCCL has set up its connections for these collectives */
        return launch_update(e, NULL);
    }
    return exec_replay(e, G, launch_update, NULL);
}

/* ---------------------------------------------------------------- checkpoints */

bool cuda_exec_gather(CudaExec *e, Tensor *const *ts, int n) {
    (void)ts, (void)n;   /* every sharded tensor: a checkpoint holds them all */
    if (!e->shard) return true;
    if (!cuda_exec_sync(e)) return false;
    int64_t most = 0;
    for (int i = 0; i < e->n_shard_tensors; i++)
        for (int q = 1; q < e->shard_world; q++) {
            int64_t lo, hi;
            tensor_range(e, &e->shard_tensors[i], q, &lo, &hi);
            if (hi - lo > most) most = hi - lo;
        }
    CUdeviceptr buf = 0;
    if (e->shard_rank == 0 && most && !CU_CHECK(CU(cuMemAlloc_v2)(&buf, (size_t)most))) return false;
    cuda_nccl_arm("gathering the sharded optimizer state to rank 0");
    bool ok = true;
    for (int i = 0; ok && i < e->n_shard_tensors; i++) {
        for (int q = 1; ok && q < e->shard_world; q++) {
            int64_t lo, hi;
            tensor_range(e, &e->shard_tensors[i], q, &lo, &hi);
            if (hi == lo) continue;
            if (e->shard_rank == q) {
                ok = cuda_nccl_send_bytes(exec_shard_map(e, lo), hi - lo, 0, e->stream) && cuda_exec_sync(e);
            } else if (e->shard_rank == 0) {
                ok = cuda_nccl_recv_bytes(buf, hi - lo, q, e->stream) && cuda_exec_sync(e) &&
                     CU_CHECK(CU(cuMemcpyDtoH_v2)((char *)e->host.persistent + lo, buf, (size_t)(hi - lo)));
            }
        }
    }
    cuda_nccl_disarm();
    if (buf) CU(cuMemFree_v2)(buf);
    return ok;
}

void exec_shard_close(CudaExec *e) {
    if (e->shard_graph.exec) CU(cuGraphExecDestroy)(e->shard_graph.exec);
    if (e->shard_graph.graph) CU(cuGraphDestroy)(e->shard_graph.graph);
    free(e->shard_updates);
    free(e->shard_tensors);
    free(e->shard_segs);
    free(e->norm_final);
}

bool cuda_exec_sharded(const CudaExec *e) { return e->shard; }
int64_t cuda_exec_persistent_bytes(const CudaExec *e) { return e->persistent_alloc; }
