/* plan.c — `fp8c plan`: what precision every tensor gets and what it costs, before anything runs.
 *
 * The table is read by people deciding between precision levels, so it is compact: tensors
 * that differ only in their layer number (h.0.attn..., h.1.attn...) are one row with a count,
 * and rows are grouped by role. Below it: bytes per category, the bytes per parameter of
 * persistent training state (the figure O0..O3 are compared by), and the peak of the step —
 * the persistent arena plus the step arena, exactly what the runtime allocates. A quantized copy
 * is labelled by the value it was quantized from ("h.*.ln_2:e4m3"). A second table lists the
 * transposed FP8 copies the layout pass decided on, and how each is made. `--json` gives every
 * tensor uncollapsed, with the value it was quantized from, for scripts. */
#include "compiler.h"
#include "codegen.h"
#ifdef FP8C_HAVE_CUDA
#include "gpu.h"
#endif
#include "rt.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *pattern;    /* name with layer numbers replaced by '*' */
    Role role;
    const Tensor *t;        /* a representative */
    int count;
    int64_t bytes;          /* all of them together */
} Row;

/* s as a JSON string, quoted and escaped (runtime/json.c), in the arena */
static const char *json_str(Arena *a, const char *s)
{
    size_t n = rt_json_quote(NULL, 0, s);
    char *q = arena_alloc(a, n + 1);
    rt_json_quote(q, n + 1, s);
    return q;
}

/* "h.11.attn.c_attn.weight" -> "h.*.attn.c_attn.weight" */
static const char *name_pattern(Arena *a, const char *name)
{
    char *out = arena_alloc(a, strlen(name) + 1), *o = out;
    for (const char *p = name; *p;) {
        bool component_start = p == name || p[-1] == '.';
        if (component_start && isdigit((unsigned char)*p)) {
            const char *q = p;
            while (isdigit((unsigned char)*q)) q++;
            if (*q == '.' || *q == 0 || *q == ':') {
                *o++ = '*';
                p = q;
                continue;
            }
        }
        *o++ = *p++;
    }
    *o = 0;
    return out;
}

static int64_t tensor_bytes(const Tensor *t)
{
    return t->bytes > 0 ? t->bytes : ir_numel(t) * fmt_elem_bytes(t->fmt.elem);
}

static bool listed(const Node *n)
{
    if (n->t.fmt.elem == FMT_VOID) return false;
    if (ir_role_is_persistent(n->t.role)) return n->n_in == 0;   /* the state, not its updates */
    return n->t.role == ROLE_SAVED || n->t.role == ROLE_INPUT || n->t.role == ROLE_WORKSPACE;
}

static void format_text(const Format *f, char *buf, size_t size)
{
    int k = snprintf(buf, size, "%s", fmt_elem_name(f->elem));
    if (f->scaling != SCALE_NONE) {
        if (f->scaling == SCALE_PER_GROUP) k += snprintf(buf + k, size - (size_t)k, " 1x%d", f->group);
        else k += snprintf(buf + k, size - (size_t)k, " /%s", fmt_scaling_name(f->scaling));
    }
    if (f->recipe != RECIPE_NONE) k += snprintf(buf + k, size - (size_t)k, " %s", fmt_recipe_name(f->recipe));
    if (f->codec != CODEC_PLAIN) snprintf(buf + k, size - (size_t)k, " %s", fmt_codec_name(f->codec));
}

static void shape_text(const Tensor *t, char *buf, size_t size)
{
    int k = snprintf(buf, size, "[");
    for (int i = 0; i < t->rank; i++) k += snprintf(buf + k, size - (size_t)k, i ? ",%lld" : "%lld", (long long)t->dims[i]);
    snprintf(buf + k, size - (size_t)k, "]");
}

static bool same_format(const Format *a, const Format *b)
{
    return a->elem == b->elem && a->scaling == b->scaling && a->group == b->group &&
           a->recipe == b->recipe && a->codec == b->codec;
}

/* A tensor without a name is shown by what made it and where: "gelu@gpt2.model:40"; a quantized
 * copy as its source's label with the format's element type: "gelu@gpt2.model:40:e4m3". */
static const char *label(Arena *a, const Node *x)
{
    if (x->t.name) return x->t.name;
    if (x->op == OP_QUANTIZE) return arena_printf(a, "%s:%s", label(a, x->in[0]), fmt_elem_name(x->t.fmt.elem));
    const char *file = x->loc.file ? strrchr(x->loc.file, '/') : NULL;
    file = file ? file + 1 : x->loc.file;
    if (file && x->loc.line > 0) return arena_printf(a, "%s@%s:%d", ir_op_info(x->op)->text, file, x->loc.line);
    return ir_op_info(x->op)->text;
}

static int category_rank(Role r);

static Row *collect_rows(const Graph *g, int *n_rows)
{
    Row *rows = arena_alloc(g->arena, sizeof *rows * (size_t)(g->n_nodes + 1));
    int n = 0;
    for (int rank = 0; rank <= ROLE_COUNT; rank++)
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *x = g->nodes[i];
            if (category_rank(x->t.role) != rank || !listed(x)) continue;
            const char *pat = name_pattern(g->arena, label(g->arena, x));
            int j = 0;
            for (; j < n; j++)
                if (rows[j].role == x->t.role && !strcmp(rows[j].pattern, pat) &&
                    ir_same_shape(rows[j].t, &x->t) && same_format(&rows[j].t->fmt, &x->t.fmt))
                    break;
            if (j == n) rows[n++] = (Row){pat, x->t.role, &x->t, 0, 0};
            rows[j].count++;
            rows[j].bytes += tensor_bytes(&x->t);
        }
    *n_rows = n;
    return rows;
}

