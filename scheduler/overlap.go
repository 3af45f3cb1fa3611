package scheduler

import (
	"fmt"
	"slices"

	"ebb/ioschema"
	"ebb/runner"
)

// A flight is a launched step whose results have not been absorbed yet.
// Overlapped scheduling keeps one in the air: while the device runs it, the
// next decode step is built and launched with each request's token taken
// from the flight's samples on the device (SeqStep.Follows), and only then
// are the flight's results waited for and handed out. The CPU work of a
// step (batch building, KV bookkeeping, detokenizer events) thus hides
// behind the GPU work of the next one.
type flight struct {
	batch   []*request
	steps   []runner.SeqStep
	epochs  []int // each member's epoch at launch; a changed one is stale
	pending *runner.Pending
}

// Settle waits for the step in flight, if any, and returns its events.
// Control messages call it first so that they see every request at rest.
func (c *Core) Settle() ([]Event, error) {
	events := c.takeEvents()
	if c.flight == nil {
		return events, nil
	}
	landed, err := c.land()
	return append(events, landed...), err
}

// settleInto settles and keeps the events for the next Step.
func (c *Core) settleInto() error {
	events, err := c.Settle()
	c.events = events
	return err
}

func (c *Core) takeEvents() []Event {
	ev := c.events
	c.events = nil
	return ev
}

// land waits for the flight and absorbs its results. A failed step fails
// the requests it carried; their KV from that step is not kept.
func (c *Core) land() ([]Event, error) {
	f := c.flight
	c.flight = nil
	results, err := f.pending.Wait()
	var events []Event
	for i, r := range f.batch {
		if r.epoch != f.epochs[i] {
			continue // finished or retracted since launch
		}
		r.ahead--
		if err != nil {
			keep := max(f.steps[i].Start, r.nodeTokens)
			if keep < len(r.slots) {
				c.pool.release(r.slots[keep:])
				r.slots = r.slots[:keep]
			}
			events = append(events, c.finish(r, ioschema.FinishAbort("internal error: "+err.Error())))
			continue
		}
		if ev, ok := c.absorb(r, f.steps[i], results[i]); ok {
			events = append(events, ev)
		}
	}
	if err != nil {
		return events, fmt.Errorf("forward step: %w", err)
	}
	return events, nil
}

// follow launches the decode step after the flight, before its results are
// known, when every running request is in it and can continue blind: no
// queued request could be admitted instead (headBlocked: a long rollout
// that waits for room keeps the decodes overlapped), and no logit
// adjustment depends on the token not yet seen. It returns nil when it
// does not.
func (c *Core) follow() *flight {
	f := c.flight
	if c.opts.DisableOverlap || !c.headBlocked() {
		return nil
	}
	members, need := 0, 0
	for i, r := range f.batch {
		if r.epoch != f.epochs[i] {
			continue
		}
		if !f.steps[i].Sample || len(r.output) == 0 || !r.blindFollowable() {
			return nil
		}
		members++
		if !r.lastInFlight() {
			need++
		}
	}
	if members != len(c.running) || need == 0 || !c.ensureFree(need) {
		return nil
	}
	next := &flight{}
	// Longest context first, as schedule orders decodes (the prompts that
	// finished in the flight join at its end).
	order := make([]int, 0, len(f.batch))
	for i := range f.batch {
		order = append(order, i)
	}
	slices.SortStableFunc(order, func(a, b int) int { return len(f.batch[b].slots) - len(f.batch[a].slots) })
	for _, i := range order {
		r := f.batch[i]
		if r.epoch != f.epochs[i] || r.lastInFlight() {
			continue
		}
		slots, _ := c.pool.alloc(1)
		r.slots = append(r.slots, slots...)
		next.batch = append(next.batch, r)
		next.epochs = append(next.epochs, r.epoch)
		next.steps = append(next.steps, runner.SeqStep{
			Tokens: []int32{0}, Start: len(r.slots) - 1, Slots: r.slots, Sample: true,
			Params: r.sampleParams(), Draw: len(r.output) + r.ahead, Follows: i + 1, Adjust: r.biases(),
		})
	}
	graphs := c.run.Stats.GraphSteps
	p, err := c.run.Launch(next.steps)
	if err != nil {
		// The ordinary path will build this step again and report the error.
		for _, r := range next.batch {
			c.pool.release(r.slots[len(r.slots)-1:])
			r.slots = r.slots[:len(r.slots)-1]
		}
		return nil
	}
	c.Stats.Steps++
	c.Stats.Overlapped++
	c.ratio.step()
	c.last, c.launched = StepInfo{Decodes: len(next.batch), Graph: c.run.Stats.GraphSteps != graphs}, true
	for _, r := range next.batch {
		r.ahead++
	}
	next.pending = p
	return next
}

// biases are r's logit_bias entries alone: what adjust gives a request
// that blindFollowable allows (no penalties, past min_new_tokens), whose
// counts then change nothing.
func (r *request) biases() []runner.LogitAdjust {
	var out []runner.LogitAdjust
	for _, b := range r.Params.LogitBias {
		out = append(out, runner.LogitAdjust{Token: b.Token, Bias: b.Bias})
	}
	return out
}

// blindFollowable reports whether r's next step needs no knowledge of the
// token in flight: no penalties (they count it) and no EOS ban pending.
func (r *request) blindFollowable() bool {
	p := r.Params
	return p.RepetitionPenalty == 1 && p.FrequencyPenalty == 0 && p.PresencePenalty == 0 &&
		len(r.output)+r.ahead >= p.MinNewTokens
}

// lastInFlight reports whether the token in flight is r's last by length.
func (r *request) lastInFlight() bool {
	return len(r.output)+r.ahead >= r.Params.MaxNewTokens
}
