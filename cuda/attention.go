package cuda

import (
	"fmt"
	"strings"

	"ebb/device"
)

// Attention implements device.Device: a decode kernel when every sequence
// has one query (split along the KV for parallelism when the batch is small),
// the tiled prefill kernel otherwise.
func (d *Device) Attention(out, qkv, kCache, vCache device.Tensor, meta device.AttnMeta, scale float32) {
	if d.err != nil || meta.NumSeqs == 0 {
		return
	}
	hk, dim := kCache.Dim(1), kCache.Dim(2)
	hq := qkv.Dim(1) - 2*hk
	g := hq / hk
	if d.det {
		d.attnDet(out, qkv, kCache, vCache, meta, scale, hq, hk, dim)
		return
	}
	if meta.MaxQLen > 1 && meta.Decodes > 0 && meta.Decodes < meta.NumSeqs {
		// A mixed step: the prefill kernel would give each decode a whole
		// tile of queries; the decodes go to the decode kernel instead.
		if _, _, ok := d.splitDecodeKernel(g, dim, meta.Decodes*hk, meta.MaxKVLen); ok {
			dec, pre := meta, meta
			dec.NumSeqs, dec.MaxQLen = meta.Decodes, 1
			pre.NumSeqs, pre.Decodes = meta.NumSeqs-meta.Decodes, 0
			pre.QIndptr = meta.QIndptr.Rows(meta.Decodes, meta.NumSeqs+1)
			pre.KVIndptr = meta.KVIndptr.Rows(meta.Decodes, meta.NumSeqs+1)
			d.Attention(out, qkv, kCache, vCache, dec, scale)
			d.Attention(out, qkv, kCache, vCache, pre, scale)
			return
		}
	}
	if meta.MaxQLen == 1 && !meta.Sparse {
		if name, _, ok := d.splitDecodeKernel(g, dim, meta.NumSeqs*hk, meta.MaxKVLen); ok {
			waves, splits := d.decodeVecGrid(meta.NumSeqs*hk, g, d.gqaDecode(g, dim, meta.NumSeqs*hk))
			d.attnDecode(name, waves, splits, true, out, qkv, kCache, vCache, meta, scale, hq, hk, dim, nil)
			return
		}
		if name, ok := decodeKernel(g, dim); ok {
			d.attnDecode(name, 2, 32, false, out, qkv, kCache, vCache, meta, scale, hq, hk, dim, nil)
			return
		}
	}
	if dim == 64 || dim == 128 {
		d.attnPrefillMMA(out, qkv, kCache, vCache, meta, scale, hq, hk, dim, rawQueries{})
		return
	}
	d.attnPrefill(out, qkv, kCache, vCache, meta, scale, hq, hk, dim)
}

// decodeVecWaves is the blocks (in SMs' worth) attn_decode_vec's fair
// shares are cut for, for a batch of pairs (sequence, kv head): four,
// except where the pairs fill between half and all of one wave of four
// blocks an SM. There, shares of a quarter of the GPU's blocks left the
// longest of mixed contexts one block each, running long after the rest;
// shares of an eighth give them two (H100, 200-1800 positions, `bench
// attention`: 48-64 sequences 73-76% -> 79-84% of HBM bandwidth; 128
// requests of nano-vllm's workload 61.6 / 61.7% -> 62.6 / 62.7% of the
// bandwidth floor). Beyond one wave it made 128 sequences slower (90% ->
// 78%), and below half a wave it changed nothing.
func decodeVecWaves(pairs, sms int) int {
	if pairs > 2*sms && pairs <= 4*sms {
		return 8
	}
	return 4
}

// decodeVecMaxSplits is attn_decode_vec's limit (DV_MAX_SPLITS).
const decodeVecMaxSplits = 128

