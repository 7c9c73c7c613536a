/* layout.c — the transposed FP8 copies that GEMMs need, made explicit in the graph.
 *
 * Hopper's FP8 tensor cores multiply only one layout ("TN"): both operands k-contiguous, A as
 * (M, K) and B as (N, K) row-major. A forward GEMM y = x W^T reads both that way, but the
 * backward's dx = dy W reads W along its rows and dW = dy^T x reads dy and x along theirs:
 * each needs a transposed copy. Where that copy comes from is a memory and bandwidth decision,
 * so it is made here, once, for every backend, and `fp8c plan` shows it:
 *
 *   - A transient FP8 value that GEMMs read both ways (a gradient dy, read as it is by dx = dy W
 *     and transposed by dW = dy^T x) is quantized into both layouts at once (QUANTIZE
 *     transposed=1): one read of the bf16 value instead of a quantize and a transpose of its
 *     result (TransformerEngine's cast-transpose). Both layouts then live from the quantize to
 *     the last reader; with the choice layout.cast_transpose=0 (a point of fp8c tune) the
 *     value keeps one layout and is transposed right before the GEMM that reads it so, as
 *     below, which costs a pass over the FP8 copy and keeps the transposed bytes only from
 *     there. Either way the GEMMs read the same bytes.
 *   - Any other FP8 operand read transposed — the forward's saved copies (x, read by dW) and
 *     the weights' copies (W, read by dx) — gets a TRANSPOSE node just before its first such
 *     reader, in the reader's phase, and the GEMM reads the copy with its flag flipped. Its
 *     bytes live only in the step arena, from there to the last reader. Quantizing these in
 *     both layouts in the forward as one value would keep twice the FP8 bytes across the step;
 *     but a forward copy that the backward reads only transposed is saved as its transposed
 *     copy, made in the forward right after it (transpose_saved_copies_early): one layout is
 *     kept across the step either way.
 *
 * A per-tensor copy shares the original's one scale; a copy in 128 x 128 blocks gets its grid
 * of block scales transposed too (a second, small TRANSPOSE). Row and 1x128 scales lie along the
 * stored rows and do not survive a transpose: such operands read transposed are left as they
 * are (the GPU backend decodes them to f32, cuda/spec.c). The reference executor and the CPU
 * backend multiply any layout, so for them the copies change nothing but the work; they run
 * them all the same, and all three backends execute one graph. */
#include "passes.h"

#include <string.h>

/* Whether GEMM mm reads its operand k in the layout Hopper's FP8 GEMM takes (k contiguous:
 * A as (M, K), B as (N, K)) or needs it transposed. */
static bool reads_transposed(const Node *mm, int k)
{
    return k == 0 ? IR_IATTR(mm, MATMUL, trans_a) != 0 : IR_IATTR(mm, MATMUL, trans_b) == 0;
}

static bool is_fp8_per_tensor(const Tensor *t)
{
    return (t->fmt.elem == FMT_E4M3 || t->fmt.elem == FMT_E5M2) && t->fmt.scaling == SCALE_PER_TENSOR &&
           t->rank >= 2;
}

/* Whether t's scales form a grid of blocks (rather than one per tensor) */
static bool scales_in_blocks(const Format *f)
{
    return f->scaling != SCALE_NONE && fmt_scaling_info(f->scaling)->block_rows > 0;
}

/* An FP8 operand whose transposed copy reads the same values: one scale per tensor (shared), or
 * a transposable grid of blocks, 128 x 128 (ir/scaling.def), transposed with it. */
static bool is_transposable(const Tensor *t)
{
    if (is_fp8_per_tensor(t)) return true;
    return (t->fmt.elem == FMT_E4M3 || t->fmt.elem == FMT_E5M2) && t->fmt.scaling != SCALE_NONE &&
           fmt_scaling_info(t->fmt.scaling)->transposable && scales_in_blocks(&t->fmt) &&
           t->rank >= 2 && t->fmt.scale && t->fmt.scale->t.rank == 2;
}

/* A transient per-tensor FP8 copy that FP8 GEMMs read both as it is and transposed is
 * quantized into both layouts at once. */
static void keep_transposed_copies(Graph *g, const Uses *uses)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *q = g->nodes[i];
        if (q->op != OP_QUANTIZE || !is_fp8_per_tensor(&q->t) ||
            (q->t.role != ROLE_ACTIVATION && q->t.role != ROLE_GRAD_TEMP) ||
            !ir_choice_on(g, "layout.cast_transpose", q))
            continue;
        bool direct = false, transposed = false;
        for (int k = 0; k < uses[i].n; k++) {
            const Node *r = uses[i].list[k];
            if (r->op != OP_MATMUL || IR_IATTR(r, MATMUL, fp8) != GEMM_FP8_TENSOR) continue;
            for (int j = 0; j < 2; j++)
                if (r->in[j] == q) {
                    if (reads_transposed(r, j)) transposed = true;
                    else direct = true;
                }
        }
        if (direct && transposed) IR_IATTR(q, QUANTIZE, transposed) = 1;
    }
}

