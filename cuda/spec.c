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
 * read, and the dequantization scales. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"

_Static_assert(SCALE_COUNT == 6, "scaling names below follow ir.h");
static const char *const scale_enum[SCALE_COUNT] = {
    "SCALE_NONE", "SCALE_PER_TENSOR", "SCALE_PER_ROW", "SCALE_PER_GROUP", "SCALE_TILE_1x128",
    "SCALE_BLOCK_128",
};

enum { ELEM_THREADS = 256, ELEM_MAX_BLOCKS = 4096, ROW_THREADS = 256, PARTIAL_BLOCKS = 1024 };

/* Threads of a cross entropy's row blocks (forward and backward: the backward recomputes the
 * forward's logsumexp where it does not read it, and must get the same bits). A chunk of the
 * loss is some 500 to 1300 rows of the vocabulary's 50304 logits: at 256 threads a row, its
 * blocks filled half to one and a quarter waves of an H200 (0.48 waves measured, 42% of the
 * warps busy, 35% of the memory bandwidth for the forward). 1024 threads take a vocabulary row
 * in six or seven wide loads a thread (Llama's 32000 in four), two rows an SM at a time, in two
 * to five full waves. */
static unsigned ce_row_threads(int64_t V) { return V >= 8 * 2048 ? 1024 : ROW_THREADS; }

typedef struct {
    Arena *arena;
    const Node *n;
    CuNodePlan *plan;
    int cap;
    char *why;
    size_t why_len;
    bool failed;
    bool amax_written;   /* a launch of the node's own writes its block maxima (amax=1) */
    /* how a producer that may be fused with the quantize of its value stores its result
     * (fuse_producer_quantizes): as itself, only its block maxima, or quantized into `through` */
    enum { RESULT_STORED, RESULT_AMAX_ONLY, RESULT_THROUGH } result;
    const Node *through;
    /* a QUANTIZE with transposed=1 that also sums its input's rows for this SUM_ROWS, and
     * adds the sum into the accumulator of bias_acc (an ACCUMULATE) where that is set
     * (fuse_bias_grads) */
    const Node *bias_grad, *bias_acc;
    /* a QUANTIZE into per-group scales that also makes them: the QUANT_SCALE (of the same x)
     * whose launch moves here (fuse_group_quantizes) */
    const Node *group_scale;
    /* a CROSS_ENTROPY and the CROSS_ENTROPY_BWD right after it, of the same logits
     * (fuse_ce_lse): the forward leaves each row's logsumexp in the scratch at this byte
     * offset, and the backward reads it there instead of reading its row once more; 0: none */
    int64_t ce_lse_at;
} Spec;

