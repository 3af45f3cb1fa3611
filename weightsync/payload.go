package weightsync

import (
	"encoding/base64"
	"fmt"
	"math/big"
	"strings"

	"ebb/device"
)

// Storage is the memory a trainer shares: a CUDA allocation (IPC) or a
// POSIX shared-memory file (torch's file_system strategy).
type Storage struct {
	// CUDA IPC (rebuild_cuda_tensor)
	IPCHandle  [64]byte // cudaIpcMemHandle of the allocation
	IPCOffset  int64    // the storage's offset in that allocation
	RefCounter string   // POSIX shared memory holding the producer's reference counters
	RefOffset  int64    // index of this storage's counter there
	Event      [64]byte // cudaIpcEventHandle to wait on before reading
	EventSync  bool
	Device     string // the producer's GPU (index or UUID)
	// POSIX shared memory (rebuild_storage_filename)
	ShmName string
	// Bytes is the storage's size.
	Bytes int64
}

// CUDA reports whether the storage lives on a GPU.
func (s *Storage) CUDA() bool { return s.ShmName == "" }

// Key identifies the storage (and the allocation behind it) in a request.
func (s *Storage) Key() string {
	if s.CUDA() {
		return "cuda:" + string(s.IPCHandle[:])
	}
	return "shm:" + s.ShmName
}

// Tensor is a view of a shared storage, as torch describes it.
type Tensor struct {
	Shape   []int
	Stride  []int
	Offset  int64 // in elements from the storage's start
	DType   string
	Storage *Storage
}

// Numel is the number of elements.
func (t *Tensor) Numel() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= int64(d)
	}
	return n
}

// ElemSize is the size of one element in bytes (0 for unknown dtypes).
func (t *Tensor) ElemSize() int {
	if dt, err := t.DeviceDType(); err == nil {
		return dt.Size()
	}
	return 0
}

// DeviceDType maps the torch dtype to the engine's, for the float types a
// weight can have.
func (t *Tensor) DeviceDType() (device.DType, error) {
	switch t.DType {
	case "float32", "float":
		return device.F32, nil
	case "bfloat16":
		return device.BF16, nil
	case "float16", "half":
		return device.F16, nil
	}
	return 0, fmt.Errorf("dtype %s is not a weight type (float32, bfloat16, float16)", t.DType)
}

// Contiguous reports whether the view is dense and row-major.
func (t *Tensor) Contiguous() bool {
	want := int64(1)
	for i := len(t.Shape) - 1; i >= 0; i-- {
		if t.Shape[i] != 1 && int64(t.Stride[i]) != want {
			return false
		}
		want *= int64(t.Shape[i])
	}
	return true
}

// ByteRange is where the view's data lies in its storage.
func (t *Tensor) ByteRange() (off, n int64) {
	es := int64(t.ElemSize())
	return t.Offset * es, t.Numel() * es
}

// NamedTensor is one parameter of a payload.
type NamedTensor struct {
	Name   string
	Tensor *Tensor
}

// flatMeta is SGLang's FlattenedTensorMetadata.
type flatMeta struct {
	name       string
	shape      []int
	dtype      string
	start, end int64
}

// localTensor is SGLang's LocalSerializedTensor: one pickled tensor per
// TP rank.
type localTensor struct{ values [][]byte }

type dtypeName string

// Payload formats (load_format).
const (
	FormatDefault   = ""
	FormatDirect    = "direct"
	FormatFlattened = "flattened_bucket"
)

// DecodeBase64 accepts an element of serialized_named_tensors as HTTP
// sends it (a base64 string, as SGLang's MultiprocessingSerializer writes
// with output_str) or as raw bytes.
func DecodeBase64(v string) ([]byte, error) {
	b, err := base64.StdEncoding.DecodeString(v)
	if err != nil {
		return nil, refuse("serialized_named_tensors: not base64 (%v)", err)
	}
	return b, nil
}

