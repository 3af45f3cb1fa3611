package cuda

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"ebb/device"
	"ebb/device/cpu"
	"ebb/memory"
	"ebb/model"
	"ebb/safetensors"
)

// pair runs the same operation on the GPU and on the CPU reference.
type pair struct {
	t   *testing.T
	gpu *Device
	cpu *cpu.Device
	rng *rand.Rand
}

type both struct{ g, c device.Tensor }

func newPair(t *testing.T) *pair {
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

func TestMatMul(t *testing.T) {
	p := newPair(t)
	// An H100's kernels are built for sm_90a, so that matmul_wg runs and
	// is what this test checks for its rows.
	if major, _, err := NVRTCVersion(); err == nil && major >= 12 && p.gpu.ctx.CCMajor == 9 && p.gpu.ctx.CCMinor == 0 &&
		os.Getenv("EBB_MATMUL_WG") != "0" {
		if got := p.gpu.matMulKernel(64, 1024, 1024); got != "matmul_wg_n64" {
			t.Fatalf("64 rows on %s run %s, not matmul_wg_n64", p.gpu.mod.Arch, got)
		}
	}
	for _, s := range []struct{ m, k, n int }{{1, 256, 300}, {1, 1024, 301}, {2, 2048, 1024}, {3, 1024, 4096}, {1, 1024, 6145}, {4, 256, 8000}, {8, 3072, 1024}, {37, 256, 300}, {128, 1024, 3072},
		// matmul_tc (2 to 16 rows): one and two tiles, K splits, ragged
		// N; a K that is no multiple of 32 goes to cuBLAS.
		{5, 1024, 301}, {16, 2048, 1024}, {12, 256, 40}, {9, 12288, 512}, {13, 1000, 64}, {64, 3072, 1024}, {200, 2048, 1000},
		// matmul_tc with three tiles (17 to 24 rows).
		{17, 1024, 4096}, {24, 3072, 1024}, {20, 96, 512}, {23, 1024, 301},
		// matmul_wg's narrow products (25 to 256 rows on sm_90a); a K that
		// is no multiple of 64 or an N no multiple of 16 goes to cuBLAS.
		{32, 2048, 1024}, {48, 3072, 1024}, {128, 2048, 1008}, {33, 96, 512}, {40, 1024, 1000}} {
		x := p.random(device.BF16, 1, s.m, s.k)
		w := p.random(device.BF16, 1/float32(math.Sqrt(float64(s.k))), s.n, s.k)
		bias := p.random(device.BF16, 0.5, s.n)
		out := p.random(device.BF16, 1, s.m, s.n)
		p.gpu.MatMul(out.g, x.g, w.g, bias.g)
		p.cpu.MatMul(out.c, x.c, w.c, bias.c)
		p.close("matmul bf16+bias", out, 2e-2, 2e-2)
		logits := p.random(device.F32, 1, s.m, s.n)
		p.gpu.MatMul(logits.g, x.g, w.g, device.Tensor{})
		p.cpu.MatMul(logits.c, x.c, w.c, device.Tensor{})
		p.close("matmul f32 out", logits, 1e-3, 1e-3)
	}
}

// TestMatMulWG runs matmul_wg on shapes MatMul gives it and on those it
// leaves to cuBLAS: every batch tile, one to eight K splits, N past the
// last full tile, fp32 and bf16 out.
func TestMatMulWG(t *testing.T) {
	p := newPair(t)
	if !p.gpu.wgmma {
		t.Skipf("matmul_wg needs sm_90a kernels (these are %s)", p.gpu.mod.Arch)
	}
	for _, s := range []struct{ m, k, n int }{{25, 1024, 4096}, {32, 2048, 1024}, {48, 3072, 1024}, {64, 1024, 6144},
		{90, 1024, 4096}, {128, 2048, 1008}, {100, 1024, 304}, {97, 64, 256}, {128, 3072, 1024}, {120, 4096, 2048}} {
		x := p.random(device.BF16, 1, s.m, s.k)
		w := p.random(device.BF16, 1/float32(math.Sqrt(float64(s.k))), s.n, s.k)
		out := p.random(device.BF16, 1, s.m, s.n)
		p.gpu.matMulWG(out.g.Ptr, false, x.g.Ptr, w.g.Ptr, s.m, s.n, s.k, false)
		p.cpu.MatMul(out.c, x.c, w.c, device.Tensor{})
		p.close(fmt.Sprintf("matmul_wg %+v", s), out, 2e-2, 2e-2)
		logits := p.random(device.F32, 1, s.m, s.n)
		p.gpu.matMulWG(logits.g.Ptr, true, x.g.Ptr, w.g.Ptr, s.m, s.n, s.k, false)
		p.cpu.MatMul(logits.c, x.c, w.c, device.Tensor{})
		p.close(fmt.Sprintf("matmul_wg f32 %+v", s), logits, 1e-3, 1e-3)
	}
}

// TestMatMulSameBits: matmul_tc adds its K splits in a fixed order (and
// cuBLAS's products do not split K), so running one twice gives the same
// bits.
func TestMatMulSameBits(t *testing.T) {
	p := newPair(t)
	for _, s := range []struct{ m, k, n int }{{8, 2048, 1024}, {24, 3072, 1024}, {128, 1024, 4096}, {64, 3072, 1024}} {
		x := p.random(device.BF16, 1, s.m, s.k)
		w := p.random(device.BF16, 1/float32(math.Sqrt(float64(s.k))), s.n, s.k)
		first, again := p.random(device.F32, 1, s.m, s.n), p.random(device.F32, 1, s.m, s.n)
		p.gpu.MatMul(first.g, x.g, w.g, device.Tensor{})
		p.gpu.MatMul(again.g, x.g, w.g, device.Tensor{})
		p.sameBits(fmt.Sprintf("matmul run twice %+v", s), again.g, first.g)
	}
}

// cpuMatMulAddRMSNorm is what the fused kernels stand for, on the CPU:
// out = in @ w^T, in being x or, with silu, SiLUMul(x) (through act); then
// AddRMSNorm into res and normed.
func cpuMatMulAddRMSNorm(p *pair, out, x, w, act both, silu bool, res, normed, normW both) {
	in := x.c
	if silu {
		p.cpu.SiLUMul(act.c, x.c)
		in = act.c
	}
	p.cpu.MatMul(out.c, in, w.c, device.Tensor{})
	p.cpu.AddRMSNorm(res.c, out.c, normed.c, normW.c, 1e-6)
}

// TestMatMulAddRMSNorm compares the fused decode kernel with the CPU's
// separate SiLUMul, MatMul and AddRMSNorm, which define its result; twice
// in a row, as the counter that elects the last block must reset itself.
func TestMatMulAddRMSNorm(t *testing.T) {
	p := newPair(t)
	for _, s := range []struct {
		m, k, n int
		silu    bool
	}{{1, 1024, 1024, false}, {1, 2048, 1024, false}, {1, 3072, 1024, true}, {1, 384, 384, true}, {1, 4096, 4096, false}, {1, 1024, 1000, true}, {1, 1024, 301, false}} {
		kin := s.k
		if s.silu {
			kin = 2 * s.k
		}
		x := p.random(device.BF16, 2, s.m, kin)
		w := p.random(device.BF16, 1/float32(math.Sqrt(float64(s.k))), s.n, s.k)
		normW := p.random(device.BF16, 0.3, s.n)
		out := p.random(device.BF16, 1, s.m, s.n)
		normed := p.random(device.BF16, 1, s.m, s.n)
		act := p.random(device.BF16, 1, s.m, s.k)
		for range 2 {
			res := p.random(device.BF16, 3, s.m, s.n) // fresh: errors would compound
			if !p.gpu.MatMulAddRMSNorm(out.g, x.g, w.g, s.silu, res.g, normed.g, normW.g, 1e-6) {
				t.Fatalf("%+v: not fused", s)
			}
			cpuMatMulAddRMSNorm(p, out, x, w, act, s.silu, res, normed, normW)
			// The CPU's silu_mul does not round silu(gate) to bf16 before
			// the product as the GPU's does: its activations differ by
			// an ulp, and K of them add up in out.
			tol := 2e-2
			if s.silu {
				tol = 3e-2
			}
			p.close("fused out", out, tol, 2e-2)
			p.close("fused residual", res, 3e-2, 1e-2)
			p.close("fused normed", normed, 3e-2, 3e-2)
		}
	}
	x := p.random(device.BF16, 1, 2, 256)
	if p.gpu.MatMulAddRMSNorm(p.random(device.BF16, 1, 2, 64).g, x.g, p.random(device.BF16, 1, 64, 256).g, false,
		p.random(device.BF16, 1, 2, 64).g, p.random(device.BF16, 1, 2, 64).g, p.random(device.BF16, 1, 64).g, 1e-6) {
		t.Fatal("fused for 2 rows")
	}
}

// TestMatMulAddThenRMSNormMatMul compares gemv_fused's squares mode and
// the gemv that normalises its residual as it reads it (and with glu
// applies silu to gate and up) with the CPU's MatMul, AddRMSNorm, MatMul
// and SiLUMul; twice in a row, as in decode.
func TestMatMulAddThenRMSNormMatMul(t *testing.T) {
	p := newPair(t)
	for _, s := range []struct {
		m, k, hidden, n int
		silu, glu       bool
	}{
		{1, 2048, 1024, 4096, false, false}, {1, 2048, 1024, 6144, false, true}, {1, 3072, 1024, 6144, true, false},
		{1, 384, 512, 384, true, true}, {1, 2048, 1024, 1000, false, false}, {1, 256, 512, 1002, false, true},
		{1, 64, 4096, 256, false, false},
	} {
		kin, ny := s.k, s.n
		if s.silu {
			kin = 2 * s.k
		}
		if s.glu {
			ny = s.n / 2
		}
		x := p.random(device.BF16, 2, s.m, kin)
		w := p.random(device.BF16, 1/float32(math.Sqrt(float64(s.k))), s.hidden, s.k)
		next := p.random(device.BF16, 1/float32(math.Sqrt(float64(s.hidden))), s.n, s.hidden)
		normW := p.random(device.BF16, 0.3, s.hidden)
		out := p.random(device.BF16, 1, s.m, s.hidden)
		normed := p.random(device.BF16, 1, s.m, s.hidden)
		act := p.random(device.BF16, 1, s.m, s.k)
		gateUp := p.random(device.BF16, 1, s.m, s.n)
		y := p.random(device.BF16, 1, s.m, ny)
		for range 2 {
			res := p.random(device.BF16, 3, s.m, s.hidden)
			if !p.gpu.MatMulAdd(x.g, w.g, s.silu, res.g) {
				t.Fatalf("%+v: not fused", s)
			}
			if !p.gpu.RMSNormMatMul(y.g, res.g, normW.g, next.g, 1e-6, s.glu) {
				t.Fatalf("%+v: glu not fused", s)
			}
			cpuMatMulAddRMSNorm(p, out, x, w, act, s.silu, res, normed, normW)
			if s.glu {
				p.cpu.MatMul(gateUp.c, normed.c, next.c, device.Tensor{})
				p.cpu.SiLUMul(y.c, gateUp.c)
			} else {
				p.cpu.MatMul(y.c, normed.c, next.c, device.Tensor{})
			}
			p.close("squares residual", res, 3e-2, 1e-2)
			p.close(fmt.Sprintf("normalising matmul (glu %v)", s.glu), y, 4e-2, 3e-2)
		}
	}
	// Two rows are not fused: the model adds and normalises on its own.
	if p.gpu.MatMulAdd(p.random(device.BF16, 1, 2, 128).g, p.random(device.BF16, 1, 256, 128).g, false, p.random(device.BF16, 1, 2, 256).g) {
		t.Fatal("fused for two rows")
	}
	// A normalising matmul needs the sums of the residual it reads.
	res := p.random(device.BF16, 1, 1, 256)
	if !p.gpu.MatMulAdd(p.random(device.BF16, 1, 1, 128).g, p.random(device.BF16, 1, 256, 128).g, false, res.g) {
		t.Fatal("not fused")
	}
	other := p.random(device.BF16, 1, 1, 256)
	p.gpu.RMSNormMatMul(p.random(device.BF16, 1, 1, 64).g, other.g, p.random(device.BF16, 1, 256).g, p.random(device.BF16, 1, 64, 256).g, 1e-6, false)
	if err := p.gpu.Sync(); err == nil || !strings.Contains(err.Error(), "rmsnorm matmul") {
		t.Fatalf("normalising matmul on another residual: %v", err)
	}
}

// TestMatMulSiLU compares the fused gate_up products (the gemv whose warp
// groups take a gate and its up, for one row; matmul_tc whose warps do,
// for 2 to 24 rows) with the CPU's MatMul then SiLUMul, and matmul_tc's
// with the GPU's own MatMul then SiLUMul, which it must equal bit for bit.
func TestMatMulSiLU(t *testing.T) {
	p := newPair(t)
	for _, s := range []struct{ m, k, inter int }{{1, 1024, 3072}, {1, 4096, 6144}, {1, 256, 501},
		{2, 1024, 3072}, {8, 4096, 6144}, {13, 256, 501}, {24, 1024, 3072}, {19, 2048, 100},
		{25, 1024, 3072}, {64, 1024, 3072}, {128, 2048, 104}, {100, 1024, 3072}} {
		x := p.random(device.BF16, 1, s.m, s.k)
		w := p.random(device.BF16, 1/float32(math.Sqrt(float64(s.k))), 2*s.inter, s.k)
		gateUp := p.random(device.BF16, 1, s.m, 2*s.inter)
		out := p.random(device.BF16, 1, s.m, s.inter)
		if !p.gpu.MatMulSiLU(out.g, x.g, w.g) {
			t.Fatalf("%+v: not fused", s)
		}
		p.cpu.MatMul(gateUp.c, x.c, w.c, device.Tensor{})
		p.cpu.SiLUMul(out.c, gateUp.c)
		p.close(fmt.Sprintf("matmul silu %+v", s), out, 2e-2, 2e-2)
		if s.m == 1 {
			continue
		}
		apart := p.random(device.BF16, 1, s.m, s.inter)
		if s.m > 8*matMulTCMaxTiles { // the product as matmul_wg forms it; MatMul leaves gate_up to cuBLAS
			p.gpu.matMulWG(gateUp.g.Ptr, false, x.g.Ptr, w.g.Ptr, s.m, 2*s.inter, s.k, false)
		} else {
			p.gpu.MatMul(gateUp.g, x.g, w.g, device.Tensor{})
		}
		p.gpu.SiLUMul(apart.g, gateUp.g)
		p.sameBits(fmt.Sprintf("matmul silu %+v against product then silu_mul", s), out.g, apart.g)
	}
	if rows := 8*matMulTCMaxTiles + 1; !p.gpu.wgmma &&
		p.gpu.MatMulSiLU(p.random(device.BF16, 1, rows, 64).g, p.random(device.BF16, 1, rows, 256).g, p.random(device.BF16, 1, 128, 256).g) {
		t.Fatalf("fused for %d rows without matmul_wg", rows)
	}
	if p.gpu.MatMulSiLU(p.random(device.BF16, 1, 129, 64).g, p.random(device.BF16, 1, 129, 256).g, p.random(device.BF16, 1, 128, 256).g) {
		t.Fatal("fused for 129 rows")
	}
}

func TestSiLUMul(t *testing.T) {
	p := newPair(t)
	for _, inter := range []int{200, 203} { // vectorised, and not
		gu := p.random(device.BF16, 2, 9, 2*inter)
		out := p.random(device.BF16, 1, 9, inter)
		p.gpu.SiLUMul(out.g, gu.g)
		p.cpu.SiLUMul(out.c, gu.c)
		p.close("silu_mul", out, 1e-2, 2e-2)
	}
}

func ropeTables(p *pair, positions, half int) (cos, sin both) {
	cfg := &model.Config{HeadDim: 2 * half, RopeTheta: 10000, Rope: model.RopeScaling{Type: "default"}}
	c, s := cfg.RopeTables(positions)
	return p.floats(device.F32, c, positions, half), p.floats(device.F32, s, positions, half)
}

func TestPrepareQKV(t *testing.T) {
	for _, tc := range []struct {
		name      string
		hq, hk, d int
		norm      bool
		tokens    int
	}{{"qwen3", 16, 8, 128, true, 6}, {"qwen2", 4, 2, 64, false, 6}, {"mqa-small-dim", 6, 1, 16, true, 6},
		{"d24-lane-pairs", 4, 2, 24, true, 6},          // not a multiple of 16: prepare_qkv's bf16x2 lanes
		{"qwen3-prefill", 16, 8, 128, true, 300},       // 128-thread blocks
		{"qwen3-long-prefill", 16, 8, 128, true, 2100}, // prepare_qkv16
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t)
			slots := tc.tokens + 44
			qkv := p.random(device.BF16, 1.5, tc.tokens, tc.hq+2*tc.hk, tc.d)
			var qn, kn both
			if tc.norm { // weights near 1, as trained norms are
				qn, kn = p.floats(device.BF16, onesPlus(p, tc.d), tc.d), p.floats(device.BF16, onesPlus(p, tc.d), tc.d)
			}
			positions, slotIDs := []int32{0, 1, 7, 300, 1023, 4}, []int32{3, 17, 0, 49, 22, 8}
			if tc.tokens != len(positions) {
				positions, slotIDs = nil, nil
				for i, s := range p.rng.Perm(slots)[:tc.tokens] {
					positions, slotIDs = append(positions, int32(i%1024)), append(slotIDs, int32(s))
				}
			}
			pos, sl := p.ints(positions), p.ints(slotIDs)
			cos, sin := ropeTables(p, 1024, tc.d/2)
			kc := p.random(device.BF16, 1, slots, tc.hk, tc.d)
			vc := p.random(device.BF16, 1, slots, tc.hk, tc.d)
			p.gpu.PrepareQKV(qkv.g, qn.g, kn.g, pos.g, cos.g, sin.g, kc.g, vc.g, sl.g, 1e-6)
			p.cpu.PrepareQKV(qkv.c, qn.c, kn.c, pos.c, cos.c, sin.c, kc.c, vc.c, sl.c, 1e-6)
			p.closeQueries("q", qkv, tc.hq, tc.hk, tc.d, 3e-2)
			p.close("k cache", kc, 3e-2, 3e-2)
			p.close("v cache", vc, 0, 0)
		})
	}
}

