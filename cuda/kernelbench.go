package cuda

import (
	"fmt"
	"math/rand/v2"
	"sort"

	"ebb/device"
	"ebb/memory"
	"ebb/model"
)

// AttentionBenchSpec is one attention shape to time: Batch sequences of
// Context cached positions each, QLen new queries per sequence (1 for
// decode; more is a prefill that attends to Context-QLen cached positions
// and causally to itself). With MinContext set, contexts are spread evenly
// over [MinContext, Context], longest first as the scheduler orders a
// decode batch, or Shuffled.
type AttentionBenchSpec struct {
	Batch, Context, QLen int
	MinContext           int    `json:",omitempty"`
	Shuffled             bool   `json:",omitempty"`
	Layout               string `json:",omitempty"` // KV slot layout: contiguous (default), interleaved or random
	QHeads, KVHeads, Dim int
	Iters                int
}

// AttentionBenchResult is the median of Iters launches, timed by events.
type AttentionBenchResult struct {
	AttentionBenchSpec
	Kernel string `json:"kernel"`
	// Bytes: K and V read once, plus queries and outputs; TFLOPS for a
	// prefill: 4·hq·dim per visible (query, key) pair.
	KernelTiming
	// The step's whole attention is also timed with the query and key
	// preparation (per-head norm, rotary, cache store): prepare_qkv then
	// the kernel, and the kernel preparing its own queries where it does
	// (decodes, and prefills of about a thousand tokens or more; 0
	// otherwise).
	WithPrepareUs float64 `json:"with_prepare_us,omitempty"`
	FusedUs       float64 `json:"fused_prepare_us,omitempty"`
}

// BenchAttention times d's attention kernel on the spec's shape. By default
// the KV cache rows of each sequence are contiguous slots, as a fresh pool
// gives; interleaved places position p of sequence b at slot p*Batch+b, as
// decode steps that each take one slot per sequence do; random shuffles
// all slots.
func BenchAttention(d *Device, s AttentionBenchSpec) (AttentionBenchResult, error) {
	res := AttentionBenchResult{AttentionBenchSpec: s}
	if s.MinContext == 0 {
		s.MinContext = s.Context
	}
	if s.QLen < 1 || s.QLen > s.MinContext || s.MinContext > s.Context || s.Iters < 1 || s.KVHeads < 1 || s.QHeads%s.KVHeads != 0 {
		return res, fmt.Errorf("attention bench: bad shape %+v", s)
	}
	ctx := benchContexts(s.Batch, s.MinContext, s.Context, s.Shuffled)
	idx, err := benchSlots(ctx, s.Layout)
	if err != nil {
		return res, err
	}
	slots, cacheSlots := len(idx), int32(0)
	for _, i := range idx {
		cacheSlots = max(cacheSlots, i+1)
	}
	tokens := s.Batch * s.QLen
	a, err := newBenchArena(d)
	if err != nil {
		return res, err
	}
	defer a.free()
	alloc := a.alloc
	kc, vc := alloc(device.BF16, int(cacheSlots), s.KVHeads, s.Dim), alloc(device.BF16, int(cacheSlots), s.KVHeads, s.Dim)
	qkv := alloc(device.BF16, tokens, s.QHeads+2*s.KVHeads, s.Dim)
	out := alloc(device.BF16, tokens, s.QHeads, s.Dim)
	qInd, kvInd := make([]int32, s.Batch+1), make([]int32, s.Batch+1)
	for b := 0; b < s.Batch; b++ {
		qInd[b+1], kvInd[b+1] = int32((b+1)*s.QLen), kvInd[b]+int32(ctx[b])
	}
	meta := device.AttnMeta{NumSeqs: s.Batch, MaxQLen: s.QLen, MaxKVLen: s.Context,
		QIndptr: alloc(device.I32, s.Batch+1), KVIndptr: alloc(device.I32, s.Batch+1), KVIndices: alloc(device.I32, slots)}
	if err := d.Sync(); err != nil {
		return res, err
	}
	for _, u := range []struct {
		t device.Tensor
		v []int32
	}{{meta.QIndptr, qInd}, {meta.KVIndptr, kvInd}, {meta.KVIndices, idx}} {
		if err := d.Upload(u.t, model.I32Bytes(u.v), device.I32); err != nil {
			return res, err
		}
	}
	d.Fill(kc, 0.02)
	d.Fill(vc, 0.5)
	d.Fill(qkv, 0.1)
	scale := float32(0.088)
	d.Attention(out, qkv, kc, vc, meta, scale) // first launch loads the function
	us, err := timeLaunches(d, s.Iters, 10, func(int) { d.Attention(out, qkv, kc, vc, meta, scale) })
	if err != nil {
		return res, err
	}
	res.Kernel = d.attentionKernelName(s)
	pairs := 0.0
	for _, c := range ctx {
		pairs += float64(s.QLen)*float64(c-s.QLen) + float64(s.QLen)*float64(s.QLen+1)/2
	}
	res.set(d, us, 2*int64(slots)*int64(s.KVHeads*s.Dim)*2+int64(tokens)*int64(2*s.QHeads+2*s.KVHeads)*int64(s.Dim)*2,
		4*float64(s.QHeads*s.Dim)*pairs)
	if res.WithPrepareUs, res.FusedUs, err = benchPrepare(d, a, s, ctx, idx, kvInd, qkv, out, kc, vc, meta); err != nil {
		return res, err
	}
	return res, d.Sync()
}

