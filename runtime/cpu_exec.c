/* cpu_exec.c — the CPU backend's executor: compiled kernels, in schedule order.
 *
 * `fp8c build` lowered the planned graph to kernels (codegen/lower_kernels.c), compiled them
 * through LLVM and linked the object into the binary, with a table of one function pointer per
 * kernel. The binary carries the graph, not the kernel list: at start-up this file lowers the
 * graph again with the same code and checks that the result hashes to what was compiled, so
 * the kernel list, the buffers each kernel binds and the compiled code cannot drift apart (a
 * mismatch is one error line, not a wrong result).
 *
 * Running a phase is then a walk over its kernels: bind each buffer (a tensor's data, a scratch
 * array, a constant table), split the items into ranges of roughly equal work and hand them
 * to the reference executor's thread pool. A kernel's items are independent by construction
 * (codegen.h), so any split gives the same bits: results do not depend on the thread count.
 * GEMM kernels call rt_cpu_gemm_rows, which hands blocks of C's rows to the GEMM's epilogue
 * kernel (the next one) as it finishes them, so that the epilogue reads C while it is in cache.
 * An attention node alone in its group, with bf16 operands, runs on the GEMM's tile path where
 * the CPU has one (cpu_attn_tile.c) in place of its kernels: at the first of them, the others
 * skipped; reference kernels (nodes no kernel handles; the models of models/ have none) call the
 * reference executor on their nodes. */
#define _GNU_SOURCE
#include "codegen.h"
#include "ref_internal.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The table the kernel object defines (codegen/llvm.c); absent when none was linked. */
extern const uint64_t fp8c_cpu_kernel_hash __attribute__((weak));
extern const int32_t fp8c_cpu_kernel_count __attribute__((weak));
extern const RtCpuKernelFn fp8c_cpu_kernel_fns[] __attribute__((weak));

const RtCpuKernels *rt_cpu_builtin_kernels(void)
{
    static RtCpuKernels k;
    if (!&fp8c_cpu_kernel_count || !&fp8c_cpu_kernel_hash || !fp8c_cpu_kernel_fns) return NULL;
    k = (RtCpuKernels){fp8c_cpu_kernel_hash, fp8c_cpu_kernel_count, fp8c_cpu_kernel_fns};
    return &k;
}

struct RtCpuExec {
    Arena *arena;
    double *ms;                 /* FP8C_PROFILE: time per kernel, printed when freed, of
                                   every run but the first (page faults on first touch) */
    int64_t *runs;              /* runs per kernel, the first included */
    Graph *g;
    CgProgram *p;
    const RtCpuKernels *table;
    float **scratch;            /* per scratch array */
    void ***bufs;               /* per kernel: its buffer pointers (tensors refreshed per run) */
    bool *ran_with_gemm;        /* per epilogue kernel: its GEMM has run it on C's row blocks */
    signed char *attention;     /* per kernel of an attention node alone in its group: 1 the
                                   first (the tile path runs the node there), 2 the others */
};

/* Items per task: at least about WORK scalar operations each (the artifact's cpu.task_work
 * choice, then FP8C_CPU_TASK_WORK, override it), so that small kernels stay on one thread and big ones spread over all of them. */
enum { WORK = 1 << 14 };

static int64_t task_work_chosen;   /* the artifact's cpu.task_work (runtime/tune.c), 0: none */

void rt_cpu_set_task_work(int64_t w) { task_work_chosen = w; }

static int64_t task_work(void)
{
    static bool env_read;
    if (!env_read) {
        env_read = true;
        const char *s = getenv("FP8C_CPU_TASK_WORK");
        int64_t v = 0;
        if (s && (!rt_cli_int(s, &v) || v < 1)) {   /* as strict as a flag: no silent default */
            rt_error("FP8C_CPU_TASK_WORK=%s: expected a whole number of operations, 1 or more", s);
            exit(2);
        }
        if (v >= 1) task_work_chosen = v;
        else if (!task_work_chosen) task_work_chosen = WORK;
    }
    return task_work_chosen;
}

typedef struct {
    RtCpuKernelFn fn;
    void *const *bufs;
    int64_t first, items, grain;   /* items [first, first + items) */
} Launch;

