/* main.c — the fp8c command line.
 *
 *   fp8c plan  MODEL [build flags] [--json] [--vs -On | --vs-model M]   precision + memory table
 *   fp8c plan  MODEL [build flags] --kernels [--device cuda|cpu]        the kernel program
 *   fp8c build MODEL [build flags] -o NAME                               a training binary
 *   fp8c train MODEL [build flags] [-- run flags]                        build, then run it
 *   fp8c opt   FILE.ir --passes=a,b                                      run passes on textual IR
 *   fp8c passes                                                          list the passes
 *
 * Build flags: -O0..-O3, --batch N, --seq N, -D name=value, --policy FILE,
 * --precision PATTERN=FORMAT, --grad-release, --print-ir-after=PASS|all, --verify.
 * Every flag is checked; a bad one is one line on stderr and exit status 2. */
#include "compiler.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_DEFINES 64
#define MAX_OVERRIDES 64

/* One arena for the command. It is reachable from here until main returns, also when a user
 * error ends the run early through exit(), so leak checkers see no lost compilation. */
static Arena *the_arena;

static Arena *session_arena(void)
{
    if (!the_arena) the_arena = arena_new();
    return the_arena;
}

static void usage(FILE *out)
{
    fputs("usage: fp8c plan  MODEL [build flags] [--json] [--vs -On] [--kernels [--device cuda|cpu]]\n"
          "       fp8c build MODEL [build flags] -o NAME\n"
          "       fp8c train MODEL [build flags] [-- run flags]\n"
          "       fp8c opt   FILE.ir --passes=a,b [--print-ir-after=PASS|all]\n"
          "       fp8c passes\n"
          "       fp8c --version\n"
          "build flags: -O0..-O3  --batch N  --seq N  -D name=value  --policy FILE\n"
          "             --precision PATTERN=FORMAT  --grad-release  --verify\n"
          "             --print-ir-after=PASS|all  --stop-after=PASS\n"
          "             --cpu=NAME (CPU kernels for an LLVM CPU, e.g. x86-64-v3; default: this one)\n"
          "             --print-kernels (build: the CPU kernels, as the binary runs them, to stdout)\n",
          out);
}

static _Noreturn void bad_flag(const char *fmt, const char *arg)
{
    fprintf(stderr, "fp8c: error: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see fp8c --help)\n");
    exit(2);
}

static int64_t parse_size(const char *flag, const char *s)
{
    char *end;
    errno = 0;
    long long v = s ? strtoll(s, &end, 10) : 0;
    if (!s || errno || *end || v <= 0 || v > (1LL << 30)) {
        fprintf(stderr, "fp8c: error: %s needs a positive integer, not '%s'\n", flag, s ? s : "");
        exit(2);
    }
    return v;
}

typedef struct {
    BuildOptions build;
    Define defines[MAX_DEFINES];
    char define_names[MAX_DEFINES][64];
    const char *overrides[MAX_OVERRIDES];
    const char *model;
    const char *output;
    bool json;
    bool level_given;          /* -On was on the command line (opt: overrides the IR's opt=) */
    int vs_level;              /* --vs -On: compare with another level; -1 none */
    bool kernels;              /* plan --kernels: the kernel program instead of the table */
    const char *device;        /* plan --kernels --device cuda|cpu (default cuda) */
    const char *passes;        /* opt: --passes= */
    char **run_args;           /* train: what follows -- */
    int n_run_args;
    char **flags;              /* everything after the command (the binary cache's key) */
    int n_flags;
    bool print_kernels;
} Args;

