/* reduce.cuh — column and whole-tensor reductions, scales, group quantization, the embedding
 * backward.
 *
 * The kernels that reduce across a launch: column sums (bias gradients), softmax rows, sums of
 * squares and maxima over a whole tensor in two launches (fixed partitions write partials, one
 * block adds them in order: no float atomics), the per-tensor, per-row, per-group and per-block
 * scales made from them with the quantizations that read those scales, and the embedding's
 * backward (the tokens sorted by id, each row's gradients summed in order). Loaded after
 * norm.cuh. */

/* Column sums, first launch: grid (ceil(C/256), P), 256 threads as 32 column lanes x 8 row
 * lanes. A block takes 256 columns: where the tensors allow wide loads a column lane holds
 * CK_VEC consecutive columns (one load per row), else columns tx, tx + 32, ... Partition p of P
 * takes rows [p R / P, (p+1) R / P). MODE 0: sum_rows(x = t[1]); MODE 1: the norm weight
 * gradient, dy (t[1]) * xhat of x (t[2]) with the statistics at the start of scratch. Partials
 * go to scratch after the statistics: part[p][c] (f64), each the sum of its rows in order of
 * row lane, then over the 8 lanes in order. i = {C, R, P} */
template <int MODE, class X, class X2> __device__ void ck_colsum_partial(const CkArgs &a) {
    __shared__ double acc[8][8 * 32 + 1];
    i64 C = a.i[0], R = a.i[1], P = a.i[2], p = blockIdx.y;
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    i64 base = (i64)blockIdx.x * 256;
    i64 r0 = p * R / P, r1 = (p + 1) * R / P;
    const double *stats = (const double *)a.scratch;
    float s[CK_VEC];   /* a thread's rows (R / P / 8 of them) in f32; the rest in f64 */
    #pragma unroll
    for (int j = 0; j < CK_VEC; j++) s[j] = 0;
    bool vec = C % CK_VEC == 0 && X::vec_ok(a.t[1]) && (MODE == 0 || X2::vec_ok(a.t[2]));
    if (vec) {
        i64 c = base + tx * CK_VEC;
        if (c < C)
            for (i64 r = r0 + ty; r < r1; r += 8) {
                float v[CK_VEC], x[CK_VEC];
                X::ld_vec(a.t[1], r * C + c, v);
                if (MODE == 1) X2::ld_vec(a.t[2], r * C + c, x);
                float mean = MODE == 1 ? (float)stats[r] : 0.0f, rstd = MODE == 1 ? (float)stats[R + r] : 0.0f;
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) s[j] += MODE == 0 ? v[j] : v[j] * ((x[j] - mean) * rstd);
            }
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) acc[ty][tx * CK_VEC + j] = s[j];
    } else {
        for (i64 r = r0 + ty; r < r1; r += 8)
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                i64 c = base + tx + 32 * j;
                if (c >= C) break;
                if (MODE == 0) s[j] += X::ld(a.t[1], r * C + c);
                else s[j] += X::ld(a.t[1], r * C + c) * (float)((X2::ld(a.t[2], r * C + c) - stats[r]) * stats[R + r]);
            }
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) acc[ty][tx + 32 * j] = s[j];
    }
    __syncthreads();
    double *part = (double *)a.scratch + (MODE == 1 ? 2 * R : 0);
    for (int k = threadIdx.x; k < 256; k += blockDim.x) {
        if (base + k >= C) continue;
        double t = acc[0][k];
        for (int l = 1; l < 8; l++) t += acc[l][k];
        part[p * C + base + k] = t;
    }
}

/* second launch: grid ceil(C/32), blocks of 32 columns x LANES lanes (1, 8 or 32: spec_ops.c,
 * colsum_lanes); lane l adds the partials p = l, l + LANES, .. in order, then the LANES lanes
 * are added in order. y[c] = sum over p of part[p][c]; i = {C, R, P}. With 8 lanes for every
 * P, GPT-2 d12's 25 launches a step (512 partials of up to 3072 columns: 96 blocks) took 16
 * us each for 12 MB, a lane's 64 loads one after another. LANES is a template argument: read
 * from the block at run time, it made d12's bias sums 40% slower (results.md "(o)"). */
template <int MODE, int LANES> static __device__ bool ck_colsum_total(const CkArgs &a, i64 *col, double *total) {
    __shared__ double acc[LANES][33];
    i64 C = a.i[0], R = a.i[1], P = a.i[2];
    const double *part = (const double *)a.scratch + (MODE == 1 ? 2 * R : 0);
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    i64 c = (i64)blockIdx.x * 32 + tx;
    double s = 0;
    if (c < C) {
        #pragma unroll 4
        for (i64 p = ty; p < P; p += LANES) s += part[p * C + c];
    }
    if (LANES > 1) {
        acc[ty][tx] = s;
        __syncthreads();
    }
    if (ty != 0 || c >= C) return false;
    for (int l = 1; l < LANES; l++) s += acc[l][tx];
    *col = c, *total = s;
    return true;
}
template <int MODE, int LANES, class Y> __device__ void ck_colsum_final(const CkArgs &a) {
    i64 c;
    double s;
    if (ck_colsum_total<MODE, LANES>(a, &c, &s)) Y::st(a.t[0], c, (float)s);
}

/* The sum of a bias gradient, rounded as its own format S stores it (t[1]), added into its
 * accumulator (t[0], format A) as ck_accumulate adds: the sum and its accumulation in the
 * launch after a quantize that summed the tiles (spec.c, fuse_bias_grads). i = {C, R, P} */
template <int LANES, class A, class S> __device__ void ck_colsum_final_acc(const CkArgs &a) {
    i64 c;
    double s;
    if (ck_colsum_total<0, LANES>(a, &c, &s)) A::st(a.t[0], c, A::ld(a.t[0], c) + S::round(a.t[1], c, (float)s));
}

