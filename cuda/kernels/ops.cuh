/* ops.cuh — the kernel of every graph op that is not a GEMM or attention, one template each.
 *
 * Each template implements its op exactly as the reference executor defines it (runtime/ref_*.c):
 * the same formulas, f32 where the reference computes in f32, f64 where it accumulates in f64,
 * so that the only differences are the order of f64 sums and the last ulps of exp and tanh.
 * Kernels are written for three shapes of work:
 *   elementwise   a grid-stride loop over the result's elements (any grid size works);
 *   rows          one thread block per row, the row's sums as block reductions;
 *   reductions    two launches: fixed partitions write partial results to the node's scratch,
 *                 then one block adds them in a fixed order. No float atomics anywhere, so
 *                 every run of a step gives the same bits.
 * The argument block's tensors are t[0] = result (or the operand updated in place), then the
 * node's inputs in order; the integer attributes i[] are filled by cuda/spec.c, which names
 * their meaning next to each op. */

/* ---------------------------------------------------------------- helpers over packs */

/* X...[k]::ld(t[base + k], j) for a run-time k */
template <int K, class... X> struct CkPick;
template <int K> struct CkPick<K> {
    static __device__ __forceinline__ float ld(const CkArgs &, int, i64) { return CK_NAN; }
    static __device__ __forceinline__ double sum(const CkArgs &, double s, i64) { return s; }
    static __device__ __forceinline__ bool vec_ok(const CkArgs &) { return true; }
    static __device__ __forceinline__ void sum_vec(const CkArgs &, double *, i64) {}
};
template <int K, class X0, class... X> struct CkPick<K, X0, X...> {
    static __device__ __forceinline__ float ld(const CkArgs &a, int k, i64 j) {
        return k == K ? X0::ld(a.t[1 + K], j) : CkPick<K + 1, X...>::ld(a, k, j);
    }
    /* sum over every input, in input order, in f64 (ref_add_n) */
    static __device__ __forceinline__ double sum(const CkArgs &a, double s, i64 j) {
        s += (double)X0::ld(a.t[1 + K], j);
        return CkPick<K + 1, X...>::sum(a, s, j);
    }
    /* the same for CK_VEC elements from i, read as one vector per input */
    static __device__ __forceinline__ bool vec_ok(const CkArgs &a) {
        return X0::vec_ok(a.t[1 + K]) && CkPick<K + 1, X...>::vec_ok(a);
    }
    static __device__ __forceinline__ void sum_vec(const CkArgs &a, double *s, i64 i) {
        float v[CK_VEC];
        X0::ld_vec(a.t[1 + K], i, v);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) s[j] += (double)v[j];
        CkPick<K + 1, X...>::sum_vec(a, s, i);
    }
};

/* ---------------------------------------------------------------- a producer fused with its quantize
 * Where a value is made only to be quantized with a per-tensor scale of its own (a layernorm
 * or a GELU feeding an FP8 GEMM), spec.c runs its producer's kernel twice instead of storing
 * the value and reading it back: at the producer's place with CkAmaxOnly<Y>, which stores
 * nothing but the block maxima (ck_amax_out) that the scale reads, and at the quantize's place
 * with CkThrough<Y, Q>, which stores each value rounded to Y, the value's own format, then
 * quantized into Q: the bits the quantize would have written from the stored value. Both
 * passes take the same path through the kernel (they agree on vec_ok), so they compute the
 * same values. */
template <class Y> struct CkAmaxOnly {
    static __device__ __forceinline__ bool vec_ok(const CkTensor &t) { return Y::vec_ok(t); }
    static __device__ __forceinline__ void st(const CkTensor &, i64, float) {}
    static __device__ __forceinline__ void st_vec(const CkTensor &, i64, const float *) {}
    static __device__ __forceinline__ float round(const CkTensor &t, i64 i, float v) { return Y::round(t, i, v); }
};
template <class Y, class Q> struct CkThrough {
    /* Y has no scale (spec.c fuses only such values), so its rounding reads nothing of t */
    static __device__ __forceinline__ bool vec_ok(const CkTensor &t) { return Y::vec_ok(t) && Q::vec_ok(t); }
    static __device__ __forceinline__ void st(const CkTensor &t, i64 i, float v) { Q::st(t, i, Y::round(t, i, v)); }
    static __device__ __forceinline__ void st_vec(const CkTensor &t, i64 i, const float *v) {
        float r[CK_VEC];
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) r[j] = Y::round(t, i + j, v[j]);
        Q::st_vec(t, i, r);
    }
    static __device__ __forceinline__ float round(const CkTensor &t, i64 i, float v) { return Q::round(t, i, Y::round(t, i, v)); }
};

/* ---------------------------------------------------------------- block maxima
 * A value whose per-tensor scale comes next (ops.def amax=1) leaves the scale the largest |x|
 * of each block of its producer, so that the scale reads CK_AMAX_PARTS floats instead of the
 * value. Block b of the launch writes slot b; block 0 zeros the slots past the grid (the spec
 * keeps the grid within them). The maximum is taken of the values before their rounding to
 * Y and rounded once: rounding is monotonic, so that is the maximum of the stored values.
 * i[CK_AMAX_AT]: the slots' byte offset from t[0], 0: none. Every thread of the block calls
 * it, after its last store.
 *
 * Where the scale's node would run right after this launch (spec_fuse.c, fold_amax_scales),
 * the launch stores the scale itself: a.scale_to is set, each block takes a ticket after its
 * slot (ck_last_block: a fence, then the count), and the block that finishes last reduces the
 * slots and stores max(elem) / amax / 2^margin as ck_quant_scale_parts would. It reads the
 * grid's slots only: the others hold zeros, which no maximum of |x| changes (fmaxf from 0 is
 * exact and does not depend on the order), so the scale has the bits of the separate launch.
 * A kernel that calls this must not take the ticket for anything else (one counter a launch),
 * and its grid must be one-dimensional and not batched (gridDim.x is the ticket's count). */
static __device__ void ck_amax_scale_out(const CkArgs &a, const float *parts);
template <class Y> static __device__ void ck_amax_out(const CkArgs &a, float m) {
    if (!a.i[CK_AMAX_AT]) return;
    m = ck_block_max(m);
    float *parts = (float *)((char *)a.t[0].p + a.i[CK_AMAX_AT]);
    if (threadIdx.x == 0) parts[CK_BLOCK] = Y::round(a.t[0], 0, m);
    if (CK_BLOCK == 0)
        for (i64 k = CK_BLOCKS + threadIdx.x; k < CK_AMAX_PARTS; k += blockDim.x) parts[k] = 0.0f;
    if (a.scale_to) ck_amax_scale_out(a, parts);
}

/* ---------------------------------------------------------------- elementwise */

template <class Y> __device__ void ck_const(const CkArgs &a) {
    float v = (float)a.f[0];
    CK_GRID_STRIDE(i, a.t[0].n) Y::st(a.t[0], i, v);
}

/* ADD, SUB, MUL; b broadcasts as a suffix (b[i mod nb]) */
template <int OP> static __device__ __forceinline__ float ck_binop(float x, float y) {
    return OP == OP_ADD ? x + y : OP == OP_SUB ? x - y : x * y;
}
template <int OP, class Y, class A, class B> __device__ void ck_binary(const CkArgs &a) {
    i64 n = a.t[0].n, nb = a.t[2].n;
    float m = 0.0f;
    if (Y::vec_ok(a.t[0]) && A::vec_ok(a.t[1]) && B::vec_ok(a.t[2])) {
        CK_GRID_STRIDE(c, n / CK_VEC) {
            float x[CK_VEC], y[CK_VEC];
            A::ld_vec(a.t[1], c * CK_VEC, x);
            B::ld_vec(a.t[2], nb == n ? c * CK_VEC : c * CK_VEC % nb, y);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                x[j] = ck_binop<OP>(x[j], y[j]);
                m = fmaxf(m, fabsf(x[j]));
            }
            Y::st_vec(a.t[0], c * CK_VEC, x);
        }
    } else {
        CK_GRID_STRIDE(i, n) {
            float v = ck_binop<OP>(A::ld(a.t[1], i), B::ld(a.t[2], nb == n ? i : i % nb));
            m = fmaxf(m, fabsf(v));
            Y::st(a.t[0], i, v);
        }
    }
    ck_amax_out<Y>(a, m);
}

template <class Y, class X> __device__ void ck_scale(const CkArgs &a) {
    float alpha = (float)a.f[0];
    CK_GRID_STRIDE(i, a.t[0].n) Y::st(a.t[0], i, alpha * X::ld(a.t[1], i));
}

template <class Y, class... X> __device__ void ck_add_n(const CkArgs &a) {
    float m = 0.0f;
    if (Y::vec_ok(a.t[0]) && CkPick<0, X...>::vec_ok(a)) {
        CK_GRID_STRIDE(c, a.t[0].n / CK_VEC) {
            double s[CK_VEC];
            float out[CK_VEC];
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) s[j] = 0.0;
            CkPick<0, X...>::sum_vec(a, s, c * CK_VEC);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                out[j] = (float)s[j];
                m = fmaxf(m, fabsf(out[j]));
            }
            Y::st_vec(a.t[0], c * CK_VEC, out);
        }
    } else {
        CK_GRID_STRIDE(i, a.t[0].n) {
            float v = (float)CkPick<0, X...>::sum(a, 0.0, i);
            m = fmaxf(m, fabsf(v));
            Y::st(a.t[0], i, v);
        }
    }
    ck_amax_out<Y>(a, m);
}

/* ADD_N of more inputs than an argument block holds: launches of up to 10 inputs each carry
 * the f64 running sum in scratch, so the sum is the same, in the same order, as one launch's */
template <int FIRST, int LAST, class Y, class... X> __device__ void ck_add_n_part(const CkArgs &a) {
    double *acc = (double *)a.scratch;
    CK_GRID_STRIDE(i, a.t[0].n) {
        double s = CkPick<0, X...>::sum(a, FIRST ? 0.0 : acc[i], i);
        if (LAST) Y::st(a.t[0], i, (float)s);
        else acc[i] = s;
    }
}

#define CK_GELU_C 0.7978845608028654f
#define CK_GELU_A 0.044715f
/* -2 sqrt(2 / pi) log2(e) and its product with 0.044715: the exponent of 2 in the logistic
 * form below, z = x (GELU_K1 + GELU_K2 x^2) = -2 u log2(e) */
#define CK_GELU_K1 -2.3022082f
#define CK_GELU_K2 -0.10294324f

/* 2^x by the SFU (ex2.approx.ftz: relative error about 2^-22, +inf past 128, 0 for -inf) */
static __device__ __forceinline__ float ck_exp2_sfu(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* GELU as x / (1 + e^(-2u)) with GELU's u = sqrt(2 / pi) (x + 0.044715 x^3): the logistic
 * of 2u is (1 + tanh(u)) / 2, so this is the reference's tanh form (ref_ops.c, in f64)
 * without the tanh. One ex2 and one fast division (1 + e lies in [1, inf]; past 2^126 the
 * quotient is 0, where the GELU is below 2^-126 |x|), and no cancellation: where tanh(u) is
 * near -1, 1 + tanh lost the low bits of the GELU of a negative x that this keeps. The tanh
 * form (an exp, a division, 1 - e, 1 + e, copysign, then 1 + t and 0.5 x) took 17 f32
 * operations besides its two SFU ones (fmad is off), which made GELU compute-bound on Hopper:
 * d12's GELU at batch 32 (100M elements) took 0.107 ms to read 200 MB, the bandwidth's time
 * some 45 us. This form takes 6 besides the two SFU operations, which alone fit in that time.
 * Within a few f32 ulps of the f64 reference (tests/gpu/test_gpu_ops.c, "gelu f32 wide"). */
static __device__ __forceinline__ float ck_gelu_exp2(float x, float x2) {
    return ck_exp2_sfu(x * (CK_GELU_K1 + CK_GELU_K2 * x2));   /* e^(-2u) */
}

/* GELU, SILU: (x); GELU_BWD, SILU_BWD: (dy, x) */
template <int OP> static __device__ __forceinline__ float ck_unop(float x0, float x1) {
    if (OP == OP_GELU) return __fdividef(x0, 1.0f + ck_gelu_exp2(x0, x0 * x0));
    if (OP == OP_GELU_BWD) {
        /* d/dx x s(x) = s + x s' with s = (1 + tanh(u)) / 2: s' = 2 s (1 - s) u', and
         * 1 - s = e s (no cancellation where s is near 1); e at most 2^125 keeps s normal and
         * e s finite (the true s is smaller still there: x below -9) */
        float v = x1, v2 = v * v, e = fminf(ck_gelu_exp2(v, v2), 0x1p125f);
        float s = __fdividef(1.0f, 1.0f + e), du = CK_GELU_C + (3.0f * CK_GELU_C * CK_GELU_A) * v2;
        return x0 * (s + 2.0f * v * (s * (e * s)) * du);
    }
    if (OP == OP_SILU) return x0 / (1.0f + expf(-x0));
    float s = 1.0f / (1.0f + expf(-x1));
    return x0 * s * (1.0f + x1 * (1.0f - s));
}
template <int OP, class Y, class X0, class X1> __device__ void ck_unary(const CkArgs &a) {
    const bool two = OP == OP_GELU_BWD || OP == OP_SILU_BWD;
    float m = 0.0f;
    if (Y::vec_ok(a.t[0]) && X0::vec_ok(a.t[1]) && (!two || X1::vec_ok(a.t[2]))) {
        CK_GRID_STRIDE(c, a.t[0].n / CK_VEC) {
            float x0[CK_VEC], x1[CK_VEC];
            X0::ld_vec(a.t[1], c * CK_VEC, x0);
            if (two) X1::ld_vec(a.t[2], c * CK_VEC, x1);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                x0[j] = ck_unop<OP>(x0[j], two ? x1[j] : 0.0f);
                m = fmaxf(m, fabsf(x0[j]));
            }
            Y::st_vec(a.t[0], c * CK_VEC, x0);
        }
    } else {
        CK_GRID_STRIDE(i, a.t[0].n) {
            float x0 = X0::ld(a.t[1], i), x1 = two ? X1::ld(a.t[2], i) : 0.0f;
            float v = ck_unop<OP>(x0, x1);
            m = fmaxf(m, fabsf(v));
            Y::st(a.t[0], i, v);
        }
    }
    ck_amax_out<Y>(a, m);
}

/* ---------------------------------------------------------------- an elementwise producer inside its reader
 * Where an elementwise value is read only by other elementwise kernels, the readers may
 * compute it from its own inputs instead of loading it (spec_fuse.c, fuse_inline_elementwise):
 *   an activation inside a binary op   SwiGLU's silu(gate) * up reads gate and up, where the
 *                                      silu's kernel wrote silu(gate) for the product to read;
 *   a product inside an activation's   silu_bwd(dy * up, gate) reads dy, up and gate, where a
 *   backward                           product's kernel wrote dy * up for it to read.
 * The value is rounded to its own (unscaled) format exactly where its store would have
 * rounded it, so the readers compute the bits of the unfused nodes. */

/* Reads act(x) where a binary op's template reads an input: x's tensor stands in that input's
 * slot, and each value is rounded to A, the activation's format, as its store would. */