// benchPrepare times a step's attention with its query and key
// preparation, both ways (see AttentionBenchResult).
func benchPrepare(d *Device, a *benchArena, s AttentionBenchSpec, ctx []int, idx, kvInd []int32, qkv, out, kc, vc device.Tensor, meta device.AttnMeta) (withPrepare, fused float64, err error) {
	var pos, slots []int32
	for b, c := range ctx {
		for p := c - s.QLen; p < c; p++ {
			pos, slots = append(pos, int32(p)), append(slots, idx[int(kvInd[b])+p])
		}
	}
	cfg := &model.Config{HeadDim: s.Dim, RopeTheta: 1e6, Rope: model.RopeScaling{Type: "default"}}
	cosT, sinT := cfg.RopeTables(s.Context)
	posT, slotT := a.alloc(device.I32, len(pos)), a.alloc(device.I32, len(slots))
	cosD, sinD := a.alloc(device.F32, s.Context, s.Dim/2), a.alloc(device.F32, s.Context, s.Dim/2)
	qn, kn := a.alloc(device.BF16, s.Dim), a.alloc(device.BF16, s.Dim)
	if err := d.Sync(); err != nil {
		return 0, 0, err
	}
	for _, u := range []struct {
		t  device.Tensor
		b  []byte
		dt device.DType
	}{{posT, model.I32Bytes(pos), device.I32}, {slotT, model.I32Bytes(slots), device.I32},
		{cosD, model.F32Bytes(cosT), device.F32}, {sinD, model.F32Bytes(sinT), device.F32}} {
		if err := d.Upload(u.t, u.b, u.dt); err != nil {
			return 0, 0, err
		}
	}
	d.Fill(qn, 1)
	d.Fill(kn, 1)
	scale, eps := float32(0.088), float32(1e-6)
	median := func(launch func()) (float64, error) {
		launch()
		us, err := timeLaunches(d, s.Iters, 10, func(int) { launch() })
		if err != nil {
			return 0, err
		}
		return us[len(us)/2], nil
	}
	if withPrepare, err = median(func() {
		d.PrepareQKV(qkv, qn, kn, posT, cosD, sinD, kc, vc, slotT, eps)
		d.Attention(out, qkv, kc, vc, meta, scale)
	}); err != nil {
		return 0, 0, err
	}
	fusedLaunch := func() { d.PrepareAttention(out, qkv, qn, kn, posT, cosD, sinD, kc, vc, slotT, meta, scale, eps) }
	if !d.PrepareAttention(out, qkv, qn, kn, posT, cosD, sinD, kc, vc, slotT, meta, scale, eps) {
		return withPrepare, 0, nil // a prefill this small keeps prepare_qkv
	}
	fused, err = median(fusedLaunch)
	return withPrepare, fused, err
}

