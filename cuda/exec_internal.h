/* exec_internal.h — what the files of the CUDA executor share (cuda/exec*.c).
 *
 * exec.c sets the executor up (arenas, module, the phases' launch lists) and runs the lists;
 * exec_gemm.c sets up and runs the cuBLASLt matmuls, with their timed, stored or tuned
 * algorithms; exec_batch.c runs a run of small update nodes as one launch per kernel;
 * exec_comm.c sums the gradients over the ranks, in buckets during the last micro-step;
 * exec_shard.c runs the sharded step (--shard-states): shard arenas, reductions to the
 * shards' owners, the update over each rank's shards and the gathers after it; exec_grads.c
 * its stage 2 (--shard-states=2): the backward's bucket buffers, reduced every micro-step;
 * exec_gather.c its stage 3 (=3): the layers' weights gathered into layer buffers;
 * exec_cg.c runs loop kernels of a kernel-IR program on the executor's arenas (tests). They
 * share the executor's state (struct CudaExec) and its launch lists. Internal to cuda/. */
#ifndef FP8C_EXEC_INTERNAL_H
#define FP8C_EXEC_INTERNAL_H

#include "gpu_internal.h"

#define CUBLAS_WORKSPACE (32 << 20)
#define ALIGN 256
#define GEMM_CANDIDATES 8       /* algorithms the heuristic offers for timing */
#define GEMM_TUNE_RUNS 5
#define GEMM_WIDE 32            /* algorithms the heuristic offers in the tuning mode */
#define GEMM_TIMED_RUNS 7       /* timed runs of each in the tuning mode: median, min, max */
#define EXEC_ROPE_TABLES 8      /* RoPE tables of distinct (T, head_dim, theta) a graph may have */
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

/* The update's leading gradient norms (SQNORM; delayed scales may come between them, which go
 * to LIST_UPDATE) are a list of their own, LIST_NORMS, run before LIST_UPDATE, where the update
 * is one list (not sharded): on one GPU the gradients' finite check runs them, their
 * last launches setting its flag, and the update after it runs the rest (cuda_exec_all_finite) */
enum { LIST_EVAL, LIST_MICRO, LIST_UPDATE, LIST_FINITE, LIST_NORMS, LIST_COUNT };

/* A gradient summed over the ranks (an ALL_REDUCE node, comm.c): by NCCL, in its bucket
 * while the last micro-step's backward runs, or at the start of the update (exec_comm.c). */
typedef struct {
    const Node *node;
    CUdeviceptr p;
    int64_t count;
    ElemType elem;
} ExecReduce;

/* --shard-states (exec_shard.c): a kept run [lo, hi) of the host persistent arena, at byte
 * dev of the device's; an update and the shard this rank owns; a sharded tensor (a state, a
 * master, or a codec's side values) at byte `at` of the host arena. */
typedef struct {
    int64_t lo, hi, dev;
} ExecSegment;
typedef struct {
    const Node *node;
    int64_t n, group;                     /* elements, shard group (rt_shard_group) */
    RtShard mine;
    int reduce;                           /* its gradient's sum in e->reduce */
    CUdeviceptr grad, param, copy, amax;  /* whole tensors; copy and amax 0 without an FP8 copy */
    int64_t grad_bytes, param_eb, copy_eb;
    bool gathered;                        /* --shard-states=3: the weight (and copy) kept as its
                                             shard and gathered by the step (exec_gather.c) */
} ExecShardUpdate;
typedef struct {
    int update;
    int64_t at, bytes;                    /* the whole tensor in the host arena */
    Codec codec;                          /* CODEC_PLAIN: codes of eb bytes; else its side values */
    int64_t eb;
} ExecShardTensor;
typedef bool (*ExecPieceFn)(CudaExec *e, char *host, CUdeviceptr dev, int64_t bytes, void *ctx);
/* --shard-states=2 (exec_grads.c): a gradient (in e->comm.reduce's order), its accumulator's
 * bytes in the host arena, its place in its bucket's buffer and this rank's shard of it. */
