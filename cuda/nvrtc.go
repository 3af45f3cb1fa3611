package cuda

/*
#include <stdlib.h>
#include "ebbcuda.h"
*/
import "C"

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"unsafe"
)

//go:embed kernels/*.cuh kernels/*.cu
var kernelFS embed.FS

// KernelSource is every kernel file, prelude first, as one translation unit,
// after the defines of $EBB_KERNEL_DEFINES. $EBB_KERNEL_DIR names a
// directory whose kernel files replace the embedded ones, so that an A/B
// run compares two versions of a kernel from one binary (the host's
// launches must fit both).
func KernelSource() (string, error) {
	var b strings.Builder
	env := os.Getenv("EBB_KERNEL_DEFINES")
	defines, err := kernelDefines(env)
	if err != nil {
		return "", err
	}
	files, err := fs.Sub(kernelFS, "kernels")
	if err != nil {
		return "", err
	}
	if dir := os.Getenv("EBB_KERNEL_DIR"); dir != "" {
		files = os.DirFS(dir)
	}
	prelude, err := fs.ReadFile(files, "prelude.cuh")
	if err != nil {
		return "", fmt.Errorf("kernel sources: %w", err)
	}
	b.Write(prelude)
	names, err := fs.Glob(files, "*.cu")
	if err != nil {
		return "", err
	}
	if len(names) == 0 {
		return "", errors.New("kernel sources: no .cu files")
	}
	sort.Strings(names)
	for _, n := range names {
		src, err := fs.ReadFile(files, n)
		if err != nil {
			return "", fmt.Errorf("kernel sources: %w", err)
		}
		fmt.Fprintf(&b, "\n// ---- %s ----\n", n)
		b.Write(src)
	}
	if err := definesTakeEffect(env, b.String()); err != nil {
		return "", err
	}
	return defines + b.String(), nil
}

// definesTakeEffect checks that each macro $EBB_KERNEL_DEFINES sets is one
// the kernels read, and that each #define of it in them sits under an
// #ifndef of it: NVRTC only warns when a file's #define replaces the
// setting, and an A/B run of it then times the same kernels twice (the
// fifty-second stop's MOE_SORT_CACHE=1).
func definesTakeEffect(env, source string) error {
	for _, d := range defineEntries(env) {
		word := regexp.MustCompile(`\b` + regexp.QuoteMeta(d.name) + `\b`)
		if !word.MatchString(source) {
			return fmt.Errorf("EBB_KERNEL_DEFINES: no kernel reads %s", d.name)
		}
		directive := func(kind string) int {
			return len(regexp.MustCompile(`(?m)^[ \t]*#[ \t]*`+kind+`[ \t]+`+regexp.QuoteMeta(d.name)+`\b`).FindAllStringIndex(source, -1))
		}
		if directive("define") > directive("ifndef") {
			return fmt.Errorf("EBB_KERNEL_DEFINES: a kernel defines %s without #ifndef %s, so the setting would not take effect", d.name, d.name)
		}
	}
	return nil
}

// kernelDefines turns "NAME=VALUE,NAME2=VALUE2" into #define lines, so that
// an A/B run sets the compile-time tunables kernels guard with #ifndef
// (GEMV_PRELOAD) from one binary. The kernel cache key covers the source:
// each setting compiles once.
func kernelDefines(v string) (string, error) {
	var b strings.Builder
	for _, d := range defineEntries(v) {
		if !validDefineName(d.name) || strings.ContainsAny(d.value, "\n\r") {
			return "", fmt.Errorf("EBB_KERNEL_DEFINES: %q is not NAME=VALUE", d.text)
		}
		fmt.Fprintf(&b, "#define %s %s\n", d.name, d.value)
	}
	return b.String(), nil
}

// kernelDefineInt is the integer $EBB_KERNEL_DEFINES gives name, or def:
// for the tunables the host must know too (a kernel's block size). It
// reads the entries as kernelDefines does, so both see the same value.
func kernelDefineInt(name string, def int) int {
	for _, d := range defineEntries(os.Getenv("EBB_KERNEL_DEFINES")) {
		if d.name == name {
			if i, err := strconv.Atoi(strings.TrimSpace(d.value)); err == nil {
				return i
			}
		}
	}
	return def
}

