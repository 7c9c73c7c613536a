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
 * (cuda/spec_attn.c bounds the launch so: 128 registers a thread, 97 KiB of shared memory a
 * block at D 128) for the same reason across blocks. Heavy blocks (late query tiles) are
 * numbered first, as in attn_tc.
 *
 * attn_ws.cuh has the loads in a producer warpgroup and the warpgroups apart, through
 * mbarriers (the choice attn.fwd_ws; slower with cp.async copies, so off); ck_attn_wg_fwd_pipe
 * below issues the S of tile j + 1 before the softmax of tile j. The backward's two passes
 * follow at the end of the file. Precision is attn_tc's: P rounded to bf16 as an operand, row sums of the
 * f32 values, f32 accumulation, a fixed order (results repeat bit for bit). Used when q, k, v
 * are plain bf16, D is 64 or 128 and the choice attn.wgmma is on (cuda/spec_attn.c); the
 * binary's target is sm_90a (cuda/nvrtc.c), which wgmma needs. */

#define CK_WG_THREADS 256   /* two warpgroups, 64 query rows each */

/* shared memory, in bytes; cuda/spec_attn.c computes the same size */
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
 * swizzled tile at shared address dst, zeros past T, by NT threads of which the caller is tid;
 * asynchronous until ck_cp_wait. As ck_tc_load, a base that is not 16-byte aligned takes
 * element copies. */
template <int D, int R, int NT>
static __device__ __forceinline__ void ck_wg_load_by(int tid, unsigned dst, const CkTensor &x, i64 b, i64 T, i64 t0,
                                                     i64 stride, i64 col0) {
    const __nv_bfloat16 *p = (const __nv_bfloat16 *)x.p;
    bool vec = ((size_t)p & 15) == 0;
    const int CH = D / 8, STEP = NT / CH;   /* 16-byte chunks a row; rows a step of NT threads */
    static_assert(NT % CH == 0, "a thread copies the same chunk of every row it copies");
    /* the thread's chunk c of rows r0, r0 + STEP, ..: one address made, then a step added (rows
     * past T copy nothing, from the tensor's start). The step is made here each call (the empty
     * asm), or the compiler keeps the multiples of it for every k in registers across a
     * kernel's loop of loads: 17 more registers in the dq pass, a block an SM fewer. */
    const int r0 = tid / CH, c = tid % CH;
    const __nv_bfloat16 *src = p + (b * T + t0 + r0) * stride + col0 + c * 8;
    i64 step = (i64)STEP * stride;
    asm volatile("" : "+l"(step));
#pragma unroll
    for (int k = 0; k < R / STEP; k++, src += step) {
        int r = r0 + k * STEP;
        bool in = t0 + r < T;
        unsigned to = dst + ck_wg_chunk<R>(r, c);
        if (vec) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(in ? src : p), "r"(in ? 16 : 0));
        } else {
            for (int j = 0; j < 8; j += 2) {
                __nv_bfloat162 v = in ? __halves2bfloat162(src[j], src[j + 1]) : __float2bfloat162_rn(0.0f);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(to + 2 * j), "r"(*(unsigned *)&v));
            }
        }
    }
}

/* the same, loaded by the NT threads of the block (thread index tid = threadIdx.x) */
template <int D, int R, int NT = CK_WG_THREADS>
static __device__ __forceinline__ void ck_wg_load(unsigned dst, const CkTensor &x, i64 b, i64 T, i64 t0,
                                                  i64 stride, i64 col0) {
    ck_wg_load_by<D, R, NT>((int)threadIdx.x, dst, x, b, T, t0, stride, col0);
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
/* all but the last commit group done: the one before it may be read while the last runs */
static __device__ __forceinline__ void ck_wg_wait_but_last() {
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
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
#define CK_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
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

/* d (64 x 32, f32) = (acc ? d : 0) + A B: A and B K-major descriptors */
static __device__ __forceinline__ void ck_wg_ss32(float *d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " CK_D16 ", %16, %17, p, 1, 1, 0, 0;\n}\n"
                 : CK_F16(d, 0)
                 : "l"(da), "l"(db), "r"(acc));
}
/* d (64 x 64, f32) = (acc ? d : 0) + A B: A and B MN-major descriptors (both read transposed) */
static __device__ __forceinline__ void ck_wg_ss64_mn(float *d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " CK_D32 ", %32, %33, p, 1, 1, 1, 1;\n}\n"
                 : CK_F16(d, 0), CK_F16(d, 16)
                 : "l"(da), "l"(db), "r"(acc));
}
/* d (64 x 128, f32) = (acc ? d : 0) + A B: A and B K-major descriptors (a key tile of 128) */
static __device__ __forceinline__ void ck_wg_ss128(float *d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " CK_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : CK_F16(d, 0), CK_F16(d, 16), CK_F16(d, 32), CK_F16(d, 48)
                 : "l"(da), "l"(db), "r"(acc));
}
template <int N>
static __device__ __forceinline__ void ck_wg_ss(float *d, unsigned long long da, unsigned long long db, int acc) {
    static_assert(N == 32 || N == 64 || N == 128, "m64nNk16 for N = 32, 64 or 128");
    if constexpr (N == 128) ck_wg_ss128(d, da, db, acc);
    else if constexpr (N == 64) ck_wg_ss64(d, da, db, acc);
    else ck_wg_ss32(d, da, db, acc);
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

/* S = Q K^T for warpgroup wg (64 x BN, f32): its 64 rows of the Q tile of BM rows at sQ against
 * the BN keys at sK, both in the swizzled layout above; k-step kk is column block kk / 4, 32
 * bytes a step in it. Issued and committed; ck_wg_qk waits for it. The forwards of this file
 * and attn_ws.cuh's consumers. */
template <int D, int BM, int BN = 64>
static __device__ __forceinline__ void ck_wg_qk_issue(float (*s)[4], unsigned sQ, unsigned sK, int wg) {
    ck_wg_hold<BN / 2>(&s[0][0]);
    ck_wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        unsigned qa = sQ + (kk >> 2) * BM * 128 + wg * 64 * 128 + (kk & 3) * 32;
        unsigned ka = sK + (kk >> 2) * BN * 128 + (kk & 3) * 32;
        ck_wg_ss<BN>(&s[0][0], ck_wg_desc(qa, 16, 1024), ck_wg_desc(ka, 16, 1024), kk > 0);
    }
    ck_wg_commit();
}
template <int D, int BM, int BN = 64>
static __device__ __forceinline__ void ck_wg_qk(float (*s)[4], unsigned sQ, unsigned sK, int wg) {
    ck_wg_qk_issue<D, BM, BN>(s, sQ, sK, wg);
    ck_wg_wait();
    ck_wg_hold<BN / 2>(&s[0][0]);
}

/* O = O corr + P V: P the packed bf16 A operand (ck_softmax_tile's pf), V the BN keys' tile at
 * sV; k-step kk is keys 16 kk.., 2048 bytes on; LBO the next 64 columns. The issue alone
 * (ck_wg_pv_issue) leaves the product running until a wait. */
