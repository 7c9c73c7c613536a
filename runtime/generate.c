/* generate.c — sampling text from the model in the binary (--generate).
 *
 * The binary holds one graph: the training step at a fixed batch B and sequence length T.
 * There is no separate inference graph, and none is needed: the step's forward phase computes
 * the logits of every position on the way to the loss, and attention is causal, so the logits
 * at position t of a row depend on that row's tokens 0..t only. To sample the next token after
 * a context of n <= T tokens, the context goes into row 0 at positions 0..n-1 (the rest of the
 * batch is padding that nothing of row 0 sees), the forward nodes run on the reference executor
 * one by one, and the logits row (0, n-1) is read as soon as the head node that computes it has
 * run — before the memory plan hands its buffer to anything else, and without running the rest
 * (the loss and, when chunk_loss split the head, the later chunks). A context longer than T
 * keeps its last T tokens.
 *
 * That costs a whole B x T forward per token and runs on the host, whatever device trains: it
 * is meant for looking at what a model writes, not for serving it. The reference executor reads
 * every tensor through its format, so the logits are those of the trained precision (FP8 GEMMs
 * at -O1 and above). Forward nodes that record amax values (delayed scaling) write persistent
 * state; the caller saves and restores it around generation as around an evaluation.
 *
 * --logits FILE keeps, for each token, the V logits it was drawn from (f32, in order): what a
 * comparison with another implementation's forward needs (tools/hf/validate_hf.py). */
#define _GNU_SOURCE   /* qsort_r */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rt.h"

/* The head nodes: the logits each forward cross-entropy reads, with the first of the (B*T)
 * flattened rows it covers (chunk_loss slices the rows). */
typedef struct {
    Node *logits;
    int64_t row0, rows;
} Head;

static int64_t gen_row_offset(const Node *n) {
    int64_t at = 0;
    while (n && n->op != OP_INPUT) {
        if (n->op == OP_SLICE && IR_IATTR(n, SLICE, axis) == 0) at += IR_IATTR(n, SLICE, start);
        else if (n->op != OP_RESHAPE && n->op != OP_CAST) return -1;
        n = n->in[0];
    }
    return n ? at : -1;
}

