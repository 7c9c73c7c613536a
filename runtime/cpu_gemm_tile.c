/* cpu_gemm_tile.c — the CPU GEMM's tile path, for operands whose values bf16 holds: 32 x 32
 * blocks of C from bf16 pairs, on Intel AMX tiles or on AVX512-BF16 dot products.
 *
 * bf16, e4m3 and e5m2 values are all exact in bf16 (FP8's few mantissa bits and narrow
 * exponents fit inside bf16's), so a GEMM whose operands are stored in those formats can
 * multiply bf16 pairs instead of widening every element to f32 for the vector units' FMAs.
 * Two kinds of hardware do that, and this file drives either over the same packed panels:
 *   amx      AMX's bf16 tile unit (TDPBF16PS: a 16 x 32 by 32 x 16 product added into 16 x 16
 *            f32 sums, 1024 multiply-adds a cycle), on Intel CPUs from Sapphire Rapids on;
 *   bf16dot  AVX512-BF16's VDPBF16PS (16 f32 lanes, each adding the products of a pair of
 *            bf16 — 32 multiply-adds an instruction, twice what an f32 FMA does), on CPUs
 *            that have it but no usable AMX: AMD Zen 4 and later, Intel Cooper Lake.
 * Where the CPU has neither (or FP8C_CPU_TILES=off) the driver keeps its f32 path.
 *
 * Numerics. The products of two bf16 are exact in f32 and the sums are f32, as on the f32
 * path; only the order of the additions differs (k goes in by pairs; on the dot path each
 * product of a pair is its own rounded addition, the odd k's first, as Intel describes the
 * instruction and as measured on AMD Zen 4). Two things the f32 path does not do: both units
 * treat subnormal inputs as zero and flush subnormal results to zero (below 2^-126, far under
 * any value a training step carries; the dot instruction does so whatever MXCSR says, on AMD
 * Zen 4 too: measured there, a subnormal bf16 input, a subnormal sum it adds to and a product
 * or sum that falls below 2^-126 all give 0), and a per-tensor scale is applied once to the
 * sum (C = sum(a b) / (sa sb)) rather than to every element, which is what FP8 GEMM units do.
 *
 * cpu_gemm.c keeps the driver — tasks, K blocks, panels packed by the first task that needs
 * them — and calls this file to pack a panel and to multiply a 32 x 32 block of C. A panel is
 * 32 lines (rows of op(A), or columns of op(B)) by the K block's depth, as bf16 pairs (the
 * units' 32-bit elements hold two consecutive k), in steps of 32 k:
 *   A panel, step s: [line 0..31][pair 0..15]  — two A tiles, lines 0-15 and 16-31
 *   B panel, step s: [pair 0..15][line 0..31]  — two B tiles, columns 0-15 and 16-31
 * An operand stored with k along its rows (A, or B read transposed) gives the first order as
 * it lies; one stored with k down its columns gives the second by interleaving two rows. The
 * other combination is a 16 x 16 transpose of 32-bit pairs in vector registers, for an A
 * panel on AMX only: the dot path reads A a word at a time, and takes such a panel in the
 * second order as it comes (TILE_A_PAIRS). Lines and k past the operand's edge are zeros, so
 * a block is always whole. A bf16 A with k along its rows is not packed at all where a panel
 * has its 32 rows and K comes in steps of 32: a tile load takes any row stride, and the dot
 * path reads A one pair at a time anyway, so both load A from where it lies.
 *
 * The same layout suits the dot path as it is: a B panel's pair p is two vector registers
 * (its 32 columns), and A's pair (i, p) one 32-bit word broadcast to 16 lanes, so a block is
 * acc[i][h] += A[i][p] . B[p][16 h .. 16 h + 15] over i, h and p. The 64 vector sums of a
 * 32 x 32 block do not fit in 32 registers, so the block is swept in chunks of 12, 12 and 8
 * rows (24 sums in registers, two for B's pair, one for the broadcast), each over the whole
 * depth of the call, as a BLIS micro-kernel sweeps its panel: B's panel is read three times
 * from L1 or L2, and each pair's two loads feed 24 dot products. That runs near the unit's
 * rate: on Zen 4, whole GEMMs of gpt2_tiny's shapes (2048 x 512 x 128, 2048 x 128 x 512) at
 * 218 - 229 GFLOP/s a core, against 109 - 113 on the f32 path.
 *
 * The tile unit needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM), asked once.
 * The implementation is chosen once, by CPUID: AMX where the CPU has it and the kernel grants
 * it, else bf16dot where the CPU has AVX512-BF16 (with AVX512F, BW and VL for the packing),
 * else none. FP8C_CPU_TILES=amx|bf16dot|off picks one (a path the CPU lacks is reported on
 * stderr, and the f32 path runs); FP8C_CPU_AMX=0, the older switch, means off. */
