/* spec_fuse.c — what the GPU backend fuses across nodes, on top of the kernel program.
 *
 * The kernel program's groups (codegen/fuse.c) are the same for every backend. The GPU's
 * library kernels and cuBLASLt can do more in one launch than the kernel IR describes, and
 * these rewrites of the per-node plans (spec.c) use that, each switched by the choice table
 * (fusion_on: "fuse.KIND[@ID]", which `fp8c tune` times):
 *   GEMM epilogues         a matmul's group run as one cuBLASLt call (cuda_plan_epilogues);
 *   producer quantizes     a norm or GELU writes its own FP8 copy (fuse_producer_quantizes);
 *   bias gradients         summed in the transposing quantize of dy (fuse_bias_grads);
 *   group quantizes        per-group scales made in the quantize (fuse_group_quantizes);
 *   input group copies     an activation writes its input's group copy (fuse_input_group_copies),
 *                          a product its two inputs' (fuse_product_group_copies);
 *   elementwise producers  SwiGLU's silu and product computed by the kernels that read them
 *                          (fuse_inline_elementwise);
 *   cast-transposes        a transposed FP8 copy written with the copy (fuse_cast_transposes),
 *                          a norm's by tiles from the row statistics its first pass kept
 *                          (norm_stats_kept, "fuse.norm_stats");
 *   the loss               cross entropy's forward and backward in one pass over the
 *                          logits (fuse_ce_one_pass), or else the backward reads the
 *                          forward's logsumexp (fuse_ce_lse).
 * Each decides from the graph, its uses and the memory plan's offsets only, so the compiler
 * (which compiles the kernels) and the training binary (which launches them) plan the same.
 * cuda_plan_graph runs the per-node plans and then these; cuda_plan_epilogues is the phases'
 * view with the GEMM epilogues applied, and then the scales that earlier launches make
 * (spec_scales.c). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec_internal.h"

/* ---------------------------------------------------------------- GEMM epilogues
 *
 * Fusion (codegen/fuse.c) puts a matmul and the elementwise nodes that consume its
 * product into one group that runs at the place of the group's last node, having checked
 * against the memory plan that every input survives until then. Where the group is a chain
 * cuBLASLt's epilogue computes — the product plus a bias row (y = x W^T + b), plus a
 * same-shaped tensor (a residual: y = x W^T + b + r; one term of a gradient sum; or an
 * accumulator updated in place: g += x^T dy), or GELU's backward of the product
 * (dx = (dy W) gelu'(x), DGELU, reading x) — the GEMM writes the chain's last value directly
 * and the other nodes run no kernel of their own.
 *
 * A GELU of a group's result is not in the group (its input is kept for the backward, so the
 * group must store it), but cuBLASLt's GELU_AUX_BIAS writes both: the GELU as D and its input
 * as the auxiliary output. The GELU then moves into the GEMM (gemm_gelu) when its value is
 * stored as it is (-O0), or, under delayed scaling, when nothing but its per-tensor FP8 copy
 * and the copy's amax record read it: the GEMM then writes the FP8 copy itself, through the
 * scale the history gave (D_SCALE), and leaves the value's amax for the history (AMAX_D) —
 * TransformerEngine's forward MLP GEMM. cuBLASLt offers AMAX_D only for FP8 results, and an
 * amax under current scaling is needed before the copy's scale exists, so where the copy is
 * scaled by its current amax (the levels' default) the GELU keeps its own kernel, which then
 * writes the copy itself (fuse_producer_quantizes: fewer bytes than a bf16 GELU from the GEMM
 * and a quantize after it). cuBLASLt's GELU is the tanh approximation, as the GELU op's.
 * Measured on an H200 (cuBLAS 13.1, d12's MLP at batch 32 x 1024): GELU_AUX_BIAS costs 0.04
 * ms (bf16) to 0.07 ms (e4m3) over a bias epilogue, against some 0.1 ms for a GELU kernel;
 * DGELU costs 0.08 ms over a plain bf16 GEMM, against some 0.15 ms for GELU's backward, but
 * with FP8 operands its GEMM takes 0.78 ms against 0.13, so FP8 products keep their GELU
 * backward kernel.
 *
 * Unlike the kernel IR's fusion this does change results a little: the chain is rounded
 * once, from f32, where the unfused nodes round the product (and the GELU's input) to their
 * formats first. */

static bool plain_direct(const Tensor *t) {
    return t->fmt.codec == CODEC_PLAIN && t->fmt.scaling == SCALE_NONE &&
           (t->fmt.elem == FMT_BF16 || t->fmt.elem == FMT_F32);
}

/* cuBLASLt's auxiliary matrix: GELU's input, plain, of D's element type and shape, never on
 * the bytes of d (the epilogue reads or writes it while it writes D) */
static bool gemm_aux_fits(const Node *aux, const Node *d) {
    ElemType e = d->t.fmt.elem == FMT_E4M3 || d->t.fmt.elem == FMT_E5M2 ? FMT_BF16 : d->t.fmt.elem;
    return plain_direct(&aux->t) && aux->t.fmt.elem == e && aux->t.offset >= 0 &&
           ir_numel(&aux->t) == ir_numel(&d->t) && !fuse_nodes_overlap(aux, d);
}

/* Whether the GEMM's result d stays off what it reads: its operands, their scales. */
static bool gemm_reads_clear(const Node *m, const Node *d) {
    for (int k = 0; k < 2; k++) {
        const Node *x = m->in[k];
        if (x->t.offset < 0 || fuse_nodes_overlap(x, d)) return false;
        if (x->t.fmt.scale && (x->t.fmt.scale->t.offset < 0 || fuse_nodes_overlap(x->t.fmt.scale, d)))
            return false;
    }
    return true;
}

/* The epilogue of the group members[0..n) (a matmul first, in schedule order), or false;
 * GELU's backward only where `gelu` allows activations. */
static bool epilogue_of(const Node *const *members, int n, bool gelu, GemmEpilogue *ep) {
    const Node *m = members[0];
    memset(ep, 0, sizeof *ep);
    if (m->op != OP_MATMUL || n < 2) return false;
    int64_t N = IR_IATTR(m, MATMUL, trans_b) ? rows_of(&m->in[1]->t) : cols_of(&m->in[1]->t);
    for (int i = 1; i < n; i++) {
        const Node *c = members[i], *prev = members[i - 1], *other = NULL;
        bool last = i == n - 1;
        if (c->op == OP_ADD || (c->op == OP_ADD_N && c->n_in == 2)) {
            if ((c->in[0] == prev) == (c->in[1] == prev)) return false;
            other = c->in[0] == prev ? c->in[1] : c->in[0];
            if (c->op == OP_ADD && c->in[1] == other && other->t.rank == 1 && ir_numel(&other->t) == N &&
                i == 1 && N != ir_numel(&c->t)) {
                ep->bias = other;
            } else if (ir_numel(&other->t) == ir_numel(&c->t) && !ep->c) {
                ep->c = other;
            } else {
                return false;
            }
            ep->d = c;
        } else if (c->op == OP_ACCUMULATE && last && !ep->c && c->in[1] == prev && c->in[0] != prev) {
            ep->c = ep->d = c->in[0];
        } else if (gelu && c->op == OP_GELU_BWD && last && i == 1 && c->in[0] == prev && c->in[1] != prev &&
                   operand_kind(&m->in[0]->t) != OPD_FP8 && operand_kind(&m->in[1]->t) != OPD_FP8) {
            ep->act = CU_ACT_DGELU;
            ep->aux = c->in[1];
            ep->d = c;
        } else {
            return false;
        }
    }
    /* formats cuBLASLt reads and writes as they are; the result must not land on an operand
     * (or its scale) that the GEMM is still reading; C may be the result itself */
    const Tensor *d = &ep->d->t;
    if (!plain_direct(d) || d->offset < 0) return false;
    if (ep->c && (!plain_direct(&ep->c->t) || ep->c->t.fmt.elem != d->fmt.elem || ep->c->t.offset < 0))
        return false;
    if (ep->c && ep->c != ep->d && fuse_nodes_overlap(ep->c, ep->d) &&
        !(ep->c->t.offset == d->offset && ir_role_is_persistent(ep->c->t.role) == ir_role_is_persistent(d->role)))
        return false;
    if (ep->bias && (!plain_direct(&ep->bias->t) || ep->bias->t.offset < 0 || fuse_nodes_overlap(ep->bias, ep->d)))
        return false;
    if (ep->aux && !gemm_aux_fits(ep->aux, ep->d)) return false;
    return gemm_reads_clear(m, ep->d);
}

