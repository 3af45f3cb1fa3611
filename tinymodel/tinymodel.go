// Package tinymodel writes small deterministic random-weight model
// directories (config, safetensors, real tokenizer files) that transformers
// can load: the default model of `make run` and the subject of the goldens.
package tinymodel

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"

	"ebb/assets"
	"ebb/safetensors"
)

// Spec describes a tiny model.
type Spec struct {
	Arch          string  `json:"arch"` // qwen3, qwen3_moe, qwen2, qwen2_moe, llama
	Hidden        int     `json:"hidden"`
	Intermediate  int     `json:"intermediate"`
	Layers        int     `json:"layers"`
	Heads         int     `json:"heads"`
	KVHeads       int     `json:"kv_heads"`
	HeadDim       int     `json:"head_dim"`
	Tie           bool    `json:"tie"`
	AttentionBias bool    `json:"attention_bias"` // qwen3/llama; qwen2 always has q/k/v bias
	Rope          string  `json:"rope"`           // "", "linear", "llama3"
	RopeTheta     float64 `json:"rope_theta"`
	MaxPositions  int     `json:"max_positions"`
	DType         string  `json:"dtype"` // BF16 or F32
	Seed          uint64  `json:"seed"`
	// Vocab overrides the tokenizer's vocabulary size (0: keep it); a
	// smaller one makes a fast model that takes input_ids only.
	Vocab int `json:"vocab,omitempty"`
	// Mixture of experts (qwen3_moe, qwen2_moe): layers are sparse as
	// decoder_sparse_step and mlp_only_layers say; dense ones use
	// Intermediate. qwen2_moe adds a shared expert of SharedIntermediate.
	Experts            int   `json:"experts,omitempty"`
	ExpertsPerToken    int   `json:"experts_per_token,omitempty"`
	MoEIntermediate    int   `json:"moe_intermediate,omitempty"`
	SharedIntermediate int   `json:"shared_expert_intermediate,omitempty"`
	NormTopK           bool  `json:"norm_topk_prob,omitempty"`
	SparseStep         int   `json:"decoder_sparse_step,omitempty"`
	MLPOnly            []int `json:"mlp_only_layers,omitempty"`
}

// moe reports whether the spec is a mixture of experts.
func (s Spec) moe() bool { return s.Arch == "qwen3_moe" || s.Arch == "qwen2_moe" }

// sparse reports whether layer i has experts (transformers' rule).
func (s Spec) sparse(i int) bool {
	if !s.moe() {
		return false
	}
	for _, l := range s.MLPOnly {
		if l == i {
			return false
		}
	}
	return (i+1)%s.SparseStep == 0
}

// FromJSON overlays a JSON spec (any subset of fields, "arch" required) on
// the architecture's defaults.
func FromJSON(data []byte) (Spec, error) {
	var head struct {
		Arch string `json:"arch"`
	}
	if err := json.Unmarshal(data, &head); err != nil {
		return Spec{}, fmt.Errorf("tiny-model spec: %w", err)
	}
	s, err := Default(head.Arch)
	if err != nil {
		return Spec{}, err
	}
	if err := json.Unmarshal(data, &s); err != nil {
		return Spec{}, fmt.Errorf("tiny-model spec: %w", err)
	}
	return s, nil
}

// Default returns the spec ebb uses for an architecture.
func Default(arch string) (Spec, error) {
	s := Spec{Arch: arch, Hidden: 64, Intermediate: 192, Layers: 2, Heads: 4, KVHeads: 2,
		RopeTheta: 1000000, MaxPositions: 4096, DType: "BF16", Seed: 1}
	switch arch {
	case "qwen3":
		s.HeadDim, s.Tie = 32, true // head_dim differs from hidden/heads, as in Qwen3
	case "qwen3_moe":
		s.HeadDim = 32
		s.Experts, s.ExpertsPerToken, s.MoEIntermediate, s.NormTopK, s.SparseStep = 8, 2, 48, true, 1
	case "qwen2":
		s.HeadDim = 16
	case "qwen2_moe":
		s.HeadDim = 16
		s.Experts, s.ExpertsPerToken, s.MoEIntermediate, s.SharedIntermediate, s.SparseStep = 8, 2, 48, 96, 1
	case "llama":
		s.HeadDim, s.Rope, s.RopeTheta = 16, "llama3", 500000
	default:
		return Spec{}, fmt.Errorf("unknown tiny-model arch %q (qwen3, qwen3_moe, qwen2, qwen2_moe, llama)", arch)
	}
	return s, nil
}

