// Attention kernels for the common head sizes: decode at memory bandwidth
// here, prefill on the tensor cores in attention_flash.cu. attention.cu's
// kernels remain for the other shapes. Indexing is the same: sequence s owns query rows
// qptr[s]..qptr[s+1] and KV slots kvidx[kvptr[s]..kvptr[s+1]] in position
// order; K and V are bf16 [slots, hk, D].

#define LOG2E 1.4426950408889634f

// ex2_ftz is 2^x in one instruction; exp2f adds a range check and two
// scalings so that results below 2^-126 are not flushed to zero, which a
// softmax weight that small does not need.
__device__ __forceinline__ float ex2_ftz(float x) {
	float r;
	asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
	return r;
}

// ---- decode ------------------------------------------------------------------

// attn_decode_vec: one query per sequence. Block (kv head, sequence, split)
// of DV_WARPS warps. A K or V row (D bf16) is read by LPR = D/8 lanes with
// 16-byte loads, so a warp reads RPW = 32/LPR rows at once; each lane keeps
// DV_UNROLL rows of K and of V in flight. The MG >= G query heads of the kv
// head share every row. Softmax is online, in base 2 (q is scaled by
// log2(e)); row groups merge in shared memory, splits as attn_decode's do
// (the last block to finish merges, counters reset after use).
#define DV_WARPS 4
#define DV_UNROLL 4
#define DV_UNIT 2048 // positions a work unit aims at (attn_decode_vec_impl)
#define DV_MAX_SPLITS 128 // the most splits attnDecode gives these kernels (decodeVecMaxSplits)
// DV_MIN_BLOCKS holds the kernels for one or two query heads a kv head to
// 128 registers, four blocks an SM: left free, the softmax over a step's
// rows at once took 130 and three blocks, and batch 1 at 32k positions
// ran 14 % slower instead of 3 % faster (H100, `bench attention`).
#define DV_MIN_BLOCKS(MG) ((MG) <= 2 ? 4 : 1)

// With RAW the queries and the newest K and V come straight from the qkv
// projection (raw), and the kernel does what prepare_qkv would have done
// for a decode step (per-head RMSNorm when qnorm is set, rotary
// embedding, in prepare_qkv16's 16-byte layout and so with its bits): each
// block prepares its own query heads, and the block whose split holds the
// newest position prepares that K and writes it and its V into the cache
// at slots[token], so a decode step launches one kernel where it launched
// two.
struct DecodeRaw {
	const bf16 *qnorm, *knorm; // null without the per-head norm
	const int *pos, *slots;
	const float *cos_t, *sin_t;
	float eps;
};

// DecodeRawStep is what a decode kernel preparing its own queries and
// newest K and V (RAW) reads before the wait, being step inputs: the
// rotation at the token's position and the norm weights at a lane's dims
// c8 of the 16-byte layout, and the newest position's slot.
struct DecodeRawStep {
	float cs[8], sn[8];
	uint4 qwa, qwb, kwa, kwb;
	long long new_slot;

	template <int D>
	__device__ __forceinline__ void load(const DecodeRaw &raw, long long row, int c8) {
		const long long p = raw.pos[row];
		load8f(raw.cos_t + p * (D / 2) + c8, cs);
		load8f(raw.sin_t + p * (D / 2) + c8, sn);
		qwa = qwb = kwa = kwb = make_uint4(0, 0, 0, 0);
		if (raw.qnorm) {
			qwa = *(const uint4 *)(raw.qnorm + c8);
			qwb = *(const uint4 *)(raw.qnorm + D / 2 + c8);
			kwa = *(const uint4 *)(raw.knorm + c8);
			kwb = *(const uint4 *)(raw.knorm + D / 2 + c8);
		}
		new_slot = raw.slots[row];
	}
};

// DecodeSplit is how a decode kernel cuts a sequence of kvlen positions:
// used splits of per positions (attn_decode_vec and attn_decode_gqa alike).
struct DecodeSplit {
	int per, used;
};

