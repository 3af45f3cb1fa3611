package cuda

import (
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"ebb/device"
	"ebb/device/cpu"
	"ebb/memory"
	"ebb/model"
	"ebb/safetensors"
)

// pair runs the same operation on the GPU and on the CPU reference.
type pair struct {
	t   testing.TB
	gpu *Device
	cpu *cpu.Device
	rng *rand.Rand
}

type both struct{ g, c device.Tensor }

func newPair(t testing.TB) *pair {
	t.Helper()
	if err := Available(); err != nil {
		t.Skip("no GPU:", err)
	}
	g, err := OpenDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	c := cpu.New(0)
	for _, m := range []*memory.Manager{g.Memory(), c.Memory()} {
		if _, err := m.Create(memory.Workspace, memory.RegionOptions{Capacity: 4 << 30, GrowStep: 64 << 20}); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		if err := g.Close(); err != nil {
			t.Error(err)
		}
		c.Close()
	})
	return &pair{t: t, gpu: g, cpu: c, rng: rand.New(rand.NewPCG(uint64(len(t.Name())), 42))}
}

// floats allocates a tensor on both devices holding the same values (rounded
// to bf16, so both start from identical inputs; dtype F32 keeps floats).
func (p *pair) floats(dtype device.DType, vals []float32, shape ...int) both {
	p.t.Helper()
	g, err := p.gpu.Alloc(memory.Workspace, dtype, shape...)
	if err != nil {
		p.t.Fatal(err)
	}
	c, err := p.cpu.Alloc(memory.Workspace, device.F32, shape...)
	if err != nil {
		p.t.Fatal(err)
	}
	if dtype == device.BF16 {
		for i, v := range vals {
			vals[i] = math.Float32frombits(uint32(safetensors.BF16Bits(v)) << 16)
		}
	}
	if err := p.gpu.Upload(g, model.F32Bytes(vals), device.F32); err != nil {
		p.t.Fatal(err)
	}
	if err := p.cpu.Upload(c, model.F32Bytes(vals), device.F32); err != nil {
		p.t.Fatal(err)
	}
	return both{g, c}
}

func (p *pair) random(dtype device.DType, scale float32, shape ...int) both {
	n := 1
	for _, d := range shape {
		n *= d
	}
	vals := make([]float32, n)
	for i := range vals {
		vals[i] = float32(p.rng.NormFloat64()) * scale
	}
	return p.floats(dtype, vals, shape...)
}

func (p *pair) ints(vals []int32, shape ...int) both {
	p.t.Helper()
	if len(shape) == 0 {
		shape = []int{len(vals)}
	}
	var out both
	for i, d := range []device.Device{p.gpu, p.cpu} {
		t, err := d.Alloc(memory.Workspace, device.I32, shape...)
		if err != nil {
			p.t.Fatal(err)
		}
		if err := d.Upload(t, model.I32Bytes(vals), device.I32); err != nil {
			p.t.Fatal(err)
		}
		if i == 0 {
			out.g = t
		} else {
			out.c = t
		}
	}
	return out
}

// free gives tensors' memory back to both workspaces.
func (p *pair) free(bs ...both) {
	for _, b := range bs {
		p.gpu.Free(memory.Workspace, b.g)
		p.cpu.Free(memory.Workspace, b.c)
	}
}

func (p *pair) sync() {
	p.t.Helper()
	if err := p.gpu.Sync(); err != nil {
		p.t.Fatal(err)
	}
	if err := p.cpu.Sync(); err != nil {
		p.t.Fatal(err)
	}
}

func (p *pair) download(b both) (g, c []float32) {
	p.t.Helper()
	p.sync()
	g, c = make([]float32, b.g.Numel()), make([]float32, b.c.Numel())
	if err := p.gpu.DownloadF32(b.g, g); err != nil {
		p.t.Fatal(err)
	}
	if err := p.cpu.DownloadF32(b.c, c); err != nil {
		p.t.Fatal(err)
	}
	return g, c
}

