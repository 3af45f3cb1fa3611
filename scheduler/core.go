// Package scheduler owns the GPU side of serving: the request queue,
// continuous batching with chunked prefill, the KV pool and radix prefix
// cache, sampling through the runner, and (in the scheduler process) the
// control messages of the RL lifecycle.
package scheduler

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"

	"ebb/ioschema"
	"ebb/runner"
	"ebb/tokenizer"
)

// Options configure a Core.
type Options struct {
	MaxRunningRequests int
	ChunkedPrefillSize int
	// EOS are the model's end-of-sequence ids (config, generation config and
	// tokenizer together).
	EOS []int32
	// Tokenizer is optional; it is needed for stop strings.
	Tokenizer *tokenizer.Tokenizer
	// RandomSeed makes the draws of requests without a sampling_seed
	// reproducible (--random-seed); nil seeds from the system.
	RandomSeed *uint64
	// DisableRadixCache stops prefix sharing: a request's KV is freed when
	// it finishes and nothing is matched at admission.
	DisableRadixCache bool
	// DisableOverlap waits for each step's results before building the
	// next (--disable-overlap-schedule).
	DisableOverlap bool
	// EnableMixedChunk runs the decodes in the steps that prefill too
	// (--enable-mixed-chunk); by default a prefill step holds them back.
	EnableMixedChunk bool
	// ScheduleConservativeness scales the share of their remaining output
	// that requests which may stop early are expected to produce
	// (--schedule-conservativeness; 0 is SGLang's default, 1).
	ScheduleConservativeness float64
	// SchedulePolicy orders the waiting queue (--schedule-policy; empty is
	// fcfs).
	SchedulePolicy SchedulePolicy
}

// Core is the scheduling state machine, free of I/O: Add requests, call Step
// until Idle. Not safe for concurrent use.
type Core struct {
	opts    Options
	run     *runner.Runner
	ctxLen  int
	vocab   int
	pool    *kvPool
	cache   *RadixCache
	waiting []*request
	running []*request
	byRid   map[string]*request
	rng     *rand.Rand
	// policyRng shuffles the queue under the random policy.
	policyRng *rand.Rand
	events    []Event  // produced while scheduling, returned by the next Step
	flight    *flight  // launched, results not absorbed yet
	owners    []int32  // CheckInvariants' table of slot owners, kept between checks
	last      StepInfo // the step launched by the last Step, if launched
	launched  bool
	ratio     tokenRatio // admission's expectation of early stops (admission.go)
	// holdWaiting: no queued request is admitted (a weight update waits
	// for the running ones).
	holdWaiting bool
	Stats       Stats
}

// Stats are cumulative counters for metrics and logs.
type Stats struct {
	PromptTokens    int64
	CachedTokens    int64
	GeneratedTokens int64
	Steps           int64
	Retractions     int64
	// RetractedInputTokens and RetractedOutputTokens are the prompt and
	// output lengths of the requests retracted (SGLang's counters).
	RetractedInputTokens  int64
	RetractedOutputTokens int64
	// RecomputedTokens were computed again after a retraction: tokens a
	// request had computed and did not find in the radix cache on return.
	RecomputedTokens int64
	Overlapped       int64 // steps launched before the previous one's results were in
	Finished         int64
}

