/* lower_kernels.c — graph nodes become kernels.
 *
 * Every node that computes something becomes one or a few kernels of the kernel IR
 * (codegen.h), in schedule order, so that an executor running the kernels of a phase in order
 * runs the step the graph describes. The shapes of the kernels follow the reference executor's
 * split of the work, which is also how a GPU splits it:
 *   elementwise ops   one item per element (or per row when an operand broadcasts, so that the
 *                     broadcast index is the column, not a division per element);
 *   row ops           one item per row (norms, softmax, cross entropy, embedding, rope), the
 *                     columns in CG_LOOP_ROW loops with their sums and maxima as CG_REDUCE;
 *   column sums       one item per block of 64 columns, rows in a sequential loop, summed in
 *                     chunks of 64 rows (bias and norm-weight gradients); with four chunks
 *                     or more, the chunks' sums first, one item per (chunk, block), then
 *                     added in order per block;
 *   whole-tensor      partial results per chunk into a scratch array, then one item that
 *   reductions        combines them in order (squared norms, amax, the mean loss);
 *   attention         blocks of query rows against blocks of transposed keys (lower_attn.c);
 *   GEMM              a call (CG_KERNEL_GEMM), with f32 conversions around it when asked.
 * This file keeps the elementwise groups, the GEMM and the dispatch (lower_head); the other
 * heads are lowered by kind in lower_rows.c, lower_attn.c and lower_adamw.c, which share
 * what lower_kernels.h holds.
 *
 * Fusion (fuse.c) is applied here: a group is lowered from its head (the one non-
 * elementwise node, if any), and wherever the head's kernel has an output element, the
 * group's elementwise nodes compute the root's element from it inline (emit_out, value_at);
 * a group of elementwise nodes alone is one elementwise kernel for the root.
 *
 * Numerics follow the reference executor op by op (the same formulas, in f32; the reference
 * accumulates reductions in f64, which is where the stated tolerances come from). Loads and
 * stores go through each tensor's format; AdamW reads and writes coded optimizer states
 * through their codes and side values and does the codecs' math itself. A node that touches
 * a format no kernel handles (a coded state read by anything but AdamW) becomes a
 * CG_KERNEL_REF kernel: the reference executor runs it. */
#include "lower_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const float GELU_C = 0.7978845608028654f;   /* sqrt(2 / pi), as the reference */
static const float GELU_A = 0.044715f;

/* ---------------------------------------------------------------- elementwise values */

static int value_at(Lower *L, CgKernel *k, Node *n, At at);

static bool in_group(const Lower *L, const Node *n)
{
    return n->index >= 0 && n->index < L->g->n_nodes && L->g->nodes[n->index] == n &&
           L->group[n->index] == L->root;
}

/* Input j of an elementwise node at `at`: inline when it is the same size, else broadcast. */
static int operand(Lower *L, CgKernel *k, Node *n, int j, At at)
{
    Node *x = n->in[j];
    int64_t nb = ir_numel(&x->t), na = ir_numel(&n->t);
    if (nb == na) return value_at(L, k, x, at);
    IR_ASSERT(!in_group(L, x));
    int buf = cg_buf_tensor(k, x, true, false);
    return ld(k, buf, bcast_index(k, nb, at));
}