static const char *human(int64_t bytes, char *buf)
{
    double b = (double)bytes;
    if (b >= 1 << 30) sprintf(buf, "%.2f GiB", b / (1 << 30));
    else if (b >= 1 << 20) sprintf(buf, "%.1f MiB", b / (1 << 20));
    else if (b >= 1 << 10) sprintf(buf, "%.1f KiB", b / (1 << 10));
    else sprintf(buf, "%lld B", (long long)bytes);
    return buf;
}

/* The categories of DESIGN.md's level table, in the order people ask about them. */
static const struct { const char *name; Role role; } categories[] = {
    {"weights", ROLE_PARAM},          {"master weights", ROLE_MASTER},
    {"gradients", ROLE_GRAD},         {"Adam m", ROLE_ADAM_M},
    {"Adam v", ROLE_ADAM_V},          {"scales", ROLE_SCALE},
    {"amax histories", ROLE_AMAX_HISTORY}, {"FP8 weight copies", ROLE_WEIGHT_COPY},
    {"saved activations", ROLE_SAVED},
    {"optimizer state", ROLE_OPTIM_STATE}, {"inputs", ROLE_INPUT},
    {"workspace", ROLE_WORKSPACE},
};

/* Rows follow the categories' order; roles outside it come last. */
static int category_rank(Role r)
{
    for (size_t c = 0; c < sizeof categories / sizeof categories[0]; c++)
        if (categories[c].role == r) return (int)c;
    return ROLE_COUNT;
}

/* The layout pass's transposed FP8 copies (passes/layout.c): a TRANSPOSE node, or the copy a
 * QUANTIZE with transposed=1 keeps after its result. Rows collapse over layers as above. */
typedef struct {
    const char *pattern, *made_by;
    int64_t dims[2];
    const char *phase;
    int count;
    int64_t bytes;
} CopyRow;

static bool transposed_copy_of(const Node *x, const char **made_by)
{
    if (x->op == OP_TRANSPOSE) *made_by = "a transpose";
    else if (x->op == OP_QUANTIZE && ir_transposed_offset(x)) *made_by = "its quantize, both layouts";
    else return false;
    return true;
}

static CopyRow *collect_copies(const Graph *g, int *n_rows)
{
    CopyRow *rows = arena_alloc(g->arena, sizeof *rows * (size_t)(g->n_nodes + 1));
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *x = g->nodes[i];
        const char *made_by;
        if (!transposed_copy_of(x, &made_by)) continue;
        const Tensor *t = &x->t;
        int64_t C = t->rank ? t->dims[t->rank - 1] : 1;
        int64_t dims[2] = {C, C ? ir_numel(t) / C : 0};   /* a quantize's copy: (C, rows) */
        if (x->op == OP_TRANSPOSE) dims[0] = t->dims[0], dims[1] = t->dims[1];
        const char *label_of = x->op == OP_TRANSPOSE && !x->t.name
                                   ? arena_printf(g->arena, "%s:T", label(g->arena, x->in[0]))
                                   : label(g->arena, x);
        const char *pat = name_pattern(g->arena, label_of);
        int j = 0;
        for (; j < n; j++)
            if (!strcmp(rows[j].pattern, pat) && rows[j].made_by == made_by && rows[j].dims[0] == dims[0] &&
                rows[j].dims[1] == dims[1])
                break;
        if (j == n) rows[n++] = (CopyRow){pat, made_by, {dims[0], dims[1]}, ir_phase_name(x->phase), 0, 0};
        rows[j].count++;
        rows[j].bytes += ir_numel(t) * fmt_elem_bytes(t->fmt.elem);
    }
    *n_rows = n;
    return rows;
}

/* GEMMs the precision pass planned in bf16 where FP8 was asked for, because cuBLASLt cannot
 * run them in FP8 (MATMUL unaligned=1): one row per weight pattern, kind and shape. */
typedef struct {
    const char *pattern, *kind;
    int64_t m, n, k;
    int count;
} FallbackRow;

/* The values passes/recompute.c made again in the backward (save.cheap=0): backward nodes in
 * an activation's role. Returns how many; *bytes: what they would take saved. */
static int recomputed_values(const Graph *g, int64_t *bytes)
{
    int n = 0;
    *bytes = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *x = g->nodes[i];
        if (x->phase == PHASE_FORWARD || x->t.role != ROLE_ACTIVATION) continue;
        n++;
        *bytes += ir_storage_bytes(x);
    }
    return n;
}

static FallbackRow *collect_fallbacks(const Graph *g, int *n_rows)
{
    FallbackRow *rows = arena_alloc(g->arena, sizeof *rows * (size_t)(g->n_nodes + 1));
    int n = 0;
    Uses *uses = NULL;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *mm = g->nodes[i];
        if (mm->op != OP_MATMUL || !IR_IATTR(mm, MATMUL, unaligned)) continue;
        if (!uses) uses = ir_fill_uses(g);
        const char *weight;
        const char *kind = precision_gemm_kind(mm, uses, &weight);
        FallbackRow r = {name_pattern(g->arena, *weight ? weight : "(no weight)"), kind, 0, 0, 0, 0};
        ir_matmul_dims(mm, &r.m, &r.n, &r.k);
        int j = 0;
        for (; j < n; j++)
            if (!strcmp(rows[j].pattern, r.pattern) && rows[j].kind == r.kind && rows[j].m == r.m &&
                rows[j].n == r.n && rows[j].k == r.k)
                break;
        if (j == n) rows[n++] = r;
        rows[j].count++;
    }
    *n_rows = n;
    return rows;
}

