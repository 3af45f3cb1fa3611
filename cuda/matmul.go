package cuda

import (
	"fmt"

	"ebb/device"
)

// The products: which kernels take a product of m rows (gemv, matmul_tc,
// matmul_wg or cuBLAS), and the fused forms the decode step uses.

// MatMul implements device.Device.
func (d *Device) MatMul(out, x, w, bias device.Tensor) {
	if d.err != nil {
		return
	}
	m, k, n := x.Dim(0), x.Dim(-1), w.Dim(0)
	if w.Dim(-1) != k || out.Numel() != m*n || x.DType != device.BF16 || w.DType != device.BF16 {
		d.fail(fmt.Errorf("matmul: x %v, w %v, out %v", x, w, out))
		return
	}
	if m == 0 {
		return
	}
	route := routeBLAS
	if x.Ptr%16 == 0 && w.Ptr%16 == 0 {
		route = d.matMulRoute(m, n, k, false)
	}
	outF32 := out.DType == device.F32
	switch {
	case d.det:
		d.detMatMul(out.Ptr, outF32, x.Ptr, w.Ptr, m, n, k, false)
	case route == routeGemv:
		name, wpo, blocks := d.gemvShape(m, n, k, false)
		d.launch(name, D1(blocks), D1(256), 0, P(out.Ptr), I(boolInt(outF32)), P(x.Ptr), P(w.Ptr), I(n), I(k), I(wpo),
			P(0), P(0), I(0), F(0), I(0))
	case route == routeTC:
		d.matMulTC(out.Ptr, outF32, x.Ptr, w.Ptr, m, n, k, false, normFold{})
	case route == routeWG:
		d.matMulWG(out.Ptr, outF32, x.Ptr, w.Ptr, m, n, k, false, normFold{})
	case route == routeFew:
		d.matMulWGFew(out.Ptr, outF32, x.Ptr, w.Ptr, m, n, k, false, normFold{})
	default:
		if !d.tunedMatMul(out.Ptr, outF32, x.Ptr, w.Ptr, m, n, k) {
			d.fail(d.blas.gemm(out.Ptr, outF32, x.Ptr, w.Ptr, m, n, k, false))
		}
	}
	if bias.Valid() {
		total := int64(m) * int64(n)
		name := "add_bias"
		if out.DType == device.F32 {
			name = "add_bias_f32"
		}
		d.launch(name, gridFor(total), D1(256), 0, P(out.Ptr), P(bias.Ptr), uint64(total), I(n))
	}
}

// MatMulAccumulate implements device.Accumulating for prefills (a
// thousand rows or more): out += x @ w^T in cuBLAS's epilogue, which reads
// out while the product is compute-bound, instead of a pass that reads the
// product back. Decode steps keep their kernels.
func (d *Device) MatMulAccumulate(out, x, w device.Tensor) bool {
	m, k, n := x.Dim(0), x.Dim(-1), w.Dim(0)
	if d.err != nil || d.det || m < 1024 || w.Dim(-1) != k || out.Numel() != m*n ||
		x.DType != device.BF16 || w.DType != device.BF16 || out.DType != device.BF16 {
		return false
	}
	d.fail(d.blas.gemm(out.Ptr, false, x.Ptr, w.Ptr, m, n, k, true))
	return true
}

func useGemv(m, k int) bool { return m <= gemvMaxRows && k%8 == 0 }

const (
	matMulTCWarps    = 8     // MMT_WARPS in matmul.cu
	matMulTCMaxTiles = 3     // the largest T of matmul_tc_t*
	matMulCountersAt = 32768 // its split counters, after the attention's in d.counters
)

// useMatMulTC says whether matmul_tc takes m rows of an n x k matrix.
// Past 24 its 16-column warps, each reading every row of x from L2, fall
// behind cuBLAS (H100, 0.6B shapes: at 8 and 16 rows 4.2-6.1 us against
// cuBLAS's 5.3-7.0, at 17-24 rows level with it but launched early like
// the kernels around it, decode steps 1-2% faster; at 32 rows decode steps
// 5% slower, at 128 the products two to three times slower). Past one tile
// it keeps only weights under matMulTCMaxBytes.
func (d *Device) useMatMulTC(m, n, k int) bool {
	return m > gemvMaxRows && m <= 8*matMulTCMaxTiles && k%32 == 0 &&
		(m <= 8 || 2*int64(n)*int64(k) < matMulTCMaxBytes || d.tcLarge)
}

