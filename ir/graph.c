/* graph.c — the op, format and role tables, and building and editing graphs.
 *
 * The tables come from the X-macro files (ops.def, formats.def, scaling.def) so that names,
 * arities, attribute lists and scaling recipes cannot drift from the enums; static_asserts keep
 * the counts in step. Graph
 * editing is deliberately small: append a node, replace uses, filter. Passes that reorder
 * (schedule) rewrite Graph.nodes and call ir_renumber. */
#include "ir.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>

/* ---------------------------------------------------------------- element types */

static const struct {
    const char *text;
    int bytes;
    bool is_float;
} elem_table[] = {
#define X(name, text, bytes, is_float) {text, bytes, is_float},
#include "formats.def"
#undef X
};
_Static_assert(sizeof elem_table / sizeof elem_table[0] == FMT_COUNT, "formats.def and ElemType");

const char *fmt_elem_name(ElemType e) { return e < FMT_COUNT ? elem_table[e].text : "?"; }
int fmt_elem_bytes(ElemType e) { return elem_table[e].bytes; }
bool fmt_elem_is_float(ElemType e) { return elem_table[e].is_float; }

bool fmt_elem_from_name(const char *s, ElemType *out)
{
    for (int i = 0; i < FMT_COUNT; i++)
        if (strcmp(elem_table[i].text, s) == 0) {
            *out = (ElemType)i;
            return true;
        }
    return false;
}

static const ScalingInfo scaling_table[SCALE_COUNT] = {
#define X(name, text, rule, brows, bcols, selem, gact, gweight, cublaslt, transposable) \
    {text, rule, brows, bcols, selem, gact, gweight, cublaslt, transposable},
#include "scaling.def"
#undef X
};
static const char *const recipe_names[RECIPE_COUNT] = {"none", "current", "delayed", "static"};
static const char *const codec_names[CODEC_COUNT] = {"plain", "expand", "compand", "sqrt", "split"};

const char *fmt_scaling_name(Scaling s) { return s < SCALE_COUNT ? scaling_table[s].text : "?"; }

const ScalingInfo *fmt_scaling_info(Scaling s)
{
    IR_ASSERT(s < SCALE_COUNT);
    return &scaling_table[s];
}

bool fmt_scaling_from_rule(const char *word, Scaling *out)
{
    for (int i = 0; i < SCALE_COUNT; i++)
        if (*scaling_table[i].rule && !strcmp(scaling_table[i].rule, word)) {
            *out = (Scaling)i;
            return true;
        }
    return false;
}

int fmt_scaling_group(Scaling s, int group)
{
    IR_ASSERT(s < SCALE_COUNT);
    const ScalingInfo *si = &scaling_table[s];
    return si->block_rows == 1 && si->block_cols > 0 ? si->block_cols : group;
}

Scaling fmt_gemm_operand_scaling(GemmScaling mode, bool weight)
{
    for (int i = 0; i < SCALE_COUNT; i++)
        if ((weight ? scaling_table[i].gemm_weight : scaling_table[i].gemm_act) == (int)mode) return (Scaling)i;
    IR_ASSERT(!"no granularity for this GEMM mode");
}

GemmScaling fmt_gemm_mode_of(Scaling s)
{
    IR_ASSERT(s < SCALE_COUNT);
    const ScalingInfo *si = &scaling_table[s];
    return si->gemm_act >= 0 ? (GemmScaling)si->gemm_act
         : si->gemm_weight >= 0 ? (GemmScaling)si->gemm_weight : GEMM_FP8_TENSOR;
}

ScaleGrid fmt_scale_grid(Scaling s, int64_t group, int64_t rows, int64_t cols)
{
    IR_ASSERT(s > SCALE_NONE && s < SCALE_COUNT);
    const ScalingInfo *si = &scaling_table[s];
    int64_t br = si->block_rows == 0 ? rows : si->block_rows;
    int64_t bc = si->block_cols == 0 ? cols : si->block_cols < 0 ? group : si->block_cols;
    IR_ASSERT(bc > 0 || cols == 0);
    ScaleGrid g = {.block_rows = br > 0 ? br : 1, .block_cols = bc > 0 ? bc : 1};
    g.grid_rows = si->block_rows == 0 ? 1 : (rows + g.block_rows - 1) / g.block_rows;
    g.grid_cols = si->block_cols == 0 ? 1 : (cols + g.block_cols - 1) / g.block_cols;
    return g;
}
const char *fmt_recipe_name(Recipe r) { return r < RECIPE_COUNT ? recipe_names[r] : "?"; }
const char *fmt_codec_name(Codec c) { return c < CODEC_COUNT ? codec_names[c] : "?"; }

