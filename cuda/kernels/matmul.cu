// matmul_tc computes out[m, n] = sum_k x[m, k] w[n, k] for decode batches
// of 2 to 24 rows on tensor cores. Such a step is bound by reading the
// weights once; cuBLAS's tiles, made for large m, leave most SMs idle on
// it (1024 x 2048 at 8 rows: 5.3 us, a quarter of HBM bandwidth, H100),
// and the gemv's multiply-adds cost more than its loads from two rows.
// Past 24 rows each warp's reads of x from L2 make it slower than cuBLAS
// (32 rows: decode steps 5% slower; tried: column groups sharing x
// through L1, 2.2x slower at 64 rows).
//
// The weight rows are the M side of mma.m16n8k16 and the batch rows its
// N side, so a warp covers 16 output columns and 8*T rows, streaming the
// weights into registers with 16-byte loads. Both operands take the same
// permutation of k within each 32-wide step, which lets every thread load
// 16 contiguous bytes of a row instead of the fragment's scattered pairs:
// thread (g = lane / 4, q = lane % 4) holds k = 8q .. 8q+7 of weight rows
// g and g+8 and of batch row g of each tile; the first mma takes
// 8q .. 8q+3, the second 8q+4 .. 8q+7.
//
// Block: 8 warps on the same 16 columns, each taking every eighth 32-wide
// step of its split of K; their sums are added in a fixed order through
// shared memory. Grid (N/16, 1, splits): with splits > 1 each block leaves
// fp32 partials and the last of a column's blocks adds them in split
// order, so every run gives the same bits. K is a multiple of 32; rows
// past m and columns past N are not stored.
//
// With glu, w is [gate | up] (N rows, N/2 of each) and out[m, N/2] takes
// silu(gate) * up, rounded as the product and then silu_mul would round
// it: a warp's rows g are gates 8 blockIdx.x + g and its rows g + 8 the
// matching ups, so each gate meets its up in the same thread (grid N/16
// as without glu).
//
// For up to 8 rows (one tile), like matmul_wg at 25-48, it takes part in
// the decode layer's add_rmsnorm (the host asks where the product before
// and the one after both run it; with more tiles every warp normalising
// each tile's x cost more than the launch saved):
//   - add (residual set): the last block of a column group adds the
//     product to the residual, rounded as add_rmsnorm rounds it, and
//     leaves sq[row * gridDim.x + column group] the sum of squares of
//     its 16 new values; out is not written;
//   - norm (norm_w set): x is such a residual h, normalised as each 16
//     bytes of it are loaded (the row's nsq partial sums in sq give its
//     scale), as the normalising gemv does.
#define MMT_WARPS 8
#define MMT_PRE 4 // 32-wide steps of weights each warp loads ahead

