package cuda

import (
	"cmp"
	"fmt"
	"os"
	"slices"
	"strconv"
)

// matMulWGRows are the batch tiles matmul_wg is built for (BN in
// matmul_wg.cu): a batch runs the smallest that holds it. The 192- and
// 256-row tiles are for deterministic inference, whose products all run on
// matmul_wg: with 128-row tiles a batch of 256 read every weight twice, and
// the 256-row tile gave batches of 129-192 up to a third more tensor work.
// H100, 0.6B shape, flag on, ms a decode step (128 in, 128 out), two
// rounds, 256-row tile against 192 (EBB_MATMUL_WG_N192=0 for A/B): batch
// 144 3.384 / 3.288 -> 3.062 / 3.114, 160 3.433 / 3.394 -> 3.187 / 3.223,
// 192 3.601 / 3.685 -> 3.394 / 3.350.
var matMulWGRows = []int{32, 48, 64, 96, 128, 192, 256}

// matMulWGMaxRows is the most rows matmul_wg takes outside deterministic
// inference (EBB_MATMUL_WG_ROWS=256 raises it, for A/B runs). Past 128
// rows cuBLAS was faster with 128-row tiles (H100 decode steps, batch 192
// 3.21 -> 3.31 ms, 256 3.87 -> 4.06 with matmul_wg): its tiles split the
// batch as well, ours leave a block all of it (the tensor cores' time
// grows with the rows). The 256-row tile is not yet measured against it.
const matMulWGMaxRows = 128

// matMulWGNormRows is the most rows for which matmul_wg takes part in
// add_rmsnorm (FOLD in matmul_wg.cu). H100, 0.6B decode steps with o_proj
// adding to the residual and gate_up normalising it: batch 25 1.445 ->
// 1.420 ms, 32 1.483 -> 1.452, 48 1.765 -> 1.757; 64 1.89 -> 1.96 and 128
// 2.42 -> 2.49, where every block's pass over x costs more than the
// add_rmsnorm launch it saves.
const matMulWGNormRows = 48

const (
	matMulWGTileRows = 128 // MWG_ROWS: weight rows a block
	matMulWGThreads  = 288 // MWG_THREADS: moe_wg's two warpgroups and producer warp
	matMulWGBK       = 64
	// matMulWGMaxCluster is the portable cluster size: a tile's K splits.
	matMulWGMaxCluster = 8
	// The ring: at most matMulWGMaxStages stages within matMulWGRingBytes
	// (mwg_stages in matmul_wg.cu).
	matMulWGMaxStages = 8
	matMulWGRingBytes = 192 << 10
)

// clusterFit is how many clusters of s matmul_wg blocks run at once, by s
// (0: the driver cannot say).
type clusterFit [matMulWGMaxCluster + 1]int

// blocksByWarps is how many blocks of w warps a kernel runs at once, by w
// (0: the driver cannot say).
type blocksByWarps [matMulWGMaxCluster + 1]int

// matMulWGBlock is matmul_wg's block (MWG_BLOCK): two consumer warpgroups
// and a producer warpgroup that gives them its registers, or with MWG_REGS=0
// in EBB_KERNEL_DEFINES a producer warp.
func matMulWGBlock() int {
	if kernelDefineInt("MWG_REGS", 1) == 0 {
		return matMulWGThreads
	}
	return matMulWGThreads - 32 + 128
}

