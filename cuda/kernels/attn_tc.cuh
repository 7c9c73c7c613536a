/* attn_tc.cuh — the same attention on the tensor cores (bf16 q, k, v; mma.sync m16n8k16).
 *
 * The algorithm is attn.cuh's — 64 x 64 tiles, online softmax forward, a statistics rerun and
 * separate dq and dk/dv passes backward, each output written by one block — laid out as
 * FlashAttention-2 lays it out, so that only the bf16 operand tiles (and the dk/dv pass's lse and
 * Dt) go through shared memory. A block is four warps and owns 64 rows; each warp owns 16 of them.
 * A tile product such as S = Q K^T leaves, in each thread, the elements of two rows (groupID and
 * groupID + 8) in the accumulator fragment of m16n8k16, so a row's max and sum are the thread's
 * own values plus two shuffles over the four threads of a quad, and the output's rescaling is a
 * multiply in registers. That accumulator layout is also the layout of the A operand of the next
 * product (pairs of f32 become bf16x2), so P = exp(S - m) feeds O += P V, and dS feeds dQ += dS K,
 * without leaving registers.
 *
 * The dk/dv pass computes S^T = K Q^T (keys as rows) as attn.cuh does, so that P^T and dS^T come
 * out as A operands of dV += P^T dY and dK += dS^T Q; the operands that must be read along the
 * other axis (V and K for P V and dS K, dY and Q there) are loaded transposed by ldmatrix.trans
 * from the same row-major tiles. Tiles are copied with 16-byte cp.async into rows padded by 16
 * bytes (a row then starts four banks after the previous one, so the eight row addresses of an
 * ldmatrix hit distinct banks), double-buffered: the next key (or query) tile is in flight while
 * the current one is multiplied. The causal mask costs work only in the tiles that meet the
 * diagonal (or T). Heavy blocks (late query tiles, early key tiles) are numbered first, for every
 * head at once, so that none of them starts last and trails the grid.
 *
 * Precision: P and dS are rounded to bf16 as the operands of their products (FlashAttention does
 * the same); the softmax's row sums add the f32 values before that rounding, exp is ex2.approx of
 * f32 scores scaled to base 2 (ck_ex2),
 * every product accumulates in f32. Each output element is written by one thread of one block and
 * every sum runs in a fixed order, so results repeat bit for bit. The tests bound the result
 * against the reference's f64. Used when q, k, v (and dy) are plain bf16 and the head dim is a
 * multiple of 16 up to 128; other formats take attn.cuh.
 *
 * Fragments of mma.m16n8k16 (PTX ISA; lane = 4 groupID + tig, pairs packed low element
 * first):
 *   A (16 x 16, row-major): a0 (groupID, 2 tig + {0,1}), a1 (groupID + 8, 2 tig + {0,1}),
 *                           a2 (groupID, 2 tig + 8 + {0,1}), a3 (groupID + 8, 2 tig + 8 + {0,1})
 *   B (16 x 8, k by n):     b0 (k = 2 tig + {0,1}, n = groupID), b1 (k = 2 tig + 8 + {0,1}, n)
 *   C (16 x 8, f32):        c0, c1 (groupID, 2 tig + {0,1}), c2, c3 (groupID + 8, 2 tig + {0,1})
 * ldmatrix.x4 reads four 8 x 8 b16 matrices; lanes 8 i .. 8 i + 7 give the row addresses of
 * matrix i, and register i of a lane receives (row groupID, columns 2 tig + {0,1}) of matrix i,
 * or with .trans (rows 2 tig + {0,1}, column groupID). Hence, for a 16 x 16 block at (r0, c0)
 * of a row-major tile:
 *   A operand, or B operand from a (k, n) tile with .trans: lane gives row r0 + lane % 16,
 *     column c0 + 8 (lane / 16); registers a0..a3, or b0 b1 of n-block 0 then of n-block 1;
 *   B operand from an (n, k) tile (K for Q K^T): lane gives row r0 + lane % 8 + 8 (lane / 16),
 *     column c0 + 8 (lane / 8 % 2); registers b0 b1 of n-block 0 (rows r0..), then of n-block 1.
 * The C fragments of two adjacent n-blocks j = 2 kk, 2 kk + 1 are the A fragment of k-chunk
 * kk: {c0 c1, c2 c3} of block 2 kk become a0, a1, those of block 2 kk + 1 a2, a3. */

#define CK_TC_THREADS 128      /* four warps, 16 rows each */

/* shared memory, in bytes; cuda/spec.c computes the same sizes */
template <int D> struct CkTc {
    enum {
        LD = D + 8,                        /* bf16 row stride of every tile (16 bytes of padding) */
        TILE = 64 * LD * 2,                /* one bf16 (64, D) tile */
        FWD = 5 * TILE,                    /* q; k, v twice */
        DQ = 6 * TILE,                     /* q, dy; k, v twice */
        DKV = 6 * TILE + 4 * 64 * 4,       /* k, v; q, dy, lse, Dt twice */
        NC = 32                            /* query columns per step of dk/dv: S^T, dP^T, P^T and
                                              dS^T beside dK and dV in few enough registers for
                                              three blocks on an SM at D = 64 */
    };
};

