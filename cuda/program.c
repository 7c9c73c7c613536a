/* program.c — the GPU kernel program as a table: what `fp8c plan --kernels --device cuda` shows.
 *
 * The training binary derives its launches from the scheduled graph with cuda_plan_graph and
 * cuda_plan_epilogues (spec_fuse.c), the same calls the compiler makes to know which kernels to
 * compile; this file makes those calls once more and lists the result, so the listing is the
 * program that runs, not a description of it. One line per launch, in launch order: its phase,
 * whether it is a library kernel or a cuBLASLt GEMM, the kernel's name, the graph nodes whose
 * work it does (a GEMM with its epilogue's adds, a producer that writes its own FP8 copy, a
 * quantize that makes its scales), the bytes of the tensors it reads and writes (each once: a
 * lower bound on its memory traffic; of a producer's first pass that stores only its block
 * maxima, CkAmaxOnly, just those, and of the scale made from them, those again), and for GEMMs
 * and attention the floating-point operations
 * of their products. The update's runs of small nodes that the executor batches (exec_batch.c)
 * are one line per kernel, as they are one launch: "adamw x 580". Totals per phase close the
 * table, so a reader sees at once where a step's bytes and FLOPs are. */
#include <stdio.h>
#include <string.h>

#include "gpu.h"

/* bytes of a node's storage with its scale array, counted once per launch */
static int64_t node_bytes(const Node *n) {
    int64_t b = ir_storage_bytes(n);
    const Node *s = n->t.fmt.scale;
    if (s && s != n) b += ir_storage_bytes(s);
    return b;
}

static void add_node(const Node **seen, int *n_seen, int64_t *bytes, const Node *n) {
    if (!n) return;
    for (int i = 0; i < *n_seen; i++)
        if (seen[i] == n) return;
    seen[(*n_seen)++] = n;
    *bytes += node_bytes(n);
}

/* The products of a GEMM, 2 m n k; of an attention launch, by its tag: the forward (and the
 * backward's rerun of it for the statistics) two products per tile, the dq pass three, the
 * dk/dv pass four, over the causal half of the T x T scores. */
static double launch_flops(const CuLaunch *l) {
    if (l->kind == CU_GEMM) return 2.0 * (double)l->gemm.m * (double)l->gemm.n * (double)l->gemm.k;
    int products = !strncmp(l->fn, "attndkv_", 8) ? 4 : !strncmp(l->fn, "attndq_", 7) ? 3
                 : !strncmp(l->fn, "attn_", 5) || !strncmp(l->fn, "attnstat_", 9) ? 2 : 0;
    if (!products) return 0;
    double B = (double)l->args.i[0], T = (double)l->args.i[1], H = (double)l->args.i[2], D = (double)l->args.i[4];
    return products * 2.0 * B * H * T * (T + 1) / 2 * D;
}

/* "quantize+layernorm": the op of the plan's node, then those it absorbed or grouped */
static void fused_ops(const CuNodePlan *p, char *out, size_t len) {
    const Node *list[16];
    int n = 0;
    if (p->members)
        for (int i = 0; i < p->n_members && n < 16; i++) list[n++] = p->members[i];
    else
        list[n++] = p->node;
    for (int i = 0; i < p->n_absorbed && n < 16; i++) list[n++] = p->absorbed[i];
    size_t at = 0;
    out[0] = 0;
    for (int i = 0; i < n && at + 1 < len; i++)
        at += (size_t)snprintf(out + at, len - at, "%s%s", i ? "+" : "", ir_op_info(list[i]->op)->text);
}

typedef struct {
    int launches, gemms;
    double bytes, flops;
} PhaseTotal;

/* The bytes one launch reads and writes (each tensor once), and its kernel's name: "cublasLt",
 * or the library kernel's prefix ("adamw"). */
