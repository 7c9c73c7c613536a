/* spec_scales.c — scales made by the launches around them, not by launches of their own.
 *
 * At -O1..-O3 most FP8 copies are scaled per tensor by their value's current amax, and the
 * GEMMs that read them divide by those scales: each scale, and each pair of reciprocals a GEMM
 * reads, was a small launch of its own on the step's critical path, and some a pass over the
 * whole value. These rewrites of the phases' plans (after cuda_plan_epilogues has applied the
 * GEMM epilogues, spec_fuse.c) give that work to a launch that runs anyway, each switched by
 * the choice table and each leaving the bits as they were:
 *   attention's scales     the attention's last block stores its result's scale
 *                          (fold_attention_scales);
 *   scales from maxima     the launch that leaves a value's block maxima stores its
 *                          per-tensor scale from its last block (fold_amax_scales);
 *   scales from an amax    a copy makes the scale it quantizes by from the stored amax
 *                          (fold_state_scales);
 *   inverse scales         a GEMM's 1/s by the launch that writes its operand
 *                          (fold_inverse_scales), last, since it may hook a launch that the
 *                          others gave a scale to.
 * Each decides from the graph, the plans and the memory plan's offsets only, so the compiler
 * and the training binary fold the same. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec_internal.h"

static bool fusion_on(const Graph *g, const char *kind, const Node *site) { return ir_choice_on(g, kind, site); }

/* ---------------------------------------------------------------- inverse scales
 * A GEMM of per-tensor FP8 operands reads their dequantization scales 1/s, which a one-block
 * launch right before it writes into its scratch (ck_inv_scales): 144 launches of a GPT-2 d12
 * step at -O1, 462 of Llama 1.1B's. Where an earlier launch writes one of the GEMM's operands
 * (the quantize that makes it, or a launch that absorbed that quantize or its transpose), and
 * neither it nor anything between it and the GEMM writes either operand's scale, so that the
 * scales are final when it starts, that launch's block 0 computes the two reciprocals first
 * (ck_entry, the same division) into a slot of the executor's descale area that only this
 * GEMM reads, and the GEMM's own launch goes. One launch takes up to CK_MAX_INVERSE GEMMs
 * (the quantize of dy feeds the input gradient's GEMM and the weight gradient's; Llama's
 * normed input feeds the q, k and v projections). Not taken:
 * a launch of a GEMM's group (the executor may run such a group unfused), of a node that runs
 * its own launches alone in the evaluation (CuNodePlan.alone), a batched one, or one of
 * another phase than a forward GEMM's (nodes whose work other launches do are passed over:
 * the backward's transposes that forward launches write); the walk back stops at the update
 * phase. The choice
 * fuse.inverse_scales=0 (per GEMM: @ID of its plan's node) keeps the launches. */

/* whether plan p does the work of node x */
static bool plan_writes(const CuNodePlan *p, const Node *x) {
    if (!x || !p->n_launch) return false;
    if (p->node == x) return true;
    for (int k = 0; k < p->n_absorbed; k++)
        if (p->absorbed[k] == x) return true;
    for (int k = 0; k < p->n_members; k++)
        if (p->members[k] == x) return true;
    return false;
}

enum { INVERSE_SLOT = 128, INVERSE_WALK = 4096 };   /* bytes a GEMM's slot; nodes looked back */

/* plan p's launches as its own copy (plans start as copies of node_plans sharing their arrays) */
static CuLaunch *own_launches(CuNodePlan *p, bool *owned, Arena *a) {
    if (!*owned) {
        CuLaunch *l = arena_alloc(a, sizeof *l * (size_t)p->n_launch);
        memcpy(l, p->launch, sizeof *l * (size_t)p->n_launch);
        p->launch = l;
        *owned = true;
    }
    return p->launch;
}

