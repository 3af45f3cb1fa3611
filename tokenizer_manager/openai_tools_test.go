package tokenizermanager

import (
	"bufio"
	"context"
	"encoding/json"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/zap"

	"ebb/ioschema"
	"ebb/tokenizer"
)

const scriptedCall = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>"

// scriptedScheduler stands in for the scheduler and detokenizer: it answers
// every request with fixed text in small pieces. A prompt whose chat
// template rendered tools gets a tool call; any other gets "Hello there!".
func scriptedScheduler(t *testing.T, ctx context.Context, m *Manager, in, out string) {
	t.Helper()
	zctx, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	pull, _ := zctx.NewSocket(zmq.PULL)
	push, _ := zctx.NewSocket(zmq.PUSH)
	pull.SetLinger(0)
	push.SetLinger(0)
	if err := pull.Bind(in); err != nil {
		t.Fatal(err)
	}
	if err := push.Connect(out); err != nil {
		t.Fatal(err)
	}
	pull.SetRcvtimeo(100e6)
	go func() {
		defer func() { pull.Close(); push.Close(); zctx.Term() }()
		for ctx.Err() == nil {
			b, err := pull.RecvBytes(0)
			if err != nil {
				continue
			}
			msg, err := ioschema.Decode(b)
			req, ok := msg.(*ioschema.TokenizedGenerateReqInput)
			if err != nil || !ok {
				continue
			}
			text := "Hello there!"
			if strings.Contains(m.Tokenizer.Decode(req.InputIDs, false), "<tools>") {
				text = "Let me check. " + scriptedCall
			}
			if strings.Contains(m.Tokenizer.Decode(req.InputIDs, false), "Think first") {
				text = scriptedThought
			}
			pieces := splitEvery(text, 7)
			for i, p := range pieces {
				o := &ioschema.BatchStrOutput{OutputStrs: []string{p}}
				t := o.Outputs()
				t.Rids = []string{req.Rid}
				t.OutputIDs = []ioschema.Int32s{{int32(i % 100)}}
				t.PromptTokens, t.CompletionTokens, t.CachedTokens = []int{len(req.InputIDs)}, []int{i + 1}, []int{0}
				var fr *ioschema.FinishReason
				if i == len(pieces)-1 {
					fr = ioschema.FinishStopToken(2)
				}
				t.FinishedReasons = []*ioschema.FinishReason{fr}
				enc, _ := ioschema.Encode(o)
				push.SendBytes(enc, 0)
			}
		}
	}()
}

func splitEvery(s string, n int) []string {
	var out []string
	for len(s) > n {
		out, s = append(out, s[:n]), s[n:]
	}
	return append(out, s)
}

// scriptedThought is the scripted reply to a prompt that asks to think.
const scriptedThought = "<think>\nThe user greets me.\n</think>\n\nHello there!"

// scriptedServer serves the scripted scheduler's replies; opts change the
// manager's Config.
func scriptedServer(t *testing.T, opts ...func(*Config)) *httptest.Server {
	t.Helper()
	dir := t.TempDir()
	cfg := Config{ModelDir: "../assets/default-model", SchedulerEndpoints: []string{"ipc://" + filepath.Join(dir, "s")},
		InputEndpoint: "ipc://" + filepath.Join(dir, "t")}
	for _, o := range opts {
		o(&cfg)
	}
	m, err := New(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	scriptedScheduler(t, ctx, m, cfg.SchedulerEndpoints[0], cfg.InputEndpoint)
	if err := m.Start(ctx); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Handler())
	t.Cleanup(func() { srv.Close(); cancel(); m.Close() })
	return srv
}

var weatherTools = []any{map[string]any{"type": "function", "function": map[string]any{"name": "get_weather",
	"description": "Current weather in a city", "parameters": map[string]any{"type": "object",
		"properties": map[string]any{"city": map[string]any{"type": "string"}, "unit": map[string]any{"type": "string"}},
		"required":   []string{"city"}}}}}

func postJSON(t *testing.T, url string, body any) (int, map[string]any) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out
}