Format fmt_plain(ElemType e)
{
    Format f = {0};
    f.elem = e;
    return f;
}

/* ---------------------------------------------------------------- roles and phases */

static const char *const role_names[ROLE_COUNT] = {
    "activation", "saved", "grad_temp", "input", "param", "grad", "master",
    "adam_m", "adam_v", "scale", "amax_history", "workspace", "output", "optim_state", "weight_copy"};

const char *ir_role_name(Role r) { return r < ROLE_COUNT ? role_names[r] : "?"; }

/* ---------------------------------------------------------------- optimizers */

static const char *const optim_names[OPTIM_COUNT] = {"adamw", "lion", "sgd"};

const char *ir_optim_name(OptimKind k) { return k < OPTIM_COUNT ? optim_names[k] : "?"; }

bool ir_optim_from_name(const char *s, OptimKind *out)
{
    for (int i = 0; i < OPTIM_COUNT; i++)
        if (strcmp(optim_names[i], s) == 0) {
            *out = (OptimKind)i;
            return true;
        }
    return false;
}

bool ir_role_from_name(const char *s, Role *out)
{
    for (int i = 0; i < ROLE_COUNT; i++)
        if (strcmp(role_names[i], s) == 0) {
            *out = (Role)i;
            return true;
        }
    return false;
}

bool ir_role_is_persistent(Role r)
{
    switch (r) {
    case ROLE_PARAM: case ROLE_GRAD: case ROLE_MASTER: case ROLE_ADAM_M: case ROLE_ADAM_V:
    case ROLE_SCALE: case ROLE_AMAX_HISTORY: case ROLE_OPTIM_STATE: case ROLE_WEIGHT_COPY:
        return true;
    default:
        return false;
    }
}

static const char *const phase_names[PHASE_COUNT] = {"forward", "backward", "update"};
const char *ir_phase_name(Phase p) { return p < PHASE_COUNT ? phase_names[p] : "?"; }

/* ---------------------------------------------------------------- ops */

#define X(name, text, arity, iattrs, fattrs, summary, cls) +1
enum { OPS_IN_TABLE = 0
#include "ops.def"
};
#undef X
_Static_assert((int)OPS_IN_TABLE == (int)OP_COUNT, "ops.def and OpKind");

static OpInfo op_table[OP_COUNT];
static bool op_table_ready;

/* Splits "a,b,c" into names; the strings are static literals, so keep pointers into copies. */
static int split_names(const char *spec, const char **out, int max, char *buf, size_t bufsize)
{
    if (!*spec) return 0;
    IR_ASSERT(strlen(spec) < bufsize);
    strcpy(buf, spec);
    int n = 0;
    for (char *p = buf; p && *p;) {
        IR_ASSERT(n < max);
        out[n++] = p;
        p = strchr(p, ',');
        if (p) *p++ = 0;
    }
    return n;
}

