// Package runner executes forward steps of a model over a ragged batch of
// sequences: it packs the step into device inputs, runs the model, applies
// penalties, samples on the device and brings back only ids and logprobs.
package runner

import (
	"errors"
	"fmt"
	"math"

	"ebb/device"
	"ebb/memory"
	"ebb/model"
)

// SampleParams are one sequence's sampling settings.
type SampleParams struct {
	Temperature       float32
	TopP              float32
	TopK              int
	MinP              float32
	RepetitionPenalty float32
	FrequencyPenalty  float32
	PresencePenalty   float32
	Seed              uint64
	TopLogprobs       int // number of alternatives to return (0: none)
}

// Greedy is deterministic argmax sampling.
var Greedy = SampleParams{Temperature: 0, TopP: 1, RepetitionPenalty: 1}

// SeqStep is one sequence's share of a step.
type SeqStep struct {
	// Tokens are processed this step; Start is the position of Tokens[0].
	Tokens []int32
	Start  int
	// Slots are the KV slots of positions [0, Start+len(Tokens)).
	Slots []int32
	// Sample asks for the next token after Tokens (false for a prefill
	// chunk that is not the last one).
	Sample bool
	Params SampleParams
	// Draw is the index of the token being sampled (for seeded draws).
	Draw int
	// Adjust lists per-token logit adjustments (penalty counts and biases);
	// empty when no penalty or bias applies.
	Adjust []LogitAdjust
	// NextTokens, when set, asks for the logprob of NextTokens[i] at row i
	// of this step (teacher forcing / prompt logprobs); -1 skips a row.
	NextTokens []int32
	// InputTopK asks, with NextTokens, for the InputTopK most likely tokens
	// and their logprobs at each row not skipped (SGLang's
	// input_top_logprobs).
	InputTopK int
	// Follows, when positive, says that this sequence's one token is the
	// one sampled at row Follows-1 of the step launched just before, whose
	// result may not be back yet (overlapped scheduling); Tokens[0] is then
	// ignored.
	Follows int
}

// LogitAdjust is one token's entry for penalties and biases.
type LogitAdjust struct {
	Token int32
	Count int32   // times generated; 0 for a token seen only in the prompt
	Bias  float32 // added to the logit (-Inf bans the token)
}

// SeqResult is one sequence's outcome of a step.
type SeqResult struct {
	Token       int32
	Logprob     float32
	TopIDs      []int32
	TopLogprobs []float32
	// InputLogprobs holds the logprobs of NextTokens (NaN where skipped).
	InputLogprobs []float32
	// InputTopIDs and InputTopLogprobs hold each row's most likely tokens
	// where InputTopK asked (nil rows where skipped).
	InputTopIDs      [][]int32
	InputTopLogprobs [][]float32
}

// Limits bound a step.
type Limits struct {
	MaxTokens    int // tokens per step
	MaxSeqs      int // sequences per step
	MaxLogitRows int // rows of logits per step (samples plus prompt logprobs)
	MaxTopK      int // top logprobs per row
}

// Runner runs steps for one model. It is owned by the device goroutine.
type Runner struct {
	Model  *model.Model
	dev    device.Device
	limits Limits
	vocab  int

	host   hostStep  // reused packing buffers
	graphs *graphSet // captured decode steps, nil when eager only
	last   *Pending  // the step launched last, which Follows refers to
	routed *routedStore
	Stats  Stats
	// Mirror, when set, is given every step before it is launched: a
	// tensor-parallel leader sends it to the other ranks, which must run
	// the same steps in the same order.
	Mirror func([]SeqStep) error
}

// Pending is a launched step. On a device with a stream, a decode step
// that runs as a graph is still on its way when Launch returns.
type Pending struct {
	n     int
	graph bool
	fence device.Fence // nil once the results are in
	out   []int32      // graph steps: ids then logprobs, maxB each
	maxB  int
	res   []SeqResult
	err   error
	// A graph step's routing, filed once it is back: [sparse layers][b][k]
	// for the rows whose KV slots are routedSlots.
	routed      []int32
	routedSlots []int32
	routedB     int
	store       *routedStore
}

// Wait returns the step's results once the device has them.
func (p *Pending) Wait() ([]SeqResult, error) {
	if p.fence != nil {
		p.err = p.fence.Wait()
		p.fence = nil
		if p.err == nil {
			p.res = p.decode()
			p.fileRouting()
		}
	}
	return p.res, p.err
}

