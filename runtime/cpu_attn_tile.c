/* cpu_attn_tile.c — causal attention on the tile path, for q, k, v (and dy) stored as bf16.
 *
 * The kernel IR's attention (codegen/lower_kernels.c) computes its products with f32 vector
 * FMAs: at a head size of 32 to 128 that is most of a training step's time on a CPU whose
 * GEMMs run on the tile path. Where the GEMM has its tile path (AMX's tiles, or AVX512-BF16's
 * dot products: cpu_gemm_tile.c; this file calls its block operations and does not care
 * which) and the operands are bf16, the executor (cpu_exec.c) runs an attention node here
 * instead, as FlashAttention does on a GPU: in blocks of 32 query (or key) rows, the scores
 * and their products as 32 x 32 blocks, the softmax in f32 vectors between them. The kernel
 * IR's kernels stay what runs everywhere else (FP8C_CPU_TILES=off, other CPUs, operands in
 * other formats, a group with fused elementwise nodes), and the tests run every path the CPU
 * has against the reference executor.
 *
 * Numerics. q, k, v and dy are bf16, so their products are exact in f32 and the scores and
 * dP = dy v^T are f32 sums of exact products, as on the vector path. P and dS, computed in f32,
 * are rounded to bf16 (to nearest even) as the left operands of P V, dS k, P^T dy and dS^T q,
 * as FlashAttention and the GPU's tensor-core attention (cuda/kernels/attn_tc.cuh) round them;
 * the softmax's row sums add the f32 values before that rounding. The rounding costs about
 * 2^-9 of each weight, and against the reference's f64 the results move from 1e-7 to a few
 * 1e-4 (normalized error; the tests bound them). What it buys: every product of the attention
 * is one bf16 product, where an exact f32 operand cost three bf16 terms' products on AMX or
 * f32 FMAs at half the dot product's rate. exp is 2^x by a polynomial (softmax_exp), within
 * 1e-6 relative where it counts.
 *
 * Work: operands are first packed into the tiles' layouts (cpu_tile_pack), once per call:
 *   "rows" layout   panels of 32 rows (keys or queries), steps of 32 columns of the head: the
 *                   right operand of a product over the head dimension (q k^T, dy v^T, k q^T)
 *   "cols" layout   panels of 32 columns of the head, steps of 32 rows: the right operand of a
 *                   product over rows (P v, dS k, P^T dy, dS^T q), or, packed as a left
 *                   operand, the left operand of the transposed products (dy^T P, q^T dS)
 * then
 *   forward   one task per (batch, head, block of 32 queries): S = q k^T, the causal softmax
 *             in place, O = P v, y = O / l;
 *   backward  by heads, one task per (batch, kv head): for each of its query heads and each
 *             block of 32 queries, S and dP = dy v^T, P, D_i = sum_j P_ij dP_ij, dS = P (dP -
 *             D) scale, dq = dS k; then for the blocks of keys the block sees, dv^T += dy^T P
 *             and dk^T += q^T dS, P and dS as right operands made by pairing their rows (no
 *             transposes), dk^T and dv^T summed in the task's own buffers and transposed at
 *             its end;
 *             or by blocks, where there are too few (batch, kv head) pairs to keep every
 *             thread busy (batch 1 on many cores), in two passes:
 *   dq        one task per (batch, head, block of 32 queries): S, dP, P, D, dS, dq as above,
 *             and each row's max, 1 / sum of exps and D kept for
 *   dk dv     one task per (batch, kv head, block of 32 keys): for the query heads of the kv
 *             head and the blocks of queries at or after the keys, S^T = k q^T and dP^T =
 *             v dy^T, P^T and dS^T from the kept rows, dv += P^T dy, dk += dS^T q.
 *             That is seven products of a pair of blocks where by heads takes five: at
 *             gpt2_tiny's batch 16 x 128 on two Zen 4 cores, 2.1 - 2.4 ms a layer against
 *             1.6.
 * Each task writes its own rows only, and sums in a fixed order: the results do not depend
 * on the thread count, and both cuts of the backward give the same bits (P is exp(scale S -
 * m) / l in both, from the same m and 1 / l, and every sum runs in the same order). */
#define _GNU_SOURCE
#include "ref_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_TILE_ATTN 1
#endif

enum { BLK = TILE_LINES, STEP = TILE_STEP_WORDS, MAX_HEAD = 256 };

static int64_t attn_tile_runs;

int64_t cpu_attention_tile_runs(void) { return attn_tile_runs; }

static CpuAttnBwd bwd_how;
static int64_t head_runs;

void cpu_attention_bwd_select(CpuAttnBwd how) { bwd_how = how; }
int64_t cpu_attention_bwd_head_runs(void) { return head_runs; }

