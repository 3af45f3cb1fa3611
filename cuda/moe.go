package cuda

import (
	"fmt"

	"ebb/device"
)

// Mixture-of-experts layers (moe.cu): routing, pairs grouped by expert,
// the experts' products over their own rows, and the weighted sum.

var (
	_ device.MoE      = (*Device)(nil)
	_ device.MoEFused = (*Device)(nil)
)

const (
	moeMaxExperts = 256 // moe_route keeps 8 logits a lane
	moeMaxTopK    = 16  // moe_combine's shared arrays
	moeDownCols   = 4   // output columns a moe_down_combine block takes (MOE_DOWN_COLS)
	moeBN         = 64  // MOE_BN
	// moeSmallTileRows: where the experts average at most this many rows,
	// moe_gemm_r16's 16-row tiles take them (moe_gemm's 64-row tiles
	// otherwise).
	moeSmallTileRows = 16
	// moeGemvTokens: steps of up to this many tokens run the pair gemv
	// (moe_gemv_glu, moe_down_combine) rather than the grouped products.
	// 30B-A3B experts, H100, us (`bench moe`), pair gemv against moe_wg:
	// 1 token 35.7 / 40.6, 2 60.7 / 64.4, 4 106.5 / 107.4, 8 204.6 / 180.1;
	// the batch-8 decode step 11.95 -> 10.64 ms with moe_wg.
	moeGemvTokens = 4
)

// MoERoute implements device.MoE.
func (d *Device) MoERoute(ids, weights, logits device.Tensor, norm bool) {
	t, e, k := logits.Dim(0), logits.Dim(-1), ids.Dim(-1)
	d.routeSorted = routeSorted{} // ids are routed again
	if d.err != nil {
		return
	}
	if logits.DType != device.BF16 || ids.Numel() != t*k || weights.Numel() != t*k || weights.DType != device.F32 ||
		e > moeMaxExperts || k > moeMaxTopK || k > e {
		d.fail(fmt.Errorf("moe route: logits %v, ids %v, weights %v (at most %d experts, %d chosen)", logits, ids, weights, moeMaxExperts, moeMaxTopK))
		return
	}
	d.launch("moe_route", D1((t+7)/8), D1(256), 0, P(ids.Ptr), P(weights.Ptr), P(logits.Ptr), I(t), I(e), I(k), I(boolInt(norm)))
}

// moeWork is where MoEExperts keeps its pairs and intermediate rows in
// the scratch it is given.
type moeWork struct{ order, inv, offsets, tiles, act, y uintptr }

func moeLayout(base uintptr, t, k, experts, inter, hidden int) (moeWork, int64) {
	p := int64(t * k)
	at := int64(0)
	next := func(bytes int64) uintptr {
		off := base + uintptr(at)
		at += (bytes + 255) &^ 255
		return off
	}
	w := moeWork{
		order: next(4 * p), inv: next(4 * p), offsets: next(4 * int64(experts+1)), tiles: next(4 * int64(experts+1)),
		act: next(2 * p * int64(inter)), y: next(2 * p * int64(hidden)),
	}
	return w, at + 256
}

// MoEWorkBytes implements device.MoE.
func (d *Device) MoEWorkBytes(t, k, experts, inter, hidden int) int64 {
	_, n := moeLayout(0, t, k, experts, inter, hidden)
	return n
}

// MoEExperts implements device.MoE.
func (d *Device) MoEExperts(out, x, ids, weights, gateUp, down, work device.Tensor) {
	if d.err != nil {
		return
	}
	t, h, k := x.Dim(0), x.Dim(-1), ids.Dim(-1)
	e, inter := gateUp.Dim(0), gateUp.Dim(1)/2
	if out.Numel() != t*h || !d.moeExpertsFit(x, ids, weights, gateUp, down, work) {
		d.fail(fmt.Errorf("moe experts: out %v, x %v, ids %v, weights %v, gate_up %v, down %v, work %v", out, x, ids, weights, gateUp, down, work))
		return
	}
	if t == 0 {
		return
	}
	w, _ := moeLayout(work.Ptr, t, k, e, inter, h)
	if !d.det && t <= d.moeGemvTokens {
		// A few tokens: a gemv per (token, choice) pair, and the down
		// products summed as they are formed. Deterministic inference
		// keeps moe_gemm, whose rows have the same bits at any batch size.
		d.moeExpertsGemv(out.Ptr, out.DType == device.F32, 0, x, ids, weights, gateUp, down, w)
		return
	}
	w = d.moeProducts(x, ids, gateUp, down, w)
	d.launch("moe_combine", D1(t), D1(256), 0, P(out.Ptr), I(boolInt(out.DType == device.F32)), P(w.y), P(w.inv),
		P(ids.Ptr), P(weights.Ptr), I(k), I(h))
}

