package cpu

import (
	"math"
	"sort"

	"ebb/device"
)

// Sample implements device.Device with the reference sampling algorithm that
// the CUDA kernels reproduce:
//
//  1. Greedy (temperature 0, or top_k 1): the lowest id of the largest logit;
//     its logprob is from log_softmax(logits/T), T = 1 when temperature is 0.
//  2. Otherwise scaled s = logits/T and p = exp(s - max). The sampled token's
//     logprob is from log_softmax(s), before filtering (SGLang's default).
//  3. Filtering keeps every token with p >= tau, tau the largest of: the k-th
//     largest p (top_k); the p of the last token of the shortest descending
//     prefix whose mass exceeds top_p (top_p < 1); min_p * max p (min_p).
//  4. The token is the kept one with the largest s + g, g the Gumbel noise
//     of its id under the row's key (lowest id among equals): a draw from
//     softmax over the kept tokens that one pass over the row finds.
func (d *Device) Sample(logits device.Tensor, a device.SampleArgs) {
	v := logits.Dim(-1)
	all := F32(logits)
	temp, topP, topK, minP, keys := F32(a.Temperature), F32(a.TopP), I32(a.TopK), F32(a.MinP), I32(a.Keys)
	ids, lps := I32(a.IDs), F32(a.Logprobs)
	k := 0
	if a.TopIDs.Valid() {
		k = a.TopIDs.Dim(-1)
	}
	for r := 0; r < logits.Dim(0); r++ {
		row := all[r*v : (r+1)*v]
		id, lp, scaled := SampleRow(row, temp[r], topP[r], int(topK[r]), minP[r], uint32(keys[2*r]), uint32(keys[2*r+1]))
		ids[r], lps[r] = id, lp
		if k > 0 {
			topIDs, topLps := I32(a.TopIDs)[r*k:(r+1)*k], F32(a.TopLogprobs)[r*k:(r+1)*k]
			TopLogprobs(scaled, topIDs, topLps)
		}
	}
}

// ResolveTokens implements device.Device.
func (d *Device) ResolveTokens(tokens, src, prev device.Tensor) {
	t, s, p := I32(tokens), I32(src), I32(prev)
	for i := range t {
		if s[i] >= 0 {
			t[i] = p[s[i]]
		}
	}
}

// Gumbel is the noise of token i for a row keyed (k0, k1): lowbias32 of
// the id mixed with the key, as a uniform in (0, 1), then -log(-log(u)).
// The CUDA sampler's gumbel is the same function.
//
// u stays below 1: for the largest hash, h>>8 + 0.5 rounds to 2^24 in
// float32, which made u 1 and the noise +Inf, so that token won whatever
// its logit (in one row in 110 over a 151,936-token vocabulary).
func Gumbel(k0, k1 uint32, i int) float32 {
	u := min((float32(gumbelHash(k0, k1, i)>>8)+0.5)*(1.0/16777216), math.Nextafter32(1, 0))
	return float32(-math.Log(-math.Log(float64(u))))
}

// GumbelMaxHash is a row key and a token whose hash has its top 24 bits
// set, the largest u (for tests of both samplers).
func GumbelMaxHash() (k0, k1 uint32, i int) {
	for k0 = 1; ; k0++ {
		for i = 0; i < 1<<20; i++ {
			if gumbelHash(k0, 7, i)>>8 == 1<<24-1 {
				return k0, 7, i
			}
		}
	}
}

// gumbelHash is lowbias32 of token i mixed with the row's key.
func gumbelHash(k0, k1 uint32, i int) uint32 {
	mix := func(h uint32) uint32 {
		h ^= h >> 16
		h *= 0x7feb352d
		h ^= h >> 15
		h *= 0x846ca68b
		return h ^ h>>16
	}
	return mix(mix(uint32(i)*0x9e3779b1^k0) ^ k1)
}

