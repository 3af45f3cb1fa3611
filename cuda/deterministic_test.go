package cuda

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"ebb/device"
)

// detQwen3 is the Qwen3-0.6B shape, which deterministic inference takes.
var detQwen3 = device.ModelShape{Hidden: 1024, Intermediate: 3072, Heads: 16, KVHeads: 8, HeadDim: 128, Vocab: 151936}

// detPair is a pair whose GPU runs deterministic inference's kernels.
func detPair(t *testing.T) *pair {
	p := newPair(t)
	if err := p.gpu.EnableDeterministic(detQwen3); err != nil {
		t.Skip(err)
	}
	return p
}

// TestDetShapeError: the models deterministic inference takes, and the
// reason it gives for those it does not (no GPU needed).
func TestDetShapeError(t *testing.T) {
	with := func(f func(*device.ModelShape)) device.ModelShape { m := detQwen3; f(&m); return m }
	for _, c := range []struct {
		name  string
		shape device.ModelShape
		want  string // empty: accepted
	}{
		{"qwen3-0.6b", detQwen3, ""},
		{"qwen3-8b", device.ModelShape{Hidden: 4096, Intermediate: 12288, Heads: 32, KVHeads: 8, HeadDim: 128, Vocab: 151936}, ""},
		{"qwen3-30b-a3b", device.ModelShape{Hidden: 2048, Intermediate: 6144, Heads: 32, KVHeads: 4, HeadDim: 128, Vocab: 151936, Experts: 128}, ""},
		{"llama-3.2-1b", device.ModelShape{Hidden: 2048, Intermediate: 8192, Heads: 32, KVHeads: 8, HeadDim: 64, Vocab: 128256}, ""},
		{"head_dim 80", with(func(m *device.ModelShape) { m.HeadDim = 80 }), "head_dim 80"},
		{"32 heads a kv head", with(func(m *device.ModelShape) { m.Heads, m.KVHeads = 32, 1 }), "32 query heads over 1 kv heads"},
		{"uneven heads", with(func(m *device.ModelShape) { m.Heads, m.KVHeads = 12, 8 }), "12 query heads over 8"},
		{"no kv heads", with(func(m *device.ModelShape) { m.KVHeads = 0 }), "over 0 kv heads"},
		{"odd vocabulary", with(func(m *device.ModelShape) { m.Vocab = 32001 }), "lm_head is 32001 x 1024"},
		{"hidden off 64", with(func(m *device.ModelShape) { m.Hidden = 1000 }), "is 4096 x 1000"},
		{"intermediate off 64", with(func(m *device.ModelShape) { m.Intermediate = 3000 }), "down_proj is 1024 x 3000"},
		{"router of 60 experts", with(func(m *device.ModelShape) { m.Experts = 60 }), "the router is 60 x 1024"},
		{"qwen2-moe's shared expert", with(func(m *device.ModelShape) { m.Experts, m.SharedIntermediate = 64, 2048 }),
			"the shared expert's gate is 1 x 1024"},
	} {
		err := detShapeError(c.shape)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: %v, want accepted", c.name, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: %v, want an error naming %q", c.name, err, c.want)
		}
	}
}

