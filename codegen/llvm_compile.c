/* llvm_compile.c — a rendered module to an object file: the optimizer, the target, the cache.
 *
 * llvm.c renders a program to an LLVM module; this file makes the object the training binary
 * links: it renders the module, looks its hash up in the object cache, and on a miss verifies
 * the module, runs the -O2/-O3 pipeline (loop and SLP vectorization) for the host CPU or the
 * one asked for, and writes the object, then copies it into the cache (under a temporary name,
 * renamed, so that a build running at the same time never takes half a file). The key is the
 * unoptimized module's text, the target triple, the CPU, its features, the optimization level
 * and LLVM's version: everything the object's bytes depend on. Kept apart from the renderer
 * because it is the part that knows about machines, files and caches, and not about kernels. */
#include "llvm_internal.h"

/* ---------------------------------------------------------------- the object cache */

static char *cache_dir(void)
{
    const char *env = getenv("FP8C_CACHE_DIR");
    char buf[4096];
    if (env && *env) {
        snprintf(buf, sizeof buf, "%s", env);
    } else {
        const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
        if (xdg && *xdg) snprintf(buf, sizeof buf, "%s/fp8c", xdg);
        else if (home && *home) snprintf(buf, sizeof buf, "%s/.cache/fp8c", home);
        else return NULL;
    }
    /* mkdir -p, quietly: no cache is slower, not wrong */
    for (char *s = buf + 1; *s; s++)
        if (*s == '/') {
            *s = 0;
            mkdir(buf, 0755);
            *s = '/';
        }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return NULL;
    return strdup(buf);
}

static bool copy_file(const char *from, const char *to)
{
    FILE *in = fopen(from, "rb");
    if (!in) return false;
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp%d", to, (int)getpid());
    FILE *out = fopen(tmp, "wb");
    bool ok = out != NULL;
    char buf[65536];
    size_t got;
    while (ok && (got = fread(buf, 1, sizeof buf, in)) > 0) ok = fwrite(buf, 1, got, out) == got;
    fclose(in);
    if (out && fclose(out) != 0) ok = false;
    if (ok) ok = rename(tmp, to) == 0;
    if (!ok) unlink(tmp);
    return ok;
}

/* ---------------------------------------------------------------- compile */

/* LLVM ends the process on a fatal error, by default with an abort and a core dump. The one a
 * user can cause is a CPU it cannot make x86-64 code for (--cpu or FP8C_CPU naming no CPU, or
 * a 32-bit one: "64-bit code requested on a subtarget that doesn't support it"), so the error
 * is reported as fp8c's, naming the CPU, and the process ends with status 1. _exit, not exit:
 * the handler runs inside LLVM, on the compiling thread, where LLVM's own destructors must not
 * run. */
static const char *fatal_cpu;

static void llvm_fatal(const char *reason)
{
    fflush(stdout);
    fprintf(stderr, "fp8c: error: LLVM cannot compile the CPU kernels for CPU '%s' (--cpu, FP8C_CPU): %s\n",
            fatal_cpu ? fatal_cpu : "?", reason);
    _exit(1);
}

char *cg_llvm_host(void)
{
    char *triple = LLVMGetDefaultTargetTriple(), *cpu = LLVMGetHostCPUName();
    char *features = LLVMGetHostCPUFeatures();
    size_t n = strlen(FP8C_LLVM_VERSION) + strlen(triple) + strlen(cpu) + strlen(features) + 4;
    char *out = malloc(n);
    if (out) snprintf(out, n, "%s|%s|%s|%s", FP8C_LLVM_VERSION, triple, cpu, features);
    LLVMDisposeMessage(triple);
    LLVMDisposeMessage(cpu);
    LLVMDisposeMessage(features);
    return out;
}

