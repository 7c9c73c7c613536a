/* spec.c — what the GPU runs for each node: kernels of the library, or a cuBLASLt GEMM.
 *
 * The compiler (to know which kernels to compile) and the training binary (to launch them)
 * both call cuda_plan_graph on the same scheduled graph, so the plan is never stored: it is a
 * pure function of the node, its tensors' shapes and formats, and its attributes, except where
 * a producer writes the FP8 copy of its value itself (fuse_producer_quantizes: a function of
 * the node, its uses and the memory plan's offsets). A launch
 * names the library template it instantiates ("ck_norm<1, F<FMT_BF16, SCALE_NONE>, ..>(a)")
 * and its function is named after a hash of that text, so equal instantiations in different
 * layers are one function in the module. The argument block is filled here except for the
 * device pointers, which the executor resolves from the refs (a node's tensor and its scale
 * array, or an offset into the node's scratch).
 *
 * Conventions of the argument block: t[0] is the result and t[1..] the inputs in order; for
 * the in-place ops (accumulate, assign, adamw, amax_record, delayed_scale) t[k] is input k,
 * the operand they update first. Reductions use the node's scratch for partial results;
 * GEMMs use it for transposed FP8 copies, f32 copies of operands in formats cuBLASLt cannot
 * read, and the dequantization scales.
 *
 * This file holds the helpers every plan uses (the Spec, launches, arguments, checks) and the
 * dispatch per node (plan_node); the plans of the library's op families are in spec_ops.c,
 * the GEMM in spec_gemm.c, and the fusions across nodes in spec_fuse.c (spec_internal.h lists
 * what they share). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec_internal.h"

_Static_assert(SCALE_COUNT == 6, "scaling names below follow ir.h");
static const char *const scale_enum[SCALE_COUNT] = {
    "SCALE_NONE", "SCALE_PER_TENSOR", "SCALE_PER_ROW", "SCALE_PER_GROUP", "SCALE_TILE_1x128",
    "SCALE_BLOCK_128",
};

uint64_t cuda_hash(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    if (!h) h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

bool spec_fail(Spec *s, const char *fmt, ...) {
    if (!s->failed) {
        char msg[384];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        const Node *n = s->n;
        snprintf(s->why, s->why_len, "%s %%%d%s%s: %s", ir_op_info(n->op)->text, n->id,
                 n->t.name ? " " : "", n->t.name ? n->t.name : "", msg);
    }
    s->failed = true;
    return false;
}

static void elem_enum(ElemType e, char *out, size_t len) {
    const char *name = fmt_elem_name(e);
    size_t k = (size_t)snprintf(out, len, "FMT_");
    for (const char *p = name; *p && k + 1 < len; p++) out[k++] = (char)(*p >= 'a' && *p <= 'z' ? *p - 32 : *p);
    out[k] = 0;
}

/* The template argument for a tensor's format: F<FMT_BF16, SCALE_NONE>. */
const char *fmt_arg(Spec *s, const Tensor *t) {
    char e[32], se[32];
    elem_enum(t->fmt.elem, e, sizeof e);
    if (t->fmt.scaling != SCALE_NONE && t->fmt.scale && t->fmt.scale->t.fmt.elem != FMT_F32) {
        elem_enum(t->fmt.scale->t.fmt.elem, se, sizeof se);
        return arena_printf(s->arena, "F<%s, %s, %s>", e, scale_enum[t->fmt.scaling], se);
    }
    return arena_printf(s->arena, "F<%s, %s>", e, scale_enum[t->fmt.scaling]);
}

