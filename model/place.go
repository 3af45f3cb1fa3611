package model

import (
	"fmt"

	"ebb/device"
)

// HostPart is this rank's part of the checkpoint tensor data (row-major,
// elements of size bytes): all of it without tensor parallelism.
func (t Target) HostPart(data []byte, size int) []byte {
	return slice(data, t.Shape, size, t.Rows, t.Cols)
}

// Placer copies whole checkpoint tensors that are already on the device
// (a trainer's, shared or broadcast) into their targets, taking this
// rank's part. It keeps the gather indices of column blocks for reuse and
// frees its scratch at Close, after the device has finished with it.
type Placer struct {
	dev     device.Device
	scratch func(device.DType, int) (device.Tensor, error)
	free    func(device.Tensor)
	indices map[[3]int]device.Tensor
	temps   []device.Tensor
}

// NewPlacer places on dev, taking scratch memory from alloc and giving it
// back through free.
func NewPlacer(dev device.Device, alloc func(device.DType, int) (device.Tensor, error), free func(device.Tensor)) *Placer {
	return &Placer{dev: dev, scratch: alloc, free: free, indices: map[[3]int]device.Tensor{}}
}

// Place writes t's part of from (the checkpoint's shape, any float dtype)
// into t.Dst, converting the dtype. Rows of a shard are a contiguous block;
// a block of columns (o_proj, down_proj) is gathered: viewing [R, C] as
// [R*C/w, w] rows, row i's block is row i*C/w + from/w.
func (p *Placer) Place(t Target, from device.Tensor) error {
	if from.Numel() != t.numel() {
		return fmt.Errorf("%s: %d elements, want %v", t.Name, from.Numel(), t.Shape)
	}
	from = from.View(t.Shape...)
	if !t.Rows.whole() {
		from = from.Rows(t.Rows.from, t.Rows.to)
	}
	if t.Cols.whole() {
		p.copy(t.Dst, from.View(t.Dst.Shape...))
		return nil
	}
	if len(from.Shape) != 2 {
		return fmt.Errorf("%s: a block of columns of a %d-D tensor", t.Name, len(from.Shape))
	}
	r, c, w := from.Shape[0], from.Shape[1], t.Cols.to-t.Cols.from
	if c%w != 0 || t.Cols.from%w != 0 {
		return fmt.Errorf("%s: columns %d..%d of %v are not one of equal blocks", t.Name, t.Cols.from, t.Cols.to, from.Shape)
	}
	idx, err := p.index(r, c/w, t.Cols.from/w)
	if err != nil {
		return err
	}
	blocks := from.View(r*c/w, w)
	if from.DType == t.Dst.DType {
		p.dev.GatherRows(t.Dst.View(r, w), blocks, idx)
		return nil
	}
	tmp, err := p.scratch(from.DType, r*w)
	if err != nil {
		return err
	}
	p.temps = append(p.temps, tmp)
	p.dev.GatherRows(tmp.View(r, w), blocks, idx)
	p.dev.Convert(t.Dst, tmp.View(t.Dst.Shape...))
	// A full-size conversion buffer per tensor would add up: wait for
	// this one, then reuse the memory.
	if err := p.dev.Sync(); err != nil {
		return err
	}
	p.release()
	return nil
}

func (p *Placer) copy(dst, src device.Tensor) {
	if src.DType == dst.DType {
		p.dev.Copy(dst, src)
	} else {
		p.dev.Convert(dst, src)
	}
}

// index is the row list r rows of stride blocks starting at block first.
func (p *Placer) index(rows, stride, first int) (device.Tensor, error) {
	key := [3]int{rows, stride, first}
	if t, ok := p.indices[key]; ok {
		return t, nil
	}
	v := make([]int32, rows)
	for i := range v {
		v[i] = int32(i*stride + first)
	}
	t, err := p.scratch(device.I32, rows)
	if err != nil {
		return t, err
	}
	if err := p.dev.Upload(t, I32Bytes(v), device.I32); err != nil {
		p.free(t)
		return device.Tensor{}, err
	}
	p.indices[key] = t
	return t, nil
}

func (p *Placer) release() {
	for _, t := range p.temps {
		p.free(t)
	}
	p.temps = nil
}

// Close waits for the device and frees the scratch.
func (p *Placer) Close() error {
	err := p.dev.Sync()
	p.release()
	for k, t := range p.indices {
		p.free(t)
		delete(p.indices, k)
	}
	return err
}

func (t Target) numel() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}
