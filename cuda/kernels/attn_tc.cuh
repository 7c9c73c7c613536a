/* attn_tc.cuh — the same attention on the tensor cores (bf16 q, k, v; WMMA 16x16x16).
 *
 * The algorithm is attn.cuh's — 64 x 64 tiles, online softmax forward, a statistics rerun and
 * separate dq and dk/dv passes backward, each output written by one block — with every tile
 * product on the tensor cores: S = Q K^T, O += P V, dP = dY V^T, dQ += dS K, dV += P^T dY,
 * dK += dS^T Q, bf16 operands, f32 accumulation. WMMA leaves the layout of an accumulator
 * fragment to the hardware, so whatever needs elements by row (the softmax, the rescaling of
 * the output when the running max grows, dS) goes through shared memory: S and dP are stored
 * as f32, P and dS written back as bf16 for the next product. The forward keeps O in
 * registers, element e of the tile in thread e mod 256, and adds each tile's P V (stored to
 * shared memory) after rescaling; dQ, dK and dV are pure sums over tiles and stay in
 * accumulator fragments.
 *
 * Precision: P and dS are rounded to bf16 as the operands of their products (FlashAttention
 * does the same); everything else is as attn.cuh. The tests bound the result against the
 * reference's f64. Used when q, k, v (and dy) are plain bf16 and the head dim is a multiple
 * of 16 up to 128; other formats take attn.cuh. */
#include <mma.h>

#define CK_TC_LDS 68           /* f32 row stride of S tiles */
#define CK_TC_LDP 72           /* bf16 row stride of P tiles */

/* shared memory layout: offsets in bytes, every region 128-byte aligned */
template <int D> struct CkTc {
    enum {
        LDH = D + 8,                       /* bf16 row stride of q, k, v, dy tiles */
        LDO = D + 4,                       /* f32 row stride of output tiles */
        H = 64 * LDH * 2,                  /* one bf16 (64, D) tile */
        S = 64 * CK_TC_LDS * 4,            /* one f32 (64, 64) tile */
        P = 64 * CK_TC_LDP * 2,            /* one bf16 (64, 64) tile */
        O = 64 * LDO * 4,                  /* one f32 (64, D) tile */
        FWD = 3 * H + S + P + O + 4 * 64 * 4,
        DQ = 4 * H + (2 * S > O ? 2 * S : O) + P + 2 * 64 * 4,
        DKV = 4 * H + (2 * S > O ? 2 * S : O) + 2 * P + 2 * 64 * 4,
        FRAGS = (D / 4 + 7) / 8            /* (64, D) output fragments per warp */
    };
};

typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> CkAcc;
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major> CkFragA;
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major> CkFragBr;
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::col_major> CkFragBc;

/* rows [t0, t0 + 64) of one head into a bf16 tile (zeros past T) */
template <int D, class X>
__device__ __forceinline__ void ck_tc_load(__nv_bfloat16 *s, const CkTensor &x, i64 b, i64 T, i64 t0,
                                           i64 stride, i64 col0) {
    for (int e = threadIdx.x; e < 64 * D; e += blockDim.x) {
        int r = e / D, d = e - r * D;
        i64 t = t0 + r;
        s[r * (D + 8) + d] = __float2bfloat16_rn(t < T ? X::ld(x, (b * T + t) * stride + col0 + d) : 0.0f);
    }
}

/* C (64 x 64, f32, stride CK_TC_LDS) = A (64 x D) B^T, B (64 x D) both row-major bf16:
 * 16 fragments, two per warp */
