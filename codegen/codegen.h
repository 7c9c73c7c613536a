/* codegen.h — kernels: the one description of the step's work that both backends render.
 *
 * After the passes, the graph says *what* the step computes, node by node. The kernel IR says
 * *how it runs*: a list of kernels in launch order, each a small loop nest over buffers. The
 * fusion decision (fuse.c) says which nodes share a kernel; lower_kernels.c turns every
 * group into kernels; llvm.c renders them to native code for the CPU (codegen/cuda*.c renders
 * the same kernels to CUDA C). Executors (runtime/cpu_exec.c) bind buffers to tensors and
 * run the kernels; the reference executor (runtime/ref_*.c) stays the ground truth they are
 * tested against.
 *
 * ---------------------------------------------------------------- a kernel in one picture
 *
 *   kernel k7 "h.0.ln_1" rows items=512 cost=384
 *     buf 0 x   bf16[512,128]  read              (a tensor of the graph)
 *     buf 1 w   f32[128]       read
 *     buf 2 b   f32[128]       read
 *     buf 3 y   e4m3[512,128]  write  scale=buf 4 (per tensor)
 *     buf 4 s   f32[]          read
 *     %0 = fconst 0.0078125           <- prologue: runs once per thread, before any item
 *     %1 = body                       <- the per-item body starts here
 *     %2 = item                       (i64: the row this body computes)
 *     %3 = imul %2, 128
 *     %4 = loop.row 0, 128            (i64: the column)
 *     %5 = iadd %3, %4
 *     %6 = load buf0[%5] row=%2 col=%4
 *     %7 = reduce.sum %6              (value after the loop: sum over the row)
 *     %8 = end
 *     ...
 *     %20 = store buf3[%5], %19 row=%2 col=%4
 *
 * Semantics (every renderer must give the same results, up to the stated math tolerances):
 *
 * - A kernel runs its body once for every item in [0, items). Items are independent: no item
 *   reads what another item writes, so items may run in any order and on any thread, and the
 *   result never depends on the partition. `par` says how big an item is, for the GPU mapping:
 *     CG_PAR_THREAD  an item is a few scalar operations (one element, one column): a thread;
 *     CG_PAR_BLOCK   an item is a row: its CG_LOOP_ROW loops run over the row's columns and
 *                    may be spread over a thread block, their CG_REDUCE becoming block
 *                    reductions (warp shuffles).
 * - Instructions are in one flat array; the value of instruction i is %i (SSA: defined once,
 *   used after). The instructions before CG_BODY are the prologue: they do not depend on the
 *   item (constants, scalar loads of buffers the kernel does not write, math on those) and
 *   run once per thread; it holds no loops, locals or stores. The rest is the body.
 * - Loops are structured: CG_LOOP opens one (its value is the i64 induction variable, args lo
 *   and hi, step 1), CG_END closes the innermost open one. A value defined inside a loop is
 *   used only inside it, except a CG_REDUCE, whose value is the reduction and is used only
 *   after its loop's CG_END.
 *     CG_LOOP_ROW  iterations are independent (they may run in parallel and in any order);
 *                  values carried across iterations go through CG_REDUCE only (sum: init 0;
 *                  max: init -inf, NaN ignored as by fmaxf). Stores in different iterations
 *                  go to different elements. The summation order is the renderer's choice.
 *     CG_LOOP_SEQ  iterations run in order (a counting sort, the rows of a column sum);
 *                  values are carried in locals (CG_LOCAL). A CG_REDUCE directly in a SEQ loop
 *                  accumulates in iteration order.
 * - Locals: CG_LOCAL declares a per-item array of `i` f32 elements (i <= CG_MAX_LOCAL),
 *   every element set to `f` at that point; CG_LGET / CG_LSET read and write element a[1]
 *   (an i64 value) of local a[0]. Inside a CG_LOOP_ROW, a local may be written only at the
 *   loop's induction variable, or at it plus a value defined before the loop (so a block can
 *   keep each thread's elements to itself).
 * - Buffers are the kernel's parameters (CgBuf): a graph tensor, seen through its Format, or
 *   a scratch array of f32 owned by the program. CG_LOAD reads element a[0] (flat index, i64)
 *   and returns f32: decoded from the element type (exactly: every code is an f32) and then
 *   divided by its scale (IEEE division, not multiplication by a reciprocal), exactly as
 *   ref_load does. CG_STORE writes element a[0] with value a[1]: the value is multiplied by
 *   its scale, then encoded as num_encode does (round to nearest even, FP8 saturating to the
 *   largest finite value, NaN to the canonical NaN; integers rounded, clamped, NaN -> 0):
 *   stores are bit-identical to the reference executor's for the same f32 value. The scale
 *   of element (r, c) of the 2-D view (rows = all leading dims) is looked up as ref_scale_map
 *   says; LOAD and STORE may pass r and c as a[1], a[2] (LOAD) or a[2], a[3] (STORE) when the
 *   lowering knows them (-1 otherwise: the renderer divides the index by cols). CG_ROUND
 *   returns what a LOAD would read after a STORE of a[1] at a[0] (the buffer's data is not
 *   touched): fused intermediates go through it so that fusion never changes a value the
 *   plan rounds.
 *   Integer tensors (token ids, targets) load as f32 (exact below 2^24), like the reference.
 *   A tensor stored through an optimizer-state codec (range expansion, companding, split
 *   master: ir/codecs.c) has no element-wise meaning, since its groups share side values that
 *   depend on every element. Kernels see it as codes (CgBuf.codes, cg_buf_codes): LOAD and
 *   STORE convert between f32 and the code's element type like any unscaled buffer (e4m3
 *   values; i8/u8 integers, rounded and clamped), and the lowering writes the codec's
 *   decode, group statistics and encode in the instructions below, with the side values in
 *   an f32 buffer of their own (Format.scale's tensor).
 * - Math is f32 (IEEE, round to nearest), i64 for indices, bool for conditions. Renderers may
 *   contract a*b+c into an FMA only where CG_FMA says so. CG_EXP, CG_LOG, CG_TANH may be off by
 *   a few ulps (CUDA's expf/logf/tanhf are within 2); everything else is correctly rounded.
 *   CG_FMAX / CG_FMIN are fmaxf / fminf (a NaN operand is ignored). CG_IDIV / CG_IMOD take
 *   non-negative operands. CG_FTOI truncates toward zero. CG_LOG(0) is -inf, of a negative
 *   number NaN; CG_EXP(-inf) is 0. CG_FBITS and CG_BITSF reinterpret an f32's IEEE bits as
 *   an integer and back (exponent fields, exact powers of two: a split master's bf16 ulp);
 *   subnormals are kept, never flushed to zero, by every operation.
 *
 * Kernels that are not loop nests:
 *   CG_KERNEL_GEMM  C = op(A) @ op(B) (CgGemm), a library call on both targets (cuBLASLt on
 *                   the GPU; rt_cpu_gemm_mixed on the CPU). With CgLowerOptions.gemm_f32 the
 *                   lowering keeps A and B as they are when the CPU GEMM reads them (f32,
 *                   bf16, f16, e4m3, e5m2; unscaled or one scale per tensor), converts other
 *                   operands into f32 scratch first, and has C written as f32 (to its tensor,
 *                   an f32 accumulator, or scratch that an epilogue kernel stores).
 *   CG_KERNEL_REF   the nodes are run by the reference executor (ops or formats that have no
 *                   kernel); an executor that has no reference reports them. The models of
 *                   models/ lower to none at any level.
 *
 * Names: generated functions are "fp8c_k<N>" where N indexes the program's unique kernel
 * bodies (CgProgram.funcs), so layers with the same shapes share one function. The CPU calling
 * convention is
 *     void fp8c_kN(void *const *bufs, int64_t lo, int64_t hi)     items lo..hi-1
 * with bufs[i] the data pointer of buffer i (tensor data, or scratch). */
