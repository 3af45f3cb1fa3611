// matmul_wg computes out[m, n] = sum_k x[m, k] w[n, k] for decode batches
// of 25 to 128 rows (and every product of deterministic inference, up to
// 256 rows a tile), on Hopper's warpgroup MMA (wgmma; sm_90a only).
// Such a product reads its weights once and x many times. cuBLAS's tiles
// take 5.3-7 us for the 0.6B model's products whatever the rows between 8
// and 128, a quarter to half of HBM bandwidth (H100); kernels of our own
// on mma.sync lost to it past 24 rows (each x fragment fed two mma.sync
// and was read from shared memory by every warp), and so did this one
// while 256 threads copied the tiles with cp.async (the address arithmetic
// alone held it to a stage a microsecond).
//
// A block takes 128 weight rows, the M side of two warpgroups' m64nBNk16
// (BN: the batch rows, padded), over a range of K: the K splits of a tile
// are one thread block cluster, sized so that the grid fills the SMs once.
// One thread of a producer warpgroup has the tensor memory accelerator copy
// each stage (64 of k: the weights' 128 x 64 and x's BN x 64) into a ring
// of shared memory in the 128-byte swizzle, which wgmma reads through
// matrix descriptors; full and empty barriers pass the stages between it
// and the warpgroups.
// The first stages' weights are requested before waiting for the previous
// kernel, which never writes them.
//
// With splits, each block leaves its fp32 sums in its shared memory and
// block r of the cluster adds fragments r, r + splits, ... of all blocks in
// rank order (distributed shared memory), so every run gives the same bits.
// Deterministic decode steps of o_proj and down_proj may instead leave each
// split's sums in global memory (out_f32 2, no cluster) for the norm that
// follows to add in the same order: the same bits without the cluster's
// barriers and remote reads (add_rmsnorm_parts_v8).
//
// matmul_wg_part takes deterministic inference's prefills, whose batch
// tiles fill the GPU without splits: persistent blocks take the tiles in
// turn, a block runs all of a tile's K, and at every kpart k-steps (a
// split's length) adds its accumulators into a running sum, 0 + p0 + p1 +
// ... as the cluster adds its ranks. A row gets the bits
// a decode step's split product gives it, without a cluster's pipeline
// refilled every few k-steps and its sums passed through shared memory.
//
// w's tensor map is 4-d (k, row within 8, gate or up, group of 8 rows), so
// that with glu each 16-row group of the tile is 8 gates and their 8 ups:
// a warp's accumulator rows g and g + 8 are a gate and its up, and the
// block writes silu(gate) * up as silu_mul would (as matmul_tc does).
// Without glu the same map walks 128 consecutive rows.
//
// Two modes, for tiles of up to 48 rows, fold the decode layer's
// add_rmsnorm into the products around it, as gemv_fused's squares mode
// and the normalising gemv do for one row (a kernel boundary costs 2.4-2.7
// us at these batches, H100):
//   - add (residual set): residual += the product, rounded as add_rmsnorm
//     rounds it; out is not written, and sq[row * gridDim.x + tile] takes
//     the sum of squares of the tile's new residual values;
//   - norm (norm_w set): x is such a residual h, which the consumers turn
//     into norm_w * rmsnorm(h) in shared memory once a round of the ring
//     has landed (the row's nsq partial sums in sq give its scale), before
//     wgmma reads it. Deterministic inference folds on matmul_wg_few.
#define MWG_ROWS 128
// matmul_wg_part's tile order: a weight tile's batch tiles in turn, so
// that the blocks running at once read the same weights (one read from
// HBM, the rest from L2). Only products of several batch tiles and more
// tiles than blocks see it: a deterministic decode batch's lm_head at
// 193-256 rows, 2 x 1,187 tiles on 132 blocks (H200, 0.6B shape, alone:
// weight tiles first 198.1 us and 698 MB, the vocabulary read twice;
// batch tiles first 179.8 us and 383 MB), and deterministic prefills
// (256 x 128 the same 82 ms). 0 takes the weight tiles first, for A/B
// runs.
#ifndef MWG_PART_BATCH_FASTEST
#define MWG_PART_BATCH_FASTEST 1
#endif
#define MWG_CONSUMERS 256
#define MWG_THREADS (MWG_CONSUMERS + 32) // moe_wg's block: two warpgroups and the producer warp
// MWG_REGS: matmul_wg's producer is a whole warpgroup that gives its
// registers to the consumers (setmaxnreg: 232 a consumer thread, 40 a
// producer's). ptxas allots a block of 288 threads as three warpgroups,
// 168 registers a thread, and matmul_wg_part_n128's 128 accumulators (the
// sums and their running sum) spilled there: 92 bytes (nvcc 13). H100,
// 0.6B shape, deterministic prefills 256 x 128 105 -> 87 ms and 64 x 1,024
// 247 -> 212 ms; decode level at both flags. MWG_REGS=0 (in
// EBB_KERNEL_DEFINES, which the host reads too) keeps the producer warp of
// 288 threads, for A/B runs.
#ifndef MWG_REGS
#define MWG_REGS 1
#endif
#define MWG_BLOCK (MWG_CONSUMERS + (MWG_REGS ? 128 : 32)) // matMulWGBlock
#define MWG_BK 64
#define MWG_MAX_CLUSTER 8 // matMulWGMaxCluster: a tile's K splits

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MWG_ON 1
#define MWG_GRID_CONST __grid_constant__
#else
#define MWG_GRID_CONST
#endif

