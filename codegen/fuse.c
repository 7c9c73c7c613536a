/* fuse.c — which nodes run together as one kernel.
 *
 * A kernel that reads a value from memory, applies one elementwise op and writes it back spends
 * its time on memory, not on the op. Fusion keeps such values in registers: a group is a root
 * node plus the elementwise nodes it can compute inline — producers whose only use is the
 * group (a bias add feeding a GELU), and consumers of a head (a GEMM, a norm, softmax,
 * embedding, attention: an op whose kernel yields each output element once) that take the
 * head's value before it is stored (the bias add after a GEMM, the accumulation of a weight
 * gradient into its accumulator). A group becomes one kernel (or a head's kernels followed by
 * nothing else); its intermediates are never written.
 *
 * Fused intermediates keep their format: the kernel rounds a value the plan stores in bf16 or
 * e4m3 exactly as a store and a load would (CG_ROUND), so fusion changes speed, never results.
 * (The GPU backend also runs a GEMM's group as one cuBLASLt call with an epilogue, which rounds
 * the sum once: the one exception, cuda/spec.c.)
 *
 * Where this runs, and why: after memplan, on the planned graph. The schedule fixes the launch
 * order that fusion must respect, and the memory plan is what makes delaying a computation
 * safe or not: a group runs at its root's place in the schedule, so every input a member
 * reads must still hold its value there — memplan may already have given a dead input's bytes
 * to a tensor made in between, or to the root's own result. The pass checks exactly that
 * against the offsets. Fusing first and planning after would free the intermediates' memory
 * as well, but would need memplan to know about groups; as it is, the planned graph stays a
 * complete program that the reference executor runs unchanged (`--device ref`), and fused
 * intermediates simply leave their slots unused.
 *
 * The grouping is a pure function of the planned graph (fuse_plan), not stored in the IR: the
 * training binary re-lowers the artifact it carries and gets the same groups, and a hash of
 * the kernels checks that it did. How large a group may grow is the one choice it reads
 * (fuse.members, from the graph's choice table, which the artifact carries: 0, the default,
 * any size; 1 no fusion at all): fp8c tune's point of fusion granularity on the CPU, where a
 * long group's loop may keep fewer values in registers than two shorter ones.
 *
 * Why this is codegen's and not a pass: the decision is read by the lowering (lower_kernels.c)
 * and by the GPU backend's plans (cuda/spec.c), both above the passes, and it needs the op
 * classes the lowering knows how to compute inline. Kept among the passes it made the two
 * layers call each other. The `fuse` pass of passes.def (passes/fuse.c) only reports the
 * groups: --print-ir-after=fuse prints them (fuse_print) as comments before the IR, through a
 * function the compiler hands the passes in PassOptions. */
#include "codegen.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- what can be fused */

/* The op classes the groups are made of are ops.def's CLASS column (ir_op_class): members
 * are ELEMWISE nodes, at most one HEAD among them; HELD and COLLECTIVE nodes run no kernel.
 * The lowering (lower_kernels.c) reads the same classes. */
static bool is_elementwise(OpKind op) { return ir_op_class(op) == CLASS_ELEMWISE; }
static bool is_head(OpKind op) { return ir_op_class(op) == CLASS_HEAD; }

static bool format_is_plain(const Format *f)
{
    return f->scaling == SCALE_NONE && f->codec == CODEC_PLAIN;
}

bool cg_node_is_view(const Node *n)
{
    if (n->op != OP_RESHAPE) return false;
    const Node *x = n->in[0];
    return n->t.offset >= 0 && n->t.offset == x->t.offset &&
           ir_role_is_persistent(n->t.role) == ir_role_is_persistent(x->t.role) &&
           n->t.fmt.elem == x->t.fmt.elem && format_is_plain(&n->t.fmt) &&
           format_is_plain(&x->t.fmt);
}

bool cg_node_runs_kernel(const Node *n)
{
    OpClass c = ir_op_class(n->op);
    return c != CLASS_HELD && c != CLASS_COLLECTIVE && !cg_node_is_view(n);
}

/* ---------------------------------------------------------------- the groups */

typedef struct {
    const Graph *g;
    int *group;             /* node index -> root index (itself when alone), -1 no kernel */
    Uses *uses;
    int *n_members;         /* per root: nodes in its group */
    bool *has_head;         /* per root: the group holds a head */
    int *first, *last, *next;   /* per root: its members as a list (first, last), per node: next */
    bool *referenced;       /* per node: a format names it (fuse_referenced_by_format) */
    int64_t max_members;    /* the choice fuse.members: nodes a group may hold; 0: any */
} Fuse;

