package launcher

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"
)

// batchGreedy generates 8 prompts of different lengths in one request.
func batchGreedy(t *testing.T, s *server) [][]int32 {
	t.Helper()
	var prompts [][]int
	for i := range 8 {
		p := make([]int, 5+9*i)
		for j := range p {
			p[j] = (i*131 + j*37) % 500
		}
		prompts = append(prompts, p)
	}
	body := map[string]any{"input_ids": prompts, "sampling_params": map[string]any{"max_new_tokens": 10, "temperature": 0, "ignore_eos": true}}
	var out []genResult
	if code := s.post(t, "/generate", body, &out); code != 200 || len(out) != len(prompts) {
		t.Fatalf("batch generate: status %d, %d results\n%s", code, len(out), s.log.String())
	}
	var ids [][]int32
	for _, r := range out {
		ids = append(ids, r.OutputIDs)
	}
	return ids
}

// TestDataParallel: two CPU engines behind one tokenizer manager give the
// outputs of one engine; requests spread over both; control calls reach
// both and answer once, with each engine's reply; a call one engine
// refuses is an error.
func TestDataParallel(t *testing.T) {
	one := startServer(t)
	want, wantGreedy := batchGreedy(t, one), one.greedy(t)

	dp := startServer(t, "--dp-size", "2")
	if got := batchGreedy(t, dp); !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("dp 2: %v\none engine: %v", got, want)
	}
	info := dp.info(t)
	engines, _ := info["engines"].([]any)
	if info["dp_size"] != float64(2) || len(engines) != 2 {
		t.Fatalf("server_info: dp_size %v, %d engines", info["dp_size"], len(engines))
	}
	var total float64
	for i, e := range engines {
		n, _ := e.(map[string]any)["generated_tokens"].(float64)
		if n == 0 {
			t.Fatalf("engine %d generated nothing: requests were not spread", i)
		}
		total += n
	}
	if info["generated_tokens"] != total {
		t.Fatalf("generated_tokens %v, engines' sum %v", info["generated_tokens"], total)
	}
	routedToOneEngine(t, dp)
	followsConversation(t, dp)
	reportsLoads(t, dp)

	// verl's order, on both engines at once.
	for _, step := range []struct {
		path string
		body map[string]any
	}{
		{"/release_memory_occupation", map[string]any{"tags": []string{"kv_cache", "weights"}}},
		{"/resume_memory_occupation", map[string]any{"tags": []string{"weights"}}},
		{"/update_weights_from_disk", map[string]any{"model_path": modelDir}},
		{"/flush_cache", map[string]any{}},
		{"/resume_memory_occupation", map[string]any{"tags": []string{"kv_cache"}}},
		{"/pause_generation", map[string]any{"mode": "abort"}},
		{"/continue_generation", map[string]any{}},
	} {
		out := dp.mustPost(t, step.path, step.body)
		if detail, _ := out["engines"].([]any); len(detail) != 2 {
			t.Fatalf("%s: reply without both engines' detail: %v", step.path, out)
		}
	}
	if got := dp.greedy(t); !slices.Equal(got, wantGreedy) {
		t.Fatalf("after the cycle: %v, one engine: %v", got, wantGreedy)
	}
	var out map[string]any
	if code := dp.post(t, "/resume_memory_occupation", map[string]any{"tags": []string{"no_such_tag"}}, &out); code == 200 && out["success"] != false {
		t.Fatalf("an unknown tag succeeded: %v", out)
	}
	// Every engine would give the trainer's reference counts back.
	if code := dp.post(t, "/update_weights_from_tensor", map[string]any{"serialized_named_tensors": []string{"AA=="}}, &out); code != 400 ||
		!strings.Contains(fmt.Sprint(out), "dp-size") {
		t.Fatalf("update_weights_from_tensor with 2 engines: %d %v", code, out)
	}
	if got := dp.greedy(t); !slices.Equal(got, wantGreedy) {
		t.Fatalf("after a refused call: %v", got)
	}
}

