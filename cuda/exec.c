/* exec.c — the CUDA executor: the plan's arenas on the device and each phase as a graph.
 *
 * Memory is two allocations, as the memory plan says (llm.c, ggml-alloc): the persistent
 * arena and the step arena, whose tail holds the backend's workspace — cuBLASLt's workspace,
 * the scratch the node plans ask for (one region, reused by every node, since nodes run one
 * after another on one stream), and the pointer tables and flags the launches read. Free
 * memory is checked before anything is allocated, and a plan that does not fit gets one line
 * with the numbers. Every tensor keeps its arena offset on the device, so the host arenas
 * mirror the device ones byte for byte and moving a tensor is one copy at the same offset.
 *
 * Each phase of the step (evaluation: the forward nodes; a micro-step: forward and backward
 * in schedule order; the update) is a list of launches built once: library kernels with their
 * argument blocks resolved to device pointers, and cuBLASLt matmuls whose algorithms were
 * chosen at set-up: the algorithms of a tuning record where the artifact holds one, else the
 * heuristic's first choice, so that two runs of one binary multiply alike (FP8C_CUDA_TUNE=1
 * times the heuristic's candidates on the arenas before they are filled, once per shape, and
 * may pick differently from run to run). A GEMM whose fuse group its epilogue
 * computes replaces the group's adds (spec_fuse.c's cuda_plan_epilogues); one launch runs a run of
 * small update nodes (batched launches, below). The first run of a phase captures the list in
 * a CUDA graph; later runs replay it, so a step costs a handful of driver calls however many kernels
 * it has. Inputs change between runs only in their bytes (the arenas never move), which is
 * what makes replay valid. FP8C_CUDA_GRAPHS=0 launches directly; FP8C_CUDA_SYNC=1 also
 * synchronizes after every launch and names the node of the first failing one.
 *
 * This file sets the executor up and runs the lists; the matmuls and their algorithms are in
 * exec_gemm.c, batched launches in exec_batch.c, the gradient sums of a data-parallel run in
 * exec_comm.c, its sharded optimizer state (--shard-states) in exec_shard.c, its sharded
 * gradients (=2) in exec_grads.c, its sharded weights (=3) in exec_gather.c, and kernel-IR
 * programs (tests) in exec_cg.c;
 * exec_internal.h holds what they share. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "exec_internal.h"

/* room for one more item in a growing array of n items (capacity *cap, doubled when full) */
bool grow(void **items, int *cap, int n, size_t size) {
    if (n < *cap) return true;
    int more = *cap ? 2 * *cap : 64;
    void *grown = realloc(*items, size * (size_t)more);
    if (!grown) return false;
    *items = grown;
    *cap = more;
    return true;
}

bool env_flag(const char *name, bool dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    return strcmp(v, "0") != 0;
}

/* ---------------------------------------------------------------- pointers */

/* The device address of host mirror bytes p (inside one of the host arenas). */
static bool exec_map(const CudaExec *e, const void *p, CUdeviceptr *out) {
    const char *c = p;
    const char *hp = e->host.persistent, *hs = e->host.step;
    if (!p) {
        *out = 0;
        return true;
    }
    if (hp && c >= hp && c <= hp + e->host.persistent_bytes) {
        /* --shard-states: the device holds this rank's shards only (exec_shard.c); =2: the
         * micro-step writes the gradients into bucket buffers (exec_grads.c) */
        if (e->shard_grads && exec_grads_map(e, c - hp, out)) return true;
        *out = e->shard ? exec_shard_map(e, c - hp) : e->persistent + (CUdeviceptr)(c - hp);
        return true;
    }
    if (hs && c >= hs && c <= hs + e->host.step_bytes) {
        *out = e->step + (CUdeviceptr)(c - hs);
        return true;
    }
    return false;
}

bool exec_map_tensor(const CudaExec *e, const Tensor *t, CUdeviceptr *out) {
    /* --shard-states=3: a gathered weight read by the forward or backward is in a layer
     * buffer while its gather holds it (exec_gather.c) */
    if (e->shard_weights && exec_gather_map(e, t, out)) return true;
    if (exec_map(e, t->data, out)) return true;
    rt_error("CUDA executor: tensor '%s' is not in the plan's arenas", t->name ? t->name : "unnamed");
    return false;
}

/* The slot of RoPE's table for launch l's (T, head_dim, theta), found or added; -1 when
 * EXEC_ROPE_TABLES are taken. */
static int rope_slot(CudaExec *e, const CuLaunch *l) {
    int64_t T = l->args.i[3], D = l->args.i[0];
    double theta = l->args.f[0];
    for (int k = 0; k < e->n_rope; k++)
        if (e->rope[k].T == T && e->rope[k].D == D && e->rope[k].theta == theta) return k;
    if (e->n_rope == EXEC_ROPE_TABLES) return -1;
    e->rope[e->n_rope].T = T, e->rope[e->n_rope].D = D, e->rope[e->n_rope].theta = theta;
    e->rope[e->n_rope].at = 0;
    return e->n_rope++;
}

/* the bytes of the (T, head_dim / 2) table of (cos, sin) in f64 */
static int64_t rope_table_bytes(int64_t T, int64_t head_dim) { return 2 * (int64_t)sizeof(double) * T * (head_dim / 2); }

/* RoPE's table for launch l, in aux: made on the host the first time (ir_rope_table, the
 * reference executor's values), then shared. 0 on failure. */
static CUdeviceptr rope_table(CudaExec *e, const CuLaunch *l) {
    int k = rope_slot(e, l);
    if (k < 0) {
        rt_error("CUDA executor: more than %d RoPE tables", EXEC_ROPE_TABLES);
        return 0;
    }
    if (e->rope[k].at) return e->rope[k].at;
    int64_t T = e->rope[k].T, D = e->rope[k].D, bytes = rope_table_bytes(T, D);
    double *tab = malloc((size_t)bytes);
    if (!tab) {
        rt_error("CUDA executor: out of host memory for a RoPE table");
        return 0;
    }
    ir_rope_table(T, D, e->rope[k].theta, tab);
    CUdeviceptr at = 0;
    bool ok = aux_take(e, tab, bytes, &at);
    free(tab);
    return ok ? (e->rope[k].at = at) : 0;
}