// moeProducts groups the pairs by expert and runs the grouped gate_up and
// down products into w.y, in sorted order, for a combine. It returns w
// with the grouping it used (sortPairs).
func (d *Device) moeProducts(x, ids, gateUp, down device.Tensor, w moeWork) moeWork {
	t, h, k := x.Dim(0), x.Dim(-1), ids.Dim(-1)
	e, inter := gateUp.Dim(0), gateUp.Dim(1)/2
	p := t * k
	if bn := d.moeWGTile(p, e, inter, h); bn > 0 {
		w = d.sortPairs(w, ids, e, bn)
		d.moeExpertsWG(x, ids, gateUp, down, w, bn)
		return w
	}
	gemm, bm := d.moeTiles(p, e)
	w = d.sortPairs(w, ids, e, bm)
	// Row tiles: at most one partial tile per expert that has rows.
	rowTiles := (p+bm-1)/bm + min(e, p)
	d.launch(gemm, Dim3{X: uint32((inter + moeBN/2 - 1) / (moeBN / 2)), Y: uint32(rowTiles), Z: 1}, D1(128), 0,
		P(w.act), P(x.Ptr), P(w.order), I(k), P(gateUp.Ptr), P(w.offsets), P(w.tiles), I(e), I(2*inter), I(h), I(1))
	d.launch(gemm, Dim3{X: uint32((h + moeBN - 1) / moeBN), Y: uint32(rowTiles), Z: 1}, D1(128), 0,
		P(w.y), P(w.act), P(0), I(k), P(down.Ptr), P(w.offsets), P(w.tiles), I(e), I(h), I(inter), I(0))
	return w
}

// sortPairs groups the pairs of ids by expert for row tiles of bm: where
// the moe_add_norm_route before it grouped these ids for bm, w takes that
// grouping (routeSort's), else moe_sort writes w's. Either way the
// grouping is used once.
func (d *Device) sortPairs(w moeWork, ids device.Tensor, e, bm int) moeWork {
	p, s := ids.Numel(), d.routeSorted
	d.routeSorted = routeSorted{}
	if s.ids == ids.Ptr && s.pairs == p && s.experts == e && s.rows == bm {
		l := routeSortAt(d.routeSort.Ptr)
		w.order, w.inv, w.offsets, w.tiles = l.order, l.inv, l.offsets, l.tiles
		return w
	}
	d.launch("moe_sort", D1(1), D1(1024), 0, P(w.order), P(w.inv), P(w.offsets), P(w.tiles), P(ids.Ptr), I(p), I(e), I(bm))
	return w
}

// routeSorted is what a moe_add_norm_route grouped in routeSort: the pairs
// of ids (pairs of them over experts) for row tiles of rows.
type routeSorted struct {
	ids                  uintptr
	pairs, experts, rows int
}

// routeSort's int32s: the experts' counts and the clusters' ticket
// (MOE_MAX_EXPERTS + 1), offsets and tiles (each experts + 1), then order
// and inv for the most pairs moe_add_norm_route takes.
const (
	routeSortMaxPairs   = moeNormRouteMaxRows * moeMaxTopK
	routeSortExpertInts = 2 * moeMaxExperts // counts, offsets and tiles each take moeMaxExperts + 1
	routeSortInts       = 3*routeSortExpertInts + 2*routeSortMaxPairs
)

