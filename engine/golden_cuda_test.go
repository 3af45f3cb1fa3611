package engine_test

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"ebb/cuda"
	"ebb/engine"
	"ebb/ioschema"
	"ebb/runner"
	"ebb/scheduler"
)

// TestGoldensCUDA runs the golden prompts on the GPU in bf16, through
// CUDA-graph decode, against transformers in bf16 (sdpa). Tokens must agree
// until transformers' top-2 gap is within one bf16 step of the logits.
// Logprobs must be as close to transformers as transformers' own eager
// attention is (bf16_floor): mean |d| within max(0.02, 1.5 x the floor's),
// and each within 1.5 x the floor's max plus 1% of its magnitude. It skips
// without a GPU.
func TestGoldensCUDA(t *testing.T) {
	if err := cuda.Available(); err != nil {
		t.Skip("no GPU:", err)
	}
	const tieGap, relTol = 0.13, 0.01
	var sum, worst, floorMean float64
	var n int
	type model struct {
		g   golden
		dir func(t *testing.T) string
	}
	var models []model
	for _, g := range loadGoldens(t) {
		models = append(models, model{g, func(t *testing.T) string { return writeGoldenModel(t, g) }})
	}
	models = append(models, model{loadDefaultModelGolden(t), func(*testing.T) string { return defaultModelDir }})
	var trainedSum float64
	var trainedN int
	for _, m := range models {
		g := m.g
		if len(g.BF16Cases) != len(g.Cases) {
			t.Fatalf("%s: no bf16 reference (rerun tools/golden_tiny.py on the GPU machine)", g.Name)
		}
		g.Cases = g.BF16Cases
		floorMean += g.BF16Floor.Mean
		absTol := 1.5*g.BF16Floor.Max + 0.01
		t.Run(g.Name, func(t *testing.T) {
			dir := m.dir(t)
			e, err := engine.Open(engine.Config{ModelDir: dir, Device: "cuda", MaxRunningRequests: 8, ChunkedPrefillSize: 64,
				MaxTotalTokens: 4096, CUDAGraphMaxBS: 8, EnableReturnRoutedExperts: isMoE(t, dir)})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			outs := runGolden(t, e, g)
			check := func(what string, got float32, want float64) {
				d := math.Abs(float64(got) - want)
				sum, n, worst = sum+d, n+1, math.Max(worst, d)
				if g.Name == "default-model" {
					trainedSum, trainedN = trainedSum+d, trainedN+1
				}
				if d > absTol+relTol*math.Abs(want) {
					t.Errorf("%s: logprob %v, transformers %v", what, got, want)
				}
			}
			for i, c := range g.Cases {
				agree := 0
				for j := range c.OutputIDs {
					if c.Top2Gap[j] < tieGap || outs[i].OutputIDs[j] != c.OutputIDs[j] {
						break
					}
					agree++
				}
				compareRouting(t, fmt.Sprintf("prompt %d", i), c, outs[i].RoutedExperts, agree, routerTieBF16)
				for j := range c.OutputIDs {
					if c.Top2Gap[j] < tieGap {
						break
					}
					if outs[i].OutputIDs[j] != c.OutputIDs[j] {
						t.Fatalf("prompt %d: token %d is %d, transformers %d (gap %.3f)", i, j, outs[i].OutputIDs[j], c.OutputIDs[j], c.Top2Gap[j])
					}
					check(fmt.Sprintf("prompt %d step %d", i, j), outs[i].OutputLogprobs[j], c.OutputLogprobs[j])
				}
				for j, want := range c.PromptLogprobs {
					check(fmt.Sprintf("prompt %d token %d", i, j+1), outs[i].InputLogprobs[j+1], want)
				}
			}
		})
	}
	if trainedN > 0 {
		// Trained weights give peaked distributions: there the bf16 noise
		// floor is low and the mean must be within 0.02.
		t.Logf("default model: %d logprobs, mean |d| %.4f", trainedN, trainedSum/float64(trainedN))
		if trainedSum/float64(trainedN) > 0.02 {
			t.Errorf("default model: mean |d| %.4f above 0.02", trainedSum/float64(trainedN))
		}
	}
	if n > 0 {
		floorMean /= float64(len(models))
		t.Logf("GPU (bf16) vs transformers (bf16, sdpa): %d logprobs, mean |d| %.4f, max |d| %.4f; transformers eager vs sdpa: mean %.4f",
			n, sum/float64(n), worst, floorMean)
		if limit := max(0.02, 1.5*floorMean); sum/float64(n) > limit {
			t.Fatalf("mean |d| %.4f above %.4f", sum/float64(n), limit)
		}
	}
}

