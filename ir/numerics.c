/* numerics.c — exact conversions between f32 and the element types tensors are stored in.
 *
 * Every tensor the reference executor reads is decoded to f32 through its format and every
 * tensor it writes is rounded through it, so these functions decide what "the same result as
 * the GPU" means. They are written to agree bit for bit with CUDA's conversions on sm_90:
 *   bf16  __float2bfloat16_rn   (cvt.rn.bf16.f32)
 *   f16   __float2half_rn       (cvt.rn.f16.f32)
 *   e4m3  __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)  (cvt.rn.satfinite.e4m3x2.f32)
 *   e5m2  __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)  (cvt.rn.satfinite.e5m2x2.f32)
 * tests/gpu/fp8_convert_check.cu compares all 2^32 inputs on a GPU; tests/test_numerics.c
 * compares against independent reference encoders on the CPU.
 *
 * All four narrowings share one routine: round the magnitude to nearest, ties to even, in a
 * binary format with the target's mantissa width and exponent bias but no upper exponent
 * limit. Subnormal results fall out of the same shift (the shift just grows by the number of
 * binades below the smallest normal), and a carry out of the mantissa moves into the
 * exponent field by plain integer addition. What each format does with a magnitude beyond
 * its largest finite value is then one comparison:
 *   bf16, f16  the rounded code lands on the infinity code (IEEE overflow);
 *   e4m3       saturates to 448 (0x7E): the would-be next code 0x7F is NaN, so 464 ≤ |x| < 480
 *              (which rounds up to it) and ±inf saturate as well, exactly as CUDA's
 *              "maxnorm + 1/2 ulp" threshold does (464 itself ties to even, i.e. to 448);
 *   e5m2       saturates to 57344 (0x7B): |x| ≥ 61440 (rounding to the infinity code 0x7C)
 *              and ±inf.
 * NaN inputs give the canonical NaN of each format, without sign: bf16 0x7FFF, f16 0x7FFF,
 * e4m3 0x7F, e5m2 0x7F. That is what CUDA's own host implementations of these intrinsics
 * return (they canonicalize the input to 0x7FFFFFFF first), and what the GPU check verifies
 * for the hardware instructions. Signed zeros keep their sign; inputs below half the smallest
 * subnormal round to a zero of their sign.
 *
 * Decoding is exact: every code of every format is an f32 value. Integer element types (i8,
 * u8, i32) round to nearest even and clamp to their range; NaN becomes 0. */
#include <math.h>
#include <string.h>

#include "ir.h"

static uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Rounds the magnitude `abs` (f32 bits with the sign cleared; finite or inf, not NaN) to
 * nearest even in a format with `man_bits` stored mantissa bits and exponent bias `bias`, and
 * returns the code (exponent field << man_bits | mantissa). Codes above the format's largest
 * finite one are returned as they are; the caller decides between infinity and saturation. */
static uint32_t num_round_magnitude(uint32_t abs, int man_bits, int bias)
{
    int biased = (int)(abs >> 23);
    uint32_t m = abs & 0x7FFFFFu;
    if (biased) m |= 0x800000u;                    /* implicit bit of a normal f32 */
    else biased = 1;                               /* f32 subnormal: same scale as 2^-126 */
    int exp = biased - 127;                        /* |x| = m * 2^(exp - 23) */
    int below = (1 - bias) - exp;                  /* binades below the target's smallest normal */
    int shift = 23 - man_bits + (below > 0 ? below : 0);
    if (shift > 25) return 0;                      /* m < 2^24 <= half of the smallest step */
    /* For a normal result the implicit bit of m lands on bit man_bits and adds 1 to the
     * exponent field; the fields above it come from the binades above the smallest normal. */
    uint32_t q = (m >> shift) + (below < 0 ? (uint32_t)(-below) << man_bits : 0u);
    uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return q;
}

uint16_t num_f32_to_bf16(float x)
{
    uint32_t u = f32_bits(x), abs = u & 0x7FFFFFFFu;
    if (abs > 0x7F800000u) return 0x7FFF;
    /* inf and overflow both land on 0x7F80 by themselves */
    return (uint16_t)(((u >> 16) & 0x8000u) | num_round_magnitude(abs, 7, 127));
}