// A CUtensorMap, passed by value as a kernel parameter.
struct __align__(64) TmaDesc {
	unsigned long long v[16];
};

// mwg_stages: the ring's depth for a batch tile, at most 8 stages within
// 192 KB (the host's matMulWGShared counts the same).
__host__ __device__ constexpr int mwg_stages(int bn) {
	return 196608 / (MWG_ROWS * 128 + bn * 128) < 8 ? 196608 / (MWG_ROWS * 128 + bn * 128) : 8;
}

// wgmma_bf16 adds m64nBNk16 into d (BN / 2 fp32 a thread). Inline asm
// names each accumulator register, so every BN has its own operand list:
// the specialisations below differ only in their length.
template <int BN> __device__ __forceinline__ void wgmma_bf16(float *d, unsigned long long a, unsigned long long b);
#ifdef MWG_ON
// WGMMA_D8(i) is accumulators d[i] to d[i + 7] as read-write asm operands.
#define WGMMA_D8(i)                                                                                    \
	"+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
	    "+f"(d[i + 6]), "+f"(d[i + 7])
template <> __device__ __forceinline__ void wgmma_bf16<32>(float *d, unsigned long long a, unsigned long long b) {
	asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
	             "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
	             "}, %16, %17, 1, 1, 1, 0, 0;"
	             : WGMMA_D8(0), WGMMA_D8(8)
	             : "l"(a), "l"(b));
}
template <> __device__ __forceinline__ void wgmma_bf16<48>(float *d, unsigned long long a, unsigned long long b) {
	asm volatile("wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {"
	             "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
	             "%16, %17, %18, %19, %20, %21, %22, %23"
	             "}, %24, %25, 1, 1, 1, 0, 0;"
	             : WGMMA_D8(0), WGMMA_D8(8), WGMMA_D8(16)
	             : "l"(a), "l"(b));
}
template <> __device__ __forceinline__ void wgmma_bf16<64>(float *d, unsigned long long a, unsigned long long b) {
	asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
	             "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
	             "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
	             "}, %32, %33, 1, 1, 1, 0, 0;"
	             : WGMMA_D8(0), WGMMA_D8(8), WGMMA_D8(16), WGMMA_D8(24)
	             : "l"(a), "l"(b));
}
template <> __device__ __forceinline__ void wgmma_bf16<96>(float *d, unsigned long long a, unsigned long long b) {
	asm volatile("wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {"
	             "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
	             "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
	             "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
	             "}, %48, %49, 1, 1, 1, 0, 0;"
	             : WGMMA_D8(0), WGMMA_D8(8), WGMMA_D8(16), WGMMA_D8(24), WGMMA_D8(32), WGMMA_D8(40)
	             : "l"(a), "l"(b));
}
template <> __device__ __forceinline__ void wgmma_bf16<128>(float *d, unsigned long long a, unsigned long long b) {
	asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
	             "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
	             "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
	             "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
	             "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
	             "}, %64, %65, 1, 1, 1, 0, 0;"
	             : WGMMA_D8(0), WGMMA_D8(8), WGMMA_D8(16), WGMMA_D8(24), WGMMA_D8(32), WGMMA_D8(40), WGMMA_D8(48),
	               WGMMA_D8(56)
	             : "l"(a), "l"(b));
}
template <> __device__ __forceinline__ void wgmma_bf16<192>(float *d, unsigned long long a, unsigned long long b) {
	asm volatile("wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
	             "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
	             "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
	             "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
	             "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
	             "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
	             "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
	             "}, %96, %97, 1, 1, 1, 0, 0;"
	             : WGMMA_D8(0), WGMMA_D8(8), WGMMA_D8(16), WGMMA_D8(24), WGMMA_D8(32), WGMMA_D8(40), WGMMA_D8(48),
	               WGMMA_D8(56), WGMMA_D8(64), WGMMA_D8(72), WGMMA_D8(80), WGMMA_D8(88)
	             : "l"(a), "l"(b));
}
template <> __device__ __forceinline__ void wgmma_bf16<256>(float *d, unsigned long long a, unsigned long long b) {
	asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
	             "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
	             "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
	             "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
	             "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
	             "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
	             "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
	             "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
	             "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
	             "}, %128, %129, 1, 1, 1, 0, 0;"
	             : WGMMA_D8(0), WGMMA_D8(8), WGMMA_D8(16), WGMMA_D8(24), WGMMA_D8(32), WGMMA_D8(40), WGMMA_D8(48),
	               WGMMA_D8(56), WGMMA_D8(64), WGMMA_D8(72), WGMMA_D8(80), WGMMA_D8(88), WGMMA_D8(96), WGMMA_D8(104),
	               WGMMA_D8(112), WGMMA_D8(120)
	             : "l"(a), "l"(b));
}
#undef WGMMA_D8
#endif

