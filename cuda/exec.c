/* exec.c — the CUDA executor: the plan's arenas on the device and each phase as a graph.
 *
 * Memory is two allocations, as the memory plan says (llm.c, ggml-alloc): the persistent
 * arena and the step arena, whose tail holds the backend's workspace — cuBLASLt's workspace,
 * the scratch the node plans ask for (one region, reused by every node, since nodes run one
 * after another on one stream), and the pointer tables and flags the launches read. Free
 * memory is checked before anything is allocated, and a plan that does not fit gets one line
 * with the numbers. Every tensor keeps its arena offset on the device, so the host arenas
 * mirror the device ones byte for byte and moving a tensor is one copy at the same offset.
 *
 * Each phase of the step (evaluation: the forward nodes; a micro-step: forward and backward
 * in schedule order; the update) is a list of launches built once: library kernels with their
 * argument blocks resolved to device pointers, and cuBLASLt matmuls whose algorithms were
 * chosen at set-up: the heuristic's candidates are timed on the arenas before they are filled,
 * once per shape (FP8C_CUDA_TUNE=0: its first choice), unless the artifact holds the
 * algorithms of a tuning record (below: a tuned binary times nothing). A GEMM whose fuse group its epilogue
 * computes replaces the group's adds (spec_fuse.c's cuda_plan_epilogues); one launch runs a run of
 * small update nodes (batched launches, below). The first run of a phase captures the list in
 * a CUDA graph; later runs replay it, so a step costs a handful of driver calls however many kernels
 * it has. Inputs change between runs only in their bytes (the arenas never move), which is
 * what makes replay valid. FP8C_CUDA_GRAPHS=0 launches directly; FP8C_CUDA_SYNC=1 also
 * synchronizes after every launch and names the node of the first failing one. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_internal.h"

#define CUBLAS_WORKSPACE (32 << 20)
#define ALIGN 256
#define GEMM_CANDIDATES 8       /* algorithms the heuristic offers for timing */
#define GEMM_TUNE_RUNS 5
#define GEMM_WIDE 32            /* algorithms the heuristic offers in the tuning mode */
#define GEMM_TIMED_RUNS 7       /* timed runs of each in the tuning mode: median, min, max */
#define GEMM_TUNE_AT_STEP 2     /* the micro-step whose GEMMs the tuning mode times */

typedef struct {
    CuLaunchKind kind;
    const Node *node;
    const char *fn;
    CUfunction f;
    unsigned grid[2], block, smem;
    CkArgs args;
    bool batched;                         /* runs batch (below) instead of args */
    CkBatch batch;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatrixLayout_t lc;            /* C's own layout where it differs from D's: an FP8 D */
    cublasLtMatmulAlgo_t algo;
    const void *A, *B, *C;
    void *D;
    float beta;
    const CuGemm *gemm;                   /* the plan's GEMM (its shape, for the tuning mode) */
    cublasLtMatmulHeuristicResult_t *cands;   /* the tuning mode: the heuristic's wide list */
    int n_cands;
} ExecLaunch;

/* A GEMM's algorithm, timed once for every GEMM with the same key (shapes, types, layouts,
 * epilogue and alignments): the layers of a model share a handful of keys. */
typedef struct {
    uint64_t key;
    cublasLtMatmulAlgo_t algo;
} TunedGemm;

/* FP8C_CUDA_PROFILE=1: every launch timed with events (no graphs), summed by kernel */
typedef struct {
    char key[96];
    double ms;
    long calls;
} ProfRow;

typedef struct {
    ExecLaunch *l;
    int n, cap;
    CUgraph graph;
    CUgraphExec exec;
    bool captured;
} ExecList;

enum { LIST_EVAL, LIST_MICRO, LIST_UPDATE, LIST_FINITE, LIST_COUNT };

/* A gradient the update averages over the ranks first (an ALL_REDUCE node, comm.c): NCCL's,
 * enqueued on the executor's stream before the update's graph, outside its capture, so that
 * NCCL's own connection set-up on first use never runs inside a capture. */
typedef struct {
    const Node *node;
    CUdeviceptr p;
    int64_t count;
    ElemType elem;
    int order;                            /* the accumulator's place: the backward's order */
} ExecReduce;

struct CudaExec {
    Graph *g;
    RtMemory host;
    Arena *arena;
    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
    CUmodule module;
    cublasLtHandle_t lt;
    bool have_ctx, have_lt;
    CUdeviceptr persistent, step;
    int64_t step_alloc;                   /* step arena + workspace */
    CUdeviceptr cublas_ws, scratch, aux;
    int64_t scratch_bytes, aux_bytes, aux_used;
    CuNodePlan *node_plans;               /* one node each (cuda_exec_run_node) */
    CuNodePlan *plans;                    /* the phases': GEMM epilogues fused */
    int n_epilogues;                      /* GEMMs in plans with a fused epilogue */
    int n_gelu, n_dgelu, n_fp8_results;   /* of them: GELU, GELU's backward, an FP8 D */
    ExecList lists[LIST_COUNT];
    int *batch_run;                       /* per node: nodes in the batched run it starts, else 0 */
    int finite_flag_off;                  /* in aux */
    int ticket_off;                       /* in aux: the kernels' last-block counter */
    bool graphs, sync_each, profile;
    bool tune;                            /* time the heuristic's candidates (set-up only) */
    bool fast_accum_all;                  /* FP8C_CUDA_FAST_ACCUM=all: gradient GEMMs too */
    TunedGemm *tuned;
    int n_tuned, cap_tuned;
    ExecReduce *reduce;                   /* the gradients to average (several ranks only) */
    int n_reduce, cap_reduce;
    const char *tune_report;              /* FP8C_TUNE_GEMMS: the tuning mode's report file */
    int micro_runs;
    bool stored_algos;                    /* the artifact's tune.device is this GPU: use its algorithms */
    int n_stored, n_stored_failed, n_unstored;
    char desc[512];                       /* cuda_device_description's */
    ProfRow *prof;
    int n_prof, cap_prof;
    double prof_total;
    FILE *trace;                          /* FP8C_CUDA_TRACE: every profiled launch, one line */
    int trace_run;
    char name[256];
};

static int64_t align_up(int64_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }

/* room for one more item in a growing array of n items (capacity *cap, doubled when full) */
static bool grow(void **items, int *cap, int n, size_t size) {
    if (n < *cap) return true;
    int more = *cap ? 2 * *cap : 64;
    void *grown = realloc(*items, size * (size_t)more);
    if (!grown) return false;
    *items = grown;
    *cap = more;
    return true;
}

static bool env_flag(const char *name, bool dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    return strcmp(v, "0") != 0;
}

/* ---------------------------------------------------------------- pointers */

/* The device address of host mirror bytes p (inside one of the host arenas). */
static bool exec_map(const CudaExec *e, const void *p, CUdeviceptr *out) {
    const char *c = p;
    const char *hp = e->host.persistent, *hs = e->host.step;
    if (!p) {
        *out = 0;
        return true;
    }
    if (hp && c >= hp && c <= hp + e->host.persistent_bytes) {
        *out = e->persistent + (CUdeviceptr)(c - hp);
        return true;
    }
    if (hs && c >= hs && c <= hs + e->host.step_bytes) {
        *out = e->step + (CUdeviceptr)(c - hs);
        return true;
    }
    return false;
}

static bool exec_map_tensor(const CudaExec *e, const Tensor *t, CUdeviceptr *out) {
    if (exec_map(e, t->data, out)) return true;
    rt_error("CUDA executor: tensor '%s' is not in the plan's arenas", t->name ? t->name : "unnamed");
    return false;
}

static int64_t tensor_bytes(const Tensor *t) { return ir_numel(t) * fmt_elem_bytes(t->fmt.elem); }

static bool exec_resolve(CudaExec *e, const CuLaunch *l, CkArgs *a, CUdeviceptr scratch_base) {
    *a = l->args;
    for (int k = 0; k < CK_MAX_TENSORS; k++) {
        const CuRef *r = &l->ref[k];
        CUdeviceptr p = 0;
        if (r->node) {
            if (!exec_map_tensor(e, &r->node->t, &p)) return false;
            if (l->ref_scale[k]) {
                CUdeviceptr s;
                if (!exec_map_tensor(e, &r->node->t.fmt.scale->t, &s)) return false;
                a->t[k].s = (const void *)(uintptr_t)s;
            }
        } else if (r->scratch >= 0) {
            p = scratch_base + (CUdeviceptr)r->scratch;
        }
        a->t[k].p = (void *)(uintptr_t)p;
    }
    a->scratch = l->scratch >= 0 ? (void *)(uintptr_t)(scratch_base + (CUdeviceptr)l->scratch) : NULL;
    a->ticket = (unsigned *)(uintptr_t)(e->aux + (CUdeviceptr)e->ticket_off);
    return true;
}

static CUdeviceptr ref_ptr(CudaExec *e, const CuRef *r, bool *ok) {
    CUdeviceptr p = 0;
    if (r->node) {
        *ok &= exec_map_tensor(e, &r->node->t, &p);
        p += (CUdeviceptr)r->offset;
    } else {
        p = e->scratch + (CUdeviceptr)r->scratch;
    }
    return p;
}

/* ---------------------------------------------------------------- GEMMs */

static cudaDataType_t lt_type(ElemType t) {
    switch (t) {
    case FMT_BF16: return CUDA_R_16BF;
    case FMT_F16: return CUDA_R_16F;
    case FMT_E4M3: return CUDA_R_8F_E4M3;
    case FMT_E5M2: return CUDA_R_8F_E5M2;
    default: return CUDA_R_32F;
    }
}

