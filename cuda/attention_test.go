package cuda

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"ebb/device"
	"ebb/model"
)

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
			p.checkPrepareAttention(tc.hq, tc.hk, tc.d, tc.norm, tc.qlens, tc.kvlens, out, qkv, kc, vc, meta)
			// A step of a few hundred tokens keeps prepare_qkv.
			sout, sqkv, skc, svc, smeta := attnCase(p, tc.hq, tc.hk, tc.d, []int{100}, []int{100})
			spos := p.ints(make([]int32, 100))
			cos, sin := ropeTables(p, 100, tc.d/2)
			if p.gpu.PrepareAttention(sout.g, sqkv.g, device.Tensor{}, device.Tensor{}, spos.g, cos.g, sin.g, skc.g, svc.g, spos.g, smeta[0], 1, 1e-6) {
				t.Fatal("PrepareAttention applied to a 100-token step")
			}
		})
	}
}

// TestPrepareDecode: a decode step's kernel preparing its own queries and
// newest K and V (attn_decode_vec_raw) gives the bits of PrepareQKV then
// Attention on the GPU, and the CPU reference within bf16 rounding. The
// projections are multiples of 1/8, whose sums of squares are exact in
// fp32: the two paths add them in different orders.
func TestPrepareDecode(t *testing.T) {
	cases := []struct {
		name      string
		hq, hk, d int
		norm      bool
		kvlens    []int
	}{
		{"qwen3", 16, 8, 128, true, []int{700, 1, 65, 130, 2000, 64}},
		{"qwen3-one-long", 16, 8, 128, true, []int{3000}},
		{"qwen3-one-very-long", 16, 8, 128, true, []int{24000}},
		{"qwen3-ragged-full-gpu", 16, 8, 128, true, raggedContexts(80)},
		{"d64-g3-no-norm", 6, 2, 64, false, []int{90, 400, 7}},
		{"d256-g1", 4, 4, 256, true, []int{300, 33}},
		{"d32-g8", 16, 2, 32, true, []int{129, 5, 1000}},
		{"qwen3-30b-a3b-g8", 32, 4, 128, true, []int{700, 1, 65, 16, 17, 3000}},
		{"qwen3-8b-g4-ragged", 32, 8, 128, true, raggedContexts(80)},
		{"g3-no-norm", 12, 4, 128, false, []int{90, 400, 7}},
		// EBB_DECODE_GQA=0: small batches of one and two heads a kv head
		// on the vector kernel, which takes them beyond 4.5 waves' pairs.
		{"vector-qwen3", 16, 8, 128, true, []int{700, 1, 65, 130, 2000, 64}},
		{"vector-g1-no-norm", 8, 8, 128, false, []int{90, 400, 7}},
		{"gqa-all-qwen3-ragged-full-gpu", 16, 8, 128, true, raggedContexts(80)},
		// EBB_GQA_LEAN=1: the tensor-core kernel with one chunk in flight a warp.
		{"lean-qwen3-30b-a3b-g8", 32, 4, 128, true, []int{700, 1, 65, 16, 17, 3000}},
		{"lean-qwen3-8b-g4-ragged", 32, 8, 128, true, raggedContexts(80)},
		{"lean-qwen3", 16, 8, 128, true, []int{700, 1, 65, 130, 2000, 64}},
		// EBB_GQA_HEADS_A_BLOCK: two or four kv heads a lean block.
		{"lean2-qwen3-30b-a3b-g8", 32, 4, 128, true, []int{700, 1, 65, 16, 17, 3000}},
		{"lean4-qwen3-8b-g4-ragged", 32, 8, 128, true, raggedContexts(80)},
		{"lean2-qwen3", 16, 8, 128, true, []int{700, 1, 65, 130, 2000, 64}},
		{"lean4-g3-no-norm", 12, 4, 128, false, []int{90, 400, 7}},
		// EBB_DECODE_WHOLE=512: contexts up to 512 positions in one split.
		{"qwen3-30b-a3b-g8-whole", 32, 4, 128, true, []int{700, 1, 65, 512, 513, 3000}},
		{"qwen3-30b-a3b-g8-b1-whole", 32, 4, 128, true, []int{400}},
		{"lean-qwen3-30b-a3b-g8-whole", 32, 4, 128, true, []int{700, 1, 65, 512, 513, 3000}},
		{"vector-qwen3-whole", 16, 8, 128, true, []int{700, 1, 65, 512, 513, 3000}},
		// EBB_DECODE_ONE=1: attn_decode_gqa_one_raw.
		{"one-qwen3-30b-a3b-g8", 32, 4, 128, true, []int{1, 65, 16, 17, 384}},
		{"one-qwen3-8b-g4", 32, 8, 128, true, []int{130, 256}},
		{"one-qwen3", 16, 8, 128, true, []int{1, 64, 65, 200}},
		// EBB_DECODE_WHOLE=0: short contexts in more than one split.
		{"qwen3-30b-a3b-g8-b1-split", 32, 4, 128, true, []int{250}},
		{"vector-qwen3-split", 16, 8, 128, true, []int{200, 1, 65, 130, 256, 64}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t)
			p.gpu.rawDecode = true
			p.gpu.gqaFrom = decodeKernelMode(tc.name)
			p.gpu.gqaLean, p.gpu.gqaHeads = leanMode(tc.name), leanHeads(tc.name)
			p.gpu.whole, p.gpu.wholeSet = wholeMode(tc.name)
			p.gpu.decodeOne = oneMode(tc.name)
			qlens := repeat(1, len(tc.kvlens))
			out, _, kc, vc, meta := attnCase(p, tc.hq, tc.hk, tc.d, qlens, tc.kvlens)
			vals := make([]float32, len(qlens)*(tc.hq+2*tc.hk)*tc.d)
			for i := range vals {
				vals[i] = float32(p.rng.IntN(33)-16) / 8
			}
			qkv := p.floats(device.BF16, vals, len(qlens), tc.hq+2*tc.hk, tc.d)
			p.checkPrepareAttention(tc.hq, tc.hk, tc.d, tc.norm, qlens, tc.kvlens, out, qkv, kc, vc, meta)
			// Without the kernel's own preparation the step is left to
			// PrepareQKV and Attention.
			p.gpu.rawDecode = false
			cos, sin := ropeTables(p, 10, tc.d/2)
			zeros := p.ints(make([]int32, len(qlens)))
			if p.gpu.PrepareAttention(out.g, qkv.g, device.Tensor{}, device.Tensor{}, zeros.g, cos.g, sin.g, kc.g, vc.g, zeros.g, meta[0], 1, 1e-6) {
				t.Fatal("PrepareAttention applied with EBB_DECODE_PREPARE=separate")
			}
		})
	}
}

