package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"syscall"
	"time"

	"ebb/cuda"
	"ebb/engine"
)

// RLCycleConfig is `ebb bench rl-cycle`.
type RLCycleConfig struct {
	Engine     engine.Config
	Cycles     int
	BatchSize  int
	InputLen   int
	OutputLen  int
	Executable string    // the ebb binary (default: this one)
	PlotPath   string    // PNG of memory over time; empty for none
	Progress   io.Writer // nil for none
}

// Phase is one NVML reading during the run.
type Phase struct {
	Seconds      float64 `json:"t_s"`
	Cycle        int     `json:"cycle"`
	Name         string  `json:"phase"`
	ServerMiB    float64 `json:"server_mib"`      // the scheduler process (NVML); with several GPUs, the largest rank's
	DeviceUsedMB float64 `json:"device_used_mib"` // the whole GPU (the first engine's leader's)
	// RankMiB are every engine's ranks' processes, each on its GPU: an
	// engine's leader, then its other tensor-parallel ranks.
	RankMiB []float64 `json:"rank_mib,omitempty"`
}

// CycleRecord is one rollout / train / resume cycle.
type CycleRecord struct {
	Cycle               int                `json:"cycle"`
	RolloutTokPerS      float64            `json:"rollout_output_tokens_per_s"`
	ProbeMatches        bool               `json:"probe_matches_first_cycle"`
	BeforeReleaseMiB    float64            `json:"server_before_release_mib"`
	AfterReleaseMiB     float64            `json:"server_after_release_mib"`
	ResidualMiB         float64            `json:"residual_over_bare_context_mib"`
	ReclaimPct          float64            `json:"reclaim_pct"`
	ReleaseMs           map[string]float64 `json:"release_ms"`
	ReleaseCallMs       float64            `json:"release_call_ms"`
	TrainerAllocatedMiB float64            `json:"trainer_allocated_mib"`
	TrainerFreeMiB      float64            `json:"trainer_driver_free_mib"`
	ResumeMs            map[string]float64 `json:"resume_ms"`
	ResumeWeightsCallMs float64            `json:"resume_weights_call_ms"`
	UpdateWeightsMs     float64            `json:"update_weights_ms"`
	ResumeRestCallMs    float64            `json:"resume_kv_graph_call_ms"`
	AfterResumeMiB      float64            `json:"server_after_resume_mib"`
	RegionReservedBytes int64              `json:"region_reserved_bytes"`
}

// RLCycleReport is the benchmark's result.
type RLCycleReport struct {
	Device         string             `json:"device"`
	BareContextMiB float64            `json:"bare_context_mib"`
	DeviceTotalMiB float64            `json:"device_total_mib"`
	Cycles         []CycleRecord      `json:"cycles"`
	Phases         []Phase            `json:"phases"`
	Summary        map[string]float64 `json:"summary"`
}

