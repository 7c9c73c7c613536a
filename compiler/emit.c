/* emit.c — the last stage: a planned graph becomes a training binary.
 *
 * The artifact is the graph's textual IR (ir_print), the same text `fp8c opt` reads: it holds
 * the nodes, every tensor's format and its place in the memory plan, so the runtime needs
 * nothing else to run the step. Rather than turning that text into a C array (slow to compile
 * for big graphs, and a second encoding to keep right), an assembler file pulls the bytes in
 * with `.incbin` between two symbols, and the system C compiler links it with the runtime
 * libraries built next to fp8c (libfp8c_train_main.a, libfp8c_rt.a, libfp8c_ir.a). The linked
 * binary needs no compiler, no model file and no artifact file at run time.
 *
 * Where things are found: the C compiler is $FP8C_CC, else the one fp8c was built with, else
 * `cc`; the libraries are in $FP8C_LIBDIR, else beside fp8c or in ../lib/fp8c from it (see
 * emit_libdir). A binary built under
 * sanitizers is linked with them too (FP8C_LINK_FLAGS, set by CMake).
 *
 * The output appears only when the link succeeded: the linker writes a temp file beside it,
 * which is renamed over the target, so a failed build never leaves a half-written binary (or
 * destroys a working one).
 *
 * The GPU module (NVRTC) and the CPU kernels (LLVM) compile at the same time, on two threads,
 * and each stage prints one line on stderr when it ends (build_progress), so that a build of
 * tens of seconds says what it is doing. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "compiler.h"
#ifdef FP8C_HAVE_CUDA
#include "gpu.h"
#endif
#ifdef FP8C_HAVE_LLVM
#include "codegen.h"
#endif

#ifndef FP8C_C_COMPILER
#define FP8C_C_COMPILER "cc"
#endif
#ifndef FP8C_LINK_FLAGS
#define FP8C_LINK_FLAGS ""
#endif

#define EMIT_MAX_ARGS 64

#ifdef FP8C_HAVE_CUDA
static const char *const emit_libs[] = {"libfp8c_train_main.a", "libfp8c_cuda_rt.a", "libfp8c_rt.a",
                                        "libfp8c_kernels.a", "libfp8c_ir.a"};
#else
static const char *const emit_libs[] = {"libfp8c_train_main.a", "libfp8c_rt.a", "libfp8c_kernels.a",
                                        "libfp8c_ir.a"};
#endif
#define EMIT_N_LIBS ((int)(sizeof emit_libs / sizeof emit_libs[0]))

double build_clock(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

void build_progress(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fp8c: %s\n", line);   /* one call: lines from two threads never mix */
    fflush(stderr);
}

bool build_no_cache(void) {
    const char *no = getenv("FP8C_NO_CACHE");
    return no && *no && strcmp(no, "0") != 0;
}

const char *const *emit_runtime_libs(int *n) {
    *n = EMIT_N_LIBS;
    return emit_libs;
}

const char *emit_compiler(void) {
    const char *env = getenv("FP8C_CC");
    if (env && *env) return env;
    if (access(FP8C_C_COMPILER, X_OK) == 0) return FP8C_C_COMPILER;
    return "cc";
}

/* $FP8C_LIBDIR, else found from this executable's own path: the libraries beside it (the
 * build tree), else in ../lib/fp8c (an installed tree, `cmake --install`). No directory of the
 * machine fp8c was built on is written into it. */
const char *emit_libdir(void) {
    const char *env = getenv("FP8C_LIBDIR");
    if (env && *env) return env;
    static char dir[4096];
    char exe[4000];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return ".";
    exe[n] = 0;
    *strrchr(exe, '/') = 0;
    snprintf(dir, sizeof dir, "%s/libfp8c_rt.a", exe);
    if (access(dir, R_OK) != 0) {
        snprintf(dir, sizeof dir, "%s/../lib/fp8c/libfp8c_rt.a", exe);
        if (access(dir, R_OK) == 0) {
            snprintf(dir, sizeof dir, "%s/../lib/fp8c", exe);
            return dir;
        }
    }
    snprintf(dir, sizeof dir, "%s", exe);
    return dir;
}

/* A private directory for the build's intermediate files, NULL after the message. */
static char *emit_tempdir(void) {
    const char *base = getenv("TMPDIR");
    if (!base || !*base) base = "/tmp";
    size_t n = strlen(base) + 32;
    char *dir = malloc(n);
    if (!dir) return NULL;
    snprintf(dir, n, "%s/fp8c-XXXXXX", base);
    if (!mkdtemp(dir)) {
        fprintf(stderr, "fp8c: error: cannot create a temp directory in %s: %s\n", base,
                strerror(errno));
        free(dir);
        return NULL;
    }
    return dir;
}

