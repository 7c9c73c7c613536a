/* spec_internal.h — what the files that plan the GPU's launches share (cuda/spec*.c).
 *
 * spec.c plans each node (cuda_plan_node: the argument block, the launches and their library
 * templates) and holds the helpers every plan uses; spec_ops.c the plans of the op families
 * that run library kernels (elementwise, reductions, rows, the optimizer); spec_attn.c
 * attention's;
 * spec_gemm.c the cuBLASLt GEMM; spec_fuse.c what the backend fuses across nodes on top of
 * the kernel program's groups (producers writing their FP8 copies, bias gradients in the
 * quantize of dy, per-group scales in their quantize, the loss's forward and backward in one
 * pass or its logsumexp, GEMM epilogues)
 * and cuda_plan_graph / cuda_plan_epilogues, which run them; spec_scales.c the scales that
 * launches around them make (spec_fold_scales). Spec is the state of one node's
 * plan while it is built. Internal to cuda/: nothing outside includes it. */
#ifndef FP8C_SPEC_INTERNAL_H
#define FP8C_SPEC_INTERNAL_H

#include "gpu.h"

enum { ELEM_THREADS = 256, ELEM_MAX_BLOCKS = 4096, ROW_THREADS = 256, PARTIAL_BLOCKS = 1024 };

/* How a cross entropy's row blocks run, forward and backward alike (the backward recomputes the
 * forward's logsumexp where it does not read it, and must get the same bits): the choices
 * ce.threads, ce.exp2, ce.shared and ce.ring (ce_rows_chosen, spec_ops.c; docs/tuning.md). */
typedef struct {
    unsigned threads;   /* a block's, for rows of 16384 logits or more (shorter ones: ROW_THREADS) */
    bool exp2;          /* exponentials as ex2.approx (loss.cuh, CkExpFrom<1>), else expf */
    bool shared;        /* the one pass may hold a row in shared memory (ck_ce_fused) */
    bool ring;          /* ... and a block two rows, one in flight (ck_ce_ring) */
} CeRows;
/* On an H200 (GPT-2 d12 at batch 32, 25 chunks of the loss, the one pass): 4.00 ms a step at
 * 1024 threads with expf, 3.38 with ex2, 3.10 at 512 with expf, 2.47 at 512 with ex2 (the row
 * in shared memory), 3.15 with the row read twice, 3.46 at 256 with ex2 (docs/results.md). */
#define CE_ROWS_DEFAULT ((CeRows){.threads = 512, .exp2 = true, .shared = true, .ring = true})

/* Threads of a cross entropy's row blocks. A chunk of the loss is some 500 to 1300 rows of the
 * vocabulary's 50304 logits: at 256 threads a row (rows read twice, from L2 the second time),
 * its blocks filled half to one and a quarter waves of an H200 (0.48 waves measured, 42% of
 * the warps busy, 35% of the memory bandwidth for the forward). 1024 threads take a vocabulary
 * row in six or seven wide loads a thread (Llama's 32000 in four), held in registers, one row
 * an SM at a time; 512 or 256 with the row in shared memory, two rows an SM (ce_row_held). */
static inline unsigned ce_row_threads(CeRows ce, int64_t V) { return V >= 8 * 2048 ? ce.threads : ROW_THREADS; }

/* the bytes of a logit the one pass may hold (plain bf16 or f32), else 0 */
static inline int ce_row_bytes(const Format *f) {
    return f->scaling != SCALE_NONE || f->codec != CODEC_PLAIN ? 0 : f->elem == FMT_BF16 ? 2 : f->elem == FMT_F32 ? 4 : 0;
}

/* Vectors of 8 logits a thread of `threads` holds when the cross entropy's one pass keeps
 * its row in registers (ck_ce_fused, CkHeld), or 0 where it does not: logits other than plain
 * bf16 or f32, rows not in whole vectors, or rows whose vectors would take more than 32
 * registers a thread (a block of 1024 threads has 64: GPT-2's 50304 bf16 logits take 28 and
 * leave the kernel at 64 without spills; f32 rows up to 32768). */