__device__ __forceinline__ void mma16816(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
	             "{%0, %1, %2, %3};"
	             : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
	             : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// row_scales leaves in inv_s each of the m rows' inverse root mean square
// from the nsq partial sums of squares a row in sq: P threads a row (P a
// power of two up to 32, m * P at most the threads calling), each adding
// every P-th, their loads issued together, then the P added in a fixed
// order. The caller synchronises before reading inv_s.
template <int P>
__device__ __forceinline__ void row_scales(float *inv_s, const float *sq, int nsq, int m, int K, float eps) {
	const int r = threadIdx.x / P, p = threadIdx.x % P;
	float ss = 0.f;
	if (r < m) {
		const float *row = sq + (long long)r * nsq;
		float v[8];
#pragma unroll
		for (int i = 0; i < 8; i++) v[i] = p + P * i < nsq ? __ldcg(row + p + P * i) : 0.f;
#pragma unroll
		for (int i = 0; i < 8; i++) ss += v[i];
		for (int i = p + 8 * P; i < nsq; i += P) ss += __ldcg(row + i);
	}
#pragma unroll
	for (int o = 1; o < P; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
	if (p == 0 && r < m) inv_s[r] = rsqrtf(ss / K + eps);
}

// matmul_tc_step adds one 32-wide step of weight rows g and g+8 (wa, wb)
// times the batch rows of every tile; with nw (norm mode: the step's norm
// weights for this thread's k) each row of x is normalised as it loads.
template <int T>
__device__ __forceinline__ void matmul_tc_step(float acc[T][4], uint4 wa, uint4 wb, const bf16 *x, long long K, int m,
                                               int row0, long long k, const bf16 *norm_w, const float *inv_s) {
	uint4 nw = make_uint4(0, 0, 0, 0);
	if (norm_w) nw = __ldg((const uint4 *)(norm_w + k));
#pragma unroll
	for (int t = 0; t < T; t++) {
		const int r = row0 + 8 * t;
		uint4 xv = make_uint4(0, 0, 0, 0);
		if (r < m) xv = __ldg((const uint4 *)(x + r * K + k));
		if (norm_w && r < m) xv = rmsnorm8(xv, nw, inv_s[r]);
		mma16816(acc[t], wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
		mma16816(acc[t], wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
	}
}

template <int T>
__device__ void matmul_tc_impl(void *out, int out_f32, const bf16 *x, const bf16 *w, int m, int N, int K,
                               float *partial, int *counters, int glu, bf16 *residual, const bf16 *norm_w, float *sq,
                               int nsq, float eps) {
	__shared__ float red[MMT_WARPS - 1][T][32][4];
	__shared__ float inv_s[8 * T];
	__shared__ int last;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
	const long long n0 = (long long)blockIdx.x * (glu ? 8 : 16);
	const int split = blockIdx.z, splits = gridDim.z;
	const int steps = K / 32, stride = MMT_WARPS * splits;
	const int first = split * MMT_WARPS + warp;
	const long long half = N / 2;
	const long long na = glu ? min(n0 + g, half - 1) : min(n0 + g, (long long)N - 1),
	                nb = glu ? half + na : min(n0 + g + 8, (long long)N - 1);
	const bf16 *wra = w + na * K + 8 * q, *wrb = w + nb * K + 8 * q;
	const bf16 *xr = x + 8 * q;
	// The weights do not depend on earlier kernels: the first steps are
	// loaded while the previous kernel finishes.
	uint4 wa[MMT_PRE], wb[MMT_PRE];
#pragma unroll
	for (int j = 0; j < MMT_PRE; j++) {
		const int s = first + j * stride;
		if (s < steps) {
			wa[j] = __ldcs((const uint4 *)(wra + s * 32));
			wb[j] = __ldcs((const uint4 *)(wrb + s * 32));
		}
	}
	DEP();
	// add mode: warp 0's share of the residual, requested now so that the
	// epilogue (in the last block of the column group) finds it.
	float hpre[T][4];
	if (residual && warp == 0) {
#pragma unroll
		for (int t = 0; t < T; t++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int r = 8 * t + 2 * q + (e & 1);
				const long long n = n0 + g + (e >> 1) * 8;
				hpre[t][e] = r < m && n < N ? bf2f(__ldcg(residual + r * (long long)N + n)) : 0.f;
			}
	}
	if (norm_w) {
		row_scales<8>(inv_s, sq, nsq, m, K, eps);
		__syncthreads();
	}
	float acc[T][4];
#pragma unroll
	for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
	for (int s0 = first; s0 < steps; s0 += MMT_PRE * stride) {
#pragma unroll
		for (int j = 0; j < MMT_PRE; j++) {
			const int s = s0 + j * stride;
			if (s < steps) {
				const uint4 a = wa[j], b = wb[j];
				const int next = s + MMT_PRE * stride;
				if (next < steps) {
					wa[j] = __ldcs((const uint4 *)(wra + next * 32));
					wb[j] = __ldcs((const uint4 *)(wrb + next * 32));
				}
				matmul_tc_step<T>(acc, a, b, xr, K, m, g, (long long)s * 32, norm_w ? norm_w + 8 * q : nullptr,
				                  inv_s);
			}
		}
	}
	if (warp > 0) {
#pragma unroll
		for (int t = 0; t < T; t++)
			*(float4 *)red[warp - 1][t][lane] = make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
	}
	__syncthreads();
	if (warp == 0) {
#pragma unroll
		for (int t = 0; t < T; t++)
			for (int p = 0; p < MMT_WARPS - 1; p++) {
				const float4 v = *(const float4 *)red[p][t][lane];
				acc[t][0] += v.x, acc[t][1] += v.y, acc[t][2] += v.z, acc[t][3] += v.w;
			}
	}
	if (splits > 1) {
		// partial[column block, split, t, lane]: float4s.
		const int tile = blockIdx.x;
		float4 *p = (float4 *)partial + (long long)tile * splits * T * 32;
		if (warp == 0) {
#pragma unroll
			for (int t = 0; t < T; t++)
				__stcg(p + ((long long)split * T + t) * 32 + lane, make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]));
		}
		if (!split_elect_last(counters + tile, splits, &last)) return;
		if (warp > 0) return;
#pragma unroll
		for (int t = 0; t < T; t++) {
			acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
			for (int sp = 0; sp < splits; sp++) {
				const float4 v = __ldcg(p + ((long long)sp * T + t) * 32 + lane);
				acc[t][0] += v.x, acc[t][1] += v.y, acc[t][2] += v.z, acc[t][3] += v.w;
			}
		}
		if (lane == 0) counters[tile] = 0;
	}
	if (warp > 0) return;
	// acc[t]: c0, c1 rows (output columns) g, batch rows 2q, 2q+1 of tile
	// t; c2, c3 the same for column g + 8 (with glu: the up of gate g).
	if (residual) {
#pragma unroll
		for (int t = 0; t < T; t++) {
			float sqv[2] = {0.f, 0.f};
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int r = 8 * t + 2 * q + (e & 1);
				const long long n = n0 + g + (e >> 1) * 8;
				if (r >= m || n >= N) continue;
				const float hv = rbf(hpre[t][e] + rbf(acc[t][e]));
				residual[r * (long long)N + n] = f2bf(hv);
				sqv[e & 1] += hv * hv;
			}
			// Lanes of one q hold rows 8 t + 2 q (+1) of the 16 columns.
#pragma unroll
			for (int o = 4; o < 32; o <<= 1) {
				sqv[0] += __shfl_xor_sync(0xffffffffu, sqv[0], o);
				sqv[1] += __shfl_xor_sync(0xffffffffu, sqv[1], o);
			}
#pragma unroll
			for (int e = 0; e < 2; e++) {
				const int r = 8 * t + 2 * q + e;
				if (g == 0 && r < m) sq[(long long)r * gridDim.x + blockIdx.x] = sqv[e];
			}
		}
		return;
	}
#pragma unroll
	for (int t = 0; t < T; t++) {
		if (glu) {
#pragma unroll
			for (int e = 0; e < 2; e++) {
				const int r = 8 * t + 2 * q + e;
				const long long n = n0 + g;
				if (r < m && n < half) ((bf16 *)out)[r * half + n] = silu_mul1(rbf(acc[t][e]), rbf(acc[t][e + 2]));
			}
			continue;
		}
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const int r = 8 * t + 2 * q + (e & 1);
			const long long n = n0 + g + (e >> 1) * 8;
			if (r >= m || n >= N) continue;
			if (out_f32) ((float *)out)[r * (long long)N + n] = acc[t][e];
			else ((bf16 *)out)[r * (long long)N + n] = f2bf(acc[t][e]);
		}
	}
}

#define MATMUL_TC(T)                                                                                          \
	extern "C" __global__ void __launch_bounds__(MMT_WARPS * 32)                                              \
	    matmul_tc_t##T(void *out, int out_f32, const bf16 *x, const bf16 *w, int m, int N, int K, float *partial, \
	                   int *counters, int glu, bf16 *residual, const bf16 *norm_w, float *sq, int nsq, float eps) { \
		matmul_tc_impl<T>(out, out_f32, x, w, m, N, K, partial, counters, glu, residual, norm_w, sq, nsq, eps);   \
	}
MATMUL_TC(1)
MATMUL_TC(2)
MATMUL_TC(3)
