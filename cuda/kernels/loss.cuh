/* loss.cuh — the cross entropy of the output head: its row losses, their mean, its gradient,
 * and the forward and backward of a row in one pass.
 *
 * These are the "rows" kernels of the loss (ops.cuh's conventions: one block a row, block
 * reductions, no float atomics, the reference executor's formulas with its f64 sums), kept in
 * a file of their own because the loss has a shape of its own: a row is a whole vocabulary
 * (50304 logits for GPT-2, 98 KiB in bf16), so how a row is held (registers, shared memory, or
 * read twice), how many threads share it and how its exponentials are taken decide the loss's
 * speed. Those are the choices ce.threads, ce.shared and ce.exp2 (cuda/spec_ops.c,
 * ce_rows_chosen); the fused and unfused launches follow the same choices, so that each gives
 * the other's bits. Included after ops.cuh (and norm.cuh, reduce.cuh, gemm_io.cuh), whose block reductions it uses. */

/* e^(x - m) for the values of a row against one m, the way the cross entropy's kernels take it
 * (the choice ce.exp2, spec_ops.c): EX2 = 0, expf(x - m), within an ulp or two of e^(x - m) and
 * some ten instructions a value; EX2 = 1, the hardware's 2^y (ex2.approx.ftz) at
 * y = x log2(e) - m log2(e), one fused multiply-add and one special-function instruction,
 * relative error about 1e-6 for logits up to some tens (the rounding of m log2(e) and of y;
 * results under 2^-126 flush to 0). A row costs two exponentials a logit, the loss's sum and
 * the gradient, and GPT-2's 50304 logits a row made those instructions as many as the memory's
 * cycles. Infinities and NaN come out as from expf: +inf - +inf and NaN give NaN, -inf gives 0. */
#define CK_LOG2E 1.4426950408889634f
template <int EX2> struct CkExpFrom {
    float m, mb;
    __device__ __forceinline__ explicit CkExpFrom(float m_) : m(m_), mb(m_ * CK_LOG2E) {}
    __device__ __forceinline__ float operator()(float x) const {
        if (!EX2) return expf(x - m);
        float y;
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(__fmaf_rn(x, CK_LOG2E, -mb)));
        return y;
    }
};

/* One pass over a row for its log-sum-exp: each thread keeps the largest value it has seen, m,
 * and the sum of exp(x - m) over its values, brought to a new m when a larger value comes
 * (s exp(m_old - m_new), the exponential taken as the row's others are: CkExpFrom); the block
 * then brings every thread's sum to the row's maximum and adds them. A row of GPT-2's 50304
 * logits is then read once, eight elements a load where the row allows, instead of once for
 * the maximum and again for the sum. The sum differs from the two-pass sum by the rounding of
 * the rescalings (relative 1e-7 each with expf, 1e-6 with ex2.approx: as much as one term's).
 * The rescaling was an f64 exp, whose software sequence (its multiply-adds in f64 and their
 * constants moved through uniform registers) made a fifth of the one pass's instructions on
 * GPT-2's rows (ncu, an H200), where the pass is bound by its instructions. As in the
 * reference, a NaN or +inf logit makes the row's result NaN and a -inf logit adds nothing. */
template <int EX2> static __device__ __forceinline__ void ck_lse_fold(float &m, double &s, const float *v, int n) {
    float mx = m;
    for (int j = 0; j < n; j++) mx = fmaxf(mx, v[j]);
    if (mx > m) {
        s *= (double)CkExpFrom<EX2>(mx)(m);   /* e^(m - mx); 0 where m is -inf */
        m = mx;
    }
    CkExpFrom<EX2> e(m);
    float t = 0;
    for (int j = 0; j < n; j++) t += e(v[j]);
    s += t;
}

/* the block's log-sum-exp from each thread's (m, s) of ck_lse_fold; every thread gets it */
static __device__ __forceinline__ double ck_lse_block(float m, double s) {
    float M = ck_block_max(m);
    if (m != M) s *= m == -CK_INF ? 0.0 : exp((double)m - M);   /* a thread without values: 0 */
    s = ck_block_sum(s);
    return (double)M + log(s);
}