/* The bytes a node's result occupies: [lo, hi) in arena `persistent`; empty when it has none. */
typedef struct {
    bool persistent;
    int64_t lo, hi;
} Span;

static Span node_span(const Node *n)
{
    Span s = {ir_role_is_persistent(n->t.role), 0, 0};
    if (n->t.offset < 0 || n->t.fmt.elem == FMT_VOID) return s;
    s.lo = n->t.offset;
    s.hi = n->t.offset + ir_numel(&n->t) * fmt_elem_bytes(n->t.fmt.elem);
    return s;
}

static bool spans_overlap(Span a, Span b)
{
    return a.persistent == b.persistent && a.lo < b.hi && b.lo < a.hi;
}

bool fuse_nodes_overlap(const Node *a, const Node *b)
{
    return spans_overlap(node_span(a), node_span(b));
}

/* Whether node j writes bytes of x: its own result, or an operand it updates in place. */
static bool writes_over(const Node *j, Span x)
{
    if (spans_overlap(node_span(j), x)) return true;
    for (int i = 0; i < j->n_in; i++)
        if (ir_mutates_input(j, i) && spans_overlap(node_span(j->in[i]), x)) return true;
    return false;
}

/* x keeps its value from just after position `from` through position `to` (exclusive):
 * no node scheduled in between writes over it. */
bool fuse_value_survives(const Graph *g, const Node *x, int from, int to)
{
    Span s = node_span(x);
    if (s.hi == s.lo) return true;
    for (int j = from + 1; j < to; j++)
        if (writes_over(g->nodes[j], s)) return false;
    return true;
}

static bool survives(const Fuse *f, const Node *x, int from, int to)
{
    return fuse_value_survives(f->g, x, from, to);
}

/* Whether the value of p (a member or the head of root's group, in place of the group's
 * consumer c) may be delayed from p's position to c's: every input p reads from outside the
 * group must survive until c, and the group's own stores must not land on them. A scaled
 * input's kernel reads its scale tensor as well (a group's e8m0 scales are a tensor of their
 * own), so the scale must survive too, and the root may not share a byte with it. */
static bool inputs_survive(const Fuse *f, int root, int c)
{
    const Graph *g = f->g;
    Span out = node_span(g->nodes[c]);
    IR_ASSERT(f->group[c] == root);   /* c is a member: the list holds it */
    for (int i = f->first[root]; i >= 0; i = f->next[i]) {
        const Node *m = g->nodes[i];
        for (int k = 0; k < m->n_in; k++) {
            const Node *x = m->in[k];
            if (x->index >= 0 && (f->group[x->index] == root || x->index == c)) continue;
            if (i != c && !survives(f, x, i, c)) return false;
            const Node *xs_scale = x->t.fmt.scale;
            if (xs_scale && i != c && !survives(f, xs_scale, i, c)) return false;
            if (xs_scale && spans_overlap(out, node_span(xs_scale))) return false;
            /* the root's store may share bytes with an input only element for element */
            Span xs = node_span(x);
            if (m->op != OP_MATMUL && spans_overlap(out, xs) &&
                !(xs.lo == out.lo && xs.hi == out.hi &&
                  fmt_elem_bytes(x->t.fmt.elem) == fmt_elem_bytes(g->nodes[c]->t.fmt.elem)))
                return false;
        }
    }
    return true;
}

/* Operand slot k of an elementwise consumer c reads its producer element for element. */
static bool same_element_operand(const Node *c, int k)
{
    const Node *p = c->in[k];
    if (ir_numel(&p->t) != ir_numel(&c->t)) return false;   /* broadcast operands */
    if (c->op == OP_QUANTIZE && k != 0) return false;        /* the scale */
    if (c->op == OP_ACCUMULATE && k != 1) return false;      /* the accumulator itself */
    return true;
}

/* A node whose value other tensors depend on by reference (a scale, an amax) must be stored. */
bool fuse_referenced_by_format(const Graph *g, const Node *p)
{
    for (int i = 0; i < g->n_nodes; i++) {
        const Format *f = &g->nodes[i]->t.fmt;
        if (f->scale == p || f->amax == p) return true;
    }
    return false;
}

