/* test_tune.c — `fp8c tune` on the CPU, and its record reused by build and plan.
 *
 * What a user relies on: `fp8c tune` measures the model's choice points on the device and
 * writes a record with every field docs/tuning.md names, and never over an existing file;
 * `fp8c build --tune` builds with the record's winners, which the binary carries in its
 * artifact; the binary then computes the same losses, bit for bit, on every run, and the same
 * as a binary built with the same choices forced by hand (--choice); a record made for another
 * model, fp8c version or device is refused with one line naming which (or, asked to, the
 * defaults are built); a malformed record is one line and a failed build; `fp8c plan --tune`
 * shows the winners beside the defaults; `fp8c tune --list-candidates` names the binaries tune
 * builds, for a machine that compiles ahead what another will measure. On a GPU the binary's
 * GEMM tuning mode checks only the candidates the winning rule could pick (rt_tune_could_win):
 * on reports made here, with no GPU, those checks pick the same winner as checking every
 * candidate, and the unchecked ones reach the record as not ok, with a note and no error.
 *
 * The model is gpt2_tiny cut down to one narrow layer, built without GPU kernels; the record is
 * made once (setup) with a short budget and four steps a run. Records with chosen winners are
 * written from the measured one, so that the reuse tests do not depend on which candidate
 * happened to win on this machine. */
#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include "compiler.h"
#include "rt.h"
#include "test_files.h"

static char fp8c[1024];
static char model[1024];
static const char *const model_flags = "-O1 -D layers=1 -D dim=64 --batch 2 --seq 32";
static char env[600];

static char *slurp(const char *name) { return read_tmp(name, NULL); }
static char *slurp_path(const char *path) { return read_path(path, NULL); }

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

static int setup(void **state) {
    (void)state;
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/fp8c-test-tune-XXXXXX");
    assert_non_null(mkdtemp(tmp_dir));
    const char *e = getenv("FP8C");
    snprintf(fp8c, sizeof fp8c, "%s", e && *e ? e : FP8C_BINARY_DIR "/fp8c");
    snprintf(model, sizeof model, "%s/models/gpt2_tiny.model", FP8C_SOURCE_DIR);
    snprintf(env, sizeof env, "FP8C_CACHE_DIR=%s/cache FP8C_GPU=0", tmp_dir);
    int rc = run("tune", "%s %s tune %s %s --device cpu --budget 120 --tune-steps 4 -o %s/record.json", env,
                 fp8c, model, model_flags, tmp_dir);
    char *out = slurp("tune.out");
    if (rc != 0) fail_msg("fp8c tune failed (%d):\n%s", rc, out);
    /* progress: a line per candidate, with how many are left and the time so far */
    assert_non_null(strstr(out, "fp8c: tune: cpu.threads="));
    assert_non_null(strstr(out, " left, "));
    assert_non_null(strstr(out, "fp8c: wrote "));
    free(out);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    remove_tree(tmp_dir);
    return 0;
}

static const Jv *get(const Jv *o, const char *key, JvKind kind) {
    const Jv *v = rt_json_get(o, key);
    if (!v || v->kind != kind) fail_msg("record: \"%s\" missing or of the wrong kind", key);
    return v;
}

static bool is_hex(const char *s, size_t n) {
    if (strlen(s) != n) return false;
    for (; *s; s++)
        if (!strchr("0123456789abcdef", *s)) return false;
    return true;
}

static const Jv *find_choice(const Jv *choices, const char *name) {
    for (int i = 0; i < choices->n; i++) {
        const Jv *n = rt_json_get(&choices->items[i], "name");
        if (n && n->kind == JV_STR && !strcmp(n->str, name)) return &choices->items[i];
    }
    return NULL;
}

/* The record names the device, fp8c, the model and flags, and per choice point its candidates,
 * their times and a winner among them. */