// useMatMulFew says whether matmul_wg_few takes m rows (2 to 8) of an n x
// k product outside deterministic inference: weights of matMulTCMaxBytes
// or more, where matmul_tc reads more slowly than matmul_wg_few's rings,
// even with the norms it folds (H100, Qwen3-8B shape, one-batch ms a step,
// 128 in, 64 out, two rounds: batch 2 / 4 / 8 on matmul_tc 6.478 / 6.546 /
// 6.781 and 6.470 / 6.541 / 6.778, on matmul_wg_few 5.911 / 5.984 / 6.038
// and 5.912 / 5.987 / 6.031). The 0.6B model's weights (12.6 MB at most)
// stay on matmul_tc. EBB_MATMUL_FEW=0 leaves them all to matmul_tc.
func (d *Device) useMatMulFew(m, n, k int) bool {
	return d.wgmma && !d.det && m >= 2 && m <= d.few.rows && 2*int64(n)*int64(k) >= matMulTCMaxBytes &&
		detProductFits(n, k)
}

// matMulFewRows is the most rows matmul_wg_few takes outside deterministic
// inference (EBB_MATMUL_FEW sets it, up to detFewMaxRows): past 8 rows
// cuBLAS was faster (H100, 8B shape, batch 12 / 16: 6.630 / 6.698 ms a
// step against 7.080 / 7.064 on matmul_wg_few's two batch tiles).
const matMulFewRows = 8

// matMulTCMaxBytes: weights of this size or more go to matmul_tc for one
// tile (8 rows) only. With two or three tiles the x it reads again from L2
// (rows/16 of the weights' bytes) holds it well behind cuBLAS once a
// product is bound by reading its weights rather than by its launch
// (H100, Qwen3-8B's shapes, 16.8-201 MB: at 17-24 rows 1.4-1.8x cuBLAS's
// time at 25 rows, at 9-16 rows 1.0-1.3x; one-batch steps at 17 and 24
// rows 10.3 ms against 7.2 at 32). The 0.6B model's layers (12.6 MB at
// most) keep it. EBB_MATMUL_TC=all gives it every weight again.
const matMulTCMaxBytes = 16 << 20

// matMulTCShape picks matmul_tc's tile count T (8T rows) and grid (N/16
// column blocks, K splits) for m rows of an n x k matrix: K is split
// while that leaves fewer than two blocks per SM, every warp at least one
// 32-wide step and the partials room in d.partO (1024 x 2048 at 8 rows:
// four splits 4.2 us, two 4.9 us).
func (d *Device) matMulTCShape(m, n, k int) (string, Dim3) {
	t := (m + 7) / 8
	cols := (n + 15) / 16
	splits := 1
	for cols*splits*2 <= 2*d.ctx.SMs && k/32 >= 2*splits*matMulTCWarps &&
		int64(2*splits*cols*t*32*4)*4 <= d.partO.Bytes() && cols <= d.counters.Numel()-1-qkvHeadCounters-matMulCountersAt {
		splits *= 2
	}
	return fmt.Sprintf("matmul_tc_t%d", t), Dim3{uint32(cols), 1, uint32(splits)}
}

// matMulTC launches matmul_tc; with glu w is [gate | up] and out takes
// silu(gate) * up (n/2 columns, bf16).
func (d *Device) matMulTC(out uintptr, outF32 bool, x, w uintptr, m, n, k int, glu bool, norm normFold) {
	name, grid := d.matMulTCShape(m, n, k)
	d.launch(name, grid, D1(matMulTCWarps*32), 0, P(out), I(boolInt(outF32)), P(x), P(w), I(m), I(n), I(k),
		P(d.partO.Ptr), P(d.counters.Ptr+matMulCountersAt*4), I(boolInt(glu)),
		P(norm.residual), P(norm.normW), P(d.rowSquares.Ptr), I(norm.parts), F(norm.eps))
}

// normFold is a product's part in a decode layer's add_rmsnorm (matmul_tc
// and matmul_wg); the zero value is a plain product.
type normFold struct {
	residual uintptr // add mode: residual += the product, its rows' squares to d.rowSquares
	normW    uintptr // norm mode: x is such a residual, normalised as it is read
	parts    int     // norm mode: partial sums of squares a row in d.rowSquares
	eps      float32
}

// matMulTCNormRows is the most rows for which matmul_tc takes part in
// add_rmsnorm: one tile. H100, 0.6B decode steps (ms): batch 2 1.08 ->
// 1.01, 4 1.10 -> 1.05, 8 1.13 -> 1.08; with two and three tiles slower,
// 16 1.38 -> 1.41, 17 1.66 -> 1.75, 24 1.69 -> 1.77 (every warp
// normalises each tile's x as it loads it).
const matMulTCNormRows = 8

