/* ops.cuh — the elementwise kernels of the graph's ops, and what every kernel file shares.
 *
 * Each template implements its op exactly as the reference executor defines it (runtime/ref_*.c):
 * the same formulas, f32 where the reference computes in f32, f64 where it accumulates in f64,
 * so that the only differences are the order of f64 sums and the last ulps of exp and tanh.
 * Kernels are written for three shapes of work, one file each after this one:
 *   elementwise   a grid-stride loop over the result's elements (any grid size works): here,
 *                 with the producers computed inside their readers and the optimizer's scalars;
 *   rows          a warp or a block per row, the row's sums as shuffles (norm.cuh);
 *   reductions    two launches: fixed partitions write partial results to the node's scratch,
 *                 then one block adds them in a fixed order (reduce.cuh). No float atomics
 *                 anywhere, so every run of a step gives the same bits.
 * gemm_io.cuh makes what the library GEMMs read. This file also holds what they all use: the
 * format packs, a producer fused with its quantize, and the block maxima a value leaves for
 * its per-tensor scale.
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
 * Where the scale's node would run right after this launch (spec_scales.c, fold_amax_scales),
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

/* 1/x by the SFU (rcp.approx.ftz: within an ulp; 0 for +inf, and for x past 2^126 a result
 * under 2^-126 that flushes to 0). __fdividef's quotient is this reciprocal times the dividend,
 * after a test and two multiplications that keep a divisor past 2^126 in range: with fmad off
 * those were three of some twenty instructions a value in the cast-transpose that computes
 * GELU from its input (ncu: instruction-bound, 78% of the issue slots busy). A divisor past
 * 2^126 gives 0 both ways. */