// wg_desc describes a K-major operand at addr (1024-byte aligned tile, or
// that plus 32 bytes per 16 of k): 128-byte swizzle, 8-row groups 1024
// bytes apart.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
	return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
	       (1ull << 62);
}

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
	asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
	asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
	asm volatile("{\n.reg .pred p;\nWAIT:\n"
	             "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
	             "@!p bra WAIT;\n}" ::"r"(bar),
	             "r"(parity)
	             : "memory");
}
// bulk_load copies bytes (a multiple of 16) from global src to shared dst,
// completing on bar's transaction count.
__device__ __forceinline__ void bulk_load(unsigned dst, const void *src, unsigned bytes, unsigned bar) {
	asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
	             "l"(src), "r"(bytes), "r"(bar)
	             : "memory");
}
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaDesc *map, unsigned bar, int c0, int c1) {
	asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
	             "[%4];" ::"r"(dst),
	             "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
	             : "memory");
}
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaDesc *map, unsigned bar, int c0, int c1, int c2,
                                            int c3) {
	asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
	             "%4, %5}], [%6];" ::"r"(dst),
	             "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
	             : "memory");
}

__device__ __forceinline__ void cluster_sync() {
	asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// cluster_arrive and cluster_wait are cluster_sync in two halves. A block
// may write another block's shared memory only once every block of its
// cluster has started (CUDA's guide): a kernel that writes before its first
// cluster_sync arrives as it starts and waits just before the first such
// write, by which time the wait costs nothing (moe_norm_route and
// moe_add_norm_route: the same step times with and without, H200).
__device__ __forceinline__ void cluster_arrive() {
	asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
	asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

// ld_cluster_f4 reads 16 bytes at a shared address of the cluster's block rank.
__device__ __forceinline__ float4 ld_cluster_f4(unsigned addr, int rank) {
	unsigned remote;
	float4 v;
	asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
	asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
	             : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
	             : "r"(remote)
	             : "memory");
	return v;
}

// st_cluster_f32 writes v at a shared address of the cluster's block rank.
__device__ __forceinline__ void st_cluster_f32(unsigned addr, int rank, float v) {
	unsigned remote;
	asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
	asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}

// st_cluster_u4 writes 16 bytes at a shared address of the cluster's block rank.
__device__ __forceinline__ void st_cluster_u4(unsigned addr, int rank, uint4 v) {
	unsigned remote;
	asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
	asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(remote), "r"(v.x), "r"(v.y), "r"(v.z),
	             "r"(v.w)
	             : "memory");
}

// mwg_normalise turns the x of a round of landed stages (BN rows of 64 k
// each, in the 128-byte swizzle: row r's 16-byte chunk c at r * 128 + 16
// (c ^ (r & 7))) into norm_w * rmsnorm(h), all at once: one barrier a
// round, not a stage. Consumer i of 256 takes chunks i, i + 256, ... of a
// stage: rows i / 8 + 32 u, all with the same logical chunk, so one norm_w
// chunk (nw[stage]).
template <int BN, int S>
__device__ __forceinline__ void mwg_normalise(unsigned x0, unsigned stage_bytes, int stages, const uint4 *nw,
                                              const float *inv) {
#pragma unroll
	for (int j = 0; j < S; j++) {
		if (j >= stages) break;
#pragma unroll
		for (int u = 0; u < (BN * 8 + MWG_CONSUMERS - 1) / MWG_CONSUMERS; u++) {
			const int i = threadIdx.x + u * MWG_CONSUMERS;
			if (i >= BN * 8) break;
			const unsigned a = x0 + j * stage_bytes + 16 * i;
			uint4 h;
			asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(h.x), "=r"(h.y), "=r"(h.z), "=r"(h.w) : "r"(a));
			h = rmsnorm8(h, nw[j], inv[u]);
			asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(h.x), "r"(h.y), "r"(h.z), "r"(h.w)
			             : "memory");
		}
	}
	// wgmma reads through the async proxy, and each warpgroup reads rows
	// that every consumer wrote.
	asm volatile("fence.proxy.async.shared::cta;\nbar.sync 1, %0;" ::"n"(MWG_CONSUMERS) : "memory");
}