// initMatMulWG lets matmul_wg's kernels have their shared memory, where
// the module was built for sm_90a and the driver encodes tensor maps
// (EBB_MATMUL_WG=0 leaves them unused).
func (d *Device) initMatMulWG() error {
	if d.mod.Arch != "sm_90a" || !HasTensorMaps() || os.Getenv("EBB_MATMUL_WG") == "0" {
		return nil
	}
	for _, bn := range matMulWGRows {
		if err := d.k[fmt.Sprintf("matmul_wg_n%d", bn)].SetMaxDynamicShared(matMulWGShared(bn)); err != nil {
			return err
		}
	}
	for _, bn := range []int{matMulWGDetPartRows, matMulWGPartRows} {
		if err := d.k[fmt.Sprintf("matmul_wg_part_n%d", bn)].SetMaxDynamicShared(matMulWGShared(bn)); err != nil {
			return err
		}
		if err := d.k[fmt.Sprintf("matmul_wg_part_qkv_n%d", bn)].SetMaxDynamicShared(matMulWGQKVShared(bn)); err != nil {
			return err
		}
	}
	d.noQKVEpilogue = os.Getenv("EBB_DET_QKV_EPILOGUE") == "0"
	if n, err := strconv.Atoi(os.Getenv("EBB_DET_PART_FROM")); err == nil && n > 0 {
		d.detPartFrom = n
	}
	d.noPart = os.Getenv("EBB_MATMUL_WG_PART") == "0"
	d.noPartOne = os.Getenv("EBB_DET_PART_ONE") == "0"
	d.wgOneTile = os.Getenv("EBB_MATMUL_WG_PERSIST") == "0"
	d.wgNo192 = os.Getenv("EBB_MATMUL_WG_N192") == "0"
	for t := 1; t <= detFewMaxRows/8; t++ {
		for _, name := range []string{"matmul_wg_few_t%d", "matmul_wg_few_qkv_t%d"} {
			if err := d.k[fmt.Sprintf(name, t)].SetMaxDynamicShared(matMulWGFewShared(matMulWGMaxCluster)); err != nil {
				return err
			}
		}
	}
	// Outside deterministic inference matmul_wg_few takes 2-8 rows (one
	// batch tile): its blocks' residency by warps, for matMulWGFewShape.
	for w := 1; w <= matMulWGMaxCluster; w++ {
		n, err := d.k[matMulWGFewName(matMulFewRows)].MaxActiveClusters(32*w, matMulWGFewShared(w), 1)
		if err != nil {
			break // the driver cannot say: the splits stay as they start
		}
		d.fewResident[w] = n
	}
	d.moeWGRing32 = kernelDefineInt("MOE_WG_RING32", moeWGRing32)
	for _, bn := range moeWGRows {
		if err := d.k[fmt.Sprintf("moe_wg_n%d", bn)].SetMaxDynamicShared(d.moeWGShared(bn)); err != nil {
			return err
		}
	}
	d.moeWG = os.Getenv("EBB_MOE_WG") != "0"
	if err := d.k["moe_down_bulk"].SetMaxDynamicShared(moeDownBulkMaxShared); err != nil {
		return err
	}
	d.noMoEBulk = os.Getenv("EBB_MOE_BULK") == "0"
	if n, err := strconv.Atoi(os.Getenv("EBB_MATMUL_WG_ROWS")); err == nil && slices.Contains(matMulWGRows, n) {
		d.wgMaxRows = n
	}
	d.wgBlock = matMulWGBlock()
	if n, err := strconv.Atoi(os.Getenv("EBB_MATMUL_WG_TILES")); err == nil && n >= 1 {
		d.wgMaxTiles = n
	}
	if n, err := strconv.Atoi(os.Getenv("EBB_MATMUL_WG_SPLITS")); err == nil && n >= 1 && n <= matMulWGMaxCluster {
		d.wgSplits = n
	}
	// Every batch tile's ring takes most of an SM's shared memory, so the
	// largest tile's clusters are every tile's.
	bn := matMulWGRows[len(matMulWGRows)-1]
	for s := 2; s <= matMulWGMaxCluster; s++ {
		n, err := d.k[fmt.Sprintf("matmul_wg_n%d", bn)].MaxActiveClusters(d.wgBlock, matMulWGShared(bn), s)
		if err != nil {
			break // the driver cannot say: clusters are taken to fit wherever their blocks do
		}
		d.wgClusters[s] = n
	}
	d.wgmma = true
	return nil
}

// matMulWGShared is matmul_wg's shared memory for a batch tile: the ring
// and room to align it to 1024 bytes (the swizzle's period).
func matMulWGShared(bn int) int {
	stage := (matMulWGTileRows + bn) * matMulWGBK * 2
	return min(matMulWGMaxStages, matMulWGRingBytes/stage)*stage + 1024
}

// matMulWGQKVShared is matmul_wg_part_qkv's shared memory: matmul_wg's,
// and the tile staged as bf16 for its epilogue (bn rows of one head).
func matMulWGQKVShared(bn int) int { return matMulWGShared(bn) + bn*matMulWGTileRows*2 }