#define _GNU_SOURCE
#include "ref_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_TILES 1
#endif
#if defined(HAVE_TILES) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1      /* the kernel's permission is asked through arch_prctl */
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

/* An A panel packed from an operand with k along its lines lies [line][pair], as both units
 * read it. One packed from an operand with k down its columns comes out of the pairing of two
 * rows as [pair][line]; AMX's tile loads need it transposed, the dot path broadcasts A's words
 * from wherever they are and takes it as it is (a weight gradient's dy^T: the transposes were
 * about half of its packing). */
int64_t cpu_tile_a_layout(bool k_fast)
{
    return k_fast || cpu_tiles() == CPU_TILES_AMX ? TILE_A_PACKED : TILE_A_PAIRS;
}

/* ---------------------------------------------------------------- which implementation */

static const char *const tiles_names[] = {"off", "bf16dot", "amx"};
static bool tiles_have[3];              /* per CpuTiles: the CPU (and the kernel) allow it */
static int tiles_on = -1;               /* the CpuTiles in use; -1 before the first question */

static bool amx_probe(void)
{
#ifdef HAVE_AMX
    /* CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE */
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
}

/* What the CPU has, then FP8C_CPU_TILES (or the older FP8C_CPU_AMX=0): the implementation. A
 * name this file does not know is an error of the user's, one line and exit status 2; a path
 * the CPU lacks is said once on stderr and the f32 path runs, so that a timing taken with
 * FP8C_CPU_TILES=amx is never silently one of the dot path. */
static void tiles_init(void)
{
    fill_fp8_bf16();
    tiles_have[CPU_TILES_OFF] = true;
#ifdef HAVE_TILES
    __builtin_cpu_init();
    /* AVX-512 F, BW and VL for the packing, on either path */
    bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl");
    tiles_have[CPU_TILES_BF16DOT] = avx512 && __builtin_cpu_supports("avx512bf16");
    tiles_have[CPU_TILES_AMX] = avx512 && amx_probe();
#endif
    tiles_on = tiles_have[CPU_TILES_AMX] ? CPU_TILES_AMX : tiles_have[CPU_TILES_BF16DOT] ? CPU_TILES_BF16DOT
                                                                                        : CPU_TILES_OFF;
    const char *want = getenv("FP8C_CPU_TILES"), *old = getenv("FP8C_CPU_AMX");
    if (want && *want && strcmp(want, "auto") != 0) {
        int t = 0;
        while (t < 3 && strcmp(want, tiles_names[t]) != 0) t++;
        if (t == 3) {
            fprintf(stderr, "fp8c: FP8C_CPU_TILES=%s: expected amx, bf16dot, off or auto\n", want);
            exit(2);
        }
        if (!tiles_have[t])
            fprintf(stderr, "fp8c: FP8C_CPU_TILES=%s: %s; the tile path is off\n", want,
                    t == CPU_TILES_AMX ? "this CPU has no AMX, or the kernel does not allow it"
                                       : "this CPU has no AVX512-BF16");
        tiles_on = tiles_have[t] ? t : CPU_TILES_OFF;
    } else if (old && strcmp(old, "0") == 0) {
        tiles_on = CPU_TILES_OFF;
    }
}