func TestChatToolCalls(t *testing.T) {
	srv := scriptedServer(t)
	msgs := []any{map[string]any{"role": "user", "content": "What is the weather in Paris?"}}
	code, out := postJSON(t, srv.URL+"/v1/chat/completions", map[string]any{"model": "m", "messages": msgs, "tools": weatherTools})
	if code != 200 {
		t.Fatalf("status %d: %v", code, out)
	}
	choice := out["choices"].([]any)[0].(map[string]any)
	msg := choice["message"].(map[string]any)
	calls, _ := msg["tool_calls"].([]any)
	if choice["finish_reason"] != "tool_calls" || len(calls) != 1 || msg["content"] != "Let me check." {
		t.Fatalf("choice: %v", choice)
	}
	fn := calls[0].(map[string]any)["function"].(map[string]any)
	var args map[string]string
	if fn["name"] != "get_weather" || json.Unmarshal([]byte(fn["arguments"].(string)), &args) != nil || args["city"] != "Paris" {
		t.Fatalf("call: %v", calls[0])
	}
	// tool_choice "none": no tools in the prompt, and the reply is text.
	code, out = postJSON(t, srv.URL+"/v1/chat/completions", map[string]any{"model": "m", "messages": msgs, "tools": weatherTools, "tool_choice": "none"})
	choice = out["choices"].([]any)[0].(map[string]any)
	if code != 200 || choice["finish_reason"] != "stop" || choice["message"].(map[string]any)["content"] != "Hello there!" {
		t.Fatalf("tool_choice none: %d %v", code, out)
	}
	// Streaming: content first, then the call, then finish_reason tool_calls.
	b, _ := json.Marshal(map[string]any{"model": "m", "messages": msgs, "tools": weatherTools, "stream": true})
	resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	var content, name, args2, finish string
	for _, line := range sseData(t, resp) {
		var chunk struct {
			Choices []struct {
				Delta struct {
					Content   string `json:"content"`
					ToolCalls []struct {
						Function struct{ Name, Arguments string }
					} `json:"tool_calls"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(line), &chunk); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		for _, c := range chunk.Choices {
			content += c.Delta.Content
			for _, tc := range c.Delta.ToolCalls {
				name += tc.Function.Name
				args2 += tc.Function.Arguments
			}
			if c.FinishReason != nil {
				finish = *c.FinishReason
			}
		}
	}
	if strings.TrimSpace(content) != "Let me check." || name != "get_weather" || !strings.Contains(args2, "Paris") || finish != "tool_calls" {
		t.Fatalf("stream: content %q name %q args %q finish %q", content, name, args2, finish)
	}
}

func TestOpenAIRefusesWhatItCannotHonour(t *testing.T) {
	srv := scriptedServer(t)
	msgs := []any{map[string]any{"role": "user", "content": "hi"}}
	for _, c := range []struct {
		path  string
		extra map[string]any
		want  string
	}{
		{"/v1/chat/completions", map[string]any{"response_format": map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "x"}}}, "response_format"},
		{"/v1/chat/completions", map[string]any{"response_format": map[string]any{"type": "json_object"}}, "response_format"},
		{"/v1/chat/completions", map[string]any{"tool_choice": "required", "tools": weatherTools}, "tool_choice"},
		{"/v1/chat/completions", map[string]any{"frobnicate": true}, "frobnicate"},
		{"/v1/chat/completions", map[string]any{"n": 0}, "n must be at least 1"},
		{"/v1/completions", map[string]any{"best_of": 3}, "best_of"},
		{"/v1/completions", map[string]any{"suffix": "}"}, "suffix"},
	} {
		body := map[string]any{"model": "m"}
		if strings.Contains(c.path, "chat") {
			body["messages"] = msgs
		} else {
			body["prompt"] = "hi"
		}
		for k, v := range c.extra {
			body[k] = v
		}
		code, out := postJSON(t, srv.URL+c.path, body)
		if code != 400 || !strings.Contains(fmtJSON(out), c.want) {
			t.Errorf("%s %v: %d %v (want a 400 naming %q)", c.path, c.extra, code, out, c.want)
		}
	}
	// Values that ask for nothing ebb lacks are fine.
	code, out := postJSON(t, srv.URL+"/v1/chat/completions", map[string]any{"model": "m", "messages": msgs,
		"response_format": map[string]any{"type": "text"}, "logit_bias": map[string]any{}, "user": "u1", "parallel_tool_calls": true})
	if code != 200 {
		t.Fatalf("plain values refused: %d %v", code, out)
	}
}

func fmtJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// TestOpenAISDKSeesToolCalls drives the tool-call path with the official
// OpenAI SDK for Node (installed by scripts/install-deps.sh into
// .cache/npm; skipped where npm is not available).
func TestOpenAISDKSeesToolCalls(t *testing.T) {
	sdk, _ := filepath.Abs("../.cache/npm/node_modules")
	if _, err := os.Stat(filepath.Join(sdk, "openai")); err != nil {
		t.Skip("the openai npm package is not installed (scripts/install-deps.sh installs it where npm works)")
	}
	if _, err := exec.LookPath("node"); err != nil {
		t.Skip("no node")
	}
	srv := scriptedServer(t)
	cmd := exec.Command("node", "testdata/openai_sdk_tools.js", srv.URL+"/v1")
	cmd.Env = append(os.Environ(), "NODE_PATH="+sdk)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var res struct {
		Finish, StreamFinish, Name, StreamName, City, StreamArgs string
		JSONSchemaStatus                                         int
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if res.Finish != "tool_calls" || res.Name != "get_weather" || res.City != "Paris" || res.StreamFinish != "tool_calls" ||
		res.StreamName != "get_weather" || !strings.Contains(res.StreamArgs, "Paris") || res.JSONSchemaStatus != 400 {
		t.Fatalf("the SDK saw %+v", res)
	}
	t.Logf("openai SDK: %s", out)
}

// TestCompletionEcho: echo puts the prompt before the completion, whole or
// streamed (in the first chunk, as SGLang sends it).
func TestCompletionEcho(t *testing.T) {
	srv := scriptedServer(t)
	code, out := postJSON(t, srv.URL+"/v1/completions", map[string]any{"model": "m", "prompt": "Say hi.", "echo": true})
	if text := out["choices"].([]any)[0].(map[string]any)["text"]; code != 200 || text != "Say hi.Hello there!" {
		t.Fatalf("echo: %d %v", code, out)
	}
	b, _ := json.Marshal(map[string]any{"model": "m", "prompt": "Say hi.", "echo": true, "stream": true})
	resp, err := http.Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	var chunks []string
	for _, line := range sseData(t, resp) {
		var chunk struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(line), &chunk); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		for _, c := range chunk.Choices {
			chunks = append(chunks, c.Text)
		}
	}
	if len(chunks) == 0 || !strings.HasPrefix(chunks[0], "Say hi.") || strings.Join(chunks, "") != "Say hi.Hello there!" {
		t.Fatalf("streamed echo: %q", chunks)
	}
}

// TestCompletionLogprobsEcho: with echo the legacy logprobs object starts
// with the prompt's tokens, null where a token has no logprob (the first)
// or no alternatives, then the completion's.
func TestCompletionLogprobsEcho(t *testing.T) {
	tok, err := tokenizer.Embedded("qwen3")
	if err != nil {
		t.Fatal(err)
	}
	m := &Manager{Tokenizer: tok, log: zap.NewNop()}
	nan := float32(math.NaN())
	s := snapshot{InIdx: []int32{9707, 1879}, InLogprobs: []float32{nan, -1.5},
		InTopVals: [][]float32{nil, {-0.5, -1.5}}, InTopIdx: [][]int32{nil, {11, 1879}},
		OutputIDs: []int32{0}, OutLogprobs: []float32{-0.25}, OutTopVals: [][]float32{{-0.25, -3}}, OutTopIdx: [][]int32{{0, 11}}}
	for _, echo := range []bool{true, false} {
		got, _ := json.Marshal(m.completionLogprobs(s, echo))
		want := `{"token_logprobs":[null,-1.5,-0.25],"tokens":["Hello"," world","!"],"top_logprobs":[null,{" world":-1.5,",":-0.5},{"!":-0.25,",":-3}]}`
		if !echo {
			want = `{"token_logprobs":[-0.25],"tokens":["!"],"top_logprobs":[{"!":-0.25,",":-3}]}`
		}
		if string(got) != want {
			t.Errorf("echo %v:\n got %s\nwant %s", echo, got, want)
		}
	}
}

// sseData reads a streamed response to its end: the data of each event
// but the closing [DONE].
func sseData(t *testing.T, resp *http.Response) []string {
	t.Helper()
	defer resp.Body.Close()
	var lines []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := strings.TrimPrefix(sc.Text(), "data: ")
		if line == "" || line == "[DONE]" || line == sc.Text() {
			continue
		}
		lines = append(lines, line)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return lines
}

// TestToolCallParserFlag: --tool-call-parser names the syntax tool calls
// are read in, whatever the chat template's: with llama3's JSON a reply of
// <tool_call> blocks is text; with qwen25 it is the call, as the template
// would have it.
func TestToolCallParserFlag(t *testing.T) {
	msgs := []any{map[string]any{"role": "user", "content": "What is the weather in Paris?"}}
	for _, c := range []struct {
		parser string
		calls  int
	}{{"qwen25", 1}, {"llama3", 0}} {
		srv := scriptedServer(t, func(cfg *Config) { cfg.ToolCallParser = c.parser })
		code, out := postJSON(t, srv.URL+"/v1/chat/completions", map[string]any{"model": "m", "messages": msgs, "tools": weatherTools})
		msg := out["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)
		calls, _ := msg["tool_calls"].([]any)
		if code != 200 || len(calls) != c.calls {
			t.Errorf("%s: %d, %v", c.parser, code, msg)
		}
	}
	if _, err := parseToolCallParser("mistral"); err == nil || !strings.Contains(err.Error(), "hermes, llama3, qwen, qwen25") {
		t.Errorf("an unknown parser: %v", err)
	}
}
