/* cpu_gemm_tile.c — the CPU GEMM on Intel AMX tiles, for operands whose values bf16 holds.
 *
 * bf16, e4m3 and e5m2 values are all exact in bf16 (FP8's few mantissa bits and narrow
 * exponents fit inside bf16's), so a GEMM whose operands are stored in those formats can run
 * on AMX's bf16 tile unit (TDPBF16PS: a 16 x 32 by 32 x 16 product added into 16 x 16 f32
 * sums, 1024 multiply-adds a cycle) instead of widening every element to f32 for the vector
 * units. The products of two bf16 are exact in f32 and the sums are f32, as on the f32 path;
 * only the order of the additions differs (pairs of k first). Two things the f32 path does not
 * do: the tile unit treats subnormal inputs as zero and flushes subnormal sums to zero (below
 * 2^-126, far under any value a training step carries), and a per-tensor scale is applied
 * once to the sum (C = sum(a b) / (sa sb)) rather than to every element, which is what FP8
 * GEMM units do.
 *
 * cpu_gemm.c keeps the driver — tasks, K blocks, panels packed by the first task that needs
 * them — and calls this file to pack a panel and to multiply a 32 x 32 block of C. A panel is
 * 32 lines (rows of op(A), or columns of op(B)) by the K block's depth, as bf16 pairs (the
 * tile unit's 32-bit elements hold two consecutive k), in steps of 32 k:
 *   A panel, step s: [line 0..31][pair 0..15]  — two A tiles, lines 0-15 and 16-31
 *   B panel, step s: [pair 0..15][line 0..31]  — two B tiles, columns 0-15 and 16-31
 * An operand stored with k along its rows (A, or B read transposed) gives the first order as
 * it lies; one stored with k down its columns gives the second by interleaving two rows. The
 * other combination is a 16 x 16 transpose of 32-bit pairs in vector registers. Lines and k
 * past the operand's edge are zeros, so a block is always whole. A bf16 A with k along its
 * rows is not packed at all where a panel has its 32 rows and K comes in steps of 32: a tile
 * load takes any row stride, so its tiles load from where A lies.
 *
 * The tile unit needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM), asked once;
 * without it, without the CPU feature or with FP8C_CPU_AMX=0 the driver uses its f32 path. */
#define _GNU_SOURCE
#include "ref_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif

/* bf16 codes of every e4m3 and e5m2 value (exact; numerics.c's decoders, top halves). Both
 * formats are sign and magnitude, so a negative code's bf16 is its magnitude's with the sign
 * bit set, and the vector lookup (bf16_load) needs only the first 128 entries. */
static uint16_t fp8_bf16[2][256] __attribute__((aligned(64)));

static void fill_fp8_bf16(void)
{
    for (int q = 0; q < 256; q++)
        for (int f = 0; f < 2; f++) {
            float v = f ? num_e5m2_to_f32((uint8_t)q) : num_e4m3_to_f32((uint8_t)q);
            uint32_t u;
            memcpy(&u, &v, sizeof u);
            IR_ASSERT((u & 0xFFFF) == 0);   /* the value is a bf16 */
            fp8_bf16[f][q] = (uint16_t)(u >> 16);
        }
    for (int q = 0; q < 128; q++)
        for (int f = 0; f < 2; f++)
            if (!isnan(num_bf16_to_f32(fp8_bf16[f][q])))
                IR_ASSERT(fp8_bf16[f][q | 0x80] == (fp8_bf16[f][q] | 0x8000));
}

bool cpu_tile_operand(ElemType e) { return e == FMT_BF16 || e == FMT_E4M3 || e == FMT_E5M2; }

static int amx_state = -1;   /* -1 not yet asked, 0 off, 1 on */
static bool amx_granted;

static bool amx_probe(void)
{
#ifdef HAVE_AMX
    __builtin_cpu_init();
    /* CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE; AVX-512 for the packing */
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!(d & (1u << 22)) || !(d & (1u << 24)) || !__builtin_cpu_supports("avx512f") ||
        !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl"))
        return false;
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
}

bool cpu_tile_usable(void)
{
    if (amx_state < 0) {
        amx_granted = amx_probe();
        const char *env = getenv("FP8C_CPU_AMX");
        amx_state = amx_granted && !(env && strcmp(env, "0") == 0);
        fill_fp8_bf16();
    }
    return amx_state == 1;
}

