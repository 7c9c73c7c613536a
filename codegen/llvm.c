/* llvm.c — kernels to native code through the LLVM C API.
 *
 * Every unique kernel body of a program (CgProgram.funcs) becomes one function
 *     void fp8c_kN(i8** bufs, i64 lo, i64 hi)
 * whose body is the kernel's prologue followed by a loop over the items lo..hi-1. The module
 * also gets the table the runtime binds (fp8c_cpu_kernel_hash/_count/_fns, codegen.h). LLVM's
 * -O2/-O3 pipeline then does the work a hand-written CPU kernel would: SROA turns the allocas
 * below into registers, the loop vectorizer vectorizes the item loop of elementwise kernels
 * and the CG_LOOP_ROW loops of row kernels, and the object is emitted for the host CPU (or the
 * one asked for).
 *
 * Rendering choices, and why:
 *  - Every loop-carried value (induction variables, reductions, locals) lives in an alloca made
 *    in the entry block; mem2reg/SROA turns them into phis. This keeps the renderer a single
 *    forward walk over the instructions.
 *  - Row loops carry `llvm.loop.vectorize.enable`: the kernel IR says their iterations are
 *    independent and their sums may be reordered (codegen.h), and this hint is how LLVM 14 is
 *    told that an f32 reduction may be reassociated (its C API has no fast-math flags).
 *  - Row loops (and item loops without inner loops) are also `llvm.loop.parallel_accesses`
 *    loops: every load and store inside carries their access groups, which tells LLVM what the
 *    kernel IR guarantees, that no iteration reads what another writes. Buffers are plain
 *    pointers that may alias; without this, an in-place kernel (a gradient summed into its
 *    accumulator, memory the plan reuses) failed the vectorizer's runtime overlap check on
 *    every run and ran its scalar loop (layernorm's backward in gpt2_tiny: 3.4x slower).
 *  - Conversions are integer code, not libcalls: the encoders are numerics.c's rounding
 *    (round to nearest even in a format with the target's mantissa width, then the format's
 *    overflow rule) written with selects, so they vectorize and are bit-identical to
 *    num_encode by construction; FP8 decodes are a 256-entry table filled from num_*_to_f32.
 *  - A max reduction is carried as an integer: each f32 as the i32 whose signed order is the
 *    floats' order (the bits, with the magnitude bits flipped for negative values), a NaN as
 *    the smallest i32 so that it is ignored as llvm.maxnum ignores it, and the result turned
 *    back at the loop's exit. LLVM 14 vectorizes an integer max reduction but not an f32
 *    one without no-NaN flags; amax passes over whole tensors ran scalar, at ~2 G elements/s.
 *  - exp, log and tanh are inline polynomials (Cephes' expf and logf, within 2 ulp; a rational
 *    minimax tanh, within 6 ulp) so that loops containing them vectorize: the optimizer-state
 *    codecs take a power (an exp of a log) of every element they decode or encode, and a libm
 *    call would keep those loops scalar.
 *
 * This file renders; llvm_compile.c optimizes the module, emits the object and caches it
 * (objects are cached by a hash of the unoptimized module text, the CPU, its features and the
 * optimization level: a rebuild of the same plan costs a file copy). llvm_internal.h holds
 * the renderer's state the two share. */
#include "llvm_internal.h"

/* ---------------------------------------------------------------- small helpers */

static LLVMValueRef cf(R *r, double v) { return LLVMConstReal(r->f32, v); }
static LLVMValueRef ci32(R *r, long long v) { return LLVMConstInt(r->i32, (unsigned long long)v, 1); }
static LLVMValueRef ci64(R *r, long long v) { return LLVMConstInt(r->i64, (unsigned long long)v, 1); }

static LLVMValueRef intrinsic(R *r, const char *name, LLVMTypeRef *types, int n_types,
                              LLVMValueRef *args, int n_args)
{
    unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
    IR_ASSERT(id != 0);
    LLVMValueRef f = LLVMGetIntrinsicDeclaration(r->mod, id, types, (size_t)n_types);
    LLVMTypeRef t = LLVMIntrinsicGetType(r->ctx, id, types, (size_t)n_types);
    return LLVMBuildCall2(r->b, t, f, args, (unsigned)n_args, "");
}

static LLVMValueRef call1f(R *r, const char *name, LLVMValueRef x)
{
    return intrinsic(r, name, &r->f32, 1, &x, 1);
}

static LLVMValueRef call2f(R *r, const char *name, LLVMValueRef x, LLVMValueRef y)
{
    LLVMValueRef args[2] = {x, y};
    return intrinsic(r, name, &r->f32, 1, args, 2);
}

static LLVMValueRef fma3(R *r, LLVMValueRef a, LLVMValueRef b, LLVMValueRef c)
{
    LLVMValueRef args[3] = {a, b, c};
    return intrinsic(r, "llvm.fma", &r->f32, 1, args, 3);
}

static LLVMValueRef bits_of(R *r, LLVMValueRef x) { return LLVMBuildBitCast(r->b, x, r->i32, ""); }
static LLVMValueRef float_of(R *r, LLVMValueRef u) { return LLVMBuildBitCast(r->b, u, r->f32, ""); }

/* An f32's max-reduction key and back: signed i32 order is float order, a NaN is INT32_MIN.
 * The map flips the magnitude bits of negative values, so it is its own inverse. */
static LLVMValueRef flip_negative(R *r, LLVMValueRef u)
{
    LLVMValueRef sign = LLVMBuildAShr(r->b, u, ci32(r, 31), "");
    return LLVMBuildXor(r->b, u, LLVMBuildAnd(r->b, sign, ci32(r, 0x7fffffff), ""), "");
}
static LLVMValueRef max_key(R *r, LLVMValueRef x)
{
    LLVMValueRef nan = LLVMBuildFCmp(r->b, LLVMRealUNO, x, x, "");
    return LLVMBuildSelect(r->b, nan, ci32(r, INT32_MIN), flip_negative(r, bits_of(r, x)), "");
}
static LLVMValueRef key_float(R *r, LLVMValueRef key) { return float_of(r, flip_negative(r, key)); }

static LLVMValueRef alloca_entry(R *r, LLVMTypeRef t, const char *name)
{
    LLVMBasicBlockRef entry = LLVMGetEntryBasicBlock(r->fn);
    LLVMBuilderRef b = LLVMCreateBuilderInContext(r->ctx);
    LLVMValueRef first = LLVMGetFirstInstruction(entry);
    if (first) LLVMPositionBuilderBefore(b, first);
    else LLVMPositionBuilderAtEnd(b, entry);
    LLVMValueRef a = LLVMBuildAlloca(b, t, name);
    LLVMDisposeBuilder(b);
    return a;
}

