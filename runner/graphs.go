package runner

import (
	"encoding/binary"
	"fmt"
	"math"
	"sort"

	"ebb/device"
	"ebb/memory"
	"ebb/model"
)

// DefaultGraphBatchSizes is the ladder of decode batch sizes captured as
// graphs; a decode step runs the smallest one that holds it, padded.
var DefaultGraphBatchSizes = []int{1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256}

// graphSet holds captured decode steps. Every graph reads its inputs from
// and writes its outputs to one static buffer (cuda_graph region), so a
// replay is one host-to-device copy, the graph, and one copy back.
type graphSet struct {
	dev     device.Device
	sizes   []int
	graphs  map[int]device.Graph
	maxB    int
	kvCap   int
	l       staticLayout
	buf     device.Tensor // static inputs and outputs, 4-byte words
	scratch device.Tensor // static activations, shared by every graph
	host    []byte        // staging for buf (page-locked when the device offers it)
}

// staticLayout places every field at a fixed word offset for the largest
// batch; the KV indices come last so a step uploads only the prefix it uses.
type staticLayout struct {
	tokens, positions, slots, qptr, kvptr, rows, topK int // int32 fields
	temp, topP, minP, uni                             int // float32 fields
	outIDs, outLp                                     int // outputs, adjacent
	kvidx, words                                      int
}

func newStaticLayout(maxB, kvCap int) staticLayout {
	var l staticLayout
	n := 0
	next := func(size int) int { off := n; n += size; return off }
	l.tokens, l.positions, l.slots = next(maxB), next(maxB), next(maxB)
	l.qptr, l.kvptr, l.rows, l.topK = next(maxB+1), next(maxB+1), next(maxB), next(maxB)
	l.temp, l.topP, l.minP, l.uni = next(maxB), next(maxB), next(maxB), next(maxB)
	l.outIDs, l.outLp = next(maxB), next(maxB)
	l.kvidx = next(kvCap)
	l.words = n
	return l
}

// CaptureGraphs records decode steps for every batch size in sizes that is
// at most the runner's MaxSeqs. Without graph support it does nothing.
func (r *Runner) CaptureGraphs(sizes []int) error {
	gc, ok := r.dev.(device.GraphCapturer)
	if !ok || len(sizes) == 0 {
		return nil
	}
	sizes = append([]int(nil), sizes...)
	sort.Ints(sizes)
	for len(sizes) > 0 && sizes[len(sizes)-1] > r.limits.MaxSeqs {
		sizes = sizes[:len(sizes)-1]
	}
	if len(sizes) == 0 {
		return nil
	}
	maxB := sizes[len(sizes)-1]
	g := &graphSet{dev: r.dev, sizes: sizes, graphs: map[int]device.Graph{}, maxB: maxB}
	g.kvCap = min(maxB*r.Model.ContextLen(), r.Model.KVSlots()*4+maxB)
	g.l = newStaticLayout(maxB, g.kvCap)
	mem := r.dev.Memory()
	if mem.Region(memory.CUDAGraph) == nil {
		if _, err := mem.Create(memory.CUDAGraph, memory.RegionOptions{Capacity: 64 << 30, GrowStep: 64 << 20}); err != nil {
			return err
		}
	}
	var err error
	if g.buf, err = r.dev.Alloc(memory.CUDAGraph, device.I32, g.l.words); err != nil {
		return fmt.Errorf("graph inputs: %w", err)
	}
	if g.scratch, err = r.dev.Alloc(memory.CUDAGraph, device.F32, int((r.Model.ScratchBytes(maxB, maxB)+3)/4)); err != nil {
		return fmt.Errorf("graph activations: %w", err)
	}
	if p, ok := r.dev.(device.PinnedAllocator); ok {
		if g.host, err = p.AllocPinned(4 * g.l.words); err != nil {
			return fmt.Errorf("graph staging: %w", err)
		}
	} else {
		g.host = make([]byte, 4*g.l.words)
	}
	for _, b := range sizes {
		// Valid dummy inputs: every row decodes token 0 into the pad slot.
		g.packPadding(0, b, r.Model.PadSlot())
		if err := g.upload(g.l.kvidx); err != nil {
			return err
		}
		in, samp := g.views(b, r.Model.ContextLen())
		run := func() {
			logits := r.Model.Forward(in, device.NewScratch(g.scratch))
			r.dev.Sample(logits, samp)
		}
		run() // warm-up outside capture: loads kernels and cuBLAS heuristics
		if err := r.dev.Sync(); err != nil {
			return fmt.Errorf("graph warm-up (batch %d): %w", b, err)
		}
		gr, err := gc.CaptureGraph(run)
		if err != nil {
			return fmt.Errorf("capture decode graph (batch %d): %w", b, err)
		}
		g.graphs[b] = gr
	}
	r.graphs = g
	return nil
}

func (g *graphSet) i32(off, n int) device.Tensor {
	return device.Tensor{Ptr: g.buf.Ptr + uintptr(4*off), DType: device.I32, Shape: []int{n}}
}

func (g *graphSet) f32(off, n int) device.Tensor {
	return device.Tensor{Ptr: g.buf.Ptr + uintptr(4*off), DType: device.F32, Shape: []int{n}}
}

func (g *graphSet) setI(off int, v int32) { binary.LittleEndian.PutUint32(g.host[4*off:], uint32(v)) }

func (g *graphSet) setF(off int, v float32) {
	binary.LittleEndian.PutUint32(g.host[4*off:], math.Float32bits(v))
}

