/* nvrtc.c — GPU kernels compiled at `fp8c build`, with NVRTC, once per distinct module.
 *
 * The training binary carries a cubin for sm_90a (Hopper, with its architecture-specific
 * instructions) and must never compile anything at run time, so all compilation happens
 * here, in the compiler, through NVRTC (no nvcc, no GPU needed). The PTX the cubin was made
 * from comes out of the same compilation and is kept beside it in the cache for inspection
 * (a second compilation for compute_90a, only to get PTX, cost NVRTC time for nothing).
 * Compiling the kernel library takes seconds, so results are cached under a key that hashes
 * the module text, the options and NVRTC's version: a rebuild of an unchanged model compiles
 * nothing. A graph's kernels compile in CUDA_MODULE_PARTS modules (render.c), each on a thread
 * of its own and cached on its own, packed into one blob for the binary (module_set.c): a cold
 * build on a few cores waits for the longest part, not for the whole module.
 *
 * Options: -std=c++17, --fmad=false (no contraction of a*b+c that the reference executor does
 * not do; the attention kernels ask for fused multiply-adds explicitly with fmaf), the
 * toolkit's include directory for cuda_fp8.h and friends. When NVRTC rejects a module the
 * numbered source and NVRTC's log are printed: that is a compiler bug, and the two together
 * are what it takes to fix it. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gpu.h"

#ifdef FP8C_HAVE_NVRTC
#include <nvrtc.h>
#endif

#ifndef FP8C_CUDA_INCLUDE
#define FP8C_CUDA_INCLUDE "/usr/local/cuda/include"
#endif

#define NVRTC_ARCH "sm_90a"

bool cuda_compiler_available(void) {
#ifdef FP8C_HAVE_NVRTC
    return true;
#else
    return false;
#endif
}

void cuda_binary_free(CudaBinary *b) {
    free(b->cubin);
    free(b->ptx);
    memset(b, 0, sizeof *b);
}

/* ---------------------------------------------------------------- the cache */

static bool cache_dir(char *out, size_t len) {
    const char *no = getenv("FP8C_NO_CACHE");
    if (no && *no && strcmp(no, "0") != 0) return false;
    const char *d = getenv("FP8C_CACHE_DIR");
    if (d && *d) snprintf(out, len, "%s", d);
    else if ((d = getenv("XDG_CACHE_HOME")) && *d) snprintf(out, len, "%s/fp8c", d);
    else if ((d = getenv("HOME")) && *d) snprintf(out, len, "%s/.cache/fp8c", d);
    else return false;
    /* mkdir -p */
    for (char *p = out + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        mkdir(out, 0777);
        *p = '/';
    }
    return mkdir(out, 0777) == 0 || errno == EEXIST;
}

static void *read_all(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) buf[n] = 0, *size = (size_t)n;
    return buf;
}

/* written to a temp file and renamed: a concurrent build never reads half a cubin */
static void write_all(const char *path, const void *data, size_t size) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return;
    bool ok = fwrite(data, 1, size, f) == size;
    if (fclose(f) != 0) ok = false;
    if (!ok || rename(tmp, path) != 0) unlink(tmp);
}

/* ---------------------------------------------------------------- compiling */

#ifdef FP8C_HAVE_NVRTC
static void print_numbered(const char *src) {
    int line = 1;
    fprintf(stderr, "%5d  ", line);
    for (const char *p = src; *p; p++) {
        fputc(*p, stderr);
        if (*p == '\n' && p[1]) fprintf(stderr, "%5d  ", ++line);
    }
    fputc('\n', stderr);
}

#define NVRTC_CHECK(call)                                                                    \
    do {                                                                                     \
        nvrtcResult r_ = (call);                                                             \
        if (r_ != NVRTC_SUCCESS) {                                                           \
            fprintf(stderr, "fp8c: error: NVRTC: %s failed: %s at %s:%d\n", #call,           \
                    nvrtcGetErrorString(r_), __FILE__, __LINE__);                            \
            goto fail;                                                                       \
        }                                                                                    \
    } while (0)