static __device__ __forceinline__ unsigned ck_smem(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

/* 16 bytes global -> shared, zeros when !in (nothing is read then) */
static __device__ __forceinline__ void ck_cp16(void *dst, const void *src, bool in) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(ck_smem(dst)), "l"(src), "r"(in ? 16 : 0));
}
static __device__ __forceinline__ void ck_cp4(void *dst, const void *src, bool in) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(ck_smem(dst)), "l"(src), "r"(in ? 4 : 0));
}
static __device__ __forceinline__ void ck_cp_wait() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

static __device__ __forceinline__ void ck_ldm(unsigned *r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
static __device__ __forceinline__ void ck_ldm_t(unsigned *r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

/* c (16 x 8, f32) += a (16 x 16) b (16 x 8), bf16 operands */
static __device__ __forceinline__ void ck_mma(float *c, const unsigned *a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* two f32 as a bf16x2 operand register, lo in the low half (round to nearest even) */
static __device__ __forceinline__ unsigned ck_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(unsigned *)&v;
}

/* 2^x by the SFU (ex2.approx: relative error about 2^-22; 0 for -inf). The softmax works in
 * base 2, its scores multiplied by scale log2(e) once, so that each probability is one
 * subtraction (or multiply-add) and one ex2, where expf wraps the same ex2 in a range reduction
 * of its own; the lse kept for the backward stays a natural logarithm. */
#define CK_LOG2E 1.4426950408889634f
#define CK_LN2 0.6931471805599453f
static __device__ __forceinline__ float ck_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* the lane's element offset into a tile for ldmatrix, see the head of the file */
template <int D> static __device__ __forceinline__ int ck_off_a() {
    int lane = threadIdx.x & 31;
    return (lane & 15) * (D + 8) + (lane >> 4) * 8;
}
template <int D> static __device__ __forceinline__ int ck_off_b() {
    int lane = threadIdx.x & 31;
    return ((lane & 7) + ((lane >> 4) << 3)) * (D + 8) + ((lane >> 3) & 1) * 8;
}

/* Rows [t0, t0 + 64) of one head (D bf16 columns from col0, rows stride apart) into a tile of
 * row stride D + 8, zeros past T; asynchronous until ck_cp_wait. With D a multiple of 16 (the
 * only head dims spec.c sends here), strides and column offsets are multiples of 16 elements,
 * so every 16-byte chunk is aligned when the tensor's base is (the memory plan aligns to 256
 * bytes); a base that is not takes element copies. */
/* acc (16 x D per warp) += a (16 x 16 KC: the A fragments of KC k-chunks) times the (16 KC, D)
 * row-major tile at shared address base, which ldmatrix.trans reads as the B operand: O += P V,
 * dQ += dS K, dV += P^T dY, dK += dS^T Q. */
template <int D, int KC>
static __device__ __forceinline__ void ck_mma_tile_t(float (*acc)[4], const unsigned (*a)[4], unsigned base) {
#pragma unroll
    for (int kk = 0; kk < KC; kk++)
#pragma unroll
        for (int p = 0; p < D / 16; p++) {
            unsigned f[4];
            ck_ldm_t(f, base + (kk * 16 * CkTc<D>::LD + p * 16) * 2);
            ck_mma(acc[2 * p], a[kk], f[0], f[1]);
            ck_mma(acc[2 * p + 1], a[kk], f[2], f[3]);
        }
}

template <int D>
static __device__ __forceinline__ void ck_tc_load(__nv_bfloat16 *s, const CkTensor &x, i64 b, i64 T, i64 t0,
                                                  i64 stride, i64 col0) {
    const __nv_bfloat16 *p = (const __nv_bfloat16 *)x.p;
    bool vec = ((size_t)p & 15) == 0;
    const int CH = D / 8;   /* 16-byte chunks per row */
#pragma unroll
    for (int k = 0; k < 64 * CH / CK_TC_THREADS; k++) {
        int e = threadIdx.x + k * CK_TC_THREADS, r = e / CH, c = e - r * CH;
        bool in = t0 + r < T;
        const __nv_bfloat16 *src = p + (b * T + (in ? t0 + r : 0)) * stride + col0 + c * 8;
        __nv_bfloat16 *dst = s + r * (D + 8) + c * 8;
        if (vec) ck_cp16(dst, src, in);
        else
            for (int j = 0; j < 8; j++) dst[j] = in ? src[j] : __float2bfloat16_rn(0.0f);
    }
}

/* One 64-key tile of the online softmax, for the 16 rows of a warp (rows row0 and row0 + 8 of
 * each quad, as m16n8k16's accumulator and the per-warp slice of wgmma's m64n64 accumulator
 * both lay them out): s (S = Q K^T, 8 n-blocks of keys k0 + 8 n ..) is scaled to base 2 and,
 * where `edge` (the tile meets the diagonal or T), masked; the running max m and sum l are
 * updated, P = 2^(s - max) is packed into pf as the bf16 A operand of P V (k-chunk n / 2), and
 * corr is the factor that rescales O. */
/* The tile's masking where `edge` (keys past the row or past T to -inf) and each of the two
 * rows' largest value among the thread's, over NB n-blocks of 8 keys (ck_softmax_tile and
 * attn_ws.cuh's ck_ws_softmax_tile; the quad's maximum is theirs to take) */
template <int NB = 8>
static __device__ __forceinline__ void ck_tile_mask_max(float (*s)[4], bool edge, int k0, int row0, int tig, int Ti,
                                                        float *mx) {
    if (edge)
#pragma unroll
        for (int n = 0; n < NB; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int col = k0 + n * 8 + tig * 2 + (i & 1), row = row0 + (i >> 1) * 8;
                if (col > row || col >= Ti) s[n][i] = -CK_INF;
            }
    mx[0] = mx[1] = -CK_INF;
#pragma unroll
    for (int n = 0; n < NB; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) mx[i >> 1] = fmaxf(mx[i >> 1], s[n][i]);
}

/* n-block n's probabilities of the two rows (p0, p1 of row0; p2, p3 of row0 + 8): into the
 * thread's row sums rs and, packed to bf16, into pf as P V's A operand */
static __device__ __forceinline__ void ck_tile_keep_p(int n, float p0, float p1, float p2, float p3, float *rs,
                                                      unsigned (*pf)[4]) {
    rs[0] += p0 + p1;
    rs[1] += p2 + p3;
    pf[n >> 1][(n & 1) * 2] = ck_pack(p0, p1);
    pf[n >> 1][(n & 1) * 2 + 1] = ck_pack(p2, p3);
}

/* the quad's row sums rs into the running sums l, rescaled by corr */
static __device__ __forceinline__ void ck_tile_sum_rows(float *rs, float *l, const float *corr) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 1);
        rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 2);
        l[r] = l[r] * corr[r] + rs[r];
    }
}

