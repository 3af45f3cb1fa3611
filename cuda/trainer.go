package cuda

import (
	"errors"
	"fmt"
)

// TrainerReport is what the trainer stand-in managed to take.
type TrainerReport struct {
	BareContextBytes int64 `json:"bare_context_bytes"` // NVML, this process, right after context creation
	DriverFreeBefore int64 `json:"driver_free_before"` // cuMemGetInfo before allocating
	AllocatedBytes   int64 `json:"allocated_bytes"`    // what it could map and write
}

// FillAsTrainer stands in for a trainer sharing GPU ordinal: it takes all
// the device memory it can (1 GiB pieces, then 64 MiB, then 2 MiB), writes
// it, calls hold (while the memory is held: a caller can measure it), and
// gives it back.
func FillAsTrainer(ordinal int, hold func(*TrainerReport)) (*TrainerReport, error) {
	ctx, err := Open(ordinal)
	if err != nil {
		return nil, err
	}
	defer ctx.Close()
	rep := &TrainerReport{BareContextBytes: -1}
	if nv, err := OpenNVML(ctx); err == nil {
		if r, err := nv.Read(); err == nil {
			rep.BareContextBytes = r.ProcessBytes
		}
	}
	if rep.DriverFreeBefore, _, err = ctx.MemInfo(); err != nil {
		return nil, err
	}
	v, err := NewVMM(ctx)
	if err != nil {
		return nil, err
	}
	type piece struct {
		va   uintptr
		size int64
		m    any
	}
	var pieces []piece
	defer func() {
		for _, p := range pieces {
			_ = v.Unmap(p.va, p.size, p.m)
			_ = v.Unreserve(p.va, p.size)
		}
	}()
	for _, size := range []int64{1 << 30, 64 << 20, v.Granularity()} {
		for {
			va, err := v.Reserve(size)
			if err != nil {
				return nil, fmt.Errorf("reserve: %w", err)
			}
			m, err := v.Map(va, size)
			if err != nil {
				_ = v.Unreserve(va, size)
				var ce *Error
				if errors.As(err, &ce) && ce.Name == "CUDA_ERROR_OUT_OF_MEMORY" {
					break
				}
				return nil, err
			}
			pieces = append(pieces, piece{va, size, m})
			if err := ctx.MemsetD32(va, 0x5a5a5a5a, size/4); err != nil {
				return nil, err
			}
			rep.AllocatedBytes += size
		}
	}
	if err := ctx.Synchronize(); err != nil {
		return nil, err
	}
	if hold != nil {
		hold(rep)
	}
	return rep, nil
}