static void fold_inverse_scales(const Graph *g, CuNodePlan *plans, Arena *a) {
    int64_t next_slot = 0;
    bool *owned = arena_alloc(a, sizeof *owned * (size_t)(g->n_nodes ? g->n_nodes : 1));
    for (int i = 0; i < g->n_nodes; i++) {
        CuNodePlan *p = &plans[i];
        const Node *gn = g->nodes[i];
        if (p->n_launch < 2 || strncmp(p->launch[0].fn, "invscale", 8) || p->launch[1].kind != CU_GEMM ||
            p->launch[1].gemm.scales != p->launch[0].scratch || gn->phase == PHASE_UPDATE ||
            !fusion_on(g, "fuse.inverse_scales", p->node))
            continue;
        const CuLaunch *inv = &p->launch[0];
        const Node *scale[2] = {inv->ref[1].node, inv->ref[2].node};
        const Node *operand[2] = {p->launch[1].gemm.a.node, p->launch[1].gemm.b.node};
        for (int j = i - 1; j >= 0 && j >= i - INVERSE_WALK; j--) {
            CuNodePlan *q = &plans[j];
            const Node *qn = g->nodes[j];
            if (!q->n_launch) continue;   /* its work is done elsewhere (or is none) */
            if (qn->phase == PHASE_UPDATE || (gn->phase == PHASE_FORWARD && qn->phase != PHASE_FORWARD)) break;
            /* a plan that writes a scale has it only after its launches, unless block 0 makes
             * it first (fold_state_scales: the copy's one launch, ck_entry) */
            bool made = q->n_launch == 1 && q->launch[0].scale_amax &&
                        (q->launch[0].scale_to == scale[0] || q->launch[0].scale_to == scale[1]);
            if (!made && (plan_writes(q, scale[0]) || plan_writes(q, scale[1]) ||
                          (q->alone && (plan_writes(q->alone, scale[0]) || plan_writes(q->alone, scale[1])))))
                break;
            if (!plan_writes(q, operand[0]) && !plan_writes(q, operand[1])) continue;
            int last = q->n_launch - 1;
            while (last >= 0 && q->launch[last].kind != CU_KERNEL) last--;
            if (last < 0 || q->members || q->alone || q->launch[last].batch ||
                q->launch[last].n_inv == CK_MAX_INVERSE)
                break;
            CuLaunch *hook = &own_launches(q, &owned[j], a)[last];
            int k = hook->n_inv++;
            hook->inv_from[2 * k] = scale[0];
            hook->inv_from[2 * k + 1] = scale[1];
            hook->inv_slot[k] = next_slot;
            CuLaunch *mine = own_launches(p, &owned[i], a);
            mine[1].gemm.descaled = true;
            mine[1].gemm.descales = next_slot;
            next_slot += INVERSE_SLOT;
            p->launch = mine + 1;   /* the invscale launch goes */
            p->n_launch--;
            break;
        }
    }
}

/* ---------------------------------------------------------------- attention scales
 * Attention's result is quantized with current scaling at -O1..-O3 (y for the output
 * projection, the backward's packed dq|dk|dv for the weight and input gradients of q, k and
 * v), and its per-tensor scale is a pass over the whole result (ck_quant_scale_tensor): 24
 * launches and 2.3 GB of reads a GPT-2 d12 step at batch 32. The attention's own launches
 * hold every value they store, so they can take the amax as they go: each block folds its
 * largest |value| into a running maximum, and the last block of the last launch writing the
 * result stores the scale (ck_attn_scale_out, attn_tc.cuh). The scale's launch goes and the
 * attention's plan absorbs its node. The same bits: the maximum of the stored values either
 * way, and the same division.
 *
 * Taken where the scale is a plain f32 scalar made by the pass, right after the attention in
 * the schedule (no launch between them: the scale's bytes, born at its node, may be another
 * value's until then, and only the attention's last block writes them, after every read of
 * the launch), and the attention runs on the tensor-core kernels (attn_tc.cuh, attn_wgmma.cuh,
 * attn_ws.cuh; the CUDA-core ones of other formats keep the pass). The choice
 * fuse.attention_scales=0 (per scale: @ID of the attention) keeps the pass. */

