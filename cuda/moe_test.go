package cuda

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"testing"

	"ebb/device"
	"ebb/memory"
)

// TestMoERoute: the GPU picks each row's experts as the CPU reference
// does, in the same order, wherever the choice is not a float tie, and
// gives them the same weights rounded to bf16.
func TestMoERoute(t *testing.T) {
	p := newPair(t)
	for _, c := range []struct {
		rows, experts, k int
		norm             bool
	}{{300, 128, 8, true}, {7, 16, 4, false}, {33, 256, 16, true}, {5, 8, 2, true}} {
		logits := p.random(device.BF16, 2, c.rows, c.experts)
		ids := p.ints(make([]int32, c.rows*c.k), c.rows, c.k)
		w := p.random(device.F32, 0, c.rows, c.k)
		p.gpu.MoERoute(ids.g, w.g, logits.g, c.norm)
		p.cpu.MoERoute(ids.c, w.c, logits.c, c.norm)
		p.sync()
		gi, ci := make([]int32, c.rows*c.k), make([]int32, c.rows*c.k)
		if err := p.gpu.DownloadI32(ids.g, gi); err != nil {
			t.Fatal(err)
		}
		if err := p.cpu.DownloadI32(ids.c, ci); err != nil {
			t.Fatal(err)
		}
		_, lc := p.download(logits)
		checked := 0
		for r := 0; r < c.rows; r++ {
			row := slices.Clone(lc[r*c.experts : (r+1)*c.experts])
			sort.Slice(row, func(i, j int) bool { return row[i] > row[j] })
			tie := false
			for j := 0; j < c.k && j+1 < c.experts; j++ {
				tie = tie || (row[j] > row[j+1] && row[j]-row[j+1] < 1e-6) // equal logits are equal on both
			}
			if tie {
				continue
			}
			checked++
			if !slices.Equal(gi[r*c.k:(r+1)*c.k], ci[r*c.k:(r+1)*c.k]) {
				t.Fatalf("%+v row %d: gpu experts %v, cpu %v", c, r, gi[r*c.k:(r+1)*c.k], ci[r*c.k:(r+1)*c.k])
			}
		}
		if checked < c.rows*3/4 {
			t.Fatalf("%+v: only %d rows without ties", c, checked)
		}
		p.close(fmt.Sprintf("weights %+v", c), w, 1e-6, 8e-3)
	}
}

