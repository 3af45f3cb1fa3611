package tokenizer

import (
	"strings"
	"testing"
	"time"
)

var pathological = []struct{ name, text string }{
	{"spaces", strings.Repeat(" ", 100_000)},
	{"spaces-then-word", strings.Repeat(" ", 100_000) + "x"},
	{"newlines", strings.Repeat("\n \r\n", 25_000)},
	{"letters", strings.Repeat("a", 100_000)},
	{"mixed-letters", strings.Repeat("abcdefghij", 10_000)},
	{"number", strings.Repeat("1234567890", 10_000)},
	{"punctuation", strings.Repeat("!", 100_000)},
	{"cjk", strings.Repeat("中文", 50_000)},
	{"angle-brackets", strings.Repeat("<|", 50_000)},
}

// TestPathologicalInputs guards against super-linear behaviour: a quadratic
// pass over 100k runes takes minutes, so a generous bound catches it without
// turning this into a timing test (BenchmarkPathological gives the figures).
func TestPathologicalInputs(t *testing.T) {
	for _, family := range []string{"qwen3", "llama3"} {
		tk := load(t, family)
		for _, p := range pathological {
			start := time.Now()
			ids := tk.Encode(p.text, false)
			if elapsed := time.Since(start); elapsed > 10*time.Second {
				t.Errorf("%s/%s: %v", family, p.name, elapsed)
			}
			if got := tk.Decode(ids, false); got != p.text {
				t.Errorf("%s/%s: round trip differs", family, p.name)
			}
		}
	}
}

func BenchmarkPathological(b *testing.B) {
	for _, family := range []string{"qwen3", "llama3"} {
		tk := load(b, family)
		for _, p := range pathological {
			b.Run(family+"/"+p.name, func(b *testing.B) {
				b.SetBytes(int64(len(p.text)))
				for b.Loop() {
					tk.bpe.mu.Lock()
					clear(tk.bpe.cache)
					tk.bpe.mu.Unlock()
					tk.Encode(p.text, false)
				}
			})
		}
	}
}