__device__ __forceinline__ DecodeSplit decode_split(const int *kvptr, int kvlen, int hk, int splits, int units,
                                                    int units_max, int min_split, int whole) {
	// A context of at most whole positions takes one split: no partials,
	// no election of a last block and no merge, which at short contexts cost
	// more than the split's positions (see decodeWhole).
	if (kvlen <= whole) return DecodeSplit{max(kvlen, 1), 1};
	// Splits of at least min_split positions; where a sequence's fair
	// share of the batch's work (over units blocks) is longer, it gets as
	// many splits as it holds shares (a remainder of three quarters counts
	// as one): equal contexts keep the splits they had, and a long one among
	// short ones is cut, so that no block runs far past the rest. Long
	// contexts raise the units towards units_max, a block for about every
	// DV_UNIT positions: a batch of more pairs than the GPU holds four
	// blocks an SM of, one block a pair, left SMs with four or five blocks
	// and few warps (H100, 71 x 8192 positions: 68% of HBM bandwidth).
	int per = max(min_split, (kvlen + splits - 1) / splits);
	int used = max(1, (kvlen + per - 1) / per);
	const long long total = (long long)(kvptr[gridDim.y] - kvptr[0]) * hk;
	const long long work = min((long long)units_max, max((long long)units, total / DV_UNIT));
	const long long share = (total + work - 1) / work;
	if (share > per) {
		used = (int)min((long long)splits, max(1LL, (kvlen + share / 4) / share));
		per = (kvlen + used - 1) / used;
	}
	return DecodeSplit{per, used};
}

// merge_splits is one output element of a (sequence, kv head) from its
// used splits (at most DV_FEW_SPLITS): load(j, m, l, o) gives split j's
// maximum, sum and partial output, all requested before any is used. It
// computes what the merge of more splits below does, in the same order,
// so both give the same bits. (Eight splits' worth of loads in flight gave
// the kernel 148 registers and three blocks an SM.)
#define DV_FEW_SPLITS 4
template <typename Load>
__device__ __forceinline__ float merge_splits(int used, Load load) {
	float mj[DV_FEW_SPLITS], lj[DV_FEW_SPLITS], oj[DV_FEW_SPLITS];
#pragma unroll
	for (int j = 0; j < DV_FEW_SPLITS; j++)
		if (j < used) load(j, mj[j], lj[j], oj[j]);
	float M = -EBB_INF;
#pragma unroll
	for (int j = 0; j < DV_FEW_SPLITS; j++)
		if (j < used) M = fmaxf(M, lj[j] > 0.f ? mj[j] : -EBB_INF);
	float L = 0.f;
#pragma unroll
	for (int j = 0; j < DV_FEW_SPLITS; j++) {
		if (j < used) {
			mj[j] = lj[j] > 0.f ? exp2f(mj[j] - M) : 0.f; // now split j's weight
			L += lj[j] * mj[j];
		}
	}
	const float inv = L > 0.f ? 1.f / L : 0.f;
	float acc = 0.f;
#pragma unroll
	for (int j = 0; j < DV_FEW_SPLITS; j++)
		if (j < used) acc += mj[j] * oj[j];
	return acc * inv;
}

