package scheduler

import (
	"math"
	"slices"
)

// KV pressure: which waiting request may start, and which running one to
// retract when the cache cannot hold the next decode step.
//
// A request is admitted only when the cache can hold, at every step to
// come, what it and the running requests are expected to hold then: each
// its tokens and one more a step until it finishes and gives them back. A
// request that must run to max_new_tokens (ignore_eos, no stop tokens or
// strings: what RL rollouts and benchmarks send) is expected to produce
// all of it, so such requests are never retracted. For the others the
// expectation is SGLang's new-token ratio: 0.7 of the remaining output at
// first, falling to a tenth of that as decode steps pass without trouble,
// and set back up after a retraction.

const (
	// initNewTokenRatio, minNewTokenRatioFactor and newTokenRatioDecaySteps
	// are SGLang's defaults (SGLANG_INIT_NEW_TOKEN_RATIO and its companions).
	initNewTokenRatio       = 0.7
	minNewTokenRatioFactor  = 0.14
	newTokenRatioDecaySteps = 600
	// retractDecodeSteps is how many decode steps of the requests left a
	// retraction makes room for (SGLang's retract_decode_steps).
	retractDecodeSteps = 20
)

// tokenRatio is the share of a request's remaining output that admission
// expects it to produce, where that output may end early.
type tokenRatio struct {
	value, min, decay float64
}

func newTokenRatio(conservativeness float64) tokenRatio {
	if conservativeness <= 0 {
		conservativeness = 1
	}
	init := min(initNewTokenRatio*conservativeness, 1)
	low := init * minNewTokenRatioFactor
	return tokenRatio{value: init, min: low, decay: (init - low) / newTokenRatioDecaySteps}
}

// step lowers the ratio after a decode step that needed no retraction.
func (t *tokenRatio) step() { t.value = max(t.value-t.decay, t.min) }

// runsToLength reports whether r can only finish at max_new_tokens: it
// ignores EOS and has no stop tokens or strings.
func (r *request) runsToLength() bool {
	p := r.Params
	return p.IgnoreEOS && len(p.StopTokenIDs) == 0 && len(p.Stop) == 0 || p.MinNewTokens >= p.MaxNewTokens
}

// kvFuture is what a request is expected to hold from now on: base slots
// (its tokens so far, computed or not, less cached ones that another
// request holds longer), one more each step for rest steps (all of its
// remaining output, or the ratio's share where it may end early), and then
// none: it finishes and its KV can be evicted.
type kvFuture struct{ base, rest int }

// kvPlan is the requests admission plans the KV for: the running ones
// and those admitted since the plan was made, with their rests.
type kvPlan struct {
	reqs  []*request
	rests []int
}

func (c *Core) rest(r *request) int {
	rest := max(r.Params.MaxNewTokens-len(r.output), 0)
	if !r.runsToLength() {
		rest = int(math.Ceil(float64(rest) * c.ratio.value))
	}
	return rest
}

func (c *Core) kvPlan() *kvPlan {
	p := &kvPlan{reqs: make([]*request, 0, len(c.running)+1), rests: make([]int, 0, len(c.running)+1)}
	for _, r := range c.running {
		p.add(c, r)
	}
	return p
}

// add puts admitted request r into the plan.
func (p *kvPlan) add(c *Core, r *request) {
	p.reqs, p.rests = append(p.reqs, r), append(p.rests, c.rest(r))
}

// futures are the kvFutures of p's requests and of extra (when not nil),
// by rest. A cached node that several of them hold (GRPO's samples of a
// prompt) stays as long as the last of them runs, so it counts in that
// one's base alone.
func (c *Core) futures(p *kvPlan, extra *request) []kvFuture {
	reqs, rests := p.reqs, p.rests
	if extra != nil {
		reqs, rests = append(slices.Clip(reqs), extra), append(slices.Clip(rests), c.rest(extra))
	}
	holder := map[*radixNode]int{} // the index in reqs of the one that holds it longest
	for i, r := range reqs {
		for n := r.node; n != nil && n != c.cache.root; n = n.parent {
			if h, ok := holder[n]; !ok || rests[h] < rests[i] {
				holder[n] = i
			}
		}
	}
	fs := make([]kvFuture, len(reqs))
	for i, r := range reqs {
		shared := 0
		for n := r.node; n != nil && n != c.cache.root; n = n.parent {
			if holder[n] != i {
				shared += len(n.key)
			}
		}
		fs[i] = kvFuture{base: r.numTokens() - shared, rest: rests[i]}
	}
	slices.SortFunc(fs, func(a, b kvFuture) int { return a.rest - b.rest })
	return fs
}

// peakSlots is the most KV a plan holds at once: the requests still
// running at step t hold base + t each, so the peak is at one of their
// ends. Reserving every request's whole output instead kept the cache half
// empty under rollouts of mixed lengths (H100, 512 rollouts of 1k-16k
// tokens: token usage 0.5 with requests waiting).
func peakSlots(plan []kvFuture) int {
	peak, base := 0, 0
	for k := len(plan) - 1; k >= 0; k-- {
		base += plan[k].base
		peak = max(peak, base+(len(plan)-k)*plan[k].rest)
	}
	return peak
}

