/* ref_gemm.c — matrix multiplication for the reference executor.
 *
 * Most of a CPU training step is GEMM, so this is a small packed GEMM in the usual shape
 * (GotoBLAS/BLIS): for each block of KC along K, op(B) is packed into column panels of NR,
 * each task packs an MR-row panel of op(A), and a register-blocked micro-kernel carries an
 * MR x NR tile of C through the block. Packing absorbs the four transpose combinations, so the
 * kernel sees one layout; blocking K keeps the packed B in cache when K is long (the weight
 * gradients, where K is every token of the batch).
 *
 * Accumulation is in f64, one running sum per output element, in k order: a tile that spans
 * several K blocks is parked in an f64 buffer between blocks and resumed, never summed from
 * zero per block, so the result is exactly sum_k a_ik b_kj added left to right. The product of
 * two f32 values is exact in f64, so a fused multiply-add gives the same bits as a multiply and
 * an add: the ISA clones of the kernel (AVX2+FMA, baseline) and any thread count give
 * identical results, and so do the 6 x 8 and 12 x 8 tiles. Work is split by row panels of C;
 * a tile never depends on another.
 * Padding rows and columns of the panels are zeros and their outputs are dropped. */
#include "ref_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* MR rows x NR columns per register tile: 6 x 8 in twelve 4-wide registers, or, where AVX-512
 * is present, 12 x 8 in twelve 8-wide ones (chosen at run time; the sums are the same). */
enum { MR = 6, MR_WIDE = 12, NR = 8, KC = 512 };

typedef double v4d __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GEMM_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define GEMM_CLONES
#endif

/* c (MR x NR) = (resume ? c : 0) + sum over k of ap[k] (MR) outer bp[k] (NR). The twelve
 * accumulators are spelled out so that they live in registers (GCC at -O2 keeps an
 * accumulator array in memory). */
