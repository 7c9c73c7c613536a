/* autodiff.c — reverse-mode differentiation of the whole forward graph.
 *
 * The forward graph ends in a scalar node named "loss". This pass appends, in one sweep over
 * the forward nodes from the loss back to the first node, the nodes that compute the gradient
 * of the loss with respect to every parameter the loss depends on. Each forward node collects
 * the gradient contributions of its readers; when the sweep reaches it they are summed (ADD_N)
 * and its backward rule turns that gradient into contributions for its own operands. The new
 * nodes run in PHASE_BACKWARD, are ROLE_GRAD_TEMP and carry the source location of the forward
 * node they differentiate, so that a later error about a backward tensor points at the line of
 * the model that caused it.
 *
 * Why it is built this way:
 * - One sweep in reverse graph order is enough because the graph is topological: every reader
 *   of a node comes after it, so its gradient is complete when the sweep reaches it.
 * - Only nodes that depend on a parameter get gradients ("needs"); tokens, targets and
 *   constants never do, and no work is emitted for branches that cannot reach a parameter.
 * - Broadcast operands (a bias (C) or a (T,C) table added to (B,T,C), or a scalar) get the
 *   gradient reduced onto their shape with SUM_ROWS, reshaping first so that the summed
 *   leading dims are exactly the broadcast ones: (B,T,C) -> (B, T*C) -> (T*C) -> (T,C); a
 *   scalar is the case (N, 1) -> (1) -> ().
 * - A tensor that is cut into consecutive SLICEs (a fused projection split into q|k|v or into
 *   a gated MLP's halves, the row chunks of chunk_loss.c) gets the CONCAT of its slices'
 *   gradients instead of a sum of zero-PADded pieces; when those gradients are themselves
 *   consecutive slices of one tensor (ATTENTION_BWD's packed dq|dk|dv) the concat is that
 *   tensor, and no copy is made at all. (Attention over a packed q|k|v operand, which
 *   simplify.c makes of such slices, gets the packed gradient directly.)
 * - Forward values that a backward node reads become ROLE_SAVED: they must live until the
 *   backward has used them, and the precision levels store them differently.
 * - Backward nodes that turn out unread (slices made redundant by the fold above) are removed
 *   before the pass returns, so its output is exactly the backward graph.
 * A parameter P's final gradient is the node named "P.grad" with grad_of = P; the optimizer
 * pass finds gradients by that link. */
#include "passes.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    Node **items;
    int n, cap;
} NodeList;

typedef struct {
    Graph *g;
    int n_fwd;              /* the forward nodes are g->nodes[0 .. n_fwd) */
    Uses *uses;             /* readers of each forward node, among the forward nodes */
    bool *needs;            /* per forward node: depends on a parameter (gets a gradient) */
    bool *tiled;            /* per forward node: read only by SLICEs that tile it */
    NodeList *contrib;      /* per forward node: gradient contributions from its readers */
    Node **slice_grad;      /* per SLICE of a tiled tensor: its gradient, joined by CONCAT */
    const Node *at;         /* the forward node being differentiated (locations) */
} Autodiff;

/* ---------------------------------------------------------------- emitting backward nodes */

static Node *bw_node(Autodiff *ad, OpKind op, int n_in, Node *const *in)
{
    Node *n = ir_add(ad->g, op, n_in, in, ad->at->loc);
    n->phase = PHASE_BACKWARD;
    n->t.role = ROLE_GRAD_TEMP;
    return n;
}

/* Shapes of backward nodes follow from the forward graph, which the front end has checked:
 * a disagreement here is a bug in a backward rule. */
static Node *bw_finish(Autodiff *ad, Node *n)
{
    const char *err = ir_infer_shape(n, ad->g->arena);
    if (err)
        ir_die(__FILE__, __LINE__, "autodiff of %s (node %%%d): %s", ir_op_info(ad->at->op)->text,
               ad->at->id, err);
    return n;
}

static Node *bw1(Autodiff *ad, OpKind op, Node *a) { return bw_finish(ad, bw_node(ad, op, 1, &a)); }

static Node *bw2(Autodiff *ad, OpKind op, Node *a, Node *b)
{
    Node *in[2] = {a, b};
    return bw_finish(ad, bw_node(ad, op, 2, in));
}