/* A memory access (or memset) emitted inside parallel loops joins their access groups. */
static LLVMValueRef grouped(R *r, LLVMValueRef inst)
{
    if (r->groups) LLVMSetMetadata(inst, r->md_access_group, r->groups);
    return inst;
}

/* ---------------------------------------------------------------- math */

/* Cephes expf's core: e^x = 2^n e^t for n = rint(x / ln2), t = x - n ln2 in two parts, e^t by
 * a degree-5 polynomial; returns e^t and sets *n (x finite and clamped by the caller). */
static LLVMValueRef exp_reduced(R *r, LLVMValueRef x, LLVMValueRef *n)
{
    LLVMBuilderRef b = r->b;
    *n = call1f(r, "llvm.rint", LLVMBuildFMul(b, x, cf(r, 1.44269504088896341), ""));
    LLVMValueRef t = fma3(r, *n, cf(r, -0.693359375), x);
    t = fma3(r, *n, cf(r, 2.12194440e-4), t);
    static const double c[] = {1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                               4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1};
    LLVMValueRef p = cf(r, c[0]);
    for (int i = 1; i < 6; i++) p = fma3(r, p, t, cf(r, c[i]));
    return fma3(r, LLVMBuildFMul(b, p, t, ""), t, LLVMBuildFAdd(b, t, cf(r, 1.0), ""));
}

/* Cephes expf: exp_reduced on x clamped to [-104, 89], 2^n applied in two halves so that
 * subnormal results and n = 128 come out right. */
static LLVMValueRef emit_exp(R *r, LLVMValueRef x)
{
    LLVMBuilderRef b = r->b;
    LLVMValueRef xc = call2f(r, "llvm.minnum", call2f(r, "llvm.maxnum", x, cf(r, -104.0)), cf(r, 89.0));
    LLVMValueRef n, y = exp_reduced(r, xc, &n);
    LLVMValueRef ni = LLVMBuildFPToSI(b, n, r->i32, "");
    LLVMValueRef n1 = LLVMBuildAShr(b, ni, ci32(r, 1), ""), n2 = LLVMBuildSub(b, ni, n1, "");
    LLVMValueRef s1 = float_of(r, LLVMBuildShl(b, LLVMBuildAdd(b, n1, ci32(r, 127), ""), ci32(r, 23), ""));
    LLVMValueRef s2 = float_of(r, LLVMBuildShl(b, LLVMBuildAdd(b, n2, ci32(r, 127), ""), ci32(r, 23), ""));
    y = LLVMBuildFMul(b, LLVMBuildFMul(b, y, s1, ""), s2, "");
    /* beyond the clamp: 0 and inf exactly; NaN stays NaN */
    y = LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealOLT, x, cf(r, -103.9), ""), cf(r, 0.0), y, "");
    y = LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealOGT, x, cf(r, 88.7228394), ""), cf(r, INFINITY), y, "");
    return LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealUNO, x, x, ""), x, y, "");
}

/* Cephes logf: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log(m) = f - f^2/2 + f^3 P(f) for
 * f = m - 1, and e ln2 added in two parts. Subnormal x is scaled by 2^23 first; 0 gives -inf,
 * negative x NaN, +inf and NaN themselves. */
static LLVMValueRef emit_log(R *r, LLVMValueRef x)
{
    LLVMBuilderRef b = r->b;
    LLVMValueRef sub = LLVMBuildFCmp(b, LLVMRealOLT, x, cf(r, 0x1p-126), "");
    LLVMValueRef xs = LLVMBuildSelect(b, sub, LLVMBuildFMul(b, x, cf(r, 0x1p23), ""), x, "");
    LLVMValueRef u = bits_of(r, xs);
    /* frexp: xs = m 2^e, m in [0.5, 1) */
    LLVMValueRef e = LLVMBuildSub(b, LLVMBuildLShr(b, u, ci32(r, 23), ""), ci32(r, 126), "");
    e = LLVMBuildSub(b, e, LLVMBuildSelect(b, sub, ci32(r, 23), ci32(r, 0), ""), "");
    LLVMValueRef m = float_of(r, LLVMBuildOr(b, LLVMBuildAnd(b, u, ci32(r, 0x7FFFFF), ""), ci32(r, 0x3F000000), ""));
    LLVMValueRef low = LLVMBuildFCmp(b, LLVMRealOLT, m, cf(r, 0.707106781186547524), "");
    LLVMValueRef f = LLVMBuildFSub(b, LLVMBuildSelect(b, low, LLVMBuildFAdd(b, m, m, ""), m, ""), cf(r, 1.0), "");
    e = LLVMBuildSub(b, e, LLVMBuildZExt(b, low, r->i32, ""), "");
    LLVMValueRef z = LLVMBuildFMul(b, f, f, "");
    static const double c[] = {7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
                               1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
                               3.3333331174e-1};
    LLVMValueRef p = cf(r, c[0]);
    for (int i = 1; i < 9; i++) p = fma3(r, p, f, cf(r, c[i]));
    LLVMValueRef y = LLVMBuildFMul(b, LLVMBuildFMul(b, p, f, ""), z, "");
    LLVMValueRef fe = LLVMBuildSIToFP(b, e, r->f32, "");
    y = fma3(r, fe, cf(r, -2.12194440e-4), y);
    y = fma3(r, z, cf(r, -0.5), y);
    LLVMValueRef v = LLVMBuildFAdd(b, f, y, "");
    v = fma3(r, fe, cf(r, 0.693359375), v);
    v = LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealOEQ, x, cf(r, 0.0), ""), cf(r, -INFINITY), v, "");
    v = LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealOLT, x, cf(r, 0.0), ""), cf(r, NAN), v, "");
    /* +inf and NaN come back as they are */
    return LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealUGE, x, cf(r, INFINITY), ""), x, v, "");
}

/* tanh(x) = x P(x^2) / Q(x^2) on x clamped to [-9, 9] (past 9, tanh is 1 to within half an
 * ulp), P of degree 5 and Q of degree 3 in x^2, both with 1 as their constant term (so that
 * tiny x comes back as itself), the result clamped to [-1, 1]; NaN stays NaN. The coefficients
 * are a minimax fit of the relative error (5.8e-8 in exact arithmetic; linear programming on
 * 2000 points of [1e-4, 9]); evaluated in f32 with FMAs the result is within 6 ulp. GELU, the
 * one user of tanh, spends most of its time here: the Cephes form this replaced (an odd
 * polynomial below 0.625, 1 - 2 / (e^2|x| + 1) above, both computed and one selected, within
 * 2 ulp) took about twice the vector instructions, and GELU's result is rounded to bf16 or FP8
 * in all but f32 plans. */