static int64_t launch_bytes(const CuLaunch *l, char *name, size_t len) {
    const Node *seen[CK_MAX_TENSORS + 8];
    int n_seen = 0;
    int64_t bytes = 0;
    if (l->kind == CU_GEMM) {
        const CuGemm *m = &l->gemm;
        const CuRef *r[] = {&m->a, &m->b, &m->d, &m->c, &m->bias, &m->aux};
        for (size_t q = 0; q < sizeof r / sizeof r[0]; q++) add_node(seen, &n_seen, &bytes, r[q]->node);
        snprintf(name, len, "cublasLt");
        return bytes;
    }
    /* a pass that stores only its block maxima writes those, not its result, and a scale made
     * from them reads them, not the value they are the maxima of */
    int parts = strstr(l->body, "CkAmaxOnly<") ? 0 : strstr(l->body, "ck_quant_scale_parts<") ? 1 : -1;
    if (parts >= 0 && l->ref[parts].node) {
        seen[n_seen++] = l->ref[parts].node;
        bytes += IR_AMAX_PARTS * 4;
    }
    for (int q = 0; q < CK_MAX_TENSORS; q++) add_node(seen, &n_seen, &bytes, l->ref[q].node);
    add_node(seen, &n_seen, &bytes, l->scale_to);
    add_node(seen, &n_seen, &bytes, l->scale_amax);
    const char *cut = strchr(l->fn, '_');
    snprintf(name, len, "%.*s", cut ? (int)(cut - l->fn) : (int)strlen(l->fn), l->fn);
    return bytes;
}

/* An in-place result's bytes are its accumulator's (runtime/arenas.c binds them so). */
bool cuda_plan_storage_at(const Node *x, uintptr_t *lo) {
    while (ir_op_is_inplace(x->op)) x = x->in[0];
    if (x->t.fmt.elem == FMT_VOID || x->t.offset < 0) return false;
    *lo = (ir_role_is_persistent(x->t.role) ? 0 : (uintptr_t)1 << 60) + (uintptr_t)x->t.offset;
    return true;
}

/* the graph's first ALL_REDUCE (they share one wire format) */
static const Node *cp_first_reduce(const Graph *g) {
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_ALL_REDUCE) return g->nodes[i];
    return NULL;
}