// defineEntry is one NAME=VALUE of $EBB_KERNEL_DEFINES, text as written.
type defineEntry struct{ text, name, value string }

func defineEntries(v string) []defineEntry {
	var out []defineEntry
	for _, d := range strings.Split(v, ",") {
		if d = strings.TrimSpace(d); d != "" {
			name, value, _ := strings.Cut(d, "=")
			out = append(out, defineEntry{d, name, value})
		}
	}
	return out
}

func validDefineName(s string) bool {
	for i, r := range s {
		if !(r == '_' || r >= 'A' && r <= 'Z' || r >= 'a' && r <= 'z' || i > 0 && r >= '0' && r <= '9') {
			return false
		}
	}
	return s != ""
}

// NVRTCVersion is the run-time compiler's version.
func NVRTCVersion() (int, int, error) {
	if err := LoadNVRTC(); err != nil {
		return 0, 0, err
	}
	var a, b C.int
	if r := C.ebb_nvrtcVersion(&a, &b); r != 0 {
		return 0, 0, nvrtcError("nvrtcVersion", r)
	}
	return int(a), int(b), nil
}

func nvrtcError(call string, r C.int) error {
	return fmt.Errorf("%s: %s", call, C.GoString(C.ebb_nvrtc_error_string(r)))
}

// CompileError carries the compiler's log.
type CompileError struct {
	Arch string
	Log  string
}

func (e *CompileError) Error() string {
	return fmt.Sprintf("kernel compilation for %s failed:\n%s", e.Arch, e.Log)
}

// Compile builds source for arch: "sm_90" gives a CUBIN, "compute_90" PTX.
func Compile(source, name, arch string) ([]byte, error) {
	if err := LoadNVRTC(); err != nil {
		return nil, err
	}
	csrc, cname := C.CString(source), C.CString(name)
	defer C.free(unsafe.Pointer(csrc))
	defer C.free(unsafe.Pointer(cname))
	var prog C.nvrtcProgram
	if r := C.ebb_nvrtcCreateProgram(&prog, csrc, cname, 0, nil, nil); r != 0 {
		return nil, nvrtcError("nvrtcCreateProgram", r)
	}
	defer C.ebb_nvrtcDestroyProgram(&prog)
	opts := []string{"--gpu-architecture=" + arch, "--std=c++17", "--fmad=true", "-DEBB_NVRTC=1"}
	copts := make([]*C.char, len(opts))
	for i, o := range opts {
		copts[i] = C.CString(o)
		defer C.free(unsafe.Pointer(copts[i]))
	}
	r := C.ebb_nvrtcCompileProgram(prog, C.int(len(copts)), &copts[0])
	var logSize C.size_t
	C.ebb_nvrtcGetProgramLogSize(prog, &logSize)
	log := make([]byte, logSize+1)
	C.ebb_nvrtcGetProgramLog(prog, (*C.char)(unsafe.Pointer(&log[0])))
	if r != 0 {
		return nil, &CompileError{Arch: arch, Log: strings.TrimRight(string(log), "\x00")}
	}
	var size C.size_t
	var out []byte
	if strings.HasPrefix(arch, "sm_") {
		if r := C.ebb_nvrtcGetCUBINSize(prog, &size); r != 0 {
			return nil, nvrtcError("nvrtcGetCUBINSize", r)
		}
		out = make([]byte, size)
		if r := C.ebb_nvrtcGetCUBIN(prog, (*C.char)(unsafe.Pointer(&out[0]))); r != 0 {
			return nil, nvrtcError("nvrtcGetCUBIN", r)
		}
	} else {
		if r := C.ebb_nvrtcGetPTXSize(prog, &size); r != 0 {
			return nil, nvrtcError("nvrtcGetPTXSize", r)
		}
		out = make([]byte, size)
		if r := C.ebb_nvrtcGetPTX(prog, (*C.char)(unsafe.Pointer(&out[0]))); r != 0 {
			return nil, nvrtcError("nvrtcGetPTX", r)
		}
	}
	return out, nil
}

// cacheDir is where compiled kernels are kept: $EBB_KERNEL_CACHE, else the
// user cache directory.
func cacheDir() string {
	if d := os.Getenv("EBB_KERNEL_CACHE"); d != "" {
		return d
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "ebb", "kernels")
	}
	return filepath.Join(os.TempDir(), "ebb-kernels")
}

