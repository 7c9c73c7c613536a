/* rt.h — the runtime: what a training binary runs. Small and stable.
 *
 * Sections: the reference executor (ref_exec.c, ref_tensor.c), parameter init (init.c), and the training
 * program's pieces (data.c, checkpoint.c, log.c, args.c, arenas.c, train.c). */
#ifndef FP8C_RT_H
#define FP8C_RT_H

#include "ir.h"

/* ---------------------------------------------------------------- ref_exec.c, ref_tensor.c
 * Plain C, one op at a time, f32 storage semantics through each tensor's Format (inputs are
 * decoded to f32, results rounded into their element type), f64 accumulation in reductions.
 * It is the ground truth the backends are tested against. Every tensor a node reads or writes
 * must be bound (Tensor.data) before it runs. */
void ref_exec_node(Node *n);
void ref_run_phase(Graph *g, Phase phase);             /* every node of `phase`, in order */
/* A micro-step: every FORWARD and BACKWARD node in list order, in one sweep. The schedule may
 * interleave them (a chunk's loss backward right after its forward) and the memory plan counts
 * on this order; evaluation runs the FORWARD nodes alone, which is safe in any plan. */
void ref_run_micro_step(Graph *g);
/* One rank's shard of an update (ADAMW, LION, SGD; --shard-states): elements [off, off+len)
 * of param, grad, states, master and FP8 copy, the shard on the tensors' groups
 * (rt_shard_of). The copy's amax (of this shard) goes to *copy_amax, not to the amax state:
 * the ranks' maximum is the tensor's, which the caller stores. */
void ref_update_shard(Node *n, int64_t off, int64_t len, float *copy_amax);
/* ref_tensor.c */
float *ref_load(const Tensor *t);                      /* decoded f32 copy; free() it */
void ref_store(Tensor *t, const float *x);             /* encode through t's format */
/* Threads the executor uses: FP8C_THREADS, else the CPUs this process may run on
 * (ref_cpu_count). Results are bit-identical whatever the count: work is split by output
 * elements, each computed in a fixed order. At most RT_MAX_THREADS (the pool's limit, and
 * --threads' range). */
#define RT_MAX_THREADS 1024
void ref_set_threads(int n);
int ref_threads(void);
/* The CPUs this process may run on: its affinity mask (taskset, a container's cpuset), not
 * every online CPU, so that two jobs given halves of a host each use its own half; at least 1. */
int ref_cpu_count(void);

/* ---------------------------------------------------------------- cpu_gemm.c, cpu_exec.c
 * The CPU backend (docs/cpu-backend.md): the kernels `fp8c build` compiled through LLVM and
 * linked into the binary, run per phase in schedule order, each over its items on the
 * reference executor's threads; GEMMs go to rt_cpu_gemm. Results do not depend on the thread
 * count. --device ref runs the reference executor instead. */
/* C (M, N, row stride ldc) = or += op(A) @ op(B), f32; A is (M, K) or (K, M) when ta, B is
 * (K, N) or (N, K) when tb, row-major with row strides lda, ldb. */
void rt_cpu_gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, bool ta,
                 const float *B, int64_t ldb, bool tb, float *C, int64_t ldc, bool accumulate);
/* The same with operands in a stored format: each element decoded and divided by `scale` (1
 * when unscaled), as ref_load reads it. elem: f32, bf16, f16, e4m3 or e5m2. */
typedef struct {
    const void *data;
    ElemType elem;
    float scale;
} RtGemmOperand;
void rt_cpu_gemm_mixed(int64_t M, int64_t N, int64_t K, RtGemmOperand A, int64_t lda, bool ta,
                       RtGemmOperand B, int64_t ldb, bool tb, float *C, int64_t ldc, bool accumulate);
/* The same, calling rows_done(ctx, lo, hi, c) as soon as rows [lo, hi) of C are final: every
 * row once, before the GEMM returns; from the pool's task that finished the last of their
 * columns where the GEMM has a block of rows for each of its threads, else once for all rows
 * at the end, from the calling thread. c points at row lo, with C's row stride: in C, or in
 * the task's own buffer where a task makes whole rows (C itself is then never written; a
 * caller that passes rows_done reads C only through c). */
typedef void (*RtRowsDoneFn)(void *ctx, int64_t lo, int64_t hi, const float *c);
void rt_cpu_gemm_rows(int64_t M, int64_t N, int64_t K, RtGemmOperand A, int64_t lda, bool ta,
                      RtGemmOperand B, int64_t ldb, bool tb, float *C, int64_t ldc, bool accumulate,
                      RtRowsDoneFn rows_done, void *ctx);

typedef void (*RtCpuKernelFn)(void *const *bufs, int64_t lo, int64_t hi);
/* A compiled program's table (the symbols codegen/llvm.c defines in the kernel object). */
typedef struct {
    uint64_t hash;
    int32_t count;
    const RtCpuKernelFn *fns;
} RtCpuKernels;
/* The kernels linked into this binary; NULL when it was built without them. */
const RtCpuKernels *rt_cpu_builtin_kernels(void);
typedef struct RtCpuExec RtCpuExec;
/* Re-lowers g (scheduled and planned; its tensors bound before each run) into the kernels
 * that were compiled, checks that they are the same (hash), allocates scratch. NULL after
 * rt_error. */
RtCpuExec *rt_cpu_exec_new(Graph *g, const RtCpuKernels *k);
void rt_cpu_run_phase(RtCpuExec *x, Phase phase);
void rt_cpu_exec_free(RtCpuExec *x);
/* One kernel at a time (tests replay a step kernel by kernel): how many, the node whose value
 * kernel i completes (its group's root), and running it alone. */
int rt_cpu_kernel_count(const RtCpuExec *x);
Node *rt_cpu_kernel_root(const RtCpuExec *x, int i);
void rt_cpu_run_kernel(RtCpuExec *x, int i);
/* The device "cpu" of a binary that carries compiled kernels (register it with
 * rt_device_register); NULL when it carries none, and "cpu" is the reference executor. */