CpuTiles cpu_tiles(void)
{
    if (tiles_on < 0) tiles_init();
    return (CpuTiles)tiles_on;
}

bool cpu_tile_usable(void) { return cpu_tiles() != CPU_TILES_OFF; }

bool cpu_tiles_select(CpuTiles t)
{
    cpu_tiles();
    tiles_on = tiles_have[t] ? t : CPU_TILES_OFF;
    return tiles_on == (int)t;
}

const char *cpu_tiles_name(CpuTiles t) { return tiles_names[t]; }

#ifdef HAVE_TILES
/* ---------------------------------------------------------------- packing, shared */

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
__attribute__((target("avx512f"))) void cpu_tile_transpose16(const uint32_t *src, int64_t lds, uint32_t *dst,
                                                            int64_t ldd)
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
    /* pairs of rows of k (k down the columns) go out as [pair][line] as they are made */
    bool pairs = as_b || cpu_tile_a_layout(false) == TILE_A_PAIRS;
    for (int64_t k0 = 0; k0 < kc; k0 += 32, dst += TILE_STEP_WORDS) {
        int64_t depth = kc - k0 < 32 ? kc - k0 : 32;
        if (k_fast) {   /* line l's 32 k lie together: [line][pair] */
            uint32_t *out = as_b ? stage : dst;
            for (int64_t l = 0; l < 32; l++)
                _mm512_storeu_si512(out + l * 16, bf16_load(o, at + l * ld + k0, l < lines ? depth : 0));
            if (as_b) {
                cpu_tile_transpose16(stage, 16, dst, 32);
                cpu_tile_transpose16(stage + 16 * 16, 16, dst + 16, 32);
            }
        } else {        /* each k's 32 lines lie together: rows 2p and 2p + 1 make [pair][line] */
            uint32_t *out = pairs ? dst : stage;
            for (int64_t p = 0; p < 16; p++) {
                int64_t k = k0 + 2 * p;
                interleave(bf16_load(o, at + k * ld, 2 * p < depth ? lines : 0),
                           bf16_load(o, at + (k + 1) * ld, 2 * p + 1 < depth ? lines : 0), out + p * 32);
            }
            if (!pairs) {
                cpu_tile_transpose16(stage, 32, dst, 16);
                cpu_tile_transpose16(stage + 16, 32, dst + 16 * 16, 16);
            }
        }
    }
}

/* ---------------------------------------------------------------- amx: the tile unit */

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

__attribute__((target("amx-tile"))) static void amx_begin(void) { _tile_loadconfig(&tile_config); }

__attribute__((target("amx-tile"))) static void amx_end(void) { _tile_release(); }

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
 * amx_panels' general loop a K = 2048 GEMM ran 7% slower). A is a packed panel (a_ld = 0)
 * or bf16 rows a_ld elements apart, read where they lie (amx_panels says how). */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_block(int64_t steps, const void *a, int64_t a_ld,
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
 * loaded where they lie, a step 32 elements along them. With one step the A tiles stay loaded
 * across the blocks. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_panels(int64_t panels, int64_t steps,
                                                                    const void *a, int64_t a_ld,
                                                                    const uint32_t *b, int64_t b_panel,
                                                                    float *c, int64_t ldc, bool add)
{
    int64_t a_stride = a_ld ? a_ld * 2 : 64, a_step = a_ld ? 64 : TILE_STEP_WORDS * 4;
    const char *ab = a;
    bool keep_a = steps == 1;
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
            if (!keep_a) {
                _tile_loadd(4, as, a_stride);
                _tile_loadd(5, as + 16 * a_stride, a_stride);
            }
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        c_tiles_store(c, ldc);
    }
}

