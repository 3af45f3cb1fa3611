package tokenizer

// StreamDecoder turns a growing sequence of ids into text deltas that never
// split a UTF-8 character.
type StreamDecoder struct {
	tok         *Tokenizer
	skipSpecial bool
	pending     []byte
}

// NewStreamDecoder starts an empty incremental decode.
func (t *Tokenizer) NewStreamDecoder(skipSpecial bool) *StreamDecoder {
	return &StreamDecoder{tok: t, skipSpecial: skipSpecial}
}

// Add appends one token and returns the text that became complete.
func (d *StreamDecoder) Add(id int32) string {
	d.pending = d.tok.AppendTokenBytes(d.pending, id, d.skipSpecial)
	n := completePrefixLen(d.pending)
	if n == 0 {
		return ""
	}
	out := lossyString(d.pending[:n])
	d.pending = append(d.pending[:0], d.pending[n:]...)
	return out
}

// Flush returns whatever is still held back (an incomplete character decodes
// to U+FFFD), for the end of a stream.
func (d *StreamDecoder) Flush() string {
	out := lossyString(d.pending)
	d.pending = d.pending[:0]
	return out
}
