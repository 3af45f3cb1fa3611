// Shared helpers for every ebb kernel. No CUDA headers: NVRTC on the GPU
// machines ships without cuda_bf16.h, so bf16 is a 16-bit integer here and
// conversions use PTX (sm_80 and later).
typedef unsigned short bf16;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;

#define EBB_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((unsigned int)x) << 16); }

__device__ __forceinline__ bf16 f2bf(float f) {
	unsigned short r;
	asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
	return r;
}

__device__ __forceinline__ float warp_sum(float v) {
	for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
	return v;
}

__device__ __forceinline__ float warp_max(float v) {
	for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
	return v;
}

// block_sum reduces over the whole block; shared must hold 32 floats.
__device__ __forceinline__ float block_sum(float v, float *shared) {
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	v = warp_sum(v);
	__syncthreads();
	if (lane == 0) shared[warp] = v;
	__syncthreads();
	int nwarps = (blockDim.x + 31) >> 5;
	v = lane < nwarps ? shared[lane] : 0.f;
	return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float *shared) {
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	v = warp_max(v);
	__syncthreads();
	if (lane == 0) shared[warp] = v;
	__syncthreads();
	int nwarps = (blockDim.x + 31) >> 5;
	v = lane < nwarps ? shared[lane] : -EBB_INF;
	return warp_max(v);
}

// Round through bf16, as a bf16 tensor operation in PyTorch does.
__device__ __forceinline__ float rbf(float f) { return bf2f(f2bf(f)); }

// Programmatic dependent launch (sm_90 and later): a kernel launched with
// it may start while the previous kernel of the stream is still running.
// dep_wait blocks until that kernel has finished and its writes are
// visible; dep_launch lets the next kernel start. Every kernel waits in
// every block before it reads what earlier kernels wrote, or writes what
// they read, and before it exits, so the waits chain from kernel to kernel.
// Without the launch attribute (older GPUs, EBB_PDL=0) both are no-ops.
__device__ __forceinline__ void dep_wait() {
#if __CUDA_ARCH__ >= 900
	asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void dep_launch() {
#if __CUDA_ARCH__ >= 900
	asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define DEP()            \
	do {                 \
		dep_wait();      \
		dep_launch();    \
	} while (0)

// Grid-stride loop over [0, n).
#define FOR_GRID(i, n) \
	for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

// Split-KV decode: split_store writes a split's partial (its output rows
// unnormalised, with their max and sum), or the answer when the sequence
// has one split; split_elect_last elects the split that finishes last to
// merge them all. Every thread of the block calls split_elect_last.
__device__ __forceinline__ void split_store(bf16 *out, float *part_o, float *part_ml, long long rh, int splits, int sp,
                                            int used, int d, int dd, float M, float L, float acc) {
	if (used == 1) {
		out[rh * d + dd] = f2bf(L > 0.f ? acc / L : 0.f);
		return;
	}
	part_o[(rh * splits + sp) * d + dd] = acc;
	if (dd == 0) {
		part_ml[(rh * splits + sp) * 2] = M;
		part_ml[(rh * splits + sp) * 2 + 1] = L;
	}
}

__device__ __forceinline__ bool split_elect_last(int *counter, int used, int *sh_last) {
	__threadfence();
	__syncthreads();
	if (threadIdx.x == 0) *sh_last = atomicAdd(counter, 1) == used - 1;
	__syncthreads();
	if (!*sh_last) return false;
	__threadfence();
	return true;
}