// RLCycle runs `ebb serve` and, per cycle: generates a rollout batch, checks
// a greedy probe against the first cycle, pauses, releases every tag, lets a
// separate process fill the freed memory, resumes the weights, updates them
// from disk, resumes kv_cache and cuda_graph and continues. NVML measures the
// scheduler process throughout.
func RLCycle(cfg RLCycleConfig) (*RLCycleReport, error) {
	if cfg.Executable == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		cfg.Executable = exe
	}
	cfg.Engine.Defaults()
	gpus := make([]int, cfg.Engine.TPSize*cfg.Engine.DPSize) // one trainer per GPU the engines use
	for i := range gpus {
		gpus[i] = cfg.Engine.GPU + i
	}
	trainerBase, err := runTrainers(cfg.Executable, gpus, nil)
	if err != nil {
		return nil, fmt.Errorf("trainer probe: %w", err)
	}
	rep := &RLCycleReport{BareContextMiB: mib(slices.MaxFunc(trainerBase, func(a, b *cuda.TrainerReport) int {
		return int(a.BareContextBytes - b.BareContextBytes)
	}).BareContextBytes), Summary: map[string]float64{}}
	srv, err := startServe(cfg.Executable, cfg.Engine, "--max-running-requests", strconv.Itoa(max(cfg.BatchSize, 8)),
		"--context-length", strconv.Itoa(max(cfg.Engine.ContextLength, cfg.InputLen+cfg.OutputLen+64)))
	if err != nil {
		return nil, err
	}
	defer srv.stop()
	info := map[string]any{}
	if err := srv.call("GET", "/server_info", nil, &info); err != nil {
		return nil, err
	}
	rep.Device, _ = info["device"].(string)
	start := time.Now()
	// /memory_stats has every rank's NVML reading of its own process.
	read := func(cycle int, name string) Phase {
		p := Phase{Seconds: time.Since(start).Seconds(), Cycle: cycle, Name: name}
		var st memoryStats
		if err := srv.call("GET", "/memory_stats", nil, &st); err == nil {
			ranks := st.ranks()
			p.DeviceUsedMB = mib(ranks[0].UsedBytes)
			rep.DeviceTotalMiB = mib(ranks[0].TotalBytes)
			for _, r := range ranks {
				p.RankMiB = append(p.RankMiB, mib(r.ProcessBytes))
			}
			p.ServerMiB = slices.Max(p.RankMiB)
			if len(p.RankMiB) == 1 {
				p.RankMiB = nil
			}
		}
		rep.Phases = append(rep.Phases, p)
		return p
	}
	rng := rand.New(rand.NewPCG(3, 4))
	vocab := int(info["vocab_size"].(float64)) - 1000
	randomIDs := func(n int) []int32 {
		ids := make([]int32, n)
		for i := range ids {
			ids[i] = int32(rng.IntN(vocab))
		}
		return ids
	}
	probe := [][]int32{randomIDs(64), randomIDs(17), randomIDs(100)}
	var probeRef [][]int32
	bar := newProgress(cfg.Progress, cfg.Cycles, "rl cycles")
	for c := 0; c < cfg.Cycles; c++ {
		rec := CycleRecord{Cycle: c, ReleaseMs: map[string]float64{}, ResumeMs: map[string]float64{}}
		rollout := make([][]int32, cfg.BatchSize)
		for i := range rollout {
			rollout[i] = randomIDs(cfg.InputLen)
		}
		t0 := time.Now()
		if _, err := srv.generate(rollout, cfg.OutputLen, 1.0); err != nil {
			return rep, fmt.Errorf("cycle %d rollout: %w", c, err)
		}
		rec.RolloutTokPerS = float64(cfg.BatchSize*cfg.OutputLen) / time.Since(t0).Seconds()
		// Probe prompts run one at a time: a batch's composition can vary
		// with arrival timing, and different GEMM shapes round differently,
		// which would flip greedy near-ties that say nothing about memory.
		var got [][]int32
		for _, p := range probe {
			out, err := srv.generate([][]int32{p}, 24, 0)
			if err != nil {
				return rep, fmt.Errorf("cycle %d probe: %w", c, err)
			}
			got = append(got, out...)
		}
		if probeRef == nil {
			probeRef = got
		}
		rec.ProbeMatches = equalIDs(got, probeRef)
		rec.BeforeReleaseMiB = read(c, "generating").ServerMiB
		if err := srv.control("/pause_generation", map[string]any{"mode": "retract"}, nil); err != nil {
			return rep, err
		}
		var rel struct {
			Tags []struct {
				Tag   string  `json:"tag"`
				Ms    float64 `json:"ms"`
				Bytes int64   `json:"bytes"`
			} `json:"tags"`
		}
		t0 = time.Now()
		if err := srv.control("/release_memory_occupation", map[string]any{}, &rel); err != nil {
			return rep, err
		}
		rec.ReleaseCallMs = ms(time.Since(t0))
		for _, t := range rel.Tags {
			rec.ReleaseMs[t.Tag] = t.Ms
		}
		rec.AfterReleaseMiB = read(c, "released").ServerMiB
		rec.ResidualMiB = rec.AfterReleaseMiB - rep.BareContextMiB
		rec.ReclaimPct = 100 * (rec.BeforeReleaseMiB - rec.AfterReleaseMiB) / (rec.BeforeReleaseMiB - rep.BareContextMiB)
		trs, err := runTrainers(cfg.Executable, gpus, func() { read(c, "trainer holds the GPU") })
		if err != nil {
			return rep, fmt.Errorf("cycle %d trainer: %w", c, err)
		}
		// The GPU where the trainer got least speaks for the group.
		tr := slices.MinFunc(trs, func(a, b *cuda.TrainerReport) int { return int(a.AllocatedBytes - b.AllocatedBytes) })
		rec.TrainerAllocatedMiB, rec.TrainerFreeMiB = mib(tr.AllocatedBytes), mib(tr.DriverFreeBefore)
		read(c, "trainer done")
		var res struct {
			Tags []struct {
				Tag string  `json:"tag"`
				Ms  float64 `json:"ms"`
			} `json:"tags"`
		}
		t0 = time.Now()
		if err := srv.control("/resume_memory_occupation", map[string]any{"tags": []string{"weights"}}, &res); err != nil {
			return rep, err
		}
		rec.ResumeWeightsCallMs = ms(time.Since(t0))
		for _, t := range res.Tags {
			rec.ResumeMs[t.Tag] = t.Ms
		}
		t0 = time.Now()
		if err := srv.control("/update_weights_from_disk", map[string]any{"model_path": cfg.Engine.ModelDir, "weight_version": fmt.Sprint("cycle-", c)}, nil); err != nil {
			return rep, err
		}
		rec.UpdateWeightsMs = ms(time.Since(t0))
		t0 = time.Now()
		res.Tags = nil
		if err := srv.control("/resume_memory_occupation", map[string]any{"tags": []string{"kv_cache", "cuda_graph"}}, &res); err != nil {
			return rep, err
		}
		rec.ResumeRestCallMs = ms(time.Since(t0))
		for _, t := range res.Tags {
			rec.ResumeMs[t.Tag] = t.Ms
		}
		if err := srv.control("/continue_generation", map[string]any{}, nil); err != nil {
			return rep, err
		}
		rec.AfterResumeMiB = read(c, "resumed").ServerMiB
		var stats memoryStats
		if err := srv.call("GET", "/memory_stats", nil, &stats); err != nil {
			return rep, err
		}
		rec.RegionReservedBytes = stats.reservedBytes()
		rep.Cycles = append(rep.Cycles, rec)
		bar.Add(1)
	}
	summarize(rep)
	if cfg.PlotPath != "" {
		if err := plotMemory(rep, cfg.PlotPath); err != nil {
			return rep, err
		}
	}
	return rep, nil
}

