// Sampling, penalties and logprobs over logits [rows, V] (float32 or bf16).
// The algorithm is device/cpu's (SampleRow): a token is the argmax of
// x/T + g over the kept tokens, g Gumbel noise from a hash of the row's key
// and the token id, so one pass over the row samples it and the same key
// gives the same token whatever else is in the batch. Filtering keeps the
// tokens whose scaled logit is at least a threshold (top_k: the k-th
// largest; top_p: where the descending mass passes top_p; min_p:
// m + log(min_p)), never by sorting the row. With top_k up to the block's
// threads (the models' own defaults, top_k 20 with top_p 0.95, among them)
// the k-th largest of the threads' maxima bounds the threshold from below,
// so one pass collects the few tokens above it and only those are sorted
// (sample_candidates); otherwise radix selection finds the thresholds.

#define SAMPLE_THREADS 1024
// SAMPLE_CANDIDATES bounds the tokens sample_candidates sorts; a row with
// more at or above the bound goes to radix selection.
#define SAMPLE_CANDIDATES 4096

struct ArgMax {
	float v;
	int i;
};

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
	if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
	return a;
}

// block_argmax: largest value, lowest index among equals. shared: 64 floats.
__device__ ArgMax block_argmax(ArgMax a, float *shared) {
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	for (int o = 16; o > 0; o >>= 1) {
		ArgMax b = {__shfl_xor_sync(0xffffffff, a.v, o), __shfl_xor_sync(0xffffffff, a.i, o)};
		a = better(a, b);
	}
	__syncthreads();
	if (lane == 0) {
		shared[warp] = a.v;
		((int *)shared)[32 + warp] = a.i;
	}
	__syncthreads();
	int nwarps = (blockDim.x + 31) >> 5;
	a.v = lane < nwarps ? shared[lane] : -EBB_INF;
	a.i = lane < nwarps ? ((int *)shared)[32 + lane] : 0x7fffffff;
	for (int o = 16; o > 0; o >>= 1) {
		ArgMax b = {__shfl_xor_sync(0xffffffff, a.v, o), __shfl_xor_sync(0xffffffff, a.i, o)};
		a = better(a, b);
	}
	return a;
}

// gumbel is the noise of token i for a row keyed (k0, k1): lowbias32 of the
// id mixed with the key, as a uniform in (0, 1), then -log(-log(u)).
// device/cpu's gumbel is the same function. u stays below 1: for the
// largest hash, h>>8 + 0.5 rounds to 2^24, which made u 1 and the noise
// +inf, so that token won whatever its logit (one row in 110 over a
// 151,936-token vocabulary).
// The outer logarithm runs on the MUFU (__logf): its argument, -log(u),
// lies in [6e-8, 17], where the approximation's absolute error (about
// 1e-7) is that of logf's rounding. The inner one stays logf: as u nears 1
// (the largest noise) its result must be accurate relative to itself,
// which lg2.approx's absolute error is not. H200, BenchmarkSample, 256
// rows of 151,936 bf16 logits: 162.2 -> 135.0 us; batch-256 decode steps,
// temperature 1, the same tokens: 0.6B shape 3.183 -> 3.173 ms, 30B-A3B
// 18.526 -> 18.480. EBB_KERNEL_DEFINES=SAMPLE_FAST_OUTER=0 restores logf
// for A/B runs.
#ifndef SAMPLE_FAST_OUTER
#define SAMPLE_FAST_OUTER 1
#endif
__device__ __forceinline__ float gumbel(unsigned k0, unsigned k1, int i) {
	unsigned h = ((unsigned)i * 0x9e3779b1u) ^ k0;
	h ^= h >> 16;
	h *= 0x7feb352du;
	h ^= h >> 15;
	h *= 0x846ca68bu;
	h ^= h >> 16;
	h ^= k1;
	h ^= h >> 16;
	h *= 0x7feb352du;
	h ^= h >> 15;
	h *= 0x846ca68bu;
	h ^= h >> 16;
	const float u = fminf(((float)(h >> 8) + 0.5f) * (1.f / 16777216.f), __int_as_float(0x3f7fffff));
	return SAMPLE_FAST_OUTER ? -__logf(-logf(u)) : -logf(-logf(u));
}