static LLVMValueRef emit_tanh(R *r, LLVMValueRef x)
{
    LLVMBuilderRef b = r->b;
    static const double p[] = {1.818359042e-11, -1.274835451e-08, 9.255298413e-06, 0.002919306587, 0.1291782264, 1.0};
    static const double q[] = {0.0002279069127, 0.02375705403, 0.462511056, 1.0};
    LLVMValueRef xc = call2f(r, "llvm.minnum", call2f(r, "llvm.maxnum", x, cf(r, -9.0)), cf(r, 9.0));
    LLVMValueRef z = LLVMBuildFMul(b, xc, xc, "");
    LLVMValueRef num = cf(r, p[0]), den = cf(r, q[0]);
    for (int i = 1; i < 6; i++) num = fma3(r, num, z, cf(r, p[i]));
    for (int i = 1; i < 4; i++) den = fma3(r, den, z, cf(r, q[i]));
    LLVMValueRef y = LLVMBuildFDiv(b, LLVMBuildFMul(b, xc, num, ""), den, "");
    y = call2f(r, "llvm.minnum", call2f(r, "llvm.maxnum", y, cf(r, -1.0)), cf(r, 1.0));
    return LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealUNO, x, x, ""), x, y, "");
}

/* ---------------------------------------------------------------- conversions */

/* numerics.c's num_round_magnitude on i32 lanes: abs (f32 bits, sign clear, not NaN) rounded
 * to nearest even with man_bits mantissa bits and exponent bias `bias`; codes above the
 * format's largest finite value come back as they are. Two cheap paths and a select:
 *  - below the format's smallest normal 2^(1-bias), the code is the number of subnormal steps
 *    2^(1-bias-man_bits): adding 2^(that exponent + 23) makes f32's own round-to-nearest-even
 *    round at exactly that step (the sum stays in the binade whose ulp it is), and the code is
 *    the sum's bits less the constant's (f32 subnormal inputs, which a flush-to-zero mode
 *    would zero, are far below half a step of every format here);
 *  - from there up, the f32 bits rounded to man_bits mantissa bits (ties to even, carries
 *    into the exponent) and re-biased.
 * A general shift-and-compare rounding took twice as many vector instructions, and FP8
 * quantization is most of the elementwise work of a step at -O1 and above. */
static LLVMValueRef round_magnitude(R *r, LLVMValueRef abs, int man_bits, int bias)
{
    LLVMBuilderRef b = r->b;
    int min_exp = 1 - bias, step_exp = min_exp - man_bits, drop = 23 - man_bits;
    LLVMValueRef magic = cf(r, ldexp(1.0, step_exp + 23));
    LLVMValueRef sum = LLVMBuildFAdd(b, float_of(r, abs), magic, "");
    LLVMValueRef sub = LLVMBuildSub(b, bits_of(r, sum), bits_of(r, magic), "");
    LLVMValueRef odd = LLVMBuildAnd(b, LLVMBuildLShr(b, abs, ci32(r, drop), ""), ci32(r, 1), "");
    LLVMValueRef up = LLVMBuildAdd(b, LLVMBuildAdd(b, abs, ci32(r, (1 << (drop - 1)) - 1), ""), odd, "");
    LLVMValueRef normal = LLVMBuildSub(b, LLVMBuildLShr(b, up, ci32(r, drop), ""), ci32(r, (127 - bias) << man_bits), "");
    LLVMValueRef small = LLVMBuildICmp(b, LLVMIntULT, abs, ci32(r, (127 + min_exp) << 23), "");
    return LLVMBuildSelect(b, small, sub, normal, "");
}

/* f32 -> the element type's code, as num_encode does (an i32 holding the code's bits). */
static LLVMValueRef encode(R *r, ElemType e, LLVMValueRef x)
{
    LLVMBuilderRef b = r->b;
    LLVMValueRef isnan = LLVMBuildFCmp(b, LLVMRealUNO, x, x, "");
    switch (e) {
    case FMT_F32: return bits_of(r, x);
    case FMT_BF16: {
        LLVMValueRef u = bits_of(r, x);
        LLVMValueRef lsb = LLVMBuildAnd(b, LLVMBuildLShr(b, u, ci32(r, 16), ""), ci32(r, 1), "");
        LLVMValueRef q = LLVMBuildLShr(b, LLVMBuildAdd(b, LLVMBuildAdd(b, u, ci32(r, 0x7FFF), ""), lsb, ""), ci32(r, 16), "");
        return LLVMBuildSelect(b, isnan, ci32(r, 0x7FFF), q, "");
    }
    case FMT_F16: case FMT_E4M3: case FMT_E5M2: {
        int man = e == FMT_F16 ? 10 : e == FMT_E4M3 ? 3 : 2;
        int bias = e == FMT_E4M3 ? 7 : 15;
        unsigned max_code = e == FMT_F16 ? 0x7C00 : e == FMT_E4M3 ? 0x7E : 0x7B;
        unsigned nan_code = e == FMT_F16 ? 0x7FFF : 0x7F;
        int sign_shift = e == FMT_F16 ? 16 : 24;
        LLVMValueRef u = bits_of(r, x);
        LLVMValueRef abs = LLVMBuildAnd(b, u, ci32(r, 0x7FFFFFFF), "");
        LLVMValueRef q = round_magnitude(r, abs, man, bias);
        /* f16 overflows to infinity (0x7C00 is its code); FP8 saturates, infinities too */
        q = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntUGT, q, ci32(r, max_code), ""), ci32(r, max_code), q, "");
        LLVMValueRef inf = LLVMBuildICmp(b, LLVMIntEQ, abs, ci32(r, 0x7F800000), "");
        q = LLVMBuildSelect(b, inf, ci32(r, max_code), q, "");
        LLVMValueRef sign = LLVMBuildAnd(b, LLVMBuildLShr(b, u, ci32(r, sign_shift), ""),
                                         ci32(r, e == FMT_F16 ? 0x8000 : 0x80), "");
        q = LLVMBuildOr(b, q, sign, "");
        return LLVMBuildSelect(b, isnan, ci32(r, nan_code), q, "");
    }
    case FMT_I8: case FMT_U8: {
        double lo = e == FMT_I8 ? -128.0 : 0.0, hi = e == FMT_I8 ? 127.0 : 255.0;
        LLVMValueRef v = call1f(r, "llvm.rint", x);
        v = LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealOLE, x, cf(r, lo), ""), cf(r, lo), v, "");
        v = LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealOGE, x, cf(r, hi), ""), cf(r, hi), v, "");
        v = LLVMBuildSelect(b, isnan, cf(r, 0.0), v, "");
        return LLVMBuildFPToSI(b, v, r->i32, "");
    }
    case FMT_I32: {
        LLVMTypeRef types[2] = {r->i32, r->f32};
        LLVMValueRef v = call1f(r, "llvm.rint", x);
        return intrinsic(r, "llvm.fptosi.sat", types, 2, &v, 1);
    }
    case FMT_E8M0: {
        /* the exponent field, rounding down to a power of two: subnormals and x <= 0 give 0,
         * everything from 2^127 up (infinity too) 254, NaN 255 */
        LLVMValueRef biased = LLVMBuildLShr(b, bits_of(r, x), ci32(r, 23), "");
        LLVMValueRef q = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntUGT, biased, ci32(r, 254), ""), ci32(r, 254), biased, "");
        q = LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealOGT, x, cf(r, 0.0), ""), q, ci32(r, 0), "");
        return LLVMBuildSelect(b, isnan, ci32(r, 255), q, "");
    }
    default: IR_ASSERT(!"encode: no values in this element type");
    }
    return NULL;
}

