package tokenizermanager

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// TestReasoningSplit: a reply's reasoning and answer by SGLang's rule
// (untrimmed), and a stream fed a byte at a time sends the same reasoning
// in deltas and ends with the same answer, with or without streamed
// reasoning.
func TestReasoningSplit(t *testing.T) {
	qwen3, forced, r1 := reasoningParsers["qwen3"], reasoningParsers["qwen3-thinking"], reasoningParsers["deepseek-r1"]
	for _, c := range []struct {
		name, text        string
		p                 reasoningParser
		reasoning, answer string
	}{
		{"thought then answer", "<think>\nHmm.\n</think>\n\nHi!", qwen3, "\nHmm.\n", "\n\nHi!"},
		{"no thought", "Hi there", qwen3, "", "Hi there"},
		{"stopped while thinking", "<think>\nStill going", qwen3, "\nStill going", ""},
		{"empty thought", "<think></think>Hi", qwen3, "", "Hi"},
		{"opened by the template", "Hmm.</think>Hi", forced, "Hmm.", "Hi"},
		{"a tag's bytes in the text", "a < b </thinking", qwen3, "", "a < b </thinking"},
		{"a tool call closes the thought", "<think>Check.<tool_call>{}</tool_call>", qwen3, "Check.", "<tool_call>{}</tool_call>"},
		{"not for deepseek-r1", "Check.<tool_call>{}", r1, "Check.<tool_call>{}", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, a := c.p.split(c.text)
			if r != c.reasoning || a != c.answer {
				t.Fatalf("split: %q, %q; want %q, %q", r, a, c.reasoning, c.answer)
			}
			for _, streamed := range []bool{true, false} {
				s := &reasoningStream{p: &c.p, streamReasoning: streamed}
				var got strings.Builder
				answer, chunks := "", 0
				for i := 1; i <= len(c.text); i++ {
					delta, so := s.feed(c.text[:i], i == len(c.text))
					if !strings.HasPrefix(so, answer) {
						t.Fatalf("the answer went back: %q after %q", so, answer)
					}
					if delta != "" {
						chunks++
					}
					got.WriteString(delta)
					answer = so
				}
				if got.String() != c.reasoning || answer != c.answer {
					t.Errorf("streamed %v: %q, %q", streamed, got.String(), answer)
				}
				if !streamed && chunks > 1 {
					t.Errorf("without streamed reasoning it came in %d pieces", chunks)
				}
			}
		})
	}
	if _, err := parseReasoningParser("gpt-oss"); err == nil || !strings.Contains(err.Error(), "deepseek-r1, qwen3, qwen3-thinking") {
		t.Errorf("an unknown parser: %v", err)
	}
}

// TestChatReasoningContent: with --reasoning-parser qwen3 the chat reply
// carries its thought in reasoning_content, whole and streamed, and
// separate_reasoning false leaves it in content.
func TestChatReasoningContent(t *testing.T) {
	srv := scriptedServer(t, func(c *Config) { c.ReasoningParser = "qwen3" })
	msgs := []any{map[string]any{"role": "user", "content": "Think first, then greet me."}}
	body := map[string]any{"model": "m", "messages": msgs}
	code, out := postJSON(t, srv.URL+"/v1/chat/completions", body)
	msg := out["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)
	if code != 200 || msg["reasoning_content"] != "\nThe user greets me.\n" || msg["content"] != "\n\nHello there!" {
		t.Fatalf("%d: %v", code, out)
	}
	body["separate_reasoning"] = false
	_, out = postJSON(t, srv.URL+"/v1/chat/completions", body)
	msg = out["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)
	if msg["content"] != scriptedThought || msg["reasoning_content"] != nil {
		t.Fatalf("separate_reasoning false: %v", msg)
	}
	body["separate_reasoning"], body["stream"] = true, true
	b, _ := json.Marshal(body)
	resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	var thought, content strings.Builder
	for _, line := range sseData(t, resp) {
		var chunk map[string]any
		if err := json.Unmarshal([]byte(line), &chunk); err != nil {
			t.Fatal(err)
		}
		for _, ch := range chunk["choices"].([]any) {
			delta := ch.(map[string]any)["delta"].(map[string]any)
			r, _ := delta["reasoning_content"].(string)
			c, _ := delta["content"].(string)
			thought.WriteString(r)
			content.WriteString(c)
		}
	}
	if thought.String() != "\nThe user greets me.\n" || content.String() != "\n\nHello there!" {
		t.Errorf("streamed: %q, %q", thought.String(), content.String())
	}
}
