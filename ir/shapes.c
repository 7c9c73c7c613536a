/* shapes.c — shape inference: one rule per op.
 *
 * Shapes are static once --batch, --seq and -D are bound, so every tensor's dims are known
 * at compile time and the memory plan can be exact. ir_infer_shape computes a node's result
 * shape from its inputs and attributes and explains any disagreement in words that name the
 * dims ("cannot add f32[8,64,768] and f32[512]: last dims 768 and 512 differ"); the front end
 * turns the message into a diagnostic at the node's source location, and ir_verify uses the
 * same rules to check that passes keep shapes right. */
#include "ir.h"

#include <string.h>

const char *ir_shape_text(Arena *a, const Tensor *t)
{
    char buf[160];
    int k = snprintf(buf, sizeof buf, "%s[", fmt_elem_name(t->fmt.elem));
    for (int i = 0; i < t->rank; i++)
        k += snprintf(buf + k, sizeof buf - (size_t)k, i ? ",%lld" : "%lld", (long long)t->dims[i]);
    snprintf(buf + k, sizeof buf - (size_t)k, "]");
    return arena_strdup(a, buf);
}

static int64_t last_dim(const Tensor *t) { return t->rank ? t->dims[t->rank - 1] : 1; }
static int64_t rows_of(const Tensor *t) { return t->rank ? ir_numel(t) / t->dims[t->rank - 1] : 1; }

static void copy_shape(Node *n, const Tensor *from) { ir_set_shape(n, from->rank, from->dims); }
static void set_scalar(Node *n) { ir_set_shape(n, 0, NULL); }

static bool is_int_elem(ElemType e) { return e == FMT_I32 || e == FMT_I8 || e == FMT_U8; }

/* b broadcasts onto a when b is a scalar or b's dims are a suffix of a's. */
static const char *check_broadcast(Node *n, Arena *a, const char *verb)
{
    const Tensor *x = &n->in[0]->t, *y = &n->in[1]->t;
    if (y->rank == 0) return NULL;
    if (y->rank > x->rank)
        return arena_printf(a, "cannot %s %s and %s: the second has more dims than the first",
                            verb, ir_shape_text(a, x), ir_shape_text(a, y));
    for (int i = 1; i <= y->rank; i++)
        if (x->dims[x->rank - i] != y->dims[y->rank - i])
            return arena_printf(a, "cannot %s %s and %s: dim %d is %lld and %lld", verb,
                                ir_shape_text(a, x), ir_shape_text(a, y), x->rank - i,
                                (long long)x->dims[x->rank - i], (long long)y->dims[y->rank - i]);
    return NULL;
}

static const char *check_same(Node *n, Arena *a, int i, int j, const char *what)
{
    const Tensor *x = &n->in[i]->t, *y = &n->in[j]->t;
    if (ir_same_shape(x, y)) return NULL;
    return arena_printf(a, "%s: %s and %s must have the same shape", what, ir_shape_text(a, x),
                        ir_shape_text(a, y));
}

static const char *check_vector(Node *n, Arena *a, int i, int64_t len, const char *what)
{
    const Tensor *t = &n->in[i]->t;
    if (t->rank == 1 && t->dims[0] == len) return NULL;
    return arena_printf(a, "%s must be a vector of %lld (the last dim of the input), not %s",
                        what, (long long)len, ir_shape_text(a, t));
}

static const char *check_scalar(Node *n, Arena *a, int i, const char *what)
{
    if (n->in[i]->t.rank == 0) return NULL;
    return arena_printf(a, "%s must be a scalar, not %s", what, ir_shape_text(a, &n->in[i]->t));
}

static const char *infer_matmul(Node *n, Arena *a)
{
    const Tensor *x = &n->in[0]->t, *y = &n->in[1]->t;
    bool ta = IR_IATTR(n, MATMUL, trans_a), tb = IR_IATTR(n, MATMUL, trans_b);
    if (x->rank < (ta ? 2 : 1))
        return arena_printf(a, "matmul: the first operand %s has too few dims", ir_shape_text(a, x));
    if (y->rank < 2)
        return arena_printf(a, "matmul: the second operand %s must have at least 2 dims", ir_shape_text(a, y));
    int64_t m = ta ? last_dim(x) : rows_of(x), k = ta ? rows_of(x) : last_dim(x);
    int64_t k2 = tb ? last_dim(y) : rows_of(y), nn = tb ? rows_of(y) : last_dim(y);
    if (k != k2)
        return arena_printf(a, "matmul of %s%s and %s%s: inner dims %lld and %lld differ",
                            ir_shape_text(a, x), ta ? " (transposed)" : "", ir_shape_text(a, y),
                            tb ? " (transposed)" : "", (long long)k, (long long)k2);
    if (ta) {
        int64_t d[2] = {m, nn};
        ir_set_shape(n, 2, d);
    } else {
        int64_t d[IR_MAX_RANK];
        memcpy(d, x->dims, sizeof d);
        d[x->rank - 1] = nn;
        ir_set_shape(n, x->rank, d);
    }
    return NULL;
}