func mib(b int64) float64          { return float64(b) / (1 << 20) }
func ms(d time.Duration) float64   { return float64(d.Microseconds()) / 1000 }
func equalIDs(a, b [][]int32) bool { return slices.EqualFunc(a, b, slices.Equal[[]int32]) }

func medianOf(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	sort.Float64s(s)
	return s[len(s)/2]
}

func summarize(rep *RLCycleReport) {
	var residual, reclaim, relCall, resumeRest, update []float64
	perTag := map[string][]float64{}
	allMatch := 1.0
	for _, c := range rep.Cycles {
		residual = append(residual, c.ResidualMiB)
		reclaim = append(reclaim, c.ReclaimPct)
		relCall = append(relCall, c.ReleaseCallMs)
		resumeRest = append(resumeRest, c.ResumeRestCallMs)
		update = append(update, c.UpdateWeightsMs)
		for tag, v := range c.ReleaseMs {
			perTag["release_"+tag] = append(perTag["release_"+tag], v)
		}
		for tag, v := range c.ResumeMs {
			perTag["resume_"+tag] = append(perTag["resume_"+tag], v)
		}
		if !c.ProbeMatches {
			allMatch = 0
		}
	}
	s := rep.Summary
	s["residual_mib_max"] = slices.Max(residual)
	s["residual_mib_median"] = medianOf(residual)
	s["reclaim_pct_min"] = slices.Min(reclaim)
	s["release_call_ms_median"] = medianOf(relCall)
	s["resume_kv_graph_call_ms_median"] = medianOf(resumeRest)
	s["update_weights_ms_median"] = medianOf(update)
	for k, v := range perTag {
		s[k+"_ms_median"] = medianOf(v)
	}
	first, last := rep.Cycles[0], rep.Cycles[len(rep.Cycles)-1]
	s["drift_after_resume_mib"] = last.AfterResumeMiB - first.AfterResumeMiB
	s["drift_after_release_mib"] = last.AfterReleaseMiB - first.AfterReleaseMiB
	s["drift_region_reserved_bytes"] = float64(last.RegionReservedBytes - first.RegionReservedBytes)
	s["probe_matches_every_cycle"] = allMatch
	s["trainer_allocated_mib_min"] = slices.MinFunc(rep.Cycles, func(a, b CycleRecord) int {
		return int(a.TrainerAllocatedMiB - b.TrainerAllocatedMiB)
	}).TrainerAllocatedMiB
	s["device_total_mib"] = rep.DeviceTotalMiB
	s["bare_context_mib"] = rep.BareContextMiB
}

