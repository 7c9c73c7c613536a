/* lower_program.c — a model file as a whole: the scan before it runs, the end after.
 *
 * How a program runs:
 *   1. a scan of the top level finds the blocks (so that they may be called before they are
 *      written), checks where statements may appear, and checks -D against the configs;
 *   2. the statements run in order (lower.c's interpreter), building nodes with ir_add and
 *      asking ir_infer_shape about each; every problem is a diag_error at the place in the
 *      file;
 *   3. weight-decay flags, the optimizer clause and the model's name are filled in, and
 *      nodes that do not reach the loss are dropped.
 *
 * Errors never stop the run: a failed expression evaluates to an error value that later
 * expressions pass on silently, so one mistake is reported once, not in every line after it.
 * A block body runs once per call (48 times in GPT-2 XL); an error at one place in the file
 * is therefore reported the first time only. */
#include "lower.h"

#include <errno.h>
#include <fnmatch.h>
#include <stdlib.h>
#include <string.h>

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
            const AstStmt *old = lower_find_block(L, s->name);
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
            lower_suggest_try(&sg, L->configs[j]);
        }
        Value v;
        if (!known)
            lower_error(L, lower_command_line, "-D %s=%s: the model has no config '%s'%s", d->name,
                        d->value ? d->value : "", d->name, lower_suggest_text(L, &sg));
        else if (!d->value || !lower_parse_number(d->value, &v))
            lower_error(L, lower_command_line, "-D %s=%s: '%s' is not a number", d->name,
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
            IR_IATTR(n, PARAM, decay) = n->t.rank >= 2;
            continue;
        }
        bool in = decay_match(&d->items, n->t.name, used);
        bool out = decay_match(&d->except, n->t.name, used + d->items.n);
        IR_IATTR(n, PARAM, decay) = in && !out;
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
    lower_exec_stmts(&L, &L.top, prog);

    L.g->model_name = L.model ? L.model->name : default_model_name(&L, path);
    if (!L.loss && diag_error_count() == errors)
        lower_error(&L, (SrcLoc){path, 0, 0}, "the model has no loss: end it with a loss statement, "
                    "e.g. loss cross_entropy(logits, targets)");
    finish_decay(&L, errors);
    if (L.loss && diag_error_count() == errors) finish_graph(&L);
    return diag_error_count() == errors ? L.g : NULL;
}

/* ---------------------------------------------------------------- entry points */

/* A UTF-8 byte-order mark, which some editors write at the start of a file: not part of the
 * model. It is skipped, so that columns count from the first character a reader sees. */
static const char *skip_byte_order_mark(const char *text)
{
    return strncmp(text, "\xef\xbb\xbf", 3) == 0 ? text + 3 : text;
}

Graph *front_compile_text(Arena *a, const char *path, const char *text, const FrontOptions *o)
{
    text = skip_byte_order_mark(text);
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
