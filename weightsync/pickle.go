// Package weightsync receives weights from a trainer process: the pickled
// tensor handles of update_weights_from_tensor (CUDA IPC, or POSIX shared
// memory for CPU tensors), and the TCPStore rendezvous that
// update_weights_from_distributed's NCCL group is built on.
//
// Payloads are read by a restricted unpickler: it knows the few globals
// that PyTorch's ForkingPickler and SGLang's weight buckets use, builds
// plain Go values from them, and refuses everything else. Nothing in a
// payload is ever executed.
package weightsync

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/big"
)

// ErrRefused is wrapped by every error about a payload's content.
var ErrRefused = errors.New("payload refused")

func refuse(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrRefused, fmt.Sprintf(format, a...))
}

// Limits on what a payload may ask for, so a hostile one cannot make the
// decoder allocate or recurse without bound.
const (
	maxItems = 1 << 20 // elements on the stack and in all containers
	maxDepth = 64
)

// Pickle values are Go values: nil, bool, int64, *big.Int, float64,
// string, []byte, Tuple, *List, *Dict, and what the known globals build.
type (
	// Tuple is a pickled tuple.
	Tuple []any
	// List is a pickled list (a pointer: APPEND mutates it).
	List struct{ Items []any }
	// Dict is a pickled dict with string keys.
	Dict struct{ Items map[string]any }
)

// global is a name a payload refers to, and what it builds when called
// (REDUCE) or instantiated (NEWOBJ and BUILD).
type global struct {
	name string
	// call builds a value from REDUCE's arguments; nil: not callable.
	call func(args Tuple) (any, error)
	// object builds a value from NEWOBJ then BUILD's state; nil: not a class.
	object func(state map[string]any) (any, error)
}

// instance is an object between NEWOBJ and BUILD.
type instance struct {
	class *global
	built any
}

// unpickler holds the decoding state.
type unpickler struct {
	data    []byte
	pos     int
	stack   []any
	marks   []int
	memo    map[uint32]any
	globals func(module, name string) (*global, error)
	built   func(any) // sees every value a global builds, even if decoding fails later
	items   int
}

// unpickle decodes a pickle stream whose globals are resolved by globals;
// built sees each value that REDUCE or BUILD makes.
func unpickle(data []byte, globals func(module, name string) (*global, error), built func(any)) (v any, err error) {
	defer func() {
		if r := recover(); r != nil {
			v, err = nil, refuse("malformed pickle: %v", r)
		}
	}()
	u := &unpickler{data: data, memo: map[uint32]any{}, globals: globals, built: built}
	return u.run()
}

func (u *unpickler) need(n int) []byte {
	if n < 0 || u.pos+n > len(u.data) {
		panic(fmt.Sprintf("truncated at byte %d (needs %d more)", u.pos, n))
	}
	b := u.data[u.pos : u.pos+n]
	u.pos += n
	return b
}

func (u *unpickler) u8() int  { return int(u.need(1)[0]) }
func (u *unpickler) u16() int { return int(binary.LittleEndian.Uint16(u.need(2))) }
func (u *unpickler) u32() int { return int(binary.LittleEndian.Uint32(u.need(4))) }
func (u *unpickler) u64() int {
	v := binary.LittleEndian.Uint64(u.need(8))
	if v > uint64(len(u.data)) {
		panic(fmt.Sprintf("length %d exceeds the payload", v))
	}
	return int(v)
}

func (u *unpickler) push(v any) {
	u.items++
	if u.items > maxItems || len(u.stack) > maxItems {
		panic("too many elements")
	}
	u.stack = append(u.stack, v)
}

func (u *unpickler) pop() any {
	if len(u.stack) == 0 || (len(u.marks) > 0 && len(u.stack) == u.marks[len(u.marks)-1]) {
		panic("stack underflow")
	}
	v := u.stack[len(u.stack)-1]
	u.stack = u.stack[:len(u.stack)-1]
	return v
}

func (u *unpickler) top() any {
	if len(u.stack) == 0 {
		panic("stack underflow")
	}
	return u.stack[len(u.stack)-1]
}