// decodeVecGrid is the waves and most splits attn_decode_vec gets for a
// batch of pairs (sequence, kv head): at most 64 splits (the waves' worth
// of blocks decides below that: only the smallest batches get more than
// 32), or with EBB_DECODE_SPLITS (for A/B runs) that many, with the waves
// to hold them. Batch 1 of Qwen3-0.6B, H100, ms a decode step: 32k
// positions 2.51 with 32 splits, 2.20 with 64, 2.42 with 128 (whose merge
// the last block does alone); 4k positions 1.17 / 1.20 / 1.19.
//
// attn_decode_gqa (gqa) runs two blocks an SM, not four, and a block's
// fixed cost (its queries, the merge of its warps, a split's partials and
// the last block's merge) is most of its time at short contexts, so it
// does not take the vector kernel's eight waves where the pairs fill half
// to all of one: that cut 64 sequences of 132 positions in two splits each
// for nothing. Where it takes the small batches of g (one or two) heads a
// kv head that the vector kernel takes otherwise, it fills the GPU once
// (two waves of one block an SM): 8 pairs of 32,000 positions 55.7 us with
// four, 51.5 with two; 64 pairs of 4,000 51.9 / 48.3; from 64 pairs of 512
// up the same. EBB_GQA_WAVES sets its waves for A/B runs.
func (d *Device) decodeVecGrid(pairs, g int, gqa bool) (waves, splits int) {
	waves, splits = decodeVecWaves(pairs, d.ctx.SMs), 64
	if gqa {
		waves = 4
		if g < gqaDecodeFrom {
			waves = 2
		}
		if d.gqaWaves > 0 {
			waves = d.gqaWaves
		}
	}
	if d.decodeSplits > 0 {
		splits = d.decodeSplits
		waves = max(waves, (splits*pairs+d.ctx.SMs-1)/d.ctx.SMs)
	}
	return waves, splits
}

// decodeVecMinSplit is the fewest positions a split of attn_decode_vec
// takes: 64, and 128 where a sequence may have more than 32 splits, so
// that a short context keeps to about 32 (4k positions at batch 1 in 63
// splits of 64 ran 2% slower than in 32).
func decodeVecMinSplit(splits int) int {
	if splits > 32 {
		return 128
	}
	return 64
}

// decodeWholeContext is the longest context a balanced decode kernel
// takes in one split, decodeWholeContextG8 that for eight query heads a kv
// head or more. One split writes its output at once where more leave
// partials, elect a last block and merge them, and at short contexts that
// costs more than the split's positions save. A decode step at 128 to 256
// positions, H200, against the splits decode_split cuts (two of 128
// positions at batch 1): the 30B-A3B shape (8 heads a kv head) batch 1
// 2.890 -> 2.761 ms (-4.45 %), batch 8 8.408 -> 8.176 (-2.76 %), batch 32
// 14.953 -> 14.752 (-1.35 %), batch 256 the same (one split already); the
// 8B shape (4) batch 1 4.412 -> 4.401 (-0.26 %), batch 32 5.400 -> 5.331
// (-1.28 %); the 0.6B shape (2) batch 1 0.758 -> 0.757 (-0.20 %). At 256 to
// 384 positions, batch 1, one split up to 384 against 256: 30B-A3B 2.926
// -> 2.855 (-2.44 %; batch 8 -0.11 %), 8B +1.02 %, 0.6B +6.27 %; the
// merge a split pays grows with the heads it merges. Longer bounds lost
// where contexts reach them: 512 at 384 to 512 positions, 8B +2.52 %,
// 0.6B +11.7 % (30B-A3B -0.25 %); 1,024 at 896 to 1,024, 30B-A3B +15.7 %.
const (
	decodeWholeContext   = 256
	decodeWholeContextG8 = 384
)

// decodeWhole is the one-split bound for g query heads a kv head, or
// EBB_DECODE_WHOLE's where it is set, for A/B runs (0: the splits
// decode_split cuts).
func (d *Device) decodeWhole(g int) int {
	switch {
	case d.wholeSet:
		return d.whole
	case g >= 8:
		return decodeWholeContextG8
	}
	return decodeWholeContext
}

// splitDecodeKernel picks the split decode kernel for g query heads a kv
// head, the head size, a step's pairs (sequence, kv head) and its longest
// context: attention_gqa.cu's tensor-core kernel for 3 to 8 heads of 128
// dims, and for fewer where the pairs are few (gqaDecode), in its lean form
// where the contexts are short (leanDecode); attention_fast.cu's vector
// kernel for head sizes of 32 to 256 lanes' worth of 16-byte loads and up
// to 8 heads. raw is the kernel that also prepares the step's queries and
// newest K and V.
func (d *Device) splitDecodeKernel(g, dim, pairs, maxKV int) (name, raw string, ok bool) {
	if d.gqaDecode(g, dim, pairs) {
		if d.leanDecode(g, pairs, maxKV) {
			return "attn_decode_gqa_lean_d128", "attn_decode_gqa_lean_raw_d128", true
		}
		if d.oneDecode(g, pairs, maxKV) {
			return "attn_decode_gqa_one_d128", "attn_decode_gqa_one_raw_d128", true
		}
		return "attn_decode_gqa_d128", "attn_decode_gqa_raw_d128", true
	}
	mg := 1
	for mg < g {
		mg *= 2
	}
	if mg > 8 || (dim != 32 && dim != 64 && dim != 128 && dim != 256) {
		return "", "", false
	}
	return fmt.Sprintf("attn_decode_vec_d%d_g%d", dim, mg), fmt.Sprintf("attn_decode_vec_raw_d%d_g%d", dim, mg), true
}

