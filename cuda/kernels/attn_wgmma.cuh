/* attn_wgmma.cuh — the attention forward on Hopper's warpgroup MMA (bf16 q, k, v; wgmma).
 *
 * The algorithm is attn_tc.cuh's forward — online softmax in base 2 over key tiles of 64, the
 * causal mask only where a tile meets the diagonal or T, lse (and for MODE 1 Dt) written as
 * ck_attn_tc_fwd writes them, so that the backward (attn_tc.cuh's dq and dk/dv passes) reads
 * them unchanged — computed by wgmma.mma_async instead of mma.sync. One mma.sync is a 16 x 8
 * product of one warp, fed from registers that ldmatrix filled; one wgmma is a 64 x N product
 * of a warpgroup (four warps), which reads its B operand (and A, if not in registers) straight
 * from shared memory through a matrix descriptor, and runs asynchronously until
 * wgmma.wait_group. Fewer, larger instructions and no ldmatrix traffic are what Hopper's
 * tensor cores need to run at their rate; mma.sync reaches about half of it there.
 *
 * A block is two warpgroups (256 threads) and owns 128 query rows of one (batch, head); each
 * warpgroup owns 64 of them. Per key tile j, a warpgroup computes
 *   S = Q K^T      m64n64k16 x D/16: A (its 64 rows of Q) and B (the tile's 64 keys) are both
 *                  K-major descriptors (the head dim is contiguous), accumulated in f32;
 *   P = exp2(S scale log2(e) - m)   on the accumulator fragment, as attn_tc does: warp w of
 *                  the warpgroup holds rows 16 w + groupID and + 8, columns 8 n + 2 tig + {0,1}
 *                  in d[4 n .. 4 n + 3], exactly mma.sync's C layout repeated over n, so a
 *                  row's max and sum are the thread's values and two shuffles in a quad;
 *   O = O corr + P V   m64nDk16 x 4 with P as the register A operand (the fragment of m64nNk16's
 *                  A from registers is mma.sync's A layout, so two adjacent n-blocks of S,
 *                  rounded to bf16 pairs, are one k-chunk of P) and V as an MN-major B operand
 *                  (d contiguous: the descriptor's transpose bit reads it along keys).
 *
 * Shared memory holds every tile in the one layout the descriptors name "128-byte swizzle": a
 * 64-wide bf16 row is exactly 128 bytes; a tile of R rows and D columns is D / 64 column blocks
 * of R rows of 128 bytes, and the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its row.
 * Eight consecutive rows (1024 bytes, aligned to 1024) are one swizzle atom: the tensor core
 * reads the eight rows of one chunk column from eight distinct bank groups, with no padding.
 * The same bytes serve as K-major (Q, K: a 16-wide k-step is 32 bytes further into the row, the
 * next 8 rows 1024 bytes on: SBO) and as MN-major (V: a 16-key k-step is 2048 bytes on, the
 * next 8 keys 1024 bytes on: SBO; the next 64 head columns one column block on: LBO). Each
 * thread writes its chunks with 16-byte cp.async at the swizzled place (zeros past T), so the
 * loads need no TMA descriptor built on the host.
 *
 * The pipeline: Q and the first K, V tiles are loaded together; the K, V tiles are
 * double-buffered, the next one in flight (cp.async by all 256 threads) while both warpgroups
 * multiply the current one. Writes by cp.async are generic-proxy writes and wgmma reads through
 * the async proxy, so each thread fences (fence.proxy.async) between its last wait and the
 * barrier that publishes the tile. A warpgroup skips the key tiles wholly above its rows (the
 * last one of the lower half of a causal block). The two warpgroups are independent between
 * barriers, so one's softmax overlaps the other's tensor-core work, and two blocks share an SM
 * (cuda/spec_ops.c bounds the launch so: 128 registers a thread, 97 KiB of shared memory a
 * block at D 128) for the same reason across blocks. Heavy blocks (late query tiles) are
 * numbered first, as in attn_tc.
 *
 * Not done here (yet): a producer warp with TMA and mbarriers instead of cp.async and
 * __syncthreads, the S of tile j + 1 issued before the softmax of tile j within a warpgroup, and
 * a backward on wgmma. Precision is attn_tc's: P rounded to bf16 as an operand, row sums of the
 * f32 values, f32 accumulation, a fixed order (results repeat bit for bit). Used when q, k, v
 * are plain bf16, D is 64 or 128 and the choice attn.wgmma is on (cuda/spec_ops.c); the
 * binary's target is sm_90a (cuda/nvrtc.c), which wgmma needs. */

#define CK_WG_THREADS 256   /* two warpgroups, 64 query rows each */

/* shared memory, in bytes; cuda/spec_ops.c computes the same size */
template <int D> struct CkWg {
    enum {
        BM = 128,                          /* query rows of a block */
        BN = 64,                           /* keys of a tile */
        Q_BYTES = BM * D * 2,
        KV_BYTES = BN * D * 2,             /* one k or v tile */
        SMEM = 1024 + Q_BYTES + 4 * KV_BYTES   /* slack to align to 1024; q; k, v twice */
    };
};

