/* compiler.h — the compiler's front end, pipeline and emitter.
 *
 * Sections: ast.c (the syntax tree), lexer.l/parser.y (text -> AST), the lowering (AST ->
 * forward IR: lower_program.c, lower.c, builtins.c, lower_values.c; their shared lower.h),
 * pipeline.c (the whole compiler in one function), emit.c (artifact + training binary),
 * cache.c (whole binaries cached by their inputs). */
#ifndef FP8C_COMPILER_H
#define FP8C_COMPILER_H

#include "ir.h"
#include "passes.h"

/* ---------------------------------------------------------------- lower_program.c */

/* `-D name=value` from the command line. */
typedef struct {
    const char *name;
    const char *value;
} Define;

typedef struct {
    int64_t batch, seq;        /* bind the symbolic sizes B and T; 0 = not given */
    const Define *defines;
    int n_defines;
} FrontOptions;

/* Reads, parses and lowers a model file into a forward graph whose loss node is named "loss"
 * (role ROLE_OUTPUT). Returns NULL after reporting every error it found through diag_error. */
Graph *front_compile_file(Arena *a, const char *path, const FrontOptions *o);
Graph *front_compile_text(Arena *a, const char *path, const char *text, const FrontOptions *o);

/* ---------------------------------------------------------------- pipeline.c */

typedef struct {
    FrontOptions front;
    PassOptions passes;
    const char *stop_after;    /* run the pipeline up to and including this pass, NULL: all */
    const Choice *choices;     /* the kernel program's choices (a tuning record's winners, or
                                  forced with --choice), copied into the graph's table first */
    int n_choices;
} BuildOptions;

/* Model file -> fully planned graph (forward, backward, update, formats, schedule, memory). */
Graph *pipeline_compile(Arena *a, const char *path, const BuildOptions *o);

/* ---------------------------------------------------------------- plan.c */

/* `fp8c plan`: the per-tensor precision and memory table of a compiled graph, totals per
 * category, bytes per parameter of persistent state and the step's peak (the numbers the
 * runtime allocates). plan_print_diff sets two plans side by side (a: baseline, b: new). */
void plan_print(const Graph *g, bool json, FILE *out);
void plan_print_diff(const Graph *a, const Graph *b, bool json, FILE *out);
/* `fp8c plan --kernels --device cuda|cpu`: the kernel program the training binary runs on that
 * device, a line per kernel (cuda/program.c, codegen's cg_program_print_table). False after a
 * message on stderr when this fp8c has no such backend or the graph cannot run there. */
bool plan_print_kernels(const Graph *g, const char *device, FILE *out);

/* ---------------------------------------------------------------- emit.c */

/* A build says what each stage did and how long it took, one line per stage on stderr
 * ("fp8c: link 0.8 s"), so that a long build is never silent. */
double build_clock(void);   /* seconds, monotonic */
void build_progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
bool build_no_cache(void);  /* FP8C_NO_CACHE set (and not 0): no cache is read or written */

/* Writes a training binary at out_path: the runtime linked with the graph's textual IR
 * embedded as its artifact. Returns false after printing one line naming what failed. */
bool emit_training_binary(const Graph *g, const char *out_path);
/* The CPU the binary's kernels are compiled for (an LLVM CPU name such as "x86-64-v3");
 * NULL or "native": this machine's (the default, or $FP8C_CPU). */
void emit_set_cpu(const char *cpu);
void emit_set_print_kernels(bool on);   /* build: print the CPU kernel IR to stdout */
/* `fp8c train`: a binary in a new temp directory (NULL after a message), named after the model
 * (else "train"), run with run_args; emit_train_run removes the binary and the directory, frees
 * both paths and returns the binary's exit status. */
char *emit_train_dir(void);
char *emit_train_path(const char *dir, const char *model_name);
int emit_train_run(char *dir, char *bin, char **run_args, int n_run_args);
/* What a binary is linked from and with (for cache.c's key), and the notes (lines without
 * the "fp8c: note: " prefix) the last emit_training_binary printed. */