/* Whether the two nodes at `at` are all that read y: its delayed per-tensor FP8 copy (a
 * QUANTIZE to e4m3 or e5m2 through a scale the history gives, keeping no transposed copy) and
 * the copy's amax record (an AMAX_RECORD of y) — the pair the scaling pass makes for a value
 * under delayed scaling, in either order. */
static bool delayed_fp8_copy(const Graph *g, const Uses *uses, const Node *y, int at, const Node **copy,
                             const Node **record) {
    if (at + 1 >= g->n_nodes || uses[y->index].n != 2 || ir_role_is_persistent(y->t.role) ||
        y->t.role == ROLE_OUTPUT)
        return false;
    const Node *a = g->nodes[at], *b = g->nodes[at + 1];
    const Node *q = a->op == OP_QUANTIZE ? a : b, *r = a->op == OP_AMAX_RECORD ? a : b;
    if (q->op != OP_QUANTIZE || r->op != OP_AMAX_RECORD || q->in[0] != y || r->in[1] != y) return false;
    const Format *f = &q->t.fmt;
    const Node *sc = f->scale;
    if ((f->elem != FMT_E4M3 && f->elem != FMT_E5M2) || f->codec != CODEC_PLAIN || f->scaling != SCALE_PER_TENSOR ||
        f->recipe != RECIPE_DELAYED || !sc || sc->t.fmt.elem != FMT_F32 || ir_numel(&sc->t) != 1 || sc->t.offset < 0 ||
        ir_transposed_offset(q) || q->t.offset < 0 || fuse_nodes_overlap(q, sc) || fuse_nodes_overlap(q, r->in[0]))
        return false;
    *copy = q;
    *record = r;
    return true;
}

/* The GELU of the result h of a fused GEMM whose group ends at r, taken into the GEMM (the
 * essay above): the GELU is the next node, and stores its value as it is, or hands it only to
 * its delayed FP8 copy and amax record, the two nodes after it. members (n of them) gains the
 * nodes the GEMM now computes, in schedule order. The GEMM runs at r, before them: its results
 * must not land on what it reads, and between r and them nothing else runs. */
static bool gemm_gelu(const Graph *g, const Uses *uses, int r, const Node **members, int *n, GemmEpilogue *ep) {
    const Node *h = ep->d;
    if (ep->act != CU_ACT_NONE || ep->c || r + 1 >= g->n_nodes || ir_amax_parts_offset(h)) return false;
    const Node *y = g->nodes[r + 1];
    if (y->op != OP_GELU || y->in[0] != h || h->t.fmt.elem != FMT_BF16) return false;
    GemmEpilogue e = *ep;
    e.act = CU_ACT_GELU;
    e.aux = h;
    const Node *copy = NULL, *record = NULL;
    if (delayed_fp8_copy(g, uses, y, r + 2, &copy, &record)) {   /* y itself is never stored */
        e.d = copy;
        e.record = record;
    } else if (plain_direct(&y->t) && y->t.offset >= 0 && !ir_amax_parts_offset(y)) {
        e.d = y;
    } else {
        return false;
    }
    if (!gemm_aux_fits(h, e.d) || !gemm_reads_clear(members[0], e.d) || (e.bias && fuse_nodes_overlap(e.bias, e.d)))
        return false;
    *ep = e;
    members[(*n)++] = y;
    for (int k = r + 2; record && k <= r + 3; k++) members[(*n)++] = g->nodes[k];
    return true;
}

/* ---------------------------------------------------------------- producers fused with quantizes */

/* Whether the quantize q (at schedule position qi) may run y's kernel again instead of reading
 * y: the graph allows it (ir_quantize_may_rerun_producer: y, a norm or activation whose kernel
 * stores through CkAmaxOnly or CkThrough, is made only for q and its scale), and everything
 * y's kernel reads still holds its value at q's place and shares no byte with q's result. */
static bool quantize_can_rerun(const Graph *g, const Uses *uses, const Node *q, int qi) {
    if (!ir_quantize_may_rerun_producer(q, uses)) return false;
    const Node *y = q->in[0];
    if (y->index >= qi || g->nodes[y->index] != y || y->t.offset % 16 || q->t.offset % 16 ||
        ir_numel(&y->t) != ir_numel(&q->t))
        return false;
    for (int k = 0; k < y->n_in; k++) {
        const Node *x = y->in[k], *xs = x->t.fmt.scale;
        if (!fuse_value_survives(g, x, y->index, qi) || fuse_nodes_overlap(q, x)) return false;
        if (xs && (!fuse_value_survives(g, xs, y->index, qi) || fuse_nodes_overlap(q, xs))) return false;
    }
    return true;
}

/* The uses of g's nodes, for passes that read a node's position as its index; NULL where the
 * positions are not the indices (nothing is fused then). */
static Uses *uses_by_position(const Graph *g) {
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->index != i) return NULL;
    return ir_fill_uses(g);
}

/* The one hook of the tuner (compiler/tune.c) in this file: each fusion below asks the graph's
 * choice table whether it may fuse at a site ("fuse.KIND@ID", else "fuse.KIND", else yes). A
 * tuning record or --choice sets them at build time; they travel in the artifact, so the
 * binary plans exactly what fp8c compiled. */
static bool fusion_on(const Graph *g, const char *kind, const Node *site) { return ir_choice_on(g, kind, site); }

/* whether a node's plan is its own launches, which no other fusion took or emptied */
static bool plans_own(const CuNodePlan *p) { return p->n_launch > 0 && !p->members && !p->n_absorbed; }

/* ---------------------------------------------------------------- an activation writing its input's group copy
 *
 * At -O2 and -O3 the backward reads a GELU's (or SiLU's, or a norm's) input x from its copy
 * into 1x16 groups, which a quantize makes right before the activation reads x (its group
 * scales made in the same launch: fuse_group_quantizes). The activation's kernel writes that
 * copy itself from the vectors it reads (reduce.cuh, ck_unary_group; a norm's from the rows it
 * reads, ck_norm_group): x is read from memory once instead of twice (GPT-2 d12 at batch 32:
 * 201 MB a layer for the GELU, 50 MB for each norm). The quantize's launch moves to the
 * activation's place, which
 * it may: nothing reads the copy or its scales before then (every use of either is at or
 * after the activation), the memory plan keeps their bytes from the quantize's place on, and
 * x holds its value up to the activation, which reads it. (A GELU that a GEMM's epilogue
 * computes, gemm_gelu, follows the GEMM directly, so its input has no quantize before it.)
 * The bytes are those of the two launches. */
/* whether q is a group copy (a QUANTIZE of x whose one launch also makes its scales) that a
 * reader of x may write instead */
static bool group_copy_of(const Graph *g, const CuNodePlan *plans, const Node *q, const Node *x) {
    if (q->op != OP_QUANTIZE || q->in[0] != x || q->n_in != 2 || q->index < 0) return false;
    const CuNodePlan *pq = &plans[q->index];
    return pq->n_launch == 1 && pq->n_absorbed == 1 && pq->absorbed[0] == q->in[1] && !pq->members &&
           !strncmp(pq->launch[0].fn, "qgroup", 6) && fusion_on(g, "fuse.input_group_copies", q);
}

