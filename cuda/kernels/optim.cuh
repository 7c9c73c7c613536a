/* optim.cuh — the optimizer updates whose states are coded or whose rule is not AdamW's:
 * AdamW with m and v in the state codecs of ir/codecs.c (O2's range expansion, O3's companding,
 * the split master), Lion and SGD with momentum.
 *
 * Each update is one elementwise pass over a parameter, its gradient and its states (ops.cuh's
 * elementwise shape, the optimizer scalars of ops.cuh: the bias corrections, the clip scale,
 * the finite check); what sets these apart is the coded states' groups, whose statistics are
 * shuffles among the lanes that hold a group. Included after ops.cuh. */

/* ---------------------------------------------------------------- AdamW with coded states
 * Adam's m and v at O2/O3 are stored through the optimizer-state codecs of ir/codecs.c: per
 * group of consecutive elements (128 for range expansion, 32 for companding), one byte per
 * element and f32 side values (in the tensor's scale array) that depend on the whole group.
 * A warp takes 256 elements, eight consecutive ones a lane, so that every tensor moves in wide
 * loads and stores (8 codes, 8 bf16 values) and a group is a few neighbouring lanes: a 128-group
 * is a half warp, a 32-group four lanes. The group statistics are shuffles among those lanes,
 * with no shared memory and no second pass. The master weight may be split (bf16 weight + i8
 * rounding error).
 *
 * Everything is computed in f32: the codecs as the kernel IR's AdamW computes them
 * (codegen/lower_kernels.c, moment_decode and moment_encode, term for term, with the powers of
 * range expansion through the special-function unit), and the update. codecs.c and ref_adamw
 * compute in f64 and are the reference this is bounded against, not matched bit for bit: the
 * side values that are a group's maximum come out bit for bit (sqrtf is correctly rounded, and
 * the f32 square root of an f32 equals the f64 one rounded), k within a few f32 ulps, and a code
 * lands one step from the reference's only where the two straddle a rounding point
 * (tests/gpu/test_gpu_ops.c states the bounds). In f64, with a warp per 128 elements and a byte
 * a lane per access, the update of GPT-2 d12's states took 5.2 ms at -O3 on an H200. */

#define CK_EXPAND_RANGE 28672.0f   /* e4m3's normal range, 448 / 2^-6 */
#define CK_EXPAND_K_MAX 16.0f
#define CK_CODED_CHUNK 256         /* elements a warp takes at a time */

/* y^e for y >= 0, e > 0 (0 at y = 0) through the special-function unit: lg2.approx, then
 * exp2 of the product, within a few ulps of f32 (about 1e-6 relative where e log2 y reaches
 * -10, the smallest a range-expanded element gets), a sixtieth of an e4m3 step */
static __device__ __forceinline__ float ck_pow_fast(float y, float e) { return exp2f(e * __log2f(y)); }

/* NaN wins (codec_absmax) */
static __device__ __forceinline__ float ck_absmax_nan(float m, float a) { return (a > m || a != a) ? a : m; }

/* reductions over the LANES neighbouring lanes of one group (LANES a power of two) */
template <int LANES> static __device__ __forceinline__ float ck_lanes_absmax_nan(float m) {
    for (int o = LANES / 2; o > 0; o >>= 1) m = ck_absmax_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}
