/* read.c — reads the textual IR written by print.c.
 *
 * The reader is the other half of golden-file testing and of the artifact that training binaries
 * embed, so it is strict: anything print.c would not write is an error with file:line:col and a
 * caret, and the graph is only returned when the whole text was good. Nodes may refer only to
 * earlier nodes; format references (scale=, amax=) and of= may name any node, and are resolved
 * after the last line. Shapes are not re-inferred here (ir_verify does that on request), but
 * they are bounded like the front end's (IR_MAX_NUMEL). Node numbers are names: they are kept in
 * a hash map, so a text with %2000000000 costs what one with %0 does, and they run from 0 to
 * INT_MAX - 1 (Graph.next_id stays an int). */
#include "ir.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    Arena *a;
    const char *file;
    const char *p;         /* cursor */
    const char *line_start;
    int line;
    bool failed;           /* an error in this line: skip to the next */
    /* id -> node: open addressing, at most half full */
    Node **by_id;
    int cap_id, n_id;
    /* forward references resolved at the end */
    struct Fixup { Node **slot; int id; SrcLoc loc; } *fix;
    int n_fix, cap_fix;
} Reader;

static SrcLoc here(const Reader *r)
{
    return (SrcLoc){r->file, r->line, (int)(r->p - r->line_start) + 1};
}

static void fail(Reader *r, const char *what)
{
    if (!r->failed) diag_error(here(r), "%s", what);
    r->failed = true;
}

static void skip_spaces(Reader *r)
{
    while (*r->p == ' ' || *r->p == '\t' || *r->p == '\r') r->p++;
}

static bool accept(Reader *r, const char *s)
{
    skip_spaces(r);
    size_t n = strlen(s);
    if (strncmp(r->p, s, n) != 0) return false;
    r->p += n;
    return true;
}

static void expect(Reader *r, const char *s)
{
    if (r->failed) return;
    if (!accept(r, s)) {
        char buf[64];
        snprintf(buf, sizeof buf, "expected '%s'", s);
        fail(r, buf);
    }
}

static const char *read_word(Reader *r)
{
    skip_spaces(r);
    const char *s = r->p;
    while (isalnum((unsigned char)*r->p) || *r->p == '_') r->p++;
    if (r->p == s) {
        fail(r, "expected a name");
        return "";
    }
    return arena_printf(r->a, "%.*s", (int)(r->p - s), s);
}

static const char *read_quoted(Reader *r)
{
    skip_spaces(r);
    if (*r->p != '"') {
        fail(r, "expected a quoted string");
        return "";
    }
    r->p++;
    /* room for the string up to its closing quote, not for the rest of the text: an artifact
     * holds thousands of names, and sizing each by strlen(r->p) made reading quadratic */
    size_t n = 0;
    for (const char *q = r->p; *q && *q != '"' && *q != '\n'; q++, n++)
        if (*q == '\\' && q[1]) q++;
    char *buf = arena_alloc(r->a, n + 1), *o = buf;
    while (*r->p && *r->p != '"' && *r->p != '\n') {
        if (*r->p == '\\' && r->p[1]) r->p++;
        *o++ = *r->p++;
    }
    if (*r->p != '"') {
        fail(r, "unterminated string");
        return "";
    }
    r->p++;
    return buf;
}

static long long read_int(Reader *r)
{
    skip_spaces(r);
    char *end;
    errno = 0;
    long long v = strtoll(r->p, &end, 10);
    if (end == r->p || errno) {
        fail(r, "expected an integer");
        return 0;
    }
    r->p = end;
    return v;
}

static double read_float(Reader *r)
{
    skip_spaces(r);
    char *end;
    double v = strtod(r->p, &end);
    if (end == r->p) {
        fail(r, "expected a number");
        return 0;
    }
    r->p = end;
    return v;
}

static size_t id_slot(const Reader *r, int id)
{
    size_t mask = (size_t)r->cap_id - 1, h = ((uint32_t)id * 2654435761u) & mask;
    while (r->by_id[h] && r->by_id[h]->id != id) h = (h + 1) & mask;
    return h;
}

static void remember(Reader *r, Node *n)
{
    if (2 * (r->n_id + 1) > r->cap_id) {
        Node **old = r->by_id;
        int old_cap = r->cap_id;
        r->cap_id = old_cap ? old_cap * 2 : 1024;
        r->by_id = arena_alloc(r->a, sizeof(Node *) * (size_t)r->cap_id);
        for (int i = 0; i < old_cap; i++)
            if (old[i]) r->by_id[id_slot(r, old[i]->id)] = old[i];
    }
    r->by_id[id_slot(r, n->id)] = n;
    r->n_id++;
}