// memoryReading is the NVML part of a /memory_stats reply.
type memoryReading struct {
	ProcessBytes int64 `json:"nvml_process_bytes"`
	UsedBytes    int64 `json:"nvml_device_used_bytes"`
	TotalBytes   int64 `json:"nvml_device_total_bytes"`
}

// engineMemory is one engine's /memory_stats: its leader's reading and
// regions, and its other tensor-parallel ranks' readings.
type engineMemory struct {
	memoryReading
	Tags []struct {
		Reserved int64 `json:"reserved_bytes"`
	} `json:"tags"`
	TPRanks []memoryReading `json:"tp_ranks"`
}

// memoryStats is a /memory_stats reply: one engine's, or with
// data parallelism the first engine's and every engine's under engines.
type memoryStats struct {
	engineMemory
	Engines []engineMemory `json:"engines"`
}

func (s *memoryStats) engines() []engineMemory {
	if len(s.Engines) > 0 {
		return s.Engines
	}
	return []engineMemory{s.engineMemory}
}

// ranks are every process's readings: each engine's leader, then its
// other ranks.
func (s *memoryStats) ranks() []memoryReading {
	var out []memoryReading
	for _, e := range s.engines() {
		out = append(append(out, e.memoryReading), e.TPRanks...)
	}
	return out
}

// reservedBytes is what the engines' leaders have reserved for their
// regions.
func (s *memoryStats) reservedBytes() int64 {
	var n int64
	for _, e := range s.engines() {
		for _, t := range e.Tags {
			n += t.Reserved
		}
	}
	return n
}

// runTrainers runs `ebb __trainer` on each GPU, processes of their own that
// fill their GPU and report what they got; holding runs while all of them
// hold the memory.
func runTrainers(exe string, gpus []int, holding func()) ([]*cuda.TrainerReport, error) {
	type trainer struct {
		cmd   *exec.Cmd
		stdin io.WriteCloser
		line  []byte
	}
	var ts []*trainer
	defer func() {
		for _, t := range ts {
			t.stdin.Close()
			if t.cmd.ProcessState == nil {
				_ = t.cmd.Process.Kill()
				_ = t.cmd.Wait()
			}
		}
	}()
	for _, g := range gpus {
		t := &trainer{cmd: exec.Command(exe, "__trainer", "--gpu", strconv.Itoa(g))}
		t.cmd.Stderr = os.Stderr
		t.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		var err error
		if t.stdin, err = t.cmd.StdinPipe(); err != nil {
			return nil, err
		}
		stdout, err := t.cmd.StdoutPipe()
		if err != nil {
			return nil, err
		}
		if err := t.cmd.Start(); err != nil {
			return nil, err
		}
		ts = append(ts, t)
		if t.line, err = bufio.NewReader(stdout).ReadBytes('\n'); err != nil {
			return nil, fmt.Errorf("trainer on GPU %d: %w", g, err)
		}
	}
	if holding != nil {
		holding()
	}
	var out []*cuda.TrainerReport
	for i, t := range ts {
		t.stdin.Close() // the trainer frees its memory and exits
		if err := t.cmd.Wait(); err != nil {
			return nil, fmt.Errorf("trainer on GPU %d: %w", gpus[i], err)
		}
		var r cuda.TrainerReport
		if err := json.Unmarshal(t.line, &r); err != nil {
			return nil, fmt.Errorf("trainer output %q: %w", t.line, err)
		}
		out = append(out, &r)
	}
	return out, nil
}