bool cpu_gemm_use_amx(bool on)
{
    cpu_tile_usable();
    amx_state = on && amx_granted;
    return amx_state == 1;
}

#ifdef HAVE_AMX
/* n (<= 32) consecutive elements of o from `at` as bf16 codes, zeros after them up to 32 */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline __m512i
bf16_load(const RtGemmOperand *o, int64_t at, int64_t n)
{
    if (o->elem == FMT_BF16) {
        __mmask32 live = n >= 32 ? ~0u : (1u << n) - 1;
        return _mm512_maskz_loadu_epi16(live, (const uint16_t *)o->data + at);
    }
    /* FP8: the magnitude's 7 bits look up one of four 32-entry quarters of the table (two
     * two-register permutes, then a blend on bit 6), and the sign bit moves to bit 15; a NaN
     * code stays a NaN (its sign aside). Lanes past n load zero, which decodes to +0. */
    const uint16_t *table = fp8_bf16[o->elem == FMT_E5M2];
    __m512i q0 = _mm512_load_si512(table), q1 = _mm512_load_si512(table + 32);
    __m512i q2 = _mm512_load_si512(table + 64), q3 = _mm512_load_si512(table + 96);
    __mmask32 live = n >= 32 ? ~0u : (1u << n) - 1;
    __m512i code = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(live, (const uint8_t *)o->data + at));
    __m512i mag = _mm512_and_si512(code, _mm512_set1_epi16(0x7F));
    __m512i low = _mm512_permutex2var_epi16(q0, mag, q1), high = _mm512_permutex2var_epi16(q2, mag, q3);
    __mmask32 upper = _mm512_test_epi16_mask(mag, _mm512_set1_epi16(0x40));
    __m512i v = _mm512_mask_blend_epi16(upper, low, high);
    __m512i sign = _mm512_slli_epi16(_mm512_and_si512(code, _mm512_set1_epi16(0x80)), 8);
    return _mm512_or_si512(v, sign);
}

/* C's block (ni x nj at c, row stride ldc) = alpha out, or += alpha out with add; out is a
 * 32 x 32 block from cpu_tile_block */
__attribute__((target("avx512f"))) void cpu_tile_store(const float *out, float *c, int64_t ldc,
                                                       int64_t ni, int64_t nj, float alpha, bool add)
{
    __m512 a = _mm512_set1_ps(alpha);
    __mmask16 m0 = nj >= 16 ? 0xFFFF : (__mmask16)((1u << nj) - 1);
    __mmask16 m1 = nj >= 32 ? 0xFFFF : nj <= 16 ? 0 : (__mmask16)((1u << (nj - 16)) - 1);
    for (int64_t r = 0; r < ni; r++, c += ldc, out += TILE_LINES) {
        __m512 x0 = _mm512_mul_ps(a, _mm512_load_ps(out)), x1 = _mm512_mul_ps(a, _mm512_load_ps(out + 16));
        if (add) {
            x0 = _mm512_add_ps(x0, _mm512_maskz_loadu_ps(m0, c));
            x1 = _mm512_add_ps(x1, _mm512_maskz_loadu_ps(m1, c + 16));
        }
        _mm512_mask_storeu_ps(c, m0, x0);
        _mm512_mask_storeu_ps(c + 16, m1, x1);
    }
}

/* dst[c * ldd + r] = src[r * lds + c] for r, c < 16, 32-bit elements: the rows interleaved in
 * pairs, then pairs of pairs, then 128-bit lanes in two rounds. */
__attribute__((target("avx512f"))) static void transpose16(const uint32_t *src, int64_t lds,
                                                           uint32_t *dst, int64_t ldd)
{
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * lds);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4q + j] holds, in lane L (128 bits), column 4L + j of rows 4q..4q+3 */
    for (int j = 0; j < 4; j++) {
        __m512i a = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);       /* lanes 0, 2 of each */
        __m512i b = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);       /* lanes 1, 3 */
        __m512i c = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
        __m512i d = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
        t[j] = _mm512_shuffle_i32x4(a, c, 0x88);        /* column j */
        t[8 + j] = _mm512_shuffle_i32x4(a, c, 0xDD);    /* column 8 + j */
        t[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);    /* column 4 + j */
        t[12 + j] = _mm512_shuffle_i32x4(b, d, 0xDD);   /* column 12 + j */
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + i * ldd, t[i]);
}

