package tokenizermanager

import (
	"math"
	"strings"
	"sync"
	"time"

	"ebb/ioschema"
)

// reqState accumulates one request's outputs. The manager loop writes it;
// the request's handler reads it, woken through notify.
type reqState struct {
	rid            string
	engine         int     // the data-parallel engine running it
	load           load    // what it holds in that engine's account
	prompt         []int32 // its input ids
	returnLogprob  bool
	topLogprobsNum int
	created        time.Time
	notify         chan struct{}

	mu            sync.Mutex
	text          strings.Builder
	outputIDs     []int32
	outLogprobs   []float32
	outTopVals    [][]float32
	outTopIdx     [][]int32
	inLogprobs    []float32
	inIdx         []int32
	inTopVals     [][]float32 // per prompt position, where top logprobs were asked (nil for the first token)
	inTopIdx      [][]int32
	promptTokens  int
	completion    int
	cached        int
	routed        []int32 // routed experts, once finished, when asked
	finish        *ioschema.FinishReason
	weightVersion string
	firstToken    time.Time
	lastToken     time.Time
	err           error
	done          bool
}

func newReqState(rid string, returnLogprob bool, topN int) *reqState {
	return &reqState{rid: rid, returnLogprob: returnLogprob, topLogprobsNum: topN, created: time.Now(), notify: make(chan struct{}, 1)}
}

func (r *reqState) wake() {
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// absorb takes entry i of a text batch.
func (r *reqState) absorb(o *ioschema.BatchStrOutput, i int, m *Manager) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if i < len(o.OutputStrs) {
		r.text.WriteString(o.OutputStrs[i])
	}
	if i < len(o.OutputIDs) && len(o.OutputIDs[i]) > 0 {
		now := time.Now()
		if r.firstToken.IsZero() {
			r.firstToken = now
			m.metrics.firstToken(r)
		} else {
			m.metrics.tokens(now.Sub(r.lastToken), len(o.OutputIDs[i]))
		}
		r.lastToken = now
		r.outputIDs = append(r.outputIDs, o.OutputIDs[i]...)
	}
	if i < len(o.OutputTokenLogprobsVal) {
		r.outLogprobs = append(r.outLogprobs, o.OutputTokenLogprobsVal[i]...)
	}
	if i < len(o.OutputTopLogprobsVal) {
		r.outTopVals = append(r.outTopVals, o.OutputTopLogprobsVal[i]...)
		for _, ids := range o.OutputTopLogprobsIdx[i] {
			r.outTopIdx = append(r.outTopIdx, ids)
		}
	}
	if i < len(o.InputTokenLogprobsVal) && o.InputTokenLogprobsVal[i] != nil {
		r.inLogprobs, r.inIdx = o.InputTokenLogprobsVal[i], o.InputTokenLogprobsIdx[i]
	}
	if i < len(o.InputTopLogprobsVal) && o.InputTopLogprobsVal[i] != nil {
		r.inTopVals = o.InputTopLogprobsVal[i]
		r.inTopIdx = make([][]int32, len(o.InputTopLogprobsIdx[i]))
		for j, ids := range o.InputTopLogprobsIdx[i] {
			r.inTopIdx[j] = ids
		}
	}
	if i < len(o.PromptTokens) {
		r.promptTokens, r.completion, r.cached = o.PromptTokens[i], o.CompletionTokens[i], o.CachedTokens[i]
	}
	if i < len(o.RoutedExperts) && o.RoutedExperts[i] != nil {
		r.routed = o.RoutedExperts[i]
	}
	r.weightVersion = o.WeightVersion
	if i < len(o.FinishedReasons) && o.FinishedReasons[i] != nil {
		r.finish = o.FinishedReasons[i]
		r.done = true
	}
	r.wake()
}

func (r *reqState) fail(err error) {
	r.mu.Lock()
	if !r.done {
		r.err, r.done = err, true
	}
	r.mu.Unlock()
	r.wake()
}

func (r *reqState) finished() bool {
	done, _ := r.outcome()
	return done
}

// outcome reports whether r is done and with what error, without the copy
// of everything so far that a snapshot makes: a waiter woken at every token
// of a 16,384-token rollout would copy its ids and logprobs 16,384 times.
func (r *reqState) outcome() (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.done, r.err
}

