/* fastmath_check.cu — cuda/kernels/fastmath.cuh against sqrtf and the f32 division, bit for bit,
 * on the GPU.
 *
 * The coded optimizer updates take the fast paths of the correctly rounded square root and
 * division without the compiler's range checks (fastmath.cuh), on the claim that inside the
 * stated ranges the fast path's result is the operation's. This program checks the claim where
 * it is used:
 *   sqrt      every f32 bit pattern: where ck_sqrt_fast says its operand is in range, its
 *             result has the bits of sqrtf (and it must say so for every normal x >= 2^-101)
 *   div       ck_div_fast(a, b): every significand of a against 4096 random significands of b
 *             at each of 9 exponent pairs (the ends of the range and the middle), then 2^32
 *             random pairs over the whole range, against a / b
 *   div_by    ck_div_by8's product-and-correction, x / c with |x| <= c as a group's values are
 *             (x of at least 2^-100, c in [2^-100, 2^100], rc = ck_recip(c), the quotient at
 *             least 2^-125): every significand of x against 4096 random c, then 2^32 random
 *             pairs, against x / c
 *   div_unit  ck_div_unit(a, d), d in [1, 2), 2^-100 <= |a| < 2: every significand of a
 *             against 4096 random d with a in [2^-100, 2^-99) and in [1, 2), then 2^32 random
 *             pairs, against a / d
 *   group     ck_group_quotient(max, m), max 448 and 57344, against ck_scale_for's f64 at margin
 *             0, (float)(max / (double)m): every positive f32 m, the subnormals, the largest
 *             values (infinite quotients) and infinity included
 * A zero is not among the operands: the functions return it unchanged, as the division and the
 * square root do. Arguments name the checks to run (sqrt div div_by div_unit group; none: all).
 * Exit status: 0 when everything matches, 1 on any mismatch, 2 when no GPU is
 * usable. Build (tests/gpu/run_check.sh fastmath --build does this):
 *   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --fmad=false tests/gpu/fastmath_check.cu */
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "../../cuda/kernels/fastmath.cuh"

struct Counts {
    unsigned long long checked, mismatched, fast;
    unsigned first_a, first_b;   /* the first mismatch's operands (bits) */
};

static __device__ __forceinline__ uint64_t mix(uint64_t x) {   /* splitmix64 */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static __device__ __forceinline__ float make(unsigned sign, int exp, unsigned sig) {
    return __uint_as_float(sign << 31 | (unsigned)(exp + 127) << 23 | (sig & 0x7fffffu));
}

static __device__ void note(Counts *c, bool same, float a, float b) {
    if (!same && atomicAdd(&c->mismatched, 1ull) == 0) {
        c->first_a = __float_as_uint(a);
        c->first_b = __float_as_uint(b);
    }
}

/* every f32 bit pattern from base, n of them */
__global__ void check_sqrt(Counts *c, uint64_t base, uint64_t n) {
    unsigned long long fast = 0, checked = 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        unsigned bits = (unsigned)(base + i);
        float x = __uint_as_float(bits);
        bool ok = true;
        float y = ck_sqrt_fast(x, ok);
        bool normal_in_range = bits >= 0x0d000000u && bits < 0x7f800000u;
        checked++;
        if (ok) {
            fast++;
            note(c, __float_as_uint(y) == __float_as_uint(sqrtf(x)), x, 0.0f);
        }
        if (normal_in_range && !ok) note(c, false, x, 1.0f);   /* the range it promises */
    }
    atomicAdd(&c->checked, checked);
    atomicAdd(&c->fast, fast);
}

/* MODE 0: ck_div_fast(a, b); 1: the product and correction of ck_div_by (|a| <= b); 2:
 * ck_div_unit(a, b). An exhaustive pass (ea, eb >= -126) takes every significand of a against
 * 4096 significands of b; a random pass (ea < -126) draws everything. */
