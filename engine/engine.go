// Package engine assembles a servable model from a Hugging Face directory:
// device, weights, KV cache, runner, tokenizer and sampling defaults. The
// scheduler (process and offline) starts here.
package engine

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"ebb/device"
	"ebb/ioschema"
	"ebb/memory"
	"ebb/model"
	"ebb/runner"
	"ebb/safetensors"
	"ebb/tokenizer"
)

// Config are the engine's start-up settings (SGLang's server args).
type Config struct {
	ModelDir string
	// TokenizerDir holds tokenizer.json and tokenizer_config.json when they
	// are not next to the weights (--tokenizer-path).
	TokenizerDir      string
	Device            string // cpu, cuda, auto
	GPU               int    // the first GPU (--base-gpu-id)
	TPSize, DPSize    int    // tensor- and data-parallel sizes (--tp-size, --dp-size)
	DType             string // auto or bfloat16 (--dtype)
	RandomSeed        *uint64
	DisableRadixCache bool
	// TPRank is this process's rank among TPSize, and Collective joins the
	// ranks that add up each other's partial sums, once the device is open
	// (set by the process that opens a tensor-parallel rank).
	TPRank     int                                            `json:",omitempty"`
	Collective func(device.Device) (device.Collective, error) `json:"-"`
	// DisableOverlap waits for each step before building the next
	// (--disable-overlap-schedule).
	DisableOverlap bool
	// EnableMixedChunk puts the decodes in the steps that prefill
	// (--enable-mixed-chunk).
	EnableMixedChunk bool
	// EnableDeterministicInference runs batch-invariant kernels: a
	// request's tokens and logprobs are the same bits whatever it is
	// batched with (--enable-deterministic-inference).
	EnableDeterministicInference bool
	// EnableReturnRoutedExperts records the experts every token of a
	// mixture-of-experts model was routed to, for requests that ask
	// (return_routed_experts; --enable-return-routed-experts).
	EnableReturnRoutedExperts bool
	// LoadFormat is auto (the safetensors of ModelDir) or dummy (random
	// weights from config.json alone, for benchmarks; --load-format).
	LoadFormat string
	// ScheduleConservativeness scales how much of their remaining output
	// requests that may stop early are expected to need when admitted
	// (--schedule-conservativeness; 0 means 1).
	ScheduleConservativeness float64
	// SchedulePolicy orders the waiting queue: fcfs (default), lpm,
	// dfs-weight, lof or random (--schedule-policy, SGLang's names).
	SchedulePolicy string
	// DistTimeout bounds waiting on a trainer's process group (--dist-timeout).
	DistTimeout time.Duration
	// WatchdogTimeout stops a scheduler process whose step has run this
	// long (--watchdog-timeout; 0: the scheduler's default).
	WatchdogTimeout    time.Duration
	ContextLength      int
	MaxRunningRequests int
	ChunkedPrefillSize int
	MaxTotalTokens     int     // KV cache slots; 0: derived from MemFractionStatic
	MemFractionStatic  float64 // share of GPU memory for weights and KV cache
	CPUBackup          bool    // --enable-weights-cpu-backup
	MaxTopLogprobs     int
	DisableCUDAGraph   bool
	// CUDAGraphMaxBS is the largest decode batch captured as a graph; 0
	// means 256 on a GPU and none on the CPU (where graphs are emulated,
	// which tests use).
	CUDAGraphMaxBS int
	// DecodeLogInterval is how many decode steps a "Decode batch" log line
	// covers (--decode-log-interval).
	DecodeLogInterval int
}

// Defaults fills unset fields.
func (c *Config) Defaults() {
	if c.Device == "" {
		c.Device = "auto"
	}
	if c.MaxRunningRequests <= 0 {
		c.MaxRunningRequests = 256
	}
	if c.ChunkedPrefillSize <= 0 {
		c.ChunkedPrefillSize = 8192
	}
	if c.MemFractionStatic <= 0 {
		c.MemFractionStatic = 0.85
	}
	if c.DecodeLogInterval <= 0 {
		c.DecodeLogInterval = 40
	}
	if c.MaxTopLogprobs <= 0 {
		c.MaxTopLogprobs = 20
	}
	if c.TokenizerDir == "" {
		c.TokenizerDir = c.ModelDir
	}
	if c.LoadFormat == "" {
		c.LoadFormat = "auto"
	}
	c.TPSize, c.DPSize = max(c.TPSize, 1), max(c.DPSize, 1)
}

// CheckDType accepts SGLang's --dtype values ebb runs: auto and bfloat16
// (the GPU computes in bf16; the CPU reference in float32 either way).
func CheckDType(dtype string) error {
	switch dtype {
	case "", "auto", "bfloat16", "bf16":
		return nil
	}
	return fmt.Errorf("--dtype %s is not supported: ebb runs models in bfloat16 (use auto or bfloat16)", dtype)
}