template <int D>
__device__ __forceinline__ void ck_tc_abt(float *c, const __nv_bfloat16 *A, const __nv_bfloat16 *B) {
    int warp = threadIdx.x >> 5;
    for (int f = warp; f < 16; f += 8) {
        int i = f >> 2, j = f & 3;
        CkAcc acc;
        nvcuda::wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            CkFragA fa;
            CkFragBc fb;
            nvcuda::wmma::load_matrix_sync(fa, A + i * 16 * (D + 8) + kk * 16, D + 8);
            nvcuda::wmma::load_matrix_sync(fb, B + j * 16 * (D + 8) + kk * 16, D + 8);
            nvcuda::wmma::mma_sync(acc, fa, fb, acc);
        }
        nvcuda::wmma::store_matrix_sync(c + i * 16 * CK_TC_LDS + j * 16, acc, CK_TC_LDS, nvcuda::wmma::mem_row_major);
    }
}

/* acc[f] += P (64 x 64 bf16, stride CK_TC_LDP) V (64 x D bf16 row-major) for the warp's
 * output fragments f (fragment index warp + 8 f of the (64, D) tile) */
template <int D>
__device__ __forceinline__ void ck_tc_pv(CkAcc *acc, const __nv_bfloat16 *P, const __nv_bfloat16 *V) {
    int warp = threadIdx.x >> 5;
#pragma unroll
    for (int f = 0; f < CkTc<D>::FRAGS; f++) {
        int idx = warp + 8 * f;
        if (idx >= D / 4) break;
        int i = idx / (D / 16), j = idx % (D / 16);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            CkFragA fa;
            CkFragBr fb;
            nvcuda::wmma::load_matrix_sync(fa, P + i * 16 * CK_TC_LDP + kk * 16, CK_TC_LDP);
            nvcuda::wmma::load_matrix_sync(fb, V + kk * 16 * (D + 8) + j * 16, D + 8);
            nvcuda::wmma::mma_sync(acc[f], fa, fb, acc[f]);
        }
    }
}

template <int D> __device__ __forceinline__ void ck_tc_store(float *o, CkAcc *acc) {
    int warp = threadIdx.x >> 5;
#pragma unroll
    for (int f = 0; f < CkTc<D>::FRAGS; f++) {
        int idx = warp + 8 * f;
        if (idx >= D / 4) break;
        int i = idx / (D / 16), j = idx % (D / 16);
        nvcuda::wmma::store_matrix_sync(o + i * 16 * (D + 4) + j * 16, acc[f], D + 4, nvcuda::wmma::mem_row_major);
    }
}

/* MODE 0: y = attention(q, k, v); MODE 1 (t[1] = dy): lse and Dt into scratch */
template <int D, int MODE, class Y, class Q, class K, class V, class DY>
__device__ void ck_attn_tc_fwd(const CkArgs &a) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkTc<D> L;
    __nv_bfloat16 *sQ = (__nv_bfloat16 *)smem_raw, *sK = (__nv_bfloat16 *)(smem_raw + L::H);
    __nv_bfloat16 *sV = (__nv_bfloat16 *)(smem_raw + 2 * L::H);
    float *sS = (float *)(smem_raw + 3 * L::H);
    __nv_bfloat16 *sP = (__nv_bfloat16 *)(smem_raw + 3 * L::H + L::S);
    float *sPV = (float *)(smem_raw + 3 * L::H + L::S + L::P);
    float *sC = (float *)(smem_raw + 3 * L::H + L::S + L::P + L::O), *sM = sC + 64, *sL = sM + 64;
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3];
    float scale = (float)a.f[0];
    i64 n_qt = (T + 63) / 64;
    i64 bh = blockIdx.x / n_qt, qt = blockIdx.x % n_qt, b = bh / H, h = bh % H, g = h / (H / Hkv);
    i64 q0 = qt * 64;
    int r = threadIdx.x >> 2, qd = threadIdx.x & 3;
    const CkTensor &tq = a.t[MODE + 1], &tk = a.t[MODE + 2], &tv = a.t[MODE + 3];

    ck_tc_load<D, Q>(sQ, tq, b, T, q0, a.i[5], a.i[6] + h * D);
    const int NO = D / 4;   /* output elements per thread: 64 D / 256 */
    float o[NO];
