package scheduler

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"ebb/ioschema"
)

func TestPrefixSharingReportsCachedTokens(t *testing.T) {
	h := newHarness(t, false, 4096)
	shared := prompt(11, 100)
	h.generate("first", append(slices.Clone(shared), 1, 2, 3), 4)
	h.runToIdle()
	h.generate("second", append(slices.Clone(shared), 7, 8), 4)
	h.runToIdle()
	if cached := h.cached["second"]; cached < 100 {
		t.Fatalf("second request reused %d cached tokens, want >= 100", cached)
	}
}

// TestChunkedPrefillMatchesOneShot: a prompt split over several steps (chunk
// 48) decodes exactly like the same prompt in one chunk.
func TestChunkedPrefillMatchesOneShot(t *testing.T) {
	ids := prompt(21, 200)
	small := newHarness(t, false, 4096)
	small.generate("x", ids, 8)
	small.runToIdle()
	big := newHarnessChunk(t, false, 4096, 512)
	big.generate("x", ids, 8)
	big.runToIdle()
	if !slices.Equal(small.tokens["x"], big.tokens["x"]) || len(small.tokens["x"]) != 8 {
		t.Fatalf("chunked %v, one shot %v", small.tokens["x"], big.tokens["x"])
	}
}

func TestFinishRules(t *testing.T) {
	h := newHarness(t, false, 4096)
	ids := prompt(31, 12)
	h.generate("probe", ids, 6)
	h.runToIdle()
	probe := h.tokens["probe"]
	zero := 0.0
	cases := []struct {
		name   string
		params ioschema.SamplingParams
		want   func(toks []int32, fr *ioschema.FinishReason) error
	}{
		{"stop_token_ids", ioschema.SamplingParams{MaxNewTokens: ptr(6), Temperature: &zero, StopTokenIDs: []int32{probe[2]}, IgnoreEOS: true},
			func(toks []int32, fr *ioschema.FinishReason) error {
				if fr.Type != "stop" || fr.Matched != probe[2] || len(toks) > 3 {
					return fmt.Errorf("%v %+v", toks, fr)
				}
				return nil
			}},
		{"min_new_tokens bans the stop token", ioschema.SamplingParams{MaxNewTokens: ptr(6), MinNewTokens: 4, Temperature: &zero,
			StopTokenIDs: []int32{probe[0]}, IgnoreEOS: true},
			func(toks []int32, fr *ioschema.FinishReason) error {
				if len(toks) < 4 || slices.Contains(toks[:3], probe[0]) {
					return fmt.Errorf("%v %+v", toks, fr)
				}
				return nil
			}},
		{"max_new_tokens 0 prefills only", ioschema.SamplingParams{MaxNewTokens: ptr(0)},
			func(toks []int32, fr *ioschema.FinishReason) error {
				if len(toks) != 0 || fr.Type != "length" {
					return fmt.Errorf("%v %+v", toks, fr)
				}
				return nil
			}},
		{"logit_bias bans the greedy token", ioschema.SamplingParams{MaxNewTokens: ptr(1), Temperature: &zero, IgnoreEOS: true,
			LogitBias: map[string]float64{fmt.Sprint(probe[0]): -100}},
			func(toks []int32, fr *ioschema.FinishReason) error {
				if len(toks) != 1 || toks[0] == probe[0] {
					return fmt.Errorf("%v %+v, want a first token other than %d", toks, fr, probe[0])
				}
				return nil
			}},
		{"logit_bias forces a token, beside a repetition penalty", ioschema.SamplingParams{MaxNewTokens: ptr(4), Temperature: &zero,
			IgnoreEOS: true, RepetitionPenalty: ptr(1.5), LogitBias: map[string]float64{"7": 100}},
			func(toks []int32, fr *ioschema.FinishReason) error {
				if !slices.Equal(toks, []int32{7, 7, 7, 7}) {
					return fmt.Errorf("%v %+v, want token 7 throughout", toks, fr)
				}
				return nil
			}},
		{"length", ioschema.SamplingParams{MaxNewTokens: ptr(3), Temperature: &zero, IgnoreEOS: true},
			func(toks []int32, fr *ioschema.FinishReason) error {
				if len(toks) != 3 || fr.Type != "length" || fr.Length != 3 {
					return fmt.Errorf("%v %+v", toks, fr)
				}
				return nil
			}},
	}
	for i, c := range cases {
		rid := fmt.Sprint("case", i)
		h.s.Handle(&ioschema.TokenizedGenerateReqInput{Rid: rid, InputIDs: ids, SamplingParams: c.params, LogprobStartLen: -1})
		h.runToIdle()
		if fr := h.finish[rid]; fr == nil {
			t.Fatalf("%s: not finished", c.name)
		} else if err := c.want(h.tokens[rid], fr); err != nil {
			t.Errorf("%s: %v", c.name, err)
		}
	}
}