// checkPrepareAttention runs PrepareAttention on a step of sequences whose
// last qlens[i] of kvlens[i] positions are queries, and compares it with
// PrepareQKV then Attention: the same bits on the GPU, close to the CPU.
func (p *pair) checkPrepareAttention(hq, hk, d int, norm bool, qlens, kvlens []int, out, qkv, kc, vc both, meta [2]device.AttnMeta) {
	p.t.Helper()
	idx := make([]int32, meta[1].KVIndices.Numel())
	if err := p.cpu.DownloadI32(meta[1].KVIndices, idx); err != nil {
		p.t.Fatal(err)
	}
	var positions, slots []int32
	kv0 := 0
	for i, q := range qlens {
		for j := kvlens[i] - q; j < kvlens[i]; j++ {
			positions = append(positions, int32(j))
			slots = append(slots, idx[kv0+j])
		}
		kv0 += kvlens[i]
	}
	pos, sl := p.ints(positions), p.ints(slots)
	cos, sin := ropeTables(p, slices.Max(kvlens), d/2)
	var qn, kn both
	if norm {
		qn, kn = p.floats(device.BF16, onesPlus(p, d), d), p.floats(device.BF16, onesPlus(p, d), d)
	}
	qkv2, kc2, vc2, out2 := p.clone(device.BF16, qkv), p.clone(device.BF16, kc), p.clone(device.BF16, vc), p.clone(device.BF16, out)
	scale, eps := float32(1/math.Sqrt(float64(d))), float32(1e-6)
	if !p.gpu.PrepareAttention(out.g, qkv.g, qn.g, kn.g, pos.g, cos.g, sin.g, kc.g, vc.g, sl.g, meta[0], scale, eps) {
		p.t.Fatal("PrepareAttention did not apply")
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
		// attention_fast.cu and attention_flash.cu: vectorised decode and tensor-core prefill.
		{"decode-default-model-g3-d64", 6, 2, 64, []int{1, 1, 1}, []int{1, 200, 4000}},
		{"decode-tiny-d32", 4, 2, 32, []int{1, 1}, []int{3, 129}},
		{"decode-g4-d128-long", 32, 8, 128, []int{1, 1}, []int{4096, 777}},
		// attention_gqa.cu: 3 to 8 query heads a kv head at 128 dims.
		{"decode-gqa-g8", 32, 4, 128, []int{1, 1, 1, 1, 1}, []int{1, 15, 16, 17, 300}},
		{"decode-gqa-g8-long", 32, 4, 128, []int{1}, []int{32000}},
		{"decode-gqa-g3-ragged", 12, 4, 128, repeat(1, 80), raggedContexts(80)},
		{"decode-gqa-g5-many", 40, 8, 128, repeat(1, 200), repeat(130, 200)},
		{"mixed-gqa-g8", 32, 4, 128, []int{1, 1, 70, 1}, []int{2000, 3, 70, 64}},
		// One and two heads a kv head on it where the pairs are few, and
		// with EBB_DECODE_GQA=all at any batch.
		{"decode-gqa-g2", 16, 8, 128, []int{1, 1, 1, 1, 1}, []int{1, 15, 16, 17, 300}},
		{"decode-gqa-g2-long", 16, 8, 128, []int{1}, []int{32000}},
		{"gqa-all-g1-ragged", 8, 8, 128, repeat(1, 80), raggedContexts(80)},
		// EBB_GQA_LEAN=1: its lean kernels.
		{"lean-decode-gqa-g8", 32, 4, 128, []int{1, 1, 1, 1, 1}, []int{1, 15, 16, 17, 300}},
		{"lean-decode-gqa-g8-long", 32, 4, 128, []int{1}, []int{32000}},
		{"lean-decode-gqa-g5-many", 40, 8, 128, repeat(1, 200), repeat(130, 200)},
		{"lean-mixed-gqa-g8", 32, 4, 128, []int{1, 1, 70, 1}, []int{2000, 3, 70, 64}},
		{"lean-decode-gqa-g2-long", 16, 8, 128, []int{1}, []int{32000}},
		{"bycontext-decode-gqa-g8-short", 32, 4, 128, repeat(1, 40), repeat(700, 40)},
		// EBB_GQA_HEADS_A_BLOCK: two or four kv heads a lean block (four
		// with 8 heads a kv head is more than its query preparation holds,
		// so it keeps one).
		{"lean2-decode-gqa-g8", 32, 4, 128, []int{1, 1, 1, 1, 1}, []int{1, 15, 16, 17, 300}},
		{"lean2-decode-gqa-g8-long", 32, 4, 128, []int{1}, []int{32000}},
		{"lean2-decode-gqa-g5-many", 40, 8, 128, repeat(1, 200), repeat(130, 200)},
		{"lean2-mixed-gqa-g8", 32, 4, 128, []int{1, 1, 70, 1}, []int{2000, 3, 70, 64}},
		{"lean4-decode-gqa-g4-ragged", 32, 8, 128, repeat(1, 80), raggedContexts(80)},
		{"lean4-decode-gqa-g8", 32, 4, 128, []int{1, 1, 1, 1, 1}, []int{1, 15, 16, 17, 300}},
		{"bycontext-decode-gqa-g8-two-heads-a-block", 32, 4, 128, repeat(1, 300), repeat(190, 300)},
		// EBB_DECODE_GQA=0: the vector kernel's small batches.
		{"vector-g2", 16, 8, 128, []int{1, 1, 1, 1, 1}, []int{1, 15, 16, 17, 300}},
		{"vector-b1-64-splits", 16, 8, 128, []int{1}, []int{4000}},
		{"vector-b1-long", 16, 8, 128, []int{1}, []int{24000}},
		{"vector-ragged-small-batch", 16, 8, 128, []int{1, 1, 1, 1}, []int{4000, 100, 65, 1}},
		{"vector-ragged-one-wave", 16, 8, 128, repeat(1, 48), raggedContexts(48)},
		{"decode-b1-64-splits", 16, 8, 128, []int{1}, []int{4000}},
		{"decode-b1-long", 16, 8, 128, []int{1}, []int{24000}}, // up to 128 splits (EBB_DECODE_SPLITS)
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
		// EBB_DECODE_WHOLE=512: contexts up to 512 positions in one split,
		// longer ones cut as before.
		{"decode-gqa-g8-whole", 32, 4, 128, repeat(1, 5), []int{1, 300, 512, 513, 3000}},
		{"decode-gqa-g8-b1-whole", 32, 4, 128, []int{1}, []int{400}},
		{"lean-decode-gqa-g8-whole", 32, 4, 128, repeat(1, 5), []int{1, 300, 512, 513, 3000}},
		{"vector-g2-whole", 16, 8, 128, repeat(1, 5), []int{1, 300, 512, 513, 3000}},
		// EBB_DECODE_ONE=1: a few sequences of one-split contexts on
		// attn_decode_gqa_one (eight warps, no merge).
		{"one-decode-gqa-g8", 32, 4, 128, repeat(1, 5), []int{1, 15, 16, 300, 384}},
		{"one-decode-gqa-g8-b1", 32, 4, 128, []int{1}, []int{200}},
		{"one-decode-gqa-g4", 32, 8, 128, repeat(1, 3), []int{129, 256, 2}},
		{"one-decode-gqa-g2", 16, 8, 128, repeat(1, 4), []int{1, 65, 255, 256}},
		// EBB_DECODE_WHOLE=0: short contexts in more than one split.
		{"decode-gqa-g8-split", 32, 4, 128, repeat(1, 5), []int{1, 15, 130, 200, 256}},
		{"decode-gqa-g8-b1-split", 32, 4, 128, []int{1}, []int{250}},
		{"lean-decode-gqa-g8-split", 32, 4, 128, repeat(1, 5), []int{1, 15, 130, 200, 256}},
		{"vector-g2-split", 16, 8, 128, repeat(1, 5), []int{1, 15, 130, 200, 256}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t)
			p.gpu.gqaFrom = decodeKernelMode(tc.name)
			p.gpu.gqaLean, p.gpu.gqaHeads = leanMode(tc.name), leanHeads(tc.name)
			p.gpu.whole, p.gpu.wholeSet = wholeMode(tc.name)
			p.gpu.decodeOne = oneMode(tc.name)
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

// TestDecodeWhole (no GPU): contexts of up to 256 positions take one
// split, 384 from eight query heads a kv head, unless EBB_DECODE_WHOLE sets
// another bound (0: none).
func TestDecodeWhole(t *testing.T) {
	for _, c := range []struct {
		g, env, want int
		set          bool
	}{
		{2, 0, decodeWholeContext, false},
		{4, 0, decodeWholeContext, false},
		{8, 0, decodeWholeContextG8, false},
		{16, 0, decodeWholeContextG8, false},
		{8, 0, 0, true},
		{2, 512, 512, true},
	} {
		d := &Device{whole: c.env, wholeSet: c.set}
		if got := d.decodeWhole(c.g); got != c.want {
			t.Errorf("%d heads a kv head, EBB_DECODE_WHOLE %d (set %v): %d, want %d", c.g, c.env, c.set, got, c.want)
		}
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

// TestDecodeGrid (no GPU): attn_decode_gqa keeps four waves where the
// vector kernel takes eight (pairs filling half to all of one wave), and
// two where it takes one or two heads a kv head; EBB_GQA_WAVES sets its
// waves alone, and EBB_DECODE_SPLITS adds the waves its splits need to
// both.
func TestDecodeGrid(t *testing.T) {
	for _, c := range []struct {
		name                     string
		pairs, heads             int
		gqa                      bool
		gqaWaves, decodeSplits   int
		wantWaves, wantMaxSplits int
	}{
		{"vector, short batch", 64, 2, false, 0, 0, 4, 64},
		{"vector, half to one wave", 512, 2, false, 0, 0, 8, 64},
		{"gqa, half to one wave", 512, 4, true, 0, 0, 4, 64},
		{"gqa, large batch", 2048, 8, true, 0, 0, 4, 64},
		{"gqa, two heads", 8, 2, true, 0, 0, 2, 64},
		{"gqa, one head", 512, 1, true, 0, 0, 2, 64},
		{"gqa, EBB_GQA_WAVES", 512, 4, true, 8, 0, 8, 64},
		{"gqa, two heads, EBB_GQA_WAVES", 8, 2, true, 4, 0, 4, 64},
		{"vector ignores EBB_GQA_WAVES", 64, 2, false, 2, 0, 4, 64},
		{"gqa, EBB_DECODE_SPLITS", 512, 4, true, 0, 4, 16, 4},
	} {
		d := &Device{ctx: &Context{SMs: 132}, gqaWaves: c.gqaWaves, decodeSplits: c.decodeSplits}
		waves, splits := d.decodeVecGrid(c.pairs, c.heads, c.gqa)
		if waves != c.wantWaves || splits != c.wantMaxSplits {
			t.Errorf("%s: %d waves, %d splits; want %d, %d", c.name, waves, splits, c.wantWaves, c.wantMaxSplits)
		}
	}
}

// TestDecodeKernelChoice (no GPU): 3 to 8 query heads a kv head at 128
// dims take the tensor-core kernel (a loaded kernel), and 1 or 2 where the
// step's pairs are at most 4.5 waves of SMs; 1 to 8 at any batch with
// EBB_DECODE_GQA=all and none with 0; every other head count up to 8 takes
// the vector kernel whose register tiles hold it (the power of two above),
// plain and raw alike; more than 8 take none.
func TestDecodeKernelChoice(t *testing.T) {
	loaded := map[string]bool{}
	for _, n := range kernelNames {
		loaded[n] = true
	}
	for _, mode := range []struct {
		env   string
		pairs int
		from  int // fewest heads on the tensor-core kernel at 128 dims
	}{{"", 8, 1}, {"", 594, 1}, {"", 595, 3}, {"", 2048, 3}, {"0", 8, 9}, {"all", 2048, 1}} {
		d := &Device{ctx: &Context{SMs: 132}, gqaFrom: gqaFromEnv(mode.env)}
		for _, dim := range []int{32, 64, 128, 256} {
			for g := 1; g <= 16; g++ {
				name, raw, ok := d.splitDecodeKernel(g, dim, mode.pairs, 0)
				if g > 8 {
					if ok {
						t.Errorf("%d heads a kv head, %d dims: %q, want none", g, dim, name)
					}
					continue
				}
				if dim == 128 && g >= mode.from {
					if name != "attn_decode_gqa_d128" || raw != "attn_decode_gqa_raw_d128" || !loaded[name] || !loaded[raw] {
						t.Errorf("%d heads, %d dims, %d pairs, EBB_DECODE_GQA=%q: %q / %q, want the loaded tensor-core kernels", g, dim, mode.pairs, mode.env, name, raw)
					}
					continue
				}
				mg := 1
				for mg < g {
					mg *= 2
				}
				want := fmt.Sprintf("attn_decode_vec_d%d_g%d", dim, mg)
				if !ok || name != want || raw != strings.Replace(want, "vec_", "vec_raw_", 1) {
					t.Errorf("%d heads, %d dims, %d pairs, EBB_DECODE_GQA=%q: %q / %q, want %q", g, dim, mode.pairs, mode.env, name, raw, want)
				}
			}
		}
	}
	// The lean kernels: by the step's longest context, from 3 heads a kv
	// head, unless EBB_GQA_LEAN says always or never.
	for _, c := range []struct {
		mode, g, pairs, maxKV int
		want                  string
	}{
		{leanByContext, 8, 1024, 192, "attn_decode_gqa_lean_d128"},
		{leanByContext, 4, gqaLeanMinPairs, gqaLeanMaxKV, "attn_decode_gqa_lean_d128"},
		{leanByContext, 8, gqaLeanMinPairs - 1, 192, "attn_decode_gqa_d128"},
		{leanByContext, 8, 1024, gqaLeanMaxKV + 1, "attn_decode_gqa_d128"},
		{leanByContext, 8, 1024, 0, "attn_decode_gqa_d128"},
		{leanByContext, 2, 8, 192, "attn_decode_gqa_d128"},
		{leanAlways, 8, 1024, 40000, "attn_decode_gqa_lean_d128"},
		{leanAlways, 2, 2048, 192, "attn_decode_vec_d128_g2"},
		{leanNever, 8, 1024, 192, "attn_decode_gqa_d128"},
	} {
		d := &Device{ctx: &Context{SMs: 132}, gqaLean: c.mode}
		name, raw, _ := d.splitDecodeKernel(c.g, 128, c.pairs, c.maxKV)
		gqa := strings.HasPrefix(name, "attn_decode_gqa")
		if name != c.want || raw == name || (gqa && (!loaded[name] || !loaded[raw])) {
			t.Errorf("lean mode %d, %d heads, %d pairs, longest context %d: %q / %q, want %q and its raw form, loaded",
				c.mode, c.g, c.pairs, c.maxKV, name, raw, c.want)
		}
	}
	// A lean block's kv heads: two where they cost no more waves x heads
	// than one (waves of four blocks an SM), unless EBB_GQA_HEADS_A_BLOCK
	// sets them (where the heads divide hk and their query preparation
	// fits).
	for _, c := range []struct {
		env, b, hq, hk, want int
		lean                 bool
	}{
		{0, 256, 32, 4, 2, true},
		{0, 132, 32, 4, 1, true},
		{0, 133, 32, 4, 2, true},
		{0, 160, 32, 4, 2, true},
		{0, 256, 32, 8, 2, true},
		{0, 160, 32, 8, 1, true},
		{0, 128, 32, 8, 2, true},
		{0, 64, 32, 8, 1, true},
		{0, 512, 32, 8, 2, true},
		{0, 256, 32, 4, 1, false},
		{0, 256, 12, 3, 1, true},
		{4, 256, 32, 8, 4, true},
		{4, 1, 32, 8, 4, true},
		{4, 256, 32, 4, 1, true},
		{2, 1, 32, 4, 2, true},
		{3, 256, 36, 12, 1, true},
	} {
		d := &Device{ctx: &Context{SMs: 132}, gqaHeads: c.env}
		if got := d.gqaHeadsABlock(c.lean, c.b, c.hq, c.hk, 4); got != c.want {
			t.Errorf("EBB_GQA_HEADS_A_BLOCK=%d, lean %v, batch %d, %d/%d heads: %d kv heads a block, want %d", c.env, c.lean, c.b, c.hq, c.hk, got, c.want)
		}
	}
	for _, c := range []struct {
		mode, hq, hk, dim, batch, want int
		one                            int // EBB_DECODE_ONE's pairs
	}{
		{leanByContext, 32, 4, 128, 256, gqaLeanMaxKV, 0},
		{leanByContext, 32, 4, 128, gqaLeanMinPairs / 4, gqaLeanMaxKV, 0},
		{leanByContext, 32, 4, 128, gqaLeanMinPairs/4 - 1, 0, 0},
		{leanByContext, 16, 8, 128, 256, 0, 0},
		{leanByContext, 32, 8, 64, 256, 0, 0},
		{leanAlways, 32, 4, 128, 256, 0, 0},
		{leanNever, 32, 4, 128, 256, 0, 0},
		// The one-split kernels below the lean kernels' pairs.
		{leanByContext, 32, 4, 128, 1, decodeWholeContextG8, gqaLeanMinPairs - 1},
		{leanByContext, 32, 4, 128, gqaLeanMinPairs/4 - 1, decodeWholeContextG8, gqaLeanMinPairs - 1},
		{leanByContext, 32, 4, 128, gqaLeanMinPairs / 4, gqaLeanMaxKV, gqaLeanMinPairs - 1},
		{leanByContext, 16, 8, 128, 1, decodeWholeContext, gqaLeanMinPairs - 1},
		{leanByContext, 32, 8, 128, 1, decodeWholeContext, gqaLeanMinPairs - 1},
		{leanByContext, 16, 8, 128, 256, 0, gqaLeanMinPairs - 1},
		{leanByContext, 32, 8, 64, 1, 0, gqaLeanMinPairs - 1},
		// The default: a step of one sequence.
		{leanByContext, 32, 4, 128, 1, decodeWholeContextG8, decodeOneSeqPairs},
		{leanByContext, 32, 4, 128, 2, decodeWholeContextG8, decodeOneSeqPairs},
		{leanByContext, 32, 4, 128, 3, 0, decodeOneSeqPairs},
		{leanByContext, 32, 8, 128, 1, decodeWholeContext, decodeOneSeqPairs},
		{leanByContext, 32, 8, 128, 2, 0, decodeOneSeqPairs},
	} {
		d := &Device{ctx: &Context{SMs: 132}, gqaLean: c.mode, decodeOne: c.one}
		if got := d.ShortDecodeContext(c.hq, c.hk, c.dim, c.batch); got != c.want {
			t.Errorf("lean mode %d, one %d, %d/%d heads of %d, batch %d: ShortDecodeContext %d, want %d", c.mode, c.one, c.hq, c.hk, c.dim, c.batch, got, c.want)
		}
	}
}

// TestDecodeOneKernel (no GPU): with EBB_DECODE_ONE=1, steps of fewer pairs
// than the lean kernels take and every context within decodeWhole's one
// split take attn_decode_gqa_one, at any heads a kv head the tensor-core
// kernel takes; longer contexts, more pairs and other head sizes keep
// theirs.
func TestDecodeOneKernel(t *testing.T) {
	loaded := map[string]bool{}
	for _, n := range kernelNames {
		loaded[n] = true
	}
	for _, c := range []struct {
		g, dim, pairs, maxKV int
		want                 string
	}{
		{8, 128, 4, 1, "attn_decode_gqa_one_d128"},
		{8, 128, 4, decodeWholeContextG8, "attn_decode_gqa_one_d128"},
		{8, 128, 4, decodeWholeContextG8 + 1, "attn_decode_gqa_d128"},
		{8, 128, gqaLeanMinPairs - 1, 200, "attn_decode_gqa_one_d128"},
		{8, 128, gqaLeanMinPairs, 200, "attn_decode_gqa_lean_d128"},
		{4, 128, 8, decodeWholeContext, "attn_decode_gqa_one_d128"},
		{4, 128, 8, decodeWholeContext + 1, "attn_decode_gqa_d128"},
		{2, 128, 8, 200, "attn_decode_gqa_one_d128"},
		{8, 128, 4, 0, "attn_decode_gqa_d128"},
		{2, 64, 8, 200, "attn_decode_vec_d64_g2"},
	} {
		d := &Device{ctx: &Context{SMs: 132}, decodeOne: decodeOneFromEnv("1")}
		name, raw, _ := d.splitDecodeKernel(c.g, c.dim, c.pairs, c.maxKV)
		if name != c.want || raw == name || (strings.HasPrefix(name, "attn_decode_gqa") && (!loaded[name] || !loaded[raw])) {
			t.Errorf("%d heads a kv head, %d dims, %d pairs, contexts to %d: %q / %q, want %q", c.g, c.dim, c.pairs, c.maxKV, name, raw, c.want)
		}
		d.decodeOne = decodeOneFromEnv("0")
		if name, _, _ := d.splitDecodeKernel(c.g, c.dim, c.pairs, c.maxKV); strings.Contains(name, "_one") {
			t.Errorf("%d heads, %d pairs, contexts to %d, EBB_DECODE_ONE=0: %q", c.g, c.pairs, c.maxKV, name)
		}
		d.decodeOne = decodeOneFromEnv("")
		one := strings.Contains(name, "gqa_") && c.pairs <= decodeOneSeqPairs && c.maxKV > 0 && c.maxKV <= d.decodeWhole(c.g)
		if got, _, _ := d.splitDecodeKernel(c.g, c.dim, c.pairs, c.maxKV); strings.Contains(got, "_one") != one {
			t.Errorf("%d heads, %d pairs, contexts to %d, EBB_DECODE_ONE unset: %q", c.g, c.pairs, c.maxKV, got)
		}
	}
}

// oneMode is the EBB_DECODE_ONE setting a case's name asks for: "one-"
// every step below the lean kernels' pairs, otherwise none (the
// two-chunk kernels, which the default keeps for steps of several
// sequences).
func oneMode(name string) int {
	if strings.HasPrefix(name, "one-") {
		return decodeOneFromEnv("1")
	}
	return decodeOneFromEnv("0")
}

// leanMode is the EBB_GQA_LEAN setting a case's name asks for: "lean-"
// always, "bycontext-" by the longest context, otherwise never (the
// two-chunk kernels at every context).
func leanMode(name string) int {
	switch {
	case strings.HasPrefix(name, "lean-"), leanHeads(name) > 0:
		return leanAlways
	case strings.HasPrefix(name, "bycontext-"):
		return leanByContext
	}
	return leanNever
}

// leanHeads is the EBB_GQA_HEADS_A_BLOCK setting a case's name asks for
// (with the lean kernels always): "lean2-" two, "lean4-" four, otherwise
// unset.
func leanHeads(name string) int {
	switch {
	case strings.HasPrefix(name, "lean2-"):
		return 2
	case strings.HasPrefix(name, "lean4-"):
		return 4
	}
	return 0
}

// wholeMode is the EBB_DECODE_WHOLE setting a case's name asks for:
// "-whole" 512 positions, "-split" 0 (short contexts cut as long ones),
// otherwise unset.
func wholeMode(name string) (int, bool) {
	switch {
	case strings.HasSuffix(name, "-whole"):
		return 512, true
	case strings.HasSuffix(name, "-split"):
		return 0, true
	}
	return 0, false
}

// decodeKernelMode is the EBB_DECODE_GQA setting a case's name asks for:
// "gqa-all-" all, "vector-" none (the vector kernel), otherwise the
// default.
func decodeKernelMode(name string) int {
	switch {
	case strings.HasPrefix(name, "gqa-all-"):
		return gqaFromEnv("all")
	case strings.HasPrefix(name, "vector-"):
		return gqaFromEnv("0")
	}
	return 0
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
