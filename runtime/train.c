/* train.c — the training program that a compiled binary runs.
 *
 * The graph read from the artifact already is the whole step: forward, backward and update
 * nodes, a format for every tensor and an offset for every buffer in two arenas (persistent:
 * parameters, accumulators, optimizer states, scales; step: everything else). What is left for
 * the runtime is small: the flags (args.c), the two arenas the plan asks for with every tensor
 * bound to its offset (arenas.c), and here: initialize or load the persistent state, then
 * loop — feed a batch, run forward and backward once per micro-step, feed lr/step/grad_scale,
 * run the update, log, evaluate, checkpoint.
 *
 * Two properties shape the loop. Resuming is exact: batches depend only on (seed, step,
 * micro-step, row) (data.c), the checkpoint holds every persistent tensor in its storage bits,
 * and the Adam step count is saved with it, so steps s+1.. of a resumed run are bit-identical
 * to those of a straight run. And NaN never reaches the weights: a micro-step whose loss or
 * accumulated gradient is not finite cancels the step's update (accumulators zeroed, logged);
 * a run that keeps producing them stops with an error instead of spinning.
 *
 * Evaluation runs the forward phase alone. Forward nodes may record amax values or scales as
 * they go (delayed scaling); those persistent bytes are saved before evaluation and put back
 * after, so evaluating never changes what training computes.
 *
 * Nothing already written is lost. A run that does not resume refuses an --out or --log holding
 * another run unless told --overwrite; --out is proven writable before step 1 rather than at the
 * first save; every log write is checked and a failed one stops the run; a resumed run drops
 * the log lines of the steps it repeats, so each step is logged once. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "rt.h"
#include "train_internal.h"

#define TRAIN_MAX_SKIPS 10      /* consecutive non-finite steps before giving up */
#define TRAIN_VAL_FRACTION 0.05 /* held out of a text --data when there is no --val */
#define TRAIN_MAX_META 32

double rt_lr_at(double peak, double floor, int64_t warmup, int64_t steps, int64_t step) {
    if (step < warmup) return peak * (double)(step + 1) / (double)warmup;
    if (steps <= warmup + 1) return peak;
    double ratio = (double)(step - warmup) / (double)(steps - warmup - 1);
    if (ratio > 1) ratio = 1;
    return floor + 0.5 * (1.0 + cos(M_PI * ratio)) * (peak - floor);
}

int rt_global_micro(int rank, int accum, int micro) { return rank * accum + micro; }

double rt_grad_scale(int accum, int world) { return 1.0 / ((double)accum * (double)world); }

/* ---------------------------------------------------------------- the graph's interface */

typedef struct {
    Node *tokens, *targets;             /* (B, T) inputs */
    Node *loss, *grad_norm;             /* scalar outputs */
    Node *lr, *step, *grad_scale;       /* scalar inputs of the update */
    int B, T;
    int64_t vocab;
    Node **saved;                       /* the persistent tensors a checkpoint holds */
    int n_saved;
    Node **grads;                       /* gradient accumulators */
    int n_grads;
    Node **eval_touched;                /* persistent tensors the forward phase writes */
    int n_eval_touched;
    Node **delayed;                     /* delayed scales and their amax histories, in pairs */
    int n_delayed;
} Model;

static Node *model_input(const Graph *g, const char *name, bool required) {
    Node *n = ir_find(g, name);
    if (n && n->op != OP_INPUT) n = NULL;
    if (!n && required) rt_error("artifact: the graph has no input named \"%s\"", name);
    return n;
}

static bool model_push(Node ***list, int *count, Node *n) {
    for (int i = 0; i < *count; i++)
        if ((*list)[i] == n) return true;
    Node **grown = realloc(*list, (size_t)(*count + 1) * sizeof *grown);
    if (!grown) return false;
    *list = grown;
    grown[(*count)++] = n;
    return true;
}

/* A persistent tensor at the same offset as one already listed is a view of it (a reshape
 * that memplan placed on its input): a checkpoint holds the bytes once. */
static bool model_is_view(const Model *m, const Node *n) {
    for (int i = 0; i < m->n_saved; i++)
        if (n->t.offset >= 0 && m->saved[i]->t.offset == n->t.offset) return true;
    return false;
}