static const char *copy_name(Graph *g, const Node *x)
{
    return x->t.name ? arena_printf(g->arena, "%s:T", x->t.name) : NULL;
}

/* x's transposed copy, made just before `first` (its first reader in that phase that wants it);
 * a 128 x 128-block copy gets its block grid transposed the same way */
static Node *transposed_copy(Graph *g, Node *x, Node *first)
{
    Node *t = ir_add1(g, OP_TRANSPOSE, x, x->loc);
    t->phase = first->phase;
    t->t.role = first->phase == PHASE_FORWARD ? ROLE_ACTIVATION : ROLE_GRAD_TEMP;
    t->t.fmt = x->t.fmt;   /* the same codes and, per tensor, the same scale tensor */
    t->t.name = copy_name(g, x);
    const char *err = ir_infer_shape(t, g->arena);
    if (err) ir_die(__FILE__, __LINE__, "layout: %s", err);
    ir_move_before(g, t, first);
    if (scales_in_blocks(&x->t.fmt)) t->t.fmt.scale = transposed_copy(g, x->t.fmt.scale, t);
    return t;
}

/* A forward copy x that the forward's GEMMs read as it is and the backward reads only through
 * its transposed copy t is saved for the backward as t, not as x: t moves into the forward,
 * right after x, and x lives only until its forward readers are done. The same bytes are kept
 * across the step (one layout instead of the other), but t is now made where x is, so the
 * GPU writes both layouts in x's launch (cuda/spec_fuse.c, fuse_cast_transposes; the memory
 * plan gives t its bytes from x's place on, memplan.c) instead of reading x back in the
 * backward to transpose it. */
static void transpose_saved_copies_early(Graph *g, Node **copies, int ids)
{
    Uses *uses = ir_fill_uses(g);   /* by index: the moves come after every test */
    Node **early = arena_alloc(g->arena, sizeof(Node *) * (size_t)(ids ? ids : 1));
    int n_early = 0;
    for (int id = 0; id < ids; id++) {
        Node *t = copies[(size_t)id * PHASE_COUNT + PHASE_BACKWARD];
        if (!t || copies[(size_t)id * PHASE_COUNT + PHASE_FORWARD]) continue;
        Node *x = t->in[0];
        if (x->op != OP_QUANTIZE || x->phase != PHASE_FORWARD || x->t.role != ROLE_SAVED || !is_fp8_per_tensor(&x->t))
            continue;
        bool only_t = true;
        for (int k = 0; k < uses[x->index].n; k++)
            only_t &= uses[x->index].list[k] == t || uses[x->index].list[k]->phase == PHASE_FORWARD;
        if (only_t) early[n_early++] = t;
    }
    for (int k = 0; k < n_early; k++) {
        Node *t = early[k], *x = t->in[0];
        t->phase = PHASE_FORWARD;
        t->t.role = ROLE_SAVED;
        x->t.role = ROLE_ACTIVATION;
        ir_move_before(g, t, g->nodes[x->index + 1]);
    }
}

bool pass_layout(Graph *g, const PassOptions *opt)
{
    (void)opt;
    Uses *uses = ir_fill_uses(g);
    keep_transposed_copies(g, uses);

    /* every other per-tensor FP8 operand read transposed: one TRANSPOSE per value and phase,
     * before its first such reader there (the graph is in topological order, so that is the
     * earliest); a copy is never carried from one phase into the next */
    int n = g->n_nodes;
    Node **snapshot = arena_alloc(g->arena, sizeof(Node *) * (size_t)(n ? n : 1));
    memcpy(snapshot, g->nodes, sizeof(Node *) * (size_t)n);
    int ids = g->next_id;   /* copies by the value's id and the reader's phase */
    Node **copies = arena_alloc(g->arena, sizeof(Node *) * (size_t)(ids ? ids : 1) * PHASE_COUNT);
    memset(copies, 0, sizeof(Node *) * (size_t)(ids ? ids : 1) * PHASE_COUNT);
    for (int i = 0; i < n; i++) {
        Node *mm = snapshot[i];
        if (mm->op != OP_MATMUL) continue;
        if (IR_IATTR(mm, MATMUL, fp8) != GEMM_FP8_TENSOR && IR_IATTR(mm, MATMUL, fp8) != GEMM_FP8_BLOCK) continue;
        for (int j = 0; j < 2; j++) {
            Node *x = mm->in[j];
            if (!reads_transposed(mm, j) || !is_transposable(&x->t)) continue;
            if (x->op == OP_QUANTIZE && IR_IATTR(x, QUANTIZE, transposed)) continue;   /* it keeps both layouts */
            IR_ASSERT(x->id >= 0 && x->id < ids);
            Node **copy = &copies[(size_t)x->id * PHASE_COUNT + mm->phase];
            if (!*copy) *copy = transposed_copy(g, x, mm);
            mm->in[j] = *copy;
            int64_t *trans = j == 0 ? &IR_IATTR(mm, MATMUL, trans_a) : &IR_IATTR(mm, MATMUL, trans_b);
            *trans = !*trans;
        }
    }
    transpose_saved_copies_early(g, copies, ids);
    return true;
}