template <int MODE> __global__ void check_div(Counts *c, int ea, int eb, uint64_t n, uint64_t seed) {
    unsigned long long fast = 0, checked = 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t r = mix(seed ^ mix(i));
        float a, b;
        if (ea >= -126) {
            a = make((unsigned)(r >> 63), ea, (unsigned)(i >> 12));
            b = make(0, eb, (unsigned)mix(seed + (i & 4095)));
            if (MODE == 1 && fabsf(a) > b) continue;   /* a group's values are at most its maximum */
        } else if (MODE == 0) {   /* a in [2^-60, 2^61), b in [2^-60, 2^60] */
            a = make((unsigned)(r >> 63), (int)((r >> 32) % 121) - 60, (unsigned)r);
            b = make(0, (int)((r >> 40) % 120) - 60, (unsigned)(r >> 8));
        } else if (MODE == 1) {   /* c in [2^-100, 2^100), |x| in [2^-100, c] */
            int e_c = (int)((r >> 32) % 200) - 100;
            b = make(0, e_c, (unsigned)(r >> 8));
            int e_x = e_c - (int)((r >> 48) % (unsigned)(e_c + 101));
            a = make((unsigned)(r >> 63), e_x, (unsigned)r);
            if (fabsf(a) > b) a = copysignf(b, a);
        } else {                  /* d in [1, 2), |a| in [2^-100, 2] */
            b = make(0, 0, (unsigned)(r >> 8));
            a = make((unsigned)(r >> 63), (int)((r >> 32) % 102) - 100, (unsigned)r);
        }
        float got;
        bool ok = true;
        if (MODE == 0) {
            got = ck_div_fast(a, b, ok);
        } else if (MODE == 1) {
            float y[8], x[8] = {a, a, a, a, a, a, a, a};
            ck_div_by8(x, b, ck_recip(b), true, y);
            got = y[0];
            ok = ck_recip(b) != 0.0f && ck_div_by_ok(a, a * ck_recip(b));   /* else it divides */
        } else {
            got = ck_div_unit(a, b);
        }
        checked++;
        if (ok) {
            fast++;
            note(c, __float_as_uint(got) == __float_as_uint(a / b), a, b);
        }
    }
    atomicAdd(&c->checked, checked);
    atomicAdd(&c->fast, fast);
}

/* every positive f32 bit pattern from 1 up to infinity's (n of them from base), for max */
__global__ void check_group(Counts *c, float max, uint64_t base, uint64_t n) {
    unsigned long long checked = 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        unsigned bits = (unsigned)(base + i);
        if (bits == 0 || bits > 0x7f800000u) continue;
        float m = __uint_as_float(bits);
        float want = (float)((double)max / (double)m * ldexp(1.0, 0));   /* ck_scale_for, margin 0 */
        checked++;
        note(c, __float_as_uint(ck_group_quotient(max, m)) == __float_as_uint(want), max, m);
    }
    atomicAdd(&c->checked, checked);
    atomicAdd(&c->fast, checked);
}

static int failures;

static bool cuda_ok(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    fprintf(stderr, "fastmath_check: %s: %s\n", what, cudaGetErrorString(e));
    return false;
}

static void report(const char *name, Counts *dev) {
    Counts h;
    if (!cuda_ok(cudaMemcpy(&h, dev, sizeof h, cudaMemcpyDeviceToHost), "copy back")) {
        failures++;
        return;
    }
    printf("%-44s %14llu checked, %14llu on the fast path, %llu mismatched", name, h.checked, h.fast, h.mismatched);
    if (h.mismatched) {
        float a, b;
        memcpy(&a, &h.first_a, 4), memcpy(&b, &h.first_b, 4);
        printf(" (first: %a, %a)", a, b);
        failures++;
    }
    printf("\n");
    cudaMemset(dev, 0, sizeof h);
}

