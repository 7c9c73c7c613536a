/* test_cpu_gemm.c — the CPU backend's GEMM (runtime/cpu_gemm.c, cpu_gemm_tile.c) on each of
 * its paths the CPU has, against f64 products of the decoded operands.
 *
 * The GEMM is the one routine of the CPU backend written by hand, with three implementations
 * chosen by CPUID (f32 micro-kernels; the bf16 tile path on AVX512-BF16 dot products or on
 * AMX tiles) that a machine can run only some of. These tests need nothing but the runtime —
 * no LLVM, no compiler — so the executable runs on machines that have a path the development
 * machine lacks (a GPU machine's Xeon with AMX) as well as in CI. The tile attention, which
 * runs on the GEMM's block operations, is tested here too. The kernels that call the GEMM are
 * tested with the rest of the CPU backend in test_codegen.c. FP8C_TEST_SEED repeats
 * a run's random data. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref_internal.h"
#include "test_rng.h"


/* The GEMM itself (rt_cpu_gemm_mixed) on each of its paths the CPU has — f32 micro-kernels,
 * and the bf16 tile path on AVX512-BF16 dot products and on AMX's tiles — against an f64
 * product of the decoded operands: every pair of stored formats the tile path takes (and f32
 * x bf16, which it leaves to the f32 path), per-tensor scales, the four transpose
 * combinations, accumulation, and shapes that end inside a tile, a pair of k and a K block.
 * Bound: error < 1e-5 of the terms' magnitudes (gemm_error; f32 sums of exact products, K up
 * to 1100). Results must not depend on the thread count. */
typedef struct {
    ElemType elem;
    float scale;
    void *data;
    double *value;          /* decoded / scale */
} GemmInput;

static GemmInput gemm_input(ElemType e, float scale, int64_t n)
{
    GemmInput in = {e, scale, malloc((size_t)n * 4), malloc((size_t)n * sizeof(double))};
    float *x = calloc((size_t)n, sizeof(float)), *back = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = rng_normal() * (e == FMT_F32 || e == FMT_BF16 ? 1.0f : 40.0f);
    num_encode(e, x, in.data, n);
    num_decode(e, in.data, back, n);
    for (int64_t i = 0; i < n; i++) in.value[i] = (double)back[i] / scale;
    free(x);
    free(back);
    return in;
}

/* ||C - sum|| over ||magnitude||, the magnitude of an element being |C's start| + sum |a b|:
 * an f32 sum's rounding is bounded by its terms' magnitudes, not by the sum, which can cancel
 * (1 + a b with a b near -1: one rounding of a b, 1.5e-5 of the cancelled sum, failed a
 * normalization by the sum on a 1 x 1 x 1 GEMM). A wrong term is off by its own size. */
static double gemm_error(int64_t M, int64_t N, int64_t K, const GemmInput *a, bool ta,
                         const GemmInput *b, bool tb, bool accumulate, float *C)
{
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double sum = accumulate ? 1.0 : 0.0, mag = fabs(sum);   /* C starts at ones */
            for (int64_t k = 0; k < K; k++) {
                double t = a->value[ta ? k * M + i : i * K + k] * b->value[tb ? j * K + k : k * N + j];
                sum += t;
                mag += fabs(t);
            }
            diff += (C[i * N + j] - sum) * (C[i * N + j] - sum);
            norm += mag * mag;
        }
    return sqrt(diff / (norm > 0 ? norm : 1));
}