bool cpu_attention_tile_usable(int64_t head_dim)
{
#ifdef HAVE_TILE_ATTN
    static int bf16 = -1;   /* AVX512-BF16 rounds P and dS to bf16 (every CPU with AMX-BF16 has it) */
    if (bf16 < 0) {
        __builtin_cpu_init();
        bf16 = __builtin_cpu_supports("avx512bf16");
    }
    return bf16 && cpu_tile_usable() && head_dim % 32 == 0 && head_dim <= MAX_HEAD;
#else
    (void)head_dim;
    return false;
#endif
}

#ifdef HAVE_TILE_ATTN

static int64_t blocks_of(int64_t n) { return (n + BLK - 1) / BLK; }

/* a task's scratch: its thread's buffer (cpu_gemm.c keeps them) */
static void *thread_scratch(size_t bytes)
{
    return cpu_thread_floats(CPU_BUF_ATTENTION, (int64_t)((bytes + 3) / 4));
}

/* the packed operands of one call (the caller runs one attention at a time) */
static uint32_t *packed_store;
static size_t packed_words;

static uint32_t *packed_space(size_t words)
{
    if (words > packed_words) {
        words = (words + 15) & ~(size_t)15;     /* aligned_alloc takes whole 64-byte lines */
        free(packed_store);
        packed_store = aligned_alloc(64, words * 4);
        IR_ASSERT(packed_store);
        packed_words = words;
    }
    return packed_store;
}

/* ---------------------------------------------------------------- packing */

/* A (B, T, heads x D) matrix seen per (batch, head): element (b, t, h, d) at
 * base[(b T + t) stride + h D + d]. */
typedef struct {
    const uint16_t *base;
    int64_t stride, heads;
} Heads;

/* Words one (batch, head) takes in either layout: ceil(T / 32) x D / 32 steps. */
static int64_t head_words(const RtAttention *a) { return blocks_of(a->T) * (a->D / 32) * STEP; }

typedef struct {
    const RtAttention *a;
    Heads x;
    uint32_t *rows, *cols;      /* either may be NULL */
    bool cols_as_a;             /* cols as A panels of x^T (cpu_tile_a_layout(false)) */
} PackJob;

static void pack_task(void *ctx, int64_t task)
{
    const PackJob *p = ctx;
    const RtAttention *a = p->a;
    int64_t b = task / p->x.heads, h = task % p->x.heads, nb = blocks_of(a->T), ds = a->D / 32;
    RtGemmOperand o = {p->x.base, FMT_BF16, 1.0f};
    int64_t at = b * a->T * p->x.stride + h * a->D;
    if (p->rows) {
        uint32_t *dst = p->rows + task * head_words(a);
        for (int64_t jb = 0; jb < nb; jb++) {
            int64_t lines = a->T - jb * BLK < BLK ? a->T - jb * BLK : BLK;
            cpu_tile_pack(&o, at + jb * BLK * p->x.stride, p->x.stride, true, lines, a->D, true,
                          dst + jb * ds * STEP);
        }
    }
    if (p->cols) {
        uint32_t *dst = p->cols + task * head_words(a);
        for (int64_t dp = 0; dp < ds; dp++)
            cpu_tile_pack(&o, at + dp * BLK, p->x.stride, false, BLK, a->T, !p->cols_as_a, dst + dp * nb * STEP);
    }
}

static void pack_heads(const RtAttention *a, Heads x, uint32_t *rows, uint32_t *cols, bool cols_as_a)
{
    PackJob p = {a, x, rows, cols, cols_as_a};
    ref_parallel_for(a->B * x.heads, pack_task, &p);
}

/* Rows [t0, t0 + 32) of head h of batch b as a left operand (32 bf16 rows, *ld elements
 * apart): where they lie when all 32 are before T, else copied into spare (32 x D) with zeros
 * past T. */
static const uint16_t *block_rows(const RtAttention *a, Heads x, int64_t b, int64_t h, int64_t t0, uint16_t *spare,
                                  int64_t *ld)
{
    const uint16_t *at = x.base + (b * a->T + t0) * x.stride + h * a->D;
    if (t0 + BLK <= a->T) {
        *ld = x.stride;
        return at;
    }
    for (int64_t r = 0; r < BLK; r++) {
        if (t0 + r < a->T) memcpy(spare + r * a->D, at + r * x.stride, 2 * (size_t)a->D);
        else memset(spare + r * a->D, 0, 2 * (size_t)a->D);
    }
    *ld = a->D;
    return spare;
}

/* ---------------------------------------------------------------- vector math */