/* ck_softmax_tile's part after the mask, from the thread's row maxima mx, over NB n-blocks.
 * FUSED = false: s and mx are already in base 2; true (attn_ws.cuh's rounding): they are raw
 * scores, and each probability takes the scaling and the subtraction in one multiply-add. */
template <int NB = 8, bool FUSED = false>
static __device__ __forceinline__ void ck_softmax_rows(float (*s)[4], float *mx, float scale2, float *m, float *l,
                                                       unsigned (*pf)[4], float *corr) {
    float muse[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        float mnew = fmaxf(m[r], FUSED ? mx[r] * scale2 : mx[r]);
        muse[r] = mnew == -CK_INF ? 0.0f : mnew;
        corr[r] = ck_ex2(m[r] - muse[r]);
        m[r] = mnew;
    }
    float rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NB; n++) {
        float p0 = FUSED ? ck_ex2(fmaf(s[n][0], scale2, -muse[0])) : ck_ex2(s[n][0] - muse[0]);
        float p1 = FUSED ? ck_ex2(fmaf(s[n][1], scale2, -muse[0])) : ck_ex2(s[n][1] - muse[0]);
        float p2 = FUSED ? ck_ex2(fmaf(s[n][2], scale2, -muse[1])) : ck_ex2(s[n][2] - muse[1]);
        float p3 = FUSED ? ck_ex2(fmaf(s[n][3], scale2, -muse[1])) : ck_ex2(s[n][3] - muse[1]);
        ck_tile_keep_p(n, p0, p1, p2, p3, rs, pf);
    }
    ck_tile_sum_rows(rs, l, corr);
}

static __device__ __forceinline__ void ck_softmax_tile(float (*s)[4], float scale2, bool edge, int k0, int row0,
                                                       int tig, int Ti, float *m, float *l, unsigned (*pf)[4],
                                                       float *corr) {
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) s[n][i] *= scale2;
    float mx[2];
    ck_tile_mask_max(s, edge, k0, row0, tig, Ti, mx);
    ck_softmax_rows(s, mx, scale2, m, l, pf, corr);
}

/* The mask without a branch (the pipelined walks, attn_wgmma.cuh and attn_ws.cuh): key k0 + c
 * of row r is kept where c <= min(r, T - 1) - k0; lim[r] is that bound less the thread's first
 * column 2 tig, so each element is one comparison with a constant and a select, and a tile
 * that meets neither the diagonal nor T keeps every key: the -inf that ck_tile_mask_max puts,
 * in the same places. (ptxas serializes a warpgroup's products where a branch it cannot prove
 * uniform falls between a product's issue and its wait.) */
template <int NB>
static __device__ __forceinline__ void ck_tile_mask_lim_max(float (*s)[4], const int *lim, float *mx) {
    mx[0] = mx[1] = -CK_INF;
#pragma unroll
    for (int n = 0; n < NB; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s[n][i] = n * 8 + (i & 1) > lim[i >> 1] ? -CK_INF : s[n][i];
            mx[i >> 1] = fmaxf(mx[i >> 1], s[n][i]);
        }
}

