/* parser.y — the grammar of the model language (docs/language.md is its prose twin).
 *
 * A pure (reentrant) LALR(1) parser with locations. Each action is one call to an AST
 * builder (ast.c): the grammar only recognizes, it never evaluates, so that the same tree
 * can be lowered with different -D, --batch and --seq and so that error recovery has no
 * half-built meaning to undo.
 *
 * Error recovery is per statement: a statement with a syntax error is skipped up to the end
 * of its line and parsing goes on, so one run reports the syntax errors of every line (the
 * lowering does not run after a syntax error: its errors would mostly be echoes).
 *
 * Syntax errors are worded here (parse.error custom) rather than by bison's default, so that
 * they name the token that was found ("unexpected name 'dimm'") in the words of this
 * language, and stay quiet about tokens the scanner already complained of.
 *
 * No %destructor: every semantic value (names, strings, AST nodes and lists) lives in the
 * compilation's Arena and is freed with it, so a value dropped during recovery owns nothing.
 * A destructor would be an empty function that suggests otherwise. */

%require "3.8"
%define api.pure full
%define api.prefix {model_yy}
%define parse.error custom
%define parse.trace
%locations
%expect 0

%param {yyscan_t scanner}
%parse-param {ParseCtx *ctx}

%code requires {
#include "ast.h"

#ifndef YY_TYPEDEF_YY_SCANNER_T
#define YY_TYPEDEF_YY_SCANNER_T
typedef void *yyscan_t;
#endif

/* Shared by the scanner (as yyextra) and the parser. */
typedef struct {
    Arena *arena;
    const char *file;
    int line, col;          /* where the next token starts */
    int last_eol_col;       /* the column of the last newline: where the line before ended */
    int nesting;            /* open ( and [: newlines inside them are white space */
    bool at_line_start;     /* the last token was a NEWLINE (or there was none yet) */
    SrcLoc braces[32];      /* where the open { are, innermost last, for "never closed" */
    int n_braces;
    AstVec program;
} ParseCtx;
}

%code {
#define YYSTYPE MODEL_YYSTYPE
#define YYLTYPE MODEL_YYLTYPE
#include "lexer.h"

#include <stdlib.h>
#include <string.h>

static void model_yyerror(const YYLTYPE *loc, yyscan_t scanner, ParseCtx *ctx, const char *msg);

#define A (ctx->arena)
#define LOC(l) ((SrcLoc){ctx->file, (l).first_line, (l).first_column})
}

%union {
    const char *str;
    int64_t ival;
    double fval;
    AstVec vec;
    AstExpr *expr;
    AstStmt *stmt;
    AstType *type;
    AstPath *path;
    AstArg *arg;
    AstBinding *binding;
}

%printer { fprintf(yyo, "'%s'", $$); } <str>
%printer { fprintf(yyo, "%lld", (long long)$$); } <ival>
%printer { fprintf(yyo, "%g", $$); } <fval>

%token <str>  NAME     "name"
%token <str>  STRING   "string"
%token <ival> INT      "integer"
%token <fval> FLOAT    "number"
%token NEWLINE         "end of line"

%token MODEL "model" CONFIG "config" INPUT "input" PARAM "param" BLOCK "block"
       RETURN "return" FOR "for" IN "in" LOSS "loss" OPTIMIZER "optimizer"
       DECAY "decay" EXCEPT "except" AS "as"

%token LPAREN "(" RPAREN ")" LBRACKET "[" RBRACKET "]" LBRACE "{" RBRACE "}"
       COMMA "," COLON ":" ASSIGN "=" DOTDOT ".." DOT "."
       PLUS "+" MINUS "-" STAR "*" SLASH "/" PERCENT "%"

%nterm <vec> stmts config_items params_opt names targets exprs args_opt args dims_opt dims
             patterns except_opt
%nterm <stmt> stmt
%nterm <expr> expr call
%nterm <type> type
%nterm <path> path
%nterm <arg> arg
%nterm <binding> config_item

%left "+" "-"
%left "*" "/" "%"
%precedence NEG

%%

program:
    stmts                               { ctx->program = $1; }
;

/* Statements, one per line; blank lines are empty statements. */
stmts:
    %empty                              { $$ = ast_vec_new(A); }
|   stmts NEWLINE
|   stmts stmt NEWLINE                  { $$ = ast_vec_push(A, $1, $2); }
|   stmts error NEWLINE                 { $$ = $1; yyerrok; }
;

stmt:
    "model" NAME                        { $$ = ast_model(A, LOC(@2), $2); }
