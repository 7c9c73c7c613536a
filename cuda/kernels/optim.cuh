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
 * (tests/gpu/test_gpu_ops.c states the bounds). The divisions of the codecs take no division
 * instruction: a decode reads its code's table (ck_code_table_fill), an encode multiplies by
 * its group's reciprocal and corrects (ck_div_by8, ck_div_unit), with the division's rounding;
 * the update's square roots and its division take their fast paths eight at a time
 * (fastmath.cuh). A lane asks for all its bytes of a chunk before it decodes any (CkStateRaw).
 * In f64, with a warp per 128 elements and a byte a lane per access, the update of GPT-2 d12's
 * states took 5.2 ms at -O3 on an H200; in f32 with a division per code, 2.0 ms, and Llama
 * 1.1B's 17.8 ms (0.7 TB/s, bound by the divisions' instructions); with the codes' tables,
 * 10.2 ms (a memory latency per tensor of a chunk, one after the other); with the loads first
 * and the fast paths eight at a time, 8.9 ms, the same bits. ncu then counts 208 instructions
 * an element, issued at 3.1 a cycle, the integer and logic pipe 72% busy and DRAM 29%: what
 * is left to gain is in instructions. -O2's range expansion took 229 an element (Llama 1.1B:
 * 10.65 ms); with its logarithms in the code table, one test a lane where a branch an element
 * was, and the weight's copy in one store, 201 (9.36 ms), the same bits. */

#define CK_EXPAND_RANGE 28672.0f   /* e4m3's normal range, 448 / 2^-6 */
#define CK_EXPAND_K_MAX 16.0f
#define CK_CODED_CHUNK 256         /* elements a warp takes at a time */

/* y^e from l = __log2f(y) (a code table holds it): exp2 of the product */
static __device__ __forceinline__ float ck_pow_fast_log2(float l, float e) { return exp2f(e * l); }
/* y^e for y >= 0, e > 0 (0 at y = 0) through the special-function unit: lg2.approx, then
 * exp2 of the product, within a few ulps of f32 (about 1e-6 relative where e log2 y reaches
 * -10, the smallest a range-expanded element gets), a sixtieth of an e4m3 step */
static __device__ __forceinline__ float ck_pow_fast(float y, float e) { return ck_pow_fast_log2(__log2f(y), e); }

/* -x where the code's top bit (an e4m3 sign) is set: the sign bit flipped, as negation does */
static __device__ __forceinline__ float ck_code_sign(float x, unsigned char q) {
    return __uint_as_float(__float_as_uint(x) ^ ((unsigned)(q & 0x80) << 24));
}

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

/* The value of each of a coded state's 256 codes before its group's side values: z / (254 - |z|)
 * (companding), z / (510 - z) (sqrt), log2(|d| / 448) (range expansion, through lg2.approx as
 * ck_pow_fast takes it). Each block fills the tables of its states once, with the f32
 * operations that decoding a byte did, so that a decode is a read of shared memory and a
 * product (range expansion: and one exp2), bit for bit as before. A division per element and
 * state was most of the update's instructions: at -O3 it ran at 0.7 TB/s, bound by them; the
 * logarithm of range expansion's decode was four more a code, its denormal scaling included. */