void cg_llvm_check_cpu(const char *cpu)
{
    if (!cpu || !*cpu || !strcmp(cpu, "native")) return;
    LLVMInitializeNativeTarget();
    LLVMInitializeNativeAsmPrinter();
    fatal_cpu = cpu;
    LLVMInstallFatalErrorHandler(llvm_fatal);
    char *triple = LLVMGetDefaultTargetTriple(), *err = NULL;
    LLVMTargetRef target = NULL;
    if (!LLVMGetTargetFromTriple(triple, &target, &err)) {
        LLVMContextRef ctx = LLVMContextCreate();
        LLVMModuleRef mod = LLVMModuleCreateWithNameInContext("cpu", ctx);
        LLVMSetTarget(mod, triple);
        LLVMValueRef fn = LLVMAddFunction(mod, "f", LLVMFunctionType(LLVMVoidTypeInContext(ctx), NULL, 0, 0));
        LLVMBuilderRef b = LLVMCreateBuilderInContext(ctx);
        LLVMPositionBuilderAtEnd(b, LLVMAppendBasicBlockInContext(ctx, fn, "entry"));
        LLVMBuildRetVoid(b);
        LLVMDisposeBuilder(b);
        LLVMTargetMachineRef tm = LLVMCreateTargetMachine(target, triple, cpu, "", LLVMCodeGenLevelNone,
                                                          LLVMRelocPIC, LLVMCodeModelDefault);
        LLVMMemoryBufferRef buf = NULL;
        if (tm && !LLVMTargetMachineEmitToMemoryBuffer(tm, mod, LLVMObjectFile, &err, &buf))
            LLVMDisposeMemoryBuffer(buf);
        if (tm) LLVMDisposeTargetMachine(tm);
        LLVMDisposeModule(mod);
        LLVMContextDispose(ctx);
    }
    LLVMDisposeMessage(err);
    LLVMDisposeMessage(triple);
}