// TestDeterministicProductsAreRowInvariant: a row's product has the same
// bits whichever rows share the launch (1 to 300 of them: every batch tile
// and past one; and a prefill large enough for matmul_wg_part, which runs
// the splits in one block), on matmul_wg for every count, and matches the
// CPU reference within bf16 rounding.
func TestDeterministicProductsAreRowInvariant(t *testing.T) {
	const rows = 300
	for _, tc := range []struct {
		n, k  int
		glu   bool
		f32   bool
		scale float32
	}{{1024, 2048, false, false, 0.03}, {4096, 1024, false, false, 0.03}, {6144, 1024, true, false, 0.03},
		{151936, 1024, false, true, 0.03}, {4096, 12288, false, false, 0.01}} { // the last: Qwen3-8B's down_proj
		t.Run(fmt.Sprintf("n%d-k%d-glu%v", tc.n, tc.k, tc.glu), func(t *testing.T) {
			p := detPair(t) // the context is this goroutine's
			x := p.random(device.BF16, 1, rows, tc.k)
			w := p.random(device.BF16, tc.scale, tc.n, tc.k)
			cols, dt := tc.n, device.BF16
			if tc.glu {
				cols = tc.n / 2
			}
			if tc.f32 {
				dt = device.F32
			}
			product := func(out, x device.Tensor) {
				if tc.glu {
					if !p.gpu.MatMulSiLU(out, x, w.g) {
						t.Fatal("MatMulSiLU declined")
					}
					return
				}
				p.gpu.MatMul(out, x, w.g, device.Tensor{})
			}
			full := p.random(dt, 0, rows, cols)
			product(full.g, x.g)
			if tc.glu {
				gu := p.random(device.F32, 0, rows, tc.n)
				p.cpu.MatMul(gu.c, x.c, w.c, device.Tensor{})
				p.cpu.SiLUMul(full.c, gu.c)
			} else {
				p.cpu.MatMul(full.c, x.c, w.c, device.Tensor{})
			}
			p.close("product", full, 2e-2, 2e-2)
			want, _ := p.download(full)
			for _, m := range []int{1, 2, 4, 8, 9, 13, 16, 17, 25, 33, 48, 64, 100, 128, 129, 192, 193, 256} {
				// The last m rows: each lands at another place in its tile.
				// Up to 16 rows run on matmul_wg_few.
				part := p.random(dt, 0, m, cols)
				product(part.g, x.g.Rows(rows-m, rows))
				sameRows(t, p, part, want[(rows-m)*cols:], cols, fmt.Sprintf("%d rows among %d", m, rows))
			}
			// The fewest rows that take matmul_wg_part, whose last rows (in
			// the middle of its last tile) and first rows must have the
			// bits they have alone.
			big := 0
			for m := rows; m <= 4096 && big == 0; m++ {
				if name, _, _, _, _ := p.gpu.matMulWGShape(m, tc.n, tc.k); strings.HasPrefix(name, "matmul_wg_part_") {
					big = m
				}
			}
			if big == 0 {
				return // one split a tile (lm_head): nothing to run in parts
			}
			xb := p.random(device.BF16, 1, big, tc.k)
			prefill := p.random(dt, 0, big, cols)
			product(prefill.g, xb.g)
			all, _ := p.download(prefill)
			for _, r := range [][2]int{{big - 40, big}, {0, 33}} {
				part := p.random(dt, 0, r[1]-r[0], cols)
				product(part.g, xb.g.Rows(r[0], r[1]))
				sameRows(t, p, part, all[r[0]*cols:], cols, fmt.Sprintf("rows %d-%d among %d (matmul_wg_part)", r[0], r[1], big))
			}
		})
	}
}

// sameRows fails unless the GPU rows of part have exactly the bits of want
// (rows of cols values each).
func sameRows(t *testing.T, p *pair, part both, want []float32, cols int, what string) {
	t.Helper()
	got, _ := p.download(part)
	for i := range got {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Errorf("%s: row %d col %d: %v, want %v", what, i/cols, i%cols, got[i], want[i])
			return
		}
	}
}

// detSeq is a sequence's slots in position order.
type detSeq []int32

// detMeta builds a step over prefix sequences: sequence i has queries
// for its last qlens[i] positions and attends to kv[i].
func detMeta(p *pair, qlens []int, kv []detSeq) device.AttnMeta {
	qptr, kvptr, idx := []int32{0}, []int32{0}, []int32{}
	maxQ, maxKV, decodes := 0, 0, 0
	for i, s := range kv {
		if decodes == i && qlens[i] == 1 {
			decodes++
		}
		idx = append(idx, s...)
		qptr = append(qptr, qptr[i]+int32(qlens[i]))
		kvptr = append(kvptr, kvptr[i]+int32(len(s)))
		maxQ, maxKV = max(maxQ, qlens[i]), max(maxKV, len(s))
	}
	return device.AttnMeta{NumSeqs: len(kv), MaxQLen: maxQ, MaxKVLen: maxKV, Decodes: decodes,
		QIndptr: p.ints(qptr).g, KVIndptr: p.ints(kvptr).g, KVIndices: p.ints(idx).g}
}