static void op_table_init(void)
{
    static char names[OP_COUNT][2][64];
    static const struct {
        const char *text;
        int arity;
        const char *iattrs, *fattrs, *summary;
        OpClass cls;
    } raw[] = {
#define X(name, text, arity, iattrs, fattrs, summary, cls) \
    {text, arity, IR_ATTR_TEXT(iattrs), IR_ATTR_TEXT(fattrs), summary, CLASS_##cls},
#include "ops.def"
#undef X
    };
    for (int i = 0; i < OP_COUNT; i++) {
        OpInfo *o = &op_table[i];
        o->text = raw[i].text;
        o->arity = raw[i].arity;
        o->summary = raw[i].summary;
        o->cls = raw[i].cls;
        o->n_iattr = split_names(raw[i].iattrs, o->iattr_names, IR_MAX_IATTR, names[i][0], 64);
        o->n_fattr = split_names(raw[i].fattrs, o->fattr_names, IR_MAX_FATTR, names[i][1], 64);
    }
    op_table_ready = true;
}

int ir_attr_check(const Node *n, OpKind op, int k, bool fattr)
{
    const OpInfo *want = ir_op_info(op), *have = ir_op_info(n->op);
    int n_have = fattr ? have->n_fattr : have->n_iattr;
    const char *name = fattr ? want->fattr_names[k] : want->iattr_names[k];
    if (k >= n_have || strcmp(fattr ? have->fattr_names[k] : have->iattr_names[k], name) != 0)
        ir_die(__FILE__, __LINE__, "%s %%%d has no attribute '%s' where %s has it", have->text, n->id,
               name, want->text);
    return k;
}

const OpInfo *ir_op_info(OpKind op)
{
    if (!op_table_ready) op_table_init();
    IR_ASSERT(op < OP_COUNT);
    return &op_table[op];
}

OpClass ir_op_class(OpKind op)
{
    return ir_op_info(op)->cls;
}

bool ir_op_from_name(const char *s, OpKind *out)
{
    for (int i = 0; i < OP_COUNT; i++)
        if (strcmp(ir_op_info((OpKind)i)->text, s) == 0) {
            *out = (OpKind)i;
            return true;
        }
    return false;
}

bool ir_attention_bwd_reads_y(const Node *n)
{
    return n->op == OP_ATTENTION_BWD && (n->n_in == 3 || n->n_in == 5);
}

int64_t ir_attention_lse_offset(const Node *n)
{
    if (n->op != OP_ATTENTION || !IR_IATTR(n, ATTENTION, lse)) return 0;
    return (ir_numel(&n->t) * fmt_elem_bytes(n->t.fmt.elem) + 15) / 16 * 16;
}

/* the place of op's integer attribute amax (ops.def), -1 where it has none: the ops that have
 * it hold it at different places (first for the elementwise and norm ops, after the others
 * for SLICE and ROPE), so these three find it by name for all of them: they are its accessors */
static int amax_index(OpKind op)
{
    const OpInfo *info = ir_op_info(op);
    for (int k = 0; k < info->n_iattr; k++)
        if (strcmp(info->iattr_names[k], "amax") == 0) return k;
    return -1;
}

bool ir_op_keeps_amax(OpKind op)
{
    return amax_index(op) >= 0;
}

void ir_set_keeps_amax(Node *n)
{
    IR_ASSERT(ir_op_keeps_amax(n->op));
    n->iattr[amax_index(n->op)] = 1;
}

bool ir_keeps_amax(const Node *n)
{
    int k = amax_index(n->op);
    return k >= 0 && n->iattr[k];
}

static int64_t result_bytes(const Node *n) { return ir_numel(&n->t) * fmt_elem_bytes(n->t.fmt.elem); }

/* where what a node keeps after its result starts: the next multiple of 256 bytes */
static int64_t after_result(const Node *n) { return (result_bytes(n) + 255) / 256 * 256; }

int64_t ir_amax_parts_offset(const Node *n)
{
    return ir_keeps_amax(n) ? after_result(n) : 0;
}

int64_t ir_transposed_offset(const Node *n)
{
    return n->op == OP_QUANTIZE && IR_IATTR(n, QUANTIZE, transposed) ? after_result(n) : 0;
}

bool ir_is_recomputed(const Node *n)
{
    return n->phase == PHASE_BACKWARD && n->t.role == ROLE_ACTIVATION;
}

bool ir_quantize_may_rerun_producer(const Node *q, const Uses *uses)
{
    if (q->op != OP_QUANTIZE || ir_transposed_offset(q) || q->t.fmt.scaling != SCALE_PER_TENSOR ||
        q->t.fmt.recipe != RECIPE_CURRENT)
        return false;
    const Node *y = q->in[0], *scale = q->t.fmt.scale;
    if (!scale || scale->op != OP_QUANT_SCALE || scale->in[0] != y || !ir_amax_parts_offset(y) ||
        y->t.fmt.scaling != SCALE_NONE || ir_role_is_persistent(y->t.role) || y->t.role == ROLE_OUTPUT ||
        y->index < 0)
        return false;
    switch (y->op) {
    case OP_LAYERNORM: case OP_RMSNORM: case OP_LAYERNORM_BWD_X: case OP_RMSNORM_BWD_X:
    case OP_GELU: case OP_SILU: case OP_GELU_BWD: case OP_SILU_BWD: break;
    default: return false;
    }
    const Uses *u = &uses[y->index];
    for (int i = 0; i < u->n; i++)
        if (u->list[i] != q && u->list[i] != scale) return false;
    return true;
}

const Node *ir_inlined_product(const Graph *g, const Node *u, const Uses *uses)
{
    if ((u->op != OP_GELU_BWD && u->op != OP_SILU_BWD) || u->n_in != 2) return NULL;
    const Node *d = u->in[0];
    if ((d->op != OP_ADD && d->op != OP_SUB && d->op != OP_MUL) || d == u->in[1] || d->index < 0 ||
        uses[d->index].n != 1 || ir_numel(&d->t) != ir_numel(&u->t) || ir_numel(&d->in[0]->t) != ir_numel(&d->t) ||
        ir_numel(&d->in[1]->t) != ir_numel(&d->t) || !ir_choice_on(g, "fuse.inline_elementwise", d))
        return NULL;
    return d;
}

const Node *ir_inlined_activation(const Graph *g, const Node *y, const Uses *uses)
{
    if ((y->op != OP_ADD && y->op != OP_SUB && y->op != OP_MUL) || y->n_in != 2 || y->in[0] == y->in[1]) return NULL;
    for (int k = 0; k < 2; k++) {
        const Node *x = y->in[k];
        if ((x->op == OP_GELU || x->op == OP_SILU) && x->n_in == 1 && x->index >= 0 && uses[x->index].n == 1 &&
            x->t.fmt.scaling == SCALE_NONE && ir_numel(&x->t) == ir_numel(&y->t) &&
            ir_numel(&y->in[1 - k]->t) == ir_numel(&y->t) && ir_numel(&x->in[0]->t) == ir_numel(&y->t) &&
            ir_choice_on(g, "fuse.inline_elementwise", x))
            return x;
    }
    return NULL;
}

int64_t ir_storage_bytes(const Node *n)
{
    int64_t lse = ir_attention_lse_offset(n);
    if (lse && n->t.rank == 3) return lse + n->t.dims[0] * IR_IATTR(n, ATTENTION, heads) * n->t.dims[1] * 4;
    if (ir_amax_parts_offset(n)) return after_result(n) + IR_AMAX_PARTS * 4;
    if (ir_transposed_offset(n)) return after_result(n) + result_bytes(n);
    return result_bytes(n);
}

bool ir_op_is_inplace(OpKind op)
{
    return op == OP_ACCUMULATE || ir_op_is_update(op) || op == OP_AMAX_RECORD || op == OP_DELAYED_SCALE ||
           op == OP_ASSIGN || op == OP_ALL_REDUCE;
}

bool ir_op_is_update(OpKind op) { return op == OP_ADAMW || op == OP_LION || op == OP_SGD; }

/* ---------------------------------------------------------------- graphs */

Graph *ir_graph_new(Arena *a)
{
    Graph *g = arena_alloc(a, sizeof *g);
    g->arena = a;
    g->cap = 256;
    g->nodes = arena_alloc(a, sizeof(Node *) * (size_t)g->cap);
    return g;
}

/* ---------------------------------------------------------------- the choice table */

const char *ir_choice(const Graph *g, const char *name)
{
    for (int i = 0; i < g->n_choices; i++)
        if (!strcmp(g->choices[i].name, name)) return g->choices[i].value;
    return NULL;
}

int64_t ir_choice_int(const Graph *g, const char *name, int64_t dflt) { return ir_choice_int_at(g, name, NULL, dflt); }

/* the value of KIND@ID for the node `site` where set, else of KIND; NULL where neither is */
static const char *choice_at(const Graph *g, const char *kind, const Node *site)
{
    if (site) {
        char name[96];
        snprintf(name, sizeof name, "%s@%d", kind, site->id);
        const char *v = ir_choice(g, name);
        if (v) return v;
    }
    return ir_choice(g, kind);
}

bool ir_choice_on(const Graph *g, const char *kind, const Node *site)
{
    const char *v = choice_at(g, kind, site);
    return !v || strcmp(v, "0") != 0;
}

int64_t ir_choice_int_at(const Graph *g, const char *kind, const Node *site, int64_t dflt)
{
    const char *v = choice_at(g, kind, site);
    if (!v) return dflt;
    char *end;
    long long x = strtoll(v, &end, 10);
    return end != v && !*end ? (int64_t)x : dflt;
}

static bool choice_chars_ok(const char *s, const char *extra)
{
    if (!s || !*s) return false;
    for (; *s; s++)
        if (!isalnum((unsigned char)*s) && !strchr(extra, *s)) return false;
    return true;
}

void ir_fingerprint(const char *text, char out[17])
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) h = (h ^ *p) * 0x100000001b3ull;
    snprintf(out, 17, "%016llx", (unsigned long long)h);
}

