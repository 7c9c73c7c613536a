/* gemm_io.cuh — what the library GEMMs read: transposed and quantized copies, their scales.
 *
 * cuBLASLt reads FP8 operands in the layouts its Hopper kernels take (the weight gradient reads
 * dy and x transposed), with per-tensor dequantization scales (1/s) or grouped scale arrays.
 * These kernels make them: byte transposes through shared-memory tiles, the quantize that
 * writes a copy and its transpose from one tile (cast-transpose, with a bias gradient's column
 * sums where asked), the inverse scales and grouped scale layouts, and the finite check of the
 * gradients. Loaded after reduce.cuh. */

/* ---------------------------------------------------------------- around library GEMMs */

template <int B> struct CkBytes;
template <> struct CkBytes<1> { typedef unsigned char T; };
template <> struct CkBytes<2> { typedef unsigned short T; };
template <> struct CkBytes<4> { typedef unsigned T; };

/* out (cols, rows) = in (rows, cols), element bytes as they are (a per-tensor scale is the
 * same for the transpose); t[0] out, t[1] in; 32 x 32 tiles, 256 threads */
template <int BYTES> __device__ void ck_transpose(const CkArgs &a) {
    typedef typename CkBytes<BYTES>::T T;
    __shared__ T tile[32][33];
    i64 R = a.t[1].rows, C = a.t[1].cols;
    i64 c0 = (i64)blockIdx.x * 32, r0 = (i64)blockIdx.y * 32;
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const T *in = (const T *)a.t[1].p;
    T *out = (T *)a.t[0].p;
    for (int k = ty; k < 32; k += 8)
        if (r0 + k < R && c0 + tx < C) tile[k][tx] = in[(r0 + k) * C + c0 + tx];
    __syncthreads();
    for (int k = ty; k < 32; k += 8)
        if (c0 + k < C && r0 + tx < R) out[(c0 + k) * R + r0 + tx] = tile[tx][k];
}

/* A 16 x 4 block of bytes transposed: the word at col[0] and the 15 below it, `pitch` words
 * apart (rows of bytes, four columns a word), into o[j], the 16 bytes of column j (o[j][i]
 * holds rows 4i .. 4i + 3): sixteen word loads and 32 byte permutes, where gathering a byte at
 * a time takes a load, a shift and an or for each byte. */
static __device__ __forceinline__ void ck_bytes_t16x4(const unsigned *col, int pitch, unsigned (&o)[4][4]) {
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        unsigned a0 = col[(4 * i) * pitch], a1 = col[(4 * i + 1) * pitch];
        unsigned a2 = col[(4 * i + 2) * pitch], a3 = col[(4 * i + 3) * pitch];
        unsigned lo01 = __byte_perm(a0, a1, 0x5140), hi01 = __byte_perm(a0, a1, 0x7362);
        unsigned lo23 = __byte_perm(a2, a3, 0x5140), hi23 = __byte_perm(a2, a3, 0x7362);
        o[0][i] = __byte_perm(lo01, lo23, 0x5410), o[1][i] = __byte_perm(lo01, lo23, 0x7632);
        o[2][i] = __byte_perm(hi01, hi23, 0x5410), o[3][i] = __byte_perm(hi01, hi23, 0x7632);
    }
}

/* The same for 1-byte elements (the FP8 operands of the backward GEMMs), where a thread per
 * byte would leave the bandwidth idle: 64 x 64 tiles, each thread moving 4-byte words (rows
 * and columns multiples of 4; single bytes otherwise); 256 threads. Both global reads and
 * writes go a row at a time (16 threads, 64 bytes); the tile's rows are 65 bytes apart, so the
 * transposed reads of one warp fall in different banks. */
/* rows and columns multiples of 16 (the FP8 GEMM operands): 16-byte global loads and stores,
 * a load taking a quarter of a tile row; the tile's rows are 68 bytes apart (the loads' words:
 * at most two threads of a warp on one bank) */
/* the 64 x 64 byte tile (rows of 68 bytes in shared memory) at (r0, c0) of an (R, C) matrix,
 * written transposed into out (C, R), 16 bytes a store (R and C multiples of 16). A thread
 * takes a word column w of the tile (its columns 4w .. 4w + 3) over 16 rows and stores four
 * output rows of 16 bytes (ck_bytes_t16x4). Gathered a byte at a time, the transposed store
 * took about a third of the cast-transposes' instructions, and those kernels are bound by
 * their instructions (ncu, an H200). A warp's 32 word reads fall in 32 banks (rows 17 words
 * apart). */