/* whether launch l is one of the tensor-core kernels that store attention's result: a
 * forward of MODE 0 ("ck_attn_wg_fwd<64, 0, ..", "ck_attn_ws_fwd<64, 3, 0, 64, 0, 0, ..": MODE 1, the
 * backward's rerun of it, stores only statistics), a dq or a dk/dv pass (which stores dq too
 * where no dq pass runs: attn.dq_in_dkv) */
static bool attn_tc_result_launch(const CuLaunch *l) {
    /* the forwards, with the number of template arguments before MODE (D; D, WGS, TMA, KEYS
     * and PIPE) */
    static const struct { const char *name; int before; } fwd[] = {
        {"ck_attn_tc_fwd<", 1}, {"ck_attn_wg_fwd<", 1}, {"ck_attn_wg_fwd_pipe<", 1}, {"ck_attn_ws_fwd<", 5}};
    static const char *const bwd[] = {"ck_attn_tc_dq<", "ck_attn_wg_dq<", "ck_attn_tc_dkv<", "ck_attn_wg_dkv<"};
    if (l->kind != CU_KERNEL) return false;
    for (size_t k = 0; k < sizeof bwd / sizeof *bwd; k++)
        if (!strncmp(l->body, bwd[k], strlen(bwd[k]))) return true;
    for (size_t k = 0; k < sizeof fwd / sizeof *fwd; k++) {
        size_t at = strlen(fwd[k].name);
        if (strncmp(l->body, fwd[k].name, at)) continue;
        for (int arg = 0; arg < fwd[k].before; arg++) {
            if (arg) {
                if (strncmp(l->body + at, ", ", 2)) return false;
                at += 2;
            }
            while (l->body[at] >= '0' && l->body[at] <= '9') at++;
        }
        return !strncmp(l->body + at, ", 0,", 4);
    }
    return false;
}

/* whether a scale's node is one plain f32 value, which a kernel can store as a float */
static bool plain_scalar(const Node *qs) {
    return qs->t.fmt.elem == FMT_F32 && qs->t.fmt.scaling == SCALE_NONE && qs->t.fmt.codec == CODEC_PLAIN &&
           ir_numel(&qs->t) == 1;
}

static void fold_attention_scales(const Graph *g, CuNodePlan *plans, Arena *a) {
    for (int i = 1; i < g->n_nodes; i++) {
        const Node *qs = g->nodes[i], *x = qs->op == OP_QUANT_SCALE ? qs->in[0] : NULL;
        CuNodePlan *p = &plans[i];
        if (!x || (x->op != OP_ATTENTION && x->op != OP_ATTENTION_BWD) ||
            IR_IATTR(qs, QUANT_SCALE, scaling) != SCALE_PER_TENSOR || p->n_launch != 1 || p->n_absorbed ||
            p->members || strncmp(p->launch[0].body, "ck_quant_scale_tensor<", 22) || !plain_scalar(qs) ||
            x->index < 0 || x->index >= i || !fusion_on(g, "fuse.attention_scales", x))
            continue;
        CuNodePlan *xp = &plans[x->index];
        if (!xp->n_launch || xp->members || xp->alone || xp->n_absorbed >= (int)(sizeof xp->absorbed / sizeof *xp->absorbed))
            continue;
        bool between = false;   /* a launch between the attention's and the scale's place */
        for (int j = x->index + 1; j < i && !between; j++) between = plans[j].n_launch > 0;
        /* the launches that store the result: the forward's one, the backward's dq and dk/dv */
        int writers[2], n_writers = 0;
        bool other = false;
        for (int k = 0; k < xp->n_launch; k++) {
            if (attn_tc_result_launch(&xp->launch[k])) {
                if (n_writers < 2) writers[n_writers] = k;
                n_writers++;
            } else if (xp->launch[k].kind != CU_KERNEL || strncmp(xp->launch[k].body, "ck_attn_", 8)) {
                other = true;   /* the statistics (attnsaved, attnstat) are the only others */
            }
        }
        /* the forward's one; the backward's dq and dk/dv passes, or the dk/dv pass alone */
        bool dq_pass = false;
        for (int k = 0; k < xp->n_launch; k++) dq_pass = dq_pass || strstr(xp->launch[k].body, "_dq<");
        int want = x->op == OP_ATTENTION || !dq_pass ? 1 : 2;
        if (between || other || n_writers != want) continue;
        bool owned = false;   /* an attention has one result, so one scale: copied once */
        CuLaunch *l = own_launches(xp, &owned, a);
        for (int k = 0; k < n_writers; k++) {
            CuLaunch *w = &l[writers[k]];
            arg_node(w, CK_MAX_TENSORS - 1, qs);
            w->args.f[1] = k == n_writers - 1 ? num_elem_max((ElemType)IR_IATTR(qs, QUANT_SCALE, elem)) : 0.0;
            w->args.f[2] = (double)IR_IATTR(qs, QUANT_SCALE, margin);
        }
        xp->absorbed[xp->n_absorbed++] = qs;
        memset(p, 0, sizeof *p);
        p->node = qs;
    }
}

