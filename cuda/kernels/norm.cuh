/* norm.cuh — LayerNorm and RMSNorm, forward and backward: a row's sums kept in registers.
 *
 * Norms are the step's memory-bound row work: a row of up to 2048 values is read, reduced twice
 * (mean, then squared deviations) and written, and its backward adds two column sums (the
 * weight's and the bias's gradients) over all rows. The forward and the short rows' backward
 * give a row to a warp, so that a row's sums are shuffles with no block barrier and its values
 * stay in the lanes' registers between the passes; rows are staged through shared memory by
 * cp.async with the next one in flight (CkStage). Long rows' backward gives a row to a block,
 * so that each thread's column sums stay in registers. Every sum runs in a fixed order: the same
 * bits on every run. Loaded after ops.cuh (its formats, block maxima and packs), before
 * reduce.cuh, whose group copies of a norm's input reuse the row functions here. */

/* ---------------------------------------------------------------- rows */

/* ---------------------------------------------------------------- norms
 * A warp per row (8 rows a block of 256 threads): the row's sums are warp reductions, with no
 * shared memory and no block barrier, which a row of a few thousand elements cannot afford.
 * Where the row is whole vectors of at most CK_ROW_VECS x 32 x CK_VEC elements and every
 * operand allows wide loads, a lane holds its part of x in registers (read once) and works in
 * f32 (f64 conversions cost more than the row's memory traffic; the errors stay far inside
 * the tests' bounds); otherwise lanes step through the row an element at a time in f64. Sums
 * are in a fixed order. NV, the vectors a lane holds, is the row's own (spec.c: ceil(C / 256),
 * 0 for rows that do not fit): registers sized for the longest row would leave a row of 768
 * with a third of the warps an SM can hold, and the norms latency-bound.
 * LAYERNORM (x, w, b) / RMSNORM (x, w): i = {C, R}, f = {eps} */
#define CK_ROW_VECS 8

/* What a forward norm does with a row's values as read, before its statistics (row: nothing
 * here; reduce.cuh's CkRowGroupCopy writes the input's copy into per-group scales from them),
 * and with its statistics (stats: nothing here; CkRowStats keeps them). */
struct CkNoRowCopy {
    template <int NV> static __device__ __forceinline__ void row(const CkArgs &, i64, i64, const float (&)[NV][CK_VEC]) {}
    static __device__ __forceinline__ void stats(const CkArgs &, i64, float, float) {}
};

/* A norm that keeps each row's statistics for a later pass over its rows (the FP8 copy in both
 * layouts, gemm_io.cuh's CkLdNorm: spec_fuse.c, fuse_cast_transposes): the mean (0 for
 * RMSNorm) and 1 / sqrt(var + eps) of row r as (f32, f32) at float pair r of the result's own
 * storage, which the norm does not otherwise write (CkAmaxOnly), by the row's first lane. */
struct CkRowStats : CkNoRowCopy {
    static __device__ __forceinline__ void stats(const CkArgs &a, i64 r, float mean, float rstd) {
        if ((threadIdx.x & 31) == 0) ((float2 *)a.t[0].p)[r] = make_float2(mean, rstd);
    }
};
#define CK_ROW_OF_WARP ((i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5))

/* A row's mean from the lanes' partial sums s of its C elements, and its 1 / sqrt(var + eps)
 * from the partial sums of squared deviations q, every lane getting them. In f32: a warp sum
 * in f64 takes two shuffles a step and f64 arithmetic, and holding it cost the norms 73 to 80
 * registers a thread, three blocks an SM, too few rows in flight to keep the memory busy; f32
 * sums of a row of a few thousand values are good to about 1e-6 relative. */
static __device__ __forceinline__ float ck_row_mean(float s, i64 C) { return ck_warp_sum(s) / (float)C; }
static __device__ __forceinline__ float ck_row_rstd(float q, i64 C, double eps) {
    return 1.0f / sqrtf(ck_warp_sum(q) / (float)C + (float)eps);
}

/* x's part of row r held by this lane, and mean and rstd of the row (every lane gets them) */
template <int LN, int NV, class X> __device__ __forceinline__ void ck_row_load_stats(
    const CkTensor &x, i64 r, i64 C, double eps, float (&v)[NV][CK_VEC], float *mean, float *rstd) {
    int lane = threadIdx.x & 31;
    float s = 0;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (c < C) {
            X::ld_vec(x, r * C + c, v[k]);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) s += v[k][j];
        }
    }
    float m = LN ? ck_row_mean(s, C) : 0.0f, q = 0;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (c < C)
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float d = v[k][j] - m;
                q = fmaf(d, d, q);
            }
    }
    *mean = m;
    *rstd = ck_row_rstd(q, C, eps);
}

/* the same, an element at a time (any row length and format) */
template <int LN, class X> __device__ void ck_row_stats(const CkTensor &x, i64 r, i64 C, double eps,
                                                        double *mean, double *rstd) {
    int lane = threadIdx.x & 31;
    double s = 0;
    if (LN)
        for (i64 c = lane; c < C; c += 32) s += X::ld(x, r * C + c);
    double m = LN ? ck_warp_sum(s) / (double)C : 0.0, q = 0;
    for (i64 c = lane; c < C; c += 32) {
        double d = X::ld(x, r * C + c) - m;
        q += d * d;
    }
    *mean = m;
    *rstd = 1.0 / sqrt(ck_warp_sum(q) / (double)C + eps);
}

template <int NV> static __device__ __forceinline__ bool ck_row_in_registers(i64 C) {
    return NV > 0 && C % CK_VEC == 0 && C <= (i64)NV * 32 * CK_VEC;
}

/* the norm's results of row r from its vectors in registers (ck_row_load_stats); returns the
 * largest |result| before rounding */
template <int LN, int NV, class Y, class W, class B> __device__ __forceinline__ float ck_norm_row_out(
    const CkArgs &a, i64 r, i64 C, const float (&v)[NV][CK_VEC], float mean, float rstd) {
    int lane = threadIdx.x & 31;
    float m = 0.0f;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (c >= C) continue;
        float w[CK_VEC], bias[CK_VEC], out[CK_VEC];
        W::ld_vec(a.t[2], c, w);
        if (LN) B::ld_vec(a.t[3], c, bias);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            float t = (v[k][j] - mean) * rstd * w[j];
            out[j] = LN ? t + bias[j] : t;
            m = fmaxf(m, fabsf(out[j]));
        }
        Y::st_vec(a.t[0], r * C + c, out);
    }
    return m;
}