#define CK_CODES 256
template <int C> static __device__ __forceinline__ void ck_code_table_fill(float *tab) {
    if (C == CODEC_PLAIN) return;
    for (int q = threadIdx.x; q < CK_CODES; q += blockDim.x) {
        float z = C == CODEC_COMPAND ? (float)(signed char)q : (float)q;
        unsigned char b = (unsigned char)q;
        tab[q] = C == CODEC_EXPAND ? __log2f(fabsf(Elem<FMT_E4M3>::ld(&b, 0)) / 448.0f)
                 : C == CODEC_COMPAND ? z / (254.0f - fabsf(z))
                                      : z / (510.0f - z);
    }
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

/* 8 raw bytes at element i (a multiple of 8) of t's storage: a chunk read whole unpacks its one
 * load (ck_unpack8_bytes), the others read the bytes of elements < n (0 beyond); stored back
 * the same ways */
static __device__ __forceinline__ void ck_unpack8_bytes(uint2 r, unsigned char *b) {
    #pragma unroll
    for (int j = 0; j < 8; j++) b[j] = (unsigned char)((j < 4 ? r.x : r.y) >> (8 * (j & 3)));
}
static __device__ __forceinline__ void ck_ld8_bytes(const CkTensor &t, i64 i, i64 n, unsigned char *b) {
    #pragma unroll
    for (int j = 0; j < 8; j++) b[j] = i + j < n ? ((const unsigned char *)t.p)[i + j] : 0;
}
static __device__ __forceinline__ void ck_st8_bytes(const CkTensor &t, i64 i, i64 n, bool full, const unsigned char *b) {
    if (full) {
        uint2 r = make_uint2(0u, 0u);
        #pragma unroll
        for (int j = 0; j < 8; j++) (j < 4 ? r.x : r.y) |= (unsigned)b[j] << (8 * (j & 3));
        ((uint2 *)t.p)[i / 8] = r;
        return;
    }
    #pragma unroll
    for (int j = 0; j < 8; j++)
        if (i + j < n) ((unsigned char *)t.p)[i + j] = b[j];
}

/* 8 two-byte values at element i (a multiple of 8): one 16-byte access for a chunk read whole,
 * else those of elements < n (0 beyond) */
static __device__ __forceinline__ void ck_unpack8_u16(uint4 r, unsigned short *h) {
    unsigned w[4] = {r.x, r.y, r.z, r.w};
    #pragma unroll
    for (int j = 0; j < 8; j++) h[j] = (unsigned short)(w[j / 2] >> (16 * (j & 1)));
}
static __device__ __forceinline__ void ck_ld8_u16(const CkTensor &t, i64 i, i64 n, unsigned short *h) {
    #pragma unroll
    for (int j = 0; j < 8; j++) h[j] = i + j < n ? ((const unsigned short *)t.p)[i + j] : 0;
}
static __device__ __forceinline__ void ck_st8_u16(const CkTensor &t, i64 i, i64 n, bool full, const unsigned short *h) {
    if (full) {
        uint4 r;
        r.x = h[0] | (unsigned)h[1] << 16;
        r.y = h[2] | (unsigned)h[3] << 16;
        r.z = h[4] | (unsigned)h[5] << 16;
        r.w = h[6] | (unsigned)h[7] << 16;
        ((uint4 *)t.p)[i / 8] = r;
        return;
    }
    #pragma unroll
    for (int j = 0; j < 8; j++)
        if (i + j < n) ((unsigned short *)t.p)[i + j] = h[j];
}

/* ---------------------------------------------------------------- one chunk's loads
 * A lane's bytes of every tensor of a chunk are read first, all of them, and decoded after:
 * a decode waits for its bytes, and a lane that decoded m before it asked for v and the weight
 * paid a memory latency per tensor, one after the other (at -O3 three per chunk, where the
 * codes' table reads waited for m's codes, then v's; Llama 1.1B's coded update moved 1.3 TB/s).
 * CkStateRaw holds one state's bytes as stored; the members a format does not use cost nothing. */
template <int C, class X> struct CkStateRaw {
    typename X::Raw v;   /* a plain state's vector */
    uint2 q;             /* a coded state's eight codes */
    float c, k;          /* and its group's side values (k: range expansion's exponent) */
};

/* whether a state's chunks can be read whole (the chunk must also lie inside n, and for a coded
 * state the kernel's `wide` checks the codes' alignment) */
template <int C, class X> static __device__ __forceinline__ bool ck_state_fetch_ok(const CkTensor &t) {
    return C != CODEC_PLAIN || X::vec_ok(t);
}

/* the side values of the group that holds element i of a coded state: c, and range
 * expansion's k (groups of 128: two values each; companding and sqrt: c, groups of 32) */
template <int C> static __device__ __forceinline__ void ck_state_side(const CkTensor &t, i64 i, float &c, float &k) {
    const float *p = (const float *)t.s;
    if (C == CODEC_EXPAND) {
        c = p[(i / 128) * 2];
        k = p[(i / 128) * 2 + 1];
    } else {
        c = p[i / 32];
        k = 0.0f;
    }
}

/* the bytes of the 8 elements at i (a chunk inside n) */
template <int C, class X> static __device__ __forceinline__ void ck_state_fetch8(const CkTensor &t, i64 i,
                                                                                  CkStateRaw<C, X> &r) {
    if (C == CODEC_PLAIN) {
        ck_raw_vec<X>(t.p, ck_vec_index(i), r.v);
        return;
    }
    r.q = ((const uint2 *)t.p)[i / 8];
    ck_state_side<C>(t, i, r.c, r.k);
}

/* the 8 values of a state from its codes q and its group's side values c, k (coded by C through
 * its code table tab) */
template <int C> static __device__ __forceinline__ void ck_state_decode_codes(const unsigned char *q, float c,
                                                                               float k, float *x, const float *tab) {
    if (C == CODEC_EXPAND) {   /* sign(d) c (|d| / 448)^(1/k), tab holding log2(|d| / 448) */
        float inv_k = 1.0f / k;
        #pragma unroll
        for (int j = 0; j < 8; j++)   /* e4m3's sign is the code's top bit */
            x[j] = ck_code_sign(c * ck_pow_fast_log2(tab[q[j]], inv_k), q[j]);
    } else if (C == CODEC_COMPAND) {   /* amax z / (2 - |z|), z = q / 127 */
        #pragma unroll
        for (int j = 0; j < 8; j++) x[j] = c * tab[q[j]];
    } else {   /* CODEC_SQRT: (p z / (2 - z))^2, z = q / 255 */
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            float r = tab[q[j]] * c;
            x[j] = r * r;
        }
    }
}

