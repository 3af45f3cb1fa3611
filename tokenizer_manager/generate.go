package tokenizermanager

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"ebb/ioschema"
)

// prompt is one request after a GenerateReqInput is expanded (batch, n).
type prompt struct {
	tokenized *ioschema.TokenizedGenerateReqInput
	state     *reqState
}

// badRequest marks errors that are the client's (HTTP 400).
type badRequest struct{ error }

func badf(format string, a ...any) error { return badRequest{fmt.Errorf(format, a...)} }

// IsBadRequest reports whether err is the client's fault.
func IsBadRequest(err error) bool {
	var b badRequest
	return errors.As(err, &b)
}

// expand validates a generate request and tokenizes its prompts; n > 1
// repeats each prompt with rids suffixed -0, -1, ... A single rid for a
// batch of prompts names them rid_0, rid_1, ... as SGLang does.
func (m *Manager) expand(in *ioschema.GenerateReqInput) ([]*prompt, bool, error) {
	hasText, hasIDs := len(in.Text.Items) > 0, len(in.InputIDs.Items) > 0
	if hasText == hasIDs {
		return nil, false, badf("give exactly one of text and input_ids")
	}
	var inputs [][]int32
	var texts []string
	listed := in.Text.Batch || in.InputIDs.Batch // the prompts came as a list
	batch := listed
	if hasText {
		if m.Tokenizer == nil {
			return nil, false, badf("the model has no tokenizer: send input_ids")
		}
		for _, t := range in.Text.Items {
			ids, err := m.encode(t, true)
			if err != nil {
				return nil, false, err
			}
			inputs = append(inputs, ids)
			texts = append(texts, t)
		}
	} else {
		inputs = in.InputIDs.Items
		texts = make([]string, len(inputs))
	}
	if in.Rid.Batch && len(in.Rid.Items) != len(inputs) {
		return nil, false, badf("rid has %d entries for %d prompts", len(in.Rid.Items), len(inputs))
	}
	start := -1
	if in.LogprobStartLen != nil {
		start = *in.LogprobStartLen
	}
	if start < -1 {
		return nil, false, badf("logprob_start_len must be -1 (output tokens only) or at least 0, got %d", start)
	}
	if in.TopLogprobsNum < 0 {
		return nil, false, badf("top_logprobs_num must be at least 0")
	}
	var out []*prompt
	for i, ids := range inputs {
		if len(ids) == 0 {
			return nil, false, badf("prompt %d is empty", i)
		}
		sp, err := in.SamplingParams.For(i)
		if err != nil {
			return nil, false, badRequest{err}
		}
		if ids, err = m.fitContext(ids, &sp); err != nil {
			return nil, false, err
		}
		if in.ReturnLogprob && start >= len(ids) { // SGLang's words: clients match them
			return nil, false, badf("req.logprob_start_len=%d is higher than the number of input tokens len(req.origin_input_ids)=%d. "+
				"Please use a smaller logprob_start_len.", start, len(ids))
		}
		n := sp.Copies()
		if n < 1 {
			return nil, false, badf("n must be at least 1, got %d", n)
		}
		if n > 1 {
			batch = true
		}
		rid := newRid()
		switch {
		case in.Rid.Batch && in.Rid.Items[i] != "":
			rid = in.Rid.Items[i]
		case !in.Rid.Batch && len(in.Rid.Items) == 1 && listed:
			rid = fmt.Sprintf("%s_%d", in.Rid.Items[0], i) // one rid for a batch of prompts: SGLang's rid_0, rid_1, ...
		case !in.Rid.Batch && len(in.Rid.Items) == 1:
			rid = in.Rid.Items[0]
		}
		for j := 0; j < n; j++ {
			r := rid
			if n > 1 {
				r = fmt.Sprintf("%s-%d", rid, j)
			}
			sp := sp
			sp.N = nil
			t := &ioschema.TokenizedGenerateReqInput{Rid: r, InputText: texts[i], InputIDs: ids, SamplingParams: sp,
				ReturnLogprob: in.ReturnLogprob, LogprobStartLen: start, TopLogprobsNum: in.TopLogprobsNum, Stream: in.Stream,
				ReturnRoutedExperts: in.ReturnRoutedExperts}
			out = append(out, &prompt{tokenized: t, state: newReqState(r, in.ReturnLogprob, in.TopLogprobsNum)})
		}
	}
	return out, batch, nil
}