static Node *bw3(Autodiff *ad, OpKind op, Node *a, Node *b, Node *c, double f0)
{
    Node *in[3] = {a, b, c};
    Node *n = bw_node(ad, op, 3, in);
    if (op != OP_CROSS_ENTROPY_BWD) IR_FATTR(n, LAYERNORM_BWD_X, eps) = f0;   /* the norms' dx */
    return bw_finish(ad, n);
}

static Node *bw_scale(Autodiff *ad, Node *a, double alpha)
{
    Node *n = bw_node(ad, OP_SCALE, 1, &a);
    IR_FATTR(n, SCALE, alpha) = alpha;
    return bw_finish(ad, n);
}

static Node *bw_matmul(Autodiff *ad, Node *a, Node *b, bool trans_a, bool trans_b)
{
    Node *in[2] = {a, b};
    Node *n = bw_node(ad, OP_MATMUL, 2, in);
    IR_IATTR(n, MATMUL, trans_a) = trans_a;
    IR_IATTR(n, MATMUL, trans_b) = trans_b;
    return bw_finish(ad, n);
}

static Node *bw_reshape(Autodiff *ad, Node *a, int rank, const int64_t *dims)
{
    Node *n = bw_node(ad, OP_RESHAPE, 1, &a);
    ir_set_shape(n, rank, dims);
    return bw_finish(ad, n);
}

/* SLICE or PAD along axis: `size` is the result's length there. */
static Node *bw_axis(Autodiff *ad, OpKind op, Node *a, int64_t axis, int64_t start, int64_t size)
{
    Node *n = bw_node(ad, op, 1, &a);
    IR_IATTR(n, SLICE, axis) = axis;      /* PAD has them in the same places */
    IR_IATTR(n, SLICE, start) = start;
    IR_IATTR(n, SLICE, size) = size;
    return bw_finish(ad, n);
}

static Node *bw_zeros(Autodiff *ad, const Tensor *like)
{
    Node *n = ir_leaf(ad->g, OP_CONST, NULL, ROLE_GRAD_TEMP, FMT_F32, like->rank, like->dims,
                      ad->at->loc);
    n->phase = PHASE_BACKWARD;
    return n;
}

/* The same elements in `like`'s shape: matmul gradients come out with the flattened 2-D shape
 * when the operand had more dims (or was transposed). */
static Node *bw_fit(Autodiff *ad, Node *d, const Tensor *like)
{
    if (ir_same_shape(&d->t, like)) return d;
    IR_ASSERT(ir_numel(&d->t) == ir_numel(like));
    return bw_reshape(ad, d, like->rank, like->dims);
}

/* Sums a gradient of a's shape onto the shape of a broadcast operand b (a suffix of a's shape,
 * or a scalar): reshape to (rows, numel(b)), sum the rows, reshape to b. */
static Node *bw_reduce_to(Autodiff *ad, Node *d, const Tensor *b)
{
    if (ir_same_shape(&d->t, b)) return d;
    if (b->rank == 1) return bw1(ad, OP_SUM_ROWS, d);
    int64_t k = ir_numel(b);
    int64_t rows_k[2] = {ir_numel(&d->t) / k, k};
    Node *s = bw1(ad, OP_SUM_ROWS, bw_reshape(ad, d, 2, rows_k));
    return bw_reshape(ad, s, b->rank, b->dims);
}

static bool is_one(const Node *n)
{
    return n->op == OP_CONST && n->t.rank == 0 && IR_FATTR(n, CONST, value) == 1.0;
}

/* ---------------------------------------------------------------- gradient bookkeeping */

static void give(Autodiff *ad, Node *x, Node *d)
{
    if (!ad->needs[x->index]) return;
    if (!ir_same_shape(&d->t, &x->t))
        ir_die(__FILE__, __LINE__, "autodiff of %s: a gradient of node %%%d has the wrong shape",
               ir_op_info(ad->at->op)->text, x->id);
    NodeList *l = &ad->contrib[x->index];
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 4;
        Node **bigger = arena_alloc(ad->g->arena, sizeof(Node *) * (size_t)cap);
        if (l->n) memcpy(bigger, l->items, sizeof(Node *) * (size_t)l->n);
        l->items = bigger;
        l->cap = cap;
    }
    l->items[l->n++] = d;
}

