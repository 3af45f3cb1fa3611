package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"ebb/bench"
	"ebb/cuda"
)

func benchCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "bench", Short: "Benchmarks: one-batch latency, offline throughput, serving, RL memory cycle"}
	cmd.AddCommand(oneBatchCmd(), rlCycleCmd(), weightSyncCmd(), attentionCmd(), matMulCmd(), moeCmd(), servingCmd())
	return cmd
}

func rlCycleCmd() *cobra.Command {
	var cfg bench.RLCycleConfig
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "rl-cycle --model DIR --cycles N",
		Short: "Rollout, release every tag, a trainer process fills the GPU, resume, update weights, continue; per cycle",
		RunE: func(*cobra.Command, []string) error {
			return printReport(asJSON, &cfg.Progress, func() (*bench.RLCycleReport, error) { return bench.RLCycle(cfg) }, printRLCycle)
		},
	}
	f := cmd.Flags()
	addEngineFlags(f, &cfg.Engine)
	f.IntVar(&cfg.Cycles, "cycles", 10, "cycles to run")
	f.IntVar(&cfg.BatchSize, "batch-size", 64, "rollout batch size")
	f.IntVar(&cfg.InputLen, "input-len", 128, "rollout prompt tokens")
	f.IntVar(&cfg.OutputLen, "output-len", 128, "rollout generated tokens")
	f.StringVar(&cfg.PlotPath, "plot", "", "write a PNG of memory over time here")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func trainerCmd() *cobra.Command {
	gpu := 0
	cmd := &cobra.Command{
		Use:    "__trainer",
		Hidden: true,
		Short:  "Stand in for a trainer: take all the GPU memory possible, write it, report JSON, wait for a line on stdin, free it",
		RunE: func(*cobra.Command, []string) error {
			_, err := cuda.FillAsTrainer(gpu, func(rep *cuda.TrainerReport) {
				_ = json.NewEncoder(os.Stdout).Encode(rep)
				// Hold the memory until the caller has measured it.
				_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
			})
			return err
		},
	}
	cmd.Flags().IntVar(&gpu, "gpu", 0, "GPU ordinal")
	return cmd
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, p := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("%q is not a positive integer", p)
		}
		out = append(out, v)
	}
	return out, nil
}

func oneBatchCmd() *cobra.Command {
	var cfg bench.OneBatchConfig
	var sizes string
	var asJSON, syncStdio bool
	cmd := &cobra.Command{
		Use:   "one-batch --model DIR --batch-size 1,8,64,256 --input-len 128 --output-len 128",
		Short: "Prefill latency, decode step latency and output tokens/s per batch size",
		RunE: func(*cobra.Command, []string) error {
			var err error
			if cfg.BatchSizes, err = parseInts(sizes); err != nil {
				return fmt.Errorf("--batch-size: %w", err)
			}
			if cfg.Log, err = newLogger("warn", "bench"); err != nil {
				return err
			}
			if syncStdio {
				cfg.BeforeBatch = waitForGo(bufio.NewReader(os.Stdin))
			}
			return printReport(asJSON, &cfg.Progress, func() ([]bench.OneBatchResult, error) { return bench.OneBatch(cfg) }, printOneBatch)
		},
	}
	f := cmd.Flags()
	addEngineFlags(f, &cfg.Engine)
	f.StringVar(&sizes, "batch-size", "1,8,64,256", "comma-separated batch sizes")
	f.IntVar(&cfg.InputLen, "input-len", 128, "prompt tokens per request")
	f.IntVar(&cfg.OutputLen, "output-len", 128, "generated tokens per request")
	f.Float64Var(&cfg.Temperature, "temperature", 0, "sample the outputs, each request with a seed of its own (0: greedy; "+
		"under --load-format dummy a greedy 16-token step of the 30B-A3B shape read about 8 experts' weights: its rows route alike)")
	f.IntVar(&cfg.TopK, "top-k", -1, "top_k of the sampled requests (-1: the whole vocabulary; Qwen3's default 20)")
	f.Float64Var(&cfg.TopP, "top-p", 1, "top_p of the sampled requests (Qwen3's default 0.95)")
	f.Float64Var(&cfg.MinP, "min-p", 0, "min_p of the sampled requests")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	f.IntVar(&cfg.ProfileStep, "profile-step", -1, "profile one step of the first batch size (0 prefill, k the k-th decode) for ncu --profile-from-start off")
	f.BoolVar(&syncStdio, "sync-stdio", false, "before each batch size write \"ready N\" on stdout and wait for \"go\" on stdin (one data-parallel engine of another one-batch)")
	_ = f.MarkHidden("sync-stdio")
	return cmd
}

