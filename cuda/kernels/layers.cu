// Elementwise and per-row kernels of the transformer layers. Storage is
// bf16, math is fp32, and results are rounded where transformers rounds (each
// bf16 tensor op), so outputs track transformers' bf16 forward closely.

// embedding: the table's rows are ids first..first+rows-1 (a rank's part
// of the vocabulary); other ids give zero rows.
extern "C" __global__ void embedding(bf16 *out, const bf16 *table, const int *ids, int hidden, int first, int rows) {
	DEP();
	const int r = ids[blockIdx.x] - first;
	const bool in = r >= 0 && r < rows;
	const bf16 *row = table + (long long)(in ? r : 0) * hidden;
	bf16 *o = out + (long long)blockIdx.x * hidden;
	if ((hidden & 7) == 0) {
		const uint4 *src = (const uint4 *)row;
		uint4 *dst = (uint4 *)o;
		for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) dst[i] = in ? src[i] : make_uint4(0, 0, 0, 0);
	} else {
		for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = in ? row[i] : (bf16)0;
	}
}

// Norms keep a row in registers (NORM_VPT values per thread, dim <=
// NORM_VPT * blockDim.x): one read of each operand, all issued up front.
#define NORM_VPT 8

// rmsnorm: one block per row; out may alias x.
extern "C" __global__ void rmsnorm(bf16 *out, const bf16 *x, const bf16 *w, int dim, float eps) {
	DEP();
	__shared__ float red[32];
	const bf16 *xr = x + (long long)blockIdx.x * dim;
	bf16 *o = out + (long long)blockIdx.x * dim;
	float v[NORM_VPT], wv[NORM_VPT];
	float ss = 0.f;
#pragma unroll
	for (int k = 0; k < NORM_VPT; k++) {
		int i = threadIdx.x + k * blockDim.x;
		v[k] = i < dim ? bf2f(xr[i]) : 0.f;
		wv[k] = i < dim ? bf2f(w[i]) : 0.f;
		ss += v[k] * v[k];
	}
	float inv = rsqrtf(block_sum(ss, red) / dim + eps);
#pragma unroll
	for (int k = 0; k < NORM_VPT; k++) {
		int i = threadIdx.x + k * blockDim.x;
		if (i < dim) o[i] = f2bf(wv[k] * rbf(v[k] * inv));
	}
}

// add_rmsnorm: residual += x (rounded to bf16), out = rmsnorm(residual).
// X is bf16, or float32 for tensor-parallel partial sums added up in float32
// (rounded to bf16 first, as one GPU's matmul output is).
__device__ __forceinline__ float x_value(const bf16 *x, long long i) { return bf2f(x[i]); }
__device__ __forceinline__ float x_value(const float *x, long long i) { return rbf(x[i]); }

template <typename X>
__device__ void add_rmsnorm_impl(bf16 *residual, const X *x, bf16 *out, const bf16 *w, int dim, float eps) {
	__shared__ float red[32];
	long long off = (long long)blockIdx.x * dim;
	bf16 *r = residual + off;
	const X *xr = x + off;
	bf16 *o = out + off;
	float v[NORM_VPT], wv[NORM_VPT];
	float ss = 0.f;
#pragma unroll
	for (int k = 0; k < NORM_VPT; k++) {
		int i = threadIdx.x + k * blockDim.x;
		v[k] = i < dim ? rbf(bf2f(r[i]) + x_value(xr, i)) : 0.f;
		wv[k] = i < dim ? bf2f(w[i]) : 0.f;
		ss += v[k] * v[k];
	}
	float inv = rsqrtf(block_sum(ss, red) / dim + eps);
#pragma unroll
	for (int k = 0; k < NORM_VPT; k++) {
		int i = threadIdx.x + k * blockDim.x;
		if (i < dim) {
			r[i] = f2bf(v[k]);
			o[i] = f2bf(wv[k] * rbf(v[k] * inv));
		}
	}
}

extern "C" __global__ void add_rmsnorm(bf16 *residual, const bf16 *x, bf16 *out, const bf16 *w, int dim, float eps) {
	DEP();
	add_rmsnorm_impl(residual, x, out, w, dim, eps);
}

extern "C" __global__ void add_rmsnorm_f32x(bf16 *residual, const float *x, bf16 *out, const bf16 *w, int dim, float eps) {
	DEP();
	add_rmsnorm_impl(residual, x, out, w, dim, eps);
}

// The _v8 norms read and write 16 bytes at a time (dim % 8 == 0, rows
// 16-byte aligned): thread t holds elements 8t..8t+7. The scalar kernels'
// two-byte loads held an 8k prefill chunk's norms to 2.1 TB/s; these reach
// 2.75 (H100).
__device__ __forceinline__ void load8x(const bf16 *p, float f[8]) { unpack8(*(const uint4 *)p, f); }
__device__ __forceinline__ void load8x(const float *p, float f[8]) {
	load8f(p, f);
#pragma unroll
	for (int e = 0; e < 8; e++) f[e] = rbf(f[e]);
}

