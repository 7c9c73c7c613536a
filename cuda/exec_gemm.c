/* exec_gemm.c — the executor's cuBLASLt matmuls: descriptors, algorithms, the tuning mode.
 *
 * A GEMM launch of a plan (spec_gemm.c) becomes a cuBLASLt matmul whose descriptors, layouts
 * and algorithm are made once, at set-up (exec_setup_gemm), so that a phase's list replays
 * without asking cuBLASLt anything. The algorithm comes from one of three places, in this
 * order: a tuning record stored in the artifact, where it names this GPU (below: tuned
 * algorithms); with FP8C_CUDA_TUNE=1, the heuristic's candidates timed on the arenas, once per
 * GEMM key (timings differ from run to run, and so may the winners and the bits); else the
 * heuristic's first choice, the same in every run. The tuning mode (FP8C_TUNE_GEMMS, set by
 * `fp8c tune`) times a wider list on real data during a step and reports it. These are kept
 * apart from exec.c because they are the one part of the executor that depends on cuBLASLt's
 * API beyond a call, and the one that `fp8c tune` changes. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exec_internal.h"

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

void exec_free_gemm(ExecLaunch *x) {
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
cublasStatus_t exec_run_gemm(CudaExec *e, const ExecLaunch *x, const cublasLtMatmulAlgo_t *algo) {
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

/* Data parallel: every rank runs rank 0's algorithms. Each rank times the same candidates on
 * its own GPU, and timing noise picks a different algorithm for some GEMMs on different ranks
 * (and in different runs): the ranks then compute their shares with different kernels, and a
 * run launched with --gpus N differs from the same run launched as N processes (seen on two
 * H200s: 3e-3 relative in the loss after 30 steps of d12 at -O1). So rank 0's timed table is
 * sent to every rank, which takes it for each GEMM of its lists. The ranks made the same
 * table from the same graph; a rank whose count of timed problems differs says so rather than
 * guess. Nothing to do when nothing was timed (the default, a tuned binary). */
bool exec_agree_gemms(CudaExec *e) {
    if (!cuda_nccl_active()) return true;
    int64_t n = e->n_tuned;
    if (!cuda_nccl_broadcast_host(&n, sizeof n, "agreeing on rank 0's GEMM algorithms")) return false;
    if (n != e->n_tuned) {
        rt_error("rank 0 timed %lld GEMM problems and this rank %d: the ranks do not run the same "
                 "step (the same binary, and FP8C_CUDA_TUNE the same on every rank?)", (long long)n,
                 e->n_tuned);
        return false;
    }
    if (!n) return true;
    TunedGemm *t0 = malloc(sizeof *t0 * (size_t)n);
    if (!t0) return false;
    memcpy(t0, e->tuned, sizeof *t0 * (size_t)n);
    bool ok = cuda_nccl_broadcast_host(t0, sizeof *t0 * (size_t)n, "agreeing on rank 0's GEMM algorithms");
    for (int k = 0; ok && k < LIST_COUNT; k++) {
        ExecList *L = &e->lists[k];
        for (int i = 0; i < L->n; i++) {
            ExecLaunch *x = &L->l[i];
            if (x->kind != CU_GEMM || !x->gemm) continue;
            const void *ptrs[4] = {x->A, x->B, x->C, x->D};
            uint64_t key = gemm_key(x->gemm, ptrs);
            for (int64_t j = 0; j < n; j++)
                if (t0[j].key == key) x->algo = t0[j].algo;
        }
    }
    if (ok) memcpy(e->tuned, t0, sizeof *t0 * (size_t)n);
    free(t0);
    return ok;
}

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
 * candidate in its place. D is saved first, into one device buffer sized for the step's
 * largest D, so that putting it back before each run is a copy on the GPU; then two phases.
 *
 * Timing: every candidate runs from D restored, once untimed (the first launch of a kernel
 * loads its module; an algorithm that does not run is left out of the report), then
 * GEMM_TIMED_RUNS times with events: median, min, max, in us.
 *
 * Checks, on copies of D in pinned host memory: the default's D, computed twice, must be
 * bit-identical and is the reference. A candidate is checked the same way — computed twice
 * (the two must be bit-identical: an algorithm whose split reduction is not deterministic is
 * rejected) and compared with the reference (normalized max error, within one unit of D's
 * format: 1e-4 f32, 1e-2 bf16/f16, 0.13 e4m3, 0.26 e5m2) — only where fp8c could pick it.
 * fp8c takes the fastest candidate that passed and lets it win when it beats the default by
 * more than the noise (rt_tune_could_win, the rule compiler/tune.c applies to the report):
 * so the candidates that beat the default's median by more than the default's noise are
 * checked fastest first, and the first that passes ends the checks. The others are reported
 * "ok": false, with a note saying why they were not checked, and cannot win. Before, every
 * candidate was checked, its D carried over PCIe from pageable memory four times and decoded
 * on the host: on an H200 the micro-step of GPT-2 d12 at batch 32 took 49.8 s that way, 5.4 s
 * this way (16 problems of 8 candidates; 21 checked, 16 of them the defaults).
 *
 * D is then restored (the timing runs overwrote it, and with C == D accumulated into it) and
 * the step goes on with the default algorithm, so the run's losses are the defaults'. GEMMs
 * with the same key (gemm_key: the layers of a model repeat a handful of problems) are timed
 * once, and every one of them is reported with those candidates and times. The report, JSON,
 * lists every GEMM; fp8c picks the winners. */