// popMark returns the items above the last mark.
func (u *unpickler) popMark() []any {
	if len(u.marks) == 0 {
		panic("no mark")
	}
	m := u.marks[len(u.marks)-1]
	u.marks = u.marks[:len(u.marks)-1]
	items := append([]any(nil), u.stack[m:]...)
	u.stack = u.stack[:m]
	return items
}

func (u *unpickler) run() (any, error) {
	for {
		op := u.u8()
		switch op {
		case 0x80: // PROTO
			if p := u.u8(); p < 2 || p > 5 {
				return nil, refuse("pickle protocol %d (2 to 5 are read)", p)
			}
		case 0x95: // FRAME
			u.need(8)
		case '.': // STOP
			if len(u.stack) != 1 || len(u.marks) != 0 {
				return nil, refuse("malformed pickle: %d values left at STOP", len(u.stack))
			}
			return u.stack[0], nil
		case '(': // MARK
			u.marks = append(u.marks, len(u.stack))
		case '0': // POP
			u.pop()
		case '1': // POP_MARK
			u.popMark()
		case '2': // DUP
			u.push(u.top())
		case 'N':
			u.push(nil)
		case 0x88:
			u.push(true)
		case 0x89:
			u.push(false)
		case 'J': // BININT
			u.push(int64(int32(binary.LittleEndian.Uint32(u.need(4)))))
		case 'K': // BININT1
			u.push(int64(u.u8()))
		case 'M': // BININT2
			u.push(int64(u.u16()))
		case 0x8a: // LONG1
			u.push(decodeLong(u.need(u.u8())))
		case 0x8b: // LONG4
			n := u.u32()
			if n > 64 {
				return nil, refuse("integer of %d bytes", n)
			}
			u.push(decodeLong(u.need(n)))
		case 'G': // BINFLOAT
			u.push(math.Float64frombits(binary.BigEndian.Uint64(u.need(8))))
		case 0x8c: // SHORT_BINUNICODE
			u.push(string(u.need(u.u8())))
		case 'X': // BINUNICODE
			u.push(string(u.need(u.u32())))
		case 0x8d: // BINUNICODE8
			u.push(string(u.need(u.u64())))
		case 'C': // SHORT_BINBYTES
			u.push(append([]byte(nil), u.need(u.u8())...))
		case 'B': // BINBYTES
			u.push(append([]byte(nil), u.need(u.u32())...))
		case 0x8e: // BINBYTES8
			u.push(append([]byte(nil), u.need(u.u64())...))
		case ']': // EMPTY_LIST
			u.push(&List{})
		case 'l': // LIST
			u.push(&List{Items: u.popMark()})
		case 'a': // APPEND
			v := u.pop()
			l, ok := u.top().(*List)
			if !ok {
				return nil, refuse("APPEND to %T", u.top())
			}
			l.Items = append(l.Items, v)
		case 'e': // APPENDS
			items := u.popMark()
			l, ok := u.top().(*List)
			if !ok {
				return nil, refuse("APPENDS to %T", u.top())
			}
			l.Items = append(l.Items, items...)
		case ')':
			u.push(Tuple{})
		case 't':
			u.push(Tuple(u.popMark()))
		case 0x85:
			u.push(Tuple{u.pop()})
		case 0x86:
			b, a := u.pop(), u.pop()
			u.push(Tuple{a, b})
		case 0x87:
			c, b, a := u.pop(), u.pop(), u.pop()
			u.push(Tuple{a, b, c})
		case '}': // EMPTY_DICT
			u.push(&Dict{Items: map[string]any{}})
		case 'd': // DICT
			d := &Dict{Items: map[string]any{}}
			if err := setItems(d, u.popMark()); err != nil {
				return nil, err
			}
			u.push(d)
		case 's': // SETITEM
			v, k := u.pop(), u.pop()
			d, ok := u.top().(*Dict)
			if !ok {
				return nil, refuse("SETITEM on %T", u.top())
			}
			if err := setItems(d, []any{k, v}); err != nil {
				return nil, err
			}
		case 'u': // SETITEMS
			items := u.popMark()
			d, ok := u.top().(*Dict)
			if !ok {
				return nil, refuse("SETITEMS on %T", u.top())
			}
			if err := setItems(d, items); err != nil {
				return nil, err
			}
		case 'c': // GLOBAL "module\nname\n"
			module, name := u.line(), u.line()
			g, err := u.globals(module, name)
			if err != nil {
				return nil, err
			}
			u.push(g)
		case 0x93: // STACK_GLOBAL
			name, ok1 := u.pop().(string)
			module, ok2 := u.pop().(string)
			if !ok1 || !ok2 {
				return nil, refuse("STACK_GLOBAL of non-strings")
			}
			g, err := u.globals(module, name)
			if err != nil {
				return nil, err
			}
			u.push(g)
		case 'R': // REDUCE
			args, ok := u.pop().(Tuple)
			g, okg := u.pop().(*global)
			if !ok || !okg || g.call == nil {
				return nil, refuse("REDUCE of something that is not a known function")
			}
			v, err := g.call(args)
			if err != nil {
				return nil, err
			}
			u.built(v)
			u.push(v)
		case 0x81: // NEWOBJ
			if _, ok := u.pop().(Tuple); !ok {
				return nil, refuse("NEWOBJ without a tuple of arguments")
			}
			g, ok := u.pop().(*global)
			if !ok || g.object == nil {
				return nil, refuse("NEWOBJ of something that is not a known class")
			}
			u.push(&instance{class: g})
		case 'b': // BUILD
			state := u.pop()
			in, ok := u.top().(*instance)
			if !ok || in.built != nil {
				return nil, refuse("BUILD of %T", u.top())
			}
			d, ok := state.(*Dict)
			if !ok {
				return nil, refuse("%s: state is %T, not a dict", in.class.name, state)
			}
			v, err := in.class.object(d.Items)
			if err != nil {
				return nil, err
			}
			u.built(v)
			u.stack[len(u.stack)-1] = v
		case 0x94: // MEMOIZE
			u.memo[uint32(len(u.memo))] = u.top()
		case 'q': // BINPUT
			u.memo[uint32(u.u8())] = u.top()
		case 'r': // LONG_BINPUT
			u.memo[uint32(u.u32())] = u.top()
		case 'h': // BINGET
			u.get(uint32(u.u8()))
		case 'j': // LONG_BINGET
			u.get(uint32(u.u32()))
		default:
			return nil, refuse("pickle opcode 0x%02x at byte %d is not one that tensor payloads use", op, u.pos-1)
		}
		if len(u.marks) > maxDepth {
			return nil, refuse("nested deeper than %d", maxDepth)
		}
	}
}