template <int OP, class A, class X> struct CkAct {
    static __device__ __forceinline__ bool vec_ok(const CkTensor &t) { return X::vec_ok(t); }
    static __device__ __forceinline__ float ld(const CkTensor &t, i64 i) {
        return A::round(t, i, ck_unop<OP>(X::ld(t, i), 0.0f));
    }
    static __device__ __forceinline__ void ld_vec(const CkTensor &t, i64 i, float *v) {
        X::ld_vec(t, i, v);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) v[j] = A::round(t, i + j, ck_unop<OP>(v[j], 0.0f));
    }
};

/* GELU_BWD or SILU_BWD (dy, x) with dy = BOP(p, q) computed here, rounded to its format D:
 * t[0] = y, t[1] = p, t[2] = q, t[3] = x, all of one size; amax as ck_unary */
template <int OP, int BOP, class Y, class D, class P, class Q, class X> __device__ void ck_unary_bin(const CkArgs &a) {
    float m = 0.0f;
    if (Y::vec_ok(a.t[0]) && P::vec_ok(a.t[1]) && Q::vec_ok(a.t[2]) && X::vec_ok(a.t[3])) {
        CK_GRID_STRIDE(c, a.t[0].n / CK_VEC) {
            float p[CK_VEC], q[CK_VEC], x[CK_VEC];
            P::ld_vec(a.t[1], c * CK_VEC, p);
            Q::ld_vec(a.t[2], c * CK_VEC, q);
            X::ld_vec(a.t[3], c * CK_VEC, x);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float dy = D::round(a.t[1], c * CK_VEC + j, ck_binop<BOP>(p[j], q[j]));
                p[j] = ck_unop<OP>(dy, x[j]);
                m = fmaxf(m, fabsf(p[j]));
            }
            Y::st_vec(a.t[0], c * CK_VEC, p);
        }
    } else {
        CK_GRID_STRIDE(i, a.t[0].n) {
            float dy = D::round(a.t[1], i, ck_binop<BOP>(P::ld(a.t[1], i), Q::ld(a.t[2], i)));
            float v = ck_unop<OP>(dy, X::ld(a.t[3], i));
            m = fmaxf(m, fabsf(v));
            Y::st(a.t[0], i, v);
        }
    }
    ck_amax_out<Y>(a, m);
}

/* CAST, RESHAPE, QUANTIZE (the store through Y's format is the quantization), ASSIGN
 * (t[0] = the state, t[1] = x), and format conversions around library GEMMs */
template <class Y, class X> __device__ void ck_copy(const CkArgs &a) {
    if (Y::vec_ok(a.t[0]) && X::vec_ok(a.t[1])) {
        CK_GRID_STRIDE(c, a.t[0].n / CK_VEC) {
            float v[CK_VEC];
            X::ld_vec(a.t[1], c * CK_VEC, v);
            Y::st_vec(a.t[0], c * CK_VEC, v);
        }
        return;
    }
    CK_GRID_STRIDE(i, a.t[0].n) Y::st(a.t[0], i, X::ld(a.t[1], i));
}

/* SLICE, PAD: i = {outer, len_y, len_x, inner, start}. A slice keeps, of each of the outer
 * blocks of lx inner-runs, the ly runs from start on: one contiguous piece a block. Where the
 * pieces and their starts are whole vectors, a thread copies a vector and finds its block once
 * for it: an element at a time, the 64-bit divisions of the index took longer than the copy
 * (Llama 1.1B's backward splits attention's packed dq|dk|dv into three, 66 launches a step,
 * 2.0 ms of a traced step at 0.9 TB/s). The same values either way. */
template <int PADDING, class Y, class X> __device__ void ck_slice(const CkArgs &a) {
    i64 ly = a.i[1], lx = a.i[2], inner = a.i[3], start = a.i[4];
    i64 piece = ly * inner, row = lx * inner, at = start * inner;
    if (!PADDING && piece % CK_VEC == 0 && row % CK_VEC == 0 && at % CK_VEC == 0 && Y::vec_ok(a.t[0]) &&
        X::vec_ok(a.t[1])) {
        CK_GRID_STRIDE(v, a.t[0].n / CK_VEC) {
            i64 e = v * CK_VEC, o = e / piece;
            float x[CK_VEC];
            X::ld_vec(a.t[1], o * row + at + (e - o * piece), x);
            Y::st_vec(a.t[0], e, x);
        }
        return;
    }
    CK_GRID_STRIDE(i, a.t[0].n) {
        i64 o = i / (ly * inner), rem = i - o * ly * inner, l = rem / inner, in = rem - l * inner;
        float v;
        if (PADDING) {
            i64 k = l - start;
            v = k >= 0 && k < lx ? X::ld(a.t[1], (o * lx + k) * inner + in) : 0.0f;
        } else {
            v = X::ld(a.t[1], (o * lx + start + l) * inner + in);
        }
        Y::st(a.t[0], i, v);
    }
}

/* CONCAT: i = {outer, len_y, inner, len_x of input 0, 1, ..} */
template <class Y, class... X> __device__ void ck_concat(const CkArgs &a) {
    i64 ly = a.i[1], inner = a.i[2];
    CK_GRID_STRIDE(i, a.t[0].n) {
        i64 o = i / (ly * inner), rem = i - o * ly * inner, l = rem / inner, in = rem - l * inner;
        int k = 0;
        i64 at = 0;
        while (k + 1 < a.n_in && l >= at + a.i[3 + k]) at += a.i[3 + k++];
        i64 lx = a.i[3 + k];
        Y::st(a.t[0], i, CkPick<0, X...>::ld(a, k, (o * lx + (l - at)) * inner + in));
    }
}

/* CONCAT of more inputs than an argument block holds: each launch writes its inputs' part of
 * the result; i = {outer, len_y, inner, at (the part's start on the axis), len of the part,
 * len_x of its inputs ..} */
template <class Y, class... X> __device__ void ck_concat_part(const CkArgs &a) {
    i64 ly = a.i[1], inner = a.i[2], at0 = a.i[3], lp = a.i[4];
    CK_GRID_STRIDE(j, a.i[0] * lp * inner) {
        i64 o = j / (lp * inner), rem = j - o * lp * inner, l = rem / inner, in = rem - l * inner;
        int k = 0;
        i64 at = 0;
        while (k + 1 < a.n_in && l >= at + a.i[5 + k]) at += a.i[5 + k++];
        i64 lx = a.i[5 + k];
        Y::st(a.t[0], (o * ly + at0 + l) * inner + in, CkPick<0, X...>::ld(a, k, (o * lx + (l - at)) * inner + in));
    }
}

/* EMBEDDING (table (V, C), ids): an id out of range reads NaN (the runtime checks tokens
 * against the vocabulary before they get here) */
template <class Y, class T, class I> __device__ void ck_embedding(const CkArgs &a) {
    i64 C = a.t[1].cols, V = a.t[1].rows;
    CK_GRID_STRIDE(i, a.t[0].n) {
        i64 r = i / C, c = i - r * C;
        float v = I::ld(a.t[2], r);
        bool ok = v >= 0.0f && v < (float)V && v == floorf(v);
        Y::st(a.t[0], i, ok ? T::ld(a.t[1], (i64)v * C + c) : CK_NAN);
    }
}

/* ROPE: i = {head_dim, inverse, C, T}, f = {theta}; over pairs (2j, 2j+1). The rotation of
 * pair k of position p depends on (p, k) alone: the first launch makes the T x head_dim / 2
 * table of cos and sin (f64, as the reference computes them) in the scratch, the second
 * rotates every head's pairs by reading it. Each pair used to compute its own pow, cos and sin
 * in f64, some 0.1 ms per launch on Llama 1.1B's q at batch 4 x 2048 (8.8 ms of its step); the
 * bits are the same. */
template <class Y, class X> __device__ void ck_rope_table(const CkArgs &a) {
    i64 D = a.i[0], T = a.i[3], K = D / 2;
    double theta = a.f[0], *tab = (double *)a.scratch;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < T * K; j += (i64)gridDim.x * blockDim.x) {
        i64 p = j / K, k = j % K;
        double ang = (double)p * pow(theta, -2.0 * (double)k / (double)D);
        tab[2 * j] = cos(ang);
        tab[2 * j + 1] = sin(ang);
    }
}
/* Where a head is whole vectors (D and C multiples of CK_VEC) and both tensors allow wide
 * loads, a thread takes a vector, four pairs of one head at one position, and finds the
 * position and pair once for them: the 64-bit divisions of the index took more time than the
 * rope's memory (Llama 1.1B at 4 x 2048: 3.0 ms of a traced step in 88 launches). The same
 * f64 products per pair, so the same bits. */
template <class Y, class X> __device__ void ck_rope(const CkArgs &a) {
    i64 D = a.i[0], C = a.i[2], T = a.i[3];
    double sign = a.i[1] ? -1.0 : 1.0;
    const double *tab = (const double *)a.scratch;
    if (D % CK_VEC == 0 && C % CK_VEC == 0 && X::vec_ok(a.t[1]) && Y::vec_ok(a.t[0])) {
        CK_GRID_STRIDE(v, a.t[0].n / CK_VEC) {
            i64 e = v * CK_VEC, c = e % C, p = (e / C) % T, k = (c % D) / 2;
            const double *cs = tab + 2 * (p * (D / 2) + k);
            float x[CK_VEC], y[CK_VEC];
            X::ld_vec(a.t[1], e, x);
            #pragma unroll
            for (int q = 0; q < CK_VEC / 2; q++) {
                double co = cs[2 * q], si = sign * cs[2 * q + 1], x0 = x[2 * q], x1 = x[2 * q + 1];
                y[2 * q] = (float)(x0 * co - x1 * si);
                y[2 * q + 1] = (float)(x0 * si + x1 * co);
            }
            Y::st_vec(a.t[0], e, y);
        }
        return;
    }
    CK_GRID_STRIDE(j, a.t[0].n / 2) {
        i64 e = 2 * j, c = e % C, p = (e / C) % T, k = (c % D) / 2;
        const double *cs = tab + 2 * (p * (D / 2) + k);
        double co = cs[0], si = sign * cs[1];
        double x0 = X::ld(a.t[1], e), x1 = X::ld(a.t[1], e + 1);
        Y::st(a.t[0], e, (float)(x0 * co - x1 * si));
        Y::st(a.t[0], e + 1, (float)(x0 * si + x1 * co));
    }
}

/* ACCUMULATE: t[0] = the accumulator, updated in place; t[1] = g */
template <class A, class G> __device__ void ck_accumulate(const CkArgs &a) {
    CK_GRID_STRIDE(i, a.t[0].n) A::st(a.t[0], i, A::ld(a.t[0], i) + G::ld(a.t[1], i));
}

/* ---------------------------------------------------------------- optimizer scalars */

/* CLIP_COEF (grad_norm): f = {max_norm} */
template <class Y, class X> __device__ void ck_clip_coef(const CkArgs &a) {
    if (blockIdx.x || threadIdx.x) return;
    double max_norm = a.f[0], norm = X::ld(a.t[1], 0);
    Y::st(a.t[0], 0, max_norm > 0 ? (float)fmin(1.0, max_norm / (norm + 1e-6)) : 1.0f);
}

/* GRAD_NORM (grad_scale, sqnorms..): the sqnorms are plain f32 scalars listed in a.table */
template <class Y, class S> __device__ void ck_grad_norm(const CkArgs &a) {
    if (blockIdx.x || threadIdx.x) return;
    double s = 0;
    for (int k = 0; k < a.n_in - 1; k++) s += a.table[k][0];
    Y::st(a.t[0], 0, (float)(sqrt(s) * S::ld(a.t[1], 0)));
}

/* AdamW's FP8 weight copy (COPY_AT > 0: the copy is t[COPY_AT], format CP): the weight as
 * stored, quantized through the copy's scale, and the block's largest |weight| so far in m */
template <int COPY_AT, class P, class CP>
static __device__ __forceinline__ void ck_adamw_copy(const CkArgs &a, i64 i, float w, float &m) {
    if (!COPY_AT) return;
    float stored = P::round(a.t[0], i, w);
    CP::st(a.t[COPY_AT], i, stored);
    m = fmaxf(m, fabsf(stored));
}

/* every block leaves its maximum in the scratch (plan_copy_amax); all threads call it */
template <int COPY_AT> static __device__ __forceinline__ void ck_adamw_copy_amax(const CkArgs &a, float m) {
    if (!COPY_AT) return;
    m = ck_block_max(m);
    if (threadIdx.x == 0) ((float *)a.scratch)[CK_BLOCK] = m;
}

/* ADAMW (param, grad, m, v, lr, step, clip, grad_scale[, master][, copy, scale, amax]):
 * f = {b1, b2, eps, wd} */
template <class P, class G, class M, class V, class LR, class ST, class CL, class GS, class W,
          int MASTER, class CP, int COPY_AT>
__device__ void ck_adamw(const CkArgs &a) {
    __shared__ double k[4];   /* lr, gmul, 1 / bc1, 1 / bc2 (the divisions once per block) */
    double b1 = a.f[0], b2 = a.f[1], eps = a.f[2], wd = a.f[3];
    if (threadIdx.x == 0) {
        double step = ST::ld(a.t[5], 0);
        k[0] = LR::ld(a.t[4], 0);
        k[1] = (double)GS::ld(a.t[7], 0) * (double)CL::ld(a.t[6], 0);
        k[2] = 1 / (1 - pow(b1, step));
        k[3] = 1 / (1 - pow(b2, step));
    }
    __syncthreads();
    float copy_max = 0.0f;
    if (P::vec_ok(a.t[0]) && G::vec_ok(a.t[1]) && M::vec_ok(a.t[2]) && V::vec_ok(a.t[3]) &&
        (!MASTER || W::vec_ok(a.t[8]))) {
        CK_GRID_STRIDE(c, a.t[0].n / CK_VEC) {
            i64 i = c * CK_VEC;
            float g[CK_VEC], m[CK_VEC], v[CK_VEC], w[CK_VEC];
            G::ld_vec(a.t[1], i, g);
            M::ld_vec(a.t[2], i, m);
            V::ld_vec(a.t[3], i, v);
            if (MASTER) W::ld_vec(a.t[8], i, w);
            else P::ld_vec(a.t[0], i, w);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                double gj = g[j] * k[1];
                double mj = b1 * m[j] + (1 - b1) * gj;
                double vj = b2 * v[j] + (1 - b2) * gj * gj;
                double mhat = mj * k[2], vhat = vj * k[3];
                double wj = w[j];
                wj -= k[0] * (mhat / (sqrt(vhat) + eps) + wd * wj);
                m[j] = (float)mj, v[j] = (float)vj, w[j] = (float)wj, g[j] = 0.0f;
            }
            M::st_vec(a.t[2], i, m);
            V::st_vec(a.t[3], i, v);
            G::st_vec(a.t[1], i, g);
            if (MASTER) W::st_vec(a.t[8], i, w);
            P::st_vec(a.t[0], i, w);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) ck_adamw_copy<COPY_AT, P, CP>(a, i + j, w[j], copy_max);
        }
        ck_adamw_copy_amax<COPY_AT>(a, copy_max);
        return;
    }
    CK_GRID_STRIDE(i, a.t[0].n) {
        double g = G::ld(a.t[1], i) * k[1];
        double m = b1 * M::ld(a.t[2], i) + (1 - b1) * g;
        double v = b2 * V::ld(a.t[3], i) + (1 - b2) * g * g;
        double mhat = m * k[2], vhat = v * k[3];
        double w = MASTER ? (double)W::ld(a.t[8], i) : (double)P::ld(a.t[0], i);
        w -= k[0] * (mhat / (sqrt(vhat) + eps) + wd * w);
        M::st(a.t[2], i, (float)m);
        V::st(a.t[3], i, (float)v);
        G::st(a.t[1], i, 0.0f);
        if (MASTER) W::st(a.t[8], i, (float)w);
        P::st(a.t[0], i, (float)w);
        ck_adamw_copy<COPY_AT, P, CP>(a, i, (float)w, copy_max);
    }
    ck_adamw_copy_amax<COPY_AT>(a, copy_max);
}