static void test_record_fields(void **state) {
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/record.json", tmp_dir);
    Jv r;
    assert_true(rt_json_read(path, &r));
    assert_true(get(&r, "fp8c_tuning_record", JV_NUM)->num == 1);
    assert_int_equal(run("version", "%s --version", fp8c), 0);
    char *version = slurp("version.out");
    version[strcspn(version, "\n")] = 0;
    assert_string_equal(version + 5, get(&r, "fp8c_version", JV_STR)->str);
    free(version);
    const Jv *dev = get(&r, "device", JV_OBJ), *m = get(&r, "model", JV_OBJ);
    assert_string_equal(get(dev, "kind", JV_STR)->str, "cpu");
    assert_true(is_hex(get(dev, "id", JV_STR)->str, 16));
    assert_non_null(strstr(get(dev, "description", JV_STR)->str, "threads"));
    assert_true(is_hex(get(m, "hash", JV_STR)->str, 64));
    assert_string_equal(get(m, "flags", JV_STR)->str, model_flags);
    assert_true(get(get(&r, "method", JV_OBJ), "steps", JV_NUM)->num == 4);
    assert_true(get(&r, "default_step_ms", JV_NUM)->num > 0);
    assert_true(get(&r, "tuned_step_ms", JV_NUM)->num > 0);
    const Jv *choices = get(&r, "choices", JV_ARR);
    const char *want[] = {"cpu.threads", "cpu.task_work", "loss.chunks"};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        if (!find_choice(choices, want[i])) fail_msg("record: no choice point %s", want[i]);
    for (int i = 0; i < choices->n; i++) {
        const Jv *c = &choices->items[i], *cands = get(c, "candidates", JV_ARR);
        const char *dflt = get(c, "default", JV_STR)->str, *winner = get(c, "winner", JV_STR)->str;
        get(c, "what", JV_STR);
        bool measured = get(c, "measured", JV_BOOL)->num != 0;
        bool have_default = false, have_winner = false;
        assert_true(cands->n >= 2);
        for (int k = 0; k < cands->n; k++) {
            const Jv *cv = &cands->items[k];
            const char *value = get(cv, "value", JV_STR)->str;
            have_default |= !strcmp(value, dflt);
            have_winner |= !strcmp(value, winner);
            const Jv *med = rt_json_get(cv, "median");
            if (med && med->kind == JV_NUM) {
                double lo = get(cv, "min", JV_NUM)->num, hi = get(cv, "max", JV_NUM)->num;
                assert_true(lo > 0 && lo <= med->num && med->num <= hi);
                get(cv, "max_rel_diff", JV_NUM);
            }
            get(cv, "ok", JV_BOOL);
        }
        assert_true(have_default);
        assert_true(have_winner);
        if (!measured) assert_string_equal(dflt, winner);
    }
    rt_json_free(&r);
}

/* tune writes a new record and nothing else: an existing file stays as it was */
static void test_tune_never_overwrites(void **state) {
    (void)state;
    char *before = slurp("record.json");
    int rc = run("again", "%s %s tune %s %s --device cpu --budget 5 -o %s/record.json", env, fp8c, model,
                 model_flags, tmp_dir);
    assert_int_not_equal(rc, 0);
    char *out = slurp("again.out"), *after = slurp("record.json");
    assert_non_null(strstr(out, "already exists"));
    assert_string_equal(before, after);
    free(before), free(out), free(after);
}

/* A record like the measured one, with winners chosen here and keys optionally changed. */
typedef struct {
    const char *name, *dflt, *winner;
} Pick;

static void write_record_of(const char *kind, const char *name, const char *hash, const char *version,
                            const char *device_id, const Pick *picks, int n_picks) {
    char path[512];
    snprintf(path, sizeof path, "%s/record.json", tmp_dir);
    Jv r;
    assert_true(rt_json_read(path, &r));
    const Jv *dev = get(&r, "device", JV_OBJ), *m = get(&r, "model", JV_OBJ);
    snprintf(path, sizeof path, "%s/%s", tmp_dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "{\"fp8c_tuning_record\": 1, \"fp8c_version\": \"%s\",\n",
            version ? version : get(&r, "fp8c_version", JV_STR)->str);
    fprintf(f, " \"device\": {\"kind\": \"%s\", \"id\": \"%s\", \"description\": \"%s\"},\n", kind,
            device_id ? device_id : get(dev, "id", JV_STR)->str, get(dev, "description", JV_STR)->str);
    fprintf(f, " \"model\": {\"file\": \"%s\", \"flags\": \"%s\", \"hash\": \"%s\"},\n", get(m, "file", JV_STR)->str,
            get(m, "flags", JV_STR)->str, hash ? hash : get(m, "hash", JV_STR)->str);
    fputs(" \"default_step_ms\": 2.0, \"tuned_step_ms\": 1.0, \"choices\": [", f);
    for (int i = 0; i < n_picks; i++)
        fprintf(f, "%s\n  {\"name\": \"%s\", \"what\": \"\", \"default\": \"%s\", \"winner\": \"%s\", "
                   "\"measured\": true, \"candidates\": [{\"value\": \"%s\", \"median\": 2.0, \"min\": 1.9, "
                   "\"max\": 2.1, \"ok\": true}, {\"value\": \"%s\", \"median\": 1.0, \"min\": 0.9, \"max\": 1.1, "
                   "\"ok\": true}]}",
                i ? "," : "", picks[i].name, picks[i].dflt, picks[i].winner, picks[i].dflt, picks[i].winner);
    fputs("]}\n", f);
    fclose(f);
    rt_json_free(&r);
}

static void write_record(const char *name, const char *hash, const char *version, const char *device_id,
                         const Pick *picks, int n_picks) {
    write_record_of("cpu", name, hash, version, device_id, picks, n_picks);
}