/* ---------------------------------------------------------------- scales from block maxima
 * At -O1..-O3 most FP8 copies are scaled by their value's current amax, and the value's
 * producer leaves its blocks' maxima (ck_amax_out) for a one-block launch that reduces them
 * and stores the scale (ck_quant_scale_parts): 154 launches of a Llama 1.1B -O1 step, each a
 * gap on the critical path of the step's serialized kernels. Where that launch would run
 * right after the producer's, the producer's launch stores the scale from its last block (a
 * ticket after each block's slot, ck_amax_out), and the scale's node runs nothing: the same
 * maxima reduced by the same function, divided as ck_store_scale divides, so the same bits.
 *
 * Taken, as for attention's scales, where the scale is a plain f32 scalar whose node has no
 * launch between its place and the producer's launch (the scale's bytes, born at its node, may
 * be another value's until then, and only the producer's last block writes them, after every
 * block's reads and stores), and where the launch that writes the maxima is the producer plan's
 * last, or the launches after it in that plan touch none of the scale's bytes. The writing
 * launch must be a one-dimensional kernel grid that no other launch is batched with and that
 * takes the ticket for nothing else; a GEMM group's plan (the executor may run it unfused), a
 * plan run alone in the evaluation (CuNodePlan.alone) and the update phase are passed over.
 * The choice fuse.amax_scales=0 (per scale: @ID of the value) keeps the launch. */

/* whether launch l reads or writes a byte of n (or might: a GEMM, a pointer table) */
static bool launch_touches(const CuLaunch *l, const Node *n) {
    if (l->kind != CU_KERNEL || l->table) return true;
    for (int k = 0; k < CK_MAX_TENSORS; k++) {
        const Node *r = l->ref[k].node;
        if (r && (fuse_nodes_overlap(r, n) || (l->ref_scale[k] && fuse_nodes_overlap(r->t.fmt.scale, n)))) return true;
    }
    for (int k = 0; k < 2 * l->n_inv; k++)
        if (l->inv_from[k] && fuse_nodes_overlap(l->inv_from[k], n)) return true;
    return (l->scale_to && fuse_nodes_overlap(l->scale_to, n)) || (l->scale_amax && fuse_nodes_overlap(l->scale_amax, n));
}

/* the launch of plan p that writes x's block maxima and may store qs's scale too; -1: none */
static int amax_scale_writer(const CuNodePlan *p, const Node *x, const Node *qs) {
    int64_t at = ir_amax_parts_offset(x);
    int w = -1;
    for (int k = 0; k < p->n_launch; k++) {
        const CuLaunch *l = &p->launch[k];
        if (l->kind != CU_KERNEL || l->args.i[CK_AMAX_AT] != at || l->ref[0].node != x || l->ref[0].offset) continue;
        if (w >= 0) return -1;   /* two launches leave maxima: neither has them all */
        w = k;
    }
    if (w < 0) return -1;
    const CuLaunch *l = &p->launch[w];
    if (l->batch || l->grid[1] != 1 || l->scale_to) return -1;
    for (int k = w + 1; k < p->n_launch; k++)
        if (launch_touches(&p->launch[k], qs)) return -1;
    return w;
}