/* ---------------------------------------------------------------- rows */

/* ---------------------------------------------------------------- norms
 * A warp per row (8 rows a block of 256 threads): the row's sums are warp reductions, with no
 * shared memory and no block barrier, which a row of a few thousand elements cannot afford.
 * Where the row is whole vectors of at most CK_ROW_VECS x 32 x CK_VEC elements and every
 * operand allows wide loads, a lane holds its part of x in registers (read once) and works in
 * f32 (f64 conversions cost more than the row's memory traffic; the errors stay far inside
 * the tests' bounds); otherwise lanes step through the row an element at a time in f64. Sums
 * are in a fixed order. NV, the vectors a lane holds, is the row's own (spec.c: ceil(C / 256),
 * 0 for rows that do not fit): registers sized for the longest row would leave a row of 768
 * with a third of the warps an SM can hold, and the norms latency-bound.
 * LAYERNORM (x, w, b) / RMSNORM (x, w): i = {C, R}, f = {eps} */
#define CK_ROW_VECS 8
#define CK_ROW_OF_WARP ((i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5))

/* A row's mean from the lanes' partial sums s of its C elements, and its 1 / sqrt(var + eps)
 * from the partial sums of squared deviations q, every lane getting them. In f32: a warp sum
 * in f64 takes two shuffles a step and f64 arithmetic, and holding it cost the norms 73 to 80
 * registers a thread, three blocks an SM, too few rows in flight to keep the memory busy; f32
 * sums of a row of a few thousand values are good to about 1e-6 relative. */
static __device__ __forceinline__ float ck_row_mean(float s, i64 C) { return ck_warp_sum(s) / (float)C; }
static __device__ __forceinline__ float ck_row_rstd(float q, i64 C, double eps) {
    return 1.0f / sqrtf(ck_warp_sum(q) / (float)C + (float)eps);
}

/* x's part of row r held by this lane, and mean and rstd of the row (every lane gets them) */
template <int LN, int NV, class X> __device__ __forceinline__ void ck_row_load_stats(
    const CkTensor &x, i64 r, i64 C, double eps, float (&v)[NV][CK_VEC], float *mean, float *rstd) {
    int lane = threadIdx.x & 31;
    float s = 0;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (c < C) {
            X::ld_vec(x, r * C + c, v[k]);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) s += v[k][j];
        }
    }
    float m = LN ? ck_row_mean(s, C) : 0.0f, q = 0;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (c < C)
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float d = v[k][j] - m;
                q = fmaf(d, d, q);
            }
    }
    *mean = m;
    *rstd = ck_row_rstd(q, C, eps);
}

/* the same, an element at a time (any row length and format) */
template <int LN, class X> __device__ void ck_row_stats(const CkTensor &x, i64 r, i64 C, double eps,
                                                        double *mean, double *rstd) {
    int lane = threadIdx.x & 31;
    double s = 0;
    if (LN)
        for (i64 c = lane; c < C; c += 32) s += X::ld(x, r * C + c);
    double m = LN ? ck_warp_sum(s) / (double)C : 0.0, q = 0;
    for (i64 c = lane; c < C; c += 32) {
        double d = X::ld(x, r * C + c) - m;
        q += d * d;
    }
    *mean = m;
    *rstd = 1.0 / sqrt(ck_warp_sum(q) / (double)C + eps);
}

template <int NV> static __device__ __forceinline__ bool ck_row_in_registers(i64 C) {
    return NV > 0 && C % CK_VEC == 0 && C <= (i64)NV * 32 * CK_VEC;
}

/* the norm's results of row r from its vectors in registers (ck_row_load_stats); returns the
 * largest |result| before rounding */
template <int LN, int NV, class Y, class W, class B> __device__ __forceinline__ float ck_norm_row_out(
    const CkArgs &a, i64 r, i64 C, const float (&v)[NV][CK_VEC], float mean, float rstd) {
    int lane = threadIdx.x & 31;
    float m = 0.0f;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (c >= C) continue;
        float w[CK_VEC], bias[CK_VEC], out[CK_VEC];
        W::ld_vec(a.t[2], c, w);
        if (LN) B::ld_vec(a.t[3], c, bias);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            float t = (v[k][j] - mean) * rstd * w[j];
            out[j] = LN ? t + bias[j] : t;
            m = fmaxf(m, fabsf(out[j]));
        }
        Y::st_vec(a.t[0], r * C + c, out);
    }
    return m;
}

/* whether row r of a norm runs from registers (the vector path of ck_norm_row) */
template <int NV, class Y, class X, class W, class B, int LN> __device__ __forceinline__ bool ck_norm_vec_ok(const CkArgs &a) {
    return ck_row_in_registers<NV>(a.i[0]) && X::vec_ok(a.t[1]) && Y::vec_ok(a.t[0]) && W::vec_ok(a.t[2]) &&
           (!LN || B::vec_ok(a.t[3]));
}

template <int LN, class Y, class X, class W, class B> __device__ __forceinline__ float ck_norm_row_scalar(const CkArgs &a, i64 r);

/* row r of LAYERNORM / RMSNORM; returns the largest |result| before rounding */
template <int LN, int NV, class Y, class X, class W, class B> __device__ __forceinline__ float ck_norm_row(const CkArgs &a, i64 r) {
    i64 C = a.i[0];
    if (ck_norm_vec_ok<NV, Y, X, W, B, LN>(a)) {
        float v[NV > 0 ? NV : 1][CK_VEC], mean, rstd;
        ck_row_load_stats<LN, (NV > 0 ? NV : 1), X>(a.t[1], r, C, a.f[0], v, &mean, &rstd);
        return ck_norm_row_out<LN, (NV > 0 ? NV : 1), Y, W, B>(a, r, C, v, mean, rstd);
    }
    return ck_norm_row_scalar<LN, Y, X, W, B>(a, r);
}

/* row r of LAYERNORM / RMSNORM an element at a time, statistics in f64 (any row and format) */
template <int LN, class Y, class X, class W, class B> __device__ __forceinline__ float ck_norm_row_scalar(const CkArgs &a, i64 r) {
    i64 C = a.i[0];
    int lane = threadIdx.x & 31;
    const CkTensor &x = a.t[1], &y = a.t[0];
    float m = 0.0f;
    double mean, rstd;
    ck_row_stats<LN, X>(x, r, C, a.f[0], &mean, &rstd);
    for (i64 c = lane; c < C; c += 32) {
        double t = (X::ld(x, r * C + c) - mean) * rstd * W::ld(a.t[2], c);
        if (LN) t += B::ld(a.t[3], c);
        m = fmaxf(m, fabsf((float)t));
        Y::st(y, r * C + c, (float)t);
    }
    return m;
}

/* a warp per row, striding by the grid's warps when the grid is capped (amax=1) */
#define CK_ROW_STRIDE ((i64)gridDim.x * (blockDim.x >> 5))
#define CK_ROWS_OF_WARP(r, R) for (i64 r = CK_ROW_OF_WARP; r < (R); r += CK_ROW_STRIDE)

/* ---------------------------------------------------------------- rows staged in shared memory
 * A warp that loads a row into registers and then reduces it has that row's bytes in flight
 * only until its loads return, and none while it computes: measured on an H200 (ncu, GPT-2
 * d12 -O1), the norms waited on loads 42-49% of their cycles at 27-36% of the memory's
 * bandwidth with 28-30 warps an SM, and a hint that brought the next row into L2 early
 * (prefetch.global.L2) gained nothing. Staged, a warp copies the row it takes next into shared
 * memory by cp.async (no registers held, nothing waited for) before it works on the one in
 * hand, which its lanes then read from shared memory: each warp has a row in flight all the
 * time. A lane copies exactly the vectors it reads later (vector k 32 + lane, the layout of
 * ck_row_load_stats), so its own cp.async.wait_group is all the ordering needed, no barrier;
 * and it reads a slot's values into registers before it copies into that slot again. Two
 * slots a warp and tensor, in the launch's dynamic shared memory (spec_ops.c, norm_stage,
 * sizes it the same way). The bytes decoded are those a load would read: the same results. */
#define CK_STAGE_SLOTS 2
/* A ring of CK_STAGE_SLOTS slots of SLOT bytes (at least NV 32 vectors of X: ck_stage_fits) */
template <int NV, class X, int SLOT> struct CkStage {
    unsigned char *ring;
    __device__ __forceinline__ const unsigned char *slot(int k) const { return ring + k * SLOT; }
    /* this lane's vectors of row r of x into slot k (nothing past R; no commit); FULL: C is
     * NV 32 vectors, every lane has all NV */
    template <bool FULL = false> __device__ __forceinline__ void fetch(const CkTensor &x, i64 r, i64 R, i64 C, int k) const {
        if (r >= R) return;
        int lane = threadIdx.x & 31;
        unsigned to = (unsigned)__cvta_generic_to_shared(ring + k * SLOT);
        #pragma unroll
        for (int v = 0; v < NV; v++) {
            i64 c = ((i64)v * 32 + lane) * CK_VEC;
            if (!FULL && c >= C) continue;
            const char *src = (const char *)x.p + (r * C + c) * ElemBytes<X::elem>::n;
            unsigned dst = to + (v * 32 + lane) * X::vbytes;
            if (X::vbytes == 8) {
                asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
            } else {
                #pragma unroll
                for (int h = 0; h < X::vbytes / 16; h++)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + 16 * h), "l"(src + 16 * h)
                                 : "memory");
            }
        }
    }
    /* vector v of this lane from slot k, decoded as a load of element i of x decodes it */
    __device__ __forceinline__ void read(const CkTensor &x, i64 i, int k, int v, float *out) const {
        X::decode_vec(x, i, ((const typename X::Raw *)slot(k))[v * 32 + (threadIdx.x & 31)], out);
    }
};
template <int NV, class X, int SLOT> __host__ __device__ constexpr bool ck_stage_fits() {
    return SLOT >= NV * 32 * X::vbytes && SLOT % 16 == 0;
}
/* the copies fetched since the last commit, as one group (possibly empty: groups count rows) */
static __device__ __forceinline__ void ck_stage_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* every group but the newest is in */
static __device__ __forceinline__ void ck_stage_wait_prev() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

/* The ring of this warp for tensor t, in the dynamic shared memory from byte `at` on: the
 * block's rings of tensor 0 (a ring a warp, CK_STAGE_SLOTS slots of SLOT bytes), then of
 * tensor 1, .. (spec_ops.c, norm_stage, lays them out the same way) */
template <int SLOT> static __device__ __forceinline__ unsigned char *ck_stage_ring(int at, int t) {
    extern __shared__ __align__(16) unsigned char ck_stage_smem[];
    int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    return ck_stage_smem + at + (i64)((t * warps + warp) * CK_STAGE_SLOTS) * SLOT;
}

/* ---------------------------------------------------------------- the staged forward's rows
 * Once its bytes are staged, a row is instruction-bound: ncu on an H200 put the staged norms at
 * 1.2 TB/s, a third of the memory's bandwidth. So the forward norms' staged path does per row
 * only what the row needs; every value is computed by the same operations in the same order as
 * ck_row_load_stats and ck_norm_row_out compute it, and every result bit is theirs.
 *  - A lane's vectors of the weight (and LN's bias) are the same for every row: where they fit
 *    beside the row (ck_norm_holds: short rows) the lane loads them once, as stored, before
 *    the warp's first row, and decodes them per row (a bf16 element is one shift); elsewhere
 *    it reads them per row, which costs fewer instructions than the registers would cost warps.
 *  - Vectors are read whole (ck_raw_vec): copied as a struct of bytes, a bf16 weight and bias
 *    vector came apart into 16 two-byte loads, and a staged vector into two shared loads.
 *  - LN keeps x - mean, computed once for the squared deviations, in place of x: the result's
 *    (x - mean) is the same operation on the same values.
 *  - Rows of exactly NV 32 vectors (FULL: 768 at NV 3, Llama's 2048 at NV 8), the common case,
 *    are a second instance of the loop with no column tests; C and eps are converted to f32
 *    once, not per row.
 *  - The FP8 tile of ck_norm_t is addressed from the row and column the loop has, not from a
 *    64-bit division of the flat index (CkRowSt). */

/* One vector's bytes, vector v of the array at p, read whole into r (filled in place: a Raw
 * returned by value is rebuilt byte by byte, four instructions an element to decode bf16) */
template <class X> static __device__ __forceinline__ void ck_raw_vec(const void *p, i64 v, typename X::Raw &r) {
    if constexpr (X::vbytes && X::vbytes % 16 == 0) {
        #pragma unroll
        for (int h = 0; h < X::vbytes / 16; h++) ((uint4 *)&r)[h] = ((const uint4 *)p)[v * (X::vbytes / 16) + h];
    } else if constexpr (X::vbytes == 8) {
        *(uint2 *)&r = ((const uint2 *)p)[v];
    } else {
        r = ((const typename X::Raw *)p)[v];
    }
}

/* Whether a lane of a staged forward norm holds its weight (and bias) vectors through its rows:
 * their stored bytes cost NV (W's + B's) / 4 registers, on top of the row's NV CK_VEC values,
 * and are held only where the two together stay within CK_NORM_HELD words: rows of up to 256
 * (NV 1), and RMSNorm's of up to 512 with bf16 weights. Measured with ptxas (sm_90a), longer
 * rows cannot afford them: d12's layernorm (NV 3, bf16, 24 words held) spilled 136 to 168
 * bytes a thread under the 64 registers its bounds leave (spec_ops.c, norm_min_blocks), and
 * Llama's RMSNorm (NV 8, 32 words) went from 120-127 registers to 176-187, one block of 256
 * an SM instead of two. There the weights are read per row, two 16-byte loads a vector. */
#define CK_NORM_HELD 24
template <int LN, int NV, class W, class B> __host__ __device__ constexpr bool ck_norm_holds() {
    return NV * CK_VEC + NV * (W::vbytes + (LN ? B::vbytes : 0)) / 4 <= CK_NORM_HELD;
}

/* A lane's vectors of a norm's weight (t[2]) and, for LN, bias (t[3]): held as stored where
 * HOLD, else read per row; each decoded as ld_vec decodes it */