// mwg_stage adds a landed stage at st (weights, then x from st + wbytes)
// into warpgroup wg's accumulators and returns once only this stage's
// wgmma is in flight: the stage before it is free.
template <int BN> __device__ __forceinline__ void mwg_stage(float *d, unsigned st, unsigned wbytes, int wg) {
#ifdef MWG_ON
	asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
	for (int kk = 0; kk < MWG_BK / 16; kk++)
		wgmma_bf16<BN>(d, wg_desc(st + wg * 64 * 128 + kk * 32), wg_desc(st + wbytes + kk * 32));
	asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
	asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
#endif
}

// MwgQkv is what the qkv products' epilogues (matmul_wg_part_qkv,
// matmul_wg_few_qkv) need to prepare the projection as prepare_qkv16 would.
struct MwgQkv {
	QkvHeads heads;
	QkvStep step;
};

// MwgQkvUnits are the step inputs of a block's units (token row0 + 32 i +
// tid / 8, head: a consumer's 8 lanes a unit) that mwg_prepare_qkv takes:
// qkv16_finish's rotation and cache slot, and the token (-1: none).
template <int BN> struct MwgQkvUnits {
	static constexpr int PASSES = BN / 32; // 32 units a pass of 256 consumers
	float cs[PASSES][8], sn[PASSES][8];
	long long slot[PASSES];
	int tok[PASSES];

	__device__ __forceinline__ void load(const MwgQkv &p, int row0, int head, int m) {
		const int tid = threadIdx.x, c = tid & 7;
#pragma unroll
		for (int i = 0; i < PASSES; i++) {
			const int r = row0 + i * 32 + (tid >> 3);
			tok[i] = r < m ? r : -1;
			p.step.load(tok[i], head, p.heads.hq, p.heads.hk, MWG_ROWS / 2, c, cs[i], sn[i], slot[i]);
		}
	}
};

// MWG_QKV_EARLY is the largest batch tile whose matmul_wg_part_qkv
// consumers load their units' step inputs before the product rather than
// after it (0, for A/B runs): the 128-row tile's consumers would hold 64
// more registers through the product beside 128 of sums. H100, 0.6B shape,
// flag on, ms a decode step (128 in, 128 out), batch 32 / 64 / 256, early
// 1.410 / 1.678 / 4.024 and 1.446 / 1.671 / 3.992, late 1.435 / 1.679 /
// 4.132 and 1.455 / 1.681 / 4.100 (ptxas: 168 registers, no spill).
#ifndef MWG_QKV_EARLY
#define MWG_QKV_EARLY 64
#endif

// mwg_prepare_qkv is matmul_wg_part_qkv's epilogue. A weight tile is one
// head of MWG_ROWS dims, so a block holds whole (token, head) units: the
// tile goes to shared memory as the bf16 the product would have stored
// (stg: BN rows of 256 bytes, row r's 16-byte chunk c at 16 (c ^ (r & 7)),
// so that neither the fragments' stores nor the units' loads meet in a
// bank), then each 8 consumers take a unit, with the step inputs in u,
// through qkv16_finish, with prepare_qkv16's bits.
template <int BN>
__device__ __forceinline__ void mwg_prepare_qkv(const float *d, unsigned char *stg, int trow, int q, int head, int N,
                                                bf16 *qkv, const MwgQkv &p, const MwgQkvUnits<BN> &u) {
	const int tid = threadIdx.x, c = tid & 7;
	// The last tile's units have read stg.
	asm volatile("bar.sync 1, %0;" ::"n"(MWG_CONSUMERS) : "memory");
#pragma unroll
	for (int j = 0; j < BN / 8; j++)
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const int r = 8 * j + 2 * q + (e & 1), n = trow + 8 * (e >> 1);
			*(bf16 *)(stg + r * 256 + (((n >> 3) ^ (r & 7)) << 4) + 2 * (n & 7)) = f2bf(d[4 * j + e]);
		}
	asm volatile("bar.sync 1, %0;" ::"n"(MWG_CONSUMERS) : "memory");
#pragma unroll
	for (int i = 0; i < u.PASSES; i++) {
		const int r = i * 32 + (tid >> 3);
		const unsigned char *row = stg + r * 256;
		const uint4 xa = *(const uint4 *)(row + ((c ^ (r & 7)) << 4));
		const uint4 xb = *(const uint4 *)(row + (((8 + c) ^ (r & 7)) << 4));
		qkv16_finish(xa, xb, u.cs[i], u.sn[i], u.tok[i], head, u.slot[i], qkv + (long long)u.tok[i] * N, p.heads, c);
	}
}