static __device__ void ck_tile_store_t(const unsigned (*tile)[17], unsigned char *out, i64 R, i64 C, i64 r0, i64 c0) {
    for (int k = threadIdx.x; k < 16 * 4; k += blockDim.x) {
        int w = k & 15, q = k >> 4;   /* the tile's columns 4w .. 4w + 3, its rows 16q .. 16q + 15 */
        if (c0 + 4 * w >= C || r0 + q * 16 >= R) continue;
        unsigned o[4][4];
        ck_bytes_t16x4(&tile[q * 16][w], 17, o);
        #pragma unroll
        for (int j = 0; j < 4; j++)
            *(uint4 *)(out + (c0 + 4 * w + j) * R + r0 + q * 16) = make_uint4(o[j][0], o[j][1], o[j][2], o[j][3]);
    }
}

static __device__ void ck_transpose_b1_x16(const unsigned char *in, unsigned char *out, i64 R, i64 C, i64 r0, i64 c0) {
    __shared__ unsigned tile[64][17];
    for (int k = threadIdx.x; k < 64 * 4; k += blockDim.x) {
        int row = k >> 2, q = k & 3;
        if (r0 + row >= R || c0 + q * 16 >= C) continue;
        uint4 v = *(const uint4 *)(in + (r0 + row) * C + c0 + q * 16);
        tile[row][q * 4] = v.x, tile[row][q * 4 + 1] = v.y, tile[row][q * 4 + 2] = v.z, tile[row][q * 4 + 3] = v.w;
    }
    __syncthreads();
    ck_tile_store_t(tile, out, R, C, r0, c0);
}

/* What ck_quantize_t quantizes: x = t[1] as it is stored (CkLd), or the value of an
 * elementwise producer computed from its inputs t[1], t[2] and rounded to Y, the value's own
 * (unscaled) format, where the producer writes its FP8 copies itself (CkLdUnary; spec_fuse.c,
 * fuse_cast_transposes): the bits of quantizing the stored value, without storing it. */
template <class X> struct CkLd {
    static __device__ __forceinline__ bool vec_ok(const CkArgs &a) { return X::vec_ok(a.t[1]); }
    static __device__ __forceinline__ float ld(const CkArgs &a, i64 i) { return X::ld(a.t[1], i); }
    static __device__ __forceinline__ void ld_vec(const CkArgs &a, i64 i, float *v) { X::ld_vec(a.t[1], i, v); }
    /* the vector at row r, column c of the (R, C) value (ck_quantize_t's wide path) */
    static __device__ __forceinline__ void ld_row_vec(const CkArgs &a, i64 r, i64 c, i64 C, float *v) {
        ld_vec(a, r * C + c, v);
    }
};
template <int OP, class Y, class X0, class X1> struct CkLdUnary {
    static constexpr bool two = OP == OP_GELU_BWD || OP == OP_SILU_BWD;
    static __device__ __forceinline__ bool vec_ok(const CkArgs &a) {
        return X0::vec_ok(a.t[1]) && (!two || X1::vec_ok(a.t[2]));
    }
    static __device__ __forceinline__ float ld(const CkArgs &a, i64 i) {
        float v = ck_unop<OP>(X0::ld(a.t[1], i), two ? X1::ld(a.t[2], i) : 0.0f);
        return Y::round(a.t[0], i, v);
    }
    static __device__ __forceinline__ void ld_vec(const CkArgs &a, i64 i, float *v) {
        float x1[CK_VEC];
        X0::ld_vec(a.t[1], i, v);
        if (two) X1::ld_vec(a.t[2], i, x1);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) v[j] = Y::round(a.t[0], i + j, ck_unop<OP>(v[j], two ? x1[j] : 0.0f));
    }
    static __device__ __forceinline__ void ld_row_vec(const CkArgs &a, i64 r, i64 c, i64 C, float *v) {
        ld_vec(a, r * C + c, v);
    }
};

/* A norm's value computed from its input x (t[1]), weight (t[2]), LN's bias (t[3]) and each
 * row's statistics as the norm's own pass kept them (norm.cuh, CkRowStats: (mean, rstd) as
 * float pair r of t[i[2]]), rounded to Y, the norm's own format: the value of the norm's row
 * kernels from the same operations in the same order, LN's (x - mean) rstd w + b, RMSNorm's
 * x rstd w, each rounded apart (no contraction), as those kernels compute them. Used where the
 * norm's FP8 copy is written in both layouts by 64 x 64 tiles (spec_fuse.c,
 * fuse_cast_transposes), which hold no row whole: the row statistics are what a tile needs. */
