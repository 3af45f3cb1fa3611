package ioschema

import (
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