uint64_t cuda_hash(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    if (!h) h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static bool spec_fail(Spec *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool spec_fail(Spec *s, const char *fmt, ...) {
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

static int64_t rows_of(const Tensor *t) {
    int64_t r = 1;
    for (int i = 0; i + 1 < t->rank; i++) r *= t->dims[i];
    return r;
}
static int64_t cols_of(const Tensor *t) { return t->rank ? t->dims[t->rank - 1] : 1; }

static unsigned grid_elem(int64_t n) {
    int64_t b = (n + ELEM_THREADS - 1) / ELEM_THREADS;
    return (unsigned)(b < 1 ? 1 : b > ELEM_MAX_BLOCKS ? ELEM_MAX_BLOCKS : b);
}

/* a warp per row, ROW_THREADS / 32 rows a block (the norms) */
static unsigned grid_warp_rows(int64_t rows) {
    int64_t per = ROW_THREADS / 32, b = (rows + per - 1) / per;
    return (unsigned)(b < 1 ? 1 : b);
}

static void elem_enum(ElemType e, char *out, size_t len) {
    const char *name = fmt_elem_name(e);
    size_t k = (size_t)snprintf(out, len, "FMT_");
    for (const char *p = name; *p && k + 1 < len; p++) out[k++] = (char)(*p >= 'a' && *p <= 'z' ? *p - 32 : *p);
    out[k] = 0;
}

/* The template argument for a tensor's format: F<FMT_BF16, SCALE_NONE>. */
static const char *fmt_arg(Spec *s, const Tensor *t) {
    char e[32], se[32];
    elem_enum(t->fmt.elem, e, sizeof e);
    if (t->fmt.scaling != SCALE_NONE && t->fmt.scale && t->fmt.scale->t.fmt.elem != FMT_F32) {
        elem_enum(t->fmt.scale->t.fmt.elem, se, sizeof se);
        return arena_printf(s->arena, "F<%s, %s, %s>", e, scale_enum[t->fmt.scaling], se);
    }
    return arena_printf(s->arena, "F<%s, %s>", e, scale_enum[t->fmt.scaling]);
}
static const char *F32_ARG = "F<FMT_F32, SCALE_NONE>";

/* Whether the kernels can read and write t: storage, a plain codec, scales they can find. */
static bool spec_check_tensor(Spec *s, const Tensor *t, const char *what) {
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
static CuLaunch *spec_launch(Spec *s, const char *tag, unsigned grid, unsigned block,
                             const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static CuLaunch *spec_launch(Spec *s, const char *tag, unsigned grid, unsigned block,
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
static void arg_node(CuLaunch *l, int k, const Node *m) {
    l->args.t[k] = ck_tensor_of(&m->t);
    l->ref[k].node = m;
    l->ref[k].scratch = -1;
    l->ref_scale[k] = m->t.fmt.scaling != SCALE_NONE && m->t.fmt.scale != NULL;
}

/* t[k] = a plain f32 (rows, cols) array at byte `off` of the node's scratch */
static void arg_scratch(CuLaunch *l, int k, int64_t off, int64_t rows, int64_t cols) {
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

static void need_scratch(Spec *s, int64_t bytes) {
    bytes = (bytes + 255) / 256 * 256;
    if (bytes > s->plan->scratch_bytes) s->plan->scratch_bytes = bytes;
}

/* the node's result then every input, as t[0], t[1..] */
static void args_result_inputs(CuLaunch *l, const Node *n) {
    arg_node(l, 0, n);
    for (int i = 0; i < n->n_in; i++) arg_node(l, 1 + i, n->in[i]);
    l->args.n_in = n->n_in;
}
static void args_inputs(CuLaunch *l, const Node *n) {
    for (int i = 0; i < n->n_in; i++) arg_node(l, i, n->in[i]);
    l->args.n_in = n->n_in;
}

static bool check_io(Spec *s, const Node *n, bool result) {
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
static void arg_amax_parts(Spec *s, CuLaunch *l, const Node *n) {
    int64_t off = ir_amax_parts_offset(n);
    if (!off) return;
    l->args.i[CK_AMAX_AT] = off;
    if (l->grid[0] > CK_AMAX_PARTS) l->grid[0] = CK_AMAX_PARTS;
    s->amax_written = true;
}

/* the block maxima of d by a pass over it, where no kernel of its producer writes them (a
 * GEMM's epilogue wrote d, or an ADD_N of more inputs than one launch takes) */
static void plan_amax_pass(Spec *s, const Node *d) {
    unsigned grid = grid_elem(ir_numel(&d->t));
    CuLaunch *l = spec_launch(s, "amaxparts", grid < CK_AMAX_PARTS ? grid : CK_AMAX_PARTS, ELEM_THREADS,
                              "ck_amax_parts<%s>(a)", fmt_arg(s, &d->t));
    arg_node(l, 0, d);
    l->args.i[CK_AMAX_AT] = ir_amax_parts_offset(d);
}

/* The format argument of a producer's result, and t[0] with its block maxima, as s->result
 * says (ops.cuh's CkAmaxOnly and CkThrough) */
static const char *producer_fmt(Spec *s) {
    const char *Y = fmt_arg(s, &s->n->t);
    if (s->result == RESULT_AMAX_ONLY) return arena_printf(s->arena, "CkAmaxOnly<%s>", Y);
    if (s->result == RESULT_THROUGH) return arena_printf(s->arena, "CkThrough<%s, %s>", Y, fmt_arg(s, &s->through->t));
    return Y;
}
static void producer_result(Spec *s, CuLaunch *l) {
    if (s->result == RESULT_THROUGH) arg_node(l, 0, s->through);
    else arg_amax_parts(s, l, s->n);
}

static bool plan_elementwise(Spec *s) {
    const Node *n = s->n;
    const Tensor *y = &n->t;
    int64_t count = ir_numel(y);
    CuLaunch *l;
    const char *Y = fmt_arg(s, y);
    switch (n->op) {
    case OP_CONST:
        if (!check_io(s, n, true)) return false;
        l = spec_launch(s, "const", grid_elem(count), ELEM_THREADS, "ck_const<%s>(a)", Y);
        arg_node(l, 0, n);
        l->args.f[0] = n->fattr[0];
        return true;
    case OP_ADD: case OP_SUB: case OP_MUL: {
        if (!check_io(s, n, true)) return false;
        int64_t na = ir_numel(&n->in[0]->t), nb = ir_numel(&n->in[1]->t);
        if (nb == 0 || na % nb || na != count) return spec_fail(s, "cannot broadcast");
        l = spec_launch(s, "binary", grid_elem(count), ELEM_THREADS, "ck_binary<%s, %s, %s, %s>(a)",
                        n->op == OP_ADD ? "OP_ADD" : n->op == OP_SUB ? "OP_SUB" : "OP_MUL", Y,
                        fmt_arg(s, &n->in[0]->t), fmt_arg(s, &n->in[1]->t));
        args_result_inputs(l, n);
        arg_amax_parts(s, l, n);
        return true;
    }
    case OP_SCALE:
        if (!check_io(s, n, true)) return false;
        l = spec_launch(s, "scale", grid_elem(count), ELEM_THREADS, "ck_scale<%s, %s>(a)", Y,
                        fmt_arg(s, &n->in[0]->t));
        args_result_inputs(l, n);
        l->args.f[0] = n->fattr[0];
        return true;
    case OP_ADD_N:
        if (n->n_in > CK_MAX_TENSORS - 1) {
            if (!check_io(s, n, true)) return false;
            enum { PER = 10 };
            need_scratch(s, count * 8);
            for (int at = 0; at < n->n_in; at += PER) {
                int k = n->n_in - at < PER ? n->n_in - at : PER;
                char list[512] = "";
                for (int i = 0; i < k; i++) {
                    size_t len = strlen(list);
                    snprintf(list + len, sizeof list - len, ", %s", fmt_arg(s, &n->in[at + i]->t));
                }
                l = spec_launch(s, "add_n", grid_elem(count), ELEM_THREADS, "ck_add_n_part<%d, %d, %s%s>(a)",
                                at == 0, at + k == n->n_in, Y, list);
                arg_node(l, 0, n);
                for (int i = 0; i < k; i++) arg_node(l, 1 + i, n->in[at + i]);
                l->args.n_in = k;
                l->scratch = 0;
            }
            return true;
        }
        /* fall through */
    case OP_CONCAT: {
        if (!check_io(s, n, true)) return false;
        if (n->op == OP_CONCAT && n->n_in > CK_MAX_IATTR - 3) {
            int axis = (int)(n->iattr[0] < 0 ? n->iattr[0] + y->rank : n->iattr[0]);
            if (axis < 0 || axis >= y->rank) return spec_fail(s, "bad axis");
            int64_t outer = 1, inner = 1, at = 0;
            for (int i = 0; i < axis; i++) outer *= y->dims[i];
            for (int i = axis + 1; i < y->rank; i++) inner *= y->dims[i];
            enum { PER = CK_MAX_IATTR - 5 };
            for (int k0 = 0; k0 < n->n_in; k0 += PER) {
                int k = n->n_in - k0 < PER ? n->n_in - k0 : PER;
                char list[512] = "";
                int64_t lp = 0;
                for (int i = 0; i < k; i++) {
                    size_t len = strlen(list);
                    snprintf(list + len, sizeof list - len, ", %s", fmt_arg(s, &n->in[k0 + i]->t));
                    lp += n->in[k0 + i]->t.dims[axis];
                }
                l = spec_launch(s, "concat", grid_elem(outer * lp * inner), ELEM_THREADS,
                                "ck_concat_part<%s%s>(a)", Y, list);
                arg_node(l, 0, n);
                for (int i = 0; i < k; i++) {
                    arg_node(l, 1 + i, n->in[k0 + i]);
                    l->args.i[5 + i] = n->in[k0 + i]->t.dims[axis];
                }
                l->args.n_in = k;
                l->args.i[0] = outer, l->args.i[1] = y->dims[axis], l->args.i[2] = inner;
                l->args.i[3] = at, l->args.i[4] = lp;
                at += lp;
            }
            return true;
        }
        int max = n->op == OP_ADD_N ? CK_MAX_TENSORS - 1 : CK_MAX_IATTR - 3;
        if (n->n_in > max) return spec_fail(s, "more than %d inputs", max);
        char list[512] = "";
        for (int i = 0; i < n->n_in; i++) {
            size_t at = strlen(list);
            snprintf(list + at, sizeof list - at, ", %s", fmt_arg(s, &n->in[i]->t));
        }
        if (n->op == OP_ADD_N) {
            l = spec_launch(s, "add_n", grid_elem(count), ELEM_THREADS, "ck_add_n<%s%s>(a)", Y, list);
            args_result_inputs(l, n);
            arg_amax_parts(s, l, n);
            return true;
        }
        int axis = (int)(n->iattr[0] < 0 ? n->iattr[0] + y->rank : n->iattr[0]);
        if (axis < 0 || axis >= y->rank) return spec_fail(s, "bad axis");
        int64_t outer = 1, inner = 1;
        for (int i = 0; i < axis; i++) outer *= y->dims[i];
        for (int i = axis + 1; i < y->rank; i++) inner *= y->dims[i];
        l = spec_launch(s, "concat", grid_elem(count), ELEM_THREADS, "ck_concat<%s%s>(a)", Y, list);
        args_result_inputs(l, n);
        l->args.i[0] = outer;
        l->args.i[1] = y->dims[axis];
        l->args.i[2] = inner;
        for (int i = 0; i < n->n_in; i++) l->args.i[3 + i] = n->in[i]->t.dims[axis];
        return true;
    }
    case OP_GELU: case OP_SILU: case OP_GELU_BWD: case OP_SILU_BWD: {
        if (!check_io(s, n, true)) return false;
        const char *op = n->op == OP_GELU ? "OP_GELU" : n->op == OP_SILU ? "OP_SILU"
                         : n->op == OP_GELU_BWD ? "OP_GELU_BWD" : "OP_SILU_BWD";
        l = spec_launch(s, "unary", grid_elem(count), ELEM_THREADS, "ck_unary<%s, %s, %s, %s>(a)",
                        op, producer_fmt(s), fmt_arg(s, &n->in[0]->t),
                        n->n_in > 1 ? fmt_arg(s, &n->in[1]->t) : F32_ARG);
        args_result_inputs(l, n);
        producer_result(s, l);
        return true;
    }
    case OP_CAST: case OP_RESHAPE: case OP_QUANTIZE:
        if (!check_io(s, n, true)) return false;
        if (ir_numel(&n->in[0]->t) != count) return spec_fail(s, "element counts differ");
        if (ir_transposed_offset(n)) {
            /* both layouts at once (ops.def transposed=1): 64 x 64 tiles */
            if (fmt_elem_bytes(y->fmt.elem) != 1) return spec_fail(s, "a transposed copy of a wider element type");
            int64_t R = rows_of(y), C = cols_of(y), P = (R + 63) / 64;
            l = spec_launch(s, "quantt", (unsigned)((C + 63) / 64), 256, "ck_quantize_t<%s, %s, %d>(a)", Y,
                            fmt_arg(s, &n->in[0]->t), s->bias_grad != NULL);
            l->grid[1] = (unsigned)P;
            arg_node(l, 0, n);
            arg_node(l, 1, n->in[0]);
            l->args.n_in = 1;
            l->args.i[0] = ir_transposed_offset(n);
            if (s->bias_grad) {   /* the tiles' column sums, then their sum over the P row tiles */
                const Node *b = s->bias_grad, *acc = s->bias_acc;
                l->scratch = 0;
                need_scratch(s, P * C * 8);
                if (acc) {
                    l = spec_launch(s, "colacc", (unsigned)((C + 31) / 32), 256, "ck_colsum_final_acc<%s, %s>(a)",
                                    fmt_arg(s, &acc->in[0]->t), fmt_arg(s, &b->t));
                    arg_node(l, 0, acc->in[0]);
                    arg_node(l, 1, b);
                    l->args.n_in = 1;
                } else {
                    l = spec_launch(s, "colfinal", (unsigned)((C + 31) / 32), 256, "ck_colsum_final<0, %s>(a)",
                                    fmt_arg(s, &b->t));
                    args_result_inputs(l, b);
                }
                l->scratch = 0;
                l->args.i[0] = C, l->args.i[1] = R, l->args.i[2] = P;
            }
            return true;
        }
        if (s->group_scale) {   /* the group scales made here too: a thread per vector of x */
            const Node *sc = s->group_scale;
            l = spec_launch(s, "qgroup", grid_elem((count + 7) / 8), ELEM_THREADS, "ck_quantize_group<%s, %s>(a)",
                            Y, fmt_arg(s, &n->in[0]->t));
            arg_node(l, 0, n);
            arg_node(l, 1, n->in[0]);
            l->args.n_in = 1;
            l->args.i[1] = sc->iattr[3];
            l->args.i[2] = l->args.t[0].group;
            l->args.f[0] = num_elem_max((ElemType)sc->iattr[0]);
            return true;
        }
        l = spec_launch(s, "copy", grid_elem(count), ELEM_THREADS, "ck_copy<%s, %s>(a)", Y,
                        fmt_arg(s, &n->in[0]->t));
        arg_node(l, 0, n);
        arg_node(l, 1, n->in[0]);
        l->args.n_in = 1;
        return true;
    case OP_SLICE: case OP_PAD: {
        if (!check_io(s, n, true)) return false;
        const Tensor *x = &n->in[0]->t;
        int axis = (int)(n->iattr[0] < 0 ? n->iattr[0] + y->rank : n->iattr[0]);
        if (axis < 0 || axis >= y->rank || x->rank != y->rank) return spec_fail(s, "bad axis");
        int64_t outer = 1, inner = 1;
        for (int i = 0; i < axis; i++) outer *= y->dims[i];
        for (int i = axis + 1; i < y->rank; i++) inner *= y->dims[i];
        l = spec_launch(s, "slice", grid_elem(count), ELEM_THREADS, "ck_slice<%d, %s, %s>(a)",
                        n->op == OP_PAD, Y, fmt_arg(s, x));
        args_result_inputs(l, n);
        l->args.i[0] = outer;
        l->args.i[1] = y->dims[axis];
        l->args.i[2] = x->dims[axis];
        l->args.i[3] = inner;
        l->args.i[4] = n->iattr[1];
        return true;
    }
    case OP_EMBEDDING:
        if (!check_io(s, n, true)) return false;
        if (n->in[0]->t.rank != 2) return spec_fail(s, "the table is not (V, C)");
        l = spec_launch(s, "embedding", grid_elem(count), ELEM_THREADS, "ck_embedding<%s, %s, %s>(a)",
                        Y, fmt_arg(s, &n->in[0]->t), fmt_arg(s, &n->in[1]->t));
        args_result_inputs(l, n);
        return true;
    case OP_ROPE: {
        if (!check_io(s, n, true)) return false;
        if (y->rank < 2 || n->iattr[0] <= 0 || n->iattr[0] % 2 || cols_of(y) % n->iattr[0])
            return spec_fail(s, "head_dim does not split the columns into even heads");
        /* the (T, head_dim / 2) table of cos and sin, f64, then the rotation that reads it */
        int64_t T = y->dims[y->rank - 2], pairs = T * (n->iattr[0] / 2);
        need_scratch(s, pairs * 16);
        for (int k = 0; k < 2; k++) {
            l = k ? spec_launch(s, "rope", grid_elem(count / 2), ELEM_THREADS, "ck_rope<%s, %s>(a)", Y,
                                fmt_arg(s, &n->in[0]->t))
                  : spec_launch(s, "ropetab", grid_elem(pairs), ELEM_THREADS, "ck_rope_table<%s, %s>(a)", Y,
                                fmt_arg(s, &n->in[0]->t));
            args_result_inputs(l, n);
            l->scratch = 0;
            l->args.i[0] = n->iattr[0];
            l->args.i[1] = n->iattr[1];
            l->args.i[2] = cols_of(y);
            l->args.i[3] = T;
            l->args.f[0] = n->fattr[0];
        }
        return true;
    }
    default: break;
    }
    return spec_fail(s, "not an elementwise op");
}

/* t[x_at] reduced over the whole tensor: partial launch (SQ: sum of squares, else amax) */
static CuLaunch *plan_partials(Spec *s, bool sq, int x_at, const Node *x) {
    int64_t count = ir_numel(&x->t);
    unsigned blocks = grid_elem(count);
    if (blocks > PARTIAL_BLOCKS) blocks = PARTIAL_BLOCKS;
    CuLaunch *l = spec_launch(s, sq ? "sqpart" : "amaxpart", blocks, ROW_THREADS,
                              "ck_reduce_partial<%d, %d, %s>(a)", sq, x_at, fmt_arg(s, &x->t));
    l->scratch = 0;
    l->batch = true;
    need_scratch(s, (int64_t)blocks * 8);
    return l;
}

static bool plan_reductions(Spec *s) {
    const Node *n = s->n;
    CuLaunch *l;
    switch (n->op) {
    case OP_SQNORM: {
        if (!check_io(s, n, true)) return false;
        l = plan_partials(s, true, 1, n->in[0]);
        args_result_inputs(l, n);
        unsigned parts = l->grid[0];
        l = spec_launch(s, "sqfinal", 1, ROW_THREADS, "ck_sqnorm_final<%s>(a)", fmt_arg(s, &n->t));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->batch = true;
        l->args.i[0] = parts;
        return true;
    }
    case OP_QUANT_SCALE: {
        if (!check_io(s, n, true)) return false;
        ElemType e = (ElemType)n->iattr[0];
        Scaling kind = (Scaling)n->iattr[1];
        if (e <= FMT_VOID || e >= FMT_COUNT || kind <= SCALE_NONE || kind >= SCALE_COUNT)
            return spec_fail(s, "bad element type or scaling");
        const Tensor *x = &n->in[0]->t;
        int64_t R = rows_of(x), C = cols_of(x);
        const char *Y = fmt_arg(s, &n->t), *X = fmt_arg(s, x);
        int64_t group = kind == SCALE_PER_GROUP ? n->iattr[2] : 128;
        if (kind == SCALE_PER_TENSOR && ir_amax_parts_offset(n->in[0])) {
            /* the producer left its block maxima: one block over them */
            l = spec_launch(s, "qsparts", 1, ROW_THREADS, "ck_quant_scale_parts<%s>(a)", Y);
            l->args.i[CK_AMAX_AT] = ir_amax_parts_offset(n->in[0]);
        } else if (kind == SCALE_PER_TENSOR) {
            unsigned blocks = grid_elem(ir_numel(x));
            if (blocks > PARTIAL_BLOCKS) blocks = PARTIAL_BLOCKS;
            l = spec_launch(s, "qscale", blocks, ROW_THREADS, "ck_quant_scale_tensor<%s, %s>(a)", Y, X);
            need_scratch(s, (int64_t)blocks * 8);
            l->args.i[0] = blocks;
        } else if (kind == SCALE_PER_ROW) {
            l = spec_launch(s, "qsrow", (unsigned)R, ROW_THREADS, "ck_quant_scale_row<%s, %s>(a)", Y, X);
        } else if (kind == SCALE_BLOCK_128) {
            l = spec_launch(s, "qsblock", (unsigned)(((R + 127) / 128) * ((C + 127) / 128)),
                            ROW_THREADS, "ck_quant_scale_block<%s, %s>(a)", Y, X);
        } else {
            if (group <= 0) return spec_fail(s, "per-group scaling without a group size");
            /* a thread per group, or per vector of x where groups are whole vectors */
            int64_t groups = ir_numel(&n->t), vectors = (ir_numel(x) + 7) / 8;
            l = spec_launch(s, "qsgroup", grid_elem(groups > vectors ? groups : vectors), ELEM_THREADS,
                            "ck_quant_scale_group<%s, %s>(a)", Y, X);
        }
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[1] = n->iattr[3];
        l->args.i[2] = group;
        l->args.f[0] = num_elem_max(e);
        return true;
    }
    case OP_AMAX_RECORD: {
        if (!check_io(s, n, false)) return false;
        l = plan_partials(s, false, 1, n->in[1]);
        args_inputs(l, n);
        unsigned parts = l->grid[0];
        l = spec_launch(s, "amaxrec", 1, ROW_THREADS, "ck_amax_record_final<%s>(a)",
                        fmt_arg(s, &n->in[0]->t));
        args_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = parts;
        return true;
    }
    case OP_DELAYED_SCALE:
        if (!check_io(s, n, false)) return false;
        if (ir_numel(&n->in[0]->t) != 1) return spec_fail(s, "the scale must be a scalar");
        l = spec_launch(s, "dscale", 1, 32, "ck_delayed_scale<%s, %s>(a)", fmt_arg(s, &n->in[0]->t),
                        fmt_arg(s, &n->in[1]->t));
        args_inputs(l, n);
        l->args.i[0] = n->iattr[2];
        l->args.i[1] = n->iattr[1];
        l->args.f[0] = num_elem_max((ElemType)n->iattr[0]);
        return true;
    default: break;
    }
    return spec_fail(s, "not a reduction");
}

/* column sums: partials over P row partitions, then the sum of partials (MODE 0: sum_rows,
 * MODE 1: a norm's weight gradient, whose statistics come first in scratch) */
static void plan_colsum(Spec *s, int mode, int64_t R, int64_t C, const char *X, const char *X2) {
    const Node *n = s->n;
    int64_t P = R / 64;
    P = P < 1 ? 1 : P > 256 ? 256 : P;
    int64_t base = mode == 1 ? 2 * R * 8 : 0;
    need_scratch(s, base + P * C * 8);
    CuLaunch *l = spec_launch(s, "colpart", (unsigned)((C + 255) / 256), 256,
                              "ck_colsum_partial<%d, %s, %s>(a)", mode, X, X2);
    l->grid[1] = (unsigned)P;
    args_result_inputs(l, n);
    l->scratch = 0;
    l->args.i[0] = C, l->args.i[1] = R, l->args.i[2] = P;
    l = spec_launch(s, "colfinal", (unsigned)((C + 31) / 32), 256, "ck_colsum_final<%d, %s>(a)", mode,
                    fmt_arg(s, &n->t));
    args_result_inputs(l, n);
    l->scratch = 0;
    l->args.i[0] = C, l->args.i[1] = R, l->args.i[2] = P;
}

/* the vectors of CK_VEC elements a lane of a norm's warp holds of a row of C (ops.cuh's NV;
 * 0: the row does not fit in registers and goes element by element) */
static int row_vectors(int64_t C) {
    enum { ROW_VECS_MAX = 8 };   /* ops.cuh's CK_ROW_VECS */
    if (C % 8 || C > ROW_VECS_MAX * 32 * 8) return 0;
    return (int)((C + 32 * 8 - 1) / (32 * 8));
}

static bool plan_rows(Spec *s) {
    const Node *n = s->n;
    CuLaunch *l;
    if (!check_io(s, n, true)) return false;
    const char *Y = fmt_arg(s, &n->t);
    switch (n->op) {
    case OP_SUM_ROWS: {
        const Tensor *x = &n->in[0]->t;
        plan_colsum(s, 0, rows_of(x), cols_of(x), fmt_arg(s, x), F32_ARG);
        return true;
    }
    case OP_LAYERNORM: case OP_RMSNORM: {
        const Tensor *x = &n->in[0]->t;
        bool ln = n->op == OP_LAYERNORM;
        l = spec_launch(s, "norm", grid_warp_rows(rows_of(x)), ROW_THREADS, "ck_norm<%d, %d, %s, %s, %s, %s>(a)",
                        ln, row_vectors(cols_of(x)), producer_fmt(s), fmt_arg(s, x), fmt_arg(s, &n->in[1]->t),
                        ln ? fmt_arg(s, &n->in[2]->t) : F32_ARG);
        args_result_inputs(l, n);
        l->args.i[0] = cols_of(x), l->args.i[1] = rows_of(x);
        l->args.f[0] = n->fattr[0];
        producer_result(s, l);
        return true;
    }
    case OP_LAYERNORM_BWD_X: case OP_RMSNORM_BWD_X: {
        const Tensor *x = &n->in[1]->t;
        l = spec_launch(s, "normbx", grid_warp_rows(rows_of(x)), ROW_THREADS,
                        "ck_norm_bwd_x<%d, %d, %s, %s, %s, %s>(a)", n->op == OP_LAYERNORM_BWD_X,
                        row_vectors(cols_of(x)), producer_fmt(s),
                        fmt_arg(s, &n->in[0]->t), fmt_arg(s, x), fmt_arg(s, &n->in[2]->t));
        args_result_inputs(l, n);
        l->args.i[0] = cols_of(x), l->args.i[1] = rows_of(x);
        l->args.f[0] = n->fattr[0];
        producer_result(s, l);
        return true;
    }
    case OP_LAYERNORM_BWD_W: case OP_RMSNORM_BWD_W: {
        const Tensor *x = &n->in[1]->t;
        int64_t R = rows_of(x), C = cols_of(x);
        l = spec_launch(s, "normstat", grid_warp_rows(R), ROW_THREADS, "ck_norm_stats<%d, %d, %s>(a)",
                        n->op == OP_LAYERNORM_BWD_W, row_vectors(C), fmt_arg(s, x));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = C, l->args.i[1] = R;
        l->args.f[0] = n->fattr[0];
        plan_colsum(s, 1, R, C, fmt_arg(s, &n->in[0]->t), fmt_arg(s, x));
        return true;
    }
    case OP_SOFTMAX: case OP_SOFTMAX_BWD:
        l = spec_launch(s, "softmax", (unsigned)rows_of(&n->t), ROW_THREADS,
                        "ck_softmax<%d, %s, %s, %s>(a)", n->op == OP_SOFTMAX_BWD, Y,
                        fmt_arg(s, &n->in[0]->t), n->n_in > 1 ? fmt_arg(s, &n->in[1]->t) : F32_ARG);
        args_result_inputs(l, n);
        l->args.i[0] = cols_of(&n->t);
        return true;
    case OP_CROSS_ENTROPY: {
        const Tensor *lg = &n->in[0]->t;
        int64_t R = rows_of(lg), V = cols_of(lg);
        need_scratch(s, s->ce_lse_at ? s->ce_lse_at + R * 8 : R * 8);
        l = spec_launch(s, "cerows", (unsigned)R, ce_row_threads(V), "ck_ce_rows<%s, %s>(a)",
                        fmt_arg(s, lg), fmt_arg(s, &n->in[1]->t));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = V, l->args.i[1] = R, l->args.i[2] = s->ce_lse_at;
        l = spec_launch(s, "cefinal", 1, 1024, "ck_ce_final<%s, %s>(a)", Y, fmt_arg(s, &n->in[1]->t));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = V, l->args.i[1] = R;
        return true;
    }
    case OP_CROSS_ENTROPY_BWD: {
        const Tensor *lg = &n->in[1]->t;
        int64_t R = rows_of(lg), V = cols_of(lg);
        need_scratch(s, s->ce_lse_at ? s->ce_lse_at + R * 8 : 8);
        l = spec_launch(s, "cecoef", 1, 1024, "ck_ce_bwd_coef<%s, %s>(a)", fmt_arg(s, &n->in[0]->t),
                        fmt_arg(s, &n->in[2]->t));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = V, l->args.i[1] = R;
        l = spec_launch(s, "cebwd", (unsigned)R, ce_row_threads(V), "ck_ce_bwd<%s, %s, %s>(a)", Y,
                        fmt_arg(s, lg), fmt_arg(s, &n->in[2]->t));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = V, l->args.i[1] = R, l->args.i[2] = s->ce_lse_at;
        return true;
    }
    case OP_EMBEDDING_BWD: {
        if (n->t.rank != 2) return spec_fail(s, "the result is not (V, C)");
        int64_t V = n->t.dims[0], C = n->t.dims[1], R = ir_numel(&n->in[1]->t);
        need_scratch(s, (3 * V + 2 + 2 * R) * 4);
        const char *I = fmt_arg(s, &n->in[1]->t);
        const char *bodies[4][3] = {
            {"ebzero", "ck_eb_zero(a)", ""},
            {"ebcount", "ck_eb_count<%s>(a)", I},
            {"ebscan", "ck_eb_scan(a)", ""},
            {"ebscatter", "ck_eb_scatter<%s>(a)", I},
        };
        for (int k = 0; k < 4; k++) {
            unsigned grid = k == 0 ? grid_elem(V + 1) : k == 2 ? 1 : grid_elem(R);
            l = spec_launch(s, bodies[k][0], grid, k == 2 ? 1024 : ELEM_THREADS, bodies[k][1], bodies[k][2]);
            args_result_inputs(l, n);
            l->scratch = 0;
            l->args.i[0] = V, l->args.i[1] = C, l->args.i[2] = R;
        }
        l = spec_launch(s, "ebsort", (unsigned)V, ROW_THREADS, "ck_eb_sort(a)");
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = V, l->args.i[1] = C, l->args.i[2] = R;
        l = spec_launch(s, "ebsum", (unsigned)(V * ((C + ROW_THREADS - 1) / ROW_THREADS)), ROW_THREADS,
                        "ck_eb_sum<%s, %s>(a)", Y, fmt_arg(s, &n->in[0]->t));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = V, l->args.i[1] = C, l->args.i[2] = R;
        return true;
    }
    default: break;
    }
    return spec_fail(s, "not a row op");
}

/* the attention argument block: sizes, q/k/v strides and columns; t[] from the node, with a
 * packed q|k|v passed as q, k and v (three views of one tensor) */
static void attn_args(CuLaunch *l, const Node *n, bool packed, const int64_t *sz) {
    bool bwd = n->op == OP_ATTENTION_BWD;
    arg_node(l, 0, n);
    int base = bwd ? 2 : 1;
    if (bwd) arg_node(l, 1, n->in[0]);
    for (int k = 0; k < 3; k++) arg_node(l, base + k, n->in[packed ? base - 1 : base - 1 + k]);
    l->args.n_in = n->n_in;
    for (int k = 0; k < 11; k++) l->args.i[k] = sz[k];
    l->args.f[0] = n->fattr[0];
}

static bool plan_attention(Spec *s) {
    const Node *n = s->n;
    if (!check_io(s, n, true)) return false;
    bool bwd = n->op == OP_ATTENTION_BWD;
    const Node *ysaved = ir_attention_bwd_reads_y(n) ? n->in[n->n_in - 1] : NULL;
    int n_qkv = n->n_in - (bwd ? 1 : 0) - (ysaved != NULL);
    if (n_qkv != 1 && n_qkv != 3) return spec_fail(s, "takes q, k, v or a packed q|k|v");
    bool packed = n_qkv == 1;
    const Tensor *q = &n->in[bwd ? 1 : 0]->t;
    if (q->rank != 3) return spec_fail(s, "q is not (B, T, H*D)");
    int64_t B = q->dims[0], T = q->dims[1], H = n->iattr[0], Hkv = n->iattr[1];
    int64_t width = packed ? q->dims[2] : 0;
    if (H <= 0 || Hkv <= 0 || H % Hkv) return spec_fail(s, "heads do not divide into kv heads");
    int64_t D = packed ? (q->dims[2] % (H + 2 * Hkv) ? 0 : q->dims[2] / (H + 2 * Hkv))
                       : (q->dims[2] % H ? 0 : q->dims[2] / H);
    if (D <= 0) return spec_fail(s, "heads %lld, kv_heads %lld do not divide q", (long long)H, (long long)Hkv);
    if (D % 16 || D > 128) return spec_fail(s, "head dim %lld: the GPU kernel takes multiples of 16 up to 128", (long long)D);
    int64_t sz[11] = {B, T, H, Hkv, D,
                      packed ? width : H * D, 0,
                      packed ? width : Hkv * D, packed ? H * D : 0,
                      packed ? width : Hkv * D, packed ? (H + Hkv) * D : 0};
    int64_t n_t = (T + 63) / 64;
    int base = bwd ? 1 : 0;
    const char *Y = fmt_arg(s, &n->t);
    const char *Q = fmt_arg(s, &n->in[base]->t);
    const char *K = fmt_arg(s, &n->in[packed ? base : base + 1]->t);
    const char *V = fmt_arg(s, &n->in[packed ? base : base + 2]->t);
    const char *DY = bwd ? fmt_arg(s, &n->in[0]->t) : F32_ARG;
    /* the tensor-core kernels take plain bf16 operands (read exactly as bf16) */
    bool tc = true;
    for (int i = 0; i < n->n_in; i++) {
        const Format *f = &n->in[i]->t.fmt;
        if (f->elem != FMT_BF16 || f->scaling != SCALE_NONE) tc = false;
    }
    /* tensor cores: 128 threads, shared memory as CkTc<D> in attn_tc.cuh (bf16 tiles of row
     * stride D + 8: q and double-buffered k, v forward; q, dy and double-buffered k, v for dq;
     * k, v and double-buffered q, dy, lse, Dt for dk/dv) */
    int64_t tile = 64 * (D + 8) * 2;
    unsigned threads = tc ? 128 : 256;
    unsigned fwd_smem = (unsigned)(tc ? 5 * tile : (3 * 64 * (D + 1) + 64 * 65) * 4);
    unsigned dq_smem = (unsigned)(tc ? 6 * tile : (4 * 64 * (D + 1) + 64 * 65) * 4);
    unsigned dkv_smem = (unsigned)(tc ? 6 * tile + 4 * 64 * 4 : (4 * 64 * (D + 1) + 2 * 64 * 65 + 2 * 64) * 4);
    const char *fwd = tc ? "ck_attn_tc_fwd" : "ck_attn_fwd";
    CuLaunch *l;
    if (!bwd) {
        l = spec_launch(s, "attn", (unsigned)(B * H * n_t), threads, "%s<%lld, 0, %s, %s, %s, %s, %s>(a)", fwd,
                        (long long)D, Y, Q, K, V, F32_ARG);
        l->smem = fwd_smem;
        attn_args(l, n, packed, sz);
        l->args.i[11] = ir_attention_lse_offset(n);
        return true;
    }
    need_scratch(s, 2 * B * H * T * 4);
    if (ysaved && ir_attention_lse_offset(ysaved)) {
        /* the forward stored lse after y: the statistics are Dt = dy . y and a copy */
        /* as ck_attn_stat_lanes: 32 / lanes rows per warp, 8 warps */
        int64_t lanes = D % 8 == 0 && 32 % (D / 8) == 0 ? D / 8 : 32, rows = 8 * (32 / lanes);
        l = spec_launch(s, "attnsaved", (unsigned)((B * T * H + rows - 1) / rows), 256,
                        "ck_attn_saved_stats<%s, %s>(a)", DY, fmt_arg(s, &ysaved->t));
        attn_args(l, n, packed, sz);
        arg_node(l, 5, ysaved);
        l->args.i[11] = ir_attention_lse_offset(ysaved);
    } else {
        l = spec_launch(s, "attnstat", (unsigned)(B * H * n_t), threads, "%s<%lld, 1, %s, %s, %s, %s, %s>(a)", fwd,
                        (long long)D, F32_ARG, Q, K, V, DY);
        l->smem = fwd_smem;
        attn_args(l, n, packed, sz);
    }
    l->scratch = 0;
    l = spec_launch(s, "attndq", (unsigned)(B * H * n_t), threads, "%s<%lld, %s, %s, %s, %s, %s>(a)",
                    tc ? "ck_attn_tc_dq" : "ck_attn_dq", (long long)D, Y, DY, Q, K, V);
    l->smem = dq_smem;
    l->scratch = 0;
    attn_args(l, n, packed, sz);
    l = spec_launch(s, "attndkv", (unsigned)(B * Hkv * n_t), threads, "%s<%lld, %s, %s, %s, %s, %s>(a)",
                    tc ? "ck_attn_tc_dkv" : "ck_attn_dkv", (long long)D, Y, DY, Q, K, V);
    l->smem = dkv_smem;
    l->scratch = 0;
    attn_args(l, n, packed, sz);
    return true;
}


/* An update that writes the weights' FP8 copy leaves each block's largest |new weight| in its
 * scratch (the update launch `l`); one block then stores their maximum as the copy's amax
 * (ck_amax_record_final over a history of one). */
static void plan_copy_amax(Spec *s, const Node *n, CuLaunch *l) {
    const Node *amax = n->in[ir_adamw_copy_index(n) + 2];
    unsigned parts = l->grid[0];
    l->scratch = 0;
    need_scratch(s, (int64_t)parts * 4);
    l = spec_launch(s, "copyamax", 1, ROW_THREADS, "ck_amax_record_final<%s>(a)", fmt_arg(s, &amax->t));
    arg_node(l, 0, amax);
    l->scratch = 0;
    l->batch = true;
    l->args.i[0] = parts;
}
static bool plan_optimizer(Spec *s) {
    const Node *n = s->n;
    CuLaunch *l;
    switch (n->op) {
    case OP_ACCUMULATE:
        if (!check_io(s, n, false)) return false;
        if (ir_numel(&n->in[0]->t) != ir_numel(&n->in[1]->t)) return spec_fail(s, "sizes differ");
        l = spec_launch(s, "accum", grid_elem(ir_numel(&n->in[0]->t)), ELEM_THREADS,
                        "ck_accumulate<%s, %s>(a)", fmt_arg(s, &n->in[0]->t), fmt_arg(s, &n->in[1]->t));
        args_inputs(l, n);
        return true;
    case OP_ASSIGN:
        if (!check_io(s, n, false)) return false;
        if (ir_numel(&n->in[0]->t) != ir_numel(&n->in[1]->t)) return spec_fail(s, "sizes differ");
        l = spec_launch(s, "copy", grid_elem(ir_numel(&n->in[0]->t)), ELEM_THREADS,
                        "ck_copy<%s, %s>(a)", fmt_arg(s, &n->in[0]->t), fmt_arg(s, &n->in[1]->t));
        args_inputs(l, n);
        return true;
    case OP_CLIP_COEF:
        if (!check_io(s, n, true)) return false;
        l = spec_launch(s, "clip", 1, 32, "ck_clip_coef<%s, %s>(a)", fmt_arg(s, &n->t),
                        fmt_arg(s, &n->in[0]->t));
        args_result_inputs(l, n);
        l->args.f[0] = n->fattr[0];
        return true;
    case OP_GRAD_NORM:
        if (!spec_check_tensor(s, &n->t, "the result") || !spec_check_tensor(s, &n->in[0]->t, "grad_scale"))
            return false;
        for (int i = 1; i < n->n_in; i++) {
            const Tensor *t = &n->in[i]->t;
            if (t->fmt.elem != FMT_F32 || t->fmt.scaling != SCALE_NONE || ir_numel(t) != 1)
                return spec_fail(s, "input %d is not a plain f32 scalar", i);
        }
        l = spec_launch(s, "gnorm", 1, 32, "ck_grad_norm<%s, %s>(a)", fmt_arg(s, &n->t),
                        fmt_arg(s, &n->in[0]->t));
        arg_node(l, 0, n);
        arg_node(l, 1, n->in[0]);
        l->args.n_in = n->n_in;
        l->table = true;
        return true;
    case OP_ADAMW: {
        int at_master = ir_adamw_master_index(n), at_copy = ir_adamw_copy_index(n);
        if (n->n_in - (at_copy >= 0 ? 3 : 0) != 8 + (at_master >= 0)) return spec_fail(s, "takes 8 or 9 inputs");
        int64_t count = ir_numel(&n->in[0]->t);
        for (int i = 1; i < n->n_in && i != 4; i++)
            if (i < 4 && ir_numel(&n->in[i]->t) != count) return spec_fail(s, "input %d's size differs", i);
        const Node *mn = n->in[2], *vn = n->in[3], *wn = at_master >= 0 ? n->in[at_master] : NULL;
        const Node *cn = at_copy >= 0 ? n->in[at_copy] : NULL;
        if (cn && (!spec_check_tensor(s, &cn->t, "the FP8 copy") || cn->t.fmt.scaling != SCALE_PER_TENSOR ||
                   !spec_check_tensor(s, &n->in[at_copy + 2]->t, "the copy's amax")))
            return false;
        /* the copy's template argument and its place: t[at_copy], after it the scale and amax */
        const char *copy_arg = cn ? fmt_arg(s, &cn->t) : F32_ARG;
        int copy_at = cn ? at_copy : 0;
        Codec mc = mn->t.fmt.codec, vc = vn->t.fmt.codec, wc = wn ? wn->t.fmt.codec : CODEC_PLAIN;
        if (mc == CODEC_PLAIN && vc == CODEC_PLAIN && wc == CODEC_PLAIN) {
            if (!check_io(s, n, false)) return false;
            char list[1024] = "";
            for (int i = 0; i < 9; i++) {
                size_t at = strlen(list);
                snprintf(list + at, sizeof list - at, "%s, ",
                         i < 8 || wn ? fmt_arg(s, &n->in[i]->t) : F32_ARG);
            }
            /* about four vectors a thread: each block starts by reading the step's scalars and
             * computing the bias corrections, one thread while the others wait */
            l = spec_launch(s, "adamw", grid_elem((count + 31) / 32), ELEM_THREADS, "ck_adamw<%s%d, %s, %d>(a)", list,
                            wn != NULL, copy_arg, copy_at);
            args_inputs(l, n);
            l->batch = true;
            for (int i = 0; i < 4; i++) l->args.f[i] = n->fattr[i];
            if (cn) plan_copy_amax(s, n, l);
            return true;
        }
        /* coded states: each one is plain, or a group codec with its side values */
        const Node *st[2] = {mn, vn};
        for (int k = 0; k < 2; k++) {
            const Format *f = &st[k]->t.fmt;
            if (f->codec == CODEC_PLAIN) {
                if (!spec_check_tensor(s, &st[k]->t, k ? "v" : "m")) return false;
                continue;
            }
            if (f->codec == CODEC_SPLIT || f->elem != codec_elem(f->codec) || !f->scale ||
                f->scale->t.fmt.elem != FMT_F32 ||
                ir_numel(&f->scale->t) != codec_param_count(f->codec, count))
                return spec_fail(s, "%s: codec '%s' with elements %s and %lld side values", k ? "v" : "m",
                                 fmt_codec_name(f->codec), fmt_elem_name(f->elem),
                                 (long long)(f->scale ? ir_numel(&f->scale->t) : 0));
        }
        int mk = !wn ? 0 : wc == CODEC_SPLIT ? 2 : 1;
        if (mk == 2 && (n->in[0]->t.fmt.elem != FMT_BF16 || n->in[0]->t.fmt.scaling != SCALE_NONE ||
                        wn->t.fmt.elem != FMT_I8))
            return spec_fail(s, "a split master needs a bf16 parameter and an i8 correction");
        if (mk == 1 && !spec_check_tensor(s, &wn->t, "the master")) return false;
        for (int i = 0; i < 8; i++)
            if (i != 2 && i != 3 && !(i == 0 && mk == 2) && !spec_check_tensor(s, &n->in[i]->t, "an input"))
                return false;
        const char *codec_names[CODEC_COUNT] = {"CODEC_PLAIN", "CODEC_EXPAND", "CODEC_COMPAND", "CODEC_SQRT", "CODEC_SPLIT"};
        /* a warp per 256 elements, four chunks a warp: a block starts with one thread computing
         * the bias corrections in f64 while the others wait, which blocks of one chunk a warp
         * paid once per 1024 elements (7.0 ms of d12 -O3's update on an H200) */
        int64_t chunks = (count + 255) / 256;
        int64_t blocks = (chunks + 31) / 32;
        l = spec_launch(s, "adamwc", (unsigned)(blocks < 1 ? 1 : blocks > 4096 ? 4096 : blocks), ELEM_THREADS,
                        "ck_adamw_coded<%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %d, %s, %s, %d>(a)",
                        mk == 2 ? "F<FMT_BF16, SCALE_NONE>" : fmt_arg(s, &n->in[0]->t),
                        fmt_arg(s, &n->in[1]->t), fmt_arg(s, &n->in[4]->t), fmt_arg(s, &n->in[5]->t),
                        fmt_arg(s, &n->in[6]->t), fmt_arg(s, &n->in[7]->t), codec_names[mc],
                        mc == CODEC_PLAIN ? fmt_arg(s, &mn->t) : F32_ARG, codec_names[vc],
                        vc == CODEC_PLAIN ? fmt_arg(s, &vn->t) : F32_ARG, mk,
                        mk == 1 ? fmt_arg(s, &wn->t) : F32_ARG, copy_arg, copy_at);
        args_inputs(l, n);
        l->batch = true;
        for (int i = 0; i < 4; i++) l->args.f[i] = n->fattr[i];
        if (cn) plan_copy_amax(s, n, l);
        return true;
    }
    default: break;
    }
    return spec_fail(s, "not an optimizer op");
}

/* ---------------------------------------------------------------- GEMM */

typedef enum { OPD_BF16, OPD_F32, OPD_FP8, OPD_OTHER } OperandKind;

/* OPD_FP8: e4m3 or e5m2 with f32 scales, per tensor, row, 1x128 tile or 128x128 block */
static OperandKind operand_kind(const Tensor *t) {
    const Format *f = &t->fmt;
    if (f->codec != CODEC_PLAIN) return OPD_OTHER;
    if (f->scaling == SCALE_NONE && f->elem == FMT_BF16) return OPD_BF16;
    if (f->scaling == SCALE_NONE && f->elem == FMT_F32) return OPD_F32;
    bool grouping = f->scaling == SCALE_PER_TENSOR || f->scaling == SCALE_PER_ROW ||
                    f->scaling == SCALE_TILE_1x128 || f->scaling == SCALE_BLOCK_128;
    if ((f->elem == FMT_E4M3 || f->elem == FMT_E5M2) && grouping && f->scale && f->scale->t.fmt.elem == FMT_F32 &&
        (f->scaling != SCALE_TILE_1x128 || f->group == 128))
        return OPD_FP8;
    return OPD_OTHER;
}

/* The cuBLASLt scale mode of an FP8 operand whose contraction runs along its columns
 * (k_cols) or along its rows (it is read through a transposed copy); -1: none fits. Rows and
 * 1x128 tiles are scales along the stored rows, which cuBLASLt takes only when k runs along
 * them; a 128x128 block is the same block either way. */
static int fp8_scale_mode(const Tensor *t, bool k_cols) {
    switch (t->fmt.scaling) {
    case SCALE_PER_TENSOR: return CU_SCALE_TENSOR;
    case SCALE_PER_ROW: return k_cols ? CU_SCALE_OUTER : -1;
    case SCALE_TILE_1x128: return k_cols ? CU_SCALE_VEC128 : -1;
    case SCALE_BLOCK_128: return CU_SCALE_BLK128;
    default: return -1;
    }
}

/* The pairs of scale modes Hopper's cuBLASLt multiplies (cuBLAS 12.9 and later for all but
 * per-tensor): both per tensor; both per row; 1x128 tiles with 1x128 tiles or with 128x128
 * blocks. The grouped modes take e4m3 operands, as DeepSeek-V3's recipe uses them. */
static bool fp8_scale_pair(int a, int b, ElemType ea, ElemType eb) {
    if (a < 0 || b < 0) return false;
    if (a == CU_SCALE_TENSOR || b == CU_SCALE_TENSOR) return a == b;
    if (ea != FMT_E4M3 || eb != FMT_E4M3) return false;
    if (a == CU_SCALE_OUTER || b == CU_SCALE_OUTER) return a == b;
    return !(a == CU_SCALE_BLK128 && b == CU_SCALE_BLK128);
}

/* Bytes of an operand's dequantization scales in mode m, stored (outer, k). */
static int64_t fp8_scale_bytes(int m, int64_t outer, int64_t k) {
    int64_t kb = (k + 127) / 128;
    int64_t n = m == CU_SCALE_TENSOR ? 16 : m == CU_SCALE_OUTER ? outer
              : m == CU_SCALE_VEC128 ? kb * outer : (outer + 127) / 128 * ((kb + 3) / 4 * 4);
    return (n * 4 + 255) / 256 * 256;
}

/* The launch that writes a grouped operand's dequantization scales in cuBLASLt's layout. */
static void plan_gemm_scales(Spec *s, const Node *x, int mode, bool k_rows, int64_t off) {
    int64_t R = rows_of(&x->t), C = cols_of(&x->t);
    int64_t n = fp8_scale_bytes(mode, k_rows ? C : R, k_rows ? R : C) / 4;
    CuLaunch *l = spec_launch(s, "gemmscales", grid_elem(n), ELEM_THREADS, "ck_gemm_scales(a)");
    arg_node(l, 1, x->t.fmt.scale);
    l->args.i[0] = mode, l->args.i[1] = R, l->args.i[2] = C, l->args.i[3] = k_rows;
    l->scratch = off;
}

/* a row-major (r, c) operand copied as (c, r), element bytes as they are: into the tensor of
 * node `to` (a TRANSPOSE), or without one into scratch at byte off */
static void plan_transpose(Spec *s, const Node *x, const Node *to, int64_t off) {
    int64_t R = rows_of(&x->t), C = cols_of(&x->t);
    int bytes = fmt_elem_bytes(x->t.fmt.elem), tile = bytes == 1 ? 64 : 32;
    CuLaunch *l = bytes == 1 ? spec_launch(s, "transpose", (unsigned)((C + tile - 1) / tile), 256, "ck_transpose_b1(a)")
                             : spec_launch(s, "transpose", (unsigned)((C + tile - 1) / tile), 256,
                                           "ck_transpose<%d>(a)", bytes);
    l->grid[1] = (unsigned)((R + tile - 1) / tile);
    if (to) arg_node(l, 0, to);
    else arg_scratch(l, 0, off, C, R);
    arg_node(l, 1, x);
}

/* Whether TRANSPOSE n moves x's codes as they are: unscaled, the same per-tensor scale, or
 * 128 x 128 blocks whose grid of scales is the transpose of x's (the layout pass's second
 * TRANSPOSE). */
static bool transpose_keeps_values(const Node *n) {
    const Format *fx = &n->in[0]->t.fmt, *fy = &n->t.fmt;
    if (fy->elem != fx->elem || fy->scaling != fx->scaling || fy->codec != fx->codec) return false;
    switch (fy->scaling) {
    case SCALE_NONE: return true;
    case SCALE_PER_TENSOR: return fy->scale == fx->scale;
    case SCALE_BLOCK_128: return fy->scale && fy->scale->op == OP_TRANSPOSE && fy->scale->in[0] == fx->scale;
    default: return false;
    }
}

/* an operand decoded to plain f32 in scratch */
static void plan_decode(Spec *s, const Node *x, int64_t off) {
    int64_t count = ir_numel(&x->t);
    CuLaunch *l = spec_launch(s, "copy", grid_elem(count), ELEM_THREADS, "ck_copy<%s, %s>(a)",
                              F32_ARG, fmt_arg(s, &x->t));
    arg_scratch(l, 0, off, rows_of(&x->t), cols_of(&x->t));
    arg_node(l, 1, x);
}

/* What cuBLASLt adds to a GEMM's product before its one rounding: a bias broadcast over the
 * rows, a same-shaped C (beta = 1), or both, then an activation (CuActivation: GELU, whose
 * pre-activation it also writes to aux, or GELU's backward, which reads GELU's input from
 * aux); the result goes to d's tensor. d is a plain bf16 or f32 value, or the delayed
 * per-tensor FP8 copy of the value (a QUANTIZE), whose amax the GEMM hands to `record` (the
 * value's AMAX_RECORD). For a plain matmul: nothing, and d is the matmul itself. */
typedef struct {
    const Node *d, *bias, *c;
    CuActivation act;
    const Node *aux;
    const Node *record;
} GemmEpilogue;

static bool plan_matmul(Spec *s, const GemmEpilogue *ep) {
    const Node *n = s->n, *y = ep ? ep->d : n;
    if (!check_io(s, n, true) || !spec_check_tensor(s, &y->t, "the result")) return false;
    const Node *A = n->in[0], *B = n->in[1];
    bool ta = n->iattr[0] != 0, tb = n->iattr[1] != 0;
    int64_t ar = rows_of(&A->t), ac = cols_of(&A->t), br = rows_of(&B->t), bc = cols_of(&B->t);
    int64_t M = ta ? ac : ar, K = ta ? ar : ac, KB = tb ? bc : br, N = tb ? br : bc;
    if (K != KB) return spec_fail(s, "inner dimensions %lld and %lld differ", (long long)K, (long long)KB);
    if (ir_numel(&n->t) != M * N || ir_numel(&y->t) != M * N) return spec_fail(s, "the result is not (M, N)");
    OperandKind ka = operand_kind(&A->t), kb = operand_kind(&B->t);
    const Format *fy = &y->t.fmt;
    bool y_direct = fy->codec == CODEC_PLAIN && fy->scaling == SCALE_NONE &&
                    (fy->elem == FMT_BF16 || fy->elem == FMT_F32);
    bool y_fp8 = ep && ep->record;   /* a GELU's delayed FP8 copy (gemm_gelu) */
    if (ep && !y_direct && !y_fp8) return spec_fail(s, "an epilogue needs a plain bf16 or f32 result");
    /* cuBLAS's A is B_g, its k along B_g's columns when tb; cuBLAS's B is A_g (k along its
     * columns unless ta) */
    int mode_a = kb == OPD_FP8 ? fp8_scale_mode(&B->t, tb) : -1;
    int mode_b = ka == OPD_FP8 ? fp8_scale_mode(&A->t, !ta) : -1;
    bool grouped = mode_a > CU_SCALE_TENSOR || mode_b > CU_SCALE_TENSOR;
    bool fp8 = fp8_scale_pair(mode_a, mode_b, B->t.fmt.elem, A->t.fmt.elem) &&
               !(A->t.fmt.elem == FMT_E5M2 && B->t.fmt.elem == FMT_E5M2) && K % 16 == 0 && N % 16 == 0 &&
               M % 16 == 0;
    /* grouped scales: a plain product into bf16 (the combinations cuBLASLt is known to run) */
    if (grouped && (ep || !y_direct || fy->elem != FMT_BF16)) {
        if (ep) return spec_fail(s, "no epilogue with grouped FP8 scales");
        fp8 = false;
    }
    bool bf16 = ka == OPD_BF16 && kb == OPD_BF16;
    bool f32 = ka == OPD_F32 && kb == OPD_F32;
    if (y_fp8 && (!fp8 || grouped)) return spec_fail(s, "an FP8 result needs per-tensor FP8 operands");
    /* f32 operands (as they are, or decoded) multiply into an f32 result only (cuBLASLt has no
     * f32 x f32 -> bf16): another result type goes through scratch */
    if (!fp8 && !bf16 && y_direct && fy->elem != FMT_F32) {
        if (ep) return spec_fail(s, "an epilogue of f32 operands needs an f32 result");
        y_direct = false;
    }

    int64_t at = 0;   /* scratch bytes used so far */
    CuGemm g;
    memset(&g, 0, sizeof g);
    g.m = N, g.n = M, g.k = K;
    g.scales = -1;
    g.a.scratch = g.b.scratch = g.d.scratch = g.c.scratch = g.bias.scratch = -1;
    if (fp8) {
        /* Hopper's FP8 GEMM takes only TN: A (cuBLAS) = B_g as (N, K) row-major, B (cuBLAS) =
         * A_g as (M, K) row-major; other layouts get a transposed copy */
        g.ta = true, g.tb = false;
        g.atype = B->t.fmt.elem, g.btype = A->t.fmt.elem;
        /* as TransformerEngine does: forward products accumulate in the tensor cores' fast
         * mode, gradients (long sums over tokens, small values) with f32 promotion */
        g.fast_accum = n->phase == PHASE_FORWARD && !grouped;
        g.lda = K, g.ldb = K;
        g.scale_a = (CuScaleMode)mode_a, g.scale_b = (CuScaleMode)mode_b;
        g.scales = at;
        at += fp8_scale_bytes(mode_a, N, K);
        g.scales_b = grouped ? at : g.scales + 64;
        if (grouped) at += fp8_scale_bytes(mode_b, M, K);
        /* an operand read transposed: the copy its quantize kept (transposed=1), or one made
         * here in scratch — for graphs that did not go through the layout pass, which gives
         * every per-tensor and 128x128-block operand a k-contiguous copy (passes/layout.c) */
        if (tb) g.a.node = B;
        else if (ir_transposed_offset(B)) g.a.node = B, g.a.offset = ir_transposed_offset(B);
        else {
            g.a.scratch = at;
            plan_transpose(s, B, NULL, at);
            at += (N * K + 255) / 256 * 256;
        }
        if (!ta) g.b.node = A;
        else if (ir_transposed_offset(A)) g.b.node = A, g.b.offset = ir_transposed_offset(A);
        else {
            g.b.scratch = at;
            plan_transpose(s, A, NULL, at);
            at += (M * K + 255) / 256 * 256;
        }
        if (grouped) {
            plan_gemm_scales(s, B, mode_a, !tb, g.scales);
            plan_gemm_scales(s, A, mode_b, ta, g.scales_b);
        } else {
            CuLaunch *l = spec_launch(s, "invscale", 1, 32, "ck_inv_scales(a)");
            arg_node(l, 1, B->t.fmt.scale);
            arg_node(l, 2, A->t.fmt.scale);
            l->scratch = g.scales;
        }
    } else {
        ElemType e = bf16 ? FMT_BF16 : FMT_F32;
        g.atype = g.btype = e;
        g.ta = tb, g.tb = ta;
        g.lda = tb ? K : N;
        g.ldb = ta ? M : K;
        if (bf16 || f32) {
            g.a.node = B, g.b.node = A;
        } else {
            g.a.scratch = at;
            plan_decode(s, B, at);
            at += (N * K * 4 + 255) / 256 * 256;
            g.b.scratch = at;
            plan_decode(s, A, at);
            at += (M * K * 4 + 255) / 256 * 256;
        }
    }
    g.ldd = N;
    g.amax = -1;
    int64_t y_off = -1;
    if (y_direct || y_fp8) {
        g.d.node = y;
        g.dtype = fy->elem;
    } else {
        y_off = at;
        g.d.scratch = at;
        g.dtype = FMT_F32;
        at += (M * N * 4 + 255) / 256 * 256;
    }
    if (ep && ep->bias) {
        g.bias.node = ep->bias;
        g.biastype = ep->bias->t.fmt.elem;
    }
    if (ep && ep->c) g.c.node = ep->c;
    if (ep && ep->act != CU_ACT_NONE) {
        g.act = ep->act;
        g.aux.node = ep->aux;
        g.auxtype = ep->aux->t.fmt.elem;
    }
    if (y_fp8) {
        g.dscale.node = fy->scale;
        g.amax = at;
        at += 256;
    }
    CuLaunch *l = spec_launch(s, "gemm", 0, 0, "gemm");
    l->kind = CU_GEMM;
    l->gemm = g;
    snprintf(l->fn, sizeof l->fn, "cublasLt");
    if (y_fp8) {
        /* the history takes the amax cuBLASLt left: AMAX_RECORD's last launch over one part */
        const Node *r = ep->record;
        l = spec_launch(s, "amaxrec", 1, ROW_THREADS, "ck_amax_record_final<%s>(a)", fmt_arg(s, &r->in[0]->t));
        arg_node(l, 0, r->in[0]);
        l->scratch = g.amax;
        l->args.i[0] = 1;
    }
    if (!y_direct && !y_fp8) {
        l = spec_launch(s, "copy", grid_elem(M * N), ELEM_THREADS, "ck_copy<%s, %s>(a)",
                        fmt_arg(s, &n->t), F32_ARG);
        arg_node(l, 0, n);
        arg_scratch(l, 1, y_off, M, N);
    }
    need_scratch(s, at);
    return true;
}

/* ---------------------------------------------------------------- GEMM epilogues
 *
 * Fusion (codegen/fuse.c) puts a matmul and the elementwise nodes that consume its
 * product into one group that runs at the place of the group's last node, having checked
 * against the memory plan that every input survives until then. Where the group is a chain
 * cuBLASLt's epilogue computes — the product plus a bias row (y = x W^T + b), plus a
 * same-shaped tensor (a residual: y = x W^T + b + r; one term of a gradient sum; or an
 * accumulator updated in place: g += x^T dy), or GELU's backward of the product
 * (dx = (dy W) gelu'(x), DGELU, reading x) — the GEMM writes the chain's last value directly
 * and the other nodes run no kernel of their own.
 *
 * A GELU of a group's result is not in the group (its input is kept for the backward, so the
 * group must store it), but cuBLASLt's GELU_AUX_BIAS writes both: the GELU as D and its input
 * as the auxiliary output. The GELU then moves into the GEMM (gemm_gelu) when its value is
 * stored as it is (-O0), or, under delayed scaling, when nothing but its per-tensor FP8 copy
 * and the copy's amax record read it: the GEMM then writes the FP8 copy itself, through the
 * scale the history gave (D_SCALE), and leaves the value's amax for the history (AMAX_D) —
 * TransformerEngine's forward MLP GEMM. cuBLASLt offers AMAX_D only for FP8 results, and an
 * amax under current scaling is needed before the copy's scale exists, so where the copy is
 * scaled by its current amax (the levels' default) the GELU keeps its own kernel, which then
 * writes the copy itself (fuse_producer_quantizes: fewer bytes than a bf16 GELU from the GEMM
 * and a quantize after it). cuBLASLt's GELU is the tanh approximation, as the GELU op's.
 * Measured on an H200 (cuBLAS 13.1, d12's MLP at batch 32 x 1024): GELU_AUX_BIAS costs 0.04
 * ms (bf16) to 0.07 ms (e4m3) over a bias epilogue, against some 0.1 ms for a GELU kernel;
 * DGELU costs 0.08 ms over a plain bf16 GEMM, against some 0.15 ms for GELU's backward, but
 * with FP8 operands its GEMM takes 0.78 ms against 0.13, so FP8 products keep their GELU
 * backward kernel.
 *
 * Unlike the kernel IR's fusion this does change results a little: the chain is rounded
 * once, from f32, where the unfused nodes round the product (and the GELU's input) to their
 * formats first. */

static bool plain_direct(const Tensor *t) {
    return t->fmt.codec == CODEC_PLAIN && t->fmt.scaling == SCALE_NONE &&
           (t->fmt.elem == FMT_BF16 || t->fmt.elem == FMT_F32);
}

/* cuBLASLt's auxiliary matrix: GELU's input, plain, of D's element type and shape, never on
 * the bytes of d (the epilogue reads or writes it while it writes D) */
static bool gemm_aux_fits(const Node *aux, const Node *d) {
    ElemType e = d->t.fmt.elem == FMT_E4M3 || d->t.fmt.elem == FMT_E5M2 ? FMT_BF16 : d->t.fmt.elem;
    return plain_direct(&aux->t) && aux->t.fmt.elem == e && aux->t.offset >= 0 &&
           ir_numel(&aux->t) == ir_numel(&d->t) && !fuse_nodes_overlap(aux, d);
}

/* Whether the GEMM's result d stays off what it reads: its operands, their scales. */
static bool gemm_reads_clear(const Node *m, const Node *d) {
    for (int k = 0; k < 2; k++) {
        const Node *x = m->in[k];
        if (x->t.offset < 0 || fuse_nodes_overlap(x, d)) return false;
        if (x->t.fmt.scale && (x->t.fmt.scale->t.offset < 0 || fuse_nodes_overlap(x->t.fmt.scale, d)))
            return false;
    }
    return true;
}

/* The epilogue of the group members[0..n) (a matmul first, in schedule order), or false;
 * GELU's backward only where `gelu` allows activations. */
static bool epilogue_of(const Node *const *members, int n, bool gelu, GemmEpilogue *ep) {
    const Node *m = members[0];
    memset(ep, 0, sizeof *ep);
    if (m->op != OP_MATMUL || n < 2) return false;
    int64_t N = m->iattr[1] ? rows_of(&m->in[1]->t) : cols_of(&m->in[1]->t);
    for (int i = 1; i < n; i++) {
        const Node *c = members[i], *prev = members[i - 1], *other = NULL;
        bool last = i == n - 1;
        if (c->op == OP_ADD || (c->op == OP_ADD_N && c->n_in == 2)) {
            if ((c->in[0] == prev) == (c->in[1] == prev)) return false;
            other = c->in[0] == prev ? c->in[1] : c->in[0];
            if (c->op == OP_ADD && c->in[1] == other && other->t.rank == 1 && ir_numel(&other->t) == N &&
                i == 1 && N != ir_numel(&c->t)) {
                ep->bias = other;
            } else if (ir_numel(&other->t) == ir_numel(&c->t) && !ep->c) {
                ep->c = other;
            } else {
                return false;
            }
            ep->d = c;
        } else if (c->op == OP_ACCUMULATE && last && !ep->c && c->in[1] == prev && c->in[0] != prev) {
            ep->c = ep->d = c->in[0];
        } else if (gelu && c->op == OP_GELU_BWD && last && i == 1 && c->in[0] == prev && c->in[1] != prev &&
                   operand_kind(&m->in[0]->t) != OPD_FP8 && operand_kind(&m->in[1]->t) != OPD_FP8) {
            ep->act = CU_ACT_DGELU;
            ep->aux = c->in[1];
            ep->d = c;
        } else {
            return false;
        }
    }
    /* formats cuBLASLt reads and writes as they are; the result must not land on an operand
     * (or its scale) that the GEMM is still reading; C may be the result itself */
    const Tensor *d = &ep->d->t;
    if (!plain_direct(d) || d->offset < 0) return false;
    if (ep->c && (!plain_direct(&ep->c->t) || ep->c->t.fmt.elem != d->fmt.elem || ep->c->t.offset < 0))
        return false;
    if (ep->c && ep->c != ep->d && fuse_nodes_overlap(ep->c, ep->d) &&
        !(ep->c->t.offset == d->offset && ir_role_is_persistent(ep->c->t.role) == ir_role_is_persistent(d->role)))
        return false;
    if (ep->bias && (!plain_direct(&ep->bias->t) || ep->bias->t.offset < 0 || fuse_nodes_overlap(ep->bias, ep->d)))
        return false;
    if (ep->aux && !gemm_aux_fits(ep->aux, ep->d)) return false;
    return gemm_reads_clear(m, ep->d);
}

/* Whether the two nodes at `at` are all that read y: its delayed per-tensor FP8 copy (a
 * QUANTIZE to e4m3 or e5m2 through a scale the history gives, keeping no transposed copy) and
 * the copy's amax record (an AMAX_RECORD of y) — the pair the scaling pass makes for a value
 * under delayed scaling, in either order. */
static bool delayed_fp8_copy(const Graph *g, const Uses *uses, const Node *y, int at, const Node **copy,
                             const Node **record) {
    if (at + 1 >= g->n_nodes || uses[y->index].n != 2 || ir_role_is_persistent(y->t.role) ||
        y->t.role == ROLE_OUTPUT)
        return false;
    const Node *a = g->nodes[at], *b = g->nodes[at + 1];
    const Node *q = a->op == OP_QUANTIZE ? a : b, *r = a->op == OP_AMAX_RECORD ? a : b;
    if (q->op != OP_QUANTIZE || r->op != OP_AMAX_RECORD || q->in[0] != y || r->in[1] != y) return false;
    const Format *f = &q->t.fmt;
    const Node *sc = f->scale;
    if ((f->elem != FMT_E4M3 && f->elem != FMT_E5M2) || f->codec != CODEC_PLAIN || f->scaling != SCALE_PER_TENSOR ||
        f->recipe != RECIPE_DELAYED || !sc || sc->t.fmt.elem != FMT_F32 || ir_numel(&sc->t) != 1 || sc->t.offset < 0 ||
        ir_transposed_offset(q) || q->t.offset < 0 || fuse_nodes_overlap(q, sc) || fuse_nodes_overlap(q, r->in[0]))
        return false;
    *copy = q;
    *record = r;
    return true;
}

/* The GELU of the result h of a fused GEMM whose group ends at r, taken into the GEMM (the
 * essay above): the GELU is the next node, and stores its value as it is, or hands it only to
 * its delayed FP8 copy and amax record, the two nodes after it. members (n of them) gains the
 * nodes the GEMM now computes, in schedule order. The GEMM runs at r, before them: its results
 * must not land on what it reads, and between r and them nothing else runs. */
static bool gemm_gelu(const Graph *g, const Uses *uses, int r, const Node **members, int *n, GemmEpilogue *ep) {
    const Node *h = ep->d;
    if (ep->act != CU_ACT_NONE || ep->c || r + 1 >= g->n_nodes || ir_amax_parts_offset(h)) return false;
    const Node *y = g->nodes[r + 1];
    if (y->op != OP_GELU || y->in[0] != h || h->t.fmt.elem != FMT_BF16) return false;
    GemmEpilogue e = *ep;
    e.act = CU_ACT_GELU;
    e.aux = h;
    const Node *copy = NULL, *record = NULL;
    if (delayed_fp8_copy(g, uses, y, r + 2, &copy, &record)) {   /* y itself is never stored */
        e.d = copy;
        e.record = record;
    } else if (plain_direct(&y->t) && y->t.offset >= 0 && !ir_amax_parts_offset(y)) {
        e.d = y;
    } else {
        return false;
    }
    if (!gemm_aux_fits(h, e.d) || !gemm_reads_clear(members[0], e.d) || (e.bias && fuse_nodes_overlap(e.bias, e.d)))
        return false;
    *ep = e;
    members[(*n)++] = y;
    for (int k = r + 2; record && k <= r + 3; k++) members[(*n)++] = g->nodes[k];
    return true;
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

static bool plan_node(Spec *s) {
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
        return plan_optimizer(s);
    case OP_COUNT: break;
    }
    return spec_fail(s, "no GPU kernel for this op");
}

/* an empty plan for n, and the spec that fills it */
static Spec spec_for(const Node *n, Arena *a, CuNodePlan *out, char *why, size_t why_len) {
    memset(out, 0, sizeof *out);
    out->node = n;
    return (Spec){.arena = a, .n = n, .plan = out, .why = why, .why_len = why_len};
}

bool cuda_plan_node(const Node *n, Arena *a, CuNodePlan *out, char *why, size_t why_len) {
    Spec s = spec_for(n, a, out, why, why_len);
    if (!plan_node(&s)) return false;
    if (ir_amax_parts_offset(n) && !s.amax_written) plan_amax_pass(&s, n);
    return true;
}

bool cuda_plan_amax_pass(const Node *n, Arena *a, CuNodePlan *out) {
    char why[256];
    Spec s = spec_for(n, a, out, why, sizeof why);
    if (!ir_amax_parts_offset(n) || !spec_check_tensor(&s, &n->t, "the tensor")) return false;
    plan_amax_pass(&s, n);
    return true;
}

bool cuda_plan_finite(const Node *n, Arena *a, CuNodePlan *out) {
    char why[256];
    Spec s = spec_for(n, a, out, why, sizeof why);
    if (!spec_check_tensor(&s, &n->t, "the tensor")) return false;
    CuLaunch *l = spec_launch(&s, "finite", grid_elem(ir_numel(&n->t)), ELEM_THREADS,
                              "ck_all_finite<%s>(a)", fmt_arg(&s, &n->t));
    arg_node(l, 0, n);
    l->scratch = 0;
    l->batch = true;
    return true;
}

/* ---------------------------------------------------------------- producers fused with quantizes */

/* ops whose one kernel launch computes the value and may store it through CkAmaxOnly or
 * CkThrough (plan_rows, plan_elementwise: producer_fmt) */
static bool producer_can_rerun(const Node *y) {
    switch (y->op) {
    case OP_LAYERNORM: case OP_RMSNORM: case OP_LAYERNORM_BWD_X: case OP_RMSNORM_BWD_X:
    case OP_GELU: case OP_SILU: case OP_GELU_BWD: case OP_SILU_BWD: return true;
    default: return false;
    }
}

/* Whether the quantize q (at schedule position qi) may run y's kernel again instead of reading
 * y: y is a transient, unscaled value made only for q and for q's own per-tensor scale (which
 * reads y's block maxima), q keeps no transposed copy, and everything y's kernel reads still
 * holds its value at q's place and shares no byte with q's result. */
static bool quantize_can_rerun(const Graph *g, const Uses *uses, const Node *q, int qi) {
    const Node *y = q->in[0], *scale = q->t.fmt.scale;
    if (q->op != OP_QUANTIZE || ir_transposed_offset(q) || q->t.fmt.scaling != SCALE_PER_TENSOR ||
        q->t.fmt.recipe != RECIPE_CURRENT || !scale || scale->op != OP_QUANT_SCALE || scale->in[0] != y)
        return false;
    if (!producer_can_rerun(y) || !ir_amax_parts_offset(y) || y->t.fmt.scaling != SCALE_NONE ||
        ir_role_is_persistent(y->t.role) || y->t.role == ROLE_OUTPUT || y->index < 0 || y->index >= qi ||
        g->nodes[y->index] != y || y->t.offset % 16 || q->t.offset % 16 || ir_numel(&y->t) != ir_numel(&q->t))
        return false;
    const Uses *u = &uses[y->index];
    for (int i = 0; i < u->n; i++)
        if (u->list[i] != q && u->list[i] != scale) return false;
    for (int k = 0; k < y->n_in; k++) {
        const Node *x = y->in[k], *xs = x->t.fmt.scale;
        if (!fuse_value_survives(g, x, y->index, qi) || fuse_nodes_overlap(q, x)) return false;
        if (xs && (!fuse_value_survives(g, xs, y->index, qi) || fuse_nodes_overlap(q, xs))) return false;
    }
    return true;
}

/* The uses of g's nodes, for passes that read a node's position as its index; NULL where the
 * positions are not the indices (nothing is fused then). */
static Uses *uses_by_position(const Graph *g) {
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->index != i) return NULL;
    return ir_fill_uses(g);
}

/* The one hook of the tuner (compiler/tune.c) in this file: each fusion below asks the graph's
 * choice table whether it may fuse at a site ("fuse.KIND@ID", else "fuse.KIND", else yes). A
 * tuning record or --choice sets them at build time; they travel in the artifact, so the
 * binary plans exactly what fp8c compiled. */
static bool fusion_on(const Graph *g, const char *kind, const Node *site) { return ir_choice_on(g, kind, site); }

/* A layernorm or GELU whose value only an FP8 copy of it reads (its one quantize) writes that
 * copy itself: its kernel runs at its own place storing only the block maxima that the copy's
 * scale reads, and again at the quantize's place storing FP8 (ops.cuh, CkAmaxOnly and
 * CkThrough). The value is never written or read back: per element, 2 bytes written and 2 read
 * become 2 read again (the producer's input). The bits are those of the unfused pair. */
static void fuse_producer_quantizes(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    for (int qi = 0; qi < g->n_nodes; qi++) {
        const Node *q = g->nodes[qi];
        if (q->op != OP_QUANTIZE || !fusion_on(g, "fuse.producer_quantizes", q) || !quantize_can_rerun(g, uses, q, qi))
            continue;
        const Node *y = q->in[0];
        char why[256];
        CuNodePlan amax_only, through;
        Spec s1 = spec_for(y, a, &amax_only, why, sizeof why), s2 = spec_for(y, a, &through, why, sizeof why);
        s1.result = RESULT_AMAX_ONLY;
        s2.result = RESULT_THROUGH;
        s2.through = q;
        if (!plan_node(&s1) || !s1.amax_written || amax_only.n_launch != 1 || !plan_node(&s2)) continue;
        through.node = q;
        through.absorbed[through.n_absorbed++] = y;
        plans[y->index] = amax_only;
        plans[qi] = through;
    }
}

/* A bias gradient, the sum over rows of a gradient dy, where dy is also quantized with its
 * transposed copy for the GEMMs (the weight's input and weight gradients): the quantize's tiles
 * sum their columns as they go, and a last launch at the quantize's place adds the tiles' sums
 * (TransformerEngine's cast-transpose-dbias). dy is read once instead of twice. The schedule
 * puts the sum, and the accumulation of the sum into the bias's gradient accumulator, before
 * the quantize; they move to the quantize's place where nothing reads them before it:
 *  - a sum that only later nodes read keeps its bytes until then (the memory plan holds them
 *    for its readers), and the last launch stores it;
 *  - a sum that only its accumulation reads, accumulated into an accumulator that nothing in
 *    between reads or writes and that only later nodes read: the last launch adds the sum,
 *    rounded to its format, into the accumulator, as the accumulation would have, and the sum
 *    is never stored.
 * Their own places then run nothing. */
static bool read_only_after(const Uses *uses, const Node *x, int at) {
    const Uses *u = &uses[x->index];
    for (int k = 0; k < u->n; k++)
        if (u->list[k]->index <= at) return false;
    return true;
}

static const Node *bias_grad_accumulation(const Graph *g, const Uses *uses, const Node *q, const Node *sum) {
    const Uses *u = &uses[sum->index];
    const Node *acc = u->n == 1 ? u->list[0] : NULL;
    if (!acc || acc->op != OP_ACCUMULATE || acc->in[1] != sum || acc->in[0] == sum || acc->index >= q->index ||
        !plain_direct(&acc->t) || !plain_direct(&acc->in[0]->t) || !read_only_after(uses, acc, q->index))
        return NULL;
    const Node *state = acc->in[0];
    if (!fuse_value_survives(g, state, acc->index, q->index)) return NULL;
    for (int j = acc->index + 1; j < q->index; j++)
        for (int k = 0; k < g->nodes[j]->n_in; k++)
            if (fuse_nodes_overlap(state, g->nodes[j]->in[k])) return NULL;
    return acc;
}

static void fuse_bias_grads(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    for (int si = 0; si < g->n_nodes; si++) {
        const Node *sum = g->nodes[si], *x = sum->op == OP_SUM_ROWS ? sum->in[0] : NULL;
        if (!x || x->index < 0 || !plain_direct(&sum->t) || !plain_direct(&x->t) || sum->t.role == ROLE_OUTPUT ||
            ir_numel(&sum->t) != cols_of(&x->t) || !fusion_on(g, "fuse.bias_grads", sum))
            continue;
        const Uses *u = &uses[x->index];
        const Node *q = NULL;
        for (int k = 0; k < u->n && !q; k++)
            if (u->list[k]->op == OP_QUANTIZE && ir_transposed_offset(u->list[k])) q = u->list[k];
        if (!q || q->index <= si || plans[q->index].n_launch != 1) continue;
        const Node *acc = NULL;
        if (!read_only_after(uses, sum, q->index) && !(acc = bias_grad_accumulation(g, uses, q, sum))) continue;
        if (acc && plans[acc->index].n_launch != 1) continue;
        char why[256];
        CuNodePlan fused;
        Spec s = spec_for(q, a, &fused, why, sizeof why);
        s.bias_grad = sum;
        s.bias_acc = acc;
        if (!plan_node(&s) || fused.n_launch != 2) continue;
        fused.absorbed[fused.n_absorbed++] = sum;
        if (acc) fused.absorbed[fused.n_absorbed++] = acc;
        plans[q->index] = fused;
        memset(&plans[si], 0, sizeof plans[si]);
        plans[si].node = sum;
        if (acc) {
            memset(&plans[acc->index], 0, sizeof plans[acc->index]);
            plans[acc->index].node = acc;
        }
    }
}

/* A quantize into per-group (or 1 x 128 tile) scales, and the QUANT_SCALE that makes those
 * scales from the same x, run as one launch at the quantize's place: each group's scale is
 * stored and its elements quantized through it while x is in registers (ops.cuh,
 * ck_quantize_group), one read of x instead of two. The scale's place then runs nothing. It
 * may move later because nothing before the quantize reads it (every use of the scale is the
 * quantize or after it), the memory plan keeps its bytes from its own place on, and x, which
 * the quantize reads, still holds its value there. The bits are those of the two launches. */
static bool group_quantize_fusable(const Uses *uses, const Node *q) {
    const Node *sc = q->op == OP_QUANTIZE && q->n_in == 2 ? q->in[1] : NULL;
    Scaling kind = q->t.fmt.scaling;
    if (!sc || ir_transposed_offset(q) || (kind != SCALE_PER_GROUP && kind != SCALE_TILE_1x128) ||
        q->t.fmt.recipe != RECIPE_CURRENT || q->t.fmt.scale != sc || sc->op != OP_QUANT_SCALE ||
        sc->in[0] != q->in[0] || sc->iattr[0] != q->t.fmt.elem || sc->iattr[1] != kind ||
        (kind == SCALE_PER_GROUP && sc->iattr[2] != q->t.fmt.group) || sc->index < 0 || sc->index >= q->index ||
        ir_role_is_persistent(sc->t.role) || ir_role_is_persistent(q->in[0]->t.role))
        return false;
    const Uses *u = &uses[sc->index];
    for (int k = 0; k < u->n; k++)
        if (u->list[k]->index < q->index) return false;
    return true;
}

static void fuse_group_quantizes(const Graph *g, CuNodePlan *plans, Arena *a) {
    Uses *uses = uses_by_position(g);
    if (!uses) return;
    for (int qi = 0; qi < g->n_nodes; qi++) {
        const Node *q = g->nodes[qi];
        if (!group_quantize_fusable(uses, q) || !fusion_on(g, "fuse.group_quantizes", q) || plans[qi].n_launch != 1 ||
            plans[q->in[1]->index].n_launch != 1)
            continue;
        char why[256];
        CuNodePlan fused;
        Spec s = spec_for(q, a, &fused, why, sizeof why);
        s.group_scale = q->in[1];
        if (!plan_node(&s) || fused.n_launch != 1) continue;
        fused.absorbed[fused.n_absorbed++] = q->in[1];
        plans[qi] = fused;
        memset(&plans[q->in[1]->index], 0, sizeof plans[0]);
        plans[q->in[1]->index].node = q->in[1];
    }
}

/* A cross entropy's backward right after its forward (the loss chunks of chunk_loss.c run
 * so): both read every row of the logits for its logsumexp, the same computation in the same
 * order (ck_row_lse, one block of ce_row_threads a row). The forward leaves it in the scratch,
 * after the row losses and the backward's coefficient, and the backward reads it there: a read
 * of the logits less, the same bits. Nothing runs between them, so nothing else uses the
 * scratch (which every node's launches share) in between. */
static void fuse_ce_lse(const Graph *g, CuNodePlan *plans, Arena *a) {
    for (int j = 1; j < g->n_nodes; j++) {
        const Node *b = g->nodes[j], *f = g->nodes[j - 1];
        if (b->op != OP_CROSS_ENTROPY_BWD || f->op != OP_CROSS_ENTROPY || b->in[1] != f->in[0] ||
            b->in[2] != f->in[1] || plans[j - 1].n_launch != 2 || plans[j].n_launch != 2 || !fusion_on(g, "fuse.ce_lse", b))
            continue;
        char why[256];
        CuNodePlan pf, pb;
        Spec sf = spec_for(f, a, &pf, why, sizeof why), sb = spec_for(b, a, &pb, why, sizeof why);
        sf.ce_lse_at = sb.ce_lse_at = 8 * (rows_of(&f->in[0]->t) + 1);
        if (!plan_node(&sf) || !plan_node(&sb) || pf.n_launch != 2 || pb.n_launch != 2) continue;
        plans[j - 1] = pf;
        plans[j] = pb;
    }
}

CuNodePlan *cuda_plan_graph(const Graph *g, Arena *a, char *why, size_t why_len) {
    CuNodePlan *plans = arena_alloc(a, sizeof *plans * (size_t)(g->n_nodes ? g->n_nodes : 1));
    for (int i = 0; i < g->n_nodes; i++)
        if (!cuda_plan_node(g->nodes[i], a, &plans[i], why, why_len)) return NULL;
    fuse_producer_quantizes(g, plans, a);
    fuse_bias_grads(g, plans, a);
    fuse_group_quantizes(g, plans, a);
    fuse_ce_lse(g, plans, a);
    return plans;
}

CuNodePlan *cuda_plan_epilogues(Graph *g, const CuNodePlan *node_plans, Arena *a) {
    CuNodePlan *plans = arena_alloc(a, sizeof *plans * (size_t)(g->n_nodes ? g->n_nodes : 1));
    memcpy(plans, node_plans, sizeof *plans * (size_t)g->n_nodes);
    ir_renumber(g);
    int *group = fuse_plan(g, a);
    Uses *uses = uses_by_position(g);
    bool gelu_epilogues = fusion_on(g, "fuse.gemm_gelu", NULL);   /* off: GELU keeps its own kernels */
    const Node **members = arena_alloc(a, sizeof *members * (size_t)(g->n_nodes ? g->n_nodes : 1));
    for (int r = 0; r < g->n_nodes; r++) {
        int n = 0;
        for (int j = 0; j <= r; j++)
            if (group[j] == r) members[n++] = g->nodes[j];
        GemmEpilogue ep;
        if (n < 2 || !fusion_on(g, "fuse.gemm_epilogues", g->nodes[r]) || !epilogue_of(members, n, gelu_epilogues, &ep))
            continue;
        if (uses && gelu_epilogues) gemm_gelu(g, uses, r, members, &n, &ep);
        CuNodePlan fused;
        memset(&fused, 0, sizeof fused);
        fused.node = g->nodes[r];
        char why[256];
        Spec s = {.arena = a, .n = members[0], .plan = &fused, .why = why, .why_len = sizeof why};
        if (!plan_matmul(&s, &ep)) continue;
        if (ir_amax_parts_offset(ep.d)) plan_amax_pass(&s, ep.d);   /* the GEMM wrote d */
        fused.members = arena_alloc(a, sizeof *fused.members * (size_t)n);
        memcpy(fused.members, members, sizeof *members * (size_t)n);
        fused.n_members = n;
        for (int k = 0; k < n; k++) {
            const Node *m = members[k];
            memset(&plans[m->index], 0, sizeof plans[m->index]);
            plans[m->index].node = m;
        }
        plans[r] = fused;
    }
    return plans;
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