/* whether row r of a norm runs from registers (the vector path of ck_norm_row) */
template <int NV, class Y, class X, class W, class B, int LN> __device__ __forceinline__ bool ck_norm_vec_ok(const CkArgs &a) {
    return ck_row_in_registers<NV>(a.i[0]) && X::vec_ok(a.t[1]) && Y::vec_ok(a.t[0]) && W::vec_ok(a.t[2]) &&
           (!LN || B::vec_ok(a.t[3]));
}

template <int LN, class Y, class X, class W, class B, class Stats = CkNoRowCopy>
__device__ __forceinline__ float ck_norm_row_scalar(const CkArgs &a, i64 r);

/* row r of LAYERNORM / RMSNORM; returns the largest |result| before rounding. Stats (a
 * CkNoRowCopy) sees the statistics of the vector path; the element path's are f64, and its
 * f32 rounding of them (what Stats sees there) need not give its results. */
template <int LN, int NV, class Y, class X, class W, class B, class Stats = CkNoRowCopy>
__device__ __forceinline__ float ck_norm_row(const CkArgs &a, i64 r) {
    i64 C = a.i[0];
    if (ck_norm_vec_ok<NV, Y, X, W, B, LN>(a)) {
        float v[NV > 0 ? NV : 1][CK_VEC], mean, rstd;
        ck_row_load_stats<LN, (NV > 0 ? NV : 1), X>(a.t[1], r, C, a.f[0], v, &mean, &rstd);
        Stats::stats(a, r, mean, rstd);
        return ck_norm_row_out<LN, (NV > 0 ? NV : 1), Y, W, B>(a, r, C, v, mean, rstd);
    }
    return ck_norm_row_scalar<LN, Y, X, W, B, Stats>(a, r);
}

/* row r of LAYERNORM / RMSNORM an element at a time, statistics in f64 (any row and format) */
template <int LN, class Y, class X, class W, class B, class Stats>
__device__ __forceinline__ float ck_norm_row_scalar(const CkArgs &a, i64 r) {
    i64 C = a.i[0];
    int lane = threadIdx.x & 31;
    const CkTensor &x = a.t[1], &y = a.t[0];
    float m = 0.0f;
    double mean, rstd;
    ck_row_stats<LN, X>(x, r, C, a.f[0], &mean, &rstd);
    Stats::stats(a, r, (float)mean, (float)rstd);
    for (i64 c = lane; c < C; c += 32) {
        double t = (X::ld(x, r * C + c) - mean) * rstd * W::ld(a.t[2], c);
        if (LN) t += B::ld(a.t[3], c);
        m = fmaxf(m, fabsf((float)t));
        Y::st(y, r * C + c, (float)t);
    }
    return m;
}

/* a warp per row, striding by the grid's warps when the grid is capped (amax=1) */
#define CK_ROW_STRIDE ((i64)gridDim.x * (blockDim.x >> 5))
#define CK_ROWS_OF_WARP(r, R) for (i64 r = CK_ROW_OF_WARP; r < (R); r += CK_ROW_STRIDE)

/* ---------------------------------------------------------------- rows staged in shared memory
 * A warp that loads a row into registers and then reduces it has that row's bytes in flight
 * only until its loads return, and none while it computes: measured on an H200 (ncu, GPT-2
 * d12 -O1), the norms waited on loads 42-49% of their cycles at 27-36% of the memory's
 * bandwidth with 28-30 warps an SM, and a hint that brought the next row into L2 early
 * (prefetch.global.L2) gained nothing. Staged, a warp copies the row it takes next into shared
 * memory by cp.async (no registers held, nothing waited for) before it works on the one in
 * hand, which its lanes then read from shared memory: each warp has a row in flight all the
 * time. A lane copies exactly the vectors it reads later (vector k 32 + lane, the layout of
 * ck_row_load_stats), so its own cp.async.wait_group is all the ordering needed, no barrier;
 * and it reads a slot's values into registers before it copies into that slot again. Two
 * slots a warp and tensor, in the launch's dynamic shared memory (spec_ops.c, norm_stage,
 * sizes it the same way). The bytes decoded are those a load would read: the same results. */
#define CK_STAGE_SLOTS 2
/* A ring of CK_STAGE_SLOTS slots of SLOT bytes (at least NV 32 vectors of X: ck_stage_fits) */
template <int NV, class X, int SLOT> struct CkStage {
    unsigned char *ring;
    __device__ __forceinline__ const unsigned char *slot(int k) const { return ring + k * SLOT; }
    /* this lane's vectors of row r of x into slot k (nothing past R; no commit); FULL: C is
     * NV 32 vectors, every lane has all NV */
    template <bool FULL = false> __device__ __forceinline__ void fetch(const CkTensor &x, i64 r, i64 R, i64 C, int k) const {
        if (r >= R) return;
        int lane = threadIdx.x & 31;
        unsigned to = (unsigned)__cvta_generic_to_shared(ring + k * SLOT);
        #pragma unroll
        for (int v = 0; v < NV; v++) {
            i64 c = ((i64)v * 32 + lane) * CK_VEC;
            if (!FULL && c >= C) continue;
            const char *src = (const char *)x.p + (r * C + c) * ElemBytes<X::elem>::n;
            unsigned dst = to + (v * 32 + lane) * X::vbytes;
            if (X::vbytes == 8) {
                asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
            } else {
                #pragma unroll
                for (int h = 0; h < X::vbytes / 16; h++)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + 16 * h), "l"(src + 16 * h)
                                 : "memory");
            }
        }
    }
    /* vector v of this lane from slot k, decoded as a load of element i of x decodes it */
    __device__ __forceinline__ void read(const CkTensor &x, i64 i, int k, int v, float *out) const {
        typename X::Raw r;
        ck_raw_vec<X>(slot(k), v * 32 + (threadIdx.x & 31), r);
        X::decode_vec(x, i, r, out);
    }
};
template <int NV, class X, int SLOT> __host__ __device__ constexpr bool ck_stage_fits() {
    return SLOT >= NV * 32 * X::vbytes && SLOT % 16 == 0;
}
/* the copies fetched since the last commit, as one group (possibly empty: groups count rows) */
static __device__ __forceinline__ void ck_stage_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* every group but the newest is in */
static __device__ __forceinline__ void ck_stage_wait_prev() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

/* The ring of this warp for tensor t, in the dynamic shared memory from byte `at` on: the
 * block's rings of tensor 0 (a ring a warp, CK_STAGE_SLOTS slots of SLOT bytes), then of
 * tensor 1, .. (spec_ops.c, norm_stage, lays them out the same way) */
template <int SLOT> static __device__ __forceinline__ unsigned char *ck_stage_ring(int at, int t) {
    extern __shared__ __align__(16) unsigned char ck_stage_smem[];
    int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    return ck_stage_smem + at + (i64)((t * warps + warp) * CK_STAGE_SLOTS) * SLOT;
}

