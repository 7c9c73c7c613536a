/* chunk_loss.c — the output head and its loss in row chunks: no full logits tensor exists.
 *
 * With a 50k vocabulary the logits of one step are the largest tensor of a GPT-2 training step
 * (batch 32 x 1024 x 50304 in bf16 is 3.3 GB, and its gradient as much again), larger than all
 * the weights. Nothing needs them whole: cross-entropy is a mean over rows, so the head GEMM,
 * the loss and, after autodiff, the loss's backward and the head's gradient GEMMs can run chunk
 * by chunk (Liger's fused linear cross-entropy, llm.c's fused classifier). This pass rewrites,
 * before autodiff,
 *     loss = cross_entropy(matmul(x, W), targets)
 * into
 *     loss = sum_c (rows_c / rows) * cross_entropy(matmul(x[c], W), targets[c])
 * over row slices c. The scheduler then runs each chunk's backward right after its forward
 * (the backward of a chunk does not wait for the loss: its seed is a constant), so one chunk's
 * logits are live at a time.
 *
 * Exactness: each chunk's mean is over its rows, weighted by its share of all rows; this equals
 * the unchunked mean when no target is ignored (negative), which the runtime never produces.
 * Chunks are sized so that a chunk of logits is at most 400 MiB in bf16; a head that small
 * already is left alone. Larger chunks are larger GEMMs and fewer launches: on an H200 GPT-2 d12
 * at batch 32 (32768 rows) took 59.5 ms a step -O1 in 8 chunks of 4096 rows against 61.1 ms in 25
 * of 1344 (the 128 MiB of an earlier rule), for 0.5 GiB more (docs/results.md); Llama 1.1B's 8192
 * rows go in 2 chunks instead of 4. There are at most 256 chunks: past that (more than 2.7M rows
 * of a 50k vocabulary) the chunks grow instead. Every chunk adds a dozen nodes and two values
 * that live until all chunks are done (its share of the loss, its part of the input's gradient),
 * so an unbounded count made the graph, and the memory plan's work, grow with the batch; at 256
 * chunks a chunk's logits are a small part of a step that large.
 *
 * The chunk count is a choice of the kernel program (`loss.chunks` in the graph's choice
 * table, which `fp8c tune` measures and `fp8c build --tune` sets): fewer, larger chunks make
 * larger GEMMs and fewer launches, more chunks less memory. 1 leaves the head whole; unset, the
 * 400 MiB rule above decides. The sum over chunks changes order with the count, so the loss
 * agrees with the default's to rounding, not bit for bit. */
#include "passes.h"

#include <string.h>

enum { CHUNK_BYTES = 400 << 20, CHUNK_ROW_ALIGN = 64, MAX_CHUNKS = 256 };

static Node *add_checked(Graph *g, Node *n)
{
    const char *err = ir_infer_shape(n, g->arena);
    if (err) ir_die(__FILE__, __LINE__, "chunk_loss: %s", err);
    return n;
}

/* x (.., C) viewed as (rows, C) */
static Node *flatten_rows(Graph *g, Node *x, int64_t rows, SrcLoc loc)
{
    Node *r = ir_add1(g, OP_RESHAPE, x, loc);
    int64_t d[2] = {rows, x->t.dims[x->t.rank - 1]};
    ir_set_shape(r, 2, d);
    return add_checked(g, r);
}

static Node *row_slice(Graph *g, Node *x, int64_t start, int64_t size, SrcLoc loc)
{
    Node *s = ir_add1(g, OP_SLICE, x, loc);
    IR_IATTR(s, SLICE, axis) = 0, IR_IATTR(s, SLICE, start) = start, IR_IATTR(s, SLICE, size) = size;
    return add_checked(g, s);
}

bool pass_chunk_loss(Graph *g, const PassOptions *opt)
{
    (void)opt;
    Node *loss = ir_find(g, "loss");
    if (!loss || loss->op != OP_CROSS_ENTROPY) return true;
    Node *head = loss->in[0], *targets = loss->in[1];
    if (head->op != OP_MATMUL || IR_IATTR(head, MATMUL, trans_a)) return true;
    int64_t vocab = head->t.dims[head->t.rank - 1];
    int64_t rows = ir_numel(&head->t) / vocab;
    int64_t chunks = (rows * vocab * 2 + CHUNK_BYTES - 1) / CHUNK_BYTES;
    int64_t chosen = ir_choice_int(g, "loss.chunks", 0);
    if (chosen > 0) chunks = chosen < rows ? chosen : rows;
    if (chunks <= 1) return true;
    if (chunks > MAX_CHUNKS) chunks = MAX_CHUNKS;
    int64_t per = (rows + chunks - 1) / chunks;
    if (chosen <= 0 || per >= CHUNK_ROW_ALIGN)   /* a chosen count of tiny chunks stays that count */
        per = (per + CHUNK_ROW_ALIGN - 1) / CHUNK_ROW_ALIGN * CHUNK_ROW_ALIGN;

    SrcLoc loc = loss->loc;
    Node *x = head->in[0], *w = head->in[1];
    Node *x2 = flatten_rows(g, x, rows, loc);
    Node *t1 = ir_add1(g, OP_RESHAPE, targets, loc);
    ir_set_shape(t1, 1, &rows);
    t1->t.fmt = targets->t.fmt;
    add_checked(g, t1);
    int n_parts = (int)((rows + per - 1) / per);
    Node **parts = arena_alloc(g->arena, sizeof(Node *) * (size_t)n_parts);
    for (int c = 0; c < n_parts; c++) {
        int64_t start = c * per, size = start + per <= rows ? per : rows - start;
        Node *xc = row_slice(g, x2, start, size, loc);
        Node *tc = row_slice(g, t1, start, size, loc);
        tc->t.fmt = targets->t.fmt;
        Node *lc = ir_add2(g, OP_MATMUL, xc, w, head->loc);
        memcpy(lc->iattr, head->iattr, sizeof lc->iattr);
        add_checked(g, lc);
        Node *ce = add_checked(g, ir_add2(g, OP_CROSS_ENTROPY, lc, tc, loc));
        Node *sc = ir_add1(g, OP_SCALE, ce, loc);
        IR_FATTR(sc, SCALE, alpha) = (double)size / (double)rows;
        parts[c] = add_checked(g, sc);
    }
    Node *sum = add_checked(g, ir_add(g, OP_ADD_N, n_parts, parts, loc));
    sum->t.name = loss->t.name;
    sum->t.role = ROLE_OUTPUT;
    loss->t.name = NULL;
    loss->t.role = ROLE_ACTIVATION;
    ir_replace_uses(g, loss, sum);
    /* the unchunked head and loss now reach nothing; dce removes them */
    return true;
}