static void test_gemm_paths(void **state)
{
    (void)state;
    static const struct { ElemType a, b; float sa, sb; } pairs[] = {
        {FMT_BF16, FMT_BF16, 1.0f, 1.0f}, {FMT_E4M3, FMT_E4M3, 37.5f, 0.21f},
        {FMT_E5M2, FMT_E4M3, 1.0f, 64.0f}, {FMT_BF16, FMT_E5M2, 1.0f, 3.0f},
        {FMT_F32, FMT_BF16, 1.0f, 1.0f},
    };
    static const int64_t shapes[][3] = {{45, 53, 70}, {128, 96, 128}, {33, 70, 1100}, {1, 1, 1},
                                        {97, 31, 3}};
    CpuTiles was = cpu_tiles();
    static const CpuTiles paths[] = {CPU_TILES_OFF, CPU_TILES_BF16DOT, CPU_TILES_AMX};
    enum { N_PATHS = sizeof paths / sizeof paths[0] };
    bool ran[N_PATHS];
    for (int path = 0; path < N_PATHS; path++) {
        ran[path] = cpu_tiles_select(paths[path]);
        print_message("gemm paths: %s%s%s\n", path ? "tile path " : "f32", path ? cpu_tiles_name(paths[path]) : "",
                      ran[path] ? "" : " skipped: not on this CPU");
    }
    /* every finite FP8 code times the identity: exactly its value, on every path (the tile
     * path decodes FP8 through a vector table lookup) */
    for (int path = 0; path < N_PATHS; path++)
        for (int f = 0; f < 2 && ran[path]; f++) {
            cpu_tiles_select(paths[path]);
            ElemType e = f ? FMT_E5M2 : FMT_E4M3;
            uint8_t codes[256];
            uint16_t eye[16 * 16] = {0};
            float C[256];
            for (int q = 0; q < 256; q++) {
                float v = f ? num_e5m2_to_f32((uint8_t)q) : num_e4m3_to_f32((uint8_t)q);
                codes[q] = isfinite(v) ? (uint8_t)q : 0;
            }
            for (int i = 0; i < 16; i++) eye[i * 16 + i] = num_f32_to_bf16(1.0f);
            RtGemmOperand a = {codes, e, 1.0f}, b = {eye, FMT_BF16, 1.0f};
            rt_cpu_gemm_mixed(16, 16, 16, a, 16, false, b, 16, false, C, 16, false);
            for (int q = 0; q < 256; q++) {
                float want = f ? num_e5m2_to_f32(codes[q]) : num_e4m3_to_f32(codes[q]);
                if (C[q] != want)   /* -0 sums to +0 */
                    fail_msg("%s code 0x%02x through the %s path: %g, not %g", fmt_elem_name(e), q,
                             path ? cpu_tiles_name(paths[path]) : "f32", C[q], want);
            }
        }
    int threads = ref_threads();
    for (int path = 0; path < N_PATHS; path++) {
        if (!ran[path]) continue;
        cpu_tiles_select(paths[path]);
        for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++)
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
                for (int tr = 0; tr < 4; tr++) {
                    int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
                    bool ta = tr & 1, tb = tr >> 1, acc = (p + s + (size_t)tr) % 2;
                    GemmInput a = gemm_input(pairs[p].a, pairs[p].sa, M * K);
                    GemmInput b = gemm_input(pairs[p].b, pairs[p].sb, K * N);
                    RtGemmOperand oa = {a.data, a.elem, a.scale}, ob = {b.data, b.elem, b.scale};
                    float *C[2];
                    for (int run = 0; run < 2; run++) {   /* all threads, then one */
                        ref_set_threads(run ? 1 : threads);
                        C[run] = malloc((size_t)(M * N) * sizeof(float));
                        for (int64_t i = 0; i < M * N; i++) C[run][i] = 1.0f;
                        rt_cpu_gemm_mixed(M, N, K, oa, ta ? M : K, ta, ob, tb ? K : N, tb, C[run], N, acc);
                    }
                    ref_set_threads(threads);
                    double err = gemm_error(M, N, K, &a, ta, &b, tb, acc, C[0]);
                    if (!(err < 1e-5) || memcmp(C[0], C[1], sizeof(float) * (size_t)(M * N)) != 0)
                        fail_msg("gemm %s x %s (%s path) %lldx%lldx%lld ta=%d tb=%d acc=%d: error "
                                 "%.3g, thread counts %s", fmt_elem_name(a.elem),
                                 fmt_elem_name(b.elem), path ? cpu_tiles_name(paths[path]) : "f32", (long long)M,
                                 (long long)N, (long long)K, ta, tb, acc, err,
                                 memcmp(C[0], C[1], sizeof(float) * (size_t)(M * N)) ? "differ" : "agree");
                    free(C[0]), free(C[1]), free(a.data), free(a.value), free(b.data), free(b.value);
                }
    }
    cpu_tiles_select(was);
}

/* rt_cpu_gemm_rows: every row of C handed on exactly once, with the values rt_cpu_gemm_mixed
 * writes into C, whether a task's rows were made in C or in its thread's buffer (the
 * callback sees which), on both paths and at several thread counts. */
typedef struct {
    int64_t M, N;
    const float *C;         /* the GEMM's own C */
    float *out;             /* the rows as handed on */
    int *times;             /* per row: how often it was handed on */
    int local;              /* blocks handed on from outside C */
} RowsSeen;