// gqaDecodeFrom is the fewest query heads a kv head that decode on
// attn_decode_gqa by default, gqaDecodeHeads the most it takes
// (DG_HEADS). Below three the vector kernel's per-row work was not what
// limited it (H100, 256 x 2,048 positions: 92 % of HBM bandwidth with two
// heads, 68 % with four).
const (
	gqaDecodeFrom  = 3
	gqaDecodeHeads = 8
)

// gqaFromEnv is the fewest heads EBB_DECODE_GQA's value v sends to
// attn_decode_gqa: "0" none, "all" every count, otherwise 0 (the default).
func gqaFromEnv(v string) int {
	switch v {
	case "0":
		return gqaDecodeHeads + 1
	case "all":
		return 1
	}
	return 0
}

// gqaDecode says whether g query heads a kv head of dim take
// attn_decode_gqa in a step of pairs (sequence, kv head): from three heads
// always, where the vector kernel's work a row grows with the heads until
// it outweighs the loads; one or two heads where the pairs are at most
// 4.5 waves of SMs, where the vector kernel's fixed cost a block is what
// shows (EBB_DECODE_GQA, for A/B runs: 0 for none, all for 1 to 8 at any
// batch). The 0.6B shape (two heads, 8 kv heads), H100, us: 1 x 32,000
// 52.6 -> 51.5, 1 x 4,000 11.4 -> 10.2, 71 x 512 64.0 -> 59.9, 71 x 8,192
// 855.5 -> 822.0; a decode step at batch 1, 128 positions 0.90 -> 0.83 ms.
// At 256 sequences the vector kernel is faster (512 positions 176.9 against
// 187.5, and the step 3.32 ms against 3.63).
func (d *Device) gqaDecode(g, dim, pairs int) bool {
	if dim != 128 || g > gqaDecodeHeads {
		return false
	}
	if d.gqaFrom != 0 {
		return g >= d.gqaFrom
	}
	return g >= gqaDecodeFrom || 2*pairs <= 9*d.ctx.SMs
}

// gqaLeanMaxKV is the longest context at which a decode step of 3 to 8
// query heads a kv head takes attn_decode_gqa's lean kernels (128
// registers, four blocks an SM, one chunk in flight a warp) rather than
// its two-chunk ones (212 registers, two blocks an SM). At short contexts a
// block's fixed chain of loads is most of its time and more blocks an SM
// hide it; at long ones the second chunk in flight wins. `ebb bench
// attention`, H200, us, two-chunk against lean: 30B-A3B shape (8 heads a
// kv head) batch 256 x 192 positions 40.8 / 33.4, x 512 77.0 / 71.0, x
// 1,024 134.3 / 132.0, x 2,048 250.9 / 257.8, x 16,384 1,906.7 /
// 1,970.4; batch 64 x 1,024 43.8 / 41.2, batch 128 x 1,024 68.2 / 69.5;
// 8B shape (4) batch 256 x 1,024 256.9 / 250.8, x 4,096 959.6 / 981.5.
// A 30B-A3B decode step at batch 256 x 128-192 positions, EBB_GQA_LEAN=0
// against by context: 19.730 / 19.729 -> 19.433 / 19.442 ms; batch 16 x
// 512 11.973 -> 11.815. Decode graphs are captured for both sides of the
// bound (device.ContextDecoder).
const gqaLeanMaxKV = 1024