template <int LN, class Y, class X, class W, class B> struct CkLdNorm {
    static __device__ __forceinline__ bool vec_ok(const CkArgs &a) {
        return X::vec_ok(a.t[1]) && W::vec_ok(a.t[2]) && (!LN || B::vec_ok(a.t[3])) && a.t[1].cols % CK_VEC == 0;
    }
    static __device__ __forceinline__ float value(float x, float2 st, float w, float b) {
        float t = __fmul_rn(__fmul_rn(LN ? __fsub_rn(x, st.x) : x, st.y), w);
        return LN ? __fadd_rn(t, b) : t;
    }
    static __device__ __forceinline__ float ld(const CkArgs &a, i64 i) {
        i64 C = a.t[1].cols, r = i / C, c = i - r * C;
        float2 st = ((const float2 *)a.t[a.i[2]].p)[r];
        float v = value(X::ld(a.t[1], i), st, W::ld(a.t[2], c), LN ? B::ld(a.t[3], c) : 0.0f);
        return Y::round(a.t[0], i, v);
    }
    static __device__ __forceinline__ void ld_row_vec(const CkArgs &a, i64 r, i64 c, i64 C, float *v) {
        float2 st = ((const float2 *)a.t[a.i[2]].p)[r];
        float w[CK_VEC], b[CK_VEC];
        X::ld_vec(a.t[1], r * C + c, v);
        W::ld_vec(a.t[2], c, w);
        if (LN) B::ld_vec(a.t[3], c, b);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) v[j] = Y::round(a.t[0], r * C + c + j, value(v[j], st, w[j], LN ? b[j] : 0.0f));
    }
};

/* BGRAD: the tile's column sums of x, for the sum over rows that a bias gradient is (spec.c,
 * fuse_bias_grads): four quarters of 16 rows each summed in order in f64, then the quarters in
 * order, stored as partial blockIdx.y of column c in scratch (ck_colsum_final's layout). The
 * values come from `vals`, the tile's values as the quantize loaded them (row r - r0, column
 * c - c0), or where it is NULL from x again. Read again, by single loads from L2 with their
 * 64-bit addresses, they made half the instructions of d12's backward cast-transposes, which
 * are bound by their instructions (ncu, an H200). */
#define CK_QT_VALS_PITCH 68   /* floats a row of vals: 16-byte rows, a column read without conflicts */
template <int BGRAD, class L>
static __device__ __forceinline__ void ck_tile_colsum(const CkArgs &a, i64 R, i64 C, i64 r0, i64 c0,
                                                      const float *vals) {
    if (!BGRAD) return;
    __shared__ double part[4][64];
    int col = threadIdx.x & 63, quarter = threadIdx.x >> 6;   /* 256 threads */
    i64 c = c0 + col, lo = r0 + quarter * 16, hi = lo + 16 < R ? lo + 16 : R;
    double s = 0;
    if (c < C && vals) {
        const float *v = vals + (lo - r0) * CK_QT_VALS_PITCH + col;
        for (i64 r = lo; r < hi; r++, v += CK_QT_VALS_PITCH) s += *v;
    } else if (c < C) {
        for (i64 r = lo; r < hi; r++) s += L::ld(a, r * C + c);
    }
    part[quarter][col] = s;
    __syncthreads();
    if (quarter == 0 && c < C)
        ((double *)a.scratch)[(i64)blockIdx.y * C + c] = part[0][col] + part[1][col] + part[2][col] + part[3][col];
}

/* QUANTIZE with transposed=1 (ops.def): the block quantizes the 64 x 64 tile at (r0, c0) of x
 * (R, C, the shape of t[1]; loaded by L: CkLd, CkLdUnary) into the 1-byte result y and,
 * through shared memory, into its transposed copy (C, R): at byte i[0] of y's storage, or
 * where i[1] is set, tensor t[i[1]] (the result of a TRANSPOSE of the copy that this launch
 * writes too: fuse_cast_transposes). The bytes are ck_copy's (the same Y store). Eight
 * elements a thread where the formats and sizes allow, else one. BGRAD: also the tile's
 * column sums of x (ck_tile_colsum). */
