package cuda

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"ebb/device"
	"ebb/memory"
)

// Deterministic inference (--enable-deterministic-inference): every
// operation computes a row the same way whatever else shares its launch,
// so a request's tokens and logprobs do not depend on the batch, on a
// prefix-cache hit or on chunk boundaries, and the logprob a token gets as
// it is generated is the one a prefill of the finished sequence gives it.
//
//   - Products: matmul_wg for every row count. Its reduction order (the K
//     splits of a weight tile, fixed by the weights' shape and the SMs, and
//     the rank order they are added in) does not depend on the rows; past
//     256 rows the batch takes a tile a blockIdx.y. Up to 16 rows,
//     matmul_wg_few gives the same bits with warps of mma.sync, without
//     matmul_wg's latency (H100, 0.6B shape, decode ms a step at batch 1 /
//     2 / 4 / 8: 1.218 / 1.249 / 1.267 / 1.369 -> 0.917 / 0.994 / 1.011 /
//     1.052, flag off 0.852 / 0.918 / 0.948 / 0.995; batch 9 / 12 / 16, two
//     rounds: 1.375 / 1.375 / 1.411 and 1.364 / 1.354 / 1.404 -> 1.265 /
//     1.265 / 1.288 and 1.259 / 1.277 / 1.276). The fused decode
//     forms of the flag off (cuBLAS's epilogue, gemv) are off: each
//     rounds where the plain kernels do not; batches of 1-2 rows fold
//     add_rmsnorm with add_rmsnorm_v8's sums instead (detFoldRows).
//   - Attention: attn_det for prefills and decodes alike (fixed splits of
//     DET_SPLIT positions merged in order; attention_flash.cu).
//   - q/k preparation: prepare_qkv for every step size.
//   - Sampling and logprobs: sample_scan_det's slices depend on the
//     vocabulary alone, and a prompt's token logprobs merge them as a
//     sampled token's do.

// detSplit is DET_SPLIT in attention_flash.cu.
const detSplit = 128

// detLoneSplits: a decode of at most this many splits runs in one block,
// which merges them in registers; longer ones share their splits among
// blocks (EBB_DET_LONE_SPLITS sets it; the bits are the same either way).
const detLoneSplits = 2

// detPartialBytes holds attn_det's decode partials: (sequences +
// positions / detSplit) x query heads rows of head_dim floats (Qwen3-0.6B,
// 256 sequences of 2,048 positions: 35 MB). Sequences whose splits do not
// fit are merged by one block instead, with the same bits.
const detPartialBytes = 64 << 20

// EnableDeterministic implements device.Deterministic. It needs matmul_wg
// (an sm_90a build: Hopper GPUs) and a model its kernels take.
func (d *Device) EnableDeterministic(m device.ModelShape) error {
	if d.det {
		return nil
	}
	if !d.wgmma {
		return errors.New("deterministic inference needs an sm_90 GPU (H100, H200): its products run on matmul_wg")
	}
	if err := detShapeError(m); err != nil {
		return err
	}
	for _, dim := range []int{64, 128} {
		if err := d.k[fmt.Sprintf("attn_det_d%d", dim)].SetMaxDynamicShared(detShared(dim, false)); err != nil {
			return err
		}
		if err := d.k[fmt.Sprintf("attn_det_dec_d%d", dim)].SetMaxDynamicShared(detShared(dim, true)); err != nil {
			return err
		}
	}
	var err error
	if d.detPartO, err = d.Alloc(memory.CUDAGraph, device.F32, detPartialBytes/4); err != nil {
		return fmt.Errorf("deterministic attention partials: %w", err)
	}
	if d.detPartML, err = d.Alloc(memory.CUDAGraph, device.F32, detPartialBytes/4/64); err != nil {
		return fmt.Errorf("deterministic attention partials: %w", err)
	}
	if !d.noDetParts {
		// o_proj's and down_proj's split sums (detMatMulAddRMSNorm): the
		// most splits of the largest batch tile, hidden columns each.
		planes := matMulWGMaxCluster * matMulWGRows[len(matMulWGRows)-1] * m.Hidden
		if d.detParts, err = d.Alloc(memory.CUDAGraph, device.F32, planes); err != nil {
			return fmt.Errorf("deterministic products' split sums: %w", err)
		}
	}
	d.detLoneSplits = detLoneSplits
	if n, err := strconv.Atoi(os.Getenv("EBB_DET_LONE_SPLITS")); err == nil && n >= 0 {
		d.detLoneSplits = n
	}
	d.det = true
	return nil
}

