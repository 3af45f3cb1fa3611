package launcher

import (
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestKVPressureCPU sends rollouts whose KV demand is about 1.6 times the
// cache through a real server. Those that may stop at EOS are admitted on
// the new-token ratio and some are retracted; every one still finishes,
// the retractions and recomputed tokens appear in /server_info, /metrics
// and the log, and once idle no KV is held. Rollouts that must run to
// their length wait for room instead: no retraction.
func TestKVPressureCPU(t *testing.T) {
	s := startServer(t, "--max-total-tokens", "800", "--chunked-prefill-size", "128")
	run := func(ignoreEOS bool) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan error, 14)
		for i := range 14 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ids := make([]int, 20+2*i)
				for j := range ids {
					ids[j] = 100 + (i*131+j*17)%5000
				}
				var got genResult
				body := map[string]any{"input_ids": ids, "sampling_params": map[string]any{
					"max_new_tokens": 60, "temperature": 0, "ignore_eos": ignoreEOS}}
				if code := s.post(t, "/generate", body, &got); code != 200 || got.MetaInfo.FinishReason.Type == "abort" {
					errs <- fmt.Errorf("request %d: status %d, finish %q", i, code, got.MetaInfo.FinishReason.Type)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("%v\n%s", err, s.log.String())
		}
	}
	idle := func() map[string]any {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			info := s.info(t)
			if info["num_running_reqs"] == 0.0 && info["num_waiting_reqs"] == 0.0 || time.Now().After(deadline) {
				if info["num_used_tokens"] != 0.0 || info["invariants_ok"] != true {
					t.Fatalf("idle server holds %v KV tokens, invariants ok %v", info["num_used_tokens"], info["invariants_ok"])
				}
				return info
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	run(false)
	info := idle()
	retracted, recomputed := info["num_retracted_reqs"].(float64), info["recomputed_tokens"].(float64)
	if retracted == 0 {
		t.Fatalf("no retraction with KV demand 1.6x the cache: %v", info)
	}
	if !strings.Contains(s.log.String(), "KV cache pool is full. Retract requests.") {
		t.Errorf("no retraction line in the log:\n%s", s.log.String())
	}
	metrics := scrape(t, s.url+"/metrics")
	for name, want := range map[string]float64{
		"sglang:num_retracted_requests_total": retracted, "ebb:retracted_requests_total": retracted,
		"ebb:recomputed_tokens_total": recomputed,
	} {
		if got, ok := metrics[name]; !ok || got != want {
			t.Errorf("%s = %v (present %v), want %v", name, got, ok, want)
		}
	}
	if _, ok := metrics["sglang:new_token_ratio"]; !ok {
		t.Error("no sglang:new_token_ratio")
	}

	run(true)
	if info := idle(); info["num_retracted_reqs"].(float64) != retracted {
		t.Fatalf("rollouts that run to their length were retracted: %v -> %v", retracted, info["num_retracted_reqs"])
	}
}

var metricLine = regexp.MustCompile(`^([a-z_:]+)(\{[^}]*\})? (\S+)$`)

// scrape reads a Prometheus text page: each metric's value (the last
// series of a name wins).
func scrape(t *testing.T, url string) map[string]float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	out := map[string]float64{}
	for _, line := range strings.Split(string(b), "\n") {
		if m := metricLine.FindStringSubmatch(line); m != nil {
			if v, err := strconv.ParseFloat(m[3], 64); err == nil {
				out[m[1]] = v
			}
		}
	}
	return out
}
