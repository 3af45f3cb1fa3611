// Mixture-of-experts layers (Qwen3-MoE): routing, the tokens grouped by
// expert, the experts' products on tensor cores, and the weighted sum.
//
// moe_route picks each token's experts; moe_sort lists the (token, choice)
// pairs grouped by expert, in pair order within an expert, so that every
// run, whatever else is in the batch, puts a pair through the same
// operations (outside deterministic inference, decode steps of 5 to 512
// tokens are grouped by moe_add_norm_route instead, in no fixed order
// within an expert, which moe_wg's products do not see); moe_gemm runs each expert's products over its rows only
// (the gate and up products with silu in one pass, then down), and
// moe_combine adds each token's k results in ascending expert order,
// rounded as transformers' index_add_ rounds them.
#define MOE_MAX_EXPERTS 256 // moeMaxExperts: moe_sort's shared counts
#define MOE_BN 64           // moe_gemm: output columns of a tile (32 with glu)
#define MOE_MAX_TOPK 16 // moe_down_combine's per-lane arrays (moeMaxTopK)
#define MOE_STAGES 4 // cp.async steps in flight: a decode step's few rows leave it bound by reading weights

// moe_route_row: one warp picks a row's experts from its logits, v[i]
// that of expert lane + 32 i (-inf past E): a float softmax, its k
// largest probabilities (the lower expert first on a tie) into ids [k] and
// weights [k], divided by their sum when norm, and rounded to bf16 as
// transformers rounds the routing weights.
//
// From sm_80 each pick takes two warp reductions (redux.sync) in place of
// five rounds of two dependent shuffles: the largest key, where a
// probability's key is its bits plus one (non-negative floats order as
// their bits; a taken expert's key is 0), then the lowest expert holding
// it; the same picks and bits by construction. One warp routes a token
// after the router's products and before the experts may start, k = 8
// picks in a row: a decode step of the 30B-A3B shape, H200, batch 1 2.893
// -> 2.880 ms (-0.45 %), batch 256 18.921 -> 18.838 (-0.44 %), the same
// tokens.
//
// With counts set, lane j < k also takes pair j's place among its expert's
// pairs (an atomic on counts[expert]) into ranks[j], all k at once: the
// grouping moe_add_norm_route's last cluster completes (moe_route_sorted).
__device__ __forceinline__ void moe_route_row(float v[8], int *ids, float *weights, int E, int k, int norm,
                                              int *counts = nullptr, int *ranks = nullptr) {
	const int lane = threadIdx.x & 31;
	float m = -EBB_INF;
#pragma unroll
	for (int i = 0; i < 8; i++) m = fmaxf(m, v[i]);
	m = warp_max(m);
	float s = 0.f;
#pragma unroll
	for (int i = 0; i < 8; i++) {
		v[i] = lane + 32 * i < E ? expf(v[i] - m) : -1.f;
		s += fmaxf(v[i], 0.f);
	}
	s = warp_sum(s);
	float picked[16];
	int chosen[16];
	float sum = 0.f;
	for (int j = 0; j < k; j++) {
		float bv = -1.f;
		int bi = 0x7fffffff;
#if __CUDA_ARCH__ >= 800
		{
			unsigned key[8], best = 0;
#pragma unroll
			for (int i = 0; i < 8; i++) {
				key[i] = v[i] >= 0.f ? __float_as_uint(v[i]) + 1u : 0u;
				best = max(best, key[i]);
			}
			best = __reduce_max_sync(0xffffffffu, best);
			unsigned mine = 0xffffffffu;
#pragma unroll
			for (int i = 7; i >= 0; i--)
				if (key[i] == best) mine = lane + 32 * i; // this lane's lowest expert holding it
			bi = (int)__reduce_min_sync(0xffffffffu, mine);
			bv = __uint_as_float(best - 1u);
		}
#else
		{
#pragma unroll
			for (int i = 0; i < 8; i++)
				if (v[i] > bv) bv = v[i], bi = lane + 32 * i; // ascending experts: the first of equals stays
			for (int o = 16; o > 0; o >>= 1) {
				const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
				const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
				if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
			}
		}
#endif
		if ((bi & 31) == lane) v[bi >> 5] = -1.f; // taken
		picked[j] = bv / s;
		chosen[j] = bi;
		sum += picked[j];
	}
	if (lane == 0) {
		for (int j = 0; j < k; j++) {
			ids[j] = chosen[j];
			weights[j] = rbf(norm ? picked[j] / sum : picked[j]);
		}
	}
	if (counts) {
		int mine = 0;
		for (int j = 0; j < k; j++)
			if (lane == j) mine = chosen[j];
		if (lane < k) ranks[lane] = atomicAdd(counts + mine, 1);
	}
}

// moe_expert_starts: thread e < E of the block (blockDim.x >= E, whole
// warps) holds expert e's rows; it writes offsets[e] (its first sorted
// position), tiles[e] (its first bm-row tile) and base[e] (shared), and
// offsets[E], tiles[E] the totals, by an exclusive scan over the threads,
// warp by warp. Every thread calls it; base is complete on return.
__device__ __forceinline__ void moe_expert_starts(int rows, int E, int bm, int *offsets, int *tiles, int *base) {
	__shared__ int scan_rows[32], scan_tiles[32];
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	int r = rows, t = (rows + bm - 1) / bm;
	for (int o = 1; o < 32; o <<= 1) {
		const int ar = __shfl_up_sync(0xffffffffu, r, o), at = __shfl_up_sync(0xffffffffu, t, o);
		if (lane >= o) r += ar, t += at;
	}
	if (lane == 31) scan_rows[warp] = r, scan_tiles[warp] = t;
	__syncthreads();
	if (warp == 0) {
		const bool in = lane < (int)(blockDim.x >> 5);
		int wr = in ? scan_rows[lane] : 0, wt = in ? scan_tiles[lane] : 0;
		for (int o = 1; o < 32; o <<= 1) {
			const int ar = __shfl_up_sync(0xffffffffu, wr, o), at = __shfl_up_sync(0xffffffffu, wt, o);
			if (lane >= o) wr += ar, wt += at;
		}
		if (in) scan_rows[lane] = wr, scan_tiles[lane] = wt;
	}
	__syncthreads();
	if (warp > 0) r += scan_rows[warp - 1], t += scan_tiles[warp - 1];
	if (threadIdx.x < E) {
		const int first = r - rows;
		base[threadIdx.x] = first, offsets[threadIdx.x] = first, tiles[threadIdx.x] = t - (rows + bm - 1) / bm;
		if (threadIdx.x == E - 1) offsets[E] = r, tiles[E] = t;
	}
	__syncthreads();
}

// moe_route: one warp a row of router logits [T, E] (E <= 256), picked by
// moe_route_row into ids [T, k] and weights [T, k].
extern "C" __global__ void moe_route(int *ids, float *weights, const bf16 *logits, int T, int E, int k, int norm) {
	DEP(); // every moe kernel reads what the one before it wrote
	const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
	if (row >= T) return;
	const bf16 *l = logits + (long long)row * E;
	float v[8];
#pragma unroll
	for (int i = 0; i < 8; i++) {
		const int e = lane + 32 * i;
		v[i] = e < E ? bf2f(l[e]) : -EBB_INF;
	}
	moe_route_row(v, ids + (long long)row * k, weights + (long long)row * k, E, k, norm);
}

