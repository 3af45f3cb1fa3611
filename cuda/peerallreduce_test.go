package cuda

import (
	"bytes"
	"errors"
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
		tabs := simulatedGroup(t, d, ranks)
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

// TestPeerAllReduceAddRMSNorm runs the fused all-reduce and norm for ranks
// in one grid against the CPU (the partials summed in rank order, then
// AddRMSNorm) and against the GPU's all-reduce then AddRMSNorm, whose bits
// it must give: one row, more rows than blocks, the widest rows, calls after
// plain all-reduces (alternate staging halves).
func TestPeerAllReduceAddRMSNorm(t *testing.T) {
	p := newPair(t)
	d := p.gpu
	for _, ranks := range []int{2, 4} {
		tabs := simulatedGroup(t, d, ranks)
		for call, shape := range [][2]int{{1, 4096}, {3, 1024}, {300, 2048}, {2, 8192}, {1, 64}, {256, 4096}} {
			rows, dim := shape[0], shape[1]
			n := rows * dim
			name := fmt.Sprintf("%d-ranks/%dx%d", ranks, rows, dim)
			partial := p.random(device.F32, 4, ranks, rows, dim)
			res, out := p.random(device.BF16, 2, ranks, rows, dim), p.random(device.BF16, 1, ranks, rows, dim)
			w := p.random(device.BF16, 0.3, dim)

			// The separate kernels, on copies, define the bits.
			sep := func(b both) device.Tensor {
				c, err := d.Alloc(memory.Workspace, b.g.DType, b.g.Shape...)
				if err != nil {
					t.Fatal(err)
				}
				d.Copy(c, b.g)
				return c
			}
			sumG, resG, outG := sep(partial), sep(res), sep(out)
			d.allReduce(tabs.Ptr, ranks, ranks, sumG.Ptr, int64(n), int64(n))
			for r := 0; r < ranks; r++ {
				d.AddRMSNorm(resG.Rows(r, r+1).View(rows, dim), sumG.Rows(r, r+1).View(rows, dim),
					outG.Rows(r, r+1).View(rows, dim), w.g, 1e-6)
			}
			if call%2 == 1 { // a plain all-reduce between: the next call's staging half flips
				d.allReduce(tabs.Ptr, ranks, ranks, sumG.Ptr, 8, 8)
			}
			d.allReduceAddRMSNorm(tabs.Ptr, ranks, partial.g.Ptr, res.g.Ptr, out.g.Ptr, w.g.Ptr, rows, dim, 1e-6, int64(n))

			// The CPU: each rank's residual plus the partials in rank order.
			_, in := p.download(partial)
			sum := make([]float32, n)
			for i := range sum {
				s := in[i]
				for r := 1; r < ranks; r++ {
					s += in[r*n+i]
				}
				sum[i] = s
			}
			sumC := p.floats(device.F32, sum, rows, dim)
			for r := 0; r < ranks; r++ {
				p.cpu.AddRMSNorm(res.c.Rows(r, r+1).View(rows, dim), sumC.c, out.c.Rows(r, r+1).View(rows, dim), w.c, 1e-6)
			}
			p.close(name+" residual", res, 5e-2, 8e-3)
			p.close(name+" out", out, 2e-2, 2e-2)
			for _, c := range []struct {
				what      string
				got, want device.Tensor
			}{{"residual", res.g, resG}, {"out", out.g, outG}} {
				got, want := make([]byte, c.got.Bytes()), make([]byte, c.want.Bytes())
				if err := errors.Join(d.ctx.CopyDtoH(got, c.got.Ptr), d.ctx.CopyDtoH(want, c.want.Ptr)); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				if !bytes.Equal(got, want) {
					t.Errorf("%s: %s differs from all-reduce then add_rmsnorm", name, c.what)
				}
			}
			for _, b := range []device.Tensor{sumG, resG, outG, partial.g, res.g, out.g, w.g} {
				d.Free(memory.Workspace, b)
			}
		}
	}
}

// simulatedGroup sets up ranks' staging memory and tables on one GPU, to
// run them in one grid (a rank per blockIdx.y).
func simulatedGroup(t *testing.T, d *Device, ranks int) device.Tensor {
	t.Helper()
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
	return tabs
}

// TestPeerAllGatherColumns gathers the ranks' [rows, cols] bf16 parts side
// by side, as the vocabulary-parallel logits are, for ranks run in one
// grid: every rank must hold every part at its columns, bit for bit, with
// 16-byte and 2-byte units and more rows than fit the staging at once.
func TestPeerAllGatherColumns(t *testing.T) {
	p := newPair(t)
	d := p.gpu
	for _, ranks := range []int{2, 4} {
		tabs := simulatedGroup(t, d, ranks)
		for _, shape := range [][2]int{{1, 8}, {3, 7}, {5, 4096}, {300, 20000}, {2, 8}} {
			rows, cols := shape[0], shape[1]
			name := fmt.Sprintf("%d-ranks/%dx%d", ranks, rows, cols)
			local := p.random(device.BF16, 1, ranks, rows, cols)
			full, err := d.Alloc(memory.Workspace, device.BF16, ranks, rows, ranks*cols)
			if err != nil {
				t.Fatal(err)
			}
			d.allGatherColumns(tabs.Ptr, ranks, local.g.Ptr, full.Ptr, rows, int64(2*cols), ranks,
				int64(2*rows*cols), int64(2*rows*ranks*cols))
			in := make([]byte, local.g.Bytes())
			out := make([]byte, full.Bytes())
			if err := errors.Join(d.ctx.CopyDtoH(in, local.g.Ptr), d.ctx.CopyDtoH(out, full.Ptr)); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			bad := 0
			for r := 0; r < ranks; r++ { // the rank holding the result
				for q := 0; q < ranks; q++ { // the part's rank
					for row := 0; row < rows; row++ {
						want := in[2*((q*rows+row)*cols) : 2*((q*rows+row+1)*cols)]
						at := 2 * ((r*rows+row)*ranks*cols + q*cols)
						if !bytes.Equal(out[at:at+2*cols], want) {
							if bad++; bad <= 5 {
								t.Errorf("%s: rank %d row %d: rank %d's part differs", name, r, row, q)
							}
						}
					}
				}
			}
			d.Free(memory.Workspace, full)
			d.Free(memory.Workspace, local.g)
		}
	}
}
