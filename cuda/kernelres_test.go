package cuda

import (
	"errors"
	"testing"
)

// TestKernelResources compiles two kernels to a CUBIN with NVRTC (skipped
// where there is none) and reads their registers, frames and static shared
// memory back: one that keeps a dynamically indexed array in local memory
// and a shared one, one that needs neither.
func TestKernelResources(t *testing.T) {
	if _, _, err := NVRTCVersion(); errors.Is(err, ErrNoLibrary) {
		t.Skip("no NVRTC on this machine:", err)
	}
	const src = `
extern "C" __global__ void plain(float *x) { x[threadIdx.x] *= 2.f; }
extern "C" __global__ void local_array(float *x, int i) {
	float a[256];
#pragma unroll 1
	for (int j = 0; j < 256; j++) a[j] = x[j * blockDim.x + threadIdx.x];
	a[i & 255] += 1.f;
	__shared__ float sh[300];
	sh[threadIdx.x] = a[i & 255];
	__syncthreads();
	float s = sh[(threadIdx.x + 1) % blockDim.x];
#pragma unroll 1
	for (int j = 0; j < 256; j++) s += a[j] * x[j];
	x[threadIdx.x] = s;
}
`
	cubin, err := Compile(src, "res.cu", "sm_80")
	if err != nil {
		t.Fatal(err)
	}
	res, err := KernelResources(cubin)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]KernelResource{}
	for _, r := range res {
		got[r.Name] = r
	}
	if len(res) != 2 || got["plain"].Registers == 0 || got["local_array"].Registers == 0 {
		t.Fatalf("kernels: %+v", res)
	}
	if got["plain"].Frame != 0 || got["local_array"].Frame < 256*4 {
		t.Errorf("frames: plain %d bytes, local_array %d (want 0 and at least 1,024)", got["plain"].Frame, got["local_array"].Frame)
	}
	if got["plain"].Shared != 0 || got["local_array"].Shared != 300*4 {
		t.Errorf("shared: plain %d bytes, local_array %d (want 0 and 1,200)", got["plain"].Shared, got["local_array"].Shared)
	}
}