struct RtDevice;
const struct RtDevice *rt_cpu_kernels_device(void);

/* ---------------------------------------------------------------- init.c
 * Fills every PARAM per its init attribute (normal(0, std), zeros, ones) from a counter-based
 * generator keyed by (seed, parameter name, element index): values do not depend on node order
 * or thread count. STATE is zeroed, except scales (1) and master copies (the parameter's
 * unrounded initial value). Everything is written through the tensors' formats. */
void rt_init_params(Graph *g, uint64_t seed);
/* The same with every parameter's values from values(ctx, param, x, n), which fills x (n
 * f32, the parameter's shape, row-major) or returns false after one rt_error line; then this
 * returns false. */
typedef bool (*RtParamValuesFn)(void *ctx, const Node *param, float *x, int64_t n);
bool rt_init_params_from(Graph *g, uint64_t seed, RtParamValuesFn values, void *ctx);

/* ---------------------------------------------------------------- log.c
 * Runtime errors are one line naming the file and the problem: "PROG: error: FILE: what".
 * rt_error prints it at once and keeps it for rt_last_error (tests read it there). */
void rt_set_program_name(const char *argv0);
void rt_set_error_stream(FILE *f);                     /* NULL: stderr */
const char *rt_program_name(void);
void rt_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void rt_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void rt_set_quiet(bool quiet);                         /* rt_note silent; errors still print */
/* Flushes stdout at the end of a program: false after one rt_error line when something written
 * there was lost (a full disk), so that the program does not end with status 0 having printed
 * less than it says. */
bool rt_stdout_flush(void);
const char *rt_last_error(void);
void rt_clear_error(void);
/* The word of list (NULL-terminated) nearest to word by edit distance (adjacent swaps count
 * one), when near enough to be what was meant (fewer than 1 + len/3 edits), else NULL: the
 * "did you mean" of an unknown flag, command or name. */
const char *rt_nearest_word(const char *word, const char *const *list);

/* One optimizer step as logged: a JSON line in the --log file, a progress line on stderr. */
typedef struct {
    int64_t step, steps;
    int steps_width;            /* digits of `steps`, to keep the progress line still */
    double loss, val_loss;      /* val_loss only when has_val */
    bool has_val;
    double lr, grad_norm, tokens_per_s, ms;
    int64_t mem_bytes;          /* the plan's two arenas */
    const char *skipped;        /* why the update was skipped (non-finite loss), or NULL */
} LogRecord;

typedef struct {
    FILE *json;                 /* the --log file, NULL when none */
    const char *path;
    bool tty;                   /* stderr is a terminal: one progress line rewritten with \r */
    bool progress_open;
    bool failed;                /* a write failed (reported once); nothing more is written */
} RtLog;

bool rt_log_open(RtLog *l, const char *path, bool append);   /* path NULL: no JSON file */
/* Before a run resumed at `step` appends to the log at path: drops the lines from the first one
 * whose step is beyond it, or that a crash cut short, to the end (*dropped counts them). A
 * missing or non-regular file is left alone. False after rt_error. */
bool rt_log_trim(const char *path, int64_t step, int *dropped);
/* Before a run appends to the log at path (--resume, --eval-only): true when the file is
 * missing, empty or not a regular file, or starts as a log's first line does; else false after
 * one rt_error line, so that a checkpoint, a data file or notes given as --log are neither cut
 * by rt_log_trim nor appended to. */
bool rt_log_check_appendable(const char *path);
/* Writes the JSON line (flushed) and the progress line; false after one rt_error line when the
 * JSON line could not be written: the caller stops the run. */
