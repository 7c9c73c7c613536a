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
 * of live bytes, which is a lower bound. The bytes taken by the placed blocks whose lifetimes
 * overlap a new one are found through a segment tree over the schedule that keeps them as
 * unions of extents (below), not by a scan of the placed blocks. The step
 * arena's size is the highest end of any placement. A forward GEMM's operands stay alive until
 * the adds that take its product are done (and a GELU of their result, with its FP8 copy under
 * delayed scaling), because the GPU backend computes those in the GEMM's epilogue and writes
 * their result while it still reads the operands. */
#include "passes.h"

#include <stdlib.h>
#include <string.h>

enum { MEM_ALIGN = 256 };

static int64_t align_up(int64_t x) { return (x + MEM_ALIGN - 1) / MEM_ALIGN * MEM_ALIGN; }

/* Whether two formats store the same plain elements (no scaling, no codec, no scale or amax
 * tensor beside them): one value's bytes read as the other's */
static bool plain_alike(const Format *a, const Format *b)
{
    return a->elem == b->elem && a->scaling == SCALE_NONE && b->scaling == SCALE_NONE && a->codec == CODEC_PLAIN &&
           b->codec == CODEC_PLAIN && !a->scale && !b->scale && !a->amax && !b->amax;
}

Node *memplan_alias_of(const Node *n)
{
    /* ACCUMULATE, AMAX_RECORD, DELAYED_SCALE: the result is the updated first operand */
    if (ir_op_is_inplace(n->op)) return n->t.fmt.elem == FMT_VOID ? NULL : n->in[0];
    /* a sum in the storage of one of its terms (mark_in_place_sums) */
    if (n->op == OP_ADD_N && IR_IATTR(n, ADD_N, in_place) > 0 && IR_IATTR(n, ADD_N, in_place) <= n->n_in)
        return n->in[IR_IATTR(n, ADD_N, in_place) - 1];
    if (n->op != OP_RESHAPE) return NULL;
    Node *x = n->in[0];
    if (!plain_alike(&x->t.fmt, &n->t.fmt)) return NULL;
    if (ir_role_is_persistent(x->t.role) != ir_role_is_persistent(n->t.role)) return NULL;
    return x;
}

static Node *alias_root(Node *n)
{
    Node *a;
    while ((a = memplan_alias_of(n))) n = a;
    return n;
}

/* v (and its scale) live at least until node i */
static void live_until(const Node *v, int i, int *last) {
    const Node *refs[2] = {v, v->t.fmt.scale};
    for (int j = 0; j < 2; j++) {
        if (!refs[j]) continue;
        int x = alias_root((Node *)refs[j])->index;
        if (i > last[x]) last[x] = i;
    }
}

/* A copy that may rerun its producer (ir_quantize_may_rerun_producer: the GPU backend then runs
 * the producer's kernel again at the copy's place instead of storing its value) reads the
 * producer's inputs there, so they (and their scales) live until then. Where the inputs outlive the copy anyway (-O1's saved GELU input)
 * this changes nothing; at -O2/-O3, where the GELU's input is saved only as its 1x16 copy,
 * it keeps the bf16 input two nodes longer instead of storing the GELU's value. */
static void extend_for_producer_reruns(const Graph *g, const Uses *uses, int *last) {
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *q = g->nodes[i];
        if (!ir_quantize_may_rerun_producer(q, uses)) continue;
        const Node *y = q->in[0];
        for (int k = 0; k < y->n_in; k++) live_until(y->in[k], i, last);
    }
}

/* An activation gradient (GELU_BWD, SILU_BWD) whose dy is a product that nothing else reads
 * (ir_inlined_product): the GPU backend computes the product inside the activation
 * gradient's kernel (cuda/spec_fuse.c, fuse_inline_elementwise: SwiGLU's silu_bwd(dy * up,
 * gate)) and reads the product's operands there, so they live until then. On Llama 1.1B the
 * MLP's dy then outlives the up projection's gradient GEMMs, which run in between. The choice
 * fuse.inline_elementwise=0 (at the product) keeps the lifetimes as they were. The same for
 * an activation that only a product reads (ir_inlined_activation): the product may compute it
 * from the activation's input (SwiGLU's silu(gate) * up at -O2 and -O3, where gate's value is
 * otherwise dead after the SiLU: the backward reads its FP8 copy), which then lives until the
 * product. */