static void exec_free_gemm(ExecLaunch *x) {
    free(x->cands);
    x->cands = NULL;
    x->n_cands = 0;
    if (x->la) CU(cublasLtMatrixLayoutDestroy)(x->la);
    if (x->lb) CU(cublasLtMatrixLayoutDestroy)(x->lb);
    if (x->ld) CU(cublasLtMatrixLayoutDestroy)(x->ld);
    if (x->lc) CU(cublasLtMatrixLayoutDestroy)(x->lc);
    if (x->desc) CU(cublasLtMatmulDescDestroy)(x->desc);
    x->la = x->lb = x->ld = x->lc = NULL;
    x->desc = NULL;
}

/* x's matmul with algorithm algo, on the stream */
static cublasStatus_t exec_run_gemm(CudaExec *e, const ExecLaunch *x, const cublasLtMatmulAlgo_t *algo) {
    float alpha = 1.0f;
    return CU(cublasLtMatmul)(e->lt, x->desc, &alpha, x->A, x->la, x->B, x->lb, &x->beta, x->C, x->lc ? x->lc : x->ld, x->D,
                              x->ld, algo, (void *)(uintptr_t)e->cublas_ws, CUBLAS_WORKSPACE,
                              (cudaStream_t)e->stream);
}

/* What makes two GEMMs the same problem for cuBLASLt: shapes, types, layouts, epilogue and the
 * operands' alignments. The layers of a model share a handful of keys. */
static uint64_t gemm_key(const CuGemm *g, const void *const *ptrs) {
    int64_t what[24] = {g->m, g->n, g->k, g->lda, g->ldb, g->ldd, g->ta, g->tb, g->atype, g->btype,
                        g->dtype, g->bias.node != NULL, g->biastype, g->c.node != NULL,
                        g->scales >= 0 ? 1 + g->scale_a * 4 + g->scale_b : 0, g->fast_accum,
                        g->act, g->act ? g->auxtype : 0, g->dscale.node != NULL, g->amax >= 0};
    for (int i = 0; i < 4; i++) what[20 + i] = (int64_t)((uintptr_t)ptrs[i] & 255);
    return cuda_hash(0, what, sizeof what);
}

/* The fastest of the heuristic's candidates for x, timed on the arenas (set-up only: the runs
 * write D, and the arenas are filled from the host afterwards), once per key. */
static bool exec_tune_gemm(CudaExec *e, ExecLaunch *x, const CuGemm *g, const void *const *ptrs,
                           const cublasLtMatmulHeuristicResult_t *res, int found) {
    uint64_t key = gemm_key(g, ptrs);
    for (int i = 0; i < e->n_tuned; i++)
        if (e->tuned[i].key == key) {
            x->algo = e->tuned[i].algo;
            return true;
        }
    CUevent ev[2];
    if (!CU_CHECK(CU(cuEventCreate)(&ev[0], 0)) || !CU_CHECK(CU(cuEventCreate)(&ev[1], 0))) return false;
    float best = -1;
    for (int c = 0; c < found; c++) {
        float ms = 0;
        bool ran = exec_run_gemm(e, x, &res[c].algo) == CUBLAS_STATUS_SUCCESS &&
                   CU(cuStreamSynchronize)(e->stream) == CUDA_SUCCESS;
        if (!ran) continue;   /* a candidate that does not run is not chosen */
        bool timed = CU_CHECK(CU(cuEventRecord)(ev[0], e->stream));
        for (int r = 0; timed && r < GEMM_TUNE_RUNS; r++)
            timed = exec_run_gemm(e, x, &res[c].algo) == CUBLAS_STATUS_SUCCESS;
        timed = timed && CU_CHECK(CU(cuEventRecord)(ev[1], e->stream)) && CU_CHECK(CU(cuEventSynchronize)(ev[1])) &&
                CU_CHECK(CU(cuEventElapsedTime)(&ms, ev[0], ev[1]));
        if (timed && (best < 0 || ms < best)) {
            best = ms;
            x->algo = res[c].algo;
        }
    }
    CU(cuEventDestroy_v2)(ev[0]);
    CU(cuEventDestroy_v2)(ev[1]);
    if (!grow((void **)&e->tuned, &e->cap_tuned, e->n_tuned, sizeof *e->tuned)) return false;
    e->tuned[e->n_tuned++] = (TunedGemm){key, x->algo};
    return CU_CHECK(CU(cuStreamSynchronize)(e->stream));
}

static bool exec_launch(CudaExec *e, const ExecLaunch *x);

/* ---------------------------------------------------------------- tuned algorithms
 *
 * A tuning record (fp8c tune, compiler/tune.c) stores the algorithm of every GEMM problem in
 * the artifact's choice table, as `gemm.KEY` = the 64 bytes of cublasLtMatmulAlgo_t in hex, KEY
 * being gemm_key's 16 hex digits (shapes, types, layouts, epilogue, operand alignments). A key,
 * not a node number: the GEMMs of a model's layers share one entry, and the entry still finds
 * its GEMMs when another choice (the loss's chunk count) renumbers the nodes. The algorithm
 * is valid only for the cuBLASLt and GPU it was found on, so it is used only where tune.device
 * names this GPU (cuda_device_description's fingerprint), and only after
 * cublasLtMatmulAlgoCheck accepts it for this matmul's descriptors with a workspace that fits;
 * else the heuristic's first choice runs, and a note says how many fell back. Nothing is timed
 * at start-up in a tuned binary, so it computes the same bits on every run. */

static void gemm_choice_name(const ExecLaunch *x, char *out, size_t len) {
    const void *ptrs[4] = {x->A, x->B, x->C, x->D};
    snprintf(out, len, "gemm.%016llx", (unsigned long long)gemm_key(x->gemm, ptrs));
}

