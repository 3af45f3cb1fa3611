package model

import (
	"math"
	"strings"
	"testing"
)

const base = `"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
	"vocab_size": 100, "max_position_embeddings": 512`

func TestParseConfig(t *testing.T) {
	cases := []struct {
		name    string
		json    string
		wantErr string
		check   func(*Config) bool
	}{
		{"qwen3 defaults", `{"architectures": ["Qwen3ForCausalLM"], ` + base + `}`, "",
			func(c *Config) bool {
				return c.QKNorm && c.KVHeads == 4 && c.HeadDim == 16 && !c.AttentionBias && c.Rope.Type == "default"
			}},
		{"qwen2 has qkv bias and no o bias", `{"architectures": ["Qwen2ForCausalLM"], ` + base + `}`, "",
			func(c *Config) bool { return c.AttentionBias && !c.OutputBias && !c.QKNorm }},
		{"llama gqa, head_dim, eos list", `{"architectures": ["LlamaForCausalLM"], ` + base + `, "num_key_value_heads": 1, "head_dim": 32, "eos_token_id": [1, 2]}`, "",
			func(c *Config) bool {
				return c.KVHeads == 1 && c.HeadDim == 32 && len(c.EOSTokenIDs) == 2 && c.QKVRows() == 6*32
			}},
		{"transformers 5 rope_parameters", `{"architectures": ["LlamaForCausalLM"], ` + base + `, "rope_parameters": {"rope_type": "linear", "factor": 2, "rope_theta": 5000}}`, "",
			func(c *Config) bool { return c.Rope.Type == "linear" && c.RopeTheta == 5000 }},
		{"legacy type key", `{"architectures": ["LlamaForCausalLM"], ` + base + `, "rope_scaling": {"type": "linear", "factor": 4}}`, "",
			func(c *Config) bool { return c.Rope.Type == "linear" && c.Rope.Factor == 4 }},
		{"unsupported architecture", `{"architectures": ["MambaForCausalLM"], ` + base + `}`, `"MambaForCausalLM"`, nil},
		{"unsupported rope", `{"architectures": ["LlamaForCausalLM"], ` + base + `, "rope_scaling": {"rope_type": "yarn", "factor": 4}}`, `"yarn"`, nil},
		{"kv heads must divide", `{"architectures": ["LlamaForCausalLM"], ` + base + `, "num_key_value_heads": 3}`, "num_key_value_heads", nil},
		{"sliding window", `{"architectures": ["Qwen2ForCausalLM"], ` + base + `, "use_sliding_window": true}`, "use_sliding_window", nil},
		{"activation", `{"architectures": ["LlamaForCausalLM"], ` + base + `, "hidden_act": "gelu"}`, "gelu", nil},
		{"missing sizes", `{"architectures": ["LlamaForCausalLM"]}`, "hidden_size", nil},
		{"quantized", `{"architectures": ["LlamaForCausalLM"], ` + base + `, "quantization_config": {"quant_method": "awq"}}`, "quantization", nil},
		{"not json", `{`, "parse", nil},
		{"qwen3 moe, Qwen's spelling", `{"architectures": ["Qwen3MoeForCausalLM"], ` + base + `, "num_experts": 16, "num_experts_per_tok": 4,
			"moe_intermediate_size": 32, "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [0]}`, "",
			func(c *Config) bool {
				m := c.MoE
				return c.QKNorm && m.Experts == 16 && m.TopK == 4 && m.Intermediate == 32 && m.NormTopK &&
					!c.Sparse(0) && c.Sparse(1) && c.SparseLayers() == 1
			}},
		{"qwen3 moe, transformers 5 spelling and defaults", `{"architectures": ["Qwen3MoeForCausalLM"], ` + base + `, "num_local_experts": 32, "decoder_sparse_step": 2}`, "",
			func(c *Config) bool {
				m := c.MoE
				return m.Experts == 32 && m.TopK == 8 && m.Intermediate == 768 && !m.NormTopK && !c.Sparse(0) && c.Sparse(1)
			}},
		{"dense models have no experts", `{"architectures": ["Qwen3ForCausalLM"], ` + base + `, "num_experts": 8}`, "",
			func(c *Config) bool { return c.MoE == nil && !c.Sparse(0) }},
		{"top-k beyond the experts", `{"architectures": ["Qwen3MoeForCausalLM"], ` + base + `, "num_experts": 4, "num_experts_per_tok": 8}`, "num_experts_per_tok", nil},
		{"mlp_only_layers out of range", `{"architectures": ["Qwen3MoeForCausalLM"], ` + base + `, "mlp_only_layers": [5]}`, "mlp_only_layers", nil},
		{"qwen2 moe defaults (Qwen1.5-MoE-A2.7B's)", `{"architectures": ["Qwen2MoeForCausalLM"], ` + base + `}`, "",
			func(c *Config) bool {
				m := c.MoE
				return c.AttentionBias && !c.OutputBias && !c.QKNorm && m.Experts == 60 && m.TopK == 4 &&
					m.Intermediate == 1408 && m.SharedIntermediate == 5632 && !m.NormTopK && c.Sparse(0)
			}},
		{"qwen2 moe shared expert size", `{"architectures": ["Qwen2MoeForCausalLM"], ` + base + `, "num_experts": 64, "num_experts_per_tok": 8,
			"moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480}`, "",
			func(c *Config) bool { return c.MoE.Experts == 64 && c.MoE.SharedIntermediate == 20480 }},
		{"qwen2 moe without a shared expert", `{"architectures": ["Qwen2MoeForCausalLM"], ` + base + `, "shared_expert_intermediate_size": 0}`,
			"shared_expert_intermediate_size", nil},
		{"qwen3 moe has no shared expert", `{"architectures": ["Qwen3MoeForCausalLM"], ` + base + `, "shared_expert_intermediate_size": 64}`, "",
			func(c *Config) bool { return c.MoE.SharedIntermediate == 0 }},
	}
	for _, c := range cases {
		cfg, err := ParseConfig([]byte(c.json))
		switch {
		case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
			t.Errorf("%s: error %v, want one naming %s", c.name, err, c.wantErr)
		case c.wantErr == "" && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.check != nil && err == nil && !c.check(cfg):
			t.Errorf("%s: %+v", c.name, cfg)
		}
	}
}