template <int LN, int NV, bool HOLD, class W, class B> struct CkNormAffine {
    typename W::Raw w[HOLD ? NV : 1];
    typename B::Raw b[HOLD && LN ? NV : 1];
    __device__ __forceinline__ void hold(const CkArgs &a, i64 C) {
        if constexpr (HOLD) {
            int lane = threadIdx.x & 31;
            #pragma unroll
            for (int k = 0; k < NV; k++) {
                i64 c = ((i64)k * 32 + lane) * CK_VEC;
                if (c >= C) continue;
                ck_raw_vec<W>(a.t[2].p, ck_vec_index(c), w[k]);
                if (LN) ck_raw_vec<B>(a.t[3].p, ck_vec_index(c), b[k]);
            }
        }
    }
    /* vector k of this lane, starting at column c */
    __device__ __forceinline__ void get(const CkArgs &a, int k, i64 c, float *wv, float *bv) const {
        if constexpr (HOLD) {
            W::decode_vec(a.t[2], c, w[k], wv);
            if (LN) B::decode_vec(a.t[3], c, b[k], bv);
        } else {
            typename W::Raw wr;
            ck_raw_vec<W>(a.t[2].p, ck_vec_index(c), wr);
            W::decode_vec(a.t[2], c, wr, wv);
            if (LN) {
                typename B::Raw br;
                ck_raw_vec<B>(a.t[3].p, ck_vec_index(c), br);
                B::decode_vec(a.t[3], c, br, bv);
            }
        }
    }
};

/* Y::st_vec of the vector at column c of row r (CkRowSt<CkTileSt>: without the division) */
template <class Y> struct CkRowSt {
    static __device__ __forceinline__ void st(const CkTensor &t, i64 r, i64 C, i64 c, const float *v) {
        Y::st_vec(t, r * C + c, v);
    }
};

/* x's part of row r (its first element i0) from its staged bytes, as ck_row_load_stats reads
 * it: LN leaves in v each value less the mean, RMSNorm the values; rstd for every lane. n and
 * eps: C and eps in f32. */
template <int LN, int NV, bool FULL, class X> static __device__ __forceinline__ void ck_staged_row_stats(
    const CkTensor &x, i64 i0, i64 C, float n, float eps, const unsigned char *slot, float (&v)[NV][CK_VEC],
    float *rstd) {
    int lane = threadIdx.x & 31;
    float s = 0;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (!FULL && c >= C) continue;
        typename X::Raw xr;
        ck_raw_vec<X>(slot, k * 32 + lane, xr);
        X::decode_vec(x, i0 + c, xr, v[k]);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) s += v[k][j];
    }
    float m = LN ? ck_warp_sum(s) / n : 0.0f, q = 0;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (!FULL && c >= C) continue;
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            float d = v[k][j] - m;
            q = fmaf(d, d, q);
            if (LN) v[k][j] = d;
        }
    }
    *rstd = 1.0f / sqrtf(ck_warp_sum(q) / n + eps);
}

/* the norm's results of row r from d (ck_staged_row_stats) as ck_norm_row_out finds them;
 * returns the largest |result| before rounding */
template <int LN, int NV, bool FULL, class Y, class Aff> static __device__ __forceinline__ float ck_staged_row_out(
    const CkArgs &a, i64 r, i64 C, const float (&d)[NV][CK_VEC], float rstd, const Aff &aff) {
    int lane = threadIdx.x & 31;
    float m = 0.0f;
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        if (!FULL && c >= C) continue;
        float w[CK_VEC], bias[CK_VEC], out[CK_VEC];
        aff.get(a, k, c, w, bias);
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            float t = d[k][j] * rstd * w[j];
            out[j] = LN ? t + bias[j] : t;
            m = fmaxf(m, fabsf(out[j]));
        }
        CkRowSt<Y>::st(a.t[0], r, C, c, out);
    }
    return m;
}

/* Rows r = first, first + step, .. below end and R of a forward norm, each from its staged
 * copy, the next one fetched before the warp works on the one in hand (x's rows in vectors:
 * ck_norm_vec_ok; the rings from byte 0 of the dynamic shared memory); the results through Y
 * into a.t[0]; returns the largest |result| */
template <int LN, int NV, int SLOT, bool FULL, class Y, class X, class W, class B>
static __device__ __forceinline__ float ck_staged_rows(const CkArgs &a, i64 first, i64 step, i64 end) {
    static_assert(ck_stage_fits<NV, X, SLOT>(), "a slot holds a row of whole vectors");
    const CkTensor &x = a.t[1];
    const i64 C = a.i[0], R = a.i[1];
    const float n = (float)C, eps = (float)a.f[0];
    CkNormAffine<LN, NV, ck_norm_holds<LN, NV, W, B>(), W, B> aff;
    aff.hold(a, C);
    const CkStage<NV, X, SLOT> st{ck_stage_ring<SLOT>(0, 0)};
    if (end > R) end = R;
    st.template fetch<FULL>(x, first, end, C, 0);
    ck_stage_commit();
    float m = 0.0f;
    int k = 0;
    for (i64 r = first; r < end; r += step, k ^= 1) {
        st.template fetch<FULL>(x, r + step, end, C, k ^ 1);
        ck_stage_commit();
        ck_stage_wait_prev();
        float v[NV][CK_VEC], rstd;
        ck_staged_row_stats<LN, NV, FULL, X>(x, r * C, C, n, eps, st.slot(k), v, &rstd);
        m = fmaxf(m, ck_staged_row_out<LN, NV, FULL, Y>(a, r, C, v, rstd, aff));
    }
    return m;
}
/* the same, the instance for C: rows of exactly NV 32 vectors test no columns */
template <int LN, int NV, int SLOT, class Y, class X, class W, class B>
static __device__ __forceinline__ float ck_staged_norm_rows(const CkArgs &a, i64 first, i64 step, i64 end) {
    if (a.i[0] == (i64)NV * 32 * CK_VEC) return ck_staged_rows<LN, NV, SLOT, true, Y, X, W, B>(a, first, step, end);
    return ck_staged_rows<LN, NV, SLOT, false, Y, X, W, B>(a, first, step, end);
}

/* ST: 0, or the rows staged through slots of ST bytes (the launch has the shared memory) */
template <int LN, int NV, int ST, class Y, class X, class W, class B> __device__ void ck_norm(const CkArgs &a) {
    float m = 0.0f;
    bool staged = false;
    if constexpr (ST > 0)
        if ((staged = ck_norm_vec_ok<NV, Y, X, W, B, LN>(a)))
            m = ck_staged_norm_rows<LN, NV, ST, Y, X, W, B>(a, CK_ROW_OF_WARP, CK_ROW_STRIDE, a.i[1]);
    if (!staged) CK_ROWS_OF_WARP(r, a.i[1]) m = fmaxf(m, ck_norm_row<LN, NV, Y, X, W, B>(a, r));
    ck_amax_out<Y>(a, m);
}

/* A layernorm or RMSNorm writing its FP8 copy in both layouts (spec_fuse.c,
 * fuse_cast_transposes): a block of eight warps takes a band of BAND rows (32, or 16 for rows
 * longer than 1280), BAND / 8 a warp, and stores their codes (ck_norm_row through CkTileSt:
 * the value rounded to Y, then quantized into Q, CkThrough's bits) in shared memory; then it
 * writes the band's rows of the copy 16 bytes a thread, and the band's BAND bytes of each
 * column into the transposed copy (C, R) at t[i[2]]: a whole sector each at 32, half of one at
 * 16 (the next band's block writes the other half). Rows of the tile are PITCH bytes apart (16
 * more than a row: reading a column, the 32 lanes' bytes fall in 8 banks, four lanes a word).
 * R a multiple of BAND, C of 16 and at most NV x 256 with NV <= 8 (at most 41 KB of shared
 * memory at 32 rows, NV <= 5, 33 KB at 16); with ST, each warp's rows are staged too
 * (ck_staged_rows, in the dynamic shared memory); i = {C, R, the transposed copy's tensor},
 * f = {eps}. */
template <class Y, class Q> struct CkTileSt {
    /* t.p: the tile, t.cols: C, t.ncg: the band's first row, t.group: PITCH */
    static __device__ __forceinline__ CkTensor at(const CkTensor &t, i64 i) {
        i64 r = i / t.cols;
        CkTensor u = t;
        u.p = (unsigned char *)t.p + (r - t.ncg) * t.group + (i - r * t.cols);
        return u;
    }
    static __device__ __forceinline__ bool vec_ok(const CkTensor &t) { return Y::vec_ok(t) && Q::vec_ok(t); }
    static __device__ __forceinline__ void st(const CkTensor &t, i64 i, float v) {
        Q::st(at(t, i), 0, Y::round(t, i, v));
    }
    static __device__ __forceinline__ void st_vec(const CkTensor &t, i64 i, const float *v) {
        float r[CK_VEC];
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) r[j] = Y::round(t, i + j, v[j]);
        Q::st_vec(at(t, i), 0, r);
    }
    static __device__ __forceinline__ float round(const CkTensor &t, i64 i, float v) {
        return Q::round(t, i, Y::round(t, i, v));
    }
    /* st_vec at row r, column c (i = r C + c), whose tile address needs no division */
    static __device__ __forceinline__ void st_row_vec(const CkTensor &t, i64 r, i64 c, const float *v) {
        float q[CK_VEC];
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) q[j] = Y::round(t, r * t.cols + c + j, v[j]);
        CkTensor u = t;
        u.p = (unsigned char *)t.p + (r - t.ncg) * t.group + c;
        Q::st_vec(u, 0, q);
    }
};
template <class Y, class Q> struct CkRowSt<CkTileSt<Y, Q>> {
    static __device__ __forceinline__ void st(const CkTensor &t, i64 r, i64, i64 c, const float *v) {
        CkTileSt<Y, Q>::st_row_vec(t, r, c, v);
    }
};

template <int LN, int NV, int BAND, int ST, class Y, class Q, class X, class W, class B>
__device__ void ck_norm_t(const CkArgs &a) {
    static_assert(BAND == 32 || BAND == 16, "a band is 32 or 16 rows");
    constexpr int PITCH = (NV > 0 ? NV : 1) * 32 * CK_VEC + 16;
    __shared__ __align__(16) unsigned char tile[BAND * PITCH];
    i64 C = a.i[0], R = a.i[1], r0 = (i64)blockIdx.x * BAND;
    CkArgs b = a;
    b.t[0].p = tile;
    b.t[0].cols = C;
    b.t[0].ncg = r0;
    b.t[0].group = PITCH;
    constexpr int PER_WARP = BAND / 8;
    i64 first = r0 + (threadIdx.x >> 5) * PER_WARP;
    bool staged = false;
    if constexpr (ST > 0)
        if ((staged = ck_norm_vec_ok<NV, CkTileSt<Y, Q>, X, W, B, LN>(b)))
            ck_staged_norm_rows<LN, NV, ST, CkTileSt<Y, Q>, X, W, B>(b, first, 1, first + PER_WARP);
    if (!staged)
        for (i64 r = first; r < first + PER_WARP && r < R; r++) ck_norm_row<LN, NV, CkTileSt<Y, Q>, X, W, B>(b, r);
    __syncthreads();
    unsigned char *y = (unsigned char *)a.t[0].p, *yt = (unsigned char *)a.t[a.i[2]].p;
    i64 vr = C / 16;
    for (i64 k = threadIdx.x; k < BAND * vr; k += blockDim.x) {
        i64 row = k / vr, c = (k - row * vr) * 16;
        if (r0 + row < R) *(uint4 *)(y + (r0 + row) * C + c) = *(const uint4 *)(tile + row * PITCH + c);
    }
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
        unsigned w[BAND / 4];
        #pragma unroll
        for (int j = 0; j < BAND / 4; j++) {
            w[j] = 0;
            #pragma unroll
            for (int b4 = 0; b4 < 4; b4++) w[j] |= (unsigned)tile[(4 * j + b4) * PITCH + c] << (8 * b4);
        }
        uint4 *o = (uint4 *)(yt + c * R + r0);
        #pragma unroll
        for (int j = 0; j < BAND / 16; j++) o[j] = make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]);
    }
}

/* *_BWD_X (dy, x, w): dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w (LN; RMS without
 * the first mean); i = {C, R}, f = {eps} */
template <int LN, int NV, class Y, class DY, class X, class W>
__device__ __forceinline__ float ck_norm_bwd_x_row(const CkArgs &a, i64 r) {
    i64 C = a.i[0];
    float m = 0.0f;
    int lane = threadIdx.x & 31;
    const CkTensor &dy = a.t[1], &x = a.t[2], &w = a.t[3];
    if (ck_row_in_registers<NV>(C) && DY::vec_ok(dy) && X::vec_ok(x) && W::vec_ok(w) && Y::vec_ok(a.t[0])) {
        float v[NV > 0 ? NV : 1][CK_VEC], mean, rstd, sgf = 0, sgxf = 0;
        ck_row_load_stats<LN, (NV > 0 ? NV : 1), X>(x, r, C, a.f[0], v, &mean, &rstd);
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float d[CK_VEC], wv[CK_VEC];
            DY::ld_vec(dy, r * C + c, d);
            W::ld_vec(w, c, wv);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = d[j] * wv[j];
                sgf += g;
                sgxf = fmaf(g, (v[k][j] - mean) * rstd, sgxf);
            }
        }
        float mg = LN ? ck_row_mean(sgf, C) : 0.0f, mgx = ck_row_mean(sgxf, C);
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float d[CK_VEC], wv[CK_VEC], out[CK_VEC];
            DY::ld_vec(dy, r * C + c, d);   /* again: the row was just read, it is in cache */
            W::ld_vec(w, c, wv);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = d[j] * wv[j], xh = (v[k][j] - mean) * rstd;
                out[j] = rstd * (g - mg - xh * mgx);
                m = fmaxf(m, fabsf(out[j]));
            }
            Y::st_vec(a.t[0], r * C + c, out);
        }
        return m;
    }
    double mean, rstd, sg = 0, sgx = 0;
    ck_row_stats<LN, X>(x, r, C, a.f[0], &mean, &rstd);
    for (i64 c = lane; c < C; c += 32) {
        double g = (double)DY::ld(dy, r * C + c) * W::ld(w, c);
        double xh = (X::ld(x, r * C + c) - mean) * rstd;
        sg += g;
        sgx += g * xh;
    }
    double mg = LN ? ck_warp_sum(sg) / (double)C : 0.0, mgx = ck_warp_sum(sgx) / (double)C;
    for (i64 c = lane; c < C; c += 32) {
        double g = (double)DY::ld(dy, r * C + c) * W::ld(w, c);
        double xh = (X::ld(x, r * C + c) - mean) * rstd;
        float v = (float)(rstd * (g - mg - xh * mgx));
        m = fmaxf(m, fabsf(v));
        Y::st(a.t[0], r * C + c, v);
    }
    return m;
}

template <int LN, int NV, class Y, class DY, class X, class W> __device__ void ck_norm_bwd_x(const CkArgs &a) {
    float m = 0.0f;
    CK_ROWS_OF_WARP(r, a.i[1]) m = fmaxf(m, ck_norm_bwd_x_row<LN, NV, Y, DY, X, W>(a, r));
    ck_amax_out<Y>(a, m);
}

/* CK_VEC elements of t from element i: one wide load, or one at a time where t's pointer or
 * length does not allow it (the same values either way) */
template <class T> static __device__ __forceinline__ void ck_ld8(const CkTensor &t, i64 i, float *v, bool vec) {
    if (vec) {
        T::ld_vec(t, i, v);
        return;
    }
    #pragma unroll
    for (int j = 0; j < CK_VEC; j++) v[j] = T::ld(t, i + j);
}