/* The losses a binary logs over a few steps, as the text of the log's "loss" fields. */
static char *losses_of(const char *bin, const char *tag) {
    char log[600];
    snprintf(log, sizeof log, "%s/%s.jsonl", tmp_dir, tag);
    int rc = run(tag, "%s/%s --data %s/README.md --steps 4 --log %s --eval-every 0 --eval-batches 1 --device cpu "
                      "--seed 3", tmp_dir, bin, FP8C_SOURCE_DIR, log);
    if (rc != 0) {
        char out[300];
        snprintf(out, sizeof out, "%s.out", tag);
        fail_msg("%s did not run:\n%s", bin, slurp(out));
    }
    char *text = slurp_path(log);
    assert_non_null(text);
    char *losses = calloc(strlen(text) + 1, 1);
    for (const char *p = text; (p = strstr(p, "\"loss\":")); p += 7) {
        size_t n = strcspn(p + 7, ",}");
        strncat(losses, p + 7, n);
        strcat(losses, " ");
    }
    unlink(log);
    free(text);
    assert_true(strlen(losses) > 8);
    return losses;
}

static void build_ok(const char *tag, const char *flags) {
    int rc = run(tag, "%s %s build %s %s %s -o %s/%s", env, fp8c, model, model_flags, flags, tmp_dir, tag);
    char out[300];
    snprintf(out, sizeof out, "%s.out", tag);
    if (rc != 0) fail_msg("fp8c build %s failed (%d):\n%s", flags, rc, slurp(out));
}

/* A record's winners reach the binary (its artifact's choice lines); it computes the same
 * losses on every run, the same as a binary with those choices forced by hand, and not the
 * defaults' (the loss in two chunks sums in another order). The measured record builds too. */
static void test_reuse_is_bit_identical(void **state) {
    (void)state;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    char threads[16];
    snprintf(threads, sizeof threads, "%ld", cpus);
    Pick picks[] = {{"loss.chunks", "1", "2"}, {"cpu.task_work", "16384", "4096"}, {"cpu.threads", threads, "1"}};
    write_record("forced.json", NULL, NULL, NULL, picks, 3);
    char flags[600];
    snprintf(flags, sizeof flags, "--tune %s/forced.json --print-ir-after=fuse", tmp_dir);
    build_ok("tuned_ir", flags);
    char *ir = slurp("tuned_ir.out");
    assert_non_null(strstr(ir, "\nchoice loss.chunks 2\n"));
    assert_non_null(strstr(ir, "\nchoice cpu.task_work 4096\n"));
    assert_non_null(strstr(ir, "\nchoice cpu.threads 1\n"));
    free(ir);

    snprintf(flags, sizeof flags, "--tune %s/forced.json", tmp_dir);
    build_ok("tuned", flags);
    build_ok("by_hand", "--choice loss.chunks=2 --choice cpu.task_work=4096 --choice cpu.threads=1");
    build_ok("plain", "");
    char *a = losses_of("tuned", "run_a"), *b = losses_of("tuned", "run_b");
    char *h = losses_of("by_hand", "run_h"), *d = losses_of("plain", "run_d");
    printf("  tuned: %s\n  by hand: %s\n  defaults: %s\n", a, h, d);
    assert_string_equal(a, b);
    assert_string_equal(a, h);
    assert_string_not_equal(a, d);
    free(a), free(b), free(h), free(d);

    snprintf(flags, sizeof flags, "--tune %s/record.json", tmp_dir);
    build_ok("measured", flags);
    char *m1 = losses_of("measured", "run_m1"), *m2 = losses_of("measured", "run_m2");
    assert_string_equal(m1, m2);
    free(m1), free(m2);
}

/* Another model, fp8c or device: one line naming which, exit 1; --tune-mismatch=defaults
 * builds on the defaults after a note. */
static void test_mismatch_refused(void **state) {
    (void)state;
    Pick picks[] = {{"loss.chunks", "1", "2"}};
    write_record("model.json", "0000000000000000000000000000000000000000000000000000000000000000", NULL, NULL,
                 picks, 1);
    write_record("version.json", NULL, "0.0.0-other", NULL, picks, 1);
    write_record("device.json", NULL, NULL, "00000000deadbeef", picks, 1);
    const char *files[] = {"model.json", "version.json", "device.json"};
    const char *which[] = {"another model", "another fp8c version", "another device"};
    for (int i = 0; i < 3; i++) {
        char tag[64];
        snprintf(tag, sizeof tag, "refused%d", i);
        int rc = run(tag, "%s %s build %s %s --tune %s/%s -o %s/%s", env, fp8c, model, model_flags, tmp_dir,
                     files[i], tmp_dir, tag);
        char out[300];
        snprintf(out, sizeof out, "%s.out", tag);
        char *text = slurp(out);
        if (rc != 1 || !strstr(text, which[i]) || count_lines(text) != 1)
            fail_msg("%s: want one line naming %s and status 1, got %d:\n%s", files[i], which[i], rc, text);
        free(text);
        char path[600];
        snprintf(path, sizeof path, "%s/%s", tmp_dir, tag);
        assert_int_not_equal(access(path, F_OK), 0);   /* no binary */

        snprintf(tag, sizeof tag, "defaults%d", i);
        rc = run(tag, "%s %s build %s %s --tune %s/%s --tune-mismatch=defaults --print-ir-after=fuse -o %s/%s",
                 env, fp8c, model, model_flags, tmp_dir, files[i], tmp_dir, tag);
        snprintf(out, sizeof out, "%s.out", tag);
        text = slurp(out);
        assert_int_equal(rc, 0);
        assert_non_null(strstr(text, "building on the defaults"));
        assert_null(strstr(text, "\nchoice "));
        free(text);
    }
}

