/* cpu_gemm_bench.c — the CPU backend's GEMM (rt_cpu_gemm) against OpenBLAS sgemm.
 *
 * GPT-2 d12 shapes at a small batch: M = batch x seq rows, K and N from {768, 2304, 3072} as
 * the linear layers have them, in the three orientations a training step runs: the forward
 * (x @ W^T), the input gradient (dy @ W) and the weight gradient (dy^T @ x). Each is timed as
 * the best of several runs after a warm-up, with the same thread count for both libraries
 * (FP8C_THREADS; OpenBLAS is told the same through openblas_set_num_threads). Two fp8c
 * columns: f32 operands (the f32 micro-kernels, what sgemm computes), and the same values
 * stored as bf16 (rt_cpu_gemm_mixed, what a -O0 step's GEMMs read; on the tile path, AMX or
 * AVX512-BF16, where the CPU has one; FP8C_CPU_TILES picks it). Built and run by
 * tools/bench/cpu_bench.sh. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref_internal.h"

void openblas_set_num_threads(int n);

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* n random values that bf16 holds exactly, so that both columns multiply the same numbers */
static float *rnd(int64_t n)
{
    float *p = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
    for (int64_t i = 0; i < n; i++) p[i] = num_round(FMT_BF16, (float)rand() / RAND_MAX - 0.5f);
    return p;
}

static uint16_t *as_bf16(const float *x, int64_t n)
{
    uint16_t *p = aligned_alloc(64, (size_t)((n * 2 + 63) / 64 * 64));
    for (int64_t i = 0; i < n; i++) p[i] = num_f32_to_bf16(x[i]);
    return p;
}

typedef struct {
    const char *what;
    int64_t M, N, K;
    bool ta, tb;
    const uint16_t *A16, *B16;   /* the operands as bf16, for run_fp8c_bf16 */
} Shape;

static double best_of(int reps, void (*fn)(const Shape *, const float *, const float *, float *),
                      const Shape *s, const float *A, const float *B, float *C)
{
    fn(s, A, B, C);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        fn(s, A, B, C);
        double t = now_s() - t0;
        if (t < best) best = t;
    }
    return best;
}

static void run_fp8c(const Shape *s, const float *A, const float *B, float *C)
{
    rt_cpu_gemm(s->M, s->N, s->K, A, s->ta ? s->M : s->K, s->ta, B, s->tb ? s->K : s->N, s->tb, C,
                s->N, false);
}

static void run_fp8c_bf16(const Shape *s, const float *A, const float *B, float *C)
{
    (void)A, (void)B;
    RtGemmOperand a = {s->A16, FMT_BF16, 1.0f}, b = {s->B16, FMT_BF16, 1.0f};
    rt_cpu_gemm_mixed(s->M, s->N, s->K, a, s->ta ? s->M : s->K, s->ta, b, s->tb ? s->K : s->N,
                      s->tb, C, s->N, false);
}

static double norm_diff(const float *x, const float *ref, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += (double)(x[i] - ref[i]) * (x[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / den);
}

static void run_blas(const Shape *s, const float *A, const float *B, float *C)
{
    cblas_sgemm(CblasRowMajor, s->ta ? CblasTrans : CblasNoTrans, s->tb ? CblasTrans : CblasNoTrans,
                (int)s->M, (int)s->N, (int)s->K, 1.0f, A, s->ta ? (int)s->M : (int)s->K, B,
                s->tb ? (int)s->K : (int)s->N, 0.0f, C, (int)s->N);
}

int main(int argc, char **argv)
{
    int64_t M = argc > 1 ? atoll(argv[1]) : 128;
    int threads = ref_threads();
    openblas_set_num_threads(threads);
    static const int64_t dims[][2] = {{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}};
    printf("GEMM GFLOP/s, M = %lld rows, %d threads (fp8c rt_cpu_gemm on f32 and on bf16 operands, tile "
           "path %s, vs OpenBLAS sgemm)\n", (long long)M, threads, cpu_tiles_name(cpu_tiles()));
    printf("%-34s %10s %10s %10s %7s %7s  %s\n", "shape (M x K) @ (K x N)", "fp8c f32", "fp8c bf16",
           "OpenBLAS", "f32/BL", "bf16/BL", "norm. diff f32, bf16");
    double sum_ratio = 0, sum_ratio16 = 0;
    int count = 0;
    for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++) {
        int64_t in = dims[d][0], out = dims[d][1];
        Shape shapes[3] = {
            {"forward   x @ W^T", M, out, in, false, true},
            {"backward  dy @ W", M, in, out, false, false},
            {"weights   dy^T @ x", out, in, M, true, false},
        };
        for (int k = 0; k < 3; k++) {
            Shape *s = &shapes[k];
            float *A = rnd(s->M * s->K), *B = rnd(s->K * s->N);
            float *C1 = rnd(s->M * s->N), *C2 = rnd(s->M * s->N), *C3 = rnd(s->M * s->N);
            uint16_t *A16 = as_bf16(A, s->M * s->K), *B16 = as_bf16(B, s->K * s->N);
            s->A16 = A16, s->B16 = B16;
            double flops = 2.0 * (double)s->M * (double)s->N * (double)s->K;
            int reps = flops > 2e9 ? 5 : 20;
            double t1 = best_of(reps, run_fp8c, s, A, B, C1);
            double t3 = best_of(reps, run_fp8c_bf16, s, A, B, C3);
            double t2 = best_of(reps, run_blas, s, A, B, C2);
            char label[64];
            snprintf(label, sizeof label, "%s %lldx%lldx%lld", s->what, (long long)s->M,
                     (long long)s->K, (long long)s->N);
            int64_t n = s->M * s->N;
            printf("%-34s %10.1f %10.1f %10.1f %7.2f %7.2f  %.1e, %.1e\n", label, flops / t1 / 1e9,
                   flops / t3 / 1e9, flops / t2 / 1e9, t2 / t1, t2 / t3, norm_diff(C1, C2, n),
                   norm_diff(C3, C2, n));
            sum_ratio += log(t2 / t1);
            sum_ratio16 += log(t2 / t3);
            count++;
            free(A);
            free(B);
            free(A16);
            free(B16);
            free(C1);
            free(C2);
            free(C3);
        }
    }
    printf("geometric mean of fp8c / OpenBLAS throughput: f32 %.2f, bf16 %.2f\n",
           exp(sum_ratio / count), exp(sum_ratio16 / count));
    return 0;
}