GEMM_CLONES
static void gemm_kernel(int64_t K, const double *restrict ap, const double *restrict bp,
                        double *restrict c, bool resume)
{
    v4d acc[MR][NR / 4];
    if (resume) memcpy(acc, c, sizeof acc);
    else memset(acc, 0, sizeof acc);
    v4d c00 = acc[0][0], c01 = acc[0][1], c10 = acc[1][0], c11 = acc[1][1];
    v4d c20 = acc[2][0], c21 = acc[2][1], c30 = acc[3][0], c31 = acc[3][1];
    v4d c40 = acc[4][0], c41 = acc[4][1], c50 = acc[5][0], c51 = acc[5][1];
    for (int64_t k = 0; k < K; k++) {
        v4d b0, b1;
        memcpy(&b0, bp + k * NR, sizeof b0);
        memcpy(&b1, bp + k * NR + 4, sizeof b1);
        const double *a = ap + k * MR;
        c00 += a[0] * b0, c01 += a[0] * b1;
        c10 += a[1] * b0, c11 += a[1] * b1;
        c20 += a[2] * b0, c21 += a[2] * b1;
        c30 += a[3] * b0, c31 += a[3] * b1;
        c40 += a[4] * b0, c41 += a[4] * b1;
        c50 += a[5] * b0, c51 += a[5] * b1;
    }
    v4d out[MR][NR / 4] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    memcpy(c, out, sizeof out);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HAVE_WIDE_KERNEL 1
/* The 12 x 8 kernel: each row of the tile is one 8-wide register. */
__attribute__((target("arch=x86-64-v4")))
static void gemm_kernel_wide(int64_t K, const double *restrict ap, const double *restrict bp,
                             double *restrict c, bool resume)
{
    v8d acc[MR_WIDE];
    if (resume) memcpy(acc, c, sizeof acc);
    else memset(acc, 0, sizeof acc);
    v8d c0 = acc[0], c1 = acc[1], c2 = acc[2], c3 = acc[3], c4 = acc[4], c5 = acc[5];
    v8d c6 = acc[6], c7 = acc[7], c8 = acc[8], c9 = acc[9], c10 = acc[10], c11 = acc[11];
    for (int64_t k = 0; k < K; k++) {
        v8d b;
        memcpy(&b, bp + k * NR, sizeof b);
        const double *a = ap + k * MR_WIDE;
        c0 += a[0] * b, c1 += a[1] * b, c2 += a[2] * b, c3 += a[3] * b;
        c4 += a[4] * b, c5 += a[5] * b, c6 += a[6] * b, c7 += a[7] * b;
        c8 += a[8] * b, c9 += a[9] * b, c10 += a[10] * b, c11 += a[11] * b;
    }
    v8d out[MR_WIDE] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
    memcpy(c, out, sizeof out);
}

static int forced_rows;

static int gemm_rows_per_tile(void)
{
    static int mr;
    if (!mr) mr = __builtin_cpu_supports("avx512f") ? MR_WIDE : MR;
    return forced_rows == MR ? MR : mr;
}

void ref_gemm_set_tile_rows(int rows) { forced_rows = rows; }
#else
#define HAVE_WIDE_KERNEL 0
static void gemm_kernel_wide(int64_t K, const double *ap, const double *bp, double *c,
                             bool resume)
{
    (void)K, (void)ap, (void)bp, (void)c, (void)resume;
    IR_ASSERT(!"no wide kernel");
}
static int gemm_rows_per_tile(void) { return MR; }
void ref_gemm_set_tile_rows(int rows) { (void)rows; }
#endif

typedef struct {
    int64_t M, N, K, lda, ldb;
    int64_t mr;             /* rows of the register tile: MR or MR_WIDE */
    const float *A, *B;
    bool ta, tb;
    int64_t k0, kl;         /* the block of K in work */
    float *C;               /* ref_gemm: the f32 result (M, N), written after the last block */
    double *sums;           /* ref_gemm with several K blocks: running sums (M, N) between them */
    double *Cd;             /* ref_gemm_f64: the f64 result, row stride ldd, set or added to */
    int64_t ldd;
    bool add;
    double *bpack;          /* ceil(N/NR) panels of kl x NR */
    int64_t n_row_panels, n_col_panels, panels_per_task;
} GemmJob;

static double *alloc_doubles(int64_t n)
{
    size_t bytes = (sizeof(double) * (size_t)(n ? n : 1) + 63) & ~(size_t)63;
    double *p = aligned_alloc(64, bytes);
    IR_ASSERT(p);
    return p;
}

/* Packs op(B)[k0 .. k0+kl, j0 .. j0+NR] as kl rows of NR, reading B along its rows. */
static void gemm_pack_b(void *ctx, int64_t jp)
{
    GemmJob *j = ctx;
    double *dst = j->bpack + jp * j->kl * NR;
    int64_t j0 = jp * NR, nj = j->N - j0 < NR ? j->N - j0 : NR;
    if (nj < NR) memset(dst, 0, sizeof(double) * (size_t)(j->kl * NR));
    if (j->tb) {
        for (int64_t jj = 0; jj < nj; jj++) {
            const float *src = j->B + (j0 + jj) * j->ldb + j->k0;
            for (int64_t kk = 0; kk < j->kl; kk++) dst[kk * NR + jj] = src[kk];
        }
    } else {
        for (int64_t kk = 0; kk < j->kl; kk++) {
            const float *src = j->B + (j->k0 + kk) * j->ldb + j0;
            for (int64_t jj = 0; jj < nj; jj++) dst[kk * NR + jj] = src[jj];
        }
    }
}

/* Packs op(A)[i0 .. i0+mr, k0 .. k0+kl] as kl columns of mr, reading A along its rows. */
static void gemm_pack_a(const GemmJob *j, int64_t ip, double *ap)
{
    int64_t mr = j->mr, i0 = ip * mr, ni = j->M - i0 < mr ? j->M - i0 : mr;
    if (ni < mr) memset(ap, 0, sizeof(double) * (size_t)(j->kl * mr));
    if (j->ta) {
        for (int64_t kk = 0; kk < j->kl; kk++) {
            const float *src = j->A + (j->k0 + kk) * j->lda + i0;
            for (int64_t ii = 0; ii < ni; ii++) ap[kk * mr + ii] = src[ii];
        }
    } else {
        for (int64_t ii = 0; ii < ni; ii++) {
            const float *src = j->A + (i0 + ii) * j->lda + j->k0;
            for (int64_t kk = 0; kk < j->kl; kk++) ap[kk * mr + ii] = src[kk];
        }
    }
}

/* One tile (row panel ip, column panel jp) through the current K block. */
static void gemm_tile(const GemmJob *j, int64_t ip, int64_t jp, const double *ap)
{
    bool first = j->k0 == 0, last = j->k0 + j->kl == j->K;
    int64_t mr = j->mr, i0 = ip * mr, ni = j->M - i0 < mr ? j->M - i0 : mr;
    int64_t j0 = jp * NR, nj = j->N - j0 < NR ? j->N - j0 : NR;
    double tile[MR_WIDE * NR];
    if (!first) {   /* resume the running sums parked after the previous block */
        memset(tile, 0, sizeof tile);
        for (int64_t ii = 0; ii < ni; ii++)
            memcpy(tile + ii * NR, j->sums + (i0 + ii) * j->N + j0, sizeof(double) * (size_t)nj);
    }
    if (mr == MR_WIDE)
        gemm_kernel_wide(j->kl, ap, j->bpack + jp * j->kl * NR, tile, !first);
    else
        gemm_kernel(j->kl, ap, j->bpack + jp * j->kl * NR, tile, !first);
    for (int64_t ii = 0; ii < ni; ii++) {
        const double *t = tile + ii * NR;
        if (!last) {
            memcpy(j->sums + (i0 + ii) * j->N + j0, t, sizeof(double) * (size_t)nj);
        } else if (j->C) {
            float *c = j->C + (i0 + ii) * j->N + j0;
            for (int64_t jj = 0; jj < nj; jj++) c[jj] = (float)t[jj];
        } else if (j->add) {
            double *c = j->Cd + (i0 + ii) * j->ldd + j0;
            for (int64_t jj = 0; jj < nj; jj++) c[jj] += t[jj];
        } else {
            memcpy(j->Cd + (i0 + ii) * j->ldd + j0, t, sizeof(double) * (size_t)nj);
        }
    }
}

static bool gemm_b_fits(const GemmJob *j)
{
    return (int64_t)sizeof(double) * j->kl * NR * j->n_col_panels <= (512 << 10);
}

/* Row panels [p0, p1) through the current K block; apack has room for all of them packed.
 * When the packed B block is small it stays in cache while each A panel meets every column
 * panel; when it is large (long K times wide N, few rows) the A panels are the smaller side
 * and each B panel meets every A panel instead. The order changes no sum. */
static void gemm_panels(const GemmJob *j, int64_t p0, int64_t p1, double *apack)
{
    int64_t panel = j->kl * j->mr;
    if (gemm_b_fits(j)) {
        for (int64_t ip = p0; ip < p1; ip++) {
            gemm_pack_a(j, ip, apack);
            for (int64_t jp = 0; jp < j->n_col_panels; jp++) gemm_tile(j, ip, jp, apack);
        }
        return;
    }
    for (int64_t ip = p0; ip < p1; ip++) gemm_pack_a(j, ip, apack + (ip - p0) * panel);
    for (int64_t jp = 0; jp < j->n_col_panels; jp++)
        for (int64_t ip = p0; ip < p1; ip++) gemm_tile(j, ip, jp, apack + (ip - p0) * panel);
}

static void gemm_rows_task(void *ctx, int64_t task)
{
    GemmJob *j = ctx;
    int64_t p0 = task * j->panels_per_task;
    int64_t p1 = p0 + j->panels_per_task < j->n_row_panels ? p0 + j->panels_per_task
                                                           : j->n_row_panels;
    double *apack = alloc_doubles((gemm_b_fits(j) ? 1 : p1 - p0) * j->kl * j->mr);
    gemm_panels(j, p0, p1, apack);
    free(apack);
}

static GemmJob gemm_job(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, bool ta,
                        const float *B, int64_t ldb, bool tb)
{
    GemmJob j = {.M = M, .N = N, .K = K, .lda = lda, .ldb = ldb, .A = A, .B = B,
                 .ta = ta, .tb = tb, .mr = gemm_rows_per_tile()};
    j.n_row_panels = (M + j.mr - 1) / j.mr;
    j.n_col_panels = (N + NR - 1) / NR;
    return j;
}

void ref_gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, bool ta,
              const float *B, int64_t ldb, bool tb, float *C)
{
    if (M == 0 || N == 0) return;
    if (K == 0) {
        memset(C, 0, sizeof(float) * (size_t)(M * N));
        return;
    }
    GemmJob j = gemm_job(M, N, K, A, lda, ta, B, ldb, tb);
    j.C = C;
    j.sums = K > KC ? alloc_doubles(M * N) : NULL;
    j.bpack = alloc_doubles(j.n_col_panels * (K < KC ? K : KC) * NR);
    /* a few tasks per thread keep the threads balanced without tiny tasks */
    int64_t want = (int64_t)ref_threads() * 4;
    j.panels_per_task = (j.n_row_panels + want - 1) / want;
    int64_t n_tasks = (j.n_row_panels + j.panels_per_task - 1) / j.panels_per_task;
    for (j.k0 = 0; j.k0 < K; j.k0 += KC) {
        j.kl = K - j.k0 < KC ? K - j.k0 : KC;
        ref_parallel_for(j.n_col_panels, gemm_pack_b, &j);
        ref_parallel_for(n_tasks, gemm_rows_task, &j);
    }
    free(j.bpack);
    free(j.sums);
}