// gqaHeadsABlock is the kv heads of a sequence that one block of
// attn_decode_gqa's lean kernels takes, its four warps shared among them.
// At short contexts a block's fixed chain (slots, queries, merge) is much
// of its time, and each wave of blocks pays it again while memory idles;
// a block of h heads has h times the positions a warp, in 1/h the blocks.
// So h is the one (1 or 2) with the least waves x h, the streaming a warp
// does counted in whole waves of blocks (waves blocks an SM), and on a tie
// the larger, which pays the fixed chain fewer times. `ebb bench
// attention --layout interleaved`, H200, us, one head a block against
// two: 30B-A3B shape (8 query heads a kv head) batch 256 x 128 / 192 / 256
// / 512 positions 29.5 / 37.2 / 45.0 / 73.9 against 25.6 / 33.0 / 40.2 /
// 72.0, batch 160 x 192 29.1 / 27.1 (a tie by the count), batch 128 x 192
// 18.9 / 28.8 (one wave either way: one head); 8B shape (4) batch 256 x
// 192 64.8 / 59.6 (four heads 55.7), batch 160 x 192 44.3 / 48.7 (three
// waves against two of twice the work: one head). Not four by default: a
// block's splits are at most two (decode_split, balanced), so with four the
// longest context among short ones would run on one warp a head.
// EBB_GQA_HEADS_A_BLOCK sets the heads for A/B runs (1, 2 or 4, where they
// divide hk and hpb * (G + 1) query preparations fit the block's rounds;
// otherwise one). The two-chunk kernels keep one head a block.
func (d *Device) gqaHeadsABlock(lean bool, b, hq, hk, waves int) int {
	fits := func(h int) bool {
		return h <= gqaMaxHeadsABlock && 4%h == 0 && hk%h == 0 && h*(hq/hk+1) <= 16*gqaTaskRounds
	}
	switch {
	case !lean:
		return 1
	case d.gqaHeads > 0 && fits(d.gqaHeads):
		return d.gqaHeads
	case d.gqaHeads > 0:
		return 1
	}
	wave := waves * d.ctx.SMs
	best, bestCost := 1, (b*hk+wave-1)/wave
	if fits(2) {
		if cost := 2 * ((b*hk/2 + wave - 1) / wave); cost <= bestCost {
			best = 2
		}
	}
	return best
}

// gqaMaxHeadsABlock and gqaTaskRounds are attention_gqa.cu's
// DG_HEADS_A_BLOCK and DG_TASK_ROUNDS.
const (
	gqaMaxHeadsABlock = 4
	gqaTaskRounds     = 2
)

// gqaLeanMinPairs is the fewest pairs (sequence, kv head) that take the
// lean kernels by context: a few blocks gain nothing from room for more on
// an SM, and batch 1 of the 30B-A3B shape (4 pairs) lost (192 positions
// 8.5 -> 8.9 us, a decode step 3.05 -> 3.10 ms); batch 16 (64 pairs) x 512
// positions gained (14.5 -> 10.3 us).
const gqaLeanMinPairs = 64

// leanDecode says whether a decode step of g heads a kv head, its pairs
// and its longest context of maxKV positions takes the lean kernels:
// EBB_GQA_LEAN=1 always, =0 never, for A/B runs. maxKV 0 (unknown) keeps
// the two-chunk kernels.
func (d *Device) leanDecode(g, pairs, maxKV int) bool {
	switch d.gqaLean {
	case leanAlways:
		return true
	case leanNever:
		return false
	}
	return g >= gqaDecodeFrom && pairs >= gqaLeanMinPairs && maxKV > 0 && maxKV <= gqaLeanMaxKV
}

// oneDecode says whether a decode step of g heads a kv head, its pairs
// and its longest context of maxKV positions takes attn_decode_gqa_one:
// at most decodeOne pairs, fewer than the lean kernels take, every
// context within decodeWhole's one split. There the two-chunk kernel
// launches a grid of splits whose blocks past the first return at once,
// and its four warps take a 384-position context in six chunks of 16
// each, one round trip after another; the one kernel launches a block a
// pair, of eight warps. Decode graphs are captured for both sides of
// decodeWhole where it applies (ShortDecodeContext).
func (d *Device) oneDecode(g, pairs, maxKV int) bool {
	w := d.decodeWhole(g)
	return pairs <= d.decodeOne && pairs < gqaLeanMinPairs && maxKV > 0 && maxKV <= w
}

