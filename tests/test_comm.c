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
 * - The FP8 reduction (comm:grad=e5m2 / e4m3, runtime/comm_fp8.c): its host reference against
 *   an f64 sum of the ranks' gradients on random data, within the bound its two roundings
 *   allow (derived at fp8_bound below); infinities and NaN reach the step's finite check; the
 *   plan's bytes per collective; the rule refused without --gpus; a binary built with it runs
 *   on one rank exactly as one without it.
 *
 * The GPU side (two ranks against one GPU with --grad-accum 2, both launch paths, the FP8
 * reduction's kernels against the host reference bit for bit) is tests/gpu/test_gpu_comm.c
 * and tools/gpu/multi_gpu_check.sh. The fp8c executable is $FP8C, else the build directory's. */
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
#include "test_rng.h"

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

/* A build refused by a pass: status 1, its one error line and the count of errors. */
static void expect_pass_error(const char *name, const char *want, int rc) {
    char out[64];
    snprintf(out, sizeof out, "%s.out", name);
    char *text = slurp(out);
    const char *at = strstr(text, want);
    if (rc != 1 || count_lines(text) != 2 || !at || at > strchr(text, '\n') || !strstr(text, "\n1 error."))
        fail_msg("%s: status %d (want 1), output should be \"%s\" in one error line and the count:\n%s", name,
                 rc, want, text);
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
    /* the FP8 reduction: nothing to reduce on one rank either */
    build("-O1", "one");
    build("-O1 --gpus 2 --precision comm:grad=e5m2", "dp");
    check_same_run("cpu", "1", 1);
}

static double json_num(const char *text, const char *key);

/* ---------------------------------------------------------------- the FP8 reduction
 * The bound on |out - S| for one element, S = sum_j x_j exactly (f64), out = the reference's
 * (comm_fp8.c), with e = 2^-(mantissa bits + 1) the format's relative rounding (2^-3 e5m2,
 * 2^-4 e4m3), d half its smallest subnormal (2^-17, 2^-10), u = 2^-24 (f32):
 *   x_j s1 is an f32 product (u), rounded to FP8: |dq_j - x_j s1| <= e' |x_j s1| + d with
 *     e' = e (1 + 2u) + 2u; saturation adds nothing (|x_j s1| <= max (1 + u));
 *   the sum of the N codes in f32 and the division by s1 add (N u) sum |dq_j| / s1 + u |y|;
 *   so |y - S| <= e1 = e' A + N d / s1 + 2 N u ((1 + e') A + N d / s1), A = sum |x_j|;
 *   the second rounding: |out - y| <= e' |y| + d / s2 <= e' (|S| + e1) + d / s2.
 * Per element the first term dominates: e' times the sum of the magnitudes, not of the sum,
 * which is why cancelling gradients (opposite signs on two ranks) lose relative accuracy. */
static double fp8_bound(ElemType wire, int ranks, const double *x_abs_sum, double sum, float s1, float s2)
{
    double e = wire == FMT_E5M2 ? 0x1p-3 : 0x1p-4, d = wire == FMT_E5M2 ? 0x1p-17 : 0x1p-10;
    double u = 0x1p-24, ep = e * (1 + 2 * u) + 2 * u, A = *x_abs_sum;
    double e1 = ep * A + ranks * d / s1 + 2 * ranks * u * ((1 + ep) * A + ranks * d / s1);
    return e1 + ep * (fabs(sum) + e1) + d / s2;
}

static void test_fp8_reduction_bound(void **state) {
    (void)state;
    rng_state = seed;
    static const ElemType wires[2] = {FMT_E5M2, FMT_E4M3};
    static const int ranks_list[4] = {2, 3, 4, 8};
    for (int w = 0; w < 2; w++)
        for (int k = 0; k < 4; k++) {
            ElemType wire = wires[w];
            int ranks = ranks_list[k];
            int64_t n = rng_int(1, 6000);
            float *x[8], *out = malloc(sizeof(float) * (size_t)n);
            /* gradients of a layer: normal values over five decades, a share exactly zero, each
             * rank its own magnitude; half the cases rounded to bf16 as the accumulators are */
            double decade = rng_uniform() * 8 - 6;
            for (int r = 0; r < ranks; r++) {
                x[r] = malloc(sizeof(float) * (size_t)n);
                double rank_scale = pow(10, decade + rng_uniform());
                for (int64_t i = 0; i < n; i++) {
                    float v = (float)(rng_normal() * rank_scale * pow(10, 4 * rng_uniform() - 2));
                    if (rng_uniform() < 0.05) v = 0;
                    x[r][i] = (k & 1) ? num_round(FMT_BF16, v) : v;
                }
            }
            rt_comm_fp8_reduce(wire, ranks, n, (const float *const *)x, out);
            /* the scales the reference used, recomputed */
            float amax = 0, amax2 = 0;
            for (int r = 0; r < ranks; r++)
                for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[r][i]));
            float s1 = rt_comm_fp8_scale(wire, amax);
            double err2 = 0, ref2 = 0, worst = 0;
            for (int64_t i = 0; i < n; i++) {
                float sum = 0;
                for (int r = 0; r < ranks; r++) sum += num_round(wire, x[r][i] * s1);
                amax2 = fmaxf(amax2, fabsf(sum / s1));
            }
            float s2 = rt_comm_fp8_scale(wire, amax2);
            for (int64_t i = 0; i < n; i++) {
                double S = 0, A = 0;
                for (int r = 0; r < ranks; r++) S += x[r][i], A += fabs(x[r][i]);
                double bound = fp8_bound(wire, ranks, &A, S, s1, s2);
                double err = fabs((double)out[i] - S);
                if (!(err <= bound * (1 + 1e-9)))
                    fail_msg("%s over %d ranks, element %lld of %lld: %.9g, the sum is %.9g (error %.3g, "
                             "bound %.3g; scales %g, %g)", fmt_elem_name(wire), ranks, (long long)i,
                             (long long)n, out[i], S, err, bound, s1, s2);
                if (bound > 0 && err / bound > worst) worst = err / bound;
                err2 += err * err, ref2 += S * S;
            }
            /* normalized error: about e / sqrt(3) for each of two roundings of values spread over
             * the binades; 0.5 e bounds it with room for few elements */
            double norm = ref2 > 0 ? sqrt(err2 / ref2) : 0;
            double e = wire == FMT_E5M2 ? 0x1p-3 : 0x1p-4;
            printf("  %s over %d ranks, %lld elements: normalized error %.4f (bound on it %.4f), "
                   "worst element at %.2f of its bound\n", fmt_elem_name(wire), ranks, (long long)n,
                   norm, e, worst);
            assert_true(norm <= e);
            for (int r = 0; r < ranks; r++) free(x[r]);
            free(out);
        }
}