/* Whether the kernels can read and write t: storage, a plain codec, scales they can find. */
bool spec_check_tensor(Spec *s, const Tensor *t, const char *what) {
    const Format *f = &t->fmt;
    if (f->elem == FMT_VOID) return spec_fail(s, "%s has no storage", what);
    if (f->codec != CODEC_PLAIN)
        return spec_fail(s, "%s uses codec '%s', which the GPU kernels do not implement yet", what,
                         fmt_codec_name(f->codec));
    if (f->scaling != SCALE_NONE) {
        if (f->scaling == SCALE_PER_GROUP && f->group <= 0)
            return spec_fail(s, "%s: per-group scaling without a group size", what);
        if (!f->scale && f->recipe != RECIPE_STATIC)
            return spec_fail(s, "%s is scaled but has no scale tensor", what);
        if (f->scale && ((f->scale->t.fmt.elem != FMT_F32 && f->scale->t.fmt.elem != FMT_E8M0) ||
                         f->scale->t.fmt.scaling != SCALE_NONE || f->scale->t.fmt.codec != CODEC_PLAIN))
            return spec_fail(s, "%s: its scales are not plain f32 or e8m0", what);
    }
    return true;
}

static CkTensor ck_tensor_of(const Tensor *t) {
    CkTensor c;
    memset(&c, 0, sizeof c);
    c.n = ir_numel(t);
    c.rows = rows_of(t);
    c.cols = cols_of(t);
    c.sconst = 1.0f;
    const Format *f = &t->fmt;
    switch (f->scaling) {
    case SCALE_PER_GROUP:
        c.group = f->group;
        c.ncg = (c.cols + f->group - 1) / f->group;
        break;
    case SCALE_TILE_1x128:
    case SCALE_BLOCK_128:
        c.group = 128;
        c.ncg = (c.cols + 127) / 128;
        break;
    default: c.group = 1; break;
    }
    c.gshift = -1;
    if ((f->scaling == SCALE_PER_GROUP || f->scaling == SCALE_TILE_1x128) && c.group > 0 &&
        !(c.group & (c.group - 1)) && c.cols % c.group == 0)
        for (c.gshift = 0; (1 << c.gshift) < c.group; c.gshift++) {}
    if (f->scaling != SCALE_NONE && !f->scale) c.sconst = f->static_scale;
    return c;
}

/* Appends a launch of `body` (a call of a library template on the argument block a). */
CuLaunch *spec_launch(Spec *s, const char *tag, unsigned grid, unsigned block,
                             const char *fmt, ...) {
    CuNodePlan *p = s->plan;
    if (p->n_launch == s->cap) {
        int cap = s->cap ? 2 * s->cap : 4;
        CuLaunch *grown = arena_alloc(s->arena, sizeof *grown * (size_t)cap);
        if (p->n_launch) memcpy(grown, p->launch, sizeof *grown * (size_t)p->n_launch);
        p->launch = grown;
        s->cap = cap;
    }
    CuLaunch *l = &p->launch[p->n_launch++];
    memset(l, 0, sizeof *l);
    l->kind = CU_KERNEL;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l->body, sizeof l->body, fmt, ap);
    va_end(ap);
    /* the entry point is named by its body and its block size: its __launch_bounds__ */
    uint64_t h = cuda_hash(0, l->body, strlen(l->body));
    h = cuda_hash(h, &block, sizeof block);
    snprintf(l->fn, sizeof l->fn, "%s_%016llx", tag, (unsigned long long)h);
    l->grid[0] = grid;
    l->grid[1] = 1;
    l->block = block;
    l->scratch = -1;
    for (int i = 0; i < CK_MAX_TENSORS; i++) l->ref[i].scratch = -1;
    return l;
}

/* t[k] = node m's tensor */
void arg_node(CuLaunch *l, int k, const Node *m) {
    l->args.t[k] = ck_tensor_of(&m->t);
    l->ref[k].node = m;
    l->ref[k].scratch = -1;
    l->ref_scale[k] = m->t.fmt.scaling != SCALE_NONE && m->t.fmt.scale != NULL;
}