// close checks |g-c| <= atol + rtol*|c| everywhere and reports the worst.
func (p *pair) close(name string, b both, atol, rtol float64) {
	p.t.Helper()
	g, c := p.download(b)
	worst, at := 0.0, -1
	for i := range g {
		d := math.Abs(float64(g[i]) - float64(c[i]))
		if math.IsNaN(float64(g[i])) || d > atol+rtol*math.Abs(float64(c[i])) {
			p.t.Fatalf("%s: element %d: gpu %v, cpu %v", name, i, g[i], c[i])
		}
		if d > worst {
			worst, at = d, i
		}
	}
	p.t.Logf("%s: %d elements, max |gpu-cpu| %.3g (at %d)", name, len(g), worst, at)
}

func TestEmbeddingGatherCopyFill(t *testing.T) {
	p := newPair(t)
	table := p.random(device.BF16, 1, 100, 72)
	ids := p.ints([]int32{5, 99, 0, 5, 42})
	out := p.random(device.BF16, 1, 5, 72)
	p.gpu.Embedding(out.g, table.g, ids.g, 0, 100)
	p.cpu.Embedding(out.c, table.c, ids.c, 0, 100)
	p.close("embedding", out, 0, 0)
	// A tensor-parallel rank's part of a vocabulary of 200: ids 100..199;
	// 5, 99 and 0 give zero rows (hidden 36 takes the kernel's scalar path).
	for _, hidden := range []int{72, 36} {
		part := p.random(device.BF16, 1, 100, hidden)
		ids := p.ints([]int32{5, 199, 0, 100, 142, 99})
		emb := p.random(device.BF16, 1, 6, hidden)
		p.gpu.Embedding(emb.g, part.g, ids.g, 100, 200)
		p.cpu.Embedding(emb.c, part.c, ids.c, 100, 200)
		p.close(fmt.Sprint("embedding of part of the vocabulary, hidden ", hidden), emb, 0, 0)
	}
	rows := p.ints([]int32{4, 0, 2})
	sel := p.random(device.BF16, 1, 3, 72)
	p.gpu.GatherRows(sel.g, out.g, rows.g)
	p.cpu.GatherRows(sel.c, out.c, rows.c)
	p.close("gather_rows", sel, 0, 0)
	cp := p.random(device.BF16, 1, 3, 72)
	p.gpu.Copy(cp.g, sel.g)
	p.cpu.Copy(cp.c, sel.c)
	p.close("copy", cp, 0, 0)
	for _, dt := range []device.DType{device.BF16, device.F32} {
		f := p.random(dt, 1, 1000)
		p.gpu.Fill(f.g, 0.75)
		p.cpu.Fill(f.c, 0.75)
		p.close("fill "+dt.String(), f, 0, 0)
	}
}

// TestFillUniform: --load-format dummy's draws on the GPU are the host's
// (device.UniformAt) bit for bit, rounded to bf16 as an upload rounds them.
func TestFillUniform(t *testing.T) {
	p := newPair(t)
	for _, dt := range []device.DType{device.BF16, device.F32} {
		for _, n := range []int{1000, 3<<20 + 5} {
			seed, step := uint64(n)*0x51ed27, device.UniformStep(0.0625)
			want := make([]float32, n)
			for i := range want {
				want[i] = device.UniformAt(seed, uint64(i), step)
			}
			f := p.floats(dt, want, n)
			p.gpu.Fill(f.g, 0) // so that a fill that writes nothing fails
			p.gpu.FillUniform(f.g, seed, step)
			p.close(fmt.Sprintf("fill uniform %s, %d", dt, n), f, 0, 0)
		}
	}
}

// TestConvert covers the dtype conversions: bf16 to float32 eight at a time
// (a multiple of 8) or one at a time, and float32 to bf16.
func TestConvert(t *testing.T) {
	p := newPair(t)
	for _, n := range []int{8 * 1237, 1001, 8} {
		src, dst := p.random(device.BF16, 3, n), p.random(device.F32, 1, n)
		p.gpu.Convert(dst.g, src.g)
		p.cpu.Convert(dst.c, src.c)
		p.close(fmt.Sprintf("bf16 to f32, %d", n), dst, 0, 0)
		src32, dst16 := p.random(device.F32, 3, n), p.random(device.BF16, 1, n)
		p.gpu.Convert(dst16.g, src32.g)
		p.cpu.Convert(dst16.c, src32.c)
		p.close(fmt.Sprintf("f32 to bf16, %d", n), dst16, 0, 1.0/256)
	}
}