/* The code (i32 holding its bits) -> f32, exactly. */
static LLVMValueRef decode(R *r, ElemType e, LLVMValueRef q)
{
    LLVMBuilderRef b = r->b;
    switch (e) {
    case FMT_F32: return float_of(r, q);
    case FMT_BF16: return float_of(r, LLVMBuildShl(b, q, ci32(r, 16), ""));
    case FMT_F16: {
        LLVMValueRef sign = LLVMBuildShl(b, LLVMBuildAnd(b, q, ci32(r, 0x8000), ""), ci32(r, 16), "");
        LLVMValueRef ex = LLVMBuildAnd(b, LLVMBuildLShr(b, q, ci32(r, 10), ""), ci32(r, 0x1F), "");
        LLVMValueRef m = LLVMBuildAnd(b, q, ci32(r, 0x3FF), "");
        LLVMValueRef normal = LLVMBuildOr(b, LLVMBuildShl(b, LLVMBuildAdd(b, ex, ci32(r, 112), ""), ci32(r, 23), ""),
                                          LLVMBuildShl(b, m, ci32(r, 13), ""), "");
        LLVMValueRef top = LLVMBuildOr(b, ci32(r, 0x7F800000),
                                       LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntNE, m, ci32(r, 0), ""),
                                                       LLVMBuildOr(b, ci32(r, 0x400000), LLVMBuildShl(b, m, ci32(r, 13), ""), ""),
                                                       ci32(r, 0), ""), "");
        LLVMValueRef sub = bits_of(r, LLVMBuildFMul(b, LLVMBuildSIToFP(b, m, r->f32, ""), cf(r, ldexp(1.0, -24)), ""));
        LLVMValueRef v = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntEQ, ex, ci32(r, 31), ""), top,
                                         LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntEQ, ex, ci32(r, 0), ""), sub, normal, ""), "");
        return float_of(r, LLVMBuildOr(b, v, sign, ""));
    }
    case FMT_E4M3: case FMT_E5M2: {
        LLVMValueRef table = e == FMT_E4M3 ? r->table_e4m3 : r->table_e5m2;
        LLVMValueRef idx[2] = {ci64(r, 0), LLVMBuildZExt(b, LLVMBuildAnd(b, q, ci32(r, 0xFF), ""), r->i64, "")};
        LLVMValueRef p = LLVMBuildInBoundsGEP2(b, LLVMArrayType(r->f32, 256), table, idx, 2, "");
        return grouped(r, LLVMBuildLoad2(b, r->f32, p, ""));
    }
    case FMT_I8: return LLVMBuildSIToFP(b, LLVMBuildTrunc(b, q, r->i8, ""), r->f32, "");
    case FMT_U8: return LLVMBuildUIToFP(b, LLVMBuildTrunc(b, q, r->i8, ""), r->f32, "");
    case FMT_I32: return LLVMBuildSIToFP(b, q, r->f32, "");
    case FMT_E8M0: {
        LLVMValueRef c = LLVMBuildAnd(b, q, ci32(r, 0xFF), "");
        LLVMValueRef v = LLVMBuildShl(b, c, ci32(r, 23), "");
        v = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntEQ, c, ci32(r, 0), ""), ci32(r, 0x00400000), v, "");
        v = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntEQ, c, ci32(r, 255), ""), ci32(r, 0x7FC00000), v, "");
        return float_of(r, v);
    }
    default: IR_ASSERT(!"decode: no values in this element type");
    }
    return NULL;
}

static LLVMTypeRef storage_type(R *r, ElemType e)
{
    switch (fmt_elem_bytes(e)) {
    case 1: return r->i8;
    case 2: return r->i16;
    default: return r->i32;
    }
}

static LLVMValueRef elem_ptr(R *r, int buf, LLVMValueRef idx)
{
    ElemType e = r->k->bufs[buf].elem;
    LLVMTypeRef t = e == FMT_F32 ? r->f32 : storage_type(r, e);
    LLVMValueRef base = LLVMBuildBitCast(r->b, r->ptr[buf], LLVMPointerType(t, 0), "");
    return LLVMBuildInBoundsGEP2(r->b, t, base, &idx, 1, "");
}

static LLVMValueRef load_raw(R *r, int buf, LLVMValueRef idx)
{
    ElemType e = r->k->bufs[buf].elem;
    LLVMValueRef p = elem_ptr(r, buf, idx);
    if (e == FMT_F32) return grouped(r, LLVMBuildLoad2(r->b, r->f32, p, ""));
    LLVMValueRef v = grouped(r, LLVMBuildLoad2(r->b, storage_type(r, e), p, ""));
    return decode(r, e, fmt_elem_bytes(e) == 4 ? v : LLVMBuildZExt(r->b, v, r->i32, ""));
}

static void store_raw(R *r, int buf, LLVMValueRef idx, LLVMValueRef x)
{
    ElemType e = r->k->bufs[buf].elem;
    LLVMValueRef p = elem_ptr(r, buf, idx);
    if (e == FMT_F32) {
        grouped(r, LLVMBuildStore(r->b, x, p));
        return;
    }
    LLVMValueRef q = encode(r, e, x);
    if (fmt_elem_bytes(e) < 4) q = LLVMBuildTrunc(r->b, q, storage_type(r, e), "");
    grouped(r, LLVMBuildStore(r->b, q, p));
}

