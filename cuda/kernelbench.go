package cuda

import (
	"fmt"
	"sort"

	"ebb/device"
	"ebb/memory"
	"ebb/model"
)

// AttentionBenchSpec is one attention shape to time: Batch sequences of
// Context cached positions each, QLen new queries per sequence (1 for
// decode; more is a prefill that attends to Context-QLen cached positions
// and causally to itself).
type AttentionBenchSpec struct {
	Batch, Context, QLen int
	QHeads, KVHeads, Dim int
	Iters                int
}

// AttentionBenchResult is the median of Iters launches, timed by events.
type AttentionBenchResult struct {
	AttentionBenchSpec
	Kernel      string  `json:"kernel"`
	MedianUs    float64 `json:"median_us"`
	MinUs       float64 `json:"min_us"`
	Bytes       int64   `json:"bytes"` // K and V read once, plus queries and outputs
	GBPerS      float64 `json:"gb_per_s"`
	PeakGBPerS  float64 `json:"peak_gb_per_s"` // from NVML's memory clock and bus width; 0 if unknown
	PeakPercent float64 `json:"peak_percent"`
	TFLOPS      float64 `json:"tflops"` // prefill: 4·hq·dim per visible (query, key) pair
}

// BenchAttention times d's attention kernel on the spec's shape. The KV
// cache rows of each sequence are contiguous slots, as a fresh pool gives.
func BenchAttention(d *Device, s AttentionBenchSpec) (AttentionBenchResult, error) {
	res := AttentionBenchResult{AttentionBenchSpec: s}
	if s.QLen < 1 || s.QLen > s.Context || s.Iters < 1 || s.KVHeads < 1 || s.QHeads%s.KVHeads != 0 {
		return res, fmt.Errorf("attention bench: bad shape %+v", s)
	}
	slots := s.Batch * s.Context
	tokens := s.Batch * s.QLen
	a, err := newBenchArena(d)
	if err != nil {
		return res, err
	}
	defer a.free()
	alloc := a.alloc
	kc, vc := alloc(device.BF16, slots, s.KVHeads, s.Dim), alloc(device.BF16, slots, s.KVHeads, s.Dim)
	qkv := alloc(device.BF16, tokens, s.QHeads+2*s.KVHeads, s.Dim)
	out := alloc(device.BF16, tokens, s.QHeads, s.Dim)
	qInd, kvInd, idx := make([]int32, s.Batch+1), make([]int32, s.Batch+1), make([]int32, slots)
	for b := 0; b < s.Batch; b++ {
		qInd[b+1], kvInd[b+1] = int32((b+1)*s.QLen), int32((b+1)*s.Context)
	}
	for i := range idx {
		idx[i] = int32(i)
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
	res.MedianUs, res.MinUs = us[len(us)/2], us[0]
	res.Kernel = attentionKernelName(s)
	res.Bytes = 2*int64(slots)*int64(s.KVHeads*s.Dim)*2 + int64(tokens)*int64(2*s.QHeads+2*s.KVHeads)*int64(s.Dim)*2
	res.GBPerS = float64(res.Bytes) / res.MedianUs / 1e3
	prefix := s.Context - s.QLen
	pairs := float64(s.Batch) * (float64(s.QLen)*float64(prefix) + float64(s.QLen)*float64(s.QLen+1)/2)
	res.TFLOPS = 4 * float64(s.QHeads*s.Dim) * pairs / res.MedianUs / 1e6
	res.PeakGBPerS, res.PeakPercent = d.peakShare(res.GBPerS)
	return res, d.Sync()
}

func attentionKernelName(s AttentionBenchSpec) string {
	g := s.QHeads / s.KVHeads
	if s.QLen == 1 {
		if name, ok := decodeVecKernel(g, s.Dim); ok {
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
}

// MatMulBenchResult is the median of Iters launches. Weights are read
// from enough copies that they come from HBM, as in a model's step,
// not from L2.
type MatMulBenchResult struct {
	MatMulBenchSpec
	Kernel      string  `json:"kernel"`
	MedianUs    float64 `json:"median_us"`
	MinUs       float64 `json:"min_us"`
	Bytes       int64   `json:"bytes"` // weights, inputs and outputs once
	GBPerS      float64 `json:"gb_per_s"`
	PeakGBPerS  float64 `json:"peak_gb_per_s"`
	PeakPercent float64 `json:"peak_percent"`
	TFLOPS      float64 `json:"tflops"`
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
	x, out := a.alloc(device.BF16, s.M, s.K), a.alloc(device.BF16, s.M, s.N)
	ws := make([]device.Tensor, copies)
	for i := range ws {
		ws[i] = a.alloc(device.BF16, s.N, s.K)
		d.Fill(ws[i], 0.01)
	}
	d.Fill(x, 0.5)
	d.MatMul(out, x, ws[0], device.Tensor{}) // first launch loads the function
	if err := d.Sync(); err != nil {
		return res, err
	}
	us, err := timeLaunches(d, s.Iters, copies, func(i int) { d.MatMul(out, x, ws[i], device.Tensor{}) })
	if err != nil {
		return res, err
	}
	res.MedianUs, res.MinUs = us[len(us)/2], us[0]
	res.Kernel = d.matMulKernel(s.M, s.N, s.K)
	res.Bytes = wBytes + int64(s.M)*int64(s.K+s.N)*2
	res.GBPerS = float64(res.Bytes) / res.MedianUs / 1e3
	res.TFLOPS = 2 * float64(s.M) * float64(s.N) * float64(s.K) / res.MedianUs / 1e6
	res.PeakGBPerS, res.PeakPercent = d.peakShare(res.GBPerS)
	return res, d.Sync()
}