// Deterministic reports whether EnableDeterministic was called.
func (d *Device) Deterministic() bool { return d.det }

// detShapeError says which of a model's shapes the deterministic kernels
// do not take, so that the server refuses it at start rather than failing
// its first step: attn_det's head dims and its 16 query rows a kv head,
// and matmul_wg's 16-row weight groups and 64-wide steps of K.
func detShapeError(m device.ModelShape) error {
	if err := detAttentionError(m.Heads, m.KVHeads, m.HeadDim); err != nil {
		return err
	}
	type product struct {
		name string
		n, k int
	}
	products := []product{
		{"qkv_proj", (m.Heads + 2*m.KVHeads) * m.HeadDim, m.Hidden},
		{"o_proj", m.Hidden, m.Heads * m.HeadDim},
		{"lm_head", m.Vocab, m.Hidden},
	}
	if m.Intermediate > 0 {
		products = append(products, product{"gate_up_proj", 2 * m.Intermediate, m.Hidden},
			product{"down_proj", m.Hidden, m.Intermediate})
	}
	if m.Experts > 0 {
		products = append(products, product{"the router", m.Experts, m.Hidden})
	}
	if si := m.SharedIntermediate; si > 0 {
		products = append(products, product{"the shared expert's gate_up_proj", 2 * si, m.Hidden},
			product{"the shared expert's down_proj", m.Hidden, si}, product{"the shared expert's gate", 1, m.Hidden})
	}
	for _, p := range products {
		if !detProductFits(p.n, p.k) {
			return fmt.Errorf("%s is %d x %d (its products take rows in multiples of 16 and K in multiples of %d)", p.name, p.n, p.k, matMulWGBK)
		}
	}
	return nil
}

// detAttentionError says why attn_det cannot take hq query heads over hk
// kv heads of dim, or nil.
func detAttentionError(hq, hk, dim int) error {
	if dim != 64 && dim != 128 {
		return fmt.Errorf("head_dim %d is not supported (its attention takes 64 or 128)", dim)
	}
	if hk < 1 || hq%hk != 0 || hq/hk > 16 {
		return fmt.Errorf("%d query heads over %d kv heads are not supported (its attention takes up to 16 a kv head)", hq, hk)
	}
	return nil
}

// detProductFits says whether matmul_wg takes an n x k weight: 16-row
// groups (its tensor map) and 64-wide steps of K.
func detProductFits(n, k int) bool { return n%16 == 0 && k%matMulWGBK == 0 }

// detMatMul is a product with matmul_wg's bits for any m (glu: gate_up with
// silu): on matmul_wg_few up to few.detRows rows, else on matmul_wg.
func (d *Device) detMatMul(out uintptr, outF32 bool, x, w uintptr, m, n, k int, glu bool) {
	if !detProductFits(n, k) || x%16 != 0 || w%16 != 0 {
		d.fail(fmt.Errorf("deterministic inference: a %d x %d product (its kernel needs rows in multiples of 16 and K of %d)", n, k, matMulWGBK))
		return
	}
	if m <= d.few.detRows {
		d.matMulWGFew(out, outF32, x, w, m, n, k, glu, normFold{})
		return
	}
	d.matMulWG(out, outF32, x, w, m, n, k, glu, normFold{})
}