/* ---------------------------------------------------------------- the staged forward's rows
 * Once its bytes are staged, a row is instruction-bound: ncu on an H200 put the staged norms at
 * 1.2 TB/s, a third of the memory's bandwidth. So the forward norms' staged path does per row
 * only what the row needs; every value is computed by the same operations in the same order as
 * ck_row_load_stats and ck_norm_row_out compute it, and every result bit is theirs.
 *  - A lane's vectors of the weight (and LN's bias) are the same for every row: where they fit
 *    beside the row (ck_norm_holds: short rows) the lane loads them once, as stored, before
 *    the warp's first row, and decodes them per row (a bf16 element is one shift); elsewhere
 *    it reads them per row, which costs fewer instructions than the registers would cost warps.
 *  - LN keeps x - mean, computed once for the squared deviations, in place of x: the result's
 *    (x - mean) is the same operation on the same values.
 *  - Rows of exactly NV 32 vectors (FULL: 768 at NV 3, Llama's 2048 at NV 8), the common case,
 *    are a second instance of the loop with no column tests; C and eps are converted to f32
 *    once, not per row.
 *  - The FP8 tile of ck_norm_t is addressed from the row and column the loop has, not from a
 *    64-bit division of the flat index (CkRowSt). */

/* Whether a lane of a staged forward norm holds its weight (and bias) vectors through its rows:
 * their stored bytes cost NV (W's + B's) / 4 registers, on top of the row's NV CK_VEC values,
 * and are held only where the two together stay within CK_NORM_HELD words: rows of up to 256
 * (NV 1), and RMSNorm's of up to 512 with bf16 weights. Measured with ptxas (sm_90a), longer
 * rows cannot afford them: d12's layernorm (NV 3, bf16, 24 words held) spilled 136 to 168
 * bytes a thread under the 64 registers its bounds leave (spec_ops.c, norm_min_blocks), and
 * Llama's RMSNorm (NV 8, 32 words) went from 120-127 registers to 176-187, one block of 256
 * an SM instead of two. There the weights are read per row, two 16-byte loads a vector. */
#define CK_NORM_HELD 24
template <int LN, int NV, class W, class B> __host__ __device__ constexpr bool ck_norm_holds() {
    return NV * CK_VEC + NV * (W::vbytes + (LN ? B::vbytes : 0)) / 4 <= CK_NORM_HELD;
}

/* A lane's vectors of a norm's weight (t[2]) and, for LN, bias (t[3]): held as stored where
 * HOLD, else read per row; each decoded as ld_vec decodes it */
template <int LN, int NV, bool HOLD, class W, class B> struct CkNormAffine {
    typename W::Raw w[HOLD ? NV : 1];
    typename B::Raw b[HOLD && LN ? NV : 1];
    __device__ __forceinline__ void hold(const CkArgs &a, i64 C) {
        if constexpr (HOLD) {
            int lane = threadIdx.x & 31;
            #pragma unroll
            for (int k = 0; k < NV; k++) {
                i64 c = ((i64)k * 32 + lane) * CK_VEC;
                if (c >= C) continue;
                ck_raw_vec<W>(a.t[2].p, ck_vec_index(c), w[k]);
                if (LN) ck_raw_vec<B>(a.t[3].p, ck_vec_index(c), b[k]);
            }
        }
    }
    /* vector k of this lane, starting at column c */
    __device__ __forceinline__ void get(const CkArgs &a, int k, i64 c, float *wv, float *bv) const {
        if constexpr (HOLD) {
            W::decode_vec(a.t[2], c, w[k], wv);
            if (LN) B::decode_vec(a.t[3], c, b[k], bv);
        } else {
            typename W::Raw wr;
            ck_raw_vec<W>(a.t[2].p, ck_vec_index(c), wr);
            W::decode_vec(a.t[2], c, wr, wv);
            if (LN) {
                typename B::Raw br;
                ck_raw_vec<B>(a.t[3].p, ck_vec_index(c), br);
                B::decode_vec(a.t[3], c, br, bv);
            }
        }
    }
};

/* Y::st_vec of the vector at column c of row r (CkRowSt<CkTileSt>: without the division) */
template <class Y> struct CkRowSt {
    static __device__ __forceinline__ void st(const CkTensor &t, i64 r, i64 C, i64 c, const float *v) {
        Y::st_vec(t, r * C + c, v);
    }
};

/* x's part of row r (its first element i0) from its staged bytes, as ck_row_load_stats reads
 * it: LN leaves in v each value less the mean, RMSNorm the values; rstd for every lane. n and
 * eps: C and eps in f32. read(v) sees the row's values as read, before any is changed. */
template <int LN, int NV, bool FULL, class X, class Read> static __device__ __forceinline__ void ck_staged_row_stats(
    const CkTensor &x, i64 i0, i64 C, float n, float eps, const unsigned char *slot, float (&v)[NV][CK_VEC],
    float *mean, float *rstd, const Read &read) {
    int lane = threadIdx.x & 31;
    float s = 0;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (!FULL && c >= C) continue;
        typename X::Raw xr;
        ck_raw_vec<X>(slot, k * 32 + lane, xr);
        X::decode_vec(x, i0 + c, xr, v[k]);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) s += v[k][j];
    }
    read(v);
    float m = LN ? ck_warp_sum(s) / n : 0.0f, q = 0;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (!FULL && c >= C) continue;
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            float d = v[k][j] - m;
            q = fmaf(d, d, q);
            if (LN) v[k][j] = d;
        }
    }
    *mean = m;
    *rstd = 1.0f / sqrtf(ck_warp_sum(q) / n + eps);
}

/* the norm's results of row r from d (ck_staged_row_stats) as ck_norm_row_out finds them;
 * returns the largest |result| before rounding */
template <int LN, int NV, bool FULL, class Y, class Aff> static __device__ __forceinline__ float ck_staged_row_out(
    const CkArgs &a, i64 r, i64 C, const float (&d)[NV][CK_VEC], float rstd, const Aff &aff) {
    int lane = threadIdx.x & 31;
    float m = 0.0f;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (!FULL && c >= C) continue;
        float w[CK_VEC], bias[CK_VEC], out[CK_VEC];
        aff.get(a, k, c, w, bias);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            float t = d[k][j] * rstd * w[j];
            out[j] = LN ? t + bias[j] : t;
            m = fmaxf(m, fabsf(out[j]));
        }
        CkRowSt<Y>::st(a.t[0], r, C, c, out);
    }
    return m;
}