/* The choices the compiler and the runtime read, and the values each takes (docs/tuning.md):
 * a list of words, or whole numbers from lo to hi in steps of `step`, or hex digits. A choice
 * outside the table, or a value outside its list or range, would be read as the default
 * where it is used, so ir_choice_check refuses it where it is given. */
typedef struct {
    const char *name;
    const char *words;      /* "0 1", "64 128": the values, space-separated; NULL: a number */
    int64_t lo, hi, step;   /* a number's range and step (hex: step 0, hi digits) */
} ChoiceRule;

/* the kinds read per node as well (ir_choice_on, ir_choice_int_at): only these take NAME@ID */
static bool choice_per_node(const char *name)
{
    return (!strncmp(name, "fuse.", 5) && strcmp(name, "fuse.members")) || !strncmp(name, "attn.", 5) ||
           !strncmp(name, "ce.", 3) || !strncmp(name, "norm.", 5);
}

static const ChoiceRule choice_rules[] = {
    {"loss.chunks", NULL, 1, 256, 1},
    {"cpu.threads", NULL, 1, 1024, 1},
    {"cpu.tiles", "amx bf16dot off", 0, 0, 0},
    {"cpu.task_work", NULL, 1, INT64_C(1) << 40, 1},
    {"fuse.producer_quantizes", "0 1", 0, 0, 0},
    {"fuse.cast_transposes", "0 1", 0, 0, 0},
    {"fuse.norm_stats", "0 1", 0, 0, 0},
    {"fuse.bias_grads", "0 1", 0, 0, 0},
    {"fuse.group_quantizes", "0 1", 0, 0, 0},
    {"fuse.input_group_copies", "0 1", 0, 0, 0},
    {"fuse.inline_elementwise", "0 1", 0, 0, 0},
    {"layout.cast_transpose", "0 1", 0, 0, 0},
    {"scale.weight_amax", "0 1", 0, 0, 0},
    {"fuse.ce_one_pass", "0 1", 0, 0, 0},
    {"fuse.ce_lse", "0 1", 0, 0, 0},
    {"fuse.norm_grads", "0 1", 0, 0, 0},
    {"fuse.gemm_epilogues", "0 1", 0, 0, 0},
    {"fuse.gemm_gelu", "0 1", 0, 0, 0},
    {"fuse.inverse_scales", "0 1", 0, 0, 0},
    {"fuse.attention_scales", "0 1", 0, 0, 0},
    {"fuse.amax_scales", "0 1", 0, 0, 0},
    {"fuse.state_scales", "0 1", 0, 0, 0},
    {"fuse.members", NULL, 0, 64, 1},
    {"attn.wgmma", "0 1", 0, 0, 0},
    {"attn.fwd_pipeline", "0 1", 0, 0, 0},
    {"attn.fwd_ws", "0 2 3", 0, 0, 0},
    {"attn.fwd_tma", "0 1", 0, 0, 0},
    {"attn.fwd_keys", "64 128", 0, 0, 0},
    {"attn.wgmma_bwd", "0 1", 0, 0, 0},
    {"attn.dq_rows", "64 128", 0, 0, 0},
    {"attn.dkv_rows", "64 128", 0, 0, 0},
    {"attn.head_group", NULL, 0, 1024, 1},
    {"attn.dkv_split", "1 2", 0, 0, 0},
    {"attn.dq_in_dkv", "0 1", 0, 0, 0},
    {"attn.dkv_parts", NULL, 0, 8, 1},
    {"ce.threads", NULL, 64, 1024, 32},
    {"ce.exp2", "0 1", 0, 0, 0},
    {"ce.shared", "0 1", 0, 0, 0},
    {"ce.ring", "0 1", 0, 0, 0},
    {"save.attention_y", "0 1", 0, 0, 0},
    {"save.cheap", "0 1", 0, 0, 0},
    {"save.activations", "0 1", 0, 0, 0},
    {"save.attention_inputs", "0 1", 0, 0, 0},
    {"cuda.pdl", "0 1", 0, 0, 0},
    {"cuda.grad_fast_accum", "0 1", 0, 0, 0},
    {"norm.stage", "0 1", 0, 0, 0},
    {"norm.bwd_block", "0 1", 0, 0, 0},
    {"comm.overlap", "0 1", 0, 0, 0},
    {"comm.bucket_mb", NULL, 1, 1 << 20, 1},
    {"tune.device", NULL, 0, 16, 0},
    {"gemm.", NULL, 0, 128, 0},   /* gemm.KEY: a cuBLASLt algorithm, 64 bytes in hex */
};