bool exec_resolve(CudaExec *e, const CuLaunch *l, CkArgs *a, CUdeviceptr scratch_base) {
    *a = l->args;
    for (int k = 0; k < CK_MAX_TENSORS; k++) {
        const CuRef *r = &l->ref[k];
        CUdeviceptr p = 0;
        if (r->node) {
            if (!exec_map_tensor(e, &r->node->t, &p)) return false;
            if (l->ref_scale[k]) {
                CUdeviceptr s;
                if (!exec_map_tensor(e, &r->node->t.fmt.scale->t, &s)) return false;
                a->t[k].s = (const void *)(uintptr_t)s;
            }
        } else if (r->scratch >= 0) {
            p = scratch_base + (CUdeviceptr)r->scratch;
        }
        a->t[k].p = (void *)(uintptr_t)p;
    }
    a->scratch = l->scratch >= 0 ? (void *)(uintptr_t)(scratch_base + (CUdeviceptr)l->scratch) : NULL;
    if (l->rope_table && !(a->scratch = (void *)(uintptr_t)rope_table(e, l))) return false;
    a->ticket = (unsigned *)(uintptr_t)(e->aux + (CUdeviceptr)e->ticket_off);
    if (l->check_flag) a->t[2].p = (void *)(uintptr_t)(e->aux + (CUdeviceptr)e->finite_flag_off);
    if (l->scale_to) {
        CUdeviceptr p = 0;
        if (!exec_map_tensor(e, &l->scale_to->t, &p)) return false;
        a->scale_to = (float *)(uintptr_t)p;
    }
    if (l->scale_amax) {
        CUdeviceptr p = 0;
        if (!exec_map_tensor(e, &l->scale_amax->t, &p)) return false;
        a->scale_amax = (const float *)(uintptr_t)p;
    }
    return true;
}

CUdeviceptr ref_ptr(CudaExec *e, const CuRef *r, bool *ok) {
    CUdeviceptr p = 0;
    if (r->node) {
        *ok &= exec_map_tensor(e, &r->node->t, &p);
        p += (CUdeviceptr)r->offset;
    } else {
        p = e->scratch + (CUdeviceptr)r->scratch;
    }
    return p;
}

/* ---------------------------------------------------------------- launch lists */

bool list_push(ExecList *L, ExecLaunch *x) {
    if (!grow((void **)&L->l, &L->cap, L->n, sizeof *L->l)) return false;
    L->l[L->n++] = *x;
    return true;
}

/* bytes of aux for the launches' tables (copied from host when given) */
bool aux_take(CudaExec *e, const void *host, int64_t bytes, CUdeviceptr *out) {
    if (e->aux_used + bytes > e->aux_bytes) {
        rt_error("CUDA executor: pointer tables overflow the workspace");
        return false;
    }
    *out = e->aux + (CUdeviceptr)e->aux_used;
    e->aux_used = align_up(e->aux_used + bytes);
    return !host || !bytes || CU_CHECK(CU(cuMemcpyHtoD_v2)(*out, host, (size_t)bytes));
}

bool exec_get_function(CudaExec *e, const Node *n, const char *fn, unsigned smem, CUfunction *f) {
    /* the kernel is in one of the modules: a miss in the others is not an error */
    CUresult r = CUDA_ERROR_NOT_FOUND;
    for (int k = 0; k < e->n_modules && r == CUDA_ERROR_NOT_FOUND; k++) r = CU(cuModuleGetFunction)(f, e->modules[k], fn);
    if (!CU_CHECK(r)) {
        rt_error("the binary's GPU module has no kernel %s for %s %%%d: rebuild it with this fp8c",
                 fn, ir_op_info(n->op)->text, n->id);
        return false;
    }
    /* the dynamic shared memory a launch may ask for: by default 48 KiB less the kernel's
     * static shared memory; raised (never lowered: launches of one kernel may ask for
     * different sizes, a norm's by its row length) where this launch asks for more */
    if (!smem) return true;
    int most = 0;
    if (!CU_CHECK(CU(cuFuncGetAttribute)(&most, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, *f))) return false;
    return (int)smem <= most ||
           CU_CHECK(CU(cuFuncSetAttribute)(*f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem));
}

/* The TMA tensor maps launch l's kernel reads its operands t[tma_first ..] through (CuLaunch.tma):
 * made by the driver on the host from the operands' device addresses, then kept in aux, where
 * args.tmaps points. Each is a 3-D bf16 view, the row width (elements), T rows a batch and B
 * batches, read in boxes of 64 x 64 (a row of 128 bytes) with the 128-byte swizzle, so that
 * rows past T come in as zeros and a box lands in shared memory in the layout wgmma's
 * descriptors name (attn_ws.cuh). */
static bool exec_tensor_maps(CudaExec *e, const CuLaunch *l, CkArgs *a) {
    CUtensorMap maps[4];
    if (l->tma > (int)(sizeof maps / sizeof *maps)) {
        rt_error("CUDA executor: a launch asks for %d tensor maps", l->tma);
        return false;
    }
    cuuint64_t B = (cuuint64_t)a->i[0], T = (cuuint64_t)a->i[1];
    for (int k = 0; k < l->tma; k++) {
        cuuint64_t width = (cuuint64_t)a->i[l->tma_stride + 2 * k];
        cuuint64_t dims[3] = {width, T, B}, strides[2] = {width * 2, T * width * 2};
        cuuint32_t box[3] = {64, 64, 1}, step[3] = {1, 1, 1};
        if (!CU_CHECK(CU(cuTensorMapEncodeTiled)(&maps[k], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, a->t[l->tma_first + k].p,
                                                  dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)))
            return false;
    }
    CUdeviceptr at = 0;
    if (!aux_take(e, maps, (int64_t)sizeof *maps * l->tma, &at)) return false;
    a->tmaps = (const void *)(uintptr_t)at;
    return true;
}

