package launcher

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
)

// sseObjects posts body to path and returns every data object of the SSE
// stream, failing unless the stream ends with [DONE].
func (s *server) sseObjects(t *testing.T, path string, body map[string]any) []map[string]any {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(s.url+path, "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var objs []map[string]any
	done := false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if done {
			t.Fatalf("%s: data after [DONE]: %s", path, line)
		}
		if line == "[DONE]" {
			done = true
			continue
		}
		var o map[string]any
		if err := json.Unmarshal([]byte(line), &o); err != nil {
			t.Fatalf("%s: %v in %s", path, err, line)
		}
		objs = append(objs, o)
	}
	if !done {
		t.Fatalf("%s: stream ended without [DONE]", path)
	}
	return objs
}

type openAIUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

type completionResponse struct {
	Object  string `json:"object"`
	Choices []struct {
		Index        int    `json:"index"`
		Text         string `json:"text"`
		FinishReason string `json:"finish_reason"`
		Message      struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Logprobs struct {
			Content []struct {
				Token   string   `json:"token"`
				Logprob *float64 `json:"logprob"`
			} `json:"content"`
		} `json:"logprobs"`
	} `json:"choices"`
	Usage openAIUsage `json:"usage"`
}

// TestOpenAICompletions: greedy /v1/completions returns /generate's text,
// with echo, n > 1 and streaming (with the usage chunk) agreeing with it.
func TestOpenAICompletions(t *testing.T) {
	s := startServer(t)
	const prompt, maxTokens = "Once upon a time", 12
	var gen genResult
	s.post(t, "/generate", map[string]any{"text": prompt, "sampling_params": map[string]any{"max_new_tokens": maxTokens, "temperature": 0}}, &gen)
	req := func(extra map[string]any) map[string]any {
		b := map[string]any{"model": "tiny", "prompt": prompt, "max_tokens": maxTokens, "temperature": 0}
		for k, v := range extra {
			b[k] = v
		}
		return b
	}

	var got completionResponse
	if code := s.post(t, "/v1/completions", req(nil), &got); code != 200 {
		t.Fatalf("status %d", code)
	}
	if got.Object != "text_completion" || len(got.Choices) != 1 || got.Choices[0].Text != gen.Text || got.Choices[0].FinishReason != "length" {
		t.Fatalf("completion %+v, want text %q", got, gen.Text)
	}
	if u := got.Usage; u.CompletionTokens != maxTokens || u.TotalTokens != u.PromptTokens+maxTokens || u.PromptTokens == 0 {
		t.Fatalf("usage %+v", u)
	}

	var echo completionResponse
	s.post(t, "/v1/completions", req(map[string]any{"echo": true}), &echo)
	if echo.Choices[0].Text != prompt+gen.Text {
		t.Fatalf("echo %q, want %q", echo.Choices[0].Text, prompt+gen.Text)
	}

	var two completionResponse
	s.post(t, "/v1/completions", req(map[string]any{"n": 2}), &two)
	if len(two.Choices) != 2 || two.Usage.CompletionTokens != 2*maxTokens {
		t.Fatalf("n=2: %+v", two)
	}
	for i, c := range two.Choices {
		if c.Index != i || c.Text != gen.Text {
			t.Fatalf("n=2 choice %d: %+v", i, c)
		}
	}

	objs := s.sseObjects(t, "/v1/completions", req(map[string]any{"stream": true, "stream_options": map[string]any{"include_usage": true}}))
	var text strings.Builder
	for _, o := range objs[:len(objs)-1] {
		c := o["choices"].([]any)[0].(map[string]any)
		text.WriteString(c["text"].(string))
	}
	if text.String() != gen.Text {
		t.Fatalf("streamed %q, want %q", text.String(), gen.Text)
	}
	last := objs[len(objs)-1]
	if len(last["choices"].([]any)) != 0 || last["usage"].(map[string]any)["completion_tokens"].(float64) != maxTokens {
		t.Fatalf("usage chunk %v", last)
	}

	// logit_bias reaches the sampler from the OpenAI endpoint: a large
	// bias makes greedy decoding pick its token throughout.
	forced := gen.OutputIDs[len(gen.OutputIDs)-1] + 1
	var biased struct {
		Choices []struct {
			TokenIDs []int32 `json:"token_ids"`
		} `json:"choices"`
	}
	s.post(t, "/v1/completions", req(map[string]any{"logit_bias": map[string]any{fmt.Sprint(forced): 100}, "return_token_ids": true}), &biased)
	if len(biased.Choices) != 1 || len(biased.Choices[0].TokenIDs) != maxTokens || slices.ContainsFunc(biased.Choices[0].TokenIDs, func(id int32) bool { return id != forced }) {
		t.Fatalf("logit_bias {%d: 100}: %+v", forced, biased)
	}
	if code := s.post(t, "/v1/completions", req(map[string]any{"logit_bias": map[string]any{"999999999": 1}}), nil); code != 400 {
		t.Fatalf("logit_bias past the vocabulary: status %d", code)
	}

	// stop_regex on /generate ends on the token that completes a match;
	// finish_reason.matched names the pattern.
	var stopped struct {
		Text     string `json:"text"`
		MetaInfo struct {
			FinishReason struct {
				Type    string `json:"type"`
				Matched string `json:"matched"`
			} `json:"finish_reason"`
		} `json:"meta_info"`
	}
	const pattern = `\S\s+\S`
	s.post(t, "/generate", map[string]any{"text": prompt, "sampling_params": map[string]any{"max_new_tokens": maxTokens, "temperature": 0,
		"stop_regex": pattern}}, &stopped)
	if fr := stopped.MetaInfo.FinishReason; fr.Type != "stop" || fr.Matched != pattern || !strings.HasPrefix(gen.Text, stopped.Text) || len(stopped.Text) >= len(gen.Text) {
		t.Fatalf("stop_regex %q: %+v, want a stop on %q within %q", pattern, stopped, pattern, gen.Text)
	}
	if code := s.post(t, "/generate", map[string]any{"text": prompt, "sampling_params": map[string]any{"stop_regex": "(?<=a)b"}}, nil); code != 400 {
		t.Fatalf("a lookbehind stop_regex: status %d", code)
	}
	var regexStop completionResponse
	s.post(t, "/v1/completions", req(map[string]any{"stop_regex": []string{pattern}}), &regexStop)
	if len(regexStop.Choices) != 1 || regexStop.Choices[0].FinishReason != "stop" || regexStop.Choices[0].Text != stopped.Text {
		t.Fatalf("stop_regex on /v1/completions: %+v, want %q", regexStop, stopped.Text)
	}
}

