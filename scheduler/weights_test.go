package scheduler

import (
	"testing"

	"ebb/ioschema"
)

// TestWeightUpdateWaitsForRunningRequests checks that a weight update
// arriving while requests decode waits for them, as SGLang's does (its
// model update lock), with nothing queued admitted meanwhile; that a pause
// coming after it answers it at once; that requests paused in place keep
// their KV through an update without a flush (SGLang's flush_cache false);
// that one whose caller went away is dropped; and that abort_all_requests
// ends the wait.
func TestWeightUpdateWaitsForRunningRequests(t *testing.T) {
	const maxNew = 30
	want := reference(t, map[string][]int32{"busy": prompt(5, 20)}, maxNew)
	update := func(abortAll bool) ioschema.Message {
		return &ioschema.UpdateWeightFromDiskReqInput{Control: ioschema.Control{Rid: "ctl-1"}, ModelPath: testModel(t),
			WeightVersion: ptr("v2"), AbortAllRequests: abortAll}
	}
	start := func(t *testing.T) *harness {
		h := newHarness(t, false, 4096)
		h.generate("busy", prompt(5, 20), maxNew)
		h.step(3)
		h.replies = nil
		h.s.Handle(update(false))
		h.generate("late", prompt(6, 20), 5)
		h.drain()
		if len(h.replies) != 0 {
			t.Fatalf("the update did not wait: %+v", h.replies[0])
		}
		return h
	}
	t.Run("carried out after them", func(t *testing.T) {
		h := start(t)
		for len(h.replies) == 0 && !h.s.core.Idle() {
			if waiting, _ := h.s.core.Counts(); waiting != 1 {
				t.Fatalf("%d waiting while the update waits", waiting)
			}
			h.step(1)
		}
		if len(h.replies) != 1 {
			t.Fatalf("%d replies", len(h.replies))
		}
		if success, msg := ok(h.replies[0]); !success {
			t.Fatalf("update failed: %s", msg)
		}
		if h.finish["busy"] == nil || h.finish["busy"].Type != "length" || len(h.tokens["late"]) != 0 {
			t.Fatalf("at the update: busy %+v, late %d tokens", h.finish["busy"], len(h.tokens["late"]))
		}
		sameOutputs(t, map[string][]int32{"busy": h.tokens["busy"]}, want)
		h.runToIdle()
		if len(h.tokens["late"]) != 5 || h.s.weightVersion != "v2" {
			t.Fatalf("late: %d tokens, version %s", len(h.tokens["late"]), h.s.weightVersion)
		}
		if err := h.s.checkHeldUpdates(); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("a pause answers it", func(t *testing.T) {
		h := start(t)
		h.s.Handle(&ioschema.PauseGenerationReqInput{Mode: ioschema.PauseInPlace})
		h.drain()
		if len(h.replies) != 2 {
			t.Fatalf("%d replies", len(h.replies))
		}
		if success, _ := ok(h.replies[1]); success {
			t.Fatal("an update with requests paused in place succeeded")
		}
		h.mustSucceed(&ioschema.ContinueGenerationReqInput{})
		h.runToIdle()
		if len(h.tokens["busy"]) != maxNew || len(h.tokens["late"]) != 5 {
			t.Fatalf("busy %d, late %d tokens", len(h.tokens["busy"]), len(h.tokens["late"]))
		}
	})
	t.Run("dropped when its caller goes away", func(t *testing.T) {
		h := start(t)
		h.s.Handle(&ioschema.AbortReq{Rid: "ctl-1"}) // what the tokenizer manager sends
		h.runToIdle()
		if len(h.replies) != 0 || h.s.weightVersion != "default" || len(h.tokens["busy"]) != maxNew || len(h.tokens["late"]) != 5 {
			t.Fatalf("%d replies, version %s, busy %d and late %d tokens", len(h.replies), h.s.weightVersion,
				len(h.tokens["busy"]), len(h.tokens["late"]))
		}
	})
	t.Run("paused in place, kept without a flush", func(t *testing.T) {
		h := newHarness(t, false, 4096)
		h.generate("busy", prompt(5, 20), maxNew)
		h.step(3)
		h.mustSucceed(&ioschema.PauseGenerationReqInput{Mode: ioschema.PauseInPlace})
		h.mustFail(update(false), "requests hold KV, flush")
		keep := false
		h.mustSucceed(&ioschema.UpdateWeightFromDiskReqInput{ModelPath: testModel(t), FlushCache: &keep})
		h.mustSucceed(&ioschema.ContinueGenerationReqInput{})
		h.runToIdle()
		// The same checkpoint: the tokens are those of a run left alone.
		sameOutputs(t, map[string][]int32{"busy": h.tokens["busy"]}, want)
	})
	t.Run("abort_all_requests ends the wait", func(t *testing.T) {
		h := start(t)
		h.s.Handle(update(true))
		h.drain()
		if len(h.replies) != 2 {
			t.Fatalf("%d replies", len(h.replies))
		}
		for _, r := range h.replies {
			if success, msg := ok(r); !success {
				t.Fatalf("update failed: %s", msg)
			}
		}
		// Every request, queued or running, as SGLang's abort_all_requests.
		for _, rid := range []string{"busy", "late"} {
			if fr := h.finish[rid]; fr == nil || fr.Type != "abort" {
				t.Fatalf("%s: %+v", rid, fr)
			}
		}
		if !h.s.core.Idle() || h.s.core.holdWaiting {
			t.Fatal("requests left, or the queue still held")
		}
	})
}