bool rt_generate(Graph *g, const RtGenerate *o, const int32_t *prompt, int n_prompt, FILE *out) {
    Node *tokens = ir_find(g, "tokens"), *targets = ir_find(g, "targets");
    if (!tokens || !targets || tokens->t.rank != 2) {
        rt_error("artifact: the graph has no (B, T) inputs tokens and targets");
        return false;
    }
    int64_t B = tokens->t.dims[0], T = tokens->t.dims[1], V = 0;
    Head *heads = calloc((size_t)g->n_nodes, sizeof *heads);
    int n_heads = 0;
    if (!heads) {
        rt_error("out of memory");
        return false;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->op != OP_CROSS_ENTROPY || n->phase != PHASE_FORWARD) continue;
        const Tensor *l = &n->in[0]->t;
        int64_t v = l->dims[l->rank - 1], row0 = gen_row_offset(n->in[1]);
        if (row0 < 0 || (V && v != V)) {
            rt_error("artifact: cannot tell which rows cross-entropy node %%%d covers", n->id);
            free(heads);
            return false;
        }
        V = v;
        heads[n_heads++] = (Head){.logits = n->in[0], .row0 = row0, .rows = ir_numel(l) / v};
    }
    if (!n_heads) {
        rt_error("artifact: the graph has no cross-entropy over logits to sample from");
        free(heads);
        return false;
    }
    int64_t total = (int64_t)n_prompt + o->count;
    int32_t *seq = malloc((size_t)total * sizeof *seq);
    int32_t *ids = malloc((size_t)(B * T) * sizeof *ids);
    float *probs = malloc((size_t)V * sizeof *probs);
    int64_t *order = malloc((size_t)V * sizeof *order);
    float *feed = malloc((size_t)(B * T) * sizeof *feed);
    bool ok = seq && ids && probs && order && feed;
    if (!ok) rt_error("out of memory");
    if (ok) memcpy(seq, prompt, (size_t)n_prompt * sizeof *seq);
    uint64_t rng = o->seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    int64_t n = n_prompt;
    for (int i = 0; ok && i < n_prompt; i++) {   /* the prompt, then each token as it comes */
        if (o->text) fputc(prompt[i], out);
        else fprintf(out, "%s%d", i ? " " : "", prompt[i]);
    }
    for (int64_t k = 0; ok && k < o->count; k++, n++) {
        int64_t from = n > T ? n - T : 0, len = n - from;
        for (int64_t i = 0; i < B * T; i++) ids[i] = seq[from + (i % T < len ? i % T : len - 1)];
        Node *io[2] = {tokens, targets};
        for (int j = 0; j < 2; j++) {
            Tensor *t = &io[j]->t;
            if (t->fmt.elem == FMT_I32) {
                if (j == 0) memcpy(t->data, ids, (size_t)(B * T) * sizeof *ids);
                else memset(t->data, 0, (size_t)(B * T) * sizeof *ids);
            } else {
                for (int64_t i = 0; i < B * T; i++) feed[i] = j == 0 ? (float)ids[i] : 0.0f;
                ref_store(t, feed);
            }
        }
        /* run the forward until the head that computes row (0, len-1) has run */
        int64_t row = len - 1;
        const Head *h = NULL;
        for (int i = 0; i < g->n_nodes && !h; i++) {
            Node *node = g->nodes[i];
            if (node->phase != PHASE_FORWARD) continue;
            ref_exec_node(node);
            for (int c = 0; c < n_heads && !h; c++)
                if (heads[c].logits == node && row >= heads[c].row0 && row < heads[c].row0 + heads[c].rows)
                    h = &heads[c];
        }
        if (!h) {
            rt_error("artifact: no head node computes the logits of row %lld", (long long)row);
            ok = false;
            break;
        }
        float *all = ref_load(&h->logits->t);
        memcpy(probs, all + (row - h->row0) * V, (size_t)V * sizeof *probs);
        free(all);
        if (o->logits && fwrite(probs, sizeof *probs, (size_t)V, o->logits) != (size_t)V) {
            rt_error("--logits: cannot write: %s", strerror(errno));
            ok = false;
            break;
        }
        int32_t next = (int32_t)rt_sample(probs, V, o->temperature, o->top_k, &rng, order);
        seq[n] = next;
        if (o->text) {
            fputc(next, out);
        } else {
            fprintf(out, "%s%d", n ? " " : "", next);
        }
        fflush(out);
    }
    if (ok && !o->text) fputc('\n', out);
    free(heads);
    free(seq);
    free(ids);
    free(probs);
    free(order);
    free(feed);
    return ok;
}

/* splitmix64 as a stream: the next 53-bit uniform in [0, 1) */
static double gen_uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0;
}

static int gen_cmp_desc(const void *a, const void *b, void *ctx) {
    const float *p = ctx;
    float x = p[*(const int64_t *)a], y = p[*(const int64_t *)b];
    if (x != y) return x > y ? -1 : 1;
    int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
    return i < j ? -1 : i > j;
}

int64_t rt_sample(float *logits, int64_t V, double temperature, int64_t top_k, uint64_t *rng,
                  int64_t *order) {
    int64_t best = 0;
    for (int64_t v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    if (temperature <= 0) return best;   /* greedy */
    int64_t keep = top_k > 0 && top_k < V ? top_k : V;
    for (int64_t v = 0; v < V; v++) order[v] = v;
    if (keep < V) qsort_r(order, (size_t)V, sizeof *order, gen_cmp_desc, logits);
    double sum = 0, mx = logits[best];
    for (int64_t i = 0; i < keep; i++) sum += exp((logits[order[i]] - mx) / temperature);
    double u = gen_uniform(rng) * sum, acc = 0;
    for (int64_t i = 0; i < keep; i++) {
        acc += exp((logits[order[i]] - mx) / temperature);
        if (u < acc) return order[i];
    }
    return order[keep - 1];
}