/* log-sum-exp of row r of logits l (V columns), every thread gets it */
template <int EX2, class L> __device__ double ck_row_lse(const CkTensor &l, i64 r, i64 V) {
    float m = -CK_INF;
    double s = 0;
    if (L::vec_ok(l) && V % CK_VEC == 0) {
        #pragma unroll 2
        for (i64 c = (i64)threadIdx.x * CK_VEC; c < V; c += (i64)blockDim.x * CK_VEC) {
            float v[CK_VEC];
            L::ld_vec(l, r * V + c, v);
            ck_lse_fold<EX2>(m, s, v, CK_VEC);
        }
    } else {
        for (i64 c = threadIdx.x; c < V; c += blockDim.x) {
            float v = L::ld(l, r * V + c);
            ck_lse_fold<EX2>(m, s, &v, 1);
        }
    }
    return ck_lse_block(m, s);
}

/* The gradient of a vector of 8 logits v of a row, in place: coef (e^(v - lse) - [j == jt]),
 * jt the target's place in the vector (outside 0..7: not in it). The other vectors skip the
 * one-hot: e - 0 is e, so they have the bits of the formula as written, for four instructions
 * a logit less (a compare, a select and a subtraction, the index). */
template <int EX2>
static __device__ __forceinline__ void ck_ce_grad_vec(float *v, i64 jt, float coef, const CkExpFrom<EX2> &e) {
    #pragma unroll
    for (int j = 0; j < CK_VEC; j++) v[j] = e(v[j]);
    if ((unsigned long long)jt < CK_VEC) {
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) v[j] -= j == jt ? 1.0f : 0.0f;
    }
    #pragma unroll
    for (int j = 0; j < CK_VEC; j++) v[j] *= coef;
}

/* CROSS_ENTROPY (logits, targets), first launch: one block per row, the row's loss into
 * scratch (f64; NaN for an ignored row, target < 0), and where i[2] is not 0 its logsumexp
 * at byte i[2] of the scratch, for the backward (spec.c, fuse_ce_lse); i = {V, R, lse at}.
 * EX2: the exponential of CkExpFrom, as every launch of the loss takes it. */
template <int EX2, class L, class T> __device__ void ck_ce_rows(const CkArgs &a) {
    i64 V = a.i[0], r = blockIdx.x;
    float t = T::ld(a.t[2], r);
    double *loss = (double *)a.scratch;
    if (t < 0.0f) {
        if (threadIdx.x == 0) loss[r] = CK_NAN;
        return;
    }
    double lse = ck_row_lse<EX2, L>(a.t[1], r, V);
    i64 ti = (i64)t;
    if (threadIdx.x == 0) {
        loss[r] = ti < V && t == floorf(t) ? lse - L::ld(a.t[1], r * V + ti) : (double)CK_NAN;
        if (a.i[2]) ((double *)((char *)a.scratch + a.i[2]))[r] = lse;
    }
}

/* The mean over the valid rows of the row losses in loss[0..R), stored at element 0 of y by
 * thread 0: the second launch of CROSS_ENTROPY, and the last block of the fused pass
 * (ck_ce_fused, which reads what other blocks wrote: through L2) */
template <class Y, class T> static __device__ void ck_ce_mean(const CkTensor &y, const CkTensor &tg,
                                                              const double *loss, i64 R) {
    double s = 0, n = 0;
    for (i64 r = threadIdx.x; r < R; r += blockDim.x)
        if (T::ld(tg, r) >= 0.0f) {
            s += __ldcg(loss + r);
            n += 1;
        }
    s = ck_block_sum(s);
    n = ck_block_sum(n);
    if (threadIdx.x == 0) Y::st(y, 0, n > 0 ? (float)(s / n) : 0.0f);
}

/* second launch, one block: the mean over valid rows */
template <class Y, class T> __device__ void ck_ce_final(const CkArgs &a) {
    ck_ce_mean<Y, T>(a.t[0], a.t[2], (const double *)a.scratch, a.i[1]);
}

/* CROSS_ENTROPY_BWD (dloss, logits, targets), first launch, one block: coef = dloss / valid
 * rows into scratch[0]; i = {V, R} */
template <class DL, class T> __device__ void ck_ce_bwd_coef(const CkArgs &a) {
    i64 R = a.i[1];
    double n = 0;
    for (i64 r = threadIdx.x; r < R; r += blockDim.x) n += T::ld(a.t[3], r) >= 0.0f ? 1.0 : 0.0;
    n = ck_block_sum(n);
    if (threadIdx.x == 0) ((double *)a.scratch)[0] = n > 0 ? (double)DL::ld(a.t[1], 0) / n : 0.0;
}