/* Rows r = first, first + step, .. below end and R of a forward norm, each from its staged
 * copy, the next one fetched before the warp works on the one in hand (x's rows in vectors:
 * ck_norm_vec_ok; the rings from byte 0 of the dynamic shared memory); the results through Y
 * into a.t[0], each row's values as read through Copy; returns the largest |result| */
template <int LN, int NV, int SLOT, bool FULL, class Y, class X, class W, class B, class Copy>
static __device__ __forceinline__ float ck_staged_rows(const CkArgs &a, i64 first, i64 step, i64 end) {
    static_assert(ck_stage_fits<NV, X, SLOT>(), "a slot holds a row of whole vectors");
    const CkTensor &x = a.t[1];
    const i64 C = a.i[0], R = a.i[1];
    const float n = (float)C, eps = (float)a.f[0];
    CkNormAffine<LN, NV, ck_norm_holds<LN, NV, W, B>(), W, B> aff;
    aff.hold(a, C);
    const CkStage<NV, X, SLOT> st{ck_stage_ring<SLOT>(0, 0)};
    if (end > R) end = R;
    st.template fetch<FULL>(x, first, end, C, 0);
    ck_stage_commit();
    float m = 0.0f;
    int k = 0;
    for (i64 r = first; r < end; r += step, k ^= 1) {
        st.template fetch<FULL>(x, r + step, end, C, k ^ 1);
        ck_stage_commit();
        ck_stage_wait_prev();
        float v[NV][CK_VEC], mean, rstd;
        ck_staged_row_stats<LN, NV, FULL, X>(x, r * C, C, n, eps, st.slot(k), v, &mean, &rstd,
                                             [&](const float (&raw)[NV][CK_VEC]) { Copy::row(a, r, C, raw); });
        Copy::stats(a, r, mean, rstd);
        m = fmaxf(m, ck_staged_row_out<LN, NV, FULL, Y>(a, r, C, v, rstd, aff));
    }
    return m;
}
/* the same, the instance for C: rows of exactly NV 32 vectors test no columns */
template <int LN, int NV, int SLOT, class Y, class X, class W, class B, class Copy = CkNoRowCopy>
static __device__ __forceinline__ float ck_staged_norm_rows(const CkArgs &a, i64 first, i64 step, i64 end) {
    if (a.i[0] == (i64)NV * 32 * CK_VEC) return ck_staged_rows<LN, NV, SLOT, true, Y, X, W, B, Copy>(a, first, step, end);
    return ck_staged_rows<LN, NV, SLOT, false, Y, X, W, B, Copy>(a, first, step, end);
}

/* ST: 0, or the rows staged through slots of ST bytes (the launch has the shared memory);
 * Stats: CkNoRowCopy, or CkRowStats where a later pass reads the rows' statistics */
template <int LN, int NV, int ST, class Y, class X, class W, class B, class Stats = CkNoRowCopy>
__device__ void ck_norm(const CkArgs &a) {
    float m = 0.0f;
    bool staged = false;
    if constexpr (ST > 0)
        if ((staged = ck_norm_vec_ok<NV, Y, X, W, B, LN>(a)))
            m = ck_staged_norm_rows<LN, NV, ST, Y, X, W, B, Stats>(a, CK_ROW_OF_WARP, CK_ROW_STRIDE, a.i[1]);
    if (!staged) CK_ROWS_OF_WARP(r, a.i[1]) m = fmaxf(m, ck_norm_row<LN, NV, Y, X, W, B, Stats>(a, r));
    ck_amax_out<Y>(a, m);
}

/* A layernorm or RMSNorm writing its FP8 copy in both layouts (spec_fuse.c,
 * fuse_cast_transposes): a block of eight warps takes a band of BAND rows (32, or 16 for rows
 * longer than 1280), BAND / 8 a warp, and stores their codes (ck_norm_row through CkTileSt:
 * the value rounded to Y, then quantized into Q, CkThrough's bits) in shared memory; then it
 * writes the band's rows of the copy 16 bytes a thread, and the band's BAND bytes of each
 * column into the transposed copy (C, R) at t[i[2]]: a whole sector each at 32, half of one at
 * 16 (the next band's block writes the other half). Rows of the tile are PITCH bytes apart (16
 * more than a row: reading a column, the 32 lanes' bytes fall in 8 banks, four lanes a word).
 * R a multiple of BAND, C of 16 and at most NV x 256 with NV <= 8 (at most 41 KB of shared
 * memory at 32 rows, NV <= 5, 33 KB at 16); with ST, each warp's rows are staged too
 * (ck_staged_rows, in the dynamic shared memory); i = {C, R, the transposed copy's tensor},
 * f = {eps}. */
template <class Y, class Q> struct CkTileSt {
    /* t.p: the tile, t.cols: C, t.ncg: the band's first row, t.group: PITCH */
    static __device__ __forceinline__ CkTensor at(const CkTensor &t, i64 i) {
        i64 r = i / t.cols;
        CkTensor u = t;
        u.p = (unsigned char *)t.p + (r - t.ncg) * t.group + (i - r * t.cols);
        return u;
    }
    static __device__ __forceinline__ bool vec_ok(const CkTensor &t) { return Y::vec_ok(t) && Q::vec_ok(t); }
    static __device__ __forceinline__ void st(const CkTensor &t, i64 i, float v) {
        Q::st(at(t, i), 0, Y::round(t, i, v));
    }
    static __device__ __forceinline__ void st_vec(const CkTensor &t, i64 i, const float *v) {
        float r[CK_VEC];
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) r[j] = Y::round(t, i + j, v[j]);
        Q::st_vec(at(t, i), 0, r);
    }
    static __device__ __forceinline__ float round(const CkTensor &t, i64 i, float v) {
        return Q::round(t, i, Y::round(t, i, v));
    }
    /* st_vec at row r, column c (i = r C + c), whose tile address needs no division */
    static __device__ __forceinline__ void st_row_vec(const CkTensor &t, i64 r, i64 c, const float *v) {
        float q[CK_VEC];
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) q[j] = Y::round(t, r * t.cols + c + j, v[j]);
        CkTensor u = t;
        u.p = (unsigned char *)t.p + (r - t.ncg) * t.group + c;
        Q::st_vec(u, 0, q);
    }
};
template <class Y, class Q> struct CkRowSt<CkTileSt<Y, Q>> {
    static __device__ __forceinline__ void st(const CkTensor &t, i64 r, i64, i64 c, const float *v) {
        CkTileSt<Y, Q>::st_row_vec(t, r, c, v);
    }
};

