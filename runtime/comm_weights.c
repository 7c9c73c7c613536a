/* comm_weights.c — sharded weights (--shard-states=3, ZeRO stage 3 / FSDP): what is gathered,
 * in which format, when, and into which buffer.
 *
 * Stage 2 leaves one thing whole on every GPU: the weights the forward and backward read, 2
 * bytes a parameter in bf16. Stage 3 keeps of each large weight only the rank's shard (the
 * update's shard, comm_shard.c, on the same codec-group boundaries as its master, states and
 * gradient), and makes the whole weight exist only while a layer computes: before the step's
 * first use of a layer's weights, in the forward and again in the backward, the layer's
 * weights are all-gathered into a transient buffer, and the buffer is free again after the
 * layer's last use in that phase.
 *
 * What travels is what the GEMMs read, so that the bytes gathered are the fewest and the copy
 * each rank ends with is the one a single GPU makes:
 *  - A weight the level quantizes per use with one scale per tensor (-O3: quant_scale, then
 *    quantize to e4m3) is gathered in e4m3. Each rank finds its shard's amax, an all-reduce
 *    (max) of that one float gives every rank the whole tensor's amax, so every rank derives
 *    the same scale (the max of the shards' maxima is the whole maximum); each owner quantizes
 *    its shard with it and the codes are all-gathered. Quantizing is elementwise, so the
 *    gathered copy is the unsharded quantize's, byte for byte. The backward's quantize reuses
 *    the forward's scale (as one GPU does) and gathers again, with no all-reduce.
 *  - A weight whose FP8 copy the update writes (-O1/-O2: the weight_copy state, delayed
 *    scaling) is sharded with its copy; the copy's shards are gathered. Their scale is the
 *    delayed one every rank agrees on already (stage 1 all-reduces the amax in the update).
 *  - A weight a GEMM reads in bf16 (-O0), or whose quantize is scaled per row, group or block
 *    (a recipe), is gathered in bf16 and, for such a recipe, quantized whole on every rank: its
 *    scales need the whole rows or blocks, which the shards do not respect.
 * Everything else stays whole, as in stage 2: vectors (norm weights, biases: a few KiB a
 * layer, where a gather would cost more in latency than it saves) and any weight something
 * other than a GEMM reads (the token and position embeddings, read by the embedding's gather;
 * GPT-2's tied output head shares the token embedding). The plan lists both counts.
 *
 * A layer is the weights whose names share the prefix up to the first number (`h.7.`); a
 * weight with no number in its name is a layer of its own. Per phase, layers are gathered in
 * the order of their first reader; layer k's gather is issued when layer k-1's first reader
 * runs (a prefetch of one layer ahead, so that the gather overlaps layer k-1's compute), the
 * first layer's at its own first reader. Buffers are taken greedily: a gather takes the
 * free buffer (its last gather's last reader ran before this gather's issue) that holds it or
 * is largest, else a new one; with layers that do not interleave that is two buffers a
 * phase, reused by the next phase, so the step needs twice the largest layer. They are an
 * area of their own beside the step arena, counted in the plan's per-GPU peak (as stage 2's
 * gradient buffers are); the step arena still holds the quantize results the gathers
 * replace, so the figure is an upper bound. Positions are node indices of the scheduled
 * graph, as for the gradient buckets.
 *
 * cuda/exec_gather.c runs this plan on the GPUs: each gather a group of broadcasts of the
 * owners' shards (per-tensor shards padded to groups are not ncclAllGather's equal pieces),
 * at these positions on NCCL's stream; the readers resolved into the buffers. It gathers the
 * forward's e4m3 quantizes as planned (amax, all-reduce, scale, the owners' quantize); the
 * backward's quantizes write the transposed layouts too, so there it gathers the bf16 weight
 * and runs the step's own quantize on it: the same bits, twice these bytes. */
#include <stdlib.h>
#include <string.h>

#include "rt.h"

