package ioschema

import (
	"encoding/json"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func jsonUnmarshal(s string, v any) error { return json.Unmarshal([]byte(s), v) }

// FuzzDecode feeds arbitrary bytes to the decoder: it must return a message
// or an error, never panic, and what it returns must encode again. The seed
// corpus (every sample message and some broken ones) runs in `go test`.
func FuzzDecode(f *testing.F) {
	for _, m := range samples() {
		b, err := Encode(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	for _, v := range []any{
		map[string]any{"type": "GenerateReqInput", "input_ids": [][]any{{1}, {"x"}}},
		map[string]any{"type": "TokenizedGenerateReqInput", "input_ids": []byte{1, 2, 3}},
		map[string]any{"type": "BatchStrOutput", "rids": 5},
		[]any{nil, true},
	} {
		b, _ := msgpack.Marshal(v)
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0xdf, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := Decode(data)
		if err != nil {
			return
		}
		if _, err := Encode(m); err != nil {
			t.Fatalf("decoded %T does not encode: %v", m, err)
		}
	})
}
