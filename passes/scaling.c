/* scaling.c — makes the precision pass's FP8 decisions real: scales, amax, quantize nodes.
 *
 * The precision pass only marks: GEMMs that take FP8 operands (MATMUL fp8=granularity, history=
 * recipe) and saved values whose backward copy is FP8 (Tensor.saved_as). This pass inserts, for
 * each such operand or copy,
 *     s = quant_scale(x)        current scaling: max(format) / amax(x), per tensor, row, group
 *     q = quantize(x, s)        or block; q's Format names s as its scale
 * or, for delayed scaling (TransformerEngine), reads a persistent scale state instead, records
 * amax(x) into a persistent history (amax_record) and recomputes the scale from the history in
 * the update phase (delayed_scale). Forward operands are e4m3, gradients e5m2, or e4m3 too where
 * the precision pass set grad_e4m3 (DeepSeek-V3's choice).
 *
 * Reuse decides what the backward keeps. A value quantized for a forward GEMM is reused by the
 * backward GEMM that reads the same value (the weight gradient's x^T dy): the FP8 copy is what
 * the backward keeps, and the bf16 original dies with its last other reader. Quantizing the
 * kept value again in the backward would give the same bytes (same value, same scale) for
 * twice the memory traffic. Where there is no forward copy in that format, the backward
 * quantizes with the scale the forward found for the value where it has one (four bytes
 * kept), since the value and so its amax have not changed. Weights are quantized once per step
 * and the copy reused, except at O3 where no FP8 weight copy is kept across the step: each
 * use quantizes afresh, through a scale made from the amax that the weight's update found
 * (scale_from_update), so that no pass over a weight is left for its scale.
 *
 * quant_scale and quantize stay nodes of their own, so that the reference executor runs them
 * one by one; the kernel IR fuses a quantize with an elementwise producer read by nothing else,
 * and the GPU backend runs each as its own (vectorized) kernel, except that a layernorm or GELU
 * whose value only its FP8 copy reads writes that copy itself (cuda/spec.c). A per-tensor scale of a value
 * made by an elementwise or norm kernel marks that producer amax=1 (ops.def): its storage then
 * also holds the maxima its GPU blocks saw, and the scale reads those instead of the value. */
#include "passes.h"

#include <string.h>

typedef struct {
    Node *src;
    ElemType elem;
    Scaling scaling;
    int group;
    Phase phase;
    Node *q;
} Quantized;

typedef struct {
    Graph *g;
    const PassOptions *opt;
    Quantized *made;
    int n_made, cap_made;
} Ctx;

/* Node.pass_data of this pass: a value that a backward node other than an FP8 GEMM reads */
static char read_in_backward;

static const char *base_name(Ctx *c, const Node *x)
{
    return x->t.name ? x->t.name : arena_printf(c->g->arena, "t%d", x->id);
}

static Node *find_made(Ctx *c, Node *src, ElemType elem, Scaling sc, int group, Phase phase, bool any_phase)
{
    for (int i = 0; i < c->n_made; i++) {
        Quantized *q = &c->made[i];
        if (q->src == src && q->elem == elem && q->scaling == sc && q->group == group &&
            (any_phase || q->phase == phase))
            return q->q;
    }
    return NULL;
}

static void remember(Ctx *c, Quantized q)
{
    if (c->n_made == c->cap_made) {
        int cap = c->cap_made ? c->cap_made * 2 : 256;
        Quantized *bigger = arena_alloc(c->g->arena, sizeof *bigger * (size_t)cap);
        if (c->n_made) memcpy(bigger, c->made, sizeof *bigger * (size_t)c->n_made);
        c->made = bigger;
        c->cap_made = cap;
    }
    c->made[c->n_made++] = q;
}

static void infer_or_die(Graph *g, Node *n)
{
    const char *err = ir_infer_shape(n, g->arena);
    if (err) ir_die(__FILE__, __LINE__, "scaling: %s", err);
}

/* Whether the kernel that makes src can hand its per-tensor scale the maxima of its blocks
 * (ops.def's amax=1), sparing the scale a pass over the whole value: an elementwise or norm
 * op with a result of its own (not a view) in a plain unscaled format. */
