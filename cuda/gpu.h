/* gpu.h — the GPU backend: what runs on an NVIDIA GPU and how it gets there.
 *
 * The compiler and the training binary share one description of the GPU's work: for every
 * node of the scheduled graph, spec.c says which kernels of the kernel library
 * (cuda/kernels/ (.cuh), CUDA C++ templates over tensor formats) run, with which template
 * arguments, launch shape, argument block and scratch, or which cuBLASLt GEMM. At `fp8c build`
 * render.c turns the set of kernels a graph needs into one CUDA C module and nvrtc.c compiles
 * it for sm_90a (cubin, plus PTX) through NVRTC, with a cache keyed by the source and the
 * options; emit.c embeds the cubin in the training binary. At run time the binary re-derives
 * the same plan from its graph (no compiler), loads the cubin, and exec.c replays each
 * phase's launch list as a CUDA graph. The binary does not link the CUDA driver or cuBLASLt:
 * loader.c opens them with dlopen when the GPU is chosen, so the same binary starts on
 * machines without a GPU and trains on the CPU there.
 *
 * Sections: spec.c (node -> launches; with spec_ops.c, spec_gemm.c and spec_fuse.c),
 * render.c (CUDA C module), nvrtc.c (compiler only), loader.c (driver and cuBLASLt entry
 * points), exec.c (the executor; with exec_gemm.c, exec_batch.c and exec_cg.c), device.c
 * (the training program's "cuda" device). */
#ifndef FP8C_GPU_H
#define FP8C_GPU_H

#include "ck_args.h"
#include "codegen.h"
#include "rt.h"

/* ---------------------------------------------------------------- spec.c */

/* A tensor an argument block refers to: a node's tensor, or a piece of the node's scratch. */
typedef struct {
    const Node *node;       /* NULL: scratch (or nothing, when scratch < 0) */
    int64_t scratch;        /* byte offset in the node's scratch, -1: none */
    int64_t offset;         /* with node: bytes into its storage (a transposed copy kept there) */
} CuRef;

/* How a cuBLASLt FP8 operand is scaled (cublasLtMatmulMatrixScale_t on Hopper). For an
 * operand stored (outer, k) with k contiguous, its dequantization scales are: TENSOR one f32;
 * OUTER one per outer row; VEC128 one per 1 x 128 run along k, laid out [k / 128][outer];
 * BLK128 one per 128 x 128 block, laid out [outer / 128][k / 128 rounded up to 4]. */
typedef enum { CU_SCALE_TENSOR, CU_SCALE_OUTER, CU_SCALE_VEC128, CU_SCALE_BLK128 } CuScaleMode;

/* The activation a cuBLASLt epilogue applies after the bias: GELU (tanh approximation, as the
 * GELU op) writes D = gelu(product + bias) and the pre-activation product + bias to aux
 * (CUBLASLT_EPILOGUE_GELU_AUX[_BIAS]); DGELU writes D = product * gelu'(aux), the backward of
 * a GELU whose input aux holds (CUBLASLT_EPILOGUE_DGELU). */
typedef enum { CU_ACT_NONE, CU_ACT_GELU, CU_ACT_DGELU } CuActivation;

/* One cuBLASLt matmul in column-major terms: D (m, n) = op(A) (m, k) op(B) (k, n), with
 * dequantization scales for FP8 operands. The row-major C = op(A_g) op(B_g) of the graph is
 * D = C^T: m = N, n = M, A = B_g's side, B = A_g's side. */
