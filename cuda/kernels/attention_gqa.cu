// Decode attention on the tensor cores for grouped queries.
//
// attn_decode_gqa does what attn_decode_vec does (the same grid, splits,
// merge and RAW preparation) for 3 to 8 query heads a kv head at head size
// 128 (Qwen3-8B has 4, Qwen3-30B-A3B 8). There the vector kernel's work a
// row grows with the heads (for each, a dot product, four shuffles, two
// exponentials and eight multiply-adds) until it, not the loads, sets the
// pace: H100, 8 heads, 256 sequences of 2,048 positions, 29% of HBM
// bandwidth. Here each warp takes chunks of 16 positions and runs
// S^T = K Q^T and O^T += V^T P^T as mma.m16n8k16, the positions and the head
// dims as M and the (up to 8) heads as N, so that no row of a tile is
// padding.
//
// K and V come from the cache straight into registers with 16-byte loads,
// without shared memory. A dot product may take the dims in any order as
// long as the query takes the same one, so lane (gid, t) holds dims
// 32q+8t..32q+8t+7 (q = 0..3) of its two positions' keys, each k-step of
// the product using half of one such run. An output dim may live in any
// lane, so row m of V^T's tile mt is dim 64(m/8) + 8(m%8) + mt, which leaves
// each lane two runs of 8 dims of its four positions' values. P^T's
// fragment is S^T's, transposed in registers (movmatrix).
#define DG_WARPS 4
#define DG_CHUNK 16 // positions a warp takes at a time
#define DG_HEADS 8  // query heads a kv head at most (the N of the products)
// A block may take up to DG_HEADS_A_BLOCK kv heads of its sequence, its
// warps shared among them, where a batch has more pairs (sequence, kv head)
// than one wave of blocks holds: at short contexts a block's fixed chain
// (slots, queries, merge) is most of its time, and a second wave pays it
// again while memory idles. Its query preparation takes at most
// DG_TASK_ROUNDS rounds of 16 (hpb * (G + 1) <= 16 * DG_TASK_ROUNDS).
#define DG_HEADS_A_BLOCK 4
#define DG_TASK_ROUNDS 2
// The one-split kernels (attn_decode_gqa_one*, EBB_DECODE_ONE): a few
// sequences whose contexts take one split (decodeWhole) run on blocks of
// DG_ONE_WARPS warps, twice the four's, so that a warp streams half the
// chunks one after another; launched with one split a sequence, they
// never merge (no partials, no counter, and none of the merge's shared
// memory), and no block of the grid is left without work.
#define DG_ONE_WARPS 8

__device__ __forceinline__ unsigned movmatrix_t(unsigned x) {
	unsigned y;
	asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
	return y;
}

__device__ __forceinline__ unsigned word_of(uint4 u, int i) { return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w; }

// elem_pair is element e of x (low half) and of y (high half), x and y 8
// bf16 each.
__device__ __forceinline__ unsigned elem_pair(uint4 x, uint4 y, int e) {
	return __byte_perm(word_of(x, e >> 1), word_of(y, e >> 1), (e & 1) ? 0x7632 : 0x5410);
}

