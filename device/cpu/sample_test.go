package cpu

import (
	"math"
	"math/rand/v2"
	"testing"
)

func logSoftmax(x []float32, t float32) []float64 {
	m := math.Inf(-1)
	for _, v := range x {
		m = math.Max(m, float64(v/t))
	}
	var z float64
	for _, v := range x {
		z += math.Exp(float64(v/t) - m)
	}
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = float64(v/t) - m - math.Log(z)
	}
	return out
}

func TestSampleRow(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	logits := make([]float32, 500)
	for i := range logits {
		logits[i] = float32(rng.NormFloat64() * 2)
	}
	order := make([]int, len(logits))
	for i := range order {
		order[i] = i
	}
	rank := func(id int32) int {
		r := 0
		for _, v := range logits {
			if v > logits[id] {
				r++
			}
		}
		return r
	}
	cases := []struct {
		name             string
		temp, topP, minP float32
		topK             int
		allowed          func(id int32) bool
	}{
		{"greedy", 0, 1, 0, -1, func(id int32) bool { return rank(id) == 0 }},
		{"top_k 1 is greedy", 0.7, 1, 0, 1, func(id int32) bool { return rank(id) == 0 }},
		{"top_k 5", 1, 1, 0, 5, func(id int32) bool { return rank(id) < 5 }},
		{"tiny top_p keeps the top token", 1, 1e-6, 0, -1, func(id int32) bool { return rank(id) == 0 }},
		{"min_p", 1, 1, 0.5, -1, func(id int32) bool {
			var top float32 = -1e9
			for _, v := range logits {
				top = max(top, v)
			}
			return math.Exp(float64(logits[id]-top)) >= 0.5
		}},
		{"plain sampling", 1.3, 1, 0, -1, func(int32) bool { return true }},
	}
	for _, c := range cases {
		seen := map[int32]bool{}
		for i := 0; i < 300; i++ {
			id, lp, _ := SampleRow(logits, c.temp, c.topP, c.topK, c.minP, uint32(i), 77)
			if id < 0 || !c.allowed(id) {
				t.Fatalf("%s: sampled %d (rank %d)", c.name, id, rank(id))
			}
			temp := c.temp
			if temp <= 0 {
				temp = 1
			}
			if want := logSoftmax(logits, temp)[id]; math.Abs(float64(lp)-want) > 1e-4 {
				t.Fatalf("%s: logprob %v, want %v", c.name, lp, want)
			}
			seen[id] = true
		}
		if c.name == "plain sampling" && len(seen) < 20 {
			t.Fatalf("plain sampling drew only %d distinct tokens over the whole [0,1) range", len(seen))
		}
	}
}

// TestGumbelDrawsFollowTheSoftmax: over many keys, each token is drawn as
// often as softmax(logits/T) says (and always the same for one key).
func TestGumbelDrawsFollowTheSoftmax(t *testing.T) {
	logits := []float32{2, 1, 0.5, 0, -1, -3}
	const n = 60000
	for _, temp := range []float32{1, 0.5} {
		want := logSoftmax(logits, temp)
		counts := make([]int, len(logits))
		for i := 0; i < n; i++ {
			id, _, _ := SampleRow(logits, temp, 1, -1, 0, uint32(i), uint32(i*7+3))
			counts[id]++
			if again, _, _ := SampleRow(logits, temp, 1, -1, 0, uint32(i), uint32(i*7+3)); again != id {
				t.Fatal("one key drew two tokens")
			}
		}
		for i, c := range counts {
			p := math.Exp(want[i])
			if sd := math.Sqrt(p * (1 - p) / n); math.Abs(float64(c)/n-p) > 5*sd+1e-4 {
				t.Errorf("T=%v token %d: frequency %.4f, probability %.4f", temp, i, float64(c)/n, p)
			}
		}
	}
}

func TestThreshold(t *testing.T) {
	p := []float32{1, 0.5, 0.25, 0.125, 0.125}
	z := float32(2)
	cases := []struct {
		topP float32
		topK int
		minP float32
		want float32
	}{
		{1, -1, 0, 0},
		{1, 2, 0, 0.5},
		{1, 4, 0, 0.125},  // ties at the k-th value are all kept
		{0.5, -1, 0, 0.5}, // mass before the second token is exactly top_p: kept, as SGLang does
		{0.4, -1, 0, 1},   // the first token alone covers top_p
		{0.6, -1, 0, 0.5},
		{1, -1, 0.3, 0.3},
		{0.6, 1, 0.1, 1},
	}
	for _, c := range cases {
		if got := Threshold(p, z, c.topP, c.topK, c.minP); got != c.want {
			t.Errorf("Threshold(top_p=%v top_k=%d min_p=%v) = %v, want %v", c.topP, c.topK, c.minP, got, c.want)
		}
	}
}

// TestFilteredDrawsFollowTheRenormalisedSoftmax: with top_k, top_p and
// min_p (alone and together, as a model's generation_config sets them),
// only the kept tokens are drawn, each as often as the softmax over the
// kept tokens says.
func TestFilteredDrawsFollowTheRenormalisedSoftmax(t *testing.T) {
	logits := []float32{3, 2.5, 2, 1.2, 1, 0, -0.5, -1, -2, -4}
	const n = 40000
	for _, c := range []struct {
		topP float32
		topK int
		minP float32
		kept int // the most likely tokens kept
	}{
		{1, 3, 0, 3},
		{0.8, -1, 0, 3},  // masses 0.42, 0.25, 0.15: the third passes 0.8
		{0.95, 20, 0, 5}, // Qwen3's defaults: top_p decides (0.956 with the fifth)
		{0.95, 2, 0, 2},  // top_k decides
		{1, -1, 0.2, 3},  // p >= 0.2 * max: logits within log(5) of 3
	} {
		p := make([]float64, len(logits))
		var kept float64
		for i := range c.kept {
			p[i] = math.Exp(float64(logits[i]))
			kept += p[i]
		}
		counts := make([]int, len(logits))
		for i := 0; i < n; i++ {
			id, _, _ := SampleRow(logits, 1, c.topP, c.topK, c.minP, uint32(i*31+7), uint32(i))
			counts[id]++
		}
		for i, got := range counts {
			want := p[i] / kept
			if sd := math.Sqrt(want * (1 - want) / n); math.Abs(float64(got)/n-want) > 5*sd+1e-4 {
				t.Errorf("%+v token %d: frequency %.4f, probability %.4f", c, i, float64(got)/n, want)
			}
		}
	}
}

// TestGumbelIsFiniteForEveryHash: the hash whose top 24 bits are all set
// once gave u = 1 and +Inf noise, so its token was drawn whatever its
// logit. The noise stays finite and the draw follows the logits.
func TestGumbelIsFiniteForEveryHash(t *testing.T) {
	k0, k1, i := GumbelMaxHash()
	g := Gumbel(k0, k1, i)
	if math.IsInf(float64(g), 0) || math.IsNaN(float64(g)) || g > 17 {
		t.Fatalf("Gumbel(%d, %d, %d) = %v, want finite and at most 17", k0, k1, i, g)
	}
	logits := make([]float32, i+2)
	for j := range logits {
		logits[j] = -30
	}
	logits[i+1] = 30
	if id, _, _ := SampleRow(logits, 1, 1, -1, 0, k0, k1); id != int32(i+1) {
		t.Fatalf("drew token %d (logit %v), want %d (logit %v)", id, logits[id], i+1, logits[i+1])
	}
}