// routeSortAt lays routeSort out from base.
func routeSortAt(base uintptr) (l struct{ counts, offsets, tiles, order, inv uintptr }) {
	const n = 4 * routeSortExpertInts
	l.counts, l.offsets, l.tiles, l.order = base, base+n, base+2*n, base+3*n
	l.inv = l.order + 4*routeSortMaxPairs
	return l
}

// moeCombineNormMaxHidden is the widest row moe_combine_add_rmsnorm takes:
// a thread holds 8 columns, a block 1,024 threads.
const moeCombineNormMaxHidden = 8 * 1024

// MoEExpertsAddRMSNorm implements device.MoEFused for the steps whose
// experts end in moe_combine (more rows than the pair gemv takes): the
// combine adds into the residual and normalises it in one launch
// (moe_combine_add_rmsnorm) in place of moe_combine and add_rmsnorm.
// Deterministic inference keeps its separate launches; EBB_MOE_FOLD=0 too.
func (d *Device) MoEExpertsAddRMSNorm(residual, x, normW, ids, weights, gateUp, down, work device.Tensor, eps float32) bool {
	t, h, k := x.Dim(0), x.Dim(-1), ids.Dim(-1)
	e, inter := gateUp.Dim(0), gateUp.Dim(1)/2
	if d.err != nil || d.det || d.noMoEFold || t == 0 || t <= d.moeGemvTokens || h%8 != 0 || h > moeCombineNormMaxHidden ||
		residual.DType != device.BF16 || residual.Numel() != t*h || normW.DType != device.BF16 || normW.Numel() != h ||
		residual.Ptr%16 != 0 || x.Ptr%16 != 0 || normW.Ptr%16 != 0 || !d.moeExpertsFit(x, ids, weights, gateUp, down, work) {
		return false
	}
	w, _ := moeLayout(work.Ptr, t, k, e, inter, h)
	w = d.moeProducts(x, ids, gateUp, down, w)
	d.launch("moe_combine_add_rmsnorm", D1(t), D1(normThreads(h)), 0, P(residual.Ptr), P(x.Ptr), P(normW.Ptr), F(eps),
		P(w.y), P(w.inv), P(ids.Ptr), P(weights.Ptr), I(k), I(h))
	return true
}

// moeExpertsFit says whether MoEExperts takes these operands.
func (d *Device) moeExpertsFit(x, ids, weights, gateUp, down, work device.Tensor) bool {
	t, h, k := x.Dim(0), x.Dim(-1), ids.Dim(-1)
	e, inter := gateUp.Dim(0), gateUp.Dim(1)/2
	return ids.Numel() == t*k && weights.Numel() == t*k && gateUp.Dim(2) == h && down.Dim(0) == e && down.Dim(1) == h &&
		down.Dim(2) == inter && x.DType == device.BF16 && gateUp.DType == device.BF16 && down.DType == device.BF16 &&
		h%8 == 0 && inter%8 == 0 && k <= moeMaxTopK && e <= moeMaxExperts && work.Bytes() >= d.MoEWorkBytes(t, k, e, inter, h)
}

// moeGluBlocks is moe_gemv_glu's blocks an SM for one token's gate and up,
// each taking column groups in turn: with a block a group their 768 blocks
// (30B-A3B) fill the SMs, and moe_down_bulk's blocks launch, and ask for
// their weights, only as gate and up end. Full 30B-A3B shape, H200, batch 1,
// 128/128, ms a decode step over two rounds: a block a group 3.107, 3.109;
// three 3.080, 3.079; four 3.074, 3.074 (fifty-third stop). Two to four
// tokens, whose down products take no bulk copies, were not measured and
// keep a block a group unless EBB_MOE_GLU_BLOCKS says otherwise.
const moeGluBlocks = 4

