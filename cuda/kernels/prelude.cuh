/* prelude.cuh — what every generated kernel module starts with: element types, scaled
 * loads and stores, block reductions.
 *
 * Loads and stores are where the GPU must agree with the reference executor bit for bit:
 * a load decodes the element exactly (every code of every format is an f32 value) and then
 * divides by its scale with IEEE division, as ref_load does; a store multiplies by the scale
 * and rounds with CUDA's own conversions (bf16 round-to-nearest-even, FP8 saturating to the
 * largest finite value), which ir/numerics.c reproduces on the CPU. Everything else in the
 * kernels is ordinary float math whose differences from the reference stay within the
 * tolerances stated by the tests.
 *
 * Element type and scaling kind are template parameters (F<E, S>): the code for an
 * unscaled bf16 tensor has no scale lookup at all. The enums FMT_* and SCALE_* are emitted by
 * the renderer from ir/formats.def and ir.h ahead of this text. */
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef long long i64;

#define CK_INF __int_as_float(0x7f800000)
#define CK_NAN __int_as_float(0x7fffffff)

/* ---------------------------------------------------------------- element types */

template <int E> struct Elem;
template <> struct Elem<FMT_F32> {
    static __device__ __forceinline__ float ld(const void *p, i64 i) { return ((const float *)p)[i]; }
    static __device__ __forceinline__ void st(void *p, i64 i, float v) { ((float *)p)[i] = v; }
};
template <> struct Elem<FMT_BF16> {
    static __device__ __forceinline__ float ld(const void *p, i64 i) {
        return __uint_as_float((unsigned)((const unsigned short *)p)[i] << 16);
    }
    static __device__ __forceinline__ void st(void *p, i64 i, float v) {
        __nv_bfloat16 h = __float2bfloat16_rn(v);
        ((unsigned short *)p)[i] = *(unsigned short *)&h;
    }
};
template <> struct Elem<FMT_F16> {
    static __device__ __forceinline__ float ld(const void *p, i64 i) {
        unsigned short b = ((const unsigned short *)p)[i];
        return __half2float(*(__half *)&b);
    }
    static __device__ __forceinline__ void st(void *p, i64 i, float v) {
        __half h = __float2half_rn(v);
        ((unsigned short *)p)[i] = *(unsigned short *)&h;
    }
};
template <> struct Elem<FMT_E4M3> {
    static __device__ __forceinline__ float ld(const void *p, i64 i) {
        __half_raw h = __nv_cvt_fp8_to_halfraw(((const __nv_fp8_storage_t *)p)[i], __NV_E4M3);
        return __half2float(*(__half *)&h);
    }
    static __device__ __forceinline__ void st(void *p, i64 i, float v) {
        ((__nv_fp8_storage_t *)p)[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    }
};
template <> struct Elem<FMT_E5M2> {
    static __device__ __forceinline__ float ld(const void *p, i64 i) {
        __half_raw h = __nv_cvt_fp8_to_halfraw(((const __nv_fp8_storage_t *)p)[i], __NV_E5M2);
        return __half2float(*(__half *)&h);
    }
    static __device__ __forceinline__ void st(void *p, i64 i, float v) {
        ((__nv_fp8_storage_t *)p)[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
    }
};

/* Storage bytes of an element type with a vector path (ElemBytes<E>::n; 0: none). */
template <int E> struct ElemBytes { enum { n = 0 }; };
template <> struct ElemBytes<FMT_F32> { enum { n = 4 }; };
template <> struct ElemBytes<FMT_BF16> { enum { n = 2 }; };
template <> struct ElemBytes<FMT_F16> { enum { n = 2 }; };
template <> struct ElemBytes<FMT_E4M3> { enum { n = 1 }; };
template <> struct ElemBytes<FMT_E5M2> { enum { n = 1 }; };

/* E8M0 (microscaling scales): 2^(q - 127), 255 NaN; a store keeps the exponent (rounds down
 * to a power of two), x <= 0 gives 2^-127, beyond 2^127 gives 2^127 (num_f32_to_e8m0) */
template <> struct Elem<FMT_E8M0> {
    static __device__ __forceinline__ float ld(const void *p, i64 i) {
        unsigned q = ((const unsigned char *)p)[i];
        return q == 255 ? CK_NAN : q ? __uint_as_float(q << 23) : __uint_as_float(0x00400000u);
    }
    static __device__ __forceinline__ void st(void *p, i64 i, float v) {
        unsigned q;
        if (v != v) q = 255;
        else if (!(v > 0.0f)) q = 0;
        else {
            q = (__float_as_uint(v) >> 23) & 0xff;
            if (q > 254) q = 254;
        }
        ((unsigned char *)p)[i] = (unsigned char)q;
    }
};

/* Integer types round to nearest even after clamping; NaN stores 0 (num_encode). */
static __device__ __forceinline__ float ck_round_int(float x, float lo, float hi) {
    if (x != x) return 0.0f;
    if (x <= lo) return lo;
    if (x >= hi) return hi;
    return rintf(x);
}
template <> struct Elem<FMT_I8> {
    static __device__ __forceinline__ float ld(const void *p, i64 i) { return (float)((const signed char *)p)[i]; }
    static __device__ __forceinline__ void st(void *p, i64 i, float v) {
        ((signed char *)p)[i] = (signed char)ck_round_int(v, -128.0f, 127.0f);
    }
};
template <> struct Elem<FMT_U8> {
    static __device__ __forceinline__ float ld(const void *p, i64 i) { return (float)((const unsigned char *)p)[i]; }
    static __device__ __forceinline__ void st(void *p, i64 i, float v) {
        ((unsigned char *)p)[i] = (unsigned char)ck_round_int(v, 0.0f, 255.0f);
    }
};
template <> struct Elem<FMT_I32> {
    static __device__ __forceinline__ float ld(const void *p, i64 i) { return (float)((const int *)p)[i]; }
    static __device__ __forceinline__ void st(void *p, i64 i, float v) {
        int q;
        if (v != v) q = 0;
        else if (v >= 2147483648.0f) q = 2147483647;
        else if (v <= -2147483648.0f) q = (int)0x80000000u;
        else q = (int)rintf(v);
        ((int *)p)[i] = q;
    }
};

/* ---------------------------------------------------------------- scaled formats */

/* Index of the scale of flat element i (ref_scale_index). */
template <int S> static __device__ __forceinline__ i64 ck_scale_index(const CkTensor &t, i64 i) {
    if (S == SCALE_PER_TENSOR) return 0;
    /* whole groups a row: group k of the flattened tensor, a shift (no 64-bit division) */
    if ((S == SCALE_PER_GROUP || S == SCALE_TILE_1x128) && t.gshift >= 0) return i >> t.gshift;
    i64 r = i / t.cols, c = i - r * t.cols;
    if (S == SCALE_PER_ROW) return r;
    if (S == SCALE_BLOCK_128) return (r / 128) * t.ncg + c / 128;
    return r * t.ncg + c / t.group;   /* per group, 1x128 tiles */
}

template <int S, int SE> static __device__ __forceinline__ float ck_scale(const CkTensor &t, i64 i) {
    return t.s ? Elem<SE>::ld(t.s, ck_scale_index<S>(t, i)) : t.sconst;
}

/* ---------------------------------------------------------------- vector access
 * Elementwise kernels are bound by memory, and a thread that moves one 2-byte element per load
 * leaves most of the bandwidth unused. Where a tensor allows it (an element type of 1, 2 or 4
 * bytes, its storage aligned to the vector, and one scale for the whole vector), a thread takes
 * CK_VEC consecutive elements with one wide load into registers and decodes them there with the
 * same Elem code and the same scale, so every value is bit-identical to the scalar path's.
 * A vector starts at a multiple of CK_VEC, so it holds one scale when the scale is per tensor,
 * or per row, per group (of a multiple of CK_VEC) or per 128 x 128 block of rows of whole
 * vectors: the saved activations of -O2 and -O3 (1 x 16 groups) take the wide path too, and
 * look their scale up once per vector instead of once per element. */
#define CK_VEC 8
template <int N> struct alignas(N < 16 ? N : 16) CkRaw { unsigned char b[N]; };

/* The vector that element i (never negative) starts: a shift, where i64's own division by
 * CK_VEC would round toward zero for negative i and add three instructions a vector for it. */
static __device__ __forceinline__ i64 ck_vec_index(i64 i) { return (i64)((unsigned long long)i / CK_VEC); }

/* whether every CK_VEC-aligned vector of t lies under one scale of kind S */
template <int S> static __device__ __forceinline__ bool ck_scale_vec_ok(const CkTensor &t) {
    if (S == SCALE_NONE || S == SCALE_PER_TENSOR) return true;
    if (t.cols % CK_VEC) return false;
    return S == SCALE_PER_ROW || S == SCALE_BLOCK_128 || t.group % CK_VEC == 0;
}

/* One vector's bytes, vector v of the array at p, read whole into r by loads of 4, 8 or 16 bytes.
 * A vector read as a struct of bytes, or through a reference to it in memory, comes apart into
 * a load per element (eight two-byte loads for a bf16 vector, measured in the SASS of every
 * memory-bound kernel), eight times the load instructions for the same bytes; and a Raw
 * returned by value is rebuilt byte by byte, four instructions an element to decode bf16. So
 * r is filled in place. */
template <class X> static __device__ __forceinline__ void ck_raw_vec(const void *p, i64 v, typename X::Raw &r) {
    if constexpr (X::vbytes && X::vbytes % 16 == 0) {
        #pragma unroll
        for (int h = 0; h < X::vbytes / 16; h++) ((uint4 *)&r)[h] = ((const uint4 *)p)[v * (X::vbytes / 16) + h];
    } else if constexpr (X::vbytes == 8) {
        *(uint2 *)&r = ((const uint2 *)p)[v];
    } else if constexpr (X::vbytes == 4) {
        *(unsigned *)&r = ((const unsigned *)p)[v];
    } else {
        r = ((const typename X::Raw *)p)[v];
    }
}

/* F<E, S, SE>: a tensor of element type E and scaling S, its scales stored as SE. */
template <int E, int S, int SE = FMT_F32> struct F {
    enum { elem = E, scaling = S, scale_elem = SE };
    enum { vbytes = ElemBytes<E>::n * CK_VEC };
    /* whether t can be read and written CK_VEC elements at a time (at multiples of CK_VEC) */
    static __device__ __forceinline__ bool vec_ok(const CkTensor &t) {
        const int align = vbytes < 16 ? vbytes : 16;
        return ElemBytes<E>::n && ck_scale_vec_ok<S>(t) && t.n % CK_VEC == 0 &&
               (unsigned long long)t.p % (align ? align : 1) == 0;
    }
    /* A scale stored as E8M0 is a power of two, whose reciprocal is exact: each element is then
     * multiplied by it, with the quotient's bits (one correctly rounded operation on the same
     * real number), and a vector takes one reciprocal instead of CK_VEC divisions. */
    typedef CkRaw<vbytes ? vbytes : 1> Raw;   /* one vector's bytes as stored */
    static __device__ __forceinline__ void ld_vec(const CkTensor &t, i64 i, float *v) {
        Raw r;
        ck_raw_vec<F>(t.p, ck_vec_index(i), r);
        decode_vec(t, i, r, v);
    }
    /* the vector at element i of t from its bytes r, read from t or from a copy of them */
    static __device__ __forceinline__ void decode_vec(const CkTensor &t, i64 i, const Raw &r, float *v) {
        float s = S != SCALE_NONE ? ck_scale<S, SE>(t, i) : 1.0f;
        float rs = SE == FMT_E8M0 ? __frcp_rn(s) : 1.0f;
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            v[j] = Elem<E>::ld(r.b, j);
            if (S != SCALE_NONE) v[j] = SE == FMT_E8M0 ? v[j] * rs : v[j] / s;
        }
    }
    static __device__ __forceinline__ void st_vec(const CkTensor &t, i64 i, const float *v) {
        st_vec_scaled(t, i, v, S != SCALE_NONE ? ck_scale<S, SE>(t, i) : 1.0f);
    }
    /* the same through scale s, which the caller holds (what t's scale array has, or will have) */
    static __device__ __forceinline__ void st_vec_scaled(const CkTensor &t, i64 i, const float *v, float s) {
        CkRaw<vbytes ? vbytes : 1> r;
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) Elem<E>::st(r.b, j, S != SCALE_NONE ? v[j] * s : v[j]);
        ((CkRaw<vbytes ? vbytes : 1> *)t.p)[ck_vec_index(i)] = r;
    }
    /* scale s as a load of it from t's scale array reads it back after a store */
    static __device__ __forceinline__ float scale_round(float s) {
        unsigned buf[1];
        Elem<SE>::st(buf, 0, s);
        return Elem<SE>::ld(buf, 0);
    }
    static __device__ __forceinline__ float ld(const CkTensor &t, i64 i) {
        float v = Elem<E>::ld(t.p, i);
        if (S != SCALE_NONE) v = v / ck_scale<S, SE>(t, i);
        return v;
    }
    static __device__ __forceinline__ void st(const CkTensor &t, i64 i, float v) {
        if (S != SCALE_NONE) v = v * ck_scale<S, SE>(t, i);
        Elem<E>::st(t.p, i, v);
    }
    /* what a load reads back after a store of v (nothing is written) */
    static __device__ __forceinline__ float round(const CkTensor &t, i64 i, float v) {
        float s = S != SCALE_NONE ? ck_scale<S, SE>(t, i) : 1.0f;
        if (S != SCALE_NONE) v = v * s;
        unsigned buf[1];
        Elem<E>::st(buf, 0, v);
        float r = Elem<E>::ld(buf, 0);
        return S != SCALE_NONE ? r / s : r;
    }
};