static bool producer_keeps_amax(const Node *src)
{
    const Format *f = &src->t.fmt;
    return ir_op_keeps_amax(src->op) && !ir_role_is_persistent(src->t.role) && f->codec == CODEC_PLAIN &&
           f->scaling == SCALE_NONE && (f->elem == FMT_BF16 || f->elem == FMT_F16 || f->elem == FMT_F32);
}

/* Emits the nodes that quantize src into (elem, scaling, group) before `before`, in `phase`. */
/* How an operand's scale is found: current (history 0, static_scale 0), delayed (history > 0,
 * from the max or the most recent amax of it), or a fixed static scale; margin divides by 2^m. */
typedef struct {
    int history;
    bool recent;
    int margin;
    float static_scale;
} ScaleRecipe;

static Node *emit_quantize(Ctx *c, Node *src, ElemType elem, Scaling sc, int group, ScaleRecipe rc,
                           ElemType scale_elem, Phase phase, Node *before, Node *known_scale)
{
    Graph *g = c->g;
    Node *scale;
    int history = rc.history;
    if (known_scale) {
        scale = known_scale;   /* current scaling of an unchanged value: found once already */
    } else if (rc.static_scale > 0) {
        scale = ir_leaf(g, OP_CONST, NULL, phase == PHASE_FORWARD ? ROLE_ACTIVATION : ROLE_GRAD_TEMP,
                        FMT_F32, 0, NULL, src->loc);
        IR_FATTR(scale, CONST, value) = rc.static_scale;
        scale->phase = phase;
        ir_move_before(g, scale, before);
        history = 0;
    } else if (history > 0 && sc == SCALE_PER_TENSOR) {
        /* delayed: last step's scale from the history; this step's amax goes into it */
        /* a value quantized again in the backward (with a recipe of its own) has its own
         * history */
        const char *name = phase == PHASE_FORWARD || src->phase != PHASE_FORWARD
                               ? base_name(c, src)
                               : arena_printf(g->arena, "%s:bwd", base_name(c, src));
        Node *state = ir_leaf(g, OP_STATE, arena_printf(g->arena, "%s:%s.scale", name, fmt_elem_name(elem)),
                              ROLE_SCALE, FMT_F32, 0, NULL, src->loc);
        int64_t h = history;
        Node *hist = ir_leaf(g, OP_STATE, arena_printf(g->arena, "%s:%s.amax_history", name, fmt_elem_name(elem)),
                             ROLE_AMAX_HISTORY, FMT_F32, 1, &h, src->loc);
        ir_move_before(g, state, before);
        ir_move_before(g, hist, before);
        Node *rec = ir_add2(g, OP_AMAX_RECORD, hist, src, src->loc);
        rec->phase = phase;
        rec->t.role = ROLE_AMAX_HISTORY;   /* it is the history, updated */
        rec->t.name = hist->t.name;
        infer_or_die(g, rec);
        ir_move_before(g, rec, before);
        Node *upd = ir_add2(g, OP_DELAYED_SCALE, state, rec, src->loc);
        IR_IATTR(upd, DELAYED_SCALE, elem) = elem, IR_IATTR(upd, DELAYED_SCALE, margin) = rc.margin;
        IR_IATTR(upd, DELAYED_SCALE, use_max) = !rc.recent;
        upd->phase = PHASE_UPDATE;
        upd->t.role = ROLE_SCALE;
        upd->t.name = state->t.name;
        infer_or_die(g, upd);   /* stays at the end of the graph: the update phase */
        scale = state;
    } else {
        scale = ir_add1(g, OP_QUANT_SCALE, src, src->loc);
        IR_IATTR(scale, QUANT_SCALE, elem) = elem, IR_IATTR(scale, QUANT_SCALE, scaling) = sc;
        IR_IATTR(scale, QUANT_SCALE, group) = group, IR_IATTR(scale, QUANT_SCALE, margin) = rc.margin;
        if (sc == SCALE_PER_TENSOR && producer_keeps_amax(src)) ir_set_keeps_amax(src);
        scale->phase = phase;
        scale->t.role = phase == PHASE_FORWARD ? ROLE_ACTIVATION : ROLE_GRAD_TEMP;
        scale->t.fmt = fmt_plain(scale_elem);
        infer_or_die(g, scale);
        ir_move_before(g, scale, before);
    }
    Node *q = ir_add2(g, OP_QUANTIZE, src, scale, src->loc);
    q->phase = phase;
    q->t.role = phase == PHASE_FORWARD ? ROLE_ACTIVATION : ROLE_GRAD_TEMP;
    q->t.fmt = (Format){.elem = elem, .scaling = sc, .group = fmt_scaling_group(sc, group),
                        .recipe = rc.static_scale > 0 ? RECIPE_STATIC : history > 0 ? RECIPE_DELAYED : RECIPE_CURRENT,
                        .history = history, .history_max = history > 0 && !rc.recent, .margin = rc.margin,
                        .static_scale = rc.static_scale, .scale = scale};
    if (src->t.name) q->t.name = arena_printf(g->arena, "%s:%s", src->t.name, fmt_elem_name(elem));
    infer_or_die(g, q);
    ir_move_before(g, q, before);
    return q;
}

