package runner

import (
	"fmt"
	"math"
	"sort"
	"unsafe"

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
	dev    device.Device
	sizes  []int
	graphs map[int]device.Graph
	// short holds, for the sizes where the device's decode kernels differ
	// at short contexts (device.ContextDecoder), steps whose contexts are
	// all within the graph's bound.
	short   map[int]shortGraph
	maxB    int
	kvCap   int
	l       staticLayout
	buf     device.Tensor // static inputs and outputs, 4-byte words
	scratch device.Tensor // static activations, shared by every graph
	// Two sets of host staging (page-locked when the device offers it), so
	// that the next step is packed while the last one's copy may still be
	// queued; users[i] is the step that last used set i.
	host  [2][]byte
	outs  [2][]int32 // outputs copied back: ids, then logprobs, maxB each
	users [2]*Pending
	// Routing replay: the graphs' routing [sparse layers][b][k], and its
	// two host copies.
	routed    device.Tensor
	routedOut [2][]int32
	cur       int
	words     []int32 // host[cur] as 4-byte words (little-endian, as the device reads them)
}

// staticLayout places every field at a fixed word offset for the largest
// batch. A step uploads the prefix up to its last KV index; the outputs
// come after the KV indices, so that upload never overwrites the previous
// step's sampled ids, which the next step may read (src).
type staticLayout struct {
	tokens, src, positions, slots, qptr, kvptr, rows, topK, keys int // int32 fields
	temp, topP, minP                                             int // float32 fields
	kvidx                                                        int
	outIDs, outLp                                                int // outputs, adjacent
	words                                                        int
}

func newStaticLayout(maxB, kvCap int) staticLayout {
	var l staticLayout
	n := 0
	next := func(size int) int { off := n; n += size; return off }
	l.tokens, l.src, l.positions, l.slots = next(maxB), next(maxB), next(maxB), next(maxB)
	l.qptr, l.kvptr, l.rows, l.topK, l.keys = next(maxB+1), next(maxB+1), next(maxB), next(maxB), next(2*maxB)
	l.temp, l.topP, l.minP = next(maxB), next(maxB), next(maxB)
	l.kvidx = next(kvCap)
	l.outIDs, l.outLp = next(maxB), next(maxB)
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
	if g.scratch, err = r.dev.Alloc(memory.CUDAGraph, device.F32, int((r.Model.LogitsScratchBytes(maxB, maxB)+3)/4)); err != nil {
		return fmt.Errorf("graph activations: %w", err)
	}
	for i := range g.host {
		if g.host[i], err = hostBuffer(r.dev, 4*g.l.words); err != nil {
			return fmt.Errorf("graph staging: %w", err)
		}
		out, err := hostBuffer(r.dev, 8*maxB)
		if err != nil {
			return fmt.Errorf("graph outputs: %w", err)
		}
		g.outs[i] = unsafe.Slice((*int32)(unsafe.Pointer(&out[0])), 2*maxB)
	}
	if st := r.routed; st != nil {
		n := len(st.sparse) * maxB * st.k
		if g.routed, err = r.dev.Alloc(memory.CUDAGraph, device.I32, n); err != nil {
			return fmt.Errorf("graph routing: %w", err)
		}
		for i := range g.routedOut {
			buf, err := hostBuffer(r.dev, 4*n)
			if err != nil {
				return fmt.Errorf("graph routing staging: %w", err)
			}
			g.routedOut[i] = unsafe.Slice((*int32)(unsafe.Pointer(&buf[0])), n)
		}
	}
	g.use(0)
	g.graphs, err = r.captureSet(gc, g, sizes, func(int) int { return r.Model.ContextLen() })
	c := r.Model.Config
	if cd, ok := r.dev.(device.ContextDecoder); ok && err == nil {
		bound := func(b int) int {
			if kv := cd.ShortDecodeContext(c.Heads, c.KVHeads, c.HeadDim, b); kv < r.Model.ContextLen() {
				return kv
			}
			return 0
		}
		var short []int
		for _, b := range sizes {
			if bound(b) > 0 {
				short = append(short, b)
			}
		}
		var set map[int]device.Graph
		set, err = r.captureSet(gc, g, short, bound)
		g.short = map[int]shortGraph{}
		for b, gr := range set {
			g.short[b] = shortGraph{gr, bound(b)}
		}
	}
	r.graphs = g
	if err != nil {
		_ = r.ReleaseGraphs() // the capture's error is the one to report
		return err
	}
	return nil
}

