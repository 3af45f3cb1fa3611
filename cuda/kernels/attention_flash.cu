// Attention on the tensor cores: prefill (attn_prefill_mma) and every step
// of deterministic inference (attn_det). It uses attention_fast.cu's
// LOG2E and ex2_ftz; attention_gqa.cu uses its mma_bf16.

// attn_prefill_mma: FlashAttention-2 style. Block (query tile of FA_BM
// rows, query head, sequence), four warps of 16 query rows. K and V come
// through shared memory in tiles of FA_BN keys (gathered from the paged
// cache with cp.async, one buffer: 48 KB a block, and registers capped by
// the launch bounds, give three blocks an SM, which hide each other's
// loads better than two double-buffered ones); S = Q K^T and O += P V run as
// mma.sync m16n8k16 (bf16 in, fp32 accumulate); softmax is online in
// registers, base 2. Shared rows are D bf16 with their 16-byte chunks
// swizzled (chunk ^ row % 8), so ldmatrix reads without bank conflicts.
// With raw_q the queries come as projected and each warp normalises and
// rotates its own rows in shared memory (qk_norm_rope, as prepare_qkv
// would have): a prompt's q heads are then read once instead of read,
// written back and read again.
#define FA_BM 64
#define FA_BN 64

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], unsigned addr) {
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
	             : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
	             : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], unsigned addr) {
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
	             : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
	             : "r"(addr));
}

// mma_bf16: c += a (16x16, row) * b (16x8, col), fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
	             "{%0, %1, %2, %3};\n"
	             : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
	             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// swz is the byte offset of element (row, col) in a swizzled tile of rows
// of D bf16.
template <int D>
__device__ __forceinline__ unsigned swz(int row, int col) {
	return row * (D * 2) + ((((col >> 3) ^ (row & 7))) << 4) + ((col & 7) << 1);
}

// Deterministic inference (DET) cuts every query's keys into splits of
// DET_SPLIT positions from position 0, computes each split as a fresh
// softmax, and merges the splits in order with det_merge: a query's bits
// then depend on its position and the keys alone. Prefill blocks (workers
// 0) run their splits one after another and merge in registers; decode
// blocks (workers W > 0, one query a sequence) share a sequence's splits
// among W blocks, which leave them in part_o/part_ml, and the last block to
// finish merges them with the same operations in the same order.
#define DET_SPLIT 128
struct DetArgs {
	int workers;
	float *part_o, *part_ml;
	int *counters;
	int part_rows;   // rows of D floats part_o holds
	int lone_splits; // a decode of at most this many splits is one block's
};

// det_merge folds a split (max m, sum l, in base 2) into a running
// (M, L), giving the factors a and b for the outputs: O = O a + o b.
// Every operation is spelled out so that no contraction can differ
// between the two places that merge.
__device__ __forceinline__ void det_merge(float &M, float &L, float m, float l, float &a, float &b) {
	const float mn = fmaxf(M, m);
	a = ex2_ftz(__fsub_rn(M, mn));
	b = ex2_ftz(__fsub_rn(m, mn));
	L = __fmaf_rn(L, a, __fmul_rn(l, b));
	M = mn;
}
__device__ __forceinline__ float det_acc(float O, float a, float o, float b) { return __fmaf_rn(O, a, __fmul_rn(o, b)); }
__device__ __forceinline__ float det_out(float O, float L) { return __fmul_rn(O, __frcp_rn(L)); }