/* launch l of plan taker stores the per-tensor scale qs (scale_to, with its element type's
 * largest value and its margin), and qs's own plan p runs nothing */
static void hand_scale(CuLaunch *l, CuNodePlan *taker, CuNodePlan *p, const Node *qs) {
    l->scale_to = qs;
    l->args.scale_max = num_elem_max((ElemType)IR_IATTR(qs, QUANT_SCALE, elem));
    l->args.scale_margin = IR_IATTR(qs, QUANT_SCALE, margin);
    taker->absorbed[taker->n_absorbed++] = qs;
    memset(p, 0, sizeof *p);
    p->node = qs;
}

static void fold_amax_scales(const Graph *g, CuNodePlan *plans, Arena *a) {
    bool *owned = arena_alloc(a, sizeof *owned * (size_t)(g->n_nodes ? g->n_nodes : 1));
    memset(owned, 0, sizeof *owned * (size_t)(g->n_nodes ? g->n_nodes : 1));
    for (int i = 1; i < g->n_nodes; i++) {
        const Node *qs = g->nodes[i], *x = qs->op == OP_QUANT_SCALE ? qs->in[0] : NULL;
        CuNodePlan *p = &plans[i];
        if (!x || IR_IATTR(qs, QUANT_SCALE, scaling) != SCALE_PER_TENSOR || p->n_launch != 1 || p->n_absorbed ||
            p->members || p->alone || strncmp(p->launch[0].body, "ck_quant_scale_parts<", 21) ||
            !plain_scalar(qs) || qs->t.offset < 0 || !ir_amax_parts_offset(x) || qs->phase == PHASE_UPDATE ||
            !fusion_on(g, "fuse.amax_scales", x))
            continue;
        int j = i - 1;   /* the launches right before the scale's: they must leave x's maxima */
        while (j >= 0 && !plans[j].n_launch) j--;
        if (j < 0) continue;
        CuNodePlan *xp = &plans[j];
        int w = amax_scale_writer(xp, x, qs);
        if (w < 0 || xp->members || xp->alone || g->nodes[j]->phase != qs->phase || !plan_writes(xp, x) ||
            xp->n_absorbed >= (int)(sizeof xp->absorbed / sizeof *xp->absorbed))
            continue;
        hand_scale(&own_launches(xp, &owned[j], a)[w], xp, p, qs);
    }
}

/* ---------------------------------------------------------------- scales from stored maxima
 * -O3 keeps no weight in e4m3: the forward quantizes each weight per use, per tensor, by the
 * scale of the amax the last update found (a persistent f32 scalar), and that scale is a
 * QUANT_SCALE of the one stored value: a launch of one block a weight, 154 of a Llama 1.1B
 * -O3 step, each a gap between the kernels around it. Where the first launch after the
 * scale's place that touches the scale's bytes is the copy quantized by it, the copy makes
 * the scale itself: every block computes it from the amax (ck_state_scale, the division
 * ck_quant_scale_tensor makes: the same bits), block 0 stores it for the launches after (the
 * backward's copies; the GEMMs' inverse scales, which fold_inverse_scales may then give the
 * same block 0, and ck_entry takes from the value it made), and the scale's node runs
 * nothing. The store moves later, not earlier: the scale's bytes are its own from its node on
 * (the memory plan), nothing between reads them, and only the update writes the amax.
 *
 * Taken where the scale is a plain f32 scalar of a plain f32 scalar that lives across steps,
 * made by ck_quant_scale_tensor outside the update; the copy is a QUANTIZE scaled per tensor
 * by that node, in the same phase, its plan one unbatched launch of its own (ck_copy, or
 * ck_quantize_t where it writes the transposed copy too: GPT-2 d12's weights); and no
 * launch between touches the scale (a GEMM: its operands, their scales, C, D, bias and aux).
 * Not where the states are sharded (--shard-states), whose weights and amaxes the executor
 * moves between ranks. The choice fuse.state_scales=0 (per scale: @ID of the amax) keeps the
 * launch. */

static bool node_touches(const Node *r, const Node *n) {
    return r && (fuse_nodes_overlap(r, n) || (r->t.fmt.scale && fuse_nodes_overlap(r->t.fmt.scale, n)));
}

