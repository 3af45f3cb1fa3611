package scheduler

import (
	"fmt"
	"time"

	"go.uber.org/zap"
)

// StepInfo describes the step last launched, for SGLang's batch log lines.
type StepInfo struct {
	Decodes      int  // sequences decoding one token
	NewSeqs      int  // sequences with a prompt chunk
	NewTokens    int  // prompt tokens computed
	CachedTokens int  // prompt tokens of newly admitted sequences found in the prefix cache
	Graph        bool // replayed as a CUDA graph
	// RecomputedTokens of NewTokens had been computed before a retraction.
	RecomputedTokens int
	// Retracted requests made room for this step; the new-token ratio
	// went from RatioBefore to RatioAfter.
	Retracted               int
	RatioBefore, RatioAfter float64
}

// lastStep reports the step launched by the last Step call, and whether
// that call launched one.
func (c *Core) lastStep() (StepInfo, bool) { return c.last, c.launched }

// tokenUsage is the share of KV slots held, not counting cached prefixes
// that could be evicted (SGLang's "token usage"), and the count held.
func (c *Core) tokenUsage() (float64, int) {
	used := c.pool.total - c.pool.available() - c.cache.Evictable()
	return float64(used) / float64(max(c.pool.total, 1)), used
}

// batchLog writes SGLang's "Prefill batch" line for every step with prompt
// tokens and a "Decode batch" line every interval decode-only steps, with
// the output tokens per second since the last one.
type batchLog struct {
	interval int
	steps    int
	since    time.Time
	genAt    int64 // Stats.GeneratedTokens when since was taken
	// throughput is the last line's gen_throughput (SGLang's
	// last_gen_throughput, which /v1/loads reports), 0 once idle.
	throughput float64
}

func (b *batchLog) record(log *zap.Logger, c *Core) {
	if c.Idle() {
		b.steps, b.throughput = 0, 0 // time spent idle is not generation time
	}
	info, ok := c.lastStep()
	if !ok || b.interval <= 0 {
		return
	}
	usage, used := c.tokenUsage()
	if info.Retracted > 0 {
		log.Warn("KV cache pool is full. Retract requests.", zap.Int("retracted_reqs", info.Retracted),
			zap.String("new_token_ratio", fmt.Sprintf("%.4f -> %.4f", info.RatioBefore, info.RatioAfter)),
			zap.Int64("retracted_total", c.Stats.Retractions))
	}
	if info.NewTokens > 0 {
		log.Info("Prefill batch", zap.Int("new_seq", info.NewSeqs), zap.Int("new_token", info.NewTokens),
			zap.Int("cached_token", info.CachedTokens), zap.Int("recomputed_token", info.RecomputedTokens),
			zap.Float64("token_usage", round2(usage)), zap.Int("running_req", info.Decodes), zap.Int("queue_req", len(c.waiting)))
		return
	}
	now := time.Now()
	if b.steps == 0 {
		b.since, b.genAt = now, c.Stats.GeneratedTokens
	}
	b.steps++
	if b.steps <= b.interval {
		return
	}
	gen := c.Stats.GeneratedTokens - b.genAt
	b.throughput = round2(float64(gen) / now.Sub(b.since).Seconds())
	log.Info("Decode batch", zap.Int("running_req", len(c.running)), zap.Int("token", used),
		zap.Float64("token_usage", round2(usage)), zap.Bool("cuda_graph", info.Graph),
		zap.Float64("gen_throughput", b.throughput), zap.Int("queue_req", len(c.waiting)))
	b.steps, b.since, b.genAt = 1, now, c.Stats.GeneratedTokens
}

// waitingTokens is the tokens the waiting requests have yet to prefill
// (SGLang's pending prefill tokens): prompts, and the outputs of retracted
// requests.
func (c *Core) waitingTokens() int {
	n := 0
	for _, r := range c.waiting {
		n += len(r.InputIDs) + len(r.output) - len(r.slots)
	}
	return n
}

func round2(x float64) float64 { return float64(int64(x*100+0.5)) / 100 }