// CompileCached returns the CUBIN for arch from the disk cache that
// engines load their kernels from ($EBB_KERNEL_CACHE), compiling on a miss.
// The key covers the source, the architecture and the compiler, so that
// `ebb kernels --cache` can compile an A/B run's settings side by side
// before its runs, each of which would otherwise compile in turn.
func CompileCached(source, arch string) ([]byte, error) {
	major, minor, err := NVRTCVersion()
	if err != nil {
		return nil, err
	}
	h := sha256.Sum256([]byte(fmt.Sprintf("%s\x00%s\x00nvrtc %d.%d", source, arch, major, minor)))
	path := filepath.Join(cacheDir(), hex.EncodeToString(h[:16])+"-"+arch+".cubin")
	if b, err := os.ReadFile(path); err == nil {
		return b, nil
	}
	bin, err := Compile(source, "ebb_kernels.cu", arch)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err == nil {
		tmp := path + fmt.Sprintf(".%d.tmp", os.Getpid())
		if os.WriteFile(tmp, bin, 0o644) == nil {
			_ = os.Rename(tmp, path) // a failed cache write only costs a recompile
		}
	}
	return bin, nil
}

// Module is loaded kernel code.
type Module struct {
	m     C.CUmodule
	funcs map[string]*Kernel
	Arch  string // the target it was compiled for, e.g. "sm_90a"
}

// Kernel is one __global__ function.
type Kernel struct {
	f    C.CUfunction
	Name string
}

// EngineArch is the target an engine compiles for on a GPU of real
// architecture arch: sm_90 takes sm_90a, with the warpgroup MMA
// (matmul_wg), where NVRTC has "a" targets (12.0 and later).
func EngineArch(arch string) string {
	major, _, err := NVRTCVersion()
	return engineArch(arch, major, err == nil)
}

func engineArch(arch string, nvrtcMajor int, ok bool) string {
	if arch == "sm_90" && ok && nvrtcMajor >= 12 {
		return "sm_90a"
	}
	return arch
}

// LoadKernels compiles (or takes from the cache) every embedded kernel for
// this GPU and loads them.
func (c *Context) LoadKernels() (*Module, error) {
	src, err := KernelSource()
	if err != nil {
		return nil, err
	}
	arch := EngineArch(fmt.Sprintf("sm_%d%d", c.CCMajor, c.CCMinor))
	bin, err := CompileCached(src, arch)
	if err != nil {
		return nil, err
	}
	m := &Module{funcs: map[string]*Kernel{}, Arch: arch}
	if err := check("cuModuleLoadData", C.ebb_cuModuleLoadData(&m.m, unsafe.Pointer(&bin[0]))); err != nil {
		return nil, err
	}
	return m, nil
}