// moe_norm_route is a decode step's norm, router product and moe_route for
// one token in one launch, where separately they were three kernels in a
// row, each waiting for the one before (o_proj's last block adding and
// normalising, a gemv of the 0.5 MB router, one warp routing: 30B-A3B
// shape, 17 us a layer of a batch-1 step on the H100, more than reading
// the chosen experts' down weights).
//
// h is the residual as MatMulAdd's gemv left it, with nsq partial sums of
// its squares in sq; x = rmsnorm(h) * norm_w is formed as the normalising
// gemv forms it and written out for the experts. A cluster of
// MOE_ROUTE_BLOCKS blocks shares the router: warp w of block b takes expert
// rows b * MOE_ROUTE_WARPS + w + MOE_ROUTE_ROWS j, and loads the first row's
// first MOE_ROUTE_PRE 16-byte chunks a lane before it waits for the
// previous kernel (the router's weights never change in a step). Each
// block stores its logits, rounded to bf16 as the router product's output
// is, in block 0's shared memory; after the cluster's barrier one warp of
// block 0 routes them as moe_route does. H <= 8 * MOE_ROUTE_XS.
//
// In a batch-1 step the kernel costs twice its time alone (15.5 against
// 7.5 us a 30B-A3B layer, H200). Smaller blocks, which might start beside
// o_proj's, were slower: warps a block are a tunable (EBB_KERNEL_DEFINES,
// which the host reads too), and on the 12-layer copy at batch 1 a step
// took 0.895 ms with 16 (one row a warp), 0.921 with 8 (two rows, the
// second loaded after the wait) and 0.977 with 4, twice each.
#define MOE_ROUTE_BLOCKS 8 // moeRouteBlocks: a portable cluster
#ifndef MOE_ROUTE_WARPS
#define MOE_ROUTE_WARPS 16 // moeRouteWarps
#endif
#define MOE_ROUTE_ROWS (MOE_ROUTE_BLOCKS * MOE_ROUTE_WARPS)
#ifndef MOE_ROUTE_PRE
#define MOE_ROUTE_PRE 8 // a 2,048-wide row is 8 chunks a lane
#endif
#define MOE_ROUTE_XS 1024 // moeRouteMaxHidden / 8: x's chunks in shared memory

__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
	const unsigned au[4] = {a.x, a.y, a.z, a.w}, bu[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
	for (int e = 0; e < 4; e++) {
		acc += __uint_as_float(au[e] << 16) * __uint_as_float(bu[e] << 16);
		acc += __uint_as_float(au[e] & 0xffff0000u) * __uint_as_float(bu[e] & 0xffff0000u);
	}
	return acc;
}

extern "C" __global__ void __launch_bounds__(MOE_ROUTE_WARPS * 32)
    moe_norm_route(int *ids, float *weights, bf16 *x, const bf16 *h, const bf16 *norm_w, const float *sq, int nsq,
                   float eps, const bf16 *router, int E, int H, int k, int norm) {
#if __CUDA_ARCH__ >= 900
	__shared__ uint4 xs[MOE_ROUTE_XS];
	__shared__ float logits[MOE_MAX_EXPERTS]; // block 0's: every block's logits
	__shared__ float red[32];
	cluster_arrive(); // block 0's logits are written before the first cluster_sync
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, rank = blockIdx.z, kv = H / 8;
	const int r0 = rank * MOE_ROUTE_WARPS + warp;
	const uint4 *w0 = (const uint4 *)(router + (long long)min(r0, E - 1) * H);
	uint4 pre[MOE_ROUTE_PRE];
#pragma unroll
	for (int c = 0; c < MOE_ROUTE_PRE; c++) {
		const int i = lane + 32 * c;
		if (r0 < E && i < kv) pre[c] = __ldcs(w0 + i);
	}
	// A thread's first chunk of the norm's weights is asked for before the
	// wait and of the residual right after it, beside the partial sums of
	// squares, not after the block has added those: one round trip less
	// before the router's products (30B-A3B batch 1 -0.25 %, H200).
	const bool early = threadIdx.x < kv;
	uint4 h0 = make_uint4(0, 0, 0, 0), nw0 = h0;
	if (early) nw0 = __ldg((const uint4 *)norm_w + threadIdx.x);
	DEP();
	if (early) h0 = __ldcg((const uint4 *)h + threadIdx.x);
	// The row's scale: the same bits in every block.
	float ss = 0.f;
	for (int j = threadIdx.x; j < nsq; j += blockDim.x) ss += __ldcg(sq + j);
	const float inv = rsqrtf(block_sum(ss, red) / H + eps);
	for (int i = threadIdx.x; i < kv; i += blockDim.x) {
		xs[i] = early && i == threadIdx.x
		            ? rmsnorm8(h0, nw0, inv)
		            : rmsnorm8(__ldcg((const uint4 *)h + i), __ldg((const uint4 *)norm_w + i), inv);
		if (i % MOE_ROUTE_BLOCKS == rank) ((uint4 *)x)[i] = xs[i];
	}
	__syncthreads();
	cluster_wait(); // every block of the cluster has started
	for (int r = r0, j = 0; r < E; r += MOE_ROUTE_ROWS, j++) {
		const uint4 *wr = (const uint4 *)(router + (long long)r * H);
		float acc = 0.f;
		int i = lane;
		if (j == 0) {
#pragma unroll
			for (int c = 0; c < MOE_ROUTE_PRE; c++, i += 32)
				if (i < kv) acc = dot8(pre[c], xs[i], acc);
		}
		for (; i < kv; i += 32) acc = dot8(__ldcs(wr + i), xs[i], acc);
		acc = warp_sum(acc);
		if (lane == 0) st_cluster_f32(smem_u32(logits + r), 0, rbf(acc)); // into block 0's logits[r]
	}
	cluster_sync();
	if (rank != 0 || warp != 0) return;
	float v[8];
#pragma unroll
	for (int i = 0; i < 8; i++) v[i] = lane + 32 * i < E ? logits[lane + 32 * i] : -EBB_INF;
	moe_route_row(v, ids, weights, E, k, norm);
#endif
}

// moe_add_norm_route is moe_norm_route for a decode step of many tokens:
// residual += o (o_proj's product, in x), x = rmsnorm(residual) * norm_w,
// the router's product and moe_route, in one launch where they were
// add_rmsnorm_v8, the router on cuBLAS (which takes no part in dependent
// launches) and moe_route. A cluster of MOE_NR_RANKS blocks takes TOK
// tokens (8 or 16, an mma column tile each 8). Each block adds and
// normalises its own TOK / MOE_NR_RANKS of them (each 256 threads a group
// of them, a thread a 16-byte chunk of each), writes their new residual
// and x rows and stores x into every block's shared memory (distributed
// shared memory); after the cluster's barrier each block forms the logits
// of its share of the experts (16-expert tiles r, r + MOE_NR_RANKS, ...)
// for all TOK tokens on tensor cores, K in MOE_NR_SLICES slices across its
// warps, and stores them, summed over the slices in a fixed order and
// rounded to bf16 as the router's output is, in block 0's shared memory;
// after a second barrier block 0's warps route a token each. A warp loads
// its first (tile, slice) of router chunks before the dependent-launch
// wait (the router never changes in a step).
//
// Sixteen tokens a cluster halve the clusters at 256 tokens: 32 clusters of
// four one-an-SM blocks do not all fit an H200 at once (ncu: at most 30
// active), and the last two ran as a second wave (ncu, 12-layer copy:
// 17.6 us a layer against 13.6 in clusters of sixteen).
//
// The product's K order is permuted alike for both operands, so that a
// lane loads 16 contiguous bytes of a router row and of x's row for two
// mma steps: of 32-wide chunk c, lane q's (q = lane % 4) columns 8q..8q+3
// are the first step's logical k {2q, 2q+1, 2q+8, 2q+9}, columns
// 8q+4..8q+7 the second's. A token's logits do not depend on the other
// tokens of its tile (an mma column is its own dot products), nor does its
// norm (a 256-thread group and one order whatever TOK is), so its experts
// and bits are the same wherever it falls in a batch this kernel takes.
#define MOE_NR_RANKS 4   // moeNormRouteRanks: blocks a cluster, each a share of the experts
#define MOE_NR_WARPS 16  // moeNormRouteWarps
#define MOE_NR_SLICES 8  // K slices: two 16-expert tiles a block (128 experts) are a (tile, slice) a warp
#define MOE_NR_PRE 8     // 32-wide chunks of a warp's first (tile, slice) loaded before the wait
#define MOE_NR_CHUNKS 2  // moeNormRouteHidden / 8 / 256: a thread's chunks of a row
#define MOE_NR_TILES ((MOE_MAX_EXPERTS / 16 + MOE_NR_RANKS - 1) / MOE_NR_RANKS)