static void algo_to_hex(const cublasLtMatmulAlgo_t *a, char *out) {
    const unsigned char *b = (const unsigned char *)a;
    for (size_t i = 0; i < sizeof *a; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
}

static bool algo_from_hex(const char *hex, cublasLtMatmulAlgo_t *a) {
    if (strlen(hex) != 2 * sizeof *a) return false;
    unsigned char *b = (unsigned char *)a;
    for (size_t i = 0; i < sizeof *a; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return false;
        b[i] = (unsigned char)v;
    }
    return true;
}

static bool exec_stored_algo(CudaExec *e, ExecLaunch *x) {
    if (!e->stored_algos) return false;
    char name[64];
    gemm_choice_name(x, name, sizeof name);
    const char *hex = ir_choice(e->g, name);
    if (!hex) {   /* a problem the tuning run did not meet */
        e->n_unstored++;
        return false;
    }
    cublasLtMatmulAlgo_t algo;
    cublasLtMatmulHeuristicResult_t check;
    memset(&check, 0, sizeof check);
    if (algo_from_hex(hex, &algo) &&
        CU(cublasLtMatmulAlgoCheck)(e->lt, x->desc, x->la, x->lb, x->lc ? x->lc : x->ld, x->ld, &algo, &check) ==
            CUBLAS_STATUS_SUCCESS &&
        check.state == CUBLAS_STATUS_SUCCESS && check.workspaceSize <= CUBLAS_WORKSPACE) {
        x->algo = algo;
        e->n_stored++;
        return true;
    }
    e->n_stored_failed++;
    return false;
}

static void algo_label(const cublasLtMatmulAlgo_t *a, char *out, size_t len) {
    int32_t id = -1;
    uint32_t tile = 0, stages = 0, splitk = 0;
    size_t w;
    CU(cublasLtMatmulAlgoConfigGetAttribute)(a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &w);
    CU(cublasLtMatmulAlgoConfigGetAttribute)(a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
    CU(cublasLtMatmulAlgoConfigGetAttribute)(a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &w);
    CU(cublasLtMatmulAlgoConfigGetAttribute)(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &w);
    snprintf(out, len, "algo %d tile %u stages %u splitk %u", id, tile, stages, splitk);
}

bool cuda_device_description(char *out, size_t len) {
    if (!cuda_load(NULL, 0)) return false;
    CUdevice dev;
    char name[256] = "?";
    int sms = 0, driver = 0;
    if (CU(cuDeviceGet)(&dev, 0) != CUDA_SUCCESS) return false;
    CU(cuDeviceGetName)(name, sizeof name, dev);
    CU(cuDeviceGetAttribute)(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    CU(cuDriverGetVersion)(&driver);
    snprintf(out, len, "%s; %d SMs; driver CUDA %d.%d; cuBLASLt %zu", name, sms, driver / 1000,
             driver % 1000 / 10, CU(cublasLtGetVersion)());
    return true;
}

/* ---------------------------------------------------------------- the tuning mode
 *
 * FP8C_TUNE_GEMMS=FILE (set by fp8c tune): every GEMM keeps the heuristic's wide list
 * (GEMM_WIDE candidates), and at micro-step GEMM_TUNE_AT_STEP, when every operand holds real
 * data and the scales are those of training, each GEMM of the step is tried with each
 * candidate in its place: D is saved, then for each candidate restored and computed twice
 * (the two must be bit-identical: an algorithm whose split reduction is not deterministic is
 * rejected), compared with the default algorithm's D (normalized max error, within one unit
 * of D's format: 1e-4 f32, 1e-2 bf16/f16, 0.13 e4m3, 0.26 e5m2), and timed GEMM_TIMED_RUNS
 * times with events. D is then restored and the step goes on with the default algorithm, so
 * the run's losses are the defaults'. GEMMs with the same key (gemm_key: the layers of a model
 * repeat a handful of problems) are timed once, and every one of them is reported with those
 * candidates and times. The report, JSON, lists every GEMM; fp8c picks the winners. */

typedef struct {
    uint64_t key;
    char *entry;        /* the report's entry but its "what" count and closing brace, JSON */
    int count;          /* GEMMs of the step with this key */
} TimedKey;

static double gemm_tolerance(ElemType t) {
    return t == FMT_F32 ? 1e-4 : t == FMT_E4M3 ? 0.13 : t == FMT_E5M2 ? 0.26 : 1e-2;
}

static int compare_floats(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef struct {
    float median, min, max;
    double diff;
    bool ran, deterministic;
} GemmTrial;

static bool exec_trial(CudaExec *e, const ExecLaunch *x, const cublasLtMatmulAlgo_t *algo, const void *saved,
                       void *out, void *again, const float *ref, float *decoded, int64_t count, size_t bytes,
                       CUevent ev[2], GemmTrial *t) {
    CUdeviceptr D = (CUdeviceptr)(uintptr_t)x->D;
    memset(t, 0, sizeof *t);
    for (int pass = 0; pass < 2; pass++) {
        if (!CU_CHECK(CU(cuMemcpyHtoD_v2)(D, saved, bytes))) return false;
        if (exec_run_gemm(e, x, algo) != CUBLAS_STATUS_SUCCESS) return CU_CHECK(CU(cuStreamSynchronize)(e->stream));
        if (!CU_CHECK(CU(cuStreamSynchronize)(e->stream)) ||
            !CU_CHECK(CU(cuMemcpyDtoH_v2)(pass ? again : out, D, bytes)))
            return false;
    }
    t->ran = true;
    t->deterministic = !memcmp(out, again, bytes);
    if (ref) {
        num_decode(x->gemm->dtype, out, decoded, count);
        double worst = 0, scale = 0;
        for (int64_t i = 0; i < count; i++) {
            if (fabs(ref[i]) > scale) scale = fabs(ref[i]);
            double d = fabs((double)decoded[i] - ref[i]);
            if (!(d <= worst)) worst = d;   /* NaN counts as the worst */
        }
        t->diff = scale > 0 ? worst / scale : worst;
    }
    float ms[GEMM_TIMED_RUNS];
    for (int r = 0; r < GEMM_TIMED_RUNS; r++) {
        if (!CU_CHECK(CU(cuEventRecord)(ev[0], e->stream)) || exec_run_gemm(e, x, algo) != CUBLAS_STATUS_SUCCESS ||
            !CU_CHECK(CU(cuEventRecord)(ev[1], e->stream)) || !CU_CHECK(CU(cuEventSynchronize)(ev[1])) ||
            !CU_CHECK(CU(cuEventElapsedTime)(&ms[r], ev[0], ev[1])))
            return false;
    }
    qsort(ms, GEMM_TIMED_RUNS, sizeof *ms, compare_floats);
    t->median = ms[GEMM_TIMED_RUNS / 2] * 1000, t->min = ms[0] * 1000, t->max = ms[GEMM_TIMED_RUNS - 1] * 1000;
    return true;
}

static bool exec_tune_report_gemm(CudaExec *e, const ExecLaunch *x, TimedKey *timed, int *n_timed) {
    const CuGemm *g = x->gemm;
    char name[64], hex[2 * sizeof(cublasLtMatmulAlgo_t) + 1], chex[sizeof hex], label[96];
    gemm_choice_name(x, name, sizeof name);
    algo_to_hex(&x->algo, hex);   /* the default's */
    const Node *n = g->d.node ? g->d.node : x->node;
    const void *ptrs[4] = {x->A, x->B, x->C, x->D};
    uint64_t key = gemm_key(g, ptrs);
    char what[256];
    snprintf(what, sizeof what, "%s %s: %s x %s -> %s, m %lld n %lld k %lld", ir_op_info(n->op)->text,
             n->t.name ? n->t.name : "", fmt_elem_name(g->atype), fmt_elem_name(g->btype), fmt_elem_name(g->dtype),
             (long long)g->m, (long long)g->n, (long long)g->k);
    for (int i = 0; i < *n_timed; i++)
        if (timed[i].key == key) {   /* the same problem as one timed already */
            timed[i].count++;
            return true;
        }
    int64_t count = (g->n - 1) * g->ldd + g->m;
    size_t bytes = (size_t)count * (size_t)fmt_elem_bytes(g->dtype);
    void *saved = malloc(bytes), *out = malloc(bytes), *again = malloc(bytes);
    float *ref = malloc(sizeof *ref * (size_t)count), *decoded = malloc(sizeof *decoded * (size_t)count);
    CUevent ev[2] = {0};
    bool ok = saved && out && again && ref && decoded && CU_CHECK(CU(cuStreamSynchronize)(e->stream)) &&
              CU_CHECK(CU(cuMemcpyDtoH_v2)(saved, (CUdeviceptr)(uintptr_t)x->D, bytes)) &&
              CU_CHECK(CU(cuEventCreate)(&ev[0], 0)) && CU_CHECK(CU(cuEventCreate)(&ev[1], 0));
    GemmTrial def;
    ok = ok && exec_trial(e, x, &x->algo, saved, out, again, NULL, decoded, count, bytes, ev, &def) && def.ran;
    if (ok) num_decode(g->dtype, out, ref, count);
    char *list = NULL;
    size_t list_len = 0;
    FILE *cands = ok ? open_memstream(&list, &list_len) : NULL;
    ok = ok && cands;
    double tol = gemm_tolerance(g->dtype);
    int written = 0;
    for (int c = 0; ok && c < x->n_cands; c++) {
        const cublasLtMatmulAlgo_t *algo = &x->cands[c].algo;
        GemmTrial t;
        bool same = !memcmp(algo, &x->algo, sizeof *algo);
        if (same) t = def, t.diff = 0;
        else if (!exec_trial(e, x, algo, saved, out, again, ref, decoded, count, bytes, ev, &t)) ok = false;
        if (!ok || !t.ran) continue;
        algo_to_hex(algo, chex);
        algo_label(algo, label, sizeof label);
        bool good = t.deterministic && t.diff <= tol;
        fprintf(cands, "%s\n      {\"value\": \"%s\", \"label\": \"%s\", \"median\": %.3f, \"min\": %.3f, "
                   "\"max\": %.3f, \"max_rel_diff\": %.3g, \"ok\": %s%s}",
                written++ ? "," : "", chex, label, t.median, t.min, t.max, isfinite(t.diff) ? t.diff : 1e30,
                good ? "true" : "false", t.deterministic ? "" : ", \"note\": \"not deterministic\"");
    }
    if (cands) fclose(cands);
    size_t size = ok ? strlen(list) + strlen(name) + strlen(hex) + strlen(what) + 64 : 0;
    char *entry = ok ? malloc(size) : NULL;
    if (entry) {
        snprintf(entry, size, "{\"name\": \"%s\", \"default\": \"%s\", \"candidates\": [%s], \"what\": \"%s", name, hex,
                 list, what);
        timed[(*n_timed)++] = (TimedKey){key, entry, 1};
    } else {
        ok = false;
    }
    free(list);
    /* the step goes on from D as it was, with the default algorithm */
    ok = ok && CU_CHECK(CU(cuMemcpyHtoD_v2)((CUdeviceptr)(uintptr_t)x->D, saved, bytes));
    if (ev[0]) CU(cuEventDestroy_v2)(ev[0]);
    if (ev[1]) CU(cuEventDestroy_v2)(ev[1]);
    free(saved), free(out), free(again), free(ref), free(decoded);
    return ok;
}

/* The micro-step of the tuning mode: launch by launch, each GEMM tried first. */
static bool exec_run_tuning(CudaExec *e, ExecList *L) {
    FILE *f = fopen(e->tune_report, "w");
    if (!f) {
        rt_error("FP8C_TUNE_GEMMS=%s: cannot write the report: %s", e->tune_report, strerror(errno));
        return false;
    }
    fputs("{\"device\": {\"description\": \"", f);
    for (const char *p = e->desc; *p; p++) fprintf(f, *p == '"' || *p == '\\' ? "\\%c" : "%c", *p);
    fputs("\"},\n  \"gemms\": [", f);
    int n_timed = 0;
    TimedKey *timed = calloc((size_t)(L->n ? L->n : 1), sizeof *timed);
    bool ok = timed != NULL;
    for (int i = 0; ok && i < L->n; i++) {
        const ExecLaunch *x = &L->l[i];
        if (x->kind == CU_GEMM && x->n_cands > 0) ok = exec_tune_report_gemm(e, x, timed, &n_timed);
        ok = ok && exec_launch(e, x);
    }
    for (int i = 0; i < n_timed; i++) {
        fprintf(f, "%s\n    %s, %d GEMM%s of the step\"}", i ? "," : "", timed[i].entry, timed[i].count,
                timed[i].count == 1 ? "" : "s");
        free(timed[i].entry);
    }
    free(timed);
    fputs("\n  ]}\n", f);
    if (fclose(f) != 0) ok = false;
    if (!ok) rt_error("FP8C_TUNE_GEMMS=%s: the GEMMs could not all be timed", e->tune_report);
    return ok;
}

/* Sets up one cuBLASLt matmul and picks its algorithm. *no_algo (when given) says that the
 * heuristic had none, without a message: the caller falls back to plain GEMMs. */
static bool exec_setup_gemm_of(CudaExec *e, const CuLaunch *l, ExecLaunch *x, bool *no_algo) {
    const CuGemm *g = &l->gemm;
    bool ok = true;
    x->gemm = g;
    x->A = (const void *)(uintptr_t)ref_ptr(e, &g->a, &ok);
    x->B = (const void *)(uintptr_t)ref_ptr(e, &g->b, &ok);
    x->D = (void *)(uintptr_t)ref_ptr(e, &g->d, &ok);
    x->C = g->c.node ? (const void *)(uintptr_t)ref_ptr(e, &g->c, &ok) : x->D;
    x->beta = g->c.node ? 1.0f : 0.0f;
    const void *bias = g->bias.node ? (const void *)(uintptr_t)ref_ptr(e, &g->bias, &ok) : NULL;
    const void *aux = g->act ? (const void *)(uintptr_t)ref_ptr(e, &g->aux, &ok) : NULL;
    const void *dscale = g->dscale.node ? (const void *)(uintptr_t)ref_ptr(e, &g->dscale, &ok) : NULL;
    const void *amax = g->amax >= 0 ? (const void *)(uintptr_t)(e->scratch + (CUdeviceptr)g->amax) : NULL;
    bool d_fp8 = g->dtype == FMT_E4M3 || g->dtype == FMT_E5M2;
    /* An FP8 D takes a bf16 C, which with beta = 0 is never read, but cuBLASLt runs none of its
     * algorithms when C's pointer is D's (seen with cuBLAS 13.1): the aux matrix stands in. */
    if (d_fp8 && !g->c.node) x->C = aux;
    if (!ok) return false;
    if (d_fp8 && !x->C) {
        rt_error("an FP8 GEMM result without a bf16 matrix for C (node %%%d)", x->node->id);
        return false;
    }
    cublasOperation_t ta = g->ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (!LT_CHECK(CU(cublasLtMatmulDescCreate)(&x->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
        !LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta)) ||
        !LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb)))
        return false;
    cublasLtEpilogue_t epi = g->act == CU_ACT_GELU ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                           : g->act == CU_ACT_DGELU ? CUBLASLT_EPILOGUE_DGELU
                           : bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    if (epi != CUBLASLT_EPILOGUE_DEFAULT &&
        !LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi)))
        return false;
    if (bias) {
        cudaDataType_t bt = lt_type(g->biastype);
        if (!LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias)) ||
            !LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt)))
            return false;
    }
    if (aux) {
        int64_t ld = g->m;
        cudaDataType_t at = lt_type(g->auxtype);
        if (!LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux)) ||
            !LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld)) ||
            !LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &at, sizeof at)))
            return false;
    }
    if (dscale && !LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &dscale,
                                                                sizeof dscale)))
        return false;
    if (amax && !LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &amax,
                                                              sizeof amax)))
        return false;
    bool per_tensor = g->scale_a == CU_SCALE_TENSOR && g->scale_b == CU_SCALE_TENSOR;
    if (g->fast_accum || (e->fast_accum_all && g->scales >= 0 && per_tensor)) {
        int8_t fast = 1;
        if (!LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast)))
            return false;
    }
    if (g->scales >= 0) {
        /* cuBLASLt multiplies by these: the dequantization scales 1/s */
        const float *sa = (const float *)(uintptr_t)(e->scratch + (CUdeviceptr)g->scales);
        const float *sb = (const float *)(uintptr_t)(e->scratch + (CUdeviceptr)g->scales_b);
        if (!LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa)) ||
            !LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb)))
            return false;
        if (!per_tensor) {
            /* grouped scales (cuBLAS 12.9 and later, Hopper) */
            static const cublasLtMatmulMatrixScale_t lt_mode[] = {
                CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
                CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F};
            cublasLtMatmulMatrixScale_t ma = lt_mode[g->scale_a], mb = lt_mode[g->scale_b];
            if (!LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma)) ||
                !LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb)))
                return false;
        }
    }
    if (!LT_CHECK(CU(cublasLtMatrixLayoutCreate)(&x->la, lt_type(g->atype), (uint64_t)(g->ta ? g->k : g->m),
                                                 (uint64_t)(g->ta ? g->m : g->k), g->lda)) ||
        !LT_CHECK(CU(cublasLtMatrixLayoutCreate)(&x->lb, lt_type(g->btype), (uint64_t)(g->tb ? g->n : g->k),
                                                 (uint64_t)(g->tb ? g->k : g->n), g->ldb)) ||
        !LT_CHECK(CU(cublasLtMatrixLayoutCreate)(&x->ld, lt_type(g->dtype), (uint64_t)g->m,
                                                 (uint64_t)g->n, g->ldd)))
        return false;
    if (d_fp8 && !LT_CHECK(CU(cublasLtMatrixLayoutCreate)(&x->lc, CUDA_R_16BF, (uint64_t)g->m, (uint64_t)g->n, g->ldd)))
        return false;
    cublasLtMatmulPreference_t pref;
    uint64_t ws = CUBLAS_WORKSPACE;
    if (!LT_CHECK(CU(cublasLtMatmulPreferenceCreate)(&pref))) return false;
    ok = LT_CHECK(CU(cublasLtMatmulPreferenceSetAttribute)(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    /* the heuristic assumes 256-byte aligned matrices unless told otherwise; an algorithm
     * chosen for alignment the pointers do not have fails at launch */
    const void *ptrs[4] = {x->A, x->B, x->C, x->D};
    const cublasLtMatmulPreferenceAttributes_t which[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; ok && i < 4; i++) {
        uint32_t align = 256;
        while (align > 1 && (uintptr_t)ptrs[i] % align) align /= 2;
        ok = LT_CHECK(CU(cublasLtMatmulPreferenceSetAttribute)(pref, which[i], &align, sizeof align));
    }
    cublasLtMatmulHeuristicResult_t res[GEMM_WIDE];
    int found = 0;
    memset(res, 0, sizeof res);
    if (ok) {
        int want = no_algo ? 1 : e->tune_report ? GEMM_WIDE : e->tune ? GEMM_CANDIDATES : 1;
        cublasStatus_t r = CU(cublasLtMatmulAlgoGetHeuristic)(e->lt, x->desc, x->la, x->lb, x->lc ? x->lc : x->ld,
                                                             x->ld, pref, want, res, &found);
        /* an epilogue it lacks (cuBLAS 13.1 answers INVALID_VALUE for some) */
        if ((r == CUBLAS_STATUS_NOT_SUPPORTED || r == CUBLAS_STATUS_INVALID_VALUE) && no_algo) found = 0;
        else ok = LT_CHECK(r);
    }
    CU(cublasLtMatmulPreferenceDestroy)(pref);
    if (ok && found < 1 && no_algo) {
        *no_algo = true;
        ok = false;
    } else if (ok && found < 1) {
        const Node *n = l->gemm.d.node ? l->gemm.d.node : x->node;
        rt_error("cuBLASLt has no algorithm for matmul %%%d %s (%s x %s -> %s, m %lld n %lld k %lld)",
                 n->id, n->t.name ? n->t.name : "", fmt_elem_name(g->atype), fmt_elem_name(g->btype),
                 fmt_elem_name(g->dtype), (long long)g->m, (long long)g->n, (long long)g->k);
        ok = false;
    }
    x->algo = res[0].algo;
    if (!ok || no_algo) return ok;
    if (exec_stored_algo(e, x)) return true;
    if (e->tune_report) {   /* the tuning mode tries them all at its micro-step */
        x->cands = malloc(sizeof *x->cands * (size_t)found);
        if (!x->cands) return false;
        memcpy(x->cands, res, sizeof *x->cands * (size_t)found);
        x->n_cands = found;
        return true;
    }
    if (found > 1 && e->tune) ok = exec_tune_gemm(e, x, g, ptrs, res, found);
    return ok;
}

/* exec_setup_gemm_of, and when a library call fails, a line naming the GEMM it was for: the
 * node, where the model file made it, its operand formats and shape */
static bool exec_setup_gemm(CudaExec *e, const CuLaunch *l, ExecLaunch *x, bool *no_algo) {
    if (exec_setup_gemm_of(e, l, x, no_algo)) return true;
    if (no_algo && *no_algo) return false;   /* not an error: the caller plans plain GEMMs */
    const CuGemm *g = &l->gemm;
    const Node *n = g->d.node ? g->d.node : x->node;
    if (!n) return false;
    char at[256] = "";
    if (n->loc.file && n->loc.line > 0) snprintf(at, sizeof at, " at %s:%d:%d", n->loc.file, n->loc.line, n->loc.col);
    rt_error("  in the GEMM of %s %%%d %s%s: %s x %s -> %s, m %lld n %lld k %lld", ir_op_info(n->op)->text, n->id,
             n->t.name ? n->t.name : "", at, fmt_elem_name(g->atype), fmt_elem_name(g->btype),
             fmt_elem_name(g->dtype), (long long)g->m, (long long)g->n, (long long)g->k);
    return false;
}

/* ---------------------------------------------------------------- launch lists */

static bool list_push(ExecList *L, ExecLaunch *x) {
    if (!grow((void **)&L->l, &L->cap, L->n, sizeof *L->l)) return false;
    L->l[L->n++] = *x;
    return true;
}

/* bytes of aux for the launches' tables (copied from host when given) */
static bool aux_take(CudaExec *e, const void *host, int64_t bytes, CUdeviceptr *out) {
    if (e->aux_used + bytes > e->aux_bytes) {
        rt_error("CUDA executor: pointer tables overflow the workspace");
        return false;
    }
    *out = e->aux + (CUdeviceptr)e->aux_used;
    e->aux_used = align_up(e->aux_used + bytes);
    return !host || !bytes || CU_CHECK(CU(cuMemcpyHtoD_v2)(*out, host, (size_t)bytes));
}

static bool exec_get_function(CudaExec *e, const Node *n, const char *fn, unsigned smem, CUfunction *f) {
    if (!CU_CHECK(CU(cuModuleGetFunction)(f, e->module, fn))) {
        rt_error("the binary's GPU module has no kernel %s for %s %%%d: rebuild it with this fp8c",
                 fn, ir_op_info(n->op)->text, n->id);
        return false;
    }
    return smem <= 48 * 1024 ||
           CU_CHECK(CU(cuFuncSetAttribute)(*f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem));
}

static bool exec_prepare_launch(CudaExec *e, const Node *n, const CuLaunch *l, ExecLaunch *x) {
    memset(x, 0, sizeof *x);
    x->kind = l->kind;
    x->node = n;
    x->fn = l->fn;
    if (l->kind == CU_GEMM) return exec_setup_gemm(e, l, x, NULL);
    if (!exec_get_function(e, n, l->fn, l->smem, &x->f)) return false;
    x->grid[0] = l->grid[0];
    x->grid[1] = l->grid[1];
    x->block = l->block;
    x->smem = l->smem;
    if (!exec_resolve(e, l, &x->args, e->scratch)) return false;
    if (l->table) {
        /* the scalar inputs' device addresses, in aux */
        int count = n->n_in - 1;
        CUdeviceptr *ptrs = malloc(sizeof *ptrs * (size_t)(count ? count : 1));
        bool ok = ptrs != NULL;
        for (int i = 0; ok && i < count; i++) ok = exec_map_tensor(e, &n->in[1 + i]->t, &ptrs[i]);
        CUdeviceptr table = 0;
        ok = ok && aux_take(e, ptrs, (int64_t)sizeof *ptrs * count, &table);
        x->args.table = (const float *const *)(uintptr_t)table;
        free(ptrs);
        if (!ok) return false;
    }
    return true;
}

static bool exec_add_node(CudaExec *e, ExecList *L, const Node *n, const CuNodePlan *p) {
    for (int k = 0; k < p->n_launch; k++) {
        ExecLaunch x;
        if (!exec_prepare_launch(e, n, &p->launch[k], &x) || !list_push(L, &x)) return false;
    }
    return true;
}

/* ---------------------------------------------------------------- batched launches
 *
 * The update has one AdamW node per parameter and, for the gradient norm, one sum of squares
 * per gradient; the training loop checks each gradient for non-finite values. GPT-2 d48 has
 * 580 parameters, and most of them (biases, norm weights) are so small that a launch per node
 * costs more in gaps between kernels than in work. A run of consecutive nodes of one op whose
 * plans launch the same batchable kernels (spec.c's `batch`), none of which writes storage
 * another one reads or writes, runs as one launch per kernel: the nodes' argument blocks go
 * to aux, each block of the launch finds its own (CkBatch), and each node gets scratch of its
 * own in aux, so a partial-sums launch and its final launch work as they do alone. */

typedef struct {
    const Node *node;
    const CuNodePlan *plan;
    CUdeviceptr scratch;      /* the node's scratch */
} BatchItem;

enum { BATCH_MIN = 2 };

static bool batch_same_kernels(const CuNodePlan *a, const CuNodePlan *b) {
    if (a->n_launch != b->n_launch || !a->n_launch || a->members || b->members) return false;
    for (int k = 0; k < a->n_launch; k++) {
        const CuLaunch *x = &a->launch[k], *y = &b->launch[k];
        if (x->kind != CU_KERNEL || y->kind != CU_KERNEL || !x->batch || !y->batch || x->table ||
            strcmp(x->fn, y->fn) || x->block != y->block || x->smem != y->smem || x->grid[1] != 1 ||
            y->grid[1] != 1)
            return false;
    }
    return true;
}

typedef struct {
    uintptr_t lo, hi;
    int owner;
    bool write;
} Span;

static void span_add(Span *s, int *n, const Tensor *t, int owner, bool write) {
    int64_t bytes = tensor_bytes(t);
    if (!t->data || bytes <= 0) return;
    s[(*n)++] = (Span){(uintptr_t)t->data, (uintptr_t)t->data + (uintptr_t)bytes, owner, write};
    const Node *sc = t->fmt.scale;
    if (sc && sc->t.data && tensor_bytes(&sc->t) > 0)
        s[(*n)++] = (Span){(uintptr_t)sc->t.data, (uintptr_t)sc->t.data + (uintptr_t)tensor_bytes(&sc->t),
                           owner, write};
}

/* whether no node of the run writes storage that another one reads or writes */
static bool batch_independent(const Graph *g, int from, int count) {
    int cap = 0;
    for (int j = 0; j < count; j++) cap += 2 * (g->nodes[from + j]->n_in + 1);
    Span *s = malloc(sizeof *s * (size_t)(cap ? cap : 1));
    if (!s) return false;
    int n = 0;
    for (int j = 0; j < count; j++) {
        const Node *m = g->nodes[from + j];
        span_add(s, &n, &m->t, j, true);
        for (int i = 0; i < m->n_in; i++) span_add(s, &n, &m->in[i]->t, j, ir_mutates_input(m, i));
    }
    bool ok = true;
    for (int a = 0; ok && a < n; a++) {
        if (!s[a].write) continue;
        for (int b = 0; ok && b < n; b++)
            ok = s[b].owner == s[a].owner || s[b].hi <= s[a].lo || s[a].hi <= s[b].lo;
    }
    free(s);
    return ok;
}

/* aux bytes that exec_add_batch takes for n nodes that launch n_launch kernels each */
static int64_t batch_aux_bytes(int n_launch, int n) {
    return n_launch * (align_up((int64_t)sizeof(CkArgs) * n) + align_up(4 * (int64_t)(n + 1)));
}

/* The runs of the update: batch_run[i] = the length of the run node i starts (0: none). The
 * nodes between a run's members have no launches. Returns the aux bytes the runs need. */
static int64_t exec_find_batches(CudaExec *e) {
    const Graph *g = e->g;
    int64_t aux = 0;
    e->batch_run = calloc((size_t)(g->n_nodes ? g->n_nodes : 1), sizeof *e->batch_run);
    if (!e->batch_run) return -1;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->phase != PHASE_UPDATE || !batch_same_kernels(&e->plans[i], &e->plans[i])) continue;
        int j = i + 1, members = 1;
        int64_t scratch = align_up(e->plans[i].scratch_bytes);   /* each member's own */
        while (j < g->n_nodes) {
            const Node *m = g->nodes[j];
            if (m->phase == PHASE_UPDATE && !e->plans[j].n_launch) {
                j++;
                continue;
            }
            if (m->phase != PHASE_UPDATE || m->op != n->op || !batch_same_kernels(&e->plans[i], &e->plans[j]))
                break;
            members++;
            scratch += align_up(e->plans[j].scratch_bytes);
            j++;
        }
        if (members >= BATCH_MIN && batch_independent(g, i, j - i)) {
            e->batch_run[i] = j - i;
            aux += scratch + batch_aux_bytes(e->plans[i].n_launch, members);
        }
        i = j - 1;
    }
    return aux;
}

