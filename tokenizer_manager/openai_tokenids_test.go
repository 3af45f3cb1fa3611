package tokenizermanager

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestReturnTokenIDs: with SGLang's return_token_ids a choice carries the
// prompt's token ids and the output's, whole or streamed; without it,
// neither. The scripted scheduler answers every request with output ids 0
// and 1 ("Hello t", "here!").
func TestReturnTokenIDs(t *testing.T) {
	srv := scriptedServer(t)
	msgs := []any{map[string]any{"role": "user", "content": "Say hello"}}
	ids := func(v any) string { return fmt.Sprint(v) }
	for _, c := range []struct {
		name, path string
		body       map[string]any
	}{
		{"completions", "/v1/completions", map[string]any{"model": "m", "prompt": "Say hello"}},
		{"chat", "/v1/chat/completions", map[string]any{"model": "m", "messages": msgs}},
	} {
		t.Run(c.name, func(t *testing.T) {
			code, out := postJSON(t, srv.URL+c.path, c.body)
			choice := out["choices"].([]any)[0].(map[string]any)
			if _, has := choice["token_ids"]; code != 200 || has {
				t.Fatalf("without return_token_ids: %d %v", code, out)
			}
			c.body["return_token_ids"] = true
			code, out = postJSON(t, srv.URL+c.path, c.body)
			if code != 200 {
				t.Fatalf("status %d: %v", code, out)
			}
			choice = out["choices"].([]any)[0].(map[string]any)
			prompt, _ := choice["prompt_token_ids"].([]any)
			usage := out["usage"].(map[string]any)
			if ids(choice["token_ids"]) != "[0 1]" || len(prompt) == 0 || float64(len(prompt)) != usage["prompt_tokens"] {
				t.Errorf("token_ids %v, %d prompt ids against %v prompt tokens", choice["token_ids"], len(prompt), usage["prompt_tokens"])
			}

			// Streamed: completions send each chunk's new ids and the
			// prompt's with the first; chat sends them whole with its finish.
			c.body["stream"] = true
			b, _ := json.Marshal(c.body)
			resp, err := http.Post(srv.URL+c.path, "application/json", strings.NewReader(string(b)))
			if err != nil {
				t.Fatal(err)
			}
			var got []any
			var streamedPrompt []any
			promptChunks := 0
			for _, line := range sseData(t, resp) {
				var chunk map[string]any
				if err := json.Unmarshal([]byte(line), &chunk); err != nil {
					t.Fatal(err)
				}
				for _, ch := range chunk["choices"].([]any) {
					ch := ch.(map[string]any)
					if p, ok := ch["prompt_token_ids"].([]any); ok {
						streamedPrompt, promptChunks = p, promptChunks+1
					}
					if tids, ok := ch["token_ids"].([]any); ok {
						got = append(got, tids...)
					}
				}
			}
			if ids(got) != "[0 1]" || promptChunks != 1 || ids(streamedPrompt) != ids(prompt) {
				t.Errorf("streamed token_ids %v, prompt ids in %d chunks (%v, whole %v)", got, promptChunks, streamedPrompt, prompt)
			}
		})
	}
}
