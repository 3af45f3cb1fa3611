// Package cuda drives NVIDIA GPUs through a thin C layer that loads libcuda,
// NVRTC, cuBLAS and NCCL at run time (dlopen): building and testing need no
// CUDA toolkit, and a machine without a GPU fails with a clear message only
// when the GPU is asked for. It provides the device memory backend
// (virtual-memory regions that release and resume at the same addresses),
// run-time kernel compilation, NVML readings and the CUDA implementation of
// device.Device.
package cuda

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "ebbcuda.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"unsafe"
)

// Error is a failed CUDA driver call.
type Error struct {
	Call string
	Code int
	Name string
}

func (e *Error) Error() string { return fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Code) }

// ErrNoLibrary is returned when a CUDA library is not installed.
var ErrNoLibrary = errors.New("CUDA library not found")

func check(call string, r C.int) error {
	if r == 0 {
		return nil
	}
	return &Error{Call: call, Code: int(r), Name: C.GoString(C.ebb_cu_error_name(r))}
}

type loader struct {
	once sync.Once
	err  error
}

func (l *loader) load(name string, f func(*C.char, C.int) C.int) error {
	l.once.Do(func() {
		buf := make([]byte, 512)
		if f((*C.char)(unsafe.Pointer(&buf[0])), C.int(len(buf))) != 0 {
			l.err = fmt.Errorf("%w: %s: %s", ErrNoLibrary, name, C.GoString((*C.char)(unsafe.Pointer(&buf[0]))))
		}
	})
	return l.err
}

var (
	cudaLib, nvrtcLib, cublasLib, cublasLtLib, ncclLib loader
	initOnce                                           sync.Once
	initErr                                            error
)

// Available reports whether a CUDA driver and a GPU are present.
func Available() error {
	if err := cudaLib.load("libcuda", func(b *C.char, n C.int) C.int { return C.ebb_load_cuda(b, n) }); err != nil {
		return err
	}
	initOnce.Do(func() { initErr = check("cuInit", C.ebb_cuInit(0)) })
	if initErr != nil {
		return initErr
	}
	var n C.int
	if err := check("cuDeviceGetCount", C.ebb_cuDeviceGetCount(&n)); err != nil {
		return err
	}
	if n == 0 {
		return errors.New("no CUDA device")
	}
	return nil
}

// LoadNVRTC loads the run-time compiler.
func LoadNVRTC() error {
	return nvrtcLib.load("libnvrtc", func(b *C.char, n C.int) C.int { return C.ebb_load_nvrtc(b, n) })
}

func loadCUBLAS() error {
	return cublasLib.load("libcublas", func(b *C.char, n C.int) C.int { return C.ebb_load_cublas(b, n) })
}

func loadNCCL() error {
	setNCCLDefaults()
	return ncclLib.load("libnccl", func(b *C.char, n C.int) C.int { return C.ebb_load_nccl(b, n) })
}

// Device attribute numbers (CUdevice_attribute).
const (
	attrMultiprocessors = 16
	attrCCMajor         = 75
	attrCCMinor         = 76
)

// Context is the primary context of one GPU and the stream ebb uses on it.
// It belongs to the goroutine that opened it, which Open locks to its OS
// thread: CUDA's current context is per thread.
type Context struct {
	Ordinal     int
	Name        string
	CCMajor     int
	CCMinor     int
	SMs         int
	TotalMemory int64
	PCIBusID    string
	// PDL launches kernels with programmatic dependent launch (Hopper and
	// later; EBB_PDL=0 turns it off): a kernel's launch and its loads of
	// weights overlap the end of the kernel before it.
	PDL bool

	dev    C.CUdevice
	ctx    C.CUcontext
	stream C.CUstream
}

