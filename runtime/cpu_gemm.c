/* cpu_gemm.c — the CPU backend's matrix multiplication: cache-blocked, multithreaded, f32 sums.
 *
 * GEMMs are most of a training step's arithmetic, so this is the one routine of the CPU
 * backend written by hand rather than generated (DESIGN.md §5). It has the shape every fast
 * CPU GEMM has (GotoBLAS, BLIS): K is cut into blocks of KC so that a packed panel of op(B)
 * (KC x NR, contiguous) stays in L1/L2 while a register-blocked micro-kernel sweeps MR rows of
 * packed op(A) over it; packing also absorbs the four transpose combinations, so the
 * micro-kernel sees one layout. The micro-kernel keeps an MR x NR tile of C in vector
 * registers: 8 x 32 floats in 16 zmm registers with AVX-512, 6 x 16 in 12 ymm with AVX2
 * (chosen when the program starts, by what the CPU supports), and a plain C loop elsewhere.
 *
 * Results are independent of the thread count: work is split by tiles of C (how finely
 * depends on the shape and the threads, gemm_split), and every tile sums its K blocks in
 * order, each block in k order. They are not the reference's bits (that one accumulates in
 * f64); the CPU backend's tests state the tolerance.
 *
 * Operands are read in their stored formats (f32, bf16, f16, e4m3, e5m2, unscaled or with one
 * scale per tensor) and widened to f32 while they are packed — exactly the values the
 * reference reads (decoded, divided by the scale) — so a bf16 or FP8 GEMM costs no separate
 * conversion pass; the kernel lowering widens other formats into f32 scratch first.
 *
 * Where both operands are stored as bf16, e4m3 or e5m2 (values bf16 holds exactly) and the CPU
 * has AMX or AVX512-BF16, the same driver — tasks, K blocks, panels packed by the first task
 * that needs them — packs bf16 panels of 32 lines instead and multiplies 32 x 32 blocks of C
 * on AMX's tiles or with AVX512-BF16's dot products (the tile path, cpu_gemm_tile.c, whose
 * essay says how its numerics differ). That is what a -O0 to -O3 step's
 * GEMMs mostly are; f32 and f16 operands keep the f32 path.
 *
 * rt_cpu_gemm_rows hands each block of C's rows on as soon as the last task covering its
 * columns has finished it (a counter per row block), so the executor runs the GEMM's epilogue
 * — bias, residual, GELU's backward, the rounding and accumulation of a weight gradient — on
 * rows still in cache, from the thread that finished them; where the GEMM has fewer row blocks
 * than threads, it hands all rows on at the end instead, so that the epilogue is not left to
 * a thread or two. Where each task makes whole rows in one round, it makes them in a buffer of
 * its thread's, which the epilogue reads and the thread's next rows reuse: C itself is then
 * never written. */
#include "ref_internal.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

enum { KC = 384, MC = 96, NC_TASK = 256, PACK_FLOATS = 1 << 21, LOAD_COST = 4 };
/* The tile path's K block: panels of 32 lines x 1024 bf16 (64 KiB) stay in L2. */
enum { KC_TILE = 1024 };
/* The widest C (columns) the tile path cuts into tasks of whole rows (gemm_split). */
enum { WIDE_ROWS = 512 };

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

typedef void (*MicroFn)(int64_t kc, const float *restrict a, const float *restrict b,
                        float *restrict c, int64_t ldc, bool add);

/* C (MR x NR at c, row stride ldc) = or += sum over k of a[k] (MR) outer b[k] (NR).
 * The tile lives in named vector variables so that the compiler keeps it in registers (an
 * array indexed in a loop ends up on the stack); ROW(i) is one row of the tile. */
#define TILE_LOAD(v, p) memcpy(&(v), (p), sizeof(v))
#define TILE_STORE(p, v) memcpy((p), &(v), sizeof(v))