// ProjectQKV implements device.QKVProjector for deterministic inference:
// the qkv product prepares q, k and v itself where a head is one weight
// tile of matmul_wg (128 dims), with prepare_qkv16's code (qkv16_finish),
// so with the bits every other step gets from MatMul and PrepareQKV. On
// matmul_wg_part (steps of more than matMulWGDetPartFrom tokens, decode or
// prefill) each block prepares the heads it computes; on matmul_wg_few
// (up to detFewQKVRows rows, with the norm folded in where detFold says)
// the last block of a head does. The batches between keep prepare_qkv16.
// EBB_DET_QKV_EPILOGUE=0 leaves every step to it, for A/B runs.
func (d *Device) ProjectQKV(qkv, x, normW, w, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots device.Tensor, eps float32) bool {
	if d.err != nil || !d.det || !d.wgmma || d.noQKVEpilogue {
		return false
	}
	m, k, n := x.Dim(0), x.Dim(-1), w.Dim(0)
	hk, dim := kCache.Dim(1), kCache.Dim(2)
	hq := qkv.Dim(1) - 2*hk
	if dim != matMulWGTileRows || qkv.Dim(2) != dim || n != (hq+2*hk)*dim || w.Dim(-1) != k || qkv.Numel() != m*n ||
		x.Numel() != m*k || positions.Numel() != m || slots.Numel() < m || x.DType != device.BF16 ||
		w.DType != device.BF16 || qkv.DType != device.BF16 || kCache.DType != device.BF16 ||
		vCache.DType != device.BF16 || !detProductFits(n, k) || x.Ptr%16 != 0 || w.Ptr%16 != 0 ||
		!qkv16Layout(qkv, kCache, vCache) {
		return false
	}
	name, bn, grid, kps, kpart := d.matMulWGShape(m, n, k)
	prep := []uint64{P(qNorm.Ptr), P(kNorm.Ptr), I(boolInt(qNorm.Valid())), F(eps), P(kCache.Ptr), P(vCache.Ptr),
		I(hq), I(hk), P(positions.Ptr), P(slots.Ptr), P(cos.Ptr), P(sin.Ptr)}
	if m <= min(d.few.detRows, detFewQKVRows) {
		splits := int(grid.Z)
		per := max(1, d.few.warps/splits)
		if (matMulWGTileRows/16)%per != 0 || n/matMulWGTileRows > qkvHeadCounters {
			return false
		}
		if normW.Valid() {
			p := d.pendingNorm
			if !d.detFold(m, k) || p.residual != x.Ptr || p.rows != m || p.cols != k || normW.Numel() != k {
				return false
			}
			d.pendingNorm = pendingNorm{}
		}
		d.launch(fmt.Sprintf("matmul_wg_few_qkv_t%d", (m+7)/8), D1((n/16+per-1)/per), D1(per*splits*32),
			matMulWGFewShared(per*splits), append([]uint64{P(qkv.Ptr), P(x.Ptr), P(w.Ptr), I(m), I(n), I(k), I(kps),
				I(splits), P(normW.Ptr), F(eps), P(d.qkvCounters())}, prep...)...)
		return true
	}
	if m <= d.few.detRows || kpart == 0 || normW.Valid() {
		return false
	}
	d.launchWG(strings.Replace(name, "part_", "part_qkv_", 1), grid, d.wgBlock, matMulWGQKVShared(bn), 1,
		wgOperands{w: w.Ptr, n: n, x: x.Ptr, m: m, k: k, box: bn},
		append([]uint64{P(qkv.Ptr), I(m), I(n), I(k), I(kps), I(kpart)}, prep...)...)
	return true
}

// detFewQKVRows is the most rows whose matmul_wg_few product prepares q, k
// and v (its last block a head does, after the head's other blocks): past
// two rows prepare_qkv16's many blocks were faster. H100, 0.6B shape, flag
// on, ms a decode step (128 in, 64 out), epilogue on / off / on: batch 1
// 0.926 / 0.935 / 0.923, 2 1.004 / 1.009 / 0.990, 8 1.066 / 1.032 / 1.066,
// 16 1.298 / 1.241 / 1.301 (batch 256, on matmul_wg_part_qkv, 3.684 /
// 3.796 / 3.692).
const detFewQKVRows = 2

