/* lower.c — the model language's interpreter: from the syntax tree to the forward graph.
 *
 * The model language has no run time of its own: a model file is a program that the
 * compiler runs once, at compile time, to build a graph. Config constants, --batch/--seq and
 * loop variables are ordinary numbers; tensors are IR nodes; calling a block runs its body
 * with its parameters named under the call's `as` path; a `for` loop simply runs its body
 * again. When the program ends, the graph holds every parameter (by its Hugging Face name),
 * every input and the forward computation of the loss. Evaluating instead of type-checking
 * keeps the language small and makes every shape static, which the memory planner needs.
 *
 * This file runs statements (lower_exec_stmts) and evaluates expressions (eval), building
 * nodes with lower_values.c and calling the builtin library (builtins.c) with arguments it has
 * bound and checked. The program as a whole (the scan before, the end after) is
 * lower_program.c's; lower.h lists who calls whom.
 *
 * Names live in frames, one per block call and one for the top level; parameters in a hash
 * table by full name, and the computed tensors that took a name in another, so that a
 * parameter declared later under that name takes it back without a scan of the graph. */
#include "lower.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- names */

static const char *const bind_words[] = {"variable", "config constant", "input", "parameter",
                                         "loop variable"};

/* ---------------------------------------------------------------- tables */