/* A norm's whole backward in one pass over its rows (spec_fuse.c, fuse_norm_grads). Per row, as
 * ck_norm_bwd_x: dx, rounded to its own format BX; where the graph adds dx to another gradient
 * (the residual stream's ADD_N), that sum as ck_add_n makes it, in the ADD_N's order. Per
 * column, the weight's gradient sum(dy xhat) and, for LayerNorm's bias, sum(dy): each lane
 * adds its columns of each of its warp's rows into the warp's own row of sums in shared memory
 * (held in registers with the row, they took 128 a thread, two blocks an SM, and the pass ran
 * at a third of the memory's speed), the block then adds its warps' sums in order, and block b
 * leaves row b of the partials in scratch for ck_norm_grads_final (HB: there is a bias).
 * Shared memory: warps x (1 + HB) x NV x 32 x CK_VEC floats, dynamic. Fixed order throughout: the same bits every
 * run. The spec fuses only rows that fit the lanes' registers (C a multiple of CK_VEC, at most
 * NV * 32 * CK_VEC).
 * With ST (spec_ops.c), the rows of x and dy, and of the other term where i[3] is 3, are
 * staged through slots of ST bytes after the sums (CkStage), the next row in flight.
 * t = {Y (the sum, or dx), dy, x, w, the other term (RES > 0), dx's tensor (its format)};
 * i = {C, R, RES: 0 none, 1 the other term is the ADD_N's first input, 2 its second, the
 * tensors staged};
 * f = {eps}; scratch: f32 partials [gridDim.x][C] of the weight, then of the bias. */
template <int LN, int HB, int NV, int ST, class Y, class DY, class X, class W, class RS, class BX>
__device__ void ck_norm_bwd_fused(const CkArgs &a) {
    extern __shared__ float ck_norm_sums[];
    i64 C = a.i[0], R = a.i[1];
    int res = (int)a.i[2];
    enum { HOLD = NV <= 4 || X::scaling != SCALE_NONE };
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const CkTensor &dy = a.t[1], &x = a.t[2], &w = a.t[3];
    bool vec = DY::vec_ok(dy) && X::vec_ok(x) && W::vec_ok(w) && Y::vec_ok(a.t[0]) && (!res || RS::vec_ok(a.t[4]));
    /* a warp's sums, element j of its vector k of lane l at (k CK_VEC + j) 32 + l: the lanes of
     * one update hit 32 banks (by column, eight lanes would share one) */
    const int S = NV * CK_VEC * 32;
    float *gw = ck_norm_sums + (i64)warp * (1 + HB) * S, *gb = gw + S, m = 0.0f;
    for (int i = lane; i < S; i += 32) {
        gw[i] = 0.0f;
        if (HB) gb[i] = 0.0f;
    }
    __syncwarp();
    /* with ST, x, dy and the other term staged (rings after the sums, tensors 0, 1, 2) */
    const int sums = warps * (1 + HB) * S * 4;
    const CkStage<NV, X, ST> sx{ck_stage_ring<ST>(sums, 0)};
    const CkStage<NV, DY, ST> sdy{ck_stage_ring<ST>(sums, 1)};
    const CkStage<NV, RS, ST> sres{ck_stage_ring<ST>(sums, 2)};
    bool stage_res = res && a.i[3] == 3;
    /* row r, its vectors from slot `slot` of the rings, or from memory (slot < 0) */
    auto row = [&](i64 r, int slot) {
        auto ldx = [&](int k, i64 c, float *v) {
            if (slot >= 0) sx.read(x, r * C + c, slot, k, v);
            else ck_ld8<X>(x, r * C + c, v, vec);
        };
        auto lddy = [&](int k, i64 c, float *v) {
            if (slot >= 0) sdy.read(dy, r * C + c, slot, k, v);
            else ck_ld8<DY>(dy, r * C + c, v, vec);
        };
        /* x held in registers where its row is short or decoding it costs (a scaled FP8 copy);
         * otherwise read again in each pass (its row is in cache, or staged): registers for
         * more warps */
        float xr[HOLD ? NV : 1][CK_VEC], s = 0.0f, sgf = 0.0f, sgxf = 0.0f;
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float v[CK_VEC];
            ldx(k, c, v);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                s += v[j];
                if (HOLD) xr[HOLD ? k : 0][j] = v[j];
            }
        }
        /* mean and rstd as ck_row_load_stats finds them */
        float mean = LN ? ck_row_mean(s, C) : 0.0f, q = 0.0f;
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float v[CK_VEC];
            if (HOLD) {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) v[j] = xr[HOLD ? k : 0][j];
            } else {
                ldx(k, c, v);
            }
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float d = v[j] - mean;
                q = fmaf(d, d, q);
            }
        }
        float rstd = ck_row_rstd(q, C, a.f[0]);
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float d[CK_VEC], wv[CK_VEC], v[CK_VEC];
            lddy(k, c, d);
            ck_ld8<W>(w, c, wv, vec);
            if (HOLD) {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) v[j] = xr[HOLD ? k : 0][j];
            } else {
                ldx(k, c, v);
            }
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = d[j] * wv[j], xh = (v[j] - mean) * rstd;
                sgf += g;
                sgxf = fmaf(g, xh, sgxf);
                gw[(k * CK_VEC + j) * 32 + lane] += d[j] * xh;
                if (HB) gb[(k * CK_VEC + j) * 32 + lane] += d[j];
            }
        }
        float mg = LN ? ck_row_mean(sgf, C) : 0.0f, mgx = ck_row_mean(sgxf, C);
        #pragma unroll
        for (int k = 0; k < NV; k++) {
            i64 c = ((i64)k * 32 + lane) * CK_VEC;
            if (c >= C) continue;
            float d[CK_VEC], wv[CK_VEC], o[CK_VEC], out[CK_VEC], v[CK_VEC];
            lddy(k, c, d);
            ck_ld8<W>(w, c, wv, vec);
            if (HOLD) {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) v[j] = xr[HOLD ? k : 0][j];
            } else {
                ldx(k, c, v);
            }
            if (res) {
                if (slot >= 0 && stage_res) sres.read(a.t[4], r * C + c, slot, k, o);
                else ck_ld8<RS>(a.t[4], r * C + c, o, vec);
            }
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = d[j] * wv[j], xh = (v[j] - mean) * rstd;
                out[j] = rstd * (g - mg - xh * mgx);
                if (res) {
                    double dx = BX::round(a.t[5], r * C + c + j, out[j]);
                    out[j] = (float)(res == 1 ? (double)o[j] + dx : dx + (double)o[j]);
                }
                m = fmaxf(m, fabsf(out[j]));
            }
            if (vec) {
                Y::st_vec(a.t[0], r * C + c, out);
            } else {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) Y::st(a.t[0], r * C + c + j, out[j]);
            }
        }
    };
    static_assert(ST == 0 || (ck_stage_fits<NV, X, ST>() && ck_stage_fits<NV, DY, ST>()), "slots of whole rows");
    /* the other term's rows fit the slots too where they are staged (spec_ops.c sizes them so) */
    if (ST > 0 && vec && a.i[3] >= 2 && (!stage_res || NV * 32 * RS::vbytes <= ST)) {
        auto fetch = [&](i64 r, int slot) {
            sx.fetch(x, r, R, C, slot);
            sdy.fetch(dy, r, R, C, slot);
            if (stage_res) sres.fetch(a.t[4], r, R, C, slot);
            ck_stage_commit();
        };
        int slot = 0;
        fetch(CK_ROW_OF_WARP, 0);
        CK_ROWS_OF_WARP(r, R) {
            fetch(r + CK_ROW_STRIDE, slot ^ 1);
            ck_stage_wait_prev();
            row(r, slot);
            slot ^= 1;
        }
    } else {
        CK_ROWS_OF_WARP(r, R) row(r, -1);
    }
    __syncthreads();
    float *out_w = (float *)a.scratch + (i64)blockIdx.x * C, *out_b = (float *)a.scratch + ((i64)gridDim.x + blockIdx.x) * C;
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
        float sw = 0.0f, sb = 0.0f;
        int at = (int)((c / (32 * CK_VEC) * CK_VEC + c % CK_VEC) * 32 + c / CK_VEC % 32);
        for (int v = 0; v < warps; v++) {
            sw += ck_norm_sums[v * (1 + HB) * S + at];
            if (HB) sb += ck_norm_sums[v * (1 + HB) * S + S + at];
        }
        out_w[c] = sw;
        if (HB) out_b[c] = sb;
    }
    ck_amax_out<Y>(a, m);
}

/* A norm's whole backward for long rows, a block a row (spec_ops.c, plan_norm_grads; the
 * choice norm.bwd_block). ck_norm_bwd_fused gives a row to a warp, so each lane holds NV
 * vectors of the weight's column sums: for rows of 2048 (Llama 1.1B) they lived in shared
 * memory, read and written once per element, with three warps an SM's worth of rows in
 * flight, and the pass moved about 1.0 TB/s. Here the block's threads share a row, thread t
 * taking vectors t, t + blockDim.x, .. (VPT of them), so that its columns are the same in every
 * row and their sums stay in registers: VPT x CK_VEC floats (twice with a bias). A row's three
 * sums (LayerNorm: the mean, then the squared deviations, then sum(g) and sum(g xhat); RMSNorm
 * the last two) are block sums: each warp's shuffle sum, then every thread adds the warps'
 * in order (the same bits every run). The next row's x and dy are loaded while this one is
 * worked on, as stored. Block b leaves row b of the partials in scratch for ck_norm_grads_final, as
 * ck_norm_bwd_fused does, and the other arguments are its own:
 * t = {Y (the sum, or dx), dy, x, w, the other term (RES > 0), dx's tensor (its format)};
 * i = {C, R, RES: 0 none, 1 the other term is the ADD_N's first input, 2 its second};
 * f = {eps}; scratch: f32 partials [gridDim.x][C] of the weight, then of the bias. */
template <int LN, int HB, int VPT, class Y, class DY, class X, class W, class RS, class BX>
__device__ void ck_norm_bwd_block(const CkArgs &a) {
    __shared__ float2 sums[3][32];
    i64 C = a.i[0], R = a.i[1];
    int res = (int)a.i[2];
    const CkTensor &dy = a.t[1], &x = a.t[2], &w = a.t[3];
    bool vec = DY::vec_ok(dy) && X::vec_ok(x) && W::vec_ok(w) && Y::vec_ok(a.t[0]) && (!res || RS::vec_ok(a.t[4]));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    /* the block's sum of (v.x, and with both v.y), every thread getting it; sum k of a row
     * uses its own slots, so a slot is written again only after every thread read it */
    auto block_sum = [&](int k, float2 v, bool both) {
        v.x = ck_warp_sum(v.x);
        if (both) v.y = ck_warp_sum(v.y);
        if (lane == 0) sums[k][warp] = v;
        __syncthreads();
        float2 s = make_float2(0.0f, 0.0f);
        for (int i = 0; i < warps; i++) {
            s.x += sums[k][i].x;
            if (both) s.y += sums[k][i].y;
        }
        return s;
    };
    auto column = [&](int k) { return ((i64)k * blockDim.x + threadIdx.x) * CK_VEC; };
    float gw[VPT][CK_VEC], gb[HB ? VPT : 1][CK_VEC], xv[VPT][CK_VEC], dv[VPT][CK_VEC], m = 0.0f;
    #pragma unroll
    for (int k = 0; k < VPT; k++)
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            gw[k][j] = 0.0f;
            if (HB) gb[HB ? k : 0][j] = 0.0f;
        }
    /* the next row's x and dy as stored (a bf16 vector is four registers, eight decoded),
     * fetched where vectors may be read whole; decoded into xv and dv when its turn comes */
    typename X::Raw xn[VPT];
    typename DY::Raw dn[VPT];
    auto fetch = [&](i64 r) {
        #pragma unroll
        for (int k = 0; k < VPT; k++) {
            i64 c = column(k);
            if (vec && r < R && c < C) {
                ck_raw_vec<X>(x.p, ck_vec_index(r * C + c), xn[k]);
                ck_raw_vec<DY>(dy.p, ck_vec_index(r * C + c), dn[k]);
            }
        }
    };
    fetch(blockIdx.x);
    for (i64 r = blockIdx.x; r < R; r += gridDim.x) {
        #pragma unroll
        for (int k = 0; k < VPT; k++) {
            i64 c = column(k);
            if (c >= C) continue;
            if (vec) {
                X::decode_vec(x, r * C + c, xn[k], xv[k]);
                DY::decode_vec(dy, r * C + c, dn[k], dv[k]);
            } else {
                ck_ld8<X>(x, r * C + c, xv[k], false);
                ck_ld8<DY>(dy, r * C + c, dv[k], false);
            }
        }
        fetch(r + gridDim.x);
        /* mean and rstd, two passes over the row held in registers as ck_row_load_stats */
        float s = 0.0f, q = 0.0f, mean = 0.0f;
        if (LN) {
            #pragma unroll
            for (int k = 0; k < VPT; k++)
                if (column(k) < C)
                    #pragma unroll
                    for (int j = 0; j < CK_VEC; j++) s += xv[k][j];
            mean = block_sum(0, make_float2(s, 0.0f), false).x / (float)C;
        }
        #pragma unroll
        for (int k = 0; k < VPT; k++)
            if (column(k) < C)
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) {
                    float d = xv[k][j] - mean;
                    q = fmaf(d, d, q);
                }
        float rstd = 1.0f / sqrtf(block_sum(1, make_float2(q, 0.0f), false).x / (float)C + (float)a.f[0]);
        /* sum(g) and sum(g xhat) of the row, g = dy w; the columns' sums of dy xhat and dy */
        float sgf = 0.0f, sgxf = 0.0f;
        #pragma unroll
        for (int k = 0; k < VPT; k++) {
            i64 c = column(k);
            if (c >= C) continue;
            float wv[CK_VEC];
            ck_ld8<W>(w, c, wv, vec);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = dv[k][j] * wv[j], xh = (xv[k][j] - mean) * rstd;
                sgf += g;
                sgxf = fmaf(g, xh, sgxf);
                gw[k][j] += dv[k][j] * xh;
                if (HB) gb[HB ? k : 0][j] += dv[k][j];
            }
        }
        float2 t = block_sum(2, make_float2(sgf, sgxf), true);
        float mg = LN ? t.x / (float)C : 0.0f, mgx = t.y / (float)C;
        #pragma unroll
        for (int k = 0; k < VPT; k++) {
            i64 c = column(k);
            if (c >= C) continue;
            float wv[CK_VEC], o[CK_VEC], out[CK_VEC];
            ck_ld8<W>(w, c, wv, vec);
            if (res) ck_ld8<RS>(a.t[4], r * C + c, o, vec);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                float g = dv[k][j] * wv[j], xh = (xv[k][j] - mean) * rstd;
                out[j] = rstd * (g - mg - xh * mgx);
                if (res) {
                    double dx = BX::round(a.t[5], r * C + c + j, out[j]);
                    out[j] = (float)(res == 1 ? (double)o[j] + dx : dx + (double)o[j]);
                }
                m = fmaxf(m, fabsf(out[j]));
            }
            if (vec) {
                Y::st_vec(a.t[0], r * C + c, out);
            } else {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) Y::st(a.t[0], r * C + c + j, out[j]);
            }
        }
    }
    float *out_w = (float *)a.scratch + (i64)blockIdx.x * C, *out_b = (float *)a.scratch + ((i64)gridDim.x + blockIdx.x) * C;
    #pragma unroll
    for (int k = 0; k < VPT; k++) {
        i64 c = column(k);
        if (c >= C) continue;
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) {
            out_w[c + j] = gw[k][j];
            if (HB) out_b[c + j] = gb[HB ? k : 0][j];
        }
    }
    ck_amax_out<Y>(a, m);
}

