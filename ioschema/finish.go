package ioschema

import "github.com/vmihailenco/msgpack/v5"

// FinishReason is SGLang's meta_info.finish_reason.
type FinishReason struct {
	Type    string `msgpack:"type" json:"type"`           // stop, length, abort
	Matched any    `msgpack:"-" json:"matched,omitempty"` // token id or stop string
	Length  int    `msgpack:"length,omitempty" json:"length,omitempty"`
	Message string `msgpack:"message,omitempty" json:"message,omitempty"`
}

// FinishStopToken ends on a stop or eos token.
func FinishStopToken(id int32) *FinishReason { return &FinishReason{Type: "stop", Matched: id} }

// FinishStopString ends on a stop string.
func FinishStopString(s string) *FinishReason { return &FinishReason{Type: "stop", Matched: s} }

// FinishLength ends at max_new_tokens.
func FinishLength(n int) *FinishReason { return &FinishReason{Type: "length", Length: n} }

// FinishAbort ends a request early.
func FinishAbort(msg string) *FinishReason { return &FinishReason{Type: "abort", Message: msg} }

// finishWire is FinishReason on the wire, with Matched decoded safely.
type finishWire struct {
	Type    string `msgpack:"type"`
	Matched *Value `msgpack:"matched,omitempty"`
	Length  int    `msgpack:"length,omitempty"`
	Message string `msgpack:"message,omitempty"`
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (f *FinishReason) EncodeMsgpack(enc *msgpack.Encoder) error {
	w := finishWire{Type: f.Type, Length: f.Length, Message: f.Message}
	if f.Matched != nil {
		w.Matched = &Value{f.Matched}
	}
	return enc.Encode(&w)
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (f *FinishReason) DecodeMsgpack(dec *msgpack.Decoder) error {
	var w finishWire
	if err := dec.Decode(&w); err != nil {
		return err
	}
	*f = FinishReason{Type: w.Type, Length: w.Length, Message: w.Message}
	if w.Matched != nil {
		f.Matched = w.Matched.V
	}
	return nil
}
