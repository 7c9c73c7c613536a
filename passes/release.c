/* release.c — gradient release (--grad-release): no gradient outlives its update.
 *
 * Normally each parameter's gradient is summed into a persistent accumulator (P:grad) during
 * the backward and the AdamW updates run once the whole backward is done: 2 to 4 bytes per
 * parameter that exist only to wait. With release (FlashOptim, and the "optimizer in backward"
 * of LOMO and PyTorch's hooks) the update of P runs in the backward as soon as P.grad is
 * complete, and P.grad's buffer is free right after: the accumulators disappear from the plan,
 * and the scheduler, which favours nodes that free memory, puts each update next to the GEMM
 * that finished its gradient.
 *
 * Global-norm clipping cannot see this step's whole gradient before the first update, so it
 * uses the previous step's norm instead (a persistent scalar "optim:grad_norm_prev", written at
 * the end of each step; the first step is not clipped). The plan and the log still report this
 * step's norm. Gradient accumulation over micro-steps needs accumulators, so a binary built
 * with release refuses --grad-accum above 1. */
#include "passes.h"

#include <string.h>

bool pass_release(Graph *g, const PassOptions *opt)
{
    if (!opt->grad_release) return true;
    Node *clip = NULL, *norm = NULL;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->op == OP_CLIP_COEF) clip = n;
        if (n->op == OP_GRAD_NORM) norm = n;
    }
    if (!clip || !norm) {
        diag_error((SrcLoc){0}, "--grad-release needs the optimizer's update in the graph");
        return false;
    }
    /* every reader of an accumulator now reads the micro-step's gradient itself */
    for (int i = 0; i < g->n_nodes; i++) {
        Node *acc = g->nodes[i];
        if (acc->op != OP_ACCUMULATE) continue;
        ir_replace_uses(g, acc, acc->in[1]);
    }
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->op == OP_ADAMW || n->op == OP_SQNORM || n->op == OP_GRAD_NORM) n->phase = PHASE_BACKWARD;
    }
    /* clip by the previous step's norm, and remember this step's for the next */
    Node *prev = ir_leaf(g, OP_STATE, "optim:grad_norm_prev", ROLE_OPTIM_STATE, FMT_F32, 0, NULL, clip->loc);
    ir_move_before(g, prev, clip);
    clip->in[0] = prev;
    clip->phase = PHASE_BACKWARD;
    Node *remember = ir_add2(g, OP_ASSIGN, prev, norm, norm->loc);
    remember->phase = PHASE_UPDATE;
    remember->t.role = ROLE_OPTIM_STATE;   /* it is the state, updated */
    remember->t.name = prev->t.name;
    const char *err = ir_infer_shape(remember, g->arena);
    if (err) ir_die(__FILE__, __LINE__, "release: %s", err);
    /* the accumulators and their updates go */
    bool *keep = arena_alloc(g->arena, (size_t)g->n_nodes);
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        keep[i] = !(n->op == OP_ACCUMULATE || (n->op == OP_STATE && n->t.role == ROLE_GRAD));
    }
    ir_filter(g, keep);
    return true;
}
