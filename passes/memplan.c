/* memplan.c — every tensor of the training step at an offset in one of two arenas.
 *
 * The runtime makes two allocations and nothing else: the persistent arena (parameters,
 * gradient accumulators, master weights, Adam states, scales, amax histories — what survives
 * from one step to the next and goes into checkpoints) and the step arena (activations, saved
 * activations, backward temporaries, inputs, outputs). Tensor.offset is relative to the arena
 * of the tensor's role (ir_role_is_persistent), Tensor.bytes is numel x element size (an
 * attention's storage also holds the logsumexp of its rows: ir_storage_bytes); scale and
 * amax tensors of scaled formats are nodes of their own and are planned like any other.
 *
 * Persistent tensors are laid out one after the other in schedule order, each at a multiple of
 * 256 bytes: their lifetime is the whole run, so there is nothing to share.
 *
 * The step arena reuses memory. Over the schedule, each tensor lives from the node that makes
 * it (an input: from the start) to the last node that reads it (an output: to the end). Two
 * values that share storage — an in-place op's result and the operand it updates (ACCUMULATE
 * and its accumulator), a RESHAPE and the tensor it views (memplan_alias_of) — are one
 * allocation whose lifetime is the union of
 * theirs. The allocations are then packed by the greedy-by-size heuristic of TFLite's arena
 * planner and ggml-alloc: largest first, each placed in the smallest gap between the tensors
 * already placed whose lifetimes overlap its own, or above them all. It is not optimal (the
 * problem is NP-hard) but it is deterministic and on transformer steps lands close to the peak
 * of live bytes, which is a lower bound. The placed blocks whose lifetimes overlap a new one
 * are found through a segment tree over the schedule (below), not by a scan of all placed
 * blocks: a step with thousands of loss chunks has tens of thousands of short-lived blocks,
 * and the scan made packing quadratic (20 s for GPT-2 at batch 262144 x 16, minutes beyond).
 * With the tree the work is the number of overlaps found, times log n. The step
 * arena's size is the highest end of any placement. A forward GEMM's operands stay alive until
 * the adds that take its product are done (and a GELU of their result, with its FP8 copy under
 * delayed scaling), because the GPU backend computes those in the GEMM's epilogue and writes
 * their result while it still reads the operands. */
#include "passes.h"

#include <stdlib.h>
#include <string.h>

enum { MEM_ALIGN = 256 };

static int64_t align_up(int64_t x) { return (x + MEM_ALIGN - 1) / MEM_ALIGN * MEM_ALIGN; }

Node *memplan_alias_of(const Node *n)
{
    /* ACCUMULATE, AMAX_RECORD, DELAYED_SCALE: the result is the updated first operand */
    if (ir_op_is_inplace(n->op)) return n->t.fmt.elem == FMT_VOID ? NULL : n->in[0];
    if (n->op != OP_RESHAPE) return NULL;
    Node *x = n->in[0];
    const Format *a = &x->t.fmt, *b = &n->t.fmt;
    bool plain = a->scaling == SCALE_NONE && b->scaling == SCALE_NONE && a->codec == CODEC_PLAIN &&
                 b->codec == CODEC_PLAIN && !a->scale && !b->scale && !a->amax && !b->amax;
    if (!plain || a->elem != b->elem) return NULL;
    if (ir_role_is_persistent(x->t.role) != ir_role_is_persistent(n->t.role)) return NULL;
    return x;
}

static Node *alias_root(Node *n)
{
    Node *a;
    while ((a = memplan_alias_of(n))) n = a;
    return n;
}

typedef struct {
    Node *node;             /* the allocation's root */
    int64_t size;           /* aligned */
    int first, last;        /* schedule indices, inclusive */
} Block;

static int compare_blocks(const void *pa, const void *pb)
{
    const Block *a = pa, *b = pb;
    if (a->size != b->size) return (a->size < b->size) - (a->size > b->size);
    if (a->first != b->first) return (a->first > b->first) - (a->first < b->first);
    return (a->node->index > b->node->index) - (a->node->index < b->node->index);
}

static int compare_by_offset(const void *pa, const void *pb)
{
    const Block *a = *(Block *const *)pa, *b = *(Block *const *)pb;
    return (a->node->t.offset > b->node->t.offset) - (a->node->t.offset < b->node->t.offset);
}

/* ---------------------------------------------------------------- lifetimes as a segment tree
 *
 * Over schedule positions [0, size): a placed block is stored in cover[] of the O(log n) tree
 * nodes whose ranges make up its lifetime, and in below[] of those nodes and every node above
 * them. A query for [f, l] walks down the nodes that meet [f, l]: every block in cover[] of such
 * a node meets it, and where a node lies inside [f, l] every block in its below[] does, and the
 * walk stops there. A block can be found at several nodes; a stamp reports it once. */