// closeQueries compares the q heads of qkv [T, hq+2hk, d] (the k and v
// heads are left unspecified by PrepareQKV).
func (p *pair) closeQueries(name string, qkv both, hq, hk, d int, tol float64) {
	p.t.Helper()
	g, c := p.download(qkv)
	row := (hq + 2*hk) * d
	for i := range g {
		if i%row >= hq*d {
			continue
		}
		if diff := math.Abs(float64(g[i]) - float64(c[i])); math.IsNaN(float64(g[i])) || diff > tol+tol*math.Abs(float64(c[i])) {
			p.t.Fatalf("%s: token %d element %d: gpu %v, cpu %v", name, i/row, i%row, g[i], c[i])
		}
	}
}

// clone uploads a copy of b's CPU values to both devices.
func (p *pair) clone(dtype device.DType, b both) both {
	p.t.Helper()
	_, c := p.download(b)
	return p.floats(dtype, c, b.c.Shape...)
}

// TestPrepareAttention: the prefill kernel normalising and rotating the
// queries itself gives the bits of PrepareQKV then Attention on the GPU,
// and the CPU reference within bf16 rounding, in prefill and mixed steps
// (of 32k (token, head) units or more: smaller steps keep prepare_qkv).
func TestPrepareAttention(t *testing.T) {
	cases := []struct {
		name          string
		hq, hk, d     int
		norm          bool
		qlens, kvlens []int
	}{
		{"prefill-qwen3", 16, 8, 128, true, []int{5, 400, 1, 600, 130}, []int{5, 500, 33, 600, 300}},
		{"mixed-qwen3", 16, 8, 128, true, []int{1, 1, 1, 400, 1, 700}, []int{90, 1, 600, 400, 33, 900}},
		{"mixed-d64-g3-no-norm", 12, 4, 64, false, []int{1, 1, 1700}, []int{400, 7, 1800}},
		// Sixteen query heads a kv head: no decode kernel, so the decodes
		// take the prefill kernel and its query preparation too.
		{"mixed-g16", 32, 2, 128, true, []int{1, 1000}, []int{50, 1000}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t)
			out, qkv, kc, vc, meta := attnCase(p, tc.hq, tc.hk, tc.d, tc.qlens, tc.kvlens)
			idx := make([]int32, meta[1].KVIndices.Numel())
			if err := p.cpu.DownloadI32(meta[1].KVIndices, idx); err != nil {
				t.Fatal(err)
			}
			var positions, slots []int32
			kv0 := 0
			for i, q := range tc.qlens {
				for j := tc.kvlens[i] - q; j < tc.kvlens[i]; j++ {
					positions = append(positions, int32(j))
					slots = append(slots, idx[kv0+j])
				}
				kv0 += tc.kvlens[i]
			}
			pos, sl := p.ints(positions), p.ints(slots)
			cos, sin := ropeTables(p, slices.Max(tc.kvlens), tc.d/2)
			var qn, kn both
			if tc.norm {
				qn, kn = p.floats(device.BF16, onesPlus(p, tc.d), tc.d), p.floats(device.BF16, onesPlus(p, tc.d), tc.d)
			}
			qkv2, kc2, vc2, out2 := p.clone(device.BF16, qkv), p.clone(device.BF16, kc), p.clone(device.BF16, vc), p.clone(device.BF16, out)
			scale, eps := float32(1/math.Sqrt(float64(tc.d))), float32(1e-6)
			if !p.gpu.PrepareAttention(out.g, qkv.g, qn.g, kn.g, pos.g, cos.g, sin.g, kc.g, vc.g, sl.g, meta[0], scale, eps) {
				t.Fatal("PrepareAttention did not apply")
			}
			p.gpu.PrepareQKV(qkv2.g, qn.g, kn.g, pos.g, cos.g, sin.g, kc2.g, vc2.g, sl.g, eps)
			p.gpu.Attention(out2.g, qkv2.g, kc2.g, vc2.g, meta[0], scale)
			p.cpu.PrepareQKV(qkv.c, qn.c, kn.c, pos.c, cos.c, sin.c, kc.c, vc.c, sl.c, eps)
			p.cpu.Attention(out.c, qkv.c, kc.c, vc.c, meta[1], scale)
			p.close("attention", out, 2e-2, 2e-2)
			p.close("k cache", kc, 3e-2, 3e-2)
			p.close("v cache", vc, 0, 0)
			p.sameBits("attention", out.g, out2.g)
			p.sameBits("k cache", kc.g, kc2.g)
			p.sameBits("v cache", vc.g, vc2.g)
			// A step of a few hundred tokens keeps prepare_qkv.
			sout, sqkv, skc, svc, smeta := attnCase(p, tc.hq, tc.hk, tc.d, []int{100}, []int{100})
			spos := p.ints(make([]int32, 100))
			if p.gpu.PrepareAttention(sout.g, sqkv.g, qn.g, kn.g, spos.g, cos.g, sin.g, skc.g, svc.g, spos.g, smeta[0], scale, eps) {
				t.Fatal("PrepareAttention applied to a 100-token step")
			}
		})
	}
}