func TestAbortByPrefixAndBadRequests(t *testing.T) {
	h := newHarness(t, false, 4096)
	for i := 0; i < 3; i++ {
		h.generate(fmt.Sprint("grp-", i), prompt(i, 20), 40)
	}
	h.generate("other", prompt(9, 20), 5)
	h.step(3)
	h.s.Handle(&ioschema.AbortReq{Rid: "grp-"})
	h.runToIdle()
	for i := 0; i < 3; i++ {
		if fr := h.finish[fmt.Sprint("grp-", i)]; fr == nil || fr.Type != "abort" {
			t.Fatalf("grp-%d: %+v", i, fr)
		}
	}
	if fr := h.finish["other"]; fr == nil || fr.Type != "length" {
		t.Fatalf("other: %+v", fr)
	}
	// Requests the model cannot take get error replies; nothing else changes.
	h.replies = nil
	long := prompt(1, 5000)
	h.generate("too-long", long, 1)
	h.generate("bad-id", []int32{1, 99999}, 1)
	h.s.Handle(&ioschema.TokenizedGenerateReqInput{Rid: "bad-params", InputIDs: prompt(1, 3), SamplingParams: ioschema.SamplingParams{TopP: ptr(2.0)}})
	for rid, bias := range map[string]map[string]float64{"bias-past-vocab": {"99999": 1}, "bias-not-an-id": {"x": 1}} {
		h.s.Handle(&ioschema.TokenizedGenerateReqInput{Rid: rid, InputIDs: prompt(1, 3), SamplingParams: ioschema.SamplingParams{LogitBias: bias}})
	}
	h.drain()
	if len(h.replies) != 5 {
		t.Fatalf("%d error replies for 5 bad requests", len(h.replies))
	}
	for _, r := range h.replies {
		if _, isErr := r.(*ioschema.ErrorOutput); !isErr {
			t.Fatalf("reply %T", r)
		}
	}
	if err := h.s.core.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestLongRolloutsWaitInsteadOfRetracting: requests that must run to
// max_new_tokens (ignore_eos, no stop tokens) are admitted only as far as
// the KV cache holds what they will hold at once, so none is ever
// retracted and none computes anything twice, however short the cache.
func TestLongRolloutsWaitInsteadOfRetracting(t *testing.T) {
	const maxNew, promptLen, slots = 40, 30, 260
	reqs := map[string][]int32{}
	for i := 0; i < 6; i++ {
		reqs[fmt.Sprint("r", i)] = prompt(40+i, promptLen)
	}
	want := reference(t, reqs, maxNew)
	h := newHarness(t, false, slots) // 6 x 70 tokens do not fit at once
	for rid, ids := range reqs {
		h.generate(rid, ids, maxNew)
	}
	most := 0
	for !h.s.core.Idle() {
		h.step(1)
		most = max(most, len(h.s.core.running))
	}
	if st := h.s.core.Stats; st.Retractions != 0 || st.RecomputedTokens != 0 {
		t.Fatalf("%d retractions, %d tokens recomputed", st.Retractions, st.RecomputedTokens)
	}
	if fit := slots / (promptLen + maxNew); most < fit {
		t.Fatalf("at most %d requests ran at once; %d fit whole", most, fit)
	}
	sameOutputs(t, h.tokens, want)
}

// TestKVExhaustionRetracts: requests that may stop early are admitted on
// SGLang's new-token ratio, so more decode demand than KV slots makes the
// scheduler retract some; all still finish with the right outputs, and
// what they compute again is counted.
func TestKVExhaustionRetracts(t *testing.T) {
	const maxNew = 40
	reqs := map[string][]int32{}
	for i := 0; i < 6; i++ {
		reqs[fmt.Sprint("r", i)] = prompt(40+i, 30)
	}
	zero := 0.0
	params := ioschema.SamplingParams{MaxNewTokens: ptr(maxNew), Temperature: &zero}
	run := func(slots int) *harness {
		h := newHarness(t, false, slots)
		for rid, ids := range reqs {
			h.s.Handle(&ioschema.TokenizedGenerateReqInput{Rid: rid, InputIDs: ids, LogprobStartLen: -1, SamplingParams: params})
		}
		h.runToIdle()
		return h
	}
	want := run(4096).tokens
	h := run(260) // 6 x 70 tokens do not fit at once
	st := h.s.core.Stats
	if st.Retractions == 0 {
		t.Fatal("expected retractions with a small KV cache")
	}
	if st.RecomputedTokens > st.RetractedInputTokens+st.RetractedOutputTokens {
		t.Fatalf("%d tokens recomputed after retractions of %d + %d", st.RecomputedTokens, st.RetractedInputTokens, st.RetractedOutputTokens)
	}
	if r := h.s.core.ratio.value; r <= h.s.core.ratio.min {
		t.Fatalf("new-token ratio %v after a retraction", r)
	}
	sameOutputs(t, h.tokens, want)
	if err := h.s.core.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestRetractionVictim: a retraction takes the request whose loss costs
// least: the smallest that covers the shortfall alone, else the largest.
func TestRetractionVictim(t *testing.T) {
	for _, tc := range []struct {
		free int
		want []string // retracted, in order
	}{
		{free: 30, want: []string{"b"}}, // 3 x 20 needed, short 30: b's 30 covers it
		{free: 35, want: []string{"b"}}, // short 25: b is the smallest that covers it
		{free: 10, want: []string{"c"}}, // short 50: only c's 50 covers it
		{free: 0, want: []string{"c"}},  // short 60: none alone, so the largest, c, which leaves enough for two
		{free: 60, want: nil},           // no shortfall
	} {
		c := &Core{pool: newKVPool(200), cache: NewRadixCache(), ratio: newTokenRatio(1)}
		held := map[string]int{"a": 10, "b": 30, "c": 50}
		for _, rid := range []string{"a", "b", "c"} {
			slots, _ := c.pool.alloc(held[rid])
			r := &request{Request: Request{Rid: rid, InputIDs: prompt(len(rid), held[rid]-1),
				Params: ioschema.Resolved{MaxNewTokens: 100}}, output: []int32{1, 2}, slots: slots}
			c.running = append(c.running, r)
		}
		c.pool.alloc(c.pool.available() - tc.free) // held elsewhere
		n := c.retractForDecodes()
		var got []string
		for _, r := range c.waiting {
			got = append(got, r.Rid)
		}
		slices.Reverse(got) // each retraction goes to the head of the queue
		if n != len(got) || !slices.Equal(got, tc.want) {
			t.Errorf("free %d: retracted %v (%d), want %v", tc.free, got, n, tc.want)
		}
	}
}

// TestCheckInvariantsFindsBrokenAccounts breaks the slot accounting in each
// way the idle check must notice.
func TestCheckInvariantsFindsBrokenAccounts(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func(c *Core)
		want    string
	}{
		{"intact", func(c *Core) {}, ""},
		{"free twice", func(c *Core) { c.pool.free[0] = c.pool.free[1] }, "is both free and free"},
		{"out of range", func(c *Core) { c.pool.free[0] = 99 }, "outside [0,16)"},
		{"free and cached", func(c *Core) {
			s, _ := c.pool.alloc(2)
			c.cache.Insert([]int32{7, 8}, s)
			c.pool.free[0] = s[1]
		}, "is both free and cached"},
		{"lost", func(c *Core) { c.pool.alloc(1) }, "!= total 16"},
		{"cached and held", func(c *Core) {
			s, _ := c.pool.alloc(3)
			c.cache.Insert([]int32{7, 8}, s[:2])
			c.running = append(c.running, &request{Request: Request{Rid: "r1"}, slots: []int32{s[1]}})
		}, "is both cached and held by r1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &Core{pool: newKVPool(16), cache: NewRadixCache()}
			tc.corrupt(c)
			err := c.CheckInvariants()
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
		})
	}
}