/* t[k] = a plain f32 (rows, cols) array at byte `off` of the node's scratch */
void arg_scratch(CuLaunch *l, int k, int64_t off, int64_t rows, int64_t cols) {
    CkTensor c;
    memset(&c, 0, sizeof c);
    c.n = rows * cols;
    c.rows = rows;
    c.cols = cols;
    c.group = 1;
    c.gshift = -1;
    c.sconst = 1.0f;
    l->args.t[k] = c;
    l->ref[k].node = NULL;
    l->ref[k].scratch = off;
}

void need_scratch(Spec *s, int64_t bytes) {
    bytes = (bytes + 255) / 256 * 256;
    if (bytes > s->plan->scratch_bytes) s->plan->scratch_bytes = bytes;
}

/* the node's result then every input, as t[0], t[1..] */
void args_result_inputs(CuLaunch *l, const Node *n) {
    arg_node(l, 0, n);
    for (int i = 0; i < n->n_in; i++) arg_node(l, 1 + i, n->in[i]);
    l->args.n_in = n->n_in;
}
void args_inputs(CuLaunch *l, const Node *n) {
    for (int i = 0; i < n->n_in; i++) arg_node(l, i, n->in[i]);
    l->args.n_in = n->n_in;
}

bool check_io(Spec *s, const Node *n, bool result) {
    if (result && !spec_check_tensor(s, &n->t, "the result")) return false;
    for (int i = 0; i < n->n_in; i++) {
        char what[32];
        snprintf(what, sizeof what, "input %d", i);
        if (!spec_check_tensor(s, &n->in[i]->t, what)) return false;
    }
    return true;
}

/* ---------------------------------------------------------------- op groups */

/* ops.def amax=1: this launch of n's own kernel also leaves the block maxima after n's result
 * (ck_amax_out), its grid kept within their slots (the kernels stride over the rest) */
void arg_amax_parts(Spec *s, CuLaunch *l, const Node *n) {
    int64_t off = ir_amax_parts_offset(n);
    if (!off) return;
    l->args.i[CK_AMAX_AT] = off;
    if (l->grid[0] > CK_AMAX_PARTS) l->grid[0] = CK_AMAX_PARTS;
    s->amax_written = true;
}

/* the block maxima of d by a pass over it, where no kernel of its producer writes them (a
 * GEMM's epilogue wrote d, or an ADD_N of more inputs than one launch takes) */
void plan_amax_pass(Spec *s, const Node *d) {
    unsigned grid = grid_elem(ir_numel(&d->t));
    CuLaunch *l = spec_launch(s, "amaxparts", grid < CK_AMAX_PARTS ? grid : CK_AMAX_PARTS, ELEM_THREADS,
                              "ck_amax_parts<%s>(a)", fmt_arg(s, &d->t));
    arg_node(l, 0, d);
    l->args.i[CK_AMAX_AT] = ir_amax_parts_offset(d);
}

/* The format argument of a producer's result, and t[0] with its block maxima, as s->result
 * says (ops.cuh's CkAmaxOnly and CkThrough) */
const char *producer_fmt(Spec *s) {
    const char *Y = fmt_arg(s, &s->n->t);
    if (s->result == RESULT_AMAX_ONLY) return arena_printf(s->arena, "CkAmaxOnly<%s>", Y);
    if (s->result == RESULT_THROUGH) return arena_printf(s->arena, "CkThrough<%s, %s>", Y, fmt_arg(s, &s->through->t));
    return Y;
}
void producer_result(Spec *s, CuLaunch *l) {
    if (s->result == RESULT_THROUGH) arg_node(l, 0, s->through);
    else arg_amax_parts(s, l, s->n);
}

/* ---------------------------------------------------------------- nodes */

/* A reshape that memplan placed on its input's bytes (same arena, offset and encoding) is
 * a view: nothing to run. */
static bool is_view(const Node *n) {
    if (n->op != OP_RESHAPE) return false;
    const Tensor *x = &n->in[0]->t, *y = &n->t;
    return x->offset >= 0 && x->offset == y->offset &&
           ir_role_is_persistent(x->role) == ir_role_is_persistent(y->role) &&
           x->fmt.elem == y->fmt.elem && x->fmt.scaling == SCALE_NONE &&
           y->fmt.scaling == SCALE_NONE;
}