static bool exec_prepare_launch(CudaExec *e, const Node *n, const CuLaunch *l, ExecLaunch *x) {
    memset(x, 0, sizeof *x);
    x->kind = l->kind;
    x->node = n;
    x->fn = l->fn;
    if (l->kind == CU_GEMM) return exec_setup_gemm(e, l, x, NULL);
    if (!exec_get_function(e, n, l->fn, l->smem, &x->f)) return false;
    x->grid[0] = l->grid[0];
    x->grid[1] = l->grid[1];
    if (l->per_sm && e->sms > 0 && (uint64_t)e->sms * l->per_sm < x->grid[0]) x->grid[0] = (unsigned)e->sms * l->per_sm;
    x->block = l->block;
    x->smem = l->smem;
    if (!exec_resolve(e, l, &x->args, e->scratch)) return false;
    for (int k = 0; k < l->n_inv; k++) {   /* the later GEMMs' dequantization scales */
        for (int j = 0; j < 2; j++) {
            const Node *s = l->inv_from[2 * k + j];
            CUdeviceptr p = 0;
            if (s && !exec_map_tensor(e, &s->t, &p)) return false;
            x->args.inv_from[2 * k + j] = (const float *)(uintptr_t)p;
        }
        x->args.inv_to[k] = (float *)(uintptr_t)(e->descales + (CUdeviceptr)l->inv_slot[k]);
    }
    if (l->tma && !exec_tensor_maps(e, l, &x->args)) return false;
    if (l->table) {
        /* the scalar inputs' device addresses, in aux */
        int count = n->n_in - 1;
        CUdeviceptr *ptrs = malloc(sizeof *ptrs * (size_t)(count ? count : 1));
        bool ok = ptrs != NULL;
        for (int i = 0; ok && i < count; i++) ok = exec_map_tensor(e, &n->in[1 + i]->t, &ptrs[i]);
        CUdeviceptr table = 0;
        ok = ok && aux_take(e, ptrs, (int64_t)sizeof *ptrs * count, &table);
        x->args.table = (const float *const *)(uintptr_t)table;
        free(ptrs);
        if (!ok) return false;
    }
    return true;
}

static bool exec_add_node(CudaExec *e, ExecList *L, const Node *n, const CuNodePlan *p) {
    for (int k = 0; k < p->n_launch; k++) {
        ExecLaunch x;
        if (!exec_prepare_launch(e, n, &p->launch[k], &x) || !list_push(L, &x)) return false;
    }
    return true;
}

static void exec_name_launch(const ExecLaunch *x) {
    const Node *n = x->node;
    char at[256] = "";
    if (n->loc.file && n->loc.line > 0) snprintf(at, sizeof at, " at %s:%d:%d", n->loc.file, n->loc.line, n->loc.col);
    rt_error("  in %s of %s %%%d %s%s", x->kind == CU_GEMM ? "the GEMM" : x->fn, ir_op_info(n->op)->text, n->id,
             n->t.name ? n->t.name : "", at);
}

bool exec_launch(CudaExec *e, const ExecLaunch *x) {
    if (x->kind == CU_GEMM) {
        if (!LT_CHECK(exec_run_gemm(e, x, &x->algo))) {
            exec_name_launch(x);
            return false;
        }
    } else {
        void *params[] = {x->batched ? (void *)&x->batch : (void *)&x->args};
        bool ok;
        if (e->pdl) {
            /* the kernel may start before the stream's previous launch ends: every entry point
             * waits for it first (ck_grid_wait); after other work (a copy, an event, a GEMM's
             * own kernels) the dependency is what the driver makes of it, at most a full one */
            CUlaunchAttribute attr = {.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION};
            attr.value.programmaticStreamSerializationAllowed = 1;
            CUlaunchConfig cfg = {.gridDimX = x->grid[0], .gridDimY = x->grid[1], .gridDimZ = 1,
                                  .blockDimX = x->block, .blockDimY = 1, .blockDimZ = 1,
                                  .sharedMemBytes = x->smem, .hStream = e->stream, .attrs = &attr, .numAttrs = 1};
            ok = CU_CHECK(CU(cuLaunchKernelEx)(&cfg, x->f, params, NULL));
        } else {
            ok = CU_CHECK(CU(cuLaunchKernel)(x->f, x->grid[0], x->grid[1], 1, x->block, 1, 1, x->smem, e->stream,
                                             params, NULL));
        }
        if (!ok) {
            exec_name_launch(x);
            return false;
        }
    }
    if (e->sync_each) {
        CUresult r = CU(cuStreamSynchronize)(e->stream);
        if (r != CUDA_SUCCESS) {
            const Node *n = x->node;
            cuda_check_cu(r, "cuStreamSynchronize", __FILE__, __LINE__);
            rt_error("CUDA executor: the failing launch was %s of %s %%%d %s", x->fn,
                     ir_op_info(n->op)->text, n->id, n->t.name ? n->t.name : "");
            return false;
        }
    }
    return true;
}

static void prof_add(CudaExec *e, const ExecLaunch *x, double ms) {
    char key[96];
    const char *us = strrchr(x->fn, '_');
    int len = us && x->kind == CU_KERNEL ? (int)(us - x->fn) : (int)strlen(x->fn);
    snprintf(key, sizeof key, "%-14s %.*s", ir_op_info(x->node->op)->text, len, x->fn);
    e->prof_total += ms;
    for (int i = 0; i < e->n_prof; i++)
        if (!strcmp(e->prof[i].key, key)) {
            e->prof[i].ms += ms;
            e->prof[i].calls++;
            return;
        }
    if (!grow((void **)&e->prof, &e->cap_prof, e->n_prof, sizeof *e->prof)) return;
    ProfRow *r = &e->prof[e->n_prof++];
    snprintf(r->key, sizeof r->key, "%s", key);
    r->ms = ms;
    r->calls = 1;
}

