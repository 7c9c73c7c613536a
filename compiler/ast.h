/* ast.h — the syntax tree of the model language, between the parser and the lowering.
 *
 * The tree is deliberately thin: it records what was written and where, and nothing that
 * needs evaluation. Whether a name is a config constant, a block or a tensor, what a shape
 * works out to, which parameter a path names: all of that is the lowering's business
 * (lower.c), because it depends on -D overrides, --batch/--seq and on which block call the
 * statement runs in. Keeping the parser free of meaning lets it recover from a syntax error
 * and keep going without half-built semantic state.
 *
 * Every node lives in the compilation's Arena, like the IR built from it; nothing here is
 * freed on its own. Lists are AstVec: a growable array of pointers, also in the arena. */
#ifndef FP8C_AST_H
#define FP8C_AST_H

#include "ir.h"

typedef struct {
    void **items;
    int n, cap;
} AstVec;

/* A name as written, with its place (block parameters, assignment targets, decay patterns). */
typedef struct {
    const char *text;
    SrcLoc loc;
} AstName;

typedef struct AstExpr AstExpr;
typedef struct AstPath AstPath;

typedef enum {
    EXPR_INT,       /* ival */
    EXPR_FLOAT,     /* fval */
    EXPR_NAME,      /* name: a variable, config constant, param, input, B or T; may be dotted */
    EXPR_BINARY,    /* binop ('+' '-' '*' '/' '%'), lhs, rhs; loc is the operator's */
    EXPR_NEG,       /* lhs */
    EXPR_CALL,      /* name, args (AstArg*), scope: the `as PATH` of a block call or NULL */
} ExprKind;

struct AstExpr {
    ExprKind kind;
    SrcLoc loc;
    int64_t ival;
    double fval;
    const char *name;
    char binop;
    AstExpr *lhs, *rhs;
    AstVec args;
    AstPath *scope;
};

/* One argument of a call: positional (name NULL) or keyword (`eps=1e-5`). */
typedef struct {
    const char *name;
    AstExpr *value;
    SrcLoc loc;
} AstArg;

/* A parameter scope path, `h[i].attn`: each part is a name (possibly dotted) or an index
 * expression that the lowering evaluates to an integer ("h.3.attn"). */
typedef struct {
    const char *name;   /* NULL for an index part */
    AstExpr *index;
    SrcLoc loc;
} AstPathPart;

struct AstPath {
    AstVec parts;       /* AstPathPart* */
    SrcLoc loc;
};

/* `f32[B, T]` or `[vocab, dim]`: an optional element type and a list of dim expressions. */
typedef struct {
    const char *elem;   /* NULL when not written */
    SrcLoc elem_loc;
    AstVec dims;        /* AstExpr* */
    SrcLoc loc;
} AstType;

/* `name = expr` in a config statement. */
typedef struct {
    const char *name;
    AstExpr *value;
    SrcLoc loc;
} AstBinding;

typedef enum {
    STMT_MODEL,         /* name */
    STMT_CONFIG,        /* items: AstBinding* */
    STMT_INPUT,         /* name, type */
    STMT_PARAM,         /* name, type, value: the init (zeros | ones | normal(std)) */
    STMT_BLOCK,         /* name, items: AstName* (parameters), body */
    STMT_ASSIGN,        /* items: AstName* (targets), value */
    STMT_RETURN,        /* items: AstExpr* */
    STMT_FOR,           /* name (loop variable), value (from), value2 (to, exclusive), body */
    STMT_LOSS,          /* value */
    STMT_OPTIMIZER,     /* value: a call, adamw(lr=...) */
    STMT_DECAY,         /* items: AstName* (patterns), except: AstName* */
} StmtKind;

typedef struct {
    StmtKind kind;
    SrcLoc loc;         /* the name where the statement declares one (model, input, param,
                         * block, for), the value of loss and optimizer, the first target of an
                         * assignment, else the keyword */
    const char *name;
    AstType *type;
    AstExpr *value, *value2;
    AstVec items;
    AstVec except;
    AstVec body;        /* AstStmt* */
} AstStmt;

/* ---------------------------------------------------------------- ast.c: builders
 * One builder per grammar construct, so that every parser action is a single call. */

AstVec ast_vec_new(Arena *a);
AstVec ast_vec_of(Arena *a, void *item);
AstVec ast_vec_push(Arena *a, AstVec v, void *item);

AstName *ast_name(Arena *a, SrcLoc loc, const char *text);
AstExpr *ast_int(Arena *a, SrcLoc loc, int64_t v);
AstExpr *ast_float(Arena *a, SrcLoc loc, double v);
AstExpr *ast_ref(Arena *a, SrcLoc loc, const char *name);
AstExpr *ast_binary(Arena *a, SrcLoc loc, char op, AstExpr *lhs, AstExpr *rhs);
AstExpr *ast_neg(Arena *a, SrcLoc loc, AstExpr *x);
AstExpr *ast_call(Arena *a, SrcLoc loc, const char *name, AstVec args);
AstExpr *ast_scoped(AstExpr *call, AstPath *scope);
AstArg *ast_arg(Arena *a, SrcLoc loc, const char *name, AstExpr *value);
AstPath *ast_path(Arena *a, SrcLoc loc, const char *name);
AstPath *ast_path_name(Arena *a, AstPath *p, SrcLoc loc, const char *name);
AstPath *ast_path_index(Arena *a, AstPath *p, SrcLoc loc, AstExpr *index);
AstType *ast_type(Arena *a, SrcLoc loc, const char *elem, SrcLoc elem_loc, AstVec dims);
AstBinding *ast_binding(Arena *a, SrcLoc loc, const char *name, AstExpr *value);

AstStmt *ast_model(Arena *a, SrcLoc loc, const char *name);
AstStmt *ast_config(Arena *a, SrcLoc loc, AstVec bindings);
AstStmt *ast_input(Arena *a, SrcLoc loc, const char *name, AstType *type);
AstStmt *ast_param(Arena *a, SrcLoc loc, const char *name, AstType *type, AstExpr *init);
AstStmt *ast_block(Arena *a, SrcLoc loc, const char *name, AstVec params, AstVec body);
AstStmt *ast_assign(Arena *a, AstVec targets, AstExpr *value);
AstStmt *ast_return(Arena *a, SrcLoc loc, AstVec values);
AstStmt *ast_for(Arena *a, SrcLoc loc, const char *var, AstExpr *from, AstExpr *to, AstVec body);
AstStmt *ast_loss(Arena *a, SrcLoc loc, AstExpr *value);
AstStmt *ast_optimizer(Arena *a, SrcLoc loc, AstExpr *call);
AstStmt *ast_decay(Arena *a, SrcLoc loc, AstVec patterns, AstVec except);

/* Writes the tree back as model text (normalized spacing); for tests and debugging. */
void ast_print(const AstVec *program, FILE *out);

/* ---------------------------------------------------------------- parser.y */

/* Parses model text into a list of statements (AstStmt*). Syntax errors are reported through
 * diag_error, several per file where recovery allows; returns false if there were any. */
bool ast_parse(Arena *a, const char *file, const char *text, AstVec *program);

#endif