bool cg_llvm_compile(const CgProgram *p, const CgLlvmOptions *o, const char *obj_path)
{
    static const CgLlvmOptions defaults = {.opt_level = 2};
    if (!o) o = &defaults;
    if (o->cached) *o->cached = false;
    LLVMInitializeNativeTarget();
    LLVMInitializeNativeAsmPrinter();
    char *triple = LLVMGetDefaultTargetTriple();
    bool native = !o->cpu || !*o->cpu || !strcmp(o->cpu, "native");
    char *cpu = native ? LLVMGetHostCPUName() : NULL;
    char *features = native ? LLVMGetHostCPUFeatures() : NULL;
    const char *cpu_name = native ? cpu : o->cpu;
    int level = o->opt_level > 0 ? o->opt_level : 2;
    fatal_cpu = cpu_name;
    LLVMInstallFatalErrorHandler(llvm_fatal);

    R r = {0};
    llvm_render_module(&r, p);
    char *err = NULL;
    bool ok = true;
    if (LLVMVerifyModule(r.mod, LLVMReturnStatusAction, &err)) {
        fprintf(stderr, "fp8c: internal error: the kernel module does not verify: %s\n", err);
        ok = false;
    }
    LLVMDisposeMessage(err);
    err = NULL;

    /* the cache key: what was rendered and how it is to be compiled */
    char *text = ok ? LLVMPrintModuleToString(r.mod) : NULL;
    uint64_t key = 0;
    if (text) {
        key = cg_hash_bytes(0, text, strlen(text));
        char opts[512];
        snprintf(opts, sizeof opts, "llvm%s|%s|%s|%s|O%d", FP8C_LLVM_VERSION, triple, cpu_name,
                 features ? features : "", level);
        key = cg_hash_bytes(key, opts, strlen(opts));
        LLVMDisposeMessage(text);
    }
    char *dir = ok && !o->no_cache ? cache_dir() : NULL;
    char cached[4200] = "";
    if (dir) {
        snprintf(cached, sizeof cached, "%s/%016llx.o", dir, (unsigned long long)key);
        if (access(cached, R_OK) == 0 && !o->dump_ir && copy_file(cached, obj_path)) {
            if (o->cached) *o->cached = true;
            free(dir);
            llvm_dispose(&r);
            LLVMDisposeMessage(triple);
            if (cpu) LLVMDisposeMessage(cpu);
            if (features) LLVMDisposeMessage(features);
            return true;
        }
    }

    LLVMTargetRef target = NULL;
    LLVMTargetMachineRef tm = NULL;
    if (ok && LLVMGetTargetFromTriple(triple, &target, &err)) {
        fprintf(stderr, "fp8c: error: LLVM has no target for %s: %s\n", triple, err);
        ok = false;
    }
    if (ok) {
        tm = LLVMCreateTargetMachine(target, triple, cpu_name, features ? features : "",
                                     level >= 3 ? LLVMCodeGenLevelAggressive : LLVMCodeGenLevelDefault,
                                     LLVMRelocPIC, LLVMCodeModelDefault);
        if (!tm) {
            fprintf(stderr, "fp8c: error: LLVM cannot make code for CPU '%s'\n", cpu_name);
            ok = false;
        }
    }
    if (ok) {
        LLVMSetTarget(r.mod, triple);
        LLVMTargetDataRef dl = LLVMCreateTargetDataLayout(tm);
        LLVMSetModuleDataLayout(r.mod, dl);
        LLVMDisposeTargetData(dl);
        /* target attributes on every function, so that the vectorizer costs for this CPU */
        for (LLVMValueRef f = LLVMGetFirstFunction(r.mod); f; f = LLVMGetNextFunction(f)) {
            if (LLVMIsDeclaration(f)) continue;
            LLVMAddAttributeAtIndex(f, LLVMAttributeFunctionIndex,
                                    LLVMCreateStringAttribute(r.ctx, "target-cpu", 10, cpu_name, (unsigned)strlen(cpu_name)));
            if (features && *features)
                LLVMAddAttributeAtIndex(f, LLVMAttributeFunctionIndex,
                                        LLVMCreateStringAttribute(r.ctx, "target-features", 15, features, (unsigned)strlen(features)));
            /* LLVM prefers 256-bit vectors on AVX-512 CPUs unless told otherwise; these loops
             * are long and regular, and at 512 bits gpt2_tiny's step took 7% less time (its
             * attention 25% less) on a Xeon with AMX. On CPUs without AVX-512 this is moot. */
            LLVMAddAttributeAtIndex(f, LLVMAttributeFunctionIndex,
                                    LLVMCreateStringAttribute(r.ctx, "prefer-vector-width", 19, "512", 3));
        }
        LLVMPassBuilderOptionsRef po = LLVMCreatePassBuilderOptions();
        LLVMPassBuilderOptionsSetLoopVectorization(po, 1);
        LLVMPassBuilderOptionsSetSLPVectorization(po, 1);
        LLVMPassBuilderOptionsSetLoopUnrolling(po, 1);
        LLVMPassBuilderOptionsSetLoopInterleaving(po, 1);
        char pipeline[32];
        snprintf(pipeline, sizeof pipeline, "default<O%d>", level);
        LLVMErrorRef e = LLVMRunPasses(r.mod, pipeline, tm, po);
        LLVMDisposePassBuilderOptions(po);
        if (e) {
            char *m = LLVMGetErrorMessage(e);
            fprintf(stderr, "fp8c: error: LLVM passes failed: %s\n", m);
            LLVMDisposeErrorMessage(m);
            ok = false;
        }
    }
    if (ok && o->dump_ir) {
        char *t = LLVMPrintModuleToString(r.mod);
        fputs(t, stderr);
        LLVMDisposeMessage(t);
    }
    if (ok && LLVMTargetMachineEmitToFile(tm, r.mod, (char *)obj_path, LLVMObjectFile, &err)) {
        fprintf(stderr, "fp8c: error: %s: LLVM cannot write the object: %s\n", obj_path, err);
        LLVMDisposeMessage(err);
        ok = false;
    }
    if (ok && dir) copy_file(obj_path, cached);
    if (tm) LLVMDisposeTargetMachine(tm);
    free(dir);
    llvm_dispose(&r);
    LLVMDisposeMessage(triple);
    if (cpu) LLVMDisposeMessage(cpu);
    if (features) LLVMDisposeMessage(features);
    return ok;
}