template <int D, int BN = 64>
static __device__ __forceinline__ void ck_wg_pv_issue(float (*o)[4], unsigned (*pf)[4], unsigned sV) {
    ck_wg_hold<D / 2>(&o[0][0]);
    ck_wg_hold<BN / 4>(&pf[0][0]);
    ck_wg_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) ck_wg_rs<D>(&o[0][0], pf[kk], ck_wg_desc(sV + kk * 16 * 128, BN * 128, 1024));
    ck_wg_commit();
}
template <int D>
static __device__ __forceinline__ void ck_wg_scale_rows(float (*o)[4], const float *corr) {
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        o[n][0] *= corr[0], o[n][1] *= corr[0];
        o[n][2] *= corr[1], o[n][3] *= corr[1];
    }
}
template <int D, int BN = 64>
static __device__ __forceinline__ void ck_wg_pv(float (*o)[4], unsigned (*pf)[4], const float *corr, unsigned sV) {
    ck_wg_scale_rows<D>(o, corr);
    ck_wg_pv_issue<D, BN>(o, pf, sV);
    ck_wg_wait();
    ck_wg_hold<D / 2>(&o[0][0]);
}

/* Which (batch, head) and which of its tiles block `blk` takes, among n_bh heads of n_t tiles
 * each; k = 0 is the head's heaviest tile (the caller maps it: the last query tile of a causal
 * forward or dq pass, the first key tile of a dk/dv pass). HG = 0: the heaviest tile of every
 * head first, then the next of every head, and so on, so that the last wave is of light tiles.
 * HG > 0: the heads in groups of HG, every tile of a group before the next group's, heaviest
 * first within it; the tiles of a head that run together then read its other operands (K and V,
 * or Q and dY, 256 KiB a head at T 1024) from L2 rather than from memory (the choice
 * attn.head_group). */
static __device__ __forceinline__ void ck_attn_order(i64 blk, i64 n_bh, i64 n_t, int hg, i64 &bh, i64 &k) {
    if (hg == 0) {
        bh = blk % n_bh, k = blk / n_bh;
        return;
    }
    i64 grp = blk / (hg * n_t), r = blk - grp * hg * n_t;
    i64 in = n_bh - grp * hg < hg ? n_bh - grp * hg : hg;   /* the last group may be short */
    bh = grp * hg + r % in, k = r / in;
}

/* Where a forward block of 128 query rows and its thread stand (ck_attn_wg_fwd and its
 * pipelined form): the (batch, head, query tile) of the block, heavy tiles first; the
 * warpgroup's first row and the thread's rows (row0, row0 + 8); the key tiles of the block and
 * of the warpgroup (none when its rows are all past T). */
struct CkWgFwdPlace {
    i64 b, h, g;
    int q0, Ti, wg, rows, row0, tig, n_kt, wg_kt;
    __device__ CkWgFwdPlace(const CkArgs &a, int hg) {
        i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3], n_qt = (T + 127) / 128, bh, heavy;
        ck_attn_order(blockIdx.x, B * H, n_qt, hg, bh, heavy);
        i64 qt = n_qt - 1 - heavy;
        b = bh / H, h = bh % H, g = h / (H / Hkv);
        q0 = (int)qt * 128, Ti = (int)T;
        wg = threadIdx.x >> 7;
        int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
        tig = lane & 3;
        rows = q0 + wg * 64;
        row0 = rows + warp * 16 + (lane >> 2);
        int last = q0 + 127 < Ti - 1 ? q0 + 127 : Ti - 1, wg_last = rows + 63 < Ti - 1 ? rows + 63 : Ti - 1;
        n_kt = (last >> 6) + 1;
        wg_kt = rows < Ti ? (wg_last >> 6) + 1 : 0;
    }
};

/* MODE 0: y = attention(q, k, v) (and lse after y when i[11]); MODE 1 (t[1] = dy): lse and Dt
 * into scratch. Arguments as ck_attn_tc_fwd's; one block per (b, h, 128 query rows). */
template <int D, int MODE, class Y, class Q, class K, class V, class DY, int HG = 0>
__device__ void ck_attn_wg_fwd(const CkArgs &a) {
    static_assert(D == 64 || D == 128, "wgmma attention takes head dims 64 and 128");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkWg<D> L;
    unsigned sQ = (ck_smem(smem_raw) + 1023u) & ~1023u;   /* swizzle atoms start at multiples of 1024 */
    unsigned sKV = sQ + L::Q_BYTES;                        /* [buffer][k, v] tiles */
    i64 T = a.i[1];
    float scale2 = (float)a.f[0] * CK_LOG2E;   /* scores in base 2 */
    const CkWgFwdPlace at(a, HG);
    const i64 b = at.b, h = at.h, g = at.g;
    const int q0 = at.q0, Ti = at.Ti, wg = at.wg, rows = at.rows, row0 = at.row0, tig = at.tig;
    const int n_kt = at.n_kt, wg_kt = at.wg_kt;
    const CkTensor &tq = a.t[MODE + 1], &tk = a.t[MODE + 2], &tv = a.t[MODE + 3];
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

        float s[8][4];
        ck_wg_qk<D, L::BM>(s, sQ, sK, wg);

        /* online softmax on the fragments; the mask only where the tile meets the diagonal or T */
        unsigned pf[4][4];
        float corr[2];
        ck_softmax_tile(s, scale2, k0 + 63 > rows || k0 + 64 > Ti, k0, row0, tig, Ti, m, l, pf, corr);

        ck_wg_pv<D>(o, pf, corr, sV);
    }

    ck_attn_fwd_finish<D, MODE, Y, DY>(a, o, m, l, b, h, row0, tig, Ti);
}

/* ck_attn_wg_fwd at D 64 with the products of a warpgroup overlapped with its softmax
 * (FlashAttention-3's intra-warpgroup pipelining; the choice attn.fwd_pipeline): in step j a
 * warpgroup issues S_j = Q K_j^T and then O += P_{j-1} V_{j-1}, waits for S_j alone, computes
 * the softmax of tile j while the tensor cores still run P_{j-1} V_{j-1}, then waits for that
 * product and rescales O by tile j's correction; P_j V_j is issued in step j + 1, and the
 * warpgroup's last one after its walk. O takes the same products in the same order as in
 * ck_attn_wg_fwd, so the results are its bits. P_{j-1} stays in registers while its product
 * runs (wgmma reads its A operand from them), so the softmax writes P_j into a second set.
 * V_{j-1} is read one step later than K_{j-1}, so the V tiles rotate through three buffers and
 * the K tiles through two: the loads of tile j + 1, issued at the top of step j, go where
 * K_{j-1} and V_{j-2} were, which every warpgroup finished with in step j - 1.
 *
 * Nothing in a step branches (ck_wg_pipe_step): where a branch that ptxas cannot prove uniform
 * falls between a product's issue and its wait, ptxas serializes the warpgroup's products
 * (its warning C7518), and the overlap is gone. The first version of this kernel, with the
 * mask and the first and last steps under conditions, was so serialized; it measured slower
 * than ck_attn_wg_fwd (docs/results.md, 2026-11-29 (j)). So every step runs the same code:
 * the mask by a bound a row (ck_tile_mask_lim_max), and step 0's P V of P = 0 (zeros in the
 * A registers) against the Q tile, which adds +0 to O = 0. Shared memory: CkWgPipe. */
struct CkWgPipe {
    enum {
        BM = 128, BN = 64, D = 64,
        Q_BYTES = BM * D * 2,
        TILE = BN * D * 2,
        SMEM = 1024 + Q_BYTES + 5 * TILE   /* slack; q; k twice; v three times */
    };
};