// foldRoute is the kernels that take part in add_rmsnorm for m rows (2 or
// more) of an n x k product (glu: gate_up with silu): matmul_tc up to
// matMulTCNormRows, matmul_wg from 25 to matMulWGNormRows, or none
// (routeBLAS). matmul_wg folds only products without glu of a full
// cluster's splits a tile (16 weight tiles on an H200): the 8B o_proj (32
// tiles) adding to the residual and gate_up normalising it made decode
// steps slower (H200, 128 in / 64 out, batch 32 5.091 -> 5.994 ms, 48
// 5.285 -> 6.452). EBB_NORM_FOLD=0 turns both off, =tc or =wg leaves one.
// Under deterministic inference, matmul_wg_few for detFold's rows.
func (d *Device) foldRoute(m, n, k int, glu bool) matMulRoute {
	if d.det { // a norm product: k is the hidden size
		if d.detFold(m, k) && detProductFits(n, k) {
			return routeFew
		}
		return routeBLAS
	}
	switch r := d.matMulRoute(m, n, k, glu); {
	case r == routeTC && d.foldTC && m <= matMulTCNormRows,
		r == routeWG && d.foldWG && m > 8*matMulTCMaxTiles && m <= matMulWGNormRows &&
			(glu || matMulWGTiles(n) <= d.ctx.SMs/matMulWGMaxCluster):
		return r
	}
	return routeBLAS
}

// foldParts is how many partial sums of squares the add mode of route
// leaves a row of n columns: one per column group (16, matmul_tc) or tile
// (128, matmul_wg).
func foldParts(route matMulRoute, n int) int {
	if route == routeTC {
		return (n + 15) / 16
	}
	return matMulWGTiles(n)
}

// matMulRoute is the family of kernels that takes a product.
type matMulRoute int

const (
	routeBLAS matMulRoute = iota // cuBLAS, with a tuned algorithm where one was timed
	routeGemv
	routeTC
	routeWG
	routeFew // matmul_wg_few
)

// matMulRoute picks the kernels for m rows of an n x k matrix with 16-byte
// aligned operands; with glu the product is gate_up with silu applied,
// which the gemvs do for one row only. MatMul, MatMulSiLU and the
// benchmark's kernel names all ask here, so that they cannot disagree.
func (d *Device) matMulRoute(m, n, k int, glu bool) matMulRoute {
	switch {
	case useGemv(m, k) && (!glu || m == 1):
		return routeGemv
	case d.useMatMulFew(m, n, k):
		return routeFew
	case d.useMatMulTC(m, n, k):
		return routeTC
	case d.useMatMulWG(m, n, k, glu):
		return routeWG
	}
	return routeBLAS
}

// matMulKernel names the kernel MatMul runs for aligned operands.
func (d *Device) matMulKernel(m, n, k int) string {
	switch d.matMulRoute(m, n, k, false) {
	case routeGemv:
		name, _, _ := d.gemvShape(m, n, k, false)
		return name
	case routeTC:
		name, _ := d.matMulTCShape(m, n, k)
		return name
	case routeWG:
		name, _, _, _, _ := d.matMulWGShape(m, n, k)
		return name
	case routeFew:
		return matMulWGFewName(m)
	}
	return "cublasGemmEx"
}

// gemvWarps is how many warps share one output column of a gemv: more for
// a narrow matrix, as long as the grid stays within four blocks per SM
// and every lane still has a 16-byte chunk of K to load. A grid that
// fills the GPU leaves no room for the next kernel's blocks, which start
// early (dependent launch) to load their weights while this one runs:
// at batch 1 up to eight warps a column (1,024 blocks for o_proj) made
// decode steps 1.29 ms, at most four blocks per SM 1.14 ms (H100).
func (d *Device) gemvWarps(n, k int) int {
	wpo := 1
	for wpo < 8 && n*2*wpo/8 <= 4*d.ctx.SMs && k/8/(2*wpo) >= 32 {
		wpo *= 2
	}
	return wpo
}