func TestRMSNorms(t *testing.T) {
	p := newPair(t)
	for _, dim := range []int{64, 1024, 1000, 998} {
		x := p.random(device.BF16, 2, 7, dim)
		w := p.random(device.BF16, 0.3, dim)
		out := p.random(device.BF16, 1, 7, dim)
		p.gpu.RMSNorm(out.g, x.g, w.g, 1e-6)
		p.cpu.RMSNorm(out.c, x.c, w.c, 1e-6)
		p.close("rmsnorm", out, 1e-2, 1.6e-2)
		res := p.random(device.BF16, 3, 7, dim)
		p.gpu.AddRMSNorm(res.g, x.g, out.g, w.g, 1e-6)
		p.cpu.AddRMSNorm(res.c, x.c, out.c, w.c, 1e-6)
		p.close("add_rmsnorm residual", res, 2e-2, 8e-3)
		p.close("add_rmsnorm out", out, 2e-2, 2e-2)
		// Tensor-parallel partial sums arrive in float32.
		x32 := p.random(device.F32, 2, 7, dim)
		p.gpu.AddRMSNorm(res.g, x32.g, out.g, w.g, 1e-6)
		p.cpu.AddRMSNorm(res.c, x32.c, out.c, w.c, 1e-6)
		// The GPU rounds x to bf16 before adding, as a bf16 matmul output is.
		p.close("add_rmsnorm f32 x residual", res, 5e-2, 8e-3)
		p.close("add_rmsnorm f32 x out", out, 2e-2, 2e-2)
	}
}

// sampleArgs uploads per-row parameters to both devices.
func sampleArgs(p *pair, temp, topP []float32, topK []int32, minP []float32, keys []int32, ntop int) [2]device.SampleArgs {
	b := len(temp)
	t, tp, tk, mp, u := p.floats(device.F32, temp, b), p.floats(device.F32, topP, b), p.ints(topK), p.floats(device.F32, minP, b), p.ints(keys)
	ids, lps := p.ints(make([]int32, b)), p.floats(device.F32, make([]float32, b), b)
	var out [2]device.SampleArgs
	var tids, tlps both
	if ntop > 0 {
		tids, tlps = p.ints(make([]int32, b*ntop), b, ntop), p.floats(device.F32, make([]float32, b*ntop), b, ntop)
	}
	for i, pick := range []func(both) device.Tensor{func(x both) device.Tensor { return x.g }, func(x both) device.Tensor { return x.c }} {
		out[i] = device.SampleArgs{Temperature: pick(t), TopP: pick(tp), TopK: pick(tk), MinP: pick(mp), Keys: pick(u),
			IDs: pick(ids), Logprobs: pick(lps), TopIDs: pick(tids), TopLogprobs: pick(tlps)}
	}
	return out
}

