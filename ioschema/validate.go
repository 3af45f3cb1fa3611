package ioschema

import (
	"encoding/binary"
	"fmt"
)

// maxDepth bounds nesting; ebb's messages nest a few levels at most.
const maxDepth = 32

// validate walks one msgpack value without allocating and checks that every
// declared length fits in the bytes that remain (a container of n elements
// needs at least n bytes), so that a short message cannot make the decoder
// preallocate gigabytes, and that nesting stays shallow.
func validate(b []byte) error {
	n, err := skip(b, 0)
	if err != nil {
		return err
	}
	if n != len(b) {
		return fmt.Errorf("%d trailing bytes", len(b)-n)
	}
	return nil
}

// skip returns the length of the value at the start of b.
func skip(b []byte, depth int) (int, error) {
	if depth > maxDepth {
		return 0, fmt.Errorf("nested deeper than %d", maxDepth)
	}
	if len(b) == 0 {
		return 0, fmt.Errorf("truncated")
	}
	c := b[0]
	need := func(n int) error {
		if n > len(b) || n < 0 {
			return fmt.Errorf("truncated")
		}
		return nil
	}
	uint := func(off, size int) (int, error) {
		if err := need(off + size); err != nil {
			return 0, err
		}
		switch size {
		case 1:
			return int(b[off]), nil
		case 2:
			return int(binary.BigEndian.Uint16(b[off:])), nil
		default:
			v := binary.BigEndian.Uint32(b[off:])
			if int64(v) > int64(len(b)) {
				return 0, fmt.Errorf("declared length %d exceeds the message", v)
			}
			return int(v), nil
		}
	}
	// payload of length n after a header of h bytes
	bytesOf := func(h, n int) (int, error) { return h + n, need(h + n) }
	// container of n elements (pairs when maps) after a header of h bytes
	container := func(h, n int, pairs bool) (int, error) {
		items := n
		if pairs {
			items = 2 * n
		}
		if items > len(b)-h {
			return 0, fmt.Errorf("container of %d elements in %d bytes", items, len(b)-h)
		}
		off := h
		for i := 0; i < items; i++ {
			k, err := skip(b[off:], depth+1)
			if err != nil {
				return 0, err
			}
			off += k
		}
		return off, nil
	}
	switch {
	case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		return 1, nil
	case c&0xf0 == 0x80:
		return container(1, int(c&0x0f), true)
	case c&0xf0 == 0x90:
		return container(1, int(c&0x0f), false)
	case c&0xe0 == 0xa0:
		return bytesOf(1, int(c&0x1f))
	}
	switch c {
	case 0xcc, 0xd0:
		return bytesOf(1, 1)
	case 0xcd, 0xd1:
		return bytesOf(1, 2)
	case 0xca, 0xce, 0xd2:
		return bytesOf(1, 4)
	case 0xcb, 0xcf, 0xd3:
		return bytesOf(1, 8)
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16 (+ type byte)
		return bytesOf(2, 1<<(c-0xd4))
	case 0xc4, 0xd9: // bin8, str8
		n, err := uint(1, 1)
		if err != nil {
			return 0, err
		}
		return bytesOf(2, n)
	case 0xc5, 0xda:
		n, err := uint(1, 2)
		if err != nil {
			return 0, err
		}
		return bytesOf(3, n)
	case 0xc6, 0xdb:
		n, err := uint(1, 4)
		if err != nil {
			return 0, err
		}
		return bytesOf(5, n)
	case 0xc7, 0xc8, 0xc9: // ext8/16/32: length, type, data
		size := map[byte]int{0xc7: 1, 0xc8: 2, 0xc9: 4}[c]
		n, err := uint(1, size)
		if err != nil {
			return 0, err
		}
		return bytesOf(2+size, n)
	case 0xdc:
		n, err := uint(1, 2)
		if err != nil {
			return 0, err
		}
		return container(3, n, false)
	case 0xdd:
		n, err := uint(1, 4)
		if err != nil {
			return 0, err
		}
		return container(5, n, false)
	case 0xde:
		n, err := uint(1, 2)
		if err != nil {
			return 0, err
		}
		return container(3, n, true)
	case 0xdf:
		n, err := uint(1, 4)
		if err != nil {
			return 0, err
		}
		return container(5, n, true)
	}
	return 0, fmt.Errorf("invalid msgpack code 0x%02x", c)
}
