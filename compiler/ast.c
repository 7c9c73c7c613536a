/* ast.c — builders and a printer for the model language's syntax tree.
 *
 * The builders exist so that every grammar action in parser.y is one call: the grammar says
 * what was recognized, the builder says how it is stored. They only allocate and fill; no
 * checking happens here, because the parser must accept anything the grammar allows and the
 * lowering (lower.c) is where names and numbers acquire meaning.
 *
 * ast_print writes a tree back as model text. Parsing what it prints must give the same tree
 * again (tests/test_parser.c checks this on every model), which keeps both sides honest. */
#include "ast.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- lists */

AstVec ast_vec_new(Arena *a)
{
    (void)a;
    return (AstVec){0};
}

AstVec ast_vec_push(Arena *a, AstVec v, void *item)
{
    if (v.n == v.cap) {
        int cap = v.cap ? v.cap * 2 : 4;
        void **items = arena_alloc(a, sizeof(void *) * (size_t)cap);
        if (v.n) memcpy(items, v.items, sizeof(void *) * (size_t)v.n);
        v.items = items;
        v.cap = cap;
    }
    v.items[v.n++] = item;
    return v;
}

AstVec ast_vec_of(Arena *a, void *item) { return ast_vec_push(a, ast_vec_new(a), item); }

/* ---------------------------------------------------------------- expressions */

AstName *ast_name(Arena *a, SrcLoc loc, const char *text)
{
    AstName *n = arena_alloc(a, sizeof *n);
    n->text = text;
    n->loc = loc;
    return n;
}

static AstExpr *expr_new(Arena *a, ExprKind kind, SrcLoc loc)
{
    AstExpr *e = arena_alloc(a, sizeof *e);
    e->kind = kind;
    e->loc = loc;
    return e;
}

AstExpr *ast_int(Arena *a, SrcLoc loc, int64_t v)
{
    AstExpr *e = expr_new(a, EXPR_INT, loc);
    e->ival = v;
    return e;
}

AstExpr *ast_float(Arena *a, SrcLoc loc, double v)
{
    AstExpr *e = expr_new(a, EXPR_FLOAT, loc);
    e->fval = v;
    return e;
}

AstExpr *ast_ref(Arena *a, SrcLoc loc, const char *name)
{
    AstExpr *e = expr_new(a, EXPR_NAME, loc);
    e->name = name;
    return e;
}

AstExpr *ast_binary(Arena *a, SrcLoc loc, char op, AstExpr *lhs, AstExpr *rhs)
{
    AstExpr *e = expr_new(a, EXPR_BINARY, loc);
    e->binop = op;
    e->lhs = lhs;
    e->rhs = rhs;
    return e;
}

AstExpr *ast_neg(Arena *a, SrcLoc loc, AstExpr *x)
{
    AstExpr *e = expr_new(a, EXPR_NEG, loc);
    e->lhs = x;
    return e;
}

AstExpr *ast_call(Arena *a, SrcLoc loc, const char *name, AstVec args)
{
    AstExpr *e = expr_new(a, EXPR_CALL, loc);
    e->name = name;
    e->args = args;
    return e;
}

AstExpr *ast_scoped(AstExpr *call, AstPath *scope)
{
    call->scope = scope;
    return call;
}

AstArg *ast_arg(Arena *a, SrcLoc loc, const char *name, AstExpr *value)
{
    AstArg *g = arena_alloc(a, sizeof *g);
    g->loc = loc;
    g->name = name;
    g->value = value;
    return g;
}

static AstPath *path_push(Arena *a, AstPath *p, SrcLoc loc, const char *name, AstExpr *index)
{
    AstPathPart *part = arena_alloc(a, sizeof *part);
    part->loc = loc;
    part->name = name;
    part->index = index;
    p->parts = ast_vec_push(a, p->parts, part);
    return p;
}

AstPath *ast_path(Arena *a, SrcLoc loc, const char *name)
{
    AstPath *p = arena_alloc(a, sizeof *p);
    p->loc = loc;
    return path_push(a, p, loc, name, NULL);
}

AstPath *ast_path_name(Arena *a, AstPath *p, SrcLoc loc, const char *name)
{
    return path_push(a, p, loc, name, NULL);
}

AstPath *ast_path_index(Arena *a, AstPath *p, SrcLoc loc, AstExpr *index)
{
    return path_push(a, p, loc, NULL, index);
}