/* SOFTMAX (x) / SOFTMAX_BWD (dy, y): one block per row; i = {C} */
template <int BWD, class Y, class X0, class X1> __device__ void ck_softmax(const CkArgs &a) {
    i64 C = a.i[0], r = blockIdx.x;
    if (BWD) {
        double s = 0;
        for (i64 c = threadIdx.x; c < C; c += blockDim.x)
            s += (double)X0::ld(a.t[1], r * C + c) * X1::ld(a.t[2], r * C + c);
        s = ck_block_sum(s);
        for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
            float p = X1::ld(a.t[2], r * C + c);
            Y::st(a.t[0], r * C + c, (float)(p * (X0::ld(a.t[1], r * C + c) - s)));
        }
        return;
    }
    float m = -CK_INF;
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) m = fmaxf(m, X0::ld(a.t[1], r * C + c));
    m = ck_block_max(m);
    double s = 0;
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) s += exp((double)X0::ld(a.t[1], r * C + c) - m);
    s = ck_block_sum(s);
    for (i64 c = threadIdx.x; c < C; c += blockDim.x)
        Y::st(a.t[0], r * C + c, (float)(exp((double)X0::ld(a.t[1], r * C + c) - m) / s));
}

/* ---------------------------------------------------------------- whole-tensor reductions */

/* first launch of SQNORM, AMAX_RECORD and per-tensor QUANT_SCALE: block b of the grid
 * writes its partial (sum of squares, f64; or amax, f32, NaN ignored as fmaxf does) to
 * scratch[b]; x is t[X_AT] */
template <int SQ> static __device__ __forceinline__ void ck_fold(double &s, float &m, float v) {
    if (SQ) s += (double)v * v;
    else m = fmaxf(m, fabsf(v));
}
/* this thread's share of a grid-wide fold of x */
template <int SQ, class X> static __device__ __forceinline__ void ck_fold_tensor(const CkArgs &a, const CkTensor &x,
                                                                                double &s, float &m) {
    if (X::vec_ok(x)) {
        #pragma unroll 4
        CK_GRID_STRIDE(c, x.n / CK_VEC) {
            float v[CK_VEC];
            X::ld_vec(x, c * CK_VEC, v);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) ck_fold<SQ>(s, m, v[j]);
        }
    } else {
        CK_GRID_STRIDE(i, x.n) ck_fold<SQ>(s, m, X::ld(x, i));
    }
}
template <int SQ, int X_AT, class X> __device__ void ck_reduce_partial(const CkArgs &a) {
    double s = 0;
    float m = 0.0f;
    ck_fold_tensor<SQ, X>(a, a.t[X_AT], s, m);
    if (SQ) {
        s = ck_block_sum(s);
        if (threadIdx.x == 0) ((double *)a.scratch)[CK_BLOCK] = s;
    } else {
        m = ck_block_max(m);
        if (threadIdx.x == 0) ((float *)a.scratch)[CK_BLOCK] = m;
    }
}

/* first launch of SQNORM: the sum of squares of each chunk of i[0] (IR_SQNORM_CHUNK)
 * consecutive elements of x = t[1], in f64, to scratch[chunk]; a warp a chunk, the grid's warps
 * taking chunks in turn. The additions within a chunk follow its elements' places in it: lane
 * l adds the vectors l, l + 32, .. of CK_VEC elements in order (a square of a bf16 or f32 value
 * is exact in f64, so a contracted multiply-add rounds as the addition alone), then the warp's
 * fixed tree. Whether the vectors are loaded whole or element by element, and where the
 * tensor starts, changes no bit: a chunk's sum depends on its elements only, so a shard of the
 * tensor that starts on a chunk boundary (--shard-states, exec_shard.c) writes the whole
 * tensor's sums of its chunks. */
template <class X> __device__ void ck_sqnorm_chunks(const CkArgs &a) {
    const CkTensor &x = a.t[1];
    const i64 chunk = a.i[0], chunks = (x.n + chunk - 1) / chunk;
    const int lane = threadIdx.x & 31;
    const i64 warps = CK_BLOCKS * (blockDim.x >> 5);   /* this launch's (or batch item's) blocks */
    const bool vec = X::vec_ok(x);
    for (i64 c = CK_BLOCK * (blockDim.x >> 5) + (threadIdx.x >> 5); c < chunks; c += warps) {
        const i64 lo = c * chunk, hi = lo + chunk < x.n ? lo + chunk : x.n;
        double s = 0;
        #pragma unroll 4   /* loads in flight; the additions keep their order */
        for (i64 i = lo + (i64)lane * CK_VEC; i < hi; i += 32 * CK_VEC) {
            float v[CK_VEC];
            if (vec && i + CK_VEC <= hi) {
                X::ld_vec(x, i, v);
            } else {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) v[j] = i + j < hi ? X::ld(x, i + j) : 0.0f;
            }
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) s += (double)v[j] * v[j];
        }
        s = ck_warp_sum(s);
        if (lane == 0) ((double *)a.scratch)[c] = s;
    }
}

/* one block over the partials (read past L1: other blocks of the same launch may have
 * written them); i = {n_partials, ..} */
static __device__ double ck_partials_sum(const CkArgs &a) {
    double s = 0;
    for (i64 k = threadIdx.x; k < a.i[0]; k += blockDim.x) s += __ldcg((const double *)a.scratch + k);
    return ck_block_sum(s);
}
static __device__ float ck_partials_max(const float *parts, i64 n) {
    float m = 0.0f;
    for (i64 k = threadIdx.x; k < n; k += blockDim.x) m = fmaxf(m, __ldcg(parts + k));
    return ck_block_max(m);
}
static __device__ float ck_partials_max(const CkArgs &a) { return ck_partials_max((const float *)a.scratch, a.i[0]); }