/* Zeros stay zeros; an infinity on one rank makes the whole bucket NaN (saturating it would
 * hide it from the finite check), a NaN stays where it is; the scales of the rule. */
static void test_fp8_reduction_special_values(void **state) {
    (void)state;
    float a[4] = {0, 0, 0, 0}, b[4] = {0, -0.0f, 0, 0}, out[4];
    const float *x[2] = {a, b};
    rt_comm_fp8_reduce(FMT_E5M2, 2, 4, x, out);
    for (int i = 0; i < 4; i++) assert_true(out[i] == 0);
    a[0] = 1, a[1] = 2, b[2] = INFINITY;
    rt_comm_fp8_reduce(FMT_E5M2, 2, 4, x, out);
    for (int i = 0; i < 4; i++) assert_true(isnan(out[i]));
    b[2] = NAN;
    rt_comm_fp8_reduce(FMT_E4M3, 2, 4, x, out);
    assert_true(isnan(out[2]));
    assert_true(out[0] == 1 && out[1] == 2 && out[3] == 0);   /* powers of two: exact */
    assert_true(rt_comm_fp8_scale(FMT_E5M2, 0) == 1.0f);
    assert_true(isnan(rt_comm_fp8_scale(FMT_E4M3, INFINITY)));
    assert_true(rt_comm_fp8_scale(FMT_E4M3, 448) == 1.0f);
    assert_true(rt_comm_fp8_scale(FMT_E5M2, 1e-40f) == 0x1p127f);   /* capped: x s stays finite */
    assert_int_equal(rt_comm_fp8_shard(1000, 3), 512);
    assert_int_equal(rt_comm_fp8_shard(512, 2), 256);
}

/* The plan of comm:grad=e5m2: its format, the bytes of each collective (the shards twice, one
 * byte an element, and two f32 maxima a bucket), under half of what bf16 sends; the rule
 * without --gpus, or with another format or pattern, is an error. */
