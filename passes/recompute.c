/* recompute.c — forward values made again in the backward instead of saved (save.cheap=0,
 * save.activations=0, save.attention_inputs=0).
 *
 * Autodiff makes every forward value that a backward node reads a saved activation: it lives
 * from its forward producer to its last backward reader, across the whole middle of the step.
 * Some of those values are cheap to make again from values that are saved anyway: a SwiGLU's
 * silu(gate) and silu(gate) * up (the backward keeps gate and up for their own gradients), a
 * GELU's output (its input is kept for GELU's backward), a norm's output (the norm's backward
 * keeps its input x). Recomputing them costs one pass over memory in the backward and saves
 * their bytes for the whole step: on Llama 1.1B at batch 4 x 2048, 5.7 GiB of -O0's 12.3 GiB
 * of saved activations (docs/precision.md). PyTorch's compiled graphs make the same trade.
 *
 * With the choice save.cheap=0 (the default at -O0; 1, the default of the FP8 levels, saves
 * them; fp8c tune measures both, and --memory-budget may pick it), each forward node that
 *   - is elementwise (ADD, SUB, MUL, SCALE, GELU, SILU) or a norm (LAYERNORM, RMSNORM),
 *   - is read by a backward node, and
 *   - reads only values the backward has anyway: persistent state (parameters), values a
 *     backward node reads already, or values recomputed here,
 * gets a copy in the backward, placed before its first backward reader, and every backward
 * reader reads the copy. The original is then read by forward nodes only and stops being saved
 * (the precision pass marks roles after this pass). A chain is copied whole, in forward order:
 * silu(gate) first, then the product that reads it reads its copy. The copy is the same op
 * over the same inputs, so it computes the same bits on every backend; what the precision pass
 * then decides for it (a transient in the backward, an FP8 copy where a GEMM reads it) is what
 * it decides for any backward value, with one difference kept: the copy's role is an
 * activation's, not a gradient's, so that an FP8 GEMM of the backward reads it in the forward
 * format (e4m3), as it read the saved value.
 *
 * With save.activations=0 (the default at -O2 and -O3) the same is done for one kind of cheap
 * value alone: an activation (GELU, SiLU) that the backward reads only in elementwise products
 * of its size, as SwiGLU's backward reads silu(gate) in dy * silu(gate). Its input is saved
 * anyway (the activation's own backward reads it), so the copy costs the backward nothing: the
 * product computes it from the input's saved copy as it reads it (the GPU's
 * fuse_inline_elementwise, a kernel of the CPU's kernel program). At the FP8 levels the saved
 * value would be an FP8 copy of its own, written in the forward (Llama 1.1B at batch 4 x 2048:
 * 46 MiB a layer, and a pass over the activation); the product then reads silu of gate's FP8
 * copy instead of an FP8 copy of silu(gate), the same quantization error taken before the
 * activation instead of after it.
 *
 * With save.attention_inputs=0 (the default at -O3) the same is done for attention's q, k and v,
 * which are not cheap: the projections that make them (a GEMM, its bias add, RoPE) are copied,
 * down to operands the backward keeps anyway (the normed input, which the projections' weight
 * gradients read; the weights). One more forward GEMM a layer in the backward buys the largest
 * saved value of a transformer layer: GPT-2's q|k|v is three times the width of the residual. A
 * copy made as soon as its operands exist would live from the start of the backward, as the saved
 * value did; the schedule therefore holds each copy until its reader's other operands exist
 * (passes/schedule.c, ir_is_recomputed). The precision pass recognises the copies as the forward
 * attention's inputs, so that the backward still reads the forward's logsumexp where the level
 * keeps it, and the GPU accumulates the copied GEMM as it did the original. */
#include "passes.h"

#include <string.h>

static bool is_cheap(OpKind op)
{
    switch (op) {
    case OP_ADD: case OP_SUB: case OP_MUL: case OP_SCALE: case OP_GELU: case OP_SILU:
    case OP_LAYERNORM: case OP_RMSNORM:
        return true;
    default:
        return false;
    }
}