func (u *unpickler) get(k uint32) {
	v, ok := u.memo[k]
	if !ok {
		panic(fmt.Sprintf("memo %d is not set", k))
	}
	u.push(v)
}

func (u *unpickler) line() string {
	start := u.pos
	for u.pos < len(u.data) && u.data[u.pos] != '\n' {
		u.pos++
	}
	if u.pos == len(u.data) {
		panic("truncated GLOBAL")
	}
	u.pos++
	return string(u.data[start : u.pos-1])
}

func setItems(d *Dict, items []any) error {
	if len(items)%2 != 0 {
		return refuse("odd number of dict items")
	}
	for i := 0; i < len(items); i += 2 {
		k, ok := items[i].(string)
		if !ok {
			return refuse("dict key of type %T (string keys only)", items[i])
		}
		d.Items[k] = items[i+1]
	}
	return nil
}

// decodeLong reads a little-endian two's-complement integer.
func decodeLong(b []byte) any {
	if len(b) == 0 {
		return int64(0)
	}
	if len(b) <= 8 {
		var v uint64
		for i := len(b) - 1; i >= 0; i-- {
			v = v<<8 | uint64(b[i])
		}
		shift := 64 - 8*uint(len(b))
		return int64(v<<shift) >> shift
	}
	be := make([]byte, len(b))
	for i := range b {
		be[len(b)-1-i] = b[i]
	}
	n := new(big.Int).SetBytes(be)
	if b[len(b)-1]&0x80 != 0 {
		n.Sub(n, new(big.Int).Lsh(big.NewInt(1), uint(8*len(b))))
	}
	return n
}