// benchContexts spreads n context lengths evenly over [lo, hi], longest
// first, or shuffled by a fixed seed.
func benchContexts(n, lo, hi int, shuffled bool) []int {
	ctx := make([]int, n)
	for i := range ctx {
		ctx[i] = hi
		if n > 1 {
			ctx[i] = hi - (hi-lo)*i/(n-1)
		}
	}
	if shuffled {
		rng := rand.New(rand.NewPCG(1, 2))
		rng.Shuffle(n, func(i, j int) { ctx[i], ctx[j] = ctx[j], ctx[i] })
	}
	return ctx
}

// benchSlots lays out the KV slots of sequences of the given contexts,
// concatenated in sequence order.
func benchSlots(ctx []int, layout string) ([]int32, error) {
	var idx []int32
	switch layout {
	case "", "contiguous", "random":
		total := 0
		for _, c := range ctx {
			total += c
		}
		idx = make([]int32, total)
		for i := range idx {
			idx[i] = int32(i)
		}
		if layout == "random" {
			rng := rand.New(rand.NewPCG(3, 4))
			rng.Shuffle(len(idx), func(i, j int) { idx[i], idx[j] = idx[j], idx[i] })
		}
	case "interleaved":
		for b, c := range ctx {
			for p := 0; p < c; p++ {
				idx = append(idx, int32(p*len(ctx)+b))
			}
		}
	default:
		return nil, fmt.Errorf("attention bench: layout %q (want contiguous, interleaved or random)", layout)
	}
	return idx, nil
}

func (d *Device) attentionKernelName(s AttentionBenchSpec) string {
	g := s.QHeads / s.KVHeads
	if s.QLen == 1 {
		if name, _, ok := d.splitDecodeKernel(g, s.Dim, s.Batch*s.KVHeads, s.Context); ok {
			return name
		}
		if name, ok := decodeKernel(g, s.Dim); ok {
			return name
		}
	}
	if s.Dim == 64 || s.Dim == 128 {
		return fmt.Sprintf("attn_prefill_mma_d%d", s.Dim)
	}
	return "attn_prefill"
}

// benchArena hands a kernel benchmark its tensors from the workspace
// region (created if the device has none yet) and frees them all at once.
type benchArena struct {
	d  *Device
	ts []device.Tensor
}

func newBenchArena(d *Device) (*benchArena, error) {
	if d.mem.Region(memory.Workspace) == nil {
		if _, err := d.mem.Create(memory.Workspace, memory.RegionOptions{Capacity: 256 << 30, GrowStep: 64 << 20}); err != nil {
			return nil, err
		}
	}
	return &benchArena{d: d}, nil
}

// alloc's error is the device's sticky error, reported by its next Sync.
func (a *benchArena) alloc(dt device.DType, shape ...int) device.Tensor {
	t, err := a.d.Alloc(memory.Workspace, dt, shape...)
	a.d.fail(err)
	a.ts = append(a.ts, t)
	return t
}

func (a *benchArena) free() {
	for _, t := range a.ts {
		a.d.Free(memory.Workspace, t)
	}
}