template <int C, class X> static __device__ __forceinline__ void ck_state_decode8(const CkTensor &t, i64 i,
                                                                                   const CkStateRaw<C, X> &r,
                                                                                   float *x, const float *tab) {
    if (C == CODEC_PLAIN) {
        X::decode_vec(t, i, r.v, x);
        return;
    }
    unsigned char q[8];
    ck_unpack8_bytes(r.q, q);
    ck_state_decode_codes<C>(q, r.c, r.k, x, tab);
}

/* the 8 elements at i of a state (format X, or coded by C through its code table tab), those
 * < n (0 beyond): the path of a chunk that is not read whole */
template <int C, class X> static __device__ __forceinline__ void ck_state_ld8(const CkTensor &t, i64 i, i64 n,
                                                                               float *x, const float *tab = nullptr) {
    if (C == CODEC_PLAIN) {
        #pragma unroll
        for (int j = 0; j < 8; j++) x[j] = i + j < n ? X::ld(t, i + j) : 0.0f;
        return;
    }
    if (i >= n) {   /* a lane past the end: nothing to decode (its side values do not exist) */
        #pragma unroll
        for (int j = 0; j < 8; j++) x[j] = 0.0f;
        return;
    }
    unsigned char q[8];
    float c, k;
    ck_ld8_bytes(t, i, n, q);
    ck_state_side<C>(t, i, c, k);
    ck_state_decode_codes<C>(q, c, k, x, tab);
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
        float ax[8], u[8];
        #pragma unroll
        for (int j = 0; j < 8; j++) ax[j] = fabsf(x[j]);
        ck_div_by8(ax, c, ck_recip(c), finite, u);
        /* one test a lane, not a branch an element (the group's c is the lane's): signed zeros
         * where the group is not finite */
        if (finite) {
            #pragma unroll
            for (int j = 0; j < 8; j++) u[j] = 448.0f * ck_pow_fast(u[j], k);
        } else {
            #pragma unroll
            for (int j = 0; j < 8; j++) u[j] = 0.0f;
        }
        #pragma unroll
        for (int j = 0; j < 8; j++) Elem<FMT_E4M3>::st(q, j, copysignf(u[j], x[j]));   /* u >= 0: signbit(x) ? -u : u */
    } else if (C == CODEC_COMPAND) {   /* groups of 32, 4 lanes: round(127 2y / (1 + |y|)), y = x / amax */
        float m = 0.0f;
        #pragma unroll
        for (int j = 0; j < 8; j++)
            if (i + j < n) m = ck_absmax_nan(m, fabsf(x[j]));
        float c = ck_lanes_absmax_nan<4>(m);
        if (lane % 4 == 0 && i < n) p[i / 32] = c;
        bool finite = c > 0.0f && c < CK_INF;
        float y[8];
        ck_div_by8(x, c, ck_recip(c), finite, y);
        #pragma unroll
        for (int j = 0; j < 8; j++)
            q[j] = (unsigned char)(signed char)rintf(127.0f * ck_div_unit(2.0f * y[j], 1.0f + fabsf(y[j])));
    } else {   /* CODEC_SQRT, groups of 32, 4 lanes: round(255 2y / (1 + y)), y = sqrt(v) / max sqrt(v); v > 0: >= 1 */
        float m = 0.0f, pv[8], sq[8], u[8];
        #pragma unroll
        for (int j = 0; j < 8; j++) pv[j] = x[j] > 0.0f ? x[j] : 0.0f;
        ck_sqrt8(pv, sq);
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            if (x[j] != x[j]) sq[j] = CK_NAN;
            if (i + j < n) m = ck_absmax_nan(m, sq[j]);
        }
        float c = ck_lanes_absmax_nan<4>(m);
        if (lane % 4 == 0 && i < n) p[i / 32] = c;
        bool finite = c > 0.0f && c < CK_INF;
        ck_div_by8(sq, c, ck_recip(c), finite, u);
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            bool pos = finite && x[j] > 0.0f;
            float y = pos ? u[j] : 0.0f;
            float r = 255.0f * ck_div_unit(2.0f * y, 1.0f + y);
            /* rint(r) < 1 exactly when r <= 0.5 (the tie rounds to the even 0) */
            q[j] = (unsigned char)(pos && r <= 0.5f ? 1.0f : rintf(r));
        }
    }
    ck_st8_bytes(t, i, n, full, q);
}