/* One step of a pipelined walk (ck_attn_wg_fwd_pipe; attn_ws.cuh's consumers with FUSED): S_j
 * and P_{j-1} V_{j-1} issued together, tile j's softmax (masked by lim) while the second runs,
 * then O rescaled and P_j kept in pp. FUSED = false rounds as ck_softmax_tile (the scores
 * scaled first), true as ck_ws_softmax_tile. Nothing in it branches (above). */
template <int D, int BM, int BN = 64, bool FUSED = false>
static __device__ __forceinline__ void ck_wg_pipe_step(float (*o)[4], unsigned (*pp)[4], unsigned sQ, unsigned sK,
                                                       unsigned sVprev, int wg, float scale2, const int *lim,
                                                       float *m, float *l) {
    float sc[BN / 8][4], corr[2], mx[2];
    unsigned pf[BN / 16][4];
    ck_wg_qk_issue<D, BM, BN>(sc, sQ, sK, wg);
    ck_wg_pv_issue<D, BN>(o, pp, sVprev);
    ck_wg_wait_but_last();
    ck_wg_hold<BN / 2>(&sc[0][0]);
    if (!FUSED)
#pragma unroll
        for (int n = 0; n < BN / 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) sc[n][i] *= scale2;
    ck_tile_mask_lim_max<BN / 8>(sc, lim, mx);
    ck_softmax_rows<BN / 8, FUSED>(sc, mx, scale2, m, l, pf, corr);
    ck_wg_wait();
    ck_wg_hold<D / 2>(&o[0][0]);
    ck_wg_hold<BN / 4>(&pp[0][0]);
    ck_wg_scale_rows<D>(o, corr);
#pragma unroll
    for (int k = 0; k < BN / 16; k++)
#pragma unroll
        for (int i = 0; i < 4; i++) pp[k][i] = pf[k][i];
}

template <int D, int MODE, class Y, class Q, class K, class V, class DY, int HG = 0>
__device__ void ck_attn_wg_fwd_pipe(const CkArgs &a) {
    static_assert(D == 64, "the pipelined wgmma forward takes head dim 64");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkWgPipe L;
    unsigned sQ = (ck_smem(smem_raw) + 1023u) & ~1023u;
    unsigned sK0 = sQ + L::Q_BYTES, sV0 = sK0 + 2 * L::TILE;   /* k[2], v[3] */
    i64 T = a.i[1];
    float scale2 = (float)a.f[0] * CK_LOG2E;
    const CkWgFwdPlace at(a, HG);
    const i64 b = at.b, h = at.h, g = at.g;
    const int Ti = at.Ti, wg = at.wg, row0 = at.row0, tig = at.tig;
    const int n_kt = at.n_kt, wg_kt = at.wg_kt;
    const CkTensor &tq = a.t[MODE + 1], &tk = a.t[MODE + 2], &tv = a.t[MODE + 3];
    ck_wg_load<D, L::BM>(sQ, tq, b, T, at.q0, a.i[5], a.i[6] + h * D);
    ck_wg_load<D, L::BN>(sK0, tk, b, T, 0, a.i[7], a.i[8] + g * D);
    ck_wg_load<D, L::BN>(sV0, tv, b, T, 0, a.i[9], a.i[10] + g * D);

    float o[D / 8][4], m[2] = {-CK_INF, -CK_INF}, l[2] = {0.0f, 0.0f};
    unsigned pp[4][4];   /* P_{j-1}: the A operand of the product in flight */
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) pp[k][0] = pp[k][1] = pp[k][2] = pp[k][3] = 0u;
    const int rmax[2] = {row0 < Ti - 1 ? row0 : Ti - 1, row0 + 8 < Ti - 1 ? row0 + 8 : Ti - 1};
    /* the warpgroup's last P V, of tile wg_kt - 1 */
    auto drain = [&]() {
        ck_wg_pv_issue<D>(o, pp, sV0 + ((wg_kt - 1) % 3) * L::TILE);
        ck_wg_wait();
        ck_wg_hold<D / 2>(&o[0][0]);
    };
    for (int j = 0; j < n_kt; j++) {
        ck_cp_wait();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();   /* tile j is in; K_{j-1} and V_{j-2} are free */
        if (j + 1 < n_kt) {
            ck_wg_load<D, L::BN>(sK0 + ((j + 1) & 1) * L::TILE, tk, b, T, (j + 1) * 64, a.i[7], a.i[8] + g * D);
            ck_wg_load<D, L::BN>(sV0 + ((j + 1) % 3) * L::TILE, tv, b, T, (j + 1) * 64, a.i[9], a.i[10] + g * D);
        }
        if (j < wg_kt) {
            int k0 = j * 64, lim[2] = {rmax[0] - k0 - 2 * tig, rmax[1] - k0 - 2 * tig};
            ck_wg_pipe_step<D, L::BM>(o, pp, sQ, sK0 + (j & 1) * L::TILE, j > 0 ? sV0 + ((j - 1) % 3) * L::TILE : sQ, wg,
                                      scale2, lim, m, l);
        } else if (j == wg_kt && j > 0) {
            drain();
        }
    }
    if (wg_kt == n_kt && n_kt > 0) drain();

    ck_attn_fwd_finish<D, MODE, Y, DY>(a, o, m, l, b, h, row0, tig, Ti);
}

/* ---------------------------------------------------------------- the backward on wgmma
 *
 * The backward keeps attn_tc's split into two passes, each output written by one block in a
 * fixed order (so results repeat bit for bit, with no atomics and no f32 dq buffer), and moves
 * both onto warpgroup MMA with the forward's tile layout (a single pass with dq summed in a
 * fixed order follows the dk/dv pass below, measured slower). The passes recompute S and dP that
 * the other also computes (seven tile products where FlashAttention's single pass with atomic
 * dq adds takes five); what they gain is that every product is a wgmma over swizzled tiles:
 *
 *   dq  (ck_attn_wg_dq): a block of WGS warpgroups owns 64 WGS query rows (128, as the
 *       forward, or 64) and walks the 64-key tiles up to its diagonal with K and V
 *       double-buffered. Where the forward's y and logsumexp are kept, it first makes its
 *       rows' statistics (Dt = dy . y, while its first tiles load) and stores them with lse
 *       for the dk/dv pass, so that no statistics pass runs before it:
 *         S = Q K^T, dP = dY V^T   two m64n64k16 chains, both operands K-major descriptors;
 *         dS = P (dP - Dt) scale   on the accumulator fragments, P = 2^(S scale log2 e - lse);
 *         dQ += dS K               dS as the register A operand, K as an MN-major B operand
 *                                  (the forward's P V with K in V's place).
 *   dk, dv (ck_attn_wg_dkv): a block owns 64 WGS keys (64 a warpgroup) of one kv head and walks
 *       the 64-query tiles at and after them, for every head of the group, with Q, dY and
 *       their lse and Dt double-buffered:
 *         S^T = K Q^T, dP^T = V dY^T   keys as rows, so that P^T and dS^T come out in the
 *                                  accumulator layout that is the A operand of
 *         dV += P^T dY, dK += dS^T Q   with dY and Q as MN-major B operands.
 *
 * The block size is a trade. Two warpgroups share each tile they load, but they meet at every
 * step's barrier, so they issue their products together and compute their softmax together,
 * and the tensor cores idle while they do; only another block on the SM fills that time. dK
 * and dV stay in registers over the whole walk (190 registers a thread at D 64), so a dk/dv
 * block of two warpgroups runs alone on its SM; with one warpgroup a block, two blocks share
 * it and drift apart, at the price of loading each Q and dY tile twice as often (from L2).
 * spec_attn.c takes WGS from the choices attn.dq_rows and attn.dkv_rows. Masks, rounding (P and
 * dS to bf16 as operands) and the statistics read are attn_tc's; only the order of the f32
 * sums inside a product differs. */

