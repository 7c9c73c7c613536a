/* codecs.c — how 8-bit optimizer states and split master weights are encoded.
 *
 * Adam's m and v at O2/O3 are stored in one byte per element plus a few f32 side values per
 * group of consecutive elements (DESIGN.md §4). The plain way — e4m3 with a per-group absmax
 * scale — wastes most of FP8's range on these tensors: within a group, m spans a few binades
 * and FP8's 3 mantissa bits give the large values 6% steps, while values far below the group
 * max fall into subnormals or flush to zero. Each codec here reshapes the values before
 * rounding so that the 256 codes are spent where the state has mass:
 *
 *   CODEC_PLAIN    the baseline: e4m3(x * 448/amax) per group of 128.
 *   CODEC_EXPAND   COAT's dynamic range expansion, per group of 128: y = sign(x)|x/c|^k with
 *                  c = amax, and k chosen so that the group's range max|x|/min|x| (over
 *                  nonzero x) becomes e4m3's normal range 448/2^-6 = 28672; store e4m3(448 y).
 *                  A relative step δ of y is a step δ/k of x, so k > 1 sharpens every value,
 *                  and the smallest value still lands on a normal code instead of a subnormal
 *                  one.
 *   CODEC_COMPAND  FlashOptim's companding of m, per group of 32: y = x/amax, store
 *                  round(127 * 2y/(1+|y|)) in i8. The map doubles the resolution near zero
 *                  (where m has its mass) and halves it near ±1.
 *   CODEC_SQRT     FlashOptim's v, per group of 32: store round(255 * sqrt(v)/max sqrt(v)) in
 *                  u8. The square root halves v's dynamic range, so the Adam denominator
 *                  sqrt(v) itself is what gets uniform steps.
 *   CODEC_SPLIT    master weights as the bf16 weight the forward reads plus an i8 correction:
 *                  the rounding error w - bf16(w) in units of 2^-8 bf16 ulps.
 *
 * Side values are f32 (the Format.scale tensor is f32 everywhere in fp8c): at one or two per
 * 32 or 128 elements they cost 1/16 to 1/8 byte per element, and keeping them exact means the
 * group max is reproduced exactly and k need not be rounded in a way the decoder would have to
 * know about. The transforms are computed in double: this file is the reference the GPU
 * kernels are compared with, within a tolerance, not bit for bit.
 *
 * Non-finite state values are a diverged run, not something to preserve: NaN stays NaN, and an
 * infinity makes its group NaN. */
#include <math.h>
#include <string.h>

#include "ir.h"

#define EXPAND_GROUP 128
#define COMPAND_GROUP 32
#define SQRT_GROUP 32
#define PLAIN_GROUP 128

/* The e4m3 value the smallest nonzero magnitude of an expanded group maps to: the smallest
 * normal, 2^-6, not the smallest subnormal 2^-9. Filling the range down to 2^-9 gives a larger
 * k and so a ~14% smaller mean error, but puts the group's smallest values on subnormal codes
 * with one to three significant bits: the worst relative error grows from 8% to 26-34%
 * (docs/numerics.md). For v the smallest values make the largest Adam steps, so the bound
 * matters more than the mean. */
#define EXPAND_TARGET_MIN (1.0 / 64.0)
/* Beyond k = 16 a group's values are within a factor 1.9 of each other and the relative error
 * 2^-4/k is already below bf16's; the cap keeps pow() away from huge exponents. */
#define EXPAND_K_MAX 16.0

ElemType codec_elem(Codec c)
{
    switch (c) {
    case CODEC_PLAIN:
    case CODEC_EXPAND: return FMT_E4M3;
    case CODEC_COMPAND:
    case CODEC_SPLIT: return FMT_I8;
    case CODEC_SQRT: return FMT_U8;
    case CODEC_COUNT: break;
    }
    IR_ASSERT(!"codec_elem of no codec");
    return FMT_VOID;
}

int codec_group_size(Codec c)
{
    switch (c) {
    case CODEC_PLAIN: return PLAIN_GROUP;
    case CODEC_EXPAND: return EXPAND_GROUP;
    case CODEC_COMPAND: return COMPAND_GROUP;
    case CODEC_SQRT: return SQRT_GROUP;
    case CODEC_SPLIT: return 1;
    case CODEC_COUNT: break;
    }
    IR_ASSERT(!"codec_group_size of no codec");
    return 1;
}

int codec_params_per_group(Codec c)
{
    switch (c) {
    case CODEC_EXPAND: return 2;
    case CODEC_PLAIN:
    case CODEC_COMPAND:
    case CODEC_SQRT: return 1;
    case CODEC_SPLIT: return 0;
    case CODEC_COUNT: break;
    }
    IR_ASSERT(!"codec_params_per_group of no codec");
    return 0;
}