static void extend_for_inline_products(const Graph *g, const Uses *uses, int *last) {
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *d = ir_inlined_product(g, g->nodes[i], uses), *act = ir_inlined_activation(g, g->nodes[i], uses);
        for (int k = 0; d && k < 2; k++) live_until(d->in[k], i, last);
        if (act) live_until(act->in[0], i, last);
    }
}

/* Whether value s can take c's storage: the same plain format (no scale, no block maxima
 * after it), the same bytes, both in the step arena. */
static bool storage_fits(const Node *c, const Node *s)
{
    return plain_alike(&c->t.fmt, &s->t.fmt) && c->t.bytes == s->t.bytes && c->t.bytes > 0 && c->op != OP_INPUT && c->op != OP_PARAM && c->t.role != ROLE_OUTPUT &&
           s->t.role != ROLE_OUTPUT && !ir_role_is_persistent(alias_root((Node *)c)->t.role) &&
           !ir_role_is_persistent(s->t.role);
}

/* A sum of two terms s = add_n(c, p), where p is a GEMM's product and c an earlier value, each
 * read by s alone, takes c's storage (ADD_N's in_place). The GPU backend computes such a sum in
 * p's GEMM (C = c, D = s), which it can only where s lands on no operand of the GEMM: given
 * bytes of its own, s took the bytes of a transposed weight that died at the GEMM in 42 of
 * Llama 1.1B's 43 sums of input gradients at -O1 (the q, k, v projections' and the MLP's), and
 * those GEMMs ran plain, each sum a launch of its own. On c's bytes it never does (c is live
 * while the GEMM runs), and it needs no bytes of its own. Every kernel of a sum reads each
 * element of its terms before it writes that element of the result. */
static void mark_in_place_sums(Graph *g, const Uses *uses)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *s = g->nodes[i];
        if (s->op != OP_ADD_N) continue;
        IR_IATTR(s, ADD_N, in_place) = 0;
        if (s->n_in != 2 || s->in[0] == s->in[1]) continue;
        for (int k = 0; k < 2; k++) {
            Node *c = s->in[k], *p = s->in[1 - k];
            if (p->op != OP_MATMUL || c->index > p->index || uses[p->index].n != 1 || uses[c->index].n != 1 ||
                !storage_fits(c, s))
                continue;
            IR_IATTR(s, ADD_N, in_place) = k + 1;
            break;
        }
    }
}

/* The GEMM of an in-place sum (mark_in_place_sums) runs at the sum's place, where the GPU
 * backend computes it with the sum in its epilogue (codegen/fuse.c: a group runs at its
 * root's place): its operands are read until the sum. Between the two there is at most the
 * weight gradient's GEMM of the same dy; without this its result could land on the GEMM's
 * transposed weight, dead after the GEMM's own place, and the sum ran as a launch of its own
 * (Llama 1.1B -O1: 17 of its 19 sums that were launches). */
static void extend_for_in_place_sums(const Graph *g, int *last)
{
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *s = g->nodes[i];
        int k = s->op == OP_ADD_N ? (int)IR_IATTR(s, ADD_N, in_place) : 0;
        if (!k) continue;
        const Node *p = s->in[2 - k];   /* in_place = k: the sum takes term k - 1's bytes */
        for (int j = 0; j < p->n_in; j++) live_until(p->in[j], i, last);
    }
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