/* Packed (B, T, (H + 2 Hkv) D): one tensor holding q, k and v side by side. */
static const char *infer_attention_packed(Node *n, Arena *a, const Tensor *x)
{
    int64_t h = IR_IATTR(n, ATTENTION, heads), hk = IR_IATTR(n, ATTENTION, kv_heads);
    if (h <= 0 || hk <= 0 || h % hk)
        return arena_printf(a, "attention needs heads > 0, kv_heads > 0 dividing heads");
    if (x->rank != 3 || x->dims[2] % (h + 2 * hk))
        return arena_printf(a, "packed attention: %s is not (batch, seq, (heads + 2 kv_heads) * head_dim)",
                            ir_shape_text(a, x));
    int64_t d = x->dims[2] / (h + 2 * hk);
    int64_t dims[3] = {x->dims[0], x->dims[1], n->op == OP_ATTENTION ? h * d : x->dims[2]};
    ir_set_shape(n, 3, dims);
    return NULL;
}

static const char *infer_attention(Node *n, Arena *a)
{
    if (n->n_in == 1) return infer_attention_packed(n, a, &n->in[0]->t);
    if (n->n_in != 3) return arena_printf(a, "attention takes q, k, v or one packed tensor, not %d operands", n->n_in);
    const Tensor *q = &n->in[0]->t, *k = &n->in[1]->t, *v = &n->in[2]->t;
    int64_t h = IR_IATTR(n, ATTENTION, heads), hk = IR_IATTR(n, ATTENTION, kv_heads);
    if (h <= 0 || hk <= 0) return arena_printf(a, "attention needs heads > 0 and kv_heads > 0");
    if (h % hk) return arena_printf(a, "attention: heads (%lld) must be a multiple of kv_heads (%lld)",
                                    (long long)h, (long long)hk);
    static const char *const which[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; i++)
        if (n->in[i]->t.rank != 3)
            return arena_printf(a, "attention: %s must have 3 dims (batch, seq, heads*head_dim), not %s",
                                which[i], ir_shape_text(a, &n->in[i]->t));
    if (q->dims[0] != k->dims[0] || q->dims[1] != k->dims[1] || !ir_same_shape(k, v))
        return arena_printf(a, "attention: q %s, k %s and v %s disagree in batch or sequence dims",
                            ir_shape_text(a, q), ir_shape_text(a, k), ir_shape_text(a, v));
    if (q->dims[2] % h)
        return arena_printf(a, "attention: heads (%lld) does not divide the width of q (%lld)",
                            (long long)h, (long long)q->dims[2]);
    int64_t d = q->dims[2] / h;
    if (k->dims[2] != hk * d)
        return arena_printf(a, "attention: k and v have width %lld, but kv_heads %lld x head_dim %lld = %lld",
                            (long long)k->dims[2], (long long)hk, (long long)d, (long long)(hk * d));
    if (n->op == OP_ATTENTION) {
        copy_shape(n, q);
    } else {
        int64_t dims[3] = {q->dims[0], q->dims[1], (h + 2 * hk) * d};
        ir_set_shape(n, 3, dims);
    }
    return NULL;
}

static const char *infer_axis_op(Node *n, Arena *a)
{
    const Tensor *x = &n->in[0]->t;
    int64_t axis = IR_IATTR(n, SLICE, axis), start = IR_IATTR(n, SLICE, start), size = IR_IATTR(n, SLICE, size);
    if (axis < 0 || axis >= x->rank)
        return arena_printf(a, "axis %lld is out of range for %s", (long long)axis, ir_shape_text(a, x));
    if (size <= 0 || start < 0) return arena_printf(a, "slice start must be >= 0 and size > 0");
    int64_t d[IR_MAX_RANK];
    memcpy(d, x->dims, sizeof d);
    if (n->op == OP_SLICE) {
        if (start + size > x->dims[axis])
            return arena_printf(a, "slice [%lld, %lld) of axis %lld exceeds its length %lld in %s",
                                (long long)start, (long long)(start + size), (long long)axis,
                                (long long)x->dims[axis], ir_shape_text(a, x));
        d[axis] = size;
    } else {
        if (start + x->dims[axis] > size)
            return arena_printf(a, "pad: %lld elements at %lld do not fit in %lld",
                                (long long)x->dims[axis], (long long)start, (long long)size);
        d[axis] = size;
    }
    ir_set_shape(n, x->rank, d);
    return NULL;
}