/* ---------------------------------------------------------------- bf16dot: AVX512-BF16 */

enum { DOT_CHUNK = 12 };   /* rows a chunk: 24 sums, B's pair and a broadcast in 32 registers */

/* Rows 0 .. R - 1 of a block (R <= DOT_CHUNK, a constant wherever this is inlined, so that the
 * sums are registers: an array indexed in a loop would live on the stack): c (row stride ldc)
 * = (or += with add) the sum over `steps` steps of 32 k of A's pairs times B's. Row i's
 * pair p of step s is the 32-bit word at a + s a_step + i a_stride + 4 p (bytes); B's pair p
 * of step s the 32 columns at b + s TILE_STEP_WORDS + 32 p. A's pair is the operand VDPBF16PS
 * can broadcast from memory (GCC 12 broadcasts it with
 * an instruction of its own, which the loop's rate does not show). */
__attribute__((target("avx512f,avx512bf16"), always_inline)) static inline void
dot_rows(const int R, int64_t steps, const char *a, int64_t a_stride, int64_t a_pair, int64_t a_step, const uint32_t *b,
         float *c, int64_t ldc, bool add)
{
    __m512 acc[DOT_CHUNK][2];
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) {
        acc[i][0] = add ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();
        acc[i][1] = add ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t s = 0; s < steps; s++, a += a_step, b += TILE_STEP_WORDS) {
#pragma GCC unroll 2
        for (int p = 0; p < 16; p++) {
            __m512bh b0 = (__m512bh)_mm512_load_si512(b + 32 * p);
            __m512bh b1 = (__m512bh)_mm512_load_si512(b + 32 * p + 16);
            const char *at = a + p * a_pair;
#pragma GCC unroll 12
            for (int i = 0; i < R; i++) {
                int32_t w;
                memcpy(&w, at + i * a_stride, sizeof w);
                __m512bh ai = (__m512bh)_mm512_set1_epi32(w);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], b0, ai);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], b1, ai);
            }
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) {
        _mm512_storeu_ps(c + i * ldc, acc[i][0]);
        _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);
    }
}

/* A whole 32 x 32 block: rows 0-11, 12-23 and 24-31, each over the whole depth */
__attribute__((target("avx512f,avx512bf16"), always_inline)) static inline void
dot_sweep(int64_t steps, const char *a, int64_t a_stride, int64_t a_pair, int64_t a_step, const uint32_t *b, float *c,
          int64_t ldc, bool add)
{
    dot_rows(DOT_CHUNK, steps, a, a_stride, a_pair, a_step, b, c, ldc, add);
    dot_rows(DOT_CHUNK, steps, a + DOT_CHUNK * a_stride, a_stride, a_pair, a_step, b, c + DOT_CHUNK * ldc, ldc, add);
    dot_rows(TILE_LINES - 2 * DOT_CHUNK, steps, a + 2 * DOT_CHUNK * a_stride, a_stride, a_pair, a_step, b,
             c + 2 * DOT_CHUNK * ldc, ldc, add);
}

/* dot_sweep over A in any of its layouts (cpu_tile_block's a_ld): the strides are constants in
 * each call, which the addressing folds in */
__attribute__((target("avx512f,avx512bf16"), always_inline)) static inline void
dot_sweep_any(int64_t steps, const void *a, int64_t a_ld, const uint32_t *b, float *c, int64_t ldc, bool add)
{
    if (a_ld == TILE_A_PACKED) dot_sweep(steps, a, 64, 4, TILE_STEP_WORDS * 4, b, c, ldc, add);
    else if (a_ld == TILE_A_PAIRS) dot_sweep(steps, a, 4, 4 * TILE_LINES, TILE_STEP_WORDS * 4, b, c, ldc, add);
    else dot_sweep(steps, a, 2 * a_ld, 4, 64, b, c, ldc, add);
}