template <int D, int WGS> struct CkWgBwd {
    enum {
        THREADS = 128 * WGS,             /* WGS warpgroups of 64 rows */
        ROWS = 64 * WGS,                 /* query rows of a dq block, keys of a dk/dv block */
        STEP = 64,                       /* keys of a dq step, queries of a dk/dv step */
        WHOLE = ROWS * D * 2,            /* q or dy (dq), k or v (dk/dv) */
        TILE = STEP * D * 2,             /* one k or v (dq), one q or dy (dk/dv) */
        DQ = 1024 + 2 * WHOLE + 4 * TILE,             /* slack; q, dy; k, v twice */
        DKV = 1024 + 2 * WHOLE + 4 * TILE + 4 * STEP * 4   /* slack; k, v; q, dy, lse, Dt twice */
    };
};

/* The counters after lse and Dt in the scratch, of one of two kinds (a backward takes one or
 * neither): the dk/dv pass's ONE (a counter per (b, h, 64 queries), then the blocks' numbers)
 * or its PARTS (a ticket per key tile, ck_attn_dkv_tickets of them at most); both below. */
static __device__ __forceinline__ unsigned *ck_attn_counters(const CkArgs &a) {
    return (unsigned *)((float *)a.scratch + 2 * a.i[0] * a.i[2] * a.i[1]);
}
static __device__ __forceinline__ i64 ck_attn_dkv_tickets(const CkArgs &a) {
    return a.i[0] * a.i[3] * ((a.i[1] + 63) / 64);
}

/* The statistics of a thread's two rows (row0, row0 + 8: ck_attn_row_stats's) from the
 * forward's y (t[5]) and the logsumexp it stored i[11] bytes after y: Dt = dy . y, summed in
 * the order ck_attn_saved_stats sums it (D / 8 lanes of eight elements, halves folded: lane
 * tig of a quad holds those lanes' sums tig + 4 j and folds them before the quad's two
 * shuffles), so that Dt has the same bits as that pass's. fetch() issues the loads of y (as
 * stored) and lse as the block's tiles start loading; finish(), once the block's dY tile is
 * in shared memory, reads dy there (its bytes as the tile holds them, decoded as DY decodes
 * a vector, so as ck_attn_saved_stats reads it), adds, and the quad's first
 * lane stores both rows' lse and Dt into the scratch for the dk/dv pass, which runs next. Where
 * y cannot be read in vectors, finish() reads it an element at a time. */
struct CkNoY;   /* no saved y: the statistics pass filled the scratch */
template <class YS> struct CkHasY { enum { v = 1 }; };
template <> struct CkHasY<CkNoY> { enum { v = 0 }; };
template <int D, int ROWS, class DY, class YS> struct CkRowsY {
    static constexpr int PER = D / CK_VEC, NC = PER / 4;   /* ck_attn_saved_stats's lanes; this lane's */
    static_assert(PER * CK_VEC == D && NC >= 1 && (NC & (NC - 1)) == 0, "whole vectors, a power of two a lane");
    typename YS::Raw y[2][NC];
    float l[2];
    bool vec;
    __device__ __forceinline__ i64 base(const CkArgs &a, i64 b, i64 h, int row) const {
        return (b * a.i[1] + row) * a.i[2] * D + h * D;
    }
    __device__ __forceinline__ void fetch(const CkArgs &a, i64 b, i64 h, int row0, int tig, int Ti) {
        const float *lse_y = (const float *)((const char *)a.t[5].p + a.i[11]);
        vec = YS::vec_ok(a.t[5]);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int row = row0 + r * 8;
            l[r] = row < Ti ? lse_y[(b * a.i[2] + h) * a.i[1] + row] : 0.0f;
#pragma unroll
            for (int j = 0; j < NC; j++)
                if (vec && row < Ti) ck_raw_vec<YS>(a.t[5].p, ck_vec_index(base(a, b, h, row) + (tig + 4 * j) * CK_VEC), y[r][j]);
        }
    }
    /* lr0: the thread's first row in the tile at sDY (ROWS rows, 128-byte swizzled) */
    __device__ __forceinline__ void finish(const CkArgs &a, i64 b, i64 h, int row0, int tig, int Ti, unsigned sDY,
                                           int lr0, float *ls, float *dt) const {
        i64 B = a.i[0], T = a.i[1], H = a.i[2];
        float *lse = (float *)a.scratch, *dd = lse + B * H * T;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int row = row0 + r * 8;
            float s[NC];
#pragma unroll
            for (int j = 0; j < NC; j++) {
                int sub = tig + 4 * j;
                s[j] = 0.0f;
                if (row >= Ti) continue;
                static_assert(sizeof(typename DY::Raw) == 16, "a chunk of the dY tile is one vector of dy");
                typename DY::Raw dr;
                unsigned *w = (unsigned *)&dr;
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                             : "r"(sDY + ck_wg_chunk<ROWS>(lr0 + r * 8, sub)));
                float u[CK_VEC], v[CK_VEC];
                DY::decode_vec(a.t[1], base(a, b, h, row) + sub * CK_VEC, dr, u);
                if (vec) {
                    YS::decode_vec(a.t[5], base(a, b, h, row) + sub * CK_VEC, y[r][j], v);
                } else {
#pragma unroll
                    for (int k = 0; k < CK_VEC; k++) v[k] = YS::ld(a.t[5], base(a, b, h, row) + sub * CK_VEC + k);
                }
#pragma unroll
                for (int k = 0; k < CK_VEC; k++) s[j] = fmaf(u[k], v[k], s[j]);
            }
#pragma unroll
            for (int w = NC / 2; w >= 1; w /= 2)
#pragma unroll
                for (int j = 0; j < w; j++) s[j] += s[j + w];
            s[0] += __shfl_xor_sync(0xffffffffu, s[0], 2);
            s[0] += __shfl_xor_sync(0xffffffffu, s[0], 1);
            ls[r] = l[r] * CK_LOG2E;   /* base 2 */
            dt[r] = s[0];
            if (row < Ti && tig == 0) {
                i64 at = (b * H + h) * T + row;
                lse[at] = l[r], dd[at] = s[0];
            }
        }
    }
};

template <int D, int ROWS, class DY> struct CkRowsY<D, ROWS, DY, CkNoY> {};

/* dq: one block per (b, h, 64 WGS query rows); t[1..4] = dy, q, k, v; lse and Dt in the scratch,
 * or (YS, the saved y's format) made here from y (t[5]) and stored there for the dk/dv pass.
 * ZERO: block 0 also zeroes the dk/dv pass's tickets, which that pass, run next, takes. */
