package tokenizermanager

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/nikolalohinski/gonja/v2"
	"github.com/nikolalohinski/gonja/v2/exec"

	"ebb/tokenizer"
)

// chatTemplate renders a model's Jinja chat template (gonja renders the
// Qwen3 and Llama-3 templates byte-identically to transformers).
type chatTemplate struct {
	tpl      *exec.Template
	bos, eos string
}

func newChatTemplate(cfg *tokenizer.Config) (*chatTemplate, error) {
	tpl, err := gonja.FromString(cfg.ChatTemplate)
	if err != nil {
		return nil, err
	}
	return &chatTemplate{tpl: tpl, bos: cfg.BOSToken, eos: cfg.EOSToken}, nil
}

// ChatMessage is an OpenAI chat message; content is a string or a list of
// parts, of which the text parts are used.
type ChatMessage struct {
	Role             string `json:"role"`
	Content          any    `json:"content"`
	Name             string `json:"name,omitempty"`
	ReasoningContent string `json:"reasoning_content,omitempty"`
	ToolCalls        []any  `json:"tool_calls,omitempty"`
	ToolCallID       string `json:"tool_call_id,omitempty"`
}

func (m ChatMessage) text() (string, error) {
	switch c := m.Content.(type) {
	case nil:
		return "", nil
	case string:
		return c, nil
	case []any:
		var b strings.Builder
		for _, p := range c {
			part, ok := p.(map[string]any)
			if !ok {
				return "", fmt.Errorf("content parts must be objects")
			}
			switch part["type"] {
			case "text":
				s, _ := part["text"].(string)
				b.WriteString(s)
			default:
				return "", fmt.Errorf("content part of type %v is not supported (text only)", part["type"])
			}
		}
		return b.String(), nil
	}
	return "", fmt.Errorf("content must be a string or a list of parts")
}

// chatRoles are the message roles SGLang's chat endpoint accepts (system,
// user, assistant, tool, function) and OpenAI's developer; the template
// decides what a role becomes.
var chatRoles = []string{"system", "developer", "user", "assistant", "tool", "function"}

// render applies the template with add_generation_prompt and any extra
// template arguments (chat_template_kwargs, e.g. enable_thinking).
func (c *chatTemplate) render(messages []ChatMessage, tools []any, kwargs map[string]any) (string, error) {
	if len(messages) == 0 {
		return "", errors.New("messages is empty")
	}
	msgs := make([]any, len(messages))
	for i, m := range messages {
		text, err := m.text()
		if err != nil {
			return "", fmt.Errorf("message %d: %w", i, err)
		}
		if m.Role == "" {
			return "", fmt.Errorf("message %d has no role", i)
		}
		role := strings.ToLower(m.Role) // SGLang takes roles in any case
		if !slices.Contains(chatRoles, role) {
			return "", fmt.Errorf("message %d: 'role' must be one of %s (case-insensitive), got %q", i, strings.Join(chatRoles, ", "), m.Role)
		}
		mm := map[string]any{"role": role, "content": text}
		if m.ReasoningContent != "" {
			mm["reasoning_content"] = m.ReasoningContent
		}
		if len(m.ToolCalls) > 0 {
			mm["tool_calls"] = templateToolCalls(m.ToolCalls)
		}
		if m.ToolCallID != "" {
			mm["tool_call_id"] = m.ToolCallID
		}
		if m.Name != "" {
			mm["name"] = m.Name
		}
		msgs[i] = mm
	}
	vars := map[string]any{
		"messages": msgs, "add_generation_prompt": true, "bos_token": c.bos, "eos_token": c.eos,
		"raise_exception": func(msg string) (string, error) { return "", errors.New(msg) },
	}
	if len(tools) > 0 {
		vars["tools"] = tools
	}
	for k, v := range kwargs {
		vars[k] = v
	}
	out, err := c.tpl.ExecuteToString(exec.NewContext(vars))
	if err != nil {
		return "", fmt.Errorf("chat template: %w", err)
	}
	return out, nil
}

// renderContinuing is render with a last assistant message of text taken
// as SGLang's chat endpoint takes it (_handle_last_assistant_message): with
// continue_final_message it is not rendered but returned as prefix, to be
// tokenized apart and appended to the prompt, so that the reply continues
// it (an RL agent's partial turn, or a forced opening); without, it is
// rendered as a user message, so that the prompt ends on a user's turn.
func (c *chatTemplate) renderContinuing(messages []ChatMessage, tools []any, kwargs map[string]any, continueFinal bool) (text, prefix string, err error) {
	n := len(messages)
	if n > 0 && strings.EqualFold(messages[n-1].Role, "assistant") {
		if last, ok := messages[n-1].Content.(string); ok {
			messages = slices.Clone(messages)
			if continueFinal {
				messages, prefix = messages[:n-1], last
			} else {
				messages[n-1] = ChatMessage{Role: "user", Content: last}
			}
		}
	}
	text, err = c.render(messages, tools, kwargs)
	return text, prefix, err
}

// templateToolCalls gives templates the arguments of earlier calls as
// objects: OpenAI sends them as JSON text, and templates (Llama 3's) write
// them with tojson, which would quote the text again. SGLang does the same.
func templateToolCalls(calls []any) []any {
	out := make([]any, len(calls))
	for i, c := range calls {
		out[i] = c
		call, ok := c.(map[string]any)
		if !ok {
			continue
		}
		fn, ok := call["function"].(map[string]any)
		if !ok {
			continue
		}
		if args, ok := fn["arguments"].(string); ok {
			var v any
			if json.Unmarshal([]byte(args), &v) == nil {
				fn2 := maps.Clone(fn)
				fn2["arguments"] = v
				call2 := maps.Clone(call)
				call2["function"] = fn2
				out[i] = call2
			}
		}
	}
	return out
}