/* the sizes that are no multiple of 16: "K = 150", "M = 150 and N = 257" */
static const char *fallback_why(Arena *a, const FallbackRow *r)
{
    const char *names[3] = {"M", "N", "K"};
    int64_t dims[3] = {r->m, r->n, r->k};
    char *out = arena_printf(a, "%s", "");
    for (int i = 0, shown = 0; i < 3; i++)
        if (dims[i] % PRECISION_FP8_GEMM_ALIGN)
            out = arena_printf(a, "%s%s%s = %lld", out, shown++ ? " and " : "", names[i], (long long)dims[i]);
    return out;
}

/* The data-parallel build's gradient all-reduce (comm.c): how many tensors, their bytes, the
 * GPUs planned for, and what each GPU sends per step (rt_comm_sent_bytes: a ring all-reduce
 * sends 2 (N-1) / N of the bytes; the FP8 reduction its shards twice, one byte an element). */
typedef struct {
    int count, ranks;
    int64_t bytes, sent;
    int64_t sent_plain;     /* what the default reduction (the accumulators' formats) sends */
    char formats[32];
    RtCommPlan buckets;     /* rt_comm_plan's: how the runtime sends them */
    bool overlap;           /* the choice comm.overlap */
} PlanComm;

static PlanComm plan_comm(const Graph *g)
{
    PlanComm c = {0};
    bool f32 = false, bf16 = false;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->op != OP_ALL_REDUCE) continue;
        c.count++;
        c.ranks = (int)IR_IATTR(n, ALL_REDUCE, ranks);
        c.bytes += ir_numel(&n->t) * fmt_elem_bytes(n->t.fmt.elem);
        f32 |= n->t.fmt.elem == FMT_F32;
        bf16 |= n->t.fmt.elem == FMT_BF16;
    }
    snprintf(c.formats, sizeof c.formats, "%s%s%s", bf16 ? "bf16" : "", bf16 && f32 ? " and " : "",
             f32 ? "f32" : "");
    if (!rt_comm_plan(g, &c.buckets)) memset(&c.buckets, 0, sizeof c.buckets);
    c.overlap = rt_comm_overlap(g);
    c.sent = rt_comm_sent_bytes(&c.buckets, c.ranks);
    RtCommPlan plain = c.buckets;
    plain.wire = FMT_VOID;
    c.sent_plain = rt_comm_sent_bytes(&plain, c.ranks);
    return c;
}

/* The FP8 reduction's collectives (comm_fp8.c), each with the bytes one GPU sends per step:
 * name, format, bytes. Returns how many. */
typedef struct {
    const char *name, *format;
    int64_t bytes;
} PlanCollective;

static int plan_collectives(const PlanComm *c, PlanCollective *out)
{
    const RtCommPlan *p = &c->buckets;
    int n = c->ranks;
    if (n <= 1) return 0;
    if (p->wire == FMT_VOID) {
        out[0] = (PlanCollective){"all_reduce sum (ring)", c->formats, c->sent};
        return 1;
    }
    int64_t shards = 0;
    for (int b = 0; b < p->n_buckets; b++) shards += rt_comm_fp8_shard(p->buckets[b].elems, n);
    int64_t each = (n - 1) * shards * fmt_elem_bytes(p->wire);
    out[0] = (PlanCollective){"all_to_all (send/recv)", fmt_elem_name(p->wire), each};
    out[1] = (PlanCollective){"all_gather", fmt_elem_name(p->wire), each};
    out[2] = (PlanCollective){"all_reduce max (scales)", "f32", c->sent - 2 * each};
    return 3;
}

/* The optimizer the step runs and its settings (lr is the binary's default peak). */
static void optimizer_line(const Graph *g, FILE *out)
{
    const OptimSpec *o = &g->optim;
    fprintf(out, "optimizer %s: lr %g, ", ir_optim_name(o->kind), o->lr);
    if (o->kind == OPTIM_ADAMW) fprintf(out, "betas %g, %g, eps %g, ", o->beta1, o->beta2, o->eps);
    if (o->kind == OPTIM_LION) fprintf(out, "betas %g, %g, ", o->beta1, o->beta2);
    if (o->kind == OPTIM_SGD) fprintf(out, "momentum %g%s, ", o->momentum, o->nesterov ? " (nesterov)" : "");
    fprintf(out, "weight decay %g (%s), clip %g; %d state%s a parameter\n\n", o->weight_decay,
            o->kind == OPTIM_SGD ? "L2, in the gradient" : "decoupled", o->clip,
            o->kind == OPTIM_ADAMW ? 2 : 1, o->kind == OPTIM_ADAMW ? "s" : "");
}

/* --shard-states (runtime/comm_shard.c): the collectives of a sharded step, per GPU. */
static int shard_collectives(const RtShardPlan *sp, const PlanComm *c, PlanCollective *out)
{
    int k = 0;
    out[k++] = (PlanCollective){"reduce_scatter sum", c->formats, sp->sent_reduce_scatter};
    if (sp->stage >= 3) {   /* each micro-step's forward and backward gather the layers */
        if (sp->sent_gather_fp8)
            out[k++] = (PlanCollective){"all_gather (layers, FP8)", "e4m3", sp->sent_gather_fp8};
        if (sp->sent_gather_bf16)
            out[k++] = (PlanCollective){"all_gather (layers, bf16)", "bf16", sp->sent_gather_bf16};
        if (sp->gather_amax_values)
            out[k++] = (PlanCollective){"all_reduce max (amax)", "f32", sp->sent_gather_scalars};
        out[k++] = (PlanCollective){"all_gather (whole params)", "bf16", sp->sent_gather_weights};
    } else {
        out[k++] = (PlanCollective){"all_gather (weights)", "bf16", sp->sent_gather_weights};
    }
    if (sp->copy_bytes) out[k++] = (PlanCollective){"all_gather (FP8 copies)", "e4m3", sp->sent_gather_copies};
    out[k++] = (PlanCollective){"all_reduce (norm, amax)", "f64/f32", sp->sent_scalars};
    return k;
}