#ifndef FP8C_CODEGEN_H
#define FP8C_CODEGEN_H

#include "ir.h"

/* ---------------------------------------------------------------- kernel.c: the kernel IR */

typedef enum { CG_VOID, CG_F32, CG_I64, CG_BOOL } CgType;

/* X(name, "text", args, result type). args: how many of a[] are value operands (-1: see the
 * comment). The imm fields each op uses are in the comment. */
#define CG_OPS(X)                                                                          \
    X(BODY,   "body",    0, CG_VOID) /* the end of the prologue, the start of the body */    \
    X(FCONST, "fconst",  0, CG_F32)  /* f */                                                 \
    X(ICONST, "iconst",  0, CG_I64)  /* i */                                                 \
    X(ITEM,   "item",    0, CG_I64)  /* the item this body runs for */                       \
    X(IADD,   "iadd",    2, CG_I64)                                                          \
    X(ISUB,   "isub",    2, CG_I64)                                                          \
    X(IMUL,   "imul",    2, CG_I64)                                                          \
    X(IDIV,   "idiv",    2, CG_I64)  /* non-negative operands */                             \
    X(IMOD,   "imod",    2, CG_I64)  /* non-negative operands */                             \
    X(IMIN,   "imin",    2, CG_I64)                                                          \
    X(IMAX,   "imax",    2, CG_I64)                                                          \
    X(ITOF,   "itof",    1, CG_F32)                                                          \
    X(FTOI,   "ftoi",    1, CG_I64)  /* truncation toward zero */                            \
    X(FADD,   "fadd",    2, CG_F32)                                                          \
    X(FSUB,   "fsub",    2, CG_F32)                                                          \
    X(FMUL,   "fmul",    2, CG_F32)                                                          \
    X(FDIV,   "fdiv",    2, CG_F32)                                                          \
    X(FMA,    "fma",     3, CG_F32)  /* a0 * a1 + a2, one rounding */                        \
    X(FMAX,   "fmax",    2, CG_F32)  /* fmaxf */                                             \
    X(FMIN,   "fmin",    2, CG_F32)  /* fminf */                                             \
    X(FNEG,   "fneg",    1, CG_F32)                                                          \
    X(FABS,   "fabs",    1, CG_F32)                                                          \
    X(EXP,    "exp",     1, CG_F32)                                                          \
    X(LOG,    "log",     1, CG_F32)                                                          \
    X(TANH,   "tanh",    1, CG_F32)                                                          \
    X(SQRT,   "sqrt",    1, CG_F32)                                                          \
    X(FBITS,  "fbits",   1, CG_I64)  /* the 32 bits of f32 a0, as an i64 in [0, 2^32) */       \
    X(BITSF,  "bitsf",   1, CG_F32)  /* the f32 whose bits are a0 (in [0, 2^32)) */            \
    X(FLT,    "flt",     2, CG_BOOL) /* ordered comparisons: false when either is NaN */     \
    X(FLE,    "fle",     2, CG_BOOL)                                                         \
    X(FEQ,    "feq",     2, CG_BOOL)                                                         \
    X(ILT,    "ilt",     2, CG_BOOL)                                                         \
    X(IEQ,    "ieq",     2, CG_BOOL)                                                         \
    X(AND,    "and",     2, CG_BOOL)                                                         \
    X(NOT,    "not",     1, CG_BOOL)                                                         \
    X(SELECT, "select",  3, CG_VOID) /* a0 ? a1 : a2; the type of a1 (f32 or i64) */         \
    X(LOAD,   "load",    3, CG_F32)  /* buf[a0], a1 row, a2 col (-1: not given) */           \
    X(STORE,  "store",   4, CG_VOID) /* buf[a0] = a1, a2 row, a3 col (-1: not given) */      \
    X(ROUND,  "round",   4, CG_F32)  /* a1 rounded as buf[a0] would store it; a2, a3 r/c */  \
    X(LOOP,   "loop",    2, CG_I64)  /* [a0, a1), i = CgLoopKind; value: induction var */    \
    X(END,    "end",     0, CG_VOID) /* closes the innermost loop */                         \
    X(REDUCE, "reduce",  1, CG_F32)  /* i = CgReduce; a0 per iteration; value after END */   \
    X(LOCAL,  "local",   0, CG_VOID) /* i elements, each f */                                \
    X(LGET,   "lget",    2, CG_F32)  /* local a0, element a1 */                              \
    X(LSET,   "lset",    3, CG_VOID) /* local a0, element a1 = a2 */

