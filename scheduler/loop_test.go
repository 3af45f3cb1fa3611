package scheduler

import (
	"context"
	"fmt"
	"testing"
	"time"

	"ebb/ioschema"
)

// TestLoopStopsSteppingWhenAControlMessageArrivesBusy drives Loop itself:
// a control message that arrives while requests decode is taken in the
// drain before a step, and the loop must not take that step once the
// message has paused generation or released memory. It once did, and a
// step on released weights read unmapped memory (a SIGSEGV on the CPU, an
// illegal address that ends the CUDA context on a GPU).
func TestLoopStopsSteppingWhenAControlMessageArrivesBusy(t *testing.T) {
	const maxNew = 300
	cases := []struct {
		name   string
		stop   ioschema.Message
		resume []ioschema.Message
	}{
		{"pause in_place", &ioschema.PauseGenerationReqInput{Mode: ioschema.PauseInPlace},
			[]ioschema.Message{&ioschema.ContinueGenerationReqInput{}}},
		{"pause retract", &ioschema.PauseGenerationReqInput{Mode: ioschema.PauseRetract},
			[]ioschema.Message{&ioschema.ContinueGenerationReqInput{}}},
		{"release weights", &ioschema.ReleaseMemoryOccupationReqInput{Tags: []string{"weights"}},
			[]ioschema.Message{&ioschema.ResumeMemoryOccupationReqInput{Tags: []string{"weights"}}}},
		{"release kv_cache", &ioschema.ReleaseMemoryOccupationReqInput{Tags: []string{"kv_cache"}},
			[]ioschema.Message{&ioschema.ResumeMemoryOccupationReqInput{Tags: []string{"kv_cache"}}}},
		{"release all", &ioschema.ReleaseMemoryOccupationReqInput{},
			[]ioschema.Message{&ioschema.ResumeMemoryOccupationReqInput{}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, true, 4096)
			inbox := make(chan ioschema.Message, 16)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- h.s.Loop(ctx, inbox, make(chan error), 10*time.Millisecond) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Error(err)
				}
			}()
			zero := 0.0
			rids := []string{"a", "b", "c"}
			for i, rid := range rids {
				n := maxNew
				inbox <- &ioschema.TokenizedGenerateReqInput{Rid: rid, InputIDs: prompt(i+1, 20+10*i), LogprobStartLen: -1,
					SamplingParams: ioschema.SamplingParams{MaxNewTokens: &n, Temperature: &zero, IgnoreEOS: true}}
			}
			tokens := map[string]int{}
			finished := 0
			// next returns the loop's next output, counting tokens, or nil
			// when there is none for quiet.
			next := func(quiet time.Duration) ioschema.Message {
				for {
					select {
					case o := <-h.out:
						if m, ok := o.msg.(*ioschema.BatchTokenIDOutput); ok {
							for i, rid := range m.Rids {
								tokens[rid] += len(m.OutputIDs[i])
								if m.FinishedReasons[i] != nil {
									finished++
								}
							}
							return m
						}
						return o.msg
					case <-time.After(quiet):
						return nil
					}
				}
			}
			// Wait until the loop decodes, then send the message.
			for m := next(10 * time.Second); ; m = next(10 * time.Second) {
				if m == nil {
					t.Fatal("no output from the loop")
				}
				if _, ok := m.(*ioschema.BatchTokenIDOutput); ok && tokens["a"] > 2 {
					break
				}
			}
			inbox <- c.stop
			var reply ioschema.Message
			for reply == nil {
				m := next(10 * time.Second)
				switch m.(type) {
				case nil:
					t.Fatalf("no reply to %s", c.stop.TypeName())
				case *ioschema.BatchTokenIDOutput:
				default:
					reply = m
				}
			}
			if success, msg := ok(reply); !success {
				t.Fatalf("%s failed: %s", c.stop.TypeName(), msg)
			}
			before := fmt.Sprint(tokens)
			if m := next(300 * time.Millisecond); m != nil {
				t.Fatalf("after %s's reply the loop went on: %T (tokens %s, then %v)", c.stop.TypeName(), m, before, tokens)
			}
			for _, r := range c.resume {
				inbox <- r
			}
			deadline := time.Now().Add(60 * time.Second)
			for finished < len(rids) && time.Now().Before(deadline) {
				next(time.Second)
			}
			for _, rid := range rids {
				if tokens[rid] != maxNew {
					t.Fatalf("%s: %d tokens, want %d (tokens %v)", rid, tokens[rid], maxNew, tokens)
				}
			}
		})
	}
}
