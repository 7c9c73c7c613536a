/* lower_adamw.c — the optimizer's kernels: clipping, the gradient norm, the updates (AdamW,
 * Lion, SGD with momentum).
 *
 * The update is the one kernel that reads and writes the optimizer-state codecs (FP8 with
 * range expansion, companded int8, split master weights) itself, instead of leaving a coded
 * tensor to the reference executor: at O2/O3 the states are most of the step's bytes, and a
 * codec's groups share side values that only a kernel seeing the whole group can make. The
 * section on the updates below says how the items are cut and how close the f32 codec math comes to
 * codecs.c's f64. The clip coefficient and the gradient norm are one-item kernels; the
 * weights' amax the update needs for their FP8 copy uses lower_rows.c's partial sums. */
#include "lower_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- optimizer */

void lower_clip_coef(Lower *L, Node *n)
{
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, 1, 10);
    body(k);
    double max_norm = IR_FATTR(n, CLIP_COEF, max_norm);
    int y = fc(k, 1.0f);
    if (max_norm > 0) {
        int norm = ld(k, cg_buf_tensor(k, n->in[0], true, false), ic(k, 0));
        y = e2(k, CG_FMIN, fc(k, 1.0f), fdiv(k, fc(k, (float)max_norm), fadd(k, norm, fc(k, 1e-6f))));
    }
    cg_store(k, cg_buf_tensor(k, n, false, true), ic(k, 0), y, NONE, NONE);
}

void lower_grad_norm(Lower *L, Node *n)
{
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    shape(k, CG_PAR_THREAD, 1, 2 * n->n_in);
    body(k);
    int s = fc(k, 0.0f);
    for (int j = 1; j < n->n_in; j++) {
        int64_t m = ir_numel(&n->in[j]->t);
        int xb = cg_buf_tensor(k, n->in[j], true, false);
        for (int64_t i = 0; i < m; i++) s = fadd(k, s, ld(k, xb, ic(k, i)));
    }
    int gs = ld(k, cg_buf_tensor(k, n->in[0], true, false), ic(k, 0));
    cg_store(k, cg_buf_tensor(k, n, false, true), ic(k, 0), fmul(k, e1(k, CG_SQRT, s), gs), NONE, NONE);
}

/* ---------------------------------------------------------------- the updates
 *
 * ref_optim.c's updates in f32: the step's scalars (and AdamW's bias corrections) in the
 * prologue, then per element g, the states, the weight. AdamW keeps two states (m, v), Lion and
 * SGD one (their momentum m, stored as Adam's m is); the lowering is one for all three, only
 * the element's arithmetic differs (update_element). With plain states that is an elementwise
 * kernel. At O2/O3 the states are stored through the optimizer-state codecs of ir/codecs.c, whose groups share
 * side values (amax, the range-expansion exponent k) that depend on every new element of the
 * group, so the update is a block kernel: an item is a chunk of C consecutive elements (the
 * larger of the two states' group sizes, so that every group lies in one item) and runs
 *   1. a row loop over the chunk: decode the states and the master, the step, store the
 *      weight (splitting a split master), zero the gradient, keep the new states in locals;
 *   2. per coded state and group: a row loop of reductions for the group's statistics, the
 *      side values, and a row loop that encodes and stores the codes.
 * It is the GPU library's ck_adamw_coded (a warp per 128 elements) in kernel-IR form.
 *
 * The codec formulas are codecs.c's, in f32 where codecs.c computes in f64: powers are
 * exp(k log y), and quotients like z/(2 - |z|) with z = q/127 are q/(254 - |q|). The
 * statistics that select a value (the group max, the smallest nonzero magnitude, the max of
 * sqrt(v)) are exact, so for the same new m and v the side values c, amax and p are bit for
 * bit the reference's and k = log(28672) / log(c/lo) is within an ulp or two; codes differ
 * only where the f32 and f64 values straddle a rounding point of the code, by one step. In a
 * real step the new m and v themselves differ from ref_adamw's f64 ones in their last bits,
 * most where m's two terms cancel; a group whose smallest element cancelled gets a slightly
 * different k and is encoded (and later decoded) with it. A split master decodes exactly in
 * f32 (its unit ulp(hi)/256 is a power of two made from hi's exponent bits), so it is
 * bit-identical wherever the f32 weight is. Non-finite values follow codecs.c: a group
 * holding a NaN keeps NaN as its max (an infinity: inf), codes of zero, and decodes to NaN.
 * tests/test_codegen.c states and checks the bounds. */

