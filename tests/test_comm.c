/* test_comm.c — data parallel without GPUs: what CI can check of `--gpus N`.
 *
 * - A binary built with --gpus 2 (its update averages every gradient over the GPUs first: the
 *   comm pass's all_reduce nodes) trains on one rank, on the CPU kernels and on the reference
 *   executor, exactly as a binary built without it: the same log lines (loss and gradient norm
 *   to the last digit) and the same checkpoint bytes, with --grad-accum above 1 too.
 * - `fp8c plan --gpus N` counts the all-reduce: one per gradient accumulator, their bytes equal
 *   to the plan's gradient category, and a ring's 2 (N-1) / N of them sent per GPU; `--kernels`
 *   lists the NCCL group. The counts come from the plan's own tensor table and totals.
 * - Bad launches end with one line and a non-zero status: --grad-release with --gpus at build
 *   time; at run time --rank without --world-size, a rank outside the world, a world without
 *   --comm-file, --gpus with --rank, the CPU device, a binary built for one GPU, and --gpus or
 *   --world-size where this host has no GPU or no NCCL (or fewer GPUs than asked for).
 *
 * The GPU side (two ranks against one GPU with --grad-accum 2, both launch paths) is
 * tools/gpu/multi_gpu_check.sh. The fp8c executable is $FP8C, else the build directory's. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "rt.h"
#include "test_files.h"

static char fp8c[1024];
static char model[1024];
static unsigned seed;
static const char *const model_flags = "--batch 4 --seq 32";
static const char *const data = FP8C_SOURCE_DIR "/data/gcide_sample.txt";

static int setup(void **state) {
    (void)state;
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/fp8c-test-comm-XXXXXX");
    assert_non_null(mkdtemp(tmp_dir));
    const char *env = getenv("FP8C");
    snprintf(fp8c, sizeof fp8c, "%s", env && *env ? env : FP8C_BINARY_DIR "/fp8c");
    snprintf(model, sizeof model, "%s/models/gpt2_tiny.model", FP8C_SOURCE_DIR);
    seed = (unsigned)time(NULL) ^ (unsigned)getpid();
    printf("test_comm: seed %u\n", seed);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    remove_tree(tmp_dir);
    return 0;
}

static char *slurp_path(const char *path, int64_t *size) {
    int64_t n = 0;
    uint8_t *p = rt_read_file(path, &n);
    if (!p) fail_msg("cannot read %s", path);
    char *s = realloc(p, (size_t)n + 1);
    s[n] = 0;
    if (size) *size = n;
    return s;
}

static char *slurp(const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", tmp_dir, name);
    return slurp_path(path, NULL);
}

static void build(const char *flags, const char *bin) {
    int rc = run("build", "%s build %s %s %s -o %s/%s", fp8c, model, flags, model_flags, tmp_dir, bin);
    if (rc != 0) fail_msg("fp8c build failed (%d):\n%s", rc, slurp("build.out"));
}

static int count_lines(const char *text) {
    int n = 0;
    for (const char *p = text; *p; p++) n += *p == '\n';
    return n;
}

static void expect_one_line(const char *name, int want_rc, const char *want, int rc) {
    char out[64];
    snprintf(out, sizeof out, "%s.out", name);
    char *text = slurp(out);
    if (rc != want_rc || count_lines(text) != 1 || !strstr(text, want))
        fail_msg("%s: status %d (want %d), output should be one line with \"%s\":\n%s", name, rc,
                 want_rc, want, text);
    free(text);
}

/* The log without the fields that measure time (tokens_per_s, ms). */
static char *log_without_times(const char *name) {
    char *text = slurp(name);
    char *out = calloc(strlen(text) + 1, 1), *o = out;
    for (const char *p = text; *p;) {
        if (!strncmp(p, "\"tokens_per_s\":", 15) || !strncmp(p, "\"ms\":", 5)) {
            while (*p && *p != ',' && *p != '}') p++;
            if (*p == ',') p++;
            continue;
        }
        *o++ = *p++;
    }
    free(text);
    return out;
}