static int elementwise_math(Lower *L, CgKernel *k, Node *n, At at)
{
    switch (n->op) {
    case OP_ADD: return fadd(k, operand(L, k, n, 0, at), operand(L, k, n, 1, at));
    case OP_SUB: return fsub(k, operand(L, k, n, 0, at), operand(L, k, n, 1, at));
    case OP_MUL: return fmul(k, operand(L, k, n, 0, at), operand(L, k, n, 1, at));
    case OP_SCALE: return fmul(k, fc(k, (float)IR_FATTR(n, SCALE, alpha)), operand(L, k, n, 0, at));
    case OP_ADD_N: {
        int s = operand(L, k, n, 0, at);
        for (int j = 1; j < n->n_in; j++) s = fadd(k, s, operand(L, k, n, j, at));
        return s;
    }
    case OP_GELU: {
        /* 0.5f * v * (1.0f + tanhf(GELU_C * (v + GELU_A * v * v * v))), in this order */
        int v = operand(L, k, n, 0, at);
        int cube = fmul(k, fmul(k, fmul(k, fc(k, GELU_A), v), v), v);
        int t = e1(k, CG_TANH, fmul(k, fc(k, GELU_C), fadd(k, v, cube)));
        return fmul(k, fmul(k, fc(k, 0.5f), v), fadd(k, fc(k, 1.0f), t));
    }
    case OP_GELU_BWD: {
        int dy = operand(L, k, n, 0, at), v = operand(L, k, n, 1, at);
        int cube = fmul(k, fmul(k, fmul(k, fc(k, GELU_A), v), v), v);
        int t = e1(k, CG_TANH, fmul(k, fc(k, GELU_C), fadd(k, v, cube)));
        int du = fmul(k, fc(k, GELU_C),
                      fadd(k, fc(k, 1.0f), fmul(k, fmul(k, fc(k, 3.0f * GELU_A), v), v)));
        int left = fmul(k, fc(k, 0.5f), fadd(k, fc(k, 1.0f), t));
        int right = fmul(k, fmul(k, fmul(k, fc(k, 0.5f), v), fsub(k, fc(k, 1.0f), fmul(k, t, t))), du);
        return fmul(k, dy, fadd(k, left, right));
    }
    case OP_SILU: {
        int v = operand(L, k, n, 0, at);
        return fdiv(k, v, fadd(k, fc(k, 1.0f), e1(k, CG_EXP, e1(k, CG_FNEG, v))));
    }
    case OP_SILU_BWD: {
        int dy = operand(L, k, n, 0, at), v = operand(L, k, n, 1, at);
        int s = fdiv(k, fc(k, 1.0f), fadd(k, fc(k, 1.0f), e1(k, CG_EXP, e1(k, CG_FNEG, v))));
        int d = fadd(k, fc(k, 1.0f), fmul(k, v, fsub(k, fc(k, 1.0f), s)));
        return fmul(k, fmul(k, dy, s), d);
    }
    case OP_CAST: case OP_QUANTIZE: case OP_RESHAPE: return operand(L, k, n, 0, at);
    case OP_ACCUMULATE: {
        int acc = cg_buf_tensor(k, n->in[0], true, true);
        return fadd(k, load_at(k, acc, at), operand(L, k, n, 1, at));
    }
    default: IR_ASSERT(!"not an elementwise op");
    }
    return NONE;
}

/* The value of n at `at`: computed inline for members of the group being lowered (rounded to
 * n's format, as storing and reloading it would), loaded for everything else. */
static int value_at(Lower *L, CgKernel *k, Node *n, At at)
{
    for (int i = 0; i < L->n_memo; i++)
        if (L->memo_node[i] == n) return L->memo_val[i];
    int v;
    if (in_group(L, n) && n != L->head) {
        v = elementwise_math(L, k, n, at);
        if (n->index != L->root && !(n->t.fmt.elem == FMT_F32 && format_is_plain(&n->t.fmt))) {
            int buf = cg_buf_tensor(k, n, false, false);
            int r, c;
            hints(k, buf, at, &r, &c);
            v = cg_round(k, buf, at.idx, v, r, c);
        }
    } else {
        IR_ASSERT(n != L->head);   /* a head's value is set by emit_out */
        v = load_at(k, cg_buf_tensor(k, n, true, false), at);
    }
    IR_ASSERT(L->n_memo < MEMO_MAX);
    L->memo_node[L->n_memo] = n;
    L->memo_val[L->n_memo++] = v;
    return v;
}

/* A head has computed its value v at `at`: store it, or hand it to the group's elementwise
 * nodes and store the root's value instead. */