/* ---------------------------------------------------------------- lifetimes as a segment tree
 *
 * Best fit needs, for a new block's lifetime [f, l], the bytes taken by the placed blocks that
 * live at some point of it: the union of their [offset, offset + size), whose gaps are the
 * candidates. The tree over schedule positions [0, size) keeps such unions, each as sorted,
 * disjoint extents (touching ones joined): cover[] of a tree node, the blocks whose lifetime
 * includes its whole range (a block goes into the O(log n) nodes that make up its lifetime),
 * and below[], the blocks that meet its range (those nodes and every node above them). A query
 * walks down the nodes that meet [f, l], taking cover[] of each and below[] of a node inside
 * [f, l], where it stops. Placed blocks pack into runs, so a union is a few extents where the
 * blocks are thousands (a deep model's saved activations during its backward): the scan of all
 * overlapping blocks, and before it of all placed blocks, made packing quadratic (20 s for
 * GPT-2 at batch 262144 x 16; 110 s for a 2,000-layer gpt2_tiny). The gaps are those the scan
 * found, so the plan is the same to the byte. */

typedef struct {
    int64_t lo, hi;
} Extent;

typedef struct {
    Extent *items;
    int n, cap;
} ExtentSet;

typedef struct {
    int size;                   /* a power of two >= the number of positions */
    ExtentSet *cover, *below;   /* per tree node (1-based heap order) */
} Lifetimes;

/* Adds [lo, hi) to the union, joining the extents it meets or touches. */
static void extents_add(ExtentSet *s, int64_t lo, int64_t hi)
{
    int a = 0, b = s->n;   /* first extent with its end at or after lo */
    while (a < b) {
        int m = a + (b - a) / 2;
        if (s->items[m].hi < lo) a = m + 1;
        else b = m;
    }
    int z = a;             /* past the last extent that starts at or before hi */
    while (z < s->n && s->items[z].lo <= hi) z++;
    if (z > a) {
        if (s->items[a].lo < lo) lo = s->items[a].lo;
        if (s->items[z - 1].hi > hi) hi = s->items[z - 1].hi;
    }
    int delta = 1 - (z - a);
    if (s->n + delta > s->cap) {
        s->cap = s->cap ? 2 * s->cap : 4;
        if (s->cap < s->n + delta) s->cap = s->n + delta;
        s->items = realloc(s->items, sizeof(Extent) * (size_t)s->cap);
        IR_ASSERT(s->items);
    }
    memmove(s->items + a + 1, s->items + z, sizeof(Extent) * (size_t)(s->n - z));
    s->items[a] = (Extent){lo, hi};
    s->n += delta;
}

static void lifetimes_insert(Lifetimes *t, int node, int lo, int hi, int f, int l, int64_t at, int64_t end)
{
    if (hi < f || l < lo) return;
    extents_add(&t->below[node], at, end);
    if (f <= lo && hi <= l) {
        extents_add(&t->cover[node], at, end);
        return;
    }
    int mid = lo + (hi - lo) / 2;
    lifetimes_insert(t, 2 * node, lo, mid, f, l, at, end);
    lifetimes_insert(t, 2 * node + 1, mid + 1, hi, f, l, at, end);
}

/* The unions a query found: each sorted, read in offset order by a merge. */
typedef struct {
    const ExtentSet **runs;
    int n, cap;
} Found;

static void take(Found *out, const ExtentSet *from)
{
    if (!from->n) return;
    if (out->n == out->cap) {
        out->cap = out->cap ? 2 * out->cap : 64;
        out->runs = realloc(out->runs, sizeof *out->runs * (size_t)out->cap);
        IR_ASSERT(out->runs);
    }
    out->runs[out->n++] = from;
}

static void lifetimes_query(const Lifetimes *t, int node, int lo, int hi, int f, int l, Found *out)
{
    if (hi < f || l < lo) return;
    take(out, &t->cover[node]);
    if (f <= lo && hi <= l) {
        take(out, &t->below[node]);
        return;
    }
    int mid = lo + (hi - lo) / 2;
    lifetimes_query(t, 2 * node, lo, mid, f, l, out);
    lifetimes_query(t, 2 * node + 1, mid + 1, hi, f, l, out);
}

