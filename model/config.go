// Package model loads Hugging Face decoder-only transformers (Qwen3, Qwen2,
// Llama, and the Qwen3-MoE and Qwen2-MoE mixtures of experts) and runs their
// forward pass on a device.Device with a paged KV cache.
package model

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
)

// Arch is a supported architecture.
type Arch string

// Supported architectures.
const (
	Qwen3    Arch = "Qwen3ForCausalLM"
	Qwen2    Arch = "Qwen2ForCausalLM"
	Llama    Arch = "LlamaForCausalLM"
	Qwen3MoE Arch = "Qwen3MoeForCausalLM"
	Qwen2MoE Arch = "Qwen2MoeForCausalLM"
)

// RopeScaling is the subset of rope_scaling / rope_parameters ebb supports.
type RopeScaling struct {
	Type              string  `json:"rope_type"` // "default", "linear", "llama3"
	Factor            float64 `json:"factor"`
	LowFreqFactor     float64 `json:"low_freq_factor"`
	HighFreqFactor    float64 `json:"high_freq_factor"`
	OriginalMaxPos    int     `json:"original_max_position_embeddings"`
	LegacyType        string  `json:"type"`
	RopeTheta         float64 `json:"rope_theta"`
	PartialRotaryFrac float64 `json:"partial_rotary_factor"`
}

// Config is the part of config.json the forward pass needs.
type Config struct {
	Arch         Arch
	Hidden       int
	Intermediate int
	Layers       int
	Heads        int
	KVHeads      int
	HeadDim      int
	Vocab        int
	// VocabRows is how many rows of the embedding and lm_head this rank
	// holds when tensor parallelism splits the vocabulary; 0 is all.
	VocabRows     int
	RMSNormEps    float64
	RopeTheta     float64
	Rope          RopeScaling
	MaxPositions  int
	AttentionBias bool // bias on q, k, v (and o unless Qwen2)
	OutputBias    bool // bias on o_proj
	QKNorm        bool // Qwen3's per-head RMSNorm on q and k
	TieEmbeddings bool
	BOSTokenID    int32
	EOSTokenIDs   []int32
	TorchDType    string
	// MoE is the mixture-of-experts part of a sparse model; nil for a
	// dense one.
	MoE *MoEConfig
}

// MoEConfig describes the sparse MLP layers of a mixture-of-experts model
// (Qwen3-MoE, Qwen2-MoE): a router picks TopK of Experts per token, each
// expert a silu-gated MLP of Intermediate columns, and their outputs are
// added weighted by the router's softmax (renormalised over the chosen ones
// when NormTopK). Qwen2-MoE adds a shared expert of SharedIntermediate
// columns that every token takes, weighted by the sigmoid of its own gate.
type MoEConfig struct {
	Experts      int
	TopK         int
	Intermediate int // this rank's share under tensor parallelism
	NormTopK     bool
	// SharedIntermediate is the shared expert's columns (this rank's
	// share); 0 for none (Qwen3-MoE).
	SharedIntermediate int
	// SparseStep and MLPOnly pick the sparse layers as transformers does:
	// layer i is sparse when (i+1) % SparseStep == 0 and i is not in
	// MLPOnly; the others have a dense MLP of Config.Intermediate.
	SparseStep int
	MLPOnly    []int
}

// Sparse reports whether layer i has experts rather than a dense MLP.
func (c *Config) Sparse(i int) bool {
	m := c.MoE
	return m != nil && (i+1)%m.SparseStep == 0 && !slices.Contains(m.MLPOnly, i)
}

// SparseLayers is the number of layers with experts.
func (c *Config) SparseLayers() int {
	n := 0
	for i := 0; i < c.Layers; i++ {
		if c.Sparse(i) {
			n++
		}
	}
	return n
}

// LocalVocab is the number of embedding and lm_head rows this rank holds.
func (c *Config) LocalVocab() int {
	if c.VocabRows > 0 {
		return c.VocabRows
	}
	return c.Vocab
}

// QKVRows is the number of output rows of the fused q/k/v projection.
func (c *Config) QKVRows() int { return (c.Heads + 2*c.KVHeads) * c.HeadDim }

