/* lower.c — from the syntax tree to the forward graph.
 *
 * The model language has no run time of its own: a model file is a program that the
 * compiler runs once, at compile time, to build a graph. Config constants, --batch/--seq and
 * loop variables are ordinary numbers; tensors are IR nodes; calling a block runs its body
 * with its parameters named under the call's `as` path; a `for` loop simply runs its body
 * again. When the program ends, the graph holds every parameter (by its Hugging Face name),
 * every input and the forward computation of the loss. Evaluating instead of type-checking
 * keeps the language small and makes every shape static, which the memory planner needs.
 *
 * How it runs:
 *   1. a scan of the top level finds the blocks (so that they may be called before they are
 *      written), checks where statements may appear, and checks -D against the configs;
 *   2. the statements run in order (exec_stmt / eval), building nodes with ir_add and asking
 *      ir_infer_shape about each; every problem is a diag_error at the place in the file;
 *   3. weight-decay flags, the optimizer clause and the model's name are filled in, and
 *      nodes that do not reach the loss are dropped.
 *
 * Errors never stop the run: a failed expression evaluates to an error value that later
 * expressions pass on silently, so one mistake is reported once, not in every line after it.
 * A block body runs once per call (48 times in GPT-2 XL); an error at one place in the file
 * is therefore reported the first time only. */
#include "compiler.h"

#include "ast.h"

#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- values */

typedef enum {
    VAL_NONE,       /* an optional argument that was not given */
    VAL_ERROR,      /* the result of something already reported */
    VAL_INT,        /* i */
    VAL_FLOAT,      /* f */
    VAL_TENSOR,     /* node */
    VAL_TUPLE,      /* items[n_items]: split(..) and blocks that return several values */
} ValKind;

typedef struct Value {
    ValKind kind;
    int64_t i;
    double f;
    Node *node;
    struct Value *items;
    int n_items;
} Value;

static Value val_error(void) { return (Value){.kind = VAL_ERROR}; }
static Value val_int(int64_t i) { return (Value){.kind = VAL_INT, .i = i}; }
static Value val_float(double f) { return (Value){.kind = VAL_FLOAT, .f = f}; }
static Value val_tensor(Node *n) { return (Value){.kind = VAL_TENSOR, .node = n}; }
static bool val_is_num(Value v) { return v.kind == VAL_INT || v.kind == VAL_FLOAT; }
static double val_num(Value v) { return v.kind == VAL_INT ? (double)v.i : v.f; }

/* ---------------------------------------------------------------- names */

typedef enum { BIND_VAR, BIND_CONFIG, BIND_INPUT, BIND_PARAM, BIND_LOOP } BindKind;

static const char *const bind_words[] = {"variable", "config constant", "input", "parameter",
                                         "loop variable"};

typedef struct Binding {
    struct Binding *next;
    const char *name;
    BindKind kind;
    Value val;
    SrcLoc loc;
    bool active;        /* BIND_LOOP: its loop is running */
} Binding;

/* The names of one block call (or of the top level). */
typedef struct Frame {
    Binding *names;
    const char *scope;          /* prefix of the parameters declared here: "h.3.attn", "" */
    const AstStmt *block;       /* the block being run; NULL at the top level */
    SrcLoc call_loc;
    struct Frame *caller;
    bool returned;
    Value ret;
} Frame;

/* Parameters by full name: an open-addressing table, since GPT-2 XL declares ~600. */
typedef struct {
    const char **keys;
    Node **nodes;
    int cap, n;
} ParamMap;

/* The computed tensors that name_value named, by name: a parameter declared later under the
 * same name takes it from them. A name may be given several times (a loop at the top level
 * names each trip's value), so each entry is a list. */
typedef struct NamedNode {
    Node *node;
    struct NamedNode *next;
} NamedNode;

typedef struct {
    const char **keys;
    NamedNode **lists;
    int cap, n;
} NameMap;

typedef struct {
    Arena *a;
    Graph *g;
    const FrontOptions *o;
    const char *file;
    Frame top;
    const AstStmt **blocks;
    int n_blocks;
    ParamMap params;
    NameMap computed;           /* computed tensors by the name name_value gave them */
    const char **configs;       /* names declared by `config` anywhere at the top */
    int n_configs;
    Node *loss;
    SrcLoc loss_loc;
    const AstStmt *model, *optimizer, *decay, *loss_stmt;
    int loop_depth;
    bool told_batch, told_seq;
    bool told_size;         /* the graph passed MAX_GRAPH_NODES (reported once) */
    SrcLoc *reported;           /* places with an error already: report each once */
    int n_reported, cap_reported;
} Lower;

static const SrcLoc command_line = {"<command line>", 0, 0};

/* ---------------------------------------------------------------- errors */

static bool same_loc(SrcLoc a, SrcLoc b)
{
    return a.line == b.line && a.col == b.col && a.file == b.file;
}

/* Reports an error unless one was reported at the same place before (a block body runs once
 * per call; its mistakes are the same each time). Returns whether it printed. */
