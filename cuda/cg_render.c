/* cg_render.c — the kernel IR (codegen/codegen.h) rendered to CUDA C.
 *
 * The CPU backend renders the same kernels to LLVM IR (codegen/llvm.c); this file gives each
 * unique kernel body of a program (CgProgram.funcs) one CUDA function
 *     extern "C" __global__ void fp8c_gN(const CgCudaArgs a)     a.buf[i]: buffer i, a.items
 * in a module that starts with the GPU kernel library's prelude, so loads and stores use the
 * same exact conversions as the library kernels (Elem<E>, bit-identical to ir/numerics.c).
 *
 * The mapping is the one codegen.h's parallel kinds ask for:
 *   CG_PAR_THREAD  an item is a thread: a grid-stride loop over items; row and sequential
 *                  loops run inside the thread; locals are per-thread arrays.
 *   CG_PAR_BLOCK   an item is a thread block: a grid-stride loop over items by block. The
 *                  outermost CG_LOOP_ROW loops (those inside no other row loop) are spread
 *                  over the block's threads, and their reductions become block reductions
 *                  (warp shuffles, then one warp) that every thread receives. Everything else
 *                  runs in every thread with the same values. Locals live in shared memory:
 *                  inside a spread loop each thread touches only the elements at its own
 *                  iterations (codegen.h's rule), outside one every thread reads them; writes
 *                  outside spread loops (stores and lset) are done by thread 0 between two
 *                  barriers, so that no thread sees half an update.
 * Math is plain f32 (--fmad=false keeps a*b+c unfused unless CG_FMA asks), expf/logf/tanhf
 * for the transcendental ops, sqrtf correctly rounded, subnormals kept (no --ftz: the powers
 * of two of a split master's correction go down to 2^-141); f32 sums in spread loops are
 * added in a fixed tree, so results repeat bit for bit. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codegen.h"
#include "gpu.h"

extern const char cuda_text_ck_args[], cuda_text_prelude[];

enum { MAX_DEPTH = 16 };

typedef struct {
    StrBuf text;
    int indent;
} Out;

static void out_raw(Out *o, const char *s) { strbuf_add(&o->text, s); }

/* One line at the current indentation. */
static void out_line(Out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void out_line(Out *o, const char *fmt, ...) {
    for (int i = 0; i < o->indent && i < 100; i++) strbuf_addn(&o->text, "  ", 2);
    va_list ap;
    va_start(ap, fmt);
    strbuf_vprintf(&o->text, fmt, ap);
    va_end(ap);
    strbuf_addn(&o->text, "\n", 1);
}

/* ---------------------------------------------------------------- one kernel body */

typedef struct {
    const CgKernel *k;
    Out *o;
    bool block;             /* CG_PAR_BLOCK */
    int *red_loop;          /* per REDUCE: the instruction of its loop */
    bool *spread;           /* per LOOP: spread over the block's threads */
    int loops[MAX_DEPTH];   /* open loops */
    int depth;
    int spread_depth;       /* open spread loops (0 or 1) */
} R;

static const char *ctype(CgType t) {
    return t == CG_F32 ? "float" : t == CG_I64 ? "long long" : t == CG_BOOL ? "bool" : "void";
}

static CgType type_of(const CgKernel *k, int i) {
    const CgInst *in = &k->insts[i];
    if (in->op == CG_SELECT) return type_of(k, in->a[1]);
    return in->type;
}

static void fconst_text(double f, char *out, size_t len) {
    float x = (float)f;
    if (x != x) snprintf(out, len, "CK_NAN");
    else if (isinf(x)) snprintf(out, len, "%sCK_INF", x < 0 ? "-" : "");
    else snprintf(out, len, "%.9ef", (double)x);
}

static const char *elem_enum(ElemType e) {
    static char names[FMT_COUNT][16];
    char *s = names[e];
    if (!s[0]) {
        const char *n = fmt_elem_name(e);
        size_t k = (size_t)snprintf(s, 16, "FMT_");
        for (; *n && k < 15; n++) s[k++] = (char)(*n >= 'a' && *n <= 'z' ? *n - 32 : *n);
        s[k] = 0;
    }
    return s;
}

/* The expression of the scale of element idx of buffer b (row/col expressions or NULL). */
static void scale_expr(R *r, int b, const char *idx, const char *row, const char *col, char *out, size_t len) {
    const CgBuf *bf = &r->k->bufs[b];
    if (bf->scale_buf == CG_NONE) {
        fconst_text(bf->static_scale, out, len);
        return;
    }
    const char *se = elem_enum(r->k->bufs[bf->scale_buf].elem);
    char rw[160], cl[160];
    if (row) {
        snprintf(rw, sizeof rw, "%s", row);
        snprintf(cl, sizeof cl, "%s", col);
    } else {
        snprintf(rw, sizeof rw, "(%s / %lldLL)", idx, (long long)bf->cols);
        snprintf(cl, sizeof cl, "(%s %% %lldLL)", idx, (long long)bf->cols);
    }
    int64_t G = bf->group > 0 ? bf->group : 1;
    switch (bf->scaling) {
    case SCALE_PER_TENSOR: snprintf(out, len, "Elem<%s>::ld(a.buf[%d], 0)", se, bf->scale_buf); break;
    case SCALE_PER_ROW: snprintf(out, len, "Elem<%s>::ld(a.buf[%d], %s)", se, bf->scale_buf, rw); break;
    case SCALE_PER_GROUP:
    case SCALE_TILE_1x128:
        snprintf(out, len, "Elem<%s>::ld(a.buf[%d], %s * %lldLL + %s / %lldLL)", se, bf->scale_buf, rw,
                 (long long)((bf->cols + G - 1) / G), cl, (long long)G);
        break;
    case SCALE_BLOCK_128:
        snprintf(out, len, "Elem<%s>::ld(a.buf[%d], (%s / 128) * %lldLL + %s / 128)", se, bf->scale_buf, rw,
                 (long long)((bf->cols + 127) / 128), cl);
        break;
    default: snprintf(out, len, "1.0f"); break;
    }
}

#define V(i) "v%d", (i)

/* a write outside a spread loop of a block kernel: one thread, between barriers */
static void write_open(R *r) {
    if (r->block && !r->spread_depth) {
        out_line(r->o, "__syncthreads();");
        out_line(r->o, "if (threadIdx.x == 0) {");
        r->o->indent++;
    }
}
static void write_close(R *r) {
    if (r->block && !r->spread_depth) {
        r->o->indent--;
        out_line(r->o, "}");
        out_line(r->o, "__syncthreads();");
    }
}

static void emit_inst(R *r, int i) {
    const CgKernel *k = r->k;
    const CgInst *in = &k->insts[i];
    Out *o = r->o;
    int a0 = in->a[0], a1 = in->a[1], a2 = in->a[2], a3 = in->a[3];
    const char *t = ctype(type_of(k, i));
    char c[64];
    switch (in->op) {
    case CG_BODY: case CG_ITEM: return;   /* the caller's */
    case CG_FCONST: fconst_text(in->f, c, sizeof c); out_line(o, "const float v%d = %s;", i, c); return;
    case CG_ICONST: out_line(o, "const long long v%d = %lldLL;", i, (long long)in->i); return;
    case CG_IADD: out_line(o, "const long long v%d = v%d + v%d;", i, a0, a1); return;
    case CG_ISUB: out_line(o, "const long long v%d = v%d - v%d;", i, a0, a1); return;
    case CG_IMUL: out_line(o, "const long long v%d = v%d * v%d;", i, a0, a1); return;
    case CG_IDIV: out_line(o, "const long long v%d = v%d / v%d;", i, a0, a1); return;
    case CG_IMOD: out_line(o, "const long long v%d = v%d %% v%d;", i, a0, a1); return;
    case CG_IMIN: out_line(o, "const long long v%d = v%d < v%d ? v%d : v%d;", i, a0, a1, a0, a1); return;
    case CG_IMAX: out_line(o, "const long long v%d = v%d > v%d ? v%d : v%d;", i, a0, a1, a0, a1); return;
    case CG_ITOF: out_line(o, "const float v%d = (float)v%d;", i, a0); return;
    case CG_FTOI: out_line(o, "const long long v%d = (long long)v%d;", i, a0); return;
    case CG_FADD: out_line(o, "const float v%d = v%d + v%d;", i, a0, a1); return;
    case CG_FSUB: out_line(o, "const float v%d = v%d - v%d;", i, a0, a1); return;
    case CG_FMUL: out_line(o, "const float v%d = v%d * v%d;", i, a0, a1); return;
    case CG_FDIV: out_line(o, "const float v%d = v%d / v%d;", i, a0, a1); return;
    case CG_FMA: out_line(o, "const float v%d = fmaf(v%d, v%d, v%d);", i, a0, a1, a2); return;
    case CG_FMAX: out_line(o, "const float v%d = fmaxf(v%d, v%d);", i, a0, a1); return;
    case CG_FMIN: out_line(o, "const float v%d = fminf(v%d, v%d);", i, a0, a1); return;
    case CG_FNEG: out_line(o, "const float v%d = -v%d;", i, a0); return;
    case CG_FABS: out_line(o, "const float v%d = fabsf(v%d);", i, a0); return;
    case CG_EXP: out_line(o, "const float v%d = expf(v%d);", i, a0); return;
    case CG_LOG: out_line(o, "const float v%d = logf(v%d);", i, a0); return;
    case CG_TANH: out_line(o, "const float v%d = tanhf(v%d);", i, a0); return;
    case CG_SQRT: out_line(o, "const float v%d = sqrtf(v%d);", i, a0); return;
    case CG_FBITS: out_line(o, "const long long v%d = (long long)__float_as_uint(v%d);", i, a0); return;
    case CG_BITSF: out_line(o, "const float v%d = __uint_as_float((unsigned)v%d);", i, a0); return;
    case CG_FLT: out_line(o, "const bool v%d = v%d < v%d;", i, a0, a1); return;
    case CG_FLE: out_line(o, "const bool v%d = v%d <= v%d;", i, a0, a1); return;
    case CG_FEQ: out_line(o, "const bool v%d = v%d == v%d;", i, a0, a1); return;
    case CG_ILT: out_line(o, "const bool v%d = v%d < v%d;", i, a0, a1); return;
    case CG_IEQ: out_line(o, "const bool v%d = v%d == v%d;", i, a0, a1); return;
    case CG_AND: out_line(o, "const bool v%d = v%d && v%d;", i, a0, a1); return;
    case CG_NOT: out_line(o, "const bool v%d = !v%d;", i, a0); return;
    case CG_SELECT: out_line(o, "const %s v%d = v%d ? v%d : v%d;", t, i, a0, a1, a2); return;
    case CG_LOAD: {
        const CgBuf *bf = &k->bufs[in->buf];
        char idx[32], row[32], col[32], s[512];
        snprintf(idx, sizeof idx, "v%d", a0);
        out_line(o, "float v%d = Elem<%s>::ld(a.buf[%d], v%d);", i, elem_enum(bf->elem), in->buf, a0);
        if (bf->scaling != SCALE_NONE) {
            if (a1 >= 0) snprintf(row, sizeof row, "v%d", a1), snprintf(col, sizeof col, "v%d", a2);
            scale_expr(r, in->buf, idx, a1 >= 0 ? row : NULL, a1 >= 0 ? col : NULL, s, sizeof s);
            out_line(o, "v%d = v%d / %s;", i, i, s);
        }
        return;
    }
    case CG_STORE: case CG_ROUND: {
        const CgBuf *bf = &k->bufs[in->buf];
        int rw = in->op == CG_STORE ? a2 : a2, cl = in->op == CG_STORE ? a3 : a3;
        char idx[32], row[32], col[32], s[512] = "";
        snprintf(idx, sizeof idx, "v%d", a0);
        if (bf->scaling != SCALE_NONE) {
            if (rw >= 0) snprintf(row, sizeof row, "v%d", rw), snprintf(col, sizeof col, "v%d", cl);
            scale_expr(r, in->buf, idx, rw >= 0 ? row : NULL, rw >= 0 ? col : NULL, s, sizeof s);
        }
        char x[600];
        if (s[0]) snprintf(x, sizeof x, "(v%d * %s)", a1, s);
        else snprintf(x, sizeof x, "v%d", a1);
        if (in->op == CG_ROUND) {
            out_line(o, "float v%d = ck_cg_round<%s>(%s);", i, elem_enum(bf->elem), x);
            if (s[0]) out_line(o, "v%d = v%d / %s;", i, i, s);
            return;
        }
        write_open(r);
        out_line(o, "Elem<%s>::st(a.buf[%d], v%d, %s);", elem_enum(bf->elem), in->buf, a0, x);
        write_close(r);
        return;
    }
    case CG_LOOP: {
        bool spread = r->spread[i];
        /* reductions of this loop start at their identity */
        for (int j = i + 1; j < k->n_insts; j++)
            if (k->insts[j].op == CG_REDUCE && r->red_loop[j] == i)
                out_line(o, "float v%d = %s;", j, k->insts[j].i == CG_RED_SUM ? "0.0f" : "-CK_INF");
        if (spread) {
            out_line(o, "__syncthreads();");
            out_line(o, "for (long long v%d = v%d + threadIdx.x; v%d < v%d; v%d += blockDim.x) {", i, a0, i, a1, i);
            r->spread_depth++;
        } else {
            out_line(o, "for (long long v%d = v%d; v%d < v%d; v%d++) {", i, a0, i, a1, i);
        }
        o->indent++;
        r->loops[r->depth++] = i;
        return;
    }
    case CG_END: {
        int l = r->loops[--r->depth];
        o->indent--;
        out_line(o, "}");
        if (r->spread[l]) {
            r->spread_depth--;
            out_line(o, "__syncthreads();");
            for (int j = l + 1; j < k->n_insts; j++)
                if (k->insts[j].op == CG_REDUCE && r->red_loop[j] == l)
                    out_line(o, "v%d = %s(v%d);", j, k->insts[j].i == CG_RED_SUM ? "ck_block_sum<float>" : "ck_block_max", j);
        }
        return;
    }
    case CG_REDUCE:
        if (in->i == CG_RED_SUM) out_line(o, "v%d += v%d;", i, a0);
        else out_line(o, "v%d = fmaxf(v%d, v%d);", i, i, a0);
        return;
    case CG_LOCAL:
        if (r->block) {
            out_line(o, "__syncthreads();");
            fconst_text(in->f, c, sizeof c);
            out_line(o, "for (int j = threadIdx.x; j < %lld; j += blockDim.x) l%d[j] = %s;", (long long)in->i, i, c);
            out_line(o, "__syncthreads();");
        } else {
            fconst_text(in->f, c, sizeof c);
            out_line(o, "for (int j = 0; j < %lld; j++) l%d[j] = %s;", (long long)in->i, i, c);
        }
        return;
    case CG_LGET: out_line(o, "const float v%d = l%d[v%d];", i, a0, a1); return;
    case CG_LSET:
        write_open(r);
        out_line(o, "l%d[v%d] = v%d;", a0, a1, a2);
        write_close(r);
        return;
    case CG_OP_COUNT: break;
    }
    IR_ASSERT(!"bad kernel IR op");
}

static void render_body(const CgKernel *k, const char *name, Out *o) {
    R r = {.k = k, .o = o, .block = k->par == CG_PAR_BLOCK};
    int n = k->n_insts;
    r.red_loop = calloc((size_t)n + 1, sizeof *r.red_loop);
    r.spread = calloc((size_t)n + 1, sizeof *r.spread);
    IR_ASSERT(r.red_loop && r.spread);
    int open[MAX_DEPTH], depth = 0, spread_open = 0;
    for (int i = 0; i < n; i++) {
        const CgInst *in = &k->insts[i];
        if (in->op == CG_LOOP) {
            IR_ASSERT(depth < MAX_DEPTH);
            r.spread[i] = r.block && in->i == CG_LOOP_ROW && !spread_open;
            if (r.spread[i]) spread_open = 1;
            open[depth++] = i;
        } else if (in->op == CG_END) {
            if (r.spread[open[depth - 1]]) spread_open = 0;
            depth--;
        } else if (in->op == CG_REDUCE) {
            r.red_loop[i] = open[depth - 1];
        }
    }
    out_line(o, "extern \"C\" __global__ void __launch_bounds__(256) %s(const CgCudaArgs a) {", name);
    o->indent++;
    for (int i = 0; i < n; i++)
        if (k->insts[i].op == CG_LOCAL)
            out_line(o, "%sfloat l%d[%lld];", r.block ? "__shared__ " : "", i, (long long)k->insts[i].i);
    int i = 0;
    for (; i < n && k->insts[i].op != CG_BODY; i++) emit_inst(&r, i);
    if (r.block)
        out_line(o, "for (long long it = blockIdx.x; it < a.items; it += gridDim.x) {");
    else
        out_line(o, "for (long long it = (long long)blockIdx.x * blockDim.x + threadIdx.x; it < a.items; "
                    "it += (long long)gridDim.x * blockDim.x) {");
    o->indent++;
    for (; i < n; i++) {
        if (k->insts[i].op == CG_ITEM) {
            out_line(o, "const long long v%d = it;", i);
            continue;
        }
        emit_inst(&r, i);
    }
    if (r.block) out_line(o, "__syncthreads();");
    o->indent--;
    out_line(o, "}");
    o->indent--;
    out_line(o, "}");
    free(r.red_loop);
    free(r.spread);
}

/* ---------------------------------------------------------------- the module */

static const char *cg_prelude =
    "/* the kernel IR's calling convention: buffer pointers and the item count */\n"
    "#define CG_CUDA_MAX_BUFS 64\n"
    "typedef struct { void *buf[CG_CUDA_MAX_BUFS]; long long items; } CgCudaArgs;\n"
    "template <int E> static __device__ __forceinline__ float ck_cg_round(float v) {\n"
    "    unsigned b[1];\n"
    "    Elem<E>::st(b, 0, v);\n"
    "    return Elem<E>::ld(b, 0);\n"
    "}\n";

char *cuda_render_cg_program(const CgProgram *p, Arena *a) {
    Out o = {0};
    out_raw(&o, "/* fp8c GPU module of a kernel-IR program (cuda/cg_render.c) */\n");
    char enums[1024];
    size_t at = 0;
    at += (size_t)snprintf(enums + at, sizeof enums - at, "enum {");
    for (int e = 0; e < FMT_COUNT; e++)
        at += (size_t)snprintf(enums + at, sizeof enums - at, "%s %s = %d", e ? "," : "", elem_enum((ElemType)e), e);
    snprintf(enums + at, sizeof enums - at, " };\nenum { SCALE_NONE = %d, SCALE_PER_TENSOR = %d, SCALE_PER_ROW = %d, "
             "SCALE_PER_GROUP = %d, SCALE_TILE_1x128 = %d, SCALE_BLOCK_128 = %d };\n",
             SCALE_NONE, SCALE_PER_TENSOR, SCALE_PER_ROW, SCALE_PER_GROUP, SCALE_TILE_1x128, SCALE_BLOCK_128);
    out_raw(&o, enums);
    out_raw(&o, cuda_text_ck_args);
    out_raw(&o, cuda_text_prelude);
    out_raw(&o, cg_prelude);
    for (int f = 0; f < p->n_funcs; f++) {
        const CgKernel *k = p->funcs[f].first;
        if (k->kind != CG_KERNEL_LOOP) continue;
        char name[32];
        snprintf(name, sizeof name, "fp8c_g%d", f);
        out_raw(&o, "\n");
        render_body(k, name, &o);
    }
    IR_ASSERT(!o.text.failed);
    char *s = arena_strdup(a, strbuf_text(&o.text));
    strbuf_free(&o.text);
    return s;
}