// snapshot is a consistent copy of the accumulated outputs.
type snapshot struct {
	Rid           string
	Text          string
	OutputIDs     []int32
	OutLogprobs   []float32
	OutTopVals    [][]float32
	OutTopIdx     [][]int32
	InLogprobs    []float32
	InIdx         []int32
	InTopVals     [][]float32
	InTopIdx      [][]int32
	PromptTokens  int
	Completion    int
	Cached        int
	Routed        []int32
	Finish        *ioschema.FinishReason
	WeightVersion string
	Err           error
	Done          bool
	Latency       time.Duration
}

func (r *reqState) snapshot() snapshot { return r.snapshotSince(0, 0) }

// snapshotSince is a snapshot of the output after its first ids tokens and
// textFrom bytes of text (an incremental stream's next chunk): only those
// tails are copied. Input logprobs and the counts are whole.
func (r *reqState) snapshotSince(ids, textFrom int) snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	text := r.text.String()
	return snapshot{Rid: r.rid, Text: text[min(textFrom, len(text)):], OutputIDs: tail(r.outputIDs, ids),
		OutLogprobs: tail(r.outLogprobs, ids), OutTopVals: tail(r.outTopVals, ids),
		OutTopIdx: tail(r.outTopIdx, ids), InLogprobs: r.inLogprobs, InIdx: r.inIdx,
		InTopVals: r.inTopVals, InTopIdx: r.inTopIdx,
		PromptTokens: r.promptTokens, Completion: r.completion, Cached: r.cached, Routed: r.routed, Finish: r.finish,
		WeightVersion: r.weightVersion, Err: r.err, Done: r.done, Latency: time.Since(r.created)}
}

// tail copies s from n on; nil stays nil (a field the request did not ask
// for), an empty tail of a non-nil s is empty and not nil.
func tail[T any](s []T, n int) []T {
	return append(s[:0:0], s[min(n, len(s)):]...)
}

// topEntries renders top logprobs: a list of triples a position, null
// where a position has none (a prompt's first token).
func (m *Manager) topEntries(vals [][]float32, idx [][]int32, withText bool) []any {
	top := make([]any, len(vals))
	for i, v := range vals {
		if v == nil {
			continue
		}
		entries := make([][]any, len(v))
		for j, lp := range v {
			entries[j] = m.logprobEntry(lp, idx[i][j], withText)
		}
		top[i] = entries
	}
	return top
}

// logprobEntry renders SGLang's [logprob, token_id, text] triple.
func (m *Manager) logprobEntry(lp float32, id int32, withText bool) []any {
	var v, text any
	if !math.IsNaN(float64(lp)) && !math.IsInf(float64(lp), 0) {
		v = float64(lp)
	}
	if withText && m.Tokenizer != nil {
		text = m.Tokenizer.Decode([]int32{id}, false)
	}
	return []any{v, id, text}
}

// generateResult is /generate's response object for one request.
func (m *Manager) generateResult(s snapshot, withText bool) map[string]any {
	meta := map[string]any{
		"id": s.Rid, "finish_reason": s.Finish, "prompt_tokens": s.PromptTokens,
		"completion_tokens": s.Completion, "cached_tokens": s.Cached, "weight_version": s.WeightVersion,
		"e2e_latency": s.Latency.Seconds(),
	}
	if s.Routed != nil {
		meta["routed_experts"] = ioschema.EncodeRoutedExperts(s.Routed)
	}
	if s.OutLogprobs != nil || s.InLogprobs != nil {
		out := make([][]any, len(s.OutLogprobs))
		for i, lp := range s.OutLogprobs {
			out[i] = m.logprobEntry(lp, s.OutputIDs[i], withText)
		}
		meta["output_token_logprobs"] = out
		in := make([][]any, len(s.InLogprobs))
		for i, lp := range s.InLogprobs {
			in[i] = m.logprobEntry(lp, s.InIdx[i], withText)
		}
		meta["input_token_logprobs"] = in
		if len(s.OutTopVals) > 0 {
			meta["output_top_logprobs"] = m.topEntries(s.OutTopVals, s.OutTopIdx, withText)
		}
		if s.InTopVals != nil {
			meta["input_top_logprobs"] = m.topEntries(s.InTopVals, s.InTopIdx, withText)
		}
	}
	var text any
	if m.Tokenizer != nil {
		text = s.Text
	}
	ids := s.OutputIDs
	if ids == nil {
		ids = []int32{}
	}
	return map[string]any{"text": text, "output_ids": ids, "meta_info": meta}
}
