// Package bench measures ebb: one-batch latency, offline throughput,
// serving against any SGLang/OpenAI-compatible server, and the RL memory
// cycle. Results are JSON; figures are medians unless named otherwise.
package bench

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"os"
	"sort"
	"time"

	"go.uber.org/zap"

	"ebb/device"
	"ebb/engine"
	"ebb/ioschema"
	"ebb/launcher"
	"ebb/scheduler"
)

// OneBatchConfig is `ebb bench one-batch`.
type OneBatchConfig struct {
	Engine     engine.Config
	BatchSizes []int
	InputLen   int
	OutputLen  int
	// Temperature samples the outputs (0: greedy). A sampled request has a
	// seed of its own, so runs stay comparable by their outputs' digest.
	// Under random weights the rows of a greedy batch route alike (ncu: a
	// 16-token decode step of the 30B-A3B shape read about 8 experts'
	// weights); sampled tokens spread them as a trained model's rows are.
	Temperature float64
	// TopK, TopP and MinP filter sampled rows as a request's top_k, top_p
	// and min_p do (Qwen3's generation_config: 20, 0.95, 0), so that the
	// sampler's filtered path is timed as RL runs it. Zero values leave the
	// whole vocabulary (top_k -1, top_p 1, min_p 0).
	TopK     int
	TopP     float64
	MinP     float64
	Progress io.Writer // progress bars; nil for none
	// ProfileStep, when >= 0, opens the device profiler (cuProfilerStart)
	// around one step of the first batch size: 0 is the prefill, k the
	// k-th decode step. For `ncu --profile-from-start off`.
	ProfileStep int
	// Executable is the ebb binary that runs the other tensor-parallel
	// ranks and the other data-parallel engines (default: this one).
	Executable string
	// Log takes the warnings of the processes started for --tp-size and
	// --dp-size (nil: none).
	Log *zap.Logger
	// BeforeBatch, when set, is called before each batch size is run (the
	// data-parallel engines start each batch size together).
	BeforeBatch func(batchSize int) error
	// RankFailed is called when another rank of the engine stops during
	// the run (the leader may be waiting on it inside a collective); nil
	// prints the error and exits.
	RankFailed func(error)
}

// sampling gives request i's sampling parameters: greedy, or sampled from
// a seed of its own with the configured filters.
func (cfg OneBatchConfig) sampling() func(i int) (ioschema.Resolved, error) {
	maxNew, temp := cfg.OutputLen, cfg.Temperature
	return func(i int) (ioschema.Resolved, error) {
		p := ioschema.SamplingParams{Temperature: &temp, MaxNewTokens: &maxNew, IgnoreEOS: true}
		if temp > 0 {
			topK, topP, minP, seed := cfg.TopK, cfg.TopP, cfg.MinP, uint64(i)
			if topK == 0 {
				topK = -1
			}
			if topP == 0 {
				topP = 1
			}
			p.TopK, p.TopP, p.MinP, p.SamplingSeed = &topK, &topP, &minP, &seed
		}
		r, err := p.Resolve(nil)
		if err != nil {
			return r, fmt.Errorf("sampling: %w", err)
		}
		return r, nil
	}
}

// OneBatchResult is one batch size's figures.
type OneBatchResult struct {
	BatchSize        int       `json:"batch_size"`
	InputLen         int       `json:"input_len"`
	OutputLen        int       `json:"output_len"`
	PrefillMs        float64   `json:"prefill_ms"` // until every request has its first token
	PrefillSteps     int       `json:"prefill_steps"`
	PrefillStepMs    []float64 `json:"prefill_step_ms"` // each prefill step's time, to find a slow one
	PrefillTokPerS   float64   `json:"prefill_tokens_per_s"`
	DecodeMedianMs   float64   `json:"decode_step_median_ms"`
	DecodeP90Ms      float64   `json:"decode_step_p90_ms"`
	DecodeTokPerS    float64   `json:"decode_tokens_per_s"` // batch / median step
	TotalMs          float64   `json:"total_ms"`
	OutputTokPerS    float64   `json:"output_tokens_per_s"` // batch*output_len / total
	GraphDecodeSteps int64     `json:"graph_decode_steps"`
	// ShortGraphSteps of them took the graphs of short contexts.
	ShortGraphSteps int64 `json:"short_context_graph_steps"`
	// OutputDigest hashes every request's generated tokens, in request
	// order: equal digests, equal outputs (greedy), to compare builds or
	// parallel layouts.
	OutputDigest string `json:"output_digest"`
	// Engines are the data-parallel engines' own figures; the row's times
	// are the slowest engine's and its tokens/s those of all engines.
	Engines []OneBatchResult `json:"engines,omitempty"`
}

