/* nccl.c — NCCL, opened at run time: the communicator of a data-parallel run and its watchdog.
 *
 * A data-parallel run is one process per GPU (launched by the binary itself for --gpus N, or
 * by the user with --rank/--world-size), each with one communicator. As with the CUDA driver
 * (loader.c), nothing of NCCL is linked: libnccl.so.2 is opened with dlopen when a run asks for
 * more than one rank (FP8C_LIBNCCL, else the versioned name, else the toolkit's lib), so a
 * binary still starts, and trains on one GPU or the CPU, where there is no NCCL. The types
 * and prototypes come from the toolkit's nccl.h at build time; every call goes through
 * NC_CHECK, which names the call and the place in the source.
 *
 * The ranks meet through a file: rank 0 asks NCCL for a unique id and writes it to --comm-file
 * atomically (a temp file linked into place, so a reader never sees half of it, and an
 * existing file is never overwritten: it is another job's or a crashed run's); the others wait
 * for the file to appear, up to the timeout. Once the communicator exists every rank has read
 * the id, and rank 0 removes the file.
 *
 * NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is put in the environment before NCCL
 * is initialised unless the user set it, because the GPU hosts this runs on require it.
 *
 * Nothing may hang silently. A rank that dies takes its sockets with it, which NCCL reports to
 * the others as an asynchronous error; a rank that hangs leaves the others waiting inside a
 * collective. So every blocking step of the communication (meeting, the GEMM algorithms sent
 * at start-up, the last micro-step or the update with the gradient sums, the reductions of the
 * logged scalars) is armed with the --comm-timeout deadline,
 * and a watchdog thread polls the deadline and ncclCommGetAsyncError every 50 ms: either one
 * ends the process with one line naming the rank and what did not finish. The process exits
 * (status 3) rather than return, because the thread that would return is the one stuck in the
 * driver; the launcher (runtime/train.c) then stops the other ranks. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <nccl.h>

#include "gpu_internal.h"

#define NC_FUNCS(X)                                                                          \
    X(ncclGetVersion, ncclResult_t, (int *))                                                 \
    X(ncclGetUniqueId, ncclResult_t, (ncclUniqueId *))                                       \
    X(ncclCommInitRank, ncclResult_t, (ncclComm_t *, int, ncclUniqueId, int))                \
    X(ncclCommAbort, ncclResult_t, (ncclComm_t))                                             \
    X(ncclCommGetAsyncError, ncclResult_t, (ncclComm_t, ncclResult_t *))                     \
    X(ncclGetErrorString, const char *, (ncclResult_t))                                      \
    X(ncclGroupStart, ncclResult_t, (void))                                                  \
    X(ncclGroupEnd, ncclResult_t, (void))                                                    \
    X(ncclAllReduce, ncclResult_t, (const void *, void *, size_t, ncclDataType_t,             \
                                    ncclRedOp_t, ncclComm_t, cudaStream_t))                  \
    X(ncclReduce, ncclResult_t, (const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,   \
                                 int, ncclComm_t, cudaStream_t))                             \
    X(ncclBroadcast, ncclResult_t, (const void *, void *, size_t, ncclDataType_t, int,        \
                                    ncclComm_t, cudaStream_t))                               \
    X(ncclAllGather, ncclResult_t, (const void *, void *, size_t, ncclDataType_t, ncclComm_t, \
                                    cudaStream_t))                                           \
    X(ncclSend, ncclResult_t, (const void *, size_t, ncclDataType_t, int, ncclComm_t,         \
                               cudaStream_t))                                                \
    X(ncclRecv, ncclResult_t, (void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t))

static struct {
#define X(name, ret, args) ret(*name) args;
    NC_FUNCS(X)
#undef X
} nc;

#define NC_CHECK(call) nccl_check((call), #call, __FILE__, __LINE__)

static int nc_state;                  /* 0 not tried, 1 loaded, -1 failed */
static char nc_why[512];
static ncclComm_t nc_comm;
static int nc_rank, nc_world = 1;
static double nc_timeout = 600;
static CUstream nc_stream;             /* the host scalars' reductions */
static CUdeviceptr nc_scalars;         /* room for NCCL_SCALARS doubles */
#define NCCL_SCALARS 16

/* the watchdog */
static pthread_t wd_thread;
static bool wd_running;
static pthread_mutex_t wd_lock = PTHREAD_MUTEX_INITIALIZER;
static double wd_deadline;             /* 0: disarmed */
static char wd_what[128];
static char wd_comm_file[4096];        /* rank 0's id file while the ranks meet: removed on exit */