/* second launch, one block per row: dlogits = coef (softmax - onehot(target)), the row's
 * logsumexp from the forward's scratch where i[2] says (else computed here); per element in
 * f32 (the f64 conversions of every logit cost more than the row's memory traffic; the result
 * moves by about 1e-6 relative, far inside the bounds); i = {V, R, lse at} */
template <int EX2, class Y, class L, class T> __device__ void ck_ce_bwd(const CkArgs &a) {
    i64 V = a.i[0], r = blockIdx.x;
    float coef = (float)((const double *)a.scratch)[0];
    float t = T::ld(a.t[3], r);
    if (t < 0.0f) {
        for (i64 c = threadIdx.x; c < V; c += blockDim.x) Y::st(a.t[0], r * V + c, 0.0f);
        return;
    }
    float lse = (float)(a.i[2] ? ((const double *)((const char *)a.scratch + a.i[2]))[r] : ck_row_lse<EX2, L>(a.t[2], r, V));
    CkExpFrom<EX2> e(lse);
    i64 ti = (i64)t;
    if (L::vec_ok(a.t[2]) && Y::vec_ok(a.t[0]) && V % CK_VEC == 0) {
        #pragma unroll 2
        for (i64 c = (i64)threadIdx.x * CK_VEC; c < V; c += (i64)blockDim.x * CK_VEC) {
            float v[CK_VEC];
            L::ld_vec(a.t[2], r * V + c, v);
            ck_ce_grad_vec<EX2>(v, ti - c, coef, e);
            Y::st_vec(a.t[0], r * V + c, v);
        }
        return;
    }
    for (i64 c = threadIdx.x; c < V; c += blockDim.x)
        Y::st(a.t[0], r * V + c, coef * (e(L::ld(a.t[2], r * V + c)) - (c == ti ? 1.0f : 0.0f)));
}

/* A vector of 8 logits held as loaded, in 32-bit registers (bf16: four, f32: eight), and its
 * element j as Elem<E>::ld reads it: shifts, no byte array whose address the compiler would
 * have to keep in memory. Other element types are not held (ce_row_vectors: 0). */
template <int E> struct CkHeld {
    enum { words = 0 };
    static __device__ __forceinline__ float at(const unsigned *, int) { return CK_NAN; }
};
template <> struct CkHeld<FMT_BF16> {
    enum { words = 4 };
    static __device__ __forceinline__ float at(const unsigned *w, int j) {
        return __uint_as_float(j & 1 ? w[j >> 1] & 0xffff0000u : w[j >> 1] << 16);
    }
};
template <> struct CkHeld<FMT_F32> {
    enum { words = 8 };
    static __device__ __forceinline__ float at(const unsigned *w, int j) { return __uint_as_float(w[j]); }
};

/* Vector q of a row held in shared memory as loaded (W words a vector, W / 4 chunks of 16
 * bytes), decoded: both passes of the one pass read the row so. */
template <class H, int W>
static __device__ __forceinline__ void ck_held_vec(const uint4 *held, int q, float *v) {
    unsigned w[W];
    #pragma unroll
    for (int h = 0; h < W / 4; h++) *(uint4 *)&w[4 * h] = held[q * (W / 4) + h];
    #pragma unroll
    for (int j = 0; j < CK_VEC; j++) v[j] = H::at(w, j);
}

