package cuda

import (
	"fmt"
	"time"
)

// ChunkProbe is the cost of backing one address range with physical memory
// in chunks of one size.
type ChunkProbe struct {
	ChunkMiB       int64     `json:"chunk_mib"`
	Chunks         int       `json:"chunks"`
	MapMs          []float64 `json:"map_ms"`            // right after the previous unmap
	MapAfterIdleMs []float64 `json:"map_after_idle_ms"` // after an idle wait
	UnmapMs        []float64 `json:"unmap_ms"`
}

// ProbeChunks maps and unmaps total bytes in chunks of each size, cycles
// times back to back and cycles times with idle in between, to show how the
// driver's cost depends on allocation size and on recently freed memory.
func ProbeChunks(ctx *Context, total int64, chunkSizes []int64, cycles int, idle time.Duration) ([]ChunkProbe, error) {
	v, err := NewVMM(ctx)
	if err != nil {
		return nil, err
	}
	va, err := v.Reserve(total)
	if err != nil {
		return nil, err
	}
	defer v.Unreserve(va, total)
	var out []ChunkProbe
	for _, cs := range chunkSizes {
		if cs%v.Granularity() != 0 || total%cs != 0 {
			return out, fmt.Errorf("chunk %d does not divide %d in units of %d", cs, total, v.Granularity())
		}
		p := ChunkProbe{ChunkMiB: cs >> 20, Chunks: int(total / cs)}
		maps := make([]any, p.Chunks)
		for i := 0; i < 2*cycles; i++ {
			if i == cycles {
				time.Sleep(idle)
			}
			t0 := time.Now()
			for c := range maps {
				if maps[c], err = v.Map(va+uintptr(int64(c)*cs), cs); err != nil {
					return out, err
				}
			}
			mapMs := float64(time.Since(t0).Microseconds()) / 1000
			if i < cycles {
				p.MapMs = append(p.MapMs, mapMs)
			} else {
				p.MapAfterIdleMs = append(p.MapAfterIdleMs, mapMs)
			}
			if err := ctx.Synchronize(); err != nil {
				return out, err
			}
			t1 := time.Now()
			for c := range maps {
				if err := v.Unmap(va+uintptr(int64(c)*cs), cs, maps[c]); err != nil {
					return out, err
				}
			}
			p.UnmapMs = append(p.UnmapMs, float64(time.Since(t1).Microseconds())/1000)
			if i >= cycles {
				time.Sleep(idle)
			}
		}
		out = append(out, p)
	}
	return out, nil
}
