package scheduler

import (
	"strings"
	"testing"

	"ebb/ioschema"
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