#pragma unroll
    for (int k = 0; k < NO; k++) o[k] = 0.0f;
    float m = -CK_INF, l = 0.0f;
    i64 last = q0 + 63 < T - 1 ? q0 + 63 : T - 1;
    for (i64 k0 = 0; k0 <= last; k0 += 64) {
        __syncthreads();
        ck_tc_load<D, K>(sK, tk, b, T, k0, a.i[7], a.i[8] + g * D);
        ck_tc_load<D, V>(sV, tv, b, T, k0, a.i[9], a.i[10] + g * D);
        __syncthreads();
        ck_tc_abt<D>(sS, sQ, sK);
        __syncthreads();
        /* the softmax of row r, columns 16 qd .. 16 qd + 15 */
        i64 tq_ = q0 + r;
        float s[16], mx = -CK_INF;
#pragma unroll
        for (int c = 0; c < 16; c++) {
            i64 tk_ = k0 + qd * 16 + c;
            s[c] = tk_ <= tq_ && tk_ < T ? sS[r * CK_TC_LDS + qd * 16 + c] * scale : -CK_INF;
            mx = fmaxf(mx, s[c]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float mnew = fmaxf(m, mx), muse = mnew == -CK_INF ? 0.0f : mnew;
        float corr = expf(m - muse), rs = 0.0f;
#pragma unroll
        for (int c = 0; c < 16; c++) {
            float p = expf(s[c] - muse);
            sP[r * CK_TC_LDP + qd * 16 + c] = __float2bfloat16_rn(p);
            rs += p;
        }
        rs += __shfl_xor_sync(0xffffffffu, rs, 1);
        rs += __shfl_xor_sync(0xffffffffu, rs, 2);
        l = l * corr + rs;
        m = mnew;
        if (qd == 0) sC[r] = corr;
        __syncthreads();
        CkAcc acc[L::FRAGS];
#pragma unroll
        for (int f = 0; f < L::FRAGS; f++) nvcuda::wmma::fill_fragment(acc[f], 0.0f);
        ck_tc_pv<D>(acc, sP, sV);
        ck_tc_store<D>(sPV, acc);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < NO; k++) {
            int e = threadIdx.x + 256 * k, row = e / D, col = e - row * D;
            o[k] = o[k] * sC[row] + sPV[row * L::LDO + col];
        }
    }
    if (qd == 0) {
        sM[r] = m;
        sL[r] = l;
    }
    __syncthreads();
    if (MODE == 0) {
#pragma unroll
        for (int k = 0; k < NO; k++) {
            int e = threadIdx.x + 256 * k, row = e / D, col = e - row * D;
            i64 t = q0 + row;
            if (t < T) Y::st(a.t[0], (b * T + t) * H * D + h * D + col, o[k] / sL[row]);
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < NO; k++) {
        int e = threadIdx.x + 256 * k, row = e / D, col = e - row * D;
        sPV[row * L::LDO + col] = o[k] / sL[row];
    }
    __syncthreads();
    i64 t = q0 + r;
    float dsum = 0.0f;
    if (t < T)
        for (int d = qd * (D / 4); d < (qd + 1) * (D / 4); d++)
            dsum = fmaf(DY::ld(a.t[1], (b * T + t) * H * D + h * D + d), sPV[r * L::LDO + d], dsum);
    dsum += __shfl_xor_sync(0xffffffffu, dsum, 1);
    dsum += __shfl_xor_sync(0xffffffffu, dsum, 2);
    if (t < T && qd == 0) {
        float *lse = (float *)a.scratch, *dd = lse + B * H * T;
        lse[(b * H + h) * T + t] = sM[r] + logf(sL[r]);
        dd[(b * H + h) * T + t] = dsum;
    }
}

/* dq: one block per (b, h, query tile); t[1..4] = dy, q, k, v */
template <int D, class Y, class DY, class Q, class K, class V>
__device__ void ck_attn_tc_dq(const CkArgs &a) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkTc<D> L;
    __nv_bfloat16 *sQ = (__nv_bfloat16 *)smem_raw, *sDY = (__nv_bfloat16 *)(smem_raw + L::H);
    __nv_bfloat16 *sK = (__nv_bfloat16 *)(smem_raw + 2 * L::H), *sV = (__nv_bfloat16 *)(smem_raw + 3 * L::H);
    float *sS = (float *)(smem_raw + 4 * L::H), *sDP = sS + 64 * CK_TC_LDS, *sOut = sS;
    const int SO = 2 * L::S > L::O ? 2 * L::S : L::O;
    __nv_bfloat16 *sDS = (__nv_bfloat16 *)(smem_raw + 4 * L::H + SO);
    float *sL = (float *)(smem_raw + 4 * L::H + SO + L::P), *sDt = sL + 64;
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3];
    i64 ycols = (H + 2 * Hkv) * D;
    float scale = (float)a.f[0];
    i64 n_qt = (T + 63) / 64;
    i64 bh = blockIdx.x / n_qt, qt = blockIdx.x % n_qt, b = bh / H, h = bh % H, g = h / (H / Hkv);
    i64 q0 = qt * 64;
    int r = threadIdx.x >> 2, qd = threadIdx.x & 3;
    const float *lse = (const float *)a.scratch, *dd = lse + B * H * T;

    ck_tc_load<D, Q>(sQ, a.t[2], b, T, q0, a.i[5], a.i[6] + h * D);
    ck_tc_load<D, DY>(sDY, a.t[1], b, T, q0, H * D, h * D);
    for (int k = threadIdx.x; k < 64; k += blockDim.x) {
        i64 t = q0 + k;
        sL[k] = t < T ? lse[(b * H + h) * T + t] : 0.0f;
        sDt[k] = t < T ? dd[(b * H + h) * T + t] : 0.0f;
    }
    CkAcc acc[L::FRAGS];
