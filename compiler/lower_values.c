/* lower_values.c — what the lowering's values are made of: errors, suggestions, nodes, and
 * arithmetic.
 *
 * Running a model file produces values: numbers, tensors (nodes of the forward graph) and
 * tuples. The interpreter (lower.c) and the builtin library (builtins.c) both make nodes and
 * report errors, so those live here, below both: a node is added, its inputs and attributes
 * set, and lower_node_done asks ir_infer_shape about it, reporting a bad shape at its place.
 *
 * Errors are reported once per place in the file: a block body runs once per call (48 times in
 * GPT-2 XL), and its mistakes are the same each time. A failed expression evaluates to an error
 * value that later expressions pass on silently, so one mistake is reported once, not in every
 * line after it. Unknown names get a "did you mean" from the names in scope.
 *
 * Arithmetic: integers stay integers where the result is exact (dim / heads is a size) and
 * overflow is an error; a tensor and a number make SCALE or ADD of a constant; two tensors
 * add, subtract and multiply elementwise with broadcasting. */
#include "lower.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

const SrcLoc lower_command_line = {"<command line>", 0, 0};

/* ---------------------------------------------------------------- errors */

bool lower_same_loc(SrcLoc a, SrcLoc b)
{
    return a.line == b.line && a.col == b.col && a.file == b.file;
}

bool lower_error(Lower *L, SrcLoc loc, const char *fmt, ...)
{
    if (loc.line > 0) {
        for (int i = 0; i < L->n_reported; i++)
            if (lower_same_loc(L->reported[i], loc)) return false;
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

const char *lower_shape_text(Lower *L, const Tensor *t) { return ir_shape_text(L->a, t); }

/* What a value is, for "must be a tensor, not ..." */
const char *lower_val_text(Lower *L, Value v)
{
    switch (v.kind) {
    case VAL_INT: return arena_printf(L->a, "the integer %lld", (long long)v.i);
    case VAL_FLOAT: return arena_printf(L->a, "the number %g", v.f);
    case VAL_TENSOR: return arena_printf(L->a, "a tensor %s", lower_shape_text(L, &v.node->t));
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

void lower_suggest_try(Suggest *s, const char *cand)
{
    if (!cand || !strcmp(cand, s->want)) return;
    int d = edit_distance(s->want, cand);
    int limit = strlen(s->want) <= 4 ? 1 : 2;
    if (d <= limit && d < s->best_d) {
        s->best_d = d;
        s->best = cand;
    }
}

const char *lower_suggest_text(Lower *L, const Suggest *s)
{
    return s->best ? arena_printf(L->a, " (did you mean '%s'?)", s->best) : "";
}

/* ---------------------------------------------------------------- nodes */

Node *lower_node_new(Lower *L, OpKind op, SrcLoc loc, int n_in, Node **in)
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
Value lower_node_done(Lower *L, Node *n)
{
    for (int i = 0; i < n->n_in; i++) {
        const Tensor *t = &n->in[i]->t;
        if (!fmt_elem_is_float(t->fmt.elem) && !int_input_allowed(n, i)) {
            lower_error(L, n->loc, "%s reads %s: integer tensors hold token ids, which only "
                        "embedding and cross_entropy take", ir_op_info(n->op)->text, lower_shape_text(L, t));
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

Value lower_node_unary(Lower *L, OpKind op, SrcLoc loc, Node *x)
{
    return lower_node_done(L, lower_node_new(L, op, loc, 1, &x));
}

Value lower_node_binary(Lower *L, OpKind op, SrcLoc loc, Node *x, Node *y)
{
    Node *in[2] = {x, y};
    return lower_node_done(L, lower_node_new(L, op, loc, 2, in));
}

Value lower_node_scale(Lower *L, SrcLoc loc, Node *x, double alpha)
{
    Node *n = lower_node_new(L, OP_SCALE, loc, 1, &x);
    IR_FATTR(n, SCALE, alpha) = alpha;
    return lower_node_done(L, n);
}

/* A scalar constant, broadcast by ADD onto any tensor. */
Node *lower_node_const(Lower *L, SrcLoc loc, double value)
{
    Node *n = ir_leaf(L->g, OP_CONST, NULL, ROLE_ACTIVATION, FMT_F32, 0, NULL, loc);
    n->phase = PHASE_FORWARD;
    IR_FATTR(n, CONST, value) = value;
    return n;
}

/* ---------------------------------------------------------------- arithmetic on values */

Value lower_arith_numbers(Lower *L, SrcLoc loc, char op, Value a, Value b)
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

Value lower_arith_tensors(Lower *L, SrcLoc loc, char op, Value a, Value b)
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
            return lower_node_binary(L, op == '+' ? OP_ADD : OP_MUL, loc, x, y);
        }
        if (op == '-') return lower_node_binary(L, OP_SUB, loc, x, y);
        lower_error(L, loc, "cannot %s tensors %s and %s: tensors are added, subtracted and "
                    "multiplied elementwise", op_verb(op), lower_shape_text(L, &x->t), lower_shape_text(L, &y->t));
        return val_error();
    }
    bool t_first = a.kind == VAL_TENSOR;
    Node *t = t_first ? a.node : b.node;
    double s = val_num(t_first ? b : a);
    switch (op) {
    case '*':
        return lower_node_scale(L, loc, t, s);
    case '/':
        if (t_first && s != 0) return lower_node_scale(L, loc, t, 1.0 / s);
        if (t_first) {
            lower_error(L, loc, "division by zero");
            return val_error();
        }
        break;
    case '+':
        return lower_node_binary(L, OP_ADD, loc, t, lower_node_const(L, loc, s));
    case '-':
        if (t_first) return lower_node_binary(L, OP_ADD, loc, t, lower_node_const(L, loc, -s));
        Value neg = lower_node_scale(L, loc, t, -1.0);
        if (neg.kind != VAL_TENSOR) return neg;
        return lower_node_binary(L, OP_ADD, loc, neg.node, lower_node_const(L, loc, s));
    }
    lower_error(L, loc, "cannot %s %s and %s", op_verb(op), lower_val_text(L, a), lower_val_text(L, b));
    return val_error();
}

bool lower_not_a_tuple(Lower *L, SrcLoc loc, Value v)
{
    if (v.kind != VAL_TUPLE) return true;
    lower_error(L, loc, "this gives %d values; assign them to %d names first", v.n_items, v.n_items);
    return false;
}

/* A -D value: an integer or a real number, the whole string. */
bool lower_parse_number(const char *s, Value *out)
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