static bool word_listed(const char *words, const char *v)
{
    size_t n = strlen(v);
    for (const char *w = words; *w;) {
        size_t len = strcspn(w, " ");
        if (len == n && !strncmp(w, v, n)) return true;
        w += len + (w[len] == ' ');
    }
    return false;
}

const char *ir_choice_check(const char *name, const char *value, char *why, size_t why_len)
{
    /* NAME@ID sets one node: NAME's values */
    size_t base = strcspn(name, "@");
    if (name[base] && (!name[base + 1] || strspn(name + base + 1, "0123456789") != strlen(name + base + 1))) {
        snprintf(why, why_len, "'%s': a site is NAME@ID with a node number", name);
        return why;
    }
    const ChoiceRule *r = NULL;
    for (size_t i = 0; i < sizeof choice_rules / sizeof *choice_rules && !r; i++) {
        const char *n = choice_rules[i].name;
        size_t len = strlen(n);
        bool prefix = n[len - 1] == '.';
        if (prefix ? base > len && !strncmp(name, n, len) : base == len && !strncmp(name, n, len))
            r = &choice_rules[i];
    }
    if (!r) {
        snprintf(why, why_len, "unknown choice '%.*s' (docs/tuning.md lists them)", (int)base, name);
        return why;
    }
    if (name[base] && !choice_per_node(r->name)) {
        snprintf(why, why_len, "%.*s is one choice for the whole program: it takes no @ID", (int)base, name);
        return why;
    }
    if (r->words) {
        if (word_listed(r->words, value)) return NULL;
        snprintf(why, why_len, "%.*s takes one of: %s, not '%s'", (int)base, name, r->words, value);
        return why;
    }
    if (r->step == 0) {   /* hex digits */
        if (strlen(value) == (size_t)r->hi && strspn(value, "0123456789abcdefABCDEF") == (size_t)r->hi) return NULL;
        snprintf(why, why_len, "%.*s takes %lld hex digits, not '%s'", (int)base, name, (long long)r->hi, value);
        return why;
    }
    char *end;
    errno = 0;
    long long x = strtoll(value, &end, 10);
    if (end != value && !*end && errno == 0 && x >= r->lo && x <= r->hi && (x - r->lo) % r->step == 0) return NULL;
    if (r->step > 1)
        snprintf(why, why_len, "%.*s takes a multiple of %lld from %lld to %lld, not '%s'", (int)base, name,
                 (long long)r->step, (long long)r->lo, (long long)r->hi, value);
    else
        snprintf(why, why_len, "%.*s takes a whole number from %lld to %lld, not '%s'", (int)base, name,
                 (long long)r->lo, (long long)r->hi, value);
    return why;
}