/* What makes attention's inputs from values the backward keeps: the projections (a GEMM, its
 * bias, RoPE; views of them). */
static bool makes_attention_input(OpKind op)
{
    switch (op) {
    case OP_MATMUL: case OP_ADD: case OP_ROPE: case OP_RESHAPE: case OP_SLICE:
        return true;
    default:
        return false;
    }
}

static bool read_in_backward(const Uses *u)
{
    for (int k = 0; k < u->n; k++)
        if (u->list[k]->phase != PHASE_FORWARD) return true;
    return false;
}

/* save.activations=0: a GELU or SiLU of one input that the backward reads, only in ADD, SUB or
 * MUL of its own size */
static bool activation_of_products(const Node *n, const Uses *u)
{
    if ((n->op != OP_GELU && n->op != OP_SILU) || n->n_in != 1 || !read_in_backward(u)) return false;
    for (int k = 0; k < u->n; k++) {
        const Node *r = u->list[k];
        if (r->phase == PHASE_FORWARD) continue;
        if ((r->op != OP_ADD && r->op != OP_SUB && r->op != OP_MUL) || ir_numel(&r->t) != ir_numel(&n->t)) return false;
    }
    return true;
}

static char copy_tag;   /* pass_data of a copy (a copy's own copy pointer is never needed) */

/* The copies c reads go before c: a product's first backward reader (the GEMM of its weight's
 * gradient) can come before the first reader of the silu(gate) it is made of. */
static void hoist_copied_inputs(Graph *g, Node *c)
{
    for (int k = 0; k < c->n_in; k++) {
        Node *x = c->in[k];
        if (x->pass_data != &copy_tag || x->index < c->index) continue;
        ir_move_before(g, x, c);
        ir_renumber(g);
        hoist_copied_inputs(g, x);
    }
}

/* Whether the backward reads a value, and only attention's backward does. */
static bool only_attention_reads(const Uses *u)
{
    bool any = false;
    for (int k = 0; k < u->n; k++) {
        const Node *r = u->list[k];
        if (r->phase == PHASE_FORWARD) continue;
        if (r->op != OP_ATTENTION_BWD) return false;
        any = true;
    }
    return any;
}

/* Marks in `wanted` attention input n and what it is made of, down to values the backward keeps
 * anyway (persistent, or read there by something other than attention), through projections
 * only and at most a few levels deep; false (and `wanted` partly written) where that fails. */
static bool mark_attention_input(const Uses *uses, Node *n, bool *wanted, int depth)
{
    if (n->phase != PHASE_FORWARD || ir_role_is_persistent(n->t.role) || !makes_attention_input(n->op) ||
        depth > 4)
        return false;
    for (int k = 0; k < n->n_in; k++) {
        Node *x = n->in[k];
        bool kept = ir_role_is_persistent(x->t.role) ||
                    (x->phase == PHASE_FORWARD && read_in_backward(&uses[x->index]) &&
                     !only_attention_reads(&uses[x->index]));
        if (!kept && !wanted[x->index] && !mark_attention_input(uses, x, wanted, depth + 1)) return false;
    }
    wanted[n->index] = true;
    return true;
}