/* The weight of an update, eight elements at a time, for AdamW, Lion and SGD alike: from its
 * master t[AT] (MK 1: plain W; 2: split, bf16 hi in t[0] and the i8 lo in t[AT]) or from t[0]
 * (MK 0), and stored back the same way. A chunk read whole fetches its bytes (CkWeightRaw)
 * with the states' before any of them is decoded. */
template <int MK, class P, class W> struct CkWeightRaw {
    uint4 hi;              /* a split master's bf16 halves */
    uint2 lo;              /* and its i8 corrections */
    typename W::Raw w;     /* a master of its own */
    typename P::Raw p;     /* no master: the parameter */
};
template <int MK, class P, class W, int AT>
static __device__ __forceinline__ void ck_update_w_fetch8(const CkArgs &a, i64 i, CkWeightRaw<MK, P, W> &r) {
    if (MK == 2) {
        r.hi = ((const uint4 *)a.t[0].p)[i / 8];
        r.lo = ((const uint2 *)a.t[AT].p)[i / 8];
    } else if (MK == 1) {
        ck_raw_vec<W>(a.t[AT].p, ck_vec_index(i), r.w);
    } else {
        ck_raw_vec<P>(a.t[0].p, ck_vec_index(i), r.p);
    }
}

/* w = hi + lo ulp(hi) / 256 (codec_split_decode) */
static __device__ __forceinline__ void ck_split_decode8(const unsigned short *hi, const unsigned char *lo, float *w) {
    #pragma unroll
    for (int j = 0; j < 8; j++)
        w[j] = __uint_as_float((unsigned)hi[j] << 16) + (float)(signed char)lo[j] * ck_split_unit(ck_split_b(hi[j]));
}