/* An -o in a directory that does not exist is refused before anything is measured, not after
 * the whole budget is spent. */
static void test_unwritable_output(void **state) {
    (void)state;
    int rc = run("nodir", "%s %s tune %s %s --device cpu --budget 0.001 --tune-steps 4 -o %s/no/such/dir/r.json",
                 env, fp8c, model, model_flags, tmp_dir);
    char *out = slurp("nodir.out");
    if (rc != 1 || !strstr(out, "cannot write the record in") || strstr(out, "fp8c: tune:") ||
        count_lines(out) != 1)
        fail_msg("tune -o in a missing directory: want one line before measuring, got %d:\n%s", rc, out);
    free(out);
}

/* A record made with a --policy file, which is then edited: the graph is another, so the
 * record is refused as another model's, in either spelling of the flag; the file put back, it
 * fits again. */
static void test_edited_policy_refused(void **state) {
    (void)state;
    char rules[512];
    snprintf(rules, sizeof rules, "%s/rules.txt", tmp_dir);
    for (int joined = 0; joined < 2; joined++) {
        FILE *f = fopen(rules, "w");
        assert_non_null(f);
        fputs("wte.weight=f32\n", f);
        assert_int_equal(fclose(f), 0);
        char policy[600], tag[64], out[300];
        snprintf(policy, sizeof policy, "--policy%s%s", joined ? "=" : " ", rules);
        snprintf(tag, sizeof tag, "policy_tune%d", joined);
        int rc = run(tag, "%s %s tune %s %s %s --device cpu --budget 0.001 --tune-steps 4 -o %s/%s.json", env,
                     fp8c, model, model_flags, policy, tmp_dir, tag);
        snprintf(out, sizeof out, "%s.out", tag);
        char *text = slurp(out);
        if (rc != 0) fail_msg("fp8c tune %s failed (%d):\n%s", policy, rc, text);
        free(text);
        f = fopen(rules, "w");
        assert_non_null(f);
        fputs("wte.weight=f16\n", f);
        assert_int_equal(fclose(f), 0);
        char use[64];
        snprintf(use, sizeof use, "policy_plan%d", joined);
        rc = run(use, "%s %s plan %s %s %s --tune %s/%s.json", env, fp8c, model, model_flags, policy, tmp_dir,
                 tag);
        snprintf(out, sizeof out, "%s.out", use);
        text = slurp(out);
        if (rc != 1 || !strstr(text, "another model") || count_lines(text) != 1)
            fail_msg("%s, edited: want one line naming another model and status 1, got %d:\n%s", policy, rc,
                     text);
        free(text);
        f = fopen(rules, "w");
        assert_non_null(f);
        fputs("wte.weight=f32\n", f);
        assert_int_equal(fclose(f), 0);
        rc = run(use, "%s %s plan %s %s %s --tune %s/%s.json", env, fp8c, model, model_flags, policy, tmp_dir,
                 tag);
        text = slurp(out);
        if (rc != 0) fail_msg("%s, put back: the record should fit, got %d:\n%s", policy, rc, text);
        free(text);
    }
}

/* A GPU's record where fp8c sees no GPU: a note that the binary checks the device when it
 * starts, and the winners (a GEMM problem's algorithm, a fusion off) and the record's device
 * fingerprint in the artifact. */