__attribute__((target("avx512f,fma"))) static void micro_8x32(int64_t kc, const float *restrict a,
                                                              const float *restrict b,
                                                              float *restrict c, int64_t ldc,
                                                              bool add)
{
    v16 z = {0};
    v16 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z;
    v16 c40 = z, c41 = z, c50 = z, c51 = z, c60 = z, c61 = z, c70 = z, c71 = z;
    for (int64_t k = 0; k < kc; k++) {
        v16 b0, b1;
        TILE_LOAD(b0, b + k * 32);
        TILE_LOAD(b1, b + k * 32 + 16);
        const float *ak = a + k * 8;
#define ROW(i)                                                                                 \
    do {                                                                                       \
        float ai = ak[i];                                                                      \
        c##i##0 += ai * b0;                                                                    \
        c##i##1 += ai * b1;                                                                    \
    } while (0)
        ROW(0); ROW(1); ROW(2); ROW(3); ROW(4); ROW(5); ROW(6); ROW(7);
#undef ROW
    }
#define OUT(i)                                                                                 \
    do {                                                                                       \
        float *ci = c + i * ldc;                                                               \
        if (add) {                                                                             \
            v16 o0, o1;                                                                        \
            TILE_LOAD(o0, ci);                                                                 \
            TILE_LOAD(o1, ci + 16);                                                            \
            c##i##0 += o0;                                                                     \
            c##i##1 += o1;                                                                     \
        }                                                                                      \
        TILE_STORE(ci, c##i##0);                                                               \
        TILE_STORE(ci + 16, c##i##1);                                                          \
    } while (0)
    OUT(0); OUT(1); OUT(2); OUT(3); OUT(4); OUT(5); OUT(6); OUT(7);
#undef OUT
}

__attribute__((target("avx2,fma"))) static void micro_6x16(int64_t kc, const float *restrict a,
                                                           const float *restrict b,
                                                           float *restrict c, int64_t ldc, bool add)
{
    v8 z = {0};
    v8 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z,
       c50 = z, c51 = z;
    for (int64_t k = 0; k < kc; k++) {
        v8 b0, b1;
        TILE_LOAD(b0, b + k * 16);
        TILE_LOAD(b1, b + k * 16 + 8);
        const float *ak = a + k * 6;
#define ROW(i)                                                                                 \
    do {                                                                                       \
        float ai = ak[i];                                                                      \
        c##i##0 += ai * b0;                                                                    \
        c##i##1 += ai * b1;                                                                    \
    } while (0)
        ROW(0); ROW(1); ROW(2); ROW(3); ROW(4); ROW(5);
#undef ROW
    }
#define OUT(i)                                                                                 \
    do {                                                                                       \
        float *ci = c + i * ldc;                                                               \
        if (add) {                                                                             \
            v8 o0, o1;                                                                         \
            TILE_LOAD(o0, ci);                                                                 \
            TILE_LOAD(o1, ci + 8);                                                             \
            c##i##0 += o0;                                                                     \
            c##i##1 += o1;                                                                     \
        }                                                                                      \
        TILE_STORE(ci, c##i##0);                                                               \
        TILE_STORE(ci + 8, c##i##1);                                                           \
    } while (0)
    OUT(0); OUT(1); OUT(2); OUT(3); OUT(4); OUT(5);
#undef OUT
}

static void micro_4x8(int64_t kc, const float *restrict a, const float *restrict b,
                      float *restrict c, int64_t ldc, bool add)
{
    float acc[4][8] = {{0}};
    for (int64_t k = 0; k < kc; k++)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 8; j++) acc[i][j] += a[k * 4 + i] * b[k * 8 + j];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 8; j++) c[i * ldc + j] = add ? c[i * ldc + j] + acc[i][j] : acc[i][j];
}

typedef struct {
    int mr, nr;
    MicroFn fn;
    bool avx, avx2;   /* packing moves 8 x 8 blocks in ymm registers (pack_across) */
} Micro;

static Micro micro_pick(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    bool avx = __builtin_cpu_supports("avx"), avx2 = __builtin_cpu_supports("avx2");
    if (__builtin_cpu_supports("avx512f")) return (Micro){8, 32, micro_8x32, avx, avx2};
    if (avx2 && __builtin_cpu_supports("fma")) return (Micro){6, 16, micro_6x16, avx, avx2};
#endif
    return (Micro){4, 8, micro_4x8, false, false};
}

typedef struct {
    Micro u;                /* the tile path: mr = nr = TILE_LINES, no fn */
    bool tiles;             /* bf16 tiles (cpu_gemm_tile.c) instead of f32 micro-kernels */
    bool a_direct;          /* tiles: whole row panels of A are read where they lie (a_panel_direct) */
    float alpha;            /* tiles: 1 / (A's scale x B's scale), applied to each block's sum */
    int64_t kc;             /* K block depth: KC, or KC_TILE on the tile path */
    int64_t M, N, K, lda, ldb, ldc;
    RtGemmOperand A, B;
    bool ta, tb, accumulate;
    float *C;
    RtRowsDoneFn rows_done;     /* called per finished block of rows, in the last round */
    void *rows_ctx;
    bool c_local;               /* with rows_done: a task's rows go to its thread's buffer */
    atomic_int *pending;        /* per row block: its tasks not yet finished this round */
    bool last_round;
    int64_t n_col_panels, n_row_panels;     /* ceil(N / NR), ceil(M / MR) */
    /* a task: a block of row panels x a group of column panels (gemm_split) */
    int64_t block_panels, group_panels, n_row_blocks, n_col_groups;
    /* the K blocks packed now: [kb0, kb0 + n_kb), each kc deep but the last */
    int64_t kb0, n_kb, kc_max;  /* kc_max: min(K, kc), the depth a packed panel is given */
    int64_t a_panel, b_panel;   /* floats a packed panel takes: kc_max x MR (NR), or on the
                                   tile path kc_max rounded up to 32 x 32 bf16 */
    float *bpack;           /* n_kb x n_col_panels panels of b_panel floats */
    float *apack;           /* n_kb x n_row_panels panels of a_panel floats */
    atomic_uchar *state;    /* per packing item (pack_item) of the round: PANEL_FREE, ... */
} Gemm;

static float *alloc_floats(int64_t n)
{
    size_t bytes = (sizeof(float) * (size_t)(n > 0 ? n : 1) + 63) & ~(size_t)63;
    float *p = aligned_alloc(64, bytes);
    IR_ASSERT(p);
    return p;
}

/* The packed panels of a GEMM, kept for the next one of the calling thread: a step runs
 * hundreds of small GEMMs, and allocating their panels anew each time cost a page fault per
 * page (the allocator maps blocks of this size afresh and unmaps them on free). Grown as
 * needed, never shrunk; a pool thread's are freed when it ends (the pool shrinks when asked
 * for fewer threads). The tile attention keeps its scratch here too (ref_internal.h). */
static _Thread_local float *thread_store[CPU_BUF_COUNT];
static _Thread_local int64_t thread_floats[CPU_BUF_COUNT];
static pthread_key_t thread_key;
static pthread_once_t thread_key_once = PTHREAD_ONCE_INIT;

static void free_thread_store(void *store)
{
    float **p = store;
    for (int i = 0; i < CPU_BUF_COUNT; i++) free(p[i]), p[i] = NULL, thread_floats[i] = 0;
}

static void make_thread_key(void) { IR_ASSERT(pthread_key_create(&thread_key, free_thread_store) == 0); }

float *cpu_thread_floats(CpuThreadBuffer which, int64_t n)
{
    if (n > thread_floats[which]) {
        free(thread_store[which]);
        thread_store[which] = alloc_floats(n);
        thread_floats[which] = n;
        pthread_once(&thread_key_once, make_thread_key);
        pthread_setspecific(thread_key, thread_store);
    }
    return thread_store[which];
}

/* the 256 values of each FP8 format (numerics.c's decoders), filled before the first GEMM */
static float fp8_values[2][256];
static bool runs_avx2;   /* decode_run widens bf16 with AVX2 */

static void fill_fp8_values(void)
{
    for (int q = 0; q < 256; q++) {
        fp8_values[0][q] = num_e4m3_to_f32((uint8_t)q);
        fp8_values[1][q] = num_e5m2_to_f32((uint8_t)q);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* dst[c * ldd + r] = row r's element c, for r, c < 8: the classic three rounds of shuffles
 * (pairs of rows interleaved, then pairs of pairs, then the 128-bit halves swapped). */
__attribute__((target("avx"), always_inline)) static inline void
transpose_rows(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5, __m256 r6,
               __m256 r7, float *dst, int64_t ldd)
{
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
           t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
           t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE),
           s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE),
           s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE),
           s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(dst + ldd, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(s3, s7, 0x31));
}

/* 8 x n f32 (row stride lds) transposed into dst (row stride ldd), n a multiple of 8 */
__attribute__((target("avx"))) static void transpose_f32(const float *src, int64_t lds, int64_t n,
                                                         float *dst, int64_t ldd)
{
    for (int64_t c = 0; c < n; c += 8, src += 8, dst += 8 * ldd)
        transpose_rows(_mm256_loadu_ps(src), _mm256_loadu_ps(src + lds),
                       _mm256_loadu_ps(src + 2 * lds), _mm256_loadu_ps(src + 3 * lds),
                       _mm256_loadu_ps(src + 4 * lds), _mm256_loadu_ps(src + 5 * lds),
                       _mm256_loadu_ps(src + 6 * lds), _mm256_loadu_ps(src + 7 * lds), dst, ldd);
}

/* The same from bf16, widened on the way (a bf16 is the top half of its f32) */
__attribute__((target("avx2"), always_inline)) static inline __m256 widen_bf16(const uint16_t *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

__attribute__((target("avx2"))) static void transpose_bf16(const uint16_t *src, int64_t lds,
                                                           int64_t n, float *dst, int64_t ldd)
{
    for (int64_t c = 0; c < n; c += 8, src += 8, dst += 8 * ldd)
        transpose_rows(widen_bf16(src), widen_bf16(src + lds), widen_bf16(src + 2 * lds),
                       widen_bf16(src + 3 * lds), widen_bf16(src + 4 * lds),
                       widen_bf16(src + 5 * lds), widen_bf16(src + 6 * lds),
                       widen_bf16(src + 7 * lds), dst, ldd);
}

/* `lines` runs of `width` bf16 (a multiple of 8; run r at src + r * lds) widened into
 * consecutive lines of dst */
__attribute__((target("avx2"))) static void widen_bf16_lines(const uint16_t *src, int64_t lds,
                                                             int64_t lines, int width, float *dst)
{
    for (int64_t r = 0; r < lines; r++, src += lds, dst += width)
        for (int c = 0; c < width; c += 8) _mm256_storeu_ps(dst + c, widen_bf16(src + c));
}

/* n bf16 widened to f32, eight at a time (decode_run's loop, built for AVX2: the baseline
 * build moves its 64-byte vectors through the stack) */
__attribute__((target("avx2"))) static int64_t widen_bf16_run(const uint16_t *src, int64_t n,
                                                              float *dst)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, widen_bf16(src + i));
    return i;
}
#endif