static void launch_task(void *ctx, int64_t t)
{
    const Launch *l = ctx;
    int64_t lo = t * l->grain, hi = lo + l->grain < l->items ? lo + l->grain : l->items;
    l->fn(l->bufs, l->first + lo, l->first + hi);
}

/* Items [lo, hi) of loop kernel k: tasks of at least WORK operations, and no more than a few
 * per thread; a parallel_for hands the op to every thread of the pool, so small kernels are
 * cheaper on the calling thread (and inside a pool's task, a parallel_for runs serially) */
static void launch(const CgKernel *k, RtCpuKernelFn fn, void *const *bufs, int64_t lo, int64_t hi)
{
    Launch l = {.fn = fn, .bufs = bufs, .first = lo, .items = hi - lo};
    if (l.items <= 0) return;
    int64_t work = task_work();
    l.grain = k->cost >= work ? 1 : work / k->cost;
    int64_t most = 4 * (int64_t)ref_threads();
    if ((l.items + l.grain - 1) / l.grain > most) l.grain = (l.items + most - 1) / most;
    int64_t tasks = (l.items + l.grain - 1) / l.grain;
    if (tasks == 1) fn(bufs, lo, hi);
    else ref_parallel_for(tasks, launch_task, &l);
}

RtCpuExec *rt_cpu_exec_new(Graph *g, const RtCpuKernels *table)
{
    RtCpuExec *x = calloc(1, sizeof *x);
    if (!x) {
        rt_error("out of memory");
        return NULL;
    }
    x->arena = arena_new();
    x->g = g;
    x->table = table;
    ir_renumber(g);
    CgLowerOptions lo = {.fuse = true, .gemm_f32 = true};
    x->p = cg_lower(g, x->arena, &lo);
    if (!x->p) {
        rt_error("the CPU backend cannot lower this artifact's graph");
        rt_cpu_exec_free(x);
        return NULL;
    }
    if (x->p->hash != table->hash || x->p->n_kernels != table->count) {
        rt_error("the compiled CPU kernels do not belong to this artifact (%d kernels, hash "
                 "%016llx; compiled: %d, %016llx): rebuild the binary with this fp8c",
                 x->p->n_kernels, (unsigned long long)x->p->hash, (int)table->count,
                 (unsigned long long)table->hash);
        rt_cpu_exec_free(x);
        return NULL;
    }
    for (int i = 0; i < x->p->n_kernels; i++) {
        const CgKernel *k = x->p->kernels[i];
        if (k->kind == CG_KERNEL_LOOP && !table->fns[i]) {
            rt_error("the compiled CPU kernels lack kernel %d (%s)", i, k->name);
            rt_cpu_exec_free(x);
            return NULL;
        }
    }
    x->scratch = calloc((size_t)x->p->n_scratch + 1, sizeof *x->scratch);
    x->bufs = calloc((size_t)x->p->n_kernels + 1, sizeof *x->bufs);
    x->ran_with_gemm = calloc((size_t)x->p->n_kernels + 1, sizeof *x->ran_with_gemm);
    x->attention = calloc((size_t)x->p->n_kernels + 1, sizeof *x->attention);
    if (!x->scratch || !x->bufs || !x->ran_with_gemm || !x->attention) {
        rt_error("out of memory");
        rt_cpu_exec_free(x);
        return NULL;
    }
    for (int i = 0; i < x->p->n_scratch; i++) {
        size_t bytes = ((size_t)x->p->scratch[i] * sizeof(float) + 63) & ~(size_t)63;
        x->scratch[i] = aligned_alloc(64, bytes);
        if (!x->scratch[i]) {
            rt_error("cannot allocate %zu bytes of CPU kernel scratch", bytes);
            rt_cpu_exec_free(x);
            return NULL;
        }
        memset(x->scratch[i], 0, bytes);
    }
    const Node *seen = NULL;
    for (int i = 0; i < x->p->n_kernels; i++) {
        const CgKernel *k = x->p->kernels[i];
        const Node *n = k->n_nodes == 1 ? k->nodes[0] : NULL;
        if (!n || (n->op != OP_ATTENTION && n->op != OP_ATTENTION_BWD)) continue;
        x->attention[i] = n == seen ? 2 : 1;
        seen = n;
    }
    const char *prof = getenv("FP8C_PROFILE");
    if (prof && *prof && strcmp(prof, "0") != 0) {
        x->ms = calloc((size_t)x->p->n_kernels + 1, sizeof(double));
        x->runs = calloc((size_t)x->p->n_kernels + 1, sizeof(int64_t));
    }
    for (int i = 0; i < x->p->n_kernels; i++) {
        const CgKernel *k = x->p->kernels[i];
        x->bufs[i] = arena_alloc(x->arena, sizeof(void *) * (size_t)(k->n_bufs + 1));
        for (int b = 0; b < k->n_bufs; b++) {
            const CgBuf *bf = &k->bufs[b];
            if (bf->scratch != CG_NONE) x->bufs[i][b] = x->scratch[bf->scratch];
            else if (bf->constant != CG_NONE) x->bufs[i][b] = x->p->consts[bf->constant].data;
        }
    }
    return x;
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* FP8C_PROFILE=1: where the time went, by kind of work and by kernel, the largest twelve
 * first (FP8C_PROFILE=N, N > 12: the largest N), each with its time per run and how many runs
 * were timed (eval batches run the forward's kernels more often than the backward's). */
static int by_time_desc(const void *a, const void *b, void *ctx)
{
    const double *ms = ctx;
    double x = ms[*(const int *)a], y = ms[*(const int *)b];
    return (x < y) - (x > y);
}

static void print_profile(const RtCpuExec *x)
{
    int n = x->p->n_kernels;
    int *order = malloc(sizeof(int) * (size_t)(n + 1));
    double total = 0, by_kind[3] = {0};
    for (int i = 0; i < n; i++) {
        order[i] = i;
        total += x->ms[i];
        by_kind[x->p->kernels[i]->kind] += x->ms[i];
    }
    qsort_r(order, (size_t)n, sizeof(int), by_time_desc, x->ms);
    fprintf(stderr, "cpu kernels, every run but the first: %.1f ms in all: generated %.1f, gemm %.1f "
            "(with the epilogues run on its rows), reference %.1f\n",
            total, by_kind[CG_KERNEL_LOOP], by_kind[CG_KERNEL_GEMM], by_kind[CG_KERNEL_REF]);
    /* by kind of work: the suffix of the kernel's name (":a", ":epilogue", ...) or its op */
    enum { MAXC = 64 };
    const char *cls[MAXC];
    double cms[MAXC] = {0};
    int nc = 0;
    for (int i = 0; i < n; i++) {
        const CgKernel *k = x->p->kernels[i];
        const char *c = strrchr(k->name, ':');
        c = c ? c + 1 : k->nodes && k->n_nodes ? ir_op_info(k->nodes[k->n_nodes - 1]->op)->text : k->name;
        if (k->kind == CG_KERNEL_GEMM) c = "gemm";
        int j = 0;
        while (j < nc && strcmp(cls[j], c) != 0) j++;
        if (j == nc && nc < MAXC) cls[nc++] = c;
        if (j < MAXC) cms[j] += x->ms[i];
    }
    for (int i = 0; i < nc; i++)
        if (cms[i] >= 0.01 * total) fprintf(stderr, "  %8.2f ms  %s (all)\n", cms[i], cls[i]);
    const char *prof = getenv("FP8C_PROFILE");
    int shown = prof && atoi(prof) > 12 ? atoi(prof) : 12;
    for (int j = 0; j < n && j < shown; j++) {
        const CgKernel *k = x->p->kernels[order[j]];
        char fn[16] = "";   /* the compiled function (fp8c_kN in a profiler's listing) */
        if (k->kind == CG_KERNEL_LOOP) snprintf(fn, sizeof fn, "fp8c_k%d", k->func);
        char size[48];      /* a GEMM's M x N x K and transposes, a loop's items */
        if (k->kind == CG_KERNEL_GEMM)
            snprintf(size, sizeof size, "%lldx%lldx%lld %s%s", (long long)k->gemm.M,
                     (long long)k->gemm.N, (long long)k->gemm.K, k->gemm.trans_a ? "T" : "N",
                     k->gemm.trans_b ? "T" : "N");
        else snprintf(size, sizeof size, "items %lld", (long long)k->items);
        int64_t timed = x->runs[order[j]] - 1;
        fprintf(stderr, "  %8.2f ms  %7.3f ms x %-4lld k%-4d %-5s %-10s %-18s %s\n",
                x->ms[order[j]], timed > 0 ? x->ms[order[j]] / (double)timed : 0.0, (long long)timed,
                k->id, k->kind == CG_KERNEL_GEMM ? "gemm" : k->kind == CG_KERNEL_REF ? "ref" : "loop",
                fn, size, k->name);
    }
    free(order);
}

void rt_cpu_exec_free(RtCpuExec *x)
{
    if (!x) return;
    if (x->ms && x->p) print_profile(x);
    free(x->ms);
    free(x->runs);
    if (x->scratch && x->p)
        for (int i = 0; i < x->p->n_scratch; i++) free(x->scratch[i]);
    free(x->scratch);
    free(x->bufs);
    free(x->ran_with_gemm);
    free(x->attention);
    arena_free(x->arena);
    free(x);
}

/* A GEMM operand as stored: its data, element type and per-tensor scale. */
static RtGemmOperand gemm_operand(const CgKernel *k, void **bufs, int b)
{
    const CgBuf *bf = &k->bufs[b];
    RtGemmOperand o = {bufs[b], bf->elem, 1.0f};
    if (bf->scaling == SCALE_PER_TENSOR) {
        if (bf->scale_buf == CG_NONE) {
            o.scale = bf->static_scale;
        } else {
            float s;
            num_decode(k->bufs[bf->scale_buf].elem, bufs[bf->scale_buf], &s, 1);
            o.scale = s;
        }
    }
    return o;
}

/* Points k's tensor buffers at their tensors' data (bound anew before each run). */
static void bind_tensors(const CgKernel *k, void **bufs)
{
    for (int b = 0; b < k->n_bufs; b++)
        if (k->bufs[b].node) bufs[b] = k->bufs[b].node->t.data;
}

/* Whether buffer b of kernel k (a tensor) shares a byte with buffer c of kernel j. */
static bool buffers_overlap(const CgKernel *k, void *const *kb, int b, const CgKernel *j,
                            void *const *jb, int c)
{
    const Node *x = k->bufs[b].node, *y = j->bufs[c].node;
    if (!x || !y) return false;
    const char *p = kb[b], *q = jb[c];
    return p < q + ir_storage_bytes(y) && q < p + ir_storage_bytes(x);
}

typedef struct {
    const CgKernel *k;
    RtCpuKernelFn fn;
    void *const *bufs;
    int c_buf;              /* the epilogue's buffer that is the GEMM's C */
    int64_t ldc;
} RowsEpilogue;

enum { EPILOGUE_BUFS = 64 };

/* inside a GEMM's task: serially; after a GEMM that ran on the calling thread: on the pool.
 * The rows are read from c (row lo), in C or in the task's buffer: the epilogue's C pointer
 * is moved so that its row lo is c (it reads no other rows). */
static void epilogue_rows(void *ctx, int64_t lo, int64_t hi, const float *c)
{
    const RowsEpilogue *e = ctx;
    void *bufs[EPILOGUE_BUFS];
    memcpy(bufs, e->bufs, sizeof(void *) * (size_t)e->k->n_bufs);
    bufs[e->c_buf] = (void *)((uintptr_t)c - (uintptr_t)lo * (uintptr_t)e->ldc * sizeof(float));
    launch(e->k, e->fn, bufs, lo, hi);
}

/* The buffer of epilogue ep that is GEMM k's C (their shared scratch array). */
static int epilogue_c_buffer(const CgKernel *ep, const CgKernel *k)
{
    int scratch = k->bufs[k->gemm.c].scratch;
    for (int b = 0; b < ep->n_bufs; b++)
        if (scratch != CG_NONE && ep->bufs[b].scratch == scratch) return b;
    return -1;
}

/* The GEMM, and its epilogue on each block of C's rows as soon as they are final (still in
 * cache), unless the epilogue writes bytes of an operand the GEMM reads (the memory plan may
 * put the group's result where an operand whose last reader is this GEMM lay): then after. */
static void run_gemm(RtCpuExec *x, const CgKernel *k, void **bufs)
{
    const CgGemm *m = &k->gemm;
    float *C = bufs[m->c];
    int64_t lda = m->trans_a ? m->M : m->K, ldb = m->trans_b ? m->K : m->N;
    RowsEpilogue e = {0};
    if (m->epilogue != CG_NONE) {
        const CgKernel *ep = x->p->kernels[m->epilogue];
        void **ebufs = x->bufs[m->epilogue];
        bool apart = true;
        bind_tensors(ep, ebufs);
        for (int b = 0; b < ep->n_bufs; b++) {
            if (ep->bufs[b].written)
                apart = apart && !buffers_overlap(ep, ebufs, b, k, bufs, m->a) &&
                        !buffers_overlap(ep, ebufs, b, k, bufs, m->b);
        }
        int c_buf = epilogue_c_buffer(ep, k);
        apart = apart && c_buf >= 0 && ep->n_bufs <= EPILOGUE_BUFS;
        if (apart) e = (RowsEpilogue){ep, x->table->fns[m->epilogue], ebufs, c_buf, m->N};
        x->ran_with_gemm[m->epilogue] = apart;
    }
    rt_cpu_gemm_rows(m->M, m->N, m->K, gemm_operand(k, bufs, m->a), lda, m->trans_a,
                     gemm_operand(k, bufs, m->b), ldb, m->trans_b, C, m->N, m->accumulate,
                     e.fn ? epilogue_rows : NULL, &e);
}

int rt_cpu_kernel_count(const RtCpuExec *x) { return x->p->n_kernels; }

Node *rt_cpu_kernel_root(const RtCpuExec *x, int i)
{
    const CgKernel *k = x->p->kernels[i];
    return k->n_nodes ? k->nodes[k->n_nodes - 1] : NULL;
}

static void run_kernel(RtCpuExec *x, int i);

void rt_cpu_run_kernel(RtCpuExec *x, int i)
{
    if (!x->ms) {
        run_kernel(x, i);
        return;
    }
    double t0 = now_ms();
    run_kernel(x, i);
    if (x->runs[i]++) x->ms[i] += now_ms() - t0;
}

/* A plain bf16 or f32 tensor (no scale, no codec), or with bf16_only, a plain bf16 one. */
static bool plain_tensor(const Node *n, bool bf16_only)
{
    const Format *f = &n->t.fmt;
    return f->scaling == SCALE_NONE && f->codec == CODEC_PLAIN && n->t.data &&
           (f->elem == FMT_BF16 || (!bf16_only && f->elem == FMT_F32));
}

/* The tile path's job for attention node n (forward, or backward into dq | dk | dv), where its
 * q, k, v (and dy) are plain bf16 and its result plain bf16 or f32; else false. */
static bool attention_job(const Node *n, RtAttention *a)
{
    bool bwd = n->op == OP_ATTENTION_BWD;
    int first = bwd ? 1 : 0, inputs = n->n_in - first - (ir_attention_bwd_reads_y(n) ? 1 : 0);
    if (inputs != 1 && inputs != 3) return false;
    for (int j = 0; j < first + inputs; j++)
        if (!plain_tensor(n->in[j], true)) return false;
    if (!plain_tensor(n, false)) return false;
    const Tensor *q = &n->in[first]->t;
    /* ATTENTION or ATTENTION_BWD: the same attributes in the same places */
    *a = (RtAttention){.B = q->dims[0], .T = q->dims[1], .H = IR_IATTR(n, ATTENTION, heads),
                       .Hkv = IR_IATTR(n, ATTENTION, kv_heads), .scale = (float)IR_FATTR(n, ATTENTION, scale),
                       .out = n->t.data, .out_elem = n->t.fmt.elem};
    a->D = q->dims[2] / (inputs == 1 ? a->H + 2 * a->Hkv : a->H);
    a->q = q->data;
    if (inputs == 1) {
        a->qs = a->ks = a->vs = q->dims[2];
        a->k = a->q + a->H * a->D;
        a->v = a->k + a->Hkv * a->D;
    } else {
        a->k = n->in[first + 1]->t.data;
        a->v = n->in[first + 2]->t.data;
        a->qs = a->H * a->D;
        a->ks = a->vs = a->Hkv * a->D;
    }
    a->dy = bwd ? n->in[0]->t.data : NULL;
    a->out_stride = bwd ? (a->H + 2 * a->Hkv) * a->D : a->H * a->D;
    return true;
}

static void run_kernel(RtCpuExec *x, int i)
{
    const CgKernel *k = x->p->kernels[i];
    RtAttention a;
    if (x->attention[i] && attention_job(k->nodes[0], &a) && cpu_attention_tile_usable(a.D)) {
        if (x->attention[i] == 1) cpu_attention_tile(&a);
        return;
    }
    if (k->kind == CG_KERNEL_REF) {
        for (int j = 0; j < k->n_nodes; j++) ref_exec_node(k->nodes[j]);
        return;
    }
    void **bufs = x->bufs[i];
    bind_tensors(k, bufs);
    if (k->kind == CG_KERNEL_GEMM) {
        run_gemm(x, k, bufs);
        return;
    }
    if (x->ran_with_gemm[i]) {
        x->ran_with_gemm[i] = false;
        return;
    }
    launch(k, x->table->fns[i], bufs, 0, k->items);
}

void rt_cpu_run_phase(RtCpuExec *x, Phase phase)
{
    for (int i = 0; i < x->p->n_kernels; i++)
        if (x->p->kernels[i]->phase == phase) rt_cpu_run_kernel(x, i);
}

/* ---------------------------------------------------------------- the "cpu" device
 * The training program talks to devices (device.c); this one works on the host arenas
 * themselves, so its transfers are nothing and only running the step differs from the
 * reference's device. */

static RtCpuExec *device_exec;
static char device_text[160];

static bool device_probe(char *why, size_t why_len)
{
    if (rt_cpu_builtin_kernels()) return true;
    snprintf(why, why_len, "this binary carries no compiled CPU kernels");
    return false;
}

static bool device_open(Graph *g, RtMemory *host)
{
    (void)host;
    device_exec = rt_cpu_exec_new(g, rt_cpu_builtin_kernels());
    if (!device_exec) return false;
    int funcs = device_exec->p->n_funcs;
    int64_t scratch = 0;   /* beyond the memory plan's arenas */
    for (int i = 0; i < device_exec->p->n_scratch; i++) scratch += 4 * device_exec->p->scratch[i];
    snprintf(device_text, sizeof device_text,
             "cpu (%d compiled kernels, %d functions, %.1f MiB of kernel scratch), %d threads",
             device_exec->p->n_kernels, funcs, (double)scratch / (1 << 20), ref_threads());
    return true;
}

static void device_close(void)
{
    rt_cpu_exec_free(device_exec);
    device_exec = NULL;
}

static bool device_run_phase(Graph *g, Phase p)
{
    (void)g;
    rt_cpu_run_phase(device_exec, p);
    return true;
}

/* forward and backward in one sweep of the schedule, as ref_run_micro_step */
static bool device_run_micro_step(Graph *g)
{
    (void)g;
    for (int i = 0; i < device_exec->p->n_kernels; i++)
        if (device_exec->p->kernels[i]->phase != PHASE_UPDATE) rt_cpu_run_kernel(device_exec, i);
    return true;
}

static bool device_sync(Tensor *const *ts, int n)
{
    (void)ts, (void)n;
    return true;
}

/* Whether stored values are finite, from their bits: an all-ones exponent field (the
 * infinity/NaN codes; e4m3 has only the NaN code 0x7F) — no decoding, split across threads.
 * The training loop asks this of every gradient accumulator each step. */
typedef struct {
    const Tensor *t;
    int64_t n;
    atomic_bool bad;
} FiniteJob;

enum { FINITE_CHUNK = 1 << 18 };

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));

