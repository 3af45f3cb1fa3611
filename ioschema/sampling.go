package ioschema

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
)

// SamplingParams mirrors SGLang's SamplingParams. Pointer fields are unset
// when nil and then take the model's generation_config.json defaults, then
// SGLang's.
type SamplingParams struct {
	MaxNewTokens               *int       `msgpack:"max_new_tokens" json:"max_new_tokens,omitempty"`
	MinNewTokens               int        `msgpack:"min_new_tokens" json:"min_new_tokens,omitempty"`
	Stop                       StringList `msgpack:"stop" json:"stop,omitempty"`
	StopTokenIDs               []int32    `msgpack:"stop_token_ids" json:"stop_token_ids,omitempty"`
	Temperature                *float64   `msgpack:"temperature" json:"temperature,omitempty"`
	TopP                       *float64   `msgpack:"top_p" json:"top_p,omitempty"`
	TopK                       *int       `msgpack:"top_k" json:"top_k,omitempty"`
	MinP                       *float64   `msgpack:"min_p" json:"min_p,omitempty"`
	FrequencyPenalty           float64    `msgpack:"frequency_penalty" json:"frequency_penalty,omitempty"`
	PresencePenalty            float64    `msgpack:"presence_penalty" json:"presence_penalty,omitempty"`
	RepetitionPenalty          *float64   `msgpack:"repetition_penalty" json:"repetition_penalty,omitempty"`
	IgnoreEOS                  bool       `msgpack:"ignore_eos" json:"ignore_eos,omitempty"`
	SkipSpecialTokens          *bool      `msgpack:"skip_special_tokens" json:"skip_special_tokens,omitempty"`
	SpacesBetweenSpecialTokens *bool      `msgpack:"spaces_between_special_tokens" json:"spaces_between_special_tokens,omitempty"`
	NoStopTrim                 bool       `msgpack:"no_stop_trim" json:"no_stop_trim,omitempty"`
	N                          *int       `msgpack:"n" json:"n,omitempty"`
	SamplingSeed               *uint64    `msgpack:"sampling_seed" json:"sampling_seed,omitempty"`
	JSONSchema                 *string    `msgpack:"json_schema" json:"json_schema,omitempty"`
	Regex                      *string    `msgpack:"regex" json:"regex,omitempty"`
	EBNF                       *string    `msgpack:"ebnf" json:"ebnf,omitempty"`
	// SGLang's parameters that ebb parses only to refuse them by name where
	// set (StreamInterval is taken: ebb streams every token, which any
	// interval's client reads alike).
	StopRegex      StringList         `msgpack:"stop_regex" json:"stop_regex,omitempty"`
	StructuralTag  *string            `msgpack:"structural_tag" json:"structural_tag,omitempty"`
	CustomParams   map[string]any     `msgpack:"custom_params" json:"custom_params,omitempty"`
	LogitBias      map[string]float64 `msgpack:"logit_bias" json:"logit_bias,omitempty"`
	StreamInterval *int               `msgpack:"stream_interval" json:"stream_interval,omitempty"`
}

// GenerationDefaults are a model's sampling defaults (generation_config.json).
type GenerationDefaults struct {
	Temperature       *float64 `json:"temperature"`
	TopP              *float64 `json:"top_p"`
	TopK              *int     `json:"top_k"`
	MinP              *float64 `json:"min_p"`
	RepetitionPenalty *float64 `json:"repetition_penalty"`
	MaxNewTokens      *int     `json:"max_new_tokens"`
}

// Resolved is SamplingParams with every default applied.
type Resolved struct {
	MaxNewTokens      int
	MinNewTokens      int
	Stop              []string
	StopTokenIDs      []int32
	StopRegex         []StopRegex
	StopRegexLen      int         // the most characters a stop_regex match spans; -1: unbounded
	LogitBias         []TokenBias // by token id; the scheduler checks the ids against the vocabulary
	Temperature       float32
	TopP              float32
	TopK              int
	MinP              float32
	FrequencyPenalty  float32
	PresencePenalty   float32
	RepetitionPenalty float32
	IgnoreEOS         bool
	SkipSpecialTokens bool
	SpacesBetween     bool
	NoStopTrim        bool
	Seed              *uint64
}

// DefaultMaxNewTokens is SGLang's default.
const DefaultMaxNewTokens = 128

// Copies is n: how many completions to sample from the prompt (default 1).
func (p *SamplingParams) Copies() int {
	if p.N == nil {
		return 1
	}
	return *p.N
}