// norm_loaded8 is norm_vals8 with the residual's 8 values at i (r) and the
// norm's weights (wv) already loaded, for a kernel that reads them before
// it waits for x.
__device__ __forceinline__ void norm_loaded8(bf16 *residual, uint4 r, float v[8], bf16 *out, uint4 wv, int dim,
                                             float eps, long long off, int i) {
	__shared__ float red[32];
	float wf[8];
	float ss = 0.f;
	if (i < dim) {
		if (residual) {
			float rf[8];
			unpack8(r, rf);
#pragma unroll
			for (int e = 0; e < 8; e++) v[e] = rbf(rf[e] + v[e]);
		}
		unpack8(wv, wf);
#pragma unroll
		for (int e = 0; e < 8; e++) ss += v[e] * v[e];
	}
	const float inv = rsqrtf(block_sum(ss, red) / dim + eps);
	if (i < dim) {
		if (residual) *(uint4 *)(residual + off + i) = pack8(v);
#pragma unroll
		for (int e = 0; e < 8; e++) wf[e] *= rbf(v[e] * inv);
		*(uint4 *)(out + off + i) = pack8(wf);
	}
}

// norm_vals8 is rmsnorm (residual null) or add_rmsnorm of row blockIdx.x
// (at off) from x's 8 values at i that this thread holds (i < dim).
__device__ __forceinline__ void norm_vals8(bf16 *residual, float v[8], bf16 *out, const bf16 *w, int dim, float eps,
                                           long long off, int i) {
	uint4 r = make_uint4(0, 0, 0, 0), wv = r;
	if (i < dim) {
		if (residual) r = *(const uint4 *)(residual + off + i);
		wv = *(const uint4 *)(w + i);
	}
	norm_loaded8(residual, r, v, out, wv, dim, eps, off, i);
}

// norm_row8 is rmsnorm (residual null) or add_rmsnorm of one row.
template <typename X>
__device__ __forceinline__ void norm_row8(bf16 *residual, const X *x, bf16 *out, const bf16 *w, int dim, float eps) {
	const long long off = (long long)blockIdx.x * dim;
	const int i = 8 * threadIdx.x;
	float v[8];
	if (i < dim) load8x(x + off + i, v);
	norm_vals8(residual, v, out, w, dim, eps, off, i);
}

extern "C" __global__ void rmsnorm_v8(bf16 *out, const bf16 *x, const bf16 *w, int dim, float eps) {
	DEP();
	norm_row8<bf16>(nullptr, x, out, w, dim, eps);
}

extern "C" __global__ void add_rmsnorm_v8(bf16 *residual, const bf16 *x, bf16 *out, const bf16 *w, int dim, float eps) {
	DEP();
	norm_row8(residual, x, out, w, dim, eps);
}

extern "C" __global__ void add_rmsnorm_f32x_v8(bf16 *residual, const float *x, bf16 *out, const bf16 *w, int dim,
                                               float eps) {
	DEP();
	norm_row8(residual, x, out, w, dim, eps);
}

// add_rmsnorm_parts_v8 is add_rmsnorm_v8 whose x it first forms (and
// stores) from a split product's planes of fp32 sums (matmul_wg's own
// sums, out_f32 2): added as the cluster adds its ranks, 0 + p0 + p1 +
// ..., and rounded as its store rounds them, so that x has the bits
// matmul_wg would have written.
#define NORM_MAX_PARTS 8 // MWG_MAX_CLUSTER
extern "C" __global__ void add_rmsnorm_parts_v8(bf16 *residual, const float *parts, int nparts, long long plane,
                                                bf16 *x, bf16 *out, const bf16 *w, int dim, float eps) {
	DEP();
	const long long off = (long long)blockIdx.x * dim;
	const int i = 8 * threadIdx.x;
	float v[8];
	if (i < dim) {
		// Every plane's values are requested before any is added.
		float4 p[NORM_MAX_PARTS][2];
#pragma unroll
		for (int s = 0; s < NORM_MAX_PARTS; s++)
			if (s < nparts) {
				const float4 *src = (const float4 *)(parts + s * plane + off + i);
				p[s][0] = __ldcg(src), p[s][1] = __ldcg(src + 1);
			}
#pragma unroll
		for (int e = 0; e < 8; e++) v[e] = 0.f;
#pragma unroll
		for (int s = 0; s < NORM_MAX_PARTS; s++)
			if (s < nparts) {
				v[0] += p[s][0].x, v[1] += p[s][0].y, v[2] += p[s][0].z, v[3] += p[s][0].w;
				v[4] += p[s][1].x, v[5] += p[s][1].y, v[6] += p[s][1].z, v[7] += p[s][1].w;
			}
#pragma unroll
		for (int e = 0; e < 8; e++) v[e] = rbf(v[e]);
		*(uint4 *)(x + off + i) = pack8(v); // the product, as MatMul leaves it
	}
	norm_vals8(residual, v, out, w, dim, eps, off, i);
}

// add_bias: x[row, j] += b[j] over rows of n.
extern "C" __global__ void add_bias(bf16 *x, const bf16 *b, long long total, int n) {
	DEP();
	FOR_GRID(i, total) x[i] = f2bf(bf2f(x[i]) + bf2f(b[i % n]));
}

// add_bias_f32 is add_bias for float32 outputs (logits).
extern "C" __global__ void add_bias_f32(float *x, const bf16 *b, long long total, int n) {
	DEP();
	FOR_GRID(i, total) x[i] += bf2f(b[i % n]);
}

// prepare_qkv: one warp per head of one token (blockIdx.x token,
// blockIdx.y * 4 + warp head; the fused row holds hq q heads, then hk k
// heads, then hk v heads): per-head RMSNorm of q and k when has_norm, rotary
// embedding of q and k (qk_norm_rope), written back in place for q and into
// the paged cache for k and v; only heads head0 + blockIdx.y * 4 + warp below
// hend. Lanes hold two adjacent pairs (j, j + d/2) and (j + 1, j + 1 + d/2),
// j even, read and written as bf16x2 (d % 4 == 0).
#define QKV_ROUNDS 2 // d <= 256

