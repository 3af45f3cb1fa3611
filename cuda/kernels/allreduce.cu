// Tensor-parallel all-reduce over peer memory (NVLink): every rank's
// staging buffers are mapped into every rank's address space, so one kernel
// adds the ranks' partial sums without NCCL. Its buffers are ebb's own
// memory, given back at release and mapped again at the same addresses on
// resume, so the decode graphs that hold these kernels stay valid.
//
// Block b of every rank handles the same element range, and waits only for
// block b of the other ranks: barriers pair blocks, not grids. Every call
// moves the group's call counter on by two (the last block to finish does),
// and consecutive calls use alternate staging halves, so a rank may start
// its next call while a slower peer still reads the previous one; it cannot
// be two calls ahead, since every call has a block 0 that waits for all.

#define AR_MAX_RANKS 8
#define AR_MAX_BLOCKS 256
#define AR_TABLE_BYTES 256

// ArPeers is one rank's view of the group (AR_TABLE_BYTES apart when a test
// runs several ranks in one grid, one per blockIdx.y).
struct ArPeers {
	float *stage[AR_MAX_RANKS];       // each rank's staging: 4 areas of stage_elems
	unsigned *signal[AR_MAX_RANKS];   // each rank's slots [AR_MAX_BLOCKS][AR_MAX_RANKS]
	unsigned *epoch;                  // this rank's call counter and blocks done
	int rank, nranks;
	long long stage_elems;
};

__device__ __forceinline__ void st_release_sys(unsigned *p, unsigned v) {
	asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned *p) {
	unsigned v;
	asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
	return v;
}

// ar_barrier: this block's writes become visible to block b of every rank,
// and theirs to it, once every rank's block b has reached value e.
__device__ __forceinline__ void ar_barrier(const ArPeers *t, unsigned e) {
	__syncthreads();
	if (threadIdx.x < t->nranks) {
		st_release_sys(t->signal[threadIdx.x] + blockIdx.x * AR_MAX_RANKS + t->rank, e);
		const unsigned *mine = t->signal[t->rank] + blockIdx.x * AR_MAX_RANKS + threadIdx.x;
		while ((int)(ld_acquire_sys(mine) - e) < 0) {
		}
	}
	__syncthreads();
}

// ar_begin waits for the kernels before (DEP) and reads the group's call
// counter; ar_end, in every block, moves it on by two once all blocks are
// done.
__device__ __forceinline__ unsigned ar_begin(const ArPeers *t) {
	__shared__ unsigned e0;
	DEP();
	if (threadIdx.x == 0) e0 = *(volatile unsigned *)t->epoch;
	__syncthreads();
	return e0;
}

__device__ __forceinline__ void ar_end(const ArPeers *t, unsigned e0) {
	__syncthreads();
	if (threadIdx.x == 0) {
		__threadfence();
		if (atomicAdd(t->epoch + 1, 1u) == gridDim.x - 1) {
			t->epoch[1] = 0;
			t->epoch[0] = e0 + 2;
		}
	}
}

template <typename V> struct ArVec;
template <> struct ArVec<float> {
	static __device__ __forceinline__ float load(const float *p) { return __ldcg(p); }
	static __device__ __forceinline__ void add(float &a, float b) { a += b; }
};
template <> struct ArVec<float4> {
	static __device__ __forceinline__ float4 load(const float4 *p) { return __ldcg(p); }
	static __device__ __forceinline__ void add(float4 &a, float4 b) {
		a.x += b.x;
		a.y += b.y;
		a.z += b.z;
		a.w += b.w;
	}
};

// ar_sum adds element i of every rank in rank order, so that every rank
// (and the CPU reference) gets the same bits; this rank's own value comes
// from its input.
template <typename V>
__device__ __forceinline__ V ar_sum(const ArPeers *t, long long area, const V *in, long long i) {
	V s = t->rank == 0 ? in[i] : ArVec<V>::load((const V *)(t->stage[0] + area) + i);
	for (int p = 1; p < t->nranks; p++) ArVec<V>::add(s, p == t->rank ? in[i] : ArVec<V>::load((const V *)(t->stage[p] + area) + i));
	return s;
}

