/* coded_check.h — optimizer states in 8-bit codecs compared with the reference's.
 *
 * The kernels of both backends (the CPU's LLVM kernels and the GPU's library) compute the
 * codecs of ir/codecs.c in f32, where codecs.c computes them in f64: the side values that are a
 * group's maximum agree bit for bit, k agrees to a few f32 ulps, and a code can land one step
 * from the reference's where the two straddle a rounding point of the code. A group whose side
 * values moved (a k from a smallest element that cancelled) is encoded with another exponent
 * and compares only decoded. These are the bounds both test suites hold the kernels to. Needs
 * cmocka.h, math.h, stdlib.h and ir.h before it. */
#ifndef FP8C_TESTS_CODED_CHECK_H
#define FP8C_TESTS_CODED_CHECK_H

typedef struct {
    double c, k;            /* side values that agree: a group's maximum, and k; relative */
    double moved;           /* fraction of groups whose side values do not */
    double off;             /* fraction of codes one step off (in groups that agree) */
    double group_err;       /* normalized error of a group's decoded values */
} CodedBounds;

/* one update step of f32 codecs against codecs.c's f64, from the same states */
static const CodedBounds CODED_STEP_BOUNDS = {1e-5, 1e-4, 0.05, 0.01, 0.1};

typedef struct {
    int64_t codes, off, groups, moved;
    double c, k, err;       /* largest relative side differences, normalized error */
} CodedStats;

/* ||a - b|| / ||b|| over decoded values, NaN where only one is NaN */
static inline double norm_error(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i]) != isnan(b[i])) return NAN;
        if (isnan(a[i]) || (isinf(a[i]) && a[i] == b[i])) continue;
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The position of a sign-magnitude code in value order (both zeros at 0). */
static inline int64_t sm_order(uint32_t code, int bits)
{
    uint32_t mag = code & ((1u << (bits - 1)) - 1);
    return code >> (bits - 1) & 1 ? -(int64_t)mag : (int64_t)mag;
}

/* How many code steps apart element i of two arrays of codes of type e is. */
static inline int64_t code_steps(ElemType e, const void *a, const void *b, int64_t i)
{
    switch (e) {
    case FMT_E4M3: return llabs(sm_order(((const uint8_t *)a)[i], 8) - sm_order(((const uint8_t *)b)[i], 8));
    case FMT_I8: return llabs((int64_t)((const int8_t *)a)[i] - ((const int8_t *)b)[i]);
    case FMT_U8: return llabs((int64_t)((const uint8_t *)a)[i] - ((const uint8_t *)b)[i]);
    default: IR_ASSERT(!"code_steps: not a code type");
    }
    return 0;
}

/* A coded tensor t: the kernel's codes cq and side values cs against the reference's rq, rs.
 * Group by group: where the side values agree, the codes are at most one step apart; a group
 * whose side values do not (a k from a smallest element that the f32 step computed with
 * cancellation) is encoded with a different exponent, and only its decoded values compare. */
static inline void coded_check(const char *what, const Tensor *t, const void *cq, const float *cs,
                               const void *rq, const float *rs, const CodedBounds *b, CodedStats *st)
{
    Codec codec = t->fmt.codec;
    int64_t n = ir_numel(t), G = codec_group_size(codec), groups = (n + G - 1) / G, off = 0, moved = 0;
    int per = codec_params_per_group(codec);
    float *c = malloc(sizeof(float) * (size_t)n), *r = malloc(sizeof(float) * (size_t)n);
    codec_decode(codec, cq, cs, c, n);
    codec_decode(codec, rq, rs, r, n);
    for (int64_t gi = 0; gi < groups; gi++) {
        int64_t lo = gi * G, hi = lo + G < n ? lo + G : n;
        bool agree = true;
        for (int j = 0; j < per; j++) {
            float x = cs[gi * per + j], y = rs[gi * per + j];
            bool is_k = j == 1;
            double d = x == y || (isnan(x) && isnan(y)) ? 0 : fabs((double)x - y) / fabs(y);
            if (is_k) st->k = fmax(st->k, d);
            else st->c = fmax(st->c, d);
            agree &= d <= (is_k ? b->k : b->c);
        }
        moved += !agree;
        for (int64_t i = lo; agree && i < hi; i++) {
            int64_t d = code_steps(t->fmt.elem, cq, rq, i);
            if (d > 1)
                fail_msg("%s[%lld]: code %lld steps from the reference's (group %lld: %.9g %.9g, reference "
                         "%.9g %.9g)", what, (long long)i, (long long)d, (long long)gi, cs[gi * per],
                         cs[gi * per + per - 1], rs[gi * per], rs[gi * per + per - 1]);
            off += d;
        }
        double ge = norm_error(c + lo, r + lo, hi - lo);
        if (!(ge <= b->group_err))
            fail_msg("%s: group %lld decoded: normalized error %.3g", what, (long long)gi, ge);
    }
    if (moved > (b->moved > 0 ? 2 : 0) + (int64_t)(b->moved * (double)groups))
        fail_msg("%s: side values of %lld of %lld groups differ", what, (long long)moved, (long long)groups);
    if (off > 4 + (int64_t)(b->off * (double)n))
        fail_msg("%s: %lld of %lld codes one step off", what, (long long)off, (long long)n);
    st->err = fmax(st->err, norm_error(c, r, n));
    st->codes += n;
    st->off += off;
    st->groups += groups;
    st->moved += moved;
    free(c);
    free(r);
}
#endif