static void test_gpu_record_without_gpu(void **state) {
    (void)state;
    char a[129], b[129];
    memset(a, 'a', 128), memset(b, 'b', 128);
    a[128] = b[128] = 0;
    Pick picks[] = {{"gemm.00000000deadbeef", a, b}, {"fuse.ce_lse", "1", "0"}};
    write_record_of("cuda", "gpu.json", NULL, NULL, "0123456789abcdef", picks, 2);
    int rc = run("gpu_ir", "%s %s build %s %s --tune %s/gpu.json --print-ir-after=fuse -o %s/gpu_ir", env, fp8c, model,
                 model_flags, tmp_dir, tmp_dir);
    char *out = slurp("gpu_ir.out"), want[256];
    if (rc == 1 && strstr(out, "the record is for another device")) {   /* a GPU here: not the record's */
        printf("  a GPU is present: the record of a made-up GPU is refused\n");
        free(out);
        return;
    }
    if (rc != 0) fail_msg("build with a GPU record failed (%d):\n%s", rc, out);
    assert_non_null(strstr(out, "no GPU here to check the record's device against"));
    snprintf(want, sizeof want, "\nchoice gemm.00000000deadbeef %s\n", b);
    assert_non_null(strstr(out, want));
    assert_non_null(strstr(out, "\nchoice fuse.ce_lse 0\n"));
    assert_non_null(strstr(out, "\nchoice tune.device 0123456789abcdef\n"));
    free(out);
}

/* Not JSON, not a record, a choice the table cannot hold: one line, a failed build. */
static void test_malformed_refused(void **state) {
    (void)state;
    char *good = slurp("record.json");
    char path[512];
    snprintf(path, sizeof path, "%s/truncated.json", tmp_dir);
    FILE *f = fopen(path, "w");
    fwrite(good, 1, strlen(good) / 2, f);
    fclose(f);
    snprintf(path, sizeof path, "%s/other.json", tmp_dir);
    f = fopen(path, "w");
    fputs("{\"vocab_size\": 50257}\n", f);
    fclose(f);
    Pick bad[] = {{"loss.chunks", "1", "two chunks"}};
    write_record("badvalue.json", NULL, NULL, NULL, bad, 1);
    free(good);
    const char *files[] = {"truncated.json", "other.json", "badvalue.json", "missing.json"};
    const char *says[] = {"bad JSON", "not a usable tuning record", "cannot have", "missing.json"};
    for (int i = 0; i < 4; i++) {
        char tag[64];
        snprintf(tag, sizeof tag, "malformed%d", i);
        int rc = run(tag, "%s %s build %s %s --tune %s/%s --tune-mismatch=defaults -o %s/%s", env, fp8c, model,
                     model_flags, tmp_dir, files[i], tmp_dir, tag);
        char out[300];
        snprintf(out, sizeof out, "%s.out", tag);
        char *text = slurp(out);
        if (rc == 0 || !strstr(text, says[i]) || count_lines(text) != 1)
            fail_msg("%s: want one line with '%s' and a failure, got %d:\n%s", files[i], says[i], rc, text);
        free(text);
    }
}

/* --memory-budget: a budget nothing reaches is one line naming the smallest peak reached, and
 * no record. (The budget of seconds is spent at once: the points keep their defaults.) */
static void test_memory_budget_unreachable(void **state) {
    (void)state;
    int rc = run("tight", "%s %s tune %s %s --device cpu --budget 0.001 --tune-steps 4 --memory-budget 0.0001 "
                          "-o %s/tight.json", env, fp8c, model, model_flags, tmp_dir);
    char *out = slurp("tight.out");
    if (rc == 0 || !strstr(out, "fp8c: error: nothing tried fits the memory budget of 0.1 MiB: the smallest memory "
                                "plan peak reached is "))
        fail_msg("want the smallest peak reached, got %d:\n%s", rc, out);
    char path[600];
    snprintf(path, sizeof path, "%s/tight.json", tmp_dir);
    assert_int_not_equal(access(path, F_OK), 0);
    free(out);
}

/* plan --tune: the choice points, defaults beside winners, with their times */
static void test_plan_shows_the_record(void **state) {
    (void)state;
    Pick picks[] = {{"loss.chunks", "1", "2"}};
    write_record("plan.json", NULL, NULL, NULL, picks, 1);
    int rc = run("plan", "%s %s plan %s %s --tune %s/plan.json", env, fp8c, model, model_flags, tmp_dir);
    char *text = slurp("plan.out");
    if (rc != 0) fail_msg("plan --tune failed:\n%s", text);
    assert_non_null(strstr(text, "tuning record:"));
    const char *row = strstr(text, "\nloss.chunks ");
    assert_non_null(row);
    char name[32], dflt[32], winner[32], unit1[8], unit2[8], saved[16];
    double t1, t2;
    assert_int_equal(sscanf(row, " %31s %31s %lf %7s %31s %lf %7s %15s", name, dflt, &t1, unit1, winner, &t2, unit2,
                            saved),
                     8);
    assert_string_equal(dflt, "1");
    assert_string_equal(winner, "2");
    assert_true(t1 == 2.0 && t2 == 1.0);
    assert_string_equal(saved, "50.0%");
    free(text);
}