#pragma unroll
    for (int f = 0; f < L::FRAGS; f++) nvcuda::wmma::fill_fragment(acc[f], 0.0f);
    i64 last = q0 + 63 < T - 1 ? q0 + 63 : T - 1;
    for (i64 k0 = 0; k0 <= last; k0 += 64) {
        __syncthreads();
        ck_tc_load<D, K>(sK, a.t[3], b, T, k0, a.i[7], a.i[8] + g * D);
        ck_tc_load<D, V>(sV, a.t[4], b, T, k0, a.i[9], a.i[10] + g * D);
        __syncthreads();
        ck_tc_abt<D>(sS, sQ, sK);
        ck_tc_abt<D>(sDP, sDY, sV);
        __syncthreads();
        i64 tq_ = q0 + r;
#pragma unroll
        for (int c = 0; c < 16; c++) {
            int col = qd * 16 + c;
            i64 tk_ = k0 + col;
            float p = tk_ <= tq_ && tq_ < T ? expf(sS[r * CK_TC_LDS + col] * scale - sL[r]) : 0.0f;
            sDS[r * CK_TC_LDP + col] = __float2bfloat16_rn(p * (sDP[r * CK_TC_LDS + col] - sDt[r]) * scale);
        }
        __syncthreads();
        ck_tc_pv<D>(acc, sDS, sK);
    }
    __syncthreads();
    ck_tc_store<D>(sOut, acc);
    __syncthreads();
    for (int e = threadIdx.x; e < 64 * D; e += blockDim.x) {
        int row = e / D, col = e - row * D;
        i64 t = q0 + row;
        if (t < T) Y::st(a.t[0], (b * T + t) * ycols + h * D + col, sOut[row * L::LDO + col]);
    }
}