// TestOpenAIChat: streamed chat deltas add up to the non-streamed message,
// with the role first, the finish reason last and the usage chunk after.
func TestOpenAIChat(t *testing.T) {
	s := startServer(t)
	const maxTokens = 10
	body := func(extra map[string]any) map[string]any {
		b := map[string]any{"model": "tiny", "messages": []any{map[string]any{"role": "user", "content": "Say hello."}},
			"max_tokens": maxTokens, "temperature": 0}
		for k, v := range extra {
			b[k] = v
		}
		return b
	}
	var got completionResponse
	if code := s.post(t, "/v1/chat/completions", body(map[string]any{"logprobs": true}), &got); code != 200 {
		t.Fatalf("status %d", code)
	}
	if got.Object != "chat.completion" || len(got.Choices) != 1 {
		t.Fatalf("chat %+v", got)
	}
	msg := got.Choices[0]
	if msg.Message.Role != "assistant" || msg.Message.Content == "" || msg.FinishReason != "length" {
		t.Fatalf("chat choice %+v", msg)
	}
	if len(msg.Logprobs.Content) != maxTokens || got.Usage.CompletionTokens != maxTokens {
		t.Fatalf("%d logprobs, usage %+v; want %d", len(msg.Logprobs.Content), got.Usage, maxTokens)
	}
	for i, lp := range msg.Logprobs.Content {
		if lp.Logprob == nil || *lp.Logprob > 0 {
			t.Fatalf("logprob %d: %+v", i, lp)
		}
	}

	objs := s.sseObjects(t, "/v1/chat/completions", body(map[string]any{"stream": true, "stream_options": map[string]any{"include_usage": true}}))
	if len(objs) < 3 {
		t.Fatalf("only %d chunks", len(objs))
	}
	delta := func(o map[string]any) map[string]any {
		return o["choices"].([]any)[0].(map[string]any)["delta"].(map[string]any)
	}
	if objs[0]["object"] != "chat.completion.chunk" || delta(objs[0])["role"] != "assistant" {
		t.Fatalf("first chunk %v", objs[0])
	}
	var content strings.Builder
	for _, o := range objs[:len(objs)-1] {
		if c, ok := delta(o)["content"].(string); ok {
			content.WriteString(c)
		}
	}
	if content.String() != msg.Message.Content {
		t.Fatalf("streamed %q, want %q", content.String(), msg.Message.Content)
	}
	finish := objs[len(objs)-2]["choices"].([]any)[0].(map[string]any)["finish_reason"]
	if finish != "length" {
		t.Fatalf("last choice chunk finish_reason %v", finish)
	}
	last := objs[len(objs)-1]
	if len(last["choices"].([]any)) != 0 || last["usage"].(map[string]any)["completion_tokens"].(float64) != maxTokens {
		t.Fatalf("usage chunk %v", last)
	}
}
