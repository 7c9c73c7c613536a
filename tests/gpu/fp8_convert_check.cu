/* fp8_convert_check.cu — every f32 bit pattern through the GPU's conversions and through
 * ir/numerics.c, compared bit for bit.
 *
 * The reference executor and the CPU backend emulate the GPU's narrowing conversions; this
 * program is the proof that the emulation is exact. All 2^32 inputs are converted on the GPU
 * with the intrinsics the generated kernels use —
 *   __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3 / __NV_E5M2)  (cvt.rn.satfinite.*x2.f32)
 *   __float2bfloat16_rn(x)                                            (cvt.rn.bf16.f32)
 *   __float2half_rn(x)                                                (cvt.rn.f16.f32)
 * — in chunks of 2^26; each chunk is copied back and compared against num_f32_to_* on all CPU
 * cores. Decoding is checked too, for every code of each format (the GPU widens e4m3/e5m2
 * through f16, as cuda_fp8.hpp does). Mismatches are counted per format, split into NaN and
 * non-NaN inputs (a NaN-only difference would mean the hardware keeps the sign or payload that
 * the canonical NaN drops), and the first few are printed.
 *
 * Exit status: 0 when everything matches, 1 on any mismatch, 2 when no GPU is usable.
 * Build (tests/gpu/run_check.sh fp8_convert --build does this):
 *   gcc -O2 -std=c11 -Iir -c ir/numerics.c -o numerics.o
 *   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tests/gpu/fp8_convert_check.cu
 *        numerics.o -o build-gpu/fp8_convert_check */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

/* ir/numerics.c, compiled as C. ir.h is C-only, so the few prototypes used are repeated. */
extern "C" {
uint16_t num_f32_to_bf16(float x);
float num_bf16_to_f32(uint16_t h);
uint16_t num_f32_to_f16(float x);
float num_f16_to_f32(uint16_t h);
uint8_t num_f32_to_e4m3(float x);
float num_e4m3_to_f32(uint8_t q);
uint8_t num_f32_to_e5m2(float x);
float num_e5m2_to_f32(uint8_t q);
/* numerics.c reports broken invariants through ir_die, which lives in ir/diag.c. */
[[noreturn]] void ir_die(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s:%d: internal error: ", file, line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}
}

#define CUDA_CHECK(call)                                                                     \
    do {                                                                                     \
        cudaError_t err_ = (call);                                                           \
        if (err_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                    \
                    cudaGetErrorString(err_));                                               \
            exit(2);                                                                         \
        }                                                                                    \
    } while (0)

enum { FMT_E4M3, FMT_E5M2, FMT_BF16, FMT_F16, NFMT };
static const char *const FMT_NAME[NFMT] = {"e4m3", "e5m2", "bf16", "f16"};
static const int CHUNK_LOG2 = 26;

/* One input per thread: the four narrowings of the f32 with bit pattern base + i. */
__global__ void convert_chunk(uint32_t base, uint32_t n, uint8_t *e4m3, uint8_t *e5m2,
                              uint16_t *bf16, uint16_t *f16)
{
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float x = __uint_as_float(base + i);
        e4m3[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
        e5m2[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
        __nv_bfloat16 b = __float2bfloat16_rn(x);
        __half h = __float2half_rn(x);
        bf16[i] = *reinterpret_cast<uint16_t *>(&b);
        f16[i] = *reinterpret_cast<uint16_t *>(&h);
    }
}

/* Every code of each format widened to f32 on the GPU. */
__global__ void decode_all(float *e4m3, float *e5m2, float *bf16, float *f16)
{
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 65536) return;
    if (i < 256) {
        __half_raw h4 = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)i, __NV_E4M3);
        __half_raw h5 = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)i, __NV_E5M2);
        e4m3[i] = __half2float(__half(h4));
        e5m2[i] = __half2float(__half(h5));
    }
    __nv_bfloat16_raw rb;
    rb.x = (unsigned short)i;
    __half_raw rh;
    rh.x = (unsigned short)i;
    bf16[i] = __bfloat162float(__nv_bfloat16(rb));
    f16[i] = __half2float(__half(rh));
}

/* Mismatch counts of one CPU thread: [format][0: NaN inputs, 1: other inputs]. */
struct Counts {
    uint64_t n[NFMT][2] = {};
};

static std::atomic<int> shown[NFMT];
static std::mutex print_lock;

static void report(Counts &c, int fmt, uint32_t u, uint32_t gpu, uint32_t cpu)
{
    c.n[fmt][(u & 0x7FFFFFFFu) > 0x7F800000u ? 0 : 1]++;
    if (shown[fmt].fetch_add(1) >= 8) return;
    float x;
    memcpy(&x, &u, sizeof x);
    std::lock_guard<std::mutex> g(print_lock);
    printf("  %s mismatch: input 0x%08x (%a): gpu 0x%0*x cpu 0x%0*x\n", FMT_NAME[fmt], u, x,
           fmt < 2 ? 2 : 4, gpu, fmt < 2 ? 2 : 4, cpu);
}