// DMODE (DET only) builds one of attn_det's two kernels: DET_PREFILL for
// query tiles (workers 0), DET_DECODE for heads mode. Apart, a decode block
// holds only its warp's quarter of the output columns in registers, not a
// prefill warp's D / 8 fragments of two sets of sums, and more blocks fit
// an SM (decode is bound by its blocks' latency).
#define DET_PREFILL 1
#define DET_DECODE 2
template <int D, bool DET = false, int DMODE = 0>
__device__ __forceinline__ void attn_prefill_mma_impl(bf16 *out, const bf16 *qkv, const bf16 *kc, const bf16 *vc,
                                                      const int *qptr, const int *kvptr, const int *kvidx, int hq,
                                                      int hk, float scale, const bf16 *qnorm, const float *cos_t,
                                                      const float *sin_t, float eps, int raw_q, DetArgs da = {}) {
	extern __shared__ __align__(16) unsigned char fa_smem[];
	constexpr int CH = D / 8; // 16-byte chunks per row
	// DET decode (heads mode, hm): blockIdx.x is the worker, blockIdx.y the
	// kv head, and the tile's rows are its G query heads of the one query,
	// so only 16 query rows are kept (detShared): more blocks fit an SM.
	const bool hm = DET && DMODE == DET_DECODE;
	// A decode block waits for the kernel before it (dep_wait) only once it
	// has requested its first K/V tile, all but the newest row, which that
	// kernel writes; other blocks wait at once. A block that leaves early
	// waits first, so that the waits still chain.
	if (DET && !hm) DEP();
	const int qrows = hm ? 16 : FA_BM;
	unsigned char *qs = fa_smem;
	unsigned char *ks = qs + qrows * D * 2; // [FA_BN][D]
	unsigned char *vs = ks + FA_BN * D * 2;
	const int s = blockIdx.z, G = hq / hk, g = hm ? blockIdx.y : blockIdx.y / G, h = hm ? g * G : blockIdx.y;
	const int qbase = qptr[s], qlen = qptr[s + 1] - qbase;
	int workers = hm ? da.workers : 0;
	const int q0 = hm ? 0 : blockIdx.x * FA_BM;
	if (q0 >= qlen || (hm && qlen != 1)) {
		if (hm) DEP();
		return;
	}
	const int kv0 = kvptr[s], kvlen = kvptr[s + 1] - kv0;
	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
	const long long stride = (long long)(hq + 2 * hk) * D;
	// Keys this tile of queries needs: up to the last query's position.
	const int last_q = kvlen - qlen + min(q0 + FA_BM, qlen) - 1;
	const int kend = min(kvlen, last_q + 1);
	const int ntiles = (kend + FA_BN - 1) / FA_BN;
	// DET: the splits, this block's first and its stride over them, and
	// the tiles it takes (nit) in that order.
	constexpr int TPS = DET_SPLIT / FA_BN;
	const int nsp = (kend + DET_SPLIT - 1) / DET_SPLIT;
	const int poff = s + kv0 / DET_SPLIT; // the sequence's first partial row (over hq)
	if (hm && (long long)(poff + nsp) * hq > da.part_rows) {
		// Partials that do not fit: the first worker takes every split.
		if (blockIdx.x != 0) {
			DEP();
			return;
		}
		workers = 0;
	}
	// A short decode is the first worker's alone: a few more tiles in turn
	// cost less than the partials' round trip and the merge.
	if (hm && workers > 1 && nsp <= da.lone_splits) {
		if (blockIdx.x != 0) {
			DEP();
			return;
		}
		workers = 0;
	}
	// A lone worker merges its splits in registers, as a prefill does, with
	// the same operations: no partials, fence or counter.
	if (workers == 1) workers = 0;
	const int w = workers > 0 ? blockIdx.x : 0, wstride = workers > 0 ? workers : 1;
	const int mysplits = w < nsp ? (nsp - 1 - w) / wstride + 1 : 0;
	const int nit = !DET ? ntiles : workers > 0 ? mysplits * TPS : ntiles;
	auto tile_of = [&](int it) { return !DET || workers == 0 ? it : (w + (it / TPS) * wstride) * TPS + it % TPS; };

	auto load_q = [&]() {
		for (int i = tid; i < qrows * CH; i += blockDim.x) {
			const int r = i / CH, ch = i % CH;
			const bool valid = hm ? r < G : q0 + r < qlen;
			const bf16 *src = hm ? qkv + (long long)qbase * stride + (long long)(h + (valid ? r : 0)) * D + ch * 8
			                     : qkv + (long long)(qbase + (valid ? q0 + r : 0)) * stride + (long long)h * D + ch * 8;
			cp_async16(smem_u32(qs + swz<D>(r, ch * 8)), src, valid);
		}
		cp_async_commit();
	};
	if (!hm) load_q();
	// A tile's KV slots: thread t copies rows t / CH + j * (128 / CH), so a
	// warp's rows are RW consecutive ones per step of 128 / CH; lane l < 16
	// reads the slot of the warp's l-th row once and the copies take it by
	// shuffle. A tile's slots are read while the tile before is computed,
	// so a copy does not wait on its address.
	constexpr int RW = 32 / CH, STEPS = FA_BN * CH / 128;
	static_assert(RW * STEPS <= 32, "a warp's rows of a tile fit its lanes");
	static_assert((128 / CH) % 8 == 0, "a thread's rows share their swizzle");
	// A lane holds its row's cache row (slot * hk), one wide multiply from
	// the copy's address; rows past kend hold row 0, which is not loaded.
	auto fetch_slot = [&](int tile) {
		const int r = tile * FA_BN + lane % RW + warp * RW + (128 / CH) * (lane / RW);
		return lane < RW * STEPS && r < kend ? (int)((unsigned)kvidx[kv0 + r] * (unsigned)hk) : 0;
	};
	// A thread's copies are of one chunk in rows crow + j * 128 / CH, whose
	// swizzle is the same, so each lands at a fixed offset from the first.
	const int crow = tid / CH, cch = tid % CH;
	const unsigned kdst = smem_u32(ks + swz<D>(crow, cch * 8)), vdst = kdst + (unsigned)(vs - ks);
	const char *ksrc = (const char *)(kc + g * D + cch * 8), *vsrc = (const char *)(vc + g * D + cch * 8);
	// load_kv copies a tile's rows, leaving out position skip (not even
	// zeroed: load_newest copies it).
	auto load_kv = [&](int tile, int slot, int skip) {
		const int k0 = tile * FA_BN;
#pragma unroll
		for (int j = 0; j < STEPS; j++) {
			const unsigned sl = (unsigned)__shfl_sync(0xffffffff, slot, lane / CH + RW * j);
			const int pos = k0 + crow + j * (128 / CH);
			const unsigned at = j * (128 / CH) * D * 2;
			if (pos == skip) continue;
			cp_async16(kdst + at, ksrc + (size_t)sl * (D * 2), pos < kend);
			cp_async16(vdst + at, vsrc + (size_t)sl * (D * 2), pos < kend);
		}
		cp_async_commit();
	};
	// load_newest copies the newest position's row where it falls in tile.
	auto load_newest = [&](int tile) {
		const int r = kvlen - 1 - tile * FA_BN;
		if (tile >= 0 && r >= 0 && r < FA_BN && r % (128 / CH) == crow) {
			const unsigned sl = (unsigned)kvidx[kv0 + kvlen - 1] * (unsigned)hk;
			const unsigned at = r / (128 / CH) * (128 / CH) * D * 2;
			cp_async16(kdst + at, ksrc + (size_t)sl * (D * 2), true);
			cp_async16(vdst + at, vsrc + (size_t)sl * (D * 2), true);
		}
		cp_async_commit();
	};
	int slot = fetch_slot(tile_of(0));
	if (nit > 0) load_kv(tile_of(0), slot, hm ? kvlen - 1 : -1);
	if (hm) {
		DEP();
		load_q();
		load_newest(nit > 0 ? tile_of(0) : -1);
		cp_async_wait<0>(); // the waits below then find nothing in flight
	}
	const int w0 = warp * 16;
	// With raw_q each warp prepares its own 16 rows in the 16-byte layout
	// of prepare_qkv16 (LG = D / 16 lanes a row), RPP rows a pass. A query is at position
	// kvlen - qlen + its row, as the causal mask below takes it; rows past
	// qlen are zeros and stay zeros.
	constexpr int LG = D / 16, RPP = 32 / LG, PASSES = 16 / RPP, half = D / 2;
	const int c = lane % LG;
	// The rotary row of a query's position, prefetched into L1 while the
	// tiles arrive (held in registers it made the kernel spill).
	auto rope_at = [&](int ps) {
		const int r = w0 + ps * RPP + lane / LG;
		return (kvlen - qlen + q0 + min(r, qlen - q0 - 1)) * (long long)half + 8 * c;
	};
	if (raw_q) {
#pragma unroll
		for (int ps = 0; ps < PASSES; ps++) {
			prefetch_l1(cos_t + rope_at(ps));
			prefetch_l1(sin_t + rope_at(ps));
		}
	}
	cp_async_wait<1>(); // the queries, while the first K/V tile loads
	__syncthreads();
	if (raw_q) {
		uint4 wa = make_uint4(0, 0, 0, 0), wb = wa;
		if (qnorm) {
			wa = *(const uint4 *)(qnorm + 8 * c);
			wb = *(const uint4 *)(qnorm + half + 8 * c);
		}
#pragma unroll
		for (int ps = 0; ps < PASSES; ps++) {
			const int r = w0 + ps * RPP + lane / LG;
			uint4 *pa = (uint4 *)(qs + swz<D>(r, 8 * c)), *pb = (uint4 *)(qs + swz<D>(r, half + 8 * c));
			uint4 a = *pa, b = *pb;
			float inv = 0.f;
			if (qnorm) {
				float af[8], bf[8];
				unpack8(a, af);
				unpack8(b, bf);
				inv = head_inv(af, bf, LG, D, eps);
			}
			float cs[8], sn[8];
			load8f(cos_t + rope_at(ps), cs);
			load8f(sin_t + rope_at(ps), sn);
			norm_rope8(a, b, qnorm != nullptr, wa, wb, inv, cs, sn);
			*pa = a;
			*pb = b;
		}
		__syncwarp();
	}
	unsigned qf[D / 16][4];
	// In heads mode only warp 0 has queries; the others read its rows
	// rather than past the 16 kept.
	const int wq = hm ? 0 : w0;
#pragma unroll
	for (int kk = 0; kk < D / 16; kk++)
		ldmatrix_x4(qf[kk], smem_u32(qs + swz<D>(wq + (lane & 7) + 8 * ((lane >> 3) & 1), kk * 16 + 8 * (lane >> 4))));
	cp_async_wait<0>();
	__syncthreads();

	float o[D / 8][4];
#pragma unroll
	for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
	float mrow[2] = {-EBB_INF, -EBB_INF}, lrow[2] = {0.f, 0.f};
	const float sl2 = scale * LOG2E;
	const int gi = lane >> 2, ti = lane & 3;
	// Absolute positions of this thread's two query rows.
	// (In heads mode every row is the one query, at kvlen - 1.)
	const int qpos0 = hm ? kvlen - 1 : kvlen - qlen + q0 + w0 + gi, qpos1 = hm ? qpos0 : qpos0 + 8;
	// The warp's first and last query positions; a warp past qlen has
	// nothing to do (heads mode shares its tiles: hm_tile).
	const int wfirst = kvlen - qlen + q0 + w0;
	const int wlast = q0 + w0 < qlen ? wfirst + 15 : -1;
	// DET: whether tile row r is a query, and where its output goes.
	auto row_ok = [&](int r) { return hm ? r < G : q0 + r < qlen; };
	auto row_out = [&](int r) {
		return out + (hm ? (long long)qbase * hq + h + r : (long long)(qbase + q0 + r) * hq + h) * D;
	};
	// DET: the merged splits (sequential mode), per row of the thread.
	float Mrun[2] = {-EBB_INF, -EBB_INF}, Lrun[2] = {0.f, 0.f};
	float orun[DET ? D / 8 : 1][4];
	if constexpr (DET) {
#pragma unroll
		for (int n = 0; n < D / 8; n++) orun[n][0] = orun[n][1] = orun[n][2] = orun[n][3] = 0.f;
	}
	// row_sums: each row's sum of the split, its quad's four lanes added.
	auto row_sums = [&](float ls[2]) {
#pragma unroll
		for (int i = 0; i < 2; i++) {
			ls[i] = lrow[i] + __shfl_xor_sync(0xffffffff, lrow[i], 1);
			ls[i] += __shfl_xor_sync(0xffffffff, ls[i], 2);
		}
	};
	// det_split_end closes a prefill tile's split sp: its rows' sums meet
	// across the quad, and it is merged into each row it reaches (a decode
	// block's splits close in hm_split_end).
	auto det_split_end = [&](int sp) {
		float ls[2];
		row_sums(ls);
		const int sfirst = sp * DET_SPLIT;
#pragma unroll
		for (int i = 0; i < 2; i++) {
			if (sfirst > (i ? qpos1 : qpos0) || !row_ok(w0 + gi + 8 * i)) continue;
			float a, b;
			det_merge(Mrun[i], Lrun[i], mrow[i], ls[i], a, b);
#pragma unroll
			for (int n = 0; n < D / 8; n++) {
				orun[n][2 * i] = det_acc(orun[n][2 * i], a, o[n][2 * i], b);
				orun[n][2 * i + 1] = det_acc(orun[n][2 * i + 1], a, o[n][2 * i + 1], b);
			}
		}
	};
	// det_decode_merge: the last of a (sequence, kv head)'s workers merges
	// its heads' splits, a thread a column, in order.
	__shared__ int last;
	auto det_decode_merge = [&]() {
		__threadfence();
		__syncthreads();
		if (tid == 0) {
			int *c = da.counters + (long long)s * hk + g;
			last = atomicAdd(c, 1) == workers - 1;
			if (last) *c = 0;
		}
		__syncthreads();
		if (!last) return;
		__threadfence();
		for (int e = tid; e < G * D; e += blockDim.x) {
			const int r = e / D, col = e % D;
			float M = -EBB_INF, L = 0.f, O = 0.f;
			for (int sp = 0; sp < nsp; sp++) {
				const long long prow = (long long)(poff + sp) * hq + h + r;
				const float2 ml = __ldcg((const float2 *)(da.part_ml + prow * 2));
				float a, b;
				det_merge(M, L, ml.x, ml.y, a, b);
				O = det_acc(O, a, __ldcg(da.part_o + prow * D + col), b);
			}
			row_out(r)[col] = f2bf(det_out(O, L));
		}
	};

	// hm_tile: a decode tile shared by the block's four warps. Warp wp takes
	// the scores of positions 16 wp.. (sacc's n-blocks 2 wp, 2 wp + 1) and
	// output columns 8 HN wp.. (o[0..HN) here); the row maxima and the
	// probabilities pass through shared memory, and every warp adds the row
	// sums in one warp's order. Each score, sum and output element sees the
	// operations it sees in a prefill's warp, in the same order: the bits
	// are prefill's.
	constexpr int HN = D / 32;
	float *hmx = (float *)(vs + FA_BN * D * 2); // [4 warps][32 lanes][2 rows]
	float *hp = hmx + 4 * 32 * 2;               // [FA_BN / 8 n-blocks][32][4]
	unsigned *hpa = (unsigned *)(hp + (FA_BN / 8) * 32 * 4); // [FA_BN / 16][32][4]
	const int wp = warp;
	auto hm_tile = [&](int tile, int k0) {
		const unsigned char *kt = ks, *vt = vs;
		float sa[2][4] = {};
#pragma unroll
		for (int kk = 0; kk < D / 16; kk++) {
			unsigned b[4];
			ldmatrix_x4(b, smem_u32(kt + swz<D>(wp * 16 + (lane & 7) + 8 * (lane >> 4), kk * 16 + 8 * ((lane >> 3) & 1))));
			mma_bf16(sa[0], qf[kk], b[0], b[1]);
			mma_bf16(sa[1], qf[kk], b[2], b[3]);
		}
		float mx[2] = {-EBB_INF, -EBB_INF};
#pragma unroll
		for (int j = 0; j < 2; j++) {
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int kpos = k0 + (2 * wp + j) * 8 + ti * 2 + (e & 1);
				if (kpos > qpos0 || kpos >= kvlen) sa[j][e] = -EBB_INF;
				mx[e >> 1] = fmaxf(mx[e >> 1], sa[j][e]);
			}
		}
#pragma unroll
		for (int i = 0; i < 2; i++) {
			mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 1));
			mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 2));
			hmx[(wp * 32 + lane) * 2 + i] = mx[i];
		}
		__syncthreads();
		float alpha[2], muse[2];