typedef enum {
#define X(name, text, args, type) CG_##name,
    CG_OPS(X)
#undef X
    CG_OP_COUNT
} CgOp;

typedef enum { CG_LOOP_ROW, CG_LOOP_SEQ } CgLoopKind;
typedef enum { CG_RED_SUM, CG_RED_MAX } CgReduce;

enum { CG_MAX_LOCAL = 4096, CG_NONE = -1 };

typedef struct {
    CgOp op;
    CgType type;
    int a[4];           /* value operands (instruction indices), CG_NONE when absent */
    int buf;            /* LOAD, STORE, ROUND: the buffer */
    int64_t i;          /* ICONST value, LOOP kind, REDUCE kind, LOCAL length */
    double f;           /* FCONST value (an f32 value), LOCAL initial value */
} CgInst;

/* A kernel parameter: one graph tensor (node != NULL), one scratch array of the program (f32,
 * read and written by kernels: partial sums, GEMM operands widened to f32), or one constant
 * table of the program (f32, read-only, filled when the program is lowered: rope's cos/sin). */
typedef struct {
    const char *name;       /* for listings and generated comments */
    Node *node;             /* the tensor; NULL for scratch and constants */
    int scratch;            /* index into CgProgram.scratch, or CG_NONE */
    int constant;           /* index into CgProgram.consts, or CG_NONE */
    ElemType elem;          /* scratch: FMT_F32 */
    Scaling scaling;
    int group;              /* SCALE_PER_GROUP: elements per group (TILE_1x128: 128) */
    int scale_buf;          /* the buffer holding the scales (unscaled f32 or e8m0), CG_NONE: static */
    float static_scale;     /* RECIPE_STATIC without a scale tensor */
    int64_t numel, rows, cols;   /* the 2-D view the scales refer to */
    bool codes;             /* an optimizer-state codec's codes, seen as plain elements */
    bool read, written;
} CgBuf;

