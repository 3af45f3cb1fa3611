package scheduler

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"go.uber.org/zap"

	"ebb/engine"
	"ebb/ioschema"
	"ebb/memory"
	"ebb/tinymodel"

	_ "ebb/device/cpu"
)

var (
	modelOnce sync.Once
	testRoot  string
	modelErr  error
)

// testModel is a tiny Qwen3 with a 4096-token vocabulary (prompts are token
// ids), written once for the package's tests: small weights keep hundreds
// of release/resume cycles fast.
func testModel(t testing.TB) string {
	t.Helper()
	modelOnce.Do(func() {
		if testRoot, modelErr = os.MkdirTemp("", "ebb-scheduler-test-"); modelErr != nil {
			return
		}
		spec, _ := tinymodel.Default("qwen3")
		spec.Tie, spec.Vocab = false, 4096
		modelErr = tinymodel.Write(filepath.Join(testRoot, "m"), spec)
	})
	if modelErr != nil {
		t.Fatal(modelErr)
	}
	return filepath.Join(testRoot, "m")
}

func TestMain(m *testing.M) {
	code := m.Run()
	if testRoot != "" {
		os.RemoveAll(testRoot)
	}
	os.Exit(code)
}

// harness drives a Server in-process: messages in through Handle, steps
// as the loop would take them, outputs collected from its out channel.
type harness struct {
	t       *testing.T
	s       *Server
	e       *engine.Engine
	out     chan outgoing
	tokens  map[string][]int32
	cached  map[string]int
	finish  map[string]*ioschema.FinishReason
	replies []ioschema.Message
}

func newHarness(t *testing.T, backup bool, slots int) *harness {
	return newHarnessChunk(t, backup, slots, 48)
}

func newHarnessChunk(t *testing.T, backup bool, slots, chunk int) *harness {
	t.Helper()
	return newHarnessConfig(t, engine.Config{Device: "cpu", MaxRunningRequests: 8,
		ChunkedPrefillSize: chunk, MaxTotalTokens: slots, CPUBackup: backup, CUDAGraphMaxBS: 4})
}

// newHarnessConfig is a harness over the test model with cfg.
func newHarnessConfig(t *testing.T, cfg engine.Config) *harness {
	t.Helper()
	cfg.ModelDir = testModel(t)
	e, err := engine.Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	s, err := NewServer(e, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, s: s, e: e, out: make(chan outgoing, 1<<16), tokens: map[string][]int32{}, cached: map[string]int{}, finish: map[string]*ioschema.FinishReason{}}
	s.out = h.out
	return h
}

func (h *harness) drain() {
	for {
		select {
		case o := <-h.out:
			switch m := o.msg.(type) {
			case *ioschema.BatchTokenIDOutput:
				for i, rid := range m.Rids {
					h.tokens[rid] = append(h.tokens[rid], m.OutputIDs[i]...)
					h.cached[rid] = m.CachedTokens[i]
					if m.FinishedReasons[i] != nil {
						h.finish[rid] = m.FinishedReasons[i]
					}
				}
			default:
				h.replies = append(h.replies, m)
			}
		default:
			return
		}
	}
}

func prompt(seed, n int) []int32 {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = int32((seed*7919 + i*104729) % 4000)
	}
	return ids
}

func (h *harness) generate(rid string, ids []int32, maxNew int) {
	zero := 0.0
	h.s.Handle(&ioschema.TokenizedGenerateReqInput{Rid: rid, InputIDs: ids, LogprobStartLen: -1,
		SamplingParams: ioschema.SamplingParams{MaxNewTokens: &maxNew, Temperature: &zero, IgnoreEOS: true}})
}

// step runs n scheduling steps if generation may proceed, checking the KV
// accounting after each.
func (h *harness) step(n int) {
	h.t.Helper()
	for i := 0; i < n && h.s.canRun() && !h.s.core.Idle(); i++ {
		if err := h.s.Step(); err != nil {
			h.t.Fatal(err)
		}
		if err := h.s.core.CheckInvariants(); err != nil {
			h.t.Fatal(err)
		}
	}
	h.drain()
}