extern "C" __global__ void __launch_bounds__(128)
    prepare_qkv(bf16 *qkv, const bf16 *qnorm, const bf16 *knorm, const int *pos, const float *cos_t,
                const float *sin_t, bf16 *kc, bf16 *vc, const int *slots, int hq, int hk, int d, float eps,
                int has_norm, int head0, int hend) {
	DEP();
	const int t = blockIdx.x, lane = threadIdx.x & 31, half = d / 2;
	const int h = head0 + blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
	if (h >= hend) return;
	const long long p = pos[t], slot = slots[t];
	bf16 *v = qkv + ((long long)t * (hq + 2 * hk) + h) * d;
	// x1 holds dims j, j + 1 of the first half, x2 the same of the second.
	float x1[QKV_ROUNDS][2], x2[QKV_ROUNDS][2];
	float ss = 0.f;
#pragma unroll
	for (int i = 0; i < QKV_ROUNDS; i++) {
		const int j = 2 * (lane + 32 * i);
		x1[i][0] = x1[i][1] = x2[i][0] = x2[i][1] = 0.f;
		if (j < half) {
			bf16x2_unpack(*(const unsigned *)(v + j), x1[i][0], x1[i][1]);
			bf16x2_unpack(*(const unsigned *)(v + j + half), x2[i][0], x2[i][1]);
		}
		ss += pairs_sumsq(x1[i], x2[i]);
	}
	if (h < hq + hk) {
		const float inv = has_norm ? rsqrtf(warp_sum(ss) / d + eps) : 0.f;
#pragma unroll
		for (int i = 0; i < QKV_ROUNDS; i++) {
			const int j = 2 * (lane + 32 * i);
			if (j < half) {
				float w1[2], w2[2];
				norm_pairs(has_norm ? (h < hq ? qnorm : knorm) : nullptr, j, half, w1, w2);
				qk_norm_rope(x1[i], x2[i], has_norm, w1, w2, inv, *(const float2 *)(cos_t + p * half + j),
				             *(const float2 *)(sin_t + p * half + j));
				if (h < hq) {
					*(unsigned *)(v + j) = bf16x2_pack(x1[i][0], x1[i][1]);
					*(unsigned *)(v + j + half) = bf16x2_pack(x2[i][0], x2[i][1]);
				}
			}
		}
	}
	if (h >= hq) {
		const bool is_k = h < hq + hk;
		const int kvh = is_k ? h - hq : h - hq - hk;
		bf16 *dst = (is_k ? kc : vc) + (slot * hk + kvh) * d;
#pragma unroll
		for (int i = 0; i < QKV_ROUNDS; i++) {
			const int j = 2 * (lane + 32 * i);
			if (j < half) {
				*(unsigned *)(dst + j) = bf16x2_pack(x1[i][0], x1[i][1]);
				*(unsigned *)(dst + j + half) = bf16x2_pack(x2[i][0], x2[i][1]);
			}
		}
	}
}

// QkvHeads is what preparing a (token, head) unit of the qkv projection
// needs besides the unit: the per-head norms (has_norm), the caches, and
// the heads' counts and size.
struct QkvHeads {
	const bf16 *qnorm, *knorm;
	bf16 *kc, *vc;
	int hq, hk, d;
	float eps;
	int has_norm;
};

// QkvStep is the step inputs that preparing a unit reads: the tokens'
// positions and cache slots, and the rotation tables (half a head wide).
struct QkvStep {
	const int *pos, *slots;
	const float *cos_t, *sin_t;

	// load gives lane c of token t's unit of head h (t < 0: none) what
	// qkv16_finish takes of the step: the rotation at the token's position
	// (q and k heads) and its cache slot (k and v heads; 0 otherwise).
	__device__ __forceinline__ void load(int t, int h, int hq, int hk, int half, int c, float cs[8], float sn[8],
	                                     long long &slot) const {
		slot = 0;
		if (t < 0) return;
		if (h >= hq) slot = slots[t];
		if (h < hq + hk) {
			const long long p = pos[t];
			load8f(cos_t + p * half + 8 * c, cs);
			load8f(sin_t + p * half + 8 * c, sn);
		}
	}
};

