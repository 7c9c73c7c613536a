/* loader.c — the CUDA driver and cuBLASLt, opened at run time.
 *
 * A training binary must start where there is no GPU and no CUDA at all (CI, laptops): it
 * then trains on the CPU. So nothing of CUDA is linked; when the GPU is chosen (--device
 * cuda, or auto), this file opens libcuda.so.1 — the driver, which belongs to the machine,
 * not to the toolkit — and libcublasLt (FP8C_CUBLASLT, else the versioned name, else the
 * toolkit's lib64) with dlopen, looks every entry point up once, and initializes the driver.
 * Driver entry points are looked up by their versioned ABI names (cuMemAlloc_v2 ...), the
 * ones the CUDA headers' macros name. A missing library or symbol is an ordinary "no GPU
 * here" with the reason, which --device auto turns into a CPU run. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_internal.h"

CudaApi cuda_api;

static int load_state;          /* 0 not tried, 1 loaded, -1 failed */
static char load_why[512];
static int load_devices;

bool cuda_check_cu(CUresult r, const char *call, const char *file, int line) {
    if (r == CUDA_SUCCESS) return true;
    const char *name = "?", *text = "?";
    if (cuda_api.cuGetErrorName) cuda_api.cuGetErrorName(r, &name);
    if (cuda_api.cuGetErrorString) cuda_api.cuGetErrorString(r, &text);
    rt_error("CUDA: %s failed: %s (%s) at %s:%d", call, name, text, file, line);
    return false;
}

bool cuda_check_lt(cublasStatus_t r, const char *call, const char *file, int line) {
    if (r == CUBLAS_STATUS_SUCCESS) return true;
    const char *text = cuda_api.cublasLtGetStatusString ? cuda_api.cublasLtGetStatusString(r) : "?";
    rt_error("cuBLASLt: %s failed: %s (%d) at %s:%d", call, text, (int)r, file, line);
    return false;
}

static void *load_first(const char *const *names, int n, char *tried, size_t tried_len) {
    tried[0] = 0;
    for (int i = 0; i < n; i++) {
        if (!names[i] || !*names[i]) continue;
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (h) return h;
        size_t at = strlen(tried);
        snprintf(tried + at, tried_len - at, "%s%s", at ? ", " : "", names[i]);
    }
    return NULL;
}

static bool load_all(void) {
    char tried[512];
    const char *cuda_names[] = {getenv("FP8C_LIBCUDA"), "libcuda.so.1"};
    void *cuda = load_first(cuda_names, 2, tried, sizeof tried);
    if (!cuda) {
        snprintf(load_why, sizeof load_why, "no GPU driver here (cannot load %s)", tried);
        return false;
    }
#define X(name, ret, args)                                                                   \
    if (!(cuda_api.name = (ret(*) args)dlsym(cuda, #name))) {                                \
        snprintf(load_why, sizeof load_why, "the GPU driver lacks %s (too old?)", #name);    \
        return false;                                                                        \
    }
    CU_FUNCS(X)
#undef X
    CUresult r = cuda_api.cuInit(0);
    if (r != CUDA_SUCCESS) {
        const char *name = "?";
        cuda_api.cuGetErrorName(r, &name);
        snprintf(load_why, sizeof load_why, "the GPU driver does not start (cuInit: %s)", name);
        return false;
    }
    if (cuda_api.cuDeviceGetCount(&load_devices) != CUDA_SUCCESS || load_devices < 1) {
        snprintf(load_why, sizeof load_why, "no GPU found (the driver sees no device)");
        return false;
    }
    const char *lt_names[] = {getenv("FP8C_CUBLASLT"), "libcublasLt.so.13", "libcublasLt.so",
                              "/usr/local/cuda/lib64/libcublasLt.so.13",
                              "/usr/local/cuda/lib64/libcublasLt.so"};
    void *lt = load_first(lt_names, 5, tried, sizeof tried);
    if (!lt) {
        snprintf(load_why, sizeof load_why, "cuBLASLt not found (tried %s; set FP8C_CUBLASLT)",
                 tried);
        return false;
    }
#define X(name, ret, args)                                                                   \
    if (!(cuda_api.name = (ret(*) args)dlsym(lt, #name))) {                                  \
        snprintf(load_why, sizeof load_why, "cuBLASLt lacks %s (too old?)", #name);          \
        return false;                                                                        \
    }
    LT_FUNCS(X)
#undef X
    return true;
}

bool cuda_load(char *why, size_t why_len) {
    if (!load_state) load_state = load_all() ? 1 : -1;
    if (load_state < 0 && why) snprintf(why, why_len, "%s", load_why);
    return load_state > 0;
}

int cuda_device_count(void) { return load_state > 0 ? load_devices : 0; }

static int load_ordinal;
void cuda_set_device_ordinal(int ordinal) { load_ordinal = ordinal; }
int cuda_device_ordinal(void) { return load_ordinal; }