/* Per-thread packing buffers of the serial GEMM: attention calls it for every block, and a
 * malloc of a few hundred KiB per call would cost page faults. They grow, and are freed when
 * their thread ends (a key destructor: the pool's threads end when the count changes). */
static _Thread_local double *tls_buf;
static _Thread_local int64_t tls_cap;
static pthread_key_t tls_key;
static pthread_once_t tls_once = PTHREAD_ONCE_INIT;

static void tls_release(void *p) { free(p); }
static void tls_key_create(void) { IR_ASSERT(pthread_key_create(&tls_key, tls_release) == 0); }

/* Serial and unblocked along K: attention's products have K = head_dim or K <= seq. */
void ref_gemm_f64(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, bool ta,
                  const float *B, int64_t ldb, bool tb, double *C, int64_t ldc, bool accumulate)
{
    if (M == 0 || N == 0) return;
    if (K == 0) {
        if (!accumulate)
            for (int64_t i = 0; i < M; i++) memset(C + i * ldc, 0, sizeof(double) * (size_t)N);
        return;
    }
    GemmJob j = gemm_job(M, N, K, A, lda, ta, B, ldb, tb);
    j.Cd = C;
    j.ldd = ldc;
    j.add = accumulate;
    j.k0 = 0;
    j.kl = K;
    int64_t need = j.n_col_panels * K * NR + j.n_row_panels * K * j.mr;
    if (need > tls_cap) {
        pthread_once(&tls_once, tls_key_create);
        free(tls_buf);
        tls_buf = alloc_doubles(need);
        tls_cap = need;
        pthread_setspecific(tls_key, tls_buf);
    }
    j.bpack = tls_buf;
    for (int64_t jp = 0; jp < j.n_col_panels; jp++) gemm_pack_b(&j, jp);
    gemm_panels(&j, 0, j.n_row_panels, tls_buf + j.n_col_panels * K * NR);
}

void ref_matmul(const Node *n, const float *const *x, float *y)
{
    const Tensor *a = &n->in[0]->t, *b = &n->in[1]->t;
    bool ta = IR_IATTR(n, MATMUL, trans_a) != 0, tb = IR_IATTR(n, MATMUL, trans_b) != 0;
    int64_t ar = ref_rows(a), ac = ref_cols(a), br = ref_rows(b), bc = ref_cols(b);
    int64_t M = ta ? ac : ar, K = ta ? ar : ac;
    int64_t KB = tb ? bc : br, N = tb ? br : bc;
    if (K != KB)
        ref_die_node(n, "inner dimensions %lld and %lld differ", (long long)K, (long long)KB);
    if (ir_numel(&n->t) != M * N)
        ref_die_node(n, "result has %lld elements, expected %lld x %lld",
                     (long long)ir_numel(&n->t), (long long)M, (long long)N);
    ref_gemm(M, N, K, x[0], ac, ta, x[1], bc, tb, y);
}