typedef struct {
    int64_t m, n, k, lda, ldb, ldd;
    bool ta, tb;            /* CUBLAS_OP_T for A, B */
    ElemType atype, btype, dtype;
    CuRef a, b, d;
    /* FP8: scratch offsets of A's and B's dequantization scales (1/s, laid out as their modes
     * say); scales -1: unscaled */
    int64_t scales, scales_b;
    /* descaled: per-tensor scales that an earlier launch computed at byte offset `descales`
     * of the executor's descale area instead of scratch (fold_inverse_scales; B's 64 bytes
     * after A's) */
    bool descaled;
    int64_t descales;
    CuScaleMode scale_a, scale_b;
    CuRef bias, c;          /* epilogue: bias vector of length m (node NULL: none); C added
                               with beta = 1, same type and layout as D (node NULL: none) */
    ElemType biastype;
    bool fast_accum;        /* FP8 forward GEMMs: Hopper's fast accumulation (no promotion) */
    CuActivation act;       /* with aux: (m, n) like D, leading dimension m, in auxtype */
    CuRef aux;
    ElemType auxtype;
    /* an FP8 D (e4m3, e5m2): D = dscale's scalar x the value (a delayed per-tensor scale), and
     * cuBLASLt leaves amax(value) as one f32 at scratch offset `amax` (AMAX_D; -1: none) */
    CuRef dscale;
    int64_t amax;
} CuGemm;

typedef enum { CU_KERNEL, CU_GEMM } CuLaunchKind;

typedef struct {
    CuLaunchKind kind;
    char fn[64];            /* the module's function */
    char body[512];         /* what it calls: "ck_binary<OP_ADD, F<2, 0>, ..>(a)" */
    unsigned grid[2], block, smem;
    unsigned per_sm;        /* > 0: at most this many blocks an SM of the device run it (the
                               executor caps grid[0]): a kernel whose blocks walk the work */
    unsigned min_blocks;    /* blocks an SM must hold at once (__launch_bounds__'s second
                               argument: caps the registers a thread; 0: no bound); one
                               value for every launch of a body, which names the function */
    CkArgs args;            /* everything but the pointers, which refs resolve */
    CuRef ref[CK_MAX_TENSORS];
    bool ref_scale[CK_MAX_TENSORS];   /* ref i is a node whose scale array goes in t[i].s */
    int64_t scratch;        /* byte offset of args.scratch in the node's scratch, -1: none */
    bool table;             /* args.table: the node's scalar inputs 1.. (grad_norm) */
    /* args.tmaps: tma TMA tensor maps, of args.t[tma_first ..]: each a 3-D bf16 view (its row
     * width, T rows a batch, B batches; T and B from args.i[1], i[0]; the row width
     * args.i[tma_stride + 2 k]) read in 64 x 64 boxes, 128-byte swizzled (attn_ws.cuh) */
    int tma, tma_first, tma_stride;
    bool rope_table;        /* args.scratch: RoPE's (T, head_dim / 2) table of (cos, sin) in f64,
                               for T = args.i[3], head_dim = args.i[0], theta = args.f[0]; made
                               once on the host and kept in the executor's aux (exec.c), so
                               every RoPE of the step reads the one table */
    bool check_flag;        /* args.t[2]: the executor's flag of the gradients' finite check,
                               which the launch sets where it finds a value not finite
                               (SQNORM's last launch; exec.c, cuda_exec_all_finite) */
    bool batch;             /* its code reads the grid as CK_BLOCK / CK_BLOCKS: launches of it
                               for independent nodes may run as one (render.c's batch_ entry) */
    /* the dequantization scales this launch's block 0 writes first for later GEMMs (args'
     * inv_from, inv_to): the scale nodes (A's side, B's side, as ck_inv_scales' t[1], t[2])
     * and the byte offset in the descale area, per GEMM */
    const Node *inv_from[2 * CK_MAX_INVERSE];
    int64_t inv_slot[CK_MAX_INVERSE];
    int n_inv;
    /* the per-tensor scale (a QUANT_SCALE) that the launch's last block stores from its block
     * maxima, args' scale_to (spec_scales.c, fold_amax_scales); NULL: none */
    const Node *scale_to;
    /* with scale_to: the amax (a persistent f32 scalar) the launch makes that scale from itself,
     * args' scale_amax (spec_scales.c, fold_state_scales); NULL: none */
    const Node *scale_amax;
    CuGemm gemm;
} CuLaunch;

