package bench

import (
	"fmt"
	"math"
	"math/rand/v2"
)

// Workload is the requests `ebb bench serving` sends: their prompt and
// output lengths and random prompt tokens, all drawn from Seed so that two
// servers see the same requests.
type Workload struct {
	Kind       string `json:"kind"` // fixed, random or sharegpt
	NumPrompts int    `json:"num_prompts"`
	// fixed
	InputLen  int `json:"input_len,omitempty"`
	OutputLen int `json:"output_len,omitempty"`
	// random: uniform in [Min, Max] (nano-vllm's benchmark: 100..1024 both)
	MinInput  int `json:"min_input,omitempty"`
	MaxInput  int `json:"max_input,omitempty"`
	MinOutput int `json:"min_output,omitempty"`
	MaxOutput int `json:"max_output,omitempty"`
	// OutputDist is how random outputs spread over [MinOutput, MaxOutput]:
	// uniform, or lognormal (a reasoning model's long tail: median at the
	// geometric mean of the bounds, which lie two standard deviations out).
	OutputDist string `json:"output_dist,omitempty"`
	// GroupSize samples of each prompt (GRPO's group), each with its own
	// output length; with GroupAsN one request asks for them with
	// sampling_params.n (and so one length), as RL frameworks may.
	GroupSize int  `json:"group_size,omitempty"`
	GroupAsN  bool `json:"group_as_n,omitempty"`
	Seed      uint64
}

// workRequest is one request of a workload: N samples (n) of Prompt, each
// of OutputLen tokens.
type workRequest struct {
	Prompt    []int32
	OutputLen int
	N         int
}

// samples is the number of completions the requests ask for.
func samples(reqs []workRequest) int {
	n := 0
	for _, r := range reqs {
		n += max(r.N, 1)
	}
	return n
}

// ShareGPT-like lengths: log-normal shapes close to ShareGPT V3's
// conversations as SGLang's bench_serving tokenizes them (prompts with a
// median near 100 tokens and a long tail, replies near 200), clipped to
// sane bounds. Generated, so no download and the same on every machine.
const (
	shareGPTInMedian, shareGPTInSigma   = 100, 1.3
	shareGPTOutMedian, shareGPTOutSigma = 200, 0.9
	shareGPTMaxIn, shareGPTMaxOut       = 4096, 2048
)

// Requests draws the workload's requests; token ids are uniform in
// [1, vocab) so that prompts share no prefixes.
func (w Workload) Requests(vocab int) ([]workRequest, error) {
	if w.NumPrompts <= 0 || vocab < 2 {
		return nil, fmt.Errorf("workload: %d prompts, vocabulary %d", w.NumPrompts, vocab)
	}
	rng := rand.New(rand.NewPCG(w.Seed, 0x5e7))
	uniform := func(lo, hi int) int { return lo + rng.IntN(hi-lo+1) }
	logNormal := func(median, sigma float64, hi int) int {
		v := int(math.Round(median * math.Exp(sigma*rng.NormFloat64())))
		return min(max(v, 4), hi)
	}
	var lengths func() (int, int)
	switch w.Kind {
	case "fixed":
		if w.InputLen <= 0 || w.OutputLen <= 0 {
			return nil, fmt.Errorf("workload fixed: input and output lengths must be positive")
		}
		lengths = func() (int, int) { return w.InputLen, w.OutputLen }
	case "random":
		if w.MinInput <= 0 || w.MaxInput < w.MinInput || w.MinOutput <= 0 || w.MaxOutput < w.MinOutput {
			return nil, fmt.Errorf("workload random: need 0 < min <= max for inputs (%d..%d) and outputs (%d..%d)",
				w.MinInput, w.MaxInput, w.MinOutput, w.MaxOutput)
		}
		out := func() int { return uniform(w.MinOutput, w.MaxOutput) }
		switch w.OutputDist {
		case "", "uniform":
		case "lognormal":
			median := math.Sqrt(float64(w.MinOutput) * float64(w.MaxOutput))
			sigma := math.Log(float64(w.MaxOutput)/float64(w.MinOutput)) / 4
			out = func() int {
				return min(max(int(math.Round(median*math.Exp(sigma*rng.NormFloat64()))), w.MinOutput), w.MaxOutput)
			}
		default:
			return nil, fmt.Errorf("output distribution %q: want uniform or lognormal", w.OutputDist)
		}
		lengths = func() (int, int) { return uniform(w.MinInput, w.MaxInput), out() }
	case "sharegpt":
		lengths = func() (int, int) {
			return logNormal(shareGPTInMedian, shareGPTInSigma, shareGPTMaxIn), logNormal(shareGPTOutMedian, shareGPTOutSigma, shareGPTMaxOut)
		}
	default:
		return nil, fmt.Errorf("workload %q: want fixed, random or sharegpt", w.Kind)
	}
	group := max(w.GroupSize, 1)
	out := make([]workRequest, 0, w.NumPrompts*group)
	for range w.NumPrompts {
		in, o := lengths()
		p := make([]int32, in)
		for j := range p {
			p[j] = int32(1 + rng.IntN(vocab-1))
		}
		if w.GroupAsN || group == 1 {
			out = append(out, workRequest{Prompt: p, OutputLen: o, N: group})
			continue
		}
		for j := range group {
			if j > 0 {
				_, o = lengths() // each sample its own length
			}
			out = append(out, workRequest{Prompt: p, OutputLen: o, N: 1})
		}
	}
	return out, nil
}

// arrivals returns each request's send time in seconds from the start: all
// at zero when rate is infinite (or not positive), otherwise a Poisson
// process of rate requests per second.
func arrivals(n int, rate float64, seed uint64) []float64 {
	out := make([]float64, n)
	if rate <= 0 || math.IsInf(rate, 1) {
		return out
	}
	rng := rand.New(rand.NewPCG(seed, 0xa77))
	t := 0.0
	for i := range out {
		t += rng.ExpFloat64() / rate
		out[i] = t
	}
	return out
}
