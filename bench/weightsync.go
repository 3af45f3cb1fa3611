package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"ebb/engine"
)

// WeightSyncConfig is `ebb bench weight-sync`.
type WeightSyncConfig struct {
	Engine engine.Config
	// Path is ipc (update_weights_from_tensor with CUDA tensors), shm (the
	// same with CPU tensors) or nccl (update_weights_from_distributed).
	Path string
	// NewWeights is the checkpoint the trainer sends (same shapes as the
	// served model); after the updates, greedy output must equal a fresh
	// server's on it. Default: the served model's own weights. With
	// Engine.LoadFormat dummy the trainer sends random weights shaped by
	// its config.json instead, and only the weights it probes are checked.
	NewWeights  string
	BucketsMB   []int
	Format      string // list or flattened
	Repeats     int    // updates per bucket size
	Trainer     string // the trainer stand-in command (tools/weight_update_trainer.py)
	TrainerEnv  []string
	Executable  string
	Progress    io.Writer
	MasterPort  int
	KillTrainer bool // nccl: also kill a trainer mid-broadcast and check the server's answer
}

// WeightSyncBucket is one bucket size's figures.
type WeightSyncBucket struct {
	BucketMB              int       `json:"bucket_mb"`
	Updates               int       `json:"updates"`
	Bytes                 int64     `json:"bytes"`
	MedianMs              float64   `json:"median_ms"`
	MinMs                 float64   `json:"min_ms"`
	GBPerS                float64   `json:"gb_per_s"`
	TrainerReservedFirst  int64     `json:"trainer_reserved_first_bytes,omitempty"`
	TrainerReservedLast   int64     `json:"trainer_reserved_last_bytes,omitempty"`
	ServerRegionsBefore   int64     `json:"server_region_reserved_before_bytes"`
	ServerRegionsAfter    int64     `json:"server_region_reserved_after_bytes"`
	ServerNVMLBeforeBytes int64     `json:"server_nvml_before_bytes"`
	ServerNVMLAfterBytes  int64     `json:"server_nvml_after_bytes"`
	UpdatesMs             []float64 `json:"updates_ms"`
}

// WeightSyncReport is the benchmark's result.
type WeightSyncReport struct {
	Path               string             `json:"path"`
	Format             string             `json:"format"`
	Buckets            []WeightSyncBucket `json:"buckets"`
	WeightsMatchSent   bool               `json:"weights_match_sent"` // the trainer's probe against /get_weights_by_name
	WeightsMismatch    string             `json:"weights_mismatch,omitempty"`
	OutputsMatchFresh  *bool              `json:"outputs_match_fresh_server,omitempty"` // nil: not checked (dummy weights)
	TrainerKilledReply string             `json:"trainer_killed_reply,omitempty"`
	ServerAfterKill    string             `json:"server_after_kill,omitempty"`
}