/* The per-tensor scale of the result, computed by the launches that write it (spec_scales.c,
 * fold_attention_scales), so that no pass over the result reads it again for its amax. Where
 * t[CK_ATTN_SCALE] is set, each block folds the largest |value| it stored (m: the thread's,
 * before rounding; rounding is monotonic, so rounding the maximum gives the maximum of the
 * stored values) into a running maximum at ticket[1]: an atomicMax on the bits, which for
 * floats >= 0 order as the floats do, and a maximum is the same whatever order the blocks
 * finish in. The last block of the launch that ends the result (the backward's dk/dv pass,
 * after its dq pass; f[CK_ATTN_SCALE_MAX] = max(elem) there, 0 on the launch before it) turns
 * the maximum into the scale as ck_store_scale does, margin f[CK_ATTN_SCALE_MARGIN], and sets
 * the maximum back to zero for the next. Every thread of the block calls it, after its last
 * store. */
#define CK_ATTN_SCALE (CK_MAX_TENSORS - 1)
#define CK_ATTN_SCALE_MAX 1
#define CK_ATTN_SCALE_MARGIN 2
template <class Y> static __device__ void ck_attn_scale_out(const CkArgs &a, float m) {
    if (!a.t[CK_ATTN_SCALE].p) return;
    m = ck_block_max(m);
    if (threadIdx.x == 0 && m > 0.0f) atomicMax(a.ticket + 1, __float_as_uint(Y::round(a.t[0], 0, m)));
    if (!ck_last_block(a) || a.f[CK_ATTN_SCALE_MAX] == 0.0 || threadIdx.x != 0) return;
    float amax = __uint_as_float(atomicExch(a.ticket + 1, 0u));
    *(float *)a.t[CK_ATTN_SCALE].p =
        ck_amax_usable(amax) ? ck_scale_for(a.f[CK_ATTN_SCALE_MAX], amax, (i64)a.f[CK_ATTN_SCALE_MARGIN]) : 1.0f;
}

/* Elements i and i + 1 of t: one four-byte store where t is plain bf16 and element i is at a
 * multiple of four bytes (a thread's two adjacent columns of an accumulator fragment), two
 * stores otherwise; the same bits either way (round to nearest even). */
template <class Y> static __device__ __forceinline__ void ck_st_pair(const CkTensor &t, i64 i, float v0, float v1) {
    if constexpr (Y::elem == FMT_BF16 && Y::scaling == SCALE_NONE) {
        if ((((size_t)t.p >> 1) + (size_t)i) % 2 == 0 && (size_t)t.p % 2 == 0) {
            *(unsigned *)((__nv_bfloat16 *)t.p + i) = ck_pack(v0, v1);
            return;
        }
    }
    Y::st(t, i, v0);
    Y::st(t, i + 1, v1);
}

/* The end of a forward for a warp's 16 rows (the accumulator layout of ck_softmax_tile): MODE 0
 * stores y = O / l and, with lse (i[11]), each row's logsumexp after y (and, folded, y's scale:
 * ck_attn_scale_out); MODE 1 (t[1] = dy) leaves in the scratch each row's logsumexp and
 * Dt = rowsum(dy * y), which the backward's dq and dk/dv passes read. */
template <int D, int MODE, class Y, class DY>
static __device__ __forceinline__ void ck_attn_fwd_finish(const CkArgs &a, const float (*o)[4], const float *m,
                                                          const float *l, i64 b, i64 h, int row0, int tig, int Ti) {
    i64 B = a.i[0], T = a.i[1], H = a.i[2];
    /* 1 / l once a row (l >= 1 where the row is before T: its largest term is 2^0) */
    float inv[2] = {row0 < Ti ? 1.0f / l[0] : 0.0f, row0 + 8 < Ti ? 1.0f / l[1] : 0.0f};
    if (MODE == 0) {
        float big = 0.0f;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                int row = row0 + r * 8, col = n * 8 + tig * 2;
                float v0 = o[n][2 * r] * inv[r], v1 = o[n][2 * r + 1] * inv[r];
                if (row < Ti) {
                    ck_st_pair<Y>(a.t[0], (b * T + row) * H * D + h * D + col, v0, v1);
                    big = fmaxf(big, fmaxf(fabsf(v0), fabsf(v1)));
                }
            }
        if (a.i[11])
#pragma unroll
            for (int r = 0; r < 2; r++) {
                int row = row0 + r * 8;
                if (row < Ti && tig == 0) ck_attn_lse_out(a)[(b * H + h) * T + row] = m[r] * CK_LN2 + logf(l[r]);
            }
        ck_attn_scale_out<Y>(a, big);
        return;
    }
    float dsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row = row0 + (i >> 1) * 8, col = n * 8 + tig * 2 + (i & 1);
            if (row < Ti)
                dsum[i >> 1] = fmaf(DY::ld(a.t[1], (b * T + row) * H * D + h * D + col), o[n][i] * inv[i >> 1], dsum[i >> 1]);
        }
    float *lse = (float *)a.scratch, *dd = lse + B * H * T;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        dsum[r] += __shfl_xor_sync(0xffffffffu, dsum[r], 1);
        dsum[r] += __shfl_xor_sync(0xffffffffu, dsum[r], 2);
        int row = row0 + r * 8;
        if (row < Ti && tig == 0) {
            lse[(b * H + h) * T + row] = m[r] * CK_LN2 + logf(l[r]);
            dd[(b * H + h) * T + row] = dsum[r];
        }
    }
}