// NewCore starts a scheduler over a runner whose model has a KV cache.
func NewCore(run *runner.Runner, opts Options) (*Core, error) {
	slots := run.Model.KVSlots()
	if slots == 0 {
		return nil, errors.New("scheduler: the model has no KV cache")
	}
	lim := run.Limits()
	if opts.MaxRunningRequests <= 0 || opts.MaxRunningRequests > lim.MaxSeqs {
		opts.MaxRunningRequests = lim.MaxSeqs
	}
	if opts.ChunkedPrefillSize <= 0 || opts.ChunkedPrefillSize+opts.MaxRunningRequests > lim.MaxTokens {
		opts.ChunkedPrefillSize = max(1, lim.MaxTokens-opts.MaxRunningRequests)
	}
	policy, err := ParseSchedulePolicy(string(opts.SchedulePolicy))
	if err != nil {
		return nil, fmt.Errorf("scheduler: %w", err)
	}
	opts.SchedulePolicy = policy
	// An end id outside the vocabulary (a config shared by model sizes) can
	// never be sampled; banning it would index past the logits.
	vocab := run.Model.Config.Vocab
	opts.EOS = slices.DeleteFunc(slices.Clone(opts.EOS), func(t int32) bool { return t < 0 || int(t) >= vocab })
	seed1, seed2 := rand.Uint64(), rand.Uint64()
	if opts.RandomSeed != nil {
		seed1, seed2 = *opts.RandomSeed, *opts.RandomSeed^0x9e3779b97f4a7c15
	}
	return &Core{
		opts: opts, run: run, ctxLen: run.Model.ContextLen(), vocab: run.Model.Config.Vocab,
		pool: newKVPool(slots), cache: NewRadixCache(), byRid: map[string]*request{},
		rng: rand.New(rand.NewPCG(seed1, seed2)), policyRng: policyRand(seed1, seed2), ratio: newTokenRatio(opts.ScheduleConservativeness),
	}, nil
}

// Options returns the effective options.
func (c *Core) Options() Options { return c.opts }

// Idle reports whether no request is queued or running.
func (c *Core) Idle() bool {
	return len(c.waiting) == 0 && len(c.running) == 0 && c.flight == nil && len(c.events) == 0
}

// HoldWaiting stops (true) or resumes admitting queued requests: the
// running ones go on to their end.
func (c *Core) HoldWaiting(hold bool) { c.holdWaiting = hold }

// Counts reports queued and running requests.
func (c *Core) Counts() (waiting, running int) { return len(c.waiting), len(c.running) }

// Add queues a request after validating it against the model.
func (c *Core) Add(req Request) error {
	if req.Rid == "" {
		return errors.New("request has no rid")
	}
	if _, dup := c.byRid[req.Rid]; dup {
		return fmt.Errorf("request %q is already running", req.Rid)
	}
	n := len(req.InputIDs)
	if n == 0 {
		return errors.New("the input is empty")
	}
	if n >= c.ctxLen {
		return fmt.Errorf("the input (%d tokens) is longer than the model's context length (%d tokens)", n, c.ctxLen)
	}
	if n+1 > c.pool.total {
		return fmt.Errorf("the input (%d tokens) does not fit in the KV cache (%d tokens)", n, c.pool.total)
	}
	for _, t := range req.InputIDs {
		if t < 0 || int(t) >= c.vocab {
			return fmt.Errorf("token id %d is outside the vocabulary (size %d)", t, c.vocab)
		}
	}
	for _, t := range req.Params.StopTokenIDs {
		if t < 0 || int(t) >= c.vocab {
			return fmt.Errorf("stop_token_ids: %d is outside the vocabulary (size %d)", t, c.vocab)
		}
	}
	for _, b := range req.Params.LogitBias {
		if int(b.Token) >= c.vocab {
			return fmt.Errorf("logit_bias: token id %d is outside the vocabulary (size %d)", b.Token, c.vocab)
		}
	}
	if req.ReturnRoutedExperts && !c.run.RoutedExpertsEnabled() {
		return errors.New("return_routed_experts needs a mixture-of-experts model served with --enable-return-routed-experts")
	}
	if req.TopLogprobsNum < 0 || req.TopLogprobsNum > c.run.Limits().MaxTopK {
		return fmt.Errorf("top_logprobs_num must be in [0, %d], got %d", c.run.Limits().MaxTopK, req.TopLogprobsNum)
	}
	// As SGLang: the output may not run past the context.
	req.Params.MaxNewTokens = min(req.Params.MaxNewTokens, c.ctxLen-n)
	r := &request{Request: req, counts: map[int32]int32{}}
	if req.Params.Seed != nil {
		r.seed = *req.Params.Seed
	} else {
		r.seed = c.rng.Uint64()
	}
	c.byRid[req.Rid] = r
	c.waiting = append(c.waiting, r)
	return nil
}