/* Whether this block is the last of the launch to finish, after the partial result it wrote
 * (thread 0) is visible to all: blocks take tickets from a.ticket, and the last one sets it
 * back to zero for the next launch. The ticket is an acquire-release add at GPU scope: its
 * release orders the block's writes (thread 0's, and through the barrier the others') before
 * the ticket, its acquire makes the last block see every earlier block's: what a sequentially
 * consistent fence (__threadfence) before a plain add did, without ordering everything else
 * the thread has in flight. */
static __device__ bool ck_last_block(const CkArgs &a) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned ticket;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(ticket) : "l"(a.ticket) : "memory");
        last = ticket == gridDim.x - 1;
        if (last) atomicExch(a.ticket, 0u);
    }
    __syncthreads();
    return last;
}

/* SQNORM's last launch: the chunks' sums of ck_sqnorm_chunks added in a fixed order (each
 * thread its chunks in order, then the block's tree), i = {chunks}. It is also the gradient's
 * finite check (t[2], where the executor gives its flag: CuLaunch.check_flag): the squares
 * and their sums are f64, in which no bf16, f16 or f32 value's square nor a sum of 2^64 of
 * them overflows, so the sum is finite exactly when every element is, as ck_all_finite
 * finds; the f32 it stores may still overflow, which the check does not look at. */
template <class Y> __device__ void ck_sqnorm_final(const CkArgs &a) {
    double s = ck_partials_sum(a);
    if (threadIdx.x != 0) return;
    Y::st(a.t[0], 0, (float)s);
    if (a.t[2].p && !isfinite(s)) atomicOr((int *)a.t[2].p, 1);
}

/* per-tensor QUANT_SCALE, final launch: i = {n_partials, margin}, f = {max of elem} */
template <class Y> static __device__ void ck_store_scale(const CkArgs &a, float amax) {
    if (threadIdx.x == 0) Y::st(a.t[0], 0, ck_amax_usable(amax) ? ck_scale_for(a.f[0], amax, a.i[1]) : 1.0f);
}
template <class Y> __device__ void ck_quant_scale_final(const CkArgs &a) { ck_store_scale<Y>(a, ck_partials_max(a)); }

/* the scale of ck_amax_out's launch, by its last block (see there) */
static __device__ void ck_amax_scale_out(const CkArgs &a, const float *parts) {
    if (!ck_last_block(a)) return;
    float amax = ck_partials_max(parts, CK_BLOCKS < CK_AMAX_PARTS ? CK_BLOCKS : CK_AMAX_PARTS);
    if (threadIdx.x == 0) *a.scale_to = ck_amax_usable(amax) ? ck_scale_for(a.scale_max, amax, a.scale_margin) : 1.0f;
}

/* per-tensor QUANT_SCALE of a value whose producer left its block maxima (amax=1): one block
 * over the CK_AMAX_PARTS slots at byte i[CK_AMAX_AT] of t[1]; i = {.., margin}, f = {max} */
template <class Y> __device__ void ck_quant_scale_parts(const CkArgs &a) {
    const float *parts = (const float *)((const char *)a.t[1].p + a.i[CK_AMAX_AT]);
    ck_store_scale<Y>(a, ck_partials_max(parts, CK_AMAX_PARTS));
}

/* the block maxima of t[0] (amax=1) where its producer does not write them (a GEMM epilogue,
 * an ADD_N of many inputs): a pass over the stored value */
template <class X> __device__ void ck_amax_parts(const CkArgs &a) {
    double s = 0;
    float m = 0.0f;
    ck_fold_tensor<0, X>(a, a.t[0], s, m);
    ck_amax_out<X>(a, m);
}

/* per-tensor QUANT_SCALE in one launch: the amax partials, then the last block's final;
 * i = {n_partials = the grid, margin}, f = {max of elem} */
template <class Y, class X> __device__ void ck_quant_scale_tensor(const CkArgs &a) {
    ck_reduce_partial<0, 1, X>(a);
    if (ck_last_block(a)) ck_quant_scale_final<Y>(a);
}

/* --shard-states=3 (cuda/exec_gather.c): a weight gathered in e4m3. Each rank finds its
 * shard's amax (t[1]: the shard, X; the block maxima in scratch, the last block's maximum at
 * t[0], one f32; i = {n_partials = the grid}), NCCL takes the ranks' maximum, which is the
 * whole tensor's, and the scale is stored from it as ck_quant_scale_tensor stores it (t[0]:
 * the scale, Y; t[1]: the amax, f32; i = {.., margin}, f = {max of elem}): every rank
 * derives the unsharded QUANT_SCALE's bits. The last-block ticket is the gather's own: these
 * run on NCCL's stream beside the step's kernels. */
template <class X> __device__ void ck_gather_amax(const CkArgs &a) {
    ck_reduce_partial<0, 1, X>(a);
    if (ck_last_block(a)) {
        float m = ck_partials_max(a);
        if (threadIdx.x == 0) ((float *)a.t[0].p)[0] = m;
    }
}
template <class Y> __device__ void ck_gather_scale(const CkArgs &a) { ck_store_scale<Y>(a, ((const float *)a.t[1].p)[0]); }

/* AMAX_RECORD (history (H), x), final launch: shift the history, record amax at 0 */
template <class H> __device__ void ck_amax_record_final(const CkArgs &a) {
    float m = ck_partials_max(a);
    if (threadIdx.x) return;
    i64 n = a.t[0].n;
    for (i64 k = n - 1; k > 0; k--) H::st(a.t[0], k, H::ld(a.t[0], k - 1));
    H::st(a.t[0], 0, m);
}

/* DELAYED_SCALE (scale state, history): i = {use_max, margin}, f = {max of elem} */
template <class S, class H> __device__ void ck_delayed_scale(const CkArgs &a) {
    if (CK_BLOCK || threadIdx.x) return;
    double amax = H::ld(a.t[1], 0);
    if (a.i[0])
        for (i64 k = 1; k < a.t[1].n; k++) amax = fmax(amax, (double)H::ld(a.t[1], k));
    if (ck_amax_usable(amax)) S::st(a.t[0], 0, ck_scale_for(a.f[0], amax, a.i[1]));
}