/* --list-candidates: the binaries tune builds besides the defaults, one --choice a line. On the
 * CPU they are the loss's chunk counts and the other values of save.cheap, save.attention_inputs,
 * layout.cast_transpose and fuse.members that the record holds (setup's tune built exactly those); on a GPU the
 * fusions, the attention's and the loss's kernels join, each a choice build accepts.
 * With -o it is refused: it measures and writes nothing. */
static void test_list_candidates(void **state) {
    (void)state;
    int rc = run("list_cpu", "%s %s tune %s %s --device cpu --list-candidates", env, fp8c, model, model_flags);
    char *text = slurp("list_cpu.out");
    if (rc != 0) fail_msg("tune --list-candidates failed (%d):\n%s", rc, text);
    char path[512];
    snprintf(path, sizeof path, "%s/record.json", tmp_dir);
    Jv r;
    assert_true(rt_json_read(path, &r));
    /* the CPU's build-time points: the loss's chunks, the recompute-or-save choices, the
     * gradients' transposed copies and the fusion granularity */
    const char *points[] = {"loss.chunks", "save.cheap", "save.attention_inputs", "layout.cast_transpose",
                            "fuse.members"};
    int want = 0;
    for (int p = 0; p < 5; p++) {
        const Jv *point = find_choice(get(&r, "choices", JV_ARR), points[p]);
        if (!point) fail_msg("the record has no %s", points[p]);
        const Jv *cands = get(point, "candidates", JV_ARR);
        const char *dflt = get(point, "default", JV_STR)->str;
        for (int k = 0; k < cands->n; k++) {
            const char *value = get(&cands->items[k], "value", JV_STR)->str;
            if (!strcmp(value, dflt)) continue;
            char line[64];
            snprintf(line, sizeof line, "%s=%s\n", points[p], value);
            if (!strstr(text, line)) fail_msg("the record's candidate %s=%s is not listed:\n%s", points[p], value, text);
            want++;
        }
    }
    assert_int_equal(count_lines(text), want);
    rt_json_free(&r);
    free(text);

    rc = run("list_cuda", "%s %s tune %s %s --device cuda --list-candidates", env, fp8c, model, model_flags);
    text = slurp("list_cuda.out");
    if (rc != 0) fail_msg("tune --device cuda --list-candidates failed (%d):\n%s", rc, text);
    const char *prefixes[] = {"\nfuse.", "\nattn.", "\nce."};
    for (int i = 0; i < 3; i++)
        if (!strstr(text, prefixes[i])) fail_msg("no %s choice listed:\n%s", prefixes[i] + 1, text);
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (run("list_plan", "%s %s plan %s %s --choice %s", env, fp8c, model, model_flags, line) != 0) {
            char *why = slurp("list_plan.out");
            fail_msg("listed '%s', which plan refuses:\n%s", line, why);
        }
    }
    free(text);

    rc = run("list_o", "%s %s tune %s %s --device cpu --list-candidates -o %s/list.json", env, fp8c, model,
             model_flags, tmp_dir);
    text = slurp("list_o.out");
    if (rc != 2 || !strstr(text, "writes no record")) fail_msg("want a refusal of -o, got %d:\n%s", rc, text);
    free(text);
}

/* The point of saving attention's output or recomputing it: listed where the level saves
 * activations in FP8, as the other value of the level's default (-O2 and -O3 save it), not at
 * -O1, where nothing would change; and a memory lever: at -O3 the saved output raises the
 * plan's peak that --memory-budget compares. The point of saving q, k, v lists the other value
 * of its level's default too (-O3 makes them again). */
static void test_attention_y_point(void **state) {
    (void)state;
    const char *levels[] = {"-O1", "-O2", "-O3"}, *want[] = {NULL, "save.attention_y=0\n", "save.attention_y=0\n"};
    for (int i = 0; i < 3; i++) {
        int rc = run("list_y", "%s %s tune %s %s -D layers=1 -D dim=64 --batch 2 --seq 32 --device cpu --list-candidates",
                     env, fp8c, model, levels[i]);
        char *text = slurp("list_y.out");
        if (rc != 0) fail_msg("%s: tune --list-candidates failed (%d):\n%s", levels[i], rc, text);
        if (want[i] ? !strstr(text, want[i]) : strstr(text, "save.attention_y") != NULL)
            fail_msg("%s: want %s listed, got:\n%s", levels[i], want[i] ? want[i] : "no save.attention_y", text);
        const char *inputs = i == 2 ? "save.attention_inputs=1\n" : "save.attention_inputs=0\n";
        if (!strstr(text, inputs)) fail_msg("%s: want %s listed, got:\n%s", levels[i], inputs, text);
        free(text);
    }
    double peak[2];
    for (int v = 0; v < 2; v++) {
        int rc = run("plan_y", "%s %s plan %s -O3 -D layers=1 -D dim=64 --batch 2 --seq 32 --json --choice save.attention_y=%d",
                     env, fp8c, model, v);
        char *text = slurp("plan_y.out");
        if (rc != 0) fail_msg("plan --choice save.attention_y=%d failed (%d):\n%s", v, rc, text);
        const char *at = strstr(text, "\"peak_bytes\"");
        if (!at) fail_msg("no peak_bytes in:\n%s", text);
        peak[v] = strtod(strchr(at, ':') + 1, NULL);
        free(text);
    }
    printf("  -O3 plan peak: %.0f bytes recomputing attention's output, %.0f saving it\n", peak[0], peak[1]);
    assert_true(peak[1] > peak[0]);
}

