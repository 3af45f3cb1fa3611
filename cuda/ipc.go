package cuda

/*
#include <string.h>
#include "ebbcuda.h"
*/
import "C"

import (
	"fmt"
	"strings"
	"unsafe"
)

// OpenIPCMemory maps another process's allocation, given its
// cudaIpcMemHandle, into this context. Each handle may be open once per
// process at a time; CloseIPCMemory unmaps it.
func (c *Context) OpenIPCMemory(handle [64]byte) (uintptr, error) {
	var h C.CUipcMemHandle
	C.memcpy(unsafe.Pointer(&h.reserved[0]), unsafe.Pointer(&handle[0]), 64)
	var p C.CUdeviceptr
	// 1: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, for memory on another GPU.
	if err := check("cuIpcOpenMemHandle", C.ebb_cuIpcOpenMemHandle(&p, h, 1)); err != nil {
		return 0, err
	}
	return uintptr(p), nil
}

// CloseIPCMemory unmaps memory opened by OpenIPCMemory.
func (c *Context) CloseIPCMemory(p uintptr) error {
	return check("cuIpcCloseMemHandle", C.ebb_cuIpcCloseMemHandle(C.CUdeviceptr(p)))
}

// WaitIPCEvent makes the stream wait for another process's event (the
// producer's writes to memory it shares).
func (c *Context) WaitIPCEvent(handle [64]byte) error {
	var h C.CUipcEventHandle
	C.memcpy(unsafe.Pointer(&h.reserved[0]), unsafe.Pointer(&handle[0]), 64)
	var ev C.CUevent
	if err := check("cuIpcOpenEventHandle", C.ebb_cuIpcOpenEventHandle(&ev, h)); err != nil {
		return err
	}
	defer C.ebb_cuEventDestroy(ev)
	return check("cuStreamWaitEvent", C.ebb_cuStreamWaitEvent(c.stream, ev, 0))
}

// UUID is the device's UUID as PyTorch prints it (8-4-4-4-12 hex digits).
func (c *Context) UUID() (string, error) {
	var u C.CUuuid
	if err := check("cuDeviceGetUuid", C.ebb_cuDeviceGetUuid(&u, c.dev)); err != nil {
		return "", err
	}
	b := C.GoBytes(unsafe.Pointer(&u.bytes[0]), 16)
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}

// SameDevice reports whether a producer's device (an index or a UUID, with
// or without "GPU-") is this context's GPU; an index cannot be compared
// across processes with different CUDA_VISIBLE_DEVICES, so it always
// matches.
func (c *Context) SameDevice(producer string) bool {
	if !strings.Contains(producer, "-") {
		return true
	}
	u, err := c.UUID()
	return err != nil || strings.EqualFold(strings.TrimPrefix(producer, "GPU-"), u)
}