/* Finds what the runtime feeds and reads, and which persistent tensors it saves. */
static bool model_inspect(Graph *g, Model *m) {
    memset(m, 0, sizeof *m);
    m->tokens = model_input(g, "tokens", true);
    m->targets = m->tokens ? model_input(g, "targets", true) : NULL;
    if (!m->targets) return false;
    m->loss = ir_find(g, "loss");
    if (!m->loss || ir_numel(&m->loss->t) != 1) {
        rt_error("artifact: the graph has no scalar output named \"loss\"");
        return false;
    }
    if (m->tokens->t.rank != 2 || !ir_same_shape(&m->tokens->t, &m->targets->t)) {
        rt_error("artifact: \"tokens\" and \"targets\" must both be (B, T)");
        return false;
    }
    m->B = (int)m->tokens->t.dims[0];
    m->T = (int)m->tokens->t.dims[1];
    m->lr = model_input(g, "lr", false);
    m->step = model_input(g, "step", false);
    m->grad_scale = model_input(g, "grad_scale", false);
    m->grad_norm = ir_find(g, "grad_norm");

    /* the vocabulary: rows of the table the tokens index, classes of the loss */
    m->vocab = INT64_MAX;
    bool ok = true;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->op == OP_EMBEDDING && n->in[1] == m->tokens && n->in[0]->t.dims[0] < m->vocab)
            m->vocab = n->in[0]->t.dims[0];
        if (n->op == OP_CROSS_ENTROPY && n->in[1] == m->targets) {
            const Tensor *logits = &n->in[0]->t;
            if (logits->dims[logits->rank - 1] < m->vocab) m->vocab = logits->dims[logits->rank - 1];
        }
        bool persistent = ir_role_is_persistent(n->t.role);
        if (persistent && rt_has_storage(n) && !model_is_view(m, n)) {
            if (!n->t.name) n->t.name = arena_printf(g->arena, "node.%d", n->id);
            ok &= model_push(&m->saved, &m->n_saved, n);
            if (n->t.role == ROLE_GRAD) ok &= model_push(&m->grads, &m->n_grads, n);
            if (n->t.role == ROLE_SCALE || n->t.role == ROLE_AMAX_HISTORY)
                ok &= model_push(&m->eval_touched, &m->n_eval_touched, n);
        }
        if (n->op == OP_DELAYED_SCALE) {
            Node *hist = n->in[1]->op == OP_AMAX_RECORD ? n->in[1]->in[0] : n->in[1];
            Node **grown = realloc(m->delayed, (size_t)(m->n_delayed + 2) * sizeof *grown);
            ok &= grown != NULL;
            if (grown) m->delayed = grown, grown[m->n_delayed++] = n->in[0], grown[m->n_delayed++] = hist;
        }
        if (n->phase == PHASE_FORWARD && n->op != OP_PARAM && n->op != OP_STATE) {
            if (persistent && rt_has_storage(n))
                ok &= model_push(&m->eval_touched, &m->n_eval_touched, n);
            if (ir_op_is_inplace(n->op))
                ok &= model_push(&m->eval_touched, &m->n_eval_touched, n->in[0]);
            if (n->t.fmt.amax) ok &= model_push(&m->eval_touched, &m->n_eval_touched, n->t.fmt.amax);
        }
    }
    if (!ok) {
        rt_error("out of memory");
        return false;
    }
    if (m->vocab == INT64_MAX) {
        rt_error("artifact: cannot tell the vocabulary: no embedding reads \"tokens\"");
        return false;
    }
    return true;
}

static void model_free(Model *m) {
    free(m->saved);
    free(m->grads);
    free(m->eval_touched);
    free(m->delayed);
}

/* The device the step runs on (the cpu unless rt_train chose another). */
static const RtDevice *train_dev = &rt_cpu_device;

/* This process's place in a data-parallel run: rank 0 of 1 unless --gpus or --world-size. */
static int train_rank, train_world = 1;

/* fn over the tensors of nodes ns (a device's push, pull, zero) */
static bool train_dev_nodes(bool (*fn)(Tensor *const *, int), Node *const *ns, int n) {
    Tensor *one[4] = {0}, **ts = n <= 4 ? one : malloc((size_t)n * sizeof *ts);
    if (!ts) return false;
    for (int i = 0; i < n; i++) ts[i] = &ns[i]->t;
    bool ok = fn(ts, n);
    if (ts != one) free(ts);
    return ok;
}

static void model_feed_ids(Node *n, const int32_t *ids) {
    int64_t count = ir_numel(&n->t);
    if (n->t.fmt.elem == FMT_I32) {
        memcpy(n->t.data, ids, (size_t)count * sizeof *ids);
        return;
    }
    float *x = malloc((size_t)count * sizeof *x);
    for (int64_t i = 0; i < count; i++) x[i] = (float)ids[i];
    ref_store(&n->t, x);
    free(x);
}

static void model_feed_scalar(Node *n, double v) {
    if (!n) return;
    float x = (float)v;
    ref_store(&n->t, &x);
    train_dev_nodes(train_dev->push, &n, 1);
}

static float model_read_scalar(Node *n) {
    if (!n) return NAN;
    if (!train_dev_nodes(train_dev->pull, &n, 1)) return NAN;
    float *x = ref_load(&n->t);
    float v = x[0];
    free(x);
    return v;
}

void rt_scales_back_off(Tensor *const *pairs, int n_pairs) {
    for (int i = 0; i < n_pairs; i++) {
        Tensor *scale = pairs[2 * i], *hist = pairs[2 * i + 1];
        float *s = ref_load(scale), *h = ref_load(hist);
        int64_t n = ir_numel(hist);
        float finite_max = 0;
        for (int64_t k = 0; k < n; k++)
            if (isfinite(h[k]) && h[k] > finite_max) finite_max = h[k];
        for (int64_t k = 0; k < n; k++)
            if (!isfinite(h[k])) h[k] = 2 * finite_max;
        s[0] *= 0.5f;
        ref_store(scale, s);
        ref_store(hist, h);
        free(s);
        free(h);
    }
}

/* A skipped step under delayed scaling: the amax it recorded may be infinite, which would hold
 * the scale where it overflowed for the history's length; back the scales off instead (as a
 * dynamic loss scaler does). Returns the number of scales changed, -1 on a device error. */
static int model_back_off_scales(const Model *m) {
    if (!m->n_delayed) return 0;
    if (!train_dev_nodes(train_dev->pull, m->delayed, m->n_delayed)) return -1;
    Tensor **ts = malloc((size_t)m->n_delayed * sizeof *ts);
    if (!ts) return -1;
    for (int i = 0; i < m->n_delayed; i++) ts[i] = &m->delayed[i]->t;
    rt_scales_back_off(ts, m->n_delayed / 2);
    free(ts);
    if (!train_dev_nodes(train_dev->push, m->delayed, m->n_delayed)) return -1;
    return m->n_delayed / 2;
}

/* Whether every gradient element is finite (*finite); false when the device could not check
 * (an error, already reported: training stops rather than skip steps it cannot judge). */