static bool lower_error(Lower *L, SrcLoc loc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool lower_error(Lower *L, SrcLoc loc, const char *fmt, ...)
{
    if (loc.line > 0) {
        for (int i = 0; i < L->n_reported; i++)
            if (same_loc(L->reported[i], loc)) return false;
        if (L->n_reported == L->cap_reported) {
            int cap = L->cap_reported ? 2 * L->cap_reported : 16;
            SrcLoc *r = arena_alloc(L->a, sizeof *r * (size_t)cap);
            if (L->n_reported) memcpy(r, L->reported, sizeof *r * (size_t)L->n_reported);
            L->reported = r;
            L->cap_reported = cap;
        }
        L->reported[L->n_reported++] = loc;
    }
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    diag_error(loc, "%s", buf);
    return true;
}

static const char *shape_text(Lower *L, const Tensor *t) { return ir_shape_text(L->a, t); }

/* What a value is, for "must be a tensor, not ..." */
static const char *val_text(Lower *L, Value v)
{
    switch (v.kind) {
    case VAL_INT: return arena_printf(L->a, "the integer %lld", (long long)v.i);
    case VAL_FLOAT: return arena_printf(L->a, "the number %g", v.f);
    case VAL_TENSOR: return arena_printf(L->a, "a tensor %s", shape_text(L, &v.node->t));
    case VAL_TUPLE: return arena_printf(L->a, "%d values", v.n_items);
    default: return "nothing";
    }
}

/* ---------------------------------------------------------------- "did you mean" */

static int edit_distance(const char *a, const char *b)
{
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 63 || lb > 63) return 99;
    int row[64];
    for (int j = 0; j <= lb; j++) row[j] = j;
    for (int i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

typedef struct {
    const char *want, *best;
    int best_d;
} Suggest;

static void suggest_try(Suggest *s, const char *cand)
{
    if (!cand || !strcmp(cand, s->want)) return;
    int d = edit_distance(s->want, cand);
    int limit = strlen(s->want) <= 4 ? 1 : 2;
    if (d <= limit && d < s->best_d) {
        s->best_d = d;
        s->best = cand;
    }
}

static const char *suggest_text(Lower *L, const Suggest *s)
{
    return s->best ? arena_printf(L->a, " (did you mean '%s'?)", s->best) : "";
}

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

static const AstStmt *block_find(const Lower *L, const char *name)
{
    for (int i = 0; i < L->n_blocks; i++)
        if (!strcmp(L->blocks[i]->name, name)) return L->blocks[i];
    return NULL;
}

/* ---------------------------------------------------------------- nodes */

static Node *node_new(Lower *L, OpKind op, SrcLoc loc, int n_in, Node **in)
{
    Node *n = ir_add(L->g, op, n_in, in, loc);
    n->phase = PHASE_FORWARD;
    return n;
}

/* Integer tensors are token ids: embedding and cross_entropy read them, nothing else does. */
static bool int_input_allowed(const Node *n, int i)
{
    return (n->op == OP_EMBEDDING || n->op == OP_CROSS_ENTROPY) && i == 1;
}

/* Infers the shape of a node whose inputs and attributes are set; reports what is wrong
 * at the node's place. */
static Value node_done(Lower *L, Node *n)
{
    for (int i = 0; i < n->n_in; i++) {
        const Tensor *t = &n->in[i]->t;
        if (!fmt_elem_is_float(t->fmt.elem) && !int_input_allowed(n, i)) {
            lower_error(L, n->loc, "%s reads %s: integer tensors hold token ids, which only "
                        "embedding and cross_entropy take", ir_op_info(n->op)->text, shape_text(L, t));
            return val_error();
        }
    }
    const char *err = ir_infer_shape(n, L->a);
    if (err) {
        lower_error(L, n->loc, "%s", err);
        return val_error();
    }
    return val_tensor(n);
}

static Value node_unary(Lower *L, OpKind op, SrcLoc loc, Node *x)
{
    return node_done(L, node_new(L, op, loc, 1, &x));
}

static Value node_binary(Lower *L, OpKind op, SrcLoc loc, Node *x, Node *y)
{
    Node *in[2] = {x, y};
    return node_done(L, node_new(L, op, loc, 2, in));
}

static Value node_scale(Lower *L, SrcLoc loc, Node *x, double alpha)
{
    Node *n = node_new(L, OP_SCALE, loc, 1, &x);
    n->fattr[0] = alpha;
    return node_done(L, n);
}

/* A scalar constant, broadcast by ADD onto any tensor. */
static Node *node_const(Lower *L, SrcLoc loc, double value)
{
    Node *n = ir_leaf(L->g, OP_CONST, NULL, ROLE_ACTIVATION, FMT_F32, 0, NULL, loc);
    n->phase = PHASE_FORWARD;
    n->fattr[0] = value;
    return n;
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
    if (block_find(L, name)) {
        lower_error(L, e->loc, "'%s' is a block; call it: %s(...)", name, name);
        return val_error();
    }
    Suggest s = {.want = name, .best_d = 99};
    for (const Frame *fr = f; fr; fr = fr == &L->top ? NULL : &L->top)
        for (Binding *x = fr->names; x; x = x->next) suggest_try(&s, x->name);
    for (int i = 0; i < L->params.cap; i++) suggest_try(&s, L->params.keys[i]);
    lower_error(L, e->loc, "unknown name '%s'%s", name, suggest_text(L, &s));
    return val_error();
}

static Value arith_numbers(Lower *L, SrcLoc loc, char op, Value a, Value b)
{
    if (a.kind == VAL_INT && b.kind == VAL_INT) {
        int64_t r;
        switch (op) {
        case '+': if (__builtin_add_overflow(a.i, b.i, &r)) goto overflow; return val_int(r);
        case '-': if (__builtin_sub_overflow(a.i, b.i, &r)) goto overflow; return val_int(r);
        case '*': if (__builtin_mul_overflow(a.i, b.i, &r)) goto overflow; return val_int(r);
        case '%':
            if (b.i == 0) break;
            return val_int(a.i % b.i);
        case '/':
            /* exact integer quotients stay integers (dim / heads is a size); others are real */
            if (b.i == 0) break;
            if (a.i % b.i == 0) return val_int(a.i / b.i);
            return val_float((double)a.i / (double)b.i);
        }
        lower_error(L, loc, "division by zero");
        return val_error();
    overflow:
        lower_error(L, loc, "integer overflow: %lld %c %lld", (long long)a.i, op, (long long)b.i);
        return val_error();
    }
    double x = val_num(a), y = val_num(b), r = 0;
    switch (op) {
    case '+': r = x + y; break;
    case '-': r = x - y; break;
    case '*': r = x * y; break;
    case '/':
        if (y == 0) {
            lower_error(L, loc, "division by zero");
            return val_error();
        }
        r = x / y;
        break;
    case '%':
        lower_error(L, loc, "'%%' needs integers, not %g %% %g", x, y);
        return val_error();
    }
    return val_float(r);
}

static const char *op_verb(char op)
{
    switch (op) {
    case '+': return "add";
    case '-': return "subtract";
    case '*': return "multiply";
    case '/': return "divide";
    default: return "take the remainder of";
    }
}

static Value arith_tensors(Lower *L, SrcLoc loc, char op, Value a, Value b)
{
    if (a.kind == VAL_TENSOR && b.kind == VAL_TENSOR) {
        Node *x = a.node, *y = b.node;
        if (op == '+' || op == '*') {
            /* commutative: the broadcast operand goes second, whichever side it was written on */
            if (x->t.rank < y->t.rank) {
                Node *t = x;
                x = y;
                y = t;
            }
            return node_binary(L, op == '+' ? OP_ADD : OP_MUL, loc, x, y);
        }
        if (op == '-') return node_binary(L, OP_SUB, loc, x, y);
        lower_error(L, loc, "cannot %s tensors %s and %s: tensors are added, subtracted and "
                    "multiplied elementwise", op_verb(op), shape_text(L, &x->t), shape_text(L, &y->t));
        return val_error();
    }
    bool t_first = a.kind == VAL_TENSOR;
    Node *t = t_first ? a.node : b.node;
    double s = val_num(t_first ? b : a);
    switch (op) {
    case '*':
        return node_scale(L, loc, t, s);
    case '/':
        if (t_first && s != 0) return node_scale(L, loc, t, 1.0 / s);
        if (t_first) {
            lower_error(L, loc, "division by zero");
            return val_error();
        }
        break;
    case '+':
        return node_binary(L, OP_ADD, loc, t, node_const(L, loc, s));
    case '-':
        if (t_first) return node_binary(L, OP_ADD, loc, t, node_const(L, loc, -s));
        Value neg = node_scale(L, loc, t, -1.0);
        if (neg.kind != VAL_TENSOR) return neg;
        return node_binary(L, OP_ADD, loc, neg.node, node_const(L, loc, s));
    }
    lower_error(L, loc, "cannot %s %s and %s", op_verb(op), val_text(L, a), val_text(L, b));
    return val_error();
}

static bool not_a_tuple(Lower *L, SrcLoc loc, Value v)
{
    if (v.kind != VAL_TUPLE) return true;
    lower_error(L, loc, "this gives %d values; assign them to %d names first", v.n_items, v.n_items);
    return false;
}

static Value eval_binary(Lower *L, Frame *f, const AstExpr *e)
{
    Value a = eval(L, f, e->lhs), b = eval(L, f, e->rhs);
    if (a.kind == VAL_ERROR || b.kind == VAL_ERROR) return val_error();
    if (!not_a_tuple(L, e->lhs->loc, a) || !not_a_tuple(L, e->rhs->loc, b)) return val_error();
    if (val_is_num(a) && val_is_num(b)) return arith_numbers(L, e->loc, e->binop, a, b);
    return arith_tensors(L, e->loc, e->binop, a, b);
}

static Value eval_neg(Lower *L, Frame *f, const AstExpr *e)
{
    Value a = eval(L, f, e->lhs);
    switch (a.kind) {
    case VAL_INT:
        if (a.i == INT64_MIN) break;
        return val_int(-a.i);
    case VAL_FLOAT: return val_float(-a.f);
    case VAL_TENSOR: return node_scale(L, e->loc, a.node, -1.0);
    case VAL_TUPLE: not_a_tuple(L, e->lhs->loc, a); return val_error();
    default: return a;
    }
    lower_error(L, e->loc, "integer overflow");
    return val_error();
}

/* ---------------------------------------------------------------- builtins */

typedef enum { ARG_TENSOR, ARG_INT, ARG_NUM } ArgKind;

typedef struct {
    const char *name;
    ArgKind kind;
    bool required;
    double dflt;        /* when not required; NAN: no default (the builtin decides) */
} BuiltinParam;

#define MAX_BUILTIN_PARAMS 6
#define MAX_EXTRA_ARGS 64

typedef struct {
    Value v[MAX_BUILTIN_PARAMS];
    SrcLoc loc[MAX_BUILTIN_PARAMS];
    Value extra[MAX_EXTRA_ARGS];        /* split's sizes */
    SrcLoc extra_loc[MAX_EXTRA_ARGS];
    int n_extra;
} Args;

typedef Value (*BuiltinFn)(Lower *L, const AstExpr *call, const Args *a);

typedef struct {
    const char *name;
    BuiltinFn fn;
    const char *usage;
    bool variadic;      /* more integer arguments after the last parameter */
    int n_params;
    BuiltinParam p[MAX_BUILTIN_PARAMS];
} Builtin;

static Value b_linear(Lower *L, const AstExpr *c, const Args *a)
{
    Node *in[2] = {a->v[0].node, a->v[1].node};
    Node *mm = node_new(L, OP_MATMUL, c->loc, 2, in);
    mm->iattr[1] = 1;                       /* nn.Linear: weight is (out, in) */
    Value y = node_done(L, mm);
    if (y.kind != VAL_TENSOR || a->v[2].kind == VAL_NONE) return y;
    return node_binary(L, OP_ADD, c->loc, y.node, a->v[2].node);
}

static bool is_flag(Lower *L, const Args *a, int i, const char *what)
{
    if (a->v[i].i == 0 || a->v[i].i == 1) return true;
    lower_error(L, a->loc[i], "%s must be 0 or 1, not %lld", what, (long long)a->v[i].i);
    return false;
}

static Value b_matmul(Lower *L, const AstExpr *c, const Args *a)
{
    if (!is_flag(L, a, 2, "transpose_a") || !is_flag(L, a, 3, "transpose_b")) return val_error();
    Node *in[2] = {a->v[0].node, a->v[1].node};
    Node *n = node_new(L, OP_MATMUL, c->loc, 2, in);
    n->iattr[0] = a->v[2].i;
    n->iattr[1] = a->v[3].i;
    return node_done(L, n);
}

static bool is_positive(Lower *L, const Args *a, int i, const char *what)
{
    if (val_num(a->v[i]) > 0) return true;
    lower_error(L, a->loc[i], "%s must be positive, not %g", what, val_num(a->v[i]));
    return false;
}

static Value b_layernorm(Lower *L, const AstExpr *c, const Args *a)
{
    if (!is_positive(L, a, 3, "eps")) return val_error();
    Node *in[3] = {a->v[0].node, a->v[1].node, a->v[2].node};
    Node *n = node_new(L, OP_LAYERNORM, c->loc, 3, in);
    n->fattr[0] = a->v[3].f;
    return node_done(L, n);
}

static Value b_rmsnorm(Lower *L, const AstExpr *c, const Args *a)
{
    if (!is_positive(L, a, 2, "eps")) return val_error();
    Node *in[2] = {a->v[0].node, a->v[1].node};
    Node *n = node_new(L, OP_RMSNORM, c->loc, 2, in);
    n->fattr[0] = a->v[2].f;
    return node_done(L, n);
}

static Value b_gelu(Lower *L, const AstExpr *c, const Args *a)
{
    return node_unary(L, OP_GELU, c->loc, a->v[0].node);
}

static Value b_silu(Lower *L, const AstExpr *c, const Args *a)
{
    return node_unary(L, OP_SILU, c->loc, a->v[0].node);
}

static Value b_softmax(Lower *L, const AstExpr *c, const Args *a)
{
    return node_unary(L, OP_SOFTMAX, c->loc, a->v[0].node);
}

static Value b_embedding(Lower *L, const AstExpr *c, const Args *a)
{
    return node_binary(L, OP_EMBEDDING, c->loc, a->v[0].node, a->v[1].node);
}

static Value b_cross_entropy(Lower *L, const AstExpr *c, const Args *a)
{
    return node_binary(L, OP_CROSS_ENTROPY, c->loc, a->v[0].node, a->v[1].node);
}

static Value b_attention(Lower *L, const AstExpr *c, const Args *a)
{
    int64_t heads = a->v[3].i;
    int64_t kv_heads = a->v[4].kind == VAL_NONE ? heads : a->v[4].i;
    if (heads <= 0) {
        lower_error(L, a->loc[3], "heads must be positive, not %lld", (long long)heads);
        return val_error();
    }
    if (kv_heads <= 0 || heads % kv_heads) {
        lower_error(L, a->loc[4], "kv_heads (%lld) must be positive and divide heads (%lld)",
                    (long long)kv_heads, (long long)heads);
        return val_error();
    }
    Node *in[3] = {a->v[0].node, a->v[1].node, a->v[2].node};
    Node *n = node_new(L, OP_ATTENTION, c->loc, 3, in);
    n->iattr[0] = heads;
    n->iattr[1] = kv_heads;
    Value y = node_done(L, n);
    if (y.kind != VAL_TENSOR) return y;
    if (a->v[5].kind == VAL_NONE) {
        int64_t head_dim = n->in[0]->t.dims[2] / heads;
        n->fattr[0] = 1.0 / sqrt((double)head_dim);
    } else {
        n->fattr[0] = a->v[5].f;
    }
    return y;
}

static Value b_rope(Lower *L, const AstExpr *c, const Args *a)
{
    if (!is_positive(L, a, 2, "theta")) return val_error();
    Node *n = node_new(L, OP_ROPE, c->loc, 1, (Node *[]){a->v[0].node});
    n->iattr[0] = a->v[1].i;
    n->iattr[1] = 0;
    n->fattr[0] = a->v[2].f;
    return node_done(L, n);
}

static Value slice_node(Lower *L, SrcLoc loc, Node *x, int64_t axis, int64_t start, int64_t size)
{
    Node *n = node_new(L, OP_SLICE, loc, 1, &x);
    n->iattr[0] = axis;
    n->iattr[1] = start;
    n->iattr[2] = size;
    return node_done(L, n);
}

static Value b_slice(Lower *L, const AstExpr *c, const Args *a)
{
    Node *x = a->v[0].node;
    int64_t axis = a->v[1].i;
    if (axis < 0) axis += x->t.rank;    /* -1: the last axis */
    if (axis < 0 || axis >= x->t.rank) {
        lower_error(L, a->loc[1], "axis %lld is out of range for %s", (long long)a->v[1].i,
                    shape_text(L, &x->t));
        return val_error();
    }
    return slice_node(L, c->loc, x, axis, a->v[2].i, a->v[3].i);
}

/* split(x, n): n equal parts of the last axis; split(x, s1, s2, ...): parts of these sizes. */
static Value b_split(Lower *L, const AstExpr *c, const Args *a)
{
    Node *x = a->v[0].node;
    if (x->t.rank == 0) {
        lower_error(L, c->loc, "split needs a tensor with an axis to split, not a scalar");
        return val_error();
    }
    int axis = x->t.rank - 1;
    int64_t width = x->t.dims[axis];
    int n = a->n_extra;
    int64_t sizes[MAX_EXTRA_ARGS];
    if (n == 0) {
        lower_error(L, c->loc, "split needs the number of parts or their sizes: split(x, 3)");
        return val_error();
    }
    if (n == 1) {
        int64_t parts = a->extra[0].i;
        if (parts <= 0 || width % parts) {
            lower_error(L, a->extra_loc[0], "cannot split the last dim %lld of %s into %lld equal parts",
                        (long long)width, shape_text(L, &x->t), (long long)parts);
            return val_error();
        }
        if (parts > MAX_EXTRA_ARGS) {
            lower_error(L, a->extra_loc[0], "split into at most %d parts", MAX_EXTRA_ARGS);
            return val_error();
        }
        n = (int)parts;
        for (int i = 0; i < n; i++) sizes[i] = width / parts;
    } else {
        int64_t sum = 0;
        char text[256] = "";
        for (int i = 0; i < n; i++) {
            sizes[i] = a->extra[i].i;
            if (sizes[i] <= 0) {
                lower_error(L, a->extra_loc[i], "split sizes must be positive, not %lld", (long long)sizes[i]);
                return val_error();
            }
            sum += sizes[i];
            size_t k = strlen(text);
            snprintf(text + k, sizeof text - k, i ? "+%lld" : "%lld", (long long)sizes[i]);
        }
        if (sum != width) {
            lower_error(L, c->loc, "split sizes %s = %lld do not add up to the last dim %lld of %s",
                        text, (long long)sum, (long long)width, shape_text(L, &x->t));
            return val_error();
        }
    }
    if (n == 1) return slice_node(L, c->loc, x, axis, 0, sizes[0]);
    Value out = {.kind = VAL_TUPLE, .n_items = n};
    out.items = arena_alloc(L->a, sizeof(Value) * (size_t)n);
    int64_t start = 0;
    for (int i = 0; i < n; i++) {
        out.items[i] = slice_node(L, c->loc, x, axis, start, sizes[i]);
        if (out.items[i].kind != VAL_TENSOR) return val_error();
        start += sizes[i];
    }
    return out;
}

static Value b_sqrt(Lower *L, const AstExpr *c, const Args *a)
{
    double x = a->v[0].f;
    if (x < 0) {
        lower_error(L, a->loc[0], "sqrt of the negative number %g", x);
        return val_error();
    }
    return val_float(sqrt(x));
}

#define T_(n) {n, ARG_TENSOR, true, 0}
#define TOPT(n) {n, ARG_TENSOR, false, NAN}
#define I_(n) {n, ARG_INT, true, 0}
#define IDEF(n, d) {n, ARG_INT, false, d}
#define IOPT(n) {n, ARG_INT, false, NAN}
#define F_(n) {n, ARG_NUM, true, 0}
#define FDEF(n, d) {n, ARG_NUM, false, d}
#define FOPT(n) {n, ARG_NUM, false, NAN}

static const Builtin builtins[] = {
    {"linear", b_linear, "linear(x, w, b)", false, 3, {T_("x"), T_("w"), TOPT("b")}},
    {"matmul", b_matmul, "matmul(a, b, transpose_a=0, transpose_b=0)", false, 4,
     {T_("a"), T_("b"), IDEF("transpose_a", 0), IDEF("transpose_b", 0)}},
    {"layernorm", b_layernorm, "layernorm(x, w, b, eps=1e-5)", false, 4,
     {T_("x"), T_("w"), T_("b"), FDEF("eps", 1e-5)}},
    {"rmsnorm", b_rmsnorm, "rmsnorm(x, w, eps=1e-6)", false, 3, {T_("x"), T_("w"), FDEF("eps", 1e-6)}},
    {"gelu", b_gelu, "gelu(x)", false, 1, {T_("x")}},
    {"silu", b_silu, "silu(x)", false, 1, {T_("x")}},
    {"softmax", b_softmax, "softmax(x)", false, 1, {T_("x")}},
    {"embedding", b_embedding, "embedding(table, ids)", false, 2, {T_("table"), T_("ids")}},
    {"attention", b_attention, "attention(q, k, v, heads=, kv_heads=heads, scale=1/sqrt(head_dim))",
     false, 6, {T_("q"), T_("k"), T_("v"), I_("heads"), IOPT("kv_heads"), FOPT("scale")}},
    {"rope", b_rope, "rope(x, head_dim=, theta=10000)", false, 3,
     {T_("x"), I_("head_dim"), FDEF("theta", 10000)}},
    {"split", b_split, "split(x, n) or split(x, size1, size2, ...)", true, 1, {T_("x")}},
    {"slice", b_slice, "slice(x, axis=, start=, size=)", false, 4,
     {T_("x"), I_("axis"), I_("start"), I_("size")}},
    {"cross_entropy", b_cross_entropy, "cross_entropy(logits, targets)", false, 2,
     {T_("logits"), T_("targets")}},
    {"sqrt", b_sqrt, "sqrt(number)", false, 1, {F_("x")}},
};

static const Builtin *builtin_find(const char *name)
{
    for (size_t i = 0; i < sizeof builtins / sizeof builtins[0]; i++)
        if (!strcmp(builtins[i].name, name)) return &builtins[i];
    return NULL;
}

/* Checks that v suits a parameter of kind k (numbers become doubles for ARG_NUM). */
static bool arg_fits(Lower *L, const Builtin *b, const char *pname, ArgKind k, Value *v, SrcLoc loc)
{
    if (v->kind == VAL_ERROR) return false;
    if (v->kind == VAL_TUPLE) return not_a_tuple(L, loc, *v);
    switch (k) {
    case ARG_TENSOR:
        if (v->kind == VAL_TENSOR) return true;
        lower_error(L, loc, "argument '%s' of %s must be a tensor, not %s", pname, b->name, val_text(L, *v));
        return false;
    case ARG_INT:
        if (v->kind == VAL_INT) return true;
        lower_error(L, loc, "argument '%s' of %s must be an integer, not %s", pname, b->name, val_text(L, *v));
        return false;
    case ARG_NUM:
        if (val_is_num(*v)) {
            *v = val_float(val_num(*v));
            return true;
        }
        lower_error(L, loc, "argument '%s' of %s must be a number, not %s", pname, b->name, val_text(L, *v));
        return false;
    }
    return false;
}

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
                for (int j = 0; j < b->n_params; j++) suggest_try(&s, b->p[j].name);
                lower_error(L, arg->loc, "unknown keyword argument '%s' of %s%s", arg->name,
                            b->usage, suggest_text(L, &s));
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
            ok &= arg_fits(L, b, "size", ARG_INT, &a.extra[a.n_extra], arg->value->loc);
            a.n_extra++;
            continue;
        }
        given[slot] = true;
        a.loc[slot] = arg->value->loc;
        a.v[slot] = v;
        ok &= arg_fits(L, b, b->p[slot].name, b->p[slot].kind, &a.v[slot], arg->value->loc);
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

static void exec_stmts(Lower *L, Frame *f, const AstVec *body);

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
                        val_text(L, v));
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
        else if (!not_a_tuple(L, arg->value->loc, vals[slot])) ok = false;
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
    exec_stmts(L, &inner, &blk->body);
    if (!inner.returned) return val_error();
    if (call->scope) name_value(L, inner.ret, scope, NULL);
    return inner.ret;
}