/* One compilation for sm_90a gives both products: the cubin, and the PTX it was made from
 * (for inspection; its .target names sm_90a). */
static bool nvrtc_run(const char *src, const char *name, const char *const *opts, int n_opts,
                      void **cubin, size_t *cubin_size, char **ptx, size_t *ptx_size) {
    nvrtcProgram prog = NULL;
    char *log = NULL;
    *cubin = NULL;
    *ptx = NULL;
    NVRTC_CHECK(nvrtcCreateProgram(&prog, src, name, 0, NULL, NULL));
    nvrtcResult r = nvrtcCompileProgram(prog, n_opts, opts);
    if (r != NVRTC_SUCCESS) {
        size_t log_size = 0;
        nvrtcGetProgramLogSize(prog, &log_size);
        log = malloc(log_size + 1);
        if (log) {
            log[0] = 0;
            nvrtcGetProgramLog(prog, log);
        }
        fprintf(stderr, "fp8c: error: NVRTC rejected the generated GPU module %s (%s); the "
                "source follows, then NVRTC's log\n", name, nvrtcGetErrorString(r));
        print_numbered(src);
        fprintf(stderr, "---- NVRTC log (options:");
        for (int i = 0; i < n_opts; i++) fprintf(stderr, " %s", opts[i]);
        fprintf(stderr, ")\n%s\n", log ? log : "(no log)");
        goto fail;
    }
    size_t size = 0;
    NVRTC_CHECK(nvrtcGetCUBINSize(prog, &size));
    *cubin = malloc(size ? size : 1);
    if (!*cubin) goto fail;
    NVRTC_CHECK(nvrtcGetCUBIN(prog, *cubin));
    *cubin_size = size;
    NVRTC_CHECK(nvrtcGetPTXSize(prog, &size));
    *ptx = malloc(size + 1);
    if (!*ptx) goto fail;
    NVRTC_CHECK(nvrtcGetPTX(prog, *ptx));
    (*ptx)[size] = 0;
    while (size && !(*ptx)[size - 1]) size--;   /* the size counts the NUL */
    *ptx_size = size;
    nvrtcDestroyProgram(&prog);
    return true;
fail:
    free(log);
    free(*cubin);
    free(*ptx);
    *cubin = NULL;
    *ptx = NULL;
    if (prog) nvrtcDestroyProgram(&prog);
    return false;
}
#endif