template <int BN, bool PART, bool PREP>
__device__ void matmul_wg_impl(const TmaDesc *wmap, const TmaDesc *xmap, void *out, int out_f32, int m, int N, int K,
                               int glu, int kps, bf16 *residual, const bf16 *norm_w, float *sq, int nsq, float eps,
                               int kpart, const MwgQkv &qp) {
#ifdef MWG_ON
	constexpr int WBYTES = MWG_ROWS * 128, STAGE = WBYTES + BN * 128, S = mwg_stages(BN);
	constexpr int NU = (BN * 8 + MWG_CONSUMERS - 1) / MWG_CONSUMERS; // x chunks a consumer normalises
	// The add and norm modes are built for tiles of up to 48 rows (the host
	// asks for them there only): at 64-128 rows normalising x cost more in
	// every block (each tile's blocks normalise all of x again) than the
	// kernel boundary it saves, even a stage ahead of the wgmma.
	constexpr bool FOLD = BN <= 48;
	extern __shared__ unsigned char wg_smem[];
	__shared__ __align__(8) unsigned long long bars[2 * 8];
	__shared__ float warp_sq[MWG_CONSUMERS / 32][FOLD ? BN : 1]; // add mode: each warp's 16 columns' squares
	// Batches past BN rows take a batch tile a blockIdx.y (matmul_wg_part:
	// a round of its loop); the fold modes are for one tile.
	if ((!FOLD && (residual || norm_w)) || gridDim.z > MWG_MAX_CLUSTER || (gridDim.y > 1 && (residual || norm_w)) ||
	    (PART && (gridDim.y > 1 || gridDim.z > 1 || residual || norm_w || kpart < 1)) ||
	    (out_f32 == 2 && (PART || residual || norm_w || gridDim.y > 1)))
		__trap();
	const int tid = threadIdx.x, lane = tid & 31;
	const bool consumer = tid < MWG_CONSUMERS;
	const unsigned base = (smem_u32(wg_smem) + 1023) & ~1023u;
	const unsigned full = smem_u32(bars), empty = full + 8 * S; // stage s: + 8 s
	const int split = blockIdx.z, splits = gridDim.z;
	const int kt0 = split * kps, nt = min(kps, K / MWG_BK - kt0);
	// out_f32 == 2 (own sums): a launch without clusters, whose blocks each
	// leave their split's fp32 sums in a plane of their own, out[split][m][N],
	// for add_rmsnorm_parts to add in split order (the cluster's order).
	const bool own = out_f32 == 2 && splits > 1;
	if (own) out = (float *)out + (long long)split * m * N;
	// matmul_wg_part's blocks are persistent: block b takes tiles b, b +
	// gridDim.x, ... (in MWG_PART_BATCH_FASTEST's order), so that while
	// its consumers write one tile the producer fills the ring with the
	// next one's first stages, and a block's start-up is paid once, not
	// once a tile (a prefill's tiles run 16-48 k-steps).
	const int wtiles = (N + MWG_ROWS - 1) / MWG_ROWS, btiles = (m + BN - 1) / BN, ntiles = PART ? wtiles * btiles : 1;
	auto part_wtile = [&](int ti) { return MWG_PART_BATCH_FASTEST ? ti / btiles : ti % wtiles; };
	auto part_btile = [&](int ti) { return MWG_PART_BATCH_FASTEST ? ti % btiles : ti / wtiles; };
	int ring = 0; // stages this block has passed through the ring before this tile
	if (tid == MWG_CONSUMERS) {
		for (int s = 0; s < S; s++) {
			mbar_init(full + 8 * s, 1);
			mbar_init(empty + 8 * s, MWG_CONSUMERS);
		}
		asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
	}
	__syncthreads();

	if (!consumer) {
		// The producer: one thread issues the copies, tile by tile as the
		// consumers' loop below takes them. With MWG_REGS it is a warpgroup
		// that gives back all but 40 registers a thread, so that the
		// consumers may have 232.
#if MWG_REGS
		asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
#endif
		const bool issue = tid == MWG_CONSUMERS;
		// The tiles of the consumers' loop below, in its order.
		for (int ti = blockIdx.x, once = 1; PART ? ti < ntiles : once; ti += gridDim.x, ring += nt, once = 0) {
			const int tile = PART ? part_wtile(ti) : blockIdx.x;
			const int row0 = (PART ? part_btile(ti) : blockIdx.y) * BN;
			// The first tile's first stages: weights before the wait for the
			// previous kernel, which never writes them.
			const int pre = ring == 0 ? min(nt, S) : 0;
			if (issue && pre) {
				asm volatile("prefetch.tensormap [%0];" ::"l"((unsigned long long)xmap) : "memory");
				for (int t = 0; t < pre; t++) {
					mbar_expect_tx(full + 8 * t, STAGE);
					tma_load_4d(base + t * STAGE, wmap, full + 8 * t, (kt0 + t) * MWG_BK, 0, 0, tile * 8);
				}
			}
			if (ring == 0) DEP();
			if (issue) {
				for (int t = 0; t < pre; t++)
					tma_load_2d(base + t * STAGE + WBYTES, xmap, full + 8 * t, (kt0 + t) * MWG_BK, row0);
				for (int t = pre; t < nt; t++) {
					const int u = ring + t, s = u % S;
					if (u >= S) mbar_wait(empty + 8 * s, (u / S - 1) & 1);
					mbar_expect_tx(full + 8 * s, STAGE);
					tma_load_4d(base + s * STAGE, wmap, full + 8 * s, (kt0 + t) * MWG_BK, 0, 0, tile * 8);
					tma_load_2d(base + s * STAGE + WBYTES, xmap, full + 8 * s, (kt0 + t) * MWG_BK, row0);
				}
			}
		}
		if (splits > 1 && !own) {
			// The consumers' barriers around the split sums below.
			__syncthreads();
			cluster_sync();
			cluster_sync();
		}
		return;
	}
#if MWG_REGS
	asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
#endif

	// Outside matmul_wg_part the loop runs once, as the compiler can see
	// (once): a loop it could not see through cost matmul_wg_n256 424
	// bytes of spill (ptxas 13 allots 168 registers a thread, the block
	// counted as three warpgroups).
	for (int ti = blockIdx.x, once = 1; PART ? ti < ntiles : once; ti += gridDim.x, ring += nt, once = 0) {
		const int tile = PART ? part_wtile(ti) : blockIdx.x;
		const int row0 = (PART ? part_btile(ti) : blockIdx.y) * BN;
		// d[4 j + e]: tile row 64 wg + 16 warp + g + 8 (e >> 1), batch row
		// 8 j + 2 q + (e & 1).
		const int g = lane >> 2, q = lane & 3, trow = (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + g;
		float hpre[2][4]; // add mode: see below
		float d[BN / 2];
		float run[PART ? BN / 2 : 1]; // PART: the sum of the splits before this one
#pragma unroll
		for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
		if (PART)
#pragma unroll
			for (int i = 0; i < BN / 2; i++) run[i] = 0.f;
		MwgQkvUnits<PREP ? BN : 32> units;
		{
			if (ring == 0) DEP();
			if constexpr (PREP && BN <= MWG_QKV_EARLY) units.load(qp, row0, tile, m);
			// add mode: the residual of this block's first two groups of 8
			// batch rows is requested now, so that the epilogue finds it.
			if (FOLD && residual) {
#pragma unroll
				for (int c = 0; c < 2; c++) {
					const int j = split + c * splits;
#pragma unroll
					for (int e = 0; e < 4; e++) {
						const int r = 8 * j + 2 * q + (e & 1);
						const long long n = (long long)MWG_ROWS * tile + trow + 8 * (e >> 1);
						hpre[c][e] = j < BN / 8 && r < m && n < N ? bf2f(__ldcg(residual + r * (long long)N + n)) : 0.f;
					}
				}
			}
			float inv[NU];
			if (FOLD && norm_w) {
				__shared__ float inv_s[FOLD ? BN : 1];
				row_scales<4>(inv_s, sq, nsq, m, K, eps); // m <= 48: 4 consumers a row
				asm volatile("bar.sync 1, %0;" ::"n"(MWG_CONSUMERS) : "memory");
#pragma unroll
				for (int u = 0; u < NU; u++) inv[u] = (tid >> 3) + 32 * u < m ? inv_s[(tid >> 3) + 32 * u] : 0.f;
			}
			const int wg = tid >> 7;
			const int chunk = (tid & 7) ^ ((tid >> 3) & 7);
			const uint4 *nwp = (const uint4 *)norm_w + kt0 * (MWG_BK / 8) + chunk;
			for (int t = 0; t < nt; t++) {
				const int u = ring + t, s = u % S; // u == t but in matmul_wg_part's later tiles
				if (FOLD && norm_w && s == 0) {
					// A round of the ring: its stages' x is normalised together.
					const int stages = min(S, nt - t);
					uint4 nw[S];
#pragma unroll
					for (int j = 0; j < S; j++)
						if (j < stages) nw[j] = __ldg(nwp + (t + j) * (MWG_BK / 8));
					if (t > 0) {
						// The round's last stage is refilled only once the
						// last round's is free.
						asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
						mbar_arrive(empty + 8 * (S - 1));
					}
					for (int j = 0; j < stages; j++) mbar_wait(full + 8 * j, (t / S) & 1);
					mwg_normalise<BN, S>(base + WBYTES, STAGE, stages, nw, inv);
				}
				mbar_wait(full + 8 * s, (u / S) & 1);
				mwg_stage<BN>(d, base + s * STAGE, WBYTES, wg);
				if (t > 0 && !(FOLD && norm_w && s == 0)) mbar_arrive(empty + 8 * ((u - 1) % S));
				if (PART && (t + 1) % kpart == 0 && t + 1 < nt) {
					// A split ends: its sums join the running sum, and the next
					// split's start from zero, as a cluster block's do.
					asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
					for (int i = 0; i < BN / 2; i++) {
						asm volatile("" : "+f"(d[i])::"memory");
						run[i] += d[i];
						d[i] = 0.f;
					}
				}
			}
			asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
			for (int i = 0; i < BN / 2; i++) asm volatile("" : "+f"(d[i])::"memory");
			if (PART) mbar_arrive(empty + 8 * ((ring + nt - 1) % S)); // the next tile may refill it
			if (PART && kpart < nt)
#pragma unroll
				for (int i = 0; i < BN / 2; i++) d[i] = run[i] + d[i];
		}

		if constexpr (PREP) {
			if (BN > MWG_QKV_EARLY) units.load(qp, row0, tile, m);
			mwg_prepare_qkv<BN>(d, wg_smem + (base - smem_u32(wg_smem)) + S * STAGE, trow, q, tile, N, (bf16 *)out, qp,
			                    units);
			continue;
		}
		const long long half = N / 2;
		const int warp = tid >> 5;
		// add adds fragment j to the residual and leaves each warp's sums of
		// squares of its rows in warp_sq.
		auto add = [&](int j, const float f[4]) {
			bf16 *h[4];
			float hv[4], sqv[2] = {0.f, 0.f}; // rows 8 j + 2 q and the next
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int r = 8 * j + 2 * q + (e & 1);
				const long long n = (long long)MWG_ROWS * tile + trow + 8 * (e >> 1);
				h[e] = r < m && n < N ? residual + r * (long long)N + n : nullptr;
				const int c = (j - split) / splits;
				hv[e] = !h[e] ? 0.f : c == 0 ? hpre[0][e] : c == 1 ? hpre[1][e] : bf2f(__ldcg(h[e]));
			}
#pragma unroll
			for (int e = 0; e < 4; e++) {
				if (!h[e]) continue;
				hv[e] = rbf(hv[e] + rbf(f[e]));
				*h[e] = f2bf(hv[e]);
				sqv[e & 1] += hv[e] * hv[e];
			}
			// The warp's 16 columns: lanes of one q hold rows 8 j + 2 q (+1).
#pragma unroll
			for (int o = 4; o < 32; o <<= 1) {
				sqv[0] += __shfl_xor_sync(0xffffffffu, sqv[0], o);
				sqv[1] += __shfl_xor_sync(0xffffffffu, sqv[1], o);
			}
			if (g == 0) warp_sq[warp][8 * j + 2 * q] = sqv[0], warp_sq[warp][8 * j + 2 * q + 1] = sqv[1];
		};
		auto store = [&](int j, float4 v) {
			const float f[4] = {v.x, v.y, v.z, v.w};
			if (FOLD && residual) {
				add(j, f);
				return;
			}
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const long long r = row0 + 8 * j + 2 * q + (e & 1);
				if (r >= m) continue;
				if (glu) {
					const long long col = 64LL * tile + 8 * (trow >> 4) + g;
					if (e < 2 && col < half) ((bf16 *)out)[r * half + col] = silu_mul1(rbf(f[e]), rbf(f[e + 2]));
					continue;
				}
				const long long n = (long long)MWG_ROWS * tile + trow + 8 * (e >> 1);
				if (n >= N) continue;
				if (out_f32) ((float *)out)[r * N + n] = f[e];
				else ((bf16 *)out)[r * N + n] = f2bf(f[e]);
			}
		};
		// squares adds the warps' sums of the rows this block stored, in warp
		// order, so the bits do not depend on timing.
		auto squares = [&]() {
			if (!FOLD || !residual) return;
			asm volatile("bar.sync 1, %0;" ::"n"(MWG_CONSUMERS) : "memory");
			const int r = tid;
			if (r >= BN || r >= m || (r / 8) % splits != split) return;
			float s = 0.f;
#pragma unroll
			for (int w = 0; w < MWG_CONSUMERS / 32; w++) s += warp_sq[w][r];
			sq[(long long)r * gridDim.x + tile] = s;
		};
		if (own) {
			// The block's split sums, coalesced: the ring is free once every
			// stage has been read, and takes the tile as rows of 128 floats
			// (16-byte chunks swizzled by the row, so that neither the
			// fragments' stores nor the rows' loads meet a bank twice); then
			// a warp writes a row's 512 bytes at once. Stored as the
			// fragments lie, a block's 4-byte stores to four rows at a time
			// made a batch-256 step 0.5 ms slower (H200).
			asm volatile("bar.sync 1, %0;" ::"n"(MWG_CONSUMERS) : "memory");
			float *sums = (float *)(wg_smem + (base - smem_u32(wg_smem)));
#pragma unroll
			for (int j = 0; j < BN / 8; j++)
#pragma unroll
				for (int e = 0; e < 4; e++) {
					const int r = 8 * j + 2 * q + (e & 1), col = trow + 8 * (e >> 1);
					sums[r * MWG_ROWS + (col ^ (((r >> 1) & 3) << 3))] = d[4 * j + e];
				}
			asm volatile("bar.sync 1, %0;" ::"n"(MWG_CONSUMERS) : "memory");
			const long long n = (long long)MWG_ROWS * tile + 4 * lane;
			for (int r = tid >> 5; r < BN && row0 + r < m; r += MWG_CONSUMERS / 32)
				if (n < N)
					*(float4 *)((float *)out + (row0 + r) * (long long)N + n) =
					    *(const float4 *)&sums[r * MWG_ROWS + ((4 * lane) ^ (((r >> 1) & 3) << 3))];
			continue;
		}
		if (splits == 1) {
			if (consumer) {
#pragma unroll
				for (int j = 0; j < BN / 8; j++) store(j, make_float4(d[4 * j], d[4 * j + 1], d[4 * j + 2], d[4 * j + 3]));
				squares();
			}
			continue; // matmul_wg_part's next tile; elsewhere the loop ends
		}
		__syncthreads(); // every stage has been read: the ring takes the sums
		const unsigned acc = base + tid * 16;
		if (consumer) {
#pragma unroll
			for (int j = 0; j < BN / 8; j++)
				asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(acc + j * MWG_CONSUMERS * 16), "f"(d[4 * j]),
				             "f"(d[4 * j + 1]), "f"(d[4 * j + 2]), "f"(d[4 * j + 3])
				             : "memory");
		}
		cluster_sync();
		if (consumer) {
			for (int j = split; j < BN / 8; j += splits) {
				// Every rank's fragment is requested before any is added: a
				// remote load's latency once, not once a rank.
				float4 p[MWG_MAX_CLUSTER];
#pragma unroll
				for (int rank = 0; rank < MWG_MAX_CLUSTER; rank++)
					if (rank < splits) p[rank] = ld_cluster_f4(acc + j * MWG_CONSUMERS * 16, rank);
				float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
				for (int rank = 0; rank < MWG_MAX_CLUSTER; rank++)
					if (rank < splits) v.x += p[rank].x, v.y += p[rank].y, v.z += p[rank].z, v.w += p[rank].w;
				store(j, v);
			}
			squares();
		}
		cluster_sync(); // no block leaves while another reads its shared memory
	}