// mayAdmit reports whether a waiting request (admitted, its cached prefix
// matched) fits beside the running ones (p): their KV and its own never
// exceed the cache, less a slot each for a step launched ahead. When none
// runs it is always taken, so that one that can never fit whole still
// runs as far as the cache allows.
func (c *Core) mayAdmit(p *kvPlan, r *request) bool {
	if len(c.running) == 0 {
		return true
	}
	probe := c.futures(p, r)
	return peakSlots(probe) <= c.pool.total-len(probe)
}

// A waiting request that shares more than sharedPrefixMin tokens beyond
// its cached prefix with the prompt of a running request not yet in the
// cache waits for that prompt instead of computing the tokens itself:
// GRPO's samples of a prompt sent as separate requests (verl's and slime's
// way) arrive together, and admitted in one step each would compute the
// prompt and hold its own copy of the KV. SGLang does the same under its
// lpm policy (IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD, 32). A step
// passes over at most maxSharedWaits such requests, so that a long queue
// of them costs a scan of bounded length.
const (
	sharedPrefixMin = 32
	maxSharedWaits  = 128
)

// awaitsShared reports whether r (admitted: its cached prefix matched)
// should wait for a running request's prompt, which becomes the cache's
// as each of its chunks lands (cacheUnfinished).
func (c *Core) awaitsShared(r *request) bool {
	if c.opts.DisableRadixCache {
		return false
	}
	toks := r.tokens()[:r.matchLimit()]
	want := r.nodeTokens + sharedPrefixMin + 1
	if len(toks) < want {
		return false
	}
	for _, s := range c.running {
		// s's tokens past its cached prefix are not anyone's yet, and a
		// prompt still running has no output; the tokens r would share
		// are compared from the end of what it found cached, where two
		// unrelated prompts differ soonest.
		if len(s.output) > 0 || s.nodeTokens >= want || len(s.InputIDs) < want ||
			!slices.Equal(toks[r.nodeTokens:want], s.InputIDs[r.nodeTokens:want]) ||
			!slices.Equal(toks[:r.nodeTokens], s.InputIDs[:r.nodeTokens]) {
			continue
		}
		return true
	}
	return false
}

// headBlocked reports whether the head of the queue cannot start now, so
// that a decode step may be launched ahead without waiting for the
// results that admission would need.
func (c *Core) headBlocked() bool {
	switch {
	case len(c.waiting) == 0 || len(c.running) >= c.opts.MaxRunningRequests:
		return true
	case len(c.running) == 0:
		return false
	}
	return !c.mayAdmit(c.kvPlan(), c.waiting[0])
}

// retractGain is the KV that retracting r makes evictable: the slots it
// holds alone, its own and those of cached nodes no other request locks.
// It is also what r computes again if that KV is evicted before it
// returns.
func (c *Core) retractGain(r *request) int {
	gain := len(r.slots) - r.nodeTokens
	for n := r.node; n != nil && n != c.cache.root && n.lockRef == 1; n = n.parent {
		gain += len(n.key)
	}
	return gain
}

// retractForDecodes retracts decoding requests until the cache holds
// retractDecodeSteps more steps of those left (or one remains), each time
// the one whose loss costs least: the request with the smallest gain that
// covers the shortfall alone, else the one with the largest gain. It
// returns how many it retracted and raises the token ratio as SGLang does.
func (c *Core) retractForDecodes() int {
	retracted := 0
	for {
		decoding, need := 0, 0
		for _, r := range c.running {
			if !r.inPrefill() {
				decoding++
				need += max(min(r.Params.MaxNewTokens-len(r.output), retractDecodeSteps), 1)
			}
		}
		short := need - c.pool.available() - c.cache.Evictable()
		if short <= 0 || decoding <= 1 {
			break
		}
		var victim *request
		best := 0
		for _, r := range c.running {
			if r.inPrefill() {
				continue
			}
			g := c.retractGain(r)
			switch {
			case victim == nil,
				g >= short && (best < short || g < best),
				best < short && g > best:
				victim, best = r, g
			}
		}
		c.retract(victim)
		retracted++
	}
	if retracted > 0 {
		decoded, budget := 0, 0
		for _, r := range c.running {
			decoded += len(r.output)
			budget += r.Params.MaxNewTokens
		}
		before := c.ratio.value
		c.ratio.value = min(1, float64(decoded+retractDecodeSteps*len(c.running))/float64(max(budget, 1)))
		c.last.Retracted, c.last.RatioBefore, c.last.RatioAfter = retracted, before, c.ratio.value
	}
	return retracted
}

// retract moves running request r back to the head of the queue. Its KV
// goes to the radix cache, where it stays unless the space is needed, so
// that r finds it again when it returns.
func (c *Core) retract(r *request) {
	r.computed = max(r.computed, len(r.slots))
	c.Stats.Retractions++
	c.Stats.RetractedInputTokens += int64(len(r.InputIDs))
	c.Stats.RetractedOutputTokens += int64(len(r.output))
	c.release(r)
	for i, x := range c.running {
		if x == r {
			c.running = append(c.running[:i], c.running[i+1:]...)
			break
		}
	}
	c.waiting = append([]*request{r}, c.waiting...)
}

// countRecomputed charges n tokens of r's chunk that r had computed before
// it was retracted and did not find in the cache again.
func (c *Core) countRecomputed(r *request, n int) {
	take := min(n, r.recompute)
	r.recompute -= take
	c.Stats.RecomputedTokens += int64(take)
	c.last.RecomputedTokens += take
}