// PF: a warp's next chunk of rows is requested before the current one's
// products (two chunks in flight, 212 registers: two blocks an SM). The
// lean kernels (PF false) request the next chunk's keys once the scores
// are formed and its values once the outputs are, in the registers just
// read: 128 registers (8-16 bytes spilled, NVRTC 11.8 for sm_80) and four
// blocks an SM, where at short contexts a block's fixed chain of loads
// (slots, rows, queries, the merges) is most of its time and two blocks an
// SM left it bare (30B-A3B shape, batch 256 of about 192 positions: 41 us
// a layer at 1.7 TB/s, H200).
template <bool RAW, bool PF = true, int W = DG_WARPS, bool ONE = false>
__device__ __forceinline__ void attn_decode_gqa_impl(bf16 *out, const bf16 *qkv, bf16 *kc, bf16 *vc, const int *qptr,
                                                     const int *kvptr, const int *kvidx, float *part_o,
                                                     float *part_ml, int *counters, int hq, int hk, int splits,
                                                     int units, int units_max, int min_split, int whole,
                                                     int hpb, float scale, DecodeRaw raw) {
	constexpr int D = 128, MG = DG_HEADS;
	__shared__ float sh_m[W][MG], sh_l[W][MG];
	// Rows of D + 1: the stores of a warp's outputs (lanes 2t, 8 gid apart)
	// met in four banks, an 8-way conflict; now in 2-way.
	constexpr int OS = D + 1;
	__shared__ float sh_o[W][MG][OS];
	__shared__ __align__(16) bf16 sh_q[DG_HEADS_A_BLOCK][MG][D];
	// The raw kernels keep the newest key and value they prepare in shared
	// memory too, and the warp whose first chunk holds the newest position
	// takes them from there after the block's barrier, rather than looking
	// up its slot and reading the row back from the cache: two round trips
	// less on that warp's path. At batch 1 every split is one chunk a warp,
	// so the newest is always in a first chunk (H200, batch 1 a step: 30B-A3B
	// -0.27 %, 8B -0.11 %, 0.6B -0.76 %).
	__shared__ __align__(16) bf16 sh_new[RAW ? DG_HEADS_A_BLOCK : 1][2][D]; // the newest K and V a head
	// A block takes hpb kv heads of one (sequence, split), W / hpb
	// warps each (see DG_HEADS_A_BLOCK); warp w's head is hh = w / wph.
	const int s = blockIdx.y, sp = blockIdx.z, wph = W / hpb;
	const int G = hq / hk, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const int hh = warp / wph, wi = warp % wph, g = blockIdx.x * hpb + hh, step = wph * DG_CHUNK;
	const int gid = lane >> 2, t = lane & 3;
	const long long row = qptr[s];
	const int kv0 = kvptr[s], kvlen = kvptr[s + 1] - kv0;
	// The shares are cut for blocks, each hpb heads' worth of positions.
	const DecodeSplit ds = decode_split(kvptr, kvlen, hk / hpb, splits, units, units_max, min_split, whole);
	if (sp >= ds.used) {
		DEP();
		return;
	}
	const int c0 = sp * ds.per, c1 = min(kvlen, c0 + ds.per), newest = kvlen - 1;
	const long long stride = (long long)(hq + 2 * hk) * D;
	// A chunk at cb: keys of positions cb+gid and cb+gid+8, values of
	// cb+2t, cb+2t+1, cb+2t+8 and cb+2t+9, of the positions in [lo, hi)
	// (the rest zero when zero is set, else left as they were). slots
	// finds their cache slots (-1 outside), fetch requests their rows: the
	// loop asks for a chunk's slots one chunk ahead of its rows, so that a
	// warp's next rows wait on one round trip to memory, not two.
	auto slots = [&](int cb, int lo, int hi, int(&ks)[2], int(&vs)[4]) {
#pragma unroll
		for (int j = 0; j < 2; j++) {
			const int pos = cb + gid + 8 * j;
			ks[j] = pos >= lo && pos < hi ? kvidx[kv0 + pos] : -1;
		}
#pragma unroll
		for (int i = 0; i < 4; i++) {
			const int pos = cb + 2 * t + (i & 1) + 8 * (i >> 1);
			vs[i] = pos >= lo && pos < hi ? kvidx[kv0 + pos] : -1;
		}
	};
	auto fetch_k = [&](const int(&ks)[2], uint4(&kd)[2][4], bool zero) {
#pragma unroll
		for (int j = 0; j < 2; j++)
#pragma unroll
			for (int q = 0; q < 4; q++) {
				if (zero) kd[j][q] = make_uint4(0, 0, 0, 0);
				if (ks[j] >= 0) kd[j][q] = __ldcs((const uint4 *)(kc + ((long long)ks[j] * hk + g) * D + 32 * q + 8 * t));
			}
	};
	auto fetch_v = [&](const int(&vs)[4], uint4(&vd)[4][2], bool zero) {
#pragma unroll
		for (int i = 0; i < 4; i++)
#pragma unroll
			for (int u = 0; u < 2; u++) {
				if (zero) vd[i][u] = make_uint4(0, 0, 0, 0);
				if (vs[i] >= 0) vd[i][u] = __ldcs((const uint4 *)(vc + ((long long)vs[i] * hk + g) * D + 64 * u + 8 * gid));
			}
	};
	auto fetch = [&](const int(&ks)[2], const int(&vs)[4], uint4(&kd)[2][4], uint4(&vd)[4][2], bool zero) {
		fetch_k(ks, kd, zero);
		fetch_v(vs, vd, zero);
	};
	auto load = [&](int cb, int lo, int hi, uint4(&kd)[2][4], uint4(&vd)[4][2], bool zero) {
		int ks[2], vs[4];
		slots(cb, lo, hi, ks, vs);
		fetch(ks, vs, kd, vd, zero);
	};
	// The newest position's K and V are this step's: loaded after the wait.
	const int first = c0 + wi * DG_CHUNK;
	uint4 kr[2][4], vr[4][2];
	load(first, 0, min(c1, newest), kr, vr, true);
	// Query preparation in the 16-byte layout (prepare_qkv16's bits): eight
	// lanes a head, lane group (warp, lane / 8) taking task slot, slot + TS,
	// ... of the block's hpb * (G + 1): for each of its kv heads the query
	// heads, then the newest key. Every task's rows are requested before
	// any is prepared.
	constexpr int TS = 4 * W; // lane groups: tasks a round
	const int hl = lane & 7, slot = warp * 4 + (lane >> 3), c8 = 8 * hl, tasks = hpb * (G + 1);
	DecodeRawStep rs{};
	if (RAW) rs.load<D>(raw, row, c8);
	DEP();
	const bool holds_newest = c1 == kvlen && kvlen > 0;
	const bf16 *x = qkv + row * stride;
	uint4 qa[DG_TASK_ROUNDS], qb[DG_TASK_ROUNDS];
#pragma unroll
	for (int r = 0; r < DG_TASK_ROUNDS; r++) {
		const int task = slot + TS * r, th = task / (G + 1), j = task % (G + 1), tg = blockIdx.x * hpb + th;
		if (task < tasks && (RAW || j < G)) {
			const bf16 *h = x + (long long)(j < G ? tg * G + j : hq + tg) * D;
			qa[r] = *(const uint4 *)(h + c8);
			qb[r] = *(const uint4 *)(h + D / 2 + c8);
		}
	}
#pragma unroll
	for (int r = 0; r < DG_TASK_ROUNDS; r++) {
		if (TS * r >= tasks) break; // uniform over the block
		const int task = slot + TS * r, th = task / (G + 1), j = task % (G + 1), tg = blockIdx.x * hpb + th;
		const bool valid = task < tasks, key = j == G;
		uint4 a = qa[r], b = qb[r];
		if (RAW) {
			// Every lane prepares a head (head_inv shuffles over the warp).
			float inv = 0.f;
			if (raw.qnorm) {
				float af[8], bf[8];
				unpack8(valid ? a : make_uint4(0, 0, 0, 0), af);
				unpack8(valid ? b : make_uint4(0, 0, 0, 0), bf);
				inv = head_inv(af, bf, 8, D, raw.eps);
			}
			norm_rope8(a, b, raw.qnorm != nullptr, key ? rs.kwa : rs.qwa, key ? rs.kwb : rs.qwb, inv, rs.cs, rs.sn);
		}
		if (!valid) continue;
		if (!key) {
			*(uint4 *)&sh_q[th][j][c8] = a;
			*(uint4 *)&sh_q[th][j][D / 2 + c8] = b;
		} else if (RAW && holds_newest) {
			const long long base = (rs.new_slot * hk + tg) * D;
			const bf16 *v = x + (long long)(hq + hk + tg) * D;
			*(uint4 *)(kc + base + c8) = a;
			*(uint4 *)(kc + base + D / 2 + c8) = b;
			*(uint4 *)(vc + base + c8) = *(const uint4 *)(v + c8);
			*(uint4 *)(vc + base + D / 2 + c8) = *(const uint4 *)(v + D / 2 + c8);
			*(uint4 *)&sh_new[th][0][c8] = a;
			*(uint4 *)&sh_new[th][0][D / 2 + c8] = b;
			*(uint4 *)&sh_new[th][1][c8] = *(const uint4 *)(v + c8);
			*(uint4 *)&sh_new[th][1][D / 2 + c8] = *(const uint4 *)(v + D / 2 + c8);
		}
	}
	// Query rows past G are zero (the products' N is MG).
	for (int i = threadIdx.x; i < hpb * (MG - G) * (D / 8); i += blockDim.x) {
		const int th = i / ((MG - G) * (D / 8)), j = G + i / (D / 8) % (MG - G);
		*(uint4 *)&sh_q[th][j][8 * (i % (D / 8))] = make_uint4(0, 0, 0, 0);
	}
	__syncthreads(); // the queries, and the newest K and V, for the whole block
	if (holds_newest && newest >= first && newest < first + DG_CHUNK) {
		if constexpr (RAW) {
			// fetch_k's and fetch_v's places in the row, from shared memory.
#pragma unroll
			for (int j = 0; j < 2; j++)
				if (first + gid + 8 * j == newest)
#pragma unroll
					for (int q = 0; q < 4; q++) kr[j][q] = *(const uint4 *)&sh_new[hh][0][32 * q + 8 * t];
#pragma unroll
			for (int i = 0; i < 4; i++)
				if (first + 2 * t + (i & 1) + 8 * (i >> 1) == newest)
#pragma unroll
					for (int u = 0; u < 2; u++) vr[i][u] = *(const uint4 *)&sh_new[hh][1][64 * u + 8 * gid];
		} else
			load(first, newest, newest + 1, kr, vr, false);
	}
	// The queries stay in registers where there is room (PF); the lean
	// kernels read them from shared memory for each chunk.
	uint4 qf[4];
#pragma unroll
	for (int q = 0; q < 4; q++)
		if constexpr (PF) qf[q] = *(const uint4 *)&sh_q[hh][gid][32 * q + 8 * t];
	const float qs = scale * LOG2E;
	float o[8][4];
#pragma unroll
	for (int mt = 0; mt < 8; mt++) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
	// This lane's heads are 2t and 2t+1: running maxima (uniform over the
	// lanes of a t) and partial sums (this lane's positions only).
	float m0 = -EBB_INF, m1 = -EBB_INF, l0 = 0.f, l1 = 0.f;
	int ksn[2], vsn[4]; // the slots of the warp's next chunk
	slots(first + step, 0, c1, ksn, vsn);
	for (int cb = first; cb < c1; cb += step) {
		uint4 kn[2][4], vn[4][2];
		if constexpr (PF) {
			fetch(ksn, vsn, kn, vn, true);
			slots(cb + 2 * step, 0, c1, ksn, vsn);
		}
		float sc[4] = {0.f, 0.f, 0.f, 0.f}; // S^T: [position gid, +8][heads 2t, 2t+1]
#pragma unroll
		for (int q = 0; q < 4; q++) {
			if constexpr (!PF) qf[q] = *(const uint4 *)&sh_q[hh][gid][32 * q + 8 * t];
#pragma unroll
			for (int h = 0; h < 2; h++) {
				const unsigned a[4] = {h ? kr[0][q].z : kr[0][q].x, h ? kr[1][q].z : kr[1][q].x,
				                       h ? kr[0][q].w : kr[0][q].y, h ? kr[1][q].w : kr[1][q].y};
				mma_bf16(sc, a, h ? qf[q].z : qf[q].x, h ? qf[q].w : qf[q].y);
			}
		}
		if constexpr (!PF) fetch_k(ksn, kr, true); // the scores are formed: the next chunk's keys
		const bool in0 = cb + gid < c1, in1 = cb + gid + 8 < c1;
		const float s0 = in0 ? sc[0] * qs : -EBB_INF, s1 = in0 ? sc[1] * qs : -EBB_INF;
		const float s2 = in1 ? sc[2] * qs : -EBB_INF, s3 = in1 ? sc[3] * qs : -EBB_INF;
		float x0 = fmaxf(s0, s2), x1 = fmaxf(s1, s3);
#pragma unroll
		for (int off = 4; off < 32; off <<= 1) {
			x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
			x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
		}
		// Position cb is in the split, so both maxima are finite.
		const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
		const float a0 = ex2_ftz(m0 - n0), a1 = ex2_ftz(m1 - n1);
		const float p0 = ex2_ftz(s0 - n0), p1 = ex2_ftz(s1 - n1), p2 = ex2_ftz(s2 - n0), p3 = ex2_ftz(s3 - n1);
		l0 = l0 * a0 + (p0 + p2);
		l1 = l1 * a1 + (p1 + p3);
		m0 = n0, m1 = n1;
		const unsigned b0 = movmatrix_t(pack_bf16x2(p0, p1)), b1 = movmatrix_t(pack_bf16x2(p2, p3));
#pragma unroll
		for (int mt = 0; mt < 8; mt++) {
			o[mt][0] *= a0, o[mt][1] *= a1, o[mt][2] *= a0, o[mt][3] *= a1;
			const unsigned a[4] = {elem_pair(vr[0][0], vr[1][0], mt), elem_pair(vr[0][1], vr[1][1], mt),
			                       elem_pair(vr[2][0], vr[3][0], mt), elem_pair(vr[2][1], vr[3][1], mt)};
			mma_bf16(o[mt], a, b0, b1);
		}
		if constexpr (PF) {
#pragma unroll
			for (int j = 0; j < 2; j++)
#pragma unroll
				for (int q = 0; q < 4; q++) kr[j][q] = kn[j][q];
#pragma unroll
			for (int i = 0; i < 4; i++)
#pragma unroll
				for (int u = 0; u < 2; u++) vr[i][u] = vn[i][u];
		} else {
			fetch_v(vsn, vr, true);
			slots(cb + 2 * step, 0, c1, ksn, vsn);
		}
	}
#pragma unroll
	for (int off = 4; off < 32; off <<= 1) {
		l0 += __shfl_xor_sync(0xffffffffu, l0, off);
		l1 += __shfl_xor_sync(0xffffffffu, l1, off);
	}
	if (gid == 0) {
		sh_m[warp][2 * t] = m0, sh_m[warp][2 * t + 1] = m1;
		sh_l[warp][2 * t] = l0, sh_l[warp][2 * t + 1] = l1;
	}
#pragma unroll
	for (int mt = 0; mt < 8; mt++) {
		sh_o[warp][2 * t][8 * gid + mt] = o[mt][0];
		sh_o[warp][2 * t + 1][8 * gid + mt] = o[mt][1];
		sh_o[warp][2 * t][64 + 8 * gid + mt] = o[mt][2];
		sh_o[warp][2 * t + 1][64 + 8 * gid + mt] = o[mt][3];
	}
	for (int h = 0; h < hpb; h++) {
		const int hg = blockIdx.x * hpb + h;
		__syncthreads(); // the warps' outputs; the last head's merge done with shared memory
		decode_block_store<D, MG, OS>(out, part_o, part_ml, &sh_m[h * wph][0], &sh_l[h * wph][0], &sh_o[h * wph][0][0],
		                              wph, row * hq + hg * G, G, splits, sp, ds.used);
		if constexpr (!ONE) decode_merge<D, MG>(out, part_o, part_ml, counters, row, hq, hk, s, hg, splits, ds.used);
	}
}