// waitForGo is a data-parallel engine's BeforeBatch: it says it is ready
// for the batch size and waits until the parent says go.
func waitForGo(in *bufio.Reader) func(int) error {
	return func(b int) error {
		if _, err := fmt.Println(bench.SyncLine(b)); err != nil {
			return err
		}
		line, err := in.ReadString('\n')
		if strings.TrimSpace(line) != "go" {
			return fmt.Errorf("waiting for go before batch %d: got %q (%v)", b, line, err)
		}
		return nil
	}
}

func weightSyncCmd() *cobra.Command {
	var cfg bench.WeightSyncConfig
	var buckets string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "weight-sync --model DIR --path ipc|nccl [--new-weights DIR] [--bucket-mb 64,128,256,512]",
		Short: "Weights from a trainer process (tools/weight_update_trainer.py): ms and GB/s per update and bucket size",
		RunE: func(*cobra.Command, []string) error {
			var err error
			if cfg.BucketsMB, err = parseInts(buckets); err != nil {
				return fmt.Errorf("--bucket-mb: %w", err)
			}
			return printReport(asJSON, &cfg.Progress, func() (*bench.WeightSyncReport, error) { return bench.WeightSync(cfg) }, printWeightSync)
		},
	}
	f := cmd.Flags()
	addEngineFlags(f, &cfg.Engine)
	f.StringVar(&cfg.Path, "path", "ipc", "ipc (CUDA tensors), shm (CPU tensors) or nccl (broadcast from the trainer's GPU)")
	f.StringVar(&cfg.NewWeights, "new-weights", "", "checkpoint the trainer sends (default: the served model's)")
	f.StringVar(&buckets, "bucket-mb", "64,128,256,512", "bucket sizes in MiB")
	f.StringVar(&cfg.Format, "format", "flattened", "list or flattened (SGLang's flattened_bucket)")
	f.IntVar(&cfg.Repeats, "repeat", 10, "updates per bucket size")
	f.StringVar(&cfg.Trainer, "trainer", "python3 tools/weight_update_trainer.py", "the trainer stand-in")
	f.IntVar(&cfg.MasterPort, "master-port", 29555, "nccl: the trainer's TCPStore port (one per bucket size from here)")
	f.BoolVar(&cfg.KillTrainer, "kill-trainer", false, "nccl: also kill a trainer mid-broadcast and report the server's state")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func attentionCmd() *cobra.Command {
	var spec cuda.AttentionBenchSpec
	var batches, contexts, qlens string
	var gpu int
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "attention [--batch 1,64,256] [--context 4096] [--qlen 1]",
		Short: "Attention kernel alone on the GPU: microseconds, GB/s against the HBM peak, TFLOP/s for prefills",
		RunE: func(*cobra.Command, []string) error {
			bs, err := parseInts(batches)
			if err != nil {
				return fmt.Errorf("--batch: %w", err)
			}
			cs, err := parseInts(contexts)
			if err != nil {
				return fmt.Errorf("--context: %w", err)
			}
			qs, err := parseInts(qlens)
			if err != nil {
				return fmt.Errorf("--qlen: %w", err)
			}
			var specs []cuda.AttentionBenchSpec
			for _, q := range qs {
				for _, c := range cs {
					for _, b := range bs {
						s := spec
						s.Batch, s.Context, s.QLen = b, c, q
						specs = append(specs, s)
					}
				}
			}
			return kernelBench(gpu, asJSON, specs, cuda.BenchAttention, func(out []cuda.AttentionBenchResult) {
				fmt.Printf("%6s %10s %6s %-26s %10s %9s %8s %8s %14s %12s\n", "batch", "context", "qlen", "kernel", "median us", "GB/s", "% peak", "TFLOP/s", "+prepare_qkv", "fused prep")
				for _, r := range out {
					ctx := strconv.Itoa(r.Context)
					if r.MinContext > 0 && r.MinContext < r.Context {
						ctx = fmt.Sprintf("%d-%d", r.MinContext, r.Context)
					}
					prep, fused := "-", "-"
					if r.WithPrepareUs > 0 {
						prep = fmt.Sprintf("%.1f", r.WithPrepareUs)
					}
					if r.FusedUs > 0 {
						fused = fmt.Sprintf("%.1f", r.FusedUs)
					}
					fmt.Printf("%6d %10s %6d %-26s %10.1f %9.0f %8.1f %8.1f %14s %12s\n", r.Batch, ctx, r.QLen, r.Kernel, r.MedianUs, r.GBPerS, r.PeakPercent, r.TFLOPS, prep, fused)
				}
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&batches, "batch", "1,8,64,256", "comma-separated sequence counts")
	f.StringVar(&contexts, "context", "4096", "comma-separated context lengths (cached positions per sequence)")
	f.StringVar(&qlens, "qlen", "1", "comma-separated new queries per sequence (1: decode)")
	f.IntVar(&spec.MinContext, "min-context", 0, "spread the contexts evenly from this length up to --context, longest first as the scheduler orders decodes (0: all --context)")
	f.BoolVar(&spec.Shuffled, "shuffle", false, "with --min-context: contexts in a random order")
	f.StringVar(&spec.Layout, "layout", "contiguous", "KV slots of a sequence: contiguous, interleaved (one slot per sequence per step, as decoding allocates) or random")
	f.IntVar(&spec.QHeads, "q-heads", 16, "query heads (Qwen3-0.6B: 16)")
	f.IntVar(&spec.KVHeads, "kv-heads", 8, "kv heads (Qwen3-0.6B: 8)")
	f.IntVar(&spec.Dim, "head-dim", 128, "head size")
	f.IntVar(&spec.Iters, "iters", 50, "timed launches per shape")
	f.IntVar(&gpu, "gpu", 0, "GPU ordinal")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func matMulCmd() *cobra.Command {
	var spec cuda.MatMulBenchSpec
	var ms, shapes string
	var gpu int
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "matmul [--m 1,16,128] [--nk 4096x1024,1024x2048]",
		Short: "MatMul alone on the GPU, weights from HBM: microseconds, GB/s against the HBM peak, TFLOP/s",
		RunE: func(*cobra.Command, []string) error {
			rows, err := parseInts(ms)
			if err != nil {
				return fmt.Errorf("--m: %w", err)
			}
			var nks [][2]int
			for _, nk := range strings.Split(shapes, ",") {
				var n, k int
				if _, err := fmt.Sscanf(nk, "%dx%d", &n, &k); err != nil {
					return fmt.Errorf("--nk %q: want NxK", nk)
				}
				nks = append(nks, [2]int{n, k})
			}
			var specs []cuda.MatMulBenchSpec
			for _, nk := range nks {
				for _, m := range rows {
					s := spec
					s.M, s.N, s.K = m, nk[0], nk[1]
					specs = append(specs, s)
				}
			}
			return kernelBench(gpu, asJSON, specs, cuda.BenchMatMul, func(out []cuda.MatMulBenchResult) {
				fmt.Printf("%5s %7s %7s %-16s %10s %9s %8s %8s\n", "m", "n", "k", "kernel", "median us", "GB/s", "% peak", "TFLOP/s")
				for _, r := range out {
					fmt.Printf("%5d %7d %7d %-16s %10.2f %9.0f %8.1f %8.1f\n", r.M, r.N, r.K, r.Kernel, r.MedianUs, r.GBPerS, r.PeakPercent, r.TFLOPS)
					for _, c := range r.LtCandidates {
						fmt.Printf("      lt %2d: algo %d tile %d stages %d split-k %d cluster %d waves %.2f same bits %v: %.2f us\n",
							c.Index, c.AlgoID, c.TileID, c.StagesID, c.SplitK, c.Cluster, c.Waves, c.SameBits, c.MedianUs)
					}
				}
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&ms, "m", "1,4,8,16,32,64,128,256", "comma-separated row counts (the batch at decode)")
	f.StringVar(&shapes, "nk", "4096x1024,1024x2048,6144x1024,1024x3072", "comma-separated weight shapes NxK (default: Qwen3-0.6B's qkv, o, gate_up, down)")
	f.BoolVar(&spec.FromL2, "from-l2", false, "one copy of the weights, so that they come from L2 after the first launch")
	f.BoolVar(&spec.Candidates, "lt-candidates", false, "also time each of cuBLASLt's heuristic algorithms for the shape, and say which keep the product's bits")
	f.IntVar(&spec.Iters, "iters", 50, "timed graph replays per shape")
	f.IntVar(&gpu, "gpu", 0, "GPU ordinal")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func moeCmd() *cobra.Command {
	var spec cuda.MoEBenchSpec
	var tokens string
	var gpu int
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "moe [--tokens 1,16,64,256]",
		Short: "A mixture-of-experts layer's experts alone on the GPU (uniform routing): microseconds, GB/s of the touched experts against the HBM peak",
		RunE: func(*cobra.Command, []string) error {
			ts, err := parseInts(tokens)
			if err != nil {
				return fmt.Errorf("--tokens: %w", err)
			}
			var specs []cuda.MoEBenchSpec
			for _, t := range ts {
				s := spec
				s.Tokens = t
				specs = append(specs, s)
			}
			return kernelBench(gpu, asJSON, specs, cuda.BenchMoE, func(out []cuda.MoEBenchResult) {
				fmt.Printf("%7s %8s %-18s %10s %9s %8s %8s\n", "tokens", "experts", "path", "median us", "GB/s", "% peak", "TFLOP/s")
				for _, r := range out {
					fmt.Printf("%7d %8d %-18s %10.1f %9.0f %8.1f %8.1f\n", r.Tokens, r.Touched, r.Path, r.MedianUs, r.GBPerS, r.PeakPercent, r.TFLOPS)
				}
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&tokens, "tokens", "1,8,16,64,256,1024", "comma-separated token counts (the batch at decode)")
	f.IntVar(&spec.Experts, "experts", 128, "experts (Qwen3-30B-A3B: 128)")
	f.IntVar(&spec.TopK, "top-k", 8, "experts a token (Qwen3-30B-A3B: 8)")
	f.IntVar(&spec.Inter, "inter", 768, "an expert's intermediate size (Qwen3-30B-A3B: 768)")
	f.IntVar(&spec.Hidden, "hidden", 2048, "hidden size (Qwen3-30B-A3B: 2048)")
	f.IntVar(&spec.Iters, "iters", 30, "timed graph replays per shape")
	f.IntVar(&gpu, "gpu", 0, "GPU ordinal")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// kernelBench times each spec on GPU gpu and prints the results as JSON
// or through table.
func kernelBench[S, R any](gpu int, asJSON bool, specs []S, bench func(*cuda.Device, S) (R, error), table func([]R)) error {
	d, err := cuda.OpenDevice(gpu)
	if err != nil {
		return err
	}
	defer d.Close()
	out := make([]R, 0, len(specs))
	for _, s := range specs {
		r, err := bench(d, s)
		if err != nil {
			return err
		}
		out = append(out, r)
	}
	return emit(asJSON, out, table)
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

func printRLCycle(rep *bench.RLCycleReport) {
	fmt.Printf("%s, bare context %.0f MiB, device %.0f MiB\n", rep.Device, rep.BareContextMiB, rep.DeviceTotalMiB)
	fmt.Printf("%5s %10s %11s %9s %11s %12s %12s %12s %6s\n", "cycle", "residual", "reclaim %", "rel ms", "trainer MiB", "res kv+g ms", "update ms", "after MiB", "probe")
	for _, c := range rep.Cycles {
		fmt.Printf("%5d %10.1f %11.2f %9.1f %11.0f %12.2f %12.1f %12.0f %6v\n", c.Cycle, c.ResidualMiB, c.ReclaimPct,
			c.ReleaseCallMs, c.TrainerAllocatedMiB, c.ResumeRestCallMs, c.UpdateWeightsMs, c.AfterResumeMiB, c.ProbeMatches)
	}
	keys := make([]string, 0, len(rep.Summary))
	for k := range rep.Summary {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Printf("%-40s %.3f\n", k, rep.Summary[k])
	}
}

func printOneBatch(res []bench.OneBatchResult) {
	fmt.Printf("%6s %8s %12s %14s %14s %16s %14s  %s\n", "batch", "in/out", "prefill ms", "decode ms/step", "decode p90 ms", "decode tok/s", "output tok/s", "outputs")
	row := func(label string, r bench.OneBatchResult) {
		fmt.Printf("%6s %4d/%-4d %12.2f %14.3f %14.3f %16.0f %14.0f  %s\n", label, r.InputLen, r.OutputLen,
			r.PrefillMs, r.DecodeMedianMs, r.DecodeP90Ms, r.DecodeTokPerS, r.OutputTokPerS, r.OutputDigest)
	}
	for _, r := range res {
		row(strconv.Itoa(r.BatchSize), r)
		for i, e := range r.Engines {
			row(fmt.Sprintf("dp%d", i), e)
		}
	}
	if len(res) > 0 && len(res[0].Engines) > 0 {
		fmt.Printf("batch: per engine; a batch size's first row: all %d engines together (slowest times, total tokens/s)\n", len(res[0].Engines))
	}
}

func printWeightSync(rep *bench.WeightSyncReport) {
	fmt.Printf("path %s, format %s\n%10s %8s %10s %10s %10s %16s %16s\n", rep.Path, rep.Format, "bucket MiB", "updates",
		"median ms", "min ms", "GB/s", "ebb regions MiB", "trainer MiB")
	for _, b := range rep.Buckets {
		fmt.Printf("%10d %8d %10.2f %10.2f %10.1f %7.0f -> %6.0f %7.0f -> %6.0f\n", b.BucketMB, b.Updates, b.MedianMs, b.MinMs, b.GBPerS,
			float64(b.ServerRegionsBefore)/(1<<20), float64(b.ServerRegionsAfter)/(1<<20),
			float64(b.TrainerReservedFirst)/(1<<20), float64(b.TrainerReservedLast)/(1<<20))
	}
	fmt.Printf("weights read back equal those sent: %v %s\n", rep.WeightsMatchSent, rep.WeightsMismatch)
	if rep.OutputsMatchFresh != nil {
		fmt.Printf("outputs equal a fresh server on the new weights: %v\n", *rep.OutputsMatchFresh)
	} else {
		fmt.Println("outputs not compared with a fresh server: dummy weights")
	}
	if rep.TrainerKilledReply != "" {
		fmt.Printf("trainer killed mid-broadcast: %s\nserver: %s\n", firstLine(rep.TrainerKilledReply), rep.ServerAfterKill)
	}
}

// printReport runs a benchmark and prints its result: JSON with --json,
// otherwise progress on stderr while it runs and a table at the end.
func printReport[T any](asJSON bool, progress *io.Writer, run func() (T, error), table func(T)) error {
	if !asJSON {
		*progress = os.Stderr
	}
	res, err := run()
	if err != nil {
		return err
	}
	return emit(asJSON, res, table)
}

// emit prints v as indented JSON with --json, otherwise through table.
func emit[T any](asJSON bool, v T, table func(T)) error {
	if asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", " ")
		return enc.Encode(v)
	}
	table(v)
	return nil
}

func servingCmd() *cobra.Command {
	var cfg bench.ServingConfig
	var rate string
	var asJSON bool
	var topK int
	var topP, minP float64
	ignoreEOS := true
	var cmd *cobra.Command
	cmd = &cobra.Command{
		Use: "serving [--url URL | --model DIR] --dataset random --num-prompts 256",
		Short: "Requests through a server's /generate (any SGLang-compatible server, or an ebb serve it starts): " +
			"tok/s, TTFT, inter-token and end-to-end latency, fraction of the bandwidth floor",
		RunE: func(*cobra.Command, []string) error {
			if rate == "inf" {
				cfg.RequestRate = 0
			} else {
				v, err := strconv.ParseFloat(rate, 64)
				if err != nil || v <= 0 {
					return fmt.Errorf("--request-rate: %q is neither inf nor a positive number", rate)
				}
				cfg.RequestRate = v
			}
			if cfg.URL == "" && cfg.Engine.ModelDir == "" {
				return fmt.Errorf("give --url of a running server or --model for ebb to serve")
			}
			if cfg.URL != "" {
				cfg.ModelDir = cfg.Engine.ModelDir
			}
			cfg.PeakGPU = cfg.Engine.GPU
			f := cmd.Flags()
			cfg.TopK, cfg.TopP, cfg.MinP = ifSet(f, "top-k", &topK), ifSet(f, "top-p", &topP), ifSet(f, "min-p", &minP)
			cfg.StopAtEOS = !ignoreEOS
			cfg.Chaos.Seed = cfg.Workload.Seed
			for _, m := range cfg.Chaos.PauseModes {
				if m != "abort" && m != "retract" && m != "in_place" {
					return fmt.Errorf("--chaos-pause-modes: %q is not abort, retract or in_place", m)
				}
			}
			if !asJSON {
				cfg.Progress = os.Stderr
			}
			rep, err := bench.Serving(cfg)
			if rep != nil && (err == nil || cfg.Check) {
				// A failed check prints the report that shows it, then fails.
				if perr := emit(asJSON, rep, printServing); perr != nil {
					return perr
				}
			}
			return err
		},
	}
	f := cmd.Flags()
	addEngineFlags(f, &cfg.Engine)
	w := &cfg.Workload
	f.StringVar(&cfg.URL, "url", "", "a running server (SGLang or ebb); without it ebb serves --model")
	f.StringVar(&w.Kind, "dataset", "random", "fixed (--input-len/--output-len), random (length ranges) or sharegpt (generated ShareGPT-like lengths)")
	f.StringVar(&w.OutputDist, "output-dist", "uniform", "random: output lengths uniform, or lognormal (a reasoning model's long tail, median at the geometric mean of the bounds)")
	f.IntVar(&w.GroupSize, "group-size", 1, "samples of each prompt (a GRPO group), each its own request with its own length")
	f.BoolVar(&w.GroupAsN, "group-as-n", false, "ask for a prompt's samples in one request with sampling_params.n (one length for the group)")
	f.IntVar(&w.NumPrompts, "num-prompts", 256, "requests")
	f.IntVar(&w.InputLen, "input-len", 1024, "fixed: prompt tokens")
	f.IntVar(&w.OutputLen, "output-len", 1024, "fixed: output tokens")
	f.IntVar(&w.MinInput, "min-input-len", 100, "random: shortest prompt")
	f.IntVar(&w.MaxInput, "max-input-len", 1024, "random: longest prompt")
	f.IntVar(&w.MinOutput, "min-output-len", 100, "random: shortest output")
	f.IntVar(&w.MaxOutput, "max-output-len", 1024, "random: longest output")
	f.Uint64Var(&w.Seed, "seed", 0, "seed of the lengths, tokens and arrivals")
	f.StringVar(&rate, "request-rate", "inf", "requests per second (Poisson arrivals), or inf to send all at once")
	f.IntVar(&cfg.MaxInFlight, "max-concurrency", 0, "most requests in flight (0: no limit)")
	f.Float64Var(&cfg.Temperature, "temperature", 0, "sampling temperature")
	f.IntVar(&topK, "top-k", -1, "top_k to send (unset: the model's generation_config default, as for clients that leave it out)")
	f.Float64Var(&topP, "top-p", 1, "top_p to send (unset: the model's default)")
	f.Float64Var(&minP, "min-p", 0, "min_p to send (unset: the model's default)")
	f.BoolVar(&ignoreEOS, "ignore-eos", true, "run every request to its output length; false lets requests stop at EOS (and the scheduler cannot count on their lengths)")
	f.DurationVar(&cfg.Duration, "duration", 0, "soak: keep sending new draws of the workload, --max-concurrency (default: the workload's size) in flight, for this long (e.g. 10m)")
	f.BoolVar(&cfg.Check, "check", false, "fail on any failed request (an error, an abort, an output short of its length) or chaos action and, once the server is idle, on KV still held, a broken invariant or GPU memory grown")
	f.DurationVar(&cfg.Chaos.Interval, "chaos", 0, "while the workload runs, send an RL control request about this often (pause/continue, release/resume, flush_cache, health_generate, and update_weights_from_disk, waiting for the running requests or paused in place without a flush, where the server loaded a checkpoint), each checked")
	f.StringSliceVar(&cfg.Chaos.PauseModes, "chaos-pause-modes", []string{"retract", "in_place"}, "the pause_generation modes the chaos uses; with abort, aborted requests are counted, not failed")
	f.BoolVar(&cfg.Stream, "stream", true, "stream the outputs (needed for TTFT and inter-token latency)")
	f.StringVar(&cfg.APIKey, "server-api-key", "", "bearer token for a server started with --api-key")
	f.BoolVar(&cfg.FlushCache, "flush-cache", false, "empty the server's radix cache first (a repeated workload otherwise finds its prompts cached)")
	f.Float64Var(&cfg.PeakGBPerS, "peak-gbps", 0, "GPU peak memory bandwidth in GB/s (default: from NVML)")
	f.StringVar(&cfg.PlotPath, "plot", "", "write a PNG of throughput over time and latency distributions here")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printServing(r *bench.ServingReport) {
	fmt.Printf("server %s, %s workload, %d completions (%d failed), temperature %g, stream %v\n", r.Server, r.Workload.Kind,
		r.Completed+r.Failed, r.Failed, r.Temperature, r.Stream)
	if r.FirstError != "" {
		fmt.Printf("first error: %s\n", r.FirstError)
	}
	if r.Aborted > 0 {
		fmt.Printf("%d completions were ended early by the chaos's pauses of mode abort\n", r.Aborted)
	}
	if c := r.Chaos; c != nil {
		var acts []string
		for _, name := range slices.Sorted(maps.Keys(c.Actions)) {
			acts = append(acts, fmt.Sprintf("%s %d", name, c.Actions[name]))
		}
		fmt.Printf("chaos: %s; %d failed\n", strings.Join(acts, ", "), c.Failed)
		if c.FirstError != "" {
			fmt.Printf("chaos first error: %s\n", c.FirstError)
		}
	}
	if r.Retracted > 0 || r.Recomputed > 0 {
		fmt.Printf("the server retracted %d requests to make room in its KV cache and computed %d tokens again\n", r.Retracted, r.Recomputed)
	}
	fmt.Printf("duration %.2f s, input %d tokens, output %d tokens\n", r.DurationS, r.InputTokens, r.OutputTokens)
	if r.CachedTokens > 0 {
		fmt.Printf("%d of the input tokens (%.1f %%) were found in the server's radix cache, so their prefill was skipped (--flush-cache empties it first)\n",
			r.CachedTokens, 100*float64(r.CachedTokens)/float64(r.InputTokens))
	}
	fmt.Printf("throughput: %.2f req/s, %.0f output tok/s, %.0f total tok/s\n", r.RequestPerS, r.OutputTokPerS, r.TotalTokPerS)
	fmt.Printf("%-12s %10s %10s %10s %10s\n", "ms", "mean", "p50", "p90", "p99")
	for _, p := range []struct {
		name string
		v    bench.Percentiles
	}{{"TTFT", r.TTFTMs}, {"inter-token", r.ITLMs}, {"end-to-end", r.E2EMs}} {
		fmt.Printf("%-12s %10.2f %10.2f %10.2f %10.2f\n", p.name, p.v.Mean, p.v.P50, p.v.P90, p.v.P99)
	}
	if r.FloorTokPerS > 0 {
		gpus := ""
		if r.GPUs > 1 {
			gpus = fmt.Sprintf(" on %d GPUs", r.GPUs)
		}
		fmt.Printf("bandwidth floor %.0f output tok/s (KV %.2f TB + weights %.2f TB at %.0f GB/s%s): %.1f %% of it\n",
			r.FloorTokPerS, r.KVReadBytes/1e12, r.WeightReadBytes/1e12, r.PeakGBPerS, gpus, 100*r.FractionOfFloor)
	}
	if len(r.Checks) > 0 {
		fmt.Printf("checks: %s\n", strings.Join(r.Checks, "; "))
	}
}