|   "config" config_items               { $$ = ast_config(A, LOC(@1), $2); }
|   "input" NAME ":" type               { $$ = ast_input(A, LOC(@2), $2, $4); }
|   "param" NAME ":" type "=" expr      { $$ = ast_param(A, LOC(@2), $2, $4, $6); }
|   "block" NAME "(" params_opt ")" "{" stmts "}"
                                        { $$ = ast_block(A, LOC(@2), $2, $4, $7); }
|   targets "=" expr                    { $$ = ast_assign(A, $1, $3); }
|   "return" exprs                      { $$ = ast_return(A, LOC(@1), $2); }
|   "for" NAME "in" expr ".." expr "{" stmts "}"
                                        { $$ = ast_for(A, LOC(@2), $2, $4, $6, $8); }
|   "loss" expr                         { $$ = ast_loss(A, LOC(@2), $2); }
|   "optimizer" call                    { $$ = ast_optimizer(A, LOC(@2), $2); }
|   "decay" patterns except_opt         { $$ = ast_decay(A, LOC(@1), $2, $3); }
;

config_items:
    config_item                         { $$ = ast_vec_of(A, $1); }
|   config_items "," config_item        { $$ = ast_vec_push(A, $1, $3); }
;

config_item:
    NAME "=" expr                       { $$ = ast_binding(A, LOC(@1), $1, $3); }
;

params_opt:
    %empty                              { $$ = ast_vec_new(A); }
|   names
;

names:
    NAME                                { $$ = ast_vec_of(A, ast_name(A, LOC(@1), $1)); }
|   names "," NAME                      { $$ = ast_vec_push(A, $1, ast_name(A, LOC(@3), $3)); }
;

targets:
    names
;

exprs:
    expr                                { $$ = ast_vec_of(A, $1); }
|   exprs "," expr                      { $$ = ast_vec_push(A, $1, $3); }
;

/* `f32[B, T]`, `[vocab, dim]`, `[]` (a scalar) */
type:
    "[" dims_opt "]"                    { $$ = ast_type(A, LOC(@1), NULL, LOC(@1), $2); }
|   NAME "[" dims_opt "]"               { $$ = ast_type(A, LOC(@1), $1, LOC(@1), $3); }
;

dims_opt:
    %empty                              { $$ = ast_vec_new(A); }
|   dims
;

dims:
    expr                                { $$ = ast_vec_of(A, $1); }
|   dims "," expr                       { $$ = ast_vec_push(A, $1, $3); }
;

patterns:
    STRING                              { $$ = ast_vec_of(A, ast_name(A, LOC(@1), $1)); }
|   patterns "," STRING                 { $$ = ast_vec_push(A, $1, ast_name(A, LOC(@3), $3)); }
;

except_opt:
    %empty                              { $$ = ast_vec_new(A); }
|   "except" patterns                   { $$ = $2; }
;

expr:
    INT                                 { $$ = ast_int(A, LOC(@1), $1); }
|   FLOAT                               { $$ = ast_float(A, LOC(@1), $1); }
|   NAME                                { $$ = ast_ref(A, LOC(@1), $1); }
|   "(" expr ")"                        { $$ = $2; }
|   call
|   call "as" path                      { $$ = ast_scoped($1, $3); }
|   expr "+" expr                       { $$ = ast_binary(A, LOC(@2), '+', $1, $3); }
|   expr "-" expr                       { $$ = ast_binary(A, LOC(@2), '-', $1, $3); }
|   expr "*" expr                       { $$ = ast_binary(A, LOC(@2), '*', $1, $3); }
|   expr "/" expr                       { $$ = ast_binary(A, LOC(@2), '/', $1, $3); }
|   expr "%" expr                       { $$ = ast_binary(A, LOC(@2), '%', $1, $3); }
|   "-" expr %prec NEG                  { $$ = ast_neg(A, LOC(@1), $2); }
;

call:
    NAME "(" args_opt ")"               { $$ = ast_call(A, LOC(@1), $1, $3); }
;

args_opt:
    %empty                              { $$ = ast_vec_new(A); }
|   args
;

args:
    arg                                 { $$ = ast_vec_of(A, $1); }
|   args "," arg                        { $$ = ast_vec_push(A, $1, $3); }
;

arg:
    expr                                { $$ = ast_arg(A, LOC(@1), NULL, $1); }
|   NAME "=" expr                       { $$ = ast_arg(A, LOC(@1), $1, $3); }
;

