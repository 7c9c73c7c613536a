/* gpu_internal.h — what the GPU backend's runtime files share: the driver and cuBLASLt entry
 * points (opened by loader.c) and the macros that check every call.
 *
 * The training binary never links libcuda or libcublasLt: these tables are filled with dlsym
 * once the GPU is chosen. The types come from the CUDA headers at build time only. Every
 * call goes through CU_CHECK / LT_CHECK, which name the call and the place in the source when
 * it fails (one rt_error line) and yield false, so failures travel up as ordinary errors. */
#ifndef FP8C_GPU_INTERNAL_H
#define FP8C_GPU_INTERNAL_H

#include <cuda.h>
#include <cublasLt.h>

#include "gpu.h"

#define CU_FUNCS(X)                                                                          \
    X(cuInit, CUresult, (unsigned))                                                          \
    X(cuDriverGetVersion, CUresult, (int *))                                                 \
    X(cuGetErrorName, CUresult, (CUresult, const char **))                                   \
    X(cuGetErrorString, CUresult, (CUresult, const char **))                                 \
    X(cuDeviceGetCount, CUresult, (int *))                                                   \
    X(cuDeviceGet, CUresult, (CUdevice *, int))                                              \
    X(cuDeviceGetName, CUresult, (char *, int, CUdevice))                                    \
    X(cuDeviceGetAttribute, CUresult, (int *, CUdevice_attribute, CUdevice))                 \
    X(cuDevicePrimaryCtxRetain, CUresult, (CUcontext *, CUdevice))                           \
    X(cuDevicePrimaryCtxRelease_v2, CUresult, (CUdevice))                                    \
    X(cuCtxSetCurrent, CUresult, (CUcontext))                                                \
    X(cuCtxSynchronize, CUresult, (void))                                                    \
    X(cuMemGetInfo_v2, CUresult, (size_t *, size_t *))                                       \
    X(cuMemAlloc_v2, CUresult, (CUdeviceptr *, size_t))                                      \
    X(cuMemFree_v2, CUresult, (CUdeviceptr))                                                 \
    X(cuMemAllocHost_v2, CUresult, (void **, size_t))                                        \
    X(cuMemFreeHost, CUresult, (void *))                                                     \
    X(cuMemcpyHtoD_v2, CUresult, (CUdeviceptr, const void *, size_t))                        \
    X(cuMemcpyDtoH_v2, CUresult, (void *, CUdeviceptr, size_t))                              \
    X(cuMemcpyDtoDAsync_v2, CUresult, (CUdeviceptr, CUdeviceptr, size_t, CUstream))          \
    X(cuMemsetD8Async, CUresult, (CUdeviceptr, unsigned char, size_t, CUstream))             \
    X(cuModuleLoadData, CUresult, (CUmodule *, const void *))                                \
    X(cuModuleUnload, CUresult, (CUmodule))                                                  \
    X(cuModuleGetFunction, CUresult, (CUfunction *, CUmodule, const char *))                 \
    X(cuFuncSetAttribute, CUresult, (CUfunction, CUfunction_attribute, int))                 \
    X(cuFuncGetAttribute, CUresult, (int *, CUfunction_attribute, CUfunction))               \
    X(cuLaunchKernel, CUresult, (CUfunction, unsigned, unsigned, unsigned, unsigned,         \
                                 unsigned, unsigned, unsigned, CUstream, void **, void **))  \
    X(cuLaunchKernelEx, CUresult, (const CUlaunchConfig *, CUfunction, void **, void **))    \
    X(cuStreamCreate, CUresult, (CUstream *, unsigned))                                      \
    X(cuStreamDestroy_v2, CUresult, (CUstream))                                              \
    X(cuStreamSynchronize, CUresult, (CUstream))                                             \
    X(cuStreamBeginCapture_v2, CUresult, (CUstream, CUstreamCaptureMode))                    \
    X(cuStreamEndCapture, CUresult, (CUstream, CUgraph *))                                   \
    X(cuGraphInstantiateWithFlags, CUresult, (CUgraphExec *, CUgraph, unsigned long long))   \
    X(cuGraphLaunch, CUresult, (CUgraphExec, CUstream))                                      \
    X(cuGraphExecDestroy, CUresult, (CUgraphExec))                                           \
    X(cuGraphDestroy, CUresult, (CUgraph))                                                   \
    X(cuEventCreate, CUresult, (CUevent *, unsigned))                                        \
    X(cuEventRecord, CUresult, (CUevent, CUstream))                                          \
    X(cuStreamWaitEvent, CUresult, (CUstream, CUevent, unsigned))                           \
    X(cuEventSynchronize, CUresult, (CUevent))                                               \
    X(cuEventElapsedTime, CUresult, (float *, CUevent, CUevent))                             \
    X(cuEventDestroy_v2, CUresult, (CUevent))                                                \
    X(cuTensorMapEncodeTiled, CUresult, (CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,     \
                                         const cuuint64_t *, const cuuint64_t *, const cuuint32_t *, \
                                         const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle, \
                                         CUtensorMapL2promotion, CUtensorMapFloatOOBfill))