// Open retains the primary context of GPU ordinal, makes it current on this
// thread and creates a non-blocking stream.
func Open(ordinal int) (*Context, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	runtime.LockOSThread()
	c := &Context{Ordinal: ordinal}
	if err := check("cuDeviceGet", C.ebb_cuDeviceGet(&c.dev, C.int(ordinal))); err != nil {
		return nil, err
	}
	if err := check("cuDevicePrimaryCtxRetain", C.ebb_cuDevicePrimaryCtxRetain(&c.ctx, c.dev)); err != nil {
		return nil, err
	}
	if err := check("cuCtxSetCurrent", C.ebb_cuCtxSetCurrent(c.ctx)); err != nil {
		return nil, err
	}
	name := make([]byte, 256)
	C.ebb_cuDeviceGetName((*C.char)(unsafe.Pointer(&name[0])), C.int(len(name)), c.dev)
	c.Name = C.GoString((*C.char)(unsafe.Pointer(&name[0])))
	bus := make([]byte, 64)
	C.ebb_cuDeviceGetPCIBusId((*C.char)(unsafe.Pointer(&bus[0])), C.int(len(bus)), c.dev)
	c.PCIBusID = C.GoString((*C.char)(unsafe.Pointer(&bus[0])))
	c.CCMajor, c.CCMinor = c.attr(attrCCMajor), c.attr(attrCCMinor)
	c.SMs = c.attr(attrMultiprocessors)
	c.PDL = c.CCMajor >= 9 && C.ebb_has_launch_ex() != 0 && os.Getenv("EBB_PDL") != "0"
	var total C.size_t
	C.ebb_cuDeviceTotalMem(&total, c.dev)
	c.TotalMemory = int64(total)
	if err := check("cuStreamCreate", C.ebb_cuStreamCreate(&c.stream, 1 /* non-blocking */)); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Context) attr(a int) int {
	var v C.int
	C.ebb_cuDeviceGetAttribute(&v, C.int(a), c.dev)
	return int(v)
}

// Close destroys the stream and releases the primary context.
func (c *Context) Close() error {
	err := errors.Join(
		check("cuStreamDestroy", C.ebb_cuStreamDestroy(c.stream)),
		check("cuDevicePrimaryCtxRelease", C.ebb_cuDevicePrimaryCtxRelease(c.dev)),
	)
	runtime.UnlockOSThread()
	return err
}

// Synchronize waits for all work of the context.
func (c *Context) Synchronize() error { return check("cuCtxSynchronize", C.ebb_cuCtxSynchronize()) }

// SyncStream waits for the stream.
func (c *Context) SyncStream() error {
	return check("cuStreamSynchronize", C.ebb_cuStreamSynchronize(c.stream))
}

// MemInfo reports the driver's free and total device memory.
func (c *Context) MemInfo() (free, total int64, err error) {
	var f, t C.size_t
	if err := check("cuMemGetInfo", C.ebb_cuMemGetInfo(&f, &t)); err != nil {
		return 0, 0, err
	}
	return int64(f), int64(t), nil
}

// DriverVersion is the CUDA version the driver supports (e.g. 13000).
func DriverVersion() int {
	var v C.int
	C.ebb_cuDriverGetVersion(&v)
	return int(v)
}

// CopyHtoD queues a copy of host bytes to device memory. From pageable
// memory (Go slices) the call returns once src has been staged, so src may
// be reused at once; from page-locked memory (AllocPinned) the copy is
// truly asynchronous and src must stay untouched until the stream has
// passed it (ebb's next download synchronizes).
func (c *Context) CopyHtoD(dst uintptr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return check("cuMemcpyHtoDAsync", C.ebb_cuMemcpyHtoDAsync(C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src)), c.stream))
}

// CopyDtoH copies device memory into dst after the stream's work and waits.
func (c *Context) CopyDtoH(dst []byte, src uintptr) error {
	if len(dst) == 0 {
		return nil
	}
	if err := check("cuMemcpyDtoHAsync", C.ebb_cuMemcpyDtoHAsync(unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst)), c.stream)); err != nil {
		return err
	}
	return c.SyncStream()
}

// CopyDtoD queues a device-to-device copy.
func (c *Context) CopyDtoD(dst, src uintptr, n int64) error {
	return check("cuMemcpyDtoDAsync", C.ebb_cuMemcpyDtoDAsync(C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n), c.stream))
}

// MemsetD32 queues a fill of n 32-bit words.
func (c *Context) MemsetD32(dst uintptr, v uint32, n int64) error {
	return check("cuMemsetD32Async", C.ebb_cuMemsetD32Async(C.CUdeviceptr(dst), C.uint(v), C.size_t(n), c.stream))
}

// ProfilerStart opens the region that a profiler started with
// --profile-from-start off records.
func (c *Context) ProfilerStart() error { return check("cuProfilerStart", C.ebb_cuProfilerStart()) }