// WeightSync serves a model, lets the trainer stand-in push weights over
// the chosen path for each bucket size, and checks memory and outputs.
func WeightSync(cfg WeightSyncConfig) (*WeightSyncReport, error) {
	if cfg.Executable == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		cfg.Executable = exe
	}
	if cfg.NewWeights == "" {
		cfg.NewWeights = cfg.Engine.ModelDir
	}
	if cfg.Repeats <= 0 {
		cfg.Repeats = 10
	}
	if cfg.Path == "nccl" && os.Getenv("EBB_NCCL_LIBRARY") == "" {
		// NCCL ranks must run one version: serve with the trainer's.
		lib, err := trainerNCCL(cfg.Trainer)
		if err != nil {
			return nil, fmt.Errorf("finding the trainer's NCCL (set EBB_NCCL_LIBRARY): %w", err)
		}
		if err := os.Setenv("EBB_NCCL_LIBRARY", lib); err != nil {
			return nil, err
		}
	}
	srv, err := startServe(cfg.Executable, cfg.Engine)
	if err != nil {
		return nil, err
	}
	defer srv.stop()
	rep := &WeightSyncReport{Path: cfg.Path, Format: cfg.Format}
	bar := newProgress(cfg.Progress, len(cfg.BucketsMB), "weight-sync buckets")
	var probe map[string][]float64
	for i, mb := range cfg.BucketsMB {
		b := WeightSyncBucket{BucketMB: mb, Updates: cfg.Repeats}
		b.ServerRegionsBefore, b.ServerNVMLBeforeBytes, err = serverMemory(srv)
		if err != nil {
			return rep, err
		}
		tr, err := runWeightTrainer(cfg, srv.url, mb, cfg.MasterPort+i, false)
		if err != nil {
			return rep, err
		}
		probe = tr.Probe
		b.Bytes, b.UpdatesMs = tr.Bytes, tr.UpdatesMs
		sorted := slices.Clone(tr.UpdatesMs)
		slices.Sort(sorted)
		b.MedianMs, b.MinMs = sorted[len(sorted)/2], sorted[0]
		b.GBPerS = float64(b.Bytes) / (b.MedianMs / 1000) / 1e9
		if n := len(tr.TrainerReserved); n > 0 {
			b.TrainerReservedFirst, b.TrainerReservedLast = tr.TrainerReserved[0], tr.TrainerReserved[n-1]
		}
		if b.ServerRegionsAfter, b.ServerNVMLAfterBytes, err = serverMemory(srv); err != nil {
			return rep, err
		}
		rep.Buckets = append(rep.Buckets, b)
		bar.Add(1)
	}
	rep.WeightsMismatch = weightsMismatch(srv, probe)
	rep.WeightsMatchSent = rep.WeightsMismatch == ""
	if cfg.Engine.LoadFormat == "dummy" {
		return rep, nil // a fresh server would draw other weights
	}
	// The served model now holds NewWeights: compare with a fresh server.
	prompts := [][]int32{{11, 22, 33, 44, 55, 66, 77, 88}, {5, 4, 3, 2, 1}}
	got, err := greedyEach(srv, prompts)
	if err != nil {
		return rep, err
	}
	fresh := cfg.Engine
	fresh.ModelDir = cfg.NewWeights
	srv.stop()
	ref, err := startServe(cfg.Executable, fresh)
	if err != nil {
		return rep, err
	}
	want, err := greedyEach(ref, prompts)
	ref.stop()
	if err != nil {
		return rep, err
	}
	match := equalIDs(got, want)
	rep.OutputsMatchFresh = &match
	if cfg.KillTrainer && cfg.Path == "nccl" {
		if err := killTrainerMidway(cfg, rep); err != nil {
			return rep, err
		}
	}
	return rep, nil
}

// killTrainerMidway starts a server, lets a trainer die mid-broadcast and
// records what the server answered and whether it serves afterwards.
func killTrainerMidway(cfg WeightSyncConfig, rep *WeightSyncReport) error {
	srv, err := startServe(cfg.Executable, cfg.Engine)
	if err != nil {
		return err
	}
	defer srv.stop()
	_, err = runWeightTrainer(cfg, srv.url, cfg.BucketsMB[0], cfg.MasterPort+100, true)
	rep.TrainerKilledReply = fmt.Sprint(err)
	// The scheduler answers again once the broadcast it was in has failed.
	start := time.Now()
	var info map[string]any
	if err := srv.call("GET", "/server_info", nil, &info); err != nil {
		rep.ServerAfterKill = "server_info failed: " + err.Error()
		return nil
	}
	rep.ServerAfterKill = fmt.Sprintf("answered %.1f s after the trainer died; generation_blocked: %q",
		time.Since(start).Seconds(), info["generation_blocked"])
	return nil
}

func greedyEach(srv *serveProc, prompts [][]int32) ([][]int32, error) {
	var out [][]int32
	for _, p := range prompts {
		ids, err := srv.generate([][]int32{p}, 24, 0)
		if err != nil {
			return nil, err
		}
		out = append(out, ids...)
	}
	return out, nil
}