template <int LANES> static __device__ __forceinline__ float ck_lanes_min(float m) {
    for (int o = LANES / 2; o > 0; o >>= 1) m = fminf(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

/* 2^e, e in [-126, 127], from its bits */
static __device__ __forceinline__ float ck_pow2i(int e) { return __int_as_float((e + 127) << 23); }

/* a split master's unit ulp(hi) / 256 = 2^(b - 142), b the biased exponent of bf16 hi (1 for
 * zero and subnormals), from 2^-141 to 2^113: a product of two normal powers of two (exact, as
 * codecs.c's ldexpf); and x / unit, x times 2^(142 - b) in two exact steps */
static __device__ __forceinline__ int ck_split_b(unsigned short hi) {
    int b = (hi >> 7) & 0xFF;
    return b ? b : 1;
}
static __device__ __forceinline__ float ck_split_unit(int b) { return ck_pow2i(b / 2 - 71) * ck_pow2i(b - b / 2 - 71); }
static __device__ __forceinline__ float ck_split_per_unit(float x, int b) {
    return x * ck_pow2i(71 - b / 2) * ck_pow2i(71 - (b - b / 2));
}

/* 8 raw bytes at element i (a multiple of 8) of t's storage: one load where full, else the
 * bytes of elements < n (0 beyond) */
static __device__ __forceinline__ void ck_ld8_bytes(const CkTensor &t, i64 i, i64 n, bool full, unsigned char *b) {
    if (full) {
        CkRaw<8> r = ((const CkRaw<8> *)t.p)[i / 8];
        #pragma unroll
        for (int j = 0; j < 8; j++) b[j] = r.b[j];
        return;
    }
    #pragma unroll
    for (int j = 0; j < 8; j++) b[j] = i + j < n ? ((const unsigned char *)t.p)[i + j] : 0;
}
static __device__ __forceinline__ void ck_st8_bytes(const CkTensor &t, i64 i, i64 n, bool full, const unsigned char *b) {
    if (full) {
        CkRaw<8> r;
        #pragma unroll
        for (int j = 0; j < 8; j++) r.b[j] = b[j];
        ((CkRaw<8> *)t.p)[i / 8] = r;
        return;
    }
    #pragma unroll
    for (int j = 0; j < 8; j++)
        if (i + j < n) ((unsigned char *)t.p)[i + j] = b[j];
}

/* the 8 elements at i of a state (format X, or coded by C), those < n (0 beyond) */
template <int C, class X> static __device__ __forceinline__ void ck_state_ld8(const CkTensor &t, i64 i, i64 n,
                                                                               bool full, float *x) {
    if (C == CODEC_PLAIN) {
        if (full && X::vec_ok(t)) {
            X::ld_vec(t, i, x);
            return;
        }
        #pragma unroll
        for (int j = 0; j < 8; j++) x[j] = i + j < n ? X::ld(t, i + j) : 0.0f;
        return;
    }
    unsigned char q[8];
    ck_ld8_bytes(t, i, n, full, q);
    if (i >= n) {   /* a lane past the end: nothing to decode (its side values do not exist) */
        #pragma unroll
        for (int j = 0; j < 8; j++) x[j] = 0.0f;
        return;
    }
    const float *p = (const float *)t.s;
    if (C == CODEC_EXPAND) {   /* sign(d) c (|d| / 448)^(1/k) */
        float c = p[(i / 128) * 2], inv_k = 1.0f / p[(i / 128) * 2 + 1];
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            float d = Elem<FMT_E4M3>::ld(q, j);
            float a = c * ck_pow_fast(fabsf(d) / 448.0f, inv_k);
            x[j] = signbit(d) ? -a : a;
        }
    } else if (C == CODEC_COMPAND) {   /* amax z / (2 - |z|), z = q / 127 */
        float c = p[i / 32];
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            float z = (float)(signed char)q[j];
            x[j] = c * (z / (254.0f - fabsf(z)));
        }
    } else {   /* CODEC_SQRT: (p z / (2 - z))^2, z = q / 255 */
        float c = p[i / 32];
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            float z = (float)q[j], r = z / (510.0f - z) * c;
            x[j] = r * r;
        }
    }
}

/* stores the 8 new values x at i of a state (format X, or encoded by C: the group's statistics
 * over its lanes, its side values by its first lane, then the codes), those < n; every lane of
 * the warp calls it */