bool cuda_print_program(Graph *g, Arena *a, FILE *out, char *why, size_t why_len) {
    CuNodePlan *node_plans = cuda_plan_graph(g, a, why, why_len);
    if (!node_plans) return false;
    CuNodePlan *plans = cuda_plan_epilogues(g, node_plans, a);
    /* the executor batches the update's runs unless the states are sharded (exec.c) */
    int *run = arena_alloc(a, sizeof *run * (size_t)(g->n_nodes ? g->n_nodes : 1));
    if (rt_shard_states(g)) memset(run, 0, sizeof *run * (size_t)g->n_nodes);
    else cuda_batch_runs(g, plans, cuda_plan_storage_at, run);
    PhaseTotal total[PHASE_COUNT];
    memset(total, 0, sizeof total);
    fprintf(out, "GPU kernel program (cuda, sm_90a): one line per launch, in launch order\n");
    fprintf(out, "%6s  %-8s  %-6s  %-9s  %-44s %10s %10s\n", "#", "phase", "kind", "kernel", "computes",
            "MiB", "GFLOP");
    int k = 0, n_reduce = 0;
    double reduce_bytes = 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_ALL_REDUCE) {
            n_reduce++;
            reduce_bytes += (double)(ir_numel(&g->nodes[i]->t) * fmt_elem_bytes(g->nodes[i]->t.fmt.elem));
        }
    /* with comm.overlap the sums leave in buckets during the last micro-step (exec_comm.c) */
    RtCommPlan cp;
    memset(&cp, 0, sizeof cp);
    int *root = NULL;
    if (n_reduce && rt_comm_overlap(g) && rt_comm_plan(g, &cp) && cp.n_buckets &&
        (root = arena_alloc(a, sizeof *root * (size_t)cp.n_buckets)))
        cuda_comm_bucket_roots(g, plans, &cp, root);
    bool reduce_listed = root != NULL;
    for (int i = 0; i < g->n_nodes; i++) {
        const CuNodePlan *p = &plans[i];
        if (n_reduce && !reduce_listed && g->nodes[i]->phase == PHASE_UPDATE &&
            (p->n_launch || g->nodes[i]->op == OP_ALL_REDUCE)) {
            /* exec.c runs the sums first in the update, as one NCCL group, outside its graph */
            char what[64];
            ElemType wire = (ElemType)IR_IATTR(cp_first_reduce(g), ALL_REDUCE, wire);
            if (wire != FMT_VOID)
                snprintf(what, sizeof what, "all_reduce (%s, by bucket) x %d", fmt_elem_name(wire), n_reduce);
            else
                snprintf(what, sizeof what, "all_reduce (sum) x %d, one group", n_reduce);
            fprintf(out, "%6d  %-8s  %-6s  %-9s  %-44.44s %10.1f %10s\n", ++k, "update", "nccl", "allreduce",
                    what, reduce_bytes / (1 << 20), "-");
            total[PHASE_UPDATE].launches++;
            total[PHASE_UPDATE].bytes += reduce_bytes;
            reduce_listed = true;
        }
        if (!p->n_launch) continue;
        char ops[256], name[64];
        fused_ops(p, ops, sizeof ops);
        const Node *n = p->node ? p->node : g->nodes[i];
        Phase ph = n->phase;
        int last = run[i] ? i + run[i] - 1 : i;   /* a batched run's last node */
        if (run[i]) {
            int members = 0;   /* its nodes with launches */
            for (int m = i; m <= last; m++) members += plans[m].n_launch > 0;
            size_t at = strlen(ops);
            snprintf(ops + at, sizeof ops - at, " x %d", members);
        }
        for (int j = 0; j < p->n_launch; j++) {
            int64_t bytes = 0;
            double flops = 0;
            for (int m = i; m <= last; m++)
                if (plans[m].n_launch) {
                    bytes += launch_bytes(&plans[m].launch[j], name, sizeof name);
                    flops += launch_flops(&plans[m].launch[j]);
                }
            const CuLaunch *l = &p->launch[j];
            char gf[32] = "-";
            if (flops > 0) snprintf(gf, sizeof gf, "%.4g", flops / 1e9);
            fprintf(out, "%6d  %-8s  %-6s  %-9s  %-44.44s %10.1f %10s\n", ++k, ir_phase_name(ph),
                    l->kind == CU_GEMM ? "gemm" : "kernel", name, ops, (double)bytes / (1 << 20), gf);
            total[ph].launches++;
            total[ph].gemms += l->kind == CU_GEMM;
            total[ph].bytes += (double)bytes;
            total[ph].flops += flops;
        }
        for (int b = 0; root && b < cp.n_buckets; b++) {
            if (root[b] != i) continue;
            char what[96];
            if (cp.wire != FMT_VOID)   /* comm_fp8.c: five kernels and four collectives */
                snprintf(what, sizeof what, "bucket %d: all_reduce (%s: a2a, gather) x %d", b,
                         fmt_elem_name(cp.wire), cp.buckets[b].count);
            else
                snprintf(what, sizeof what, "bucket %d: all_reduce (sum) x %d", b, cp.buckets[b].count);
            fprintf(out, "%6d  %-8s  %-6s  %-9s  %-44.44s %10.1f %10s\n", ++k, ir_phase_name(PHASE_BACKWARD),
                    "nccl", "allreduce", what, (double)cp.buckets[b].bytes / (1 << 20), "-");
            total[PHASE_BACKWARD].launches++;
            total[PHASE_BACKWARD].bytes += (double)cp.buckets[b].bytes;
        }
        i = last;   /* past a batched run */
    }
    rt_comm_plan_free(&cp);
    fprintf(out, "\n%-8s %9s %7s %12s %12s\n", "phase", "launches", "GEMMs", "GiB moved", "TFLOP");
    for (int ph = 0; ph < PHASE_COUNT; ph++)
        fprintf(out, "%-8s %9d %7d %12.2f %12.3f\n", ir_phase_name((Phase)ph), total[ph].launches,
                total[ph].gemms, total[ph].bytes / (1 << 30), total[ph].flops / 1e12);
    return true;
}