static int n_wanted;
static char **wanted;
static bool want(const char *name) {
    for (int i = 0; i < n_wanted; i++)
        if (!strcmp(wanted[i], name)) return true;
    return n_wanted == 0;
}

int main(int argc, char **argv) {
    n_wanted = argc - 1, wanted = argv + 1;
    for (int i = 0; i < n_wanted; i++) {
        static const char *const names[] = {"sqrt", "div", "div_by", "div_unit", "group"};
        bool known = false;
        for (const char *n : names) known |= !strcmp(wanted[i], n);
        if (!known) {
            fprintf(stderr, "fastmath_check: no check '%s' (sqrt div div_by div_unit group)\n", wanted[i]);
            return 2;
        }
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "fastmath_check: no usable GPU\n");
        return 2;
    }
    Counts *c;
    if (!cuda_ok(cudaMalloc(&c, sizeof *c), "cudaMalloc") || !cuda_ok(cudaMemset(c, 0, sizeof *c), "cudaMemset"))
        return 2;
    const unsigned grid = 132 * 16, block = 256;
    const uint64_t every_sig = (uint64_t)1 << 35;   /* 2^23 significands x 4096 */

    if (want("sqrt")) {
        for (int h = 0; h < 4; h++) check_sqrt<<<grid, block>>>(c, (uint64_t)h << 30, (uint64_t)1 << 30);
        if (!cuda_ok(cudaDeviceSynchronize(), "sqrt")) return 2;
        report("sqrt: every f32", c);
    }

    const int ends[3] = {-60, 0, 59};
    if (want("div")) {
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 3; j++) check_div<0><<<grid, block>>>(c, ends[i], ends[j], every_sig, 11 + 3 * i + j);
        if (!cuda_ok(cudaDeviceSynchronize(), "div")) return 2;
        report("div: every significand, 9 exponent pairs", c);
        check_div<0><<<grid, block>>>(c, -127, 0, (uint64_t)1 << 32, 1);
        if (!cuda_ok(cudaDeviceSynchronize(), "div random")) return 2;
        report("div: random pairs", c);
    }

    const int xc[3][2] = {{-100, -100}, {-100, 99}, {0, 0}};
    if (want("div_by")) {
        for (int i = 0; i < 3; i++) check_div<1><<<grid, block>>>(c, xc[i][0], xc[i][1], every_sig, 31 + i);
        if (!cuda_ok(cudaDeviceSynchronize(), "div_by")) return 2;
        report("div_by: every significand, 3 exponent pairs", c);
        check_div<1><<<grid, block>>>(c, -127, 0, (uint64_t)1 << 32, 2);
        if (!cuda_ok(cudaDeviceSynchronize(), "div_by random")) return 2;
        report("div_by: random pairs, |x| <= c", c);
    }

    if (want("div_unit")) {
        for (int e = -100; e <= 0; e += 100) check_div<2><<<grid, block>>>(c, e, 0, every_sig, 141 + e);
        if (!cuda_ok(cudaDeviceSynchronize(), "div_unit")) return 2;
        report("div_unit: every significand, a at 2^-100 and 1", c);
        check_div<2><<<grid, block>>>(c, -127, 0, (uint64_t)1 << 32, 3);
        if (!cuda_ok(cudaDeviceSynchronize(), "div_unit random")) return 2;
        report("div_unit: random pairs", c);
    }

    for (float max : {448.0f, 57344.0f}) {
        if (!want("group")) break;
        for (int h = 0; h < 2; h++) check_group<<<grid, block>>>(c, max, (uint64_t)h << 30, (uint64_t)1 << 30);
        if (!cuda_ok(cudaDeviceSynchronize(), "group")) return 2;
        report(max == 448.0f ? "group: every positive f32, max 448" : "group: every positive f32, max 57344", c);
    }

    printf("%s\n", failures ? "MISMATCH" : "all bit-identical");
    return failures ? 1 : 0;
}