static void rows_seen(void *ctx, int64_t lo, int64_t hi, const float *c)
{
    RowsSeen *r = ctx;
    if (c < r->C || c >= r->C + r->M * r->N) __atomic_fetch_add(&r->local, 1, __ATOMIC_RELAXED);
    for (int64_t i = lo; i < hi; i++) {
        memcpy(r->out + i * r->N, c + (i - lo) * r->N, sizeof(float) * (size_t)r->N);
        __atomic_fetch_add(&r->times[i], 1, __ATOMIC_RELAXED);
    }
}

static void test_gemm_rows(void **state)
{
    (void)state;
    static const int64_t shapes[][3] = {{512, 96, 64}, {640, 200, 128}, {300, 70, 1100}, {64, 512, 128}};
    CpuTiles was = cpu_tiles();
    static const CpuTiles paths[] = {CPU_TILES_OFF, CPU_TILES_BF16DOT, CPU_TILES_AMX};
    int threads = ref_threads(), local = 0;
    for (size_t path = 0; path < sizeof paths / sizeof paths[0]; path++) {
        if (!cpu_tiles_select(paths[path])) continue;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int nt = 2; nt <= 8; nt *= 2) {
                int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
                bool ta = s == 1, tb = s != 2;
                GemmInput a = gemm_input(FMT_BF16, 1.0f, M * K), b = gemm_input(FMT_BF16, 1.0f, K * N);
                RtGemmOperand oa = {a.data, a.elem, a.scale}, ob = {b.data, b.elem, b.scale};
                float *want = malloc(sizeof(float) * (size_t)(M * N)), *C = malloc(sizeof(float) * (size_t)(M * N));
                RowsSeen r = {.M = M, .N = N, .C = C, .out = malloc(sizeof(float) * (size_t)(M * N)),
                              .times = calloc((size_t)M, sizeof(int))};
                ref_set_threads(nt);
                rt_cpu_gemm_mixed(M, N, K, oa, ta ? M : K, ta, ob, tb ? K : N, tb, want, N, false);
                rt_cpu_gemm_rows(M, N, K, oa, ta ? M : K, ta, ob, tb ? K : N, tb, C, N, false, rows_seen, &r);
                for (int64_t i = 0; i < M; i++)
                    if (r.times[i] != 1) fail_msg("gemm rows %lldx%lldx%lld, %d threads: row %lld handed on %d times",
                                                  (long long)M, (long long)N, (long long)K, nt, (long long)i, r.times[i]);
                if (memcmp(r.out, want, sizeof(float) * (size_t)(M * N)) != 0)
                    fail_msg("gemm rows %lldx%lldx%lld (%s path), %d threads: rows differ from C",
                             (long long)M, (long long)N, (long long)K, path ? cpu_tiles_name(paths[path]) : "f32", nt);
                local += r.local;
                free(want), free(C), free(r.out), free(r.times);
                free(a.data), free(a.value), free(b.data), free(b.value);
            }
    }
    ref_set_threads(threads);
    cpu_tiles_select(was);
    print_message("gemm rows: %d blocks handed on from the tasks' own buffers\n", local);
    assert_true(local > 0);
}

/* The tile attention (runtime/cpu_attn_tile.c) on each tile path the CPU has, forward and
 * backward, against f64 sums over the same bf16 values: grouped query heads, sequences that
 * end inside a block of 32, head sizes 32 and 64. Bound: the largest difference under 1e-2
 * of the output's largest magnitude, as the GPU's tensor-core attention is held to: P and dS
 * are rounded to bf16 as the operands of their products (2^-9 of each weight); forty-eight
 * cases measured 1.4e-3 (y) to 3.8e-3 (dq). A lost block or a wrong scale is off by tenths.
 * The backward's two cuts (by whole heads, by blocks of rows) must give the same bits, and so
 * must one thread and several. */
typedef struct {
    int64_t B, T, H, Hkv, D;
    uint16_t *q, *k, *v, *dy;           /* bf16, q (B, T, H D), k and v (B, T, Hkv D), dy as q */
    double *y, *dq, *dk, *dv;           /* f64 results */
} AttnCase;

static double bf16_value(uint16_t h) { return (double)num_bf16_to_f32(h); }

static uint16_t *bf16_random(int64_t n)
{
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) x[i] = num_f32_to_bf16(rng_normal());
    return x;
}

