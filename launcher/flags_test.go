package launcher

import (
	"io"
	"net/http"
	"os/exec"
	"strings"
	"testing"
)

// TestSGLangLaunchFlagsAndAPIKey starts ebb as an RL framework launches
// SGLang, then checks --api-key on HTTP and on the external ZMQ socket.
func TestSGLangLaunchFlagsAndAPIKey(t *testing.T) {
	s := startServer(t, "--model-path", modelDir, "--tp-size", "1", "--dp-size", "1", "--enable-memory-saver",
		"--skip-server-warmup", "--trust-remote-code", "--random-seed", "1", "--api-key", "k", "--dtype", "bfloat16",
		"--disable-radix-cache", "--enable-metrics", "--served-model-name", "ebb-test", "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25",
		"--schedule-policy", "lpm")
	call := func(method, path, key, body string) int {
		req, _ := http.NewRequest(method, s.url+path, strings.NewReader(body))
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	gen := `{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}`
	for _, c := range []struct {
		method, path, key, body string
		want                    int
	}{
		{"POST", "/generate", "", gen, 401},
		{"POST", "/generate", "wrong", gen, 401},
		{"GET", "/v1/models", "", "", 401},
		{"GET", "/server_info", "", "", 401},
		{"POST", "/flush_cache", "", "", 401},
		{"GET", "/health", "", "", 200},
		{"GET", "/metrics", "", "", 200},
		{"POST", "/generate", "k", gen, 200},
		{"PUT", "/generate", "k", gen, 200},
		{"POST", "/tokenize", "", `{"prompt": "hi"}`, 401},
		{"POST", "/v1/tokenize", "k", `{"prompt": "hi"}`, 200},
		{"GET", "/get_weight_version", "k", "", 200},
		{"GET", "/v1/models", "k", "", 200},
		{"GET", "/get_server_info", "k", "", 200},
		{"GET", "/get_model_info", "k", "", 200},
	} {
		if got := call(c.method, c.path, c.key, c.body); got != c.want {
			t.Errorf("%s %s with key %q: %d, want %d", c.method, c.path, c.key, got, c.want)
		}
	}
	info, _ := http.NewRequest("GET", s.url+"/server_info", nil)
	info.Header.Set("Authorization", "Bearer k")
	resp, err := http.DefaultClient.Do(info)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `"schedule_policy":"lpm"`) {
		t.Errorf("/server_info does not report --schedule-policy lpm: %s", body)
	}
	// SGLang's metric names, so its Grafana dashboards read ebb.
	resp, err = http.Get(s.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, name := range []string{"sglang:prompt_tokens_total{model_name=\"ebb-test\"}", "sglang:generation_tokens_total",
		"sglang:num_running_reqs{", "sglang:num_queue_reqs{", "sglang:token_usage{", "sglang:cache_hit_rate{",
		"sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds_bucket",
		"sglang:e2e_request_latency_seconds_count", "sglang:gen_throughput{", "# TYPE sglang:prompt_tokens_total counter",
		"# TYPE sglang:num_running_reqs gauge", "# TYPE sglang:e2e_request_latency_seconds histogram"} {
		if !strings.Contains(string(body), name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	sock := s.dealer(t)
	req := map[string]any{"type": "GenerateReqInput", "rid": "z1", "input_ids": []int{1, 2, 3},
		"sampling_params": map[string]any{"max_new_tokens": 2}}
	if reply := zmqCall(t, sock, enc(req)); reply["type"] != "ErrorOutput" || !strings.Contains(reply["message"].(string), "api_key") {
		t.Fatalf("ZMQ without the key: %v", reply)
	}
	req["api_key"] = "k"
	if reply := zmqCall(t, sock, enc(req)); reply["type"] != "GenerateReqOutput" || reply["rid"] != "z1" {
		t.Fatalf("ZMQ with the key: %v", reply)
	}
}

// TestUnsupportedLaunchFlagsAreErrors: a flag ebb does not take, a dtype
// it does not run, or a model that does not split over the ranks asked for
// stops `ebb serve` with an error naming it.
func TestUnsupportedLaunchFlagsAreErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--model-path", modelDir, "--speculative-algorithm", "EAGLE"}, "--speculative-algorithm"},
		{[]string{"--model-path", modelDir, "--device", "cpu", "--dtype", "float16"}, "--dtype float16"},
		// Every rank fails at start (the children start together): the error names why.
		{[]string{"--model-path", modelDir, "--device", "cpu", "--tp-size", "3"}, "do not split over 3 ranks"},
		{[]string{"--model-path", modelDir, "--device", "cpu", "--dp-size", "2", "--load-balance-method", "follow_bootstrap_room"}, "prefill/decode disaggregation"},
		{[]string{"--model-path", modelDir, "--device", "cpu", "--load-balance-method", "shortest_queue"}, "round_robin"},
		{[]string{"--model-path", modelDir, "--device", "cpu", "--tool-call-parser", "pythonic"}, `--tool-call-parser "pythonic": ebb takes hermes, llama3, qwen, qwen25`},
		{[]string{"--model-path", modelDir, "--device", "cpu", "--schedule-policy", "priority"}, `unknown schedule policy "priority" (ebb takes fcfs, lpm, dfs-weight, lof, random)`},
		{[]string{"--model-path", modelDir, "--device", "cpu", "--reasoning-parser", "kimi"}, `--reasoning-parser "kimi": ebb takes deepseek-r1, qwen3, qwen3-thinking`},
	} {
		out, err := exec.Command(ebbBin, append([]string{"serve", "--port", "0"}, c.args...)...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), c.want) {
			t.Errorf("ebb serve %v: err %v, output lacks %q:\n%s", c.args, err, c.want, out)
		}
	}
}
