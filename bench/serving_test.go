package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"ebb/model"
)

func TestWorkloadRequests(t *testing.T) {
	for _, tc := range []struct {
		w              Workload
		minIn, maxIn   int
		minOut, maxOut int
	}{
		{Workload{Kind: "fixed", NumPrompts: 5, InputLen: 7, OutputLen: 9}, 7, 7, 9, 9},
		{Workload{Kind: "random", NumPrompts: 300, MinInput: 100, MaxInput: 1024, MinOutput: 100, MaxOutput: 1024, Seed: 3}, 100, 1024, 100, 1024},
		{Workload{Kind: "sharegpt", NumPrompts: 300, Seed: 3}, 4, shareGPTMaxIn, 4, shareGPTMaxOut},
	} {
		reqs, err := tc.w.Requests(1000)
		if err != nil {
			t.Fatal(err)
		}
		again, _ := tc.w.Requests(1000)
		if len(reqs) != tc.w.NumPrompts {
			t.Fatalf("%s: %d requests", tc.w.Kind, len(reqs))
		}
		for i, r := range reqs {
			if len(r.Prompt) < tc.minIn || len(r.Prompt) > tc.maxIn || r.OutputLen < tc.minOut || r.OutputLen > tc.maxOut {
				t.Fatalf("%s: request %d has %d in, %d out", tc.w.Kind, i, len(r.Prompt), r.OutputLen)
			}
			if len(again[i].Prompt) != len(r.Prompt) || again[i].Prompt[0] != r.Prompt[0] || again[i].OutputLen != r.OutputLen {
				t.Fatalf("%s: request %d differs between two draws of one seed", tc.w.Kind, i)
			}
			for _, id := range r.Prompt {
				if id < 1 || id >= 1000 {
					t.Fatalf("%s: token %d outside [1, 1000)", tc.w.Kind, id)
				}
			}
		}
	}
	for _, bad := range []Workload{{Kind: "fixed", NumPrompts: 1}, {Kind: "random", NumPrompts: 1, MinInput: 5, MaxInput: 4, MinOutput: 1, MaxOutput: 1}, {Kind: "sharegtp", NumPrompts: 1}, {Kind: "fixed"}} {
		if _, err := bad.Requests(1000); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
}

func TestArrivals(t *testing.T) {
	if a := arrivals(4, 0, 1); a[3] != 0 {
		t.Fatalf("all at once: %v", a)
	}
	a := arrivals(4000, 50, 1)
	mean := a[len(a)-1] / float64(len(a))
	if math.Abs(mean-0.02) > 0.002 {
		t.Fatalf("Poisson at 50/s: mean gap %.4f s", mean)
	}
}

// TestBandwidthFloor checks the floor against a hand count: two requests,
// KV per token of 2 layers x 2 (K, V) x 1 head x 4 dims x 2 bytes = 32.
// KV reads: request 1 (10 in, 3 out) 10+11+12 = 33 positions, 1,056 bytes;
// request 2 (5 in, 2 out) 5+6 = 11, 352 bytes. Weights: per layer 8x16 qkv
// + 8x8 o + 3x8x16 mlp = 576, lm_head 80, bf16: 2,464 bytes a step.
func TestBandwidthFloor(t *testing.T) {
	mc := &model.Config{Layers: 2, KVHeads: 1, Heads: 2, HeadDim: 4, Hidden: 8, Intermediate: 16, Vocab: 10}
	reqs := []workRequest{{Prompt: make([]int32, 10), OutputLen: 3}, {Prompt: make([]int32, 5), OutputLen: 2}}
	const step = 2 * (2*576 + 80)
	for _, c := range []struct {
		name          string
		tp, dp        int
		weights       float64 // read over all engines
		slowestEngine float64 // bytes one GPU of the slowest engine reads
	}{
		{"one GPU", 1, 1, 3 * step, 1056 + 352 + 3*step},
		// Request 1 to engine 0 (the larger), request 2 to engine 1.
		{"dp 2", 1, 2, (3 + 2) * step, 1056 + 3*step},
		// One KV head: both GPUs hold it; the weights are halved.
		{"tp 2", 2, 1, 3 * step, 1056 + 352 + 3*step/2},
	} {
		rep := &ServingReport{OutputTokPerS: 1}
		rep.bandwidthFloor(mc, reqs, 1e9, c.tp, c.dp)
		if rep.KVReadBytes != 1408 || rep.WeightReadBytes != c.weights || rep.GPUs != c.tp*c.dp {
			t.Fatalf("%s: KV %v, weights %v (want %v), GPUs %d", c.name, rep.KVReadBytes, rep.WeightReadBytes, c.weights, rep.GPUs)
		}
		if want := 5 / (c.slowestEngine / 1e9); math.Abs(rep.FloorTokPerS-want) > 1e-6*want || rep.FractionOfFloor != 1/rep.FloorTokPerS {
			t.Fatalf("%s: floor %v tok/s (want %v), fraction %v", c.name, rep.FloorTokPerS, want, rep.FractionOfFloor)
		}
	}
}

// fakeGenerate serves SGLang's /generate: max_new_tokens tokens at a known
// pace for each of n samples, streamed as chunks carrying the output so
// far (with "index" where n > 1), or as one object (a list for n > 1). It
// refuses a request whose sampling_params fail want.
func fakeGenerate(step time.Duration, want func(sp map[string]any) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			InputIDs       []int32        `json:"input_ids"`
			Stream         bool           `json:"stream"`
			SamplingParams map[string]any `json:"sampling_params"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || r.URL.Path != "/generate" {
			http.Error(w, "bad request", 400)
			return
		}
		if err := want(in.SamplingParams); err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		n, samples := int(in.SamplingParams["max_new_tokens"].(float64)), 1
		if v, ok := in.SamplingParams["n"].(float64); ok {
			samples = int(v)
		}
		reply := func(i, k int) map[string]any {
			out := map[string]any{"output_ids": make([]int32, k), "meta_info": map[string]any{"completion_tokens": k}}
			if samples > 1 {
				out["index"] = i
			}
			return out
		}
		for k := 1; k <= n; k++ {
			time.Sleep(step)
			for i := 0; in.Stream && i < samples; i++ {
				b, _ := json.Marshal(reply(i, k))
				fmt.Fprintf(w, "data: %s\n\n", b)
				w.(http.Flusher).Flush()
			}
		}
		switch {
		case in.Stream:
			fmt.Fprint(w, "data: [DONE]\n\n")
		case samples == 1:
			_ = json.NewEncoder(w).Encode(reply(0, n))
		default:
			var all []map[string]any
			for i := range samples {
				all = append(all, reply(i, n))
			}
			_ = json.NewEncoder(w).Encode(all)
		}
	}
}

// TestServingAgainstFakeServer runs the client against a server that
// streams SGLang's /generate chunks (the output so far in each) at a known
// pace, and checks the counts and latencies it derives.
func TestServingAgainstFakeServer(t *testing.T) {
	const step = 5 * time.Millisecond
	srv := httptest.NewServer(fakeGenerate(step, func(sp map[string]any) error {
		// Unset filters are left to the model's defaults.
		_, k := sp["top_k"]
		_, p := sp["top_p"]
		if k || p || sp["ignore_eos"] != true {
			return fmt.Errorf("sampling params %v", sp)
		}
		return nil
	}))
	defer srv.Close()
	for _, stream := range []bool{true, false} {
		cfg := ServingConfig{URL: srv.URL, Stream: stream, Temperature: 1, PlotPath: filepath.Join(t.TempDir(), "serving.png"),
			Workload: Workload{Kind: "fixed", NumPrompts: 6, InputLen: 3, OutputLen: 10, Seed: 1}}
		rep, err := Serving(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Completed != 6 || rep.Failed != 0 || rep.OutputTokens != 60 || rep.InputTokens != 18 {
			t.Fatalf("stream %v: %+v", stream, rep)
		}
		if rep.E2EMs.P50 < 10*float64(step.Milliseconds()) {
			t.Fatalf("stream %v: end-to-end p50 %.1f ms below 10 steps", stream, rep.E2EMs.P50)
		}
		if stream {
			if rep.TTFTMs.P50 < float64(step.Milliseconds()) || rep.ITLMs.P50 < 0.8*float64(step.Milliseconds()) || rep.TTFTMs.P50 > rep.E2EMs.P50 {
				t.Fatalf("TTFT %+v, ITL %+v, E2E %+v", rep.TTFTMs, rep.ITLMs, rep.E2EMs)
			}
		} else if rep.TTFTMs.P50 != 0 {
			t.Fatalf("no stream but TTFT %+v", rep.TTFTMs)
		}
	}
	// A server that refuses is counted, not fatal.
	cfg := ServingConfig{URL: srv.URL + "/nope", Workload: Workload{Kind: "fixed", NumPrompts: 2, InputLen: 1, OutputLen: 1}}
	rep, err := Serving(cfg)
	if err != nil || rep.Failed != 2 || rep.FirstError == "" {
		t.Fatalf("refusing server: %v, %+v", err, rep)
	}
}

// TestServerParallelism reads tp_size and dp_size from /get_server_info
// and falls back to one GPU where the server says nothing.
func TestServerParallelism(t *testing.T) {
	for _, c := range []struct {
		body   string
		status int
		tp, dp int
	}{
		{`{"tp_size": 2, "dp_size": 4, "model_path": "m"}`, http.StatusOK, 2, 4},
		{`{"tp_size": 2}`, http.StatusOK, 2, 1},
		{`{"tp_size": 0, "dp_size": null}`, http.StatusOK, 1, 1},
		{`not found`, http.StatusNotFound, 1, 1},
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/get_server_info" {
				http.NotFound(w, r)
				return
			}
			w.WriteHeader(c.status)
			io.WriteString(w, c.body)
		}))
		tp, dp := serverParallelism(srv.Client(), srv.URL, "")
		srv.Close()
		if tp != c.tp || dp != c.dp {
			t.Errorf("%s: tp %d dp %d, want %d %d", c.body, tp, dp, c.tp, c.dp)
		}
	}
}

// TestServingCountsCachedPrompts: a workload sent again finds its prompts in
// the server's radix cache and the report says how many tokens; with
// FlushCache the server is flushed first and finds none.
func TestServingCountsCachedPrompts(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]bool{}
	flushes := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		switch r.URL.Path {
		case "/flush_cache":
			if r.Method != "POST" {
				http.Error(w, "method", http.StatusMethodNotAllowed)
				return
			}
			clear(seen)
			flushes++
			return
		case "/generate":
		default:
			http.NotFound(w, r)
			return
		}
		var in struct {
			InputIDs       []int32        `json:"input_ids"`
			SamplingParams map[string]any `json:"sampling_params"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		key := fmt.Sprint(in.InputIDs)
		cached := 0
		if seen[key] {
			cached = len(in.InputIDs) - 1 // the last prompt token is always computed
		}
		seen[key] = true
		n := int(in.SamplingParams["max_new_tokens"].(float64))
		_ = json.NewEncoder(w).Encode(map[string]any{"meta_info": map[string]any{"completion_tokens": n, "cached_tokens": cached}})
	}))
	defer srv.Close()
	for _, c := range []struct {
		flush  bool
		cached int
	}{{false, 0}, {false, 6 * 4}, {true, 0}} {
		rep, err := Serving(ServingConfig{URL: srv.URL, FlushCache: c.flush,
			Workload: Workload{Kind: "fixed", NumPrompts: 6, InputLen: 5, OutputLen: 2, Seed: 3}})
		if err != nil || rep.Failed != 0 {
			t.Fatalf("flush %v: %v, %+v", c.flush, err, rep)
		}
		if rep.CachedTokens != c.cached || rep.InputTokens != 30 {
			t.Errorf("flush %v: %d of %d input tokens cached, want %d", c.flush, rep.CachedTokens, rep.InputTokens, c.cached)
		}
	}
	if flushes != 1 {
		t.Errorf("%d flushes, want 1", flushes)
	}
	if _, err := Serving(ServingConfig{URL: srv.URL + "/nope", FlushCache: true, Workload: Workload{Kind: "fixed", NumPrompts: 1, InputLen: 1, OutputLen: 1}}); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("a server without /flush_cache: %v, want an error naming the 404", err)
	}
}

