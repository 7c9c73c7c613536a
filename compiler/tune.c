/* tune.c — `fp8c tune`: the kernel program's choices, measured on the device and recorded.
 *
 * The compiler decides the kernel program by rules (how many chunks the loss runs in, which
 * producers quantize their own output, which GEMMs take their epilogue), and the runtime by
 * defaults (the threads, the CPU's tile path, cuBLASLt's first heuristic algorithm). Rules are
 * right on average; a measurement on the device at the real shapes is right for this model.
 * This file measures and writes the tuning record (tune_record.c); `fp8c build --tune FILE`
 * then builds with the winners, and the binary runs them with no timing of its own.
 *
 * How a candidate is measured: the training binary itself runs a few steps on a fixed text (a
 * deterministic pseudo-random byte stream, so that every run trains on the same batches from
 * the same initial weights), logging every step's time and loss (--log, JSON lines). The first
 * `warmup` steps are dropped; the median of the rest is the candidate's time, their minimum and
 * maximum its spread. The defaults are timed again as the measurement goes on (a machine's
 * speed drifts over minutes, and a shared one's more): a run-time point's default beside its
 * other candidates; a build-time point's default binary where its latest timing is more than a
 * minute old (TUNE_DEFAULT_FRESH_S), so that each candidate is compared with a default timed
 * within about a minute of it, and the default is not timed once per point (on an H200, GPT-2
 * d12's 29 build-time points spent 29 of their 59 runs, 7 s each, on the default); and the
 * default binary beside the final one with every winner. Its losses are compared with the default's, step by step: a candidate
 * whose relative difference exceeds the tolerance is recorded as not ok and cannot win. A
 * candidate wins only when its median beats the default's by more than the noise (both
 * spreads' larger half-width, and at least 1%): otherwise the default stays, so that a record
 * never trades a known rule for a coin toss.
 *
 * The choice points (names as in the choice table, ir_choice; docs/tuning.md):
 *  - run-time choices, timed on one binary through the environment that overrides them:
 *    cpu.threads, cpu.tiles, cpu.task_work (runtime/tune.c);
 *  - on a GPU, the cuBLASLt algorithm of every GEMM problem: the binary's tuning mode
 *    (FP8C_TUNE_GEMMS=FILE, cuda/exec_gemm.c) times a wide heuristic list on the real operands,
 *    then checks the output of those that could win here (rt_tune_could_win: determinism, and
 *    the error against the default's), and reports them per GEMM, the unchecked ones not ok;
 *  - build-time choices, one binary per candidate: loss.chunks (passes/chunk_loss.c), where the
 *    level saves activations in FP8 whether attention's output is saved or its forward rerun
 *    in the backward (save.attention_y, passes/precision.c), cheap producers saved or made
 *    again in the backward (save.cheap, passes/recompute.c), on the CPU the size of a fused
 *    kernel (fuse.members, codegen/fuse.c), and, on a GPU, each fusion of the CUDA plan on or off (fuse.*, cuda/spec_fuse.c), the attention
 *    forward's kernel (attn.wgmma, cuda/spec_ops.c), the loss's row blocks (ce.threads,
 *    ce.exp2, cuda/spec_ops.c) and the kernels' launches (cuda.pdl, cuda/exec.c).
 * Each point is measured against the defaults of all the others, one at a time; the winners
 * are then built together and timed once more (the record's tuned_step_ms), and that build's
 * losses are checked too. Points are taken cheapest first, and when the budget (--budget
 * seconds) runs out the remaining ones keep their defaults, marked as not measured.
 *
 * With --memory-budget GiB a candidate whose memory plan peaks above the budget is not run and
 * cannot win, and a default above it loses to the fastest candidate that fits; when the
 * winners together still do not fit, each point's candidate of the smallest peak is taken
 * instead, and when even that set does not fit, one line says the smallest peak reached.
 *
 * On a GPU a build-time candidate's binary spends most of its run making its training state
 * on the host (GPT-2 1.5B: drawing 1.5 billion weights, encoding masters and states), which
 * the GPU does not need: so while one candidate runs, the next one is built and started with
 * --start-after, makes its state on all but two of the host's cores and waits; the file that
 * lets it on the device is made once the one before it has ended. A point's default that will
 * need timing again by its turn is started ahead the same way (the default binary, queued in
 * its place): set up from scratch, GPT-2 d48's default took 31-54 s a re-timing where a
 * candidate started ahead took 6-8 s. One binary on the GPU at a time, as before; the CPU's
 * candidates, whose steps would share the host, run one by one.
 *
 * Progress goes to stderr, a line per candidate: which point, how many are left, the time so
 * far. */
#include "compiler.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "rt.h"

#define TUNE_MAX_STEPS 64
#define TUNE_MAX_CHOICES 1024
#define TUNE_BUILD_POINTS 48   /* build_points' most */
/* a build-time point's default reuses the default binary's latest timing if it is this recent */
#define TUNE_DEFAULT_FRESH_S 60.0
/* build-time candidates started ahead at most (ahead_count) */
#define TUNE_AHEAD_MAX 3

/* One timed run of a binary. */
typedef struct {
    bool ran;
    int n;                          /* steps logged */
    double ms[TUNE_MAX_STEPS], loss[TUNE_MAX_STEPS];
    double median, min, max;        /* over the steps after the warm-up */
} Run;

/* A started binary: its process, files, and (--start-after) the file that lets it on */
typedef struct {
    pid_t pid;                      /* 0: none */
    char *log, *out, *gate, *bin;   /* bin: a candidate's own binary, removed at the end */
    bool on;                        /* let on the device (its gate made) */
    const char *point, *value;      /* the candidate it is (a started-ahead one) */
    int64_t peak;
} Started;

typedef struct {
    const TuneRequest *q;
    char *dir, *data;
    int n_runs;
    double t0;
    Run base;                       /* every default */
    int64_t base_peak;              /* its memory plan's peak, bytes */
    Run recent;                     /* the default binary's latest timing, at recent_at s */
    double recent_at;
    Started ahead[TUNE_AHEAD_MAX];  /* the next build-time candidates in order, started and waiting */
    int n_ahead, ahead_b, ahead_i;  /* how many; the point and value of the last */
    const char *base_bin;           /* the default binary (a default's re-timing started ahead) */
    double pace;                    /* seconds a run let on lasts, the latest; 0: none yet */
    TuneRecord rec;
} Tuner;