// TestDecodesLongestFirst: decode batches list their sequences by context
// length, longest first (the decode attention launches them in that order),
// whether built by schedule or chained by follow.
func TestDecodesLongestFirst(t *testing.T) {
	h := newHarness(t, false, 4096)
	for i, n := range []int{5, 40, 12, 33} {
		h.generate(fmt.Sprint("r", i), prompt(i, n), 12)
	}
	checked := 0
	for i := 0; i < 40 && !h.s.core.Idle(); i++ {
		h.step(1)
		f := h.s.core.flight
		if f == nil {
			continue
		}
		info, _ := h.s.core.lastStep()
		if info.NewTokens > 0 {
			continue
		}
		if !slices.IsSortedFunc(f.batch, func(a, b *request) int { return len(b.slots) - len(a.slots) }) {
			lens := []int{}
			for _, r := range f.batch {
				lens = append(lens, len(r.slots))
			}
			t.Fatalf("step %d: decode batch contexts %v, want longest first", i, lens)
		}
		checked++
	}
	if checked < 5 {
		t.Fatalf("only %d decode steps checked", checked)
	}
}

// TestMixedChunk: by default a step that prefills holds the decodes back,
// as SGLang's scheduler does; with EnableMixedChunk the decodes run in every
// step and take their share of the chunk budget. The tokens are the same.
func TestMixedChunk(t *testing.T) {
	const chunk = 48
	outputs := map[bool]map[string][]int32{}
	for _, mixed := range []bool{false, true} {
		h := newHarnessChunk(t, false, 4096, chunk)
		h.s.core.opts.EnableMixedChunk = mixed
		h.generate("a", prompt(1, 5), 30)
		for i := 0; i < 10 && len(h.tokens["a"]) < 3; i++ {
			h.step(1)
		}
		h.generate("b", prompt(2, 150), 4)
		prefills, full := 0, 0
		for i := 0; i < 40 && !h.s.core.Idle(); i++ {
			h.step(1)
			info, launched := h.s.core.lastStep()
			if !launched || info.NewTokens == 0 {
				continue
			}
			prefills++
			if want := map[bool]int{false: 0, true: 1}[mixed]; info.Decodes != want {
				t.Fatalf("mixed %v: a prefill step with %d decodes, want %d", mixed, info.Decodes, want)
			}
			if info.NewTokens+info.Decodes > chunk {
				t.Fatalf("mixed %v: %d prompt tokens and %d decodes in a chunk of %d", mixed, info.NewTokens, info.Decodes, chunk)
			}
			if info.NewTokens+info.Decodes == chunk {
				full++
			}
		}
		h.runToIdle()
		if prefills != 4 || full != 3 {
			t.Fatalf("mixed %v: %d prefill steps, %d full, want 4 and 3", mixed, prefills, full)
		}
		outputs[mixed] = h.tokens
	}
	for _, rid := range []string{"a", "b"} {
		if !slices.Equal(outputs[false][rid], outputs[true][rid]) {
			t.Fatalf("%s: %v apart, %v mixed", rid, outputs[false][rid], outputs[true][rid])
		}
	}
}