/* One launch for each of the items' kernels (their plans launch the same batchable ones). */
static bool exec_add_batch(CudaExec *e, ExecList *L, const BatchItem *it, int n) {
    CkArgs *args = malloc(sizeof *args * (size_t)n);
    unsigned *first = malloc(sizeof *first * (size_t)(n + 1));
    bool ok = args && first;
    for (int k = 0; ok && k < it[0].plan->n_launch; k++) {
        const CuLaunch *l0 = &it[0].plan->launch[k];
        uint64_t total = 0;
        for (int j = 0; ok && j < n; j++) {
            const CuLaunch *l = &it[j].plan->launch[k];
            ok = exec_resolve(e, l, &args[j], it[j].scratch);
            first[j] = (unsigned)total;
            args[j].grid_base = (unsigned)total;
            args[j].grid_size = l->grid[0];
            total += l->grid[0];
        }
        first[n] = (unsigned)total;
        if (ok && total >= (1u << 31)) {
            rt_error("CUDA executor: a batched launch of %s needs %llu blocks", l0->fn, (unsigned long long)total);
            ok = false;
        }
        ExecLaunch x;
        memset(&x, 0, sizeof x);
        x.kind = CU_KERNEL;
        x.node = it[0].node;
        x.fn = arena_printf(e->arena, "batch_%s", l0->fn);
        x.grid[0] = (unsigned)total;
        x.grid[1] = 1;
        x.block = l0->block;
        x.smem = l0->smem;
        x.batched = true;
        x.batch.n = n;
        CUdeviceptr a_dev = 0, f_dev = 0;
        ok = ok && exec_get_function(e, it[0].node, x.fn, x.smem, &x.f) &&
             aux_take(e, args, (int64_t)sizeof *args * n, &a_dev) &&
             aux_take(e, first, (int64_t)sizeof *first * (n + 1), &f_dev);
        x.batch.args = (const CkArgs *)(uintptr_t)a_dev;
        x.batch.first = (const unsigned *)(uintptr_t)f_dev;
        ok = ok && list_push(L, &x);
    }
    free(args);
    free(first);
    return ok;
}