/* Parses the flags shared by plan, build, train and opt. */
static void parse_args(int argc, char **argv, Args *a)
{
    memset(a, 0, sizeof *a);
    a->flags = argv;
    a->n_flags = argc;
    a->vs_level = -1;
    a->build.passes.opt_level = 0;
    a->build.front.defines = a->defines;
    a->build.passes.overrides = a->overrides;
#ifndef NDEBUG
    a->build.passes.verify = true;
#endif
    for (int i = 0; i < argc; i++) {
        char *s = argv[i];
        const char *next = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(s, "--")) {
            a->run_args = argv + i + 1;
            a->n_run_args = argc - i - 1;
            break;
        } else if (s[0] == '-' && s[1] == 'O' && s[2] >= '0' && s[2] <= '3' && !s[3]) {
            a->build.passes.opt_level = s[2] - '0';
            a->level_given = true;
        } else if (!strcmp(s, "--batch")) {
            a->build.front.batch = parse_size(s, next), i++;
        } else if (!strcmp(s, "--seq")) {
            a->build.front.seq = parse_size(s, next), i++;
        } else if (!strncmp(s, "-D", 2)) {
            const char *def = s[2] ? s + 2 : next;
            if (!s[2]) i++;
            const char *eq = def ? strchr(def, '=') : NULL;
            if (!eq || eq == def) bad_flag("-D needs name=value, not '%s'", def ? def : "");
            if (a->build.front.n_defines == MAX_DEFINES) bad_flag("too many -D flags%s", "");
            if (eq - def >= (ptrdiff_t)sizeof a->define_names[0]) bad_flag("-D name too long: '%s'", def);
            int k = a->build.front.n_defines++;
            memcpy(a->define_names[k], def, (size_t)(eq - def));
            a->define_names[k][eq - def] = 0;
            a->defines[k] = (Define){a->define_names[k], eq + 1};
        } else if (!strcmp(s, "--policy")) {
            if (!next) bad_flag("%s needs a file", s);
            a->build.passes.policy_file = next, i++;
        } else if (!strcmp(s, "--precision")) {
            if (!next || !strchr(next, '=')) bad_flag("--precision needs PATTERN=FORMAT, not '%s'", next ? next : "");
            if (a->build.passes.n_overrides == MAX_OVERRIDES) bad_flag("too many --precision flags%s", "");
            a->overrides[a->build.passes.n_overrides++] = next, i++;
        } else if (!strcmp(s, "--grad-release")) {
            a->build.passes.grad_release = true;
        } else if (!strcmp(s, "--verify")) {
            a->build.passes.verify = true;
        } else if (!strncmp(s, "--print-ir-after=", 17)) {
            a->build.passes.print_after = s + 17;
        } else if (!strcmp(s, "--print-ir-after-all")) {
            a->build.passes.print_after = "all";
        } else if (!strncmp(s, "--stop-after=", 13)) {
            a->build.stop_after = s + 13;
        } else if (!strncmp(s, "--passes=", 9)) {
            a->passes = s + 9;
        } else if (!strncmp(s, "--cpu=", 6)) {
            if (!s[6]) bad_flag("--cpu= needs an LLVM CPU name such as x86-64-v3%s", "");
            emit_set_cpu(s + 6);
        } else if (!strcmp(s, "--print-kernels")) {
            emit_set_print_kernels(true);
            a->print_kernels = true;
        } else if (!strcmp(s, "-o")) {
            if (!next) bad_flag("%s needs a file name", s);
            a->output = next, i++;
        } else if (!strcmp(s, "--json")) {
            a->json = true;
        } else if (!strcmp(s, "--kernels")) {
            a->kernels = true;
        } else if (!strcmp(s, "--device")) {
            if (!next || (strcmp(next, "cuda") && strcmp(next, "cpu")))
                bad_flag("--device needs cuda or cpu, not '%s'", next ? next : "");
            a->device = next, i++;
        } else if (!strcmp(s, "--vs")) {
            if (!next || next[0] != '-' || next[1] != 'O' || next[2] < '0' || next[2] > '3' || next[3])
                bad_flag("--vs needs a level such as -O0, not '%s'", next ? next : "");
            a->vs_level = next[2] - '0', i++;
        } else if (!strcmp(s, "-h") || !strcmp(s, "--help")) {
            usage(stdout);
            exit(0);
        } else if (s[0] == '-') {
            bad_flag("unknown flag '%s'", s);
        } else if (!a->model) {
            a->model = s;
        } else {
            bad_flag("unexpected argument '%s'", s);
        }
    }
    int64_t b = a->build.front.batch, t = a->build.front.seq;   /* each at most 2^30 */
    if (b && t && b * t > IR_MAX_NUMEL) {
        fprintf(stderr, "fp8c: error: --batch %lld x --seq %lld is %lld tokens a step; at most 2^40\n",
                (long long)b, (long long)t, (long long)(b * t));
        exit(2);
    }
    const char *pa = a->build.passes.print_after, *sa = a->build.stop_after;
    if (pa && strcmp(pa, "all") && strcmp(pa, "front") && !pass_find(pa))
        bad_flag("--print-ir-after names no pass: '%s' (fp8c passes lists them)", pa);
    if (sa && strcmp(sa, "front") && !pass_find(sa))
        bad_flag("--stop-after names no pass: '%s' (fp8c passes lists them)", sa);
}