func (h *harness) runToIdle() { h.step(1 << 20) }

// control sends a control message and returns its reply.
func (h *harness) control(m ioschema.Message) ioschema.Message {
	h.t.Helper()
	h.replies = nil
	h.s.Handle(m)
	h.drain()
	if len(h.replies) != 1 {
		h.t.Fatalf("%s: %d replies", m.TypeName(), len(h.replies))
	}
	return h.replies[0]
}

func ok(m ioschema.Message) (bool, string) {
	if e, isErr := m.(*ioschema.ErrorOutput); isErr {
		return false, e.Message
	}
	r := m.(interface{ ResultPtr() *ioschema.Result }).ResultPtr()
	return r.Success, r.Message
}

func (h *harness) mustSucceed(m ioschema.Message) ioschema.Message {
	h.t.Helper()
	reply := h.control(m)
	if success, msg := ok(reply); !success {
		h.t.Fatalf("%s failed: %s", m.TypeName(), msg)
	}
	return reply
}

func (h *harness) mustFail(m ioschema.Message, why string) {
	h.t.Helper()
	reply := h.control(m)
	if success, msg := ok(reply); success {
		h.t.Fatalf("%s (%s) succeeded: %s", m.TypeName(), why, msg)
	}
}

// reference runs the same requests on a fresh server with no interruption.
func reference(t *testing.T, reqs map[string][]int32, maxNew int) map[string][]int32 {
	h := newHarness(t, false, 4096)
	for rid, ids := range reqs {
		h.generate(rid, ids, maxNew)
	}
	h.runToIdle()
	return h.tokens
}

func threeRequests() map[string][]int32 {
	return map[string][]int32{"a": prompt(1, 30), "b": prompt(2, 70), "c": prompt(3, 5)}
}

func sameOutputs(t *testing.T, got, want map[string][]int32) {
	t.Helper()
	for rid, w := range want {
		if !slices.Equal(got[rid], w) {
			t.Fatalf("%s: got %v\nwant %v", rid, got[rid], w)
		}
	}
}

