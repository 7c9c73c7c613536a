/* exec_batch.c — runs of small update nodes as one launch per kernel.
 *
 * The section below says why (hundreds of tiny AdamW, sum-of-squares and finite-check nodes
 * cost more in gaps between launches than in work) and when a run may be batched. The set-up
 * (exec.c's cuda_exec_open) asks exec_find_batches for the runs and the aux bytes they need;
 * the launch lists take a run with exec_add_run, and the gradients' finite checks
 * (cuda_exec_all_finite) batch with exec_add_batch. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exec_internal.h"

/* ---------------------------------------------------------------- batched launches
 *
 * The update has one AdamW node per parameter and, for the gradient norm, one sum of squares
 * per gradient; the training loop checks each gradient for non-finite values. GPT-2 d48 has
 * 580 parameters, and most of them (biases, norm weights) are so small that a launch per node
 * costs more in gaps between kernels than in work. A run of consecutive nodes of one op whose
 * plans launch the same batchable kernels (spec.c's `batch`), none of which writes storage
 * another one reads or writes, runs as one launch per kernel: the nodes' argument blocks go
 * to aux, each block of the launch finds its own (CkBatch), and each node gets scratch of its
 * own in aux, so a partial-sums launch and its final launch work as they do alone. */

bool batch_same_kernels(const CuNodePlan *a, const CuNodePlan *b) {
    if (a->n_launch != b->n_launch || !a->n_launch || a->members || b->members) return false;
    for (int k = 0; k < a->n_launch; k++) {
        const CuLaunch *x = &a->launch[k], *y = &b->launch[k];
        if (x->kind != CU_KERNEL || y->kind != CU_KERNEL || !x->batch || !y->batch || x->table ||
            strcmp(x->fn, y->fn) || x->block != y->block || x->smem != y->smem || x->grid[1] != 1 ||
            y->grid[1] != 1)
            return false;
    }
    return true;
}

typedef struct {
    uintptr_t lo, hi;
    int owner;
    bool write;
} Span;

static void span_add(Span *s, int *n, const Node *x, int owner, bool write, CuStorageAt at) {
    uintptr_t lo;
    int64_t bytes = tensor_bytes(&x->t);
    if (bytes <= 0 || !at(x, &lo)) return;
    s[(*n)++] = (Span){lo, lo + (uintptr_t)bytes, owner, write};
    const Node *sc = x->t.fmt.scale;
    if (sc && tensor_bytes(&sc->t) > 0 && at(sc, &lo))
        s[(*n)++] = (Span){lo, lo + (uintptr_t)tensor_bytes(&sc->t), owner, write};
}

/* whether no node of the run writes storage that another one reads or writes */
static bool batch_independent(const Graph *g, int from, int count, CuStorageAt at) {
    int cap = 0;
    for (int j = 0; j < count; j++) cap += 2 * (g->nodes[from + j]->n_in + 1);
    Span *s = malloc(sizeof *s * (size_t)(cap ? cap : 1));
    if (!s) return false;
    int n = 0;
    for (int j = 0; j < count; j++) {
        const Node *m = g->nodes[from + j];
        span_add(s, &n, m, j, true, at);
        for (int i = 0; i < m->n_in; i++) span_add(s, &n, m->in[i], j, ir_mutates_input(m, i), at);
    }
    bool ok = true;
    for (int a = 0; ok && a < n; a++) {
        if (!s[a].write) continue;
        for (int b = 0; ok && b < n; b++)
            ok = s[b].owner == s[a].owner || s[b].hi <= s[a].lo || s[a].hi <= s[b].lo;
    }
    free(s);
    return ok;
}

/* aux bytes that exec_add_batch takes for n nodes that launch n_launch kernels each */
int64_t batch_aux_bytes(int n_launch, int n) {
    return n_launch * (align_up((int64_t)sizeof(CkArgs) * n) + align_up(4 * (int64_t)(n + 1)));
}

void cuda_batch_runs(const Graph *g, const CuNodePlan *plans, CuStorageAt at, int *run) {
    memset(run, 0, sizeof *run * (size_t)g->n_nodes);
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->phase != PHASE_UPDATE || !batch_same_kernels(&plans[i], &plans[i])) continue;
        int j = i + 1, members = 1;
        while (j < g->n_nodes) {
            const Node *m = g->nodes[j];
            if (m->phase == PHASE_UPDATE && !plans[j].n_launch) {
                j++;
                continue;
            }
            if (m->phase != PHASE_UPDATE || m->op != n->op || !batch_same_kernels(&plans[i], &plans[j])) break;
            members++;
            j++;
        }
        if (members >= BATCH_MIN && batch_independent(g, i, j - i, at)) run[i] = j - i;
        i = j - 1;
    }
}

