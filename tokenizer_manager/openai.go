package tokenizermanager

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"time"

	"ebb/ioschema"
)

// openAISampling are the sampling fields shared by both OpenAI endpoints,
// with SGLang's extensions (top_k, min_p, ...).
type openAISampling struct {
	Model         string   `json:"model"`
	MaxTokens     *int     `json:"max_tokens"`
	Temperature   *float64 `json:"temperature"`
	TopP          *float64 `json:"top_p"`
	TopK          *int     `json:"top_k"`
	MinP          *float64 `json:"min_p"`
	N             *int     `json:"n"`
	Stream        bool     `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	Stop              ioschema.StringList `json:"stop"`
	StopTokenIDs      []int32             `json:"stop_token_ids"`
	StopRegex         ioschema.StringList `json:"stop_regex"` // SGLang's extension
	Seed              *uint64             `json:"seed"`
	PresencePenalty   float64             `json:"presence_penalty"`
	FrequencyPenalty  float64             `json:"frequency_penalty"`
	RepetitionPenalty *float64            `json:"repetition_penalty"`
	IgnoreEOS         bool                `json:"ignore_eos"`
	SkipSpecialTokens *bool               `json:"skip_special_tokens"`
	NoStopTrim        bool                `json:"no_stop_trim"`
	MinTokens         int                 `json:"min_tokens"`
	LogitBias         map[string]float64  `json:"logit_bias"`
	Rid               string              `json:"rid"`
	RoutedDPRank      *int                `json:"routed_dp_rank"`
	DataParallelRank  *int                `json:"data_parallel_rank"` // SGLang's deprecated spelling
	// ReturnRoutedExperts: SGLang's extension; the response's sglext
	// carries the first choice's routed experts.
	ReturnRoutedExperts bool `json:"return_routed_experts"`
	// ReturnTokenIDs: SGLang's extension; each choice carries the prompt's
	// token ids and the output's, so that a trainer scores the very tokens
	// the rollout produced rather than a re-tokenization of its text.
	ReturnTokenIDs bool `json:"return_token_ids"`
}

// withTokenIDs adds return_token_ids' fields to a choice where the request
// asked for them: prompt_token_ids where prompt is set (a stream sends them
// once) and token_ids.
func (o *openAISampling) withTokenIDs(c map[string]any, prompt, out []int32) map[string]any {
	if !o.ReturnTokenIDs {
		return c
	}
	if prompt != nil {
		c["prompt_token_ids"] = prompt
	}
	c["token_ids"] = append([]int32{}, out...)
	return c
}

func (o *openAISampling) params(defaultMax *int) ioschema.SamplingParams {
	max := o.MaxTokens
	if max == nil {
		max = defaultMax
	}
	return ioschema.SamplingParams{MaxNewTokens: max, Temperature: o.Temperature, TopP: o.TopP, TopK: o.TopK, MinP: o.MinP,
		Stop: o.Stop, StopTokenIDs: o.StopTokenIDs, SamplingSeed: o.Seed, PresencePenalty: o.PresencePenalty,
		FrequencyPenalty: o.FrequencyPenalty, RepetitionPenalty: o.RepetitionPenalty, IgnoreEOS: o.IgnoreEOS,
		SkipSpecialTokens: o.SkipSpecialTokens, NoStopTrim: o.NoStopTrim, MinNewTokens: o.MinTokens, N: o.N,
		LogitBias: o.LogitBias, StopRegex: o.StopRegex}
}

func finishString(fr *ioschema.FinishReason) any {
	if fr == nil {
		return nil
	}
	return fr.Type // stop, length, abort
}

func usage(snaps []snapshot) map[string]any {
	prompt, completion, cached := 0, 0, 0
	for _, s := range snaps {
		prompt += s.PromptTokens
		completion += s.Completion
		cached += s.Cached
	}
	return map[string]any{"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
		"prompt_tokens_details": map[string]any{"cached_tokens": cached}}
}

// openAIReply is what every response and stream chunk of one OpenAI request
// shares.
type openAIReply struct {
	id, object, model string
	created           int64
}

func (m *Manager) newOpenAIReply(idPrefix, object string) *openAIReply {
	return &openAIReply{id: idPrefix + newRid(), object: object, model: m.modelName(), created: time.Now().Unix()}
}

func (r *openAIReply) body(choices []any) map[string]any {
	return map[string]any{"id": r.id, "object": r.object, "created": r.created, "model": r.model, "choices": choices}
}

func (r *openAIReply) withUsage(choices []any, snaps []snapshot) map[string]any {
	b := r.body(choices)
	b["usage"] = usage(snaps)
	return b
}

// complete is a whole (not streamed) response: choices, usage and SGLang's
// extensions.
func (r *openAIReply) complete(choices []any, snaps []snapshot) map[string]any {
	b := r.withUsage(choices, snaps)
	if ext := sglExt(snaps); ext != nil {
		b["sglext"] = ext
	}
	return b
}

// sglExt is SGLang's response-level extension object: the routed experts
// of the first choice that has them, or nil.
func sglExt(snaps []snapshot) map[string]any {
	for _, s := range snaps {
		if s.Routed != nil {
			return map[string]any{"routed_experts": ioschema.EncodeRoutedExperts(s.Routed)}
		}
	}
	return nil
}

// finishStream sends SGLang's extension chunk when there is one and the
// usage chunk when the client asked for it, then [DONE].
func (o *openAISampling) finishStream(stream *sse, reply *openAIReply, final []snapshot) {
	if ext := sglExt(final); ext != nil {
		b := reply.body([]any{})
		b["sglext"] = ext
		stream.send(b)
	}
	if o.StreamOptions != nil && o.StreamOptions.IncludeUsage {
		stream.send(reply.withUsage([]any{}, final))
	}
	stream.done()
}

type completionRequest struct {
	openAISampling
	Prompt   json.RawMessage `json:"prompt"`
	Logprobs *int            `json:"logprobs"`
	Echo     bool            `json:"echo"`
}

// completions serves /v1/completions.
func (m *Manager) completions(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	if err := decodeStrict(r, &req, completionParams); err != nil {
		writeError(w, err)
		return
	}
	in := &ioschema.GenerateReqInput{Stream: req.Stream, RoutedDPRank: req.RoutedDPRank, DataParallelRank: req.DataParallelRank}
	if err := json.Unmarshal(req.Prompt, &in.Text); err != nil {
		if err := json.Unmarshal(req.Prompt, &in.InputIDs); err != nil {
			writeError(w, badf("prompt must be a string, a list of strings, or token ids"))
			return
		}
	}
	sixteen := 16 // OpenAI's default max_tokens for completions
	in.SamplingParams.Items = []ioschema.SamplingParams{req.params(&sixteen)}
	if req.Rid != "" {
		in.Rid.Items = []string{req.Rid}
	}
	if req.Logprobs != nil {
		in.ReturnLogprob, in.TopLogprobsNum = true, *req.Logprobs
		// The prompt's logprobs too, as OpenAI's legacy completions return
		// them (lm-evaluation-harness scores prompts so); SGLang's older
		// adapter asked for them, its current server warns and leaves them out.
		if req.Echo && !req.Stream {
			zero := 0
			in.LogprobStartLen = &zero
		}
	}
	in.ReturnRoutedExperts = req.ReturnRoutedExperts
	reply := m.newOpenAIReply("cmpl-", "text_completion")
	prompts, _, err := m.start(r.Context(), in)
	if err != nil {
		writeError(w, err)
		return
	}
	choice := func(i int, s snapshot, text string) map[string]any {
		c := map[string]any{"index": i, "text": text, "logprobs": nil, "finish_reason": finishString(s.Finish)}
		if s.Finish != nil && s.Finish.Matched != nil {
			c["matched_stop"] = s.Finish.Matched
		}
		if req.Logprobs != nil {
			c["logprobs"] = m.completionLogprobs(s, req.Echo && !req.Stream)
		}
		return c
	}
	if req.Stream {
		sse := newSSE(w)
		sent := make([]int, len(prompts))
		echoed := make([]bool, len(prompts)) // a chunk went out: the prompt, where echo asks for it, with it
		sentIDs := make([]int, len(prompts))
		final := make([]snapshot, len(prompts))
		m.stream(r.Context(), prompts, false, func(i int, s snapshot) bool {
			final[i] = s
			if s.Err != nil {
				sse.send(map[string]any{"error": map[string]any{"message": s.Err.Error()}})
				return false
			}
			delta := s.Text[sent[i]:]
			if !echoed[i] && req.Echo && m.Tokenizer != nil { // the prompt leads the first chunk, as in SGLang
				delta = m.Tokenizer.Decode(prompts[i].tokenized.InputIDs, true) + delta
			}
			sent[i] = len(s.Text)
			if delta == "" && !s.Done {
				return true
			}
			var promptIDs []int32
			if !echoed[i] {
				promptIDs = prompts[i].tokenized.InputIDs
			}
			echoed[i] = true
			c := req.withTokenIDs(choice(i, s, delta), promptIDs, s.OutputIDs[sentIDs[i]:])
			sentIDs[i] = len(s.OutputIDs)
			if !s.Done {
				c["finish_reason"] = nil
			}
			return sse.send(reply.body([]any{c}))
		})
		req.finishStream(sse, reply, final)
		return
	}
	snaps, err := m.waitAll(r.Context(), prompts)
	if err != nil {
		writeError(w, badRequest{err})
		return
	}
	choices := make([]any, len(snaps))
	for i, s := range snaps {
		text := s.Text
		if req.Echo && m.Tokenizer != nil {
			text = m.Tokenizer.Decode(prompts[i].tokenized.InputIDs, true) + text
		}
		choices[i] = req.withTokenIDs(choice(i, s, text), prompts[i].tokenized.InputIDs, s.OutputIDs)
	}
	writeJSON(w, http.StatusOK, reply.complete(choices, snaps))
}

func (m *Manager) tokenText(id int32) string {
	if m.Tokenizer == nil {
		return ""
	}
	return m.Tokenizer.Decode([]int32{id}, false)
}

// completionLogprobs is the legacy completions logprobs object; with echo
// the prompt's tokens come first (null where a token has no logprob: the
// first), in the shape of SGLang's to_openai_style_logprobs.
func (m *Manager) completionLogprobs(s snapshot, echo bool) map[string]any {
	var tokens []string
	var lps, top []any
	withTop := len(s.OutTopVals) > 0 || s.InTopVals != nil
	add := func(id int32, lp float32, has bool, topVals []float32, topIdx []int32) {
		tokens = append(tokens, m.tokenText(id))
		var v any
		if has && !math.IsNaN(float64(lp)) && !math.IsInf(float64(lp), 0) {
			v = float64(lp)
		}
		lps = append(lps, v)
		if !withTop {
			return
		}
		var alt any
		if topVals != nil {
			a := map[string]float64{}
			for j, v := range topVals {
				a[m.tokenText(topIdx[j])] = float64(v)
			}
			alt = a
		}
		top = append(top, alt)
	}
	if echo {
		for i, id := range s.InIdx {
			var tv []float32
			var ti []int32
			if i < len(s.InTopVals) {
				tv, ti = s.InTopVals[i], s.InTopIdx[i]
			}
			add(id, s.InLogprobs[i], true, tv, ti)
		}
	}
	for i, id := range s.OutputIDs {
		var tv []float32
		var ti []int32
		if i < len(s.OutTopVals) {
			tv, ti = s.OutTopVals[i], s.OutTopIdx[i]
		}
		var lp float32
		if i < len(s.OutLogprobs) {
			lp = s.OutLogprobs[i]
		}
		add(id, lp, i < len(s.OutLogprobs), tv, ti)
	}
	if tokens == nil {
		tokens, lps = []string{}, []any{}
	}
	return map[string]any{"tokens": tokens, "token_logprobs": lps, "top_logprobs": top}
}

type chatRequest struct {
	openAISampling
	Messages            []ChatMessage  `json:"messages"`
	MaxCompletionTokens *int           `json:"max_completion_tokens"`
	Logprobs            bool           `json:"logprobs"`
	TopLogprobs         int            `json:"top_logprobs"`
	Tools               []chatTool     `json:"tools"`
	ToolChoice          *string        `json:"tool_choice"`
	ParallelToolCalls   *bool          `json:"parallel_tool_calls"`
	ChatTemplateKwargs  map[string]any `json:"chat_template_kwargs"`
	// ContinueFinalMessage: SGLang's; a last assistant message is continued
	// (renderContinuing).
	ContinueFinalMessage bool `json:"continue_final_message"`
	// SeparateReasoning and StreamReasoning are SGLang's (both default
	// true): with --reasoning-parser, whether a reply's reasoning goes to
	// reasoning_content, and whether a stream sends it as it comes.
	SeparateReasoning *bool `json:"separate_reasoning"`
	StreamReasoning   *bool `json:"stream_reasoning"`
}

// reasoningParser is the server's reasoning parser where the request
// wants its reasoning apart, or nil.
func (req *chatRequest) reasoningParser(p *reasoningParser) *reasoningParser {
	if req.SeparateReasoning != nil && !*req.SeparateReasoning {
		return nil
	}
	return p
}

// chatTool is an OpenAI tool: a function the model may call.
type chatTool struct {
	Type     string `json:"type"`
	Function struct {
		Name        string `json:"name"`
		Description string `json:"description,omitempty"`
		Parameters  any    `json:"parameters,omitempty"`
		Strict      *bool  `json:"strict,omitempty"`
	} `json:"function"`
}

// templateTools are the tools as the chat template sees them (SGLang
// passes each tool's function object), or nil when tools are off.
func (req *chatRequest) templateTools() ([]any, error) {
	if len(req.Tools) == 0 || (req.ToolChoice != nil && *req.ToolChoice == "none") {
		return nil, nil
	}
	out := make([]any, len(req.Tools))
	for i, t := range req.Tools {
		if t.Type != "function" || t.Function.Name == "" {
			return nil, fmt.Errorf("tools[%d] must be {\"type\": \"function\", \"function\": {\"name\": ...}}", i)
		}
		f := map[string]any{"name": t.Function.Name}
		if t.Function.Description != "" {
			f["description"] = t.Function.Description
		}
		if t.Function.Parameters != nil {
			f["parameters"] = t.Function.Parameters
		}
		out[i] = f
	}
	return out, nil
}

// decodeStrict reads a JSON body after checking its parameters.
func decodeStrict(r *http.Request, v any, accepted map[string]paramRule) error {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return bodyError(err)
	}
	if err := checkParams(body, accepted); err != nil {
		return err
	}
	if err := json.Unmarshal(body, v); err != nil {
		return badf("invalid JSON body: %v", err)
	}
	return nil
}

// chatCompletions serves /v1/chat/completions with the model's template.
func (m *Manager) chatCompletions(w http.ResponseWriter, r *http.Request) {
	var req chatRequest
	if err := decodeStrict(r, &req, chatParams); err != nil {
		writeError(w, err)
		return
	}
	if m.chat == nil || m.Tokenizer == nil {
		writeError(w, badf("the model has no chat template or tokenizer"))
		return
	}
	tools, err := req.templateTools()
	if err != nil {
		writeError(w, badRequest{err})
		return
	}
	var format toolFormat
	if tools != nil {
		if format = m.toolCalls; format == 0 {
			format = toolFormatFor(m.TokConfig.ChatTemplate)
		}
		if format == 0 {
			writeError(w, badf("the model's chat template has no tool-call syntax ebb can parse (Qwen's <tool_call> or Llama 3's JSON)"))
			return
		}
		// The calls are text to parse: keep every token in it, as SGLang does.
		keep := false
		req.SkipSpecialTokens = &keep
	}
	text, prefix, err := m.chat.renderContinuing(req.Messages, tools, req.ChatTemplateKwargs, req.ContinueFinalMessage)
	if err != nil {
		writeError(w, badRequest{err})
		return
	}
	if req.MaxCompletionTokens != nil && req.MaxTokens == nil {
		req.MaxTokens = req.MaxCompletionTokens
	}
	ids, err := m.encode(text, false)
	if err != nil {
		writeError(w, err)
		return
	}
	ids = append(ids, m.Tokenizer.Encode(prefix, false)...)
	in := &ioschema.GenerateReqInput{Stream: req.Stream, RoutedDPRank: req.RoutedDPRank, DataParallelRank: req.DataParallelRank,
		InputIDs:       ioschema.InputIDBatch{Items: [][]int32{ids}},
		SamplingParams: ioschema.SamplingBatch{Items: []ioschema.SamplingParams{req.params(nil)}}}
	if req.Rid != "" {
		in.Rid.Items = []string{req.Rid}
	}
	if req.Logprobs {
		in.ReturnLogprob, in.TopLogprobsNum = true, req.TopLogprobs
	}
	in.ReturnRoutedExperts = req.ReturnRoutedExperts
	reply := m.newOpenAIReply("chatcmpl-", "chat.completion")
	prompts, _, err := m.start(r.Context(), in)
	if err != nil {
		writeError(w, err)
		return
	}
	parallel := req.ParallelToolCalls == nil || *req.ParallelToolCalls
	if req.Stream {
		sse := newSSE(w)
		streams := make([]*toolStream, len(prompts))
		thoughts := make([]*reasoningStream, len(prompts))
		parser := req.reasoningParser(m.reasoning)
		calls := make([]int, len(prompts))
		started := make([]bool, len(prompts))
		final := make([]snapshot, len(prompts))
		reply.object = "chat.completion.chunk"
		chunk := func(c map[string]any) bool { return sse.send(reply.body([]any{c})) }
		m.stream(r.Context(), prompts, false, func(i int, s snapshot) bool {
			final[i] = s
			if s.Err != nil {
				sse.send(map[string]any{"error": map[string]any{"message": s.Err.Error()}})
				return false
			}
			if !started[i] {
				started[i] = true
				streams[i] = newToolStream(format)
				if parser != nil {
					thoughts[i] = &reasoningStream{p: parser, streamReasoning: req.StreamReasoning == nil || *req.StreamReasoning}
				}
				if !chunk(map[string]any{"index": i, "delta": map[string]any{"role": "assistant", "content": ""}, "finish_reason": nil}) {
					return false
				}
			}
			answer := s.Text
			if thoughts[i] != nil {
				var thought string
				thought, answer = thoughts[i].feed(s.Text, s.Done)
				if thought != "" && !chunk(map[string]any{"index": i, "delta": map[string]any{"reasoning_content": thought}, "finish_reason": nil}) {
					return false
				}
			}
			content, newCalls := streams[i].Feed(answer)
			if s.Done {
				rest, last := streams[i].Finish(answer)
				content, newCalls = content+rest, append(newCalls, last...)
			}
			if content != "" && !chunk(map[string]any{"index": i, "delta": map[string]any{"content": content}, "finish_reason": nil}) {
				return false
			}
			for _, c := range newCalls {
				if calls[i] > 0 && !parallel {
					break
				}
				delta := map[string]any{"tool_calls": []any{c.openAI(calls[i])}}
				calls[i]++
				if !chunk(map[string]any{"index": i, "delta": delta, "finish_reason": nil}) {
					return false
				}
			}
			if s.Done {
				// A stream's token ids come whole with its finish: its text
				// chunks follow the tool-call parser, not the tokens.
				return chunk(req.withTokenIDs(map[string]any{"index": i, "delta": map[string]any{},
					"finish_reason": chatFinish(s.Finish, calls[i])}, prompts[i].tokenized.InputIDs, s.OutputIDs))
			}
			return true
		})
		req.finishStream(sse, reply, final)
		return
	}
	snaps, err := m.waitAll(r.Context(), prompts)
	if err != nil {
		writeError(w, badRequest{err})
		return
	}
	choices := make([]any, len(snaps))
	parser := req.reasoningParser(m.reasoning)
	for i, s := range snaps {
		answer := s.Text
		msg := map[string]any{"role": "assistant"}
		if parser != nil {
			var thought string
			thought, answer = parser.split(s.Text)
			msg["reasoning_content"] = nilIfEmpty(thought)
		}
		msg["content"] = answer
		ncalls := 0
		if format != 0 {
			content, calls := newToolStream(format).Finish(answer)
			if len(calls) > 0 {
				if !parallel {
					calls = calls[:1]
				}
				list := make([]any, len(calls))
				for j, c := range calls {
					list[j] = c.openAI(j)
				}
				msg["tool_calls"], msg["content"] = list, nilIfEmpty(strings.TrimSpace(content))
				ncalls = len(calls)
			}
		}
		c := map[string]any{"index": i, "message": msg, "logprobs": nil, "finish_reason": chatFinish(s.Finish, ncalls)}
		if req.Logprobs {
			c["logprobs"] = m.chatLogprobs(s)
		}
		choices[i] = req.withTokenIDs(c, prompts[i].tokenized.InputIDs, s.OutputIDs)
	}
	writeJSON(w, http.StatusOK, reply.complete(choices, snaps))
}

// chatFinish is "tool_calls" when the model stopped after calling tools.
func chatFinish(fr *ioschema.FinishReason, calls int) any {
	if calls > 0 && (fr == nil || fr.Type == "stop") {
		return "tool_calls"
	}
	return finishString(fr)
}

func nilIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// chatLogprobs is the chat completions logprobs object.
func (m *Manager) chatLogprobs(s snapshot) map[string]any {
	content := make([]any, len(s.OutputIDs))
	for i, id := range s.OutputIDs {
		tok := m.tokenText(id)
		e := map[string]any{"token": tok, "bytes": byteList(tok), "logprob": nil, "top_logprobs": []any{}}
		if i < len(s.OutLogprobs) {
			e["logprob"] = float64(s.OutLogprobs[i])
		}
		if i < len(s.OutTopVals) {
			var top []any
			for j, v := range s.OutTopVals[i] {
				t := m.tokenText(s.OutTopIdx[i][j])
				top = append(top, map[string]any{"token": t, "bytes": byteList(t), "logprob": float64(v)})
			}
			e["top_logprobs"] = top
		}
		content[i] = e
	}
	return map[string]any{"content": content}
}

// byteList is OpenAI's "bytes": the UTF-8 bytes as a list of integers.
func byteList(s string) []int {
	out := make([]int, len(s))
	for i := 0; i < len(s); i++ {
		out[i] = int(s[i])
	}
	return out
}
