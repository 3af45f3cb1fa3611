package launcher

import (
	"net/http"
	"strings"
	"testing"
)

// tinyContext is the e2e model's max_position_embeddings (tinymodel.Default).
const tinyContext = 4096

type errorReply struct {
	Error struct {
		Message string `json:"message"`
		Code    int    `json:"code"`
	} `json:"error"`
}

// TestContextLimits: a request past the context is a 400 with SGLang's
// message on /generate, the OpenAI endpoints and the ZMQ API, a body past
// --max-request-body-mb a 413, and the server keeps serving; with
// --allow-auto-truncate the prompt keeps its first tokens and
// max_new_tokens what is left.
func TestContextLimits(t *testing.T) {
	s := startServer(t, "--max-request-body-mb", "1")
	long := strings.Repeat("hello world ", 3000) // about 6,000 tokens
	ids := make([]int, 100)
	for i := range ids {
		ids[i] = i + 1
	}
	total := "Requested token count exceeds the model's maximum context length of 4096 tokens. " +
		"You requested a total of 1000100 tokens: 100 tokens from the input messages and 1000000 tokens for the completion."
	longer := "is longer than the model's context length (4096 tokens)."
	for _, c := range []struct {
		name, path string
		body       map[string]any
		want       string
	}{
		{"generate, max_new_tokens", "/generate", map[string]any{"input_ids": ids,
			"sampling_params": map[string]any{"max_new_tokens": 1000000}}, total},
		{"generate, input_ids", "/generate", map[string]any{"input_ids": make([]int, tinyContext)}, "The input (4096 tokens) " + longer},
		{"generate, text", "/generate", map[string]any{"text": long, "sampling_params": map[string]any{"max_new_tokens": 4}}, longer},
		{"completions", "/v1/completions", map[string]any{"prompt": ids, "max_tokens": 1000000}, total},
		{"chat", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": long}}}, longer},
	} {
		var out errorReply
		if code := s.post(t, c.path, c.body, &out); code != http.StatusBadRequest || !strings.Contains(out.Error.Message, c.want) {
			t.Errorf("%s: %d %q, want 400 with %q", c.name, code, out.Error.Message, c.want)
		}
	}
	reply := zmqCall(t, s.dealer(t), enc(map[string]any{"type": "GenerateReqInput", "rid": "z1", "input_ids": ids,
		"sampling_params": map[string]any{"max_new_tokens": 1000000}}))
	if reply["type"] != "ErrorOutput" || reply["rid"] != "z1" || !strings.Contains(reply["message"].(string), total) {
		t.Errorf("ZMQ: %v", reply)
	}
	resp, err := http.Post(s.url+"/generate", "application/json", strings.NewReader(`{"text": "`+strings.Repeat("a", 2<<20)+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("a 2 MiB body under --max-request-body-mb 1: %d, want 413", resp.StatusCode)
	}
	if info := s.info(t); info["allow_auto_truncate"] != false || info["max_request_body_bytes"] != float64(1<<20) {
		t.Errorf("server_info: allow_auto_truncate %v, max_request_body_bytes %v", info["allow_auto_truncate"], info["max_request_body_bytes"])
	}
	var ok genResult
	if code := s.post(t, "/generate", map[string]any{"input_ids": ids, "sampling_params": map[string]any{"max_new_tokens": 3}}, &ok); code != 200 || ok.MetaInfo.CompletionTokens != 3 {
		t.Fatalf("after the refusals: %d %+v", code, ok)
	}

	auto := startServer(t, "--allow-auto-truncate")
	if info := auto.info(t); info["allow_auto_truncate"] != true || info["max_request_body_bytes"] != float64(16<<20) {
		t.Errorf("server_info with --allow-auto-truncate: %v, %v", info["allow_auto_truncate"], info["max_request_body_bytes"])
	}
	for _, c := range []struct {
		name             string
		body             map[string]any
		prompt, complete int
	}{
		{"max_new_tokens clipped", map[string]any{"input_ids": make([]int, tinyContext-6),
			"sampling_params": map[string]any{"max_new_tokens": 1000000, "ignore_eos": true}}, tinyContext - 6, 6},
		{"prompt clipped", map[string]any{"text": long,
			"sampling_params": map[string]any{"max_new_tokens": 4, "ignore_eos": true}}, tinyContext - 1, 1},
	} {
		var out struct {
			MetaInfo struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
			} `json:"meta_info"`
		}
		if code := auto.post(t, "/generate", c.body, &out); code != 200 || out.MetaInfo.PromptTokens != c.prompt || out.MetaInfo.CompletionTokens != c.complete {
			t.Errorf("--allow-auto-truncate, %s: %d, %d prompt and %d completion tokens, want %d and %d",
				c.name, code, out.MetaInfo.PromptTokens, out.MetaInfo.CompletionTokens, c.prompt, c.complete)
		}
	}
}
