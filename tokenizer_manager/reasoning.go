package tokenizermanager

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// reasoningParser separates a reply's reasoning (<think>...</think>) from
// its answer for the chat endpoint, as SGLang's --reasoning-parser does:
// the message's reasoning_content and content.
type reasoningParser struct {
	start, end string
	// force: the reply begins inside its reasoning, because the chat
	// template opened it in the prompt (Qwen3's thinking-only models,
	// DeepSeek-R1).
	force bool
}

// reasoningParsers are the --reasoning-parser values ebb takes, SGLang's
// names.
var reasoningParsers = map[string]reasoningParser{
	"qwen3":          {"<think>", "</think>", false},
	"qwen3-thinking": {"<think>", "</think>", true},
	"deepseek-r1":    {"<think>", "</think>", true},
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

// split is a whole reply's reasoning and answer, by SGLang's rule
// (detect_and_parse): a reply that has the start tag, or any reply where
// force is set, is reasoning up to the end tag (all of it where the reply
// stopped before one), each part trimmed of surrounding space.
func (p *reasoningParser) split(text string) (reasoning, content string) {
	if !p.force && !strings.Contains(text, p.start) {
		return "", text
	}
	t := strings.TrimSpace(strings.ReplaceAll(text, p.start, ""))
	r, c, found := strings.Cut(t, p.end)
	if !found {
		return t, ""
	}
	return r, strings.TrimSpace(c)
}

// reasoningStream splits a streamed reply as it grows. Its reasoning goes
// out in deltas (or, without streamReasoning, whole once it ends); its
// answer is handed on whole so far, for the tool-call parser to cut. A
// tag's first bytes are held back until they are known not to be one.
type reasoningStream struct {
	p               *reasoningParser
	streamReasoning bool
	sent            int // bytes of the reasoning sent
}

// feed takes the reply so far (final: all of it) and gives the reasoning
// not yet sent and the answer so far.
func (s *reasoningStream) feed(text string, final bool) (reasoning, content string) {
	body := strings.TrimLeft(text, " \t\r\n")
	switch {
	case strings.HasPrefix(body, s.p.start):
		body = strings.TrimLeft(body[len(s.p.start):], " \t\r\n")
	case !s.p.force && !final && strings.HasPrefix(s.p.start, body):
		return "", "" // too little to tell yet
	case !s.p.force:
		return "", text
	}
	thought, rest, ended := strings.Cut(body, s.p.end)
	if !ended && !final {
		thought = thought[:len(thought)-partialSuffix(thought, s.p.end)]
	}
	if ended {
		content = strings.TrimLeft(rest, " \t\r\n")
	}
	if !s.streamReasoning && !ended && !final {
		return "", content
	}
	reasoning = thought[min(s.sent, len(thought)):]
	s.sent = len(thought)
	return reasoning, content
}
