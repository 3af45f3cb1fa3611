package engine_test

import (
	"encoding/json"
	"fmt"
	"math"
	"os/exec"
	"testing"

	"ebb/tinymodel"
)

// torchReference runs tools/moe_reference.py (a Qwen2/Qwen3 forward pass in
// plain PyTorch, float32) on the model in dir for the given prompts, or
// skips the test where /usr/bin/python3 has no PyTorch (make test installs
// Debian's python3-torch).
func torchReference(t *testing.T, dir string, prompts [][]int32) golden {
	t.Helper()
	if err := exec.Command("/usr/bin/python3", "-c", "import torch").Run(); err != nil {
		t.Skip("no PyTorch for /usr/bin/python3 (scripts/install-deps.sh installs python3-torch)")
	}
	ids, err := json.Marshal(prompts)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("/usr/bin/python3", "../tools/moe_reference.py", dir, "--input-ids", string(ids)).Output()
	if err != nil {
		t.Fatalf("tools/moe_reference.py: %v", err)
	}
	var g golden
	if err := json.Unmarshal(out, &g); err != nil {
		t.Fatal(err)
	}
	return g
}

// TestReferenceMatchesGoldens: tools/moe_reference.py gives what
// transformers gave for the goldens of a dense Qwen2, a dense Qwen3 with
// biases and two Qwen3-MoE configurations (float32): the same greedy tokens
// and routed experts, logprobs within 1e-3. That is what lets it stand in
// for transformers where no golden exists yet.
func TestReferenceMatchesGoldens(t *testing.T) {
	want := map[string]bool{"qwen2-default": true, "qwen3-untied-gqa4-bias": true, "qwen3moe-default": true,
		"qwen3moe-e16-top4-nonorm-dense": true}
	for _, g := range loadGoldens(t) {
		if !want[g.Name] {
			continue
		}
		t.Run(g.Name, func(t *testing.T) {
			var prompts [][]int32
			for _, c := range g.Cases {
				prompts = append(prompts, c.InputIDs)
			}
			ref := torchReference(t, writeGoldenModel(t, g), prompts)
			for i, c := range g.Cases {
				r := ref.Cases[i]
				what := fmt.Sprintf("prompt of %d", len(c.InputIDs))
				lp := make([]float32, len(r.OutputLogprobs))
				for j, v := range r.OutputLogprobs {
					lp[j] = float32(v)
				}
				n := compareGolden(t, what, c.OutputIDs, c.OutputLogprobs, c.Top2Gap, r.OutputIDs, lp, logprobTol)
				var routed []int32
				for _, tok := range r.RoutedExperts {
					for _, layer := range tok {
						routed = append(routed, layer...)
					}
				}
				compareRouting(t, what, c, routed, n, routerTie)
				for j, v := range c.PromptLogprobs {
					if d := math.Abs(v - r.PromptLogprobs[j]); d > logprobTol {
						t.Fatalf("%s: prompt token %d: reference %v, transformers %v", what, j+1, r.PromptLogprobs[j], v)
					}
				}
			}
		})
	}
}

// TestQwen2MoEAgainstReferenceCPU: Qwen2-MoE (routed experts beside a
// shared expert weighted by the sigmoid of its own gate) on the CPU, in
// three configurations, against tools/moe_reference.py: greedy tokens
// exact, every output and prompt logprob within 1e-3, and the experts ebb
// returns for every token and layer equal the reference's. Prompts of 1 to
// 130 tokens, prefilled in chunks of 64.
func TestQwen2MoEAgainstReferenceCPU(t *testing.T) {
	for _, c := range []struct {
		name string
		edit func(*tinymodel.Spec)
	}{
		{"default", nil},
		{"e16-top4-norm-dense-layer", func(s *tinymodel.Spec) {
			s.Experts, s.ExpertsPerToken, s.NormTopK, s.Layers, s.MLPOnly = 16, 4, true, 3, []int{1}
			s.MoEIntermediate, s.SharedIntermediate, s.Seed = 32, 64, 9
		}},
		{"step2-shared-wider-than-dense", func(s *tinymodel.Spec) {
			s.SparseStep, s.Layers, s.SharedIntermediate, s.Intermediate, s.Tie, s.Seed = 2, 4, 256, 128, true, 10
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := tinymodel.TestDir(t, "qwen2_moe", c.edit)
			prompts := [][]int32{{17}, {3, 99, 250, 7, 411, 12, 64}, make([]int32, 33), make([]int32, 130)}
			for i := range prompts[2] {
				prompts[2][i] = int32((i*37 + 5) % 512)
			}
			for i := range prompts[3] {
				prompts[3][i] = int32((i*101 + 11) % 512)
			}
			ref := torchReference(t, dir, prompts)
			ref.NewTokens = 32
			outs := runGolden(t, openCPU(t, dir), ref)
			for i, rc := range ref.Cases {
				what := fmt.Sprintf("prompt of %d", len(rc.InputIDs))
				n := compareGolden(t, what, rc.OutputIDs, rc.OutputLogprobs, rc.Top2Gap, outs[i].OutputIDs,
					outs[i].OutputLogprobs, logprobTol)
				compareRouting(t, what, rc, outs[i].RoutedExperts, n, routerTie)
				got := outs[i].InputLogprobs
				for j, want := range rc.PromptLogprobs {
					if d := math.Abs(float64(got[j+1]) - want); d > logprobTol {
						t.Fatalf("%s: prompt token %d: logprob %v, reference %v", what, j+1, got[j+1], want)
					}
				}
			}
		})
	}
}