bool ir_choice_name_ok(const char *s) { return choice_chars_ok(s, "_.@"); }
bool ir_choice_value_ok(const char *s) { return choice_chars_ok(s, "_.:+-"); }

void ir_set_choice(Graph *g, const char *name, const char *value)
{
    IR_ASSERT(ir_choice_name_ok(name) && ir_choice_value_ok(value));
    for (int i = 0; i < g->n_choices; i++)
        if (!strcmp(g->choices[i].name, name)) {
            g->choices[i].value = arena_strdup(g->arena, value);
            return;
        }
    Choice *bigger = arena_alloc(g->arena, sizeof *bigger * (size_t)(g->n_choices + 1));
    if (g->n_choices) memcpy(bigger, g->choices, sizeof *bigger * (size_t)g->n_choices);
    bigger[g->n_choices++] = (Choice){arena_strdup(g->arena, name), arena_strdup(g->arena, value)};
    g->choices = bigger;
}

static void graph_append(Graph *g, Node *n)
{
    if (g->n_nodes == g->cap) {
        Node **bigger = arena_alloc(g->arena, sizeof(Node *) * (size_t)g->cap * 2);
        memcpy(bigger, g->nodes, sizeof(Node *) * (size_t)g->n_nodes);
        g->nodes = bigger;
        g->cap *= 2;
    }
    n->index = g->n_nodes;
    g->nodes[g->n_nodes++] = n;
}

