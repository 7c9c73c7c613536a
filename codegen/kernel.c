/* kernel.c — building, checking, printing and hashing kernels.
 *
 * The kernel IR (codegen.h) is deliberately small: a flat array of scalar SSA instructions with
 * structured loops, over a handful of buffers. This file gives it the services every IR needs —
 * builders that keep the types right, a verifier that catches a malformed kernel before a
 * renderer turns it into a crash, a canonical text form — and one more that this compiler
 * relies on: the text without names is the kernel's identity. Equal bodies (the same layer
 * twelve times) become one function, the object cache is keyed by it, and the training binary
 * checks that the kernels it re-lowers from its artifact are the ones that were compiled.
 *
 * Everything lives in the program's arena; arrays grow by copying into a larger arena block
 * (the old one is simply left behind, as arenas do). */
#include "codegen.h"

#include <stdlib.h>
#include <string.h>

static const struct {
    const char *text;
    int args;
    CgType type;
} cg_ops[] = {
#define X(name, text, args, type) {text, args, type},
    CG_OPS(X)
#undef X
};

_Static_assert(sizeof cg_ops / sizeof cg_ops[0] == CG_OP_COUNT, "cg_ops out of step");

const char *cg_op_name(CgOp op) { return op < CG_OP_COUNT ? cg_ops[op].text : "?"; }

