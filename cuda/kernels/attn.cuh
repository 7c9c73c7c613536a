/* attn.cuh — causal grouped-query attention, forward and backward, flash style.
 *
 * Nothing of size T x T is ever stored. The forward walks the key tiles of a 64-query tile
 * with an online softmax (running max m and sum l per query row; the output accumulator is
 * rescaled whenever the max grows), so a block holds one tile of q, k, v and p in shared
 * memory and its share of the output in registers. The IR keeps q, k and v only (no output,
 * no logsumexp), so the backward first reruns the forward in a statistics mode that writes
 * lse = m + log l and Dt = dy_t . o_t per query row into scratch, then:
 *   dq   one block per (batch, head, query tile) walks the key tiles left of the diagonal:
 *        p = exp(s - lse), ds = p (dy.v - Dt) scale, dq += ds k;
 *   dk, dv  one block per (batch, kv head, key tile) walks every query head of the group and
 *        every query tile right of the diagonal: dv += p^T dy, dk += ds^T q.
 * Each output element is written by exactly one block and summed in a fixed order: no
 * atomics, repeatable bits. Math is f32 (fmaf in the dot products); the reference computes
 * in f64, and the tests bound the difference.
 *
 * Layout (as ref_attn.c): q (B, T, H*D), k and v (B, T, Hkv*D), query head h reads kv head
 * h / (H/Hkv); the backward's result is dq | dk | dv along the last axis. 256 threads: thread
 * (ty, tx) of 16 x 16 owns score rows 4 ty .. 4 ty + 3 and columns tx + 16 j, and output
 * columns d = tx + 16 j. Shared rows are padded to D + 1 floats (no bank conflicts on the
 * column-strided reads). T need not be a multiple of 64: rows and keys past T are masked.
 * i = {B, T, H, Hkv, D, q stride, q column, k stride, k column, v stride, v column},
 * f = {scale}: q, k and v are separate tensors or one packed q|k|v passed three times. */

#define CK_AT 64                 /* query and key tile */
#define CK_AT_P (CK_AT + 1)

/* dynamic shared memory (bytes) of each kernel, for the launch */
#define CK_ATTN_FWD_SMEM(D) ((3 * CK_AT * ((D) + 1) + CK_AT * CK_AT_P) * 4)
#define CK_ATTN_DQ_SMEM(D) ((4 * CK_AT * ((D) + 1) + CK_AT * CK_AT_P) * 4)
#define CK_ATTN_DKV_SMEM(D) ((4 * CK_AT * ((D) + 1) + 2 * CK_AT * CK_AT_P + 2 * CK_AT) * 4)

/* rows [t0, t0 + 64) of one head of x into s (64 x D+1), zeros past T: element (b, t, d)
 * of the head is x[(b T + t) stride + col0 + d] (a packed q|k|v has the packed width as its
 * stride) */
template <int D, class X>
__device__ __forceinline__ void ck_attn_load(float *s, const CkTensor &x, i64 b, i64 T, i64 t0,
                                             i64 stride, i64 col0) {
    for (int e = threadIdx.x; e < CK_AT * D; e += blockDim.x) {
        int r = e / D, d = e - r * D;
        i64 t = t0 + r;
        s[r * (D + 1) + d] = t < T ? X::ld(x, (b * T + t) * stride + col0 + d) : 0.0f;
    }
}

/* where an attention with lse=1 stores the logsumexp of its rows: i[11] bytes after y */
static __device__ __forceinline__ float *ck_attn_lse_out(const CkArgs &a) {
    return (float *)((char *)a.t[0].p + a.i[11]);
}

/* Lanes of a warp that take one row of ck_attn_saved_stats: D / CK_VEC where that many lanes
 * hold a row in whole vectors, else the warp (spec.c sizes the grid by the same rule). */
static __device__ __forceinline__ int ck_attn_stat_lanes(long long D) {
    return D % 8 == 0 && D / 8 <= 32 && 32 % (D / 8) == 0 ? (int)(D / 8) : 32;
}