// Step runs one forward pass over a batch chosen from the running and
// waiting requests and returns what each request produced. With nothing to
// do it returns nil.
func (c *Core) Step() ([]Event, error) {
	c.launched = false
	if c.flight != nil {
		next := c.follow()
		landed, err := c.land()
		if next != nil || err != nil {
			c.flight = next
			return append(c.takeEvents(), landed...), err
		}
		c.events = append(c.events, landed...)
	}
	batch, chunks := c.schedule()
	early := c.takeEvents()
	if len(batch) == 0 {
		if len(early) > 0 {
			return early, nil
		}
		if len(c.waiting) > 0 && len(c.running) == 0 && !c.holdWaiting {
			// Nothing runs and the head of the queue cannot be admitted: it
			// can never fit, so fail it rather than wait forever.
			r := c.waiting[0]
			c.waiting = c.waiting[1:]
			delete(c.byRid, r.Rid)
			return []Event{c.finishEvent(r, ioschema.FinishAbort("the request does not fit in the KV cache"))}, nil
		}
		return nil, nil
	}
	f := &flight{batch: batch, steps: make([]runner.SeqStep, len(batch)), epochs: make([]int, len(batch))}
	for i, r := range batch {
		f.steps[i] = c.seqStep(r, chunks[i])
		f.epochs[i] = r.epoch
	}
	graphs := c.run.Stats.GraphSteps
	p, err := c.run.Launch(f.steps)
	if err != nil {
		// The step did not run; give the new slots back and fail the batch
		// so nothing is left half-done.
		events := early
		for i, r := range batch {
			c.pool.release(r.slots[len(r.slots)-chunks[i]:])
			r.slots = r.slots[:len(r.slots)-chunks[i]]
			events = append(events, c.finish(r, ioschema.FinishAbort("internal error: "+err.Error())))
		}
		return events, fmt.Errorf("forward step: %w", err)
	}
	c.Stats.Steps++
	c.last.Graph, c.launched = c.run.Stats.GraphSteps != graphs, true
	for _, r := range batch {
		r.ahead++
	}
	f.pending = p
	c.flight = f
	if !c.opts.DisableOverlap {
		return early, nil // landed by the next Step, after it launches its own
	}
	landed, err := c.land()
	return append(early, landed...), err
}

// schedule picks this step's requests and how many tokens each processes,
// allocating their KV slots. As SGLang by default, a step either prefills
// or decodes: while prompt tokens can run, the decodes wait. With mixed
// chunks the decodes run in every step and count against the chunk budget.
func (c *Core) schedule() ([]*request, []int) {
	decodes := 0
	for _, r := range c.running {
		if !r.inPrefill() {
			decodes++
		}
	}
	c.last = StepInfo{}
	if !c.opts.EnableMixedChunk {
		if batch, chunks := c.schedulePrefill(nil, nil, decodes, c.opts.ChunkedPrefillSize); len(batch) > 0 {
			return batch, chunks
		}
		return c.scheduleDecodes(decodes)
	}
	batch, chunks := c.scheduleDecodes(decodes)
	return c.schedulePrefill(batch, chunks, len(batch), c.opts.ChunkedPrefillSize-len(batch))
}

// scheduleDecodes gives every running request past its prompt one slot,
// retracting some (retractForDecodes) where the pool cannot hold a step of
// each.
func (c *Core) scheduleDecodes(decodes int) ([]*request, []int) {
	var batch []*request
	var chunks []int
	if decodes > 0 && !c.ensureFree(decodes) {
		decodes -= c.retractForDecodes()
		c.ensureFree(decodes)
	} else if decodes > 0 {
		c.ratio.step()
	}
	for _, r := range append([]*request(nil), c.running...) {
		if r.inPrefill() {
			continue
		}
		slots, ok := c.pool.alloc(1)
		if !ok {
			// Only when one request alone fills the cache: it cannot grow.
			c.events = append(c.events, c.finish(r, ioschema.FinishAbort("the KV cache is full")))
			continue
		}
		r.slots = append(r.slots, slots...)
		batch, chunks = append(batch, r), append(chunks, 1)
	}
	// Longest context first: the decode attention launches its blocks in
	// batch order, so the long ones start first and short ones fill in at
	// the end rather than a long one finishing alone.
	slices.SortStableFunc(batch, func(a, b *request) int { return len(b.slots) - len(a.slots) })
	c.last.Decodes = len(batch)
	return batch, chunks
}