// qkv16_finish prepares unit (token t, head h) in prepare_qkv16's 16-byte
// layout: the lane's raw dims 8c..8c+7 of each half in xa and xb (g = d/16
// lanes a unit), the rotation at the token's position in cs and sn (q and
// k heads), its cache slot (k and v heads). A q head goes back to the
// token's row of qkv, qrow; k and v to the caches. Every lane calls it
// (head_inv's shuffles); t < 0 marks a lane without a unit. prepare_qkv16
// and matmul_wg_part_qkv's epilogue share it, and with it their bits.
__device__ __forceinline__ void qkv16_finish(uint4 xa, uint4 xb, const float cs[8], const float sn[8], int t, int h,
                                             long long slot, bf16 *qrow, const QkvHeads &p, int c) {
	const int g = p.d / 16, half = p.d / 2;
	float inv = 0.f;
	if (p.has_norm) {
		float af[8], bf[8];
		unpack8(xa, af);
		unpack8(xb, bf);
		inv = head_inv(af, bf, g, p.d, p.eps);
	}
	if (t < 0) return;
	if (h < p.hq + p.hk) {
		uint4 wa = make_uint4(0, 0, 0, 0), wb = wa;
		if (p.has_norm) {
			const bf16 *w = h < p.hq ? p.qnorm : p.knorm;
			wa = *(const uint4 *)(w + 8 * c);
			wb = *(const uint4 *)(w + half + 8 * c);
		}
		norm_rope8(xa, xb, p.has_norm, wa, wb, inv, cs, sn);
	}
	bf16 *dst;
	if (h < p.hq) {
		dst = qrow + (long long)h * p.d;
	} else {
		const bool is_k = h < p.hq + p.hk;
		dst = (is_k ? p.kc : p.vc) + (slot * p.hk + (is_k ? h - p.hq : h - p.hq - p.hk)) * p.d;
	}
	*(uint4 *)(dst + 8 * c) = xa;
	*(uint4 *)(dst + half + 8 * c) = xb;
}

// prepare_qkv16 is prepare_qkv for d % 16 == 0 in the 16-byte layout
// (unpack8): each thread loads the 32 bytes of each of its QKV16_UNITS
// (token, head) units, and its cache slot, before any arithmetic, where
// prepare_qkv's lanes hold 8 bytes, so that a long prefill keeps enough
// loads in flight to run at bandwidth (a decode step, bound by latency, is
// faster with prepare_qkv's many small warps). Units run over tokens
// [0, tokens) and heads [head0, hend). One unit a thread: with the bf16x2
// arithmetic, more blocks an SM beat two units' loads in flight (8k chunk,
// H100: 30.4 -> 27.3 us a layer).
#define QKV16_UNITS 1 // qkv16Units in device.go
extern "C" __global__ void __launch_bounds__(128)
    prepare_qkv16(bf16 *qkv, const bf16 *qnorm, const bf16 *knorm, const int *pos, const float *cos_t,
                  const float *sin_t, bf16 *kc, bf16 *vc, const int *slots, int hq, int hk, int d, float eps,
                  int has_norm, int head0, int hend, int tokens) {
	DEP();
	const int g = d / 16, half = d / 2, nh = hend - head0, c = (threadIdx.x & 31) % g;
	const int per_pass = blockDim.x / g;
	const long long units = (long long)tokens * nh;
	const long long first = (long long)blockIdx.x * per_pass * QKV16_UNITS + threadIdx.x / g;
	uint4 xa[QKV16_UNITS], xb[QKV16_UNITS];
	float cs[QKV16_UNITS][8], sn[QKV16_UNITS][8];
	int tok[QKV16_UNITS], head[QKV16_UNITS];
	long long slot[QKV16_UNITS];
#pragma unroll
	for (int i = 0; i < QKV16_UNITS; i++) {
		const long long u = first + (long long)i * per_pass;
		const bool ok = u < units;
		tok[i] = ok ? (int)(u / nh) : -1;
		head[i] = head0 + (ok ? (int)(u % nh) : 0);
		xa[i] = xb[i] = make_uint4(0, 0, 0, 0);
		if (ok) {
			const bf16 *row = qkv + ((long long)tok[i] * (hq + 2 * hk) + head[i]) * d;
			xa[i] = *(const uint4 *)(row + 8 * c);
			xb[i] = *(const uint4 *)(row + half + 8 * c);
		}
		QkvStep{pos, slots, cos_t, sin_t}.load(tok[i], head[i], hq, hk, half, c, cs[i], sn[i], slot[i]);
	}
#pragma unroll
	for (int i = 0; i < QKV16_UNITS; i++)
		qkv16_finish(xa[i], xb[i], cs[i], sn[i], tok[i], head[i], slot[i], qkv + (long long)tok[i] * (hq + 2 * hk) * d,
		             QkvHeads{qnorm, knorm, kc, vc, hq, hk, d, eps, has_norm}, c);
}

// gemv computes out[m, n] = sum_k x[m, k] w[n, k] for a few rows m (M of
// them; built for one, as from two matmul_tc is faster) with 16-byte loads
// of both operands: a decode step at batch 1 is bound by reading the
// weights once. A group of wpo adjacent warps
// shares output n (or C outputs), each taking every wpo-th chunk of K, so
// that a narrow matrix (N of a thousand) still puts enough loads in flight
// on every SM. Grid (N / (C * 8 / wpo)), 256 threads. K is a multiple of 8.

// bf16x8_map applies f to the eight bf16 pairs of a and b, each giving a
// bf16.
template <typename F>
__device__ __forceinline__ uint4 bf16x8_map(uint4 a, uint4 b, F f) {
	const unsigned au[4] = {a.x, a.y, a.z, a.w}, bu[4] = {b.x, b.y, b.z, b.w};
	unsigned r[4];
#pragma unroll
	for (int e = 0; e < 4; e++) {
		const bf16 lo = f(__uint_as_float(au[e] << 16), __uint_as_float(bu[e] << 16));
		const bf16 hi = f(__uint_as_float(au[e] & 0xffff0000u), __uint_as_float(bu[e] & 0xffff0000u));
		r[e] = (unsigned)lo | ((unsigned)hi << 16);
	}
	return make_uint4(r[0], r[1], r[2], r[3]);
}

// silu_mul8 forms 8 activations silu(gate) * up, rounded as silu_mul does.
__device__ __forceinline__ uint4 silu_mul8(uint4 g, uint4 u) {
	return bf16x8_map(g, u, [](float gv, float uv) { return silu_mul1(gv, uv); });
}

