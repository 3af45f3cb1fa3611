package tokenizer

// byteLevel is GPT-2's reversible map between raw bytes and printable runes:
// BPE vocabularies of byte-level tokenizers are written in these runes.
type byteLevel struct {
	toRune [256]rune
	toByte map[rune]byte
}

func newByteLevel() *byteLevel {
	bl := &byteLevel{toByte: make(map[rune]byte, 256)}
	printable := func(b int) bool {
		return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)
	}
	next := rune(256)
	for b := 0; b < 256; b++ {
		r := rune(b)
		if !printable(b) {
			r = next
			next++
		}
		bl.toRune[b] = r
		bl.toByte[r] = byte(b)
	}
	return bl
}

// encode maps raw bytes to the byte-level alphabet.
func (bl *byteLevel) encode(s string) []rune {
	out := make([]rune, len(s))
	for i := 0; i < len(s); i++ {
		out[i] = bl.toRune[s[i]]
	}
	return out
}

// decode maps a vocabulary string back to raw bytes; runes outside the
// alphabet (only possible in hand-edited vocabularies) pass through as UTF-8.
func (bl *byteLevel) decode(tok string) []byte {
	out := make([]byte, 0, len(tok))
	for _, r := range tok {
		if b, ok := bl.toByte[r]; ok {
			out = append(out, b)
		} else {
			out = append(out, string(r)...)
		}
	}
	return out
}