// moeExpertsGemv is MoEExperts on the pair gemv, the sum into out or
// (residual set) added into residual with its blocks' sums of squares in
// d.rowSquares.
func (d *Device) moeExpertsGemv(out uintptr, outF32 bool, residual uintptr, x, ids, weights, gateUp, down device.Tensor, w moeWork) {
	t, h, k := x.Dim(0), x.Dim(-1), ids.Dim(-1)
	e, inter := gateUp.Dim(0), gateUp.Dim(1)/2
	p := t * k
	wpo := d.gemvWarps(inter*p, h)
	xblocks := (inter + 8/wpo - 1) / (8 / wpo)
	glu := d.moeGluBlocks
	if glu < 0 { // unset: one token, where it was measured, takes moeGluBlocks
		glu = moeGluBlocks * boolInt(t == 1)
	}
	if gx := min(xblocks, max(1, glu*d.ctx.SMs/p)); glu > 0 && gx < xblocks {
		// That many blocks an SM, each taking groups in turn.
		d.launch("moe_gemv_glu_loop", Dim3{X: uint32(gx), Y: uint32(p), Z: 1}, D1(256), 0,
			P(w.act), P(x.Ptr), P(ids.Ptr), I(k), P(gateUp.Ptr), I(e), I(2*inter), I(h), I(wpo), I(xblocks))
	} else {
		d.launch("moe_gemv_glu", Dim3{X: uint32(xblocks), Y: uint32(p), Z: 1}, D1(256), 0,
			P(w.act), P(x.Ptr), P(ids.Ptr), I(k), P(gateUp.Ptr), I(e), I(2*inter), I(h), I(wpo))
	}
	var sq uintptr
	if residual != 0 {
		sq = d.rowSquares.Ptr
	}
	// One token's down products take bulk copies: 12-layer 30B-A3B copy,
	// H200, ms a decode step with and without (two rounds each): batch 1
	// 0.892 / 0.892 against 0.902 / 0.903, batch 4 1.736 against 1.668
	// (four 48 KB blocks a column group fill the SMs four times over).
	name, shared := "moe_down_combine", 0
	if rows := k * moeDownCols * inter * 2; t == 1 && d.wgmma && !d.noMoEBulk && rows <= moeDownBulkMaxShared {
		name, shared = "moe_down_bulk", rows
	}
	d.launch(name, Dim3{X: uint32(moeDownParts(h)), Y: uint32(t), Z: 1}, D1(256), shared, P(out),
		I(boolInt(outF32)), P(w.act), P(ids.Ptr), P(weights.Ptr), I(k), P(down.Ptr), I(e), I(h), I(inter), P(residual), P(sq))
}

// moeDownBulkMaxShared is the most shared memory moe_down_bulk is given
// for its block's rows of the chosen experts (k * MOE_DOWN_COLS * I bf16):
// top 8 of the 30B-A3B shape's experts take 48 KB.
const moeDownBulkMaxShared = 192 << 10

// moeDownParts is moe_down_combine's blocks a token: its partial sums of
// squares a row in add mode.
func moeDownParts(hidden int) int { return (hidden + moeDownCols - 1) / moeDownCols }

const (
	moeRouteBlocks    = 8    // MOE_ROUTE_BLOCKS: moe_norm_route's cluster
	moeRouteWarps     = 16   // MOE_ROUTE_WARPS, unless EBB_KERNEL_DEFINES sets it
	moeRouteMaxHidden = 8192 // 8 * MOE_ROUTE_XS
)