bool plan_node(Spec *s) {
    const Node *n = s->n;
    switch (n->op) {
    case OP_INPUT: case OP_PARAM: case OP_STATE: return true;
    case OP_ALL_REDUCE: return true;   /* NCCL, run by exec.c; no kernel */
    case OP_RESHAPE:
        if (is_view(n)) return true;
        return plan_elementwise(s);
    case OP_CONST: case OP_ADD: case OP_SUB: case OP_MUL: case OP_SCALE: case OP_ADD_N:
    case OP_GELU: case OP_GELU_BWD: case OP_SILU: case OP_SILU_BWD: case OP_CAST:
    case OP_SLICE: case OP_PAD: case OP_CONCAT: case OP_EMBEDDING: case OP_ROPE:
    case OP_QUANTIZE:
        return plan_elementwise(s);
    case OP_MATMUL: return plan_matmul(s, NULL);
    case OP_TRANSPOSE:
        if (!check_io(s, n, true)) return false;
        if (!transpose_keeps_values(n)) return spec_fail(s, "a transpose that changes the values");
        plan_transpose(s, n->in[0], n, 0);
        return true;
    case OP_SQNORM: case OP_QUANT_SCALE: case OP_AMAX_RECORD: case OP_DELAYED_SCALE:
        return plan_reductions(s);
    case OP_SUM_ROWS: case OP_LAYERNORM: case OP_LAYERNORM_BWD_X: case OP_LAYERNORM_BWD_W:
    case OP_RMSNORM: case OP_RMSNORM_BWD_X: case OP_RMSNORM_BWD_W: case OP_SOFTMAX:
    case OP_SOFTMAX_BWD: case OP_CROSS_ENTROPY: case OP_CROSS_ENTROPY_BWD: case OP_EMBEDDING_BWD:
        return plan_rows(s);
    case OP_ATTENTION: case OP_ATTENTION_BWD: return plan_attention(s);
    case OP_ACCUMULATE: case OP_ASSIGN: case OP_CLIP_COEF: case OP_GRAD_NORM: case OP_ADAMW:
    case OP_LION: case OP_SGD:
        return plan_optimizer(s);
    case OP_COUNT: break;
    }
    return spec_fail(s, "no GPU kernel for this op");
}

/* an empty plan for n, and the spec that fills it */
Spec spec_for(const Graph *g, const Node *n, Arena *a, CuNodePlan *out, char *why, size_t why_len) {
    memset(out, 0, sizeof *out);
    out->node = n;
    return (Spec){.g = g, .arena = a, .n = n, .plan = out, .why = why, .why_len = why_len, .ce = CE_ROWS_DEFAULT};
}

bool cuda_plan_node(const Graph *g, const Node *n, Arena *a, CuNodePlan *out, char *why, size_t why_len) {
    Spec s = spec_for(g, n, a, out, why, why_len);
    if (!plan_node(&s)) return false;
    if (ir_amax_parts_offset(n) && !s.amax_written) plan_amax_pass(&s, n);
    return true;
}

bool cuda_plan_amax_pass(const Node *n, Arena *a, CuNodePlan *out) {
    char why[256];
    Spec s = spec_for(NULL, n, a, out, why, sizeof why);
    if (!ir_amax_parts_offset(n) || !spec_check_tensor(&s, &n->t, "the tensor")) return false;
    plan_amax_pass(&s, n);
    return true;
}

