// moe_wg runs moe_gemm's products (each expert's weights over its sorted
// rows) on Hopper's warpgroup MMA, outside deterministic inference. At
// decode batches of 16 to 256 tokens an expert has a few rows and the step
// is bound by reading every chosen expert's weights once, which moe_gemm's
// cp.async tiles do at 72-80 % of HBM speed and this kernel at 84-88 %
// (30B-A3B shape, uniform routing, H100: `ebb bench moe`). This is
// matmul_wg's scheme: a producer warp has the tensor memory accelerator
// fill a ring of stages, and two warpgroups run m64nBNk16 with 128 weight
// rows as M and the expert's rows (padded to BN) as N.
//
// Block (x, y) takes weight tile x of the expert whose BN-row tile y is
// (tiles and offsets from moe_sort, cut at BN rows). There are no K
// splits: the experts' tiles fill the GPU many times over. Two blocks an
// SM (three for 32-row tiles), so that one block's first stages land
// while the others stream.
//
// The rows arrive in two ways:
//   - gathered (order set; gate and up read token order[r] / k of x): one
//     128-byte row a copy, each to its place in the ring. The 128-byte
//     swizzle is a function of the shared address (bits 4-6 XOR bits 7-9),
//     so a row copied alone lands where the row of a whole box would.
//   - contiguous (order null; down reads the sorted activations): one box
//     of BN rows. Rows past the expert's are other experts' or zeros past
//     the end; their columns of the product are not stored.
//
// w's map is 5-d (k, row within 8, gate or up, group of 8 rows, expert),
// matmul_wg's 4-d map with the expert outermost, so that with glu a
// thread's accumulator rows g and g + 8 are a gate and its up, and the
// block writes silu(gate) * up rounded as moe_gemm rounds it.
#define MOE_WG_RING (100 << 10) // two blocks an SM
// The 32-row tiles of decode batches take three blocks an SM on three
// stages: a block's first stages then land while two others stream.
// 30B-A3B shape, H200, `ebb bench moe` us, two blocks of five stages
// against three of three: 64 tokens 292.5 / 292.2, 256 316.4 / 308.0
// (four of two: 310.4; one of ten: 431.7); batch-256 decode step 19.381 /
// 19.373 -> 18.819 / 18.811 ms, the same tokens. EBB_KERNEL_DEFINES sets
// both for A/B runs (the host reads MOE_WG_RING32 too).
#ifndef MOE_WG_RING32
#define MOE_WG_RING32 (60 << 10)
#endif
#ifndef MOE_WG_BLOCKS32
#define MOE_WG_BLOCKS32 3
#endif
// Weight stages a refill asks for at once where the ring has five or more
// (none by default; the 32-row tiles at MOE_WG_RING32=102400 and
// MOE_WG_BLOCKS32=2): each weight row's bytes then reach DRAM in runs of
// 256 rather than 128. 30B-A3B shape, H200, `ebb bench moe` us, one stage
// against two: 256 tokens 323.6 / 320.7, 512 484.3 / 472.6; batch-256
// decode step 19.961 / 19.975 -> 19.802 / 19.819 ms. The 128-row tiles'
// three stages lost with two (prefill of 256 x 128 tokens 452-461 ->
// 471 ms). With MOE_WG_EARLY (below) the batch-256 step went from 19.766 /
// 19.724 (neither) to 19.433 / 19.442 ms (both), one machine. (torch's
// x.sum() reads HBM at 4.21 TB/s there; these products ran at 4.0.)
#ifndef MOE_WG_BURST
#define MOE_WG_BURST 2
#endif
#ifndef MOE_WG_EARLY
#define MOE_WG_EARLY 1 // 0: every block waits for the kernel before it first (A/B runs); see moe_wg_impl
#endif

__host__ __device__ constexpr int moe_wg_stages(int bn) {
	return (bn == 32 ? MOE_WG_RING32 : MOE_WG_RING) / (MWG_ROWS * 128 + bn * 128);
}

// mbar_expect_more adds bytes to the stage's expected transfer without
// arriving: the stage cannot complete before its one arrival.
__device__ __forceinline__ void mbar_expect_more(unsigned bar, unsigned bytes) {
	asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tma_load_5d(unsigned dst, const TmaDesc *map, unsigned bar, int c0, int c1, int c2,
                                            int c3, int c4) {
	asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
	             "%4, %5, %6}], [%7];" ::"r"(dst),
	             "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
	             : "memory");
}