/* MODE 0: y = attention(q, k, v); MODE 1 (t[1] = dy): lse and Dt into scratch */
template <int D, int MODE, class Y, class Q, class K, class V, class DY>
__device__ void ck_attn_tc_fwd(const CkArgs &a) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkTc<D> L;
    __nv_bfloat16 *sQ = (__nv_bfloat16 *)smem_raw, *sKV = sQ + 64 * L::LD;   /* [buffer][k, v] tiles */
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3];
    float scale = (float)a.f[0], scale2 = scale * CK_LOG2E;   /* scores in base 2 */
    i64 n_qt = (T + 63) / 64;
    i64 bh = blockIdx.x % (B * H), qt = n_qt - 1 - blockIdx.x / (B * H), b = bh / H, h = bh % H, g = h / (H / Hkv);
    int q0 = (int)qt * 64, Ti = (int)T;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    int row0 = q0 + warp * 16 + gid;   /* this thread's rows: row0, row0 + 8 */
    const CkTensor &tq = a.t[MODE + 1], &tk = a.t[MODE + 2], &tv = a.t[MODE + 3];

    int n_kt = ((q0 + 63 < Ti - 1 ? q0 + 63 : Ti - 1) >> 6) + 1;
    ck_tc_load<D>(sQ, tq, b, T, q0, a.i[5], a.i[6] + h * D);
    ck_tc_load<D>(sKV, tk, b, T, 0, a.i[7], a.i[8] + g * D);
    ck_tc_load<D>(sKV + 64 * L::LD, tv, b, T, 0, a.i[9], a.i[10] + g * D);
    ck_cp_wait();
    __syncthreads();
    unsigned qf[D / 16][4];
    unsigned aq = ck_smem(sQ + warp * 16 * L::LD + ck_off_a<D>());
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) ck_ldm(qf[kk], aq + kk * 32);

    float o[D / 8][4], m[2] = {-CK_INF, -CK_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    for (int j = 0; j < n_kt; j++) {
        if (j > 0) {
            ck_cp_wait();
            __syncthreads();   /* tile j is in, and every warp is done with buffer (j + 1) & 1 */
        }
        if (j + 1 < n_kt) {
            __nv_bfloat16 *nk = sKV + ((j + 1) & 1) * 128 * L::LD;
            ck_tc_load<D>(nk, tk, b, T, (j + 1) * 64, a.i[7], a.i[8] + g * D);
            ck_tc_load<D>(nk + 64 * L::LD, tv, b, T, (j + 1) * 64, a.i[9], a.i[10] + g * D);
        }
        const __nv_bfloat16 *sK = sKV + (j & 1) * 128 * L::LD, *sV = sK + 64 * L::LD;
        int k0 = j * 64;

        /* S = Q K^T, 16 x 64 per warp: n-block n holds keys k0 + 8 n .. */
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        unsigned bk = ck_smem(sK + ck_off_b<D>());
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
            for (int p = 0; p < 4; p++) {
                unsigned f[4];
                ck_ldm(f, bk + (p * 16 * L::LD + kk * 16) * 2);
                ck_mma(s[2 * p], qf[kk], f[0], f[1]);
                ck_mma(s[2 * p + 1], qf[kk], f[2], f[3]);
            }

        /* online softmax on the fragments; the mask only where the tile meets the diagonal or T */
        unsigned pf[4][4];
        float corr[2];
        ck_softmax_tile(s, scale2, k0 + 63 > q0 + warp * 16 || k0 + 64 > Ti, k0, row0, tig, Ti, m, l, pf, corr);

        /* O = O corr + P V: V is (keys, d), read transposed as the B operand */
        unsigned bv = ck_smem(sV + ck_off_a<D>());
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[n][0] *= corr[0], o[n][1] *= corr[0];
            o[n][2] *= corr[1], o[n][3] *= corr[1];
        }
        ck_mma_tile_t<D, 4>(o, pf, bv);
    }

    ck_attn_fwd_finish<D, MODE, Y, DY>(a, o, m, l, b, h, row0, tig, Ti);
}

/* The backward's reads and writes that attn_tc's and attn_wgmma's passes share, for a warp's
 * 16 rows in the accumulator layout (rows row0 and row0 + 8 of a quad, columns 8 n + 2 tig):
 * the two rows' logsumexp (in base 2) and Dt from the scratch the statistics pass filled,
 * zeros past T; dq into q's columns of the packed gradient; dk and dv into k's and v's; and,
 * for the dk/dv passes, a query tile's logsumexp and Dt staged in shared memory. */