// decode_block_store merges a block's groups (each a running max m, sum l
// and output o per query head, in shared memory as [groups][MG] and
// [groups][MG] rows of OS floats) and leaves the split's partials, or the
// answer for a sequence of one split, for query heads rh0..rh0+G-1. A
// row's group weights are worked out once, in place of its maxima in m
// (the caller has synchronised the block): worked out again for every
// element, they were most of the tensor-core kernel's epilogue at short
// contexts. The sums run over the groups in the same order as before, so
// the bits are the same.
template <int D, int MG, int OS = D>
__device__ __forceinline__ void decode_block_store(bf16 *out, float *part_o, float *part_ml, float *m, const float *l,
                                                   const float *o, int groups, long long rh0, int G, int splits,
                                                   int sp, int used) {
	__shared__ float sh_M[MG], sh_L[MG];
	if (threadIdx.x < G) {
		const int r = threadIdx.x;
		float M = -EBB_INF;
		for (int w = 0; w < groups; w++)
			if (l[w * MG + r] > 0.f) M = fmaxf(M, m[w * MG + r]);
		float L = 0.f;
		for (int w = 0; w < groups; w++) {
			if (l[w * MG + r] > 0.f) {
				const float f = exp2f(m[w * MG + r] - M);
				L += l[w * MG + r] * f;
				m[w * MG + r] = f;
			}
		}
		sh_M[r] = M, sh_L[r] = L;
	}
	__syncthreads();
	for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
		const int r = idx / D, dd = idx % D;
		float acc = 0.f;
		for (int w = 0; w < groups; w++)
			if (l[w * MG + r] > 0.f) acc += o[(w * MG + r) * OS + dd] * m[w * MG + r];
		split_store(out, part_o, part_ml, rh0 + r, splits, sp, used, D, dd, sh_M[r], sh_L[r], acc);
	}
}

// decode_merge: after every split of a (sequence, kv head) has left its
// partials (split_store), the last block to finish merges them into the
// output. Every thread of the block calls it.
template <int D, int MG>
__device__ __forceinline__ void decode_merge(bf16 *out, const float *part_o, const float *part_ml, int *counters,
                                             long long row, int hq, int hk, int s, int g, int splits, int used) {
	__shared__ int sh_last;
	const int G = hq / hk;
	if (used == 1 || !split_elect_last(&counters[s * hk + g], used, &sh_last)) return;
	if (used <= DV_FEW_SPLITS) {
		// Few splits: each thread requests all it needs at once, from two
		// base addresses with constant offsets.
		for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
			const int r = idx / D, dd = idx % D;
			const long long rh = row * hq + g * G + r;
			const float *ml = part_ml + rh * splits * 2, *po = part_o + rh * splits * D + dd;
			const float v = merge_splits(used, [&](int j, float &mj, float &lj, float &oj) {
				mj = __ldcg(ml + 2 * j);
				lj = __ldcg(ml + 2 * j + 1);
				oj = __ldcg(po + j * D);
			});
			out[rh * D + dd] = f2bf(v);
		}
		if (threadIdx.x == 0) counters[s * hk + g] = 0;
		return;
	}
	// The splits' maxima and sums come in once, in parallel; each split's
	// weight is then known, and every output element is one pass of
	// independent loads of the partials.
	__shared__ float sh_w[DV_MAX_SPLITS][MG], sh_sl[DV_MAX_SPLITS][MG], sh_inv[MG];
	for (int idx = threadIdx.x; idx < used * G; idx += blockDim.x) {
		const int j = idx / G, r = idx % G;
		const float *ml = part_ml + ((row * hq + g * G + r) * splits + j) * 2;
		const float lj = __ldcg(ml + 1);
		sh_w[j][r] = lj > 0.f ? __ldcg(ml) : -EBB_INF;
		sh_sl[j][r] = lj;
	}
	__syncthreads();
	if (threadIdx.x < G) {
		const int r = threadIdx.x;
		float M = -EBB_INF;
		for (int j = 0; j < used; j++) M = fmaxf(M, sh_w[j][r]);
		float L = 0.f;
		for (int j = 0; j < used; j++) {
			const float f = sh_sl[j][r] > 0.f ? exp2f(sh_w[j][r] - M) : 0.f;
			L += sh_sl[j][r] * f;
			sh_w[j][r] = f;
		}
		sh_inv[r] = L > 0.f ? 1.f / L : 0.f;
	}
	__syncthreads();
	// Each thread takes 4 output elements (16-byte loads) and, where the
	// block has more threads than the output has quads, its group of
	// threads a run of the splits; the groups' sums meet in shared memory
	// in group order. The merge runs alone at the end of the kernel, one
	// block a (sequence, kv head), so its loads must be many and wide: one
	// element a thread and a split at a time left 64 splits at 32k
	// positions slower than 32.
	__shared__ float4 sh_part[DV_WARPS * 32];
	const int nv = G * D / 4, groups = max(1, (int)blockDim.x / nv), run = (used + groups - 1) / groups;
	const int mgrp = threadIdx.x / nv;
	for (int v = groups == 1 ? threadIdx.x : threadIdx.x % nv; v < nv && mgrp < groups; v += groups == 1 ? blockDim.x : nv) {
		const int r = 4 * v / D;
		const long long rh = row * hq + g * G + r;
		const float *po = part_o + rh * splits * D + 4 * v % D;
		float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
		const int j1 = min(used, (mgrp + 1) * run);
#pragma unroll 8
		for (int j = mgrp * run; j < j1; j++) {
			const float4 o = __ldcg((const float4 *)(po + (long long)j * D));
			const float w = sh_w[j][r];
			acc.x += w * o.x, acc.y += w * o.y, acc.z += w * o.z, acc.w += w * o.w;
		}
		if (groups == 1) {
			const float inv = sh_inv[r];
			*(uint2 *)(out + rh * D + 4 * v % D) = make_uint2(bf16x2_pack(acc.x * inv, acc.y * inv), bf16x2_pack(acc.z * inv, acc.w * inv));
		} else {
			sh_part[threadIdx.x] = acc;
		}
	}
	if (groups > 1) {
		__syncthreads();
		if (threadIdx.x < nv) {
			const int v = threadIdx.x, r = 4 * v / D;
			float4 acc = sh_part[v];
			for (int k = 1; k < groups; k++) {
				const float4 o = sh_part[k * nv + v];
				acc.x += o.x, acc.y += o.y, acc.z += o.z, acc.w += o.w;
			}
			const float inv = sh_inv[r];
			const long long rh = row * hq + g * G + r;
			*(uint2 *)(out + rh * D + 4 * v % D) = make_uint2(bf16x2_pack(acc.x * inv, acc.y * inv), bf16x2_pack(acc.z * inv, acc.w * inv));
		}
	}
	if (threadIdx.x == 0) counters[s * hk + g] = 0;
}

