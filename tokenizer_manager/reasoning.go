package tokenizermanager

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// reasoningParser separates a reply's reasoning (<think>...</think>) from
// its answer for the chat endpoint, as SGLang's --reasoning-parser does
// (sglang/srt/parser/reasoning_parser.py): the message's reasoning_content
// and content, neither trimmed.
type reasoningParser struct {
	start, end string
	// toolStart, where set, also ends the reasoning: Qwen3 may open a tool
	// call without closing its thought (the call goes to the answer).
	toolStart string
	// force: the reply begins inside its reasoning, because the chat
	// template opened it in the prompt (Qwen3's thinking-only models,
	// DeepSeek-R1).
	force bool
}

// reasoningParsers are the --reasoning-parser values ebb takes, SGLang's
// names.
var reasoningParsers = map[string]reasoningParser{
	"qwen3":          {"<think>", "</think>", "<tool_call>", false},
	"qwen3-thinking": {"<think>", "</think>", "<tool_call>", true},
	"deepseek-r1":    {"<think>", "</think>", "", true},
}

// parseReasoningParser is the parser --reasoning-parser names ("": none).
func parseReasoningParser(name string) (*reasoningParser, error) {
	if name == "" {
		return nil, nil
	}
	p, ok := reasoningParsers[name]
	if !ok {
		return nil, fmt.Errorf("--reasoning-parser %q: ebb takes %s", name, strings.Join(slices.Sorted(maps.Keys(reasoningParsers)), ", "))
	}
	return &p, nil
}

// split is a whole reply's reasoning and answer by SGLang's rule
// (detect_and_parse): a reply that has the start tag, or any reply where
// force is set, is reasoning (its leading start tags dropped) up to the
// end tag, else up to toolStart, else to its end.
func (p *reasoningParser) split(text string) (reasoning, content string) {
	if !p.force && !strings.Contains(text, p.start) {
		return "", text
	}
	t := p.body(text)
	if r, c, found := strings.Cut(t, p.end); found {
		return r, c
	}
	if i := p.toolAt(t); i >= 0 {
		return t[:i], t[i:]
	}
	return t, ""
}

// body is text without its leading start tags.
func (p *reasoningParser) body(text string) string {
	for strings.HasPrefix(text, p.start) {
		text = text[len(p.start):]
	}
	return text
}

// toolAt is where a tool call opens in t, or -1.
func (p *reasoningParser) toolAt(t string) int {
	if p.toolStart == "" {
		return -1
	}
	return strings.Index(t, p.toolStart)
}

// reasoningStream splits a streamed reply as it grows. Its reasoning goes
// out in deltas (or, without streamReasoning, whole once it ends); its
// answer is handed on whole so far, for the tool-call parser to cut. A
// tag's first bytes are held back until they are known not to be one, and
// where the reasoning ended (an end tag, or a tool call's start) is kept,
// so that the answer only grows. A stream is reasoning only where the
// reply begins with the start tag (or force is set); split also takes a
// start tag later in the reply.
type reasoningStream struct {
	p               *reasoningParser
	streamReasoning bool
	sent            int // bytes of the reasoning sent
	ended           bool
	thought, answer int // once ended: the reasoning's length in body, and where the answer begins
}

// feed takes the reply so far (final: all of it) and gives the reasoning
// not yet sent and the answer so far.
func (s *reasoningStream) feed(text string, final bool) (reasoning, content string) {
	p := s.p
	switch {
	case !p.force && !final && strings.HasPrefix(p.start, text):
		return "", "" // too little to tell yet
	case !p.force && !strings.HasPrefix(text, p.start):
		return "", text
	}
	body := p.body(text)
	if !s.ended {
		if i := strings.Index(body, p.end); i >= 0 {
			s.ended, s.thought, s.answer = true, i, i+len(p.end)
		} else if i := p.toolAt(body); i >= 0 {
			s.ended, s.thought, s.answer = true, i, i
		}
	}
	thought := body
	switch {
	case s.ended:
		thought, content = body[:s.thought], body[s.answer:]
	case !final:
		thought = body[:len(body)-max(partialSuffix(body, p.end), partialSuffix(body, p.toolStart))]
	}
	if !s.streamReasoning && !s.ended && !final {
		return "", content
	}
	reasoning = thought[min(s.sent, len(thought)):]
	s.sent = len(thought)
	return reasoning, content
}
