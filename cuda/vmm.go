package cuda

/*
#include "ebbcuda.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"time"
	"unsafe"

	"ebb/memory"
)

// VMM implements memory.Physical with CUDA virtual memory management:
// cuMemAddressReserve for address ranges, cuMemCreate + cuMemMap +
// cuMemSetAccess for physical backing, and the reverse to give it back.
type VMM struct {
	ctx  *Context
	prop C.CUmemAllocationProp
	gran int64
	// Timings accumulates time spent in each driver call, for diagnosis.
	Timings VMMTimings
}

// VMMTimings are cumulative durations of the mapping calls.
type VMMTimings struct {
	Create, Map, SetAccess, Unmap, Release time.Duration
}

var _ memory.Physical = (*VMM)(nil)

// NewVMM prepares allocations on the context's device.
func NewVMM(ctx *Context) (*VMM, error) {
	v := &VMM{ctx: ctx}
	v.prop._type = 1          // CU_MEM_ALLOCATION_TYPE_PINNED
	v.prop.location._type = 1 // CU_MEM_LOCATION_TYPE_DEVICE
	v.prop.location.id = C.int(ctx.Ordinal)
	var g C.size_t
	if err := check("cuMemGetAllocationGranularity", C.ebb_cuMemGetAllocationGranularity(&g, &v.prop, 0)); err != nil {
		return nil, err
	}
	v.gran = int64(g)
	return v, nil
}

// Granularity implements memory.Physical.
func (v *VMM) Granularity() int64 { return v.gran }

// Reserve implements memory.Physical.
func (v *VMM) Reserve(size int64) (uintptr, error) {
	var p C.CUdeviceptr
	if err := check("cuMemAddressReserve", C.ebb_cuMemAddressReserve(&p, C.size_t(size), 0, 0, 0)); err != nil {
		return 0, err
	}
	return uintptr(p), nil
}

// Unreserve implements memory.Physical.
func (v *VMM) Unreserve(va uintptr, size int64) error {
	return check("cuMemAddressFree", C.ebb_cuMemAddressFree(C.CUdeviceptr(va), C.size_t(size)))
}

// Map implements memory.Physical.
func (v *VMM) Map(va uintptr, size int64) (memory.Mapping, error) {
	var h C.CUmemGenericAllocationHandle
	t0 := time.Now()
	if err := check("cuMemCreate", C.ebb_cuMemCreate(&h, C.size_t(size), &v.prop, 0)); err != nil {
		return nil, err
	}
	t1 := time.Now()
	if err := check("cuMemMap", C.ebb_cuMemMap(C.CUdeviceptr(va), C.size_t(size), 0, h, 0)); err != nil {
		C.ebb_cuMemRelease(h)
		return nil, err
	}
	t2 := time.Now()
	access := C.CUmemAccessDesc{flags: 3} // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
	access.location = v.prop.location
	defer func() {
		t3 := time.Now()
		v.Timings.Create += t1.Sub(t0)
		v.Timings.Map += t2.Sub(t1)
		v.Timings.SetAccess += t3.Sub(t2)
	}()
	if err := check("cuMemSetAccess", C.ebb_cuMemSetAccess(C.CUdeviceptr(va), C.size_t(size), &access, 1)); err != nil {
		C.ebb_cuMemUnmap(C.CUdeviceptr(va), C.size_t(size))
		C.ebb_cuMemRelease(h)
		return nil, err
	}
	return h, nil
}

// Unmap implements memory.Physical.
func (v *VMM) Unmap(va uintptr, size int64, m memory.Mapping) error {
	h, ok := m.(C.CUmemGenericAllocationHandle)
	if !ok {
		return fmt.Errorf("unmap %#x: not a CUDA mapping", va)
	}
	t0 := time.Now()
	errU := check("cuMemUnmap", C.ebb_cuMemUnmap(C.CUdeviceptr(va), C.size_t(size)))
	t1 := time.Now()
	errR := check("cuMemRelease", C.ebb_cuMemRelease(h))
	v.Timings.Unmap += t1.Sub(t0)
	v.Timings.Release += time.Since(t1)
	return errors.Join(errU, errR)
}

// Synchronize implements memory.Physical.
func (v *VMM) Synchronize() error { return v.ctx.Synchronize() }

// pinned is page-locked host memory.
type pinned struct {
	p    unsafe.Pointer
	size int64
}

func (h *pinned) Len() int64 { return h.size }

func (h *pinned) Free() error {
	if h.p == nil {
		return nil
	}
	err := check("cuMemFreeHost", C.ebb_cuMemFreeHost(h.p))
	h.p = nil
	return err
}

// AllocHost implements memory.Physical.
func (v *VMM) AllocHost(size int64) (memory.HostBuffer, error) {
	var p unsafe.Pointer
	if err := check("cuMemHostAlloc", C.ebb_cuMemHostAlloc(&p, C.size_t(size), 1 /* portable */)); err != nil {
		return nil, err
	}
	return &pinned{p: p, size: size}, nil
}

// CopyToHost implements memory.Physical (queued; Synchronize waits).
func (v *VMM) CopyToHost(dst memory.HostBuffer, off int64, src uintptr, size int64) error {
	h := dst.(*pinned)
	return check("cuMemcpyDtoHAsync", C.ebb_cuMemcpyDtoHAsync(unsafe.Add(h.p, off), C.CUdeviceptr(src), C.size_t(size), v.ctx.stream))
}

// CopyFromHost implements memory.Physical (queued; Synchronize waits).
func (v *VMM) CopyFromHost(dst uintptr, src memory.HostBuffer, off int64, size int64) error {
	h := src.(*pinned)
	return check("cuMemcpyHtoDAsync", C.ebb_cuMemcpyHtoDAsync(C.CUdeviceptr(dst), unsafe.Add(h.p, off), C.size_t(size), v.ctx.stream))
}