func TestPeakSlots(t *testing.T) {
	for _, tc := range []struct {
		plan []kvFuture
		want int
	}{
		{nil, 0},
		{[]kvFuture{{base: 10, rest: 5}}, 15},
		// Both grow for 5 steps (30), then the first ends and the second
		// alone reaches 20 + 40: the peak is the second's end.
		{[]kvFuture{{base: 10, rest: 5}, {base: 20, rest: 40}}, 60},
		// Equal ends: everything at once.
		{[]kvFuture{{base: 10, rest: 5}, {base: 20, rest: 5}}, 40},
		// Many short ones early, one long: 4 x (10 + 2) + (5 + 2) at step
		// 2 = 55 beats the long one's 5 + 30 alone.
		{[]kvFuture{{10, 2}, {10, 2}, {10, 2}, {10, 2}, {5, 30}}, 55},
	} {
		if got := peakSlots(tc.plan); got != tc.want {
			t.Errorf("peakSlots(%v) = %d, want %d", tc.plan, got, tc.want)
		}
	}
}

// TestMixedLengthRolloutsShareTheCache: rollouts of different lengths that
// all run to their max_new_tokens are admitted on the KV they will hold at
// once, not on the sum of their final lengths, so more of them run side by
// side than whole reservations would allow, and still none is retracted.
func TestMixedLengthRolloutsShareTheCache(t *testing.T) {
	const slots = 400
	reqs := map[string][]int32{}
	lengths := map[string]int{}
	for i := range 12 {
		rid := fmt.Sprint("r", i)
		reqs[rid], lengths[rid] = prompt(80+i, 20), []int{10, 20, 40, 150}[i%4]
	}
	h := newHarness(t, false, slots)
	for rid, ids := range reqs {
		h.generate(rid, ids, lengths[rid])
	}
	overcommitted := false
	for !h.s.core.Idle() {
		h.step(1)
		whole := 0
		for _, r := range h.s.core.running {
			whole += len(r.InputIDs) + r.Params.MaxNewTokens
		}
		overcommitted = overcommitted || whole > slots
	}
	if st := h.s.core.Stats; st.Retractions != 0 || st.RecomputedTokens != 0 {
		t.Fatalf("%d retractions, %d tokens recomputed", st.Retractions, st.RecomputedTokens)
	}
	if !overcommitted {
		t.Fatal("the running requests' whole lengths never exceeded the cache: admission reserved them")
	}
	for rid, n := range lengths {
		if len(h.tokens[rid]) != n {
			t.Fatalf("%s: %d tokens, want %d", rid, len(h.tokens[rid]), n)
		}
	}
}