// enableDeterministic turns on the device's batch-invariant kernels. The
// partial sums of tensor parallelism meet in NCCL, whose algorithm (and so
// the order of the sum) changes with the message size, so the two are not
// combined; data parallelism is (each engine computes alone).
func enableDeterministic(dev device.Device, cfg Config, m *model.Config) error {
	if cfg.TPSize > 1 {
		return errors.New("--enable-deterministic-inference with --tp-size > 1 is not supported: the ranks' sums meet in NCCL, " +
			"whose order changes with the batch (use --dp-size for more GPUs)")
	}
	det, ok := dev.(device.Deterministic)
	if !ok {
		return fmt.Errorf("--enable-deterministic-inference: device %s has no batch-invariant kernels", dev.Name())
	}
	shape := device.ModelShape{Hidden: m.Hidden, Intermediate: m.Intermediate, Heads: m.Heads, KVHeads: m.KVHeads,
		HeadDim: m.HeadDim, Vocab: m.Vocab}
	if m.MoE != nil {
		shape.Experts, shape.SharedIntermediate = m.MoE.Experts, m.MoE.SharedIntermediate
	}
	if err := det.EnableDeterministic(shape); err != nil {
		return fmt.Errorf("--enable-deterministic-inference: %w", err)
	}
	return nil
}

// Engine is a loaded model ready to schedule.
type Engine struct {
	Config    Config
	Dev       device.Device
	Model     *model.Model
	Runner    *runner.Runner
	Tokenizer *tokenizer.Tokenizer // nil when the directory has none
	TokConfig *tokenizer.Config
	GenConfig *model.GenerationConfig
	EOS       []int32
	comm      device.Collective // the tensor-parallel group's, when there is one
}

// Open loads the model and sizes the KV cache.
func Open(cfg Config) (*Engine, error) {
	cfg.Defaults()
	if st, err := os.Stat(cfg.ModelDir); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("model directory %q: not found", cfg.ModelDir)
	}
	if err := CheckDType(cfg.DType); err != nil {
		return nil, err
	}
	if cfg.TPSize > 1 && cfg.Collective == nil {
		return nil, fmt.Errorf("--tp-size %d: a tensor-parallel rank needs its collective", cfg.TPSize)
	}
	mcfg, err := model.LoadConfig(cfg.ModelDir)
	if err != nil {
		return nil, err
	}
	e := &Engine{Config: cfg}
	if e.GenConfig, err = model.LoadGenerationConfig(cfg.ModelDir); err != nil {
		return nil, err
	}
	if e.TokConfig, err = tokenizer.LoadConfig(cfg.TokenizerDir); err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(cfg.TokenizerDir, "tokenizer.json")); err == nil {
		if e.Tokenizer, err = tokenizer.Load(cfg.TokenizerDir); err != nil {
			return nil, err
		}
	}
	e.EOS = eosIDs(mcfg, e.GenConfig, e.TokConfig, e.Tokenizer)
	dev, err := device.Open(cfg.Device, device.OpenOptions{Ordinal: cfg.GPU})
	if err != nil {
		return nil, err
	}
	e.Dev = dev
	if cfg.EnableDeterministicInference {
		if err := enableDeterministic(dev, cfg, mcfg); err != nil {
			dev.Close()
			return nil, err
		}
	}
	if cfg.TPSize > 1 {
		if e.comm, err = cfg.Collective(dev); err != nil {
			dev.Close()
			return nil, fmt.Errorf("tensor-parallel rank %d: %w", cfg.TPRank, err)
		}
	}
	if err := e.load(mcfg); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

func (e *Engine) load(mcfg *model.Config) error {
	cfg := e.Config
	opts := model.Options{ContextLen: cfg.ContextLength, CPUBackup: cfg.CPUBackup}
	if cfg.TPSize > 1 {
		opts.Shard, opts.Comm = model.Shard{Rank: cfg.TPRank, Size: cfg.TPSize}, e.comm
	}
	m, err := model.New(e.Dev, mcfg, opts)
	if err != nil {
		return err
	}
	switch cfg.LoadFormat {
	case "", "auto", "safetensors":
		err = loadCheckpoint(m, cfg.ModelDir)
	case "dummy":
		err = m.LoadDummy(1)
	default:
		err = fmt.Errorf("--load-format %q is not supported (auto, safetensors or dummy)", cfg.LoadFormat)
	}
	if err != nil {
		return err
	}
	e.Model = m
	limits := runner.Limits{
		MaxTokens: cfg.ChunkedPrefillSize + cfg.MaxRunningRequests, MaxSeqs: cfg.MaxRunningRequests,
		MaxLogitRows: max(cfg.MaxRunningRequests, 256), MaxTopK: cfg.MaxTopLogprobs,
	}
	slots, err := e.kvSlots(limits)
	if err != nil {
		return err
	}
	if slots, err = e.agreeSlots(slots); err != nil {
		return err
	}
	if err := m.AllocKV(slots); err != nil {
		return err
	}
	if e.Runner, err = runner.New(m, limits); err != nil {
		return err
	}
	if cfg.EnableReturnRoutedExperts {
		if err := e.Runner.EnableRoutedExperts(); err != nil {
			return fmt.Errorf("--enable-return-routed-experts: %w", err)
		}
	}
	if e.Dev.Name() != "cpu" { // every rank, in step: the warm-up runs the collectives
		if err := e.Runner.WarmUp(runner.WarmUpSizes(limits)); err != nil {
			return err
		}
	}
	// Every rank captures the same graphs in the same order, the
	// collectives inside included. The CPU backend's emulated graphs would
	// run the hub's exchanges at capture: its ranks decode eagerly.
	if cfg.DisableCUDAGraph || (cfg.TPSize > 1 && e.Dev.Name() == "cpu") {
		return nil
	}
	maxBS := cfg.CUDAGraphMaxBS
	if maxBS == 0 && e.Dev.DType() == device.BF16 {
		maxBS = 256
	}
	var sizes []int
	for _, b := range runner.DefaultGraphBatchSizes {
		if b <= maxBS {
			sizes = append(sizes, b)
		}
	}
	return e.Runner.CaptureGraphs(sizes)
}