// schedulePrefill appends prompt chunks to batch within budget tokens:
// unfinished prompts first, then new requests in order, admitted only
// where the cache holds what they and the running requests are expected to
// hold at once (mayAdmit) and a step of each of the decodes; those that
// wait for a prompt they share (awaitsShared) are passed over.
func (c *Core) schedulePrefill(batch []*request, chunks []int, decodes, budget int) ([]*request, []int) {
	rows := len(batch)
	lim := c.run.Limits()
	for _, r := range c.running {
		if budget <= 0 || !r.inPrefill() {
			continue
		}
		n := c.chunkSize(r, budget, lim.MaxLogitRows-rows)
		if n == 0 || !c.ensureFree(n) {
			break
		}
		c.countRecomputed(r, n)
		c.grow(r, n)
		batch, chunks = append(batch, r), append(chunks, n)
		budget -= n
		rows += c.rowsFor(r, n)
		c.last.NewSeqs++
		c.last.NewTokens += n
	}
	if !c.holdWaiting && budget > 0 {
		c.orderWaiting()
	}
	var plan *kvPlan
	next, waits := 0, 0 // the queue's next request; those passed over, waiting for a prompt they share
	for !c.holdWaiting && budget > 0 && next < len(c.waiting) && len(c.running) < c.opts.MaxRunningRequests && len(batch) < lim.MaxSeqs {
		if plan == nil {
			plan = c.kvPlan()
		}
		r := c.waiting[next]
		c.admit(r)
		if c.awaitsShared(r) {
			c.unadmit(r)
			if waits++; waits == maxSharedWaits {
				break
			}
			next++
			continue
		}
		n := c.chunkSize(r, budget, lim.MaxLogitRows-rows)
		if n == 0 || !c.mayAdmit(plan, r) || !c.ensureFree(n+decodes) {
			c.unadmit(r)
			break
		}
		plan.add(c, r)
		c.waiting = slices.Delete(c.waiting, next, next+1)
		c.running = append(c.running, r)
		c.started(r)
		c.countRecomputed(r, n)
		c.grow(r, n)
		batch, chunks = append(batch, r), append(chunks, n)
		budget -= n
		rows += c.rowsFor(r, n)
		c.last.NewSeqs++
		c.last.NewTokens += n
		c.last.CachedTokens += r.nodeTokens
	}
	return batch, chunks
}

// chunkSize is how many of r's pending tokens fit the budget and logit rows.
func (c *Core) chunkSize(r *request, budget, rowsLeft int) int {
	n := min(r.pending(), budget)
	if r.wantsInputLogprobs() {
		n = min(n, rowsLeft-1) // one row per token plus the sample row
	}
	return max(n, 0)
}

func (c *Core) rowsFor(r *request, n int) int {
	if r.wantsInputLogprobs() {
		return n
	}
	if n == r.pending() {
		return 1
	}
	return 0
}

func (c *Core) grow(r *request, n int) {
	slots, _ := c.pool.alloc(n)
	r.slots = append(r.slots, slots...)
}

// ensureFree makes n slots free, evicting cached prefixes if needed.
func (c *Core) ensureFree(n int) bool {
	if short := n - c.pool.available(); short > 0 {
		c.cache.Evict(short, c.pool.release)
	}
	return c.pool.available() >= n
}

// admit reuses the longest cached prefix of r's tokens.
func (c *Core) admit(r *request) {
	var slots []int32
	var node *radixNode
	if !c.opts.DisableRadixCache {
		slots, node = c.cache.Match(r.tokens()[:r.matchLimit()])
		c.cache.Lock(node)
	}
	r.node, r.nodeTokens = node, len(slots)
	r.slots = append([]int32(nil), slots...)
	r.recompute = max(r.computed-len(slots), 0)
}

