/* comm_buckets.c — the buckets of a data-parallel step's gradient reduction.
 *
 * The comm pass gives every gradient accumulator an ALL_REDUCE node; how the runtime hands them
 * to NCCL is decided here, once, from the graph alone, so that the plan (`fp8c plan --gpus N`)
 * and the GPU executor see the same buckets. A bucket is a run of gradients in the order the
 * backward finishes their accumulators (the position of each one's ACCUMULATE in the schedule:
 * the last layer's first), closed when it holds comm.bucket_mb MiB (25 unless the choice table
 * says otherwise) or the gradients run out. 25 MiB is PyTorch DDP's default and the reason is
 * the same: a bucket must be large enough that NCCL runs near its bandwidth (a few MiB already
 * do on NVLink), and small enough that the first one leaves while most of the backward is
 * still to run, so that only the last bucket's reduction is left after the backward.
 *
 * With comm.overlap on (the default) the executor reduces a bucket on a stream of its own as
 * soon as the last micro-step has written its last accumulator (cuda/exec_comm.c); with it off,
 * all of them run as one NCCL group at the start of the update, as before buckets existed.
 * Either way the gradients go in the same order and each is one ncclAllReduce of its own
 * tensor, so the sums are the same bits. */
#include <stdlib.h>
#include <string.h>

#include "rt.h"

#define RT_BUCKET_MB_DEFAULT 25

bool rt_comm_overlap(const Graph *g) { return ir_choice_on(g, "comm.overlap", NULL); }

int64_t rt_comm_bucket_bytes(const Graph *g) {
    int64_t mb = ir_choice_int(g, "comm.bucket_mb", RT_BUCKET_MB_DEFAULT);
    return (mb > 0 ? mb : RT_BUCKET_MB_DEFAULT) << 20;
}

static int comm_position(const Graph *g, const Node *n) {
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i] == n) return i;
    return g->n_nodes;
}

typedef struct {
    Node *reduce;
    int at;      /* its accumulator's position */
} Pending;

static int pending_cmp(const void *a, const void *b) {
    const Pending *x = a, *y = b;
    return x->at != y->at ? x->at - y->at : x->reduce->id - y->reduce->id;
}

bool rt_comm_plan(const Graph *g, RtCommPlan *p) {
    memset(p, 0, sizeof *p);
    p->cap = rt_comm_bucket_bytes(g);
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++) n += g->nodes[i]->op == OP_ALL_REDUCE;
    if (!n) return true;
    Pending *order = malloc(sizeof *order * (size_t)n);
    p->reduce = malloc(sizeof *p->reduce * (size_t)n);
    p->buckets = malloc(sizeof *p->buckets * (size_t)n);
    if (!order || !p->reduce || !p->buckets) {
        free(order);
        rt_comm_plan_free(p);
        return false;
    }
    int k = 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_ALL_REDUCE)
            order[k++] = (Pending){g->nodes[i], comm_position(g, g->nodes[i]->in[0])};
    qsort(order, (size_t)n, sizeof *order, pending_cmp);
    RtBucket *b = NULL;
    for (int i = 0; i < n; i++) {
        Node *r = order[i].reduce;
        int64_t bytes = ir_numel(&r->t) * fmt_elem_bytes(r->t.fmt.elem);
        if (!b || b->bytes >= p->cap) {
            b = &p->buckets[p->n_buckets++];
            *b = (RtBucket){.first = i};
        }
        p->reduce[i] = r;
        b->count++;
        b->bytes += bytes;
        b->elems += ir_numel(&r->t);
        p->wire = (ElemType)IR_IATTR(r, ALL_REDUCE, wire);   /* the comm pass sets one for all */
        b->last = order[i].at;   /* ascending: the last is the latest */
        p->bytes += bytes;
    }
    p->n_reduce = n;
    free(order);
    return true;
}

void rt_comm_plan_free(RtCommPlan *p) {
    free(p->reduce);
    free(p->buckets);
    memset(p, 0, sizeof *p);
}