/* The second launch of a fused norm backward: column c of the weight's (blockIdx.y 0: t[0],
 * t[1]) or the bias's (1: t[2], t[3]) gradient, the P blocks' partials added in order (32 lanes
 * a column, each over every 32nd block, then the lanes in order, in f64). ACC 0 stores it into
 * the gradient t[0] / t[2]; ACC 1 adds it, rounded as the gradient's own format S stores it
 * (t[1] / t[3]), into the accumulator t[0] / t[2] as ck_accumulate adds. i = {C, P}; 1024
 * threads as 32 columns x 32 lanes. */
template <int ACC0, class A0, class S0, int ACC1, class A1, class S1>
__device__ void ck_norm_grads_final(const CkArgs &a) {
    __shared__ double acc[32][33];
    i64 C = a.i[0], P = a.i[1];
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    i64 c = (i64)blockIdx.x * 32 + tx;
    const float *part = (const float *)a.scratch + (blockIdx.y ? P * C : 0);
    double s = 0;
    if (c < C)
        for (i64 p = ty; p < P; p += 32) s += part[p * C + c];
    acc[ty][tx] = s;
    __syncthreads();
    if (ty != 0 || c >= C) return;
    for (int l = 1; l < 32; l++) s += acc[l][tx];
    if (blockIdx.y == 0) {
        if (ACC0) A0::st(a.t[0], c, A0::ld(a.t[0], c) + S0::round(a.t[1], c, (float)s));
        else A0::st(a.t[0], c, (float)s);
    } else {
        if (ACC1) A1::st(a.t[2], c, A1::ld(a.t[2], c) + S1::round(a.t[3], c, (float)s));
        else A1::st(a.t[2], c, (float)s);
    }
}

/* the statistics the weight gradient needs, into scratch: mean[R], rstd[R] (f64);
 * inputs as *_BWD_W (dy, x); i = {C, R}, f = {eps} */
template <int LN, int NV, class X> __device__ void ck_norm_stats(const CkArgs &a) {
    i64 C = a.i[0], R = a.i[1], r = CK_ROW_OF_WARP;
    if (r >= R) return;
    double mean, rstd;
    if (ck_row_in_registers<NV>(C) && X::vec_ok(a.t[2])) {
        float v[NV > 0 ? NV : 1][CK_VEC], m, rs;
        ck_row_load_stats<LN, (NV > 0 ? NV : 1), X>(a.t[2], r, C, a.f[0], v, &m, &rs);
        mean = m, rstd = rs;
    } else {
        ck_row_stats<LN, X>(a.t[2], r, C, a.f[0], &mean, &rstd);
    }
    if ((threadIdx.x & 31) == 0) {
        ((double *)a.scratch)[r] = mean;
        ((double *)a.scratch)[R + r] = rstd;
    }
}

/* Column sums, first launch: grid (ceil(C/256), P), 256 threads as 32 column lanes x 8 row
 * lanes. A block takes 256 columns: where the tensors allow wide loads a column lane holds
 * CK_VEC consecutive columns (one load per row), else columns tx, tx + 32, ... Partition p of P
 * takes rows [p R / P, (p+1) R / P). MODE 0: sum_rows(x = t[1]); MODE 1: the norm weight
 * gradient, dy (t[1]) * xhat of x (t[2]) with the statistics at the start of scratch. Partials
 * go to scratch after the statistics: part[p][c] (f64), each the sum of its rows in order of
 * row lane, then over the 8 lanes in order. i = {C, R, P} */
template <int MODE, class X, class X2> __device__ void ck_colsum_partial(const CkArgs &a) {
    __shared__ double acc[8][8 * 32 + 1];
    i64 C = a.i[0], R = a.i[1], P = a.i[2], p = blockIdx.y;
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    i64 base = (i64)blockIdx.x * 256;
    i64 r0 = p * R / P, r1 = (p + 1) * R / P;
    const double *stats = (const double *)a.scratch;
    float s[CK_VEC];   /* a thread's rows (R / P / 8 of them) in f32; the rest in f64 */
    #pragma unroll
    for (int j = 0; j < CK_VEC; j++) s[j] = 0;
    bool vec = C % CK_VEC == 0 && X::vec_ok(a.t[1]) && (MODE == 0 || X2::vec_ok(a.t[2]));
    if (vec) {
        i64 c = base + tx * CK_VEC;
        if (c < C)
            for (i64 r = r0 + ty; r < r1; r += 8) {
                float v[CK_VEC], x[CK_VEC];
                X::ld_vec(a.t[1], r * C + c, v);
                if (MODE == 1) X2::ld_vec(a.t[2], r * C + c, x);
                float mean = MODE == 1 ? (float)stats[r] : 0.0f, rstd = MODE == 1 ? (float)stats[R + r] : 0.0f;
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) s[j] += MODE == 0 ? v[j] : v[j] * ((x[j] - mean) * rstd);
            }
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) acc[ty][tx * CK_VEC + j] = s[j];
    } else {
        for (i64 r = r0 + ty; r < r1; r += 8)
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                i64 c = base + tx + 32 * j;
                if (c >= C) break;
                if (MODE == 0) s[j] += X::ld(a.t[1], r * C + c);
                else s[j] += X::ld(a.t[1], r * C + c) * (float)((X2::ld(a.t[2], r * C + c) - stats[r]) * stats[R + r]);
            }
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) acc[ty][tx + 32 * j] = s[j];
    }
    __syncthreads();
    double *part = (double *)a.scratch + (MODE == 1 ? 2 * R : 0);
    for (int k = threadIdx.x; k < 256; k += blockDim.x) {
        if (base + k >= C) continue;
        double t = acc[0][k];
        for (int l = 1; l < 8; l++) t += acc[l][k];
        part[p * C + base + k] = t;
    }
}

/* second launch: grid ceil(C/32), 256 threads as 32 columns x 8 lanes; lane l adds the
 * partials p = l, l + 8, .. in order, then the 8 lanes are added in order.
 * y[c] = sum over p of part[p][c]; i = {C, R, P} */
template <int MODE> static __device__ bool ck_colsum_total(const CkArgs &a, i64 *col, double *total) {
    __shared__ double acc[8][33];
    i64 C = a.i[0], R = a.i[1], P = a.i[2];
    const double *part = (const double *)a.scratch + (MODE == 1 ? 2 * R : 0);
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    i64 c = (i64)blockIdx.x * 32 + tx;
    double s = 0;
    if (c < C)
        for (i64 p = ty; p < P; p += 8) s += part[p * C + c];
    acc[ty][tx] = s;
    __syncthreads();
    if (ty != 0 || c >= C) return false;
    for (int l = 1; l < 8; l++) s += acc[l][tx];
    *col = c, *total = s;
    return true;
}
template <int MODE, class Y> __device__ void ck_colsum_final(const CkArgs &a) {
    i64 c;
    double s;
    if (ck_colsum_total<MODE>(a, &c, &s)) Y::st(a.t[0], c, (float)s);
}

/* The sum of a bias gradient, rounded as its own format S stores it (t[1]), added into its
 * accumulator (t[0], format A) as ck_accumulate adds: the sum and its accumulation in the
 * launch after a quantize that summed the tiles (spec.c, fuse_bias_grads). i = {C, R, P} */
template <class A, class S> __device__ void ck_colsum_final_acc(const CkArgs &a) {
    i64 c;
    double s;
    if (ck_colsum_total<0>(a, &c, &s)) A::st(a.t[0], c, A::ld(a.t[0], c) + S::round(a.t[1], c, (float)s));
}

/* SOFTMAX (x) / SOFTMAX_BWD (dy, y): one block per row; i = {C} */
template <int BWD, class Y, class X0, class X1> __device__ void ck_softmax(const CkArgs &a) {
    i64 C = a.i[0], r = blockIdx.x;
    if (BWD) {
        double s = 0;
        for (i64 c = threadIdx.x; c < C; c += blockDim.x)
            s += (double)X0::ld(a.t[1], r * C + c) * X1::ld(a.t[2], r * C + c);
        s = ck_block_sum(s);
        for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
            float p = X1::ld(a.t[2], r * C + c);
            Y::st(a.t[0], r * C + c, (float)(p * (X0::ld(a.t[1], r * C + c) - s)));
        }
        return;
    }
    float m = -CK_INF;
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) m = fmaxf(m, X0::ld(a.t[1], r * C + c));
    m = ck_block_max(m);
    double s = 0;
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) s += exp((double)X0::ld(a.t[1], r * C + c) - m);
    s = ck_block_sum(s);
    for (i64 c = threadIdx.x; c < C; c += blockDim.x)
        Y::st(a.t[0], r * C + c, (float)(exp((double)X0::ld(a.t[1], r * C + c) - m) / s));
}

/* ---------------------------------------------------------------- whole-tensor reductions */

/* first launch of SQNORM, AMAX_RECORD and per-tensor QUANT_SCALE: block b of the grid
 * writes its partial (sum of squares, f64; or amax, f32, NaN ignored as fmaxf does) to
 * scratch[b]; x is t[X_AT] */
template <int SQ> static __device__ __forceinline__ void ck_fold(double &s, float &m, float v) {
    if (SQ) s += (double)v * v;
    else m = fmaxf(m, fabsf(v));
}
/* this thread's share of a grid-wide fold of x */
template <int SQ, class X> static __device__ __forceinline__ void ck_fold_tensor(const CkArgs &a, const CkTensor &x,
                                                                                double &s, float &m) {
    if (X::vec_ok(x)) {
        #pragma unroll 4
        CK_GRID_STRIDE(c, x.n / CK_VEC) {
            float v[CK_VEC];
            X::ld_vec(x, c * CK_VEC, v);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) ck_fold<SQ>(s, m, v[j]);
        }
    } else {
        CK_GRID_STRIDE(i, x.n) ck_fold<SQ>(s, m, X::ld(x, i));
    }
}
template <int SQ, int X_AT, class X> __device__ void ck_reduce_partial(const CkArgs &a) {
    double s = 0;
    float m = 0.0f;
    ck_fold_tensor<SQ, X>(a, a.t[X_AT], s, m);
    if (SQ) {
        s = ck_block_sum(s);
        if (threadIdx.x == 0) ((double *)a.scratch)[CK_BLOCK] = s;
    } else {
        m = ck_block_max(m);
        if (threadIdx.x == 0) ((float *)a.scratch)[CK_BLOCK] = m;
    }
}

/* first launch of SQNORM: the sum of squares of each chunk of i[0] (IR_SQNORM_CHUNK)
 * consecutive elements of x = t[1], in f64, to scratch[chunk]; a warp a chunk, the grid's warps
 * taking chunks in turn. The additions within a chunk follow its elements' places in it: lane
 * l adds the vectors l, l + 32, .. of CK_VEC elements in order (a square of a bf16 or f32 value
 * is exact in f64, so a contracted multiply-add rounds as the addition alone), then the warp's
 * fixed tree. Whether the vectors are loaded whole or element by element, and where the
 * tensor starts, changes no bit: a chunk's sum depends on its elements only, so a shard of the
 * tensor that starts on a chunk boundary (--shard-states, exec_shard.c) writes the whole
 * tensor's sums of its chunks. */
template <class X> __device__ void ck_sqnorm_chunks(const CkArgs &a) {
    const CkTensor &x = a.t[1];
    const i64 chunk = a.i[0], chunks = (x.n + chunk - 1) / chunk;
    const int lane = threadIdx.x & 31;
    const i64 warps = CK_BLOCKS * (blockDim.x >> 5);   /* this launch's (or batch item's) blocks */
    const bool vec = X::vec_ok(x);
    for (i64 c = CK_BLOCK * (blockDim.x >> 5) + (threadIdx.x >> 5); c < chunks; c += warps) {
        const i64 lo = c * chunk, hi = lo + chunk < x.n ? lo + chunk : x.n;
        double s = 0;
        #pragma unroll 4   /* loads in flight; the additions keep their order */
        for (i64 i = lo + (i64)lane * CK_VEC; i < hi; i += 32 * CK_VEC) {
            float v[CK_VEC];
            if (vec && i + CK_VEC <= hi) {
                X::ld_vec(x, i, v);
            } else {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) v[j] = i + j < hi ? X::ld(x, i + j) : 0.0f;
            }
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) s += (double)v[j] * v[j];
        }
        s = ck_warp_sum(s);
        if (lane == 0) ((double *)a.scratch)[c] = s;
    }
}

/* one block over the partials (read past L1: other blocks of the same launch may have
 * written them); i = {n_partials, ..} */
static __device__ double ck_partials_sum(const CkArgs &a) {
    double s = 0;
    for (i64 k = threadIdx.x; k < a.i[0]; k += blockDim.x) s += __ldcg((const double *)a.scratch + k);
    return ck_block_sum(s);
}
static __device__ float ck_partials_max(const float *parts, i64 n) {
    float m = 0.0f;
    for (i64 k = threadIdx.x; k < n; k += blockDim.x) m = fmaxf(m, __ldcg(parts + k));
    return ck_block_max(m);
}
static __device__ float ck_partials_max(const CkArgs &a) { return ck_partials_max((const float *)a.scratch, a.i[0]); }

/* Whether this block is the last of the launch to finish, after the partial result it wrote
 * (thread 0) is visible to all: blocks take tickets from a.ticket, and the last one sets it
 * back to zero for the next launch. */
static __device__ bool ck_last_block(const CkArgs &a) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(a.ticket, 1u) == gridDim.x - 1;
        if (last) atomicExch(a.ticket, 0u);
    }
    __syncthreads();
    return last;
}

/* SQNORM's last launch: the chunks' sums of ck_sqnorm_chunks added in a fixed order (each
 * thread its chunks in order, then the block's tree), i = {chunks} */
template <class Y> __device__ void ck_sqnorm_final(const CkArgs &a) {
    double s = ck_partials_sum(a);
    if (threadIdx.x == 0) Y::st(a.t[0], 0, (float)s);
}

static __device__ __forceinline__ bool ck_amax_usable(double amax) { return amax > 0 && isfinite(amax); }

/* max(elem) / amax / 2^margin, computed in f64 and rounded once (ref_quant.c) */
static __device__ __forceinline__ float ck_scale_for(double fmax, double amax, i64 margin) {
    return (float)(fmax / amax * ldexp(1.0, -(int)margin));   /* x / 2^m, exactly: one division */
}

/* per-tensor QUANT_SCALE, final launch: i = {n_partials, margin}, f = {max of elem} */
template <class Y> static __device__ void ck_store_scale(const CkArgs &a, float amax) {
    if (threadIdx.x == 0) Y::st(a.t[0], 0, ck_amax_usable(amax) ? ck_scale_for(a.f[0], amax, a.i[1]) : 1.0f);
}
template <class Y> __device__ void ck_quant_scale_final(const CkArgs &a) { ck_store_scale<Y>(a, ck_partials_max(a)); }

