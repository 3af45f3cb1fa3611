package tokenizermanager

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.uber.org/zap"

	"ebb/ioschema"
	"ebb/tokenizer"
)

func TestFitContext(t *testing.T) {
	const ctx = 100
	ids := func(n int) []int32 { return make([]int32, n) }
	num := func(n int) *int { return &n }
	for _, c := range []struct {
		name            string
		prompt          int
		maxNew          *int
		auto            bool
		wantErr         string
		wantIn, wantOut int // prompt tokens and max_new_tokens kept (-1: unset)
	}{
		{"fits, no max_new_tokens", 99, nil, false, "", 99, -1},
		{"fits exactly", 50, num(50), false, "", 50, 50},
		{"prompt of the whole context", 100, nil, false, "The input (100 tokens) is longer than the model's context length (100 tokens).", 0, 0},
		{"one past", 50, num(51), false, "Requested token count exceeds the model's maximum context length of 100 tokens. " +
			"You requested a total of 101 tokens: 50 tokens from the input messages and 51 tokens for the completion. " +
			"Please reduce the number of tokens in the input messages or the completion to fit within the limit.", 0, 0},
		{"no overflow", 50, num(1 << 62), false, "Requested token count exceeds", 0, 0},
		{"auto: max_new_tokens clipped", 50, num(1000000), true, "", 50, 50},
		{"auto: prompt clipped", 150, num(10), true, "", 99, 1},
		{"auto: fits as it is", 10, num(10), true, "", 10, 10},
	} {
		m := &Manager{cfg: Config{AllowAutoTruncate: c.auto}, ctxLen: ctx, log: zap.NewNop()}
		sp := ioschema.SamplingParams{MaxNewTokens: c.maxNew}
		got, err := m.fitContext(ids(c.prompt), &sp)
		if c.wantErr != "" {
			if err == nil || !strings.HasPrefix(err.Error(), c.wantErr) || !IsBadRequest(err) {
				t.Errorf("%s: %v, want a bad request %q", c.name, err, c.wantErr)
			}
			continue
		}
		out := -1
		if sp.MaxNewTokens != nil {
			out = *sp.MaxNewTokens
		}
		if err != nil || len(got) != c.wantIn || out != c.wantOut {
			t.Errorf("%s: %d tokens, max_new_tokens %d, %v; want %d and %d", c.name, len(got), out, err, c.wantIn, c.wantOut)
		}
	}
}

// TestEncodeStopsPastTheContext: a prompt far past the context is refused
// after the context's worth of tokens, or clipped to its first ones.
func TestEncodeStopsPastTheContext(t *testing.T) {
	tok, err := tokenizer.Embedded("qwen3")
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Repeat("a rollout of many tokens ", 2000)
	full := tok.Encode(text, true)
	for _, auto := range []bool{false, true} {
		m := &Manager{cfg: Config{AllowAutoTruncate: auto}, ctxLen: 100, log: zap.NewNop(), Tokenizer: tok}
		ids, err := m.encode(text, true)
		if !auto {
			if !IsBadRequest(err) || !strings.Contains(err.Error(), "is longer than the model's context length (100 tokens)") {
				t.Errorf("refused: %v", err)
			}
			continue
		}
		if err != nil || len(ids) < 100 || len(ids) > 120 || fmt.Sprint(ids) != fmt.Sprint(full[:len(ids)]) {
			t.Errorf("clipped: %d tokens (%v), want a prefix of the full %d just past 100", len(ids), err, len(full))
		}
		ids, _ = m.fitContext(ids, &ioschema.SamplingParams{})
		if len(ids) != 99 {
			t.Errorf("clipped to %d tokens, want 99", len(ids))
		}
	}
}

// TestEncodeRefusesFromLength: a text whose length alone puts it past the
// context is refused without being tokenized.
func TestEncodeRefusesFromLength(t *testing.T) {
	tok, err := tokenizer.Embedded("qwen3")
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Repeat("x", 20<<20)
	m := &Manager{ctxLen: 40960, log: zap.NewNop(), Tokenizer: tok}
	want := fmt.Sprintf("The input (at least %d tokens) is longer", tok.MinTokens(text))
	if _, err := m.encode(text, true); !IsBadRequest(err) || !strings.HasPrefix(err.Error(), want) {
		t.Errorf("got %v, want %q", err, want)
	}
}

