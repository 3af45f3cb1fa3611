package bench

import (
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"ebb/engine"
	"ebb/tinymodel"
)

// TestOneBatchSteps runs one-batch on the CPU with prompts that take three
// prefill chunks, and checks that the per-step prefill times add up to the
// prefill time and that every request decoded to the end.
func TestOneBatchSteps(t *testing.T) {
	dir := tinymodel.TestDir(t, "qwen3", nil)
	res, err := OneBatch(OneBatchConfig{
		Engine:      engine.Config{ModelDir: dir, Device: "cpu", ChunkedPrefillSize: 32},
		BatchSizes:  []int{4},
		InputLen:    24,
		OutputLen:   3,
		ProfileStep: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 1 {
		t.Fatalf("%d results, want 1", len(res))
	}
	r := res[0]
	if r.PrefillSteps < 3 || len(r.PrefillStepMs) != r.PrefillSteps {
		t.Fatalf("prefill steps %d, step times %v: 96 prompt tokens in chunks of 32 take at least 3", r.PrefillSteps, r.PrefillStepMs)
	}
	sum := 0.0
	for _, ms := range r.PrefillStepMs {
		sum += ms
	}
	if math.Abs(sum-r.PrefillMs) > 1e-6 || r.TotalMs < r.PrefillMs || r.OutputTokPerS <= 0 {
		t.Fatalf("step times %v sum to %v, prefill %v ms, total %v ms, %v output tok/s", r.PrefillStepMs, sum, r.PrefillMs, r.TotalMs, r.OutputTokPerS)
	}
}

// TestOneBatchParallelLayouts runs one-batch with the engine's second rank
// in a child process (--tp-size 2) and with two engines as child processes
// (--dp-size 2) on the CPU: every layout generates the same tokens as one
// process, and the two engines report their own figures.
func TestOneBatchParallelLayouts(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ebb")
	}
	exe := buildEBB(t)
	dir := tinymodel.TestDir(t, "qwen3", nil)
	run := func(tp, dp int) []OneBatchResult {
		t.Helper()
		res, err := OneBatch(OneBatchConfig{
			Engine:      engine.Config{ModelDir: dir, Device: "cpu", TPSize: tp, DPSize: dp},
			BatchSizes:  []int{1, 3},
			InputLen:    12,
			OutputLen:   5,
			ProfileStep: -1,
			Executable:  exe,
			RankFailed:  func(err error) { t.Errorf("a rank failed: %v", err) },
		})
		if err != nil {
			t.Fatalf("tp %d dp %d: %v", tp, dp, err)
		}
		return res
	}
	want := run(1, 1)
	for _, l := range []struct{ tp, dp int }{{2, 1}, {1, 2}} {
		got := run(l.tp, l.dp)
		if len(got) != len(want) {
			t.Fatalf("tp %d dp %d: %d results, want %d", l.tp, l.dp, len(got), len(want))
		}
		for k := range want {
			if got[k].OutputDigest != want[k].OutputDigest || got[k].DecodeMedianMs <= 0 {
				t.Errorf("tp %d dp %d batch %d: outputs %s, decode %.3f ms; one process: %s", l.tp, l.dp,
					want[k].BatchSize, got[k].OutputDigest, got[k].DecodeMedianMs, want[k].OutputDigest)
			}
			if n := len(got[k].Engines); n != l.dp && !(l.dp == 1 && n == 0) {
				t.Errorf("tp %d dp %d: %d engines' figures", l.tp, l.dp, n)
			}
		}
	}
	if _, err := OneBatch(OneBatchConfig{Engine: engine.Config{ModelDir: dir, Device: "cpu", DPSize: 2},
		BatchSizes: []int{1}, InputLen: 4, OutputLen: 2, ProfileStep: 0, Executable: exe}); err == nil {
		t.Error("--profile-step with two engines: no error")
	}
}

// buildEBB builds cmd/ebb into the test's temporary directory.
func buildEBB(t *testing.T) string {
	t.Helper()
	exe := filepath.Join(t.TempDir(), "ebb")
	build := exec.Command("go", "build", "-o", exe, "../cmd/ebb")
	build.Stderr = os.Stderr
	if err := build.Run(); err != nil {
		t.Fatalf("building ebb: %v", err)
	}
	return exe
}

// TestOneBatchSampled: --temperature samples each request from a seed of
// its own, so two runs give the same outputs and a greedy run other ones;
// --top-k and --top-p filter them (top_k 1 is greedy); a negative
// temperature or a top_p out of range is refused before the engine starts.
func TestOneBatchSampled(t *testing.T) {
	dir := tinymodel.TestDir(t, "qwen3", nil)
	digest := func(temp float64, topK int, topP float64) string {
		t.Helper()
		res, err := OneBatch(OneBatchConfig{
			Engine:      engine.Config{ModelDir: dir, Device: "cpu"},
			BatchSizes:  []int{4},
			InputLen:    8,
			OutputLen:   16,
			Temperature: temp,
			TopK:        topK,
			TopP:        topP,
			ProfileStep: -1,
		})
		if err != nil {
			t.Fatal(err)
		}
		return res[0].OutputDigest
	}
	sampled, again, greedy := digest(1, 0, 0), digest(1, 0, 0), digest(0, 0, 0)
	if sampled != again {
		t.Fatalf("two sampled runs: outputs %s and %s, want the same (seeded)", sampled, again)
	}
	if sampled == greedy {
		t.Fatalf("sampled at temperature 1 and greedy: the same outputs %s", sampled)
	}
	if top1 := digest(1, 1, 0); top1 != greedy {
		t.Fatalf("top_k 1: outputs %s, want the greedy run's %s", top1, greedy)
	}
	if filtered := digest(1, 3, 0.9); filtered == sampled || filtered == greedy {
		t.Fatalf("top_k 3, top_p 0.9: outputs %s, the same as an unfiltered or a greedy run", filtered)
	}
	for _, c := range []OneBatchConfig{{Temperature: -1}, {Temperature: 1, TopP: 1.5}, {Temperature: 1, MinP: -0.5}} {
		c.Engine, c.BatchSizes, c.InputLen, c.OutputLen, c.ProfileStep = engine.Config{ModelDir: dir, Device: "cpu"}, []int{1}, 4, 2, -1
		if _, err := OneBatch(c); err == nil {
			t.Fatalf("temperature %g, top_p %g, min_p %g: no error", c.Temperature, c.TopP, c.MinP)
		}
	}
}
