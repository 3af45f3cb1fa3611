// Our own prototypes for the CUDA driver, NVRTC, cuBLAS and NCCL calls ebb
// makes. The libraries are loaded with dlopen at run time, so building needs
// no CUDA header or library. Layouts follow cuda.h (CUDA 12/13).
#ifndef EBB_CUDA_H
#define EBB_CUDA_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUgraph;
typedef void *CUgraphExec;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
	int type;                 // CU_MEM_ALLOCATION_TYPE_PINNED = 1
	int requestedHandleTypes; // CU_MEM_HANDLE_TYPE_NONE = 0
	CUmemLocation location;   // CU_MEM_LOCATION_TYPE_DEVICE = 1
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef struct { char bytes[16]; } CUuuid;

typedef int nvrtcResult;
typedef void *nvrtcProgram;
typedef int cublasStatus_t;
typedef void *cublasHandle_t;
// cuBLASLt's algorithm and heuristic result as cublasLt.h lays them out.
typedef void *cublasLtHandle_t;
typedef struct { unsigned long long data[8]; } ebbLtAlgo;
typedef struct {
	ebbLtAlgo algo;
	size_t workspaceSize;
	int state;
	float wavesCount;
	int reserved[4];
} ebbLtHeuristic;
typedef int ncclResult_t;
typedef void *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
// ncclConfig_t as NCCL 2.14 introduced it; later versions read the fields
// an older struct has (size, version) and default the rest.
typedef struct {
	size_t size;
	unsigned int magic;
	unsigned int version;
	int blocking;
	int cgaClusterSize;
	int minCTAs;
	int maxCTAs;
	const char *netName;
} ebbNcclConfig;

// CUlaunchAttribute and CUlaunchConfig for cuLaunchKernelEx.
typedef struct {
	int id;
	char pad[4];
	union {
		char pad[64];
		int programmaticStreamSerializationAllowed;
		struct {
			unsigned int x, y, z;
		} clusterDim;
	} value;
} ebbLaunchAttribute;
typedef struct {
	unsigned int gridDimX, gridDimY, gridDimZ;
	unsigned int blockDimX, blockDimY, blockDimZ;
	unsigned int sharedMemBytes;
	CUstream hStream;
	ebbLaunchAttribute *attrs;
	unsigned int numAttrs;
} ebbLaunchConfig;

