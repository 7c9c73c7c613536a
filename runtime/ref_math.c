/* ref_math.c — the elementary functions of the reference executor.
 *
 * One exp, for arguments <= 0, serves attention's softmax (exp(s - max)), tanh in GELU
 * (via exp(-2|u|)) and the sigmoid in SiLU (via exp(-|x|)). These take one exp per element of
 * the largest tensors in a step, and libm's exp, expm1f and tanhf, called once per element,
 * were a third of attention's time and most of GELU's. This one runs four lanes at a time and
 * is accurate to 1 ulp in f64 (checked against libm's exp over [-110, 0]); it also gives the
 * same bits on every machine and libm version, which a reference should.
 *
 * Method: Cody-Waite reduction x = k ln2 + r with k from the 1.5 * 2^52 rounding trick, a
 * Taylor polynomial of degree 13 on |r| <= ln2 / 2 (truncation below 1e-17), and 2^k put
 * together from its bits. Below -110, the result is returned as 0: every use divides it by a
 * sum of at least 1 or adds it to 1, where e^-110 is far below f32 resolution. */
#include "ref_internal.h"

#include <string.h>

typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4i __attribute__((vector_size(32)));

/* xs[0..8) = exp(xs[0..8)): two vectors at a time, so that their Horner chains overlap */
static inline __attribute__((always_inline)) void exp8_nonpositive(double *xs)
{
    const double shifter = 6755399441055744.0;          /* 1.5 * 2^52 */
    const v4d lo = {-110.0, -110.0, -110.0, -110.0}, sh = {shifter, shifter, shifter, shifter};
    v4d x[2], t[2], r[2], p[2];
    v4i tiny[2];
    memcpy(x, xs, sizeof x);
#pragma GCC unroll 2
    for (int u = 0; u < 2; u++) {
        tiny[u] = x[u] < lo;
        x[u] = (v4d)(((v4i)x[u] & ~tiny[u]) | ((v4i)lo & tiny[u]));
        t[u] = x[u] * 1.4426950408889634 + shifter;
        v4d k = t[u] - shifter;
        r[u] = (x[u] - k * 0.6931471803691238) - k * 1.9082149292705877e-10;
        p[u] = r[u] * (1.0 / 6227020800.0) + 1.0 / 479001600.0;
    }
    static const double coef[12] = {1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                                     1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                                     1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++)
#pragma GCC unroll 2
        for (int u = 0; u < 2; u++) p[u] = p[u] * r[u] + coef[i];
#pragma GCC unroll 2
    for (int u = 0; u < 2; u++) {
        v4i kbits = (v4i)t[u] - (v4i)sh;
        v4d scale = (v4d)((kbits + 1023) << 52);
        x[u] = (v4d)((v4i)(p[u] * scale) & ~tiny[u]);
    }
    memcpy(xs, x, sizeof x);
}

/* The AVX2 clone runs the same operations four lanes wide. AVX2 alone brings no FMA, so no
 * multiply-add is contracted and both clones give the same bits. NaN stays NaN. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void ref_exp_nonpositive(double *x, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) exp8_nonpositive(x + j);
    if (j < n) {
        double v[8] = {0};
        memcpy(v, x + j, sizeof(double) * (size_t)(n - j));
        exp8_nonpositive(v);
        memcpy(x + j, v, sizeof(double) * (size_t)(n - j));
    }
}