/* the group copy of x before y that y's launch may write instead, or NULL */
static const Node *group_copy_before(const Graph *g, const Uses *uses, const CuNodePlan *plans, const Node *x,
                                     const Node *y) {
    const Uses *ux = &uses[x->index];
    for (int i = 0; i < ux->n; i++) {
        const Node *q = ux->list[i];
        if (!group_copy_of(g, plans, q, x) || q->index >= y->index) continue;
        bool read_early = false;
        const Node *made[2] = {q, q->in[1]};
        for (int k = 0; k < 2; k++) {
            const Uses *u = &uses[made[k]->index];
            for (int j = 0; j < u->n; j++)
                read_early |= u->list[j] != q && u->list[j]->index <= y->index;
        }
        if (!read_early) return q;
    }
    return NULL;
}

static const Node *input_group_copy(const Graph *g, const Uses *uses, const CuNodePlan *plans, const Node *y) {
    bool act = (y->op == OP_GELU || y->op == OP_SILU) && y->n_in == 1;
    if (!act && y->op != OP_LAYERNORM && y->op != OP_RMSNORM) return NULL;
    return group_copy_before(g, uses, plans, y->in[0], y);
}

/* the input copy an activation's plan took (fuse_input_group_copies), or NULL */
static const Node *input_copy_taken(const CuNodePlan *p) {
    const Node *y = p->node;
    for (int k = 0; y && k < p->n_absorbed; k++)
        if (p->absorbed[k]->op == OP_QUANTIZE && p->absorbed[k]->in[0] == y->in[0]) return p->absorbed[k];
    return NULL;
}

static void take_input_copy(CuNodePlan *p, const Node *q) {
    p->absorbed[p->n_absorbed++] = q;
    p->absorbed[p->n_absorbed++] = q->in[1];
}

static void fuse_input_group_copies(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    for (int yi = 0; yi < g->n_nodes; yi++) {
        const Node *y = g->nodes[yi], *q;
        if (!plans_own(&plans[yi]) || plans[yi].n_launch != 1 || !(q = input_group_copy(g, uses, plans, y))) continue;
        char why[256];
        CuNodePlan fused;
        Spec s = spec_for(g, y, a, &fused, why, sizeof why);
        s.input_copy = q;
        if (!plan_node(&s) || fused.n_launch != 1) continue;
        take_input_copy(&fused, q);
        plans[yi] = fused;
        memset(&plans[q->index], 0, sizeof plans[0]);
        plans[q->index].node = q;
    }
}

static bool is_product(const Node *n) { return n->op == OP_ADD || n->op == OP_SUB || n->op == OP_MUL; }

/* a plan that computes a producer of another node inside its launch (absorbed here):
 * fuse_inline_elementwise's, which no other fusion re-plans */
static bool plan_inlines(const CuNodePlan *p) {
    for (int k = 0; k < p->n_absorbed; k++)
        if (p->absorbed[k]->op == OP_GELU || p->absorbed[k]->op == OP_SILU || is_product(p->absorbed[k])) return true;
    return false;
}

/* A layernorm or GELU whose value only an FP8 copy of it reads (its one quantize) writes that
 * copy itself: its kernel runs at its own place storing only the block maxima that the copy's
 * scale reads, and again at the quantize's place storing FP8 (ops.cuh, CkAmaxOnly and
 * CkThrough). The value is never written or read back: per element, 2 bytes written and 2 read
 * become 2 read again (the producer's input). The bits are those of the unfused pair. */
static void fuse_producer_quantizes(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    for (int qi = 0; qi < g->n_nodes; qi++) {
        const Node *q = g->nodes[qi];
        if (q->op != OP_QUANTIZE || !fusion_on(g, "fuse.producer_quantizes", q) || !quantize_can_rerun(g, uses, q, qi))
            continue;
        const Node *y = q->in[0];
        if (plan_inlines(&plans[y->index])) continue;   /* fuse_inline_elementwise took it */
        char why[256];
        CuNodePlan amax_only, through;
        Spec s1 = spec_for(g, y, a, &amax_only, why, sizeof why), s2 = spec_for(g, y, a, &through, why, sizeof why);
        s1.result = RESULT_AMAX_ONLY;
        s1.input_copy = input_copy_taken(&plans[y->index]);   /* fuse_input_group_copies */
        s2.result = RESULT_THROUGH;
        s2.through = q;
        if (!plan_node(&s1) || !s1.amax_written || amax_only.n_launch != 1 || !plan_node(&s2)) continue;
        if (s1.input_copy) take_input_copy(&amax_only, s1.input_copy);
        through.node = q;
        through.absorbed[through.n_absorbed++] = y;
        plans[y->index] = amax_only;
        plans[qi] = through;
    }
}

/* ---------------------------------------------------------------- cast-transpose in the quantize
 *
 * The layout pass gives a per-tensor FP8 copy that a GEMM also reads transposed (the weight
 * gradient's x, saved across the step) a TRANSPOSE node before its first reader in the
 * backward, and the schedule may bring it up next to the quantize that makes the copy (GPT-2:
 * right after it, or after the GEMM that reads the copy). Where the transpose's bytes are
 * free from the quantize's place on, the quantize writes both layouts from the same 64 x 64
 * tiles in shared memory (gemm_io.cuh, ck_quantize_t; TransformerEngine's cast-transpose), and the
 * transpose runs nothing: the copy is not read back, one launch less. The quantize that writes
 * the transposed bytes may be
 *  - the transpose's input c itself: a plain quantize, or the second pass of a producer that
 *    writes its own copy (fuse_producer_quantizes): an elementwise one computes the tiles from
 *    its inputs (CkLdUnary), a norm stages a band of 32 rows in shared memory (ck_norm_t);
 *  - an earlier quantize of the same value through the same scale into the same format, where
 *    the transpose is all that reads c: the scaling pass quantizes a value that backward nodes
 *    read besides its GEMM again, with the scale of its forward copy, and the schedule may put
 *    that quantize next to the forward's (GPT-2: the attention's y, quantized twice a layer).
 *    The two have the same bytes, so c then runs nothing either.
 * Delayed scaling is left out: there the GEMM before a GELU may write the GELU's copy itself
 * (gemm_gelu, after these plans). The bits are those of the unfused nodes. */
typedef struct {
    bool persistent;
    int64_t lo, hi;
} Bytes;

static Bytes bytes_of(const Node *n) {
    Bytes b = {ir_role_is_persistent(n->t.role), 0, 0};
    if (n->t.offset < 0 || n->t.fmt.elem == FMT_VOID) return b;
    b.lo = n->t.offset;
    b.hi = n->t.offset + ir_storage_bytes(n);
    return b;
}

static bool bytes_overlap(const Node *n, Bytes b) {
    Bytes m = bytes_of(n);
    return m.persistent == b.persistent && m.lo < b.hi && b.lo < m.hi;
}

/* whether n's inputs or their scales, or (with result) n's own storage, share a byte with b */
static bool touches(const Node *n, Bytes b, bool result) {
    if (result && bytes_overlap(n, b)) return true;
    for (int k = 0; k < n->n_in; k++)
        if (bytes_overlap(n->in[k], b) || (n->in[k]->t.fmt.scale && bytes_overlap(n->in[k]->t.fmt.scale, b)))
            return true;
    return false;
}

/* a per-tensor FP8 copy as ck_quantize_t writes it: 1-byte codes, current scaling, one layout */
static bool plain_fp8_copy(const Node *q) {
    const Format *f = &q->t.fmt;
    return q->op == OP_QUANTIZE && (f->elem == FMT_E4M3 || f->elem == FMT_E5M2) && f->codec == CODEC_PLAIN &&
           f->scaling == SCALE_PER_TENSOR && f->recipe == RECIPE_CURRENT && f->scale && !ir_transposed_offset(q) &&
           q->t.offset >= 0;
}

static bool same_copy(const Node *a, const Node *b) {
    return plain_fp8_copy(a) && plain_fp8_copy(b) && a->in[0] == b->in[0] && a->n_in == b->n_in &&
           (a->n_in < 2 || a->in[1] == b->in[1]) && a->t.fmt.elem == b->t.fmt.elem &&
           a->t.fmt.scale == b->t.fmt.scale && a->t.fmt.margin == b->t.fmt.margin &&
           ir_numel(&a->t) == ir_numel(&b->t) && rows_of(&a->t) == rows_of(&b->t);
}

