package safetensors

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"sort"
)

// Writable is a tensor to be written: Data holds its raw little-endian bytes.
type Writable struct {
	Name  string
	DType DType
	Shape []int
	Data  []byte
}

// Write stores tensors in one safetensors file, sorted by name as
// Hugging Face's writer does.
func Write(path string, tensors []Writable, metadata map[string]string) error {
	sort.Slice(tensors, func(i, j int) bool { return tensors[i].Name < tensors[j].Name })
	header := map[string]any{}
	if len(metadata) > 0 {
		header["__metadata__"] = metadata
	}
	var off int64
	for _, t := range tensors {
		n := int64(t.DType.Size())
		for _, d := range t.Shape {
			n *= int64(d)
		}
		if n != int64(len(t.Data)) {
			return fmt.Errorf("tensor %s: %d bytes for shape %v of %s", t.Name, len(t.Data), t.Shape, t.DType)
		}
		header[t.Name] = headerEntry{DType: t.DType, Shape: t.Shape, Offsets: [2]int64{off, off + n}}
		off += n
	}
	h, err := json.Marshal(header)
	if err != nil {
		return err
	}
	for len(h)%8 != 0 { // keep tensor data 8-byte aligned
		h = append(h, ' ')
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(f, 1<<20)
	var lenBuf [8]byte
	binary.LittleEndian.PutUint64(lenBuf[:], uint64(len(h)))
	w.Write(lenBuf[:])
	w.Write(h)
	for _, t := range tensors {
		w.Write(t.Data)
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// EncodeFloat32 converts float32 values to raw bytes of dtype (F32 or BF16,
// rounding to nearest even).
func EncodeFloat32(vals []float32, dtype DType) ([]byte, error) {
	switch dtype {
	case F32:
		b := make([]byte, 4*len(vals))
		for i, v := range vals {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
		}
		return b, nil
	case BF16:
		b := make([]byte, 2*len(vals))
		for i, v := range vals {
			binary.LittleEndian.PutUint16(b[2*i:], BF16Bits(v))
		}
		return b, nil
	}
	return nil, fmt.Errorf("cannot encode float32 as %s", dtype)
}

// BF16Bits rounds a float32 to bfloat16, nearest even, NaN kept quiet.
func BF16Bits(v float32) uint16 {
	u := math.Float32bits(v)
	if u&0x7fffffff > 0x7f800000 {
		return uint16(u>>16) | 0x40
	}
	u += 0x7fff + (u>>16)&1
	return uint16(u >> 16)
}
