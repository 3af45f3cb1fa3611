// matmul_wg_few gives deterministic inference's products of 1 to 16 rows
// the bits matmul_wg gives the same rows in any batch, without matmul_wg's
// machinery (tensor maps, a ring, clusters), which a product of one row
// pays for in latency rather than bandwidth. A row's sums in matmul_wg are:
// per K split (kps 64-wide steps, fixed by the weights' shape), a chain of
// m64nBNk16 wgmma over the split's 16-wide chunks of k in order, from zero;
// then 0 + p0 + p1 + ... over the splits (or p0 alone for one split). Here
// a warp runs one split's chain for 16 weight rows with mma.m16n8k16, whose
// step adds the same 16 products to the accumulator, and the block adds
// its warps' splits in the same order.
//
// A warp (16 weight rows: g and g + 8, or with glu gate g and its up)
// streams its split through a ring of its own in shared memory: each
// stage is 64 of k of its 16 weight rows, of x's rows and of norm_w,
// copied with cp.async in 16-byte pieces (whole 128-byte lines of a row),
// MWF_STAGES stages in flight. (Loads into registers, a chunk a load,
// reached 0.56-1.3 TB/s: a warp waited on its loads in groups.) Thread
// (g, q) then reads k 4q .. 4q + 3 of a 16-wide chunk where the mma's
// fragment layout names k 2q, 2q + 1, 2q + 8 and 2q + 9: each mma still
// adds the chunk's 16 products, only in another order within it, and the
// tensor core's sum of a chunk does not depend on that order:
// TestDeterministicProductsAreRowInvariant holds this layout to
// matmul_wg's bits (H100; the mma's own layout gave the same bits).
//
// Modes as matmul_wg's for deterministic folds: add (residual set:
// residual += the product, rounded as add_rmsnorm rounds it; out is not
// written) and norm (norm_w set: x is a residual h whose rows each warp
// scales with add_rmsnorm_v8's sums in their order, normalised as read).
#ifndef MWF_STAGES
#define MWF_STAGES 4 // 64-wide steps of K a warp has in flight (matMulWGFewStages)
#endif
#define MWF_MAX_WARPS 8
// MWF_PREP_EARLY: matmul_wg_few_qkv's blocks load their step inputs
// (positions, slots, rotations) before the product rather than after it
// (0, for A/B runs). H100, 0.6B shape, flag on, ms a decode step (128 in,
// 128 out), batch 1 / 2: early 0.932 / 1.008 and 0.920 / 1.009, late 0.942
// / 1.018 and 0.950 / 1.025.
#ifndef MWF_PREP_EARLY
#define MWF_PREP_EARLY 1
#endif
// A stage's rows of 128 bytes: 16 of weights, 8 T of x (T batch tiles of
// 8 rows, the mma's N), norm_w.
#define MWF_STAGE(T) ((17 + 8 * (T)) * 128)

// warp_row_scale is the inverse root mean square of h's row (K <= 2048)
// with add_rmsnorm_v8's bits (norm_row8: a thread's eight, then the
// warps', then the warp sums), worked out by one warp: lane l takes the 8 elements thread
// l + 32 w of add_rmsnorm_v8 would, for each of its 8 warps w.
__device__ __forceinline__ float warp_row_scale(const bf16 *h, int K, float eps) {
	const int lane = threadIdx.x & 31;
	float t = 0.f;
#pragma unroll
	for (int w = 0; w < 8; w++) {
		const int i = 8 * (32 * w + lane);
		float ss = 0.f;
		if (i < K) {
			float v[8];
			unpack8(__ldg((const uint4 *)(h + i)), v);
#pragma unroll
			for (int e = 0; e < 8; e++) ss += v[e] * v[e];
		}
		ss = warp_sum(ss);
		if (lane == w) t = ss;
	}
	t = warp_sum(t);
	return rsqrtf(t / K + eps);
}