/* One run each of the two binaries on `device`; logs and final checkpoints must agree. */
static void check_same_run(const char *device, const char *level, int accum) {
    const char *bins[2] = {"one", "dp"};
    char *logs[2], *ckpt[2];
    int64_t sizes[2];
    for (int k = 0; k < 2; k++) {
        int rc = run("train", "%s/%s --data %s --steps 4 --grad-accum %d --seed %u --device %s "
                     "--eval-every 2 --eval-batches 2 --log %s/%s.%s.jsonl --out %s/%s.%s "
                     "--overwrite", tmp_dir, bins[k], data, accum, seed, device, tmp_dir, bins[k],
                     device, tmp_dir, bins[k], device);
        if (rc != 0) fail_msg("%s -O%s on %s failed (%d):\n%s", bins[k], level, device, rc,
                              slurp("train.out"));
        char name[128], path[512];
        snprintf(name, sizeof name, "%s.%s.jsonl", bins[k], device);
        logs[k] = log_without_times(name);
        snprintf(path, sizeof path, "%s/%s.%s/step_000004.safetensors", tmp_dir, bins[k], device);
        ckpt[k] = slurp_path(path, &sizes[k]);
    }
    assert_int_equal(count_lines(logs[0]), 4);
    if (strcmp(logs[0], logs[1]))
        fail_msg("-O%s on %s: the data-parallel build logs differently on one rank:\n%s\n---\n%s",
                 level, device, logs[0], logs[1]);
    assert_int_equal(sizes[0], sizes[1]);
    if (memcmp(ckpt[0], ckpt[1], (size_t)sizes[0]))
        fail_msg("-O%s on %s: the checkpoints differ", level, device);
    for (int k = 0; k < 2; k++) free(logs[k]), free(ckpt[k]);
}

static void test_one_rank_is_bit_identical(void **state) {
    (void)state;
    build("-O1", "one");
    build("-O1 --gpus 2", "dp");
    check_same_run("cpu", "1", 2);     /* bf16 gradients, two micro-steps */
    build("-O0", "one");
    build("-O0 --gpus 4", "dp");
    check_same_run("ref", "0", 1);     /* f32 gradients, the reference executor */
}

/* "key": value of the plan's JSON, as a number */
static double json_num(const char *text, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *p = strstr(text, pat);
    if (!p) fail_msg("no \"%s\" in the plan:\n%s", key, text);
    return strtod(p + strlen(pat), NULL);
}

static void test_plan_counts_the_all_reduce(void **state) {
    (void)state;
    const int gpus = 2 + (int)(seed % 7);
    int rc = run("plan", "%s plan %s -O1 %s --gpus %d --json", fp8c, model, model_flags, gpus);
    if (rc != 0) fail_msg("plan failed:\n%s", slurp("plan.out"));
    char *text = slurp("plan.out");
    /* the tensor table's gradient accumulators, counted independently of the all-reduce */
    int grads = 0;
    for (const char *p = text; (p = strstr(p, "\"role\": \"grad\"")); p++) grads++;
    const char *totals = strstr(text, "\"totals\"");
    assert_non_null(totals);
    double grad_bytes = json_num(totals, "gradients");
    assert_true(grads > 0 && grad_bytes > 0);
    assert_int_equal((int)json_num(text, "gpus"), gpus);
    assert_int_equal((int)json_num(text, "allreduce_tensors"), grads);
    assert_true(json_num(text, "allreduce_bytes") == grad_bytes);
    assert_true(json_num(text, "sent_bytes_per_gpu") ==
                floor(2 * grad_bytes * (gpus - 1) / gpus));
    free(text);

    /* without --gpus: one GPU, nothing to reduce */
    rc = run("plan1", "%s plan %s -O1 %s --json", fp8c, model, model_flags);
    assert_int_equal(rc, 0);
    text = slurp("plan1.out");
    assert_int_equal((int)json_num(text, "gpus"), 1);
    assert_int_equal((int)json_num(text, "allreduce_tensors"), 0);
    free(text);

    rc = run("table", "%s plan %s -O1 %s --gpus %d", fp8c, model, model_flags, gpus);
    assert_int_equal(rc, 0);
    text = slurp("table.out");
    char want[128];
    snprintf(want, sizeof want, "data parallel over %d GPUs", gpus);
    assert_non_null(strstr(text, want));
    snprintf(want, sizeof want, "sums %d gradients", grads);
    assert_non_null(strstr(text, want));
    free(text);

    /* comm.overlap=0: one NCCL group at the start of the update */
    rc = run("kernels", "%s plan %s -O1 %s --gpus %d --kernels --choice comm.overlap=0", fp8c, model,
             model_flags, gpus);
    text = slurp("kernels.out");
    if (rc == 0) {   /* (an fp8c without the GPU backend has no listing to show) */
        snprintf(want, sizeof want, "all_reduce (sum) x %d, one group", grads);
        if (!strstr(text, want)) fail_msg("no NCCL group in the listing:\n%.2000s", text);
        assert_null(strstr(text, "bucket 0"));
    }
    free(text);
}