int64_t codec_param_count(Codec c, int64_t n)
{
    int64_t g = codec_group_size(c);
    return (n + g - 1) / g * codec_params_per_group(c);
}

static float codec_absmax(const float *x, int n)
{
    float m = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > m || a != a) m = a;                /* NaN wins: the group is broken anyway */
    }
    return m;
}

/* ---- PLAIN: q = e4m3(x * scale), scale = 448 / amax (the convention of Format) */

static void plain_encode(const float *x, uint8_t *q, float *p, int n)
{
    float amax = codec_absmax(x, n);
    float scale = amax == 0.0f ? 1.0f : 448.0f / amax;   /* inf/NaN amax: NaN results */
    p[0] = scale;
    for (int i = 0; i < n; i++) q[i] = num_f32_to_e4m3(x[i] * scale);
}

static void plain_decode(const uint8_t *q, const float *p, float *x, int n)
{
    for (int i = 0; i < n; i++) x[i] = num_e4m3_to_f32(q[i]) / p[0];
}

/* ---- EXPAND: p = {c, k}, q = e4m3(448 sign(x) |x/c|^k) */

static void expand_encode(const float *x, uint8_t *q, float *p, int n)
{
    double c = codec_absmax(x, n), lo = INFINITY;
    for (int i = 0; i < n; i++) {
        double a = fabs((double)x[i]);
        if (a > 0.0 && a < lo) lo = a;
    }
    double k = 1.0;
    if (c > 0.0 && c / lo > 1.0) k = log(448.0 / EXPAND_TARGET_MIN) / log(c / lo);
    if (k > EXPAND_K_MAX) k = EXPAND_K_MAX;
    p[0] = (float)c;
    p[1] = (float)k;
    /* Encode with the stored (rounded) c and k, so that the decoder inverts exactly this map. */
    c = p[0];
    k = p[1];
    for (int i = 0; i < n; i++) {
        double y = c > 0.0 && isfinite(c) ? 448.0 * pow(fabs((double)x[i]) / c, k) : 0.0;
        q[i] = num_f32_to_e4m3((float)(signbit(x[i]) ? -y : y));
    }
}

static void expand_decode(const uint8_t *q, const float *p, float *x, int n)
{
    double c = p[0], inv_k = 1.0 / p[1];
    for (int i = 0; i < n; i++) {
        double d = num_e4m3_to_f32(q[i]);
        double a = c * pow(fabs(d) / 448.0, inv_k);
        x[i] = (float)(signbit(d) ? -a : a);
    }
}

/* ---- COMPAND: p = amax, q = round(127 * 2y / (1 + |y|)), y = x / amax */

static void compand_encode(const float *x, int8_t *q, float *p, int n)
{
    double a = codec_absmax(x, n);
    p[0] = (float)a;
    for (int i = 0; i < n; i++) {
        double y = a > 0.0 && isfinite(a) ? x[i] / a : 0.0;
        q[i] = (int8_t)rint(127.0 * (2.0 * y / (1.0 + fabs(y))));
    }
}

static void compand_decode(const int8_t *q, const float *p, float *x, int n)
{
    for (int i = 0; i < n; i++) {
        double z = q[i] / 127.0;
        x[i] = (float)(p[0] * (z / (2.0 - fabs(z))));
    }
}

/* ---- SQRT: p = max sqrt(v), q = round(255 * 2y/(1+y)), y = sqrt(v) / p
 *
 * Two changes from FlashOptim's linear u8 of sqrt(v)/p, both measured on the error of the Adam
 * step factor 1/(sqrt(v)+eps) (tests/test_numerics.c, docs/numerics.md):
 * - y is companded like m: v's mass sits far below its group max, where companding doubles
 *   the resolution (mean step error 0.0029 against 0.0035 for a smooth v, worst 0.026 against
 *   0.059);
 * - a positive v never decodes to 0. A flushed v turns the step m/(sqrt(v)+eps) into m/eps: on
 *   an m^2-like v, 0.5% of elements flush and the mean step error is 12 (the linear code: 0.9%
 *   and 46). The smallest positive v take code 1 instead, decoding to about p/509 — an
 *   overestimate that only damps their step (error below 1) — and the mean falls to 0.016. */