bool rt_log_step(RtLog *l, const LogRecord *r);
/* --eval-only's line: step, val_loss, eval_batches, "eval_only":true. False as rt_log_step. */
bool rt_log_eval(RtLog *l, int64_t step, double val_loss, int64_t batches);
void rt_log_message(RtLog *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bool rt_log_close(RtLog *l);                                 /* false: fclose failed (reported) */

/* ---------------------------------------------------------------- data.c
 * Token sources: llm.c shards (256 x int32 header: magic, version, count; then uint16 tokens,
 * or uint32 under the second magic — llm.c's dev/data/data_common.py, HEADERS_INFO "gpt-2"
 * and "llama-3") or plain text through the byte-level tokenizer (token = byte, vocabulary
 * 256). */
#define RT_SHARD_MAGIC 20240520u
#define RT_SHARD_VERSION 1u
#define RT_SHARD32_MAGIC 20240801u
#define RT_SHARD32_VERSION 7u
#define RT_BYTE_VOCAB 256

typedef struct {
    char *path;
    uint16_t *tok;              /* the tokens in use: a view into base (NULL: tok32 instead) */
    int64_t n;
    uint16_t *base;             /* the file's tokens as read (owned unless the source is a view) */
    uint32_t *tok32, *base32;   /* the same for a shard of uint32 tokens */
    bool is_text;
} TokenShard;

typedef struct {
    TokenShard *shards;
    int n_shards;
    int64_t n_tokens;
    bool is_text;               /* every file was plain text */
    bool is_view;               /* holds tails of another source's buffers (rt_data_split_tail) */
} TokenData;

uint8_t *rt_read_file(const char *path, int64_t *size);      /* malloc'ed; NULL after rt_error */
/* Opens a regular file for reading ("rb"); a FIFO, directory or device is refused before it is
 * opened, so nothing blocks. NULL after one rt_error line "PATH: WHAT: why"; size may be NULL. */
FILE *rt_open_regular(const char *path, const char *what, int64_t *size);
void rt_byte_tokenize(const uint8_t *text, int64_t n, uint16_t *out);
/* spec: a file, a glob, or a comma-separated list of them. */
bool rt_data_open(TokenData *d, const char *spec);
/* Moves the last `frac` of train's tokens (in file order) into val, a view of train's buffers:
 * free val before train. */
bool rt_data_split_tail(TokenData *train, TokenData *val, double frac);
/* Every token must be below vocab, and the files that hold at least one window (T+1 tokens:
 * a batch row) must hold min_tokens between them; `what` names the source in the message
 * ("the training data"). */
bool rt_data_check(const TokenData *d, const char *what, int64_t window, int64_t min_tokens,
                   int64_t vocab);
void rt_data_free(TokenData *d);
bool rt_data_write_shard(const char *path, const uint16_t *tok, int64_t n);
/* Row r of a training batch: T+1 contiguous tokens from a position that is a hash of
 * (seed, step, micro, r). tokens and targets are (B, T); targets are tokens shifted by one. */
void rt_data_train_batch(const TokenData *d, uint64_t seed, int64_t step, int micro, int B, int T,
                         int32_t *tokens, int32_t *targets);
/* Fixed validation batch `index`: windows laid end to end, wrapping around. */
void rt_data_val_batch(const TokenData *d, int64_t index, int B, int T, int32_t *tokens,
                       int32_t *targets);

/* ---------------------------------------------------------------- checkpoint.c
 * safetensors files of the persistent tensors in their storage dtypes. Saves are atomic (temp
 * file + rename); loads check the header, every name, dtype, shape and offset before writing
 * into any tensor. */
typedef struct {
    char key[64];
    char value[256];
} CkptMeta;

bool rt_ckpt_save(const char *path, Tensor *const *ts, int n, const CkptMeta *meta, int n_meta);
/* The same with each tensor's bytes made when they are written: fill(ctx, i, buf) writes
 * tensor i's bytes (its shape x its dtype) into buf, or returns false after rt_error. Only one
 * tensor is held at a time (ts[i]->data is not read). */
typedef bool (*RtCkptFill)(void *ctx, int i, void *buf);
bool rt_ckpt_save_filled(const char *path, Tensor *const *ts, int n, const CkptMeta *meta,
                         int n_meta, RtCkptFill fill, void *ctx);
/* Fills ts[i]->data from the tensor of the same name; meta receives up to max_meta entries. */
bool rt_ckpt_load(const char *path, Tensor *const *ts, int n, CkptMeta *meta, int max_meta,
                  int *n_meta);
const char *rt_ckpt_meta_get(const CkptMeta *m, int n, const char *key);
/* Writes DIR/step_NNNNNN.safetensors, then DIR/latest naming it; `written` gets the path. */
bool rt_ckpt_save_step(const char *dir, int64_t step, Tensor *const *ts, int n,
                       const CkptMeta *meta, int n_meta, char *written, size_t written_len);
/* Gets DIR ready before training: makes it (and its parents), creates and removes a probe file
 * in it, and removes the temp files of saves a crash interrupted (*removed counts them). */
bool rt_ckpt_open_dir(const char *dir, int *removed);
/* Whether DIR holds a run's checkpoints: `latest` or a step_N.safetensors (its name into
 * found). False when DIR does not exist. */
bool rt_ckpt_dir_holds_run(const char *dir, char *found, size_t found_len);
/* A checkpoint file, or a directory -> the file its `latest` names. */
bool rt_ckpt_resolve(const char *path, char *out, size_t out_len);

/* Any safetensors file, read by name (Hugging Face weights): rt_st_open parses and checks the
 * header (each entry within the data, its bytes matching shape x dtype where the dtype is
 * known); rt_st_read copies one entry's raw little-endian bytes. */
#define RT_ST_MAX_META 32
typedef struct {
    char *name;
    char *dtype;                /* "F32", "BF16", ... as written */
    int rank;
    int64_t dims[IR_MAX_RANK];
    int64_t begin, end;         /* byte range in the data block */
    bool used;                  /* scratch for the reader's caller */
} RtStEntry;
typedef struct {
    char *path;
    FILE *f;
    int64_t data_start;
    RtStEntry *entries;
    int n_entries;
    CkptMeta meta[RT_ST_MAX_META];
    int n_meta;
} RtStFile;
bool rt_st_open(RtStFile *s, const char *path);
const RtStEntry *rt_st_find(const RtStFile *s, const char *name);
bool rt_st_read(const RtStFile *s, const RtStEntry *e, void *dst);
void rt_st_close(RtStFile *s);
int rt_st_dtype_bytes(const char *dtype);               /* 0: a dtype this runtime does not know */

/* ---------------------------------------------------------------- tune.c
 * The artifact's run-time choices (cpu.threads, cpu.tiles, cpu.task_work; docs/tuning.md) put
 * in place of the defaults where no flag or FP8C_* variable overrides them. False after one
 * rt_error line when a value is malformed. */
bool rt_tune_apply(const Graph *g);
/* Work per task of the CPU loop kernels (cpu_exec.c); FP8C_CPU_TASK_WORK overrides it. */
void rt_cpu_set_task_work(int64_t work);
/* A candidate's time in fp8c tune: the median of its runs and their spread; median < 0: not
 * timed. The rule a winner must pass lives here because two programs apply it: fp8c tune
 * picks winners by it (compiler/tune.c), and the binary's GEMM tuning mode (cuda/exec_gemm.c)
 * checks only the candidates it lets win. */
typedef struct {
    double median, min, max;
} TuneTime;
/* How far below the default's median a candidate's must be for it to win: more than the
 * larger half-spread of the two, and more than 1% of the default's median. */
double rt_tune_noise(TuneTime dflt, TuneTime cand);
/* The candidates of t[0..n) that can still win, fastest first (ties in t's order), into
 * order[]; returns how many. fp8c tune takes the fastest candidate that passed its checks and
 * lets it win when it beats the default by more than the noise: a candidate that does not
 * beat the default by more than the default's part of the noise (its half-spread, 1% of its
 * median) cannot win, whatever is found about the others. When the default failed its own
 * checks (dflt_ok false) the fastest candidate that passes wins at any time: every timed one
 * can. The default itself, if in t, is among them only then. */
int rt_tune_could_win(TuneTime dflt, bool dflt_ok, const TuneTime *t, int n, int *order);

/* ---------------------------------------------------------------- json.c
 * The runtime's JSON reader (config.json, a shard index, safetensors headers): a document
 * whose value is an object, as a tree. rt_json_read parses a file, rt_json_parse text in
 * memory; false after one rt_error line "PATH: bad WHAT: why at byte N". */
typedef enum { JV_NULL, JV_BOOL, JV_NUM, JV_STR, JV_ARR, JV_OBJ } JvKind;
typedef struct Jv {
    JvKind kind;
    int64_t at;                 /* byte offset of the value in the text */
    double num;                 /* JV_NUM, JV_BOOL (0 or 1) */
    bool is_int;                /* JV_NUM written as an integer that fits int64_t: i */
    int64_t i;
    char *str;                  /* JV_STR */
    int n;                      /* JV_ARR, JV_OBJ: items (and keys) */
    char **keys;
    struct Jv *items;
} Jv;
bool rt_json_read(const char *path, Jv *v);
/* The one JSON string writer of fp8c (checkpoint headers, the --log lines, `fp8c plan --json`):
 * s quoted, with '"', '\\' and control characters escaped, into dst as snprintf would (the
 * length it needs is returned, dst is cut short and terminated when cap is smaller). */
size_t rt_json_quote(char *dst, size_t cap, const char *s);
bool rt_json_write_string(FILE *f, const char *s);           /* false: the write failed */
bool rt_json_parse(const char *path, const char *what, const char *text, int64_t len, Jv *v);
const Jv *rt_json_get(const Jv *object, const char *key);   /* NULL: absent, or not an object */
void rt_json_free(Jv *v);

/* ---------------------------------------------------------------- hf.c
 * Weights from elsewhere and out to Hugging Face. rt_init_load initializes every parameter
 * (and what init.c derives from them) from PATH: a Hugging Face GPT-2 or Llama model (a
 * directory with model.safetensors or a sharded index, and config.json; or one of those
 * files) or an fp8c checkpoint (file, or a run directory's latest), weights only. Everything is
 * checked before a value is written; every missing, extra or mis-shaped tensor is named in one
 * rt_error line. rt_export_hf writes DIR/model.safetensors (f32) and DIR/config.json in
 * Hugging Face's layout from the parameters' most precise copies (masters). */
bool rt_init_load(Graph *g, const char *path, uint64_t seed);
bool rt_export_hf(Graph *g, const char *dir, bool overwrite);

/* ---------------------------------------------------------------- generate.c
 * Sampling from the step's own forward (row 0 of the batch, read at the head node), on the
 * host through the reference executor; the caller saves and restores the persistent state the
 * forward may write (amax histories). The prompt and each token are written to out as they
 * come: bytes when text (vocabulary 256), else token ids separated by spaces. */
typedef struct {
    int64_t count;              /* tokens to generate */
    double temperature;         /* 0: greedy */
    int64_t top_k;              /* 0: the whole vocabulary */
    uint64_t seed;
    bool text;
    FILE *logits;               /* each token's V logits (f32, little-endian) as sampled; or NULL */
} RtGenerate;
bool rt_generate(Graph *g, const RtGenerate *o, const int32_t *prompt, int n_prompt, FILE *out);
/* A token drawn from softmax(logits / temperature) over the top_k largest (argmax when
 * temperature is 0); order is scratch of V entries. */
int64_t rt_sample(float *logits, int64_t V, double temperature, int64_t top_k, uint64_t *rng,
                  int64_t *order);

/* ---------------------------------------------------------------- cli.c
 * The command lines of fp8c and of the training binary: each program's flags are a table of
 * RtFlag rows, from which getopt_long's options, the --help lines and the "did you mean"
 * candidates are made. `--flag value` and `--flag=value` are the same; order is kept and `--`
 * ends the flags; abbreviations are refused, with the flag they abbreviate suggested. */
enum { RT_ARG_NONE, RT_ARG_VALUE, RT_ARG_ATTACHED };   /* getopt's has_arg: attached is -O2 */
typedef enum {
    RT_FLAG_HEADING,            /* not a flag: a heading line of --help (help) */
    RT_FLAG_BY_ID,              /* the parser's own code sets what id stands for */
    RT_FLAG_TRUE,               /* bool at offset; takes no value */
    RT_FLAG_TEXT,               /* const char * at offset; not empty */
    RT_FLAG_INT,                /* int64_t at offset, a whole number from lo to hi */
    RT_FLAG_INT32,              /* int at offset, from lo to hi */
    RT_FLAG_REAL,               /* double at offset, finite as an f32; > 0 if lo is 1, else >= 0 */
} RtFlagKind;
typedef struct {
    const char *name;           /* --name; NULL: a flag with only a letter */
    int letter;                 /* -x; 0: none */
    int has_arg;                /* RT_ARG_* */
    const char *value;          /* the value's name in --help ("N", "FILE") */
    RtFlagKind kind;            /* what it sets: a typed field at offset, or the parser's id */
    size_t offset;
    int64_t lo, hi;
    int id;
    const char *help;           /* lines ('\n') of --help; NULL: parsed but not listed */
} RtFlag;                       /* a table ends with a row of zeros */
enum { RT_CLI_MAX = 96 };       /* rows of a table */
typedef struct {
    const RtFlag *flags;
    int argc;
    char **argv;
    /* what rt_cli_next read */
    const RtFlag *flag;         /* FLAG, MISSING, NO_VALUE: its row */
    const char *value;          /* FLAG: its value (NULL: none); WORD: the word */
    const char *word;           /* the word of argv it read */
    char name[64];              /* the flag as written, less "=value" */
    const char *near;           /* UNKNOWN: the known flag nearest to name, or NULL */
    int rest;                   /* REST: the index in argv of the first word after "--" */
    int seen[RT_CLI_MAX];       /* times each row was read */
} RtCli;
enum { RT_CLI_END, RT_CLI_FLAG, RT_CLI_WORD, RT_CLI_REST, RT_CLI_UNKNOWN, RT_CLI_MISSING,
       RT_CLI_NO_VALUE };
/* Starts reading argv[1 ..] (argv[0] is the program) by the table flags; one at a time. */
void rt_cli_begin(RtCli *c, const RtFlag *flags, int argc, char **argv);
/* The next flag, word that is not a flag, "--", end, or the error the caller reports. */
int rt_cli_next(RtCli *c);
int rt_cli_seen(const RtCli *c, const char *name);      /* times --name was read */
const char *rt_cli_nearest(const RtFlag *flags, const char *name);   /* "--flag" or NULL */
void rt_cli_help(FILE *out, const RtFlag *flags, int width);   /* width: of the flag column */
/* Strict numbers: a whole number is [-]digits and nothing else (beyond int64's range it is
 * read as INT64_MIN or INT64_MAX with errno ERANGE, else errno is 0); a real number is what
 * strtod reads whole, with no space first. */
bool rt_cli_int(const char *text, int64_t *v);
bool rt_cli_real(const char *text, double *v);
/* A typed row's value stored at base + offset, or false after one rt_error line. */
bool rt_cli_store(const RtFlag *f, const char *value, void *base);

/* ---------------------------------------------------------------- args.c, arenas.c, train.c
 * The training program: its flags (args.c), the plan's two arenas (arenas.c), the step loop,
 * evaluation and checkpoints (train.c). */
typedef struct {
    const char *data, *val;     /* token sources (rt_data_open specs) */
    const char *log;            /* JSON lines file */
    const char *out;            /* checkpoint directory */
    const char *resume;         /* checkpoint file or directory */
    const char *init;           /* weights to start from (hf.c): HF model or fp8c checkpoint */
    const char *export_hf;      /* write the loaded state as a Hugging Face model, then stop */
    bool eval_only;             /* evaluate the initial or resumed state, then stop */
    int64_t generate;           /* > 0: sample this many tokens, then stop */
    const char *prompt;         /* text (vocabulary 256) or token ids */
    double temperature;
    int64_t top_k;
    const char *logits;         /* --generate: file of the logits each token was sampled from */
    const char *device;
    int64_t steps, warmup, eval_every, eval_batches, save_every;
    int64_t stop_at;            /* stop (with a checkpoint) after this step; -1: at --steps */
    double lr, min_lr;          /* < 0: not given (defaults: the model's lr, lr / 10) */
    int grad_accum, threads;
    uint64_t seed;
    bool seed_given;
    bool steps_given, warmup_given, grad_accum_given;   /* on the command line (a resume
                                                           restores the others) */
    bool overwrite;             /* a fresh run may write over another run's --out and --log */
    /* data parallel: --gpus N launches N ranks on this host itself; --rank/--world-size run
     * one rank of a job whose processes the user launched, meeting through --comm-file */
    int gpus;                   /* 0: not given (one) */
    int rank, world_size;       /* world_size 0: not given (one) */
    const char *comm_file;
    double comm_timeout;        /* seconds a rank waits for the others (meeting, collectives) */
    const char *start_after;    /* --start-after: wait for this file before opening the device */
} TrainOptions;

/* A resumed training run's settings, from its checkpoint's metadata (checkpoint.c): --lr,
 * --min-lr, --warmup, --steps and --grad-accum not on the command line are the run's; one
 * given with another value is used, and one line says what changed. A checkpoint made at
 * another batch or sequence length than this binary's (its batches would differ), at another
 * level or with another optimizer stops the run. Checkpoints older than these fields restore
 * nothing. Returns 0, or 1 (an unreadable checkpoint) or 2 (the run cannot continue here)
 * after rt_error. */
int rt_ckpt_restore_run(const Graph *g, TrainOptions *o);
/* Whether the checkpoint at path was trained with g's optimizer; else one rt_error line. */
bool rt_ckpt_check_optimizer(const Graph *g, const char *path);
/* The metadata keys of those settings, written by train.c with the rest of the metadata. */
#define RT_META_LR "lr"
#define RT_META_MIN_LR "min_lr"
#define RT_META_WARMUP "warmup"
#define RT_META_STEPS "steps"
#define RT_META_GRAD_ACCUM "grad_accum"

enum { RT_ARGS_OK, RT_ARGS_HELP, RT_ARGS_ERROR };
/* Parses and validates the flags; RT_ARGS_ERROR after one rt_error line. */
int rt_parse_args(int argc, char **argv, TrainOptions *o);
void rt_usage(FILE *out, const char *prog);
/* Linear warm-up to `peak` over `warmup` steps, then cosine decay to `floor` at `steps`;
 * step counts from 0. */
double rt_lr_at(double peak, double floor, int64_t warmup, int64_t steps, int64_t step);
/* Data parallel over `world` ranks with `accum` micro-steps each. Rank r's micro-step m is
 * micro-step r*accum + m of the global step (its batch: rt_data_train_batch), so W ranks read
 * what one process with W*accum micro-steps reads. The ranks sum their accumulators (not
 * average: the sum is what one process's accumulator holds), and grad_scale 1/(accum*world)
 * makes it the mean, as one process with W*accum micro-steps feeds it. */
int rt_global_micro(int rank, int accum, int micro);
double rt_grad_scale(int accum, int world);

/* ---------------------------------------------------------------- comm_buckets.c
 * The gradient reduction of a data-parallel step in buckets: runs of ALL_REDUCE nodes in the
 * order the backward finishes their accumulators, about comm.bucket_mb MiB each. */
typedef struct {
    int first, count;           /* RtCommPlan.reduce[first .. first+count) */
    int64_t bytes;              /* in the accumulators' formats */
    int64_t elems;              /* elements, all its gradients together */
    int last;                   /* position in g->nodes of its last ACCUMULATE */
} RtBucket;
typedef struct {
    Node **reduce;              /* every ALL_REDUCE node, in the order they are sent */
    int n_reduce;
    RtBucket *buckets;
    int n_buckets;
    int64_t bytes;              /* all of them */
    int64_t cap;                /* the bucket size aimed at (comm.bucket_mb) */
    ElemType wire;              /* FMT_VOID: NCCL sums in the accumulators' formats; e5m2 or
                                   e4m3: the FP8 reduction of comm_fp8.c (comm:grad=...) */
} RtCommPlan;
bool rt_comm_plan(const Graph *g, RtCommPlan *p);   /* false: out of memory */
void rt_comm_plan_free(RtCommPlan *p);
/* The choice comm.overlap (default on): reduce each bucket while the backward runs. */
bool rt_comm_overlap(const Graph *g);
int64_t rt_comm_bucket_bytes(const Graph *g);
/* ---------------------------------------------------------------- comm_fp8.c
 * The FP8 gradient reduction (comm:grad=e5m2 or e4m3), per bucket of C elements over N
 * ranks: the arithmetic the GPU kernels (cuda/kernels/comm.cuh) do, written once on the host
 * as the reference they are tested against bit for bit, and the sizes the plan and the
 * executor share. */
/* Elements of one rank's shard: C / N rounded up to a multiple of RT_FP8_SHARD_ALIGN. */
#define RT_FP8_SHARD_ALIGN 256
int64_t rt_comm_fp8_shard(int64_t elems, int ranks);
/* The bucket's scale from the amax all ranks agreed on: max(wire) / amax computed in f64 and
 * rounded once to f32 (the current-scaling rule of QUANT_SCALE), at most 2^127; 1 where amax
 * is 0; NaN where amax is infinite, so that the reduced bucket is NaN and the step's finite
 * check skips it (saturating an infinity to the format's largest value would hide it). */
float rt_comm_fp8_scale(ElemType wire, float amax);
/* The reduced bucket every rank ends with, given x[r] (n values of rank r, as f32): out[i]
 * before rounding to the accumulator's format (the caller's num_round; the GPU stores it so). */
void rt_comm_fp8_reduce(ElemType wire, int ranks, int64_t n, const float *const *x, float *out);
/* Bytes one GPU sends per step for the plan's reduction over `ranks` GPUs: a ring
 * all-reduce's 2 (N - 1) / N of the gradients' bytes, or for the FP8 reduction the all-to-all
 * and the all-gather of its shards, (N - 1) x shard bytes each, and two f32 maxima a bucket. */
int64_t rt_comm_sent_bytes(const RtCommPlan *p, int ranks);
/* Device bytes the FP8 reduction's buffers take beside the arenas (cuda/exec_comm.c): the codes
 * sent, received and gathered (N S each) and the summed shard (S f32), S the largest bucket's
 * shard; 0 without the FP8 reduction. */
int64_t rt_comm_fp8_buffer_bytes(const RtCommPlan *p, int ranks);
/* The format g's gradient reduction travels in (its ALL_REDUCE nodes' wire), FMT_VOID for
 * NCCL's sums or no reduction at all. */
ElemType rt_comm_wire(const Graph *g);
/* ---------------------------------------------------------------- comm_shard.c
 * Sharded optimizer state (fp8c build --gpus N --shard-states; the ALL_REDUCE nodes' shard=1):
 * each rank keeps 1/N of the master weights, the optimizer states and the reduced gradient,
 * per tensor: shard r of n elements is [r S, (r+1) S) clipped to n, S = ceil(n / N) rounded
 * up to the update's group (the lcm of its tensors' units). */
typedef struct {
    int64_t off, len;           /* elements [off, off+len) of the tensor; len may be 0 */
} RtShard;
/* The multiple a shard boundary of t must fall on: its codec's group (O2's expand 128, O3's
 * companded 32), 1 for plain, per-tensor scaled and split tensors; numel (never split) for a
 * tensor with scales per row or block. */
int64_t rt_shard_unit(const Tensor *t);
int64_t rt_shard_group(const Node *update);     /* ADAMW, LION, SGD: lcm over its tensors */
RtShard rt_shard_of(int64_t n, int64_t group, int ranks, int rank);
/* Bytes of len elements of t as stored: codes, plus a group codec's f32 side values. */
int64_t rt_shard_bytes(const Tensor *t, int64_t len);
/* Shard s of t between its whole storage (codes; a group codec's side values) and one rank's
 * (s.len codes; its groups' side values): to_whole gathers, else scatters. */
void rt_shard_copy(const Tensor *t, RtShard s, void *whole, float *whole_params, void *part,
                   float *part_params, bool to_whole);
bool rt_shard_states(const Graph *g);           /* built with --shard-states (either stage) */
/* What --shard-states keeps on each GPU and sends each step, from the plan's bytes by role. */
typedef struct {
    bool on;                    /* the graph shards its states and ranks > 1 */
    int ranks, updates;
    int whole_updates;          /* updates too small (or not splittable) to split: rank 0's */
    int64_t per_gpu[ROLE_COUNT];   /* bytes by role on the GPU that keeps the most (rank 0) */
    int64_t saved;              /* bytes a GPU keeps fewer than one GPU (all roles) */
    int64_t group;              /* the largest shard group of a split update */
    int64_t weight_bytes, grad_bytes, copy_bytes;   /* whole, all updates together */
    int norm_values, amax_values;   /* all-reduced: the norm's chunk sums (f64), the amaxes (f32) */
    int64_t sent_reduce_scatter, sent_gather_weights, sent_gather_copies, sent_scalars;
    int stage;                  /* 1, or 2: the gradient accumulators sharded too */
    int64_t grad_buffer_bytes;  /* stage 2: the backward's bucket buffers (rt_grad_slots) */
    /* stage 3 (comm_weights.c): the weights' gathers, per micro-step, and their buffers */
    int gathered_weights, whole_params, whole_matrices, gather_buffers;
    int64_t whole_param_bytes, gather_buffer_bytes;
    int64_t gathered_fp8, gathered_bf16, sent_gather_fp8, sent_gather_bf16, sent_gather_scalars;
    int gather_amax_values;     /* one f32 a FP8-gathered weight, each micro-step's forward */
} RtShardPlan;
void rt_shard_plan(const Graph *g, const int64_t *by_role, int ranks, RtShardPlan *p);
/* ---------------------------------------------------------------- comm_grads.c
 * Sharded gradients (--shard-states=2; the ALL_REDUCE nodes' shard=2): each rank keeps the
 * accumulator's shard of each update, and the backward writes each bucket of gradients into a
 * transient buffer, reduced every micro-step into the owners' shard accumulators. */
int rt_shard_stage(const Graph *g);             /* 0, 1 (--shard-states), 2 (=2) or 3 (=3) */
/* One rank's sums of one micro-step into shard s of accumulator acc (bf16 or f32), as the
 * owner receives them: slots[r] holds rank r's whole buffer after its backward (the owner's
 * own range started from its running sum, the others' from zero); out (s.len elements in
 * acc's format) = slots[owner] + slots[owner+1] + ... (ranks mod N), each addition rounded to
 * acc's format: the documented order of comm_grads.c. */
void ref_reduce_to_owner(const Tensor *acc, RtShard s, int owner, int ranks, void *const *slots, void *out);
/* SQNORM as the reference takes it (ir.h): out[c] = the f64 sum of squares of chunk c of
 * IR_SQNORM_CHUNK elements of x[0 .. n), and the chunks' sums added in order. A shard that
 * starts on a chunk boundary gives the whole tensor's sums of its chunks (tests/test_shard.c). */
void ref_sqnorm_chunks(const float *x, int64_t n, double *out);
float ref_sqnorm_sum(const double *chunks, int64_t count);
#define RT_GRAD_ALIGN 256       /* each gradient's place in a bucket buffer */
typedef struct {
    int n_slots;                /* buffers */
    int *slot;                  /* per bucket: the buffer it is written in */
    int64_t *slot_at;           /* per buffer: its byte offset among all of them */
    int64_t *slot_bytes;        /* per buffer: its size, the largest bucket it takes */
    int64_t *at;                /* per gradient (RtCommPlan.reduce order): offset in its buffer */
    int64_t bytes;              /* all buffers */
} RtGradSlots;
/* Buffers for the buckets of cp: bucket b is live from node position open[b] (its first
 * write) and may hand its buffer on once sent at position sent[b] (its reduction enqueued
 * after that node's launches): a later bucket c takes it only if sent[b] < open[c]. */
bool rt_grad_slots(const RtCommPlan *cp, const int *open, const int *sent, RtGradSlots *s);
void rt_grad_slots_free(RtGradSlots *s);
/* The graph's own positions for rt_grad_slots: a bucket opens at the first ACCUMULATE of one of
 * its gradients or the producer of the value it adds (a GEMM whose epilogue accumulates),
 * and is sent at its last ACCUMULATE (RtBucket.last). */
void rt_grad_bucket_span(const Graph *g, const RtCommPlan *cp, int *open, int *sent);
int64_t rt_grad_tensor_bytes(const Node *reduce);   /* its place in a buffer: aligned */
int64_t rt_grad_buffer_bytes(const Graph *g);        /* the plan's buffers; -1 out of memory */
/* ---------------------------------------------------------------- comm_weights.c
 * Sharded weights (--shard-states=3; the ALL_REDUCE nodes' shard=3): each rank keeps its shard
 * of every weight a GEMM alone reads, and the step gathers each layer's weights, per phase,
 * into a transient buffer: in e4m3 where the GEMMs read a per-tensor scaled copy, else bf16. */
typedef enum {
    RT_GATHER_NONE,             /* kept whole on every rank (vectors, embeddings) */
    RT_GATHER_FP8,              /* quantized per use, one scale per tensor: each owner
                                   quantizes its shard with the all-reduced amax's scale */
    RT_GATHER_COPY,             /* the update's FP8 copy, sharded with the weight, gathered */
    RT_GATHER_BF16,             /* gathered as it is kept (a bf16 GEMM, or a recipe's scales) */
} RtGatherHow;
typedef struct {
    const Node *param, *update;
    const Node *copy;           /* its update's FP8 copy (weight_copy state), sharded with it
                                   and gathered where the step reads it; else NULL */
    RtGatherHow how;
    int layer;                  /* index into RtGatherPlan.layers */
} RtGatherWeight;
typedef struct {
    int weight;                 /* index into RtGatherPlan.weights */
    Phase phase;                /* forward or backward */
    const Node *target;         /* what the buffer holds: the QUANTIZE's result, the copy, the
                                   parameter (bf16) */
    ElemType wire;              /* what travels */
    int64_t bytes;              /* gathered: the whole tensor in wire */
    int64_t buffer_bytes;       /* its storage in the buffer (a quantize's both layouts) */
    int64_t at;                 /* its offset in its gather's buffer */
    int gather;                 /* index into RtGatherPlan.gathers */
} RtGatherItem;
#define RT_GATHER_ALIGN 256
typedef struct {
    int layer;
    Phase phase;
    int issue;                  /* node position: enqueued before this node (prefetch) */
    int first, last;            /* node positions of its first and last reader */
    int buffer;                 /* index of the buffer it lands in */
    int64_t bytes, bytes_buffer;   /* gathered; its items' storage, aligned */
} RtGather;
typedef struct {
    int ranks;
    int n_weights, n_items, n_gathers, n_layers, n_buffers;
    RtGatherWeight *weights;
    RtGatherItem *items;
    RtGather *gathers;          /* in issue order */
    char **layers;              /* each layer's name prefix ("h.7") */
    int64_t *buffer_bytes_each, *buffer_at;
    int64_t buffer_bytes;       /* all buffers: the area beside the step arena */
    int whole_params, whole_matrices;   /* parameters kept whole; of them, rank >= 2 */
    int64_t whole_bytes, sharded_bytes; /* parameter bytes kept whole / sharded (as stored) */
    int amax_values;            /* one f32 all-reduced (max) per RT_GATHER_FP8 weight a step */
    int64_t gathered_fp8, gathered_bf16;   /* whole bytes gathered per micro-step */
    int64_t sent_fp8, sent_bf16;           /* per GPU per micro-step, ring: (N-1)/N of those */
} RtGatherPlan;
/* The gathers of g for `ranks` ranks (nothing unless g is built with --shard-states=3). */
bool rt_gather_plan(const Graph *g, int ranks, RtGatherPlan *p);
void rt_gather_plan_free(RtGatherPlan *p);
const RtGatherWeight *rt_gather_weight(const RtGatherPlan *p, const Node *param);   /* NULL: whole */
/* Host reference of a gather. ref_shard_amax: max |x| over elements s of w (whole storage).
 * ref_scale_from_amax: the scale quant_scale node qs stores for that amax (per tensor).
 * ref_quantize_shard: elements s of quantize q's input, stored through q's format with scale
 * `scale` into out (q's whole storage): what the shard's owner contributes to the gather. */
float ref_shard_amax(const Tensor *w, RtShard s);
float ref_scale_from_amax(const Node *qs, float amax);
void ref_quantize_shard(const Node *q, RtShard s, float scale, void *out);

/* After a skipped step: pairs[2i] is a delayed scale (f32 scalar), pairs[2i+1] its amax history
 * (host copies). Each scale is halved and each non-finite history entry becomes twice the
 * history's largest finite one, so the next scales leave room for what overflowed. */
void rt_scales_back_off(Tensor *const *pairs, int n_pairs);

/* Bytes of a node's storage in its arena, and whether it has any (in-place ops and void
 * results have none). */
int64_t rt_storage_bytes(const Node *n);
bool rt_has_storage(const Node *n);
/* The plan's two arenas, every tensor bound to its offset. */
typedef struct {
    void *persistent, *step;
    int64_t persistent_bytes, step_bytes;
    size_t persistent_mapped, step_mapped;   /* what rt_memory_free unmaps */
    /* nothing has been written to the step arena since it was allocated (all zeros): a device
     * zeroes its own copy instead of copying it (a training run, whose steps make every value
     * there; a test that fills inputs there before the device opens leaves it false) */
    bool step_blank;
} RtMemory;
bool rt_memory_bind(Graph *g, RtMemory *m);
void rt_memory_free(RtMemory *m);

/* Runs the whole training described by o on graph g; returns the exit status. */
int rt_train(Graph *g, const TrainOptions *o);

/* ---------------------------------------------------------------- device.c
 * Where the step runs. The "cpu" device is the reference executor working on the host
 * arenas. Another device (the CUDA executor, cuda/device.c, registered by the binary's main)
 * keeps its own copy of both arenas; the host arenas are then a mirror that the training
 * program synchronizes at the few places where it touches tensor bytes itself: the inputs it
 * feeds (push), the outputs it reads and the checkpoints it writes (pull), the states it
 * saves around an evaluation (pull, then push). Every function returns false after one
 * rt_error line. */
typedef struct RtDevice {
    const char *name;                                   /* "cpu", "cuda" */
    bool (*probe)(char *why, size_t why_len);           /* usable here? else why not */
    bool (*open)(Graph *g, RtMemory *host);             /* after rt_memory_bind and init */
    void (*close)(void);
    bool (*run_phase)(Graph *g, Phase p);               /* evaluation (forward), update */
    bool (*run_micro_step)(Graph *g);                   /* forward and backward, one sweep */
    bool (*push)(Tensor *const *ts, int n);             /* host mirror -> device */
    bool (*pull)(Tensor *const *ts, int n);             /* device -> host mirror */
    bool (*all_finite)(Tensor *const *ts, int n, bool *finite);
    bool (*zero)(Tensor *const *ts, int n);             /* all-zero bits */
    const char *(*describe)(void);                      /* for the start line */
    /* Data parallel (NULL: the device cannot): comm_probe says whether `gpus` ranks can run on
     * this host (a GPU each, and NCCL), else why not; comm_open, before open, picks this
     * rank's GPU (rank % the host's GPUs) and meets the other ranks through comm_file within
     * timeout_s; comm_sum sums v over the ranks. A device that joined a world of W > 1 also
     * sums the gradients over the ranks before its update (the graph's ALL_REDUCE nodes). */
    bool (*comm_probe)(int gpus, char *why, size_t why_len);
    bool (*comm_open)(int rank, int world, const char *comm_file, double timeout_s);
    bool (*comm_sum)(double *v, int n);
    /* The step's last micro-step, where a data-parallel device may sum the gradients while the
     * backward runs (NULL: run_micro_step; the update then sums them). */
    bool (*run_last_micro_step)(Graph *g);
    /* --shard-states on several ranks (NULL: nothing is sharded): every rank calls it before
     * a checkpoint; rank 0's host mirror then holds the whole of ts (the other ranks' shards
     * of the states and masters, which its device does not keep). */
    bool (*gather)(Tensor *const *ts, int n);
} RtDevice;

extern const RtDevice rt_cpu_device;
void rt_device_register(const RtDevice *d);
bool rt_device_known(const char *name);                 /* "cpu", "auto" or registered */
const RtDevice *rt_device_find(const char *name);       /* registered, not probed; or NULL */
/* "cpu", a registered name (which must probe fine), or "auto": the first registered device
 * that probes fine, else the cpu (with a note naming why). NULL after one rt_error line. */
const RtDevice *rt_device_select(const char *name);

#endif