// ProfilerStop closes it.
func (c *Context) ProfilerStop() error {
	if err := c.SyncStream(); err != nil {
		return err
	}
	return check("cuProfilerStop", C.ebb_cuProfilerStop())
}

// StackLimit reads the per-thread stack size the context reserves local
// memory for (CU_LIMIT_STACK_SIZE).
func (c *Context) StackLimit() (int64, error) {
	var v C.size_t
	err := check("cuCtxGetLimit", C.ebb_cuCtxGetLimit(&v, 0))
	return int64(v), err
}

// SetStackLimit sets it; the driver sizes the local-memory reservation from it.
func (c *Context) SetStackLimit(v int64) error {
	return check("cuCtxSetLimit", C.ebb_cuCtxSetLimit(0, C.size_t(v)))
}

// Event is a CUDA event for timing.
type Event struct{ e C.CUevent }

// NewEvent creates a timing event.
func (c *Context) NewEvent() (*Event, error) {
	ev := &Event{}
	return ev, check("cuEventCreate", C.ebb_cuEventCreate(&ev.e, 0))
}

// Record queues the event on the stream.
func (c *Context) Record(ev *Event) error {
	return check("cuEventRecord", C.ebb_cuEventRecord(ev.e, c.stream))
}

// Elapsed waits for end and returns the milliseconds between two events.
func Elapsed(start, end *Event) (float32, error) {
	if err := check("cuEventSynchronize", C.ebb_cuEventSynchronize(end.e)); err != nil {
		return 0, err
	}
	var ms C.float
	err := check("cuEventElapsedTime", C.ebb_cuEventElapsedTime(&ms, start.e, end.e))
	return float32(ms), err
}

// NewFence creates an event without timing, to wait on.
func (c *Context) NewFence() (*Event, error) {
	ev := &Event{}
	return ev, check("cuEventCreate", C.ebb_cuEventCreate(&ev.e, 2)) // CU_EVENT_DISABLE_TIMING
}

// Synchronize waits until the stream has passed the event.
func (ev *Event) Synchronize() error {
	return check("cuEventSynchronize", C.ebb_cuEventSynchronize(ev.e))
}

// CopyDtoHAsync queues a copy of device memory into page-locked dst.
func (c *Context) CopyDtoHAsync(dst []byte, src uintptr) error {
	if len(dst) == 0 {
		return nil
	}
	return check("cuMemcpyDtoHAsync", C.ebb_cuMemcpyDtoHAsync(unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst)), c.stream))
}

// Destroy frees the event.
func (ev *Event) Destroy() error { return check("cuEventDestroy", C.ebb_cuEventDestroy(ev.e)) }

// Graph is an instantiated CUDA graph.
type Graph struct{ exec C.CUgraphExec }

// Capture records what f queues on the stream into a graph. Work is not
// executed during capture.
func (c *Context) Capture(f func() error) (*Graph, error) {
	if err := check("cuStreamBeginCapture", C.ebb_cuStreamBeginCapture(c.stream, 1 /* thread local */)); err != nil {
		return nil, err
	}
	ferr := f()
	var g C.CUgraph
	if err := check("cuStreamEndCapture", C.ebb_cuStreamEndCapture(c.stream, &g)); err != nil || ferr != nil {
		if g != nil {
			C.ebb_cuGraphDestroy(g)
		}
		return nil, errors.Join(ferr, err)
	}
	defer C.ebb_cuGraphDestroy(g)
	gr := &Graph{}
	if err := check("cuGraphInstantiate", C.ebb_cuGraphInstantiate(&gr.exec, g, 0)); err != nil {
		return nil, err
	}
	// Uploaded now, a graph's first replay does not pay for it: that was
	// the step launching a batch's first decode (0.65-1.2 ms -> 0.3-0.55
	// for the 256 x 128 prefill's last step, H100).
	if err := check("cuGraphUpload", C.ebb_cuGraphUpload(gr.exec, c.stream)); err != nil {
		C.ebb_cuGraphExecDestroy(gr.exec)
		return nil, err
	}
	return gr, nil
}

// Launch queues a replay of the graph.
func (c *Context) Launch(g *Graph) error {
	return check("cuGraphLaunch", C.ebb_cuGraphLaunch(g.exec, c.stream))
}

// Destroy frees the graph.
func (g *Graph) Destroy() error { return check("cuGraphExecDestroy", C.ebb_cuGraphExecDestroy(g.exec)) }