// sameBits fails unless GPU tensors a (the path under test) and b (the
// reference path) hold the same bits.
func (p *pair) sameBits(name string, a, b device.Tensor) {
	p.t.Helper()
	p.sync()
	av, bv := make([]float32, a.Numel()), make([]float32, b.Numel())
	if err := errors.Join(p.gpu.DownloadF32(a, av), p.gpu.DownloadF32(b, bv)); err != nil {
		p.t.Fatal(err)
	}
	for i := range av {
		if math.Float32bits(av[i]) != math.Float32bits(bv[i]) {
			p.t.Fatalf("%s: element %d: %v, reference path %v", name, i, av[i], bv[i])
		}
	}
}

// TestPrepareQKVLayouts checks that prepare_qkv16 (bf16x2 arithmetic in
// the 16-byte layout) gives prepare_qkv's bits (fp32 rounded after every
// operation): a prompt's K, prepared by the one, meets decodes' K, prepared
// by the other, in the same cache.
func TestPrepareQKVLayouts(t *testing.T) {
	for _, tc := range []struct {
		name      string
		hq, hk, d int
		norm      bool
	}{{"qwen3", 16, 8, 128, true}, {"d64-no-norm", 12, 4, 64, false}, {"d16", 6, 1, 16, true}} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t)
			const tokens, slots = 700, 800
			// Multiples of 1/8 up to 2: every partial sum of squares is exact
			// in fp32, so both kernels' heads get the same inverse root
			// (they add the squares in different orders).
			vals := make([]float32, tokens*(tc.hq+2*tc.hk)*tc.d)
			for i := range vals {
				vals[i] = float32(p.rng.IntN(33)-16) / 8
			}
			qkv := p.floats(device.BF16, vals, tokens, tc.hq+2*tc.hk, tc.d)
			var qn, kn both
			if tc.norm {
				qn, kn = p.floats(device.BF16, onesPlus(p, tc.d), tc.d), p.floats(device.BF16, onesPlus(p, tc.d), tc.d)
			}
			var positions, slotIDs []int32
			for _, s := range p.rng.Perm(slots)[:tokens] {
				positions, slotIDs = append(positions, int32(p.rng.IntN(4096))), append(slotIDs, int32(s))
			}
			pos, sl := p.ints(positions), p.ints(slotIDs)
			cos, sin := ropeTables(p, 4096, tc.d/2)
			kc, vc := p.random(device.BF16, 1, slots, tc.hk, tc.d), p.random(device.BF16, 1, slots, tc.hk, tc.d)
			qkv2, kc2, vc2 := p.clone(device.BF16, qkv), p.clone(device.BF16, kc), p.clone(device.BF16, vc)
			heads := qkv.g.Dim(1)
			p.gpu.prepareQKV(qkv.g, qn.g, kn.g, pos.g, cos.g, sin.g, kc.g, vc.g, sl.g, 1e-6, tokens, 0, heads, true)
			p.gpu.prepareQKV(qkv2.g, qn.g, kn.g, pos.g, cos.g, sin.g, kc2.g, vc2.g, sl.g, 1e-6, tokens, 0, heads, false)
			p.sameBits("qkv", qkv.g, qkv2.g)
			p.sameBits("k cache", kc.g, kc2.g)
			p.sameBits("v cache", vc.g, vc2.g)
		})
	}
}

