package runner

import (
	"testing"

	"ebb/device"
	"ebb/device/cpu"
	"ebb/memory"
	"ebb/model"
	"ebb/tinymodel"
)

// TestLastLayerOnLogitRows: a step whose last layer runs on its logit rows
// alone (model.Inputs.LastAttn) gives the logits of the whole step, for
// prompts that are sampled, a chunk that is not, and a decode among them;
// a step with prompt-logprob rows does not take that path.
func TestLastLayerOnLogitRows(t *testing.T) {
	for _, arch := range []string{"qwen3", "llama"} {
		t.Run(arch, func(t *testing.T) {
			dev := cpu.New(0)
			r := smallRunner(t, dev, tinymodel.TestDir(t, arch, nil))
			m := r.Model
			seq := func(n, start, firstSlot int, sample bool) SeqStep {
				s := SeqStep{Tokens: make([]int32, n-start), Start: start, Sample: sample, Params: Greedy}
				for i := range s.Tokens {
					s.Tokens[i] = int32((firstSlot*7 + i*13) % 500)
				}
				for i := 0; i < n; i++ {
					s.Slots = append(s.Slots, int32(firstSlot+i))
				}
				return s
			}
			// A decode (30 cached positions), a sampled prompt, a prompt chunk
			// that is not sampled, and another sampled prompt: 3 logit rows
			// of 1 + 40 + 30 + 25 tokens.
			seqs := []SeqStep{seq(31, 30, 0, true), seq(40, 0, 40, true), seq(30, 0, 90, false), seq(25, 0, 130, true)}
			full, pruned := r.logits(t, dev, seqs, false), r.logits(t, dev, seqs, true)
			if len(full) != len(pruned) || len(full) != 3*m.Config.Vocab {
				t.Fatalf("%d and %d logits", len(full), len(pruned))
			}
			for i := range full {
				if d := full[i] - pruned[i]; d > 1e-4 || d < -1e-4 {
					t.Fatalf("logit %d: %v on the logit rows alone, %v with every row", i, pruned[i], full[i])
				}
			}
			seqs[1].NextTokens = make([]int32, len(seqs[1].Tokens))
			seqs[1].NextTokens[3] = 7
			r.host.pack(seqs, 0)
			ws, err := dev.Alloc(memory.Workspace, device.F32, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			defer dev.Free(memory.Workspace, ws)
			in, _, _, _, err := r.host.upload(dev, device.NewScratch(ws))
			if err != nil {
				t.Fatal(err)
			}
			if in.LastAttn.NumSeqs != 0 {
				t.Fatal("a step with a prompt-logprob row ran its last layer on the sampled rows alone")
			}
		})
	}
}

// smallRunner is a runner of a tiny model's directory on dev: 256 slots,
// steps of up to 128 tokens and 4 sequences.
func smallRunner(t *testing.T, dev device.Device, dir string) *Runner {
	t.Helper()
	m, err := model.Load(dev, dir, model.Options{ContextLen: 256})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.AllocKV(256); err != nil {
		t.Fatal(err)
	}
	r, err := New(m, Limits{MaxTokens: 128, MaxSeqs: 4})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// logits runs seqs' forward and returns its logit rows, with the last
// layer on those rows alone or on every row.
func (r *Runner) logits(t *testing.T, dev device.Device, seqs []SeqStep, lastOnLogitRows bool) []float32 {
	t.Helper()
	r.host.pack(seqs, 0)
	ws, err := dev.Alloc(memory.Workspace, device.F32, 1<<22)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(memory.Workspace, ws)
	s := device.NewScratch(ws)
	in, _, _, _, err := r.host.upload(dev, s)
	if err != nil {
		t.Fatal(err)
	}
	if in.LastAttn.NumSeqs == 0 {
		t.Fatal("no LastAttn for a step of sampled last tokens")
	}
	if !lastOnLogitRows {
		in.LastAttn = device.AttnMeta{}
	}
	logits := r.Model.Forward(in, s)
	out := make([]float32, logits.Numel())
	if err := dev.DownloadF32(logits, out); err != nil {
		t.Fatal(err)
	}
	return out
}