// matMulWGTightRows is the largest batch tile whose blocks ask for only the
// shared memory they use (matMulWGUsed), not the whole ring
// (EBB_MATMUL_WG_RING=full gives every tile the whole ring, for A/B runs). A block that
// asks for less can start beside the previous kernel's blocks (dependent
// launch) and request its weights sooner. H100, 0.6B decode steps, ms,
// whole ring against what is used: deterministic inference (every product
// on matmul_wg) batch 1 1.345 -> 1.270, but batch 64 2.195 -> 2.211; 32, 64
// and 128 rows outside it level (1.37, 1.72, 2.33). With 64 rows two
// blocks of a cluster fit one SM, and sharing its tensor cores may cost
// more than the earlier start gains.
const matMulWGTightRows = 32

// matMulWGUsed is the shared memory a matmul_wg block of kps k-steps
// touches: a ring that never wraps uses only its first kps stages, and with
// splits the sums (bn rows of 128 floats) take the ring's place.
func matMulWGUsed(bn, kps, splits int) int {
	stage := (matMulWGTileRows + bn) * matMulWGBK * 2
	used := min(matMulWGMaxStages, matMulWGRingBytes/stage, kps) * stage
	if splits > 1 {
		used = max(used, bn*matMulWGTileRows*4)
	}
	return used + 1024
}

// useMatMulWG says whether matmul_wg takes m rows of an n x k product
// (n a multiple of 16 for its tensor map's 16-row groups) that matmul_tc
// does not (more than 8 rows: it asks after useMatMulTC). With glu it
// replaces cuBLAS and a silu_mul pass; alone, up to matMulWGMaxTiles
// weight tiles (EBB_MATMUL_WG_TILES=N for A/B runs; 16, a full cluster's
// splits a tile on the 132 SMs of an H100 or H200, is the route before).
func (d *Device) useMatMulWG(m, n, k int, glu bool) bool {
	return d.wgmma && m > 8 && m <= cmp.Or(d.wgMaxRows, matMulWGMaxRows) && k%matMulWGBK == 0 &&
		n%16 == 0 && (glu || matMulWGTiles(n) <= cmp.Or(d.wgMaxTiles, matMulWGMaxTiles))
}

// matMulWGMaxTiles is the most weight tiles of a product without glu that
// matmul_wg takes. At first it took only those of a full cluster's splits
// each (SMs / 8: 16 on an H200): H100, 0.6B decode steps, o_proj and
// down_proj (8 tiles) and gate_up with glu on matmul_wg, batch 32 1.68 ->
// 1.49 ms, 64 1.87 -> 1.76, 128 2.56 -> 2.54, but qkv (32 tiles) made 96
// and 128 slower (2.32 -> 2.38, 2.58 -> 2.76), its 32 clusters of four
// splits not all resident. Since splitsCap shrinks the splits to clusters
// that fit, more tiles pay: H200, 128 in / 64 out, dummy weights,
// temperature 1, decode ms a step with 16 tiles -> 64 (two rounds each):
// 8B shape (qkv 48 tiles, o_proj and down_proj 32) batch 9 / 16 / 32 / 64
// / 96 / 128 5.043 / 5.098 / 5.292 / 5.566 / 6.287 / 6.853 -> 4.906 /
// 4.978 / 5.106 / 5.417 / 6.110 / 6.824; 0.6B (qkv 32) batch 25 / 32 / 64
// / 96 1.132 / 1.167 / 1.506 / 1.746 -> 1.094 / 1.119 / 1.438 / 1.714;
// 30B-A3B (qkv 40) batch 12 / 16 / 32 10.147 / 11.344 / 14.515 -> 9.965 /
// 11.180 / 14.404. Past 128 rows cuBLAS stays faster (EBB_MATMUL_WG_ROWS=256:
// 8B batch 160 / 256 +10.8 / +9.6 %, 30B-A3B +0.2 / +1.9 %), and the
// lm_head's thousand tiles stay on it.
const matMulWGMaxTiles = 64

// matMulWGTiles is how many of matmul_wg's 128-row weight tiles n rows of
// weights make.
func matMulWGTiles(n int) int { return (n + matMulWGTileRows - 1) / matMulWGTileRows }

// matMulWGPartRows is matmul_wg_part's batch tile.
const matMulWGPartRows = 128