func TestSample(t *testing.T) {
	p := newPair(t)
	temp := []float32{0, 0.7, 1, 1, 0.8, 1.2, 1, 0.5}
	topP := []float32{1, 1, 1, 0.9, 1, 0.8, 0.3, 0.95}
	topK := []int32{-1, -1, 20, -1, -1, 50, -1, 1}
	minP := []float32{0, 0, 0, 0, 0.05, 0.01, 0, 0}
	b := len(temp)
	var mismatches int
	for trial := 0; trial < 8; trial++ {
		// Odd trials read bf16 logits, as decode graphs do; the later ones
		// a vocabulary of whole 16-byte loads, the scan's fast path.
		dt, v := device.F32, 5003
		if trial%2 == 1 {
			dt = device.BF16
		}
		if trial >= 4 {
			v = 5008
		}
		logits := p.random(dt, 3, b, v)
		keys := make([]int32, 2*b)
		for i := range keys {
			keys[i] = int32(p.rng.Uint32())
		}
		uni := keys
		args := sampleArgs(p, temp, topP, topK, minP, keys, 5)
		p.gpu.Sample(logits.g, args[0])
		p.cpu.Sample(logits.c, args[1])
		p.sync()
		gi, ci := make([]int32, b), make([]int32, b)
		p.gpu.DownloadI32(args[0].IDs, gi)
		p.cpu.DownloadI32(args[1].IDs, ci)
		for r := range gi {
			if gi[r] != ci[r] {
				mismatches++
				t.Logf("trial %d row %d (T=%v top_p=%v top_k=%d min_p=%v key=%x): gpu %d, cpu %d", trial, r, temp[r], topP[r], topK[r], minP[r], uni[2*r], gi[r], ci[r])
			}
		}
		p.close("sampled logprobs", both{args[0].Logprobs, args[1].Logprobs}, 1e-4, 1e-5)
		p.close("top logprobs", both{args[0].TopLogprobs, args[1].TopLogprobs}, 1e-4, 1e-5)
		gt, ct := make([]int32, b*5), make([]int32, b*5)
		p.gpu.DownloadI32(args[0].TopIDs, gt)
		p.cpu.DownloadI32(args[1].TopIDs, ct)
		for i := range gt {
			if gt[i] != ct[i] {
				t.Fatalf("top ids differ at %d: gpu %v cpu %v", i, gt, ct)
			}
		}
	}
	// Float sums in a different order may move a draw that lands within
	// rounding of a boundary; anything more is a bug.
	if mismatches > 1 {
		t.Fatalf("%d of %d draws differ", mismatches, 8*b)
	}
}

func TestResolveTokens(t *testing.T) {
	p := newPair(t)
	tokens := p.ints([]int32{5, 6, 7, 8})
	src := p.ints([]int32{2, -1, 0, 3})
	prev := p.ints([]int32{100, 101, 102, 103})
	p.gpu.ResolveTokens(tokens.g, src.g, prev.g)
	p.cpu.ResolveTokens(tokens.c, src.c, prev.c)
	p.sync()
	g, c := make([]int32, 4), make([]int32, 4)
	p.gpu.DownloadI32(tokens.g, g)
	p.cpu.DownloadI32(tokens.c, c)
	if g[0] != 102 || g[1] != 6 || g[2] != 100 || g[3] != 103 || g != nil && c[0] != g[0] || c[1] != g[1] || c[2] != g[2] || c[3] != g[3] {
		t.Fatalf("gpu %v cpu %v", g, c)
	}
}

func TestPenaltiesAndTokenLogprobs(t *testing.T) {
	p := newPair(t)
	const v = 777
	logits := p.random(device.F32, 2, 3, v)
	rowptr := p.ints([]int32{0, 3, 3, 5})
	toks := p.ints([]int32{1, 500, 776, 0, 10})
	counts := p.ints([]int32{0, 2, 1, 3, 0})
	bias := p.floats(device.F32, []float32{0, 0, float32(math.Inf(-1)), 0.5, 0}, 5)
	rep := p.floats(device.F32, []float32{1.3, 1, 0.8}, 3)
	freq := p.floats(device.F32, []float32{0.5, 0, 0}, 3)
	pres := p.floats(device.F32, []float32{0.2, 0, 1}, 3)
	for i, pick := range []func(both) device.Tensor{func(x both) device.Tensor { return x.g }, func(x both) device.Tensor { return x.c }} {
		a := device.PenaltyArgs{RowPtr: pick(rowptr), Tokens: pick(toks), Counts: pick(counts), Bias: pick(bias),
			Repetition: pick(rep), Frequency: pick(freq), Presence: pick(pres)}
		if i == 0 {
			p.gpu.ApplyPenalties(logits.g, a)
		} else {
			p.cpu.ApplyPenalties(logits.c, a)
		}
	}
	p.close("penalties", logits, 1e-6, 1e-6)
	targets := p.ints([]int32{3, 0, 776})
	out := p.floats(device.F32, make([]float32, 3), 3)
	logits2 := p.random(device.F32, 2, 3, v)
	p.gpu.TokenLogprobs(out.g, logits2.g, targets.g)
	p.cpu.TokenLogprobs(out.c, logits2.c, targets.c)
	p.close("token_logprobs", out, 1e-4, 1e-5)
}