extern "C" __global__ void __launch_bounds__(DG_WARPS * 32, 2)
    attn_decode_gqa_d128(bf16 *out, const bf16 *qkv, bf16 *kc, bf16 *vc, const int *qptr, const int *kvptr,
                         const int *kvidx, float *part_o, float *part_ml, int *counters, int hq, int hk, int d,
                         int splits, int units, int units_max, int min_split, int whole, int hpb, float scale) {
	attn_decode_gqa_impl<false>(out, qkv, kc, vc, qptr, kvptr, kvidx, part_o, part_ml, counters, hq, hk, splits, units,
	                            units_max, min_split, whole, hpb, scale, DecodeRaw{});
}

extern "C" __global__ void __launch_bounds__(DG_WARPS * 32, 2)
    attn_decode_gqa_raw_d128(bf16 *out, const bf16 *qkv, bf16 *kc, bf16 *vc, const int *qptr, const int *kvptr,
                             const int *kvidx, float *part_o, float *part_ml, int *counters, int hq, int hk, int d,
                             int splits, int units, int units_max, int min_split, int whole, int hpb, float scale,
                             const bf16 *qnorm, const bf16 *knorm, const int *pos, const int *slots,
                             const float *cos_t, const float *sin_t, float eps) {
	attn_decode_gqa_impl<true>(out, qkv, kc, vc, qptr, kvptr, kvidx, part_o, part_ml, counters, hq, hk, splits, units,
	                           units_max, min_split, whole, hpb, scale,
	                           DecodeRaw{qnorm, knorm, pos, slots, cos_t, sin_t, eps});
}

