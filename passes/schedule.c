/* schedule.c — the launch order of the training step.
 *
 * The order has hard constraints and one soft goal. Hard: it is topological; leaves (INPUT,
 * PARAM, STATE, CONST) come first, in the order they were made; then the forward and backward
 * nodes, which form one group, then every update node (a micro-step runs the forward and
 * backward nodes in this order, the update runs once per step, evaluation runs the forward
 * nodes alone, still in this order, which is safe because no forward node reads a backward
 * value). Forward and backward are not kept apart so that a backward node can run as soon as
 * its operands exist: with the loss in chunks (chunk_loss.c) each chunk's backward follows its
 * forward and only one chunk of logits is ever live. And an in-place op (ir_op_is_inplace:
 * ACCUMULATE, ADAMW, amax and scale updates) runs after every other reader of the value it
 * overwrites, including readers of a RESHAPE view of it, which shares its storage
 * (memplan_alias_of). Soft: a lower peak of live step memory, because the step arena is sized
 * by that peak.
 *
 * It is a list scheduler: it repeatedly takes one ready node of the current group. No single
 * rule for which one wins on every graph (on the bundled models each of the three below is
 * the best somewhere, by up to 2.6x on a two-layer Llama), so the pass lays out all
 * three under the same constraints, measures each one's peak of live step bytes with the
 * liveness rules memplan uses, and keeps the lowest, preferring the earlier rule on a tie:
 *   - input order: the earliest ready node of the order the graph was written in, but a
 *     gradient's accumulation as soon as it is ready (autodiff writes them all at the end, where
 *     they would keep every gradient alive and send a data-parallel build's buckets late; one
 *     allocates nothing, so running it early never raises the peak);
 *   - free first: a node that frees more bytes than it allocates (its result against the
 *     inputs it is the last reader of), the most first, else the earliest;
 *   - net bytes: the most bytes freed net of bytes allocated, even when negative (small
 *     allocations before big ones).
 * Ties go to the earliest node, so every order is deterministic. When the graph as written
 * already keeps the constraints the first rule reproduces it, accumulations moved up, so the
 * schedule never makes the peak worse than that order. Each run keeps the ready nodes of each
 * group in a heap and is O(edges x log nodes). */
#include "passes.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    Graph *g;
    int n;
    int *group;             /* 0: leaves; 1: forward and backward; 2: update */
    int *root;              /* storage root (alias chains followed), by index */
    int64_t *bytes;         /* step-arena bytes the result adds: 0 for aliases, persistent, void */
    bool *to_end;           /* per root: lives to the end (an output shares the storage) */
    int *n_readers;         /* per root: distinct nodes that read its storage */
    int *root_start, *roots;        /* per node: the distinct roots it reads (CSR) */
    int *reader_start, *readers;    /* per root: the nodes that read it (CSR, the inverse) */
    int *succ_start, *succ;         /* dependency edges, deduplicated (CSR) */
    int *n_pred;
} Sched;

typedef struct { int from, to; } Edge;

static int compare_edges(const void *pa, const void *pb)
{
    const Edge *a = pa, *b = pb;
    if (a->from != b->from) return (a->from > b->from) - (a->from < b->from);
    return (a->to > b->to) - (a->to < b->to);
}

static bool is_leaf(const Node *n)
{
    return ir_op_info(n->op)->arity == 0;   /* input, param, state, const */
}

static int64_t step_bytes(const Node *n)
{
    if (ir_role_is_persistent(n->t.role) || memplan_alias_of(n)) return 0;
    return ir_numel(&n->t) * fmt_elem_bytes(n->t.fmt.elem);
}

/* A RESHAPE view reads the same storage as its input; ACCUMULATE's result is the next version
 * of its accumulator. Two values with one storage root are the same bytes. */
static int storage_root(const Node *n)
{
    const Node *a;
    while ((a = memplan_alias_of(n))) n = a;
    return n->index;
}

/* The version class of a value: itself and its RESHAPE views (not ACCUMULATE's result, which
 * is a later version that readers see only after the write). */
static int view_root(const Node *n)
{
    while (n->op == OP_RESHAPE && memplan_alias_of(n)) n = n->in[0];
    return n->index;
}

static void *sched_alloc(Sched *s, size_t count, size_t size)
{
    return arena_alloc(s->g->arena, (count ? count : 1) * size);
}