// qkvHeadCounters are matmul_wg_few_qkv's counters (one a head), the last
// of d.counters but one.
const qkvHeadCounters = 1024

func (d *Device) qkvCounters() uintptr {
	return d.counters.Ptr + uintptr(4*(d.counters.Numel()-1-qkvHeadCounters))
}

// detFoldRows is the most rows for which deterministic inference folds
// add_rmsnorm into the products around it (matmul_wg_few's add and norm
// modes, the norm's scales from the rows themselves in add_rmsnorm_v8's
// order, so with the bits that larger batches get from add_rmsnorm_v8).
// Measured first on matmul_wg's modes (since removed): H100, 0.6B
// shape, ms a decode step (128 in, 128 out), folded against not, two
// rounds: batch 1 1.223 / 1.205 against 1.272 / 1.251, batch 2 1.270 /
// 1.276 against 1.299 / 1.302, batch 4 1.320 / 1.308 against 1.276 /
// 1.282 (EBB_DET_FOLD=0 for A/B runs). On matmul_wg_few's modes, two
// rounds: batch 1 0.970 / 0.976 against 1.015 / 1.024 unfolded; folding
// up to 8 rows (EBB_DET_FOLD_ROWS=8), batch 4 1.136 / 1.153 against 1.082
// / 1.064, batch 8 1.407 / 1.403 against 1.133 / 1.150.
const detFoldRows = 2

// fewNormMaxHidden is the widest row matmul_wg_few's norm mode scales
// (warp_row_scale: 8 warps' worth of add_rmsnorm_v8's 8-element chunks).
const fewNormMaxHidden = 2048

// detFold says whether deterministic inference folds add_rmsnorm of m
// rows of hidden into the products around it: a batch of at most
// detFoldRows, on matmul_wg_few (its norm mode works out the rows' scales
// with add_rmsnorm_v8's bits, so it needs no sums of squares), whose norm
// is add_rmsnorm_v8's (hidden a multiple of 8).
func (d *Device) detFold(m, hidden int) bool {
	return !d.noDetFold && m <= cmp.Or(d.few.detFoldRows, detFoldRows) && m <= d.few.detRows && hidden%8 == 0 && hidden <= fewNormMaxHidden
}

// detMatMulAdd is MatMulAdd under deterministic inference: residual +=
// x @ w^T in matmul_wg_few's add mode, where RMSNormMatMul (norm mode)
// takes next after it.
func (d *Device) detMatMulAdd(x, w device.Tensor, silu bool, residual, next device.Tensor) bool {
	m, n, k := residual.Dim(0), w.Dim(0), w.Dim(-1)
	if silu || !d.detFold(m, n) || !detProductFits(n, k) || !detProductFits(next.Dim(0), n) || residual.DType != device.BF16 ||
		x.DType != device.BF16 || w.DType != device.BF16 || x.Numel() != m*k || residual.Numel() != m*n ||
		next.Dim(-1) != n || residual.Ptr%16 != 0 || x.Ptr%16 != 0 || w.Ptr%16 != 0 || next.Ptr%16 != 0 {
		return false
	}
	if d.err == nil {
		d.matMulWGFew(0, false, x.Ptr, w.Ptr, m, n, k, false, normFold{residual: residual.Ptr})
		d.pendingNorm = pendingNorm{residual: residual.Ptr, rows: m, cols: n}
	}
	return true
}

