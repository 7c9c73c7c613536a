/* comm.c — data parallel: the gradients are summed over the GPUs before the update reads them.
 *
 * With N GPUs each one runs the same step on its own share of the global batch and keeps a
 * whole copy of the parameters and optimizer state. The copies stay equal only if every GPU
 * applies the same update, so the summed gradient of each parameter (its accumulator, P:grad,
 * after the last micro-step) is replaced by its sum over the GPUs before the gradient norm
 * and AdamW read it:
 *
 *   P:grad += P.grad               ACCUMULATE, backward, every micro-step (as before)
 *   P:grad  = sum_ranks(P:grad)    ALL_REDUCE, once a step, in place
 *   sq_P = sqnorm(P:grad) ... adamw(P, P:grad, ..., grad_scale)   read the reduced value
 *
 * A sum, so that the accumulator holds what one GPU's holds after N times the micro-steps,
 * and the runtime feeds grad_scale = 1 / (micro-steps x N), what that one GPU feeds: the
 * norm and the update then compute the same thing from the same kind of value.
 *
 * The collective is a node of the step rather than something the runtime does on the side,
 * so the plan, the kernel listing and the verifier see it like any other work: its bytes are
 * the accumulator's, in the accumulator's format (bf16 at O1..O3, f32 at O0), and it aliases
 * the accumulator, so the memory plan does not change. The nodes are placed in the order in
 * which the backward finishes the gradients ("buckets" in that order), and the executor keeps
 * that order when it hands them to NCCL. On one rank, on the CPU and in the reference
 * executor the node does nothing, so a run on one GPU of a data-parallel build computes the
 * same bits as a build without the pass.
 *
 * Gradient release cannot be combined with it: released updates run inside the backward, as
 * soon as each micro-step's gradient exists, before any other GPU's share could be added, so
 * the pass refuses a build that asks for both. A gradient stored in a scaled FP8 format would
 * need a scale of its own agreed between the GPUs; that is not built, and the pass says so
 * rather than reduce the raw bytes.
 *
 * What travels is a precision rule like any other: by default the sum is NCCL's, in the
 * accumulator's own format; `comm:grad=e5m2` (or e4m3) sends each bucket of gradients in FP8
 * with one scale per bucket that every GPU agrees on (runtime/comm_fp8.c has the arithmetic,
 * cuda/exec_comm.c runs it), recorded here as the node's wire attribute so that the plan, the
 * kernel listing and the executor see it. The accumulators keep their format: only the bytes
 * between the GPUs change. A comm: rule in a build without --gpus N > 1 is refused: there is
 * nothing for it to do, and a rule either does what it says or is an error.
 *
 * --shard-states (ZeRO stage 1, runtime/comm_shard.c) marks every node shard=1: each rank
 * then receives only its shard of the sum (a reduce-scatter), the update reads and writes only
 * that shard of the gradient, the master and the states, and the new weights are gathered.
 * --shard-states=2 (stage 2) marks them shard=2: the accumulators are sharded as well, each
 * rank keeping only its shard's sum, and the backward writes each bucket of gradients into a
 * transient buffer that is reduced into the owners' shards every micro-step. The graph itself
 * stays whole-tensor: on one rank a shard is the whole tensor, so the CPU, the reference and a
 * one-GPU run compute exactly what a build without the flag computes, and only the executor of
 * several ranks and the plan read the mark. With the FP8 reduction it is refused: that
 * all-reduce gathers every rank's sums by design, and a sharded variant (the scattered half
 * alone) is not built. Stage 2 is refused with comm.overlap=0 as well: its buffers are reused
 * only because each bucket leaves while the backward runs; after the backward every gradient
 * would be whole in them at once, the memory stage 2 exists to save. --shard-states=3 (stage 3,
 * runtime/comm_weights.c) marks them shard=3 and keeps stage 2's gradients and refusals: each
 * rank keeps only its shard of the GEMMs' weights as well, gathered per layer while the step
 * runs. The graph does not change for it either; the plan reads the mark. */
#include "passes.h"

/* the format a gradient may be reduced in: NCCL's bf16 or f32, unscaled */
static bool comm_format_ok(const Format *f)
{
    return (f->elem == FMT_BF16 || f->elem == FMT_F32) && f->scaling == SCALE_NONE &&
           f->codec == CODEC_PLAIN && !f->scale;
}