static bool model_grads_finite(const Model *m, bool *finite) {
    *finite = true;
    if (train_dev != &rt_cpu_device) {
        Tensor **ts = malloc((size_t)(m->n_grads ? m->n_grads : 1) * sizeof *ts);
        bool ok = ts != NULL;
        for (int i = 0; ok && i < m->n_grads; i++) ts[i] = &m->grads[i]->t;
        ok = ok && train_dev->all_finite(ts, m->n_grads, finite);
        free(ts);
        return ok;
    }
    for (int i = 0; i < m->n_grads; i++) {
        const Tensor *t = &m->grads[i]->t;
        float *x = ref_load(t);
        int64_t n = ir_numel(t);
        for (int64_t k = 0; k < n && *finite; k++) *finite = isfinite(x[k]);
        free(x);
        if (!*finite) return true;
    }
    return true;
}

static void model_zero_grads(const Model *m) {
    /* zero is all-zero bits in every element type, scaled or not */
    if (train_dev != &rt_cpu_device) {
        train_dev_nodes(train_dev->zero, m->grads, m->n_grads);
        return;
    }
    for (int i = 0; i < m->n_grads; i++)
        memset(m->grads[i]->t.data, 0, (size_t)rt_storage_bytes(m->grads[i]));
}

/* ---------------------------------------------------------------- checkpoints */

typedef struct {
    int64_t step;        /* optimizer steps done (the data position: batches are a function of it) */
    int64_t opt_step;    /* updates applied (Adam's step count); less than step after skips */
    uint64_t seed;
} Progress;

static int train_meta(const Graph *g, const TrainOptions *o, const Progress *p, CkptMeta *meta) {
    int n = 0;
#define META(k, ...) snprintf(meta[n].key, sizeof meta[n].key, "%s", k), \
                     snprintf(meta[n].value, sizeof meta[n].value, __VA_ARGS__), n++
    META("format", "fp8c");
    META("format_version", "1");
    META("model", "%s", g->model_name ? g->model_name : "");
    META("step", "%lld", (long long)p->step);
    META("opt_step", "%lld", (long long)p->opt_step);
    META("seed", "%llu", (unsigned long long)p->seed);
    META("data_step", "%lld", (long long)p->step);
    META("data", "%s", o->data);
    META("opt_level", "%d", g->opt_level);
    META("optimizer", "%s", ir_optim_name(g->optim.kind));
    META("batch", "%lld", (long long)g->batch);
    META("seq", "%lld", (long long)g->seq);
    META(RT_META_LR, "%.17g", o->lr > 0 ? o->lr : g->optim.lr);
    META(RT_META_MIN_LR, "%.17g", o->min_lr >= 0 ? o->min_lr : (o->lr > 0 ? o->lr : g->optim.lr) / 10);
    META(RT_META_WARMUP, "%lld", (long long)o->warmup);
    META(RT_META_STEPS, "%lld", (long long)o->steps);
    META(RT_META_GRAD_ACCUM, "%d", o->grad_accum);
#undef META
    return n;
}

static bool train_meta_int(const char *path, const CkptMeta *meta, int n, const char *key,
                           int64_t *out) {
    const char *s = rt_ckpt_meta_get(meta, n, key);
    char *end;
    errno = 0;
    long long v = s ? strtoll(s, &end, 10) : -1;
    if (!s || !*s || *end || errno || v < 0) {
        rt_error("%s: checkpoint metadata \"%s\" is %s", path, key, s ? "not a count" : "missing");
        return false;
    }
    *out = v;
    return true;
}

static bool train_resume(Graph *g, const Model *m, const TrainOptions *o, Progress *p) {
    char path[4096];
    if (!rt_ckpt_resolve(o->resume, path, sizeof path)) return false;
    if (!rt_ckpt_check_optimizer(g, path)) return false;
    CkptMeta meta[TRAIN_MAX_META];
    int n_meta = 0;
    Tensor **ts = malloc((size_t)(m->n_saved ? m->n_saved : 1) * sizeof *ts);
    if (!ts) return false;
    for (int i = 0; i < m->n_saved; i++) ts[i] = &m->saved[i]->t;
    bool ok = rt_ckpt_load(path, ts, m->n_saved, meta, TRAIN_MAX_META, &n_meta);
    free(ts);
    if (!ok) return false;
    const char *format = rt_ckpt_meta_get(meta, n_meta, "format");
    const char *version = rt_ckpt_meta_get(meta, n_meta, "format_version");
    if (!format || strcmp(format, "fp8c") != 0 || !version || strcmp(version, "1") != 0) {
        rt_error("%s: not an fp8c checkpoint of format version 1", path);
        return false;
    }
    int64_t seed = 0;
    if (!train_meta_int(path, meta, n_meta, "step", &p->step) ||
        !train_meta_int(path, meta, n_meta, "opt_step", &p->opt_step) ||
        !train_meta_int(path, meta, n_meta, "seed", &seed))
        return false;
    /* updates are counted among steps (a skipped step counts as a step, not an update): more
     * updates than steps is a damaged file, and Adam's bias correction would start wrong */
    if (p->opt_step > p->step) {
        rt_error("%s: checkpoint metadata opt_step %lld is greater than step %lld", path,
                 (long long)p->opt_step, (long long)p->step);
        return false;
    }
    if (!o->seed_given)
        p->seed = (uint64_t)seed;
    else if (o->seed != (uint64_t)seed)
        rt_note("--seed %llu differs from the checkpoint's seed %lld: batches will differ from "
                "the original run", (unsigned long long)o->seed, (long long)seed);
    const char *model = rt_ckpt_meta_get(meta, n_meta, "model");
    if (model && g->model_name && strcmp(model, g->model_name) != 0)
        rt_note("%s: checkpoint of model \"%s\" loaded into \"%s\" (every tensor matched)", path,
                model, g->model_name);
    rt_note("resumed from %s at step %lld", path, (long long)p->step);
    return true;
}