uint64_t cg_hash_bytes(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    if (!h) h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* ---------------------------------------------------------------- building */

CgProgram *cg_program_new(Arena *a, const Graph *g)
{
    CgProgram *p = arena_alloc(a, sizeof *p);
    p->arena = a;
    p->graph = g;
    return p;
}

CgKernel *cg_kernel_new(CgProgram *p, CgKernelKind kind, const char *name, Phase phase)
{
    if (p->n_kernels == p->cap_kernels) {
        int cap = p->cap_kernels ? 2 * p->cap_kernels : 64;
        CgKernel **grown = arena_alloc(p->arena, sizeof *grown * (size_t)cap);
        if (p->n_kernels) memcpy(grown, p->kernels, sizeof *grown * (size_t)p->n_kernels);
        p->kernels = grown;
        p->cap_kernels = cap;
    }
    CgKernel *k = arena_alloc(p->arena, sizeof *k);
    k->id = p->n_kernels;
    k->name = name ? name : "kernel";
    k->kind = kind;
    k->phase = phase;
    k->items = 1;
    k->cost = 1;
    k->func = CG_NONE;
    k->gemm.a = k->gemm.b = k->gemm.c = k->gemm.epilogue = CG_NONE;
    k->arena = p->arena;
    p->kernels[p->n_kernels++] = k;
    return k;
}

static void *grow(Arena *a, void *old, size_t elem, int n, int cap)
{
    void *p = arena_alloc(a, elem * (size_t)cap);
    if (n) memcpy(p, old, elem * (size_t)n);
    return p;
}

int cg_scratch_new(CgProgram *p, int64_t floats)
{
    if (p->n_scratch == p->cap_scratch) {
        int cap = p->cap_scratch ? 2 * p->cap_scratch : 16;
        p->scratch = grow(p->arena, p->scratch, sizeof *p->scratch, p->n_scratch, cap);
        p->cap_scratch = cap;
    }
    p->scratch[p->n_scratch] = floats > 0 ? floats : 1;
    return p->n_scratch++;
}

int cg_const_new(CgProgram *p, const float *data, int64_t n)
{
    if (p->n_consts == p->cap_consts) {
        int cap = p->cap_consts ? 2 * p->cap_consts : 8;
        p->consts = grow(p->arena, p->consts, sizeof *p->consts, p->n_consts, cap);
        p->cap_consts = cap;
    }
    float *copy = arena_alloc(p->arena, sizeof(float) * (size_t)(n ? n : 1));
    memcpy(copy, data, sizeof(float) * (size_t)n);
    p->consts[p->n_consts] = (CgConst){.n = n, .data = copy};
    return p->n_consts++;
}

static int buf_add(CgKernel *k, CgBuf b)
{
    /* a tensor already bound gets its access flags merged, not a second slot */
    for (int i = 0; i < k->n_bufs; i++) {
        CgBuf *o = &k->bufs[i];
        if ((b.node && o->node == b.node && o->codes == b.codes) ||
            (!b.node && !o->node && o->scratch == b.scratch && o->constant == b.constant)) {
            o->read |= b.read;
            o->written |= b.written;
            return i;
        }
    }
    if ((k->n_bufs & 7) == 0) k->bufs = grow(k->arena, k->bufs, sizeof *k->bufs, k->n_bufs, k->n_bufs + 8);
    k->bufs[k->n_bufs] = b;
    return k->n_bufs++;
}

static int64_t tensor_rows(const Tensor *t)
{
    int64_t r = 1;
    for (int i = 0; i + 1 < t->rank; i++) r *= t->dims[i];
    return r;
}

int cg_buf_tensor(CgKernel *k, Node *n, bool read, bool written)
{
    const Tensor *t = &n->t;
    const Format *f = &t->fmt;
    CgBuf b = {.name = t->name ? t->name : ir_op_info(n->op)->text, .node = n,
               .scratch = CG_NONE, .constant = CG_NONE, .elem = f->elem, .scaling = f->scaling, .group = f->group,
               .scale_buf = CG_NONE, .static_scale = 1.0f, .numel = ir_numel(t),
               .rows = tensor_rows(t), .cols = t->rank ? t->dims[t->rank - 1] : 1,
               .read = read, .written = written};
    if (f->scaling != SCALE_NONE && fmt_scaling_info(f->scaling)->block_cols > 0)
        b.group = fmt_scaling_info(f->scaling)->block_cols;     /* tiles and blocks: 128 */
    if (f->scaling != SCALE_NONE) {
        if (f->scale) b.scale_buf = cg_buf_tensor(k, f->scale, true, false);
        else b.static_scale = f->static_scale;
    }
    return buf_add(k, b);
}

int cg_buf_codes(CgKernel *k, Node *n, bool read, bool written)
{
    const Tensor *t = &n->t;
    IR_ASSERT(t->fmt.codec != CODEC_PLAIN);
    CgBuf b = {.name = t->name ? t->name : ir_op_info(n->op)->text, .node = n,
               .scratch = CG_NONE, .constant = CG_NONE, .elem = t->fmt.elem, .scaling = SCALE_NONE,
               .scale_buf = CG_NONE, .static_scale = 1.0f, .numel = ir_numel(t), .rows = 1,
               .cols = ir_numel(t), .codes = true, .read = read, .written = written};
    return buf_add(k, b);
}

int cg_buf_scratch(CgKernel *k, int scratch, int64_t floats, bool read, bool written)
{
    CgBuf b = {.name = "scratch", .scratch = scratch, .constant = CG_NONE, .elem = FMT_F32, .scaling = SCALE_NONE,
               .scale_buf = CG_NONE, .static_scale = 1.0f, .numel = floats, .rows = 1,
               .cols = floats, .read = read, .written = written};
    return buf_add(k, b);
}

int cg_buf_const(CgKernel *k, int constant, int64_t n)
{
    CgBuf b = {.name = "const", .scratch = CG_NONE, .constant = constant, .elem = FMT_F32,
               .scaling = SCALE_NONE, .scale_buf = CG_NONE, .static_scale = 1.0f, .numel = n,
               .rows = 1, .cols = n, .read = true};
    return buf_add(k, b);
}

static int inst_add(CgKernel *k, CgInst in)
{
    if (k->n_insts == k->cap_insts) {
        int cap = k->cap_insts ? 2 * k->cap_insts : 64;
        k->insts = grow(k->arena, k->insts, sizeof *k->insts, k->n_insts, cap);
        k->cap_insts = cap;
    }
    k->insts[k->n_insts] = in;
    return k->n_insts++;
}

int cg_emit(CgKernel *k, CgOp op, int a0, int a1, int a2, int a3)
{
    CgInst in = {.op = op, .type = cg_ops[op].type, .a = {a0, a1, a2, a3}, .buf = CG_NONE};
    if (op == CG_SELECT) in.type = k->insts[a1].type;
    return inst_add(k, in);
}

int cg_fconst(CgKernel *k, double f)
{
    int v = cg_emit(k, CG_FCONST, CG_NONE, CG_NONE, CG_NONE, CG_NONE);
    k->insts[v].f = (float)f;
    return v;
}

int cg_iconst(CgKernel *k, int64_t i)
{
    int v = cg_emit(k, CG_ICONST, CG_NONE, CG_NONE, CG_NONE, CG_NONE);
    k->insts[v].i = i;
    return v;
}

int cg_loop(CgKernel *k, CgLoopKind kind, int lo, int hi)
{
    int v = cg_emit(k, CG_LOOP, lo, hi, CG_NONE, CG_NONE);
    k->insts[v].i = kind;
    return v;
}

int cg_reduce(CgKernel *k, CgReduce kind, int x)
{
    int v = cg_emit(k, CG_REDUCE, x, CG_NONE, CG_NONE, CG_NONE);
    k->insts[v].i = kind;
    return v;
}

int cg_local(CgKernel *k, int64_t len, double init)
{
    IR_ASSERT(len >= 1 && len <= CG_MAX_LOCAL);
    int v = cg_emit(k, CG_LOCAL, CG_NONE, CG_NONE, CG_NONE, CG_NONE);
    k->insts[v].i = len;
    k->insts[v].f = init;
    return v;
}

int cg_load(CgKernel *k, int buf, int idx, int row, int col)
{
    int v = cg_emit(k, CG_LOAD, idx, row, col, CG_NONE);
    k->insts[v].buf = buf;
    return v;
}

int cg_store(CgKernel *k, int buf, int idx, int x, int row, int col)
{
    int v = cg_emit(k, CG_STORE, idx, x, row, col);
    k->insts[v].buf = buf;
    return v;
}

int cg_round(CgKernel *k, int buf, int idx, int x, int row, int col)
{
    int v = cg_emit(k, CG_ROUND, idx, x, row, col);
    k->insts[v].buf = buf;
    return v;
}

/* ---------------------------------------------------------------- verification */

typedef struct {
    const CgKernel *k;
    int problems;
} Check;

static void check_fail(Check *c, int at, const char *msg)
{
    if (c->problems++ == 0) {
        fprintf(stderr, "fp8c: internal error: malformed kernel %d (%s):\n", c->k->id, c->k->name);
        cg_kernel_print(c->k, true, stderr);
    }
    fprintf(stderr, "  %%%d: %s\n", at, msg);
}

int cg_kernel_verify(const CgKernel *k)
{
    Check c = {.k = k};
    if (k->kind != CG_KERNEL_LOOP) return 0;
    enum { MAX_DEPTH = 16 };
    int open[MAX_DEPTH], depth = 0;
    /* loop_of[i]: the innermost loop open when i was defined (-1 none); closed[i]: i is a loop
     * that has been closed; reduce results are usable once their loop is closed */
    int *loop_of = calloc((size_t)k->n_insts + 1, sizeof(int));
    bool *closed = calloc((size_t)k->n_insts + 1, sizeof(bool));
    IR_ASSERT(loop_of && closed);
    bool in_body = false;
    for (int i = 0; i < k->n_insts; i++) {
        const CgInst *in = &k->insts[i];
        loop_of[i] = depth ? open[depth - 1] : -1;
        if (in->op >= CG_OP_COUNT) {
            check_fail(&c, i, "unknown op");
            continue;
        }
        int nargs = cg_ops[in->op].args;
        for (int j = 0; j < 4; j++) {
            int a = in->a[j];
            if (j >= nargs) {
                if (a != CG_NONE) check_fail(&c, i, "operand beyond the op's arity");
                continue;
            }
            bool optional = (in->op == CG_LOAD && j >= 1) || ((in->op == CG_STORE || in->op == CG_ROUND) && j >= 2);
            if (a == CG_NONE) {
                if (!optional) check_fail(&c, i, "missing operand");
                continue;
            }
            if (a < 0 || a >= i) {
                check_fail(&c, i, "operand not defined before");
                continue;
            }
            const CgInst *d = &k->insts[a];
            if (d->type == CG_VOID && d->op != CG_LOCAL) check_fail(&c, i, "operand has no value");
            /* visible: defined outside every loop still open here, or in one of them */
            if (d->op == CG_REDUCE) {
                if (!closed[loop_of[a]]) check_fail(&c, i, "reduction used inside its loop");
            } else if (loop_of[a] != -1) {
                bool visible = false;
                for (int l = 0; l < depth; l++) visible |= open[l] == loop_of[a];
                if (!visible) check_fail(&c, i, "value used outside its loop");
            }
        }
        switch (in->op) {
        case CG_BODY:
            if (in_body) check_fail(&c, i, "second body marker");
            in_body = true;
            break;
        case CG_ITEM:
        case CG_LOOP:
        case CG_LOCAL:
        case CG_STORE:
        case CG_LSET:
            if (!in_body) check_fail(&c, i, "item-dependent or effectful op in the prologue");
            break;
        default: break;
        }
        switch (in->op) {
        case CG_LOOP:
            if (depth == MAX_DEPTH) check_fail(&c, i, "loops nested too deep");
            else open[depth++] = i;
            if (in->i != CG_LOOP_ROW && in->i != CG_LOOP_SEQ) check_fail(&c, i, "bad loop kind");
            break;
        case CG_END:
            if (!depth) check_fail(&c, i, "end without a loop");
            else closed[open[--depth]] = true;
            break;
        case CG_REDUCE:
            if (!depth) check_fail(&c, i, "reduction outside a loop");
            if (in->i != CG_RED_SUM && in->i != CG_RED_MAX) check_fail(&c, i, "bad reduction");
            break;
        case CG_LOAD:
        case CG_STORE:
        case CG_ROUND:
            if (in->buf < 0 || in->buf >= k->n_bufs) check_fail(&c, i, "no such buffer");
            else if (in->op == CG_STORE && !k->bufs[in->buf].written)
                check_fail(&c, i, "store to a buffer not marked written");
            else if (in->op == CG_LOAD && !k->bufs[in->buf].read)
                check_fail(&c, i, "load from a buffer not marked read");
            break;
        case CG_LGET:
        case CG_LSET:
            if (in->a[0] >= 0 && k->insts[in->a[0]].op != CG_LOCAL) check_fail(&c, i, "not a local");
            break;
        default: break;
        }
        /* operand types */
        CgType want = CG_VOID;
        switch (in->op) {
        case CG_IADD: case CG_ISUB: case CG_IMUL: case CG_IDIV: case CG_IMOD: case CG_IMIN:
        case CG_IMAX: case CG_ITOF: case CG_ILT: case CG_IEQ: case CG_LOOP: case CG_BITSF:
            want = CG_I64;
            break;
        case CG_FTOI: case CG_FADD: case CG_FSUB: case CG_FMUL: case CG_FDIV: case CG_FMA:
        case CG_FMAX: case CG_FMIN: case CG_FNEG: case CG_FABS: case CG_EXP: case CG_LOG:
        case CG_TANH: case CG_SQRT: case CG_FLT: case CG_FLE: case CG_FEQ: case CG_REDUCE:
        case CG_FBITS:
            want = CG_F32;
            break;
        case CG_AND: case CG_NOT: want = CG_BOOL; break;
        default: break;
        }
        if (want != CG_VOID)
            for (int j = 0; j < nargs; j++)
                if (in->a[j] >= 0 && in->a[j] < i && k->insts[in->a[j]].type != want)
                    check_fail(&c, i, "operand of the wrong type");
        if (in->op == CG_LOAD || in->op == CG_STORE || in->op == CG_ROUND) {
            for (int j = 0; j < nargs; j++) {
                int a = in->a[j];
                bool is_value = (in->op != CG_LOAD && j == 1);
                if (a >= 0 && a < i && k->insts[a].type != (is_value ? CG_F32 : CG_I64))
                    check_fail(&c, i, "load/store operand of the wrong type");
            }
        }
        if (in->op == CG_SELECT && in->a[0] >= 0 && in->a[0] < i && in->a[1] >= 0 && in->a[2] >= 0 &&
            in->a[1] < i && in->a[2] < i &&
            (k->insts[in->a[0]].type != CG_BOOL || k->insts[in->a[1]].type != k->insts[in->a[2]].type))
            check_fail(&c, i, "select operands of the wrong types");
    }
    if (depth) check_fail(&c, k->n_insts, "loop not closed");
    free(loop_of);
    free(closed);
    return c.problems;
}

/* ---------------------------------------------------------------- printing */

static const char *par_name(CgParallel p) { return p == CG_PAR_BLOCK ? "block" : "thread"; }

static void print_buf(const CgBuf *b, int i, bool with_names, FILE *out)
{
    fprintf(out, "  buf %d", i);
    if (with_names) {
        if (b->node) fprintf(out, " %%%d \"%s\"", b->node->id, b->name);
        else if (b->constant != CG_NONE) fprintf(out, " const %d", b->constant);
        else fprintf(out, " scratch %d", b->scratch);
    } else {
        fprintf(out, " %s", b->node ? "tensor" : b->constant != CG_NONE ? "const" : "scratch");
    }
    fprintf(out, " %s[%lld] view %lldx%lld%s%s", fmt_elem_name(b->elem), (long long)b->numel,
            (long long)b->rows, (long long)b->cols, b->read ? " read" : "",
            b->written ? " write" : "");
    if (b->codes) fprintf(out, " codes=%s", fmt_codec_name(b->node->t.fmt.codec));
    if (b->scaling != SCALE_NONE) {
        fprintf(out, " scaling=%s", fmt_scaling_name(b->scaling));
        if (b->group) fprintf(out, " group=%d", b->group);
        if (b->scale_buf != CG_NONE) fprintf(out, " scale=buf%d", b->scale_buf);
        else fprintf(out, " static_scale=%.9g", b->static_scale);
    }
    fputc('\n', out);
}

void cg_kernel_print(const CgKernel *k, bool with_names, FILE *out)
{
    static const char *kinds[] = {"loop", "gemm", "ref"};
    fprintf(out, "kernel");
    if (with_names) fprintf(out, " k%d \"%s\" %s", k->id, k->name, ir_phase_name(k->phase));
    fprintf(out, " %s %s items=%lld\n", kinds[k->kind], par_name(k->par), (long long)k->items);
    if (with_names && k->n_nodes) {
        fprintf(out, "  nodes");
        for (int i = 0; i < k->n_nodes; i++) fprintf(out, " %%%d", k->nodes[i]->id);
        fputc('\n', out);
    }
    for (int i = 0; i < k->n_bufs; i++) print_buf(&k->bufs[i], i, with_names, out);
    if (k->kind == CG_KERNEL_GEMM) {
        const CgGemm *m = &k->gemm;
        fprintf(out, "  gemm M=%lld N=%lld K=%lld trans_a=%d trans_b=%d accumulate=%d a=buf%d "
                "b=buf%d c=buf%d", (long long)m->M, (long long)m->N, (long long)m->K,
                m->trans_a, m->trans_b, m->accumulate, m->a, m->b, m->c);
        if (m->epilogue != CG_NONE) fprintf(out, " epilogue=+%d", m->epilogue - k->id);
        fputc('\n', out);
    }
    int depth = 0;
    for (int i = 0; i < k->n_insts; i++) {
        const CgInst *in = &k->insts[i];
        if (in->op == CG_END && depth) depth--;
        fprintf(out, "  %*s%%%d = %s", 2 * depth, "", i, cg_op_name(in->op));
        if (in->op == CG_LOOP) fprintf(out, ".%s", in->i == CG_LOOP_ROW ? "row" : "seq");
        if (in->op == CG_REDUCE) fprintf(out, ".%s", in->i == CG_RED_SUM ? "sum" : "max");
        if (in->buf != CG_NONE) fprintf(out, " buf%d", in->buf);
        for (int j = 0; j < 4; j++)
            if (in->a[j] != CG_NONE) fprintf(out, "%s%%%d", j || in->buf != CG_NONE ? ", " : " ", in->a[j]);
        if (in->op == CG_FCONST) fprintf(out, " %.9g", in->f);
        if (in->op == CG_ICONST) fprintf(out, " %lld", (long long)in->i);
        if (in->op == CG_LOCAL) fprintf(out, " [%lld] = %.9g", (long long)in->i, in->f);
        fputc('\n', out);
        if (in->op == CG_LOOP) depth++;
    }
}

void cg_program_print(const CgProgram *p, FILE *out)
{
    fprintf(out, "# %d kernels, %d functions, %d scratch arrays, hash %016llx\n", p->n_kernels,
            p->n_funcs, p->n_scratch, (unsigned long long)p->hash);
    for (int i = 0; i < p->n_scratch; i++)
        fprintf(out, "scratch %d f32[%lld]\n", i, (long long)p->scratch[i]);
    for (int i = 0; i < p->n_consts; i++)
        fprintf(out, "const %d f32[%lld]\n", i, (long long)p->consts[i].n);
    for (int i = 0; i < p->n_kernels; i++) {
        const CgKernel *k = p->kernels[i];
        if (k->func != CG_NONE) fprintf(out, "# fp8c_k%d\n", k->func);
        cg_kernel_print(k, true, out);
    }
}

/* One line per kernel: phase, kind, name, the nodes it computes, the bytes of the tensors and
 * scratch arrays it reads and writes (each once), a GEMM's FLOPs; then totals per phase
 * (`fp8c plan --kernels --device cpu`). */
void cg_program_print_table(const CgProgram *p, FILE *out)
{
    static const char *const kinds[] = {"loop", "gemm", "ref"};
    double bytes_of[PHASE_COUNT] = {0}, flops_of[PHASE_COUNT] = {0};
    int count[PHASE_COUNT] = {0}, gemms[PHASE_COUNT] = {0};
    fprintf(out, "CPU kernel program (LLVM): one line per kernel, in launch order\n");
    fprintf(out, "%6s  %-8s  %-4s  %-30s  %-36s %10s %10s\n", "#", "phase", "kind", "kernel", "computes", "MiB",
            "GFLOP");
    for (int i = 0; i < p->n_kernels; i++) {
        const CgKernel *k = p->kernels[i];
        char ops[256] = "";
        size_t at = 0;
        for (int j = 0; j < k->n_nodes && at + 1 < sizeof ops; j++)
            at += (size_t)snprintf(ops + at, sizeof ops - at, "%s%s", j ? "+" : "", ir_op_info(k->nodes[j]->op)->text);
        double bytes = 0;
        for (int b = 0; b < k->n_bufs; b++) {
            const CgBuf *u = &k->bufs[b];
            if (u->read || u->written) bytes += (double)u->numel * fmt_elem_bytes(u->elem);
        }
        double flops = k->kind == CG_KERNEL_GEMM ? 2.0 * (double)k->gemm.M * (double)k->gemm.N * (double)k->gemm.K : 0;
        char gf[32] = "-";
        if (flops > 0) snprintf(gf, sizeof gf, "%.4g", flops / 1e9);
        fprintf(out, "%6d  %-8s  %-4s  %-30.30s  %-36.36s %10.1f %10s\n", i + 1, ir_phase_name(k->phase),
                kinds[k->kind], k->name ? k->name : "", ops, bytes / (1 << 20), gf);
        bytes_of[k->phase] += bytes;
        flops_of[k->phase] += flops;
        count[k->phase]++;
        gemms[k->phase] += k->kind == CG_KERNEL_GEMM;
    }
    fprintf(out, "\n%-8s %9s %7s %12s %12s\n", "phase", "kernels", "GEMMs", "GiB moved", "TFLOP");
    for (int ph = 0; ph < PHASE_COUNT; ph++)
        fprintf(out, "%-8s %9d %7d %12.2f %12.3f\n", ir_phase_name((Phase)ph), count[ph], gemms[ph],
                bytes_of[ph] / (1 << 30), flops_of[ph] / 1e12);
}

/* ---------------------------------------------------------------- identity */

/* The hash of a kernel's body: its printed text without names. Printing into a memory stream
 * keeps one definition of what "equal kernels" means. */
static uint64_t kernel_body_hash(const CgKernel *k, char **text, size_t *len)
{
    FILE *f = open_memstream(text, len);
    IR_ASSERT(f);
    cg_kernel_print(k, false, f);
    fclose(f);
    return cg_hash_bytes(0, *text, *len);
}

void cg_program_finish(CgProgram *p)
{
    p->funcs = arena_alloc(p->arena, sizeof *p->funcs * (size_t)(p->n_kernels + 1));
    p->n_funcs = 0;
    char **texts = calloc((size_t)p->n_kernels + 1, sizeof *texts);
    IR_ASSERT(texts);
    uint64_t h = cg_hash_bytes(0, "fp8c kernels 1", 14);
    for (int i = 0; i < p->n_kernels; i++) {
        CgKernel *k = p->kernels[i];
        /* the binding (which tensors, which scratch) is part of the program's identity */
        char *named;
        size_t named_len;
        FILE *f = open_memstream(&named, &named_len);
        IR_ASSERT(f);
        cg_kernel_print(k, true, f);
        fclose(f);
        h = cg_hash_bytes(h, named, named_len);
        free(named);
        k->func = CG_NONE;
        if (k->kind != CG_KERNEL_LOOP) continue;
        size_t len;
        uint64_t bh = kernel_body_hash(k, &texts[i], &len);
        for (int j = 0; j < p->n_funcs && k->func == CG_NONE; j++) {
            CgFunc *fn = &p->funcs[j];
            if (fn->hash == bh && strcmp(texts[fn->first->id], texts[i]) == 0) {
                k->func = j;
                fn->uses++;
            }
        }
        if (k->func == CG_NONE) {
            p->funcs[p->n_funcs] = (CgFunc){.first = k, .hash = bh, .uses = 1};
            k->func = p->n_funcs++;
        }
    }
    for (int i = 0; i < p->n_scratch; i++) h = cg_hash_bytes(h, &p->scratch[i], sizeof p->scratch[i]);
    for (int i = 0; i < p->n_consts; i++)
        h = cg_hash_bytes(h, p->consts[i].data, sizeof(float) * (size_t)p->consts[i].n);
    for (int i = 0; i < p->n_kernels; i++) free(texts[i]);
    free(texts);
    p->hash = h;
}