#else
	__trap(); // the host runs matmul_wg only from an sm_90a build
#endif
}

#define MATMUL_WG(NAME, BN, PART)                                                                                     \
	extern "C" __global__ void __launch_bounds__(MWG_BLOCK, 1)                                                         \
	    NAME(const MWG_GRID_CONST TmaDesc wmap, const MWG_GRID_CONST TmaDesc xmap, void *out, int out_f32, int m,     \
	         int N, int K, int glu, int kps, bf16 *residual, const bf16 *norm_w, float *sq, int nsq, float eps,        \
	         int kpart) {                                                                                              \
		matmul_wg_impl<BN, PART, false>(&wmap, &xmap, out, out_f32, m, N, K, glu, kps, residual, norm_w, sq, nsq, eps, \
		                                kpart, MwgQkv{});                                                            \
	}
MATMUL_WG(matmul_wg_n32, 32, false)
MATMUL_WG(matmul_wg_n48, 48, false)
MATMUL_WG(matmul_wg_n64, 64, false)
MATMUL_WG(matmul_wg_n96, 96, false)
MATMUL_WG(matmul_wg_n128, 128, false)
MATMUL_WG(matmul_wg_n192, 192, false)
MATMUL_WG(matmul_wg_n256, 256, false)
MATMUL_WG(matmul_wg_part_n64, 64, true)
MATMUL_WG(matmul_wg_part_n128, 128, true)

