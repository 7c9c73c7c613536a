/* comm_fp8.c — the arithmetic of the FP8 gradient reduction (comm:grad=e5m2 or e4m3).
 *
 * A data-parallel step sums each bucket of gradients over the N ranks (comm_buckets.c). By
 * default NCCL sums them in the accumulators' own format (bf16 at -O1..-O3); with comm:grad=FMT
 * each bucket travels in FP8 instead, in the way Colossal-AI's FP8 all-reduce does, with the
 * one change that every scale is shared:
 *
 *   1. each rank finds its bucket's amax; an all-reduce(max) of that one float gives every
 *      rank the same amax, so every rank quantizes with the same scale s1 = max(FMT) / amax;
 *   2. each rank quantizes its bucket, q = FMT(x s1) (round to nearest even, saturating: the
 *      conversion of every FP8 store in fp8c, ir/numerics.c), into N equal shards (zeros past
 *      the end); an all-to-all (grouped ncclSend/ncclRecv of bytes) gives rank r shard r of
 *      every rank;
 *   3. rank r adds its shard's N contributions in f32, rank 0 first, and scales back:
 *      y = (q_0 + q_1 + ... + q_{N-1}) / s1, element by element: a fixed order, so the same
 *      bits every run and on whichever rank;
 *   4. a second all-reduce(max) of |y| gives the shared s2; rank r quantizes its summed
 *      shard, FMT(y s2), and an all-gather of the shards gives every rank the whole bucket in
 *      FP8, which it decodes (/ s2) into its accumulators.
 *
 * Why FP8 on the way back too (rather than all-gather y in bf16): the bytes. A ring all-reduce
 * of bf16 sends 2 (N-1)/N x 2 bytes an element from each GPU; steps 2 and 4 send (N-1)/N x 1
 * byte each, half of that (a quarter of an f32 reduction's); gathering y in bf16 would send
 * three quarters. The price is one more rounding, of the sum (a relative 2^-3 at most for e5m2,
 * 2^-4 for e4m3, where the first rounding is of each rank's share). Every rank decodes the
 * same gathered bytes with the same scale, so the ranks' copies of the weights stay equal bit
 * for bit, as with bf16.
 *
 * Why shared scales (an all-reduce of one float, twice a bucket) rather than Colossal-AI's
 * scale per rank sent beside its shard: the sum then adds codes of one scale, divides once,
 * and its result does not depend on which rank holds the largest value.
 *
 * Non-finite gradients must still reach the step's finite check (which skips the step): a NaN
 * stays NaN through every conversion, but an infinity would saturate to the format's largest
 * value, so an infinite amax makes the scale NaN and the whole bucket NaN.
 *
 * This file is the reference: the GPU kernels (cuda/kernels/comm.cuh) do the same operations
 * in the same order on f32, and tests/gpu/test_gpu_comm.c compares them bit for bit;
 * tests/test_comm.c bounds this reference against an f64 sum. */
#include <math.h>

#include "rt.h"

int64_t rt_comm_fp8_shard(int64_t elems, int ranks)
{
    int64_t n = ranks > 0 ? ranks : 1;
    int64_t s = (elems + n - 1) / n;
    return (s + RT_FP8_SHARD_ALIGN - 1) / RT_FP8_SHARD_ALIGN * RT_FP8_SHARD_ALIGN;
}

float rt_comm_fp8_scale(ElemType wire, float amax)
{
    if (isinf(amax)) return NAN;
    if (!(amax > 0)) return 1.0f;
    double s = (double)num_elem_max(wire) / (double)amax;
    return (float)(s < 0x1p127 ? s : 0x1p127);
}

void rt_comm_fp8_reduce(ElemType wire, int ranks, int64_t n, const float *const *x, float *out)
{
    float amax = 0.0f;
    for (int r = 0; r < ranks; r++)
        for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[r][i]));
    float s1 = rt_comm_fp8_scale(wire, amax);
    float amax_sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float sum = 0.0f;
        for (int r = 0; r < ranks; r++) sum += num_round(wire, x[r][i] * s1);
        out[i] = sum / s1;
        amax_sum = fmaxf(amax_sum, fabsf(out[i]));
    }
    float s2 = rt_comm_fp8_scale(wire, amax_sum);
    for (int64_t i = 0; i < n; i++) out[i] = num_round(wire, out[i] * s2) / s2;
}

int64_t rt_comm_fp8_buffer_bytes(const RtCommPlan *p, int ranks)
{
    if (p->wire == FMT_VOID || ranks <= 1) return 0;
    int64_t shard = 0;
    for (int b = 0; b < p->n_buckets; b++) {
        int64_t s = rt_comm_fp8_shard(p->buckets[b].elems, ranks);
        if (s > shard) shard = s;
    }
    return 3 * ranks * shard * fmt_elem_bytes(p->wire) + shard * (int64_t)sizeof(float);
}

ElemType rt_comm_wire(const Graph *g)
{
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_ALL_REDUCE) return (ElemType)IR_IATTR(g->nodes[i], ALL_REDUCE, wire);
    return FMT_VOID;
}

int64_t rt_comm_sent_bytes(const RtCommPlan *p, int ranks)
{
    if (ranks <= 1) return 0;
    if (p->wire == FMT_VOID) return 2 * p->bytes * (ranks - 1) / ranks;
    int64_t sent = 0;
    for (int b = 0; b < p->n_buckets; b++)
        sent += 2 * (ranks - 1) * rt_comm_fp8_shard(p->buckets[b].elems, ranks) * fmt_elem_bytes(p->wire) +
                2 * (2 * (int64_t)sizeof(float) * (ranks - 1) / ranks);
    return sent;
}