typedef struct CuNodePlan {
    const Node *node;
    CuLaunch *launch;
    int n_launch;
    int64_t scratch_bytes;
    const Node **members;   /* cuda_plan_epilogues: the group this GEMM computes (matmul
                               first), whose other nodes have empty plans; NULL otherwise */
    int n_members;
    /* the other fusions (a producer writing its quantize, a cast-transpose summing a bias
     * gradient, a quantize making its group scales): the nodes whose work these launches do
     * besides `node`'s, for listings only */
    const Node *absorbed[6];
    int n_absorbed;
    /* a node whose work a later node's launches do in the micro-step (a cross entropy whose
     * backward computes it: fuse_ce_one_pass), with no launches here: its own launches, for
     * where it runs without that node (evaluation, cuda_exec_run_node); NULL otherwise */
    const struct CuNodePlan *alone;
} CuNodePlan;

/* The launches of node n (none for leaves and views). Returns false with a reason in why
 * when the GPU backend cannot run n (an op or format it has no kernel for). Launches live in
 * arena a; g's choices are read (NULL: the defaults). */
bool cuda_plan_node(const Graph *g, const Node *n, Arena *a, CuNodePlan *out, char *why, size_t why_len);
/* Plans every node of g; the first node that cannot run is reported in why. */
CuNodePlan *cuda_plan_graph(const Graph *g, Arena *a, char *why, size_t why_len);
/* Data parallel, comm.overlap (exec_comm.c): root[b] is the node whose launches write bucket
 * b's last accumulator in the micro-step (plans[root[b]]: an epilogue or a fusion may write it
 * after the ACCUMULATE's own place), never before root[b-1]. The executor sends the bucket
 * after those launches; the kernel listing prints it there. */
bool cuda_comm_bucket_roots(const Graph *g, const CuNodePlan *plans, const RtCommPlan *cp, int *root);
/* The plans the phases run: node_plans (cuda_plan_graph's), except that a matmul whose fuse
 * group (codegen/fuse.c) is a bias add, a residual or gradient-sum add, an accumulation into a
 * gradient, or GELU's backward becomes one GEMM with a cuBLASLt epilogue at the group's place,
 * and so does a GELU of its result with, under delayed scaling, the GELU's FP8 copy and amax
 * record; the other nodes get empty plans. Renumbers g. */
CuNodePlan *cuda_plan_epilogues(Graph *g, const CuNodePlan *node_plans, Arena *a);
/* The bytes of the descale area that the GEMMs of plans (cuda_plan_epilogues') read their
 * per-tensor dequantization scales from, where an earlier launch computes them (CkArgs'
 * inv_from, inv_to; spec_scales.c's fold_inverse_scales). */
int64_t cuda_plan_descale_bytes(const Graph *g, const CuNodePlan *plans);
/* The check the training loop runs on gradient accumulators: one launch that sets the int
 * at its scratch when n's tensor holds a NaN or an infinity. */
bool cuda_plan_finite(const Node *n, Arena *a, CuNodePlan *out);
/* The kernels of the FP8 gradient reduction (kernels/comm.cuh) for an ALL_REDUCE node n whose
 * wire is e5m2 or e4m3: five launches in the order a bucket runs them (COMM_AMAX ..
 * COMM_UNPACK), for the module's entry points and their names; exec_comm.c fills the
 * argument blocks per bucket. False for any other node. */