/* ---------------------------------------------------------------- the GEMM point's report */

/* A report as the GEMM tuning mode writes it: one problem, its candidates' times, and per
 * candidate "ok" (NULL: not checked, no max_rel_diff, a note). */
typedef struct {
    double median, min, max;
    const char *ok;     /* "true", "false", or NULL: not checked */
} ReportCand;

static char *algo_hex(int i) {
    static char hex[8][129];
    char *h = hex[i % 8];
    for (int k = 0; k < 128; k++) h[k] = "0123456789abcdef"[(i * 7 + k) % 16];
    h[128] = 0;
    return h;
}

static void write_report(const char *path, const ReportCand *c, int n) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "{\"device\": {\"description\": \"NVIDIA H200; 132 SMs\"},\n  \"gemms\": [\n    {\"name\": "
               "\"gemm.00000000deadbeef\", \"default\": \"%s\", \"candidates\": [", algo_hex(0));
    for (int i = 0; i < n; i++) {
        fprintf(f, "%s\n      {\"value\": \"%s\", \"label\": \"algo %d\", \"median\": %.3f, \"min\": %.3f, \"max\": %.3f",
                i ? "," : "", algo_hex(i), i, c[i].median, c[i].min, c[i].max);
        if (c[i].ok) fprintf(f, ", \"max_rel_diff\": 0.001, \"ok\": %s}", c[i].ok);
        else fputs(", \"ok\": false, \"note\": \"not checked: not faster than the default by more than the noise\"}", f);
    }
    fputs("], \"what\": \"matmul logits: bf16 x bf16 -> bf16, 1 GEMM of the step\"}\n  ]}\n", f);
    fclose(f);
}

static const char *report_winner(const ReportCand *c, int n, TuneRecord *r) {
    char path[512];
    snprintf(path, sizeof path, "%s/gemms.json", tmp_dir);
    write_report(path, c, n);
    memset(r, 0, sizeof *r);
    r->points = calloc(TUNE_MAX_POINTS, sizeof *r->points);
    assert_non_null(r->points);
    assert_true(tune_gemm_report_read(path, r));
    assert_int_equal(r->n_points, 1);
    return r->points[0].winner;
}

/* Unchecked candidates are read as not ok and not compared, with the report's note, and the
 * record says so: "max_rel_diff": null. */
static void test_gemm_report_unchecked(void **state) {
    (void)state;
    ReportCand c[] = {{100, 99, 101, "true"}, {80, 79, 81, "true"}, {70, 69, 71, NULL}, {120, 118, 122, NULL}};
    TuneRecord r;
    const char *winner = report_winner(c, 4, &r);
    const TunePoint *p = &r.points[0];
    assert_string_equal(winner, algo_hex(1));   /* the unchecked faster one cannot win */
    assert_true(p->per_gemm && p->measured);
    assert_int_equal(p->n_cand, 4);
    assert_true(p->cand[1].ok && p->cand[1].max_rel_diff > 0);
    assert_false(p->cand[2].ok);
    assert_true(p->cand[2].max_rel_diff < 0);
    assert_non_null(strstr(p->cand[2].note, "not checked"));
    assert_string_equal(r.device_description, "NVIDIA H200; 132 SMs");
    snprintf(r.device_kind, sizeof r.device_kind, "cuda");
    char path[512];
    snprintf(path, sizeof path, "%s/gemm_record.json", tmp_dir);
    assert_true(tune_record_write(&r, path));
    char *text = slurp_path(path);
    assert_non_null(strstr(text, "\"max_rel_diff\": null, \"ok\": false, \"note\": \"not checked"));
    free(text);
    free(r.points);
}

/* Candidates started ahead on a GPU: every started binary's state, the running one's
 * included, within half the host's memory, at most three; none on the CPU. GPT-2 d48 -O1's
 * 24.58 GiB state: three on the 251 GiB host of two H200s, one on a 125 GiB host, none below
 * four states' worth. */