Node *ir_add(Graph *g, OpKind op, int n_in, Node *const *in, SrcLoc loc)
{
    Node *n = arena_alloc(g->arena, sizeof *n);
    n->op = op;
    n->n_in = n_in;
    n->in = n_in ? arena_alloc(g->arena, sizeof(Node *) * (size_t)n_in) : NULL;
    for (int i = 0; i < n_in; i++) {
        IR_ASSERT(in[i] != NULL);
        n->in[i] = in[i];
    }
    n->loc = loc;
    n->id = g->next_id++;
    n->t.fmt = fmt_plain(FMT_F32);
    n->t.offset = -1;
    n->t.role = ROLE_ACTIVATION;
    graph_append(g, n);
    return n;
}

Node *ir_add1(Graph *g, OpKind op, Node *a, SrcLoc loc) { return ir_add(g, op, 1, &a, loc); }

Node *ir_add2(Graph *g, OpKind op, Node *a, Node *b, SrcLoc loc)
{
    Node *in[2] = {a, b};
    return ir_add(g, op, 2, in, loc);
}

Node *ir_leaf(Graph *g, OpKind op, const char *name, Role role, ElemType elem, int rank,
              const int64_t *dims, SrcLoc loc)
{
    Node *n = ir_add(g, op, 0, NULL, loc);
    n->t.name = name ? arena_strdup(g->arena, name) : NULL;
    n->t.role = role;
    n->t.fmt = fmt_plain(elem);
    ir_set_shape(n, rank, dims);
    return n;
}

void ir_set_shape(Node *n, int rank, const int64_t *dims)
{
    IR_ASSERT(rank >= 0 && rank <= IR_MAX_RANK);
    n->t.rank = rank;
    for (int i = 0; i < IR_MAX_RANK; i++) n->t.dims[i] = i < rank ? dims[i] : 0;
}

bool ir_shape_fits(int rank, const int64_t *dims)
{
    int64_t n = 1;
    for (int i = 0; i < rank; i++)
        if (dims[i] < 0 || __builtin_mul_overflow(n, dims[i], &n) || n > IR_MAX_NUMEL) return false;
    return true;
}

/* Shapes are checked where they are made (ir_infer_shape, the front end), so an overflow here
 * is a compiler bug, not a user error. */
int64_t ir_numel(const Tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->rank; i++)
        if (__builtin_mul_overflow(n, t->dims[i], &n))
            ir_die(__FILE__, __LINE__, "element count of '%s' overflows", t->name ? t->name : "a tensor");
    return n;
}

bool ir_same_shape(const Tensor *a, const Tensor *b)
{
    if (a->rank != b->rank) return false;
    for (int i = 0; i < a->rank; i++)
        if (a->dims[i] != b->dims[i]) return false;
    return true;
}

Node *ir_find(const Graph *g, const char *name)
{
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->t.name && strcmp(g->nodes[i]->t.name, name) == 0) return g->nodes[i];
    return NULL;
}

void ir_renumber(Graph *g)
{
    for (int i = 0; i < g->n_nodes; i++) g->nodes[i]->index = i;
}

Uses *ir_fill_uses(const Graph *g)
{
    Uses *u = arena_alloc(g->arena, sizeof *u * (size_t)(g->n_nodes ? g->n_nodes : 1));
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        for (int j = 0; j < n->n_in; j++) u[n->in[j]->index].n++;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        u[i].list = arena_alloc(g->arena, sizeof(Node *) * (size_t)(u[i].n ? u[i].n : 1));
        u[i].n = 0;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        for (int j = 0; j < n->n_in; j++) {
            Uses *x = &u[n->in[j]->index];
            /* a node that reads the same input twice is one user */
            if (x->n && x->list[x->n - 1] == n) continue;
            x->list[x->n++] = n;
        }
    }
    return u;
}

void ir_replace_uses(Graph *g, Node *from, Node *to)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n == to) continue;
        for (int j = 0; j < n->n_in; j++)
            if (n->in[j] == from) n->in[j] = to;
        if (n->t.fmt.scale == from) n->t.fmt.scale = to;
        if (n->t.fmt.amax == from) n->t.fmt.amax = to;
    }
}