static Value eval_call(Lower *L, Frame *f, const AstExpr *e)
{
    const AstStmt *blk = block_find(L, e->name);
    if (blk) return call_block(L, f, blk, e);
    const Builtin *b = builtin_find(e->name);
    if (!b) {
        Suggest s = {.want = e->name, .best_d = 99};
        for (size_t i = 0; i < sizeof builtins / sizeof builtins[0]; i++) suggest_try(&s, builtins[i].name);
        for (int i = 0; i < L->n_blocks; i++) suggest_try(&s, L->blocks[i]->name);
        lower_error(L, e->loc, "unknown function '%s'%s", e->name, suggest_text(L, &s));
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
            lower_error(L, d->loc, "dim %d of %s must be a positive integer, not %s", i, what, val_text(L, v));
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
                        val_text(L, v));
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
        if (same_loc(old->loc, s->loc) && !f->block) {
            if (lower_error(L, s->loc, "duplicate parameter '%s': the loop declares it on "
                            "every trip; declare it in a block and call that with 'as NAME[i]'", full))
                diag_note(s->loc, "'%s' is declared here", full);
        } else if (same_loc(old->loc, s->loc)) {
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
        n->iattr[0] = init;
        n->fattr[0] = std;
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
        if (out.items[i].kind == VAL_ERROR || !not_a_tuple(L, e->loc, out.items[i])) out = val_error();
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
                    val_text(L, from.kind != VAL_INT ? from : to));
        return;
    }
    int64_t trips;
    if (__builtin_sub_overflow(to.i, from.i, &trips)) {
        lower_error(L, s->value2->loc, "a loop from %lld to %lld is too long (at most %d trips)",
                    (long long)from.i, (long long)to.i, MAX_LOOP_TRIPS);
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
        exec_stmts(L, f, &s->body);
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
        lower_error(L, s->value->loc, "the loss must be a scalar tensor, not %s", val_text(L, v));
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

/* optimizer adamw(lr=6e-4, beta1=0.9, ...): every argument by name, all optional. */
static void exec_optimizer(Lower *L, Frame *f, const AstStmt *s)
{
    static const struct {
        const char *name;
        double dflt, lo, hi;
        bool lo_open;
    } knobs[] = {
        /* PyTorch's AdamW defaults; no clipping unless asked for */
        {"lr", 1e-3, 0, INFINITY, true},
        {"beta1", 0.9, 0, 1, false},
        {"beta2", 0.999, 0, 1, false},
        {"eps", 1e-8, 0, INFINITY, true},
        {"weight_decay", 0.01, 0, INFINITY, false},
        {"clip", 0.0, 0, INFINITY, false},
    };
    enum { N_KNOBS = sizeof knobs / sizeof knobs[0] };
    const AstExpr *call = s->value;
    if (strcmp(call->name, "adamw")) {
        lower_error(L, call->loc, "unknown optimizer '%s': fp8c trains with adamw(...)", call->name);
        return;
    }
    double val[N_KNOBS];
    bool given[N_KNOBS] = {0};
    for (int k = 0; k < N_KNOBS; k++) val[k] = knobs[k].dflt;
    bool ok = true;
    for (int i = 0; i < call->args.n; i++) {
        const AstArg *arg = call->args.items[i];
        if (!arg->name) {
            lower_error(L, arg->loc, "optimizer settings are named: adamw(lr=6e-4, beta1=0.9, ...)");
            ok = false;
            continue;
        }
        int k = -1;
        for (int j = 0; j < N_KNOBS; j++)
            if (!strcmp(knobs[j].name, arg->name)) k = j;
        if (k < 0 || given[k]) {
            Suggest sg = {.want = arg->name, .best_d = 99};
            for (int j = 0; j < N_KNOBS; j++) suggest_try(&sg, knobs[j].name);
            if (k < 0)
                lower_error(L, arg->loc, "unknown keyword argument '%s' of adamw(lr, beta1, beta2, "
                            "eps, weight_decay, clip)%s", arg->name, suggest_text(L, &sg));
            else
                lower_error(L, arg->loc, "argument '%s' of adamw is given twice", arg->name);
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
            x >= knobs[k].hi) {
            lower_error(L, arg->value->loc, "%s must be %s%g%s, not %s", knobs[k].name,
                        knobs[k].lo_open ? "> " : ">= ", knobs[k].lo,
                        isinf(knobs[k].hi) ? "" : arena_printf(L->a, " and < %g", knobs[k].hi),
                        val_text(L, v));
            ok = false;
            continue;
        }
        val[k] = x;
    }
    if (!ok) return;
    L->g->optim = (OptimSpec){.present = true, .lr = val[0], .beta1 = val[1], .beta2 = val[2],
                              .eps = val[3], .weight_decay = val[4], .clip = val[5]};
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

static void exec_stmts(Lower *L, Frame *f, const AstVec *body)
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

/* A -D value: an integer or a real number, the whole string. */
static bool parse_number(const char *s, Value *out)
{
    char *end;
    errno = 0;
    long long i = strtoll(s, &end, 10);
    if (*s && !*end && errno == 0) {
        *out = val_int(i);
        return true;
    }
    errno = 0;
    double d = strtod(s, &end);
    if (*s && !*end && errno == 0 && isfinite(d)) {
        *out = val_float(d);
        return true;
    }
    return false;
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
            lower_error(L, b->value->loc, "config '%s' must be a number, not %s", b->name, val_text(L, v));
            v = val_error();
        }
        const Define *d = define_find(L, b->name);
        Value dv;
        if (d && parse_number(d->value, &dv)) {
            if (v.kind == VAL_INT && dv.kind != VAL_INT) {
                lower_error(L, command_line, "-D %s=%s: config '%s' is an integer", d->name, d->value, b->name);
                v = val_error();
            } else if (v.kind != VAL_ERROR) {
                v = v.kind == VAL_FLOAT ? val_float(val_num(dv)) : dv;
            }
        }
        frame_bind(L, &L->top, b->name, BIND_CONFIG, v, b->loc);
    }
}

