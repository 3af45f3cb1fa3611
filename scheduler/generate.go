package scheduler

import (
	"fmt"

	"ebb/engine"
	"ebb/ioschema"
)

// Output is one request's complete result.
type Output struct {
	Rid               string
	OutputIDs         []int32
	OutputLogprobs    []float32
	OutputTopIDs      [][]int32
	OutputTopLogprobs [][]float32
	InputLogprobs     []float32
	InputTokenIDs     []int32
	InputTopIDs       [][]int32 // with top logprobs asked: each prompt position's most likely tokens
	InputTopLogprobs  [][]float32
	FinishReason      *ioschema.FinishReason
	PromptTokens      int
	CompletionTokens  int
	CachedTokens      int
	RoutedExperts     []int32 // [tokens - 1, layers, k], when asked
}

// NewCoreFor starts a scheduler core over an engine.
func NewCoreFor(e *engine.Engine) (*Core, error) {
	return NewCore(e.Runner, Options{
		MaxRunningRequests: e.Config.MaxRunningRequests,
		ChunkedPrefillSize: e.Config.ChunkedPrefillSize,
		EOS:                e.EOS,
		Tokenizer:          e.Tokenizer,
		RandomSeed:         e.Config.RandomSeed,
		DisableRadixCache:  e.Config.DisableRadixCache,
		DisableOverlap:     e.Config.DisableOverlap,
		EnableMixedChunk:   e.Config.EnableMixedChunk,

		ScheduleConservativeness: e.Config.ScheduleConservativeness,
		SchedulePolicy:           SchedulePolicy(e.Config.SchedulePolicy),
	})
}

// Generate runs requests to completion in this process (continuous batching
// as the server does it, with no I/O) and returns them in order.
func Generate(e *engine.Engine, reqs []Request) ([]Output, error) {
	core, err := NewCoreFor(e)
	if err != nil {
		return nil, err
	}
	return generateOn(core, reqs)
}

// generateOn runs requests to completion on an existing core, whose radix
// cache earlier requests may have filled.
func generateOn(core *Core, reqs []Request) ([]Output, error) {
	outs := make([]Output, len(reqs))
	index := map[string]int{}
	for i, r := range reqs {
		if _, dup := index[r.Rid]; dup {
			return nil, fmt.Errorf("duplicate rid %q", r.Rid)
		}
		index[r.Rid] = i
		outs[i].Rid = r.Rid
		if err := core.Add(r); err != nil {
			return nil, fmt.Errorf("request %q: %w", r.Rid, err)
		}
	}
	for !core.Idle() {
		events, err := core.Step()
		if err != nil {
			return nil, err
		}
		for _, ev := range events {
			o := &outs[index[ev.Rid]]
			o.OutputIDs = append(o.OutputIDs, ev.NewTokens...)
			o.OutputLogprobs = append(o.OutputLogprobs, ev.OutputLogprobs...)
			o.OutputTopIDs = append(o.OutputTopIDs, ev.OutputTopIDs...)
			o.OutputTopLogprobs = append(o.OutputTopLogprobs, ev.OutputTopLogprobs...)
			if ev.InputLogprobs != nil {
				o.InputLogprobs, o.InputTokenIDs = ev.InputLogprobs, ev.InputTokenIDs
				o.InputTopIDs, o.InputTopLogprobs = ev.InputTopIDs, ev.InputTopLogprobs
			}
			if ev.Finished {
				o.FinishReason = ev.FinishReason
				o.PromptTokens, o.CompletionTokens, o.CachedTokens = ev.PromptTokens, ev.CompletionTokens, ev.CachedTokens
				o.RoutedExperts = ev.RoutedExperts
			}
		}
	}
	return outs, core.CheckInvariants()
}