/* the scale of ck_amax_out's launch, by its last block (see there) */
static __device__ void ck_amax_scale_out(const CkArgs &a, const float *parts) {
    if (!ck_last_block(a)) return;
    float amax = ck_partials_max(parts, CK_BLOCKS < CK_AMAX_PARTS ? CK_BLOCKS : CK_AMAX_PARTS);
    if (threadIdx.x == 0) *a.scale_to = ck_amax_usable(amax) ? ck_scale_for(a.scale_max, amax, a.scale_margin) : 1.0f;
}

/* per-tensor QUANT_SCALE of a value whose producer left its block maxima (amax=1): one block
 * over the CK_AMAX_PARTS slots at byte i[CK_AMAX_AT] of t[1]; i = {.., margin}, f = {max} */
template <class Y> __device__ void ck_quant_scale_parts(const CkArgs &a) {
    const float *parts = (const float *)((const char *)a.t[1].p + a.i[CK_AMAX_AT]);
    ck_store_scale<Y>(a, ck_partials_max(parts, CK_AMAX_PARTS));
}

/* the block maxima of t[0] (amax=1) where its producer does not write them (a GEMM epilogue,
 * an ADD_N of many inputs): a pass over the stored value */
template <class X> __device__ void ck_amax_parts(const CkArgs &a) {
    double s = 0;
    float m = 0.0f;
    ck_fold_tensor<0, X>(a, a.t[0], s, m);
    ck_amax_out<X>(a, m);
}

/* per-tensor QUANT_SCALE in one launch: the amax partials, then the last block's final;
 * i = {n_partials = the grid, margin}, f = {max of elem} */
template <class Y, class X> __device__ void ck_quant_scale_tensor(const CkArgs &a) {
    ck_reduce_partial<0, 1, X>(a);
    if (ck_last_block(a)) ck_quant_scale_final<Y>(a);
}

/* --shard-states=3 (cuda/exec_gather.c): a weight gathered in e4m3. Each rank finds its
 * shard's amax (t[1]: the shard, X; the block maxima in scratch, the last block's maximum at
 * t[0], one f32; i = {n_partials = the grid}), NCCL takes the ranks' maximum, which is the
 * whole tensor's, and the scale is stored from it as ck_quant_scale_tensor stores it (t[0]:
 * the scale, Y; t[1]: the amax, f32; i = {.., margin}, f = {max of elem}): every rank
 * derives the unsharded QUANT_SCALE's bits. The last-block ticket is the gather's own: these
 * run on NCCL's stream beside the step's kernels. */
template <class X> __device__ void ck_gather_amax(const CkArgs &a) {
    ck_reduce_partial<0, 1, X>(a);
    if (ck_last_block(a)) {
        float m = ck_partials_max(a);
        if (threadIdx.x == 0) ((float *)a.t[0].p)[0] = m;
    }
}
template <class Y> __device__ void ck_gather_scale(const CkArgs &a) { ck_store_scale<Y>(a, ((const float *)a.t[1].p)[0]); }

/* AMAX_RECORD (history (H), x), final launch: shift the history, record amax at 0 */
template <class H> __device__ void ck_amax_record_final(const CkArgs &a) {
    float m = ck_partials_max(a);
    if (threadIdx.x) return;
    i64 n = a.t[0].n;
    for (i64 k = n - 1; k > 0; k--) H::st(a.t[0], k, H::ld(a.t[0], k - 1));
    H::st(a.t[0], 0, m);
}

/* DELAYED_SCALE (scale state, history): i = {use_max, margin}, f = {max of elem} */
template <class S, class H> __device__ void ck_delayed_scale(const CkArgs &a) {
    if (blockIdx.x || threadIdx.x) return;
    double amax = H::ld(a.t[1], 0);
    if (a.i[0])
        for (i64 k = 1; k < a.t[1].n; k++) amax = fmax(amax, (double)H::ld(a.t[1], k));
    if (ck_amax_usable(amax)) S::st(a.t[0], 0, ck_scale_for(a.f[0], amax, a.i[1]));
}

/* QUANT_SCALE per row (one block per row), per group and 1x128 tiles (one thread per
 * group), per 128x128 block (one block per block); i = {n, margin, group}, f = {max} */
template <class Y, class X> __device__ void ck_quant_scale_row(const CkArgs &a) {
    const CkTensor &x = a.t[1];
    i64 r = blockIdx.x, C = x.cols;
    float m = 0.0f;
    for (i64 c = threadIdx.x; c < C; c += blockDim.x) m = fmaxf(m, fabsf(X::ld(x, r * C + c)));
    m = ck_block_max(m);
    if (threadIdx.x == 0) Y::st(a.t[0], r, ck_amax_usable(m) ? ck_scale_for(a.f[0], m, a.i[1]) : 1.0f);
}
/* How values are scaled into per-group (or 1x128 tile) scales: the largest value of the copy's
 * element type, the margin, the group; from f[F] and i[I], i[I + 1] of a launch's arguments
 * (QUANT_SCALE and QUANTIZE: f[0], i[1], i[2]) */
struct CkGroupQ {
    double fmax;
    i64 margin, G;
};
template <int F, int I> static __device__ __forceinline__ CkGroupQ ck_group_q(const CkArgs &a) {
    return CkGroupQ{a.f[F], a.i[I], a.i[I + 1]};
}
/* a group's scale from its largest |x|, m (1 for none usable) */
static __device__ __forceinline__ float ck_group_scale_of(const CkGroupQ &gq, float m) {
    return ck_amax_usable(m) ? ck_scale_for(gq.fmax, m, gq.margin) : 1.0f;
}

/* the scale of group k of x (G elements of a row, the last one of a row possibly shorter),
 * from its largest |x| */
template <class X> static __device__ __forceinline__ float ck_group_scale(const CkGroupQ &gq, const CkTensor &x, i64 k) {
    i64 G = gq.G, C = x.cols, ncg = (C + G - 1) / G;
    i64 r = k / ncg, c0 = (k - r * ncg) * G, c1 = c0 + G < C ? c0 + G : C;
    float m = 0.0f;
    for (i64 c = c0; c < c1; c++) m = fmaxf(m, fabsf(X::ld(x, r * C + c)));
    return ck_group_scale_of(gq, m);
}

/* Groups of whole vectors: G a multiple of CK_VEC, G / CK_VEC lanes a power of two within a
 * warp, rows of whole groups, x readable in vectors. A thread then takes one vector, and the
 * lanes of a group (adjacent in their warp) take its maximum by shuffles: one wide load per
 * thread instead of G narrow ones. The maximum is exact in any order, so the scale is the
 * scalar loop's bit for bit. */
template <class X> static __device__ __forceinline__ bool ck_group_vec_ok(const CkTensor &x, i64 G) {
    i64 L = G / CK_VEC;
    return G % CK_VEC == 0 && L <= 32 && (L & (L - 1)) == 0 && x.cols % G == 0 && X::vec_ok(x);
}

/* The vectors of x, a thread each, in a grid-stride loop that every lane of a warp runs the same
 * number of times (the shuffles need whole warps; a group is wholly in range or out of it):
 * f(vector index, its values, whether it is in range, its group's scale) */
template <class X, class Fn> static __device__ __forceinline__ void ck_group_vectors(const CkArgs &a, const CkGroupQ &gq,
                                                                                   const CkTensor &x, Fn f) {
    int L = (int)(gq.G / CK_VEC), lane = threadIdx.x & 31;
    i64 nv = x.n / CK_VEC;
    for (i64 c = CK_BLOCK * blockDim.x + threadIdx.x; c - lane < nv; c += CK_BLOCKS * blockDim.x) {
        bool live = c < nv;
        float v[CK_VEC], m = 0.0f;
        if (live) {
            X::ld_vec(x, c * CK_VEC, v);
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) m = fmaxf(m, fabsf(v[j]));
        }
        for (int o = L / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        f(c, v, live && (lane & (L - 1)) == 0, ck_group_scale_of(gq, m));
    }
}

template <class Y, class X> __device__ void ck_quant_scale_group(const CkArgs &a) {
    const CkTensor &x = a.t[1];
    const CkGroupQ gq = ck_group_q<0, 1>(a);
    if (ck_group_vec_ok<X>(x, gq.G)) {
        int shift = __ffs((int)(gq.G / CK_VEC)) - 1;
        ck_group_vectors<X>(a, gq, x, [&](i64 c, const float *, bool first, float sc) {
            if (first) Y::st(a.t[0], c >> shift, sc);
        });
        return;
    }
    CK_GRID_STRIDE(k, a.t[0].n) Y::st(a.t[0], k, ck_group_scale<X>(gq, x, k));
}

/* group k of x (G elements of a row, the last one of a row possibly shorter) into the copy q
 * through its scale, which goes to q's scale array: ck_quantize_group's scalar path */
template <class Q, class X> static __device__ __forceinline__ void ck_group_store(const CkGroupQ &gq, const CkTensor &x,
                                                                                 const CkTensor &q, i64 k) {
    i64 G = gq.G, C = x.cols, ncg = (C + G - 1) / G;
    float raw = ck_group_scale<X>(gq, x, k), sc = Q::scale_round(raw);
    Elem<Q::scale_elem>::st((void *)q.s, k, raw);
    i64 r = k / ncg, c0 = (k - r * ncg) * G, c1 = c0 + G < C ? c0 + G : C;
    for (i64 c = c0; c < c1; c++) Elem<Q::elem>::st(q.p, r * C + c, X::ld(x, r * C + c) * sc);
}

/* QUANTIZE into per-group (or 1x128 tile) scales together with the QUANT_SCALE that makes
 * them, at the quantize's place (spec.c: fuse_group_quantizes): the group's scale goes to the
 * result's scale array and its elements are stored through it, as read back. One pass over x
 * instead of two; the bits of the unfused pair. t[0] = the result (its scale array written
 * here), t[1] = x; i = {.., margin, group}, f = {max of elem} */
template <class Y, class X> __device__ void ck_quantize_group(const CkArgs &a) {
    const CkTensor &x = a.t[1], &y = a.t[0];
    const CkGroupQ gq = ck_group_q<0, 1>(a);
    void *sp = (void *)y.s;
    if (ck_group_vec_ok<X>(x, gq.G) && Y::vec_ok(y)) {
        int shift = __ffs((int)(gq.G / CK_VEC)) - 1;
        ck_group_vectors<X>(a, gq, x, [&](i64 c, const float *v, bool first, float sc) {
            if (first) Elem<Y::scale_elem>::st(sp, c >> shift, sc);
            if (c < x.n / CK_VEC) Y::st_vec_scaled(y, c * CK_VEC, v, Y::scale_round(sc));
        });
        return;
    }
    i64 ncg = (x.cols + gq.G - 1) / gq.G;
    CK_GRID_STRIDE(k, x.rows * ncg) ck_group_store<Y, X>(gq, x, y, k);
}
/* GELU or SILU (as ck_unary: t[0] = y, t[1] = x) that also writes x's copy into per-group
 * scales, t[3], with the scales (the fused pair of ck_quantize_group, moved here:
 * spec_fuse.c, fuse_input_group_copies): x is read once for both, where the quantize and the
 * activation each read it. i = {.., margin, group, .., amax at}, f = {max of the copy's elem}.
 * The copy's bytes are ck_quantize_group's, y's and its block maxima ck_unary's. */
template <int OP, class Y, class X, class Q> __device__ void ck_unary_group(const CkArgs &a) {
    const CkTensor &x = a.t[1], &q = a.t[3];
    const CkGroupQ gq = ck_group_q<0, 1>(a);
    void *sp = (void *)q.s;
    float m = 0.0f;
    if (ck_group_vec_ok<X>(x, gq.G) && Q::vec_ok(q) && Y::vec_ok(a.t[0])) {
        int shift = __ffs((int)(gq.G / CK_VEC)) - 1;
        i64 nv = x.n / CK_VEC;
        ck_group_vectors<X>(a, gq, x, [&](i64 c, const float *v, bool first, float sc) {
            if (first) Elem<Q::scale_elem>::st(sp, c >> shift, sc);
            if (c >= nv) return;
            Q::st_vec_scaled(q, c * CK_VEC, v, Q::scale_round(sc));
            float r[CK_VEC];
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) {
                r[j] = ck_unop<OP>(v[j], 0.0f);
                m = fmaxf(m, fabsf(r[j]));
            }
            Y::st_vec(a.t[0], c * CK_VEC, r);
        });
    } else {
        i64 ncg = (x.cols + gq.G - 1) / gq.G;
        CK_GRID_STRIDE(k, x.rows * ncg) ck_group_store<Q, X>(gq, x, q, k);
        CK_GRID_STRIDE(i, a.t[0].n) {
            float v = ck_unop<OP>(X::ld(x, i), 0.0f);
            m = fmaxf(m, fabsf(v));
            Y::st(a.t[0], i, v);
        }
    }
    ck_amax_out<Y>(a, m);
}

/* A norm's input row r into its copy Q (t[4]) in groups of G = i[3] with their scales
 * (margin i[2], f[1] the max of Q's elem): the bytes of ck_quantize_group. From the row's
 * vectors in registers (ck_norm_row's layout: lane l holds vectors l, l + 32, ..) where
 * ck_norm_group_vec_ok: the lanes of a group are adjacent and take its maximum by shuffles. */