// mwf_at is the shared address of row r's 16-byte piece p in a stage,
// swizzled so that a chunk's fragments of 8 rows fill every bank.
__device__ __forceinline__ unsigned mwf_at(unsigned stage, int r, int p) { return stage + r * 128 + ((p ^ (r & 7)) << 4); }

__device__ __forceinline__ uint2 lds_u2(unsigned a) {
	uint2 v;
	asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
	return v;
}

// mwf_prepare_head is matmul_wg_few_qkv's epilogue, run by every thread
// once the block's rows of out are stored: the last block to store a
// head's rows (counters[head], zero between launches) prepares the head of
// each of the m tokens with qkv16_finish, reading the rows the head's
// blocks stored (the bf16 prepare_qkv16 would read), so with its bits.
// Every block has loaded its lanes' step inputs (u: token tid / 8) before
// its product, so that the last block does not wait for them.
__device__ __forceinline__ void mwf_prepare_head(bf16 *qkv, int head, int blocks_a_head, int m, int N, int *counters,
                                                 const MwgQkv &p, const MwgQkvUnits<32> &u) {
	__shared__ int last;
	__threadfence(); // the stores, before the count that lets another block read them
	__syncthreads();
	if (threadIdx.x == 0) {
		last = atomicAdd(counters + head, 1) == blocks_a_head - 1;
		if (last) counters[head] = 0;
	}
	__syncthreads();
	// Whole warps (head_inv's shuffles), 8 lanes a token.
	if (!last || threadIdx.x >= (8 * m + 31) / 32 * 32) return;
	__threadfence();
	const int c = threadIdx.x & 7, t = u.tok[0];
	const bf16 *row = qkv + (long long)max(t, 0) * N + (long long)head * MWG_ROWS;
	const uint4 xa = __ldcg((const uint4 *)(row + 8 * c)), xb = __ldcg((const uint4 *)(row + MWG_ROWS / 2 + 8 * c));
	qkv16_finish(xa, xb, u.cs[0], u.sn[0], t, head, u.slot[0], qkv + (long long)t * N, p.heads, c);
}