func TestPauseModesWithRequestsInFlight(t *testing.T) {
	const maxNew = 12
	want := reference(t, threeRequests(), maxNew)
	for _, mode := range []string{ioschema.PauseAbort, ioschema.PauseRetract, ioschema.PauseInPlace} {
		t.Run(mode, func(t *testing.T) {
			h := newHarness(t, false, 4096)
			for rid, ids := range threeRequests() {
				h.generate(rid, ids, maxNew)
			}
			h.step(4) // every request is in flight, some have output
			reply := h.mustSucceed(&ioschema.PauseGenerationReqInput{Mode: mode}).(*ioschema.PauseGenerationReqOutput)
			// Requests arriving while paused wait.
			h.generate("late", prompt(4, 9), maxNew)
			h.step(10)
			if len(h.tokens["late"]) != 0 {
				t.Fatal("a request ran while paused")
			}
			waiting, running := h.s.core.Counts()
			switch mode {
			case ioschema.PauseAbort:
				if reply.Aborted != 3 {
					t.Fatalf("aborted %d", reply.Aborted)
				}
				for rid := range threeRequests() {
					if fr := h.finish[rid]; fr == nil || fr.Type != "abort" {
						t.Fatalf("%s finished with %+v", rid, fr)
					}
					if n := len(h.tokens[rid]); n == 0 || n >= maxNew {
						t.Fatalf("%s: %d partial tokens", rid, n)
					}
				}
			case ioschema.PauseRetract:
				if running != 0 || waiting != 4 || reply.Retracted == 0 {
					t.Fatalf("retract: waiting %d running %d retracted %d", waiting, running, reply.Retracted)
				}
			case ioschema.PauseInPlace:
				if running == 0 {
					t.Fatal("in_place dropped running requests")
				}
			}
			h.mustSucceed(&ioschema.ContinueGenerationReqInput{TorchEmptyCache: true})
			h.runToIdle()
			if len(h.tokens["late"]) != maxNew {
				t.Fatalf("late request: %d tokens", len(h.tokens["late"]))
			}
			if mode != ioschema.PauseAbort {
				// Retracted requests re-prefill and continue where they were.
				sameOutputs(t, h.tokens, want)
			}
			if st := h.s.core.Stats; mode == ioschema.PauseRetract && (st.Retractions != 3 || st.RecomputedTokens != 0) {
				// With room to spare their KV stayed in the radix cache.
				t.Fatalf("retract: %d retractions, %d tokens computed again", st.Retractions, st.RecomputedTokens)
			}
			if err := h.s.core.CheckInvariants(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestMisuseGetsErrorReplies(t *testing.T) {
	h := newHarness(t, false, 4096)
	h.mustFail(&ioschema.ResumeMemoryOccupationReqInput{Tags: []string{"kv_cache"}}, "resume a resident tag")
	h.mustFail(&ioschema.ReleaseMemoryOccupationReqInput{Tags: []string{"activations"}}, "unknown tag")
	h.mustFail(&ioschema.PauseGenerationReqInput{Mode: "sideways"}, "unknown mode")
	h.mustFail(&ioschema.GetWeightsByNameReqInput{Name: "model.nope", TruncateSize: 3}, "unknown parameter")
	h.mustFail(&ioschema.UpdateWeightFromDiskReqInput{ModelPath: "/nonexistent"}, "missing directory")
	// A checkpoint with the wrong shapes is refused and the weights stay.
	other := filepath.Join(t.TempDir(), "other")
	spec, _ := tinymodel.Default("qwen3")
	spec.Hidden, spec.Vocab = 32, 4096
	if err := tinymodel.Write(other, spec); err != nil {
		t.Fatal(err)
	}
	before := h.mustSucceed(&ioschema.GetWeightsByNameReqInput{Name: "model.norm.weight", TruncateSize: 8}).(*ioschema.GetWeightsByNameReqOutput)
	h.mustFail(&ioschema.UpdateWeightFromDiskReqInput{ModelPath: other}, "wrong shapes")
	after := h.mustSucceed(&ioschema.GetWeightsByNameReqInput{Name: "model.norm.weight", TruncateSize: 8}).(*ioschema.GetWeightsByNameReqOutput)
	if !slices.Equal(before.Parameter, after.Parameter) {
		t.Fatal("a refused update changed the weights")
	}
	// An update that would flush the KV requests paused in place hold needs
	// abort_all_requests (while generation runs it waits for them:
	// TestWeightUpdateWaitsForRunningRequests).
	h.generate("busy", prompt(5, 20), 50)
	h.step(3)
	h.mustSucceed(&ioschema.PauseGenerationReqInput{Mode: ioschema.PauseInPlace})
	h.mustFail(&ioschema.UpdateWeightFromDiskReqInput{ModelPath: testModel(t)}, "requests hold KV")
	// A wrong path or checkpoint aborts nothing, even with abort_all_requests.
	h.mustFail(&ioschema.UpdateWeightFromDiskReqInput{ModelPath: "/nonexistent", AbortAllRequests: true}, "missing directory, abort all")
	h.mustFail(&ioschema.UpdateWeightFromDiskReqInput{ModelPath: other, AbortAllRequests: true}, "wrong shapes, abort all")
	h.mustFail(&ioschema.UpdateWeightFromDiskReqInput{AbortAllRequests: true}, "no model_path")
	if fr := h.finish["busy"]; fr != nil {
		t.Fatalf("a refused update ended the busy request: %+v", fr)
	}
	h.mustFail(&ioschema.FlushCacheReqInput{}, "requests running")
	h.mustSucceed(&ioschema.UpdateWeightFromDiskReqInput{ModelPath: testModel(t), AbortAllRequests: true, WeightVersion: ptr("v2")})
	if fr := h.finish["busy"]; fr == nil || fr.Type != "abort" {
		t.Fatalf("busy request: %+v", fr)
	}
	h.mustSucceed(&ioschema.ReleaseMemoryOccupationReqInput{})
	h.mustFail(&ioschema.ReleaseMemoryOccupationReqInput{}, "release twice")
	h.mustFail(&ioschema.UpdateWeightFromDiskReqInput{ModelPath: testModel(t)}, "weights released")
	h.mustFail(&ioschema.UpdateWeightsFromTensorReqInput{}, "not supported")
	h.mustSucceed(&ioschema.ResumeMemoryOccupationReqInput{})
	if err := h.s.core.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

func ptr[T any](v T) *T { return &v }

func TestReleaseResumeGeneratesAsFresh(t *testing.T) {
	const maxNew = 10
	want := reference(t, threeRequests(), maxNew)
	for _, backup := range []bool{true, false} {
		t.Run(fmt.Sprintf("cpu_backup=%v", backup), func(t *testing.T) {
			h := newHarness(t, backup, 4096)
			h.generate("warm", prompt(9, 40), 5)
			h.runToIdle()
			rel := h.mustSucceed(&ioschema.ReleaseMemoryOccupationReqInput{}).(*ioschema.ReleaseMemoryOccupationReqOutput)
			for _, o := range rel.Tags {
				if o.State != "released" || o.Bytes == 0 && o.Tag != memory.Workspace {
					t.Fatalf("release: %+v", o)
				}
			}
			// Multi-stage resume: weights first, then the rest.
			h.mustSucceed(&ioschema.ResumeMemoryOccupationReqInput{Tags: []string{"weights"}})
			if !backup {
				h.replies = nil
				h.generate("refused", prompt(1, 3), 2)
				h.drain()
				if len(h.replies) != 1 {
					t.Fatal("generation on stale weights was not refused")
				}
				h.mustSucceed(&ioschema.UpdateWeightFromDiskReqInput{ModelPath: testModel(t)})
			}
			h.mustSucceed(&ioschema.ResumeMemoryOccupationReqInput{Tags: []string{"kv_cache", "cuda_graph"}})
			for rid, ids := range threeRequests() {
				h.generate(rid, ids, maxNew)
			}
			h.runToIdle()
			sameOutputs(t, h.tokens, want)
		})
	}
}

func TestReleaseWithRequestsInFlightRetracts(t *testing.T) {
	const maxNew = 12
	want := reference(t, threeRequests(), maxNew)
	h := newHarness(t, true, 4096)
	for rid, ids := range threeRequests() {
		h.generate(rid, ids, maxNew)
	}
	h.step(4)
	h.mustSucceed(&ioschema.ReleaseMemoryOccupationReqInput{})
	h.step(5)
	waiting, running := h.s.core.Counts()
	if running != 0 || waiting != 3 {
		t.Fatalf("after release: waiting %d running %d", waiting, running)
	}
	h.mustSucceed(&ioschema.ResumeMemoryOccupationReqInput{})
	h.runToIdle()
	sameOutputs(t, h.tokens, want)
}

// TestManyCyclesDoNotGrow: 200 release/resume cycles with generation in
// between leave every region's reservation where it was.
func TestManyCyclesDoNotGrow(t *testing.T) {
	h := newHarness(t, true, 2048)
	h.generate("first", prompt(7, 20), 4)
	h.runToIdle()
	start := h.e.Dev.Memory().Stats()
	for i := 0; i < 200; i++ {
		h.mustSucceed(&ioschema.ReleaseMemoryOccupationReqInput{})
		h.mustSucceed(&ioschema.ResumeMemoryOccupationReqInput{})
		if i%50 == 0 {
			h.generate(fmt.Sprint("c", i), prompt(i, 10), 3)
			h.runToIdle()
		}
	}
	end := h.e.Dev.Memory().Stats()
	for i := range start {
		if start[i].Reserved != end[i].Reserved || start[i].Allocated != end[i].Allocated || start[i].Capacity != end[i].Capacity {
			t.Fatalf("%s changed: %+v -> %+v", start[i].Tag, start[i], end[i])
		}
	}
	if err := h.e.Dev.Memory().CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}