/* ---------------------------------------------------------------- the scan */

static const char *stmt_word(StmtKind k)
{
    static const char *const words[] = {"model", "config", "input", "param", "block", "assignment",
                                        "return", "for", "loss", "optimizer", "decay"};
    return words[k];
}

/* Where statements may stand: model, config, input, block, loss, optimizer and decay at the
 * top level only; return as the last statement of a block. */
static void scan_body(Lower *L, const AstVec *body, const AstStmt *block, bool block_level)
{
    for (int i = 0; i < body->n; i++) {
        const AstStmt *s = body->items[i];
        switch (s->kind) {
        case STMT_MODEL: case STMT_CONFIG: case STMT_INPUT: case STMT_BLOCK: case STMT_LOSS:
        case STMT_OPTIMIZER: case STMT_DECAY:
            lower_error(L, s->loc, "'%s' belongs at the top level, not inside a %s", stmt_word(s->kind),
                        block_level ? "block" : "loop");
            break;
        case STMT_RETURN:
            if (!block || !block_level || i != body->n - 1)
                lower_error(L, s->loc, block ? "'return' must be the last statement of block '%s'"
                                             : "'return' outside a block%s", block ? block->name : "");
            break;
        case STMT_FOR:
            scan_body(L, &s->body, block, false);
            break;
        default:
            break;
        }
    }
    if (block && block_level &&
        (body->n == 0 || ((const AstStmt *)body->items[body->n - 1])->kind != STMT_RETURN))
        lower_error(L, block->loc, "block '%s' does not end with a return", block->name);
}