// MatMulAddMoERoute implements device.MoEFused. One token: MatMulAdd's
// gemv in squares mode, then moe_norm_route (a cluster; sm_90 and later),
// in place of o_proj's last block normalising, the router's gemv and
// moe_route. With MoEExpertsAdd, the 30B-A3B shape's batch-1 decode step
// went from 3.389 to 3.099 ms (H200, EBB_MOE_FOLD=0 against on, one run);
// ncu a layer: o_proj 14.5 -> 8.6 us, router and routing 3.2 + 4.6 ->
// 7.5 us, add_rmsnorm's 3.2 us gone. More tokens: moeAddNormRoute.
func (d *Device) MatMulAddMoERoute(in, w, residual, x, normW, router, ids, weights device.Tensor, eps float32, norm bool) bool {
	d.routeSorted = routeSorted{} // ids are routed again
	t, h, e, k := residual.Dim(0), residual.Dim(-1), router.Dim(0), ids.Dim(-1)
	if d.det || d.noMoEFold || d.ctx.CCMajor < 9 || h%8 != 0 || h > moeRouteMaxHidden || router.Dim(-1) != h ||
		e > moeMaxExperts || k > moeMaxTopK || k > e || ids.Numel() != t*k || weights.Numel() != t*k ||
		weights.DType != device.F32 || x.Numel() != t*h || x.DType != device.BF16 || router.DType != device.BF16 ||
		normW.Numel() != h || x.Ptr%16 != 0 || router.Ptr%16 != 0 || normW.Ptr%16 != 0 || residual.DType != device.BF16 ||
		residual.Ptr%16 != 0 {
		return false
	}
	if t != 1 {
		return d.moeAddNormRoute(in, w, residual, x, normW, router, ids, weights, eps, norm)
	}
	if !d.MatMulAdd(in, w, false, residual, router, false) {
		return false
	}
	p := d.pendingNorm
	d.pendingNorm = pendingNorm{}
	d.launchCluster("moe_norm_route", Dim3{X: 1, Y: 1, Z: moeRouteBlocks}, D1(32*d.moeRouteWarps), 0, moeRouteBlocks, nil,
		P(ids.Ptr), P(weights.Ptr), P(x.Ptr), P(residual.Ptr), P(normW.Ptr), P(d.rowSquares.Ptr), I(p.parts), F(eps),
		P(router.Ptr), I(e), I(h), I(k), I(boolInt(norm)))
	return true
}

const (
	moeNormRouteRanks  = 4    // MOE_NR_RANKS: a moe_add_norm_route cluster's blocks
	moeNormRouteWarps  = 16   // MOE_NR_WARPS
	moeNormRouteHidden = 4096 // the widest row whose tokens' rows fit its shared memory (MOE_NR_CHUNKS)
	// moeNormRouteMaxRows is the most tokens EBB_MOE_NORM_ROUTE_ROWS lets
	// moe_add_norm_route take: each cluster reads the router (0.5 MB at
	// 30B-A3B) from L2, so a prefill chunk's thousands of tokens keep
	// cuBLAS's router product.
	moeNormRouteMaxRows = 512
	// moeNormRouteRows is the most it takes by default. 30B-A3B shape,
	// H200, `bench one-batch --temperature 1`, ms a decode step, off / on,
	// 128 in / 64 out, two rounds: batch 32 15.056, 15.055 / 15.019,
	// 15.003; 64 16.626, 16.643 / 16.563, 16.604; 128 17.496, 17.525 /
	// 17.369, 17.381. Batch 256, 128 / 128, in clusters of sixteen: 19.293,
	// 19.233 / 19.224, 19.219, and on another machine 19.082, 19.069 with
	// the bound at 128 / 19.045, 19.037 (ncu, 12-layer copy: 13.6 us a
	// layer, where clusters of eight took 17.6 and the three launches
	// before 15.7).
	moeNormRouteRows = 256
	// moeNormRouteEights is the most tokens taken by clusters of eight;
	// more take clusters of sixteen (moe_add_norm_route16), so that 256
	// tokens are 16 clusters of four one-an-SM blocks, not 32 of which an
	// H200 holds 30 at once.
	moeNormRouteEights = 128
)

// moeNormRouteKernels are moe_add_norm_route's kernels by the tokens a
// cluster takes.
var moeNormRouteKernels = [...]struct {
	tokens int
	name   string
}{{8, "moe_add_norm_route"}, {16, "moe_add_norm_route16"}}

// moeNormRouteTokens is the tokens a moe_add_norm_route cluster takes in a
// batch of t tokens where clusters of eight take up to eights, and the
// kernel that takes them.
func moeNormRouteTokens(t, eights int) (int, string) {
	k := moeNormRouteKernels[0]
	if t > eights {
		k = moeNormRouteKernels[1]
	}
	return k.tokens, k.name
}