AstType *ast_type(Arena *a, SrcLoc loc, const char *elem, SrcLoc elem_loc, AstVec dims)
{
    AstType *t = arena_alloc(a, sizeof *t);
    t->loc = loc;
    t->elem = elem;
    t->elem_loc = elem_loc;
    t->dims = dims;
    return t;
}

AstBinding *ast_binding(Arena *a, SrcLoc loc, const char *name, AstExpr *value)
{
    AstBinding *b = arena_alloc(a, sizeof *b);
    b->loc = loc;
    b->name = name;
    b->value = value;
    return b;
}

/* ---------------------------------------------------------------- statements */

static AstStmt *stmt_new(Arena *a, StmtKind kind, SrcLoc loc)
{
    AstStmt *s = arena_alloc(a, sizeof *s);
    s->kind = kind;
    s->loc = loc;
    return s;
}

AstStmt *ast_model(Arena *a, SrcLoc loc, const char *name)
{
    AstStmt *s = stmt_new(a, STMT_MODEL, loc);
    s->name = name;
    return s;
}

AstStmt *ast_config(Arena *a, SrcLoc loc, AstVec bindings)
{
    AstStmt *s = stmt_new(a, STMT_CONFIG, loc);
    s->items = bindings;
    return s;
}

AstStmt *ast_input(Arena *a, SrcLoc loc, const char *name, AstType *type)
{
    AstStmt *s = stmt_new(a, STMT_INPUT, loc);
    s->name = name;
    s->type = type;
    return s;
}

AstStmt *ast_param(Arena *a, SrcLoc loc, const char *name, AstType *type, AstExpr *init)
{
    AstStmt *s = stmt_new(a, STMT_PARAM, loc);
    s->name = name;
    s->type = type;
    s->value = init;
    return s;
}

AstStmt *ast_block(Arena *a, SrcLoc loc, const char *name, AstVec params, AstVec body)
{
    AstStmt *s = stmt_new(a, STMT_BLOCK, loc);
    s->name = name;
    s->items = params;
    s->body = body;
    return s;
}

AstStmt *ast_assign(Arena *a, AstVec targets, AstExpr *value)
{
    AstStmt *s = stmt_new(a, STMT_ASSIGN, ((AstName *)targets.items[0])->loc);
    s->items = targets;
    s->value = value;
    return s;
}

AstStmt *ast_return(Arena *a, SrcLoc loc, AstVec values)
{
    AstStmt *s = stmt_new(a, STMT_RETURN, loc);
    s->items = values;
    return s;
}

AstStmt *ast_for(Arena *a, SrcLoc loc, const char *var, AstExpr *from, AstExpr *to, AstVec body)
{
    AstStmt *s = stmt_new(a, STMT_FOR, loc);
    s->name = var;
    s->value = from;
    s->value2 = to;
    s->body = body;
    return s;
}

AstStmt *ast_loss(Arena *a, SrcLoc loc, AstExpr *value)
{
    AstStmt *s = stmt_new(a, STMT_LOSS, loc);
    s->value = value;
    return s;
}

AstStmt *ast_optimizer(Arena *a, SrcLoc loc, AstExpr *call)
{
    AstStmt *s = stmt_new(a, STMT_OPTIMIZER, loc);
    s->value = call;
    return s;
}

AstStmt *ast_decay(Arena *a, SrcLoc loc, AstVec patterns, AstVec except)
{
    AstStmt *s = stmt_new(a, STMT_DECAY, loc);
    s->items = patterns;
    s->except = except;
    return s;
}

/* ---------------------------------------------------------------- printing */

/* Binding strength of each operator, for printing the parentheses that the source needed
 * (and no others). */
static int expr_prec(const AstExpr *e)
{
    if (e->kind == EXPR_BINARY) return e->binop == '+' || e->binop == '-' ? 1 : 2;
    if (e->kind == EXPR_NEG) return 3;
    return 4;
}

static void print_expr(const AstExpr *e, FILE *out);

static void print_sub(const AstExpr *e, int min_prec, FILE *out)
{
    bool paren = expr_prec(e) < min_prec;
    if (paren) fputc('(', out);
    print_expr(e, out);
    if (paren) fputc(')', out);
}

static void print_path(const AstPath *p, FILE *out)
{
    for (int i = 0; i < p->parts.n; i++) {
        const AstPathPart *part = p->parts.items[i];
        if (part->name) {
            fprintf(out, "%s%s", i ? "." : "", part->name);
        } else {
            fputc('[', out);
            print_expr(part->index, out);
            fputc(']', out);
        }
    }
}

