/* builtins.c — the model language's library: linear, matmul, the norms, activations,
 * embedding, attention, rope, slice and split, cross_entropy, sqrt.
 *
 * A builtin is a row of `builtins[]`: its name, the function that builds its nodes, a usage
 * line for errors, and its parameters (tensor, integer or number; required, with a default, or
 * optional). The interpreter (lower.c) binds a call's positional and keyword arguments to those
 * parameters, evaluates them and checks their kinds (builtin_arg_fits) before the function
 * runs, so a function here sees arguments of the right kinds and only checks what is its own
 * business (a flag that must be 0 or 1, heads that must divide the width). Functions build
 * nodes with lower_values.c and never call back into the interpreter: a builtin is a graph
 * fragment, not a program.
 *
 * Adding one: a function b_NAME, its row in builtins[], and its line in docs/language.md's
 * table of builtins (docs/contributing.md has the whole checklist). */
#include "lower.h"

#include <math.h>
#include <string.h>

static Value b_linear(Lower *L, const AstExpr *c, const Args *a)
{
    Node *in[2] = {a->v[0].node, a->v[1].node};
    Node *mm = lower_node_new(L, OP_MATMUL, c->loc, 2, in);
    IR_IATTR(mm, MATMUL, trans_b) = 1;      /* nn.Linear: weight is (out, in) */
    Value y = lower_node_done(L, mm);
    if (y.kind != VAL_TENSOR || a->v[2].kind == VAL_NONE) return y;
    return lower_node_binary(L, OP_ADD, c->loc, y.node, a->v[2].node);
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
    Node *n = lower_node_new(L, OP_MATMUL, c->loc, 2, in);
    IR_IATTR(n, MATMUL, trans_a) = a->v[2].i;
    IR_IATTR(n, MATMUL, trans_b) = a->v[3].i;
    return lower_node_done(L, n);
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
    Node *n = lower_node_new(L, OP_LAYERNORM, c->loc, 3, in);
    IR_FATTR(n, LAYERNORM, eps) = a->v[3].f;
    return lower_node_done(L, n);
}

static Value b_rmsnorm(Lower *L, const AstExpr *c, const Args *a)
{
    if (!is_positive(L, a, 2, "eps")) return val_error();
    Node *in[2] = {a->v[0].node, a->v[1].node};
    Node *n = lower_node_new(L, OP_RMSNORM, c->loc, 2, in);
    IR_FATTR(n, RMSNORM, eps) = a->v[2].f;
    return lower_node_done(L, n);
}

static Value b_gelu(Lower *L, const AstExpr *c, const Args *a)
{
    return lower_node_unary(L, OP_GELU, c->loc, a->v[0].node);
}

static Value b_silu(Lower *L, const AstExpr *c, const Args *a)
{
    return lower_node_unary(L, OP_SILU, c->loc, a->v[0].node);
}

static Value b_softmax(Lower *L, const AstExpr *c, const Args *a)
{
    return lower_node_unary(L, OP_SOFTMAX, c->loc, a->v[0].node);
}

static Value b_embedding(Lower *L, const AstExpr *c, const Args *a)
{
    return lower_node_binary(L, OP_EMBEDDING, c->loc, a->v[0].node, a->v[1].node);
}

static Value b_cross_entropy(Lower *L, const AstExpr *c, const Args *a)
{
    return lower_node_binary(L, OP_CROSS_ENTROPY, c->loc, a->v[0].node, a->v[1].node);
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
    Node *n = lower_node_new(L, OP_ATTENTION, c->loc, 3, in);
    IR_IATTR(n, ATTENTION, heads) = heads;
    IR_IATTR(n, ATTENTION, kv_heads) = kv_heads;
    Value y = lower_node_done(L, n);
    if (y.kind != VAL_TENSOR) return y;
    if (a->v[5].kind == VAL_NONE) {
        int64_t head_dim = n->in[0]->t.dims[2] / heads;
        IR_FATTR(n, ATTENTION, scale) = 1.0 / sqrt((double)head_dim);
    } else {
        IR_FATTR(n, ATTENTION, scale) = a->v[5].f;
    }
    return y;
}

static Value b_rope(Lower *L, const AstExpr *c, const Args *a)
{
    if (!is_positive(L, a, 2, "theta")) return val_error();
    Node *n = lower_node_new(L, OP_ROPE, c->loc, 1, (Node *[]){a->v[0].node});
    IR_IATTR(n, ROPE, head_dim) = a->v[1].i;
    IR_IATTR(n, ROPE, inverse) = 0;
    IR_FATTR(n, ROPE, theta) = a->v[2].f;
    return lower_node_done(L, n);
}

static Value slice_node(Lower *L, SrcLoc loc, Node *x, int64_t axis, int64_t start, int64_t size)
{
    Node *n = lower_node_new(L, OP_SLICE, loc, 1, &x);
    IR_IATTR(n, SLICE, axis) = axis;
    IR_IATTR(n, SLICE, start) = start;
    IR_IATTR(n, SLICE, size) = size;
    return lower_node_done(L, n);
}

static Value b_slice(Lower *L, const AstExpr *c, const Args *a)
{
    Node *x = a->v[0].node;
    int64_t axis = a->v[1].i;
    if (axis < 0) axis += x->t.rank;    /* -1: the last axis */
    if (axis < 0 || axis >= x->t.rank) {
        lower_error(L, a->loc[1], "axis %lld is out of range for %s", (long long)a->v[1].i,
                    lower_shape_text(L, &x->t));
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
                        (long long)width, lower_shape_text(L, &x->t), (long long)parts);
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
                        text, (long long)sum, (long long)width, lower_shape_text(L, &x->t));
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

void builtin_suggest(Suggest *s)
{
    for (size_t i = 0; i < sizeof builtins / sizeof builtins[0]; i++) lower_suggest_try(s, builtins[i].name);
}

const Builtin *builtin_find(const char *name)
{
    for (size_t i = 0; i < sizeof builtins / sizeof builtins[0]; i++)
        if (!strcmp(builtins[i].name, name)) return &builtins[i];
    return NULL;
}

bool builtin_arg_fits(Lower *L, const Builtin *b, const char *pname, ArgKind k, Value *v, SrcLoc loc)
{
    if (v->kind == VAL_ERROR) return false;
    if (v->kind == VAL_TUPLE) return lower_not_a_tuple(L, loc, *v);
    switch (k) {
    case ARG_TENSOR:
        if (v->kind == VAL_TENSOR) return true;
        lower_error(L, loc, "argument '%s' of %s must be a tensor, not %s", pname, b->name, lower_val_text(L, *v));
        return false;
    case ARG_INT:
        if (v->kind == VAL_INT) return true;
        lower_error(L, loc, "argument '%s' of %s must be an integer, not %s", pname, b->name, lower_val_text(L, *v));
        return false;
    case ARG_NUM:
        if (val_is_num(*v)) {
            *v = val_float(val_num(*v));
            return true;
        }
        lower_error(L, loc, "argument '%s' of %s must be a number, not %s", pname, b->name, lower_val_text(L, *v));
        return false;
    }
    return false;
}