func (p *Pending) fileRouting() {
	if p.store != nil {
		p.store.scatter(p.routed, p.routedSlots, p.routedB)
		p.store = nil
	}
}

func (p *Pending) decode() []SeqResult {
	res := make([]SeqResult, p.n)
	for i := range res {
		res[i] = SeqResult{Token: p.out[i], Logprob: math.Float32frombits(uint32(p.out[p.maxB+i]))}
	}
	return res
}

// Stats count steps by path.
type Stats struct {
	GraphSteps int64
	EagerSteps int64
	// ChainedSteps took their tokens from the step before on the device,
	// without a round trip through the host.
	ChainedSteps int64
	// ShortGraphSteps are the graph steps that took the graphs of short
	// contexts (device.ContextDecoder).
	ShortGraphSteps int64
}

// weightUpdateHeadroom is workspace address space for weight updates.
const weightUpdateHeadroom = 4 << 30

// New creates a runner and plans its workspace: the region is sized for the
// largest step so that serving never grows it.
func New(m *model.Model, limits Limits) (*Runner, error) {
	if limits.MaxTokens <= 0 || limits.MaxSeqs <= 0 {
		return nil, errors.New("runner: MaxTokens and MaxSeqs must be positive")
	}
	limits.MaxLogitRows = max(limits.MaxLogitRows, limits.MaxSeqs)
	limits.MaxTopK = max(limits.MaxTopK, 1)
	r := &Runner{Model: m, dev: m.Device(), limits: limits, vocab: m.Config.Vocab}
	plan := WorkspaceBytes(m, limits)
	if r.dev.Memory().Region(memory.Workspace) == nil {
		// Address space only beyond what is mapped: the headroom takes a
		// trainer's weight buckets (a flattened broadcast lands whole in
		// scratch), given back after each update.
		if _, err := r.dev.Memory().Create(memory.Workspace, memory.RegionOptions{
			Capacity: 2*plan + weightUpdateHeadroom, GrowStep: plan,
		}); err != nil {
			return nil, fmt.Errorf("workspace region: %w", err)
		}
	}
	// Touch the planned size once so the arena holds it from the start.
	t, err := r.dev.Alloc(memory.Workspace, device.F32, int(plan/4))
	if err != nil {
		return nil, fmt.Errorf("plan workspace of %s: %w", memory.MiB(plan), err)
	}
	r.dev.Free(memory.Workspace, t)
	return r, r.dev.Sync()
}

// Limits returns the step bounds.
func (r *Runner) Limits() Limits { return r.limits }

// WorkspaceBytes is the largest step's scratch plus its packed inputs
// (limits as New normalises them).
func WorkspaceBytes(m *model.Model, l Limits) int64 {
	l.MaxLogitRows = max(l.MaxLogitRows, l.MaxSeqs)
	l.MaxTopK = max(l.MaxTopK, 1)
	scratch := m.ScratchBytes(l.MaxTokens, l.MaxLogitRows) + routedBytes(m.Config, l.MaxTokens)
	return scratch + inputBytes(l.MaxTokens, l.MaxSeqs, l.MaxTokens+l.MaxSeqs*m.ContextLen(), l.MaxLogitRows, l.MaxTopK, l.MaxTopK, 0) + 4<<20
}

// Step runs one forward over seqs and samples where asked.
func (r *Runner) Step(seqs []SeqStep) ([]SeqResult, error) {
	p, err := r.Launch(seqs)
	if err != nil {
		return nil, err
	}
	return p.Wait()
}

