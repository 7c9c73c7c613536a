/* ref_internal.h — what the reference executor's files share; not part of rt.h's interface.
 *
 * The executor is split by concern and imports one way: ref_exec.c (dispatch) calls the
 * kernels, and they and the dispatcher read and write tensors through ref_tensor.c (loads
 * and stores through formats, scale layout, node errors). The kernels: ref_gemm.c (matmul),
 * ref_attn.c (attention, rope), ref_ops.c (elementwise, shape, row and gather ops),
 * ref_optim.c (accumulation, norms, AdamW), ref_quant.c (scales and amax histories); below
 * them all, ref_pool.c (threads) and ref_math.c (exp).
 *
 * Kernels see decoded f32 arrays: `x[i]` is input i (numel(in[i]) floats, ids too: token ids
 * and targets are exact in f32 below 2^24) and `y` receives numel(n->t) floats that the
 * dispatcher then stores through the result's format. */
#ifndef FP8C_REF_INTERNAL_H
#define FP8C_REF_INTERNAL_H

#include "rt.h"

/* ---------------------------------------------------------------- ref_pool.c
 * Runs fn(ctx, i) for every i in [0, n_tasks) on the pool's threads (the caller works too).
 * Tasks are taken in any order by any thread, so a task must compute its outputs alone and in
 * a fixed order: that is what makes results independent of the thread count. Calls from inside
 * a task run serially. */
typedef void (*RefTaskFn)(void *ctx, int64_t task);
void ref_parallel_for(int64_t n_tasks, RefTaskFn fn, void *ctx);
/* The same over elements: fn(ctx, lo, hi) for the ranges [0, chunk), [chunk, 2 chunk), .. of
 * [0, n), the last one shorter. The ranges are fixed by chunk alone, never by the threads. */
typedef void (*RefRangeFn)(void *ctx, int64_t lo, int64_t hi);
void ref_parallel_ranges(int64_t n, int64_t chunk, RefRangeFn fn, void *ctx);

/* ---------------------------------------------------------------- ref_tensor.c
 * (ref_load and ref_store are in rt.h) */
_Noreturn void ref_die_node(const Node *n, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
int64_t ref_rows(const Tensor *t);          /* product of all dims but the last (1 for rank 0) */
int64_t ref_cols(const Tensor *t);          /* the last dim (1 for rank 0) */
int64_t ref_id(const Node *n, float v, int64_t limit, const char *what);   /* checked index */
/* bf16 conversions, bit-identical to num_f32_to_bf16 / num_bf16_to_f32, in vectorizable loops */
void ref_bf16_encode(const float *src, uint16_t *dst, int64_t n);
void ref_bf16_decode(const uint16_t *src, float *dst, int64_t n);
/* Scales of a scaled (rows, cols) view: how many, and which one element (r, c) uses. Scale
 * tensors hold one scale per block of block_rows x group (ir/scaling.def: the granularity's
 * block, clipped to the view), row-major over the grid of blocks, rounding up: (1), (rows),
 * (rows, cols/G), (rows/128, cols/128). */
typedef struct {
    Scaling kind;
    int64_t rows, cols;
    int64_t block_rows, group;      /* the block that shares a scale */
    int64_t n_col_groups, count;    /* blocks along a row of blocks; all of them */
} RefScaleMap;
RefScaleMap ref_scale_map(Scaling kind, int group, int64_t rows, int64_t cols);
int64_t ref_scale_index(const RefScaleMap *m, int64_t r, int64_t c);
/* A read-only f32 view of t: its own storage when that is plain f32 (no copy), else a decoded
 * copy returned through *owned for the caller to free. */
const float *ref_load_view(const Tensor *t, float **owned);
/* codec_split_encode and codec_split_decode (a bf16 weight hi and its i8 correction lo), on
 * the threads */
void ref_split_encode(const float *w, uint16_t *hi, int8_t *lo, int64_t n);
void ref_split_decode(const uint16_t *hi, const int8_t *lo, float *w, int64_t n);

/* ---------------------------------------------------------------- ref_gemm.c */
/* C (M, N) = op(A) @ op(B) with f64 accumulation; A is (M, K) or, when ta, (K, M), row-major
 * with row stride lda; likewise B (K, N) or, when tb, (N, K). */
void ref_gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, bool ta,
              const float *B, int64_t ldb, bool tb, float *C);
/* The same product computed serially into f64 (C has row stride ldc), overwriting C or adding
 * to it; for callers inside a parallel task (attention's blocks). */
void ref_gemm_f64(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, bool ta,
                  const float *B, int64_t ldb, bool tb, double *C, int64_t ldc, bool accumulate);