bool pass_recompute(Graph *g, const PassOptions *opt)
{
    (void)opt;
    bool cheap = !precision_cheap_saved(g);
    bool activations = !precision_activations_saved(g);
    bool attention_inputs = !precision_attention_inputs_saved(g);
    if (!cheap && !activations && !attention_inputs) return true;
    ir_renumber(g);
    Uses *uses = ir_fill_uses(g);
    int count = g->n_nodes;
    /* save.attention_inputs=0: the GEMMs (with their bias and RoPE) that make attention's q,
     * k and v, where their own inputs are kept, so that the backward makes q, k, v again */
    bool *wanted = arena_alloc(g->arena, sizeof(bool) * (size_t)(count ? count : 1));
    memset(wanted, 0, sizeof(bool) * (size_t)(count ? count : 1));
    for (int i = 0; attention_inputs && i < count; i++) {
        const Node *a = g->nodes[i];
        if (a->op != OP_ATTENTION_BWD) continue;
        for (int k = 1; k < a->n_in; k++) {
            Node *x = a->in[k];
            if (x->op == OP_ATTENTION || !only_attention_reads(&uses[x->index])) continue;
            bool *trial = arena_alloc(g->arena, sizeof(bool) * (size_t)count);
            memcpy(trial, wanted, sizeof(bool) * (size_t)count);
            if (mark_attention_input(uses, x, trial, 0)) memcpy(wanted, trial, sizeof(bool) * (size_t)count);
        }
    }
    /* which nodes are copied, decided on the graph as autodiff left it, in forward order (a
     * node whose input is copied may be copied too) */
    bool *copied = arena_alloc(g->arena, sizeof(bool) * (size_t)(count ? count : 1));
    Node **chosen = arena_alloc(g->arena, sizeof(Node *) * (size_t)(count ? count : 1));
    int *chosen_at = arena_alloc(g->arena, sizeof(int) * (size_t)(count ? count : 1));
    int n_chosen = 0;
    for (int i = 0; i < count; i++) {
        Node *n = g->nodes[i];
        copied[i] = false;
        n->pass_data = NULL;
        bool candidate = wanted[i] || (cheap && is_cheap(n->op) && read_in_backward(&uses[i])) ||
                         (activations && activation_of_products(n, &uses[i]));
        if (n->phase != PHASE_FORWARD || !candidate || ir_role_is_persistent(n->t.role) || n->t.role == ROLE_OUTPUT)
            continue;
        bool inputs_kept = true;
        for (int k = 0; k < n->n_in && inputs_kept; k++) {
            const Node *x = n->in[k];
            inputs_kept = ir_role_is_persistent(x->t.role) || copied[x->index] ||
                          (x->phase == PHASE_FORWARD && read_in_backward(&uses[x->index]));
        }
        if (!inputs_kept) continue;
        copied[i] = true;
        chosen_at[n_chosen] = i;
        chosen[n_chosen++] = n;
    }
    /* the copies: the same op and attributes over the same inputs (or their copies), each
     * before the first backward reader of its original, which every backward reader now reads */
    for (int m = 0; m < n_chosen; m++) {
        Node *n = chosen[m];
        const Uses *u = &uses[chosen_at[m]];   /* its readers as they were: node pointers */
        Node **in = arena_alloc(g->arena, sizeof(Node *) * (size_t)n->n_in);
        for (int k = 0; k < n->n_in; k++) in[k] = n->in[k]->pass_data ? n->in[k]->pass_data : n->in[k];
        Node *c = ir_add(g, n->op, n->n_in, in, n->loc);
        memcpy(c->iattr, n->iattr, sizeof c->iattr);
        memcpy(c->fattr, n->fattr, sizeof c->fattr);
        const char *err = ir_infer_shape(c, g->arena);
        if (err) ir_die(__FILE__, __LINE__, "recompute: %s", err);
        c->t.fmt = n->t.fmt;
        c->t.role = ROLE_ACTIVATION;   /* a value of the forward, made late: not a gradient */
        c->phase = PHASE_BACKWARD;
        if (n->t.name) c->t.name = arena_printf(g->arena, "%s:recomputed", n->t.name);
        n->pass_data = c;
        c->pass_data = &copy_tag;
        Node *first = NULL;
        for (int k = 0; k < u->n; k++) {
            Node *r = u->list[k];
            if (r->phase == PHASE_FORWARD) continue;
            for (int j = 0; j < r->n_in; j++)
                if (r->in[j] == n) r->in[j] = c;
            if (!first || r->index < first->index) first = r;
        }
        /* a copy only other copies read (a GEMM under its bias add) goes before them, below */
        if (!first) continue;
        ir_move_before(g, c, first);
        ir_renumber(g);
        hoist_copied_inputs(g, c);
    }
    for (int i = 0; i < g->n_nodes; i++) g->nodes[i]->pass_data = NULL;
    return true;
}