// detMatMulAddRMSNorm implements device.Fused's MatMulAddRMSNorm under
// deterministic inference where the product is matmul_wg's K splits on
// clusters (decode batches past matmul_wg_few's rows): the blocks leave
// their splits' fp32 sums in planes of detParts, without the cluster's
// barriers and remote reads, and add_rmsnorm_parts_v8 adds them in split
// order before its add and norm, so that out, residual and normed get the
// bits of MatMul then AddRMSNorm. (The thirty-eighth stop's profile of
// batch 256 found o_proj's and down_proj's blocks waiting on the cluster's
// exchange of 7 MB of sums.) EBB_DET_PARTS=0 keeps the clusters.
func (d *Device) detMatMulAddRMSNorm(out, x, w device.Tensor, silu bool, residual, normed, normW device.Tensor, eps float32) bool {
	m, n, k := residual.Dim(0), w.Dim(0), w.Dim(-1)
	if silu || !d.detParts.Valid() || m <= d.few.detRows || m > cmp.Or(d.detPartsRows, detPartsMaxRows) || !detProductFits(n, k) || n%8 != 0 || n > 8*1024 ||
		x.DType != device.BF16 || w.DType != device.BF16 || residual.DType != device.BF16 ||
		normed.DType != device.BF16 || out.DType != device.BF16 || normW.DType != device.BF16 ||
		x.Numel() != m*k || residual.Numel() != m*n || normed.Numel() != m*n || out.Numel() != m*n || normW.Numel() != n ||
		x.Ptr%16 != 0 || w.Ptr%16 != 0 || residual.Ptr%16 != 0 || normed.Ptr%16 != 0 || out.Ptr%16 != 0 || normW.Ptr%16 != 0 {
		return false
	}
	name, bn, grid, kps, kpart := d.matMulWGShape(m, n, k)
	splits := int(grid.Z)
	if kpart != 0 || grid.Y != 1 || splits < 2 || !strings.HasPrefix(name, "matmul_wg_n") || splits*m*n > d.detParts.Numel() {
		return false
	}
	if d.err != nil {
		return true
	}
	d.pendingNorm = pendingNorm{}
	parts := d.detParts.Ptr
	d.launchWG(name, grid, d.wgBlock, d.matMulWGRing(bn, kps, kpart, splits), 1, wgOperands{w: w.Ptr, n: n, x: x.Ptr, m: m, k: k, box: bn},
		P(parts), I(2), I(m), I(n), I(k), I(0), I(kps), P(0), P(0), P(d.rowSquares.Ptr), I(0), F(0), I(0))
	d.launch("add_rmsnorm_parts_v8", D1(m), D1(normThreads(n)), 0, P(residual.Ptr), P(parts), I(splits), uint64(m*n),
		P(out.Ptr), P(normed.Ptr), P(normW.Ptr), I(n), F(eps))
	return true
}

// detPartsMaxRows is the most rows detMatMulAddRMSNorm takes
// (EBB_DET_PARTS_ROWS sets it for A/B runs): past 128 the planes' traffic
// (8 MB a product at 256 rows, written and read back) outweighs the
// clusters' exchange. H200, 0.6B shape, flag on, 128 in / 128 out, ms a
// decode step, means of two rounds, planes against clusters: batch 32
// 1.185 / 1.257, 64 1.406 / 1.469, 96 1.837 / 1.904, 128 2.10 / 2.16, 160
// 2.70 / 2.64, 192 2.86 / 2.86, 256 3.50 / 3.46 (3.51 / 3.39 in a second
// run); the same output digests.
const detPartsMaxRows = 128