// X(name, symbol, args, call)
#define EBB_CU_FUNCS(X) \
	X(cuInit, "cuInit", (unsigned int f), (f)) \
	X(cuDriverGetVersion, "cuDriverGetVersion", (int *v), (v)) \
	X(cuDeviceGetCount, "cuDeviceGetCount", (int *n), (n)) \
	X(cuDeviceGet, "cuDeviceGet", (CUdevice *d, int o), (d, o)) \
	X(cuDeviceGetName, "cuDeviceGetName", (char *s, int n, CUdevice d), (s, n, d)) \
	X(cuDeviceGetAttribute, "cuDeviceGetAttribute", (int *v, int a, CUdevice d), (v, a, d)) \
	X(cuDeviceTotalMem, "cuDeviceTotalMem_v2", (size_t *b, CUdevice d), (b, d)) \
	X(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId", (char *s, int n, CUdevice d), (s, n, d)) \
	X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext *c, CUdevice d), (c, d)) \
	X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", (CUdevice d), (d)) \
	X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext c), (c)) \
	X(cuCtxSynchronize, "cuCtxSynchronize", (void), ()) \
	X(cuMemGetInfo, "cuMemGetInfo_v2", (size_t *f, size_t *t), (f, t)) \
	X(cuMemAddressReserve, "cuMemAddressReserve", (CUdeviceptr *p, size_t s, size_t a, CUdeviceptr h, unsigned long long f), (p, s, a, h, f)) \
	X(cuMemAddressFree, "cuMemAddressFree", (CUdeviceptr p, size_t s), (p, s)) \
	X(cuMemCreate, "cuMemCreate", (CUmemGenericAllocationHandle *h, size_t s, const CUmemAllocationProp *p, unsigned long long f), (h, s, p, f)) \
	X(cuMemRelease, "cuMemRelease", (CUmemGenericAllocationHandle h), (h)) \
	X(cuMemMap, "cuMemMap", (CUdeviceptr p, size_t s, size_t o, CUmemGenericAllocationHandle h, unsigned long long f), (p, s, o, h, f)) \
	X(cuMemUnmap, "cuMemUnmap", (CUdeviceptr p, size_t s), (p, s)) \
	X(cuMemSetAccess, "cuMemSetAccess", (CUdeviceptr p, size_t s, const CUmemAccessDesc *d, size_t n), (p, s, d, n)) \
	X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", (size_t *g, const CUmemAllocationProp *p, int o), (g, p, o)) \
	X(cuMemHostAlloc, "cuMemHostAlloc", (void **p, size_t s, unsigned int f), (p, s, f)) \
	X(cuMemFreeHost, "cuMemFreeHost", (void *p), (p)) \
	X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", (CUdeviceptr d, const void *s, size_t n, CUstream st), (d, s, n, st)) \
	X(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", (void *d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st)) \
	X(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st)) \
	X(cuMemsetD32Async, "cuMemsetD32Async", (CUdeviceptr d, unsigned int v, size_t n, CUstream st), (d, v, n, st)) \
	X(cuMemsetD8Async, "cuMemsetD8Async", (CUdeviceptr d, unsigned char v, size_t n, CUstream st), (d, v, n, st)) \
	X(cuStreamCreate, "cuStreamCreate", (CUstream *s, unsigned int f), (s, f)) \
	X(cuStreamDestroy, "cuStreamDestroy_v2", (CUstream s), (s)) \
	X(cuStreamSynchronize, "cuStreamSynchronize", (CUstream s), (s)) \
	X(cuEventCreate, "cuEventCreate", (CUevent *e, unsigned int f), (e, f)) \
	X(cuEventDestroy, "cuEventDestroy_v2", (CUevent e), (e)) \
	X(cuEventRecord, "cuEventRecord", (CUevent e, CUstream s), (e, s)) \
	X(cuEventSynchronize, "cuEventSynchronize", (CUevent e), (e)) \
	X(cuEventElapsedTime, "cuEventElapsedTime", (float *ms, CUevent a, CUevent b), (ms, a, b)) \
	X(cuModuleLoadData, "cuModuleLoadData", (CUmodule *m, const void *img), (m, img)) \
	X(cuModuleUnload, "cuModuleUnload", (CUmodule m), (m)) \
	X(cuModuleGetFunction, "cuModuleGetFunction", (CUfunction *f, CUmodule m, const char *n), (f, m, n)) \
	X(cuFuncSetAttribute, "cuFuncSetAttribute", (CUfunction f, int a, int v), (f, a, v)) \
	X(cuLaunchKernel, "cuLaunchKernel", (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by, unsigned int bz, unsigned int sh, CUstream s, void **p, void **e), (f, gx, gy, gz, bx, by, bz, sh, s, p, e)) \
	X(cuStreamBeginCapture, "cuStreamBeginCapture_v2", (CUstream s, int mode), (s, mode)) \
	X(cuStreamEndCapture, "cuStreamEndCapture", (CUstream s, CUgraph *g), (s, g)) \
	X(cuGraphInstantiate, "cuGraphInstantiateWithFlags", (CUgraphExec *e, CUgraph g, unsigned long long f), (e, g, f)) \
	X(cuGraphLaunch, "cuGraphLaunch", (CUgraphExec e, CUstream s), (e, s)) \
	X(cuGraphUpload, "cuGraphUpload", (CUgraphExec e, CUstream s), (e, s)) \
	X(cuGraphExecDestroy, "cuGraphExecDestroy", (CUgraphExec e), (e)) \
	X(cuGraphDestroy, "cuGraphDestroy", (CUgraph g), (g)) \
	X(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", (CUdeviceptr *p, CUipcMemHandle h, unsigned int f), (p, h, f)) \
	X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", (CUdeviceptr p), (p)) \
	X(cuIpcGetMemHandle, "cuIpcGetMemHandle", (CUipcMemHandle *h, CUdeviceptr p), (h, p)) \
	X(cuIpcOpenEventHandle, "cuIpcOpenEventHandle", (CUevent *e, CUipcEventHandle h), (e, h)) \
	X(cuStreamWaitEvent, "cuStreamWaitEvent", (CUstream s, CUevent e, unsigned int f), (s, e, f)) \
	X(cuStreamQuery, "cuStreamQuery", (CUstream s), (s)) \
	X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr *p, size_t n), (p, n)) \
	X(cuMemFree, "cuMemFree_v2", (CUdeviceptr p), (p)) \
	X(cuDeviceGetUuid, "cuDeviceGetUuid_v2", (CUuuid *u, CUdevice d), (u, d)) \
	X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", (void *sh, CUmemGenericAllocationHandle h, int type, unsigned long long f), (sh, h, type, f)) \
	X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", (CUmemGenericAllocationHandle *h, void *os, int type), (h, os, type)) \
	X(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", (int *can, CUdevice d, CUdevice peer), (can, d, peer)) \
	X(cuProfilerStart, "cuProfilerStart", (void), ()) \
	X(cuCtxSetLimit, "cuCtxSetLimit", (int limit, size_t v), (limit, v)) \
	X(cuCtxGetLimit, "cuCtxGetLimit", (size_t *v, int limit), (v, limit)) \
	X(cuProfilerStop, "cuProfilerStop", (void), ())