template <int LN, int NV, int BAND, int ST, class Y, class Q, class X, class W, class B>
__device__ void ck_norm_t(const CkArgs &a) {
    static_assert(BAND == 32 || BAND == 16, "a band is 32 or 16 rows");
    constexpr int PITCH = (NV > 0 ? NV : 1) * 32 * CK_VEC + 16;
    __shared__ __align__(16) unsigned char tile[BAND * PITCH];
    i64 C = a.i[0], R = a.i[1], r0 = (i64)blockIdx.x * BAND;
    CkArgs b = a;
    b.t[0].p = tile;
    b.t[0].cols = C;
    b.t[0].ncg = r0;
    b.t[0].group = PITCH;
    constexpr int PER_WARP = BAND / 8;
    i64 first = r0 + (threadIdx.x >> 5) * PER_WARP;
    bool staged = false;
    if constexpr (ST > 0)
        if ((staged = ck_norm_vec_ok<NV, CkTileSt<Y, Q>, X, W, B, LN>(b)))
            ck_staged_norm_rows<LN, NV, ST, CkTileSt<Y, Q>, X, W, B>(b, first, 1, first + PER_WARP);
    if (!staged)
        for (i64 r = first; r < first + PER_WARP && r < R; r++) ck_norm_row<LN, NV, CkTileSt<Y, Q>, X, W, B>(b, r);
    __syncthreads();
    unsigned char *y = (unsigned char *)a.t[0].p, *yt = (unsigned char *)a.t[a.i[2]].p;
    i64 vr = C / 16;
    for (i64 k = threadIdx.x; k < BAND * vr; k += blockDim.x) {
        i64 row = k / vr, c = (k - row * vr) * 16;
        if (r0 + row < R) *(uint4 *)(y + (r0 + row) * C + c) = *(const uint4 *)(tile + row * PITCH + c);
    }
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
        unsigned w[BAND / 4];
        #pragma unroll
        for (int j = 0; j < BAND / 4; j++) {
            w[j] = 0;
            #pragma unroll
            for (int b4 = 0; b4 < 4; b4++) w[j] |= (unsigned)tile[(4 * j + b4) * PITCH + c] << (8 * b4);
        }
        uint4 *o = (uint4 *)(yt + c * R + r0);
        #pragma unroll
        for (int j = 0; j < BAND / 16; j++) o[j] = make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]);
    }
}

/* *_BWD_X (dy, x, w): dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w (LN; RMS without
 * the first mean); i = {C, R}, f = {eps} */
template <int LN, int NV, class Y, class DY, class X, class W>
__device__ __forceinline__ float ck_norm_bwd_x_row(const CkArgs &a, i64 r) {
    i64 C = a.i[0];
    float m = 0.0f;
    int lane = threadIdx.x & 31;
    const CkTensor &dy = a.t[1], &x = a.t[2], &w = a.t[3];
    if (ck_row_in_registers<NV>(C) && DY::vec_ok(dy) && X::vec_ok(x) && W::vec_ok(w) && Y::vec_ok(a.t[0])) {
        float v[NV > 0 ? NV : 1][CK_VEC], mean, rstd, sgf = 0, sgxf = 0;
        ck_row_load_stats<LN, (NV > 0 ? NV : 1), X>(x, r, C, a.f[0], v, &mean, &rstd);
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float d[CK_VEC], wv[CK_VEC];
            DY::ld_vec(dy, r * C + c, d);
            W::ld_vec(w, c, wv);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = d[j] * wv[j];
                sgf += g;
                sgxf = fmaf(g, (v[k][j] - mean) * rstd, sgxf);
            }
        }
        float mg = LN ? ck_row_mean(sgf, C) : 0.0f, mgx = ck_row_mean(sgxf, C);
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float d[CK_VEC], wv[CK_VEC], out[CK_VEC];
            DY::ld_vec(dy, r * C + c, d);   /* again: the row was just read, it is in cache */
            W::ld_vec(w, c, wv);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = d[j] * wv[j], xh = (v[k][j] - mean) * rstd;
                out[j] = rstd * (g - mg - xh * mgx);
                m = fmaxf(m, fabsf(out[j]));
            }
            Y::st_vec(a.t[0], r * C + c, out);
        }
        return m;
    }
    double mean, rstd, sg = 0, sgx = 0;
    ck_row_stats<LN, X>(x, r, C, a.f[0], &mean, &rstd);
    for (i64 c = lane; c < C; c += 32) {
        double g = (double)DY::ld(dy, r * C + c) * W::ld(w, c);
        double xh = (X::ld(x, r * C + c) - mean) * rstd;
        sg += g;
        sgx += g * xh;
    }
    double mg = LN ? ck_warp_sum(sg) / (double)C : 0.0, mgx = ck_warp_sum(sgx) / (double)C;
    for (i64 c = lane; c < C; c += 32) {
        double g = (double)DY::ld(dy, r * C + c) * W::ld(w, c);
        double xh = (X::ld(x, r * C + c) - mean) * rstd;
        float v = (float)(rstd * (g - mg - xh * mgx));
        m = fmaxf(m, fabsf(v));
        Y::st(a.t[0], r * C + c, v);
    }
    return m;
}

template <int LN, int NV, class Y, class DY, class X, class W> __device__ void ck_norm_bwd_x(const CkArgs &a) {
    float m = 0.0f;
    CK_ROWS_OF_WARP(r, a.i[1]) m = fmaxf(m, ck_norm_bwd_x_row<LN, NV, Y, DY, X, W>(a, r));
    ck_amax_out<Y>(a, m);
}

/* CK_VEC elements of t from element i: one wide load, or one at a time where t's pointer or
 * length does not allow it (the same values either way) */
template <class T> static __device__ __forceinline__ void ck_ld8(const CkTensor &t, i64 i, float *v, bool vec) {
    if (vec) {
        T::ld_vec(t, i, v);
        return;
    }
    #pragma unroll
    for (int j = 0; j < CK_VEC; j++) v[j] = T::ld(t, i + j);
}

/* A norm's whole backward in one pass over its rows (spec_fuse.c, fuse_norm_grads). Per row, as
 * ck_norm_bwd_x: dx, rounded to its own format BX; where the graph adds dx to another gradient
 * (the residual stream's ADD_N), that sum as ck_add_n makes it, in the ADD_N's order. Per
 * column, the weight's gradient sum(dy xhat) and, for LayerNorm's bias, sum(dy): each lane
 * adds its columns of each of its warp's rows into the warp's own row of sums in shared memory
 * (held in registers with the row, they took 128 a thread, two blocks an SM, and the pass ran
 * at a third of the memory's speed), the block then adds its warps' sums in order, and block b
 * leaves row b of the partials in scratch for ck_norm_grads_final (HB: there is a bias).
 * Shared memory: warps x (1 + HB) x NV x 32 x CK_VEC floats, dynamic. Fixed order throughout: the same bits every
 * run. The spec fuses only rows that fit the lanes' registers (C a multiple of CK_VEC, at most
 * NV * 32 * CK_VEC).
 * With ST (spec_ops.c), the rows of x and dy, and of the other term where i[3] is 3, are
 * staged through slots of ST bytes after the sums (CkStage), the next row in flight.
 * t = {Y (the sum, or dx), dy, x, w, the other term (RES > 0), dx's tensor (its format)};
 * i = {C, R, RES: 0 none, 1 the other term is the ADD_N's first input, 2 its second, the
 * tensors staged};
 * f = {eps}; scratch: f32 partials [gridDim.x][C] of the weight, then of the bias. */