func (g *graphSet) getI(off int) int32 { return int32(binary.LittleEndian.Uint32(g.host[4*off:])) }

// views builds the model inputs and sampling arguments of a batch of b over
// the static buffer.
func (g *graphSet) views(b, ctxLen int) (model.Inputs, device.SampleArgs) {
	l := g.l
	in := model.Inputs{
		Tokens: g.i32(l.tokens, b), Positions: g.i32(l.positions, b), OutSlots: g.i32(l.slots, b),
		Attn: device.AttnMeta{NumSeqs: b, MaxQLen: 1, MaxKVLen: ctxLen,
			QIndptr: g.i32(l.qptr, b+1), KVIndptr: g.i32(l.kvptr, b+1), KVIndices: g.i32(l.kvidx, g.kvCap)},
		LogitRows: g.i32(l.rows, b),
	}
	samp := device.SampleArgs{
		Temperature: g.f32(l.temp, b), TopP: g.f32(l.topP, b), TopK: g.i32(l.topK, b), MinP: g.f32(l.minP, b),
		Uniform: g.f32(l.uni, b), IDs: g.i32(l.outIDs, b), Logprobs: g.f32(l.outLp, b),
	}
	return in, samp
}

// packPadding fills rows [from, to) as greedy padding rows with no KV.
func (g *graphSet) packPadding(from, to int, pad int32) {
	l := g.l
	if from == 0 {
		g.setI(l.qptr, 0)
		g.setI(l.kvptr, 0)
	}
	kvEnd := g.getI(l.kvptr + from)
	for i := from; i < to; i++ {
		g.setI(l.tokens+i, 0)
		g.setI(l.positions+i, 0)
		g.setI(l.slots+i, pad)
		g.setI(l.qptr+i+1, int32(i+1))
		g.setI(l.kvptr+i+1, kvEnd)
		g.setI(l.rows+i, int32(i))
		g.setI(l.topK+i, 1)
		g.setF(l.temp+i, 0)
		g.setF(l.topP+i, 1)
		g.setF(l.minP+i, 0)
		g.setF(l.uni+i, 0)
	}
}

// upload copies the first words of the staging buffer.
func (g *graphSet) upload(words int) error {
	return g.dev.Upload(g.i32(0, words), g.host[:4*words], device.I32)
}

// fits reports the captured size for a decode step of seqs, or 0 when the
// step must run eagerly.
func (g *graphSet) fits(seqs []SeqStep) int {
	if g == nil || len(seqs) > g.maxB {
		return 0
	}
	kv := 0
	for _, s := range seqs {
		if len(s.Tokens) != 1 || !s.Sample || len(s.Adjust) > 0 || s.NextTokens != nil || s.Params.TopLogprobs > 0 {
			return 0
		}
		kv += len(s.Slots)
	}
	if kv > g.kvCap {
		return 0
	}
	i := sort.SearchInts(g.sizes, len(seqs))
	return g.sizes[i]
}

// replay runs a decode step through the graph of size b.
func (r *Runner) replay(seqs []SeqStep, b int) ([]SeqResult, error) {
	g := r.graphs
	l := g.l
	kv := 0
	g.setI(l.qptr, 0)
	g.setI(l.kvptr, 0)
	for i, s := range seqs {
		g.setI(l.tokens+i, s.Tokens[0])
		g.setI(l.positions+i, int32(s.Start))
		g.setI(l.slots+i, s.Slots[s.Start])
		for j, sl := range s.Slots {
			g.setI(l.kvidx+kv+j, sl)
		}
		kv += len(s.Slots)
		g.setI(l.qptr+i+1, int32(i+1))
		g.setI(l.kvptr+i+1, int32(kv))
		g.setI(l.rows+i, int32(i))
		g.setI(l.topK+i, int32(s.Params.TopK))
		p := s.Params
		g.setF(l.temp+i, p.Temperature)
		g.setF(l.topP+i, p.TopP)
		g.setF(l.minP+i, p.MinP)
		g.setF(l.uni+i, Uniform(p.Seed, s.Draw))
	}
	g.packPadding(len(seqs), b, r.Model.PadSlot())
	if err := g.upload(l.kvidx + kv); err != nil {
		return nil, err
	}
	if err := g.graphs[b].Replay(); err != nil {
		return nil, err
	}
	// One copy back: ids and logprobs sit next to each other.
	out := make([]int32, 2*g.maxB)
	if err := g.dev.DownloadI32(g.i32(l.outIDs, 2*g.maxB), out); err != nil {
		return nil, err
	}
	res := make([]SeqResult, len(seqs))
	for i := range res {
		res[i] = SeqResult{Token: out[i], Logprob: math.Float32frombits(uint32(out[g.maxB+i]))}
	}
	return res, r.dev.Sync()
}

// ReleaseGraphs destroys the captured graphs (their buffers stay allocated).
func (r *Runner) ReleaseGraphs() error {
	if r.graphs == nil {
		return nil
	}
	var firstErr error
	for _, g := range r.graphs.graphs {
		if err := g.Destroy(); err != nil && firstErr == nil {
			firstErr = err
		}
	}
	r.graphs.graphs = nil
	r.graphs = nil
	return firstErr
}

// GraphBatchSizes lists the captured sizes.
func (r *Runner) GraphBatchSizes() []int {
	if r.graphs == nil {
		return nil
	}
	return r.graphs.sizes
}