/* ---------------------------------------------------------------- reductions
 * Fixed shapes, fixed order: a block reduction adds the same values in the same tree every
 * run, so results are repeatable bit for bit. */

template <class T> static __device__ __forceinline__ T ck_warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static __device__ __forceinline__ float ck_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it. */
template <class T> static __device__ T ck_block_sum(T v) {
    __shared__ T part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = ck_warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    T s = lane < nw ? part[lane] : (T)0;
    return ck_warp_sum(s);
}

static __device__ float ck_block_max(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = ck_warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float s = lane < nw ? part[lane] : -CK_INF;
    return ck_warp_max(s);
}

/* Every entry point of a module begins here (render.c). A kernel launched with programmatic
 * dependent launch (the choice cuda.pdl, exec.c) may start while the launch before it on the
 * stream still runs, so that its blocks are scheduled and its launch latency is spent during
 * the other's tail; it waits here until that launch has finished and its writes are visible,
 * before it reads anything. Launched without, the wait returns at once. */
static __device__ __forceinline__ void ck_grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

static __device__ __forceinline__ bool ck_amax_usable(double amax) { return amax > 0 && isfinite(amax); }

/* max(elem) / amax / 2^margin, computed in f64 and rounded once (ref_quant.c) */
static __device__ __forceinline__ float ck_scale_for(double fmax, double amax, i64 margin) {
    return (float)(fmax / amax * ldexp(1.0, -(int)margin));   /* x / 2^m, exactly: one division */
}