template <int LN, int HB, int NV, int ST, class Y, class DY, class X, class W, class RS, class BX>
__device__ void ck_norm_bwd_fused(const CkArgs &a) {
    extern __shared__ float ck_norm_sums[];
    i64 C = a.i[0], R = a.i[1];
    int res = (int)a.i[2];
    enum { HOLD = NV <= 4 || X::scaling != SCALE_NONE };
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const CkTensor &dy = a.t[1], &x = a.t[2], &w = a.t[3];
    bool vec = DY::vec_ok(dy) && X::vec_ok(x) && W::vec_ok(w) && Y::vec_ok(a.t[0]) && (!res || RS::vec_ok(a.t[4]));
    /* a warp's sums, element j of its vector k of lane l at (k CK_VEC + j) 32 + l: the lanes of
     * one update hit 32 banks (by column, eight lanes would share one) */
    const int S = NV * CK_VEC * 32;
    float *gw = ck_norm_sums + (i64)warp * (1 + HB) * S, *gb = gw + S, m = 0.0f;
    for (int i = lane; i < S; i += 32) {
        gw[i] = 0.0f;
        if (HB) gb[i] = 0.0f;
    }
    __syncwarp();
    /* with ST, x, dy and the other term staged (rings after the sums, tensors 0, 1, 2) */
    const int sums = warps * (1 + HB) * S * 4;
    const CkStage<NV, X, ST> sx{ck_stage_ring<ST>(sums, 0)};
    const CkStage<NV, DY, ST> sdy{ck_stage_ring<ST>(sums, 1)};
    const CkStage<NV, RS, ST> sres{ck_stage_ring<ST>(sums, 2)};
    bool stage_res = res && a.i[3] == 3;
    /* row r, its vectors from slot `slot` of the rings, or from memory (slot < 0) */
    auto row = [&](i64 r, int slot) {
        auto ldx = [&](int k, i64 c, float *v) {
            if (slot >= 0) sx.read(x, r * C + c, slot, k, v);
            else ck_ld8<X>(x, r * C + c, v, vec);
        };
        auto lddy = [&](int k, i64 c, float *v) {
            if (slot >= 0) sdy.read(dy, r * C + c, slot, k, v);
            else ck_ld8<DY>(dy, r * C + c, v, vec);
        };
        /* x held in registers where its row is short or decoding it costs (a scaled FP8 copy);
         * otherwise read again in each pass (its row is in cache, or staged): registers for
         * more warps */
        float xr[HOLD ? NV : 1][CK_VEC], s = 0.0f, sgf = 0.0f, sgxf = 0.0f;
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float v[CK_VEC];
            ldx(k, c, v);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                s += v[j];
                if (HOLD) xr[HOLD ? k : 0][j] = v[j];
            }
        }
        /* mean and rstd as ck_row_load_stats finds them */
        float mean = LN ? ck_row_mean(s, C) : 0.0f, q = 0.0f;
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float v[CK_VEC];
            if (HOLD) {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) v[j] = xr[HOLD ? k : 0][j];
            } else {
                ldx(k, c, v);
            }
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float d = v[j] - mean;
                q = fmaf(d, d, q);
            }
        }
        float rstd = ck_row_rstd(q, C, a.f[0]);
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float d[CK_VEC], wv[CK_VEC], v[CK_VEC];
            lddy(k, c, d);
            ck_ld8<W>(w, c, wv, vec);
            if (HOLD) {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) v[j] = xr[HOLD ? k : 0][j];
            } else {
                ldx(k, c, v);
            }
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = d[j] * wv[j], xh = (v[j] - mean) * rstd;
                sgf += g;
                sgxf = fmaf(g, xh, sgxf);
                gw[(k * CK_VEC + j) * 32 + lane] += d[j] * xh;
                if (HB) gb[(k * CK_VEC + j) * 32 + lane] += d[j];
            }
        }
        float mg = LN ? ck_row_mean(sgf, C) : 0.0f, mgx = ck_row_mean(sgxf, C);
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float d[CK_VEC], wv[CK_VEC], o[CK_VEC], out[CK_VEC], v[CK_VEC];
            lddy(k, c, d);
            ck_ld8<W>(w, c, wv, vec);
            if (HOLD) {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) v[j] = xr[HOLD ? k : 0][j];
            } else {
                ldx(k, c, v);
            }
            if (res) {
                if (slot >= 0 && stage_res) sres.read(a.t[4], r * C + c, slot, k, o);
                else ck_ld8<RS>(a.t[4], r * C + c, o, vec);
            }
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = d[j] * wv[j], xh = (v[j] - mean) * rstd;
                out[j] = rstd * (g - mg - xh * mgx);
                if (res) {
                    double dx = BX::round(a.t[5], r * C + c + j, out[j]);
                    out[j] = (float)(res == 1 ? (double)o[j] + dx : dx + (double)o[j]);
                }
                m = fmaxf(m, fabsf(out[j]));
            }
            if (vec) {
                Y::st_vec(a.t[0], r * C + c, out);
            } else {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) Y::st(a.t[0], r * C + c + j, out[j]);
            }
        }
    };
    static_assert(ST == 0 || (ck_stage_fits<NV, X, ST>() && ck_stage_fits<NV, DY, ST>()), "slots of whole rows");
    /* the other term's rows fit the slots too where they are staged (spec_ops.c sizes them so) */
    if (ST > 0 && vec && a.i[3] >= 2 && (!stage_res || NV * 32 * RS::vbytes <= ST)) {
        auto fetch = [&](i64 r, int slot) {
            sx.fetch(x, r, R, C, slot);
            sdy.fetch(dy, r, R, C, slot);
            if (stage_res) sres.fetch(a.t[4], r, R, C, slot);
            ck_stage_commit();
        };
        int slot = 0;
        fetch(CK_ROW_OF_WARP, 0);
        CK_ROWS_OF_WARP(r, R) {
            fetch(r + CK_ROW_STRIDE, slot ^ 1);
            ck_stage_wait_prev();
            row(r, slot);
            slot ^= 1;
        }
    } else {
        CK_ROWS_OF_WARP(r, R) row(r, -1);
    }
    __syncthreads();
    float *out_w = (float *)a.scratch + (i64)blockIdx.x * C, *out_b = (float *)a.scratch + ((i64)gridDim.x + blockIdx.x) * C;
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
        float sw = 0.0f, sb = 0.0f;
        int at = (int)((c / (32 * CK_VEC) * CK_VEC + c % CK_VEC) * 32 + c / CK_VEC % 32);
        for (int v = 0; v < warps; v++) {
            sw += ck_norm_sums[v * (1 + HB) * S + at];
            if (HB) sb += ck_norm_sums[v * (1 + HB) * S + S + at];
        }
        out_w[c] = sw;
        if (HB) out_b[c] = sb;
    }
    ck_amax_out<Y>(a, m);
}