__device__ __forceinline__ float logit(const float *x, long long i) { return x[i]; }
__device__ __forceinline__ float logit(const bf16 *x, long long i) { return bf2f(x[i]); }
// logits_vec reads the 16 bytes of logits from i (16-byte aligned).
__device__ __forceinline__ void logits_vec(const float *x, long long i, float out[4]) {
	const float4 v = __ldg((const float4 *)(x + i));
	out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
__device__ __forceinline__ void logits_vec(const bf16 *x, long long i, float out[8]) {
	const uint4 v = __ldg((const uint4 *)(x + i));
	const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
	for (int e = 0; e < 4; e++) {
		out[2 * e] = __uint_as_float(u[e] << 16);
		out[2 * e + 1] = __uint_as_float(u[e] & 0xffff0000u);
	}
}

// logits_vecn reads VEC logits from i: 16 bytes, or for float32 in
// deterministic mode (VEC 8) two 16-byte loads.
template <int VEC>
__device__ __forceinline__ void logits_vecn(const float *x, long long i, float out[VEC]) {
	logits_vec(x, i, out);
	if constexpr (VEC == 8) logits_vec(x, i + 4, out + 4);
}
template <int VEC>
__device__ __forceinline__ void logits_vecn(const bf16 *x, long long i, float out[VEC]) {
	logits_vec(x, i, out);
}

// orderable maps a float to a uint32 that sorts like it.
__device__ __forceinline__ unsigned orderable(float f) {
	unsigned u = __float_as_uint(f);
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A row's parameters, as the kernels read them.
struct RowParams {
	float T;
	bool greedy, sampled;
	unsigned k0, k1;
};

// Without temperatures (temp null: token_logprobs_det) every row is greedy
// at temperature 1.
__device__ __forceinline__ RowParams row_params(int r, const float *temp, const int *top_k, const unsigned *keys) {
	RowParams p;
	if (!temp) {
		p.T = 1.f, p.greedy = true, p.sampled = false, p.k0 = p.k1 = 0;
		return p;
	}
	p.T = temp[r];
	p.greedy = p.T <= 0.f || top_k[r] == 1;
	if (p.T <= 0.f) p.T = 1.f;
	p.sampled = !p.greedy;
	p.k0 = keys[2 * r];
	p.k1 = keys[2 * r + 1];
	return p;
}

// scan_noise says whether sample_scan draws a sampled row's noise over the
// whole row. With SAMPLE_SCAN_TOPK set, a row with a top_k of at most
// SAMPLE_THREADS (Qwen3's generation_config: 20), whose candidates
// sample_finish collects anyway, takes its draw among them there: the
// scan's winner only lets finish skip that draw where the whole row's
// winner is kept, and the noise (a hash and two logarithms a logit) is most
// of the scan's time. The same token either way; at Qwen3's defaults it
// halves sampling's time at batch 256 (H200: 234 to 123 us), and
// EBB_KERNEL_DEFINES=SAMPLE_SCAN_TOPK=0 turns it off for an A/B run.
#ifndef SAMPLE_SCAN_TOPK
#define SAMPLE_SCAN_TOPK 1
#endif
__device__ __forceinline__ bool scan_noise(const RowParams &rp, int k, int V) {
	return rp.sampled && !(SAMPLE_SCAN_TOPK && k > 0 && k < V && k <= SAMPLE_THREADS);
}

// sample_scan reduces one slice of a row (blockIdx.y of gridDim.y): the
// largest scaled logit m, the sum of exp(x/T - m), and the winner: the
// lowest index of the largest logit (greedy rows, and sampled rows whose
// noise sample_finish draws: scan_noise) or of the largest x/T + g (other
// sampled rows). part[(row * parts + p) * 4 + {0..3}] =
// {m, sum, winner's value, winner's index as bits}. DET (deterministic
// inference) gives float32 and bf16 logits the same 8 values a load, so
// that a thread sums the same tokens in the same order from either.
template <typename T, bool DET = false>
__device__ void sample_scan_impl(const T *logits, int V, const float *temp, const int *top_k, const unsigned *keys,
                                 float *part) {
	__shared__ float shared[64];
	const int r = blockIdx.x, p = blockIdx.y, parts = gridDim.y;
	const T *x = logits + (long long)r * V;
	const RowParams rp = row_params(r, temp, top_k, keys);
	const bool noise = scan_noise(rp, temp ? top_k[r] : 0, V);
	const float inv = 1.f / rp.T;
	// Slices start on 16-byte boundaries where rows do, so that a thread
	// takes 16 bytes a load, two loads at a time: one scalar load in
	// flight per thread left the scan at a sixth of HBM bandwidth (batch
	// 256 decode, H100: 144 us for 78 MB of logits).
	constexpr int VEC = DET ? 8 : 16 / sizeof(T);
	const int len = ((V + parts - 1) / parts + VEC - 1) / VEC * VEC, lo = p * len, hi = min(V, lo + len);
	float m = -EBB_INF, z = 0.f;
	ArgMax best = {-EBB_INF, 0x7fffffff};
	auto take = [&](float raw, int i) {
		const float s = raw * inv;
		if (s > m) {
			z = z * __expf(m - s) + 1.f;
			m = s;
		} else if (s > -EBB_INF) {
			z += __expf(s - m);
		}
		const float v = noise ? s + gumbel(rp.k0, rp.k1, i) : s;
		best = better(best, ArgMax{v, i});
	};
	const int vend = V % VEC == 0 ? hi : lo, step = blockDim.x * VEC;
	for (int i = lo + threadIdx.x * VEC; i < vend; i += 2 * step) {
		float a[VEC], b[VEC];
		const bool two = i + step < vend;
		logits_vecn<VEC>(x, i, a);
		if (two) logits_vecn<VEC>(x, i + step, b);
#pragma unroll
		for (int e = 0; e < VEC; e++) take(a[e], i + e);
		if (two) {
#pragma unroll
			for (int e = 0; e < VEC; e++) take(b[e], i + step + e);
		}
	}
	for (int i = vend + threadIdx.x; i < hi; i += blockDim.x) take(logit(x, i), i);
	// Merge the threads' (m, z) pairs, then the winners.
	const float M = block_max(m, shared);
	z = m == -EBB_INF ? 0.f : z * __expf(m - M);
	z = block_sum(z, shared);
	best = block_argmax(best, shared);
	if (threadIdx.x == 0) {
		float *o = part + ((long long)r * parts + p) * 4;
		o[0] = M;
		o[1] = z;
		o[2] = best.v;
		o[3] = __int_as_float(best.i);
	}
}

// radix_select finds the key (orderable of x/T) at which keeping every
// token whose key is at least it first holds k tokens (by count) or more
// than `limit` of the mass (by_mass: mass of exp(x/T - m) in 2^-32 units,
// exact and order-independent), scanning the keys from the top in four
// passes of eight bits.
template <typename T>
__device__ unsigned radix_select(const T *x, int V, float inv, float m, bool by_mass, unsigned long long k_or_limit,
                                 unsigned long long *hist) {
	unsigned prefix = 0, mask = 0;
	unsigned long long above = 0;
	__shared__ unsigned sh_digit;
	__shared__ unsigned long long sh_above;
	for (int shift = 24; shift >= 0; shift -= 8) {
		for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
		__syncthreads();
		for (int i = threadIdx.x; i < V; i += blockDim.x) {
			const float s = logit(x, i) * inv;
			const unsigned key = orderable(s);
			if ((key & mask) == prefix) {
				const unsigned long long w = by_mass ? (unsigned long long)(__expf(s - m) * 4294967296.f) : 1ull;
				atomicAdd(&hist[(key >> shift) & 255], w);
			}
		}
		__syncthreads();
		if (threadIdx.x == 0) {
			unsigned long long cum = above;
			int d = 255;
			for (; d > 0; d--) {
				if (by_mass ? cum + hist[d] > k_or_limit : cum + hist[d] >= k_or_limit) break;
				cum += hist[d];
			}
			sh_digit = d;
			sh_above = cum;
		}
		__syncthreads();
		prefix |= sh_digit << shift;
		mask |= 0xffu << shift;
		above = sh_above;
	}
	return prefix;
}

// from_orderable inverts orderable.
__device__ __forceinline__ float from_orderable(unsigned k) {
	return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// bitonic_desc sorts n (a power of two) keys with their ids in shared
// memory, largest first and the lower id first among equals.
__device__ void bitonic_desc(unsigned *key, int *id, int n) {
	for (int size = 2; size <= n; size <<= 1) {
		for (int stride = size >> 1; stride > 0; stride >>= 1) {
			__syncthreads();
			for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
				const int i = 2 * stride * (t / stride) + t % stride, j = i + stride;
				const unsigned a = key[i], b = key[j];
				const int ia = id[i], ib = id[j];
				// Descending where bit `size` of i is clear, so that the last
				// merge (size n) leaves the whole run descending.
				const bool b_first = b > a || (b == a && ib < ia);
				if (b_first == ((i & size) == 0)) {
					key[i] = b, key[j] = a;
					id[i] = ib, id[j] = ia;
				}
			}
		}
	}
	__syncthreads();
}

// row_keys calls f(key, i) for the orderable key of every scaled logit of
// a row, each thread taking an interleaved share (16-byte loads where rows
// are whole loads), so that the shares partition the row.
template <typename T, typename F>
__device__ __forceinline__ void row_keys(const T *x, int V, float inv, F f) {
	constexpr int VEC = 16 / sizeof(T);
	if (V % VEC == 0) {
		for (int i = threadIdx.x * VEC; i < V; i += blockDim.x * VEC) {
			float a[VEC];
			logits_vec(x, i, a);
#pragma unroll
			for (int e = 0; e < VEC; e++) f(orderable(a[e] * inv), i + e);
		}
		return;
	}
	for (int i = threadIdx.x; i < V; i += blockDim.x) f(orderable(logit(x, i) * inv), i);
}

// sample_candidates finds the filtering threshold of a row with top_k k (at
// most blockDim.x) from its candidates: the k largest of the threads'
// maxima are k distinct tokens, so the k-th largest token is at least the
// k-th largest maximum L, and every token kept is among those at or above
// L. It collects them (ckey, cid; *count of them), sorts them and returns
// the largest of the top_k, top_p and min_p thresholds over that prefix of
// the row's descending order, or 0 where there are too many candidates.
template <typename T>
__device__ unsigned sample_candidates(const T *x, int V, float inv, float m, float Z, int k, float top_p,
                                      unsigned minp_key, unsigned *ckey, int *cid, int *count) {
	unsigned mx = 0; // below every key, orderable(-inf) included
	row_keys(x, V, inv, [&](unsigned key, int) { mx = max(mx, key); });
	ckey[threadIdx.x] = mx;
	cid[threadIdx.x] = threadIdx.x;
	bitonic_desc(ckey, cid, blockDim.x);
	const unsigned L = ckey[k - 1];
	__syncthreads();
	if (threadIdx.x == 0) *count = 0;
	__syncthreads();
	row_keys(x, V, inv, [&](unsigned key, int i) {
		if (key >= L) {
			const int p = atomicAdd(count, 1);
			if (p < SAMPLE_CANDIDATES) ckey[p] = key, cid[p] = i;
		}
	});
	__syncthreads();
	const int n = *count;
	if (n > SAMPLE_CANDIDATES) return 0;
	int np = 2;
	while (np < n) np <<= 1;
	for (int i = n + threadIdx.x; i < np; i += blockDim.x) ckey[i] = 0, cid[i] = 0x7fffffff;
	bitonic_desc(ckey, cid, np);
	unsigned thresh = max(minp_key, ckey[k - 1]);
	if (top_p < 1.f) {
		// The prefix of the row's descending order that the candidates are
		// holds the token where the mass passes top_p, unless it lies below
		// them and so below the top_k threshold anyway. Masses in 2^-32
		// units, as radix_select counts them: exact and order-free.
		__shared__ unsigned long long warp_mass[32];
		__shared__ unsigned p_key;
		const unsigned long long limit = (unsigned long long)((double)top_p * (double)Z * 4294967296.0);
		const int per = (n + blockDim.x - 1) / blockDim.x, lo = min((int)threadIdx.x * per, n), hi = min(lo + per, n);
		unsigned long long own = 0;
		for (int i = lo; i < hi; i++) own += (unsigned long long)(__expf(from_orderable(ckey[i]) - m) * 4294967296.f);
		// Inclusive scan of the threads' sums: within each warp, then over warps.
		const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
		unsigned long long incl = own;
		for (int o = 1; o < 32; o <<= 1) {
			const unsigned lo32 = __shfl_up_sync(0xffffffff, (unsigned)incl, o);
			const unsigned hi32 = __shfl_up_sync(0xffffffff, (unsigned)(incl >> 32), o);
			if (lane >= o) incl += ((unsigned long long)hi32 << 32) | lo32;
		}
		if (threadIdx.x == 0) p_key = 0;
		if (lane == 31) warp_mass[warp] = incl;
		__syncthreads();
		unsigned long long before = incl - own;
		for (int w = 0; w < warp; w++) before += warp_mass[w];
		for (int i = lo; i < hi; i++) {
			const unsigned long long mass = (unsigned long long)(__expf(from_orderable(ckey[i]) - m) * 4294967296.f);
			if (before <= limit && before + mass > limit) p_key = ckey[i]; // one token passes the limit
			before += mass;
		}
		__syncthreads();
		thresh = max(thresh, p_key);
	}
	return max(thresh, 1u); // 0 means too many candidates
}

// parts_lse merges a row's slices from sample_scan: its largest scaled
// logit m, the sum Z of exp(x/T - m) and their logsumexp. sample_finish
// and token_logprobs_det share it, so that in deterministic mode a token's
// logprob is the same bits whether it was sampled or scored as a prompt's.
__device__ __forceinline__ float parts_lse(const float *pr, int parts, float &m, float &Z) {
	m = -EBB_INF;
	for (int p = 0; p < parts; p++) m = fmaxf(m, pr[4 * p]);
	Z = 0.f;
	for (int p = 0; p < parts; p++)
		if (pr[4 * p + 1] > 0.f) Z = __fmaf_rn(pr[4 * p + 1], __expf(pr[4 * p] - m), Z);
	return __fadd_rn(m, logf(Z));
}

// sample_finish draws one token per row (one block per row) from the
// slices sample_scan reduced; filtered rows (top-k, top-p, min-p) find
// their threshold and take the winner among the kept tokens here.
template <typename T>
__device__ void sample_finish_impl(const T *logits, int V, const float *temp, const float *top_p, const int *top_k,
                                   const float *min_p, const unsigned *keys, int *out_ids, float *out_lp, int *top_ids,
                                   float *top_lps, int ntop, const float *part, int parts) {
	__shared__ float shared[64];
	__shared__ int chosen_top[64];
	__shared__ unsigned long long hist[256];
	__shared__ unsigned ckey[SAMPLE_CANDIDATES];
	__shared__ int cid[SAMPLE_CANDIDATES];
	__shared__ int ccount;
	const int r = blockIdx.x;
	const T *x = logits + (long long)r * V;
	const RowParams rp = row_params(r, temp, top_k, keys);
	const float inv = 1.f / rp.T;
	const float *pr = part + (long long)r * parts * 4;
	float m, Z;
	const float lse = parts_lse(pr, parts, m, Z);
	ArgMax best = {-EBB_INF, 0x7fffffff};
	for (int p = 0; p < parts; p++) best = better(best, ArgMax{pr[4 * p + 2], __float_as_int(pr[4 * p + 3])});
	if (best.i < 0 || best.i >= V) best.i = 0; // a row of -inf logits only
	const int k = top_k[r];
	const bool filtered = rp.sampled && ((k > 0 && k < V) || top_p[r] < 1.f || min_p[r] > 0.f);
	int id = best.i;
	if (filtered) {
		const unsigned minp_key = min_p[r] > 0.f ? orderable(m + logf(min_p[r])) : 0u;
		const bool topk = k > 0 && k < V;
		unsigned thresh = 0;
		int among = 0; // candidates holding every kept token (0: the whole row)
		if (topk && k <= (int)blockDim.x) {
			thresh = sample_candidates(x, V, inv, m, Z, k, top_p[r], minp_key, ckey, cid, &ccount);
			among = thresh ? ccount : 0;
		}
		if (thresh == 0) {
			thresh = minp_key;
			if (topk) thresh = max(thresh, radix_select(x, V, inv, m, false, (unsigned long long)k, hist));
			if (top_p[r] < 1.f) {
				const unsigned long long limit = (unsigned long long)((double)top_p[r] * (double)Z * 4294967296.0);
				thresh = max(thresh, radix_select(x, V, inv, m, true, limit, hist));
			}
		}
		// The whole row's winner, where the scan drew it and it is kept, is
		// the kept tokens' winner.
		if (!scan_noise(rp, k, V) || orderable(logit(x, id) * inv) < thresh) {
			ArgMax b = {-EBB_INF, 0x7fffffff};
			if (among > 0) {
				for (int c = threadIdx.x; c < among; c += blockDim.x) {
					if (ckey[c] >= thresh) b = better(b, ArgMax{from_orderable(ckey[c]) + gumbel(rp.k0, rp.k1, cid[c]), cid[c]});
				}
			} else {
				for (int i = threadIdx.x; i < V; i += blockDim.x) {
					const float s = logit(x, i) * inv;
					if (orderable(s) >= thresh) b = better(b, ArgMax{s + gumbel(rp.k0, rp.k1, i), i});
				}
			}
			id = block_argmax(b, shared).i;
		}
	}
	if (threadIdx.x == 0) {
		out_ids[r] = id;
		out_lp[r] = logit(x, id) * inv - lse;
	}
	// Top alternatives: repeated argmax, skipping those already chosen.
	for (int j = 0; j < ntop; j++) {
		ArgMax a = {-EBB_INF, 0x7fffffff};
		for (int i = threadIdx.x; i < V; i += blockDim.x) {
			bool taken = false;
			for (int q = 0; q < j; q++) taken |= chosen_top[q] == i;
			if (!taken) a = better(a, ArgMax{logit(x, i) * inv, i});
		}
		a = block_argmax(a, shared);
		if (threadIdx.x == 0) {
			chosen_top[j] = a.i;
			top_ids[(long long)r * ntop + j] = a.i;
			top_lps[(long long)r * ntop + j] = a.v - lse;
		}
		__syncthreads();
	}
}

#define SAMPLE_KERNELS(NAME, T)                                                                                  \
	extern "C" __global__ void __launch_bounds__(256) sample_scan_##NAME(const T *logits, int V, const float *temp, \
	                                                                     const int *top_k, const unsigned *keys,  \
	                                                                     float *part) {                           \
		DEP(); \
		sample_scan_impl<T>(logits, V, temp, top_k, keys, part);                                                   \
	}                                                                                                            \
	extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)                                                 \
	    sample_finish_##NAME(const T *logits, int V, const float *temp, const float *top_p, const int *top_k,      \
	                         const float *min_p, const unsigned *keys, int *out_ids, float *out_lp, int *top_ids,  \
	                         float *top_lps, int ntop, const float *part, int parts) {                             \
		DEP(); \
		sample_finish_impl<T>(logits, V, temp, top_p, top_k, min_p, keys, out_ids, out_lp, top_ids, top_lps, ntop, \
		                      part, parts);                                                                        \
	}