/* The softmax's exp(scale s - m) as 2^(s c - m2), c = scale log2(e) and m2 = m log2(e) (the
 * row's m and scale folded into one multiply-add): 2^f by a degree-5 polynomial on f in
 * [-1/2, 1/2] (a minimax fit of the relative error, 2.1e-7 evaluated in f32), times 2^n by
 * scalef, which also makes arguments far below the f32 range 0. The rounding of s c - m2 adds
 * up to 1e-6 relative for the weights that count (2^-20 and up); the weights are then rounded
 * to bf16 for their products (2^-9). Half the instructions of Cephes' expf with its clamps and
 * two-part reduction, which this replaced. */
__attribute__((target("avx512f"))) static inline __m512 softmax_exp(__m512 s, __m512 c, __m512 m2)
{
    __m512 t = _mm512_fmsub_ps(s, c, m2);
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.327626741e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675471527e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713266e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402212109e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469675e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000071f));
    return _mm512_scalef_ps(p, n);
}

static const float LOG2E = 1.44269504088896341f;

/* lanes j .. j + 15 that key positions up to i see */
static inline __mmask16 seen(int64_t j, int64_t i)
{
    return j > i ? 0 : i - j >= 15 ? 0xFFFF : (__mmask16)((1u << (i - j + 1)) - 1);
}

__attribute__((target("avx512f"))) static inline float hmax16(__m512 x) { return _mm512_reduce_max_ps(x); }
__attribute__((target("avx512f"))) static inline float hsum16(__m512 x) { return _mm512_reduce_add_ps(x); }

/* The left operand of a product over rows: P or dS as bf16, 32 rows `ld` values apart. */
typedef struct {
    uint16_t *base;
    int64_t ld;
} Left;

/* values j .. j + 31 of row r: x0, then x1, rounded to bf16 (to nearest even) */
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline void
left_store(const Left *l, int64_t r, int64_t j, __m512 x0, __m512 x1)
{
    _mm512_storeu_si512(l->base + r * l->ld + j, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
}

/* C (32 x D: D / 32 blocks at c, row stride ldc) = (or += with add) the operand times a packed
 * B over `steps` steps, B's panel for each 32 columns of D b_panel words after the last */
static void left_product(const Left *l, const uint32_t *b, int64_t b_panel, int64_t panels, int64_t steps, float *c,
                         int64_t ldc, bool add)
{
    cpu_tile_panels(panels, steps, l->base, l->ld, b, b_panel, c, ldc, add);
}

/* bf16 codes of 16 f32 lanes, as num_f32_to_bf16 (round to nearest even, NaN to 0x7FFF) */
__attribute__((target("avx512f,avx512bw"))) static inline __m256i bf16_of16(__m512 x)
{
    __m512i u = _mm512_castps_si512(x), abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(abs, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(abs, _mm512_set1_epi32(0x7FFF)), odd), 16);
    r = _mm512_or_si512(r, _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FFF));
    return _mm512_cvtepi32_epi16(r);
}

/* bf16_of16 by the conversion instruction, where it agrees: it rounds to nearest even too, but
 * takes f32 subnormals as zero and keeps a NaN's sign and payload, so lanes of either kind
 * take bf16_of16 */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static inline __m256i bf16_fast16(__m512 x)
{
    __m512i abs = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
    __mmask16 odd = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(abs, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x007FFFFF)) |
                    _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F800000));
    return odd ? bf16_of16(x) : (__m256i)_mm512_cvtneps_pbh(x);
}

/* stores rows [t0, t0 + n) of a 32 x D f32 block into the output (bf16 rounded as
 * num_encode does, or f32), each row times its row_scale where that is given */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void store_rows(const RtAttention *a, const float *o,
                                                                             int64_t b, int64_t t0, int64_t n,
                                                                             int64_t col, const float *row_scale)
{
    for (int64_t r = 0; r < n; r++, o += a->D) {
        __m512 f = _mm512_set1_ps(row_scale ? row_scale[r] : 1.0f);
        int64_t at = (b * a->T + t0 + r) * a->out_stride + col;
        for (int64_t d = 0; d < a->D; d += 16) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + d), f);
            if (a->out_elem == FMT_BF16) _mm256_storeu_si256((__m256i *)((uint16_t *)a->out + at + d), bf16_fast16(x));
            else _mm512_storeu_ps((float *)a->out + at + d, x);
        }
    }
}

/* The block of 32 query rows a forward or dq task takes: task = (b H + h) nb + qb. */
typedef struct {
    int64_t qb, b, h, bh, g, t0, keys;  /* keys: those up to the block's last row, in blocks */
} QueryBlock;

static QueryBlock query_block(const RtAttention *a, int64_t nb, int64_t task)
{
    QueryBlock q = {.qb = task % nb, .bh = task / nb};
    q.b = q.bh / a->H;
    q.h = q.bh % a->H;
    q.g = q.h / (a->H / a->Hkv);
    q.t0 = q.qb * BLK;
    q.keys = (q.qb + 1) * BLK;
    return q;
}