/* The update of parameter p, where the optimizer pass made one and it runs in the update phase
 * (not released into the backward by --grad-release). */
static Node *update_of(Graph *g, const Node *p)
{
    for (int i = g->n_nodes - 1; i >= 0; i--) {
        Node *u = g->nodes[i];
        if (ir_op_is_update(u->op) && u->in[0] == p) return u->phase == PHASE_UPDATE ? u : NULL;
    }
    return NULL;
}

/* Gives update u the operands that its copy attribute (ops.def: 1, the FP8 copy, its scale and
 * amax; 2, the amax alone) says it ends with, and moves it to the end of the graph: the
 * updates that write copies or amaxes together, which the GPU runs as one batch. */
static void extend_update(Graph *g, Node *u, int copy, Node *const *extra, int n_extra)
{
    Node **in = arena_alloc(g->arena, sizeof(Node *) * (size_t)(u->n_in + n_extra));
    memcpy(in, u->in, sizeof(Node *) * (size_t)u->n_in);
    memcpy(in + u->n_in, extra, sizeof(Node *) * (size_t)n_extra);
    u->in = in;
    u->n_in += n_extra;
    IR_IATTR(u, ADAMW, copy) = copy;
    infer_or_die(g, u);
    ir_move_to_end(g, u);
}

/* The FP8 copy of weight p that its update writes for the next step, in place of quantizing p
 * in every forward. The copy, its scale and the amax of the weights it was made from are
 * persistent:
 *     scale = delayed_scale(scale, amax)      update phase: from the weights the step read
 *     adamw(.., copy, scale, amax)            new weights, their copy through that scale, and
 *                                             their amax for the next update's scale
 * so the forward of step t reads weights quantized with the amax of step t-1's weights
 * (delayed scaling, one step of history), which the update finds as it writes them: no pass
 * over the weights is left in the step. The runtime makes the first copy (init.c) with current
 * scaling. Below O3 only, where a weight's copy is kept across the step anyway (the backward
 * reads it): O3 quantizes at every use and keeps no copy. */
