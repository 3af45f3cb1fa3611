package tokenizermanager

import (
	"strings"
	"testing"

	"ebb/assets"
	"ebb/tokenizer"
)

func TestChatTemplatesRenderLikeTransformers(t *testing.T) {
	msgs := []ChatMessage{{Role: "system", Content: "You are helpful."}, {Role: "user", Content: []any{map[string]any{"type": "text", "text": "Hi"}}}}
	cases := []struct {
		family string
		kwargs map[string]any
		want   string
	}{
		{"qwen3", nil, "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"},
		{"qwen3", map[string]any{"enable_thinking": false}, "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"},
		{"llama3", nil, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
	}
	for _, c := range cases {
		got, err := embeddedTemplate(t, c.family).render(msgs, nil, c.kwargs)
		if err != nil {
			t.Fatal(err)
		}
		if got != c.want {
			t.Errorf("%s %v:\n got %q\nwant %q", c.family, c.kwargs, got, c.want)
		}
	}
}

// TestChatRoles: roles are taken in any case, as SGLang takes them, and a
// role its chat endpoint does not know is an error naming the ones it does.
func TestChatRoles(t *testing.T) {
	tpl := embeddedTemplate(t, "qwen3")
	for _, c := range []struct {
		role, wantErr string
	}{
		{"user", ""},
		{"USER", ""},
		{"System", ""},
		{"wizard", `message 0: 'role' must be one of system, developer, user, assistant, tool, function (case-insensitive), got "wizard"`},
		{"", "message 0 has no role"},
	} {
		got, err := tpl.render([]ChatMessage{{Role: c.role, Content: "Hi"}}, nil, nil)
		if c.wantErr != "" {
			if err == nil || err.Error() != c.wantErr {
				t.Errorf("role %q: %v, want %q", c.role, err, c.wantErr)
			}
			continue
		}
		want := "<|im_start|>" + strings.ToLower(c.role) + "\nHi<|im_end|>\n<|im_start|>assistant\n"
		if err != nil || got != want {
			t.Errorf("role %q: %q, %v; want %q", c.role, got, err, want)
		}
	}
}

// embeddedTemplate is the chat template of an embedded tokenizer family.
func embeddedTemplate(t *testing.T, family string) *chatTemplate {
	t.Helper()
	raw, err := assets.TokenizerConfig(family)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := tokenizer.ParseConfig(raw)
	if err != nil {
		t.Fatal(err)
	}
	tpl, err := newChatTemplate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tpl
}

// TestContinueFinalMessage: a last assistant message of text is the
// prompt's prefix to continue with continue_final_message and a user's turn
// without it, as in SGLang; one of content parts is rendered as it is.
func TestContinueFinalMessage(t *testing.T) {
	tpl := embeddedTemplate(t, "qwen3")
	user := ChatMessage{Role: "user", Content: "2+2?"}
	partial := ChatMessage{Role: "assistant", Content: "The answer is"}
	parts := ChatMessage{Role: "assistant", Content: []any{map[string]any{"type": "text", "text": "The answer is"}}}
	asked := []ChatMessage{user, partial}
	render := func(msgs ...ChatMessage) string {
		out, err := tpl.render(msgs, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	for _, c := range []struct {
		name         string
		msgs         []ChatMessage
		cont         bool
		text, prefix string
	}{
		{"continued", []ChatMessage{user, partial}, true, render(user), "The answer is"},
		{"a user's turn without it", asked, false, render(user, ChatMessage{Role: "user", Content: "The answer is"}), ""},
		{"content parts", []ChatMessage{user, parts}, true, render(user, parts), ""},
		{"a user message last", []ChatMessage{user}, true, render(user), ""},
	} {
		text, prefix, err := tpl.renderContinuing(c.msgs, nil, nil, c.cont)
		if err != nil || text != c.text || prefix != c.prefix {
			t.Errorf("%s: %q, %q, %v; want %q, %q", c.name, text, prefix, err, c.text, c.prefix)
		}
	}
	if asked[1].Role != "assistant" {
		t.Errorf("renderContinuing changed its caller's messages: %v", asked)
	}
}