// OneBatch prefills each batch (in chunks of --chunked-prefill-size tokens,
// as the server does) and decodes it to the end, timing every step of the
// scheduler core (pack, upload, forward, sample, download). The prefill
// time runs until every request has its first token. With --tp-size the
// engine's rank 0 runs here and the others as child processes; with
// --dp-size each engine is a child process running the same batches, all
// starting each batch size together.
func OneBatch(cfg OneBatchConfig) ([]OneBatchResult, error) {
	if len(cfg.BatchSizes) == 0 {
		return nil, errors.New("no batch sizes")
	}
	if cfg.Temperature < 0 {
		return nil, fmt.Errorf("temperature %g: want 0 (greedy) or more", cfg.Temperature)
	}
	paramsFor := cfg.sampling()
	if _, err := paramsFor(0); err != nil {
		return nil, err
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	if cfg.Executable == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		cfg.Executable = exe
	}
	if cfg.Engine.DPSize > 1 {
		return oneBatchDP(cfg)
	}
	maxB := 0
	for _, b := range cfg.BatchSizes {
		maxB = max(maxB, b)
	}
	ec := cfg.Engine
	ec.MaxRunningRequests = maxB
	if ec.MaxTotalTokens == 0 {
		ec.MaxTotalTokens = maxB*(cfg.InputLen+cfg.OutputLen) + 1024
	}
	if ec.ContextLength == 0 {
		ec.ContextLength = cfg.InputLen + cfg.OutputLen + 64
	}
	e, closeEngine, err := openOneBatchEngine(cfg, ec)
	if err != nil {
		return nil, err
	}
	defer closeEngine()
	core, err := scheduler.NewCoreFor(e)
	if err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(1, 2))
	vocab := e.Model.Config.Vocab
	if e.Tokenizer != nil {
		vocab = min(vocab, e.Tokenizer.VocabSize()-300) // stay clear of special tokens
	}
	run := func(b int, label string) (OneBatchResult, error) {
		res := OneBatchResult{BatchSize: b, InputLen: cfg.InputLen, OutputLen: cfg.OutputLen}
		rids := make([]string, b)
		outputs := map[string][]int32{}
		for i := 0; i < b; i++ {
			ids := make([]int32, cfg.InputLen)
			for j := range ids {
				ids[j] = int32(rng.IntN(vocab))
			}
			rids[i] = fmt.Sprintf("%s-%d", label, i)
			params, err := paramsFor(i)
			if err != nil {
				return res, err
			}
			if err := core.Add(scheduler.Request{Rid: rids[i], InputIDs: ids, Params: params, LogprobStartLen: -1}); err != nil {
				return res, err
			}
		}
		bar := newProgress(cfg.Progress, cfg.OutputLen+1, fmt.Sprintf("batch %d steps", b))
		graphBefore, shortBefore := e.Runner.Stats.GraphSteps, e.Runner.Stats.ShortGraphSteps
		prof, _ := e.Dev.(device.Profiler)
		profile := prof != nil && cfg.ProfileStep >= 0 && label == fmt.Sprintf("b%d", cfg.BatchSizes[0])
		var steps []float64
		prefillSteps := 0
		started := map[string]bool{}
		start := time.Now()
		for !core.Idle() {
			if profile && len(steps) == cfg.ProfileStep {
				if err := prof.ProfilerStart(); err != nil {
					return res, err
				}
			}
			t0 := time.Now()
			events, err := core.Step()
			if err != nil {
				return res, err
			}
			for _, ev := range events {
				outputs[ev.Rid] = append(outputs[ev.Rid], ev.NewTokens...)
				if len(ev.NewTokens) > 0 && !started[ev.Rid] {
					started[ev.Rid] = true
					if len(started) == b {
						prefillSteps = len(steps) + 1
					}
				}
			}
			if profile && len(steps) == cfg.ProfileStep {
				if err := prof.ProfilerStop(); err != nil {
					return res, err
				}
			}
			steps = append(steps, float64(time.Since(t0).Microseconds())/1000)
			bar.Add(1)
		}
		res.TotalMs = float64(time.Since(start).Microseconds()) / 1000
		res.GraphDecodeSteps = e.Runner.Stats.GraphSteps - graphBefore
		res.ShortGraphSteps = e.Runner.Stats.ShortGraphSteps - shortBefore
		if len(steps) == 0 {
			return res, fmt.Errorf("batch %d: no steps ran", b)
		}
		prefillSteps = max(prefillSteps, 1)
		for _, ms := range steps[:prefillSteps] {
			res.PrefillMs += ms
		}
		res.PrefillStepMs = steps[:prefillSteps:prefillSteps]
		res.PrefillSteps = prefillSteps
		res.PrefillTokPerS = float64(b*cfg.InputLen) / (res.PrefillMs / 1000)
		decode := append([]float64(nil), steps[prefillSteps:]...)
		sort.Float64s(decode)
		if len(decode) > 0 {
			res.DecodeMedianMs = decode[len(decode)/2]
			res.DecodeP90Ms = decode[len(decode)*9/10]
			res.DecodeTokPerS = float64(b) / (res.DecodeMedianMs / 1000)
		}
		res.OutputTokPerS = float64(b*cfg.OutputLen) / (res.TotalMs / 1000)
		res.OutputDigest = outputDigest(rids, outputs)
		if err := core.FlushCache(); err != nil {
			return res, err
		}
		return res, core.CheckInvariants()
	}
	// Warm up kernels, cuBLAS heuristics and the allocator once.
	if _, err := run(min(maxB, 8), "warmup"); err != nil {
		return nil, err
	}
	var out []OneBatchResult
	for _, b := range cfg.BatchSizes {
		if cfg.BeforeBatch != nil {
			if err := cfg.BeforeBatch(b); err != nil {
				return out, err
			}
		}
		r, err := run(b, fmt.Sprintf("b%d", b))
		if err != nil {
			return out, err
		}
		out = append(out, r)
	}
	return out, nil
}