/* A norm's whole backward for long rows, a block a row (spec_ops.c, plan_norm_grads; the
 * choice norm.bwd_block). ck_norm_bwd_fused gives a row to a warp, so each lane holds NV
 * vectors of the weight's column sums: for rows of 2048 (Llama 1.1B) they lived in shared
 * memory, read and written once per element, with three warps an SM's worth of rows in
 * flight, and the pass moved about 1.0 TB/s. Here the block's threads share a row, thread t
 * taking vectors t, t + blockDim.x, .. (VPT of them), so that its columns are the same in every
 * row and their sums stay in registers: VPT x CK_VEC floats (twice with a bias).
 *
 * A thread holds only a vector or two of a row, so what a row costs besides its elements
 * decides the pass: each block sum is a warp's shuffles, a barrier and every warp's part read
 * back. With the mean, the squared deviations and then sum(g), sum(g xhat) as three block sums
 * (and seven f32 divisions), ncu put d48's pass (rows of 1600) at 91 instructions an element
 * and 55% of the issue slots, 1.5 TB/s. So a row takes one block sum, of four values at once:
 * sum(x - K), sum((x - K)^2), sum(g) and sum(g (x - K)), with K the row's first element, from
 * which
 *   mean = K + sum(x - K) / C,   var = sum((x - K)^2) / C - (mean - K)^2,
 *   sum(g xhat) = rstd (sum(g (x - K)) - (mean - K) sum(g)).
 * The shift keeps the subtraction's loss small: no element lies further from the mean than
 * sqrt(C var), so var loses at most a factor C (2^11 for rows of 2048) of f32's 2^-24, and a
 * typical row far less (the tests hold dx to a bf16 rounding of the reference's f64). RMSNorm
 * takes sum(x^2) and sum(g x) alone. The four sums go through a warp as a reduce-scatter (six
 * shuffles, not twenty: each lane keeps one of the four sums after two rounds) into a slot of
 * the row's parity, so the next row's sums never overwrite one still being read: one barrier
 * a row. Every sum adds in a fixed order: the same bits every run.
 *
 * The next row's x, dy and first element are loaded while this one is worked on, as stored;
 * the other term is read when dx is made (fetched ahead too, its registers spilled at rows
 * of 768 to 2048, ptxas sm_90a). Block b leaves row b of the partials in scratch for
 * ck_norm_grads_final, as ck_norm_bwd_fused does, and the other arguments are its own:
 * t = {Y (the sum, or dx), dy, x, w, the other term (RES > 0), dx's tensor (its format)};
 * i = {C, R, RES: 0 none, 1 the other term is the ADD_N's first input, 2 its second};
 * f = {eps}; scratch: f32 partials [gridDim.x][C] of the weight, then of the bias. */
/* The warp's sums of a lane's four values v into the block's slots at `slot` (4 floats a
 * warp): after the reduce-scatter, lanes 8q .. 8q + 7 all hold the warp's sum of component q,
 * each from the same additions (an exchange adds the same two values in either lane). */