/* QUANT_SCALE per row (one block per row), per group and 1x128 tiles (one thread per
 * group), per 128x128 block (one block per block); i = {n, margin, group}, f = {max} */
template <class Y, class X> __device__ void ck_quant_scale_row(const CkArgs &a) {
    const CkTensor &x = a.t[1];
    i64 r = blockIdx.x, C = x.cols;
    float m = 0.0f;
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) m = fmaxf(m, fabsf(X::ld(x, r * C + c)));
    m = ck_block_max(m);
    if (threadIdx.x == 0) Y::st(a.t[0], r, ck_amax_usable(m) ? ck_scale_for(a.f[0], m, a.i[1]) : 1.0f);
}
/* How values are scaled into per-group (or 1x128 tile) scales: the largest value of the copy's
 * element type, the margin, the group; from f[F] and i[I], i[I + 1] of a launch's arguments
 * (QUANT_SCALE and QUANTIZE: f[0], i[1], i[2]) */
struct CkGroupQ {
    double fmax;
    i64 margin, G;
    float fmax32;   /* fmax where it is an f32 and the margin 0, else 0 (ck_group_scale_of) */
};
template <int F, int I> static __device__ __forceinline__ CkGroupQ ck_group_q(const CkArgs &a) {
    float f = (float)a.f[F];
    return CkGroupQ{a.f[F], a.i[I], a.i[I + 1], (double)f == a.f[F] && a.i[I] == 0 ? f : 0.0f};
}
/* a group's scale from its largest |x|, m (1 for none usable): ck_scale_for's, through f32's
 * own division where the margin is 0 and the largest value an f32 (ck_group_quotient, the
 * same bits) */
static __device__ __forceinline__ float ck_group_scale_of(const CkGroupQ &gq, float m) {
    if (gq.fmax32 != 0.0f) return m > 0.0f && m < CK_INF ? ck_group_quotient(gq.fmax32, m) : 1.0f;
    return ck_amax_usable(m) ? ck_scale_for(gq.fmax, m, gq.margin) : 1.0f;
}

/* the scale of group k of x (G elements of a row, the last one of a row possibly shorter),
 * from its largest |x| */
template <class X> static __device__ __forceinline__ float ck_group_scale(const CkGroupQ &gq, const CkTensor &x, i64 k) {
    i64 G = gq.G, C = x.cols, ncg = (C + G - 1) / G;
    i64 r = k / ncg, c0 = (k - r * ncg) * G, c1 = c0 + G < C ? c0 + G : C;
    float m = 0.0f;
    for (i64 c = c0; c < c1; c++) m = fmaxf(m, fabsf(X::ld(x, r * C + c)));
    return ck_group_scale_of(gq, m);
}

/* Groups of whole vectors: G a multiple of CK_VEC, G / CK_VEC lanes a power of two within a
 * warp, rows of whole groups, x readable in vectors. A thread then takes one vector, and the
 * lanes of a group (adjacent in their warp) take its maximum by shuffles: one wide load per
 * thread instead of G narrow ones. The maximum is exact in any order, so the scale is the
 * scalar loop's bit for bit. */
template <class X> static __device__ __forceinline__ bool ck_group_vec_ok(const CkTensor &x, i64 G) {
    i64 L = G / CK_VEC;
    return G % CK_VEC == 0 && L <= 32 && (L & (L - 1)) == 0 && x.cols % G == 0 && X::vec_ok(x);
}

/* The vectors of x, a thread each, in a grid-stride loop that every lane of a warp runs the same
 * number of times (the shuffles need whole warps; a group is wholly in range or out of it):
 * f(vector index, its values, whether it is in range, its group's scale) */
template <class X, class Fn> static __device__ __forceinline__ void ck_group_vectors(const CkArgs &a, const CkGroupQ &gq,
                                                                                   const CkTensor &x, Fn f) {
    int L = (int)(gq.G / CK_VEC), lane = threadIdx.x & 31;
    i64 nv = x.n / CK_VEC;
    for (i64 c = CK_BLOCK * blockDim.x + threadIdx.x; c - lane < nv; c += CK_BLOCKS * blockDim.x) {
        bool live = c < nv;
        float v[CK_VEC], m = 0.0f;
        if (live) {
            X::ld_vec(x, c * CK_VEC, v);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) m = fmaxf(m, fabsf(v[j]));
        }
        for (int o = L / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        f(c, v, live && (lane & (L - 1)) == 0, ck_group_scale_of(gq, m));
    }
}

template <class Y, class X> __device__ void ck_quant_scale_group(const CkArgs &a) {
    const CkTensor &x = a.t[1];
    const CkGroupQ gq = ck_group_q<0, 1>(a);
    if (ck_group_vec_ok<X>(x, gq.G)) {
        int shift = __ffs((int)(gq.G / CK_VEC)) - 1;
        ck_group_vectors<X>(a, gq, x, [&](i64 c, const float *, bool first, float sc) {
            if (first) Y::st(a.t[0], c >> shift, sc);
        });
        return;
    }
    CK_GRID_STRIDE(k, a.t[0].n) Y::st(a.t[0], k, ck_group_scale<X>(gq, x, k));
}

/* group k of x (G elements of a row, the last one of a row possibly shorter) into the copy q
 * through its scale, which goes to q's scale array: ck_quantize_group's scalar path */
template <class Q, class X> static __device__ __forceinline__ void ck_group_store(const CkGroupQ &gq, const CkTensor &x,
                                                                                 const CkTensor &q, i64 k) {
    i64 G = gq.G, C = x.cols, ncg = (C + G - 1) / G;
    float raw = ck_group_scale<X>(gq, x, k), sc = Q::scale_round(raw);
    Elem<Q::scale_elem>::st((void *)q.s, k, raw);
    i64 r = k / ncg, c0 = (k - r * ncg) * G, c1 = c0 + G < C ? c0 + G : C;
    for (i64 c = c0; c < c1; c++) Elem<Q::elem>::st(q.p, r * C + c, X::ld(x, r * C + c) * sc);
}