// moe_wg_further finds further tile o (0, 1, ...) of the experts' tiles
// past each one's first, in expert order: its expert e and its tile j
// (1 or more) within it; false past the last. Every thread of the block
// calls it (E <= 256 < MWG_THREADS). Expert i has tiles[i + 1] - tiles[i]
// tiles, so the further tiles before expert i + 1 number tiles[i + 1] less
// the experts up to i that have rows (a scan of ballots).
__device__ __forceinline__ bool moe_wg_further(const int *tiles, int E, int o, int &e, int &j) {
	__shared__ int warp_rows[MWG_THREADS / 32], before;
	const int tid = threadIdx.x, lane = tid & 31;
	const int t0 = tid < E ? tiles[tid] : 0, t1 = tid < E ? tiles[tid + 1] : 0;
	const unsigned has = __ballot_sync(0xffffffffu, t1 > t0);
	if (lane == 0) warp_rows[tid >> 5] = __popc(has);
	__syncthreads();
	int with = __popc(has & (0xffffffffu >> (31 - lane))); // experts up to tid that have rows
	for (int w = 0; w < (tid >> 5); w++) with += warp_rows[w];
	const int upto = tid < E ? t1 - with : 0x7fffffff; // further tiles of experts 0..tid
	e = __syncthreads_count(upto <= o);
	if (e >= E) return false;
	if (tid == e) before = upto - max(t1 - t0 - 1, 0); // further tiles before expert e
	__syncthreads();
	j = 1 + o - before;
	return true;
}

