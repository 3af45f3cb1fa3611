// Attention over the paged KV cache: K and V are bf16 [slots, hk, d].
// Sequence s owns query rows qptr[s]..qptr[s+1] of qkv (heads 0..hq-1 of the
// fused q|k|v rows) and the KV slots kvidx[kvptr[s]..kvptr[s+1]] in position
// order; its queries are the last positions of that range (causal).

#define ATT_WARPS 4

// attn_decode handles one query per sequence. Block (sequence, kv head,
// split); the query heads of one kv head (MG >= hq/hk) share each K/V row.
// Warps take KV positions in turn, lanes hold dims lane, lane+32, ... (DL of
// them), each warp keeps an online softmax that the block merges at the end.
// A sequence uses as many of the launched splits as give each at least
// DECODE_MIN_SPLIT positions; with more than one, every split writes a
// partial and the last one to finish (a counter per sequence and kv head,
// reset after use) merges them, so no second launch is needed.
#define DECODE_MIN_SPLIT 16

template <int MG, int DL>
__device__ void attn_decode_impl(bf16 *out, const bf16 *qkv, const bf16 *kc, const bf16 *vc, const int *qptr,
                                 const int *kvptr, const int *kvidx, float *part_o, float *part_ml, int *counters,
                                 int hq, int hk, int d, int splits, float scale) {
	__shared__ float sh_m[ATT_WARPS][MG], sh_l[ATT_WARPS][MG];
	__shared__ float sh_o[ATT_WARPS][MG][DL * 32];
	__shared__ int sh_last;
	const int s = blockIdx.x, g = blockIdx.y, sp = blockIdx.z;
	const int G = hq / hk, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const long long row = qptr[s];
	const int kv0 = kvptr[s], kvlen = kvptr[s + 1] - kv0;
	const int per = max(DECODE_MIN_SPLIT, (kvlen + splits - 1) / splits);
	const int used = max(1, (kvlen + per - 1) / per);
	if (sp >= used) return;
	const int c0 = sp * per, c1 = min(kvlen, c0 + per);
	const long long stride = (long long)(hq + 2 * hk) * d;
	float q[MG][DL], o[MG][DL], m[MG], l[MG];
#pragma unroll
	for (int r = 0; r < MG; r++) {
		m[r] = -EBB_INF;
		l[r] = 0.f;
#pragma unroll
		for (int i = 0; i < DL; i++) {
			int dd = lane + 32 * i;
			q[r][i] = (r < G && dd < d) ? bf2f(qkv[row * stride + (long long)(g * G + r) * d + dd]) * scale : 0.f;
			o[r][i] = 0.f;
		}
	}
	for (int c = c0 + warp; c < c1; c += ATT_WARPS) {
		long long base = ((long long)kvidx[kv0 + c] * hk + g) * d;
		float k[DL], v[DL];
#pragma unroll
		for (int i = 0; i < DL; i++) {
			int dd = lane + 32 * i;
			k[i] = dd < d ? bf2f(kc[base + dd]) : 0.f;
			v[i] = dd < d ? bf2f(vc[base + dd]) : 0.f;
		}
#pragma unroll
		for (int r = 0; r < MG; r++) {
			if (r < G) {
				float dot = 0.f;
#pragma unroll
				for (int i = 0; i < DL; i++) dot += q[r][i] * k[i];
				dot = warp_sum(dot);
				float mn = fmaxf(m[r], dot);
				float a = __expf(m[r] - mn), p = __expf(dot - mn);
				l[r] = l[r] * a + p;
#pragma unroll
				for (int i = 0; i < DL; i++) o[r][i] = o[r][i] * a + p * v[i];
				m[r] = mn;
			}
		}
	}
#pragma unroll
	for (int r = 0; r < MG; r++) {
		if (lane == 0) {
			sh_m[warp][r] = m[r];
			sh_l[warp][r] = l[r];
		}
#pragma unroll
		for (int i = 0; i < DL; i++) sh_o[warp][r][lane + 32 * i] = o[r][i];
	}
	__syncthreads();
	// Merge the warps: thread t handles (row r, dim dd) pairs.
	for (int idx = threadIdx.x; idx < G * d; idx += blockDim.x) {
		int r = idx / d, dd = idx % d;
		float M = -EBB_INF;
		for (int w = 0; w < ATT_WARPS; w++)
			if (sh_l[w][r] > 0.f) M = fmaxf(M, sh_m[w][r]);
		float L = 0.f, acc = 0.f;
		for (int w = 0; w < ATT_WARPS; w++) {
			if (sh_l[w][r] > 0.f) {
				float f = __expf(sh_m[w][r] - M);
				L += sh_l[w][r] * f;
				acc += sh_o[w][r][dd] * f;
			}
		}
		split_store(out, part_o, part_ml, row * hq + g * G + r, splits, sp, used, d, dd, M, L, acc);
	}
	// The last split of this (sequence, kv head) to finish merges.
	if (used == 1 || !split_elect_last(&counters[s * hk + g], used, &sh_last)) return;
	for (int idx = threadIdx.x; idx < G * d; idx += blockDim.x) {
		int r = idx / d, dd = idx % d;
		long long rh = row * hq + g * G + r;
		const float *ml = part_ml + rh * splits * 2;
		float M = -EBB_INF;
		for (int j = 0; j < used; j++)
			if (__ldcg(ml + 2 * j + 1) > 0.f) M = fmaxf(M, __ldcg(ml + 2 * j));
		float L = 0.f, acc = 0.f;
		for (int j = 0; j < used; j++) {
			float lj = __ldcg(ml + 2 * j + 1);
			if (lj > 0.f) {
				float f = __expf(__ldcg(ml + 2 * j) - M);
				L += lj * f;
				acc += __ldcg(part_o + (rh * splits + j) * d + dd) * f;
			}
		}
		out[rh * d + dd] = f2bf(L > 0.f ? acc / L : 0.f);
	}
	if (threadIdx.x == 0) counters[s * hk + g] = 0;
}