/* n consecutive elements of operand o from element `at`, as f32: decoded exactly and divided
 * by the operand's scale, which is what the reference reads (ref_load). */
static void decode_run(const RtGemmOperand *o, int64_t at, int64_t n, float *dst)
{
    switch (o->elem) {
    case FMT_F32: memcpy(dst, (const float *)o->data + at, sizeof(float) * (size_t)n); break;
    case FMT_E4M3: case FMT_E5M2: {
        const float *values = fp8_values[o->elem == FMT_E5M2];
        const uint8_t *src = (const uint8_t *)o->data + at;
        for (int64_t i = 0; i < n; i++) dst[i] = values[src[i]];
        break;
    }
    case FMT_BF16: {
        /* sixteen at a time in vector registers: packing runs are short (a panel's width), so
         * the per-element loop, which the compiler does not vectorize, cost as much as the
         * multiplication on small GEMMs */
        const uint16_t *src = (const uint16_t *)o->data + at;
        int64_t i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
        if (runs_avx2) i = widen_bf16_run(src, n, dst);
#endif
        for (; i + 16 <= n; i += 16) {
            u16x16 h;
            memcpy(&h, src + i, sizeof h);
            u32x16 w = __builtin_convertvector(h, u32x16) << 16;
            memcpy(dst + i, &w, sizeof w);
        }
        if (i + 8 <= n) {   /* a row panel's 8 rows, read across a transposed operand */
            u16x8 h;
            memcpy(&h, src + i, sizeof h);
            u32x8 w = __builtin_convertvector(h, u32x8) << 16;
            memcpy(dst + i, &w, sizeof w);
            i += 8;
        }
        for (; i < n; i++) {
            uint32_t u = (uint32_t)src[i] << 16;
            memcpy(&dst[i], &u, sizeof u);
        }
        break;
    }
    default: num_decode(o->elem, (const char *)o->data + at * fmt_elem_bytes(o->elem), dst, n); break;
    }
    if (o->scale != 1.0f) {
        int64_t i = 0;
        v16 s = {0};
        s += o->scale;
        for (; i + 16 <= n; i += 16) {
            v16 x;
            memcpy(&x, dst + i, sizeof x);
            x /= s;
            memcpy(dst + i, &x, sizeof x);
        }
        for (; i < n; i++) dst[i] /= o->scale;
    }
}