enum { A_PARAM, A_GRAD, A_M };   /* then the other state (AdamW's v), lr, step, clip, grad_scale */

/* codecs.c's range expansion: the group's range becomes e4m3's normal range 448 / 2^-6, and
 * k is capped at 16 */
#define EXPAND_RANGE 28672.0
#define EXPAND_K_MAX 16.0

/* An optimizer state (Adam's m or v, Lion's or SGD's momentum) as the update kernel sees it. */
typedef struct {
    Codec codec;            /* CODEC_PLAIN: loaded and stored through the tensor's format */
    int64_t group;          /* elements sharing side values; 1 when plain */
    int buf;                /* the tensor, or its codes */
    int side;               /* the side values (f32, codec_params_per_group per group) */
    int p0, p1;             /* the item's group's side values, when the group is the chunk */
    int local;              /* the chunk's new values, until they are encoded */
} Moment;

typedef struct {
    OpKind op;                  /* ADAMW, LION, SGD */
    double b1, b2, eps, wd;     /* SGD: b1 is the momentum */
    bool nesterov;              /* SGD */
    int lr, gmul, bc1, bc2;     /* prologue values; bc1, bc2: AdamW's */
    int param, grad;
    int master;                 /* a plain master's tensor, a split master's codes, or NONE */
    bool split;
    int copy;                   /* the weights' FP8 copy for the next step, or NONE */
    int n_states;               /* 2 (m, v) or 1 (m) */
    Moment st[2];
} Adam;


/* signbit(x), -0 and NaNs with the sign set included */
static int sign_bit(CgKernel *k, int x) { return e2(k, CG_ILT, ic(k, 0x7FFFFFFF), e1(k, CG_FBITS, x)); }

/* x^y for x >= 0 (0 when x = 0, y > 0) */
static int power(CgKernel *k, int x, int y) { return e1(k, CG_EXP, fmul(k, y, e1(k, CG_LOG, x))); }

/* 0 < x < inf */
static int positive_finite(CgKernel *k, int x)
{
    return both(k, flt(k, fc(k, 0.0), x), flt(k, x, fc(k, INFINITY)));
}

/* 2^e for e in [-126, 127] */
static int pow2(CgKernel *k, int e)
{
    return e1(k, CG_BITSF, imul(k, iadd(k, e, ic(k, 127)), ic(k, 1 << 23)));
}

/* A split master's unit ulp(hi)/256 = 2^(b - 142) for the bf16 value hi, b its biased exponent
 * (1 for zero and subnormals): codecs.c's ldexpf(1, split_ulp_exp(hi) - 8). It runs from
 * 2^-141 to 2^113, so it is made as a product of two normal powers of two (exact, subnormal
 * at the bottom). */
static int split_unit(CgKernel *k, int hi)
{
    int b = e2(k, CG_IMOD, e2(k, CG_IDIV, e1(k, CG_FBITS, hi), ic(k, 1 << 23)), ic(k, 256));
    b = e2(k, CG_IMAX, b, ic(k, 1));
    int half = e2(k, CG_IDIV, b, ic(k, 2));
    int s = e2(k, CG_ISUB, half, ic(k, 71)), t = e2(k, CG_ISUB, e2(k, CG_ISUB, b, ic(k, 71)), half);
    return fmul(k, pow2(k, s), pow2(k, t));
}

static Moment moment_of(CgKernel *k, Node *x)
{
    Moment s = {.codec = x->t.fmt.codec, .group = 1, .side = NONE, .p0 = NONE, .p1 = NONE, .local = NONE};
    if (s.codec == CODEC_PLAIN) {
        s.buf = cg_buf_tensor(k, x, true, true);
        return s;
    }
    s.group = codec_group_size(s.codec);
    s.buf = cg_buf_codes(k, x, true, true);
    s.side = cg_buf_tensor(k, x->t.fmt.scale, true, true);
    return s;
}

/* Side value j of group gi. */
static int side_at(CgKernel *k, const Moment *s, int gi, int j)
{
    int64_t per = codec_params_per_group(s->codec);
    return ld(k, s->side, iadd(k, imul(k, gi, ic(k, per)), ic(k, j)));
}

