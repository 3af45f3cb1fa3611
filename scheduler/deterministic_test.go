package scheduler

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"ebb/engine"
	"ebb/ioschema"
)

// detOutput is what a request returned: its tokens and the bits of every
// logprob (output, top and input).
type detOutput struct {
	tokens                []int32
	out, top, input       []uint32
	inputIDs, topIDsFlat  []int32
	inputTop              []uint32 // the prompt's top logprobs (a position's two best)
	inputTopIDs           []int32
	finished              bool
	promptLen, cachedToks int
}

func f32bits(v []float32) []uint32 {
	b := make([]uint32, len(v))
	for i, x := range v {
		b[i] = math.Float32bits(x)
	}
	return b
}

// detHarness is a CPU engine with --enable-deterministic-inference.
func detHarness(t *testing.T, chunk int, overlap bool) *harness {
	t.Helper()
	return newHarnessConfig(t, engine.Config{Device: "cpu", MaxRunningRequests: 32, ChunkedPrefillSize: chunk,
		MaxTotalTokens: 16384, CUDAGraphMaxBS: 8, DisableOverlap: !overlap, EnableDeterministicInference: true})
}

// detRequest asks for logprobs of everything: the prompt from position 0,
// each output token and its two best alternatives.
func detRequest(rid string, ids []int32, maxNew int, temp float64, seed uint64) *ioschema.TokenizedGenerateReqInput {
	return &ioschema.TokenizedGenerateReqInput{Rid: rid, InputIDs: ids, ReturnLogprob: true, LogprobStartLen: 0, TopLogprobsNum: 2,
		SamplingParams: ioschema.SamplingParams{MaxNewTokens: &maxNew, Temperature: &temp, SamplingSeed: &seed, IgnoreEOS: true}}
}

// runDet sends reqs (in order, all before the first step) and runs to
// idle, collecting each request's output.
func runDet(h *harness, reqs ...*ioschema.TokenizedGenerateReqInput) map[string]*detOutput {
	h.t.Helper()
	outs := map[string]*detOutput{}
	for _, r := range reqs {
		h.s.Handle(r)
		outs[r.Rid] = &detOutput{}
	}
	for i := 0; i < 1<<16 && !h.s.core.Idle(); i++ {
		if err := h.s.Step(); err != nil {
			h.t.Fatal(err)
		}
		h.collect(outs)
	}
	h.s.settle()
	h.collect(outs)
	for rid, o := range outs {
		if !o.finished {
			h.t.Fatalf("%s did not finish", rid)
		}
	}
	return outs
}

func (h *harness) collect(outs map[string]*detOutput) {
	for {
		select {
		case o := <-h.out:
			m, ok := o.msg.(*ioschema.BatchTokenIDOutput)
			if !ok {
				if e, isErr := o.msg.(*ioschema.ErrorOutput); isErr {
					h.t.Fatalf("%s: %s", e.Rid, e.Message)
				}
				continue
			}
			for i, rid := range m.Rids {
				d := outs[rid]
				if d == nil {
					continue
				}
				d.tokens = append(d.tokens, m.OutputIDs[i]...)
				d.out = append(d.out, f32bits(m.OutputTokenLogprobsVal[i])...)
				for j, top := range m.OutputTopLogprobsVal[i] {
					d.top = append(d.top, f32bits(top)...)
					d.topIDsFlat = append(d.topIDsFlat, m.OutputTopLogprobsIdx[i][j]...)
				}
				d.input = append(d.input, f32bits(m.InputTokenLogprobsVal[i])...)
				d.inputIDs = append(d.inputIDs, m.InputTokenLogprobsIdx[i]...)
				for j, top := range m.InputTopLogprobsVal[i] {
					d.inputTop = append(d.inputTop, f32bits(top)...)
					d.inputTopIDs = append(d.inputTopIDs, m.InputTopLogprobsIdx[i][j]...)
				}
				d.promptLen, d.cachedToks = m.PromptTokens[i], m.CachedTokens[i]
				d.finished = d.finished || m.FinishedReasons[i] != nil
			}
		default:
			return
		}
	}
}