/* The maximum of scale s[j] over the keys j <= i of a row of scores */
__attribute__((target("avx512f"))) static float row_max(const float *s, int64_t keys, int64_t i, __m512 scale)
{
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < keys && j <= i; j += 16)
        m = _mm512_mask_max_ps(m, seen(j, i), m, _mm512_mul_ps(_mm512_loadu_ps(s + j), scale));
    return hmax16(m);
}

/* ---------------------------------------------------------------- forward */

typedef struct {
    const RtAttention *a;
    const uint32_t *k_rows, *v_cols;
    int64_t nb;
} Fwd;

__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void fwd_task(void *ctx, int64_t task)
{
    const Fwd *f = ctx;
    const RtAttention *a = f->a;
    QueryBlock z = query_block(a, f->nb, task);
    int64_t nb = f->nb, qb = z.qb, b = z.b, h = z.h, g = z.g, t0 = z.t0, keys = z.keys, D = a->D;
    size_t s_bytes = sizeof(float) * BLK * (size_t)keys, p_bytes = 2 * BLK * (size_t)keys;
    char *mem = thread_scratch(s_bytes + p_bytes + sizeof(float) * BLK * (size_t)D + 2 * BLK * (size_t)D + 64 * BLK);
    float *S = (float *)mem, *O = (float *)(mem + s_bytes + p_bytes);
    uint16_t *q = (uint16_t *)(O + BLK * D);
    float *inv = (float *)(q + BLK * D);
    Left P = {(uint16_t *)(mem + s_bytes), keys};
    int64_t q_ld;
    const uint16_t *qr = block_rows(a, (Heads){a->q, a->qs, a->H}, b, h, t0, q, &q_ld);
    cpu_tile_begin();
    const uint32_t *kr = f->k_rows + (b * a->Hkv + g) * nb * (D / 32) * STEP;
    cpu_tile_panels(qb + 1, D / 32, qr, q_ld, kr, (D / 32) * STEP, S, keys, false);
    __m512 scale = _mm512_set1_ps(a->scale), c = _mm512_set1_ps(a->scale * LOG2E);
    for (int64_t r = 0; r < BLK; r++) {
        float *s = S + r * keys;
        int64_t i = t0 + r;     /* keys 0..i are seen */
        __m512 m2 = _mm512_set1_ps(row_max(s, keys, i, scale) * LOG2E), l = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; j += 32) {
            __m512 e0 = _mm512_maskz_mov_ps(seen(j, i), softmax_exp(_mm512_loadu_ps(s + j), c, m2));
            __m512 e1 = _mm512_maskz_mov_ps(seen(j + 16, i), softmax_exp(_mm512_loadu_ps(s + j + 16), c, m2));
            l = _mm512_add_ps(l, _mm512_add_ps(e0, e1));
            left_store(&P, r, j, e0, e1);
        }
        inv[r] = 1.0f / hsum16(l);
    }
    left_product(&P, f->v_cols + (b * a->Hkv + g) * (D / 32) * nb * STEP, nb * STEP, D / 32, qb + 1, O, D, false);
    cpu_tile_end();
    store_rows(a, O, b, t0, a->T - t0 < BLK ? a->T - t0 : BLK, h * D, inv);
}

/* ---------------------------------------------------------------- backward */

typedef struct {
    const RtAttention *a;
    int64_t nb;
    const uint32_t *k_rows, *v_rows, *k_cols;       /* dq */
    const uint32_t *q_rows, *dy_rows, *q_cols, *dy_cols;   /* dk dv, by blocks */
    const uint32_t *q_t, *dy_t;     /* dk dv, by heads: A panels of q^T and dy^T */
    float *kept;            /* softmax_grad_rows' rows: B H T each of max, inv, dsum */
} Bwd;

/* Rows t0 .. t0 + 31 of a block of queries, from S = q k^T and dP = dy v^T (32 rows of
 * `keys` values): P = softmax(scale S) over the keys each row sees, as exp(scale S - m) / l
 * (m the row's largest, l the sum of the exps), written over S, and dS = P (dP - D) scale over
 * dP, with D = sum_j P_ij dP_ij; rows past T become zeros. Each row's m, 1 / l and D go to
 * keep where it is given, for the blocks' dk dv pass, which recomputes P from them with the
 * same operations: both cuts of the backward give the same bits. */
typedef struct {
    float *max, *inv, *dsum;    /* per (b, h, t) */
} RowsKept;