type rawConfig struct {
	Architectures      []string        `json:"architectures"`
	ModelType          string          `json:"model_type"`
	HiddenSize         int             `json:"hidden_size"`
	IntermediateSize   int             `json:"intermediate_size"`
	NumHiddenLayers    int             `json:"num_hidden_layers"`
	NumAttentionHeads  int             `json:"num_attention_heads"`
	NumKeyValueHeads   *int            `json:"num_key_value_heads"`
	HeadDim            *int            `json:"head_dim"`
	VocabSize          int             `json:"vocab_size"`
	RMSNormEps         *float64        `json:"rms_norm_eps"`
	RopeTheta          *float64        `json:"rope_theta"`
	RopeScaling        *RopeScaling    `json:"rope_scaling"`
	RopeParameters     *RopeScaling    `json:"rope_parameters"`
	MaxPositions       int             `json:"max_position_embeddings"`
	AttentionBias      *bool           `json:"attention_bias"`
	MLPBias            bool            `json:"mlp_bias"`
	TieWordEmbeddings  *bool           `json:"tie_word_embeddings"`
	HiddenAct          string          `json:"hidden_act"`
	UseSlidingWindow   bool            `json:"use_sliding_window"`
	BOSTokenID         *int32          `json:"bos_token_id"`
	EOSTokenID         json.RawMessage `json:"eos_token_id"`
	TorchDType         string          `json:"torch_dtype"`
	DType              string          `json:"dtype"`
	QuantizationConfig json.RawMessage `json:"quantization_config"`
	// Mixture of experts (Qwen3-MoE, Qwen2-MoE). Qwen's releases write
	// num_experts, transformers 5 num_local_experts.
	NumExperts          *int  `json:"num_experts"`
	NumLocalExperts     *int  `json:"num_local_experts"`
	NumExpertsPerTok    int   `json:"num_experts_per_tok"`
	MoEIntermediateSize int   `json:"moe_intermediate_size"`
	NormTopKProb        bool  `json:"norm_topk_prob"`
	DecoderSparseStep   *int  `json:"decoder_sparse_step"`
	MLPOnlyLayers       []int `json:"mlp_only_layers"`
	SharedExpertSize    *int  `json:"shared_expert_intermediate_size"`
}

// LoadConfig reads dir/config.json.
func LoadConfig(dir string) (*Config, error) {
	data, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("model config: %w", err)
	}
	c, err := ParseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, "config.json"), err)
	}
	return c, nil
}