/* dst[l] = a[l] | b[l] << 16 for l < 32: two rows of k, paired, in registers (through a
 * stack buffer, a weight gradient's packing ran 5% slower) */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline void interleave(__m512i a, __m512i b,
                                                                                        uint32_t *dst)
{
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                           40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                           32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, first, b));
    _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi16(a, second, b));
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void
cpu_tile_pack(const RtGemmOperand *o, int64_t at, int64_t ld, bool k_fast, int64_t lines, int64_t kc,
              bool as_b, uint32_t *dst)
{
    uint32_t stage[32 * 16] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < kc; k0 += 32, dst += TILE_STEP_WORDS) {
        int64_t depth = kc - k0 < 32 ? kc - k0 : 32;
        if (k_fast) {   /* line l's 32 k lie together: [line][pair] */
            uint32_t *out = as_b ? stage : dst;
            for (int64_t l = 0; l < 32; l++)
                _mm512_storeu_si512(out + l * 16, bf16_load(o, at + l * ld + k0, l < lines ? depth : 0));
            if (as_b) {
                transpose16(stage, 16, dst, 32);
                transpose16(stage + 16 * 16, 16, dst + 16, 32);
            }
        } else {        /* each k's 32 lines lie together: rows 2p and 2p + 1 make [pair][line] */
            uint32_t *out = as_b ? dst : stage;
            for (int64_t p = 0; p < 16; p++) {
                int64_t k = k0 + 2 * p;
                interleave(bf16_load(o, at + k * ld, 2 * p < depth ? lines : 0),
                           bf16_load(o, at + (k + 1) * ld, 2 * p + 1 < depth ? lines : 0), out + p * 32);
            }
            if (!as_b) {
                transpose16(stage, 32, dst, 16);
                transpose16(stage + 16, 32, dst + 16 * 16, 16);
            }
        }
    }
}

/* The tile configuration (palette 1): eight tiles of 16 rows x 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* static: GCC 12 drops stores into a local configuration that only LDTILECFG reads */
static const TileConfig tile_config = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

__attribute__((target("amx-tile"))) void cpu_tile_begin(void) { _tile_loadconfig(&tile_config); }

__attribute__((target("amx-tile"))) void cpu_tile_end(void) { _tile_release(); }

