/* exec_cg.c — kernel-IR programs run by the CUDA executor (the tests of cuda/cg_render.c).
 *
 * The training binary's GPU step runs the library's kernels and cuBLASLt (exec.c); the kernel
 * IR's CUDA rendering is checked by running a program's loop kernels on the same arenas and
 * comparing with the reference executor. This is that runner, apart from the executor proper:
 * it loads the program's own module and allocates its scratch and constants, and takes the
 * executor's context, stream and tensors' device bytes. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exec_internal.h"

/* ---------------------------------------------------------------- kernel-IR programs
 * Loop kernels of a kernel-IR program (cuda/cg_render.c) run on the executor's arenas: a
 * buffer that is a graph tensor is that tensor's device bytes; scratch arrays and constant
 * tables get one device allocation of their own. Used by the tests that check the rendered
 * kernels against the reference executor. */

#define CG_CUDA_MAX_BUFS 64
typedef struct {
    void *buf[CG_CUDA_MAX_BUFS];
    long long items;
} CgCudaArgs;

struct CudaCg {
    CudaExec *e;
    const CgProgram *p;
    CUmodule module;
    CUdeviceptr mem;
    CUdeviceptr *scratch, *consts;
};

CudaCg *cuda_cg_open(CudaExec *e, const CgProgram *p, const void *cubin, size_t cubin_size) {
    CudaCg *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->e = e;
    c->p = p;
    c->scratch = calloc((size_t)p->n_scratch + 1, sizeof *c->scratch);
    c->consts = calloc((size_t)p->n_consts + 1, sizeof *c->consts);
    int64_t bytes = 0;
    for (int i = 0; i < p->n_scratch; i++) bytes += align_up(p->scratch[i] * 4);
    for (int i = 0; i < p->n_consts; i++) bytes += align_up(p->consts[i].n * 4);
    if (!c->scratch || !c->consts || !CU_CHECK(CU(cuModuleLoadData)(&c->module, cubin)) ||
        !CU_CHECK(CU(cuMemAlloc_v2)(&c->mem, (size_t)(bytes ? bytes : ALIGN)))) {
        cuda_cg_close(c);
        return NULL;
    }
    (void)cubin_size;
    CUdeviceptr at = c->mem;
    for (int i = 0; i < p->n_scratch; i++) {
        c->scratch[i] = at;
        at += (CUdeviceptr)align_up(p->scratch[i] * 4);
    }
    for (int i = 0; i < p->n_consts; i++) {
        c->consts[i] = at;
        if (p->consts[i].n && !CU_CHECK(CU(cuMemcpyHtoD_v2)(at, p->consts[i].data, (size_t)p->consts[i].n * 4))) {
            cuda_cg_close(c);
            return NULL;
        }
        at += (CUdeviceptr)align_up(p->consts[i].n * 4);
    }
    return c;
}

void cuda_cg_close(CudaCg *c) {
    if (!c) return;
    if (c->module) CU(cuModuleUnload)(c->module);
    if (c->mem) CU(cuMemFree_v2)(c->mem);
    free(c->scratch);
    free(c->consts);
    free(c);
}

bool cuda_cg_write_scratch(CudaCg *c, int scratch, const float *data, int64_t n) {
    if (scratch < 0 || scratch >= c->p->n_scratch || n < 0 || n > c->p->scratch[scratch]) {
        rt_error("scratch %d of the kernel-IR program cannot take %lld floats", scratch, (long long)n);
        return false;
    }
    if (!cuda_exec_sync(c->e)) return false;
    return !n || CU_CHECK(CU(cuMemcpyHtoD_v2)(c->scratch[scratch], data, (size_t)n * 4));
}

bool cuda_cg_run_kernel(CudaCg *c, const CgKernel *k) {
    unsigned grid, block;
    if (!cuda_cg_launch_shape(k, &grid, &block)) return true;
    if (k->n_bufs > CG_CUDA_MAX_BUFS) {
        rt_error("kernel %s has %d buffers, more than %d", k->name, k->n_bufs, CG_CUDA_MAX_BUFS);
        return false;
    }
    CgCudaArgs args;
    memset(&args, 0, sizeof args);
    args.items = k->items;
    for (int i = 0; i < k->n_bufs; i++) {
        const CgBuf *b = &k->bufs[i];
        CUdeviceptr p = 0;
        if (b->node) {
            if (!exec_map_tensor(c->e, &b->node->t, &p)) return false;
        } else if (b->scratch != CG_NONE) {
            p = c->scratch[b->scratch];
        } else if (b->constant != CG_NONE) {
            p = c->consts[b->constant];
        }
        args.buf[i] = (void *)(uintptr_t)p;
    }
    char name[32];
    snprintf(name, sizeof name, "fp8c_g%d", k->func);
    CUfunction f;
    if (!CU_CHECK(CU(cuModuleGetFunction)(&f, c->module, name))) return false;
    void *params[] = {&args};
    if (!CU_CHECK(CU(cuLaunchKernel)(f, grid, 1, 1, block, 1, 1, 0, c->e->stream, params, NULL)))
        return false;
    return exec_finish(c->e, k->name);
}