/* Element i of a moment (codecs.c's *_decode); p0, p1 its group's side values. */
static int moment_decode(CgKernel *k, const Moment *s, int i, int p0, int p1)
{
    int q = ld(k, s->buf, i);
    switch (s->codec) {
    case CODEC_PLAIN: return q;
    case CODEC_EXPAND: {            /* sign(d) c (|d| / 448)^(1/k) */
        int y = fdiv(k, fabs_of(k, q), fc(k, 448.0));
        int a = fmul(k, p0, e1(k, CG_EXP, fdiv(k, e1(k, CG_LOG, y), p1)));
        return select_of(k, sign_bit(k, q), fneg(k, a), a);
    }
    case CODEC_COMPAND:             /* amax z / (2 - |z|), z = q/127 */
        return fmul(k, p0, fdiv(k, q, fsub(k, fc(k, 254.0), fabs_of(k, q))));
    case CODEC_SQRT: {              /* (p z / (2 - z))^2, z = q/255 */
        int r = fmul(k, fdiv(k, q, fsub(k, fc(k, 510.0), q)), p0);
        return fmul(k, r, r);
    }
    default: IR_ASSERT(!"moment_decode: not a moment codec");
    }
    return NONE;
}

/* Encodes the new values local[lo..hi) of a moment, group gi, into codes base + lo.. (codecs.c's
 * *_encode): the group's statistics, its side values, its codes. */
static void moment_encode(CgKernel *k, const Moment *s, int base, int lo, int hi, int gi)
{
    int zero = fc(k, 0.0);
    bool sq = s->codec == CODEC_SQRT, ex = s->codec == CODEC_EXPAND;
    int j = row_loop(k, lo, hi);
    int x = lget(k, s->local, j);
    int a = sq ? select_of(k, flt(k, zero, x), e1(k, CG_SQRT, x), zero) : fabs_of(k, x);
    int amax = reduce_max(k, a);
    int nan = reduce_max(k, select_of(k, e2(k, CG_FEQ, x, x), zero, fc(k, 1.0)));
    /* the smallest nonzero magnitude, as the max of its negation (-inf when none) */
    int neg_min = ex ? reduce_max(k, select_of(k, flt(k, zero, a), fneg(k, a), fc(k, -INFINITY))) : NONE;
    end(k);
    /* a NaN anywhere wins the max, as in codec_absmax */
    int c = select_of(k, flt(k, zero, nan), fc(k, NAN), amax);
    int finite = positive_finite(k, c);
    int side0 = imul(k, gi, ic(k, codec_params_per_group(s->codec)));
    cg_store(k, s->side, side0, c, NONE, NONE);
    int kk = NONE;
    if (ex) {
        /* k = log(28672) / log(c / lo) when c > 0 and c / lo > 1, else 1; at most 16 */
        int ratio = fdiv(k, c, fneg(k, neg_min));
        int spread = both(k, flt(k, zero, c), flt(k, fc(k, 1.0), ratio));
        kk = select_of(k, spread, fdiv(k, fc(k, log(EXPAND_RANGE)), e1(k, CG_LOG, ratio)), fc(k, 1.0));
        kk = e2(k, CG_FMIN, kk, fc(k, EXPAND_K_MAX));
        cg_store(k, s->side, iadd(k, side0, ic(k, 1)), kk, NONE, NONE);
    }
    j = row_loop(k, lo, hi);
    x = lget(k, s->local, j);
    int q;
    switch (s->codec) {
    case CODEC_EXPAND: {            /* e4m3(448 sign(x) |x/c|^k) */
        int y = fmul(k, fc(k, 448.0), power(k, fdiv(k, fabs_of(k, x), c), kk));
        y = select_of(k, finite, y, zero);
        q = select_of(k, sign_bit(k, x), fneg(k, y), y);
        break;
    }
    case CODEC_COMPAND: {           /* round(127 2y / (1 + |y|)), y = x / amax */
        int y = select_of(k, finite, fdiv(k, x, c), zero);
        q = fmul(k, fc(k, 127.0), fdiv(k, fmul(k, fc(k, 2.0), y), fadd(k, fc(k, 1.0), fabs_of(k, y))));
        break;
    }
    case CODEC_SQRT: {              /* round(255 2y / (1 + y)), y = sqrt(v) / p; v > 0: >= 1 */
        int pos = both(k, finite, flt(k, zero, x));
        int y = select_of(k, pos, fdiv(k, e1(k, CG_SQRT, x), c), zero);
        int r = fmul(k, fc(k, 255.0), fdiv(k, fmul(k, fc(k, 2.0), y), fadd(k, fc(k, 1.0), y)));
        /* rint(r) < 1 exactly when r <= 0.5 (the tie rounds to the even 0) */
        q = select_of(k, both(k, pos, e2(k, CG_FLE, r, fc(k, 0.5))), fc(k, 1.0), r);
        break;
    }
    default: IR_ASSERT(!"moment_encode: not a moment codec");
    }
    cg_store(k, s->buf, iadd(k, base, j), q, NONE, NONE);   /* the store rounds and clamps */
    end(k);
}

