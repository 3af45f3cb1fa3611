package cuda

import (
	"fmt"
	"math"
	"testing"

	"ebb/device"
	"ebb/device/cpu"
)

// filterCase is one row's sampling parameters.
type filterCase struct {
	temp, topP float32
	topK       int32
	minP       float32
}

// largeVocabCases cover both of sample_finish's ways to its threshold: the
// candidates of top_k up to the block's 1024 threads (with top_p and min_p
// on top), and radix selection beyond it or without top_k.
var largeVocabCases = []filterCase{
	{1, 0.95, 20, 0}, // Qwen3's generation_config
	{1, 1, 20, 0},
	{0.6, 0.95, 20, 0},
	{0.7, 0.9, 50, 0.01},
	{1, 1, 1000, 0},
	{1, 0.5, 1000, 0},
	{1, 1, 1024, 0},
	{1.2, 0.95, 2, 0},
	{1, 0.95, 1500, 0}, // radix selection
	{1, 0.9, -1, 0},    // radix selection
	{1, 1, -1, 0.05},
	{0, 0.95, 20, 0}, // greedy
}

// TestSampleFilteredLargeVocab: over Qwen3's 151,936-token vocabulary, the
// GPU draws the CPU reference's token for every filter combination, from
// bf16 logits (decode graphs) and float32 ones (eager steps).
func TestSampleFilteredLargeVocab(t *testing.T) {
	p := newPair(t)
	const v = 151936
	b := len(largeVocabCases)
	temp, topP, topK, minP := make([]float32, b), make([]float32, b), make([]int32, b), make([]float32, b)
	for i, c := range largeVocabCases {
		temp[i], topP[i], topK[i], minP[i] = c.temp, c.topP, c.topK, c.minP
	}
	mismatches := 0
	for trial := 0; trial < 4; trial++ {
		dt := device.BF16
		if trial%2 == 1 {
			dt = device.F32
		}
		// Trials 0-1: flat logits (a random model's: kept sets of
		// thousands); 2-3: peaked ones (a trained model's).
		scale := float32(0.7)
		if trial >= 2 {
			scale = 4
		}
		logits := p.random(dt, scale, b, v)
		keys := make([]int32, 2*b)
		for i := range keys {
			keys[i] = int32(p.rng.Uint32())
		}
		args := sampleArgs(p, temp, topP, topK, minP, keys, 0)
		p.gpu.Sample(logits.g, args[0])
		p.cpu.Sample(logits.c, args[1])
		p.sync()
		gi, ci := make([]int32, b), make([]int32, b)
		if err := p.gpu.DownloadI32(args[0].IDs, gi); err != nil {
			t.Fatal(err)
		}
		if err := p.cpu.DownloadI32(args[1].IDs, ci); err != nil {
			t.Fatal(err)
		}
		for r := range gi {
			if gi[r] != ci[r] {
				mismatches++
				t.Logf("trial %d row %d %+v: gpu %d, cpu %d", trial, r, largeVocabCases[r], gi[r], ci[r])
			}
		}
		p.close("sampled logprobs", both{args[0].Logprobs, args[1].Logprobs}, 1e-3, 1e-4)
	}
	// The CPU sums its mass in float32; a draw within rounding of a
	// boundary may land on the other side.
	if mismatches > 1 {
		t.Fatalf("%d of %d draws differ", mismatches, 4*b)
	}
}