static inline int ce_row_vectors(const Format *f, int64_t V, unsigned threads) {
    int64_t per = 8 * (int64_t)threads, nv = (V + per - 1) / per;
    int bytes = ce_row_bytes(f);
    if (!bytes || V % 8) return 0;
    return nv * 8 * bytes <= 128 ? (int)nv : 0;
}

/* Where the one pass keeps a row between its logsumexp and its gradient (ck_ce_fused's NV):
 * in registers where ce_row_vectors allows; else, with ce.shared, in shared memory where the
 * row takes at most CE_SHARED_ROW_MAX bytes (228 KiB a Hopper SM, less 1 KiB a block that the
 * hardware keeps and the half KiB of the block's reductions: GPT-2's bf16 rows of 98 KiB,
 * Llama 2's of 62 KiB): with ce.ring two rows a block, a block an SM that walks its rows
 * (CE_ROW_RING), else a row a block and two blocks an SM (CE_ROW_SHARED); else 0, read twice. */
enum { CE_ROW_SHARED = -1, CE_ROW_RING = -2, CE_SHARED_ROW_MAX = 110 * 1024 };
static inline int ce_row_held(const Format *f, int64_t V, CeRows ce) {
    int nv = ce_row_vectors(f, V, ce_row_threads(ce, V)), bytes = ce_row_bytes(f);
    if (nv > 0 || !ce.shared || !bytes || V % 8) return nv;
    return V * bytes > CE_SHARED_ROW_MAX ? 0 : ce.ring ? CE_ROW_RING : CE_ROW_SHARED;
}