static void test_ahead_count(void **state) {
    (void)state;
    const double GiB = 1024.0 * 1024 * 1024, d48 = 24.58 * GiB;
    assert_int_equal(tune_ahead_count("cuda", 251 * GiB, d48), 3);
    assert_int_equal(tune_ahead_count("cuda", 125 * GiB, d48), 1);
    assert_int_equal(tune_ahead_count("cuda", 4 * d48, d48), 1);
    assert_int_equal(tune_ahead_count("cuda", 4 * d48 - 1, d48), 0);
    assert_int_equal(tune_ahead_count("cuda", 6 * d48, d48), 2);
    assert_int_equal(tune_ahead_count("cuda", 1000 * d48, d48), 3);
    assert_int_equal(tune_ahead_count("cpu", 1000 * d48, d48), 0);
    assert_int_equal(tune_ahead_count("cuda", 251 * GiB, 0), 0);
}

/* The rule on its own: fastest first, only what beats the default by more than its noise
 * (half its spread, at least 1%), everything timed when the default failed its checks. */
static void test_could_win(void **state) {
    (void)state;
    TuneTime dflt = {100, 96, 104};   /* noise 4 */
    TuneTime t[] = {{100, 96, 104}, {95, 94, 96}, {90, 80, 120}, {97, 97, 97}, {-1, -1, -1}, {50, 49, 51}, {90, 89, 91}};
    int order[8];
    int n = rt_tune_could_win(dflt, true, t, 7, order);
    assert_int_equal(n, 4);   /* 95.0 beats 100 by 5 > 4; 97 does not; the untimed never */
    assert_int_equal(order[0], 5), assert_int_equal(order[1], 2), assert_int_equal(order[2], 6);
    assert_int_equal(order[3], 1);
    n = rt_tune_could_win(dflt, false, t, 7, order);
    assert_int_equal(n, 6);
    assert_int_equal(order[4], 3), assert_int_equal(order[5], 0);
    TuneTime tight = {100, 100, 100};   /* 1% of the median */
    TuneTime u[] = {{99, 99, 99}, {98.9, 98.9, 98.9}};
    assert_int_equal(rt_tune_could_win(tight, true, u, 2, order), 1);
    assert_int_equal(order[0], 1);
}

/* Checking only what could win, fastest first up to the first that passes, picks the winner
 * that checking every candidate picks: random times and check outcomes, both reports read
 * by fp8c tune's own reader and rule. */
static void test_checks_pick_the_same_winner(void **state) {
    (void)state;
    uint64_t x = 0x2545f4914f6cdd1dull;
    for (int trial = 0; trial < 300; trial++) {
        enum { N = 8 };
        ReportCand all[N], few[N];
        TuneTime t[N];
        bool pass[N];
        for (int i = 0; i < N; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            double med = 80 + (double)(x % 4000) / 100, half = (double)((x >> 16) % 300) / 100;
            if ((x >> 32) % 7 == 0 && i) med = all[0].median;   /* ties with the default */
            pass[i] = (x >> 40) % 3 != 0 || (i == 0 && (x >> 48) % 4 != 0);
            all[i] = (ReportCand){med, med - half, med + half, pass[i] ? "true" : "false"};
            /* as printed, as the mode decides */
            char s[64];
            snprintf(s, sizeof s, "%.3f", med);
            t[i].median = strtod(s, NULL);
            snprintf(s, sizeof s, "%.3f", med - half);
            t[i].min = strtod(s, NULL);
            snprintf(s, sizeof s, "%.3f", med + half);
            t[i].max = strtod(s, NULL);
            few[i] = all[i];
            if (i) few[i].ok = NULL;
        }
        int order[N];
        int n = rt_tune_could_win(t[0], pass[0], t, N, order);
        for (int j = 0; j < n; j++) {
            if (order[j] == 0) continue;
            few[order[j]].ok = all[order[j]].ok;
            if (pass[order[j]]) break;
        }
        TuneRecord a, b;
        char want[TUNE_VALUE_LEN];
        snprintf(want, sizeof want, "%s", report_winner(all, N, &a));
        const char *got = report_winner(few, N, &b);
        if (strcmp(want, got)) fail_msg("trial %d: checking every candidate picks %.8s, checking what could win %.8s",
                                        trial, want, got);
        free(a.points), free(b.points);
    }
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_record_fields),   cmocka_unit_test(test_tune_never_overwrites),
        cmocka_unit_test(test_reuse_is_bit_identical), cmocka_unit_test(test_mismatch_refused),
        cmocka_unit_test(test_malformed_refused), cmocka_unit_test(test_plan_shows_the_record),
        cmocka_unit_test(test_memory_budget_unreachable), cmocka_unit_test(test_gpu_record_without_gpu),
        cmocka_unit_test(test_edited_policy_refused),
        cmocka_unit_test(test_unwritable_output),
        cmocka_unit_test(test_list_candidates),  cmocka_unit_test(test_attention_y_point),
        cmocka_unit_test(test_could_win),        cmocka_unit_test(test_gemm_report_unchecked),
        cmocka_unit_test(test_ahead_count),
        cmocka_unit_test(test_checks_pick_the_same_winner),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
