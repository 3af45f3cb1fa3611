package cuda

/*
#include "ebbcuda.h"
*/
import "C"

import "fmt"

// cuBLAS enums used here.
const (
	cublasOpN         = 0
	cublasOpT         = 1
	cudaR32F          = 0
	cudaR16BF         = 14
	cublasCompute32F  = 68
	cublasGemmDefault = -1
)

// blas is one cuBLAS handle bound to the context's stream, with its
// workspace in ebb's own memory so that nothing is allocated behind the
// engine's back and captured graphs find it at the same address.
type blas struct {
	h      C.cublasHandle_t
	ws     uintptr // the workspace, which cuBLASLt calls take explicitly
	wsSize int64
}

func newBLAS(c *Context, workspace uintptr, size int64) (*blas, error) {
	if err := loadCUBLAS(); err != nil {
		return nil, err
	}
	b := &blas{ws: workspace, wsSize: size}
	if r := C.ebb_cublasCreate(&b.h); r != 0 {
		return nil, fmt.Errorf("cublasCreate: status %d", int(r))
	}
	if r := C.ebb_cublasSetStream(b.h, c.stream); r != 0 {
		return nil, fmt.Errorf("cublasSetStream: status %d", int(r))
	}
	if r := C.ebb_cublas_set_workspace(b.h, C.CUdeviceptr(workspace), C.size_t(size)); r != 0 {
		return nil, fmt.Errorf("cublasSetWorkspace: status %d", int(r))
	}
	return b, nil
}

// gemm computes out[M,N] = x[M,K] @ w[N,K]^T (+ out when accumulate) with
// bf16 inputs, float32 accumulation and a bf16 or float32 output.
func (b *blas) gemm(out uintptr, outF32 bool, x, w uintptr, m, n, k int, accumulate bool) error {
	ct := C.int(cudaR16BF)
	if outF32 {
		ct = cudaR32F
	}
	beta := C.float(0)
	if accumulate {
		beta = 1
	}
	if r := C.ebb_gemm_bf16(b.h, C.int(m), C.int(n), C.int(k), C.CUdeviceptr(x), C.CUdeviceptr(w), C.CUdeviceptr(out), ct, beta); r != 0 {
		return fmt.Errorf("cublasGemmEx(m=%d n=%d k=%d): status %d", m, n, k, int(r))
	}
	return nil
}

func (b *blas) destroy() error {
	if r := C.ebb_cublasDestroy(b.h); r != 0 {
		return fmt.Errorf("cublasDestroy: status %d", int(r))
	}
	return nil
}