static void scan_top(Lower *L, const AstVec *prog)
{
    L->blocks = arena_alloc(L->a, sizeof(AstStmt *) * (size_t)(prog->n ? prog->n : 1));
    int n_config_names = 0;
    for (int i = 0; i < prog->n; i++) {
        const AstStmt *s = prog->items[i];
        if (s->kind == STMT_CONFIG) n_config_names += s->items.n;
    }
    L->configs = arena_alloc(L->a, sizeof(char *) * (size_t)(n_config_names ? n_config_names : 1));
    for (int i = 0; i < prog->n; i++) {
        const AstStmt *s = prog->items[i];
        const AstStmt **first = NULL;
        switch (s->kind) {
        case STMT_BLOCK: {
            const AstStmt *old = block_find(L, s->name);
            if (old) {
                if (lower_error(L, s->loc, "block '%s' is defined twice", s->name))
                    diag_note(old->loc, "'%s' was first defined here", s->name);
                break;
            }
            if (builtin_find(s->name)) {
                lower_error(L, s->loc, "block '%s' has the name of a builtin function", s->name);
                break;
            }
            for (int j = 0; j < s->items.n; j++) {
                const AstName *pj = s->items.items[j];
                for (int k = 0; k < j; k++)
                    if (!strcmp(pj->text, ((AstName *)s->items.items[k])->text))
                        lower_error(L, pj->loc, "block '%s' has two parameters named '%s'", s->name, pj->text);
            }
            L->blocks[L->n_blocks++] = s;
            scan_body(L, &s->body, s, true);
            break;
        }
        case STMT_CONFIG:
            for (int j = 0; j < s->items.n; j++)
                L->configs[L->n_configs++] = ((AstBinding *)s->items.items[j])->name;
            break;
        case STMT_FOR:
            scan_body(L, &s->body, NULL, false);
            break;
        case STMT_RETURN:
            lower_error(L, s->loc, "'return' outside a block");
            break;
        case STMT_MODEL: first = &L->model; break;
        case STMT_OPTIMIZER: first = &L->optimizer; break;
        case STMT_DECAY: first = &L->decay; break;
        case STMT_LOSS: first = &L->loss_stmt; break;
        default:
            break;
        }
        if (first && *first) {
            if (lower_error(L, s->loc, "a second '%s' statement", stmt_word(s->kind)))
                diag_note((*first)->loc, "the first is here");
        } else if (first) {
            *first = s;
        }
    }

    for (int i = 0; i < L->o->n_defines; i++) {
        const Define *d = &L->o->defines[i];
        bool known = false;
        Suggest sg = {.want = d->name, .best_d = 99};
        for (int j = 0; j < L->n_configs; j++) {
            known |= !strcmp(L->configs[j], d->name);
            suggest_try(&sg, L->configs[j]);
        }
        Value v;
        if (!known)
            lower_error(L, command_line, "-D %s=%s: the model has no config '%s'%s", d->name,
                        d->value ? d->value : "", d->name, suggest_text(L, &sg));
        else if (!d->value || !parse_number(d->value, &v))
            lower_error(L, command_line, "-D %s=%s: '%s' is not a number", d->name,
                        d->value ? d->value : "", d->value ? d->value : "");
    }
}