func TestErrorStatus(t *testing.T) {
	for _, c := range []struct {
		err  error
		want int
	}{
		{badf("bad"), http.StatusBadRequest},
		{tooLargeError{1 << 20}, http.StatusRequestEntityTooLarge},
		{bodyError(&http.MaxBytesError{Limit: 1 << 20}), http.StatusRequestEntityTooLarge},
		{errShuttingDown, http.StatusServiceUnavailable},
		{fmt.Errorf("generate: %w", errShuttingDown), http.StatusServiceUnavailable},
		{context.Canceled, 499},
		{errors.New("other"), http.StatusInternalServerError},
	} {
		w := httptest.NewRecorder()
		writeError(w, c.err)
		if w.Code != c.want {
			t.Errorf("%v: %d, want %d", c.err, w.Code, c.want)
		}
	}
}

// TestLogprobStartLen: a request whose logprob_start_len is past its prompt
// is refused with SGLang's message (which aborts it) when it asks for
// logprobs; without return_logprob the field is not read, as in SGLang;
// below -1 it is refused either way.
func TestLogprobStartLen(t *testing.T) {
	num := func(n int) *int { return &n }
	for _, c := range []struct {
		name    string
		start   *int
		logprob bool
		wantErr string
	}{
		{"unset", nil, true, ""},
		{"-1: output tokens only", num(-1), true, ""},
		{"the whole prompt", num(0), true, ""},
		{"the last prompt token", num(2), true, ""},
		{"past the prompt", num(3), true, "req.logprob_start_len=3 is higher than the number of input tokens len(req.origin_input_ids)=3. Please use a smaller logprob_start_len."},
		{"past the prompt, no logprobs asked", num(3), false, ""},
		{"below -1", num(-5), false, "logprob_start_len must be -1 (output tokens only) or at least 0, got -5"},
	} {
		m := &Manager{ctxLen: 100, log: zap.NewNop()}
		in := &ioschema.GenerateReqInput{InputIDs: ioschema.InputIDBatch{Items: [][]int32{{1, 2, 3}}}, ReturnLogprob: c.logprob,
			LogprobStartLen: c.start}
		_, _, err := m.expand(in)
		if c.wantErr == "" {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
			continue
		}
		if err == nil || err.Error() != c.wantErr || !IsBadRequest(err) {
			t.Errorf("%s: %v, want a bad request %q", c.name, err, c.wantErr)
		}
	}
}

// TestBatchRids: prompts are named as SGLang names them: a list of rids one
// each; one rid for a batch of prompts rid_0, rid_1, ...; one rid for one
// prompt as it is; copies (n > 1) rid-0, rid-1, ...
func TestBatchRids(t *testing.T) {
	two := ioschema.InputIDBatch{Items: [][]int32{{1}, {2}}, Batch: true}
	one := ioschema.InputIDBatch{Items: [][]int32{{1}}}
	n := 2
	for _, c := range []struct {
		name string
		in   ioschema.GenerateReqInput
		want []string
	}{
		{"a rid each", ioschema.GenerateReqInput{InputIDs: two, Rid: ioschema.Rids{Items: []string{"a", "b"}, Batch: true}}, []string{"a", "b"}},
		{"one rid, a batch", ioschema.GenerateReqInput{InputIDs: two, Rid: ioschema.Rids{Items: []string{"x"}}}, []string{"x_0", "x_1"}},
		{"one rid, one prompt", ioschema.GenerateReqInput{InputIDs: one, Rid: ioschema.Rids{Items: []string{"x"}}}, []string{"x"}},
		{"copies", ioschema.GenerateReqInput{InputIDs: one, Rid: ioschema.Rids{Items: []string{"x"}},
			SamplingParams: ioschema.SamplingBatch{Items: []ioschema.SamplingParams{{N: &n}}}}, []string{"x-0", "x-1"}},
	} {
		m := &Manager{ctxLen: 100, log: zap.NewNop()}
		prompts, _, err := m.expand(&c.in)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		var got []string
		for _, p := range prompts {
			got = append(got, p.tokenized.Rid)
		}
		if fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("%s: rids %v, want %v", c.name, got, c.want)
		}
	}
}