static void test_plan_of_the_fp8_reduction(void **state) {
    (void)state;
    const int gpus = 2 + (int)(seed % 3);
    int rc = run("plan", "%s plan %s -O1 %s --gpus %d --json --precision comm:grad=e5m2", fp8c, model,
                 model_flags, gpus);
    char *text = slurp("plan.out");
    if (rc != 0) fail_msg("plan failed:\n%s", text);
    assert_non_null(strstr(text, "\"allreduce_wire\": \"e5m2\""));
    double bytes = json_num(text, "allreduce_bytes"), sent = json_num(text, "sent_bytes_per_gpu");
    assert_non_null(strstr(text, "\"collective\": \"all_to_all (send/recv)\", \"format\": \"e5m2\""));
    assert_non_null(strstr(text, "\"collective\": \"all_gather\", \"format\": \"e5m2\""));
    const char *a2a = strstr(text, "\"collective\": \"all_to_all");
    const char *ag = strstr(text, "\"collective\": \"all_gather");
    double sent_a2a = json_num(a2a, "bytes_per_gpu"), sent_ag = json_num(ag, "bytes_per_gpu");
    assert_true(sent_a2a == sent_ag);
    assert_true(sent_a2a + sent_ag < sent && sent < sent_a2a + sent_ag + 64 * 8);
    /* bf16 gradients: an element is 2 bytes in the accumulator, (N-1)/N of a byte twice on the
     * wire (shards padded to 256 elements) against 2 (N-1)/N x 2 bytes for NCCL's bf16 sum */
    double bf16_sent = 2 * bytes * (gpus - 1) / gpus;
    printf("  comm:grad=e5m2 over %d GPUs: %.0f bytes sent per GPU per step, bf16 %.0f (%.3f of it)\n",
           gpus, sent, bf16_sent, sent / bf16_sent);
    assert_true(sent < 0.55 * bf16_sent);
    free(text);
    rc = run("table", "%s plan %s -O1 %s --gpus %d --precision comm:grad=e4m3", fp8c, model, model_flags, gpus);
    text = slurp("table.out");
    assert_int_equal(rc, 0);
    if (!strstr(text, "sent in e4m3 with one scale per bucket") || !strstr(text, "all_to_all (send/recv)"))
        fail_msg("the plan does not show the FP8 reduction:\n%s", text);
    free(text);
    static const struct { const char *flags, *want; } refused[] = {
        {"--precision comm:grad=e5m2", "build with --gpus N"},
        {"--gpus 2 --precision comm:grad=bf16", "comm:grad takes e5m2 or e4m3"},
        {"--gpus 2 --precision comm:grad=e5m2:delayed16", "comm:grad takes e5m2 or e4m3"},
        {"--gpus 2 --precision comm:weights=e5m2", "a comm: rule names what is reduced"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        rc = run("refused", "%s build %s -O1 %s %s -o %s/x", fp8c, model, model_flags, refused[i].flags, tmp_dir);
        text = slurp("refused.out");
        if (rc == 0 || !strstr(text, refused[i].want))
            fail_msg("fp8c build %s: status %d, want an error with \"%s\":\n%s", refused[i].flags, rc,
                     refused[i].want, text);
        free(text);
    }
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
/* --shard-states: refused without --gpus N, with the FP8 reduction, and by tune (it times one
 * GPU, where nothing is sharded); the plan shows the per-GPU state at 1/N and the sharded
 * step's collectives. The arithmetic is tests/test_shard.c's; the GPU step is
 * tests/gpu/test_gpu_comm.c's. */
static void test_shard_states_plan_and_refusals(void **state) {
    (void)state;
    int rc = run("shard_one", "%s plan %s -O3 %s --shard-states", fp8c, model, model_flags);
    char *text = slurp("shard_one.out");
    if (rc == 0 || !strstr(text, "--shard-states") || !strstr(text, "--gpus N"))
        fail_msg("--shard-states without --gpus: status %d\n%s", rc, text);
    free(text);
    rc = run("shard_fp8", "%s plan %s -O3 %s --gpus 2 --shard-states --precision comm:grad=e5m2", fp8c,
             model, model_flags);
    text = slurp("shard_fp8.out");
    if (rc == 0 || !strstr(text, "--shard-states"))
        fail_msg("--shard-states with comm:grad=e5m2: status %d\n%s", rc, text);
    free(text);
    rc = run("shard_tune", "%s tune %s -O3 %s --gpus 2 --shard-states -o %s/x.tune", fp8c, model,
             model_flags, tmp_dir);
    expect_one_line("shard_tune", 2, "--shard-states: fp8c tune times one GPU", rc);
    rc = run("shard_plan", "%s plan %s -O2 %s --gpus 2 --shard-states", fp8c, model, model_flags);
    text = slurp("shard_plan.out");
    if (rc != 0 || !strstr(text, "with sharded state") || !strstr(text, "reduce_scatter sum") ||
        !strstr(text, "all_gather (FP8 copies)") || !strstr(text, "bytes per parameter (one GPU:"))
        fail_msg("plan --gpus 2 --shard-states: status %d\n%s", rc, text);
    free(text);
    rc = run("shard_json", "%s plan %s -O2 %s --gpus 2 --shard-states --json", fp8c, model, model_flags);
    text = slurp("shard_json.out");
    const char *at = strstr(text, "\"per_gpu_bytes_per_param\": "), *one = strstr(text, "\"bytes_per_param\": ");
    if (rc != 0 || !at || !one || !strstr(text, "\"shard_states\": true"))
        fail_msg("plan --json --shard-states: status %d\n%s", rc, text);
    double per_gpu = atof(at + strlen("\"per_gpu_bytes_per_param\": ")), whole = atof(one + strlen("\"bytes_per_param\": "));
    /* O2: bf16 weights, e4m3 copies and bf16 gradients whole; f32 master, e4m3 states halved */
    if (!(per_gpu < whole * 0.8 && per_gpu > 5))
        fail_msg("plan --json: %.3f bytes a parameter per GPU, %.3f on one", per_gpu, whole);
    free(text);
}

/* --shard-states=2 (ZeRO stage 2): a stage other than 1, 2 or 3 is refused by the flag, stage 2
 * with --grad-release or comm.overlap=0 by the comm pass, each in one line, and tune names the
 * stage it refuses; the plan shows the gradients at 1/N and the bucket buffers in the step
 * arena, and --json says which stage. */
static void test_shard_grads_plan_and_refusals(void **state) {
    (void)state;
    int rc = run("shard4", "%s plan %s -O3 %s --gpus 2 --shard-states=4", fp8c, model, model_flags);
    expect_one_line("shard4", 2, "--shard-states takes the ZeRO stage, 1", rc);
    rc = run("shard2_release", "%s plan %s -O3 %s --gpus 2 --shard-states=2 --grad-release", fp8c, model,
             model_flags);
    expect_pass_error("shard2_release", "--shard-states=2 keeps each gradient only as its shard's sum", rc);
    rc = run("shard2_after", "%s plan %s -O3 %s --gpus 2 --shard-states=2 --choice comm.overlap=0", fp8c,
             model, model_flags);
    expect_pass_error("shard2_after", "comm.overlap=0 reduces them after it", rc);
    rc = run("shard2_one", "%s plan %s -O3 %s --shard-states=2", fp8c, model, model_flags);
    expect_pass_error("shard2_one", "add --gpus N", rc);
    rc = run("shard2_tune", "%s tune %s -O3 %s --gpus 2 --shard-states=2 -o %s/x.tune", fp8c, model,
             model_flags, tmp_dir);
    expect_one_line("shard2_tune", 2, "--shard-states=2 --tune FILE", rc);
    rc = run("shard2_plan", "%s plan %s -O3 %s --gpus 2 --shard-states=2", fp8c, model, model_flags);
    char *text = slurp("shard2_plan.out");
    if (rc != 0 || !strstr(text, "ZeRO\nstage 2") || !strstr(text, "of gradient buffers") ||
        !strstr(text, "reduce_scatter sum") || !strstr(text, "(x --grad-accum)"))
        fail_msg("plan --gpus 2 --shard-states=2: status %d\n%s", rc, text);
    const char *grads = strstr(text, "  gradients ");
    if (!grads || !strstr(grads, "(1/N)") || strstr(grads, "(1/N)") > strchr(grads, '\n'))
        fail_msg("plan --shard-states=2: the gradients are not marked 1/N:\n%s", text);
    free(text);
    rc = run("shard2_json", "%s plan %s -O3 %s --gpus 2 --shard-states=2 --json", fp8c, model, model_flags);
    text = slurp("shard2_json.out");
    const char *buf = strstr(text, "\"per_gpu_grad_buffer_bytes\": ");
    if (rc != 0 || !strstr(text, "\"shard_stage\": 2") || !buf || atoll(buf + 29) <= 0)
        fail_msg("plan --json --shard-states=2: status %d\n%s", rc, text);
    free(text);
    rc = run("shard1_json", "%s plan %s -O3 %s --gpus 2 --shard-states=1 --json", fp8c, model, model_flags);
    text = slurp("shard1_json.out");
    if (rc != 0 || !strstr(text, "\"shard_stage\": 1") || !strstr(text, "\"per_gpu_grad_buffer_bytes\": 0,"))
        fail_msg("plan --json --shard-states=1: status %d\n%s", rc, text);
    free(text);
}

/* --shard-states=3 (ZeRO stage 3, runtime/comm_weights.c, cuda/exec_gather.c): build makes a
 * binary, which on one process (the CPU here) runs the unsharded step; tune refuses the flag
 * in one line; the comm pass refuses it with --grad-release and comm.overlap=0 as stage 2; the plan marks the weights 1/N, says what stays whole, counts the layer buffers in
 * the peak and lists the layers' gathers (e4m3 at -O3, bf16 at -O0), and --json says the
 * stage, the buffers and the count of gathered weights. */
static void test_shard_weights_plan_and_refusals(void **state) {
    (void)state;
    build("-O3 --gpus 2 --shard-states=3", "zero3");
    int rc = run("shard3_run", "%s/zero3 --data %s --steps 2", tmp_dir, data);
    char *ran = slurp("shard3_run.out");
    if (rc != 0 || !strstr(ran, "step 2/2"))
        fail_msg("a --shard-states=3 binary on one process: status %d\n%s", rc, ran);
    free(ran);
    rc = run("shard3_tune", "%s tune %s -O3 %s --gpus 2 --shard-states=3 -o %s/x.tune", fp8c, model,
             model_flags, tmp_dir);
    expect_one_line("shard3_tune", 2, "--shard-states=3 --tune FILE", rc);
    rc = run("shard3_release", "%s plan %s -O3 %s --gpus 2 --shard-states=3 --grad-release", fp8c, model,
             model_flags);
    expect_pass_error("shard3_release", "--shard-states=3 keeps each gradient only as its shard's sum", rc);
    rc = run("shard3_after", "%s plan %s -O3 %s --gpus 2 --shard-states=3 --choice comm.overlap=0", fp8c,
             model, model_flags);
    expect_pass_error("shard3_after", "comm.overlap=0 reduces them after it", rc);
    const char *levels[2][3] = {{"-O3", "all_gather (layers, FP8)", "e4m3"},
                                {"-O0", "all_gather (layers, bf16)", "bf16"}};
    for (int k = 0; k < 2; k++) {
        rc = run("shard3_plan", "%s plan %s %s %s --gpus 2 --shard-states=3", fp8c, model, levels[k][0],
                 model_flags);
        char *text = slurp("shard3_plan.out");
        const char *coll = strstr(text, levels[k][1]);
        if (rc != 0 || !strstr(text, "ZeRO stage 3") || !strstr(text, "of layer buffers") || !coll ||
            !strstr(coll, levels[k][2]) || strstr(coll, levels[k][2]) > strchr(coll, '\n') ||
            !strstr(text, "stay whole") || !strstr(text, "all_gather (whole params)"))
            fail_msg("plan %s --gpus 2 --shard-states=3: status %d\n%s", levels[k][0], rc, text);
        const char *w = strstr(text, "  weights ");
        if (!w || !strstr(w, "(1/N)") || strstr(w, "(1/N)") > strchr(w, '\n'))
            fail_msg("plan --shard-states=3: the weights are not marked 1/N:\n%s", text);
        free(text);
    }
    rc = run("shard3_json", "%s plan %s -O3 %s --gpus 2 --shard-states=3 --json", fp8c, model, model_flags);
    char *text = slurp("shard3_json.out");
    const char *buf = strstr(text, "\"per_gpu_gather_buffer_bytes\": ");
    const char *n = strstr(text, "\"gathered_weights\": ");
    if (rc != 0 || !strstr(text, "\"shard_stage\": 3") || !buf || atoll(buf + 31) <= 0 || !n ||
        atoi(n + 20) <= 0 || !strstr(text, "all_gather (layers, FP8)"))
        fail_msg("plan --json --shard-states=3: status %d\n%s", rc, text);
    free(text);
}

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
        cmocka_unit_test_setup_teardown(test_shard_states_plan_and_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shard_grads_plan_and_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shard_weights_plan_and_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fp8_reduction_bound, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fp8_reduction_special_values, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plan_of_the_fp8_reduction, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