// attnDet runs attn_det: a step's decodes (one query each, the leading
// meta.Decodes sequences, or all when MaxQLen is 1) with their splits
// spread over blocks, the other sequences a query tile a block.
func (d *Device) attnDet(out, qkv, kc, vc device.Tensor, meta device.AttnMeta, scale float32, hq, hk, dim int) {
	if err := detAttentionError(hq, hk, dim); err != nil {
		d.fail(fmt.Errorf("deterministic inference: %w", err))
		return
	}
	dec, pre := meta, device.AttnMeta{}
	switch {
	case meta.MaxQLen == 1 && !meta.Sparse:
	case meta.Decodes > 0:
		dec.NumSeqs, dec.MaxQLen = meta.Decodes, 1
		pre = meta
		pre.NumSeqs, pre.Decodes = meta.NumSeqs-meta.Decodes, 0
		pre.QIndptr = meta.QIndptr.Rows(meta.Decodes, meta.NumSeqs+1)
		pre.KVIndptr = meta.KVIndptr.Rows(meta.Decodes, meta.NumSeqs+1)
	default:
		dec, pre = device.AttnMeta{}, meta
	}
	if b := dec.NumSeqs; b > 0 {
		if b*hk > matMulCountersAt {
			d.fail(fmt.Errorf("attention: %d sequences x %d kv heads exceed the merge counters", b, hk))
			return
		}
		// A block takes a (sequence, kv head)'s query heads, as rows of
		// its tile, over every workers-th split.
		workers := max(1, min(32, 2*d.ctx.SMs/(b*hk)))
		d.launchDet(fmt.Sprintf("attn_det_dec_d%d", dim), Dim3{uint32(workers), uint32(hk), uint32(b)}, workers, out, qkv, kc, vc, dec, scale, hq, hk, dim)
	}
	if pre.NumSeqs > 0 {
		tiles := (pre.MaxQLen + 63) / 64
		d.launchDet(fmt.Sprintf("attn_det_d%d", dim), Dim3{uint32(tiles), uint32(hq), uint32(pre.NumSeqs)}, 0, out, qkv, kc, vc, pre, scale, hq, hk, dim)
	}
}

func (d *Device) launchDet(name string, grid Dim3, workers int, out, qkv, kc, vc device.Tensor, meta device.AttnMeta, scale float32, hq, hk, dim int) {
	d.launch(name, grid, D1(128), detShared(dim, workers > 0), P(out.Ptr), P(qkv.Ptr), P(kc.Ptr), P(vc.Ptr),
		P(meta.QIndptr.Ptr), P(meta.KVIndptr.Ptr), P(meta.KVIndices.Ptr), I(hq), I(hk), F(scale), I(workers),
		P(d.detPartO.Ptr), P(d.detPartML.Ptr), P(d.counters.Ptr), I(cmp.Or(d.detPartRows, d.detPartO.Numel()/dim)),
		I(d.detLoneSplits))
}

// detShared is attn_det's shared memory: its query rows (a decode block's
// 16, the query heads of one kv head; a prefill tile's 64) and a K and a V
// tile of 64 positions, and for a decode block what its warps pass each
// other (hm_tile: row maxima, probabilities as floats and as mma
// fragments). H100, 0.6B decode steps: 16 rows rather than 64, batch 64
// 2.41 -> 2.29 ms, 256 5.47 -> 5.20; a second K/V stage had cost more (as
// much shared memory as 64 rows) than its overlap saved.
func detShared(dim int, decode bool) int {
	if !decode {
		return (64 + 2*64) * dim * 2
	}
	const exchange = (4*32*2 + 8*32*4 + 4*32*4) * 4
	return (16+2*64)*dim*2 + exchange
}

// detSampleParts is how many slices sample_scan_det cuts a row of v
// logits into: fixed by the vocabulary, so a row's logsumexp has the same
// bits in any batch.
func detSampleParts(v int) int { return max(1, min(64, (v+2047)/2048)) }

// sampleDet is Sample's scan with the fixed slices; sample_finish merges
// them as usual.
func (d *Device) sampleDet(suffix string, logits device.Tensor, a device.SampleArgs) (parts int, ok bool) {
	rows, v := logits.Dim(0), logits.Dim(-1)
	parts = detSampleParts(v)
	if int64(rows*parts*16) > d.samplePart.Bytes() {
		d.fail(fmt.Errorf("sample: %d rows of %d logits exceed deterministic sampling's buffer", rows, v))
		return 0, false
	}
	d.launch("sample_scan_det_"+suffix, Dim3{uint32(rows), uint32(parts), 1}, D1(256), 0, P(logits.Ptr), I(v),
		P(a.Temperature.Ptr), P(a.TopK.Ptr), P(a.Keys.Ptr), P(d.samplePart.Ptr))
	return parts, true
}