/* QUANTIZE into per-group (or 1x128 tile) scales together with the QUANT_SCALE that makes
 * them, at the quantize's place (spec.c: fuse_group_quantizes): the group's scale goes to the
 * result's scale array and its elements are stored through it, as read back. One pass over x
 * instead of two; the bits of the unfused pair. t[0] = the result (its scale array written
 * here), t[1] = x; i = {.., margin, group}, f = {max of elem} */
template <class Y, class X> __device__ void ck_quantize_group(const CkArgs &a) {
    const CkTensor &x = a.t[1], &y = a.t[0];
    const CkGroupQ gq = ck_group_q<0, 1>(a);
    void *sp = (void *)y.s;
    if (ck_group_vec_ok<X>(x, gq.G) && Y::vec_ok(y)) {
        int shift = __ffs((int)(gq.G / CK_VEC)) - 1;
        ck_group_vectors<X>(a, gq, x, [&](i64 c, const float *v, bool first, float sc) {
            if (first) Elem<Y::scale_elem>::st(sp, c >> shift, sc);
            if (c < x.n / CK_VEC) Y::st_vec_scaled(y, c * CK_VEC, v, Y::scale_round(sc));
        });
        return;
    }
    i64 ncg = (x.cols + gq.G - 1) / gq.G;
    CK_GRID_STRIDE(k, x.rows * ncg) ck_group_store<Y, X>(gq, x, y, k);
}
/* GELU or SILU (as ck_unary: t[0] = y, t[1] = x) that also writes x's copy into per-group
 * scales, t[3], with the scales (the fused pair of ck_quantize_group, moved here:
 * spec_fuse.c, fuse_input_group_copies): x is read once for both, where the quantize and the
 * activation each read it. i = {.., margin, group, .., amax at}, f = {max of the copy's elem}.
 * The copy's bytes are ck_quantize_group's, y's and its block maxima ck_unary's. */
template <int OP, class Y, class X, class Q> __device__ void ck_unary_group(const CkArgs &a) {
    const CkTensor &x = a.t[1], &q = a.t[3];
    const CkGroupQ gq = ck_group_q<0, 1>(a);
    void *sp = (void *)q.s;
    float m = 0.0f;
    if (ck_group_vec_ok<X>(x, gq.G) && Q::vec_ok(q) && Y::vec_ok(a.t[0])) {
        int shift = __ffs((int)(gq.G / CK_VEC)) - 1;
        i64 nv = x.n / CK_VEC;
        ck_group_vectors<X>(a, gq, x, [&](i64 c, const float *v, bool first, float sc) {
            if (first) Elem<Q::scale_elem>::st(sp, c >> shift, sc);
            if (c >= nv) return;
            Q::st_vec_scaled(q, c * CK_VEC, v, Q::scale_round(sc));
            float r[CK_VEC];
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                r[j] = ck_unop<OP>(v[j], 0.0f);
                m = fmaxf(m, fabsf(r[j]));
            }
            Y::st_vec(a.t[0], c * CK_VEC, r);
        });
    } else {
        i64 ncg = (x.cols + gq.G - 1) / gq.G;
        CK_GRID_STRIDE(k, x.rows * ncg) ck_group_store<Q, X>(gq, x, q, k);
        CK_GRID_STRIDE(i, a.t[0].n) {
            float v = ck_unop<OP>(X::ld(x, i), 0.0f);
            m = fmaxf(m, fabsf(v));
            Y::st(a.t[0], i, v);
        }
    }
    ck_amax_out<Y>(a, m);
}

/* ---------------------------------------------------------------- a product writing its inputs' group copies
 * ADD, SUB or MUL of two inputs of one size (as ck_binary; A may be CkAct, an activation
 * computed from its input) that also writes each input's copy into per-group scales
 * (spec_fuse.c, fuse_product_group_copies): SwiGLU's silu(gate) * up writes gate's and up's
 * 1x16 copies, which the backward reads, from the vectors it reads, as qgroup's launches would
 * write them. QA, QB: the copies' formats, or CkNoCopy where that input has none. t[0] = y,
 * t[1], t[2] the inputs as stored (an activation's input in its slot), t[3], t[4] the copies;
 * i = {.., margin A, group A, margin B, group B, .., amax at}, f = {max of QA's elem, QB's}. */
struct CkNoCopy {};
template <class Q> struct CkHasCopy { static constexpr bool v = true; };
template <> struct CkHasCopy<CkNoCopy> { static constexpr bool v = false; };

/* vector c (its values v, in range where live) into copy q, the group's lanes taking its
 * largest |v| by shuffles (every lane of the warp calls it: ck_group_vectors' loop) */
template <class Q> static __device__ __forceinline__ void ck_vec_group_store(const CkTensor &q, const CkGroupQ &gq, i64 c,
                                                                           const float *v, bool live) {
    int L = (int)(gq.G / CK_VEC), lane = threadIdx.x & 31;
    float m = 0.0f;
    if (live)
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) m = fmaxf(m, fabsf(v[j]));
    for (int o = L / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float sc = ck_group_scale_of(gq, m);
    if (!live) return;
    if ((lane & (L - 1)) == 0) Elem<Q::scale_elem>::st((void *)q.s, c / L, sc);
    Q::st_vec_scaled(q, c * CK_VEC, v, Q::scale_round(sc));
}

/* whether input slot x (stored as X) takes the vector path with its copy q (Q, or none) */
template <class X, class Q> static __device__ __forceinline__ bool ck_copy_vec_ok(const CkTensor &x, const CkTensor &q,
                                                                                const CkGroupQ &gq) {
    if constexpr (CkHasCopy<Q>::v) return ck_group_vec_ok<X>(x, gq.G) && Q::vec_ok(q);
    return X::vec_ok(x);
}