// TestDeterministicAttention: attn_det gives a query the same bits as a
// prompt's row in one prefill, in a chunk of it, and as a decode among
// others of any length (its splits spread over blocks), and the prefill
// matches the CPU reference within bf16 rounding.
func TestDeterministicAttention(t *testing.T) {
	for _, tc := range []struct{ hq, hk, d int }{{16, 8, 128}, {32, 8, 128}, {12, 4, 64}} {
		t.Run(fmt.Sprintf("hq%d-hk%d-d%d", tc.hq, tc.hk, tc.d), func(t *testing.T) {
			p := detPair(t)
			const n = 1500
			slots := n + 64
			perm := p.rng.Perm(slots)
			seq := make(detSeq, n)
			for i := range seq {
				seq[i] = int32(perm[i])
			}
			qkv := p.random(device.BF16, 1, n, tc.hq+2*tc.hk, tc.d)
			kc, vc := p.random(device.BF16, 1, slots, tc.hk, tc.d), p.random(device.BF16, 1, slots, tc.hk, tc.d)
			scale := float32(1 / math.Sqrt(float64(tc.d)))
			row := tc.hq * tc.d

			// The whole prompt in one prefill.
			full := p.random(device.BF16, 0, n, tc.hq, tc.d)
			meta := detMeta(p, []int{n}, []detSeq{seq})
			p.gpu.Attention(full.g, qkv.g, kc.g, vc.g, meta, scale)
			cmeta := meta
			cmeta.QIndptr, cmeta.KVIndptr, cmeta.KVIndices = p.ints([]int32{0, n}).c, p.ints([]int32{0, n}).c, p.ints(seq).c
			p.cpu.Attention(full.c, qkv.c, kc.c, vc.c, cmeta, scale)
			p.close("prefill", full, 2e-2, 2e-2)
			want, _ := p.download(full)
			same := func(name string, got []float32, pos []int) {
				t.Helper()
				for i, ps := range pos {
					for j := 0; j < row; j++ {
						if a, b := got[i*row+j], want[ps*row+j]; math.Float32bits(a) != math.Float32bits(b) {
							t.Fatalf("%s: position %d element %d: %v, one prefill %v", name, ps, j, a, b)
						}
					}
				}
			}
			span := func(from, to int) []int {
				var s []int
				for i := from; i < to; i++ {
					s = append(s, i)
				}
				return s
			}

			// A chunk: the prompt's last 700 tokens after the first 800
			// were cached, beside a short prompt.
			short := seq[:50]
			cq := p.random(device.BF16, 0, 750, tc.hq+2*tc.hk, tc.d)
			p.gpu.Copy(cq.g.Rows(0, 700), qkv.g.Rows(800, n))
			p.gpu.Copy(cq.g.Rows(700, 750), qkv.g.Rows(0, 50))
			chunk := p.random(device.BF16, 0, 750, tc.hq, tc.d)
			p.gpu.Attention(chunk.g, cq.g, kc.g, vc.g, detMeta(p, []int{700, 50}, []detSeq{seq, short}), scale)
			got, _ := p.download(chunk)
			same("chunk", got, append(span(800, n), span(0, 50)...))

			// Decodes at positions around the split and tile edges, one
			// batch alone and one mixed with a prefill after them.
			pos := []int{0, 1, 63, 64, 127, 128, 129, 255, 256, 700, 1023, n - 1}
			dq := p.random(device.BF16, 0, len(pos)+50, tc.hq+2*tc.hk, tc.d)
			var kv []detSeq
			for i, ps := range pos {
				p.gpu.Copy(dq.g.Rows(i, i+1), qkv.g.Rows(ps, ps+1))
				kv = append(kv, seq[:ps+1])
			}
			p.gpu.Copy(dq.g.Rows(len(pos), len(pos)+50), qkv.g.Rows(0, 50))
			qlens := slices.Repeat([]int{1}, len(pos))
			dec := p.random(device.BF16, 0, len(pos), tc.hq, tc.d)
			p.gpu.Attention(dec.g, dq.g.Rows(0, len(pos)), kc.g, vc.g, detMeta(p, qlens, kv), scale)
			got, _ = p.download(dec)
			same("decode", got, pos)
			// Every decode's splits shared among blocks, then every decode
			// in one block.
			for _, lone := range []int{0, 1 << 20} {
				was := p.gpu.detLoneSplits
				p.gpu.detLoneSplits = lone
				p.gpu.Attention(dec.g, dq.g.Rows(0, len(pos)), kc.g, vc.g, detMeta(p, qlens, kv), scale)
				p.gpu.detLoneSplits = was
				got, _ = p.download(dec)
				same(fmt.Sprintf("decode, lone up to %d splits", lone), got, pos)
			}
			mixed := p.random(device.BF16, 0, len(pos)+50, tc.hq, tc.d)
			p.gpu.Attention(mixed.g, dq.g, kc.g, vc.g, detMeta(p, append(qlens, 50), append(kv, short)), scale)
			got, _ = p.download(mixed)
			same("mixed step", got, append(slices.Clone(pos), span(0, 50)...))

			// A decode among 255 others, whose partials then take every
			// worker's share of the buffer differently.
			var many []detSeq
			mq := p.random(device.BF16, 0, 256, tc.hq+2*tc.hk, tc.d)
			for i := 0; i < 256; i++ {
				ps := n - 1 - 5*i
				many = append(many, seq[:ps+1])
				p.gpu.Copy(mq.g.Rows(i, i+1), qkv.g.Rows(ps, ps+1))
			}
			big := p.random(device.BF16, 0, 256, tc.hq, tc.d)
			p.gpu.Attention(big.g, mq.g, kc.g, vc.g, detMeta(p, slices.Repeat([]int{1}, 256), many), scale)
			got, _ = p.download(big)
			var mpos []int
			for i := 0; i < 256; i++ {
				mpos = append(mpos, n-1-5*i)
			}
			same("256 decodes", got, mpos)
			// Partials for a tenth of them: the rest are merged by one
			// block each, in registers.
			p.gpu.detPartRows = 26 * tc.hq * 12
			p.gpu.Attention(big.g, mq.g, kc.g, vc.g, detMeta(p, slices.Repeat([]int{1}, 256), many), scale)
			got, _ = p.download(big)
			p.gpu.detPartRows = 0
			same("256 decodes, partials for some", got, mpos)
		})
	}
}

