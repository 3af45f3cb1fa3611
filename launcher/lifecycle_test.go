package launcher

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"
)

// greedy generates from a fixed prompt with temperature 0.
func (s *server) greedy(t *testing.T) []int32 {
	t.Helper()
	var got genResult
	body := map[string]any{"input_ids": []int{11, 22, 33, 44, 55, 66, 77}, "sampling_params": map[string]any{"max_new_tokens": 12, "temperature": 0, "ignore_eos": true}}
	if code := s.post(t, "/generate", body, &got); code != 200 || len(got.OutputIDs) != 12 {
		t.Fatalf("generate: status %d, %d tokens", code, len(got.OutputIDs))
	}
	return got.OutputIDs
}

// mustPost posts a control request and fails unless it succeeds.
func (s *server) mustPost(t *testing.T, path string, body map[string]any) map[string]any {
	t.Helper()
	var out map[string]any
	if code := s.post(t, path, body, &out); code != 200 || out["success"] == false {
		t.Fatalf("%s %v: status %d %v\n%s", path, body, code, out, s.log.String())
	}
	return out
}

func (s *server) get(t *testing.T, path string) (int, map[string]any) {
	t.Helper()
	resp, err := http.Get(s.url + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out
}

// TestRLCallOrdersCPU runs the release/resume/update orders of slime, verl
// and AReaL against `ebb serve --device cpu` as it starts by default (no
// cuda_graph region, no CPU backup) and checks that greedy output after
// each cycle is what it was before.
func TestRLCallOrdersCPU(t *testing.T) {
	s := startServer(t, "--cuda-graph-max-bs", "0")
	want := s.greedy(t)
	update := map[string]any{"model_path": modelDir}
	orders := []struct {
		name  string
		steps func(t *testing.T)
	}{
		{"slime", func(t *testing.T) {
			s.mustPost(t, "/release_memory_occupation", map[string]any{})
			// A request that arrives now waits, visibly.
			done := make(chan []int32, 1)
			go func() {
				var got genResult
				body := map[string]any{"input_ids": []int{11, 22, 33, 44, 55, 66, 77}, "sampling_params": map[string]any{"max_new_tokens": 12, "temperature": 0, "ignore_eos": true}}
				s.post(t, "/generate", body, &got)
				done <- got.OutputIDs
			}()
			waitFor(t, func() bool {
				_, st := s.get(t, "/memory_stats")
				return st["waiting_requests"] == 1.0 && strings.Contains(st["generation_blocked"].(string), "kv_cache")
			})
			start := time.Now()
			code, body := s.get(t, "/health_generate")
			if code != 503 || time.Since(start) > 5*time.Second || !strings.Contains(fmtJSON(body), "released") {
				t.Fatalf("/health_generate while released: %d %v after %v", code, body, time.Since(start))
			}
			s.mustPost(t, "/resume_memory_occupation", map[string]any{"tags": []string{"weights"}})
			s.mustPost(t, "/update_weights_from_disk", update)
			s.mustPost(t, "/resume_memory_occupation", map[string]any{"tags": []string{"kv_cache"}})
			out := s.mustPost(t, "/resume_memory_occupation", map[string]any{"tags": []string{"cuda_graph"}})
			if !strings.Contains(fmtJSON(out), "absent") {
				t.Fatalf("cuda_graph on the CPU is not reported absent: %v", out)
			}
			select {
			case got := <-done:
				if !slices.Equal(got, want) {
					t.Fatalf("the request that waited: %v, want %v", got, want)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("the request that waited never finished")
			}
			if !strings.Contains(s.log.String(), "requests wait") {
				t.Fatalf("no log line about the waiting request:\n%s", s.log.String())
			}
		}},
		{"verl", func(t *testing.T) {
			s.mustPost(t, "/release_memory_occupation", map[string]any{"tags": []string{"kv_cache", "weights"}})
			s.mustPost(t, "/resume_memory_occupation", map[string]any{"tags": []string{"weights"}})
			s.mustPost(t, "/update_weights_from_disk", map[string]any{"model_path": modelDir, "flush_cache": false})
			s.mustPost(t, "/flush_cache", map[string]any{})
			s.mustPost(t, "/resume_memory_occupation", map[string]any{"tags": []string{"kv_cache"}})
		}},
		{"areal", func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			finished := make(chan string, 1)
			go func() {
				// As long as the context allows (tinyContext), so that it is still running.
				res, _, _ := streamGenerate(ctx, s.url, map[string]any{"input_ids": []int{5, 6, 7},
					"sampling_params": map[string]any{"max_new_tokens": tinyContext - 3, "ignore_eos": true}}, 0)
				finished <- res.MetaInfo.FinishReason.Type
			}()
			waitFor(t, func() bool { return s.info(t)["num_running_reqs"].(float64) == 1 })
			// A busy engine is healthy once it steps; no probe waits in its queue.
			start := time.Now()
			if code, body := s.get(t, "/health_generate"); code != 200 || time.Since(start) > 5*time.Second {
				t.Fatalf("/health_generate while a request runs: %d %v after %v", code, body, time.Since(start))
			}
			s.mustPost(t, "/pause_generation", map[string]any{"mode": "abort"})
			s.mustPost(t, "/update_weights_from_disk", map[string]any{"model_path": modelDir, "abort_all_requests": true})
			s.mustPost(t, "/continue_generation", map[string]any{})
			if fr := <-finished; fr != "abort" {
				t.Fatalf("the in-flight request finished with %q", fr)
			}
		}},
		{"an update while a request runs", func(t *testing.T) {
			finished := make(chan string, 1)
			go func() {
				res, _, _ := streamGenerate(context.Background(), s.url, map[string]any{"input_ids": []int{5, 6, 7},
					"sampling_params": map[string]any{"max_new_tokens": tinyContext - 3, "ignore_eos": true}}, 0)
				finished <- res.MetaInfo.FinishReason.Type
			}()
			waitFor(t, func() bool { return s.info(t)["num_running_reqs"].(float64) == 1 })
			// One whose caller gives up while it waits is never carried out.
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			b, _ := json.Marshal(map[string]any{"model_path": modelDir, "weight_version": "given-up"})
			req, _ := http.NewRequestWithContext(ctx, "POST", s.url+"/update_weights_from_disk", strings.NewReader(string(b)))
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
				t.Fatalf("an update while a request runs answered at once: %d", resp.StatusCode)
			}
			waitFor(t, func() bool { return s.info(t)["weight_updates_waiting"].(float64) == 0 })
			if info := s.info(t); info["num_running_reqs"].(float64) != 1 || info["weight_version"] == "given-up" {
				t.Fatalf("after the caller gave up: %v running, version %v", info["num_running_reqs"], info["weight_version"])
			}
			// One that waits is carried out once no request runs (here once
			// the running one is aborted, rather than run to its end).
			updated := make(chan map[string]any, 1)
			go func() {
				out := map[string]any{}
				b, _ := json.Marshal(map[string]any{"model_path": modelDir, "weight_version": "after-run"})
				if resp, err := http.Post(s.url+"/update_weights_from_disk", "application/json", strings.NewReader(string(b))); err != nil {
					out["error"] = err.Error()
				} else {
					_ = json.NewDecoder(resp.Body).Decode(&out)
					resp.Body.Close()
				}
				updated <- out
			}()
			waitFor(t, func() bool { return s.info(t)["weight_updates_waiting"].(float64) == 1 })
			s.mustPost(t, "/abort_request", map[string]any{"abort_all": true})
			if out := <-updated; out["success"] != true {
				t.Fatalf("the update that waited: %v", out)
			}
			if fr := <-finished; fr != "abort" {
				t.Fatalf("the running request finished with %q", fr)
			}
			if v := s.info(t)["weight_version"]; v != "after-run" {
				t.Fatalf("weight_version %v", v)
			}
			// SGLang's own endpoints for it agree.
			for _, path := range []string{"/get_weight_version", "/get_model_info"} {
				if code, out := s.get(t, path); code != 200 || out["weight_version"] != "after-run" {
					t.Fatalf("%s: %d %v", path, code, out)
				}
			}
		}},
		{"release all, resume with no tags", func(t *testing.T) {
			s.mustPost(t, "/release_memory_occupation", map[string]any{})
			s.mustPost(t, "/resume_memory_occupation", map[string]any{})
			s.mustPost(t, "/update_weights_from_disk", update)
		}},
	}
	for _, o := range orders {
		t.Run(o.name, func(t *testing.T) {
			o.steps(t)
			if got := s.greedy(t); !slices.Equal(got, want) {
				t.Fatalf("after the cycle: %v, before: %v", got, want)
			}
			if code, _ := s.get(t, "/health_generate"); code != 200 {
				t.Fatalf("/health_generate after the cycle: %d", code)
			}
		})
	}
	checkKVWhole(t, s)
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 20 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func fmtJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