template <int MK, class P, class W, int AT>
static __device__ __forceinline__ void ck_update_w_decode8(const CkArgs &a, i64 i, const CkWeightRaw<MK, P, W> &r,
                                                           float *w) {
    if (MK == 2) {
        unsigned char lo[8];
        unsigned short hi[8];
        ck_unpack8_bytes(r.lo, lo);
        ck_unpack8_u16(r.hi, hi);
        ck_split_decode8(hi, lo, w);
    } else if (MK == 1) {
        W::decode_vec(a.t[AT], i, r.w, w);
    } else {
        P::decode_vec(a.t[0], i, r.p, w);
    }
}

/* the weight of a chunk that is not read whole: the elements < n (0 beyond) */
template <int MK, class P, class W, int AT>
static __device__ __forceinline__ void ck_update_w_ld8(const CkArgs &a, i64 i, i64 n, float *w) {
    if (MK == 2) {
        unsigned char lo[8];
        unsigned short hi[8];
        ck_ld8_bytes(a.t[AT], i, n, lo);
        ck_ld8_u16(a.t[0], i, n, hi);
        ck_split_decode8(hi, lo, w);
    } else if (MK == 1) {
        #pragma unroll
        for (int j = 0; j < 8; j++) w[j] = i + j < n ? W::ld(a.t[AT], i + j) : 0.0f;
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
        unsigned short hi[8];
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            __nv_bfloat16 hb = __float2bfloat16_rn(w[j]);
            unsigned short h = *(unsigned short *)&hb;
            float hf = __uint_as_float((unsigned)h << 16);
            hi[j] = h;
            /* computed for every element and kept where hi is finite: a select, not a branch each */
            float r = rintf(ck_split_per_unit(w[j] - hf, ck_split_b(h)));
            r = isfinite(hf) ? (r > 127.0f ? 127.0f : r < -128.0f ? -128.0f : r) : 0.0f;
            lo[j] = (unsigned char)(signed char)r;
        }
        ck_st8_u16(a.t[0], i, n, full, hi);
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

/* A chunk's gradient g, first state m, second state v (when V_AT > 0: AdamW's; Lion and SGD have
 * none) and weight w (its master at t[AT]), eight values a lane: a chunk read whole asks for all
 * its bytes before it decodes any; the others, element by element. */
template <class G, int MC, class M, int VC, class V, int V_AT, int MK, class P, class W, int AT>
static __device__ __forceinline__ void ck_chunk_ld8(const CkArgs &a, i64 i, i64 n, bool whole, float *g, float *m,
                                                    float *v, float *w, const float *mtab, const float *vtab) {
    if (whole) {
        CkStateRaw<CODEC_PLAIN, G> gr;   /* the gradient, a plain state's way */
        CkStateRaw<MC, M> mr;
        CkStateRaw<VC, V> vr;
        CkWeightRaw<MK, P, W> wr;
        ck_state_fetch8(a.t[1], i, gr);
        ck_state_fetch8(a.t[2], i, mr);
        if constexpr (V_AT != 0) ck_state_fetch8(a.t[V_AT], i, vr);
        ck_update_w_fetch8<MK, P, W, AT>(a, i, wr);
        ck_state_decode8(a.t[1], i, gr, g, nullptr);
        ck_state_decode8(a.t[2], i, mr, m, mtab);
        if constexpr (V_AT != 0) ck_state_decode8(a.t[V_AT], i, vr, v, vtab);
        ck_update_w_decode8<MK, P, W, AT>(a, i, wr, w);
    } else {
        ck_state_ld8<CODEC_PLAIN, G>(a.t[1], i, n, g);
        ck_state_ld8<MC, M>(a.t[2], i, n, m, mtab);
        if constexpr (V_AT != 0) ck_state_ld8<VC, V>(a.t[V_AT], i, n, v, vtab);
        ck_update_w_ld8<MK, P, W, AT>(a, i, n, w);
    }
}

/* The weight's FP8 copy (or, COPY_AT < 0, its largest |weight| alone) of the eight new weights
 * w at i, as ck_adamw_copy stores them one by one: where the chunk is read whole and the copy
 * is scaled per tensor, through its scale s (loaded once a launch) in one 8-byte store, where
 * eight byte stores, each with its scale's load and its bounds test, took some fifteen
 * instructions an element. */
template <int COPY_AT, class P, class CP> static __device__ __forceinline__ bool ck_copy8_ok(const CkArgs &a) {
    if constexpr (COPY_AT > 0)
        return (CP::scaling == SCALE_PER_TENSOR || CP::scaling == SCALE_NONE) && CP::vec_ok(a.t[COPY_AT]);
    return COPY_AT < 0;
}
template <int COPY_AT, class P, class CP> static __device__ __forceinline__ float ck_copy8_scale(const CkArgs &a) {
    if constexpr (COPY_AT > 0)
        if (CP::scaling == SCALE_PER_TENSOR) return ck_scale<CP::scaling, CP::scale_elem>(a.t[COPY_AT], 0);
    return 1.0f;
}
template <int COPY_AT, class P, class CP>
static __device__ __forceinline__ void ck_adamw_copy8(const CkArgs &a, i64 i, i64 n, bool whole, float s, const float *w,
                                                      float &m) {
    if constexpr (COPY_AT == 0) return;
    if (whole) {
        float stored[8];
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            stored[j] = P::round(a.t[0], i + j, w[j]);
            m = fmaxf(m, fabsf(stored[j]));
        }
        if constexpr (COPY_AT > 0) CP::st_vec_scaled(a.t[COPY_AT], i, stored, s);
        return;
    }
    #pragma unroll
    for (int j = 0; j < 8; j++)
        if (i + j < n) ck_adamw_copy<COPY_AT, P, CP>(a, i + j, w[j], m);
}

