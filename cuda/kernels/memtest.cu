// Kernels for `ebb selftest memory`.

// fill_pattern writes a position-dependent pattern that a later check can
// recompute.
extern "C" __global__ void fill_pattern(uint32_t *p, unsigned long long n, uint32_t seed) {
	DEP();
	for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
	     i += (unsigned long long)gridDim.x * blockDim.x) {
		uint32_t x = (uint32_t)i * 2654435761u ^ seed;
		p[i] = x ^ (x >> 15);
	}
}

// count_mismatch counts words that differ from fill_pattern's.
extern "C" __global__ void count_mismatch(const uint32_t *p, unsigned long long n, uint32_t seed,
                                          unsigned long long *bad) {
	DEP();
	unsigned long long local = 0;
	for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
	     i += (unsigned long long)gridDim.x * blockDim.x) {
		uint32_t x = (uint32_t)i * 2654435761u ^ seed;
		local += p[i] != (x ^ (x >> 15));
	}
	if (local) atomicAdd(bad, local);
}

// axpb is the work a captured graph replays: y = a*x + b.
extern "C" __global__ void axpb(float *y, const float *x, float a, float b, int n) {
	DEP();
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) y[i] = a * x[i] + b;
}
