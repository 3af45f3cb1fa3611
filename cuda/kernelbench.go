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
	alloc := func(dt device.DType, shape ...int) device.Tensor {
		t, err := d.Alloc(memory.Workspace, dt, shape...)
		d.fail(err)
		return t
	}
	if d.mem.Region(memory.Workspace) == nil {
		if _, err := d.mem.Create(memory.Workspace, memory.RegionOptions{Capacity: 256 << 30, GrowStep: 64 << 20}); err != nil {
			return res, err
		}
	}
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
	// Timed as the model runs it: launches replayed from a CUDA graph, so
	// that the host's launch cost does not count for short kernels.
	const perGraph = 10
	d.Attention(out, qkv, kc, vc, meta, scale) // first launch loads the function
	graph, err := d.CaptureGraph(func() {
		for range perGraph {
			d.Attention(out, qkv, kc, vc, meta, scale)
		}
	})
	if err != nil {
		return res, err
	}
	defer graph.Destroy()
	start, err := d.ctx.NewEvent()
	if err != nil {
		return res, err
	}
	defer start.Destroy()
	end, err := d.ctx.NewEvent()
	if err != nil {
		return res, err
	}
	defer end.Destroy()
	us := make([]float64, s.Iters)
	for i := range us {
		if err := graph.Replay(); err != nil { // warm, and keeps the GPU ahead of the host
			return res, err
		}
		d.fail(d.ctx.Record(start))
		if err := graph.Replay(); err != nil {
			return res, err
		}
		d.fail(d.ctx.Record(end))
		ms, err := Elapsed(start, end)
		if err != nil {
			return res, err
		}
		us[i] = float64(ms) * 1000 / perGraph
	}
	if err := d.Sync(); err != nil {
		return res, err
	}
	sort.Float64s(us)
	res.MedianUs, res.MinUs = us[len(us)/2], us[0]
	res.Kernel = attentionKernelName(s)
	res.Bytes = 2*int64(slots)*int64(s.KVHeads*s.Dim)*2 + int64(tokens)*int64(2*s.QHeads+2*s.KVHeads)*int64(s.Dim)*2
	res.GBPerS = float64(res.Bytes) / res.MedianUs / 1e3
	prefix := s.Context - s.QLen
	pairs := float64(s.Batch) * (float64(s.QLen)*float64(prefix) + float64(s.QLen)*float64(s.QLen+1)/2)
	res.TFLOPS = 4 * float64(s.QHeads*s.Dim) * pairs / res.MedianUs / 1e6
	if d.nvml != nil {
		if peak, err := d.nvml.PeakBandwidth(); err == nil {
			res.PeakGBPerS = peak / 1e9
			res.PeakPercent = 100 * res.GBPerS / res.PeakGBPerS
		}
	}
	for _, t := range []device.Tensor{kc, vc, qkv, out, meta.QIndptr, meta.KVIndptr, meta.KVIndices} {
		d.Free(memory.Workspace, t)
	}
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