// SampleRow samples one row; it also returns the logits as scaled for the
// logprobs (divided by the temperature unless greedy).
func SampleRow(logits []float32, temperature, topP float32, topK int, minP float32, k0, k1 uint32) (int32, float32, []float32) {
	greedy := temperature <= 0 || topK == 1
	if temperature <= 0 {
		temperature = 1
	}
	scaled := logits
	if temperature != 1 {
		scaled = make([]float32, len(logits))
		for i, x := range logits {
			scaled[i] = x / temperature
		}
	}
	lse := logSumExp(scaled)
	if greedy {
		best := 0
		for i, x := range scaled {
			if x > scaled[best] {
				best = i
			}
		}
		return int32(best), scaled[best] - lse, scaled
	}
	var p []float32 // kept tokens have p >= tau; nil keeps all
	tau := float32(0)
	if topK > 0 && topK < len(logits) || topP < 1 || minP > 0 {
		m := float32(math.Inf(-1))
		for _, x := range scaled {
			m = max(m, x)
		}
		p = make([]float32, len(logits))
		var z float32
		for i, x := range scaled {
			p[i] = float32(math.Exp(float64(x - m)))
			z += p[i]
		}
		tau = Threshold(p, z, topP, topK, minP)
	}
	choice, best := -1, float32(math.Inf(-1))
	for i, x := range scaled {
		if math.IsInf(float64(x), -1) || p != nil && p[i] < tau {
			continue
		}
		if v := x + Gumbel(k0, k1, i); choice < 0 || v > best {
			choice, best = i, v
		}
	}
	if choice < 0 {
		choice = 0 // every logit is -inf
	}
	return int32(choice), scaled[choice] - lse, scaled
}

// Threshold computes the filtering threshold tau of step 3 over
// unnormalised probabilities p (max 1) with total mass z.
func Threshold(p []float32, z float32, topP float32, topK int, minP float32) float32 {
	tau := float32(0)
	if minP > 0 {
		tau = minP // the largest p is exp(0) = 1
	}
	if (topK <= 0 || topK >= len(p)) && topP >= 1 {
		return tau
	}
	sorted := append([]float32(nil), p...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i] > sorted[j] })
	if topK > 0 && topK < len(p) {
		tau = max(tau, sorted[topK-1])
	}
	if topP < 1 {
		limit := topP * z
		var before float32
		for _, x := range sorted {
			if before+x > limit {
				tau = max(tau, x)
				break
			}
			before += x
		}
	}
	return tau
}

func logSumExp(x []float32) float32 {
	m := float32(math.Inf(-1))
	for _, v := range x {
		m = max(m, v)
	}
	var s float64
	for _, v := range x {
		s += math.Exp(float64(v - m))
	}
	return m + float32(math.Log(s))
}

// TopLogprobs fills the k most likely tokens of log_softmax(scaled), largest
// first, lowest id first among equals.
func TopLogprobs(scaled []float32, ids []int32, lps []float32) {
	lse := logSumExp(scaled)
	idx := make([]int32, len(scaled))
	for i := range idx {
		idx[i] = int32(i)
	}
	sort.SliceStable(idx, func(i, j int) bool { return scaled[idx[i]] > scaled[idx[j]] })
	for j := range ids {
		ids[j] = idx[j]
		lps[j] = scaled[idx[j]] - lse
	}
}

// TokenLogprobs implements device.Device.
func (d *Device) TokenLogprobs(out, logits, targets device.Tensor) {
	v := logits.Dim(-1)
	all, o := F32(logits), F32(out)
	for r, t := range I32(targets) {
		row := all[r*v : (r+1)*v]
		o[r] = row[t] - logSumExp(row)
	}
}

// ApplyPenalties implements device.Device. Repetition divides positive
// logits (multiplies negative ones) of every listed token with a count or in
// the prompt; frequency and presence subtract count*freq and presence for
// tokens generated so far; the bias is added last.
func (d *Device) ApplyPenalties(logits device.Tensor, a device.PenaltyArgs) {
	v := logits.Dim(-1)
	all := F32(logits)
	rowPtr, toks, counts, bias := I32(a.RowPtr), I32(a.Tokens), I32(a.Counts), F32(a.Bias)
	rep, freq, pres := F32(a.Repetition), F32(a.Frequency), F32(a.Presence)
	for r := 0; r < logits.Dim(0); r++ {
		row := all[r*v : (r+1)*v]
		for j := rowPtr[r]; j < rowPtr[r+1]; j++ {
			t, c := toks[j], counts[j]
			x := row[t]
			if rep[r] != 1 {
				if x > 0 {
					x /= rep[r]
				} else {
					x *= rep[r]
				}
			}
			if c > 0 {
				x -= float32(c)*freq[r] + pres[r]
			}
			row[t] = x + bias[j]
		}
	}
}