// decodeOneSeqPairs is the most pairs that take attn_decode_gqa_one by
// default: a step of one sequence of up to eight kv heads (two of the
// 30B-A3B shape's four). H200, 128 in / 128 out at temperature 1, against
// the two-chunk kernel, two machines: batch 1 of the 30B-A3B shape 2.765
// -> 2.737 ms (-1.01 %) and 2.747 -> 2.744 (-0.09 %), the 8B 4.375 ->
// 4.331 (-1.02 %) and 4.404 -> 4.359 (-1.02 %), the 0.6B 0.768 -> 0.756
// (-1.50 %) and 0.748 -> 0.747; the 30B-A3B's batch 2 4.111 -> 4.054
// (-1.38 %). All of batch 8's 32 pairs of the 30B-A3B gained 0.09 %, and
// the 8B's and 0.6B's 64 take the lean kernels either way.
const decodeOneSeqPairs = 8

// decodeOneFromEnv is the most pairs EBB_DECODE_ONE's value v sends to
// attn_decode_gqa_one: "0" none, "1" every step below the lean kernels'
// pairs, otherwise decodeOneSeqPairs.
func decodeOneFromEnv(v string) int {
	switch v {
	case "0":
		return 0
	case "1":
		return gqaLeanMinPairs - 1
	}
	return decodeOneSeqPairs
}

// gqaOneWarps is attention_gqa.cu's DG_ONE_WARPS.
const gqaOneWarps = 8

// Lean decode modes (EBB_GQA_LEAN).
const (
	leanByContext = iota
	leanAlways
	leanNever
)

// ShortDecodeContext implements device.ContextDecoder: gqaLeanMaxKV where
// splitDecodeKernel picks another kernel for a batch of a model of hq
// query and hk kv heads of dim on either side of it, 0 where it does not
// (deterministic inference keeps its own kernels).
func (d *Device) ShortDecodeContext(hq, hk, dim, batch int) int {
	if d.det || hk == 0 || hq%hk != 0 {
		return 0
	}
	// The one-split kernels' bound (small batches) and the lean kernels'
	// (from gqaLeanMinPairs pairs) never apply to the same batch.
	for _, bound := range []int{d.decodeWhole(hq / hk), gqaLeanMaxKV} {
		if bound == 0 {
			continue
		}
		short, _, _ := d.splitDecodeKernel(hq/hk, dim, batch*hk, bound)
		long, _, _ := d.splitDecodeKernel(hq/hk, dim, batch*hk, bound+1)
		if short != long {
			return bound
		}
	}
	return 0
}

// PrepareAttention implements device.AttentionPreparer. A decode step's
// kernel prepares its queries and newest K and V itself
// (attn_decode_vec_raw). Where a step has about a thousand prompt tokens
// or more and the tensor-core prefill kernel takes them, prepare_qkv16
// writes back only the decodes' queries and the prefill kernel normalises
// and rotates the rest as it loads them.
func (d *Device) PrepareAttention(out, qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots device.Tensor, meta device.AttnMeta, scale, eps float32) bool {
	hk, dim := kCache.Dim(1), kCache.Dim(2)
	hq := qkv.Dim(1) - 2*hk
	if d.err != nil || d.det {
		return false
	}
	if meta.MaxQLen == 1 {
		return d.prepareDecode(out, qkv, kCache, vCache, meta, scale, hq, hk, dim,
			&decodeRaw{qNorm: qNorm, kNorm: kNorm, positions: positions, slots: slots, cos: cos, sin: sin, eps: eps})
	}
	// The kernel's queries take prepare_qkv16's layout (and bits): only
	// where the step prepares with it.
	if meta.MaxQLen < 1 || (dim != 64 && dim != 128) || !vectorisedQKV(qkv, kCache, vCache, positions.Numel()) {
		return false
	}
	pre, decodes := meta, 0
	if _, _, ok := d.splitDecodeKernel(hq/hk, dim, meta.Decodes*hk, meta.MaxKVLen); ok && meta.Decodes > 0 {
		// As Attention splits a mixed step: the decodes, their queries
		// prepared, to the decode kernel.
		decodes = meta.Decodes
		pre.NumSeqs, pre.Decodes = meta.NumSeqs-decodes, 0
		pre.QIndptr = meta.QIndptr.Rows(decodes, meta.NumSeqs+1)
		pre.KVIndptr = meta.KVIndptr.Rows(decodes, meta.NumSeqs+1)
	}
	// k and v of every token; the decodes' queries as well.
	d.prepareQKV(qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots, eps, positions.Numel(), hq, hq+2*hk, true)
	d.prepareQKV(qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots, eps, decodes, 0, hq, true)
	if decodes > 0 {
		dec := meta
		dec.NumSeqs, dec.MaxQLen = decodes, 1
		d.Attention(out, qkv, kCache, vCache, dec, scale)
	}
	d.attnPrefillMMA(out, qkv, kCache, vCache, pre, scale, hq, hk, dim,
		rawQueries{raw: true, norm: qNorm, cos: cos, sin: sin, eps: eps})
	return true
}