static char *emit_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static void emit_incbin(FILE *f, const char *path) {
    fputs("\t.incbin \"", f);
    for (const char *p = path; *p; p++) {
        if (*p == '"' || *p == '\\') fputc('\\', f);
        fputc(*p, f);
    }
    fputs("\"\n", f);
}

/* The assembler file: the artifact's bytes, then a NUL, between two global symbols; then
 * the GPU kernels' cubin (possibly empty) between fp8c_cubin and fp8c_cubin_end. */
static bool emit_write_asm(const char *asm_path, const char *ir_path, const char *cubin_path) {
    FILE *f = fopen(asm_path, "w");
    if (!f) return false;
    fputs("\t.section .rodata\n\t.balign 16\n\t.global fp8c_cubin\n"
          "\t.type fp8c_cubin, @object\nfp8c_cubin:\n", f);
    if (cubin_path) emit_incbin(f, cubin_path);
    fputs("\t.global fp8c_cubin_end\nfp8c_cubin_end:\n", f);
    fputs("\t.section .rodata\n\t.balign 16\n\t.global fp8c_artifact\n"
          "\t.type fp8c_artifact, @object\nfp8c_artifact:\n\t.incbin \"", f);
    for (const char *p = ir_path; *p; p++) {
        if (*p == '"' || *p == '\\') fputc('\\', f);
        fputc(*p, f);
    }
    fputs("\"\n\t.byte 0\n\t.global fp8c_artifact_end\nfp8c_artifact_end:\n"
          "\t.section .note.GNU-stack,\"\",@progbits\n", f);
    return fclose(f) == 0;
}