// Func looks a kernel up by name.
func (m *Module) Func(name string) (*Kernel, error) {
	if k, ok := m.funcs[name]; ok {
		return k, nil
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	k := &Kernel{Name: name}
	if err := check("cuModuleGetFunction("+name+")", C.ebb_cuModuleGetFunction(&k.f, m.m, cname)); err != nil {
		return nil, err
	}
	m.funcs[name] = k
	return k, nil
}

// MustFuncs resolves several kernels at once.
func (m *Module) Funcs(names ...string) (map[string]*Kernel, error) {
	out := map[string]*Kernel{}
	var errs []error
	for _, n := range names {
		k, err := m.Func(n)
		errs = append(errs, err)
		out[n] = k
	}
	return out, errors.Join(errs...)
}

// Unload frees the module.
func (m *Module) Unload() error { return check("cuModuleUnload", C.ebb_cuModuleUnload(m.m)) }

// SetMaxDynamicShared raises a kernel's dynamic shared memory limit.
func (k *Kernel) SetMaxDynamicShared(bytes int) error {
	return check("cuFuncSetAttribute", C.ebb_cuFuncSetAttribute(k.f, 8 /* MAX_DYNAMIC_SHARED_SIZE_BYTES */, C.int(bytes)))
}

// MaxActiveClusters is how many clusters of cluster blocks (threads each,
// with shared bytes of dynamic shared memory) the GPU runs at once: a
// cluster's blocks must share a GPC, so a grid of clusters may need more
// than one wave where the same blocks unclustered would fit.
func (k *Kernel) MaxActiveClusters(threads, shared, cluster int) (int, error) {
	var n C.int
	err := check("cuOccupancyMaxActiveClusters", C.ebb_max_active_clusters(&n, k.f, C.uint(threads), C.uint(shared), C.uint(cluster)))
	return int(n), err
}

// Dim3 is a grid or block shape.
type Dim3 struct{ X, Y, Z uint32 }

// D1 is a one-dimensional shape.
func D1(x int) Dim3 { return Dim3{uint32(x), 1, 1} }

// Kernel arguments are passed as 8-byte slots: pointers and 64-bit values
// fill them; 32-bit values use the low half (little-endian).

// P is a pointer argument.
func P(p uintptr) uint64 { return uint64(p) }

// I is a 32-bit integer argument.
func I(v int) uint64 { return uint64(uint32(int32(v))) }

// F is a float argument.
func F(v float32) uint64 { return uint64(*(*uint32)(unsafe.Pointer(&v))) }

func cBool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// LaunchKernel queues k on the stream.
func (c *Context) LaunchKernel(k *Kernel, grid, block Dim3, shmem int, args ...uint64) error {
	return c.LaunchCluster(k, grid, block, shmem, 1, nil, args...)
}

// LaunchCluster queues k as thread block clusters of clusterZ blocks
// along z (1: no clusters), with maps as its first parameters.
func (c *Context) LaunchCluster(k *Kernel, grid, block Dim3, shmem, clusterZ int, maps []TensorMap, args ...uint64) error {
	var a *C.ulonglong
	if len(args) > 0 {
		a = (*C.ulonglong)(unsafe.Pointer(&args[0]))
	}
	var m unsafe.Pointer
	if len(maps) > 0 {
		m = unsafe.Pointer(&maps[0])
	}
	r := C.ebb_launch(k.f, C.uint(grid.X), C.uint(grid.Y), C.uint(grid.Z), C.uint(block.X), C.uint(block.Y),
		C.uint(block.Z), C.uint(shmem), c.stream, a, C.int(len(args)), cBool(c.PDL), C.uint(clusterZ), m, C.int(len(maps)))
	if r != 0 {
		return &Error{Call: "cuLaunchKernel(" + k.Name + ")", Code: int(r), Name: C.GoString(C.ebb_cu_error_name(r))}
	}
	return nil
}

// HasTensorMaps says whether the driver encodes tensor maps (CUDA 12.0+).
func HasTensorMaps() bool { return C.ebb_has_tensor_maps() != 0 }

// TensorMap is an encoded CUtensorMap: how the tensor memory accelerator
// copies tiles of a tensor in global memory to shared memory.
type TensorMap [16]uint64

// NewTensorMapBF16 encodes a map of the bf16 tensor at addr: dims and box
// innermost first, strides in bytes of dims 1 and up; with swizzle128 the
// tiles land in shared memory in the 128-byte swizzle.
func NewTensorMapBF16(addr uintptr, dims, strides []uint64, box []uint32, swizzle128 bool) (TensorMap, error) {
	var out TensorMap
	if len(dims) == 0 || len(strides) != len(dims)-1 || len(box) != len(dims) {
		return out, fmt.Errorf("tensor map: %d dims, %d strides, %d box sizes", len(dims), len(strides), len(box))
	}
	// The driver wants the map 64-byte aligned.
	var buf [24]uint64
	off := (64 - int(uintptr(unsafe.Pointer(&buf[0]))%64)) % 64 / 8
	st := append(append([]uint64(nil), strides...), 0) // non-empty for rank 1
	r := C.ebb_tensor_map_bf16(unsafe.Pointer(&buf[off]), C.uint(len(dims)), C.CUdeviceptr(addr),
		(*C.ulonglong)(unsafe.Pointer(&dims[0])), (*C.ulonglong)(unsafe.Pointer(&st[0])),
		(*C.uint)(unsafe.Pointer(&box[0])), cBool(swizzle128))
	if r != 0 {
		return out, &Error{Call: fmt.Sprintf("cuTensorMapEncodeTiled(dims %v, strides %v, box %v)", dims, strides, box),
			Code: int(r), Name: C.GoString(C.ebb_cu_error_name(r))}
	}
	copy(out[:], buf[off:off+16])
	return out, nil
}
