/* test_build.c — `fp8c build` and its cache of whole binaries (compiler/cache.c).
 *
 * What a user relies on: a build says what each stage did; an unchanged rebuild comes from the
 * cache, in two lines, and is the same bytes as a full build; changing any input (a -D value,
 * -O, --seq, the model text, an FP8C_ variable) misses and gives the binary of the new inputs;
 * a damaged entry (truncated, a flipped byte, a bad meta file, a missing binary) is never
 * used: the build runs in full, succeeds, and stores the entry again; `fp8c train` runs the
 * cached binary.
 *
 * Builds run with FP8C_GPU=0 and, except in the first case, FP8C_CPU_KERNELS=0 (no NVRTC, no
 * LLVM), so that a build takes a fraction of a second; each case has its own cache directory
 * under a fresh temp directory. The fp8c executable is $FP8C (set by CTest), else the one in
 * the build directory. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include "test_files.h"

static char fp8c[1024];
static char model[1024];

/* gpt2_tiny cut down: one layer, 64 wide, short sequences */
static const char *const model_flags = "-D layers=1 -D dim=64 --batch 2 --seq 16";
/* the environment of a quick build: no GPU module, no CPU kernels, a private cache */
static char quick_env[600];

static int setup(void **state) {
    (void)state;
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/fp8c-test-build-XXXXXX");
    assert_non_null(mkdtemp(tmp_dir));
    const char *env = getenv("FP8C");
    snprintf(fp8c, sizeof fp8c, "%s", env && *env ? env : FP8C_BINARY_DIR "/fp8c");
    snprintf(model, sizeof model, "%s/models/gpt2_tiny.model", FP8C_SOURCE_DIR);
    snprintf(quick_env, sizeof quick_env, "FP8C_CACHE_DIR=%s/cache FP8C_GPU=0 FP8C_CPU_KERNELS=0",
             tmp_dir);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    remove_tree(tmp_dir);
    return 0;
}

/* A file of tmp_dir, whole; *size its length. NULL when it cannot be read. */
static char *slurp_size(const char *name, size_t *size) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", tmp_dir, name);
    return read_path(path, size);
}

static char *slurp(const char *name) { return read_tmp(name, NULL); }

typedef enum { BUILT, CACHED } How;

/* fp8c build (env, extra flags, model file) -o tmp/OUT; checks that it succeeded and whether
 * it came from the cache: a cached build prints "binary cached" and runs no pass. */
static void build_as(How want, const char *env, const char *model_file, const char *flags,
                     const char *out) {
    int rc = run(out, "%s %s build %s %s %s -o %s/%s", env, fp8c, model_file, model_flags, flags,
                 tmp_dir, out);
    char log[300];
    snprintf(log, sizeof log, "%s.out", out);
    char *text = slurp(log);
    if (rc != 0) fail_msg("fp8c build -o %s failed (%d):\n%s", out, rc, text);
    bool cached = strstr(text, "fp8c: binary cached") != NULL;
    bool built = strstr(text, "fp8c: passes ") != NULL;
    if (want == CACHED && (!cached || built))
        fail_msg("-o %s: want the cached binary, got:\n%s", out, text);
    if (want == BUILT && (cached || !built))
        fail_msg("-o %s: want a full build, got:\n%s", out, text);
    assert_non_null(strstr(text, "fp8c: wrote "));
    free(text);
}

static bool same_bytes(const char *a, const char *b) {
    size_t na, nb;
    char *pa = slurp_size(a, &na), *pb = slurp_size(b, &nb);
    assert_non_null(pa);
    assert_non_null(pb);
    bool same = na == nb && memcmp(pa, pb, na) == 0;
    free(pa);
    free(pb);
    return same;
}

/* The final line of a build's output from its figures on (the part after the output's name). */
static void wrote_line(const char *out, char *line, size_t len) {
    char log[300];
    snprintf(log, sizeof log, "%s.out", out);
    char *text = slurp(log);
    const char *p = strstr(text, "fp8c: wrote ");
    assert_non_null(p);
    p = strchr(p, '(');
    assert_non_null(p);
    snprintf(line, len, "%.*s", (int)strcspn(p, "\n"), p);
    free(text);
}