// seededRequests are twelve prompts of different lengths, sampled at
// temperature 1 with seeds, some stopping at EOS.
func seededRequests(t *testing.T, e *engine.Engine) []scheduler.Request {
	var reqs []scheduler.Request
	for i := range 12 {
		temp, seed, maxNew := 1.0, uint64(i+1), 20+7*i
		params, err := (&ioschema.SamplingParams{Temperature: &temp, SamplingSeed: &seed, MaxNewTokens: &maxNew,
			IgnoreEOS: i%3 != 0}).Resolve(e.Defaults())
		if err != nil {
			t.Fatal(err)
		}
		ids := make([]int32, 10+13*i)
		for j := range ids {
			ids[j] = int32((i*7919 + j*104729) % 4000)
		}
		reqs = append(reqs, scheduler.Request{Rid: fmt.Sprint(i), InputIDs: ids, Params: params, LogprobStartLen: -1})
	}
	return reqs
}

func generateSeeded(t *testing.T, disableOverlap bool) ([]scheduler.Output, runner.Stats) {
	e, err := engine.Open(engine.Config{ModelDir: defaultModelDir, Device: "cuda", MaxRunningRequests: 16,
		MaxTotalTokens: 8192, CUDAGraphMaxBS: 16, DisableOverlap: disableOverlap})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	outs, err := scheduler.Generate(e, seededRequests(t, e))
	if err != nil {
		t.Fatal(err)
	}
	return outs, e.Runner.Stats
}

// TestOverlapCUDA: with overlapped scheduling, decode graphs read their
// tokens from the previous graph's samples on the device; the outputs of
// seeded sampling must equal those of step-by-step scheduling.
func TestOverlapCUDA(t *testing.T) {
	if err := cuda.Available(); err != nil {
		t.Skip("no GPU:", err)
	}
	want, _ := generateSeeded(t, true)
	got, stats := generateSeeded(t, false)
	if stats.ChainedSteps == 0 {
		t.Fatalf("no step was chained on the device (%+v)", stats)
	}
	for i := range want {
		if !slices.Equal(got[i].OutputIDs, want[i].OutputIDs) {
			t.Errorf("request %d: overlapped %v\nsequential %v", i, got[i].OutputIDs, want[i].OutputIDs)
		}
	}
	t.Logf("%d of %d graph steps chained on the device", stats.ChainedSteps, stats.GraphSteps)
}

// TestDependentLaunchCUDA: kernels that start while the previous one
// finishes (programmatic dependent launch) must compute exactly what
// kernels launched one after the other do: same tokens, same logprob bits.
func TestDependentLaunchCUDA(t *testing.T) {
	if err := cuda.Available(); err != nil {
		t.Skip("no GPU:", err)
	}
	ctx, err := cuda.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	pdl := ctx.PDL
	ctx.Close()
	if !pdl {
		t.Skip("this GPU or driver has no programmatic dependent launch")
	}
	got, _ := generateSeeded(t, false)
	t.Setenv("EBB_PDL", "0")
	want, _ := generateSeeded(t, false)
	for i := range want {
		if !slices.Equal(got[i].OutputIDs, want[i].OutputIDs) || !slices.Equal(got[i].OutputLogprobs, want[i].OutputLogprobs) ||
			!slices.Equal(got[i].InputLogprobs, want[i].InputLogprobs) {
			t.Errorf("request %d: dependent launch %v %v\nserial %v %v", i, got[i].OutputIDs, got[i].OutputLogprobs,
				want[i].OutputIDs, want[i].OutputLogprobs)
		}
	}
}