/* the run of nodes that starts at index i, each with scratch of its own in aux */
static bool exec_add_run(CudaExec *e, ExecList *L, int i) {
    int n = 0;
    BatchItem *it = malloc(sizeof *it * (size_t)e->batch_run[i]);
    bool ok = it != NULL;
    for (int j = i; ok && j < i + e->batch_run[i]; j++) {
        if (!e->plans[j].n_launch) continue;
        it[n] = (BatchItem){e->g->nodes[j], &e->plans[j], 0};
        ok = aux_take(e, NULL, e->plans[j].scratch_bytes, &it[n].scratch);
        n++;
    }
    ok = ok && exec_add_batch(e, L, it, n);
    free(it);
    return ok;
}

/* the node a failed launch was for, after the library's own line */
static void exec_name_launch(const ExecLaunch *x) {
    const Node *n = x->node;
    char at[256] = "";
    if (n->loc.file && n->loc.line > 0) snprintf(at, sizeof at, " at %s:%d:%d", n->loc.file, n->loc.line, n->loc.col);
    rt_error("  in %s of %s %%%d %s%s", x->kind == CU_GEMM ? "the GEMM" : x->fn, ir_op_info(n->op)->text, n->id,
             n->t.name ? n->t.name : "", at);
}

static bool exec_launch(CudaExec *e, const ExecLaunch *x) {
    if (x->kind == CU_GEMM) {
        if (!LT_CHECK(exec_run_gemm(e, x, &x->algo))) {
            exec_name_launch(x);
            return false;
        }
    } else {
        void *params[] = {x->batched ? (void *)&x->batch : (void *)&x->args};
        if (!CU_CHECK(CU(cuLaunchKernel)(x->f, x->grid[0], x->grid[1], 1, x->block, 1, 1, x->smem,
                                          e->stream, params, NULL))) {
            exec_name_launch(x);
            return false;
        }
    }
    if (e->sync_each) {
        CUresult r = CU(cuStreamSynchronize)(e->stream);
        if (r != CUDA_SUCCESS) {
            const Node *n = x->node;
            cuda_check_cu(r, "cuStreamSynchronize", __FILE__, __LINE__);
            rt_error("CUDA executor: the failing launch was %s of %s %%%d %s", x->fn,
                     ir_op_info(n->op)->text, n->id, n->t.name ? n->t.name : "");
            return false;
        }
    }
    return true;
}