typedef struct {
    int bucket;
    int64_t at, bytes, eb;                /* the whole accumulator in the host arena */
    ElemType elem;
    int64_t buf_at;                       /* its place among the buffers (e->grad_buf) */
    int64_t n, group;                     /* elements, shard group (rt_shard_group) */
    RtShard mine;
    CUdeviceptr shard;                    /* this rank's shard accumulator (persistent) */
} ExecGrad;

/* --shard-states=3 (exec_gather.c): what one gather brings into the layer buffers, and one
 * gather of a layer in a phase with its places in the two lists that run it. An item is a
 * tensor whose readers read the buffer: a weight or its FP8 copy, gathered from the owners'
 * shards as they keep them; or, where the forward quantizes a weight per tensor to e4m3
 * (-O3), that QUANTIZE's result, which each owner makes of its shard with the scale of the
 * ranks' largest amax (its QUANT_SCALE's place then copies that scale; the QUANTIZE's own
 * launch runs over no elements, for the inverse scales it writes for the GEMMs). */
enum { GATHER_EVAL, GATHER_MICRO, GATHER_LISTS };   /* LIST_EVAL, LIST_MICRO */
typedef struct {
    int gather;                           /* index into e->gathers */
    const Node *tensor;                   /* the PARAM, the weight_copy state, or the QUANTIZE */
    const char *host;                     /* its bytes in a host arena (persistent, or step) */
    int64_t bytes, eb;
    const Node *weight;                   /* the sharded tensor: tensor, or the QUANTIZE's PARAM */
    int64_t weight_at, weight_eb;         /* in the host persistent arena */
    int64_t n, group;                     /* elements, shard group (its update's) */
    int64_t buf_at;                       /* its place among the buffers (e->gather_buf) */
    /* e4m3 (-O3): the QUANT_SCALE, the item's amax and scale (f32) in the gather area, where
     * in each list the scale is copied to the QUANT_SCALE's result, and the three argument
     * blocks run on NCCL's stream (the shard's amax, the scale, the shard's quantize) */
    const Node *scale;
    int64_t scalars_at;
    int scale_at[GATHER_LISTS];
    CUfunction fn_amax, fn_scale, fn_quantize;
    unsigned grid_amax, grid_quantize, block_amax, block_scale, block_quantize;
    CkArgs amax_args, scale_args, quantize_args;
} ExecGatherItem;
typedef struct {
    Phase phase;
    int issue;                            /* node position: enqueued before its launches */
    int buffer;                           /* e->gather_slot_at[buffer]: its buffer */
    int first_item, n_items;
    int64_t bytes;                        /* its items in the buffer, aligned */
    /* per list: the launch it is issued before, the first and last launch that read it
     * (-1: none); filled while the lists are resolved */
    int issue_at[GATHER_LISTS], read_from[GATHER_LISTS], read_to[GATHER_LISTS];
    CUevent done;                         /* its collectives have finished (NCCL's stream) */
} ExecGather;