/* The per-tensor scale that a launch with a.scale_amax makes for its own use (spec_scales.c,
 * fold_state_scales): the value ck_quant_scale_tensor stores for a QUANT_SCALE of the one f32
 * at scale_amax (its |x|, folded into 0 as a maximum is: a NaN gives 1), with the largest
 * value scale_max of the copy's element type and margin scale_margin. */
static __device__ __forceinline__ float ck_state_scale(const CkArgs &a) {
    float amax = fmaxf(0.0f, fabsf(*a.scale_amax));
    return ck_amax_usable(amax) ? ck_scale_for(a.scale_max, amax, a.scale_margin) : 1.0f;
}

/* The entry of a launch that is not batched: the wait, then, in block 0, the scale the launch
 * makes from a stored amax (stored at scale_to, for the launches after it), and the
 * reciprocals of the scales of the GEMMs that fold_inverse_scales (spec_scales.c) gave it (the
 * division ck_inv_scales makes: the same bits; of the scale made here, from its value), before
 * the kernel's own work. */
static __device__ __forceinline__ void ck_entry(const CkArgs &a) {
    ck_grid_wait();
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 2 * CK_MAX_INVERSE) {
        float *to = a.inv_to[threadIdx.x >> 1];
        const float *s = a.inv_from[threadIdx.x];
        bool made = a.scale_amax && s == a.scale_to;
        if (to && s) to[16 * (threadIdx.x & 1)] = 1.0f / (made ? ck_state_scale(a) : s[0]);
        if (a.scale_amax && threadIdx.x == 0) *a.scale_to = ck_state_scale(a);
    }
}