/* A panel `width` wide whose lines are rows of the operand (A's rows, or B's rows when op(B)
 * reads it transposed): dst[c * width + r] = element (r, c) of the operand from `at` (row
 * stride ld) for r < rows, 0 for rows <= r < width, c < n. Read along the rows, written across.
 * Writing element by element (one store per float, each to another line of the panel) held
 * the forward x @ W^T GEMMs, whose whole weight is packed this way, to 0.67 of OpenBLAS; so
 * eight rows at a time move as 8 x 8 blocks transposed in vector registers, read in place
 * when f32 or bf16 (widened in the same registers), else first decoded into `stage`. Values
 * are only moved: the result is the element loop's, bit for bit. */
static void pack_across(const Gemm *g, const RtGemmOperand *o, int64_t at, int64_t ld,
                        int64_t rows, int width, int64_t n, float *dst)
{
    float stage[8 * KC];
    for (int r0 = 0; r0 < width; r0 += 8) {
        int h = width - r0 < 8 ? width - r0 : 8;
        int64_t live = rows - r0 < 0 ? 0 : rows - r0 < h ? rows - r0 : h;
        int64_t c = 0, whole = h == 8 ? n / 8 * 8 : 0;
        const float *src = stage;
        int64_t lds = KC;
        bool in_place = live == 8 && o->scale == 1.0f && (o->elem == FMT_F32 || o->elem == FMT_BF16);
#if defined(__x86_64__) && defined(__GNUC__)
        if (in_place && o->elem == FMT_F32 && g->u.avx) {
            transpose_f32((const float *)o->data + at + r0 * ld, ld, whole, dst + r0, width);
            c = whole;
        } else if (in_place && o->elem == FMT_BF16 && g->u.avx2) {
            transpose_bf16((const uint16_t *)o->data + at + r0 * ld, ld, whole, dst + r0, width);
            c = whole;
        }
#endif
        if (c == n) continue;
        if (in_place && o->elem == FMT_F32) {
            src = (const float *)o->data + at + r0 * ld;
            lds = ld;
        } else {
            for (int r = 0; r < h; r++) {
                if (r < live) decode_run(o, at + (r0 + r) * ld + c, n - c, stage + r * KC + c);
                else memset(stage + r * KC + c, 0, sizeof(float) * (size_t)(n - c));
            }
        }
#if defined(__x86_64__) && defined(__GNUC__)
        if (c < whole && g->u.avx) {
            transpose_f32(src + c, lds, whole - c, dst + c * width + r0, width);
            c = whole;
        }
#endif
        for (; c < n; c++)
            for (int r = 0; r < h; r++) dst[c * width + r0 + r] = src[r * lds + c];
    }
}