/* The weight of element i: the master (split: hi + lo ulp(hi)/256, exact), else the param. */
static int weight_load(CgKernel *k, const Adam *A, int i)
{
    if (!A->split) return ld(k, A->master != NONE ? A->master : A->param, i);
    int hi = ld(k, A->param, i);
    return fadd(k, hi, fmul(k, ld(k, A->master, i), split_unit(k, hi)));
}

static void weight_store(CgKernel *k, const Adam *A, int i, int w)
{
    if (A->split) {
        /* hi = bf16(w), the weight the forward reads; lo = rint((w - hi) / unit), exact before
         * the rounding, 0 where hi is not finite */
        int hi = cg_round(k, A->param, i, w, NONE, NONE);
        int r = fdiv(k, fsub(k, w, hi), split_unit(k, hi));
        cg_store(k, A->param, i, w, NONE, NONE);
        cg_store(k, A->master, i, select_of(k, flt(k, fabs_of(k, hi), fc(k, INFINITY)), r, fc(k, 0.0)), NONE, NONE);
        if (A->copy != NONE) cg_store(k, A->copy, i, hi, NONE, NONE);
        return;
    }
    if (A->master != NONE) cg_store(k, A->master, i, w, NONE, NONE);
    cg_store(k, A->param, i, w, NONE, NONE);   /* through param's format: round(master) */
    /* the copy quantizes the weight as stored, as the forward would */
    if (A->copy != NONE) cg_store(k, A->copy, i, cg_round(k, A->param, i, w, NONE, NONE), NONE, NONE);
}

/* The step of element i from its old states: stores the weight and a zero gradient and
 * returns the new states (ref_optim.c's update_task, in f32). */
static void update_element(CgKernel *k, const Adam *A, int i, const int *old, int *now)
{
    int g = fmul(k, ld(k, A->grad, i), A->gmul);
    int w = weight_load(k, A, i), upd;
    switch (A->op) {
    case OP_ADAMW: {
        int m = fadd(k, fmul(k, fc(k, A->b1), old[0]), fmul(k, fc(k, 1 - A->b1), g));
        int v = fadd(k, fmul(k, fc(k, A->b2), old[1]), fmul(k, fmul(k, fc(k, 1 - A->b2), g), g));
        int mhat = fdiv(k, m, A->bc1), vhat = fdiv(k, v, A->bc2);
        upd = fadd(k, fdiv(k, mhat, fadd(k, e1(k, CG_SQRT, vhat), fc(k, A->eps))), fmul(k, fc(k, A->wd), w));
        now[0] = m, now[1] = v;
        break;
    }
    case OP_LION: {             /* sign(b1 m + (1 - b1) g) + wd w; m from b2 */
        int d = fadd(k, fmul(k, fc(k, A->b1), old[0]), fmul(k, fc(k, 1 - A->b1), g));
        int zero = fc(k, 0.0);
        int sign = select_of(k, flt(k, zero, d), fc(k, 1.0), select_of(k, flt(k, d, zero), fc(k, -1.0), zero));
        upd = fadd(k, sign, fmul(k, fc(k, A->wd), w));
        now[0] = fadd(k, fmul(k, fc(k, A->b2), old[0]), fmul(k, fc(k, 1 - A->b2), g));
        break;
    }
    default: {                  /* SGD: g + wd w (L2), m = mu m + g, nesterov: g + mu m */
        if (A->wd != 0) g = fadd(k, g, fmul(k, fc(k, A->wd), w));
        int m = fadd(k, fmul(k, fc(k, A->b1), old[0]), g);
        upd = A->nesterov ? fadd(k, g, fmul(k, fc(k, A->b1), m)) : m;
        now[0] = m;
        break;
    }
    }
    w = fsub(k, w, fmul(k, A->lr, upd));
    cg_store(k, A->grad, i, fc(k, 0.0), NONE, NONE);
    weight_store(k, A, i, w);
}

