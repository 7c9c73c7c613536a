/* device.c — the training program's "cuda" device: the executor behind the RtDevice table.
 *
 * The training loop (runtime/train.c) speaks to devices through RtDevice only; this file
 * adapts the CUDA executor to it and decides, in probe, whether a GPU run is possible here:
 * the binary must carry kernels, the driver and cuBLASLt must load, and a GPU must answer.
 * --device auto takes the GPU exactly when probe says yes. */
#include <stdio.h>
#include <string.h>

#include "gpu_internal.h"

static const void *dev_cubin;
static size_t dev_cubin_size;
static CudaExec *dev_exec;
static char dev_desc[512];
static CUdevice comm_dev;       /* a rank's GPU, whose primary context comm_open retained */
static bool comm_ctx;

static bool dev_probe(char *why, size_t why_len) {
    if (!dev_cubin_size) {
        snprintf(why, why_len, "this binary carries no GPU kernels (fp8c was built without "
                 "NVRTC, or the model has ops the GPU backend cannot run)");
        return false;
    }
    return cuda_load(why, why_len);
}

static bool dev_open(Graph *g, RtMemory *host) {
    dev_exec = cuda_exec_open(g, host, dev_cubin, dev_cubin_size);
    if (!dev_exec) return false;
    double t[4];
    cuda_exec_setup_times(dev_exec, t);
    int n = snprintf(dev_desc, sizeof dev_desc, "%s (cuda), %.2f GiB of device memory in use; set up in %.1f s "
                     "(plan %.1f, module %.1f, launch lists %.1f, upload %.1f)", cuda_exec_device_name(dev_exec),
                     (double)cuda_exec_device_bytes(dev_exec) / (1 << 30), t[0] + t[1] + t[2] + t[3], t[0], t[1],
                     t[2], t[3]);
    if (cuda_nccl_active() && n > 0 && (size_t)n < sizeof dev_desc) {
        int buckets = cuda_exec_buckets(dev_exec);
        char how[96] = "after the backward";
        if (buckets) snprintf(how, sizeof how, "in %d buckets during the backward", buckets);
        ElemType wire = rt_comm_wire(g);
        char in[64] = "";
        if (wire != FMT_VOID) snprintf(in, sizeof in, " in %s (one scale a bucket)", fmt_elem_name(wire));
        n += snprintf(dev_desc + n, sizeof dev_desc - (size_t)n, "; data parallel over %d GPUs (NCCL), "
                      "%d gradients summed each step%s %s", cuda_nccl_world(), cuda_exec_reductions(dev_exec), in, how);
        if (cuda_exec_sharded(dev_exec) && n > 0 && (size_t)n < sizeof dev_desc)
            snprintf(dev_desc + n, sizeof dev_desc - (size_t)n, "; %s sharded (%s): persistent arena "
                     "%lld bytes on this GPU, %lld whole",
                     rt_shard_stage(g) >= 3   ? "weights, gradients, masters and optimizer states"
                     : rt_shard_stage(g) >= 2 ? "gradients, masters and optimizer states"
                                              : "masters and optimizer states",
                     rt_shard_stage(g) >= 3 ? "--shard-states=3" : rt_shard_stage(g) >= 2 ? "--shard-states=2" : "--shard-states",
                     (long long)cuda_exec_persistent_bytes(dev_exec), (long long)host->persistent_bytes);
    }
    return true;
}

static void dev_close(void) {
    cuda_exec_close(dev_exec);
    dev_exec = NULL;
    cuda_nccl_close();
    if (comm_ctx) CU(cuDevicePrimaryCtxRelease_v2)(comm_dev);
    comm_ctx = false;
}

static bool dev_run_phase(Graph *g, Phase p) {
    (void)g;
    return cuda_exec_run_phase(dev_exec, p);
}
static bool dev_run_micro_step(Graph *g) {
    (void)g;
    return cuda_exec_run_micro_step(dev_exec);
}
static bool dev_run_last_micro_step(Graph *g) {
    (void)g;
    return cuda_exec_run_last_micro_step(dev_exec);
}
static bool dev_push(Tensor *const *ts, int n) { return cuda_exec_push(dev_exec, ts, n); }
static bool dev_pull(Tensor *const *ts, int n) { return cuda_exec_pull(dev_exec, ts, n); }
static bool dev_all_finite(Tensor *const *ts, int n, bool *finite) {
    return cuda_exec_all_finite(dev_exec, ts, n, finite);
}
static bool dev_zero(Tensor *const *ts, int n) { return cuda_exec_zero(dev_exec, ts, n); }
static bool dev_gather(Tensor *const *ts, int n) { return cuda_exec_gather(dev_exec, ts, n); }
static const char *dev_describe(void) { return dev_desc; }

static bool dev_comm_probe(int gpus, char *why, size_t why_len) {
    if (!dev_probe(why, why_len)) return false;
    if (cuda_device_count() < gpus) {
        snprintf(why, why_len, "%d GPU%s here, not %d", cuda_device_count(),
                 cuda_device_count() == 1 ? "" : "s", gpus);
        return false;
    }
    return cuda_nccl_load(why, why_len);
}

/* This rank's GPU made current (its primary context, which the executor retains again), then
 * the communicator on it. */

static bool dev_comm_open(int rank, int world, const char *comm_file, double timeout_s) {
    char why[512];
    if (!dev_probe(why, sizeof why)) {
        rt_error("rank %d: %s", rank, why);
        return false;
    }
    cuda_set_device_ordinal(rank % cuda_device_count());
    CUcontext ctx;
    if (!CU_CHECK(CU(cuDeviceGet)(&comm_dev, cuda_device_ordinal())) ||
        !CU_CHECK(CU(cuDevicePrimaryCtxRetain)(&ctx, comm_dev)))
        return false;
    comm_ctx = true;
    return CU_CHECK(CU(cuCtxSetCurrent)(ctx)) && cuda_nccl_open(rank, world, comm_file, timeout_s);
}

static bool dev_comm_sum(double *v, int n) { return cuda_nccl_sum_host(v, n); }

static const RtDevice cuda_device = {
    .name = "cuda", .probe = dev_probe, .open = dev_open, .close = dev_close,
    .run_phase = dev_run_phase, .run_micro_step = dev_run_micro_step, .push = dev_push,
    .pull = dev_pull, .all_finite = dev_all_finite, .zero = dev_zero, .describe = dev_describe,
    .comm_probe = dev_comm_probe, .comm_open = dev_comm_open, .comm_sum = dev_comm_sum,
    .run_last_micro_step = dev_run_last_micro_step, .gather = dev_gather,
};

const RtDevice *cuda_rt_device(const void *cubin, size_t cubin_size) {
    dev_cubin = cubin;
    dev_cubin_size = cubin_size;
    return &cuda_device;
}