// gemvShape picks the gemv kernel for m rows of an n x k matrix, its
// warps per output column and its grid. Where even one warp a column
// would put more than four blocks per SM (gate_up, lm_head), a warp group
// takes two columns, forming each input chunk once for both (H100 decode
// steps: batch 2 1.26 -> 1.18 ms, batch 4 1.68 -> 1.48 ms).
// With glu the two columns of a group are a gate and its up. A one-row
// grid of at most gemvOneWaveBlocks an SM takes the kernel without the
// blocks-an-SM bound (layers.cu, GEMV_MIN_BLOCKS): such a grid has no use
// for a sixth block and the bound's spills cost it (H200, batch 1:
// 30B-A3B -1.04 %, 8B -0.25 %, 0.6B -1.47 %).
func (d *Device) gemvShape(m, n, k int, glu bool) (name string, wpo, blocks int) {
	cols, name := 1, fmt.Sprintf("gemv_m%d", m)
	if m <= 4 && (glu || n/8 > 4*d.ctx.SMs) {
		cols, name = 2, fmt.Sprintf("gemv2_m%d", m)
	}
	wpo = d.gemvWarps((n+cols-1)/cols, k)
	perBlock := 8 / wpo * cols
	blocks = (n + perBlock - 1) / perBlock
	if m == 1 && blocks <= gemvOneWaveBlocks*d.ctx.SMs {
		name += "_one_wave"
	}
	return name, wpo, blocks
}

// gemvOneWaveBlocks is how many blocks an SM gemv_m1 and gemv2_m1 hold
// without their launch bound (48 registers, NVRTC 11.8, sm_80).
const gemvOneWaveBlocks = 5

// MatMulAddRMSNorm implements device.Fused for one row, and under
// deterministic inference for the split products of detMatMulAddRMSNorm.
func (d *Device) MatMulAddRMSNorm(out, x, w device.Tensor, silu bool, residual, normed, normW device.Tensor, eps float32) bool {
	if d.det {
		return d.detMatMulAddRMSNorm(out, x, w, silu, residual, normed, normW, eps)
	}
	if !fusable(out.Dim(0), x, w) || out.DType != device.BF16 {
		return false
	}
	if d.err != nil {
		return true
	}
	d.pendingNorm = pendingNorm{}
	n, k := w.Dim(0), w.Dim(-1)
	wpo := d.gemvWarps(n, k)
	d.launch(fmt.Sprintf("gemv_fused_m%d", out.Dim(0)), D1((n*wpo+7)/8), D1(256), 0, P(out.Ptr), P(x.Ptr), P(w.Ptr), I(n), I(k), I(boolInt(silu)), I(wpo),
		P(residual.Ptr), P(normed.Ptr), P(normW.Ptr), F(eps), P(d.counters.Ptr+uintptr(d.counters.Bytes()-4)), P(0))
	return true
}

// fusable says whether gemv_fused takes m rows of x (silu: [gate | up]).
func fusable(m int, x, w device.Tensor) bool {
	n, k := w.Dim(0), w.Dim(-1)
	return m <= gemvMaxRows && k%8 == 0 && n <= 8*1024 && x.Ptr%16 == 0 && w.Ptr%16 == 0
}

// pendingNorm is what RMSNormMatMul needs from the MatMulAdd before it:
// the residual it wrote and how many partial sums of squares per row.
type pendingNorm struct {
	residual   uintptr
	rows, cols int
	parts      int
}

// MatMulAdd implements device.Fused: for one row gemv_fused in squares
// mode, for 2-8 rows matmul_tc and for 25-48 matmul_wg in add mode, where
// RMSNormMatMul takes next after it (so that the normalisation cannot be
// left undone).
func (d *Device) MatMulAdd(x, w device.Tensor, silu bool, residual, next device.Tensor, glu bool) bool {
	m, n, k := residual.Dim(0), w.Dim(0), w.Dim(-1)
	if d.det {
		return d.detMatMulAdd(x, w, silu, residual, next)
	}
	if residual.DType != device.BF16 || residual.Numel() != m*n || n%8 != 0 || residual.Ptr%16 != 0 ||
		x.Ptr%16 != 0 || w.Ptr%16 != 0 || next.Dim(-1) != n || next.Ptr%16 != 0 {
		return false
	}
	if m > gemvMaxRows {
		route := d.foldRoute(m, n, k, false)
		parts := foldParts(route, n)
		if route == routeBLAS || silu || x.DType != device.BF16 || w.DType != device.BF16 || x.Numel() != m*k ||
			m*parts > d.rowSquares.Numel() || d.foldRoute(m, next.Dim(0), n, glu) == routeBLAS {
			return false
		}
		if d.err == nil {
			if route == routeTC {
				d.matMulTC(0, false, x.Ptr, w.Ptr, m, n, k, false, normFold{residual: residual.Ptr})
			} else {
				d.matMulWG(0, false, x.Ptr, w.Ptr, m, n, k, false, normFold{residual: residual.Ptr})
			}
			d.pendingNorm = pendingNorm{residual: residual.Ptr, rows: m, cols: n, parts: parts}
		}
		return true
	}
	wpo := d.gemvWarps(n, k)
	parts := (n*wpo + 7) / 8
	if !fusable(m, x, w) || m*parts > d.rowSquares.Numel() {
		return false
	}
	if d.err != nil {
		return true
	}
	d.launch(fmt.Sprintf("gemv_fused_m%d", m), D1(parts), D1(256), 0, P(0), P(x.Ptr), P(w.Ptr), I(n), I(k), I(boolInt(silu)), I(wpo),
		P(residual.Ptr), P(0), P(0), F(0), P(0), P(d.rowSquares.Ptr))
	d.pendingNorm = pendingNorm{residual: residual.Ptr, rows: m, cols: n, parts: parts}
	return true
}