void ref_matmul(const Node *n, const float *const *x, float *y);
/* Tests: 6 forces the 6 x 8 register tile where the 12 x 8 one would run; 0 restores it. */
void ref_gemm_set_tile_rows(int rows);

/* ---------------------------------------------------------------- cpu_gemm.c
 * A thread's grow-only buffers of f32 (64-byte aligned), kept between calls and freed when the
 * thread ends: the GEMM's packed panels and bookkeeping, a task's rows of C, the tile
 * attention's scratch. */
typedef enum {
    CPU_BUF_B_PANELS, CPU_BUF_A_PANELS, CPU_BUF_PANEL_STATES, CPU_BUF_ROW_COUNTERS, CPU_BUF_ROWS,
    CPU_BUF_ATTENTION, CPU_BUF_COUNT
} CpuThreadBuffer;
float *cpu_thread_floats(CpuThreadBuffer which, int64_t n);

/* ---------------------------------------------------------------- cpu_gemm_tile.c
 * The CPU GEMM's bf16 tile path for operands stored as bf16, e4m3 or e5m2: 32 x 32 blocks of C
 * on Intel AMX's tiles or on AVX512-BF16 dot products, over the same panels, 32 lines by a K
 * block, in steps of 32 k of TILE_STEP_WORDS pairs of bf16 (the layouts are in the file's
 * essay). */
enum { TILE_LINES = 32, TILE_STEP_WORDS = 32 * 16 };
typedef enum { CPU_TILES_OFF, CPU_TILES_BF16DOT, CPU_TILES_AMX } CpuTiles;
/* The implementation in use: the fastest the CPU has, or FP8C_CPU_TILES=amx|bf16dot|off
 * (FP8C_CPU_AMX=0: off); CPU_TILES_OFF leaves every GEMM and attention to the f32 path. */
CpuTiles cpu_tiles(void);
bool cpu_tile_usable(void);         /* cpu_tiles() != CPU_TILES_OFF */
/* Tests and benchmarks: use t where the CPU has it, else the f32 path; returns whether t is
 * now in use. */
bool cpu_tiles_select(CpuTiles t);
const char *cpu_tiles_name(CpuTiles t);     /* "off", "bf16dot", "amx" */
bool cpu_tile_operand(ElemType e);  /* values exact in bf16: bf16, e4m3, e5m2 */
/* How A is laid out for cpu_tile_block and cpu_tile_panels (their a_ld): a packed panel
 * [line][pair] (TILE_A_PACKED), a packed panel [pair][line] (TILE_A_PAIRS, the dot path only),
 * or, a_ld > 0, bf16 rows a_ld elements apart read where they lie. */
enum { TILE_A_PACKED = 0, TILE_A_PAIRS = -1 };
/* The layout cpu_tile_pack gives an A panel of an operand with k along its lines (k_fast) or
 * down its columns */
int64_t cpu_tile_a_layout(bool k_fast);
/* A panel of `lines` (<= 32) lines x kc of o, from `at`: element (line l, k) at at + l * ld + k
 * when k_fast, else at + k * ld + l; as a B panel with as_b. */
void cpu_tile_pack(const RtGemmOperand *o, int64_t at, int64_t ld, bool k_fast, int64_t lines,
                   int64_t kc, bool as_b, uint32_t *dst);
void cpu_tile_begin(void);          /* amx: load the tile configuration (per thread, per task) */
void cpu_tile_end(void);
/* c (32 x 32 f32, row stride ldc) = (or += with add) A times B panel over `steps` steps of 32
 * k; A as a_ld says (TILE_A_PACKED, TILE_A_PAIRS, or the row stride of bf16 rows) */
void cpu_tile_block(int64_t steps, const void *a, int64_t a_ld, const uint32_t *b, float *c, int64_t ldc,
                    bool add);
/* Blocks p < panels of c (c + 32 p, 32 x 32 f32, row stride ldc) = (or += with add) A times B
 * panel p (b + p b_panel) over `steps` steps of 32 k, A as for cpu_tile_block. */
void cpu_tile_panels(int64_t panels, int64_t steps, const void *a, int64_t a_ld, const uint32_t *b, int64_t b_panel,
                     float *c, int64_t ldc, bool add);
/* dst[c ldd + r] = src[r lds + c] for r, c < 16, 32-bit elements (x86-64 with AVX-512 only) */
void cpu_tile_transpose16(const uint32_t *src, int64_t lds, uint32_t *dst, int64_t ldd);
/* C's block (ni x nj at c, row stride ldc) = alpha out, or += alpha out with add */
void cpu_tile_store(const float *out, float *c, int64_t ldc, int64_t ni, int64_t nj, float alpha, bool add);