enum { COMM_AMAX, COMM_QUANTIZE, COMM_SUM, COMM_REQUANTIZE, COMM_UNPACK, COMM_KERNELS };
enum { COMM_THREADS = 256, COMM_MAX_BLOCKS = 1024 };   /* a block's threads; blocks a launch */
bool cuda_plan_comm(const Node *n, Arena *a, CuNodePlan *out);
/* The kernels of an e4m3 weight gather (--shard-states=3, kernels/reduce.cuh's ck_gather_amax
 * and ck_gather_scale) for QUANT_SCALE node n, per tensor, of a PARAM: the shard's amax, then
 * the scale from the ranks' maximum, for the module's entry points; exec_gather.c fills the
 * argument blocks. False for any other node. */
bool cuda_plan_gather(const Node *n, Arena *a, CuNodePlan *out);
/* The pass that leaves the block maxima of an amax=1 value (ops.def) where a GEMM's epilogue,
 * not the value's own kernel, writes it; false when n keeps none. */
bool cuda_plan_amax_pass(const Node *n, Arena *a, CuNodePlan *out);
uint64_t cuda_hash(uint64_t h, const void *data, size_t n);      /* FNV-1a, 64 bits; h 0: start */

/* ---------------------------------------------------------------- program.c (compiler only) */
/* The GPU kernel program of g as the training binary runs it (cuda_plan_graph, then
 * cuda_plan_epilogues; renumbers g): one line per launch, in launch order (an update run
 * that runs batched, cuda_batch_runs, one line a kernel), with the nodes it
 * computes, the bytes of the tensors it reads and writes, and the FLOPs of GEMMs and
 * attention; totals per phase. False with a reason in why when a node has no GPU kernel. */
bool cuda_print_program(Graph *g, Arena *a, FILE *out, char *why, size_t why_len);
/* Where node x's bytes are in the memory plan (a CuStorageAt for cuda_batch_runs): its arena's
 * offset, the step arena's placed after the persistent one's; none without storage. */
bool cuda_plan_storage_at(const Node *x, uintptr_t *lo);

/* ---------------------------------------------------------------- render.c */

/* The CUDA C module for the kernels plans use: the library text, then one extern "C"
 * function per distinct kernel. Returned in arena a; *n_kernels counts the functions. */
char *cuda_render_module(const Graph *g, const CuNodePlan *plans, Arena *a, int *n_kernels);
/* The same kernels in up to CUDA_MODULE_PARTS modules, each the library text and every
 * CUDA_MODULE_PARTS-th entry point in name order, for NVRTC to compile at the same time
 * (nvrtc.c); returns how many parts there are (fewer with fewer kernels, at least one). The
 * count is fixed, not the machine's cores, so that the texts (and the cache's keys) are the
 * same wherever fp8c runs. */
enum { CUDA_MODULE_PARTS = 4 };
int cuda_render_module_parts(const Graph *g, const CuNodePlan *plans, Arena *a, char *parts[CUDA_MODULE_PARTS],
                             int *n_kernels);
/* The library text alone (prelude, ops, attention) with the enums it needs. */
char *cuda_render_library(Arena *a);

/* ---------------------------------------------------------------- cg_render.c
 * The kernel IR (codegen.h) to CUDA C: one function fp8c_gN(CgCudaArgs) per unique loop
 * kernel body N of the program (GEMM and reference kernels have none). */
char *cuda_render_cg_program(const CgProgram *p, Arena *a);
/* Grid and block of a loop kernel (false for the other kinds). */
bool cuda_cg_launch_shape(const CgKernel *k, unsigned *grid, unsigned *block);

/* ---------------------------------------------------------------- nvrtc.c (compiler only) */

typedef struct {
    void *cubin;            /* malloc'ed */
    size_t cubin_size;
    char *ptx;              /* malloc'ed, NUL-terminated */
    bool cached;            /* came from the cache */
    double seconds;         /* compile time (0 when cached) */
    int n_kernels;          /* cuda_compile_graph: the kernels the module defines */
} CudaBinary;

