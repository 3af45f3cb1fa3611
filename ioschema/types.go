package ioschema

import (
	"encoding/base64"
	"encoding/json"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// StringList accepts a string or a list of strings, as SGLang's "stop" does.
type StringList []string

// DecodeMsgpack implements msgpack.CustomDecoder.
func (s *StringList) DecodeMsgpack(dec *msgpack.Decoder) error {
	v, err := dec.DecodeInterface()
	if err != nil {
		return err
	}
	out, err := toStringList(v)
	if err != nil {
		return err
	}
	*s = out
	return nil
}

// UnmarshalJSON accepts a string or a list of strings.
func (s *StringList) UnmarshalJSON(b []byte) error {
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	out, err := toStringList(v)
	if err != nil {
		return err
	}
	*s = out
	return nil
}

func toStringList(v any) ([]string, error) {
	switch x := v.(type) {
	case nil:
		return nil, nil
	case string:
		return []string{x}, nil
	case []any:
		out := make([]string, len(x))
		for i, e := range x {
			s, ok := e.(string)
			if !ok {
				return nil, fmt.Errorf("expected a string in the list, got %T", e)
			}
			out[i] = s
		}
		return out, nil
	}
	return nil, fmt.Errorf("expected a string or a list of strings, got %T", v)
}

// Int32s is a list of token ids. It decodes from a msgpack array of
// integers or from a bin of little-endian int32s (the compact form ebb's
// processes may use); it encodes as an array, which every client reads.
type Int32s []int32

// DecodeMsgpack implements msgpack.CustomDecoder.
func (s *Int32s) DecodeMsgpack(dec *msgpack.Decoder) error {
	code, err := dec.PeekCode()
	if err != nil {
		return err
	}
	if isBin(code) {
		b, err := dec.DecodeBytes()
		if err != nil {
			return err
		}
		if len(b)%4 != 0 {
			return fmt.Errorf("token id bin of %d bytes is not int32s", len(b))
		}
		out := make([]int32, len(b)/4)
		for i := range out {
			out[i] = int32(uint32(b[4*i]) | uint32(b[4*i+1])<<8 | uint32(b[4*i+2])<<16 | uint32(b[4*i+3])<<24)
		}
		*s = out
		return nil
	}
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return err
	}
	if n < 0 {
		*s = nil
		return nil
	}
	out := make([]int32, n)
	for i := range out {
		v, err := dec.DecodeInt64()
		if err != nil {
			return fmt.Errorf("token id %d: %w", i, err)
		}
		if v < -1<<31 || v >= 1<<31 {
			return fmt.Errorf("token id %d out of range", v)
		}
		out[i] = int32(v)
	}
	*s = out
	return nil
}

func isBin(code byte) bool { return code == 0xc4 || code == 0xc5 || code == 0xc6 }

// SerializedPayloads is serialized_named_tensors: one payload per TP rank,
// each a base64 string (what SGLang's HTTP clients send) or raw bytes
// (msgpack bin, from the external ZMQ socket). Decoding keeps the bytes.
type SerializedPayloads [][]byte

// DecodeMsgpack implements msgpack.CustomDecoder.
func (s *SerializedPayloads) DecodeMsgpack(dec *msgpack.Decoder) error {
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return err
	}
	if n < 0 {
		*s = nil
		return nil
	}
	out := make([][]byte, n)
	for i := range out {
		code, err := dec.PeekCode()
		if err != nil {
			return err
		}
		if isBin(code) {
			if out[i], err = dec.DecodeBytes(); err != nil {
				return err
			}
			continue
		}
		str, err := dec.DecodeString()
		if err != nil {
			return fmt.Errorf("serialized_named_tensors[%d]: %w", i, err)
		}
		if out[i], err = base64.StdEncoding.DecodeString(str); err != nil {
			return fmt.Errorf("serialized_named_tensors[%d]: not base64: %w", i, err)
		}
	}
	*s = out
	return nil
}

// UnmarshalJSON accepts a list of base64 strings.
func (s *SerializedPayloads) UnmarshalJSON(b []byte) error {
	var strs []string
	if err := json.Unmarshal(b, &strs); err != nil {
		return fmt.Errorf("serialized_named_tensors must be a list of base64 strings: %w", err)
	}
	out := make([][]byte, len(strs))
	for i, str := range strs {
		var err error
		if out[i], err = base64.StdEncoding.DecodeString(str); err != nil {
			return fmt.Errorf("serialized_named_tensors[%d]: not base64: %w", i, err)
		}
	}
	*s = out
	return nil
}