/* Whether t's bytes, written at q's place instead of t's (later), are left alone until t's
 * place: by every node whose work runs in between (its own, what its plan absorbed, the GEMM
 * groups that run there: group[k], fuse_plan's), and by what the writing launch reads (q's
 * inputs, or the producer's where it computes q's value: its own value is never stored then). */
static bool bytes_free_early(const Graph *g, const CuNodePlan *plans, const int *group, const Node *q,
                             const Node *producer, const Node *t) {
    int qi = q->index, ti = t->index;
    Bytes b = bytes_of(t);
    if (bytes_overlap(q, b) || (producer ? touches(producer, b, false) : touches(q, b, false))) return false;
    for (int k = 0; k < g->n_nodes; k++) {
        int at = group && group[k] >= 0 ? group[k] : k;
        if (((k > qi && k < ti) || (at > qi && at < ti)) && touches(g->nodes[k], b, true)) return false;
    }
    for (int j = qi + 1; j < ti; j++)
        for (int k = 0; k < plans[j].n_absorbed; k++)
            if (touches(plans[j].absorbed[k], b, true)) return false;
    return true;
}

/* q's plan, if ck_quantize_t or ck_norm_t can take it over: a plain quantize's (1 launch,
 * *producer NULL), or an elementwise producer's or a norm's second pass
 * (fuse_producer_quantizes: *producer its node) */
static bool cast_transposable(const CuNodePlan *pq, const Node *q, const Node **producer) {
    const Node *y = q->in[0];
    bool through = pq->n_absorbed == 1 && pq->absorbed[0] == y;
    *producer = through ? y : NULL;
    if (pq->node != q || pq->n_launch != 1 || pq->members || (pq->n_absorbed && !through)) return false;
    return !through || y->op == OP_GELU || y->op == OP_SILU || y->op == OP_GELU_BWD || y->op == OP_SILU_BWD ||
           y->op == OP_LAYERNORM || y->op == OP_RMSNORM;
}

/* A norm y whose own pass stores only its block maxima (fuse_producer_quantizes' amax-only
 * plan, with or without its input's group copy) keeps its rows' statistics in its result's unused storage
 * (Spec.row_stats: *stats, its plan again with them), so that the pass that writes its FP8
 * copy q in both layouts (and t, the transpose) takes 64 x 64 tiles of the value from x and
 * the statistics (CkLdNorm) instead of bands of whole rows (ck_norm_t): a tile holds no row
 * whole, and a band of rows held 16 to 32 rows' bytes and their reductions in a block of two
 * an SM (Llama 1.1B's rows of 2048: 127 registers a thread, 98 KiB of shared memory). Where
 * y's bytes are apart from q's and t's (the one launch reads the statistics and writes
 * those), and the choice fuse.norm_stats is on. */
static bool norm_stats_kept(const Graph *g, const CuNodePlan *plans, Arena *a, const Node *y, const Node *q,
                            const Node *t, CuNodePlan *stats) {
    const CuNodePlan *p = &plans[y->index];
    const Node *copy = input_copy_taken(p);   /* fuse_input_group_copies */
    if ((y->op != OP_LAYERNORM && y->op != OP_RMSNORM) || !fusion_on(g, "fuse.norm_stats", y) || p->n_launch != 1 ||
        p->members || p->n_absorbed != (copy ? 2 : 0) || !strstr(p->launch[0].body, "CkAmaxOnly<") ||
        (strncmp(p->launch[0].body, "ck_norm<", 8) && strncmp(p->launch[0].body, "ck_norm_group<", 14)) ||
        y->t.offset < 0 || fuse_nodes_overlap(y, q) || fuse_nodes_overlap(y, t))
        return false;
    char why[256];
    Spec s = spec_for(g, y, a, stats, why, sizeof why);
    s.result = RESULT_AMAX_ONLY;
    s.row_stats = true;
    s.input_copy = copy;
    if (!plan_node(&s) || !s.amax_written || stats->n_launch != 1) return false;
    if (copy) take_input_copy(stats, copy);
    return true;
}

static void fuse_cast_transposes(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    int *group = fuse_plan(g, a);
    for (int ti = 0; ti < g->n_nodes; ti++) {
        const Node *t = g->nodes[ti], *c = t->op == OP_TRANSPOSE ? t->in[0] : NULL;
        if (!c || !plain_fp8_copy(c) || !transpose_keeps_values(t) || t->t.offset < 0 || plans[ti].n_launch != 1 ||
            !fusion_on(g, "fuse.cast_transposes", t))
            continue;
        /* the candidates: the earliest quantize with c's bytes where only t reads c, then c */
        const Node *cand[2] = {NULL, c}, *cy;
        if (uses[c->index].n == 1 && cast_transposable(&plans[c->index], c, &cy) && !cy)
            for (int j = 0; j < c->index && !cand[0]; j++)
                if (same_copy(g->nodes[j], c)) cand[0] = g->nodes[j];
        for (int k = 0; k < 2; k++) {
            const Node *q = cand[k], *y;
            if (!q || !cast_transposable(&plans[q->index], q, &y) || !bytes_free_early(g, plans, group, q, y, t))
                continue;
            char why[256];
            CuNodePlan fused, stats;
            bool kept = y && norm_stats_kept(g, plans, a, y, q, t, &stats), planned = false;
            for (int tiles = kept; tiles >= 0 && !planned; tiles--) {   /* the tiles, else bands */
                Spec s = spec_for(g, y ? y : q, a, &fused, why, sizeof why);
                if (y) {
                    s.result = RESULT_THROUGH;
                    s.through = q;
                    s.stats_of = tiles ? y : NULL;
                }
                s.transpose_to = t;
                planned = plan_node(&s) && fused.n_launch == 1;
                if (planned && tiles) plans[y->index] = stats;
            }
            if (!planned) continue;
            fused.node = q;
            if (y) fused.absorbed[fused.n_absorbed++] = y;
            if (q != c) fused.absorbed[fused.n_absorbed++] = c;
            fused.absorbed[fused.n_absorbed++] = t;
            plans[q->index] = fused;
            memset(&plans[ti], 0, sizeof plans[ti]);
            plans[ti].node = t;
            if (q != c) {
                memset(&plans[c->index], 0, sizeof plans[c->index]);
                plans[c->index].node = c;
            }
            break;
        }
    }
}

static bool is_member(const Node *const *m, int n, const Node *x) {
    for (int k = 0; k < n; k++)
        if (m[k] == x) return true;
    return false;
}

/* whether every reader of x other than the members (m[0..n), none where n is 0) comes after
 * position `at` */
static bool read_after(const Uses *uses, const Node *x, const Node *const *m, int n, int at) {
    const Uses *u = &uses[x->index];
    for (int k = 0; k < u->n; k++)
        if (!is_member(m, n, u->list[k]) && u->list[k]->index <= at) return false;
    return true;
}


/* A bias gradient, the sum over rows of a gradient dy, where dy is also quantized with its
 * transposed copy for the GEMMs (the weight's input and weight gradients): the quantize's tiles
 * sum their columns as they go, and a last launch at the quantize's place adds the tiles' sums
 * (TransformerEngine's cast-transpose-dbias). dy is read once instead of twice. The schedule
 * puts the sum, and the accumulation of the sum into the bias's gradient accumulator, before
 * the quantize; they move to the quantize's place where nothing reads them before it:
 *  - a sum that only later nodes read keeps its bytes until then (the memory plan holds them
 *    for its readers), and the last launch stores it;
 *  - a sum that only its accumulation reads, accumulated into an accumulator that nothing in
 *    between reads or writes and that only later nodes read: the last launch adds the sum,
 *    rounded to its format, into the accumulator, as the accumulation would have, and the sum
 *    is never stored.
 * Their own places then run nothing. */