/* Whether the kernels can update n's states: plain, or states through a group codec whose
 * side values fit (the chunk holds whole groups of each), or a split master of a bf16 param. */
bool adamw_codecs_supported(const Node *n)
{
    int states = ir_update_states(n);
    for (int j = 0; j < n->n_in; j++)
        if ((j < A_M || j >= A_M + states) && j != ir_adamw_master_index(n) && n->in[j]->t.fmt.codec != CODEC_PLAIN)
            return false;
    int64_t C = 1, gs[2] = {1, 1};
    for (int j = A_M; j < A_M + states; j++) {
        const Format *f = &n->in[j]->t.fmt;
        if (f->codec == CODEC_PLAIN) continue;
        if (f->codec != CODEC_EXPAND && f->codec != CODEC_COMPAND && f->codec != CODEC_SQRT) return false;
        if (f->elem != codec_elem(f->codec) || !f->scale || f->scale->t.fmt.elem != FMT_F32 ||
            f->scale->t.fmt.codec != CODEC_PLAIN || f->scale->t.fmt.scaling != SCALE_NONE ||
            ir_numel(&f->scale->t) != codec_param_count(f->codec, ir_numel(&n->in[j]->t)))
            return false;
        gs[j - A_M] = codec_group_size(f->codec);
        if (gs[j - A_M] > C) C = gs[j - A_M];
    }
    if (C % gs[0] || C % gs[1]) return false;
    int at_master = ir_adamw_master_index(n), at_amax = ir_update_amax_index(n);
    if (at_amax >= 0 && !format_is_plain(&n->in[at_amax]->t.fmt)) return false;
    if (at_master >= 0 && n->in[at_master]->t.fmt.codec != CODEC_PLAIN) {
        const Format *f = &n->in[at_master]->t.fmt;
        return f->codec == CODEC_SPLIT && f->elem == FMT_I8 && f->scaling == SCALE_NONE &&
               n->in[A_PARAM]->t.fmt.elem == FMT_BF16 && format_is_plain(&n->in[A_PARAM]->t.fmt);
    }
    return true;
}