static int prof_cmp(const void *a, const void *b) {
    double x = ((const ProfRow *)a)->ms, y = ((const ProfRow *)b)->ms;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void prof_print(CudaExec *e) {
    if (!e->n_prof) return;
    qsort(e->prof, (size_t)e->n_prof, sizeof *e->prof, prof_cmp);
    fprintf(stderr, "GPU profile (FP8C_CUDA_PROFILE): %.1f ms in kernels and GEMMs\n", e->prof_total);
    fprintf(stderr, "  %%     ms  calls  op / kernel\n");
    for (int i = 0; i < e->n_prof && i < 30; i++)
        fprintf(stderr, "%5.1f %8.2f %6ld  %s\n", 100 * e->prof[i].ms / e->prof_total, e->prof[i].ms,
                e->prof[i].calls, e->prof[i].key);
}

static bool exec_run_profiled(CudaExec *e, ExecList *L) {
    CUevent ev[2];
    if (!CU_CHECK(CU(cuEventCreate)(&ev[0], 0)) || !CU_CHECK(CU(cuEventCreate)(&ev[1], 0))) return false;
    bool ok = true;
    for (int i = 0; ok && i < L->n; i++) {
        float ms = 0;
        ok = CU_CHECK(CU(cuEventRecord)(ev[0], e->stream)) && exec_launch(e, &L->l[i]) &&
             CU_CHECK(CU(cuEventRecord)(ev[1], e->stream)) && CU_CHECK(CU(cuEventSynchronize)(ev[1])) &&
             CU_CHECK(CU(cuEventElapsedTime)(&ms, ev[0], ev[1]));
        if (ok) prof_add(e, &L->l[i], ms);
        if (ok && e->trace) {
            const ExecLaunch *x = &L->l[i];
            fprintf(e->trace, "%d\t%d\t%s\t%s\t%%%d\t%s\t%.4f\n", e->trace_run, i, ir_op_info(x->node->op)->text,
                    x->fn, x->node->id, x->node->t.name ? x->node->t.name : "-", ms);
        }
    }
    e->trace_run++;
    CU(cuEventDestroy_v2)(ev[0]);
    CU(cuEventDestroy_v2)(ev[1]);
    return ok;
}

bool exec_replay(CudaExec *e, ExecList *G, bool (*launch)(CudaExec *e, void *ctx), void *ctx) {
    if (!G->captured) {
        if (!CU_CHECK(CU(cuStreamBeginCapture_v2)(e->stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)))
            return false;
        bool ok = launch(e, ctx);
        CUgraph graph = NULL;
        bool ended = CU_CHECK(CU(cuStreamEndCapture)(e->stream, &graph));
        if (!ok || !ended) return false;
        if (!CU_CHECK(CU(cuGraphInstantiateWithFlags)(&G->exec, graph, 0))) return false;
        G->graph = graph;
        G->captured = true;
    }
    return CU_CHECK(CU(cuGraphLaunch)(G->exec, e->stream));
}

static bool launch_list(CudaExec *e, void *list) {
    ExecList *L = list;
    for (int i = 0; i < L->n; i++)
        if (!exec_launch(e, &L->l[i])) return false;
    return true;
}

static bool exec_run_list(CudaExec *e, ExecList *L) {
    if (L != &e->lists[LIST_NORMS]) e->touched++;
    if (e->tune_report && L == &e->lists[LIST_MICRO] && ++e->micro_runs == GEMM_TUNE_AT_STEP)
        return exec_run_tuning(e, L);
    if (e->profile) return exec_run_profiled(e, L);
    if (!e->graphs || e->sync_each) return launch_list(e, L);
    return exec_replay(e, L, launch_list, L);
}

bool exec_finish(CudaExec *e, const char *what) {
    CUresult r = CU(cuStreamSynchronize)(e->stream);
    if (r == CUDA_SUCCESS) return true;
    cuda_check_cu(r, "cuStreamSynchronize", __FILE__, __LINE__);
    rt_error("CUDA executor: the %s failed on the GPU (FP8C_CUDA_SYNC=1 names the kernel)", what);
    return false;
}

/* ---------------------------------------------------------------- set-up */

/* A fused GEMM for which cuBLASLt has no algorithm (an epilogue it does not offer for these
 * types) goes back to its group's plain plans, each node at its own place. */
static bool exec_check_epilogues(CudaExec *e) {
    int plain = 0;
    for (int i = 0; i < e->g->n_nodes; i++) {
        CuNodePlan *p = &e->plans[i];
        bool no_algo = false;
        for (int k = 0; p->members && !no_algo && k < p->n_launch; k++) {
            if (p->launch[k].kind != CU_GEMM) continue;
            ExecLaunch x;
            memset(&x, 0, sizeof x);
            x.node = p->node;
            bool ok = exec_setup_gemm(e, &p->launch[k], &x, &no_algo);
            exec_free_gemm(&x);
            if (!ok && !no_algo) return false;
        }
        if (no_algo) {
            for (int m = 0; m < p->n_members; m++) {
                int j = p->members[m]->index;
                e->plans[j] = e->node_plans[j];   /* the root (i) is the last member */
            }
            plain++;
        } else if (p->members) {
            e->n_epilogues++;
            for (int k = 0; k < p->n_launch; k++) {
                const CuGemm *gm = &p->launch[k].gemm;
                if (p->launch[k].kind != CU_GEMM) continue;
                e->n_gelu += gm->act == CU_ACT_GELU;
                e->n_dgelu += gm->act == CU_ACT_DGELU;
                e->n_fp8_results += gm->dscale.node != NULL;
            }
        }
    }
    if (getenv("FP8C_CUDA_VERBOSE"))
        fprintf(stderr, "CUDA executor: %d GEMMs with epilogues (%d with a GELU, %d of them into its FP8 copy; "
                "%d with GELU's backward), %d left plain (no cuBLASLt algorithm)\n",
                e->n_epilogues, e->n_gelu, e->n_fp8_results, e->n_dgelu, plain);
    return true;
}

int cuda_exec_epilogues(const CudaExec *e) { return e->n_epilogues; }

void cuda_exec_gelu_epilogues(const CudaExec *e, int *gelu, int *dgelu, int *fp8_results) {
    *gelu = e->n_gelu;
    *dgelu = e->n_dgelu;
    *fp8_results = e->n_fp8_results;
}

int cuda_exec_batched_launches(const CudaExec *e) {
    int n = 0;
    for (int k = 0; k < LIST_COUNT; k++)
        for (int i = 0; i < e->lists[k].n; i++) n += e->lists[k].l[i].batched;
    return n;
}

int cuda_exec_reductions(const CudaExec *e) { return e->n_reduce; }

static void fmt_gib(char *out, size_t len, int64_t bytes) {
    snprintf(out, len, "%.2f GiB", (double)bytes / (1 << 30));
}

/* the seconds since *since, which becomes now (cuda_exec_open's set-up times) */
static double exec_lap_s(double *since) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    double now = (double)t.tv_sec + 1e-9 * (double)t.tv_nsec, d = now - *since;
    *since = now;
    return d;
}