static void attention_f64(AttnCase *c)
{
    int64_t B = c->B, T = c->T, H = c->H, Hkv = c->Hkv, D = c->D, G = H / Hkv;
    double scale = 1.0 / sqrt((double)D);
    c->y = calloc((size_t)(B * T * H * D), sizeof(double));
    c->dq = calloc((size_t)(B * T * H * D), sizeof(double));
    c->dk = calloc((size_t)(B * T * Hkv * D), sizeof(double));
    c->dv = calloc((size_t)(B * T * Hkv * D), sizeof(double));
    double *p = malloc(sizeof(double) * (size_t)T), *dp = malloc(sizeof(double) * (size_t)T);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < T; i++) {
                int64_t g = h / G, qi = (b * T + i) * H * D + h * D;
                double mx = -INFINITY, sum = 0, dsum = 0;
                for (int64_t j = 0; j <= i; j++) {
                    int64_t kj = (b * T + j) * Hkv * D + g * D;
                    double s = 0, t = 0;
                    for (int64_t d = 0; d < D; d++) {
                        s += bf16_value(c->q[qi + d]) * bf16_value(c->k[kj + d]);
                        t += bf16_value(c->dy[qi + d]) * bf16_value(c->v[kj + d]);
                    }
                    p[j] = s * scale;
                    dp[j] = t;
                    mx = fmax(mx, p[j]);
                }
                for (int64_t j = 0; j <= i; j++) sum += (p[j] = exp(p[j] - mx));
                for (int64_t j = 0; j <= i; j++) dsum += (p[j] /= sum) * dp[j];
                for (int64_t j = 0; j <= i; j++) {
                    int64_t kj = (b * T + j) * Hkv * D + g * D;
                    double ds = p[j] * (dp[j] - dsum) * scale;
                    for (int64_t d = 0; d < D; d++) {
                        c->y[qi + d] += p[j] * bf16_value(c->v[kj + d]);
                        c->dq[qi + d] += ds * bf16_value(c->k[kj + d]);
                        c->dk[kj + d] += ds * bf16_value(c->q[qi + d]);
                        c->dv[kj + d] += p[j] * bf16_value(c->dy[qi + d]);
                    }
                }
            }
    free(p);
    free(dp);
}

/* max |got - want| over max |want|, got's rows `stride` floats apart from column col */
static double attention_error(const float *got, int64_t stride, int64_t col, const double *want, int64_t rows,
                              int64_t width)
{
    double diff = 0, mag = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t x = 0; x < width; x++) {
            diff = fmax(diff, fabs(got[r * stride + col + x] - want[r * width + x]));
            mag = fmax(mag, fabs(want[r * width + x]));
        }
    return diff / (mag > 0 ? mag : 1);
}

static void test_attention_tiles(void **state)
{
    (void)state;
    static const int64_t shapes[][5] = {{2, 19, 4, 2, 32}, {2, 70, 4, 2, 32}, {1, 128, 4, 4, 64}, {3, 45, 2, 1, 64}};
    static const CpuTiles paths[] = {CPU_TILES_BF16DOT, CPU_TILES_AMX};
    CpuTiles was = cpu_tiles();
    int threads = ref_threads(), ran = 0;
    for (size_t path = 0; path < sizeof paths / sizeof paths[0]; path++) {
        if (!cpu_tiles_select(paths[path]) || !cpu_attention_tile_usable(32)) {
            print_message("attention tiles: %s skipped: not on this CPU\n", cpu_tiles_name(paths[path]));
            continue;
        }
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            AttnCase c = {.B = shapes[s][0], .T = shapes[s][1], .H = shapes[s][2], .Hkv = shapes[s][3], .D = shapes[s][4]};
            int64_t B = c.B, T = c.T, H = c.H, Hkv = c.Hkv, D = c.D, wide = (H + 2 * Hkv) * D;
            c.q = bf16_random(B * T * H * D), c.dy = bf16_random(B * T * H * D);
            c.k = bf16_random(B * T * Hkv * D), c.v = bf16_random(B * T * Hkv * D);
            attention_f64(&c);
            RtAttention a = {.B = B, .T = T, .H = H, .Hkv = Hkv, .D = D, .scale = (float)(1.0 / sqrt((double)D)),
                             .q = c.q, .k = c.k, .v = c.v, .qs = H * D, .ks = Hkv * D, .vs = Hkv * D,
                             .out_elem = FMT_F32};
            float *y = malloc(sizeof(float) * (size_t)(B * T * H * D));
            a.out = y, a.out_stride = H * D;
            cpu_attention_tile(&a);
            double err = attention_error(y, H * D, 0, c.y, B * T, H * D);
            /* the backward by heads and by blocks, with every thread and with one */
            float *grads[3];
            static const CpuAttnBwd hows[3] = {CPU_ATTN_BWD_HEADS, CPU_ATTN_BWD_BLOCKS, CPU_ATTN_BWD_HEADS};
            a.dy = c.dy, a.out_stride = wide;
            for (int run = 0; run < 3; run++) {
                grads[run] = malloc(sizeof(float) * (size_t)(B * T * wide));
                cpu_attention_bwd_select(hows[run]);
                ref_set_threads(run == 2 ? 1 : threads);
                int64_t heads = cpu_attention_bwd_head_runs();
                a.out = grads[run];
                cpu_attention_tile(&a);
                assert_int_equal(cpu_attention_bwd_head_runs() - heads, hows[run] == CPU_ATTN_BWD_HEADS);
            }
            ref_set_threads(threads);
            cpu_attention_bwd_select(CPU_ATTN_BWD_AUTO);
            double err_dq = attention_error(grads[0], wide, 0, c.dq, B * T, H * D);
            double err_dk = attention_error(grads[0], wide, H * D, c.dk, B * T, Hkv * D);
            double err_dv = attention_error(grads[0], wide, (H + Hkv) * D, c.dv, B * T, Hkv * D);
            bool same = true;
            for (int64_t r = 0; r < B * T; r++)     /* rows' whole width: dq | dk | dv */
                for (int run = 1; run < 3; run++)
                    same = same && memcmp(grads[0] + r * wide, grads[run] + r * wide, sizeof(float) * (size_t)wide) == 0;
            print_message("attention tiles (%s) B %lld T %lld H %lld/%lld D %lld: y %.2g, dq %.2g, dk %.2g, dv %.2g%s\n",
                          cpu_tiles_name(paths[path]), (long long)B, (long long)T, (long long)H, (long long)Hkv,
                          (long long)D, err, err_dq, err_dk, err_dv, same ? "" : "; the cuts differ");
            if (!(err < 1e-2 && err_dq < 1e-2 && err_dk < 1e-2 && err_dv < 1e-2) || !same)
                fail_msg("attention tiles: out of bounds or cuts differ");
            ran++;
            free(y), free(grads[0]), free(grads[1]), free(grads[2]);
            free(c.q), free(c.k), free(c.v), free(c.dy), free(c.y), free(c.dq), free(c.dk), free(c.dv);
        }
    }
    cpu_tiles_select(was);
    if (!ran) skip();
}

