package tokenizermanager

import (
	"strings"
	"testing"
)

// TestToolStream feeds replies a few bytes at a time: content must come out
// as early as it is certain, never containing any part of a call, and the
// calls whole.
func TestToolStream(t *testing.T) {
	for _, c := range []struct {
		name      string
		format    toolFormat
		reply     string
		content   string
		calls     []toolCall
		noPartial bool // content must never hold a prefix of <tool_call>
	}{
		{"tagged call after text", toolsTagged, "Sure. <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>",
			"Sure. ", []toolCall{{"f", `{"x":1}`}}, true},
		{"two tagged calls", toolsTagged, "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": {\"y\": \"z\"}}</tool_call>",
			"\n", []toolCall{{"a", "{}"}, {"b", `{"y":"z"}`}}, true},
		{"unclosed call at the end", toolsTagged, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 2}}", "", []toolCall{{"f", `{"x":2}`}}, true},
		{"text that only looks like a tag", toolsTagged, "a <tool b", "a <tool b", nil, false},
		{"malformed block stays text", toolsTagged, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", nil, false},
		{"llama json", toolsJSON, "{\"name\": \"get\", \"parameters\": {\"q\": \"x\"}}", "", []toolCall{{"get", `{"q":"x"}`}}, false},
		{"llama python tag, two calls", toolsJSON, "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"k\": 1}}",
			"", []toolCall{{"a", "{}"}, {"b", `{"k":1}`}}, false},
		{"llama plain answer", toolsJSON, "The answer is 4.", "The answer is 4.", nil, false},
		{"llama brace that is not a call", toolsJSON, "{not a call}", "{not a call}", nil, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, step := range []int{1, 3, 7, len(c.reply)} {
				s := newToolStream(c.format)
				var content strings.Builder
				var calls []toolCall
				for end := step; ; end += step {
					end = min(end, len(c.reply))
					text, got := s.Feed(c.reply[:end])
					if c.noPartial && strings.Contains(text, "<") {
						t.Fatalf("step %d: streamed %q", step, text)
					}
					content.WriteString(text)
					calls = append(calls, got...)
					if end == len(c.reply) {
						break
					}
				}
				text, got := s.Finish(c.reply)
				content.WriteString(text)
				calls = append(calls, got...)
				if content.String() != c.content || len(calls) != len(c.calls) {
					t.Fatalf("step %d: content %q calls %v, want %q %v", step, content.String(), calls, c.content, c.calls)
				}
				for i := range calls {
					if calls[i] != c.calls[i] {
						t.Fatalf("step %d: call %d is %v, want %v", step, i, calls[i], c.calls[i])
					}
				}
			}
		})
	}
}