typedef struct {
    uint64_t key;
    char *entry;        /* the report's entry but its "what" count and closing brace, JSON */
    int count;          /* GEMMs of the step with this key */
} TimedKey;

#define CHECK_CHUNK 65536   /* elements of a candidate's D decoded at a time */

/* What the tuning mode holds for the whole step, sized for its largest D. */
typedef struct {
    CUdeviceptr saved;  /* D as the step left it; 0: no room on the GPU, saved_host instead */
    void *saved_host;
    void *out, *again;  /* a D computed twice, copied back for the checks */
    bool pinned;        /* out, again and saved_host from cuMemAllocHost, else malloc */
    float *ref;         /* the default's D, decoded */
    float *decoded;     /* CHECK_CHUNK elements of a candidate's D, decoded */
    CUevent ev[2];
} TuneBufs;

static void tune_bufs_free(TuneBufs *b) {
    void *host[3] = {b->out, b->again, b->saved_host};
    for (int i = 0; i < 3; i++)
        if (host[i] && b->pinned) CU(cuMemFreeHost)(host[i]);
        else free(host[i]);
    if (b->saved) CU(cuMemFree_v2)(b->saved);
    for (int i = 0; i < 2; i++)
        if (b->ev[i]) CU(cuEventDestroy_v2)(b->ev[i]);
    free(b->ref), free(b->decoded);
    memset(b, 0, sizeof *b);
}

/* The buffers for a D of up to bytes (count elements). The saved copy falls back to host
 * memory where the GPU has no room for it, pinned memory to malloc'ed; false after one line
 * when the host has no memory for the copies. */
static bool tune_bufs_alloc(TuneBufs *b, size_t bytes, int64_t count) {
    memset(b, 0, sizeof *b);
    if (CU(cuMemAlloc_v2)(&b->saved, bytes) != CUDA_SUCCESS) {
        b->saved = 0;
        rt_note("FP8C_TUNE_GEMMS: no room on the GPU for a copy of the largest GEMM output (%.0f MiB); "
                "it is kept on the host", (double)bytes / 1048576.0);
    }
    void **host[3] = {&b->out, &b->again, &b->saved_host};
    int n_host = b->saved ? 2 : 3;
    b->pinned = true;
    for (int i = 0; i < n_host && b->pinned; i++)
        if (CU(cuMemAllocHost_v2)(host[i], bytes) != CUDA_SUCCESS) {
            *host[i] = NULL;
            b->pinned = false;
        }
    if (!b->pinned)
        for (int i = 0; i < n_host; i++) {
            if (*host[i]) CU(cuMemFreeHost)(*host[i]);
            *host[i] = malloc(bytes);
        }
    b->ref = malloc(sizeof *b->ref * (size_t)count);
    b->decoded = malloc(sizeof *b->decoded * CHECK_CHUNK);
    bool ok = b->out && b->again && (b->saved || b->saved_host) && b->ref && b->decoded;
    if (!ok)
        rt_error("FP8C_TUNE_GEMMS: no host memory for the checks' copies of the largest GEMM output "
                 "(%.0f MiB)", (double)(n_host * bytes + sizeof *b->ref * (size_t)count) / 1048576.0);
    ok = ok && CU_CHECK(CU(cuEventCreate)(&b->ev[0], 0)) && CU_CHECK(CU(cuEventCreate)(&b->ev[1], 0));
    if (!ok) tune_bufs_free(b);
    return ok;
}

