package scheduler

import (
	"maps"
	"math"
	"strings"
	"testing"

	"ebb/ioschema"
	"ebb/runner"
	"ebb/tokenizer"
)

// TestStopRegex: a request with stop_regex ends on the first token whose
// text completes a match, bounded patterns searched in their tail and
// unbounded ones in the whole output, its finish reason naming the
// pattern (SGLang's FINISH_MATCHED_STR); stop strings keep their turn.
func TestStopRegex(t *testing.T) {
	tok, err := tokenizer.Embedded("qwen3")
	if err != nil {
		t.Fatal(err)
	}
	const text = "The answer is 42. Then we check: <answer>yes</answer> and so on, finally done."
	for _, c := range []struct {
		name     string
		stop     []string
		regex    []string
		matched  string // "" : runs to max_new_tokens
		endsWith string // the decoded output's end where it stops
	}{
		{"digits", nil, []string{`\d\d`}, `\d\d`, "42"},
		{"an unbounded span", nil, []string{`<answer>.*</answer>`}, `<answer>.*</answer>`, "</answer>"},
		{"bounded alternation", nil, []string{`(yes|no)</`}, `(yes|no)</`, "</"},
		{"the first of two", nil, []string{`finally`, `check`}, `check`, "check"},
		{"a stop string first", []string{"answer is"}, []string{`\d`}, "answer is", "answer is"},
		{"no match", nil, []string{`\d{3}`}, "", ""},
		{"anchored to the output's start", nil, []string{`^The`}, `^The`, "The"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sp := ioschema.SamplingParams{Stop: c.stop, StopRegex: c.regex, MaxNewTokens: ptr(1000), IgnoreEOS: true}
			params, err := sp.Resolve(nil)
			if err != nil {
				t.Fatal(err)
			}
			r := &request{Request: Request{Params: params}}
			var fr *ioschema.FinishReason
			for _, id := range tok.Encode(text, false) {
				r.output = append(r.output, id)
				if fr = r.checkFinish(nil, tok); fr != nil {
					break
				}
			}
			got := tok.Decode(r.output, true)
			switch {
			case c.matched == "" && fr != nil:
				t.Fatalf("stopped on %+v at %q", fr, got)
			case c.matched == "":
			case fr == nil || fr.Type != "stop" || fr.Matched != c.matched:
				t.Fatalf("finish %+v, want matched %q (output %q)", fr, c.matched, got)
			case !strings.HasSuffix(got, c.endsWith):
				t.Fatalf("stopped at %q, want it to end %q", got, c.endsWith)
			}
		})
	}
}

// TestAdjustOneEntryAToken: penalties, logit_bias and the bans before
// min_new_tokens meet in one entry a token (the penalty kernel takes a
// row's entries in parallel: two for a token raced, and a ban could be
// overwritten by the penalty of the same token).
func TestAdjustOneEntryAToken(t *testing.T) {
	const eos = 9
	sp := ioschema.SamplingParams{RepetitionPenalty: ptr(1.3), PresencePenalty: 0.5, MinNewTokens: 5,
		StopTokenIDs: []int32{4}, LogitBias: map[string]float64{"3": 2, "9": 7, "11": -1}}
	params, err := sp.Resolve(nil)
	if err != nil {
		t.Fatal(err)
	}
	r := &request{Request: Request{Params: params, InputIDs: []int32{eos, 3, 3, 5}},
		output: []int32{3, 4}, counts: map[int32]int32{3: 1, 4: 1}}
	got := map[int32]runner.LogitAdjust{}
	for _, a := range r.adjust([]int32{eos}) {
		if _, dup := got[a.Token]; dup {
			t.Fatalf("token %d has two entries", a.Token)
		}
		got[a.Token] = a
	}
	inf := float32(math.Inf(-1))
	want := map[int32]runner.LogitAdjust{
		3: {Token: 3, Count: 1, Bias: 2}, 4: {Token: 4, Count: 1, Bias: inf}, 5: {Token: 5},
		eos: {Token: eos, Bias: inf}, 11: {Token: 11, Bias: -1},
	}
	if !maps.Equal(got, want) {
		t.Fatalf("adjust: %v, want %v", got, want)
	}
}
