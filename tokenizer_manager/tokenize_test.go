package tokenizermanager

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.uber.org/zap"

	"ebb/tokenizer"
)

// TestTokenizeEndpoints: /tokenize and /detokenize answer in SGLang's
// shapes (one prompt or a list), with the server's own tokenizer, and bad
// bodies get a 400 naming the problem.
func TestTokenizeEndpoints(t *testing.T) {
	tok, err := tokenizer.Embedded("qwen3")
	if err != nil {
		t.Fatal(err)
	}
	m := &Manager{ctxLen: 4096, log: zap.NewNop(), Tokenizer: tok}
	hello, rollout := tok.Encode("Hello, world", true), tok.Encode("a rollout", true)
	im, ok := tok.TokenID("<|im_end|>")
	if !ok {
		t.Fatal("qwen3's tokenizer has no <|im_end|>")
	}
	withSpecial := append(append([]int32{}, hello...), im)
	js := func(v any) string {
		b, _ := json.Marshal(v)
		return string(b)
	}
	for _, c := range []struct {
		name, handler, body string
		status              int
		want                string // the reply's JSON, or a part of the error's message
	}{
		{"one prompt", "tokenize", `{"prompt": "Hello, world"}`, 200,
			js(map[string]any{"count": len(hello), "max_model_len": 4096, "tokens": hello})},
		{"a list of prompts", "tokenize", `{"model": "m", "prompt": ["Hello, world", "a rollout"], "add_special_tokens": false}`, 200,
			js(map[string]any{"count": []int{len(hello), len(rollout)}, "max_model_len": 4096, "tokens": [][]int32{hello, rollout}})},
		{"an empty list", "tokenize", `{"prompt": []}`, 200, `{"count":[],"max_model_len":4096,"tokens":[]}`},
		{"no prompt", "tokenize", `{}`, 400, "prompt is required"},
		{"a number for a prompt", "tokenize", `{"prompt": 7}`, 400, "text must be a string or a list of strings"},
		{"not JSON", "tokenize", `{"prompt": `, 400, "invalid JSON body"},
		{"one id list", "detokenize", js(map[string]any{"tokens": withSpecial}), 200, `{"text":"Hello, world"}`},
		{"special tokens kept", "detokenize", js(map[string]any{"tokens": withSpecial, "skip_special_tokens": false}), 200,
			`{"text":"Hello, world<|im_end|>"}`},
		{"a list of id lists", "detokenize", js(map[string]any{"tokens": [][]int32{hello, rollout}}), 200,
			`{"text":["Hello, world","a rollout"]}`},
		{"no ids", "detokenize", `{"tokens": []}`, 200, `{"text":""}`},
		{"no tokens", "detokenize", `{}`, 400, "tokens is required"},
		{"an id past the vocabulary", "detokenize", `{"tokens": [1, 99999999]}`, 400, "token id 99999999 is outside the vocabulary"},
		{"a negative id", "detokenize", `{"tokens": [[1], [-3]]}`, 400, "token id -3 out of range"},
		{"a string for an id", "detokenize", `{"tokens": ["a"]}`, 400, "invalid JSON body"},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := m.tokenize
			if c.handler == "detokenize" {
				h = m.detokenize
			}
			rec := httptest.NewRecorder()
			h(rec, httptest.NewRequest(http.MethodPost, "/"+c.handler, strings.NewReader(c.body)))
			got := strings.TrimSpace(rec.Body.String())
			if rec.Code != c.status {
				t.Fatalf("status %d (%s), want %d", rec.Code, got, c.status)
			}
			if c.status == 200 && canonicalJSON(t, got) != canonicalJSON(t, c.want) || c.status != 200 && !strings.Contains(got, c.want) {
				t.Errorf("got %s, want %s", got, c.want)
			}
		})
	}
	t.Run("no tokenizer", func(t *testing.T) {
		bare := &Manager{ctxLen: 4096, log: zap.NewNop()}
		for _, h := range []http.HandlerFunc{bare.tokenize, bare.detokenize} {
			rec := httptest.NewRecorder()
			h(rec, httptest.NewRequest(http.MethodPost, "/", strings.NewReader(`{"prompt": "x", "tokens": [1]}`)))
			if rec.Code != 400 || !strings.Contains(rec.Body.String(), "no tokenizer") {
				t.Errorf("status %d: %s", rec.Code, rec.Body.String())
			}
		}
	})
}

// canonicalJSON re-encodes s, so that replies compare as values (the
// server escapes < and > where Python's JSON does not).
func canonicalJSON(t *testing.T, s string) string {
	t.Helper()
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	b, _ := json.Marshal(v)
	return string(b)
}