bool cuda_compile_source(const char *src, const char *name, CudaBinary *out) {
    memset(out, 0, sizeof *out);
#ifndef FP8C_HAVE_NVRTC
    (void)src, (void)name;
    fprintf(stderr, "fp8c: error: this fp8c was built without NVRTC: it cannot compile GPU kernels\n");
    return false;
#else
    const char *inc = getenv("FP8C_CUDA_INCLUDE");
    char inc_opt[1100];
    snprintf(inc_opt, sizeof inc_opt, "-I%s", inc && *inc ? inc : FP8C_CUDA_INCLUDE);
    const char *opts_cubin[] = {"--gpu-architecture=" NVRTC_ARCH, "-std=c++17", "--fmad=false",
                                "-default-device", inc_opt};
    int major = 0, minor = 0;
    nvrtcVersion(&major, &minor);
    uint64_t h = cuda_hash(0, src, strlen(src));
    for (size_t i = 0; i < sizeof opts_cubin / sizeof *opts_cubin; i++)
        h = cuda_hash(h, opts_cubin[i], strlen(opts_cubin[i]) + 1);
    h = cuda_hash(h, &major, sizeof major);
    h = cuda_hash(h, &minor, sizeof minor);

    char dir[4096], cubin_path[4200], ptx_path[4200];
    bool cache = cache_dir(dir, sizeof dir);
    if (cache) {
        snprintf(cubin_path, sizeof cubin_path, "%s/cuda-%016llx.cubin", dir, (unsigned long long)h);
        snprintf(ptx_path, sizeof ptx_path, "%s/cuda-%016llx.ptx", dir, (unsigned long long)h);
        size_t size = 0, psize = 0;
        out->cubin = read_all(cubin_path, &size);
        out->ptx = read_all(ptx_path, &psize);   /* for inspection only: may have been pruned */
        if (out->cubin && size > 0) {
            out->cubin_size = size;
            out->cached = true;
            return true;
        }
        cuda_binary_free(out);
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    void *cubin = NULL;
    char *ptx = NULL;
    size_t cubin_size = 0, ptx_size = 0;
    if (!nvrtc_run(src, name, opts_cubin, 5, &cubin, &cubin_size, &ptx, &ptx_size)) return false;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    out->cubin = cubin;
    out->cubin_size = cubin_size;
    out->ptx = ptx;
    out->seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    if (cache) {
        write_all(ptx_path, ptx, ptx_size);
        write_all(cubin_path, cubin, cubin_size);
    }
    return true;
#endif
}

/* One part of the graph's module, compiled on a thread of its own (cuda_compile_source: the
 * cache, then NVRTC; distinct programs, distinct cache files). */
typedef struct {
    const char *src;
    char name[300];
    CudaBinary bin;
    bool ok;
} ModulePart;

static void *compile_part(void *arg) {
    ModulePart *p = arg;
    p->ok = cuda_compile_source(p->src, p->name, &p->bin);
    return NULL;
}

bool cuda_compile_graph(const Graph *g, CudaBinary *out, bool *skipped, char *why, size_t why_len) {
    memset(out, 0, sizeof *out);
    *skipped = false;
    Arena *a = arena_new();
    CuNodePlan *plans = cuda_plan_graph(g, a, why, why_len);
    if (!plans) {
        *skipped = true;
        arena_free(a);
        return true;
    }
    int n_kernels = 0;
    char *texts[CUDA_MODULE_PARTS];
    int n = cuda_render_module_parts(g, plans, a, texts, &n_kernels);
    ModulePart parts[CUDA_MODULE_PARTS];
    pthread_t threads[CUDA_MODULE_PARTS];
    bool threaded[CUDA_MODULE_PARTS] = {false};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int p = 0; p < n; p++) {
        memset(&parts[p], 0, sizeof parts[p]);
        parts[p].src = texts[p];
        snprintf(parts[p].name, sizeof parts[p].name, "%s.%d.cu",
                 g->model_name && *g->model_name ? g->model_name : "module", p);
        threaded[p] = p > 0 && pthread_create(&threads[p], NULL, compile_part, &parts[p]) == 0;
    }
    for (int p = 0; p < n; p++)
        if (!threaded[p]) compile_part(&parts[p]);
    for (int p = 0; p < n; p++)
        if (threaded[p]) pthread_join(threads[p], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    bool ok = true, cached = true;
    const void *cubins[CUDA_MODULE_PARTS];
    size_t sizes[CUDA_MODULE_PARTS], ptx_len = 0;
    for (int p = 0; p < n; p++) {
        ok = ok && parts[p].ok;
        cached = cached && parts[p].bin.cached;
        cubins[p] = parts[p].bin.cubin, sizes[p] = parts[p].bin.cubin_size;
        ptx_len += parts[p].bin.ptx ? strlen(parts[p].bin.ptx) : 0;
    }
    if (ok) {
        out->cubin = cuda_module_set_pack(cubins, sizes, n, &out->cubin_size);
        out->ptx = malloc(ptx_len + 1);   /* the parts' PTX one after the other, for inspection */
        if (out->ptx) {
            out->ptx[0] = 0;
            for (int p = 0; p < n; p++)
                if (parts[p].bin.ptx) strcat(out->ptx, parts[p].bin.ptx);
        }
        ok = out->cubin != NULL;
        if (!ok) fprintf(stderr, "fp8c: error: out of memory for the GPU kernels\n");
    }
    out->cached = cached;
    out->seconds = cached ? 0 : (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    out->n_kernels = n_kernels;
    for (int p = 0; p < n; p++) cuda_binary_free(&parts[p].bin);
    if (!ok) cuda_binary_free(out);
    arena_free(a);
    return ok;
}