typedef struct {
    int *items;
    int n, cap;
} IntList;

typedef struct {
    int size;               /* a power of two >= the number of positions */
    IntList *cover, *below; /* per tree node (1-based heap order) */
    int *stamp;             /* per block: the last query that reported it */
    int query;
} Lifetimes;

static void list_push(IntList *l, int x)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 4;
        l->items = realloc(l->items, sizeof(int) * (size_t)l->cap);
        IR_ASSERT(l->items);
    }
    l->items[l->n++] = x;
}

static void lifetimes_insert(Lifetimes *t, int node, int lo, int hi, int f, int l, int block)
{
    if (hi < f || l < lo) return;
    list_push(&t->below[node], block);
    if (f <= lo && hi <= l) {
        list_push(&t->cover[node], block);
        return;
    }
    int mid = lo + (hi - lo) / 2;
    lifetimes_insert(t, 2 * node, lo, mid, f, l, block);
    lifetimes_insert(t, 2 * node + 1, mid + 1, hi, f, l, block);
}

static void report(Lifetimes *t, const IntList *from, Block *blocks, Block **out, int *k)
{
    for (int i = 0; i < from->n; i++) {
        int b = from->items[i];
        if (t->stamp[b] == t->query) continue;
        t->stamp[b] = t->query;
        out[(*k)++] = &blocks[b];
    }
}

static void lifetimes_query(Lifetimes *t, int node, int lo, int hi, int f, int l, Block *blocks, Block **out, int *k)
{
    if (hi < f || l < lo) return;
    report(t, &t->cover[node], blocks, out, k);
    if (f <= lo && hi <= l) {
        report(t, &t->below[node], blocks, out, k);
        return;
    }
    int mid = lo + (hi - lo) / 2;
    lifetimes_query(t, 2 * node, lo, mid, f, l, blocks, out, k);
    lifetimes_query(t, 2 * node + 1, mid + 1, hi, f, l, blocks, out, k);
}

/* Greedy by size, best fit: returns the arena size. */
static int64_t pack_blocks(Block *blocks, int n, int positions)
{
    qsort(blocks, (size_t)n, sizeof *blocks, compare_blocks);
    Block **overlap = malloc(sizeof(Block *) * (size_t)(n + 1));
    Lifetimes t = {.size = 1};
    while (t.size < positions) t.size *= 2;
    t.cover = calloc((size_t)(2 * t.size), sizeof(IntList));
    t.below = calloc((size_t)(2 * t.size), sizeof(IntList));
    t.stamp = calloc((size_t)(n + 1), sizeof(int));
    IR_ASSERT(overlap && t.cover && t.below && t.stamp);
    int64_t top = 0;
    for (int i = 0; i < n; i++) {
        Block *b = &blocks[i];
        int k = 0;
        t.query = i + 1;
        lifetimes_query(&t, 1, 0, t.size - 1, b->first, b->last, blocks, overlap, &k);
        qsort(overlap, (size_t)k, sizeof *overlap, compare_by_offset);
        int64_t at = -1, best_gap = 0, prev_end = 0;
        for (int j = 0; j < k; j++) {
            int64_t gap = overlap[j]->node->t.offset - prev_end;
            if (gap >= b->size && (at < 0 || gap < best_gap)) {
                at = prev_end;
                best_gap = gap;
            }
            int64_t end = overlap[j]->node->t.offset + overlap[j]->size;
            if (end > prev_end) prev_end = end;
        }
        if (at < 0) at = prev_end;
        b->node->t.offset = at;
        if (at + b->size > top) top = at + b->size;
        lifetimes_insert(&t, 1, 0, t.size - 1, b->first, b->last, i);
    }
    for (int i = 0; i < 2 * t.size; i++) free(t.cover[i].items), free(t.below[i].items);
    free(t.cover);
    free(t.below);
    free(t.stamp);
    free(overlap);
    return top;
}