/* The scale of element idx (row, col given or derived) of a scaled buffer, NULL if unscaled. */
static LLVMValueRef scale_of(R *r, int buf, LLVMValueRef idx, LLVMValueRef row, LLVMValueRef col)
{
    const CgBuf *bf = &r->k->bufs[buf];
    if (bf->scaling == SCALE_NONE) return NULL;
    if (r->scale0[buf]) return r->scale0[buf];
    if (bf->scale_buf == CG_NONE) return cf(r, bf->static_scale);
    LLVMBuilderRef b = r->b;
    if (bf->scaling == SCALE_PER_TENSOR) return load_raw(r, bf->scale_buf, ci64(r, 0));
    if (!row) {
        row = LLVMBuildUDiv(b, idx, ci64(r, bf->cols), "");
        col = LLVMBuildSub(b, idx, LLVMBuildMul(b, row, ci64(r, bf->cols), ""), "");
    }
    LLVMValueRef k;
    int64_t G = bf->group > 0 ? bf->group : 1;
    int64_t ncg = (bf->cols + G - 1) / G;
    switch (bf->scaling) {
    case SCALE_PER_ROW: k = row; break;
    case SCALE_PER_GROUP:
    case SCALE_TILE_1x128:
        k = LLVMBuildAdd(b, LLVMBuildMul(b, row, ci64(r, ncg), ""), LLVMBuildUDiv(b, col, ci64(r, G), ""), "");
        break;
    case SCALE_BLOCK_128:
        k = LLVMBuildAdd(b, LLVMBuildMul(b, LLVMBuildUDiv(b, row, ci64(r, 128), ""), ci64(r, (bf->cols + 127) / 128), ""),
                         LLVMBuildUDiv(b, col, ci64(r, 128), ""), "");
        break;
    default: IR_ASSERT(!"bad scaling");
    }
    return load_raw(r, bf->scale_buf, k);
}

static LLVMValueRef opt_val(R *r, int a) { return a == CG_NONE ? NULL : r->val[a]; }

/* ---------------------------------------------------------------- the walk */

/* A parallel loop's latch: vectorize, and its accesses (access group `group`) are independent
 * between iterations. */
static void loop_metadata(R *r, LLVMValueRef branch, LLVMValueRef group)
{
    LLVMMetadataRef tmp = LLVMTemporaryMDNode(r->ctx, NULL, 0);
    LLVMMetadataRef name = LLVMMDStringInContext2(r->ctx, "llvm.loop.vectorize.enable", 26);
    LLVMMetadataRef one = LLVMValueAsMetadata(LLVMConstInt(r->i1, 1, 0));
    LLVMMetadataRef pair[2] = {name, one};
    LLVMMetadataRef pa[2] = {LLVMMDStringInContext2(r->ctx, "llvm.loop.parallel_accesses", 27),
                             LLVMValueAsMetadata(group)};
    LLVMMetadataRef ops[3] = {tmp, LLVMMDNodeInContext2(r->ctx, pair, 2), LLVMMDNodeInContext2(r->ctx, pa, 2)};
    LLVMMetadataRef node = LLVMMDNodeInContext2(r->ctx, ops, 3);
    LLVMMetadataReplaceAllUsesWith(tmp, node);
    LLVMSetMetadata(branch, r->md_loop, LLVMMetadataAsValue(r->ctx, node));
}

/* An access group for the next parallel loop (made by make_access_groups). */
static LLVMValueRef take_group(R *r)
{
    IR_ASSERT(r->next_group < r->n_groups);
    return r->group[r->next_group++];
}

/* r->groups: the groups of the parallel loops open now (one node, or a list of them). */
static void update_groups(R *r)
{
    LLVMMetadataRef g[MAX_DEPTH + 1];
    size_t n = 0;
    if (r->item_group) g[n++] = LLVMValueAsMetadata(r->item_group);
    for (int i = 0; i < r->depth; i++)
        if (r->loops[i].group) g[n++] = LLVMValueAsMetadata(r->loops[i].group);
    r->groups = n == 0 ? NULL : n == 1 ? LLVMMetadataAsValue(r->ctx, g[0])
                                       : LLVMMetadataAsValue(r->ctx, LLVMMDNodeInContext2(r->ctx, g, n));
}

static void open_loop(R *r, int inst, LLVMValueRef lo, LLVMValueRef hi, bool row)
{
    IR_ASSERT(r->depth < MAX_DEPTH);
    Loop *l = &r->loops[r->depth++];
    l->inst = inst;
    l->row = row;
    l->hi = hi;
    l->slot = alloca_entry(r, r->i64, "iv");
    LLVMBuildStore(r->b, lo, l->slot);
    /* reductions of this loop start at their identity */
    for (int i = inst + 1; i < r->k->n_insts; i++)
        if (r->k->insts[i].op == CG_REDUCE && r->red_loop[i] == inst)
            LLVMBuildStore(r->b, r->k->insts[i].i == CG_RED_SUM ? cf(r, 0.0) : max_key(r, cf(r, -INFINITY)),
                           r->slot[i]);
    l->header = LLVMAppendBasicBlockInContext(r->ctx, r->fn, "loop");
    LLVMBasicBlockRef bodyb = LLVMAppendBasicBlockInContext(r->ctx, r->fn, "body");
    l->exit = LLVMAppendBasicBlockInContext(r->ctx, r->fn, "exit");
    LLVMBuildBr(r->b, l->header);
    LLVMPositionBuilderAtEnd(r->b, l->header);
    LLVMValueRef iv = LLVMBuildLoad2(r->b, r->i64, l->slot, "i");
    LLVMBuildCondBr(r->b, LLVMBuildICmp(r->b, LLVMIntSLT, iv, hi, ""), bodyb, l->exit);
    LLVMPositionBuilderAtEnd(r->b, bodyb);
    r->val[inst] = iv;
    l->group = row ? take_group(r) : NULL;
    update_groups(r);
}

static void close_loop(R *r)
{
    IR_ASSERT(r->depth > 0);
    Loop *l = &r->loops[--r->depth];
    LLVMValueRef iv = LLVMBuildLoad2(r->b, r->i64, l->slot, "");
    LLVMBuildStore(r->b, LLVMBuildAdd(r->b, iv, ci64(r, 1), ""), l->slot);
    LLVMValueRef br = LLVMBuildBr(r->b, l->header);
    if (l->row) loop_metadata(r, br, l->group);
    update_groups(r);
    LLVMPositionBuilderAtEnd(r->b, l->exit);
    for (int i = l->inst + 1; i < r->k->n_insts; i++)
        if (r->k->insts[i].op == CG_REDUCE && r->red_loop[i] == l->inst)
            r->val[i] = r->k->insts[i].i == CG_RED_SUM ? LLVMBuildLoad2(r->b, r->f32, r->slot[i], "")
                                                      : key_float(r, LLVMBuildLoad2(r->b, r->i32, r->slot[i], ""));
}

static LLVMValueRef local_elem(R *r, int local, LLVMValueRef idx)
{
    LLVMTypeRef at = LLVMArrayType(r->f32, (unsigned)r->k->insts[local].i);
    LLVMValueRef ix[2] = {ci64(r, 0), idx};
    return LLVMBuildInBoundsGEP2(r->b, at, r->slot[local], ix, 2, "");
}