static void prof_add(CudaExec *e, const ExecLaunch *x, double ms) {
    char key[96];
    const char *us = strrchr(x->fn, '_');
    int len = us && x->kind == CU_KERNEL ? (int)(us - x->fn) : (int)strlen(x->fn);
    snprintf(key, sizeof key, "%-14s %.*s", ir_op_info(x->node->op)->text, len, x->fn);
    e->prof_total += ms;
    for (int i = 0; i < e->n_prof; i++)
        if (!strcmp(e->prof[i].key, key)) {
            e->prof[i].ms += ms;
            e->prof[i].calls++;
            return;
        }
    if (!grow((void **)&e->prof, &e->cap_prof, e->n_prof, sizeof *e->prof)) return;
    ProfRow *r = &e->prof[e->n_prof++];
    snprintf(r->key, sizeof r->key, "%s", key);
    r->ms = ms;
    r->calls = 1;
}

static int prof_cmp(const void *a, const void *b) {
    double x = ((const ProfRow *)a)->ms, y = ((const ProfRow *)b)->ms;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void prof_print(CudaExec *e) {
    if (!e->n_prof) return;
    qsort(e->prof, (size_t)e->n_prof, sizeof *e->prof, prof_cmp);
    fprintf(stderr, "GPU profile (FP8C_CUDA_PROFILE): %.1f ms in kernels and GEMMs\n", e->prof_total);
    fprintf(stderr, "  %%     ms  calls  op / kernel\n");
    for (int i = 0; i < e->n_prof && i < 30; i++)
        fprintf(stderr, "%5.1f %8.2f %6ld  %s\n", 100 * e->prof[i].ms / e->prof_total, e->prof[i].ms,
                e->prof[i].calls, e->prof[i].key);
}

static bool exec_run_profiled(CudaExec *e, ExecList *L) {
    CUevent ev[2];
    if (!CU_CHECK(CU(cuEventCreate)(&ev[0], 0)) || !CU_CHECK(CU(cuEventCreate)(&ev[1], 0))) return false;
    bool ok = true;
    for (int i = 0; ok && i < L->n; i++) {
        float ms = 0;
        ok = CU_CHECK(CU(cuEventRecord)(ev[0], e->stream)) && exec_launch(e, &L->l[i]) &&
             CU_CHECK(CU(cuEventRecord)(ev[1], e->stream)) && CU_CHECK(CU(cuEventSynchronize)(ev[1])) &&
             CU_CHECK(CU(cuEventElapsedTime)(&ms, ev[0], ev[1]));
        if (ok) prof_add(e, &L->l[i], ms);
        if (ok && e->trace) {
            const ExecLaunch *x = &L->l[i];
            fprintf(e->trace, "%d\t%d\t%s\t%s\t%%%d\t%s\t%.4f\n", e->trace_run, i, ir_op_info(x->node->op)->text,
                    x->fn, x->node->id, x->node->t.name ? x->node->t.name : "-", ms);
        }
    }
    e->trace_run++;
    CU(cuEventDestroy_v2)(ev[0]);
    CU(cuEventDestroy_v2)(ev[1]);
    return ok;
}

static bool exec_run_list(CudaExec *e, ExecList *L) {
    if (e->tune_report && L == &e->lists[LIST_MICRO] && ++e->micro_runs == GEMM_TUNE_AT_STEP)
        return exec_run_tuning(e, L);
    if (e->profile) return exec_run_profiled(e, L);
    if (!e->graphs || e->sync_each) {
        for (int i = 0; i < L->n; i++)
            if (!exec_launch(e, &L->l[i])) return false;
        return true;
    }
    if (!L->captured) {
        if (!CU_CHECK(CU(cuStreamBeginCapture_v2)(e->stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)))
            return false;
        bool ok = true;
        for (int i = 0; ok && i < L->n; i++) ok = exec_launch(e, &L->l[i]);
        CUgraph graph = NULL;
        bool ended = CU_CHECK(CU(cuStreamEndCapture)(e->stream, &graph));
        if (!ok || !ended) return false;
        if (!CU_CHECK(CU(cuGraphInstantiateWithFlags)(&L->exec, graph, 0))) return false;
        L->graph = graph;
        L->captured = true;
    }
    return CU_CHECK(CU(cuGraphLaunch)(L->exec, e->stream));
}

static bool exec_finish(CudaExec *e, const char *what) {
    CUresult r = CU(cuStreamSynchronize)(e->stream);
    if (r == CUDA_SUCCESS) return true;
    cuda_check_cu(r, "cuStreamSynchronize", __FILE__, __LINE__);
    rt_error("CUDA executor: the %s failed on the GPU (FP8C_CUDA_SYNC=1 names the kernel)", what);
    return false;
}

/* ---------------------------------------------------------------- set-up */

/* A fused GEMM for which cuBLASLt has no algorithm (an epilogue it does not offer for these
 * types) goes back to its group's plain plans, each node at its own place. */
static bool exec_check_epilogues(CudaExec *e) {
    int plain = 0;
    for (int i = 0; i < e->g->n_nodes; i++) {
        CuNodePlan *p = &e->plans[i];
        bool no_algo = false;
        for (int k = 0; p->members && !no_algo && k < p->n_launch; k++) {
            if (p->launch[k].kind != CU_GEMM) continue;
            ExecLaunch x;
            memset(&x, 0, sizeof x);
            x.node = p->node;
            bool ok = exec_setup_gemm(e, &p->launch[k], &x, &no_algo);
            exec_free_gemm(&x);
            if (!ok && !no_algo) return false;
        }
        if (no_algo) {
            for (int m = 0; m < p->n_members; m++) {
                int j = p->members[m]->index;
                e->plans[j] = e->node_plans[j];   /* the root (i) is the last member */
            }
            plain++;
        } else if (p->members) {
            e->n_epilogues++;
            for (int k = 0; k < p->n_launch; k++) {
                const CuGemm *gm = &p->launch[k].gemm;
                if (p->launch[k].kind != CU_GEMM) continue;
                e->n_gelu += gm->act == CU_ACT_GELU;
                e->n_dgelu += gm->act == CU_ACT_DGELU;
                e->n_fp8_results += gm->dscale.node != NULL;
            }
        }
    }
    if (getenv("FP8C_CUDA_VERBOSE"))
        fprintf(stderr, "CUDA executor: %d GEMMs with epilogues (%d with a GELU, %d of them into its FP8 copy; "
                "%d with GELU's backward), %d left plain (no cuBLASLt algorithm)\n",
                e->n_epilogues, e->n_gelu, e->n_fp8_results, e->n_dgelu, plain);
    return true;
}

int cuda_exec_epilogues(const CudaExec *e) { return e->n_epilogues; }

void cuda_exec_gelu_epilogues(const CudaExec *e, int *gelu, int *dgelu, int *fp8_results) {
    *gelu = e->n_gelu;
    *dgelu = e->n_dgelu;
    *fp8_results = e->n_fp8_results;
}

int cuda_exec_batched_launches(const CudaExec *e) {
    int n = 0;
    for (int k = 0; k < LIST_COUNT; k++)
        for (int i = 0; i < e->lists[k].n; i++) n += e->lists[k].l[i].batched;
    return n;
}

/* An ALL_REDUCE node: nothing with one rank (the value is its own mean), else its tensor. */
static bool exec_add_reduce(CudaExec *e, const Node *n) {
    if (!cuda_nccl_active()) return true;
    if (!grow((void **)&e->reduce, &e->cap_reduce, e->n_reduce, sizeof *e->reduce)) return false;
    ExecReduce *r = &e->reduce[e->n_reduce];
    r->node = n;
    r->count = ir_numel(&n->t);
    r->elem = n->t.fmt.elem;
    r->order = n->in[0]->index;
    if (!exec_map_tensor(e, &n->t, &r->p)) return false;
    e->n_reduce++;
    return true;
}

static int reduce_cmp(const void *a, const void *b) {
    return ((const ExecReduce *)a)->order - ((const ExecReduce *)b)->order;
}

/* The averages, as one NCCL group in the backward's order: NCCL fuses a group into few
 * kernels, and the many small gradients (biases, norm weights) cost no launch each. */
static bool exec_run_reduce(CudaExec *e) {
    if (!e->n_reduce) return true;
    bool ok = cuda_nccl_group(true);
    for (int i = 0; ok && i < e->n_reduce; i++) {
        const ExecReduce *r = &e->reduce[i];
        ok = cuda_nccl_all_reduce_mean(r->p, r->count, r->elem, e->stream);
    }
    return cuda_nccl_group(false) && ok;
}

int cuda_exec_reductions(const CudaExec *e) { return e->n_reduce; }

static void fmt_gib(char *out, size_t len, int64_t bytes) {
    snprintf(out, len, "%.2f GiB", (double)bytes / (1 << 30));
}

CudaExec *cuda_exec_open(Graph *g, const RtMemory *host, const void *cubin, size_t cubin_size) {
    char why[512];
    if (!cuda_load(why, sizeof why)) {
        rt_error("--device cuda: %s", why);
        return NULL;
    }
    CudaExec *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->g = g;
    e->host = *host;
    e->arena = arena_new();
    e->graphs = env_flag("FP8C_CUDA_GRAPHS", true);
    e->sync_each = env_flag("FP8C_CUDA_SYNC", false);
    e->profile = env_flag("FP8C_CUDA_PROFILE", false);
    const char *trace = getenv("FP8C_CUDA_TRACE");   /* a file: each launch of each run, timed */
    if (trace && *trace) {
        if (!(e->trace = fopen(trace, "w"))) {
            rt_error("FP8C_CUDA_TRACE: cannot write %s", trace);
            goto fail;
        }
        e->profile = true;
    }
    const char *fa = getenv("FP8C_CUDA_FAST_ACCUM");
    e->fast_accum_all = fa && !strcmp(fa, "all");
    if (!CU_CHECK(CU(cuDeviceGet)(&e->dev, cuda_device_ordinal())) || !CU_CHECK(CU(cuDevicePrimaryCtxRetain)(&e->ctx, e->dev)))
        goto fail;
    e->have_ctx = true;
    if (!CU_CHECK(CU(cuCtxSetCurrent)(e->ctx))) goto fail;
    CU(cuDeviceGetName)(e->name, sizeof e->name, e->dev);
    int major = 0, minor = 0;
    CU(cuDeviceGetAttribute)(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, e->dev);
    CU(cuDeviceGetAttribute)(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, e->dev);
    if (major != 9 || minor != 0) {
        rt_error("--device cuda: %s has compute capability %d.%d; the kernels are built for "
                 "sm_90a (H100, H200)", e->name, major, minor);
        goto fail;
    }

    /* every node's plan first: a node the GPU cannot run stops here, before any allocation */
    e->node_plans = cuda_plan_graph(g, e->arena, why, sizeof why);
    if (!e->node_plans) {
        rt_error("--device cuda: the GPU backend cannot run %s", why);
        goto fail;
    }
    e->plans = env_flag("FP8C_CUDA_EPILOGUES", true) ? cuda_plan_epilogues(g, e->node_plans, e->arena)
                                                     : e->node_plans;
    for (int i = 0; i < g->n_nodes; i++) {
        if (e->plans[i].scratch_bytes > e->scratch_bytes) e->scratch_bytes = e->plans[i].scratch_bytes;
        if (e->node_plans[i].scratch_bytes > e->scratch_bytes) e->scratch_bytes = e->node_plans[i].scratch_bytes;
    }
    int n_tables = 0;
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < e->plans[i].n_launch; k++)
            if (e->plans[i].launch[k].table) n_tables += g->nodes[i]->n_in;
    /* the phases' tables, and as much again for nodes run one at a time (tests) */
    e->aux_bytes = align_up(ALIGN + 16 * (int64_t)n_tables + ALIGN * 64);
    int64_t batch_aux = exec_find_batches(e);
    if (batch_aux < 0) goto fail;
    /* and the batched finite checks of the gradients */
    int n_grads = 0;
    for (int i = 0; i < g->n_nodes; i++) n_grads += g->nodes[i]->t.role == ROLE_GRAD;
    e->aux_bytes += batch_aux + batch_aux_bytes(1, n_grads);

    /* memory: check, then one allocation per arena */
    int64_t step_bytes = align_up(host->step_bytes);
    int64_t ws_bytes = CUBLAS_WORKSPACE + align_up(e->scratch_bytes) + e->aux_bytes;
    e->step_alloc = step_bytes + ws_bytes;
    int64_t need = align_up(host->persistent_bytes) + e->step_alloc;
    size_t free_b = 0, total_b = 0;
    if (!CU_CHECK(CU(cuMemGetInfo_v2)(&free_b, &total_b))) goto fail;
    if (need > (int64_t)free_b) {
        char a[32], b[32], c[32], d[32], f[32], t[32];
        fmt_gib(a, sizeof a, need);
        fmt_gib(b, sizeof b, host->persistent_bytes);
        fmt_gib(c, sizeof c, host->step_bytes);
        fmt_gib(d, sizeof d, ws_bytes);
        fmt_gib(f, sizeof f, (int64_t)free_b);
        fmt_gib(t, sizeof t, (int64_t)total_b);
        rt_error("--device cuda: the plan needs %s on the GPU (persistent %s + step peak %s + "
                 "workspace %s), but %s has %s free of %s", a, b, c, d, e->name, f, t);
        goto fail;
    }
    if (!CU_CHECK(CU(cuMemAlloc_v2)(&e->persistent, (size_t)(host->persistent_bytes ? host->persistent_bytes : ALIGN))) ||
        !CU_CHECK(CU(cuMemAlloc_v2)(&e->step, (size_t)e->step_alloc)))
        goto fail;
    e->cublas_ws = e->step + (CUdeviceptr)step_bytes;
    e->scratch = e->cublas_ws + CUBLAS_WORKSPACE;
    e->aux = e->scratch + (CUdeviceptr)align_up(e->scratch_bytes);
    e->finite_flag_off = 0;
    e->ticket_off = 64;
    e->aux_used = ALIGN;

    if (!CU_CHECK(CU(cuStreamCreate)(&e->stream, CU_STREAM_DEFAULT))) goto fail;
    if (!CU_CHECK(CU(cuMemsetD8Async)(e->aux, 0, ALIGN, e->stream))) goto fail;   /* flag, ticket */
    if (!cubin_size) {
        rt_error("--device cuda: this binary carries no GPU kernels (built without NVRTC)");
        goto fail;
    }
    if (!CU_CHECK(CU(cuModuleLoadData)(&e->module, cubin))) goto fail;
    if (!LT_CHECK(CU(cublasLtCreate)(&e->lt))) goto fail;
    e->have_lt = true;
    cuda_device_description(e->desc, sizeof e->desc);
    const char *report = getenv("FP8C_TUNE_GEMMS");
    e->tune_report = report && *report ? report : NULL;

    if (!exec_check_epilogues(e)) goto fail;
    /* the launch lists: evaluation, micro-step, update; then the gradient checks */
    bool batches = env_flag("FP8C_CUDA_BATCH", true);
    e->tune = env_flag("FP8C_CUDA_TUNE", true);
    const char *tuned_on = ir_choice(g, "tune.device");
    if (tuned_on) {   /* a tuned binary: its algorithms, and no timing */
        char fp[17];
        ir_fingerprint(e->desc, fp);
        e->tune = false;
        e->stored_algos = !strcmp(fp, tuned_on);
        if (!e->stored_algos)
            rt_note("this binary was tuned on another GPU (or driver, or cuBLASLt) than %s: its GEMMs run "
                    "the heuristic's first algorithm", e->desc);
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (!e->plans[i].n_launch) continue;
        if (n->phase == PHASE_FORWARD && !exec_add_node(e, &e->lists[LIST_EVAL], n, &e->plans[i])) goto fail;
        if (n->phase != PHASE_UPDATE && !exec_add_node(e, &e->lists[LIST_MICRO], n, &e->plans[i])) goto fail;
        if (n->phase != PHASE_UPDATE) continue;
        if (batches && e->batch_run[i]) {
            if (!exec_add_run(e, &e->lists[LIST_UPDATE], i)) goto fail;
            i += e->batch_run[i] - 1;
        } else if (!exec_add_node(e, &e->lists[LIST_UPDATE], n, &e->plans[i])) {
            goto fail;
        }
    }
    /* the gradients' averages (no launches of their own: a batched run may span them) */
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_ALL_REDUCE && !exec_add_reduce(e, g->nodes[i])) goto fail;
    qsort(e->reduce, (size_t)e->n_reduce, sizeof *e->reduce, reduce_cmp);
    e->tune = false;   /* from here on the arenas hold data */
    if (getenv("FP8C_CUDA_VERBOSE")) fprintf(stderr, "CUDA executor: %d GEMM shapes timed\n", e->n_tuned);
    if (e->n_stored_failed)
        rt_note("%d of the tuned GEMM algorithms do not check out on %s (cublasLtMatmulAlgoCheck): "
                "those GEMMs run the heuristic's first", e->n_stored_failed, e->desc);
    if (e->n_unstored)
        rt_note("%d GEMM set-ups found no tuned algorithm for their problem: they run the heuristic's first",
                e->n_unstored);
    if (!cuda_exec_push_arenas(e)) goto fail;
    return e;