/* Compares inputs [lo, hi) of the chunk that starts at base. */
static void compare_slice(Counts *c, uint32_t base, uint32_t lo, uint32_t hi,
                          const uint8_t *e4m3, const uint8_t *e5m2, const uint16_t *bf16,
                          const uint16_t *f16)
{
    for (uint32_t i = lo; i < hi; i++) {
        uint32_t u = base + i;
        float x;
        memcpy(&x, &u, sizeof x);
        uint8_t a = num_f32_to_e4m3(x), b = num_f32_to_e5m2(x);
        uint16_t h = num_f32_to_bf16(x), d = num_f32_to_f16(x);
        if (a != e4m3[i]) report(*c, FMT_E4M3, u, e4m3[i], a);
        if (b != e5m2[i]) report(*c, FMT_E5M2, u, e5m2[i], b);
        if (h != bf16[i]) report(*c, FMT_BF16, u, bf16[i], h);
        if (d != f16[i]) report(*c, FMT_F16, u, f16[i], d);
    }
}

/* Same value, or both NaN (payloads of widened NaNs are not part of the contract). */
static bool same_float(float a, float b)
{
    if (a != a || b != b) return a != a && b != b;
    uint32_t ua, ub;
    memcpy(&ua, &a, 4);
    memcpy(&ub, &b, 4);
    return ua == ub;
}

static int check_decode(void)
{
    float *d;
    CUDA_CHECK(cudaMalloc(&d, 4 * 65536 * sizeof(float)));
    decode_all<<<256, 256>>>(d, d + 65536, d + 2 * 65536, d + 3 * 65536);
    CUDA_CHECK(cudaGetLastError());
    std::vector<float> h(4 * 65536);
    CUDA_CHECK(cudaMemcpy(h.data(), d, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(d));
    int bad = 0;
    for (uint32_t q = 0; q < 65536; q++) {
        float cpu[NFMT] = {q < 256 ? num_e4m3_to_f32((uint8_t)q) : 0.0f,
                           q < 256 ? num_e5m2_to_f32((uint8_t)q) : 0.0f,
                           num_bf16_to_f32((uint16_t)q), num_f16_to_f32((uint16_t)q)};
        for (int f = 0; f < NFMT; f++) {
            if (f < 2 && q >= 256) continue;
            float gpu = h[(size_t)f * 65536 + q];
            if (!same_float(gpu, cpu[f]) && bad++ < 8)
                printf("  %s decode mismatch: code 0x%x: gpu %a cpu %a\n", FMT_NAME[f], q, gpu,
                       cpu[f]);
        }
    }
    printf("decode: every code of e4m3, e5m2, bf16, f16: %d mismatches\n", bad);
    return bad;
}

int main(void)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "fp8_convert_check: no CUDA device\n");
        return 2;
    }
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    unsigned nthreads = std::max(1u, std::thread::hardware_concurrency());
    printf("device: %s (sm_%d%d), runtime %d, driver %d, %u CPU threads\n", prop.name,
           prop.major, prop.minor, rt, drv, nthreads);
    auto t0 = std::chrono::steady_clock::now();

    const uint32_t chunk = 1u << CHUNK_LOG2;
    uint8_t *d8, *h8;
    uint16_t *d16, *h16;
    CUDA_CHECK(cudaMalloc(&d8, 2 * (size_t)chunk));
    CUDA_CHECK(cudaMalloc(&d16, 2 * (size_t)chunk * sizeof(uint16_t)));
    CUDA_CHECK(cudaMallocHost(&h8, 2 * (size_t)chunk));
    CUDA_CHECK(cudaMallocHost(&h16, 2 * (size_t)chunk * sizeof(uint16_t)));

    std::vector<Counts> counts(nthreads);
    for (uint64_t base = 0; base < (1ull << 32); base += chunk) {
        convert_chunk<<<prop.multiProcessorCount * 8, 256>>>((uint32_t)base, chunk, d8,
                                                              d8 + chunk, d16, d16 + chunk);
        CUDA_CHECK(cudaGetLastError());
        CUDA_CHECK(cudaMemcpy(h8, d8, 2 * (size_t)chunk, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(h16, d16, 2 * (size_t)chunk * sizeof(uint16_t),
                              cudaMemcpyDeviceToHost));
        std::vector<std::thread> pool;
        for (unsigned k = 0; k < nthreads; k++) {
            uint32_t lo = (uint32_t)((uint64_t)chunk * k / nthreads);
            uint32_t hi = (uint32_t)((uint64_t)chunk * (k + 1) / nthreads);
            pool.emplace_back(compare_slice, &counts[k], (uint32_t)base, lo, hi, h8,
                              h8 + chunk, h16, h16 + chunk);
        }
        for (auto &th : pool) th.join();
    }
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    uint64_t total = 0;
    printf("encode: all 2^32 f32 inputs (%.1f s)\n", secs);
    for (int f = 0; f < NFMT; f++) {
        uint64_t a = 0, b = 0;
        for (const Counts &c : counts) {
            a += c.n[f][0];
            b += c.n[f][1];
        }
        total += a + b;
        printf("  %-5s %llu mismatches (%llu on NaN inputs, %llu on others)\n", FMT_NAME[f],
               (unsigned long long)(a + b), (unsigned long long)a, (unsigned long long)b);
    }
    int bad_decode = check_decode();
    printf("%s\n", total == 0 && bad_decode == 0 ? "PASS: bit-identical" : "FAIL");
    CUDA_CHECK(cudaFree(d8));
    CUDA_CHECK(cudaFree(d16));
    CUDA_CHECK(cudaFreeHost(h8));
    CUDA_CHECK(cudaFreeHost(h16));
    return total == 0 && bad_decode == 0 ? 0 : 1;
}