/* The cache's entry (relative to tmp_dir): its binary and its meta file. */
static void entry_names(char *bin, char *meta, size_t len) {
    char dir[300];
    snprintf(dir, sizeof dir, "%s/cache", tmp_dir);
    DIR *d = opendir(dir);
    assert_non_null(d);
    int found = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, "bin-", 4) || strchr(e->d_name, '.')) continue;
        snprintf(bin, len, "cache/%s", e->d_name);
        snprintf(meta, len, "cache/%s.meta", e->d_name);
        found++;
    }
    closedir(d);
    assert_int_equal(found, 1);
}

static void write_tmp(const char *name, const void *data, size_t size) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", tmp_dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, size, f), size);
    assert_int_equal(fclose(f), 0);
}

/* An unchanged rebuild is a cache hit, with the CPU kernels compiled by LLVM: the same bytes
 * as the build that stored it and as a build that does not use the cache, and the same
 * figures in the final line. */
static void test_hit_is_identical(void **state) {
    (void)state;
    char env[600];
    snprintf(env, sizeof env, "FP8C_CACHE_DIR=%s/cache FP8C_GPU=0", tmp_dir);
    build_as(BUILT, env, model, "-O1", "first");
    build_as(CACHED, env, model, "-O1", "second");
    assert_true(same_bytes("first", "second"));
    char a[300], b[300];
    wrote_line("first", a, sizeof a);
    wrote_line("second", b, sizeof b);
    assert_string_equal(a, b);
    /* a line per stage on a full build; two lines from the cache */
    char *log = slurp("first.out");
    assert_non_null(strstr(log, "fp8c: passes "));
    assert_non_null(strstr(log, "fp8c: CPU kernels: "));
    assert_non_null(strstr(log, " lowered ("));
    assert_non_null(strstr(log, "fp8c: link "));
    free(log);
    log = slurp("second.out");
    int lines = 0;
    for (const char *p = log; *p; p++) lines += *p == '\n';
    assert_int_equal(lines, 2);
    free(log);
    char nocache[700];
    snprintf(nocache, sizeof nocache, "%s FP8C_NO_CACHE=1", env);
    build_as(BUILT, nocache, model, "-O1", "uncached");
    assert_true(same_bytes("first", "uncached"));
    struct stat st;
    char path[512];
    snprintf(path, sizeof path, "%s/second", tmp_dir);
    assert_int_equal(stat(path, &st), 0);
    assert_true(st.st_mode & S_IXUSR);
}