#define LT_FUNCS(X)                                                                          \
    X(cublasLtCreate, cublasStatus_t, (cublasLtHandle_t *))                                  \
    X(cublasLtDestroy, cublasStatus_t, (cublasLtHandle_t))                                   \
    X(cublasLtGetStatusString, const char *, (cublasStatus_t))                               \
    X(cublasLtMatmulDescCreate, cublasStatus_t,                                              \
      (cublasLtMatmulDesc_t *, cublasComputeType_t, cudaDataType_t))                         \
    X(cublasLtMatmulDescDestroy, cublasStatus_t, (cublasLtMatmulDesc_t))                     \
    X(cublasLtMatmulDescSetAttribute, cublasStatus_t,                                        \
      (cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, const void *, size_t))          \
    X(cublasLtMatrixLayoutCreate, cublasStatus_t,                                            \
      (cublasLtMatrixLayout_t *, cudaDataType, uint64_t, uint64_t, int64_t))                 \
    X(cublasLtMatrixLayoutDestroy, cublasStatus_t, (cublasLtMatrixLayout_t))                 \
    X(cublasLtMatmulPreferenceCreate, cublasStatus_t, (cublasLtMatmulPreference_t *))        \
    X(cublasLtMatmulPreferenceDestroy, cublasStatus_t, (cublasLtMatmulPreference_t))         \
    X(cublasLtMatmulPreferenceSetAttribute, cublasStatus_t,                                  \
      (cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t, const void *,       \
       size_t))                                                                              \
    X(cublasLtMatmulAlgoGetHeuristic, cublasStatus_t,                                        \
      (cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,                       \
       cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,               \
       cublasLtMatmulPreference_t, int, cublasLtMatmulHeuristicResult_t *, int *))           \
    X(cublasLtGetVersion, size_t, (void))                                                    \
    X(cublasLtMatmulAlgoCheck, cublasStatus_t,                                               \
      (cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,                       \
       cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,               \
       const cublasLtMatmulAlgo_t *, cublasLtMatmulHeuristicResult_t *))                     \
    X(cublasLtMatmulAlgoConfigGetAttribute, cublasStatus_t,                                  \
      (const cublasLtMatmulAlgo_t *, cublasLtMatmulAlgoConfigAttributes_t, void *, size_t,   \
       size_t *))                                                                            \
    X(cublasLtMatmul, cublasStatus_t,                                                        \
      (cublasLtHandle_t, cublasLtMatmulDesc_t, const void *, const void *,                   \
       cublasLtMatrixLayout_t, const void *, cublasLtMatrixLayout_t, const void *,           \
       const void *, cublasLtMatrixLayout_t, void *, cublasLtMatrixLayout_t,                 \
       const cublasLtMatmulAlgo_t *, void *, size_t, cudaStream_t))

typedef struct {
#define X(name, ret, args) ret(*name) args;
    CU_FUNCS(X)
    LT_FUNCS(X)
#undef X
} CudaApi;