void emit_out(Lower *L, CgKernel *k, Node *head, int v, At at)
{
    Node *root = L->g->nodes[L->root];
    L->n_memo = 0;
    if (root != head) {
        /* the consumers see the head's value as the plan stores it */
        if (!(head->t.fmt.elem == FMT_F32 && format_is_plain(&head->t.fmt))) {
            int hb = cg_buf_tensor(k, head, false, false), r, c;
            hints(k, hb, at, &r, &c);
            v = cg_round(k, hb, at.idx, v, r, c);
        }
        L->memo_node[0] = head;
        L->memo_val[0] = v;
        L->n_memo = 1;
        v = value_at(L, k, root, at);
    }
    int buf = cg_buf_tensor(k, store_target(root), root->op == OP_ACCUMULATE, true);
    store_at(k, buf, at, v);
    L->n_memo = 0;
}

/* A group of elementwise nodes alone (a root with inline producers, or one node). */
static void lower_elementwise(Lower *L, Node *root)
{
    int64_t n = ir_numel(&root->t), cols = cols_of(&root->t), rows = rows_of(&root->t);
    /* broadcasting anywhere in the group: one item per row, the operand index is the column */
    bool bcast = false;
    int members = 0;
    for (int i = 0; i <= L->root; i++) {
        Node *m = L->g->nodes[i];
        if (L->group[i] != L->root) continue;
        members++;
        for (int j = 0; j < m->n_in; j++)
            if (ir_numel(&m->in[j]->t) != ir_numel(&m->t) && !(m->op == OP_QUANTIZE && j == 1))
                bcast = true;
    }
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, root, NULL);
    body(k);
    At at = {.row = NONE, .col = NONE, .cols = cols};
    if (bcast && cols > 1) {
        shape(k, CG_PAR_BLOCK, rows, cols * 4 * members);
        at.row = item(k);
        at.col = row_loop(k, ic(k, 0), ic(k, cols));
        at.idx = iadd(k, imul(k, at.row, ic(k, cols)), at.col);
    } else {
        shape(k, CG_PAR_THREAD, n, 4 * members);
        at.idx = item(k);
    }
    L->n_memo = 0;
    int v = value_at(L, k, root, at);
    int buf = cg_buf_tensor(k, store_target(root), root->op == OP_ACCUMULATE, true);
    store_at(k, buf, at, v);
    if (bcast && cols > 1) end(k);
}

/* ---------------------------------------------------------------- GEMM */

/* A copy of x decoded into f32 scratch: one elementwise kernel. */
static int widen(Lower *L, Node *n, Node *x, const char *what)
{
    int64_t N = ir_numel(&x->t);
    int s = cg_scratch_new(L->p, N);
    CgKernel *k = kernel(L, CG_KERNEL_LOOP, n, what);
    shape(k, CG_PAR_THREAD, N, 2);
    body(k);
    int i = item(k);
    int v = ld(k, cg_buf_tensor(k, x, true, false), i);
    cg_store(k, cg_buf_scratch(k, s, N, false, true), i, v, NONE, NONE);
    return s;
}

static bool plain_f32(const Node *n)
{
    return n->t.fmt.elem == FMT_F32 && format_is_plain(&n->t.fmt);
}

/* Operands the CPU GEMM widens itself while packing (rt_cpu_gemm_mixed): float types,
 * unscaled or with one scale per tensor. */
static bool gemm_reads(const Node *x)
{
    const Format *f = &x->t.fmt;
    bool elem = f->elem == FMT_F32 || f->elem == FMT_BF16 || f->elem == FMT_F16 ||
                f->elem == FMT_E4M3 || f->elem == FMT_E5M2;
    return elem && f->codec == CODEC_PLAIN &&
           (f->scaling == SCALE_NONE || f->scaling == SCALE_PER_TENSOR);
}