static int cmd_passes(void)
{
    int n;
    const PassInfo *t = pass_table(&n);
    for (int i = 0; i < n; i++) printf("%-10s %s\n", t[i].name, t[i].summary);
    return 0;
}

static char *read_whole_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (size_t k; buf && (k = fread(buf + len, 1, cap - len - 1, f)) > 0;) {
        len += k;
        if (len + 1 == cap) buf = realloc(buf, cap *= 2);
    }
    fclose(f);
    if (buf) buf[len] = 0;
    return buf;
}

/* fp8c opt FILE.ir --passes=a,b: read textual IR, run the passes, print the result. */
static int cmd_opt(Args *a)
{
    if (!a->model) bad_flag("opt needs an IR file%s", "");
    char *text = read_whole_file(a->model);
    if (!text) {
        fprintf(stderr, "fp8c: error: cannot read '%s': %s\n", a->model, strerror(errno));
        return 1;
    }
    /* the text and the pass list live in the arena, so every way out leaves nothing behind */
    Arena *arena = session_arena();
    char *source = arena_strdup(arena, text);
    free(text);
    Graph *g = ir_read(arena, a->model, source);
    if (!g) return 1;
    a->build.passes.verify = true;
    if (ir_verify(g, "reading")) return 1;
    if (a->level_given) g->opt_level = a->build.passes.opt_level;
    if (a->passes && *a->passes) {
        char *list = arena_strdup(arena, a->passes), *save = NULL;
        for (char *name = strtok_r(list, ",", &save); name; name = strtok_r(NULL, ",", &save)) {
            const PassInfo *p = pass_find(name);
            if (!p) bad_flag("--passes names no pass: '%s' (fp8c passes lists them)", name);
            if (!pass_run(g, p, &a->build.passes)) return 1;
        }
    }
    if (!a->build.passes.print_after) ir_print(g, stdout);
    return 0;
}

/* The planned graph, or NULL after the errors and their count. */
static Graph *compile(Arena *arena, Args *a)
{
    if (!a->model) bad_flag("a model file is needed%s", "");
    Graph *g = pipeline_compile(arena, a->model, &a->build);
    if (!g || diag_error_count()) {
        if (diag_error_count())
            fprintf(stderr, "%d error%s.\n", diag_error_count(), diag_error_count() == 1 ? "" : "s");
        return NULL;
    }
    return g;
}

static Graph *compile_or_exit(Arena *arena, Args *a)
{
    Graph *g = compile(arena, a);
    if (!g) exit(1);
    return g;
}

static int cmd_plan(Args *a)
{
    if (a->device && !a->kernels) bad_flag("--device %s goes with --kernels", a->device);
    if (a->kernels && (a->json || a->vs_level >= 0)) bad_flag("--kernels lists one plan's program: no --json or --vs%s", "");
    Arena *arena = session_arena();
    Graph *g = compile_or_exit(arena, a);
    if (a->kernels) return plan_print_kernels(g, a->device ? a->device : "cuda", stdout) ? 0 : 1;
    Graph *other = NULL;
    if (a->vs_level >= 0) {
        Args b = *a;
        b.build.passes.opt_level = a->vs_level;
        b.build.passes.print_after = NULL;
        other = compile_or_exit(arena, &b);
    }
    if (other) plan_print_diff(other, g, a->json, stdout);
    else plan_print(g, a->json, stdout);
    return 0;
}

