package tokenizer

import (
	"fmt"
	"unicode"
	"unicode/utf8"
)

// The pre-tokenizer patterns ebb understands. They are matched by a
// hand-written scanner: Go's regexp has no lookahead, and backtracking
// engines are quadratic on long whitespace runs.
const (
	// Qwen2/Qwen3 and GPT-4 style: one digit at a time.
	patternQwen = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// Llama-3: digits in groups of up to three.
	patternLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// GPT-2, used by ByteLevel pre-tokenizers with use_regex=true.
	patternGPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// splitter cuts normalized text into pre-tokens, in order, until emit
// returns false.
type splitter interface {
	split(s string, emit func(piece string) bool)
}

func splitterFor(pattern string) (splitter, error) {
	switch pattern {
	case patternQwen:
		return gpt4Splitter{maxDigits: 1}, nil
	case patternLlama3:
		return gpt4Splitter{maxDigits: 3}, nil
	case patternGPT2:
		return gpt2Splitter{}, nil
	}
	return nil, fmt.Errorf("unsupported pre-tokenizer pattern %q", pattern)
}

func isSpace(r rune) bool  { return unicode.IsSpace(r) }
func isLetter(r rune) bool { return unicode.IsLetter(r) }
func isNumber(r rune) bool { return unicode.IsNumber(r) }
func isCRLF(r rune) bool   { return r == '\r' || r == '\n' }

// runeAt decodes the rune at byte offset i (utf8.RuneError, 0 at the end).
func runeAt(s string, i int) (rune, int) {
	if i >= len(s) {
		return utf8.RuneError, 0
	}
	return utf8.DecodeRuneInString(s[i:])
}

// contraction matches (?i:'s|'t|'re|'ve|'m|'ll|'d) at i, with Unicode
// simple case folding as Oniguruma applies it (ſ folds to s).
func contraction(s string, i int, caseless bool) int {
	if i >= len(s) || s[i] != '\'' {
		return 0
	}
	fold := func(r rune) rune {
		if !caseless {
			return r
		}
		if r == 'ſ' {
			return 's'
		}
		return unicode.ToLower(r)
	}
	r1, n1 := runeAt(s, i+1)
	if n1 == 0 {
		return 0
	}
	switch fold(r1) {
	case 's', 't', 'm', 'd':
		return 1 + n1
	case 'r', 'v':
		if r2, n2 := runeAt(s, i+1+n1); n2 > 0 && fold(r2) == 'e' {
			return 1 + n1 + n2
		}
	case 'l':
		if r2, n2 := runeAt(s, i+1+n1); n2 > 0 && fold(r2) == 'l' {
			return 1 + n1 + n2
		}
	}
	return 0
}

// span advances from i over runes satisfying pred and returns the end offset
// and the number of runes consumed (at most max when max > 0).
func span(s string, i int, pred func(rune) bool, max int) (int, int) {
	n := 0
	for i < len(s) && (max <= 0 || n < max) {
		r, w := utf8.DecodeRuneInString(s[i:])
		if !pred(r) {
			break
		}
		i += w
		n++
	}
	return i, n
}

func notSpaceLetterNumber(r rune) bool { return !isSpace(r) && !isLetter(r) && !isNumber(r) }

// whitespaceTail handles the last three alternatives common to GPT-2 and
// GPT-4 patterns, at a position holding whitespace: `\s*[\r\n]+` (only when
// withNewlines), `\s+(?!\S)`, `\s+`.
func whitespaceTail(s string, i int, withNewlines bool) int {
	end, _ := span(s, i, isSpace, 0)
	if withNewlines {
		lastNL := -1
		for j := i; j < end; {
			r, w := utf8.DecodeRuneInString(s[j:])
			if isCRLF(r) {
				lastNL = j + w
			}
			j += w
		}
		if lastNL > 0 {
			return lastNL
		}
	}
	if end == len(s) {
		return end
	}
	// \s+(?!\S): give back the last whitespace rune so the next one is not \S.
	_, lastW := utf8.DecodeLastRuneInString(s[:end])
	if end-lastW > i {
		return end - lastW
	}
	return end // \s+
}

// gpt4Splitter implements patternQwen and patternLlama3.
type gpt4Splitter struct{ maxDigits int }

func (g gpt4Splitter) split(s string, emit func(string) bool) {
	for i := 0; i < len(s); {
		end := g.match(s, i)
		if !emit(s[i:end]) {
			return
		}
		i = end
	}
}

func (g gpt4Splitter) match(s string, i int) int {
	if n := contraction(s, i, true); n > 0 {
		return i + n
	}
	r, w := runeAt(s, i)
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if isLetter(r) {
		end, _ := span(s, i, isLetter, 0)
		return end
	}
	if !isCRLF(r) && !isNumber(r) {
		if r2, _ := runeAt(s, i+w); isLetter(r2) {
			end, _ := span(s, i+w, isLetter, 0)
			return end
		}
	}
	// \p{N}{1,max}
	if isNumber(r) {
		end, _ := span(s, i, isNumber, g.maxDigits)
		return end
	}
	//  ?[^\s\p{L}\p{N}]+[\r\n]*
	start := i
	if r == ' ' {
		if r2, _ := runeAt(s, i+w); notSpaceLetterNumber(r2) && i+w < len(s) {
			start = i + w
		}
	}
	if r2, _ := runeAt(s, start); start < len(s) && notSpaceLetterNumber(r2) {
		end, _ := span(s, start, notSpaceLetterNumber, 0)
		end, _ = span(s, end, isCRLF, 0)
		return end
	}
	return whitespaceTail(s, i, true)
}

// gpt2Splitter implements patternGPT2.
type gpt2Splitter struct{}

func (gpt2Splitter) split(s string, emit func(string) bool) {
	for i := 0; i < len(s); {
		end := gpt2Match(s, i)
		if !emit(s[i:end]) {
			return
		}
		i = end
	}
}

func gpt2Match(s string, i int) int {
	if n := contraction(s, i, false); n > 0 {
		return i + n
	}
	r, w := runeAt(s, i)
	start := i
	if r == ' ' && i+w < len(s) {
		start = i + w
	}
	r2, _ := runeAt(s, start)
	for _, class := range []func(rune) bool{isLetter, isNumber, notSpaceLetterNumber} {
		if start < len(s) && class(r2) {
			end, _ := span(s, start, class, 0)
			return end
		}
	}
	if !isSpace(r) {
		return i + w // unreachable for valid input: every rune is in some class
	}
	return whitespaceTail(s, i, false)
}