/* The four C tiles of a 32 x 32 block at c (row stride ldc): loaded (add) or zeroed; stored. */
__attribute__((target("amx-tile"), always_inline)) static inline void c_tiles_begin(float *c, int64_t ldc, bool add)
{
    int64_t stride = ldc * (int64_t)sizeof(float);
    if (add) {
        _tile_loadd(0, c, stride);
        _tile_loadd(1, c + 16, stride);
        _tile_loadd(2, c + 16 * ldc, stride);
        _tile_loadd(3, c + 16 * ldc + 16, stride);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
}

__attribute__((target("amx-tile"), always_inline)) static inline void c_tiles_store(float *c, int64_t ldc)
{
    int64_t stride = ldc * (int64_t)sizeof(float);
    _tile_stored(0, c, stride);
    _tile_stored(1, c + 16, stride);
    _tile_stored(2, c + 16 * ldc, stride);
    _tile_stored(3, c + 16 * ldc + 16, stride);
}

/* c (32 x 32 f32, row stride ldc) = (or += with add) A times a B panel over `steps` steps of 32
 * k: the GEMM's block, its loop over k kept to its loads and products (through
 * cpu_tile_panels' general loop a K = 2048 GEMM ran 7% slower). A is a packed panel (a_ld = 0)
 * or bf16 rows a_ld elements apart, read where they lie (cpu_tile_panels says how). */
__attribute__((target("amx-tile,amx-bf16"))) void cpu_tile_block(int64_t steps, const void *a, int64_t a_ld,
                                                                 const uint32_t *b, float *c, int64_t ldc,
                                                                 bool add)
{
    int64_t a_stride = a_ld ? a_ld * 2 : 64, a_step = a_ld ? 64 : TILE_STEP_WORDS * 4;
    const char *ab = a;
    c_tiles_begin(c, ldc, add);
    for (int64_t s = 0; s < steps; s++, ab += a_step, b += TILE_STEP_WORDS) {
        _tile_loadd(4, ab, a_stride);
        _tile_loadd(5, ab + 16 * a_stride, a_stride);
        _tile_loadd(6, b, 128);
        _tile_loadd(7, b + 16, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    c_tiles_store(c, ldc);
}

/* A row of 32 x 32 blocks: block p of c (c + 32 p, row stride ldc) = (or += with add) A times
 * B panel p (b + p b_panel), over `steps` steps of 32 k, for p < panels: C tiles 0-3 (rows
 * 0-15 | 16-31 x columns 0-15 | 16-31), A tiles 4-5, B tiles 6-7. A tile is 16 rows of 32
 * bf16 (64 bytes) at any row stride: a packed A panel (a_ld = 0) has its rows 64 bytes apart
 * and its steps TILE_STEP_WORDS words apart; bf16 rows of A itself (a_ld elements apart) are
 * loaded where they lie, a step 32 elements along them. A may come as `terms` planes (a_plane
 * elements apart) whose products add up in the tiles: attention's three-term split operands.
 * With one step of one term the A tiles stay loaded across the blocks. */
__attribute__((target("amx-tile,amx-bf16"))) void cpu_tile_panels(int64_t panels, int64_t steps,
                                                                  const void *a, int64_t a_ld,
                                                                  int64_t a_plane, int terms,
                                                                  const uint32_t *b, int64_t b_panel,
                                                                  float *c, int64_t ldc, bool add)
{
    int64_t a_stride = a_ld ? a_ld * 2 : 64, a_step = a_ld ? 64 : TILE_STEP_WORDS * 4;
    const char *ab = a;
    bool keep_a = steps == 1 && terms == 1;
    if (keep_a) {
        _tile_loadd(4, ab, a_stride);
        _tile_loadd(5, ab + 16 * a_stride, a_stride);
    }
    for (int64_t p = 0; p < panels; p++, b += b_panel, c += TILE_LINES) {
        c_tiles_begin(c, ldc, add);
        const uint32_t *bs = b;
        const char *as = ab;
        for (int64_t s = 0; s < steps; s++, bs += TILE_STEP_WORDS, as += a_step) {
            _tile_loadd(6, bs, 128);
            _tile_loadd(7, bs + 16, 128);
            for (int t = 0; t < terms; t++) {
                if (!keep_a) {
                    const char *at = as + 2 * t * a_plane;
                    _tile_loadd(4, at, a_stride);
                    _tile_loadd(5, at + 16 * a_stride, a_stride);
                }
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        c_tiles_store(c, ldc);
    }
}
#else   /* cpu_tile_usable() is false: the driver never calls these */
void cpu_tile_block(int64_t steps, const void *a, int64_t a_ld, const uint32_t *b, float *c, int64_t ldc,
                    bool add)
{
    (void)steps, (void)a, (void)a_ld, (void)b, (void)c, (void)ldc, (void)add;
    IR_ASSERT(!"AMX without AMX");
}
void cpu_tile_panels(int64_t panels, int64_t steps, const void *a, int64_t a_ld, int64_t a_plane,
                     int terms, const uint32_t *b, int64_t b_panel, float *c, int64_t ldc, bool add)
{
    (void)panels, (void)steps, (void)a, (void)a_ld, (void)a_plane, (void)terms, (void)b,
        (void)b_panel, (void)c, (void)ldc, (void)add;
    IR_ASSERT(!"AMX without AMX");
}
void cpu_tile_pack(const RtGemmOperand *o, int64_t at, int64_t ld, bool k_fast, int64_t lines,
                   int64_t kc, bool as_b, uint32_t *dst)
{
    (void)o, (void)at, (void)ld, (void)k_fast, (void)lines, (void)kc, (void)as_b, (void)dst;
    IR_ASSERT(!"AMX without AMX");
}
void cpu_tile_begin(void) { IR_ASSERT(!"AMX without AMX"); }
void cpu_tile_store(const float *out, float *c, int64_t ldc, int64_t ni, int64_t nj, float alpha, bool add)
{
    (void)out, (void)c, (void)ldc, (void)ni, (void)nj, (void)alpha, (void)add;
    IR_ASSERT(!"AMX without AMX");
}
void cpu_tile_end(void) {}
#endif