// norm_pair is two elements of norm_w * rmsnorm(h) (bf16 pairs h and w),
// rounded as add_rmsnorm rounds them: h * inv to bf16, then the product
// with w, exact in fp32, rounded once (fma with -0: sm_80 and later).
__device__ __forceinline__ unsigned norm_pair(unsigned h, unsigned w, float inv) {
	unsigned y, r;
	asm("cvt.rn.bf16x2.f32 %0, %1, %2;"
	    : "=r"(y)
	    : "f"(__uint_as_float(h & 0xffff0000u) * inv), "f"(__uint_as_float(h << 16) * inv));
	asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(y), "r"(w), "r"(0x80008000u));
	return r;
}

// rmsnorm8 forms 8 inputs norm_w * rmsnorm(h) from h and its row's
// inverse root mean square (the normalising gemv, matmul_tc and matmul_wg).
__device__ __forceinline__ uint4 rmsnorm8(uint4 h, uint4 w, float inv) {
	return make_uint4(norm_pair(h.x, w.x, inv), norm_pair(h.y, w.y, inv), norm_pair(h.z, w.z, inv),
	                  norm_pair(h.w, w.w, inv));
}

// gemv_chunk adds one 16-byte chunk i of C weight rows times the rows of
// x (formed from gate and up with silu, or normalised with nw, a norm
// weight, and inv, each row's inverse root mean square): acc[c * M + m].
template <int M, int C>
__device__ __forceinline__ void gemv_chunk(float acc[C * M], const uint4 wv[C], const uint4 *xr, long long xstride,
                                           int kv, int i, int silu, const uint4 *nw, const float inv[M]) {
	uint4 nv = make_uint4(0, 0, 0, 0);
	if (nw) nv = __ldg(nw + i);
#pragma unroll
	for (int m = 0; m < M; m++) {
		uint4 xv = __ldg(xr + m * xstride + i);
		if (silu) xv = silu_mul8(xv, __ldg(xr + m * xstride + kv + i));
		else if (nw) xv = rmsnorm8(xv, nv, inv[m]);
		const unsigned xu[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
		for (int c = 0; c < C; c++) {
			const unsigned wu[4] = {wv[c].x, wv[c].y, wv[c].z, wv[c].w};
#pragma unroll
			for (int e = 0; e < 4; e++) {
				acc[c * M + m] += __uint_as_float(wu[e] << 16) * __uint_as_float(xu[e] << 16);
				acc[c * M + m] += __uint_as_float(wu[e] & 0xffff0000u) * __uint_as_float(xu[e] & 0xffff0000u);
			}
		}
	}
}

// Weight chunks per thread that gemv loads before it waits for the
// previous kernel (a 1024-wide row is 128 chunks, four warps' worth).
// Four measures best (H100, EBB_KERNEL_DEFINES=GEMV_PRELOAD=n, batch 1,
// ms a step: 0.6B 0.890 / 0.846 / 0.972 / 1.194 with 2 / 4 / 8 / 16, 8B
// 5.787 with 4, 6.487 with 8), likely because blocks that hold more of
// their weights while the previous kernel runs slow it more than they gain.
#ifndef GEMV_PRELOAD
#define GEMV_PRELOAD 4
#endif

// The normalising gemv asks for a thread's first GEMV_SQ_TOGETHER partial
// sums of squares together: one after another, as a plain loop does (not
// unrolled), the 512 parts that o_proj and down leave at every shape
// measured were two round trips between the wait and the first product.
// 0 is the loop. With GEMV_MIN_BLOCKS below, H200, batch 1 a step: 30B-A3B
// -0.42 %, 8B -0.31 %, 0.6B -1.14 % (without it -1.12 %, +3.08 %, -2.41 %).
// Taken with L1 prefetches of the residual and norm weights it lost 23 %.
#ifndef GEMV_SQ_TOGETHER
#define GEMV_SQ_TOGETHER 2
#endif

// gemv_group computes this thread's group's C outputs from n (valid while
// < N) and returns the sums to lane 0 of the group's first warp (part 0),
// sum[c * M + m]. With silu the rows of x are [gate | up], 2K wide, and the
// activation is formed on the fly. With norm_w, x is a residual row h that
// gemv_fused's squares mode left with nsq partial sums of its squares per
// row (sq), and the input is norm_w * rmsnorm(h), formed on the fly: with
// C columns per group each input chunk is formed once for C weight rows.
// Every thread of the block must call it. bx is the block's place in the
// grid of groups (blockIdx.x unless a block takes several in turn).
template <int M, int C>
__device__ __forceinline__ void gemv_group(float sum[C * M], const bf16 *x, const bf16 *w, int N, int K, int silu,
                                           int wpo, const bf16 *norm_w, const float *sq, int nsq, float eps, int glu,
                                           long long *n_out, int *part_out, int bx = -1) {
	constexpr int PRE = GEMV_PRELOAD / C;
	__shared__ float red[8][C * M];
	__shared__ float sq_red[32];
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const int part = warp % wpo;
	// With glu (C = 2) a group's columns are n and n + N/2: a gate and its
	// up; otherwise C adjacent columns from n.
	const long long group = (long long)(bx < 0 ? blockIdx.x : bx) * (8 / wpo) + warp / wpo;
	const long long n = glu ? group : group * C, cstride = glu ? N / 2 : 1;
	const int kv = K / 8, first = part * 32 + lane, step = 32 * wpo;
	const uint4 *wr[C];
#pragma unroll
	for (int c = 0; c < C; c++) wr[c] = (const uint4 *)(w + (n + c * cstride < N ? n + c * cstride : 0) * K);
	const uint4 *xr = (const uint4 *)x;
	const long long xstride = silu ? 2 * kv : kv;
	// The weights do not depend on earlier kernels: the first chunks are
	// loaded while the previous kernel finishes (dep_wait comes after).
	uint4 pre[PRE][C];
#pragma unroll
	for (int j = 0; j < PRE; j++) {
		const int i = first + j * step;
#pragma unroll
		for (int c = 0; c < C; c++)
			if (n * (1 + glu) < N && i < kv) pre[j][c] = __ldcs(wr[c] + i);
	}
	DEP();
	// Every block adds the partial sums in the same order: the rows'
	// scales are the same bits in every block.
	float inv[M];
	const uint4 *nw = (const uint4 *)norm_w;
#pragma unroll
	for (int m = 0; m < M; m++) {
		inv[m] = 0.f;
		if (norm_w) {
			float ss = 0.f;
			const float *row = sq + (long long)m * nsq;
			if (GEMV_SQ_TOGETHER) { // a thread's first n asked for together, added in the same order
				float v[GEMV_SQ_TOGETHER > 0 ? GEMV_SQ_TOGETHER : 1];
#pragma unroll
				for (int u = 0; u < GEMV_SQ_TOGETHER; u++) {
					const int j = threadIdx.x + u * blockDim.x;
					v[u] = j < nsq ? __ldcg(row + j) : 0.f;
				}
#pragma unroll
				for (int u = 0; u < GEMV_SQ_TOGETHER; u++)
					if (threadIdx.x + u * blockDim.x < nsq) ss += v[u];
				for (int j = threadIdx.x + GEMV_SQ_TOGETHER * blockDim.x; j < nsq; j += blockDim.x) ss += __ldcg(row + j);
			} else
				for (int j = threadIdx.x; j < nsq; j += blockDim.x) ss += __ldcg(row + j);
			inv[m] = rsqrtf(block_sum(ss, sq_red) / K + eps);
		}
	}
	float acc[C * M];
#pragma unroll
	for (int j = 0; j < C * M; j++) acc[j] = 0.f;
	if (n * (1 + glu) < N) {
#pragma unroll
		for (int j = 0; j < PRE; j++) {
			const int i = first + j * step;
			if (i < kv) gemv_chunk<M, C>(acc, pre[j], xr, xstride, kv, i, silu, nw, inv);
		}
#pragma unroll 4
		for (int i = first + PRE * step; i < kv; i += step) {
			uint4 wv[C];
#pragma unroll
			for (int c = 0; c < C; c++) wv[c] = __ldcs(wr[c] + i);
			gemv_chunk<M, C>(acc, wv, xr, xstride, kv, i, silu, nw, inv);
		}
	}
#pragma unroll
	for (int j = 0; j < C * M; j++) {
		const float s = warp_sum(acc[j]);
		if (lane == 0) red[warp][j] = s;
	}
	__syncthreads();
#pragma unroll
	for (int j = 0; j < C * M; j++) {
		sum[j] = 0.f;
		if (part == 0 && lane == 0)
			for (int p = 0; p < wpo; p++) sum[j] += red[warp + p][j];
	}
	*n_out = n;
	*part_out = part;
}

template <int M, int C>
__device__ void gemv_impl(void *out, int out_f32, const bf16 *x, const bf16 *w, int N, int K, int wpo,
                          const bf16 *norm_w, const float *sq, int nsq, float eps, int glu, int bx = -1) {
	float sum[C * M];
	long long n;
	int part;
	gemv_group<M, C>(sum, x, w, N, K, 0, wpo, norm_w, sq, nsq, eps, glu, &n, &part, bx);
	if (part != 0 || (threadIdx.x & 31) != 0) return;
	if (glu) {
		// out[m, n] = silu(gate) * up, both rounded to bf16 first, as the
		// matmul's output is before silu_mul reads it.
		const int half = N / 2;
		if (n >= half) return;
#pragma unroll
		for (int m = 0; m < M; m++) {
			const float g = rbf(sum[m]), u = rbf(sum[(C - 1) * M + m]);
			((bf16 *)out)[(long long)m * half + n] = silu_mul1(g, u);
		}
		return;
	}
#pragma unroll
	for (int c = 0; c < C; c++) {
		if (n + c >= N) break;
#pragma unroll
		for (int m = 0; m < M; m++) {
			if (out_f32) ((float *)out)[(long long)m * N + n + c] = sum[c * M + m];
			else ((bf16 *)out)[(long long)m * N + n + c] = f2bf(sum[c * M + m]);
		}
	}
}

// norm_w (null for a plain gemv), sq, nsq and eps: see gemv_group.
// gemv2_m* take two columns per warp group, for matrices so wide that
// one column each would fill the GPU with blocks; with glu, a gate and
// its up, and out is [M, N/2] of silu(gate) * up.
// GEMV_MIN_BLOCKS: blocks an SM the compiler must leave room for. The
// loop's 40 registers gave six; GEMV_SQ_TOGETHER's unrolled loads took
// gemv_m1 and gemv2_m1 to 48 (five), which cost the 8B shape's step 3 %
// and gained the 30B-A3B shape's 0.7 % against six. Likely the 8B's grids
// of more than five blocks an SM (gate and up, 1,536 blocks) want the
// sixth, where a grid of one wave at five (qkv: 320 blocks for the
// 30B-A3B shape, 384 for the 8B) has no use for it and pays its spills.
// The _one_wave kernels have no bound, for such grids (gemvShape).
#ifndef GEMV_MIN_BLOCKS
#define GEMV_MIN_BLOCKS 6
#endif
#define GEMV(M, C, NAME, BOUNDS)                                                                        \
	extern "C" __global__ void BOUNDS                                                                   \
	    NAME(void *out, int out_f32, const bf16 *x, const bf16 *w, int N, int K, int wpo,               \
	         const bf16 *norm_w, const float *sq, int nsq, float eps, int glu) {                        \
		gemv_impl<M, C>(out, out_f32, x, w, N, K, wpo, norm_w, sq, nsq, eps, glu);                    \
	}
GEMV(1, 1, gemv_m1, __launch_bounds__(256, GEMV_MIN_BLOCKS))
GEMV(1, 2, gemv2_m1, __launch_bounds__(256, GEMV_MIN_BLOCKS))
GEMV(1, 1, gemv_m1_one_wave, __launch_bounds__(256))
GEMV(1, 2, gemv2_m1_one_wave, __launch_bounds__(256))

// gemv_fused is gemv for M rows (built for one) with what decode does around it:
// with silu, the input rows are [gate | up] (2K wide) and the activation
// silu(gate) * up is formed on the fly (rounded as silu_mul does). Then
// either (sq null) the last block to finish adds out to residual and
// writes normed = rmsnorm(residual) * norm_w (as add_rmsnorm does), so
// neither needs a kernel of its own (counter is zero between launches);
// or (squares mode) each block adds its outputs to residual and leaves in
// sq[m * gridDim.x + block] the sum of their squares, from which the next
// gemv normalises residual as it reads it: no block waits for the others.
// out is not written in squares mode.
//
// Squares mode reads its columns of the residual before the wait (the
// kernels that wrote it finished before the one this kernel waits for let
// it launch), so that a block's last step adds to a value it holds rather
// than one it must ask for: batch 1 -0.7 % (8B) to -1.4 % (0.6B), H200.
template <int M>
__device__ void gemv_fused_impl(bf16 *out, const bf16 *x, const bf16 *w, int N, int K, int silu, int wpo,
                                bf16 *residual, bf16 *normed, const bf16 *norm_w, float eps, int *counter,
                                float *sq) {
	__shared__ float red[32];
	__shared__ float col_sq[8][M];
	__shared__ int last;
	float sum[M];
	long long n;
	int part;
	float res[M]; // squares mode: the owner's residual, read before the wait
	if (sq) {
		const int warp = threadIdx.x >> 5;
		const long long col = (long long)blockIdx.x * (8 / wpo) + warp / wpo; // gemv_group's n
		const bool own = warp % wpo == 0 && (threadIdx.x & 31) == 0 && col < N;
#pragma unroll
		for (int m = 0; m < M; m++) res[m] = own ? bf2f(residual[(long long)m * N + col]) : 0.f;
	}
	gemv_group<M, 1>(sum, x, w, N, K, silu, wpo, nullptr, nullptr, 0, 0.f, 0, &n, &part);
	const bool owner = part == 0 && (threadIdx.x & 31) == 0;
	if (sq) {
		if (owner) {
#pragma unroll
			for (int m = 0; m < M; m++) {
				float v = 0.f;
				if (n < N) {
					v = rbf(res[m] + rbf(sum[m]));
					residual[(long long)m * N + n] = f2bf(v);
				}
				col_sq[(threadIdx.x >> 5) / wpo][m] = v * v;
			}
		}
		__syncthreads();
		if (threadIdx.x < M) {
			float s = 0.f;
			for (int c = 0; c < 8 / wpo; c++) s += col_sq[c][threadIdx.x];
			sq[(long long)threadIdx.x * gridDim.x + blockIdx.x] = s;
		}
		return;
	}
	if (n < N && owner) {
#pragma unroll
		for (int m = 0; m < M; m++) out[(long long)m * N + n] = f2bf(sum[m]);
	}
	if (residual == 0) return;
	__threadfence();
	__syncthreads();
	if (threadIdx.x == 0) last = atomicAdd(counter, 1) == gridDim.x - 1;
	__syncthreads();
	if (!last) return;
	__threadfence();
	for (int m = 0; m < M; m++) {
		bf16 *r = residual + (long long)m * N;
		const bf16 *o = out + (long long)m * N;
		float ss = 0.f;
		for (int i = threadIdx.x; i < N; i += blockDim.x) {
			const float v = rbf(bf2f(r[i]) + bf2f(__ldcg(o + i)));
			ss += v * v;
		}
		const float inv = rsqrtf(block_sum(ss, red) / N + eps);
		for (int i = threadIdx.x; i < N; i += blockDim.x) {
			const float v = rbf(bf2f(r[i]) + bf2f(__ldcg(o + i)));
			normed[(long long)m * N + i] = f2bf(bf2f(norm_w[i]) * rbf(v * inv));
		}
		__syncthreads(); // every thread has read r before it changes
		for (int i = threadIdx.x; i < N; i += blockDim.x) r[i] = f2bf(rbf(bf2f(r[i]) + bf2f(__ldcg(o + i))));
	}
	if (threadIdx.x == 0) *counter = 0;
}

#define GEMV_FUSED(M)                                                                                          \
	extern "C" __global__ void __launch_bounds__(256) gemv_fused_m##M(bf16 *out, const bf16 *x, const bf16 *w, int N, \
	                                                                   int K, int silu, int wpo, bf16 *residual, \
	                                                                   bf16 *normed, const bf16 *norm_w,         \
	                                                                   float eps, int *counter, float *sq) {     \
		gemv_fused_impl<M>(out, x, w, N, K, silu, wpo, residual, normed, norm_w, eps, counter, sq);              \
	}