// tokenLogprobsDet scores targets as sampleDet and sample_finish would
// at temperature 1, as many rows at a time as the slices' buffer holds.
func (d *Device) tokenLogprobsDet(out, logits, targets device.Tensor) {
	rows, v := logits.Dim(0), logits.Dim(-1)
	if logits.DType != device.F32 {
		d.fail(fmt.Errorf("token logprobs: logits %v (float32)", logits))
		return
	}
	parts := detSampleParts(v)
	chunk := int(d.samplePart.Bytes() / int64(parts*16))
	for r0 := 0; r0 < rows; r0 += chunk {
		n := min(chunk, rows-r0)
		l := logits.Rows(r0, r0+n)
		d.launch("sample_scan_det_f32", Dim3{uint32(n), uint32(parts), 1}, D1(256), 0, P(l.Ptr), I(v),
			P(0), P(0), P(0), P(d.samplePart.Ptr))
		d.launch("token_logprobs_det", D1((n+127)/128), D1(128), 0, P(out.Ptr+uintptr(4*r0)), P(l.Ptr),
			P(targets.Ptr+uintptr(4*r0)), I(v), P(d.samplePart.Ptr), I(parts), I(n))
	}
}

// fewSettings say which products matmul_wg_few takes and how: it gives
// deterministic inference matmul_wg's bits from warps that each run one K
// split's chain of tensor-core steps for 16 weight rows, and outside it
// takes 2-8 rows of large weights. The environment sets them for A/B runs.
type fewSettings struct {
	rows        int  // outside deterministic inference, 2 to this many rows of large weights (EBB_MATMUL_FEW; 0: none)
	detRows     int  // deterministic inference, at most this many rows (EBB_DET_FEW_ROWS; 0: none)
	warps       int  // warps a block, at least a tile's splits (EBB_DET_FEW_WARPS)
	detFoldRows int  // detFoldRows where EBB_DET_FOLD_ROWS sets it (0: detFoldRows)
	splits      int  // outside deterministic inference, the most K splits (EBB_MATMUL_FEW_SPLITS; 0: a full cluster's)
	anyWaves    bool // outside deterministic inference, the splits stay as they start whatever waves they take (EBB_MATMUL_FEW_WAVE=0)
}

// detFewMaxRows is the most rows matmul_wg_few takes: two batch tiles
// of 8 (the N side of one mma).
const detFewMaxRows = 16

// matMulWGFewName is matmul_wg_few's kernel for m rows (its batch tiles).
func matMulWGFewName(m int) string { return fmt.Sprintf("matmul_wg_few_t%d", (m+7)/8) }

func fewFromEnv() fewSettings {
	f := fewSettings{rows: matMulFewRows, detRows: detFewMaxRows, warps: 4}
	if n, err := strconv.Atoi(os.Getenv("EBB_MATMUL_FEW")); err == nil && n >= 0 {
		f.rows = min(n, detFewMaxRows)
	}
	if n, err := strconv.Atoi(os.Getenv("EBB_DET_FEW_ROWS")); err == nil && n >= 0 {
		f.detRows = min(n, detFewMaxRows)
	}
	if n, err := strconv.Atoi(os.Getenv("EBB_DET_FOLD_ROWS")); err == nil && n >= 1 {
		f.detFoldRows = min(n, detFewMaxRows)
	}
	f.anyWaves = os.Getenv("EBB_MATMUL_FEW_WAVE") == "0"
	if n, err := strconv.Atoi(os.Getenv("EBB_MATMUL_FEW_SPLITS")); err == nil && n >= 1 {
		f.splits = min(n, matMulWGMaxCluster)
	}
	if n, err := strconv.Atoi(os.Getenv("EBB_DET_FEW_WARPS")); err == nil && n >= 1 {
		f.warps = min(n, matMulWGMaxCluster)
	}
	return f
}

// matMulWGFewStages is MWF_STAGES in matmul_wg_few.cu: 64-wide steps of K
// a warp has in flight, each matMulWGFewStageBytes (MWF_STAGE(1): 25 rows
// of 128 bytes) with one batch tile.
const (
	matMulWGFewStages     = 4
	matMulWGFewStageBytes = 25 * 128
)