static Node *optimizer_copy(Ctx *c, Node *p, ElemType elem, ScaleRecipe rc, Node *mm)
{
    Graph *g = c->g;
    Node *u = update_of(g, p);
    if (!u || IR_IATTR(u, ADAMW, copy) || precision_level(g->opt_level)->weight_copies_per_use || rc.history > 0 || rc.static_scale > 0) return NULL;
    Node *first_update = NULL;
    for (int i = 0; i < g->n_nodes && !first_update; i++)
        if (g->nodes[i]->phase == PHASE_UPDATE && g->nodes[i]->n_in) first_update = g->nodes[i];
    const char *name = arena_printf(g->arena, "%s:%s", base_name(c, p), fmt_elem_name(elem));
    Node *scale = ir_leaf(g, OP_STATE, arena_printf(g->arena, "%s.scale", name), ROLE_SCALE, FMT_F32, 0, NULL, p->loc);
    Node *amax = ir_leaf(g, OP_STATE, arena_printf(g->arena, "%s.amax", name), ROLE_AMAX_HISTORY, FMT_F32, 0,
                         NULL, p->loc);
    Node *copy = ir_leaf(g, OP_STATE, name, ROLE_WEIGHT_COPY, elem, p->t.rank, p->t.dims, p->loc);
    copy->t.fmt = (Format){.elem = elem, .scaling = SCALE_PER_TENSOR, .recipe = RECIPE_DELAYED, .history = 1,
                           .margin = rc.margin, .scale = scale};
    copy->grad_of = p;
    scale->grad_of = amax->grad_of = p;
    ir_move_before(g, scale, mm);
    ir_move_before(g, amax, mm);
    ir_move_before(g, copy, mm);

    Node *upd = ir_add2(g, OP_DELAYED_SCALE, scale, amax, p->loc);
    IR_IATTR(upd, DELAYED_SCALE, elem) = elem, IR_IATTR(upd, DELAYED_SCALE, margin) = rc.margin;
    IR_IATTR(upd, DELAYED_SCALE, use_max) = 0;
    upd->phase = PHASE_UPDATE;
    upd->t.role = ROLE_SCALE;
    upd->t.name = scale->t.name;
    infer_or_die(g, upd);
    ir_move_before(g, upd, first_update);   /* the scales first, the updates together after */

    extend_update(g, u, 1, (Node *[]){copy, upd, amax}, 3);
    return copy;
}

/* O3's per-use copies of weight p take their scale from the amax of p that p's update found
 * as it wrote p, in place of a pass over p at each step's first use:
 *     adamw(.., amax)                         copy=2: the new weights' amax into the state
 *     s = quant_scale(amax)                   forward: max(elem) / amax / 2^margin
 * The amax of a one-element tensor holding max |p| is that maximum, so s has the bits that
 * quant_scale(p) would have had: the step computes the same thing with one read of p fewer.
 * The state holds the amax of the weights as they are between updates; the runtime finds the
 * first from the initial (or loaded) weights, and a checkpoint keeps it with the weights. Not
 * where the update runs in the backward (--grad-release), nor where the weights are sharded
 * and gathered per layer (--shard-states=3: the gather finds their amax, comm_weights.c), and
 * only for current scaling per tensor; the choice scale.weight_amax=0 (a point of fp8c tune)
 * keeps the passes. Gives the scale node, or NULL to quantize as usual. */
static Node *scale_from_update(Ctx *c, Node *p, ElemType elem, ScaleRecipe rc, Node *mm)
{
    Graph *g = c->g;
    if (!precision_level(g->opt_level)->weight_copies_per_use || rc.history > 0 || rc.static_scale > 0 ||
        (c->opt && c->opt->shard_states >= 3) || !ir_choice_int(g, "scale.weight_amax", 1))
        return NULL;
    Node *u = update_of(g, p);
    if (!u || IR_IATTR(u, ADAMW, copy) == 1) return NULL;
    Node *amax;
    if (IR_IATTR(u, ADAMW, copy) == 2) {
        amax = u->in[ir_update_amax_index(u)];
    } else {
        amax = ir_leaf(g, OP_STATE, arena_printf(g->arena, "%s.amax", base_name(c, p)), ROLE_AMAX_HISTORY, FMT_F32, 0,
                       NULL, p->loc);
        amax->grad_of = p;
        ir_move_before(g, amax, mm);
        extend_update(g, u, 2, &amax, 1);
    }
    Node *scale = ir_add1(g, OP_QUANT_SCALE, amax, p->loc);
    IR_IATTR(scale, QUANT_SCALE, elem) = elem, IR_IATTR(scale, QUANT_SCALE, scaling) = SCALE_PER_TENSOR;
    IR_IATTR(scale, QUANT_SCALE, margin) = rc.margin;
    scale->phase = PHASE_FORWARD;
    scale->t.role = ROLE_ACTIVATION;
    scale->t.fmt = fmt_plain(FMT_F32);
    infer_or_die(g, scale);
    ir_move_before(g, scale, mm);
    return scale;
}

static bool is_gradient(const Node *x)
{
    return x->phase != PHASE_FORWARD && x->n_in > 0 && x->t.role == ROLE_GRAD_TEMP;
}

