package ioschema

import (
	"encoding/base64"
	"encoding/binary"
)

// EncodeRoutedExperts is SGLang's meta_info.routed_experts: the int32s'
// little-endian bytes in base64, which clients reshape to [-1, layers, k].
func EncodeRoutedExperts(ids []int32) string {
	b := make([]byte, 4*len(ids))
	for i, v := range ids {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(v))
	}
	return base64.StdEncoding.EncodeToString(b)
}