template <int D, int WGS, class Y, class DY, class Q, class K, class V, int HG = 0, int ZERO = 0, class YS = CkNoY>
__device__ void ck_attn_wg_dq(const CkArgs &a) {
    if (ZERO && blockIdx.x == 0)
        for (i64 t = threadIdx.x; t < ck_attn_dkv_tickets(a); t += 128 * WGS) ck_attn_counters(a)[t] = 0u;
    static_assert(D == 64 || D == 128, "wgmma attention takes head dims 64 and 128");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkWgBwd<D, WGS> L;
    unsigned sQ = (ck_smem(smem_raw) + 1023u) & ~1023u, sDY = sQ + L::WHOLE;
    unsigned sKV = sDY + L::WHOLE;   /* [buffer][k, v] tiles */
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3];
    float scale = (float)a.f[0], scale2 = scale * CK_LOG2E;   /* scores in base 2 */
    i64 n_qt = (T + L::ROWS - 1) / L::ROWS;
    i64 bh, heavy;
    ck_attn_order(blockIdx.x, B * H, n_qt, HG, bh, heavy);
    i64 qt = n_qt - 1 - heavy, b = bh / H, h = bh % H, g = h / (H / Hkv);
    int q0 = (int)qt * L::ROWS, Ti = (int)T;
    int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    int rows = q0 + wg * 64, row0 = rows + warp * 16 + gid;

    int last = q0 + L::ROWS - 1 < Ti - 1 ? q0 + L::ROWS - 1 : Ti - 1;
    int n_kt = (last >> 6) + 1;
    int wg_last = rows + 63 < Ti - 1 ? rows + 63 : Ti - 1;
    int wg_kt = rows < Ti ? (wg_last >> 6) + 1 : 0;
    ck_wg_load<D, L::ROWS, L::THREADS>(sQ, a.t[2], b, T, q0, a.i[5], a.i[6] + h * D);
    ck_wg_load<D, L::ROWS, L::THREADS>(sDY, a.t[1], b, T, q0, H * D, h * D);
    ck_wg_load<D, L::STEP, L::THREADS>(sKV, a.t[3], b, T, 0, a.i[7], a.i[8] + g * D);
    ck_wg_load<D, L::STEP, L::THREADS>(sKV + L::TILE, a.t[4], b, T, 0, a.i[9], a.i[10] + g * D);
    float ls[2], dt[2];
    CkRowsY<D, L::ROWS, DY, YS> ys;   /* with the saved y: its rows as the tiles load, Dt after (below) */
    if constexpr (CkHasY<YS>::v)
        ys.fetch(a, b, h, row0, tig, Ti);
    else
        ck_attn_row_stats(a, b, h, row0, Ti, ls, dt);
    float dq[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
    if constexpr (CkHasY<YS>::v) {   /* the first tiles are in, dY with them (the loop waits again: at once) */
        ck_cp_wait();
        __syncthreads();
        ys.finish(a, b, h, row0, tig, Ti, sDY, wg * 64 + warp * 16 + gid, ls, dt);
    }
    for (int j = 0; j < n_kt; j++) {
        ck_cp_wait();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   /* my writes, to wgmma */
        __syncthreads();   /* tile j is in, and both warpgroups are done with buffer (j + 1) & 1 */
        if (j + 1 < n_kt) {
            unsigned nk = sKV + ((j + 1) & 1) * 2 * L::TILE;
            ck_wg_load<D, L::STEP, L::THREADS>(nk, a.t[3], b, T, (j + 1) * 64, a.i[7], a.i[8] + g * D);
            ck_wg_load<D, L::STEP, L::THREADS>(nk + L::TILE, a.t[4], b, T, (j + 1) * 64, a.i[9], a.i[10] + g * D);
        }
        if (j >= wg_kt) continue;   /* every key of the tile after every row of the warpgroup */
        unsigned sK = sKV + (j & 1) * 2 * L::TILE, sV = sK + L::TILE;
        int k0 = j * 64;

        /* S = Q K^T, then dP = dY V^T, 64 x 64 per warpgroup, in two commit groups: P is
         * computed while dP is still on the tensor cores */
        float s[8][4], dp[8][4];
        ck_wg_hold<32>(&s[0][0]);
        ck_wg_hold<32>(&dp[0][0]);
        ck_wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            unsigned mine = (kk >> 2) * L::ROWS * 128 + wg * 64 * 128 + (kk & 3) * 32;
            unsigned tile = (kk >> 2) * L::STEP * 128 + (kk & 3) * 32;
            ck_wg_ss64(&s[0][0], ck_wg_desc(sQ + mine, 16, 1024), ck_wg_desc(sK + tile, 16, 1024), kk > 0);
        }
        ck_wg_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            unsigned mine = (kk >> 2) * L::ROWS * 128 + wg * 64 * 128 + (kk & 3) * 32;
            unsigned tile = (kk >> 2) * L::STEP * 128 + (kk & 3) * 32;
            ck_wg_ss64(&dp[0][0], ck_wg_desc(sDY + mine, 16, 1024), ck_wg_desc(sV + tile, 16, 1024), kk > 0);
        }
        ck_wg_commit();
        ck_wg_wait_but_last();
        ck_wg_hold<32>(&s[0][0]);

        /* P = exp(S scale - lse); masked S is -inf (P = 0) only where the tile meets the
         * diagonal or T */
        if (k0 + 63 > rows || rows + 64 > Ti)
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int col = k0 + n * 8 + tig * 2 + (i & 1), row = row0 + (i >> 1) * 8;
                    if (col > row || row >= Ti) s[n][i] = -CK_INF;
                }
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) s[n][i] = ck_ex2(fmaf(s[n][i], scale2, -ls[i >> 1]));

        /* dS = P (dP - Dt) scale, as bf16 A operands */
        ck_wg_wait();
        ck_wg_hold<32>(&dp[0][0]);
        unsigned df[4][4];
#pragma unroll
        for (int n = 0; n < 8; n++) {
            float ds[4];
#pragma unroll
            for (int i = 0; i < 4; i++) ds[i] = s[n][i] * (dp[n][i] - dt[i >> 1]) * scale;
            df[n >> 1][(n & 1) * 2] = ck_pack(ds[0], ds[1]);
            df[n >> 1][(n & 1) * 2 + 1] = ck_pack(ds[2], ds[3]);
        }

        /* dQ += dS K: k-step kk is keys 16 kk.., 2048 bytes on; LBO the next 64 columns */
        ck_wg_hold<D / 2>(&dq[0][0]);
        ck_wg_hold<16>(&df[0][0]);
        ck_wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            ck_wg_rs<D>(&dq[0][0], df[kk], ck_wg_desc(sK + kk * 16 * 128, L::STEP * 128, 1024));
        ck_wg_commit();
        ck_wg_wait();
        ck_wg_hold<D / 2>(&dq[0][0]);
    }
    ck_attn_dq_store<D, Y>(a, dq, b, h, row0, tig, Ti);
}