// TestServingGroupsAndFilters: a GRPO group goes out as n requests or as
// one with sampling_params.n, and is counted sample by sample either way;
// filters given are sent, and --duration keeps sending until it passes.
func TestServingGroupsAndFilters(t *testing.T) {
	const step = time.Millisecond
	srv := httptest.NewServer(fakeGenerate(step, func(sp map[string]any) error {
		if sp["top_k"] != 20.0 || sp["top_p"] != 0.95 || sp["min_p"] != nil || sp["ignore_eos"] != false {
			return fmt.Errorf("sampling params %v", sp)
		}
		return nil
	}))
	defer srv.Close()
	k, p := 20, 0.95
	for _, stream := range []bool{true, false} {
		for _, asN := range []bool{false, true} {
			w := Workload{Kind: "random", NumPrompts: 4, MinInput: 5, MaxInput: 9, MinOutput: 4, MaxOutput: 64,
				OutputDist: "lognormal", GroupSize: 3, GroupAsN: asN, Seed: 2}
			reqs, err := w.Requests(1000)
			if err != nil {
				t.Fatal(err)
			}
			rep, err := Serving(ServingConfig{URL: srv.URL, Stream: stream, TopK: &k, TopP: &p, StopAtEOS: true, Workload: w})
			if err != nil {
				t.Fatal(err)
			}
			want := 0
			for _, r := range reqs {
				want += max(r.N, 1) * r.OutputLen
			}
			if rep.Completed != 12 || rep.Samples != 12 || rep.Failed != 0 || rep.OutputTokens != want {
				t.Fatalf("stream %v, n %v: %d completions (%d samples, %d failed: %s), %d output tokens, want 12 and %d",
					stream, asN, rep.Completed, rep.Samples, rep.Failed, rep.FirstError, rep.OutputTokens, want)
			}
			if asN != (len(reqs) == 4) {
				t.Fatalf("n %v: %d requests for 4 prompts of 3 samples", asN, len(reqs))
			}
		}
	}
	start := time.Now()
	rep, err := Serving(ServingConfig{URL: srv.URL, Stream: true, TopK: &k, TopP: &p, StopAtEOS: true, Duration: 300 * time.Millisecond,
		Workload: Workload{Kind: "fixed", NumPrompts: 2, InputLen: 3, OutputLen: 20, Seed: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < 300*time.Millisecond || rep.Completed < 10 || rep.Failed != 0 || rep.Samples != rep.Completed {
		t.Fatalf("soak: %v, %d completed of %d sent, %d failed", took, rep.Completed, rep.Samples, rep.Failed)
	}
}

func TestLogNormalOutputs(t *testing.T) {
	w := Workload{Kind: "random", NumPrompts: 4000, MinInput: 1, MaxInput: 1, MinOutput: 1024, MaxOutput: 16384, OutputDist: "lognormal", Seed: 5}
	reqs, err := w.Requests(100)
	if err != nil {
		t.Fatal(err)
	}
	below, atBounds := 0, 0
	for _, r := range reqs {
		if r.OutputLen < 1024 || r.OutputLen > 16384 {
			t.Fatalf("output %d outside the bounds", r.OutputLen)
		}
		if r.OutputLen < 4096 {
			below++
		}
		if r.OutputLen == 1024 || r.OutputLen == 16384 {
			atBounds++
		}
	}
	// The median is the geometric mean, 4096; the bounds are 2 sd out.
	if below < 1800 || below > 2200 || atBounds > 250 {
		t.Fatalf("%d of 4000 below the median, %d at the bounds", below, atBounds)
	}
	if _, err := (Workload{Kind: "random", NumPrompts: 1, MinInput: 1, MaxInput: 1, MinOutput: 1, MaxOutput: 2, OutputDist: "pareto"}).Requests(100); err == nil {
		t.Fatal("unknown distribution accepted")
	}
}

// TestCheckAfterRun: --check passes an idle server that holds nothing and
// has not grown, and names each way a server can fail it.
func TestCheckAfterRun(t *testing.T) {
	type state struct {
		used, reserved, process int64
		ok                      bool
	}
	for _, tc := range []struct {
		name   string
		after  state
		failed int
		want   string
	}{
		{"clean", state{0, 100 << 20, 600 << 20, true}, 0, "ok"},
		{"driver noise", state{0, 100 << 20, 610 << 20, true}, 0, "ok"},
		{"failed requests", state{0, 100 << 20, 600 << 20, true}, 2, "2 of 7 requests failed"},
		{"KV held", state{37, 100 << 20, 600 << 20, true}, 0, "37 KV tokens held"},
		{"invariant", state{0, 100 << 20, 600 << 20, false}, 0, "broken invariant"},
		{"region grown", state{0, 164 << 20, 600 << 20, true}, 0, "memory regions reserve"},
		{"memory grown", state{0, 100 << 20, 700 << 20, true}, 0, "GPU memory grew by 100 MiB"},
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/get_server_info":
				_ = json.NewEncoder(w).Encode(map[string]any{"num_running_reqs": 0, "num_waiting_reqs": 0,
					"num_used_tokens": tc.after.used, "invariants_ok": tc.after.ok})
			case "/memory_stats":
				_ = json.NewEncoder(w).Encode(map[string]any{"nvml_process_bytes": tc.after.process,
					"tags": []map[string]any{{"reserved_bytes": tc.after.reserved}}})
			default:
				http.NotFound(w, r)
			}
		}))
		before := serverState{HasMemory: true, ReservedBytes: 100 << 20, ProcessBytes: 600 << 20}
		rep := &ServingReport{Completed: 5, Failed: tc.failed, FirstError: "boom"}
		got := strings.Join(checkAfterRun(http.DefaultClient, srv.URL, "", rep, before), "; ")
		srv.Close()
		if !strings.Contains(got, tc.want) || (tc.want == "ok") != (got == "ok") {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}

// TestStepWeightBytes: a dense model's decode steps each read its weights
// once; a mixture-of-experts step reads more of its experts the more
// sequences it runs, and the floor follows the batch as it drains.
func TestStepWeightBytes(t *testing.T) {
	dense := &model.Config{Hidden: 64, Intermediate: 128, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16, Vocab: 100}
	if got, want := stepWeightBytes(dense, []int{5, 10, 10}), 10*float64(dense.DecodeWeightBytes()); got != want {
		t.Fatalf("dense: %v bytes, want %v", got, want)
	}
	moe := *dense
	moe.MoE = &model.MoEConfig{Experts: 128, TopK: 8, Intermediate: 32, SparseStep: 1}
	one, all := float64(moe.DecodeWeightBytesAt(1)), float64(moe.DecodeWeightBytesAt(256))
	if got := stepWeightBytes(&moe, []int{3}); got != 3*one {
		t.Fatalf("one sequence: %v bytes, want %v", got, 3*one)
	}
	outputs := make([]int, 256)
	for i := range outputs {
		outputs[i] = 4
	}
	outputs[0] = 6 // runs two steps alone at the end
	if got, want := stepWeightBytes(&moe, outputs), 4*all+2*one; math.Abs(got-want) > 1 {
		t.Fatalf("256 sequences: %v bytes, want %v", got, want)
	}
	if all < 10*one {
		t.Fatalf("a step of 256 reads %v bytes, one of 1 %v: most experts should be read", all, one)
	}
}