#pragma unroll
		for (int i = 0; i < 2; i++) {
			float m = hmx[lane * 2 + i];
#pragma unroll
			for (int v = 1; v < 4; v++) m = fmaxf(m, hmx[(v * 32 + lane) * 2 + i]);
			const float mn = fmaxf(mrow[i], m * sl2);
			muse[i] = mn == -EBB_INF ? 0.f : mn;
			alpha[i] = ex2_ftz(mrow[i] - muse[i]);
			mrow[i] = mn;
			lrow[i] *= alpha[i];
		}
		if (tile % TPS != 0) {
#pragma unroll
			for (int j = 0; j < HN; j++) {
				o[j][0] *= alpha[0];
				o[j][1] *= alpha[0];
				o[j][2] *= alpha[1];
				o[j][3] *= alpha[1];
			}
		}
#pragma unroll
		for (int j = 0; j < 2; j++) {
#pragma unroll
			for (int e = 0; e < 4; e++) sa[j][e] = ex2_ftz(fmaf(sa[j][e], sl2, -muse[e >> 1]));
			*(float4 *)(hp + ((2 * wp + j) * 32 + lane) * 4) = make_float4(sa[j][0], sa[j][1], sa[j][2], sa[j][3]);
		}
		*(uint4 *)(hpa + (wp * 32 + lane) * 4) = make_uint4(pack_bf16x2(sa[0][0], sa[0][1]), pack_bf16x2(sa[0][2], sa[0][3]),
		                                                    pack_bf16x2(sa[1][0], sa[1][1]), pack_bf16x2(sa[1][2], sa[1][3]));
		__syncthreads();