// TestDeterministicLogprobs: a sampled token's logprob (from bf16 logits,
// as decode graphs sample) has the bits of the same token scored as a
// prompt's (float32 logits, TokenLogprobs), in batches of any size.
func TestDeterministicLogprobs(t *testing.T) {
	p := detPair(t)
	const v, b = 151936, 9
	logits := p.random(device.BF16, 3, b, v)
	f32 := p.random(device.F32, 0, b, v)
	p.gpu.Convert(f32.g, logits.g)
	p.cpu.Convert(f32.c, logits.c)
	greedy := make([]float32, b)
	args := sampleArgs(p, greedy, slices.Repeat([]float32{1}, b), slices.Repeat([]int32{-1}, b), make([]float32, b), make([]int32, 2*b), 0)
	p.gpu.Sample(logits.g, args[0])
	p.sync()
	ids, lps := make([]int32, b), make([]float32, b)
	if err := p.gpu.DownloadI32(args[0].IDs, ids); err != nil {
		t.Fatal(err)
	}
	if err := p.gpu.DownloadF32(args[0].Logprobs, lps); err != nil {
		t.Fatal(err)
	}
	targets := p.ints(ids)
	scored := p.random(device.F32, 0, b)
	p.gpu.TokenLogprobs(scored.g, f32.g, targets.g)
	got, _ := p.download(scored)
	ref := p.random(device.F32, 0, b)
	p.cpu.TokenLogprobs(ref.c, f32.c, targets.c)
	_, cpuLps := p.download(ref)
	for r := range got {
		if math.Float32bits(got[r]) != math.Float32bits(lps[r]) {
			t.Fatalf("row %d: sampled logprob %v, scored %v", r, lps[r], got[r])
		}
		if math.Abs(float64(got[r]-cpuLps[r])) > 1e-3 {
			t.Fatalf("row %d: logprob %v, CPU reference %v", r, got[r], cpuLps[r])
		}
	}
	// One row alone.
	one := sampleArgs(p, greedy[:1], []float32{1}, []int32{-1}, []float32{0}, []int32{0, 0}, 0)
	p.gpu.Sample(logits.g.Rows(b-1, b), one[0])
	p.sync()
	alone := make([]float32, 1)
	if err := p.gpu.DownloadF32(one[0].Logprobs, alone); err != nil {
		t.Fatal(err)
	}
	if math.Float32bits(alone[0]) != math.Float32bits(lps[b-1]) {
		t.Fatalf("a row alone: logprob %v, among %d rows %v", alone[0], b, lps[b-1])
	}
}

