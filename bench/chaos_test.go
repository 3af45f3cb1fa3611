package bench

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"ebb/engine"
	"ebb/tinymodel"
)

// TestServingCountsServerAbortsAndShortOutputs: a 200 whose finish_reason
// is abort (a failed step aborts its batch) or whose output stops short of
// the length it had to run to is a failed request, not a completion;
// aborts are expected only where the run's own chaos pauses with mode
// abort.
func TestServingCountsServerAbortsAndShortOutputs(t *testing.T) {
	var mu sync.Mutex
	calls := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/generate" {
			http.NotFound(w, r)
			return
		}
		var in struct {
			SamplingParams map[string]any `json:"sampling_params"`
		}
		_ = json.NewDecoder(r.Body).Decode(&in)
		n := int(in.SamplingParams["max_new_tokens"].(float64))
		mu.Lock()
		calls++
		k := calls
		mu.Unlock()
		finish := map[string]any{"type": "length", "length": n}
		switch k % 3 {
		case 1:
			finish, n = map[string]any{"type": "abort", "message": "step failed: CUDA error"}, n/2
		case 2:
			finish, n = map[string]any{"type": "stop", "matched": 7}, n-1
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"meta_info": map[string]any{"completion_tokens": n, "finish_reason": finish}})
	}))
	defer srv.Close()
	w := Workload{Kind: "fixed", NumPrompts: 6, InputLen: 3, OutputLen: 10, Seed: 1}
	rep, err := Serving(ServingConfig{URL: srv.URL, Workload: w})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Completed != 2 || rep.Failed != 4 || !strings.Contains(rep.FirstError, "aborted by the server: step failed") &&
		!strings.Contains(rep.FirstError, "9 of 10 output tokens") {
		t.Fatalf("runs to length: %d completed, %d failed (%s)", rep.Completed, rep.Failed, rep.FirstError)
	}
	// Requests that may stop at EOS may stop early; an abort still fails.
	calls = 0
	rep, err = Serving(ServingConfig{URL: srv.URL, Workload: w, StopAtEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Completed != 4 || rep.Failed != 2 || !strings.Contains(rep.FirstError, "aborted by the server") {
		t.Fatalf("may stop at EOS: %d completed, %d failed (%s)", rep.Completed, rep.Failed, rep.FirstError)
	}
}

// chaosServer fakes the control endpoints the chaos calls; bad names one
// that fails (success false).
func chaosServer(t *testing.T, bad string) (*httptest.Server, map[string]int) {
	var mu sync.Mutex
	seen := map[string]int{}
	paused, released := false, false
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		seen[r.URL.Path]++
		ok := true
		switch r.URL.Path {
		case "/get_server_info":
			_ = json.NewEncoder(w).Encode(map[string]any{"cpu_backup": true})
			return
		case "/model_info":
			_ = json.NewEncoder(w).Encode(map[string]any{"model_path": "/models/m"})
			return
		case "/update_weights_from_disk":
			var in struct {
				Path string `json:"model_path"`
			}
			_ = json.NewDecoder(r.Body).Decode(&in)
			ok = in.Path == "/models/m" && !released
		case "/generate":
			var in struct {
				SamplingParams map[string]any `json:"sampling_params"`
			}
			_ = json.NewDecoder(r.Body).Decode(&in)
			time.Sleep(2 * time.Millisecond)
			n := int(in.SamplingParams["max_new_tokens"].(float64))
			_ = json.NewEncoder(w).Encode(map[string]any{"meta_info": map[string]any{"completion_tokens": n}})
			return
		case "/pause_generation":
			ok, paused = !paused, true
		case "/continue_generation":
			ok, paused = paused, false
		case "/release_memory_occupation":
			ok, released = !released, true
		case "/resume_memory_occupation":
			ok, released = released, false
		case "/flush_cache":
			w.WriteHeader(http.StatusBadRequest) // busy: refused, as SGLang does
			return
		case "/health_generate":
			if paused || released {
				w.WriteHeader(http.StatusServiceUnavailable)
			}
			return
		default:
			http.NotFound(w, r)
			return
		}
		if r.URL.Path == bad {
			ok = false
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"success": ok, "message": fmt.Sprintf("%s ok=%v", r.URL.Path, ok)})
	}))
	t.Cleanup(srv.Close)
	return srv, seen
}