#pragma unroll
		for (int n = 0; n < FA_BN / 8; n++) {
			const float4 p = *(const float4 *)(hp + (n * 32 + lane) * 4);
			lrow[0] += p.x;
			lrow[0] += p.y;
			lrow[1] += p.z;
			lrow[1] += p.w;
		}
#pragma unroll
		for (int kk = 0; kk < FA_BN / 16; kk++) {
			const uint4 pv = *(const uint4 *)(hpa + (kk * 32 + lane) * 4);
			const unsigned pa[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
			for (int jd = 0; jd < HN / 2; jd++) {
				unsigned b[4];
				ldmatrix_x4_trans(b, smem_u32(vt + swz<D>(kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), (wp * (HN / 2) + jd) * 16 + 8 * (lane >> 4))));
				mma_bf16(o[2 * jd], pa, b[0], b[1]);
				mma_bf16(o[2 * jd + 1], pa, b[2], b[3]);
			}
		}
	};
	// hm_split_end is det_split_end for the shared tiles: the warps hold the
	// same row sums, and each its own output columns.
	auto hm_split_end = [&](int sp) {
		float ls[2];
		row_sums(ls);
#pragma unroll
		for (int i = 0; i < 2; i++) {
			const int r = gi + 8 * i;
			if (!row_ok(r)) continue;
			if (workers > 0) {
				const long long prow = (long long)(poff + sp) * hq + h + r;
#pragma unroll
				for (int j = 0; j < HN; j++)
					*(float2 *)(da.part_o + prow * D + (wp * HN + j) * 8 + ti * 2) = make_float2(o[j][2 * i], o[j][2 * i + 1]);
				if (wp == 0 && ti == 0) *(float2 *)(da.part_ml + prow * 2) = make_float2(mrow[i], ls[i]);
				continue;
			}
			float a, b;
			det_merge(Mrun[i], Lrun[i], mrow[i], ls[i], a, b);
#pragma unroll
			for (int j = 0; j < HN; j++) {
				orun[j][2 * i] = det_acc(orun[j][2 * i], a, o[j][2 * i], b);
				orun[j][2 * i + 1] = det_acc(orun[j][2 * i + 1], a, o[j][2 * i + 1], b);
			}
		}
	};

	for (int it = 0; it < nit; it++) {
		const int tile = tile_of(it);
		if (it > 0) {
			load_kv(tile, slot, -1);
			cp_async_wait<0>();
			__syncthreads();
		}
		if (it + 1 < nit) slot = fetch_slot(tile_of(it + 1));
		const int k0 = tile * FA_BN;
		if (DET && tile % TPS == 0) { // a split starts afresh
#pragma unroll
			for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
			mrow[0] = mrow[1] = -EBB_INF;
			lrow[0] = lrow[1] = 0.f;
		}
		if (hm) {
			if (k0 < kvlen) hm_tile(tile, k0);
		} else if (k0 <= wlast) { // else every key of the tile is after the warp's queries
			const unsigned char *kt = ks, *vt = vs;
			float sacc[FA_BN / 8][4];
#pragma unroll
			for (int n = 0; n < FA_BN / 8; n++) sacc[n][0] = sacc[n][1] = sacc[n][2] = sacc[n][3] = 0.f;
#pragma unroll
			for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
				for (int np = 0; np < FA_BN / 16; np++) {
					unsigned b[4];
					ldmatrix_x4(b, smem_u32(kt + swz<D>(np * 16 + (lane & 7) + 8 * (lane >> 4), kk * 16 + 8 * ((lane >> 3) & 1))));
					mma_bf16(sacc[2 * np], qf[kk], b[0], b[1]);
					mma_bf16(sacc[2 * np + 1], qf[kk], b[2], b[3]);
				}
			}
			// Only a tile that reaches past the warp's first query or the
			// keys' end has keys to mask.
			if (k0 + FA_BN - 1 > wfirst || k0 + FA_BN > kvlen) {
#pragma unroll
				for (int n = 0; n < FA_BN / 8; n++) {
#pragma unroll
					for (int e = 0; e < 4; e++) {
						const int kpos = k0 + n * 8 + ti * 2 + (e & 1);
						if (kpos > (e < 2 ? qpos0 : qpos1) || kpos >= kvlen) sacc[n][e] = -EBB_INF;
					}
				}
			}
			// The scores are scaled as they meet the exponent (the row
			// maximum of the raw scores, scaled, is the maximum of the
			// scaled ones).
			float mx[2] = {-EBB_INF, -EBB_INF};
#pragma unroll
			for (int n = 0; n < FA_BN / 8; n++) {
#pragma unroll
				for (int e = 0; e < 4; e++) mx[e >> 1] = fmaxf(mx[e >> 1], sacc[n][e]);
			}
			float alpha[2], muse[2];
#pragma unroll
			for (int i = 0; i < 2; i++) {
				mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 1));
				mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 2));
				const float mn = fmaxf(mrow[i], mx[i] * sl2);
				muse[i] = mn == -EBB_INF ? 0.f : mn;
				alpha[i] = ex2_ftz(mrow[i] - muse[i]);
				mrow[i] = mn;
				lrow[i] *= alpha[i];
			}
			if (DET ? tile % TPS != 0 : tile > 0) { // o is still zero after no tile
#pragma unroll
				for (int n = 0; n < D / 8; n++) {
					o[n][0] *= alpha[0];
					o[n][1] *= alpha[0];
					o[n][2] *= alpha[1];
					o[n][3] *= alpha[1];
				}
			}
			unsigned pa[FA_BN / 16][4];