// ParseConfig validates a config.json and fills defaults as transformers does.
func ParseConfig(data []byte) (*Config, error) {
	var r rawConfig
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	if len(r.Architectures) != 1 {
		return nil, fmt.Errorf("architectures must name one architecture, got %v", r.Architectures)
	}
	c := &Config{
		Arch: Arch(r.Architectures[0]), Hidden: r.HiddenSize, Intermediate: r.IntermediateSize,
		Layers: r.NumHiddenLayers, Heads: r.NumAttentionHeads, Vocab: r.VocabSize,
		MaxPositions: r.MaxPositions, RMSNormEps: 1e-6, RopeTheta: 10000,
		TorchDType: r.TorchDType,
	}
	if c.TorchDType == "" {
		c.TorchDType = r.DType
	}
	switch c.Arch {
	case Qwen3, Qwen3MoE:
		c.QKNorm = true
		c.AttentionBias = r.AttentionBias != nil && *r.AttentionBias
		c.OutputBias = c.AttentionBias
	case Qwen2, Qwen2MoE:
		c.AttentionBias = true // Qwen2 always has q/k/v bias and no o bias
	case Llama:
		c.AttentionBias = r.AttentionBias != nil && *r.AttentionBias
		c.OutputBias = c.AttentionBias
	default:
		return nil, fmt.Errorf("unsupported architecture %q (supported: %s, %s, %s, %s, %s)", c.Arch, Qwen3, Qwen3MoE, Qwen2,
			Qwen2MoE, Llama)
	}
	var errs []error
	positive := func(name string, v int) {
		if v <= 0 {
			errs = append(errs, fmt.Errorf("%s must be positive, got %d", name, v))
		}
	}
	positive("hidden_size", c.Hidden)
	positive("intermediate_size", c.Intermediate)
	positive("num_hidden_layers", c.Layers)
	positive("num_attention_heads", c.Heads)
	positive("vocab_size", c.Vocab)
	positive("max_position_embeddings", c.MaxPositions)
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	c.KVHeads = c.Heads
	if r.NumKeyValueHeads != nil {
		c.KVHeads = *r.NumKeyValueHeads
	}
	if c.KVHeads <= 0 || c.Heads%c.KVHeads != 0 {
		return nil, fmt.Errorf("num_key_value_heads %d must divide num_attention_heads %d", c.KVHeads, c.Heads)
	}
	if r.HeadDim != nil && *r.HeadDim > 0 {
		c.HeadDim = *r.HeadDim
	} else {
		if c.Hidden%c.Heads != 0 {
			return nil, fmt.Errorf("hidden_size %d is not a multiple of num_attention_heads %d", c.Hidden, c.Heads)
		}
		c.HeadDim = c.Hidden / c.Heads
	}
	if c.HeadDim%2 != 0 {
		return nil, fmt.Errorf("head_dim %d must be even for rotary embeddings", c.HeadDim)
	}
	if r.RMSNormEps != nil {
		c.RMSNormEps = *r.RMSNormEps
	}
	if r.HiddenAct != "" && r.HiddenAct != "silu" {
		return nil, fmt.Errorf("unsupported hidden_act %q (only silu)", r.HiddenAct)
	}
	if r.MLPBias {
		return nil, fmt.Errorf("unsupported mlp_bias: true")
	}
	if r.UseSlidingWindow {
		return nil, fmt.Errorf("unsupported use_sliding_window: true")
	}
	if len(r.QuantizationConfig) > 0 && string(r.QuantizationConfig) != "null" {
		return nil, fmt.Errorf("unsupported quantization_config (quantized checkpoints)")
	}
	// transformers defaults: Qwen3 and Qwen2 and Llama all default to untied.
	if r.TieWordEmbeddings != nil {
		c.TieEmbeddings = *r.TieWordEmbeddings
	}
	if err := c.parseRope(&r); err != nil {
		return nil, err
	}
	if r.BOSTokenID != nil {
		c.BOSTokenID = *r.BOSTokenID
	} else {
		c.BOSTokenID = -1
	}
	eos, err := parseIDList(r.EOSTokenID)
	if err != nil {
		return nil, fmt.Errorf("eos_token_id: %w", err)
	}
	c.EOSTokenIDs = eos
	if c.Arch == Qwen3MoE || c.Arch == Qwen2MoE {
		if c.MoE, err = parseMoE(&r, c.Layers, c.Arch == Qwen2MoE); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// parseMoE reads the expert settings with Qwen3MoeConfig's defaults, or
// Qwen2MoeConfig's (60 experts, 4 a token, 1,408 columns each, a shared
// expert of 5,632) where shared.
func parseMoE(r *rawConfig, layers int, shared bool) (*MoEConfig, error) {
	m := &MoEConfig{Experts: 128, TopK: r.NumExpertsPerTok, Intermediate: r.MoEIntermediateSize,
		NormTopK: r.NormTopKProb, SparseStep: 1, MLPOnly: r.MLPOnlyLayers}
	topK, inter := 8, 768
	if shared {
		m.Experts, topK, inter, m.SharedIntermediate = 60, 4, 1408, 5632
		if r.SharedExpertSize != nil {
			m.SharedIntermediate = *r.SharedExpertSize
		}
	}
	switch {
	case r.NumExperts != nil:
		m.Experts = *r.NumExperts
	case r.NumLocalExperts != nil:
		m.Experts = *r.NumLocalExperts
	}
	if r.DecoderSparseStep != nil {
		m.SparseStep = *r.DecoderSparseStep
	}
	if m.TopK == 0 {
		m.TopK = topK
	}
	if m.Intermediate == 0 {
		m.Intermediate = inter
	}
	var errs []error
	if shared && m.SharedIntermediate <= 0 {
		errs = append(errs, fmt.Errorf("shared_expert_intermediate_size must be positive, got %d", m.SharedIntermediate))
	}
	if m.Experts <= 0 || m.TopK <= 0 || m.TopK > m.Experts {
		errs = append(errs, fmt.Errorf("num_experts_per_tok %d must be in [1, num_experts %d]", m.TopK, m.Experts))
	}
	if m.TopK > MaxTopKExperts {
		errs = append(errs, fmt.Errorf("num_experts_per_tok %d exceeds the %d ebb supports", m.TopK, MaxTopKExperts))
	}
	if m.Intermediate <= 0 {
		errs = append(errs, fmt.Errorf("moe_intermediate_size must be positive, got %d", m.Intermediate))
	}
	if m.SparseStep <= 0 {
		errs = append(errs, fmt.Errorf("decoder_sparse_step must be positive, got %d", m.SparseStep))
	}
	for _, l := range m.MLPOnly {
		if l < 0 || l >= layers {
			errs = append(errs, fmt.Errorf("mlp_only_layers names layer %d of %d", l, layers))
		}
	}
	return m, errors.Join(errs...)
}

// MaxTopKExperts bounds num_experts_per_tok: the routing kernels keep a
// token's choices in registers.
const MaxTopKExperts = 16

func (c *Config) parseRope(r *rawConfig) error {
	if r.RopeTheta != nil {
		c.RopeTheta = *r.RopeTheta
	}
	scaling := r.RopeScaling
	if scaling == nil {
		scaling = r.RopeParameters // transformers 5 writes rope settings here
	}
	if scaling == nil {
		c.Rope.Type = "default"
		return nil
	}
	c.Rope = *scaling
	if c.Rope.Type == "" {
		c.Rope.Type = c.Rope.LegacyType
	}
	if c.Rope.RopeTheta > 0 {
		c.RopeTheta = c.Rope.RopeTheta
	}
	if c.Rope.PartialRotaryFrac != 0 && c.Rope.PartialRotaryFrac != 1 {
		return fmt.Errorf("unsupported partial_rotary_factor %v", c.Rope.PartialRotaryFrac)
	}
	switch c.Rope.Type {
	case "", "default":
		c.Rope.Type = "default"
	case "linear":
		if c.Rope.Factor <= 0 {
			return fmt.Errorf("rope_scaling linear needs a positive factor")
		}
	case "llama3":
		if c.Rope.Factor <= 0 || c.Rope.OriginalMaxPos <= 0 || c.Rope.HighFreqFactor <= c.Rope.LowFreqFactor {
			return fmt.Errorf("rope_scaling llama3 needs factor, low/high_freq_factor and original_max_position_embeddings")
		}
	default:
		return fmt.Errorf("unsupported rope_scaling type %q (supported: default, linear, llama3)", c.Rope.Type)
	}
	return nil
}

func parseIDList(raw json.RawMessage) ([]int32, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var one int32
	if err := json.Unmarshal(raw, &one); err == nil {
		return []int32{one}, nil
	}
	var many []int32
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, err
	}
	return many, nil
}

// InvFreq returns the rotary inverse frequencies (D/2 of them), computed in
// float32 as transformers does, with rope scaling applied.
func (c *Config) InvFreq() []float32 {
	half := c.HeadDim / 2
	inv := make([]float32, half)
	for j := range inv {
		e := float32(2*j) / float32(c.HeadDim)
		inv[j] = 1 / float32(math.Pow(c.RopeTheta, float64(e)))
	}
	switch c.Rope.Type {
	case "linear":
		for j := range inv {
			inv[j] /= float32(c.Rope.Factor)
		}
	case "llama3":
		f, lo, hi := c.Rope.Factor, c.Rope.LowFreqFactor, c.Rope.HighFreqFactor
		old := float64(c.Rope.OriginalMaxPos)
		loWave, hiWave := old/lo, old/hi
		for j, x := range inv {
			wave := 2 * math.Pi / float64(x)
			scaled := float64(x)
			if wave > loWave {
				scaled = float64(x) / f
			}
			if !(wave < hiWave) && !(wave > loWave) {
				smooth := (old/wave - lo) / (hi - lo)
				scaled = (1-smooth)*scaled/f + smooth*scaled
			}
			inv[j] = float32(scaled)
		}
	}
	return inv
}

// RopeTables returns cos and sin [positions, D/2] for positions [0, n).
func (c *Config) RopeTables(n int) (cos, sin []float32) {
	inv := c.InvFreq()
	half := len(inv)
	cos, sin = make([]float32, n*half), make([]float32, n*half)
	for p := 0; p < n; p++ {
		for j, f := range inv {
			a := float64(float32(p) * f)
			cos[p*half+j] = float32(math.Cos(a))
			sin[p*half+j] = float32(math.Sin(a))
		}
	}
	return cos, sin
}

// DecodeWeightBytes is what one decode step of a single sequence reads of
// the weights in bf16: every layer's projections (the chosen experts' of a
// sparse layer, and its router) and the lm_head (the embedding rows looked
// up are negligible).
func (c *Config) DecodeWeightBytes() int64 { return c.DecodeWeightBytesAt(1) }

// DecodeWeightBytesAt is DecodeWeightBytes for a step of batch sequences:
// a sparse layer reads each expert that any of them picks, expected
// Experts * (1 - (1 - TopK/Experts)^batch) of them with uniform routing.
func (c *Config) DecodeWeightBytesAt(batch int) int64 {
	h := int64(c.Hidden)
	attn := h*int64(c.QKVRows()) + int64(c.Heads*c.HeadDim)*h
	var n int64
	for i := 0; i < c.Layers; i++ {
		n += attn
		if !c.Sparse(i) {
			n += 3 * h * int64(c.Intermediate)
			continue
		}
		m := c.MoE
		touched := float64(m.Experts) * (1 - math.Pow(1-float64(m.TopK)/float64(m.Experts), float64(max(batch, 1))))
		n += int64(m.Experts)*h + int64(touched*float64(3*h*int64(m.Intermediate)))
		if m.SharedIntermediate > 0 {
			n += h + 3*h*int64(m.SharedIntermediate) // every token takes the shared expert
		}
	}
	return 2 * (n + int64(c.Vocab)*h)
}