/* Runs argv[0] with argv and waits; returns its exit status, 128+signal, or -1. */
static int emit_spawn(char *const *argv, bool shield_signals) {
    fflush(NULL);   /* what fp8c printed so far comes before the child's output */
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        execvp(argv[0], argv);
        fprintf(stderr, "fp8c: error: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    /* Ctrl-C reaches the child through the terminal; the parent only waits for it */
    struct sigaction ignore = {.sa_handler = SIG_IGN}, old_int, old_quit;
    if (shield_signals) {
        sigaction(SIGINT, &ignore, &old_int);
        sigaction(SIGQUIT, &ignore, &old_quit);
    }
    int status = 0;
    pid_t got;
    do got = waitpid(pid, &status, 0);
    while (got < 0 && errno == EINTR);
    if (shield_signals) {
        sigaction(SIGINT, &old_int, NULL);
        sigaction(SIGQUIT, &old_quit, NULL);
    }
    if (got < 0) return -1;
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -1;
}

/* mkstemp made the linker's output file 0600; a binary gets the usual 0777 less the umask. */
static bool emit_make_executable(const char *path) {
    mode_t mask = umask(0);
    umask(mask);
    return chmod(path, 0777 & ~mask) == 0;
}

static bool emit_link(const char *asm_path, const char *obj_path, const char *out_path) {
    const char *libdir = emit_libdir();
    char *lib_paths[EMIT_N_LIBS] = {0};
    bool ok = true;
    for (int i = 0; i < EMIT_N_LIBS && ok; i++) {
        lib_paths[i] = emit_join(libdir, emit_libs[i]);
        if (!lib_paths[i] || access(lib_paths[i], R_OK) != 0) {
            fprintf(stderr, "fp8c: error: cannot find the runtime library %s in %s (set "
                    "FP8C_LIBDIR to the directory fp8c was built in)\n", emit_libs[i], libdir);
            ok = false;
        }
    }
    /* the linker writes a temp file beside the target, renamed once complete */
    char *tmp_out = NULL;
    if (ok) {
        size_t n = strlen(out_path) + 16;
        tmp_out = malloc(n);
        snprintf(tmp_out, n, "%s.XXXXXX", out_path);
        int fd = mkstemp(tmp_out);
        if (fd < 0) {
            fprintf(stderr, "fp8c: error: %s: cannot create the output: %s\n", out_path,
                    strerror(errno));
            ok = false;
        } else {
            close(fd);
        }
    }
    if (ok) {
        char flags[] = FP8C_LINK_FLAGS;
        char *argv[EMIT_MAX_ARGS];
        int argc = 0;
        argv[argc++] = (char *)emit_compiler();
        argv[argc++] = "-o";
        argv[argc++] = tmp_out;
        argv[argc++] = (char *)asm_path;
        if (obj_path) argv[argc++] = (char *)obj_path;
        for (int i = 0; i < EMIT_N_LIBS; i++) argv[argc++] = lib_paths[i];
        argv[argc++] = "-lm";
#ifdef FP8C_HAVE_CUDA
        argv[argc++] = "-ldl";
#endif
        argv[argc++] = "-lpthread";
        for (char *save = NULL, *w = strtok_r(flags, " ", &save); w && argc < EMIT_MAX_ARGS - 1;
             w = strtok_r(NULL, " ", &save))
            argv[argc++] = w;
        argv[argc] = NULL;
        int rc = emit_spawn(argv, false);
        if (rc != 0) {
            fprintf(stderr, "fp8c: error: linking %s failed (%s exited with status %d):", out_path,
                    argv[0], rc);
            for (int i = 0; i < argc; i++) fprintf(stderr, " %s", argv[i]);
            fputc('\n', stderr);
            ok = false;
        } else if (!emit_make_executable(tmp_out) || rename(tmp_out, out_path) != 0) {
            fprintf(stderr, "fp8c: error: %s: cannot write: %s\n", out_path, strerror(errno));
            ok = false;
        }
    }
    if (tmp_out && !ok) unlink(tmp_out);
    free(tmp_out);
    for (int i = 0; i < EMIT_N_LIBS; i++) free(lib_paths[i]);
    return ok;
}

/* The notes this build printed, one per line, for the cache to print again on a hit. */
static char emit_note_text[1024];

const char *emit_notes(void) { return emit_note_text; }

/* The GPU kernels of g (cuda/), compiled by NVRTC into a cubin file in dir; *path stays NULL
 * when there are none: fp8c built without CUDA, FP8C_GPU=0, or a node the GPU backend cannot
 * run yet (a note says which; the binary then trains on the CPU). False only when NVRTC
 * rejected the generated module (its source and log are printed). */
static bool emit_gpu_kernels(const Graph *g, const char *dir, char **path) {
    *path = NULL;
#ifdef FP8C_HAVE_CUDA
    const char *want = getenv("FP8C_GPU");
    if ((want && !strcmp(want, "0")) || !cuda_compiler_available()) return true;
    CudaBinary bin;
    bool skipped = false;
    char why[512] = "";
    double t0 = build_clock();
    if (!cuda_compile_graph(g, &bin, &skipped, why, sizeof why)) return false;
    if (skipped) {
        fprintf(stderr, "fp8c: note: no GPU kernels in this binary: %s\n", why);
        snprintf(emit_note_text, sizeof emit_note_text, "no GPU kernels in this binary: %s", why);
        return true;
    }
    double total = build_clock() - t0;
    if (bin.cached)
        build_progress("GPU kernels: %d rendered, NVRTC cached (%.2f s)", bin.n_kernels, total);
    else
        build_progress("GPU kernels: %d rendered (%.2f s), NVRTC %.1f s", bin.n_kernels,
                       total - bin.seconds, bin.seconds);
    char *p = emit_join(dir, "kernels.cubin");
    FILE *f = p ? fopen(p, "wb") : NULL;
    bool ok = f && fwrite(bin.cubin, 1, bin.cubin_size, f) == bin.cubin_size;
    if (f && fclose(f) != 0) ok = false;
    cuda_binary_free(&bin);
    if (!ok) {
        fprintf(stderr, "fp8c: error: %s: cannot write the GPU kernels: %s\n", p ? p : dir,
                strerror(errno));
        if (p) unlink(p);
        free(p);
        return false;
    }
    *path = p;
#else
    (void)g, (void)dir;
#endif
    return true;
}

/* The CPU kernels (codegen/), rendered by LLVM into an object file in dir; *path stays NULL
 * when fp8c was built without LLVM or FP8C_CPU_KERNELS=0 (the binary then runs the reference
 * executor). They are lowered from the artifact as read back, exactly as the training binary
 * re-lowers it at start-up, so the two agree (the binary checks the kernels' hash). */
static const char *emit_cpu_name;
static bool emit_print_kernels;

void emit_set_cpu(const char *cpu) { emit_cpu_name = cpu; }
void emit_set_print_kernels(bool on) { emit_print_kernels = on; }

static bool emit_cpu_kernels(const char *ir_path, const char *dir, char **path) {
    *path = NULL;
#ifdef FP8C_HAVE_LLVM
    const char *want = getenv("FP8C_CPU_KERNELS");
    if (want && !strcmp(want, "0")) return true;
    double t0 = build_clock();
    FILE *f = fopen(ir_path, "rb");
    char *text = NULL;
    size_t len = 0;
    if (f) {
        FILE *m = open_memstream(&text, &len);
        char buf[65536];
        size_t got;
        while (m && (got = fread(buf, 1, sizeof buf, f)) > 0) fwrite(buf, 1, got, m);
        if (m) fclose(m);
        fclose(f);
    }
    Arena *a = arena_new();
    Graph *g = text ? ir_read(a, "artifact", text) : NULL;
    CgProgram *p = g ? (ir_renumber(g), cg_lower(g, a, NULL)) : NULL;
    if (p && emit_print_kernels) cg_program_print(p, stdout);
    char *obj = emit_join(dir, "kernels.o");
    const char *cpu = emit_cpu_name ? emit_cpu_name : getenv("FP8C_CPU");
    bool cached = false;
    CgLlvmOptions o = {.cpu = cpu, .opt_level = 3, .no_cache = build_no_cache(), .cached = &cached};
    double t1 = build_clock();
    bool ok = p && obj && cg_llvm_compile(p, &o, obj);
    if (!ok) fprintf(stderr, "fp8c: error: the CPU kernels of this plan did not compile\n");
    double t2 = build_clock();
    if (ok)
        build_progress("CPU kernels: %d lowered (%.2f s), LLVM %s%.2f s", p->n_kernels, t1 - t0,
                       cached ? "cached " : "", t2 - t1);
    if (ok) *path = obj;
    else free(obj);
    free(text);
    arena_free(a);
    return ok;
#else
    (void)ir_path, (void)dir;
    return true;
#endif
}

/* The GPU kernels compile on a thread of their own while the CPU kernels compile on the
 * caller's: NVRTC and LLVM are separate libraries with no state in common, the GPU side only
 * reads g, and the CPU side works on its own copy read back from the artifact. On two cores
 * the kernel stages take as long as the longer of the two (NVRTC) instead of their sum. */
typedef struct {
    const Graph *g;
    const char *dir;
    char *path;
    bool ok;
} GpuJob;

static void *emit_gpu_job(void *arg) {
    GpuJob *j = arg;
    j->ok = emit_gpu_kernels(j->g, j->dir, &j->path);
    return NULL;
}

bool emit_training_binary(const Graph *g, const char *out_path) {
    emit_note_text[0] = 0;
#ifdef FP8C_HAVE_LLVM
    /* a CPU LLVM cannot compile for ends the build here, before it has made a temp directory */
    const char *kernels = getenv("FP8C_CPU_KERNELS");
    if (!kernels || strcmp(kernels, "0")) cg_llvm_check_cpu(emit_cpu_name ? emit_cpu_name : getenv("FP8C_CPU"));
#endif
    char *dir = emit_tempdir();
    if (!dir) return false;
    char *ir_path = emit_join(dir, "artifact.ir");
    char *asm_path = emit_join(dir, "artifact.s");
    bool ok = ir_path && asm_path;
    if (ok) {
        FILE *f = fopen(ir_path, "w");
        ok = f != NULL;
        if (f) {
            ir_print(g, f);
            ok = !ferror(f);
            if (fclose(f) != 0) ok = false;
        }
        if (!ok)
            fprintf(stderr, "fp8c: error: %s: cannot write the artifact: %s\n", ir_path,
                    strerror(errno));
    }
    char *cubin_path = NULL, *obj_path = NULL;
    if (ok) {
        GpuJob job = {.g = g, .dir = dir};
        pthread_t thread;
        bool threaded = pthread_create(&thread, NULL, emit_gpu_job, &job) == 0;
        if (!threaded) emit_gpu_job(&job);
        ok = emit_cpu_kernels(ir_path, dir, &obj_path);
        if (threaded) pthread_join(thread, NULL);
        cubin_path = job.path;
        ok = ok && job.ok;
    }
    if (ok && !emit_write_asm(asm_path, ir_path, cubin_path)) {
        fprintf(stderr, "fp8c: error: %s: cannot write: %s\n", asm_path, strerror(errno));
        ok = false;
    }
    double t0 = build_clock();
    if (ok) ok = emit_link(asm_path, obj_path, out_path);
    if (ok) build_progress("link %.2f s", build_clock() - t0);
    if (obj_path) unlink(obj_path);
    free(obj_path);
    if (ir_path) unlink(ir_path);
    if (asm_path) unlink(asm_path);
    if (cubin_path) unlink(cubin_path);
    free(cubin_path);
    rmdir(dir);
    free(ir_path);
    free(asm_path);
    free(dir);
    return ok;
}

char *emit_train_dir(void) { return emit_tempdir(); }

char *emit_train_path(const char *dir, const char *model_name) {
    bool usable = model_name && *model_name && !strchr(model_name, '/') &&
                  strcmp(model_name, ".") && strcmp(model_name, "..");
    const char *name = usable ? model_name : "train";
    return emit_join(dir, name);
}

int emit_train_run(char *dir, char *bin, char **run_args, int n_run_args) {
    int status = 1;
    char **args = calloc((size_t)n_run_args + 2, sizeof *args);
    if (args) {
        args[0] = bin;
        for (int i = 0; i < n_run_args; i++) args[i + 1] = run_args[i];
        status = emit_spawn(args, true);
        if (status < 0) {
            fprintf(stderr, "fp8c: error: cannot run %s: %s\n", bin, strerror(errno));
            status = 1;
        }
        free(args);
    }
    unlink(bin);
    rmdir(dir);
    free(bin);
    free(dir);
    return status;
}