/* Whether this fp8c can compile GPU kernels (built with NVRTC). */
bool cuda_compiler_available(void);
/* Compiles src for sm_90a with NVRTC (cubin and PTX), or takes both from the cache
 * ($FP8C_CACHE_DIR, else $XDG_CACHE_HOME/fp8c, else ~/.cache/fp8c; FP8C_NO_CACHE=1 skips
 * it). On a compile error prints the numbered source and NVRTC's log, returns false. */
bool cuda_compile_source(const char *src, const char *name, CudaBinary *out);
void cuda_binary_free(CudaBinary *b);
/* Plans and renders g and compiles the module. Returns false after a message on stderr when
 * NVRTC rejects it; *skipped (with a reason) when the graph has nodes the GPU cannot run. */
bool cuda_compile_graph(const Graph *g, CudaBinary *out, bool *skipped, char *why, size_t why_len);

/* ---------------------------------------------------------------- module_set.c
 * The GPU kernels a training binary carries: one cubin, or several (cuda_render_module_parts)
 * in one blob, "FP8CMODS", their count and sizes, then each cubin 16-byte aligned. */
enum { CUDA_MAX_MODULES = 8 };
/* The blob of n cubins, malloc'ed (*size its bytes); NULL when out of memory. */
void *cuda_module_set_pack(const void *const *cubins, const size_t *sizes, int n, size_t *size);
/* The cubins in blob (a set, or a single cubin: then itself): their count, at most max, and
 * where each starts and its size; -1 when blob is a set that is cut short or malformed. */
int cuda_module_set_split(const void *blob, size_t size, const void **cubins, size_t *sizes, int max);

/* ---------------------------------------------------------------- loader.c */

/* Opens libcuda.so.1 (and initializes the driver) and libcublasLt; false with a reason in
 * why when either is missing or no device answers. Safe to call more than once. */
bool cuda_load(char *why, size_t why_len);
int cuda_device_count(void);
/* GPU 0 as a tuning record names it: "NAME; N SMs; driver CUDA X.Y; cuBLASLt V" (exec.c).
 * False when there is no GPU to ask. */
bool cuda_device_description(char *out, size_t len);

/* ---------------------------------------------------------------- exec.c */

typedef struct CudaExec CudaExec;

/* Sets up g on GPU 0: plans every node, loads the module (cubin bytes), allocates the two
 * arenas (sizes of host's, the step arena with the backend's workspace at its end) after
 * checking the free memory, and prepares each phase's launch list. host is the bound host
 * mirror (rt_memory_bind). NULL after one rt_error line. */
CudaExec *cuda_exec_open(Graph *g, const RtMemory *host, const void *cubin, size_t cubin_size);
void cuda_exec_close(CudaExec *e);
/* Runs every node of a phase; the first run of a phase captures it in a CUDA graph, later
 * runs replay the graph (FP8C_CUDA_GRAPHS=0: plain launches every time). */
bool cuda_exec_run_phase(CudaExec *e, Phase p);       /* PHASE_FORWARD alone, or the update */
bool cuda_exec_run_micro_step(CudaExec *e);           /* forward and backward, one sweep */
/* The step's last micro-step: with several ranks and comm.overlap, the gradients' sums run in
 * buckets while its backward runs, and the update that follows runs none (exec_comm.c). */
bool cuda_exec_run_last_micro_step(CudaExec *e);
/* Copies between host mirror and device, tensor by tensor (same offsets). */
bool cuda_exec_push(CudaExec *e, Tensor *const *ts, int n);
bool cuda_exec_pull(CudaExec *e, Tensor *const *ts, int n);
bool cuda_exec_push_arenas(CudaExec *e);       /* both whole arenas, host -> device */
bool cuda_exec_all_finite(CudaExec *e, Tensor *const *ts, int n, bool *finite);
bool cuda_exec_zero(CudaExec *e, Tensor *const *ts, int n);
/* --shard-states on several ranks (exec_shard.c): whether this executor keeps only its
 * shards of the states and masters; and the gather before a checkpoint, which every rank
 * calls: rank 0's host mirror then holds every rank's shards (the whole tensors). ts and n
 * name what is about to be saved; every sharded tensor is gathered. */
