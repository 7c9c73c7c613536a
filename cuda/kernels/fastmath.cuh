/* fastmath.cuh — the correctly rounded square root and division without their branches, for
 * kernels that take many of them per thread (the coded optimizer updates, optim.cuh).
 *
 * NVRTC compiles sqrtf and the f32 division to a fast path (a hardware approximation, a Newton
 * step, a correction by a fused multiply-add) behind a range check and a branch to a slow path
 * for operands near the ends of the f32 range. The fast path alone is the operation wherever
 * its operands are in range; these functions take it without the check, or with a check that
 * costs no branch, and the tests hold them to the bits of sqrtf and of the division
 * (tests/gpu/fastmath_check.cu, on a GPU: every f32 square root, every pair of significands of
 * the divisions). Self-contained, so that the check includes it as the kernels do. */

/* a / d for 1 <= d <= 2 and |a| <= 2: the IEEE division's own fast path (the hardware's
 * reciprocal, one Newton step, the quotient corrected by a fused multiply-add), which rounds as
 * the division does for such operands down to |a| = 2^-100 (below, the quotient loses its last
 * bits, and every code it feeds is zero); without the range check and slow path that the
 * division adds for operands near the ends of the f32 range */
static __device__ __forceinline__ float ck_div_unit(float a, float d) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    r = fmaf(r, fmaf(-d, r, 1.0f), r);
    float q = a * r;
    return fmaf(fmaf(-d, q, a), r, q);
}

/* x / c for the values of a group over its one divisor c, given rc = ck_recip(c): a product
 * and its correction by a fused multiply-add (ck_div_unit's last steps), which round as the
 * division does while c and |x| are at least 2^-100, c at most 2^100 and the quotient at least
 * 2^-125, so that the residual and the quotient are normal numbers (Markstein's theorem for a
 * correctly rounded 1 / c); the division itself elsewhere (rc = 0 says so for the whole group).
 * A subnormal quotient is rounded at a fixed place, where the correction can miss: 4 of 2^32
 * random pairs did (0x1.00005p-35 / 0x1.8p+96) before the quotient's bound was checked */
static __device__ __forceinline__ float ck_recip(float c) {
    return c >= 0x1p-100f && c <= 0x1p100f ? 1.0f / c : 0.0f;
}
static __device__ __forceinline__ bool ck_div_by_ok(float x, float q) {
    return (fabsf(x) >= 0x1p-100f) & (fabsf(q) >= 0x1p-125f);
}
static __device__ __forceinline__ float ck_div_by(float x, float c, float rc) {
    float q = x * rc;
    if (rc == 0.0f || !ck_div_by_ok(x, q)) return x / c;
    return fmaf(fmaf(-c, q, x), rc, q);
}

/* ---------------------------------------------------------------- eight at a time
 * A lane's eight square roots or divisions take the fast path, straight, and each checks its
 * operands' range into one flag, bitwise, so that the checks do not become branches of their
 * own; only a lane whose flag is down (an operand out of range: a subnormal, an infinity, a NaN,
 * a negative root) computes its eight again with the exact operations. In the coded AdamW the
 * per-operation checks, branches and reconvergence points were some 400 of the 2,300
 * instructions of its loop (SASS of GPT-2 d12 -O3's update). A zero takes neither path: x / c
 * and sqrt(x) are then x, its sign kept, which the fast paths would lose. */

/* sqrtf(x) where x is 0 or a normal number >= 2^-101 (else ok drops): the reciprocal square
 * root, the root x r and its residual, one correction, as the square root's fast path does */
static __device__ __forceinline__ float ck_sqrt_fast(float x, bool &ok) {
    float r, s, h;
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    asm("mul.ftz.f32 %0, %1, %2;" : "=f"(s) : "f"(x), "f"(r));
    asm("mul.ftz.f32 %0, %1, 0f3F000000;" : "=f"(h) : "f"(r));
    float y = fmaf(fmaf(-s, s, x), h, s);
    ok &= (x == 0.0f) | (__float_as_uint(x) - 0x0d000000u <= 0x727fffffu);
    return x == 0.0f ? x : y;
}

/* a / b where a is 0 or 2^-60 <= |a| <= 2^60, and 2^-60 <= b <= 2^60 (else ok drops): then the
 * quotient, the reciprocal and the residual are normal numbers and the sequence of ck_div_unit
 * rounds as the division does */
static __device__ __forceinline__ bool ck_in_pow2_range(float x, unsigned lo_bits, unsigned hi_bits) {
    return (__float_as_uint(x) & 0x7fffffffu) - lo_bits <= hi_bits - lo_bits;
}
static __device__ __forceinline__ float ck_div_fast(float a, float b, bool &ok) {
    ok &= ((a == 0.0f) | ck_in_pow2_range(a, 0x21800000u, 0x5d800000u)) & (b > 0.0f) &
          ck_in_pow2_range(b, 0x21800000u, 0x5d800000u);
    return a == 0.0f ? a : ck_div_unit(a, b);
}

/* y = sqrtf(x), eight of them */
static __device__ __forceinline__ void ck_sqrt8(const float *x, float *y) {
    bool ok = true;
    #pragma unroll
    for (int j = 0; j < 8; j++) y[j] = ck_sqrt_fast(x[j], ok);
    if (!ok) {
        #pragma unroll
        for (int j = 0; j < 8; j++) y[j] = sqrtf(x[j]);
    }
}

/* q = a / b, eight of them */
static __device__ __forceinline__ void ck_div8(const float *a, const float *b, float *q) {
    bool ok = true;
    #pragma unroll
    for (int j = 0; j < 8; j++) q[j] = ck_div_fast(a[j], b[j], ok);
    if (!ok) {
        #pragma unroll
        for (int j = 0; j < 8; j++) q[j] = a[j] / b[j];
    }
}

/* y = x / c (0 where the group is not finite), c a group's divisor and rc = ck_recip(c), eight
 * of a group's values: ck_div_by without its branch each */
static __device__ __forceinline__ void ck_div_by8(const float *x, float c, float rc, bool finite, float *y) {
    if (!finite) {
        #pragma unroll
        for (int j = 0; j < 8; j++) y[j] = 0.0f;
        return;
    }
    bool ok = rc != 0.0f;
    #pragma unroll
    for (int j = 0; j < 8; j++) {
        float q = x[j] * rc, r = fmaf(fmaf(-c, q, x[j]), rc, q);
        y[j] = x[j] == 0.0f ? x[j] : r;
        ok &= (x[j] == 0.0f) | ck_div_by_ok(x[j], q);
    }
    if (!ok) {
        #pragma unroll
        for (int j = 0; j < 8; j++) y[j] = ck_div_by(x[j], c, rc);
    }
}

/* ---------------------------------------------------------------- a group's scale
 * max / m rounded to f32, for a group's largest |x|, m, and the largest value max of the copy's
 * format: what prelude.cuh's ck_scale_for computes at margin 0 in f64 and rounds to f32, a
 * division and an ldexp in f64 (some thirty instructions) where a writer of 1 x 16 groups needs
 * one every 16 elements. f32's own correctly rounded quotient is the same bits for max an f32
 * (e4m3's 448, e5m2's 57344): a quotient of two 24-bit numbers rounded to 53 bits and then to 24
 * rounds as if once (53 >= 2 x 24 + 2), overflow to infinity included; fastmath_check.cu checks
 * every positive f32 m against the f64 expression. */
static __device__ __forceinline__ float ck_group_quotient(float max, float m) { return __fdiv_rn(max, m); }