float num_bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

uint16_t num_f32_to_f16(float x)
{
    uint32_t u = f32_bits(x), abs = u & 0x7FFFFFFFu;
    if (abs > 0x7F800000u) return 0x7FFF;
    uint32_t q = abs == 0x7F800000u ? 0x7C00u : num_round_magnitude(abs, 10, 15);
    if (q > 0x7C00u) q = 0x7C00u;
    return (uint16_t)(((u >> 16) & 0x8000u) | q);
}

float num_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return f32_from_bits(sign | 0x7F800000u | (m ? 0x400000u | (m << 13) : 0u));
    if (e == 0) {
        float v = ldexpf((float)m, -24);
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

/* FP8 narrowing shared by both formats: `max_code` is the largest finite code. */
static uint8_t num_f32_to_fp8(float x, int man_bits, int bias, uint32_t max_code)
{
    uint32_t u = f32_bits(x), abs = u & 0x7FFFFFFFu;
    if (abs > 0x7F800000u) return 0x7F;
    uint32_t q = abs == 0x7F800000u ? max_code : num_round_magnitude(abs, man_bits, bias);
    if (q > max_code) q = max_code;
    return (uint8_t)(((u >> 24) & 0x80u) | q);
}

/* FP8 widening: exact. `ieee_top` says whether every code with the top exponent is inf or
 * NaN (e5m2) or only the all-ones mantissa there is NaN and the rest are finite (e4m3). */
static float num_fp8_to_f32(uint8_t q, int man_bits, int bias, bool ieee_top)
{
    uint32_t sign = (uint32_t)(q & 0x80u) << 24;
    uint32_t e = (q & 0x7Fu) >> man_bits, m = q & ((1u << man_bits) - 1u);
    uint32_t e_top = (0x7Fu >> man_bits);
    if (ieee_top && e == e_top) return f32_from_bits(sign | 0x7F800000u | (m ? 0x400000u : 0u));
    if (!ieee_top && e == e_top && m == (1u << man_bits) - 1u)
        return f32_from_bits(sign | 0x7FC00000u);
    if (e == 0) {
        float v = ldexpf((float)m, 1 - bias - man_bits);
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((e - (uint32_t)bias + 127u) << 23) | (m << (23 - man_bits)));
}

uint8_t num_f32_to_e4m3(float x) { return num_f32_to_fp8(x, 3, 7, 0x7E); }
float num_e4m3_to_f32(uint8_t q) { return num_fp8_to_f32(q, 3, 7, false); }
uint8_t num_f32_to_e5m2(float x) { return num_f32_to_fp8(x, 2, 15, 0x7B); }
float num_e5m2_to_f32(uint8_t q) { return num_fp8_to_f32(q, 2, 15, true); }

float num_elem_max(ElemType e)
{
    switch (e) {
    case FMT_F32: return 3.40282347e38f;
    case FMT_BF16: return num_bf16_to_f32(0x7F7F);
    case FMT_F16: return 65504.0f;
    case FMT_E4M3: return 448.0f;
    case FMT_E5M2: return 57344.0f;
    case FMT_I8: return 127.0f;
    case FMT_U8: return 255.0f;
    case FMT_I32: return 2147483647.0f;            /* as a float: 2^31 */
    case FMT_E8M0: return 1.7014118e38f;           /* 2^127 */
    case FMT_VOID:
    case FMT_COUNT: break;
    }
    return 0.0f;
}

/* Integer element types: round to nearest even (rintf in the default rounding mode, which
 * nothing in fp8c changes) after clamping to the type's range; NaN stores 0. */
/* E8M0 (OCP microscaling scales): a bare exponent, 2^(q - 127); 255 is NaN. Encoding keeps the
 * exponent of x, rounding down to a power of two (a scale rounded down never pushes a scaled
 * value past its format's maximum); x <= 0 gives the smallest scale, 2^-127. */
static uint8_t num_f32_to_e8m0(float x)
{
    if (x != x) return 255;
    if (!(x > 0)) return 0;
    if (x > 1.7014118e38f) return 254;          /* 2^127 and above */
    int e;
    frexpf(x, &e);                              /* x = m 2^e, m in [0.5, 1) */
    e -= 1;                                     /* floor(log2 x) */
    return (uint8_t)(e < -127 ? 0 : e + 127);
}

static float num_e8m0_to_f32(uint8_t q)
{
    return q == 255 ? NAN : ldexpf(1.0f, (int)q - 127);
}

static float num_round_int(float x, float lo, float hi)
{
    if (x != x) return 0.0f;
    if (x <= lo) return lo;
    if (x >= hi) return hi;
    return rintf(x);
}

static int32_t num_to_i32(float x)
{
    if (x != x) return 0;
    if (x >= 2147483648.0f) return INT32_MAX;
    if (x <= -2147483648.0f) return INT32_MIN;
    return (int32_t)rintf(x);
}

float num_round(ElemType e, float x)
{
    switch (e) {
    case FMT_F32: return x;
    case FMT_BF16: return num_bf16_to_f32(num_f32_to_bf16(x));
    case FMT_F16: return num_f16_to_f32(num_f32_to_f16(x));
    case FMT_E4M3: return num_e4m3_to_f32(num_f32_to_e4m3(x));
    case FMT_E5M2: return num_e5m2_to_f32(num_f32_to_e5m2(x));
    case FMT_I8: return num_round_int(x, -128.0f, 127.0f);
    case FMT_U8: return num_round_int(x, 0.0f, 255.0f);
    case FMT_I32: return (float)num_to_i32(x);
    case FMT_E8M0: return num_e8m0_to_f32(num_f32_to_e8m0(x));
    case FMT_VOID:
    case FMT_COUNT: break;
    }
    IR_ASSERT(!"num_round of an element type without values");
    return 0.0f;
}

void num_encode(ElemType e, const float *src, void *dst, int64_t n)
{
    switch (e) {
    case FMT_F32: memmove(dst, src, (size_t)n * sizeof(float)); return;
    case FMT_BF16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = num_f32_to_bf16(src[i]);
        return;
    }
    case FMT_F16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = num_f32_to_f16(src[i]);
        return;
    }
    case FMT_E4M3: {
        uint8_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = num_f32_to_e4m3(src[i]);
        return;
    }
    case FMT_E5M2: {
        uint8_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = num_f32_to_e5m2(src[i]);
        return;
    }
    case FMT_I8: {
        int8_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = (int8_t)num_round_int(src[i], -128.0f, 127.0f);
        return;
    }
    case FMT_U8: {
        uint8_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = (uint8_t)num_round_int(src[i], 0.0f, 255.0f);
        return;
    }
    case FMT_I32: {
        int32_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = num_to_i32(src[i]);
        return;
    }
    case FMT_E8M0: {
        uint8_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = num_f32_to_e8m0(src[i]);
        return;
    }
    case FMT_VOID:
    case FMT_COUNT: break;
    }
    IR_ASSERT(!"num_encode into an element type without values");
}

void num_decode(ElemType e, const void *src, float *dst, int64_t n)
{
    switch (e) {
    case FMT_F32: memmove(dst, src, (size_t)n * sizeof(float)); return;
    case FMT_BF16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = num_bf16_to_f32(s[i]);
        return;
    }
    case FMT_F16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = num_f16_to_f32(s[i]);
        return;
    }
    case FMT_E4M3: {
        const uint8_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = num_e4m3_to_f32(s[i]);
        return;
    }
    case FMT_E5M2: {
        const uint8_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = num_e5m2_to_f32(s[i]);
        return;
    }
    case FMT_I8: {
        const int8_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
        return;
    }
    case FMT_U8: {
        const uint8_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
        return;
    }
    case FMT_I32: {
        const int32_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
        return;
    }
    case FMT_E8M0: {
        const uint8_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = num_e8m0_to_f32(s[i]);
        return;
    }
    case FMT_VOID:
    case FMT_COUNT: break;
    }
    IR_ASSERT(!"num_decode from an element type without values");
}