bool pass_comm(Graph *g, const PassOptions *opt)
{
    ElemType wire = FMT_VOID;
    const char *rule = NULL;
    SrcLoc rule_at = {0};
    if (!precision_comm_rule(g->arena, opt, &wire, &rule, &rule_at)) return false;
    if (opt->shard_states && opt->gpus <= 1) {
        diag_error((SrcLoc){0}, "--shard-states splits the optimizer state over the GPUs of a "
                   "data-parallel build: add --gpus N (N >= 2)");
        return false;
    }
    if (opt->shard_states && wire != FMT_VOID) {
        diag_error(rule_at, "'%s' sends every gradient whole to every GPU, and --shard-states "
                   "needs each GPU's shard only: build with one of them", rule);
        return false;
    }
    if (opt->shard_states >= 2 && opt->grad_release) {
        diag_error((SrcLoc){0}, "--shard-states=%d keeps each gradient only as its shard's sum over "
                   "the GPUs, and --grad-release updates each parameter inside the backward from its "
                   "own GPU's whole gradient: build with one of them", opt->shard_states);
        return false;
    }
    if (opt->shard_states >= 2 && !ir_choice_on(g, "comm.overlap", NULL)) {
        diag_error((SrcLoc){0}, "--shard-states=%d reuses its gradient buffers because each bucket is "
                   "reduced while the backward runs, and comm.overlap=0 reduces them after it, with "
                   "every gradient whole at once: build without --choice comm.overlap=0", opt->shard_states);
        return false;
    }
    if (opt->gpus <= 1) {
        if (wire == FMT_VOID) return true;
        diag_error(rule_at, "'%s' chooses how gradients are sent between GPUs, and this build "
                   "runs on one: build with --gpus N (N >= 2), or without the rule", rule);
        return false;
    }
    if (opt->grad_release) {
        diag_error((SrcLoc){0}, "--grad-release updates each parameter inside the backward, before "
                   "its gradient can be averaged over %d GPUs: build without --grad-release, or "
                   "without --gpus", opt->gpus);
        return false;
    }
    /* the accumulators in the order the backward completes them, and the first update node */
    int n = g->n_nodes, n_acc = 0;
    Node **acc = arena_alloc(g->arena, sizeof(Node *) * (size_t)(n + 1));
    Node *first_update = NULL;
    for (int i = 0; i < n; i++) {
        Node *a = g->nodes[i];
        if (a->phase == PHASE_UPDATE && !first_update) first_update = a;
        if (a->op == OP_ALL_REDUCE) {
            diag_error(a->loc, "the graph already averages its gradients over the GPUs");
            return false;
        }
        if (a->op != OP_ACCUMULATE || a->t.role != ROLE_GRAD) continue;
        if (!comm_format_ok(&a->t.fmt)) {
            diag_error(a->loc, "the gradient of %s is stored as %s: averaging it over GPUs is "
                       "built for bf16 and f32 gradients only (give it bf16 with --precision)",
                       a->grad_of && a->grad_of->t.name ? a->grad_of->t.name : "a parameter",
                       fmt_elem_name(a->t.fmt.elem));
            return false;
        }
        acc[n_acc++] = a;
    }
    if (!n_acc || !first_update) {
        diag_error((SrcLoc){0}, "--gpus %d: the step has no gradient accumulators and update to "
                   "average gradients for (run the optimizer pass first)", opt->gpus);
        return false;
    }
    for (int i = 0; i < n_acc; i++) {
        Node *a = acc[i];
        Node *r = ir_add1(g, OP_ALL_REDUCE, a, a->loc);
        IR_IATTR(r, ALL_REDUCE, ranks) = opt->gpus;
        IR_IATTR(r, ALL_REDUCE, wire) = wire;
        IR_IATTR(r, ALL_REDUCE, shard) = opt->shard_states;
        r->phase = PHASE_UPDATE;
        r->t.role = ROLE_GRAD;        /* it is the accumulator itself (same storage) */
        r->grad_of = a->grad_of;
        const char *err = ir_infer_shape(r, g->arena);
        if (err) ir_die(__FILE__, __LINE__, "comm: %s", err);
        ir_replace_uses(g, a, r);     /* every reader after the step's last accumulation */
        r->in[0] = a;
        ir_move_before(g, r, first_update);
    }
    return true;
}
