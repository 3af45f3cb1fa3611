package safetensors

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestWriteOpenRoundTrip(t *testing.T) {
	dir := t.TempDir()
	vals := []float32{1, -2.5, 3.25, 0.1, 1e-3, -7}
	tests := []struct {
		dtype DType
		tol   float32
	}{{F32, 0}, {BF16, 0.01}}
	for _, tc := range tests {
		data, err := EncodeFloat32(vals, tc.dtype)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, string(tc.dtype)+".safetensors")
		err = Write(path, []Writable{{Name: "w", DType: tc.dtype, Shape: []int{2, 3}, Data: data}}, map[string]string{"format": "pt"})
		if err != nil {
			t.Fatal(err)
		}
		f, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		tensor := f.Tensors["w"]
		if tensor == nil || !slices.Equal(tensor.Shape, []int{2, 3}) || f.Metadata["format"] != "pt" {
			t.Fatalf("%s: bad tensor %+v", tc.dtype, tensor)
		}
		got, err := tensor.Float32()
		if err != nil {
			t.Fatal(err)
		}
		for i := range vals {
			if d := got[i] - vals[i]; d > tc.tol*abs(vals[i]) || -d > tc.tol*abs(vals[i]) {
				t.Fatalf("%s: element %d = %v, want %v", tc.dtype, i, got[i], vals[i])
			}
		}
		f.Close()
	}
}

func abs(x float32) float32 {
	if x < 0 {
		return -x
	}
	return x
}

func TestShardedIndex(t *testing.T) {
	dir := t.TempDir()
	one, _ := EncodeFloat32([]float32{1, 2}, F32)
	two, _ := EncodeFloat32([]float32{3}, F32)
	must(t, Write(filepath.Join(dir, "model-00001-of-00002.safetensors"), []Writable{{Name: "a", DType: F32, Shape: []int{2}, Data: one}}, nil))
	must(t, Write(filepath.Join(dir, "model-00002-of-00002.safetensors"), []Writable{{Name: "b", DType: F32, Shape: []int{1}, Data: two}}, nil))
	idx, _ := json.Marshal(map[string]any{"weight_map": map[string]string{
		"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
	must(t, os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), idx, 0o644))
	s, err := OpenDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !slices.Equal(s.Names(), []string{"a", "b"}) {
		t.Fatalf("names %v", s.Names())
	}
	b, _ := s.Get("b")
	v, _ := b.Float32()
	if v[0] != 3 {
		t.Fatalf("b = %v", v)
	}
}

func TestCorruptHeaders(t *testing.T) {
	dir := t.TempDir()
	cases := map[string][]byte{
		"short":        {1, 2, 3},
		"huge-length":  {0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, '{', '}'},
		"bad-json":     append([]byte{2, 0, 0, 0, 0, 0, 0, 0}, '{', 'x'),
		"bad-offsets":  withHeader(`{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}`, 8),
		"bad-dtype":    withHeader(`{"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}}`, 1),
		"out-of-range": withHeader(`{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, 2),
	}
	for name, data := range cases {
		p := filepath.Join(dir, name)
		must(t, os.WriteFile(p, data, 0o644))
		if _, err := Open(p); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func withHeader(h string, body int) []byte {
	b := make([]byte, 8, 8+len(h)+body)
	b[0] = byte(len(h))
	b = append(b, h...)
	return append(b, make([]byte, body)...)
}

func TestBF16Rounding(t *testing.T) {
	cases := map[float32]uint16{1: 0x3f80, -2: 0xc000, 1.00390625: 0x3f80, 1.01171875: 0x3f82}
	for v, want := range cases {
		if got := BF16Bits(v); got != want {
			t.Errorf("BF16Bits(%v) = %#x, want %#x", v, got, want)
		}
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