static bool needs(const Autodiff *ad, const Node *x) { return ad->needs[x->index]; }

static int compare_slice_start(const void *pa, const void *pb)
{
    const Node *a = *(Node *const *)pa, *b = *(Node *const *)pb;
    int64_t x = IR_IATTR(a, SLICE, start), y = IR_IATTR(b, SLICE, start);
    return (x > y) - (x < y);
}

/* Whether every reader of x is a SLICE along one axis and the slices cover x exactly once.
 * On success the readers are left sorted by start in `sorted`. */
static bool slices_tile(const Node *x, const Uses *u, Node **sorted)
{
    if (u->n < 2) return false;
    if (u->list[0]->op != OP_SLICE) return false;
    int64_t axis = IR_IATTR(u->list[0], SLICE, axis);
    for (int i = 0; i < u->n; i++) {
        const Node *s = u->list[i];
        if (s->op != OP_SLICE || IR_IATTR(s, SLICE, axis) != axis) return false;
        sorted[i] = u->list[i];
    }
    qsort(sorted, (size_t)u->n, sizeof *sorted, compare_slice_start);
    int64_t next = 0;
    for (int i = 0; i < u->n; i++) {
        if (IR_IATTR(sorted[i], SLICE, start) != next) return false;
        next += sorted[i]->t.dims[axis];
    }
    return next == x->t.dims[axis];
}

/* concat(slice(P, 0:a), slice(P, a:b), .., slice(P, ..:end)) along the slices' axis is P. */
static Node *fold_concat_of_slices(Node *const *parts, int n, int64_t axis, const Tensor *like)
{
    Node *p = parts[0]->op == OP_SLICE ? parts[0]->in[0] : NULL;
    if (!p || !ir_same_shape(&p->t, like)) return NULL;
    int64_t next = 0;
    for (int i = 0; i < n; i++) {
        const Node *s = parts[i];
        if (s->op != OP_SLICE || s->in[0] != p || IR_IATTR(s, SLICE, axis) != axis || IR_IATTR(s, SLICE, start) != next)
            return NULL;
        next += s->t.dims[axis];
    }
    return next == p->t.dims[axis] ? p : NULL;
}

/* The gradient of a tiled tensor: its slices' gradients joined in order (zeros for a slice that
 * got none), or NULL when none of them got one. */
static Node *join_slice_grads(Autodiff *ad, Node *x)
{
    const Uses *u = &ad->uses[x->index];
    Node **sorted = arena_alloc(ad->g->arena, sizeof(Node *) * (size_t)u->n);
    Node **parts = arena_alloc(ad->g->arena, sizeof(Node *) * (size_t)u->n);
    bool ok = slices_tile(x, u, sorted), any = false;
    IR_ASSERT(ok);
    for (int i = 0; i < u->n; i++) any |= ad->slice_grad[sorted[i]->index] != NULL;
    if (!any) return NULL;
    int64_t axis = IR_IATTR(sorted[0], SLICE, axis);
    for (int i = 0; i < u->n; i++) {
        Node *d = ad->slice_grad[sorted[i]->index];
        parts[i] = d ? d : bw_zeros(ad, &sorted[i]->t);
    }
    Node *whole = fold_concat_of_slices(parts, u->n, axis, &x->t);
    if (whole) return whole;
    Node *c = bw_node(ad, OP_CONCAT, u->n, parts);
    IR_IATTR(c, CONCAT, axis) = axis;
    return bw_finish(ad, c);
}

/* The sum of x's contributions: NULL (none), the one, or a running sum of two-input ADD_Ns in
 * the order the contributions are made. One ADD_N of all of them would keep every contribution
 * live until the last exists: a tied embedding under a chunked loss gets one vocabulary-sized
 * gradient per chunk, and the running sum holds two at a time instead of all. */
static Node *total_grad(Autodiff *ad, Node *x)
{
    NodeList *l = &ad->contrib[x->index];
    if (l->n == 0) return NULL;
    Node *sum = l->items[0];
    for (int i = 1; i < l->n; i++) {
        Node *pair[2] = {sum, l->items[i]};
        sum = bw_finish(ad, bw_node(ad, OP_ADD_N, 2, pair));
    }
    return sum;
}