// TestDeterministicFold: under deterministic inference a batch of up to
// detFoldRows folds add_rmsnorm into o_proj (add mode) and gate_up (norm
// mode, the scales from the rows in add_rmsnorm_v8's order), and each row's
// residual and activations have exactly the bits that MatMul, AddRMSNorm
// and MatMulSiLU give it in a batch too large to fold.
func TestDeterministicFold(t *testing.T) {
	p := detPair(t)
	// More rows than matmul_wg_few takes: the reference is matmul_wg's.
	const rows, hidden, inter, heads = detFewMaxRows + 1, 1024, 3072, 2048
	x := p.random(device.BF16, 1, rows, heads)
	wo := p.random(device.BF16, 1/float32(math.Sqrt(heads)), hidden, heads)
	wgu := p.random(device.BF16, 1/float32(math.Sqrt(hidden)), 2*inter, hidden)
	normW := p.random(device.BF16, 0.3, hidden)
	h0 := p.random(device.BF16, 3, rows, hidden)
	h, tmp, xn := p.clone(device.BF16, h0), p.random(device.BF16, 0, rows, hidden), p.random(device.BF16, 0, rows, hidden)
	act := p.random(device.BF16, 0, rows, inter)
	p.gpu.MatMul(tmp.g, x.g, wo.g, device.Tensor{})
	p.gpu.AddRMSNorm(h.g, tmp.g, xn.g, normW.g, 1e-6)
	if !p.gpu.MatMulSiLU(act.g, xn.g, wgu.g) {
		t.Fatal("MatMulSiLU declined")
	}
	wantH, _ := p.download(h)
	wantAct, _ := p.download(act)
	if p.gpu.MatMulAdd(x.g, wo.g, false, h0.g, wgu.g, true) {
		t.Fatalf("folded %d rows", rows)
	}
	start, _ := p.download(h0)
	for _, m := range []int{1, detFoldRows} {
		hm := p.floats(device.BF16, start[:m*hidden], m, hidden)
		actm := p.random(device.BF16, 0, m, inter)
		if !p.gpu.MatMulAdd(x.g.Rows(0, m), wo.g, false, hm.g, wgu.g, true) {
			t.Fatalf("%d rows: not folded", m)
		}
		if !p.gpu.RMSNormMatMul(actm.g, hm.g, normW.g, wgu.g, 1e-6, true) {
			t.Fatalf("%d rows: no norm product", m)
		}
		sameRows(t, p, hm, wantH, hidden, fmt.Sprintf("%d rows: residual", m))
		sameRows(t, p, actm, wantAct, inter, fmt.Sprintf("%d rows: activations", m))
	}
}