// serverMemory reads the server's region reservations and NVML figure.
func serverMemory(srv *serveProc) (regions, nvml int64, err error) {
	var st struct {
		Tags []struct {
			Reserved int64 `json:"reserved_bytes"`
		} `json:"tags"`
		NVML int64 `json:"nvml_process_bytes"`
	}
	if err := srv.call("GET", "/memory_stats", nil, &st); err != nil {
		return 0, 0, err
	}
	for _, t := range st.Tags {
		regions += t.Reserved
	}
	return regions, st.NVML, nil
}

type trainerReport struct {
	Bytes           int64                `json:"bytes"`
	UpdatesMs       []float64            `json:"updates_ms"`
	TrainerReserved []int64              `json:"trainer_reserved_bytes"`
	Probe           map[string][]float64 `json:"probe"` // a few tensors' first values, as sent
}

// weightsMismatch compares the values the trainer says it sent with what
// the server's /get_weights_by_name holds: "" when they are equal, else
// the first difference (a name the server cannot read counts as one).
func weightsMismatch(srv *serveProc, probe map[string][]float64) string {
	if len(probe) == 0 {
		return "the trainer reported no values to check"
	}
	for _, name := range slices.Sorted(maps.Keys(probe)) {
		sent := probe[name]
		var got []float64
		if err := srv.call("POST", "/get_weights_by_name", map[string]any{"name": name, "truncate_size": len(sent)}, &got); err != nil {
			return err.Error()
		}
		if len(got) != len(sent) {
			return fmt.Sprintf("%s: the server gave %d values for %d sent", name, len(got), len(sent))
		}
		for i := range sent {
			if float32(got[i]) != float32(sent[i]) {
				return fmt.Sprintf("%s[%d] = %v, sent %v", name, i, got[i], sent[i])
			}
		}
	}
	return ""
}

// trainerNCCL asks the trainer's Python where its PyTorch's NCCL library is
// (the nvidia-nccl wheel that PyTorch's CUDA builds load).
func trainerNCCL(trainer string) (string, error) {
	fields := strings.Fields(trainer)
	if len(fields) == 0 {
		return "", fmt.Errorf("no trainer command")
	}
	const probe = `import os, glob, torch, nvidia.nccl as n
print(sorted(glob.glob(os.path.join(list(n.__path__)[0], "lib", "libnccl.so*")))[0])`
	out, err := exec.Command(fields[0], "-c", probe).Output()
	if err != nil {
		return "", fmt.Errorf("%s: %w", fields[0], err)
	}
	return strings.TrimSpace(string(out)), nil
}

// runWeightTrainer runs the trainer stand-in for one bucket size.
func runWeightTrainer(cfg WeightSyncConfig, url string, mb, port int, kill bool) (*trainerReport, error) {
	fields := strings.Fields(cfg.Trainer)
	transport := cfg.Path
	args := append(fields[1:], "--url", url, "--model", cfg.NewWeights, "--transport", transport, "--format", cfg.Format,
		"--bucket-mb", strconv.Itoa(mb), "--repeat", strconv.Itoa(cfg.Repeats), "--master-port", strconv.Itoa(port))
	if cfg.Engine.LoadFormat == "dummy" {
		args = append(args, "--dummy")
	}
	if kill {
		// One tensor at a time, so that it can die between two of them.
		args = append(args, "--kill-after", "3", "--repeat", "1", "--format", "list")
	}
	cmd := exec.Command(fields[0], args...)
	cmd.Env = append(os.Environ(), cfg.TrainerEnv...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("trainer (%s): %v\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	var tr trainerReport
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &tr); err != nil {
		return nil, fmt.Errorf("trainer report %q: %w", lines[len(lines)-1], err)
	}
	return &tr, nil
}