#define ATTN_DECODE(MG, DL)                                                                                    \
	extern "C" __global__ void __launch_bounds__(128) attn_decode_g##MG##_d##DL(                                  \
	    bf16 *out, const bf16 *qkv, const bf16 *kc, const bf16 *vc, const int *qptr, const int *kvptr,          \
	    const int *kvidx, float *part_o, float *part_ml, int *counters, int hq, int hk, int d, int splits,      \
	    float scale) {                                                                                         \
		DEP(); \
		attn_decode_impl<MG, DL>(out, qkv, kc, vc, qptr, kvptr, kvidx, part_o, part_ml, counters, hq, hk, d,  \
		                         splits, scale);                                                               \
	}
#define ATTN_DECODE_G(MG) ATTN_DECODE(MG, 1) ATTN_DECODE(MG, 2) ATTN_DECODE(MG, 4) ATTN_DECODE(MG, 8)
ATTN_DECODE_G(1)
ATTN_DECODE_G(2)
ATTN_DECODE_G(4)
ATTN_DECODE_G(8)
ATTN_DECODE(16, 1)
ATTN_DECODE(16, 2)
ATTN_DECODE(16, 4)

#define PF_ROWS 32 // query rows (query position x head) per block
#define PF_KC 32   // keys per chunk
// Shared rows are padded so that the rows a warp touches fall in different
// banks: q and o rows by 4 floats, K and V rows by one 4-byte word, scores
// by one float.
#define PF_QS(d) ((d) + 4)
#define PF_KS(d) ((d) + 2)
#define PF_PS (PF_KC + 1)