template <int BN>
__device__ void moe_wg_impl(const TmaDesc *wmap, const TmaDesc *xmap, bf16 *out, const int *order, int k,
                            const int *offsets, const int *tiles, int E, int N, int K, int glu, int first) {
#ifdef MWG_ON
	constexpr int WBYTES = MWG_ROWS * 128, STAGE = WBYTES + BN * 128, S = moe_wg_stages(BN);
	constexpr int BURST = S >= 5 && MOE_WG_BURST < S ? MOE_WG_BURST : 1;
	extern __shared__ unsigned char wg_smem[];
	__shared__ __align__(8) unsigned long long bars[2 * S];
	__shared__ int xrow[BN];
	const int tid = threadIdx.x, lane = tid & 31;
	const unsigned base = (smem_u32(wg_smem) + 1023) & ~1023u;
	const unsigned full = smem_u32(bars), empty = full + 8 * S; // stage s: + 8 s
	if (tid == MWG_CONSUMERS) {
		for (int s = 0; s < S; s++) {
			mbar_init(full + 8 * s, 1);
			mbar_init(empty + 8 * s, MWG_CONSUMERS);
		}
		asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
	}
	// Rows in a box (order null) come from a kernel after the grouping
	// (moe_sort, or moe_add_norm_route's last cluster; "moe_sort" below):
	// the sorted rows or gate and up. moe_sort, which wrote tiles and offsets,
	// then finished before the kernel before this one passed its wait (DEP
	// waits, then lets the next kernel launch), so the block finds its
	// expert and asks for its first weight stages before it waits, and they
	// stream while that kernel's last blocks finish: `ebb bench moe`, 256
	// tokens, 321.4 -> 316.3 us. Gathered rows wait first: the kernel
	// before is moe_sort.
	//
	// With first set, block y < E takes expert y's first row tile, so it
	// knows its weights before moe_sort has run and asks for its first
	// stages before it waits: they stream while moe_sort runs, one block
	// on one SM (or while the routing runs on a cluster of four a 16
	// tokens, whose last cluster groups the pairs). Blocks past E take the experts' further tiles in order
	// (moe_wg_further). An expert with no rows still reads those stages.
	const int y = blockIdx.y, tile = blockIdx.x, nt = K / MWG_BK;
	const bool known = first && y < E;
	if (known && tid == MWG_CONSUMERS)
		for (int t = 0; t < min(nt, S); t++) {
			mbar_expect_more(full + 8 * t, WBYTES); // the rows' bytes and the arrival come after the wait
			tma_load_5d(base + t * STAGE, wmap, full + 8 * t, t * MWG_BK, 0, 0, tile * 8, y);
		}
	const bool early = MOE_WG_EARLY && order == nullptr && !first;
	if (!early) DEP();
	int e = y, et = 0; // the expert and its row tile within it
	if (first && !known) {
		if (!moe_wg_further(tiles, E, y - E, e, et)) return;
	} else if (!first) {
		if (y >= tiles[E]) return; // the grid is an upper bound of the row tiles
		// The expert e with tiles[e] <= y < tiles[e + 1]: tiles ascends, so e is
		// one less than the count of such entries, one load a thread (a search
		// would wait on seven loads in a row).
		int below = 0;
		for (int i0 = 0; i0 < E; i0 += blockDim.x) below += __syncthreads_count(i0 + tid < E && tiles[i0 + tid] <= y);
		e = below - 1, et = y - tiles[e];
	}
	const int r0 = offsets[e] + et * BN, rows = min(BN, offsets[e + 1] - r0);
	if (rows <= 0) { // known, no rows: its stages land before the block leaves
		if (tid == MWG_CONSUMERS)
			for (int t = 0; t < min(nt, S); t++) {
				mbar_arrive(full + 8 * t);
				mbar_wait(full + 8 * t, 0);
			}
		return;
	}
	const unsigned bytes = WBYTES + (order ? rows : BN) * 128;
	if (tid == MWG_CONSUMERS) // the first stages' weights (or, known, their rows' bytes), while the rows are listed
		for (int t = 0; t < min(nt, S); t++) {
			mbar_expect_tx(full + 8 * t, known ? bytes - WBYTES : bytes);
			if (!known) tma_load_5d(base + t * STAGE, wmap, full + 8 * t, t * MWG_BK, 0, 0, tile * 8, e);
		}
	if (early) DEP(); // the rows
	if (order)
		for (int i = tid; i < rows; i += blockDim.x) xrow[i] = order[r0 + i] / k;
	__syncthreads(); // xrow

	// d[4 j + c]: tile row 64 wg + 16 warp + g + 8 (c >> 1), batch row
	// 8 j + 2 q + (c & 1), as in matmul_wg.
	const int g = lane >> 2, q = lane & 3, trow = (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + g;
	float d[BN / 2];
#pragma unroll
	for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
	if (tid >= MWG_CONSUMERS) {
		for (int t = 0; t < nt; t++) {
			const int s = t % S;
			const unsigned dst = base + s * STAGE, bar = full + 8 * s;
			if (t >= S && (t - S) % BURST == 0) {
				const int end = min(t + BURST, nt);
				for (int u = t; u < end; u++) mbar_wait(empty + 8 * (u % S), (u / S - 1) & 1);
				if (lane == 0)
					for (int u = t; u < end; u++) {
						mbar_expect_tx(full + 8 * (u % S), bytes);
						tma_load_5d(base + (u % S) * STAGE, wmap, full + 8 * (u % S), u * MWG_BK, 0, 0, tile * 8, e);
					}
				__syncwarp(); // the stages' bytes are expected before any row lands
			}
			if (!order && lane == 0) tma_load_2d(dst + WBYTES, xmap, bar, t * MWG_BK, r0);
			if (order)
				for (int j = lane; j < rows; j += 32) tma_load_2d(dst + WBYTES + j * 128, xmap, bar, t * MWG_BK, xrow[j]);
		}
		return;
	}
	const int wg = tid >> 7;
	for (int t = 0; t < nt; t++) {
		const int s = t % S;
		mbar_wait(full + 8 * s, (t / S) & 1);
		mwg_stage<BN>(d, base + s * STAGE, WBYTES, wg);
		if (t > 0) mbar_arrive(empty + 8 * ((t - 1) % S));
	}
	asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
	for (int i = 0; i < BN / 2; i++) asm volatile("" : "+f"(d[i])::"memory");
	const int half = N / 2;
#pragma unroll
	for (int j = 0; j < BN / 8; j++)
#pragma unroll
		for (int c = 0; c < 4; c++) {
			const int r = 8 * j + 2 * q + (c & 1);
			if (r >= rows) continue;
			const long long orow = r0 + r;
			if (glu) {
				const int col = 64 * tile + 8 * (trow >> 4) + g;
				if (c < 2 && col < half) out[orow * half + col] = silu_mul1(rbf(d[4 * j + c]), rbf(d[4 * j + c + 2]));
				continue;
			}
			const int n = MWG_ROWS * tile + trow + 8 * (c >> 1);
			if (n < N) out[orow * N + n] = f2bf(d[4 * j + c]);
		}
#else
	__trap(); // the host runs moe_wg only from an sm_90a build
#endif
}

#define MOE_WG(BN)                                                                                                    \
	extern "C" __global__ void __launch_bounds__(MWG_THREADS, BN == 32 ? MOE_WG_BLOCKS32 : 2)                         \
	    moe_wg_n##BN(const MWG_GRID_CONST TmaDesc wmap, const MWG_GRID_CONST TmaDesc xmap, bf16 *out, const int *order, \
	                 int k, const int *offsets, const int *tiles, int E, int N, int K, int glu, int first) {           \
		moe_wg_impl<BN>(&wmap, &xmap, out, order, k, offsets, tiles, E, N, K, glu, first);                            \
	}
MOE_WG(32)
MOE_WG(64)
MOE_WG(128)