type family struct {
	arch, modelType, tokenizer string
	vocab                      int
	bos                        *int
	eos                        int
	genEOS                     []int
}

func familyOf(arch string) (family, error) {
	bos := 128000
	switch arch {
	case "qwen3":
		return family{"Qwen3ForCausalLM", "qwen3", "qwen3", 151936, nil, 151645, []int{151645, 151643}}, nil
	case "qwen3_moe":
		return family{"Qwen3MoeForCausalLM", "qwen3_moe", "qwen3", 151936, nil, 151645, []int{151645, 151643}}, nil
	case "qwen2":
		return family{"Qwen2ForCausalLM", "qwen2", "qwen3", 151936, nil, 151645, []int{151645, 151643}}, nil
	case "qwen2_moe":
		return family{"Qwen2MoeForCausalLM", "qwen2_moe", "qwen3", 151936, nil, 151645, []int{151645, 151643}}, nil
	case "llama":
		return family{"LlamaForCausalLM", "llama", "llama3", 128256, &bos, 128009, []int{128001, 128009}}, nil
	}
	return family{}, fmt.Errorf("unknown tiny-model arch %q", arch)
}

// Write creates dir with config.json, generation_config.json,
// model.safetensors, tokenizer.json and tokenizer_config.json.
func Write(dir string, s Spec) error {
	f, err := familyOf(s.Arch)
	if err != nil {
		return err
	}
	if s.Heads%s.KVHeads != 0 || s.HeadDim%2 != 0 {
		return fmt.Errorf("tiny model: kv_heads must divide heads and head_dim must be even")
	}
	if s.moe() && (s.Experts <= 0 || s.ExpertsPerToken <= 0 || s.ExpertsPerToken > s.Experts ||
		s.MoEIntermediate <= 0 || s.SparseStep <= 0) {
		return fmt.Errorf("tiny model: %s needs experts >= experts_per_token > 0, moe_intermediate and decoder_sparse_step > 0", s.Arch)
	}
	if s.Arch == "qwen2_moe" && s.SharedIntermediate <= 0 {
		return fmt.Errorf("tiny model: qwen2_moe needs shared_expert_intermediate > 0")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if s.Vocab > 0 {
		f.vocab = s.Vocab
	}
	if err := writeJSON(filepath.Join(dir, "config.json"), configJSON(s, f)); err != nil {
		return err
	}
	gen := map[string]any{"bos_token_id": f.bos, "eos_token_id": f.genEOS, "do_sample": true,
		"temperature": 0.6, "top_p": 0.95, "top_k": 20, "transformers_version": "4.51.0"}
	if err := writeJSON(filepath.Join(dir, "generation_config.json"), gen); err != nil {
		return err
	}
	tok, err := assets.TokenizerJSON(f.tokenizer)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), tok, 0o644); err != nil {
		return err
	}
	tc, err := assets.TokenizerConfig(f.tokenizer)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), tc, 0o644); err != nil {
		return err
	}
	tensors, err := weights(s, f)
	if err != nil {
		return err
	}
	return safetensors.Write(filepath.Join(dir, "model.safetensors"), tensors, map[string]string{"format": "pt"})
}