static __device__ __forceinline__ float ck_rcp_sfu(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* GELU as x / (1 + e^(-2u)) with GELU's u = sqrt(2 / pi) (x + 0.044715 x^3): the logistic
 * of 2u is (1 + tanh(u)) / 2, so this is the reference's tanh form (ref_ops.c, in f64)
 * without the tanh. One ex2 and one reciprocal (1 + e lies in [1, inf]; past 2^126 the
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
    if (OP == OP_GELU) return x0 * ck_rcp_sfu(1.0f + ck_gelu_exp2(x0, x0 * x0));
    if (OP == OP_GELU_BWD) {
        /* d/dx x s(x) = s + x s' with s = (1 + tanh(u)) / 2: s' = 2 s (1 - s) u', and
         * 1 - s = e s (no cancellation where s is near 1); e at most 2^125 keeps s normal and
         * e s finite (the true s is smaller still there: x below -9) */
        float v = x1, v2 = v * v, e = fminf(ck_gelu_exp2(v, v2), 0x1p125f);
        float s = ck_rcp_sfu(1.0f + e), du = CK_GELU_C + (3.0f * CK_GELU_C * CK_GELU_A) * v2;
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

/* What a binary op's input slot of read class A holds in memory, and the value the op reads
 * from it: the value itself, or for CkAct<OP, A, X> the activation's input x (what a group
 * copy of that input is made of), from which the op computes act(x) rounded to A, as
 * CkAct's loads do (reduce.cuh, ck_binary_group). */
template <class A> struct CkSource {
    using X = A;
    static __device__ __forceinline__ float value(const CkTensor &, i64, float v) { return v; }
};
template <int OP, class A, class X0> struct CkSource<CkAct<OP, A, X0>> {
    using X = X0;
    static __device__ __forceinline__ float value(const CkTensor &t, i64 i, float v) {
        return A::round(t, i, ck_unop<OP>(v, 0.0f));
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
    CkTensor y = a.t[0];
    if (a.scale_amax) y.s = NULL, y.sconst = ck_state_scale(a);   /* a scale it makes (ck_entry) */
    if (Y::vec_ok(y) && X::vec_ok(a.t[1])) {
        CK_GRID_STRIDE(c, y.n / CK_VEC) {
            float v[CK_VEC];
            X::ld_vec(a.t[1], c * CK_VEC, v);
            Y::st_vec(y, c * CK_VEC, v);
        }
        return;
    }
    CK_GRID_STRIDE(i, y.n) Y::st(y, i, X::ld(a.t[1], i));
}

/* SLICE, PAD: i = {outer, len_y, len_x, inner, start}. A slice keeps, of each of the outer
 * blocks of lx inner-runs, the ly runs from start on: one contiguous piece a block. Where the
 * pieces and their starts are whole vectors, a thread copies a vector and finds its block once
 * for it: an element at a time, the 64-bit divisions of the index took longer than the copy
 * (Llama 1.1B's backward splits attention's packed dq|dk|dv into three, 66 launches a step,
 * 2.0 ms of a traced step at 0.9 TB/s). The same values either way. */
template <int PADDING, int AMAX, class Y, class X> __device__ void ck_slice(const CkArgs &a) {
    i64 ly = a.i[1], lx = a.i[2], inner = a.i[3], start = a.i[4];
    i64 piece = ly * inner, row = lx * inner, at = start * inner;
    float m = 0.0f;   /* AMAX (ops.def's amax=1): its block maxima (ck_amax_out) */
    if (!PADDING && piece % CK_VEC == 0 && row % CK_VEC == 0 && at % CK_VEC == 0 && Y::vec_ok(a.t[0]) &&
        X::vec_ok(a.t[1])) {
        CK_GRID_STRIDE(v, a.t[0].n / CK_VEC) {
            i64 e = v * CK_VEC, o = e / piece;
            float x[CK_VEC];
            X::ld_vec(a.t[1], o * row + at + (e - o * piece), x);
            if (AMAX) {
                #pragma unroll
                for (int j = 0; j < CK_VEC; j++) m = fmaxf(m, fabsf(x[j]));
            }
            Y::st_vec(a.t[0], e, x);
        }
        if (AMAX) ck_amax_out<Y>(a, m);
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
        if (AMAX) m = fmaxf(m, fabsf(v));
        Y::st(a.t[0], i, v);
    }
    if (AMAX) ck_amax_out<Y>(a, m);
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
 * pair k of position p depends on (p, k) alone: a.scratch holds the T x head_dim / 2 table of
 * (cos, sin) in f64, which the executor makes once on the host with the reference's formula
 * (cuda/exec.c, rope_table) for every RoPE of the step, and each head's pairs are rotated by
 * reading it. Each pair used to compute its own pow, cos and sin in f64, some 0.1 ms per
 * launch on Llama 1.1B's q at batch 4 x 2048 (8.8 ms of its step), and later each RoPE made
 * the table again in a launch of its own (88 a step). */
/* Where a head is whole vectors (D and C multiples of CK_VEC) and both tensors allow wide
 * loads, a thread takes a vector, four pairs of one head at one position, and finds the
 * position and pair once for them: the 64-bit divisions of the index took more time than the
 * rope's memory (Llama 1.1B at 4 x 2048: 3.0 ms of a traced step in 88 launches). The same
 * f64 products per pair, so the same bits. */
template <int AMAX, class Y, class X> __device__ void ck_rope(const CkArgs &a) {
    i64 D = a.i[0], C = a.i[2], T = a.i[3];
    double sign = a.i[1] ? -1.0 : 1.0;
    const double *tab = (const double *)a.scratch;
    float m = 0.0f;   /* AMAX (ops.def's amax=1): its block maxima (ck_amax_out) */
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
                if (AMAX) m = fmaxf(m, fmaxf(fabsf(y[2 * q]), fabsf(y[2 * q + 1])));
            }
            Y::st_vec(a.t[0], e, y);
        }
        if (AMAX) ck_amax_out<Y>(a, m);
        return;
    }
    CK_GRID_STRIDE(j, a.t[0].n / 2) {
        i64 e = 2 * j, c = e % C, p = (e / C) % T, k = (c % D) / 2;
        const double *cs = tab + 2 * (p * (D / 2) + k);
        double co = cs[0], si = sign * cs[1];
        double x0 = X::ld(a.t[1], e), x1 = X::ld(a.t[1], e + 1);
        float y0 = (float)(x0 * co - x1 * si), y1 = (float)(x0 * si + x1 * co);
        if (AMAX) m = fmaxf(m, fmaxf(fabsf(y0), fabsf(y1)));
        Y::st(a.t[0], e, y0);
        Y::st(a.t[0], e + 1, y1);
    }
    if (AMAX) ck_amax_out<Y>(a, m);
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
 * stored, quantized through the copy's scale, and the block's largest |weight| so far in m.
 * COPY_AT < 0 (O3: copy=2): no copy, the largest |weight| alone. */
template <int COPY_AT, class P, class CP>
static __device__ __forceinline__ void ck_adamw_copy(const CkArgs &a, i64 i, float w, float &m) {
    if (!COPY_AT) return;
    float stored = P::round(a.t[0], i, w);
    if (COPY_AT > 0) CP::st(a.t[COPY_AT > 0 ? COPY_AT : 0], i, stored);
    m = fmaxf(m, fabsf(stored));
}

/* every block leaves its maximum in the scratch (plan_copy_amax); all threads call it */
template <int COPY_AT> static __device__ __forceinline__ void ck_adamw_copy_amax(const CkArgs &a, float m) {
    if (!COPY_AT) return;
    m = ck_block_max(m);
    if (threadIdx.x == 0) ((float *)a.scratch)[CK_BLOCK] = m;
}