// Launch starts a step and returns before its results are back where the
// device allows (graph decode steps on a stream); Step is Launch then Wait.
// Sequences may follow the previous launch's samples (SeqStep.Follows):
// on the device when both steps run as graphs, else on the host after
// waiting for them.
func (r *Runner) Launch(seqs []SeqStep) (*Pending, error) {
	if err := r.check(seqs); err != nil {
		return nil, err
	}
	if r.Mirror != nil {
		if err := r.Mirror(seqs); err != nil {
			return nil, fmt.Errorf("sending the step to the other tensor-parallel ranks: %w", err)
		}
	}
	prev := r.last
	r.last = nil
	b := r.graphs.fits(seqs)
	_, streams := r.dev.(device.Streamer)
	switch {
	case !follows(seqs):
	case b == 0 || !streams || !prev.graph:
		res, err := prev.Wait()
		if err != nil {
			return nil, fmt.Errorf("the step these tokens follow: %w", err)
		}
		seqs = resolved(seqs, res)
	default:
		r.Stats.ChainedSteps++
	}
	var p *Pending
	if b > 0 {
		r.Stats.GraphSteps++
		var err error
		if p, err = r.launchGraph(seqs, b); err != nil {
			return nil, err
		}
	} else {
		r.Stats.EagerSteps++
		res, err := r.eager(seqs)
		if err != nil {
			return nil, err
		}
		p = &Pending{n: len(seqs), res: res}
	}
	r.last = p
	return p, nil
}

func follows(seqs []SeqStep) bool {
	for _, s := range seqs {
		if s.Follows > 0 {
			return true
		}
	}
	return false
}

// resolved is seqs with each follower's token taken from prev's results.
func resolved(seqs []SeqStep, prev []SeqResult) []SeqStep {
	out := append([]SeqStep(nil), seqs...)
	for i := range out {
		if f := out[i].Follows; f > 0 {
			out[i].Tokens = []int32{prev[f-1].Token}
			out[i].Follows = 0
		}
	}
	return out
}

// eager runs a step kernel by kernel and waits for its results.
func (r *Runner) eager(seqs []SeqStep) ([]SeqResult, error) {
	h := &r.host
	h.pack(seqs, r.limits.MaxTopK)
	wsBytes := r.Model.ScratchBytes(h.numTokens, h.numRows) + h.bytes()
	if r.routed != nil {
		wsBytes += routedBytes(r.Model.Config, h.numTokens)
	}
	ws, err := r.dev.Alloc(memory.Workspace, device.F32, int((wsBytes+3)/4))
	if err != nil {
		return nil, fmt.Errorf("step workspace: %w", err)
	}
	defer r.dev.Free(memory.Workspace, ws)
	s := device.NewScratch(ws)
	in, samp, pen, tl, err := h.upload(r.dev, s)
	if err != nil {
		return nil, err
	}
	in.Routed = r.routed.take(s, h.numTokens)
	logits := r.Model.Forward(in, s)
	if pen.RowPtr.Valid() {
		r.dev.ApplyPenalties(logits.Rows(0, h.numSample), pen)
	}
	if h.numSample > 0 {
		r.dev.Sample(logits.Rows(0, h.numSample), samp)
	}
	if tl.Valid() {
		r.dev.TokenLogprobs(tl, logits.Rows(h.numSample, h.numRows), h.targetsTensor)
	}
	if h.inTopK > 0 {
		r.inputTop(logits.Rows(h.numSample, h.numRows), h.inTop)
	}
	if err := r.routed.collect(r.dev, in.Routed, seqs); err != nil {
		return nil, err
	}
	return h.results(r.dev, samp, tl)
}

// inputTopRows is the most prompt rows one Sample call takes for their top
// logprobs: as many as a decode batch has, which every device's sampling
// buffers hold (deterministic sampling refuses more than its buffer).
const inputTopRows = 256

// inputTop samples the prompt-logprob rows greedily for their top
// logprobs (those of the unscaled distribution), a batch of rows at a time.
func (r *Runner) inputTop(logits device.Tensor, a device.SampleArgs) {
	rows := logits.Dim(0)
	for r0 := 0; r0 < rows; r0 += inputTopRows {
		r1 := min(rows, r0+inputTopRows)
		r.dev.Sample(logits.Rows(r0, r1), device.SampleArgs{
			Temperature: a.Temperature.Rows(r0, r1), TopP: a.TopP.Rows(r0, r1), TopK: a.TopK.Rows(r0, r1),
			MinP: a.MinP.Rows(r0, r1), Keys: a.Keys.Rows(2*r0, 2*r1), IDs: a.IDs.Rows(r0, r1),
			Logprobs: a.Logprobs.Rows(r0, r1), TopIDs: a.TopIDs.Rows(r0, r1), TopLogprobs: a.TopLogprobs.Rows(r0, r1),
		})
	}
}