/* Collects the distinct values of list[0..n) (small lists: quadratic is fine). */
static int distinct(int *list, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int j = 0; j < k && !seen; j++) seen = list[j] == list[i];
        if (!seen) list[k++] = list[i];
    }
    return k;
}

/* A value made again in the backward instead of saved (passes/recompute.c: an activation of
 * the backward phase) is worth its bytes only if it is made just before it is read: made as
 * soon as its inputs exist, which is at the start of the backward, it would live as long as
 * the saved value did. So it waits, by edges of its own, for the other operands of its first
 * reader (through the copies that read it: a GEMM's copy waits for what its bias add's reader
 * waits for), those that do not depend on it. */
static int late_copy_edge_bound(const Graph *g)
{
    int bound = 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (!is_leaf(g->nodes[i]))
            for (int j = 0; j < g->nodes[i]->n_in; j++)
                if (ir_is_recomputed(g->nodes[i]->in[j])) bound += g->nodes[i]->n_in;
    return bound;
}

/* Whether `to` is reached from `from` along operand edges (the graph is in topological order,
 * so only nodes between the two can be on the way). */
static bool reaches(const Graph *g, const Node *from, const Node *to, bool *seen)
{
    if (from == to) return true;
    int lo = from->index, hi = to->index;
    if (hi < lo) return false;
    memset(seen + lo, 0, sizeof(bool) * (size_t)(hi - lo + 1));
    seen[lo] = true;
    for (int i = lo + 1; i <= hi; i++) {
        const Node *v = g->nodes[i];
        for (int j = 0; j < v->n_in && !seen[i]; j++) {
            int k = v->in[j]->index;
            seen[i] = k >= lo && k <= hi && seen[k];
        }
    }
    return seen[hi];
}

/* The first node (by index) that reads v and is not itself recomputed, following copies. */
static const Node *first_real_reader(const Uses *uses, const Node *v)
{
    const Node *best = NULL;
    const Uses *u = &uses[v->index];
    for (int k = 0; k < u->n; k++) {
        const Node *r = u->list[k];
        const Node *x = ir_is_recomputed(r) ? first_real_reader(uses, r) : r;
        if (x && (!best || x->index < best->index)) best = x;
    }
    return best;
}

static int late_copy_edges(const Graph *g, Edge *out, int cap)
{
    if (cap == 0) return 0;   /* no recomputed value is read: nothing to hold */
    int e = 0;
    bool *seen = arena_alloc(g->arena, sizeof(bool) * (size_t)g->n_nodes);
    const Uses *uses = ir_fill_uses(g);
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *c = g->nodes[i];
        if (!ir_is_recomputed(c)) continue;
        const Node *r = first_real_reader(uses, c);
        if (!r) continue;
        for (int j = 0; j < r->n_in; j++) {
            const Node *t = r->in[j];
            if (is_leaf(t) || ir_is_recomputed(t) || t->index == i || reaches(g, c, t, seen)) continue;
            if (e < cap) out[e++] = (Edge){t->index, i};
        }
    }
    return e;
}

