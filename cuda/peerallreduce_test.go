package cuda

import (
	"fmt"
	"math"
	"testing"

	"ebb/device"
	"ebb/memory"
)

// TestPeerAllReduce runs the all-reduce kernel for several ranks on one GPU
// (one grid, a rank per blockIdx.y, each with its own staging memory and
// table) against the CPU sum in rank order: every rank must get exactly
// those bits, call after call (alternate staging halves, changing grids),
// one-shot and two-shot, vectorised or not.
func TestPeerAllReduce(t *testing.T) {
	p := newPair(t)
	d := p.gpu
	for _, ranks := range []int{2, 4} {
		mem, err := d.Alloc(memory.Workspace, device.F32, ranks, arUsedBytes/4)
		if err != nil {
			t.Fatal(err)
		}
		tabs, err := d.Alloc(memory.Workspace, device.F32, ranks, arTableBytes/4)
		if err != nil {
			t.Fatal(err)
		}
		base := func(r int) uintptr { return mem.Ptr + uintptr(r*arUsedBytes) }
		stage, signal := make([]uintptr, ranks), make([]uintptr, ranks)
		for r := range stage {
			stage[r], signal[r] = base(r), base(r)+arSignalOff
			if err := d.ctx.MemsetD32(base(r)+arSignalOff, 0, (arTableOff-arSignalOff)/4); err != nil {
				t.Fatal(err)
			}
		}
		for r := range stage {
			if err := d.ctx.CopyHtoD(tabs.Ptr+uintptr(r*arTableBytes), arTable(stage, signal, base(r)+arEpochOff, r)); err != nil {
				t.Fatal(err)
			}
		}
		// Sizes: not a multiple of 4 (scalar kernel), one block, many
		// blocks (two-shot from 512 KiB with 4 ranks), more than one
		// staging area; small again after large.
		for call, n := range []int{6, 4096, 4096, 300_000, 1024, 2, 300_000, arStageElems + 4000, 8} {
			name := fmt.Sprintf("%d-ranks/call-%d-n-%d", ranks, call, n)
			x := p.random(device.F32, 4, ranks, n)
			want := make([]float32, n)
			_, in := p.download(x)
			for i := range want {
				s := in[i]
				for r := 1; r < ranks; r++ {
					s += in[r*n+i]
				}
				want[i] = s
			}
			d.allReduce(tabs.Ptr, ranks, ranks, x.g.Ptr, int64(n), int64(n))
			got := make([]float32, ranks*n)
			if err := d.DownloadF32(x.g, got); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			bad := 0
			for r := 0; r < ranks; r++ {
				for i, w := range want {
					if g := got[r*n+i]; math.Float32bits(g) != math.Float32bits(w) {
						if bad++; bad <= 5 {
							t.Errorf("%s: rank %d element %d = %v, want %v", name, r, i, g, w)
						}
					}
				}
			}
		}
	}
}