CudaExec *cuda_exec_open(Graph *g, const RtMemory *host, const void *cubin, size_t cubin_size) {
    char why[512];
    if (!cuda_load(why, sizeof why)) {
        rt_error("--device cuda: %s", why);
        return NULL;
    }
    CudaExec *e = calloc(1, sizeof *e);
    int *micro_end = NULL;
    if (!e) return NULL;
    double lap = 0;
    exec_lap_s(&lap);
    e->g = g;
    e->host = *host;
    e->arena = arena_new();
    e->graphs = env_flag("FP8C_CUDA_GRAPHS", true);
    e->sync_each = env_flag("FP8C_CUDA_SYNC", false);
    e->profile = env_flag("FP8C_CUDA_PROFILE", false);
    const char *trace = getenv("FP8C_CUDA_TRACE");   /* a file: each launch of each run, timed */
    if (trace && *trace) {
        if (!(e->trace = fopen(trace, "w"))) {
            rt_error("FP8C_CUDA_TRACE: cannot write %s", trace);
            goto fail;
        }
        e->profile = true;
    }
    /* timed or synchronized launches stay whole: a launch that starts early would blur both */
    e->pdl = ir_choice_int(g, "cuda.pdl", 0) == 1 && !e->profile && !e->sync_each;
    /* the gradient GEMMs' accumulation is the binary's (cuda.grad_fast_accum), not the
     * environment's: say so to whoever still sets the variable that chose it */
    if (getenv("FP8C_CUDA_FAST_ACCUM"))
        rt_note("FP8C_CUDA_FAST_ACCUM is no longer read: the gradient GEMMs' fast accumulation is "
                "built in with --choice cuda.grad_fast_accum=1 (docs/tuning.md)");
    if (!CU_CHECK(CU(cuDeviceGet)(&e->dev, cuda_device_ordinal())) || !CU_CHECK(CU(cuDevicePrimaryCtxRetain)(&e->ctx, e->dev)))
        goto fail;
    e->have_ctx = true;
    if (!CU_CHECK(CU(cuCtxSetCurrent)(e->ctx))) goto fail;
    CU(cuDeviceGetName)(e->name, sizeof e->name, e->dev);
    int major = 0, minor = 0;
    CU(cuDeviceGetAttribute)(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, e->dev);
    CU(cuDeviceGetAttribute)(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, e->dev);
    CU(cuDeviceGetAttribute)(&e->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, e->dev);
    if (major != 9 || minor != 0) {
        rt_error("--device cuda: %s has compute capability %d.%d; the kernels are built for "
                 "sm_90a (H100, H200)", e->name, major, minor);
        goto fail;
    }

    /* every node's plan first: a node the GPU cannot run stops here, before any allocation */
    e->node_plans = cuda_plan_graph(g, e->arena, why, sizeof why);
    if (!e->node_plans) {
        rt_error("--device cuda: the GPU backend cannot run %s", why);
        goto fail;
    }
    /* the GEMM epilogues the build planned (the choice fuse.gemm_epilogues, written into the
     * artifact): the same plan as the module was rendered from */
    e->plans = cuda_plan_epilogues(g, e->node_plans, e->arena);
    for (int i = 0; i < g->n_nodes; i++) {
        if (e->plans[i].scratch_bytes > e->scratch_bytes) e->scratch_bytes = e->plans[i].scratch_bytes;
        if (e->node_plans[i].scratch_bytes > e->scratch_bytes) e->scratch_bytes = e->node_plans[i].scratch_bytes;
        const CuNodePlan *alone = e->plans[i].alone;
        if (alone && alone->scratch_bytes > e->scratch_bytes) e->scratch_bytes = alone->scratch_bytes;
    }
    e->descale_bytes = cuda_plan_descale_bytes(g, e->plans);
    int n_tables = 0;
    int64_t rope_bytes = 0;
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < e->plans[i].n_launch; k++) {
            const CuLaunch *l = &e->plans[i].launch[k];
            if (l->table) n_tables += g->nodes[i]->n_in;
            n_tables += 16 * l->tma;   /* TMA tensor maps: 128 bytes each, room for 256 */
        }
    for (int i = 0; i < g->n_nodes; i++)   /* RoPE's tables, one per (T, head_dim, theta) */
        for (int k = 0; k < e->node_plans[i].n_launch; k++) {
            const CuLaunch *l = &e->node_plans[i].launch[k];
            int had = e->n_rope, slot = l->rope_table ? rope_slot(e, l) : had;
            if (slot < 0) {
                rt_error("--device cuda: the graph's RoPEs need more than %d tables", EXEC_ROPE_TABLES);
                goto fail;
            }
            if (e->n_rope > had) rope_bytes += align_up(rope_table_bytes(l->args.i[3], l->args.i[0]));
        }
    /* the phases' tables, and as much again for nodes run one at a time (tests) */
    e->aux_bytes = align_up(ALIGN + 16 * (int64_t)n_tables + ALIGN * 64) + align_up(e->descale_bytes) + rope_bytes;
    int64_t batch_aux = exec_find_batches(e);
    if (batch_aux < 0) goto fail;
    /* and the batched finite checks of the gradients */
    int n_grads = 0;
    for (int i = 0; i < g->n_nodes; i++) n_grads += g->nodes[i]->t.role == ROLE_GRAD;
    e->aux_bytes += batch_aux + batch_aux_bytes(1, n_grads);

    /* memory: check, then one allocation per arena (with --shard-states on several ranks the
     * persistent one holds this rank's shards of the states and masters: exec_shard.c) */
    e->persistent_alloc = exec_shard_layout(e, cuda_nccl_active() ? cuda_nccl_world() : 1, cuda_nccl_rank());
    if (e->persistent_alloc < 0) goto fail;
    e->aux_bytes += align_up(8 * e->n_norm_chunks);   /* the sharded norm's chunk sums */
    int64_t grad_buf_bytes = exec_grads_layout(e);   /* --shard-states=2: the bucket buffers */
    if (grad_buf_bytes < 0) goto fail;
    int64_t gather_buf_bytes = exec_gather_layout(e);   /* --shard-states=3: the layer buffers */
    if (gather_buf_bytes < 0) goto fail;
    int64_t step_bytes = align_up(host->step_bytes);
    int64_t ws_bytes = CUBLAS_WORKSPACE + align_up(e->scratch_bytes) + align_up(e->aux_bytes) + align_up(grad_buf_bytes) +
                       align_up(gather_buf_bytes);
    e->step_alloc = step_bytes + ws_bytes;
    int64_t need = align_up(e->persistent_alloc) + e->step_alloc;
    size_t free_b = 0, total_b = 0;
    if (!CU_CHECK(CU(cuMemGetInfo_v2)(&free_b, &total_b))) goto fail;
    if (need > (int64_t)free_b) {
        char a[32], b[32], c[32], d[32], f[32], t[32];
        fmt_gib(a, sizeof a, need);
        fmt_gib(b, sizeof b, e->persistent_alloc);
        fmt_gib(c, sizeof c, host->step_bytes);
        fmt_gib(d, sizeof d, ws_bytes);
        fmt_gib(f, sizeof f, (int64_t)free_b);
        fmt_gib(t, sizeof t, (int64_t)total_b);
        rt_error("--device cuda: the plan needs %s on the GPU (persistent %s + step peak %s + "
                 "workspace %s), but %s has %s free of %s", a, b, c, d, e->name, f, t);
        goto fail;
    }
    if (!CU_CHECK(CU(cuMemAlloc_v2)(&e->persistent, (size_t)(e->persistent_alloc ? e->persistent_alloc : ALIGN))) ||
        !CU_CHECK(CU(cuMemAlloc_v2)(&e->step, (size_t)e->step_alloc)))
        goto fail;
    e->cublas_ws = e->step + (CUdeviceptr)step_bytes;
    e->scratch = e->cublas_ws + CUBLAS_WORKSPACE;
    e->aux = e->scratch + (CUdeviceptr)align_up(e->scratch_bytes);
    e->grad_buf = e->aux + (CUdeviceptr)align_up(e->aux_bytes);
    e->gather_buf = e->grad_buf + (CUdeviceptr)align_up(grad_buf_bytes);
    e->finite_flag_off = 0;
    e->norms_check = -1;
    e->ticket_off = 64;
    e->aux_used = ALIGN;
    if (e->descale_bytes && !aux_take(e, NULL, e->descale_bytes, &e->descales)) goto fail;
    if (e->n_norm_chunks && !aux_take(e, NULL, 8 * e->n_norm_chunks, &e->norm_chunks)) goto fail;

    if (!CU_CHECK(CU(cuStreamCreate)(&e->stream, CU_STREAM_DEFAULT))) goto fail;
    if (!CU_CHECK(CU(cuMemsetD8Async)(e->aux, 0, ALIGN, e->stream))) goto fail;   /* flag, ticket */
    if (!cubin_size) {
        rt_error("--device cuda: this binary carries no GPU kernels (built without NVRTC)");
        goto fail;
    }
    e->setup_s[0] = exec_lap_s(&lap);
    const void *cubins[CUDA_MAX_MODULES];
    size_t cubin_sizes[CUDA_MAX_MODULES];
    int n_cubins = cuda_module_set_split(cubin, cubin_size, cubins, cubin_sizes, CUDA_MAX_MODULES);
    if (n_cubins < 1) {
        rt_error("--device cuda: this binary's GPU kernels are damaged (a set of modules cut short)");
        goto fail;
    }
    for (; e->n_modules < n_cubins; e->n_modules++)
        if (!CU_CHECK(CU(cuModuleLoadData)(&e->modules[e->n_modules], cubins[e->n_modules]))) goto fail;
    if (!LT_CHECK(CU(cublasLtCreate)(&e->lt))) goto fail;
    e->have_lt = true;
    e->setup_s[1] = exec_lap_s(&lap);
    cuda_device_description(e->desc, sizeof e->desc);
    const char *report = getenv("FP8C_TUNE_GEMMS");
    e->tune_report = report && *report ? report : NULL;

    if (!exec_check_epilogues(e)) goto fail;
    /* the launch lists: evaluation, micro-step, update; then the gradient checks */
    bool batches = env_flag("FP8C_CUDA_BATCH", true);
    e->tune = env_flag("FP8C_CUDA_TUNE", false);   /* timing may pick differently each run */
    const char *tuned_on = ir_choice(g, "tune.device");
    if (tuned_on) {   /* a tuned binary: its algorithms, and no timing */
        char fp[17];
        ir_fingerprint(e->desc, fp);
        e->tune = false;
        e->stored_algos = !strcmp(fp, tuned_on);
        if (!e->stored_algos)
            rt_note("this binary was tuned on another GPU (or driver, or cuBLASLt) than %s: its GEMMs run "
                    "the heuristic's first algorithm", e->desc);
    }
    /* (micro_end[i]: the micro-step's launches up to node i's, where a bucket of the gradient
     * sums may leave: exec_comm.c) */
    micro_end = calloc((size_t)(g->n_nodes ? g->n_nodes : 1), sizeof *micro_end);
    if (!micro_end) goto fail;
    bool norms_lead = !e->shard;   /* the update's SQNORMs so far lead it (LIST_NORMS) */
    e->norm_nodes = arena_alloc(e->arena, sizeof *e->norm_nodes * (size_t)(g->n_nodes ? g->n_nodes : 1));
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        micro_end[i] = e->lists[LIST_MICRO].n;
        /* a forward whose work its backward does in the micro-step runs its own launches here */
        const CuNodePlan *eval = e->plans[i].alone ? e->plans[i].alone : &e->plans[i];
        /* --shard-states=3: the lists read gathered weights in the layer buffers (exec_gather.c) */
        bool gathered = exec_gather_at(e, GATHER_EVAL, i, e->lists[LIST_EVAL].n);   /* its work the gather's */
        if (n->phase == PHASE_FORWARD && !gathered && !exec_add_node(e, &e->lists[LIST_EVAL], n, eval)) goto fail;
        gathered = exec_gather_at(e, GATHER_MICRO, i, e->lists[LIST_MICRO].n);
        if (!e->plans[i].n_launch) continue;
        e->map_grads = e->shard_grads;   /* the micro-step writes the bucket buffers */
        bool added = n->phase == PHASE_UPDATE || gathered || exec_add_node(e, &e->lists[LIST_MICRO], n, &e->plans[i]);
        e->map_grads = false;
        exec_gather_at(e, -1, 0, 0);
        if (!added) goto fail;
        micro_end[i] = e->lists[LIST_MICRO].n;
        if (n->phase != PHASE_UPDATE) continue;
        /* the norms before the update's first node other than a norm or a delayed scale (which
         * reads and writes scales and amax histories only, so it may run after them); a
         * batched run is of one op */
        norms_lead = norms_lead && (n->op == OP_SQNORM || n->op == OP_DELAYED_SCALE);
        bool norm = norms_lead && n->op == OP_SQNORM;
        ExecList *U = &e->lists[norm ? LIST_NORMS : LIST_UPDATE];
        int run = batches && !e->shard ? e->batch_run[i] : 0;   /* sharded: a launch per node (exec_shard.c) */
        for (int j = i; norm && j < i + (run ? run : 1); j++)
            if (e->plans[j].n_launch) e->norm_nodes[e->n_norm_nodes++] = g->nodes[j];
        if (run) {
            if (!exec_add_run(e, U, i)) goto fail;
            i += run - 1;
        } else if (!exec_add_node(e, U, n, &e->plans[i])) {
            goto fail;
        }
    }
    /* the gradients' sums (no launches of their own: a batched run may span them), in buckets */
    if (!exec_gather_check(e) || !exec_comm_open(e, micro_end) || !exec_shard_prepare(e) ||
        !exec_grads_open(e, micro_end) || !exec_gather_open(e))
        goto fail;
    free(micro_end);
    micro_end = NULL;
    if (!exec_agree_gemms(e)) goto fail;
    e->tune = false;   /* from here on the arenas hold data */
    if (getenv("FP8C_CUDA_VERBOSE")) fprintf(stderr, "CUDA executor: %d GEMM shapes timed\n", e->n_tuned);
    if (e->n_stored_failed)
        rt_note("%d of the tuned GEMM algorithms do not check out on %s (cublasLtMatmulAlgoCheck): "
                "those GEMMs run the heuristic's first", e->n_stored_failed, e->desc);
    if (e->n_unstored)
        rt_note("%d GEMM set-ups found no tuned algorithm for their problem: they run the heuristic's first",
                e->n_unstored);
    e->setup_s[2] = exec_lap_s(&lap);
    if (!cuda_exec_push_arenas(e)) goto fail;
    e->setup_s[3] = exec_lap_s(&lap);
    return e;
