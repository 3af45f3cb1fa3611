// Sampling, penalties and logprobs over float32 logits [rows, V]. One block
// of SAMPLE_THREADS threads per row. The algorithm is device/cpu's
// (SampleRow): see its comment for the exact rules this reproduces.

#define SAMPLE_THREADS 1024

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

// count_and_mass of p = exp(s - m) >= tau over the row.
__device__ void count_mass(const float *x, int V, float T, float m, float tau, float *shared,
                           float *count, float *mass) {
	float c = 0.f, z = 0.f;
	for (int i = threadIdx.x; i < V; i += blockDim.x) {
		float p = expf(x[i] / T - m);
		if (p >= tau) {
			c += 1.f;
			z += p;
		}
	}
	*count = block_sum(c, shared);
	*mass = block_sum(z, shared);
}

// sample_part reduces one slice of a row (blockIdx.y of gridDim.y slices):
// the largest scaled logit, its lowest index, and the sum of exp(x/T - max).
// part[(row * parts + p) * 3 + {0,1,2}] = {max, index (as bits), sum}.
extern "C" __global__ void __launch_bounds__(256)
    sample_part(const float *logits, int V, const float *temp, float *part) {
	__shared__ float shared[64];
	const int r = blockIdx.x, p = blockIdx.y, parts = gridDim.y;
	const float *x = logits + (long long)r * V;
	float T = temp[r] > 0.f ? temp[r] : 1.f;
	const int len = (V + parts - 1) / parts, lo = p * len, hi = min(V, lo + len);
	ArgMax best = {-EBB_INF, 0x7fffffff};
	for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) best = better(best, ArgMax{x[i] / T, i});
	best = block_argmax(best, shared);
	float z = 0.f;
	for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) z += expf(x[i] / T - best.v);
	z = block_sum(z, shared);
	if (threadIdx.x == 0) {
		float *o = part + ((long long)r * parts + p) * 3;
		o[0] = best.v;
		o[1] = __int_as_float(best.i);
		o[2] = z;
	}
}

// pick_in_range finds, in token-id order over [lo, hi), the first token
// with p = exp(x/T - m) >= tau whose cumulative p (starting at before)
// exceeds target; each thread owns a contiguous chunk. Returns -1 when
// rounding leaves the target past the end; last_kept gets the last token
// with p >= tau.
__device__ int pick_in_range(const float *x, int lo, int hi, float T, float m, float tau, float before, float target,
                             float *shared, float *scan, int *found, int *last_kept) {
	const int chunk = (hi - lo + blockDim.x - 1) / blockDim.x;
	const int b0 = lo + threadIdx.x * chunk, b1 = min(hi, b0 + chunk);
	float mine = 0.f;
	int last = -1;
	for (int i = b0; i < b1; i++) {
		float p = expf(x[i] / T - m);
		if (p >= tau) {
			mine += p;
			last = i;
		}
	}
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	float incl = mine;
	for (int o = 1; o < 32; o <<= 1) {
		float v = __shfl_up_sync(0xffffffff, incl, o);
		if (lane >= o) incl += v;
	}
	if (lane == 31) scan[warp] = incl;
	if (threadIdx.x == 0) *found = -1;
	__syncthreads();
	if (warp == 0) {
		float w = lane < (int)(blockDim.x >> 5) ? scan[lane] : 0.f;
		float wi = w;
		for (int o = 1; o < 32; o <<= 1) {
			float v = __shfl_up_sync(0xffffffff, wi, o);
			if (lane >= o) wi += v;
		}
		if (lane < (int)(blockDim.x >> 5)) scan[lane] = wi - w; // exclusive warp offsets
	}
	__syncthreads();
	float excl = __shfl_up_sync(0xffffffff, incl, 1);
	if (lane == 0) excl = 0.f;
	const float start = before + scan[warp] + excl;
	if (mine > 0.f && start <= target && target < start + mine) {
		float cum = start;
		int pick = last;
		for (int i = b0; i < b1; i++) {
			float p = expf(x[i] / T - m);
			if (p >= tau) {
				cum += p;
				if (cum > target) {
					pick = i;
					break;
				}
			}
		}
		atomicMax(found, pick);
	}
	ArgMax lk = {last >= 0 ? (float)last : -1.f, 0};
	lk = block_argmax(lk, shared);
	*last_kept = (int)lk.v;
	__syncthreads();
	return *found;
}