/* The buckets of the reduction (runtime/comm_buckets.c): every gradient in exactly one, each
 * bucket but the last at least comm.bucket_mb, in the order the backward finishes them; the
 * kernel listing sends each in the backward (comm.overlap, the default), after the launch
 * that writes its last accumulator, and never two at once. */
static void test_plan_shows_the_buckets(void **state) {
    (void)state;
    const int mb = 1 + (int)(seed % 2);
    int rc = run("plan", "%s plan %s -O1 --batch 8 --seq 64 -D dim=256 --gpus 2 --json --choice "
                 "comm.bucket_mb=%d", fp8c, model, mb);
    char *text = slurp("plan.out");
    if (rc != 0) fail_msg("plan failed:\n%s", text);
    int grads = (int)json_num(text, "allreduce_tensors");
    double bytes = json_num(text, "allreduce_bytes");
    assert_non_null(strstr(text, "\"allreduce_overlap\": true"));
    const char *p = strstr(text, "\"allreduce_buckets\": [");
    assert_non_null(p);
    int n = 0, tensors = 0;
    double sum = 0, last = 0;
    for (const char *q = p; (q = strstr(q, "{\"tensors\": ")); q++) {
        if (n && last < (double)(mb << 20))
            fail_msg("bucket %d holds %g bytes, less than %d MiB, and is not the last", n - 1, last, mb);
        tensors += (int)json_num(q, "tensors");
        last = json_num(q, "bytes");
        assert_true(last > 0);
        sum += last;
        n++;
    }
    assert_true(n >= 2);
    assert_int_equal(tensors, grads);
    assert_true(sum == bytes);
    free(text);

    rc = run("table", "%s plan %s -O1 --batch 8 --seq 64 -D dim=256 --gpus 2 --choice comm.bucket_mb=%d",
             fp8c, model, mb);
    assert_int_equal(rc, 0);
    text = slurp("table.out");
    char want[128];
    snprintf(want, sizeof want, "%d buckets of about %d.0 MiB", n, mb);
    if (!strstr(text, want)) fail_msg("no \"%s\" in the plan:\n%s", want, text);
    free(text);

    rc = run("kernels", "%s plan %s -O1 --batch 8 --seq 64 -D dim=256 --gpus 2 --kernels --choice "
             "comm.bucket_mb=%d", fp8c, model, mb);
    text = slurp("kernels.out");
    if (rc == 0) {
        int at = -1;
        for (int b = 0; b < n; b++) {
            snprintf(want, sizeof want, "bucket %d: all_reduce (sum)", b);
            const char *q = strstr(text, want);
            if (!q) fail_msg("no \"%s\" in the listing:\n%.3000s", want, text);
            const char *line = q;
            while (line > text && line[-1] != '\n') line--;
            if (!strstr(line, "backward")) fail_msg("bucket %d is not sent in the backward", b);
            assert_true((int)(q - text) > at);
            at = (int)(q - text);
            /* the line before it: the launch that writes an accumulator, or another bucket */
            const char *prev = line - 1;
            while (prev > text && prev[-1] != '\n') prev--;
            char before[256];
            snprintf(before, sizeof before, "%.*s", (int)(line - prev), prev);
            if (!strstr(before, "accumulate") && !strstr(before, "nccl"))
                fail_msg("bucket %d does not follow an accumulation: %s", b, before);
        }
        assert_null(strstr(text, "one group"));
    }
    free(text);
}