/* CROSS_ENTROPY and the CROSS_ENTROPY_BWD of the same logits in one pass (spec_fuse.c,
 * fuse_ce_one_pass): a block per row reads the row once, computes its logsumexp and loss, and
 * writes the row's gradient; the block that writes the last row loss takes their mean (a
 * ticket taken as soon as its own is written, not when the block ends).
 *
 * Where the row waits between its logsumexp and its gradient is NV (spec_internal.h,
 * ce_row_held), for plain bf16 or f32 logits in whole vectors:
 *  - NV > 0: in registers as loaded (CkHeld), NV 16-byte vectors a thread, all loads in flight
 *    at once. GPT-2's 50304 bf16 logits are seven vectors a thread of 1024, and the kernel
 *    takes 64 registers: one block an SM, so a row's loads, its block reductions and its
 *    stores follow one another, none overlapping another row's (0.165 ms a chunk of 1311 rows
 *    on an H200, against some 0.07 for its bytes).
 *  - NV = CK_ROW_SHARED: in shared memory, copied there by cp.async (16 bytes a copy, no
 *    register holds them, all in flight at once). A bf16 row of GPT-2 takes 98 KiB, two rows
 *    an SM, and blocks of 512 or 256 threads leave the registers for both: while one block
 *    reduces its row or stores its gradient, the other's copies are in flight.
 *  - NV = 0: read a second time for the gradient, from L2 mostly, as the unfused backward
 *    reads it; the other logits (scaled, or rows not in whole vectors) go so too.
 * Whichever, each value goes through the operations of ck_ce_rows, ck_ce_final,
 * ck_ce_bwd_coef and ck_ce_bwd in the same order (the per-thread folds of the logsumexp visit
 * the same elements in the same order, a thread's vectors q = threadIdx.x + k blockDim.x; the
 * count of valid targets is exact), so at the same block size and exponential (EX2) the results
 * have their bits. The coefficient dloss / valid rows needs every row's target: each block
 * counts them (__syncthreads_count over the R targets, a few KB from L2, while its row's loads
 * are in flight) instead of a launch before. The logit at the target is read before any
 * gradient is written, so the gradient may take the logits' bytes.
 * t = {dlogits, dloss, logits, targets, loss}; i = {V, R}; the scratch holds the row losses
 * (f64); with CK_ROW_SHARED, V times the logit's bytes of dynamic shared memory. */
enum { CK_ROW_SHARED = -1 };

/* the number of rows of the R targets tg that are not ignored; every thread of the block */
template <class T> static __device__ __forceinline__ int ck_ce_valid(const CkTensor &tg, i64 R) {
    int valid = 0;
    for (i64 k = 0; k < R; k += blockDim.x) {
        i64 q = k + threadIdx.x;
        valid += __syncthreads_count(q < R && T::ld(tg, q) >= 0.0f);
    }
    return valid;
}
/* thread 0: row r's loss into the scratch, then a ticket; whether this row was the last of
 * the R to be done */
static __device__ __forceinline__ bool ck_ce_row_done(const CkArgs &a, i64 r, double loss) {
    ((double *)a.scratch)[r] = loss;
    __threadfence();
    bool last = atomicAdd(a.ticket, 1u) == (unsigned)a.i[1] - 1;
    if (last) atomicExch(a.ticket, 0u);
    return last;
}
template <class DL> static __device__ __forceinline__ float ck_ce_coef(const CkArgs &a, int valid) {
    return (float)(valid > 0 ? (double)DL::ld(a.t[1], 0) / valid : 0.0);
}
/* 16 bytes from global to shared memory, through L2 only, without a register */
static __device__ __forceinline__ void ck_copy16_async(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}

/* Row r held in shared memory as loaded (`held`, its nvec vectors; ck_held_vec): its
 * log-sum-exp, its loss (thread 0, ck_ce_row_done: whether the row was the last, for thread 0)
 * and its gradient into t[0]; tq the target's place (-1: outside the row). Every thread of the
 * block calls it (the log-sum-exp's block reductions). */
template <int EX2, class H, int W, class Y>
static __device__ __forceinline__ bool ck_ce_held_row(const CkArgs &a, const uint4 *held, int nvec, i64 r, int tq,
                                                      bool hit, float xt, float coef) {
    i64 V = a.i[0];
    float m = -CK_INF;
    double s = 0;
    #pragma unroll 4
    for (int q = threadIdx.x; q < nvec; q += blockDim.x) {
        float v[CK_VEC];
        ck_held_vec<H, W>(held, q, v);
        ck_lse_fold<EX2>(m, s, v, CK_VEC);
    }
    double lse = ck_lse_block(m, s);
    bool last = threadIdx.x == 0 && ck_ce_row_done(a, r, hit ? lse - xt : (double)CK_NAN);
    CkExpFrom<EX2> e((float)lse);
    #pragma unroll 4
    for (int q = threadIdx.x; q < nvec; q += blockDim.x) {
        float v[CK_VEC];
        ck_held_vec<H, W>(held, q, v);
        ck_ce_grad_vec<EX2>(v, tq - q * CK_VEC, coef, e);
        Y::st_vec(a.t[0], r * V + (i64)q * CK_VEC, v);
    }
    return last;
}

/* NV = CK_ROW_RING: a block takes rows blockIdx.x, + gridDim.x, .. (a grid of one block an
 * SM: the executor caps it, CuLaunch.per_sm) and holds two of them in shared memory, the next
 * row's copies in flight while it works on the one in hand. With a row a block (CK_ROW_SHARED)
 * a block's copies, its reductions and its stores follow one another, and the SM's other block
 * is all that overlaps them: ncu on an H200 put d12's one pass at 52% of the memory's
 * bandwidth. Each row's values go through the same operations in the same order as there. */
