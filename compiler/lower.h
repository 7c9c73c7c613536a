/* lower.h — what the files of the lowering share; not part of compiler.h's interface.
 *
 * The model language is a program that the compiler runs once to build the forward graph
 * (lower.c's essay says why). Its files import one way, each calling only those below it:
 *   lower_program.c  a program as a whole: the scan before it runs, the end after it, and the
 *                    entry points front_compile_text and front_compile_file;
 *   lower.c          the interpreter: names, expressions, block and builtin calls, statements,
 *                    configs;
 *   builtins.c       the builtin library (linear, attention, split, ...): functions that build
 *                    nodes from arguments the interpreter has evaluated and checked;
 *   lower_values.c   values, errors reported once per place, "did you mean", and the nodes and
 *                    the arithmetic on values that the interpreter and the builtins share. */
#ifndef FP8C_LOWER_H
#define FP8C_LOWER_H

#include "compiler.h"

#include "ast.h"

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

static inline Value val_error(void) { return (Value){.kind = VAL_ERROR}; }
static inline Value val_int(int64_t i) { return (Value){.kind = VAL_INT, .i = i}; }
static inline Value val_float(double f) { return (Value){.kind = VAL_FLOAT, .f = f}; }
static inline Value val_tensor(Node *n) { return (Value){.kind = VAL_TENSOR, .node = n}; }
static inline bool val_is_num(Value v) { return v.kind == VAL_INT || v.kind == VAL_FLOAT; }
static inline double val_num(Value v) { return v.kind == VAL_INT ? (double)v.i : v.f; }

/* ---------------------------------------------------------------- names */

typedef enum { BIND_VAR, BIND_CONFIG, BIND_INPUT, BIND_PARAM, BIND_LOOP } BindKind;

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

/* ---------------------------------------------------------------- lower_values.c */

extern const SrcLoc lower_command_line;         /* where -D errors are reported */
/* Reports an error unless one was reported at the same place before (a block body runs once
 * per call; its mistakes are the same each time). Returns whether it printed. */
bool lower_error(Lower *L, SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
bool lower_same_loc(SrcLoc a, SrcLoc b);
const char *lower_shape_text(Lower *L, const Tensor *t);
const char *lower_val_text(Lower *L, Value v);  /* "the integer 3", "a tensor f32[2, 4]" */
/* "did you mean": the closest candidate within an edit distance of 1 (short names) or 2 */
typedef struct {
    const char *want, *best;
    int best_d;
} Suggest;
void lower_suggest_try(Suggest *s, const char *cand);
const char *lower_suggest_text(Lower *L, const Suggest *s);   /* " (did you mean 'x'?)" or "" */
/* Nodes of the forward graph: lower_node_new adds one, lower_node_done infers its shape once
 * its inputs and attributes are set and reports what is wrong at its place. */
Node *lower_node_new(Lower *L, OpKind op, SrcLoc loc, int n_in, Node **in);
Value lower_node_done(Lower *L, Node *n);
Value lower_node_unary(Lower *L, OpKind op, SrcLoc loc, Node *x);
Value lower_node_binary(Lower *L, OpKind op, SrcLoc loc, Node *x, Node *y);
Value lower_node_scale(Lower *L, SrcLoc loc, Node *x, double alpha);
Node *lower_node_const(Lower *L, SrcLoc loc, double value);
/* a op b for op in + - * / %: on two numbers, or on tensors (and a number) as nodes */
Value lower_arith_numbers(Lower *L, SrcLoc loc, char op, Value a, Value b);
Value lower_arith_tensors(Lower *L, SrcLoc loc, char op, Value a, Value b);
bool lower_not_a_tuple(Lower *L, SrcLoc loc, Value v);   /* false (reported) for a tuple */
bool lower_parse_number(const char *s, Value *out);      /* a -D value */

/* ---------------------------------------------------------------- builtins.c */

const Builtin *builtin_find(const char *name);           /* NULL: no builtin of that name */
void builtin_suggest(Suggest *s);                        /* tries every builtin's name */
/* Checks that v suits a parameter of kind k (numbers become doubles for ARG_NUM). */
bool builtin_arg_fits(Lower *L, const Builtin *b, const char *pname, ArgKind k, Value *v, SrcLoc loc);

/* ---------------------------------------------------------------- lower.c */

const AstStmt *lower_find_block(const Lower *L, const char *name);
/* Runs statements in frame f until one of them returns. */
void lower_exec_stmts(Lower *L, Frame *f, const AstVec *body);

#endif