// timeLaunches times iters replays of a CUDA graph of perGraph calls of
// launch (given their index), as the model runs kernels, so that the
// host's launch cost does not count for short ones: microseconds per
// call, sorted.
func timeLaunches(d *Device, iters, perGraph int, launch func(i int)) ([]float64, error) {
	graph, err := d.CaptureGraph(func() {
		for i := range perGraph {
			launch(i)
		}
	})
	if err != nil {
		return nil, err
	}
	defer graph.Destroy()
	start, err := d.ctx.NewEvent()
	if err != nil {
		return nil, err
	}
	defer start.Destroy()
	end, err := d.ctx.NewEvent()
	if err != nil {
		return nil, err
	}
	defer end.Destroy()
	us := make([]float64, iters)
	for i := range us {
		if err := graph.Replay(); err != nil { // warm, and keeps the GPU ahead of the host
			return nil, err
		}
		d.fail(d.ctx.Record(start))
		if err := graph.Replay(); err != nil {
			return nil, err
		}
		d.fail(d.ctx.Record(end))
		ms, err := Elapsed(start, end)
		if err != nil {
			return nil, err
		}
		us[i] = float64(ms) * 1000 / float64(perGraph)
	}
	if err := d.Sync(); err != nil {
		return nil, err
	}
	sort.Float64s(us)
	return us, nil
}

// KernelTiming is what a kernel benchmark reports of its launches: the
// median and fastest time, the bytes they move once, and the speed and
// share of HBM's peak (from NVML's memory clock and bus width; 0 if
// unknown) and tensor throughput that follow.
type KernelTiming struct {
	MedianUs    float64 `json:"median_us"`
	MinUs       float64 `json:"min_us"`
	Bytes       int64   `json:"bytes"`
	GBPerS      float64 `json:"gb_per_s"`
	PeakGBPerS  float64 `json:"peak_gb_per_s"`
	PeakPercent float64 `json:"peak_percent"`
	TFLOPS      float64 `json:"tflops"`
}

// set fills t from sorted launch times us (microseconds), the bytes a
// launch moves and the floating-point operations it does.
func (t *KernelTiming) set(d *Device, us []float64, bytes int64, flops float64) {
	t.MedianUs, t.MinUs, t.Bytes = us[len(us)/2], us[0], bytes
	t.GBPerS = float64(bytes) / t.MedianUs / 1e3
	t.TFLOPS = flops / t.MedianUs / 1e6
	t.PeakGBPerS, t.PeakPercent = d.peakShare(t.GBPerS)
}

// peakShare is the HBM peak from NVML (GB/s) and gbps as a percentage of
// it; zeros where NVML does not know the peak.
func (d *Device) peakShare(gbps float64) (peak, percent float64) {
	if d.nvml == nil {
		return 0, 0
	}
	p, err := d.nvml.PeakBandwidth()
	if err != nil {
		return 0, 0
	}
	return p / 1e9, 100 * gbps / (p / 1e9)
}

// MatMulBenchSpec is one x[M,K] @ w[N,K]^T to time.
type MatMulBenchSpec struct {
	M, N, K int
	Iters   int
	// FromL2 reads one copy of the weights, which stays in L2 once the
	// first launch has read it: the product's cost with its weights' HBM
	// reads taken away.
	FromL2 bool
	// Candidates also times each of cuBLASLt's heuristic algorithms for
	// the shape (LtCandidates), to see whether one beats the product's
	// own and keeps its bits.
	Candidates bool
}

// MatMulBenchResult is the median of Iters launches. Weights are read
// from enough copies that they come from HBM, as in a model's step,
// not from L2 (unless FromL2).
type MatMulBenchResult struct {
	MatMulBenchSpec
	Kernel       string        `json:"kernel"`
	KernelTiming               // Bytes: weights, inputs and outputs once
	LtCandidates []LtCandidate `json:"lt_candidates,omitempty"`
}