static const Node *bias_grad_accumulation(const Graph *g, const Uses *uses, const Node *q, const Node *sum) {
    const Uses *u = &uses[sum->index];
    const Node *acc = u->n == 1 ? u->list[0] : NULL;
    if (!acc || acc->op != OP_ACCUMULATE || acc->in[1] != sum || acc->in[0] == sum || acc->index >= q->index ||
        !plain_direct(&acc->t) || !plain_direct(&acc->in[0]->t) || !read_after(uses, acc, NULL, 0, q->index))
        return NULL;
    const Node *state = acc->in[0];
    if (!fuse_value_survives(g, state, acc->index, q->index)) return NULL;
    for (int j = acc->index + 1; j < q->index; j++)
        for (int k = 0; k < g->nodes[j]->n_in; k++)
            if (fuse_nodes_overlap(state, g->nodes[j]->in[k])) return NULL;
    return acc;
}

static void fuse_bias_grads(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    for (int si = 0; si < g->n_nodes; si++) {
        const Node *sum = g->nodes[si], *x = sum->op == OP_SUM_ROWS ? sum->in[0] : NULL;
        if (!x || x->index < 0 || !plain_direct(&sum->t) || !plain_direct(&x->t) || sum->t.role == ROLE_OUTPUT ||
            ir_numel(&sum->t) != cols_of(&x->t) || !fusion_on(g, "fuse.bias_grads", sum))
            continue;
        const Uses *u = &uses[x->index];
        const Node *q = NULL;
        for (int k = 0; k < u->n && !q; k++)
            if (u->list[k]->op == OP_QUANTIZE && ir_transposed_offset(u->list[k])) q = u->list[k];
        if (!q || q->index <= si || plans[q->index].n_launch != 1) continue;
        const Node *acc = NULL;
        if (!read_after(uses, sum, NULL, 0, q->index) && !(acc = bias_grad_accumulation(g, uses, q, sum))) continue;
        if (acc && plans[acc->index].n_launch != 1) continue;
        char why[256];
        CuNodePlan fused;
        Spec s = spec_for(g, q, a, &fused, why, sizeof why);
        s.bias_grad = sum;
        s.bias_acc = acc;
        if (!plan_node(&s) || fused.n_launch != 2) continue;
        fused.absorbed[fused.n_absorbed++] = sum;
        if (acc) fused.absorbed[fused.n_absorbed++] = acc;
        plans[q->index] = fused;
        memset(&plans[si], 0, sizeof plans[si]);
        plans[si].node = sum;
        if (acc) {
            memset(&plans[acc->index], 0, sizeof plans[acc->index]);
            plans[acc->index].node = acc;
        }
    }
}

/* A quantize into per-group (or 1 x 128 tile) scales, and the QUANT_SCALE that makes those
 * scales from the same x, run as one launch at the quantize's place: each group's scale is
 * stored and its elements quantized through it while x is in registers (reduce.cuh,
 * ck_quantize_group), one read of x instead of two. The scale's place then runs nothing. It
 * may move later because nothing before the quantize reads it (every use of the scale is the
 * quantize or after it), the memory plan keeps its bytes from its own place on, and x, which
 * the quantize reads, still holds its value there. The bits are those of the two launches. */
static bool group_quantize_fusable(const Uses *uses, const Node *q) {
    const Node *sc = q->op == OP_QUANTIZE && q->n_in == 2 ? q->in[1] : NULL;
    Scaling kind = q->t.fmt.scaling;
    if (!sc || ir_transposed_offset(q) || (kind != SCALE_PER_GROUP && kind != SCALE_TILE_1x128) ||
        q->t.fmt.recipe != RECIPE_CURRENT || q->t.fmt.scale != sc || sc->op != OP_QUANT_SCALE ||
        sc->in[0] != q->in[0] || IR_IATTR(sc, QUANT_SCALE, elem) != q->t.fmt.elem ||
        IR_IATTR(sc, QUANT_SCALE, scaling) != kind ||
        (kind == SCALE_PER_GROUP && IR_IATTR(sc, QUANT_SCALE, group) != q->t.fmt.group) || sc->index < 0 || sc->index >= q->index ||
        ir_role_is_persistent(sc->t.role) || ir_role_is_persistent(q->in[0]->t.role))
        return false;
    const Uses *u = &uses[sc->index];
    for (int k = 0; k < u->n; k++)
        if (u->list[k]->index < q->index) return false;
    return true;
}

static void fuse_group_quantizes(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    for (int qi = 0; qi < g->n_nodes; qi++) {
        const Node *q = g->nodes[qi];
        if (!group_quantize_fusable(uses, q) || !fusion_on(g, "fuse.group_quantizes", q) || plans[qi].n_launch != 1 ||
            plans[q->in[1]->index].n_launch != 1)
            continue;
        char why[256];
        CuNodePlan fused;
        Spec s = spec_for(g, q, a, &fused, why, sizeof why);
        s.group_scale = q->in[1];
        if (!plan_node(&s) || fused.n_launch != 1) continue;
        fused.absorbed[fused.n_absorbed++] = q->in[1];
        plans[qi] = fused;
        memset(&plans[q->in[1]->index], 0, sizeof plans[0]);
        plans[q->in[1]->index].node = q->in[1];
    }
}

/* A cross entropy's backward right after its forward (the loss chunks of chunk_loss.c run
 * so) runs as one pass over the logits at the backward's place (ck_ce_fused): each row is read
 * once, held in registers where it fits, for its logsumexp, its loss and its gradient; the last
 * block takes the mean. The two nodes read the logits twice and write the gradient, and take
 * four launches (the row losses, their mean, the backward's coefficient, the gradient); one
 * pass reads them once, in one launch: GPT-2 d12's 25 chunks of 1311 x 50304 bf16 logits read
 * 3.3 GB less a step. The results have the unfused launches' bits: the same operations in the
 * same order, the mean's f64 sum over as many threads as the unfused mean's launch.
 *
 * It may run there: the backward's coefficient is ready (the backward reads it), nothing runs
 * between the two, so the forward's inputs still hold and nothing reads the loss in between,
 * and the loss lands on none of the backward's operands. The evaluation phase runs forward
 * nodes only: there the forward runs its own launches (CuNodePlan.alone). */
static void fuse_ce_one_pass(const Graph *g, CuNodePlan *plans, Arena *a) {
    for (int j = 1; j < g->n_nodes; j++) {
        const Node *b = g->nodes[j], *f = g->nodes[j - 1];
        if (b->op != OP_CROSS_ENTROPY_BWD || f->op != OP_CROSS_ENTROPY || b->in[1] != f->in[0] ||
            b->in[2] != f->in[1] || b->in[0] == f ||
            !plans_own(&plans[j - 1]) || !plans_own(&plans[j]) || !fusion_on(g, "fuse.ce_one_pass", b))
            continue;
        bool clear = f->t.offset >= 0 && !fuse_nodes_overlap(f, b);
        for (int i = 0; clear && i < b->n_in; i++) clear = !fuse_nodes_overlap(f, b->in[i]);
        if (!clear) continue;
        char why[256];
        CuNodePlan fused;
        Spec s = spec_for(g, b, a, &fused, why, sizeof why);
        s.ce_forward = f;
        s.ce = ce_rows_chosen(g, b);
        if (!plan_node(&s) || fused.n_launch != 1) continue;
        CuNodePlan *alone = arena_alloc(a, sizeof *alone);
        *alone = plans[j - 1];
        fused.absorbed[fused.n_absorbed++] = f;
        plans[j] = fused;
        memset(&plans[j - 1], 0, sizeof plans[0]);
        plans[j - 1].node = f;
        plans[j - 1].alone = alone;
    }
}

/* Where the one pass is switched off (fuse.ce_one_pass=0), the backward right after its
 * forward still shares its logsumexps: both read every row of the logits for it, the same
 * computation in the same order (ck_row_lse, one block of ce_row_threads a row). The forward
 * leaves it in the scratch, after the row losses and the backward's coefficient, and the
 * backward reads it there: a read of the logits less, the same bits. Nothing runs between
 * them, so nothing else uses the scratch (which every node's launches share) in between. */