// TestSampleFilteredDistribution draws one row many times under different
// keys: every token drawn is in the kept set the CPU reference computes,
// and each kept token is drawn as often as its renormalised probability
// says, within five standard deviations.
func TestSampleFilteredDistribution(t *testing.T) {
	p := newPair(t)
	const v, draws = 32000, 4096
	for _, c := range []filterCase{{1, 0.95, 20, 0}, {0.8, 0.9, 100, 0}, {1, 0.8, -1, 0}, {1, 1, 5, 0.05}} {
		row := make([]float32, v)
		for i := range row {
			row[i] = float32(p.rng.NormFloat64()) * 2.5
		}
		vals := make([]float32, 0, v*draws)
		for range draws {
			vals = append(vals, row...)
		}
		logits := p.floats(device.BF16, vals, draws, v)
		copy(row, vals[:v]) // as rounded to bf16
		temp, topP, topK, minP := make([]float32, draws), make([]float32, draws), make([]int32, draws), make([]float32, draws)
		keys := make([]int32, 2*draws)
		for i := range temp {
			temp[i], topP[i], topK[i], minP[i] = c.temp, c.topP, c.topK, c.minP
			keys[2*i], keys[2*i+1] = int32(p.rng.Uint32()), int32(p.rng.Uint32())
		}
		args := sampleArgs(p, temp, topP, topK, minP, keys, 0)
		p.gpu.Sample(logits.g, args[0])
		p.sync()
		ids := make([]int32, draws)
		if err := p.gpu.DownloadI32(args[0].IDs, ids); err != nil {
			t.Fatal(err)
		}
		// The reference's kept set and probabilities.
		scaled := make([]float32, v)
		m := float32(math.Inf(-1))
		for i, x := range row {
			scaled[i] = x / c.temp
			m = max(m, scaled[i])
		}
		prob := make([]float32, v)
		var z float32
		for i, s := range scaled {
			prob[i] = float32(math.Exp(float64(s - m)))
			z += prob[i]
		}
		tau := cpu.Threshold(prob, z, c.topP, int(c.topK), c.minP)
		var kept float64
		for _, q := range prob {
			if q >= tau {
				kept += float64(q)
			}
		}
		counts := map[int32]int{}
		for _, id := range ids {
			if prob[id] < tau {
				t.Fatalf("%+v: drew token %d (p %g) below the threshold %g", c, id, prob[id], tau)
			}
			counts[id]++
		}
		// Tokens expected 25 times or more one by one, the rest together
		// (a normal bound is wrong for a count expected once or twice).
		worst, restWant, restGot := 0.0, 0.0, 0
		check := func(what string, got int, p float64) {
			want := draws * p
			sd := math.Sqrt(want * (1 - p))
			dev := math.Abs(float64(got)-want) / max(sd, 1)
			worst = max(worst, dev)
			if dev > 5 {
				t.Errorf("%+v: %s drawn %d times, want %.1f +- %.1f", c, what, got, want, sd)
			}
		}
		for i, q := range prob {
			switch p := float64(q) / kept; {
			case q < tau:
			case draws*p >= 25:
				check(fmt.Sprint("token ", i), counts[int32(i)], p)
			default:
				restWant += p
				restGot += counts[int32(i)]
			}
		}
		if restWant > 0 {
			check("the unlikely kept tokens", restGot, restWant)
		}
		t.Logf("%+v: %d distinct tokens drawn, worst deviation %.2f sd", c, len(counts), worst)
	}
}

// TestSampleGumbelMaxHash: the token whose noise hash is the largest (it
// once got +inf noise and was drawn whatever its logit) is drawn only as
// its logit says, plain and filtered, by the GPU as by the CPU.
func TestSampleGumbelMaxHash(t *testing.T) {
	p := newPair(t)
	k0, k1, tok := cpu.GumbelMaxHash()
	v := tok + 2
	vals := make([]float32, v)
	for i := range vals {
		vals[i] = -30
	}
	vals[tok+1] = 30
	for _, dt := range []device.DType{device.F32, device.BF16} {
		logits := p.floats(dt, append(append([]float32{}, vals...), vals...), 2, v)
		keys := []int32{int32(k0), int32(k1), int32(k0), int32(k1)}
		args := sampleArgs(p, []float32{1, 1}, []float32{1, 0.95}, []int32{-1, 20}, []float32{0, 0}, keys, 0)
		p.gpu.Sample(logits.g, args[0])
		p.cpu.Sample(logits.c, args[1])
		p.sync()
		for i, d := range []device.Device{p.gpu, p.cpu} {
			ids := make([]int32, 2)
			if err := d.DownloadI32(args[i].IDs, ids); err != nil {
				t.Fatal(err)
			}
			for r, id := range ids {
				if id != int32(tok+1) {
					t.Errorf("%v logits, row %d (%s): drew token %d, want %d", dt, r, []string{"gpu", "cpu"}[i], id, tok+1)
				}
			}
		}
	}
}

// BenchmarkSample times one decode step's sampling of 256 rows over
// Qwen3's vocabulary from bf16 logits: flat ones (a random model's) and
// spread ones (a trained model's), each plain and under Qwen3's
// generation_config (top_k 20, top_p 0.95). On a GPU:
//
//	cuda.test -test.run XXX -test.bench Sample -test.benchtime 40x
func BenchmarkSample(b *testing.B) {
	const rows, v = 256, 151936
	p := newPair(b)
	for _, c := range []struct {
		name  string
		scale float32
		f     filterCase
	}{
		{"flat", 0.7, filterCase{1, 1, -1, 0}},
		{"spread", 4, filterCase{1, 1, -1, 0}},
		{"flat-qwen3", 0.7, filterCase{1, 0.95, 20, 0}},
		{"spread-qwen3", 4, filterCase{1, 0.95, 20, 0}},
	} {
		b.Run(c.name, func(b *testing.B) {
			temp, topP, topK, minP := make([]float32, rows), make([]float32, rows), make([]int32, rows), make([]float32, rows)
			keys := make([]int32, 2*rows)
			for i := range temp {
				temp[i], topP[i], topK[i], minP[i] = c.f.temp, c.f.topP, c.f.topK, c.f.minP
				keys[2*i], keys[2*i+1] = int32(p.rng.Uint32()), int32(p.rng.Uint32())
			}
			logits := p.random(device.BF16, c.scale, rows, v)
			args := sampleArgs(p, temp, topP, topK, minP, keys, 0)
			p.gpu.Sample(logits.g, args[0])
			if err := p.gpu.Sync(); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for range b.N {
				p.gpu.Sample(logits.g, args[0])
			}
			if err := p.gpu.Sync(); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(rows*v*2)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}