/* D saved, and D put back as it was saved, in the stream's order */
static bool tune_save_d(CudaExec *e, TuneBufs *b, const ExecLaunch *x, size_t bytes) {
    CUdeviceptr D = (CUdeviceptr)(uintptr_t)x->D;
    if (b->saved) return CU_CHECK(CU(cuMemcpyDtoDAsync_v2)(b->saved, D, bytes, e->stream));
    return CU_CHECK(CU(cuStreamSynchronize)(e->stream)) && CU_CHECK(CU(cuMemcpyDtoH_v2)(b->saved_host, D, bytes));
}

static bool tune_restore_d(CudaExec *e, TuneBufs *b, const ExecLaunch *x, size_t bytes) {
    CUdeviceptr D = (CUdeviceptr)(uintptr_t)x->D;
    if (b->saved) return CU_CHECK(CU(cuMemcpyDtoDAsync_v2)(D, b->saved, bytes, e->stream));
    return CU_CHECK(CU(cuStreamSynchronize)(e->stream)) && CU_CHECK(CU(cuMemcpyHtoD_v2)(D, b->saved_host, bytes));
}

static double gemm_tolerance(ElemType t) {
    return t == FMT_F32 ? 1e-4 : t == FMT_E4M3 ? 0.13 : t == FMT_E5M2 ? 0.26 : 1e-2;
}