// moeNormRouteShared is moe_add_norm_route's dynamic shared memory for tok
// tokens a cluster: the K slices' sums of its experts (MOE_NR_SLICES x
// MOE_NR_TILES x 16 x tok), block 0's logits (tok x MOE_MAX_EXPERTS), and
// the tokens' x rows, each padded by 64 bytes.
func moeNormRouteShared(tok, h int) int {
	const slices, tiles = 8, (moeMaxExperts/16 + moeNormRouteRanks - 1) / moeNormRouteRanks
	return 4*tok*(slices*tiles*16+moeMaxExperts) + tok*(h/8+4)*16
}

// moeAddNormRoute is MatMulAddMoERoute for 2 to moeNormRouteRows tokens
// (EBB_MOE_NORM_ROUTE_ROWS sets the bound, up to moeNormRouteMaxRows; 0
// turns it off): o_proj's product into x, then moe_add_norm_route in
// place of add_rmsnorm_v8, the router's product and moe_route.
func (d *Device) moeAddNormRoute(in, w, residual, x, normW, router, ids, weights device.Tensor, eps float32, norm bool) bool {
	t, h, e, k := residual.Dim(0), residual.Dim(-1), router.Dim(0), ids.Dim(-1)
	if t < 2 || t > d.normRouteRows || h%32 != 0 || h > moeNormRouteHidden || in.Dim(0) != t || w.Dim(0) != h ||
		w.Dim(-1) != in.Dim(-1) {
		return false
	}
	d.MatMul(x, in, w, device.Tensor{})
	d.pendingNorm = pendingNorm{}
	tok, name := moeNormRouteTokens(t, d.routeEights)
	l, sorted := routeSortAt(d.routeSort.Ptr), d.routeSortFor(t, k, e)
	if sorted.rows == 0 {
		l.counts = 0
	}
	d.launchCluster(name, Dim3{X: uint32((t + tok - 1) / tok), Y: 1, Z: moeNormRouteRanks},
		D1(32*moeNormRouteWarps), moeNormRouteShared(tok, h), moeNormRouteRanks, nil,
		P(ids.Ptr), P(weights.Ptr), P(x.Ptr), P(residual.Ptr), P(normW.Ptr), F(eps), P(router.Ptr), I(t), I(e), I(h), I(k),
		I(boolInt(norm)), P(l.order), P(l.inv), P(l.offsets), P(l.tiles), P(l.counts), I(sorted.rows))
	if sorted.rows > 0 {
		sorted.ids = ids.Ptr
		d.routeSorted = sorted
	}
	return true
}

// routeSortFor is how moe_add_norm_route groups the pairs of t tokens, k
// each, over e experts (rows 0: it does not, and moe_sort will): for the
// row tiles of the grouped products after it, unless the pair gemv takes
// them (it reads ids itself) or EBB_MOE_ROUTE_SORT=0. It takes the place of
// moe_sort's launch, one block on one SM with its own chain of round trips
// between the routing and the experts.
func (d *Device) routeSortFor(t, k, e int) routeSorted {
	if d.noRouteSort || t <= d.moeGemvTokens || t*k > routeSortMaxPairs || e > moeMaxExperts {
		return routeSorted{}
	}
	rows := moeWGRowTile(t*k, e)
	if !d.wgmma || !d.moeWG {
		_, rows = d.moeTiles(t*k, e)
	}
	return routeSorted{pairs: t * k, experts: e, rows: rows}
}

// MoEExpertsAdd implements device.MoEFused for one token: the pair gemv,
// then the down products adding into the residual and leaving their
// blocks' sums of squares, so that the next layer's qkv gemv normalises
// the residual (no add_rmsnorm launch).
func (d *Device) MoEExpertsAdd(residual, x, ids, weights, gateUp, down, work, next device.Tensor) bool {
	t, h, k := x.Dim(0), x.Dim(-1), ids.Dim(-1)
	e, inter := gateUp.Dim(0), gateUp.Dim(1)/2
	if d.det || d.noMoEFold || t != 1 || t > d.moeGemvTokens || residual.DType != device.BF16 || residual.Numel() != t*h ||
		next.Dim(-1) != h || t*moeDownParts(h) > d.rowSquares.Numel() || residual.Ptr%16 != 0 ||
		!d.moeExpertsFit(x, ids, weights, gateUp, down, work) {
		return false
	}
	if d.err != nil {
		return true
	}
	w, _ := moeLayout(work.Ptr, t, k, e, inter, h)
	d.moeExpertsGemv(0, false, residual.Ptr, x, ids, weights, gateUp, down, w)
	d.pendingNorm = pendingNorm{residual: residual.Ptr, rows: t, cols: h, parts: moeDownParts(h)}
	return true
}