static __device__ __forceinline__ void ck_warp_sums4_to(float4 v, float *slot) {
    int lane = threadIdx.x & 31;
    bool hi = lane & 16, h8 = lane & 8;
    float k0 = hi ? v.z : v.x, k1 = hi ? v.w : v.y;   /* kept: x, y below lane 16; z, w from it */
    float g0 = hi ? v.x : v.z, g1 = hi ? v.y : v.w;
    k0 += __shfl_xor_sync(0xffffffffu, g0, 16);
    k1 += __shfl_xor_sync(0xffffffffu, g1, 16);
    float k = h8 ? k1 : k0, g = h8 ? k0 : k1;
    k += __shfl_xor_sync(0xffffffffu, g, 8);
    #pragma unroll
    for (int o = 4; o > 0; o >>= 1) k += __shfl_xor_sync(0xffffffffu, k, o);
    if ((lane & 7) == 0) slot[(threadIdx.x >> 5) * 4 + (lane >> 3)] = k;
}
template <int LN, int HB, int VPT, class Y, class DY, class X, class W, class RS, class BX>
__device__ void ck_norm_bwd_block(const CkArgs &a) {
    __shared__ __align__(16) float sums[2][32 * 4];
    i64 C = a.i[0], R = a.i[1];
    int res = (int)a.i[2];
    const CkTensor &dy = a.t[1], &x = a.t[2], &w = a.t[3];
    bool vec = DY::vec_ok(dy) && X::vec_ok(x) && W::vec_ok(w) && Y::vec_ok(a.t[0]) && (!res || RS::vec_ok(a.t[4]));
    int warps = blockDim.x >> 5;
    const float inv_c = 1.0f / (float)C;
    auto column = [&](int k) { return ((i64)k * blockDim.x + threadIdx.x) * CK_VEC; };
    float gw[VPT][CK_VEC], gb[HB ? VPT : 1][CK_VEC], xv[VPT][CK_VEC], dv[VPT][CK_VEC], m = 0.0f;
    #pragma unroll
    for (int k = 0; k < VPT; k++)
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            gw[k][j] = 0.0f;
            if (HB) gb[HB ? k : 0][j] = 0.0f;
        }
    /* the next row's x and dy as stored (a bf16 vector is four registers, eight decoded), and
     * the first word of its first vector (its first element), fetched where vectors may be read
     * whole; decoded when its turn comes */
    typename X::Raw xn[VPT], kn = {};
    typename DY::Raw dn[VPT];
    auto fetch = [&](i64 r) {
        if (!vec || r >= R) return;
        if (LN) *(unsigned *)&kn = *(const unsigned *)((const char *)x.p + r * C * ElemBytes<X::elem>::n);
        #pragma unroll
        for (int k = 0; k < VPT; k++) {
            i64 c = column(k);
            if (c < C) {
                ck_raw_vec<X>(x.p, ck_vec_index(r * C + c), xn[k]);
                ck_raw_vec<DY>(dy.p, ck_vec_index(r * C + c), dn[k]);
            }
        }
    };
    fetch(blockIdx.x);
    int parity = 0;
    for (i64 r = blockIdx.x; r < R; r += gridDim.x, parity ^= 1) {
        float shift = 0.0f;
        if (LN) {
            if (vec) {
                float kv[CK_VEC];
                X::decode_vec(x, r * C, kn, kv);
                shift = kv[0];
            } else {
                shift = X::ld(x, r * C);
            }
        }
        #pragma unroll
        for (int k = 0; k < VPT; k++) {
            i64 c = column(k);
            if (c >= C) continue;
            if (vec) {
                X::decode_vec(x, r * C + c, xn[k], xv[k]);
                DY::decode_vec(dy, r * C + c, dn[k], dv[k]);
            } else {
                ck_ld8<X>(x, r * C + c, xv[k], false);
                ck_ld8<DY>(dy, r * C + c, dv[k], false);
            }
        }
        fetch(r + gridDim.x);
        /* the row's four sums about its first element (RMSNorm: about 0, no sum(x), no sum(g)) */
        float4 t = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        #pragma unroll
        for (int k = 0; k < VPT; k++) {
            i64 c = column(k);
            if (c >= C) continue;
            float wv[CK_VEC];
            ck_ld8<W>(w, c, wv, vec);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float d = xv[k][j] - shift, g = dv[k][j] * wv[j];
                if (LN) t.x += d, t.z += g;
                t.y = fmaf(d, d, t.y);
                t.w = fmaf(g, d, t.w);
            }
        }
        ck_warp_sums4_to(t, sums[parity]);
        __syncthreads();
        t = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int i = 0; i < warps; i++) {
            float4 p = ((const float4 *)sums[parity])[i];
            t.x += p.x, t.y += p.y, t.z += p.z, t.w += p.w;
        }
        float dm = LN ? t.x * inv_c : 0.0f;   /* mean - K */
        float var = fmaxf(t.y * inv_c - dm * dm, 0.0f);
        float rstd = rsqrtf(var + (float)a.f[0]), mean = shift + dm;
        float mg = LN ? t.z * inv_c : 0.0f, mgx = rstd * fmaf(-dm, t.z, t.w) * inv_c;
        #pragma unroll
        for (int k = 0; k < VPT; k++) {
            i64 c = column(k);
            if (c >= C) continue;
            float wv[CK_VEC], o[CK_VEC], out[CK_VEC];
            ck_ld8<W>(w, c, wv, vec);
            if (res) ck_ld8<RS>(a.t[4], r * C + c, o, vec);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = dv[k][j] * wv[j], xh = (xv[k][j] - mean) * rstd;
                gw[k][j] = fmaf(dv[k][j], xh, gw[k][j]);
                if (HB) gb[HB ? k : 0][j] += dv[k][j];
                out[j] = rstd * (g - mg - xh * mgx);
                if (res) {
                    double dx = BX::round(a.t[5], r * C + c + j, out[j]);
                    out[j] = (float)(res == 1 ? (double)o[j] + dx : dx + (double)o[j]);
                }
                m = fmaxf(m, fabsf(out[j]));
            }
            if (vec) {
                Y::st_vec(a.t[0], r * C + c, out);
            } else {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) Y::st(a.t[0], r * C + c + j, out[j]);
            }
        }
    }
    float *out_w = (float *)a.scratch + (i64)blockIdx.x * C, *out_b = (float *)a.scratch + ((i64)gridDim.x + blockIdx.x) * C;
    #pragma unroll
    for (int k = 0; k < VPT; k++) {
        i64 c = column(k);
        if (c >= C) continue;
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            out_w[c + j] = gw[k][j];
            if (HB) out_b[c + j] = gb[HB ? k : 0][j];
        }
    }
    ck_amax_out<Y>(a, m);
}

/* The second launch of a fused norm backward: column c of the weight's (blockIdx.y 0: t[0],
 * t[1]) or the bias's (1: t[2], t[3]) gradient, the P blocks' partials added in order (32 lanes
 * a column, each over every 32nd block, then the lanes in order, in f64). ACC 0 stores it into
 * the gradient t[0] / t[2]; ACC 1 adds it, rounded as the gradient's own format S stores it
 * (t[1] / t[3]), into the accumulator t[0] / t[2] as ck_accumulate adds. i = {C, P}; 1024
 * threads as 32 columns x 32 lanes. */
template <int ACC0, class A0, class S0, int ACC1, class A1, class S1>
__device__ void ck_norm_grads_final(const CkArgs &a) {
    __shared__ double acc[32][33];
    i64 C = a.i[0], P = a.i[1];
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    i64 c = (i64)blockIdx.x * 32 + tx;
    const float *part = (const float *)a.scratch + (blockIdx.y ? P * C : 0);
    double s = 0;
    if (c < C)
        for (i64 p = ty; p < P; p += 32) s += part[p * C + c];
    acc[ty][tx] = s;
    __syncthreads();
    if (ty != 0 || c >= C) return;
    for (int l = 1; l < 32; l++) s += acc[l][tx];
    if (blockIdx.y == 0) {
        if (ACC0) A0::st(a.t[0], c, A0::ld(a.t[0], c) + S0::round(a.t[1], c, (float)s));
        else A0::st(a.t[0], c, (float)s);
    } else {
        if (ACC1) A1::st(a.t[2], c, A1::ld(a.t[2], c) + S1::round(a.t[3], c, (float)s));
        else A1::st(a.t[2], c, (float)s);
    }
}

/* the statistics the weight gradient needs, into scratch: mean[R], rstd[R] (f64);
 * inputs as *_BWD_W (dy, x); i = {C, R}, f = {eps} */
template <int LN, int NV, class X> __device__ void ck_norm_stats(const CkArgs &a) {
    i64 C = a.i[0], R = a.i[1], r = CK_ROW_OF_WARP;
    if (r >= R) return;
    double mean, rstd;
    if (ck_row_in_registers<NV>(C) && X::vec_ok(a.t[2])) {
        float v[NV > 0 ? NV : 1][CK_VEC], m, rs;
        ck_row_load_stats<LN, (NV > 0 ? NV : 1), X>(a.t[2], r, C, a.f[0], v, &m, &rs);
        mean = m, rstd = rs;
    } else {
        ck_row_stats<LN, X>(a.t[2], r, C, a.f[0], &mean, &rstd);
    }
    if ((threadIdx.x & 31) == 0) {
        ((double *)a.scratch)[r] = mean;
        ((double *)a.scratch)[R + r] = rstd;
    }
}
