package scheduler

import (
	"math"
	"slices"
	"testing"

	"ebb/ioschema"
)

// TestInputTopLogprobs: with logprob_start_len and top_logprobs_num a
// request gets each prompt position's most likely tokens (SGLang's
// input_top_logprobs), across prefill chunks: in descending order, the
// prompt token's own logprob where it is among them, and, scored again
// with the token it generated appended, that token as the last position's
// best with the logprob it was generated with.
func TestInputTopLogprobs(t *testing.T) {
	const k = 3
	req := func(rid string, ids []int32) *ioschema.TokenizedGenerateReqInput {
		one, zero := 1, 0.0
		return &ioschema.TokenizedGenerateReqInput{Rid: rid, InputIDs: ids, ReturnLogprob: true, LogprobStartLen: 0,
			TopLogprobsNum: k, SamplingParams: ioschema.SamplingParams{MaxNewTokens: &one, Temperature: &zero, IgnoreEOS: true}}
	}
	for _, c := range []struct{ n, chunk int }{
		{40, 16},    // three prefill chunks
		{300, 8192}, // one step of 299 prompt rows: more than one Sample call takes (inputTopRows)
	} {
		p := prompt(9, c.n)
		a := runDet(newHarnessChunk(t, false, 4096, c.chunk), req("a", p))["a"]
		if len(a.inputTop) != k*(len(p)-1) || len(a.inputTopIDs) != len(a.inputTop) || len(a.input) != len(p) {
			t.Fatalf("%d input logprobs and %d top ones for a %d-token prompt", len(a.input), len(a.inputTop), len(p))
		}
		for pos := 1; pos < len(p); pos++ {
			ids, vals := a.inputTopIDs[k*(pos-1):k*pos], a.inputTop[k*(pos-1):k*pos]
			f := func(i int) float32 { return math.Float32frombits(vals[i]) }
			if f(0) < f(1) || f(1) < f(2) || f(0) < math.Float32frombits(a.input[pos]) {
				t.Fatalf("%d tokens, position %d: top %v (%v, %v, %v) against the token's %v", c.n, pos, ids, f(0), f(1), f(2), math.Float32frombits(a.input[pos]))
			}
			if j := slices.Index(ids, p[pos]); j >= 0 && vals[j] != a.input[pos] {
				t.Fatalf("%d tokens, position %d: token %d at %v among the top, %v as the input logprob", c.n, pos, p[pos], f(j), math.Float32frombits(a.input[pos]))
			}
		}
		b := runDet(newHarnessChunk(t, false, 4096, c.chunk), req("b", append(slices.Clone(p), a.tokens[0])))["b"]
		last := k * (len(p) - 1)
		if b.inputTopIDs[last] != a.tokens[0] || b.inputTop[last] != a.out[0] {
			t.Fatalf("%d tokens scored again: best %d at %v, generated %d at %v", c.n, b.inputTopIDs[last], math.Float32frombits(b.inputTop[last]),
				a.tokens[0], math.Float32frombits(a.out[0]))
		}
	}
}