/* The block's index and the grid's size as the argument block a sees them: in a batched
 * launch, those of a's own entry. */
#define CK_BLOCK ((i64)blockIdx.x - (i64)a.grid_base)
#define CK_BLOCKS (a.grid_size ? (i64)a.grid_size : (i64)gridDim.x)
#define CK_GRID_STRIDE(i, n) \
    for (i64 i = CK_BLOCK * blockDim.x + threadIdx.x; i < (n); i += CK_BLOCKS * blockDim.x)

/* Entry of a batched launch: the block finds its argument block (binary search over the
 * first blocks) and copies it to shared memory. */
static __device__ __forceinline__ void ck_batch_load(const CkBatch &b, CkArgs *out) {
    int lo = 0, hi = b.n - 1;
    unsigned bid = blockIdx.x;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (b.first[mid] <= bid) lo = mid;
        else hi = mid - 1;
    }
    static_assert(sizeof(CkArgs) % 8 == 0, "argument blocks copy as 8-byte words");
    const unsigned long long *src = (const unsigned long long *)&b.args[lo];
    unsigned long long *dst = (unsigned long long *)out;
    for (int k = threadIdx.x; k < (int)(sizeof(CkArgs) / 8); k += blockDim.x) dst[k] = src[k];
    __syncthreads();
}
