package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Config is the part of tokenizer_config.json that serving needs.
type Config struct {
	BOSToken     string
	EOSToken     string
	PadToken     string
	ChatTemplate string
	AddBOSToken  bool
}

type rawTokenizerConfig struct {
	BOSToken     json.RawMessage `json:"bos_token"`
	EOSToken     json.RawMessage `json:"eos_token"`
	PadToken     json.RawMessage `json:"pad_token"`
	ChatTemplate json.RawMessage `json:"chat_template"`
	AddBOSToken  bool            `json:"add_bos_token"`
}

// LoadConfig reads dir/tokenizer_config.json (and chat_template.jinja when
// the template lives in its own file). A missing file gives an empty Config.
func LoadConfig(dir string) (*Config, error) {
	data, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	if errors.Is(err, os.ErrNotExist) {
		return &Config{}, nil
	}
	if err != nil {
		return nil, err
	}
	c, err := ParseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, "tokenizer_config.json"), err)
	}
	if c.ChatTemplate == "" {
		if b, err := os.ReadFile(filepath.Join(dir, "chat_template.jinja")); err == nil {
			c.ChatTemplate = string(b)
		}
	}
	return c, nil
}

// ParseConfig parses tokenizer_config.json contents.
func ParseConfig(data []byte) (*Config, error) {
	var r rawTokenizerConfig
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, err
	}
	c := &Config{AddBOSToken: r.AddBOSToken}
	for _, f := range []struct {
		raw json.RawMessage
		dst *string
	}{{r.BOSToken, &c.BOSToken}, {r.EOSToken, &c.EOSToken}, {r.PadToken, &c.PadToken}} {
		s, err := tokenString(f.raw)
		if err != nil {
			return nil, err
		}
		*f.dst = s
	}
	tmpl, err := chatTemplate(r.ChatTemplate)
	if err != nil {
		return nil, err
	}
	c.ChatTemplate = tmpl
	return c, nil
}

// tokenString accepts "tok", {"content": "tok", ...} or null.
func tokenString(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var obj struct {
		Content string `json:"content"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil {
		return "", fmt.Errorf("special token: %w", err)
	}
	return obj.Content, nil
}

// chatTemplate accepts a string or a list of {name, template} (the default
// one is used).
func chatTemplate(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var list []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
	}
	if err := json.Unmarshal(raw, &list); err != nil {
		return "", fmt.Errorf("chat_template: %w", err)
	}
	for _, t := range list {
		if t.Name == "default" {
			return t.Template, nil
		}
	}
	if len(list) > 0 {
		return list[0].Template, nil
	}
	return "", nil
}