template <int OP, class Y, class A, class B, class QA, class QB> __device__ void ck_binary_group(const CkArgs &a) {
    using XA = typename CkSource<A>::X;
    using XB = typename CkSource<B>::X;
    const CkTensor &xa = a.t[1], &xb = a.t[2], &qa = a.t[3], &qb = a.t[4];
    const CkGroupQ ga = ck_group_q<0, 1>(a), gb = ck_group_q<1, 3>(a);
    i64 n = a.t[0].n;
    float m = 0.0f;
    if (Y::vec_ok(a.t[0]) && ck_copy_vec_ok<XA, QA>(xa, qa, ga) && ck_copy_vec_ok<XB, QB>(xb, qb, gb)) {
        i64 nv = n / CK_VEC;
        int lane = threadIdx.x & 31;
        for (i64 c = CK_BLOCK * blockDim.x + threadIdx.x; c - lane < nv; c += CK_BLOCKS * blockDim.x) {
            bool live = c < nv;
            float x[CK_VEC], y[CK_VEC];
            if (live) {
                XA::ld_vec(xa, c * CK_VEC, x);
                XB::ld_vec(xb, c * CK_VEC, y);
            }
            if constexpr (CkHasCopy<QA>::v) ck_vec_group_store<QA>(qa, ga, c, x, live);
            if constexpr (CkHasCopy<QB>::v) ck_vec_group_store<QB>(qb, gb, c, y, live);
            if (!live) continue;
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                i64 i = c * CK_VEC + j;
                x[j] = ck_binop<OP>(CkSource<A>::value(xa, i, x[j]), CkSource<B>::value(xb, i, y[j]));
                m = fmaxf(m, fabsf(x[j]));
            }
            Y::st_vec(a.t[0], c * CK_VEC, x);
        }
    } else {
        if constexpr (CkHasCopy<QA>::v)
            CK_GRID_STRIDE(k, xa.rows * ((xa.cols + ga.G - 1) / ga.G)) ck_group_store<QA, XA>(ga, xa, qa, k);
        if constexpr (CkHasCopy<QB>::v)
            CK_GRID_STRIDE(k, xb.rows * ((xb.cols + gb.G - 1) / gb.G)) ck_group_store<QB, XB>(gb, xb, qb, k);
        CK_GRID_STRIDE(i, n) {
            float v = ck_binop<OP>(A::ld(xa, i), B::ld(xb, i));
            m = fmaxf(m, fabsf(v));
            Y::st(a.t[0], i, v);
        }
    }
    ck_amax_out<Y>(a, m);
}

/* A norm's input row r into its copy Q (t[4]) in groups of G = i[3] with their scales
 * (margin i[2], f[1] the max of Q's elem): the bytes of ck_quantize_group. From the row's
 * vectors in registers (ck_norm_row's layout: lane l holds vectors l, l + 32, ..) where
 * ck_norm_group_vec_ok: the lanes of a group are adjacent and take its maximum by shuffles. */
template <int NV, class Q> __device__ __forceinline__ void ck_row_group_store(const CkArgs &a, i64 r, i64 C,
                                                                             const float (&v)[NV][CK_VEC]) {
    const CkTensor &q = a.t[4];
    i64 G = a.i[3];
    int lane = threadIdx.x & 31, L = (int)(G / CK_VEC);
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        bool live = c < C;
        float m = 0.0f;
        if (live)
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) m = fmaxf(m, fabsf(v[k][j]));
        for (int o = L / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float sc = ck_group_scale_of(ck_group_q<1, 2>(a), m);
        if (!live) continue;
        if ((lane & (L - 1)) == 0) Elem<Q::scale_elem>::st((void *)q.s, (r * C + c) / G, sc);
        Q::st_vec_scaled(q, r * C + c, v[k], Q::scale_round(sc));
    }
}
template <int NV, class X, class Q> __device__ __forceinline__ bool ck_norm_group_vec_ok(const CkArgs &a) {
    i64 G = a.i[3], L = G / CK_VEC;
    return G % CK_VEC == 0 && L <= 32 && (L & (L - 1)) == 0 && a.i[0] % G == 0 && Q::vec_ok(a.t[4]);
}

/* the same, an element at a time, a lane per group (any row and format); written out rather
 * than through ck_group_store, which took ck_norm_group from 64 registers to 96 (ptxas, sm_90a) */
template <class X, class Q> __device__ __forceinline__ void ck_row_group_copy(const CkArgs &a, i64 r, i64 C) {
    const CkTensor &x = a.t[1], &q = a.t[4];
    i64 G = a.i[3], ncg = (C + G - 1) / G;
    for (i64 g = threadIdx.x & 31; g < ncg; g += 32) {
        i64 c0 = g * G, c1 = c0 + G < C ? c0 + G : C;
        float m = 0.0f;
        for (i64 c = c0; c < c1; c++) m = fmaxf(m, fabsf(X::ld(x, r * C + c)));
        float raw = ck_group_scale_of(ck_group_q<1, 2>(a), m), sc = Q::scale_round(raw);
        Elem<Q::scale_elem>::st((void *)q.s, r * ncg + g, raw);
        for (i64 c = c0; c < c1; c++) Elem<Q::elem>::st(q.p, r * C + c, X::ld(x, r * C + c) * sc);
    }
}

/* a staged norm's row (norm.cuh, ck_staged_rows) into its input's copy, as above; its
 * statistics to Stats (norm.cuh: CkNoRowCopy, CkRowStats) */
template <class Q, class Stats = CkNoRowCopy> struct CkRowGroupCopy {
    template <int NV> static __device__ __forceinline__ void row(const CkArgs &a, i64 r, i64 C, const float (&v)[NV][CK_VEC]) {
        ck_row_group_store<NV, Q>(a, r, C, v);
    }
    static __device__ __forceinline__ void stats(const CkArgs &a, i64 r, float mean, float rstd) {
        Stats::stats(a, r, mean, rstd);
    }
};

