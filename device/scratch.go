package device

import "fmt"

// scratchAlign keeps every scratch tensor aligned for vector loads.
const scratchAlign = 256

// Scratch hands out tensors from one preallocated buffer, bump style, for
// the activations of a forward pass. Sizes are planned ahead (see
// ScratchPlan), so running out is a programming error.
type Scratch struct {
	base uintptr
	size int64
	off  int64
}

// NewScratch uses the bytes of buf.
func NewScratch(buf Tensor) *Scratch { return &Scratch{base: buf.Ptr, size: buf.Bytes()} }

// Take returns the next tensor.
func (s *Scratch) Take(dtype DType, shape ...int) Tensor {
	t := Tensor{Ptr: s.base + uintptr(s.off), DType: dtype, Shape: shape}
	s.off += alignUp(t.Bytes())
	if s.off > s.size {
		panic(fmt.Sprintf("scratch overflow: %d of %d bytes (planned sizes are wrong)", s.off, s.size))
	}
	return t
}

// Reset makes the whole buffer available again.
func (s *Scratch) Reset() { s.off = 0 }

func alignUp(n int64) int64 { return (n + scratchAlign - 1) / scratchAlign * scratchAlign }

// ScratchPlan adds up tensor sizes the way Scratch.Take lays them out.
type ScratchPlan int64

// Add accounts for one tensor.
func (p *ScratchPlan) Add(dtype DType, shape ...int) {
	*p += ScratchPlan(alignUp(Tensor{DType: dtype, Shape: shape}.Bytes()))
}
