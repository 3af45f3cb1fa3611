package cuda

import (
	"errors"
	"testing"
)

// TestKernelResources compiles two kernels to a CUBIN with NVRTC (skipped
// where there is none) and reads their registers and frames back: one that
// keeps a dynamically indexed array in local memory, one that needs none.
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
	float s = 0.f;
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
}