/* The backward's statistics from the forward's (attention_bwd reading y): lse as the forward
 * stored it after y (t[5], i[11] bytes on), and Dt = dy . y per row and head, into scratch as
 * ck_attn_fwd's MODE 1 puts them. ck_attn_stat_lanes lanes per (b, t, h); i as the
 * attention's. ZERO: the dk/dv pass computes dq too (attn_wgmma.cuh, ONE), and its counters,
 * B H ceil(T / 64) + 1 of them after Dt, start at zero. */
template <class DY, class YS, int ZERO = 0> __device__ void ck_attn_saved_stats(const CkArgs &a) {
    i64 B = a.i[0], T = a.i[1], H = a.i[2], D = a.i[4];
    if (ZERO) {
        i64 at = CK_BLOCK * blockDim.x + threadIdx.x;
        if (at <= B * H * ((T + 63) / 64)) ((unsigned *)((float *)a.scratch + 2 * B * H * T))[at] = 0u;
    }
    int per = ck_attn_stat_lanes(D), lane = threadIdx.x & 31, sub = lane % per;
    i64 r = (CK_BLOCK * (blockDim.x >> 5) + (threadIdx.x >> 5)) * (32 / per) + lane / per;
    bool live = r < B * T * H;
    i64 h = r % H, t = (r / H) % T, b = r / (H * T);
    i64 base = (b * T + t) * H * D + h * D;
    float s = 0.0f;
    if (live && per * CK_VEC == D && DY::vec_ok(a.t[1]) && YS::vec_ok(a.t[5])) {
        float u[CK_VEC], v[CK_VEC];
        DY::ld_vec(a.t[1], base + sub * CK_VEC, u);
        YS::ld_vec(a.t[5], base + sub * CK_VEC, v);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) s = fmaf(u[j], v[j], s);
    } else if (live) {
        for (i64 d = sub; d < D; d += per) s = fmaf(DY::ld(a.t[1], base + d), YS::ld(a.t[5], base + d), s);
    }
    for (int o = per / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (live && sub == 0) {
        float *lse = (float *)a.scratch, *dd = lse + B * H * T;
        i64 at = (b * H + h) * T + t;
        lse[at] = ((const float *)((const char *)a.t[5].p + a.i[11]))[at];
        dd[at] = s;
    }
}

/* MODE 0: y = attention(q, k, v); MODE 1 (t[1] = dy, t[2..4] = q, k, v): lse and Dt into
 * scratch ([B*H*T] each, f32) */