/* Names the gradient of parameter p. A node that already stands for another value (the seed,
 * or a gradient passed through unchanged to two parameters) gets a copy of its own, because
 * "P.grad" is what the optimizer and the plan show for p alone. */
static void name_param_grad(Autodiff *ad, Node *p, Node *d)
{
    if (d->t.name || d->grad_of || d->op == OP_CONST) d = bw_scale(ad, d, 1.0);
    d->t.name = arena_printf(ad->g->arena, "%s.grad", p->t.name ? p->t.name : "param");
    d->grad_of = p;
}

/* ---------------------------------------------------------------- backward rules */

/* Emits n's backward given dy, the gradient of its result. Returns false (after a diagnostic)
 * for an op that has no rule. */
static bool backward(Autodiff *ad, Node *n, Node *dy)
{
    Node *a = n->n_in > 0 ? n->in[0] : NULL, *b = n->n_in > 1 ? n->in[1] : NULL;
    switch (n->op) {
    case OP_ADD:
    case OP_SUB:
        if (needs(ad, a)) give(ad, a, dy);
        if (needs(ad, b)) {
            Node *db = bw_reduce_to(ad, dy, &b->t);
            give(ad, b, n->op == OP_SUB ? bw_scale(ad, db, -1.0) : db);
        }
        return true;
    case OP_MUL:
        if (a == b) {   /* x * x: one product, doubled */
            give(ad, a, bw_scale(ad, bw2(ad, OP_MUL, dy, a), 2.0));
            return true;
        }
        if (needs(ad, a)) give(ad, a, bw2(ad, OP_MUL, dy, b));
        if (needs(ad, b)) give(ad, b, bw_reduce_to(ad, bw2(ad, OP_MUL, dy, a), &b->t));
        return true;
    case OP_SCALE:
        give(ad, a, bw_scale(ad, dy, IR_FATTR(n, SCALE, alpha)));
        return true;
    case OP_ADD_N:
        for (int i = 0; i < n->n_in; i++) give(ad, n->in[i], dy);
        return true;
    case OP_GELU:
        give(ad, a, bw2(ad, OP_GELU_BWD, dy, a));
        return true;
    case OP_SILU:
        give(ad, a, bw2(ad, OP_SILU_BWD, dy, a));
        return true;
    case OP_CAST:   /* rounding is the identity as far as the gradient knows */
        give(ad, a, dy);
        return true;
    case OP_RESHAPE:
        give(ad, a, bw_reshape(ad, dy, a->t.rank, a->t.dims));
        return true;
    case OP_SLICE:
        if (ad->tiled[a->index])
            ad->slice_grad[n->index] = dy;   /* joined when the sweep reaches a */
        else
            give(ad, a, bw_axis(ad, OP_PAD, dy, IR_IATTR(n, SLICE, axis), IR_IATTR(n, SLICE, start),
                                    a->t.dims[IR_IATTR(n, SLICE, axis)]));
        return true;
    case OP_PAD:
        give(ad, a, bw_axis(ad, OP_SLICE, dy, IR_IATTR(n, PAD, axis), IR_IATTR(n, PAD, start),
                                    a->t.dims[IR_IATTR(n, PAD, axis)]));
        return true;
    case OP_CONCAT: {
        int64_t axis = IR_IATTR(n, CONCAT, axis), start = 0;
        for (int i = 0; i < n->n_in; i++) {
            Node *x = n->in[i];
            if (needs(ad, x)) give(ad, x, bw_axis(ad, OP_SLICE, dy, axis, start, x->t.dims[axis]));
            start += x->t.dims[axis];
        }
        return true;
    }
    case OP_MATMUL: {
        /* C = op(A) op(B) on the 2-D views; dop(A) = dC op(B)^T and dop(B) = op(A)^T dC, each
         * written as one matmul whose flags absorb the transposes. */
        bool ta = IR_IATTR(n, MATMUL, trans_a), tb = IR_IATTR(n, MATMUL, trans_b);
        if (needs(ad, a)) {
            Node *da = ta ? bw_matmul(ad, b, dy, tb, true) : bw_matmul(ad, dy, b, false, !tb);
            give(ad, a, bw_fit(ad, da, &a->t));
        }
        if (needs(ad, b)) {
            Node *db = tb ? bw_matmul(ad, dy, a, true, ta) : bw_matmul(ad, a, dy, !ta, false);
            give(ad, b, bw_fit(ad, db, &b->t));
        }
        return true;
    }
    case OP_SUM_ROWS:   /* broadcast dy (N) back over the rows */
        give(ad, a, bw2(ad, OP_ADD, bw_zeros(ad, &a->t), dy));
        return true;
    case OP_SQNORM:   /* 2 a dy; dy is often the seed 1 itself */
        give(ad, a, is_one(dy) ? bw_scale(ad, a, 2.0) : bw2(ad, OP_MUL, bw_scale(ad, a, 2.0), dy));
        return true;
    case OP_LAYERNORM:
        if (needs(ad, a)) give(ad, a, bw3(ad, OP_LAYERNORM_BWD_X, dy, a, b, IR_FATTR(n, LAYERNORM, eps)));
        if (needs(ad, b)) {
            Node *dw = bw2(ad, OP_LAYERNORM_BWD_W, dy, a);
            IR_FATTR(dw, LAYERNORM_BWD_W, eps) = IR_FATTR(n, LAYERNORM, eps);
            give(ad, b, dw);
        }
        if (needs(ad, n->in[2])) give(ad, n->in[2], bw1(ad, OP_SUM_ROWS, dy));
        return true;
    case OP_RMSNORM:
        if (needs(ad, a)) give(ad, a, bw3(ad, OP_RMSNORM_BWD_X, dy, a, b, IR_FATTR(n, RMSNORM, eps)));
        if (needs(ad, b)) {
            Node *dw = bw2(ad, OP_RMSNORM_BWD_W, dy, a);
            IR_FATTR(dw, RMSNORM_BWD_W, eps) = IR_FATTR(n, RMSNORM, eps);
            give(ad, b, dw);
        }
        return true;
    case OP_SOFTMAX:
        give(ad, a, bw2(ad, OP_SOFTMAX_BWD, dy, n));
        return true;
    case OP_EMBEDDING: {
        Node *in[2] = {dy, b};
        Node *d = bw_node(ad, OP_EMBEDDING_BWD, 2, in);
        IR_IATTR(d, EMBEDDING_BWD, vocab) = a->t.dims[0];
        give(ad, a, bw_finish(ad, d));
        return true;
    }
    case OP_CROSS_ENTROPY:
        give(ad, a, bw3(ad, OP_CROSS_ENTROPY_BWD, dy, a, b, 0.0));
        return true;
    case OP_ROPE: {
        Node *d = bw_node(ad, OP_ROPE, 1, &dy);
        IR_IATTR(d, ROPE, head_dim) = IR_IATTR(n, ROPE, head_dim);
        IR_IATTR(d, ROPE, inverse) = !IR_IATTR(n, ROPE, inverse);
        IR_FATTR(d, ROPE, theta) = IR_FATTR(n, ROPE, theta);
        give(ad, a, bw_finish(ad, d));
        return true;
    }
    case OP_ATTENTION: {
        Node *in[4] = {dy, n->in[0], n->n_in == 3 ? n->in[1] : NULL, n->n_in == 3 ? n->in[2] : NULL};
        Node *p = bw_node(ad, OP_ATTENTION_BWD, 1 + n->n_in, in);
        memcpy(p->iattr, n->iattr, sizeof p->iattr);
        memcpy(p->fattr, n->fattr, sizeof p->fattr);
        bw_finish(ad, p);
        if (n->n_in == 1) {   /* packed q|k|v: the packed gradient is its gradient */
            if (needs(ad, n->in[0])) give(ad, n->in[0], p);
            return true;
        }
        int64_t start = 0;   /* dq | dk | dv along the last axis */
        for (int i = 0; i < 3; i++) {
            Node *x = n->in[i];
            int64_t w = x->t.dims[2];
            if (needs(ad, x)) give(ad, x, bw_axis(ad, OP_SLICE, p, 2, start, w));
            start += w;
        }
        return true;
    }
    default:
        diag_error(n->loc, "cannot differentiate '%s': it has no backward rule",
                   ir_op_info(n->op)->text);
        return false;
    }
}