func onesPlus(p *pair, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = 1 + 0.1*float32(p.rng.NormFloat64())
	}
	return v
}

// attnCase builds caches and metadata for sequences with the given query
// and KV lengths (queries are the last positions).
func attnCase(p *pair, hq, hk, d int, qlens, kvlens []int) (out, qkv, kc, vc both, meta [2]device.AttnMeta) {
	tokens, total := 0, 0
	for i := range qlens {
		tokens += qlens[i]
		total += kvlens[i]
	}
	slots := total + 10
	perm := p.rng.Perm(slots)
	qptr, kvptr, idx := []int32{0}, []int32{0}, []int32{}
	maxQ, maxKV, decodes := 0, 0, 0
	for i := range qlens {
		if decodes == i && qlens[i] == 1 {
			decodes++
		}
		for j := 0; j < kvlens[i]; j++ {
			idx = append(idx, int32(perm[len(idx)]))
		}
		qptr = append(qptr, qptr[i]+int32(qlens[i]))
		kvptr = append(kvptr, kvptr[i]+int32(kvlens[i]))
		maxQ, maxKV = max(maxQ, qlens[i]), max(maxKV, kvlens[i])
	}
	qkv = p.random(device.BF16, 1, tokens, hq+2*hk, d)
	kc = p.random(device.BF16, 1, slots, hk, d)
	vc = p.random(device.BF16, 1, slots, hk, d)
	out = p.random(device.BF16, 1, tokens, hq, d)
	q, kv, ix := p.ints(qptr), p.ints(kvptr), p.ints(idx)
	for i, pick := range []func(both) device.Tensor{func(b both) device.Tensor { return b.g }, func(b both) device.Tensor { return b.c }} {
		meta[i] = device.AttnMeta{NumSeqs: len(qlens), MaxQLen: maxQ, MaxKVLen: maxKV, Decodes: decodes, QIndptr: pick(q),
			KVIndptr: pick(kv), KVIndices: pick(ix)}
	}
	return
}

