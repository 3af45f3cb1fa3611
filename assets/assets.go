// Package assets embeds the real tokenizer files that tiny models ship with
// (Qwen3: Apache-2.0; Llama-3: Meta Llama 3 Community License, see README).
package assets

import (
	"bytes"
	"compress/gzip"
	"embed"
	"fmt"
	"io"
)

//go:embed qwen3 llama3
var files embed.FS

// Tokenizers lists the embedded tokenizer families.
var Tokenizers = []string{"qwen3", "llama3"}

// TokenizerJSON returns the uncompressed tokenizer.json of a family.
func TokenizerJSON(family string) ([]byte, error) {
	gz, err := files.ReadFile(family + "/tokenizer.json.gz")
	if err != nil {
		return nil, fmt.Errorf("no embedded tokenizer %q: %w", family, err)
	}
	r, err := gzip.NewReader(bytes.NewReader(gz))
	if err != nil {
		return nil, fmt.Errorf("embedded tokenizer %q: %w", family, err)
	}
	return io.ReadAll(r)
}

// TokenizerConfig returns the tokenizer_config.json of a family.
func TokenizerConfig(family string) ([]byte, error) {
	b, err := files.ReadFile(family + "/tokenizer_config.json")
	if err != nil {
		return nil, fmt.Errorf("no embedded tokenizer config %q: %w", family, err)
	}
	return b, nil
}