/* The update of parameter p (ADAMW, LION, SGD with p as in[0]). */
static const Node *update_of(const Graph *g, const Node *p)
{
    for (int i = 0; i < g->n_nodes; i++)
        if (ir_op_is_update(g->nodes[i]->op) && g->nodes[i]->in[0] == p) return g->nodes[i];
    return NULL;
}

static bool reads(const Node *n, const Node *x)
{
    for (int k = 0; k < n->n_in; k++)
        if (n->in[k] == x) return true;
    return false;
}

static bool per_tensor_fp8(const Format *f)
{
    return (f->elem == FMT_E4M3 || f->elem == FMT_E5M2) && f->scaling == SCALE_PER_TENSOR;
}

/* How the step's forward and backward read parameter p (copy: its update's FP8 copy or NULL):
 * RT_GATHER_NONE when p stays whole. */
static RtGatherHow how_read(const Graph *g, const Node *p, const Node *copy)
{
    if (p->t.rank < 2) return RT_GATHER_NONE;
    RtGatherHow how = RT_GATHER_NONE;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->phase == PHASE_UPDATE) continue;
        if (copy && reads(n, copy)) {
            if (n->op != OP_MATMUL && n->op != OP_TRANSPOSE) return RT_GATHER_NONE;
            how = how == RT_GATHER_NONE || how == RT_GATHER_COPY ? RT_GATHER_COPY : RT_GATHER_BF16;
        }
        if (!reads(n, p)) continue;
        RtGatherHow h;
        if (n->op == OP_QUANT_SCALE)
            h = IR_IATTR(n, QUANT_SCALE, scaling) == SCALE_PER_TENSOR ? RT_GATHER_FP8 : RT_GATHER_BF16;
        else if (n->op == OP_QUANTIZE && n->in[0] == p)
            h = per_tensor_fp8(&n->t.fmt) ? RT_GATHER_FP8 : RT_GATHER_BF16;
        else if (n->op == OP_MATMUL || n->op == OP_TRANSPOSE || n->op == OP_QUANTIZE)
            h = RT_GATHER_BF16;
        else
            return RT_GATHER_NONE;   /* an embedding, a norm: kept whole */
        /* one format a weight: any bf16 reader makes the whole weight travel in bf16 */
        how = how == RT_GATHER_NONE || how == h ? h : RT_GATHER_BF16;
    }
    return how;
}

/* The layer of a weight: its name up to and including the first all-digit component. */
static int layer_key_len(const char *name)
{
    const char *s = name;
    while (*s) {
        const char *e = strchr(s, '.');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        bool digits = len > 0;
        for (size_t k = 0; k < len; k++) digits = digits && s[k] >= '0' && s[k] <= '9';
        if (digits) return (int)(s - name + (ptrdiff_t)len);
        if (!e) break;
        s = e + 1;
    }
    return (int)strlen(name);
}

static int layer_of(RtGatherPlan *p, const char *name)
{
    int len = layer_key_len(name);
    for (int k = 0; k < p->n_layers; k++)
        if ((int)strlen(p->layers[k]) == len && !strncmp(p->layers[k], name, (size_t)len)) return k;
    char *s = malloc((size_t)len + 1);
    IR_ASSERT(s);
    memcpy(s, name, (size_t)len);
    s[len] = 0;
    p->layers = realloc(p->layers, sizeof(char *) * (size_t)(p->n_layers + 1));
    IR_ASSERT(p->layers);
    p->layers[p->n_layers] = s;
    return p->n_layers++;
}

/* The items a phase gathers for weight w: what lands in a buffer, and the nodes that read it. */
static void add_item(RtGatherPlan *p, const RtGatherWeight *w, Phase phase, const Node *target, ElemType wire,
                     int64_t buffer_bytes)
{
    for (int k = 0; k < p->n_items; k++)
        if (p->items[k].target == target && p->items[k].phase == phase) return;
    p->items = realloc(p->items, sizeof *p->items * (size_t)(p->n_items + 1));
    IR_ASSERT(p->items);
    p->items[p->n_items++] = (RtGatherItem){.weight = (int)(w - p->weights), .phase = phase, .target = target,
                                            .wire = wire, .bytes = ir_numel(&target->t) * fmt_elem_bytes(wire),
                                            .buffer_bytes = buffer_bytes};
}

