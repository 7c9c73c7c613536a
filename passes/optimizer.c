/* optimizer.c — the update step: gradient accumulation, global-norm clipping, AdamW.
 *
 * After autodiff every trained parameter P has a gradient "P.grad" for one micro-batch. This
 * pass makes the rest of the training step explicit in the graph, so that the precision,
 * memory and kernel passes see the optimizer's state and work like any other tensors:
 *
 *   P:grad    += P.grad                          ACCUMULATE, backward (once per micro-step)
 *   sq_P       = sqnorm(P:grad)                  update (once per step)
 *   grad_norm  = sqrt(sum sq_P) * grad_scale     the global norm of the mean gradient
 *   clip       = min(1, max_norm / grad_norm)
 *   adamw(P, P:grad, P:adam_m, P:adam_v, lr, step, clip, grad_scale)
 *
 * The accumulators hold the sum over micro-steps; grad_scale (1/micro-steps, fed by the
 * runtime) turns it into the mean inside the norm and the update, so the backward never has
 * to know how many micro-steps there are. The update reads the accumulator through the
 * ACCUMULATE node, not the state leaf, so that "after the last accumulation" is an edge of the
 * graph rather than a convention of the scheduler; ADAMW zeroes it for the next step.
 * Weight decay applies to the parameters whose `decay` attribute is set (the front end sets it
 * for matrices, not for biases and norm weights). */
#include "passes.h"

static Node *scalar_input(Graph *g, const char *name)
{
    Node *n = ir_find(g, name);
    if (n) {
        IR_ASSERT(n->op == OP_INPUT && n->t.rank == 0);
        return n;
    }
    n = ir_leaf(g, OP_INPUT, name, ROLE_INPUT, FMT_F32, 0, NULL, (SrcLoc){0});
    n->phase = PHASE_UPDATE;
    return n;
}

static Node *state_of(Graph *g, Node *p, const char *suffix, Role role, Phase phase)
{
    const char *name = arena_printf(g->arena, "%s:%s", p->t.name, suffix);
    Node *n = ir_leaf(g, OP_STATE, name, role, FMT_F32, p->t.rank, p->t.dims, p->loc);
    n->grad_of = p;
    n->phase = phase;
    return n;
}

static Node *update_node(Graph *g, OpKind op, int n_in, Node *const *in, SrcLoc loc, Role role)
{
    Node *n = ir_add(g, op, n_in, in, loc);
    n->phase = PHASE_UPDATE;
    n->t.role = role;
    return n;
}

static void finish(Graph *g, Node *n)
{
    const char *err = ir_infer_shape(n, g->arena);
    if (err) ir_die(__FILE__, __LINE__, "optimizer: %s", err);
}

bool pass_optimizer(Graph *g, const PassOptions *opt)
{
    (void)opt;
    Node *loss = ir_find(g, "loss");
    SrcLoc at = loss ? loss->loc : (SrcLoc){0};
    if (!g->optim.present) {
        diag_error(at, "the model has no optimizer clause");
        return false;
    }

    /* the parameters with a gradient, in graph order */
    int n_nodes = g->n_nodes, n_params = 0;
    Node **params = arena_alloc(g->arena, sizeof(Node *) * (size_t)(n_nodes + 1));
    Node **grads = arena_alloc(g->arena, sizeof(Node *) * (size_t)(n_nodes + 1));
    for (int i = 0; i < n_nodes; i++) {
        Node *d = g->nodes[i];
        if (d->phase != PHASE_BACKWARD || !d->grad_of || d->grad_of->op != OP_PARAM) continue;
        if (d->t.role != ROLE_GRAD_TEMP) continue;
        params[n_params] = d->grad_of;
        grads[n_params++] = d;
    }
    if (n_params == 0) {
        diag_error(at, "no parameter has a gradient: run autodiff before the optimizer");
        return false;
    }
    for (int i = 0; i < n_nodes; i++)
        if (g->nodes[i]->phase == PHASE_UPDATE) {
            diag_error(g->nodes[i]->loc, "the graph already has an update step");
            return false;
        }

    /* accumulate each micro-step's gradient into the persistent accumulator */
    Node **acc = arena_alloc(g->arena, sizeof(Node *) * (size_t)n_params);
    for (int i = 0; i < n_params; i++) {
        Node *p = params[i];
        Node *state = state_of(g, p, "grad", ROLE_GRAD, PHASE_BACKWARD);
        Node *a = ir_add2(g, OP_ACCUMULATE, state, grads[i], p->loc);
        a->phase = PHASE_BACKWARD;
        a->t.role = ROLE_GRAD;   /* it is the accumulator itself (same storage) */
        a->grad_of = p;
        finish(g, a);
        acc[i] = a;
    }

    Node *lr = scalar_input(g, "lr");
    Node *step = scalar_input(g, "step");
    Node *grad_scale = scalar_input(g, "grad_scale");

    /* global gradient norm and the clipping coefficient */
    Node **norm_in = arena_alloc(g->arena, sizeof(Node *) * (size_t)(n_params + 1));
    norm_in[0] = grad_scale;
    for (int i = 0; i < n_params; i++) {
        Node *sq = update_node(g, OP_SQNORM, 1, &acc[i], params[i]->loc, ROLE_GRAD_TEMP);
        finish(g, sq);
        norm_in[i + 1] = sq;
    }
    Node *norm = update_node(g, OP_GRAD_NORM, n_params + 1, norm_in, at, ROLE_OUTPUT);
    norm->t.name = "grad_norm";
    finish(g, norm);
    Node *clip = update_node(g, OP_CLIP_COEF, 1, &norm, at, ROLE_GRAD_TEMP);
    IR_FATTR(clip, CLIP_COEF, max_norm) = g->optim.clip;
    finish(g, clip);

    /* AdamW, one in-place update per parameter */
    for (int i = 0; i < n_params; i++) {
        Node *p = params[i];
        Node *m = state_of(g, p, "adam_m", ROLE_ADAM_M, PHASE_UPDATE);
        Node *v = state_of(g, p, "adam_v", ROLE_ADAM_V, PHASE_UPDATE);
        Node *in[8] = {p, acc[i], m, v, lr, step, clip, grad_scale};
        Node *u = update_node(g, OP_ADAMW, 8, in, p->loc, ROLE_GRAD_TEMP);
        IR_FATTR(u, ADAMW, beta1) = g->optim.beta1;
        IR_FATTR(u, ADAMW, beta2) = g->optim.beta2;
        IR_FATTR(u, ADAMW, eps) = g->optim.eps;
        IR_FATTR(u, ADAMW, weight_decay) = IR_IATTR(p, PARAM, decay) ? g->optim.weight_decay : 0.0;
        finish(g, u);
    }
    return true;
}