// Payload is one rank's element of serialized_named_tensors, decoded.
type Payload struct {
	Tensors []NamedTensor
	// Storages are every storage the payload shared, each once; even when
	// decoding failed, their references must be given back (Release), or
	// the trainer can never free them.
	Storages []*Storage
}

// Decode reads one rank's element of serialized_named_tensors. The
// returned payload is never nil: its Storages are set even on error.
func Decode(data []byte, format string, rank int) (*Payload, error) {
	p := &Payload{}
	seen := map[*Storage]bool{}
	built := func(v any) {
		var s *Storage
		switch x := v.(type) {
		case *Tensor:
			s = x.Storage
		case *Storage:
			s = x
		case *typedStorage:
			s = x.s
		}
		if s != nil && !seen[s] {
			seen[s] = true
			p.Storages = append(p.Storages, s)
		}
	}
	v, err := unpickle(data, knownGlobal, built)
	if err != nil {
		return p, err
	}
	switch format {
	case FormatDefault, FormatDirect, "auto":
		p.Tensors, err = namedList(v, rank, built)
	case FormatFlattened:
		p.Tensors, err = flattened(v)
	default:
		err = refuse("load_format %q is not supported (none, \"direct\", \"flattened_bucket\")", format)
	}
	return p, err
}

// namedList reads [(name, tensor), ...].
func namedList(v any, rank int, built func(any)) ([]NamedTensor, error) {
	items, err := sequence(v)
	if err != nil {
		return nil, refuse("expected a list of (name, tensor) pairs, got %s", typeName(v))
	}
	out := make([]NamedTensor, 0, len(items))
	for i, it := range items {
		pair, ok := it.(Tuple)
		if l, isList := it.(*List); isList {
			pair, ok = Tuple(l.Items), true
		}
		if !ok || len(pair) != 2 {
			return nil, refuse("entry %d is %s, not a (name, tensor) pair", i, typeName(it))
		}
		name, ok := pair[0].(string)
		if !ok {
			return nil, refuse("entry %d: name is %s", i, typeName(pair[0]))
		}
		t, err := tensorFor(pair[1], rank, built)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		out = append(out, NamedTensor{name, t})
	}
	return out, nil
}

func tensorFor(v any, rank int, built func(any)) (*Tensor, error) {
	switch t := v.(type) {
	case *Tensor:
		return t, nil
	case *localTensor:
		if rank < 0 || rank >= len(t.values) {
			return nil, refuse("LocalSerializedTensor has %d values, none for TP rank %d", len(t.values), rank)
		}
		inner, err := unpickle(t.values[rank], knownGlobal, built)
		if err != nil {
			return nil, err
		}
		if tt, ok := inner.(*Tensor); ok {
			return tt, nil
		}
		return nil, refuse("LocalSerializedTensor value is %s, not a tensor", typeName(inner))
	}
	return nil, refuse("%s is not a tensor", typeName(v))
}

// flattened reads SGLang's flattened bucket: {"flattened_tensor": t,
// "metadata": [FlattenedTensorMetadata, ...]}.
func flattened(v any) ([]NamedTensor, error) {
	d, ok := v.(*Dict)
	if !ok {
		return nil, refuse("flattened_bucket: expected a dict, got %s", typeName(v))
	}
	flat, ok := d.Items["flattened_tensor"].(*Tensor)
	if !ok {
		return nil, refuse("flattened_bucket: flattened_tensor is %s", typeName(d.Items["flattened_tensor"]))
	}
	if len(flat.Shape) != 1 || !flat.Contiguous() {
		return nil, refuse("flattened_bucket: flattened_tensor must be one contiguous dimension, got shape %v", flat.Shape)
	}
	metas, err := sequence(d.Items["metadata"])
	if err != nil {
		return nil, refuse("flattened_bucket: metadata is %s", typeName(d.Items["metadata"]))
	}
	out := make([]NamedTensor, 0, len(metas))
	for i, mv := range metas {
		m, ok := mv.(*flatMeta)
		if !ok {
			return nil, refuse("flattened_bucket: metadata %d is %s", i, typeName(mv))
		}
		numel := int64(1)
		for _, s := range m.shape {
			numel *= int64(s)
		}
		if m.start < 0 || m.end != m.start+numel || m.end > int64(flat.Shape[0]) {
			return nil, refuse("flattened_bucket: %s spans [%d, %d) for shape %v in %d elements", m.name, m.start, m.end, m.shape, flat.Shape[0])
		}
		out = append(out, NamedTensor{m.name, &Tensor{Shape: m.shape, Stride: contiguousStride(m.shape),
			Offset: flat.Offset + m.start, DType: flat.DType, Storage: flat.Storage}})
	}
	return out, nil
}