// matchLimit is how many of r's tokens may come from the cache: all but
// the last, which must run to produce logits, and none from the first
// whose input logprob r asks for.
func (r *request) matchLimit() int {
	limit := r.numTokens() - 1
	if r.wantsInputLogprobs() {
		limit = min(limit, max(r.LogprobStartLen-1, 0))
	}
	return limit
}

// started counts r's prompt and what it found cached when it first runs.
func (c *Core) started(r *request) {
	if !r.admitted {
		r.admitted = true
		r.cached = r.nodeTokens
		c.Stats.CachedTokens += int64(r.nodeTokens)
		c.Stats.PromptTokens += int64(len(r.InputIDs))
	}
}

func (c *Core) unadmit(r *request) {
	if r.node != nil {
		c.cache.Unlock(r.node)
	}
	r.node, r.nodeTokens, r.slots = nil, 0, nil
}

// Retract moves every running request back to the queue (pause with mode
// retract); their KV stays in the cache until it is flushed or evicted.
func (c *Core) Retract() int {
	_ = c.settleInto() // a failed step has already failed its requests
	n := len(c.running)
	for i := n - 1; i >= 0; i-- {
		c.retract(c.running[i])
	}
	return n
}

// release hands r's KV to the radix cache and unlocks its prefix.
func (c *Core) release(r *request) {
	// A step launched blind past r's end holds one slot for a token r will
	// never have; the slots of tokens whose KV is still being written may be
	// shared, as any reader runs after that step on the device.
	fill := min(len(r.slots), r.numTokens())
	c.pool.release(r.slots[fill:])
	r.slots = r.slots[:fill]
	r.epoch++
	r.ahead = 0
	if c.opts.DisableRadixCache {
		c.pool.release(r.slots)
		fill = 0
	}
	if fill > 0 {
		matched := c.cache.Insert(r.tokens()[:fill], r.slots)
		if matched > r.nodeTokens {
			c.pool.release(r.slots[r.nodeTokens:matched])
		}
	}
	if r.node != nil {
		c.cache.Unlock(r.node)
	}
	r.node, r.nodeTokens, r.slots = nil, 0, nil
}

// cacheUnfinished shares r's computed prompt KV with later requests while r
// keeps running: its slots become the cache's, locked by r.
func (c *Core) cacheUnfinished(r *request) {
	if c.opts.DisableRadixCache {
		return
	}
	fill := len(r.slots)
	toks := r.tokens()[:fill]
	matched := c.cache.Insert(toks, r.slots)
	if matched > r.nodeTokens {
		c.pool.release(r.slots[r.nodeTokens:matched])
	}
	slots, node := c.cache.Match(toks)
	c.cache.Lock(node)
	if r.node != nil {
		c.cache.Unlock(r.node)
	}
	r.slots = append(r.slots[:0], slots...)
	r.node, r.nodeTokens = node, fill
}

func (c *Core) seqStep(r *request, n int) runner.SeqStep {
	start := len(r.slots) - n
	s := runner.SeqStep{
		Tokens: r.tokenRange(start, start+n), Start: start, Slots: r.slots,
		Sample: start+n == r.numTokens(), Params: r.sampleParams(), Draw: len(r.output),
	}
	if s.Sample {
		s.Adjust = r.adjust(c.opts.EOS)
	}
	if r.wantsInputLogprobs() {
		s.NextTokens, s.InputTopK = make([]int32, n), r.TopLogprobsNum
		first := max(r.LogprobStartLen, 1)
		for j := range s.NextTokens {
			s.NextTokens[j] = -1
			if next := start + j + 1; next >= first && next < len(r.InputIDs) {
				s.NextTokens[j] = r.InputIDs[next]
			}
		}
	}
	return s
}