// allreduce: out = sum over ranks of in, n floats (n a multiple of V's). out may be in. two_shot: each rank adds up 1/nranks
// of the block's range and the others copy it (less peer traffic for more
// than two ranks); otherwise every rank adds up everything.
template <typename V>
__device__ void allreduce(const ArPeers *tabs, const float *in_, float *out_, long long n, long long stride,
                          int two_shot) {
	const ArPeers *t = (const ArPeers *)((const char *)tabs + blockIdx.y * AR_TABLE_BYTES);
	const int units_per = sizeof(V) / sizeof(float);
	const V *in = (const V *)(in_ + blockIdx.y * stride);
	V *out = (V *)(out_ + blockIdx.y * stride);
	long long units = n / units_per;
	int R = t->nranks;
	const unsigned e0 = ar_begin(t);
	long long S = t->stage_elems;
	long long in_area = ((e0 >> 1) & 1) * 2 * S, out_area = in_area + S;
	V *mine = (V *)(t->stage[t->rank] + in_area);

	long long per = (units + gridDim.x - 1) / gridDim.x;
	long long lo = min(units, blockIdx.x * per), hi = min(units, lo + per);
	for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) mine[i] = in[i];
	if (!two_shot) {
		ar_barrier(t, e0 + 2);
		for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) out[i] = ar_sum<V>(t, in_area, in, i);
	} else {
		ar_barrier(t, e0 + 1);
		long long slice = (hi - lo + R - 1) / R;
		long long a = min(hi, lo + t->rank * slice), b = min(hi, a + slice);
		V *reduced = (V *)(t->stage[t->rank] + out_area);
		for (long long i = a + threadIdx.x; i < b; i += blockDim.x) {
			V s = ar_sum<V>(t, in_area, in, i);
			reduced[i] = s;
			out[i] = s;
		}
		ar_barrier(t, e0 + 2);
		for (int q = 0; q < R; q++) {
			if (q == t->rank) continue;
			const V *theirs = (const V *)(t->stage[q] + out_area);
			long long qa = min(hi, lo + q * slice), qb = min(hi, qa + slice);
			for (long long i = qa + threadIdx.x; i < qb; i += blockDim.x) out[i] = ArVec<V>::load(theirs + i);
		}
	}
	ar_end(t, e0);
}

// stride: elements between the tensors of the ranks a test runs in one grid
// (blockIdx.y); 0 otherwise.
extern "C" __global__ void allreduce_f32(const ArPeers *tabs, const float *in, float *out, long long n,
                                         long long stride, int two_shot) {
	allreduce<float>(tabs, in, out, n, stride, two_shot);
}

extern "C" __global__ void allreduce_f32_v4(const ArPeers *tabs, const float *in, float *out, long long n,
                                            long long stride, int two_shot) {
	allreduce<float4>(tabs, in, out, n, stride, two_shot);
}

// allreduce_add_rmsnorm: residual += the sum over ranks of the float32
// partial sums, out = rmsnorm(residual) * w, in one kernel: where a
// tensor-parallel layer's o_proj and down_proj partials meet in a small
// decode batch. The bits are allreduce's then add_rmsnorm_f32x_v8's (sum in
// rank order, rounded to bf16, added to the residual and rounded again).
// Rows of dim (dim % 8 == 0, 16-byte aligned): thread t holds elements
// 8t..8t+7 of a row, as the _v8 norms; block b takes rows b, b + gridDim.x,
// .... Each rank writes its partials into the others' staging (slot s of
// R - 1 for source rank s, skipping the owner: the R - 1 slots fill the
// call's two areas) and then reads only its own, so no load waits on the
// link: one-shot, every rank adds up every row. stride: elements between
// the ranks' tensors of a test's one grid (blockIdx.y); 0 otherwise.
__device__ __forceinline__ void ldcg8(const float *p, float f[8]) {
	const float4 lo = __ldcg((const float4 *)p), hi = __ldcg((const float4 *)(p + 4));
	f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w, f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
}

