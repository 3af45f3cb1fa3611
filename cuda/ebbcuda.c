#include "ebbcuda.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EBB_POINTER(name, sym, args, call) static int (*p_##name) args;
EBB_CU_FUNCS(EBB_POINTER)
EBB_NVRTC_FUNCS(EBB_POINTER)
EBB_CUBLAS_FUNCS(EBB_POINTER)
EBB_CUBLASLT_FUNCS(EBB_POINTER)
EBB_NCCL_FUNCS(EBB_POINTER)
#undef EBB_POINTER

// A missing library gives code -1000 from every call rather than a crash.
#define EBB_WRAP(name, sym, args, call) \
	int ebb_##name args { return p_##name ? p_##name call : -1000; }
EBB_CU_FUNCS(EBB_WRAP)
EBB_NVRTC_FUNCS(EBB_WRAP)
EBB_CUBLAS_FUNCS(EBB_WRAP)
EBB_CUBLASLT_FUNCS(EBB_WRAP)
EBB_NCCL_FUNCS(EBB_WRAP)
#undef EBB_WRAP

static int (*p_cuGetErrorName)(int, const char **);
// cuLaunchKernelEx (CUDA 12.0+) is optional: without it kernels launch the
// classic way and programmatic dependent launch is off.
static int (*p_cuLaunchKernelEx)(const ebbLaunchConfig *, CUfunction, void **, void **);
// cuOccupancyMaxActiveClusters (CUDA 12.0+) is optional as well: without it
// a grid of clusters is taken to fit wherever its blocks do.
static int (*p_cuOccupancyMaxActiveClusters)(int *, CUfunction, const ebbLaunchConfig *);
// cuTensorMapEncodeTiled (CUDA 12.0+) is optional too: without it the
// products that read through the tensor memory accelerator stay off.
static int (*p_cuTensorMapEncodeTiled)(void *, int, unsigned int, void *, const unsigned long long *,
	const unsigned long long *, const unsigned int *, const unsigned int *, int, int, int, int);
static const char *(*p_nvrtcGetErrorString)(int);
static const char *(*p_ncclGetErrorString)(int);

// open_first tries each soname on the loader's path, then in the CUDA
// toolkit's usual places (often missing from ld.so.conf).
static void *open_first(const char *const *names, char *err, int n) {
	static const char *const dirs[] = {"", "/usr/local/cuda/lib64/", "/usr/local/cuda/targets/x86_64-linux/lib/", NULL};
	char path[512];
	for (int d = 0; dirs[d]; d++) {
		for (int i = 0; names[i]; i++) {
			snprintf(path, sizeof path, "%s%s", dirs[d], names[i]);
			void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
			if (h) return h;
		}
	}
	snprintf(err, n, "none of %s%s could be loaded (%s)", names[0], names[1] ? " and its other versions" : "",
		dlerror());
	return NULL;
}