// Resolve applies model defaults d (may be nil), then SGLang's, and
// validates the values.
func (p *SamplingParams) Resolve(d *GenerationDefaults) (Resolved, error) {
	if d == nil {
		d = &GenerationDefaults{}
	}
	r := Resolved{
		MaxNewTokens: pick(p.MaxNewTokens, d.MaxNewTokens, DefaultMaxNewTokens),
		MinNewTokens: p.MinNewTokens, Stop: p.Stop, StopTokenIDs: p.StopTokenIDs,
		Temperature:       float32(pick(p.Temperature, d.Temperature, 1)),
		TopP:              float32(pick(p.TopP, d.TopP, 1)),
		TopK:              pick(p.TopK, d.TopK, -1),
		MinP:              float32(pick(p.MinP, d.MinP, 0)),
		FrequencyPenalty:  float32(p.FrequencyPenalty),
		PresencePenalty:   float32(p.PresencePenalty),
		RepetitionPenalty: float32(pick(p.RepetitionPenalty, d.RepetitionPenalty, 1)),
		IgnoreEOS:         p.IgnoreEOS,
		SkipSpecialTokens: pick(p.SkipSpecialTokens, nil, true),
		SpacesBetween:     pick(p.SpacesBetweenSpecialTokens, nil, true),
		NoStopTrim:        p.NoStopTrim,
		Seed:              p.SamplingSeed,
	}
	var errs []error
	if r.MaxNewTokens < 0 {
		errs = append(errs, fmt.Errorf("max_new_tokens must be at least 0, got %d", r.MaxNewTokens))
	}
	if r.MinNewTokens < 0 || (r.MaxNewTokens >= 0 && r.MinNewTokens > r.MaxNewTokens) { // one error for a negative max
		errs = append(errs, fmt.Errorf("min_new_tokens must be in [0, max_new_tokens], got %d", r.MinNewTokens))
	}
	if r.Temperature < 0 {
		errs = append(errs, fmt.Errorf("temperature must be non-negative, got %v", r.Temperature))
	}
	if r.TopP <= 0 || r.TopP > 1 {
		errs = append(errs, fmt.Errorf("top_p must be in (0, 1], got %v", r.TopP))
	}
	if r.TopK == 0 || r.TopK < -1 {
		errs = append(errs, fmt.Errorf("top_k must be -1 (disable) or at least 1, got %d", r.TopK))
	}
	if r.MinP < 0 || r.MinP > 1 {
		errs = append(errs, fmt.Errorf("min_p must be in [0, 1], got %v", r.MinP))
	}
	if r.FrequencyPenalty < -2 || r.FrequencyPenalty > 2 {
		errs = append(errs, fmt.Errorf("frequency_penalty must be in [-2, 2], got %v", r.FrequencyPenalty))
	}
	if r.PresencePenalty < -2 || r.PresencePenalty > 2 {
		errs = append(errs, fmt.Errorf("presence_penalty must be in [-2, 2], got %v", r.PresencePenalty))
	}
	if r.RepetitionPenalty <= 0 || r.RepetitionPenalty > 2 {
		errs = append(errs, fmt.Errorf("repetition_penalty must be in (0, 2], got %v", r.RepetitionPenalty))
	}
	if p.N != nil && *p.N < 1 {
		errs = append(errs, fmt.Errorf("n must be at least 1, got %d", *p.N))
	}
	for _, c := range []struct {
		name string
		v    *string
	}{{"json_schema", p.JSONSchema}, {"regex", p.Regex}, {"ebnf", p.EBNF}, {"structural_tag", p.StructuralTag}} {
		if c.v != nil {
			errs = append(errs, fmt.Errorf("%s: constrained decoding is not supported", c.name))
		}
	}
	if len(p.StopRegex) > 0 {
		var err error
		if r.StopRegex, r.StopRegexLen, err = compileStopRegexes(p.StopRegex); err != nil {
			errs = append(errs, err)
		}
	}
	if len(p.CustomParams) > 0 {
		errs = append(errs, errors.New("custom_params is not supported: ebb runs no custom logit processors"))
	}
	if len(p.LogitBias) > 0 {
		var err error
		if r.LogitBias, err = logitBias(p.LogitBias); err != nil {
			errs = append(errs, err)
		}
	}
	if p.StreamInterval != nil && *p.StreamInterval < 1 {
		errs = append(errs, fmt.Errorf("stream_interval must be at least 1, got %d", *p.StreamInterval))
	}
	if len(errs) > 0 {
		return Resolved{}, errors.Join(errs...)
	}
	if r.Temperature < 1e-6 { // SGLang: near-zero temperature is greedy
		r.Temperature, r.TopK = 0, 1
	}
	return r, nil
}

func pick[T any](v, model *T, def T) T {
	if v != nil {
		return *v
	}
	if model != nil {
		return *model
	}
	return def
}

// TokenBias is one logit_bias entry: added to the token's logit after the
// penalties and before the temperature, as SGLang's apply_logits_bias.
type TokenBias struct {
	Token int32
	Bias  float32
}

// logitBias reads SGLang's and OpenAI's logit_bias, token ids as strings,
// into entries by token id.
func logitBias(m map[string]float64) ([]TokenBias, error) {
	out := make([]TokenBias, 0, len(m))
	for k, v := range m {
		id, err := strconv.ParseInt(k, 10, 32)
		if err != nil || id < 0 {
			return nil, fmt.Errorf("logit_bias: key %q is not a token id", k)
		}
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return nil, fmt.Errorf("logit_bias: token %d has bias %v", id, v)
		}
		out = append(out, TokenBias{Token: int32(id), Bias: float32(v)})
	}
	slices.SortFunc(out, func(a, b TokenBias) int { return cmp.Compare(a.Token, b.Token) })
	return out, nil
}