static void print_wrote(const char *output, const BuildSummary *s)
{
    fprintf(stderr, "fp8c: wrote %s (-O%d, batch %lld, seq %lld): %lld parameters, "
                    "memory plan peak %.1f MiB (state %.1f MiB + step %.1f MiB)\n",
            output, s->opt_level, s->batch, s->seq, s->n_params,
            (double)(s->persistent + s->transient) / 1048576.0, (double)s->persistent / 1048576.0,
            (double)s->transient / 1048576.0);
}

/* A training binary at out: from the cache (cache.c) when everything it depends on is as it
 * was, else the whole pipeline and emit, and the result kept in the cache. False after a
 * message. */
static bool make_binary(Args *a, const char *out, BuildSummary *sum)
{
    double t0 = build_clock();
    char key[65];
    bool cacheable = !a->build.stop_after && !a->build.passes.print_after && !a->print_kernels &&
                     !build_no_cache() && cache_make_key(a->flags, a->n_flags, key);
    CacheResult cached = cacheable ? cache_fetch_binary(key, out, sum) : CACHE_MISS;
    if (cached == CACHE_HIT)
        build_progress("binary cached (%.12s), %.2f s", key, build_clock() - t0);
    if (cached != CACHE_MISS) return cached == CACHE_HIT;
    Arena *arena = session_arena();
    double t1 = build_clock();
    Graph *g = compile(arena, a);
    if (!g) return false;
    build_progress("passes %.2f s (%d nodes)", build_clock() - t1, g->n_nodes);
    if (!emit_training_binary(g, out)) return false;
    MemSummary m;
    memplan_summarize(g, &m);
    *sum = (BuildSummary){.opt_level = g->opt_level, .batch = (long long)g->batch,
                          .seq = (long long)g->seq, .n_params = (long long)m.n_params,
                          .persistent = (long long)m.persistent,
                          .transient = (long long)m.transient};
    snprintf(sum->model_name, sizeof sum->model_name, "%s", g->model_name ? g->model_name : "");
    /* stored only when its inputs did not change while it was being built */
    char again[65];
    if (cacheable && cache_make_key(a->flags, a->n_flags, again) && !strcmp(key, again))
        cache_store_binary(key, out, sum, emit_notes());
    return true;
}

static int cmd_build(Args *a)
{
    if (!a->output) bad_flag("build needs -o NAME%s", "");
    if (a->build.stop_after) {   /* the passes up to one, to print the IR: no binary */
        compile_or_exit(session_arena(), a);
        return 0;
    }
    BuildSummary sum;
    if (!make_binary(a, a->output, &sum)) return 1;
    print_wrote(a->output, &sum);
    return 0;
}

/* fp8c train: the binary (cached as a build's is) in a temp directory, named after the model,
 * run with the flags after `--`, then removed. */
static int cmd_train(Args *a)
{
    if (!a->model) bad_flag("a model file is needed%s", "");
    char *dir = emit_train_dir();
    if (!dir) return 1;
    char *bin = emit_train_path(dir, "train");
    BuildSummary sum;
    if (!bin || !make_binary(a, bin, &sum)) {
        if (bin) unlink(bin);
        rmdir(dir);
        free(bin);
        free(dir);
        return 1;
    }
    char *named = emit_train_path(dir, sum.model_name);
    if (named && strcmp(named, bin) && rename(bin, named) == 0) {
        free(bin);
        bin = named;
    } else {
        free(named);
    }
    return emit_train_run(dir, bin, a->run_args, a->n_run_args);
}

static int dispatch(int argc, char **argv);

int main(int argc, char **argv)
{
    int status = dispatch(argc, argv);
    arena_free(the_arena);
    return status;
}

static int dispatch(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--version")) {
        printf("fp8c %s\n", FP8C_VERSION);
        return 0;
    }
    if (!strcmp(cmd, "passes")) return cmd_passes();
    Args a;
    parse_args(argc - 2, argv + 2, &a);
    if (!strcmp(cmd, "plan")) return cmd_plan(&a);
    if (!strcmp(cmd, "build")) return cmd_build(&a);
    if (!strcmp(cmd, "train")) return cmd_train(&a);
    if (!strcmp(cmd, "opt")) return cmd_opt(&a);
    fprintf(stderr, "fp8c: error: unknown command '%s' (plan, build, train, opt, passes)\n", cmd);
    return 2;
}