static bool nccl_check(ncclResult_t r, const char *call, const char *file, int line) {
    if (r == ncclSuccess) return true;
    const char *text = nc.ncclGetErrorString ? nc.ncclGetErrorString(r) : "?";
    rt_error("rank %d: NCCL: %s failed: %s (%d) at %s:%d", nc_rank, call, text, (int)r, file, line);
    return false;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

bool cuda_nccl_load(char *why, size_t why_len) {
    if (!nc_state) {
        /* before NCCL reads its environment (at its first call), never after */
        setenv("NCCL_NVLS_ENABLE", "0", 0);
        const char *names[] = {getenv("FP8C_LIBNCCL"), "libnccl.so.2", "libnccl.so",
                               "/usr/local/cuda/lib/libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"};
        char tried[512] = "";
        void *h = NULL;
        for (int i = 0; i < 5 && !h; i++) {
            if (!names[i] || !*names[i]) continue;
            h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
            size_t at = strlen(tried);
            if (!h) snprintf(tried + at, sizeof tried - at, "%s%s", at ? ", " : "", names[i]);
        }
        nc_state = 1;
        if (!h) {
            snprintf(nc_why, sizeof nc_why, "NCCL not found (tried %s; set FP8C_LIBNCCL to "
                     "libnccl.so.2's path)", tried);
            nc_state = -1;
        }
#define X(name, ret, args)                                                                   \
        if (nc_state > 0 && !(nc.name = (ret(*) args)dlsym(h, #name))) {                     \
            snprintf(nc_why, sizeof nc_why, "NCCL lacks %s (too old? 2.10 or later needed)", \
                     #name);                                                                 \
            nc_state = -1;                                                                   \
        }
        NC_FUNCS(X)
#undef X
    }
    if (nc_state < 0 && why) snprintf(why, why_len, "%s", nc_why);
    return nc_state > 0;
}

/* ---------------------------------------------------------------- the watchdog */

static void *wd_main(void *arg) {
    (void)arg;
    for (;;) {
        struct timespec pause = {0, 50 * 1000 * 1000};
        nanosleep(&pause, NULL);
        pthread_mutex_lock(&wd_lock);
        double deadline = wd_deadline;
        char what[sizeof wd_what];
        memcpy(what, wd_what, sizeof what);
        pthread_mutex_unlock(&wd_lock);
        /* only while a step waits on the others: a rank that finished (and closed its
         * connections) while this one still writes its last checkpoint is no failure */
        ncclResult_t async = ncclSuccess;
        if (deadline > 0 && nc_comm && nc.ncclCommGetAsyncError(nc_comm, &async) == ncclSuccess &&
            async != ncclSuccess && async != ncclInProgress) {
            rt_error("rank %d of %d: NCCL reports %s during %s: another rank failed or the "
                     "network broke; ending this rank", nc_rank, nc_world,
                     nc.ncclGetErrorString(async), what);
            _exit(3);
        }
        if (deadline > 0 && now_s() > deadline) {
            if (wd_comm_file[0]) unlink(wd_comm_file);   /* a later run must not read it */
            rt_error("rank %d of %d: %s did not finish within %g s (--comm-timeout): another "
                     "rank died or hangs; ending this rank", nc_rank, nc_world, what, nc_timeout);
            _exit(3);
        }
    }
    return NULL;
}

void cuda_nccl_arm(const char *what) {
    if (!wd_running) return;
    pthread_mutex_lock(&wd_lock);
    snprintf(wd_what, sizeof wd_what, "%s", what);
    wd_deadline = now_s() + nc_timeout;
    pthread_mutex_unlock(&wd_lock);
}

void cuda_nccl_disarm(void) {
    if (!wd_running) return;
    pthread_mutex_lock(&wd_lock);
    wd_deadline = 0;
    pthread_mutex_unlock(&wd_lock);
}

/* ---------------------------------------------------------------- meeting */

/* rank 0: the id into path, atomically and never over an existing file */
static bool comm_write_id(const char *path, const ncclUniqueId *id) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        rt_error("%s: cannot write the NCCL id (--comm-file): %s", tmp, strerror(errno));
        return false;
    }
    bool ok = write(fd, id, sizeof *id) == (ssize_t)sizeof *id && fsync(fd) == 0;
    ok = close(fd) == 0 && ok;
    if (!ok) {
        rt_error("%s: cannot write the NCCL id (--comm-file): %s", tmp, strerror(errno));
        unlink(tmp);
        return false;
    }
    if (link(tmp, path) != 0) {
        int err = errno;
        unlink(tmp);
        if (err == EEXIST)
            rt_error("%s: --comm-file exists already (another job's, or left by a run that "
                     "crashed): remove it or give another path", path);
        else
            rt_error("%s: cannot write the NCCL id (--comm-file): %s", path, strerror(err));
        return false;
    }
    unlink(tmp);
    return true;
}

/* the other ranks: wait for the file (complete once it exists: it is linked into place) */
static bool comm_read_id(const char *path, ncclUniqueId *id) {
    double deadline = now_s() + nc_timeout;
    for (;;) {
        int fd = open(path, O_RDONLY);
        if (fd >= 0) {
            ssize_t got = read(fd, id, sizeof *id);
            close(fd);
            if (got == (ssize_t)sizeof *id) return true;
            rt_error("%s: --comm-file holds %zd bytes, not an NCCL id of %zu", path, got,
                     sizeof *id);
            return false;
        }
        if (errno != ENOENT) {
            rt_error("%s: cannot read --comm-file: %s", path, strerror(errno));
            return false;
        }
        if (now_s() > deadline) {
            rt_error("rank %d: %s did not appear within %g s (--comm-timeout): is rank 0 "
                     "running, with the same --comm-file?", nc_rank, path, nc_timeout);
            return false;
        }
        struct timespec pause = {0, 20 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
}

bool cuda_nccl_open(int rank, int world, const char *comm_file, double timeout_s) {
    char why[512];
    nc_rank = rank;
    nc_world = world;
    nc_timeout = timeout_s;
    if (world <= 1) return true;
    if (!cuda_nccl_load(why, sizeof why)) {
        rt_error("rank %d: %s", rank, why);
        return false;
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (rank == 0) {
        if (!NC_CHECK(nc.ncclGetUniqueId(&id)) || !comm_write_id(comm_file, &id)) return false;
    } else if (!comm_read_id(comm_file, &id)) {
        return false;
    }
    if (!wd_running) {
        if (pthread_create(&wd_thread, NULL, wd_main, NULL) != 0) {
            rt_error("rank %d: cannot start the communication watchdog thread", rank);
            return false;
        }
        pthread_detach(wd_thread);
        wd_running = true;
    }
    if (rank == 0) snprintf(wd_comm_file, sizeof wd_comm_file, "%s", comm_file);
    cuda_nccl_arm("meeting the other ranks (ncclCommInitRank)");
    bool ok = NC_CHECK(nc.ncclCommInitRank(&nc_comm, world, id, rank));
    cuda_nccl_disarm();
    wd_comm_file[0] = 0;
    if (rank == 0) unlink(comm_file);   /* every rank has read it: the communicator exists */
    if (!ok) {
        nc_comm = NULL;
        return false;
    }
    /* a blocking stream: it waits for the synchronous copies (legacy stream) that fill its input */
    if (!CU_CHECK(CU(cuStreamCreate)(&nc_stream, CU_STREAM_DEFAULT)) ||
        !CU_CHECK(CU(cuMemAlloc_v2)(&nc_scalars, NCCL_SCALARS * sizeof(double))))
        return false;
    return true;
}

void cuda_nccl_close(void) {
    if (!nc_comm) return;
    cuda_nccl_disarm();
    if (nc_scalars) CU(cuMemFree_v2)(nc_scalars);
    if (nc_stream) CU(cuStreamDestroy_v2)(nc_stream);
    /* abort, not destroy: every collective has finished here (the streams were synchronized),
     * and abort frees the local resources without waiting on peers that may be gone */
    nc.ncclCommAbort(nc_comm);
    nc_comm = NULL;
    nc_scalars = 0;
    nc_stream = NULL;
}

bool cuda_nccl_active(void) { return nc_comm != NULL; }
int cuda_nccl_world(void) { return nc_comm ? nc_world : 1; }
int cuda_nccl_rank(void) { return nc_comm ? nc_rank : 0; }

/* ---------------------------------------------------------------- collectives */

bool cuda_nccl_group(bool start) {
    return start ? NC_CHECK(nc.ncclGroupStart()) : NC_CHECK(nc.ncclGroupEnd());
}

/* A sum, not ncclAvg: the accumulator then holds what one process's accumulator holds after
 * every rank's micro-steps, and the update's grad_scale (1 / (micro-steps x ranks)) makes the
 * mean exactly as one process does. ncclAvg would round each rank's share (x 1/W) to the
 * gradient's type before adding, which for W not a power of two one process never does. */
static bool sum_type(ElemType elem, ncclDataType_t *type) {
    switch (elem) {
    case FMT_F32: *type = ncclFloat32; return true;
    case FMT_BF16: *type = ncclBfloat16; return true;
    default:
        rt_error("rank %d: NCCL: cannot sum %s values", nc_rank, fmt_elem_name(elem));
        return false;
    }
}

bool cuda_nccl_all_reduce_sum(CUdeviceptr buf, int64_t count, ElemType elem, CUstream stream) {
    ncclDataType_t type;
    if (!sum_type(elem, &type)) return false;
    void *p = (void *)(uintptr_t)buf;
    return NC_CHECK(nc.ncclAllReduce(p, p, (size_t)count, type, ncclSum, nc_comm,
                                     (cudaStream_t)stream));
}

/* --shard-states (exec_shard.c): the sum over the ranks of count values at buf, in place on
 * rank `root` (the shard's owner); on the other ranks buf is only read. */
bool cuda_nccl_reduce_sum(CUdeviceptr buf, int64_t count, ElemType elem, int root, CUstream stream) {
    ncclDataType_t type;
    if (!sum_type(elem, &type)) return false;
    void *p = (void *)(uintptr_t)buf;
    return NC_CHECK(nc.ncclReduce(p, p, (size_t)count, type, ncclSum, root, nc_comm, (cudaStream_t)stream));
}

/* --shard-states=2 (exec_grads.c): the sum over the ranks of count values at send, into recv
 * on rank `root` (its shard accumulator); recv is not written on the other ranks. */
bool cuda_nccl_reduce_sum_to(CUdeviceptr send, CUdeviceptr recv, int64_t count, ElemType elem, int root,
                             CUstream stream) {
    ncclDataType_t type;
    if (!sum_type(elem, &type)) return false;
    return NC_CHECK(nc.ncclReduce((void *)(uintptr_t)send, (void *)(uintptr_t)recv, (size_t)count, type, ncclSum,
                                  root, nc_comm, (cudaStream_t)stream));
}

/* rank root's bytes at buf to every rank's buf, in place */
bool cuda_nccl_broadcast_bytes(CUdeviceptr buf, int64_t bytes, int root, CUstream stream) {
    void *p = (void *)(uintptr_t)buf;
    return NC_CHECK(nc.ncclBroadcast(p, p, (size_t)bytes, ncclUint8, root, nc_comm, (cudaStream_t)stream));
}

/* bytes from root's send into every rank's recv (send is read on root only) */
bool cuda_nccl_broadcast_bytes_to(CUdeviceptr send, CUdeviceptr recv, int64_t bytes, int root, CUstream stream) {
    return NC_CHECK(nc.ncclBroadcast((const void *)(uintptr_t)send, (void *)(uintptr_t)recv, (size_t)bytes, ncclUint8,
                                     root, nc_comm, (cudaStream_t)stream));
}

/* count f32 values summed over the ranks, in place */
bool cuda_nccl_all_reduce_sum_f32(CUdeviceptr buf, int64_t count, CUstream stream) {
    void *p = (void *)(uintptr_t)buf;
    return NC_CHECK(nc.ncclAllReduce(p, p, (size_t)count, ncclFloat32, ncclSum, nc_comm, (cudaStream_t)stream));
}

/* count f64 values summed over the ranks, in place (the gradient norm's chunk sums, each
 * nonzero on one rank only: adding zeros is exact, so the sum is that rank's value) */
bool cuda_nccl_all_reduce_sum_f64(CUdeviceptr buf, int64_t count, CUstream stream) {
    void *p = (void *)(uintptr_t)buf;
    return NC_CHECK(nc.ncclAllReduce(p, p, (size_t)count, ncclFloat64, ncclSum, nc_comm, (cudaStream_t)stream));
}

/* point to point, bytes (the save's gather of the states' shards to rank 0) */
bool cuda_nccl_send_bytes(CUdeviceptr buf, int64_t bytes, int peer, CUstream stream) {
    return NC_CHECK(nc.ncclSend((const void *)(uintptr_t)buf, (size_t)bytes, ncclUint8, peer, nc_comm,
                                (cudaStream_t)stream));
}
bool cuda_nccl_recv_bytes(CUdeviceptr buf, int64_t bytes, int peer, CUstream stream) {
    return NC_CHECK(nc.ncclRecv((void *)(uintptr_t)buf, (size_t)bytes, ncclUint8, peer, nc_comm,
                                (cudaStream_t)stream));
}

/* The FP8 reduction's collectives (exec_comm.c): the largest of count floats over the ranks,
 * in place; the all-to-all of its shards (rank r's shard p of `shard` bytes at send + p shard
 * goes to rank p, which receives it at recv + r shard; a rank's own shard stays in send, where
 * the sum reads it); the all-gather of each rank's shard, in place (rank r's at buf + r shard). */
bool cuda_nccl_all_reduce_max_f32(CUdeviceptr buf, int64_t count, CUstream stream) {
    void *p = (void *)(uintptr_t)buf;
    return NC_CHECK(nc.ncclAllReduce(p, p, (size_t)count, ncclFloat32, ncclMax, nc_comm,
                                     (cudaStream_t)stream));
}

bool cuda_nccl_all_to_all_bytes(CUdeviceptr send, CUdeviceptr recv, int64_t shard, CUstream stream) {
    if (!cuda_nccl_group(true)) return false;
    bool ok = true;
    for (int p = 0; ok && p < nc_world; p++) {
        if (p == nc_rank) continue;
        ok = NC_CHECK(nc.ncclSend((const void *)(uintptr_t)(send + (CUdeviceptr)(p * shard)), (size_t)shard,
                                  ncclUint8, p, nc_comm, (cudaStream_t)stream)) &&
             NC_CHECK(nc.ncclRecv((void *)(uintptr_t)(recv + (CUdeviceptr)(p * shard)), (size_t)shard,
                                  ncclUint8, p, nc_comm, (cudaStream_t)stream));
    }
    return cuda_nccl_group(false) && ok;
}

bool cuda_nccl_all_gather_bytes(CUdeviceptr buf, int64_t shard, CUstream stream) {
    return NC_CHECK(nc.ncclAllGather((const void *)(uintptr_t)(buf + (CUdeviceptr)(nc_rank * shard)),
                                     (void *)(uintptr_t)buf, (size_t)shard, ncclUint8, nc_comm,
                                     (cudaStream_t)stream));
}

bool cuda_nccl_broadcast_host(void *buf, size_t bytes, const char *what) {
    if (!nc_comm || !bytes) return true;
    CUdeviceptr d = 0;
    cuda_nccl_arm(what);
    bool ok = CU_CHECK(CU(cuMemAlloc_v2)(&d, bytes)) && CU_CHECK(CU(cuMemcpyHtoD_v2)(d, buf, bytes)) &&
              NC_CHECK(nc.ncclBroadcast((void *)(uintptr_t)d, (void *)(uintptr_t)d, bytes, ncclUint8, 0,
                                        nc_comm, (cudaStream_t)nc_stream)) &&
              CU_CHECK(CU(cuStreamSynchronize)(nc_stream)) && CU_CHECK(CU(cuMemcpyDtoH_v2)(buf, d, bytes));
    cuda_nccl_disarm();
    if (d) CU(cuMemFree_v2)(d);
    return ok;
}

bool cuda_nccl_sum_host(double *v, int n) {
    if (!nc_comm) return true;
    if (n > NCCL_SCALARS) {
        rt_error("rank %d: NCCL: %d scalars to sum, at most %d", nc_rank, n, NCCL_SCALARS);
        return false;
    }
    size_t bytes = (size_t)n * sizeof *v;
    cuda_nccl_arm("summing the step's loss over the ranks");
    bool ok = CU_CHECK(CU(cuMemcpyHtoD_v2)(nc_scalars, v, bytes)) &&
              NC_CHECK(nc.ncclAllReduce((void *)(uintptr_t)nc_scalars, (void *)(uintptr_t)nc_scalars,
                                        (size_t)n, ncclFloat64, ncclSum, nc_comm,
                                        (cudaStream_t)nc_stream)) &&
              CU_CHECK(CU(cuStreamSynchronize)(nc_stream)) &&
              CU_CHECK(CU(cuMemcpyDtoH_v2)(v, nc_scalars, bytes));
    cuda_nccl_disarm();
    return ok;
}