func contiguousStride(shape []int) []int {
	s := make([]int, len(shape))
	n := 1
	for i := len(shape) - 1; i >= 0; i-- {
		s[i] = n
		n *= shape[i]
	}
	return s
}

func sequence(v any) ([]any, error) {
	switch x := v.(type) {
	case *List:
		return x.Items, nil
	case Tuple:
		return x, nil
	}
	return nil, fmt.Errorf("not a sequence")
}

func typeName(v any) string {
	switch x := v.(type) {
	case nil:
		return "None"
	case *global:
		return x.name
	case *instance:
		return "an unbuilt " + x.class.name
	case *List:
		return "a list"
	case Tuple:
		return "a tuple"
	case *Dict:
		return "a dict"
	}
	return fmt.Sprintf("%T", v)
}

// knownGlobal resolves the globals tensor payloads use; any other name is
// refused, naming it.
func knownGlobal(module, name string) (*global, error) {
	full := module + "." + name
	if g, ok := globals[full]; ok {
		if g == fileDescriptorStrategy {
			return nil, errFileDescriptorStrategy
		}
		return g, nil
	}
	if strings.HasPrefix(module, "sglang.") {
		// SGLang moves these between modules across versions.
		switch name {
		case "_rebuild_cuda_tensor_modified":
			return globals["torch.multiprocessing.reductions.rebuild_cuda_tensor"], nil
		case "FlattenedTensorMetadata":
			return metaClass, nil
		case "LocalSerializedTensor":
			return localClass, nil
		}
	}
	if module == "torch" {
		if _, ok := torchDTypes[name]; ok {
			return &global{name: full}, nil
		}
	}
	return nil, refuse("the payload refers to %s, which is not one of the names tensor payloads use", full)
}

var torchDTypes = map[string]bool{"float32": true, "float": true, "bfloat16": true, "float16": true, "half": true,
	"float64": true, "double": true, "int64": true, "long": true, "int32": true, "int": true, "int16": true,
	"int8": true, "uint8": true, "bool": true, "float8_e4m3fn": true, "float8_e5m2": true}

// classes whose value is only a marker (type(tensor), type(storage)).
func marker(name string) *global { return &global{name: name} }