bool cuda_exec_sharded(const CudaExec *e);
int64_t cuda_exec_persistent_bytes(const CudaExec *e);   /* the device's persistent arena */
bool cuda_exec_gather(CudaExec *e, Tensor *const *ts, int n);
bool cuda_exec_sync(CudaExec *e);
/* Runs only node n's launches (tests: one op against the reference). */
bool cuda_exec_run_node(CudaExec *e, const Node *n);
/* Kernel-IR programs (cuda/cg_render.c) on the executor's arenas: the module of the
 * program's rendered loop kernels, its scratch and constant tables on the device; a kernel
 * runs synchronously (tests compare each with the reference). */
typedef struct CudaCg CudaCg;
CudaCg *cuda_cg_open(CudaExec *e, const CgProgram *p, const void *cubin, size_t cubin_size);
bool cuda_cg_run_kernel(CudaCg *c, const CgKernel *k);   /* GEMM and reference kernels: nothing */
/* Copies n floats from the host into scratch array `scratch` of the program (a test that
 * computes a GEMM kernel's result on the host hands it to the epilogue that reads it). */
bool cuda_cg_write_scratch(CudaCg *c, int scratch, const float *data, int64_t n);
void cuda_cg_close(CudaCg *c);
/* How many GEMMs of the phases run with a fused epilogue (cuda_plan_epilogues; 0 with
 * FP8C_CUDA_EPILOGUES=0). */
int cuda_exec_epilogues(const CudaExec *e);
/* Of those: how many apply a GELU, how many of these write its FP8 copy, and how many apply
 * GELU's backward. */
void cuda_exec_gelu_epilogues(const CudaExec *e, int *gelu, int *dgelu, int *fp8_results);
/* How many launches of the phases run several nodes at once (exec.c's batched launches; 0
 * with FP8C_CUDA_BATCH=0). */
int cuda_exec_batched_launches(const CudaExec *e);
/* Gradients summed over the ranks each step (0 on one rank), and the buckets they go in while
 * the backward runs (0: at the start of the update, or one rank). */
int cuda_exec_reductions(const CudaExec *e);
int cuda_exec_buckets(const CudaExec *e);
/* Device memory the executor holds: arenas and workspace. */
int64_t cuda_exec_device_bytes(const CudaExec *e);
const char *cuda_exec_device_name(const CudaExec *e);
/* the seconds cuda_exec_open took: planning and allocation, loading the module and cuBLASLt,
 * the launch lists with the GEMMs' set-ups, the upload of the arenas */
void cuda_exec_setup_times(const CudaExec *e, double s[4]);

/* ---------------------------------------------------------------- exec_batch.c */

/* Where node x's storage starts, in an address space where two nodes' bytes meet only if they
 * share storage: false for one without storage. */
typedef bool (*CuStorageAt)(const Node *x, uintptr_t *lo);
/* The update's runs of nodes that run as one launch per kernel: consecutive update nodes of
 * one op whose plans launch the same batchable kernels (spec.c's `batch`), at least two, none
 * writing storage another one reads or writes. run[i] = the length of the run node i starts
 * (nodes without launches inside it included), 0 where none starts. The executor tells
 * storage apart by its arenas' addresses; `fp8c plan --kernels` by the memory plan's offsets
 * (cuda_plan_storage_at): the same arenas, so the same runs. */
void cuda_batch_runs(const Graph *g, const CuNodePlan *plans, CuStorageAt at, int *run);

/* ---------------------------------------------------------------- device.c */

/* The training program's "cuda" device over the cubin embedded in the binary (empty: the
 * binary was built without GPU kernels, and the device says so). */
const RtDevice *cuda_rt_device(const void *cubin, size_t cubin_size);

#endif