template <int T, bool PREP>
__device__ void matmul_wg_few_impl(void *out, int out_f32, const bf16 *x, const bf16 *w, int m, int N, int K, int glu,
                                   int kps, int splits, bf16 *residual, const bf16 *norm_w, float eps, int *counters,
                                   const MwgQkv &qp) {
	constexpr int STAGE = MWF_STAGE(T), NORM_ROW = 16 + 8 * T;
	extern __shared__ __align__(128) unsigned char mwf_smem[];
	__shared__ float4 red[MWF_MAX_WARPS][T][32];
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
	const int per = blockDim.x / 32 / splits; // 16-row groups a block
	const int s = warp % splits;
	const long long grp = (long long)blockIdx.x * per + warp / splits;
	const bool active = grp < N / 16;
	const long long half = N / 2;
	const long long na = glu ? 8 * grp + g : 16 * grp + g;
	const int k0 = s * kps * 64, steps = active ? (min(K, k0 + kps * 64) - k0) / 64 : 0;
	const unsigned ring = smem_u32(mwf_smem) + warp * MWF_STAGES * STAGE;
	// Copies: lane l takes piece l % 8 (8 of k) of rows l / 8 + 4 i.
	const int cp = lane & 7, cr = lane >> 3;
	auto weights = [&](int t) {
		const unsigned st = ring + (t % MWF_STAGES) * STAGE;
		const long long k = k0 + 64LL * t + 8 * cp;
#pragma unroll
		for (int i = 0; i < 4; i++) {
			const int r = cr + 4 * i;
			const long long row = glu ? (r < 8 ? 8 * grp + r : half + 8 * grp + r - 8) : 16 * grp + r;
			cp_async16(mwf_at(st, r, cp), w + row * K + k, true);
		}
	};
	auto inputs = [&](int t) {
		const unsigned st = ring + (t % MWF_STAGES) * STAGE;
		const long long k = k0 + 64LL * t + 8 * cp;
#pragma unroll
		for (int i = 0; i < 2 * T; i++)
			if (cr + 4 * i < m) cp_async16(mwf_at(st, 16 + cr + 4 * i, cp), x + (cr + 4 * i) * (long long)K + k, true);
		if (norm_w && cr == 0) cp_async16(mwf_at(st, NORM_ROW, cp), norm_w + k, true);
	};
	// The weights do not depend on earlier kernels: the first stages are
	// requested while the previous kernel finishes.
	for (int t = 0; t < MWF_STAGES; t++) {
		if (t < steps) weights(t);
		cp_async_commit();
	}
	DEP();
	for (int t = 0; t < MWF_STAGES && t < steps; t++) inputs(t);
	cp_async_commit();
	// PREP: this lane's unit of the head (8 lanes a token, at most 256
	// threads: one pass) and its step inputs, for mwf_prepare_head.
	const int head = blockIdx.x * per * 16 / MWG_ROWS;
	MwgQkvUnits<32> unit;
	if (PREP && MWF_PREP_EARLY) unit.load(qp, 0, head, m);
	// add mode: this thread's residual values, requested now.
	float hpre[T][4];
	if (residual && s == 0 && active)
#pragma unroll
		for (int u = 0; u < T; u++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int r = 8 * u + 2 * q + (e & 1);
				hpre[u][e] = r < m ? bf2f(__ldcg(residual + r * (long long)N + na + 8 * (e >> 1))) : 0.f;
			}
	float inv[T]; // norm mode: the scales of batch rows 8 u + g
#pragma unroll
	for (int u = 0; u < T; u++) inv[u] = 0.f;
	if (norm_w && active)
		for (int r = 0; r < m; r++) {
			const float v = warp_row_scale(x + (long long)r * K, K, eps);
#pragma unroll
			for (int u = 0; u < T; u++)
				if (r == 8 * u + g) inv[u] = v;
		}
	cp_async_wait<0>();
	__syncwarp();
	float acc[T][4];
#pragma unroll
	for (int u = 0; u < T; u++) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
	for (int t = 0; t < steps; t++) {
		// Stage t's group is the oldest of at most MWF_STAGES pending.
		cp_async_wait<MWF_STAGES - 1>();
		__syncwarp();
		const unsigned st = ring + (t % MWF_STAGES) * STAGE;
#pragma unroll
		for (int c = 0; c < 4; c++) {
			const int p = 2 * c + (q >> 1), h = 8 * (q & 1);
			const uint2 a = lds_u2(mwf_at(st, g, p) + h), b = lds_u2(mwf_at(st, g + 8, p) + h);
			uint2 nv = make_uint2(0, 0);
			if (norm_w) nv = lds_u2(mwf_at(st, NORM_ROW, p) + h);
#pragma unroll
			for (int u = 0; u < T; u++) {
				uint2 xv = make_uint2(0, 0);
				if (8 * u + g < m) {
					xv = lds_u2(mwf_at(st, 16 + 8 * u + g, p) + h);
					if (norm_w) xv = make_uint2(norm_pair(xv.x, nv.x, inv[u]), norm_pair(xv.y, nv.y, inv[u]));
				}
				mma16816(acc[u], a.x, b.x, a.y, b.y, xv.x, xv.y);
			}
		}
		__syncwarp(); // every lane has read the stage before it is refilled
		if (t + MWF_STAGES < steps) {
			weights(t + MWF_STAGES);
			inputs(t + MWF_STAGES);
		}
		cp_async_commit();
	}
	if (splits > 1) {
#pragma unroll
		for (int u = 0; u < T; u++) red[warp][u][lane] = make_float4(acc[u][0], acc[u][1], acc[u][2], acc[u][3]);
		__syncthreads();
		if (s != 0 && !PREP) return;
		if (s == 0)
#pragma unroll
			for (int u = 0; u < T; u++) {
				float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
				for (int p = 0; p < splits; p++) {
					const float4 f = red[warp + p][u][lane];
					v.x += f.x, v.y += f.y, v.z += f.z, v.w += f.w;
				}
				acc[u][0] = v.x, acc[u][1] = v.y, acc[u][2] = v.z, acc[u][3] = v.w;
			}
	}
	if (!active && !PREP) return;
	// acc[u]: c0, c1 weight row g, batch rows 8 u + 2q, + 1; c2, c3 row g + 8.
	// With PREP every thread goes on to the epilogue: only split 0's
	// active warps store.
	if (!PREP || (active && s == 0))
#pragma unroll
	for (int u = 0; u < T; u++)
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const int r = 8 * u + 2 * q + (e & 1);
			if (r >= m) continue;
			if (glu) {
				if (e < 2) ((bf16 *)out)[r * half + na] = silu_mul1(rbf(acc[u][e]), rbf(acc[u][e + 2]));
				continue;
			}
			const long long n = na + 8 * (e >> 1);
			if (residual) residual[r * (long long)N + n] = f2bf(rbf(hpre[u][e] + rbf(acc[u][e])));
			else if (out_f32) ((float *)out)[r * (long long)N + n] = acc[u][e];
			else ((bf16 *)out)[r * (long long)N + n] = f2bf(acc[u][e]);
		}
	if (PREP && !MWF_PREP_EARLY) unit.load(qp, 0, head, m);
	if (PREP) // per: 16-row groups a block, within one head (the host checks)
		mwf_prepare_head((bf16 *)out, head, MWG_ROWS / 16 / per, m, N, counters, qp, unit);
}