var (
	metaClass = &global{name: "FlattenedTensorMetadata", object: func(st map[string]any) (any, error) {
		m := &flatMeta{}
		var err error
		if m.name, err = str(st, "name"); err != nil {
			return nil, err
		}
		if m.shape, err = ints(st["shape"]); err != nil {
			return nil, refuse("FlattenedTensorMetadata %s: shape: %v", m.name, err)
		}
		if m.dtype, err = dtypeOf(st["dtype"]); err != nil {
			return nil, err
		}
		if m.start, err = integer(st["start_idx"]); err != nil {
			return nil, refuse("FlattenedTensorMetadata %s: start_idx: %v", m.name, err)
		}
		if m.end, err = integer(st["end_idx"]); err != nil {
			return nil, refuse("FlattenedTensorMetadata %s: end_idx: %v", m.name, err)
		}
		return m, nil
	}}
	localClass = &global{name: "LocalSerializedTensor", object: func(st map[string]any) (any, error) {
		vals, err := sequence(st["values"])
		if err != nil {
			return nil, refuse("LocalSerializedTensor.values is %s", typeName(st["values"]))
		}
		lt := &localTensor{}
		for _, v := range vals {
			b, ok := v.([]byte)
			if !ok {
				if s, isStr := v.(string); isStr {
					var err error
					if b, err = DecodeBase64(s); err != nil {
						return nil, err
					}
				} else {
					return nil, refuse("LocalSerializedTensor value is %s", typeName(v))
				}
			}
			lt.values = append(lt.values, b)
		}
		return lt, nil
	}}
	globals = map[string]*global{
		"torch.Tensor":                 marker("torch.Tensor"),
		"torch._tensor.Tensor":         marker("torch.Tensor"),
		"torch.nn.parameter.Parameter": marker("torch.nn.parameter.Parameter"),
		"torch.storage.TypedStorage":   marker("torch.storage.TypedStorage"),
		"torch.storage.UntypedStorage": marker("torch.storage.UntypedStorage"),
		"torch.UntypedStorage":         marker("torch.UntypedStorage"),
		"torch.Size":                   {name: "torch.Size", call: torchSize},
		"torch.multiprocessing.reductions.rebuild_cuda_tensor": {name: "rebuild_cuda_tensor", call: rebuildCUDATensor},
		"torch.multiprocessing.reductions.rebuild_tensor":      {name: "rebuild_tensor", call: rebuildTensor},
		"torch.multiprocessing.reductions.rebuild_typed_storage": {name: "rebuild_typed_storage", call: func(a Tuple) (any, error) {
			if len(a) != 2 {
				return nil, refuse("rebuild_typed_storage takes 2 arguments, got %d", len(a))
			}
			s, ok := a[0].(*Storage)
			if !ok {
				return nil, refuse("rebuild_typed_storage of %s", typeName(a[0]))
			}
			dt, err := dtypeOf(a[1])
			if err != nil {
				return nil, err
			}
			return &typedStorage{s, dt}, nil
		}},
		"torch.multiprocessing.reductions.rebuild_storage_filename": {name: "rebuild_storage_filename", call: rebuildStorageFilename},
		"torch.multiprocessing.reductions.rebuild_storage_fd":       fileDescriptorStrategy,
		"multiprocessing.resource_sharer.DupFd":                     fileDescriptorStrategy,
		"torch.multiprocessing.reductions.rebuild_event": {name: "rebuild_event", call: func(Tuple) (any, error) {
			return nil, refuse("CUDA events are not weights")
		}},
		"sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata":   metaClass,
		"sglang.srt.model_executor.model_runner.LocalSerializedTensor":   localClass,
		"sglang.srt.model_executor.model_runner.FlattenedTensorMetadata": metaClass,
	}
)

// fileDescriptorStrategy answers torch's default way of sharing CPU
// tensors, which another program cannot receive.
var (
	fileDescriptorStrategy    = &global{name: "rebuild_storage_fd"}
	errFileDescriptorStrategy = refuse("the CPU tensor was shared with torch's file_descriptor strategy, whose file descriptors only the " +
		"sender's own child processes can receive: call torch.multiprocessing.set_sharing_strategy(\"file_system\") in the trainer")
)

type typedStorage struct {
	s     *Storage
	dtype string
}