bool cuda_plan_finite(const Node *n, Arena *a, CuNodePlan *out) {
    char why[256];
    Spec s = spec_for(NULL, n, a, out, why, sizeof why);
    if (!spec_check_tensor(&s, &n->t, "the tensor")) return false;
    /* a thread for some 32 elements (ck_all_finite's four vectors in flight): a block each
     * 256 elements made a batched check of Llama 1.1B's gradients a third of a million
     * blocks, 1.09 ms on an H200 where the gradient's squared norm reads them in 0.70 */
    CuLaunch *l = spec_launch(&s, "finite", grid_elem((ir_numel(&n->t) + 31) / 32), ELEM_THREADS,
                              "ck_all_finite<%s>(a)", fmt_arg(&s, &n->t));
    arg_node(l, 0, n);
    l->scratch = 0;
    l->batch = true;
    return true;
}

bool cuda_plan_comm(const Node *n, Arena *a, CuNodePlan *out) {
    if (n->op != OP_ALL_REDUCE) return false;
    ElemType wire = (ElemType)IR_IATTR(n, ALL_REDUCE, wire);
    if (wire != FMT_E5M2 && wire != FMT_E4M3) return false;
    char why[256], w[16];
    Spec s = spec_for(NULL, n, a, out, why, sizeof why);
    snprintf(w, sizeof w, "%s", wire == FMT_E5M2 ? "FMT_E5M2" : "FMT_E4M3");
    static const char *const tags[COMM_KERNELS] = {"comm_amax", "comm_quantize", "comm_sum",
                                                   "comm_requantize", "comm_unpack"};
    for (int k = 0; k < COMM_KERNELS; k++) {
        /* the amax reads the gradients only: one kernel for either wire format */
        const char *body = k == COMM_AMAX ? "ck_comm_amax(a)" : arena_printf(a, "ck_%s<%s>(a)", tags[k], w);
        CuLaunch *l = spec_launch(&s, tags[k], 1, COMM_THREADS, "%s", body);
        l->args.f[0] = num_elem_max(wire);
    }
    return true;
}

bool cuda_plan_gather(const Node *n, Arena *a, CuNodePlan *out) {
    if (n->op != OP_QUANT_SCALE || n->in[0]->op != OP_PARAM ||
        IR_IATTR(n, QUANT_SCALE, scaling) != SCALE_PER_TENSOR)
        return false;
    char why[256];
    Spec s = spec_for(NULL, n, a, out, why, sizeof why);
    const Node *w = n->in[0];
    if (!check_io(&s, n, true)) return false;
    unsigned blocks = grid_elem(ir_numel(&w->t));
    if (blocks > PARTIAL_BLOCKS) blocks = PARTIAL_BLOCKS;
    CuLaunch *l = spec_launch(&s, "gatheramax", blocks, ROW_THREADS, "ck_gather_amax<%s>(a)", fmt_arg(&s, &w->t));
    arg_scratch(l, 0, 0, 1, 1);
    arg_node(l, 1, w);
    l->args.n_in = 1;
    l->args.i[0] = blocks;
    l->scratch = 0;
    need_scratch(&s, (int64_t)blocks * 8);
    l = spec_launch(&s, "gatherscale", 1, ROW_THREADS, "ck_gather_scale<%s>(a)", fmt_arg(&s, &n->t));
    arg_node(l, 0, n);
    arg_scratch(l, 1, 0, 1, 1);
    l->args.n_in = 1;
    l->args.i[1] = IR_IATTR(n, QUANT_SCALE, margin);
    l->args.f[0] = num_elem_max((ElemType)IR_IATTR(n, QUANT_SCALE, elem));
    return true;
}

/* Loop kernels of the kernel IR (cuda/cg_render.c): a thread per item in a grid-stride loop,
 * or a block per item. */
bool cuda_cg_launch_shape(const CgKernel *k, unsigned *grid, unsigned *block) {
    if (k->kind != CG_KERNEL_LOOP) return false;
    int64_t items = k->items > 0 ? k->items : 1;
    *block = 256;
    if (k->par == CG_PAR_BLOCK) {
        *grid = (unsigned)(items < (1 << 20) ? items : (1 << 20));
    } else {
        int64_t g = (items + 255) / 256;
        *grid = (unsigned)(g < 1 ? 1 : g > 8192 ? 8192 : g);
    }
    return true;
}
