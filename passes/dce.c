/* dce.c — dead code elimination.
 *
 * A node stays when its result is read by a node that stays, or when it is a root: what the
 * runtime reads after the step (ROLE_OUTPUT), what changes state (the in-place ACCUMULATE and
 * ADAMW, whose results nobody needs to read), persistent state (PARAM and STATE leaves: they
 * are checkpointed and must keep their names and places even when this graph does not read
 * them) and the runtime's inputs (INPUT leaves: the training binary feeds them by name, so a
 * graph that happens not to read the targets still has the same interface). Scale and amax
 * tensors named by a kept tensor's format are read through it and stay with it.
 */
#include "passes.h"

static bool dce_is_root(const Node *n)
{
    return n->t.role == ROLE_OUTPUT || ir_op_is_inplace(n->op) || ir_op_class(n->op) == CLASS_HELD;
}

/* Format references (scale=, amax=) may point at later nodes, so liveness spreads through a
 * worklist rather than a single backward sweep. */
bool pass_dce(Graph *g, const PassOptions *opt)
{
    (void)opt;
    size_t n = (size_t)(g->n_nodes ? g->n_nodes : 1);
    bool *keep = arena_alloc(g->arena, sizeof(bool) * n);
    Node **work = arena_alloc(g->arena, sizeof(Node *) * n);
    int top = 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (dce_is_root(g->nodes[i])) {
            keep[i] = true;
            work[top++] = g->nodes[i];
        }
    while (top > 0) {
        const Node *x = work[--top];
        Node *reads[2] = {x->t.fmt.scale, x->t.fmt.amax};
        for (int j = 0; j < x->n_in + 2; j++) {
            Node *y = j < x->n_in ? x->in[j] : reads[j - x->n_in];
            if (!y || keep[y->index]) continue;
            keep[y->index] = true;
            work[top++] = y;
        }
    }
    ir_filter(g, keep);
    return true;
}