template <int D, int MG, bool RAW>
__device__ __forceinline__ void attn_decode_vec_impl(bf16 *out, const bf16 *qkv, bf16 *kc, bf16 *vc, const int *qptr,
                                                     const int *kvptr, const int *kvidx, float *part_o,
                                                     float *part_ml, int *counters, int hq, int hk, int splits,
                                                     int units, int units_max, int min_split, int whole,
                                                     float scale, DecodeRaw raw) {
	constexpr int LPR = D / 8, RPW = 32 / LPR, GROUPS = DV_WARPS * RPW;
	__shared__ float sh_m[GROUPS][MG], sh_l[GROUPS][MG];
	__shared__ float sh_o[GROUPS][MG][D];
	// The kv heads of a sequence are adjacent in launch order, so a batch
	// whose decodes come longest first (as the scheduler orders them) starts
	// its longest blocks first and ends on short ones.
	const int g = blockIdx.x, s = blockIdx.y, sp = blockIdx.z;
	const int G = hq / hk, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const int sub = lane % LPR, grp = warp * RPW + lane / LPR;
	// The indices and every cached position but the newest were written
	// before this step's first kernel (the newest comes from the kernel
	// before this one): they are read, and the first rows of K and V
	// requested, before dep_wait, while the previous kernel finishes.
	const long long row = qptr[s];
	const int kv0 = kvptr[s], kvlen = kvptr[s + 1] - kv0;
	const DecodeSplit ds = decode_split(kvptr, kvlen, hk, splits, units, units_max, min_split, whole);
	const int per = ds.per, used = ds.used;
	if (sp >= used) {
		DEP();
		return;
	}
	const int c0 = sp * per, c1 = min(kvlen, c0 + per);
	const long long stride = (long long)(hq + 2 * hk) * D;
	const float qs = scale * LOG2E;
	// The loop bound is the same for a whole warp (its row groups differ by
	// lane), as the shuffles need every lane. Loads run one step ahead of
	// the arithmetic, so each warp keeps two steps of rows in flight.
	constexpr int STEP = GROUPS * DV_UNROLL;
	const int lrow = lane / LPR;
	uint4 kr[DV_UNROLL], vr[DV_UNROLL];
	// Every slot index is requested before any row, so that the rows'
	// loads wait for one round trip, not one each; in the loop a step's
	// slots are requested a step ahead of its rows (slots, fetch), so
	// that its rows wait for none.
	auto slots = [&](int cb, int lim, int *slot) {
#pragma unroll
		for (int u = 0; u < DV_UNROLL; u++) {
			const int pos = cb + lrow + u * GROUPS;
			slot[u] = pos < lim ? kvidx[kv0 + pos] : -1;
		}
	};
	auto fetch = [&](const int *slot, uint4 *kd, uint4 *vd) {
#pragma unroll
		for (int u = 0; u < DV_UNROLL; u++) {
			kd[u] = vd[u] = make_uint4(0, 0, 0, 0);
			if (slot[u] >= 0) {
				const long long base = ((long long)slot[u] * hk + g) * D + sub * 8;
				kd[u] = __ldcs((const uint4 *)(kc + base));
				vd[u] = __ldcs((const uint4 *)(vc + base));
			}
		}
	};
	{
		int slot[DV_UNROLL];
		slots(c0 + warp * RPW, min(c1, kvlen - 1), slot);
		fetch(slot, kr, vr);
	}
	// RAW: a lane holds dims c8..c8+7 of both halves of a head (the
	// 16-byte layout, so the two lanes sub and sub ^ HH hold the same) and
	// keeps the half at its own dims. The position's rotation, the norm
	// weights and the newest slot are step inputs, read before the wait.
	constexpr int HH = LPR / 2;
	const int c8 = 8 * (sub % HH);
	const bool upper = sub >= HH;
	DecodeRawStep rs{};
	if (RAW) rs.load<D>(raw, row, c8);
	// prepared returns the lane's 16 bytes of raw head h of the token,
	// normalised (with weights wa, wb) and rotated; every lane calls it.
	auto prepared = [&](int h, uint4 wa, uint4 wb) {
		const bf16 *x = qkv + row * stride + (long long)h * D;
		uint4 a = *(const uint4 *)(x + c8), b = *(const uint4 *)(x + D / 2 + c8);
		float inv = 0.f;
		if (raw.qnorm) {
			float af[8], bf[8];
			unpack8(a, af);
			unpack8(b, bf);
			inv = head_inv(af, bf, HH, D, raw.eps);
		}
		norm_rope8(a, b, raw.qnorm != nullptr, wa, wb, inv, rs.cs, rs.sn);
		return upper ? b : a;
	};
	DEP();
	if (c1 == kvlen && kvlen > 0) {
		uint4 kn = make_uint4(0, 0, 0, 0), vn = kn;
		if (RAW) {
			kn = prepared(hq + g, rs.kwa, rs.kwb);
			vn = *(const uint4 *)(qkv + row * stride + (long long)(hq + hk + g) * D + sub * 8);
			if (warp == 0 && lrow == 0) {
				const long long base = (rs.new_slot * hk + g) * D + sub * 8;
				*(uint4 *)(kc + base) = kn;
				*(uint4 *)(vc + base) = vn;
			}
		}
#pragma unroll
		for (int u = 0; u < DV_UNROLL; u++) {
			if (c0 + warp * RPW + lrow + u * GROUPS == kvlen - 1) {
				if (!RAW) {
					const long long base = ((long long)kvidx[kv0 + kvlen - 1] * hk + g) * D + sub * 8;
					kn = __ldcs((const uint4 *)(kc + base));
					vn = __ldcs((const uint4 *)(vc + base));
				}
				kr[u] = kn;
				vr[u] = vn;
			}
		}
		// The loop's later loads may read the newest row from the cache.
		if (RAW) __syncthreads();
	}
	float q[MG][8], o[MG][8], m[MG], l[MG];
#pragma unroll
	for (int r = 0; r < MG; r++) {
		m[r] = -EBB_INF;
		l[r] = 0.f;
		uint4 qv = make_uint4(0, 0, 0, 0);
		if (r < G)
			qv = RAW ? prepared(g * G + r, rs.qwa, rs.qwb)
			         : *(const uint4 *)(qkv + row * stride + (long long)(g * G + r) * D + sub * 8);
		unsigned qu[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
		for (int e = 0; e < 4; e++) {
			q[r][2 * e] = __uint_as_float(qu[e] << 16) * qs;
			q[r][2 * e + 1] = __uint_as_float(qu[e] & 0xffff0000u) * qs;
		}
#pragma unroll
		for (int e = 0; e < 8; e++) o[r][e] = 0.f;
	}
	int next[DV_UNROLL]; // the slots of the warp's next step
	slots(c0 + warp * RPW + STEP, c1, next);
	for (int cb = c0 + warp * RPW; cb < c1; cb += STEP) {
		uint4 kn[DV_UNROLL], vn[DV_UNROLL];
		fetch(next, kn, vn);
		slots(cb + 2 * STEP, c1, next);
		// One or two heads: the step's DV_UNROLL rows meet the running
		// softmax at once, one rescale of o and l a head, not one a row (a
		// row's p and the rescale each cost an ex2, and the rescale eight
		// multiplies; the kernel issues an instruction every other cycle at
		// long contexts, so fewer of them is time). More heads keep a row at
		// a time: the step's dots would add 16 or 32 registers to kernels
		// already past 128, and that was not measured.
		if constexpr (MG <= 2) {
			float dot[MG][DV_UNROLL];
#pragma unroll
			for (int u = 0; u < DV_UNROLL; u++) {
				float k[8];
				unpack8(kr[u], k);
#pragma unroll
				for (int r = 0; r < MG; r++) {
					float d = 0.f;
#pragma unroll
					for (int e = 0; e < 8; e++) d += q[r][e] * k[e];
#pragma unroll
					for (int off = LPR / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffff, d, off);
					dot[r][u] = d;
				}
			}
			// Rows past the split's end are left out; the first row of the step
			// is in it wherever any is.
			if (cb + lrow < c1) {
#pragma unroll
				for (int r = 0; r < MG; r++) {
					if (r >= G) continue;
					float mn = m[r];
#pragma unroll
					for (int u = 0; u < DV_UNROLL; u++)
						if (cb + lrow + u * GROUPS < c1) mn = fmaxf(mn, dot[r][u]);
					const float a = ex2_ftz(m[r] - mn);
					float ps = 0.f;
#pragma unroll
					for (int u = 0; u < DV_UNROLL; u++) {
						dot[r][u] = cb + lrow + u * GROUPS < c1 ? ex2_ftz(dot[r][u] - mn) : 0.f; // now the row's p
						ps += dot[r][u];
					}
					l[r] = l[r] * a + ps;
					m[r] = mn;
#pragma unroll
					for (int e = 0; e < 8; e++) o[r][e] *= a;
				}
#pragma unroll
				for (int u = 0; u < DV_UNROLL; u++) {
					float v[8];
					unpack8(vr[u], v);
#pragma unroll
					for (int r = 0; r < MG; r++)
						if (r < G)
#pragma unroll
							for (int e = 0; e < 8; e++) o[r][e] += dot[r][u] * v[e];
				}
			}
		} else {
#pragma unroll
			for (int u = 0; u < DV_UNROLL; u++) {
				const bool valid = cb + lrow + u * GROUPS < c1;
				float k[8], v[8];
				unpack8(kr[u], k);
				unpack8(vr[u], v);
#pragma unroll
				for (int r = 0; r < MG; r++) {
					float dot = 0.f;
#pragma unroll
					for (int e = 0; e < 8; e++) dot += q[r][e] * k[e];
#pragma unroll
					for (int off = LPR / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, off);
					if (valid && r < G) {
						const float mn = fmaxf(m[r], dot);
						const float a = ex2_ftz(m[r] - mn), p = ex2_ftz(dot - mn);
						l[r] = l[r] * a + p;
#pragma unroll
						for (int e = 0; e < 8; e++) o[r][e] = o[r][e] * a + p * v[e];
						m[r] = mn;
					}
				}
			}
		}
#pragma unroll
		for (int u = 0; u < DV_UNROLL; u++) {
			kr[u] = kn[u];
			vr[u] = vn[u];
		}
	}
#pragma unroll
	for (int r = 0; r < MG; r++) {
		if (sub == 0) {
			sh_m[grp][r] = m[r];
			sh_l[grp][r] = l[r];
		}
#pragma unroll
		for (int e = 0; e < 8; e++) sh_o[grp][r][sub * 8 + e] = o[r][e];
	}
	__syncthreads();
	decode_block_store<D, MG>(out, part_o, part_ml, &sh_m[0][0], &sh_l[0][0], &sh_o[0][0][0], GROUPS,
	                          row * hq + g * G, G, splits, sp, used);
	decode_merge<D, MG>(out, part_o, part_ml, counters, row, hq, hk, s, g, splits, used);
}

#define ATTN_DECODE_VEC(D, MG)                                                                                    \
	extern "C" __global__ void __launch_bounds__(DV_WARPS * 32, DV_MIN_BLOCKS(MG)) attn_decode_vec_d##D##_g##MG(  \
	    bf16 *out, const bf16 *qkv, bf16 *kc, bf16 *vc, const int *qptr, const int *kvptr, const int *kvidx,      \
	    float *part_o, float *part_ml, int *counters, int hq, int hk, int d, int splits, int units, int units_max, \
	    int min_split, int whole, float scale) {                                                                  \
		attn_decode_vec_impl<D, MG, false>(out, qkv, kc, vc, qptr, kvptr, kvidx, part_o, part_ml, counters, hq,   \
		                                   hk, splits, units, units_max, min_split, whole, scale, DecodeRaw{});   \
	}                                                                                                             \
	extern "C" __global__ void __launch_bounds__(DV_WARPS * 32, DV_MIN_BLOCKS(MG)) attn_decode_vec_raw_d##D##_g##MG( \
	    bf16 *out, const bf16 *qkv, bf16 *kc, bf16 *vc, const int *qptr, const int *kvptr, const int *kvidx,      \
	    float *part_o, float *part_ml, int *counters, int hq, int hk, int d, int splits, int units, int units_max, \
	    int min_split, int whole, float scale, const bf16 *qnorm, const bf16 *knorm, const int *pos,              \
	    const int *slots, const float *cos_t, const float *sin_t, float eps) {                                    \
		attn_decode_vec_impl<D, MG, true>(out, qkv, kc, vc, qptr, kvptr, kvidx, part_o, part_ml, counters, hq,    \
		                                  hk, splits, units, units_max, min_split, whole, scale,                  \
		                                  DecodeRaw{qnorm, knorm, pos, slots, cos_t, sin_t, eps});                \
	}
#define ATTN_DECODE_VEC_D(D) ATTN_DECODE_VEC(D, 1) ATTN_DECODE_VEC(D, 2) ATTN_DECODE_VEC(D, 4) ATTN_DECODE_VEC(D, 8)
ATTN_DECODE_VEC_D(32)
ATTN_DECODE_VEC_D(64)
ATTN_DECODE_VEC_D(128)
ATTN_DECODE_VEC_D(256)