#define MATMUL_WG_FEW(T)                                                                                              \
	extern "C" __global__ void __launch_bounds__(MWF_MAX_WARPS * 32)                                                   \
	    matmul_wg_few_t##T(void *out, int out_f32, const bf16 *x, const bf16 *w, int m, int N, int K, int glu, int kps, \
	                       int splits, bf16 *residual, const bf16 *norm_w, float eps) {                              \
		matmul_wg_few_impl<T, false>(out, out_f32, x, w, m, N, K, glu, kps, splits, residual, norm_w, eps, nullptr,     \
		                             MwgQkv{});                                                                        \
	}
MATMUL_WG_FEW(1)
MATMUL_WG_FEW(2)

// matmul_wg_few_qkv is matmul_wg_few for the qkv projection of heads of
// MWG_ROWS dims, which the last block of each head prepares
// (mwf_prepare_head) in place of prepare_qkv16. The norm mode as
// matmul_wg_few's (norm_w); deterministic inference, the host checks the
// shapes.
#define MATMUL_WG_FEW_QKV(T)                                                                                          \
	extern "C" __global__ void __launch_bounds__(MWF_MAX_WARPS * 32) matmul_wg_few_qkv_t##T(                          \
	    bf16 *out, const bf16 *x, const bf16 *w, int m, int N, int K, int kps, int splits, const bf16 *norm_w,          \
	    float norm_eps, int *counters, const bf16 *qnorm, const bf16 *knorm, int has_norm, float eps, bf16 *kc,        \
	    bf16 *vc, int hq, int hk, const int *pos, const int *slots, const float *cos_t, const float *sin_t) {         \
		matmul_wg_few_impl<T, true>(                                                                                 \
		    out, 0, x, w, m, N, K, 0, kps, splits, nullptr, norm_w, norm_eps, counters,                               \
		    MwgQkv{QkvHeads{qnorm, knorm, kc, vc, hq, hk, MWG_ROWS, eps, has_norm}, QkvStep{pos, slots, cos_t, sin_t}}); \
	}
MATMUL_WG_FEW_QKV(1)
MATMUL_WG_FEW_QKV(2)
