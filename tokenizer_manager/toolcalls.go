package tokenizermanager

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// toolCall is one function call the model wrote, in OpenAI's shape.
type toolCall struct {
	Name      string
	Arguments string // JSON text
}

func (c toolCall) openAI(index int) map[string]any {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return map[string]any{"index": index, "id": "call_" + hex.EncodeToString(b[:]), "type": "function",
		"function": map[string]any{"name": c.Name, "arguments": c.Arguments}}
}

// toolFormat is how a model family writes tool calls.
type toolFormat int

const (
	// toolsTagged: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
	// blocks (Qwen2.5, Qwen3 and their chat templates).
	toolsTagged toolFormat = iota + 1
	// toolsJSON: the whole reply is {"name": ..., "parameters": {...}}, maybe
	// after <|python_tag|>, calls separated by ";" (Llama 3.1+).
	toolsJSON
)

// toolFormatFor picks the format from the chat template; 0 when the
// template has no tool syntax ebb knows.
func toolFormatFor(template string) toolFormat {
	switch {
	case strings.Contains(template, "<tool_call>"):
		return toolsTagged
	case strings.Contains(template, "parameters") && strings.Contains(template, "tools"):
		return toolsJSON
	}
	return 0
}

// toolCallParsers are the --tool-call-parser values ebb takes (SGLang's
// names) and the format each reads; without the flag the chat template
// decides (toolFormatFor).
var toolCallParsers = map[string]toolFormat{"qwen25": toolsTagged, "qwen": toolsTagged, "hermes": toolsTagged, "llama3": toolsJSON}

// parseToolCallParser is the format --tool-call-parser names (0: none given).
func parseToolCallParser(name string) (toolFormat, error) {
	if name == "" {
		return 0, nil
	}
	f, ok := toolCallParsers[name]
	if !ok {
		return 0, fmt.Errorf("--tool-call-parser %q: ebb takes %s", name, strings.Join(slices.Sorted(maps.Keys(toolCallParsers)), ", "))
	}
	return f, nil
}

const (
	toolOpen  = "<tool_call>"
	toolClose = "</tool_call>"
	pythonTag = "<|python_tag|>"
)

// toolStream separates a growing reply into content and tool calls: Feed
// takes the whole text so far and returns the content and calls that are
// certain now; Finish returns what is left at the end.
type toolStream struct {
	format  toolFormat
	sent    int  // bytes of text handed out as content or consumed by calls
	holding bool // toolsJSON: the reply is a call; nothing streams
}

func newToolStream(f toolFormat) *toolStream { return &toolStream{format: f} }

// Feed returns new content and newly completed calls.
func (s *toolStream) Feed(text string) (string, []toolCall) {
	switch s.format {
	case toolsTagged:
		return s.feedTagged(text, false)
	case toolsJSON:
		trimmed := strings.TrimLeft(text, " \t\r\n")
		if s.sent == 0 && (strings.HasPrefix(trimmed, "{") || strings.HasPrefix(trimmed, pythonTag) ||
			strings.HasPrefix(pythonTag, trimmed)) {
			s.holding = true // a call, or too little to tell yet
			return "", nil
		}
		s.holding = false
		out := text[s.sent:]
		s.sent = len(text)
		return out, nil
	}
	out := text[s.sent:]
	s.sent = len(text)
	return out, nil
}

func (s *toolStream) feedTagged(text string, final bool) (string, []toolCall) {
	var content strings.Builder
	var calls []toolCall
	for {
		rest := text[s.sent:]
		open := strings.Index(rest, toolOpen)
		if open < 0 {
			safe := len(rest)
			if !final {
				safe -= partialSuffix(rest, toolOpen)
			}
			content.WriteString(rest[:safe])
			s.sent += safe
			return content.String(), calls
		}
		content.WriteString(rest[:open])
		body := rest[open+len(toolOpen):]
		end := strings.Index(body, toolClose)
		if end < 0 {
			if !final {
				s.sent += open
				return content.String(), calls
			}
			if c, ok := parseCall(body); ok { // the reply ended inside the block
				calls = append(calls, c)
			} else {
				content.WriteString(rest[open:])
			}
			s.sent = len(text)
			return content.String(), calls
		}
		if c, ok := parseCall(body[:end]); ok {
			calls = append(calls, c)
		} else {
			content.WriteString(rest[open : open+len(toolOpen)+end+len(toolClose)])
		}
		s.sent += open + len(toolOpen) + end + len(toolClose)
	}
}

// Finish returns the content and calls left once the reply is complete.
func (s *toolStream) Finish(text string) (string, []toolCall) {
	switch s.format {
	case toolsTagged:
		return s.feedTagged(text, true)
	case toolsJSON:
		if s.holding || s.sent == 0 {
			trimmed := strings.TrimSpace(strings.TrimPrefix(strings.TrimLeft(text, " \t\r\n"), pythonTag))
			var calls []toolCall
			for _, part := range strings.Split(trimmed, ";") {
				c, ok := parseCall(part)
				if !ok {
					s.sent = len(text)
					return text, nil // not a call after all: it is the answer
				}
				calls = append(calls, c)
			}
			s.sent = len(text)
			return "", calls
		}
	}
	out := text[s.sent:]
	s.sent = len(text)
	return out, nil
}

// partialSuffix is the length of the longest suffix of s that begins tag.
func partialSuffix(s, tag string) int {
	for n := min(len(s), len(tag)-1); n > 0; n-- {
		if strings.HasSuffix(s, tag[:n]) {
			return n
		}
	}
	return 0
}

// parseCall reads {"name": ..., "arguments"|"parameters": {...}}.
func parseCall(s string) (toolCall, bool) {
	var v struct {
		Name       string          `json:"name"`
		Arguments  json.RawMessage `json:"arguments"`
		Parameters json.RawMessage `json:"parameters"`
	}
	dec := json.NewDecoder(strings.NewReader(strings.TrimSpace(s)))
	if err := dec.Decode(&v); err != nil || v.Name == "" || dec.More() {
		return toolCall{}, false
	}
	args := v.Arguments
	if len(args) == 0 {
		args = v.Parameters
	}
	if len(args) == 0 || string(args) == "null" {
		args = json.RawMessage("{}")
	}
	// Arguments given as a JSON string already hold the JSON text.
	var str string
	if json.Unmarshal(args, &str) == nil {
		return toolCall{Name: v.Name, Arguments: str}, true
	}
	var compact bytes.Buffer
	if err := json.Compact(&compact, args); err != nil {
		return toolCall{}, false
	}
	return toolCall{Name: v.Name, Arguments: compact.String()}, true
}