// TestSamplesOfAPromptShareItsPrefill: copies of one prompt sent as
// separate requests together (GRPO as verl and slime send it) compute the
// prompt once: the first prefills it and the others wait for it, then find
// it cached. A prompt that shares only a few tokens does not wait, and the
// copies decode as a lone run does.
func TestSamplesOfAPromptShareItsPrefill(t *testing.T) {
	ids := prompt(41, 120)
	lone := newHarnessChunk(t, false, 4096, 512)
	lone.generate("lone", ids, 6)
	lone.runToIdle()

	h := newHarnessChunk(t, false, 4096, 512)
	for i := range 4 {
		h.generate(fmt.Sprint("copy-", i), ids, 6)
	}
	near := append(slices.Clone(ids[:sharedPrefixMin/2]), prompt(42, 100)...)
	h.generate("near", near, 6)
	h.generate("other", prompt(43, 90), 6)
	h.runToIdle()
	for i := range 4 {
		rid := fmt.Sprint("copy-", i)
		if !slices.Equal(h.tokens[rid], lone.tokens["lone"]) {
			t.Errorf("%s: %v, alone %v", rid, h.tokens[rid], lone.tokens["lone"])
		}
		if want := len(ids) - 1; i > 0 && h.cached[rid] != want {
			t.Errorf("%s found %d prompt tokens cached, want %d", rid, h.cached[rid], want)
		}
	}
	st := h.s.core.Stats
	computed := st.PromptTokens - st.CachedTokens
	if want := int64(len(ids) + 3 + len(near) + 90); computed != want {
		t.Errorf("%d prompt tokens computed (%d cached of %d), want %d", computed, st.CachedTokens, st.PromptTokens, want)
	}
	if err := h.s.core.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestSamplesOfAPromptFitTogether: admission counts a prompt that several
// running samples share once, so a GRPO group whose copies would not fit
// each with its own prompt runs at once, without retraction.
func TestSamplesOfAPromptFitTogether(t *testing.T) {
	// Each copy alone peaks at 300 slots; four with one shared prompt at
	// 200 + 4 x 100 = 600, four with their own at 1,200.
	ids := prompt(71, 200)
	h := newHarnessChunk(t, false, 700, 512)
	for i := range 4 {
		h.generate(fmt.Sprint("copy-", i), ids, 100)
	}
	most := 0
	for !h.s.core.Idle() {
		h.step(1)
		most = max(most, len(h.s.core.running))
	}
	if st := h.s.core.Stats; most != 4 || st.Retractions != 0 {
		t.Fatalf("%d copies ran at once (want 4), %d retractions", most, st.Retractions)
	}
	for i := range 4 {
		if rid := fmt.Sprint("copy-", i); len(h.tokens[rid]) != 100 {
			t.Fatalf("%s: %d tokens, want 100", rid, len(h.tokens[rid]))
		}
	}
}