// absorb records a step's result for r and reports an event when there is
// something to tell.
func (c *Core) absorb(r *request, s runner.SeqStep, res runner.SeqResult) (Event, bool) {
	if s.NextTokens != nil {
		if r.inputLP == nil {
			r.inputLP = make([]float32, len(r.InputIDs))
			for i := range r.inputLP {
				r.inputLP[i] = float32(math.NaN())
			}
		}
		for j, v := range res.InputLogprobs {
			if s.NextTokens[j] >= 0 {
				r.inputLP[s.Start+j+1] = v
			}
		}
		if res.InputTopIDs != nil && r.inputTopIDs == nil {
			r.inputTopIDs, r.inputTopLP = make([][]int32, len(r.InputIDs)), make([][]float32, len(r.InputIDs))
		}
		for j, ids := range res.InputTopIDs {
			if s.NextTokens[j] >= 0 {
				r.inputTopIDs[s.Start+j+1], r.inputTopLP[s.Start+j+1] = ids, res.InputTopLogprobs[j]
			}
		}
	}
	promptDone := len(r.output) == 0 && s.Sample
	if len(r.output) == 0 {
		c.cacheUnfinished(r)
	}
	if !s.Sample {
		return Event{}, false
	}
	ev := Event{Rid: r.Rid}
	if promptDone && r.ReturnLogprob && r.LogprobStartLen >= 0 && r.LogprobStartLen < len(r.InputIDs) && !r.inputDone {
		r.inputDone = true
		ev.InputLogprobs = r.inputLP[r.LogprobStartLen:]
		ev.InputTokenIDs = r.InputIDs[r.LogprobStartLen:]
		if r.inputTopIDs != nil {
			ev.InputTopIDs, ev.InputTopLogprobs = r.inputTopIDs[r.LogprobStartLen:], r.inputTopLP[r.LogprobStartLen:]
		}
	}
	if promptDone && r.Params.MaxNewTokens == 0 {
		return c.finishWith(r, ev, ioschema.FinishLength(0)), true
	}
	r.output = append(r.output, res.Token)
	r.counts[res.Token]++
	c.Stats.GeneratedTokens++
	ev.NewTokens = []int32{res.Token}
	if r.ReturnLogprob {
		ev.OutputLogprobs = []float32{res.Logprob}
		if r.TopLogprobsNum > 0 {
			ev.OutputTopIDs = [][]int32{res.TopIDs}
			ev.OutputTopLogprobs = [][]float32{res.TopLogprobs}
		}
	}
	if fr := r.checkFinish(c.opts.EOS, c.opts.Tokenizer); fr != nil {
		return c.finishWith(r, ev, fr), true
	}
	c.fillCounts(r, &ev)
	return ev, true
}

func (c *Core) fillCounts(r *request, ev *Event) {
	ev.PromptTokens, ev.CompletionTokens, ev.CachedTokens = len(r.InputIDs), len(r.output), r.cached
}

func (c *Core) finishWith(r *request, ev Event, fr *ioschema.FinishReason) Event {
	fin := c.finish(r, fr)
	fin.NewTokens, fin.OutputLogprobs = ev.NewTokens, ev.OutputLogprobs
	fin.OutputTopIDs, fin.OutputTopLogprobs = ev.OutputTopIDs, ev.OutputTopLogprobs
	fin.InputLogprobs, fin.InputTokenIDs = ev.InputLogprobs, ev.InputTokenIDs
	fin.InputTopIDs, fin.InputTopLogprobs = ev.InputTopIDs, ev.InputTopLogprobs
	return fin
}

// finish ends a running request and frees what it holds.
func (c *Core) finish(r *request, fr *ioschema.FinishReason) Event {
	var routed []int32
	if r.ReturnRoutedExperts {
		// Every token but the last has been through the model (SGLang
		// reports the same seqlen - 1); an aborted one, those computed.
		routed = c.run.RoutedExperts(r.slots[:max(min(len(r.slots), r.numTokens()-1), 0)])
	}
	c.release(r)
	for i, x := range c.running {
		if x == r {
			c.running = append(c.running[:i], c.running[i+1:]...)
			break
		}
	}
	delete(c.byRid, r.Rid)
	c.Stats.Finished++
	ev := c.finishEvent(r, fr)
	ev.RoutedExperts = routed
	return ev
}

