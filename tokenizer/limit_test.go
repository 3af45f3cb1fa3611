package tokenizer

import (
	"slices"
	"strings"
	"testing"
)

// TestMinTokens: the bound from a text's length alone holds on ordinary,
// pathological and NFC-composing text.
func TestMinTokens(t *testing.T) {
	texts := []string{
		strings.Repeat(" ", 100_000),
		strings.Repeat("-", 50_000),
		strings.Repeat("\u1100\u1161\u11a8", 20_000), // jamo that NFC composes into syllables
		strings.Repeat("e\u0301", 30_000),
		strings.Repeat("The quick brown fox. ", 5_000),
		strings.Repeat("<|im_start|>", 10_000),
	}
	for _, family := range []string{"qwen3", "llama3"} {
		tk := load(t, family)
		if tk.maxTokenBytes == 0 {
			t.Fatalf("%s: no longest token", family)
		}
		for i, text := range texts {
			if min, got := tk.MinTokens(text), len(tk.Encode(text, false)); min > got || min == 0 {
				t.Errorf("%s text %d: bound %d, %d tokens", family, i, min, got)
			}
		}
	}
}

// TestEncodeLimit: a limited encoding is the full one where it fits, and
// otherwise a prefix of it just past the limit.
func TestEncodeLimit(t *testing.T) {
	texts := []string{
		"Hello, world! The quick brown fox jumps over the lazy dog.",
		strings.Repeat("RL rollouts run for thousands of tokens. ", 200),
		"<|im_start|>user\nhi<|im_end|>\n" + strings.Repeat("数字 12345 ", 100),
		strings.Repeat(" ", 3000) + "x",
	}
	for _, family := range []string{"qwen3", "llama3"} {
		tk := load(t, family)
		for ti, text := range texts {
			for _, special := range []bool{false, true} {
				full := tk.Encode(text, special)
				for _, limit := range []int{-1, 0, 1, 7, len(full) / 2, len(full) - 1, len(full), len(full) + 5} {
					ids, complete := tk.EncodeLimit(text, special, limit)
					switch {
					case complete && !slices.Equal(ids, full):
						t.Errorf("%s text %d limit %d: complete but not the full encoding", family, ti, limit)
					case complete && limit >= 0 && len(ids) > limit:
						t.Errorf("%s text %d limit %d: complete with %d tokens", family, ti, limit, len(ids))
					case !complete && (len(ids) <= limit || !slices.Equal(ids, full[:len(ids)])):
						t.Errorf("%s text %d limit %d: stopped at %d tokens, not a prefix past the limit", family, ti, limit, len(ids))
					case !complete && ti == 1 && len(ids) > limit+8:
						t.Errorf("%s text %d limit %d: ran on to %d tokens", family, ti, limit, len(ids))
					}
				}
			}
		}
	}
}