// matMulWGFewShared is the shared memory a block of matmul_wg_few asks
// for: 25,600 bytes a warp, twice the ring of eight rows of x, which holds
// an SM to two blocks of four warps. H100, 0.6B shape, flag on, ms a
// decode step (128 in, 128 out) at batch 1 / 2 / 4 / 8: four stages
// asking for eight 0.921 / 1.000 / 1.020 / 1.047 and 0.918 / 1.022 / 1.014
// / 1.033; asking for four 0.970 / 1.060 / 1.082 / 1.133 and 0.976 / 1.054
// / 1.064 / 1.150 (eight stages used: 1.006 / 1.075 / 1.102 / 1.114).
func matMulWGFewShared(warps int) int { return warps * 2 * matMulWGFewStages * matMulWGFewStageBytes }

// matMulWGFew launches matmul_wg_few for m rows (at most detFewMaxRows)
// with the K splits matmul_wg uses in deterministic inference; a block
// takes warps / splits groups of 16 weight rows, a warp a split of one
// group.
func (d *Device) matMulWGFew(out uintptr, outF32 bool, x, w uintptr, m, n, k int, glu bool, norm normFold) {
	blocks, per, splits, kps := d.matMulWGFewShape(n, k)
	d.launch(matMulWGFewName(m), D1(blocks), D1(per*splits*32), matMulWGFewShared(per*splits), P(out), I(boolInt(outF32)), P(x), P(w), I(m), I(n), I(k),
		I(boolInt(glu)), I(kps), I(splits), P(norm.residual), P(norm.normW), F(norm.eps))
}

// matMulWGFewShape is matmul_wg_few's grid for an n x k product: blocks of
// per groups of 16 weight rows, splits warps a group, kps k-steps a warp.
// It starts from a full cluster's splits: where matmul_wg's clusters
// would not all fit (splitsCap), the Qwen3-8B shape's o_proj and down_proj
// in 3 splits, not 4, made decode steps 1.2-1.5 % slower at batch 2, 4
// and 8 (H200, one-batch, 128 in, 64 out). Outside deterministic
// inference (whose bits fix the splits) it then takes fewer splits where
// that is what brings the blocks into one wave: the 30B-A3B shape's qkv
// (5120 x 2048) in 3 splits is 320 blocks of 3 warps, two an SM by their
// rings, 1.2 waves; in 2 it is 160 blocks of 4 warps. `ebb bench matmul`
// on an H200, 2 / 4 / 8 rows: 11.19 / 11.32 / 10.60 us -> 8.15 / 8.18 /
// 7.83; decode steps at batch 2 / 4 / 8 (128 in, 64 out) 2.7 / 3.5 /
// 1.7 % faster. Every other large product of that shape and of the 8B
// shape already fits and keeps its splits. EBB_MATMUL_FEW_WAVE=0 keeps the
// splits as they start, EBB_MATMUL_FEW_SPLITS caps them, for A/B runs.
func (d *Device) matMulWGFewShape(n, k int) (blocks, per, splits, kps int) {
	shape := func(most int) (blocks, per, splits, kps int) {
		splits, kps = d.kSplits(matMulWGTiles(n), k/matMulWGBK, most)
		per = max(1, d.few.warps/splits)
		return (n/16 + per - 1) / per, per, splits, kps
	}
	most := matMulWGMaxCluster
	if !d.det && d.few.splits > 0 {
		most = d.few.splits
	}
	blocks, per, splits, kps = shape(most)
	if d.det || d.few.anyWaves || d.fewResident[per*splits] == 0 || blocks <= d.fewResident[per*splits] {
		return blocks, per, splits, kps
	}
	for s := splits - 1; s >= 1; s-- {
		b, p, sp, kp := shape(s)
		if r := d.fewResident[p*sp]; r > 0 && b <= r {
			return b, p, sp, kp
		}
	}
	return blocks, per, splits, kps
}
