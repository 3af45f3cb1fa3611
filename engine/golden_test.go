package engine_test

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"ebb/engine"
	"ebb/ioschema"
	"ebb/model"
	"ebb/runner"
	"ebb/scheduler"
	"ebb/tinymodel"

	_ "ebb/device/cpu"
)

// golden is one file written by tools/golden_tiny.py from transformers.
type golden struct {
	Name          string          `json:"name"`
	Spec          json.RawMessage `json:"spec"`
	WeightsSHA256 string          `json:"weights_sha256"`
	NewTokens     int             `json:"new_tokens"`
	Cases         []goldenCase    `json:"cases"`      // transformers, float32, CPU
	BF16Cases     []goldenCase    `json:"bf16_cases"` // transformers, bf16, CUDA (sdpa)
	// BF16Floor is how far transformers' eager attention is from its sdpa
	// attention in bf16: the spread of two faithful bf16 implementations.
	BF16Floor struct{ Mean, Max float64 } `json:"bf16_floor"`
}

type goldenCase struct {
	InputIDs       []int32   `json:"input_ids"`
	OutputIDs      []int32   `json:"output_ids"`
	OutputLogprobs []float64 `json:"output_logprobs"`
	Top2Gap        []float64 `json:"top2_gap"`
	PromptLogprobs []float64 `json:"prompt_logprobs"`
	// Mixture-of-experts models: the experts every token but the last was
	// routed to, [tokens][layers][k] (-1 in dense layers), and the margin
	// of each token's choice in each layer [tokens][layers].
	RoutedExperts [][][]int32 `json:"routed_experts"`
	RouterMargin  [][]float64 `json:"router_margin"`
}

// Margins between neighbouring router probabilities that float32 noise
// (the CPU against transformers in float32) and bf16 noise (the GPU
// against transformers in bf16) may reorder.
const (
	routerTie     = 1e-5
	routerTieBF16 = 0.02
)

const (
	logprobTol = 1e-3
	nearTie    = 1e-4 // a top-2 gap this small may go either way in float32
)