static void items_of(const Graph *g, RtGatherPlan *p, const RtGatherWeight *w)
{
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->phase == PHASE_UPDATE) continue;
        if (w->copy && reads(n, w->copy))
            add_item(p, w, n->phase, w->copy, w->copy->t.fmt.elem, rt_storage_bytes(w->copy));
        if (!reads(n, w->param)) continue;
        if (w->how == RT_GATHER_FP8 && n->op == OP_QUANTIZE)
            add_item(p, w, n->phase, n, n->t.fmt.elem, rt_storage_bytes(n));
        else if (w->how == RT_GATHER_BF16)
            add_item(p, w, n->phase, w->param, w->param->t.fmt.elem, rt_storage_bytes(w->param));
    }
}

/* The first and last node position that reads what item it holds (a quantize's result: its
 * readers; a weight or copy: the readers in the item's phase). */
static void item_span(const Graph *g, const RtGatherItem *it, int *first, int *last)
{
    *first = g->n_nodes, *last = -1;
    bool result = it->target->op == OP_QUANTIZE;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->phase != it->phase) continue;
        /* a quantize's result is made from the amax its scale is found from (the forward's
         * quant_scale of the same weight): the gather, which all-reduces that amax, comes first */
        const Node *qs = result ? it->target->in[1] : NULL;
        bool scale_of_it = qs && n == qs && qs->op == OP_QUANT_SCALE && qs->in[0] == it->target->in[0];
        bool uses = result ? (n == it->target || reads(n, it->target) || scale_of_it) : reads(n, it->target);
        if (!uses) continue;
        if (i < *first) *first = i;
        if (i > *last) *last = i;
    }
}

static int cmp_gather(const void *a, const void *b)
{
    const RtGather *x = a, *y = b;
    return x->first != y->first ? (x->first > y->first) - (x->first < y->first) : (x->layer > y->layer) - (x->layer < y->layer);
}