fail:
    free(micro_end);
    cuda_exec_close(e);
    return NULL;
}

void cuda_exec_close(CudaExec *e) {
    if (!e) return;
    prof_print(e);
    free(e->prof);
    if (e->trace) fclose(e->trace);
    if (e->have_ctx) {
        CU(cuCtxSetCurrent)(e->ctx);
        if (e->stream) CU(cuStreamSynchronize)(e->stream);
        for (int k = 0; k < LIST_COUNT; k++) {
            ExecList *L = &e->lists[k];
            for (int i = 0; i < L->n; i++)
                if (L->l[i].kind == CU_GEMM) exec_free_gemm(&L->l[i]);
            if (L->exec) CU(cuGraphExecDestroy)(L->exec);
            if (L->graph) CU(cuGraphDestroy)(L->graph);
            free(L->l);
        }
        exec_comm_close(e);
        exec_grads_close(e);
        exec_gather_close(e);
        exec_shard_close(e);
        if (e->have_lt) CU(cublasLtDestroy)(e->lt);
        for (int k = 0; k < e->n_modules; k++) CU(cuModuleUnload)(e->modules[k]);
        if (e->stream) CU(cuStreamDestroy_v2)(e->stream);
        if (e->persistent) CU(cuMemFree_v2)(e->persistent);
        if (e->step) CU(cuMemFree_v2)(e->step);
        CU(cuDevicePrimaryCtxRelease_v2)(e->dev);
    }
    free(e->batch_run);
    free(e->tuned);
    arena_free(e->arena);
    free(e);
}

