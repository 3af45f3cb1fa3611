package scheduler

import (
	"math"
	"strings"

	"ebb/ioschema"
	"ebb/runner"
	"ebb/tokenizer"
)

// Request is a tokenized generation request as the core accepts it.
type Request struct {
	Rid             string
	InputIDs        []int32
	Params          ioschema.Resolved
	ReturnLogprob   bool
	LogprobStartLen int // first prompt position whose logprob is returned; -1: none
	TopLogprobsNum  int
	// ReturnRoutedExperts asks for the experts every token was routed to
	// (mixture-of-experts models, --enable-return-routed-experts).
	ReturnRoutedExperts bool
}

// Event is what one request produced in one step.
type Event struct {
	Rid               string
	NewTokens         []int32
	OutputLogprobs    []float32
	OutputTopIDs      [][]int32
	OutputTopLogprobs [][]float32
	// InputLogprobs is set once, when the prompt is done: the logprob of
	// each prompt token from LogprobStartLen (NaN for the first token).
	InputLogprobs []float32
	InputTokenIDs []int32
	// InputTopIDs and InputTopLogprobs, set with InputLogprobs where the
	// request asked for top logprobs, are each prompt position's most
	// likely tokens (nil for the first token).
	InputTopIDs      [][]int32
	InputTopLogprobs [][]float32
	Finished         bool
	FinishReason     *ioschema.FinishReason
	PromptTokens     int
	CompletionTokens int
	CachedTokens     int
	// RoutedExperts, in a finished request's last event when it asked, are
	// the experts each of its tokens but the last was routed to:
	// [prompt + output - 1, layers, k] int32 (SGLang's layout).
	RoutedExperts []int32
}

type request struct {
	Request
	output     []int32
	slots      []int32    // KV slots of tokens()[:len(slots)]
	node       *radixNode // locked end of the cached prefix
	nodeTokens int        // tokens covered by node
	cached     int        // prompt tokens reused from the cache at first admission
	admitted   bool
	// computed is the most tokens r had computed when it was retracted,
	// and recompute how many of those its next admission did not find
	// cached and computes again (Stats.RecomputedTokens).
	computed, recompute int
	seed                uint64
	counts              map[int32]int32 // output token counts, for penalties
	inputLP             []float32
	inputTopIDs         [][]int32 // with inputLP, where top logprobs are asked
	inputTopLP          [][]float32
	inputDone           bool
	// ahead counts launched steps whose token is not absorbed yet; epoch
	// changes whenever r stops running, so results of steps launched
	// before are recognised as stale.
	ahead int
	epoch int
}

func (r *request) tokens() []int32 {
	if len(r.output) == 0 {
		return r.InputIDs
	}
	t := make([]int32, 0, len(r.InputIDs)+len(r.output))
	return append(append(t, r.InputIDs...), r.output...)
}

// tokenRange is tokens()[from:to] without building the whole sequence
// (a decode step needs one token of it).
func (r *request) tokenRange(from, to int) []int32 {
	n := len(r.InputIDs)
	switch {
	case to <= n:
		return r.InputIDs[from:to]
	case from >= n:
		return r.output[from-n : to-n]
	}
	return append(append(make([]int32, 0, to-from), r.InputIDs[from:]...), r.output[:to-n]...)
}

func (r *request) numTokens() int { return len(r.InputIDs) + len(r.output) }

// pending is the number of tokens whose KV is not computed yet.
func (r *request) pending() int { return r.numTokens() - len(r.slots) }

// inPrefill reports whether the request still has prompt (or, after a
// retraction, earlier output) to process before its next sample.
func (r *request) inPrefill() bool { return r.pending() > 1 || len(r.output) == 0 }

func (r *request) wantsInputLogprobs() bool {
	return r.ReturnLogprob && r.LogprobStartLen >= 0 && r.LogprobStartLen < len(r.InputIDs) && !r.inputDone
}

func (r *request) sampleParams() runner.SampleParams {
	p := r.Params
	return runner.SampleParams{
		Temperature: p.Temperature, TopP: p.TopP, TopK: p.TopK, MinP: p.MinP,
		RepetitionPenalty: p.RepetitionPenalty, FrequencyPenalty: p.FrequencyPenalty,
		PresencePenalty: p.PresencePenalty, Seed: r.seed, TopLogprobs: r.topLogprobs(),
	}
}