// shortGraph is a decode step captured for contexts of at most maxKV
// positions.
type shortGraph struct {
	graph device.Graph
	maxKV int
}

// captureSet captures a decode step for each of sizes whose contexts are
// at most bound(size) positions.
func (r *Runner) captureSet(gc device.GraphCapturer, g *graphSet, sizes []int, bound func(int) int) (map[int]device.Graph, error) {
	set := map[int]device.Graph{}
	for _, b := range sizes {
		maxKV := bound(b)
		// Valid dummy inputs: every row decodes token 0 into the pad slot.
		g.packPadding(0, b, r.Model.PadSlot())
		if err := g.upload(g.l.kvidx); err != nil {
			return set, err
		}
		in, samp := g.views(b, maxKV)
		if g.routed.Valid() {
			in.Routed = g.routedView(b, r.routed)
		}
		run := func() {
			r.dev.ResolveTokens(in.Tokens, g.i32(g.l.src, b), g.i32(g.l.outIDs, g.maxB))
			logits := r.Model.ForwardLogits(in, device.NewScratch(g.scratch))
			r.dev.Sample(logits, samp)
		}
		run() // warm-up outside capture: loads kernels and cuBLAS heuristics
		if err := r.dev.Sync(); err != nil {
			return set, fmt.Errorf("graph warm-up (batch %d, contexts to %d): %w", b, maxKV, err)
		}
		gr, err := gc.CaptureGraph(run)
		if err != nil {
			return set, fmt.Errorf("capture decode graph (batch %d, contexts to %d): %w", b, maxKV, err)
		}
		set[b] = gr
	}
	return set, nil
}

// hostBuffer is page-locked memory when the device offers it.
func hostBuffer(dev device.Device, n int) ([]byte, error) {
	if p, ok := dev.(device.PinnedAllocator); ok {
		return p.AllocPinned(n)
	}
	return make([]byte, n), nil
}

// use makes staging set i current, once the step that last used it is done
// with it (its upload may still be queued otherwise).
func (g *graphSet) use(i int) {
	if u := g.users[i]; u != nil {
		_, _ = u.Wait() // its error belongs to its own caller
		g.users[i] = nil
	}
	g.cur = i
	g.words = unsafe.Slice((*int32)(unsafe.Pointer(&g.host[i][0])), g.l.words)
}

func (g *graphSet) i32(off, n int) device.Tensor {
	return device.Tensor{Ptr: g.buf.Ptr + uintptr(4*off), DType: device.I32, Shape: []int{n}}
}

func (g *graphSet) f32(off, n int) device.Tensor {
	return device.Tensor{Ptr: g.buf.Ptr + uintptr(4*off), DType: device.F32, Shape: []int{n}}
}

// routedView is the first b rows' share of the graphs' routing buffer.
func (g *graphSet) routedView(b int, st *routedStore) device.Tensor {
	return device.Tensor{Ptr: g.routed.Ptr, DType: device.I32, Shape: []int{len(st.sparse), b, st.k}}
}

func (g *graphSet) setI(off int, v int32)   { g.words[off] = v }
func (g *graphSet) setF(off int, v float32) { g.words[off] = int32(math.Float32bits(v)) }
func (g *graphSet) getI(off int) int32      { return g.words[off] }

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
		Keys: g.i32(l.keys, 2*b), IDs: g.i32(l.outIDs, b), Logprobs: g.f32(l.outLp, b),
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
		g.setI(l.src+i, -1)
		g.setI(l.positions+i, 0)
		g.setI(l.slots+i, pad)
		g.setI(l.qptr+i+1, int32(i+1))
		g.setI(l.kvptr+i+1, kvEnd)
		g.setI(l.rows+i, int32(i))
		g.setI(l.topK+i, 1)
		g.setF(l.temp+i, 0)
		g.setF(l.topP+i, 1)
		g.setF(l.minP+i, 0)
		g.setI(l.keys+2*i, 0)
		g.setI(l.keys+2*i+1, 0)
	}
}

