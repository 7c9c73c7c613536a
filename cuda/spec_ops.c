/* spec_ops.c — the plans of the ops that run kernels of the library (cuda/kernels/, .cuh).
 *
 * One function per op family, each a switch over its ops that picks the template, fills the
 * argument block (spec.c's conventions: t[0] the result, t[1..] the inputs) and says how many
 * blocks of how many threads run it: elementwise ops and quantizes (plan_elementwise), whole-
 * tensor reductions and the scales made from them (plan_reductions), row ops and column sums
 * (plan_rows) and the optimizer (plan_optimizer); attention's are in spec_attn.c. plan_node
 * (spec.c) dispatches to them. The fused variants a family's kernels offer (a producer that
 * stores its FP8 copy, a quantize that sums bias gradients or makes its group scales, the
 * loss's saved logsumexp) are chosen in spec_fuse.c and only read here, from the Spec. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec_internal.h"

/* The lanes a column of a column sum's last launch over P partials (reduce.cuh,
 * ck_colsum_total; blocks of 32 columns): 32 where there are at least 32 partials to add, 8
 * where there are 8, else one (lanes with no partials add nothing in parallel: GPT-2 d48's
 * sum over 8 rows of the position embedding's gradient, 1.6M columns of one partial each,
 * took four times as long in blocks of 32 lanes as in blocks of 8). */
static int colsum_lanes(int64_t P) { return P >= 32 ? 32 : P >= 8 ? 8 : 1; }

/* ck_quantize_t into the 1-byte per-tensor (or unscaled) q, a 64 x 64 tile a block, x read
 * through the loader ld (CkLd, CkLdUnary); t[0] = q, the caller adds the rest */
static CuLaunch *quantize_t_launch(Spec *s, const Node *q, const char *ld, int bgrad) {
    const Tensor *y = &q->t;
    if (fmt_elem_bytes(y->fmt.elem) != 1) {
        spec_fail(s, "a transposed copy of a wider element type");
        return NULL;
    }
    int64_t R = rows_of(y), C = cols_of(y);
    CuLaunch *l = spec_launch(s, "quantt", (unsigned)((C + 63) / 64), 256, "ck_quantize_t<%s, %s, %d>(a)",
                              fmt_arg(s, y), ld, bgrad);
    l->grid[1] = (unsigned)((R + 63) / 64);
    arg_node(l, 0, q);
    return l;
}