func (r *request) topLogprobs() int {
	if !r.ReturnLogprob {
		return 0
	}
	return r.TopLogprobsNum
}

// adjust builds the logit adjustments for the next sample: penalties,
// logit_bias and, before min_new_tokens, bans on the tokens that would end
// the request. A token has one entry, whatever applies to it: the kernel
// takes a row's entries in parallel, so two for one token would race, and
// each would apply the penalties again.
func (r *request) adjust(eos []int32) []runner.LogitAdjust {
	p := r.Params
	rep := p.RepetitionPenalty != 1
	var out []runner.LogitAdjust
	var at map[int32]int // made on the first entry: most steps of most requests have none
	entry := func(t int32) *runner.LogitAdjust {
		i, ok := at[t]
		if !ok {
			if at == nil {
				at = map[int32]int{}
			}
			i = len(out)
			at[t] = i
			out = append(out, runner.LogitAdjust{Token: t, Count: r.counts[t]})
		}
		return &out[i]
	}
	if rep || p.FrequencyPenalty != 0 || p.PresencePenalty != 0 {
		if rep {
			for _, t := range r.InputIDs {
				entry(t)
			}
		}
		for t := range r.counts {
			entry(t)
		}
	}
	for _, b := range p.LogitBias {
		entry(b.Token).Bias += b.Bias
	}
	if len(r.output) < p.MinNewTokens {
		ban := float32(math.Inf(-1))
		if !p.IgnoreEOS {
			for _, t := range eos {
				entry(t).Bias = ban
			}
		}
		for _, t := range p.StopTokenIDs {
			entry(t).Bias = ban
		}
	}
	return out
}

// checkFinish decides whether the token just appended ends the request.
func (r *request) checkFinish(eos []int32, tok *tokenizer.Tokenizer) *ioschema.FinishReason {
	p := r.Params
	last := r.output[len(r.output)-1]
	if len(r.output) >= p.MinNewTokens {
		if !p.IgnoreEOS {
			for _, e := range eos {
				if last == e {
					return ioschema.FinishStopToken(last)
				}
			}
		}
		for _, s := range p.StopTokenIDs {
			if last == s {
				return ioschema.FinishStopToken(last)
			}
		}
		if s := r.matchStopString(tok); s != "" {
			return ioschema.FinishStopString(s)
		}
		if s := r.matchStopRegex(tok); s != "" {
			return ioschema.FinishStopString(s)
		}
	}
	if len(r.output) >= p.MaxNewTokens {
		return ioschema.FinishLength(p.MaxNewTokens)
	}
	return nil
}

// matchStopString looks for a stop string in the text of the newest tokens,
// as SGLang does: every stop string is at most maxLen bytes, and every token
// is at least one byte.
func (r *request) matchStopString(tok *tokenizer.Tokenizer) string {
	if len(r.Params.Stop) == 0 || tok == nil {
		return ""
	}
	maxLen := 0
	for _, s := range r.Params.Stop {
		maxLen = max(maxLen, len(s))
	}
	tail := r.output[max(0, len(r.output)-maxLen-1):]
	text := tok.Decode(tail, r.Params.SkipSpecialTokens)
	prev := tok.Decode(tail[:len(tail)-1], r.Params.SkipSpecialTokens)
	for _, s := range r.Params.Stop {
		// Only a match that the newest token completed counts.
		if s != "" && strings.Contains(text, s) && !strings.Contains(prev, s) {
			return s
		}
	}
	return ""
}

// matchStopRegex searches the text of the newest tokens for a stop_regex
// match, as SGLang's check_finished does: the last StopRegexLen + 1 tokens
// (a character at most a token), or the whole output where a pattern's
// matches are unbounded. The finish reason names the pattern.
func (r *request) matchStopRegex(tok *tokenizer.Tokenizer) string {
	p := r.Params
	if len(p.StopRegex) == 0 || tok == nil {
		return ""
	}
	tail := r.output
	if p.StopRegexLen >= 0 {
		tail = r.output[max(0, len(r.output)-p.StopRegexLen-1):]
	}
	text := tok.Decode(tail, p.SkipSpecialTokens)
	for _, re := range p.StopRegex {
		if re.MatchString(text) {
			return re.Pattern
		}
	}
	return ""
}
