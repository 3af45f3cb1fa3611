package main

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"ebb/engine"
	"ebb/scheduler"
)

// addEngineFlags registers the model and memory flags shared by serve,
// generate and bench, under SGLang's names (sglang.launch_server's).
func addEngineFlags(f *pflag.FlagSet, cfg *engine.Config) {
	f.StringVar(&cfg.ModelDir, "model-path", "", "Hugging Face model directory (config.json, *.safetensors, tokenizer.json)")
	f.StringVar(&cfg.ModelDir, "model", "", "same as --model-path")
	f.StringVar(&cfg.TokenizerDir, "tokenizer-path", "", "directory of tokenizer.json and tokenizer_config.json (default: the model's)")
	f.StringVar(&cfg.Device, "device", "auto", "cpu, cuda or auto (cuda when a GPU is usable)")
	f.IntVar(&cfg.GPU, "base-gpu-id", 0, "the first GPU to use")
	f.IntVar(&cfg.GPU, "gpu", 0, "same as --base-gpu-id")
	_ = f.MarkHidden("gpu")
	f.IntVar(&cfg.TPSize, "tp-size", 1, "tensor-parallel ranks per engine, one GPU each (NCCL), or processes on the CPU backend")
	f.IntVar(&cfg.DPSize, "dp-size", 1, "data-parallel engines, one GPU each from --base-gpu-id, behind one HTTP/ZMQ front")
	// SGLang's aliases (server_args.py), and the abbreviations its argparse
	// accepts and its docs use.
	f.IntVar(&cfg.TPSize, "tensor-parallel-size", 1, "same as --tp-size")
	f.IntVar(&cfg.TPSize, "tp", 1, "same as --tp-size")
	f.IntVar(&cfg.DPSize, "data-parallel-size", 1, "same as --dp-size")
	f.IntVar(&cfg.DPSize, "dp", 1, "same as --dp-size")
	f.StringVar(&cfg.DType, "dtype", "auto", "auto or bfloat16 (ebb runs bf16 on the GPU, float32 on the CPU)")
	f.Var(&seedFlag{&cfg.RandomSeed}, "random-seed", "seed for the sampling of requests without a sampling_seed")
	f.IntVar(&cfg.ContextLength, "context-length", 0, "maximum tokens per sequence (default: the model's max_position_embeddings)")
	f.IntVar(&cfg.MaxTotalTokens, "max-total-tokens", 0, "KV cache size in tokens (default: from --mem-fraction-static)")
	f.Float64Var(&cfg.MemFractionStatic, "mem-fraction-static", 0.85, "share of GPU memory for weights and KV cache")
	f.BoolVar(&cfg.CPUBackup, "enable-weights-cpu-backup", false, "keep a pinned host copy of the weights so resume restores them")
	f.IntVar(&cfg.MaxRunningRequests, "max-running-requests", 0, "most requests decoding at once (default 256)")
	f.IntVar(&cfg.ChunkedPrefillSize, "chunked-prefill-size", 0, "most prompt tokens per step (default 8192)")
	f.BoolVar(&cfg.DisableRadixCache, "disable-radix-cache", false, "do not share the KV of common prefixes between requests")
	f.BoolVar(&cfg.DisableOverlap, "disable-overlap-schedule", false, "build each step only after the last one's results are back")
	f.BoolVar(&cfg.EnableMixedChunk, "enable-mixed-chunk", false, "run the decodes in the steps that prefill (by default they wait for the prompt tokens)")
	f.BoolVar(&cfg.EnableDeterministicInference, "enable-deterministic-inference", false, "batch-invariant kernels: a request's tokens and logprobs are the same bits "+
		"whatever it is batched with, and a token's decode logprob equals its prefill logprob")
	f.BoolVar(&cfg.EnableReturnRoutedExperts, "enable-return-routed-experts", false, "record the experts each token of a mixture-of-experts model is routed to, "+
		"returned to requests with return_routed_experts (routing replay)")
	f.StringVar(&cfg.LoadFormat, "load-format", "auto", "auto (the model's safetensors) or dummy (random weights from config.json alone, for benchmarks)")
	f.Float64Var(&cfg.ScheduleConservativeness, "schedule-conservativeness", 1, "scale of the output that requests which may stop early are expected to need at admission "+
		"(requests with ignore_eos and no stop tokens or strings are expected to run to max_new_tokens)")
	cfg.SchedulePolicy = string(scheduler.PolicyFCFS)
	f.Var(&policyFlag{&cfg.SchedulePolicy}, "schedule-policy", "order of the waiting requests: fcfs (as they came), lpm (longest cached prefix first), "+
		"dfs-weight (requests sharing a cached prefix together), lof (longest max_new_tokens first) or random")
	f.BoolVar(&cfg.DisableCUDAGraph, "disable-cuda-graph", false, "run decode steps eagerly")
	f.IntVar(&cfg.CUDAGraphMaxBS, "cuda-graph-max-bs", 0, "largest decode batch captured as a CUDA graph (default 256 on a GPU)")
	f.IntVar(&cfg.DecodeLogInterval, "decode-log-interval", 40, "decode steps per \"Decode batch\" log line (with the output tok/s over them)")
	f.Var(&secondsFlag{&cfg.DistTimeout}, "dist-timeout", "seconds to wait on a trainer's process group (NCCL weight updates; default 600)")
	f.Var(&secondsFlag{&cfg.WatchdogTimeout}, "watchdog-timeout", "seconds a step may run before its scheduler process stops, and with it the server (a hung GPU or rank; default 300)")
}