template <int C, class X> static __device__ __forceinline__ void ck_state_st8(const CkTensor &t, i64 i, i64 n,
                                                                               bool full, const float *x) {
    if (C == CODEC_PLAIN) {
        if (full && X::vec_ok(t)) {
            X::st_vec(t, i, x);
            return;
        }
        #pragma unroll
        for (int j = 0; j < 8; j++)
            if (i + j < n) X::st(t, i + j, x[j]);
        return;
    }
    int lane = threadIdx.x & 31;
    float *p = (float *)t.s;
    unsigned char q[8];
    if (C == CODEC_EXPAND) {   /* groups of 128: 16 lanes */
        float m = 0.0f, lo = CK_INF;
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            if (i + j >= n) continue;
            float a = fabsf(x[j]);
            m = ck_absmax_nan(m, a);
            if (a > 0.0f && a < lo) lo = a;
        }
        float c = ck_lanes_absmax_nan<16>(m);
        lo = ck_lanes_min<16>(lo);
        /* k = log(28672) / log(c / lo) when c > 0 and c / lo > 1, else 1; at most 16 */
        float ratio = c / lo, k = 1.0f;
        if (c > 0.0f && ratio > 1.0f) k = logf(CK_EXPAND_RANGE) / logf(ratio);
        k = fminf(k, CK_EXPAND_K_MAX);
        if (lane % 16 == 0 && i < n) {
            p[(i / 128) * 2] = c;
            p[(i / 128) * 2 + 1] = k;
        }
        bool finite = c > 0.0f && c < CK_INF;
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            float y = finite ? 448.0f * ck_pow_fast(fabsf(x[j]) / c, k) : 0.0f;
            Elem<FMT_E4M3>::st(q, j, signbit(x[j]) ? -y : y);
        }
    } else if (C == CODEC_COMPAND) {   /* groups of 32, 4 lanes: round(127 2y / (1 + |y|)), y = x / amax */
        float m = 0.0f;
        #pragma unroll
        for (int j = 0; j < 8; j++)
            if (i + j < n) m = ck_absmax_nan(m, fabsf(x[j]));
        float c = ck_lanes_absmax_nan<4>(m);
        if (lane % 4 == 0 && i < n) p[i / 32] = c;
        bool finite = c > 0.0f && c < CK_INF;
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            float y = finite ? x[j] / c : 0.0f;
            q[j] = (unsigned char)(signed char)rintf(127.0f * (2.0f * y / (1.0f + fabsf(y))));
        }
    } else {   /* CODEC_SQRT, groups of 32, 4 lanes: round(255 2y / (1 + y)), y = sqrt(v) / max sqrt(v); v > 0: >= 1 */
        float m = 0.0f;
        #pragma unroll
        for (int j = 0; j < 8; j++)
            if (i + j < n) m = ck_absmax_nan(m, x[j] > 0.0f ? sqrtf(x[j]) : x[j] != x[j] ? CK_NAN : 0.0f);
        float c = ck_lanes_absmax_nan<4>(m);
        if (lane % 4 == 0 && i < n) p[i / 32] = c;
        bool finite = c > 0.0f && c < CK_INF;
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            bool pos = finite && x[j] > 0.0f;
            float y = pos ? sqrtf(x[j]) / c : 0.0f;
            float r = 255.0f * (2.0f * y / (1.0f + y));
            /* rint(r) < 1 exactly when r <= 0.5 (the tie rounds to the even 0) */
            q[j] = (unsigned char)(pos && r <= 0.5f ? 1.0f : rintf(r));
        }
    }
    ck_st8_bytes(t, i, n, full, q);
}

/* The weight of an update, eight elements at a time, for AdamW, Lion and SGD alike: from its
 * master t[AT] (MK 1: plain W; 2: split, bf16 hi in t[0] and the i8 lo in t[AT]) or from t[0]
 * (MK 0), and stored back the same way. */
template <int MK, class P, class W, int AT>
static __device__ __forceinline__ void ck_update_w_ld8(const CkArgs &a, i64 i, i64 n, bool full, float *w) {
    if (MK == 2) {   /* w = hi + lo ulp(hi) / 256 (codec_split_decode) */
        unsigned char lo[8];
        ck_ld8_bytes(a.t[AT], i, n, full, lo);
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            unsigned short hi = i + j < n ? ((const unsigned short *)a.t[0].p)[i + j] : 0;
            w[j] = __uint_as_float((unsigned)hi << 16) + (float)(signed char)lo[j] * ck_split_unit(ck_split_b(hi));
        }
    } else if (MK == 1 && full) {
        W::ld_vec(a.t[AT], i, w);
    } else if (MK == 1) {
        #pragma unroll
        for (int j = 0; j < 8; j++) w[j] = i + j < n ? W::ld(a.t[AT], i + j) : 0.0f;
    } else if (full) {
        P::ld_vec(a.t[0], i, w);
    } else {
        #pragma unroll
        for (int j = 0; j < 8; j++) w[j] = i + j < n ? P::ld(a.t[0], i + j) : 0.0f;
    }
}

/* stores the new weight (splitting a split master: hi = bf16(w), lo = rint((w - hi) / unit), 0
 * where hi is not finite) */
template <int MK, class P, class W, int AT>
static __device__ __forceinline__ void ck_update_w_st8(const CkArgs &a, i64 i, i64 n, bool full, const float *w) {
    if (MK == 2) {
        unsigned char lo[8];
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            __nv_bfloat16 hb = __float2bfloat16_rn(w[j]);
            unsigned short h = *(unsigned short *)&hb;
            float hf = __uint_as_float((unsigned)h << 16);
            if (i + j < n) ((unsigned short *)a.t[0].p)[i + j] = h;
            signed char l = 0;
            if (isfinite(hf)) {
                float r = rintf(ck_split_per_unit(w[j] - hf, ck_split_b(h)));
                l = (signed char)(r > 127.0f ? 127.0f : r < -128.0f ? -128.0f : r);
            }
            lo[j] = (unsigned char)l;
        }
        ck_st8_bytes(a.t[AT], i, n, full, lo);
        return;
    }
    if (MK == 1) {
        if (full) {
            W::st_vec(a.t[AT], i, w);
        } else {
            #pragma unroll
            for (int j = 0; j < 8; j++)
                if (i + j < n) W::st(a.t[AT], i + j, w[j]);
        }
    }
    if (full) {
        P::st_vec(a.t[0], i, w);
    } else {
        #pragma unroll
        for (int j = 0; j < 8; j++)
            if (i + j < n) P::st(a.t[0], i + j, w[j]);
    }
}