// TestMoEExperts: the experts' products and their weighted sum match the
// CPU reference for the same routing, at batch sizes from one token to a
// prefill chunk, with partial tiles (an intermediate size that is not a
// multiple of 32) and a float32 output (a tensor-parallel partial sum),
// on every path (the pair gemv of a few tokens, moe_gemm's 16- and 64-row
// tiles); and on moe_gemm, which deterministic inference keeps at every
// batch size, a token's output has the same bits alone as in a batch,
// whichever tile height either takes.
func TestMoEExperts(t *testing.T) {
	p := newPair(t)
	for _, c := range []struct{ rows, experts, k, inter, hidden int }{
		{1, 16, 4, 96, 128}, {5, 16, 4, 96, 128}, {300, 16, 4, 96, 128}, {64, 128, 8, 768, 2048}, {600, 8, 2, 48, 64},
		{1, 32, 8, 768, 2048}, {8, 32, 8, 768, 2048}, {3, 16, 16, 48, 64},
	} {
		name := fmt.Sprintf("%d rows, %d experts, top %d, %d x %d", c.rows, c.experts, c.k, c.inter, c.hidden)
		x := p.random(device.BF16, 1, c.rows, c.hidden)
		gateUp := p.random(device.BF16, float32(1/math.Sqrt(float64(c.hidden))), c.experts, 2*c.inter, c.hidden)
		down := p.random(device.BF16, float32(1/math.Sqrt(float64(c.inter))), c.experts, c.hidden, c.inter)
		// One routing for both devices: distinct experts per row, weights
		// exact in bf16.
		idv := make([]int32, c.rows*c.k)
		wv := make([]float32, c.rows*c.k)
		for r := 0; r < c.rows; r++ {
			perm := p.rng.Perm(c.experts)
			for j := 0; j < c.k; j++ {
				idv[r*c.k+j] = int32(perm[j])
				wv[r*c.k+j] = float32(1+p.rng.IntN(64)) / 64
			}
		}
		ids := p.ints(idv, c.rows, c.k)
		w := p.floats(device.F32, wv, c.rows, c.k)
		work, err := p.gpu.Alloc(memory.Workspace, device.I32, int(p.gpu.MoEWorkBytes(c.rows, c.k, c.experts, c.inter, c.hidden)/4)+1)
		if err != nil {
			t.Fatal(err)
		}
		for _, mode := range []struct{ gemvTokens, tileRows int }{{moeGemvTokens, 0}, {0, 0}, {0, 16}, {0, 64}} {
			p.gpu.moeGemvTokens, p.gpu.moeTileRows = mode.gemvTokens, mode.tileRows
			for _, dt := range []device.DType{device.BF16, device.F32} {
				out := p.random(dt, 0, c.rows, c.hidden)
				p.gpu.MoEExperts(out.g, x.g, ids.g, w.g, gateUp.g, down.g, work)
				p.cpu.MoEExperts(out.c, x.c, ids.c, w.c, gateUp.c, down.c, device.Tensor{})
				// A bf16 output rounds each of the k terms and each partial
				// sum as transformers does (the CPU reference adds in
				// float32): about 0.004 an addition at the 30B shape's
				// magnitudes. A wrong expert or row is off by tenths.
				atol := 2e-2
				if dt == device.BF16 {
					atol = 4e-2
				}
				p.close(fmt.Sprintf("%s %s, pair gemv up to %d tokens, tiles of %d rows", name, dt, mode.gemvTokens, mode.tileRows), out, atol, 3e-2)
				if dt != device.BF16 || c.rows == 1 || mode.gemvTokens > 0 {
					continue
				}
				// Row 0 alone, in the tiles its own count picks
				// (moe_gemm_r16's): same bits as in the batch.
				p.gpu.moeTileRows = 0
				all, _ := p.download(out)
				one := p.random(dt, 0, 1, c.hidden)
				p.gpu.MoEExperts(one.g, x.g.Rows(0, 1), ids.g.Rows(0, 1), w.g.Rows(0, 1), gateUp.g, down.g, work)
				alone, _ := p.download(one)
				p.gpu.moeTileRows = mode.tileRows
				if !slices.Equal(alone, all[:c.hidden]) {
					t.Fatalf("%s: a token alone gets other bits than in a batch of %d", name, c.rows)
				}
			}
		}
		p.gpu.moeGemvTokens, p.gpu.moeTileRows = moeGemvTokens, 0
		p.gpu.Free(memory.Workspace, work)
	}
}

// TestMoETileChoice (no GPU): 16-row tiles where the experts average 16
// rows or fewer, 64-row tiles above, EBB_MOE_TILE_ROWS forcing either; both
// kernels are loaded.
func TestMoETileChoice(t *testing.T) {
	loaded := map[string]bool{}
	for _, n := range kernelNames {
		loaded[n] = true
	}
	for _, c := range []struct {
		pairs, experts, forced int
		kernel                 string
		rows                   int
	}{
		{8, 128, 0, "moe_gemm_r16", 16},
		{2048, 128, 0, "moe_gemm_r16", 16}, // batch 256, top 8 of 128
		{2049, 128, 0, "moe_gemm", 64},
		{65536, 128, 0, "moe_gemm", 64}, // an 8,192-token prefill chunk
		{1200, 16, 0, "moe_gemm", 64},
		{1200, 16, 16, "moe_gemm_r16", 16},
		{8, 128, 64, "moe_gemm", 64},
	} {
		d := &Device{moeTileRows: c.forced}
		kernel, rows := d.moeTiles(c.pairs, c.experts)
		if kernel != c.kernel || rows != c.rows || !loaded[kernel] {
			t.Errorf("%d pairs over %d experts (forced %d): %s with %d rows, want %s with %d (loaded: %v)",
				c.pairs, c.experts, c.forced, kernel, rows, c.kernel, c.rows, loaded[kernel])
		}
	}
}