// matmul_wg_part_qkv is matmul_wg_part for the qkv projection of heads of
// MWG_ROWS dims, which it prepares in its epilogue (mwg_prepare_qkv) in
// place of prepare_qkv16: q back into out, k and v into the caches.
// Deterministic inference; the host checks the shapes.
#define MATMUL_WG_QKV(NAME, BN)                                                                                         \
	extern "C" __global__ void __launch_bounds__(MWG_BLOCK, 1)                                                         \
	    NAME(const MWG_GRID_CONST TmaDesc wmap, const MWG_GRID_CONST TmaDesc xmap, bf16 *out, int m, int N, int K,    \
	         int kps, int kpart, const bf16 *qnorm, const bf16 *knorm, int has_norm, float eps, bf16 *kc, bf16 *vc,    \
	         int hq, int hk, const int *pos, const int *slots, const float *cos_t, const float *sin_t) {               \
		matmul_wg_impl<BN, true, true>(                                                                               \
		    &wmap, &xmap, out, 0, m, N, K, 0, kps, nullptr, nullptr, nullptr, 0, 0.f, kpart,                          \
		    MwgQkv{QkvHeads{qnorm, knorm, kc, vc, hq, hk, MWG_ROWS, eps, has_norm}, QkvStep{pos, slots, cos_t, sin_t}}); \
	}
MATMUL_WG_QKV(matmul_wg_part_qkv_n64, 64)
MATMUL_WG_QKV(matmul_wg_part_qkv_n128, 128)