static void sqrt_encode(const float *v, uint8_t *q, float *p, int n)
{
    double a = 0.0;
    for (int i = 0; i < n; i++) {
        double s = v[i] > 0.0f ? sqrt((double)v[i]) : v[i] != v[i] ? NAN : 0.0;
        if (s > a || s != s) a = s;
    }
    p[0] = (float)a;
    a = p[0];
    for (int i = 0; i < n; i++) {
        double y = a > 0.0 && isfinite(a) && v[i] > 0.0f ? sqrt((double)v[i]) / a : 0.0;
        double r = rint(255.0 * (2.0 * y / (1.0 + y)));
        q[i] = (uint8_t)(r < 1.0 && y > 0.0 ? 1.0 : r);
    }
}

static void sqrt_decode(const uint8_t *q, const float *p, float *v, int n)
{
    for (int i = 0; i < n; i++) {
        double z = q[i] / 255.0;
        double s = z / (2.0 - z) * p[0];
        v[i] = (float)(s * s);
    }
}

void codec_encode(Codec c, const float *src, void *dst, float *params, int64_t n)
{
    int g = codec_group_size(c), np = codec_params_per_group(c);
    for (int64_t i = 0; i < n; i += g) {
        int len = n - i < g ? (int)(n - i) : g;
        float *p = params + i / g * np;
        switch (c) {
        case CODEC_PLAIN: plain_encode(src + i, (uint8_t *)dst + i, p, len); break;
        case CODEC_EXPAND: expand_encode(src + i, (uint8_t *)dst + i, p, len); break;
        case CODEC_COMPAND: compand_encode(src + i, (int8_t *)dst + i, p, len); break;
        case CODEC_SQRT: sqrt_encode(src + i, (uint8_t *)dst + i, p, len); break;
        case CODEC_SPLIT:
        case CODEC_COUNT: IR_ASSERT(!"codec_encode: CODEC_SPLIT goes through codec_split_encode");
        }
    }
}

void codec_decode(Codec c, const void *src, const float *params, float *dst, int64_t n)
{
    int g = codec_group_size(c), np = codec_params_per_group(c);
    for (int64_t i = 0; i < n; i += g) {
        int len = n - i < g ? (int)(n - i) : g;
        const float *p = params + i / g * np;
        switch (c) {
        case CODEC_PLAIN: plain_decode((const uint8_t *)src + i, p, dst + i, len); break;
        case CODEC_EXPAND: expand_decode((const uint8_t *)src + i, p, dst + i, len); break;
        case CODEC_COMPAND: compand_decode((const int8_t *)src + i, p, dst + i, len); break;
        case CODEC_SQRT: sqrt_decode((const uint8_t *)src + i, p, dst + i, len); break;
        case CODEC_SPLIT:
        case CODEC_COUNT: IR_ASSERT(!"codec_decode: CODEC_SPLIT goes through codec_split_decode");
        }
    }
}

/* ---- SPLIT: w = hi + lo * ulp(hi) / 256
 *
 * hi = bf16(w) rounded to nearest even, so |w - hi| <= ulp(hi)/2 and the error in units of
 * ulp/256 rounds into [-128, 128]. The +128 end (errors within 1/512 ulp of +ulp/2, exact ties
 * rounded down to an even hi among them: about 0.2% of weights) is clamped to 127. The scale
 * is a power of two on purpose: w - hi is exact in f32 (Sterbenz), scaling it is exact, and
 * hi + lo*ulp/256 needs 16 significant bits, so decoding is exact in f32 and any GPU kernel
 * reconstructs the same bits with or without FMA. Since ulp(hi)/|hi| <= 2^-7, the decoded
 * weight is within 2^-7 * 2^-9 = 2^-16 of w relative, and within 2^-15 where lo was clamped.
 * (A scale of 254 would avoid the clamp but make decoding inexact for 2^-16.0 instead.) */

static int split_ulp_exp(uint16_t hi)                /* ulp(hi) = 2^split_ulp_exp(hi) */
{
    int biased = (hi >> 7) & 0xFF;
    return (biased ? biased : 1) - 127 - 7;
}

void codec_split_encode(const float *w, uint16_t *hi, int8_t *lo, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint16_t h = num_f32_to_bf16(w[i]);
        float hf = num_bf16_to_f32(h);
        hi[i] = h;
        if (!isfinite(hf)) {
            lo[i] = 0;
            continue;
        }
        float r = rintf(ldexpf(w[i] - hf, 8 - split_ulp_exp(h)));
        lo[i] = (int8_t)(r > 127.0f ? 127.0f : r < -128.0f ? -128.0f : r);
    }
}

void codec_split_decode(const uint16_t *hi, const int8_t *lo, float *w, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        w[i] = num_bf16_to_f32(hi[i]) + ldexpf((float)lo[i], split_ulp_exp(hi[i]) - 8);
}