/* dk, dv: one block per (b, kv head, key tile) */
template <int D, class Y, class DY, class Q, class K, class V>
__device__ void ck_attn_tc_dkv(const CkArgs &a) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkTc<D> L;
    __nv_bfloat16 *sK = (__nv_bfloat16 *)smem_raw, *sV = (__nv_bfloat16 *)(smem_raw + L::H);
    __nv_bfloat16 *sQ = (__nv_bfloat16 *)(smem_raw + 2 * L::H), *sDY = (__nv_bfloat16 *)(smem_raw + 3 * L::H);
    float *sS = (float *)(smem_raw + 4 * L::H), *sDP = sS + 64 * CK_TC_LDS, *sOut = sS;
    const int SO = 2 * L::S > L::O ? 2 * L::S : L::O;
    __nv_bfloat16 *sP = (__nv_bfloat16 *)(smem_raw + 4 * L::H + SO);
    __nv_bfloat16 *sDS = (__nv_bfloat16 *)(smem_raw + 4 * L::H + SO + L::P);
    float *sL = (float *)(smem_raw + 4 * L::H + SO + 2 * L::P), *sDt = sL + 64;
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3], grp = H / Hkv;
    i64 ycols = (H + 2 * Hkv) * D;
    float scale = (float)a.f[0];
    i64 n_kt = (T + 63) / 64;
    i64 bg = blockIdx.x / n_kt, kt = blockIdx.x % n_kt, b = bg / Hkv, g = bg % Hkv;
    i64 k0 = kt * 64;
    int r = threadIdx.x >> 2, qd = threadIdx.x & 3;
    const float *lse = (const float *)a.scratch, *dd = lse + B * H * T;

    ck_tc_load<D, K>(sK, a.t[3], b, T, k0, a.i[7], a.i[8] + g * D);
    ck_tc_load<D, V>(sV, a.t[4], b, T, k0, a.i[9], a.i[10] + g * D);
    CkAcc dk[L::FRAGS], dv[L::FRAGS];
#pragma unroll
    for (int f = 0; f < L::FRAGS; f++) {
        nvcuda::wmma::fill_fragment(dk[f], 0.0f);
        nvcuda::wmma::fill_fragment(dv[f], 0.0f);
    }
    for (i64 h = g * grp; h < (g + 1) * grp; h++)
        for (i64 q0 = k0; q0 < T; q0 += 64) {
            __syncthreads();
            ck_tc_load<D, Q>(sQ, a.t[2], b, T, q0, a.i[5], a.i[6] + h * D);
            ck_tc_load<D, DY>(sDY, a.t[1], b, T, q0, H * D, h * D);
            for (int k = threadIdx.x; k < 64; k += blockDim.x) {
                i64 t = q0 + k;
                sL[k] = t < T ? lse[(b * H + h) * T + t] : 0.0f;
                sDt[k] = t < T ? dd[(b * H + h) * T + t] : 0.0f;
            }
            __syncthreads();
            ck_tc_abt<D>(sS, sK, sQ);     /* S^T: keys x queries */
            ck_tc_abt<D>(sDP, sV, sDY);   /* dP^T */
            __syncthreads();
            i64 tk_ = k0 + r;
#pragma unroll
            for (int c = 0; c < 16; c++) {
                int qc = qd * 16 + c;
                i64 tq_ = q0 + qc;
                float p = tk_ <= tq_ && tq_ < T && tk_ < T ? expf(sS[r * CK_TC_LDS + qc] * scale - sL[qc]) : 0.0f;
                sP[r * CK_TC_LDP + qc] = __float2bfloat16_rn(p);
                sDS[r * CK_TC_LDP + qc] = __float2bfloat16_rn(p * (sDP[r * CK_TC_LDS + qc] - sDt[qc]) * scale);
            }
            __syncthreads();
            ck_tc_pv<D>(dv, sP, sDY);
            ck_tc_pv<D>(dk, sDS, sQ);
        }
    for (int pass = 0; pass < 2; pass++) {
        __syncthreads();
        ck_tc_store<D>(sOut, pass ? dv : dk);
        __syncthreads();
        for (int e = threadIdx.x; e < 64 * D; e += blockDim.x) {
            int row = e / D, col = e - row * D;
            i64 t = k0 + row;
            if (t < T) Y::st(a.t[0], (b * T + t) * ycols + (H + pass * Hkv) * D + g * D + col, sOut[row * L::LDO + col]);
        }
    }
}