/* The tile attention's exp (2^t, t = s c - m2 by one multiply-add) against exp2 in f64 of the
 * same t: within 4e-7 relative where the result is a normal f32 (the polynomial's 2.1e-7, and
 * one rounding), within 2^-149 and that where it is subnormal, 0 below the range. Arguments
 * over [-160, 0.5], scales and maxima as softmax rows have them. */
static void test_softmax_exp(void **state)
{
    (void)state;
    if (!cpu_attention_tile_usable(32)) skip();
    enum { N = 1 << 16 };
    float *s = malloc(sizeof(float) * N), *out = malloc(sizeof(float) * N), *t = malloc(sizeof(float) * N);
    double worst = 0;
    for (int round = 0; round < 8; round++) {
        float c = (float)((0.05 + 0.45 * rng_uniform()) * 1.4426950408889634), m2 = (float)(rng_uniform() * 40 - 20);
        for (int i = 0; i < N; i++) {
            double want_t = -160.0 + 160.5 * rng_uniform();
            if (i < 4) want_t = i == 0 ? 0.0 : i == 1 ? -126.0 : i == 2 ? -149.0 : 0.5;
            s[i] = (float)((want_t + m2) / c);
            t[i] = fmaf(s[i], c, -m2);
        }
        cpu_attention_softmax_exp(s, N, c, m2, out);
        for (int i = 0; i < N; i++) {
            double want = exp2((double)t[i]), err = fabs((double)out[i] - want);
            bool ok = want >= 0x1p-126 ? err <= 4e-7 * want : err <= 0x1p-149 + 4e-7 * want;
            if (!ok)
                fail_msg("softmax exp: 2^%.9g = %.9g, exactly %.17g", (double)t[i], (double)out[i], want);
            if (want >= 0x1p-126) worst = fmax(worst, err / want);
        }
    }
    print_message("softmax exp: within %.2g relative\n", worst);
    free(s), free(out), free(t);
}

int main(void)
{
    const char *seed = getenv("FP8C_TEST_SEED");
    rng_state = seed ? strtoull(seed, NULL, 10) : (uint64_t)time(NULL);
    printf("test_cpu_gemm: seed %llu\n", (unsigned long long)rng_state);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_gemm_paths), cmocka_unit_test(test_gemm_rows),
                                       cmocka_unit_test(test_attention_tiles), cmocka_unit_test(test_softmax_exp)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