/* A panel `width` wide whose lines are runs of the operand (op(B) not transposed, op(A)
 * transposed): line r of dst = n elements of the operand from at + r * ld, then zeros up to
 * `width`, for r < lines. A full line of bf16 is widened in place, without decode_run's call
 * and checks per line: a panel has hundreds of lines of 32 floats, and those per-line costs
 * were most of the packing of gpt2_tiny's bf16 operands. */
static void pack_along(const Gemm *g, const RtGemmOperand *o, int64_t at, int64_t ld,
                       int64_t lines, int width, int64_t n, float *dst)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (n == width && width % 8 == 0 && o->elem == FMT_BF16 && o->scale == 1.0f && g->u.avx2) {
        widen_bf16_lines((const uint16_t *)o->data + at, ld, lines, width, dst);
        return;
    }
#endif
    for (int64_t r = 0; r < lines; r++) {
        float *line = dst + r * width;
        decode_run(o, at + r * ld, n, line);
        for (int64_t c = n; c < width; c++) line[c] = 0;
    }
}

/* Depth of K block kb: kc, or what is left of K. */
static int64_t kblock_depth(const Gemm *g, int64_t kb)
{
    int64_t k0 = kb * g->kc;
    return g->K - k0 < g->kc ? g->K - k0 : g->kc;
}

/* Column panel jp of op(B) for K block kb: kc x NR, zero columns past N. */
static void pack_b(const Gemm *g, int64_t kb, int64_t jp)
{
    int nr = g->u.nr;
    int64_t k0 = kb * g->kc, kc = kblock_depth(g, kb);
    float *dst = g->bpack + ((kb - g->kb0) * g->n_col_panels + jp) * g->b_panel;
    int64_t j0 = jp * nr, nj = g->N - j0 < nr ? g->N - j0 : nr;
    if (g->tiles) {
        int64_t at = g->tb ? j0 * g->ldb + k0 : k0 * g->ldb + j0;
        cpu_tile_pack(&g->B, at, g->ldb, g->tb, nj, kc, true, (uint32_t *)dst);
        return;
    }
    if (g->tb) {   /* rows of B are columns of op(B) */
        pack_across(g, &g->B, j0 * g->ldb + k0, g->ldb, nj, nr, kc, dst);
        return;
    }
    pack_along(g, &g->B, k0 * g->ldb + j0, g->ldb, kc, nr, nj, dst);
}

/* Whether row panel ip of A is read in place by the tile path: A is bf16 with k along its
 * rows, in steps of 32 k (the tile's row), and the panel has its 32 rows. Packing such a panel
 * only copied it, and the copy made a K = 128 GEMM's panels a third of its time. */
static bool a_panel_direct(const Gemm *g, int64_t ip)
{
    return g->a_direct && (ip + 1) * TILE_LINES <= g->M;
}

/* Row panel ip of op(A) for K block kb: kc x MR, zero rows past M. Packed once and shared by
 * every task of its rows, so that narrow column groups (short M, many threads) do not repeat
 * it. */
static void pack_a(const Gemm *g, int64_t kb, int64_t ip)
{
    int mr = g->u.mr;
    int64_t k0 = kb * g->kc, kc = kblock_depth(g, kb), i = ip * mr, ni = g->M - i < mr ? g->M - i : mr;
    if (a_panel_direct(g, ip)) return;
    float *ap = g->apack + ((kb - g->kb0) * g->n_row_panels + ip) * g->a_panel;
    if (g->tiles) {
        int64_t at = g->ta ? k0 * g->lda + i : i * g->lda + k0;
        cpu_tile_pack(&g->A, at, g->lda, !g->ta, ni, kc, false, (uint32_t *)ap);
        return;
    }
    if (g->ta) {
        pack_along(g, &g->A, k0 * g->lda + i, g->lda, kc, mr, ni, ap);
        return;
    }
    pack_across(g, &g->A, i * g->lda + k0, g->lda, ni, mr, kc, ap);
}

/* One packing item: for each K block, its column panels of B, then its row panels of A. */
static void pack_item(const Gemm *g, int64_t item)
{
    int64_t per_kb = g->n_col_panels + g->n_row_panels;
    int64_t kb = g->kb0 + item / per_kb, p = item % per_kb;
    if (p < g->n_col_panels) pack_b(g, kb, p);
    else pack_a(g, kb, p - g->n_col_panels);
}

/* Panels are packed by the first task that needs them, not in a parallel pass of their own:
 * that pass ended in a barrier, one more per GEMM, and a step runs hundreds of small GEMMs.
 * A task claims the free panels of its K block and packs them, then waits for those that
 * other tasks claimed first (they are being packed, so the wait is short; never a cycle, as
 * packing waits for nothing). Who packs a panel changes nothing in it. */
enum { PANEL_FREE, PANEL_PACKING, PANEL_READY };

