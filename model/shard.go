package model

import "fmt"

// Shard is one rank's part of a tensor-parallel model: the attention heads
// and MLP columns are split over Size ranks (KV heads too, or replicated
// when there are fewer of them than ranks), so o_proj and down_proj give
// partial sums that a device.Collective adds up. The embedding and lm_head
// are split by vocabulary when it divides evenly (each rank embeds the
// tokens it holds, zeros for the rest, and the ranks add; the logits of
// the ranks' parts are gathered), else whole on every rank.
type Shard struct{ Rank, Size int }

// Sharded reports whether the model is split over several ranks.
func (s Shard) Sharded() bool { return s.Size > 1 }

// LocalConfig is the configuration one rank computes with.
func (s Shard) LocalConfig(c *Config) (*Config, error) {
	if !s.Sharded() {
		return c, nil
	}
	if s.Rank < 0 || s.Rank >= s.Size {
		return nil, fmt.Errorf("tensor-parallel rank %d of %d", s.Rank, s.Size)
	}
	if c.Heads%s.Size != 0 || c.Intermediate%s.Size != 0 {
		return nil, fmt.Errorf("%d attention heads and intermediate size %d do not split over %d ranks", c.Heads, c.Intermediate, s.Size)
	}
	if c.KVHeads%s.Size != 0 && s.Size%c.KVHeads != 0 {
		return nil, fmt.Errorf("%d KV heads neither split over nor replicate evenly to %d ranks", c.KVHeads, s.Size)
	}
	if c.MoE != nil && c.MoE.Intermediate%s.Size != 0 {
		return nil, fmt.Errorf("moe_intermediate_size %d does not split over %d ranks", c.MoE.Intermediate, s.Size)
	}
	if c.MoE != nil && c.MoE.SharedIntermediate%s.Size != 0 {
		return nil, fmt.Errorf("shared_expert_intermediate_size %d does not split over %d ranks", c.MoE.SharedIntermediate, s.Size)
	}
	l := *c
	if c.MoE != nil {
		// Every rank holds every expert's share of columns: the router
		// picks the same experts on each, and the partial sums meet as a
		// dense MLP's do.
		moe := *c.MoE
		moe.Intermediate /= s.Size
		moe.SharedIntermediate /= s.Size // the shared expert splits as a dense MLP does
		l.MoE = &moe
	}
	l.Heads = c.Heads / s.Size
	l.KVHeads = max(c.KVHeads/s.Size, 1)
	l.Intermediate = c.Intermediate / s.Size
	if c.Vocab%s.Size == 0 {
		l.VocabRows = c.Vocab / s.Size
	}
	return &l, nil
}

// vocabSpan is this rank's rows of the embedding and lm_head; zero when it
// holds them whole.
func (s Shard) vocabSpan(local *Config) span {
	if local.VocabRows == 0 {
		return span{}
	}
	return span{s.Rank * local.VocabRows, (s.Rank + 1) * local.VocabRows}
}

// kvHead0 is the first global KV head of this rank: the one its first
// query head reads.
func (s Shard) kvHead0(global *Config) int {
	if !s.Sharded() {
		return 0
	}
	return s.Rank * (global.Heads / s.Size) / (global.Heads / global.KVHeads)
}

// span is a range of rows or columns of a checkpoint tensor; the zero
// value is all of them.
type span struct{ from, to int }

func (s span) whole() bool { return s.from == 0 && s.to == 0 }

// slice copies rows x cols of a row-major tensor of shape (1-D tensors have
// one row) with elements of size bytes.
func slice(data []byte, shape []int, size int, rows, cols span) []byte {
	if rows.whole() && cols.whole() {
		return data
	}
	n := shape[len(shape)-1]
	if len(shape) == 1 { // a bias: its one dimension is the "rows"
		cols, rows = rows, span{0, 1}
	}
	if rows.whole() {
		rows = span{0, len(data) / size / n}
	}
	if cols.whole() {
		cols = span{0, n}
	}
	out := make([]byte, 0, (rows.to-rows.from)*(cols.to-cols.from)*size)
	for r := rows.from; r < rows.to; r++ {
		out = append(out, data[(r*n+cols.from)*size:(r*n+cols.to)*size]...)
	}
	return out
}