static uint64_t hash_name(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static Node *param_get(const ParamMap *m, const char *name)
{
    if (!m->cap) return NULL;
    for (uint64_t i = hash_name(name) & (uint64_t)(m->cap - 1);; i = (i + 1) & (uint64_t)(m->cap - 1)) {
        if (!m->keys[i]) return NULL;
        if (!strcmp(m->keys[i], name)) return m->nodes[i];
    }
}

static void param_put(Arena *a, ParamMap *m, const char *name, Node *n)
{
    if (2 * (m->n + 1) > m->cap) {
        ParamMap bigger = {.cap = m->cap ? 2 * m->cap : 64};
        bigger.keys = arena_alloc(a, sizeof(char *) * (size_t)bigger.cap);
        bigger.nodes = arena_alloc(a, sizeof(Node *) * (size_t)bigger.cap);
        for (int i = 0; i < m->cap; i++)
            if (m->keys[i]) param_put(a, &bigger, m->keys[i], m->nodes[i]);
        *m = bigger;
    }
    uint64_t i = hash_name(name) & (uint64_t)(m->cap - 1);
    while (m->keys[i]) i = (i + 1) & (uint64_t)(m->cap - 1);
    m->keys[i] = name;
    m->nodes[i] = n;
    m->n++;
}

/* The list of computed tensors named `name` (NULL: none), or with `add`, its slot, made if new. */
static NamedNode **names_slot(Arena *a, NameMap *m, const char *name, bool add)
{
    if (add && 2 * (m->n + 1) > m->cap) {
        NameMap bigger = {.cap = m->cap ? 2 * m->cap : 64};
        bigger.keys = arena_alloc(a, sizeof(char *) * (size_t)bigger.cap);
        bigger.lists = arena_alloc(a, sizeof(NamedNode *) * (size_t)bigger.cap);
        for (int i = 0; i < m->cap; i++)
            if (m->keys[i]) *names_slot(a, &bigger, m->keys[i], true) = m->lists[i];
        *m = bigger;
    }
    if (!m->cap) return NULL;
    uint64_t i = hash_name(name) & (uint64_t)(m->cap - 1);
    for (; m->keys[i]; i = (i + 1) & (uint64_t)(m->cap - 1))
        if (!strcmp(m->keys[i], name)) return &m->lists[i];
    if (!add) return NULL;
    m->keys[i] = name;
    m->lists[i] = NULL;
    m->n++;
    return &m->lists[i];
}

static Binding *frame_find(const Frame *f, const char *name)
{
    for (Binding *b = f->names; b; b = b->next)
        if (!strcmp(b->name, name)) return b;
    return NULL;
}

static Binding *frame_bind(Lower *L, Frame *f, const char *name, BindKind kind, Value v, SrcLoc loc)
{
    Binding *b = arena_alloc(L->a, sizeof *b);
    b->name = name;
    b->kind = kind;
    b->val = v;
    b->loc = loc;
    b->next = f->names;
    f->names = b;
    return b;
}

const AstStmt *lower_find_block(const Lower *L, const char *name)
{
    for (int i = 0; i < L->n_blocks; i++)
        if (!strcmp(L->blocks[i]->name, name)) return L->blocks[i];
    return NULL;
}



/* Names a computed tensor after the variable or the scope that first holds it: "h.3.attn.y"
 * for `y = ...` in a block called as h[3].attn, "h.3" for the result of `layer(x) as h[3]`.
 * Precision policies select activations by these names (saved:h.*.mlp.*=e4m3). Leaves keep
 * their own names, and names that training gives to other tensors are not taken. */
static void name_value(Lower *L, Value v, const char *scope, const char *var)
{
    static const char *const taken[] = {"lr", "step", "grad_scale", "grad_norm", "loss"};
    if (v.kind != VAL_TENSOR || v.node->t.name || v.node->n_in == 0) return;
    const char *name = !*scope ? var : var ? arena_printf(L->a, "%s.%s", scope, var) : scope;
    size_t len = strlen(name);
    if (param_get(&L->params, name) || (len > 5 && !strcmp(name + len - 5, ".grad"))) return;
    for (size_t i = 0; i < sizeof taken / sizeof taken[0]; i++)
        if (!strcmp(name, taken[i])) return;
    v.node->t.name = name;
    NamedNode **list = names_slot(L->a, &L->computed, name, true);
    NamedNode *e = arena_alloc(L->a, sizeof *e);
    *e = (NamedNode){.node = v.node, .next = *list};
    *list = e;
}

/* ---------------------------------------------------------------- expressions */

static Value eval(Lower *L, Frame *f, const AstExpr *e);

static Value eval_name(Lower *L, Frame *f, const AstExpr *e)
{
    const char *name = e->name;
    Binding *b = frame_find(f, name);
    if (b) return b->val;
    if (f != &L->top) {
        Binding *t = frame_find(&L->top, name);
        if (t && (t->kind == BIND_CONFIG || t->kind == BIND_INPUT || t->kind == BIND_PARAM))
            return t->val;
        if (t) {
            lower_error(L, e->loc, "'%s' is a %s of the top level; a block sees its arguments, "
                        "its own names, configs, inputs and parameters by full name", name,
                        bind_words[t->kind]);
            return val_error();
        }
    }
    Node *p = param_get(&L->params, name);
    if (p) return val_tensor(p);
    if (!strcmp(name, "B") || !strcmp(name, "T")) {
        bool batch = name[0] == 'B';
        int64_t v = batch ? L->o->batch : L->o->seq;
        if (v > 0) return val_int(v);
        bool *told = batch ? &L->told_batch : &L->told_seq;
        if (!*told)
            lower_error(L, e->loc, "'%s' is the %s, which this build does not set: give %s N",
                        name, batch ? "batch size" : "sequence length", batch ? "--batch" : "--seq");
        *told = true;
        return val_error();
    }
    if (lower_find_block(L, name)) {
        lower_error(L, e->loc, "'%s' is a block; call it: %s(...)", name, name);
        return val_error();
    }
    Suggest s = {.want = name, .best_d = 99};
    for (const Frame *fr = f; fr; fr = fr == &L->top ? NULL : &L->top)
        for (Binding *x = fr->names; x; x = x->next) lower_suggest_try(&s, x->name);
    for (int i = 0; i < L->params.cap; i++) lower_suggest_try(&s, L->params.keys[i]);
    lower_error(L, e->loc, "unknown name '%s'%s", name, lower_suggest_text(L, &s));
    return val_error();
}

static Value eval_binary(Lower *L, Frame *f, const AstExpr *e)
{
    Value a = eval(L, f, e->lhs), b = eval(L, f, e->rhs);
    if (a.kind == VAL_ERROR || b.kind == VAL_ERROR) return val_error();
    if (!lower_not_a_tuple(L, e->lhs->loc, a) || !lower_not_a_tuple(L, e->rhs->loc, b)) return val_error();
    if (val_is_num(a) && val_is_num(b)) return lower_arith_numbers(L, e->loc, e->binop, a, b);
    return lower_arith_tensors(L, e->loc, e->binop, a, b);
}

static Value eval_neg(Lower *L, Frame *f, const AstExpr *e)
{
    Value a = eval(L, f, e->lhs);
    switch (a.kind) {
    case VAL_INT:
        if (a.i == INT64_MIN) break;
        return val_int(-a.i);
    case VAL_FLOAT: return val_float(-a.f);
    case VAL_TENSOR: return lower_node_scale(L, e->loc, a.node, -1.0);
    case VAL_TUPLE: lower_not_a_tuple(L, e->lhs->loc, a); return val_error();
    default: return a;
    }
    lower_error(L, e->loc, "integer overflow");
    return val_error();
}

/* ---------------------------------------------------------------- builtin calls */

static Value call_builtin(Lower *L, Frame *f, const Builtin *b, const AstExpr *call)
{
    Args a;
    bool given[MAX_BUILTIN_PARAMS] = {0}, ok = true, keywords = false;
    memset(&a, 0, sizeof a);
    int pos = 0;
    for (int i = 0; i < call->args.n; i++) {
        const AstArg *arg = call->args.items[i];
        int slot = -1;
        if (!arg->name) {
            if (keywords) {
                lower_error(L, arg->loc, "a positional argument cannot follow keyword arguments");
                return val_error();
            }
            if (pos < b->n_params) {
                slot = pos++;
            } else if (!b->variadic) {
                lower_error(L, arg->loc, "too many arguments: %s takes %d", b->usage, b->n_params);
                return val_error();
            } else if (a.n_extra == MAX_EXTRA_ARGS) {
                lower_error(L, arg->loc, "too many arguments to %s", b->name);
                return val_error();
            }
        } else {
            keywords = true;
            for (int j = 0; j < b->n_params; j++)
                if (!strcmp(b->p[j].name, arg->name)) slot = j;
            if (slot < 0) {
                Suggest s = {.want = arg->name, .best_d = 99};
                for (int j = 0; j < b->n_params; j++) lower_suggest_try(&s, b->p[j].name);
                lower_error(L, arg->loc, "unknown keyword argument '%s' of %s%s", arg->name,
                            b->usage, lower_suggest_text(L, &s));
                ok = false;
                continue;
            }
            if (given[slot]) {
                lower_error(L, arg->loc, "argument '%s' of %s is given twice", arg->name, b->name);
                ok = false;
                continue;
            }
        }
        Value v = eval(L, f, arg->value);
        if (slot < 0) {     /* one of split's sizes */
            a.extra_loc[a.n_extra] = arg->value->loc;
            a.extra[a.n_extra] = v;
            ok &= builtin_arg_fits(L, b, "size", ARG_INT, &a.extra[a.n_extra], arg->value->loc);
            a.n_extra++;
            continue;
        }
        given[slot] = true;
        a.loc[slot] = arg->value->loc;
        a.v[slot] = v;
        ok &= builtin_arg_fits(L, b, b->p[slot].name, b->p[slot].kind, &a.v[slot], arg->value->loc);
    }
    for (int j = 0; j < b->n_params; j++) {
        const BuiltinParam *p = &b->p[j];
        if (given[j]) continue;
        a.loc[j] = call->loc;
        if (p->required) {
            if (ok) lower_error(L, call->loc, "missing argument '%s': %s", p->name, b->usage);
            ok = false;
        } else if (isnan(p->dflt)) {
            a.v[j] = (Value){.kind = VAL_NONE};
        } else {
            a.v[j] = p->kind == ARG_INT ? val_int((int64_t)p->dflt) : val_float(p->dflt);
        }
    }
    if (!ok) return val_error();
    return b->fn(L, call, &a);
}

/* ---------------------------------------------------------------- block calls */

/* "h[i].attn" in frame f -> "h.3.attn" */
static const char *eval_path(Lower *L, Frame *f, const AstPath *p)
{
    char *s = "";
    for (int i = 0; i < p->parts.n; i++) {
        const AstPathPart *part = p->parts.items[i];
        if (part->name) {
            s = arena_printf(L->a, "%s%s%s", s, *s ? "." : "", part->name);
            continue;
        }
        Value v = eval(L, f, part->index);
        if (v.kind == VAL_ERROR) return NULL;
        if (v.kind != VAL_INT || v.i < 0) {
            lower_error(L, part->index->loc, "a scope index must be a non-negative integer, not %s",
                        lower_val_text(L, v));
            return NULL;
        }
        s = arena_printf(L->a, "%s.%lld", s, (long long)v.i);
    }
    return s;
}

static Value call_block(Lower *L, Frame *f, const AstStmt *blk, const AstExpr *call)
{
    for (const Frame *c = f; c; c = c->caller)
        if (c->block == blk) {
            lower_error(L, call->loc, "block '%s' calls itself; blocks cannot recurse", blk->name);
            return val_error();
        }
    int n_params = blk->items.n;
    Value *vals = arena_alloc(L->a, sizeof(Value) * (size_t)(n_params ? n_params : 1));
    bool *given = arena_alloc(L->a, sizeof(bool) * (size_t)(n_params ? n_params : 1));
    bool ok = true;
    int pos = 0;
    for (int i = 0; i < call->args.n; i++) {
        const AstArg *arg = call->args.items[i];
        int slot = -1;
        if (!arg->name) {
            if (pos >= n_params) {
                lower_error(L, arg->loc, "too many arguments: block '%s' takes %d", blk->name, n_params);
                return val_error();
            }
            slot = pos++;
        } else {
            for (int j = 0; j < n_params; j++)
                if (!strcmp(((AstName *)blk->items.items[j])->text, arg->name)) slot = j;
            if (slot < 0 || given[slot]) {
                lower_error(L, arg->loc, slot < 0 ? "block '%s' has no parameter '%s'"
                                                  : "block '%s': argument '%s' is given twice",
                            blk->name, arg->name);
                ok = false;
                continue;
            }
        }
        given[slot] = true;
        vals[slot] = eval(L, f, arg->value);
        if (vals[slot].kind == VAL_ERROR) ok = false;
        else if (!lower_not_a_tuple(L, arg->value->loc, vals[slot])) ok = false;
    }
    for (int j = 0; j < n_params && ok; j++)
        if (!given[j]) {
            lower_error(L, call->loc, "block '%s' takes %d argument%s, got %d", blk->name,
                        n_params, n_params == 1 ? "" : "s", call->args.n);
            ok = false;
        }
    const char *scope = f->scope;
    if (call->scope) {
        const char *path = eval_path(L, f, call->scope);
        if (!path) return val_error();
        scope = *scope ? arena_printf(L->a, "%s.%s", scope, path) : path;
    }
    if (!ok) return val_error();

    Frame inner = {.scope = scope, .block = blk, .call_loc = call->loc, .caller = f};
    for (int j = 0; j < n_params; j++) {
        const AstName *p = blk->items.items[j];
        frame_bind(L, &inner, p->text, BIND_VAR, vals[j], p->loc);
    }
    lower_exec_stmts(L, &inner, &blk->body);
    if (!inner.returned) return val_error();
    if (call->scope) name_value(L, inner.ret, scope, NULL);
    return inner.ret;
}

static Value eval_call(Lower *L, Frame *f, const AstExpr *e)
{
    const AstStmt *blk = lower_find_block(L, e->name);
    if (blk) return call_block(L, f, blk, e);
    const Builtin *b = builtin_find(e->name);
    if (!b) {
        Suggest s = {.want = e->name, .best_d = 99};
        builtin_suggest(&s);
        for (int i = 0; i < L->n_blocks; i++) lower_suggest_try(&s, L->blocks[i]->name);
        lower_error(L, e->loc, "unknown function '%s'%s", e->name, lower_suggest_text(L, &s));
        return val_error();
    }
    if (e->scope) {
        lower_error(L, e->scope->loc, "'as' names the parameters of a block call; '%s' is a "
                    "builtin, not a block", e->name);
        return val_error();
    }
    return call_builtin(L, f, b, e);
}

static Value eval(Lower *L, Frame *f, const AstExpr *e)
{
    switch (e->kind) {
    case EXPR_INT: return val_int(e->ival);
    case EXPR_FLOAT: return val_float(e->fval);
    case EXPR_NAME: return eval_name(L, f, e);
    case EXPR_BINARY: return eval_binary(L, f, e);
    case EXPR_NEG: return eval_neg(L, f, e);
    case EXPR_CALL: return eval_call(L, f, e);
    }
    ir_die(__FILE__, __LINE__, "expression kind %d", (int)e->kind);
}

/* ---------------------------------------------------------------- declarations */

/* The dims of `[vocab, dim]`: positive integers. Returns the rank, -1 after an error. */
static int eval_dims(Lower *L, Frame *f, const AstType *t, const char *what, int64_t *dims)
{
    if (t->dims.n > IR_MAX_RANK) {
        lower_error(L, t->loc, "%s has %d dims; at most %d are supported", what, t->dims.n, IR_MAX_RANK);
        return -1;
    }
    bool ok = true;
    for (int i = 0; i < t->dims.n; i++) {
        const AstExpr *d = t->dims.items[i];
        Value v = eval(L, f, d);
        if (v.kind == VAL_ERROR) {
            ok = false;
        } else if (v.kind != VAL_INT || v.i <= 0) {
            lower_error(L, d->loc, "dim %d of %s must be a positive integer, not %s", i, what, lower_val_text(L, v));
            ok = false;
        } else {
            dims[i] = v.i;
        }
    }
    if (ok && !ir_shape_fits(t->dims.n, dims)) {
        char text[160] = "";
        for (int i = 0; i < t->dims.n; i++)
            snprintf(text + strlen(text), sizeof text - strlen(text), "%s%lld", i ? " x " : "", (long long)dims[i]);
        lower_error(L, t->loc, "%s has %s elements, more than 2^40", what, text);
        ok = false;
    }
    return ok ? t->dims.n : -1;
}

/* Names that the model may not take for itself. */
static bool name_is_reserved(Lower *L, const char *name, SrcLoc loc)
{
    static const char *const reserved[] = {"lr", "step", "grad_scale", "grad_norm", "loss"};
    if (!strcmp(name, "B") || !strcmp(name, "T")) {
        lower_error(L, loc, "'%s' is the %s, set by %s", name, name[0] == 'B' ? "batch size" : "sequence length",
                    name[0] == 'B' ? "--batch" : "--seq");
        return true;
    }
    for (size_t i = 0; i < sizeof reserved / sizeof reserved[0]; i++)
        if (!strcmp(name, reserved[i])) {
            lower_error(L, loc, "'%s' is the name of a tensor that training adds", name);
            return true;
        }
    return false;
}

static void exec_input(Lower *L, Frame *f, const AstStmt *s)
{
    if (name_is_reserved(L, s->name, s->loc)) return;
    Binding *old = frame_find(&L->top, s->name);
    if (old) {
        if (lower_error(L, s->loc, "'%s' is already defined", s->name))
            diag_note(old->loc, "'%s' was defined here", s->name);
        return;
    }
    ElemType elem = FMT_F32;
    if (s->type->elem && (!fmt_elem_from_name(s->type->elem, &elem) || elem == FMT_VOID)) {
        lower_error(L, s->type->elem_loc, "unknown element type '%s'", s->type->elem);
        frame_bind(L, &L->top, s->name, BIND_INPUT, val_error(), s->loc);
        return;
    }
    int64_t dims[IR_MAX_RANK];
    int rank = eval_dims(L, f, s->type, arena_printf(L->a, "input '%s'", s->name), dims);
    if (rank < 0) {
        frame_bind(L, &L->top, s->name, BIND_INPUT, val_error(), s->loc);
        return;
    }
    Node *n = ir_leaf(L->g, OP_INPUT, s->name, ROLE_INPUT, elem, rank, dims, s->loc);
    n->phase = PHASE_FORWARD;
    frame_bind(L, &L->top, s->name, BIND_INPUT, val_tensor(n), s->loc);
}

/* The outermost block call that led here: where a repeated call declared its parameters
 * again under the same names. */
static SrcLoc outermost_call(const Frame *f)
{
    SrcLoc loc = f->call_loc;
    for (; f && f->block; f = f->caller) loc = f->call_loc;
    return loc;
}

enum { INIT_NORMAL = 0, INIT_ZEROS = 1, INIT_ONES = 2 };

/* `= normal(0.02)`, `= zeros`, `= ones`. Returns false after an error. */
static bool eval_init(Lower *L, Frame *f, const AstExpr *e, int *kind, double *std)
{
    *std = 0;
    if (e->kind == EXPR_NAME && !strcmp(e->name, "zeros")) {
        *kind = INIT_ZEROS;
        return true;
    }
    if (e->kind == EXPR_NAME && !strcmp(e->name, "ones")) {
        *kind = INIT_ONES;
        return true;
    }
    if (e->kind == EXPR_CALL && !strcmp(e->name, "normal") && !e->scope) {
        const AstArg *arg = e->args.n == 1 ? e->args.items[0] : NULL;
        if (!arg || (arg->name && strcmp(arg->name, "std"))) {
            lower_error(L, e->loc, "normal takes one argument, the standard deviation: normal(0.02)");
            return false;
        }
        Value v = eval(L, f, arg->value);
        if (v.kind == VAL_ERROR) return false;
        if (!val_is_num(v) || val_num(v) < 0 || !isfinite(val_num(v))) {
            lower_error(L, arg->value->loc, "the standard deviation of normal must be a number >= 0, not %s",
                        lower_val_text(L, v));
            return false;
        }
        *kind = INIT_NORMAL;
        *std = val_num(v);
        return true;
    }
    const char *what = e->kind == EXPR_CALL ? e->name : e->kind == EXPR_NAME ? e->name : NULL;
    if (what)
        lower_error(L, e->loc, "unknown initializer '%s': use normal(std), zeros or ones", what);
    else
        lower_error(L, e->loc, "a parameter's initializer is normal(std), zeros or ones");
    return false;
}

static void exec_param(Lower *L, Frame *f, const AstStmt *s)
{
    const char *full = *f->scope ? arena_printf(L->a, "%s.%s", f->scope, s->name) : s->name;
    if (name_is_reserved(L, s->name, s->loc)) return;
    Node *old = param_get(&L->params, full);
    if (old) {
        if (lower_same_loc(old->loc, s->loc) && !f->block) {
            if (lower_error(L, s->loc, "duplicate parameter '%s': the loop declares it on "
                            "every trip; declare it in a block and call that with 'as NAME[i]'", full))
                diag_note(s->loc, "'%s' is declared here", full);
        } else if (lower_same_loc(old->loc, s->loc)) {
            /* the same declaration ran twice: a block called again in the same scope */
            SrcLoc at = outermost_call(f);
            if (lower_error(L, at, "duplicate parameter '%s': this call declares the parameters "
                            "of block '%s' again under the same names; give it its own scope "
                            "with 'as NAME'", full, f->block->name))
                diag_note(s->loc, "'%s' is declared here", full);
        } else if (lower_error(L, s->loc, "duplicate parameter '%s'", full)) {
            diag_note(old->loc, "'%s' was first declared here", full);
        }
        /* bound to an error value, so that its uses do not report "unknown name" */
        if (!frame_find(f, s->name)) frame_bind(L, f, s->name, BIND_PARAM, val_error(), s->loc);
        return;
    }
    Binding *local = frame_find(f, s->name);
    if (local && local->kind != BIND_PARAM) {
        if (lower_error(L, s->loc, "'%s' is already a %s here", s->name, bind_words[local->kind]))
            diag_note(local->loc, "'%s' was defined here", s->name);
        return;
    }
    if (s->type->elem && strcmp(s->type->elem, "f32")) {
        lower_error(L, s->type->elem_loc, "parameters are declared f32; their storage format "
                    "comes from -O and the precision policy, not from the model");
        return;
    }
    int64_t dims[IR_MAX_RANK];
    int rank = eval_dims(L, f, s->type, arena_printf(L->a, "parameter '%s'", full), dims);
    int init;
    double std;
    bool init_ok = eval_init(L, f, s->value, &init, &std);
    Node *n = NULL;
    Value v = val_error();
    if (rank >= 0 && init_ok) {
        n = ir_leaf(L->g, OP_PARAM, full, ROLE_PARAM, FMT_F32, rank, dims, s->loc);
        n->phase = PHASE_FORWARD;
        IR_IATTR(n, PARAM, init) = init;
        IR_FATTR(n, PARAM, std) = std;
        param_put(L->a, &L->params, n->t.name, n);
        /* the parameter's name is its own: computed tensors named so before give it up */
        NamedNode **named = names_slot(L->a, &L->computed, full, false);
        for (NamedNode *e = named ? *named : NULL; e; e = e->next)
            if (e->node->t.name && !strcmp(e->node->t.name, full)) e->node->t.name = NULL;
        if (named) *named = NULL;
        v = val_tensor(n);
    }
    /* bound even after an error, so that its uses do not report "unknown name" */
    if (local) local->val = v;
    else frame_bind(L, f, s->name, BIND_PARAM, v, s->loc);
}

static void exec_config(Lower *L, const AstStmt *s);

/* ---------------------------------------------------------------- statements */

static void assign_name(Lower *L, Frame *f, const AstName *t, Value v)
{
    Binding *b = frame_find(f, t->text);
    if (!b && f != &L->top) {
        Binding *g = frame_find(&L->top, t->text);
        if (g && (g->kind == BIND_CONFIG || g->kind == BIND_INPUT)) b = g;
    }
    if (b && b->kind != BIND_VAR) {
        if (lower_error(L, t->loc, "cannot assign to %s '%s'", bind_words[b->kind], t->text))
            diag_note(b->loc, "'%s' is defined here", t->text);
        return;
    }
    if (!b && param_get(&L->params, t->text)) {
        lower_error(L, t->loc, "cannot assign to parameter '%s'", t->text);
        return;
    }
    if (!b && (!strcmp(t->text, "B") || !strcmp(t->text, "T"))) {
        name_is_reserved(L, t->text, t->loc);
        return;
    }
    if (b) b->val = v;
    else frame_bind(L, f, t->text, BIND_VAR, v, t->loc);
    name_value(L, v, f->scope, t->text);
}

static void exec_assign(Lower *L, Frame *f, const AstStmt *s)
{
    Value v = eval(L, f, s->value);
    int n = s->items.n;
    if (v.kind == VAL_TUPLE && v.n_items != n) {
        lower_error(L, s->loc, "the right side gives %d values, but %d name%s assigned",
                    v.n_items, n, n == 1 ? " is" : "s are");
        v = val_error();
    } else if (v.kind != VAL_TUPLE && v.kind != VAL_ERROR && n > 1) {
        lower_error(L, s->loc, "the right side gives one value, but %d names are assigned", n);
        v = val_error();
    }
    for (int i = 0; i < n; i++)
        assign_name(L, f, s->items.items[i], v.kind == VAL_TUPLE ? v.items[i] : v);
}

static void exec_return(Lower *L, Frame *f, const AstStmt *s)
{
    int n = s->items.n;
    Value out = {.kind = VAL_TUPLE, .n_items = n};
    out.items = arena_alloc(L->a, sizeof(Value) * (size_t)n);
    for (int i = 0; i < n; i++) {
        const AstExpr *e = s->items.items[i];
        out.items[i] = eval(L, f, e);
        if (out.items[i].kind == VAL_ERROR || !lower_not_a_tuple(L, e->loc, out.items[i])) out = val_error();
        if (out.kind == VAL_ERROR) break;
    }
    f->ret = out.kind == VAL_TUPLE && n == 1 ? out.items[0] : out;
    f->returned = true;
}

enum { MAX_LOOP_TRIPS = 1 << 16 };
/* The forward graph's size, bounded so that a mistyped -D cannot ask for a plan of hours: at
 * the bound (a 1,600-layer gpt2_tiny) fp8c plan takes about 10 s; GPT-2 d48 has about 2,000
 * forward nodes. */
enum { MAX_GRAPH_NODES = 1 << 16 };

static void exec_for(Lower *L, Frame *f, const AstStmt *s)
{
    Value from = eval(L, f, s->value), to = eval(L, f, s->value2);
    if (from.kind == VAL_ERROR || to.kind == VAL_ERROR) return;
    if (from.kind != VAL_INT || to.kind != VAL_INT) {
        const AstExpr *bad = from.kind != VAL_INT ? s->value : s->value2;
        lower_error(L, bad->loc, "loop bounds must be integers, not %s",
                    lower_val_text(L, from.kind != VAL_INT ? from : to));
        return;
    }
    int64_t trips;
    if (__builtin_sub_overflow(to.i, from.i, &trips)) {
        lower_error(L, s->value2->loc, "a loop from %lld to %lld is too long (at most %d trips)",
                    (long long)from.i, (long long)to.i, MAX_LOOP_TRIPS);
        return;
    }
    /* a range that ends before it starts is a count gone negative (-D layers=-1, a config's
     * n_layer of -3), not a loop meant to run no times: that is written with equal ends */
    if (trips < 0) {
        lower_error(L, s->value2->loc, "a loop from %lld to %lld ends before it starts (0..0 runs no times)",
                    (long long)from.i, (long long)to.i);
        return;
    }
    if (trips > MAX_LOOP_TRIPS) {
        lower_error(L, s->value2->loc, "a loop of %lld trips is too long (at most %d)", (long long)trips,
                    MAX_LOOP_TRIPS);
        return;
    }
    Binding *var = frame_find(f, s->name);
    if (var && (var->kind != BIND_LOOP || var->active)) {
        if (lower_error(L, s->loc, "'%s' is already a %s here", s->name, bind_words[var->kind]))
            diag_note(var->loc, "'%s' is defined here", s->name);
        return;
    }
    Binding *global = f != &L->top ? frame_find(&L->top, s->name) : NULL;
    if (!var && global && (global->kind == BIND_CONFIG || global->kind == BIND_INPUT)) {
        lower_error(L, s->loc, "'%s' is already a %s", s->name, bind_words[global->kind]);
        return;
    }
    if (!var) var = frame_bind(L, f, s->name, BIND_LOOP, val_int(from.i), s->loc);
    var->active = true;
    L->loop_depth++;
    for (int64_t i = from.i; i < to.i && !f->returned; i++) {
        var->val = val_int(i);
        lower_exec_stmts(L, f, &s->body);
        if (L->g->n_nodes > MAX_GRAPH_NODES) {   /* the innermost loop reports it, the others stop */
            if (!L->told_size)
                lower_error(L, s->loc, "the model unrolls into more than %d operations; fp8c plans steps "
                            "of at most that many", MAX_GRAPH_NODES);
            L->told_size = true;
            break;
        }
    }
    L->loop_depth--;
    var->active = false;
}

static void exec_loss(Lower *L, Frame *f, const AstStmt *s)
{
    Value v = eval(L, f, s->value);
    if (v.kind == VAL_ERROR) return;
    if (v.kind != VAL_TENSOR || v.node->t.rank != 0) {
        lower_error(L, s->value->loc, "the loss must be a scalar tensor, not %s", lower_val_text(L, v));
        return;
    }
    Node *n = v.node;
    if (n->op == OP_INPUT || n->op == OP_PARAM || n->op == OP_CONST) {
        lower_error(L, s->value->loc, "the loss must be computed by the model, not a %s",
                    ir_op_info(n->op)->text);
        return;
    }
    n->t.name = "loss";
    n->t.role = ROLE_OUTPUT;
    L->loss = n;
    L->loss_loc = s->value->loc;
}

/* optimizer adamw(lr=6e-4, beta1=0.9, ...), lion(...) or sgd(...): every argument by name, all
 * optional, each optimizer with its own settings and defaults (PyTorch's for AdamW and SGD,
 * except SGD's momentum 0.9; the Lion paper's for Lion). */
static void exec_optimizer(Lower *L, Frame *f, const AstStmt *s)
{
    enum { A = 1 << OPTIM_ADAMW, LI = 1 << OPTIM_LION, S = 1 << OPTIM_SGD };
    static const struct {
        const char *name;
        int which;                      /* the optimizers that have it */
        double dflt[OPTIM_COUNT];       /* adamw, lion, sgd */
        double lo, hi;
        bool lo_open, hi_closed;
    } knobs[] = {
        {"lr", A | LI | S, {1e-3, 1e-4, 1e-3}, 0, INFINITY, true, false},
        {"beta1", A | LI, {0.9, 0.9, 0}, 0, 1, false, false},
        {"beta2", A | LI, {0.999, 0.99, 0}, 0, 1, false, false},
        {"eps", A, {1e-8, 0, 0}, 0, INFINITY, true, false},
        {"weight_decay", A | LI | S, {0.01, 0, 0}, 0, INFINITY, false, false},
        {"clip", A | LI | S, {0, 0, 0}, 0, INFINITY, false, false},     /* no clipping unless asked */
        {"momentum", S, {0, 0, 0.9}, 0, 1, false, false},
        {"nesterov", S, {0, 0, 0}, 0, 1, false, true},
    };
    static const char *const usage[OPTIM_COUNT] = {"adamw(lr, beta1, beta2, eps, weight_decay, clip)",
                                                   "lion(lr, beta1, beta2, weight_decay, clip)",
                                                   "sgd(lr, momentum, nesterov, weight_decay, clip)"};
    enum { N_KNOBS = sizeof knobs / sizeof knobs[0] };
    const AstExpr *call = s->value;
    OptimKind kind;
    if (!ir_optim_from_name(call->name, &kind)) {
        lower_error(L, call->loc, "unknown optimizer '%s': fp8c trains with adamw(...), lion(...) or sgd(...)",
                    call->name);
        return;
    }
    double val[N_KNOBS];
    bool given[N_KNOBS] = {0};
    for (int k = 0; k < N_KNOBS; k++) val[k] = knobs[k].dflt[kind];
    bool ok = true;
    for (int i = 0; i < call->args.n; i++) {
        const AstArg *arg = call->args.items[i];
        if (!arg->name) {
            lower_error(L, arg->loc, "optimizer settings are named: %s(lr=6e-4, ...)", call->name);
            ok = false;
            continue;
        }
        int k = -1;
        for (int j = 0; j < N_KNOBS; j++)
            if ((knobs[j].which & (1 << kind)) && !strcmp(knobs[j].name, arg->name)) k = j;
        if (k < 0 || given[k]) {
            Suggest sg = {.want = arg->name, .best_d = 99};
            for (int j = 0; j < N_KNOBS; j++)
                if (knobs[j].which & (1 << kind)) lower_suggest_try(&sg, knobs[j].name);
            if (k < 0)
                lower_error(L, arg->loc, "unknown keyword argument '%s' of %s%s", arg->name, usage[kind],
                            lower_suggest_text(L, &sg));
            else
                lower_error(L, arg->loc, "argument '%s' of %s is given twice", arg->name, call->name);
            ok = false;
            continue;
        }
        given[k] = true;
        Value v = eval(L, f, arg->value);
        if (v.kind == VAL_ERROR) {
            ok = false;
            continue;
        }
        double x = val_num(v);
        if (!val_is_num(v) || x < knobs[k].lo || (knobs[k].lo_open && x == knobs[k].lo) ||
            (knobs[k].hi_closed ? x > knobs[k].hi : x >= knobs[k].hi) ||
            (knobs[k].hi_closed && x != 0 && x != 1)) {
            if (knobs[k].hi_closed)
                lower_error(L, arg->value->loc, "%s must be 0 or 1, not %s", knobs[k].name, lower_val_text(L, v));
            else
                lower_error(L, arg->value->loc, "%s must be %s%g%s, not %s", knobs[k].name,
                            knobs[k].lo_open ? "> " : ">= ", knobs[k].lo,
                            isinf(knobs[k].hi) ? "" : arena_printf(L->a, " and < %g", knobs[k].hi),
                            lower_val_text(L, v));
            ok = false;
            continue;
        }
        val[k] = x;
    }
    if (!ok) return;
    L->g->optim = (OptimSpec){.present = true, .kind = kind, .lr = val[0], .beta1 = val[1], .beta2 = val[2],
                              .eps = val[3], .weight_decay = val[4], .clip = val[5], .momentum = val[6],
                              .nesterov = val[7] != 0};
}

static void exec_stmt(Lower *L, Frame *f, const AstStmt *s)
{
    bool top = f == &L->top && L->loop_depth == 0;
    switch (s->kind) {
    /* top-level statements elsewhere were reported by the scan; they do nothing */
    case STMT_MODEL: case STMT_BLOCK: case STMT_DECAY:
        return;
    case STMT_CONFIG:
        if (top) exec_config(L, s);
        return;
    case STMT_INPUT:
        if (top) exec_input(L, f, s);
        return;
    case STMT_LOSS:         /* a second one was reported by the scan */
        if (top && s == L->loss_stmt) exec_loss(L, f, s);
        return;
    case STMT_OPTIMIZER:
        if (top && s == L->optimizer) exec_optimizer(L, f, s);
        return;
    case STMT_PARAM:
        exec_param(L, f, s);
        return;
    case STMT_ASSIGN:
        exec_assign(L, f, s);
        return;
    case STMT_RETURN:
        if (f->block) exec_return(L, f, s);
        return;
    case STMT_FOR:
        exec_for(L, f, s);
        return;
    }
}

void lower_exec_stmts(Lower *L, Frame *f, const AstVec *body)
{
    for (int i = 0; i < body->n && !f->returned; i++) exec_stmt(L, f, body->items[i]);
}

/* ---------------------------------------------------------------- configs and -D */

static const Define *define_find(const Lower *L, const char *name)
{
    const Define *found = NULL;
    for (int i = 0; i < L->o->n_defines; i++)     /* the last -D of a name wins */
        if (!strcmp(L->o->defines[i].name, name)) found = &L->o->defines[i];
    return found;
}

static void exec_config(Lower *L, const AstStmt *s)
{
    for (int i = 0; i < s->items.n; i++) {
        const AstBinding *b = s->items.items[i];
        if (name_is_reserved(L, b->name, b->loc)) continue;
        Binding *old = frame_find(&L->top, b->name);
        if (old) {
            if (lower_error(L, b->loc, "'%s' is already defined", b->name))
                diag_note(old->loc, "'%s' was defined here", b->name);
            continue;
        }
        Value v = eval(L, &L->top, b->value);
        if (v.kind != VAL_ERROR && !val_is_num(v)) {
            lower_error(L, b->value->loc, "config '%s' must be a number, not %s", b->name, lower_val_text(L, v));
            v = val_error();
        }
        const Define *d = define_find(L, b->name);
        Value dv;
        if (d && lower_parse_number(d->value, &dv)) {
            if (v.kind == VAL_INT && dv.kind != VAL_INT) {
                lower_error(L, lower_command_line, "-D %s=%s: config '%s' is an integer", d->name, d->value, b->name);
                v = val_error();
            } else if (v.kind != VAL_ERROR) {
                v = v.kind == VAL_FLOAT ? val_float(val_num(dv)) : dv;
            }
        }
        frame_bind(L, &L->top, b->name, BIND_CONFIG, v, b->loc);
    }
}