__attribute__((target("avx512f"))) static void softmax_grad_rows(const RtAttention *a, float *S, float *dP,
                                                                 int64_t keys, int64_t t0, const RowsKept *keep)
{
    __m512 scale = _mm512_set1_ps(a->scale), c = _mm512_set1_ps(a->scale * LOG2E);
    for (int64_t r = 0; r < BLK; r++) {
        float *s = S + r * keys, *dp = dP + r * keys;
        int64_t i = t0 + r;
        if (i >= a->T) {
            memset(s, 0, sizeof(float) * (size_t)keys);
            memset(dp, 0, sizeof(float) * (size_t)keys);
            continue;
        }
        float mx = row_max(s, keys, i, scale);
        __m512 m2 = _mm512_set1_ps(mx * LOG2E), l = _mm512_setzero_ps(), pd = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; j += 16) {
            __m512 e = _mm512_maskz_mov_ps(seen(j, i), softmax_exp(_mm512_loadu_ps(s + j), c, m2));
            _mm512_storeu_ps(s + j, e);
            l = _mm512_add_ps(l, e);
            pd = _mm512_fmadd_ps(e, _mm512_loadu_ps(dp + j), pd);
        }
        float inv = 1.0f / hsum16(l), d = hsum16(pd) * inv;
        __m512 iv = _mm512_set1_ps(inv), dv = _mm512_set1_ps(d);
        for (int64_t j = 0; j < keys; j += 16) {
            __m512 p = _mm512_mul_ps(_mm512_loadu_ps(s + j), iv);
            _mm512_storeu_ps(s + j, p);
            _mm512_storeu_ps(dp + j, _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dp + j), dv)), scale));
        }
        if (keep) {
            keep->max[i] = mx;
            keep->inv[i] = inv;
            keep->dsum[i] = d;
        }
    }
}

/* 32 rows of f32 values (`cols` of them, rows ld apart, cols a multiple of 32) as a Left of
 * their bf16 roundings in `space` */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static Left left_of(const float *x, int64_t ld, int64_t cols,
                                                                         uint16_t *space)
{
    Left l = {space, cols};
    for (int64_t r = 0; r < BLK; r++)
        for (int64_t j = 0; j < cols; j += 32)
            left_store(&l, r, j, _mm512_loadu_ps(x + r * ld + j), _mm512_loadu_ps(x + r * ld + j + 16));
    return l;
}

/* A block of 32 queries' scratch for rows of up to `span` keys: S and dP, the space of a left
 * operand made of them (left_of: 2 bytes a value), dq's block, the block's q and dy rows */
typedef struct {
    float *S, *dP, *dQ;
    uint16_t *left, *q, *dy;
} QueryScratch;

static size_t query_scratch_bytes(int64_t span, int64_t D)
{
    return (2 * sizeof(float) + 2) * BLK * (size_t)span + (sizeof(float) + 4) * BLK * (size_t)D;
}

static QueryScratch query_scratch(char *mem, int64_t span, int64_t D)
{
    QueryScratch x = {.S = (float *)mem};
    x.dP = x.S + BLK * span;
    x.left = (uint16_t *)(x.dP + BLK * span);
    x.dQ = (float *)(x.left + BLK * span);
    x.q = (uint16_t *)(x.dQ + BLK * D);
    x.dy = x.q + BLK * D;
    return x;
}

/* Block qb of query head h (batch b): S = q k^T and dP = dy v^T, P and dS over them
 * (softmax_grad_rows, the rows kept where keep is given), and dq's rows = dS k, stored. Both
 * cuts of the backward start a block of queries with this. */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void query_block_backward(const Bwd *w, int64_t b,
                                                                                      int64_t h, int64_t qb,
                                                                                      const QueryScratch *x,
                                                                                      const RowsKept *keep)
{
    const RtAttention *a = w->a;
    int64_t nb = w->nb, D = a->D, ds = D / 32, kv = b * a->Hkv + h / (a->H / a->Hkv);
    int64_t t0 = qb * BLK, keys = (qb + 1) * BLK;
    int64_t q_ld, dy_ld;
    const uint16_t *q = block_rows(a, (Heads){a->q, a->qs, a->H}, b, h, t0, x->q, &q_ld);
    const uint16_t *dy = block_rows(a, (Heads){a->dy, a->H * D, a->H}, b, h, t0, x->dy, &dy_ld);
    cpu_tile_panels(qb + 1, ds, q, q_ld, w->k_rows + kv * nb * ds * STEP, ds * STEP, x->S, keys, false);
    cpu_tile_panels(qb + 1, ds, dy, dy_ld, w->v_rows + kv * nb * ds * STEP, ds * STEP, x->dP, keys, false);
    softmax_grad_rows(a, x->S, x->dP, keys, t0, keep);
    Left dS = left_of(x->dP, keys, keys, x->left);
    left_product(&dS, w->k_cols + kv * ds * nb * STEP, nb * STEP, ds, qb + 1, x->dQ, D, false);
    store_rows(a, x->dQ, b, t0, a->T - t0 < BLK ? a->T - t0 : BLK, h * D, NULL);
}