/* whether plan p's launches (or those it runs alone in the evaluation) read or write a byte of n */
static bool plan_touches(const CuNodePlan *p, const Node *n) {
    for (int k = 0; k < p->n_launch; k++) {
        const CuLaunch *l = &p->launch[k];
        if (l->kind == CU_KERNEL && launch_touches(l, n)) return true;
        if (l->kind != CU_GEMM) continue;
        const CuGemm *m = &l->gemm;
        const CuRef *r[] = {&m->a, &m->b, &m->d, &m->c, &m->bias, &m->aux, &m->dscale};
        for (size_t q = 0; q < sizeof r / sizeof *r; q++)
            if (node_touches(r[q]->node, n)) return true;
    }
    return p->alone && plan_touches(p->alone, n);
}

/* the plan of the copy that may make scale qs (at i) itself, or NULL */
static CuNodePlan *state_scale_copy(const Graph *g, CuNodePlan *plans, const Node *qs, int i) {
    for (int j = i + 1; j < g->n_nodes; j++) {
        CuNodePlan *p = &plans[j];
        const Node *q = g->nodes[j];
        if (q->phase == PHASE_UPDATE) return NULL;
        if (!p->n_launch || !plan_touches(p, qs)) continue;
        bool copy = q->phase == qs->phase && q->op == OP_QUANTIZE && q->in[1] == qs && q->t.fmt.scale == qs &&
                    q->t.fmt.scaling == SCALE_PER_TENSOR && p->node == q && p->n_launch == 1 && !p->members &&
                    !p->alone && p->launch[0].kind == CU_KERNEL &&
                    (!strncmp(p->launch[0].body, "ck_copy<", 8) || !strncmp(p->launch[0].body, "ck_quantize_t<", 14)) &&
                    !p->launch[0].batch && !p->launch[0].scale_to && !p->launch[0].n_inv &&
                    p->n_absorbed < (int)(sizeof p->absorbed / sizeof *p->absorbed);
        return copy ? p : NULL;
    }
    return NULL;
}

static void fold_state_scales(const Graph *g, CuNodePlan *plans, Arena *a) {
    if (rt_shard_stage(g)) return;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *qs = g->nodes[i], *amax = qs->op == OP_QUANT_SCALE ? qs->in[0] : NULL;
        CuNodePlan *p = &plans[i];
        if (!amax || IR_IATTR(qs, QUANT_SCALE, scaling) != SCALE_PER_TENSOR || p->n_launch != 1 || p->n_absorbed ||
            p->members || p->alone || strncmp(p->launch[0].body, "ck_quant_scale_tensor<", 22) || !plain_scalar(qs) ||
            !plain_scalar(amax) || !ir_role_is_persistent(amax->t.role) || qs->t.offset < 0 || amax->t.offset < 0 ||
            qs->phase == PHASE_UPDATE || !fusion_on(g, "fuse.state_scales", amax))
            continue;
        CuNodePlan *cp = state_scale_copy(g, plans, qs, i);
        if (!cp) continue;
        bool owned = false;
        CuLaunch *l = own_launches(cp, &owned, a);
        l->scale_amax = amax;
        hand_scale(l, cp, p, qs);
    }
}

/* The bytes of the descale area the plans' GEMMs read (fold_inverse_scales). */
int64_t cuda_plan_descale_bytes(const Graph *g, const CuNodePlan *plans) {
    int64_t bytes = 0;
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < plans[i].n_launch; k++)
            for (int j = 0; j < plans[i].launch[k].n_inv; j++)
                if (plans[i].launch[k].inv_slot[j] + INVERSE_SLOT > bytes) bytes = plans[i].launch[k].inv_slot[j] + INVERSE_SLOT;
    return bytes;
}

void spec_fold_scales(const Graph *g, CuNodePlan *plans, Arena *a) {
    fold_attention_scales(g, plans, a);
    fold_amax_scales(g, plans, a);
    fold_state_scales(g, plans, a);
    fold_inverse_scales(g, plans, a);
}