static __device__ __forceinline__ void ck_attn_row_stats(const CkArgs &a, i64 b, i64 h, int row0, int Ti, float *ls,
                                                         float *dt) {
    i64 B = a.i[0], T = a.i[1], H = a.i[2];
    const float *lse = (const float *)a.scratch, *dd = lse + B * H * T;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = row0 + r * 8;
        ls[r] = row < Ti ? lse[(b * H + h) * T + row] * CK_LOG2E : 0.0f;   /* base 2 */
        dt[r] = row < Ti ? dd[(b * H + h) * T + row] : 0.0f;
    }
}
/* The 64 queries from q0 of head hh, for a dk/dv pass: threads 0-63 copy their logsumexp and
 * 64-127 their Dt into dst (two rows of 64 floats), asynchronously until ck_cp_wait; zeros
 * past T. */
static __device__ __forceinline__ void ck_attn_stage_stats(const CkArgs &a, float *dst, i64 b, i64 hh, int q0,
                                                           int Ti) {
    i64 B = a.i[0], T = a.i[1], H = a.i[2];
    const float *lse = (const float *)a.scratch, *dd = lse + B * H * T;
    if (threadIdx.x < 128) {
        int t = q0 + (threadIdx.x & 63);
        const float *src = (threadIdx.x < 64 ? lse : dd) + (b * H + hh) * T + (t < Ti ? t : 0);
        ck_cp4(dst + threadIdx.x, src, t < Ti);
    }
}
template <int D, class Y>
static __device__ __forceinline__ void ck_attn_dq_store(const CkArgs &a, const float (*dq)[4], i64 b, i64 h,
                                                        int row0, int tig, int Ti) {
    i64 T = a.i[1], H = a.i[2], Hkv = a.i[3], ycols = (H + 2 * Hkv) * D;
    float big = 0.0f;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int row = row0 + r * 8, col = n * 8 + tig * 2;
            if (row < Ti) {
                ck_st_pair<Y>(a.t[0], (b * T + row) * ycols + h * D + col, dq[n][2 * r], dq[n][2 * r + 1]);
                big = fmaxf(big, fmaxf(fabsf(dq[n][2 * r]), fabsf(dq[n][2 * r + 1])));
            }
        }
    ck_attn_scale_out<Y>(a, big);
}
template <int D, class Y>
static __device__ __forceinline__ void ck_attn_dkv_store(const CkArgs &a, const float (*dk)[4], const float (*dv)[4],
                                                         i64 b, i64 g, int key0, int tig, int Ti, float big = 0.0f) {
    i64 T = a.i[1], H = a.i[2], Hkv = a.i[3], ycols = (H + 2 * Hkv) * D;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int key = key0 + r * 8, col = n * 8 + tig * 2;
            if (key < Ti) {
                const float *k2 = &dk[n][2 * r], *v2 = &dv[n][2 * r];
                ck_st_pair<Y>(a.t[0], (b * T + key) * ycols + H * D + g * D + col, k2[0], k2[1]);
                ck_st_pair<Y>(a.t[0], (b * T + key) * ycols + (H + Hkv) * D + g * D + col, v2[0], v2[1]);
                big = fmaxf(big, fmaxf(fmaxf(fabsf(k2[0]), fabsf(k2[1])), fmaxf(fabsf(v2[0]), fabsf(v2[1]))));
            }
        }
    ck_attn_scale_out<Y>(a, big);
}