/* The scope of a block call: `ln_1`, `h[i]`, `model.layers[i].mlp` */
path:
    NAME                                { $$ = ast_path(A, LOC(@1), $1); }
|   path "." NAME                       { $$ = ast_path_name(A, $1, LOC(@3), $3); }
|   path "[" expr "]"                   { $$ = ast_path_index(A, $1, LOC(@3), $3); }
;

%%

/* How a token is named in a message: words bare, punctuation and keywords quoted. */
static const char *token_words(yysymbol_kind_t k)
{
    switch (k) {
    case YYSYMBOL_YYEOF: return "end of file";
    case YYSYMBOL_NAME: return "name";
    case YYSYMBOL_STRING: return "string";
    case YYSYMBOL_INT: return "integer";
    case YYSYMBOL_FLOAT: return "number";
    case YYSYMBOL_NEWLINE: return "end of line";
    default: return NULL;
    }
}

static void print_expected(FILE *out, yysymbol_kind_t k)
{
    const char *w = token_words(k);
    if (w) {
        fputs(w, out);
        return;
    }
    fprintf(out, "'%s'", yysymbol_name(k));     /* the token's alias: = .. model */
}

/* "unexpected name 'dimm', expected '=' or ':'". The lookahead is the token the scanner
 * matched last, so its text is still the scanner's yytext. */
static int yyreport_syntax_error(const yypcontext_t *pc, yyscan_t scanner, ParseCtx *ctx)
{
    /* Recovery skips to the end of the line; an unclosed ( or [ must not hide that end
     * (and every later one) from the parser. */
    ctx->nesting = 0;
    yysymbol_kind_t tok = yypcontext_token(pc);
    if (tok == YYSYMBOL_YYUNDEF) return 0;      /* the scanner has reported it */

    char *msg = NULL;
    size_t size = 0;
    FILE *out = open_memstream(&msg, &size);
    if (!out) ir_die(__FILE__, __LINE__, "out of memory");
    fputs("unexpected ", out);
    switch (tok) {
    case YYSYMBOL_NAME: case YYSYMBOL_INT: case YYSYMBOL_FLOAT:
        fprintf(out, "%s '%s'", token_words(tok), model_yyget_text(scanner));
        break;
    case YYSYMBOL_STRING:
        fprintf(out, "string %s", model_yyget_text(scanner));
        break;
    default:
        print_expected(out, tok);
    }
    if (tok == YYSYMBOL_YYEOF && ctx->n_braces > 0) {
        /* the only useful thing to say at the end of the file: which { is still open */
        fclose(out);
        const YYLTYPE *l = yypcontext_location(pc);
        diag_error(LOC(*l), "%s, expected '}'", msg);
        int open = ctx->n_braces < 32 ? ctx->n_braces : 32;
        diag_note(ctx->braces[open - 1], "this '{' is not closed");
        free(msg);
        return 0;
    }

    yysymbol_kind_t expected[6];
    int n = yypcontext_expected_tokens(pc, expected, 6);
    for (int i = 0; i < n; i++) {
        fputs(i == 0 ? ", expected " : i == n - 1 ? " or " : ", ", out);
        print_expected(out, expected[i]);
    }
    fclose(out);

    const YYLTYPE *l = yypcontext_location(pc);
    diag_error(LOC(*l), "%s", msg);
    free(msg);
    return 0;
}

/* Only bison's own failures arrive here ("memory exhausted" on absurd nesting); syntax
 * errors go through yyreport_syntax_error. */
static void model_yyerror(const YYLTYPE *loc, yyscan_t scanner, ParseCtx *ctx, const char *msg)
{
    (void)scanner;
    diag_error(LOC(*loc), "%s", msg);
}

bool ast_parse(Arena *a, const char *file, const char *text, AstVec *program)
{
    ParseCtx ctx = {.arena = a, .file = file, .line = 1, .col = 1, .at_line_start = true};
    int errors_before = diag_error_count();
    yyscan_t scanner;
    if (model_yylex_init_extra(&ctx, &scanner)) ir_die(__FILE__, __LINE__, "out of memory");
    YY_BUFFER_STATE buf = model_yy_scan_string(text, scanner);
    model_yydebug = getenv("FP8C_PARSE_TRACE") != NULL;
    int rc = model_yyparse(scanner, &ctx);
    model_yy_delete_buffer(buf, scanner);
    model_yylex_destroy(scanner);
    *program = ctx.program;
    return rc == 0 && diag_error_count() == errors_before;
}