func TestAttention(t *testing.T) {
	cases := []struct {
		name          string
		hq, hk, d     int
		qlens, kvlens []int
	}{
		{"decode-qwen3", 16, 8, 128, []int{1, 1, 1}, []int{1, 70, 1500}},
		{"decode-mqa", 6, 1, 24, []int{1, 1}, []int{33, 200}},
		{"decode-g4-d64", 16, 4, 64, []int{1, 1, 1, 1}, []int{5, 64, 65, 9}},
		{"decode-g1-d256", 4, 4, 256, []int{1}, []int{300}},
		{"decode-many", 16, 8, 128, repeat(1, 200), repeat(130, 200)},
		{"prefill-qwen3", 16, 8, 128, []int{5, 40, 1, 100}, []int{5, 100, 33, 100}},
		{"prefill-g3-d48", 6, 2, 48, []int{17, 2}, []int{20, 70}},
		{"prefill-g8-d16", 8, 1, 16, []int{70}, []int{200}},
		// attention_fast.cu: vectorised decode and tensor-core prefill.
		{"decode-default-model-g3-d64", 6, 2, 64, []int{1, 1, 1}, []int{1, 200, 4000}},
		{"decode-tiny-d32", 4, 2, 32, []int{1, 1}, []int{3, 129}},
		{"decode-g4-d128-long", 32, 8, 128, []int{1, 1}, []int{4096, 777}},
		{"decode-b1-64-splits", 16, 8, 128, []int{1}, []int{4000}},
		// Contexts of very different lengths: long ones take more than one
		// split by their share of the batch, also where the batch alone
		// fills the GPU.
		{"decode-ragged-small-batch", 16, 8, 128, []int{1, 1, 1, 1}, []int{4000, 100, 65, 1}},
		{"decode-ragged-full-gpu", 16, 8, 128, repeat(1, 80), raggedContexts(80)},
		{"decode-ragged-one-wave", 16, 8, 128, repeat(1, 48), raggedContexts(48)},
		{"prefill-mma-d128-ragged", 16, 8, 128, []int{1, 63, 64, 65, 130, 7}, []int{1, 63, 100, 65, 300, 500}},
		{"prefill-mma-d64-g3", 6, 2, 64, []int{200, 33}, []int{200, 97}},
		{"prefill-mma-d128-long", 16, 8, 128, []int{700}, []int{1000}},
		{"prefill-mma-g4-two-heads-a-block", 32, 8, 128, []int{70, 5, 130}, []int{100, 5, 130}},
		// A mixed step: decodes first (decode kernel), then prompts (a
		// one-token chunk among them stays with the prefill kernel).
		{"mixed-decodes-first", 16, 8, 128, []int{1, 1, 1, 40, 1, 70}, []int{90, 1, 600, 40, 33, 200}},
		{"mixed-d64-g3", 6, 2, 64, []int{1, 1, 129}, []int{4000, 7, 129}},
		// Sparse: a last layer on the logit rows alone (one query at the
		// last position, none for sequences without a logit row).
		{"sparse-d128", 16, 8, 128, []int{1, 0, 1, 1, 0}, []int{1, 128, 300, 65, 20}},
		{"sparse-d64-g3", 6, 2, 64, []int{0, 1, 1}, []int{40, 4000, 7}},
		{"sparse-d32", 4, 2, 32, []int{1, 0, 1}, []int{3, 5, 129}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t)
			out, qkv, kc, vc, meta := attnCase(p, tc.hq, tc.hk, tc.d, tc.qlens, tc.kvlens)
			if strings.HasPrefix(tc.name, "sparse") {
				for i := range meta {
					meta[i].Sparse, meta[i].Decodes = true, 0
				}
			}
			scale := float32(1 / math.Sqrt(float64(tc.d)))
			p.gpu.Attention(out.g, qkv.g, kc.g, vc.g, meta[0], scale)
			p.cpu.Attention(out.c, qkv.c, kc.c, vc.c, meta[1], scale)
			p.close("attention", out, 2e-2, 2e-2)
		})
	}
}