// TestTensorParallelCPU: an engine split over 2 CPU rank processes (and two
// such engines side by side) gives the outputs of one process, also after
// a release / resume / update-from-disk cycle that every rank carries out.
func TestTensorParallelCPU(t *testing.T) {
	one := startServer(t, "--device", "cpu")
	want, wantGreedy := batchGreedy(t, one), one.greedy(t)
	for _, args := range [][]string{{"--tp-size", "2"}, {"--tp-size", "2", "--dp-size", "2"}} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			s := startServer(t, append([]string{"--device", "cpu"}, args...)...)
			if got := batchGreedy(t, s); !slices.EqualFunc(got, want, slices.Equal) {
				t.Fatalf("%v: %v\none process: %v", args, got, want)
			}
			if tp := s.info(t)["tp_size"]; tp != float64(2) {
				t.Fatalf("server_info tp_size %v", tp)
			}
			// Loads come from each engine's rank 0, one entry an engine.
			var loads loadsReply
			engines := 1
			if slices.Contains(args, "--dp-size") {
				engines = 2
			}
			if code := getJSON(t, s.url+"/v1/loads", &loads); code != 200 || loads.DPRankCount != engines || loads.Loads[engines-1].MaxTotal == 0 {
				t.Fatalf("/v1/loads: %d %+v", code, loads)
			}
			// memory_stats of every rank (of every engine).
			code, stats := s.get(t, "/memory_stats")
			ranks, _ := stats["tp_ranks"].([]any)
			if engines, _ := stats["engines"].([]any); len(engines) > 0 {
				ranks, _ = engines[len(engines)-1].(map[string]any)["tp_ranks"].([]any)
			}
			if code != 200 || len(ranks) != 1 || ranks[0].(map[string]any)["tags"] == nil {
				t.Fatalf("memory_stats: %d %v", code, stats)
			}
			for _, step := range []struct {
				path string
				body map[string]any
			}{
				{"/release_memory_occupation", map[string]any{}},
				{"/resume_memory_occupation", map[string]any{"tags": []string{"weights"}}},
				{"/update_weights_from_disk", map[string]any{"model_path": modelDir}},
				{"/resume_memory_occupation", map[string]any{"tags": []string{"kv_cache", "cuda_graph"}}},
			} {
				s.mustPost(t, step.path, step.body)
			}
			if got := s.greedy(t); !slices.Equal(got, wantGreedy) {
				t.Fatalf("after the cycle: %v, one process: %v", got, wantGreedy)
			}
			var out map[string]any
			if code := s.post(t, "/get_weights_by_name", map[string]any{"name": "model.layers.0.mlp.down_proj.weight"}, &out); code != 400 {
				t.Fatalf("reading a sharded weight: status %d %v", code, out)
			}
			// Malformed payloads, one per rank: every rank refuses, nothing
			// changes (with several engines the manager refuses first).
			refusal := "weights unchanged"
			if slices.Contains(args, "--dp-size") {
				refusal = "--dp-size 2 is not supported"
			}
			out = nil
			if code := s.post(t, "/update_weights_from_tensor", map[string]any{"serialized_named_tensors": []string{"AA==", "AA=="}}, &out); code != 400 ||
				!strings.Contains(fmt.Sprint(out), refusal) {
				t.Fatalf("malformed payloads with tensor parallelism: %d %v", code, out)
			}
			if got := s.greedy(t); !slices.Equal(got, wantGreedy) {
				t.Fatalf("after refused payloads: %v, one process: %v", got, wantGreedy)
			}
		})
	}
}

// engineTokens is each engine's generated_tokens.
func engineTokens(t *testing.T, s *server) []float64 {
	t.Helper()
	var n []float64
	engines, _ := s.info(t)["engines"].([]any)
	for _, e := range engines {
		v, _ := e.(map[string]any)["generated_tokens"].(float64)
		n = append(n, v)
	}
	return n
}

