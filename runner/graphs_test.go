package runner

import (
	"slices"
	"testing"

	"ebb/device"
	"ebb/device/cpu"
	"ebb/tinymodel"
)

// contextDevice is the CPU device as a device whose decode kernels change
// at short contexts from batches of two: it records the longest context
// each Attention call is told, which a graph captured for short contexts
// must carry.
type contextDevice struct {
	*cpu.Device
	short int
	seen  []int
}

func (d *contextDevice) ShortDecodeContext(hq, hk, dim, batch int) int {
	if batch < 2 {
		return 0
	}
	return d.short
}

func (d *contextDevice) Attention(out, qkv, kCache, vCache device.Tensor, meta device.AttnMeta, scale float32) {
	d.seen = append(d.seen, meta.MaxKVLen)
	d.Device.Attention(out, qkv, kCache, vCache, meta, scale)
}

// TestShortContextGraphs: a device whose decode kernels change at short
// contexts gets a second set of decode graphs for the batch sizes where
// they change, captured for contexts of at most its bound; a decode step
// takes them while every sequence's context is within it and the full set
// after, and the tokens equal those of a runner with one set.
func TestShortContextGraphs(t *testing.T) {
	const short, prompt, steps = 24, 10, 30
	dir := tinymodel.TestDir(t, "qwen3", nil)
	generate := func(dev device.Device, counts *contextDevice) (toks []int32, shortSteps []bool) {
		r := smallRunner(t, dev, dir)
		if err := r.CaptureGraphs([]int{1, 2, 4}); err != nil {
			t.Fatal(err)
		}
		if counts != nil {
			var sizes []int
			for b, sg := range r.graphs.short {
				if sg.maxKV != short {
					t.Fatalf("batch %d's short-context graph is for contexts to %d, want %d", b, sg.maxKV, short)
				}
				sizes = append(sizes, b)
			}
			if slices.Sort(sizes); !slices.Equal(sizes, []int{2, 4}) {
				t.Fatalf("short-context graphs for batches %v, want 2 and 4", sizes)
			}
		}
		// Two sequences, the second 6 positions behind the first.
		seqs := make([]SeqStep, 2)
		for i := range seqs {
			n := prompt - 6*i
			seqs[i] = SeqStep{Tokens: make([]int32, n), Sample: true, Params: Greedy}
			for j := range n {
				seqs[i].Tokens[j] = int32(11*i + 7*j + 3)
				seqs[i].Slots = append(seqs[i].Slots, int32(128*i+j))
			}
		}
		for step := 0; step <= steps; step++ {
			before := r.Stats
			if counts != nil {
				counts.seen = counts.seen[:0]
			}
			res, err := r.Step(seqs)
			if err != nil {
				t.Fatal(err)
			}
			if step > 0 {
				if r.Stats.GraphSteps != before.GraphSteps+1 {
					t.Fatalf("decode step %d did not run as a graph", step)
				}
				isShort := r.Stats.ShortGraphSteps == before.ShortGraphSteps+1
				shortSteps = append(shortSteps, isShort)
				if counts != nil {
					want := r.Model.ContextLen()
					if isShort {
						want = short
					}
					if len(counts.seen) == 0 || slices.ContainsFunc(counts.seen, func(kv int) bool { return kv != want }) {
						t.Fatalf("decode step %d (short %v): attention told longest contexts %v, want %d", step, isShort, counts.seen, want)
					}
				}
			}
			for i := range seqs {
				toks = append(toks, res[i].Token)
				s := &seqs[i]
				s.Start += len(s.Tokens)
				s.Tokens = []int32{res[i].Token}
				s.Slots = append(s.Slots, int32(128*i+s.Start))
			}
		}
		return toks, shortSteps
	}
	cd := &contextDevice{Device: cpu.New(0), short: short}
	got, shortSteps := generate(cd, cd)
	want, plain := generate(cpu.New(0), nil)
	if !slices.Equal(got, want) {
		t.Fatalf("tokens with short-context graphs %v, with one set %v", got, want)
	}
	for step, s := range shortSteps {
		// The first sequence's context at decode step s (from 1) is
		// prompt + s positions, the longest of the two.
		if wantShort := prompt+step+1 <= short; s != wantShort || plain[step] {
			t.Fatalf("decode step %d (longest context %d): short graph %v (one set: %v), want %v", step+1, prompt+step+1, s, plain[step], wantShort)
		}
	}
}
