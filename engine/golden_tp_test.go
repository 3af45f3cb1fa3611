package engine_test

import (
	"fmt"
	"math"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"ebb/device"
	"ebb/device/cpu"
	"ebb/engine"
	"ebb/model"
	"ebb/runner"
)

// TestGoldensCPUTensorParallel: every golden configuration whose heads
// split over two ranks, run as two tensor-parallel CPU ranks (in one
// process: rank 1 runs each step rank 0 sends it, as a follower process
// does), matches transformers as one rank does.
func TestGoldensCPUTensorParallel(t *testing.T) {
	ran := 0
	for _, g := range loadGoldens(t) {
		t.Run(g.Name, func(t *testing.T) {
			dir := writeGoldenModel(t, g)
			mc, err := model.LoadConfig(dir)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := (model.Shard{Size: 2}).LocalConfig(mc); err != nil {
				t.Skip(err)
			}
			comms := cpu.NewLocalGroup(2)
			var ranks [2]*engine.Engine
			for r := range ranks {
				e, err := engine.Open(engine.Config{ModelDir: dir, Device: "cpu", MaxRunningRequests: 8, ChunkedPrefillSize: 64,
					MaxTotalTokens: 4096, TPSize: 2, TPRank: r, EnableReturnRoutedExperts: mc.MoE != nil,
					Collective: func(device.Device) (device.Collective, error) { return comms[r], nil }})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				ranks[r] = e
			}
			steps := make(chan []byte, 16)
			done := make(chan error, 1)
			go func() {
				var err error
				for b := range steps {
					var seqs []runner.SeqStep
					if err = msgpack.Unmarshal(b, &seqs); err != nil {
						break
					}
					p, lerr := ranks[1].Runner.Launch(seqs)
					if err = lerr; err == nil {
						_, err = p.Wait()
					}
					if err != nil {
						break
					}
				}
				for range steps { // unblock the leader's sends
				}
				done <- err
			}()
			// As over the wire: the follower gets a copy of the step.
			ranks[0].Runner.Mirror = func(seqs []runner.SeqStep) error {
				b, err := msgpack.Marshal(seqs)
				if err == nil {
					steps <- b
				}
				return err
			}
			outs := generateGolden(t, ranks[0], g)
			close(steps)
			if err := <-done; err != nil {
				t.Fatalf("rank 1: %v", err)
			}
			for i, c := range g.Cases {
				what := fmt.Sprintf("prompt of %d", len(c.InputIDs))
				n := compareGolden(t, what, c.OutputIDs, c.OutputLogprobs, c.Top2Gap,
					outs[i].OutputIDs, outs[i].OutputLogprobs, logprobTol)
				compareRouting(t, what, c, outs[i].RoutedExperts, n, routerTie)
				for j, want := range c.PromptLogprobs {
					if d := math.Abs(float64(outs[i].InputLogprobs[j+1]) - want); d > logprobTol {
						t.Fatalf("prompt token %d: logprob %v, transformers %v", j+1, outs[i].InputLogprobs[j+1], want)
					}
				}
			}
			ran++
		})
	}
	if ran == 0 {
		t.Fatal("no golden configuration splits over two ranks")
	}
}