/* LAYERNORM / RMSNORM (as ck_norm) that also writes its input's copy into per-group scales
 * (t[4]; spec_fuse.c, fuse_input_group_copies) from the row it holds: x is read once for
 * both. ST: 0, or the rows staged through slots of ST bytes, as ck_norm's (the copy from the
 * values as staged: the same bits). Unstaged, Llama 1.1B's RMSNorm with its copy took 0.059
 * ms a launch where the staged one without it took 0.019 (H200, docs/results.md "(q)").
 * i = {C, R, margin, group, .., amax at}, f = {eps, max of Q's elem}. Stats: as ck_norm's. */
template <int LN, int NV, int ST, class Y, class X, class W, class B, class Q, class Stats = CkNoRowCopy>
__device__ void ck_norm_group(const CkArgs &a) {
    constexpr int N = NV > 0 ? NV : 1;
    i64 C = a.i[0];
    bool vec = ck_norm_vec_ok<NV, Y, X, W, B, LN>(a) && ck_norm_group_vec_ok<NV, X, Q>(a);
    float m = 0.0f;
    if constexpr (ST > 0)
        if (vec) {
            m = ck_staged_norm_rows<LN, NV, ST, Y, X, W, B, CkRowGroupCopy<Q, Stats>>(a, CK_ROW_OF_WARP, CK_ROW_STRIDE,
                                                                                   a.i[1]);
            ck_amax_out<Y>(a, m);
            return;
        }
    CK_ROWS_OF_WARP(r, a.i[1]) {
        if (vec) {
            float v[N][CK_VEC], mean, rstd;
            ck_row_load_stats<LN, N, X>(a.t[1], r, C, a.f[0], v, &mean, &rstd);
            Stats::stats(a, r, mean, rstd);
            ck_row_group_store<N, Q>(a, r, C, v);
            m = fmaxf(m, ck_norm_row_out<LN, N, Y, W, B>(a, r, C, v, mean, rstd));
        } else {
            ck_row_group_copy<X, Q>(a, r, C);
            m = fmaxf(m, ck_norm_row_scalar<LN, Y, X, W, B, Stats>(a, r));
        }
    }
    ck_amax_out<Y>(a, m);
}

template <class Y, class X> __device__ void ck_quant_scale_block(const CkArgs &a) {
    const CkTensor &x = a.t[1];
    i64 C = x.cols, R = x.rows, ncb = (C + 127) / 128, k = blockIdx.x;
    i64 r0 = (k / ncb) * 128, c0 = (k % ncb) * 128;
    float m = 0.0f;
    for (int e = threadIdx.x; e < 128 * 128; e += blockDim.x) {
        i64 r = r0 + e / 128, c = c0 + e % 128;
        if (r < R && c < C) m = fmaxf(m, fabsf(X::ld(x, r * C + c)));
    }
    m = ck_block_max(m);
    if (threadIdx.x == 0) Y::st(a.t[0], k, ck_amax_usable(m) ? ck_scale_for(a.f[0], m, a.i[1]) : 1.0f);
}

/* ---------------------------------------------------------------- embedding backward
 * dtable[v] = the sum of dy over the rows whose id is v, those rows in row order (as the
 * reference sums them). The rows are bucketed by id with integer atomics (a counting sort
 * whose order inside a bucket depends on timing), then each bucket is sorted by row index
 * before its rows are summed, so the sum's order — and its bits — never change.
 * Scratch (int): count[V + 1], first[V + 1], fill[V], order[R], sorted[R]; i = {V, C, R} */

__device__ void ck_eb_zero(const CkArgs &a) {
    int *count = (int *)a.scratch;
    CK_GRID_STRIDE(v, a.i[0] + 1) count[v] = 0;
}

template <class I> __device__ void ck_eb_count(const CkArgs &a) {
    i64 V = a.i[0];
    int *count = (int *)a.scratch;
    CK_GRID_STRIDE(r, a.i[2]) {
        float id = I::ld(a.t[2], r);
        if (id >= 0.0f && id < (float)V) atomicAdd(&count[(i64)id], 1);
    }
}

/* one block of 1024: exclusive scan of count into first, fill = first */
__device__ void ck_eb_scan(const CkArgs &a) {
    __shared__ int carry;
    __shared__ int warp_sums[32];
    i64 V = a.i[0];
    int *count = (int *)a.scratch, *first = count + V + 1, *fill = first + V + 1;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (i64 base = 0; base <= V; base += blockDim.x) {
        i64 v = base + threadIdx.x;
        int x = v < V ? count[v] : 0, incl = x;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) warp_sums[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            int w = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                int y = __shfl_up_sync(0xffffffffu, w, o);
                if (lane >= o) w += y;
            }
            warp_sums[lane] = w;
        }
        __syncthreads();
        int excl = carry + (warp ? warp_sums[warp - 1] : 0) + incl - x;
        if (v <= V) first[v] = excl;
        if (v < V) fill[v] = excl;
        __syncthreads();
        if (threadIdx.x == blockDim.x - 1) carry = excl + x;
        __syncthreads();
    }
}

template <class I> __device__ void ck_eb_scatter(const CkArgs &a) {
    i64 V = a.i[0], R = a.i[2];
    int *first = (int *)a.scratch + V + 1, *fill = first + V + 1, *order = fill + V;
    CK_GRID_STRIDE(r, R) {
        float id = I::ld(a.t[2], r);
        if (id >= 0.0f && id < (float)V) order[atomicAdd(&fill[(i64)id], 1)] = (int)r;
    }
}

/* exclusive prefix sum over the block of one int a thread (blockDim.x a multiple of 32) */
static __device__ int ck_block_excl_scan(int x) {
    __shared__ int warp_sums[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, incl = x;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    __syncthreads();
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; w++) before += warp_sums[w];
    return before + incl - x;
}

enum { CK_EB_SMALL = 64, CK_EB_WORDS = 4096 };

