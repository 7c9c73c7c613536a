/* sums.c — gradient sums reassociated in the order their terms are produced.
 *
 * Autodiff sums a value's gradient contributions as a running sum of two-input add_n nodes,
 * s1 = t0 + t1, s2 = s1 + t2, ..., in the order it met them walking the graph backwards. The
 * schedule may produce the terms in another order: the head of a chunked loss produces one
 * vocabulary-sized weight gradient per chunk, in forward order, while autodiff met them in
 * reverse. A term that the running sum cannot take yet stays live, so every chunk's gradient
 * waited for the last one (0.9 GB at GPT-2 d12, batch 32 x 1024).
 *
 * Addition is commutative and associative (up to rounding, and the order chosen here is fixed,
 * so results stay deterministic), so after scheduling this pass takes each chain, sorts its
 * terms by when the schedule produces them, rewires the chain in that order and moves each
 * partial sum to just after its term. Every term then dies as soon as it is made; the memory
 * plan that follows sees the shorter lifetimes. */
#include "passes.h"

#include <stdlib.h>
#include <string.h>

static bool is_link(const Node *n) { return n->op == OP_ADD_N && n->n_in == 2; }

static int by_index(const void *a, const void *b)
{
    const Node *x = *(Node *const *)a, *y = *(Node *const *)b;
    return (x->index > y->index) - (x->index < y->index);
}

bool pass_sums(Graph *g, const PassOptions *opt)
{
    (void)opt;
    ir_renumber(g);
    Uses *uses = ir_fill_uses(g);
    int n = g->n_nodes;
    /* a link continues a chain when its only reader is the next link reading it as operand 0 */
    Node **next = calloc((size_t)n + 1, sizeof(Node *));
    bool *inner = calloc((size_t)n + 1, 1);
    IR_ASSERT(next && inner);
    for (int i = 0; i < n; i++) {
        Node *s = g->nodes[i];
        if (!is_link(s) || uses[i].n != 1) continue;
        Node *r = uses[i].list[0];
        if (is_link(r) && r->in[0] == s && r->in[1] != s && ir_same_shape(&r->t, &s->t) &&
            r->t.fmt.elem == s->t.fmt.elem) {
            next[i] = r;
            inner[r->index] = true;
        }
    }
    int moved_any = 0;
    Node **chain = malloc(sizeof(Node *) * (size_t)(n + 1));
    Node **terms = malloc(sizeof(Node *) * (size_t)(n + 2));
    IR_ASSERT(chain && terms);
    for (int i = 0; i < n; i++) {
        Node *s = g->nodes[i];
        if (!is_link(s) || inner[i] || !next[i]) continue;   /* chains of 2+ links, from their start */
        int k = 0, m = 0;
        terms[m++] = s->in[0];
        for (Node *c = s; c; c = next[c->index]) {
            chain[k++] = c;
            terms[m++] = c->in[1];
        }
        qsort(terms, (size_t)m, sizeof *terms, by_index);
        chain[0]->in[0] = terms[0];
        chain[0]->in[1] = terms[1];
        for (int j = 1; j < k; j++) chain[j]->in[0] = chain[j - 1], chain[j]->in[1] = terms[j + 1];
        /* each partial sum right after the later of its operands */
        for (int j = 0; j < k; j++) {
            Node *after = terms[j + 1];
            if (j > 0 && chain[j - 1]->index > after->index) after = chain[j - 1];
            if (chain[j]->index > after->index + 1) {
                ir_move_before(g, chain[j], g->nodes[after->index + 1]);
                moved_any++;
            }
        }
    }
    free(chain);
    free(terms);
    free(next);
    free(inner);
    (void)moved_any;
    return true;
}