// MoeRouteSort: where moe_add_norm_route also groups the step's pairs by
// expert (counts null: it does not), as moe_sort would for row tiles of
// bm: order, inv, offsets and tiles as moe_sort's, counts the experts'
// running counts and, at MOE_MAX_EXPERTS, the clusters done, zero between
// launches (the last cluster resets them).
struct MoeRouteSort {
	int *order, *inv, *offsets, *tiles, *counts;
	int bm;
};

// moe_route_sorted: block 0 of each cluster, once its tokens' pairs have
// their ranks within their experts (in inv), counts itself done; the last
// turns the counts into offsets and tiles and places every pair: order[at]
// = p, inv[p] = at, at = its expert's offset + its rank. A pair's rank is
// the order its atomic came in, so within an expert the pairs are in no
// fixed order, unlike moe_sort's; no product depends on it (a row of
// moe_wg's tile is its own column of the MMA, and moe_combine finds a
// token's k results through inv in choice order), so the bits do not.
// In place of moe_sort's launch, one block on one SM with its own chain of
// round trips, after the routing.
__device__ __forceinline__ void moe_route_sorted(const MoeRouteSort &srt, const int *ids, int P, int E) {
	__shared__ int last, base[MOE_MAX_EXPERTS];
	__threadfence(); // this block's ranks and ids before its ticket
	__syncthreads();
	if (threadIdx.x == 0) last = atomicAdd(srt.counts + MOE_MAX_EXPERTS, 1) == (int)gridDim.x - 1;
	__syncthreads();
	if (!last) return;
	__threadfence(); // every other cluster's, after their tickets
	const int rows = threadIdx.x < E ? atomicExch(srt.counts + threadIdx.x, 0) : 0;
	if (threadIdx.x == 0) srt.counts[MOE_MAX_EXPERTS] = 0;
	moe_expert_starts(rows, E, srt.bm, srt.offsets, srt.tiles, base);
	for (int p = threadIdx.x; p < P; p += blockDim.x) {
		const int e = min(max(__ldcg(ids + p), 0), E - 1), at = base[e] + __ldcg(srt.inv + p);
		srt.order[at] = p, srt.inv[p] = at;
	}
}