// RMSNormMatMul implements device.Fused: a gemv, or matmul_tc or matmul_wg
// in norm mode, that normalises the residual MatMulAdd left as it reads it (with
// glu also applying silu).
func (d *Device) RMSNormMatMul(out, residual, normW, w device.Tensor, eps float32, glu bool) bool {
	m, n, k := residual.Dim(0), w.Dim(0), w.Dim(-1)
	if d.err != nil {
		return true
	}
	p := d.pendingNorm
	d.pendingNorm = pendingNorm{}
	cols := n
	if glu {
		cols = n / 2
	}
	route := routeGemv
	if m > gemvMaxRows || d.det {
		route = d.foldRoute(m, n, k, glu)
	}
	if p.residual == 0 || p.residual != residual.Ptr || p.rows != m || p.cols != k || residual.Numel() != m*k ||
		normW.Numel() != k || out.Numel() != m*cols || (glu && n%2 != 0) || out.DType != device.BF16 || w.Ptr%16 != 0 ||
		route == routeBLAS {
		d.fail(fmt.Errorf("rmsnorm matmul: residual %v (last MatMulAdd: %d x %d at %#x), norm %v, w %v, out %v, glu %v",
			residual, p.rows, p.cols, p.residual, normW, w, out, glu))
		return true
	}
	fold := normFold{normW: normW.Ptr, parts: p.parts, eps: eps}
	switch route {
	case routeTC:
		d.matMulTC(out.Ptr, false, residual.Ptr, w.Ptr, m, n, k, glu, fold)
		return true
	case routeWG:
		d.matMulWG(out.Ptr, false, residual.Ptr, w.Ptr, m, n, k, glu, fold)
		return true
	case routeFew: // deterministic inference: the rows' scales from the residual itself
		d.matMulWGFew(out.Ptr, false, residual.Ptr, w.Ptr, m, n, k, glu, fold)
		return true
	}
	gemv, wpo, blocks := d.gemvShape(m, n, k, glu)
	d.launch(gemv, D1(blocks), D1(256), 0, P(out.Ptr), I(0), P(residual.Ptr), P(w.Ptr),
		I(n), I(k), I(wpo), P(normW.Ptr), P(d.rowSquares.Ptr), I(p.parts), F(eps), I(boolInt(glu)))
	return true
}

// MatMulSiLU implements device.Fused: for one row, gemv2 with each gate
// and its up in one warp group; for matmul_tc's and matmul_wg's rows,
// those kernels with each gate and its up in one thread, which apply
// silu in place of a silu_mul pass (tensor parallelism uses it too:
// gate_up is split by columns, so nothing is added across ranks before
// silu).
func (d *Device) MatMulSiLU(out, x, w device.Tensor) bool {
	m, n, k := x.Dim(0), w.Dim(0), w.Dim(-1)
	if n%2 != 0 || x.Numel() != m*k || out.Numel() != m*n/2 || x.DType != device.BF16 ||
		w.DType != device.BF16 || out.DType != device.BF16 || x.Ptr%16 != 0 || w.Ptr%16 != 0 {
		return false
	}
	if d.det {
		d.detMatMul(out.Ptr, false, x.Ptr, w.Ptr, m, n, k, true)
		return true
	}
	switch d.matMulRoute(m, n, k, true) {
	case routeGemv:
		gemv, wpo, blocks := d.gemvShape(m, n, k, true)
		d.launch(gemv, D1(blocks), D1(256), 0, P(out.Ptr), I(0), P(x.Ptr), P(w.Ptr), I(n), I(k), I(wpo), P(0), P(0), I(0), F(0), I(1))
	case routeTC:
		d.matMulTC(out.Ptr, false, x.Ptr, w.Ptr, m, n, k, true, normFold{})
	case routeWG:
		d.matMulWG(out.Ptr, false, x.Ptr, w.Ptr, m, n, k, true, normFold{})
	case routeFew:
		d.matMulWGFew(out.Ptr, false, x.Ptr, w.Ptr, m, n, k, true, normFold{})
	default:
		return false
	}
	return true
}