static void dq_task(void *ctx, int64_t task)
{
    const Bwd *w = ctx;
    const RtAttention *a = w->a;
    QueryBlock z = query_block(a, w->nb, task);
    QueryScratch x = query_scratch(thread_scratch(query_scratch_bytes(z.keys, a->D)), z.keys, a->D);
    int64_t rows = a->B * a->H * a->T, at = z.bh * a->T;
    RowsKept keep = {w->kept + at, w->kept + rows + at, w->kept + 2 * rows + at};
    cpu_tile_begin();
    query_block_backward(w, z.b, z.h, z.qb, &x, &keep);
    cpu_tile_end();
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void dkv_task(void *ctx, int64_t task)
{
    const Bwd *w = ctx;
    const RtAttention *a = w->a;
    int64_t nb = w->nb, kb = task % nb, kv = task / nb, b = kv / a->Hkv, g = kv % a->Hkv;
    int64_t group = a->H / a->Hkv, j0 = kb * BLK, D = a->D, ds = D / 32;
    size_t blk = sizeof(float) * BLK * BLK;
    char *mem = thread_scratch(2 * blk + 2 * 2 * BLK * BLK + 2 * sizeof(float) * BLK * (size_t)D +
                               4 * BLK * (size_t)D);
    float *ST = (float *)mem, *dPT = (float *)(mem + blk);
    uint16_t *pt = (uint16_t *)(mem + 2 * blk), *dst = pt + BLK * BLK;
    Left PT = {pt, BLK}, dST = {dst, BLK};
    float *dK = (float *)(dst + BLK * BLK), *dV = dK + BLK * D;
    uint16_t *k = (uint16_t *)(dV + BLK * D), *v = k + BLK * D;
    int64_t k_ld, v_ld;
    const uint16_t *kr = block_rows(a, (Heads){a->k, a->ks, a->Hkv}, b, g, j0, k, &k_ld);
    const uint16_t *vr = block_rows(a, (Heads){a->v, a->vs, a->Hkv}, b, g, j0, v, &v_ld);
    memset(dK, 0, sizeof(float) * BLK * (size_t)D);
    memset(dV, 0, sizeof(float) * BLK * (size_t)D);
    __m512 scale = _mm512_set1_ps(a->scale), c = _mm512_set1_ps(a->scale * LOG2E);
    cpu_tile_begin();
    for (int64_t hh = 0; hh < group; hh++) {
        int64_t h = g * group + hh, bh = b * a->H + h;
        int64_t rows = a->B * a->H * a->T;
        const float *max = w->kept + bh * a->T, *inv = max + rows, *dsum = inv + rows;
        for (int64_t qb = kb; qb < nb; qb++) {
            int64_t t0 = qb * BLK;
            cpu_tile_panels(1, ds, kr, k_ld, w->q_rows + (bh * nb + qb) * ds * STEP, 0, ST, BLK, false);
            cpu_tile_panels(1, ds, vr, v_ld, w->dy_rows + (bh * nb + qb) * ds * STEP, 0, dPT, BLK, false);
            __mmask16 inside[2];        /* the two halves' queries before T */
            __m512 m2[2], iv[2], dv[2]; /* their max times log2(e), 1 / sum and D */
            for (int u = 0; u < 2; u++) {
                int64_t i0 = t0 + 16 * u;
                inside[u] = i0 + 16 <= a->T ? 0xFFFF : a->T <= i0 ? 0 : (__mmask16)((1u << (a->T - i0)) - 1);
                m2[u] = _mm512_mul_ps(_mm512_maskz_loadu_ps(inside[u], max + i0), _mm512_set1_ps(LOG2E));
                iv[u] = _mm512_maskz_loadu_ps(inside[u], inv + i0);
                dv[u] = _mm512_maskz_loadu_ps(inside[u], dsum + i0);
            }
            for (int64_t r = 0; r < BLK; r++) {   /* key j0 + r against queries t0 .. t0 + 31 */
                int64_t j = j0 + r;
                __m512 p[2], d[2];
                for (int u = 0; u < 2; u++) {
                    int64_t i0 = t0 + 16 * u;
                    __mmask16 live = inside[u];
                    if (i0 < j) live &= j - i0 >= 16 ? 0 : (__mmask16)(0xFFFFu << (j - i0));
                    if (j >= a->T) live = 0;
                    __m512 e = softmax_exp(_mm512_loadu_ps(ST + r * BLK + 16 * u), c, m2[u]);
                    p[u] = _mm512_mul_ps(_mm512_maskz_mov_ps(live, e), iv[u]);
                    d[u] = _mm512_mul_ps(_mm512_mul_ps(p[u], _mm512_sub_ps(_mm512_loadu_ps(dPT + r * BLK + 16 * u), dv[u])), scale);
                }
                left_store(&PT, r, 0, p[0], p[1]);
                left_store(&dST, r, 0, d[0], d[1]);
            }
            const uint32_t *dyc = w->dy_cols + bh * ds * nb * STEP + qb * STEP;
            const uint32_t *qc = w->q_cols + bh * ds * nb * STEP + qb * STEP;
            left_product(&PT, dyc, nb * STEP, ds, 1, dV, D, true);
            left_product(&dST, qc, nb * STEP, ds, 1, dK, D, true);
        }
    }
    cpu_tile_end();
    int64_t n = a->T - j0 < BLK ? a->T - j0 : BLK;
    store_rows(a, dK, b, j0, n, a->H * D + g * D, NULL);
    store_rows(a, dV, b, j0, n, a->H * D + a->Hkv * D + g * D, NULL);
}

/* Values j .. j + 31 of two consecutive rows r0 and r1 of f32 as one pair of a B panel
 * ([pair][line], 32 words): word l is bf16(r0[l]) | bf16(r1[l]) << 16, rounded to nearest
 * even as left_store rounds */
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline void
pair_store(const float *r0, const float *r1, uint32_t *dst)
{
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int h = 0; h < 2; h++) {
        __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(r1 + 16 * h), _mm512_loadu_ps(r0 + 16 * h));
        _mm512_storeu_si512(dst + 16 * h, _mm512_permutexvar_epi16(mix, both));
    }
}