/* ---------------------------------------------------------------- dq in the dk/dv pass
 *
 * With ONE (the choice attn.dq_in_dkv) the dk/dv pass computes dq too and no dq pass runs: five
 * tile products where the two passes take seven. Each step's dS^T (64 keys x 64 queries, the A
 * operand of dK += dS^T Q) is also stored, as bf16, into a 128-byte-swizzled tile with the
 * keys as rows; read through a transposed descriptor it is dS, the A operand of
 *   dQ_part = dS K        m64n64k16 x 4, both operands MN-major (dS's queries and K's head dim
 *                         are contiguous), the accumulator rows the step's 64 queries,
 * the part of the query tile's dq that this block's 64 keys give. The parts of one query tile
 * come from the blocks of the keys at and before it and are summed in a fixed order, so that
 * dq repeats bit for bit: the diagonal block's first (it stores its part into an f32 buffer in
 * the scratch), then the block of the keys before it, each adding its part to the sum, down to
 * the block of keys 0, which adds the last part and stores dq through Y. A counter per (batch,
 * head, query tile), zeroed by the statistics pass before, says how many parts are in; a block
 * waits for its turn (thread 0 with an acquiring load, then the block's barrier), adds, and
 * hands on (the block's barrier, then thread 0's releasing store of the count, as CUTLASS's
 * semaphores do). A step's part waits in shared memory and is added during the next step,
 * after its first products are issued, so that the sums' round trips to L2 run under them.
 *
 * The order costs no waiting: block kb meets query tile qt at its step qt - kb, one step after
 * block kb + 1 met it, so blocks that run side by side never wait for one another. The blocks
 * of a (batch, kv head) are numbered together, the one with the fewest steps first, and a
 * block takes its number when it starts (a counter after the others, as CUB's single-pass scan
 * numbers its tiles), not from blockIdx: every block a block waits for started before it, so
 * none waits for one that has no place to run, whatever order the GPU starts blocks in.
 * Grouped-query heads walk their query heads in the same order in every block of a kv head,
 * so the argument holds head by head.
 * Taken where one warpgroup owns 64 keys at head dim 64 and the statistics come from the saved
 * y (spec_attn.c); the f32 buffer is (B, H, T, 64), 4 bytes a value of q.
 *
 * Measured on an H200 it loses (docs/results.md, "(m)"): a traced GPT-2 d12 -O1 step's dk/dv
 * pass took 15.45 ms where the two passes take 6.99 + 3.85, and Llama 1.1B's step 137 ms
 * against 103 (its blocks walk eight query heads, and the blocks with the most steps start
 * last). Each step reads and writes 32 KiB of f32 sums in L2, twice the bytes of the step's q
 * and dy tiles, and adding the part a step later, under the next products, changed nothing:
 * the sums' traffic, not their latency, is the cost. So attn.dq_in_dkv is 0 by default and
 * not among fp8c tune's candidates; blocks of more keys (fewer sums a key) are what could
 * change that. */

/* ONE's scratch after its counters (B H nq u32, then the blocks'): the f32 sums (B H T 64) */
static __device__ __forceinline__ float *ck_attn_dq_sums(const CkArgs &a) {
    i64 B = a.i[0], T = a.i[1], H = a.i[2], counters = B * H * ((T + 63) / 64) + 1;
    return (float *)((char *)ck_attn_counters(a) + ((counters * 4 + 255) & ~(i64)255));
}

/* This block's part of dq for query tile qt of head hh, from key block kb, added in the order
 * above; the last part stores dq into q's columns of the packed gradient. The part is the
 * thread's accumulator fragment (rows row0, row0 + 8 of the tile, columns 8 n + 2 tig), its
 * element 4 n + i in shared memory at word (4 n + i) 128 + threadIdx.x of stash. Returns the
 * largest |dq| it stored (0 where it was not the last). Every thread of the block calls it. */
template <class Y>
static __device__ __forceinline__ float ck_attn_dq_part(const CkArgs &a, const float *stash, i64 b, i64 hh, int qt,
                                                        int kb, int row0, int tig, int Ti) {
    i64 T = a.i[1], H = a.i[2], Hkv = a.i[3], ycols = (H + 2 * Hkv) * 64;
    int before = qt - kb;   /* parts in ahead of this one */
    unsigned *count = ck_attn_counters(a) + (b * H + hh) * ((T + 63) / 64) + qt;
    if (before > 0) {
        if (threadIdx.x == 0) {
            unsigned seen;
            for (;;) {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(count) : "memory");
                if (seen == (unsigned)before) break;
                __nanosleep(64);
            }
        }
        __syncthreads();
    }
    float *sum = ck_attn_dq_sums(a) + (b * H + hh) * T * 64;
    float big = 0.0f;
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int row = row0 + r * 8, col = n * 8 + tig * 2;
            if (row >= Ti) continue;
            const float *part = stash + (4 * n + 2 * r) * 128 + threadIdx.x;
            float2 *at = (float2 *)(sum + (i64)row * 64 + col), v = make_float2(part[0], part[128]);
            if (before > 0) {
                float2 s = __ldcg(at);
                v = make_float2(s.x + v.x, s.y + v.y);
            }
            if (kb > 0) {
                __stcg(at, v);
            } else {
                i64 i = (b * T + row) * ycols + hh * 64 + col;
                ck_st_pair<Y>(a.t[0], i, v.x, v.y);
                big = fmaxf(big, fmaxf(fabsf(v.x), fabsf(v.y)));
            }
        }
    if (kb > 0) {   /* hand on: every thread's sums before the count */
        __syncthreads();
        if (threadIdx.x == 0)
            asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(count), "r"((unsigned)before + 1) : "memory");
    }
    return big;
}

/* ---------------------------------------------------------------- a key tile's steps in parts
 *
 * A dk/dv block of a grouped-query attention walks every query head of its group: at Llama
 * 1.1B's 4 x 2048 (32 heads, 4 kv heads) the block of keys 0-63 takes 8 x 32 steps and the
 * block of the last keys 8, and the 512 blocks' longest is 1.5 times the work that each of the
 * 396 places on the GPU (three blocks an SM) gets on average: with the heaviest first, the
 * pass ends a third of its time with SMs running out of blocks. With PARTS (the choice
 * attn.dkv_parts) a key tile's steps are cut into PARTS runs of nearly equal length, one block
 * each (the parts of a tile numbered together, after the heavier tiles' parts), and every
 * block's dk and dv are the sums of its run only. Each block stores its sums (f32, in the
 * accumulator's layout: value e of thread t at e THREADS + t, so a warp's stores are whole
 * lines) into the tile's slot in the scratch, fences, and takes the tile's ticket; the block
 * that takes the last one adds the PARTS slots in part order, its own from registers, and
 * stores dk and dv as a block of the whole tile would. So the result does not depend on which
 * part finishes last: the same bits in every run. The tickets are zeroed by the dq pass, which
 * runs before (ck_attn_wg_dq's ZERO); the f32 slots hold 8 D bytes a key and part, read back
 * from L2 by the last block. On an H200 Llama 1.1B -O1's dk/dv passes took 12.20 ms a step
 * whole and 9.86 in four parts (the rule's choice for it; two parts 10.07, eight 10.62), the
 * step 100.57 / 100.03 -> 98.28 / 98.25 ms in alternating runs (docs/results.md "(q)"). */

/* after the tickets, the parts' f32 sums */
static __device__ __forceinline__ float *ck_attn_dkv_sums(const CkArgs &a) {
    return (float *)((char *)ck_attn_counters(a) + ((ck_attn_dkv_tickets(a) * 4 + 255) & ~(i64)255));
}