static void panel_claim(const Gemm *g, int64_t item)
{
    atomic_uchar *s = &g->state[item];
    unsigned char free_state = PANEL_FREE;
    if (atomic_load_explicit(s, memory_order_relaxed) == PANEL_FREE &&
        atomic_compare_exchange_strong_explicit(s, &free_state, PANEL_PACKING, memory_order_relaxed,
                                                memory_order_relaxed)) {
        pack_item(g, item);
        atomic_store_explicit(s, PANEL_READY, memory_order_release);
    }
}

static void panel_wait(const Gemm *g, int64_t item)
{
    for (int spins = 0; atomic_load_explicit(&g->state[item], memory_order_acquire) != PANEL_READY; spins++) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if (spins >= 256) sched_yield();   /* the packer may be off the CPU (more threads than cores) */
    }
}

/* One task: a block of row panels x a group of column panels, summed over the packed K blocks
 * in order. */
static void gemm_task(void *ctx, int64_t task)
{
    Gemm *g = ctx;
    int mr = g->u.mr, nr = g->u.nr;
    int64_t ib = task / g->n_col_groups, jg = task % g->n_col_groups;
    int64_t ip0 = ib * g->block_panels, jp0 = jg * g->group_panels;
    int64_t ip1 = ip0 + g->block_panels < g->n_row_panels ? ip0 + g->block_panels : g->n_row_panels;
    int64_t jp1 = jp0 + g->group_panels < g->n_col_panels ? jp0 + g->group_panels : g->n_col_panels;
    int64_t per_kb = g->n_col_panels + g->n_row_panels;
    float tile[TILE_LINES * TILE_LINES] __attribute__((aligned(64)));
    /* where this task's rows of C go: C, or its thread's buffer (row ip0 * mr at its start) */
    float *C = g->C;
    int64_t row0 = 0;
    if (g->c_local) {
        row0 = ip0 * mr;
        C = cpu_thread_floats(CPU_BUF_ROWS, (ip1 - ip0) * mr * g->ldc);
    }
    if (g->tiles) cpu_tile_begin();
    for (int64_t q = 0; q < g->n_kb; q++) {
        int64_t kb = g->kb0 + q, kc = kblock_depth(g, kb), items = q * per_kb;
        bool add = g->accumulate || kb > 0;
        for (int64_t jp = jp0; jp < jp1; jp++) panel_claim(g, items + jp);
        for (int64_t ip = ip0; ip < ip1; ip++) panel_claim(g, items + g->n_col_panels + ip);
        for (int64_t jp = jp0; jp < jp1; jp++) panel_wait(g, items + jp);
        for (int64_t ip = ip0; ip < ip1; ip++) {
            int64_t i = ip * mr, ni = g->M - i < mr ? g->M - i : mr;
            const float *ap = g->apack + (q * g->n_row_panels + ip) * g->a_panel;
            panel_wait(g, items + g->n_col_panels + ip);
            for (int64_t jp = jp0; jp < jp1; jp++) {
                int64_t j0 = jp * nr, nj = g->N - j0 < nr ? g->N - j0 : nr;
                const float *bp = g->bpack + (q * g->n_col_panels + jp) * g->b_panel;
                if (g->tiles) {   /* a whole unscaled block goes to C and back in the tiles */
                    int64_t steps = (kc + 31) / 32;
                    const uint32_t *b32 = (const uint32_t *)bp;
                    const void *a = ap;
                    int64_t a_ld = cpu_tile_a_layout(!g->ta);
                    if (a_panel_direct(g, ip)) {
                        a = (const uint16_t *)g->A.data + i * g->lda + kb * g->kc;
                        a_ld = g->lda;
                    }
                    float *c = C + (i - row0) * g->ldc + j0;
                    if (ni == mr && nj == nr && g->alpha == 1.0f) {
                        cpu_tile_block(steps, a, a_ld, b32, c, g->ldc, add);
                    } else {
                        cpu_tile_block(steps, a, a_ld, b32, tile, TILE_LINES, false);
                        cpu_tile_store(tile, c, g->ldc, ni, nj, g->alpha, add);
                    }
                    continue;
                }
                if (ni == mr && nj == nr) {
                    g->u.fn(kc, ap, bp, C + (i - row0) * g->ldc + j0, g->ldc, add);
                    continue;
                }
                g->u.fn(kc, ap, bp, tile, nr, false);
                for (int64_t r = 0; r < ni; r++)
                    for (int64_t j = 0; j < nj; j++) {
                        float *c = C + (i - row0 + r) * g->ldc + j0 + j;
                        *c = add ? *c + tile[r * nr + j] : tile[r * nr + j];
                    }
            }
        }
    }
    if (g->tiles) cpu_tile_end();
    /* the last task of a row block to finish hands its rows on (acq_rel: it sees the others'
     * stores to C) */
    if (g->rows_done && g->last_round &&
        atomic_fetch_sub_explicit(&g->pending[ib], 1, memory_order_acq_rel) == 1)
        g->rows_done(g->rows_ctx, ip0 * mr, ip1 * mr < g->M ? ip1 * mr : g->M,
                     C + (ip0 * mr - row0) * g->ldc);
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* How C is cut into tasks for `threads` threads. A task is at most MC rows by NC_TASK columns
 * (what the caches hold), in whole panels, and costs its multiply-adds plus the loading of its
 * packed panels from the shared cache (LOAD_COST multiply-adds a float, per k: a task one
 * panel high rereads as much B as it multiplies). Tasks are claimed dynamically, so a split
 * takes about ceil(tasks / threads) rounds of its largest task, plus up to one more: a thread
 * that wakes late or runs slow leaves its last task for the others to wait on. The search
 * takes the quickest split, and of equally quick ones the fewest tasks, and cuts no finer than
 * four tasks a thread unless the cache limits alone make more. With short M and many threads
 * this gives narrow column groups, down to one panel, and row blocks of equal height (128
 * rows: two blocks of 64, not 96 and 32). The split decides which thread computes a tile,
 * never the order in which it is summed. */
static void gemm_split(Gemm *g, int64_t threads)
{
    int mr = g->u.mr, nr = g->u.nr;
    int64_t most = ceil_div(g->n_row_panels, MC / mr) * ceil_div(g->n_col_panels, NC_TASK / nr);
    if (most < 4 * threads) most = 4 * threads;
    /* Whole rows a task, where that lets the tasks keep C in their threads' buffers (c_local:
     * the rows go on to an epilogue, K is one block, C is at most WIDE_ROWS wide) and there
     * are row panels for two tasks a thread. Cutting the columns as well would write C to
     * memory and read it back: at gpt2_tiny's 2048 x 512 x 128 on the dot path, a quarter of
     * the GEMM's time. */
    bool whole_rows = g->tiles && g->rows_done && !g->accumulate && g->K <= g->kc &&
                      g->n_col_panels * nr <= WIDE_ROWS && g->n_row_panels >= 2 * threads;
    int64_t cp_most = whole_rows ? g->n_col_panels : NC_TASK / nr, cp_least = whole_rows ? g->n_col_panels : 1;
    int64_t best_time = INT64_MAX, best_tasks = 0, blocks = 1, groups = 1;
    for (int64_t rp = MC / mr; rp >= 1; rp--)
        for (int64_t cp = cp_most; cp >= cp_least; cp--) {
            int64_t b = ceil_div(g->n_row_panels, rp), c = ceil_div(g->n_col_panels, cp);
            if (b * c > most) continue;
            int64_t rows = (rp < g->n_row_panels ? rp : g->n_row_panels) * mr;
            int64_t cols = (cp < g->n_col_panels ? cp : g->n_col_panels) * nr;
            int64_t time = (ceil_div(b * c, threads) + 1) * (rows * cols + LOAD_COST * (rows + cols));
            if (time < best_time || (time == best_time && b * c < best_tasks)) {
                best_time = time;
                best_tasks = b * c;
                blocks = b;
                groups = c;
            }
        }
    g->block_panels = ceil_div(g->n_row_panels, blocks);
    g->group_panels = ceil_div(g->n_col_panels, groups);
    g->n_row_blocks = ceil_div(g->n_row_panels, g->block_panels);
    g->n_col_groups = ceil_div(g->n_col_panels, g->group_panels);
}

void rt_cpu_gemm_mixed(int64_t M, int64_t N, int64_t K, RtGemmOperand A, int64_t lda, bool ta,
                       RtGemmOperand B, int64_t ldb, bool tb, float *C, int64_t ldc, bool accumulate)
{
    rt_cpu_gemm_rows(M, N, K, A, lda, ta, B, ldb, tb, C, ldc, accumulate, NULL, NULL);
}

void rt_cpu_gemm_rows(int64_t M, int64_t N, int64_t K, RtGemmOperand A, int64_t lda, bool ta,
                      RtGemmOperand B, int64_t ldb, bool tb, float *C, int64_t ldc, bool accumulate,
                      RtRowsDoneFn rows_done, void *ctx)
{
    if (M <= 0) return;
    if (N <= 0 || K <= 0) {
        if (!accumulate && N > 0)
            for (int64_t i = 0; i < M; i++) memset(C + i * ldc, 0, sizeof(float) * (size_t)N);
        if (rows_done) rows_done(ctx, 0, M, C);
        return;
    }
    static Micro u;
    if (!u.fn) {
        fill_fp8_values();
        u = micro_pick();
        runs_avx2 = u.avx2;
    }
    Gemm g = {.u = u, .kc = KC, .M = M, .N = N, .K = K, .lda = lda, .ldb = ldb, .ldc = ldc,
              .A = A, .B = B, .ta = ta, .tb = tb, .accumulate = accumulate, .C = C,
              .rows_done = rows_done, .rows_ctx = ctx};
    /* operands whose values bf16 holds go to the tile unit where there is one */
    if (cpu_tile_operand(A.elem) && cpu_tile_operand(B.elem) && cpu_tile_usable()) {
        g.tiles = true;
        g.u = (Micro){TILE_LINES, TILE_LINES, NULL, u.avx, u.avx2};
        g.kc = KC_TILE;
        g.alpha = (float)(1.0 / ((double)A.scale * (double)B.scale));
        g.a_direct = A.elem == FMT_BF16 && !ta && K % 32 == 0;
    }
    g.n_col_panels = ceil_div(N, g.u.nr);
    g.n_row_panels = ceil_div(M, g.u.mr);
    /* no thread gets much under a million multiply-adds (on the tile path, AMX's or
     * AVX512-BF16's, two million): waking the pool costs more. AMX had eight million until the
     * pool's dispatch got cheaper; at two, gpt2_tiny's batch-1 GEMMs (128 rows) spread over
     * three or four threads instead of one, and the -O0 step on a 16-core Xeon went from
     * 3.6 - 3.9 ms to 2.4 - 2.8 (docs/cpu-backend.md). */
    double flops = 2.0 * (double)M * (double)N * (double)K;
    double least = !g.tiles ? 2e6 : 4e6;
    int64_t threads = ref_threads();
    if ((double)threads > flops / least) threads = (int64_t)(flops / least) + 1;
    bool serial = threads == 1;
    gemm_split(&g, threads);
    /* As many K blocks packed at once as PACK_FLOATS holds, so that a short GEMM packs
     * everything in one round: each round ends in a barrier, and at sixteen threads a
     * barrier costs about as much as a K block of a short GEMM. */
    int64_t n_kblocks = ceil_div(K, g.kc);
    g.kc_max = K < g.kc ? K : g.kc;
    g.a_panel = g.tiles ? ceil_div(g.kc_max, 32) * TILE_STEP_WORDS : g.kc_max * g.u.mr;
    g.b_panel = g.tiles ? ceil_div(g.kc_max, 32) * TILE_STEP_WORDS : g.kc_max * g.u.nr;
    int64_t kb_floats = g.n_col_panels * g.b_panel + g.n_row_panels * g.a_panel;
    int64_t fit = PACK_FLOATS / kb_floats > 1 ? PACK_FLOATS / kb_floats : 1;
    int64_t chunk = ceil_div(n_kblocks, ceil_div(n_kblocks, fit));   /* rounds of equal size */
    g.bpack = cpu_thread_floats(CPU_BUF_B_PANELS, chunk * g.n_col_panels * g.b_panel);
    g.apack = cpu_thread_floats(CPU_BUF_A_PANELS, chunk * g.n_row_panels * g.a_panel);
    g.state = (atomic_uchar *)cpu_thread_floats(CPU_BUF_PANEL_STATES, ceil_div(chunk * (g.n_col_panels + g.n_row_panels), 4));
    g.pending = (atomic_int *)cpu_thread_floats(CPU_BUF_ROW_COUNTERS, g.n_row_blocks);
    for (int64_t b = 0; b < g.n_row_blocks; b++) atomic_init(&g.pending[b], (int)g.n_col_groups);
    int64_t tasks = g.n_row_blocks * g.n_col_groups;
    /* Rows go on block by block only where there are blocks enough for the threads: a row
     * block's epilogue runs on the one thread that finished the block, and a short GEMM cut
     * into column groups has only a block or two. Otherwise they go on together at the end,
     * from outside any task, and the epilogue spreads over the pool. */
    bool by_block = !serial && g.n_row_blocks >= threads;
    if (!by_block) g.rows_done = NULL;
    /* A task that makes whole rows in one round keeps them in its thread's buffer, which its
     * next row block reuses: they stay in cache from the GEMM to the epilogue, and C (4 MiB in
     * a K = 128 GEMM of gpt2_tiny at batch 16 x 128) is neither written to memory nor read
     * back. Writing C was what held that GEMM's blocks to a third of the tile unit's rate. */
    g.c_local = g.rows_done && g.n_col_groups == 1 && !accumulate &&
                ceil_div(K, g.kc) <= chunk;
    for (g.kb0 = 0; g.kb0 < n_kblocks; g.kb0 += chunk) {
        g.n_kb = n_kblocks - g.kb0 < chunk ? n_kblocks - g.kb0 : chunk;
        g.last_round = g.kb0 + g.n_kb >= n_kblocks;
        int64_t items = g.n_kb * (g.n_col_panels + g.n_row_panels);
        for (int64_t t = 0; t < items; t++) atomic_init(&g.state[t], PANEL_FREE);
        if (serial)
            for (int64_t t = 0; t < tasks; t++) gemm_task(&g, t);
        else
            ref_parallel_for(tasks, gemm_task, &g);
    }
    if (!by_block && rows_done) rows_done(ctx, 0, M, C);
}

void rt_cpu_gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, bool ta,
                 const float *B, int64_t ldb, bool tb, float *C, int64_t ldc, bool accumulate)
{
    RtGemmOperand a = {A, FMT_F32, 1.0f}, b = {B, FMT_F32, 1.0f};
    rt_cpu_gemm_mixed(M, N, K, a, lda, ta, b, ldb, tb, C, ldc, accumulate);
}