const char *const *emit_runtime_libs(int *n);   /* file names in emit_libdir() */
const char *emit_libdir(void);
const char *emit_compiler(void);
const char *emit_notes(void);

/* ---------------------------------------------------------------- cache.c */

/* The figures of the final `fp8c: wrote` line, which a cached build prints without a graph. */
typedef struct {
    int opt_level;
    long long batch, seq, n_params;
    long long persistent, transient;   /* bytes */
    char model_name[64];               /* `fp8c train` names the binary after it */
} BuildSummary;

/* The key of the binary that `fp8c build` with these flags (the arguments after the command)
 * makes, as 64 hex digits: a SHA-256 of fp8c, the flags and the files they name, the FP8C_*
 * environment, the runtime libraries and the tools. False when one of them cannot be read. */
bool cache_make_key(char **flags, int n_flags, char key[65]);
/* CACHE_HIT: the binary written at out_path, its notes printed, *summary filled. CACHE_MISS
 * also for an entry that does not check out (which is removed); CACHE_FAILED after a message
 * when the output cannot be written. */
typedef enum { CACHE_MISS, CACHE_HIT, CACHE_FAILED } CacheResult;
CacheResult cache_fetch_binary(const char *key, const char *out_path, BuildSummary *summary);
/* Keeps a copy of the binary at bin_path under key; silent when it cannot. */
void cache_store_binary(const char *key, const char *bin_path, const BuildSummary *s,
                        const char *notes);
void cache_sha256_hex(const void *data, size_t n, char hex[65]);
/* The readable file a flag's word names, or NULL: the word itself (`--policy rules.txt` gives
 * the path as a word of its own), else the value of a `--flag=VALUE` word, so that both
 * spellings key a binary or a tuning record by the file's contents. */
const char *cache_flag_file(const char *word);

/* ---------------------------------------------------------------- tune_record.c */

/* A tuning record (docs/tuning.md): the choice points of one model's kernel program on one
 * device, each with its candidates, their times and the winner. */
#define TUNE_RECORD_FORMAT 1
#define TUNE_MAX_CANDIDATES 48
#define TUNE_MAX_POINTS 512     /* a record's points, as fp8c tune allocates them */
#define TUNE_VALUE_LEN 160     /* a GEMM algorithm is 128 hex digits */

typedef struct {
    char value[TUNE_VALUE_LEN];
    char label[96];            /* for people: a GEMM algorithm's id, tile and stages */
    double median, min, max;   /* step ms (a GEMM's: us); < 0: not measured */
    double max_rel_diff;       /* against the default's result; < 0: not compared */
    int64_t peak;              /* the memory plan's peak with it, bytes; 0: not built */
    bool ok;                   /* ran, agreed with the default within the tolerance, and fit */
    char note[128];            /* why not */
} TuneCandidate;

typedef struct {
    char name[96];             /* the choice table's name (ir_choice) */
    char what[128];
    char dflt[TUNE_VALUE_LEN]; /* the default rule's value, as the candidates spell it */
    char winner[TUNE_VALUE_LEN];
    bool measured;             /* false: the budget ran out first; the default stays */
    bool per_gemm;             /* times are one GEMM's, in us, not a step's */
    TuneCandidate cand[TUNE_MAX_CANDIDATES];
    int n_cand;
} TunePoint;

typedef struct {
    char fp8c_version[32];
    char device_kind[8];       /* "cpu" or "cuda" */
    char device_id[17];        /* tune_device_fingerprint of the description */
    char device_description[512];
    char model_file[512], model_flags[1024], model_hash[65];
    int steps, warmup;
    double tolerance, budget_s, elapsed_s;
    double memory_budget;      /* bytes of the memory plan's peak; 0: none */
    double default_ms, tuned_ms;   /* the median step with every default, with every winner */
    int64_t default_peak, tuned_peak;   /* the memory plan's peak of each, bytes */
    TunePoint *points;         /* malloc'ed */
    int n_points;
} TuneRecord;