/* ---------------------------------------------------------------- the end */

static bool decay_match(const AstVec *patterns, const char *name, bool *used)
{
    bool hit = false;
    for (int i = 0; i < patterns->n; i++)
        if (fnmatch(((AstName *)patterns->items[i])->text, name, 0) == 0) {
            hit = true;
            if (used) used[i] = true;
        }
    return hit;
}

/* Weight decay per parameter: the decay clause's globs, else every matrix (rank >= 2) and
 * no vector (biases, norm weights), as in GPT-2's and Llama's training recipes. */
static void finish_decay(Lower *L, int errors_before)
{
    const AstStmt *d = L->decay;
    if (d && !L->optimizer) lower_error(L, d->loc, "'decay' needs an 'optimizer' statement");
    bool check_patterns = diag_error_count() == errors_before;
    bool *used = d ? arena_alloc(L->a, (size_t)(d->items.n + d->except.n) + 1) : NULL;
    for (int i = 0; i < L->g->n_nodes; i++) {
        Node *n = L->g->nodes[i];
        if (n->op != OP_PARAM) continue;
        if (!d) {
            n->iattr[1] = n->t.rank >= 2;
            continue;
        }
        bool in = decay_match(&d->items, n->t.name, used);
        bool out = decay_match(&d->except, n->t.name, used + d->items.n);
        n->iattr[1] = in && !out;
    }
    if (!d || !check_patterns) return;   /* after an error some parameters may be missing */
    for (int i = 0; i < d->items.n + d->except.n; i++)
        if (!used[i]) {
            const AstName *p = i < d->items.n ? d->items.items[i] : d->except.items[i - d->items.n];
            lower_error(L, p->loc, "pattern \"%s\" matches no parameter", p->text);
        }
}

