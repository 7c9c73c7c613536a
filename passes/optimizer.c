/* optimizer.c — the update step: gradient accumulation, global-norm clipping, the optimizer.
 *
 * After autodiff every trained parameter P has a gradient "P.grad" for one micro-batch. This
 * pass makes the rest of the training step explicit in the graph, so that the precision,
 * memory and kernel passes see the optimizer's state and work like any other tensors:
 *
 *   P:grad    += P.grad                          ACCUMULATE, backward (once per micro-step)
 *   sq_P       = sqnorm(P:grad)                  update (once per step)
 *   grad_norm  = sqrt(sum sq_P) * grad_scale     the global norm of the mean gradient
 *   clip       = min(1, max_norm / grad_norm)
 *   adamw(P, P:grad, P:adam_m, P:adam_v, lr, step, clip, grad_scale)     or
 *   lion(P, P:grad, P:momentum, lr, step, clip, grad_scale)              or
 *   sgd(P, P:grad, P:momentum, lr, step, clip, grad_scale)
 *
 * The accumulators hold the sum over micro-steps; grad_scale (1/micro-steps, fed by the
 * runtime) turns it into the mean inside the norm and the update, so the backward never has
 * to know how many micro-steps there are. The update reads the accumulator through the
 * ACCUMULATE node, not the state leaf, so that "after the last accumulation" is an edge of the
 * graph rather than a convention of the scheduler; the update zeroes it for the next step.
 * Weight decay applies to the parameters whose `decay` attribute is set (the front end sets it
 * for matrices, not for biases and norm weights): AdamW's and Lion's is decoupled (w -= lr wd
 * w), SGD's is PyTorch's L2 term added to the gradient before the momentum.
 *
 * Lion and SGD keep one state, "P:momentum", with the role of Adam's m (ROLE_ADAM_M): the
 * precision pass gives it m's format at every level, so the compressed formats of -O2/-O3
 * hold for them as they are. `--optimizer` (opt->optimizer) replaces the model's clause by
 * another optimizer: the settings every optimizer has (lr, weight_decay, clip) carry over,
 * the others take the chosen optimizer's defaults (Lion: betas 0.9, 0.99; SGD: momentum 0.9),
 * since AdamW's beta2 = 0.95 is not a good Lion beta2. The choice is the graph's optim.kind,
 * so the textual IR, the artifact, the plan and the checkpoints all record it. */
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

/* --optimizer NAME [--nesterov] over the model's clause (the essay above says what carries) */
static bool choose_optimizer(Graph *g, const PassOptions *opt, SrcLoc at)
{
    OptimSpec *o = &g->optim;
    if (opt && opt->optimizer) {
        OptimKind kind;
        if (!ir_optim_from_name(opt->optimizer, &kind)) {
            diag_error((SrcLoc){0}, "--optimizer %s: the optimizers are adamw, lion and sgd", opt->optimizer);
            return false;
        }
        if (kind != o->kind) {
            OptimSpec c = {.present = true, .kind = kind, .lr = o->lr, .weight_decay = o->weight_decay,
                           .clip = o->clip};
            if (kind == OPTIM_ADAMW) c.beta1 = 0.9, c.beta2 = 0.999, c.eps = 1e-8;
            if (kind == OPTIM_LION) c.beta1 = 0.9, c.beta2 = 0.99;
            if (kind == OPTIM_SGD) c.momentum = 0.9;
            *o = c;
        }
    }
    if (opt && opt->nesterov) {
        if (o->kind != OPTIM_SGD) {
            diag_error((SrcLoc){0}, "--nesterov is for --optimizer sgd, and this build trains with %s",
                       ir_optim_name(o->kind));
            return false;
        }
        o->nesterov = true;
    }
    if (o->kind == OPTIM_SGD && o->nesterov && !(o->momentum > 0)) {
        diag_error(at, "sgd with nesterov needs a momentum above 0 (it is %g)", o->momentum);
        return false;
    }
    return true;
}

/* One parameter's update node, with the optimizer's settings as its attributes. */
static Node *update_of(Graph *g, Node *p, Node *acc, Node *lr, Node *step, Node *clip, Node *grad_scale)
{
    const OptimSpec *o = &g->optim;
    double wd = IR_IATTR(p, PARAM, decay) ? o->weight_decay : 0.0;
    if (o->kind == OPTIM_ADAMW) {
        Node *m = state_of(g, p, "adam_m", ROLE_ADAM_M, PHASE_UPDATE);
        Node *v = state_of(g, p, "adam_v", ROLE_ADAM_V, PHASE_UPDATE);
        Node *in[8] = {p, acc, m, v, lr, step, clip, grad_scale};
        Node *u = update_node(g, OP_ADAMW, 8, in, p->loc, ROLE_GRAD_TEMP);
        IR_FATTR(u, ADAMW, beta1) = o->beta1;
        IR_FATTR(u, ADAMW, beta2) = o->beta2;
        IR_FATTR(u, ADAMW, eps) = o->eps;
        IR_FATTR(u, ADAMW, weight_decay) = wd;
        return u;
    }
    Node *m = state_of(g, p, "momentum", ROLE_ADAM_M, PHASE_UPDATE);
    Node *in[7] = {p, acc, m, lr, step, clip, grad_scale};
    Node *u = update_node(g, o->kind == OPTIM_LION ? OP_LION : OP_SGD, 7, in, p->loc, ROLE_GRAD_TEMP);
    if (o->kind == OPTIM_LION) {
        IR_FATTR(u, LION, beta1) = o->beta1;
        IR_FATTR(u, LION, beta2) = o->beta2;
        IR_FATTR(u, LION, weight_decay) = wd;
    } else {
        IR_FATTR(u, SGD, momentum) = o->momentum;
        IR_FATTR(u, SGD, weight_decay) = wd;
        IR_IATTR(u, SGD, nesterov) = o->nesterov;
    }
    return u;
}

bool pass_optimizer(Graph *g, const PassOptions *opt)
{
    Node *loss = ir_find(g, "loss");
    SrcLoc at = loss ? loss->loc : (SrcLoc){0};
    if (!g->optim.present) {
        diag_error(at, "the model has no optimizer clause");
        return false;
    }
    if (!choose_optimizer(g, opt, at)) return false;

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

    /* the optimizer, one in-place update per parameter */
    for (int i = 0; i < n_params; i++)
        finish(g, update_of(g, params[i], acc[i], lr, step, clip, grad_scale));
    return true;
}