static const char *infer_concat(Node *n, Arena *a)
{
    const Tensor *x = &n->in[0]->t;
    int64_t axis = IR_IATTR(n, CONCAT, axis);
    if (axis < 0 || axis >= x->rank)
        return arena_printf(a, "axis %lld is out of range for %s", (long long)axis, ir_shape_text(a, x));
    int64_t d[IR_MAX_RANK];
    memcpy(d, x->dims, sizeof d);
    d[axis] = 0;
    for (int i = 0; i < n->n_in; i++) {
        const Tensor *y = &n->in[i]->t;
        bool ok = y->rank == x->rank;
        for (int j = 0; ok && j < x->rank; j++) ok = j == axis || y->dims[j] == x->dims[j];
        if (!ok)
            return arena_printf(a, "concat along axis %lld: %s and %s differ elsewhere",
                                (long long)axis, ir_shape_text(a, x), ir_shape_text(a, y));
        d[axis] += y->dims[axis];
    }
    ir_set_shape(n, x->rank, d);
    return NULL;
}

void ir_matmul_dims(const Node *mm, int64_t *m, int64_t *n, int64_t *k)
{
    IR_ASSERT(mm->op == OP_MATMUL && mm->n_in == 2);
    const Tensor *a = &mm->in[0]->t, *b = &mm->in[1]->t;
    int64_t ca = a->rank ? a->dims[a->rank - 1] : 1, ra = ca ? ir_numel(a) / ca : 0;
    int64_t cb = b->rank ? b->dims[b->rank - 1] : 1, rb = cb ? ir_numel(b) / cb : 0;
    *m = IR_IATTR(mm, MATMUL, trans_a) ? ca : ra;
    *k = IR_IATTR(mm, MATMUL, trans_a) ? ra : ca;
    *n = IR_IATTR(mm, MATMUL, trans_b) ? rb : cb;
}

static const char *infer_shape(Node *n, Arena *a);

/* Every result shape is bounded here (IR_MAX_NUMEL): the front end reports a model whose
 * GEMM or reshape would make a larger tensor at its place, and no later count overflows. */
const char *ir_infer_shape(Node *n, Arena *a)
{
    const char *err = NULL;
    if (n->op == OP_RESHAPE || n->n_in == 0) {   /* shapes set by their builders */
        if (!ir_shape_fits(n->t.rank, n->t.dims))
            return arena_printf(a, "%s's shape %s has more than 2^40 elements", ir_op_info(n->op)->text,
                                ir_shape_text(a, &n->t));
    }
    for (int i = 0; i < n->n_in; i++)
        if (!ir_shape_fits(n->in[i]->t.rank, n->in[i]->t.dims))
            return arena_printf(a, "%s reads %s, which has more than 2^40 elements", ir_op_info(n->op)->text,
                                ir_shape_text(a, &n->in[i]->t));
    if ((err = infer_shape(n, a))) return err;
    if (!ir_shape_fits(n->t.rank, n->t.dims))
        return arena_printf(a, "%s's result %s has more than 2^40 elements", ir_op_info(n->op)->text,
                            ir_shape_text(a, &n->t));
    return NULL;
}