template <int TOK>
__device__ __forceinline__ void moe_add_norm_route_impl(int *ids, float *weights, bf16 *x, bf16 *residual,
                                                        const bf16 *norm_w, float eps, const bf16 *router, int T,
                                                        int E, int H, int k, int norm, MoeRouteSort srt) {
#if __CUDA_ARCH__ >= 900
	constexpr int OWN = TOK / MOE_NR_RANKS, GROUP = OWN / 2, NT = TOK / 8;
	// Dynamic shared memory (moeNormRouteShared): the slices' sums, block
	// 0's logits of every block, then the TOK tokens' x rows.
	extern __shared__ __align__(16) unsigned char nr_smem[];
	auto part = (float(*)[MOE_NR_TILES][16][TOK])nr_smem;
	auto logits = (float(*)[MOE_MAX_EXPERTS])(nr_smem + sizeof(float) * MOE_NR_SLICES * MOE_NR_TILES * 16 * TOK);
	uint4 *xs = (uint4 *)(nr_smem + sizeof(float) * (MOE_NR_SLICES * MOE_NR_TILES * 16 + MOE_MAX_EXPERTS) * TOK);
	__shared__ float red[MOE_NR_WARPS][GROUP], inv_s[OWN];
	cluster_arrive(); // x goes into the other blocks' shared memory before the first cluster_sync
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, rank = blockIdx.z, kv = H / 8;
	const int stride = kv + 4; // 16-byte chunks a row in shared memory: tokens g, g + 1 64 bytes apart in the banks
	const long long t0 = (long long)blockIdx.x * TOK;
	const int tiles = (E + 15) / 16, mine = rank < tiles ? (tiles - rank + MOE_NR_RANKS - 1) / MOE_NR_RANKS : 0;
	const int q = lane & 3, g = lane >> 2, chunks = H / 32, items = mine * MOE_NR_SLICES;
	const uint4 zero = make_uint4(0, 0, 0, 0);
	uint4 pre_lo[MOE_NR_PRE], pre_hi[MOE_NR_PRE];
	if (warp < items) {
		const int lt = warp / MOE_NR_SLICES, s = warp % MOE_NR_SLICES, e0 = (rank + lt * MOE_NR_RANKS) * 16 + g;
		const uint4 *w0 = (const uint4 *)(router + (long long)min(e0, E - 1) * H) + q;
		const uint4 *w1 = (const uint4 *)(router + (long long)min(e0 + 8, E - 1) * H) + q;
#pragma unroll
		for (int j = 0; j < MOE_NR_PRE; j++) {
			const int c = s + MOE_NR_SLICES * j;
			pre_lo[j] = c < chunks && e0 < E ? __ldg(w0 + 4 * c) : zero;
			pre_hi[j] = c < chunks && e0 + 8 < E ? __ldg(w1 + 4 * c) : zero;
		}
	}
	uint4 nw[MOE_NR_CHUNKS]; // the norm's weights, asked for before the wait, not after the block's sums
#pragma unroll
	for (int ci = 0; ci < MOE_NR_CHUNKS; ci++) {
		const int i = (threadIdx.x & 255) + 256 * ci;
		nw[ci] = i < kv ? __ldg((const uint4 *)norm_w + i) : zero;
	}
	DEP();
	// Each 256 threads add and normalise GROUP of the block's tokens, a
	// thread chunks col and col + 256 of each; the sums stay in registers.
	const int col = threadIdx.x & 255, slot0 = rank * OWN + GROUP * (threadIdx.x >> 8);
	float ss[GROUP];
	uint4 sum[GROUP][MOE_NR_CHUNKS];
#pragma unroll
	for (int j = 0; j < GROUP; j++) ss[j] = 0.f;
#pragma unroll
	for (int ci = 0; ci < MOE_NR_CHUNKS; ci++) {
		const int i = col + 256 * ci;
		if (i >= kv) break;
		uint4 o[GROUP], r[GROUP];
#pragma unroll
		for (int j = 0; j < GROUP; j++) {
			const long long t = t0 + slot0 + j;
			o[j] = t < T ? ((const uint4 *)(x + t * H))[i] : zero;
			r[j] = t < T ? ((const uint4 *)(residual + t * H))[i] : zero;
		}
#pragma unroll
		for (int j = 0; j < GROUP; j++) {
			float a[8], b[8];
			unpack8(o[j], a);
			unpack8(r[j], b);
#pragma unroll
			for (int e = 0; e < 8; e++) a[e] = rbf(b[e] + a[e]), ss[j] += a[e] * a[e];
			sum[j][ci] = pack8(a);
			const long long t = t0 + slot0 + j;
			if (t < T) ((uint4 *)(residual + t * H))[i] = sum[j][ci];
		}
	}
#pragma unroll
	for (int j = 0; j < GROUP; j++) {
		const float v = warp_sum(ss[j]);
		if (lane == 0) red[warp][j] = v;
	}
	__syncthreads();
	if (threadIdx.x < OWN) { // the group's eight warps in order
		const int h = threadIdx.x / GROUP, j = threadIdx.x % GROUP;
		float s = 0.f;
		for (int w = 0; w < 8; w++) s += red[8 * h + w][j];
		inv_s[threadIdx.x] = rsqrtf(s / H + eps);
	}
	__syncthreads();
	cluster_wait(); // every block of the cluster has started
#pragma unroll
	for (int ci = 0; ci < MOE_NR_CHUNKS; ci++) {
		const int i = col + 256 * ci;
		if (i >= kv) break;
		float w[8];
		unpack8(nw[ci], w);
#pragma unroll
		for (int j = 0; j < GROUP; j++) {
			float v[8], o[8];
			unpack8(sum[j][ci], v);
			const float inv = inv_s[slot0 - rank * OWN + j];
#pragma unroll
			for (int e = 0; e < 8; e++) o[e] = w[e] * rbf(v[e] * inv);
			const long long t = t0 + slot0 + j;
			const uint4 out = t < T ? pack8(o) : zero;
			if (t < T) ((uint4 *)(x + t * H))[i] = out;
			const unsigned at = smem_u32(xs + (slot0 + j) * stride + i);
#pragma unroll
			for (int b = 0; b < MOE_NR_RANKS; b++) st_cluster_u4(at, b, out);
		}
	}
	cluster_sync(); // every block's x rows are in every block's xs
	// The logits: (tile, slice) items over the warps.
	for (int it = warp; it < items; it += MOE_NR_WARPS) {
		const int lt = it / MOE_NR_SLICES, s = it % MOE_NR_SLICES, e0 = (rank + lt * MOE_NR_RANKS) * 16 + g;
		const uint4 *w0 = (const uint4 *)(router + (long long)min(e0, E - 1) * H) + q;
		const uint4 *w1 = (const uint4 *)(router + (long long)min(e0 + 8, E - 1) * H) + q;
		const uint4 *xb = xs + g * stride + q;
		const bool first = it == warp;
		float acc[NT][4] = {};
#pragma unroll
		for (int j = 0; j < MOE_NR_PRE; j++) {
			const int c = s + MOE_NR_SLICES * j;
			if (c >= chunks) break;
			const uint4 lo = first ? pre_lo[j] : e0 < E ? __ldg(w0 + 4 * c) : zero; // expert e0
			const uint4 hi = first ? pre_hi[j] : e0 + 8 < E ? __ldg(w1 + 4 * c) : zero;
#pragma unroll
			for (int n = 0; n < NT; n++) {
				const uint4 xv = xb[8 * n * stride + 4 * c];
				mma16816(acc[n], lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
				mma16816(acc[n], lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
			}
		}
		for (int c = s + MOE_NR_SLICES * MOE_NR_PRE; c < chunks; c += MOE_NR_SLICES) {
			const uint4 lo = e0 < E ? __ldg(w0 + 4 * c) : zero, hi = e0 + 8 < E ? __ldg(w1 + 4 * c) : zero;
#pragma unroll
			for (int n = 0; n < NT; n++) {
				const uint4 xv = xb[8 * n * stride + 4 * c];
				mma16816(acc[n], lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
				mma16816(acc[n], lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
			}
		}
#pragma unroll
		for (int n = 0; n < NT; n++) {
			part[s][lt][g][8 * n + 2 * q] = acc[n][0], part[s][lt][g][8 * n + 2 * q + 1] = acc[n][1];
			part[s][lt][g + 8][8 * n + 2 * q] = acc[n][2], part[s][lt][g + 8][8 * n + 2 * q + 1] = acc[n][3];
		}
	}
	__syncthreads();
	for (int i = threadIdx.x; i < mine * 16 * TOK; i += blockDim.x) {
		const int lt = i / (16 * TOK), row = i / TOK % 16, tok = i % TOK;
		const int e = (rank + lt * MOE_NR_RANKS) * 16 + row;
		float s = 0.f;
#pragma unroll
		for (int sl = 0; sl < MOE_NR_SLICES; sl++) s += part[sl][lt][row][tok];
		if (e < E) st_cluster_f32(smem_u32(&logits[tok][e]), 0, rbf(s));
	}
	cluster_sync();
	const int valid = (int)min((long long)TOK, T - t0);
	if (rank != 0) return;
	if (warp < valid) {
		float v[8];
#pragma unroll
		for (int i = 0; i < 8; i++) v[i] = lane + 32 * i < E ? logits[warp][lane + 32 * i] : -EBB_INF;
		const long long at = (t0 + warp) * k;
		moe_route_row(v, ids + at, weights + at, E, k, norm, srt.counts, srt.counts ? srt.inv + at : nullptr);
	}
	if (srt.counts) moe_route_sorted(srt, ids, T * k, E);
#endif
}

// moe_add_norm_route: eight tokens a cluster; moe_add_norm_route16: sixteen.
extern "C" __global__ void __launch_bounds__(MOE_NR_WARPS * 32, 1)
    moe_add_norm_route(int *ids, float *weights, bf16 *x, bf16 *residual, const bf16 *norm_w, float eps,
                       const bf16 *router, int T, int E, int H, int k, int norm, int *order, int *inv,
                       int *offsets, int *tiles, int *counts, int bm) {
	moe_add_norm_route_impl<8>(ids, weights, x, residual, norm_w, eps, router, T, E, H, k, norm,
	                              MoeRouteSort{order, inv, offsets, tiles, counts, bm});
}
extern "C" __global__ void __launch_bounds__(MOE_NR_WARPS * 32, 1)
    moe_add_norm_route16(int *ids, float *weights, bf16 *x, bf16 *residual, const bf16 *norm_w, float eps,
                         const bf16 *router, int T, int E, int H, int k, int norm, int *order, int *inv,
                         int *offsets, int *tiles, int *counts, int bm) {
	moe_add_norm_route_impl<16>(ids, weights, x, residual, norm_w, eps, router, T, E, H, k, norm,
	                              MoeRouteSort{order, inv, offsets, tiles, counts, bm});
}

// moe_sort (one block of 1024 threads) lists the P = T*k pairs grouped by
// expert: order[i] is the pair at sorted position i (pairs of one expert
// in pair order), inv[pair] its position, offsets[e] the first position of
// expert e (offsets[E] = P) and tiles[e] the first of its bm-row tiles
// (tiles[E] = all of them).
//
// Each of the 32 warps takes a contiguous run of the pairs, so pair order
// within an expert is warp order, then order within the warp. A warp
// counts its run's pairs of each expert, 32 at a time (peers with the same
// expert found by __match_any_sync, their first lane adding for all); the
// counts become each warp's start within the expert and the experts'
// offsets (a scan over the experts, E <= 256); then each warp places its
// run again, 32 at a time.
// The serial part is a warp's run, not all P pairs (one warp placing 2,048
// pairs took 31 us of a 30B-A3B layer at batch 256, H100).
//
// Up to MOE_SORT_CACHE pairs (a decode step's), a warp may first load all
// its run's experts at once into shared memory, a byte each (E <= 256),
// and both passes read them there: four L2 round trips in a row at batch
// 256. On the H200 at the 30B-A3B shape, batch 256, it saved about 0.04 ms
// a step (fifty-third stop, docs/gpu-notes.md); EBB_KERNEL_DEFINES=
// MOE_SORT_CACHE=1 turns it off for an A/B run.
#ifndef MOE_SORT_CACHE
#define MOE_SORT_CACHE 8192
#endif
extern "C" __global__ void __launch_bounds__(1024) moe_sort(int *order, int *inv, int *offsets, int *tiles,
                                                            const int *ids, int P, int E, int bm) {
	__shared__ int start[32][MOE_MAX_EXPERTS]; // a warp's count, then its start within the expert
	__shared__ int base[MOE_MAX_EXPERTS];
	__shared__ unsigned char cache[MOE_SORT_CACHE];
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	for (int i = threadIdx.x; i < 32 * E; i += blockDim.x) start[i / E][i % E] = 0;
	DEP();
	const int per = (P + 31) / 32, lo = min(P, warp * per), hi = min(P, lo + per);
	const bool cached = P <= MOE_SORT_CACHE;
	if (cached) {
		constexpr int AT_ONCE = 8; // loads in flight a lane: 256 pairs a warp
		for (int p0 = lo; p0 < hi; p0 += 32 * AT_ONCE) {
			int v[AT_ONCE];
#pragma unroll
			for (int u = 0; u < AT_ONCE; u++) {
				const int p = p0 + 32 * u + lane;
				v[u] = p < hi ? __ldg(ids + p) : 0;
			}
#pragma unroll
			for (int u = 0; u < AT_ONCE; u++) {
				const int p = p0 + 32 * u + lane;
				if (p < hi) cache[p] = (unsigned char)min(max(v[u], 0), E - 1);
			}
		}
		__syncwarp(); // a lane reads the others' bytes
	}
	auto expert = [&](int p) { return p >= hi ? -1 : cached ? (int)cache[p] : min(max(ids[p], 0), E - 1); };
	__syncthreads(); // the counts are zero
	for (int p0 = lo; p0 < hi; p0 += 32) {
		const int p = p0 + lane;
		const int e = expert(p);
		const unsigned peers = __match_any_sync(0xffffffffu, e);
		if (p < hi && lane == __ffs(peers) - 1) start[warp][e] += __popc(peers);
		__syncwarp();
	}
	__syncthreads();
	// Per expert (a thread each): the warps' starts within it and its rows.
	int rows = 0;
	if (threadIdx.x < E)
		for (int w = 0; w < 32; w++) {
			const int c = start[w][threadIdx.x];
			start[w][threadIdx.x] = rows;
			rows += c;
		}
	moe_expert_starts(rows, E, bm, offsets, tiles, base);
	for (int p0 = lo; p0 < hi; p0 += 32) {
		const int p = p0 + lane;
		const int e = expert(p);
		const unsigned peers = __match_any_sync(0xffffffffu, e);
		if (p < hi) {
			const int at = base[e] + start[warp][e] + __popc(peers & ((1u << lane) - 1));
			order[at] = p, inv[p] = at;
		}
		__syncwarp();
		if (p < hi && lane == __ffs(peers) - 1) start[warp][e] += __popc(peers);
		__syncwarp();
	}
}

// moe_gemm: for each expert e, out[r] = a_r @ w[e]^T over its sorted rows
// r in [offsets[e], offsets[e+1]), w [E, N, K]. a_r is x[order[r] / k]
// when order is given (the tokens, gathered), else a[r]. With glu, w's
// rows are each expert's gates then ups (N = 2I) and out [rows, I] takes
// silu(gate) * up, gate and up rounded to bf16 first and silu(gate) after,
// as separate bf16 operations round them.
//
// Grid (column tiles, an upper bound of row tiles): block y finds its
// expert in tiles (cut by moe_sort into tiles of BM rows); blocks past the
// last tile return. Block: 4 warps over a BM x 64 tile (MI 16-row
// fragments each), mma.m16n8k16 over BK-wide steps of K (K a multiple of
// 8), MOE_STAGES steps loading (cp.async) while one computes. With glu a
// tile's weight rows interleave gate and up of 32 columns, so each
// thread's pair of accumulators is a gate and its up.
//
// Two shapes: 64 x 64 tiles with 32-wide steps for prefill, where an
// expert has hundreds of rows; 16 x 64 tiles with 64-wide steps where it
// has a few (a decode batch of 64 tokens gives each of 128 experts about
// four), so that the stages carry twice the weights and no empty rows. A
// row's products add the same 16-wide steps of K in the same order in
// both, so a row has the same bits whichever tile takes it.
template <int BM, int BK, int MI>
__device__ __forceinline__ void moe_gemm_impl(bf16 *out, const bf16 *a, const int *order, int k, const bf16 *w,
                                              const int *offsets, const int *tiles, int E, int N, int K, int glu) {
	constexpr int WM = BM / (16 * MI), WN = 4 / WM, WCOLS = MOE_BN / WN, NJ = WCOLS / 8;
	constexpr int CPR = BK / 8, RSTEP = 128 / CPR, AI = BM / RSTEP, BI = MOE_BN / RSTEP;
	__shared__ __align__(16) bf16 As[MOE_STAGES][BM][BK + 8];
	__shared__ __align__(16) bf16 Bs[MOE_STAGES][MOE_BN][BK + 8];
	DEP();
	const int y = blockIdx.y;
	if (y >= tiles[E]) return;
	int lo = 0, hi = E; // the expert e with tiles[e] <= y < tiles[e + 1]
	while (hi - lo > 1) {
		const int mid = (lo + hi) / 2;
		if (tiles[mid] <= y) lo = mid;
		else hi = mid;
	}
	const int e = lo;
	const int r0 = offsets[e] + (y - tiles[e]) * BM, rend = offsets[e + 1];
	const bf16 *we = w + (long long)e * N * K;
	const int half = N / 2;
	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
	const int wm = warp / WN, wn = warp % WN;
	// Each thread loads AI 16-byte pieces of A and BI of B a step: rows
	// tid / CPR + RSTEP i, k 8 (tid % CPR).
	const int lr = tid / CPR, lk = 8 * (tid % CPR);
	const bf16 *arow[AI > 0 ? AI : 1];
	const bf16 *brow[BI];
#pragma unroll
	for (int i = 0; i < AI; i++) {
		const int r = r0 + lr + RSTEP * i;
		arow[i] = nullptr;
		if (r < rend) arow[i] = order ? a + (long long)(order[r] / k) * K : a + (long long)r * K;
	}
#pragma unroll
	for (int i = 0; i < BI; i++) {
		const int c = lr + RSTEP * i; // a weight row of the tile
		long long n;
		if (glu) {
			const int col = blockIdx.x * (MOE_BN / 2) + (c >> 1);
			n = col < half ? (c & 1 ? half + col : col) : -1;
		} else {
			n = blockIdx.x * MOE_BN + c;
			if (n >= N) n = -1;
		}
		brow[i] = n >= 0 ? we + n * K : nullptr;
	}
	bool live[MI];
#pragma unroll
	for (int i = 0; i < MI; i++) live[i] = r0 + 16 * MI * wm + 16 * i < rend;
	float acc[MI][NJ][4];
#pragma unroll
	for (int i = 0; i < MI; i++)
#pragma unroll
		for (int j = 0; j < NJ; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
	const int steps = (K + BK - 1) / BK;
	auto load = [&](int stage, int k0) {
		const bool in = k0 + lk < K;
#pragma unroll
		for (int i = 0; i < AI; i++) {
			const bool av = in && arow[i];
			cp_async16(smem_u32(&As[stage][lr + RSTEP * i][lk]), av ? arow[i] + k0 + lk : w, av);
		}
#pragma unroll
		for (int i = 0; i < BI; i++) {
			const bool bv = in && brow[i];
			cp_async16(smem_u32(&Bs[stage][lr + RSTEP * i][lk]), bv ? brow[i] + k0 + lk : w, bv);
		}
	};
#pragma unroll
	for (int s = 0; s < MOE_STAGES - 1; s++) {
		if (s < steps) load(s, s * BK);
		cp_async_commit(); // empty groups keep the count uniform
	}
	for (int step = 0; step < steps; step++) {
		cp_async_wait<MOE_STAGES - 2>();
		__syncthreads(); // the step's tiles are in, and every warp is done with the stage refilled next
		const int next = step + MOE_STAGES - 1;
		if (next < steps) load(next % MOE_STAGES, next * BK);
		cp_async_commit();
		const int st = step % MOE_STAGES;
#pragma unroll
		for (int kk = 0; kk < BK; kk += 16) {
			unsigned af[MI][4], bfr[NJ][2];
#pragma unroll
			for (int i = 0; i < MI; i++) {
				const int r = 16 * MI * wm + 16 * i + g;
				af[i][0] = *(const unsigned *)&As[st][r][kk + 2 * q];
				af[i][1] = *(const unsigned *)&As[st][r + 8][kk + 2 * q];
				af[i][2] = *(const unsigned *)&As[st][r][kk + 2 * q + 8];
				af[i][3] = *(const unsigned *)&As[st][r + 8][kk + 2 * q + 8];
			}
#pragma unroll
			for (int j = 0; j < NJ; j++) {
				const int n = WCOLS * wn + 8 * j + g;
				bfr[j][0] = *(const unsigned *)&Bs[st][n][kk + 2 * q];
				bfr[j][1] = *(const unsigned *)&Bs[st][n][kk + 2 * q + 8];
			}
#pragma unroll
			for (int i = 0; i < MI; i++) {
				if (!live[i]) continue; // rows past the expert's: a decode tile is mostly empty
#pragma unroll
				for (int j = 0; j < NJ; j++)
					mma16816(acc[i][j], af[i][0], af[i][1], af[i][2], af[i][3], bfr[j][0], bfr[j][1]);
			}
		}
	}
	cp_async_wait<0>();
	// acc[i][j]: rows 16 MI wm + 16 i + g (+8 for c2, c3), tile columns
	// WCOLS wn + 8 j + 2q, +1.
#pragma unroll
	for (int i = 0; i < MI; i++)
#pragma unroll
		for (int h = 0; h < 2; h++) {
			const int r = r0 + 16 * MI * wm + 16 * i + g + 8 * h;
			if (r >= rend) continue;
#pragma unroll
			for (int j = 0; j < NJ; j++) {
				const float c0 = acc[i][j][2 * h], c1 = acc[i][j][2 * h + 1];
				const int tc = WCOLS * wn + 8 * j + 2 * q; // even: a gate, with its up next
				if (glu) {
					const int col = blockIdx.x * (MOE_BN / 2) + (tc >> 1);
					if (col >= half) continue;
					const float gt = rbf(c0), up = rbf(c1);
					out[(long long)r * half + col] = f2bf(rbf(gt / (1.f + expf(-gt))) * up);
				} else {
					const int col = blockIdx.x * MOE_BN + tc;
					if (col + 1 < N && (N & 1) == 0) {
						*(unsigned *)(out + (long long)r * N + col) = (unsigned)f2bf(c0) | ((unsigned)f2bf(c1) << 16);
					} else {
						if (col < N) out[(long long)r * N + col] = f2bf(c0);
						if (col + 1 < N) out[(long long)r * N + col + 1] = f2bf(c1);
					}
				}
			}
		}
}

#define MOE_GEMM(NAME, BM, BK, MI)                                                                                   \
	extern "C" __global__ void __launch_bounds__(128)                                                                \
	    NAME(bf16 *out, const bf16 *a, const int *order, int k, const bf16 *w, const int *offsets, const int *tiles, \
	         int E, int N, int K, int glu) {                                                                         \
		moe_gemm_impl<BM, BK, MI>(out, a, order, k, w, offsets, tiles, E, N, K, glu);                               \
	}
MOE_GEMM(moe_gemm, 64, 32, 2)
MOE_GEMM(moe_gemm_r16, 16, 64, 1)

// moe_pair_sorted puts token t's k pairs (k <= MOE_MAX_TOPK) in ascending
// expert order, the lower pair first among equal experts (the order in
// which moe_combine and moe_down_combine add their terms): at rank r, the
// pair (order), its weight (wt) and, with inv, its place in y (pos). A
// whole warp calls it, lane j loading pair j, so that a token's ids,
// weights and places arrive in one round trip, not one after another as
// the sort of a single thread asked for them (in local memory). With the
// residual read before the wait too (moe_down_residual, and
// moe_combine_add_rmsnorm), the full 30B-A3B shape on an H200, ms a
// decode step over three rounds: batch 1 3.106 -> 3.018, batch 256
// 18.972 -> 18.899 (fifty-fourth stop).
__device__ __forceinline__ void moe_pair_sorted(int *order, float *wt, int *pos, const int *inv, const int *ids,
                                                const float *weights, int k, long long t) {
	const int lane = threadIdx.x & 31;
	const bool mine = lane < k;
	const int e = mine ? ids[t * k + lane] : 0;
	const float w = mine ? weights[t * k + lane] : 0.f;
	const int at = mine && inv ? inv[t * k + lane] : 0;
	int rank = 0;
	for (int i = 0; i < k; i++) {
		const int ei = __shfl_sync(0xffffffffu, e, i);
		rank += ei < e || (ei == e && i < lane);
	}
	if (!mine) return;
	wt[rank] = w;
	if (order) order[rank] = lane;
	if (pos) pos[rank] = at;
}

// moe_combine_setup: warp 0 lists token t's k choices in ascending expert
// order, their places in y (pos) and weights (wt).
__device__ __forceinline__ void moe_combine_setup(int *pos, float *wt, const int *inv, const int *ids,
                                                  const float *weights, int k, long long t) {
	if (threadIdx.x < 32) moe_pair_sorted(nullptr, wt, pos, inv, ids, weights, k, t);
	__syncthreads();
}

// moe_combine8 sums columns h..h+7 of the k terms into acc (H % 8 == 0):
// every term's 16 bytes are requested before any is added.
__device__ __forceinline__ void moe_combine8(float acc[8], const bf16 *y, const int *pos, const float *wt, int k,
                                             int H, int h, bool f32) {
	uint4 v[MOE_MAX_TOPK];
#pragma unroll
	for (int j = 0; j < MOE_MAX_TOPK; j++)
		if (j < k) v[j] = __ldcs((const uint4 *)(y + (long long)pos[j] * H + h));
#pragma unroll
	for (int i = 0; i < 8; i++) acc[i] = 0.f;
#pragma unroll
	for (int j = 0; j < MOE_MAX_TOPK; j++) {
		if (j >= k) break;
		float f[8];
		unpack8(v[j], f);
#pragma unroll
		for (int i = 0; i < 8; i++) {
			const float term = wt[j] * f[i];
			acc[i] = f32 ? acc[i] + term : rbf(acc[i] + rbf(term));
		}
	}
}

// moe_sorted_rows writes x's rows in the experts' sorted order (row inv[t k
// + j] is token t's, for each of its k choices), so that moe_wg's gate and
// up read a box of rows a stage, not one 128-byte copy a row: the tensor
// memory accelerator's copies of a row each held moe_wg's gate and up at
// 120 TFLOP/s where down's boxes ran at 440 (a prefill chunk of 8,192
// tokens, 30B-A3B shape, H200). A block a token reads its row once (H % 8
// == 0).
extern "C" __global__ void moe_sorted_rows(bf16 *out, const bf16 *x, const int *inv, int k, int H) {
	DEP();
	const long long t = blockIdx.x;
	for (int h = 8 * threadIdx.x; h < H; h += 8 * blockDim.x) {
		const uint4 v = *(const uint4 *)(x + t * H + h);
		for (int j = 0; j < k; j++) *(uint4 *)(out + (long long)inv[t * k + j] * H + h) = v;
	}
}

// moe_combine: out[t] = sum over token t's k choices, in ascending expert
// order, of weight * y[inv[pair]] (y [P, H], the experts' results in
// sorted order). A bf16 out rounds each term and each partial sum, as
// transformers' index_add_ into a bf16 tensor does; a float32 out (a
// tensor-parallel partial sum) keeps them in float.
extern "C" __global__ void moe_combine(void *out, int out_f32, const bf16 *y, const int *inv, const int *ids,
                                       const float *weights, int k, int H) {
	__shared__ int pos[MOE_MAX_TOPK];
	__shared__ float wt[MOE_MAX_TOPK];
	const long long t = blockIdx.x;
	DEP();
	moe_combine_setup(pos, wt, inv, ids, weights, k, t);
	for (int h = 8 * threadIdx.x; h < H; h += 8 * blockDim.x) {
		float acc[8];
		moe_combine8(acc, y, pos, wt, k, H, h, out_f32);
		if (out_f32) {
			float4 *o = (float4 *)((float *)out + t * H + h);
			o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]), o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
		} else *(uint4 *)((bf16 *)out + t * H + h) = pack8(acc);
	}
}

// moe_combine_add_rmsnorm is moe_combine into bf16 and then
// add_rmsnorm_v8 (residual += the sum, x = rmsnorm(residual) * w) in one
// launch, a block of H / 8 threads a token: the same bits, and a step of
// 256 tokens saves a launch a sparse layer (30B-A3B shape, H200: moe_combine
// 9.2 us, add_rmsnorm 3.6).
//
// It runs after the down product, which runs after gate and up: ids,
// weights (moe_route) and inv (moe_sort) were written before gate and up
// passed their waits, and a block of down has passed its own when this
// kernel starts, so the token's places and weights (and the residual,
// which o_proj's add wrote before the routing, and the norm's weights)
// are read before the wait, and only the experts' results after it
// (MOE_COMBINE_EARLY 0: all after it, for A/B runs). 30B-A3B shape, H200,
// batch-256 decode step, ms, two rounds in one run: 19.062 / 19.028
// without, 18.951 / 19.053 with (and 19.177 / 19.083 with neither this nor
// moe_wg's first tiles).
#ifndef MOE_COMBINE_EARLY
#define MOE_COMBINE_EARLY 1
#endif
extern "C" __global__ void moe_combine_add_rmsnorm(bf16 *residual, bf16 *x, const bf16 *w, float eps, const bf16 *y,
                                                   const int *inv, const int *ids, const float *weights, int k,
                                                   int H) {
	__shared__ int pos[MOE_MAX_TOPK];
	__shared__ float wt[MOE_MAX_TOPK];
	const long long t = blockIdx.x;
	if (!MOE_COMBINE_EARLY) DEP();
	moe_combine_setup(pos, wt, inv, ids, weights, k, t);
	const int i = 8 * threadIdx.x;
	uint4 r = make_uint4(0, 0, 0, 0), wv = r;
	if (i < H) r = *(const uint4 *)(residual + t * H + i), wv = *(const uint4 *)(w + i);
	if (MOE_COMBINE_EARLY) DEP();
	float v[8];
	if (i < H) moe_combine8(v, y, pos, wt, k, H, i, false);
	norm_loaded8(residual, r, v, x, wv, H, eps, t * H, i);
}

// ---- decode: a few tokens ----------------------------------------------------
//
// With a handful of tokens nearly every (token, choice) pair has an expert
// of its own, and moe_gemm's 64-row tiles hold one row each: the weights
// stream through a pipeline sized for a full tile (H100, Qwen3-30B-A3B
// shape, batch 1: 1.5 TB/s). These two kernels take such steps as gemv
// does a dense layer, with no grouping by expert.

// moe_gemv_glu: act[p] = silu(gate) * up of expert ids[p] for token p / k,
// blockIdx.y the pair p, as gemv2 with glu computes a dense layer's.
extern "C" __global__ void __launch_bounds__(256) moe_gemv_glu(bf16 *act, const bf16 *x, const int *ids, int k,
                                                               const bf16 *w, int E, int N, int K, int wpo) {
	dep_wait(); // moe_route picks the weights to read
	const int p = blockIdx.y, e = min(max(ids[p], 0), E - 1);
	gemv_impl<1, 2>(act + (long long)p * (N / 2), 0, x + (long long)(p / k) * K, w + (long long)e * N * K, N, K, wpo,
	                nullptr, nullptr, 0, 0.f, 1);
}

// moe_gemv_glu_loop is moe_gemv_glu (the same bits) on a smaller grid: a
// block takes column groups blockIdx.x, blockIdx.x + gridDim.x, ... below
// xblocks, so that room is left on the SMs for the down products' blocks,
// which then launch (dependent launch) and ask for their weights while
// gate and up still stream, not after them (EBB_MOE_GLU_BLOCKS). A kernel
// of its own: the loop takes moe_gemv_glu from 48 registers to 63 (NVRTC
// 11.8, sm_80), four blocks an SM where it had five.
extern "C" __global__ void __launch_bounds__(256) moe_gemv_glu_loop(bf16 *act, const bf16 *x, const int *ids, int k,
                                                                    const bf16 *w, int E, int N, int K, int wpo,
                                                                    int xblocks) {
	dep_wait();
	const int p = blockIdx.y, e = min(max(ids[p], 0), E - 1);
	for (int bx = blockIdx.x; bx < xblocks; bx += gridDim.x) {
		gemv_impl<1, 2>(act + (long long)p * (N / 2), 0, x + (long long)(p / k) * K, w + (long long)e * N * K, N, K,
		                wpo, nullptr, nullptr, 0, 0.f, 1, bx);
		if (bx + gridDim.x < xblocks) __syncthreads(); // the group's shared sums are read before the next one's
	}
}

// Output columns of one token that a moe_down_combine block takes.
#define MOE_DOWN_COLS 4

// moe_down_residual is the residual at the column moe_down_finish has this
// thread add to (0 where it adds none). The residual was written before
// the experts' gate and up passed their waits (o_proj's add), so it is read
// before this kernel's, and the block's last step waits on no load.
__device__ __forceinline__ float moe_down_residual(const bf16 *residual, int H, long long t, int n0) {
	const int n = n0 + threadIdx.x;
	return residual && threadIdx.x < MOE_DOWN_COLS && n < H ? bf2f(residual[t * H + n]) : 0.f;
}

// moe_down_finish adds a moe_down_combine block's dots [column][pair] in
// ascending expert order (order and wt from moe_pair_sorted), each term
// and partial sum rounded as moe_combine rounds them, into out or
// (residual set) the residual, whose value at the thread's column (rv,
// from moe_down_residual) was read before the wait; every thread of the
// block calls it.
__device__ __forceinline__ void moe_down_finish(void *out, int out_f32, int k, int H, bf16 *residual, float rv,
                                                float *sq, long long t, int n0,
                                                float dots[MOE_DOWN_COLS][MOE_MAX_TOPK], const int *order,
                                                const float *wt) {
	constexpr int R = MOE_DOWN_COLS;
	__syncthreads();
	const int r = threadIdx.x, n = n0 + r;
	if (r >= R) return;
	float acc = 0.f;
	if (n < H)
		for (int j = 0; j < k; j++) {
			const float term = wt[j] * rbf(dots[r][order[j]]);
			acc = out_f32 ? acc + term : rbf(acc + rbf(term));
		}
	if (residual) {
		float v = 0.f;
		if (n < H) {
			v = rbf(rv + acc);
			residual[t * H + n] = f2bf(v);
		}
		float s = v * v;
#pragma unroll
		for (int o = 1; o < R; o <<= 1) s += __shfl_xor_sync((1u << R) - 1, s, o);
		if (r == 0) sq[t * gridDim.x + blockIdx.x] = s;
		return;
	}
	if (n >= H) return;
	if (out_f32) ((float *)out)[t * H + n] = acc;
	else ((bf16 *)out)[t * H + n] = f2bf(acc);
}

// moe_down_combine: the down products of a token's k pairs and their
// weighted sum in one pass; a block takes MOE_DOWN_COLS output columns
// from n0 of token blockIdx.y. Its (column, pair) dot products are spread
// over the eight warps, each striding I with its 32 lanes, so that every
// thread has the next chunk of each of its products in flight while it
// multiplies the current one (rather than a warp a column with the k
// products in series: a 12-layer 30B-A3B shape at batch 1, 1.189 -> 1.151
// ms a step on the H100). Each dot product with act [T*k, I] (pair order)
// is rounded to bf16 as moe_gemm's output is, then added in ascending
// expert order, rounded as moe_combine adds them.
//
// ids and weights come from moe_route, which finished before
// moe_gemv_glu passed its dep_wait and let this kernel launch: they and
// the weights they pick are read before this kernel waits for
// moe_gemv_glu's act.
//
// With residual set (bf16 out, the add mode of gemv_fused's squares mode)
// the sum is added to the residual, rounded as add_rmsnorm rounds it, and
// the block leaves in sq[t * gridDim.x + blockIdx.x] the sum of its
// columns' squares, from which the next layer's qkv gemv normalises the
// residual as it reads it: the layer needs no add_rmsnorm of its own.
extern "C" __global__ void __launch_bounds__(256) moe_down_combine(void *out, int out_f32, const bf16 *act,
                                                                   const int *ids, const float *weights, int k,
                                                                   const bf16 *w, int E, int H, int I,
                                                                   bf16 *residual, float *sq) {
	// Q products a warp in each pass: the 8 warps take R columns of up to
	// top 8 in one pass.
	constexpr int R = MOE_DOWN_COLS, Q = R;
	__shared__ float dots[R][MOE_MAX_TOPK];
	__shared__ int order[MOE_MAX_TOPK];
	__shared__ float wt[MOE_MAX_TOPK];
	const long long t = blockIdx.y;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n0 = blockIdx.x * R, kv = I / 8;
	if (warp == 0) moe_pair_sorted(order, wt, nullptr, nullptr, ids, weights, k, t);
	const float rv = moe_down_residual(residual, H, t, n0);
	for (int q0 = 0; q0 < R * k; q0 += 8 * Q) {
		const uint4 *wr[Q], *ar[Q];
		bool ok[Q];
		uint4 cur[Q];
#pragma unroll
		for (int s = 0; s < Q; s++) {
			const int q = q0 + warp + 8 * s, r = q / k, j = q % k;
			ok[s] = q < R * k && n0 + r < H;
			const int e = ok[s] ? min(max(ids[t * k + j], 0), E - 1) : 0;
			wr[s] = (const uint4 *)(w + ((long long)e * H + (ok[s] ? n0 + r : 0)) * I);
			ar[s] = (const uint4 *)(act + (t * k + j) * I);
			cur[s] = ok[s] && lane < kv ? __ldcs(wr[s] + lane) : make_uint4(0, 0, 0, 0);
		}
		if (q0 == 0) DEP();
		float dot[Q];
#pragma unroll
		for (int s = 0; s < Q; s++) dot[s] = 0.f;
		for (int i = lane; i < kv; i += 32) {
			uint4 next[Q];
#pragma unroll
			for (int s = 0; s < Q; s++) next[s] = ok[s] && i + 32 < kv ? __ldcs(wr[s] + i + 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
			for (int s = 0; s < Q; s++) {
				if (!ok[s]) continue;
				dot[s] = dot8(cur[s], __ldg(ar[s] + i), dot[s]);
				cur[s] = next[s];
			}
		}
#pragma unroll
		for (int s = 0; s < Q; s++) {
			const float d = warp_sum(dot[s]);
			const int q = q0 + warp + 8 * s;
			if (lane == 0 && ok[s]) dots[q / k][q % k] = d;
		}
	}
	moe_down_finish(out, out_f32, k, H, residual, rv, sq, t, n0, dots, order, wt);
}

// moe_down_bulk is moe_down_combine (the same products, sums and bits)
// with its weights brought in by the copy engine: before it waits for
// moe_gemv_glu, one thread asks for the block's columns of each chosen
// expert (contiguous in w [E, H, I]: k copies of MOE_DOWN_COLS rows) into
// shared memory, so that all of them are in flight at once without
// holding registers, and the block's eight warps then take its (column,
// pair) products from shared memory. Dynamic shared memory: k *
// MOE_DOWN_COLS * I bf16 (sm_90: bulk copies).
extern "C" __global__ void __launch_bounds__(256) moe_down_bulk(void *out, int out_f32, const bf16 *act, const int *ids,
                                                                const float *weights, int k, const bf16 *w, int E,
                                                                int H, int I, bf16 *residual, float *sq) {
#if __CUDA_ARCH__ >= 900
	constexpr int R = MOE_DOWN_COLS;
	extern __shared__ __align__(128) unsigned char moe_down_smem[];
	__shared__ __align__(8) unsigned long long bar;
	__shared__ float dots[R][MOE_MAX_TOPK];
	__shared__ int order[MOE_MAX_TOPK];
	__shared__ float wt[MOE_MAX_TOPK];
	const long long t = blockIdx.y;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n0 = blockIdx.x * R, cols = min(R, H - n0);
	const unsigned rows = smem_u32(moe_down_smem), b = smem_u32(&bar), bytes = (unsigned)cols * I * 2;
	if (threadIdx.x == 0) {
		// ids come from moe_route, which finished before moe_gemv_glu let
		// this kernel launch.
		mbar_init(b, 1);
		asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
		mbar_expect_tx(b, bytes * k);
		for (int j = 0; j < k; j++) {
			const int e = min(max(ids[t * k + j], 0), E - 1);
			bulk_load(rows + j * R * I * 2, w + ((long long)e * H + n0) * I, bytes, b);
		}
	}
	if (warp == 1) moe_pair_sorted(order, wt, nullptr, nullptr, ids, weights, k, t);
	const float rv = moe_down_residual(residual, H, t, n0);
	__syncthreads();
	DEP();
	mbar_wait(b, 0);
	const int kv = I / 8;
	for (int q = warp; q < R * k; q += 8) {
		const int r = q / k, j = q % k;
		if (r >= cols) continue;
		const uint4 *wr = (const uint4 *)(moe_down_smem + (size_t)(j * R + r) * I * 2);
		const uint4 *ar = (const uint4 *)(act + (t * k + j) * I);
		float d = 0.f;
		for (int i = lane; i < kv; i += 32) d = dot8(wr[i], __ldg(ar + i), d);
		d = warp_sum(d);
		if (lane == 0) dots[r][j] = d;
	}
	moe_down_finish(out, out_f32, k, H, residual, rv, sq, t, n0, dots, order, wt);
#endif
}

// moe_shared_add: out[t] += sigmoid(gate[t]) * y[t] (Qwen2-MoE's shared
// expert and its gate), the sigmoid and each product rounded to bf16 as
// transformers' bf16 tensors round them, the sum to out's dtype (float32:
// a tensor-parallel partial sum). A block a row, eight columns a thread
// (H % 8 == 0).
extern "C" __global__ void moe_shared_add(void *out, int out_f32, const bf16 *y, const bf16 *gate, int H) {
	const long long t = blockIdx.x;
	DEP();
	const float g = bf2f(gate[t]);
	const float s = rbf(1.f / (1.f + expf(-g)));
	for (int h = 8 * threadIdx.x; h < H; h += 8 * blockDim.x) {
		float f[8];
		unpack8(__ldcs((const uint4 *)(y + t * H + h)), f);
		if (out_f32) {
			float *o = (float *)out + t * H + h;
#pragma unroll
			for (int e = 0; e < 8; e++) o[e] += rbf(s * f[e]);
			continue;
		}
		uint4 *o = (uint4 *)((bf16 *)out + t * H + h);
		float a[8];
		unpack8(*o, a);
#pragma unroll
		for (int e = 0; e < 8; e++) a[e] += rbf(s * f[e]);
		*o = pack8(a);
	}
}
