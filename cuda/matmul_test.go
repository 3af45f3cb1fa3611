package cuda

import (
	"fmt"
	"math"
	"os"
	"strings"
	"testing"

	"ebb/device"
)

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
	for _, s := range []struct{ m, k, n int }{{1, 256, 300}, {1, 1024, 301}, {1, 2048, 1001}, {1, 4096, 6144}, {1, 3072, 301}, {2, 2048, 1024}, {3, 1024, 4096}, {1, 1024, 6145}, {4, 256, 8000}, {8, 3072, 1024}, {37, 256, 300}, {128, 1024, 3072},
		// matmul_tc (2 to 16 rows): one and two tiles, K splits, ragged
		// N; a K that is no multiple of 32 goes to cuBLAS.
		{5, 1024, 301}, {16, 2048, 1024}, {12, 256, 40}, {9, 12288, 512}, {13, 1000, 64}, {64, 3072, 1024}, {200, 2048, 1000},
		// matmul_tc with three tiles (17 to 24 rows).
		{17, 1024, 4096}, {24, 3072, 1024}, {20, 96, 512}, {23, 1024, 301},
		// matmul_wg's narrow products (25 to 256 rows on sm_90a); a K that
		// is no multiple of 64 or an N no multiple of 16 goes to cuBLAS.
		{32, 2048, 1024}, {48, 3072, 1024}, {128, 2048, 1008}, {33, 96, 512}, {40, 1024, 1000},
		// matmul_wg_few: 2 to 8 rows of weights of 16 MiB or more (sm_90a).
		{2, 4096, 4096}, {5, 12288, 1024}, {8, 2048, 4096}, {13, 4096, 4096}} {
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
// leaves to cuBLAS: every batch tile, one to eight K splits, up to 48
// weight tiles (the 8B o_proj at 16 rows, the 30B-A3B qkv at 12), N past
// the last full tile, fp32 and bf16 out.
func TestMatMulWG(t *testing.T) {
	p := newPair(t)
	if !p.gpu.wgmma {
		t.Skipf("matmul_wg needs sm_90a kernels (these are %s)", p.gpu.mod.Arch)
	}
	for _, s := range []struct{ m, k, n int }{{25, 1024, 4096}, {32, 2048, 1024}, {48, 3072, 1024}, {64, 1024, 6144},
		{90, 1024, 4096}, {128, 2048, 1008}, {100, 1024, 304}, {97, 64, 256}, {128, 3072, 1024}, {120, 4096, 2048},
		{16, 4096, 4096}, {12, 2048, 5120}} {
		x := p.random(device.BF16, 1, s.m, s.k)
		w := p.random(device.BF16, 1/float32(math.Sqrt(float64(s.k))), s.n, s.k)
		out := p.random(device.BF16, 1, s.m, s.n)
		p.gpu.matMulWG(out.g.Ptr, false, x.g.Ptr, w.g.Ptr, s.m, s.n, s.k, false, normFold{})
		p.cpu.MatMul(out.c, x.c, w.c, device.Tensor{})
		p.close(fmt.Sprintf("matmul_wg %+v", s), out, 2e-2, 2e-2)
		logits := p.random(device.F32, 1, s.m, s.n)
		p.gpu.matMulWG(logits.g.Ptr, true, x.g.Ptr, w.g.Ptr, s.m, s.n, s.k, false, normFold{})
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

// TestMatMulAddThenRMSNormMatMul compares the products that add to the
// residual and leave its sums of squares (gemv_fused's squares mode for
// one row, matmul_tc's for 2-8, matmul_wg's for 25-48) and those that
// normalise it as they read it (and with glu apply silu to gate and up)
// with the CPU's MatMul, AddRMSNorm, MatMul and SiLUMul; twice in a row,
// as in decode.
func TestMatMulAddThenRMSNormMatMul(t *testing.T) {
	p := newPair(t)
	type addCase struct {
		m, k, hidden, n int
		silu, glu       bool
	}
	cases := []addCase{
		{1, 2048, 1024, 4096, false, false}, {1, 2048, 1024, 6144, false, true}, {1, 3072, 1024, 6144, true, false},
		{1, 384, 512, 384, true, true}, {1, 2048, 1024, 1000, false, false}, {1, 256, 512, 1002, false, true},
		{1, 64, 4096, 256, false, false},
	}
	// matmul_tc's rows: o_proj then gate_up with silu, down then qkv.
	for _, m := range []int{2, 5, 8} {
		cases = append(cases, addCase{m, 2048, 1024, 6144, false, true})
	}
	cases = append(cases, addCase{6, 3072, 1024, 4096, false, false}, addCase{3, 384, 512, 1002, false, true})
	if p.gpu.wgmma {
		// o_proj then gate_up with silu, at each batch tile and between;
		// down then a product narrow enough for matmul_wg.
		for _, m := range []int{25, 32, 40, 48} {
			cases = append(cases, addCase{m, 2048, 1024, 6144, false, true})
		}
		cases = append(cases, addCase{37, 3072, 1024, 1024, false, false})
		// 67 tiles: no K split, the ring goes round four times.
		cases = append(cases, addCase{48, 256, 2048, 67 * 128, false, true})
	}
	for _, s := range cases {
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
			if !p.gpu.MatMulAdd(x.g, w.g, s.silu, res.g, next.g, s.glu) {
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
	// Where the next product would not normalise its input (a product
	// too wide for matmul_wg, more rows than the norm modes take) or the
	// input needs silu first, the model adds and normalises on its own.
	for _, s := range []struct {
		m, n int
		silu bool
	}{{32, 4096, false}, {64, 6144, false}, {16, 6144, false}, {8, 1024, true}} {
		kin := 1024
		if s.silu {
			kin = 2048
		}
		if p.gpu.MatMulAdd(p.random(device.BF16, 1, s.m, kin).g, p.random(device.BF16, 1, 1024, 1024).g, s.silu,
			p.random(device.BF16, 1, s.m, 1024).g, p.random(device.BF16, 1, s.n, 1024).g, false) {
			t.Fatalf("fused for %d rows before a %d-wide product (silu %v)", s.m, s.n, s.silu)
		}
	}
	// A normalising matmul needs the sums of the residual it reads.
	res := p.random(device.BF16, 1, 1, 256)
	if !p.gpu.MatMulAdd(p.random(device.BF16, 1, 1, 128).g, p.random(device.BF16, 1, 256, 128).g, false, res.g,
		p.random(device.BF16, 1, 64, 256).g, false) {
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
// for 2 to 24 rows of small weights; matmul_wg's threads, for more) with
// the CPU's MatMul then SiLUMul, and with the GPU's own product (MatMul, or
// matmul_wg's) then SiLUMul, which they must equal bit for bit.
func TestMatMulSiLU(t *testing.T) {
	p := newPair(t)
	for _, s := range []struct{ m, k, inter int }{{1, 1024, 3072}, {1, 4096, 6144}, {1, 256, 501}, {1, 2048, 501},
		{2, 1024, 3072}, {8, 4096, 6144}, {13, 256, 501}, {24, 1024, 3072}, {19, 2048, 100},
		{25, 1024, 3072}, {64, 1024, 3072}, {128, 2048, 104}, {100, 1024, 3072}, {20, 4096, 6144}, {12, 4096, 6144}} {
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
		if p.gpu.matMulRoute(s.m, 2*s.inter, s.k, true) == routeWG { // the product as matmul_wg forms it; MatMul leaves gate_up to cuBLAS
			p.gpu.matMulWG(gateUp.g.Ptr, false, x.g.Ptr, w.g.Ptr, s.m, 2*s.inter, s.k, false, normFold{})
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

// TestBenchMatMul: the kernel benchmark names the kernel MatMul picks for
// each row count and times it.
func TestBenchMatMul(t *testing.T) {
	p := newPair(t)
	// One row of 1,024 columns: 128 blocks, one wave (gemvShape). 25 to
	// 128 rows: matmul_wg where its kernels were built, in its 32-
	// to 128-row tiles.
	wg32, wg128 := "cublasGemmEx", "cublasGemmEx"
	if p.gpu.wgmma {
		wg32, wg128 = "matmul_wg_n32", "matmul_wg_n128"
	}
	for _, c := range []struct {
		m      int
		kernel string
	}{{1, "gemv_m1_one_wave"}, {8, "matmul_tc_t1"}, {16, "matmul_tc_t2"}, {24, "matmul_tc_t3"}, {25, wg32}, {128, wg128}, {129, "cublasGemmEx"}} {
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

// TestMatMulRoute: which kernels take a decode product, by rows and weight
// size, on an H100-like device (132 SMs, matmul_wg built). It needs no GPU.
func TestMatMulRoute(t *testing.T) {
	d := &Device{ctx: &Context{SMs: 132}, wgmma: true, few: fewSettings{rows: matMulFewRows}}
	for _, c := range []struct {
		m, n, k int
		glu     bool
		want    matMulRoute
	}{
		{1, 6144, 1024, false, routeGemv},
		{8, 6144, 1024, false, routeTC},
		{24, 6144, 1024, false, routeTC},     // 0.6B qkv: 12.6 MB
		{24, 6144, 1024, true, routeTC},      // 0.6B gate_up
		{16, 151936, 1024, false, routeBLAS}, // 0.6B lm_head: 311 MB
		{8, 24576, 4096, true, routeFew},     // 8B gate_up, 201 MB
		{2, 4096, 4096, false, routeFew},     // 8B o_proj, 34 MB
		{8, 6144, 4096, false, routeFew},     // 8B qkv
		{9, 4096, 4096, false, routeWG},      // past 8 rows matmul_tc keeps small weights only
		{9, 6144, 4096, false, routeWG},      // 8B qkv, 50 MB
		{17, 4096, 4096, false, routeWG},     // 8B o_proj: 32 tiles
		{64, 6144, 4096, false, routeWG},     // 8B qkv: 48 tiles
		{64, 10240, 5120, false, routeBLAS},  // 32B qkv: 80 tiles
		{17, 24576, 4096, true, routeWG},     // 8B gate_up with silu
		{24, 4096, 2048, false, routeWG},     // exactly 16 MiB: past matmul_tc
		{25, 1024, 2048, false, routeWG},     // 0.6B o_proj
		{129, 1024, 2048, false, routeBLAS},
	} {
		if got := d.matMulRoute(c.m, c.n, c.k, c.glu); got != c.want {
			t.Errorf("%d rows of %dx%d (glu %v): route %d, want %d", c.m, c.n, c.k, c.glu, got, c.want)
		}
	}
	d.foldTC, d.foldWG = true, true
	for _, c := range []struct {
		m, n, k int
		glu     bool
		want    matMulRoute
	}{
		{32, 1024, 2048, false, routeWG},   // 0.6B o_proj adds to the residual
		{32, 6144, 1024, true, routeWG},    // 0.6B gate_up normalises it
		{32, 4096, 1024, false, routeBLAS}, // 0.6B qkv: 32 tiles on matmul_wg, not folded
		{32, 4096, 4096, false, routeBLAS}, // 8B o_proj
		{64, 1024, 2048, false, routeBLAS}, // past matMulWGNormRows
		{8, 4096, 4096, false, routeBLAS},  // matmul_wg_few
	} {
		if got := d.foldRoute(c.m, c.n, c.k, c.glu); got != c.want {
			t.Errorf("fold, %d rows of %dx%d (glu %v): route %d, want %d", c.m, c.n, c.k, c.glu, got, c.want)
		}
	}
	d.wgMaxTiles = 16 // EBB_MATMUL_WG_TILES=16: the 8B o_proj's 32 tiles back on cuBLAS
	if got := d.matMulRoute(17, 4096, 4096, false); got != routeBLAS {
		t.Errorf("EBB_MATMUL_WG_TILES=16: route %d, want cuBLAS", got)
	}
	d.wgMaxTiles = 0
	d.few.rows = 0 // EBB_MATMUL_FEW=0: one tile of matmul_tc keeps every weight
	if got := d.matMulRoute(8, 24576, 4096, true); got != routeTC {
		t.Errorf("EBB_MATMUL_FEW=0: route %d, want matmul_tc", got)
	}
	d.tcLarge = true // EBB_MATMUL_TC=all
	if got := d.matMulRoute(17, 24576, 4096, true); got != routeTC {
		t.Errorf("EBB_MATMUL_TC=all: route %d, want matmul_tc", got)
	}
}

// TestGemvOneWave (no GPU): a one-row gemv whose grid is one wave at five
// blocks an SM takes the kernel without the launch bound; larger grids and
// more rows keep it.
func TestGemvOneWave(t *testing.T) {
	cases := []struct {
		name    string
		m, n, k int
		glu     bool
		want    string
	}{
		{"30B-A3B qkv, 320 blocks", 1, 5120, 2048, false, "gemv2_m1_one_wave"},
		{"0.6B qkv, 512 blocks", 1, 4096, 1024, false, "gemv_m1_one_wave"},
		{"0.6B gate and up, 384 blocks", 1, 6144, 1024, true, "gemv2_m1_one_wave"},
		{"8B gate and up, 1,536 blocks", 1, 24576, 4096, true, "gemv2_m1"},
		{"lm_head", 1, 151936, 2048, false, "gemv2_m1"},
		{"two rows", 2, 5120, 2048, false, "gemv2_m2"},
	}
	loaded := map[string]bool{}
	for _, n := range kernelNames {
		loaded[n] = true
	}
	for _, c := range cases {
		d := &Device{ctx: &Context{SMs: 132}}
		name, _, blocks := d.gemvShape(c.m, c.n, c.k, c.glu)
		if name != c.want {
			t.Errorf("%s: %s (%d blocks), want %s", c.name, name, blocks, c.want)
		}
		if c.m == 1 && !loaded[name] {
			t.Errorf("%s: %s is not loaded", c.name, name)
		}
	}
}

// TestKernelNamesForEveryRowCount asks for the kernels of every row count a
// step can hold (a decode batch to a whole prefill chunk) over the shapes
// of the models ebb serves: each name the routing builds must be one that
// OpenDevice loads (no GPU needed).
func TestKernelNamesForEveryRowCount(t *testing.T) {
	loaded := map[string]bool{"cublasGemmEx": true}
	for _, n := range kernelNames {
		loaded[n] = true
	}
	shapes := []struct{ n, k int }{
		{6144, 1024}, {1024, 2048}, {6144, 1024}, {151936, 1024}, // 0.6B
		{6144, 4096}, {4096, 4096}, {24576, 4096}, {4096, 12288}, // 8B
		{64, 64}, {96, 32}, // tiny test models
	}
	det := &Device{ctx: &Context{SMs: 132}, wgmma: true, det: true}
	for _, s := range shapes {
		for m := 1; m <= 9000 && detProductFits(s.n, s.k); m++ {
			// Deterministic inference runs every product on matmul_wg.
			if name, _, _, _, _ := det.matMulWGShape(m, s.n, s.k); !loaded[name] {
				t.Fatalf("%d rows of %dx%d (deterministic): kernel %q is not loaded", m, s.n, s.k, name)
			}
		}
	}
	for _, wg := range []bool{false, true} {
		d := &Device{ctx: &Context{SMs: 132}, wgmma: wg, few: fewSettings{rows: detFewMaxRows}}
		for _, s := range shapes {
			for m := 1; m <= 9000; m++ {
				if name := d.matMulKernel(m, s.n, s.k); !loaded[name] {
					t.Fatalf("%d rows of %dx%d (matmul_wg %v): kernel %q is not loaded", m, s.n, s.k, wg, name)
				}
				if d.matMulRoute(m, s.n, s.k, true) == routeGemv {
					if name, _, _ := d.gemvShape(m, s.n, s.k, true); !loaded[name] {
						t.Fatalf("%d rows of %dx%d with silu: kernel %q is not loaded", m, s.n, s.k, name)
					}
				}
			}
		}
	}
}

// TestMatMulWGPartShape (no GPU): matmul_wg_part takes a product where
// 128-row batch tiles alone fill the GPU and its weight tiles are split,
// persistent blocks running a tile's K in the splits' lengths (as few
// blocks as finish in the rounds one block an SM would take), and (64-row
// tiles) deterministic batches past 16 rows of products with 32
// weight tiles or more in 4 splits or more, (128-row tiles) past 128 rows
// in 2 or 3 splits; elsewhere, and with
// EBB_MATMUL_WG_PART=0, clusters split K.
func TestMatMulWGPartShape(t *testing.T) {
	for _, c := range []struct {
		name       string
		m, n, k    int
		noPart     bool
		want       string
		grid       Dim3
		kps, kpart int
		flagOff    bool
	}{
		{"o_proj, decode", 64, 1024, 2048, false, "matmul_wg_n64", Dim3{8, 1, 8}, 4, 0, false},
		{"o_proj, 16 tiles short of the SMs", 2048, 1024, 2048, false, "matmul_wg_n256", Dim3{8, 8, 8}, 4, 0, false},
		{"o_proj, 17 tiles of 128 rows", 2049, 1024, 2048, false, "matmul_wg_part_n128", Dim3{68, 1, 1}, 32, 4, false},
		{"o_proj, a prefill chunk", 8192, 1024, 2048, false, "matmul_wg_part_n128", Dim3{128, 1, 1}, 32, 4, false},
		{"o_proj, EBB_MATMUL_WG_PART=0", 8192, 1024, 2048, true, "matmul_wg_n256", Dim3{8, 32, 8}, 4, 0, false},
		{"gate_up (48 tiles, 2 splits)", 384, 6144, 1024, false, "matmul_wg_part_n128", Dim3{72, 1, 1}, 16, 8, false},
		{"gate_up (two splits), batch 256", 256, 6144, 1024, false, "matmul_wg_part_n128", Dim3{96, 1, 1}, 16, 8, false},
		{"gate_up (two splits), batch 129", 129, 6144, 1024, false, "matmul_wg_part_n128", Dim3{96, 1, 1}, 16, 8, false},
		{"gate_up (two splits), batch 128", 128, 6144, 1024, false, "matmul_wg_n128", Dim3{48, 1, 2}, 8, 0, false},
		{"gate_up (two splits), batch 256, flag off", 256, 6144, 1024, false, "matmul_wg_n256", Dim3{48, 1, 2}, 8, 0, true},
		{"qkv, batch 256", 256, 4096, 1024, false, "matmul_wg_part_n64", Dim3{128, 1, 1}, 16, 4, false},
		{"qkv, batch 64", 64, 4096, 1024, false, "matmul_wg_part_n64", Dim3{32, 1, 1}, 16, 4, false},
		{"qkv, batch 48", 48, 4096, 1024, false, "matmul_wg_part_n64", Dim3{32, 1, 1}, 16, 4, false},
		{"qkv, batch 17", 17, 4096, 1024, false, "matmul_wg_part_n64", Dim3{32, 1, 1}, 16, 4, false},
		{"qkv, batch 16 (matmul_wg_few's)", 16, 4096, 1024, false, "matmul_wg_n32", Dim3{32, 1, 4}, 4, 0, false},
		{"qkv, batch 64, flag off", 64, 4096, 1024, false, "matmul_wg_n64", Dim3{32, 1, 4}, 4, 0, true},
		{"o_proj, batch 256", 256, 1024, 2048, false, "matmul_wg_n256", Dim3{8, 1, 8}, 4, 0, false},
		{"down, uneven splits", 4096, 1024, 3072, false, "matmul_wg_part_n128", Dim3{128, 1, 1}, 48, 6, false},
		{"lm_head (one split)", 8192, 151936, 1024, false, "matmul_wg_n256", Dim3{1187, 32, 1}, 16, 0, false},
		{"lm_head, batch 256", 256, 151936, 1024, false, "matmul_wg_part_n128", Dim3{132, 1, 1}, 16, 16, false},
		{"lm_head, batch 193", 193, 151936, 1024, false, "matmul_wg_part_n128", Dim3{132, 1, 1}, 16, 16, false},
		{"lm_head, batch 192", 192, 151936, 1024, false, "matmul_wg_n192", Dim3{1187, 1, 1}, 16, 0, false},
		{"lm_head, batch 128", 128, 151936, 1024, false, "matmul_wg_n128", Dim3{1187, 1, 1}, 16, 0, false},
		{"lm_head, batch 256, flag off", 256, 151936, 1024, false, "matmul_wg_n256", Dim3{1187, 1, 1}, 16, 0, true},
	} {
		d := &Device{ctx: &Context{SMs: 132}, wgmma: true, det: !c.flagOff, noPart: c.noPart}
		name, _, grid, kps, kpart := d.matMulWGShape(c.m, c.n, c.k)
		if name != c.want || grid != c.grid || kps != c.kps || kpart != c.kpart {
			t.Errorf("%s: %s %v, %d k-steps a block, parts of %d; want %s %v, %d, %d", c.name, name, grid, kps, kpart,
				c.want, c.grid, c.kps, c.kpart)
		}
	}
	// EBB_MATMUL_WG_PERSIST=0: a block a tile (8 weight tiles x 64 batch tiles).
	d := &Device{ctx: &Context{SMs: 132}, wgmma: true, det: true, wgOneTile: true}
	if name, _, grid, _, _ := d.matMulWGShape(8192, 1024, 2048); name != "matmul_wg_part_n128" || grid != D1(512) {
		t.Errorf("a block a tile: %s %v, want matmul_wg_part_n128 %v", name, grid, D1(512))
	}
}

// TestMatMulWGSplitsFit: outside deterministic inference a product's
// clusters of K splits all run at once (an H200's counts), not in a second
// wave; deterministic products and a driver that cannot say keep 8.
func TestMatMulWGSplitsFit(t *testing.T) {
	h200 := clusterFit{0, 0, 66, 39, 30, 22, 17, 15, 15}
	for _, c := range []struct {
		name      string
		clusters  clusterFit
		det       bool
		capSplits int
		m, n, k   int
		grid      Dim3
		kps       int
	}{
		{"30B-A3B o_proj (16 tiles)", h200, false, 0, 64, 2048, 4096, Dim3{16, 1, 6}, 11},
		{"30B-A3B o_proj, deterministic", h200, true, 0, 64, 2048, 4096, Dim3{16, 1, 8}, 8},
		{"30B-A3B o_proj, clusters not known", clusterFit{}, false, 0, 64, 2048, 4096, Dim3{16, 1, 8}, 8},
		{"30B-A3B o_proj, EBB_MATMUL_WG_SPLITS=8", h200, false, 8, 64, 2048, 4096, Dim3{16, 1, 8}, 8},
		{"0.6B o_proj (8 tiles)", h200, false, 0, 64, 1024, 2048, Dim3{8, 1, 8}, 4},
		{"0.6B gate_up (48 tiles)", h200, false, 0, 64, 6144, 1024, Dim3{48, 1, 2}, 8},
	} {
		d := &Device{ctx: &Context{SMs: 132}, wgmma: true, det: c.det, wgClusters: c.clusters, wgSplits: c.capSplits}
		_, _, grid, kps, _ := d.matMulWGShape(c.m, c.n, c.k)
		if grid != c.grid || kps != c.kps {
			t.Errorf("%s: %v, %d k-steps a block; want %v, %d", c.name, grid, kps, c.grid, c.kps)
		}
	}
}

// TestMatMulWGFewWave: outside deterministic inference matmul_wg_few takes
// fewer K splits where that brings its blocks into one wave (residency by
// warps as an H200's driver gives it: 7 blocks an SM of one warp, 4 of two,
// 2 of three or four, 1 above); products that fit, deterministic ones, a
// driver that cannot say and EBB_MATMUL_FEW_WAVE=0 keep a full cluster's.
func TestMatMulWGFewWave(t *testing.T) {
	h200 := blocksByWarps{0, 924, 528, 264, 264, 132, 132, 132, 132} // cuOccupancyMaxActiveClusters, H200
	for _, c := range []struct {
		name                     string
		resident                 blocksByWarps
		det, anyWaves            bool
		n, k                     int
		blocks, per, splits, kps int
	}{
		{"30B-A3B qkv: 320 blocks of 3 warps in 1.2 waves", h200, false, false, 5120, 2048, 160, 2, 2, 16},
		{"30B-A3B qkv, deterministic", h200, true, false, 5120, 2048, 320, 1, 3, 11},
		{"30B-A3B qkv, EBB_MATMUL_FEW_WAVE=0", h200, false, true, 5120, 2048, 320, 1, 3, 11},
		{"30B-A3B qkv, residency not known", blocksByWarps{}, false, false, 5120, 2048, 320, 1, 3, 11},
		{"30B-A3B o_proj fits", h200, false, false, 2048, 4096, 128, 1, 8, 8},
		{"8B qkv fits", h200, false, false, 6144, 4096, 192, 2, 2, 32},
		{"8B o_proj fits", h200, false, false, 4096, 4096, 256, 1, 4, 16},
		{"8B gate_up: one split, more than a wave", h200, false, false, 24576, 4096, 384, 4, 1, 64},
	} {
		d := &Device{ctx: &Context{SMs: 132}, det: c.det, fewResident: c.resident, few: fewSettings{warps: 4, anyWaves: c.anyWaves}}
		blocks, per, splits, kps := d.matMulWGFewShape(c.n, c.k)
		if blocks != c.blocks || per != c.per || splits != c.splits || kps != c.kps {
			t.Errorf("%s: %d blocks of %d groups, %d splits of %d k-steps; want %d, %d, %d, %d", c.name,
				blocks, per, splits, kps, c.blocks, c.per, c.splits, c.kps)
		}
	}
}

// TestMatMulWGUsed: a block asks for the stages it fills and, with splits,
// room for its sums; never more than the whole ring.
func TestMatMulWGUsed(t *testing.T) {
	for _, c := range []struct {
		name            string
		bn, kps, splits int
		want            int
	}{
		{"o_proj at batch 1: 4 of 8 stages", 32, 4, 8, 4*(160*128) + 1024},
		{"gate_up at batch 1: the ring is full", 32, 8, 2, 8*(160*128) + 1024},
		{"a wrapping ring", 32, 16, 1, 8*(160*128) + 1024},
		{"one k-step: one stage, which holds the sums", 32, 1, 8, 160*128 + 1024},
		{"256 rows: the sums take the ring", 256, 2, 8, 256*128*4 + 1024},
	} {
		got := matMulWGUsed(c.bn, c.kps, c.splits)
		if got != c.want || got > matMulWGShared(c.bn) {
			t.Errorf("%s: %d bytes, want %d (whole ring %d)", c.name, got, c.want, matMulWGShared(c.bn))
		}
	}
}

// TestLaunchOfUnknownKernelIsAnError: a kernel name the device did not load
// fails the device with an error that names it; it does not launch nil.
func TestLaunchOfUnknownKernelIsAnError(t *testing.T) {
	d := &Device{ctx: &Context{SMs: 132}, k: map[string]*Kernel{}}
	d.launch("gemv_m0", D1(1), D1(256), 0)
	if d.err == nil || !strings.Contains(d.err.Error(), `"gemv_m0"`) {
		t.Fatalf("launch of an unknown kernel: %v", d.err)
	}
	d.err = nil
	d.launch("gemv_m0", D1(0), D1(256), 0) // an empty grid runs nothing
	if d.err != nil {
		t.Fatalf("empty grid: %v", d.err)
	}
}

// TestMatMulWGClusters logs the clusters of matmul_wg blocks this GPU runs
// at once (splitsCap's table) and checks they fit its SMs.
func TestMatMulWGClusters(t *testing.T) {
	p := newPair(t)
	if !p.gpu.wgmma {
		t.Skip("matmul_wg is not built for this GPU")
	}
	for s := 2; s <= matMulWGMaxCluster; s++ {
		n := p.gpu.wgClusters[s]
		t.Logf("clusters of %d: %d at once (%d SMs)", s, n, p.gpu.ctx.SMs)
		if n != 0 && (n < 1 || n*s > p.gpu.ctx.SMs) {
			t.Errorf("clusters of %d: %d at once on %d SMs", s, n, p.gpu.ctx.SMs)
		}
	}
	// matmul_wg_few's blocks: at least one an SM, fewer the more warps
	// (their rings take 25.6 KB a warp).
	for w := 1; w <= matMulWGMaxCluster; w++ {
		n := p.gpu.fewResident[w]
		t.Logf("matmul_wg_few blocks of %d warps: %d at once", w, n)
		if n != 0 && (n < p.gpu.ctx.SMs || w > 1 && n > p.gpu.fewResident[w-1]) {
			t.Errorf("matmul_wg_few blocks of %d warps: %d at once on %d SMs (%d of %d warps)", w, n, p.gpu.ctx.SMs, p.gpu.fewResident[w-1], w-1)
		}
	}
}