/* The byte offset of 16-byte chunk c (0 .. D/8 - 1) of row r in a swizzled tile of R rows. */
template <int R>
static __device__ __forceinline__ unsigned ck_wg_chunk(int r, int c) {
    return (unsigned)((c >> 3) * R * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/* Rows [t0, t0 + R) of one head (D bf16 columns from col0, rows stride apart) into the
 * swizzled tile at shared address dst, zeros past T; asynchronous until ck_cp_wait. As
 * ck_tc_load, a base that is not 16-byte aligned takes element copies. */
template <int D, int R>
static __device__ __forceinline__ void ck_wg_load(unsigned dst, const CkTensor &x, i64 b, i64 T, i64 t0,
                                                  i64 stride, i64 col0) {
    const __nv_bfloat16 *p = (const __nv_bfloat16 *)x.p;
    bool vec = ((size_t)p & 15) == 0;
    const int CH = D / 8;   /* 16-byte chunks per row */
#pragma unroll
    for (int k = 0; k < R * CH / CK_WG_THREADS; k++) {
        int e = threadIdx.x + k * CK_WG_THREADS, r = e / CH, c = e - r * CH;
        bool in = t0 + r < T;
        const __nv_bfloat16 *src = p + (b * T + (in ? t0 + r : 0)) * stride + col0 + c * 8;
        unsigned to = dst + ck_wg_chunk<R>(r, c);
        if (vec) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(in ? 16 : 0));
        } else {
            for (int j = 0; j < 8; j += 2) {
                __nv_bfloat162 v = in ? __halves2bfloat162(src[j], src[j + 1]) : __float2bfloat162_rn(0.0f);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(to + 2 * j), "r"(*(unsigned *)&v));
            }
        }
    }
}

/* A shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): bits 0-13 the start
 * address >> 4, 16-29 the leading-dimension byte offset >> 4, 32-45 the stride-dimension byte
 * offset >> 4, 49-51 the base offset (0: every atom is 1024-aligned), 62-63 the swizzle mode
 * (1: 128 bytes). K-major with 128-byte swizzle: SBO is the step between groups of 8 rows, LBO
 * unused (1, as CUTLASS sets it); MN-major: SBO the step between groups of 8 k-rows, LBO the
 * step between 64-wide column blocks. */
static __device__ __forceinline__ unsigned long long ck_wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr >> 4) & 0x3FFF) | (unsigned long long)((lbo >> 4) & 0x3FFF) << 16 |
           (unsigned long long)((sbo >> 4) & 0x3FFF) << 32 | 1ull << 62;
}

static __device__ __forceinline__ void ck_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void ck_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void ck_wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
/* Keeps the compiler from moving reads or writes of wgmma's registers (accumulators, the A
 * fragment) across the wait or the fence: to it, the registers change at this point. The fence
 * orders the warpgroup's earlier accesses to them before the wgmma that follows, and the wait
 * makes the results readable; neither means anything to the compiler's scheduler by itself. */
template <int N>
static __device__ __forceinline__ void ck_wg_hold(float *d) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
static __device__ __forceinline__ void ck_wg_hold(unsigned *r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i])::"memory");
}

#define CK_F4(d, i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define CK_F16(d, i) CK_F4(d, i), CK_F4(d, (i) + 4), CK_F4(d, (i) + 8), CK_F4(d, (i) + 12)
#define CK_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
               "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CK_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
               "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
               "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
               "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

/* d (64 x 64, f32) = (acc ? d : 0) + A B: A and B K-major descriptors */
static __device__ __forceinline__ void ck_wg_ss64(float *d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " CK_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : CK_F16(d, 0), CK_F16(d, 16)
                 : "l"(da), "l"(db), "r"(acc));
}

/* d (64 x N, f32) += A B: A (64 x 16 bf16) in registers, B an MN-major descriptor (scale-d is
 * a predicate, set from a constant as in ck_wg_ss64) */
template <int N>
static __device__ __forceinline__ void ck_wg_rs(float *d, const unsigned *a, unsigned long long db) {
    if constexpr (N == 64) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " CK_D32
                     ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                     : CK_F16(d, 0), CK_F16(d, 16)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
    } else {
        static_assert(N == 128, "m64nNk16 for N = 64 or 128");
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " CK_D64
                     ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                     : CK_F16(d, 0), CK_F16(d, 16), CK_F16(d, 32), CK_F16(d, 48)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
    }
}

/* MODE 0: y = attention(q, k, v) (and lse after y when i[11]); MODE 1 (t[1] = dy): lse and Dt
 * into scratch. Arguments as ck_attn_tc_fwd's; one block per (b, h, 128 query rows). */