// TestLlama3RopeScaling checks the three frequency bands of llama3 scaling.
func TestLlama3RopeScaling(t *testing.T) {
	c := &Config{HeadDim: 128, RopeTheta: 500000, Rope: RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPos: 8192}}
	plain := &Config{HeadDim: 128, RopeTheta: 500000, Rope: RopeScaling{Type: "default"}}
	got, raw := c.InvFreq(), plain.InvFreq()
	for j := range got {
		wave := 2 * math.Pi / float64(raw[j])
		switch {
		case wave < 8192/4: // high frequency: unchanged
			if got[j] != raw[j] {
				t.Fatalf("band high, %d: %v vs %v", j, got[j], raw[j])
			}
		case wave > 8192: // low frequency: divided by the factor
			if math.Abs(float64(got[j]*8-raw[j])) > 1e-6*float64(raw[j]) {
				t.Fatalf("band low, %d: %v vs %v", j, got[j], raw[j])
			}
		default: // smoothed between the two
			if got[j] > raw[j] || got[j] < raw[j]/8 {
				t.Fatalf("band mid, %d: %v outside [%v, %v]", j, got[j], raw[j]/8, raw[j])
			}
		}
	}
	cos, sin := plain.RopeTables(4)
	if cos[0] != 1 || sin[0] != 0 || math.Abs(float64(cos[64]*cos[64]+sin[64]*sin[64])-1) > 1e-6 {
		t.Fatal("rope tables are not unit rotations")
	}
}