// MoESharedAdd implements device.MoE.
func (d *Device) MoESharedAdd(out, y, gate device.Tensor) {
	if d.err != nil {
		return
	}
	t, h := y.Dim(0), y.Dim(-1)
	if out.Numel() != t*h || gate.Numel() != t || y.DType != device.BF16 || gate.DType != device.BF16 ||
		(out.DType != device.BF16 && out.DType != device.F32) || h%8 != 0 || y.Ptr%16 != 0 || out.Ptr%16 != 0 {
		d.fail(fmt.Errorf("moe shared add: out %v, y %v, gate %v (bf16 y and gate, H a multiple of 8)", out, y, gate))
		return
	}
	if t == 0 {
		return
	}
	d.launch("moe_shared_add", D1(t), D1(256), 0, P(out.Ptr), I(boolInt(out.DType == device.F32)), P(y.Ptr),
		P(gate.Ptr), I(h))
}

// moeTiles picks the grouped product and its tile height for p pairs over
// e experts (EBB_MOE_TILE_ROWS=16 or 64 forces one, for A/B runs).
func (d *Device) moeTiles(p, e int) (kernel string, rows int) {
	small := p <= moeSmallTileRows*e
	if d.moeTileRows != 0 {
		small = d.moeTileRows == 16
	}
	if small {
		return "moe_gemm_r16", 16
	}
	return "moe_gemm", 64
}

// moeWGRows are moe_wg's row tiles (BN in moe_wg.cu).
var moeWGRows = []int{32, 64, 128}

const (
	moeWGRing   = 100 << 10 // MOE_WG_RING
	moeWGRing32 = 60 << 10  // MOE_WG_RING32: the 32-row tiles', three blocks an SM
)

// moeWGShared is moe_wg's shared memory for a row tile: the ring and room
// to align it to 1024 bytes.
func (d *Device) moeWGShared(bn int) int {
	stage, ring := (matMulWGTileRows+bn)*matMulWGBK*2, moeWGRing
	if bn == 32 {
		ring = d.moeWGRing32
	}
	return ring/stage*stage + 1024
}

// moeWGTile is moe_wg's row tile for p pairs over e experts (0: moe_gemm
// takes them): the smallest that holds the rows an expert averages, where
// matmul_wg runs (an sm_90a build), outside deterministic inference (whose
// rows keep moe_gemm's bits at any batch size), for hidden and
// intermediate sizes in whole 64-wide steps of K. EBB_MOE_WG=0 keeps
// moe_gemm, for A/B runs.
func (d *Device) moeWGTile(p, e, inter, hidden int) int {
	if !d.wgmma || !d.moeWG || d.det || inter%matMulWGBK != 0 || hidden%matMulWGBK != 0 {
		return 0
	}
	return moeWGRowTile(p, e)
}

// moeWGRowTile is moe_wg's row tile for p pairs over e experts where it
// takes them.
func moeWGRowTile(p, e int) int {
	avg := (p + min(p, e) - 1) / min(p, e)
	for _, bn := range moeWGRows {
		if avg <= bn {
			return bn
		}
	}
	return moeWGRows[len(moeWGRows)-1]
}

// moeSortedFrom is the smallest moe_wg row tile whose gate and up read
// x's rows from a sorted copy (moe_sorted_rows). 30B-A3B shape, H200, us
// (`ebb bench moe`), rows gathered one a copy against sorted: 256 tokens
// (32-row tiles) 317.7 / 318.6, 512 (32) 451.5 / 395.3, 1,024 (64) 700.4 /
// 443.0, 2,048 (128) 1,207 / 576, 8,192 4,225 / 1,631, 16,384 8,229 /
// 3,080; a prefill of 256 x 128 tokens 899 -> 447 ms. Decode batches of up
// to 256 keep the gathered rows: the copy gains them nothing.
const moeSortedFrom = 64