/* ADAMW (param, grad, m, v, lr, step, clip, grad_scale[, master][, copy, scale, amax]) with any
 * state codecs: MC, VC the codecs of m and v (CODEC_PLAIN: through their formats M, V); MK the
 * master: 0 none, 1 plain (format W), 2 split; the copy as in ck_adamw. A warp per 256
 * elements, eight a lane. f = {b1, b2, eps, wd} */
template <class P, class G, class LR, class ST, class CL, class GS, int MC, class M, int VC, class V,
          int MK, class W, class CP, int COPY_AT>
__device__ void ck_adamw_coded(const CkArgs &a) {
    __shared__ float k[4];   /* lr, gmul, 1 / bc1, 1 / bc2: in f64 once per block, kept in f32 */
    float b1 = (float)a.f[0], b2 = (float)a.f[1], eps = (float)a.f[2], wd = (float)a.f[3];
    float c1 = (float)(1 - a.f[0]), c2 = (float)(1 - a.f[1]);
    if (threadIdx.x == 0) {
        double step = ST::ld(a.t[5], 0);
        k[0] = LR::ld(a.t[4], 0);
        k[1] = (float)((double)GS::ld(a.t[7], 0) * (double)CL::ld(a.t[6], 0));
        k[2] = (float)(1 / (1 - pow(a.f[0], step)));
        k[3] = (float)(1 / (1 - pow(a.f[1], step)));
    }
    __syncthreads();
    i64 n = a.t[0].n, chunks = (n + CK_CODED_CHUNK - 1) / CK_CODED_CHUNK;
    int lane = threadIdx.x & 31;
    i64 warp = (CK_BLOCK * blockDim.x + threadIdx.x) >> 5, warps = (CK_BLOCKS * blockDim.x) >> 5;
    /* wide access where every tensor is aligned for it; the chunk must also lie inside n */
    bool wide = n % 8 == 0 && G::vec_ok(a.t[1]) &&
                (MC == CODEC_PLAIN || (unsigned long long)a.t[2].p % 8 == 0) &&
                (VC == CODEC_PLAIN || (unsigned long long)a.t[3].p % 8 == 0) &&
                (MK == 2 ? (unsigned long long)a.t[8].p % 8 == 0 : P::vec_ok(a.t[0])) &&
                (MK != 1 || W::vec_ok(a.t[8]));
    float copy_max = 0.0f;
    for (i64 ch = warp; ch < chunks; ch += warps) {
        i64 i = ch * CK_CODED_CHUNK + lane * 8;
        bool full = wide && ch * CK_CODED_CHUNK + CK_CODED_CHUNK <= n;
        float g[8], m[8], v[8], w[8];
        ck_state_ld8<CODEC_PLAIN, G>(a.t[1], i, n, full, g);   /* the gradient, a plain state's way */
        ck_state_ld8<MC, M>(a.t[2], i, n, full, m);
        ck_state_ld8<VC, V>(a.t[3], i, n, full, v);
        ck_update_w_ld8<MK, P, W, 8>(a, i, n, full, w);
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            float gj = g[j] * k[1];
            m[j] = b1 * m[j] + c1 * gj;
            v[j] = b2 * v[j] + c2 * gj * gj;
            float mhat = m[j] * k[2], vhat = v[j] * k[3];
            w[j] -= k[0] * (mhat / (sqrtf(vhat) + eps) + wd * w[j]);
            g[j] = 0.0f;
        }
        /* the lanes of a group re-encode it together: all of them have read it above */
        __syncwarp();
        ck_state_st8<MC, M>(a.t[2], i, n, full, m);
        ck_state_st8<VC, V>(a.t[3], i, n, full, v);
        if (full) {
            G::st_vec(a.t[1], i, g);
        } else {
            #pragma unroll
            for (int j = 0; j < 8; j++)
                if (i + j < n) G::st(a.t[1], i + j, 0.0f);
        }
        ck_update_w_st8<MK, P, W, 8>(a, i, n, full, w);
        #pragma unroll
        for (int j = 0; j < 8; j++)
            if (i + j < n) ck_adamw_copy<COPY_AT, P, CP>(a, i + j, w[j], copy_max);
    }
    ck_adamw_copy_amax<COPY_AT>(a, copy_max);
}

