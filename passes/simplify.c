/* simplify.c — canonical forms before differentiation.
 *
 * Rewrites that make the forward graph smaller in a way every later pass profits from, done
 * once, before autodiff, so that the backward is derived from the simpler form:
 *
 *   attention(slice(x, 0..a), slice(x, a..b), slice(x, b..c))  with the slices tiling x's last
 *   axis as q | k | v   ->   attention(x)   (packed)
 *
 * GPT-2 computes q, k and v with one GEMM and splits them; as slices they would be three
 * copies, kept for the backward, and the backward would concatenate three gradients again.
 * Packed, attention reads the GEMM's result in place and its backward writes the GEMM's
 * gradient directly: at GPT-2 d12 batch 32 x 1024 that is 1.8 GB less kept for the backward. */
#include "passes.h"

static bool is_last_axis_slice(const Node *s, const Node *of, int64_t start, int64_t size)
{
    return s->op == OP_SLICE && s->in[0] == of && IR_IATTR(s, SLICE, axis) == of->t.rank - 1 &&
           IR_IATTR(s, SLICE, start) == start && IR_IATTR(s, SLICE, size) == size;
}

static bool pack_attention(Graph *g, Node *n)
{
    if (n->op != OP_ATTENTION || n->n_in != 3 || n->in[0]->op != OP_SLICE) return false;
    Node *x = n->in[0]->in[0];
    int64_t wq = n->in[0]->t.dims[2], wk = n->in[1]->t.dims[2], wv = n->in[2]->t.dims[2];
    if (x->t.rank != 3 || x->t.dims[2] != wq + wk + wv) return false;
    if (!is_last_axis_slice(n->in[0], x, 0, wq) || !is_last_axis_slice(n->in[1], x, wq, wk) ||
        !is_last_axis_slice(n->in[2], x, wq + wk, wv))
        return false;
    n->in[0] = x;
    n->n_in = 1;
    const char *err = ir_infer_shape(n, g->arena);
    if (err) ir_die(__FILE__, __LINE__, "simplify: %s", err);
    return true;
}

bool pass_simplify(Graph *g, const PassOptions *opt)
{
    (void)opt;
    for (int i = 0; i < g->n_nodes; i++) pack_attention(g, g->nodes[i]);
    /* the slices nobody reads any more go with dce */
    return true;
}
