/* verify.c — the invariants every pass must keep.
 *
 * Run after every pass in debug builds (and with --verify), it catches a pass that breaks the
 * graph where it breaks it, not three passes later as a wrong number. It re-infers every shape
 * with the same rules the front end used, so a pass cannot quietly change a shape; it checks
 * that operands are defined earlier, that in-place updates run after every other reader of
 * what they overwrite, that forward nodes do not read backward values, and that formats are
 * coherent (a scaled tensor has its scale tensor). Problems are printed with the node. */
#include "ir.h"

#include <stdlib.h>
#include <string.h>

static int problem(const char *after, const Node *n, const char *what)
{
    fprintf(stderr, "fp8c: IR verification failed%s%s: %s\n    ", after ? " after " : "",
            after ? after : "", what);
    ir_print_node(n, stderr);
    return 1;
}

static int verify_node(const Graph *g, const Node *n, const char *after)
{
    int bad = 0;
    const OpInfo *info = ir_op_info(n->op);
    if (info->arity >= 0 && n->n_in != info->arity) bad += problem(after, n, "wrong number of operands");
    for (int j = 0; j < n->n_in; j++) {
        const Node *x = n->in[j];
        if (x->index >= n->index || g->nodes[x->index] != x)
            bad += problem(after, n, "an operand is not defined before its use");
        else if (n->phase == PHASE_FORWARD && x->phase != PHASE_FORWARD && x->n_in > 0)
            bad += problem(after, n, "a forward node reads a backward or update value");
        else if (x->t.fmt.elem == FMT_VOID)
            bad += problem(after, n, "an operand has no value (void)");
    }
    if (bad) return bad;

    /* re-infer the shape on a copy and compare */
    Node copy = *n;
    const char *err = ir_infer_shape(&copy, g->arena);
    if (err) bad += problem(after, n, err);
    else if (!ir_same_shape(&copy.t, &n->t)) bad += problem(after, n, "its shape differs from the inferred one");

    const Format *f = &n->t.fmt;
    if (f->scaling != SCALE_NONE && !f->scale) bad += problem(after, n, "a scaled format without a scale tensor");
    if (f->scaling == SCALE_PER_GROUP && f->group <= 0) bad += problem(after, n, "per-group scaling needs group > 0");
    if (f->elem == FMT_VOID && !ir_op_is_update(n->op)) bad += problem(after, n, "only an update may have no value");
    if (n->n_in == 0 && ir_op_info(n->op)->arity != 0)
        bad += problem(after, n, "an op without operands that is not a leaf");
    if ((n->op == OP_PARAM || ir_role_is_persistent(n->t.role)) && n->n_in == 0 && !n->t.name)
        bad += problem(after, n, "persistent state needs a name (checkpoints use it)");
    return bad;
}

/* Every other reader of an operand that n overwrites must come before n. */
static int verify_inplace(const Graph *g, const Uses *uses, const Node *n, const char *after)
{
    int bad = 0;
    for (int j = 0; j < n->n_in; j++) {
        if (!ir_mutates_input(n, j)) continue;
        const Uses *u = &uses[n->in[j]->index];
        for (int k = 0; k < u->n; k++)
            if (u->list[k] != n && u->list[k]->index > n->index)
                bad += problem(after, u->list[k], "reads a value after an in-place update overwrote it");
    }
    (void)g;
    return bad;
}

static int by_name_then_index(const void *x, const void *y)
{
    const Node *a = *(const Node *const *)x, *b = *(const Node *const *)y;
    int c = strcmp(a->t.name, b->t.name);
    return c ? c : (a->index > b->index) - (a->index < b->index);
}

int ir_verify(const Graph *g, const char *after_pass)
{
    int bad = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        if (g->nodes[i]->index != i) {
            bad += problem(after_pass, g->nodes[i], "Node.index is stale (call ir_renumber)");
            return bad;
        }
    }
    for (int i = 0; i < g->n_nodes; i++) bad += verify_node(g, g->nodes[i], after_pass);
    if (bad) return bad;
    Uses *uses = ir_fill_uses(g);
    for (int i = 0; i < g->n_nodes; i++)
        if (ir_op_is_inplace(g->nodes[i]->op)) bad += verify_inplace(g, uses, g->nodes[i], after_pass);
    /* names of persistent state are checkpoint keys: they must be unique. Sorted by name (then
     * position), so that the check stays linearithmic: comparing every pair took minutes on a
     * 256-layer GPT-2, whose ~10^4 parameters and states met every one of its ~10^5 nodes */
    const Node **named = malloc((size_t)g->n_nodes * sizeof *named + 1);
    IR_ASSERT(named != NULL);
    int n_named = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *a = g->nodes[i];
        if (a->t.name && ir_role_is_persistent(a->t.role) && !a->n_in) named[n_named++] = a;
    }
    qsort(named, (size_t)n_named, sizeof *named, by_name_then_index);
    for (int i = 1; i < n_named; i++)
        if (!strcmp(named[i - 1]->t.name, named[i]->t.name))
            bad += problem(after_pass, named[i], "two persistent tensors share this name");
    free(named);
    return bad;
}