// decodeRaw is what attn_decode_vec_raw needs to prepare a decode step's
// queries and newest K and V as PrepareQKV would.
type decodeRaw struct {
	qNorm, kNorm, positions, slots, cos, sin device.Tensor
	eps                                      float32
}

// prepareDecode runs a decode step's attention with its preparation, where
// attn_decode_vec takes the step (EBB_DECODE_PREPARE=separate leaves it
// to prepare_qkv, for A/B runs).
func (d *Device) prepareDecode(out, qkv, kc, vc device.Tensor, meta device.AttnMeta, scale float32, hq, hk, dim int, raw *decodeRaw) bool {
	_, name, ok := d.splitDecodeKernel(hq/hk, dim, meta.NumSeqs*hk, meta.MaxKVLen)
	if !ok || meta.Sparse || !d.rawDecode || dim%16 != 0 || raw.positions.Numel() != meta.NumSeqs {
		return false
	}
	waves, splits := d.decodeVecGrid(meta.NumSeqs*hk, hq/hk, d.gqaDecode(hq/hk, dim, meta.NumSeqs*hk))
	d.attnDecode(name, waves, splits, true,
		out, qkv, kc, vc, meta, scale, hq, hk, dim, raw)
	return true
}

// rawQueries are what attn_prefill_mma needs to normalise and rotate
// queries straight from the projection (raw false: they are prepared).
// It takes a query's position from its place in the sequence, as the
// causal mask does.
type rawQueries struct {
	raw            bool
	norm, cos, sin device.Tensor
	eps            float32
}

// prefillMMAShared is attn_prefill_mma's shared memory: a query, a K and a
// V tile of 64 rows.
func prefillMMAShared(dim int) int { return 3 * 64 * dim * 2 }

func (d *Device) attnPrefillMMA(out, qkv, kc, vc device.Tensor, meta device.AttnMeta, scale float32, hq, hk, dim int, rq rawQueries) {
	name := fmt.Sprintf("attn_prefill_mma_d%d", dim)
	k, err := d.mod.Func(name)
	if err != nil {
		d.fail(err)
		return
	}
	shared := prefillMMAShared(dim)
	if shared > 48<<10 && !d.mmaShared[dim] {
		if err := k.SetMaxDynamicShared(shared); err != nil {
			d.fail(err)
			return
		}
		d.mmaShared[dim] = true
	}
	tiles := (meta.MaxQLen + 63) / 64
	d.fail(d.ctx.LaunchKernel(k, Dim3{uint32(tiles), uint32(hq), uint32(meta.NumSeqs)}, D1(128), shared,
		P(out.Ptr), P(qkv.Ptr), P(kc.Ptr), P(vc.Ptr), P(meta.QIndptr.Ptr), P(meta.KVIndptr.Ptr),
		P(meta.KVIndices.Ptr), I(hq), I(hk), F(scale), P(rq.norm.Ptr), P(rq.cos.Ptr), P(rq.sin.Ptr),
		F(rq.eps), I(boolInt(rq.raw))))
}

// decodeKernel picks the instantiation whose register tiles fit g query
// heads per kv head and dim.
func decodeKernel(g, dim int) (string, bool) {
	mg := 1
	for mg < g {
		mg *= 2
	}
	dl := 1
	for dl*32 < dim {
		dl *= 2
	}
	if mg > 16 || dl > 8 || (mg == 16 && dl == 8) {
		return "", false
	}
	return fmt.Sprintf("attn_decode_g%d_d%d", mg, dl), true
}