typedef struct {
    const Graph *g;   /* the node's graph, whose choices the plan reads; NULL: the defaults */
    Arena *arena;
    const Node *n;
    CuNodePlan *plan;
    int cap;
    char *why;
    size_t why_len;
    bool failed;
    bool amax_written;   /* a launch of the node's own writes its block maxima (amax=1) */
    /* how a producer that may be fused with the quantize of its value stores its result
     * (fuse_producer_quantizes): as itself, only its block maxima, or quantized into `through` */
    enum { RESULT_STORED, RESULT_AMAX_ONLY, RESULT_THROUGH } result;
    const Node *through;
    /* a QUANTIZE with transposed=1 that also sums its input's rows for this SUM_ROWS, and
     * adds the sum into the accumulator of bias_acc (an ACCUMULATE) where that is set
     * (fuse_bias_grads) */
    const Node *bias_grad, *bias_acc;
    /* a per-tensor FP8 QUANTIZE (or a producer writing its FP8 copy through one) that also
     * writes the result of this TRANSPOSE of the copy, from the same tiles
     * (fuse_cast_transposes) */
    const Node *transpose_to;
    /* a norm's rows' statistics (fuse_cast_transposes, fuse.norm_stats): row_stats, its
     * RESULT_AMAX_ONLY pass keeps them in its result's storage (norm.cuh, CkRowStats);
     * stats_of, the norm whose kept statistics its RESULT_THROUGH pass with transpose_to reads
     * (64 x 64 tiles, gemm_io.cuh's CkLdNorm) */
    bool row_stats;
    const Node *stats_of;
    /* a QUANTIZE into per-group scales that also makes them: the QUANT_SCALE (of the same x)
     * whose launch moves here (fuse_group_quantizes) */
    const Node *group_scale;
    /* a GELU or SILU that also writes this QUANTIZE of its input into per-group scales, whose
     * fused launch (group_scale above) moves into the activation's (fuse_input_group_copies) */
    const Node *input_copy;
    /* an ADD, SUB or MUL that also writes these QUANTIZEs into per-group scales of its two
     * inputs as stored (for an input computed inside it, inline_of below: the activation's
     * input), NULL where an input has none (fuse_product_group_copies) */
    const Node *product_copies[2];
    /* an elementwise producer computed inside this node's kernel instead of read
     * (fuse_inline_elementwise): for ADD, SUB, MUL the activation (GELU, SILU) that input
     * inline_slot is, read from its own input; for GELU_BWD, SILU_BWD the product (ADD, SUB,
     * MUL) that input 0 is, computed from its two inputs */
    const Node *inline_of;
    int inline_slot;
    /* a CROSS_ENTROPY and the CROSS_ENTROPY_BWD right after it, of the same logits
     * (fuse_ce_lse): the forward leaves each row's logsumexp in the scratch at this byte
     * offset, and the backward reads it there instead of reading its row once more; 0: none */
    int64_t ce_lse_at;
    /* a CROSS_ENTROPY_BWD that also computes this CROSS_ENTROPY of the same logits and targets
     * (fuse_ce_one_pass): one launch reads each row once for the loss and the gradient */
    const Node *ce_forward;
    /* how the cross entropy's row blocks run (plan_ce_choices; CE_ROWS_DEFAULT where unchosen) */
    CeRows ce;
    /* an attention whose forward (or the backward's rerun of it) runs on warpgroup MMA
     * (plan_attention_choices: the choice attn.wgmma) */
    bool attn_wgmma;
    /* at head dim 64, with its softmax overlapped with its P V product (the choice
     * attn.fwd_pipeline=1, off by default: ck_attn_wg_fwd_pipe) */
    bool attn_fwd_pipe;
    /* loaded by a producer warpgroup into a ring of tiles for this many consumer warpgroups, 0
     * for none, -1 where the choice attn.fwd_ws is not set (ck_attn_ws_fwd; plan_attention
     * decides with the key tiles) */
    int attn_fwd_ws;
    /* with a producer, its loads by TMA (the choice attn.fwd_tma; -1: not set) and the keys of
     * a tile, 64 or 128 (the choice attn.fwd_keys; -1: not set, plan_attention's rule) */
    int attn_fwd_tma, attn_fwd_keys;
    /* and whose backward's dq and dk/dv passes do too (the choice attn.wgmma_bwd, on unless 0) */
    bool attn_wgmma_bwd;
    /* warpgroups of 64 rows a block of those passes (the choices attn.dq_rows, attn.dkv_rows) */
    int attn_dq_wgs, attn_dkv_wgs;
    /* heads whose wgmma blocks run together, 0 for the heaviest tiles of all heads first
     * (the choice attn.head_group; ck_attn_order) */
    int attn_head_group;
    /* parts of a dk/dv step's 64 queries (the choice attn.dkv_split: 1 or 2) */
    int attn_dkv_split;
    /* dq computed by the dk/dv pass, no dq pass (the choice attn.dq_in_dkv; attn_wgmma.cuh, ONE) */
    bool attn_dq_in_dkv;
    /* blocks a key tile's dk/dv steps are cut into, 0 for the balance rule (the choice
     * attn.dkv_parts; attn_wgmma.cuh, PARTS) */
    int attn_dkv_parts;
} Spec;

static inline int64_t rows_of(const Tensor *t) {
    int64_t r = 1;
    for (int i = 0; i + 1 < t->rank; i++) r *= t->dims[i];
    return r;
}
static inline int64_t cols_of(const Tensor *t) { return t->rank ? t->dims[t->rank - 1] : 1; }

static inline unsigned grid_elem(int64_t n) {
    int64_t b = (n + ELEM_THREADS - 1) / ELEM_THREADS;
    return (unsigned)(b < 1 ? 1 : b > ELEM_MAX_BLOCKS ? ELEM_MAX_BLOCKS : b);
}

/* a warp per row, ROW_THREADS / 32 rows a block (the norms) */
static inline unsigned grid_warp_rows(int64_t rows) {
    int64_t per = ROW_THREADS / 32, b = (rows + per - 1) / per;
    return (unsigned)(b < 1 ? 1 : b);
}

static const char *const F32_ARG = "F<FMT_F32, SCALE_NONE>";

/* ---------------------------------------------------------------- spec.c */