/* The model key: a SHA-256 of the model file's text and the flags that shape the graph (hex);
 * shown gets those flags as a line. False after a message. */
bool tune_model_key(const char *model, char **flags, int n_flags, char hex[65], char *shown,
                    size_t shown_len);
void tune_device_fingerprint(const char *description, char out[17]);
bool tune_cpu_description(char *out, size_t len);
/* The fingerprint of this machine's device of that kind ("cpu", "cuda") in id, or NULL when
 * there is none to ask (no GPU here: the binary checks when it starts). */
const char *tune_current_device(const char *kind, char id[17]);
bool tune_record_write(const TuneRecord *r, const char *path);   /* false after a message */
bool tune_record_read(const char *path, TuneRecord *r);          /* false after one line */
void tune_record_free(TuneRecord *r);
/* NULL when the record fits; else which key differs ("device", "model", "fp8c version") with
 * the details in why. device_id NULL: the device is not known here (not compared). */
const char *tune_record_mismatch(const TuneRecord *r, const char *model_hash, const char *version,
                                 const char *device_id, char *why, size_t why_len);
/* The winners that differ from the defaults (and every GEMM's algorithm), plus tune.device, as
 * choice table entries pointing into r; returns how many. */
int tune_record_choices(const TuneRecord *r, Choice *out, int cap);

/* ---------------------------------------------------------------- tune.c */

/* `fp8c tune`: what to measure, and how the command builds a binary with given choices (the
 * driver's make_binary, with `--choice` entries added to its cache key). */
typedef struct {
    const char *model, *device, *output, *version;
    char **flags;              /* the command's flags (the model key) */
    int n_flags;
    double budget_s, tolerance;
    double memory_budget;      /* --memory-budget, bytes of the memory plan's peak; 0: none */
    int steps, warmup;         /* steps a run logs; the first `warmup` are not timed */
    int64_t tokens_per_step;
    int64_t default_chunks;    /* the loss's chunk count by the default rule */
    int attention_y_default;   /* save.attention_y's default at the level, -1: not a point
                                  (no attention, or activations not saved in FP8) */
    int attention_inputs_default;   /* save.attention_inputs's default at the level */
    int cheap_default;              /* save.cheap's default at the level */
    int weight_amax_default;        /* scale.weight_amax's default, -1: not a point (the level
                                       keeps FP8 weight copies, or none per use) */
    int64_t state_bytes;            /* the defaults' persistent state in the memory plan: what a
                                       GPU binary's host mirror fills (its step arena it does not) */
    bool (*build)(void *ctx, const Choice *choices, int n, const char *out, int64_t *peak);
    void *ctx;
} TuneRequest;
/* Measures, writes q->output (never over an existing file); returns the exit status. */
int tune_run(const TuneRequest *q);
/* The build-time candidates tune_run would build for q, besides the defaults, as the argument
 * of a --choice, one a line: what a machine without the device can compile ahead (the GPU
 * modules, cached). Measures nothing; returns the exit status. */
int tune_list_candidates(const TuneRequest *q, FILE *out);
/* How many build-time candidates tune_run starts ahead on `device`: as many as keep every
 * started binary's host state (state_bytes each, the running one's included) within half of
 * host_bytes, at most 3; 0 off the GPU. */
int tune_ahead_count(const char *device, double host_bytes, double state_bytes);
/* Reads the GEMM report of a binary's tuning mode (FP8C_TUNE_GEMMS, cuda/exec_gemm.c) into r:
 * its device, and a point per GEMM problem with its winner picked. r->points holds
 * TUNE_MAX_POINTS. False after a message. */
bool tune_gemm_report_read(const char *path, TuneRecord *r);

#endif