// attnDecode launches a decode kernel over (sequence, kv head, split),
// with enough splits for waves times the SMs' worth of blocks. Balanced
// kernels take the kv head from blockIdx.x, so that the blocks of a
// sequence launch together and a batch ordered longest first (as the
// scheduler orders decodes) launches its longest work first, and cut each
// sequence by its share of the batch's positions.
func (d *Device) attnDecode(name string, waves, maxSplits int, balanced bool, out, qkv, kc, vc device.Tensor, meta device.AttnMeta, scale float32, hq, hk, dim int, raw *decodeRaw) {
	if d.skipKernels[name] {
		return // EBB_SKIP_KERNELS, as launch does
	}
	k, err := d.mod.Func(name)
	if err != nil {
		d.fail(err)
		return
	}
	b := meta.NumSeqs
	// Enough blocks to fill the GPU waves times over; the kernel uses fewer
	// for a short sequence (at least 64 positions a split), and the
	// partials and merge counters must fit their fixed buffers.
	splits := 1
	if blocks := b * hk; blocks < waves*d.ctx.SMs {
		// Rounded down: a block more than the GPU holds at once would
		// make a second wave that costs as much as the first.
		splits = max(1, min(waves*d.ctx.SMs/blocks, maxSplits))
	}
	if balanced {
		// Room for a long context among short ones to take two blocks
		// where the batch alone fills the GPU (the kernel decides).
		splits = max(splits, 2)
	}
	for splits > 1 && (int64(b*hq*splits)*int64(dim)*4 > d.partO.Bytes() || int64(b*hq*splits)*8 > d.partML.Bytes()) {
		splits--
	}
	threads := 128
	if strings.Contains(name, "_one") {
		// One split a sequence: the kernel never merges.
		splits, threads = 1, gqaOneWarps*32
	}
	if b*hk > matMulCountersAt {
		d.fail(fmt.Errorf("attention: %d sequences x %d kv heads exceed the merge counters", b, hk))
		return
	}
	args := []uint64{P(out.Ptr), P(qkv.Ptr), P(kc.Ptr), P(vc.Ptr), P(meta.QIndptr.Ptr), P(meta.KVIndptr.Ptr),
		P(meta.KVIndices.Ptr), P(d.partO.Ptr), P(d.partML.Ptr), P(d.counters.Ptr), I(hq), I(hk), I(dim), I(splits)}
	grid := Dim3{uint32(b), uint32(hk), uint32(splits)}
	if balanced {
		grid = Dim3{uint32(hk), uint32(b), uint32(splits)}
		args = append(args, I(waves*d.ctx.SMs), I(max(waves, 8)*d.ctx.SMs), I(decodeVecMinSplit(splits)), I(d.decodeWhole(hq/hk)))
	}
	if strings.HasPrefix(name, "attn_decode_gqa") {
		hpb := d.gqaHeadsABlock(strings.Contains(name, "_lean"), b, hq, hk, waves)
		grid.X /= uint32(hpb)
		args = append(args, I(hpb))
	}
	args = append(args, F(scale))
	if raw != nil {
		args = append(args, P(raw.qNorm.Ptr), P(raw.kNorm.Ptr), P(raw.positions.Ptr), P(raw.slots.Ptr), P(raw.cos.Ptr),
			P(raw.sin.Ptr), F(raw.eps))
	}
	d.fail(d.ctx.LaunchKernel(k, grid, D1(threads), 0, args...))
}

const (
	prefillRows = 32 // PF_ROWS in attention.cu
	prefillKC   = 32 // PF_KC
)

// prefillShared matches the padded layout of attn_prefill.
func prefillShared(dim int) int {
	return (2*prefillRows*(dim+4)+prefillRows*(prefillKC+1))*4 + 2*prefillKC*(dim+2)*2
}

func (d *Device) attnPrefill(out, qkv, kc, vc device.Tensor, meta device.AttnMeta, scale float32, hq, hk, dim int) {
	g := hq / hk
	if g > prefillRows {
		d.fail(fmt.Errorf("attention: %d query heads per kv head (limit %d)", g, prefillRows))
		return
	}
	qt := prefillRows / g
	shared := prefillShared(dim)
	if shared > 48<<10 && shared > d.prefillShared {
		if err := d.k["attn_prefill"].SetMaxDynamicShared(shared); err != nil {
			d.fail(err)
			return
		}
		d.prefillShared = shared
	}
	tiles := (meta.MaxQLen + qt - 1) / qt
	d.launch("attn_prefill", Dim3{uint32(meta.NumSeqs), uint32(tiles), uint32(hk)}, D1(128), shared,
		P(out.Ptr), P(qkv.Ptr), P(kc.Ptr), P(vc.Ptr), P(meta.QIndptr.Ptr), P(meta.KVIndptr.Ptr),
		P(meta.KVIndices.Ptr), I(hq), I(hk), I(dim), I(qt), F(scale))
}
