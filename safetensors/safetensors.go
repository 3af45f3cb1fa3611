// Package safetensors reads (memory-mapped) and writes Hugging Face
// safetensors files, single or sharded.
package safetensors

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"

	"github.com/x448/float16"
	"golang.org/x/sys/unix"
)

// DType is a safetensors element type.
type DType string

// Element types ebb reads.
const (
	F32  DType = "F32"
	F16  DType = "F16"
	BF16 DType = "BF16"
	I32  DType = "I32"
	I64  DType = "I64"
)

// Size is the element size in bytes (0 for unknown types).
func (d DType) Size() int {
	switch d {
	case F32, I32:
		return 4
	case F16, BF16:
		return 2
	case I64:
		return 8
	}
	return 0
}

// Tensor is a view of one tensor's bytes inside a mapped file.
type Tensor struct {
	Name  string
	DType DType
	Shape []int
	Data  []byte
}

// Numel is the number of elements.
func (t *Tensor) Numel() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// Float32 converts the tensor to float32 (from F32, F16 or BF16).
func (t *Tensor) Float32() ([]float32, error) {
	out := make([]float32, t.Numel())
	return out, t.DecodeInto(out)
}

// DecodeInto converts the tensor to float32 into dst (len(dst) == Numel()).
func (t *Tensor) DecodeInto(dst []float32) error {
	n := t.Numel()
	if len(dst) != n {
		return fmt.Errorf("tensor %s: %d elements, destination holds %d", t.Name, n, len(dst))
	}
	switch t.DType {
	case F32:
		for i := range dst {
			dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:]))
		}
	case BF16:
		for i := range dst {
			dst[i] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(t.Data[2*i:])) << 16)
		}
	case F16:
		for i := range dst {
			dst[i] = float16.Frombits(binary.LittleEndian.Uint16(t.Data[2*i:])).Float32()
		}
	default:
		return fmt.Errorf("tensor %s: dtype %s is not a float type", t.Name, t.DType)
	}
	return nil
}

type headerEntry struct {
	DType   DType    `json:"dtype"`
	Shape   []int    `json:"shape"`
	Offsets [2]int64 `json:"data_offsets"`
}

// File is one memory-mapped safetensors file.
type File struct {
	Path     string
	Tensors  map[string]*Tensor
	Metadata map[string]string
	mapped   []byte
}

// Open maps a safetensors file read-only and parses its header.
func Open(path string) (*File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	size := st.Size()
	if size < 8 {
		return nil, fmt.Errorf("%s: too short for a safetensors file", path)
	}
	data, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", path, err)
	}
	sf := &File{Path: path, mapped: data, Tensors: map[string]*Tensor{}}
	if err := sf.parse(); err != nil {
		sf.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return sf, nil
}

func (f *File) parse() error {
	hlen := binary.LittleEndian.Uint64(f.mapped)
	if hlen > uint64(len(f.mapped)-8) || hlen > 100<<20 {
		return fmt.Errorf("header length %d exceeds the file", hlen)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(f.mapped[8:8+hlen], &raw); err != nil {
		return fmt.Errorf("header: %w", err)
	}
	body := f.mapped[8+hlen:]
	for name, msg := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(msg, &f.Metadata); err != nil {
				return fmt.Errorf("metadata: %w", err)
			}
			continue
		}
		var e headerEntry
		if err := json.Unmarshal(msg, &e); err != nil {
			return fmt.Errorf("tensor %s: %w", name, err)
		}
		if e.DType.Size() == 0 {
			return fmt.Errorf("tensor %s: unsupported dtype %q", name, e.DType)
		}
		t := &Tensor{Name: name, DType: e.DType, Shape: e.Shape}
		begin, end := e.Offsets[0], e.Offsets[1]
		if begin < 0 || end < begin || end > int64(len(body)) || end-begin != int64(t.Numel()*e.DType.Size()) {
			return fmt.Errorf("tensor %s: offsets %v do not fit shape %v of %s", name, e.Offsets, e.Shape, e.DType)
		}
		t.Data = body[begin:end:end]
		f.Tensors[name] = t
	}
	return nil
}

// Close unmaps the file; tensors from it must not be used afterwards.
func (f *File) Close() error {
	if f.mapped == nil {
		return nil
	}
	err := unix.Munmap(f.mapped)
	f.mapped = nil
	return err
}

// Set is the tensors of a model directory: one file or an indexed shard set.
type Set struct {
	files   []*File
	tensors map[string]*Tensor
}

// OpenDir opens model.safetensors, or the shards listed in
// model.safetensors.index.json, or every *.safetensors file in dir.
func OpenDir(dir string) (*Set, error) {
	paths, err := shardPaths(dir)
	if err != nil {
		return nil, err
	}
	s := &Set{tensors: map[string]*Tensor{}}
	for _, p := range paths {
		f, err := Open(p)
		if err != nil {
			s.Close()
			return nil, err
		}
		s.files = append(s.files, f)
		for name, t := range f.Tensors {
			if _, dup := s.tensors[name]; dup {
				s.Close()
				return nil, fmt.Errorf("tensor %s appears in more than one file", name)
			}
			s.tensors[name] = t
		}
	}
	return s, nil
}

func shardPaths(dir string) ([]string, error) {
	index := filepath.Join(dir, "model.safetensors.index.json")
	if data, err := os.ReadFile(index); err == nil {
		var idx struct {
			WeightMap map[string]string `json:"weight_map"`
		}
		if err := json.Unmarshal(data, &idx); err != nil {
			return nil, fmt.Errorf("%s: %w", index, err)
		}
		seen := map[string]bool{}
		var paths []string
		for _, file := range idx.WeightMap {
			if !seen[file] {
				seen[file] = true
				paths = append(paths, filepath.Join(dir, file))
			}
		}
		sort.Strings(paths)
		return paths, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	paths, err := filepath.Glob(filepath.Join(dir, "*.safetensors"))
	if err != nil {
		return nil, err
	}
	if len(paths) == 0 {
		return nil, fmt.Errorf("%s: no *.safetensors files", dir)
	}
	sort.Strings(paths)
	return paths, nil
}

// Get returns a tensor by name.
func (s *Set) Get(name string) (*Tensor, bool) {
	t, ok := s.tensors[name]
	return t, ok
}

// Names lists every tensor name, sorted.
func (s *Set) Names() []string {
	names := make([]string, 0, len(s.tensors))
	for n := range s.tensors {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Close unmaps every file.
func (s *Set) Close() error {
	var errs []error
	for _, f := range s.files {
		errs = append(errs, f.Close())
	}
	return errors.Join(errs...)
}
