package ioschema

import (
	"bytes"
	"encoding/json"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Texts is GenerateReqInput.text: one prompt or a batch.
type Texts struct {
	Items []string
	Batch bool
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (t *Texts) DecodeMsgpack(dec *msgpack.Decoder) error {
	v, err := dec.DecodeInterface()
	if err != nil {
		return err
	}
	return t.from(v)
}

// UnmarshalJSON implements json.Unmarshaler.
func (t *Texts) UnmarshalJSON(b []byte) error {
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	return t.from(v)
}

func (t *Texts) from(v any) error {
	switch x := v.(type) {
	case nil:
		*t = Texts{}
	case string:
		*t = Texts{Items: []string{x}}
	case []any:
		items, err := toStringList(x)
		if err != nil {
			return fmt.Errorf("text: %w", err)
		}
		*t = Texts{Items: items, Batch: true}
	default:
		return fmt.Errorf("text must be a string or a list of strings, got %T", v)
	}
	return nil
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (t Texts) EncodeMsgpack(enc *msgpack.Encoder) error {
	if t.Items == nil {
		return enc.EncodeNil()
	}
	if !t.Batch && len(t.Items) == 1 {
		return enc.EncodeString(t.Items[0])
	}
	return enc.Encode(t.Items)
}

// InputIDBatch is GenerateReqInput.input_ids: one id list or a batch.
type InputIDBatch struct {
	Items [][]int32
	Batch bool
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (b *InputIDBatch) DecodeMsgpack(dec *msgpack.Decoder) error {
	v, err := dec.DecodeInterface()
	if err != nil {
		return err
	}
	return b.from(v)
}

// UnmarshalJSON implements json.Unmarshaler.
func (b *InputIDBatch) UnmarshalJSON(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return err
	}
	return b.from(v)
}

func (b *InputIDBatch) from(v any) error {
	switch x := v.(type) {
	case nil:
		*b = InputIDBatch{}
		return nil
	case []any:
		if len(x) > 0 {
			if _, nested := x[0].([]any); nested {
				out := make([][]int32, len(x))
				for i, e := range x {
					inner, ok := e.([]any)
					if !ok {
						return fmt.Errorf("input_ids[%d] must be a list of token ids", i)
					}
					ids, err := toIDs(inner)
					if err != nil {
						return fmt.Errorf("input_ids[%d]: %w", i, err)
					}
					out[i] = ids
				}
				*b = InputIDBatch{Items: out, Batch: true}
				return nil
			}
		}
		ids, err := toIDs(x)
		if err != nil {
			return fmt.Errorf("input_ids: %w", err)
		}
		*b = InputIDBatch{Items: [][]int32{ids}}
		return nil
	}
	return fmt.Errorf("input_ids must be a list of token ids or a list of such lists, got %T", v)
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (b InputIDBatch) EncodeMsgpack(enc *msgpack.Encoder) error {
	switch {
	case b.Items == nil:
		return enc.EncodeNil()
	case !b.Batch && len(b.Items) == 1:
		return enc.Encode(b.Items[0])
	}
	return enc.Encode(b.Items)
}

func toIDs(x []any) ([]int32, error) {
	out := make([]int32, len(x))
	for i, e := range x {
		var v int64
		switch n := e.(type) {
		case int8:
			v = int64(n)
		case int16:
			v = int64(n)
		case int32:
			v = int64(n)
		case int64:
			v = n
		case uint8:
			v = int64(n)
		case uint16:
			v = int64(n)
		case uint32:
			v = int64(n)
		case uint64:
			v = int64(n)
		case json.Number:
			i64, err := n.Int64()
			if err != nil {
				return nil, fmt.Errorf("%q is not a token id", n)
			}
			v = i64
		default:
			return nil, fmt.Errorf("element %d is %T, not a token id", i, e)
		}
		if v < 0 || v >= 1<<31 {
			return nil, fmt.Errorf("token id %d out of range", v)
		}
		out[i] = int32(v)
	}
	return out, nil
}

// SamplingBatch is GenerateReqInput.sampling_params: one set for every
// prompt, or one per prompt.
type SamplingBatch struct {
	Items []SamplingParams
	Batch bool
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (s *SamplingBatch) DecodeMsgpack(dec *msgpack.Decoder) error {
	code, err := dec.PeekCode()
	if err != nil {
		return err
	}
	if code == 0xc0 { // nil
		*s = SamplingBatch{}
		return dec.DecodeNil()
	}
	// A key SGLang's SamplingParams does not take is an error there (its
	// constructor's), and here: a misspelt parameter is never ignored.
	dec.DisallowUnknownFields(true)
	defer dec.DisallowUnknownFields(false)
	if isArrayCode(code) {
		var items []SamplingParams
		if err := dec.Decode(&items); err != nil {
			return fmt.Errorf("sampling_params: %w", err)
		}
		*s = SamplingBatch{Items: items, Batch: true}
		return nil
	}
	var one SamplingParams
	if err := dec.Decode(&one); err != nil {
		return fmt.Errorf("sampling_params: %w", err)
	}
	*s = SamplingBatch{Items: []SamplingParams{one}}
	return nil
}

func isArrayCode(c byte) bool { return c&0xf0 == 0x90 || c == 0xdc || c == 0xdd }

// EncodeMsgpack implements msgpack.CustomEncoder.
func (s SamplingBatch) EncodeMsgpack(enc *msgpack.Encoder) error {
	switch {
	case s.Items == nil:
		return enc.EncodeNil()
	case !s.Batch && len(s.Items) == 1:
		return enc.Encode(s.Items[0])
	}
	return enc.Encode(s.Items)
}

// UnmarshalJSON implements json.Unmarshaler.
func (s *SamplingBatch) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	strict := func(v any) error {
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields() // as DecodeMsgpack
		if err := dec.Decode(v); err != nil {
			return fmt.Errorf("sampling_params: %w", err)
		}
		return nil
	}
	if len(b) > 0 && b[0] == '[' {
		var items []SamplingParams
		if err := strict(&items); err != nil {
			return err
		}
		*s = SamplingBatch{Items: items, Batch: true}
		return nil
	}
	var one SamplingParams
	if err := strict(&one); err != nil {
		return err
	}
	*s = SamplingBatch{Items: []SamplingParams{one}}
	return nil
}

// For returns the sampling parameters of prompt i.
func (s SamplingBatch) For(i int) (SamplingParams, error) {
	switch {
	case len(s.Items) == 0:
		return SamplingParams{}, nil
	case !s.Batch:
		return s.Items[0], nil
	case i < len(s.Items):
		return s.Items[i], nil
	}
	return SamplingParams{}, fmt.Errorf("sampling_params has %d entries, prompt %d has none", len(s.Items), i)
}

// Rids is GenerateReqInput.rid: one id or one per prompt.
type Rids struct {
	Items []string
	Batch bool
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (r *Rids) DecodeMsgpack(dec *msgpack.Decoder) error {
	var t Texts
	if err := t.DecodeMsgpack(dec); err != nil {
		return fmt.Errorf("rid: %w", err)
	}
	*r = Rids(t)
	return nil
}

// UnmarshalJSON implements json.Unmarshaler.
func (r *Rids) UnmarshalJSON(b []byte) error {
	var t Texts
	if err := t.UnmarshalJSON(b); err != nil {
		return fmt.Errorf("rid: %w", err)
	}
	*r = Rids(t)
	return nil
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (r Rids) EncodeMsgpack(enc *msgpack.Encoder) error { return Texts(r).EncodeMsgpack(enc) }