static void emit_inst(R *r, int i)
{
    const CgInst *in = &r->k->insts[i];
    LLVMBuilderRef b = r->b;
    LLVMValueRef a0 = in->a[0] >= 0 ? r->val[in->a[0]] : NULL;
    LLVMValueRef a1 = in->a[1] >= 0 ? r->val[in->a[1]] : NULL;
    LLVMValueRef a2 = in->a[2] >= 0 ? r->val[in->a[2]] : NULL;
    LLVMValueRef v = NULL;
    switch (in->op) {
    case CG_BODY: case CG_ITEM: break;   /* handled by the caller */
    case CG_FCONST: v = cf(r, in->f); break;
    case CG_ICONST: v = ci64(r, in->i); break;
    case CG_IADD: v = LLVMBuildAdd(b, a0, a1, ""); break;
    case CG_ISUB: v = LLVMBuildSub(b, a0, a1, ""); break;
    case CG_IMUL: v = LLVMBuildMul(b, a0, a1, ""); break;
    case CG_IDIV: v = LLVMBuildUDiv(b, a0, a1, ""); break;
    case CG_IMOD: v = LLVMBuildURem(b, a0, a1, ""); break;
    case CG_IMIN: v = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSLT, a0, a1, ""), a0, a1, ""); break;
    case CG_IMAX: v = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSGT, a0, a1, ""), a0, a1, ""); break;
    case CG_ITOF: v = LLVMBuildSIToFP(b, a0, r->f32, ""); break;
    case CG_FTOI: {
        LLVMTypeRef types[2] = {r->i64, r->f32};
        v = intrinsic(r, "llvm.fptosi.sat", types, 2, &a0, 1);
        break;
    }
    case CG_FADD: v = LLVMBuildFAdd(b, a0, a1, ""); break;
    case CG_FSUB: v = LLVMBuildFSub(b, a0, a1, ""); break;
    case CG_FMUL: v = LLVMBuildFMul(b, a0, a1, ""); break;
    case CG_FDIV: v = LLVMBuildFDiv(b, a0, a1, ""); break;
    case CG_FMA: v = fma3(r, a0, a1, a2); break;
    case CG_FMAX: v = call2f(r, "llvm.maxnum", a0, a1); break;
    case CG_FMIN: v = call2f(r, "llvm.minnum", a0, a1); break;
    case CG_FNEG: v = LLVMBuildFNeg(b, a0, ""); break;
    case CG_FABS: v = call1f(r, "llvm.fabs", a0); break;
    case CG_EXP: v = emit_exp(r, a0); break;
    case CG_LOG: v = emit_log(r, a0); break;
    case CG_TANH: v = emit_tanh(r, a0); break;
    case CG_SQRT: v = call1f(r, "llvm.sqrt", a0); break;
    case CG_FBITS: v = LLVMBuildZExt(b, bits_of(r, a0), r->i64, ""); break;
    case CG_BITSF: v = float_of(r, LLVMBuildTrunc(b, a0, r->i32, "")); break;
    case CG_FLT: v = LLVMBuildFCmp(b, LLVMRealOLT, a0, a1, ""); break;
    case CG_FLE: v = LLVMBuildFCmp(b, LLVMRealOLE, a0, a1, ""); break;
    case CG_FEQ: v = LLVMBuildFCmp(b, LLVMRealOEQ, a0, a1, ""); break;
    case CG_ILT: v = LLVMBuildICmp(b, LLVMIntSLT, a0, a1, ""); break;
    case CG_IEQ: v = LLVMBuildICmp(b, LLVMIntEQ, a0, a1, ""); break;
    case CG_AND: v = LLVMBuildAnd(b, a0, a1, ""); break;
    case CG_NOT: v = LLVMBuildNot(b, a0, ""); break;
    case CG_SELECT: v = LLVMBuildSelect(b, a0, a1, a2, ""); break;
    case CG_LOAD: {
        v = load_raw(r, in->buf, a0);
        LLVMValueRef s = scale_of(r, in->buf, a0, a1, a2);
        if (s) v = LLVMBuildFDiv(b, v, s, "");
        break;
    }
    case CG_STORE: case CG_ROUND: {
        LLVMValueRef x = a1;
        LLVMValueRef s = scale_of(r, in->buf, a0, a2, opt_val(r, in->a[3]));
        if (s) x = LLVMBuildFMul(b, x, s, "");
        if (in->op == CG_STORE) {
            store_raw(r, in->buf, a0, x);
        } else {
            ElemType e = r->k->bufs[in->buf].elem;
            v = e == FMT_F32 ? x : decode(r, e, encode(r, e, x));
            if (s) v = LLVMBuildFDiv(b, v, s, "");
        }
        break;
    }
    case CG_LOOP: open_loop(r, i, a0, a1, in->i == CG_LOOP_ROW); return;
    case CG_END: close_loop(r); return;
    case CG_REDUCE: {
        if (in->i == CG_RED_SUM) {
            LLVMValueRef acc = LLVMBuildLoad2(b, r->f32, r->slot[i], "");
            LLVMBuildStore(b, LLVMBuildFAdd(b, acc, a0, ""), r->slot[i]);
        } else {
            LLVMValueRef acc = LLVMBuildLoad2(b, r->i32, r->slot[i], ""), key = max_key(r, a0);
            LLVMBuildStore(b, LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSGT, key, acc, ""), key, acc, ""), r->slot[i]);
        }
        return;   /* the value is read after the loop */
    }
    case CG_LOCAL: {
        int64_t n = in->i;
        if (in->f == 0.0 && !signbit(in->f)) {
            grouped(r, LLVMBuildMemSet(b, r->slot[i], LLVMConstInt(r->i8, 0, 0), ci64(r, n * 4), 4));
        } else if (n <= 16) {
            for (int64_t j = 0; j < n; j++) grouped(r, LLVMBuildStore(b, cf(r, in->f), local_elem(r, i, ci64(r, j))));
        } else {
            /* a small loop of its own */
            LLVMValueRef slot = alloca_entry(r, r->i64, "li");
            LLVMBuildStore(b, ci64(r, 0), slot);
            LLVMBasicBlockRef h = LLVMAppendBasicBlockInContext(r->ctx, r->fn, "init");
            LLVMBasicBlockRef bd = LLVMAppendBasicBlockInContext(r->ctx, r->fn, "initb");
            LLVMBasicBlockRef ex = LLVMAppendBasicBlockInContext(r->ctx, r->fn, "inite");
            LLVMBuildBr(b, h);
            LLVMPositionBuilderAtEnd(b, h);
            LLVMValueRef j = LLVMBuildLoad2(b, r->i64, slot, "");
            LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, j, ci64(r, n), ""), bd, ex);
            LLVMPositionBuilderAtEnd(b, bd);
            grouped(r, LLVMBuildStore(b, cf(r, in->f), local_elem(r, i, j)));
            LLVMBuildStore(b, LLVMBuildAdd(b, j, ci64(r, 1), ""), slot);
            LLVMBuildBr(b, h);
            LLVMPositionBuilderAtEnd(b, ex);
        }
        return;
    }
    case CG_LGET: v = grouped(r, LLVMBuildLoad2(b, r->f32, local_elem(r, in->a[0], a1), "")); break;
    case CG_LSET: grouped(r, LLVMBuildStore(b, a2, local_elem(r, in->a[0], a1))); return;
    case CG_OP_COUNT: IR_ASSERT(!"bad op");
    }
    r->val[i] = v;
}