bool pass_memplan(Graph *g, const PassOptions *opt)
{
    (void)opt;
    int n = g->n_nodes;
    ir_renumber(g);
    for (int i = 0; i < n; i++) {
        Tensor *t = &g->nodes[i]->t;
        t->bytes = ir_storage_bytes(g->nodes[i]);
        t->offset = -1;
    }

    /* persistent arena: in order, aligned */
    int64_t persistent = 0;
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        if (memplan_alias_of(v) || !ir_role_is_persistent(v->t.role) || v->t.bytes == 0) continue;
        v->t.offset = persistent;
        persistent = align_up(persistent + v->t.bytes);
    }

    /* step arena: lifetimes of allocation roots over the schedule */
    int *first = malloc(sizeof(int) * (size_t)(n + 1));
    int *last = malloc(sizeof(int) * (size_t)(n + 1));
    IR_ASSERT(first && last);
    for (int i = 0; i < n; i++) {
        first[i] = g->nodes[i]->op == OP_INPUT ? 0 : i;
        last[i] = i;
    }
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        int r = alias_root(v)->index;
        if (first[i] < first[r]) first[r] = first[i];
        if (v->t.role == ROLE_OUTPUT) last[r] = n - 1;
        if (i > last[r]) last[r] = i;
        for (int j = 0; j < v->n_in; j++) {
            int x = alias_root(v->in[j])->index;
            if (i > last[x]) last[x] = i;
        }
    }
    /* a forward GEMM's operands are read until the end of the chain of adds that takes its product
     * (its only reader, then that one's only reader): the GPU backend runs such a chain as
     * one GEMM whose epilogue writes the chain's last result (cuda/spec.c), which must not
     * land on an operand the GEMM is still reading. The epilogue may also apply a GELU that
     * reads the chain's result, and write the GELU's value, or under delayed scaling the
     * value's FP8 copy (whose amax record and quantize are then all that read the GELU):
     * the operands are then read until those too. */
    Uses *uses = ir_fill_uses(g);
    for (int i = 0; i < n; i++) {
        Node *m = g->nodes[i];
        if (m->op != OP_MATMUL || m->phase != PHASE_FORWARD) continue;
        Node *end = m;
        for (int k = 0; k < 3 && uses[end->index].n == 1; k++) {
            Node *c = uses[end->index].list[0];
            if ((c->op != OP_ADD && c->op != OP_ADD_N && c->op != OP_ACCUMULATE) || c->phase != m->phase) break;
            end = c;
        }
        int until = end->index;
        for (int k = 0; end != m && k < uses[end->index].n; k++) {
            Node *y = uses[end->index].list[k];
            if (y->op != OP_GELU || y->phase != m->phase) continue;
            const Uses *u = &uses[y->index];
            bool copy_only = u->n == 2;
            for (int j = 0; j < u->n; j++)
                copy_only &= u->list[j]->op == OP_QUANTIZE || u->list[j]->op == OP_AMAX_RECORD;
            /* a GELU whose value keeps block maxima for a current scale stays a kernel of its own */
            if (!copy_only && ir_amax_parts_offset(y)) continue;
            if (y->index > until) until = y->index;
            for (int j = 0; copy_only && j < u->n; j++)
                if (u->list[j]->index > until) until = u->list[j]->index;
        }
        for (int j = 0; j < m->n_in; j++) {
            int x = alias_root(m->in[j])->index;
            if (until > last[x]) last[x] = until;
        }
    }
    /* a scaled tensor is read and written together with its scale and amax tensors */
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        Node *refs[2] = {v->t.fmt.scale, v->t.fmt.amax};
        int r = alias_root(v)->index;
        for (int k = 0; k < 2; k++) {
            if (!refs[k]) continue;
            int s = alias_root(refs[k])->index;
            if (first[r] < first[s]) first[s] = first[r];
            if (last[r] > last[s]) last[s] = last[r];
        }
    }
    Block *blocks = malloc(sizeof(Block) * (size_t)(n + 1));
    IR_ASSERT(blocks);
    int n_blocks = 0;
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        if (memplan_alias_of(v) || ir_role_is_persistent(v->t.role) || v->t.bytes == 0) continue;
        blocks[n_blocks++] = (Block){v, align_up(v->t.bytes), first[i], last[i]};
    }
    int64_t transient = pack_blocks(blocks, n_blocks, n);
    free(blocks);
    free(first);
    free(last);

    /* aliases take their root's place; schedule order makes roots come first */
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        if (!memplan_alias_of(v)) continue;
        Node *r = alias_root(v);
        if (ir_role_is_persistent(r->t.role) != ir_role_is_persistent(v->t.role))
            ir_die(__FILE__, __LINE__, "memplan: node %%%d (%s) shares the storage of %%%d (%s)",
                   v->id, ir_role_name(v->t.role), r->id, ir_role_name(r->t.role));
        v->t.offset = r->t.offset;
    }
    g->persistent_bytes = persistent;
    g->transient_bytes = transient;
    return true;
}

void memplan_summarize(const Graph *g, MemSummary *out)
{
    memset(out, 0, sizeof *out);
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *v = g->nodes[i];
        if (v->op == OP_PARAM) out->n_params += ir_numel(&v->t);
        if (memplan_alias_of(v) || v->t.offset < 0) continue;
        out->by_role[v->t.role] += v->t.bytes;
    }
    out->persistent = g->persistent_bytes;
    out->transient = g->transient_bytes;
}
