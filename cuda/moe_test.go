package cuda

import (
	"cmp"
	"errors"
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
// on every path (the pair gemv of a few tokens, moe_wg where the build
// has it with gate and up on gathered or on sorted rows, moe_gemm's 16-
// and 64-row tiles); and on moe_gemm, which
// deterministic inference keeps at every batch size, a token's output has
// the same bits alone as in a batch, whichever tile height either takes.
func TestMoEExperts(t *testing.T) {
	p := newPair(t)
	wg := p.gpu.moeWG
	for _, c := range []struct{ rows, experts, k, inter, hidden int }{
		{1, 16, 4, 96, 128}, {5, 16, 4, 96, 128}, {300, 16, 4, 96, 128}, {64, 128, 8, 768, 2048}, {600, 8, 2, 48, 64},
		{1, 32, 8, 768, 2048}, {8, 32, 8, 768, 2048}, {3, 16, 16, 48, 64},
		// moe_wg's shapes: partial weight tiles (384 and 320 rows), experts
		// of 75 rows on average (several row tiles), a batch of 256, and
		// experts of 300 rows on average (a prefill's tall tiles).
		{300, 16, 4, 192, 320}, {256, 32, 8, 768, 2048}, {1200, 8, 2, 192, 320},
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
		kept := []both{x, gateUp, down, ids, w}
		work, err := p.gpu.Alloc(memory.Workspace, device.I32, int(p.gpu.MoEWorkBytes(c.rows, c.k, c.experts, c.inter, c.hidden)/4)+1)
		if err != nil {
			t.Fatal(err)
		}
		// The CPU reference (float32 whatever the GPU's dtype) once a case.
		var ref device.Tensor
		const always, never = 0, -1 // moe_wg's first tiles by block
		for _, mode := range []struct {
			gemvTokens, tileRows int
			wg                   bool
			sortedFrom           int // moe_wg's gate and up on sorted rows from this tile (0: the default)
			firstTiles           int // pairs an expert averages from which its first tile is block y's
		}{
			{moeGemvTokens, 0, wg, 0, moeFirstTilesFrom}, {0, 0, wg, 0, moeFirstTilesFrom},
			{0, 0, wg, moeWGRows[0], moeFirstTilesFrom}, {0, 0, wg, 1 << 20, moeFirstTilesFrom},
			// experts with no rows (their first tiles' blocks drain) and
			// experts of several tiles, gathered
			{0, 0, wg, 0, always}, {0, 0, wg, 1 << 20, always}, {0, 0, wg, 1 << 20, never},
			{0, 0, false, 0, moeFirstTilesFrom}, {0, 16, false, 0, moeFirstTilesFrom}, {0, 64, false, 0, moeFirstTilesFrom},
		} {
			p.gpu.moeGemvTokens, p.gpu.moeTileRows, p.gpu.moeWG = mode.gemvTokens, mode.tileRows, mode.wg
			p.gpu.moeSortedFrom, p.gpu.moeFirstTiles = cmp.Or(mode.sortedFrom, moeSortedFrom), mode.firstTiles
			for _, dt := range []device.DType{device.BF16, device.F32} {
				out := p.random(dt, 0, c.rows, c.hidden)
				kept = append(kept, out)
				p.gpu.MoEExperts(out.g, x.g, ids.g, w.g, gateUp.g, down.g, work)
				if ref.Ptr == 0 {
					p.cpu.MoEExperts(out.c, x.c, ids.c, w.c, gateUp.c, down.c, device.Tensor{})
					ref = out.c
				}
				out.c = ref
				// A bf16 output rounds each of the k terms and each partial
				// sum as transformers does (the CPU reference adds in
				// float32): about 0.004 an addition at the 30B shape's
				// magnitudes. A wrong expert or row is off by tenths.
				atol := 2e-2
				if dt == device.BF16 {
					atol = 4e-2
				}
				p.close(fmt.Sprintf("%s %s, pair gemv up to %d tokens, tiles of %d rows, moe_wg %v, sorted rows from %d, first tiles from %d", name, dt, mode.gemvTokens, mode.tileRows, mode.wg, p.gpu.moeSortedFrom, mode.firstTiles), out, atol, 3e-2)
				if mode.gemvTokens == 0 {
					checkMoESort(t, p.gpu, work, idv, c.rows, c.k, c.experts, c.inter, c.hidden)
				}
				if dt != device.BF16 || c.rows == 1 || mode.gemvTokens > 0 || mode.wg {
					continue
				}
				// Row 0 alone, in the tiles its own count picks
				// (moe_gemm_r16's): same bits as in the batch.
				p.gpu.moeTileRows = 0
				all, _ := p.download(out)
				one := p.random(dt, 0, 1, c.hidden)
				kept = append(kept, one)
				p.gpu.MoEExperts(one.g, x.g.Rows(0, 1), ids.g.Rows(0, 1), w.g.Rows(0, 1), gateUp.g, down.g, work)
				alone, _ := p.download(one)
				p.gpu.moeTileRows = mode.tileRows
				if !slices.Equal(alone, all[:c.hidden]) {
					t.Fatalf("%s: a token alone gets other bits than in a batch of %d", name, c.rows)
				}
			}
		}
		p.gpu.moeGemvTokens, p.gpu.moeTileRows, p.gpu.moeWG, p.gpu.moeSortedFrom = moeGemvTokens, 0, wg, moeSortedFrom
		p.gpu.moeFirstTiles = moeFirstTilesFrom
		p.gpu.Free(memory.Workspace, work)
		// The 128-expert case's weights alone are 2.4 GB in the CPU
		// reference's float32: the next case needs the workspace back.
		p.free(kept...)
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

// TestMoEWGTile (no GPU): moe_wg takes the grouped products on an sm_90a
// build outside deterministic inference, with the smallest row tile that
// holds the rows an expert averages, and only K in whole 64-wide steps.
func TestMoEWGTile(t *testing.T) {
	loaded := map[string]bool{}
	for _, n := range kernelNames {
		loaded[n] = true
	}
	for _, c := range []struct {
		name                          string
		pairs, experts, inter, hidden int
		wgmma, det                    bool
		want                          int
	}{
		{"batch 64, top 8 of 128", 512, 128, 768, 2048, true, false, 32},
		{"batch 256", 2048, 128, 768, 2048, true, false, 32},
		{"batch 1024", 8192, 128, 768, 2048, true, false, 64},
		{"a prefill chunk", 65536, 128, 768, 2048, true, false, 128},
		{"fewer pairs than experts", 24, 128, 768, 2048, true, false, 32},
		{"deterministic", 2048, 128, 768, 2048, true, true, 0},
		{"no wgmma", 2048, 128, 768, 2048, false, false, 0},
		{"intermediate of 96", 2048, 16, 96, 128, true, false, 0},
		{"hidden of 320", 1200, 16, 192, 320, true, false, 128},
	} {
		d := &Device{wgmma: c.wgmma, moeWG: true, det: c.det}
		got := d.moeWGTile(c.pairs, c.experts, c.inter, c.hidden)
		if got != c.want {
			t.Errorf("%s: row tile %d, want %d", c.name, got, c.want)
		}
		if got > 0 && !loaded[fmt.Sprintf("moe_wg_n%d", got)] {
			t.Errorf("%s: moe_wg_n%d is not loaded", c.name, got)
		}
	}
	if d := (&Device{wgmma: true}); d.moeWGTile(2048, 128, 768, 2048) != 0 {
		t.Error("EBB_MOE_WG=0 (moeWG false) still takes moe_wg")
	}
}

// TestMoENormRouteClusters (no GPU): moe_add_norm_route takes clusters of
// eight tokens up to moeNormRouteEights and sixteen past it, both kernels
// are loaded, the default bound takes batch 256 in at most 30 clusters
// (what an H200 holds at once at one block an SM), and a block's dynamic
// shared memory at the widest row fits sm_90's 227 KB less the static
// arrays' few hundred bytes.
func TestMoENormRouteClusters(t *testing.T) {
	loaded := map[string]bool{}
	for _, n := range kernelNames {
		loaded[n] = true
	}
	for _, c := range []struct {
		rows, tok int
	}{{2, 8}, {moeNormRouteEights, 8}, {moeNormRouteEights + 1, 16}, {moeNormRouteRows, 16}} {
		tok, name := moeNormRouteTokens(c.rows, moeNormRouteEights)
		if tok != c.tok || !loaded[name] {
			t.Errorf("%d tokens: %d a cluster (%s, loaded %v), want %d", c.rows, tok, name, loaded[name], c.tok)
		}
		if clusters := (c.rows + tok - 1) / tok; clusters > 30 {
			t.Errorf("%d tokens: %d clusters", c.rows, clusters)
		}
		if b := moeNormRouteShared(tok, moeNormRouteHidden); b > 227<<10-1<<10 {
			t.Errorf("%d tokens a cluster: %d bytes of dynamic shared memory", tok, b)
		}
	}
}

// TestBenchMoE: the experts' benchmark runs each path, names the one
// MoEExperts takes and counts the experts its routing touches.
func TestBenchMoE(t *testing.T) {
	p := newPair(t)
	for _, tokens := range []int{1, 64} {
		s := MoEBenchSpec{Tokens: tokens, Experts: 16, TopK: 4, Inter: 128, Hidden: 256, Iters: 2}
		r, err := BenchMoE(p.gpu, s)
		if err != nil {
			t.Fatal(err)
		}
		want := p.gpu.moePath(tokens, 4, 16, 128, 256)
		if r.Path != want || r.Touched < 4 || r.Touched > 16 || r.MedianUs <= 0 || r.Bytes <= 0 {
			t.Fatalf("%d tokens: %+v (path want %s)", tokens, r, want)
		}
	}
	if _, err := BenchMoE(p.gpu, MoEBenchSpec{Tokens: 1, Experts: 4, TopK: 8, Inter: 8, Hidden: 8, Iters: 1}); err == nil {
		t.Fatal("top 8 of 4 experts: no error")
	}
}

// checkMoESort: the pairs moe_sort left in work are grouped by expert in
// ascending order and, within an expert, in pair order (a stable counting
// sort of ids); inv inverts order.
func checkMoESort(t *testing.T, d *Device, work device.Tensor, ids []int32, rows, k, experts, inter, hidden int) {
	t.Helper()
	w, _ := moeLayout(work.Ptr, rows, k, experts, inter, hidden)
	n := rows * k
	order, inv, offsets := make([]int32, n), make([]int32, n), make([]int32, experts+1)
	for _, a := range []struct {
		dst []int32
		at  uintptr
	}{{order, w.order}, {inv, w.inv}, {offsets, w.offsets}} {
		if err := d.DownloadI32(device.Tensor{DType: device.I32, Shape: []int{len(a.dst)}, Ptr: a.at}, a.dst); err != nil {
			t.Fatal(err)
		}
	}
	want := make([]int32, 0, n)
	wantOff := make([]int32, 0, experts+1)
	for e := range experts {
		wantOff = append(wantOff, int32(len(want)))
		for pair, id := range ids {
			if int(id) == e {
				want = append(want, int32(pair))
			}
		}
	}
	wantOff = append(wantOff, int32(n))
	if !slices.Equal(order, want) || !slices.Equal(offsets, wantOff) {
		t.Fatalf("moe_sort of %d pairs over %d experts: order %v... offsets %v, want %v... %v", n, experts, order[:min(n, 16)], offsets[:min(experts, 16)], want[:min(n, 16)], wantOff[:min(experts, 16)])
	}
	for i, pair := range order {
		if inv[pair] != int32(i) {
			t.Fatalf("moe_sort: inv[%d] = %d, want %d", pair, inv[pair], i)
		}
	}
}

// TestMoESharedAdd: a shared expert's gated output added into bf16 and
// float32 sums matches the CPU reference within bf16 rounding.
func TestMoESharedAdd(t *testing.T) {
	p := newPair(t)
	for _, dt := range []device.DType{device.BF16, device.F32} {
		for _, c := range []struct{ rows, hidden int }{{5, 64}, {300, 2048}} {
			out := p.random(dt, 1, c.rows, c.hidden)
			y := p.random(device.BF16, 1, c.rows, c.hidden)
			gate := p.random(device.BF16, 3, c.rows, 1)
			p.gpu.MoESharedAdd(out.g, y.g, gate.g)
			p.cpu.MoESharedAdd(out.c, y.c, gate.c)
			p.close(fmt.Sprintf("moe_shared_add %v %d x %d", dt, c.rows, c.hidden), out, 2e-2, 2e-2)
		}
	}
}

// TestMatMulAddMoERoute: o_proj's add, the norm, the router product and
// the routing in two launches (one token: the gemv in squares mode, then
// moe_norm_route's cluster; more: o_proj's product, then
// moe_add_norm_route's clusters of eight or sixteen tokens) match the CPU's separate
// MatMul, AddRMSNorm, MatMul and MoERoute: the residual and x within bf16
// rounding, and the same experts for every token whose router logits are
// not within rounding of a tie. Shapes it does not take are declined with
// nothing done.
func TestMatMulAddMoERoute(t *testing.T) {
	p := newPair(t)
	if p.gpu.ctx.CCMajor < 9 {
		t.Skip("moe_norm_route needs thread block clusters (sm_90)")
	}
	const bound = 256 // sixteen-token clusters past moeNormRouteEights, whatever the default bound
	defer func(n int) { p.gpu.normRouteRows = n }(p.gpu.normRouteRows)
	p.gpu.normRouteRows = bound
	type routeCase struct {
		rows, in, hidden, experts, k int
		norm                         bool
	}
	var cases []routeCase
	for range 3 { // a token's routing is checked only away from near ties
		cases = append(cases, routeCase{1, 4096, 2048, 128, 8, true}, routeCase{1, 2048, 1024, 256, 16, true},
			routeCase{1, 512, 512, 60, 4, false}, routeCase{1, 1024, 4096, 16, 2, true}, routeCase{1, 256, 1024, 130, 8, true})
	}
	cases = append(cases, routeCase{moeNormRouteEights, 4096, 2048, 128, 8, true}, routeCase{19, 2048, 1024, 256, 16, true},
		routeCase{2, 512, 512, 60, 4, false}, routeCase{9, 1024, 4096, 16, 2, true}, routeCase{33, 256, 1024, 130, 8, true},
		routeCase{5, 256, 96, 8, 2, true}, routeCase{bound, 4096, 2048, 128, 8, true},
		routeCase{moeNormRouteEights + 21, 2048, 4096, 256, 16, true}, routeCase{moeNormRouteEights + 3, 256, 96, 8, 2, false})
	tokens, checked := 0, 0
	for _, c := range cases {
		name := fmt.Sprintf("%d x %d -> %d, %d experts, top %d", c.rows, c.in, c.hidden, c.experts, c.k)
		in := p.random(device.BF16, 1, c.rows, c.in)
		wo := p.random(device.BF16, float32(1/math.Sqrt(float64(c.in))), c.hidden, c.in)
		res := p.random(device.BF16, 2, c.rows, c.hidden)
		normW := p.random(device.BF16, 0.5, c.hidden)
		router := p.random(device.BF16, float32(4/math.Sqrt(float64(c.hidden))), c.experts, c.hidden)
		x := p.random(device.BF16, 0, c.rows, c.hidden)
		out := p.random(device.BF16, 0, c.rows, c.hidden)
		logits := p.random(device.BF16, 0, c.rows, c.experts)
		ids := p.ints(make([]int32, c.rows*c.k), c.rows, c.k)
		w := p.random(device.F32, 0, c.rows, c.k)
		resIn := p.clone(device.BF16, res)
		if !p.gpu.MatMulAddMoERoute(in.g, wo.g, res.g, x.g, normW.g, router.g, ids.g, w.g, 1e-6, c.norm) {
			t.Fatalf("%s: not taken", name)
		}
		p.cpu.MatMul(out.c, in.c, wo.c, device.Tensor{})
		p.cpu.AddRMSNorm(res.c, out.c, x.c, normW.c, 1e-6)
		p.cpu.MatMul(logits.c, x.c, router.c, device.Tensor{})
		p.cpu.MoERoute(ids.c, w.c, logits.c, c.norm)
		p.close(name+": residual", res, 3e-2, 1e-2)
		p.close(name+": x", x, 3e-2, 2e-2)
		gi, ci := make([]int32, c.rows*c.k), make([]int32, c.rows*c.k)
		p.sync()
		if err := errors.Join(p.gpu.DownloadI32(ids.g, gi), p.cpu.DownloadI32(ids.c, ci)); err != nil {
			t.Fatal(err)
		}
		_, lc := p.download(logits)
		gw, cw := p.download(w)
		for r := range c.rows {
			row := slices.Clone(lc[r*c.experts : (r+1)*c.experts])
			sort.Slice(row, func(i, j int) bool { return row[i] > row[j] })
			tie := false
			for j := 0; j < c.k && j+1 < c.experts; j++ {
				tie = tie || row[j]-row[j+1] < 0.05 // bf16 logits from x rounded apart
			}
			tokens++
			if tie {
				continue
			}
			checked++
			at := r * c.k
			if !slices.Equal(gi[at:at+c.k], ci[at:at+c.k]) {
				t.Fatalf("%s: token %d: gpu experts %v, cpu %v (logits %v)", name, r, gi[at:at+c.k], ci[at:at+c.k], row[:c.k+1])
			}
			for j := at; j < at+c.k; j++ {
				// A logit one bf16 step either way moves a weight up to ~3 %.
				if d := math.Abs(float64(gw[j] - cw[j])); d > 2e-3+7e-2*math.Abs(float64(cw[j])) {
					t.Fatalf("%s: token %d: weight %d gpu %v, cpu %v", name, r, j-at, gw[j], cw[j])
				}
			}
		}
		if c.rows > 2 { // one token takes moe_norm_route
			p.checkRouteShifted(name+", rows after the first", 1, c.rows, c.k, c.norm, in, wo, resIn, normW, router, res, x, ids)
		}
		// The same bits from clusters of sixteen where eight took them, and
		// the other way round.
		if eights := p.gpu.routeEights; c.rows > 1 {
			p.gpu.routeEights = bound
			if c.rows > eights {
				p.gpu.routeEights = 0
			}
			p.checkRouteShifted(name+", other clusters", 0, c.rows, c.k, c.norm, in, wo, resIn, normW, router, res, x, ids)
			p.gpu.routeEights = eights
		}
	}
	if checked < tokens/10 { // top 8 of 128 random logits: most tokens have a near tie
		t.Fatalf("only %d of %d tokens without a near tie", checked, tokens)
	}
	for _, c := range []struct {
		name            string
		rows, hidden, k int
	}{{"hidden past 8,192", 1, 8200, 8}, {"tokens of a hidden past 4,096", 2, 4160, 8}, {"tokens of a hidden not in 32s", 3, 1000, 8},
		{"more tokens than moe_add_norm_route takes", bound + 1, 2048, 8}} {
		res := p.random(device.BF16, 1, c.rows, c.hidden)
		before, _ := p.download(res)
		if p.gpu.MatMulAddMoERoute(p.random(device.BF16, 1, c.rows, 256).g, p.random(device.BF16, 1, c.hidden, 256).g, res.g,
			p.random(device.BF16, 1, c.rows, c.hidden).g, p.random(device.BF16, 1, c.hidden).g,
			p.random(device.BF16, 1, 128, c.hidden).g, p.ints(make([]int32, c.rows*c.k), c.rows, c.k).g,
			p.random(device.F32, 0, c.rows, c.k).g, 1e-6, true) {
			t.Fatalf("%s: taken", c.name)
		}
		if after, _ := p.download(res); !slices.Equal(before, after) {
			t.Fatalf("%s: declined, but the residual changed", c.name)
		}
	}
}

// checkRouteShifted runs MatMulAddMoERoute again on the batch's rows lo
// to hi (after its first: each token in another place of another cluster),
// and checks that each gets the same bits (residual, x) and experts as in
// the whole batch.
func (p *pair) checkRouteShifted(name string, lo, hi, k int, norm bool, in, wo, resIn, normW, router, res, x, ids both) {
	p.t.Helper()
	h, rows := res.g.Dim(-1), res.g.Dim(0)
	sub := func(b both) device.Tensor { return b.g.Rows(lo, hi) }
	res2, x2 := p.clone(device.BF16, resIn), p.random(device.BF16, 0, rows, h)
	ids2 := p.ints(make([]int32, rows*k), rows, k)
	w2 := p.random(device.F32, 0, rows, k)
	if !p.gpu.MatMulAddMoERoute(sub(in), wo.g, sub(res2), sub(x2), normW.g, router.g, sub(ids2), sub(w2), 1e-6, norm) {
		p.t.Fatalf("%s: not taken", name)
	}
	p.sameBits(name+": residual", sub(res2), sub(res))
	p.sameBits(name+": x", sub(x2), sub(x))
	p.sync()
	a, b := make([]int32, rows*k), make([]int32, rows*k)
	if err := errors.Join(p.gpu.DownloadI32(ids.g, a), p.gpu.DownloadI32(ids2.g, b)); err != nil {
		p.t.Fatal(err)
	}
	if !slices.Equal(a[lo*k:hi*k], b[lo*k:hi*k]) {
		p.t.Fatalf("%s: other experts", name)
	}
}

// TestMoEExpertsAddThenRMSNormMatMul: one token's experts added into the
// residual (moe_down_combine's add mode), then the next product
// normalising that residual from the blocks' sums of squares, match the
// CPU's MoEExperts, AddRMSNorm and MatMul.
func TestMoEExpertsAddThenRMSNormMatMul(t *testing.T) {
	p := newPair(t)
	for _, c := range []struct{ experts, k, inter, hidden, next int }{
		{128, 8, 768, 2048, 5120}, {16, 4, 96, 128, 384}, {32, 8, 768, 1024, 1024}, {8, 2, 48, 72, 96},
	} {
		name := fmt.Sprintf("%d experts, top %d, %d x %d, then %d", c.experts, c.k, c.inter, c.hidden, c.next)
		x := p.random(device.BF16, 1, 1, c.hidden)
		gateUp := p.random(device.BF16, float32(1/math.Sqrt(float64(c.hidden))), c.experts, 2*c.inter, c.hidden)
		down := p.random(device.BF16, float32(1/math.Sqrt(float64(c.inter))), c.experts, c.hidden, c.inter)
		idv, wv := make([]int32, c.k), make([]float32, c.k)
		for j, e := range p.rng.Perm(c.experts)[:c.k] {
			idv[j], wv[j] = int32(e), float32(1+p.rng.IntN(64))/64
		}
		ids, w := p.ints(idv, 1, c.k), p.floats(device.F32, wv, 1, c.k)
		next := p.random(device.BF16, float32(1/math.Sqrt(float64(c.hidden))), c.next, c.hidden)
		normW := p.random(device.BF16, 0.5, c.hidden)
		res := p.random(device.BF16, 2, 1, c.hidden)
		out := p.random(device.BF16, 0, 1, c.hidden)
		normed := p.random(device.BF16, 0, 1, c.hidden)
		y := p.random(device.BF16, 0, 1, c.next)
		work, err := p.gpu.Alloc(memory.Workspace, device.I32, int(p.gpu.MoEWorkBytes(1, c.k, c.experts, c.inter, c.hidden)/4)+1)
		if err != nil {
			t.Fatal(err)
		}
		if !p.gpu.MoEExpertsAdd(res.g, x.g, ids.g, w.g, gateUp.g, down.g, work, next.g) {
			t.Fatalf("%s: not taken", name)
		}
		if !p.gpu.RMSNormMatMul(y.g, res.g, normW.g, next.g, 1e-6, false) {
			t.Fatalf("%s: the next product does not normalise", name)
		}
		p.cpu.MoEExperts(out.c, x.c, ids.c, w.c, gateUp.c, down.c, device.Tensor{})
		p.cpu.AddRMSNorm(res.c, out.c, normed.c, normW.c, 1e-6)
		p.cpu.MatMul(y.c, normed.c, next.c, device.Tensor{})
		p.close(name+": residual", res, 6e-2, 2e-2)
		p.close(name+": next product", y, 6e-2, 3e-2)
		p.gpu.Free(memory.Workspace, work)
	}
	// Two tokens take the plain path (the next product's norm for several
	// rows reads few partial sums).
	work, err := p.gpu.Alloc(memory.Workspace, device.I32, int(p.gpu.MoEWorkBytes(2, 2, 8, 48, 64)/4)+1)
	if err != nil {
		t.Fatal(err)
	}
	if p.gpu.MoEExpertsAdd(p.random(device.BF16, 1, 2, 64).g, p.random(device.BF16, 1, 2, 64).g, p.ints([]int32{0, 1, 2, 3}, 2, 2).g,
		p.random(device.F32, 1, 2, 2).g, p.random(device.BF16, 1, 8, 96, 64).g, p.random(device.BF16, 1, 8, 64, 48).g, work,
		p.random(device.BF16, 1, 32, 64).g) {
		t.Fatal("two tokens: taken")
	}
}

// TestMoEDownBulkSameBits: moe_down_bulk (one token's weights by bulk
// copies into shared memory) gives moe_down_combine's bits, into a sum
// and added into a residual, and so does moe_gemv_glu on a grid of one,
// three or (unset, one token) moeGluBlocks blocks an SM
// (EBB_MOE_GLU_BLOCKS), each taking groups in turn.
func TestMoEDownBulkSameBits(t *testing.T) {
	p := newPair(t)
	if !p.gpu.wgmma {
		t.Skip("moe_down_bulk runs on the sm_90a build")
	}
	for _, c := range []struct{ rows, experts, k, inter, hidden int }{
		{1, 128, 8, 768, 2048}, {1, 16, 16, 48, 64}, {1, 32, 8, 768, 1024}, {1, 8, 2, 96, 1024},
	} {
		name := fmt.Sprintf("%d rows, %d experts, top %d, %d x %d", c.rows, c.experts, c.k, c.inter, c.hidden)
		x := p.random(device.BF16, 1, c.rows, c.hidden)
		gateUp := p.random(device.BF16, float32(1/math.Sqrt(float64(c.hidden))), c.experts, 2*c.inter, c.hidden)
		down := p.random(device.BF16, float32(1/math.Sqrt(float64(c.inter))), c.experts, c.hidden, c.inter)
		idv, wv := make([]int32, c.rows*c.k), make([]float32, c.rows*c.k)
		for r := range c.rows {
			for j, e := range p.rng.Perm(c.experts)[:c.k] {
				idv[r*c.k+j], wv[r*c.k+j] = int32(e), float32(1+p.rng.IntN(64))/64
			}
		}
		ids, w := p.ints(idv, c.rows, c.k), p.floats(device.F32, wv, c.rows, c.k)
		work, err := p.gpu.Alloc(memory.Workspace, device.I32, int(p.gpu.MoEWorkBytes(c.rows, c.k, c.experts, c.inter, c.hidden)/4)+1)
		if err != nil {
			t.Fatal(err)
		}
		res := p.random(device.BF16, 2, c.rows, c.hidden)
		var outs, sums [][]uint16
		settings := []struct {
			noBulk    bool
			gluBlocks int
		}{{true, 0}, {false, 0}, {false, 1}, {false, 3}, {false, -1}}
		for _, set := range settings {
			p.gpu.noMoEBulk, p.gpu.moeGluBlocks = set.noBulk, set.gluBlocks
			out := p.random(device.BF16, 0, c.rows, c.hidden)
			p.gpu.MoEExperts(out.g, x.g, ids.g, w.g, gateUp.g, down.g, work)
			outs = append(outs, p.bits(out.g))
			r := p.clone(device.BF16, res)
			if !p.gpu.MoEExpertsAdd(r.g, x.g, ids.g, w.g, gateUp.g, down.g, work, p.random(device.BF16, 1, 64, c.hidden).g) {
				t.Fatalf("%s: not added", name)
			}
			sums = append(sums, p.bits(r.g))
		}
		p.gpu.noMoEBulk, p.gpu.moeGluBlocks = false, -1
		for i := 1; i < len(settings); i++ {
			if !slices.Equal(outs[0], outs[i]) || !slices.Equal(sums[0], sums[i]) {
				t.Fatalf("%s: %+v gives other bits than %+v", name, settings[i], settings[0])
			}
		}
		p.gpu.Free(memory.Workspace, work)
	}
}

// TestMoEExpertsAddRMSNormSameBits: moe_combine_add_rmsnorm gives the bits
// of moe_combine then add_rmsnorm, on moe_wg's products and moe_gemm's
// (a hidden size off matmul_wg's 64-wide steps); the pair gemv's few rows
// are declined.
func TestMoEExpertsAddRMSNormSameBits(t *testing.T) {
	p := newPair(t)
	for _, c := range []struct {
		rows                      []int
		experts, k, inter, hidden int
	}{
		{[]int{256, 37}, 128, 8, 768, 2048}, {[]int{5}, 16, 4, 96, 128}, {[]int{64}, 8, 2, 48, 72}, {[]int{9}, 32, 8, 64, 4096},
	} {
		// One set of weights a shape: the CPU twin of the 30B-A3B shape's
		// experts takes 2.4 GB of the pair's 4 GB workspace.
		gateUp := p.random(device.BF16, float32(1/math.Sqrt(float64(c.hidden))), c.experts, 2*c.inter, c.hidden)
		down := p.random(device.BF16, float32(1/math.Sqrt(float64(c.inter))), c.experts, c.hidden, c.inter)
		normW := p.random(device.BF16, 0.5, c.hidden)
		for _, rows := range c.rows {
			name := fmt.Sprintf("%d rows, %d experts, top %d, %d x %d", rows, c.experts, c.k, c.inter, c.hidden)
			x := p.random(device.BF16, 1, rows, c.hidden)
			idv, wv := make([]int32, rows*c.k), make([]float32, rows*c.k)
			for r := range rows {
				for j, e := range p.rng.Perm(c.experts)[:c.k] {
					idv[r*c.k+j], wv[r*c.k+j] = int32(e), float32(1+p.rng.IntN(64))/64
				}
			}
			ids, w := p.ints(idv, rows, c.k), p.floats(device.F32, wv, rows, c.k)
			work, err := p.gpu.Alloc(memory.Workspace, device.I32, int(p.gpu.MoEWorkBytes(rows, c.k, c.experts, c.inter, c.hidden)/4)+1)
			if err != nil {
				t.Fatal(err)
			}
			res := p.random(device.BF16, 2, rows, c.hidden)
			// Apart: the experts' sum, then add_rmsnorm into a separate x.
			sum, normed := p.random(device.BF16, 0, rows, c.hidden), p.random(device.BF16, 0, rows, c.hidden)
			r0 := p.clone(device.BF16, res)
			p.gpu.MoEExperts(sum.g, x.g, ids.g, w.g, gateUp.g, down.g, work)
			p.gpu.AddRMSNorm(r0.g, sum.g, normed.g, normW.g, 1e-6)
			// Folded: x itself is overwritten with the norm.
			r1, x1 := p.clone(device.BF16, res), p.clone(device.BF16, x)
			if !p.gpu.MoEExpertsAddRMSNorm(r1.g, x1.g, normW.g, ids.g, w.g, gateUp.g, down.g, work, 1e-6) {
				t.Fatalf("%s: not taken", name)
			}
			if !slices.Equal(p.bits(r0.g), p.bits(r1.g)) || !slices.Equal(p.bits(normed.g), p.bits(x1.g)) {
				t.Fatalf("%s: folded combine and norm give other bits", name)
			}
			p.gpu.Free(memory.Workspace, work)
		}
	}
	work, err := p.gpu.Alloc(memory.Workspace, device.I32, int(p.gpu.MoEWorkBytes(2, 2, 8, 48, 64)/4)+1)
	if err != nil {
		t.Fatal(err)
	}
	if p.gpu.MoEExpertsAddRMSNorm(p.random(device.BF16, 1, 2, 64).g, p.random(device.BF16, 1, 2, 64).g, p.random(device.BF16, 1, 64).g,
		p.ints([]int32{0, 1, 2, 3}, 2, 2).g, p.random(device.F32, 1, 2, 2).g, p.random(device.BF16, 1, 8, 96, 64).g,
		p.random(device.BF16, 1, 8, 64, 48).g, work, 1e-6) {
		t.Fatal("two tokens: taken")
	}
}

// TestRouteSortedExperts: moe_add_norm_route's grouping of the pairs by
// expert (its last cluster's, in place of moe_sort) is a grouping of the
// ids it wrote, with moe_sort's offsets and tiles, its counts back at zero,
// and the experts after it give the same bits as with moe_sort
// (EBB_MOE_ROUTE_SORT=0). The pair gemv's few tokens are not grouped.
func TestRouteSortedExperts(t *testing.T) {
	p := newPair(t)
	if p.gpu.ctx.CCMajor < 9 {
		t.Skip("moe_add_norm_route needs thread block clusters (sm_90)")
	}
	defer func(n int, off bool) { p.gpu.normRouteRows, p.gpu.noRouteSort = n, off }(p.gpu.normRouteRows, p.gpu.noRouteSort)
	p.gpu.normRouteRows = moeNormRouteMaxRows
	for _, c := range []struct{ rows, hidden, experts, k, inter int }{
		{256, 1024, 128, 8, 256}, {512, 1024, 128, 8, 128}, {19, 1024, 256, 16, 128}, {33, 512, 130, 8, 64},
		{5, 256, 16, 2, 64}, {moeGemvTokens, 512, 128, 8, 64},
	} {
		name := fmt.Sprintf("%d tokens, %d experts, top %d", c.rows, c.experts, c.k)
		in := p.random(device.BF16, 1, c.rows, 256)
		wo := p.random(device.BF16, 1/16., c.hidden, 256)
		res := p.random(device.BF16, 2, c.rows, c.hidden)
		normW := p.random(device.BF16, 0.5, c.hidden)
		router := p.random(device.BF16, float32(4/math.Sqrt(float64(c.hidden))), c.experts, c.hidden)
		gateUp := p.random(device.BF16, float32(1/math.Sqrt(float64(c.hidden))), c.experts, 2*c.inter, c.hidden)
		down := p.random(device.BF16, float32(1/math.Sqrt(float64(c.inter))), c.experts, c.hidden, c.inter)
		work, err := p.gpu.Alloc(memory.Workspace, device.I32, int(p.gpu.MoEWorkBytes(c.rows, c.k, c.experts, c.inter, c.hidden)/4)+1)
		if err != nil {
			t.Fatal(err)
		}
		var outs [2][2][]uint16
		for i, off := range []bool{true, false} {
			p.gpu.noRouteSort = off
			r, x := p.clone(device.BF16, res), p.random(device.BF16, 0, c.rows, c.hidden)
			ids := p.ints(make([]int32, c.rows*c.k), c.rows, c.k)
			w := p.random(device.F32, 0, c.rows, c.k)
			if !p.gpu.MatMulAddMoERoute(in.g, wo.g, r.g, x.g, normW.g, router.g, ids.g, w.g, 1e-6, true) {
				t.Fatalf("%s: routing not taken", name)
			}
			sorted := p.gpu.routeSorted
			if want := !off && c.rows > moeGemvTokens; (sorted.rows > 0) != want {
				t.Fatalf("%s, route sort %v: grouped %+v", name, !off, sorted)
			}
			if sorted.rows > 0 {
				p.checkRouteSorted(name, ids.g, c.experts, sorted.rows)
			}
			if !p.gpu.MoEExpertsAddRMSNorm(r.g, x.g, normW.g, ids.g, w.g, gateUp.g, down.g, work, 1e-6) &&
				c.rows > moeGemvTokens {
				t.Fatalf("%s: experts not taken", name)
			}
			if p.gpu.routeSorted != (routeSorted{}) {
				t.Fatalf("%s: the grouping outlived the experts that used it", name)
			}
			outs[i] = [2][]uint16{p.bits(r.g), p.bits(x.g)}
			p.free(r, x, ids, w)
		}
		if !slices.Equal(outs[0][0], outs[1][0]) || !slices.Equal(outs[0][1], outs[1][1]) {
			t.Fatalf("%s: other bits with the routing's grouping than with moe_sort's", name)
		}
		p.gpu.Free(memory.Workspace, work)
		p.free(in, wo, res, normW, router, gateUp, down)
	}
}

// checkRouteSorted checks routeSort against the ids it grouped for row
// tiles of bm: offsets and tiles as moe_sort forms them, order and inv
// inverse permutations that put each pair among its expert's, and the
// counts and ticket zero again.
func (p *pair) checkRouteSorted(name string, ids device.Tensor, experts, bm int) {
	p.t.Helper()
	p.sync()
	n := ids.Numel()
	got, idv := make([]int32, p.gpu.routeSort.Numel()), make([]int32, n)
	if err := errors.Join(p.gpu.DownloadI32(p.gpu.routeSort, got), p.gpu.DownloadI32(ids, idv)); err != nil {
		p.t.Fatal(err)
	}
	l := routeSortAt(0)
	at := func(ptr uintptr, i int) int32 { return got[int(ptr)/4+i] }
	rows := make([]int32, experts)
	for _, e := range idv {
		rows[e]++
	}
	var off, tile int32
	for e := 0; e <= experts; e++ {
		if at(l.offsets, e) != off || at(l.tiles, e) != tile {
			p.t.Fatalf("%s: expert %d: offset %d, tile %d, want %d, %d", name, e, at(l.offsets, e), at(l.tiles, e), off, tile)
		}
		if e < experts {
			off, tile = off+rows[e], tile+(rows[e]+int32(bm)-1)/int32(bm)
		}
	}
	for i := range n {
		pr := at(l.order, i)
		if pr < 0 || int(pr) >= n || at(l.inv, int(pr)) != int32(i) {
			p.t.Fatalf("%s: order[%d] = %d is not inv's inverse", name, i, pr)
		}
		if e := idv[pr]; int32(i) < at(l.offsets, int(e)) || int32(i) >= at(l.offsets, int(e)+1) {
			p.t.Fatalf("%s: pair %d of expert %d at %d, outside its rows", name, pr, e, i)
		}
	}
	for i := 0; i <= moeMaxExperts; i++ {
		if at(l.counts, i) != 0 {
			p.t.Fatalf("%s: count %d left at %d", name, i, at(l.counts, i))
		}
	}
}