GEMV_FUSED(1)

// silu_mul: out = silu(gate) * up with gate_up rows [gate | up], rounded as
// transformers' act_fn(gate) * up in bf16. Grid-stride over rows * inter.
extern "C" __global__ void silu_mul(bf16 *out, const bf16 *gate_up, int inter, long long total) {
	DEP();
	FOR_GRID(i, total) {
		const long long r = i / inter, j = i % inter;
		float g = bf2f(gate_up[r * 2 * inter + j]), u = bf2f(gate_up[r * 2 * inter + inter + j]);
		out[i] = silu_mul1(g, u);
	}
}

// silu_mul_v8 is silu_mul eight elements at a time (inter % 8 == 0):
// prefill chunks are bandwidth-bound here.
extern "C" __global__ void silu_mul_v8(bf16 *out, const bf16 *gate_up, int inter8, long long total8) {
	DEP();
	FOR_GRID(i, total8) {
		const long long r = i / inter8, j = i % inter8;
		const uint4 *gu = (const uint4 *)gate_up + r * 2 * inter8;
		((uint4 *)out)[i] = silu_mul8(gu[j], gu[inter8 + j]);
	}
}

// gather_rows: out[i] = x[rows[i]] (bf16 rows of n).
extern "C" __global__ void gather_rows(bf16 *out, const bf16 *x, const int *rows, int n) {
	DEP();
	const bf16 *src = x + (long long)rows[blockIdx.x] * n;
	bf16 *dst = out + (long long)blockIdx.x * n;
	for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void fill_bf16(bf16 *x, long long n, float v) {
	DEP();
	bf16 b = f2bf(v);
	FOR_GRID(i, n) x[i] = b;
}

extern "C" __global__ void fill_f32(float *x, long long n, float v) {
	DEP();
	FOR_GRID(i, n) x[i] = v;
}

// uniform_at is device.UniformAt: splitmix64's i-th output, its top 24
// bits less 2^23, times step (one rounding, so the host's bits).
__device__ __forceinline__ float uniform_at(unsigned long long seed, unsigned long long i, float step) {
	unsigned long long z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	z ^= z >> 31;
	return __fmul_rn((float)((int)(z >> 40) - (1 << 23)), step);
}

// fill_uniform_* draw --load-format dummy's weights on the device.
extern "C" __global__ void fill_uniform_bf16(bf16 *x, long long n, unsigned long long seed, float step) {
	DEP();
	FOR_GRID(i, n) x[i] = f2bf(uniform_at(seed, i, step));
}

extern "C" __global__ void fill_uniform_f32(float *x, long long n, unsigned long long seed, float step) {
	DEP();
	FOR_GRID(i, n) x[i] = uniform_at(seed, i, step);
}

// bits_hash adds mix(i, p[i]) over n 32-bit words into *out, which the
// caller zeroes: a sum, so the order blocks finish in cannot change it.
// The GEMM tuner compares outputs with it (bitsHash is the CPU reference).
extern "C" __global__ void bits_hash(const unsigned *p, long long n, unsigned long long *out) {
	DEP();
	unsigned long long acc = 0;
	FOR_GRID(i, n) {
		const unsigned long long v = ((unsigned long long)p[i] << 32 | (unsigned)i) * 0x9E3779B97F4A7C15ull;
		acc += v ^ (v >> 29);
	}
	for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
	if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}

// f32_to_bf16 and bf16_to_f32 convert on the device (staging for uploads).
extern "C" __global__ void f32_to_bf16(bf16 *out, const float *in, long long n) {
	DEP();
	FOR_GRID(i, n) out[i] = f2bf(in[i]);
}

extern "C" __global__ void bf16_to_f32(float *out, const bf16 *in, long long n) {
	DEP();
	FOR_GRID(i, n) out[i] = bf2f(in[i]);
}

// bf16_to_f32_v8 is bf16_to_f32 eight elements at a time (n8 = n / 8,
// both 16-byte aligned): a prefill's logits are tens of megabytes.
extern "C" __global__ void bf16_to_f32_v8(float4 *out, const uint4 *in, long long n8) {
	DEP();
	FOR_GRID(i, n8) {
		float f[8];
		unpack8(in[i], f);
		out[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
		out[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
	}
}

// f16 sources (a trainer's float16 weights) convert through float32.
__device__ __forceinline__ float h2f(unsigned short x) {
	float f;
	asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
	return f;
}

extern "C" __global__ void f16_to_bf16(bf16 *out, const unsigned short *in, long long n) {
	DEP();
	FOR_GRID(i, n) out[i] = f2bf(h2f(in[i]));
}

extern "C" __global__ void f16_to_f32(float *out, const unsigned short *in, long long n) {
	DEP();
	FOR_GRID(i, n) out[i] = h2f(in[i]);
}