/* dq: one block per (b, h, query tile); t[1..4] = dy, q, k, v */
template <int D, class Y, class DY, class Q, class K, class V>
__device__ void ck_attn_tc_dq(const CkArgs &a) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkTc<D> L;
    __nv_bfloat16 *sQ = (__nv_bfloat16 *)smem_raw, *sDY = sQ + 64 * L::LD;
    __nv_bfloat16 *sKV = sDY + 64 * L::LD;   /* [buffer][k, v] tiles */
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3];
    float scale = (float)a.f[0], scale2 = scale * CK_LOG2E;   /* scores in base 2 */
    i64 n_qt = (T + 63) / 64;
    i64 bh = blockIdx.x % (B * H), qt = n_qt - 1 - blockIdx.x / (B * H), b = bh / H, h = bh % H, g = h / (H / Hkv);
    int q0 = (int)qt * 64, Ti = (int)T;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    int row0 = q0 + warp * 16 + gid;

    int n_kt = ((q0 + 63 < Ti - 1 ? q0 + 63 : Ti - 1) >> 6) + 1;
    ck_tc_load<D>(sQ, a.t[2], b, T, q0, a.i[5], a.i[6] + h * D);
    ck_tc_load<D>(sDY, a.t[1], b, T, q0, H * D, h * D);
    ck_tc_load<D>(sKV, a.t[3], b, T, 0, a.i[7], a.i[8] + g * D);
    ck_tc_load<D>(sKV + 64 * L::LD, a.t[4], b, T, 0, a.i[9], a.i[10] + g * D);
    float ls[2], dt[2];
    ck_attn_row_stats(a, b, h, row0, Ti, ls, dt);
    float dq[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
    unsigned aq = ck_smem(sQ + warp * 16 * L::LD + ck_off_a<D>());
    unsigned ay = ck_smem(sDY + warp * 16 * L::LD + ck_off_a<D>());
    for (int j = 0; j < n_kt; j++) {
        ck_cp_wait();
        __syncthreads();   /* tile j is in, and every warp is done with buffer (j + 1) & 1 */
        if (j + 1 < n_kt) {
            __nv_bfloat16 *nk = sKV + ((j + 1) & 1) * 128 * L::LD;
            ck_tc_load<D>(nk, a.t[3], b, T, (j + 1) * 64, a.i[7], a.i[8] + g * D);
            ck_tc_load<D>(nk + 64 * L::LD, a.t[4], b, T, (j + 1) * 64, a.i[9], a.i[10] + g * D);
        }
        const __nv_bfloat16 *sK = sKV + (j & 1) * 128 * L::LD, *sV = sK + 64 * L::LD;
        int k0 = j * 64;

        /* S = Q K^T and dP = dY V^T, 16 x 64 per warp */
        float s[8][4], dp[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) s[n][i] = dp[n][i] = 0.0f;
        unsigned bk = ck_smem(sK + ck_off_b<D>()), bv = ck_smem(sV + ck_off_b<D>());
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            unsigned fq[4], fy[4];
            ck_ldm(fq, aq + kk * 32);
            ck_ldm(fy, ay + kk * 32);
#pragma unroll
            for (int p = 0; p < 4; p++) {
                unsigned f[4];
                ck_ldm(f, bk + (p * 16 * L::LD + kk * 16) * 2);
                ck_mma(s[2 * p], fq, f[0], f[1]);
                ck_mma(s[2 * p + 1], fq, f[2], f[3]);
                ck_ldm(f, bv + (p * 16 * L::LD + kk * 16) * 2);
                ck_mma(dp[2 * p], fy, f[0], f[1]);
                ck_mma(dp[2 * p + 1], fy, f[2], f[3]);
            }
        }

        /* P = exp(S scale - lse), dS = P (dP - Dt) scale, as bf16 A operands; masked S is -inf
         * (P = 0) only where the tile meets the diagonal or T */
        if (k0 + 63 > q0 + warp * 16 || q0 + warp * 16 + 16 > Ti)
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int col = k0 + n * 8 + tig * 2 + (i & 1), row = row0 + (i >> 1) * 8;
                    if (col > row || row >= Ti) s[n][i] = -CK_INF;
                }
        unsigned df[4][4];
#pragma unroll
        for (int n = 0; n < 8; n++) {
            float ds[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float p = ck_ex2(fmaf(s[n][i], scale2, -ls[i >> 1]));
                ds[i] = p * (dp[n][i] - dt[i >> 1]) * scale;
            }
            df[n >> 1][(n & 1) * 2] = ck_pack(ds[0], ds[1]);
            df[n >> 1][(n & 1) * 2 + 1] = ck_pack(ds[2], ds[3]);
        }

        /* dQ += dS K: K is (keys, d), read transposed as the B operand */
        ck_mma_tile_t<D, 4>(dq, df, ck_smem(sK + ck_off_a<D>()));
    }
    ck_attn_dq_store<D, Y>(a, dq, b, h, row0, tig, Ti);
}

/* dk, dv: one block per (b, kv head, key tile), over the heads of the group and the query
 * tiles at and after the key tile; t[1..4] = dy, q, k, v */