/* A cursor into one run, in a heap ordered by the start of its next extent. */
typedef struct {
    const Extent *at, *end;
} Cursor;

static void cursor_sift(Cursor *h, int n, int i)
{
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) return;
        if (c + 1 < n && h[c + 1].at->lo < h[c].at->lo) c++;
        if (h[i].at->lo <= h[c].at->lo) return;
        Cursor tmp = h[i];
        h[i] = h[c];
        h[c] = tmp;
        i = c;
    }
}

/* Best fit among the gaps of the union of the runs (extents of different runs may overlap: the
 * running end joins them), or -1; *end is the union's end. Extents with equal starts may come
 * in any order, as only the first of them can open a gap. */
static int64_t best_fit(const Found *found, Cursor *heap, int64_t size, int64_t *end)
{
    int n = 0;
    for (int r = 0; r < found->n; r++)
        heap[n++] = (Cursor){found->runs[r]->items, found->runs[r]->items + found->runs[r]->n};
    for (int i = n / 2 - 1; i >= 0; i--) cursor_sift(heap, n, i);
    int64_t at = -1, best_gap = 0, prev_end = 0;
    while (n) {
        const Extent *e = heap[0].at;
        int64_t gap = e->lo - prev_end;
        if (gap >= size && (at < 0 || gap < best_gap)) {
            at = prev_end;
            best_gap = gap;
        }
        if (e->hi > prev_end) prev_end = e->hi;
        if (++heap[0].at == heap[0].end) heap[0] = heap[--n];
        cursor_sift(heap, n, 0);
    }
    *end = prev_end;
    return at;
}

/* Greedy by size, best fit: returns the arena size. */
static int64_t pack_blocks(Block *blocks, int n, int positions)
{
    qsort(blocks, (size_t)n, sizeof *blocks, compare_blocks);
    Lifetimes t = {.size = 1};
    while (t.size < positions) t.size *= 2;
    t.cover = calloc((size_t)(2 * t.size), sizeof(ExtentSet));
    t.below = calloc((size_t)(2 * t.size), sizeof(ExtentSet));
    IR_ASSERT(t.cover && t.below);
    Found found = {0};
    Cursor *heap = NULL;
    int heap_cap = 0;
    int64_t top = 0;
    for (int i = 0; i < n; i++) {
        Block *b = &blocks[i];
        found.n = 0;
        lifetimes_query(&t, 1, 0, t.size - 1, b->first, b->last, &found);
        if (found.n > heap_cap) {
            heap_cap = found.cap;
            heap = realloc(heap, sizeof *heap * (size_t)heap_cap);
            IR_ASSERT(heap);
        }
        int64_t end, at = best_fit(&found, heap, b->size, &end);
        if (at < 0) at = end;
        b->node->t.offset = at;
        if (at + b->size > top) top = at + b->size;
        lifetimes_insert(&t, 1, 0, t.size - 1, b->first, b->last, at, at + b->size);
    }
    for (int i = 0; i < 2 * t.size; i++) free(t.cover[i].items), free(t.below[i].items);
    free(t.cover);
    free(t.below);
    free(found.runs);
    free(heap);
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
    Uses *uses = ir_fill_uses(g);
    mark_in_place_sums(g, uses);

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
    extend_for_producer_reruns(g, uses, last);
    extend_for_inline_products(g, uses, last);
    extend_for_in_place_sums(g, last);
    /* a forward copy's transposed copy, made in the forward (passes/layout.c), is born with the
     * copy: the GPU backend writes both layouts in the copy's launch, which must not land on
     * bytes that something live in between (the copy's own inputs among them) still holds */
    for (int i = 0; i < n; i++) {
        const Node *t = g->nodes[i], *x = t->n_in ? t->in[0] : NULL;
        if (t->op != OP_TRANSPOSE || t->phase != PHASE_FORWARD || x->op != OP_QUANTIZE || x->phase != PHASE_FORWARD)
            continue;
        int r = alias_root((Node *)t)->index, q = x->index;
        if (q < first[r]) first[r] = q;
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