static void sched_init(Sched *s, Graph *g)
{
    int n = g->n_nodes;
    s->g = g;
    s->n = n;
    s->group = sched_alloc(s, (size_t)n, sizeof(int));
    s->root = sched_alloc(s, (size_t)n, sizeof(int));
    s->bytes = sched_alloc(s, (size_t)n, sizeof(int64_t));
    s->to_end = sched_alloc(s, (size_t)n, sizeof(bool));
    s->n_readers = sched_alloc(s, (size_t)n, sizeof(int));
    s->n_pred = sched_alloc(s, (size_t)n, sizeof(int));
    s->root_start = sched_alloc(s, (size_t)n + 1, sizeof(int));

    int n_edges = 0;
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        s->group[i] = is_leaf(v) ? 0 : v->phase == PHASE_UPDATE ? 2 : 1;
        s->root[i] = storage_root(v);
        s->bytes[i] = step_bytes(v);
        n_edges += v->n_in + 2;
    }
    for (int i = 0; i < n; i++)
        if (g->nodes[i]->t.role == ROLE_OUTPUT) s->to_end[s->root[i]] = true;

    /* the distinct storage roots each node reads, and the readers of each root */
    int total = 0;
    for (int i = 0; i < n; i++) total += g->nodes[i]->n_in;
    s->roots = sched_alloc(s, (size_t)total, sizeof(int));
    int k = 0;
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        s->root_start[i] = k;
        for (int j = 0; j < v->n_in; j++) s->roots[k + j] = s->root[v->in[j]->index];
        int m = distinct(s->roots + k, v->n_in);
        for (int j = 0; j < m; j++) s->n_readers[s->roots[k + j]]++;
        k += m;
    }
    s->root_start[n] = k;
    s->reader_start = sched_alloc(s, (size_t)n + 1, sizeof(int));
    s->readers = sched_alloc(s, (size_t)k, sizeof(int));
    for (int r = 0; r < n; r++) s->reader_start[r + 1] = s->reader_start[r] + s->n_readers[r];
    int *filled = sched_alloc(s, (size_t)n, sizeof(int));
    for (int i = 0; i < n; i++)
        for (int j = s->root_start[i]; j < s->root_start[i + 1]; j++) {
            int r = s->roots[j];
            s->readers[s->reader_start[r] + filled[r]++] = i;
        }

    /* readers of each version class, for the in-place constraints */
    int *class_count = sched_alloc(s, (size_t)n + 1, sizeof(int));
    int *class_of_in = sched_alloc(s, (size_t)total, sizeof(int));
    k = 0;
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        for (int j = 0; j < v->n_in; j++) class_of_in[k + j] = view_root(v->in[j]);
        int m = distinct(class_of_in + k, v->n_in);
        for (int j = 0; j < m; j++) class_count[class_of_in[k + j]]++;
        for (int j = m; j < v->n_in; j++) class_of_in[k + j] = -1;
        k += v->n_in;
    }
    int *class_start = sched_alloc(s, (size_t)n + 1, sizeof(int));
    for (int i = 0; i < n; i++) class_start[i + 1] = class_start[i] + class_count[i];
    int *class_readers = sched_alloc(s, (size_t)class_start[n], sizeof(int));
    int *fill = sched_alloc(s, (size_t)n, sizeof(int));
    k = 0;
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < g->nodes[i]->n_in; j++) {
            int c = class_of_in[k + j];
            if (c >= 0) class_readers[class_start[c] + fill[c]++] = i;
        }
        k += g->nodes[i]->n_in;
    }
    for (int i = 0; i < n; i++)
        if (ir_op_is_inplace(g->nodes[i]->op))
            for (int j = 0; j < g->nodes[i]->n_in; j++)
                if (ir_mutates_input(g->nodes[i], j))
                    n_edges += class_count[view_root(g->nodes[i]->in[j])];

    /* dependency edges: operands, format tensors defined earlier, in-place ordering, and the
     * late placement of values recomputed in the backward */
    int n_late = late_copy_edge_bound(g);
    n_edges += n_late;
    Edge *edges = sched_alloc(s, (size_t)n_edges, sizeof(Edge));
    int e = 0;
    for (int i = 0; i < n; i++) {
        Node *v = g->nodes[i];
        for (int j = 0; j < v->n_in; j++) edges[e++] = (Edge){v->in[j]->index, i};
        if (v->t.fmt.scale && v->t.fmt.scale->index < i) edges[e++] = (Edge){v->t.fmt.scale->index, i};
        if (v->t.fmt.amax && v->t.fmt.amax->index < i) edges[e++] = (Edge){v->t.fmt.amax->index, i};
        if (!ir_op_is_inplace(v->op)) continue;
        for (int j = 0; j < v->n_in; j++) {
            if (!ir_mutates_input(v, j)) continue;
            int c = view_root(v->in[j]);
            for (int r = class_start[c]; r < class_start[c + 1]; r++)
                if (class_readers[r] != i) edges[e++] = (Edge){class_readers[r], i};
        }
    }
    e += late_copy_edges(g, edges + e, n_late);
    qsort(edges, (size_t)e, sizeof *edges, compare_edges);
    int u = 0;
    for (int i = 0; i < e; i++)
        if (!u || edges[i].from != edges[u - 1].from || edges[i].to != edges[u - 1].to) edges[u++] = edges[i];
    s->succ_start = sched_alloc(s, (size_t)n + 1, sizeof(int));
    s->succ = sched_alloc(s, (size_t)u, sizeof(int));
    for (int i = 0; i < u; i++) {
        s->succ_start[edges[i].from + 1]++;
        s->n_pred[edges[i].to]++;
    }
    for (int i = 0; i < n; i++) s->succ_start[i + 1] += s->succ_start[i];
    memset(fill, 0, sizeof(int) * (size_t)n);
    for (int i = 0; i < u; i++) s->succ[s->succ_start[edges[i].from] + fill[edges[i].from]++] = edges[i].to;
}