bool rt_gather_plan(const Graph *g, int ranks, RtGatherPlan *p)
{
    memset(p, 0, sizeof *p);
    p->ranks = ranks;
    if (rt_shard_stage(g) < 3) return true;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->op != OP_PARAM) continue;
        const Node *u = update_of(g, n);
        int at = u ? ir_adamw_copy_index(u) : -1;
        const Node *copy = at >= 0 ? u->in[at] : NULL;
        RtGatherHow how = u ? how_read(g, n, copy) : RT_GATHER_NONE;
        int64_t bytes = rt_storage_bytes(n);
        if (how == RT_GATHER_NONE) {
            p->whole_params++;
            p->whole_bytes += bytes;
            if (n->t.rank >= 2) p->whole_matrices++;
            continue;
        }
        p->weights = realloc(p->weights, sizeof *p->weights * (size_t)(p->n_weights + 1));
        IR_ASSERT(p->weights);
        RtGatherWeight *w = &p->weights[p->n_weights++];
        *w = (RtGatherWeight){.param = n, .update = u, .copy = copy,
                              .how = how, .layer = layer_of(p, n->t.name ? n->t.name : "")};
        p->sharded_bytes += bytes;
        items_of(g, p, w);
        if (how == RT_GATHER_FP8) p->amax_values++;
    }
    /* one gather per (phase, layer): its items, its span */
    for (int k = 0; k < p->n_items; k++) {
        RtGatherItem *it = &p->items[k];
        int layer = p->weights[it->weight].layer, at = -1;
        for (int j = 0; j < p->n_gathers; j++)
            if (p->gathers[j].layer == layer && p->gathers[j].phase == it->phase) at = j;
        if (at < 0) {
            p->gathers = realloc(p->gathers, sizeof *p->gathers * (size_t)(p->n_gathers + 1));
            IR_ASSERT(p->gathers);
            at = p->n_gathers++;
            p->gathers[at] = (RtGather){.layer = layer, .phase = it->phase, .first = g->n_nodes, .last = -1};
        }
        RtGather *ga = &p->gathers[at];
        int first, last;
        item_span(g, it, &first, &last);
        if (first < ga->first) ga->first = first;
        if (last > ga->last) ga->last = last;
        it->at = ga->bytes_buffer;
        ga->bytes_buffer += (it->buffer_bytes + RT_GATHER_ALIGN - 1) / RT_GATHER_ALIGN * RT_GATHER_ALIGN;
        ga->bytes += it->bytes;
        if (it->wire == FMT_BF16) p->gathered_bf16 += it->bytes;
        else p->gathered_fp8 += it->bytes;
    }
    qsort(p->gathers, (size_t)p->n_gathers, sizeof *p->gathers, cmp_gather);
    /* items refer to their gather by index once the gathers are in order */
    for (int k = 0; k < p->n_items; k++)
        for (int j = 0; j < p->n_gathers; j++)
            if (p->gathers[j].layer == p->weights[p->items[k].weight].layer &&
                p->gathers[j].phase == p->items[k].phase)
                p->items[k].gather = j;
    /* prefetch one layer ahead within a phase; buffers taken greedily */
    int64_t *free_after = calloc((size_t)p->n_gathers + 1, sizeof(int64_t));
    p->buffer_bytes_each = calloc((size_t)p->n_gathers + 1, sizeof(int64_t));
    IR_ASSERT(free_after && p->buffer_bytes_each);
    for (int j = 0; j < p->n_gathers; j++) {
        RtGather *ga = &p->gathers[j];
        ga->issue = j > 0 && p->gathers[j - 1].phase == ga->phase ? p->gathers[j - 1].first : ga->first;
        int best = -1;
        for (int b = 0; b < p->n_buffers; b++) {
            if (free_after[b] >= ga->issue) continue;
            if (best < 0) best = b;
            bool fits = p->buffer_bytes_each[b] >= ga->bytes_buffer, best_fits = p->buffer_bytes_each[best] >= ga->bytes_buffer;
            if ((fits && !best_fits) || (fits == best_fits && p->buffer_bytes_each[b] > p->buffer_bytes_each[best])) best = b;
        }
        if (best < 0) best = p->n_buffers++;
        if (p->buffer_bytes_each[best] < ga->bytes_buffer) p->buffer_bytes_each[best] = ga->bytes_buffer;
        free_after[best] = ga->last;
        ga->buffer = best;
    }
    p->buffer_at = calloc((size_t)p->n_buffers + 1, sizeof(int64_t));
    IR_ASSERT(p->buffer_at);
    for (int b = 0; b < p->n_buffers; b++) {
        p->buffer_at[b] = p->buffer_bytes;
        p->buffer_bytes += p->buffer_bytes_each[b];
    }
    free(free_after);
    int64_t n1 = ranks > 1 ? ranks - 1 : 0;
    p->sent_fp8 = p->gathered_fp8 * n1 / (ranks > 0 ? ranks : 1);
    p->sent_bf16 = p->gathered_bf16 * n1 / (ranks > 0 ? ranks : 1);
    return true;
}

void rt_gather_plan_free(RtGatherPlan *p)
{
    for (int k = 0; k < p->n_layers; k++) free(p->layers[k]);
    free(p->layers);
    free(p->weights);
    free(p->items);
    free(p->gathers);
    free(p->buffer_bytes_each);
    free(p->buffer_at);
    memset(p, 0, sizeof *p);
}

const RtGatherWeight *rt_gather_weight(const RtGatherPlan *p, const Node *param)
{
    for (int k = 0; k < p->n_weights; k++)
        if (p->weights[k].param == param) return &p->weights[k];
    return NULL;
}