// openOneBatchEngine opens the engine in this process; with --tp-size its
// other ranks run as child processes of cfg.Executable, as under ebb serve.
func openOneBatchEngine(cfg OneBatchConfig, ec engine.Config) (*engine.Engine, func() error, error) {
	if ec.TPSize <= 1 {
		e, err := engine.Open(ec)
		if err != nil {
			return nil, nil, err
		}
		return e, e.Close, nil
	}
	f, err := launcher.StartFollowers(context.Background(), cfg.Executable, ec, "warn", cfg.Log)
	if err != nil {
		return nil, nil, err
	}
	e, closeLeader, err := scheduler.OpenTPLeader(f.Leader)
	if err == nil {
		if err = f.Wait(); err != nil {
			_ = closeLeader()
		}
	}
	if err != nil {
		f.Stop()
		return nil, nil, err
	}
	failed := cfg.RankFailed
	if failed == nil {
		failed = func(err error) {
			fmt.Fprintln(os.Stderr, "ebb bench one-batch:", err)
			os.Exit(1)
		}
	}
	done := make(chan struct{})
	go func() {
		select {
		case err := <-f.Failed():
			failed(err)
		case <-done:
		}
	}()
	return e, func() error {
		close(done)
		err := closeLeader()
		f.Stop()
		return err
	}, nil
}

// outputDigest is FNV-1a over each request's tokens (little-endian int32)
// and its count, in rids' order.
func outputDigest(rids []string, outputs map[string][]int32) string {
	h := fnv.New64a()
	var buf [4]byte
	for _, rid := range rids {
		toks := outputs[rid]
		binary.LittleEndian.PutUint32(buf[:], uint32(len(toks)))
		h.Write(buf[:])
		for _, t := range toks {
			binary.LittleEndian.PutUint32(buf[:], uint32(t))
			h.Write(buf[:])
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}