// TestDecodeVecWaves: shares of an eighth of the GPU's blocks only where
// the batch's (sequence, kv head) pairs fill half to all of one wave.
func TestDecodeVecWaves(t *testing.T) {
	for _, c := range []struct{ pairs, want int }{{8, 4}, {264, 4}, {265, 8}, {512, 8}, {528, 8}, {529, 4}, {2048, 4}} {
		if got := decodeVecWaves(c.pairs, 132); got != c.want {
			t.Errorf("decodeVecWaves(%d, 132) = %d, want %d", c.pairs, got, c.want)
		}
	}
}

// raggedContexts is one context in eight of 3,000 positions, the rest short.
func raggedContexts(n int) []int {
	c := make([]int, n)
	for i := range c {
		c[i] = 60 + i
		if i%8 == 0 {
			c[i] = 3000 - i
		}
	}
	return c
}

func repeat(v, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = v
	}
	return s
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

// TestBenchMatMul: the kernel benchmark names the kernel MatMul picks for
// each row count and times it.
func TestBenchMatMul(t *testing.T) {
	p := newPair(t)
	// 25 to 128 rows: matmul_wg where its kernels were built, in its 32-
	// to 128-row tiles.
	wg32, wg128 := "cublasGemmEx", "cublasGemmEx"
	if p.gpu.wgmma {
		wg32, wg128 = "matmul_wg_n32", "matmul_wg_n128"
	}
	for _, c := range []struct {
		m      int
		kernel string
	}{{1, "gemv_m1"}, {8, "matmul_tc_t1"}, {16, "matmul_tc_t2"}, {24, "matmul_tc_t3"}, {25, wg32}, {128, wg128}, {129, "cublasGemmEx"}} {
		r, err := BenchMatMul(p.gpu, MatMulBenchSpec{M: c.m, N: 1024, K: 2048, Iters: 3})
		if err != nil {
			t.Fatal(err)
		}
		if r.Kernel != c.kernel || !(r.MinUs > 0 && r.MedianUs >= r.MinUs && r.GBPerS > 0 && r.TFLOPS > 0) {
			t.Fatalf("%d rows: %+v, want kernel %s and positive times", c.m, r, c.kernel)
		}
	}
	if _, err := BenchMatMul(p.gpu, MatMulBenchSpec{M: 0, N: 8, K: 8, Iters: 1}); err == nil {
		t.Fatal("zero rows accepted")
	}
}