// secondsFlag is a duration given in seconds, as SGLang's --dist-timeout.
type secondsFlag struct{ d *time.Duration }

func (s *secondsFlag) String() string {
	if s.d == nil || *s.d == 0 {
		return ""
	}
	return strconv.FormatFloat(s.d.Seconds(), 'f', -1, 64)
}

func (s *secondsFlag) Set(v string) error {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f <= 0 {
		return fmt.Errorf("%q is not a positive number of seconds", v)
	}
	*s.d = time.Duration(f * float64(time.Second))
	return nil
}

func (s *secondsFlag) Type() string { return "seconds" }

// policyFlag is a --schedule-policy, refused at parse time when unknown.
type policyFlag struct{ p *string }

func (f *policyFlag) String() string {
	if f.p == nil {
		return ""
	}
	return *f.p
}

func (f *policyFlag) Set(v string) error {
	p, err := scheduler.ParseSchedulePolicy(v)
	if err != nil {
		return err
	}
	*f.p = string(p)
	return nil
}

func (f *policyFlag) Type() string { return "policy" }

// seedFlag is an optional uint64: unset leaves the pointer nil.
type seedFlag struct{ p **uint64 }

func (s *seedFlag) String() string {
	if s.p == nil || *s.p == nil {
		return ""
	}
	return strconv.FormatUint(**s.p, 10)
}

func (s *seedFlag) Set(v string) error {
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return fmt.Errorf("%q is not a non-negative integer", v)
	}
	*s.p = &n
	return nil
}

func (s *seedFlag) Type() string { return "uint" }

// addServerFlags registers the flags of sglang.launch_server that concern
// the server rather than the engine. --enable-memory-saver and
// --trust-remote-code are accepted for compatibility: every ebb region can
// be released (no saver to enable), and ebb runs no model code from the
// model directory.
func addServerFlags(f *pflag.FlagSet, s *serverFlags) {
	f.StringVar(&s.apiKey, "api-key", "", "require this key: HTTP `Authorization: Bearer KEY` (not on /health*, /metrics) and \"api_key\" on the external ZMQ socket")
	f.BoolVar(&s.skipWarmup, "skip-server-warmup", false, "serve without the warm-up generation at start")
	f.BoolVar(&s.enableMetrics, "enable-metrics", false, "accepted: /metrics is always served")
	f.BoolVar(&s.memorySaver, "enable-memory-saver", false, "accepted: ebb's memory is always releasable by tag")
	f.BoolVar(&s.trustRemoteCode, "trust-remote-code", false, "accepted: ebb runs no code from the model directory")
	f.BoolVar(&s.allowAutoTruncate, "allow-auto-truncate", false,
		"clip a prompt longer than the context (keeping its start) and max_new_tokens to what is left, instead of answering 400")
	f.BoolVar(&s.incrementalStreaming, "incremental-streaming-output", false,
		"streamed /generate and ZMQ chunks carry only the new text, output ids and output logprobs (default: all of the output so far)")
	f.Int64Var(&s.maxRequestBodyMB, "max-request-body-mb", 0,
		"refuse generate requests whose body is larger (413); default: 1 KiB a token of context, at least 16")
	f.StringVar(&s.reasoningParser, "reasoning-parser", "",
		"qwen3, qwen3-thinking or deepseek-r1: chat replies carry their <think> reasoning in reasoning_content")
	f.StringVar(&s.toolCallParser, "tool-call-parser", "",
		"qwen25, qwen, hermes (<tool_call> blocks) or llama3 (JSON): how chat replies' tool calls are read (default: from the chat template)")
}

type serverFlags struct {
	apiKey, reasoningParser, toolCallParser                                    string
	skipWarmup, enableMetrics, memorySaver, trustRemoteCode, allowAutoTruncate bool
	incrementalStreaming                                                       bool
	maxRequestBodyMB                                                           int64
}

// unknownFlagHelp turns pflag's "unknown flag" into an error that names the
// flag and says which SGLang flags ebb takes.
func unknownFlagHelp(cmd *cobra.Command, err error) error {
	if !strings.Contains(err.Error(), "unknown flag") && !strings.Contains(err.Error(), "unknown shorthand") {
		return err
	}
	var names []string
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if !f.Hidden && f.Name != "help" {
			names = append(names, "--"+f.Name)
		}
	})
	return fmt.Errorf("%w: ebb %s does not take it (it takes %s)", err, cmd.Name(), strings.Join(names, " "))
}

// ifSet is v where the flag name was given, nil (the server's or the
// model's default) where it was not.
func ifSet[T any](f *pflag.FlagSet, name string, v *T) *T {
	if f.Changed(name) {
		return v
	}
	return nil
}