typedef enum { CG_PAR_THREAD, CG_PAR_BLOCK } CgParallel;
typedef enum { CG_KERNEL_LOOP, CG_KERNEL_GEMM, CG_KERNEL_REF } CgKernelKind;

/* CG_KERNEL_GEMM: C (M, N) = op(A) @ op(B), row-major; A is (M, K) or (K, M) when trans_a,
 * B is (K, N) or (N, K) when trans_b; with accumulate, C += instead of C =. `epilogue` is the
 * kernel that stores C (scratch) through the group's elementwise nodes, one item a row of C
 * (CG_NONE: none). It comes right after the GEMM, and an executor may run it on each block of
 * C's rows as soon as the GEMM has finished them, while those rows are still in cache,
 * provided nothing the epilogue writes is an operand the GEMM is still reading. */
typedef struct {
    int64_t M, N, K;
    bool trans_a, trans_b, accumulate;
    int a, b, c;            /* buffer indices */
    int epilogue;           /* kernel id, or CG_NONE */
} CgGemm;

typedef struct {
    int id;                 /* position in CgProgram.kernels */
    const char *name;       /* the main node's tensor name or op, for listings */
    CgKernelKind kind;
    CgParallel par;
    Phase phase;
    int64_t items;
    int64_t cost;           /* estimated scalar operations per item (for work partitioning) */
    CgBuf *bufs;
    int n_bufs;
    CgInst *insts;
    int n_insts, cap_insts;
    CgGemm gemm;
    Node **nodes;           /* the graph nodes this kernel (with its siblings) computes */
    int n_nodes;
    int func;               /* CG_KERNEL_LOOP: index into CgProgram.funcs */
    Arena *arena;           /* the program's: where the arrays above grow */
} CgKernel;

/* A constant table: executors pass `data` itself as the buffer (the runtime re-lowers the
 * program, so it has the same numbers the compiler had). */