/* Keeps what the loss depends on, and every input (the runtime feeds them all); a parameter
 * that the loss does not read would never train, which is a mistake in the model. */
static void finish_graph(Lower *L)
{
    Graph *g = L->g;
    bool *keep = arena_alloc(L->a, (size_t)g->n_nodes + 1);
    ir_renumber(g);
    keep[L->loss->index] = true;
    for (int i = g->n_nodes - 1; i >= 0; i--) {
        if (!keep[i]) continue;
        for (int j = 0; j < g->nodes[i]->n_in; j++) keep[g->nodes[i]->in[j]->index] = true;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->op == OP_INPUT) keep[i] = true;
        if (n->op == OP_PARAM && !keep[i])
            lower_error(L, n->loc, "parameter '%s' does not affect the loss", n->t.name);
    }
    ir_filter(g, keep);
}

static const char *default_model_name(Lower *L, const char *path)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    const char *dot = strrchr(base, '.');
    size_t len = dot && dot != base ? (size_t)(dot - base) : strlen(base);
    return arena_printf(L->a, "%.*s", (int)len, base);
}

static Graph *lower_program(Arena *a, const char *path, const AstVec *prog, const FrontOptions *o)
{
    static const FrontOptions none = {0};
    Lower L = {.a = a, .o = o ? o : &none, .file = path};
    L.top.scope = "";
    L.g = ir_graph_new(a);
    L.g->batch = L.o->batch;
    L.g->seq = L.o->seq;
    int errors = diag_error_count();

    scan_top(&L, prog);
    exec_stmts(&L, &L.top, prog);

    L.g->model_name = L.model ? L.model->name : default_model_name(&L, path);
    if (!L.loss && diag_error_count() == errors)
        lower_error(&L, (SrcLoc){path, 0, 0}, "the model has no loss: end it with a loss statement, "
                    "e.g. loss cross_entropy(logits, targets)");
    finish_decay(&L, errors);
    if (L.loss && diag_error_count() == errors) finish_graph(&L);
    return diag_error_count() == errors ? L.g : NULL;
}