extern CudaApi cuda_api;

/* ---------------------------------------------------------------- loader.c: which GPU */
/* The GPU the executor and the communicator use (default 0): rank % GPUs on a host. */
void cuda_set_device_ordinal(int ordinal);
int cuda_device_ordinal(void);

/* ---------------------------------------------------------------- nccl.c
 * NCCL opened with dlopen, one communicator per process (a rank of a data-parallel run). */
bool cuda_nccl_load(char *why, size_t why_len);     /* libnccl.so.2 is here; else why not */
/* Meets the other ranks through comm_file (rank 0 writes the id, the others wait for it) and
 * makes the communicator, on the current context's GPU; world 1 does nothing. Starts the
 * watchdog that ends the process when an armed step outlives timeout_s or NCCL reports an
 * asynchronous error. False after one rt_error line. */
bool cuda_nccl_open(int rank, int world, const char *comm_file, double timeout_s);
void cuda_nccl_close(void);
bool cuda_nccl_active(void);                        /* a communicator of world > 1 is open */
int cuda_nccl_world(void);
void cuda_nccl_arm(const char *what);               /* what must finish within the timeout */
void cuda_nccl_disarm(void);
bool cuda_nccl_group(bool start);                   /* ncclGroupStart / ncclGroupEnd */
/* Enqueues buf = sum over the ranks of buf (count elements of elem: f32 or bf16). */
bool cuda_nccl_all_reduce_sum(CUdeviceptr buf, int64_t count, ElemType elem, CUstream stream);
int cuda_nccl_rank(void);                           /* this process's rank (0 without NCCL) */
/* The FP8 gradient reduction's collectives (nccl.c says what each moves). */
bool cuda_nccl_all_reduce_max_f32(CUdeviceptr buf, int64_t count, CUstream stream);
bool cuda_nccl_all_to_all_bytes(CUdeviceptr send, CUdeviceptr recv, int64_t shard, CUstream stream);
bool cuda_nccl_all_gather_bytes(CUdeviceptr buf, int64_t shard, CUstream stream);
/* The sharded step's collectives (--shard-states, exec_shard.c; nccl.c says what each moves). */
bool cuda_nccl_reduce_sum(CUdeviceptr buf, int64_t count, ElemType elem, int root, CUstream stream);
bool cuda_nccl_reduce_sum_to(CUdeviceptr send, CUdeviceptr recv, int64_t count, ElemType elem, int root,
                             CUstream stream);
bool cuda_nccl_broadcast_bytes(CUdeviceptr buf, int64_t bytes, int root, CUstream stream);
bool cuda_nccl_broadcast_bytes_to(CUdeviceptr send, CUdeviceptr recv, int64_t bytes, int root, CUstream stream);
bool cuda_nccl_all_reduce_sum_f32(CUdeviceptr buf, int64_t count, CUstream stream);
bool cuda_nccl_all_reduce_sum_f64(CUdeviceptr buf, int64_t count, CUstream stream);
bool cuda_nccl_send_bytes(CUdeviceptr buf, int64_t bytes, int peer, CUstream stream);
bool cuda_nccl_recv_bytes(CUdeviceptr buf, int64_t bytes, int peer, CUstream stream);
bool cuda_nccl_sum_host(double *v, int n);          /* v[i] = sum over the ranks, n <= 16 */
/* buf (host) = rank 0's buf, within the timeout (what: for the watchdog's line) */
bool cuda_nccl_broadcast_host(void *buf, size_t bytes, const char *what);


#define CU(name) (cuda_api.name)
/* Checked calls: false (after one line naming the call and this place) on failure. */
#define CU_CHECK(call) cuda_check_cu((call), #call, __FILE__, __LINE__)
#define LT_CHECK(call) cuda_check_lt((call), #call, __FILE__, __LINE__)
bool cuda_check_cu(CUresult r, const char *call, const char *file, int line);
bool cuda_check_lt(cublasStatus_t r, const char *call, const char *file, int line);

#endif
