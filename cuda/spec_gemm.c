/* spec_gemm.c — a MATMUL as one cuBLASLt call, and the launches that prepare its operands.
 *
 * cuBLASLt reads bf16 and f32 operands, and e4m3/e5m2 ones with f32 scales per tensor, per
 * row, per 1x128 tile or per 128x128 block (operand_kind); anything else is first decoded to
 * f32 in the node's scratch (plan_decode). Hopper's FP8 GEMMs take both operands with the
 * contraction along their columns, so an FP8 operand the other way round is transposed into
 * scratch (plan_transpose) unless the layout pass already made the copy, and scale grids are
 * rearranged as the scale mode wants (plan_gemm_scales). The GEMM's epilogue (GemmEpilogue:
 * bias, C, GELU or its backward, an FP8 output with its amax) is chosen in spec_fuse.c;
 * plan_matmul plans whatever it is given, a plain matmul when it is given none. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec_internal.h"

/* ---------------------------------------------------------------- GEMM */

/* OPD_FP8: e4m3 or e5m2 with f32 scales, per tensor, row, 1x128 tile or 128x128 block */
OperandKind operand_kind(const Tensor *t) {
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
void plan_transpose(Spec *s, const Node *x, const Node *to, int64_t off) {
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
bool transpose_keeps_values(const Node *n) {
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

bool plan_matmul(Spec *s, const GemmEpilogue *ep) {
    const Node *n = s->n, *y = ep ? ep->d : n;
    if (!check_io(s, n, true) || !spec_check_tensor(s, &y->t, "the result")) return false;
    const Node *A = n->in[0], *B = n->in[1];
    bool ta = IR_IATTR(n, MATMUL, trans_a) != 0, tb = IR_IATTR(n, MATMUL, trans_b) != 0;
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
         * mode, gradients (long sums over tokens, small values) with f32 promotion; a forward
         * GEMM made again in the backward (save.attention_inputs=0) as the forward made it.
         * The choice cuda.grad_fast_accum=1 takes the gradients' per-tensor products into the
         * fast mode too (not tuned: it changes what the gradients sum, not only how fast) */
        bool grads_fast = s->g && ir_choice_int(s->g, "cuda.grad_fast_accum", 0) == 1;
        g.fast_accum = (n->phase == PHASE_FORWARD || ir_is_recomputed(n) || grads_fast) && !grouped;
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