// sameOutput fails unless got has want's tokens and logprob bits.
func sameOutput(t *testing.T, what string, got, want *detOutput) {
	t.Helper()
	switch {
	case !slices.Equal(got.tokens, want.tokens):
		t.Fatalf("%s: tokens %v, alone %v", what, got.tokens, want.tokens)
	case !slices.Equal(got.out, want.out):
		t.Fatalf("%s: output logprob bits %x, alone %x", what, got.out, want.out)
	case !slices.Equal(got.top, want.top) || !slices.Equal(got.topIDsFlat, want.topIDsFlat):
		t.Fatalf("%s: top logprobs differ from the request alone", what)
	case !slices.Equal(got.input, want.input) || !slices.Equal(got.inputIDs, want.inputIDs):
		t.Fatalf("%s: input logprob bits %x, alone %x", what, got.input, want.input)
	case !slices.Equal(got.inputTop, want.inputTop) || !slices.Equal(got.inputTopIDs, want.inputTopIDs):
		t.Fatalf("%s: the prompt's top logprobs differ from the request alone", what)
	}
}

// TestDeterministicInference: with --enable-deterministic-inference a
// request's tokens and logprob bits (greedy and seeded sampling) are the
// same alone and among 1, 7 and 31 others of random lengths, with and
// without its prefix cached, at chunk sizes 64 and 8192, with overlap on
// and off; and the logprob each output token got as it was generated is
// the bits a prefill of the finished sequence gives it.
func TestDeterministicInference(t *testing.T) {
	target := prompt(5, 150)
	for _, temp := range []float64{0, 1} {
		// With a cached prefix the target asks for no prompt logprobs,
		// which would need the prompt computed from position 0.
		mk := func(cached bool) *ioschema.TokenizedGenerateReqInput {
			r := detRequest("target", target, 24, temp, 11)
			if cached {
				r.LogprobStartLen = -1
			}
			return r
		}
		alone := runDet(detHarness(t, 8192, true), mk(false))["target"]
		if len(alone.tokens) != 24 || len(alone.out) != 24 || len(alone.input) != len(target) ||
			len(alone.inputTop) != 2*(len(target)-1) {
			t.Fatalf("alone: %d tokens, %d output, %d input and %d input top logprobs", len(alone.tokens), len(alone.out),
				len(alone.input), len(alone.inputTop))
		}
		aloneOut := *alone
		aloneOut.input, aloneOut.inputIDs, aloneOut.inputTop, aloneOut.inputTopIDs = nil, nil, nil, nil
		sameOutput(t, "alone without prompt logprobs", runDet(detHarness(t, 8192, true), mk(true))["target"], &aloneOut)
		rng := rand.New(rand.NewPCG(uint64(temp*10), 3))
		for _, others := range []int{1, 7, 31} {
			for _, chunk := range []int{64, 8192} {
				for _, overlap := range []bool{true, false} {
					for _, cached := range []bool{false, true} {
						what := fmt.Sprintf("temperature %v, %d others, chunk %d, overlap %v, cached prefix %v", temp, others, chunk, overlap, cached)
						h := detHarness(t, chunk, overlap)
						if cached {
							runDet(h, detRequest("warm", append(slices.Clone(target[:100]), 7, 7, 7), 3, 0, 1))
						}
						reqs := []*ioschema.TokenizedGenerateReqInput{}
						for i := 0; i < others; i++ {
							n := 5 + rng.IntN(300)
							reqs = append(reqs, detRequest(fmt.Sprintf("other-%d", i), prompt(100+i, n), 1+rng.IntN(40), float64(rng.IntN(2)), rng.Uint64()))
						}
						// The target among them, at a random place in the queue.
						at := rng.IntN(len(reqs) + 1)
						reqs = slices.Insert(reqs, at, mk(cached))
						got, want := runDet(h, reqs...)["target"], alone
						if cached {
							if got.cachedToks < 100 {
								t.Fatalf("%s: %d cached tokens", what, got.cachedToks)
							}
							want = &aloneOut
						}
						sameOutput(t, what, got, want)
					}
				}
			}
		}
		// Decode and prefill agree: the finished sequence as a prompt.
		full := append(slices.Clone(target), alone.tokens...)
		scored := runDet(detHarness(t, 64, true), detRequest("scored", full, 1, 0, 1))["scored"]
		if len(scored.input) != len(full) {
			t.Fatalf("scored %d input logprobs of %d tokens", len(scored.input), len(full))
		}
		for i, b := range alone.out {
			if scored.input[len(target)+i] != b {
				t.Fatalf("temperature %v, output token %d: decode logprob %v, prefill logprob %v", temp, i,
					math.Float32frombits(b), math.Float32frombits(scored.input[len(target)+i]))
			}
		}
	}
}