// upload copies the first words of the staging buffer.
func (g *graphSet) upload(words int) error {
	return g.dev.Upload(g.i32(0, words), g.host[g.cur][:4*words], device.I32)
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

// pick is the graph of size b for a step whose longest context is maxKV
// positions, and whether it is the short-context one.
func (g *graphSet) pick(b, maxKV int) (device.Graph, bool) {
	if sg, ok := g.short[b]; ok && maxKV <= sg.maxKV {
		return sg.graph, true
	}
	return g.graphs[b], false
}

// launchGraph queues a decode step through the graph of size b. Rows whose
// Follows is set take their token from the previous step's outputs, still
// on the device. On a device with a stream the step's ids and logprobs come
// back asynchronously; the Pending waits for them.
func (r *Runner) launchGraph(seqs []SeqStep, b int) (*Pending, error) {
	g := r.graphs
	g.use(g.cur ^ 1)
	l := g.l
	kv, maxKV := 0, 0
	g.setI(l.qptr, 0)
	g.setI(l.kvptr, 0)
	for i, s := range seqs {
		maxKV = max(maxKV, len(s.Slots))
		g.setI(l.tokens+i, s.Tokens[0])
		g.setI(l.src+i, int32(s.Follows-1))
		g.setI(l.positions+i, int32(s.Start))
		g.setI(l.slots+i, s.Slots[s.Start])
		copy(g.words[l.kvidx+kv:], s.Slots)
		kv += len(s.Slots)
		g.setI(l.qptr+i+1, int32(i+1))
		g.setI(l.kvptr+i+1, int32(kv))
		g.setI(l.rows+i, int32(i))
		g.setI(l.topK+i, int32(s.Params.TopK))
		p := s.Params
		g.setF(l.temp+i, p.Temperature)
		g.setF(l.topP+i, p.TopP)
		g.setF(l.minP+i, p.MinP)
		k0, k1 := Key(p.Seed, s.Draw)
		g.setI(l.keys+2*i, int32(k0))
		g.setI(l.keys+2*i+1, int32(k1))
	}
	g.packPadding(len(seqs), b, r.Model.PadSlot())
	if err := g.upload(l.kvidx + kv); err != nil {
		return nil, err
	}
	gr, short := g.pick(b, maxKV)
	if short {
		r.Stats.ShortGraphSteps++
	}
	if err := gr.Replay(); err != nil {
		return nil, err
	}
	// One copy back: ids and logprobs sit next to each other.
	outs := g.i32(l.outIDs, 2*g.maxB)
	p := &Pending{n: len(seqs), graph: true, out: g.outs[g.cur], maxB: g.maxB}
	var routed device.Tensor
	if g.routed.Valid() {
		routed = g.routedView(b, r.routed)
		p.routed, p.routedB, p.store = g.routedOut[g.cur][:routed.Numel()], b, r.routed
		p.routedSlots = stepSlots(seqs)
	}
	g.users[g.cur] = p
	if st, ok := r.dev.(device.Streamer); ok {
		if err := st.DownloadAsync(outs, unsafe.Slice((*byte)(unsafe.Pointer(&p.out[0])), 4*len(p.out))); err != nil {
			return nil, err
		}
		if routed.Valid() {
			if err := st.DownloadAsync(routed, unsafe.Slice((*byte)(unsafe.Pointer(&p.routed[0])), 4*len(p.routed))); err != nil {
				return nil, err
			}
		}
		f, err := st.Fence()
		if err != nil {
			return nil, err
		}
		p.fence = f
		return p, nil
	}
	if err := g.dev.DownloadI32(outs, p.out); err != nil {
		return nil, err
	}
	if routed.Valid() {
		if err := g.dev.DownloadI32(routed, p.routed); err != nil {
			return nil, err
		}
	}
	p.res, p.err = p.decode(), r.dev.Sync()
	p.fileRouting()
	return p, nil
}

// ReleaseGraphs destroys the captured graphs (their buffers stay allocated).
func (r *Runner) ReleaseGraphs() error {
	if r.graphs == nil {
		return nil
	}
	var firstErr error
	destroy := func(g device.Graph) {
		if err := g.Destroy(); err != nil && firstErr == nil {
			firstErr = err
		}
	}
	for _, g := range r.graphs.graphs {
		destroy(g)
	}
	for _, sg := range r.graphs.short {
		destroy(sg.graph)
	}
	r.graphs.graphs, r.graphs.short = nil, nil
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