// kvSlots sizes the KV cache: --max-total-tokens, else the GPU memory left
// under mem_fraction_static after the weights, else (CPU) a fixed budget.
func (e *Engine) kvSlots(limits runner.Limits) (int, error) {
	if e.Config.MaxTotalTokens > 0 {
		return e.Config.MaxTotalTokens, nil
	}
	mcfg := e.Model.Config // this rank's share of the KV heads
	perSlot := mcfg.KVBytesPerSlot(e.Dev.DType())
	if mi, ok := e.Dev.(device.MemoryInfo); ok {
		free, total, err := mi.DeviceMemory()
		if err != nil {
			return 0, err
		}
		weights := e.Dev.Memory().Region(memory.Weights).Stats().Reserved
		budget := int64(float64(total)*e.Config.MemFractionStatic) - weights
		// Leave the workspace and the CUDA graphs room outside the fraction.
		budget = min(budget, free-runner.WorkspaceBytes(e.Model, limits)-(1<<30))
		if budget < perSlot*int64(mcfg.MaxPositions/8+1) && budget < perSlot*4096 {
			return 0, fmt.Errorf("too little GPU memory for the KV cache (%d MiB); lower the context or raise --mem-fraction-static", budget>>20)
		}
		return int(budget / perSlot), nil
	}
	const cpuBudget = 1 << 30
	return int(min(cpuBudget/perSlot, int64(max(4*e.Model.ContextLen(), 65536)))), nil
}

// agreeSlots makes every tensor-parallel rank size its KV cache like the
// smallest one: the leader hands out slot indices for all of them, and
// free GPU memory differs a little between GPUs. Each rank writes its count
// into its own element of a vector the ranks add up.
func (e *Engine) agreeSlots(slots int) (int, error) {
	if _, ok := e.Dev.(device.MemoryInfo); !ok || e.comm == nil || e.Config.MaxTotalTokens > 0 {
		return slots, nil // computed the same way on every rank
	}
	n := e.Config.TPSize
	t, err := e.Dev.Alloc(memory.CUDAGraph, device.F32, n)
	if err != nil {
		return 0, err
	}
	defer e.Dev.Free(memory.CUDAGraph, t)
	v := make([]float32, n)
	v[e.Config.TPRank] = float32(slots) // exact: far below 2^24 slots
	if err := e.Dev.Upload(t, model.F32Bytes(v), device.F32); err != nil {
		return 0, err
	}
	e.comm.AllReduceSum(t)
	if err := errors.Join(e.comm.Err(), e.Dev.DownloadF32(t, v)); err != nil {
		return 0, fmt.Errorf("agreeing on the KV cache size: %w", err)
	}
	return int(slices.Min(v)), nil
}

func loadCheckpoint(m *model.Model, dir string) error {
	set, err := safetensors.OpenDir(dir)
	if err != nil {
		return err
	}
	defer set.Close()
	if err := m.LoadCheckpoint(set); err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	return nil
}

// eosIDs merges the end-of-sequence ids every config file names.
func eosIDs(m *model.Config, g *model.GenerationConfig, tc *tokenizer.Config, tok *tokenizer.Tokenizer) []int32 {
	ids := append(append([]int32(nil), m.EOSTokenIDs...), g.EOS...)
	if tok != nil && tc.EOSToken != "" {
		if id, ok := tok.TokenID(tc.EOSToken); ok {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}

// Defaults are the model's sampling defaults.
func (e *Engine) Defaults() *ioschema.GenerationDefaults { return &e.GenConfig.Defaults }

// Close leaves the tensor-parallel group and frees the device.
func (e *Engine) Close() error {
	if e.Dev == nil {
		return errors.New("engine is not open")
	}
	if c, ok := e.comm.(interface{ Close() }); ok {
		c.Close()
	}
	return e.Dev.Close()
}