static Node *lookup(Reader *r, int id)
{
    return r->cap_id ? r->by_id[id_slot(r, id)] : NULL;
}

/* An integer in [lo, hi], for fields that are ints in the IR. */
static int read_int_in(Reader *r, long long lo, long long hi)
{
    skip_spaces(r);
    const char *at = r->p;
    long long v = read_int(r);
    if (!r->failed && (v < lo || v > hi)) {
        r->p = at;
        fail(r, arena_printf(r->a, "expected an integer from %lld to %lld", lo, hi));
    }
    return r->failed ? (int)lo : (int)v;
}

/* "%N"'s N: a node number, 0 .. INT_MAX - 1. */
static int read_id(Reader *r)
{
    skip_spaces(r);
    const char *at = r->p;
    long long v = read_int(r);
    if (!r->failed && (v < 0 || v >= INT_MAX)) {
        r->p = at;
        fail(r, "node numbers run from 0 to 2147483646");
    }
    return r->failed ? -1 : (int)v;
}

/* "%12" resolved later (format references may point forward). */
static void read_ref_later(Reader *r, Node **slot)
{
    skip_spaces(r);
    SrcLoc loc = here(r);
    expect(r, "%");
    int id = read_id(r);
    if (r->failed) return;
    if (r->n_fix == r->cap_fix) {
        int cap = r->cap_fix ? r->cap_fix * 2 : 64;
        struct Fixup *bigger = arena_alloc(r->a, sizeof *bigger * (size_t)cap);
        if (r->cap_fix) memcpy(bigger, r->fix, sizeof *bigger * (size_t)r->cap_fix);
        r->fix = bigger;
        r->cap_fix = cap;
    }
    r->fix[r->n_fix++] = (struct Fixup){slot, id, loc};
}

static int name_index(const char *s, const char *(*name_of)(int), int count)
{
    for (int i = 0; i < count; i++)
        if (strcmp(name_of(i), s) == 0) return i;
    return -1;
}
static const char *scaling_of(int i) { return fmt_scaling_name((Scaling)i); }
static const char *recipe_of(int i) { return fmt_recipe_name((Recipe)i); }
static const char *codec_of(int i) { return fmt_codec_name((Codec)i); }

static void read_format_block(Reader *r, Format *f)
{
    while (!r->failed && !accept(r, "}")) {
        const char *key = read_word(r);
        expect(r, "=");
        if (r->failed) return;
        int v = -2;
        if (!strcmp(key, "scaling")) {
            if ((v = name_index(read_word(r), scaling_of, SCALE_COUNT)) >= 0) f->scaling = (Scaling)v;
        } else if (!strcmp(key, "recipe")) {
            if ((v = name_index(read_word(r), recipe_of, RECIPE_COUNT)) >= 0) f->recipe = (Recipe)v;
        } else if (!strcmp(key, "codec")) {
            if ((v = name_index(read_word(r), codec_of, CODEC_COUNT)) >= 0) f->codec = (Codec)v;
        } else if (!strcmp(key, "group")) {
            f->group = read_int_in(r, 0, 1 << 30);
        } else if (!strcmp(key, "history")) {
            f->history = read_int_in(r, 0, 1 << 20);
        } else if (!strcmp(key, "margin")) {
            f->margin = read_int_in(r, 0, 31);
        } else if (!strcmp(key, "history_max")) {
            f->history_max = read_int(r) != 0;
        } else if (!strcmp(key, "static_scale")) {
            f->static_scale = (float)read_float(r);
        } else if (!strcmp(key, "scale")) {
            read_ref_later(r, &f->scale);
        } else if (!strcmp(key, "amax")) {
            read_ref_later(r, &f->amax);
        } else {
            fail(r, "unknown format field");
        }
        if (v == -1) fail(r, "unknown value for this format field");
    }
}

static void read_graph_header(Reader *r, Graph *g)
{
    g->model_name = read_quoted(r);
    expect(r, "batch=");
    g->batch = read_int_in(r, 0, 1 << 30);
    expect(r, "seq=");
    g->seq = read_int_in(r, 0, 1 << 30);
    expect(r, "opt=");
    g->opt_level = read_int_in(r, 0, 3);
    expect(r, "persistent=");
    g->persistent_bytes = read_int(r);
    expect(r, "transient=");
    g->transient_bytes = read_int(r);
}