extern "C" __global__ void allreduce_add_rmsnorm(const ArPeers *tabs, const float *partial_, bf16 *residual_,
                                                 bf16 *out_, const bf16 *w, int rows, int dim, float eps,
                                                 long long stride) {
	__shared__ float red[32];
	const ArPeers *t = (const ArPeers *)((const char *)tabs + blockIdx.y * AR_TABLE_BYTES);
	const float *partial = partial_ + blockIdx.y * stride;
	bf16 *residual = residual_ + blockIdx.y * stride;
	bf16 *out = out_ + blockIdx.y * stride;
	const int i = 8 * threadIdx.x, R = t->nranks, me = t->rank;
	const long long n = (long long)rows * dim;
	const bool live = i < dim;
	const unsigned e0 = ar_begin(t);
	const long long area = ((e0 >> 1) & 1) * 2 * t->stage_elems;
	if (live)
		for (int row = blockIdx.x; row < rows; row += gridDim.x) {
			const long long off = (long long)row * dim + i;
			const float4 a = *(const float4 *)(partial + off), b = *(const float4 *)(partial + off + 4);
			for (int q = 0; q < R; q++) {
				if (q == me) continue;
				float *dst = t->stage[q] + area + (me - (me > q)) * n + off;
				*(float4 *)dst = a;
				*(float4 *)(dst + 4) = b;
			}
		}
	ar_barrier(t, e0 + 2);
	float wv[8];
	if (live) unpack8(*(const uint4 *)(w + i), wv);
	for (int row = blockIdx.x; row < rows; row += gridDim.x) {
		const long long off = (long long)row * dim + i;
		float v[8], ss = 0.f;
		if (live) {
			float s[8], q[8];
			for (int p = 0; p < R; p++) {
				if (p == me)
					load8f(partial + off, q);
				else
					ldcg8(t->stage[me] + area + (p - (p > me)) * n + off, q);
#pragma unroll
				for (int e = 0; e < 8; e++) s[e] = p == 0 ? q[e] : s[e] + q[e];
			}
			unpack8(*(const uint4 *)(residual + off), v);
#pragma unroll
			for (int e = 0; e < 8; e++) {
				v[e] = rbf(v[e] + rbf(s[e]));
				ss += v[e] * v[e];
			}
		}
		const float inv = rsqrtf(block_sum(ss, red) / dim + eps);
		if (live) {
			*(uint4 *)(residual + off) = pack8(v);
			float o[8];
#pragma unroll
			for (int e = 0; e < 8; e++) o[e] = wv[e] * rbf(v[e] * inv);
			*(uint4 *)(out + off) = pack8(o);
		}
	}
	ar_end(t, e0);
}

// allgather_cols: full[row][rank * cols + j] = that rank's local[row][j]
// (vocabulary-parallel logits), in units of V: cols and the row counts are
// in units, rows * cols of them fit two staging areas. Block b copies its
// range of local into its staging, meets block b of the others, then
// copies every rank's same range into its place in full.
template <typename V>
__device__ void allgather_cols(const ArPeers *tabs, const V *local, V *full, long long rows, long long cols,
                               long long local_stride, long long full_stride) {
	const ArPeers *t = (const ArPeers *)((const char *)tabs + blockIdx.y * AR_TABLE_BYTES);
	local += blockIdx.y * local_stride;
	full += blockIdx.y * full_stride;
	const int R = t->nranks;
	const unsigned e0 = ar_begin(t);
	const long long area = ((e0 >> 1) & 1) * 2 * t->stage_elems; // floats
	long long units = rows * cols, per = (units + gridDim.x - 1) / gridDim.x;
	long long lo = min(units, blockIdx.x * per), hi = min(units, lo + per);
	V *mine = (V *)(t->stage[t->rank] + area);
	for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) mine[i] = local[i];
	ar_barrier(t, e0 + 2);
	for (int q = 0; q < R; q++) {
		const V *theirs = (const V *)(t->stage[q] + area);
		for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
			const long long row = i / cols, j = i - row * cols;
			full[(row * R + q) * cols + j] = q == t->rank ? local[i] : __ldcg(theirs + i);
		}
	}
	ar_end(t, e0);
}

extern "C" __global__ void allgather_cols_u16(const ArPeers *tabs, const unsigned short *local, unsigned short *full,
                                              long long rows, long long cols, long long local_stride,
                                              long long full_stride) {
	allgather_cols<unsigned short>(tabs, local, full, rows, cols, local_stride, full_stride);
}

extern "C" __global__ void allgather_cols_v16(const ArPeers *tabs, const uint4 *local, uint4 *full, long long rows,
                                              long long cols, long long local_stride, long long full_stride) {
	allgather_cols<uint4>(tabs, local, full, rows, cols, local_stride, full_stride);
}

// copy_cols_u16: dst[row][off + j] = src[row][j], in 2-byte units; how the
// NCCL path lays a rank's logits into zeros before summing them.
extern "C" __global__ void copy_cols_u16(unsigned short *dst, const unsigned short *src, long long rows, long long cols,
                                         long long dst_cols, long long off) {
	DEP();
	FOR_GRID(i, rows * cols) {
		const long long row = i / cols;
		dst[row * dst_cols + off + i - row * cols] = src[i];
	}
}