template <class Y, class L, int BGRAD> __device__ void ck_quantize_t(const CkArgs &a) {
    __shared__ unsigned tile[64][17];
    __shared__ __align__(16) float vals[BGRAD ? 64 * CK_QT_VALS_PITCH : 4];   /* BGRAD: the tile's values */
    unsigned char *bytes = (unsigned char *)tile;
    const CkTensor &x = a.t[1];
    i64 R = x.rows, C = x.cols;
    i64 c0 = (i64)blockIdx.x * 64, r0 = (i64)blockIdx.y * 64;
    unsigned char *y = (unsigned char *)a.t[0].p;
    unsigned char *yt = a.i[1] ? (unsigned char *)a.t[a.i[1]].p : y + a.i[0];
    CkTensor local = a.t[0];   /* Y's scale, stored into a register or shared memory */
    if (a.scale_amax) local.s = NULL, local.sconst = ck_state_scale(a);   /* a scale it makes (ck_entry) */
    /* local's element 0 stands for any element: one scale for the whole tensor */
    bool wide = (Y::scaling == SCALE_NONE || Y::scaling == SCALE_PER_TENSOR) && C % 16 == 0 && R % 16 == 0 &&
                (unsigned long long)y % 16 == 0 && (unsigned long long)yt % 16 == 0 && L::vec_ok(a) &&
                Y::vec_ok(a.t[0]);
    if (wide) {
        for (int k = threadIdx.x; k < 64 * 8; k += blockDim.x) {
            int row = k >> 3, g = k & 7;
            i64 r = r0 + row, c = c0 + g * 8;
            if (r >= R || c >= C) continue;
            float v[CK_VEC];
            L::ld_row_vec(a, r, c, C, v);
            if (BGRAD) {
                float4 *at = (float4 *)(vals + row * CK_QT_VALS_PITCH + g * 8);
                at[0] = make_float4(v[0], v[1], v[2], v[3]), at[1] = make_float4(v[4], v[5], v[6], v[7]);
            }
            union {
                CkRaw<8> raw;
                unsigned w[2];
            } q;
            local.p = &q;
            Y::st_vec(local, 0, v);
            *(uint2 *)(y + r * C + c) = make_uint2(q.w[0], q.w[1]);
            tile[row][2 * g] = q.w[0], tile[row][2 * g + 1] = q.w[1];
        }
        __syncthreads();
        ck_tile_store_t(tile, yt, R, C, r0, c0);
        ck_tile_colsum<BGRAD, L>(a, R, C, r0, c0, vals);
        return;
    }
    for (int k = threadIdx.x; k < 64 * 64; k += blockDim.x) {
        int row = k >> 6, col = k & 63;
        i64 r = r0 + row, c = c0 + col;
        if (r >= R || c >= C) continue;
        local.p = bytes + row * 68 + col;
        Y::st(local, 0, L::ld(a, r * C + c));
        y[r * C + c] = bytes[row * 68 + col];
    }
    __syncthreads();
    for (int k = threadIdx.x; k < 64 * 64; k += blockDim.x) {
        int orow = k >> 6, ocol = k & 63;   /* y^T row c0 + orow, column r0 + ocol */
        i64 c = c0 + orow, r = r0 + ocol;
        if (c < C && r < R) yt[c * R + r] = bytes[ocol * 68 + orow];
    }
    ck_tile_colsum<BGRAD, L>(a, R, C, r0, c0, NULL);
}

__device__ void ck_transpose_b1(const CkArgs &a) {
    __shared__ unsigned char tile[64][65];
    i64 R = a.t[1].rows, C = a.t[1].cols;
    i64 c0 = (i64)blockIdx.x * 64, r0 = (i64)blockIdx.y * 64;
    const unsigned char *in = (const unsigned char *)a.t[1].p;
    unsigned char *out = (unsigned char *)a.t[0].p;
    if (C % 16 == 0 && R % 16 == 0 && (unsigned long long)in % 16 == 0 && (unsigned long long)out % 16 == 0) {
        ck_transpose_b1_x16(in, out, R, C, r0, c0);
        return;
    }
    bool words = C % 4 == 0 && R % 4 == 0 && (unsigned long long)in % 4 == 0 && (unsigned long long)out % 4 == 0;
    for (int k = threadIdx.x; k < 64 * 16; k += blockDim.x) {
        int row = k >> 4, w = (k & 15) * 4;
        i64 r = r0 + row, c = c0 + w;
        if (r >= R) continue;
        if (words && c + 3 < C) {
            unsigned v = *(const unsigned *)(in + r * C + c);
            for (int b = 0; b < 4; b++) tile[row][w + b] = (unsigned char)(v >> (8 * b));
        } else {
            for (int b = 0; b < 4; b++)
                if (c + b < C) tile[row][w + b] = in[r * C + c + b];
        }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < 64 * 16; k += blockDim.x) {
        int orow = k >> 4, w = (k & 15) * 4;   /* output row c0 + orow, columns r0 + w .. + 3:
                                                  16 threads write one row's 64 bytes */
        i64 c = c0 + orow, r = r0 + w;
        if (c >= C) continue;
        if (words && r + 3 < R) {
            unsigned v = 0;
            for (int b = 0; b < 4; b++) v |= (unsigned)tile[w + b][orow] << (8 * b);
            *(unsigned *)(out + c * R + r) = v;
        } else {
            for (int b = 0; b < 4; b++)
                if (r + b < R) out[c * R + r + b] = tile[w + b][orow];
        }
    }
}