/* This block's dk and dv sums (part `part` of key tile `tile`) into the tile's slot; true in the
 * block that took the last ticket, with dk and dv then the sums of all parts in part order.
 * Every thread of the block calls it. */
template <int D, int THREADS, int PARTS>
static __device__ __forceinline__ bool ck_attn_dkv_gather(const CkArgs &a, float (*dk)[4], float (*dv)[4], i64 tile,
                                                          int part) {
    __shared__ unsigned ticket;
    float *slot = ck_attn_dkv_sums(a) + tile * PARTS * D * THREADS;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            __stcg(slot + ((i64)part * D + 4 * n + i) * THREADS + threadIdx.x, dk[n][i]);
            __stcg(slot + ((i64)part * D + D / 2 + 4 * n + i) * THREADS + threadIdx.x, dv[n][i]);
        }
    __threadfence();   /* my sums, before the ticket */
    __syncthreads();
    if (threadIdx.x == 0) ticket = atomicAdd(ck_attn_counters(a) + tile, 1u);
    __syncthreads();
    if (ticket != PARTS - 1) return false;
    __threadfence();   /* the other parts' sums, after their tickets */
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float k = dk[n][i], v = dv[n][i], sk = 0.0f, sv = 0.0f;
            for (int p = 0; p < PARTS; p++) {
                float pk = p == part ? k : __ldcg(slot + ((i64)p * D + 4 * n + i) * THREADS + threadIdx.x);
                float pv = p == part ? v : __ldcg(slot + ((i64)p * D + D / 2 + 4 * n + i) * THREADS + threadIdx.x);
                sk = p ? sk + pk : pk, sv = p ? sv + pv : pv;
            }
            dk[n][i] = sk, dv[n][i] = sv;
        }
    return true;
}

/* dk, dv: one block per (b, kv head, 64 WGS keys), over the heads of the group and the 64-query
 * tiles at and after the keys (with PARTS, one part of those steps: above); t[1..4] = dy, q,
 * k, v; lse and Dt in the scratch (and with ONE, dq: above) */
template <int D, int WGS, class Y, class DY, class Q, class K, class V, int HG = 0, int SPLIT = 1, int ONE = 0,
          int PARTS = 1>
__device__ void ck_attn_wg_dkv(const CkArgs &a) {
    static_assert(D == 64 || D == 128, "wgmma attention takes head dims 64 and 128");
    static_assert(SPLIT == 1 || SPLIT == 2, "a step of 64 queries, whole or in two parts");
    static_assert(!ONE || (WGS == 1 && D == 64), "dq in the dk/dv pass: 64 keys a block, head dim 64");
    static_assert(PARTS >= 1 && PARTS <= 8 && (PARTS == 1 || !ONE), "a key tile's steps in 1 to 8 parts, not with ONE");
    constexpr int NQ = 64 / SPLIT;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkWgBwd<D, WGS> L;
    unsigned sK = (ck_smem(smem_raw) + 1023u) & ~1023u, sV = sK + L::WHOLE;
    unsigned sQY = sV + L::WHOLE;   /* [buffer][q, dy] tiles */
    float *sStat = (float *)(smem_raw + (sQY + 4 * L::TILE - ck_smem(smem_raw)));   /* [buffer][lse, Dt][64] */
    unsigned sDS = sQY + 4 * L::TILE + 4 * L::STEP * 4;   /* ONE: the step's dS^T (64 x 64 bf16), 1024-aligned */
    float *sDQ = (float *)(smem_raw + (sDS + 64 * 64 * 2 - ck_smem(smem_raw)));   /* ONE: the part waiting */
    int pend_hh = -1, pend_qt = 0;   /* ONE: the head and query tile of the part waiting, if any */
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3], grp = H / Hkv;
    float scale = (float)a.f[0], scale2 = scale * CK_LOG2E;   /* scores in base 2 */
    i64 bg, kt;
    if constexpr (ONE) {   /* a kv head's blocks together, the fewest steps first, numbered as they start */
        __shared__ unsigned started;
        i64 nkt = (T + 63) / 64;
        if (threadIdx.x == 0) started = atomicAdd(ck_attn_counters(a) + B * H * nkt, 1u);
        __syncthreads();
        bg = (i64)started / nkt, kt = nkt - 1 - (i64)started % nkt;
    } else {
        ck_attn_order(blockIdx.x / PARTS, B * Hkv, (T + L::ROWS - 1) / L::ROWS, HG, bg, kt);
    }
    i64 b = bg / Hkv, g = bg % Hkv;
    int k0 = (int)kt * L::ROWS, Ti = (int)T;
    int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    int keys = k0 + wg * 64, key0 = keys + warp * 16 + gid;   /* the warpgroup's, this thread's */
    int nq = (Ti - k0 + 63) / 64, total = (int)grp * nq;   /* (head, query tile) steps */
    const int part = (int)(blockIdx.x % PARTS);   /* the block's part of the steps: [first, end) */
    int first = part * total / PARTS, end = (part + 1) * total / PARTS;

    /* q, dy, lse and Dt of step `it` into buffer `buf` */
    auto stage = [&](int it, int buf) {
        i64 hh = g * grp + it / nq;
        int q0 = k0 + (it % nq) * 64;
        unsigned q = sQY + buf * 2 * L::TILE;
        ck_wg_load<D, L::STEP, L::THREADS>(q, a.t[2], b, T, q0, a.i[5], a.i[6] + hh * D);
        ck_wg_load<D, L::STEP, L::THREADS>(q + L::TILE, a.t[1], b, T, q0, H * D, hh * D);
        ck_attn_stage_stats(a, sStat + buf * 2 * L::STEP, b, hh, q0, Ti);
    };
    ck_wg_load<D, L::ROWS, L::THREADS>(sK, a.t[3], b, T, k0, a.i[7], a.i[8] + g * D);
    ck_wg_load<D, L::ROWS, L::THREADS>(sV, a.t[4], b, T, k0, a.i[9], a.i[10] + g * D);
    if (first < end) stage(first, first & 1);

    float dk[D / 8][4], dv[D / 8][4], dq_big = 0.0f;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) dk[n][i] = dv[n][i] = 0.0f;
    for (int it = first; it < end; it++) {
        ck_cp_wait();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   /* my writes, to wgmma */
        __syncthreads();   /* step it is in, and both warpgroups are done with buffer (it + 1) & 1 */
        if (it + 1 < end) stage(it + 1, (it + 1) & 1);
        int q0 = k0 + (it % nq) * 64;
        if (keys >= Ti || q0 + 63 < keys) continue;   /* no key, or every query before every key */
        unsigned sQ = sQY + (it & 1) * 2 * L::TILE, sDY = sQ + L::TILE;
        const float *sL = sStat + (it & 1) * 2 * L::STEP, *sDt = sL + L::STEP;

        /* The step's queries in SPLIT parts of NQ (attn.dkv_split): S^T = K Q^T, then
         * dP^T = V dY^T, 64 keys x NQ queries per warpgroup, in two commit groups; each product
         * after them is issued as soon as its operand is made, so that the tensor cores run one
         * while the warpgroup computes the next operand:
         *   S^T in     -> P^T            (dP^T running)
         *   dP^T in    -> dS^T           (dV += P^T dY running)
         *   dK += dS^T Q, and wait for both
         * A part of 32 queries holds half the registers of 64 (S^T, dP^T and their operands),
         * for three blocks an SM instead of two, at the price of narrower products. */
#pragma unroll
        for (int part = 0; part < SPLIT; part++) {
            const int qp = q0 + part * NQ;   /* the part's first query */
            if (qp + NQ - 1 < keys) continue;
            float st[NQ / 8][4], dpt[NQ / 8][4];
            ck_wg_hold<NQ / 2>(&st[0][0]);
            ck_wg_hold<NQ / 2>(&dpt[0][0]);
            ck_wg_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                unsigned mine = (kk >> 2) * L::ROWS * 128 + wg * 64 * 128 + (kk & 3) * 32;
                unsigned tile = (kk >> 2) * L::STEP * 128 + part * NQ * 128 + (kk & 3) * 32;
                ck_wg_ss<NQ>(&st[0][0], ck_wg_desc(sK + mine, 16, 1024), ck_wg_desc(sQ + tile, 16, 1024), kk > 0);
            }
            ck_wg_commit();
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                unsigned mine = (kk >> 2) * L::ROWS * 128 + wg * 64 * 128 + (kk & 3) * 32;
                unsigned tile = (kk >> 2) * L::STEP * 128 + part * NQ * 128 + (kk & 3) * 32;
                ck_wg_ss<NQ>(&dpt[0][0], ck_wg_desc(sV + mine, 16, 1024), ck_wg_desc(sDY + tile, 16, 1024), kk > 0);
            }
            ck_wg_commit();
            if constexpr (ONE)   /* the last step's part of dq, while S^T and dP^T run */
                if (part == 0 && pend_hh >= 0) {
                    dq_big = fmaxf(dq_big, ck_attn_dq_part<Y>(a, sDQ, b, pend_hh, pend_qt, (int)kt,
                                                              pend_qt * 64 + warp * 16 + gid, tig, Ti));
                    pend_hh = -1;
                }
            ck_wg_wait_but_last();
            ck_wg_hold<NQ / 2>(&st[0][0]);

            /* P^T (queries are columns: lse per column) as bf16 A operands, P^T kept in f32
             * for dS^T; masked S^T is -inf (P = 0) only where the part meets the diagonal or T */
            if (qp < keys + 63 || qp + NQ > Ti)