// TestDeterministicProjectQKV: the qkv products that prepare q, k and v
// themselves (matmul_wg_few_qkv up to detFewQKVRows, with and without the norm
// folded in; matmul_wg_part_qkv at decode batches past 48 rows and a
// prefill) leave them with the bits of the product then PrepareQKV
// (prepare_qkv16), with and without the per-head norms, and within bf16
// rounding of the CPU reference; the batches between (cluster tiles) are
// left to the caller.
func TestDeterministicProjectQKV(t *testing.T) {
	const hq, hk, d, hidden, eps = 16, 8, 128, 1024, 1e-6
	const n = (hq + 2*hk) * d
	for _, tc := range []struct {
		m          int
		norm, fold bool
	}{{1, true, false}, {1, true, true}, {2, false, true}, {2, true, false}, {3, true, false}, {16, false, false},
		{17, true, false}, {48, true, false}, {49, true, false}, {64, false, false}, {100, true, false},
		{256, true, false}, {700, true, false}, {700, false, false}} {
		t.Run(fmt.Sprintf("m%d-norm%v-fold%v", tc.m, tc.norm, tc.fold), func(t *testing.T) {
			p := detPair(t)
			m := tc.m
			x := p.random(device.BF16, 1, m, hidden)
			w := p.random(device.BF16, 0.03, n, hidden)
			var qn, kn, normW both
			if tc.norm {
				qn, kn = p.floats(device.BF16, onesPlus(p, d), d), p.floats(device.BF16, onesPlus(p, d), d)
			}
			slots := m + 37
			var positions, slotIDs []int32
			for i, s := range p.rng.Perm(slots)[:m] {
				positions, slotIDs = append(positions, int32(i*7%1024)), append(slotIDs, int32(s))
			}
			pos, sl := p.ints(positions), p.ints(slotIDs)
			cos, sin := ropeTables(p, 1024, d/2)
			kc, vc := p.random(device.BF16, 1, slots, hk, d), p.random(device.BF16, 1, slots, hk, d)
			kc2, vc2 := p.clone(device.BF16, kc), p.clone(device.BF16, vc)
			// fold: x is a residual that o_proj's MatMulAdd leaves, normalised
			// by the product (RMSNormMatMul) with normW.
			var xo, wo, x2 both
			residual := func(x both) {
				if !p.gpu.MatMulAdd(xo.g, wo.g, false, x.g, w.g, false) {
					t.Fatal("MatMulAdd declined")
				}
			}
			if tc.fold {
				normW = p.floats(device.BF16, onesPlus(p, hidden), hidden)
				xo, wo = p.random(device.BF16, 1, m, 2*hidden), p.random(device.BF16, 0.02, hidden, 2*hidden)
				x2 = p.clone(device.BF16, x)
				residual(x)
			}
			got := p.random(device.BF16, 0, m, hq+2*hk, d)
			if !p.gpu.ProjectQKV(got.g, x.g, normW.g, w.g, qn.g, kn.g, pos.g, cos.g, sin.g, kc2.g, vc2.g, sl.g, eps) {
				if name, _, _, _, _ := p.gpu.matMulWGShape(m, n, hidden); m <= detFewQKVRows || (m > 16 && strings.HasPrefix(name, "matmul_wg_part_")) {
					t.Fatalf("ProjectQKV declined %d rows, which take %s", m, name)
				}
				return
			}
			if m > detFewQKVRows && m <= cmp.Or(p.gpu.detPartFrom, matMulWGDetPartFrom) {
				t.Fatalf("ProjectQKV took %d rows", m)
			}
			want := p.random(device.BF16, 0, m, hq+2*hk, d)
			if tc.fold {
				residual(x2)
				if !p.gpu.RMSNormMatMul(want.g.View(m, n), x2.g, normW.g, w.g, eps, false) {
					t.Fatal("RMSNormMatMul declined")
				}
			} else {
				p.gpu.MatMul(want.g.View(m, n), x.g, w.g, device.Tensor{})
			}
			p.gpu.PrepareQKV(want.g, qn.g, kn.g, pos.g, cos.g, sin.g, kc.g, vc.g, sl.g, eps)
			if err := p.gpu.Sync(); err != nil {
				t.Fatal(err)
			}
			g, _ := p.download(got)
			wq, _ := p.download(want)
			for i := range g {
				if i%n < hq*d && math.Float32bits(g[i]) != math.Float32bits(wq[i]) {
					t.Fatalf("q: token %d element %d: %v, want %v (the product then PrepareQKV)", i/n, i%n, g[i], wq[i])
				}
			}
			for _, c := range [][2]both{{kc2, kc}, {vc2, vc}} {
				a, _ := p.download(c[0])
				b, _ := p.download(c[1])
				for i := range a {
					if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
						t.Fatalf("caches: element %d: %v, want %v", i, a[i], b[i])
					}
				}
			}
			if tc.fold {
				return // the CPU reference has no fold; the unfolded cases compare with it
			}
			p.cpu.MatMul(got.c.View(m, n), x.c, w.c, device.Tensor{})
			p.cpu.PrepareQKV(got.c, qn.c, kn.c, pos.c, cos.c, sin.c, kc2.c, vc2.c, sl.c, eps)
			p.closeQueries("q", got, hq, hk, d, 3e-2)
			p.close("k cache", kc2, 3e-2, 3e-2)
			p.close("v cache", vc2, 2e-2, 2e-2)
		})
	}
}

