package model_test

import (
	"fmt"
	"math"
	"sync"
	"testing"

	"ebb/device"
	"ebb/device/cpu"
	"ebb/model"
	"ebb/runner"
	"ebb/tinymodel"
)

// TestTensorParallelMatchesOneRank: a model split over 2 or 4 CPU ranks
// (heads, KV heads split or replicated, MLP columns; o_proj and down_proj
// partial sums added by a collective; embedding and lm_head by vocabulary,
// or whole when it does not divide) prefills and decodes greedily to the
// tokens of the whole model, with logprobs within float32 rounding.
func TestTensorParallelMatchesOneRank(t *testing.T) {
	cases := []struct {
		arch  string
		ranks int
		spec  func(*tinymodel.Spec)
	}{
		{"qwen3", 2, nil}, // 4 heads, 2 KV heads: one each
		{"qwen3", 4, nil}, // KV heads replicated to 4 ranks
		{"qwen2", 2, nil}, // q/k/v bias
		{"llama", 2, func(s *tinymodel.Spec) { s.AttentionBias = true }}, // o_proj bias: added once
		{"llama", 4, func(s *tinymodel.Spec) { s.KVHeads = 1 }},          // MQA
		{"qwen3", 2, func(s *tinymodel.Spec) { s.Vocab = 513 }},          // vocabulary whole on each rank
		{"qwen2_moe", 2, nil}, // routed experts and the shared expert split by columns, its gate whole
		{"qwen2_moe", 4, func(s *tinymodel.Spec) { s.Layers, s.MLPOnly = 3, []int{1} }},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s-tp%d", c.arch, c.ranks), func(t *testing.T) {
			dir := tinymodel.TestDir(t, c.arch, c.spec)
			want := generate(t, dir, []model.Shard{{}}, nil)[0]
			shards := make([]model.Shard, c.ranks)
			for r := range shards {
				shards[r] = model.Shard{Rank: r, Size: c.ranks}
			}
			for r, got := range generate(t, dir, shards, cpu.NewLocalGroup(c.ranks)) {
				for i := range want {
					if got[i].Token != want[i].Token {
						t.Fatalf("rank %d step %d: token %d, one rank %d", r, i, got[i].Token, want[i].Token)
					}
					if d := math.Abs(float64(got[i].Logprob - want[i].Logprob)); d > 1e-4 {
						t.Fatalf("rank %d step %d: logprob %v, one rank %v", r, i, got[i].Logprob, want[i].Logprob)
					}
				}
			}
		})
	}
}

// generate runs one prompt's prefill and 8 greedy decode steps on every
// rank at once (each on its own CPU device) and returns each rank's
// results per step.
func generate(t *testing.T, dir string, shards []model.Shard, comms []device.Collective) [][]runner.SeqResult {
	t.Helper()
	out := make([][]runner.SeqResult, len(shards))
	errs := make([]error, len(shards))
	var wg sync.WaitGroup
	for r := range shards {
		wg.Add(1)
		go func() {
			defer wg.Done()
			opts := model.Options{ContextLen: 256, Shard: shards[r]}
			if comms != nil {
				opts.Comm = comms[r]
			}
			out[r], errs[r] = runRank(dir, opts)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return out
}

func runRank(dir string, opts model.Options) ([]runner.SeqResult, error) {
	m, err := model.Load(cpu.New(0), dir, opts)
	if err != nil {
		return nil, err
	}
	if err := m.AllocKV(64); err != nil {
		return nil, err
	}
	run, err := runner.New(m, runner.Limits{MaxTokens: 64, MaxSeqs: 2})
	if err != nil {
		return nil, err
	}
	tokens := []int32{5, 77, 300, 2, 41, 9, 128, 64, 11, 400}
	slots := make([]int32, 0, 32)
	var res []runner.SeqResult
	for step := 0; step < 9; step++ {
		start := len(slots)
		for i := start; i < len(tokens); i++ {
			slots = append(slots, int32(i))
		}
		r, err := run.Step([]runner.SeqStep{{Tokens: tokens[start:], Start: start, Slots: slots, Sample: true,
			Params: runner.Greedy, Draw: step}})
		if err != nil {
			return nil, err
		}
		if opts.Comm != nil && opts.Comm.Err() != nil {
			return nil, opts.Comm.Err()
		}
		res = append(res, r[0])
		tokens = append(tokens, r[0].Token)
	}
	return res, nil
}

func TestShardLocalConfig(t *testing.T) {
	global := &model.Config{Heads: 16, KVHeads: 8, Intermediate: 3072, HeadDim: 128}
	cases := []struct {
		shard         model.Shard
		heads, kv, im int
		err           bool
	}{
		{model.Shard{}, 16, 8, 3072, false},
		{model.Shard{Rank: 1, Size: 2}, 8, 4, 1536, false},
		{model.Shard{Rank: 15, Size: 16}, 1, 1, 192, false}, // KV heads replicated
		{model.Shard{Rank: 0, Size: 3}, 0, 0, 0, true},      // 16 heads do not split in 3
		{model.Shard{Rank: 2, Size: 2}, 0, 0, 0, true},      // no such rank
	}
	for _, c := range cases {
		l, err := c.shard.LocalConfig(global)
		if (err != nil) != c.err {
			t.Fatalf("%+v: error %v", c.shard, err)
		}
		if err == nil && (l.Heads != c.heads || l.KVHeads != c.kv || l.Intermediate != c.im) {
			t.Fatalf("%+v: %d heads, %d KV heads, intermediate %d", c.shard, l.Heads, l.KVHeads, l.Intermediate)
		}
	}
}
