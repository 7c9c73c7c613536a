/* gpu_test.h — what the GPU tests share: random data, leaves in any format, the skip rule,
 * and the comparison with the reference executor.
 *
 * The comparison is the normalized error ||gpu - ref|| / ||ref|| over a tensor's decoded
 * values (NaN anywhere fails unless both sides have it at the same place); a bound of 0 means
 * bit-identical values. Data are fresh random values every run; the seed is printed and
 * FP8C_TEST_SEED=n repeats a run. */
#ifndef FP8C_GPU_TEST_H
#define FP8C_GPU_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu.h"

static uint64_t gt_rng;

static inline void gt_seed(void) {
    const char *s = getenv("FP8C_TEST_SEED");
    gt_rng = s && *s ? strtoull(s, NULL, 10) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
    printf("seed %llu (FP8C_TEST_SEED repeats it)\n", (unsigned long long)gt_rng);
}

static inline uint64_t gt_next(void) {
    uint64_t z = (gt_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline double gt_uniform(void) { return ((double)(gt_next() >> 11) + 0.5) / 9007199254740992.0; }
static inline float gt_normal(void) {
    return (float)(sqrt(-2.0 * log(gt_uniform())) * cos(6.283185307179586 * gt_uniform()));
}
static inline int64_t gt_int(int64_t lo, int64_t hi) { return lo + (int64_t)(gt_next() % (uint64_t)(hi - lo)); }

/* Exits 0 with one line when there is no usable GPU: CI machines have none. */
static inline void gt_require_gpu(const char *test) {
    char why[512];
    if (!cuda_load(why, sizeof why)) {
        printf("%s: skipped: no GPU (%s)\n", test, why);
        exit(0);
    }
}

/* ||a - b|| / ||b|| over decoded values; -1 when NaNs differ in place */
static inline double gt_norm_error(const float *a, const float *b, int64_t n, double *max_abs) {
    double num = 0, den = 0;
    *max_abs = 0;
    for (int64_t i = 0; i < n; i++) {
        bool na = a[i] != a[i], nb = b[i] != b[i];
        if (na || nb) {
            if (na != nb) return -1;
            continue;
        }
        double d = (double)a[i] - b[i];
        if (fabs(d) > *max_abs) *max_abs = fabs(d);
        num += d * d;
        den += (double)b[i] * b[i];
    }
    if (num == 0) return 0;
    return sqrt(num) / (den > 0 ? sqrt(den) : 1e-300);
}

static inline int64_t gt_bytes(const Tensor *t) { return ir_numel(t) * fmt_elem_bytes(t->fmt.elem); }

#endif