static void test_bad_launches(void **state) {
    (void)state;
    int rc = run("release", "%s build %s -O1 %s --gpus 2 --grad-release -o %s/x", fp8c, model,
                 model_flags, tmp_dir);
    char *text = slurp("release.out");
    if (rc == 0 || !strstr(text, "--grad-release") || !strstr(text, "2 GPUs"))
        fail_msg("--grad-release with --gpus: status %d\n%s", rc, text);
    free(text);

    build("-O1 --gpus 2", "dp");
    build("-O1", "one");
    struct {
        const char *name, *flags, *want;
        int rc;
    } cases[] = {
        {"rank_alone", "--rank 1", "--rank without --world-size", 2},
        {"world_alone", "--world-size 2", "--world-size without --rank", 2},
        {"rank_outside", "--rank 2 --world-size 2 --comm-file %s/id", "ranks of --world-size 2 are 0 to 1", 2},
        {"no_comm_file", "--rank 0 --world-size 2", "--comm-file", 2},
        {"comm_file_alone", "--comm-file %s/id", "--comm-file goes with", 2},
        {"gpus_and_rank", "--gpus 2 --rank 0 --world-size 2", "drop --rank", 2},
        {"gpus_on_cpu", "--gpus 2 --device cpu", "data parallel runs on GPUs", 2},
        {"gpus_zero", "--gpus 0", "--gpus 0", 2},
        {"timeout", "--rank 0 --world-size 2 --comm-file %s/id --comm-timeout 0", "--comm-timeout", 2},
        {"eval_only", "--gpus 2 --eval-only", "one process", 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char flags[256];
        snprintf(flags, sizeof flags, cases[i].flags, tmp_dir);
        rc = run(cases[i].name, "%s/dp --data %s %s", tmp_dir, data, flags);
        expect_one_line(cases[i].name, cases[i].rc, cases[i].want, rc);
    }
    /* a binary built for one GPU has no all-reduce to run */
    rc = run("built_one", "%s/one --data %s --gpus 2", tmp_dir, data);
    expect_one_line("built_one", 1, "built for one GPU", rc);
    rc = run("built_one_w", "%s/one --data %s --rank 0 --world-size 2 --comm-file %s/id", tmp_dir,
             data, tmp_dir);
    expect_one_line("built_one_w", 1, "built for one GPU", rc);
    /* more GPUs than any host has: no driver, no NCCL or too few GPUs, said in one line by the
     * launcher before any rank starts */
    rc = run("too_many", "%s/dp --data %s --gpus 1024", tmp_dir, data);
    expect_one_line("too_many", 1, "--gpus 1024: ", rc);
    text = slurp("too_many.out");
    assert_true(strstr(text, "no GPU") || strstr(text, "NCCL") || strstr(text, "not 1024") ||
                strstr(text, "cuBLASLt"));
    free(text);
    /* the comm file is left alone when the ranks never met */
    char id[512];
    snprintf(id, sizeof id, "%s/id", tmp_dir);
    assert_int_equal(access(id, F_OK), -1);
}

/* Rank r of W with A micro-steps reads micro-steps r*A .. r*A+A-1 of the global step: the W
 * ranks together read exactly the batches of one process with W*A micro-steps, each once; and
 * grad_scale, 1 / (A*W), is what that one process feeds (the accumulators, summed over the
 * ranks, then hold what its accumulator holds). */
static void test_data_split_and_grad_scale(void **state) {
    (void)state;
    TokenData d;
    memset(&d, 0, sizeof d);
    assert_true(rt_data_open(&d, data));
    enum { B = 3, T = 16 };
    int32_t tok[B * T], tgt[B * T], want_tok[B * T], want_tgt[B * T];
    const uint64_t data_seed = seed;
    const int64_t step = seed % 1000;
    for (int world = 1; world <= 4; world++)
        for (int accum = 1; accum <= 3; accum++) {
            int n = world * accum;
            int seen[12] = {0};
            for (int r = 0; r < world; r++)
                for (int m = 0; m < accum; m++) {
                    int k = rt_global_micro(r, accum, m);
                    assert_true(k >= 0 && k < n);
                    seen[k]++;
                    /* rank r's micro-step m, and one process's micro-step r*A+m */
                    rt_data_train_batch(&d, data_seed, step, k, B, T, tok, tgt);
                    rt_data_train_batch(&d, data_seed, step, rt_global_micro(0, n, r * accum + m), B,
                                        T, want_tok, want_tgt);
                    assert_memory_equal(tok, want_tok, sizeof tok);
                    assert_memory_equal(tgt, want_tgt, sizeof tgt);
                }
            for (int k = 0; k < n; k++) assert_int_equal(seen[k], 1);
            /* the f32 the update reads equals one process's with W*A micro-steps */
            assert_true((float)rt_grad_scale(accum, world) == (float)rt_grad_scale(n, 1));
            assert_true(fabs(rt_grad_scale(accum, world) * n - 1) < 1e-15);
        }
    /* different micro-steps are different batches (the ranks do not repeat each other) */
    rt_data_train_batch(&d, data_seed, step, rt_global_micro(0, 1, 0), B, T, want_tok, want_tgt);
    rt_data_train_batch(&d, data_seed, step, rt_global_micro(1, 1, 0), B, T, tok, tgt);
    assert_true(memcmp(tok, want_tok, sizeof tok) != 0);
    rt_data_free(&d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_one_rank_is_bit_identical, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plan_counts_the_all_reduce, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_launches, setup, teardown),
        cmocka_unit_test_setup_teardown(test_data_split_and_grad_scale, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plan_shows_the_buckets, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