/* amx_block's contract, and A may also be a [pair][line] panel (TILE_A_PAIRS) */
__attribute__((target("avx512f,avx512bf16"))) static void dot_block(int64_t steps, const void *a, int64_t a_ld,
                                                                  const uint32_t *b, float *c, int64_t ldc,
                                                                  bool add)
{
    dot_sweep_any(steps, a, a_ld, b, c, ldc, add);
}

/* amx_panels' contract: the blocks one after another */
__attribute__((target("avx512f,avx512bf16"))) static void dot_panels(int64_t panels, int64_t steps,
                                                                   const void *a, int64_t a_ld,
                                                                   const uint32_t *b, int64_t b_panel,
                                                                   float *c, int64_t ldc, bool add)
{
    for (int64_t p = 0; p < panels; p++, b += b_panel, c += TILE_LINES) dot_sweep_any(steps, a, a_ld, b, c, ldc, add);
}

/* ---------------------------------------------------------------- the block operations */

void cpu_tile_begin(void)
{
    if (tiles_on == CPU_TILES_AMX) amx_begin();
}

void cpu_tile_end(void)
{
    if (tiles_on == CPU_TILES_AMX) amx_end();
}

void cpu_tile_block(int64_t steps, const void *a, int64_t a_ld, const uint32_t *b, float *c, int64_t ldc,
                    bool add)
{
    IR_ASSERT(a_ld >= 0 || tiles_on != CPU_TILES_AMX);
    if (tiles_on == CPU_TILES_AMX) amx_block(steps, a, a_ld, b, c, ldc, add);
    else dot_block(steps, a, a_ld, b, c, ldc, add);
}

void cpu_tile_panels(int64_t panels, int64_t steps, const void *a, int64_t a_ld, const uint32_t *b, int64_t b_panel,
                     float *c, int64_t ldc, bool add)
{
    IR_ASSERT(a_ld >= 0 || tiles_on != CPU_TILES_AMX);
    if (tiles_on == CPU_TILES_AMX) amx_panels(panels, steps, a, a_ld, b, b_panel, c, ldc, add);
    else dot_panels(panels, steps, a, a_ld, b, b_panel, c, ldc, add);
}
#else   /* cpu_tile_usable() is false: the driver never calls these */
void cpu_tile_block(int64_t steps, const void *a, int64_t a_ld, const uint32_t *b, float *c, int64_t ldc,
                    bool add)
{
    (void)steps, (void)a, (void)a_ld, (void)b, (void)c, (void)ldc, (void)add;
    IR_ASSERT(!"the tile path without its instructions");
}
void cpu_tile_panels(int64_t panels, int64_t steps, const void *a, int64_t a_ld, const uint32_t *b, int64_t b_panel,
                     float *c, int64_t ldc, bool add)
{
    (void)panels, (void)steps, (void)a, (void)a_ld, (void)b, (void)b_panel, (void)c, (void)ldc, (void)add;
    IR_ASSERT(!"the tile path without its instructions");
}
void cpu_tile_pack(const RtGemmOperand *o, int64_t at, int64_t ld, bool k_fast, int64_t lines,
                   int64_t kc, bool as_b, uint32_t *dst)
{
    (void)o, (void)at, (void)ld, (void)k_fast, (void)lines, (void)kc, (void)as_b, (void)dst;
    IR_ASSERT(!"the tile path without its instructions");
}
void cpu_tile_begin(void) { IR_ASSERT(!"the tile path without its instructions"); }
void cpu_tile_store(const float *out, float *c, int64_t ldc, int64_t ni, int64_t nj, float alpha, bool add)
{
    (void)out, (void)c, (void)ldc, (void)ni, (void)nj, (void)alpha, (void)add;
    IR_ASSERT(!"the tile path without its instructions");
}
void cpu_tile_end(void) {}
#endif