/* The per-GPU figures of a sharded build, after the whole step's. */
static void shard_text(const Graph *g, const MemSummary *m, const PlanComm *c, const RtShardPlan *sp,
                       FILE *out)
{
    char b1[32];
    int n = sp->ranks;
    int64_t persistent = m->persistent - sp->saved;
    if (sp->stage >= 3)
        fprintf(out, "\ndata parallel over %d GPUs with sharded weights, state and gradients (--shard-states=3,\n"
                     "ZeRO stage 3; not yet run on GPUs): the figures above are one GPU's whole step;\n"
                     "each GPU keeps 1/%d of %d weights (the GEMMs' matrices, gathered per layer while\n"
                     "the step runs) and of the gradient accumulators, master weights and optimizer states,\n"
                     "per tensor, on multiples of the norm's chunk (%lld elements); %d parameters,\n"
                     "%s, stay whole (%d vectors: norm weights and biases; %d matrices read by more\n"
                     "than a GEMM: embeddings)",
                n, n, sp->gathered_weights, (long long)sp->group, sp->whole_params,
                human(sp->whole_param_bytes, b1), sp->whole_params - sp->whole_matrices, sp->whole_matrices);
    else if (sp->stage >= 2)
        fprintf(out, "\ndata parallel over %d GPUs with sharded state and gradients (--shard-states=2, ZeRO\n"
                     "stage 2): the figures above are one GPU's whole step; each GPU keeps the weights whole\n"
                     "and 1/%d of the gradient accumulators, master weights and optimizer states, per tensor,\n"
                     "on multiples of the gradient norm's chunk (%lld elements)", n, n, (long long)sp->group);
    else
        fprintf(out, "\ndata parallel over %d GPUs with sharded state (--shard-states, ZeRO stage 1): the\n"
                     "figures above are one GPU's whole step; each GPU keeps the weights and gradients whole\n"
                     "and 1/%d of the master weights and optimizer states, per tensor, on multiples of the\n"
                     "gradient norm's chunk (%lld elements)", n, n, (long long)sp->group);
    if (sp->whole_updates) fprintf(out, "; %d tensors too small to split stay whole on GPU 0", sp->whole_updates);
    fprintf(out, ":\n  %-24s %12s %10s\n", "category (per GPU)", "bytes", "per param");
    for (size_t k = 0; k < sizeof categories / sizeof categories[0]; k++) {
        Role r = categories[k].role;
        if (!ir_role_is_persistent(r) || !m->by_role[r]) continue;
        const char *name = r == ROLE_ADAM_M && g->optim.kind != OPTIM_ADAMW ? "momentum" : categories[k].name;
        fprintf(out, "  %-24s %12s %10.2f%s\n", name, human(sp->per_gpu[r], b1),
                m->n_params ? (double)sp->per_gpu[r] / (double)m->n_params : 0,
                sp->per_gpu[r] != m->by_role[r] ? "  (1/N)" : "");
    }
    fprintf(out, "persistent training state per GPU  %s = %.2f bytes per parameter (one GPU: %.2f)\n",
            human(persistent, b1), m->n_params ? (double)persistent / (double)m->n_params : 0,
            m->n_params ? (double)m->persistent / (double)m->n_params : 0);
    if (sp->stage >= 3) {
        char b2[32], b3[32], b4[32];
        fprintf(out, "step arena per GPU                 %s + %s of gradient buffers\n"
                     "                                   + %s of layer buffers (%d, each a gathered\n"
                     "                                   layer's, reused once its last reader ran:\n"
                     "                                   comm_weights.c) = %s\n",
                human(m->transient, b1), human(sp->grad_buffer_bytes, b2), human(sp->gather_buffer_bytes, b3),
                sp->gather_buffers,
                human(m->transient + sp->grad_buffer_bytes + sp->gather_buffer_bytes, b4));
        fprintf(out, "peak memory per GPU                %s\n",
                human(persistent + m->transient + sp->grad_buffer_bytes + sp->gather_buffer_bytes, b1));
    } else if (sp->stage >= 2) {
        char b2[32], b3[32];
        fprintf(out, "step arena per GPU                 %s + %s of gradient buffers (each bucket's, reused\n"
                     "                                   once it is reduced: comm_grads.c) = %s\n",
                human(m->transient, b1), human(sp->grad_buffer_bytes, b2),
                human(m->transient + sp->grad_buffer_bytes, b3));
        fprintf(out, "peak memory per GPU                %s (each micro-step's bucket sums land in the\n"
                     "                                   owners' shard accumulators)\n",
                human(persistent + m->transient + sp->grad_buffer_bytes, b1));
    } else {
        fprintf(out, "peak memory per GPU                %s (each shard's sum lands in its accumulator)\n",
                human(persistent + m->transient, b1));
    }
    if (sp->stage >= 3) {
        char b2[32], b3[32];
        fprintf(out, "Each micro-step gathers every sharded layer twice, in the forward and again in the\n"
                     "backward, each layer prefetched while the one before it computes (%s in e4m3,\n"
                     "%s in bf16, whole)%s; it reduce-scatters %d gradients, %s (%s);\n"
                     "each step gathers the %d whole parameters' new values and all-reduces the\n"
                     "gradient norm's f64 sums of chunks of %d elements%s:\n",
                human(sp->gathered_fp8, b1), human(sp->gathered_bf16, b2),
                sp->gather_amax_values ? ",\nthe FP8 ones after an all-reduce (max) of each weight's amax in the forward" : "",
                c->count, human(c->bytes, b3), c->formats, sp->whole_params, IR_SQNORM_CHUNK,
                sp->amax_values ? " and the FP8 copies' amaxes" : "");
    } else {
        fprintf(out, "Each %s reduce-scatters %d gradients, %s (%s), each step gathers the new\n"
                     "weights%s, and all-reduces the gradient norm's f64 sums of chunks of %d\n"
                     "elements (the same on any number of GPUs)%s:\n",
                sp->stage >= 2 ? "micro-step" : "step", c->count, human(c->bytes, b1), c->formats,
                sp->copy_bytes ? " and their e4m3 copies" : "", IR_SQNORM_CHUNK,
                sp->amax_values ? " and the weights' amaxes" : "");
    }
    PlanCollective coll[8];
    int n_coll = shard_collectives(sp, c, coll);
    fprintf(out, "  %-26s %-8s %s\n", "collective", "format", "sent per GPU per step");
    for (int i = 0; i < n_coll; i++)
        fprintf(out, "  %-26s %-8s %s%s\n", coll[i].name, coll[i].format, human(coll[i].bytes, b1),
                (!i && sp->stage >= 2) || (sp->stage >= 3 && (strstr(coll[i].name, "layers") ||
                                                             !strcmp(coll[i].name, "all_reduce max (amax)")))
                    ? " (x --grad-accum)" : "");
    if (sp->stage >= 3)
        fprintf(out, "(a layer's gather: the owners' shards, all-gathered into the layer's buffer: runtime/\n"
                     "comm_weights.c; the rest as stage 2's: cuda/exec_shard.c)\n");
    else
        fprintf(out, "(the reduce-scatter is one ncclReduce per shard, to its owner; the gathers are\n"
                     "broadcasts from each shard's owner: cuda/exec_shard.c)\n");
}