/* 32 rows of f32 (row stride ld) as `blocks` B panels of one step, one per 32 columns:
 * pairs of rows (queries) by lines (keys) */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void pair_panels(const float *x, int64_t ld,
                                                                             int64_t blocks, uint32_t *dst)
{
    for (int64_t kb = 0; kb < blocks; kb++, dst += STEP)
        for (int64_t p = 0; p < BLK / 2; p++)
            pair_store(x + 2 * p * ld + kb * BLK, x + (2 * p + 1) * ld + kb * BLK, dst + p * BLK);
}

/* The whole backward of one (batch, kv head) pair: for each query head of its group and each
 * block of 32 queries, S and dP once; from them P and dS (softmax_grad_rows), dq's block
 * (dS k), and the block's share of dk and dv, computed transposed: dv^T += dy^T P and dk^T +=
 * q^T dS, with dy^T and q^T packed once per call as A panels and P and dS made B panels by
 * pairing their rows, so that no block of P or dS is transposed. The task sums dk^T and dv^T
 * over its queries in its own buffers, in a fixed order (the same products in the same order
 * as the blocks cut's P^T dy and dS^T q, hence the same bits), and transposes them once at
 * the end. */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void head_bwd_task(void *ctx, int64_t task)
{
    const Bwd *w = ctx;
    const RtAttention *a = w->a;
    int64_t nb = w->nb, kv = task, b = kv / a->Hkv, g = kv % a->Hkv, group = a->H / a->Hkv;
    int64_t D = a->D, ds = D / 32, span = nb * BLK;  /* span: the keys, padded to whole blocks */
    int64_t a_layout = cpu_tile_a_layout(false);
    size_t kv_bytes = sizeof(float) * (size_t)(span * D), x_bytes = query_scratch_bytes(span, D);
    size_t pair_bytes = sizeof(uint32_t) * (size_t)(nb * STEP);
    char *mem = thread_scratch(x_bytes + 3 * kv_bytes + 2 * pair_bytes);
    QueryScratch x = query_scratch(mem, span, D);
    float *dKT = (float *)(mem + x_bytes), *dVT = dKT + span * D;   /* (D, span) */
    float *rows = dVT + span * D;                                    /* (span, D): dk, then dv */
    uint32_t *pp = (uint32_t *)(rows + span * D), *dsp = pp + nb * STEP;
    memset(dKT, 0, 2 * kv_bytes);
    cpu_tile_begin();
    for (int64_t hh = 0; hh < group; hh++) {
        int64_t h = g * group + hh, bh = b * a->H + h;
        for (int64_t qb = 0; qb < nb; qb++) {
            int64_t keys = (qb + 1) * BLK;
            query_block_backward(w, b, h, qb, &x, NULL);
            pair_panels(x.S, keys, qb + 1, pp);
            pair_panels(x.dP, keys, qb + 1, dsp);
            for (int64_t dp = 0; dp < ds; dp++) {
                int64_t at = (bh * ds + dp) * nb * STEP + qb * STEP;
                cpu_tile_panels(qb + 1, 1, w->dy_t + at, a_layout, pp, STEP, dVT + dp * BLK * span, span, true);
                cpu_tile_panels(qb + 1, 1, w->q_t + at, a_layout, dsp, STEP, dKT + dp * BLK * span, span, true);
            }
        }
    }
    cpu_tile_end();
    const float *sums[2] = {dKT, dVT};
    for (int which = 0; which < 2; which++) {   /* dk, then dv: transposed into rows, stored */
        for (int64_t r0 = 0; r0 < D; r0 += 16)
            for (int64_t c0 = 0; c0 < span; c0 += 16)
                cpu_tile_transpose16((const uint32_t *)(sums[which] + r0 * span + c0), span,
                                     (uint32_t *)(rows + c0 * D + r0), D);
        store_rows(a, rows, b, 0, a->T, a->H * D + which * a->Hkv * D + g * D, NULL);
    }
}