static void fuse_ce_lse(const Graph *g, CuNodePlan *plans, Arena *a) {
    for (int j = 1; j < g->n_nodes; j++) {
        const Node *b = g->nodes[j], *f = g->nodes[j - 1];
        if (b->op != OP_CROSS_ENTROPY_BWD || f->op != OP_CROSS_ENTROPY || b->in[1] != f->in[0] ||
            b->in[2] != f->in[1] || plans[j - 1].n_launch != 2 || plans[j].n_launch != 2 || !fusion_on(g, "fuse.ce_lse", b))
            continue;
        char why[256];
        CuNodePlan pf, pb;
        Spec sf = spec_for(g, f, a, &pf, why, sizeof why), sb = spec_for(g, b, a, &pb, why, sizeof why);
        sf.ce_lse_at = sb.ce_lse_at = 8 * (rows_of(&f->in[0]->t) + 1);
        sf.ce = ce_rows_chosen(g, f), sb.ce = ce_rows_chosen(g, b);
        if (!plan_node(&sf) || !plan_node(&sb) || pf.n_launch != 2 || pb.n_launch != 2) continue;
        plans[j - 1] = pf;
        plans[j] = pb;
    }
}

/* ---------------------------------------------------------------- a norm's backward in one pass
 *
 * Autodiff writes a LayerNorm's backward as four nodes and a RMSNorm's as two: the input
 * gradient dx (*_BWD_X), the weight's gradient sum(dy xhat) (*_BWD_W, statistics recomputed),
 * the bias's sum(dy) (SUM_ROWS), and the residual stream adds dx to the gradient of the skip
 * path (ADD_N); each weight gradient then goes into its accumulator (ACCUMULATE). Run one by
 * one they read dy four times and x three, write dx and read it back for the sum, and take
 * nine launches (d12 at batch 32: 0.25 ms a norm, 6 ms a step). Here they run as two: one pass
 * over the rows that makes dx, adds the other term, and leaves each block's column sums, and
 * one over those partials that stores the gradients or adds them into their accumulators
 * (norm.cuh, ck_norm_bwd_fused and ck_norm_grads_final; llm.c's layernorm_backward does the
 * same). dx is rounded to its own format before the sum, as the ADD_N would have read it, so
 * the input gradient has the bits of the unfused nodes; the column sums are added in another
 * (fixed) order, so the weights' gradients agree to rounding.
 *
 * The pair runs at the place of the last of the nodes, and the others' places run nothing. It
 * may: everything read (dy, x, w, the other term, the accumulators) still holds its value
 * there, nothing but those nodes reads their results before it, and what it stores lands on
 * none of its inputs, except that the sum may take the bytes of dy, x or the other term
 * element for element (each lane reads its elements of a row before writing them). */

/* the single reader of x, where it is an op of kind `op` reading x as input `k`; else NULL */
static const Node *sole_reader(const Uses *uses, const Node *x, OpKind op, int k) {
    const Uses *u = &uses[x->index];
    if (u->n != 1 || u->list[0]->op != op || u->list[0]->in[k] != x) return NULL;
    return u->list[0];
}

/* the node of kind op reading dy as input 0 and, where x is given, x as input 1 */
static const Node *reader_of(const Uses *uses, const Node *dy, OpKind op, const Node *x) {
    const Uses *u = &uses[dy->index];
    for (int k = 0; k < u->n; k++)
        if (u->list[k]->op == op && u->list[k]->in[0] == dy && (!x || u->list[k]->in[1] == x)) return u->list[k];
    return NULL;
}

/* whether a node strictly between positions a and b, other than the members, reads or writes
 * a byte of x */
static bool touched_between(const Graph *g, const Node *x, const Node *const *m, int n, int a, int b) {
    for (int j = (a < b ? a : b) + 1; j < (a < b ? b : a); j++) {
        const Node *o = g->nodes[j];
        if (is_member(m, n, o)) continue;
        if (fuse_nodes_overlap(o, x)) return true;
        for (int k = 0; k < o->n_in; k++)
            if (fuse_nodes_overlap(x, o->in[k])) return true;
    }
    return false;
}

/* whether x, read at `at`, has been made by then and still holds its value: nothing outside
 * the members writes over it between its making and `at` */
static bool holds_at(const Graph *g, const Node *x, const Node *const *m, int n, int at) {
    if (x->index < 0 || x->index >= at || g->nodes[x->index] != x) return false;
    int prev = x->index;
    for (int j = x->index + 1; j <= at; j++) {
        if (j < at && !is_member(m, n, g->nodes[j])) continue;
        if (j > prev + 1 && !fuse_value_survives(g, x, prev, j)) return false;
        prev = j;
    }
    return true;
}

/* whether a and b are the same bytes read the same way: the row pass may write a lane's
 * elements of one after reading them of the other */
static bool same_elements(const Node *a, const Node *b) {
    return a->t.offset == b->t.offset && ir_role_is_persistent(a->t.role) == ir_role_is_persistent(b->t.role) &&
           a->t.fmt.elem == b->t.fmt.elem && a->t.fmt.scaling == SCALE_NONE && b->t.fmt.scaling == SCALE_NONE &&
           ir_numel(&a->t) == ir_numel(&b->t);
}

/* Whether the norm's backward may run as one pass at position `at` (a member's): see above.
 * What it stores lands where memplan put it; a result it makes earlier than its own node would
 * must find those bytes unused until then, one it makes later must have no reader before. */
static bool norm_grads_fusable(const Graph *g, const Uses *uses, const NormGrads *ng, const Node *const *m, int n,
                               int at) {
    const Node *bx = ng->bx, *y = ng->add ? ng->add : bx;
    const Node *other = ng->add ? (ng->add->in[0] == bx ? ng->add->in[1] : ng->add->in[0]) : NULL;
    const Node *in[4] = {bx->in[0], bx->in[1], bx->in[2], other};
    for (int k = 0; k < 4; k++) {
        const Node *x = in[k];
        if (!x) continue;
        if (x->t.offset < 0 || !holds_at(g, x, m, n, at)) return false;
        if (x->t.fmt.scale && !holds_at(g, x->t.fmt.scale, m, n, at)) return false;
    }
    const Node *stored[3] = {y, ng->acc_w ? NULL : ng->bw, ng->acc_b ? NULL : ng->sum};
    for (int k = 0; k < 3; k++) {
        const Node *o = stored[k];
        if (!o) continue;
        if (!plain_direct(&o->t) || o->t.offset < 0 || o->t.role == ROLE_OUTPUT || ir_role_is_persistent(o->t.role) ||
            !read_after(uses, o, m, n, at) || (o->index > at && touched_between(g, o, m, n, at, o->index)))
            return false;
        for (int i = 0; i < 4; i++)
            if (in[i] && fuse_nodes_overlap(o, in[i]) && !(o == y && same_elements(o, in[i]))) return false;
        for (int i = 0; i < k; i++)
            if (stored[i] && fuse_nodes_overlap(o, stored[i])) return false;
    }
    if (!plain_direct(&bx->t) || !plain_direct(&ng->bw->t) || (ng->sum && !plain_direct(&ng->sum->t)))
        return false;
    const Node *accs[2] = {ng->acc_w, ng->acc_b};
    for (int k = 0; k < 2; k++) {
        const Node *acc = accs[k];
        if (!acc) continue;
        if (!plain_direct(&acc->t) || !plain_direct(&acc->in[0]->t) || !read_after(uses, acc, m, n, at) ||
            touched_between(g, acc->in[0], m, n, acc->index, at))
            return false;
    }
    return true;
}