/* Each input on its own: the build misses, makes the new inputs' binary, and a repeat hits. */
static void test_any_change_misses(void **state) {
    (void)state;
    build_as(BUILT, quick_env, model, "-O1", "base");
    build_as(CACHED, quick_env, model, "-O1", "base_again");
    assert_true(same_bytes("base", "base_again"));

    /* -D value, level, batch: a different binary */
    build_as(BUILT, quick_env, model, "-O1 -D heads=2", "heads");
    assert_false(same_bytes("base", "heads"));
    build_as(BUILT, quick_env, model, "-O2", "level");
    assert_false(same_bytes("base", "level"));
    build_as(BUILT, quick_env, model, "-O1 --seq 8", "seq");
    assert_false(same_bytes("base", "seq"));
    build_as(CACHED, quick_env, model, "-O1 -D heads=2", "heads_again");
    assert_true(same_bytes("heads", "heads_again"));

    /* the model text, at the same path: edited in place, then put back */
    FILE *f = fopen(model, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    size_t size = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc(size + 1);
    assert_int_equal(fread(text, 1, size, f), size);
    fclose(f);
    text[size] = 0;
    write_tmp("tiny.model", text, size);
    char copy[512];
    snprintf(copy, sizeof copy, "%s/tiny.model", tmp_dir);
    build_as(BUILT, quick_env, copy, "-O1", "copy");
    build_as(CACHED, quick_env, copy, "-O1", "copy_again");
    char *at = strstr(text, "max_seq = 256");
    assert_non_null(at);
    memcpy(at, "max_seq = 128", 13);
    write_tmp("tiny.model", text, size);
    build_as(BUILT, quick_env, copy, "-O1", "edited");
    assert_false(same_bytes("copy", "edited"));
    memcpy(at, "max_seq = 256", 13);
    write_tmp("tiny.model", text, size);
    build_as(CACHED, quick_env, copy, "-O1", "restored");
    assert_true(same_bytes("copy", "restored"));
    free(text);

    /* a --policy file edited in place: its contents are an input, in either spelling */
    char flags[700];
    for (int joined = 0; joined < 2; joined++) {
        char first[32], edited[32], back[32];
        snprintf(first, sizeof first, "policy%d", joined);
        snprintf(edited, sizeof edited, "policy%d_edited", joined);
        snprintf(back, sizeof back, "policy%d_back", joined);
        snprintf(flags, sizeof flags, "-O1 --policy%s%s/rules.txt", joined ? "=" : " ", tmp_dir);
        write_tmp("rules.txt", "wte.weight=f32\n", 15);
        build_as(BUILT, quick_env, model, flags, first);
        write_tmp("rules.txt", "wte.weight=f16\n", 15);
        build_as(BUILT, quick_env, model, flags, edited);
        assert_false(same_bytes(first, edited));
        write_tmp("rules.txt", "wte.weight=f32\n", 15);
        build_as(CACHED, quick_env, model, flags, back);
        assert_true(same_bytes(first, back));
    }

    /* any FP8C_ variable is an input, even one this build does not read; the cache's own are
     * not */
    char env[800];
    snprintf(env, sizeof env, "%s FP8C_CUDA_GELU_EPILOGUES=0", quick_env);
    build_as(BUILT, env, model, "-O1", "env");
    build_as(CACHED, env, model, "-O1", "env_again");
    snprintf(env, sizeof env, "%s FP8C_NO_CACHE=0", quick_env);
    build_as(CACHED, env, model, "-O1", "nocache0");

    /* FP8C_NO_CACHE=1: built in full, and the same bytes */
    snprintf(env, sizeof env, "%s FP8C_NO_CACHE=1", quick_env);
    build_as(BUILT, env, model, "-O1", "uncached");
    assert_true(same_bytes("base", "uncached"));

    /* flags that print more than a binary run the pipeline */
    int rc = run("stop", "%s %s build %s %s -O1 --stop-after=memplan -o %s/stop", quick_env, fp8c,
                 model, model_flags, tmp_dir);
    assert_int_equal(rc, 0);
    char *out = slurp("stop.out");
    assert_null(strstr(out, "binary cached"));
    free(out);
}

/* A damaged entry is a miss: the build runs in full, makes the right binary, stores the entry
 * again, and the next build hits. */
static void damage_and_rebuild(const char *what,
                               void (*damage)(const char *bin, const char *meta)) {
    char bin[300], meta[300], out[64];
    entry_names(bin, meta, sizeof bin);
    damage(bin, meta);
    snprintf(out, sizeof out, "after_%s", what);
    build_as(BUILT, quick_env, model, "-O1", out);
    if (!same_bytes("good", out)) fail_msg("%s: a different binary after the rebuild", what);
    snprintf(out, sizeof out, "again_%s", what);
    build_as(CACHED, quick_env, model, "-O1", out);
    if (!same_bytes("good", out)) fail_msg("%s: a different binary from the new entry", what);
}

static void truncate_bin(const char *bin, const char *meta) {
    (void)meta;
    size_t size;
    char *p = slurp_size(bin, &size);
    assert_non_null(p);
    write_tmp(bin, p, size / 2);
    free(p);
}

static void flip_byte(const char *bin, const char *meta) {
    (void)meta;
    size_t size;
    char *p = slurp_size(bin, &size);
    assert_non_null(p);
    p[size / 3] ^= 0x20;
    write_tmp(bin, p, size);
    free(p);
}

static void empty_bin(const char *bin, const char *meta) {
    (void)meta;
    write_tmp(bin, "", 0);
}

static void remove_bin(const char *bin, const char *meta) {
    (void)meta;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", tmp_dir, bin);
    assert_int_equal(unlink(path), 0);
}

static void garbage_meta(const char *bin, const char *meta) {
    (void)bin;
    const char junk[] = "\x7f" "ELF\nkey\nsize -1\nsha256 zz\nsummary 1 2\n";
    write_tmp(meta, junk, sizeof junk - 1);
}

static void truncate_meta(const char *bin, const char *meta) {
    (void)bin;
    size_t size;
    char *p = slurp_size(meta, &size);
    assert_non_null(p);
    write_tmp(meta, p, size / 2);
    free(p);
}

static void wrong_size_meta(const char *bin, const char *meta) {
    (void)bin;
    size_t size;
    char *p = slurp_size(meta, &size);
    assert_non_null(p);
    char *s = strstr(p, "\nsize ");
    assert_non_null(s);
    s[6] = s[6] == '9' ? '1' : (char)(s[6] + 1);
    write_tmp(meta, p, size);
    free(p);
}

static void test_damaged_entry(void **state) {
    (void)state;
    build_as(BUILT, quick_env, model, "-O1", "good");
    damage_and_rebuild("truncated", truncate_bin);
    damage_and_rebuild("flipped", flip_byte);
    damage_and_rebuild("empty", empty_bin);
    damage_and_rebuild("missing", remove_bin);
    damage_and_rebuild("garbage_meta", garbage_meta);
    damage_and_rebuild("truncated_meta", truncate_meta);
    damage_and_rebuild("wrong_size", wrong_size_meta);
    /* the rebuilt binary runs */
    int rc = run("help", "%s/again_truncated --help", tmp_dir);
    assert_int_equal(rc, 0);
}

/* fp8c train takes its binary from the same cache, named after the model, and runs it */
static void test_train_uses_cache(void **state) {
    (void)state;
    build_as(BUILT, quick_env, model, "-O1", "built");
    int rc = run("train", "%s %s train %s %s -O1 -- --data %s/data/gcide_sample.txt --steps 1",
                 quick_env, fp8c, model, model_flags, FP8C_SOURCE_DIR);
    char *out = slurp("train.out");
    if (rc != 0) fail_msg("fp8c train failed (%d):\n%s", rc, out);
    assert_non_null(strstr(out, "fp8c: binary cached"));
    assert_null(strstr(out, "fp8c: passes "));
    assert_non_null(strstr(out, "gpt2_tiny: "));   /* the binary's own lines, by its name */
    assert_non_null(strstr(out, "step 1/1"));
    free(out);
}

/* fp8c's command line: `fp8c ARGS` run with quick_env, its status, and stdout + stderr in
 * out (at most len bytes). */
static int fp8c_says(char *out, size_t len, const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s %s %s >%s/says.out 2>&1", quick_env, fp8c, args, tmp_dir);
    int status = system(cmd);
    assert_true(WIFEXITED(status));
    char *text = slurp("says.out");
    snprintf(out, len, "%s", text ? text : "");
    free(text);
    return WEXITSTATUS(status);
}

/* --flag=value is --flag value; an unknown flag, command or recipe names the nearest known
 * one; a recipe is the level and rules that `fp8c plan` shows, and one fp8c cannot run, or a
 * -O that contradicts one, is refused with status 2. */
static void test_command_line(void **state) {
    (void)state;
    char a[1 << 16], b[1 << 16], args[2048];
    snprintf(args, sizeof args, "plan %s -O1 --batch 2 --seq 16 --json", model);
    assert_int_equal(fp8c_says(a, sizeof a, args), 0);
    snprintf(args, sizeof args, "plan %s -O1 --batch=2 --seq=16 --json", model);
    assert_int_equal(fp8c_says(b, sizeof b, args), 0);
    assert_string_equal(a, b);
    static const struct {
        const char *args, *says;
    } bad[] = {
        {"--bacth 2", "unknown flag '--bacth'; did you mean '--batch'?"},
        {"--precison=x=f32", "unknown flag '--precison=x=f32'; did you mean '--precision'?"},
        {"--zzzzzz", "unknown flag '--zzzzzz' (see fp8c --help)"},
        {"--kernals", "did you mean '--kernels'?"},   /* named in the usage as [--kernels] */
        {"--recipe rowwize", "not 'rowwize'; did you mean 'rowwise'?"},
        {"--recipe mxfp8", "--recipe mxfp8 (OCP MXFP8"},
        {"--recipe coat -O1", "--recipe coat is -O2's states with its rules: drop -O1"},
        {"--recipe coat --recipe=delayed", "--recipe is given twice (coat)"},
        {"--batch=", "--batch: '' is not a whole number"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        snprintf(args, sizeof args, "plan %s %s", model, bad[k].args);
        int rc = fp8c_says(a, sizeof a, args);
        if (rc != 2 || !strstr(a, bad[k].says))
            fail_msg("fp8c %s: status %d, said:\n%s\nexpected: %s", args, rc, a, bad[k].says);
    }
    assert_int_equal(fp8c_says(a, sizeof a, "paln"), 2);
    assert_non_null(strstr(a, "did you mean 'plan'?"));
    /* output lost to a full disk is an error, not status 0 */
    int full_rc = run("full", "%s sh -c '%s plan %s --batch 2 --seq 16 --json >/dev/full'", quick_env, fp8c, model);
    char *full = slurp("full.out");
    if (full_rc != 1 || !strstr(full, "fp8c: error: standard output: cannot write: No space left on device"))
        fail_msg("plan >/dev/full: status %d, said:\n%s", full_rc, full);
    free(full);
    /* an IR file that cannot be read is an error, not an empty graph: a directory opens */
    snprintf(args, sizeof args, "opt %s --passes=dce", tmp_dir);
    assert_int_equal(fp8c_says(a, sizeof a, args), 1);
    assert_non_null(strstr(a, "cannot read"));
    assert_non_null(strstr(a, "Is a directory"));
    /* a name left out of --passes is refused before the file is read */
    snprintf(args, sizeof args, "opt %s --passes=dce,", tmp_dir);
    assert_int_equal(fp8c_says(a, sizeof a, args), 2);
    assert_non_null(strstr(a, "fp8c: error: --passes has an empty name in its list: 'dce,'"));
    /* the plan of a recipe: its line, then its rules' formats in the table */
    snprintf(args, sizeof args, "plan %s --batch 2 --seq 16 --recipe=flashoptim", model);
    assert_int_equal(fp8c_says(a, sizeof a, args), 0);
    assert_non_null(strstr(a, "recipe flashoptim (-O3): FlashOptim"));
    assert_non_null(strstr(a, "at -O3,"));
    assert_non_null(strstr(a, "i8 1x32 compand"));
    assert_int_equal(fp8c_says(a, sizeof a, "recipes"), 0);
    assert_non_null(strstr(a, "--precision 'gemm:*=e4m3:block128'"));
}

/* -o naming an input of the build (the model, or a file a flag names) is refused before
 * anything is built: the binary, renamed over its output, would replace the model text or the
 * rules it was made from. One line, status 2, the file as it was. An -o that cannot be written
 * (a directory, or in a missing one) is one line before the build too, status 1. */
static void test_output_is_not_an_input(void **state) {
    (void)state;
    size_t size = 0;
    char *text = read_path(model, &size);
    assert_non_null(text);
    write_tmp("in.model", text, size);
    write_tmp("rules.txt", "wte.weight=f32\n", 15);
    static const char *const cases[][2] = {
        {"-o %s/in.model", "in.model"},
        {"-o %s/./in.model", "in.model"},
        {"--policy %s/rules.txt -o %s/rules.txt", "rules.txt"},
        {"--policy=%s/rules.txt -o%s/rules.txt", "rules.txt"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char flags[600];
        snprintf(flags, sizeof flags, cases[k][0], tmp_dir, tmp_dir);
        int rc = run("same", "%s %s build %s/in.model %s %s", quick_env, fp8c, tmp_dir, model_flags,
                     flags);
        char *out = slurp("same.out");
        if (rc != 2 || !strstr(out, "names an input of the build") || !strstr(out, cases[k][1]) ||
            strchr(out, '\n') != out + strlen(out) - 1)
            fail_msg("build %s: want one line and status 2, got %d:\n%s", flags, rc, out);
        free(out);
        size_t now = 0;
        char *kept = slurp_size("in.model", &now);
        assert_true(now == size && !memcmp(kept, text, size));
        free(kept);
        kept = slurp("rules.txt");
        assert_string_equal(kept, "wte.weight=f32\n");
        free(kept);
    }
    free(text);
    /* an -o that is a directory, or in one that does not exist, is refused before the build */
    static const char *const outs[][2] = {{"", "is a directory"}, {"/no/such/dir/bin", "cannot write in"}};
    for (int k = 0; k < 2; k++) {
        int rc = run("badout", "%s %s build %s %s -o %s%s", quick_env, fp8c, model, model_flags, tmp_dir,
                     outs[k][0]);
        char *out = slurp("badout.out");
        if (rc != 1 || !strstr(out, outs[k][1]) || strstr(out, "fp8c: passes") || strchr(out, '\n') != out + strlen(out) - 1)
            fail_msg("-o %s%s: want one line before the build, got %d:\n%s", tmp_dir, outs[k][0], rc, out);
        free(out);
    }
}

/* A CPU LLVM cannot make x86-64 code for (an unknown name, a 32-bit one) is an error of
 * fp8c's naming it, status 1, no binary and no temp directory left, not LLVM's abort and a
 * core dump. */
static void test_unknown_cpu(void **state) {
    (void)state;
    char env[1400], temp[600];
    snprintf(temp, sizeof temp, "%s/temp", tmp_dir);
    assert_int_equal(mkdir(temp, 0700), 0);
    snprintf(env, sizeof env, "FP8C_CACHE_DIR=%s/cache FP8C_GPU=0 TMPDIR=%s", tmp_dir, temp);
    const char *cpus[] = {"no-such-cpu", "i686"};
    for (int k = 0; k < 2; k++) {
        int rc = run("cpu", "%s %s build %s %s --cpu %s -o %s/cpu", env, fp8c, model, model_flags, cpus[k],
                     tmp_dir);
        char *out = slurp("cpu.out"), want[160];
        snprintf(want, sizeof want, "fp8c: error: LLVM cannot compile the CPU kernels for CPU '%s'", cpus[k]);
        if (rc != 1 || !strstr(out, want)) fail_msg("--cpu %s: want status 1 and '%s', got %d:\n%s", cpus[k], want, rc, out);
        free(out);
        char path[600];
        snprintf(path, sizeof path, "%s/cpu", tmp_dir);
        assert_int_not_equal(access(path, F_OK), 0);
        assert_int_equal(rmdir(temp), 0);   /* empty */
        assert_int_equal(mkdir(temp, 0700), 0);
    }
}

/* Each flag reads the same as `--flag value` and `--flag=value` (and -D with its value
 * attached or not); a flag given twice keeps the last value; a missing value, a number that is
 * not one, an abbreviation, a value given to a switch and a choice that is unknown or outside
 * its values (ir_choice_check) are each one line and status 2; and
 * after `--` the words go to the training binary unread. */
static void test_flag_spellings(void **state) {
    (void)state;
    char a[1 << 16], b[1 << 16], args[2048];
    static const struct {
        const char *spaced, *joined;
    } same[] = {
        {"-O1 --batch 2 --seq 16 -D layers=1 --json --vs -O0",
         "-O1 --batch=2 --seq=16 -Dlayers=1 --json --vs=-O0"},
        {"--batch 2 --seq 16 -D layers=1 --precision '*=f32' --gpus 2 --choice loss.chunks=2",
         "--batch=2 --seq=16 -D layers=1 --precision='*=f32' --gpus=2 --choice=loss.chunks=2"},
        {"--batch 2 --seq 16 -D layers=1 --recipe coat --print-ir-after dce",
         "--batch=2 --seq=16 -D layers=1 --recipe=coat --print-ir-after=dce"},
        {"--batch 2 --seq 16 -D layers=1 --kernels --device cpu",
         "--batch=2 --seq=16 -D layers=1 --kernels --device=cpu"},
        /* the last value of a flag given twice */
        {"--batch 4 --seq 8 -D layers=1 --batch 2 --seq=16 -O3 -O1",
         "--batch=2 --seq=16 -D layers=1 -O1"},
    };
    for (size_t k = 0; k < sizeof same / sizeof same[0]; k++) {
        snprintf(args, sizeof args, "plan %s %s", model, same[k].spaced);
        int rc = fp8c_says(a, sizeof a, args);
        if (rc != 0) fail_msg("fp8c %s: status %d, said:\n%s", args, rc, a);
        snprintf(args, sizeof args, "plan %s %s", model, same[k].joined);
        assert_int_equal(fp8c_says(b, sizeof b, args), 0);
        if (strcmp(a, b)) fail_msg("fp8c plan %s\nand %s differ:\n%s\n---\n%s", same[k].spaced,
                                   same[k].joined, a, b);
    }
    static const struct {
        const char *args, *says;
    } bad[] = {
        {"--bat 2", "fp8c: error: unknown flag '--bat'; did you mean '--batch'? (see fp8c --help)\n"},
        {"--grad-rel", "unknown flag '--grad-rel'; did you mean '--grad-release'?"},
        {"--json=1", "fp8c: error: --json takes no value: --json=1 (see fp8c --help)\n"},
        {"--seq", "fp8c: error: --seq needs a value (see fp8c --help)\n"},
        {"--batch 2 --passes", "--passes needs a value"},
        {"-D", "-D needs a value"},
        {"--batch 2x", "fp8c: error: --batch: '2x' is not a whole number\n"},
        {"--batch ' 2'", "--batch: ' 2' is not a whole number"},
        {"--batch +2", "--batch: '+2' is not a whole number"},
        {"--seq 1e3", "--seq: '1e3' is not a whole number"},
        {"--batch 0", "--batch needs a positive integer, not '0'"},
        {"--gpus 2000", "--gpus needs a count from 1 to 1024, not '2000'"},
        {"--budget 1O", "--budget: '1O' is not a number"},
        {"-O4", "unknown flag '-O4'"},
        {"-O 2", "unknown flag '-O'"},
        {"extra", "unexpected argument 'extra'"},
        /* a choice the compiler does not read, or a value it would read as its default */
        {"--choice loss_chunks=2", "--choice: unknown choice 'loss_chunks' (docs/tuning.md lists them)"},
        {"--choice fuse.typo@3=0", "unknown choice 'fuse.typo'"},
        {"--choice attn.dq_rows=96", "--choice: attn.dq_rows takes one of: 64 128, not '96'"},
        {"--choice attn.wgmma=2", "attn.wgmma takes one of: 0 1, not '2'"},
        {"--choice save.attention_y@5=1", "save.attention_y is one choice for the whole program: it takes no @ID"},
        {"--choice fuse.members@5=1", "fuse.members is one choice for the whole program: it takes no @ID"},
        {"--choice fuse.members=65", "fuse.members takes a whole number from 0 to 64, not '65'"},
        {"--choice ce.threads=100", "ce.threads takes a multiple of 32 from 64 to 1024, not '100'"},
        {"--choice loss.chunks=0", "loss.chunks takes a whole number from 1 to 256, not '0'"},
        {"--choice cpu.tiles=avx", "cpu.tiles takes one of: amx bf16dot off, not 'avx'"},
        {"--choice fuse.ce_lse@x=0", "'fuse.ce_lse@x': a site is NAME@ID with a node number"},
        {"--choice gemm.00ff=12", "gemm.00ff takes 128 hex digits, not '12'"},
        {"--choice loss.chunks@4=2", "loss.chunks is one choice for the whole program: it takes no @ID"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        snprintf(args, sizeof args, "plan %s %s", model, bad[k].args);
        int rc = fp8c_says(a, sizeof a, args);
        if (rc != 2 || !strstr(a, bad[k].says))
            fail_msg("fp8c %s: status %d, said:\n%s\nexpected: %s", args, rc, a, bad[k].says);
        if (strchr(a, '\n') != a + strlen(a) - 1) fail_msg("fp8c %s: more than one line:\n%s", args, a);
    }
    /* after --, even what looks like fp8c's own flags is the training binary's */
    snprintf(args, sizeof args, "train %s %s -- --stpes 3 --bacth 2", model, model_flags);
    int rc = fp8c_says(a, sizeof a, args);
    if (rc != 2 || !strstr(a, "gpt2_tiny: error: --stpes: unknown flag; did you mean --steps?") ||
        strstr(a, "fp8c: error"))
        fail_msg("fp8c %s: status %d, said:\n%s", args, rc, a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hit_is_identical, setup, teardown),
        cmocka_unit_test_setup_teardown(test_any_change_misses, setup, teardown),
        cmocka_unit_test_setup_teardown(test_damaged_entry, setup, teardown),
        cmocka_unit_test_setup_teardown(test_train_uses_cache, setup, teardown),
        cmocka_unit_test_setup_teardown(test_command_line, setup, teardown),
        cmocka_unit_test_setup_teardown(test_flag_spellings, setup, teardown),
        cmocka_unit_test_setup_teardown(test_output_is_not_an_input, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unknown_cpu, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