/* A GEMM operand: a transpose read through is its input with the operand's flag flipped. */
static Node *gemm_operand(const Lower *L, Node *x, bool *trans)
{
    if (x->index < 0 || !L->read_through[x->index]) return x;
    *trans = !*trans;
    return x->in[0];
}

static void lower_matmul(Lower *L, Node *n)
{
    bool ta = IR_IATTR(n, MATMUL, trans_a) != 0, tb = IR_IATTR(n, MATMUL, trans_b) != 0;
    Node *A = gemm_operand(L, n->in[0], &ta), *B = gemm_operand(L, n->in[1], &tb), *root = L->g->nodes[L->root];
    int64_t ar = rows_of(&A->t), ac = cols_of(&A->t), br = rows_of(&B->t), bc = cols_of(&B->t);
    CgGemm gm = {.M = ta ? ac : ar, .K = ta ? ar : ac, .N = tb ? br : bc, .trans_a = ta,
                 .trans_b = tb, .epilogue = NONE};
    bool f32 = L->o->gemm_f32;
    int sa = f32 && !gemm_reads(A) ? widen(L, n, A, "a") : NONE;
    int sb = f32 && !gemm_reads(B) ? widen(L, n, B, "b") : NONE;
    /* where C goes: the tensor itself, straight into a plain f32 accumulator, or scratch
     * followed by the group's epilogue */
    bool alone = root == n;
    bool into_acc = root->op == OP_ACCUMULATE && root->in[1] == n && plain_f32(root->in[0]) &&
                    plain_f32(n);
    int sc = NONE;
    if (f32 && !(alone && plain_f32(n)) && !into_acc) sc = transient_scratch(L, gm.M * gm.N);
    if (!f32 && !alone && !into_acc) sc = transient_scratch(L, gm.M * gm.N);

    CgKernel *k = kernel(L, CG_KERNEL_GEMM, n, NULL);
    shape(k, CG_PAR_THREAD, 1, 2 * gm.M * gm.N * gm.K);
    gm.a = sa != NONE ? cg_buf_scratch(k, sa, ir_numel(&A->t), true, false) : cg_buf_tensor(k, A, true, false);
    gm.b = sb != NONE ? cg_buf_scratch(k, sb, ir_numel(&B->t), true, false) : cg_buf_tensor(k, B, true, false);
    if (into_acc) {
        gm.accumulate = true;
        gm.c = cg_buf_tensor(k, root->in[0], true, true);
    } else if (sc != NONE) {
        gm.c = cg_buf_scratch(k, sc, gm.M * gm.N, false, true);
    } else {
        gm.c = cg_buf_tensor(k, n, false, true);
    }
    k->gemm = gm;
    if (sc == NONE) return;

    /* the epilogue: C's rows through the group's elementwise nodes into the root */
    CgKernel *gemm = k;
    k = kernel(L, CG_KERNEL_LOOP, n, "epilogue");
    gemm->gemm.epilogue = k->id;
    shape(k, CG_PAR_BLOCK, gm.M, 4 * gm.N);
    body(k);
    int row = item(k);
    int cb = cg_buf_scratch(k, sc, gm.M * gm.N, true, false);
    At at;
    open_cols(k, row, gm.N, &at);
    emit_out(L, k, n, ld(k, cb, at.idx), at);
    end(k);
}

/* ---------------------------------------------------------------- dispatch */

/* Formats the kernels handle: plain codecs everywhere, and the optimizer-state codecs where
 * an update (AdamW, Lion, SGD) changes them (lower_adamw decodes and encodes them itself). */
static bool node_supported(const Node *n)
{
    if (n->t.fmt.codec != CODEC_PLAIN) return false;
    if (ir_op_is_update(n->op)) return adamw_codecs_supported(n);
    for (int j = 0; j < n->n_in; j++)
        if (n->in[j]->t.fmt.codec != CODEC_PLAIN) return false;
    return true;
}