template <int D, int MODE, class Y, class Q, class K, class V, class DY>
__device__ void ck_attn_fwd(const CkArgs &a) {
    extern __shared__ float smem[];
    const int NJ = D / 16;
    float *sQ = smem, *sK = sQ + CK_AT * (D + 1), *sV = sK + CK_AT * (D + 1);
    float *sP = sV + CK_AT * (D + 1);
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3];
    float scale = (float)a.f[0];
    i64 n_qt = (T + CK_AT - 1) / CK_AT;
    i64 bh = blockIdx.x / n_qt, qt = blockIdx.x % n_qt, b = bh / H, h = bh % H, g = h / (H / Hkv);
    i64 q0 = qt * CK_AT;
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const CkTensor &tq = a.t[MODE + 1], &tk = a.t[MODE + 2], &tv = a.t[MODE + 3];

    ck_attn_load<D, Q>(sQ, tq, b, T, q0, a.i[5], a.i[6] + h * D);
    float m[4], l[4], o[4][NJ];
    for (int i = 0; i < 4; i++) {
        m[i] = -CK_INF;
        l[i] = 0.0f;
        for (int j = 0; j < NJ; j++) o[i][j] = 0.0f;
    }
    i64 last = q0 + CK_AT - 1 < T - 1 ? q0 + CK_AT - 1 : T - 1;
    for (i64 k0 = 0; k0 <= last; k0 += CK_AT) {
        __syncthreads();
        ck_attn_load<D, K>(sK, tk, b, T, k0, a.i[7], a.i[8] + g * D);
        ck_attn_load<D, V>(sV, tv, b, T, k0, a.i[9], a.i[10] + g * D);
        __syncthreads();
        float s[4][4];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) s[i][j] = 0.0f;
        for (int d = 0; d < D; d++) {
            float kd[4];
            for (int j = 0; j < 4; j++) kd[j] = sK[(tx + 16 * j) * (D + 1) + d];
            for (int i = 0; i < 4; i++) {
                float qd = sQ[(ty * 4 + i) * (D + 1) + d];
                for (int j = 0; j < 4; j++) s[i][j] = fmaf(qd, kd[j], s[i][j]);
            }
        }
        for (int i = 0; i < 4; i++) {
            i64 tq_ = q0 + ty * 4 + i;
            float mx = -CK_INF;
            for (int j = 0; j < 4; j++) {
                i64 tk_ = k0 + tx + 16 * j;
                s[i][j] = tk_ <= tq_ && tk_ < T ? s[i][j] * scale : -CK_INF;
                mx = fmaxf(mx, s[i][j]);
            }
            for (int w = 1; w < 16; w <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
            float mnew = fmaxf(m[i], mx), muse = mnew == -CK_INF ? 0.0f : mnew;
            float corr = expf(m[i] - muse), rs = 0.0f;
            for (int j = 0; j < 4; j++) {
                float p = expf(s[i][j] - muse);
                sP[(ty * 4 + i) * CK_AT_P + tx + 16 * j] = p;
                rs += p;
            }
            for (int w = 1; w < 16; w <<= 1) rs += __shfl_xor_sync(0xffffffffu, rs, w);
            l[i] = l[i] * corr + rs;
            m[i] = mnew;
            for (int j = 0; j < NJ; j++) o[i][j] *= corr;
        }
        __syncthreads();
        for (int c = 0; c < CK_AT; c++) {
            float vd[NJ];
            for (int j = 0; j < NJ; j++) vd[j] = sV[c * (D + 1) + tx + 16 * j];
            for (int i = 0; i < 4; i++) {
                float p = sP[(ty * 4 + i) * CK_AT_P + c];
                for (int j = 0; j < NJ; j++) o[i][j] = fmaf(p, vd[j], o[i][j]);
            }
        }
    }
    for (int i = 0; i < 4; i++) {
        i64 t = q0 + ty * 4 + i;
        float inv = 1.0f / l[i];
        if (MODE == 0) {
            if (t < T)
                for (int j = 0; j < NJ; j++)
                    Y::st(a.t[0], ((b * T + t) * H + h) * D + tx + 16 * j, o[i][j] * inv);
            if (t < T && tx == 0 && a.i[11]) ck_attn_lse_out(a)[(b * H + h) * T + t] = m[i] + logf(l[i]);
        } else {
            float dsum = 0.0f;
            for (int j = 0; j < NJ; j++)
                if (t < T) dsum = fmaf(DY::ld(a.t[1], (b * T + t) * H * D + h * D + tx + 16 * j),
                                       o[i][j] * inv, dsum);
            for (int w = 1; w < 16; w <<= 1) dsum += __shfl_xor_sync(0xffffffffu, dsum, w);
            if (t < T && tx == 0) {
                float *lse = (float *)a.scratch, *dd = lse + B * H * T;
                lse[(b * H + h) * T + t] = m[i] + logf(l[i]);
                dd[(b * H + h) * T + t] = dsum;
            }
        }
    }
}