// rebuildCUDATensor reads torch.multiprocessing.reductions.rebuild_cuda_tensor's
// arguments: (tensor_cls, size, stride, offset, storage_cls, dtype,
// device, handle, storage_size_bytes, storage_offset_bytes,
// requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
// event_sync_required).
func rebuildCUDATensor(a Tuple) (any, error) {
	if len(a) != 15 {
		return nil, refuse("rebuild_cuda_tensor takes 15 arguments, got %d", len(a))
	}
	t := &Tensor{Storage: &Storage{}}
	var err error
	if t.Shape, err = ints(a[1]); err != nil {
		return nil, refuse("rebuild_cuda_tensor: size: %v", err)
	}
	if t.Stride, err = ints(a[2]); err != nil || len(t.Stride) != len(t.Shape) {
		return nil, refuse("rebuild_cuda_tensor: stride %v for size %v", a[2], t.Shape)
	}
	if t.Offset, err = integer(a[3]); err != nil || t.Offset < 0 {
		return nil, refuse("rebuild_cuda_tensor: offset: %v", a[3])
	}
	if t.DType, err = dtypeOf(a[5]); err != nil {
		return nil, err
	}
	s := t.Storage
	switch d := a[6].(type) {
	case int64:
		s.Device = fmt.Sprint(d)
	case string:
		s.Device = d // a GPU UUID (SGLang's patch_torch)
	default:
		return nil, refuse("rebuild_cuda_tensor: device is %s", typeName(a[6]))
	}
	handle, ok := a[7].([]byte)
	if !ok {
		return nil, refuse("rebuild_cuda_tensor: a tensor with no storage (handle %s) has no weights", typeName(a[7]))
	}
	if s.IPCHandle, err = ipcHandle(handle); err != nil {
		return nil, err
	}
	if s.Bytes, err = integer(a[8]); err != nil || s.Bytes < 0 {
		return nil, refuse("rebuild_cuda_tensor: storage size: %v", a[8])
	}
	if s.IPCOffset, err = integer(a[9]); err != nil || s.IPCOffset < 0 {
		return nil, refuse("rebuild_cuda_tensor: storage offset: %v", a[9])
	}
	rc, ok := a[11].([]byte)
	if !ok {
		return nil, refuse("rebuild_cuda_tensor: reference counter handle is %s", typeName(a[11]))
	}
	if err := checkShmName(string(rc)); err != nil {
		return nil, err
	}
	s.RefCounter = string(rc)
	if s.RefOffset, err = integer(a[12]); err != nil || s.RefOffset < 0 {
		return nil, refuse("rebuild_cuda_tensor: reference counter offset: %v", a[12])
	}
	if sync, ok := a[14].(bool); ok && sync {
		ev, ok := a[13].([]byte)
		if !ok || len(ev) != 64 {
			return nil, refuse("rebuild_cuda_tensor: event handle of %s", typeName(a[13]))
		}
		copy(s.Event[:], ev)
		s.EventSync = true
	}
	return t, t.check()
}

// ipcHandle reads torch's shareable handle: 64 bytes of cudaIpcMemHandle
// (before torch 2.5), or a version byte, a type byte ('c': cudaMalloc'ed
// memory) and the 64 bytes.
func ipcHandle(b []byte) ([64]byte, error) {
	var h [64]byte
	switch {
	case len(b) == 64:
		copy(h[:], b)
	case len(b) == 66 && b[1] == 'c':
		copy(h[:], b[2:])
	case len(b) >= 2 && b[1] == 'e':
		return h, refuse("the tensor is in one of torch's expandable segments, whose handles ebb cannot open: " +
			"set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False in the trainer (or copy the weights into a plain allocation)")
	default:
		return h, refuse("CUDA IPC handle of %d bytes is not one torch writes", len(b))
	}
	return h, nil
}

// rebuildStorageFilename reads (cls, manager, handle, size[, dtype]).
func rebuildStorageFilename(a Tuple) (any, error) {
	if len(a) != 4 && len(a) != 5 {
		return nil, refuse("rebuild_storage_filename takes 4 or 5 arguments, got %d", len(a))
	}
	name, ok := a[2].([]byte)
	if !ok {
		if s, isStr := a[2].(string); isStr {
			name = []byte(s)
		} else {
			return nil, refuse("rebuild_storage_filename: handle is %s", typeName(a[2]))
		}
	}
	size, err := integer(a[3])
	if err != nil || size < 0 {
		return nil, refuse("rebuild_storage_filename: size %v", a[3])
	}
	s := &Storage{ShmName: string(name), Bytes: size}
	if err := checkShmName(s.ShmName); err != nil {
		return nil, err
	}
	if len(a) == 5 {
		dt, err := dtypeOf(a[4])
		if err != nil {
			return nil, err
		}
		return &typedStorage{s, dt}, nil
	}
	return s, nil
}