fail:
    cuda_exec_close(e);
    return NULL;
}

void cuda_exec_close(CudaExec *e) {
    if (!e) return;
    prof_print(e);
    free(e->prof);
    if (e->trace) fclose(e->trace);
    if (e->have_ctx) {
        CU(cuCtxSetCurrent)(e->ctx);
        if (e->stream) CU(cuStreamSynchronize)(e->stream);
        for (int k = 0; k < LIST_COUNT; k++) {
            ExecList *L = &e->lists[k];
            for (int i = 0; i < L->n; i++)
                if (L->l[i].kind == CU_GEMM) exec_free_gemm(&L->l[i]);
            if (L->exec) CU(cuGraphExecDestroy)(L->exec);
            if (L->graph) CU(cuGraphDestroy)(L->graph);
            free(L->l);
        }
        if (e->have_lt) CU(cublasLtDestroy)(e->lt);
        if (e->module) CU(cuModuleUnload)(e->module);
        if (e->stream) CU(cuStreamDestroy_v2)(e->stream);
        if (e->persistent) CU(cuMemFree_v2)(e->persistent);
        if (e->step) CU(cuMemFree_v2)(e->step);
        CU(cuDevicePrimaryCtxRelease_v2)(e->dev);
    }
    free(e->batch_run);
    free(e->reduce);
    free(e->tuned);
    arena_free(e->arena);
    free(e);
}

/* ---------------------------------------------------------------- running */

bool cuda_exec_run_phase(CudaExec *e, Phase p) {
    if (p == PHASE_FORWARD) return exec_run_list(e, &e->lists[LIST_EVAL]) && exec_finish(e, "forward");
    /* several ranks: the gradients' averages first, and the whole update within the deadline */
    if (e->n_reduce) cuda_nccl_arm("the update with its gradient all-reduce");
    bool ok = exec_run_reduce(e) && exec_run_list(e, &e->lists[LIST_UPDATE]) && exec_finish(e, "update");
    if (e->n_reduce) cuda_nccl_disarm();
    return ok;
}

bool cuda_exec_run_micro_step(CudaExec *e) {
    return exec_run_list(e, &e->lists[LIST_MICRO]) && exec_finish(e, "micro-step");
}

