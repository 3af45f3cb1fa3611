package main

import (
	"github.com/spf13/pflag"

	"ebb/engine"
)

// addEngineFlags registers the model and memory flags shared by serve,
// generate and bench (SGLang's names).
func addEngineFlags(f *pflag.FlagSet, cfg *engine.Config) {
	f.StringVar(&cfg.ModelDir, "model", "", "Hugging Face model directory (config.json, *.safetensors, tokenizer.json)")
	f.StringVar(&cfg.Device, "device", "auto", "cpu, cuda or auto (cuda when a GPU is usable)")
	f.IntVar(&cfg.GPU, "gpu", 0, "GPU ordinal")
	f.IntVar(&cfg.ContextLength, "context-length", 0, "maximum tokens per sequence (default: the model's max_position_embeddings)")
	f.IntVar(&cfg.MaxTotalTokens, "max-total-tokens", 0, "KV cache size in tokens (default: from --mem-fraction-static)")
	f.Float64Var(&cfg.MemFractionStatic, "mem-fraction-static", 0.85, "share of GPU memory for weights and KV cache")
	f.BoolVar(&cfg.CPUBackup, "enable-weights-cpu-backup", false, "keep a pinned host copy of the weights so resume restores them")
	f.IntVar(&cfg.MaxRunningRequests, "max-running-requests", 0, "most requests decoding at once (default 256)")
	f.IntVar(&cfg.ChunkedPrefillSize, "chunked-prefill-size", 0, "most prompt tokens per step (default 8192)")
	f.BoolVar(&cfg.DisableCUDAGraph, "disable-cuda-graph", false, "run decode steps eagerly")
	f.IntVar(&cfg.CUDAGraphMaxBS, "cuda-graph-max-bs", 0, "largest decode batch captured as a CUDA graph (default 256 on a GPU)")
	_ = f.SetAnnotation("model", "cobra_annotation_bash_completion_one_required_flag", []string{"true"})
}