/* dq: one block per (b, h, query tile); t[1..4] = dy, q, k, v */
template <int D, class Y, class DY, class Q, class K, class V>
__device__ void ck_attn_dq(const CkArgs &a) {
    extern __shared__ float smem[];
    const int NJ = D / 16;
    float *sQ = smem, *sDY = sQ + CK_AT * (D + 1), *sK = sDY + CK_AT * (D + 1);
    float *sV = sK + CK_AT * (D + 1), *sS = sV + CK_AT * (D + 1);
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3];
    i64 ycols = (H + 2 * Hkv) * D;
    float scale = (float)a.f[0];
    i64 n_qt = (T + CK_AT - 1) / CK_AT;
    i64 bh = blockIdx.x / n_qt, qt = blockIdx.x % n_qt, b = bh / H, h = bh % H, g = h / (H / Hkv);
    i64 q0 = qt * CK_AT;
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const float *lse = (const float *)a.scratch, *dd = lse + B * H * T;

    ck_attn_load<D, Q>(sQ, a.t[2], b, T, q0, a.i[5], a.i[6] + h * D);
    ck_attn_load<D, DY>(sDY, a.t[1], b, T, q0, H * D, h * D);
    float L[4], Dt[4], dq[4][NJ];
    for (int i = 0; i < 4; i++) {
        i64 t = q0 + ty * 4 + i;
        L[i] = t < T ? lse[(b * H + h) * T + t] : 0.0f;
        Dt[i] = t < T ? dd[(b * H + h) * T + t] : 0.0f;
        for (int j = 0; j < NJ; j++) dq[i][j] = 0.0f;
    }
    i64 last = q0 + CK_AT - 1 < T - 1 ? q0 + CK_AT - 1 : T - 1;
    for (i64 k0 = 0; k0 <= last; k0 += CK_AT) {
        __syncthreads();
        ck_attn_load<D, K>(sK, a.t[3], b, T, k0, a.i[7], a.i[8] + g * D);
        ck_attn_load<D, V>(sV, a.t[4], b, T, k0, a.i[9], a.i[10] + g * D);
        __syncthreads();
        float s[4][4], dp[4][4];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) s[i][j] = dp[i][j] = 0.0f;
        for (int d = 0; d < D; d++) {
            float kd[4], vd[4];
            for (int j = 0; j < 4; j++) {
                kd[j] = sK[(tx + 16 * j) * (D + 1) + d];
                vd[j] = sV[(tx + 16 * j) * (D + 1) + d];
            }
            for (int i = 0; i < 4; i++) {
                float qd = sQ[(ty * 4 + i) * (D + 1) + d], gd = sDY[(ty * 4 + i) * (D + 1) + d];
                for (int j = 0; j < 4; j++) {
                    s[i][j] = fmaf(qd, kd[j], s[i][j]);
                    dp[i][j] = fmaf(gd, vd[j], dp[i][j]);
                }
            }
        }
        for (int i = 0; i < 4; i++) {
            i64 tq_ = q0 + ty * 4 + i;
            for (int j = 0; j < 4; j++) {
                i64 tk_ = k0 + tx + 16 * j;
                float p = tk_ <= tq_ && tq_ < T ? expf(s[i][j] * scale - L[i]) : 0.0f;
                sS[(ty * 4 + i) * CK_AT_P + tx + 16 * j] = p * (dp[i][j] - Dt[i]) * scale;
            }
        }
        __syncthreads();
        for (int c = 0; c < CK_AT; c++) {
            float kd[NJ];
            for (int j = 0; j < NJ; j++) kd[j] = sK[c * (D + 1) + tx + 16 * j];
            for (int i = 0; i < 4; i++) {
                float ds = sS[(ty * 4 + i) * CK_AT_P + c];
                for (int j = 0; j < NJ; j++) dq[i][j] = fmaf(ds, kd[j], dq[i][j]);
            }
        }
    }
    for (int i = 0; i < 4; i++) {
        i64 t = q0 + ty * 4 + i;
        if (t < T)
            for (int j = 0; j < NJ; j++) Y::st(a.t[0], (b * T + t) * ycols + h * D + tx + 16 * j, dq[i][j]);
    }
}