/* where a node's storage is in the executor: its address in the host's arenas, which the
 * device's arenas mirror byte for byte */
static bool host_storage_at(const Node *x, uintptr_t *lo) {
    *lo = (uintptr_t)x->t.data;
    return x->t.data != NULL;
}

/* The runs of the update (cuda_batch_runs) in e->batch_run; the aux bytes they need: each
 * member's own scratch, and the argument blocks. */
int64_t exec_find_batches(CudaExec *e) {
    const Graph *g = e->g;
    int64_t aux = 0;
    e->batch_run = calloc((size_t)(g->n_nodes ? g->n_nodes : 1), sizeof *e->batch_run);
    if (!e->batch_run) return -1;
    cuda_batch_runs(g, e->plans, host_storage_at, e->batch_run);
    for (int i = 0; i < g->n_nodes; i++) {
        if (!e->batch_run[i]) continue;
        int members = 0;
        for (int j = i; j < i + e->batch_run[i]; j++) {
            if (!e->plans[j].n_launch) continue;
            members++;
            aux += align_up(e->plans[j].scratch_bytes);
        }
        aux += batch_aux_bytes(e->plans[i].n_launch, members);
    }
    return aux;
}

/* One launch for each of the items' kernels (their plans launch the same batchable ones). */
bool exec_add_batch(CudaExec *e, ExecList *L, const BatchItem *it, int n) {
    CkArgs *args = malloc(sizeof *args * (size_t)n);
    unsigned *first = malloc(sizeof *first * (size_t)(n + 1));
    bool ok = args && first;
    for (int k = 0; ok && k < it[0].plan->n_launch; k++) {
        const CuLaunch *l0 = &it[0].plan->launch[k];
        uint64_t total = 0;
        for (int j = 0; ok && j < n; j++) {
            const CuLaunch *l = &it[j].plan->launch[k];
            ok = exec_resolve(e, l, &args[j], it[j].scratch);
            first[j] = (unsigned)total;
            args[j].grid_base = (unsigned)total;
            args[j].grid_size = l->grid[0];
            total += l->grid[0];
        }
        first[n] = (unsigned)total;
        if (ok && total >= (1u << 31)) {
            rt_error("CUDA executor: a batched launch of %s needs %llu blocks", l0->fn, (unsigned long long)total);
            ok = false;
        }
        ExecLaunch x;
        memset(&x, 0, sizeof x);
        x.kind = CU_KERNEL;
        x.node = it[0].node;
        x.fn = arena_printf(e->arena, "batch_%s", l0->fn);
        x.grid[0] = (unsigned)total;
        x.grid[1] = 1;
        x.block = l0->block;
        x.smem = l0->smem;
        x.batched = true;
        x.batch.n = n;
        CUdeviceptr a_dev = 0, f_dev = 0;
        ok = ok && exec_get_function(e, it[0].node, x.fn, x.smem, &x.f) &&
             aux_take(e, args, (int64_t)sizeof *args * n, &a_dev) &&
             aux_take(e, first, (int64_t)sizeof *first * (n + 1), &f_dev);
        x.batch.args = (const CkArgs *)(uintptr_t)a_dev;
        x.batch.first = (const unsigned *)(uintptr_t)f_dev;
        ok = ok && list_push(L, &x);
    }
    free(args);
    free(first);
    return ok;
}

/* the run of nodes that starts at index i, each with scratch of its own in aux */
bool exec_add_run(CudaExec *e, ExecList *L, int i) {
    int n = 0;
    BatchItem *it = malloc(sizeof *it * (size_t)e->batch_run[i]);
    bool ok = it != NULL;
    for (int j = i; ok && j < i + e->batch_run[i]; j++) {
        if (!e->plans[j].n_launch) continue;
        it[n] = (BatchItem){e->g->nodes[j], &e->plans[j], 0};
        ok = aux_take(e, NULL, e->plans[j].scratch_bytes, &it[n].scratch);
        n++;
    }
    ok = ok && exec_add_batch(e, L, it, n);
    free(it);
    return ok;
}

/* the node a failed launch was for, after the library's own line */