void ir_filter(Graph *g, const bool *keep)
{
    int k = 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (keep[i]) g->nodes[k++] = g->nodes[i];
    g->n_nodes = k;
    ir_renumber(g);
}

int ir_update_states(const Node *n)
{
    IR_ASSERT(ir_op_is_update(n->op));
    return n->op == OP_ADAMW ? 2 : 1;
}

int ir_update_lr_index(const Node *n) { return 2 + ir_update_states(n); }

UpdateHparams ir_update_hparams(const Node *n)
{
    UpdateHparams h = {0};
    switch (n->op) {
    case OP_ADAMW:
        h.b1 = IR_FATTR(n, ADAMW, beta1), h.b2 = IR_FATTR(n, ADAMW, beta2);
        h.eps = IR_FATTR(n, ADAMW, eps), h.wd = IR_FATTR(n, ADAMW, weight_decay);
        break;
    case OP_LION:
        h.b1 = IR_FATTR(n, LION, beta1), h.b2 = IR_FATTR(n, LION, beta2), h.wd = IR_FATTR(n, LION, weight_decay);
        break;
    case OP_SGD:
        h.b1 = IR_FATTR(n, SGD, momentum), h.wd = IR_FATTR(n, SGD, weight_decay);
        h.nesterov = IR_IATTR(n, SGD, nesterov) != 0;
        break;
    default: IR_ASSERT(!"not an update op");
    }
    return h;
}

/* copy is iattr 0 of every update op, so ADAMW's name reads it on LION and SGD too: 1, the
 * operands end (copy, scale, amax); 2, they end with the amax alone */
int ir_update_tail(const Node *n)
{
    IR_ASSERT(ir_op_is_update(n->op));
    int64_t copy = IR_IATTR(n, ADAMW, copy);
    return copy == 1 ? 3 : copy == 2 ? 1 : 0;
}

void ir_rope_table(int64_t T, int64_t head_dim, double theta, double *cs)
{
    for (int64_t p = 0; p < T; p++)
        for (int64_t i = 0; i < head_dim / 2; i++) {
            double ang = (double)p * pow(theta, -2.0 * (double)i / (double)head_dim);
            cs[2 * (p * (head_dim / 2) + i)] = cos(ang);
            cs[2 * (p * (head_dim / 2) + i) + 1] = sin(ang);
        }
}

int ir_adamw_copy_index(const Node *n)
{
    return ir_update_tail(n) == 3 ? n->n_in - 3 : -1;
}

int ir_update_amax_index(const Node *n)
{
    return ir_update_tail(n) ? n->n_in - 1 : -1;
}

int ir_adamw_master_index(const Node *n)
{
    int base = ir_update_lr_index(n) + 4;   /* lr, step, clip, grad_scale */
    return n->n_in - ir_update_tail(n) == base + 1 ? base : -1;
}

bool ir_mutates_input(const Node *n, int i)
{
    switch (n->op) {
    case OP_ACCUMULATE: case OP_AMAX_RECORD: case OP_DELAYED_SCALE: case OP_ASSIGN:
    case OP_ALL_REDUCE: return i == 0;
    case OP_ADAMW: case OP_LION: case OP_SGD: {
        int c = ir_adamw_copy_index(n);
        return i < ir_update_lr_index(n) || i == ir_adamw_master_index(n) || i == c || i == ir_update_amax_index(n);
    }
    default: return false;
    }
}

void ir_move_to_end(Graph *g, Node *n)
{
    IR_ASSERT(g->nodes[n->index] == n);
    int from = n->index;
    memmove(g->nodes + from, g->nodes + from + 1, sizeof(Node *) * (size_t)(g->n_nodes - 1 - from));
    g->nodes[g->n_nodes - 1] = n;
    for (int i = from; i < g->n_nodes; i++) g->nodes[i]->index = i;
}

void ir_move_before(Graph *g, Node *n, Node *pos)
{
    IR_ASSERT(g->nodes[n->index] == n && g->nodes[pos->index] == pos);
    int from = n->index, to = pos->index;
    if (from < to) return;   /* already earlier */
    memmove(g->nodes + to + 1, g->nodes + to, sizeof(Node *) * (size_t)(from - to));
    g->nodes[to] = n;
    for (int i = to; i <= from; i++) g->nodes[i]->index = i;
}