template <int NV, class Q> __device__ __forceinline__ void ck_row_group_store(const CkArgs &a, i64 r, i64 C,
                                                                             const float (&v)[NV][CK_VEC]) {
    const CkTensor &q = a.t[4];
    i64 G = a.i[3];
    int lane = threadIdx.x & 31, L = (int)(G / CK_VEC);
    #pragma unroll
    for (int k = 0; k < NV; k++) {
        i64 c = ((i64)k * 32 + lane) * CK_VEC;
        bool live = c < C;
        float m = 0.0f;
        if (live)
            #pragma unroll
            for (int j = 0; j < CK_VEC; j++) m = fmaxf(m, fabsf(v[k][j]));
        for (int o = L / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float sc = ck_group_scale_of(ck_group_q<1, 2>(a), m);
        if (!live) continue;
        if ((lane & (L - 1)) == 0) Elem<Q::scale_elem>::st((void *)q.s, (r * C + c) / G, sc);
        Q::st_vec_scaled(q, r * C + c, v[k], Q::scale_round(sc));
    }
}
template <int NV, class X, class Q> __device__ __forceinline__ bool ck_norm_group_vec_ok(const CkArgs &a) {
    i64 G = a.i[3], L = G / CK_VEC;
    return G % CK_VEC == 0 && L <= 32 && (L & (L - 1)) == 0 && a.i[0] % G == 0 && Q::vec_ok(a.t[4]);
}

/* the same, an element at a time, a lane per group (any row and format); written out rather
 * than through ck_group_store, which took ck_norm_group from 64 registers to 96 (ptxas, sm_90a) */
template <class X, class Q> __device__ __forceinline__ void ck_row_group_copy(const CkArgs &a, i64 r, i64 C) {
    const CkTensor &x = a.t[1], &q = a.t[4];
    i64 G = a.i[3], ncg = (C + G - 1) / G;
    for (i64 g = threadIdx.x & 31; g < ncg; g += 32) {
        i64 c0 = g * G, c1 = c0 + G < C ? c0 + G : C;
        float m = 0.0f;
        for (i64 c = c0; c < c1; c++) m = fmaxf(m, fabsf(X::ld(x, r * C + c)));
        float raw = ck_group_scale_of(ck_group_q<1, 2>(a), m), sc = Q::scale_round(raw);
        Elem<Q::scale_elem>::st((void *)q.s, r * ncg + g, raw);
        for (i64 c = c0; c < c1; c++) Elem<Q::elem>::st(q.p, r * C + c, X::ld(x, r * C + c) * sc);
    }
}

/* LAYERNORM / RMSNORM (as ck_norm) that also writes its input's copy into per-group scales
 * (t[4]; spec_fuse.c, fuse_input_group_copies) from the row it holds: x is read once for
 * both. i = {C, R, margin, group, .., amax at}, f = {eps, max of Q's elem}. */
template <int LN, int NV, class Y, class X, class W, class B, class Q> __device__ void ck_norm_group(const CkArgs &a) {
    constexpr int N = NV > 0 ? NV : 1;
    i64 C = a.i[0];
    bool vec = ck_norm_vec_ok<NV, Y, X, W, B, LN>(a) && ck_norm_group_vec_ok<NV, X, Q>(a);
    float m = 0.0f;
    CK_ROWS_OF_WARP(r, a.i[1]) {
        if (vec) {
            float v[N][CK_VEC], mean, rstd;
            ck_row_load_stats<LN, N, X>(a.t[1], r, C, a.f[0], v, &mean, &rstd);
            ck_row_group_store<N, Q>(a, r, C, v);
            m = fmaxf(m, ck_norm_row_out<LN, N, Y, W, B>(a, r, C, v, mean, rstd));
        } else {
            ck_row_group_copy<X, Q>(a, r, C);
            m = fmaxf(m, ck_norm_row_scalar<LN, Y, X, W, B>(a, r));
        }
    }
    ck_amax_out<Y>(a, m);
}

template <class Y, class X> __device__ void ck_quant_scale_block(const CkArgs &a) {
    const CkTensor &x = a.t[1];
    i64 C = x.cols, R = x.rows, ncb = (C + 127) / 128, k = blockIdx.x;
    i64 r0 = (k / ncb) * 128, c0 = (k % ncb) * 128;
    float m = 0.0f;
    for (int e = threadIdx.x; e < 128 * 128; e += blockDim.x) {
        i64 r = r0 + e / 128, c = c0 + e % 128;
        if (r < R && c < C) m = fmaxf(m, fabsf(X::ld(x, r * C + c)));
    }
    m = ck_block_max(m);
    if (threadIdx.x == 0) Y::st(a.t[0], k, ck_amax_usable(m) ? ck_scale_for(a.f[0], m, a.i[1]) : 1.0f);
}

/* ---------------------------------------------------------------- embedding backward
 * dtable[v] = the sum of dy over the rows whose id is v, those rows in row order (as the
 * reference sums them). The rows are bucketed by id with integer atomics (a counting sort
 * whose order inside a bucket depends on timing), then each bucket is sorted by row index
 * before its rows are summed, so the sum's order — and its bits — never change.
 * Scratch (int): count[V + 1], first[V + 1], fill[V], order[R], sorted[R]; i = {V, C, R} */

__device__ void ck_eb_zero(const CkArgs &a) {
    int *count = (int *)a.scratch;
    CK_GRID_STRIDE(v, a.i[0] + 1) count[v] = 0;
}

template <class I> __device__ void ck_eb_count(const CkArgs &a) {
    i64 V = a.i[0];
    int *count = (int *)a.scratch;
    CK_GRID_STRIDE(r, a.i[2]) {
        float id = I::ld(a.t[2], r);
        if (id >= 0.0f && id < (float)V) atomicAdd(&count[(i64)id], 1);
    }
}

/* one block of 1024: exclusive scan of count into first, fill = first */
__device__ void ck_eb_scan(const CkArgs &a) {
    __shared__ int carry;
    __shared__ int warp_sums[32];
    i64 V = a.i[0];
    int *count = (int *)a.scratch, *first = count + V + 1, *fill = first + V + 1;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (i64 base = 0; base <= V; base += blockDim.x) {
        i64 v = base + threadIdx.x;
        int x = v < V ? count[v] : 0, incl = x;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) warp_sums[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            int w = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                int y = __shfl_up_sync(0xffffffffu, w, o);
                if (lane >= o) w += y;
            }
            warp_sums[lane] = w;
        }
        __syncthreads();
        int excl = carry + (warp ? warp_sums[warp - 1] : 0) + incl - x;
        if (v <= V) first[v] = excl;
        if (v < V) fill[v] = excl;
        __syncthreads();
        if (threadIdx.x == blockDim.x - 1) carry = excl + x;
        __syncthreads();
    }
}

template <class I> __device__ void ck_eb_scatter(const CkArgs &a) {
    i64 V = a.i[0], R = a.i[2];
    int *first = (int *)a.scratch + V + 1, *fill = first + V + 1, *order = fill + V;
    CK_GRID_STRIDE(r, R) {
        float id = I::ld(a.t[2], r);
        if (id >= 0.0f && id < (float)V) order[atomicAdd(&fill[(i64)id], 1)] = (int)r;
    }
}

/* exclusive prefix sum over the block of one int a thread (blockDim.x a multiple of 32) */
static __device__ int ck_block_excl_scan(int x) {
    __shared__ int warp_sums[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, incl = x;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    __syncthreads();
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; w++) before += warp_sums[w];
    return before + incl - x;
}

enum { CK_EB_SMALL = 64, CK_EB_WORDS = 4096 };

/* one block per id: its bucket of rows, in the scatter's order (which atomics make arbitrary),
 * sorted by row, so that the sums add in row order and every run gives the same bits. A bucket
 * of at most 64 rows ranks each row by counting the smaller ones. A larger one (a frequent
 * token, for which k^2 comparisons take milliseconds) sets its rows' bits in a bitmap of all R
 * rows in shared memory and reads them back in order; batches of more than 32 x 4096 rows,
 * whose bitmap would not fit, rank. */
__device__ void ck_eb_sort(const CkArgs &a) {
    __shared__ unsigned bits[CK_EB_WORDS];
    i64 V = a.i[0], R = a.i[2], v = blockIdx.x;
    int *first = (int *)a.scratch + V + 1, *order = first + 2 * (V + 1) - 1, *sorted = order + R;
    int lo = first[v], k = first[v + 1] - lo;
    if (k <= CK_EB_SMALL || R > 32 * (i64)CK_EB_WORDS) {
        for (int e = threadIdx.x; e < k; e += blockDim.x) {
            int row = order[lo + e], rank = 0;
            for (int j = 0; j < k; j++) rank += order[lo + j] < row;
            sorted[lo + rank] = row;
        }
        return;
    }
    int words = (int)((R + 31) / 32);
    for (int w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0;
    __syncthreads();
    for (int e = threadIdx.x; e < k; e += blockDim.x) {
        int row = order[lo + e];
        atomicOr(&bits[row >> 5], 1u << (row & 31));
    }
    __syncthreads();
    int per = (words + (int)blockDim.x - 1) / (int)blockDim.x;
    int w0 = min((int)threadIdx.x * per, words), w1 = min(w0 + per, words), n = 0;
    for (int w = w0; w < w1; w++) n += __popc(bits[w]);
    int at = lo + ck_block_excl_scan(n);
    for (int w = w0; w < w1; w++)
        for (unsigned b = bits[w]; b; b &= b - 1) sorted[at++] = w * 32 + __ffs(b) - 1;
}

/* Row v of the result, one slice of blockDim.x of its columns at a time, the blocks striding
 * over the V x slices (row, slice) items: the sum of bucket v's dy rows in f64 (zero for an
 * id no row has: at byte-level text all but some 200 of GPT-2's 50304). A bucket of up to
 * CK_EB_SPLIT rows is summed by a thread per column in row order. A larger one (a frequent id:
 * at byte-level text a space is some 15% of the rows, thousands in one bucket, which a thread
 * per column walked alone while the GPU idled) is cut into the block's warps' shares, each
 * lane taking CK_VEC columns of the slice with wide loads, four rows in flight; the shares'
 * sums are then added in warp order. The cut depends on the bucket's size only, so the order
 * of the additions, and the bits, are the same in every run; in f64 the sums of bf16 or f32
 * rows are exact unless their magnitudes span some 2^20 or more, so they are the row-order
 * sum's but for such extremes. */
enum { CK_EB_SPLIT = 64, CK_EB_THREADS = 256 };
template <class Y, class DY> __device__ void ck_eb_sum(const CkArgs &a) {
    __shared__ double part[CK_EB_THREADS / 32][CK_EB_THREADS];
    i64 V = a.i[0], C = a.i[1], R = a.i[2], slices = (C + CK_EB_THREADS - 1) / CK_EB_THREADS;
    const int *first = (const int *)a.scratch + V + 1, *sorted = first + 2 * (V + 1) - 1 + R;
    const int warps = CK_EB_THREADS / 32, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    bool vec = C % CK_VEC == 0 && DY::vec_ok(a.t[1]);
    for (i64 item = CK_BLOCK; item < V * slices; item += CK_BLOCKS) {
        i64 v = item / slices, c0 = (item - v * slices) * CK_EB_THREADS, c = c0 + threadIdx.x;
        int lo = first[v], k = first[v + 1] - lo;
        if (k <= CK_EB_SPLIT || !vec) {
            if (c >= C) continue;
            int j = 0;
            double s = 0;
            /* sixteen rows' loads in flight at a time, added in row order */
            for (; j + 16 <= k; j += 16) {
                float x[16];
                #pragma unroll
                for (int u = 0; u < 16; u++) x[u] = DY::ld(a.t[1], (i64)sorted[lo + j + u] * C + c);
                #pragma unroll
                for (int u = 0; u < 16; u++) s += x[u];
            }
            for (; j < k; j++) s += DY::ld(a.t[1], (i64)sorted[lo + j] * C + c);
            Y::st(a.t[0], v * C + c, (float)s);
            continue;
        }
        /* warp w: rows [lo + w k / warps, lo + (w + 1) k / warps), columns c0 + CK_VEC lane .. */
        int r = lo + (int)((i64)warp * k / warps), r1 = lo + (int)((i64)(warp + 1) * k / warps);
        i64 cl = c0 + (i64)lane * CK_VEC;
        double acc[CK_VEC];
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) acc[j] = 0;
        if (cl < C) {
            for (; r + 4 <= r1; r += 4) {
                float x[4][CK_VEC];
                #pragma unroll
                for (int u = 0; u < 4; u++) DY::ld_vec(a.t[1], (i64)sorted[r + u] * C + cl, x[u]);
                #pragma unroll
                for (int u = 0; u < 4; u++)
                    #pragma unroll
                    for (int j = 0; j < CK_VEC; j++) acc[j] += x[u][j];
            }
            for (; r < r1; r++) {
                float x[CK_VEC];
                DY::ld_vec(a.t[1], (i64)sorted[r] * C + cl, x);
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) acc[j] += x[j];
            }
        }
        #pragma unroll
        for (int j = 0; j < CK_VEC; j++) part[warp][(lane * CK_VEC + j) % CK_EB_THREADS] = acc[j];
        __syncthreads();
        if (c < C) {
            double s = 0;
            for (int w = 0; w < warps; w++) s += part[w][threadIdx.x];
            Y::st(a.t[0], v * C + c, (float)s);
        }
        __syncthreads();
    }
}

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

/* The same for 1-byte elements (the FP8 operands of the backward GEMMs), where a thread per
 * byte would leave the bandwidth idle: 64 x 64 tiles, each thread moving 4-byte words (rows
 * and columns multiples of 4; single bytes otherwise); 256 threads. Both global reads and
 * writes go a row at a time (16 threads, 64 bytes); the tile's rows are 65 bytes apart, so the
 * transposed reads of one warp fall in different banks. */
/* rows and columns multiples of 16 (the FP8 GEMM operands): 16-byte global loads and stores,
 * a thread taking a quarter of a tile row; the tile's rows are 68 bytes apart (at most two
 * threads of a warp on one bank either way) */
/* the 64 x 64 byte tile (rows of 68 bytes in shared memory) at (r0, c0) of an (R, C) matrix,
 * written transposed into out (C, R), 16 bytes a thread (R and C multiples of 16) */
static __device__ void ck_tile_store_t(const unsigned (*tile)[17], unsigned char *out, i64 R, i64 C, i64 r0, i64 c0) {
    const unsigned char *bytes = (const unsigned char *)tile;
    for (int k = threadIdx.x; k < 64 * 4; k += blockDim.x) {
        int orow = k >> 2, q = k & 3;   /* output row c0 + orow, columns r0 + 16 q .. + 15 */
        if (c0 + orow >= C || r0 + q * 16 >= R) continue;
        unsigned w[4];
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            w[j] = 0;
            #pragma unroll
            for (int b = 0; b < 4; b++) w[j] |= (unsigned)bytes[(q * 16 + j * 4 + b) * 68 + orow] << (8 * b);
        }
        *(uint4 *)(out + (c0 + orow) * R + r0 + q * 16) = make_uint4(w[0], w[1], w[2], w[3]);
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
};

/* BGRAD: the tile's column sums of x, for the sum over rows that a bias gradient is (spec.c,
 * fuse_bias_grads): four quarters of 16 rows each summed in order in f64, then the quarters in
 * order, stored as partial blockIdx.y of column c in scratch (ck_colsum_final's layout). */
template <int BGRAD, class L>
static __device__ __forceinline__ void ck_tile_colsum(const CkArgs &a, i64 R, i64 C, i64 r0, i64 c0) {
    if (!BGRAD) return;
    __shared__ double part[4][64];
    int col = threadIdx.x & 63, quarter = threadIdx.x >> 6;   /* 256 threads */
    i64 c = c0 + col, lo = r0 + quarter * 16, hi = lo + 16 < R ? lo + 16 : R;
    double s = 0;
    if (c < C)
        for (i64 r = lo; r < hi; r++) s += L::ld(a, r * C + c);
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
    unsigned char *bytes = (unsigned char *)tile;
    const CkTensor &x = a.t[1];
    i64 R = x.rows, C = x.cols;
    i64 c0 = (i64)blockIdx.x * 64, r0 = (i64)blockIdx.y * 64;
    unsigned char *y = (unsigned char *)a.t[0].p;
    unsigned char *yt = a.i[1] ? (unsigned char *)a.t[a.i[1]].p : y + a.i[0];
    CkTensor local = a.t[0];   /* Y's scale, stored into a register or shared memory */
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
            L::ld_vec(a, r * C + c, v);
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
        ck_tile_colsum<BGRAD, L>(a, R, C, r0, c0);
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
    ck_tile_colsum<BGRAD, L>(a, R, C, r0, c0);
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

/* whether every element of t[0] is finite: scratch (an int flag, zeroed before) gets 1 if not */
template <class X> __device__ void ck_all_finite(const CkArgs &a) {
    int bad = 0;
    if (X::vec_ok(a.t[0])) {
        CK_GRID_STRIDE(c, a.t[0].n / CK_VEC) {
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