static void read_optim(Reader *r, Graph *g)
{
    OptimSpec *o = &g->optim;
    o->present = true;
    expect(r, "lr="); o->lr = read_float(r);
    expect(r, "beta1="); o->beta1 = read_float(r);
    expect(r, "beta2="); o->beta2 = read_float(r);
    expect(r, "eps="); o->eps = read_float(r);
    expect(r, "weight_decay="); o->weight_decay = read_float(r);
    expect(r, "clip="); o->clip = read_float(r);
    o->kind = OPTIM_ADAMW;
    skip_spaces(r);
    if (accept(r, "kind=")) {
        const char *s = r->p;
        while (isalpha((unsigned char)*r->p)) r->p++;
        char name[16];
        snprintf(name, sizeof name, "%.*s", (int)(r->p - s), s);
        if (!ir_optim_from_name(name, &o->kind)) {
            fail(r, "expected an optimizer: adamw, lion or sgd");
            return;
        }
        expect(r, "momentum="); o->momentum = read_float(r);
        expect(r, "nesterov="); o->nesterov = read_int_in(r, 0, 1) != 0;
    }
}

/* `choice NAME VALUE`: one entry of the choice table (ir_set_choice). */
static const char *read_choice_token(Reader *r, const char *extra)
{
    skip_spaces(r);
    const char *s = r->p;
    while (isalnum((unsigned char)*r->p) || (*r->p && strchr(extra, *r->p))) r->p++;
    if (r->p == s) {
        fail(r, "expected a choice's name and value");
        return NULL;
    }
    return arena_printf(r->a, "%.*s", (int)(r->p - s), s);
}

static void read_choice(Reader *r, Graph *g)
{
    const char *name = read_choice_token(r, "_.@");
    const char *value = name ? read_choice_token(r, "_.:+-") : NULL;
    if (!value) return;
    if (ir_choice(g, name)) {
        fail(r, "this choice is set twice");
        return;
    }
    ir_set_choice(g, name, value);
}