// routedToOneEngine: routed_dp_rank, and SGLang's older data_parallel_rank
// (what sgl-model-gateway's dp-aware mode sends) on /generate and the OpenAI
// endpoints, send every prompt of a request to that engine; a rank the
// server does not run is a 400 that says so.
func routedToOneEngine(t *testing.T, dp *server) {
	t.Helper()
	greedy := map[string]any{"max_new_tokens": 5, "temperature": 0, "ignore_eos": true}
	for _, tc := range []struct {
		path   string
		body   map[string]any
		engine int
		tokens float64
	}{
		{"/generate", map[string]any{"input_ids": [][]int{{1, 2, 3}, {4, 5, 6, 7}}, "sampling_params": greedy, "routed_dp_rank": 1}, 1, 10},
		{"/generate", map[string]any{"input_ids": []int{8, 9}, "sampling_params": greedy, "data_parallel_rank": 0}, 0, 5},
		// n > 1: the prefix is prefilled on the named engine and the copies follow it.
		{"/generate", map[string]any{"input_ids": []int{8, 9, 10}, "sampling_params": map[string]any{"max_new_tokens": 5,
			"temperature": 0, "ignore_eos": true, "n": 3}, "routed_dp_rank": 1, "data_parallel_rank": 0}, 1, 15},
		{"/v1/completions", map[string]any{"prompt": []int{3, 1, 4}, "max_tokens": 4, "temperature": 0, "ignore_eos": true,
			"data_parallel_rank": 1}, 1, 4},
		{"/v1/completions", map[string]any{"prompt": []int{3, 1, 4}, "max_tokens": 4, "temperature": 0, "ignore_eos": true,
			"routed_dp_rank": 0}, 0, 4},
	} {
		before := engineTokens(t, dp)
		var out any
		if code := dp.post(t, tc.path, tc.body, &out); code != 200 {
			t.Fatalf("%s %v: status %d %v", tc.path, tc.body, code, out)
		}
		after := engineTokens(t, dp)
		for e := range after {
			want := 0.0
			if e == tc.engine {
				want = tc.tokens
			}
			if got := after[e] - before[e]; got != want {
				t.Fatalf("%s %v: engine %d generated %v tokens, want %v", tc.path, tc.body, e, got, want)
			}
		}
	}
	for _, tc := range []struct {
		path string
		body map[string]any
	}{
		{"/generate", map[string]any{"input_ids": []int{1, 2}, "sampling_params": greedy, "routed_dp_rank": 2}},
		{"/generate", map[string]any{"input_ids": []int{1, 2}, "sampling_params": greedy, "data_parallel_rank": -1}},
		{"/v1/completions", map[string]any{"prompt": []int{1, 2}, "max_tokens": 2, "routed_dp_rank": 5}},
	} {
		var out map[string]any
		if code := dp.post(t, tc.path, tc.body, &out); code != 400 || !strings.Contains(fmt.Sprint(out), "2 data-parallel engine(s)") {
			t.Fatalf("%s %v: status %d %v, want a 400 naming the engines", tc.path, tc.body, code, out)
		}
	}
}