#define EBB_RESOLVE(name, sym, args, call) \
	p_##name = (int(*) args)dlsym(h, sym); \
	if (!p_##name) { snprintf(err, n, "%s: symbol %s not found", lib, sym); return -1; }

int ebb_load_cuda(char *err, int n) {
	static const char *const names[] = {"libcuda.so.1", "libcuda.so", NULL};
	const char *lib = "libcuda";
	void *h = open_first(names, err, n);
	if (!h) return -1;
	EBB_CU_FUNCS(EBB_RESOLVE)
	p_cuGetErrorName = (int (*)(int, const char **))dlsym(h, "cuGetErrorName");
	p_cuLaunchKernelEx = (int (*)(const ebbLaunchConfig *, CUfunction, void **, void **))dlsym(h, "cuLaunchKernelEx");
	p_cuOccupancyMaxActiveClusters = (int (*)(int *, CUfunction, const ebbLaunchConfig *))dlsym(h,
		"cuOccupancyMaxActiveClusters");
	p_cuTensorMapEncodeTiled = (int (*)(void *, int, unsigned int, void *, const unsigned long long *,
		const unsigned long long *, const unsigned int *, const unsigned int *, int, int, int, int))dlsym(h,
		"cuTensorMapEncodeTiled");
	return 0;
}

int ebb_load_nvrtc(char *err, int n) {
	static const char *const names[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so", NULL};
	const char *lib = "libnvrtc";
	void *h = open_first(names, err, n);
	if (!h) return -1;
	EBB_NVRTC_FUNCS(EBB_RESOLVE)
	p_nvrtcGetErrorString = (const char *(*)(int))dlsym(h, "nvrtcGetErrorString");
	return 0;
}

int ebb_load_cublas(char *err, int n) {
	static const char *const names[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so", NULL};
	const char *lib = "libcublas";
	void *h = open_first(names, err, n);
	if (!h) return -1;
	EBB_CUBLAS_FUNCS(EBB_RESOLVE)
	return 0;
}

int ebb_load_cublaslt(char *err, int n) {
	static const char *const names[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so", NULL};
	const char *lib = "libcublasLt";
	void *h = open_first(names, err, n);
	if (!h) return -1;
	EBB_CUBLASLT_FUNCS(EBB_RESOLVE)
	return 0;
}

int ebb_load_nccl(char *err, int n) {
	static const char *const names[] = {"libnccl.so.2", "libnccl.so", NULL};
	const char *lib = "libnccl";
	/* EBB_NCCL_LIBRARY picks a build, e.g. the one a trainer's PyTorch
	   bundles, when the system's would not talk to it. */
	const char *chosen = getenv("EBB_NCCL_LIBRARY");
	void *h = NULL;
	if (chosen && *chosen) {
		h = dlopen(chosen, RTLD_NOW | RTLD_GLOBAL);
		if (!h) {
			snprintf(err, n, "EBB_NCCL_LIBRARY=%s could not be loaded (%s)", chosen, dlerror());
			return -1;
		}
	} else {
		h = open_first(names, err, n);
	}
	if (!h) return -1;
	EBB_NCCL_FUNCS(EBB_RESOLVE)
	p_ncclGetErrorString = (const char *(*)(int))dlsym(h, "ncclGetErrorString");
	return 0;
}
#undef EBB_RESOLVE

const char *ebb_cu_error_name(int code) {
	const char *s = NULL;
	if (code == -1000) return "EBB_LIBRARY_NOT_LOADED";
	if (p_cuGetErrorName && p_cuGetErrorName(code, &s) == 0 && s) return s;
	return "CUDA_ERROR_UNKNOWN_CODE";
}

const char *ebb_nvrtc_error_string(int code) {
	if (code == -1000) return "EBB_LIBRARY_NOT_LOADED";
	return p_nvrtcGetErrorString ? p_nvrtcGetErrorString(code) : "NVRTC_ERROR";
}

const char *ebb_nccl_error_string(int code) {
	if (code == -1000) return "EBB_LIBRARY_NOT_LOADED";
	return p_ncclGetErrorString ? p_ncclGetErrorString(code) : "NCCL_ERROR";
}

int ebb_launch(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
	unsigned int by, unsigned int bz, unsigned int shmem, CUstream s, unsigned long long *args, int nargs, int pdl,
	unsigned int cluster_z, void *maps, int nmaps) {
	void *params[48];
	if (nmaps + nargs > 48) return 1; // CUDA_ERROR_INVALID_VALUE
	for (int i = 0; i < nmaps; i++) params[i] = (char *)maps + 128 * i;
	for (int i = 0; i < nargs; i++) params[nmaps + i] = &args[i];
	if ((pdl || cluster_z > 1) && p_cuLaunchKernelEx) {
		ebbLaunchAttribute attrs[2];
		ebbLaunchConfig cfg;
		unsigned int n = 0;
		memset(attrs, 0, sizeof attrs);
		if (pdl) {
			attrs[n].id = 6; /* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION */
			attrs[n++].value.programmaticStreamSerializationAllowed = 1;
		}
		if (cluster_z > 1) {
			attrs[n].id = 4; /* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION */
			attrs[n].value.clusterDim.x = 1, attrs[n].value.clusterDim.y = 1;
			attrs[n++].value.clusterDim.z = cluster_z;
		}
		cfg.gridDimX = gx, cfg.gridDimY = gy, cfg.gridDimZ = gz;
		cfg.blockDimX = bx, cfg.blockDimY = by, cfg.blockDimZ = bz;
		cfg.sharedMemBytes = shmem;
		cfg.hStream = s;
		cfg.attrs = attrs;
		cfg.numAttrs = n;
		return p_cuLaunchKernelEx(&cfg, f, params, NULL);
	}
	if (cluster_z > 1) return 801; // CUDA_ERROR_NOT_SUPPORTED
	return ebb_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, NULL);
}

int ebb_has_launch_ex(void) { return p_cuLaunchKernelEx != NULL; }

int ebb_max_active_clusters(int *n, CUfunction f, unsigned int bx, unsigned int shmem, unsigned int cluster_z) {
	if (!p_cuOccupancyMaxActiveClusters) return 801; // CUDA_ERROR_NOT_SUPPORTED
	ebbLaunchAttribute attr;
	ebbLaunchConfig cfg;
	memset(&attr, 0, sizeof attr);
	memset(&cfg, 0, sizeof cfg);
	attr.id = 4; /* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION */
	attr.value.clusterDim.x = 1, attr.value.clusterDim.y = 1, attr.value.clusterDim.z = cluster_z;
	// The grid only has to be a multiple of the cluster; its size does not
	// change the answer.
	cfg.gridDimX = 1, cfg.gridDimY = 1, cfg.gridDimZ = cluster_z;
	cfg.blockDimX = bx, cfg.blockDimY = 1, cfg.blockDimZ = 1;
	cfg.sharedMemBytes = shmem;
	cfg.attrs = &attr;
	cfg.numAttrs = 1;
	return p_cuOccupancyMaxActiveClusters(n, f, &cfg);
}

int ebb_has_tensor_maps(void) { return p_cuTensorMapEncodeTiled != NULL; }

int ebb_tensor_map_bf16(void *map, unsigned int rank, CUdeviceptr addr, const unsigned long long *dims,
	const unsigned long long *strides, const unsigned int *box, int swizzle128) {
	unsigned int ones[5] = {1, 1, 1, 1, 1};
	if (!p_cuTensorMapEncodeTiled) return 801; // CUDA_ERROR_NOT_SUPPORTED
	if (rank > 5) return 1;
	/* CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, no interleave, 128-byte swizzle or
	   none, 256-byte L2 promotion, zeros out of bounds */
	return p_cuTensorMapEncodeTiled(map, 9, rank, (void *)addr, dims, strides, box, ones, 0, swizzle128 ? 3 : 0, 3, 0);
}

int ebb_nccl_broadcast(CUdeviceptr buf, size_t n, int dtype, int root, ncclComm_t c, CUstream s) {
	return ebb_ncclBroadcast((const void *)buf, (void *)buf, n, dtype, root, c, s);
}

int ebb_nccl_all_reduce(CUdeviceptr send, CUdeviceptr recv, size_t n, int dtype, int op, ncclComm_t c, CUstream s) {
	return ebb_ncclAllReduce((const void *)send, (void *)recv, n, dtype, op, c, s);
}

int ebb_nccl_all_gather(CUdeviceptr send, CUdeviceptr recv, size_t n, int dtype, ncclComm_t c, CUstream s) {
	return ebb_ncclAllGather((const void *)send, (void *)recv, n, dtype, c, s);
}

int ebb_nccl_init(ncclComm_t *c, int n, const char *id, int rank, int blocking) {
	ebbNcclConfig cfg;
	ncclUniqueId uid;
	memset(&cfg, 0, sizeof cfg);
	cfg.size = sizeof cfg;
	cfg.magic = 0xcafebeef;
	cfg.version = 21400; /* NCCL_VERSION(2, 14, 0) */
	cfg.blocking = blocking;
	cfg.cgaClusterSize = cfg.minCTAs = cfg.maxCTAs = (int)0x80000000; /* NCCL_CONFIG_UNDEF_INT */
	cfg.netName = NULL;
	memcpy(uid.internal, id, sizeof uid.internal);
	return ebb_ncclCommInitRankConfig(c, n, uid, rank, &cfg);
}

int ebb_cublas_set_workspace(cublasHandle_t h, CUdeviceptr w, size_t n) {
	return ebb_cublasSetWorkspace(h, (void *)w, n);
}

// Row-major out = x w^T is column-major out^T = w^T' x^T': cuBLAS computes
// C(n x m) = op(A) op(B) with A = w (k x n column-major, transposed) and
// B = x (k x m column-major).
int ebb_gemm_bf16(cublasHandle_t h, int m, int n, int k, CUdeviceptr x, CUdeviceptr w, CUdeviceptr out, int out_type,
                  float beta) {
	const float alpha = 1.f;
	return ebb_cublasGemmEx(h, 1 /* T */, 0 /* N */, n, m, k, &alpha, (const void *)w, 14 /* bf16 */, k,
		(const void *)x, 14, k, &beta, (void *)out, out_type, n, 68 /* CUBLAS_COMPUTE_32F */, -1 /* default */);
}

// cublasLt.h's attribute numbers.
enum {
	LT_DESC_TRANSA = 3,
	LT_DESC_TRANSB = 4,
	LT_PREF_MAX_WORKSPACE = 1,
	LT_CONFIG_SPLITK = 2,
};

// lt_problem describes out = x w^T as ebb_gemm_bf16 does (column-major
// out^T = op(w) x^T); the caller destroys what it returns.
static int lt_problem(int m, int n, int k, int out_type, void **desc, void *lay[3]) {
	const int trans = 1, notrans = 0;
	int r = ebb_cublasLtMatmulDescCreate(desc, 68 /* CUBLAS_COMPUTE_32F */, 0 /* CUDA_R_32F */);
	if (r) return r;
	if ((r = ebb_cublasLtMatmulDescSetAttribute(*desc, LT_DESC_TRANSA, &trans, sizeof trans))) return r;
	if ((r = ebb_cublasLtMatmulDescSetAttribute(*desc, LT_DESC_TRANSB, &notrans, sizeof notrans))) return r;
	if ((r = ebb_cublasLtMatrixLayoutCreate(&lay[0], 14 /* bf16 */, k, n, k))) return r;
	if ((r = ebb_cublasLtMatrixLayoutCreate(&lay[1], 14, k, m, k))) return r;
	return ebb_cublasLtMatrixLayoutCreate(&lay[2], out_type, n, m, n);
}

static void lt_release(void *desc, void *lay[3]) {
	for (int i = 0; i < 3; i++)
		if (lay[i]) ebb_cublasLtMatrixLayoutDestroy(lay[i]);
	if (desc) ebb_cublasLtMatmulDescDestroy(desc);
}

int ebb_lt_algos(cublasLtHandle_t h, int m, int n, int k, int out_type, size_t ws_size, ebbLtAlgo *algos, int *splitk,
                 float *waves, int max, int *count) {
	void *desc = NULL, *lay[3] = {NULL, NULL, NULL}, *pref = NULL;
	ebbLtHeuristic res[16];
	*count = 0;
	if (max > 16) max = 16;
	int r = lt_problem(m, n, k, out_type, &desc, lay);
	if (!r) r = ebb_cublasLtMatmulPreferenceCreate(&pref);
	if (!r) r = ebb_cublasLtMatmulPreferenceSetAttribute(pref, LT_PREF_MAX_WORKSPACE, &ws_size, sizeof ws_size);
	if (!r) r = ebb_cublasLtMatmulAlgoGetHeuristic(h, desc, lay[0], lay[1], lay[2], lay[2], pref, max, res, count);
	for (int i = 0; !r && i < *count; i++) {
		size_t got = 0;
		unsigned int sk = 1;
		algos[i] = res[i].algo;
		if (ebb_cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, LT_CONFIG_SPLITK, &sk, sizeof sk, &got)) sk = 0;
		splitk[i] = (int)sk;
		if (waves) waves[i] = res[i].wavesCount;
	}
	if (pref) ebb_cublasLtMatmulPreferenceDestroy(pref);
	lt_release(desc, lay);
	return r;
}

int ebb_lt_gemm(cublasLtHandle_t h, int m, int n, int k, CUdeviceptr x, CUdeviceptr w, CUdeviceptr out, int out_type,
                const ebbLtAlgo *algo, CUdeviceptr ws, size_t ws_size, CUstream s) {
	void *desc = NULL, *lay[3] = {NULL, NULL, NULL};
	const float alpha = 1.f, beta = 0.f;
	int r = lt_problem(m, n, k, out_type, &desc, lay);
	if (!r)
		r = ebb_cublasLtMatmul(h, desc, &alpha, (const void *)w, lay[0], (const void *)x, lay[1], &beta, (const void *)out,
			lay[2], (void *)out, lay[2], algo, (void *)ws, ws_size, s);
	lt_release(desc, lay);
	return r;
}

int ebb_mem_import_fd(CUmemGenericAllocationHandle *h, int fd) {
	return ebb_cuMemImportFromShareableHandle(h, (void *)(long)fd, 1 /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */);
}