/* Whole heads a task where that keeps the threads busy: at least a (batch, kv head) pair a
 * thread, and the last round at least three quarters full. Else blocks of rows, whose two
 * passes recompute S and dP (seven block products where one pass takes five) but make nb
 * times the tasks. */
static bool bwd_by_heads(const RtAttention *a)
{
    if (bwd_how != CPU_ATTN_BWD_AUTO) return bwd_how == CPU_ATTN_BWD_HEADS;
    int64_t pairs = a->B * a->Hkv, threads = ref_threads();
    int64_t rounds = (pairs + threads - 1) / threads;
    return pairs >= threads && 4 * pairs >= 3 * rounds * threads;
}

/* ---------------------------------------------------------------- entry points */

void cpu_attention_tile(const RtAttention *a)
{
    attn_tile_runs++;
    int64_t nb = blocks_of(a->T), hw = head_words(a);
    Heads k = {a->k, a->ks, a->Hkv}, v = {a->v, a->vs, a->Hkv};
    if (!a->dy) {
        uint32_t *mem = packed_space((size_t)(2 * a->B * a->Hkv * hw));
        Fwd f = {a, mem, mem + a->B * a->Hkv * hw, nb};
        pack_heads(a, k, mem, NULL, false);
        pack_heads(a, v, NULL, mem + a->B * a->Hkv * hw, false);
        ref_parallel_for(a->B * a->H * nb, fwd_task, &f);
        return;
    }
    int64_t kvw = a->B * a->Hkv * hw, qw = a->B * a->H * hw, rows = a->B * a->H * a->T;
    uint32_t *mem = packed_space((size_t)(3 * kvw + 4 * qw + 3 * rows));
    Bwd w = {.a = a, .nb = nb};
    uint32_t *k_rows = mem, *k_cols = mem + kvw, *v_rows = mem + 2 * kvw;
    uint32_t *q_rows = mem + 3 * kvw, *q_cols = q_rows + qw, *dy_rows = q_cols + qw, *dy_cols = dy_rows + qw;
    w.k_rows = k_rows, w.k_cols = k_cols, w.v_rows = v_rows;
    w.q_rows = q_rows, w.q_cols = q_cols, w.dy_rows = dy_rows, w.dy_cols = dy_cols;
    w.q_t = q_cols, w.dy_t = dy_cols;   /* the same space: one cut or the other packs it */
    w.kept = (float *)(dy_cols + qw);
    /* by heads: q and dy are read as left operands in place, and their transposes as A
     * panels; by blocks: q and dy as right operands, by rows and by columns */
    bool by_heads = bwd_by_heads(a);
    pack_heads(a, k, k_rows, k_cols, false);
    pack_heads(a, v, v_rows, NULL, false);
    pack_heads(a, (Heads){a->q, a->qs, a->H}, by_heads ? NULL : q_rows, q_cols, by_heads);
    pack_heads(a, (Heads){a->dy, a->H * a->D, a->H}, by_heads ? NULL : dy_rows, dy_cols, by_heads);
    if (by_heads) {
        head_runs++;
        ref_parallel_for(a->B * a->Hkv, head_bwd_task, &w);
        return;
    }
    ref_parallel_for(a->B * a->H * nb, dq_task, &w);
    ref_parallel_for(a->B * a->Hkv * nb, dkv_task, &w);
}

__attribute__((target("avx512f"))) void cpu_attention_softmax_exp(const float *s, int64_t n, float c, float m2,
                                                                   float *out)
{
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 live = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 e = softmax_exp(_mm512_maskz_loadu_ps(live, s + i), _mm512_set1_ps(c), _mm512_set1_ps(m2));
        _mm512_mask_storeu_ps(out + i, live, e);
    }
}

#else
void cpu_attention_tile(const RtAttention *a)
{
    (void)a;
    IR_ASSERT(!"tile attention without the tile path");
}

void cpu_attention_softmax_exp(const float *s, int64_t n, float c, float m2, float *out)
{
    (void)s, (void)n, (void)c, (void)m2, (void)out;
    IR_ASSERT(!"tile attention without the tile path");
}
#endif