/* one block per id: its bucket of rows, in the scatter's order (which atomics make arbitrary),
 * sorted by row, so that the sums add in row order and every run gives the same bits. A bucket
 * of at most 64 rows ranks each row by counting the smaller ones. A larger one (a frequent
 * token, for which k^2 comparisons take milliseconds) sets its rows' bits in a bitmap of all R
 * rows in shared memory and reads them back in order; batches of more than 32 x 4096 rows,
 * whose bitmap would not fit, rank. */
__device__ void ck_eb_sort(const CkArgs &a) {
    __shared__ unsigned bits[CK_EB_WORDS];
    i64 V = a.i[0], R = a.i[2], v = blockIdx.x;
    int *first = (int *)a.scratch + V + 1, *order = first + 2 * (V + 1) - 1, *sorted = order + R;
    int lo = first[v], k = first[v + 1] - lo;
    if (k <= CK_EB_SMALL || R > 32 * (i64)CK_EB_WORDS) {
        for (int e = threadIdx.x; e < k; e += blockDim.x) {
            int row = order[lo + e], rank = 0;
            for (int j = 0; j < k; j++) rank += order[lo + j] < row;
            sorted[lo + rank] = row;
        }
        return;
    }
    int words = (int)((R + 31) / 32);
    for (int w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0;
    __syncthreads();
    for (int e = threadIdx.x; e < k; e += blockDim.x) {
        int row = order[lo + e];
        atomicOr(&bits[row >> 5], 1u << (row & 31));
    }
    __syncthreads();
    int per = (words + (int)blockDim.x - 1) / (int)blockDim.x;
    int w0 = min((int)threadIdx.x * per, words), w1 = min(w0 + per, words), n = 0;
    for (int w = w0; w < w1; w++) n += __popc(bits[w]);
    int at = lo + ck_block_excl_scan(n);
    for (int w = w0; w < w1; w++)
        for (unsigned b = bits[w]; b; b &= b - 1) sorted[at++] = w * 32 + __ffs(b) - 1;
}

/* Row v of the result, one slice of blockDim.x of its columns at a time, the blocks striding
 * over the V x slices (row, slice) items: the sum of bucket v's dy rows in f64 (zero for an
 * id no row has: at byte-level text all but some 200 of GPT-2's 50304). A bucket of up to
 * CK_EB_SPLIT rows is summed by a thread per column in row order. A larger one (a frequent id:
 * at byte-level text a space is some 15% of the rows, thousands in one bucket, which a thread
 * per column walked alone while the GPU idled) is cut into the block's warps' shares, each
 * lane taking CK_VEC columns of the slice with wide loads, four rows in flight; the shares'
 * sums are then added in warp order. The cut depends on the bucket's size only, so the order
 * of the additions, and the bits, are the same in every run; in f64 the sums of bf16 or f32
 * rows are exact unless their magnitudes span some 2^20 or more, so they are the row-order
 * sum's but for such extremes. */
enum { CK_EB_SPLIT = 64, CK_EB_THREADS = 256 };
template <class Y, class DY> __device__ void ck_eb_sum(const CkArgs &a) {
    __shared__ double part[CK_EB_THREADS / 32][CK_EB_THREADS];
    i64 V = a.i[0], C = a.i[1], R = a.i[2], slices = (C + CK_EB_THREADS - 1) / CK_EB_THREADS;
    const int *first = (const int *)a.scratch + V + 1, *sorted = first + 2 * (V + 1) - 1 + R;
    const int warps = CK_EB_THREADS / 32, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    bool vec = C % CK_VEC == 0 && DY::vec_ok(a.t[1]);
    for (i64 item = CK_BLOCK; item < V * slices; item += CK_BLOCKS) {
        i64 v = item / slices, c0 = (item - v * slices) * CK_EB_THREADS, c = c0 + threadIdx.x;
        int lo = first[v], k = first[v + 1] - lo;
        if (k <= CK_EB_SPLIT || !vec) {
            if (c >= C) continue;
            int j = 0;
            double s = 0;
            /* sixteen rows' loads in flight at a time, added in row order */
            for (; j + 16 <= k; j += 16) {
                float x[16];
                #pragma unroll
                for (int u = 0; u < 16; u++) x[u] = DY::ld(a.t[1], (i64)sorted[lo + j + u] * C + c);
                #pragma unroll
                for (int u = 0; u < 16; u++) s += x[u];
            }
            for (; j < k; j++) s += DY::ld(a.t[1], (i64)sorted[lo + j] * C + c);
            Y::st(a.t[0], v * C + c, (float)s);
            continue;
        }
        /* warp w: rows [lo + w k / warps, lo + (w + 1) k / warps), columns c0 + CK_VEC lane .. */
        int r = lo + (int)((i64)warp * k / warps), r1 = lo + (int)((i64)(warp + 1) * k / warps);
        i64 cl = c0 + (i64)lane * CK_VEC;
        double acc[CK_VEC];
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) acc[j] = 0;
        if (cl < C) {
            for (; r + 4 <= r1; r += 4) {
                float x[4][CK_VEC];
                #pragma unroll
                for (int u = 0; u < 4; u++) DY::ld_vec(a.t[1], (i64)sorted[r + u] * C + cl, x[u]);
                #pragma unroll
                for (int u = 0; u < 4; u++)
                    #pragma unroll
                    for (int j = 0; j < CK_VEC; j++) acc[j] += x[u][j];
            }
            for (; r < r1; r++) {
                float x[CK_VEC];
                DY::ld_vec(a.t[1], (i64)sorted[r] * C + cl, x);
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) acc[j] += x[j];
            }
        }
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) part[warp][(lane * CK_VEC + j) % CK_EB_THREADS] = acc[j];
        __syncthreads();
        if (c < C) {
            double s = 0;
            for (int w = 0; w < warps; w++) s += part[w][threadIdx.x];
            Y::st(a.t[0], v * C + c, (float)s);
        }
        __syncthreads();
    }
}
