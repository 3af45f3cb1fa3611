package ioschema

// FinishReason is SGLang's meta_info.finish_reason.
type FinishReason struct {
	Type    string `msgpack:"type" json:"type"` // stop, length, abort
	Matched any    `msgpack:"matched,omitempty" json:"matched,omitempty"`
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