static void lower_ref(Lower *L, Node *root)
{
    CgKernel *k = kernel(L, CG_KERNEL_REF, root, NULL);
    for (int i = 0; i <= L->root; i++)
        if (L->group[i] == L->root) k->n_nodes++;
    k->nodes = arena_alloc(L->p->arena, sizeof(Node *) * (size_t)k->n_nodes);
    k->n_nodes = 0;
    for (int i = 0; i <= L->root; i++)
        if (L->group[i] == L->root) k->nodes[k->n_nodes++] = L->g->nodes[i];
}

static void lower_head(Lower *L, Node *h)
{
    switch (h->op) {
    case OP_MATMUL: lower_matmul(L, h); return;
    case OP_LAYERNORM: case OP_RMSNORM: case OP_LAYERNORM_BWD_X: case OP_RMSNORM_BWD_X:
        lower_norm(L, h);
        return;
    case OP_LAYERNORM_BWD_W: case OP_RMSNORM_BWD_W: lower_norm_w(L, h); return;
    case OP_SOFTMAX: case OP_SOFTMAX_BWD: lower_softmax(L, h); return;
    case OP_EMBEDDING: lower_embedding(L, h); return;
    case OP_EMBEDDING_BWD: lower_embedding_bwd(L, h); return;
    case OP_CROSS_ENTROPY: case OP_CROSS_ENTROPY_BWD: lower_cross_entropy(L, h); return;
    case OP_SUM_ROWS: lower_sum_rows(L, h); return;
    case OP_SQNORM: lower_sqnorm(L, h); return;
    case OP_QUANT_SCALE: lower_quant_scale(L, h); return;
    case OP_AMAX_RECORD: lower_amax_record(L, h); return;
    case OP_DELAYED_SCALE: lower_delayed_scale(L, h); return;
    case OP_SLICE: case OP_PAD: lower_slice(L, h); return;
    case OP_CONCAT: lower_concat(L, h); return;
    case OP_TRANSPOSE: lower_transpose(L, h); return;
    case OP_CONST: lower_const(L, h); return;
    case OP_ASSIGN: lower_assign(L, h); return;
    case OP_ROPE: lower_rope(L, h); return;
    case OP_ATTENTION: lower_attention(L, h); return;
    case OP_ATTENTION_BWD: lower_attention_bwd(L, h); return;
    case OP_CLIP_COEF: lower_clip_coef(L, h); return;
    case OP_GRAD_NORM: lower_grad_norm(L, h); return;
    case OP_ADAMW: case OP_LION: case OP_SGD: lower_adamw(L, h); return;
    default: IR_ASSERT(!"lower_head: not a head op");
    }
}

static void lower_group(Lower *L, int root_index)
{
    Node *root = L->g->nodes[root_index];
    L->root = root_index;
    L->head = NULL;
    L->n_memo = 0;
    bool supported = true;
    for (int i = 0; i <= root_index; i++) {
        if (L->group[i] != root_index) continue;
        Node *m = L->g->nodes[i];
        supported &= node_supported(m);
        if (ir_op_class(m->op) != CLASS_ELEMWISE) {
            IR_ASSERT(L->head == NULL);
            L->head = m;
        }
    }
    int first = L->p->n_kernels;
    if (!supported) lower_ref(L, root);
    else if (!L->head) lower_elementwise(L, root);
    else lower_head(L, L->head);
    /* every kernel of the group runs in the root's phase and lists the group's nodes */
    int n_nodes = 0;
    for (int i = 0; i <= root_index; i++) n_nodes += L->group[i] == root_index;
    for (int q = first; q < L->p->n_kernels; q++) {
        CgKernel *k = L->p->kernels[q];
        k->phase = root->phase;
        if (k->kind == CG_KERNEL_REF) continue;
        k->nodes = arena_alloc(L->p->arena, sizeof(Node *) * (size_t)n_nodes);
        k->n_nodes = 0;
        for (int i = 0; i <= root_index; i++)
            if (L->group[i] == root_index) k->nodes[k->n_nodes++] = L->g->nodes[i];
    }
}