#pragma unroll
			for (int n = 0; n < FA_BN / 8; n++) {
#pragma unroll
				for (int e = 0; e < 4; e++) {
					const float p = ex2_ftz(fmaf(sacc[n][e], sl2, -muse[e >> 1]));
					sacc[n][e] = p;
					lrow[e >> 1] += p;
				}
			}
#pragma unroll
			for (int kk = 0; kk < FA_BN / 16; kk++) {
				pa[kk][0] = pack_bf16x2(sacc[2 * kk][0], sacc[2 * kk][1]);
				pa[kk][1] = pack_bf16x2(sacc[2 * kk][2], sacc[2 * kk][3]);
				pa[kk][2] = pack_bf16x2(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
				pa[kk][3] = pack_bf16x2(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
			}
#pragma unroll
			for (int kk = 0; kk < FA_BN / 16; kk++) {
#pragma unroll
				for (int dp = 0; dp < D / 16; dp++) {
					unsigned b[4];
					ldmatrix_x4_trans(b, smem_u32(vt + swz<D>(kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), dp * 16 + 8 * (lane >> 4))));
					mma_bf16(o[2 * dp], pa[kk], b[0], b[1]);
					mma_bf16(o[2 * dp + 1], pa[kk], b[2], b[3]);
				}
			}
		}
		if constexpr (DET) {
			if (tile % TPS == TPS - 1 || it == nit - 1) {
				if (hm)
					hm_split_end(tile / TPS);
				else
					det_split_end(tile / TPS);
			}
		}
		__syncthreads(); // the next tile overwrites this one
	}
	const int r0 = q0 + w0 + gi, r1 = r0 + 8;
	if constexpr (DET) {
		if (workers > 0) {
			det_decode_merge();
			return;
		}
		if (hm) {
#pragma unroll
			for (int j = 0; j < HN; j++) {
				const int dd = (wp * HN + j) * 8 + ti * 2;
				if (row_ok(gi))
					*(unsigned *)(row_out(gi) + dd) = pack_bf16x2(det_out(orun[j][0], Lrun[0]), det_out(orun[j][1], Lrun[0]));
				if (row_ok(gi + 8))
					*(unsigned *)(row_out(gi + 8) + dd) = pack_bf16x2(det_out(orun[j][2], Lrun[1]), det_out(orun[j][3], Lrun[1]));
			}
			return;
		}
#pragma unroll
		for (int n = 0; n < D / 8; n++) {
			const int dd = n * 8 + ti * 2;
			if (row_ok(w0 + gi))
				*(unsigned *)(row_out(w0 + gi) + dd) = pack_bf16x2(det_out(orun[n][0], Lrun[0]), det_out(orun[n][1], Lrun[0]));
			if (row_ok(w0 + gi + 8))
				*(unsigned *)(row_out(w0 + gi + 8) + dd) = pack_bf16x2(det_out(orun[n][2], Lrun[1]), det_out(orun[n][3], Lrun[1]));
		}
	} else {
#pragma unroll
		for (int i = 0; i < 2; i++) {
			lrow[i] += __shfl_xor_sync(0xffffffff, lrow[i], 1);
			lrow[i] += __shfl_xor_sync(0xffffffff, lrow[i], 2);
		}
		const float inv0 = lrow[0] > 0.f ? 1.f / lrow[0] : 0.f, inv1 = lrow[1] > 0.f ? 1.f / lrow[1] : 0.f;
#pragma unroll
		for (int n = 0; n < D / 8; n++) {
			const int dd = n * 8 + ti * 2;
			if (r0 < qlen)
				*(unsigned *)(out + ((long long)(qbase + r0) * hq + h) * D + dd) = pack_bf16x2(o[n][0] * inv0, o[n][1] * inv0);
			if (r1 < qlen)
				*(unsigned *)(out + ((long long)(qbase + r1) * hq + h) * D + dd) = pack_bf16x2(o[n][2] * inv1, o[n][3] * inv1);
		}
	}
}