/* the dequantization scales cuBLASLt multiplies by: scratch[16 k] = 1 / scale of t[1 + k]
 * (each on its own 64-byte line) */
__device__ void ck_inv_scales(const CkArgs &a) {
    if (threadIdx.x < 2 && a.t[1 + threadIdx.x].p)
        ((float *)a.scratch)[16 * threadIdx.x] = 1.0f / ((const float *)a.t[1 + threadIdx.x].p)[0];
}

/* The dequantization scales cuBLASLt reads for an FP8 operand with grouped scales, in the
 * layout of its mode (gpu.h's CuScaleMode: 1 per row, 2 1x128 tiles, 3 128x128 blocks), into
 * scratch. t[1]: the operand's scales as the IR lays them out (ref_scale_map: per row [R],
 * tiles [R][C/128], blocks [R/128][C/128]) for the operand stored (R, C); i = {mode, R, C,
 * k_rows: the contraction runs along the stored rows (a block operand read transposed)}. */
__device__ void ck_gemm_scales(const CkArgs &a) {
    const float *s = (const float *)a.t[1].p;
    float *out = (float *)a.scratch;
    i64 mode = a.i[0], R = a.i[1], C = a.i[2];
    bool k_rows = a.i[3] != 0;
    if (mode == 1) {
        CK_GRID_STRIDE(r, R) out[r] = 1.0f / s[r];
    } else if (mode == 2) {   /* [k / 128][outer], outer = R */
        i64 ncg = (C + 127) / 128;
        CK_GRID_STRIDE(j, R * ncg) {
            i64 kb = j / R, r = j - kb * R;
            out[j] = 1.0f / s[r * ncg + kb];
        }
    } else {                  /* [outer / 128][k / 128 rounded up to 4] */
        i64 nrb = (R + 127) / 128, ncb = (C + 127) / 128;
        i64 nob = k_rows ? ncb : nrb, nkb = k_rows ? nrb : ncb, ld = (nkb + 3) / 4 * 4;
        CK_GRID_STRIDE(j, nob * ld) {
            i64 ob = j / ld, kb = j - ob * ld;
            out[j] = kb < nkb ? 1.0f / (k_rows ? s[kb * ncb + ob] : s[ob * ncb + kb]) : 1.0f;
        }
    }
}

/* whether every element of t[0] is finite: scratch (an int flag, zeroed before) gets 1 if not.
 * A thread takes its vectors four strides at a time, the four loads issued before any test. */
template <class X> __device__ void ck_all_finite(const CkArgs &a) {
    int bad = 0;
    if (X::vec_ok(a.t[0])) {
        const i64 nv = a.t[0].n / CK_VEC, stride = CK_BLOCKS * blockDim.x;
        i64 c = CK_BLOCK * blockDim.x + threadIdx.x;
        for (; c + 3 * stride < nv; c += 4 * stride) {
            float v[4][CK_VEC];
            #pragma unroll
            for (int u = 0; u < 4; u++) X::ld_vec(a.t[0], (c + u * stride) * CK_VEC, v[u]);
            #pragma unroll
            for (int u = 0; u < 4; u++)
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) bad |= !isfinite(v[u][j]);
        }
        for (; c < nv; c += stride) {
            float v[CK_VEC];
            X::ld_vec(a.t[0], c * CK_VEC, v);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) bad |= !isfinite(v[j]);
        }
    } else {
        CK_GRID_STRIDE(i, a.t[0].n) bad |= !isfinite(X::ld(a.t[0], i));
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr((int *)a.scratch, 1);
}