// WarmUp runs one eager prefill step of each of sizes tokens (spread over
// a sixteenth as many sequences, for the sampled rows), every token
// writing the pad slot. A GPU loads a kernel on first use and cuBLAS
// picks kernels by shape: without this, a prompt of a new length could
// load one mid-run and grow the context after release_memory_occupation
// measured it.
func (r *Runner) WarmUp(sizes []int) error {
	pad := r.Model.PadSlot()
	for _, n := range sizes {
		n = min(n, r.limits.MaxTokens)
		seqs := make([]SeqStep, min(max(1, n/16), r.limits.MaxSeqs, r.limits.MaxLogitRows))
		per := min(n/len(seqs), r.Model.ContextLen())
		for i := range seqs {
			t := per
			if i == len(seqs)-1 {
				t = min(n-per*(len(seqs)-1), r.Model.ContextLen())
			}
			slots := make([]int32, t)
			for j := range slots {
				slots[j] = pad
			}
			seqs[i] = SeqStep{Tokens: make([]int32, t), Slots: slots, Sample: true, Params: Greedy}
		}
		if _, err := r.eager(seqs); err != nil {
			return fmt.Errorf("warm-up step of %d tokens: %w", n, err)
		}
	}
	return nil
}

// WarmUpSizes are the step sizes WarmUp takes for these limits: from 16
// tokens (fewer run ebb's own matmul kernels, all loaded at start) to the
// most a step holds, two sizes an octave.
func WarmUpSizes(l Limits) []int {
	var sizes []int
	for n := 16; n < l.MaxTokens; n *= 2 {
		sizes = append(sizes, n)
		if n*3/2 < l.MaxTokens {
			sizes = append(sizes, n*3/2)
		}
	}
	return append(sizes, l.MaxTokens)
}

func (r *Runner) check(seqs []SeqStep) error {
	if len(seqs) == 0 || len(seqs) > r.limits.MaxSeqs {
		return fmt.Errorf("step of %d sequences (limit %d)", len(seqs), r.limits.MaxSeqs)
	}
	tokens, rows := 0, 0
	ctx, slots := r.Model.ContextLen(), r.Model.KVSlots()
	last := 0
	if r.last != nil {
		last = r.last.n
	}
	for i, s := range seqs {
		n := len(s.Tokens)
		if s.Follows > last {
			return fmt.Errorf("sequence %d follows row %d of a step of %d", i, s.Follows-1, last)
		}
		if n == 0 {
			return fmt.Errorf("sequence %d has no tokens", i)
		}
		if len(s.Slots) != s.Start+n {
			return fmt.Errorf("sequence %d: %d slots for %d positions", i, len(s.Slots), s.Start+n)
		}
		if s.Start+n > ctx {
			return fmt.Errorf("sequence %d: %d positions exceed the context length %d", i, s.Start+n, ctx)
		}
		if s.Follows > 0 && (n != 1 || !s.Sample || s.NextTokens != nil) {
			return fmt.Errorf("sequence %d: a follower must be one sampled token", i)
		}
		for _, t := range s.Tokens {
			if s.Follows > 0 {
				break
			}
			if t < 0 || int(t) >= r.vocab {
				return fmt.Errorf("sequence %d: token id %d outside the vocabulary of %d", i, t, r.vocab)
			}
		}
		for _, sl := range s.Slots[s.Start:] {
			if sl < 0 || int(sl) >= slots {
				return fmt.Errorf("sequence %d: KV slot %d outside the cache of %d", i, sl, slots)
			}
		}
		if s.NextTokens != nil && len(s.NextTokens) != n {
			return fmt.Errorf("sequence %d: %d next tokens for %d tokens", i, len(s.NextTokens), n)
		}
		if s.Params.TopLogprobs > r.limits.MaxTopK {
			return fmt.Errorf("sequence %d: %d top logprobs (limit %d)", i, s.Params.TopLogprobs, r.limits.MaxTopK)
		}
		tokens += n
		if s.Sample {
			rows++
		}
		for _, t := range s.NextTokens {
			if t >= 0 {
				rows++
			}
		}
	}
	if tokens > r.limits.MaxTokens {
		return fmt.Errorf("step of %d tokens (limit %d)", tokens, r.limits.MaxTokens)
	}
	if rows > r.limits.MaxLogitRows {
		return fmt.Errorf("step needs %d logit rows (limit %d)", rows, r.limits.MaxLogitRows)
	}
	return nil
}