/* Tries to put p (root of its own group so far) into the group of its consumer c. */
static bool try_merge(Fuse *f, Node *p, Node *c)
{
    int pi = p->index, ci = c->index, croot = f->group[ci];
    if (f->group[pi] != pi || p->phase != c->phase || pi >= ci) return false;
    bool p_elementwise = is_elementwise(p->op) && p->op != OP_ACCUMULATE;
    if (!p_elementwise && !is_head(p->op)) return false;
    if (f->has_head[pi] && f->has_head[croot]) return false;   /* one head per group */
    if (f->max_members && f->n_members[pi] + f->n_members[croot] > f->max_members) return false;
    if (ir_role_is_persistent(p->t.role) || p->t.role == ROLE_OUTPUT) return false;
    if (f->referenced[pi]) return false;
    /* every use of p is c (values the group does not store are read nowhere else) */
    const Uses *u = &f->uses[pi];
    for (int i = 0; i < u->n; i++)
        if (u->list[i] != c) return false;
    for (int k = 0; k < c->n_in; k++)
        if (c->in[k] == p && !same_element_operand(c, k)) return false;

    /* tentatively join, then check the memory; undo when it is not safe. The members are
     * walked as lists, not found by a scan of the graph: fusion stays linear in its size. */
    for (int i = f->first[pi]; i >= 0; i = f->next[i]) f->group[i] = croot;
    f->next[f->last[pi]] = f->first[croot];   /* pi's members, then croot's */
    int croot_first = f->first[croot];
    f->first[croot] = f->first[pi];
    bool ok = inputs_survive(f, croot, ci);
    if (ok) {
        f->n_members[croot] += f->n_members[pi];
        f->has_head[croot] |= f->has_head[pi];
    } else {
        f->first[croot] = croot_first;
        f->next[f->last[pi]] = -1;
        for (int i = f->first[pi]; i >= 0; i = f->next[i]) f->group[i] = pi;
    }
    return ok;
}

int *fuse_plan(const Graph *g, Arena *a)
{
    int n = g->n_nodes;
    Fuse f = {.g = g, .max_members = ir_choice_int(g, "fuse.members", 0)};
    f.group = arena_alloc(a, sizeof(int) * (size_t)(n + 1));
    f.n_members = calloc((size_t)n + 1, sizeof(int));
    f.has_head = calloc((size_t)n + 1, sizeof(bool));
    f.first = malloc(sizeof(int) * ((size_t)n + 1));
    f.last = malloc(sizeof(int) * ((size_t)n + 1));
    f.next = malloc(sizeof(int) * ((size_t)n + 1));
    f.referenced = calloc((size_t)n + 1, sizeof(bool));
    IR_ASSERT(f.n_members && f.has_head && f.first && f.last && f.next && f.referenced);
    for (int i = 0; i < n; i++) {
        IR_ASSERT(g->nodes[i]->index == i);
        f.group[i] = cg_node_runs_kernel(g->nodes[i]) ? i : -1;
        f.n_members[i] = 1;
        f.has_head[i] = is_head(g->nodes[i]->op);
        f.first[i] = f.last[i] = i;
        f.next[i] = -1;
    }
    for (int i = 0; i < n; i++) {
        const Format *fm = &g->nodes[i]->t.fmt;
        const Node *refs[2] = {fm->scale, fm->amax};
        for (int k = 0; k < 2; k++)
            if (refs[k] && refs[k]->index >= 0 && refs[k]->index < n && g->nodes[refs[k]->index] == refs[k])
                f.referenced[refs[k]->index] = true;
    }
    f.uses = ir_fill_uses(g);
    /* consumers in schedule order pull in their producers; a producer's own group is complete
     * by then (its producers come earlier still) */
    for (int ci = 0; ci < n; ci++) {
        Node *c = g->nodes[ci];
        if (f.group[ci] != ci || !is_elementwise(c->op)) continue;
        for (int k = 0; k < c->n_in; k++) {
            Node *p = c->in[k];
            if (p->index < 0 || f.group[p->index] != p->index) continue;
            try_merge(&f, p, c);
        }
    }
    free(f.n_members);
    free(f.has_head);
    free(f.first);
    free(f.last);
    free(f.next);
    free(f.referenced);
    return f.group;
}

/* ---------------------------------------------------------------- the report */

void fuse_print(const Graph *g, FILE *out)
{
    const int *group = fuse_plan(g, g->arena);
    int kernels = 0, fused = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        if (group[i] < 0) continue;
        if (group[i] == i) kernels++;
        else fused++;
    }
    fprintf(out, "# fuse: %d kernel groups; %d nodes computed inside another node's kernel\n",
            kernels, fused);
    for (int i = 0; i < g->n_nodes; i++) {
        if (group[i] != i) continue;
        int members = 0;
        for (int j = 0; j < i; j++) members += group[j] == i;
        if (!members) continue;
        fprintf(out, "# group %%%d:", g->nodes[i]->id);
        for (int j = 0; j <= i; j++)
            if (group[j] == i) fprintf(out, " %%%d %s", g->nodes[j]->id, ir_op_info(g->nodes[j]->op)->text);
        fputc('\n', out);
    }
}