/* ---------------------------------------------------------------- Lion, SGD
 *
 * The one-state updates over any state codec, laid out as ck_adamw_coded (a warp per 256
 * elements, eight a lane; the lanes of a group re-encode it together) for plain and coded
 * momentum alike: with one state there is no second fast path worth its code. The weight and
 * its master go through ck_update_w_ld8 and ck_update_w_st8, as in ck_adamw_coded. */

/* LION (KIND 1) or SGD (KIND 2): (param, grad, m, lr, step, clip, grad_scale[, master][, copy,
 * scale, amax]); MC the momentum's codec (CODEC_PLAIN: through its format M); MK and the copy
 * as in ck_adamw_coded. f = {b1 (SGD: momentum), b2, wd}. In f32, as ref_optim.c's update_task:
 *   Lion: w -= lr (sign(b1 m + (1 - b1) g) + wd w), m = b2 m + (1 - b2) g
 *   SGD:  g += wd w, m = mu m + g, w -= lr (NESTEROV ? g + mu m : m) */
template <int KIND, int NESTEROV, class P, class G, class LR, class CL, class GS, int MC, class M, int MK,
          class W, class CP, int COPY_AT>
__device__ void ck_momentum_coded(const CkArgs &a) {
    __shared__ float k[2];   /* lr, gmul */
    float b1 = (float)a.f[0], b2 = (float)a.f[1], wd = (float)a.f[2];
    float c1 = (float)(1 - a.f[0]), c2 = (float)(1 - a.f[1]);
    if (threadIdx.x == 0) {
        k[0] = LR::ld(a.t[3], 0);
        k[1] = (float)((double)GS::ld(a.t[6], 0) * (double)CL::ld(a.t[5], 0));
    }
    __syncthreads();
    i64 n = a.t[0].n, chunks = (n + CK_CODED_CHUNK - 1) / CK_CODED_CHUNK;
    int lane = threadIdx.x & 31;
    i64 warp = (CK_BLOCK * blockDim.x + threadIdx.x) >> 5, warps = (CK_BLOCKS * blockDim.x) >> 5;
    bool wide = n % 8 == 0 && G::vec_ok(a.t[1]) &&
                (MC == CODEC_PLAIN || (unsigned long long)a.t[2].p % 8 == 0) &&
                (MK == 2 ? (unsigned long long)a.t[7].p % 8 == 0 : P::vec_ok(a.t[0])) &&
                (MK != 1 || W::vec_ok(a.t[7]));
    float copy_max = 0.0f;
    for (i64 ch = warp; ch < chunks; ch += warps) {
        i64 i = ch * CK_CODED_CHUNK + lane * 8;
        bool full = wide && ch * CK_CODED_CHUNK + CK_CODED_CHUNK <= n;
        float g[8], m[8], w[8];
        ck_state_ld8<CODEC_PLAIN, G>(a.t[1], i, n, full, g);   /* the gradient, a plain state's way */
        ck_state_ld8<MC, M>(a.t[2], i, n, full, m);
        ck_update_w_ld8<MK, P, W, 7>(a, i, n, full, w);
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            float gj = g[j] * k[1];
            if (KIND == 1) {
                float d = b1 * m[j] + c1 * gj;
                float s = d > 0.0f ? 1.0f : d < 0.0f ? -1.0f : 0.0f;
                w[j] -= k[0] * (s + wd * w[j]);
                m[j] = b2 * m[j] + c2 * gj;
            } else {
                gj += wd * w[j];
                m[j] = b1 * m[j] + gj;
                w[j] -= k[0] * (NESTEROV ? gj + b1 * m[j] : m[j]);
            }
            g[j] = 0.0f;
        }
        /* the lanes of a group re-encode it together: all of them have read it above */
        __syncwarp();
        ck_state_st8<MC, M>(a.t[2], i, n, full, m);
        if (full) {
            G::st_vec(a.t[1], i, g);
        } else {
            #pragma unroll
            for (int j = 0; j < 8; j++)
                if (i + j < n) G::st(a.t[1], i + j, 0.0f);
        }
        ck_update_w_st8<MK, P, W, 7>(a, i, n, full, w);
        #pragma unroll
        for (int j = 0; j < 8; j++)
            if (i + j < n) ck_adamw_copy<COPY_AT, P, CP>(a, i + j, w[j], copy_max);
    }
    ck_adamw_copy_amax<COPY_AT>(a, copy_max);
}