/* --shard-states on several ranks: each rank's device keeps its shards of the optimizer states
 * and masters only, so before a save every rank sends them to rank 0's host mirror (a
 * collective: all ranks call this, rank 0 then saves whole tensors as on one GPU). */
static bool train_gather(const Model *m) {
    if (train_world < 2 || !train_dev->gather) return true;
    Tensor **ts = malloc((size_t)(m->n_saved ? m->n_saved : 1) * sizeof *ts);
    if (!ts) return false;
    for (int i = 0; i < m->n_saved; i++) ts[i] = &m->saved[i]->t;
    bool ok = train_dev->gather(ts, m->n_saved);
    free(ts);
    return ok;
}

static bool train_save(const Graph *g, const Model *m, const TrainOptions *o, const Progress *p,
                       RtLog *log) {
    CkptMeta meta[TRAIN_MAX_META];
    int n_meta = train_meta(g, o, p, meta);
    if (!train_dev_nodes(train_dev->pull, m->saved, m->n_saved)) return false;
    Tensor **ts = malloc((size_t)(m->n_saved ? m->n_saved : 1) * sizeof *ts);
    if (!ts) return false;
    for (int i = 0; i < m->n_saved; i++) ts[i] = &m->saved[i]->t;
    char written[4096];
    bool ok = rt_ckpt_save_step(o->out, p->step, ts, m->n_saved, meta, n_meta, written,
                                sizeof written);
    free(ts);
    if (ok) rt_log_message(log, "saved %s", written);
    return ok;
}

/* ---------------------------------------------------------------- the loop */

static double train_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* --start-after: fp8c tune makes a candidate's training state (seconds of host work for a
 * large model) while the candidate before it runs, and lets it on the device by creating the
 * file once that one has ended. The wait ends with the file, or with an error when the
 * process that started this one is gone (nobody would create it). */
static bool train_wait_for_file(const char *path) {
    pid_t parent = getppid();
    while (access(path, F_OK) != 0) {
        if (getppid() != parent) {
            rt_error("--start-after %s: the process that started this one has ended", path);
            return false;
        }
        struct timespec pause = {0, 2000000};
        nanosleep(&pause, NULL);
    }
    return true;
}

/* Mean forward loss over the fixed validation batches, leaving the training state as it was. */
static double train_evaluate(Graph *g, const Model *m, const TokenData *val, int64_t batches,
                             int32_t *tok, int32_t *tgt) {
    void **saved = calloc((size_t)(m->n_eval_touched ? m->n_eval_touched : 1), sizeof *saved);
    train_dev_nodes(train_dev->pull, m->eval_touched, m->n_eval_touched);
    for (int i = 0; i < m->n_eval_touched; i++) {
        const Tensor *t = &m->eval_touched[i]->t;
        size_t bytes = (size_t)rt_storage_bytes(m->eval_touched[i]);
        saved[i] = malloc(bytes);
        memcpy(saved[i], t->data, bytes);
    }
    double sum = 0;
    for (int64_t b = 0; b < batches; b++) {
        rt_data_val_batch(val, b, m->B, m->T, tok, tgt);
        model_feed_ids(m->tokens, tok);
        model_feed_ids(m->targets, tgt);
        Node *io[2] = {m->tokens, m->targets};
        train_dev_nodes(train_dev->push, io, 2);
        train_dev->run_phase(g, PHASE_FORWARD);
        sum += model_read_scalar(m->loss);
    }
    for (int i = 0; i < m->n_eval_touched; i++) {
        Tensor *t = &m->eval_touched[i]->t;
        memcpy(t->data, saved[i], (size_t)rt_storage_bytes(m->eval_touched[i]));
        free(saved[i]);
    }
    free(saved);
    train_dev_nodes(train_dev->push, m->eval_touched, m->n_eval_touched);
    return sum / (double)batches;
}

static int64_t train_params(const Graph *g) {
    int64_t n = 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_PARAM) n += ir_numel(&g->nodes[i]->t);
    return n;
}

/* A text file is always read through the byte-level tokenizer; a model with another
 * vocabulary still trains on it (token = byte value), which is rarely what is meant: one note. */
static void train_note_text(const TokenData *a, const TokenData *b, int64_t vocab) {
    if (vocab == RT_BYTE_VOCAB) return;
    const TokenData *ds[2] = {a, b};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < ds[k]->n_shards; i++)
            if (ds[k]->shards[i].is_text) {
                rt_note("%s: text is read as bytes (token = byte value, 0..255), while the "
                        "model's vocabulary has %lld tokens: for its tokenizer, write shards "
                        "with tools/tokenize_hf.py", ds[k]->shards[i].path, (long long)vocab);
                return;
            }
}

/* Opens --data and --val (or holds out the tail of a text --data) and checks them against the
 * batch shape and the model's vocabulary. What was decided about validation is said only once
 * the data is known to be good, so that a bad file gets its one line and nothing else. */
