/* comm_grads.c — sharded gradients (--shard-states=2, ZeRO stage 2): where the backward writes.
 *
 * Stage 1 keeps every gradient accumulator whole on every rank: 2 bytes a parameter at bf16,
 * the largest thing left after the states are sharded. Stage 2 keeps persistently only the
 * accumulator's shard that the rank updates (the update's shard, comm_shard.c, on the same
 * codec-group boundaries), and the backward writes each bucket of gradients (comm_buckets.c)
 * into a transient buffer. When the backward has finished the bucket, each of its gradients is
 * reduced to the owners of its shards, straight into their shard accumulators, and the buffer
 * can take a later bucket. This happens every micro-step: with --grad-accum K the shards sum K
 * reductions (what ZeRO-2 does with a reduce-scatter per micro-step).
 *
 * The order of the sums. Before each micro-step's backward the owner of a shard copies its
 * shard accumulator into the bucket buffer's range of that shard (the other ranges start at
 * zero), so its backward adds its own gradient to its running sum as one GPU's accumulator
 * adds a micro-step's; the reduce to the owner then adds the other ranks' buffers. Per element
 * of shard q, micro-step m, accumulator format fmt (bf16 or f32), g the gradients as the
 * backward rounds them into the buffer:
 *
 *     A_0 = 0,   A_m = fmt(... fmt(fmt(A_(m-1) + g_(q,m)) + g_(q+1,m)) ... + g_(q-1,m))
 *
 * the other ranks in NCCL's order for a reduce to root q (on two ranks the one addition;
 * ref_reduce_to_owner takes them in rank order after the owner). With one micro-step that is
 * A_1 = fmt(g_q + ...), the sum stage 1 computes, bit for bit on two ranks; with several it
 * sums ranks within a micro-step and then micro-steps, where stage 1 sums each rank's
 * micro-steps and then the ranks: another rounding order of the same sum (with f32
 * accumulators, another order of f32 additions).
 *
 * The buffers. A bucket's buffer is live from the first launch that writes one of its
 * gradients (a tied embedding's first write comes early in the backward, though its bucket
 * leaves last) until its reduction has run, which is on NCCL's stream, after the launch where
 * it was sent. A buffer is reused by a later bucket only if the earlier one was sent before the
 * later one's first write; the executor then makes that write wait for the reduction (an
 * event). Buckets take buffers in the order of their first writes, each the free buffer sent
 * longest ago that holds it (else the one that is largest, grown), else a new one. "Free"
 * asks a little more than correctness does: the earlier bucket was sent before the first
 * write of the bucket opened just before this one, so that NCCL has a bucket's worth of
 * backward to finish it before anything waits (two buffers take turns, where one would make
 * the backward wait for every reduction). Positions are node indices: the plan uses the graph's (the
 * producer of the first accumulated value, the last ACCUMULATE), the executor its launch
 * plans' (cuda/exec_grads.c); both place buffers by rt_grad_slots. */
#include <stdlib.h>
#include <string.h>

#include "rt.h"

int rt_shard_stage(const Graph *g) {
    int stage = 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_ALL_REDUCE && IR_IATTR(g->nodes[i], ALL_REDUCE, shard) > stage)
            stage = (int)IR_IATTR(g->nodes[i], ALL_REDUCE, shard);
    return stage;
}

static int position(const Graph *g, const Node *n) {
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i] == n) return i;
    return g->n_nodes;
}

void rt_grad_bucket_span(const Graph *g, const RtCommPlan *cp, int *open, int *sent) {
    for (int b = 0; b < cp->n_buckets; b++) {
        const RtBucket *k = &cp->buckets[b];
        open[b] = k->last;
        sent[b] = k->last;
        for (int i = k->first; i < k->first + k->count; i++)
            for (const Node *a = cp->reduce[i]->in[0]; a->op == OP_ACCUMULATE; a = a->in[0]) {
                int at = position(g, a), from = position(g, a->in[1]);
                if (at < open[b]) open[b] = at;
                if (from < open[b]) open[b] = from;
            }
    }
}