func TestGraphReplayReadsCurrentInputs(t *testing.T) {
	p := newPair(t)
	x := p.random(device.BF16, 1, 4, 256)
	w := p.floats(device.BF16, onesPlus(p, 256), 256)
	out := p.random(device.BF16, 1, 4, 256)
	g, err := p.gpu.CaptureGraph(func() { p.gpu.RMSNorm(out.g, x.g, w.g, 1e-6) })
	if err != nil {
		t.Fatal(err)
	}
	defer g.Destroy()
	for i := 0; i < 3; i++ {
		x = p.refill(x, 1+float32(i))
		if err := g.Replay(); err != nil {
			t.Fatal(err)
		}
		p.cpu.RMSNorm(out.c, x.c, w.c, 1e-6)
		p.close("graph replay", out, 1e-2, 1.6e-2)
	}
}

// refill writes new values into both copies of b, keeping its addresses.
func (p *pair) refill(b both, scale float32) both {
	vals := make([]float32, b.c.Numel())
	for i := range vals {
		vals[i] = math.Float32frombits(uint32(safetensors.BF16Bits(float32(p.rng.NormFloat64())*scale)) << 16)
	}
	if err := p.gpu.Upload(b.g, model.F32Bytes(vals), device.F32); err != nil {
		p.t.Fatal(err)
	}
	if err := p.cpu.Upload(b.c, model.F32Bytes(vals), device.F32); err != nil {
		p.t.Fatal(err)
	}
	return b
}

// TestSkipList: EBB_SKIP_KERNELS names kernels for launch to leave out,
// always or (name:repeats) where their arguments repeat the last launch's.
func TestSkipList(t *testing.T) {
	for _, c := range []struct {
		env    string
		always kernelSet
		repeat []string
	}{
		{"", nil, nil},
		{" , ", nil, nil},
		{"moe_route", kernelSet{"moe_route": true}, nil},
		{"moe_route, gemv_m1,", kernelSet{"moe_route": true, "gemv_m1": true}, nil},
		{"moe_sort:repeats", nil, []string{"moe_sort"}},
		{"moe_route,moe_sort:repeats", kernelSet{"moe_route": true}, []string{"moe_sort"}},
		{":repeats", nil, nil},
	} {
		always, repeat := skipList(c.env)
		if !maps.Equal(always, c.always) || (always == nil) != (c.always == nil) ||
			!slices.Equal(slices.Sorted(maps.Keys(repeat)), c.repeat) || (repeat == nil) != (c.repeat == nil) {
			t.Errorf("skipList(%q) = %v, %v, want %v, %v", c.env, always, repeat, c.always, c.repeat)
		}
	}
	d := &Device{ctx: &Context{SMs: 132}, k: map[string]*Kernel{}, skipKernels: kernelSet{"gemv_m1": true}}
	d.launch("gemv_m1", D1(1), D1(256), 0) // not loaded, but skipped: no error
	if d.err != nil {
		t.Fatalf("skipped kernel: %v", d.err)
	}
	d.skipRepeats = lastLaunches{"moe_sort": {1, 2}}
	d.launch("moe_sort", D1(1), D1(1024), 0, 1, 2) // the last launch's arguments: skipped
	if d.err != nil {
		t.Fatalf("repeated launch not skipped: %v", d.err)
	}
	d.launch("moe_sort", D1(1), D1(1024), 0, 1, 3) // new arguments: launched (and, not loaded, an error)
	if d.err == nil || !slices.Equal(d.skipRepeats["moe_sort"], []uint64{1, 3}) {
		t.Fatalf("launch with new arguments: err %v, last %v", d.err, d.skipRepeats["moe_sort"])
	}
}