// followsConversation: a conversation's next turn goes to the engine whose
// radix cache holds the turn before (and finds it there), until a flush
// empties the caches; server_info says how requests are routed.
func followsConversation(t *testing.T, dp *server) {
	t.Helper()
	if m := dp.info(t)["load_balance_method"]; m != "auto" {
		t.Fatalf("load_balance_method %v", m)
	}
	turn := func(ids []int, rank *int) (genResult, []float64) {
		t.Helper()
		body := map[string]any{"input_ids": ids, "sampling_params": map[string]any{"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}}
		if rank != nil {
			body["routed_dp_rank"] = *rank
		}
		before := engineTokens(t, dp)
		var out genResult
		if code := dp.post(t, "/generate", body, &out); code != 200 {
			t.Fatalf("generate: status %d", code)
		}
		after := engineTokens(t, dp)
		for e := range after {
			after[e] -= before[e]
		}
		return out, after
	}
	one := 1
	first := make([]int, 200)
	for i := range first {
		first[i] = (i*53 + 11) % 500
	}
	reply, _ := turn(first, &one)
	second := append(slices.Clone(first), make([]int, 0, 20)...)
	for _, id := range reply.OutputIDs {
		second = append(second, int(id))
	}
	second = append(second, 7, 8, 9, 10, 11)
	// Both engines are idle: without the prefix the tie goes to engine 0.
	got, by := turn(second, nil)
	if by[1] != 8 || got.MetaInfo.CachedTokens < 200 {
		t.Fatalf("turn 2: engines generated %v, %d prompt tokens cached; want engine 1, at least 200", by, got.MetaInfo.CachedTokens)
	}
	dp.mustPost(t, "/flush_cache", map[string]any{})
	if got, by = turn(second, nil); by[0] != 8 || got.MetaInfo.CachedTokens != 0 {
		t.Fatalf("after a flush: engines generated %v, %d tokens cached; want engine 0, none", by, got.MetaInfo.CachedTokens)
	}
}

// loadsReply is SGLang's /v1/loads.
type loadsReply struct {
	DPRankCount int `json:"dp_rank_count"`
	Loads       []struct {
		DPRank         int `json:"dp_rank"`
		NumWaitingReqs int `json:"num_waiting_reqs"`
		NumTotalReqs   int `json:"num_total_reqs"`
		NumUsedTokens  int `json:"num_used_tokens"`
		NumTotalTokens int `json:"num_total_tokens"`
		MaxTotal       int `json:"max_total_num_tokens"`
	} `json:"loads"`
	Aggregate map[string]float64 `json:"aggregate"`
}

// reportsLoads: /v1/loads and /get_load show a request waiting on the engine
// it went to (generation paused), with its prompt as the tokens still to
// prefill, and nothing once it finished; a bad query is a 400.
func reportsLoads(t *testing.T, dp *server) {
	t.Helper()
	loads := func(query string) (int, loadsReply, string) {
		t.Helper()
		resp, err := http.Get(dp.url + "/v1/loads" + query)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		var out loadsReply
		_ = json.Unmarshal(body, &out)
		return resp.StatusCode, out, string(body)
	}
	dp.mustPost(t, "/pause_generation", map[string]any{"mode": "in_place"})
	prompt := make([]int, 37)
	for i := range prompt {
		prompt[i] = (i*71 + 5) % 500
	}
	done := make(chan int, 1)
	go func() {
		body, _ := json.Marshal(map[string]any{"input_ids": prompt, "routed_dp_rank": 1, "sampling_params": map[string]any{"max_new_tokens": 4, "ignore_eos": true}})
		resp, err := http.Post(dp.url+"/generate", "application/json", strings.NewReader(string(body)))
		if err != nil {
			done <- -1
			return
		}
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	deadline := time.Now().Add(20 * time.Second)
	var got loadsReply
	for {
		_, got, _ = loads("")
		if len(got.Loads) == 2 && got.Loads[1].NumWaitingReqs == 1 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got.DPRankCount != 2 || len(got.Loads) != 2 || got.Loads[1].DPRank != 1 || got.Loads[1].NumTotalReqs != 1 ||
		got.Loads[1].NumTotalTokens-got.Loads[1].NumUsedTokens != len(prompt) || got.Loads[0].NumTotalReqs != 0 || got.Aggregate["total_reqs"] != 1 {
		t.Fatalf("/v1/loads with a request waiting on engine 1: %+v", got)
	}
	var legacy []map[string]float64
	if code := getJSON(t, dp.url+"/get_load", &legacy); code != 200 || len(legacy) != 2 || legacy[1]["num_reqs"] != 1 ||
		legacy[1]["num_waiting_reqs"] != 1 || legacy[1]["num_pending_tokens"] != float64(len(prompt)) {
		t.Fatalf("/get_load: %d %v", code, legacy)
	}
	if code, _, body := loads("?format=prometheus"); code != 200 || !strings.Contains(body, `sglang_num_waiting_reqs{dp_rank="1"} 1`) {
		t.Fatalf("/v1/loads?format=prometheus: %d\n%s", code, body)
	}
	dp.mustPost(t, "/continue_generation", map[string]any{})
	if code := <-done; code != 200 {
		t.Fatalf("the paused request: status %d", code)
	}
	for _, tc := range []struct {
		query   string
		code    int
		engines int
	}{
		{"?dp_rank=0&include=core,memory", 200, 1},
		{"?dp_rank=7", 200, 0}, // as SGLang: no such engine, no entries
		{"?include=everything", 400, 0},
		{"?dp_rank=one", 400, 0},
		{"?format=xml", 400, 0},
	} {
		code, out, body := loads(tc.query)
		if code != tc.code || len(out.Loads) != tc.engines {
			t.Fatalf("/v1/loads%s: %d, %d engines, want %d, %d\n%s", tc.query, code, len(out.Loads), tc.code, tc.engines, body)
		}
		for _, l := range out.Loads {
			if l.NumTotalReqs != 0 || l.NumUsedTokens != 0 || l.MaxTotal == 0 {
				t.Fatalf("/v1/loads%s once idle: %+v", tc.query, l)
			}
		}
	}
}

// getJSON decodes a GET's JSON reply into out and returns its status.
func getJSON(t *testing.T, url string, out any) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		t.Fatalf("%s: %v", url, err)
	}
	return resp.StatusCode
}
