package bench

import (
	"math"
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