/* Marks (pass_data) the values that a backward node other than an FP8 GEMM reads. */
static void mark_read_in_backward(Graph *g)
{
    for (int i = 0; i < g->n_nodes; i++) g->nodes[i]->pass_data = NULL;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *r = g->nodes[i];
        if (r->phase == PHASE_FORWARD || (r->op == OP_MATMUL && IR_IATTR(r, MATMUL, fp8))) continue;
        for (int j = 0; j < r->n_in; j++) r->in[j]->pass_data = &read_in_backward;
    }
}

static bool only_fp8_gemms_read(const Node *x) { return x->pass_data != &read_in_backward; }

/* The operand of an FP8 GEMM: reuse a copy where the plan allows, else quantize here. */
static Node *gemm_operand(Ctx *c, Node *mm, int i)
{
    Node *x = mm->in[i];
    if (x->op == OP_QUANTIZE) return x;
    int mode = (int)IR_IATTR(mm, MATMUL, fp8);
    ElemType elem = is_gradient(x) && !IR_IATTR(mm, MATMUL, grad_e4m3) ? FMT_E5M2 : FMT_E4M3;
    Scaling sc = fmt_gemm_operand_scaling((GemmScaling)mode, x->op == OP_PARAM);
    int group = fmt_scaling_info(sc)->block_cols > 0 ? fmt_scaling_info(sc)->block_cols : 0;

    Node *q = find_made(c, x, elem, sc, group, mm->phase, false);
    if (!q && mm->phase != PHASE_FORWARD) {
        /* a forward copy serves the backward: weights below O3; values saved in FP8; and
         * values kept as they are that only FP8 GEMMs of the backward read, whose copy would
         * be the same bytes again (one that others read stays, and is quantized late) */
        Node *fwd = find_made(c, x, elem, sc, group, PHASE_FORWARD, false);
        bool weight_copy = x->op == OP_PARAM && !precision_level(c->g->opt_level)->weight_copies_per_use;
        bool saved_fp8 = x->t.saved_as.elem == elem;
        bool kept = x->op != OP_PARAM && x->t.saved_as.elem == FMT_VOID && only_fp8_gemms_read(x);
        if (fwd && (weight_copy || saved_fp8 || kept)) {
            q = fwd;
            if (q->t.role != ROLE_WEIGHT_COPY) q->t.role = ROLE_SAVED;
        }
    }
    ScaleRecipe rc = {(int)IR_IATTR(mm, MATMUL, history), IR_IATTR(mm, MATMUL, recent) != 0,
                      (int)IR_IATTR(mm, MATMUL, margin), (float)IR_FATTR(mm, MATMUL, static_scale)};
    if (!q && x->op == OP_PARAM && sc == SCALE_PER_TENSOR && mm->phase == PHASE_FORWARD &&
        (q = optimizer_copy(c, x, elem, rc, mm)))
        remember(c, (Quantized){x, elem, sc, group, mm->phase, q});
    /* a backward copy of a kept value takes the forward copy's scale: the value has not
     * changed, so neither has its amax (four bytes kept instead of a second pass). Under
     * delayed scaling that is the forward's scale state, whose history the forward fills. */
    Node *known_scale = NULL;
    if (!q && mm->phase != PHASE_FORWARD && !(rc.static_scale > 0)) {
        Node *fwd = find_made(c, x, elem, sc, group, PHASE_FORWARD, false);
        Node *fs = fwd ? fwd->t.fmt.scale : NULL;
        if (rc.history == 0 && fs && fs->op == OP_QUANT_SCALE && fwd->t.fmt.recipe == RECIPE_CURRENT &&
            IR_IATTR(fs, QUANT_SCALE, margin) == rc.margin) {
            known_scale = fs;
            fs->t.role = ROLE_SAVED;
        }
        if (rc.history > 0 && fs && fs->op == OP_STATE && fwd->t.fmt.recipe == RECIPE_DELAYED &&
            fwd->t.fmt.history == rc.history && fwd->t.fmt.margin == rc.margin &&
            fwd->t.fmt.history_max == !rc.recent)
            known_scale = fs;
    }
    if (!q && !known_scale && x->op == OP_PARAM && sc == SCALE_PER_TENSOR && mm->phase == PHASE_FORWARD)
        known_scale = scale_from_update(c, x, elem, rc, mm);
    if (!q) {
        q = emit_quantize(c, x, elem, sc, group, rc, FMT_F32, mm->phase, mm, known_scale);
        remember(c, (Quantized){x, elem, sc, group, mm->phase, q});
    }
    return q;
}