void plan_print(const Graph *g, bool json, FILE *out)
{
    MemSummary m;
    memplan_summarize(g, &m);
    double per_param = m.n_params ? (double)m.persistent / (double)m.n_params : 0;
    int64_t peak = m.persistent + m.transient;
    if (json) {
        fprintf(out, "{\"model\": %s, \"opt_level\": %d, \"batch\": %lld, \"seq\": %lld, \"params\": %lld,\n",
                json_str(g->arena, g->model_name ? g->model_name : ""), g->opt_level, (long long)g->batch, (long long)g->seq,
                (long long)m.n_params);
        fprintf(out, " \"optimizer\": \"%s\",\n", ir_optim_name(g->optim.kind));
        fprintf(out, " \"tensors\": [\n");
        bool first = true;
        for (int i = 0; i < g->n_nodes; i++) {
            const Node *x = g->nodes[i];
            if (!listed(x)) continue;
            char shape[128], fmt[96];
            shape_text(&x->t, shape, sizeof shape);
            format_text(&x->t.fmt, fmt, sizeof fmt);
            const char *from = x->op == OP_QUANTIZE ? label(g->arena, x->in[0]) : "";
            fprintf(out, "%s  {\"name\": %s, \"role\": \"%s\", \"shape\": %s, \"format\": \"%s\", "
                         "\"elem\": \"%s\", \"scaling\": \"%s\", \"recipe\": \"%s\", \"codec\": \"%s\", "
                         "\"quantized_from\": %s, \"bytes\": %lld}",
                    first ? "" : ",\n", json_str(g->arena, label(g->arena, x)),
                    ir_role_name(x->t.role), shape, fmt, fmt_elem_name(x->t.fmt.elem),
                    fmt_scaling_name(x->t.fmt.scaling), fmt_recipe_name(x->t.fmt.recipe),
                    fmt_codec_name(x->t.fmt.codec), json_str(g->arena, from), (long long)tensor_bytes(&x->t));
            first = false;
        }
        fprintf(out, "\n ],\n \"transposed_copies\": [");
        int n_copies;
        CopyRow *copies = collect_copies(g, &n_copies);
        for (int i = 0; i < n_copies; i++)
            fprintf(out, "%s\n  {\"name\": %s, \"count\": %d, \"made_by\": \"%s\", \"phase\": \"%s\", "
                         "\"shape\": [%lld,%lld], \"bytes\": %lld}",
                    i ? "," : "", json_str(g->arena, copies[i].pattern), copies[i].count, copies[i].made_by, copies[i].phase,
                    (long long)copies[i].dims[0], (long long)copies[i].dims[1], (long long)copies[i].bytes);
        fprintf(out, "%s],\n \"bf16_gemms\": [", n_copies ? "\n " : "");
        int n_fallbacks;
        FallbackRow *fb = collect_fallbacks(g, &n_fallbacks);
        for (int i = 0; i < n_fallbacks; i++)
            fprintf(out, "%s\n  {\"weight\": %s, \"kind\": \"%s\", \"count\": %d, \"m\": %lld, "
                         "\"n\": %lld, \"k\": %lld, \"why\": \"%s not a multiple of %d\"}",
                    i ? "," : "", json_str(g->arena, fb[i].pattern), fb[i].kind, fb[i].count, (long long)fb[i].m, (long long)fb[i].n,
                    (long long)fb[i].k, fallback_why(g->arena, &fb[i]), PRECISION_FP8_GEMM_ALIGN);
        fprintf(out, "%s],\n \"totals\": {", n_fallbacks ? "\n " : "");
        for (size_t c = 0; c < sizeof categories / sizeof categories[0]; c++)
            fprintf(out, "%s\"%s\": %lld", c ? ", " : "", categories[c].name,
                    (long long)m.by_role[categories[c].role]);
        PlanComm c = plan_comm(g);
        int64_t re_bytes;
        int n_re = recomputed_values(g, &re_bytes);
        fprintf(out, "},\n \"recomputed\": %d, \"recomputed_bytes\": %lld,", n_re, (long long)re_bytes);
        fprintf(out, "\n \"persistent_bytes\": %lld, \"step_bytes\": %lld, \"peak_bytes\": %lld,"
                     " \"bytes_per_param\": %.3f,\n \"gpus\": %d, \"allreduce_tensors\": %d,"
                     " \"allreduce_bytes\": %lld, \"sent_bytes_per_gpu\": %lld,\n"
                     " \"allreduce_overlap\": %s, \"allreduce_wire\": \"%s\", \"allreduce_buffer_bytes\": %lld,\n"
                     " \"allreduce_collectives\": [",
                (long long)m.persistent, (long long)m.transient, (long long)peak, per_param,
                c.ranks ? c.ranks : 1, c.count, (long long)c.bytes, (long long)c.sent,
                c.overlap ? "true" : "false",
                c.buckets.wire == FMT_VOID ? c.formats : fmt_elem_name(c.buckets.wire),
                (long long)rt_comm_fp8_buffer_bytes(&c.buckets, c.ranks));
        PlanCollective coll[3];
        int n_coll = plan_collectives(&c, coll);
        for (int i = 0; i < n_coll; i++)
            fprintf(out, "%s{\"collective\": \"%s\", \"format\": \"%s\", \"bytes_per_gpu\": %lld}",
                    i ? ", " : "", coll[i].name, coll[i].format, (long long)coll[i].bytes);
        RtShardPlan sp;
        rt_shard_plan(g, m.by_role, c.ranks ? c.ranks : 1, &sp);
        int64_t gpu_persistent = m.persistent - sp.saved;
        fprintf(out, "],\n \"shard_states\": %s, \"shard_stage\": %d, \"per_gpu_grad_buffer_bytes\": %lld,"
                     " \"per_gpu_gather_buffer_bytes\": %lld, \"gathered_weights\": %d, \"whole_params\": %d,"
                     " \"per_gpu\": {", sp.on ? "true" : "false", sp.on ? sp.stage : 0,
                (long long)sp.grad_buffer_bytes, (long long)sp.gather_buffer_bytes, sp.gathered_weights,
                sp.whole_params);
        for (size_t k = 0; k < sizeof categories / sizeof categories[0]; k++)
            fprintf(out, "%s\"%s\": %lld", k ? ", " : "", categories[k].name, (long long)sp.per_gpu[categories[k].role]);
        fprintf(out, "},\n \"per_gpu_persistent_bytes\": %lld, \"per_gpu_bytes_per_param\": %.3f,"
                     " \"per_gpu_peak_bytes\": %lld, \"shard_collectives\": [",
                (long long)gpu_persistent, m.n_params ? (double)gpu_persistent / (double)m.n_params : 0,
                (long long)(gpu_persistent + m.transient + sp.grad_buffer_bytes + sp.gather_buffer_bytes));
        PlanCollective sc[8];
        int n_sc = sp.on ? shard_collectives(&sp, &c, sc) : 0;
        for (int i = 0; i < n_sc; i++)
            fprintf(out, "%s{\"collective\": \"%s\", \"format\": \"%s\", \"bytes_per_gpu\": %lld}",
                    i ? ", " : "", sc[i].name, sc[i].format, (long long)sc[i].bytes);
        fprintf(out, "],\n \"allreduce_buckets\": [");
        for (int i = 0; i < c.buckets.n_buckets; i++)
            fprintf(out, "%s{\"tensors\": %d, \"bytes\": %lld}", i ? ", " : "", c.buckets.buckets[i].count,
                    (long long)c.buckets.buckets[i].bytes);
        fprintf(out, "]}\n");
        rt_comm_plan_free(&c.buckets);
        return;
    }
    int n_rows;
    Row *rows = collect_rows(g, &n_rows);
    char b1[32], b2[32];
    fprintf(out, "plan of %s at -O%d, batch %lld, seq %lld: %lld parameters\n\n",
            g->model_name ? g->model_name : "model", g->opt_level, (long long)g->batch,
            (long long)g->seq, (long long)m.n_params);
    if (g->optim.present) optimizer_line(g, out);
    fprintf(out, "%-40s %-10s %-15s %-20s %11s\n", "tensor (x count)", "role", "shape", "format", "bytes");
    for (int i = 0; i < n_rows; i++) {
        char shape[64], fmt[64], name[80];
        shape_text(rows[i].t, shape, sizeof shape);
        format_text(&rows[i].t->fmt, fmt, sizeof fmt);
        if (rows[i].count > 1) snprintf(name, sizeof name, "%s x%d", rows[i].pattern, rows[i].count);
        else snprintf(name, sizeof name, "%s", rows[i].pattern);
        fprintf(out, "%-40.40s %-10s %-15.15s %-20.20s %11s\n", name, ir_role_name(rows[i].role), shape,
                fmt, human(rows[i].bytes, b1));
    }
    int n_copies;
    CopyRow *copies = collect_copies(g, &n_copies);
    if (n_copies) {
        fprintf(out, "\ntransposed FP8 copies (an FP8 GEMM reads both operands k-contiguous; made in the step arena)\n");
        fprintf(out, "%-40s %-27s %-9s %-15s %11s\n", "copy (x count)", "made by", "phase", "shape", "bytes");
        for (int i = 0; i < n_copies; i++) {
            char name[80], shape[64];
            if (copies[i].count > 1) snprintf(name, sizeof name, "%s x%d", copies[i].pattern, copies[i].count);
            else snprintf(name, sizeof name, "%s", copies[i].pattern);
            snprintf(shape, sizeof shape, "[%lld,%lld]", (long long)copies[i].dims[0], (long long)copies[i].dims[1]);
            fprintf(out, "%-40.40s %-27s %-9s %-15.15s %11s\n", name, copies[i].made_by, copies[i].phase, shape,
                    human(copies[i].bytes, b1));
        }
    }
    int n_fallbacks;
    FallbackRow *fb = collect_fallbacks(g, &n_fallbacks);
    if (n_fallbacks) {
        fprintf(out, "\nGEMMs planned in bf16 instead of FP8: FP8 GEMMs need M, N and K to be "
                     "multiples of %d\n", PRECISION_FP8_GEMM_ALIGN);
        fprintf(out, "%-40s %-6s %-26s %s\n", "weight (x count)", "GEMM", "M x N x K", "why");
        for (int i = 0; i < n_fallbacks; i++) {
            char name[80], dims[64];
            if (fb[i].count > 1) snprintf(name, sizeof name, "%s x%d", fb[i].pattern, fb[i].count);
            else snprintf(name, sizeof name, "%s", fb[i].pattern);
            snprintf(dims, sizeof dims, "%lld x %lld x %lld", (long long)fb[i].m, (long long)fb[i].n, (long long)fb[i].k);
            fprintf(out, "%-40.40s %-6s %-26s %s\n", name, fb[i].kind, dims, fallback_why(g->arena, &fb[i]));
        }
    }
    fprintf(out, "\n%-24s %12s %10s\n", "category", "bytes", "per param");
    for (size_t c = 0; c < sizeof categories / sizeof categories[0]; c++) {
        int64_t v = m.by_role[categories[c].role];
        if (!v) continue;
        /* Lion's and SGD's one state has Adam m's role */
        const char *name = categories[c].role == ROLE_ADAM_M && g->optim.kind != OPTIM_ADAMW ? "momentum"
                                                                                              : categories[c].name;
        fprintf(out, "%-24s %12s %10.2f\n", name, human(v, b1),
                m.n_params ? (double)v / (double)m.n_params : 0);
    }
    bool released = false;
    for (int i = 0; i < g->n_nodes; i++)
        if (ir_op_is_update(g->nodes[i]->op) && g->nodes[i]->in[1]->op != OP_ACCUMULATE &&
            g->nodes[i]->in[1]->op != OP_ALL_REDUCE)
            released = true;
    if (released)
        fprintf(out, "\ngradient release: each update runs in the backward as soon as its gradient is\n"
                     "complete; instead of global-norm clipping each gradient is clipped to its share\n"
                     "of the bound, max_norm * sqrt(its elements / all); --grad-accum above 1 is refused.\n");
    int64_t re_bytes;
    int n_re = recomputed_values(g, &re_bytes);
    if (n_re) {
        bool cheap = !precision_cheap_saved(g), qkv = !precision_attention_inputs_saved(g);
        fprintf(out, "\nrecomputed in the backward (%s%s%s): %d values (%s%s%s), made\n"
                     "again from what the backward keeps instead of saved across the step (%s).\n",
                cheap ? "save.cheap=0" : "", cheap && qkv ? ", " : "", qkv ? "save.attention_inputs=0" : "", n_re,
                cheap ? "norms, elementwise ops" : "", cheap && qkv ? "; " : "",
                qkv ? "attention's q, k, v: their GEMMs, bias and RoPE" : "", human(re_bytes, b1));
    }
    fprintf(out, "\npersistent training state  %s = %.2f bytes per parameter\n", human(m.persistent, b1), per_param);
    fprintf(out, "step arena (peak live)     %s\n", human(m.transient, b1));
    fprintf(out, "peak memory of the step    %s\n", human(peak, b2));
    PlanComm c = plan_comm(g);
    RtShardPlan sp;
    rt_shard_plan(g, m.by_role, c.ranks ? c.ranks : 1, &sp);
    if (c.count && sp.on) {
        shard_text(g, &m, &c, &sp, out);
        const RtCommPlan *cp = &c.buckets;
        fprintf(out, "%d buckets of about %s, each reduce-scattered as soon as the backward has "
                     "finished it:\n", cp->n_buckets, human(cp->cap, b1));
    } else if (c.count) {
        char b3[32];
        fprintf(out, "\ndata parallel over %d GPUs (fp8c build --gpus %d): the figures above are per GPU\n"
                     "(each keeps whole weights and optimizer state). Each step sums %d gradients,\n",
                c.ranks, c.ranks, c.count);
        const RtCommPlan *cp = &c.buckets;
        if (cp->wire == FMT_VOID) {
            fprintf(out, "%s (%s), over the GPUs; a ring sends 2(N-1)/N of that: %s per GPU per step.\n",
                    human(c.bytes, b1), c.formats, human(c.sent, b3));
        } else {
            char b4[32];
            const char *w = fmt_elem_name(cp->wire);
            fprintf(out, "%s (%s), over the GPUs, sent in %s with one scale per bucket (comm:grad=%s):\n"
                         "each bucket's %s shards all-to-all, summed in f32 in rank order, the sums\n"
                         "all-gathered in %s: %s per GPU per step (a %s ring all-reduce: %s).\n",
                    human(c.bytes, b1), c.formats, w, w, w, w, human(c.sent, b3), c.formats,
                    human(c.sent_plain, b4));
        }
        PlanCollective coll[3];
        int n_coll = plan_collectives(&c, coll);
        fprintf(out, "  %-26s %-8s %s\n", "collective", "format", "sent per GPU per step");
        for (int i = 0; i < n_coll; i++)
            fprintf(out, "  %-26s %-8s %s\n", coll[i].name, coll[i].format, human(coll[i].bytes, b1));
        if (cp->wire != FMT_VOID)
            fprintf(out, "The FP8 reduction's buffers take %s more on each GPU, beside the arenas.\n",
                    human(rt_comm_fp8_buffer_bytes(cp, c.ranks), b1));
        if (c.overlap)
            fprintf(out, "%d buckets of about %s, each sent by NCCL on its own stream as soon as the\n"
                         "last micro-step's backward has finished it (comm.overlap=1):\n",
                    cp->n_buckets, human(cp->cap, b1));
        else
            fprintf(out, "%d buckets of about %s, all sent at the start of the update, after the\n"
                         "backward (comm.overlap=0):\n", cp->n_buckets, human(cp->cap, b1));
    }
    if (c.count) {
        const RtCommPlan *cp = &c.buckets;
        fprintf(out, "  %-6s %9s %11s  %s\n", "bucket", "gradients", "bytes",
                "first .. last (in the order sent)");
        for (int i = 0; i < cp->n_buckets; i++) {
            const RtBucket *b = &cp->buckets[i];
            const Node *f = cp->reduce[b->first], *l = cp->reduce[b->first + b->count - 1];
            fprintf(out, "  %-6d %9d %11s  %s .. %s\n", i, b->count, human(b->bytes, b1),
                    f->grad_of && f->grad_of->t.name ? f->grad_of->t.name : "?",
                    l->grad_of && l->grad_of->t.name ? l->grad_of->t.name : "?");
        }
    }
    rt_comm_plan_free(&c.buckets);
}