enum { CK_ROW_RING = -2 };
template <int EX2, class Y, class L, class T, class DL, class YL> __device__ void ck_ce_ring(const CkArgs &a) {
    const CkTensor &dy = a.t[0], &l = a.t[2], &tg = a.t[3];
    i64 V = a.i[0], R = a.i[1];
    typedef CkHeld<L::elem> H;
    enum { W = H::words ? H::words : 4 };   /* 32-bit words of a held vector */
    __shared__ bool last;
    extern __shared__ uint4 ck_row_held[];   /* two rows as loaded, (V / 8, W / 4) each */
    bool vec = H::words && L::scaling == SCALE_NONE && L::vec_ok(l) && Y::vec_ok(dy) && V % CK_VEC == 0;
    int nvec = (int)(V / CK_VEC), chunks = nvec * (W / 4);
    /* row r's copies into buffer k as one group (an empty one past R or without vectors) */
    auto fetch = [&](i64 r, int k) {
        if (vec && r < R) {
            const uint4 *row = (const uint4 *)l.p + r * chunks;
            for (int q = threadIdx.x; q < chunks; q += blockDim.x) ck_copy16_async(&ck_row_held[k * chunks + q], row + q);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    if (threadIdx.x == 0) last = false;
    fetch(blockIdx.x, 0);
    float coef = ck_ce_coef<DL>(a, ck_ce_valid<T>(tg, R));   /* (its barriers: last is set) */
    int k = 0;
    for (i64 r = blockIdx.x; r < R; r += gridDim.x, k ^= 1) {
        float t = T::ld(tg, r);
        i64 ti = (i64)t;
        bool hit = t >= 0.0f && ti < V && t == floorf(t);
        float xt = hit && threadIdx.x == 0 ? L::ld(l, r * V + ti) : 0.0f;   /* before the row's stores */
        fetch(r + gridDim.x, k ^ 1);   /* the buffer the last row used: every thread is past it */
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        __syncthreads();
        const uint4 *held = ck_row_held + k * chunks;
        if (t < 0.0f) {   /* an ignored row: no loss, no gradient */
            if (threadIdx.x == 0) last |= ck_ce_row_done(a, r, CK_NAN);
            for (i64 c = threadIdx.x; c < V; c += blockDim.x) Y::st(dy, r * V + c, 0.0f);
        } else if (vec) {
            bool done = ck_ce_held_row<EX2, H, W, Y>(a, held, nvec, r, ti < V ? (int)ti : -1, hit, xt, coef);
            if (threadIdx.x == 0) last |= done;
        } else {   /* read twice, as ck_ce_fused's last way */
            double lse = ck_row_lse<EX2, L>(l, r, V);
            if (threadIdx.x == 0) last |= ck_ce_row_done(a, r, hit ? lse - xt : (double)CK_NAN);
            CkExpFrom<EX2> e((float)lse);
            for (i64 c = threadIdx.x; c < V; c += blockDim.x)
                Y::st(dy, r * V + c, coef * (e(L::ld(l, r * V + c)) - (c == ti ? 1.0f : 0.0f)));
        }
        __syncthreads();   /* every thread is done with buffer k before the next row's copies */
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    if (last) ck_ce_mean<YL, T>(a.t[4], tg, (const double *)a.scratch, R);
}

template <int NV, int EX2, class Y, class L, class T, class DL, class YL> __device__ void ck_ce_fused(const CkArgs &a) {
    if constexpr (NV == CK_ROW_RING) {
        ck_ce_ring<EX2, Y, L, T, DL, YL>(a);
        return;
    }
    const CkTensor &dy = a.t[0], &l = a.t[2], &tg = a.t[3];
    i64 V = a.i[0], R = a.i[1], r = blockIdx.x;
    __shared__ bool last;   /* the block that wrote the last row loss takes the mean */
    float t = T::ld(tg, r);
    i64 ti = (i64)t;
    bool hit = t >= 0.0f && ti < V && t == floorf(t);
    float xt = hit && threadIdx.x == 0 ? L::ld(l, r * V + ti) : 0.0f;   /* before any store */
    bool vec = L::vec_ok(l) && Y::vec_ok(dy) && V % CK_VEC == 0;
    typedef CkHeld<L::elem> H;
    enum { W = H::words ? H::words : 4 };   /* 32-bit words of a held vector */
    if (t < 0.0f) {   /* an ignored row: no loss, no gradient */
        if (threadIdx.x == 0) last = ck_ce_row_done(a, r, CK_NAN);
        for (i64 c = threadIdx.x; c < V; c += blockDim.x) Y::st(dy, r * V + c, 0.0f);
    } else if (NV > 0 && H::words && L::scaling == SCALE_NONE && vec && (i64)NV * blockDim.x * CK_VEC >= V) {
        /* the row's loads first, all in flight while the block counts the valid targets;
         * 32-bit positions within the row: fewer registers beside the row's */
        const uint4 *row = (const uint4 *)l.p + r * (V / CK_VEC) * (W / 4);
        int nvec = (int)(V / CK_VEC), tq = ti < V ? (int)ti : -1;
        unsigned raw[NV > 0 ? NV : 1][W];
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            int q = k * (int)blockDim.x + (int)threadIdx.x;
            #pragma unroll
            for (int h = 0; h < W / 4; h++)
                if (q < nvec) *(uint4 *)&raw[k][4 * h] = row[(i64)q * (W / 4) + h];
        }
        float coef = ck_ce_coef<DL>(a, ck_ce_valid<T>(tg, R));
        float m = -CK_INF;
        double s = 0;
        #pragma unroll
        for (int k = 0; k < NV; k++)
            if (k * (int)blockDim.x + (int)threadIdx.x < nvec) {
                float v[CK_VEC];
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) v[j] = H::at(raw[k], j);
                ck_lse_fold<EX2>(m, s, v, CK_VEC);
            }
        double lse = ck_lse_block(m, s);
        if (threadIdx.x == 0) last = ck_ce_row_done(a, r, hit ? lse - xt : (double)CK_NAN);
        CkExpFrom<EX2> e((float)lse);
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            int q = k * (int)blockDim.x + (int)threadIdx.x;
            if (q < nvec) {
                float v[CK_VEC];
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) v[j] = H::at(raw[k], j);
                ck_ce_grad_vec<EX2>(v, tq - q * CK_VEC, coef, e);
                Y::st_vec(dy, r * V + (i64)q * CK_VEC, v);
            }
        }
    } else if (NV == CK_ROW_SHARED && H::words && L::scaling == SCALE_NONE && vec) {
        /* the row's copies first, all in flight while the block counts the valid targets */
        extern __shared__ uint4 ck_row_held[];   /* (V / 8, W / 4): the row as loaded */
        const uint4 *row = (const uint4 *)l.p + r * (V / CK_VEC) * (W / 4);
        int nvec = (int)(V / CK_VEC), tq = ti < V ? (int)ti : -1;
        for (int q = threadIdx.x; q < nvec * (W / 4); q += blockDim.x) ck_copy16_async(&ck_row_held[q], row + q);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        float coef = ck_ce_coef<DL>(a, ck_ce_valid<T>(tg, R));
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncthreads();
        bool done = ck_ce_held_row<EX2, H, W, Y>(a, ck_row_held, nvec, r, tq, hit, xt, coef);
        if (threadIdx.x == 0) last = done;
    } else {
        float coef = ck_ce_coef<DL>(a, ck_ce_valid<T>(tg, R));   /* (its barriers: xt is read) */
        double lse = ck_row_lse<EX2, L>(l, r, V);
        if (threadIdx.x == 0) last = ck_ce_row_done(a, r, hit ? lse - xt : (double)CK_NAN);
        CkExpFrom<EX2> e((float)lse);
        if (vec) {
            #pragma unroll 2
            for (i64 c = (i64)threadIdx.x * CK_VEC; c < V; c += (i64)blockDim.x * CK_VEC) {
                float v[CK_VEC];
                L::ld_vec(l, r * V + c, v);
                ck_ce_grad_vec<EX2>(v, ti - c, coef, e);
                Y::st_vec(dy, r * V + c, v);
            }
        } else {
            for (i64 c = threadIdx.x; c < V; c += blockDim.x)
                Y::st(dy, r * V + c, coef * (e(L::ld(l, r * V + c)) - (c == ti ? 1.0f : 0.0f)));
        }
    }
    __syncthreads();
    if (last) ck_ce_mean<YL, T>(a.t[4], tg, (const double *)a.scratch, R);
}