static const char *infer_shape(Node *n, Arena *a)
{
    const OpInfo *info = ir_op_info(n->op);
    if (info->arity >= 0 && n->n_in != info->arity)
        return arena_printf(a, "%s takes %d operand%s, not %d", info->text, info->arity,
                            info->arity == 1 ? "" : "s", n->n_in);
    if (info->arity < 0 && n->n_in < 1) return arena_printf(a, "%s needs at least one operand", info->text);
    const Tensor *x = n->n_in ? &n->in[0]->t : NULL;
    const char *err;

    switch (n->op) {
    case OP_INPUT: case OP_PARAM: case OP_STATE: case OP_CONST:
        return NULL;
    case OP_ADD: case OP_SUB: case OP_MUL:
        if ((err = check_broadcast(n, a, n->op == OP_MUL ? "multiply" : n->op == OP_ADD ? "add" : "subtract")))
            return err;
        copy_shape(n, x);
        return NULL;
    case OP_SCALE: case OP_GELU: case OP_SILU: case OP_CAST: case OP_SOFTMAX:
        copy_shape(n, x);
        return NULL;
    case OP_GELU_BWD: case OP_SILU_BWD: case OP_SOFTMAX_BWD:
        if ((err = check_same(n, a, 0, 1, info->text))) return err;
        copy_shape(n, x);
        return NULL;
    case OP_ADD_N:
        for (int i = 1; i < n->n_in; i++)
            if ((err = check_same(n, a, 0, i, "add_n"))) return err;
        copy_shape(n, x);
        return NULL;
    case OP_RESHAPE:
        if (ir_numel(&n->t) != ir_numel(x))
            return arena_printf(a, "cannot reshape %s (%lld elements) to %s", ir_shape_text(a, x),
                                (long long)ir_numel(x), ir_shape_text(a, &n->t));
        return NULL;
    case OP_SLICE: case OP_PAD:
        return infer_axis_op(n, a);
    case OP_CONCAT:
        return infer_concat(n, a);
    case OP_TRANSPOSE: {
        if (x->rank < 2) return arena_printf(a, "transpose needs at least 2 dims, not %s", ir_shape_text(a, x));
        int64_t d[2] = {last_dim(x), rows_of(x)};
        ir_set_shape(n, 2, d);
        return NULL;
    }
    case OP_MATMUL:
        return infer_matmul(n, a);
    case OP_SUM_ROWS: {
        if (!x->rank) return arena_printf(a, "sum_rows needs a tensor, not a scalar");
        int64_t d = last_dim(x);
        ir_set_shape(n, 1, &d);
        return NULL;
    }
    case OP_SQNORM: case OP_CROSS_ENTROPY: case OP_CLIP_COEF: case OP_GRAD_NORM:
        if (n->op == OP_CROSS_ENTROPY) {
            const Tensor *tg = &n->in[1]->t;
            bool ok = tg->rank == x->rank - 1 && x->rank >= 1;
            for (int i = 0; ok && i < tg->rank; i++) ok = tg->dims[i] == x->dims[i];
            if (!ok)
                return arena_printf(a, "cross_entropy: targets %s must have the dims of logits %s without the last",
                                    ir_shape_text(a, tg), ir_shape_text(a, x));
            if (!is_int_elem(tg->fmt.elem))
                return arena_printf(a, "cross_entropy: targets must be integers, not %s", ir_shape_text(a, tg));
        }
        if (n->op == OP_CLIP_COEF || n->op == OP_GRAD_NORM)
            for (int i = 0; i < n->n_in; i++)
                if ((err = check_scalar(n, a, i, info->text))) return err;
        set_scalar(n);
        return NULL;
    case OP_LAYERNORM: case OP_RMSNORM:
        if (!x->rank) return arena_printf(a, "%s needs a tensor, not a scalar", info->text);
        if ((err = check_vector(n, a, 1, last_dim(x), "the norm's weight"))) return err;
        if (n->op == OP_LAYERNORM && (err = check_vector(n, a, 2, last_dim(x), "the norm's bias")))
            return err;
        copy_shape(n, x);
        return NULL;
    case OP_LAYERNORM_BWD_X: case OP_RMSNORM_BWD_X:
        if ((err = check_same(n, a, 0, 1, info->text))) return err;
        if ((err = check_vector(n, a, 2, last_dim(x), "the norm's weight"))) return err;
        copy_shape(n, x);
        return NULL;
    case OP_LAYERNORM_BWD_W: case OP_RMSNORM_BWD_W: {
        if ((err = check_same(n, a, 0, 1, info->text))) return err;
        int64_t d = last_dim(x);
        ir_set_shape(n, 1, &d);
        return NULL;
    }
    case OP_EMBEDDING: {
        const Tensor *ids = &n->in[1]->t;
        if (x->rank != 2) return arena_printf(a, "embedding: the table %s must have 2 dims", ir_shape_text(a, x));
        if (!is_int_elem(ids->fmt.elem))
            return arena_printf(a, "embedding: ids must be integers, not %s", ir_shape_text(a, ids));
        if (ids->rank + 1 > IR_MAX_RANK) return arena_printf(a, "embedding: ids have too many dims");
        int64_t d[IR_MAX_RANK];
        memcpy(d, ids->dims, sizeof d);
        d[ids->rank] = x->dims[1];
        ir_set_shape(n, ids->rank + 1, d);
        return NULL;
    }
    case OP_EMBEDDING_BWD: {
        const Tensor *ids = &n->in[1]->t;
        bool ok = x->rank == ids->rank + 1;
        for (int i = 0; ok && i < ids->rank; i++) ok = x->dims[i] == ids->dims[i];
        if (!ok) return arena_printf(a, "embedding_bwd: dy %s does not match ids %s", ir_shape_text(a, x), ir_shape_text(a, ids));
        int64_t vocab = IR_IATTR(n, EMBEDDING_BWD, vocab);
        if (vocab <= 0) return arena_printf(a, "embedding_bwd needs vocab > 0");
        int64_t d[2] = {vocab, last_dim(x)};
        ir_set_shape(n, 2, d);
        return NULL;
    }
    case OP_CROSS_ENTROPY_BWD: {
        if ((err = check_scalar(n, a, 0, "cross_entropy_bwd's dloss"))) return err;
        const Tensor *lg = &n->in[1]->t, *tg = &n->in[2]->t;
        bool ok = tg->rank == lg->rank - 1;
        for (int i = 0; ok && i < tg->rank; i++) ok = tg->dims[i] == lg->dims[i];
        if (!ok) return arena_printf(a, "cross_entropy_bwd: targets %s do not match logits %s",
                                     ir_shape_text(a, tg), ir_shape_text(a, lg));
        copy_shape(n, lg);
        return NULL;
    }
    case OP_ROPE: {
        int64_t hd = IR_IATTR(n, ROPE, head_dim);
        if (x->rank != 3) return arena_printf(a, "rope needs (batch, seq, heads*head_dim), not %s", ir_shape_text(a, x));
        if (hd <= 0 || hd % 2 || x->dims[2] % hd)
            return arena_printf(a, "rope: head_dim %lld must be even and divide the width %lld",
                                (long long)hd, (long long)x->dims[2]);
        copy_shape(n, x);
        return NULL;
    }
    case OP_ATTENTION:
        return infer_attention(n, a);
    case OP_ATTENTION_BWD: {
        Node *saved = n->in[0];
        if (ir_attention_bwd_reads_y(n)) {   /* y has dy's shape; the rest as without it */
            if (!ir_same_shape(&saved->t, &n->in[n->n_in - 1]->t))
                return arena_printf(a, "attention_bwd: y %s must have dy's shape %s",
                                    ir_shape_text(a, &n->in[n->n_in - 1]->t), ir_shape_text(a, &saved->t));
            Node tmp = *n;
            tmp.n_in = n->n_in - 1;
            err = ir_infer_shape(&tmp, a);
            if (!err) copy_shape(n, &tmp.t);
            return err;
        }
        if (n->n_in == 2) {
            const char *perr = infer_attention_packed(n, a, &n->in[1]->t);
            if (perr) return perr;
            int64_t h = IR_IATTR(n, ATTENTION_BWD, heads), hk = IR_IATTR(n, ATTENTION_BWD, kv_heads);
            int64_t w = n->in[1]->t.dims[2] / (h + 2 * hk) * h;
            if (saved->t.rank != 3 || saved->t.dims[0] != n->t.dims[0] || saved->t.dims[1] != n->t.dims[1] ||
                saved->t.dims[2] != w)
                return arena_printf(a, "attention_bwd: dy %s does not match the packed q|k|v %s",
                                    ir_shape_text(a, &saved->t), ir_shape_text(a, &n->in[1]->t));
            return NULL;
        }
        if (n->n_in != 4) return arena_printf(a, "attention_bwd takes (dy, q, k, v[, y]) or (dy, q|k|v[, y])");
        /* dy has q's shape; check it, then infer from (q, k, v) */
        if (!ir_same_shape(&saved->t, &n->in[1]->t))
            return arena_printf(a, "attention_bwd: dy %s must have q's shape %s",
                                ir_shape_text(a, &saved->t), ir_shape_text(a, &n->in[1]->t));
        Node tmp = *n;
        tmp.in = n->in + 1;
        tmp.n_in = 3;
        err = infer_attention(&tmp, a);
        if (!err) copy_shape(n, &tmp.t);
        return err;
    }
    case OP_ACCUMULATE: case OP_ASSIGN:
        if ((err = check_same(n, a, 0, 1, info->text))) return err;
        copy_shape(n, x);
        n->t.fmt = x->fmt;
        return NULL;
    case OP_ADAMW: case OP_LION: case OP_SGD: {
        int64_t copy_attr = IR_IATTR(n, ADAMW, copy);
        if (copy_attr < 0 || copy_attr > 2) return arena_printf(a, "%s: copy=%lld (0, 1 or 2)", info->text, (long long)copy_attr);
        int copies = ir_update_tail(n), lr = ir_update_lr_index(n);
        if (n->n_in - copies != lr + 4 && n->n_in - copies != lr + 5)
            return arena_printf(a, "%s takes %d or %d operands%s, not %d", info->text, lr + 4, lr + 5,
                                copies == 3 ? " and an FP8 copy's 3" : copies ? " and an amax state" : "", n->n_in);
        for (int i = 1; i < lr; i++)
            if ((err = check_same(n, a, 0, i, info->text))) return err;
        for (int i = lr; i < lr + 4; i++)
            if ((err = check_scalar(n, a, i, arena_printf(a, "%s's lr, step, clip and grad_scale", info->text)))) return err;
        int master = ir_adamw_master_index(n), copy = ir_adamw_copy_index(n);
        if (master >= 0 && (err = check_same(n, a, 0, master, arena_printf(a, "%s master", info->text)))) return err;
        if (copies == 1 &&
            ((err = check_scalar(n, a, n->n_in - 1, arena_printf(a, "%s's amax state", info->text))) ||
             n->in[n->n_in - 1]->t.fmt.elem != FMT_F32))
            return err ? err : arena_printf(a, "%s's amax state must be f32", info->text);
        if (copy >= 0) {
            const Format *f = &n->in[copy]->t.fmt;
            if ((err = check_same(n, a, 0, copy, arena_printf(a, "%s's FP8 copy", info->text)))) return err;
            if ((err = check_scalar(n, a, copy + 1, arena_printf(a, "%s's copy scale", info->text)))) return err;
            if ((err = check_scalar(n, a, copy + 2, arena_printf(a, "%s's copy amax", info->text)))) return err;
            const Node *sc = n->in[copy + 1];
            bool given = sc == f->scale || (ir_op_is_inplace(sc->op) && sc->n_in && sc->in[0] == f->scale);
            if (f->scaling != SCALE_PER_TENSOR || !f->scale || !given)
                return arena_printf(a, "%s's FP8 copy must be scaled per tensor by the scale it is given", info->text);
        }
        set_scalar(n);
        n->t.fmt = fmt_plain(FMT_VOID);
        return NULL;
    }
    case OP_QUANT_SCALE: {
        /* one scale per block (ir/scaling.def): a scalar per tensor, (rows) per row, else the
         * grid of blocks (rows / block rows, cols / block cols) */
        Scaling sc = (Scaling)IR_IATTR(n, QUANT_SCALE, scaling);
        int64_t g = IR_IATTR(n, QUANT_SCALE, group);
        if (sc <= SCALE_NONE || sc >= SCALE_COUNT)
            return arena_printf(a, "quant_scale needs a scaling granularity");
        const ScalingInfo *si = fmt_scaling_info(sc);
        if (si->block_cols < 0 && g <= 0) return arena_printf(a, "per-group scaling needs a group size > 0");
        ScaleGrid grid = fmt_scale_grid(sc, g, rows_of(x), last_dim(x));
        int64_t d[2] = {grid.grid_rows, grid.grid_cols};
        if (si->block_rows == 0) set_scalar(n);             /* one block: the whole tensor */
        else if (si->block_cols == 0) ir_set_shape(n, 1, d);
        else ir_set_shape(n, 2, d);
        return NULL;
    }
    case OP_QUANTIZE:
        copy_shape(n, x);
        return NULL;
    case OP_AMAX_RECORD:
        if (x->rank != 1) return arena_printf(a, "an amax history must be a vector, not %s", ir_shape_text(a, x));
        copy_shape(n, x);
        n->t.fmt = x->fmt;
        return NULL;
    case OP_DELAYED_SCALE:
        if ((err = check_scalar(n, a, 0, "delayed_scale's scale"))) return err;
        copy_shape(n, x);
        n->t.fmt = x->fmt;
        return NULL;
    case OP_ALL_REDUCE:
        copy_shape(n, x);
        n->t.fmt = x->fmt;
        return NULL;
    case OP_COUNT:
        break;
    }
    ir_die(__FILE__, __LINE__, "no shape rule for op %d", (int)n->op);
}