// submit registers prompts and sends them to the scheduler: to engine, or
// where engine < 0 to the least loaded. Copies of one prompt (n > 1) share
// its KV: the prompt is prefilled once first, as SGLang does, so the copies
// find it in the radix cache.
func (m *Manager) submit(ctx context.Context, prompts []*prompt, engine int) error {
	keys, copies := make([]string, len(prompts)), map[string]int{}
	for i, p := range prompts {
		keys[i] = promptKey(p.tokenized.InputIDs)
		copies[keys[i]]++
	}
	// Copies of one prompt go to one engine, where its prefix is cached.
	engineOf := map[string]int{}
	for i, p := range prompts {
		key := keys[i]
		if _, warmed := engineOf[key]; !warmed && !m.cfg.DisableRadixCache && len(p.tokenized.InputIDs) > 1 && copies[key] > 1 {
			e, err := m.warm(ctx, p.tokenized.InputIDs, engine)
			if err != nil {
				return err
			}
			engineOf[key] = e
		}
	}
	for i, p := range prompts {
		e, ok := engineOf[keys[i]]
		if !ok {
			e = engine
		}
		e, err := m.dispatch(ctx, p.tokenized, p.state, e)
		if err != nil {
			return err
		}
		engineOf[keys[i]] = e
	}
	return nil
}

// promptKey is ids as a map key: their bytes. A batch of 512 prompts of
// 1,000 tokens is keyed and counted in about 2 ms; their text forms
// (fmt.Sprint, 43 us each) compared pairwise took about 17 s.
func promptKey(ids []int32) string {
	b := make([]byte, 0, 4*len(ids))
	for _, id := range ids {
		b = binary.LittleEndian.AppendUint32(b, uint32(id))
	}
	return string(b)
}

// warm prefills ids once (max_new_tokens 0) on engine (the least loaded
// where engine < 0) and waits for it; it returns the engine that holds the
// prefix.
func (m *Manager) warm(ctx context.Context, ids []int32, engine int) (int, error) {
	zero := 0
	rid := "prefix-" + newRid()
	st := newReqState(rid, false, 0)
	e, err := m.dispatch(ctx, &ioschema.TokenizedGenerateReqInput{Rid: rid, InputIDs: ids,
		SamplingParams: ioschema.SamplingParams{MaxNewTokens: &zero}, LogprobStartLen: -1}, st, engine)
	if err != nil {
		return 0, err
	}
	return e, m.wait(ctx, st)
}