/* ---------------------------------------------------------------- running */

bool cuda_exec_run_phase(CudaExec *e, Phase p) {
    if (p == PHASE_FORWARD && e->shard_weights) return exec_gather_run_eval(e);   /* with its gathers */
    if (p == PHASE_FORWARD) return exec_run_list(e, &e->lists[LIST_EVAL]) && exec_finish(e, "forward");
    /* several ranks: the gradients' sums first (unless the last micro-step overlapped them
     * with its backward), and the whole update within the deadline */
    bool reduce = e->n_reduce && !e->reduced;
    e->reduced = false;
    if (e->shard) {   /* --shard-states: collectives inside the update (exec_shard.c) */
        cuda_nccl_arm(reduce ? "the sharded update with its gradient reduction" : "the sharded update");
        bool ok = (!reduce || exec_run_reduce(e)) && exec_shard_run_update(e) && exec_finish(e, "update");
        cuda_nccl_disarm();
        return ok;
    }
    if (reduce) cuda_nccl_arm("the update with its gradient all-reduce");
    /* the norms, unless the finite check ran them on these gradients */
    bool norms_done = e->norms_ran == e->touched + 1u;
    bool ok = (!reduce || exec_run_reduce(e)) && (norms_done || exec_run_list(e, &e->lists[LIST_NORMS])) &&
              exec_run_list(e, &e->lists[LIST_UPDATE]) && exec_finish(e, "update");
    if (reduce) cuda_nccl_disarm();
    return ok;
}

bool cuda_exec_run_micro_step(CudaExec *e) {
    if (e->shard_grads) return cuda_exec_run_last_micro_step(e);   /* each one reduced (exec_grads.c) */
    e->reduced = false;   /* a step's micro-steps: its sums are still to come */
    return exec_run_list(e, &e->lists[LIST_MICRO]) && exec_finish(e, "micro-step");
}

bool cuda_exec_run_node(CudaExec *e, const Node *n) {
    e->touched++;
    for (int i = 0; i < e->g->n_nodes; i++) {
        if (e->g->nodes[i] != n) continue;
        int64_t aux_at = e->aux_used;
        ExecList L = {0};
        const CuNodePlan *p = e->node_plans[i].alone ? e->node_plans[i].alone : &e->node_plans[i];
        bool ok = exec_add_node(e, &L, n, p);
        for (int k = 0; ok && k < L.n; k++) ok = exec_launch(e, &L.l[k]);
        ok = ok && exec_finish(e, ir_op_info(n->op)->text);
        for (int k = 0; k < L.n; k++)
            if (L.l[k].kind == CU_GEMM) exec_free_gemm(&L.l[k]);
        free(L.l);
        e->aux_used = aux_at;   /* the tables of this run are not needed again */
        return ok;
    }
    rt_error("CUDA executor: node %%%d is not in the graph", n->id);
    return false;
}

bool cuda_exec_sync(CudaExec *e) { return CU_CHECK(CU(cuStreamSynchronize)(e->stream)); }

/* the copies, piece by piece: a tensor sharded over the ranks moves this rank's shard only
 * (exec_pieces) */
static bool piece_push(CudaExec *e, char *host, CUdeviceptr dev, int64_t bytes, void *ctx) {
    (void)e, (void)ctx;
    return CU_CHECK(CU(cuMemcpyHtoD_v2)(dev, host, (size_t)bytes));
}
static bool piece_pull(CudaExec *e, char *host, CUdeviceptr dev, int64_t bytes, void *ctx) {
    (void)e, (void)ctx;
    return CU_CHECK(CU(cuMemcpyDtoH_v2)(host, dev, (size_t)bytes));
}
static bool piece_zero(CudaExec *e, char *host, CUdeviceptr dev, int64_t bytes, void *ctx) {
    (void)host, (void)ctx;
    return CU_CHECK(CU(cuMemsetD8Async)(dev, 0, (size_t)bytes, e->stream));
}

bool cuda_exec_push(CudaExec *e, Tensor *const *ts, int n) {
    e->touched++;
    if (!cuda_exec_sync(e)) return false;
    for (int i = 0; i < n; i++)
        if (!exec_pieces(e, ts[i]->name, ts[i]->data, tensor_bytes(ts[i]), piece_push, NULL)) return false;
    return true;
}