func configJSON(s Spec, f family) map[string]any {
	c := map[string]any{
		"architectures": []string{f.arch}, "model_type": f.modelType,
		"hidden_size": s.Hidden, "intermediate_size": s.Intermediate, "num_hidden_layers": s.Layers,
		"num_attention_heads": s.Heads, "num_key_value_heads": s.KVHeads, "head_dim": s.HeadDim,
		"vocab_size": f.vocab, "max_position_embeddings": s.MaxPositions, "rms_norm_eps": 1e-6,
		"rope_theta": s.RopeTheta, "hidden_act": "silu", "tie_word_embeddings": s.Tie,
		"torch_dtype":  map[string]string{"BF16": "bfloat16", "F32": "float32"}[s.DType],
		"bos_token_id": f.bos, "eos_token_id": f.eos, "initializer_range": 0.02,
		"attention_dropout": 0.0, "use_cache": true, "transformers_version": "4.51.0",
	}
	switch s.Arch {
	case "qwen3_moe", "qwen2_moe":
		if s.Arch == "qwen3_moe" {
			c["attention_bias"] = s.AttentionBias
		} else {
			c["shared_expert_intermediate_size"] = s.SharedIntermediate
			c["use_sliding_window"] = false
			c["sliding_window"] = nil
			c["max_window_layers"] = s.Layers
		}
		c["num_experts"] = s.Experts
		c["num_experts_per_tok"] = s.ExpertsPerToken
		c["moe_intermediate_size"] = s.MoEIntermediate
		c["norm_topk_prob"] = s.NormTopK
		c["decoder_sparse_step"] = s.SparseStep
		c["mlp_only_layers"] = append([]int{}, s.MLPOnly...)
		c["output_router_logits"] = false
		c["router_aux_loss_coef"] = 0.001
	case "qwen3", "llama":
		c["attention_bias"] = s.AttentionBias
	case "qwen2":
		c["use_sliding_window"] = false
		c["sliding_window"] = nil
		c["max_window_layers"] = s.Layers
	}
	if s.Arch == "llama" {
		c["mlp_bias"] = false
		c["pretraining_tp"] = 1
	}
	switch s.Rope {
	case "linear":
		c["rope_scaling"] = map[string]any{"rope_type": "linear", "factor": 2.0}
	case "llama3":
		c["rope_scaling"] = map[string]any{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
			"high_freq_factor": 4.0, "original_max_position_embeddings": s.MaxPositions / 4}
	default:
		c["rope_scaling"] = nil
	}
	return c
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// normals draws deterministic N(0,1) values (splitmix64 + Box-Muller), so
// a spec and seed always give the same bytes.
type normals struct{ state uint64 }

func (n *normals) uint64() uint64 {
	n.state += 0x9e3779b97f4a7c15
	z := n.state
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func (n *normals) unit() float64 { return (float64(n.uint64()>>11) + 0.5) / (1 << 53) }

func (n *normals) fill(dst []float32, mean, std float64) {
	for i := 0; i < len(dst); i += 2 {
		r := math.Sqrt(-2 * math.Log(n.unit()))
		a := 2 * math.Pi * n.unit()
		dst[i] = float32(mean + std*r*math.Cos(a))
		if i+1 < len(dst) {
			dst[i+1] = float32(mean + std*r*math.Sin(a))
		}
	}
}

func weights(s Spec, f family) ([]safetensors.Writable, error) {
	rng := &normals{state: s.Seed*0x2545f4914f6cdd1d + 1}
	dtype := safetensors.DType(s.DType)
	var out []safetensors.Writable
	var firstErr error
	add := func(name string, mean, std float64, shape ...int) {
		n := 1
		for _, d := range shape {
			n *= d
		}
		vals := make([]float32, n)
		rng.fill(vals, mean, std)
		data, err := safetensors.EncodeFloat32(vals, dtype)
		if err != nil && firstErr == nil {
			firstErr = err
		}
		out = append(out, safetensors.Writable{Name: name, DType: dtype, Shape: shape, Data: data})
	}
	h, inter, d := s.Hidden, s.Intermediate, s.HeadDim
	q, kv := s.Heads*d, s.KVHeads*d
	// The embedding scale gives logits a spread of a few units, so greedy
	// decoding has clear winners rather than float-noise ties; o_proj and
	// down_proj are scaled up so that layer outputs, not the input
	// embedding, dominate the residual stream (a tied model otherwise
	// predicts its input token forever).
	add("model.embed_tokens.weight", 0, 0.6, f.vocab, h)
	for i := 0; i < s.Layers; i++ {
		p := fmt.Sprintf("model.layers.%d.", i)
		add(p+"input_layernorm.weight", 1, 0.1, h)
		add(p+"post_attention_layernorm.weight", 1, 0.1, h)
		add(p+"self_attn.q_proj.weight", 0, 1/math.Sqrt(float64(h)), q, h)
		add(p+"self_attn.k_proj.weight", 0, 1/math.Sqrt(float64(h)), kv, h)
		add(p+"self_attn.v_proj.weight", 0, 1/math.Sqrt(float64(h)), kv, h)
		add(p+"self_attn.o_proj.weight", 0, 3/math.Sqrt(float64(q)), h, q)
		if s.Arch == "qwen2" || s.Arch == "qwen2_moe" || s.AttentionBias {
			add(p+"self_attn.q_proj.bias", 0, 0.2, q)
			add(p+"self_attn.k_proj.bias", 0, 0.2, kv)
			add(p+"self_attn.v_proj.bias", 0, 0.2, kv)
		}
		if s.Arch != "qwen2" && s.Arch != "qwen2_moe" && s.AttentionBias {
			add(p+"self_attn.o_proj.bias", 0, 0.2, h)
		}
		if s.Arch == "qwen3" || s.Arch == "qwen3_moe" {
			add(p+"self_attn.q_norm.weight", 1, 0.1, d)
			add(p+"self_attn.k_norm.weight", 1, 0.1, d)
		}
		if !s.sparse(i) {
			add(p+"mlp.gate_proj.weight", 0, 1/math.Sqrt(float64(h)), inter, h)
			add(p+"mlp.up_proj.weight", 0, 1/math.Sqrt(float64(h)), inter, h)
			add(p+"mlp.down_proj.weight", 0, 3/math.Sqrt(float64(inter)), h, inter)
			continue
		}
		// A router of this scale spreads the softmax over a few units, so
		// the top-k choice has clear margins rather than float-noise ties.
		add(p+"mlp.gate.weight", 0, 3/math.Sqrt(float64(h)), s.Experts, h)
		mi := s.MoEIntermediate
		for e := 0; e < s.Experts; e++ {
			q := fmt.Sprintf("%smlp.experts.%d.", p, e)
			add(q+"gate_proj.weight", 0, 1/math.Sqrt(float64(h)), mi, h)
			add(q+"up_proj.weight", 0, 1/math.Sqrt(float64(h)), mi, h)
			add(q+"down_proj.weight", 0, 3/math.Sqrt(float64(mi)), h, mi)
		}
		if s.Arch == "qwen2_moe" {
			si := s.SharedIntermediate
			add(p+"mlp.shared_expert.gate_proj.weight", 0, 1/math.Sqrt(float64(h)), si, h)
			add(p+"mlp.shared_expert.up_proj.weight", 0, 1/math.Sqrt(float64(h)), si, h)
			add(p+"mlp.shared_expert.down_proj.weight", 0, 3/math.Sqrt(float64(si)), h, si)
			// Gate logits of a few units either way: the shared expert
			// counts for some tokens and hardly at all for others.
			add(p+"mlp.shared_expert_gate.weight", 0, 2/math.Sqrt(float64(h)), 1, h)
		}
	}
	add("model.norm.weight", 1, 0.1, h)
	if !s.Tie {
		add("lm_head.weight", 0, 0.6, f.vocab, h)
	}
	return out, firstErr
}

// TestDir writes arch's default spec with float32 weights and a 512-token
// vocabulary (what the CPU tests compute with), changed by edit when not
// nil, into a temporary directory of tb and returns it.
func TestDir(tb testing.TB, arch string, edit func(*Spec)) string {
	tb.Helper()
	spec, err := Default(arch)
	if err != nil {
		tb.Fatal(err)
	}
	spec.Vocab, spec.DType = 512, "F32"
	if edit != nil {
		edit(&spec)
	}
	dir := tb.TempDir()
	if err := Write(dir, spec); err != nil {
		tb.Fatal(err)
	}
	return dir
}