static bool train_open_data(const TrainOptions *o, const Model *m, TokenData *train,
                            TokenData *val) {
    memset(val, 0, sizeof *val);
    memset(train, 0, sizeof *train);
    if (!o->data) {   /* --eval-only with --val alone */
        if (rt_data_open(val, o->val) && (train_note_text(train, val, m->vocab), true) &&
            rt_data_check(val, "the validation data", (int64_t)m->T + 1, (int64_t)m->T + 1, m->vocab))
            return true;
        rt_data_free(val);
        return false;
    }
    if (!rt_data_open(train, o->data)) return false;
    bool ok = true;
    char note[512] = "";
    if (o->val) {
        ok = rt_data_open(val, o->val);
    } else if (train->is_text) {
        int64_t hold = (int64_t)((double)train->n_tokens * TRAIN_VAL_FRACTION);
        if (hold < (int64_t)m->T + 1) {
            snprintf(note, sizeof note, "no --val, and the last 5%% of %s (%lld tokens) is "
                     "shorter than one sequence: evaluation is off", o->data, (long long)hold);
        } else {
            ok = rt_data_split_tail(train, val, TRAIN_VAL_FRACTION);
            snprintf(note, sizeof note, "no --val: the last 5%% of %s (%lld tokens) is the "
                     "validation set", o->data, (long long)val->n_tokens);
        }
    } else {
        snprintf(note, sizeof note, "no --val: evaluation is off");
    }
    if (ok) train_note_text(train, val, m->vocab);
    int64_t batch_tokens = (int64_t)m->B * m->T + 1;
    int64_t window = (int64_t)m->T + 1;
    ok = ok && rt_data_check(train, "the training data", window, batch_tokens, m->vocab);
    if (ok && val->n_shards) ok = rt_data_check(val, "the validation data", window, window, m->vocab);
    if (!ok) {
        rt_data_free(val);
        rt_data_free(train);
        return false;
    }
    if (*note) rt_note("%s", note);
    return true;
}

/* Whether --out is the directory of the checkpoint --resume names (the directory itself, or
 * the one its file is in): the run it continues, whose checkpoints this run's join. Read from
 * the path alone, before the checkpoint is, and silent: --resume's own errors come later. */
