// Package ioschema is ebb's wire format: SGLang's request and output structs
// as msgpack maps carrying their struct name under "type". Unknown fields
// are ignored, missing ones take SGLang's defaults, and a wrong type or an
// unknown "type" is an error (never a panic). PROTOCOL.md documents each
// message.
package ioschema

import (
	"bytes"
	"errors"
	"fmt"
	"sort"

	"github.com/vmihailenco/msgpack/v5"
)

// Message is any wire message.
type Message interface {
	// TypeName is the SGLang struct name written under "type".
	TypeName() string
}

// Defaulter is implemented by messages with defaults other than zero values.
type Defaulter interface {
	applyDefaults()
}

// registry maps "type" names to constructors.
var registry = map[string]func() Message{}

func register(f func() Message) { registry[f().TypeName()] = f }

// TypeNames lists every registered message type, sorted.
func TypeNames() []string {
	names := make([]string, 0, len(registry))
	for n := range registry {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// New returns an empty message of a registered type.
func New(typeName string) (Message, error) {
	f, ok := registry[typeName]
	if !ok {
		return nil, fmt.Errorf("%w %q", ErrUnknownType, typeName)
	}
	return f(), nil
}

// Errors returned by Decode.
var (
	ErrUnknownType = errors.New("unknown message type")
	ErrMalformed   = errors.New("malformed message")
)

type envelope struct {
	Type   string `msgpack:"type"`
	Rid    Value  `msgpack:"rid"`
	APIKey Value  `msgpack:"api_key"` // ebb: the server's --api-key, on the external socket
}

// Value holds any msgpack value. msgpack/v5 panics when a key of an
// interface{} field repeats; Value decodes every occurrence afresh.
type Value struct{ V any }

// DecodeMsgpack implements msgpack.CustomDecoder.
func (v *Value) DecodeMsgpack(dec *msgpack.Decoder) error {
	x, err := dec.DecodeInterface()
	v.V = x
	return err
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (v Value) EncodeMsgpack(enc *msgpack.Encoder) error { return enc.Encode(v.V) }

// Encode writes m as a msgpack map with its "type".
func Encode(m Message) ([]byte, error) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	raw, err := msgpack.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode %s: %w", m.TypeName(), err)
	}
	// Splice "type" into the struct's map: decode the map header, write a
	// header one larger, the type entry, then the original entries.
	dec := msgpack.NewDecoder(bytes.NewReader(raw))
	n, err := dec.DecodeMapLen()
	if err != nil {
		return nil, fmt.Errorf("encode %s: not a map: %w", m.TypeName(), err)
	}
	if err := enc.EncodeMapLen(n + 1); err != nil {
		return nil, err
	}
	if err := enc.EncodeString("type"); err != nil {
		return nil, err
	}
	if err := enc.EncodeString(m.TypeName()); err != nil {
		return nil, err
	}
	hdr := mapHeaderLen(raw)
	buf.Write(raw[hdr:])
	return buf.Bytes(), nil
}

// mapHeaderLen is the size of the msgpack map header at the start of b.
func mapHeaderLen(b []byte) int {
	switch {
	case b[0]&0xf0 == 0x80: // fixmap
		return 1
	case b[0] == 0xde: // map16
		return 3
	default: // map32
		return 5
	}
}

// Decode reads one message, dispatching on "type". A failure names the
// problem; RidOf can still recover the request id for the error reply.
func Decode(b []byte) (m Message, err error) {
	defer func() {
		// The msgpack library can panic on adversarial input; a bad
		// message must never take a process down.
		if r := recover(); r != nil {
			m, err = nil, fmt.Errorf("%w: %v", ErrMalformed, r)
		}
	}()
	if err := validate(b); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	var env envelope
	if err := msgpack.Unmarshal(b, &env); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	if env.Type == "" {
		return nil, fmt.Errorf("%w: no \"type\" field", ErrMalformed)
	}
	m, err = New(env.Type)
	if err != nil {
		return nil, err
	}
	if err := msgpack.Unmarshal(b, m); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrMalformed, env.Type, err)
	}
	if d, ok := m.(Defaulter); ok {
		d.applyDefaults()
	}
	return m, nil
}

// ApplyDefaults fills SGLang's non-zero defaults of a message decoded by
// other means (JSON bodies).
func ApplyDefaults(m Message) {
	if d, ok := m.(Defaulter); ok {
		d.applyDefaults()
	}
}

// RidOf extracts "rid" from a message that may not decode as a whole, so
// that an error reply can still echo it. Non-string rids are formatted.
func RidOf(b []byte) string {
	env := envelopeOf(b)
	if env.Rid.V == nil {
		return ""
	}
	if s, ok := env.Rid.V.(string); ok {
		return s
	}
	return fmt.Sprint(env.Rid.V)
}

// APIKeyOf extracts "api_key" ("" when absent or not a string).
func APIKeyOf(b []byte) string {
	s, _ := envelopeOf(b).APIKey.V.(string)
	return s
}

func envelopeOf(b []byte) (env envelope) {
	defer func() {
		if recover() != nil {
			env = envelope{}
		}
	}()
	if validate(b) != nil || msgpack.Unmarshal(b, &env) != nil {
		return envelope{}
	}
	return env
}