/* The function of one kernel body. */
static void render_kernel(R *r, const CgKernel *k, const char *name)
{
    r->k = k;
    r->fn = LLVMAddFunction(r->mod, name, r->fn_type);
    LLVMAddAttributeAtIndex(r->fn, LLVMAttributeFunctionIndex,
                            LLVMCreateEnumAttribute(r->ctx, LLVMGetEnumAttributeKindForName("nounwind", 8), 0));
    LLVMBasicBlockRef entry = LLVMAppendBasicBlockInContext(r->ctx, r->fn, "entry");
    LLVMPositionBuilderAtEnd(r->b, entry);
    int n = k->n_insts;
    r->val = calloc((size_t)n + 1, sizeof *r->val);
    r->slot = calloc((size_t)n + 1, sizeof *r->slot);
    r->red_loop = calloc((size_t)n + 1, sizeof *r->red_loop);
    r->ptr = calloc((size_t)k->n_bufs + 1, sizeof *r->ptr);
    r->scale0 = calloc((size_t)k->n_bufs + 1, sizeof *r->scale0);
    IR_ASSERT(r->val && r->slot && r->red_loop && r->ptr && r->scale0);
    r->depth = 0;
    r->item_group = NULL;
    update_groups(r);

    /* slots: reductions and locals */
    int open[MAX_DEPTH], depth = 0;
    for (int i = 0; i < n; i++) {
        const CgInst *in = &k->insts[i];
        if (in->op == CG_LOOP) open[depth++] = i;
        else if (in->op == CG_END) depth--;
        else if (in->op == CG_REDUCE) {
            r->red_loop[i] = open[depth - 1];
            r->slot[i] = LLVMBuildAlloca(r->b, in->i == CG_RED_SUM ? r->f32 : r->i32, "acc");
        } else if (in->op == CG_LOCAL) {
            r->slot[i] = LLVMBuildAlloca(r->b, LLVMArrayType(r->f32, (unsigned)in->i), "local");
            LLVMSetAlignment(r->slot[i], 64);
        }
    }
    /* buffer pointers, and per-tensor scales the kernel does not write */
    LLVMValueRef bufs = LLVMGetParam(r->fn, 0);
    for (int i = 0; i < k->n_bufs; i++) {
        LLVMValueRef ix = ci64(r, i);
        LLVMValueRef p = LLVMBuildInBoundsGEP2(r->b, r->i8p, bufs, &ix, 1, "");
        r->ptr[i] = LLVMBuildLoad2(r->b, r->i8p, p, k->bufs[i].name ? "" : "");
    }
    for (int i = 0; i < k->n_bufs; i++) {
        const CgBuf *bf = &k->bufs[i];
        if (bf->scaling == SCALE_PER_TENSOR && bf->scale_buf != CG_NONE && !k->bufs[bf->scale_buf].written)
            r->scale0[i] = load_raw(r, bf->scale_buf, ci64(r, 0));
    }
    /* prologue */
    int i = 0;
    for (; i < n && k->insts[i].op != CG_BODY; i++) emit_inst(r, i);
    /* the item loop */
    LLVMValueRef islot = LLVMBuildAlloca(r->b, r->i64, "item");
    LLVMBuildStore(r->b, LLVMGetParam(r->fn, 1), islot);
    LLVMBasicBlockRef header = LLVMAppendBasicBlockInContext(r->ctx, r->fn, "items");
    LLVMBasicBlockRef bodyb = LLVMAppendBasicBlockInContext(r->ctx, r->fn, "item");
    LLVMBasicBlockRef done = LLVMAppendBasicBlockInContext(r->ctx, r->fn, "done");
    LLVMBuildBr(r->b, header);
    LLVMPositionBuilderAtEnd(r->b, header);
    LLVMValueRef it = LLVMBuildLoad2(r->b, r->i64, islot, "");
    LLVMBuildCondBr(r->b, LLVMBuildICmp(r->b, LLVMIntSLT, it, LLVMGetParam(r->fn, 2), ""), bodyb, done);
    LLVMPositionBuilderAtEnd(r->b, bodyb);
    /* an item loop without inner loops is the one to vectorize */
    bool has_loops = false;
    for (int j = i; j < n; j++) has_loops |= k->insts[j].op == CG_LOOP;
    LLVMValueRef item_group = has_loops ? NULL : take_group(r);
    r->item_group = item_group;
    update_groups(r);
    for (int j = i; j < n; j++) {
        if (k->insts[j].op == CG_ITEM) r->val[j] = it;
        else if (k->insts[j].op != CG_BODY) emit_inst(r, j);
    }
    r->item_group = NULL;
    update_groups(r);
    LLVMValueRef cur = LLVMBuildLoad2(r->b, r->i64, islot, "");
    LLVMBuildStore(r->b, LLVMBuildAdd(r->b, cur, ci64(r, 1), ""), islot);
    LLVMValueRef br = LLVMBuildBr(r->b, header);
    if (!has_loops) loop_metadata(r, br, item_group);
    LLVMPositionBuilderAtEnd(r->b, done);
    LLVMBuildRetVoid(r->b);
    free(r->val);
    free(r->slot);
    free(r->red_loop);
    free(r->ptr);
    free(r->scale0);
}

static LLVMValueRef fp8_table(R *r, const char *name, float (*dec)(uint8_t))
{
    LLVMValueRef vals[256];
    for (int i = 0; i < 256; i++) vals[i] = LLVMConstReal(r->f32, dec((uint8_t)i));
    LLVMTypeRef t = LLVMArrayType(r->f32, 256);
    LLVMValueRef g = LLVMAddGlobal(r->mod, t, name);
    LLVMSetInitializer(g, LLVMConstArray(r->f32, vals, 256));
    LLVMSetGlobalConstant(g, 1);
    LLVMSetLinkage(g, LLVMPrivateLinkage);
    LLVMSetAlignment(g, 64);
    return g;
}