func loadGoldens(t *testing.T) []golden {
	t.Helper()
	var cases []struct{ Name string }
	data, err := os.ReadFile("../testdata/goldens/cases.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &cases); err != nil {
		t.Fatal(err)
	}
	var out []golden
	for _, c := range cases {
		data, err := os.ReadFile(filepath.Join("../testdata/goldens", c.Name+".json"))
		if err != nil {
			t.Fatalf("golden for %s: %v (run tools/golden_tiny.py on the GPU machine)", c.Name, err)
		}
		var g golden
		if err := json.Unmarshal(data, &g); err != nil {
			t.Fatal(err)
		}
		out = append(out, g)
	}
	return out
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// writeGoldenModel regenerates a golden's model and checks that the weights
// are the bytes transformers saw.
func writeGoldenModel(t *testing.T, g golden) string {
	t.Helper()
	spec, err := tinymodel.FromJSON(g.Spec)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := tinymodel.Write(dir, spec); err != nil {
		t.Fatal(err)
	}
	sum, err := fileSHA256(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	if sum != g.WeightsSHA256 {
		t.Fatalf("%s: tiny-model weights changed (sha256 %s, golden %s): regenerate the goldens", g.Name, sum, g.WeightsSHA256)
	}
	return dir
}

// openCPU opens a model on the CPU with decode graphs emulated, so the
// graph path (static buffers, padding to a captured size) is what runs.
func openCPU(t *testing.T, dir string) *engine.Engine {
	t.Helper()
	return openOn(t, dir, "cpu")
}

// openOn is openCPU on the named CPU backend.
func openOn(t *testing.T, dir, backend string) *engine.Engine {
	t.Helper()
	e, err := engine.Open(engine.Config{ModelDir: dir, Device: backend, MaxRunningRequests: 8, ChunkedPrefillSize: 64,
		MaxTotalTokens: 4096, CUDAGraphMaxBS: 8, EnableReturnRoutedExperts: isMoE(t, dir)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// isMoE reports whether dir holds a mixture-of-experts model.
func isMoE(t *testing.T, dir string) bool {
	t.Helper()
	c, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	return c.MoE != nil
}

// compareRouting checks the experts ebb routed each token to against
// transformers' router, for every token before the outputs first differ
// (compared counts the output tokens that agree) and wherever the choice
// is not a float tie.
func compareRouting(t *testing.T, what string, c goldenCase, got []int32, compared int, tie float64) {
	t.Helper()
	if c.RoutedExperts == nil {
		return
	}
	layers, k := len(c.RoutedExperts[0]), len(c.RoutedExperts[0][0])
	n := len(c.InputIDs) + len(c.OutputIDs) - 1
	if len(got) != n*layers*k {
		t.Fatalf("%s: %d routed expert ids, want %d tokens x %d layers x %d", what, len(got), n, layers, k)
	}
	checked := 0
	for tok := 0; tok < min(n, len(c.InputIDs)+compared); tok++ {
		for l := 0; l < layers; l++ {
			if c.RouterMargin[tok][l] < tie {
				continue
			}
			want := c.RoutedExperts[tok][l]
			row := got[(tok*layers+l)*k : (tok*layers+l+1)*k]
			if !slices.Equal(row, want) {
				t.Fatalf("%s: token %d layer %d routed to %v, transformers %v (margin %.2g)", what, tok, l, row, want, c.RouterMargin[tok][l])
			}
			checked++
		}
	}
	if checked == 0 {
		t.Fatalf("%s: no routing compared", what)
	}
}

// TestGoldensCPU: greedy output is token-exact with transformers (float32)
// and every logprob is within 1e-3, for every architecture and config in
// testdata/goldens, with prompts from 1 to 130 tokens. The prompt is
// prefilled in chunks of 64, so chunked prefill is covered too.
func TestGoldensCPU(t *testing.T) {
	for _, g := range loadGoldens(t) {
		t.Run(g.Name, func(t *testing.T) {
			dir := writeGoldenModel(t, g)
			e := openCPU(t, dir)
			outs := runGolden(t, e, g)
			for i, c := range g.Cases {
				what := fmt.Sprintf("prompt of %d", len(c.InputIDs))
				n := compareGolden(t, what, c.OutputIDs, c.OutputLogprobs, c.Top2Gap,
					outs[i].OutputIDs, outs[i].OutputLogprobs, logprobTol)
				compareRouting(t, what, c, outs[i].RoutedExperts, n, routerTie)
				// Teacher-forced prompt logprobs (input_token_logprobs).
				got := outs[i].InputLogprobs
				if len(got) != len(c.InputIDs) || (len(got) > 0 && !math.IsNaN(float64(got[0]))) {
					t.Fatalf("input logprobs: %d values for %d tokens (first must be NaN)", len(got), len(c.InputIDs))
				}
				for j, want := range c.PromptLogprobs {
					if d := math.Abs(float64(got[j+1]) - want); d > logprobTol {
						t.Fatalf("prompt token %d: logprob %v, transformers %v", j+1, got[j+1], want)
					}
				}
			}
		})
	}
}

// TestWarmUpCPU: the warm-up prefills, which write only the pad slot,
// leave every golden unchanged.
func TestWarmUpCPU(t *testing.T) {
	g := loadGoldens(t)[0]
	e := openCPU(t, writeGoldenModel(t, g))
	sizes := runner.WarmUpSizes(e.Runner.Limits())
	if want := []int{16, 24, 32, 48, 64, 72}; !slices.Equal(sizes, want) {
		t.Fatalf("warm-up sizes %v, want %v", sizes, want)
	}
	if err := e.Runner.WarmUp(sizes); err != nil {
		t.Fatal(err)
	}
	outs := runGolden(t, e, g)
	for i, c := range g.Cases {
		compareGolden(t, fmt.Sprintf("prompt of %d", len(c.InputIDs)), c.OutputIDs, c.OutputLogprobs, c.Top2Gap,
			outs[i].OutputIDs, outs[i].OutputLogprobs, logprobTol)
	}
}

// runGolden generates every golden prompt greedily (ignoring eos, with
// prompt logprobs) and checks that decode steps went through graphs.
func runGolden(t *testing.T, e *engine.Engine, g golden) []scheduler.Output {
	t.Helper()
	outs := generateGolden(t, e, g)
	if e.Runner.Stats.GraphSteps == 0 {
		t.Fatalf("no decode step went through a graph (%+v)", e.Runner.Stats)
	}
	return outs
}

// generateGolden generates every golden prompt greedily (ignoring eos, with
// prompt logprobs).
func generateGolden(t *testing.T, e *engine.Engine, g golden) []scheduler.Output {
	t.Helper()
	zero := 0.0
	maxNew := g.NewTokens
	params, err := (&ioschema.SamplingParams{Temperature: &zero, MaxNewTokens: &maxNew, IgnoreEOS: true}).Resolve(e.Defaults())
	if err != nil {
		t.Fatal(err)
	}
	var reqs []scheduler.Request
	for i, c := range g.Cases {
		reqs = append(reqs, scheduler.Request{Rid: fmt.Sprint(i), InputIDs: c.InputIDs, Params: params,
			ReturnLogprob: true, LogprobStartLen: 0, ReturnRoutedExperts: c.RoutedExperts != nil})
	}
	outs, err := scheduler.Generate(e, reqs)
	if err != nil {
		t.Fatal(err)
	}
	return outs
}

// compareGolden checks tokens up to the first near-tie and logprobs there,
// and returns how many output tokens it compared.
func compareGolden(t *testing.T, what string, wantIDs []int32, wantLP, gaps []float64, gotIDs []int32, gotLP []float32, tol float64) int {
	t.Helper()
	n := len(wantIDs)
	for j, gap := range gaps {
		if gap < nearTie {
			n = j + 1 // this step may differ; nothing after it is comparable
			break
		}
	}
	if len(gotIDs) != len(wantIDs) {
		t.Fatalf("%s: %d tokens, want %d", what, len(gotIDs), len(wantIDs))
	}
	for j := 0; j < n; j++ {
		if gotIDs[j] != wantIDs[j] && gaps[j] >= nearTie {
			t.Fatalf("%s: token %d is %d, transformers %d (gap %.2g)\n got %v\nwant %v", what, j, gotIDs[j], wantIDs[j], gaps[j], gotIDs, wantIDs)
		}
		if d := math.Abs(float64(gotLP[j]) - wantLP[j]); d > tol && gotIDs[j] == wantIDs[j] {
			t.Fatalf("%s: step %d logprob %v, transformers %v (|d| %.2g)", what, j, gotLP[j], wantLP[j], d)
		}
	}
	if n < len(wantIDs) {
		t.Logf("%s: near-tie at step %d; compared %d tokens", what, n-1, n)
	}
	return n
}

// defaultModelDir is ebb's trained default model (tools/train_default_model.py).
const defaultModelDir = "../assets/default-model"

// loadDefaultModelGolden reads the transformers reference of the default
// model and checks that the committed weights are the ones it was made from.
func loadDefaultModelGolden(t *testing.T) golden {
	t.Helper()
	data, err := os.ReadFile("../testdata/goldens/default-model.json")
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		golden
		PromptTexts []string `json:"prompt_texts"`
	}
	if err := json.Unmarshal(data, &g); err != nil {
		t.Fatal(err)
	}
	sum, err := fileSHA256(filepath.Join(defaultModelDir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	if sum != g.WeightsSHA256 {
		t.Fatalf("default model weights (sha256 %s) are not the ones the golden was made from (%s)", sum, g.WeightsSHA256)
	}
	e := openCPU(t, defaultModelDir)
	for i, text := range g.PromptTexts {
		if got := e.Tokenizer.Encode(text, false); !slices.Equal(got, g.Cases[i].InputIDs) {
			t.Fatalf("prompt %q encodes as %v, transformers' tokenizer %v", text, got, g.Cases[i].InputIDs)
		}
	}
	return g.golden
}

// TestDefaultModelGoldensCPU: the trained default model (real, peaked
// distributions, unlike the random tiny models) generates token-exact with
// transformers in float32, and its prompt logprobs agree within 1e-3.
func TestDefaultModelGoldensCPU(t *testing.T) {
	g := loadDefaultModelGolden(t)
	e := openCPU(t, defaultModelDir)
	outs := runGolden(t, e, g)
	for i, c := range g.Cases {
		compareGolden(t, fmt.Sprintf("prompt of %d", len(c.InputIDs)), c.OutputIDs, c.OutputLogprobs, c.Top2Gap,
			outs[i].OutputIDs, outs[i].OutputLogprobs, logprobTol)
		for j, want := range c.PromptLogprobs {
			if d := math.Abs(float64(outs[i].InputLogprobs[j+1]) - want); d > logprobTol {
				t.Fatalf("prompt %d token %d: logprob %v, transformers %v", i, j+1, outs[i].InputLogprobs[j+1], want)
			}
		}
	}
}