struct CudaExec {
    Graph *g;
    RtMemory host;
    Arena *arena;
    CUdevice dev;
    int sms;                              /* its multiprocessors (CuLaunch.per_sm) */
    CUcontext ctx;
    CUstream stream;
    CUmodule modules[CUDA_MAX_MODULES];   /* the binary's cubins (module_set.c) */
    int n_modules;
    cublasLtHandle_t lt;
    bool have_ctx, have_lt;
    CUdeviceptr persistent, step;
    int64_t step_alloc;                   /* step arena + workspace */
    CUdeviceptr cublas_ws, scratch, aux;
    CUdeviceptr descales;     /* in aux: GEMMs' dequantization scales written by earlier
                                 launches (cuda_plan_descale_bytes) */
    int64_t descale_bytes;
    int64_t scratch_bytes, aux_bytes, aux_used;
    /* RoPE's tables (CuLaunch.rope_table), one per (T, head_dim, theta), in aux */
    struct { int64_t T, D; double theta; CUdeviceptr at; } rope[EXEC_ROPE_TABLES];
    int n_rope;
    CuNodePlan *node_plans;               /* one node each (cuda_exec_run_node) */
    CuNodePlan *plans;                    /* the phases': GEMM epilogues fused */
    int n_epilogues;                      /* GEMMs in plans with a fused epilogue */
    int n_gelu, n_dgelu, n_fp8_results;   /* of them: GELU, GELU's backward, an FP8 D */
    ExecList lists[LIST_COUNT];
    /* seconds of cuda_exec_open: planning and allocation, the module and cuBLASLt, the launch
     * lists (with the GEMMs' set-ups), the arenas' upload (cuda_exec_setup_times) */
    double setup_s[4];
    int *batch_run;                       /* per node: nodes in the batched run it starts, else 0 */
    int finite_flag_off;                  /* in aux */
    const Node **norm_nodes;              /* the SQNORMs in LIST_NORMS, in order */
    int n_norm_nodes;
    int norms_check;                      /* LIST_NORMS is the finite check of the gradients asked
                                             about (1), is not (0), not yet known (-1) */
    unsigned touched;                     /* counts what may change the gradients: runs of the
                                             other lists, pushes, zeroings */
    unsigned norms_ran;                   /* `touched` when the check last ran LIST_NORMS, + 1
                                             (0: never), so the update need not run them again */
    int ticket_off;                       /* in aux: the kernels' last-block counter */
    bool graphs, sync_each, profile;
    bool pdl;   /* the choice cuda.pdl: kernels launched programmatically dependent (exec_launch) */
    bool tune;                            /* time the heuristic's candidates (set-up only) */
    TunedGemm *tuned;
    int n_tuned, cap_tuned;
    ExecReduce *reduce;                   /* the gradients to sum (several ranks only), in the */
    int n_reduce;                         /* order sent: comm.reduce's */
    RtCommPlan comm;                      /* their buckets */
    bool overlap;                         /* comm.overlap: buckets sent in the last micro-step */
    int *bucket_at;                       /* per bucket: the micro list's launches before it */
    CUstream comm_stream;                 /* NCCL's, with overlap */
    CUevent comm_ready, comm_done;        /* a bucket's accumulators written; all buckets sent */
    ExecList last;                        /* the last micro-step's graph (LIST_MICRO's launches) */
    bool last_warm;                       /* it ran once uncaptured (NCCL's connections exist) */
    bool reduced;                         /* this step's sums ran in its last micro-step */
    /* the FP8 reduction (comm:grad=e5m2 or e4m3, exec_comm.c): its kernels, one device block
     * for its buffers, and each bucket's argument block */
    CUfunction comm_fn[COMM_KERNELS];
    CUdeviceptr comm_mem;
    int64_t comm_mem_bytes;
    CkArgs *comm_args;
    /* --shard-states (exec_shard.c): this rank's shards, the device arena's segments, the
     * update list's pieces (launches before norm_end, before upd_end, the rest) */
    bool shard;
    int shard_world, shard_rank;
    ExecShardUpdate *shard_updates;
    int n_shard_updates;
    ExecShardTensor *shard_tensors;
    int n_shard_tensors;
    ExecSegment *shard_segs;
    int n_shard_segs;
    int64_t persistent_alloc;             /* the device's persistent arena */
    int norm_end, upd_end;
    CUdeviceptr norm_chunks;              /* every SQNORM's chunk sums (f64, ir.h), summed over the ranks */
    int64_t n_norm_chunks;
    bool *norm_final;                     /* per launch of the update list: a SQNORM's last */
    int n_sqnorms;
    ExecList shard_graph;                 /* the update with its collectives, captured */
    bool shard_warm;
    /* --shard-states=2 (exec_grads.c): the gradients, the bucket buffers (in the step
     * allocation, after aux), each bucket's first write (a node, then a launch of the micro
     * list), each buffer's event (its last bucket reduced) and whether this micro-step used it */
    bool shard_grads;
    bool map_grads;                       /* resolving the micro list: accumulators -> buffers */
    ExecGrad *grads;
    int n_grads;
    RtGradSlots grad_slots;
    CUdeviceptr grad_buf;
    int *open_node, *bucket_open;
    CUevent *slot_sent;
    bool *slot_busy;
    /* --shard-states=3 (exec_gather.c): the gathered weights, the layer buffers (in the step
     * allocation, after the gradient buffers) and, while a list is resolved, where it is */
    bool shard_weights;
    ExecGatherItem *gather_items;
    int n_gather_items;
    ExecGather *gathers;
    int n_gathers;
    int64_t *gather_slot_at;              /* per buffer: its byte offset among all of them */
    int n_gather_slots;
    CUdeviceptr gather_buf;
    int64_t gather_buf_bytes;             /* the buffers; then the gather area's scalars */
    int gather_list;                      /* resolving: GATHER_EVAL or _MICRO; -1 otherwise */
    int gather_node, gather_launch;       /* resolving: the node and the list's next launch */
    bool gather_zeroed;                   /* resolving an e4m3 item's QUANTIZE (no elements) */
    const Node *gather_miss;              /* a node that read a gathered weight outside a gather */
    CUevent gather_ready;                 /* the executor's stream reached a gather's issue */
    bool eval_warm;                       /* the evaluation list ran once uncaptured */
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

static inline int64_t align_up(int64_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }
static inline int64_t tensor_bytes(const Tensor *t) { return ir_numel(t) * fmt_elem_bytes(t->fmt.elem); }

/* ---------------------------------------------------------------- exec.c */

bool grow(void **items, int *cap, int n, size_t size);
bool env_flag(const char *name, bool dflt);
bool exec_map_tensor(const CudaExec *e, const Tensor *t, CUdeviceptr *out);
bool exec_resolve(CudaExec *e, const CuLaunch *l, CkArgs *a, CUdeviceptr scratch_base);
CUdeviceptr ref_ptr(CudaExec *e, const CuRef *r, bool *ok);
bool list_push(ExecList *L, ExecLaunch *x);
bool aux_take(CudaExec *e, const void *host, int64_t bytes, CUdeviceptr *out);
bool exec_get_function(CudaExec *e, const Node *n, const char *fn, unsigned smem, CUfunction *f);
bool exec_launch(CudaExec *e, const ExecLaunch *x);
/* launch(e, ctx)'s work as a CUDA graph: captured at the first call into G, replayed from then
 * on (the step's lists, the last micro-step with its buckets, the sharded update) */
bool exec_replay(CudaExec *e, ExecList *G, bool (*launch)(CudaExec *e, void *ctx), void *ctx);
bool exec_finish(CudaExec *e, const char *what);

/* ---------------------------------------------------------------- exec_gemm.c */

bool exec_setup_gemm(CudaExec *e, const CuLaunch *l, ExecLaunch *x, bool *no_algo);
/* Data parallel: the lists' GEMMs take rank 0's timed algorithms (every rank the same kernels). */
bool exec_agree_gemms(CudaExec *e);

/* ---------------------------------------------------------------- exec_comm.c */

/* The gradients' sums and their buckets (several ranks only); micro_end[i]: LIST_MICRO's
 * launches up to node i's. */
bool exec_comm_open(CudaExec *e, const int *micro_end);
void exec_comm_close(CudaExec *e);
/* Whether a node that plan p's launches compute (own, or the plan's members), or one of their
 * operands, shares bytes with accumulator acc: the launches then read or write what NCCL sums. */
bool exec_plan_touches(const CuNodePlan *p, const Node *own, const Node *acc);
bool exec_run_reduce(CudaExec *e);        /* all the sums, one group, on the executor's stream */
void exec_free_gemm(ExecLaunch *x);
cublasStatus_t exec_run_gemm(CudaExec *e, const ExecLaunch *x, const cublasLtMatmulAlgo_t *algo);
bool exec_run_tuning(CudaExec *e, ExecList *L);

/* ---------------------------------------------------------------- exec_batch.c */

/* A node of a batched run: its plan and its own scratch (in aux). */
typedef struct {
    const Node *node;
    const CuNodePlan *plan;
    CUdeviceptr scratch;      /* the node's scratch */
} BatchItem;

enum { BATCH_MIN = 2 };

bool batch_same_kernels(const CuNodePlan *a, const CuNodePlan *b);
int64_t batch_aux_bytes(int n_launch, int n);
bool exec_add_batch(CudaExec *e, ExecList *L, const BatchItem *it, int n);

int64_t exec_find_batches(CudaExec *e);
bool exec_add_run(CudaExec *e, ExecList *L, int i);

/* ---------------------------------------------------------------- exec_shard.c */

/* The device's persistent arena for --shard-states as rank `rank` of `world` (e->shard set
 * where world > 1; else the host's size); -1 after one rt_error line. Before the arenas are
 * allocated (it reads only the graph and the host mirror). */
int64_t exec_shard_layout(CudaExec *e, int world, int rank);
CUdeviceptr exec_shard_map(const CudaExec *e, int64_t off);   /* byte off of the host persistent arena */
/* fn over the pieces of host bytes [p, p+bytes) that the device holds, with their device
 * addresses: the whole range, except where a shard of another rank's is cut out (name: the
 * tensor's, for the error when p is in neither arena). */
bool exec_pieces(CudaExec *e, const char *name, const void *p, int64_t bytes, ExecPieceFn fn, void *ctx);
bool exec_shard_prepare(CudaExec *e);             /* the update list's launches over the shards */
bool exec_shard_reduce(CudaExec *e, int first, int count, CUstream stream);
bool exec_shard_run_update(CudaExec *e);
void exec_shard_close(CudaExec *e);

/* ---------------------------------------------------------------- exec_grads.c */

/* --shard-states=2: the gradients and their bucket buffers (e->shard_grads set where the
 * graph asks for stage 2 and the layout is sharded); the buffers' bytes, 0 without stage 2,
 * -1 after one rt_error line. After exec_shard_layout, before the arenas are allocated (it
 * reads the graph, the host mirror and e->plans). */
int64_t exec_grads_layout(CudaExec *e);
/* The device address of byte off of the host persistent arena while the micro list is
 * resolved (e->map_grads): inside an accumulator, its place in its bucket's buffer. */
bool exec_grads_map(const CudaExec *e, int64_t off, CUdeviceptr *out);
bool exec_grads_open(CudaExec *e, const int *micro_end);   /* after exec_comm_open */
void exec_grads_begin(CudaExec *e);                        /* a micro-step's list starts */
bool exec_grads_open_bucket(CudaExec *e, int b);
bool exec_grads_reduce(CudaExec *e, int first, int count, CUstream stream);
/* a finite check's tensor (a gradient) restricted to this rank's shard of its sum */
bool exec_grads_restrict_check(CudaExec *e, const Tensor *t, CkTensor *a);
void exec_grads_close(CudaExec *e);

/* ---------------------------------------------------------------- exec_gather.c */

/* --shard-states=3: the gathers (runtime/comm_weights.c's plan) and their layer buffers
 * (e->shard_weights set where the graph asks for stage 3 and the layout is sharded); the
 * buffers' bytes, 0 without stage 3, -1 after one rt_error line. After exec_shard_layout and
 * exec_grads_layout, before the arenas are allocated (it reads the graph and the host mirror). */
int64_t exec_gather_layout(CudaExec *e);
/* Resolving list GATHER_EVAL or GATHER_MICRO: node `node`'s launches come next, from launch
 * `launch` on (every node, launches or not); list -1: resolving ends. True when the node's
 * launches are not to be added: an e4m3 item's QUANT_SCALE, whose place copies the scale. */
bool exec_gather_at(CudaExec *e, int list, int node, int launch);
/* The device address of tensor t while a list is resolved: inside a gathered weight or copy
 * (its bytes, persistent), or a gathered quantize (the very tensor: step arena bytes serve
 * other tensors at other times), its place in the buffer of the gather that holds it for the
 * node being resolved (its phase's latest gather issued by then); false otherwise. A read
 * that no gather holds is remembered (e->gather_miss) for exec_gather_check. */
bool exec_gather_map(const CudaExec *e, const Tensor *t, CUdeviceptr *out);
/* After the lists are resolved: every read inside a gather issued before it, every gather
 * issued, a buffer handed to a later gather only after the earlier one's last reader; and
 * the e4m3 items' QUANTIZE launches in the lists cut to no elements. */
bool exec_gather_check(CudaExec *e);
bool exec_gather_open(CudaExec *e);                          /* events; after exec_comm_open */
/* Before launch i of list GATHER_EVAL or _MICRO: the gathers issued there, on NCCL's stream,
 * and the executor's stream made to wait for the gathers its launch i first reads. */
bool exec_gather_before(CudaExec *e, int list, int i);
bool exec_gather_run_eval(CudaExec *e);                      /* the evaluation list, with gathers */
void exec_gather_close(CudaExec *e);

#endif