static void diag_handler(LLVMDiagnosticInfoRef di, void *ctx)
{
    (void)ctx;
    if (LLVMGetDiagInfoSeverity(di) != LLVMDSError) return;   /* missed-vectorization notes */
    char *msg = LLVMGetDiagInfoDescription(di);
    fprintf(stderr, "fp8c: error: LLVM: %s\n", msg);
    LLVMDisposeMessage(msg);
}

/* n access groups, for the parallel loops of the module. An access group is a distinct
 * metadata node without operands, which LLVM 14's C API cannot make; a parsed module can, in
 * the same context, and the nodes belong to the context. */
static void make_access_groups(R *r, int n)
{
    size_t cap = 200 + (size_t)n * 96;
    char *text = malloc(cap);
    IR_ASSERT(text);
    size_t len = (size_t)snprintf(text, cap, "define void @fp8c_access_groups(i8* %%p) {\n");
    for (int i = 0; i < n; i++)
        len += (size_t)snprintf(text + len, cap - len, "  %%v%d = load i8, i8* %%p, !llvm.access.group !%d\n", i, i);
    len += (size_t)snprintf(text + len, cap - len, "  ret void\n}\n");
    for (int i = 0; i < n; i++) len += (size_t)snprintf(text + len, cap - len, "!%d = distinct !{}\n", i);
    LLVMMemoryBufferRef mb = LLVMCreateMemoryBufferWithMemoryRangeCopy(text, len, "access_groups");
    free(text);
    char *err = NULL;
    if (LLVMParseIRInContext(r->ctx, mb, &r->groups_mod, &err)) {   /* takes mb */
        fprintf(stderr, "fp8c: internal error: access groups: %s\n", err ? err : "?");
        IR_ASSERT(!"access groups do not parse");
    }
    r->group = calloc((size_t)n + 1, sizeof *r->group);
    IR_ASSERT(r->group);
    LLVMValueRef f = LLVMGetNamedFunction(r->groups_mod, "fp8c_access_groups");
    LLVMValueRef in = LLVMGetFirstInstruction(LLVMGetFirstBasicBlock(f));
    for (int i = 0; i < n; i++, in = LLVMGetNextInstruction(in))
        r->group[i] = LLVMGetMetadata(in, r->md_access_group);
    r->n_groups = n;
    r->next_group = 0;
}

/* The module of a program: one function per unique body, and the runtime's table. */
void llvm_render_module(R *r, const CgProgram *p)
{
    r->ctx = LLVMContextCreate();
    LLVMContextSetDiagnosticHandler(r->ctx, diag_handler, NULL);
    r->mod = LLVMModuleCreateWithNameInContext("fp8c_kernels", r->ctx);
    r->b = LLVMCreateBuilderInContext(r->ctx);
    r->f32 = LLVMFloatTypeInContext(r->ctx);
    r->f64 = LLVMDoubleTypeInContext(r->ctx);
    r->i64 = LLVMInt64TypeInContext(r->ctx);
    r->i32 = LLVMInt32TypeInContext(r->ctx);
    r->i16 = LLVMInt16TypeInContext(r->ctx);
    r->i8 = LLVMInt8TypeInContext(r->ctx);
    r->i1 = LLVMInt1TypeInContext(r->ctx);
    r->i8p = LLVMPointerType(r->i8, 0);
    LLVMTypeRef params[3] = {LLVMPointerType(r->i8p, 0), r->i64, r->i64};
    r->fn_type = LLVMFunctionType(LLVMVoidTypeInContext(r->ctx), params, 3, 0);
    r->md_loop = LLVMGetMDKindIDInContext(r->ctx, "llvm.loop", 9);
    r->md_access_group = LLVMGetMDKindIDInContext(r->ctx, "llvm.access.group", 17);
    int groups = 0;     /* one per row loop, and one per item loop */
    for (int f = 0; f < p->n_funcs; f++) {
        const CgKernel *k = p->funcs[f].first;
        groups++;
        for (int i = 0; i < k->n_insts; i++) groups += k->insts[i].op == CG_LOOP && k->insts[i].i == CG_LOOP_ROW;
    }
    make_access_groups(r, groups);
    r->table_e4m3 = fp8_table(r, "fp8c_e4m3_table", num_e4m3_to_f32);
    r->table_e5m2 = fp8_table(r, "fp8c_e5m2_table", num_e5m2_to_f32);

    LLVMValueRef *fns = calloc((size_t)p->n_funcs + 1, sizeof *fns);
    IR_ASSERT(fns);
    for (int f = 0; f < p->n_funcs; f++) {
        char name[32];
        snprintf(name, sizeof name, "fp8c_k%d", f);
        render_kernel(r, p->funcs[f].first, name);
        fns[f] = r->fn;
    }
    LLVMTypeRef fnp = LLVMPointerType(r->fn_type, 0);
    LLVMValueRef *entries = calloc((size_t)p->n_kernels + 1, sizeof *entries);
    IR_ASSERT(entries);
    for (int i = 0; i < p->n_kernels; i++) {
        const CgKernel *k = p->kernels[i];
        entries[i] = k->func == CG_NONE ? LLVMConstNull(fnp) : fns[k->func];
    }
    LLVMValueRef table = LLVMAddGlobal(r->mod, LLVMArrayType(fnp, (unsigned)p->n_kernels), "fp8c_cpu_kernel_fns");
    LLVMSetInitializer(table, LLVMConstArray(fnp, entries, (unsigned)p->n_kernels));
    LLVMSetGlobalConstant(table, 1);
    LLVMValueRef hash = LLVMAddGlobal(r->mod, r->i64, "fp8c_cpu_kernel_hash");
    LLVMSetInitializer(hash, LLVMConstInt(r->i64, p->hash, 0));
    LLVMSetGlobalConstant(hash, 1);
    LLVMValueRef count = LLVMAddGlobal(r->mod, r->i32, "fp8c_cpu_kernel_count");
    LLVMSetInitializer(count, LLVMConstInt(r->i32, (unsigned long long)p->n_kernels, 0));
    LLVMSetGlobalConstant(count, 1);
    free(fns);
    free(entries);
}

void llvm_dispose(R *r)
{
    if (r->b) LLVMDisposeBuilder(r->b);
    if (r->mod) LLVMDisposeModule(r->mod);
    if (r->groups_mod) LLVMDisposeModule(r->groups_mod);
    free(r->group);
    if (r->ctx) LLVMContextDispose(r->ctx);
}

char *cg_llvm_module_text(const CgProgram *p)
{
    R r = {0};
    llvm_render_module(&r, p);
    char *t = LLVMPrintModuleToString(r.mod);
    char *copy = strdup(t);
    LLVMDisposeMessage(t);
    llvm_dispose(&r);
    return copy;
}