bool plan_elementwise(Spec *s) {
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
        l->args.f[0] = IR_FATTR(n, CONST, value);
        return true;
    case OP_ADD: case OP_SUB: case OP_MUL: {
        if (!check_io(s, n, true)) return false;
        int64_t na = ir_numel(&n->in[0]->t), nb = ir_numel(&n->in[1]->t);
        if (nb == 0 || na % nb || na != count) return spec_fail(s, "cannot broadcast");
        const char *in_fmt[2] = {fmt_arg(s, &n->in[0]->t), fmt_arg(s, &n->in[1]->t)};
        const Node *act = s->inline_of;
        if (act) {
            /* input inline_slot computed from the activation's input (fuse_inline_elementwise) */
            int k = s->inline_slot;
            if (k < 0 || k > 1 || n->in[k] != act || (act->op != OP_GELU && act->op != OP_SILU) ||
                act->n_in != 1 || ir_numel(&act->t) != count || ir_numel(&act->in[0]->t) != count ||
                act->t.fmt.scaling != SCALE_NONE)
                return spec_fail(s, "no activation to compute in place of input %d", k);
            if (!spec_check_tensor(s, &act->in[0]->t, "the activation's input")) return false;
            in_fmt[k] = arena_printf(s->arena, "CkAct<%s, %s, %s>", act->op == OP_GELU ? "OP_GELU" : "OP_SILU",
                                     fmt_arg(s, &act->t), fmt_arg(s, &act->in[0]->t));
        }
        const char *op = n->op == OP_ADD ? "OP_ADD" : n->op == OP_SUB ? "OP_SUB" : "OP_MUL";
        const Node *const *qs = s->product_copies;
        if (!qs[0] && !qs[1]) {
            l = spec_launch(s, "binary", grid_elem(count), ELEM_THREADS, "ck_binary<%s, %s, %s, %s>(a)", op, Y,
                            in_fmt[0], in_fmt[1]);
            args_result_inputs(l, n);
            if (act) arg_node(l, 1 + s->inline_slot, act->in[0]);
            arg_amax_parts(s, l, n);
            return true;
        }
        /* each input's copy into per-group scales too (fuse_product_group_copies), as qgroup's
         * launches (QUANTIZE with its QUANT_SCALE) would write them */
        const char *copy_fmt[2] = {"CkNoCopy", "CkNoCopy"};
        for (int k = 0; k < 2; k++) {
            const Node *q = qs[k], *stored = act && k == s->inline_slot ? act->in[0] : n->in[k];
            if (!q) continue;
            if (q->op != OP_QUANTIZE || q->n_in != 2 || q->in[0] != stored || ir_numel(&stored->t) != count ||
                (q->t.fmt.scaling != SCALE_PER_GROUP && q->t.fmt.scaling != SCALE_TILE_1x128) ||
                q->in[1]->op != OP_QUANT_SCALE || s->result != RESULT_STORED)
                return spec_fail(s, "no group copy of input %d to write", k);
            copy_fmt[k] = fmt_arg(s, &q->t);
        }
        l = spec_launch(s, "binary", grid_elem(count), ELEM_THREADS, "ck_binary_group<%s, %s, %s, %s, %s, %s>(a)", op, Y,
                        in_fmt[0], in_fmt[1], copy_fmt[0], copy_fmt[1]);
        args_result_inputs(l, n);
        if (act) arg_node(l, 1 + s->inline_slot, act->in[0]);
        for (int k = 0; k < 2; k++) {
            if (!qs[k]) continue;
            const Node *sc = qs[k]->in[1];
            arg_node(l, 3 + k, qs[k]);
            l->args.i[1 + 2 * k] = IR_IATTR(sc, QUANT_SCALE, margin);
            l->args.i[2 + 2 * k] = l->args.t[3 + k].group;
            l->args.f[k] = num_elem_max((ElemType)IR_IATTR(sc, QUANT_SCALE, elem));
        }
        arg_amax_parts(s, l, n);
        return true;
    }
    case OP_SCALE:
        if (!check_io(s, n, true)) return false;
        l = spec_launch(s, "scale", grid_elem(count), ELEM_THREADS, "ck_scale<%s, %s>(a)", Y,
                        fmt_arg(s, &n->in[0]->t));
        args_result_inputs(l, n);
        l->args.f[0] = IR_FATTR(n, SCALE, alpha);
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
            int64_t ax = IR_IATTR(n, CONCAT, axis);
            int axis = (int)(ax < 0 ? ax + y->rank : ax);
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
        int64_t ax = IR_IATTR(n, CONCAT, axis);
        int axis = (int)(ax < 0 ? ax + y->rank : ax);
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
        if (s->result == RESULT_THROUGH && s->transpose_to) {
            /* the FP8 copy in both layouts, each tile computed from the inputs */
            const char *ld = arena_printf(s->arena, "CkLdUnary<%s, %s, %s, %s>", op, fmt_arg(s, y),
                                          fmt_arg(s, &n->in[0]->t), n->n_in > 1 ? fmt_arg(s, &n->in[1]->t) : F32_ARG);
            if (!(l = quantize_t_launch(s, s->through, ld, 0))) return false;
            for (int i = 0; i < n->n_in; i++) arg_node(l, 1 + i, n->in[i]);
            l->args.n_in = n->n_in;
            arg_node(l, 1 + n->n_in, s->transpose_to);
            l->args.i[1] = 1 + n->n_in;
            return true;
        }
        if (s->inline_of) {
            /* dy computed from the product's inputs (fuse_inline_elementwise) */
            const Node *d = s->inline_of;
            bool two = n->op == OP_GELU_BWD || n->op == OP_SILU_BWD;
            if (!two || n->in[0] != d || (d->op != OP_ADD && d->op != OP_SUB && d->op != OP_MUL) ||
                d->t.fmt.scaling != SCALE_NONE || ir_numel(&d->t) != count || ir_numel(&d->in[0]->t) != count ||
                ir_numel(&d->in[1]->t) != count || s->result != RESULT_STORED)
                return spec_fail(s, "no product to compute in place of dy");
            if (!check_io(s, d, false)) return false;
            l = spec_launch(s, "unary", grid_elem(count), ELEM_THREADS, "ck_unary_bin<%s, %s, %s, %s, %s, %s, %s>(a)",
                            op, d->op == OP_ADD ? "OP_ADD" : d->op == OP_SUB ? "OP_SUB" : "OP_MUL", Y,
                            fmt_arg(s, &d->t), fmt_arg(s, &d->in[0]->t), fmt_arg(s, &d->in[1]->t),
                            fmt_arg(s, &n->in[1]->t));
            arg_node(l, 0, n);
            arg_node(l, 1, d->in[0]);
            arg_node(l, 2, d->in[1]);
            arg_node(l, 3, n->in[1]);
            l->args.n_in = 3;
            arg_amax_parts(s, l, n);
            return true;
        }
        if (s->input_copy) {
            /* x's copy into per-group scales too (fuse_input_group_copies), as qgroup's launch
             * (plan_elementwise's QUANTIZE) would write it */
            const Node *q = s->input_copy, *sc = q->in[1];
            if (n->n_in != 1 || q->in[0] != n->in[0] || s->result == RESULT_THROUGH)
                return spec_fail(s, "an input copy needs a one-input activation's own pass");
            l = spec_launch(s, "unary", grid_elem(count), ELEM_THREADS, "ck_unary_group<%s, %s, %s, %s>(a)",
                            op, producer_fmt(s), fmt_arg(s, &n->in[0]->t), fmt_arg(s, &q->t));
            args_result_inputs(l, n);
            producer_result(s, l);
            arg_node(l, 3, q);
            l->args.i[1] = IR_IATTR(sc, QUANT_SCALE, margin);
            l->args.i[2] = l->args.t[3].group;
            l->args.f[0] = num_elem_max((ElemType)IR_IATTR(sc, QUANT_SCALE, elem));
            return true;
        }
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
        if (s->transpose_to && !ir_transposed_offset(n) && !s->bias_grad) {
            /* the copy and the TRANSPOSE's result, as below (fuse_cast_transposes) */
            if (!(l = quantize_t_launch(s, n, arena_printf(s->arena, "CkLd<%s>", fmt_arg(s, &n->in[0]->t)), 0)))
                return false;
            arg_node(l, 1, n->in[0]);
            l->args.n_in = 1;
            arg_node(l, 2, s->transpose_to);
            l->args.i[1] = 2;
            return true;
        }
        if (ir_transposed_offset(n)) {
            /* both layouts at once (ops.def transposed=1): 64 x 64 tiles */
            if (!(l = quantize_t_launch(s, n, arena_printf(s->arena, "CkLd<%s>", fmt_arg(s, &n->in[0]->t)),
                                        s->bias_grad != NULL)))
                return false;
            int64_t R = rows_of(y), C = cols_of(y), P = (R + 63) / 64;
            arg_node(l, 1, n->in[0]);
            l->args.n_in = 1;
            l->args.i[0] = ir_transposed_offset(n);
            if (s->bias_grad) {   /* the tiles' column sums, then their sum over the P row tiles */
                const Node *b = s->bias_grad, *acc = s->bias_acc;
                l->scratch = 0;
                need_scratch(s, P * C * 8);
                if (acc) {
                    l = spec_launch(s, "colacc", (unsigned)((C + 31) / 32), 32 * colsum_lanes(P),
                                    "ck_colsum_final_acc<%d, %s, %s>(a)", colsum_lanes(P), fmt_arg(s, &acc->in[0]->t),
                                    fmt_arg(s, &b->t));
                    arg_node(l, 0, acc->in[0]);
                    arg_node(l, 1, b);
                    l->args.n_in = 1;
                } else {
                    l = spec_launch(s, "colfinal", (unsigned)((C + 31) / 32), 32 * colsum_lanes(P),
                                    "ck_colsum_final<0, %d, %s>(a)", colsum_lanes(P), fmt_arg(s, &b->t));
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
            l->args.i[1] = IR_IATTR(sc, QUANT_SCALE, margin);
            l->args.i[2] = l->args.t[0].group;
            l->args.f[0] = num_elem_max((ElemType)IR_IATTR(sc, QUANT_SCALE, elem));
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
        int64_t ax = IR_IATTR(n, SLICE, axis);
        int axis = (int)(ax < 0 ? ax + y->rank : ax);
        if (axis < 0 || axis >= y->rank || x->rank != y->rank) return spec_fail(s, "bad axis");
        int64_t outer = 1, inner = 1;
        for (int i = 0; i < axis; i++) outer *= y->dims[i];
        for (int i = axis + 1; i < y->rank; i++) inner *= y->dims[i];
        l = spec_launch(s, "slice", grid_elem(count), ELEM_THREADS, "ck_slice<%d, %d, %s, %s>(a)",
                        n->op == OP_PAD, ir_keeps_amax(n), Y, fmt_arg(s, x));
        args_result_inputs(l, n);
        l->args.i[0] = outer;
        l->args.i[1] = y->dims[axis];
        l->args.i[2] = x->dims[axis];
        l->args.i[3] = inner;
        l->args.i[4] = IR_IATTR(n, SLICE, start);
        arg_amax_parts(s, l, n);
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
        if (y->rank < 2 || IR_IATTR(n, ROPE, head_dim) <= 0 || IR_IATTR(n, ROPE, head_dim) % 2 ||
            cols_of(y) % IR_IATTR(n, ROPE, head_dim))
            return spec_fail(s, "head_dim does not split the columns into even heads");
        /* the rotation, reading the (T, head_dim / 2) table of cos and sin that the executor
         * makes once for every RoPE of these sizes (rope_table: Llama 1.1B made it again in
         * each of its 88 RoPEs a step, one launch each) */
        l = spec_launch(s, "rope", grid_elem(count / 2), ELEM_THREADS, "ck_rope<%d, %s, %s>(a)", ir_keeps_amax(n),
                        Y, fmt_arg(s, &n->in[0]->t));
        args_result_inputs(l, n);
        l->rope_table = true;
        l->args.i[0] = IR_IATTR(n, ROPE, head_dim);
        l->args.i[1] = IR_IATTR(n, ROPE, inverse);
        l->args.i[2] = cols_of(y);
        l->args.i[3] = y->dims[y->rank - 2];
        l->args.f[0] = IR_FATTR(n, ROPE, theta);
        arg_amax_parts(s, l, n);
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

bool plan_reductions(Spec *s) {
    const Node *n = s->n;
    CuLaunch *l;
    switch (n->op) {
    case OP_SQNORM: {
        if (!check_io(s, n, true)) return false;
        int64_t parts;
        if (n->in[0]->op != OP_ALL_REDUCE) {
            /* one GPU's build: partial sums over the grid's blocks, then their sum */
            l = plan_partials(s, true, 1, n->in[0]);
            args_result_inputs(l, n);
            parts = l->grid[0];
        } else {
            /* a data-parallel build (the gradient is its all_reduce's): chunks of
             * IR_SQNORM_CHUNK, a warp each, then their sums in order (ir.h), so that a sharded
             * step (exec_shard.c) and an unsharded one compute the same bits on any number of
             * GPUs */
            parts = (ir_numel(&n->in[0]->t) + IR_SQNORM_CHUNK - 1) / IR_SQNORM_CHUNK;
            if (parts < 1) parts = 1;
            int64_t warps = ROW_THREADS / 32, blocks = (parts + warps - 1) / warps;
            l = spec_launch(s, "sqchunks", (unsigned)(blocks < PARTIAL_BLOCKS ? blocks : PARTIAL_BLOCKS), ROW_THREADS,
                            "ck_sqnorm_chunks<%s>(a)", fmt_arg(s, &n->in[0]->t));
            args_result_inputs(l, n);
            l->scratch = 0;
            l->batch = true;
            l->args.i[0] = IR_SQNORM_CHUNK;
            need_scratch(s, parts * 8);
        }
        l = spec_launch(s, "sqfinal", 1, ROW_THREADS, "ck_sqnorm_final<%s>(a)", fmt_arg(s, &n->t));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->batch = true;
        l->check_flag = true;   /* the gradient's finite check, from the f64 sum */
        l->args.i[0] = parts;
        return true;
    }
    case OP_QUANT_SCALE: {
        if (!check_io(s, n, true)) return false;
        ElemType e = (ElemType)IR_IATTR(n, QUANT_SCALE, elem);
        Scaling kind = (Scaling)IR_IATTR(n, QUANT_SCALE, scaling);
        if (e <= FMT_VOID || e >= FMT_COUNT || kind <= SCALE_NONE || kind >= SCALE_COUNT)
            return spec_fail(s, "bad element type or scaling");
        const Tensor *x = &n->in[0]->t;
        int64_t R = rows_of(x), C = cols_of(x);
        const char *Y = fmt_arg(s, &n->t), *X = fmt_arg(s, x);
        int64_t group = kind == SCALE_PER_GROUP ? IR_IATTR(n, QUANT_SCALE, group) : 128;
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
        l->args.i[1] = IR_IATTR(n, QUANT_SCALE, margin);
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
        l->batch = true;   /* the update's run of them, one a weight copy, is one launch */
        l->args.i[0] = IR_IATTR(n, DELAYED_SCALE, use_max);
        l->args.i[1] = IR_IATTR(n, DELAYED_SCALE, margin);
        l->args.f[0] = num_elem_max((ElemType)IR_IATTR(n, DELAYED_SCALE, elem));
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
    l = spec_launch(s, "colfinal", (unsigned)((C + 31) / 32), 32 * colsum_lanes(P), "ck_colsum_final<%d, %d, %s>(a)",
                    mode, colsum_lanes(P), fmt_arg(s, &n->t));
    args_result_inputs(l, n);
    l->scratch = 0;
    l->args.i[0] = C, l->args.i[1] = R, l->args.i[2] = P;
}

/* the vectors of CK_VEC elements a lane of a norm's warp holds of a row of C (norm.cuh's NV;
 * 0: the row does not fit in registers and goes element by element) */
static int row_vectors(int64_t C) {
    enum { ROW_VECS_MAX = 8 };   /* norm.cuh's CK_ROW_VECS */
    if (C % 8 || C > ROW_VECS_MAX * 32 * 8) return 0;
    return (int)((C + 32 * 8 - 1) / (32 * 8));
}

/* The blocks of `threads` an SM that a norm kernel's launch bounds ask for, for rows of nv
 * vectors a lane: where the row is short (nv <= 3: a width of up to 768), 32 warps an SM, which
 * caps a thread at 64 registers. Unbounded, normt took 76 and the fused backward 80, three and
 * six blocks an SM (24 warps), and with a warp's rows one after another too few rows were in
 * flight to keep the memory busy. H200, GPT-2 d12 at batch 32, -O1, a step's 24 or 25 launches
 * (docs/results.md): normt 1.767 -> 1.595 ms, the fused backward 3.290 -> 2.517 ms (at -O3,
 * where x is a scaled FP8 copy, 3.976 -> 3.043), though both now spill a few words (24 to 52
 * bytes a thread). Longer rows hold more of themselves in registers and are left unbounded:
 * capping them would spill the row. */
static unsigned norm_min_blocks(unsigned threads, int nv) { return nv > 0 && nv <= 3 ? 32 / (threads / 32) : 0; }

/* A norm's rows staged through shared memory (norm.cuh, CkStage): each warp copies the row it
 * takes next by cp.async while it works on the one in hand, so that a row is always in flight
 * (the choice norm.stage, per node, on unless 0). The kernels' ST: the bytes of a slot, a row of
 * nv vectors of the widest of the `n` staged tensors ts, or 0 where the rows are not staged:
 * no vector path, or a block's shared memory (`fixed` bytes of its own, and the rings,
 * NORM_STAGE_SLOTS slots a warp and tensor) would leave room for fewer than two blocks an SM.
 * A staged forward launch gives each warp NORM_STAGE_ROWS rows or more (a grid of fewer
 * blocks), so that there is a next row to fetch; the fused backward keeps its grid, whose
 * rows of a warp decide the order of its column sums. */
enum { NORM_STAGE_SLOTS = 2, NORM_STAGE_ROWS = 4, SM_SHARED_MAX = 227 * 1024 };
static int norm_stage(const Spec *s, const Node *site, int nv, unsigned threads, const Tensor *const *ts, int n,
                      unsigned fixed) {
    if (!nv || (s->g && !ir_choice_on(s->g, "norm.stage", site))) return 0;
    int widest = 0;
    for (int i = 0; i < n; i++) {
        int b = fmt_elem_bytes(ts[i]->fmt.elem);
        if (b != 1 && b != 2 && b != 4) return 0;
        if (b > widest) widest = b;
    }
    int slot = nv * 32 * 8 * widest;
    return 2 * (fixed + 1024 + (int64_t)(threads / 32) * n * NORM_STAGE_SLOTS * slot) <= SM_SHARED_MAX ? slot : 0;
}
static unsigned norm_stage_bytes(unsigned threads, int tensors, int slot) {
    return threads / 32 * (unsigned)tensors * NORM_STAGE_SLOTS * (unsigned)slot;
}
/* norm_min_blocks, no more blocks than the shared memory of one (static and dynamic) lets an
 * SM hold: bounds that ask for more would cap the registers for nothing */
static unsigned norm_min_blocks_smem(unsigned threads, int nv, unsigned smem) {
    unsigned b = norm_min_blocks(threads, nv), fit = smem ? SM_SHARED_MAX / (smem + 1024) : b;
    return b < fit ? b : fit;
}

/* The fused norm backward of long rows, a block a row (norm.cuh, ck_norm_bwd_block; the choice
 * norm.bwd_block, per node, on unless 0): rows of more than NORM_BLOCK_COLS columns, whole
 * vectors, at most NORM_BLOCK_VPT vectors a thread in blocks of up to 256 threads. Its vectors
 * a thread, 0 where the row does not take it. Rows of 768 (GPT-2 d12) take it too since a
 * row costs one block sum: measured against a warp a row in docs/results.md "(p)". */
enum { NORM_BLOCK_COLS = 512, NORM_BLOCK_VPT = 4, NORM_BLOCK_SMS = 128 };
static int norm_block_vpt(const Spec *s, const Node *site, int64_t C) {
    if (C <= NORM_BLOCK_COLS || C % 8 || (s->g && !ir_choice_on(s->g, "norm.bwd_block", site))) return 0;
    int64_t vpt = (C / 8 + 255) / 256;
    return vpt <= NORM_BLOCK_VPT ? (int)vpt : 0;
}

/* The launch of a fused norm backward's rows, a block a row (vpt vectors a thread) */
static CuLaunch *norm_grads_block(Spec *s, const NormGrads *ng, int vpt, const char *fmts) {
    const Node *x = ng->bx->in[1];
    int64_t R = rows_of(&x->t), C = cols_of(&x->t);
    unsigned threads = (unsigned)(((C / 8 + vpt - 1) / vpt + 31) / 32 * 32);
    /* A vector a thread: launch bounds of 32 warps an SM, 64 registers a thread; 28 for the
     * short rows' blocks of three warps (rows of 768), which spilled 72 bytes a thread at 64.
     * The grid: as many blocks as 128 SMs hold at once, each taking every gridDim.x-th row,
     * and no more than a result's block maxima have slots, so that the norms with them and
     * those without run the same grid (d12's rows: 1024 blocks of the 1152). */
    unsigned blocks = vpt == 1 ? (threads >= 128 ? 1024 : 896) / threads : 0;
    int64_t grid = NORM_BLOCK_SMS * (blocks ? blocks : 4);
    if (grid > CK_AMAX_PARTS) grid = CK_AMAX_PARTS;
    CuLaunch *l = spec_launch(s, "normbwd", (unsigned)(R < grid ? R : grid), threads,
                              "ck_norm_bwd_block<%d, %d, %d, %s>(a)", ng->bx->op == OP_LAYERNORM_BWD_X,
                              ng->sum != NULL, vpt, fmts);
    l->min_blocks = blocks;
    return l;
}

/* The same, a warp a row (ck_norm_bwd_fused): x, dy and the other term staged; without the
 * other term where all three would not leave room for two blocks an SM (Llama's rows of 2048) */
static CuLaunch *norm_grads_warps(Spec *s, const NormGrads *ng, int nv, const Node *other, const char *fmts) {
    const Node *bx = ng->bx, *dy = bx->in[0], *x = bx->in[1];
    int64_t R = rows_of(&x->t);
    const Tensor *staged[3] = {&x->t, &dy->t, other ? &other->t : NULL};
    unsigned sums = (unsigned)(NORM_GRAD_THREADS / 32 * (ng->sum ? 2 : 1) * nv * 32 * 8 * 4);   /* each warp's */
    int tensors = other ? 3 : 2, st = norm_stage(s, bx, nv, NORM_GRAD_THREADS, staged, tensors, sums);
    if (!st && other) st = norm_stage(s, bx, nv, NORM_GRAD_THREADS, staged, tensors = 2, sums);
    /* a warp a row, the grid capped (a warp then steps over the rows by the grid's warps):
     * staged or not, the same rows of each warp, so the same order of the column sums and the
     * same bits */
    int64_t grid = (R + NORM_GRAD_THREADS / 32 - 1) / (NORM_GRAD_THREADS / 32);
    if (grid > NORM_GRAD_BLOCKS) grid = NORM_GRAD_BLOCKS;
    CuLaunch *l = spec_launch(s, "normbwd", (unsigned)grid, NORM_GRAD_THREADS,
                              "ck_norm_bwd_fused<%d, %d, %d, %d, %s>(a)", bx->op == OP_LAYERNORM_BWD_X,
                              ng->sum != NULL, nv, st, fmts);
    /* each warp's column sums, then the rings of the staged rows */
    l->smem = sums + (st ? norm_stage_bytes(NORM_GRAD_THREADS, tensors, st) : 0);
    l->args.i[3] = st ? tensors : 0;
    /* the bounds from what the body's arguments fix, the most shared memory a launch of it may
     * take (three rings): launches of one body, with the other term and without, must ask
     * the same (CuLaunch.min_blocks) */
    unsigned most = sums + (st ? norm_stage_bytes(NORM_GRAD_THREADS, 3, st) : 0);
    l->min_blocks = norm_min_blocks_smem(NORM_GRAD_THREADS, nv, most);
    return l;
}

bool plan_norm_grads(Spec *s, const NormGrads *ng) {
    const Node *bx = ng->bx, *y = ng->add ? ng->add : bx, *dy = bx->in[0], *x = bx->in[1];
    int64_t R = rows_of(&x->t), C = cols_of(&x->t);
    int nv = row_vectors(C), vpt = norm_block_vpt(s, bx, C);
    if (!nv && !vpt) return spec_fail(s, "a norm row of %lld fits neither kernel of a norm's backward", (long long)C);
    bool ln = bx->op == OP_LAYERNORM_BWD_X;
    int res = !ng->add ? 0 : ng->add->in[0] == bx ? 2 : 1;
    const Node *other = res ? ng->add->in[res == 1 ? 0 : 1] : NULL;
    char fmts[256];
    snprintf(fmts, sizeof fmts, "%s, %s, %s, %s, %s, %s", fmt_arg(s, &y->t), fmt_arg(s, &dy->t), fmt_arg(s, &x->t),
             fmt_arg(s, &bx->in[2]->t), other ? fmt_arg(s, &other->t) : F32_ARG, fmt_arg(s, &bx->t));
    CuLaunch *l = vpt ? norm_grads_block(s, ng, vpt, fmts) : norm_grads_warps(s, ng, nv, other, fmts);
    arg_node(l, 0, y);
    for (int k = 0; k < 3; k++) arg_node(l, 1 + k, bx->in[k]);
    if (other) arg_node(l, 4, other);
    arg_node(l, 5, bx);
    l->args.n_in = 5;
    l->scratch = 0;
    l->args.i[0] = C, l->args.i[1] = R, l->args.i[2] = res;
    l->args.f[0] = ln ? IR_FATTR(bx, LAYERNORM_BWD_X, eps) : IR_FATTR(bx, RMSNORM_BWD_X, eps);
    arg_amax_parts(s, l, y);
    /* each block leaves a row of partials: P, the grid as launched (arg_amax_parts may have
     * capped it at the block maxima's slots; the blocks stride over the rows either way) */
    int64_t P = l->grid[0];
    need_scratch(s, P * C * 4 * (ng->sum ? 2 : 1));
    /* the columns: the weight's gradient (or its accumulator), then the bias's */
    const Node *tw = ng->acc_w ? ng->acc_w->in[0] : ng->bw, *tb = ng->acc_b ? ng->acc_b->in[0] : ng->sum;
    l = spec_launch(s, "normgrads", (unsigned)((C + 31) / 32), 1024, "ck_norm_grads_final<%d, %s, %s, %d, %s, %s>(a)",
                    ng->acc_w != NULL, fmt_arg(s, &tw->t), fmt_arg(s, &ng->bw->t), ng->acc_b != NULL,
                    tb ? fmt_arg(s, &tb->t) : F32_ARG, ng->sum ? fmt_arg(s, &ng->sum->t) : F32_ARG);
    l->grid[1] = ng->sum ? 2 : 1;
    arg_node(l, 0, tw);
    arg_node(l, 1, ng->bw);
    if (ng->sum) {
        arg_node(l, 2, tb);
        arg_node(l, 3, ng->sum);
    }
    l->args.n_in = 3;
    l->scratch = 0;
    l->args.i[0] = C, l->args.i[1] = P;
    return true;
}

bool plan_rows(Spec *s) {
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
        if (s->result == RESULT_THROUGH && s->transpose_to && s->stats_of) {
            /* the FP8 copy in both layouts by 64 x 64 tiles from the rows' kept statistics
             * (fuse_cast_transposes, fuse.norm_stats) */
            int64_t R = rows_of(x), C = cols_of(x);
            if (C % 16 || R % 16 || s->through->t.offset % 16 || s->transpose_to->t.offset % 16)
                return spec_fail(s, "a norm's rows that its tiles do not take");
            const char *ld = arena_printf(s->arena, "CkLdNorm<%d, %s, %s, %s, %s>", ln, fmt_arg(s, &n->t), fmt_arg(s, x),
                                          fmt_arg(s, &n->in[1]->t), ln ? fmt_arg(s, &n->in[2]->t) : F32_ARG);
            if (!(l = quantize_t_launch(s, s->through, ld, 0))) return false;
            for (int i = 0; i < n->n_in; i++) arg_node(l, 1 + i, n->in[i]);
            l->args.n_in = n->n_in;
            arg_node(l, 1 + n->n_in, s->transpose_to);
            arg_node(l, 2 + n->n_in, s->stats_of);
            l->args.i[1] = 1 + n->n_in, l->args.i[2] = 2 + n->n_in;
            return true;
        }
        if (s->result == RESULT_THROUGH && s->transpose_to) {
            /* the FP8 copy in both layouts, a band of rows a block (fuse_cast_transposes): 32
             * rows up to 1280 columns, 16 up to 2048 (ck_norm_t's shared memory) */
            int64_t R = rows_of(x), C = cols_of(x);
            int nv = row_vectors(C), band = nv <= 5 ? 32 : 16;
            if (!nv || R % band || C % 16 || s->through->t.offset % 16 || s->transpose_to->t.offset % 16 ||
                fmt_elem_bytes(s->through->t.fmt.elem) != 1)
                return spec_fail(s, "a norm's rows that its transposing kernel does not take");
            const Tensor *staged[1] = {x};
            int st = norm_stage(s, n, nv, ROW_THREADS, staged, 1, (unsigned)(band * (nv * 256 + 16)));
            l = spec_launch(s, "normt", (unsigned)(R / band), ROW_THREADS,
                            "ck_norm_t<%d, %d, %d, %d, %s, %s, %s, %s, %s>(a)", ln, nv, band, st, fmt_arg(s, &n->t),
                            fmt_arg(s, &s->through->t), fmt_arg(s, x), fmt_arg(s, &n->in[1]->t),
                            ln ? fmt_arg(s, &n->in[2]->t) : F32_ARG);
            args_result_inputs(l, n);
            arg_node(l, 0, s->through);
            arg_node(l, 1 + n->n_in, s->transpose_to);
            l->args.i[0] = C, l->args.i[1] = R, l->args.i[2] = 1 + n->n_in;
            l->args.f[0] = IR_FATTR(n, LAYERNORM, eps);
            l->smem = st ? norm_stage_bytes(ROW_THREADS, 1, st) : 0;
            l->min_blocks = norm_min_blocks_smem(ROW_THREADS, nv, l->smem + (unsigned)(band * (nv * 256 + 16)));
            return true;
        }
        const Node *q = s->input_copy;   /* x's group copy too (fuse_input_group_copies) */
        if (q && (q->in[0] != n->in[0] || s->result == RESULT_THROUGH))
            return spec_fail(s, "an input copy needs the norm's own pass");
        if (s->row_stats && (s->result != RESULT_AMAX_ONLY || ir_numel(&n->t) * fmt_elem_bytes(n->t.fmt.elem) <
                                                                  rows_of(x) * 8))
            return spec_fail(s, "row statistics are kept by a norm's pass that stores only its maxima");
        const Tensor *staged[1] = {x};
        int64_t rows = rows_of(x), per = ROW_THREADS / 32 * NORM_STAGE_ROWS;
        /* with the copy, staged only where the copy's groups are whole vectors of a row
         * (reduce.cuh, ck_norm_group_vec_ok): the kernel's other path reads x itself */
        int64_t G = q ? (q->t.fmt.scaling == SCALE_PER_GROUP ? q->t.fmt.group : 128) : 0;
        bool group_vectors = !q || (G % 8 == 0 && G / 8 <= 32 && !((G / 8) & (G / 8 - 1)) && cols_of(x) % G == 0);
        int nv = row_vectors(cols_of(x)), st = group_vectors ? norm_stage(s, n, nv, ROW_THREADS, staged, 1, 0) : 0;
        unsigned grid = st ? (unsigned)((rows + per - 1) / per) : grid_warp_rows(rows);
        if (q)
            l = spec_launch(s, "norm", grid, ROW_THREADS, "ck_norm_group<%d, %d, %d, %s, %s, %s, %s, %s%s>(a)", ln, nv,
                            st, producer_fmt(s), fmt_arg(s, x), fmt_arg(s, &n->in[1]->t),
                            ln ? fmt_arg(s, &n->in[2]->t) : F32_ARG, fmt_arg(s, &q->t), s->row_stats ? ", CkRowStats" : "");
        else
            l = spec_launch(s, "norm", grid, ROW_THREADS, "ck_norm<%d, %d, %d, %s, %s, %s, %s%s>(a)", ln, nv, st,
                            producer_fmt(s), fmt_arg(s, x), fmt_arg(s, &n->in[1]->t),
                            ln ? fmt_arg(s, &n->in[2]->t) : F32_ARG, s->row_stats ? ", CkRowStats" : "");
        l->smem = st ? norm_stage_bytes(ROW_THREADS, 1, st) : 0;
        args_result_inputs(l, n);
        if (q) {
            arg_node(l, 4, q);
            l->args.i[2] = IR_IATTR(q->in[1], QUANT_SCALE, margin);
            l->args.i[3] = l->args.t[4].group;
            l->args.f[1] = num_elem_max((ElemType)IR_IATTR(q->in[1], QUANT_SCALE, elem));
        }
        l->args.i[0] = cols_of(x), l->args.i[1] = rows_of(x);
        l->args.f[0] = IR_FATTR(n, LAYERNORM, eps);
        /* with the input copy the row's codes and scales take more registers than the
         * bounds leave (64 spilled 128 bytes a thread): no bounds there */
        l->min_blocks = q ? 0 : norm_min_blocks_smem(ROW_THREADS, nv, l->smem);
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
        l->args.f[0] = IR_FATTR(n, LAYERNORM_BWD_X, eps);
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
        l->args.f[0] = IR_FATTR(n, LAYERNORM_BWD_W, eps);
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
        unsigned threads = ce_row_threads(s->ce, V);
        need_scratch(s, s->ce_lse_at ? s->ce_lse_at + R * 8 : R * 8);
        l = spec_launch(s, "cerows", (unsigned)R, threads, "ck_ce_rows<%d, %s, %s>(a)", s->ce.exp2,
                        fmt_arg(s, lg), fmt_arg(s, &n->in[1]->t));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = V, l->args.i[1] = R, l->args.i[2] = s->ce_lse_at;
        /* as many threads as the rows' blocks: the mean of the one pass (ck_ce_fused) has its bits */
        l = spec_launch(s, "cefinal", 1, threads, "ck_ce_final<%s, %s>(a)", Y, fmt_arg(s, &n->in[1]->t));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = V, l->args.i[1] = R;
        return true;
    }
    case OP_CROSS_ENTROPY_BWD: {
        const Tensor *lg = &n->in[1]->t;
        int64_t R = rows_of(lg), V = cols_of(lg);
        unsigned threads = ce_row_threads(s->ce, V);
        if (s->ce_forward) {   /* the forward too, in one pass (ck_ce_fused) */
            const Node *f = s->ce_forward;
            if (!spec_check_tensor(s, &f->t, "the loss")) return false;
            need_scratch(s, R * 8);
            int held = ce_row_held(&lg->fmt, V, s->ce);
            l = spec_launch(s, "cefused", (unsigned)R, threads, "ck_ce_fused<%d, %d, %s, %s, %s, %s, %s>(a)", held,
                            s->ce.exp2, Y, fmt_arg(s, lg), fmt_arg(s, &n->in[2]->t), fmt_arg(s, &n->in[0]->t),
                            fmt_arg(s, &f->t));
            args_result_inputs(l, n);
            arg_node(l, 4, f);
            l->scratch = 0;
            l->args.i[0] = V, l->args.i[1] = R;
            if (held == CE_ROW_SHARED) {   /* the row, and two blocks an SM in the registers */
                l->smem = (unsigned)(V * ce_row_bytes(&lg->fmt));
                l->min_blocks = threads <= 512 ? 2 : 0;
            } else if (held == CE_ROW_RING) {   /* two rows, a block an SM */
                l->smem = (unsigned)(2 * V * ce_row_bytes(&lg->fmt));
                l->per_sm = 1;
            }
            return true;
        }
        need_scratch(s, s->ce_lse_at ? s->ce_lse_at + R * 8 : 8);
        l = spec_launch(s, "cecoef", 1, 1024, "ck_ce_bwd_coef<%s, %s>(a)", fmt_arg(s, &n->in[0]->t),
                        fmt_arg(s, &n->in[2]->t));
        args_result_inputs(l, n);
        l->scratch = 0;
        l->args.i[0] = V, l->args.i[1] = R;
        l = spec_launch(s, "cebwd", (unsigned)R, threads, "ck_ce_bwd<%d, %s, %s, %s>(a)", s->ce.exp2, Y,
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
        /* blocks striding over the (row, 256 columns) items (ck_eb_sum) */
        int64_t items = V * ((C + 255) / 256);
        l = spec_launch(s, "ebsum", (unsigned)(items < ELEM_MAX_BLOCKS ? items : ELEM_MAX_BLOCKS), 256,
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

/* The loss's row blocks, as the choices say (docs/tuning.md); "NAME@ID" for node ID, else
 * "NAME" for every cross entropy (a forward and its backward set alike have the same bits):
 *  - ce.threads: a row block's threads for rows of 16384 logits or more, 1024, 512 (the
 *    default) or 256 (any multiple of 32 from 64 to 1024; other values keep the default).
 *    Below 1024 the one pass holds a GPT-2 row in shared memory, two blocks an SM (ce_row_held).
 *  - ce.exp2: 1 (the default) takes the exponentials as ex2.approx (CkExpFrom<1>), 0 expf.
 *  - ce.shared: 0 keeps rows out of shared memory (read twice, the second time from L2 mostly),
 *    to be measured against it; 1 (the default) lets ce_row_held put them there.
 *  - ce.ring: 1 (the default) has the one pass hold two rows a block in shared memory, one
 *    block an SM walking its rows (ck_ce_ring); 0 a row a block, two blocks an SM. */
CeRows ce_rows_chosen(const Graph *g, const Node *n) {
    CeRows ce = CE_ROWS_DEFAULT;
    int64_t threads = ir_choice_int_at(g, "ce.threads", n, ce.threads);
    if (threads >= 64 && threads <= 1024 && threads % 32 == 0) ce.threads = (unsigned)threads;
    ce.exp2 = ir_choice_int_at(g, "ce.exp2", n, ce.exp2) != 0;
    ce.shared = ir_choice_int_at(g, "ce.shared", n, ce.shared) != 0;
    ce.ring = ir_choice_int_at(g, "ce.ring", n, ce.ring) != 0;
    return ce;
}

/* each cross entropy's plan again where its choices differ from CE_ROWS_DEFAULT (the fusions
 * of the loss, fuse_ce_one_pass and fuse_ce_lse, plan with ce_rows_chosen too) */
void plan_ce_choices(const Graph *g, CuNodePlan *plans, Arena *a) {
    CeRows dflt = CE_ROWS_DEFAULT;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->op != OP_CROSS_ENTROPY && n->op != OP_CROSS_ENTROPY_BWD) continue;
        CeRows ce = ce_rows_chosen(g, n);
        if (ce.threads == dflt.threads && ce.exp2 == dflt.exp2 && ce.shared == dflt.shared && ce.ring == dflt.ring)
            continue;
        char why[256];
        CuNodePlan chosen;
        Spec s = spec_for(g, n, a, &chosen, why, sizeof why);
        s.ce = ce;
        if (!plan_node(&s)) continue;
        if (ir_amax_parts_offset(n) && !s.amax_written) plan_amax_pass(&s, n);   /* as cuda_plan_node */
        plans[i] = chosen;
    }
}

/* An update that writes the weights' FP8 copy (or at O3 finds their amax alone) leaves each
 * block's largest |new weight| in its scratch (the update launch `l`); one block then stores
 * their maximum as the amax (ck_amax_record_final over a history of one). */
static void plan_copy_amax(Spec *s, const Node *n, CuLaunch *l) {
    const Node *amax = n->in[ir_update_amax_index(n)];
    unsigned parts = l->grid[0];
    l->scratch = 0;
    need_scratch(s, (int64_t)parts * 4);
    l = spec_launch(s, "copyamax", 1, ROW_THREADS, "ck_amax_record_final<%s>(a)", fmt_arg(s, &amax->t));
    arg_node(l, 0, amax);
    l->scratch = 0;
    l->batch = true;
    l->args.i[0] = parts;
}
/* AdamW's launch arguments: f = {beta1, beta2, eps, weight decay} */
static void adamw_args(CuLaunch *l, const Node *n) {
    UpdateHparams hp = ir_update_hparams(n);
    l->args.f[0] = hp.b1, l->args.f[1] = hp.b2, l->args.f[2] = hp.eps, l->args.f[3] = hp.wd;
}

/* The codecs' enum names, as the coded optimizer kernels take them for template arguments */
static const char *const CODEC_NAMES[CODEC_COUNT] = {"CODEC_PLAIN", "CODEC_EXPAND", "CODEC_COMPAND", "CODEC_SQRT",
                                                    "CODEC_SPLIT"};

/* How an optimizer update keeps its f32 master (the kernels' MK): 0 none, 1 a master of its
 * own (wn), 2 split (the bf16 parameter is the high half, wn an i8 correction); -1 after a
 * spec_fail for a master the kernels cannot read. */
static int master_kind(Spec *s, const Node *n, const Node *wn) {
    int mk = !wn ? 0 : wn->t.fmt.codec == CODEC_SPLIT ? 2 : 1;
    if (mk == 2 && (n->in[0]->t.fmt.elem != FMT_BF16 || n->in[0]->t.fmt.scaling != SCALE_NONE ||
                    wn->t.fmt.elem != FMT_I8))
        return spec_fail(s, "a split master needs a bf16 parameter and an i8 correction"), -1;
    if (mk == 1 && !spec_check_tensor(s, &wn->t, "the master")) return -1;
    return mk;
}

bool plan_optimizer(Spec *s) {
    const Node *n = s->n;
    CuLaunch *l;
    switch (n->op) {
    case OP_ACCUMULATE: case OP_ASSIGN: {   /* in place: acc += g, or dst = src */
        if (!check_io(s, n, false)) return false;
        if (ir_numel(&n->in[0]->t) != ir_numel(&n->in[1]->t)) return spec_fail(s, "sizes differ");
        bool acc = n->op == OP_ACCUMULATE;
        l = spec_launch(s, acc ? "accum" : "copy", grid_elem(ir_numel(&n->in[0]->t)), ELEM_THREADS,
                        "%s<%s, %s>(a)", acc ? "ck_accumulate" : "ck_copy", fmt_arg(s, &n->in[0]->t),
                        fmt_arg(s, &n->in[1]->t));
        args_inputs(l, n);
        return true;
    }
    case OP_CLIP_COEF:
        if (!check_io(s, n, true)) return false;
        l = spec_launch(s, "clip", 1, 32, "ck_clip_coef<%s, %s>(a)", fmt_arg(s, &n->t),
                        fmt_arg(s, &n->in[0]->t));
        args_result_inputs(l, n);
        l->args.f[0] = IR_FATTR(n, CLIP_COEF, max_norm);
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
        int at_master = ir_adamw_master_index(n), at_copy = ir_adamw_copy_index(n), at_amax = ir_update_amax_index(n);
        if (n->n_in - ir_update_tail(n) != 8 + (at_master >= 0)) return spec_fail(s, "takes 8 or 9 inputs");
        int64_t count = ir_numel(&n->in[0]->t);
        for (int i = 1; i < n->n_in && i != 4; i++)
            if (i < 4 && ir_numel(&n->in[i]->t) != count) return spec_fail(s, "input %d's size differs", i);
        const Node *mn = n->in[2], *vn = n->in[3], *wn = at_master >= 0 ? n->in[at_master] : NULL;
        const Node *cn = at_copy >= 0 ? n->in[at_copy] : NULL;
        if ((cn && (!spec_check_tensor(s, &cn->t, "the FP8 copy") || cn->t.fmt.scaling != SCALE_PER_TENSOR)) ||
            (at_amax >= 0 && !spec_check_tensor(s, &n->in[at_amax]->t, "the weights' amax")))
            return false;
        /* the copy's template argument and its place: t[at_copy], after it the scale and amax;
         * -1 where the update finds the weights' amax alone (copy=2) */
        const char *copy_arg = cn ? fmt_arg(s, &cn->t) : F32_ARG;
        int copy_at = cn ? at_copy : at_amax >= 0 ? -1 : 0;
        Codec mc = mn->t.fmt.codec, vc = vn->t.fmt.codec;
        /* plain or coded states alike (ck_adamw_coded): the update in f32. Plain states once
         * took an f64 update of their own (four vectors a thread), bit for bit the reference's:
         * its f64 divisions, roots and conversions held it at 3.3 TB/s, and in f32 Llama
         * 1.1B -O1's update ran 10.13 -> 9.35 ms a step, GPT-2 d48's 14.30 -> 13.32 on an H200
         * (docs/results.md, "(s)"). The states: each one plain, or a group codec with its side
         * values */
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
        int mk = master_kind(s, n, wn);
        if (mk < 0) return false;
        for (int i = 0; i < 8; i++)
            if (i != 2 && i != 3 && !(i == 0 && mk == 2) && !spec_check_tensor(s, &n->in[i]->t, "an input"))
                return false;
        /* a warp per 256 elements, four chunks a warp: a block starts with one thread computing
         * the bias corrections in f64 while the others wait, which blocks of one chunk a warp
         * paid once per 1024 elements (7.0 ms of d12 -O3's update on an H200) */
        int64_t chunks = (count + 255) / 256;
        int64_t blocks = (chunks + 31) / 32;
        l = spec_launch(s, "adamwc", (unsigned)(blocks < 1 ? 1 : blocks > 4096 ? 4096 : blocks), ELEM_THREADS,
                        "ck_adamw_coded<%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %d, %s, %s, %d>(a)",
                        mk == 2 ? "F<FMT_BF16, SCALE_NONE>" : fmt_arg(s, &n->in[0]->t),
                        fmt_arg(s, &n->in[1]->t), fmt_arg(s, &n->in[4]->t), fmt_arg(s, &n->in[5]->t),
                        fmt_arg(s, &n->in[6]->t), fmt_arg(s, &n->in[7]->t), CODEC_NAMES[mc],
                        mc == CODEC_PLAIN ? fmt_arg(s, &mn->t) : F32_ARG, CODEC_NAMES[vc],
                        vc == CODEC_PLAIN ? fmt_arg(s, &vn->t) : F32_ARG, mk,
                        mk == 1 ? fmt_arg(s, &wn->t) : F32_ARG, copy_arg, copy_at);
        args_inputs(l, n);
        l->batch = true;
        adamw_args(l, n);
        if (at_amax >= 0) plan_copy_amax(s, n, l);
        return true;
    }
    case OP_LION: case OP_SGD: {
        /* one state, plain or coded, one kernel (ck_momentum_coded) */
        int at_master = ir_adamw_master_index(n), at_copy = ir_adamw_copy_index(n), at_amax = ir_update_amax_index(n);
        if (n->n_in - ir_update_tail(n) != 7 + (at_master >= 0)) return spec_fail(s, "takes 7 or 8 inputs");
        int64_t count = ir_numel(&n->in[0]->t);
        for (int i = 1; i < 3; i++)
            if (ir_numel(&n->in[i]->t) != count) return spec_fail(s, "input %d's size differs", i);
        const Node *mn = n->in[2], *wn = at_master >= 0 ? n->in[at_master] : NULL;
        const Node *cn = at_copy >= 0 ? n->in[at_copy] : NULL;
        if ((cn && (!spec_check_tensor(s, &cn->t, "the FP8 copy") || cn->t.fmt.scaling != SCALE_PER_TENSOR)) ||
            (at_amax >= 0 && !spec_check_tensor(s, &n->in[at_amax]->t, "the weights' amax")))
            return false;
        const char *copy_arg = cn ? fmt_arg(s, &cn->t) : F32_ARG;
        int copy_at = cn ? at_copy : at_amax >= 0 ? -1 : 0;   /* as AdamW's */
        const Format *f = &mn->t.fmt;
        Codec mc = f->codec;
        if (mc == CODEC_PLAIN ? !spec_check_tensor(s, &mn->t, "m")
                              : (mc == CODEC_SPLIT || f->elem != codec_elem(mc) || !f->scale ||
                                 f->scale->t.fmt.elem != FMT_F32 ||
                                 ir_numel(&f->scale->t) != codec_param_count(mc, count)))
            return mc == CODEC_PLAIN ? false
                                     : spec_fail(s, "m: codec '%s' with elements %s and %lld side values",
                                                 fmt_codec_name(mc), fmt_elem_name(f->elem),
                                                 (long long)(f->scale ? ir_numel(&f->scale->t) : 0));
        int mk = master_kind(s, n, wn);
        if (mk < 0) return false;
        for (int i = 0; i < 7; i++)
            if (i != 2 && !(i == 0 && mk == 2) && !spec_check_tensor(s, &n->in[i]->t, "an input")) return false;
        /* the master's place is fixed at t[7] in the kernel */
        if (wn && at_master != 7) return spec_fail(s, "the master is not the 8th input");
        bool lion = n->op == OP_LION;
        int64_t chunks = (count + 255) / 256;
        int64_t blocks = (chunks + 31) / 32;
        l = spec_launch(s, lion ? "lion" : "sgd", (unsigned)(blocks < 1 ? 1 : blocks > 4096 ? 4096 : blocks),
                        ELEM_THREADS, "ck_momentum_coded<%d, %d, %s, %s, %s, %s, %s, %s, %s, %d, %s, %s, %d>(a)",
                        lion ? 1 : 2, lion ? 0 : (int)IR_IATTR(n, SGD, nesterov),
                        mk == 2 ? "F<FMT_BF16, SCALE_NONE>" : fmt_arg(s, &n->in[0]->t),
                        fmt_arg(s, &n->in[1]->t), fmt_arg(s, &n->in[3]->t), fmt_arg(s, &n->in[5]->t),
                        fmt_arg(s, &n->in[6]->t), CODEC_NAMES[mc], mc == CODEC_PLAIN ? fmt_arg(s, &mn->t) : F32_ARG,
                        mk, mk == 1 ? fmt_arg(s, &wn->t) : F32_ARG, copy_arg, copy_at);
        args_inputs(l, n);
        l->batch = true;
        UpdateHparams hp = ir_update_hparams(n);   /* SGD: b1 the momentum, b2 0 */
        l->args.f[0] = hp.b1, l->args.f[1] = hp.b2, l->args.f[2] = hp.wd;
        if (at_amax >= 0) plan_copy_amax(s, n, l);
        return true;
    }
    default: break;
    }
    return spec_fail(s, "not an optimizer op");
}