/* ---------------------------------------------------------------- the pass */

static void find_needs(Autodiff *ad)
{
    for (int i = 0; i < ad->n_fwd; i++) {
        const Node *n = ad->g->nodes[i];
        bool need = false;
        if (n->op == OP_PARAM) need = true;
        for (int j = 0; j < n->n_in && !need; j++) need = ad->needs[n->in[j]->index];
        ad->needs[i] = need && fmt_elem_is_float(n->t.fmt.elem);
    }
}

/* Removes backward nodes nobody reads (kept: the named parameter gradients and what they
 * need). Forward nodes are not this pass's to remove. */
static void drop_unread_backward(Autodiff *ad)
{
    Graph *g = ad->g;
    bool *keep = arena_alloc(g->arena, sizeof(bool) * (size_t)g->n_nodes);
    for (int i = 0; i < ad->n_fwd; i++) keep[i] = true;
    for (int i = g->n_nodes - 1; i >= ad->n_fwd; i--) {
        Node *n = g->nodes[i];
        if (n->grad_of) keep[i] = true;
        if (!keep[i]) continue;
        for (int j = 0; j < n->n_in; j++) keep[n->in[j]->index] = true;
    }
    ir_filter(g, keep);
}

/* Forward values read by the backward are saved for it. */
static void mark_saved(Graph *g)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->phase != PHASE_BACKWARD) continue;
        for (int j = 0; j < n->n_in; j++) {
            Node *x = n->in[j];
            if (x->phase == PHASE_FORWARD && x->t.role == ROLE_ACTIVATION) x->t.role = ROLE_SAVED;
        }
    }
}