// Deterministic decode batches of more than matMulWGDetPartFrom rows run
// the products of at least matMulWGDetPartTiles weight tiles in
// matMulWGDetPartSplits splits or more (qkv: not gate_up's two splits, nor
// o_proj's and down_proj's 8 tiles) on matmul_wg_part in 64-row batch
// tiles: the same bits as a cluster's splits, without the sums passed
// through distributed shared memory. H100, 0.6B shape, flag on, ms a
// decode step (128 in, 64 out) at batch 64 / 256: all on clusters 1.806 /
// 4.106 and 1.793 / 4.070; qkv and gate_up on 64-row part tiles 1.773 /
// 3.886 and 1.773 / 3.909; 128-row part tiles (batch 256 only) 3.895 /
// 3.877; o_proj and down_proj too (32 blocks at batch 256) 1.721 / 4.161
// and 1.726 / 4.168 (flag off: 1.727 / 3.394). With 128 out, batch 64 /
// 96 / 128 / 256, two rounds: clusters 1.858 / 2.338 / 2.740 / 4.499 and
// 1.862 / 2.315 / 2.768 / 4.478; qkv and gate_up on part tiles 1.843 /
// 2.278 / 2.630 / 4.262 and 1.844 / 2.282 / 2.656 / 4.269; qkv alone 1.849
// / 2.318 / 2.646 / 4.147 and 1.813 / 2.261 / 2.655 / 4.141 (gate_up's
// part tiles, 23.9 us at batch 256, against 19.9 on clusters). Since the
// qkv product on part tiles prepares q, k and v too (matmul_wg_part_qkv),
// 17-48 rows take them as well: 128 in, 64 out, batch 17 / 24 / 32 / 48,
// from 49 rows 1.419 / 1.443 / 1.535 / 1.671 and 1.415 / 1.435 / 1.523 /
// 1.674, from 17 rows 1.305 / 1.340 / 1.376 / 1.539 and 1.305 / 1.335 /
// 1.377 / 1.539 (EBB_DET_PART_FROM=48 for A/B runs). Up to 16 rows
// matmul_wg_few takes the product.
//
// The same products in fewer splits (gate_up's two) run on 128-row part
// tiles from two such tiles (129 rows): 48 weight tiles x 2 are 96 blocks,
// as many as the clusters of two had, each running both splits without
// the exchange (the 64-row tiles above gave gate_up 192 tiles and 23.9
// us). H100, 0.6B shape, flag on, ms a decode step (128 in, 128 out),
// batch 192 / 256, rounds of one A/B run: clusters 3.257 / 4.097, 3.273 /
// 4.070, 3.277 / 4.051, 3.961 (256 only), 4.019; part tiles 3.266 / 3.994,
// 3.201 / 3.989, 3.235 / 3.994, 3.939, 3.946 (flag off 2.964-3.015 /
// 3.522-3.605). Batch 1 and 128 do not reach it (0.916-0.937 against
// 0.919-0.944). One split (kps 16: new bits) measured the same at batch
// 256 and cost batch 1 about 0.09 ms through matmul_wg_few's longer
// chains, as did o_proj's and down_proj's eight splits made four (256:
// 3.85 with both; branch wip/det-wg-knob, EBB_DET_WG).
const (
	matMulWGDetPartFrom   = 16
	matMulWGDetPartTiles  = 32
	matMulWGDetPartSplits = 4
	matMulWGDetPartRows   = 64
)