template <int D, int MODE, class Y, class Q, class K, class V, class DY>
__device__ void ck_attn_wg_fwd(const CkArgs &a) {
    static_assert(D == 64 || D == 128, "wgmma attention takes head dims 64 and 128");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkWg<D> L;
    unsigned sQ = (ck_smem(smem_raw) + 1023u) & ~1023u;   /* swizzle atoms start at multiples of 1024 */
    unsigned sKV = sQ + L::Q_BYTES;                        /* [buffer][k, v] tiles */
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3];
    float scale = (float)a.f[0], scale2 = scale * CK_LOG2E;   /* scores in base 2 */
    i64 n_qt = (T + L::BM - 1) / L::BM;
    i64 bh = blockIdx.x % (B * H), qt = n_qt - 1 - blockIdx.x / (B * H), b = bh / H, h = bh % H, g = h / (H / Hkv);
    int q0 = (int)qt * L::BM, Ti = (int)T;
    int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    int rows = q0 + wg * 64;              /* the warpgroup's first row */
    int row0 = rows + warp * 16 + gid;    /* this thread's rows: row0, row0 + 8 */
    const CkTensor &tq = a.t[MODE + 1], &tk = a.t[MODE + 2], &tv = a.t[MODE + 3];

    /* key tiles of the block, and of this warpgroup (none when its rows are all past T) */
    int last = q0 + L::BM - 1 < Ti - 1 ? q0 + L::BM - 1 : Ti - 1;
    int n_kt = (last >> 6) + 1;
    int wg_last = rows + 63 < Ti - 1 ? rows + 63 : Ti - 1;
    int wg_kt = rows < Ti ? (wg_last >> 6) + 1 : 0;
    ck_wg_load<D, L::BM>(sQ, tq, b, T, q0, a.i[5], a.i[6] + h * D);
    ck_wg_load<D, L::BN>(sKV, tk, b, T, 0, a.i[7], a.i[8] + g * D);
    ck_wg_load<D, L::BN>(sKV + L::KV_BYTES, tv, b, T, 0, a.i[9], a.i[10] + g * D);

    float o[D / 8][4], m[2] = {-CK_INF, -CK_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    for (int j = 0; j < n_kt; j++) {
        ck_cp_wait();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   /* my writes, to wgmma */
        __syncthreads();   /* tile j is in, and both warpgroups are done with buffer (j + 1) & 1 */
        if (j + 1 < n_kt) {
            unsigned nk = sKV + ((j + 1) & 1) * 2 * L::KV_BYTES;
            ck_wg_load<D, L::BN>(nk, tk, b, T, (j + 1) * 64, a.i[7], a.i[8] + g * D);
            ck_wg_load<D, L::BN>(nk + L::KV_BYTES, tv, b, T, (j + 1) * 64, a.i[9], a.i[10] + g * D);
        }
        if (j >= wg_kt) continue;   /* every key of the tile after every row of the warpgroup */
        unsigned sK = sKV + (j & 1) * 2 * L::KV_BYTES, sV = sK + L::KV_BYTES;
        int k0 = j * 64;

        /* S = Q K^T, 64 x 64 per warpgroup; k-step kk is column block kk / 4, 32 bytes a step in it */
        float s[8][4];
        ck_wg_hold<32>(&s[0][0]);
        ck_wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            unsigned qa = sQ + (kk >> 2) * L::BM * 128 + wg * 64 * 128 + (kk & 3) * 32;
            unsigned ka = sK + (kk >> 2) * L::BN * 128 + (kk & 3) * 32;
            ck_wg_ss64(&s[0][0], ck_wg_desc(qa, 16, 1024), ck_wg_desc(ka, 16, 1024), kk > 0);
        }
        ck_wg_commit();
        ck_wg_wait();
        ck_wg_hold<32>(&s[0][0]);

        /* online softmax on the fragments; the mask only where the tile meets the diagonal or T */
        unsigned pf[4][4];
        float corr[2];
        ck_softmax_tile(s, scale2, k0 + 63 > rows || k0 + 64 > Ti, k0, row0, tig, Ti, m, l, pf, corr);

        /* O = O corr + P V: k-step kk is keys 16 kk.., 2048 bytes on; LBO the next 64 columns */
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[n][0] *= corr[0], o[n][1] *= corr[0];
            o[n][2] *= corr[1], o[n][3] *= corr[1];
        }
        ck_wg_hold<D / 2>(&o[0][0]);
        ck_wg_hold<16>(&pf[0][0]);
        ck_wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            ck_wg_rs<D>(&o[0][0], pf[kk], ck_wg_desc(sV + kk * 16 * 128, L::BN * 128, 1024));
        ck_wg_commit();
        ck_wg_wait();
        ck_wg_hold<D / 2>(&o[0][0]);
    }

    ck_attn_fwd_finish<D, MODE, Y, DY>(a, o, m, l, b, h, row0, tig, Ti);
}