bool spec_fail(Spec *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *fmt_arg(Spec *s, const Tensor *t);
bool spec_check_tensor(Spec *s, const Tensor *t, const char *what);
CuLaunch *spec_launch(Spec *s, const char *tag, unsigned grid, unsigned block,
                             const char *fmt, ...) __attribute__((format(printf, 5, 6)));
void arg_node(CuLaunch *l, int k, const Node *m);
void arg_scratch(CuLaunch *l, int k, int64_t off, int64_t rows, int64_t cols);
void need_scratch(Spec *s, int64_t bytes);
void args_result_inputs(CuLaunch *l, const Node *n);
void args_inputs(CuLaunch *l, const Node *n);
bool check_io(Spec *s, const Node *n, bool result);
void arg_amax_parts(Spec *s, CuLaunch *l, const Node *n);
void plan_amax_pass(Spec *s, const Node *d);
const char *producer_fmt(Spec *s);
void producer_result(Spec *s, CuLaunch *l);
bool plan_node(Spec *s);
Spec spec_for(const Graph *g, const Node *n, Arena *a, CuNodePlan *out, char *why, size_t why_len);

/* ---------------------------------------------------------------- spec_ops.c */

bool plan_elementwise(Spec *s);
bool plan_reductions(Spec *s);
bool plan_rows(Spec *s);

/* The loss's choices for cross entropy n (ce.threads, ce.exp2, ce.shared), and the cross
 * entropies of g planned again where they differ from CE_ROWS_DEFAULT. */
CeRows ce_rows_chosen(const Graph *g, const Node *n);
void plan_ce_choices(const Graph *g, CuNodePlan *plans, Arena *a);
bool plan_optimizer(Spec *s);

/* A norm's backward as one pass over its rows and one over the columns' partials
 * (spec_fuse.c, fuse_norm_grads): the input gradient bx (LAYERNORM_BWD_X, RMSNORM_BWD_X), the
 * weight's gradient bw of the same dy and x, the bias's (sum: a SUM_ROWS of dy, or NULL), the
 * ADD_N that adds dx to one other gradient (add, or NULL: dx is stored), and the ACCUMULATEs
 * of the two gradients (acc_w, acc_b, or NULL: the gradient is stored). */
typedef struct {
    const Node *bx, *bw, *sum, *add, *acc_w, *acc_b;
} NormGrads;
/* the first launch: four warps a block (each warp's column sums take NV x 1 KiB, twice with a
 * bias, of shared memory: small blocks keep several on an SM at GPT-2 d48's 1600), at most
 * CK_AMAX_PARTS blocks (the rows of partials; the slots of the result's block maxima) */
enum { NORM_GRAD_THREADS = 128, NORM_GRAD_BLOCKS = 1024 };
bool plan_norm_grads(Spec *s, const NormGrads *ng);

/* ---------------------------------------------------------------- spec_attn.c */

bool plan_attention(Spec *s);
/* Plans again, on warpgroup MMA, the attentions of g where the choice attn.wgmma is on. */
void plan_attention_choices(const Graph *g, CuNodePlan *plans, Arena *a);

/* ---------------------------------------------------------------- spec_scales.c */

/* The per-tensor scales (and GEMMs' reciprocal scales) that the phases' plans can have
 * launches around them make, each scale's own launch then gone; after the GEMM epilogues. */
void spec_fold_scales(const Graph *g, CuNodePlan *plans, Arena *a);

/* ---------------------------------------------------------------- spec_gemm.c */

typedef enum { OPD_BF16, OPD_F32, OPD_FP8, OPD_OTHER } OperandKind;
OperandKind operand_kind(const Tensor *t);

/* What cuBLASLt adds to a GEMM's product before its one rounding: a bias broadcast over the
 * rows, a same-shaped C (beta = 1), or both, then an activation (CuActivation: GELU, whose
 * pre-activation it also writes to aux, or GELU's backward, which reads GELU's input from
 * aux); the result goes to d's tensor. d is a plain bf16 or f32 value, or the delayed
 * per-tensor FP8 copy of the value (a QUANTIZE), whose amax the GEMM hands to `record` (the
 * value's AMAX_RECORD). For a plain matmul: nothing, and d is the matmul itself. */
typedef struct {
    const Node *d, *bias, *c;
    CuActivation act;
    const Node *aux;
    const Node *record;
} GemmEpilogue;

bool plan_matmul(Spec *s, const GemmEpilogue *ep);
void plan_transpose(Spec *s, const Node *x, const Node *to, int64_t off);
bool transpose_keeps_values(const Node *n);

#endif
