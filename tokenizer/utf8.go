package tokenizer

import "unicode/utf8"

// lossyString converts bytes to a string the way Rust's String::from_utf8_lossy
// (and so Hugging Face's decoders) does: every maximal invalid subpart becomes
// one U+FFFD.
func lossyString(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	out := make([]byte, 0, len(b)+8)
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r != utf8.RuneError || n > 1 {
			out = append(out, b[i:i+n]...)
			i += n
			continue
		}
		i += invalidSubpartLen(b[i:])
		out = utf8.AppendRune(out, utf8.RuneError)
	}
	return string(out)
}

// invalidSubpartLen is the length of the maximal prefix of b that starts a
// well-formed UTF-8 sequence but cannot finish one (at least 1).
func invalidSubpartLen(b []byte) int {
	need, lo, hi := seqShape(b[0])
	if need == 0 {
		return 1
	}
	n := 1
	for k := 1; k <= need && n < len(b); k++ {
		c := b[n]
		l, h := byte(0x80), byte(0xBF)
		if k == 1 {
			l, h = lo, hi
		}
		if c < l || c > h {
			break
		}
		n++
	}
	return n
}

// seqShape returns how many continuation bytes a lead byte needs and the
// allowed range of the first continuation byte (Unicode Table 3-7).
func seqShape(lead byte) (need int, lo, hi byte) {
	switch {
	case lead >= 0xC2 && lead <= 0xDF:
		return 1, 0x80, 0xBF
	case lead == 0xE0:
		return 2, 0xA0, 0xBF
	case lead == 0xED:
		return 2, 0x80, 0x9F
	case lead >= 0xE1 && lead <= 0xEF:
		return 2, 0x80, 0xBF
	case lead == 0xF0:
		return 3, 0x90, 0xBF
	case lead == 0xF4:
		return 3, 0x80, 0x8F
	case lead >= 0xF1 && lead <= 0xF3:
		return 3, 0x80, 0xBF
	}
	return 0, 0, 0
}

// completePrefixLen is the length of the longest prefix of b that can be
// emitted now: everything except a trailing sequence that may still become
// valid when more bytes arrive.
func completePrefixLen(b []byte) int {
	for back := 1; back <= 3 && back <= len(b); back++ {
		start := len(b) - back
		need, lo, hi := seqShape(b[start])
		if need == 0 {
			if b[start] >= 0x80 && b[start] <= 0xBF {
				continue // continuation byte: keep looking for its lead
			}
			return len(b)
		}
		if back > need {
			return len(b) // the sequence is complete (or already invalid)
		}
		for k := 1; k < back; k++ {
			c := b[start+k]
			l, h := byte(0x80), byte(0xBF)
			if k == 1 {
				l, h = lo, hi
			}
			if c < l || c > h {
				return len(b) // can never complete: emit it as U+FFFD now
			}
		}
		return start
	}
	return len(b)
}