// matMulWGShape picks matmul_wg's batch tile and grid (128-row tiles of
// w, K splits): K is split over a cluster of up to 8 blocks so that the
// grid fills the SMs once. The splits depend on the weights' shape alone,
// so that a row's sums are added in the same order at any batch size.
// Where 128-row batch tiles alone fill the GPU (deterministic inference's
// prefills), matmul_wg_part runs each tile's splits one after the other in
// one block (kpart k-steps each, the same order of sums) instead.
func (d *Device) matMulWGShape(m, n, k int) (name string, bn int, grid Dim3, kps, kpart int) {
	bn = matMulWGRows[len(matMulWGRows)-1]
	for _, b := range matMulWGRows {
		if m <= b && !(b == 192 && d.wgNo192) {
			bn = b
			break
		}
	}
	tiles, kt := matMulWGTiles(n), k/matMulWGBK
	splits, kps := d.kSplits(tiles, kt, d.splitsCap(tiles))
	// Deterministic products of too few splits for the 64-row part tiles
	// below (gate_up's two) take 128-row ones from two tiles.
	pt := (m + matMulWGPartRows - 1) / matMulWGPartRows
	few := d.det && pt >= 2 && tiles >= matMulWGDetPartTiles && splits < matMulWGDetPartSplits
	// A deterministic product of one split whose 128-row part tiles pad no
	// more rows than matmul_wg's batch tile would (a decode batch of
	// 193-256 rows; its lm_head has 1,187 weight tiles at the Qwen3
	// vocabulary) takes the persistent blocks too, each running a tile's
	// whole K (kpart = kt: no running sum, the bits of a block a tile).
	// H200, 0.6B shape, flag on, batch 256, four rounds: 3.454 ms a step
	// with a block a tile, 3.363 on part blocks (batch tiles first), the
	// same tokens; the lm_head alone 180.6 against 179.8 us, so the step
	// gains beside it, not in it. At 192 rows (two part tiles where
	// matmul_wg takes one of 192) a step lost 4.6 % with the weight tiles
	// first and 1.5 % with the batch tiles first. EBB_DET_PART_ONE=0 keeps
	// a block a tile, for A/B runs.
	one := d.det && splits == 1 && pt >= 2 && pt*matMulWGPartRows <= bn && m <= matMulWGRows[len(matMulWGRows)-1] &&
		!d.noPartOne
	if (splits > 1 || one) && (pt*tiles >= d.ctx.SMs || few) && !d.noPart {
		return "matmul_wg_part_n128", matMulWGPartRows, d.persistentGrid(pt * tiles), kt, kps
	}
	if d.det && m > cmp.Or(d.detPartFrom, matMulWGDetPartFrom) && tiles >= matMulWGDetPartTiles && splits >= matMulWGDetPartSplits && !d.noPart {
		pt64 := (m + matMulWGDetPartRows - 1) / matMulWGDetPartRows
		return "matmul_wg_part_n64", matMulWGDetPartRows, d.persistentGrid(pt64 * tiles), kt, kps
	}
	// Past the largest tile (deterministic inference's prefills), a batch
	// tile a blockIdx.y.
	ytiles := (m + bn - 1) / bn
	return fmt.Sprintf("matmul_wg_n%d", bn), bn, Dim3{uint32(tiles), uint32(ytiles), uint32(splits)}, kps, 0
}

// kSplits is how a product of tiles weight tiles and kt k-steps splits
// its K (at most most splits) so that its blocks fill the SMs once: the
// splits and each one's k-steps.
func (d *Device) kSplits(tiles, kt, most int) (splits, kps int) {
	splits = max(1, min(kt, most, d.ctx.SMs/tiles))
	kps = (kt + splits - 1) / splits
	return (kt + kps - 1) / kps, kps
}

// splitsCap is the most K splits a product of tiles weight tiles takes:
// a full cluster, or outside deterministic inference (whose products keep
// their bits at every batch size in matmul_wg_few and matmul_wg_part too)
// the largest cluster of which the tiles all run at once. An H200 holds 15
// clusters of 8 or 7 blocks one an SM, 17 of 6, so the 30B-A3B shape's
// o_proj (16 tiles) in eight splits ran in two waves: `ebb bench matmul`,
// 16 / 64 / 128 rows, us, 10.50 / 10.93 / 15.22, in six splits 7.88 / 8.31
// / 9.86 (cuBLAS at 64 / 128: 9.12 / 9.31). EBB_MATMUL_WG_SPLITS caps the
// splits instead, for A/B runs. matmul_wg_few launches no clusters and
// starts from a full cluster's splits (matMulWGFewShape).
func (d *Device) splitsCap(tiles int) int {
	if d.det {
		return matMulWGMaxCluster
	}
	if d.wgSplits > 0 {
		return d.wgSplits
	}
	s := matMulWGMaxCluster
	for s > 1 && d.wgClusters[s] > 0 && tiles > d.wgClusters[s] {
		s--
	}
	return s
}