#pragma unroll
                for (int n = 0; n < NQ / 8; n++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int key = key0 + (i >> 1) * 8, tq = qp + n * 8 + tig * 2 + (i & 1);
                        if (key > tq || tq >= Ti) st[n][i] = -CK_INF;
                    }
            unsigned pf[NQ / 16][4], df[NQ / 16][4];
#pragma unroll
            for (int n = 0; n < NQ / 8; n++) {
                float2 lq = *(const float2 *)(sL + part * NQ + n * 8 + tig * 2);
#pragma unroll
                for (int i = 0; i < 4; i++)
                    st[n][i] = ck_ex2(fmaf(st[n][i], scale2, -(i & 1 ? lq.y : lq.x) * CK_LOG2E));
                pf[n >> 1][(n & 1) * 2] = ck_pack(st[n][0], st[n][1]);
                pf[n >> 1][(n & 1) * 2 + 1] = ck_pack(st[n][2], st[n][3]);
            }

            /* dV += P^T dY: dY as an MN-major B operand (queries along k) */
            ck_wg_hold<D / 2>(&dv[0][0]);
            ck_wg_hold<NQ / 4>(&pf[0][0]);
            ck_wg_fence();
#pragma unroll
            for (int kk = 0; kk < NQ / 16; kk++)
                ck_wg_rs<D>(&dv[0][0], pf[kk], ck_wg_desc(sDY + (part * NQ / 16 + kk) * 16 * 128, L::STEP * 128, 1024));
            ck_wg_commit();

            /* dS^T = P^T (dP^T - Dt) scale (Dt per column), as bf16 A operands */
            ck_wg_wait_but_last();
            ck_wg_hold<NQ / 2>(&dpt[0][0]);
#pragma unroll
            for (int n = 0; n < NQ / 8; n++) {
                float2 dtq = *(const float2 *)(sDt + part * NQ + n * 8 + tig * 2);
                float ds[4];
#pragma unroll
                for (int i = 0; i < 4; i++) ds[i] = st[n][i] * (dpt[n][i] - (i & 1 ? dtq.y : dtq.x)) * scale;
                df[n >> 1][(n & 1) * 2] = ck_pack(ds[0], ds[1]);
                df[n >> 1][(n & 1) * 2 + 1] = ck_pack(ds[2], ds[3]);
                if constexpr (ONE) {   /* dS^T into the swizzled tile: row key, queries along it */
                    int r = warp * 16 + gid, c = part * NQ + n * 8 + tig * 2;
                    unsigned at = sDS + ck_wg_chunk<64>(r, c >> 3) + (c & 7) * 2;
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(df[n >> 1][(n & 1) * 2]));
                    at = sDS + ck_wg_chunk<64>(r + 8, c >> 3) + (c & 7) * 2;
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(df[n >> 1][(n & 1) * 2 + 1]));
                }
            }

            /* dK += dS^T Q: Q as an MN-major B operand */
            ck_wg_hold<D / 2>(&dk[0][0]);
            ck_wg_hold<NQ / 4>(&df[0][0]);
            ck_wg_fence();
#pragma unroll
            for (int kk = 0; kk < NQ / 16; kk++)
                ck_wg_rs<D>(&dk[0][0], df[kk], ck_wg_desc(sQ + (part * NQ / 16 + kk) * 16 * 128, L::STEP * 128, 1024));
            ck_wg_commit();
            ck_wg_wait();
            ck_wg_hold<D / 2>(&dv[0][0]);
            ck_wg_hold<D / 2>(&dk[0][0]);
        }
        if constexpr (ONE) {
            /* dQ_part = dS K: dS^T's tile and K read transposed, a k-step 16 keys (2048 bytes) on */
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   /* dS^T, to wgmma */
            __syncthreads();
            float dq[8][4];
            ck_wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                ck_wg_ss64_mn(&dq[0][0], ck_wg_desc(sDS + kk * 16 * 128, 64 * 128, 1024),
                              ck_wg_desc(sK + kk * 16 * 128, L::ROWS * 128, 1024), kk > 0);
            ck_wg_commit();
            ck_wg_wait();
            ck_wg_hold<32>(&dq[0][0]);
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) sDQ[(4 * n + i) * 128 + threadIdx.x] = dq[n][i];
            pend_hh = (int)(g * grp + it / nq), pend_qt = q0 >> 6;
        }
    }
    if constexpr (ONE)
        if (pend_hh >= 0)
            dq_big = fmaxf(dq_big, ck_attn_dq_part<Y>(a, sDQ, b, pend_hh, pend_qt, (int)kt,
                                                      pend_qt * 64 + warp * 16 + gid, tig, Ti));
    if constexpr (PARTS > 1)
        if (!ck_attn_dkv_gather<D, L::THREADS, PARTS>(a, dk, dv, blockIdx.x / PARTS, (int)(blockIdx.x % PARTS))) {
            ck_attn_scale_out<Y>(a, 0.0f);   /* every block counts towards the last one */
            return;
        }
    ck_attn_dkv_store<D, Y>(a, dk, dv, b, g, key0, tig, Ti, dq_big);
}