/* Transposed copies that the CPU GEMM need not have. The layout pass gives FP8 GEMMs
 * operands with k along their rows (what FP8 tensor cores take), so the backward transposes
 * saved activations and weight copies; the CPU GEMM packs its operands in either layout, so
 * there it reads the transpose's input with the operand's flag flipped, and the transpose
 * runs no kernel (at -O1, gpt2_tiny at batch 16 x 128: 8 MiB of e4m3 moved per step, ~9 ms on
 * two cores). A transpose qualifies when every reader is a GEMM, its input is one the GEMM
 * reads in place with the same format and scale, nothing references it as a scale, and its
 * input, and the input's scale, keep their values until each reading GEMM's group has run
 * (which its kernels, not the reference, run). */
static void find_read_through(Lower *L)
{
    const Graph *g = L->g;
    L->read_through = arena_alloc(L->p->arena, sizeof(bool) * (size_t)(g->n_nodes + 1));
    memset(L->read_through, 0, sizeof(bool) * (size_t)(g->n_nodes + 1));
    if (!L->o->gemm_f32) return;
    Uses *uses = NULL;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *t = g->nodes[i];
        if (t->op != OP_TRANSPOSE || L->group[i] != i || !gemm_reads(t->in[0])) continue;
        Node *x = t->in[0];
        const Format *ft = &t->t.fmt, *fx = &x->t.fmt;
        if (ft->elem != fx->elem || ft->codec != fx->codec || ft->scaling != fx->scaling || ft->scale != fx->scale ||
            ir_role_is_persistent(t->t.role) || t->t.role == ROLE_OUTPUT)
            continue;
        bool ok = !fuse_referenced_by_format(g, t);
        for (int j = 0; j < i && ok; j++) ok = L->group[j] != i;   /* nothing fused into it */
        if (!ok) continue;
        if (!uses) uses = ir_fill_uses(g);
        const Uses *u = &uses[i];
        ok = u->n > 0;
        for (int j = 0; j < u->n && ok; j++) {
            const Node *c = u->list[j];
            int root = L->group[c->index];
            ok = c->op == OP_MATMUL && c->n_in == 2 && root >= 0 && fuse_value_survives(g, x, i, root + 1) &&
                 (!fx->scale || fuse_value_survives(g, fx->scale, i, root + 1));
            for (int m = 0; m <= root && ok; m++)   /* kernels, not the reference, run the group */
                ok = L->group[m] != root || node_supported(g->nodes[m]);
        }
        if (ok) {
            L->read_through[i] = true;
            L->group[i] = -1;
        }
    }
}

CgProgram *cg_lower(const Graph *g, Arena *a, const CgLowerOptions *o)
{
    static const CgLowerOptions defaults = {.fuse = true, .gemm_f32 = true};
    if (!o) o = &defaults;
    for (int i = 0; i < g->n_nodes; i++) IR_ASSERT(g->nodes[i]->index == i);
    Lower L = {.g = g, .o = o, .p = cg_program_new(a, g), .transient = NONE};
    if (o->fuse) {
        L.group = fuse_plan(g, a);
    } else {
        L.group = arena_alloc(a, sizeof(int) * (size_t)(g->n_nodes + 1));
        for (int i = 0; i < g->n_nodes; i++) L.group[i] = cg_node_runs_kernel(g->nodes[i]) ? i : -1;
    }
    find_read_through(&L);
    for (int i = 0; i < g->n_nodes; i++)
        if (L.group[i] == i) lower_group(&L, i);
    int bad = 0;
    for (int i = 0; i < L.p->n_kernels; i++) bad += cg_kernel_verify(L.p->kernels[i]);
    if (bad) return NULL;
    cg_program_finish(L.p);
    return L.p;
}