/* Whether an element of [lo, hi) of the `bytes`-wide codes at x has every bit of `e` set, 16
 * bytes (the baseline's vector width) at a time. The compiler leaves the element loop scalar,
 * and a step checks every gradient: that loop alone was 3% of gpt2_tiny's one-thread step. */
#define ANY_CODE(T, V, x, lo, hi, e)                                                    \
    do {                                                                                \
        const T *p_ = (const T *)(x);                                                   \
        V acc_ = {0}, m_ = {0};                                                         \
        m_ += (T)(e);                                                                   \
        int64_t i_ = (lo);                                                              \
        for (; i_ + (int64_t)(16 / sizeof(T)) <= (hi); i_ += 16 / sizeof(T)) {          \
            V v_;                                                                       \
            memcpy(&v_, p_ + i_, sizeof v_);                                            \
            acc_ |= (V)((v_ & m_) == m_);                                               \
        }                                                                               \
        for (int64_t k_ = 0; k_ < (int64_t)(16 / sizeof(T)); k_++) found |= acc_[k_] != 0; \
        for (; i_ < (hi); i_++) found |= (p_[i_] & (T)(e)) == (T)(e);                   \
    } while (0)

static bool any_code(const void *x, int bytes, int64_t lo, int64_t hi, uint32_t e)
{
    bool found = false;
    if (bytes == 4) ANY_CODE(uint32_t, u32x4, x, lo, hi, e);
    else if (bytes == 2) ANY_CODE(uint16_t, u16x8, x, lo, hi, e);
    else ANY_CODE(uint8_t, u8x16, x, lo, hi, e);
    return found;
}