// LtCandidate is one of cuBLASLt's heuristic algorithms for a shape, in
// the heuristic's order, with its configuration as cuBLASLt reports it.
type LtCandidate struct {
	Index    int     `json:"index"`
	AlgoID   int     `json:"algo_id"`
	TileID   int     `json:"tile_id"`
	StagesID int     `json:"stages_id"`
	SplitK   int     `json:"split_k"`
	Cluster  int     `json:"cluster_shape_id"`
	Waves    float64 `json:"waves"`
	SameBits bool    `json:"same_bits"` // as d.MatMul's output
	MedianUs float64 `json:"median_us"`
}

// BenchMatMul times d.MatMul on the spec's shape with bf16 output.
func BenchMatMul(d *Device, s MatMulBenchSpec) (MatMulBenchResult, error) {
	res := MatMulBenchResult{MatMulBenchSpec: s}
	if s.M < 1 || s.N < 1 || s.K < 8 || s.Iters < 1 {
		return res, fmt.Errorf("matmul bench: bad shape %+v", s)
	}
	a, err := newBenchArena(d)
	if err != nil {
		return res, err
	}
	defer a.free()
	wBytes := int64(s.N) * int64(s.K) * 2
	copies := int(min(64, max(2, (512<<20)/wBytes)))
	launches := copies
	if s.FromL2 {
		copies, launches = 1, 32
	}
	x, out := a.alloc(device.BF16, s.M, s.K), a.alloc(device.BF16, s.M, s.N)
	ws := make([]device.Tensor, copies)
	// Random operands: constant ones draw less power and give every
	// algorithm the same bits.
	for i := range ws {
		ws[i] = a.alloc(device.BF16, s.N, s.K)
		d.FillUniform(ws[i], uint64(i+1), 0.02)
	}
	d.FillUniform(x, 1<<40, 1)
	d.MatMul(out, x, ws[0], device.Tensor{}) // first launch loads the function
	if err := d.Sync(); err != nil {
		return res, err
	}
	us, err := timeLaunches(d, s.Iters, launches, func(i int) { d.MatMul(out, x, ws[i%copies], device.Tensor{}) })
	if err != nil {
		return res, err
	}
	res.Kernel = d.matMulKernel(s.M, s.N, s.K)
	res.set(d, us, wBytes+int64(s.M)*int64(s.K+s.N)*2, 2*float64(s.M)*float64(s.N)*float64(s.K))
	if s.Candidates {
		if res.LtCandidates, err = d.benchLtCandidates(s, out, x, ws, launches); err != nil {
			return res, err
		}
	}
	return res, d.Sync()
}

// benchLtCandidates times cuBLASLt's heuristic algorithms for s as
// BenchMatMul times d.MatMul, each checked against d.MatMul's bits.
func (d *Device) benchLtCandidates(s MatMulBenchSpec, out, x device.Tensor, ws []device.Tensor, launches int) ([]LtCandidate, error) {
	if d.tuner == nil {
		return nil, fmt.Errorf("matmul bench: no cuBLASLt to list candidates")
	}
	size := int64(s.M) * int64(s.N) * 2
	d.MatMul(out, x, ws[0], device.Tensor{})
	want, err := d.outputHash(out.Ptr, size)
	if err != nil {
		return nil, err
	}
	algos, cands, err := d.ltCandidates(s.M, s.N, s.K)
	if err != nil {
		return nil, err
	}
	for i := range cands {
		c := &cands[i]
		if err := d.ltGemm(out.Ptr, false, x.Ptr, ws[0].Ptr, s.M, s.N, s.K, &algos[i]); err != nil {
			c.MedianUs = -1 // cuBLASLt refused it
			continue
		}
		h, err := d.outputHash(out.Ptr, size)
		if err != nil {
			return nil, err
		}
		c.SameBits = h == want
		us, err := timeLaunches(d, s.Iters, launches, func(j int) {
			d.fail(d.ltGemm(out.Ptr, false, x.Ptr, ws[j%len(ws)].Ptr, s.M, s.N, s.K, &algos[i]))
		})
		if err != nil {
			return nil, err
		}
		c.MedianUs = us[len(us)/2]
	}
	return cands, nil
}