bool cuda_exec_pull(CudaExec *e, Tensor *const *ts, int n) {
    if (!cuda_exec_sync(e)) return false;
    for (int i = 0; i < n; i++)
        if (!exec_pieces(e, ts[i]->name, ts[i]->data, tensor_bytes(ts[i]), piece_pull, NULL)) return false;
    return true;
}

bool cuda_exec_push_arenas(CudaExec *e) {
    e->touched++;
    if (!cuda_exec_sync(e)) return false;
    if (e->host.persistent_bytes && !exec_pieces(e, "the persistent arena", e->host.persistent, e->host.persistent_bytes, piece_push, NULL))
        return false;
    /* a blank step arena is zeroed here rather than copied: Llama 1.1B's 11 GiB at batch 4 x
     * 2048 crossed PCIe from pages that reading first had to map */
    if (e->host.step_bytes && e->host.step_blank)
        return CU_CHECK(CU(cuMemsetD8Async)(e->step, 0, (size_t)e->host.step_bytes, e->stream)) && cuda_exec_sync(e);
    if (e->host.step_bytes && !CU_CHECK(CU(cuMemcpyHtoD_v2)(e->step, e->host.step, (size_t)e->host.step_bytes)))
        return false;
    return true;
}

bool cuda_exec_zero(CudaExec *e, Tensor *const *ts, int n) {
    e->touched++;
    for (int i = 0; i < n; i++)
        if (!exec_pieces(e, ts[i]->name, ts[i]->data, tensor_bytes(ts[i]), piece_zero, NULL)) return false;
    return cuda_exec_sync(e);
}

/* Whether the SQNORMs of LIST_NORMS (cuda_exec_open's norm_nodes) read exactly the storage of
 * ts, each tensor once: then their sums are the tensors' finite check. */
static bool norms_cover(CudaExec *e, Tensor *const *ts, int n) {
    CUdeviceptr *want = malloc(sizeof *want * (size_t)(n ? n : 1));
    bool *seen = calloc((size_t)(n ? n : 1), sizeof *seen);
    bool ok = want && seen && e->n_norm_nodes == n;
    for (int i = 0; ok && i < n; i++) ok = exec_map_tensor(e, ts[i], &want[i]);
    for (int k = 0; ok && k < e->n_norm_nodes; k++) {
        const Node *x = e->norm_nodes[k];
        CUdeviceptr p;
        int at = -1;
        ok = exec_map_tensor(e, &x->in[0]->t, &p);
        for (int i = 0; ok && i < n && at < 0; i++)
            if (want[i] == p && tensor_bytes(ts[i]) == tensor_bytes(&x->in[0]->t)) at = i;
        ok = ok && at >= 0 && !seen[at];
        if (ok) seen[at] = true;
    }
    free(want);
    free(seen);
    return ok;
}

/* The checks of all tensors into one flag. On one GPU, where the update's gradient norms read
 * exactly these tensors, the check runs them (LIST_NORMS: their f64 sums are finite exactly
 * when every element is, ck_sqnorm_final) and the update that follows does not run them
 * again: one pass over the gradients fewer a step (Llama 1.1B: 2.2 GB). Otherwise the
 * checks of their own (ck_all_finite), batched where they share a kernel; that list is built
 * (and captured) for the first set of tensors asked about, which is the training loop's
 * gradient list every step. */
bool cuda_exec_all_finite(CudaExec *e, Tensor *const *ts, int n, bool *finite) {
    ExecList *L = &e->lists[LIST_FINITE];
    CUdeviceptr flag = e->aux + (CUdeviceptr)e->finite_flag_off;
    if (e->norms_check < 0) e->norms_check = !e->shard && !e->n_reduce && n && norms_cover(e, ts, n);
    if (e->norms_check) {
        int bad = 0;
        if (!CU_CHECK(CU(cuMemsetD8Async)(flag, 0, sizeof bad, e->stream)) ||
            !exec_run_list(e, &e->lists[LIST_NORMS]) || !exec_finish(e, "gradient check") ||
            !CU_CHECK(CU(cuMemcpyDtoH_v2)(&bad, flag, sizeof bad)))
            return false;
        e->norms_ran = e->touched + 1u;
        *finite = bad == 0;
        return true;
    }
    if (!L->n && n) {
        CuNodePlan *plans = arena_alloc(e->arena, sizeof *plans * (size_t)n);
        BatchItem *it = malloc(sizeof *it * (size_t)n);
        if (!it) return false;
        bool ok = true;
        for (int i = 0; ok && i < n; i++) {
            const Node *node = NULL;
            for (int k = 0; k < e->g->n_nodes && !node; k++)
                if (&e->g->nodes[k]->t == ts[i]) node = e->g->nodes[k];
            if (!node || !cuda_plan_finite(node, e->arena, &plans[i])) {
                rt_error("CUDA executor: cannot check tensor '%s' for non-finite values",
                         ts[i]->name ? ts[i]->name : "unnamed");
                ok = false;
            }
            it[i] = (BatchItem){node, &plans[i], flag};
        }
        /* the checks only read their tensors: any run of one kernel can be batched (but with
         * --shard-states=2 each checks this rank's shard of its summed gradient, below; the
         * ranks' flags are summed by the caller) */
        bool batches = env_flag("FP8C_CUDA_BATCH", true) && !e->shard_grads;
        for (int i = 0, j; ok && i < n; i = j) {
            for (j = i + 1; batches && j < n && batch_same_kernels(it[i].plan, it[j].plan);) j++;
            if (j - i >= BATCH_MIN) {
                ok = exec_add_batch(e, L, it + i, j - i);
                continue;
            }
            ExecLaunch x;
            ok = exec_prepare_launch(e, it[i].node, &plans[i].launch[0], &x) &&
                 (!e->shard_grads || exec_grads_restrict_check(e, ts[i], &x.args.t[0]));
            x.args.scratch = (void *)(uintptr_t)flag;
            ok = ok && list_push(L, &x);
        }
        free(it);
        if (!ok) return false;
    }
    int bad = 0;
    if (!CU_CHECK(CU(cuMemsetD8Async)(flag, 0, sizeof bad, e->stream)) || !exec_run_list(e, L) ||
        !exec_finish(e, "gradient check") || !CU_CHECK(CU(cuMemcpyDtoH_v2)(&bad, flag, sizeof bad)))
        return false;
    *finite = bad == 0;
    return true;
}

int64_t cuda_exec_device_bytes(const CudaExec *e) { return e->persistent_alloc + e->step_alloc; }
const char *cuda_exec_device_name(const CudaExec *e) { return e->name; }
void cuda_exec_setup_times(const CudaExec *e, double s[4]) { memcpy(s, e->setup_s, sizeof e->setup_s); }