SAMPLE_KERNELS(f32, float)
SAMPLE_KERNELS(bf16, bf16)

// Deterministic inference: the scan with a fixed slice layout, whatever
// the logits' dtype (the host fixes the slices by vocabulary alone).
#define SAMPLE_SCAN_DET(NAME, T)                                                                                  \
	extern "C" __global__ void __launch_bounds__(256) sample_scan_det_##NAME(                                     \
	    const T *logits, int V, const float *temp, const int *top_k, const unsigned *keys, float *part) {          \
		DEP();                                                                                                     \
		sample_scan_impl<T, true>(logits, V, temp, top_k, keys, part);                                             \
	}
SAMPLE_SCAN_DET(f32, float)
SAMPLE_SCAN_DET(bf16, bf16)

// token_logprobs_det: out[r] = x[targets[r]] - the logsumexp of
// sample_scan_det's slices of row r, as sample_finish computes a sampled
// token's logprob at temperature 1.
extern "C" __global__ void token_logprobs_det(float *out, const float *logits, const int *targets, int V,
                                              const float *part, int parts, int rows) {
	DEP();
	const int r = blockIdx.x * blockDim.x + threadIdx.x;
	if (r >= rows) return;
	float m, Z;
	const float lse = parts_lse(part + (long long)r * parts * 4, parts, m, Z);
	out[r] = logits[(long long)r * V + targets[r]] * 1.f - lse;
}