void plan_print_diff(const Graph *a, const Graph *b, bool json, FILE *out)
{
    MemSummary ma, mb;
    memplan_summarize(a, &ma);
    memplan_summarize(b, &mb);
    int64_t pa = ma.persistent + ma.transient, pb = mb.persistent + mb.transient;
    if (json) {
        fprintf(out, "{\"a\": {\"opt_level\": %d, \"persistent_bytes\": %lld, \"peak_bytes\": %lld},"
                     " \"b\": {\"opt_level\": %d, \"persistent_bytes\": %lld, \"peak_bytes\": %lld},"
                     " \"peak_ratio\": %.4f}\n",
                a->opt_level, (long long)ma.persistent, (long long)pa, b->opt_level,
                (long long)mb.persistent, (long long)pb, pa ? (double)pb / (double)pa : 0);
        return;
    }
    char x[32], y[32];
    fprintf(out, "%-24s %14s %14s %8s\n", "category", "-O", "-O", "b/a");
    fprintf(out, "%-24s %14d %14d\n", "", a->opt_level, b->opt_level);
    for (size_t c = 0; c < sizeof categories / sizeof categories[0]; c++) {
        int64_t va = ma.by_role[categories[c].role], vb = mb.by_role[categories[c].role];
        if (!va && !vb) continue;
        fprintf(out, "%-24s %14s %14s %8.2f\n", categories[c].name, human(va, x), human(vb, y),
                va ? (double)vb / (double)va : 0);
    }
    fprintf(out, "%-24s %14.2f %14.2f\n", "bytes per parameter",
            ma.n_params ? (double)ma.persistent / (double)ma.n_params : 0,
            mb.n_params ? (double)mb.persistent / (double)mb.n_params : 0);
    fprintf(out, "%-24s %14s %14s %8.2f\n", "peak of the step", human(pa, x), human(pb, y),
            pa ? (double)pb / (double)pa : 0);
}