// moeFirstTilesFrom is the pairs an expert averages from which moe_wg's
// gate and up give block y < E expert y's first row tile, so that its
// first weight stages stream while moe_sort runs (one block, which leaves
// HBM idle). An expert with no rows then reads those stages for nothing:
// at 4 pairs an expert about 2 % of them have none (e^-4). Where experts
// average more than half a tile, their further tiles, which come after
// every first one, read the weights from HBM again rather than from L2
// beside the first. 30B-A3B shape, H200, `ebb bench moe` us, on / off: 64
// tokens 291.9 / 294.3, 128 298.2 / 301.2, 256 306.9 / 309.0, 512 (32
// rows an expert) 439.4 / 423.6. EBB_MOE_FIRST_TILES sets it: 0 always,
// below 0 never.
const moeFirstTilesFrom = 4

// moeExpertsWG is moeProducts on moe_wg with row tiles of bn, the pairs
// grouped in w.
func (d *Device) moeExpertsWG(x, ids, gateUp, down device.Tensor, w moeWork, bn int) {
	t, h, k := x.Dim(0), x.Dim(-1), ids.Dim(-1)
	e, inter := gateUp.Dim(0), gateUp.Dim(1)/2
	p := t * k
	rowTiles := (p+bn-1)/bn + min(e, p) // at most one partial tile per expert that has rows
	name, shared := fmt.Sprintf("moe_wg_n%d", bn), d.moeWGShared(bn)
	wgrid := func(n int) Dim3 {
		return Dim3{X: uint32(matMulWGTiles(n)), Y: uint32(rowTiles), Z: 1}
	}
	// gate and up: x's rows gathered one at a time, or where the tiles are
	// tall, first written in sorted order into y (which down fills later)
	// and read as down reads, a box of bn rows; down: the sorted
	// activations.
	rows, m, box, order := x.Ptr, t, 1, w.order
	guGrid, first := wgrid(2*inter), 0
	if bn >= d.moeSortedFrom {
		d.launch("moe_sorted_rows", D1(t), D1(min(256, h/8)), 0, P(w.y), P(x.Ptr), P(w.inv), I(k), I(h))
		rows, m, box, order = w.y, p, bn, 0
	} else if d.moeFirstTiles == 0 || d.moeFirstTiles > 0 && p >= d.moeFirstTiles*e && 2*p <= bn*e {
		// Each expert's first tile, then at most p / bn further ones: an
		// expert of r rows has (r - 1) / bn.
		guGrid.Y, first = uint32(e+p/bn), 1
	}
	d.launchWG(name, guGrid, matMulWGThreads, shared, 1, wgOperands{w: gateUp.Ptr, experts: e, n: 2 * inter, x: rows, m: m, k: h, glu: true, box: box},
		P(w.act), P(order), I(k), P(w.offsets), P(w.tiles), I(e), I(2*inter), I(h), I(1), I(first))
	// down takes the same tiles by block where gate and up do: a block
	// then asks for its first weight stages as it starts, not after two
	// lookups in tiles and offsets. 30B-A3B shape, H200, `ebb bench moe` us,
	// on / off: 64 tokens 286.9 / 287.7, 256 300.9 / 302.1; decode step at
	// batch 64 / 256 (128 in, 64 out) -0.19 / -0.17 %, the same tokens.
	downGrid, downFirst := wgrid(h), 0
	if first == 1 && !d.noDownFirst {
		downGrid.Y, downFirst = guGrid.Y, 1
	}
	d.launchWG(name, downGrid, matMulWGThreads, shared, 1, wgOperands{w: down.Ptr, experts: e, n: h, x: w.act, m: p, k: inter, box: bn},
		P(w.y), P(0), I(k), P(w.offsets), P(w.tiles), I(e), I(h), I(inter), I(0), I(downFirst))
}