static void print_expr(const AstExpr *e, FILE *out)
{
    switch (e->kind) {
    case EXPR_INT:
        fprintf(out, "%lld", (long long)e->ival);
        break;
    case EXPR_FLOAT: {
        /* the shortest of %.15g and %.17g that reads back as the same double, and still
         * reads back as a float rather than an integer */
        char buf[40];
        snprintf(buf, sizeof buf, "%.15g", e->fval);
        if (strtod(buf, NULL) != e->fval) snprintf(buf, sizeof buf, "%.17g", e->fval);
        if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
        fputs(buf, out);
        break;
    }
    case EXPR_NAME:
        fputs(e->name, out);
        break;
    case EXPR_BINARY: {
        int p = expr_prec(e);
        print_sub(e->lhs, p, out);
        fprintf(out, " %c ", e->binop);
        print_sub(e->rhs, p + 1, out);   /* left associative: a - (b - c) keeps its parens */
        break;
    }
    case EXPR_NEG:
        fputc('-', out);
        print_sub(e->lhs, 3, out);
        break;
    case EXPR_CALL:
        fprintf(out, "%s(", e->name);
        for (int i = 0; i < e->args.n; i++) {
            const AstArg *g = e->args.items[i];
            if (i) fputs(", ", out);
            if (g->name) fprintf(out, "%s=", g->name);
            print_expr(g->value, out);
        }
        fputc(')', out);
        if (e->scope) {
            fputs(" as ", out);
            print_path(e->scope, out);
        }
        break;
    }
}

static void print_names(const AstVec *v, const char *quote, FILE *out)
{
    for (int i = 0; i < v->n; i++)
        fprintf(out, "%s%s%s%s", i ? ", " : "", quote, ((AstName *)v->items[i])->text, quote);
}

static void print_exprs(const AstVec *v, FILE *out)
{
    for (int i = 0; i < v->n; i++) {
        if (i) fputs(", ", out);
        print_expr(v->items[i], out);
    }
}

static void print_type(const AstType *t, FILE *out)
{
    fprintf(out, "%s[", t->elem ? t->elem : "");
    print_exprs(&t->dims, out);
    fputc(']', out);
}

static void print_stmts(const AstVec *v, int depth, FILE *out);

static void print_stmt(const AstStmt *s, int depth, FILE *out)
{
    fprintf(out, "%*s", 4 * depth, "");
    switch (s->kind) {
    case STMT_MODEL:
        fprintf(out, "model %s", s->name);
        break;
    case STMT_CONFIG:
        fputs("config ", out);
        for (int i = 0; i < s->items.n; i++) {
            const AstBinding *b = s->items.items[i];
            fprintf(out, "%s%s = ", i ? ", " : "", b->name);
            print_expr(b->value, out);
        }
        break;
    case STMT_INPUT:
        fprintf(out, "input %s: ", s->name);
        print_type(s->type, out);
        break;
    case STMT_PARAM:
        fprintf(out, "param %s: ", s->name);
        print_type(s->type, out);
        fputs(" = ", out);
        print_expr(s->value, out);
        break;
    case STMT_BLOCK:
        fprintf(out, "block %s(", s->name);
        print_names(&s->items, "", out);
        fputs(") {\n", out);
        print_stmts(&s->body, depth + 1, out);
        fprintf(out, "%*s}", 4 * depth, "");
        break;
    case STMT_ASSIGN:
        print_names(&s->items, "", out);
        fputs(" = ", out);
        print_expr(s->value, out);
        break;
    case STMT_RETURN:
        fputs("return ", out);
        print_exprs(&s->items, out);
        break;
    case STMT_FOR:
        fprintf(out, "for %s in ", s->name);
        print_expr(s->value, out);
        fputs("..", out);
        print_expr(s->value2, out);
        fputs(" {\n", out);
        print_stmts(&s->body, depth + 1, out);
        fprintf(out, "%*s}", 4 * depth, "");
        break;
    case STMT_LOSS:
        fputs("loss ", out);
        print_expr(s->value, out);
        break;
    case STMT_OPTIMIZER:
        fputs("optimizer ", out);
        print_expr(s->value, out);
        break;
    case STMT_DECAY:
        fputs("decay ", out);
        print_names(&s->items, "\"", out);
        if (s->except.n) {
            fputs(" except ", out);
            print_names(&s->except, "\"", out);
        }
        break;
    }
    fputc('\n', out);
}

static void print_stmts(const AstVec *v, int depth, FILE *out)
{
    for (int i = 0; i < v->n; i++) print_stmt(v->items[i], depth, out);
}

void ast_print(const AstVec *program, FILE *out) { print_stmts(program, 0, out); }
