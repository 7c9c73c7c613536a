/* comm.cuh — the kernels of the FP8 gradient reduction (comm:grad=e5m2 or e4m3).
 *
 * runtime/comm_fp8.c says what the reduction computes and why; these are its four steps that
 * are not NCCL's, per bucket, run by cuda/exec_comm.c on NCCL's stream between the
 * collectives:
 *
 *   ck_comm_amax          the bucket's largest |gradient|          -> amax[0]  (then all-reduce max)
 *   ck_comm_quantize<W>   codes W(x s1) into N shards, zero padded -> send     (then all-to-all)
 *   ck_comm_sum<W>        y = (sum of the N ranks' codes) / s1, rank 0 first, and max |y|
 *                                                                  -> sums, amax[1] (all-reduce max)
 *   ck_comm_requantize<W> codes W(y s2) of this rank's shard       -> gather   (then all-gather)
 *   ck_comm_unpack<W>     every accumulator = code / s2, rounded to its format
 *
 * A bucket is a list of gradient accumulators (CkSegment: pointer, first element in the
 * bucket, count, element type f32, bf16 or f16), seen as one array of C elements; the shard
 * of rank r is elements r S .. r S + S - 1 (S = rt_comm_fp8_shard). Each thread walks every
 * segment with a grid-stride loop: a bucket holds tens of tensors, and a branch per segment
 * costs nothing next to the bytes.
 *
 * The arithmetic is comm_fp8.c's, operation for operation: the same scale (f64, rounded once;
 * NaN for an infinite amax), x * s1 in f32 then the saturating conversion, the sum in f32 in
 * rank order, one IEEE division; the maxima are exact whatever the order, so the result is
 * bit for bit the host reference's (tests/gpu/test_gpu_comm.c). The two maxima are each
 * block's in the launch's scratch, reduced by the last block to finish (a ticket of the
 * reduction's own: these kernels run beside the backward's, which use the executor's).
 *
 * Argument block (filled by exec_comm.c, not by a node's plan):
 *   t[0].p segments (CkSegment[i[0]])   t[1].p send (N S codes)   t[2].p recv (N S codes:
 *   rank j's shard r at j S; the own shard is read from send)   t[3].p sums (S f32)
 *   t[4].p gather (N S codes)   t[5].p amax (2 f32)
 *   i = {segments, C, S, N, rank}, f = {largest finite value of W}, scratch: a float a block */

static __device__ __forceinline__ float ck_comm_ld(const CkSegment &s, i64 i) {
    if (s.elem == FMT_F32) return Elem<FMT_F32>::ld(s.p, i);
    if (s.elem == FMT_BF16) return Elem<FMT_BF16>::ld(s.p, i);
    return Elem<FMT_F16>::ld(s.p, i);
}

static __device__ __forceinline__ void ck_comm_st(const CkSegment &s, i64 i, float v) {
    if (s.elem == FMT_F32) Elem<FMT_F32>::st(s.p, i, v);
    else if (s.elem == FMT_BF16) Elem<FMT_BF16>::st(s.p, i, v);
    else Elem<FMT_F16>::st(s.p, i, v);
}

/* rt_comm_fp8_scale: max(W) / amax in f64 rounded once, at most 2^127; 1 for amax 0, NaN for
 * an infinite amax (the bucket becomes NaN: the step's finite check then skips it) */
static __device__ __forceinline__ float ck_comm_scale(double fmax, float amax) {
    if (isinf(amax)) return CK_NAN;
    if (!(amax > 0.0f)) return 1.0f;
    double s = fmax / (double)amax;
    double top = ldexp(1.0, 127);
    return (float)(s < top ? s : top);
}

/* the block's maximum of m into scratch; the last block writes the launch's into amax[slot] */
static __device__ void ck_comm_max_out(const CkArgs &a, float m, int slot) {
    m = ck_block_max(m);
    if (threadIdx.x == 0) ((float *)a.scratch)[blockIdx.x] = m;
    if (ck_last_block(a)) {
        float all = ck_partials_max((const float *)a.scratch, (i64)gridDim.x);
        if (threadIdx.x == 0) ((float *)a.t[5].p)[slot] = all;
    }
}

__device__ void ck_comm_amax(const CkArgs &a) {
    const CkSegment *seg = (const CkSegment *)a.t[0].p;
    float m = 0.0f;
    for (i64 k = 0; k < a.i[0]; k++) {
        const CkSegment s = seg[k];
        CK_GRID_STRIDE(i, s.n) m = fmaxf(m, fabsf(ck_comm_ld(s, i)));
    }
    ck_comm_max_out(a, m, 0);
}

template <int W> __device__ void ck_comm_quantize(const CkArgs &a) {
    const CkSegment *seg = (const CkSegment *)a.t[0].p;
    unsigned char *send = (unsigned char *)a.t[1].p;
    const float s1 = ck_comm_scale(a.f[0], ((const float *)a.t[5].p)[0]);
    for (i64 k = 0; k < a.i[0]; k++) {
        const CkSegment s = seg[k];
        CK_GRID_STRIDE(i, s.n) Elem<W>::st(send, s.start + i, ck_comm_ld(s, i) * s1);
    }
    const i64 pad = a.i[2] * a.i[3] - a.i[1];   /* N S - C codes after the last gradient */
    CK_GRID_STRIDE(i, pad) send[a.i[1] + i] = 0;
}

template <int W> __device__ void ck_comm_sum(const CkArgs &a) {
    const unsigned char *send = (const unsigned char *)a.t[1].p, *recv = (const unsigned char *)a.t[2].p;
    float *sums = (float *)a.t[3].p;
    const float s1 = ck_comm_scale(a.f[0], ((const float *)a.t[5].p)[0]);
    const i64 S = a.i[2];
    const int N = (int)a.i[3], rank = (int)a.i[4];
    float m = 0.0f;
    CK_GRID_STRIDE(i, S) {
        float sum = 0.0f;
        for (int j = 0; j < N; j++) sum += Elem<W>::ld(j == rank ? send + rank * S : recv + j * S, i);
        const float y = sum / s1;
        sums[i] = y;
        m = fmaxf(m, fabsf(y));
    }
    ck_comm_max_out(a, m, 1);
}

template <int W> __device__ void ck_comm_requantize(const CkArgs &a) {
    const float *sums = (const float *)a.t[3].p;
    unsigned char *gather = (unsigned char *)a.t[4].p;
    const float s2 = ck_comm_scale(a.f[0], ((const float *)a.t[5].p)[1]);
    const i64 S = a.i[2];
    CK_GRID_STRIDE(i, S) Elem<W>::st(gather + a.i[4] * S, i, sums[i] * s2);
}

template <int W> __device__ void ck_comm_unpack(const CkArgs &a) {
    const CkSegment *seg = (const CkSegment *)a.t[0].p;
    const unsigned char *gather = (const unsigned char *)a.t[4].p;
    const float s2 = ck_comm_scale(a.f[0], ((const float *)a.t[5].p)[1]);
    for (i64 k = 0; k < a.i[0]; k++) {
        const CkSegment s = seg[k];
        CK_GRID_STRIDE(i, s.n) ck_comm_st(s, i, Elem<W>::ld(gather, s.start + i) / s2);
    }
}