static bool fits(const Tuner *t, int64_t peak) { return !t->q->memory_budget || (double)peak <= t->q->memory_budget; }

/* bytes for people: GiB from 1 GiB up, else MiB */
typedef struct { char s[32]; } Size;
static Size size_of(double bytes)
{
    Size z;
    if (bytes >= 1073741824.0) snprintf(z.s, sizeof z.s, "%.2f GiB", bytes / 1073741824.0);
    else snprintf(z.s, sizeof z.s, "%.1f MiB", bytes / 1048576.0);
    return z;
}

static char *tune_path(const Tuner *t, const char *name)
{
    size_t n = strlen(t->dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", t->dir, name);
    return p;
}

/* The text every run trains on: bytes of a fixed xorshift stream, enough for the steps. */
static bool write_data(const char *path, int64_t bytes)
{
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < bytes; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        fputc((int)(x >> 56), f);
    }
    return fclose(f) == 0;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Starts bin for the tuner's steps with env (NAME=VALUE strings) added; its output goes to a
 * file whose tail is shown when the run fails. gated: with --start-after, to wait, its state
 * made, until finish_binary lets it on the device. On a GPU every run takes cuBLASLt's first heuristic
 * algorithm for each GEMM (FP8C_CUDA_TUNE=0, a binary's default, set here against a user's
 * FP8C_CUDA_TUNE=1) unless env says otherwise: timing the GEMMs' candidates at start-up takes
 * seconds of each run and may pick other algorithms in each, so that a fusion's candidate
 * could win or lose by its GEMMs' luck. The
 * GEMM point measures the algorithms on its own (FP8C_TUNE_GEMMS), against that same first
 * choice, which is also what the record keeps where no algorithm wins. */
static bool start_binary(Tuner *t, const char *bin, const char *const *env, int n_env, bool gated, Started *s)
{
    memset(s, 0, sizeof *s);
    char name[32];
    int k = t->n_runs++;
    snprintf(name, sizeof name, "run%d.log", k);
    s->log = tune_path(t, name);
    snprintf(name, sizeof name, "run%d.out", k);
    s->out = tune_path(t, name);
    if (gated) {
        snprintf(name, sizeof name, "run%d.go", k);
        s->gate = tune_path(t, name);
    }
    char steps[16], threads[24];
    snprintf(steps, sizeof steps, "%d", t->q->steps);
    char *argv[24] = {(char *)bin, "--data", t->data, "--steps", steps, "--log", s->log, "--eval-every", "0",
                      "--eval-batches", "1", "--device", (char *)t->q->device, "--seed", "1"};
    int argc = 0;
    while (argv[argc]) argc++;
    if (gated) {
        /* it makes its state beside a running binary: two of the host's cores left to that one */
        int cores = ref_cpu_count();
        snprintf(threads, sizeof threads, "%d", cores > 4 ? cores - 2 : 1);
        argv[argc++] = "--start-after";
        argv[argc++] = s->gate;
        argv[argc++] = "--threads";
        argv[argc++] = threads;
    }
    argv[argc] = NULL;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(s->out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        if (!strcmp(t->q->device, "cuda")) putenv("FP8C_CUDA_TUNE=0");
        for (int i = 0; i < n_env; i++) putenv((char *)env[i]);
        execv(bin, argv);
        _exit(127);
    }
    s->pid = pid > 0 ? pid : -1;
    return pid > 0;
}

/* A started binary's files removed and its names freed, once its process has ended. */
static void forget_binary(Started *s)
{
    char *files[4] = {s->log, s->out, s->gate, s->bin};
    for (int i = 0; i < 4; i++) {
        if (files[i]) unlink(files[i]);
        free(files[i]);
    }
    memset(s, 0, sizeof *s);
}

/* Lets a started binary on the device: makes its --start-after file, once. False if it
 * cannot. */
static bool let_on(Started *s)
{
    if (!s->gate || s->pid <= 0 || s->on) return s->pid > 0;
    FILE *go = fopen(s->gate, "w");
    s->on = go && fclose(go) == 0;
    return s->on;
}

/* Lets a started binary on, waits for it, and reads its log into r. */
static bool finish_binary(Tuner *t, Started *s, Run *r)
{
    memset(r, 0, sizeof *r);
    int status = 0;
    bool ok = let_on(s);
    if (!ok && s->pid > 0) kill(s->pid, SIGTERM);
    while (s->pid > 0 && waitpid(s->pid, &status, 0) < 0)
        if (errno != EINTR) ok = false;
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    FILE *f = fopen(s->log, "r");
    char line[1024];
    while (f && r->n < TUNE_MAX_STEPS && fgets(line, sizeof line, f)) {
        const char *ms = strstr(line, "\"ms\":"), *loss = strstr(line, "\"loss\":");
        if (!ms || !loss) continue;
        r->ms[r->n] = strtod(ms + 5, NULL);
        r->loss[r->n] = strncmp(loss + 7, "null", 4) ? strtod(loss + 7, NULL) : NAN;
        r->n++;
    }
    if (f) fclose(f);
    int from = t->q->warmup < r->n ? t->q->warmup : 0;
    if (ok && r->n > from) {
        double sorted[TUNE_MAX_STEPS];
        int k = r->n - from;
        memcpy(sorted, r->ms + from, sizeof *sorted * (size_t)k);
        qsort(sorted, (size_t)k, sizeof *sorted, compare_doubles);
        r->median = k % 2 ? sorted[k / 2] : (sorted[k / 2 - 1] + sorted[k / 2]) / 2;
        r->min = sorted[0];
        r->max = sorted[k - 1];
        r->ran = true;
    } else {
        fprintf(stderr, "fp8c: tune: %s did not run (exit status %d); its last lines:\n", s->bin ? s->bin : "a binary",
                WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        FILE *o = fopen(s->out, "r");
        char tail[8][512];
        int n = 0;
        while (o && fgets(tail[n % 8], sizeof tail[0], o)) n++;
        for (int i = n > 8 ? n - 8 : 0; i < n; i++) fprintf(stderr, "  %s", tail[i % 8]);
        if (o) fclose(o);
    }
    forget_binary(s);
    return r->ran;
}

/* A started binary not to be run after all: ended, its files removed. */
static void drop_binary(Started *s)
{
    if (s->pid > 0) {
        kill(s->pid, SIGTERM);
        while (waitpid(s->pid, NULL, 0) < 0 && errno == EINTR) {}
    }
    forget_binary(s);
}

/* Runs bin for the tuner's steps with env (NAME=VALUE strings) added, at once. */
static bool run_binary(Tuner *t, const char *bin, const char *const *env, int n_env, Run *r)
{
    Started s;
    start_binary(t, bin, env, n_env, false, &s);
    return finish_binary(t, &s, r);
}

/* The largest relative difference of r's losses from the default run's. */
static double loss_diff(const Run *base, const Run *r)
{
    double worst = 0;
    int n = base->n < r->n ? base->n : r->n;
    if (n < base->n) return INFINITY;
    for (int i = 0; i < n; i++) {
        double a = base->loss[i], b = r->loss[i];
        if (isnan(a) != isnan(b)) return INFINITY;
        if (isnan(a)) continue;
        double d = fabs(a - b) / fmax(fabs(a), 1e-6);
        if (d > worst) worst = d;
    }
    return worst;
}

static double elapsed(const Tuner *t) { return build_clock() - t->t0; }

static TunePoint *add_point(TuneRecord *r, const char *name, const char *what, const char *dflt)
{
    if (r->n_points == TUNE_MAX_POINTS) return NULL;
    TunePoint *p = &r->points[r->n_points++];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    snprintf(p->what, sizeof p->what, "%s", what);
    snprintf(p->dflt, sizeof p->dflt, "%s", dflt);
    snprintf(p->winner, sizeof p->winner, "%s", dflt);
    return p;
}

static TuneCandidate *add_candidate(TunePoint *p, const char *value)
{
    for (int i = 0; i < p->n_cand; i++)
        if (!strcmp(p->cand[i].value, value)) return NULL;
    if (p->n_cand == TUNE_MAX_CANDIDATES) return NULL;
    TuneCandidate *c = &p->cand[p->n_cand++];
    memset(c, 0, sizeof *c);
    snprintf(c->value, sizeof c->value, "%s", value);
    c->median = c->min = c->max = -1;
    return c;
}

static void fill_candidate(TuneCandidate *c, const Run *r, const Run *base, double tolerance)
{
    if (!r->ran) {
        snprintf(c->note, sizeof c->note, "did not run");
        return;
    }
    c->median = r->median, c->min = r->min, c->max = r->max;
    c->max_rel_diff = loss_diff(base, r);
    c->ok = c->max_rel_diff <= tolerance;
    if (!c->ok) snprintf(c->note, sizeof c->note, "losses differ from the default's by %.3g", c->max_rel_diff);
}

/* The winner: the fastest ok candidate, if it beats the default by more than the noise
 * (rt_tune_noise; the GEMM tuning mode checks only the candidates this can pick). */
static void pick_winner(TunePoint *p)
{
    const TuneCandidate *def = NULL, *best = NULL;
    for (int i = 0; i < p->n_cand; i++) {
        const TuneCandidate *c = &p->cand[i];
        if (!strcmp(c->value, p->dflt)) def = c;
        if (c->ok && c->median >= 0 && (!best || c->median < best->median)) best = c;
    }
    snprintf(p->winner, sizeof p->winner, "%s", p->dflt);
    if (best && def && !def->ok) {   /* the default does not fit the memory budget */
        snprintf(p->winner, sizeof p->winner, "%s", best->value);
        return;
    }
    if (!best || !def || best == def || def->median < 0) return;
    TuneTime d = {def->median, def->min, def->max}, b = {best->median, best->min, best->max};
    if (def->median - best->median > rt_tune_noise(d, b)) snprintf(p->winner, sizeof p->winner, "%s", best->value);
}

static void progress(const Tuner *t, const TunePoint *p, const TuneCandidate *c, int left)
{
    if (c->median >= 0)
        build_progress("tune: %s=%s: %.2f ms (%.2f..%.2f), loss diff %.2g%s; %d left, %.0f s", p->name,
                       c->label[0] ? c->label : c->value, c->median, c->min, c->max, c->max_rel_diff,
                       c->ok ? "" : " (rejected)", left, elapsed(t));
    else
        build_progress("tune: %s=%s: %s; %d left, %.0f s", p->name, c->value, c->note, left, elapsed(t));
}

/* ---------------------------------------------------------------- run-time points */

typedef struct {
    const char *name, *what, *env;
    char dflt[32];
    char values[8][32];
    int n;
} EnvPoint;

static int env_points(const Tuner *t, EnvPoint *out)
{
    int n = 0;
    if (strcmp(t->q->device, "cpu")) return 0;
    long cpus = ref_cpu_count();
    EnvPoint *p = &out[n++];
    *p = (EnvPoint){.name = "cpu.threads", .what = "threads of the CPU kernels and GEMMs", .env = "FP8C_THREADS"};
    snprintf(p->dflt, sizeof p->dflt, "%ld", cpus);
    for (long k = cpus; k >= 1 && p->n < 4; k = k > 1 ? k / 2 : 0) snprintf(p->values[p->n++], 32, "%ld", k);

    char desc[512];
    tune_cpu_description(desc, sizeof desc);
    bool amx = strstr(desc, " amx_tile") && strstr(desc, " avx512f");
    bool dot = strstr(desc, " avx512_bf16") != NULL;
    p = &out[n++];
    *p = (EnvPoint){.name = "cpu.tiles", .what = "tile path of the CPU GEMMs and attention", .env = "FP8C_CPU_TILES"};
    snprintf(p->dflt, sizeof p->dflt, "%s", amx ? "amx" : dot ? "bf16dot" : "off");
    if (amx) snprintf(p->values[p->n++], 32, "amx");
    if (dot) snprintf(p->values[p->n++], 32, "bf16dot");
    snprintf(p->values[p->n++], 32, "off");
    if (p->n < 2) n--;   /* one path: nothing to choose */

    p = &out[n++];
    *p = (EnvPoint){.name = "cpu.task_work", .what = "operations per task of the CPU loop kernels",
                    .env = "FP8C_CPU_TASK_WORK"};
    snprintf(p->dflt, sizeof p->dflt, "16384");
    static const char *const work[] = {"16384", "4096", "65536"};
    for (int i = 0; i < 3; i++) snprintf(p->values[p->n++], 32, "%s", work[i]);
    return n;
}

static void measure_env_point(Tuner *t, const char *bin, const EnvPoint *e, int *left)
{
    TunePoint *p = add_point(&t->rec, e->name, e->what, e->dflt);
    if (!p) return;
    for (int i = 0; i < e->n; i++) {
        TuneCandidate *c = add_candidate(p, e->values[i]);
        if (!c) continue;
        c->peak = t->base_peak;   /* run-time choices leave the memory plan as it is */
        (*left)--;
        if (elapsed(t) > t->q->budget_s) {
            snprintf(c->note, sizeof c->note, "not measured: the budget ran out");
            progress(t, p, c, *left);
            continue;
        } else {   /* the default too, set explicitly: timed beside its rivals */
            char env[96];
            snprintf(env, sizeof env, "%s=%s", e->env, e->values[i]);
            const char *envs[] = {env};
            Run r;
            run_binary(t, bin, envs, 1, &r);
            fill_candidate(c, &r, &t->base, t->q->tolerance);
        }
        p->measured = true;
        progress(t, p, c, *left);
    }
    pick_winner(p);
}

/* ---------------------------------------------------------------- build-time points */

typedef struct {
    const char *name, *what;
    char dflt[32];
    char values[8][32];
    int n;
} BuildPoint;

/* A point of two values, 0 and 1, dflt first */
static void switch_point(BuildPoint *p, const char *name, const char *what, int dflt)
{
    *p = (BuildPoint){.name = name, .what = what, .n = 2};
    snprintf(p->dflt, sizeof p->dflt, "%d", dflt);
    snprintf(p->values[0], 32, "%d", dflt);
    snprintf(p->values[1], 32, "%d", !dflt);
}

static int build_points(const TuneRequest *q, BuildPoint *out)
{
    int n = 0;
    BuildPoint *p = &out[n++];
    *p = (BuildPoint){.name = "loss.chunks", .what = "row chunks of the output head and its loss"};
    int64_t d = q->default_chunks > 0 ? q->default_chunks : 1;
    snprintf(p->dflt, sizeof p->dflt, "%lld", (long long)d);
    int64_t vals[] = {d, d > 1 ? d / 2 : 2, 2 * d, d > 1 ? 1 : 4, 4 * d};
    for (int i = 0; i < 5 && p->n < 4; i++) {
        bool dup = false;
        for (int k = 0; k < p->n; k++) dup |= atoll(p->values[k]) == vals[i];
        if (!dup && vals[i] >= 1 && vals[i] <= 256) snprintf(p->values[p->n++], 32, "%lld", (long long)vals[i]);
    }
    /* attention's output saved, or the forward run again in the backward for its statistics
     * (both devices; memory against time, so a lever of --memory-budget) */
    if (q->attention_y_default >= 0)
        switch_point(&out[n++], "save.attention_y", "attention's output saved for the backward, not recomputed",
                     q->attention_y_default);
    /* cheap producers (elementwise ops, norms) saved, or made again in the backward from what
     * it keeps anyway (passes/recompute.c): memory against time, on both devices */
    switch_point(&out[n++], "save.cheap", "cheap producers saved for the backward, not recomputed", q->cheap_default);
    /* attention's q, k, v saved, or made again in the backward by their GEMMs (passes/recompute.c) */
    switch_point(&out[n++], "save.attention_inputs", "attention's q, k, v saved for the backward, not recomputed",
                 q->attention_inputs_default);
    /* a transient FP8 copy that GEMMs read both ways quantized into both layouts at once, or
     * transposed when read (passes/layout.c): both devices */
    switch_point(&out[n++], "layout.cast_transpose",
                 "a gradient's FP8 copy made in both layouts at once, not transposed when read", 1);
    /* O3's per-use weight scales from the amax the update found, or a pass over each weight
     * (passes/scaling.c): both devices, the same results */
    if (q->weight_amax_default >= 0)
        switch_point(&out[n++], "scale.weight_amax",
                     "a weight's per-use scale from the amax its update found, not a pass over it",
                     q->weight_amax_default);
    /* on the CPU, how many nodes one LLVM kernel's loop may hold (codegen/fuse.c) */
    if (!strcmp(q->device, "cpu")) {
        p = &out[n++];
        *p = (BuildPoint){.name = "fuse.members", .what = "nodes a fused kernel may hold (0: any)", .dflt = "0", .n = 3};
        snprintf(p->values[0], 32, "0");
        snprintf(p->values[1], 32, "1");
        snprintf(p->values[2], 32, "2");
    }
    if (!strcmp(q->device, "cuda")) {
        static const struct { const char *name, *what; } fusions[] = {
            {"fuse.producer_quantizes", "a layernorm or GELU writes its FP8 copy itself"},
            {"fuse.cast_transposes", "an FP8 copy's transposed copy written by its quantize"},
            {"fuse.norm_stats", "a norm's FP8 copy in both layouts by tiles, from the row statistics its pass kept"},
            {"fuse.bias_grads", "bias gradients summed inside the quantize of dy"},
            {"fuse.group_quantizes", "per-group scales made inside the quantize"},
            {"fuse.input_group_copies", "a GELU or SiLU writes its input's 1x16 group copy"},
            {"fuse.inline_elementwise", "an activation or product computed by the kernel that reads it"},
            {"fuse.ce_one_pass", "the loss's forward and backward in one pass over the logits"},
            {"fuse.ce_lse", "the loss's backward reuses the forward's logsumexp"},
            {"fuse.norm_grads", "a norm's backward in one pass over its rows"},
            {"fuse.gemm_epilogues", "bias, residual, scaling and FP8 output in the GEMM's epilogue"},
            {"fuse.gemm_gelu", "GELU in the GEMM's epilogue"},
            {"fuse.inverse_scales", "a GEMM's dequantization scales computed by an earlier launch"},
            {"fuse.attention_scales", "attention's result scale computed by its own launches"},
            {"fuse.amax_scales", "a per-tensor scale stored by the last block of its value's producer"},
            {"fuse.state_scales", "a weight copy's scale made from the stored amax by the copy itself"},
        };
        for (size_t i = 0; i < sizeof fusions / sizeof *fusions; i++) {
            p = &out[n++];
            *p = (BuildPoint){.name = fusions[i].name, .what = fusions[i].what, .dflt = "1", .n = 2};
            snprintf(p->values[0], 32, "1");
            snprintf(p->values[1], 32, "0");
        }
        /* the attention's kernels (cuda/spec_ops.c: warpgroup MMA or mma.sync, the pipelined
         * forward, the backward's blocks) and the loss's row blocks (ce_rows_chosen: below 1024
         * threads the one pass holds a vocabulary row in shared memory, two rows an SM); the
         * default first */
        static const struct { const char *name, *what, *values[4]; } kernels[] = {
            {"attn.wgmma", "the attention forward on warpgroup MMA", {"1", "0"}},
            {"attn.fwd_pipeline", "the wgmma forward's softmax overlapped with its P V product (head dim 64)",
             {"0", "1"}},
            {"attn.fwd_keys", "key tiles of the attention forward (128: a producer warpgroup, three consumers, TMA)",
             {"64", "128"}},
            {"attn.wgmma_bwd", "the attention backward's dq and dk/dv passes on warpgroup MMA", {"1", "0"}},
            {"attn.dq_rows", "query rows of a block of the attention's dq pass", {"128", "64"}},
            {"attn.dkv_rows", "keys of a block of the attention's dk/dv pass", {"64", "128"}},
            {"attn.head_group", "heads whose attention blocks run together (0: heaviest first)", {"0", "32"}},
            {"attn.dkv_split", "parts of a dk/dv step's 64 queries (2: three blocks an SM)", {"2", "1"}},
            {"attn.dkv_parts", "blocks a key tile's dk/dv steps are cut into (0: the balance rule)",
             {"0", "1", "2", "4"}},
            {"ce.threads", "threads of the loss's row blocks", {"512", "1024", "256"}},
            {"ce.exp2", "the loss's exponentials as ex2.approx", {"1", "0"}},
            {"cuda.pdl", "each kernel launched while the one before it ends (programmatic dependent launch)",
             {"0", "1"}},
            {"norm.stage", "the norms' rows staged through shared memory, the next one in flight", {"1", "0"}},
            {"norm.bwd_block", "a norm backward's rows of over 512 columns a block each (0: a warp each)", {"1", "0"}},
        };
        for (size_t i = 0; i < sizeof kernels / sizeof *kernels; i++) {
            p = &out[n++];
            *p = (BuildPoint){.name = kernels[i].name, .what = kernels[i].what};
            snprintf(p->dflt, sizeof p->dflt, "%s", kernels[i].values[0]);
            for (int k = 0; k < 4 && kernels[i].values[k]; k++) snprintf(p->values[p->n++], 32, "%s", kernels[i].values[k]);
        }
    }
    if (n > TUNE_BUILD_POINTS) ir_die(__FILE__, __LINE__, "tune: %d build points, room for %d", n, TUNE_BUILD_POINTS);
    return n;
}

/* Builds candidate `value` of point b into a binary of its own and starts it (gated: to wait
 * for its turn once its state is made); false with a note in `note` where it is not run. */
static bool start_candidate(Tuner *t, const BuildPoint *b, const char *value, bool gated, Started *s, char *note,
                            size_t note_size)
{
    memset(s, 0, sizeof *s);
    char name[64];
    snprintf(name, sizeof name, "cand%d", t->n_runs++);
    char *bin = tune_path(t, name);
    Choice ch = {b->name, value};
    int64_t peak = 0;
    bool built = bin && t->q->build(t->q->ctx, &ch, 1, bin, &peak);
    if (!built) snprintf(note, note_size, "did not build");
    else if (!fits(t, peak)) snprintf(note, note_size, "not run: its peak is over the memory budget");
    if (!built || !fits(t, peak)) {
        if (bin) unlink(bin);
        free(bin);
        s->peak = peak;
        return false;
    }
    start_binary(t, bin, NULL, 0, gated, s);
    s->bin = bin;
    s->point = b->name;
    s->value = value;
    s->peak = peak;
    return true;
}

/* How many candidates may start ahead: on a GPU, as many as keep every started binary's host
 * state (the memory plan's persistent state: a GPU run's host mirror fills that, not its step
 * arena), the running one's included, within half the host's memory, at most TUNE_AHEAD_MAX.
 * A candidate's set-up outlasts a short run: GPT-2 d48 -O1 (25 GB of state) took 20-27 s
 * before its first step and 6 s of steps, so with one started ahead every other candidate
 * waited for its own set-up; a 256 GiB host keeps three ahead, a 128 GiB one one. Judged by
 * the whole plan (41 GiB) none started at all. */
int tune_ahead_count(const char *device, double host_bytes, double state_bytes)
{
    if (strcmp(device, "cuda") || host_bytes <= 0 || state_bytes <= 0) return 0;
    double fit = host_bytes / 2 / state_bytes - 1;   /* beside the running one */
    return fit < 0 ? 0 : fit > TUNE_AHEAD_MAX ? TUNE_AHEAD_MAX : (int)fit;
}
static int ahead_count(const Tuner *t)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    double state = t->q->state_bytes > 0 ? (double)t->q->state_bytes : (double)t->base_peak;
    return pages > 0 && page > 0 ? tune_ahead_count(t->q->device, (double)pages * (double)page, state) : 0;
}
static bool ahead_ok(const Tuner *t) { return ahead_count(t) > 0; }

/* Every binary started ahead stopped and forgotten. */
static void drop_ahead(Tuner *t)
{
    for (int k = 0; k < t->n_ahead; k++) drop_binary(&t->ahead[k]);
    t->n_ahead = 0;
}

/* Whether a default reached after the runs now waiting will find the default binary's
 * latest timing older than TUNE_DEFAULT_FRESH_S: each run ahead of it, the one on the device
 * included, is taken to last as long as the latest did (t->pace), and a default waiting
 * among them times it again when its turn comes. */
static bool default_stale_at_turn(const Tuner *t)
{
    double now = elapsed(t), latest = t->recent_at;
    for (int k = 0; k < t->n_ahead; k++)
        if (!t->ahead[k].bin) latest = now + (k + 1) * t->pace;   /* a default's re-timing */
    return now + (t->n_ahead + 1) * t->pace - latest > TUNE_DEFAULT_FRESH_S;
}

/* Starts the build-time candidates after value vi of point bi, gated, while the one just let
 * on runs, until ahead_count are waiting: their state is made meanwhile. A point's default is
 * among them where it will need timing again (default_stale_at_turn): the default binary,
 * started like a candidate. Those already waiting are the next in order; new ones go after
 * the last. */
static void start_ahead(Tuner *t, const BuildPoint *builds, int n_build, int bi, int vi)
{
    int most = ahead_count(t);
    if (t->n_ahead) bi = t->ahead_b, vi = t->ahead_i;
    for (int b = bi; b < n_build; b++)
        for (int i = b == bi ? vi + 1 : 0; i < builds[b].n; i++) {
            if (t->n_ahead >= most || elapsed(t) > t->q->budget_s) return;
            Started *s = &t->ahead[t->n_ahead];
            if (!strcmp(builds[b].values[i], builds[b].dflt)) {
                if (default_stale_at_turn(t)) {
                    start_binary(t, t->base_bin, NULL, 0, true, s);
                    s->point = builds[b].name, s->value = builds[b].dflt, s->peak = t->base_peak;
                    t->n_ahead++;
                }
                t->ahead_b = b, t->ahead_i = i;
                continue;
            }
            char note[64];
            if (!start_candidate(t, &builds[b], builds[b].values[i], true, s, note, sizeof note)) {
                memset(s, 0, sizeof *s);   /* its turn builds it again and says why */
                return;
            }
            t->n_ahead++, t->ahead_b = b, t->ahead_i = i;
        }
}

/* The first waiting binary if it is value `value` of point `point`, taken off the queue into
 * s; false where the queue starts with another (or is empty). */
static bool take_ahead(Tuner *t, const char *point, const char *value, Started *s)
{
    if (!t->n_ahead || strcmp(t->ahead[0].point, point) || strcmp(t->ahead[0].value, value)) return false;
    *s = t->ahead[0];   /* started while those before ran: its state is made */
    memmove(&t->ahead[0], &t->ahead[1], sizeof t->ahead[0] * (size_t)--t->n_ahead);
    memset(&t->ahead[t->n_ahead], 0, sizeof t->ahead[0]);
    return true;
}

/* Lets s on the device, starts what can wait behind it, and reads its run into r. The length
 * of a run that waited (its state made ahead) becomes the tuner's pace. */
static void run_in_turn(Tuner *t, Started *s, bool waited, const BuildPoint *builds, int n_build, int bi, int vi,
                        Run *r)
{
    double on_at = elapsed(t);
    let_on(s);
    start_ahead(t, builds, n_build, bi, vi);
    finish_binary(t, s, r);
    if (waited) t->pace = elapsed(t) - on_at;
}

static void measure_build_point(Tuner *t, const char *base_bin, const BuildPoint *builds, int n_build, int bi,
                                int *left)
{
    const BuildPoint *b = &builds[bi];
    TunePoint *p = add_point(&t->rec, b->name, b->what, b->dflt);
    if (!p) return;
    for (int i = 0; i < b->n; i++) {
        TuneCandidate *c = add_candidate(p, b->values[i]);
        if (!c) continue;
        (*left)--;
        if (elapsed(t) > t->q->budget_s) {
            snprintf(c->note, sizeof c->note, "not measured: the budget ran out");
            progress(t, p, c, *left);
            continue;
        } else if (!strcmp(b->values[i], b->dflt)) {
            /* the default binary, timed again where it was started ahead for that, or where
             * its latest timing is older than TUNE_DEFAULT_FRESH_S */
            Started s;
            if (take_ahead(t, b->name, b->dflt, &s)) {
                run_in_turn(t, &s, true, builds, n_build, bi, i, &t->recent);
                t->recent_at = elapsed(t);
            } else if (elapsed(t) - t->recent_at > TUNE_DEFAULT_FRESH_S) {
                run_binary(t, base_bin, NULL, 0, &t->recent);   /* those waiting come after it */
                t->recent_at = elapsed(t);
            }
            fill_candidate(c, &t->recent, &t->base, t->q->tolerance);
            c->peak = t->base_peak;
        } else {
            Started s;
            Run r = {0};
            bool waited = take_ahead(t, b->name, b->values[i], &s), started = waited;
            if (!started) {
                drop_ahead(t);   /* started for other candidates (none in order) */
                started = start_candidate(t, b, b->values[i], ahead_ok(t), &s, c->note, sizeof c->note);
            }
            c->peak = s.peak;
            if (started) {
                run_in_turn(t, &s, waited, builds, n_build, bi, i, &r);
                fill_candidate(c, &r, &t->base, t->q->tolerance);
            }
        }
        if (c->ok && !fits(t, c->peak)) {
            c->ok = false;
            snprintf(c->note, sizeof c->note, "its memory plan's peak, %s, is over the budget", size_of((double)c->peak).s);
        }
        p->measured = true;
        progress(t, p, c, *left);
    }
    pick_winner(p);
}

/* Every build-time candidate but the defaults, as measure_build_point builds them: one
 * binary each. The binary of the winners together is not among them (it depends on what the
 * measurements find), nor are the run-time choices and the GEMM algorithms (no build). */
int tune_list_candidates(const TuneRequest *q, FILE *out)
{
    BuildPoint builds[TUNE_BUILD_POINTS];
    int n_build = build_points(q, builds);
    for (int i = 0; i < n_build; i++)
        for (int k = 0; k < builds[i].n; k++)
            if (strcmp(builds[i].values[k], builds[i].dflt)) fprintf(out, "%s=%s\n", builds[i].name, builds[i].values[k]);
    return fflush(out) == 0 && !ferror(out) ? 0 : 1;
}

/* ---------------------------------------------------------------- GEMM algorithms (GPU) */

/* The binary's tuning mode writes {"device": {"description"}, "gemms": [{"name", "what",
 * "default", "candidates": [{"value", "label", "median", "min", "max", "max_rel_diff", "ok",
 * "note"}]}]} (cuda/exec_gemm.c), an entry per GEMM problem (gemm.KEY: every GEMM of the step
 * with the same shapes, types, layouts, epilogue and alignments). Each becomes a point of r;
 * its winner is picked as any other's. The mode times every candidate but checks (bits of two
 * runs, error against the default) only those the winning rule could pick: the others come
 * "ok": false, with no "max_rel_diff" (kept as < 0: not compared) and a note saying so. */
bool tune_gemm_report_read(const char *path, TuneRecord *r)
{
    Jv root;
    memset(&root, 0, sizeof root);
    if (!rt_json_read(path, &root)) return false;
    const Jv *dev = rt_json_get(&root, "device"), *gemms = rt_json_get(&root, "gemms");
    const Jv *desc = rt_json_get(dev, "description");
    if (!desc || desc->kind != JV_STR || !gemms || gemms->kind != JV_ARR) {
        fprintf(stderr, "fp8c: error: %s: the binary's GEMM report lacks \"device\" or \"gemms\"\n", path);
        rt_json_free(&root);
        return false;
    }
    snprintf(r->device_description, sizeof r->device_description, "%s", desc->str);
    tune_device_fingerprint(r->device_description, r->device_id);
    for (int i = 0; i < gemms->n; i++) {
        const Jv *gv = &gemms->items[i], *name = rt_json_get(gv, "name"), *what = rt_json_get(gv, "what");
        const Jv *dflt = rt_json_get(gv, "default"), *cands = rt_json_get(gv, "candidates");
        if (!name || name->kind != JV_STR || !dflt || dflt->kind != JV_STR || !cands || cands->kind != JV_ARR ||
            !ir_choice_name_ok(name->str) || !ir_choice_value_ok(dflt->str))
            continue;
        TunePoint *p = add_point(r, name->str, what && what->kind == JV_STR ? what->str : "", dflt->str);
        if (!p) break;
        p->per_gemm = true;
        p->measured = true;
        for (int k = 0; k < cands->n; k++) {
            const Jv *cv = &cands->items[k], *val = rt_json_get(cv, "value");
            if (!val || val->kind != JV_STR || !ir_choice_value_ok(val->str)) continue;
            TuneCandidate *c = add_candidate(p, val->str);
            if (!c) continue;
            const Jv *label = rt_json_get(cv, "label"), *okv = rt_json_get(cv, "ok"), *note = rt_json_get(cv, "note");
            if (label && label->kind == JV_STR) snprintf(c->label, sizeof c->label, "%s", label->str);
            if (note && note->kind == JV_STR) snprintf(c->note, sizeof c->note, "%s", note->str);
            const Jv *x;
            if ((x = rt_json_get(cv, "median")) && x->kind == JV_NUM) c->median = x->num;
            if ((x = rt_json_get(cv, "min")) && x->kind == JV_NUM) c->min = x->num;
            if ((x = rt_json_get(cv, "max")) && x->kind == JV_NUM) c->max = x->num;
            x = rt_json_get(cv, "max_rel_diff");
            c->max_rel_diff = x && x->kind == JV_NUM ? x->num : -1;
            c->ok = okv && okv->kind == JV_BOOL && okv->num != 0 && c->median >= 0 && c->max_rel_diff >= 0;
        }
        pick_winner(p);   /* stored even when it is the default: the binary then times nothing */
    }
    rt_json_free(&root);
    return true;
}

/* The GEMM point: the default binary run once in its tuning mode (FP8C_TUNE_GEMMS), and its
 * report read into the record. */
static bool measure_gemms(Tuner *t, const char *bin)
{
    char *report = tune_path(t, "gemms.json");
    if (!report) return false;
    size_t n = strlen(report) + 32;
    char *env = malloc(n);
    if (!env) {
        free(report);
        return false;
    }
    snprintf(env, n, "FP8C_TUNE_GEMMS=%s", report);
    const char *envs[] = {env};
    Run r;
    build_progress("tune: timing every GEMM's cuBLASLt algorithms (%.0f s so far)", elapsed(t));
    int before = t->rec.n_points;
    bool ok = run_binary(t, bin, envs, 1, &r) && tune_gemm_report_read(report, &t->rec);
    if (ok)
        build_progress("tune: %d GEMMs timed on %s (%.0f s so far)", t->rec.n_points - before,
                       t->rec.device_description, elapsed(t));
    unlink(report);
    free(report);
    free(env);
    return ok;
}

/* ---------------------------------------------------------------- the command */

int tune_run(const TuneRequest *q)
{
    if (access(q->output, F_OK) == 0) {
        fprintf(stderr, "fp8c: error: %s already exists; tune writes a new record (remove it or give "
                        "another -o)\n", q->output);
        return 1;
    }
    /* the record is written at the end, after minutes of measuring: a directory it cannot be
     * written in is found before the first of them */
    char where[4096];
    snprintf(where, sizeof where, "%s", q->output);
    char *slash = strrchr(where, '/');
    if (slash) slash == where ? (void)(where[1] = 0) : (void)(*slash = 0);
    if (access(slash ? where : ".", W_OK | X_OK) != 0) {
        fprintf(stderr, "fp8c: error: %s: cannot write the record in %s: %s\n", q->output,
                slash ? where : ".", strerror(errno));
        return 1;
    }
    Tuner t = {.q = q, .t0 = build_clock()};
    TuneRecord *rec = &t.rec;
    rec->points = calloc(TUNE_MAX_POINTS, sizeof *rec->points);
    const char *base_tmp = getenv("TMPDIR");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/fp8c-tune-XXXXXX", base_tmp && *base_tmp ? base_tmp : "/tmp");
    if (!rec->points || !mkdtemp(dir)) {
        fprintf(stderr, "fp8c: error: cannot create a temp directory: %s\n", strerror(errno));
        free(rec->points);
        return 1;
    }
    t.dir = dir;
    int status = 1;
    char *base_bin = tune_path(&t, "base"), *tuned_bin = tune_path(&t, "tuned");
    t.data = tune_path(&t, "data.txt");

    snprintf(rec->fp8c_version, sizeof rec->fp8c_version, "%s", q->version);
    snprintf(rec->device_kind, sizeof rec->device_kind, "%s", q->device);
    snprintf(rec->model_file, sizeof rec->model_file, "%s", q->model);
    if (!tune_model_key(q->model, q->flags, q->n_flags, rec->model_hash, rec->model_flags, sizeof rec->model_flags))
        goto out;
    if (!strcmp(q->device, "cpu")) {
        tune_cpu_description(rec->device_description, sizeof rec->device_description);
        tune_device_fingerprint(rec->device_description, rec->device_id);
    }
    rec->steps = q->steps, rec->warmup = q->warmup, rec->tolerance = q->tolerance, rec->budget_s = q->budget_s;
    /* text for the steps, and for the evaluation at the end the last 5%: more than one batch */
    if (!write_data(t.data, q->tokens_per_step * (q->steps + 4) * 3 + 4096)) {
        fprintf(stderr, "fp8c: error: %s: cannot write the tuning data\n", t.data);
        goto out;
    }

    /* the defaults */
    build_progress("tune: building %s with the default choices", q->model);
    if (!q->build(q->ctx, NULL, 0, base_bin, &t.base_peak)) goto out;
    rec->default_peak = rec->tuned_peak = t.base_peak;
    rec->memory_budget = q->memory_budget;
    if (!fits(&t, t.base_peak))
        build_progress("tune: the defaults' memory plan peaks at %s, over the budget of %s",
                       size_of((double)t.base_peak).s, size_of(q->memory_budget).s);
    t.base_bin = base_bin;
    EnvPoint envs[8];
    BuildPoint builds[TUNE_BUILD_POINTS];
    int n_env = env_points(&t, envs), n_build = build_points(q, builds), left = 0;
    /* the first build-time candidates make their state while the defaults run (GPT-2 d48
     * -O2's first one waited 54 s for its own when started at its turn) */
    start_ahead(&t, builds, n_build, 0, -1);
    if (!strcmp(q->device, "cuda") && !measure_gemms(&t, base_bin)) goto out;
    /* a first run warms what a first run warms (page cache, clocks, the driver), untimed */
    if (!run_binary(&t, base_bin, NULL, 0, &t.base)) goto out;
    double before = elapsed(&t);
    if (!run_binary(&t, base_bin, NULL, 0, &t.base)) goto out;
    t.pace = elapsed(&t) - before;   /* with its set-up: more than a run that waited, until one has */
    rec->default_ms = t.base.median;
    t.recent = t.base;
    t.recent_at = elapsed(&t);
    build_progress("tune: defaults: %.2f ms a step (%.2f..%.2f) over %d steps; %.0f s", t.base.median,
                   t.base.min, t.base.max, t.base.n - q->warmup, elapsed(&t));

    for (int i = 0; i < n_env; i++) left += envs[i].n;
    for (int i = 0; i < n_build; i++) left += builds[i].n;
    for (int i = 0; i < n_env; i++) measure_env_point(&t, base_bin, &envs[i], &left);
    for (int i = 0; i < n_build; i++) measure_build_point(&t, base_bin, builds, n_build, i, &left);
    drop_ahead(&t);   /* started ahead of candidates the budget left unmeasured */

    /* the winners together */
    Choice *choices = calloc(TUNE_MAX_CHOICES, sizeof *choices);
    int n_choices = choices ? tune_record_choices(rec, choices, TUNE_MAX_CHOICES) : 0;
    rec->tuned_ms = rec->default_ms;
    bool any = false;
    for (int i = 0; i < rec->n_points; i++) any |= strcmp(rec->points[i].winner, rec->points[i].dflt) != 0;
    if (any || !fits(&t, t.base_peak)) {
        build_progress("tune: building with the winners");
        Run r, again;
        int64_t peak = 0;
        if (!q->build(q->ctx, choices, n_choices, tuned_bin, &peak)) {
            free(choices);
            goto out;
        }
        if (!fits(&t, peak)) {
            /* the fastest set does not fit: each point's candidate of the smallest peak */
            for (int i = 0; i < rec->n_points; i++) {
                TunePoint *p = &rec->points[i];
                const TuneCandidate *least = NULL;
                for (int k = 0; k < p->n_cand; k++)
                    if (p->cand[k].peak > 0 && (!least || p->cand[k].peak < least->peak)) least = &p->cand[k];
                if (least && least->peak < t.base_peak) snprintf(p->winner, sizeof p->winner, "%s", least->value);
            }
            n_choices = tune_record_choices(rec, choices, TUNE_MAX_CHOICES);
            build_progress("tune: the fastest set peaks at %s, over the budget; building the smallest",
                           size_of((double)peak).s);
            if (!q->build(q->ctx, choices, n_choices, tuned_bin, &peak)) {
                free(choices);
                goto out;
            }
            if (!fits(&t, peak)) {
                fprintf(stderr, "fp8c: error: nothing tried fits the memory budget of %s: the smallest memory "
                                "plan peak reached is %s (the defaults': %s); no record written\n",
                        size_of(q->memory_budget).s, size_of((double)peak).s, size_of((double)t.base_peak).s);
                free(choices);
                goto out;
            }
        }
        rec->tuned_peak = peak;
        if (!run_binary(&t, base_bin, NULL, 0, &again) || !run_binary(&t, tuned_bin, NULL, 0, &r)) {
            free(choices);
            goto out;
        }
        double d = loss_diff(&t.base, &r);
        if (d > q->tolerance) {
            fprintf(stderr, "fp8c: error: the winners together change the losses by %.3g (tolerance %g); "
                            "no record written\n", d, q->tolerance);
            free(choices);
            goto out;
        }
        rec->default_ms = again.median;   /* the two timed one after the other */
        rec->tuned_ms = r.median;
        double noise = fmax(fmax((again.max - again.min) / 2, (r.max - r.min) / 2), 0.01 * again.median);
        if (r.median - again.median > noise)
            fprintf(stderr, "fp8c: note: the winners together ran slower than the defaults (%.2f against %.2f ms "
                            "a step): the points were measured one at a time, and a busy machine's times vary; "
                            "try more --tune-steps on a quiet one\n", r.median, again.median);
        build_progress("tune: winners together: %.2f ms a step (%.2f..%.2f), peak %s; defaults %.2f ms, peak %s",
                       r.median, r.min, r.max, size_of((double)rec->tuned_peak).s, rec->default_ms,
                       size_of((double)rec->default_peak).s);
    } else {
        build_progress("tune: no candidate beat the defaults by more than the noise");
    }
    free(choices);
    rec->elapsed_s = elapsed(&t);
    if (!tune_record_write(rec, q->output)) goto out;
    fprintf(stderr, "fp8c: wrote %s: %d choice points, %.2f -> %.2f ms a step, %.0f s\n", q->output,
            rec->n_points, rec->default_ms, rec->tuned_ms, rec->elapsed_s);
    status = 0;
out:
    drop_ahead(&t);   /* a run that failed with some started */
    if (base_bin) unlink(base_bin);
    if (tuned_bin) unlink(tuned_bin);
    if (t.data) unlink(t.data);
    rmdir(dir);
    free(base_bin);
    free(tuned_bin);
    free(t.data);
    free(rec->points);
    return status;
}