static void fuse_norm_grads(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    for (int xi = 0; xi < g->n_nodes; xi++) {
        const Node *bx = g->nodes[xi];
        if ((bx->op != OP_LAYERNORM_BWD_X && bx->op != OP_RMSNORM_BWD_X) || !fusion_on(g, "fuse.norm_grads", bx))
            continue;
        bool ln = bx->op == OP_LAYERNORM_BWD_X;
        NormGrads ng = {.bx = bx};
        ng.bw = reader_of(uses, bx->in[0], ln ? OP_LAYERNORM_BWD_W : OP_RMSNORM_BWD_W, bx->in[1]);
        if (!ng.bw) continue;
        if (ln) ng.sum = reader_of(uses, bx->in[0], OP_SUM_ROWS, NULL);
        if (ng.sum && !plans_own(&plans[ng.sum->index])) ng.sum = NULL;   /* summed by dy's quantize */
        ng.add = sole_reader(uses, bx, OP_ADD_N, 0);
        if (!ng.add) ng.add = sole_reader(uses, bx, OP_ADD_N, 1);
        if (ng.add && (ng.add->n_in != 2 || ng.add->in[0] == ng.add->in[1] ||
                       ir_numel(&ng.add->t) != ir_numel(&bx->t)))
            ng.add = NULL;
        ng.acc_w = sole_reader(uses, ng.bw, OP_ACCUMULATE, 1);
        if (ng.acc_w && ng.acc_w->in[0] == ng.bw) ng.acc_w = NULL;
        if (ng.sum) {
            ng.acc_b = sole_reader(uses, ng.sum, OP_ACCUMULATE, 1);
            if (ng.acc_b && ng.acc_b->in[0] == ng.sum) ng.acc_b = NULL;
        }
        const Node *m[6] = {ng.bx, ng.bw, ng.sum, ng.add, ng.acc_w, ng.acc_b};
        int n = 0;
        bool own = true;
        for (int k = 0; k < 6; k++)
            if (m[k]) {
                m[n++] = m[k];
                own = own && plans_own(&plans[m[k]->index]);
            }
        /* the earliest member's place where it may run */
        int at = -1;
        for (int k = 0; own && k < n; k++)
            if ((at < 0 || m[k]->index < at) && norm_grads_fusable(g, uses, &ng, m, n, m[k]->index)) at = m[k]->index;
        if (at < 0) continue;
        char why[256];
        CuNodePlan fused;
        Spec s = spec_for(g, g->nodes[at], a, &fused, why, sizeof why);
        if (!plan_norm_grads(&s, &ng) || fused.n_launch != 2) continue;
        for (int k = 0; k < n; k++) {
            if (m[k]->index == at) continue;
            fused.absorbed[fused.n_absorbed++] = m[k];
            memset(&plans[m[k]->index], 0, sizeof plans[0]);
            plans[m[k]->index].node = m[k];
        }
        plans[at] = fused;
    }
}

/* ---------------------------------------------------------------- an elementwise producer inside its reader
 *
 * A SwiGLU MLP makes silu(gate) for one product, silu(gate) * up, and its backward makes
 * dy * up for one activation gradient, silu_bwd(dy * up, gate): each a pass that writes a
 * value only for the next elementwise kernel to read it back (Llama 1.1B at batch 4 x 2048:
 * 88 MiB a layer each way, 22 layers). Here the reader computes the value from the
 * producer's inputs, which it reads instead (ops.cuh, CkAct and ck_unary_bin), and the
 * producer runs nothing:
 *   - an activation (GELU, SILU) all of whose readers are ADD, SUB or MUL of its size takes
 *     no launch; each reader reads the activation's input in its place. Autodiff's product
 *     dy * silu(gate) reads silu(gate) too, so the saved value is read by none: the forward
 *     product and the backward one both compute it from gate, which the backward keeps anyway;
 *   - a product (ADD, SUB, MUL of same-sized operands) read only by a GELU_BWD or SILU_BWD as
 *     its dy takes no launch; the activation gradient reads the product's two operands.
 * The value is rounded to its own format where its store would have rounded it, so the bits
 * are the unfused nodes'. Taken where the value is plain (bf16 or f32, no scale, no block
 * maxima of its own: its only readers are these kernels), where the inputs read in its place
 * hold their values at each reader's place (the memory plan's offsets), and where the reader's
 * result shares no byte with them, except element for element (an elementwise launch reads
 * an element before it writes it). The choice fuse.inline_elementwise (per node: the
 * producer's @ID) switches it. */

/* a value that a reader may compute instead of loading it: plain, no block maxima, not kept */
static bool inline_value(const Node *v) {
    return plain_direct(&v->t) && !ir_amax_parts_offset(v) && v->t.role != ROLE_OUTPUT &&
           !ir_role_is_persistent(v->t.role) && v->index >= 0;
}

/* whether x (and its scale), read by r in place of a producer, holds its value at r's place
 * and r's result lands on none of it but x's own elements */
static bool inline_input_holds(const Graph *g, const Node *x, const Node *r) {
    if (!holds_at(g, x, NULL, 0, r->index)) return false;
    if (x->t.fmt.scale && (!holds_at(g, x->t.fmt.scale, NULL, 0, r->index) || fuse_nodes_overlap(r, x->t.fmt.scale)))
        return false;
    return !fuse_nodes_overlap(r, x) || same_elements(r, x);
}

/* plans[r] replaced by r's launch computing producer v (its input `slot`) itself */
static bool plan_inlined(const Graph *g, const Node *r, const Node *v, int slot, Arena *a, CuNodePlan *out) {
    char why[256];
    Spec s = spec_for(g, r, a, out, why, sizeof why);
    s.inline_of = v;
    s.inline_slot = slot;
    if (!plan_node(&s) || out->n_launch != 1) return false;
    out->absorbed[out->n_absorbed++] = v;
    return true;
}

/* an activation computed by each of its readers, all products of its size */
static void inline_activation(const Graph *g, const Uses *uses, CuNodePlan *plans, const Node *act, Arena *a) {
    const Uses *u = &uses[act->index];
    enum { MOST = 4 };
    if (u->n < 1 || u->n > MOST) return;
    for (int k = 0; k < u->n; k++) {
        const Node *r = u->list[k];
        if (!is_product(r) || (r->in[0] == act) == (r->in[1] == act) || ir_numel(&r->t) != ir_numel(&act->t) ||
            !plans_own(&plans[r->index]) || plans[r->index].n_launch != 1 || !inline_input_holds(g, act->in[0], r))
            return;
    }
    CuNodePlan fused[MOST];
    for (int k = 0; k < u->n; k++)
        if (!plan_inlined(g, u->list[k], act, u->list[k]->in[0] == act ? 0 : 1, a, &fused[k])) return;
    for (int k = 0; k < u->n; k++) plans[u->list[k]->index] = fused[k];
    memset(&plans[act->index], 0, sizeof plans[0]);
    plans[act->index].node = act;
}

static void fuse_inline_elementwise(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if ((n->op == OP_GELU || n->op == OP_SILU) && n->n_in == 1 && inline_value(n) && plans_own(&plans[i]) &&
            plans[i].n_launch == 1 && fusion_on(g, "fuse.inline_elementwise", n))
            inline_activation(g, uses, plans, n, a);
        const Node *d = ir_inlined_product(g, n, uses);   /* its memory plan's lifetimes too */
        CuNodePlan fused;
        if (!d || !inline_value(d) || !plans_own(&plans[d->index]) || plans[d->index].n_launch != 1 ||
            !plans_own(&plans[i]) || plans[i].n_launch != 1 || !inline_input_holds(g, d->in[0], n) ||
            !inline_input_holds(g, d->in[1], n) || !plan_inlined(g, n, d, 0, a, &fused))
            continue;
        plans[i] = fused;
        memset(&plans[d->index], 0, sizeof plans[0]);
        plans[d->index].node = d;
    }
}