// sample draws one token per row (one block per row). With parts > 0 the
// row's max, argmax and normaliser come from sample_part; rows without
// top-k/top-p/min-p then only scan the slice their draw falls in.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample(const float *logits, int V, const float *temp, const float *top_p, const int *top_k, const float *min_p,
           const float *uniform, int *out_ids, float *out_lp, int *top_ids, float *top_lps, int ntop,
           const float *part, int parts) {
	__shared__ float shared[64];
	__shared__ int chosen_top[64];
	__shared__ float scan[SAMPLE_THREADS / 32];
	__shared__ int found;
	__shared__ float sh_before;
	__shared__ int sh_part;
	const int r = blockIdx.x;
	const float *x = logits + (long long)r * V;
	float T = temp[r];
	const int k = top_k[r];
	const bool greedy = T <= 0.f || k == 1;
	if (T <= 0.f) T = 1.f;
	const bool filtered = (k > 0 && k < V) || top_p[r] < 1.f || min_p[r] > 0.f;

	float m, Z;
	int argmax;
	if (parts > 0) {
		const float *pr = part + (long long)r * parts * 3;
		m = -EBB_INF;
		argmax = 0x7fffffff;
		for (int p = 0; p < parts; p++) {
			if (pr[3 * p] > m) { // parts are in index order: the first max is the lowest index
				m = pr[3 * p];
				argmax = __float_as_int(pr[3 * p + 1]);
			}
		}
		Z = 0.f;
		for (int p = 0; p < parts; p++) Z += pr[3 * p + 2] * expf(pr[3 * p] - m);
	} else {
		ArgMax best = {-EBB_INF, 0x7fffffff};
		for (int i = threadIdx.x; i < V; i += blockDim.x) best = better(best, ArgMax{x[i] / T, i});
		best = block_argmax(best, shared);
		m = best.v;
		argmax = best.i;
		float z = 0.f;
		for (int i = threadIdx.x; i < V; i += blockDim.x) z += expf(x[i] / T - m);
		Z = block_sum(z, shared);
	}
	const float lse = m + logf(Z);

	int id = argmax;
	if (!greedy) {
		int last_kept;
		if (!filtered && parts > 0) {
			// Find the slice holding the draw, then scan only it.
			if (threadIdx.x == 0) {
				const float *pr = part + (long long)r * parts * 3;
				const float target = uniform[r] * Z;
				float cum = 0.f;
				int q = parts - 1;
				for (int p = 0; p < parts; p++) {
					float sp = pr[3 * p + 2] * expf(pr[3 * p] - m);
					if (cum + sp > target) {
						q = p;
						break;
					}
					cum += sp;
				}
				sh_part = q;
				sh_before = cum;
			}
			__syncthreads();
			const int len = (V + parts - 1) / parts, lo = sh_part * len, hi = min(V, lo + len);
			id = pick_in_range(x, lo, hi, T, m, 0.f, sh_before, uniform[r] * Z, shared, scan, &found, &last_kept);
		} else {
			float tau = min_p[r] > 0.f ? min_p[r] : 0.f;
			float cnt, mass;
			if (k > 0 && k < V) {
				// Largest tau with count(p >= tau) >= k: bisection on the bits of
				// positive floats, which order like the floats.
				unsigned lo = 0, hi = 0x3f800001u;
				while (hi - lo > 1) {
					unsigned mid = lo + (hi - lo) / 2;
					count_mass(x, V, T, m, __uint_as_float(mid), shared, &cnt, &mass);
					if (cnt >= (float)k) lo = mid; else hi = mid;
				}
				tau = fmaxf(tau, __uint_as_float(lo));
			}
			if (top_p[r] < 1.f) {
				// Largest tau whose kept mass still exceeds top_p of the total.
				const float limit = top_p[r] * Z;
				unsigned lo = 0, hi = 0x3f800001u;
				while (hi - lo > 1) {
					unsigned mid = lo + (hi - lo) / 2;
					count_mass(x, V, T, m, __uint_as_float(mid), shared, &cnt, &mass);
					if (mass > limit) lo = mid; else hi = mid;
				}
				tau = fmaxf(tau, __uint_as_float(lo));
			}
			count_mass(x, V, T, m, tau, shared, &cnt, &mass);
			id = pick_in_range(x, 0, V, T, m, tau, 0.f, uniform[r] * mass, shared, scan, &found, &last_kept);
		}
		if (id < 0) id = last_kept; // rounding left the target past the end
	}
	if (threadIdx.x == 0) {
		out_ids[r] = id;
		out_lp[r] = x[id] / T - lse;
	}
	// Top alternatives: repeated argmax, skipping those already chosen.
	for (int j = 0; j < ntop; j++) {
		ArgMax a = {-EBB_INF, 0x7fffffff};
		for (int i = threadIdx.x; i < V; i += blockDim.x) {
			bool taken = false;
			for (int q = 0; q < j; q++) taken |= chosen_top[q] == i;
			if (!taken) a = better(a, ArgMax{x[i] / T, i});
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

extern "C" __global__ void apply_penalties(float *logits, int V, const int *rowptr, const int *toks, const int *counts,
                                           const float *bias, const float *rep, const float *freq, const float *pres) {
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
