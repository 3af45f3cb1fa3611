package model

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"ebb/ioschema"
)

// GenerationConfig is generation_config.json: sampling defaults and eos ids.
type GenerationConfig struct {
	Defaults ioschema.GenerationDefaults
	EOS      []int32
}

// LoadGenerationConfig reads dir/generation_config.json; a missing file
// gives empty defaults.
func LoadGenerationConfig(dir string) (*GenerationConfig, error) {
	path := filepath.Join(dir, "generation_config.json")
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return &GenerationConfig{}, nil
	}
	if err != nil {
		return nil, err
	}
	var raw struct {
		ioschema.GenerationDefaults
		DoSample *bool           `json:"do_sample"`
		EOS      json.RawMessage `json:"eos_token_id"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	g := &GenerationConfig{Defaults: raw.GenerationDefaults}
	if raw.DoSample != nil && !*raw.DoSample {
		// transformers ignores sampling settings without do_sample: greedy.
		zero := 0.0
		g.Defaults = ioschema.GenerationDefaults{Temperature: &zero, MaxNewTokens: raw.MaxNewTokens}
	}
	if g.EOS, err = parseIDList(raw.EOS); err != nil {
		return nil, fmt.Errorf("%s: eos_token_id: %w", path, err)
	}
	return g, nil
}