#define EBB_NVRTC_FUNCS(X) \
	X(nvrtcVersion, "nvrtcVersion", (int *a, int *b), (a, b)) \
	X(nvrtcCreateProgram, "nvrtcCreateProgram", (nvrtcProgram *p, const char *src, const char *name, int nh, const char *const *h, const char *const *hn), (p, src, name, nh, h, hn)) \
	X(nvrtcCompileProgram, "nvrtcCompileProgram", (nvrtcProgram p, int n, const char *const *o), (p, n, o)) \
	X(nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize", (nvrtcProgram p, size_t *n), (p, n)) \
	X(nvrtcGetProgramLog, "nvrtcGetProgramLog", (nvrtcProgram p, char *s), (p, s)) \
	X(nvrtcGetPTXSize, "nvrtcGetPTXSize", (nvrtcProgram p, size_t *n), (p, n)) \
	X(nvrtcGetPTX, "nvrtcGetPTX", (nvrtcProgram p, char *s), (p, s)) \
	X(nvrtcGetCUBINSize, "nvrtcGetCUBINSize", (nvrtcProgram p, size_t *n), (p, n)) \
	X(nvrtcGetCUBIN, "nvrtcGetCUBIN", (nvrtcProgram p, char *s), (p, s)) \
	X(nvrtcDestroyProgram, "nvrtcDestroyProgram", (nvrtcProgram *p), (p))

#define EBB_CUBLAS_FUNCS(X) \
	X(cublasCreate, "cublasCreate_v2", (cublasHandle_t *h), (h)) \
	X(cublasDestroy, "cublasDestroy_v2", (cublasHandle_t h), (h)) \
	X(cublasSetStream, "cublasSetStream_v2", (cublasHandle_t h, CUstream s), (h, s)) \
	X(cublasSetWorkspace, "cublasSetWorkspace_v2", (cublasHandle_t h, void *w, size_t n), (h, w, n)) \
	X(cublasSetMathMode, "cublasSetMathMode", (cublasHandle_t h, int m), (h, m)) \
	X(cublasGemmEx, "cublasGemmEx", (cublasHandle_t h, int ta, int tb, int m, int n, int k, const void *alpha, const void *A, int at, int lda, const void *B, int bt, int ldb, const void *beta, void *C, int ct, int ldc, int compute, int algo), (h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc, compute, algo))

#define EBB_CUBLASLT_FUNCS(X) \
	X(cublasLtCreate, "cublasLtCreate", (cublasLtHandle_t *h), (h)) \
	X(cublasLtDestroy, "cublasLtDestroy", (cublasLtHandle_t h), (h)) \
	X(cublasLtMatmulDescCreate, "cublasLtMatmulDescCreate", (void **d, int compute, int scale), (d, compute, scale)) \
	X(cublasLtMatmulDescDestroy, "cublasLtMatmulDescDestroy", (void *d), (d)) \
	X(cublasLtMatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute", (void *d, int attr, const void *buf, size_t n), (d, attr, buf, n)) \
	X(cublasLtMatrixLayoutCreate, "cublasLtMatrixLayoutCreate", (void **l, int type, unsigned long long rows, unsigned long long cols, long long ld), (l, type, rows, cols, ld)) \
	X(cublasLtMatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy", (void *l), (l)) \
	X(cublasLtMatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate", (void **p), (p)) \
	X(cublasLtMatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy", (void *p), (p)) \
	X(cublasLtMatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute", (void *p, int attr, const void *buf, size_t n), (p, attr, buf, n)) \
	X(cublasLtMatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic", (cublasLtHandle_t h, void *d, void *a, void *b, void *c, void *dl, void *p, int req, ebbLtHeuristic *res, int *n), (h, d, a, b, c, dl, p, req, res, n)) \
	X(cublasLtMatmulAlgoConfigGetAttribute, "cublasLtMatmulAlgoConfigGetAttribute", (const ebbLtAlgo *algo, int attr, void *buf, size_t n, size_t *written), (algo, attr, buf, n, written)) \
	X(cublasLtMatmul, "cublasLtMatmul", (cublasLtHandle_t h, void *d, const void *alpha, const void *A, void *la, const void *B, void *lb, const void *beta, const void *C, void *lc, void *D, void *ld, const ebbLtAlgo *algo, void *ws, size_t wsSize, CUstream s), (h, d, alpha, A, la, B, lb, beta, C, lc, D, ld, algo, ws, wsSize, s))

#define EBB_NCCL_FUNCS(X) \
	X(ncclGetVersion, "ncclGetVersion", (int *v), (v)) \
	X(ncclGetUniqueId, "ncclGetUniqueId", (ncclUniqueId *id), (id)) \
	X(ncclCommInitRank, "ncclCommInitRank", (ncclComm_t *c, int n, ncclUniqueId id, int r), (c, n, id, r)) \
	X(ncclCommInitRankConfig, "ncclCommInitRankConfig", (ncclComm_t *c, int n, ncclUniqueId id, int r, ebbNcclConfig *cfg), (c, n, id, r, cfg)) \
	X(ncclCommGetAsyncError, "ncclCommGetAsyncError", (ncclComm_t c, int *state), (c, state)) \
	X(ncclCommAbort, "ncclCommAbort", (ncclComm_t c), (c)) \
	X(ncclCommDestroy, "ncclCommDestroy", (ncclComm_t c), (c)) \
	X(ncclBroadcast, "ncclBroadcast", (const void *s, void *r, size_t n, int dt, int root, ncclComm_t c, CUstream st), (s, r, n, dt, root, c, st)) \
	X(ncclAllReduce, "ncclAllReduce", (const void *s, void *r, size_t n, int dt, int op, ncclComm_t c, CUstream st), (s, r, n, dt, op, c, st)) \
	X(ncclAllGather, "ncclAllGather", (const void *s, void *r, size_t n, int dt, ncclComm_t c, CUstream st), (s, r, n, dt, c, st))

#define EBB_DECLARE(name, sym, args, call) int ebb_##name args;
EBB_CU_FUNCS(EBB_DECLARE)
EBB_NVRTC_FUNCS(EBB_DECLARE)
EBB_CUBLAS_FUNCS(EBB_DECLARE)
EBB_CUBLASLT_FUNCS(EBB_DECLARE)
EBB_NCCL_FUNCS(EBB_DECLARE)
#undef EBB_DECLARE

// Loaders return 0 on success, or -1 with a message in err.
int ebb_load_cuda(char *err, int n);
int ebb_load_nvrtc(char *err, int n);
int ebb_load_cublas(char *err, int n);
int ebb_load_cublaslt(char *err, int n);
int ebb_load_nccl(char *err, int n);

const char *ebb_cu_error_name(int code);
const char *ebb_nvrtc_error_string(int code);
const char *ebb_nccl_error_string(int code);

// ebb_launch passes nargs 8-byte kernel arguments packed in args. With pdl
// (and cuLaunchKernelEx in the driver) the kernel may start while the
// previous one in the stream finishes (programmatic dependent launch).
// cluster_z > 1 launches thread block clusters of that many blocks along z
// (cuLaunchKernelEx only). The nmaps 128-byte tensor maps at maps come
// first, as the kernel's first parameters.
int ebb_launch(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
	unsigned int by, unsigned int bz, unsigned int shmem, CUstream s, unsigned long long *args, int nargs, int pdl,
	unsigned int cluster_z, void *maps, int nmaps);
int ebb_has_launch_ex(void);
// ebb_max_active_clusters is how many clusters of cluster_z blocks of bx
// threads and shmem bytes of dynamic shared memory can run at once
// (CUDA_ERROR_NOT_SUPPORTED where the driver cannot say).
int ebb_max_active_clusters(int *n, CUfunction f, unsigned int bx, unsigned int shmem, unsigned int cluster_z);
int ebb_has_tensor_maps(void);

// ebb_tensor_map_bf16 encodes a tiled tensor map (CUtensorMap, 128 bytes)
// of a bf16 tensor: dims innermost first, strides in bytes of dims 1..rank-1.
int ebb_tensor_map_bf16(void *map, unsigned int rank, CUdeviceptr addr, const unsigned long long *dims,
	const unsigned long long *strides, const unsigned int *box, int swizzle128);

// ebb_mem_import_fd imports an allocation exported as a POSIX file
// descriptor (the driver takes the descriptor in place of a pointer).
int ebb_mem_import_fd(CUmemGenericAllocationHandle *h, int fd);

// NCCL calls with device pointers as integers.
int ebb_nccl_broadcast(CUdeviceptr buf, size_t n, int dtype, int root, ncclComm_t c, CUstream s);
int ebb_nccl_all_reduce(CUdeviceptr send, CUdeviceptr recv, size_t n, int dtype, int op, ncclComm_t c, CUstream s);
int ebb_nccl_all_gather(CUdeviceptr send, CUdeviceptr recv, size_t n, int dtype, ncclComm_t c, CUstream s);
// ebb_nccl_init starts a communicator through ncclCommInitRankConfig; with
// blocking = 0 it can be aborted while it connects.
int ebb_nccl_init(ncclComm_t *c, int n, const char *id, int rank, int blocking);

// Device pointers stay integers on the Go side; these cast them for cuBLAS.
int ebb_cublas_set_workspace(cublasHandle_t h, CUdeviceptr w, size_t n);
// out[m,n] (row-major) = x[m,k] @ w[n,k]^T; bf16 inputs, fp32 accumulate.
int ebb_gemm_bf16(cublasHandle_t h, int m, int n, int k, CUdeviceptr x, CUdeviceptr w, CUdeviceptr out, int out_type,
                  float beta);

// The same product through cuBLASLt. ebb_lt_algos lists up to max
// algorithms in the heuristic's order with each one's split-K count (and
// waves, the heuristic's estimate of the grid in waves, where not null);
// ebb_lt_gemm runs one of them.
int ebb_lt_algos(cublasLtHandle_t h, int m, int n, int k, int out_type, size_t ws_size, ebbLtAlgo *algos, int *splitk,
                 float *waves, int max, int *count);
int ebb_lt_gemm(cublasLtHandle_t h, int m, int n, int k, CUdeviceptr x, CUdeviceptr w, CUdeviceptr out, int out_type,
                const ebbLtAlgo *algo, CUdeviceptr ws, size_t ws_size, CUstream s);

#endif
