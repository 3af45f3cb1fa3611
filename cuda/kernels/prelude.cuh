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

// A bf16 pair as one 32-bit word: lo is the element at the lower address.
__device__ __forceinline__ void bf16x2_unpack(unsigned u, float &lo, float &hi) {
	lo = __uint_as_float(u << 16);
	hi = __uint_as_float(u & 0xffff0000u);
}

__device__ __forceinline__ unsigned bf16x2_pack(float lo, float hi) {
	return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

// silu_mul1 is one activation silu(gate) * up from bf16 gate and up, as
// transformers rounds it in bf16 (silu, then the product).
__device__ __forceinline__ bf16 silu_mul1(float g, float u) { return f2bf(rbf(g / (1.f + expf(-g))) * u); }

// pairs_sumsq is one lane's share of a head's sum of squares: its dims
// j, j + 1 (x1) and j + d/2, j + d/2 + 1 (x2).
__device__ __forceinline__ float pairs_sumsq(const float x1[2], const float x2[2]) {
	return x1[0] * x1[0] + x1[1] * x1[1] + x2[0] * x2[0] + x2[1] * x2[1];
}

// qk_norm_rope applies a head's RMSNorm (when norm: weights w1, w2 at the
// lane's dims; inv is rsqrt of the head's mean square plus eps) and the
// rotate-half rotary embedding (c2, s2: the position's cos and sin at the
// lane's dims) to a lane's dims j, j + 1 (x1) and j + d/2, j + d/2 + 1 (x2),
// rounding to bf16 after every operation as transformers does in bf16.
// prepare_qkv uses it; norm_rope8 (prepare_qkv16 and the prefill
// attention's queries) gives the same bits in bf16x2 arithmetic.
__device__ __forceinline__ void qk_norm_rope(float x1[2], float x2[2], bool norm, const float w1[2], const float w2[2],
                                             float inv, float2 c2, float2 s2) {
	if (norm) {
#pragma unroll
		for (int e = 0; e < 2; e++) {
			x1[e] = rbf(w1[e] * rbf(x1[e] * inv));
			x2[e] = rbf(w2[e] * rbf(x2[e] * inv));
		}
	}
	const float c[2] = {rbf(c2.x), rbf(c2.y)}, sv[2] = {rbf(s2.x), rbf(s2.y)};
#pragma unroll
	for (int e = 0; e < 2; e++) {
		const float o1 = rbf(rbf(x1[e] * c[e]) + rbf(-x2[e] * sv[e]));
		const float o2 = rbf(rbf(x2[e] * c[e]) + rbf(x1[e] * sv[e]));
		x1[e] = o1;
		x2[e] = o2;
	}
}

// norm_pairs loads a lane's norm weights at dims j, j + 1 and j + half,
// j + half + 1 (ones without w).
__device__ __forceinline__ void norm_pairs(const bf16 *w, int j, int half, float w1[2], float w2[2]) {
	w1[0] = w1[1] = w2[0] = w2[1] = 1.f;
	if (w) {
		bf16x2_unpack(*(const unsigned *)(w + j), w1[0], w1[1]);
		bf16x2_unpack(*(const unsigned *)(w + j + half), w2[0], w2[1]);
	}
}

// The 16-byte layout of a head of d dims (d % 16 == 0): a group of d/16
// adjacent lanes holds it, lane c of the group dims 8c..8c+7 of the first
// half (a) and the same of the second half (b), so that every rotary pair
// is in one lane. prepare_qkv16 and the prefill attention's queries use it
// alike, so either gives the same bits.
__device__ __forceinline__ void unpack8(uint4 u, float f[8]) {
	bf16x2_unpack(u.x, f[0], f[1]);
	bf16x2_unpack(u.y, f[2], f[3]);
	bf16x2_unpack(u.z, f[4], f[5]);
	bf16x2_unpack(u.w, f[6], f[7]);
}

__device__ __forceinline__ uint4 pack8(const float f[8]) {
	return make_uint4(bf16x2_pack(f[0], f[1]), bf16x2_pack(f[2], f[3]), bf16x2_pack(f[4], f[5]), bf16x2_pack(f[6], f[7]));
}

// head_inv is rsqrt(mean square + eps) of the head held by each group of g
// lanes (g a power of two up to 32, groups aligned); every lane of the warp
// must call it.
__device__ __forceinline__ float head_inv(const float a[8], const float b[8], int g, int d, float eps) {
	float ss = 0.f;
#pragma unroll
	for (int e = 0; e < 8; e++) ss += a[e] * a[e] + b[e] * b[e];
	for (int o = g / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
	return rsqrtf(ss / d + eps);
}

// bf16x2 arithmetic rounds once per operation to bf16, so on bf16 operands
// it gives the bits of rbf after each fp32 operation (a product of two bf16
// is exact in fp32, and an fp32 sum of two bf16 rounded again to bf16 cannot
// land on a tie that the exact sum would not), in a quarter of the
// instructions. Explicit fma.rn keeps the compiler from fusing two steps.
__device__ __forceinline__ unsigned bf2_fma(unsigned a, unsigned b, unsigned c) {
	unsigned r;
	asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
	return r;
}
__device__ __forceinline__ unsigned bf2_mul(unsigned a, unsigned b) { return bf2_fma(a, b, 0x80008000u); }
__device__ __forceinline__ unsigned bf2_add(unsigned a, unsigned b) { return bf2_fma(a, 0x3f803f80u, b); }
__device__ __forceinline__ unsigned bf2_sub(unsigned a, unsigned b) { return bf2_fma(b, 0xbf80bf80u, a); }

// pack_bf16x2: lo in the low half, hi in the high half, each rounded to
// nearest.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
	unsigned r;
	asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
	return r;
}

// norm_rope8 is qk_norm_rope on a lane's eight pairs, dims (a, b) of the
// 16-byte layout held as bf16x2 words, with the norm weights (wa, wb) and
// cos/sin at its dims; inv is the head's rsqrt(mean square + eps).
__device__ __forceinline__ void norm_rope8(uint4 &a, uint4 &b, bool norm, uint4 wa, uint4 wb, float inv,
                                           const float cs[8], const float sn[8]) {
	unsigned au[4] = {a.x, a.y, a.z, a.w}, bu[4] = {b.x, b.y, b.z, b.w};
	const unsigned wau[4] = {wa.x, wa.y, wa.z, wa.w}, wbu[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
	for (int e = 0; e < 4; e++) {
		unsigned x1 = au[e], x2 = bu[e];
		if (norm) {
			float l, h;
			bf16x2_unpack(x1, l, h);
			x1 = bf2_mul(wau[e], pack_bf16x2(l * inv, h * inv));
			bf16x2_unpack(x2, l, h);
			x2 = bf2_mul(wbu[e], pack_bf16x2(l * inv, h * inv));
		}
		const unsigned c = pack_bf16x2(cs[2 * e], cs[2 * e + 1]), sv = pack_bf16x2(sn[2 * e], sn[2 * e + 1]);
		au[e] = bf2_sub(bf2_mul(x1, c), bf2_mul(x2, sv));
		bu[e] = bf2_add(bf2_mul(x2, c), bf2_mul(x1, sv));
	}
	a = make_uint4(au[0], au[1], au[2], au[3]);
	b = make_uint4(bu[0], bu[1], bu[2], bu[3]);
}

__device__ __forceinline__ void load8f(const float *p, float f[8]) {
	const float4 lo = *(const float4 *)p, hi = *(const float4 *)(p + 4);
	f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w, f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
}

// Programmatic dependent launch (sm_90 and later): a kernel launched with
// it may start while the previous kernel of the stream is still running.
// dep_wait blocks until that kernel has finished and its writes are
// visible; dep_launch lets the next kernel start. Every kernel waits in
// every block before it reads what earlier kernels wrote, or writes what
// they read, and before it exits, so the waits chain from kernel to kernel.
// What the step's host copies wrote, and what earlier steps' kernels wrote,
// may be read before the wait: a copy in the stream waits for every earlier
// kernel, and each step's inputs come by copy before its first kernel.
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

// prefetch_l1 asks for p's line into L1 without holding a register: a
// load after a barrier then finds it there.
__device__ __forceinline__ void prefetch_l1(const void *p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

#define DEP()            \
	do {                 \
		dep_wait();      \
		dep_launch();    \
	} while (0)

// Asynchronous 16-byte copies from global to shared memory (sm_80 and
// later); an invalid source fills the 16 bytes with zeros.
__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(unsigned dst, const void *src, bool valid) {
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
	asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

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