static void lower_adamw_update(Lower *L, Node *n)
{
    int at_master = ir_adamw_master_index(n), at_copy = ir_adamw_copy_index(n), at_lr = ir_update_lr_index(n);
    Node *master = at_master >= 0 ? n->in[at_master] : NULL;
    Adam A = {.op = n->op, .master = NONE, .copy = NONE, .n_states = ir_update_states(n)};
    UpdateHparams hp = ir_update_hparams(n);
    A.b1 = hp.b1, A.b2 = hp.b2, A.eps = hp.eps, A.wd = hp.wd, A.nesterov = hp.nesterov;
    A.split = master && master->t.fmt.codec == CODEC_SPLIT;
    int64_t N = ir_numel(&n->in[A_PARAM]->t);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, NULL);
    A.lr = ld(k, cg_buf_tensor(k, n->in[at_lr], true, false), ic(k, 0));
    int step = ld(k, cg_buf_tensor(k, n->in[at_lr + 1], true, false), ic(k, 0));
    int clip = ld(k, cg_buf_tensor(k, n->in[at_lr + 2], true, false), ic(k, 0));
    int gsc = ld(k, cg_buf_tensor(k, n->in[at_lr + 3], true, false), ic(k, 0));
    A.gmul = fmul(k, gsc, clip);
    if (n->op == OP_ADAMW) {
        /* 1 - beta^step as exp(step * log(beta)), log taken here in double */
        A.bc1 = A.b1 == 0 ? fc(k, 1.0) : fsub(k, fc(k, 1.0), e1(k, CG_EXP, fmul(k, step, fc(k, log(A.b1)))));
        A.bc2 = A.b2 == 0 ? fc(k, 1.0) : fsub(k, fc(k, 1.0), e1(k, CG_EXP, fmul(k, step, fc(k, log(A.b2)))));
    }
    body(k);
    A.param = cg_buf_tensor(k, n->in[A_PARAM], !master || A.split, true);
    A.grad = cg_buf_tensor(k, n->in[A_GRAD], true, true);
    for (int s = 0; s < A.n_states; s++) A.st[s] = moment_of(k, n->in[A_M + s]);
    if (master) A.master = A.split ? cg_buf_codes(k, master, true, true) : cg_buf_tensor(k, master, true, true);
    if (at_copy >= 0) A.copy = cg_buf_tensor(k, n->in[at_copy], false, true);
    int old[2] = {NONE, NONE}, now[2] = {NONE, NONE};

    int64_t C = 1;
    for (int s = 0; s < A.n_states; s++)
        if (A.st[s].group > C) C = A.st[s].group;
    if (C == 1) {
        /* plain states: one item per element */
        shape(k, CG_PAR_THREAD, N, A.split ? 50 : 30);
        int i = item(k);
        for (int s = 0; s < A.n_states; s++) old[s] = ld(k, A.st[s].buf, i);
        update_element(k, &A, i, old, now);
        for (int s = 0; s < A.n_states; s++) cg_store(k, A.st[s].buf, i, now[s], NONE, NONE);
        return;
    }

    /* coded states: one item per chunk of C elements, whole groups of each */
    shape(k, CG_PAR_BLOCK, (N + C - 1) / C, 120 * C);
    int it = item(k), base = imul(k, it, ic(k, C));
    int len = N % C == 0 ? ic(k, C) : e2(k, CG_IMIN, ic(k, C), e2(k, CG_ISUB, ic(k, N), base));
    for (int s = 0; s < A.n_states; s++) {
        Moment *x = &A.st[s];
        if (x->codec == CODEC_PLAIN) continue;
        x->local = cg_local(k, C, 0.0);
        if (x->group == C) {        /* the item's group: its side values once */
            x->p0 = side_at(k, x, it, 0);
            if (codec_params_per_group(x->codec) > 1) x->p1 = side_at(k, x, it, 1);
        }
    }
    int j = row_loop(k, ic(k, 0), len);
    int i = iadd(k, base, j);
    for (int s = 0; s < A.n_states; s++) {
        Moment *x = &A.st[s];
        int p0 = x->p0, p1 = x->p1;
        if (x->codec != CODEC_PLAIN && x->group != C) {
            int gi = e2(k, CG_IDIV, i, ic(k, x->group));
            p0 = side_at(k, x, gi, 0);
            if (codec_params_per_group(x->codec) > 1) p1 = side_at(k, x, gi, 1);
        }
        old[s] = moment_decode(k, x, i, p0, p1);
    }
    update_element(k, &A, i, old, now);
    for (int s = 0; s < A.n_states; s++) {
        if (A.st[s].codec == CODEC_PLAIN) cg_store(k, A.st[s].buf, i, now[s], NONE, NONE);
        else lset(k, A.st[s].local, j, now[s]);
    }
    end(k);
    for (int s = 0; s < A.n_states; s++) {
        Moment *x = &A.st[s];
        if (x->codec == CODEC_PLAIN) continue;
        if (x->group == C) {
            moment_encode(k, x, base, ic(k, 0), len, it);
            continue;
        }
        /* smaller groups: one after the other */
        int64_t G = x->group;
        int groups = N % C == 0 ? ic(k, C / G) : e2(k, CG_IDIV, iadd(k, len, ic(k, G - 1)), ic(k, G));
        int sg = seq_loop(k, ic(k, 0), groups);
        int lo = imul(k, sg, ic(k, G));
        int hi = e2(k, CG_IMIN, iadd(k, lo, ic(k, G)), len);
        moment_encode(k, x, base, lo, hi, iadd(k, imul(k, it, ic(k, C / G)), sg));
        end(k);
    }
}

/* The update (AdamW, Lion or SGD), then, where it writes the weights' FP8 copy (or at O3 their
 * amax alone), their amax for the next step's scale (in chunks, combined in order, as
 * AMAX_RECORD does). */
void lower_adamw(Lower *L, Node *n)
{
    lower_adamw_update(L, n);
    int at_amax = ir_update_amax_index(n);
    if (at_amax < 0) return;
    int chunks, amax;
    int part = chunk_partials(L, n, n->in[A_PARAM], false, &chunks);
    CgKernel *k = combine_partials(L, n, part, chunks, false, &amax);
    cg_store(k, cg_buf_tensor(k, n->in[at_amax], false, true), ic(k, 0), amax, NONE, NONE);
}