bool pass_autodiff(Graph *g, const PassOptions *opt)
{
    (void)opt;
    Node *loss = ir_find(g, "loss");
    if (!loss) {
        diag_error((SrcLoc){0}, "the model defines no value named 'loss' to differentiate");
        return false;
    }
    if (loss->t.rank != 0) {
        diag_error(loss->loc, "the loss must be a scalar, but it has %d dims", loss->t.rank);
        return false;
    }
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->phase != PHASE_FORWARD) {
            diag_error(g->nodes[i]->loc, "autodiff needs a forward graph, but this node runs in the %s phase",
                       ir_phase_name(g->nodes[i]->phase));
            return false;
        }

    Autodiff ad = {.g = g, .n_fwd = g->n_nodes};
    size_t n = (size_t)g->n_nodes;
    ad.uses = ir_fill_uses(g);
    ad.needs = arena_alloc(g->arena, sizeof(bool) * n);
    ad.tiled = arena_alloc(g->arena, sizeof(bool) * n);
    ad.contrib = arena_alloc(g->arena, sizeof(NodeList) * n);
    ad.slice_grad = arena_alloc(g->arena, sizeof(Node *) * n);
    find_needs(&ad);
    Node **scratch = arena_alloc(g->arena, sizeof(Node *) * n);
    for (int i = 0; i < ad.n_fwd; i++)
        ad.tiled[i] = ad.needs[i] && slices_tile(g->nodes[i], &ad.uses[i], scratch);

    if (!ad.needs[loss->index]) {
        diag_error(loss->loc, "the loss does not depend on any parameter: there is nothing to train");
        return false;
    }
    ad.at = loss;
    Node *seed = ir_leaf(g, OP_CONST, NULL, ROLE_GRAD_TEMP, FMT_F32, 0, NULL, loss->loc);
    IR_FATTR(seed, CONST, value) = 1.0;
    seed->phase = PHASE_BACKWARD;
    give(&ad, loss, seed);

    for (int i = loss->index; i >= 0; i--) {
        Node *x = g->nodes[i];
        if (!ad.needs[i]) continue;
        ad.at = x;
        if (ad.tiled[i]) {
            Node *d = join_slice_grads(&ad, x);
            if (d) give(&ad, x, d);
        }
        Node *dy = total_grad(&ad, x);
        if (!dy) continue;
        if (x->op == OP_PARAM)
            name_param_grad(&ad, x, dy);
        else if (!backward(&ad, x, dy))
            return false;
    }
    drop_unread_backward(&ad);
    mark_saved(g);
    return true;
}