static void read_node(Reader *r, Graph *g)
{
    SrcLoc at = here(r);
    expect(r, "%");
    int id = read_id(r);
    expect(r, "=");
    if (r->failed) return;
    if (lookup(r, id)) {
        fail(r, "this node number is defined twice");
        return;
    }
    skip_spaces(r);
    SrcLoc op_at = here(r);
    const char *opname = read_word(r);
    OpKind op;
    if (r->failed) return;
    if (!ir_op_from_name(opname, &op)) {
        r->p = r->line_start + op_at.col - 1;
        fail(r, "unknown op");
        return;
    }
    const OpInfo *info = ir_op_info(op);
    Node *in[4096];
    int n_in = 0;
    expect(r, "(");
    while (!r->failed && !accept(r, ")")) {
        if (n_in) expect(r, ",");
        skip_spaces(r);
        const char *operand_at = r->p;
        expect(r, "%");
        int ref = read_id(r);
        if (r->failed) return;
        Node *x = lookup(r, ref);
        if (!x) {
            r->p = operand_at;
            fail(r, "this operand is not defined on an earlier line");
            return;
        }
        if (n_in == (int)(sizeof in / sizeof in[0])) {
            fail(r, "too many operands");
            return;
        }
        in[n_in++] = x;
    }
    if (r->failed) return;
    if (info->arity >= 0 && n_in != info->arity) {
        r->p = r->line_start + op_at.col - 1;
        fail(r, arena_printf(r->a, "%s takes %d operands, not %d", info->text, info->arity, n_in));
        return;
    }
    Node *n = ir_add(g, op, n_in, in, at);
    n->id = id;
    if (id >= g->next_id) g->next_id = id + 1;
    remember(r, n);   /* n->loc stays this IR line unless an @"file":line:col follows */

    /* attributes up to ':' */
    while (!r->failed && !accept(r, ":")) {
        const char *key = read_word(r);
        expect(r, "=");
        if (r->failed) return;
        bool found = false;
        for (int i = 0; i < info->n_iattr && !found; i++)
            if (!strcmp(info->iattr_names[i], key)) n->iattr[i] = read_int(r), found = true;
        for (int i = 0; i < info->n_fattr && !found; i++)
            if (!strcmp(info->fattr_names[i], key)) n->fattr[i] = read_float(r), found = true;
        if (!found) fail(r, arena_printf(r->a, "%s has no attribute '%s'", info->text, key));
    }
    /* element type and shape */
    skip_spaces(r);
    const char *elem_at = r->p;
    const char *elem = read_word(r);
    if (r->failed) return;
    if (!fmt_elem_from_name(elem, &n->t.fmt.elem)) {
        r->p = elem_at;
        fail(r, "unknown element type");
        return;
    }
    expect(r, "[");
    int64_t dims[IR_MAX_RANK];
    int rank = 0;
    while (!r->failed && !accept(r, "]")) {
        if (rank) expect(r, ",");
        if (rank == IR_MAX_RANK) {
            fail(r, "too many dims");
            return;
        }
        dims[rank] = read_int(r);
        if (!r->failed && dims[rank] <= 0) fail(r, "dims must be positive");
        rank++;
    }
    if (r->failed) return;
    ir_set_shape(n, rank, dims);
    if (!ir_shape_fits(rank, dims)) {
        r->p = elem_at;
        fail(r, arena_printf(r->a, "%s has more than 2^40 elements", ir_shape_text(r->a, &n->t)));
        return;
    }
    if (accept(r, "fmt{")) read_format_block(r, &n->t.fmt);

    /* the rest: key=value until the end of the line */
    for (;;) {
        skip_spaces(r);
        if (r->failed || *r->p == '\n' || *r->p == 0) break;
        if (accept(r, "@")) {
            const char *file = read_quoted(r);
            expect(r, ":");
            int line = read_int_in(r, 0, INT_MAX);
            expect(r, ":");
            int col = read_int_in(r, 0, INT_MAX);
            n->loc = (SrcLoc){file, line, col};
            continue;
        }
        const char *key = read_word(r);
        expect(r, "=");
        if (r->failed) return;
        const char *value_at = r->p;
        if (!strcmp(key, "role")) {
            if (!ir_role_from_name(read_word(r), &n->t.role)) r->p = value_at, fail(r, "unknown role");
        } else if (!strcmp(key, "phase")) {
            const char *ph = read_word(r);
            int p = -1;
            for (int i = 0; i < PHASE_COUNT; i++)
                if (!strcmp(ir_phase_name((Phase)i), ph)) p = i;
            if (p < 0) fail(r, "unknown phase");
            else n->phase = (Phase)p;
        } else if (!strcmp(key, "saved_as")) {
            const char *e = read_word(r);
            if (!fmt_elem_from_name(e, &n->t.saved_as.elem)) r->p = value_at, fail(r, "unknown element type");
            else if (accept(r, "saved_fmt{")) read_format_block(r, &n->t.saved_as);
        } else if (!strcmp(key, "name")) {
            n->t.name = read_quoted(r);
        } else if (!strcmp(key, "of")) {
            read_ref_later(r, &n->grad_of);
        } else if (!strcmp(key, "mem")) {
            n->t.offset = read_int(r);
            expect(r, "+");
            n->t.bytes = read_int(r);
        } else {
            fail(r, arena_printf(r->a, "unknown field '%s'", key));
        }
    }
}

Graph *ir_read(Arena *a, const char *file, const char *text)
{
    diag_register_source(file, text);
    int errors_before = diag_error_count();
    Graph *g = ir_graph_new(a);
    Reader r = {.a = a, .file = file, .p = text, .line_start = text, .line = 1};
    bool seen_node = false;
    while (*r.p) {
        r.failed = false;
        skip_spaces(&r);
        if (*r.p == '#' || *r.p == '\n') {
            /* comment or blank line */
        } else if (accept(&r, "graph ")) {
            if (seen_node) fail(&r, "the graph line must come before the nodes");
            read_graph_header(&r, g);
        } else if (accept(&r, "optim ")) {
            read_optim(&r, g);
        } else if (accept(&r, "choice ")) {
            read_choice(&r, g);
        } else if (*r.p == '%') {
            seen_node = true;
            read_node(&r, g);
        } else {
            fail(&r, "expected a node (%N = op(...)), 'graph', 'optim', 'choice' or a comment");
        }
        skip_spaces(&r);
        if (!r.failed && *r.p && *r.p != '\n' && *r.p != '#') fail(&r, "unexpected text at the end of the line");
        while (*r.p && *r.p != '\n') r.p++;
        if (*r.p == '\n') {
            r.p++;
            r.line++;
            r.line_start = r.p;
        }
    }
    for (int i = 0; i < r.n_fix; i++) {
        Node *target = lookup(&r, r.fix[i].id);
        if (!target) diag_error(r.fix[i].loc, "no node %%%d in this graph", r.fix[i].id);
        else *r.fix[i].slot = target;
    }
    ir_renumber(g);
    return diag_error_count() > errors_before ? NULL : g;
}