int64_t rt_grad_tensor_bytes(const Node *reduce) {
    int64_t b = ir_numel(&reduce->t) * fmt_elem_bytes(reduce->t.fmt.elem);
    return (b + RT_GRAD_ALIGN - 1) / RT_GRAD_ALIGN * RT_GRAD_ALIGN;
}

bool rt_grad_slots(const RtCommPlan *cp, const int *open, const int *sent, RtGradSlots *s) {
    memset(s, 0, sizeof *s);
    int nb = cp->n_buckets, n = nb ? nb : 1;
    s->slot = malloc(sizeof *s->slot * (size_t)n);
    s->slot_at = calloc((size_t)n, sizeof *s->slot_at);
    s->slot_bytes = calloc((size_t)n, sizeof *s->slot_bytes);
    s->at = malloc(sizeof *s->at * (size_t)(cp->n_reduce ? cp->n_reduce : 1));
    int *order = malloc(sizeof *order * (size_t)n), *last = malloc(sizeof *last * (size_t)n);
    if (!s->slot || !s->slot_at || !s->slot_bytes || !s->at || !order || !last) {
        free(order);
        free(last);
        rt_grad_slots_free(s);
        return false;
    }
    /* each gradient's place in its bucket's buffer */
    int64_t *need = calloc((size_t)n, sizeof *need);
    if (!need) {
        free(order);
        free(last);
        rt_grad_slots_free(s);
        return false;
    }
    for (int b = 0; b < nb; b++) {
        const RtBucket *k = &cp->buckets[b];
        for (int i = k->first; i < k->first + k->count; i++) {
            s->at[i] = need[b];
            need[b] += rt_grad_tensor_bytes(cp->reduce[i]);
        }
    }
    /* the buckets in the order their first gradients are written (stable: ties in bucket order) */
    for (int b = 0; b < nb; b++) order[b] = b;
    for (int i = 1; i < nb; i++)
        for (int j = i; j > 0 && open[order[j - 1]] > open[order[j]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    for (int o = 0; o < nb; o++) {
        int b = order[o], pick = -1;
        /* free: its last bucket was sent before the previous bucket's first write (so that
         * NCCL has that bucket's backward to finish it: two buffers take turns); prefer one
         * that holds b, sent longest ago; else the largest free one */
        int before = o ? open[order[o - 1]] : open[b];
        for (int k = 0; k < s->n_slots; k++) {
            if (sent[last[k]] >= before) continue;
            if (pick < 0) {
                pick = k;
                continue;
            }
            bool fits = s->slot_bytes[k] >= need[b], pick_fits = s->slot_bytes[pick] >= need[b], better;
            if (fits != pick_fits) better = fits;
            else if (fits) better = sent[last[k]] < sent[last[pick]];
            else better = s->slot_bytes[k] > s->slot_bytes[pick];
            if (better) pick = k;
        }
        if (pick < 0) pick = s->n_slots++;
        if (s->slot_bytes[pick] < need[b]) s->slot_bytes[pick] = need[b];
        last[pick] = b;
        s->slot[b] = pick;
    }
    for (int k = 0; k < s->n_slots; k++) {
        s->slot_at[k] = s->bytes;
        s->bytes += s->slot_bytes[k];
    }
    free(need);
    free(order);
    free(last);
    return true;
}

void rt_grad_slots_free(RtGradSlots *s) {
    free(s->slot);
    free(s->slot_at);
    free(s->slot_bytes);
    free(s->at);
    memset(s, 0, sizeof *s);
}

int64_t rt_grad_buffer_bytes(const Graph *g) {
    RtCommPlan cp;
    if (!rt_comm_plan(g, &cp)) return -1;
    int n = cp.n_buckets ? cp.n_buckets : 1;
    int *open = malloc(sizeof *open * (size_t)n), *sent = malloc(sizeof *sent * (size_t)n);
    RtGradSlots s = {0};
    int64_t bytes = -1;
    if (open && sent) {
        rt_grad_bucket_span(g, &cp, open, sent);
        if (rt_grad_slots(&cp, open, sent, &s)) bytes = s.bytes;
    }
    rt_grad_slots_free(&s);
    free(open);
    free(sent);
    rt_comm_plan_free(&cp);
    return bytes;
}