/* Bytes freed by running v now: roots whose last reader v is, and v's own result when nobody
 * reads it. `left` counts the readers of each root not yet scheduled. */
static int64_t freed_by(const Sched *s, const int *left, int v)
{
    int64_t freed = 0;
    for (int k = s->root_start[v]; k < s->root_start[v + 1]; k++) {
        int r = s->roots[k];
        if (left[r] == 1 && !s->to_end[r]) freed += s->bytes[r];
    }
    if (s->n_readers[v] == 0 && !s->to_end[v]) freed += s->bytes[v];
    return freed;
}

typedef enum {
    PICK_INPUT_ORDER,       /* the earliest ready node of the input order */
    PICK_FREE_FIRST,        /* a node that frees more than it allocates, else the earliest */
    PICK_NET_BYTES,         /* the most bytes freed net of bytes allocated */
    PICK_COUNT
} Pick;

/* Ready nodes of one group in a heap, best first: the highest score, then the earliest node.
 * A node's score only grows while it waits (more of the values it reads get down to it as
 * their last reader), so a rise pushes a new entry and the old one is skipped when it comes
 * up (its score is no longer the node's). The pick is the one a scan of all ready nodes would
 * make, at log cost: a scan made scheduling quadratic where thousands of nodes wait at once
 * (the leaves; the gradient accumulations of a deep model's backward). */
typedef struct {
    int64_t score;
    int v;
} Cand;

typedef struct {
    Cand *a;
    int n;
} Heap;

static bool cand_before(Cand x, Cand y) { return x.score > y.score || (x.score == y.score && x.v < y.v); }

static void heap_push(Heap *h, Cand c)
{
    int i = h->n++;
    while (i > 0 && cand_before(c, h->a[(i - 1) / 2])) {
        h->a[i] = h->a[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h->a[i] = c;
}

static Cand heap_pop(Heap *h)
{
    Cand top = h->a[0], last = h->a[--h->n];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && cand_before(h->a[c + 1], h->a[c])) c++;
        if (!cand_before(h->a[c], last)) break;
        h->a[i] = h->a[c];
        i = c;
    }
    if (h->n) h->a[i] = last;
    return top;
}

static int64_t score_of(const Sched *s, const int *left, Pick pick, int v)
{
    if (s->group[v] == 0) return 0;   /* leaves keep their order */
    if (pick == PICK_INPUT_ORDER) return s->g->nodes[v]->op == OP_ACCUMULATE;
    int64_t score = freed_by(s, left, v) - s->bytes[v];
    return pick == PICK_FREE_FIRST && score < 0 ? 0 : score;
}

/* Fills order[] with a schedule, group by group, choosing among ready nodes by `pick`.
 * Returns the number of nodes placed (less than n when the constraints form a cycle). */