extern "C" __global__ void __launch_bounds__(DG_WARPS * 32, 4)
    attn_decode_gqa_lean_d128(bf16 *out, const bf16 *qkv, bf16 *kc, bf16 *vc, const int *qptr, const int *kvptr,
                              const int *kvidx, float *part_o, float *part_ml, int *counters, int hq, int hk, int d,
                              int splits, int units, int units_max, int min_split, int whole, int hpb, float scale) {
	attn_decode_gqa_impl<false, false>(out, qkv, kc, vc, qptr, kvptr, kvidx, part_o, part_ml, counters, hq, hk, splits,
	                                   units, units_max, min_split, whole, hpb, scale, DecodeRaw{});
}

extern "C" __global__ void __launch_bounds__(DG_WARPS * 32, 4)
    attn_decode_gqa_lean_raw_d128(bf16 *out, const bf16 *qkv, bf16 *kc, bf16 *vc, const int *qptr, const int *kvptr,
                                  const int *kvidx, float *part_o, float *part_ml, int *counters, int hq, int hk,
                                  int d, int splits, int units, int units_max, int min_split, int whole, int hpb,
                                  float scale, const bf16 *qnorm, const bf16 *knorm, const int *pos, const int *slots,
                                  const float *cos_t, const float *sin_t, float eps) {
	attn_decode_gqa_impl<true, false>(out, qkv, kc, vc, qptr, kvptr, kvidx, part_o, part_ml, counters, hq, hk, splits,
	                                  units, units_max, min_split, whole, hpb, scale,
	                                  DecodeRaw{qnorm, knorm, pos, slots, cos_t, sin_t, eps});
}