// dispatch registers a request and sends it to engine e, or to the engine
// the router picks when e < 0, and returns the engine.
func (m *Manager) dispatch(ctx context.Context, req *ioschema.TokenizedGenerateReqInput, st *reqState, e int) (int, error) {
	out := defaultMaxNewTokens
	if n := req.SamplingParams.MaxNewTokens; n != nil {
		out = *n
	}
	chosen := make(chan int, 1)
	m.do(func(t *table) {
		st.engine, st.load = t.route.pick(req.InputIDs, out, e)
		st.prompt = req.InputIDs
		t.reqs[st.rid] = st
		chosen <- st.engine
	})
	select {
	case e = <-chosen:
	case <-m.done:
		return 0, errShuttingDown
	}
	select {
	case m.toSched <- outbound{req, e}:
		return e, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// defaultMaxNewTokens is SGLang's max_new_tokens when a request names none.
const defaultMaxNewTokens = 128

// RequestWork is what a request of in prompt tokens and up to out new ones
// costs an engine, in cached positions read: its i-th decode step reads
// in + i of them, and prefilling a prompt token costs about as much as
// reading prefillPositions (0.6B model, H100: 1.8 us a prompt token at
// 32k-token steps, 35 ns a position at decode). Counting tokens instead
// left nano-vllm's workload (prompts and outputs of 100-1,024) with 7.45
// and 6.91 TB of KV reads on two engines, the slower one 4% over the mean
// (the throughput gained was within the runs' spread; docs/gpu-notes.md).
func RequestWork(in, out int) int64 {
	i, o := int64(in), int64(max(out, 0))
	return prefillPositions*i + o*i + o*(o-1)/2
}

const prefillPositions = 50

// LeastLoaded is the index of the engine with the least work(engine), the
// first of equals. The bench's floor model routes with it as the auto router
// routes prompts of which no engine holds a prefix.
func LeastLoaded[E any](engines []E, work func(E) int64) int {
	e := 0
	for i := range engines {
		if work(engines[i]) < work(engines[e]) {
			e = i
		}
	}
	return e
}

// start expands a request and submits its prompts.
func (m *Manager) start(ctx context.Context, in *ioschema.GenerateReqInput) ([]*prompt, bool, error) {
	if err := in.Unsupported(); err != nil {
		return nil, false, badRequest{err}
	}
	engine, err := m.routedEngine(in)
	if err != nil {
		return nil, false, err
	}
	prompts, batch, err := m.expand(in)
	if err != nil {
		return nil, false, err
	}
	return prompts, batch, m.submit(ctx, prompts, engine)
}

// routedEngine is the data-parallel engine a request names (routed_dp_rank
// or data_parallel_rank), or -1 where it names none.
func (m *Manager) routedEngine(in *ioschema.GenerateReqInput) (int, error) {
	r := in.DPRank()
	if r == nil {
		return -1, nil
	}
	if *r < 0 || *r >= m.engines {
		return 0, badf("routed_dp_rank %d names no engine: this server runs %d data-parallel engine(s), ranks 0 to %d",
			*r, m.engines, m.engines-1)
	}
	return *r, nil
}

// wait blocks until the request is done; if ctx ends first (the client went
// away) the request is aborted so its KV is freed.
func (m *Manager) wait(ctx context.Context, st *reqState) error {
	for {
		if done, err := st.outcome(); done {
			return err
		}
		select {
		case <-st.notify:
		case <-ctx.Done():
			m.cancel(st)
			return ctx.Err()
		}
	}
}

// waitAll waits for every prompt in order; when one fails or the client goes
// away, the rest are aborted so that their KV is freed too.
func (m *Manager) waitAll(ctx context.Context, prompts []*prompt) ([]snapshot, error) {
	snaps := make([]snapshot, len(prompts))
	for i, p := range prompts {
		if err := m.wait(ctx, p.state); err != nil {
			for _, q := range prompts[i+1:] {
				m.cancel(q.state)
			}
			return nil, err
		}
		snaps[i] = p.state.snapshot()
	}
	return snaps, nil
}

// cancel aborts a request whose client is gone and forgets it.
func (m *Manager) cancel(st *reqState) {
	m.Abort(st.rid, false)
	m.do(func(t *table) { t.forget(st.rid) })
	st.fail(context.Canceled)
}

// Generate runs a GenerateReqInput to completion and returns /generate's
// response: one object, or a list for batches and n > 1.
func (m *Manager) Generate(ctx context.Context, in *ioschema.GenerateReqInput) (any, error) {
	prompts, batch, err := m.start(ctx, in)
	if err != nil {
		return nil, err
	}
	snaps, err := m.waitAll(ctx, prompts)
	if err != nil {
		if ctx.Err() == nil && !IsServerFault(err) {
			err = badRequest{err}
		}
		return nil, err
	}
	results := make([]any, len(snaps))
	for i, s := range snaps {
		results[i] = m.generateResult(s, in.ReturnTextInLogprobs)
	}
	if batch {
		return results, nil
	}
	return results[0], nil
}

// Warmup generates a few tokens from a short prompt, as SGLang does at
// start, so kernels, graphs and the whole pipeline have run once.
func (m *Manager) Warmup(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	four, zero := 4, 0.0
	ids := []int32{0, 1, 2, 3}
	for i := range ids {
		ids[i] = int32(i) % int32(m.ModelCfg.Vocab)
	}
	in := &ioschema.GenerateReqInput{InputIDs: ioschema.InputIDBatch{Items: [][]int32{ids}},
		SamplingParams: ioschema.SamplingBatch{Items: []ioschema.SamplingParams{{MaxNewTokens: &four, Temperature: &zero}}},
		Rid:            ioschema.Rids{Items: []string{"warmup-" + newRid()}}}
	_, err := m.Generate(ctx, in)
	return err
}