static int sched_list(const Sched *s, Pick pick, int *order)
{
    int n = s->n, placed = 0, n_roots = s->root_start[n];
    int *preds = malloc(sizeof(int) * (size_t)(n + 1));
    int *left = malloc(sizeof(int) * (size_t)(n + 1));
    bool *done = calloc((size_t)n + 1, sizeof(bool));
    Heap heaps[3];
    for (int gr = 0; gr < 3; gr++) {
        heaps[gr].a = malloc(sizeof(Cand) * (size_t)(n + n_roots + 1));
        heaps[gr].n = 0;
        IR_ASSERT(heaps[gr].a);
    }
    IR_ASSERT(preds && left && done);
    memcpy(preds, s->n_pred, sizeof(int) * (size_t)n);
    memcpy(left, s->n_readers, sizeof(int) * (size_t)n);
    for (int i = 0; i < n; i++)
        if (preds[i] == 0) heap_push(&heaps[s->group[i]], (Cand){score_of(s, left, pick, i), i});
    for (int group = 0; group <= 2; group++) {
        Heap *h = &heaps[group];
        while (h->n) {
            Cand c = heap_pop(h);
            int v = c.v;
            if (done[v] || c.score != score_of(s, left, pick, v)) continue;   /* a stale entry */
            done[v] = true;
            order[placed++] = v;
            for (int k = s->root_start[v]; k < s->root_start[v + 1]; k++) {
                int r = s->roots[k];
                if (--left[r] != 1 || pick == PICK_INPUT_ORDER) continue;
                /* r's last reader, if it waits ready, now frees r: its score rose */
                for (int j = s->reader_start[r]; j < s->reader_start[r + 1]; j++) {
                    int w = s->readers[j];
                    if (!done[w] && preds[w] == 0 && s->group[w] > 0)
                        heap_push(&heaps[s->group[w]], (Cand){score_of(s, left, pick, w), w});
                }
            }
            for (int k = s->succ_start[v]; k < s->succ_start[v + 1]; k++) {
                int w = s->succ[k];
                if (--preds[w] == 0) heap_push(&heaps[s->group[w]], (Cand){score_of(s, left, pick, w), w});
            }
        }
    }
    free(preds);
    free(left);
    free(done);
    for (int gr = 0; gr < 3; gr++) free(heaps[gr].a);
    return placed;
}

/* The peak of live step-arena bytes under `order`, with memplan's liveness: a value lives from
 * the step that makes it (inputs: from the start) to its storage's last reader, outputs to the
 * end. */
static int64_t sched_peak(const Sched *s, const int *order)
{
    int n = s->n;
    int *left = malloc(sizeof(int) * (size_t)(n + 1));
    IR_ASSERT(left);
    memcpy(left, s->n_readers, sizeof(int) * (size_t)n);
    int64_t live = 0, peak = 0;
    for (int i = 0; i < n; i++)
        if (s->g->nodes[i]->op == OP_INPUT) live += s->bytes[i];
    for (int t = 0; t < n; t++) {
        int v = order[t];
        if (s->g->nodes[v]->op != OP_INPUT) live += s->bytes[v];
        if (live > peak) peak = live;
        for (int k = s->root_start[v]; k < s->root_start[v + 1]; k++) {
            int r = s->roots[k];
            if (--left[r] == 0 && !s->to_end[r]) live -= s->bytes[r];
        }
        if (s->n_readers[v] == 0 && !s->to_end[v]) live -= s->bytes[v];
    }
    free(left);
    return peak;
}

static void sched_fail(const Sched *s, const int *order, int placed)
{
    bool *done = calloc((size_t)s->n + 1, 1);
    IR_ASSERT(done);
    for (int i = 0; i < placed; i++) done[order[i]] = true;
    for (int i = 0; i < s->n; i++)
        if (!done[i]) {
            fprintf(stderr, "fp8c: schedule: no order satisfies the constraints of\n    ");
            ir_print_node(s->g->nodes[i], stderr);
            break;
        }
    free(done);
    ir_die(__FILE__, __LINE__, "schedule: a cycle of dependencies, phases or in-place updates");
}

bool pass_schedule(Graph *g, const PassOptions *opt)
{
    (void)opt;
    if (g->n_nodes == 0) return true;
    ir_renumber(g);
    Sched s;
    sched_init(&s, g);
    int *orders[PICK_COUNT];
    int64_t peaks[PICK_COUNT];
    int best = 0;
    for (int p = 0; p < PICK_COUNT; p++) {
        orders[p] = sched_alloc(&s, (size_t)s.n, sizeof(int));
        int placed = sched_list(&s, (Pick)p, orders[p]);
        if (placed != s.n) sched_fail(&s, orders[p], placed);
        peaks[p] = sched_peak(&s, orders[p]);
        if (peaks[p] < peaks[best]) best = p;
    }
    const int *order = orders[best];

    Node **nodes = sched_alloc(&s, (size_t)s.n, sizeof(Node *));
    for (int i = 0; i < s.n; i++) nodes[i] = g->nodes[order[i]];
    memcpy(g->nodes, nodes, sizeof(Node *) * (size_t)s.n);
    ir_renumber(g);
    return true;
}