func (c *Core) finishEvent(r *request, fr *ioschema.FinishReason) Event {
	ev := Event{Rid: r.Rid, Finished: true, FinishReason: fr}
	c.fillCounts(r, &ev)
	return ev
}

// Abort finishes every request whose rid starts with prefix (all when
// all is set) with finish_reason abort, returning their final events.
func (c *Core) Abort(prefix string, all bool, message string) []Event {
	events, _ := c.Settle()
	match := func(r *request) bool { return all || (prefix != "" && strings.HasPrefix(r.Rid, prefix)) }
	kept := c.waiting[:0]
	for _, r := range c.waiting {
		if match(r) {
			if r.node != nil {
				c.unadmit(r)
			}
			delete(c.byRid, r.Rid)
			events = append(events, c.finishEvent(r, ioschema.FinishAbort(message)))
		} else {
			kept = append(kept, r)
		}
	}
	c.waiting = kept
	for _, r := range append([]*request(nil), c.running...) {
		if match(r) {
			events = append(events, c.finish(r, ioschema.FinishAbort(message)))
		}
	}
	return events
}

// FlushCache drops the radix cache; it refuses while requests hold cached KV.
func (c *Core) FlushCache() error {
	_ = c.settleInto()
	if len(c.running) > 0 {
		return fmt.Errorf("%d requests are running", len(c.running))
	}
	return c.cache.Reset(c.pool.release)
}

// KVUsage reports slots: total, free, cached in the radix tree, held privately by requests.
func (c *Core) KVUsage() (total, free, cached, private int) {
	for _, r := range c.running {
		private += len(r.slots) - r.nodeTokens
	}
	return c.pool.total, c.pool.available(), c.cache.Size(), private
}

// Slot owners in CheckInvariants' table; running request i is i+1.
const (
	ownerFree   = -1
	ownerCached = -2
)

// CheckInvariants verifies that every KV slot is accounted for exactly once:
// free + cached + held by requests = total.
func (c *Core) CheckInvariants() error {
	if err := c.cache.check(); err != nil {
		return err
	}
	total, free, cached, private := c.KVUsage()
	if free+cached+private != total {
		return fmt.Errorf("KV slots: free %d + cached %d + in use %d != total %d", free, cached, private, total)
	}
	// Every slot has at most one owner. A flat table rather than a map:
	// an H200's pool holds millions of slots, and this runs every idle
	// second, ahead of whatever request arrives next.
	if len(c.owners) != total {
		c.owners = make([]int32, total)
	}
	clear(c.owners)
	name := func(o int32) string {
		switch {
		case o == ownerFree:
			return "free"
		case o == ownerCached:
			return "cached"
		}
		return "held by " + c.running[o-1].Rid
	}
	claim := func(s, who int32) error {
		if s < 0 || int(s) >= total {
			return fmt.Errorf("KV slot %d (%s) outside [0,%d)", s, name(who), total)
		}
		if prev := c.owners[s]; prev != 0 {
			return fmt.Errorf("KV slot %d is both %s and %s", s, name(prev), name(who))
		}
		c.owners[s] = who
		return nil
	}
	for _, s := range c.pool.free {
		if err := claim(s, ownerFree); err != nil {
			return err
		}
	}
	var err error
	c.cache.walk(func(n *radixNode) {
		for _, s := range n.slots {
			if err == nil {
				err = claim(s, ownerCached)
			}
		}
	})
	if err != nil {
		return err
	}
	for i, r := range c.running {
		for _, s := range r.slots[r.nodeTokens:] {
			if err := claim(s, int32(i+1)); err != nil {
				return err
			}
		}
	}
	if c.cache.protected > 0 && len(c.running) == 0 {
		return fmt.Errorf("%d cached slots are locked with no request running", c.cache.protected)
	}
	return nil
}