template <int D, class Y, class DY, class Q, class K, class V>
__device__ void ck_attn_tc_dkv(const CkArgs &a) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkTc<D> L;
    const int NC = L::NC;
    __nv_bfloat16 *sK = (__nv_bfloat16 *)smem_raw, *sV = sK + 64 * L::LD;
    __nv_bfloat16 *sQY = sV + 64 * L::LD;                       /* [buffer][q, dy] tiles */
    float *sStat = (float *)(smem_raw + 6 * L::TILE);           /* [buffer][lse, Dt][64] */
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3], grp = H / Hkv;
    float scale = (float)a.f[0], scale2 = scale * CK_LOG2E;   /* scores in base 2 */
    i64 n_kt = (T + 63) / 64;
    i64 bg = blockIdx.x % (B * Hkv), kt = blockIdx.x / (B * Hkv), b = bg / Hkv, g = bg % Hkv;
    int k0 = (int)kt * 64, Ti = (int)T;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    int key0 = k0 + warp * 16 + gid;   /* this thread's keys: key0, key0 + 8 */
    int nq = (int)(n_kt - kt), total = (int)grp * nq;   /* (head, query tile) steps */

    /* q, dy, lse and Dt of step `it` into buffer `buf` */
    auto stage = [&](int it, int buf) {
        i64 hh = g * grp + it / nq;
        int q0 = k0 + (it % nq) * 64;
        __nv_bfloat16 *q = sQY + buf * 128 * L::LD;
        ck_tc_load<D>(q, a.t[2], b, T, q0, a.i[5], a.i[6] + hh * D);
        ck_tc_load<D>(q + 64 * L::LD, a.t[1], b, T, q0, H * D, hh * D);
        ck_attn_stage_stats(a, sStat + buf * 128, b, hh, q0, Ti);
    };
    ck_tc_load<D>(sK, a.t[3], b, T, k0, a.i[7], a.i[8] + g * D);
    ck_tc_load<D>(sV, a.t[4], b, T, k0, a.i[9], a.i[10] + g * D);
    stage(0, 0);

    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) dk[n][i] = dv[n][i] = 0.0f;
    unsigned ak = ck_smem(sK + warp * 16 * L::LD + ck_off_a<D>());
    unsigned av = ck_smem(sV + warp * 16 * L::LD + ck_off_a<D>());
    for (int it = 0; it < total; it++) {
        ck_cp_wait();
        __syncthreads();   /* step it is in, and every warp is done with buffer (it + 1) & 1 */
        if (it + 1 < total) stage(it + 1, (it + 1) & 1);
        if (k0 + warp * 16 >= Ti) continue;   /* all of the warp's keys are past T */
        int q0 = k0 + (it % nq) * 64;
        const __nv_bfloat16 *sQ = sQY + (it & 1) * 128 * L::LD, *sDY = sQ + 64 * L::LD;
        const float *sL = sStat + (it & 1) * 128, *sDt = sL + 64;
#pragma unroll
        for (int c = 0; c < 64 / NC; c++) {
            int qc = q0 + c * NC;
            if (qc + NC - 1 < k0 + warp * 16) continue;   /* every query before every key */

            /* S^T = K Q^T and dP^T = V dY^T, 16 keys x NC queries per warp */
            float st[NC / 8][4], dpt[NC / 8][4];
#pragma unroll
            for (int n = 0; n < NC / 8; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) st[n][i] = dpt[n][i] = 0.0f;
            unsigned bq = ck_smem(sQ + c * NC * L::LD + ck_off_b<D>());
            unsigned by = ck_smem(sDY + c * NC * L::LD + ck_off_b<D>());
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                unsigned fk[4], fv[4];
                ck_ldm(fk, ak + kk * 32);
                ck_ldm(fv, av + kk * 32);
#pragma unroll
                for (int p = 0; p < NC / 16; p++) {
                    unsigned f[4];
                    ck_ldm(f, bq + (p * 16 * L::LD + kk * 16) * 2);
                    ck_mma(st[2 * p], fk, f[0], f[1]);
                    ck_mma(st[2 * p + 1], fk, f[2], f[3]);
                    ck_ldm(f, by + (p * 16 * L::LD + kk * 16) * 2);
                    ck_mma(dpt[2 * p], fv, f[0], f[1]);
                    ck_mma(dpt[2 * p + 1], fv, f[2], f[3]);
                }
            }

            /* P^T and dS^T (queries are columns: lse and Dt per column) as bf16 A operands;
             * masked S^T is -inf (P = 0) only where the step meets the diagonal or T */
            if (qc < k0 + warp * 16 + 15 || qc + NC > Ti)
#pragma unroll
                for (int n = 0; n < NC / 8; n++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int key = key0 + (i >> 1) * 8, tq = qc + n * 8 + tig * 2 + (i & 1);
                        if (key > tq || tq >= Ti) st[n][i] = -CK_INF;
                    }
            unsigned pf[NC / 16][4], df[NC / 16][4];
#pragma unroll
            for (int n = 0; n < NC / 8; n++) {
                int cl = c * NC + n * 8 + tig * 2;   /* column in the tile */
                float2 lq = *(const float2 *)(sL + cl), dtq = *(const float2 *)(sDt + cl);
                float p[4], ds[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    p[i] = ck_ex2(fmaf(st[n][i], scale2, -(i & 1 ? lq.y : lq.x) * CK_LOG2E));
                    ds[i] = p[i] * (dpt[n][i] - (i & 1 ? dtq.y : dtq.x)) * scale;
                }
                pf[n >> 1][(n & 1) * 2] = ck_pack(p[0], p[1]);
                pf[n >> 1][(n & 1) * 2 + 1] = ck_pack(p[2], p[3]);
                df[n >> 1][(n & 1) * 2] = ck_pack(ds[0], ds[1]);
                df[n >> 1][(n & 1) * 2 + 1] = ck_pack(ds[2], ds[3]);
            }

            /* dV += P^T dY, dK += dS^T Q: dY and Q are (queries, d), read transposed */
            ck_mma_tile_t<D, NC / 16>(dv, pf, ck_smem(sDY + c * NC * L::LD + ck_off_a<D>()));
            ck_mma_tile_t<D, NC / 16>(dk, df, ck_smem(sQ + c * NC * L::LD + ck_off_a<D>()));
        }
    }
    ck_attn_dkv_store<D, Y>(a, dk, dv, b, g, key0, tig, Ti);
}