/* ---------------------------------------------------------------- a product writing its inputs' group copies
 *
 * At -O2 and -O3 a SwiGLU's backward reads gate and up from their 1x16 group copies (silu_bwd
 * reads gate; dy * up and dy * silu(gate) read up and gate: passes/recompute.c, save.activations).
 * Unfused, the forward reads each twice: SiLU's kernel reads gate and writes silu(gate) and
 * gate's copy (fuse_input_group_copies), up's quantize reads up, and the product reads
 * silu(gate) and up. Here the product computes silu from gate (as fuse_inline_elementwise
 * does) and writes both inputs' copies from the vectors it reads (reduce.cuh,
 * ck_binary_group): Llama 1.1B at batch 4 x 2048, 622 -> 358 MiB of traffic a layer. Taken for
 * any ADD, SUB or MUL of two inputs of its size where an input (or, for an activation that
 * only this product reads, the activation's input) has a group copy that the product may
 * write: the first reader of the input after the copy's place (a norm before the product
 * writes it from its row: fuse_input_group_copies), or a copy placed after the product whose
 * bytes and scales' bytes nothing touches from the product's place to its own
 * (bytes_free_early). Under the choices fuse.input_group_copies (the copy's @ID) and
 * fuse.inline_elementwise (the activation's); the bytes are those of the unfused launches. */

/* whether a node other than `except` reads x strictly between positions lo and hi */
static bool read_between(const Uses *uses, const Node *x, int lo, int hi, const Node *except) {
    const Uses *u = &uses[x->index];
    for (int k = 0; k < u->n; k++)
        if (u->list[k] != except && u->list[k]->index > lo && u->list[k]->index < hi) return true;
    return false;
}

/* the copy of input x (stored as read; act: an activation y computes from x, or NULL) that
 * product y may write, or NULL */
static const Node *product_copy(const Graph *g, const Uses *uses, const CuNodePlan *plans, const int *group,
                                const Node *x, const Node *y, const Node *act) {
    const Node *q = group_copy_before(g, uses, plans, x, y);
    if (q) return read_between(uses, x, q->index, y->index, act) ? NULL : q;
    const Uses *ux = &uses[x->index];
    for (int i = 0; i < ux->n; i++) {
        q = ux->list[i];
        const Node *sc = q->in[1];
        if (!group_copy_of(g, plans, q, x) || q->index <= y->index || sc->index <= y->index ||
            !bytes_free_early(g, plans, group, y, act, q) || !bytes_free_early(g, plans, group, y, act, sc) ||
            (act && touches(y, bytes_of(q), false)) || (act && touches(y, bytes_of(sc), false)))
            continue;
        return q;
    }
    return NULL;
}

static void fuse_product_group_copies(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    int *group = fuse_plan(g, a);
    for (int yi = 0; yi < g->n_nodes; yi++) {
        const Node *y = g->nodes[yi];
        if (!is_product(y) || y->n_in != 2 || !plans_own(&plans[yi]) || plans[yi].n_launch != 1 ||
            ir_numel(&y->in[0]->t) != ir_numel(&y->t) || ir_numel(&y->in[1]->t) != ir_numel(&y->t))
            continue;
        const Node *act = NULL, *stored[2] = {y->in[0], y->in[1]};
        int slot = -1;
        for (int k = 0; k < 2 && !act; k++) {
            const Node *x = y->in[k];
            if ((x->op == OP_GELU || x->op == OP_SILU) && x->n_in == 1 && y->in[1 - k] != x && inline_value(x) &&
                plans_own(&plans[x->index]) && plans[x->index].n_launch == 1 && uses[x->index].n == 1 &&
                ir_numel(&x->in[0]->t) == ir_numel(&y->t) && inline_input_holds(g, x->in[0], y) &&
                fusion_on(g, "fuse.inline_elementwise", x))
                act = x, slot = k, stored[k] = x->in[0];
        }
        const Node *q[2] = {product_copy(g, uses, plans, group, stored[0], y, act),
                            product_copy(g, uses, plans, group, stored[1], y, act)};
        if (!q[0] && !q[1]) continue;
        char why[256];
        CuNodePlan fused;
        Spec s = spec_for(g, y, a, &fused, why, sizeof why);
        s.inline_of = act;
        s.inline_slot = slot;
        s.product_copies[0] = q[0], s.product_copies[1] = q[1];
        if (!plan_node(&s) || fused.n_launch != 1) continue;
        if (act) {
            fused.absorbed[fused.n_absorbed++] = act;
            memset(&plans[act->index], 0, sizeof plans[0]);
            plans[act->index].node = act;
        }
        for (int k = 0; k < 2; k++) {
            if (!q[k]) continue;
            take_input_copy(&fused, q[k]);
            memset(&plans[q[k]->index], 0, sizeof plans[0]);
            plans[q[k]->index].node = q[k];
        }
        plans[yi] = fused;
    }
}

CuNodePlan *cuda_plan_graph(const Graph *g, Arena *a, char *why, size_t why_len) {
    CuNodePlan *plans = arena_alloc(a, sizeof *plans * (size_t)(g->n_nodes ? g->n_nodes : 1));
    for (int i = 0; i < g->n_nodes; i++)
        if (!cuda_plan_node(g, g->nodes[i], a, &plans[i], why, why_len)) return NULL;
    plan_attention_choices(g, plans, a);
    plan_ce_choices(g, plans, a);
    fuse_group_quantizes(g, plans, a);
    fuse_product_group_copies(g, plans, a);
    fuse_input_group_copies(g, plans, a);
    fuse_inline_elementwise(g, plans, a);
    fuse_producer_quantizes(g, plans, a);
    fuse_bias_grads(g, plans, a);
    fuse_ce_one_pass(g, plans, a);
    fuse_ce_lse(g, plans, a);
    fuse_norm_grads(g, plans, a);
    fuse_cast_transposes(g, plans, a);
    return plans;
}

CuNodePlan *cuda_plan_epilogues(Graph *g, const CuNodePlan *node_plans, Arena *a) {
    CuNodePlan *plans = arena_alloc(a, sizeof *plans * (size_t)(g->n_nodes ? g->n_nodes : 1));
    memcpy(plans, node_plans, sizeof *plans * (size_t)g->n_nodes);
    ir_renumber(g);
    int *group = fuse_plan(g, a);
    Uses *uses = uses_by_position(g);
    bool gelu_epilogues = fusion_on(g, "fuse.gemm_gelu", NULL);   /* off: GELU keeps its own kernels */
    const Node **members = arena_alloc(a, sizeof *members * (size_t)(g->n_nodes ? g->n_nodes : 1));
    for (int r = 0; r < g->n_nodes; r++) {
        int n = 0;
        for (int j = 0; j <= r; j++)
            if (group[j] == r) members[n++] = g->nodes[j];
        GemmEpilogue ep;
        if (n < 2 || !fusion_on(g, "fuse.gemm_epilogues", g->nodes[r]) || !epilogue_of(members, n, gelu_epilogues, &ep))
            continue;
        bool taken = false;   /* a member whose work another fusion already does (fuse_norm_grads) */
        for (int k = 0; k < n; k++)
            taken = taken || !plans_own(&node_plans[members[k]->index]);
        if (taken) continue;
        if (uses && gelu_epilogues) gemm_gelu(g, uses, r, members, &n, &ep);
        CuNodePlan fused;
        memset(&fused, 0, sizeof fused);
        fused.node = g->nodes[r];
        char why[256];
        Spec s = {.arena = a, .n = members[0], .plan = &fused, .why = why, .why_len = sizeof why};
        if (!plan_matmul(&s, &ep)) continue;
        if (ir_amax_parts_offset(ep.d)) plan_amax_pass(&s, ep.d);   /* the GEMM wrote d */
        fused.members = arena_alloc(a, sizeof *fused.members * (size_t)n);
        memcpy(fused.members, members, sizeof *members * (size_t)n);
        fused.n_members = n;
        for (int k = 0; k < n; k++) {
            const Node *m = members[k];
            memset(&plans[m->index], 0, sizeof plans[m->index]);
            plans[m->index].node = m;
        }
        plans[r] = fused;
    }
    spec_fold_scales(g, plans, a);   /* scales made by earlier launches (spec_scales.c) */
    return plans;
}