/* ---------------------------------------------------------------- the kernel program */

/* The graph as the training binary holds it: its artifact text read back and renumbered, so
 * the program listed is the one that binary lowers at start-up. */
static Graph *as_artifact(const Graph *g, Arena *a)
{
    char *text = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&text, &len);
    if (!m) return NULL;
    ir_print(g, m);
    fclose(m);
    Graph *back = ir_read(a, "artifact", text);
    free(text);
    if (back) ir_renumber(back);
    return back;
}

bool plan_print_kernels(const Graph *g, const char *device, FILE *out)
{
    Arena *a = arena_new();
    Graph *h = as_artifact(g, a);
    bool ok = h != NULL;
    if (!ok) fprintf(stderr, "fp8c: error: the plan's artifact did not read back\n");
    if (ok && !strcmp(device, "cpu")) {
        CgProgram *p = cg_lower(h, a, NULL);
        ok = p != NULL;
        if (ok) cg_program_print_table(p, out);
        else fprintf(stderr, "fp8c: error: the CPU kernel program of this plan could not be made\n");
    } else if (ok) {
#ifdef FP8C_HAVE_CUDA
        char why[512] = "";
        ok = cuda_print_program(h, a, out, why, sizeof why);
        if (!ok) fprintf(stderr, "fp8c: error: the GPU cannot run this plan: %s\n", why);
#else
        fprintf(stderr, "fp8c: error: --device cuda: this fp8c was built without the CUDA toolkit\n");
        ok = false;
#endif
    }
    arena_free(a);
    return ok;
}