typedef struct {
    int64_t n;
    float *data;
} CgConst;

/* A unique kernel body: kernels whose text (without names) is equal share one function. */
typedef struct {
    CgKernel *first;        /* the kernel whose instructions are rendered */
    uint64_t hash;
    int uses;
} CgFunc;

typedef struct {
    Arena *arena;
    const Graph *graph;
    CgKernel **kernels;     /* in launch order; each phase's kernels in schedule order */
    int n_kernels, cap_kernels;
    int64_t *scratch;       /* f32 elements of each scratch array */
    int n_scratch, cap_scratch;
    CgConst *consts;
    int n_consts, cap_consts;
    CgFunc *funcs;
    int n_funcs;
    uint64_t hash;          /* of every kernel's text and buffer binding: a build and the
                               runtime that re-lowers the same graph agree on it */
} CgProgram;

/* Building kernels (lower_kernels.c uses these; tests build kernels by hand too). Every
 * builder returns the new instruction's index. */
CgProgram *cg_program_new(Arena *a, const Graph *g);
CgKernel *cg_kernel_new(CgProgram *p, CgKernelKind kind, const char *name, Phase phase);
int cg_scratch_new(CgProgram *p, int64_t floats);
int cg_const_new(CgProgram *p, const float *data, int64_t n);     /* copies data */
/* A buffer for node n's tensor (its scale tensor is added as another buffer when scaled). */
int cg_buf_tensor(CgKernel *k, Node *n, bool read, bool written);
/* The codes of a tensor stored through an optimizer-state codec (Format.codec, ir/codecs.c)
 * as plain unscaled elements of its element type: the kernel does the codec's math itself and
 * reads and writes the side values through a buffer of Format.scale's tensor. */
int cg_buf_codes(CgKernel *k, Node *n, bool read, bool written);
int cg_buf_scratch(CgKernel *k, int scratch, int64_t floats, bool read, bool written);
int cg_buf_const(CgKernel *k, int constant, int64_t n);
int cg_emit(CgKernel *k, CgOp op, int a0, int a1, int a2, int a3);
int cg_fconst(CgKernel *k, double f);
int cg_iconst(CgKernel *k, int64_t i);
int cg_loop(CgKernel *k, CgLoopKind kind, int lo, int hi);
int cg_reduce(CgKernel *k, CgReduce kind, int v);
int cg_local(CgKernel *k, int64_t len, double init);
int cg_load(CgKernel *k, int buf, int idx, int row, int col);
int cg_store(CgKernel *k, int buf, int idx, int v, int row, int col);
int cg_round(CgKernel *k, int buf, int idx, int v, int row, int col);
const char *cg_op_name(CgOp op);
/* Checks structure: operands defined before use and of the right types, loops closed,
 * reductions used after their loop, the prologue item-free. Returns the number of problems
 * (each printed to stderr with the kernel's listing). */
int cg_kernel_verify(const CgKernel *k);
/* Canonical text of a kernel; with_names false leaves out names and node ids, so that equal
 * bodies print equal (what CgFunc dedups on and the object cache hashes). */
void cg_kernel_print(const CgKernel *k, bool with_names, FILE *out);
void cg_program_print(const CgProgram *p, FILE *out);
/* The program as a table: a line per kernel (phase, kind, nodes, bytes, FLOPs), phase totals. */
void cg_program_print_table(const CgProgram *p, FILE *out);
/* Fills funcs (dedup of equal kernel bodies), each kernel's func, and p->hash. */
void cg_program_finish(CgProgram *p);
uint64_t cg_hash_bytes(uint64_t h, const void *data, size_t n);   /* FNV-1a, 64 bits */

/* ---------------------------------------------------------------- fuse.c
 * Kernel groups: nodes that run as one kernel. group[node index] is the index of the group's
 * root (the node whose position in the schedule the kernel takes); -1 for nodes that run no
 * kernel (leaves, views). A node whose group is itself and that has members is a fused
 * kernel. The grouping is a pure function of the scheduled graph, so the compiler and the
 * runtime that re-lowers the artifact compute the same one. */