// TestMatMulAccumulate: out += x @ w^T for a prefill's rows, against the
// sum in float64 of the same bf16 values; decode-sized x is left to the
// separate add.
func TestMatMulAccumulate(t *testing.T) {
	p := newPair(t)
	const m, n, k = 1100, 48, 64
	x, w, out := p.random(device.BF16, 1, m, k), p.random(device.BF16, 1, n, k), p.random(device.BF16, 1, m, n)
	xs, _ := p.download(x)
	ws, _ := p.download(w)
	before, _ := p.download(out)
	if !p.gpu.MatMulAccumulate(out.g, x.g, w.g) {
		t.Fatal("MatMulAccumulate did not apply to 1100 rows")
	}
	after, _ := p.download(out)
	worst := 0.0
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			want := float64(before[i*n+j])
			for l := 0; l < k; l++ {
				want += float64(xs[i*k+l]) * float64(ws[j*k+l])
			}
			got := float64(after[i*n+j])
			if d := math.Abs(got - want); d > 1e-2+1e-2*math.Abs(want) {
				t.Fatalf("row %d col %d: %v, want %v", i, j, got, want)
			} else if d > worst {
				worst = d
			}
		}
	}
	t.Logf("max |gpu-float64| %.3g", worst)
	small := p.random(device.BF16, 1, 16, k)
	if p.gpu.MatMulAccumulate(out.g.Rows(0, 16), small.g, w.g) {
		t.Fatal("MatMulAccumulate applied to 16 rows")
	}
}