// rebuildTensor reads (cls, storage, (offset, size, stride, requires_grad)).
func rebuildTensor(a Tuple) (any, error) {
	if len(a) != 3 {
		return nil, refuse("rebuild_tensor takes 3 arguments, got %d", len(a))
	}
	ts, ok := a[1].(*typedStorage)
	if !ok {
		return nil, refuse("rebuild_tensor of %s", typeName(a[1]))
	}
	meta, ok := a[2].(Tuple)
	if !ok || len(meta) != 4 {
		return nil, refuse("rebuild_tensor: metadata is %s", typeName(a[2]))
	}
	t := &Tensor{DType: ts.dtype, Storage: ts.s}
	var err error
	if t.Offset, err = integer(meta[0]); err != nil || t.Offset < 0 {
		return nil, refuse("rebuild_tensor: offset %v", meta[0])
	}
	if t.Shape, err = ints(meta[1]); err != nil {
		return nil, refuse("rebuild_tensor: size: %v", err)
	}
	if t.Stride, err = ints(meta[2]); err != nil || len(t.Stride) != len(t.Shape) {
		return nil, refuse("rebuild_tensor: stride %v for size %v", meta[2], t.Shape)
	}
	return t, t.check()
}

// check verifies that a tensor's data lies inside its storage.
func (t *Tensor) check() error {
	for _, d := range t.Shape {
		if d < 0 {
			return refuse("negative size %v", t.Shape)
		}
	}
	if es := t.ElemSize(); es > 0 && t.Contiguous() {
		off, n := t.ByteRange()
		if off+n > t.Storage.Bytes {
			return refuse("tensor of %d bytes at byte %d runs past its storage of %d bytes", n, off, t.Storage.Bytes)
		}
	}
	return nil
}

func torchSize(a Tuple) (any, error) {
	if len(a) != 1 {
		return nil, refuse("torch.Size takes one argument")
	}
	return ints(a[0])
}

func dtypeOf(v any) (string, error) {
	if g, ok := v.(*global); ok && strings.HasPrefix(g.name, "torch.") {
		if torchDTypes[strings.TrimPrefix(g.name, "torch.")] {
			return strings.TrimPrefix(g.name, "torch."), nil
		}
	}
	return "", refuse("%s is not a torch dtype", typeName(v))
}

func integer(v any) (int64, error) {
	switch x := v.(type) {
	case int64:
		return x, nil
	case *big.Int:
		return 0, fmt.Errorf("integer %s is too large", x)
	case bool:
		if x {
			return 1, nil
		}
		return 0, nil
	}
	return 0, fmt.Errorf("%s is not an integer", typeName(v))
}

func ints(v any) ([]int, error) {
	items, err := sequence(v)
	if err != nil {
		if l, ok := v.([]int); ok {
			return l, nil
		}
		return nil, fmt.Errorf("%s is not a sequence of integers", typeName(v))
	}
	out := make([]int, len(items))
	for i, it := range items {
		n, err := integer(it)
		if err != nil || n < 0 || n > 1<<40 {
			return nil, fmt.Errorf("element %d: %v", i, it)
		}
		out[i] = int(n)
	}
	return out, nil
}

func str(st map[string]any, key string) (string, error) {
	s, ok := st[key].(string)
	if !ok {
		return "", refuse("FlattenedTensorMetadata.%s is %s", key, typeName(st[key]))
	}
	return s, nil
}