int *fuse_plan(const Graph *g, Arena *a);
/* Whether the results of a and b share bytes in the memory plan (false for unplaced ones). */
bool fuse_nodes_overlap(const Node *a, const Node *b);
/* Whether x holds its value from just after schedule position `from` through position `to`
 * (exclusive): no node in between writes over its bytes. */
bool fuse_value_survives(const Graph *g, const Node *x, int from, int to);
/* Whether some tensor's format names p as its scale or its amax (so p must be stored). */
bool fuse_referenced_by_format(const Graph *g, const Node *p);
/* The groups as comments ("# fuse: ...", "# group %N: ..."), for --print-ir-after=fuse. */
void fuse_print(const Graph *g, FILE *out);

/* What the lowering can fuse is an op's class, ops.def's CLASS column (ir_op_class):
 * ELEMWISE ops compute one output element from the same element of their inputs (broadcast
 * operands aside) and can be computed inline in a consumer's kernel; a HEAD's kernel produces
 * each output element exactly once, at a point where an elementwise epilogue can take it over
 * (GEMM, norms, softmax, ...). Whether a node runs a kernel at all depends on the node too. */

/* A RESHAPE that the memory plan placed on its input's storage: no kernel, nothing to copy. */
bool cg_node_is_view(const Node *n);
/* Whether n runs a kernel at all (not HELD, COLLECTIVE or a view). */
bool cg_node_runs_kernel(const Node *n);

/* ---------------------------------------------------------------- lower_kernels.c */

typedef struct {
    bool fuse;              /* use fuse_plan's groups (false: one kernel per node) */
    bool gemm_f32;          /* GEMM operands the CPU GEMM reads, result f32; false: any format */
} CgLowerOptions;

/* Graph (scheduled and memory-planned) -> kernels in launch order; NULL after a message on
 * stderr when a node cannot be lowered (never for ops with a reference fallback). */
CgProgram *cg_lower(const Graph *g, Arena *a, const CgLowerOptions *o);

/* ---------------------------------------------------------------- llvm.c (compiler only)
 * Renders a program's functions to one LLVM module, optimizes it (-O2 pipeline with loop and
 * SLP vectorization) and writes a relocatable object for the host CPU, or `cpu` ("x86-64-v3",
 * "skylake-avx512", ...). The object defines fp8c_k<N> and the table the runtime binds:
 *     uint64_t fp8c_cpu_kernel_hash;        CgProgram.hash
 *     int32_t  fp8c_cpu_kernel_count;       kernels
 *     void   (*fp8c_cpu_kernel_fns[])(void *const *, int64_t, int64_t);   per kernel (NULL
 *                                           for GEMM and reference kernels)
 * Objects are cached under $FP8C_CACHE_DIR, else $XDG_CACHE_HOME/fp8c, else ~/.cache/fp8c,
 * keyed by a hash of the kernel text, the CPU and the LLVM version. Returns false after one
 * line on stderr. */
typedef struct {
    const char *cpu;        /* NULL or "native": the host; else an LLVM CPU name */
    int opt_level;          /* LLVM optimization level, 0..3 (default 2 when 0 is not meant) */
    bool no_cache;
    bool dump_ir;           /* print the optimized module to stderr */
    bool *cached;           /* if not NULL: set when the object came from the cache */
} CgLlvmOptions;
bool cg_llvm_compile(const CgProgram *p, const CgLlvmOptions *o, const char *obj_path);
/* Compiles an empty function for cpu (NULL or "native": nothing to check), so that a CPU LLVM
 * cannot make code for ends the process with fp8c's error line and status 1 before a build
 * has made anything; returns when it can. */
void cg_llvm_check_cpu(const char *cpu);
/* What a native compilation targets: "LLVM version|triple|host CPU|its features" (malloc'ed),
 * for caches of products that depend on the machine they were compiled on. */
char *cg_llvm_host(void);
/* The rendered, unoptimized module as text (tests and --print-kernels). */
char *cg_llvm_module_text(const CgProgram *p);

#endif