/* ADAMW (param, grad, m, v, lr, step, clip, grad_scale[, master][, copy, scale, amax]) with any
 * state codecs: MC, VC the codecs of m and v (CODEC_PLAIN: through their formats M, V); MK the
 * master: 0 none, 1 plain (format W), 2 split; the copy as in ck_adamw. A warp per 256
 * elements, eight a lane. f = {b1, b2, eps, wd} */
template <class P, class G, class LR, class ST, class CL, class GS, int MC, class M, int VC, class V,
          int MK, class W, class CP, int COPY_AT>
__device__ void ck_adamw_coded(const CkArgs &a) {
    __shared__ float k[4];   /* lr, gmul, 1 / bc1, 1 / bc2: in f64 once per block, kept in f32 */
    __shared__ float mtab[MC == CODEC_PLAIN ? 1 : CK_CODES], vtab[VC == CODEC_PLAIN ? 1 : CK_CODES];
    float b1 = (float)a.f[0], b2 = (float)a.f[1], eps = (float)a.f[2], wd = (float)a.f[3];
    float c1 = (float)(1 - a.f[0]), c2 = (float)(1 - a.f[1]);
    if (threadIdx.x == 0) {
        double step = ST::ld(a.t[5], 0);
        k[0] = LR::ld(a.t[4], 0);
        k[1] = (float)((double)GS::ld(a.t[7], 0) * (double)CL::ld(a.t[6], 0));
        k[2] = (float)(1 / (1 - pow(a.f[0], step)));
        k[3] = (float)(1 / (1 - pow(a.f[1], step)));
    }
    ck_code_table_fill<MC>(mtab);
    ck_code_table_fill<VC>(vtab);
    __syncthreads();
    i64 n = a.t[0].n, chunks = (n + CK_CODED_CHUNK - 1) / CK_CODED_CHUNK;
    int lane = threadIdx.x & 31;
    i64 warp = (CK_BLOCK * blockDim.x + threadIdx.x) >> 5, warps = (CK_BLOCKS * blockDim.x) >> 5;
    /* wide access where every tensor is aligned for it; the chunk must also lie inside n */
    bool wide = n % 8 == 0 && G::vec_ok(a.t[1]) &&
                (MC == CODEC_PLAIN || (unsigned long long)a.t[2].p % 8 == 0) &&
                (VC == CODEC_PLAIN || (unsigned long long)a.t[3].p % 8 == 0) &&
                (MK == 2 ? (unsigned long long)a.t[8].p % 8 == 0 && (unsigned long long)a.t[0].p % 16 == 0
                         : P::vec_ok(a.t[0])) &&
                (MK != 1 || W::vec_ok(a.t[8]));
    bool fetch_ok = ck_state_fetch_ok<MC, M>(a.t[2]) && ck_state_fetch_ok<VC, V>(a.t[3]);
    bool copy8 = ck_copy8_ok<COPY_AT, P, CP>(a);
    float copy_max = 0.0f, copy_scale = ck_copy8_scale<COPY_AT, P, CP>(a);
    for (i64 ch = warp; ch < chunks; ch += warps) {
        i64 i = ch * CK_CODED_CHUNK + lane * 8;
        bool full = wide && ch * CK_CODED_CHUNK + CK_CODED_CHUNK <= n;
        float g[8], m[8], v[8], w[8];
        ck_chunk_ld8<G, MC, M, VC, V, 3, MK, P, W, 8>(a, i, n, full && fetch_ok, g, m, v, w, mtab, vtab);
        float mhat[8], vhat[8], den[8], step[8];
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            float gj = g[j] * k[1];
            m[j] = b1 * m[j] + c1 * gj;
            v[j] = b2 * v[j] + c2 * gj * gj;
            mhat[j] = m[j] * k[2], vhat[j] = v[j] * k[3];
            g[j] = 0.0f;
        }
        ck_sqrt8(vhat, den);
        #pragma unroll
        for (int j = 0; j < 8; j++) den[j] += eps;
        ck_div8(mhat, den, step);   /* mhat / (sqrt(vhat) + eps) */
        #pragma unroll
        for (int j = 0; j < 8; j++) w[j] -= k[0] * (step[j] + wd * w[j]);
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
        ck_adamw_copy8<COPY_AT, P, CP>(a, i, n, full && copy8, copy_scale, w, copy_max);
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
    __shared__ float mtab[MC == CODEC_PLAIN ? 1 : CK_CODES];
    float b1 = (float)a.f[0], b2 = (float)a.f[1], wd = (float)a.f[2];
    float c1 = (float)(1 - a.f[0]), c2 = (float)(1 - a.f[1]);
    if (threadIdx.x == 0) {
        k[0] = LR::ld(a.t[3], 0);
        k[1] = (float)((double)GS::ld(a.t[6], 0) * (double)CL::ld(a.t[5], 0));
    }
    ck_code_table_fill<MC>(mtab);
    __syncthreads();
    i64 n = a.t[0].n, chunks = (n + CK_CODED_CHUNK - 1) / CK_CODED_CHUNK;
    int lane = threadIdx.x & 31;
    i64 warp = (CK_BLOCK * blockDim.x + threadIdx.x) >> 5, warps = (CK_BLOCKS * blockDim.x) >> 5;
    bool wide = n % 8 == 0 && G::vec_ok(a.t[1]) &&
                (MC == CODEC_PLAIN || (unsigned long long)a.t[2].p % 8 == 0) &&
                (MK == 2 ? (unsigned long long)a.t[7].p % 8 == 0 && (unsigned long long)a.t[0].p % 16 == 0
                         : P::vec_ok(a.t[0])) &&
                (MK != 1 || W::vec_ok(a.t[7]));
    bool fetch_ok = ck_state_fetch_ok<MC, M>(a.t[2]);
    bool copy8 = ck_copy8_ok<COPY_AT, P, CP>(a);
    float copy_max = 0.0f, copy_scale = ck_copy8_scale<COPY_AT, P, CP>(a);
    for (i64 ch = warp; ch < chunks; ch += warps) {
        i64 i = ch * CK_CODED_CHUNK + lane * 8;
        bool full = wide && ch * CK_CODED_CHUNK + CK_CODED_CHUNK <= n;
        float g[8], m[8], w[8];
        ck_chunk_ld8<G, MC, M, CODEC_PLAIN, G, 0, MK, P, W, 7>(a, i, n, full && fetch_ok, g, m, nullptr, w, mtab, nullptr);
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
        ck_adamw_copy8<COPY_AT, P, CP>(a, i, n, full && copy8, copy_scale, w, copy_max);
    }
    ck_adamw_copy_amax<COPY_AT>(a, copy_max);
}