/* ---------------------------------------------------------------- entry points */

Graph *front_compile_text(Arena *a, const char *path, const char *text, const FrontOptions *o)
{
    path = arena_strdup(a, path);
    diag_register_source(path, text);
    int errors = diag_error_count();
    AstVec prog;
    if (!ast_parse(a, path, text, &prog)) return NULL;
    Graph *g = lower_program(a, path, &prog, o);
    return g && diag_error_count() == errors ? g : NULL;
}

Graph *front_compile_file(Arena *a, const char *path, const FrontOptions *o)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        diag_error((SrcLoc){path, 0, 0}, "cannot open the model: %s", strerror(errno));
        return NULL;
    }
    char *text = NULL;
    size_t size = 0, len = 0;
    for (;;) {
        if (len + 1 >= size) {
            size = size ? 2 * size : 1 << 16;
            char *bigger = realloc(text, size);
            if (!bigger) ir_die(__FILE__, __LINE__, "out of memory");
            text = bigger;
        }
        size_t got = fread(text + len, 1, size - len - 1, f);
        len += got;
        if (got == 0) break;
    }
    bool failed = ferror(f);
    fclose(f);
    text[len] = 0;
    if (failed || strlen(text) != len) {
        diag_error((SrcLoc){path, 0, 0}, failed ? "cannot read the model" : "the model contains a NUL byte");
        free(text);
        return NULL;
    }
    Graph *g = front_compile_text(a, path, text, o);
    free(text);
    return g;
}