/* dk, dv: one block per (b, kv head, key tile) */
template <int D, class Y, class DY, class Q, class K, class V>
__device__ void ck_attn_dkv(const CkArgs &a) {
    extern __shared__ float smem[];
    const int NJ = D / 16;
    float *sK = smem, *sV = sK + CK_AT * (D + 1), *sQ = sV + CK_AT * (D + 1);
    float *sDY = sQ + CK_AT * (D + 1), *sP = sDY + CK_AT * (D + 1), *sDS = sP + CK_AT * CK_AT_P;
    float *sL = sDS + CK_AT * CK_AT_P, *sD = sL + CK_AT;
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3], grp = H / Hkv;
    i64 ycols = (H + 2 * Hkv) * D;
    float scale = (float)a.f[0];
    i64 n_kt = (T + CK_AT - 1) / CK_AT;
    i64 bg = blockIdx.x / n_kt, kt = blockIdx.x % n_kt, b = bg / Hkv, g = bg % Hkv;
    i64 k0 = kt * CK_AT;
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const float *lse = (const float *)a.scratch, *dd = lse + B * H * T;

    ck_attn_load<D, K>(sK, a.t[3], b, T, k0, a.i[7], a.i[8] + g * D);
    ck_attn_load<D, V>(sV, a.t[4], b, T, k0, a.i[9], a.i[10] + g * D);
    float dk[4][NJ], dv[4][NJ];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < NJ; j++) dk[i][j] = dv[i][j] = 0.0f;
    for (i64 h = g * grp; h < (g + 1) * grp; h++)
        for (i64 q0 = k0; q0 < T; q0 += CK_AT) {
            __syncthreads();
            ck_attn_load<D, Q>(sQ, a.t[2], b, T, q0, a.i[5], a.i[6] + h * D);
            ck_attn_load<D, DY>(sDY, a.t[1], b, T, q0, H * D, h * D);
            for (int r = threadIdx.x; r < CK_AT; r += blockDim.x) {
                i64 t = q0 + r;
                sL[r] = t < T ? lse[(b * H + h) * T + t] : 0.0f;
                sD[r] = t < T ? dd[(b * H + h) * T + t] : 0.0f;
            }
            __syncthreads();
            float s[4][4], dp[4][4];   /* [key row i][query column j] */
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) s[i][j] = dp[i][j] = 0.0f;
            for (int d = 0; d < D; d++) {
                float qd[4], gd[4];
                for (int j = 0; j < 4; j++) {
                    qd[j] = sQ[(tx + 16 * j) * (D + 1) + d];
                    gd[j] = sDY[(tx + 16 * j) * (D + 1) + d];
                }
                for (int i = 0; i < 4; i++) {
                    float kd = sK[(ty * 4 + i) * (D + 1) + d], vd = sV[(ty * 4 + i) * (D + 1) + d];
                    for (int j = 0; j < 4; j++) {
                        s[i][j] = fmaf(kd, qd[j], s[i][j]);
                        dp[i][j] = fmaf(vd, gd[j], dp[i][j]);
                    }
                }
            }
            for (int i = 0; i < 4; i++) {
                i64 tk_ = k0 + ty * 4 + i;
                for (int j = 0; j < 4; j++) {
                    int qc = tx + 16 * j;
                    i64 tq_ = q0 + qc;
                    float p = tk_ <= tq_ && tq_ < T && tk_ < T ? expf(s[i][j] * scale - sL[qc]) : 0.0f;
                    sP[(ty * 4 + i) * CK_AT_P + qc] = p;
                    sDS[(ty * 4 + i) * CK_AT_P + qc] = p * (dp[i][j] - sD[qc]) * scale;
                }
            }
            __syncthreads();
            for (int c = 0; c < CK_AT; c++) {
                float gd[NJ], qd[NJ];
                for (int j = 0; j < NJ; j++) {
                    gd[j] = sDY[c * (D + 1) + tx + 16 * j];
                    qd[j] = sQ[c * (D + 1) + tx + 16 * j];
                }
                for (int i = 0; i < 4; i++) {
                    float p = sP[(ty * 4 + i) * CK_AT_P + c], ds = sDS[(ty * 4 + i) * CK_AT_P + c];
                    for (int j = 0; j < NJ; j++) {
                        dv[i][j] = fmaf(p, gd[j], dv[i][j]);
                        dk[i][j] = fmaf(ds, qd[j], dk[i][j]);
                    }
                }
            }
        }
    for (int i = 0; i < 4; i++) {
        i64 t = k0 + ty * 4 + i;
        if (t < T)
            for (int j = 0; j < NJ; j++) {
                i64 at = (b * T + t) * ycols + H * D + g * D + tx + 16 * j;
                Y::st(a.t[0], at, dk[i][j]);
                Y::st(a.t[0], at + Hkv * D, dv[i][j]);
            }
    }
}