// TestDeterministicSplitSums: o_proj's and down_proj's products at the
// batches whose K splits run on clusters, each split's sums left in memory
// and added by add_rmsnorm_parts_v8 (MatMulAddRMSNorm), give the bits of
// MatMul then AddRMSNorm (the clusters' exchange) in the product, the
// residual and the normed rows, and come within bf16 rounding of the CPU.
// By default the planes take up to detPartsMaxRows rows; with the bound
// raised (EBB_DET_PARTS_ROWS) they take every batch tile.
func TestDeterministicSplitSums(t *testing.T) {
	p := detPair(t)
	const hidden, eps = 1024, 1e-6
	for _, limit := range []int{0, matMulWGRows[len(matMulWGRows)-1]} {
		p.gpu.detPartsRows = limit
		for _, c := range []struct{ rows, k int }{
			{detFewMaxRows + 1, 2048}, {64, 3072}, {100, 2048}, {192, 3072}, {256, 2048}, {256, 3072},
		} {
			name := fmt.Sprintf("%d x %d, bound %d", c.rows, c.k, cmp.Or(limit, detPartsMaxRows))
			x := p.random(device.BF16, 1, c.rows, c.k)
			w := p.random(device.BF16, 1/float32(math.Sqrt(float64(c.k))), hidden, c.k)
			normW := p.random(device.BF16, 0.3, hidden)
			h0 := p.random(device.BF16, 3, c.rows, hidden)
			h, tmp, xn := p.clone(device.BF16, h0), p.random(device.BF16, 0, c.rows, hidden), p.random(device.BF16, 0, c.rows, hidden)
			p.gpu.MatMul(tmp.g, x.g, w.g, device.Tensor{})
			p.gpu.AddRMSNorm(h.g, tmp.g, xn.g, normW.g, eps)
			h2, tmp2, xn2 := p.clone(device.BF16, h0), p.random(device.BF16, 0, c.rows, hidden), p.random(device.BF16, 0, c.rows, hidden)
			taken := p.gpu.MatMulAddRMSNorm(tmp2.g, x.g, w.g, false, h2.g, xn2.g, normW.g, eps)
			if want := c.rows <= cmp.Or(limit, detPartsMaxRows); taken != want {
				t.Fatalf("%s: taken %v, want %v", name, taken, want)
			}
			if taken {
				p.sameBits(name+": product", tmp2.g, tmp.g)
				p.sameBits(name+": residual", h2.g, h.g)
				p.sameBits(name+": normed", xn2.g, xn.g)
				p.cpu.MatMul(tmp2.c, x.c, w.c, device.Tensor{})
				p.cpu.AddRMSNorm(h2.c, tmp2.c, xn2.c, normW.c, eps)
				p.close(name+": residual against the CPU", h2, 0.07, 0.02)
				p.close(name+": normed against the CPU", xn2, 0.02, 0.02)
			}
			p.free(x, w, normW, h0, h, tmp, xn, h2, tmp2, xn2)
		}
	}
}