static void finite_task(void *ctx, int64_t c)
{
    FiniteJob *j = ctx;
    if (atomic_load(&j->bad)) return;
    int64_t lo = c * FINITE_CHUNK, hi = lo + FINITE_CHUNK < j->n ? lo + FINITE_CHUNK : j->n;
    bool bad = false;
    switch (j->t->fmt.elem) {
    case FMT_F32: bad = any_code(j->t->data, 4, lo, hi, 0x7F800000u); break;
    case FMT_BF16: bad = any_code(j->t->data, 2, lo, hi, 0x7F80); break;
    case FMT_F16: bad = any_code(j->t->data, 2, lo, hi, 0x7C00); break;
    case FMT_E4M3: bad = any_code(j->t->data, 1, lo, hi, 0x7F); break;
    case FMT_E5M2: bad = any_code(j->t->data, 1, lo, hi, 0x7C); break;
    default: break;   /* integer codes are always finite */
    }
    if (bad) atomic_store(&j->bad, true);
}

static bool device_all_finite(Tensor *const *ts, int n, bool *finite)
{
    *finite = true;
    for (int i = 0; i < n && *finite; i++) {
        const Tensor *t = ts[i];
        int64_t count = ir_numel(t);
        if (t->fmt.codec != CODEC_PLAIN || t->fmt.scaling != SCALE_NONE) {
            float *v = ref_load(t);   /* through its codec or scales */
            for (int64_t k = 0; k < count && *finite; k++) *finite = isfinite(v[k]);
            free(v);
            continue;
        }
        FiniteJob j = {.t = t, .n = count};
        atomic_init(&j.bad, false);
        ref_parallel_for((count + FINITE_CHUNK - 1) / FINITE_CHUNK, finite_task, &j);
        *finite = !atomic_load(&j.bad);
    }
    return true;
}

static bool device_zero(Tensor *const *ts, int n)
{
    for (int i = 0; i < n; i++)
        memset(ts[i]->data, 0, (size_t)(ir_numel(ts[i]) * fmt_elem_bytes(ts[i]->fmt.elem)));
    return true;
}

static const char *device_describe(void) { return device_text; }

static const RtDevice cpu_kernels_device = {
    .name = "cpu", .probe = device_probe, .open = device_open, .close = device_close,
    .run_phase = device_run_phase, .run_micro_step = device_run_micro_step, .push = device_sync,
    .pull = device_sync, .all_finite = device_all_finite, .zero = device_zero,
    .describe = device_describe,
};

const struct RtDevice *rt_cpu_kernels_device(void)
{
    return rt_cpu_builtin_kernels() ? &cpu_kernels_device : NULL;
}
