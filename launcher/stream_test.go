package launcher

import (
	"bufio"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
)

// TestIncrementalStreamingOutput: with --incremental-streaming-output each
// /generate chunk carries only its new text, ids and output logprobs, and
// together they are what the unstreamed request returns.
func TestIncrementalStreamingOutput(t *testing.T) {
	s := startServer(t, "--incremental-streaming-output")
	body := map[string]any{"text": "package main\n\nimport (\n", "return_logprob": true,
		"sampling_params": map[string]any{"max_new_tokens": 24, "temperature": 0, "ignore_eos": true}}
	type chunk struct {
		Text      string  `json:"text"`
		OutputIDs []int32 `json:"output_ids"`
		MetaInfo  struct {
			CompletionTokens int     `json:"completion_tokens"`
			Logprobs         [][]any `json:"output_token_logprobs"`
		} `json:"meta_info"`
	}
	var whole chunk
	s.post(t, "/generate", body, &whole)

	body["stream"] = true
	b, _ := json.Marshal(body)
	resp, err := http.Post(s.url+"/generate", "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var text strings.Builder
	var ids []int32
	var logprobs [][]any
	chunks := 0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: ") || line == "data: [DONE]" {
			continue
		}
		var c chunk
		if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &c); err != nil {
			t.Fatal(err)
		}
		if len(c.OutputIDs) != len(c.MetaInfo.Logprobs) || len(c.OutputIDs) > 4 {
			t.Fatalf("chunk %d: %d ids, %d logprobs: not a delta", chunks, len(c.OutputIDs), len(c.MetaInfo.Logprobs))
		}
		chunks++
		text.WriteString(c.Text)
		ids = append(ids, c.OutputIDs...)
		logprobs = append(logprobs, c.MetaInfo.Logprobs...)
		if len(ids) > 0 && c.MetaInfo.CompletionTokens != len(ids) {
			t.Errorf("chunk %d: completion_tokens %d, %d ids so far", chunks, c.MetaInfo.CompletionTokens, len(ids))
		}
	}
	if chunks < 6 {
		t.Fatalf("%d chunks for 24 tokens", chunks)
	}
	if text.String() != whole.Text || !slices.Equal(ids, whole.OutputIDs) {
		t.Fatalf("chunks add up to %q %v, the whole request is %q %v", text.String(), ids, whole.Text, whole.OutputIDs)
	}
	for i := range logprobs {
		if logprobs[i][1] != whole.MetaInfo.Logprobs[i][1] || logprobs[i][0] != whole.MetaInfo.Logprobs[i][0] {
			t.Fatalf("logprob %d: %v streamed, %v whole", i, logprobs[i], whole.MetaInfo.Logprobs[i])
		}
	}
}