bool cuda_exec_run_node(CudaExec *e, const Node *n) {
    for (int i = 0; i < e->g->n_nodes; i++) {
        if (e->g->nodes[i] != n) continue;
        int64_t aux_at = e->aux_used;
        ExecList L = {0};
        bool ok = exec_add_node(e, &L, n, &e->node_plans[i]);
        for (int k = 0; ok && k < L.n; k++) ok = exec_launch(e, &L.l[k]);
        ok = ok && exec_finish(e, ir_op_info(n->op)->text);
        for (int k = 0; k < L.n; k++)
            if (L.l[k].kind == CU_GEMM) exec_free_gemm(&L.l[k]);
        free(L.l);
        e->aux_used = aux_at;   /* the tables of this run are not needed again */
        return ok;
    }
    rt_error("CUDA executor: node %%%d is not in the graph", n->id);
    return false;
}

bool cuda_exec_sync(CudaExec *e) { return CU_CHECK(CU(cuStreamSynchronize)(e->stream)); }

bool cuda_exec_push(CudaExec *e, Tensor *const *ts, int n) {
    if (!cuda_exec_sync(e)) return false;
    for (int i = 0; i < n; i++) {
        CUdeviceptr p;
        int64_t bytes = tensor_bytes(ts[i]);
        if (!bytes) continue;
        if (!exec_map_tensor(e, ts[i], &p) || !CU_CHECK(CU(cuMemcpyHtoD_v2)(p, ts[i]->data, (size_t)bytes)))
            return false;
    }
    return true;
}

bool cuda_exec_pull(CudaExec *e, Tensor *const *ts, int n) {
    if (!cuda_exec_sync(e)) return false;
    for (int i = 0; i < n; i++) {
        CUdeviceptr p;
        int64_t bytes = tensor_bytes(ts[i]);
        if (!bytes) continue;
        if (!exec_map_tensor(e, ts[i], &p) || !CU_CHECK(CU(cuMemcpyDtoH_v2)(ts[i]->data, p, (size_t)bytes)))
            return false;
    }
    return true;
}

bool cuda_exec_push_arenas(CudaExec *e) {
    if (!cuda_exec_sync(e)) return false;
    if (e->host.persistent_bytes &&
        !CU_CHECK(CU(cuMemcpyHtoD_v2)(e->persistent, e->host.persistent, (size_t)e->host.persistent_bytes)))
        return false;
    if (e->host.step_bytes && !CU_CHECK(CU(cuMemcpyHtoD_v2)(e->step, e->host.step, (size_t)e->host.step_bytes)))
        return false;
    return true;
}

bool cuda_exec_zero(CudaExec *e, Tensor *const *ts, int n) {
    for (int i = 0; i < n; i++) {
        CUdeviceptr p;
        int64_t bytes = tensor_bytes(ts[i]);
        if (!bytes) continue;
        if (!exec_map_tensor(e, ts[i], &p) || !CU_CHECK(CU(cuMemsetD8Async)(p, 0, (size_t)bytes, e->stream)))
            return false;
    }
    return cuda_exec_sync(e);
}

/* The checks of all tensors into one flag, batched where they share a kernel; the list is
 * built (and captured) for the first set of tensors asked about, which is the training loop's
 * gradient list every step. */
bool cuda_exec_all_finite(CudaExec *e, Tensor *const *ts, int n, bool *finite) {
    ExecList *L = &e->lists[LIST_FINITE];
    CUdeviceptr flag = e->aux + (CUdeviceptr)e->finite_flag_off;
    if (!L->n && n) {
        CuNodePlan *plans = arena_alloc(e->arena, sizeof *plans * (size_t)n);
        BatchItem *it = malloc(sizeof *it * (size_t)n);
        if (!it) return false;
        bool ok = true;
        for (int i = 0; ok && i < n; i++) {
            const Node *node = NULL;
            for (int k = 0; k < e->g->n_nodes && !node; k++)
                if (&e->g->nodes[k]->t == ts[i]) node = e->g->nodes[k];
            if (!node || !cuda_plan_finite(node, e->arena, &plans[i])) {
                rt_error("CUDA executor: cannot check tensor '%s' for non-finite values",
                         ts[i]->name ? ts[i]->name : "unnamed");
                ok = false;
            }
            it[i] = (BatchItem){node, &plans[i], flag};
        }
        /* the checks only read their tensors: any run of one kernel can be batched */
        bool batches = env_flag("FP8C_CUDA_BATCH", true);
        for (int i = 0, j; ok && i < n; i = j) {
            for (j = i + 1; batches && j < n && batch_same_kernels(it[i].plan, it[j].plan);) j++;
            if (j - i >= BATCH_MIN) {
                ok = exec_add_batch(e, L, it + i, j - i);
                continue;
            }
            ExecLaunch x;
            ok = exec_prepare_launch(e, it[i].node, &plans[i].launch[0], &x);
            x.args.scratch = (void *)(uintptr_t)flag;
            ok = ok && list_push(L, &x);
        }
        free(it);
        if (!ok) return false;
    }
    int bad = 0;
    if (!CU_CHECK(CU(cuMemsetD8Async)(flag, 0, sizeof bad, e->stream)) || !exec_run_list(e, L) ||
        !exec_finish(e, "gradient check") || !CU_CHECK(CU(cuMemcpyDtoH_v2)(&bad, flag, sizeof bad)))
        return false;
    *finite = bad == 0;
    return true;
}

int64_t cuda_exec_device_bytes(const CudaExec *e) { return e->host.persistent_bytes + e->step_alloc; }
const char *cuda_exec_device_name(const CudaExec *e) { return e->name; }

/* ---------------------------------------------------------------- kernel-IR programs
 * Loop kernels of a kernel-IR program (cuda/cg_render.c) run on the executor's arenas: a
 * buffer that is a graph tensor is that tensor's device bytes; scratch arrays and constant
 * tables get one device allocation of their own. Used by the tests that check the rendered
 * kernels against the reference executor. */

#define CG_CUDA_MAX_BUFS 64
typedef struct {
    void *buf[CG_CUDA_MAX_BUFS];
    long long items;
} CgCudaArgs;

struct CudaCg {
    CudaExec *e;
    const CgProgram *p;
    CUmodule module;
    CUdeviceptr mem;
    CUdeviceptr *scratch, *consts;
};

CudaCg *cuda_cg_open(CudaExec *e, const CgProgram *p, const void *cubin, size_t cubin_size) {
    CudaCg *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->e = e;
    c->p = p;
    c->scratch = calloc((size_t)p->n_scratch + 1, sizeof *c->scratch);
    c->consts = calloc((size_t)p->n_consts + 1, sizeof *c->consts);
    int64_t bytes = 0;
    for (int i = 0; i < p->n_scratch; i++) bytes += align_up(p->scratch[i] * 4);
    for (int i = 0; i < p->n_consts; i++) bytes += align_up(p->consts[i].n * 4);
    if (!c->scratch || !c->consts || !CU_CHECK(CU(cuModuleLoadData)(&c->module, cubin)) ||
        !CU_CHECK(CU(cuMemAlloc_v2)(&c->mem, (size_t)(bytes ? bytes : ALIGN)))) {
        cuda_cg_close(c);
        return NULL;
    }
    (void)cubin_size;
    CUdeviceptr at = c->mem;
    for (int i = 0; i < p->n_scratch; i++) {
        c->scratch[i] = at;
        at += (CUdeviceptr)align_up(p->scratch[i] * 4);
    }
    for (int i = 0; i < p->n_consts; i++) {
        c->consts[i] = at;
        if (p->consts[i].n && !CU_CHECK(CU(cuMemcpyHtoD_v2)(at, p->consts[i].data, (size_t)p->consts[i].n * 4))) {
            cuda_cg_close(c);
            return NULL;
        }
        at += (CUdeviceptr)align_up(p->consts[i].n * 4);
    }
    return c;
}

void cuda_cg_close(CudaCg *c) {
    if (!c) return;
    if (c->module) CU(cuModuleUnload)(c->module);
    if (c->mem) CU(cuMemFree_v2)(c->mem);
    free(c->scratch);
    free(c->consts);
    free(c);
}

bool cuda_cg_write_scratch(CudaCg *c, int scratch, const float *data, int64_t n) {
    if (scratch < 0 || scratch >= c->p->n_scratch || n < 0 || n > c->p->scratch[scratch]) {
        rt_error("scratch %d of the kernel-IR program cannot take %lld floats", scratch, (long long)n);
        return false;
    }
    if (!cuda_exec_sync(c->e)) return false;
    return !n || CU_CHECK(CU(cuMemcpyHtoD_v2)(c->scratch[scratch], data, (size_t)n * 4));
}

bool cuda_cg_run_kernel(CudaCg *c, const CgKernel *k) {
    unsigned grid, block;
    if (!cuda_cg_launch_shape(k, &grid, &block)) return true;
    if (k->n_bufs > CG_CUDA_MAX_BUFS) {
        rt_error("kernel %s has %d buffers, more than %d", k->name, k->n_bufs, CG_CUDA_MAX_BUFS);
        return false;
    }
    CgCudaArgs args;
    memset(&args, 0, sizeof args);
    args.items = k->items;
    for (int i = 0; i < k->n_bufs; i++) {
        const CgBuf *b = &k->bufs[i];
        CUdeviceptr p = 0;
        if (b->node) {
            if (!exec_map_tensor(c->e, &b->node->t, &p)) return false;
        } else if (b->scratch != CG_NONE) {
            p = c->scratch[b->scratch];
        } else if (b->constant != CG_NONE) {
            p = c->consts[b->constant];
        }
        args.buf[i] = (void *)(uintptr_t)p;
    }
    char name[32];
    snprintf(name, sizeof name, "fp8c_g%d", k->func);
    CUfunction f;
    if (!CU_CHECK(CU(cuModuleGetFunction)(&f, c->module, name))) return false;
    void *params[] = {&args};
    if (!CU_CHECK(CU(cuLaunchKernel)(f, grid, 1, 1, block, 1, 1, 0, c->e->stream, params, NULL)))
        return false;
    return exec_finish(c->e, k->name);
}