extern "C" __global__ void apply_penalties(float *logits, int V, const int *rowptr, const int *toks, const int *counts,
                                           const float *bias, const float *rep, const float *freq, const float *pres) {
	DEP();
	const int r = blockIdx.x;
	float *row = logits + (long long)r * V;
	for (int j = rowptr[r] + threadIdx.x; j < rowptr[r + 1]; j += blockDim.x) {
		int t = toks[j];
		float x = row[t];
		if (rep[r] != 1.f) x = x > 0.f ? x / rep[r] : x * rep[r];
		if (counts[j] > 0) x -= (float)counts[j] * freq[r] + pres[r];
		row[t] = x + bias[j];
	}
}

extern "C" __global__ void token_logprobs(float *out, const float *logits, const int *targets, int V) {
	DEP();
	__shared__ float shared[64];
	const int r = blockIdx.x;
	const float *x = logits + (long long)r * V;
	float m = -EBB_INF;
	for (int i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, x[i]);
	m = block_max(m, shared);
	float z = 0.f;
	for (int i = threadIdx.x; i < V; i += blockDim.x) z += expf(x[i] - m);
	z = block_sum(z, shared);
	if (threadIdx.x == 0) out[r] = x[targets[r]] - m - logf(z);
}

// resolve_tokens: a decode step whose input tokens are the previous step's
// outputs, still on the device (overlapped scheduling): tokens[i] =
// prev[src[i]] where src[i] >= 0.
extern "C" __global__ void resolve_tokens(int *tokens, const int *src, const int *prev, int n) {
	DEP();
	const int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n && src[i] >= 0) tokens[i] = prev[src[i]];
}
