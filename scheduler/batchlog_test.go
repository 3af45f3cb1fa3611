package scheduler

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestBatchLog checks SGLang's batch lines: one "Prefill batch" per step
// with prompt tokens (chunks of 48 here), one "Decode batch" per interval
// of decode-only steps, with counts that add up.
func TestBatchLog(t *testing.T) {
	h, logs := loggedHarness(t)
	h.generate("a", prompt(1, 70), 23)
	h.generate("b", prompt(2, 30), 23)
	h.runToIdle()

	var newTokens, decodeLines int
	for _, e := range logs.All() {
		f := e.ContextMap()
		switch e.Message {
		case "Prefill batch":
			newTokens += int(f["new_token"].(int64))
			if f["new_token"].(int64) > 48 {
				t.Fatalf("prefill batch over the chunk size: %v", f)
			}
		case "Decode batch":
			decodeLines++
			if f["running_req"].(int64) != 2 || f["queue_req"].(int64) != 0 {
				t.Fatalf("decode batch: %v", f)
			}
			if tp := f["gen_throughput"].(float64); tp <= 0 {
				t.Fatalf("gen_throughput %v", tp)
			}
			if u := f["token_usage"].(float64); u <= 0 || u > 1 {
				t.Fatalf("token_usage %v", u)
			}
		}
	}
	if newTokens != 100 {
		t.Fatalf("prefill lines add up to %d prompt tokens, want 100", newTokens)
	}
	// 22 decode-only steps after the prefills (the first token comes from
	// the prefill): a line after the 6th, 11th, 16th and 21st.
	if decodeLines != 4 {
		t.Fatalf("%d decode lines, want 4", decodeLines)
	}
}

// TestBatchLogSkipsIdleTime: the first decode line after an idle spell
// reports the output rate of its own steps, not of the idle time.
func TestBatchLogSkipsIdleTime(t *testing.T) {
	h, logs := loggedHarness(t)
	h.generate("a", prompt(1, 20), 4) // fewer decode steps than the interval
	h.runToIdle()
	time.Sleep(time.Second)
	h.generate("b", prompt(2, 20), 12)
	h.runToIdle()
	lines := logs.FilterMessage("Decode batch").All()
	if len(lines) == 0 {
		t.Fatal("no decode line")
	}
	// The line covers at most six tokens: over the idle second, 6 tok/s.
	if tp := lines[0].ContextMap()["gen_throughput"].(float64); tp < 20 {
		t.Fatalf("gen_throughput %.2f tok/s counts the idle time", tp)
	}
}

// TestLoadFigures: server_info carries the last decode line's
// gen_throughput (0 once idle, as /v1/loads reports it), and a waiting
// request's prompt as the tokens still to prefill.
func TestLoadFigures(t *testing.T) {
	h, logs := loggedHarness(t)
	h.generate("a", prompt(1, 20), 40)
	if info := h.s.Info(); info["num_waiting_tokens"] != 20 || info["num_waiting_reqs"] != 1 {
		t.Fatalf("a waiting request of 20 tokens: %v tokens, %v requests", info["num_waiting_tokens"], info["num_waiting_reqs"])
	}
	for i := 0; i < 100 && logs.FilterMessage("Decode batch").Len() == 0; i++ {
		h.step(1)
	}
	lines := logs.FilterMessage("Decode batch").All()
	if len(lines) == 0 {
		t.Fatal("no decode line")
	}
	info := h.s.Info()
	if want := lines[0].ContextMap()["gen_throughput"]; info["gen_throughput"] != want || want.(float64) <= 0 {
		t.Fatalf("server_info gen_throughput %v, the decode line's %v", info["gen_throughput"], want)
	}
	if info["num_waiting_tokens"] != 0 || info["num_used_tokens"].(int) < 20 || info["token_usage"].(float64) <= 0 {
		t.Fatalf("decoding: %v waiting tokens, %v used, usage %v", info["num_waiting_tokens"], info["num_used_tokens"], info["token_usage"])
	}
	h.runToIdle()
	if info := h.s.Info(); info["gen_throughput"] != 0.0 || info["num_used_tokens"] != 0 {
		t.Fatalf("idle: gen_throughput %v, %v tokens used", info["gen_throughput"], info["num_used_tokens"])
	}
}

// loggedHarness is a harness whose info log is observed, with a decode
// line every 5 steps.
func loggedHarness(t *testing.T) (*harness, *observer.ObservedLogs) {
	h := newHarness(t, false, 4096)
	core, logs := observer.New(zap.InfoLevel)
	h.s.log = zap.New(core)
	h.s.batches.interval = 5
	return h, logs
}