/* A saved value whose non-GEMM backward readers should read an FP8 copy made in the forward. */
static void save_in_fp8(Ctx *c, Node *x, const Uses *u)
{
    const Format *want = &x->t.saved_as;
    Node *first_bwd = NULL;
    for (int k = 0; k < u->n; k++) {
        Node *r = u->list[k];
        if (r->phase == PHASE_FORWARD || (r->op == OP_MATMUL && IR_IATTR(r, MATMUL, fp8))) continue;
        if (!first_bwd || r->index < first_bwd->index) first_bwd = r;
    }
    if (!first_bwd) return;
    /* quantize right after x is produced, so the bf16 value can die with its last forward use */
    Node *after = c->g->nodes[x->index + 1];
    /* fine groups keep power-of-two scales in one byte (E8M0, as OCP microscaling formats do):
     * a quarter of the bytes of f32 scales, and scaling by them is exact */
    ElemType scale_elem = want->scaling == SCALE_PER_GROUP && want->group <= 32 ? FMT_E8M0 : FMT_F32;
    ScaleRecipe rc = {want->recipe == RECIPE_DELAYED ? want->history : 0, !want->history_max, want->margin,
                  want->recipe == RECIPE_STATIC ? want->static_scale : 0};
    Node *q = emit_quantize(c, x, want->elem, want->scaling, want->group, rc, scale_elem,
                            PHASE_FORWARD, after, NULL);
    q->t.role = ROLE_SAVED;
    for (int k = 0; k < u->n; k++) {
        Node *r = u->list[k];
        if (r->phase == PHASE_FORWARD || (r->op == OP_MATMUL && IR_IATTR(r, MATMUL, fp8))) continue;
        for (int j = 0; j < r->n_in; j++)
            if (r->in[j] == x) r->in[j] = q;
    }
}

bool pass_scaling(Graph *g, const PassOptions *opt)
{
    Ctx c = {g, opt, NULL, 0, 0};
    /* saved copies first, so that GEMM operand reuse sees the final readers */
    Uses *uses = ir_fill_uses(g);
    int n = g->n_nodes;
    Node **snapshot = arena_alloc(g->arena, sizeof(Node *) * (size_t)(n ? n : 1));
    memcpy(snapshot, g->nodes, sizeof(Node *) * (size_t)n);
    for (int i = 0; i < n; i++) {
        Node *x = snapshot[i];
        if (x->t.role == ROLE_SAVED && (x->t.saved_as.elem == FMT_E4M3 || x->t.saved_as.elem == FMT_E5M2))
            save_in_fp8(&c, x, &uses[i]);
    }
    n = g->n_nodes;
    snapshot = arena_alloc(g->arena, sizeof(Node *) * (size_t)n);
    memcpy(snapshot, g->nodes, sizeof(Node *) * (size_t)n);
    mark_read_in_backward(g);
    for (int i = 0; i < n; i++) {
        Node *mm = snapshot[i];
        if (mm->op != OP_MATMUL || !IR_IATTR(mm, MATMUL, fp8)) continue;
        Node *a = gemm_operand(&c, mm, 0);
        Node *b = gemm_operand(&c, mm, 1);
        mm->in[0] = a;
        mm->in[1] = b;
    }
    /* a value is saved only while the backward still reads it; a saved scaled value's scales
     * are kept with it */
    uses = ir_fill_uses(g);
    for (int i = 0; i < g->n_nodes; i++) {
        Node *x = g->nodes[i];
        if (x->t.role != ROLE_SAVED) continue;
        bool read_later = false;
        for (int k = 0; k < uses[i].n; k++) read_later |= uses[i].list[k]->phase != PHASE_FORWARD;
        if (!read_later) x->t.role = ROLE_ACTIVATION;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        Node *x = g->nodes[i];
        Node *s = x->t.fmt.scale;
        if (x->t.role == ROLE_SAVED && s && !ir_role_is_persistent(s->t.role)) s->t.role = ROLE_SAVED;
    }
    return true;
}