/* ---------------------------------------------------------------- cpu_attn_tile.c
 * Causal grouped-query attention on the GEMM's tile path, forward or backward (dy set), for bf16 q,
 * k, v and dy: q's element (b, t, h, d) at q[(b T + t) qs + h D + d], k and v likewise with
 * kv heads (ks, vs), dy (B, T, H D). The forward writes y (B, T, H D) into out; the backward
 * writes dq | dk | dv, (B, T, (H + 2 Hkv) D). out's rows are out_stride elements apart, stored
 * as out_elem (bf16 or f32, unscaled). */
typedef struct {
    int64_t B, T, H, Hkv, D;
    float scale;
    const uint16_t *q, *k, *v, *dy;
    int64_t qs, ks, vs;
    void *out;
    ElemType out_elem;
    int64_t out_stride;
} RtAttention;
bool cpu_attention_tile_usable(int64_t head_dim);  /* tile path on, D a multiple of 32 up to 256 */
int64_t cpu_attention_tile_runs(void);             /* tests: attentions the tile path has run */
/* How a backward is cut into tasks: whole (batch, kv head) pairs, each computing S and dP of
 * a block of queries once for dq, dk and dv (HEADS); or blocks of 32 rows, queries for dq and
 * then keys for dk and dv, each pass recomputing them (BLOCKS), which keeps more threads busy
 * when pairs are few. AUTO chooses by the threads; the others are for tests. */
typedef enum { CPU_ATTN_BWD_AUTO, CPU_ATTN_BWD_HEADS, CPU_ATTN_BWD_BLOCKS } CpuAttnBwd;
void cpu_attention_bwd_select(CpuAttnBwd how);
int64_t cpu_attention_bwd_head_runs(void);         /* tests: backwards run by whole heads */
void cpu_attention_tile(const RtAttention *a);
/* tests: out[i] = the tile attention's exp of (s[i] c - m2) in base 2, as its softmax computes
 * it (needs AVX-512: where cpu_attention_tile_usable) */
void cpu_attention_softmax_exp(const float *s, int64_t n, float c, float m2, float *out);

/* ---------------------------------------------------------------- ref_attn.c */
void ref_attention(const Node *n, const float *const *x, float *y);
void ref_attention_bwd(const Node *n, const float *const *x, float *y);
void ref_rope(const Node *n, const float *const *x, float *y);

/* ---------------------------------------------------------------- ref_ops.c */
void ref_binary(const Node *n, const float *const *x, float *y);     /* ADD, SUB, MUL */
void ref_scale(const Node *n, const float *const *x, float *y);
void ref_add_n(const Node *n, const float *const *x, float *y);
void ref_unary(const Node *n, const float *const *x, float *y);      /* GELU, SILU (+ _BWD) */
void ref_copy(const Node *n, const float *const *x, float *y);       /* RESHAPE, CAST */
void ref_slice(const Node *n, const float *const *x, float *y);      /* SLICE, PAD */
void ref_concat(const Node *n, const float *const *x, float *y);
void ref_transpose(const Node *n, const float *const *x, float *y);
void ref_sum_rows(const Node *n, const float *const *x, float *y);
void ref_norm(const Node *n, const float *const *x, float *y);       /* (LAYER|RMS)NORM(_BWD_*) */
void ref_softmax(const Node *n, const float *const *x, float *y);    /* SOFTMAX (+ _BWD) */
void ref_embedding(const Node *n, const float *const *x, float *y);
void ref_embedding_bwd(const Node *n, const float *const *x, float *y);
void ref_cross_entropy(const Node *n, const float *const *x, float *y);   /* (+ _BWD) */

/* ---------------------------------------------------------------- ref_optim.c */
void ref_sqnorm(const Node *n, const float *const *x, float *y);
void ref_clip_coef(const Node *n, const float *const *x, float *y);
void ref_grad_norm(const Node *n, const float *const *x, float *y);
void ref_accumulate(Node *n);                /* in place: reads and writes its inputs itself */
void ref_update(Node *n);                    /* ADAMW, LION, SGD, in place */
/* An update's first FP8 weight copy (where it has one), before any step: the amax of the
 * weights as they are, the scale from it, the copy through that scale (current scaling). */
void ref_adamw_first_copy(Node *n);

/* ---------------------------------------------------------------- ref_math.c */
void ref_exp_nonpositive(double *x, int64_t n);   /* x[i] = exp(x[i]) for x[i] <= 0, 1 ulp */

/* ---------------------------------------------------------------- ref_quant.c */
float ref_amax(const float *x, int64_t n);   /* max |x[i]|, NaN skipped, 0 when none; threaded */
void ref_quant_scale(const Node *n, const float *const *x, float *y);
void ref_amax_record(Node *n);               /* in place */
void ref_delayed_scale(Node *n);             /* in place */

#endif