static int compare_floats(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* us as the report prints it: the rule that picks what to check sees what fp8c will read */
static double as_printed(double us) {
    char s[64];
    snprintf(s, sizeof s, "%.3f", us);
    return strtod(s, NULL);
}

/* x's GEMM with algo, from D restored: one run untimed, then GEMM_TIMED_RUNS with events.
 * t->median < 0 when the algorithm does not run; false when the GPU fails. */
static bool gemm_time(CudaExec *e, const ExecLaunch *x, const cublasLtMatmulAlgo_t *algo, TuneBufs *b,
                      size_t bytes, TuneTime *t) {
    *t = (TuneTime){-1, -1, -1};
    if (!tune_restore_d(e, b, x, bytes)) return false;
    if (exec_run_gemm(e, x, algo) != CUBLAS_STATUS_SUCCESS) return CU_CHECK(CU(cuStreamSynchronize)(e->stream));
    if (!CU_CHECK(CU(cuStreamSynchronize)(e->stream))) return false;
    float ms[GEMM_TIMED_RUNS];
    for (int r = 0; r < GEMM_TIMED_RUNS; r++) {
        if (!CU_CHECK(CU(cuEventRecord)(b->ev[0], e->stream)) || exec_run_gemm(e, x, algo) != CUBLAS_STATUS_SUCCESS ||
            !CU_CHECK(CU(cuEventRecord)(b->ev[1], e->stream)) || !CU_CHECK(CU(cuEventSynchronize)(b->ev[1])) ||
            !CU_CHECK(CU(cuEventElapsedTime)(&ms[r], b->ev[0], b->ev[1])))
            return false;
    }
    qsort(ms, GEMM_TIMED_RUNS, sizeof *ms, compare_floats);
    *t = (TuneTime){as_printed(ms[GEMM_TIMED_RUNS / 2] * 1000.0), as_printed(ms[0] * 1000.0),
                    as_printed(ms[GEMM_TIMED_RUNS - 1] * 1000.0)};
    return true;
}

typedef struct {
    bool ran, deterministic;
    double diff;        /* normalized max error against the reference */
} GemmCheck;

/* The largest |ref|, over its finite values: the error's scale */
static double ref_scale(const float *ref, int64_t count) {
    double scale = 0;
    for (int64_t i = 0; i < count; i++)
        if (isfinite(ref[i]) && fabs(ref[i]) > scale) scale = fabs(ref[i]);
    return scale;
}

/* The normalized max error of d (count elements of type t) against ref, decoded a chunk at a
 * time. Values that equal the reference's agree, infinities and NaNs included; any other
 * infinity or NaN is an infinite error. */
static double gemm_error(ElemType t, const void *d, const float *ref, double scale, int64_t count, float *buf) {
    double worst = 0;
    int eb = fmt_elem_bytes(t);
    for (int64_t at = 0; at < count; at += CHECK_CHUNK) {
        int64_t n = count - at < CHECK_CHUNK ? count - at : CHECK_CHUNK;
        num_decode(t, (const char *)d + at * eb, buf, n);
        for (int64_t i = 0; i < n; i++) {
            float v = buf[i], r = ref[at + i];
            if (v == r || (isnan(v) && isnan(r))) continue;
            double diff = fabs((double)v - r);
            if (!isfinite(diff)) return INFINITY;
            if (diff > worst) worst = diff;
        }
    }
    return scale > 0 ? worst / scale : worst;
}

/* x's GEMM with algo computed twice from D restored and copied back (into b->out, b->again):
 * deterministic when the two are the same bits; with ref, diff is the first's error against
 * it. c->ran false when the algorithm does not run; false when the GPU fails. */
static bool gemm_check(CudaExec *e, const ExecLaunch *x, const cublasLtMatmulAlgo_t *algo, TuneBufs *b,
                       const float *ref, double scale, int64_t count, size_t bytes, GemmCheck *c) {
    memset(c, 0, sizeof *c);
    for (int pass = 0; pass < 2; pass++) {
        if (!tune_restore_d(e, b, x, bytes)) return false;
        if (exec_run_gemm(e, x, algo) != CUBLAS_STATUS_SUCCESS) return CU_CHECK(CU(cuStreamSynchronize)(e->stream));
        if (!CU_CHECK(CU(cuStreamSynchronize)(e->stream)) ||
            !CU_CHECK(CU(cuMemcpyDtoH_v2)(pass ? b->again : b->out, (CUdeviceptr)(uintptr_t)x->D, bytes)))
            return false;
    }
    c->ran = true;
    c->deterministic = !memcmp(b->out, b->again, bytes);
    if (ref) c->diff = gemm_error(x->gemm->dtype, b->out, ref, scale, count, b->decoded);
    return true;
}

/* One candidate's line in the report */
typedef struct {
    TuneTime time;      /* median < 0: it did not run, and is left out */
    bool is_default, checked;
    GemmCheck check;
    const char *note;   /* why not ok, or NULL */
} GemmCand;

static bool exec_tune_report_gemm(CudaExec *e, const ExecLaunch *x, TuneBufs *b, TimedKey *timed, int *n_timed) {
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
    int nc = x->n_cands;
    GemmCand *cand = calloc((size_t)nc, sizeof *cand);
    TuneTime *times = malloc(sizeof *times * (size_t)nc);
    int *order = malloc(sizeof *order * (size_t)nc);
    bool ok = cand && times && order && tune_save_d(e, b, x, bytes);

    /* the reference: the default's D, twice (decoded once a candidate needs it); then every
     * candidate timed */
    GemmCheck def = {0};
    TuneTime def_time = {-1, -1, -1};
    ok = ok && gemm_check(e, x, &x->algo, b, NULL, 0, count, bytes, &def) && def.ran;
    ok = ok && gemm_time(e, x, &x->algo, b, bytes, &def_time) && def_time.median >= 0;
    for (int c = 0; ok && c < nc; c++) {
        GemmCand *k = &cand[c];
        k->is_default = !memcmp(&x->cands[c].algo, &x->algo, sizeof x->algo);
        if (k->is_default) k->time = def_time, k->checked = true, k->check = def;
        else ok = gemm_time(e, x, &x->cands[c].algo, b, bytes, &k->time);
        times[c] = k->time;
        if (!k->is_default) k->note = "not checked: not faster than the default by more than the noise";
    }

    /* the checks, fastest first, of the candidates that could win, up to the first that passes */
    double tol = gemm_tolerance(g->dtype);
    int n_could = ok ? rt_tune_could_win(def_time, def.deterministic, times, nc, order) : 0;
    bool passed = false, have_ref = false;
    double scale = 0;
    for (int j = 0; ok && j < n_could; j++) {
        GemmCand *k = &cand[order[j]];
        if (k->is_default) continue;
        if (passed) {
            k->note = "not checked: a faster candidate passed the checks";
            continue;
        }
        if (!have_ref) {   /* b->out still holds the default's D: decoded only when needed */
            num_decode(g->dtype, b->out, b->ref, count);
            scale = ref_scale(b->ref, count);
            have_ref = true;
        }
        ok = gemm_check(e, x, &x->cands[order[j]].algo, b, b->ref, scale, count, bytes, &k->check);
        k->checked = true;
        k->note = !k->check.ran ? "did not run when checked" : !k->check.deterministic ? "not deterministic" : NULL;
        passed = k->check.ran && k->check.deterministic && k->check.diff <= tol;
    }
    for (int c = 0; ok && c < nc; c++)
        if (cand[c].is_default && !def.deterministic) cand[c].note = "not deterministic";

    char *list = NULL;
    size_t list_len = 0;
    FILE *cands = ok ? open_memstream(&list, &list_len) : NULL;
    ok = ok && cands;
    int written = 0;
    for (int c = 0; ok && c < nc; c++) {
        const GemmCand *k = &cand[c];
        if (k->time.median < 0) continue;   /* a candidate that does not run */
        algo_to_hex(&x->cands[c].algo, chex);
        algo_label(&x->cands[c].algo, label, sizeof label);
        bool good = k->checked && k->check.ran && k->check.deterministic && k->check.diff <= tol;
        fprintf(cands, "%s\n      {\"value\": \"%s\", \"label\": \"%s\", \"median\": %.3f, \"min\": %.3f, \"max\": %.3f",
                written++ ? "," : "", chex, label, k->time.median, k->time.min, k->time.max);
        if (k->checked && k->check.ran)
            fprintf(cands, ", \"max_rel_diff\": %.3g", isfinite(k->check.diff) ? k->check.diff : 1e30);
        fprintf(cands, ", \"ok\": %s", good ? "true" : "false");
        if (k->note) fprintf(cands, ", \"note\": \"%s\"", k->note);
        fputc('}', cands);
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
    ok = ok && tune_restore_d(e, b, x, bytes);
    free(cand), free(times), free(order);
    return ok;
}

/* The micro-step of the tuning mode: launch by launch, each GEMM tried first. */
bool exec_run_tuning(CudaExec *e, ExecList *L) {
    FILE *f = fopen(e->tune_report, "w");
    if (!f) {
        rt_error("FP8C_TUNE_GEMMS=%s: cannot write the report: %s", e->tune_report, strerror(errno));
        return false;
    }
    fputs("{\"device\": {\"description\": \"", f);
    for (const char *p = e->desc; *p; p++) fprintf(f, *p == '"' || *p == '\\' ? "\\%c" : "%c", *p);
    fputs("\"},\n  \"gemms\": [", f);
    int64_t most = 1;   /* elements of the step's largest D, and its bytes */
    size_t most_bytes = 1;
    for (int i = 0; i < L->n; i++) {
        const CuGemm *g = L->l[i].gemm;
        if (L->l[i].kind != CU_GEMM || L->l[i].n_cands < 1) continue;
        int64_t count = (g->n - 1) * g->ldd + g->m;
        size_t bytes = (size_t)count * (size_t)fmt_elem_bytes(g->dtype);
        if (count > most) most = count;
        if (bytes > most_bytes) most_bytes = bytes;
    }
    TuneBufs b;
    int n_timed = 0;
    TimedKey *timed = calloc((size_t)(L->n ? L->n : 1), sizeof *timed);
    bool ok = timed && tune_bufs_alloc(&b, most_bytes, most);
    bool have_bufs = ok;
    for (int i = 0; ok && i < L->n; i++) {
        const ExecLaunch *x = &L->l[i];
        if (x->kind == CU_GEMM && x->n_cands > 0) ok = exec_tune_report_gemm(e, x, &b, timed, &n_timed);
        ok = ok && exec_launch(e, x);
    }
    if (have_bufs) {
        if (!CU_CHECK(CU(cuStreamSynchronize)(e->stream))) ok = false;   /* the copies done before the free */
        tune_bufs_free(&b);
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
    if (g->fast_accum) {
        int8_t fast = 1;
        if (!LT_CHECK(CU(cublasLtMatmulDescSetAttribute)(x->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast)))
            return false;
    }
    if (g->scales >= 0) {
        /* cuBLASLt multiplies by these: the dequantization scales 1/s */
        CUdeviceptr at = g->descaled ? e->descales + (CUdeviceptr)g->descales : e->scratch + (CUdeviceptr)g->scales;
        const float *sa = (const float *)(uintptr_t)at;
        const float *sb = (const float *)(uintptr_t)(g->descaled ? at + 64 : e->scratch + (CUdeviceptr)g->scales_b);
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
bool exec_setup_gemm(CudaExec *e, const CuLaunch *l, ExecLaunch *x, bool *no_algo) {
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