// TestChaosAgainstFakeServer: the chaos sends every kind of action, each
// pause continued and each release resumed before the next, and a control
// request that fails fails the check.
func TestChaosAgainstFakeServer(t *testing.T) {
	w := Workload{Kind: "fixed", NumPrompts: 4, InputLen: 3, OutputLen: 5, Seed: 1}
	srv, seen := chaosServer(t, "")
	rep, err := Serving(ServingConfig{URL: srv.URL, Workload: w, Duration: 400 * time.Millisecond, Check: true,
		Chaos: ChaosConfig{Interval: 2 * time.Millisecond, PauseModes: []string{"retract", "abort"}, Seed: 3}})
	if err != nil {
		t.Fatal(err)
	}
	c := rep.Chaos
	if c == nil || c.Failed != 0 || len(c.Actions) < 5 {
		t.Fatalf("chaos %+v", c)
	}
	for _, path := range []string{"/pause_generation", "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache", "/health_generate", "/update_weights_from_disk"} {
		if seen[path] == 0 {
			t.Errorf("no %s", path)
		}
	}
	if seen["/pause_generation"] != seen["/continue_generation"] || seen["/release_memory_occupation"] != seen["/resume_memory_occupation"] {
		t.Errorf("unpaired actions: %v", seen)
	}
	srv, _ = chaosServer(t, "/resume_memory_occupation")
	_, err = Serving(ServingConfig{URL: srv.URL, Workload: w, Duration: 200 * time.Millisecond, Check: true,
		Chaos: ChaosConfig{Interval: 2 * time.Millisecond, Seed: 3}})
	if err == nil || !strings.Contains(err.Error(), "control requests of the chaos failed") || !strings.Contains(err.Error(), "resume_memory_occupation") {
		t.Fatalf("a failing resume: %v", err)
	}
}

// TestChaosSoakCPU runs a soak of rollouts that outgrow the KV cache
// against `ebb serve --device cpu` while the chaos pauses, releases and
// resumes it: no request fails or is cut short, every control request
// succeeds, and afterwards no KV is held and the invariants hold. It is
// how the loop's step on just-released memory was found.
func TestChaosSoakCPU(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ebb")
	}
	exe := buildEBB(t)
	dir := tinymodel.TestDir(t, "qwen3", func(s *tinymodel.Spec) { s.Tie = false })
	rep, err := Serving(ServingConfig{
		Engine: engine.Config{ModelDir: dir, Device: "cpu", MaxTotalTokens: 1500, ChunkedPrefillSize: 64,
			MaxRunningRequests: 16, CPUBackup: true},
		Executable: exe, Stream: true, Temperature: 1, Duration: 8 * time.Second, MaxInFlight: 24, Check: true,
		Workload: Workload{Kind: "random", NumPrompts: 8, MinInput: 10, MaxInput: 300, MinOutput: 20, MaxOutput: 200,
			OutputDist: "lognormal", GroupSize: 3, Seed: 5},
		Chaos: ChaosConfig{Interval: 150 * time.Millisecond, PauseModes: []string{"retract", "in_place", "abort"}, Seed: 5},
	})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Completed == 0 || rep.Chaos == nil || len(rep.Chaos.Actions) < 5 {
		t.Fatalf("%d completed, chaos %+v", rep.Completed, rep.Chaos)
	}
	t.Logf("%d completed (%d aborted by the chaos), %d retracted; chaos %v", rep.Completed, rep.Aborted, rep.Retracted, rep.Chaos.Actions)
}