#define ATTN_PREFILL_MMA(D)                                                                                      \
	extern "C" __global__ void __launch_bounds__(128, 3) attn_prefill_mma_d##D(                                    \
	    bf16 *out, const bf16 *qkv, const bf16 *kc, const bf16 *vc, const int *qptr, const int *kvptr,             \
	    const int *kvidx, int hq, int hk, float scale, const bf16 *qnorm, const float *cos_t, const float *sin_t,  \
	    float eps, int raw_q) {                                                                                    \
		DEP();                                                                                                     \
		attn_prefill_mma_impl<D>(out, qkv, kc, vc, qptr, kvptr, kvidx, hq, hk, scale, qnorm, cos_t, sin_t, eps,      \
		                         raw_q);                                                                           \
	}
ATTN_PREFILL_MMA(64)
ATTN_PREFILL_MMA(128)

// attn_det: attention for deterministic inference (DET above): attn_det
// for prefills (workers 0), attn_det_dec for decodes (workers > 0).
#define ATTN_DET(D, NAME, MODE, BLOCKS)                                                                          \
	extern "C" __global__ void __launch_bounds__(128, BLOCKS) NAME##_d##D(                                         \
	    bf16 *out, const bf16 *qkv, const bf16 *kc, const bf16 *vc, const int *qptr, const int *kvptr,             \
	    const int *kvidx, int hq, int hk, float scale, int workers, float *part_o, float *part_ml, int *counters,  \
	    int part_rows, int lone_splits) {                                                                          \
		attn_prefill_mma_impl<D, true, MODE>(out, qkv, kc, vc, qptr, kvptr, kvidx, hq, hk, scale, nullptr, nullptr, \
		                                     nullptr, 0.f, 0,                                                       \
		                                     DetArgs{workers, part_o, part_ml, counters, part_rows, lone_splits});  \
	}
// Blocks an SM (EBB_KERNEL_DEFINES A/B, H100, 0.6B shape, flag on, ms a
// decode step at batch 1 / 64 / 256): decode 3 blocks 1.230 / 1.901 /
// 4.200, 4 blocks 1.224 / 1.792 / 4.119 and 1.225 / 1.756 / 4.084 (126
// registers, no spill), 5 blocks 1.241 / 1.865 / 4.207 (96 and a 24-byte
// spill); attn_det alone was 1.270 / 2.211 / 5.068. Prefill at 2 blocks
// (no spill) was within noise of 3.
#ifndef DET_DECODE_BLOCKS
#define DET_DECODE_BLOCKS 4
#endif
#ifndef DET_PREFILL_BLOCKS
#define DET_PREFILL_BLOCKS 3
#endif
ATTN_DET(64, attn_det, DET_PREFILL, DET_PREFILL_BLOCKS)
ATTN_DET(128, attn_det, DET_PREFILL, DET_PREFILL_BLOCKS)
ATTN_DET(64, attn_det_dec, DET_DECODE, DET_DECODE_BLOCKS)
ATTN_DET(128, attn_det_dec, DET_DECODE, DET_DECODE_BLOCKS)