extern "C" __global__ void __launch_bounds__(DG_ONE_WARPS * 32, 1)
    attn_decode_gqa_one_d128(bf16 *out, const bf16 *qkv, bf16 *kc, bf16 *vc, const int *qptr, const int *kvptr,
                             const int *kvidx, float *part_o, float *part_ml, int *counters, int hq, int hk, int d,
                             int splits, int units, int units_max, int min_split, int whole, int hpb, float scale) {
	attn_decode_gqa_impl<false, true, DG_ONE_WARPS, true>(out, qkv, kc, vc, qptr, kvptr, kvidx, part_o, part_ml, counters,
	                                                      hq, hk, splits, units, units_max, min_split, whole, hpb, scale,
	                                                      DecodeRaw{});
}

extern "C" __global__ void __launch_bounds__(DG_ONE_WARPS * 32, 1)
    attn_decode_gqa_one_raw_d128(bf16 *out, const bf16 *qkv, bf16 *kc, bf16 *vc, const int *qptr, const int *kvptr,
                                 const int *kvidx, float *part_o, float *part_ml, int *counters, int hq, int hk, int d,
                                 int splits, int units, int units_max, int min_split, int whole, int hpb, float scale,
                                 const bf16 *qnorm, const bf16 *knorm, const int *pos, const int *slots,
                                 const float *cos_t, const float *sin_t, float eps) {
	attn_decode_gqa_impl<true, true, DG_ONE_WARPS, true>(out, qkv, kc, vc, qptr, kvptr, kvidx, part_o, part_ml, counters,
	                                                     hq, hk, splits, units, units_max, min_split, whole, hpb, scale,
	                                                     DecodeRaw{qnorm, knorm, pos, slots, cos_t, sin_t, eps});
}