// attn_prefill handles any number of queries per sequence. Block (sequence,
// query tile of qt positions, kv head); its rows are the qt positions times
// the G query heads of the kv head (qt*G <= 32), four threads per row. Keys
// come in chunks of PF_KC through shared memory; softmax is online.
// Dynamic shared memory: prefillShared in Go.
extern "C" __global__ void __launch_bounds__(128) attn_prefill(bf16 *out, const bf16 *qkv, const bf16 *kc,
                                                               const bf16 *vc, const int *qptr, const int *kvptr,
                                                               const int *kvidx, int hq, int hk, int d, int qt,
                                                               float scale) {
	DEP();
	extern __shared__ float smem[];
	const int QS = PF_QS(d), KS = PF_KS(d);
	float *qs = smem;                          // [PF_ROWS][QS]
	float *os = qs + PF_ROWS * QS;             // [PF_ROWS][QS]
	float *ps = os + PF_ROWS * QS;             // [PF_ROWS][PF_PS]
	bf16 *ks = (bf16 *)(ps + PF_ROWS * PF_PS); // [PF_KC][KS]
	bf16 *vs = ks + PF_KC * KS;                // [PF_KC][KS]
	const int s = blockIdx.x, g = blockIdx.z, G = hq / hk;
	const int qbase = qptr[s], qlen = qptr[s + 1] - qbase;
	const int q0 = blockIdx.y * qt;
	if (q0 >= qlen) return;
	const int kv0 = kvptr[s], kvlen = kvptr[s + 1] - kv0;
	const int nq = min(qt, qlen - q0), R = nq * G;
	const int tid = threadIdx.x, r = tid >> 2, sub = tid & 3, warp = tid >> 5, lane = tid & 31;
	const bool active = r < R;
	const long long stride = (long long)(hq + 2 * hk) * d;
	const int qpos = kvlen - qlen + q0 + (active ? r / G : 0); // absolute position of this row's query
	const int head = g * G + (active ? r % G : 0);
	for (int rr = warp; rr < PF_ROWS; rr += 4) {
		const bf16 *src = qkv + (long long)(qbase + q0 + (rr < R ? rr / G : 0)) * stride + (long long)(g * G + rr % G) * d;
		for (int dd = lane; dd < d; dd += 32) {
			qs[rr * QS + dd] = rr < R ? bf2f(src[dd]) * scale : 0.f;
			os[rr * QS + dd] = 0.f;
		}
	}
	float m = -EBB_INF, l = 0.f;
	const int cend = kvlen - qlen + q0 + nq; // keys needed by the last query of the tile
	for (int c0 = 0; c0 < cend; c0 += PF_KC) {
		__syncthreads();
		for (int c = warp; c < PF_KC; c += 4) {
			bool in = c0 + c < cend;
			long long base = in ? ((long long)kvidx[kv0 + c0 + c] * hk + g) * d : 0;
			for (int dd = lane; dd < d; dd += 32) {
				ks[c * KS + dd] = in ? kc[base + dd] : (bf16)0;
				vs[c * KS + dd] = in ? vc[base + dd] : (bf16)0;
			}
		}
		__syncthreads();
		float sc[PF_KC / 4];
		float mx = -EBB_INF;
#pragma unroll
		for (int j = 0; j < PF_KC / 4; j++) {
			int c = sub + 4 * j, pos = c0 + c;
			float v = -EBB_INF;
			if (active && pos < cend && pos <= qpos) {
				const float *qr = qs + r * QS;
				const bf16 *kr = ks + c * KS;
				float dot = 0.f;
				for (int dd = 0; dd < d; dd++) dot += qr[dd] * bf2f(kr[dd]);
				v = dot;
			}
			sc[j] = v;
			mx = fmaxf(mx, v);
		}
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
		float mn = fmaxf(m, mx);
		float alpha = mn == -EBB_INF ? 1.f : __expf(m - mn);
		float psum = 0.f;
#pragma unroll
		for (int j = 0; j < PF_KC / 4; j++) {
			float p = sc[j] == -EBB_INF ? 0.f : __expf(sc[j] - mn);
			ps[r * PF_PS + sub + 4 * j] = p;
			psum += p;
		}
		psum += __shfl_xor_sync(0xffffffff, psum, 1);
		psum += __shfl_xor_sync(0xffffffff, psum, 2);
		l = l * alpha + psum;
		m = mn;
		__syncwarp();
		if (active) {
			const float *pr = ps + r * PF_PS;
			for (int dd = sub; dd < d; dd += 4) {
				float acc = os[r * QS + dd] * alpha;
#pragma unroll 8
				for (int c = 0; c < PF_KC; c++) acc += pr[c] * bf2f(vs[c * KS + dd]);
				os[r * QS + dd] = acc;
			}
		}
	}
	if (!active) return;
	long long orow = (long long)(qbase + q0 + r / G) * hq + head;
	for (int dd = sub; dd < d; dd += 4) out[orow * d + dd] = f2bf(l > 0.f ? os[r * QS + dd] / l : 0.f);
}
