package scheduler

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	"ebb/ioschema"
)

type overlapCase struct {
	rid    string
	ids    []int32
	params ioschema.SamplingParams
	logp   int // top logprobs (0: none)
}

// overlapWorkload mixes what a blind follow-up step can and cannot carry:
// seeded sampling, penalties, logit_bias, min_new_tokens with a stop
// token, top logprobs, one- and two-token outputs, more requests than may
// run at once.
func overlapWorkload(stop int32) []overlapCase {
	f := func(v float64) *float64 { return &v }
	seed := func(v uint64) *uint64 { return &v }
	cases := []overlapCase{
		{"greedy", prompt(1, 30), ioschema.SamplingParams{MaxNewTokens: ptr(20), Temperature: f(0), IgnoreEOS: true}, 0},
		{"temp1", prompt(2, 45), ioschema.SamplingParams{MaxNewTokens: ptr(25), Temperature: f(1), SamplingSeed: seed(7), IgnoreEOS: true}, 0},
		{"topp", prompt(3, 12), ioschema.SamplingParams{MaxNewTokens: ptr(18), Temperature: f(0.8), TopP: f(0.9), TopK: ptr(20), MinP: f(0.01), SamplingSeed: seed(3)}, 0},
		{"penalty", prompt(4, 20), ioschema.SamplingParams{MaxNewTokens: ptr(15), Temperature: f(0), RepetitionPenalty: f(1.3), IgnoreEOS: true}, 0},
		{"minnew", prompt(5, 25), ioschema.SamplingParams{MaxNewTokens: ptr(30), MinNewTokens: 6, Temperature: f(1), SamplingSeed: seed(5), StopTokenIDs: []int32{stop}}, 0},
		{"stop", prompt(6, 25), ioschema.SamplingParams{MaxNewTokens: ptr(30), Temperature: f(0), StopTokenIDs: []int32{stop}}, 0},
		{"one", prompt(7, 9), ioschema.SamplingParams{MaxNewTokens: ptr(1), Temperature: f(0)}, 0},
		{"two", prompt(8, 9), ioschema.SamplingParams{MaxNewTokens: ptr(2), Temperature: f(1), SamplingSeed: seed(2)}, 0},
		{"logprobs", prompt(9, 16), ioschema.SamplingParams{MaxNewTokens: ptr(12), Temperature: f(0), IgnoreEOS: true}, 3},
		{"late", prompt(10, 60), ioschema.SamplingParams{MaxNewTokens: ptr(22), Temperature: f(1), SamplingSeed: seed(11), IgnoreEOS: true}, 0},
		// logit_bias rides on the blind follow-up steps too.
		{"bias", prompt(11, 20), ioschema.SamplingParams{MaxNewTokens: ptr(16), Temperature: f(1), SamplingSeed: seed(13), IgnoreEOS: true,
			LogitBias: map[string]float64{"5": 8, "6": 8, "7": -100}}, 0},
	}
	return cases
}

func runOverlapCase(t *testing.T, overlap bool, slots int, cases []overlapCase, abortAt int, abortRid string) (*harness, map[string][]int32) {
	t.Helper()
	h := newHarness(t, false, slots)
	h.s.core.opts.DisableOverlap = !overlap
	if slots < 1000 {
		// Admission that expects little of the requests that may stop
		// early over-commits the short cache, so that some are retracted.
		h.s.core.ratio = newTokenRatio(0.05)
	}
	for _, c := range cases {
		h.s.Handle(&ioschema.TokenizedGenerateReqInput{Rid: c.rid, InputIDs: c.ids, SamplingParams: c.params,
			LogprobStartLen: -1, ReturnLogprob: c.logp > 0, TopLogprobsNum: c.logp})
	}
	if abortAt > 0 {
		h.step(abortAt)
		if overlap && h.s.core.flight == nil {
			t.Fatalf("no step in flight after %d steps", abortAt)
		}
		h.s.Handle(&ioschema.AbortReq{Rid: abortRid})
	}
	h.runToIdle()
	if len(h.finish) != len(cases) {
		t.Fatalf("%d of %d requests finished", len(h.finish), len(cases))
	}
	return h, h.tokens
}

// TestOverlapMatchesSequential: overlapped scheduling produces exactly the
// tokens and finish reasons of step-by-step scheduling, also when the KV
// cache is short (retraction) and when a request is aborted mid-flight.
func TestOverlapMatchesSequential(t *testing.T) {
	probe := newHarness(t, false, 4096)
	probe.generate("probe", prompt(6, 25), 8)
	probe.runToIdle()
	stop := probe.tokens["probe"][4] // greedy "stop" ends at its 5th token
	cases := overlapWorkload(stop)
	for _, tc := range []struct {
		name    string
		slots   int
		abortAt int
	}{{"plenty", 4096, 0}, {"short-kv", 200, 0}, {"abort", 4096, 6}} {
		t.Run(tc.name, func(t *testing.T) {
			seq, want := runOverlapCase(t, false, tc.slots, cases, tc.abortAt, "temp1")
			ovl, got := runOverlapCase(t, true, tc.slots, cases, tc.abortAt, "temp1")
			if ovl.s.core.Stats.Overlapped == 0 {
				t.Fatal("no step was overlapped")
			}
			if !maps.EqualFunc(got, want, slices.Equal) {
				for rid := range want {
					if !slices.Equal(got[rid], want[rid]) {
						t.Errorf("%s: overlapped %v\nsequential %v", rid, got[rid], want[rid])
					}
				}
			}
			for rid, fr := range seq.finish {
				if o := ovl.finish[rid]; fmt.Sprint(*o) != fmt.Sprint(*fr) {
					t.Errorf("%s finished %+v overlapped, %+v sequential", rid, *o, *fr)
				}
			}
			if fr := seq.finish["stop"]; fr.Type != "stop" || len(want["stop"]) != 5 {
				t.Errorf("stop: %v %+v", want["stop"], fr)
			}
			if tc.abortAt > 0 && ovl.finish["temp1"].Type != "abort" {
				t.Errorf("temp1 finished %+v after abort", ovl.finish["temp1"])
			}
			if err := ovl.s.core.CheckInvariants(); err != nil {
				t.Fatal(err)
			}
			if tc.name == "short-kv" && ovl.s.core.Stats.Retractions == 0 {
				t.Error("no retraction with a short KV cache")
			}
		})
	}
}

// TestOverlapKeepsLogitBias: a request whose steps are all blind follow-ups
// samples with its logit_bias on each, as step-by-step scheduling does.
func TestOverlapKeepsLogitBias(t *testing.T) {
	seed := uint64(13)
	temp := 1.0
	cases := []overlapCase{{"bias", prompt(11, 20), ioschema.SamplingParams{MaxNewTokens: ptr(16), Temperature: &temp,
		SamplingSeed: &seed, IgnoreEOS: true, LogitBias: map[string]float64{"5": 30, "7": -100}}, 0}}
	h, over := runOverlapCase(t, true, 4096, cases, 0, "")
	if h.s.core.Stats.Overlapped == 0 {
		t.Fatal("no step was a blind follow-up")
	}
	_, seq := runOverlapCase(t, false, 4096, cases, 0, "")
	if !slices.Equal(over["bias"], seq["bias"]) || slices.ContainsFunc(seq["bias"], func(id int32) bool { return id != 5 }) {
		t.Fatalf("overlapped %v, step by step %v: want token 5 throughout", over["bias"], seq["bias"])
	}
}
