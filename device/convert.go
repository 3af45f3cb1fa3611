package device

import (
	"encoding/binary"
	"math"

	"github.com/x448/float16"

	"ebb/memory"
)

// AllocIn places a tensor in tag's region of m: the allocation both
// backends share.
func AllocIn(m *memory.Manager, tag memory.Tag, dtype DType, shape ...int) (Tensor, error) {
	t := Tensor{DType: dtype, Shape: append([]int(nil), shape...)}
	ptr, err := m.Alloc(tag, max(t.Bytes(), 1))
	if err != nil {
		return Tensor{}, err
	}
	t.Ptr = ptr
	return t, nil
}

// DecodeFloats converts raw little-endian F32, BF16 or F16 elements to
// float32 into dst (len(src)/size elements); it reports false for other
// types.
func DecodeFloats(dst []float32, src []byte, t DType) bool {
	switch t {
	case F32:
		for i := range dst {
			dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
		}
	case BF16:
		for i := range dst {
			dst[i] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(src[2*i:])) << 16)
		}
	case F16:
		for i := range dst {
			dst[i] = float16.Frombits(binary.LittleEndian.Uint16(src[2*i:])).Float32()
		}
	default:
		return false
	}
	return true
}