// persistentGrid is matmul_wg_part's grid for n tiles: blocks that each
// take a tile every gridDim.x, as few as finish in the same number of
// rounds as one block an SM would (the kernel needs the whole SM's shared
// memory for its ring). EBB_MATMUL_WG_PERSIST=0 gives each tile a block of
// its own, for A/B runs.
func (d *Device) persistentGrid(n int) Dim3 {
	if d.wgOneTile {
		return D1(n)
	}
	rounds := (n + d.ctx.SMs - 1) / d.ctx.SMs
	return D1((n + rounds - 1) / rounds)
}

// matMulWG launches matmul_wg; with glu w is [gate | up] and out takes
// silu(gate) * up (n/2 columns, bf16).
func (d *Device) matMulWG(out uintptr, outF32 bool, x, w uintptr, m, n, k int, glu bool, norm normFold) {
	if d.err != nil {
		return
	}
	name, bn, grid, kps, kpart := d.matMulWGShape(m, n, k)
	d.launchWG(name, grid, d.wgBlock, d.matMulWGRing(bn, kps, kpart, int(grid.Z)), int(grid.Z), wgOperands{w: w, n: n, x: x, m: m, k: k, glu: glu, box: bn},
		P(out), I(boolInt(outF32)), I(m), I(n), I(k), I(boolInt(glu)), I(kps),
		P(norm.residual), P(norm.normW), P(d.rowSquares.Ptr), I(norm.parts), F(norm.eps), I(kpart))
}

// matMulWGRing is the shared memory a matmul_wg launch of matMulWGShape's
// tile, k-steps, kpart and splits asks for: the whole ring, or for tight
// tiles only what a block uses.
func (d *Device) matMulWGRing(bn, kps, kpart, splits int) int {
	if kpart == 0 && bn <= matMulWGTightRows && !d.wgFullRing {
		return matMulWGUsed(bn, kps, splits)
	}
	return matMulWGShared(bn)
}

// wgOperands are the two operands of a matmul_wg or moe_wg launch: w
// [n, k] (or [experts, n, k]) and x [m, k], whose rows the kernel copies
// box at a time.
type wgOperands struct {
	w          uintptr
	experts, n int
	x          uintptr
	m, k       int
	glu        bool
	box        int
}

// launchWG launches matmul_wg or moe_wg with its operands' tensor maps as
// the first parameters, then args.
func (d *Device) launchWG(name string, grid Dim3, threads, shared, cluster int, o wgOperands, args ...uint64) {
	if d.err != nil || d.skipKernels[name] {
		return
	}
	wmap, xmap, err := o.maps()
	if err != nil {
		d.fail(err)
		return
	}
	d.launchCluster(name, grid, D1(threads), shared, cluster, []TensorMap{wmap, xmap}, args...)
}

// launchCluster is launch for a kernel of thread block clusters of cluster
// blocks along z, with tensor maps as its first parameters.
func (d *Device) launchCluster(name string, grid, block Dim3, shared, cluster int, maps []TensorMap, args ...uint64) {
	if d.err != nil || d.skipKernels[name] {
		return
	}
	if kern := d.kernel(name); kern != nil {
		d.fail(d.ctx.LaunchCluster(kern, grid, block, shared, cluster, maps, args...))
	}
}

// maps are the operands' tensor maps. w's is (k, row within 8, gate or
// up, group of 8), with the expert outermost where there are experts:
// without glu the halves of a 16-row group are rows 0-7 and 8-15, with glu
// 8 gates and their ups n/2 rows further.
func (o wgOperands) maps() (wmap, xmap TensorMap, err error) {
	row := uint64(2 * o.k)
	dims, strides := []uint64{uint64(o.k), 8, 2, uint64(o.n / 16)}, []uint64{row, 8 * row, 16 * row}
	if o.glu {
		strides[1], strides[2] = uint64(o.n/2)*row, 8*row
	}
	box := []uint32{matMulWGBK, 8, 2, 8}
	if o.experts > 0 {
		dims, strides, box = append(dims, uint64(o.experts)), append(strides, uint64(o.n)*row), append(box, 1)
	}
	if wmap, err = NewTensorMapBF16(o.w, dims, strides, box, true); err != nil {
		return
	}
	xmap, err = NewTensorMapBF16(o.x, []uint64{uint64(o.k), uint64(o.m)}, []uint64{row}, []uint32{matMulWGBK, uint32(o.box)}, true)
	return
}