static bool train_out_is_resumed_dir(const TrainOptions *o) {
    if (!o->resume || !o->out) return false;
    char dir[4096];
    struct stat a, b;
    snprintf(dir, sizeof dir, "%s", o->resume);
    if (stat(dir, &a) != 0 || !S_ISDIR(a.st_mode)) {
        char *slash = strrchr(dir, '/');
        if (!slash) snprintf(dir, sizeof dir, ".");
        else if (slash == dir) dir[1] = 0;
        else *slash = 0;
        if (stat(dir, &a) != 0) return false;
    }
    return stat(o->out, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/* Nothing a previous run wrote is lost by mistake. A run that does not resume would write
 * step_000001... and `latest` over another run's checkpoints in --out and start --log afresh,
 * so both are refused unless --overwrite says that is meant, before anything is read or
 * written. A resumed run is meant to share them with the run it continues, and only with it:
 * an --out that holds checkpoints of a run other than the one --resume names (the checkpoint
 * is not in it) would have its `latest` and its files of the same steps replaced, and is
 * refused the same way. Exit status 2, as for a flag: the fix is one. */
static bool train_check_fresh(const TrainOptions *o) {
    if (o->overwrite || o->eval_only) return true;   /* --eval-only only appends */
    char found[256];
    if (o->out && rt_ckpt_dir_holds_run(o->out, found, sizeof found)) {
        if (!o->resume) {
            rt_error("%s: holds another run's checkpoints (%s): give --resume %s to continue that "
                     "run, or --overwrite to start a new one there", o->out, found, o->out);
            return false;
        }
        if (!train_out_is_resumed_dir(o)) {
            rt_error("%s: holds another run's checkpoints (%s), not the one --resume %s continues: "
                     "give that run's directory as --out, or --overwrite to write there", o->out,
                     found, o->resume);
            return false;
        }
    }
    if (o->resume) return true;
    struct stat st;
    if (o->log && stat(o->log, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
        rt_error("%s: the log file holds another run's lines: give --resume to continue that "
                 "run, or --overwrite to start the log afresh", o->log);
        return false;
    }
    return true;
}

/* --overwrite: the old run's `latest` goes at the start, so that until this run saves, DIR
 * names no checkpoint as the one to resume (it would be the other run's). Its step files stay
 * until this run writes the same steps. */
static bool train_forget_latest(const char *dir) {
    char latest[4096];
    snprintf(latest, sizeof latest, "%s/latest", dir);
    if (unlink(latest) != 0 && errno != ENOENT) {
        rt_error("%s: cannot remove the other run's latest (--overwrite): %s", latest,
                 strerror(errno));
        return false;
    }
    return true;
}

/* --export-hf: load the state as a run would, write it in Hugging Face's layout, stop. */
static int train_export(Graph *g, const TrainOptions *o) {
    Model m;
    RtMemory mem;
    memset(&mem, 0, sizeof mem);
    int status = 1;
    if (!model_inspect(g, &m) || !rt_memory_bind(g, &mem)) goto out;
    Progress p = {.seed = o->seed};
    if (o->resume ? !train_resume(g, &m, o, &p) : !rt_init_load(g, o->init, o->seed)) goto out;
    if (rt_export_hf(g, o->export_hf, o->overwrite)) status = 0;
out:
    rt_memory_free(&mem);
    model_free(&m);
    return status;
}

/* The prompt as token ids: bytes for a byte vocabulary, else numbers separated by spaces or
 * commas. NULL after rt_error. */
static int32_t *train_prompt(const TrainOptions *o, int64_t vocab, int *n) {
    const char *text = o->prompt ? o->prompt : "\n";
    size_t len = strlen(text);
    int32_t *ids = malloc((len + 1) * sizeof *ids);
    if (!ids) return NULL;
    *n = 0;
    if (vocab == RT_BYTE_VOCAB) {
        for (size_t i = 0; i < len; i++) ids[(*n)++] = (unsigned char)text[i];
    } else {
        if (!o->prompt) {
            rt_error("--generate: the vocabulary has %lld tokens, not bytes: give the context as "
                     "--prompt 'ID ID ...'", (long long)vocab);
            free(ids);
            return NULL;
        }
        for (const char *p = text; *p;) {
            if (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n') {
                p++;
                continue;
            }
            char *end;
            errno = 0;
            long long v = strtoll(p, &end, 10);
            if (end == p || errno || v < 0 || v >= vocab) {
                rt_error("--prompt: \"%.32s\" is not a token id below the vocabulary's %lld", p,
                         (long long)vocab);
                free(ids);
                return NULL;
            }
            ids[(*n)++] = (int32_t)v;
            p = end;
        }
    }
    if (!*n) {
        rt_error("--prompt: empty: give at least one token");
        free(ids);
        return NULL;
    }
    return ids;
}

/* --logits FILE: created for writing; a non-empty file is another run's, kept unless
 * --overwrite. NULL after rt_error. */
static FILE *train_open_logits(const TrainOptions *o) {
    struct stat st;
    if (!o->overwrite && stat(o->logits, &st) == 0 && (!S_ISREG(st.st_mode) || st.st_size > 0)) {
        rt_error("%s: exists: give --overwrite to replace it (--logits)", o->logits);
        return NULL;
    }
    FILE *f = fopen(o->logits, "wb");
    if (!f) rt_error("%s: cannot create: %s (--logits)", o->logits, strerror(errno));
    return f;
}

/* --generate: load the state as a run would, sample, stop. */
static int train_generate(Graph *g, const TrainOptions *o) {
    Model m;
    RtMemory mem;
    memset(&mem, 0, sizeof mem);
    int status = 1, n_prompt = 0;
    int32_t *prompt = NULL;
    if (o->threads) ref_set_threads(o->threads);
    if (!model_inspect(g, &m)) goto out;
    if (!(prompt = train_prompt(o, m.vocab, &n_prompt))) {
        status = 2;   /* --prompt's value, refused as any flag's is */
        goto out;
    }
    if (!rt_memory_bind(g, &mem)) goto out;
    Progress p = {.seed = o->seed};
    TrainOptions quiet = *o;   /* --seed is the sampler's here, not the batches' */
    quiet.seed_given = false;
    if (o->resume) {
        if (!train_resume(g, &m, &quiet, &p)) goto out;
    } else if (o->init) {
        if (!rt_init_load(g, o->init, o->seed)) goto out;
    } else {
        rt_init_params(g, o->seed);
        rt_note("no --init or --resume: sampling from randomly initialized weights");
    }
    RtGenerate gen = {.count = o->generate, .temperature = o->temperature, .top_k = o->top_k,
                      .seed = o->seed, .text = m.vocab == RT_BYTE_VOCAB};
    if (o->logits && !(gen.logits = train_open_logits(o))) goto out;
    if (rt_generate(g, &gen, prompt, n_prompt, stdout)) status = 0;
    if (gen.logits && fclose(gen.logits) != 0) {
        rt_error("%s: cannot write: %s", o->logits, strerror(errno));
        status = 1;
    }
out:
    free(prompt);
    rt_memory_free(&mem);
    model_free(&m);
    return status;
}

/* ---------------------------------------------------------------- several GPUs (train_gpus.c) */

/* This process joins its world: the device meets the other ranks; only rank 0 speaks. */
static bool train_join(const RtDevice *d, const TrainOptions *o) {
    if (!d->comm_open) {
        rt_error("--world-size %d: --device %s cannot run data parallel (--device cuda)",
                 train_world, d->name);
        return false;
    }
    return d->comm_open(train_rank, train_world, o->comm_file, o->comm_timeout);
}

int rt_train(Graph *g, const TrainOptions *o) {
    if (o->export_hf) return train_export(g, o);
    if (o->generate) return train_generate(g, o);
    /* (a rank after 0 writes neither --out nor --log: rank 0, started at about the same
     * time with the same flags, may already have begun them) */
    if ((o->world_size <= 1 || o->rank == 0) && !train_check_fresh(o)) return 2;
    /* an appended log is cut after its last step (rt_log_trim): never a file that is no log */
    if ((o->world_size <= 1 || o->rank == 0) && o->log && (o->resume || o->eval_only) &&
        !rt_log_check_appendable(o->log))
        return 2;
    TrainOptions run;   /* a resumed training run takes its settings that are not given */
    if (o->resume && !o->eval_only) {
        run = *o;
        int bad = rt_ckpt_restore_run(g, &run);
        if (bad) return bad;
        o = &run;
    }
    if (o->gpus > 1) return train_launch(g, o);
    if (o->world_size > 1 && !train_world_device_ok(g, o->world_size, "--world-size")) return 1;
    return train_rank_run(g, o);
}

/* One rank (or the only process): ranks after 0 log nothing and write nothing. */
int train_rank_run(Graph *g, const TrainOptions *opts) {
    TrainOptions quiet_rank;
    const TrainOptions *o = opts;
    train_rank = opts->world_size > 1 ? opts->rank : 0;
    train_world = opts->world_size > 1 ? opts->world_size : 1;
    if (train_rank != 0) {
        static char name[128];
        snprintf(name, sizeof name, "%s[rank %d]", rt_program_name(), train_rank);
        rt_set_program_name(name);
        rt_set_quiet(true);
        quiet_rank = *opts;
        quiet_rank.out = NULL;
        quiet_rank.log = NULL;
        quiet_rank.save_every = 0;
        o = &quiet_rank;
    }
    Model m;
    if (!model_inspect(g, &m)) {
        model_free(&m);
        return 1;
    }
    double peak = o->lr > 0 ? o->lr : g->optim.lr;
    if (!(peak > 0)) {
        rt_error("the model sets no learning rate: give --lr");
        model_free(&m);
        return 1;
    }
    if (!isfinite((float)peak) || (float)peak == 0) {
        rt_error("artifact: the model's learning rate %g is outside f32's range: give --lr", peak);
        model_free(&m);
        return 1;
    }
    bool released = false;   /* built with --grad-release: updates read gradients, not accumulators */
    for (int i = 0; i < g->n_nodes; i++)
        if (ir_op_is_update(g->nodes[i]->op) && g->nodes[i]->in[1]->op != OP_ACCUMULATE &&
            g->nodes[i]->in[1]->op != OP_ALL_REDUCE)
            released = true;
    if (o->grad_accum > 1 && released) {
        /* built with --grad-release: there are no accumulators to sum micro-steps into */
        rt_error("this binary was built with --grad-release, which updates each parameter as soon "
                 "as its gradient exists: --grad-accum must be 1, not %d", o->grad_accum);
        model_free(&m);
        return 2;
    }
    double floor = o->min_lr >= 0 ? o->min_lr : peak / 10;
    if (floor > peak) {   /* a flag's mistake, as args.c's --min-lr above --lr is: status 2 */
        rt_error("--min-lr %g is above the peak learning rate %g", floor, peak);
        model_free(&m);
        return 2;
    }
    if (o->threads) ref_set_threads(o->threads);

    TokenData train, val;
    RtMemory mem;
    if (!train_open_data(o, &m, &train, &val)) {
        model_free(&m);
        return 1;
    }
    int status = 1;
    RtLog log = {0};
    int32_t *tok = NULL, *tgt = NULL;
    memset(&mem, 0, sizeof mem);
    int removed = 0;
    if (o->out && !rt_ckpt_open_dir(o->out, &removed)) goto out;
    if (o->out && o->overwrite && !train_out_is_resumed_dir(o) && !train_forget_latest(o->out)) goto out;
    if (removed)
        rt_note("%s: removed %d temp file%s left by interrupted saves", o->out, removed,
                removed == 1 ? "" : "s");
    double setup_t0 = train_now_ms();
    if (!rt_memory_bind(g, &mem)) goto out;

    Progress p = {.seed = o->seed};
    if (o->resume) {
        if (!train_resume(g, &m, o, &p)) goto out;
    } else if (o->init) {
        if (!rt_init_load(g, o->init, o->seed)) goto out;
    } else {
        rt_init_params(g, o->seed);
    }
    /* the steps make every value of the step arena: nothing above wrote to it */
    mem.step_blank = true;
    double state_ms = train_now_ms() - setup_t0, waited_ms = train_now_ms();
    if (o->start_after && !train_wait_for_file(o->start_after)) goto out;
    waited_ms = train_now_ms() - waited_ms;
    train_dev = rt_device_select(train_world > 1 && !strcmp(o->device, "auto") ? "cuda" : o->device);
    if (train_dev && train_world > 1 && !train_join(train_dev, o)) train_dev = NULL;
    if (!train_dev || !train_dev->open(g, &mem)) {
        train_dev = NULL;
        goto out;
    }
    if (p.step >= o->steps && !o->eval_only) {
        rt_note("the checkpoint is at step %lld and --steps is %lld: nothing to train",
                (long long)p.step, (long long)o->steps);
        status = 0;
        goto out;
    }
    if (o->log && o->resume && !o->eval_only) {
        int dropped = 0;
        if (!rt_log_trim(o->log, p.step, &dropped)) goto out;
        if (dropped)
            rt_note("%s: dropped %d line%s of steps after %lld, which this run repeats", o->log,
                    dropped, dropped == 1 ? "" : "s", (long long)p.step);
    }
    if (!rt_log_open(&log, o->log, o->resume != NULL || o->eval_only)) goto out;
    tok = malloc((size_t)m.B * m.T * sizeof *tok);
    tgt = malloc((size_t)m.B * m.T * sizeof *tgt);
    if (!tok || !tgt) {
        rt_error("out of memory");
        goto out;
    }
    int64_t mem_bytes = mem.persistent_bytes + mem.step_bytes;
    rt_note("model %s: %lld parameters, batch %d x %d, vocabulary %lld, memory %lld bytes "
            "(persistent %lld, step %lld); %lld training tokens",
            g->model_name ? g->model_name : "?", (long long)train_params(g), m.B, m.T,
            (long long)m.vocab, (long long)mem_bytes, (long long)mem.persistent_bytes,
            (long long)mem.step_bytes, (long long)train.n_tokens);
    if (train_dev != &rt_cpu_device) rt_note("device: %s", train_dev->describe());
    rt_note("set-up: %.1f s, of which the training state %.1f s (parameters made or read, "
            "optimizer states)", (train_now_ms() - setup_t0 - waited_ms) / 1000, state_ms / 1000);
    if (o->start_after) rt_note("waited %.1f s for %s (--start-after)", waited_ms / 1000, o->start_after);
    if (train_world > 1)
        rt_note("data parallel over %d ranks: a step is %d sequences (%d ranks x batch %d x %d "
                "micro-steps); rank 0 logs and writes checkpoints", train_world,
                train_world * m.B * o->grad_accum, train_world, m.B, o->grad_accum);
    else if (rt_comm_wire(g) != FMT_VOID)
        rt_note("built with comm:grad=%s: the gradients travel in it between GPUs; on one rank "
                "there is nothing to send, and the step is the one of a build without the rule",
                fmt_elem_name(rt_comm_wire(g)));
    if (o->eval_only) {
        if (!val.n_shards) {
            rt_error("--eval-only: %s holds no validation data: give --val FILE", o->data);
            status = 1;
            goto out;
        }
        double v = train_evaluate(g, &m, &val, o->eval_batches, tok, tgt);
        printf("step %lld | val_loss %.6f (%lld batches of %d x %d)\n", (long long)p.step, v,
               (long long)o->eval_batches, m.B, m.T);
        fflush(stdout);
        status = rt_log_eval(&log, p.step, v, o->eval_batches) ? 0 : 1;
        goto out;
    }

    int width = snprintf(NULL, 0, "%lld", (long long)o->steps);
    int skips = 0;
    char skip_note[128];
    status = 0;
    int64_t end = o->stop_at >= 0 && o->stop_at < o->steps ? o->stop_at : o->steps;
    if (end <= p.step) {
        if (opts->out && p.step == 0 && !train_gather(&m)) {
            status = 1;
        } else if (train_rank != 0) {   /* rank 0 writes the state */
        } else if (p.step == 0) {   /* --stop-at 0: the state before any step, to start another tool from */
            if (!train_save(g, &m, o, &p, &log)) status = 1;
        } else {
            rt_error("--stop-at %lld: the checkpoint is already at step %lld", (long long)end,
                     (long long)p.step);
            status = 1;
        }
        goto out;
    }
    for (; p.step < end; p.step++) {
        double t0 = train_now_ms();
        double lr = rt_lr_at(peak, floor, o->warmup, o->steps, p.step);
        double loss_sum = 0;
        bool finite = true;
        /* the update's inputs first: with gradient release the updates run in the backward */
        model_feed_scalar(m.lr, lr);
        model_feed_scalar(m.step, (double)(p.opt_step + 1));
        model_feed_scalar(m.grad_scale, rt_grad_scale(o->grad_accum, train_world));
        for (int micro = 0; micro < o->grad_accum; micro++) {
            rt_data_train_batch(&train, p.seed, p.step, rt_global_micro(train_rank, o->grad_accum, micro),
                                m.B, m.T, tok, tgt);
            model_feed_ids(m.tokens, tok);
            model_feed_ids(m.targets, tgt);
            Node *io[2] = {m.tokens, m.targets};
            bool (*sweep)(Graph *) = micro + 1 == o->grad_accum && train_dev->run_last_micro_step
                                         ? train_dev->run_last_micro_step : train_dev->run_micro_step;
            if (!train_dev_nodes(train_dev->push, io, 2) || !sweep(g)) {
                status = 1;
                goto out;
            }
            float loss = model_read_scalar(m.loss);
            finite &= isfinite(loss);
            loss_sum += loss;
        }
        bool grads_finite = true;
        if (finite && !model_grads_finite(&m, &grads_finite)) {
            status = 1;
            goto out;
        }
        if (train_world > 1) {
            /* the step's loss is the mean over every rank's micro-steps, and one rank's
             * non-finite loss or gradient skips the step on all of them (they stay equal) */
            double v[3] = {loss_sum, !finite, !grads_finite};
            if (!train_dev->comm_sum(v, 3)) {
                status = 1;
                goto out;
            }
            loss_sum = v[0] / train_world;
            finite = v[1] == 0;
            grads_finite = v[2] == 0;
        }
        LogRecord r = {.step = p.step + 1, .steps = o->steps, .steps_width = width,
                       .loss = loss_sum / o->grad_accum, .lr = lr, .grad_norm = NAN,
                       .mem_bytes = mem_bytes};
        if (finite && !grads_finite) {
            finite = false;
            r.skipped = "non-finite gradient";
        }
        if (finite) {
            if (!train_dev->run_phase(g, PHASE_UPDATE)) {
                status = 1;
                goto out;
            }
            r.grad_norm = model_read_scalar(m.grad_norm);
            p.opt_step++;
            skips = 0;
        } else {
            if (!r.skipped) r.skipped = "non-finite loss";
            model_zero_grads(&m);
            int backed = model_back_off_scales(&m);
            if (backed < 0) {
                status = 1;
                goto out;
            }
            if (backed > 0) {
                snprintf(skip_note, sizeof skip_note, "%s; %d delayed scales halved", r.skipped, backed);
                r.skipped = skip_note;
            }
            skips++;
        }
        r.ms = train_now_ms() - t0;
        r.tokens_per_s = (double)m.B * m.T * o->grad_accum * train_world / (r.ms / 1e3);
        bool last = p.step + 1 == o->steps;
        if (val.n_shards && ((o->eval_every && (p.step + 1) % o->eval_every == 0) || last)) {
            r.val_loss = train_evaluate(g, &m, &val, o->eval_batches, tok, tgt);
            r.has_val = true;
        }
        if (train_rank == 0 && !rt_log_step(&log, &r)) {
            status = 1;
            break;
        }
        if (skips >= TRAIN_MAX_SKIPS) {
            if (train_rank == 0)   /* every rank skipped the same steps: one says so */
                rt_log_message(&log, "error: the last %d steps all had a non-finite loss or "
                               "gradient; stopping (try a lower --lr)", skips);
            status = 1;
            break;
        }
        Progress done = p;
        done.step++;
        /* every rank decides alike (opts: rank 0's options), since the gather is collective */
        bool save = opts->out && ((opts->save_every && done.step % opts->save_every == 0) || last ||
                                  done.step == end);
        if (save && (!train_gather(&m) || (o->out && !train_save(g, &m, o, &done, &log)))) {
            status = 1;
            break;
        }
    }
    /* the ranks part together: none closes its connections while another may still read from
     * them, and a rank that failed (it skips this) ends the others' wait at once */
    double parting = 0;
    if (status == 0 && train_world > 1 && !train_dev->comm_sum(&parting, 1)) status = 1;
out:
    if (train_dev) train_dev->close();
    train_dev = &rt_cpu_device;
    if (!rt_log_close(&log)) status = 1;
    free(tok);
    free(tgt);
    rt_memory_free(&mem);
    rt_data_free(&val);
    rt_data_free(&train);
    model_free(&m);
    return status;
}
