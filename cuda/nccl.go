package cuda

/*
#include <stdlib.h>
#include "ebbcuda.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"time"
	"unsafe"

	"ebb/device"
)

// NCCL result codes ebb distinguishes.
const (
	ncclSuccess    = 0
	ncclInProgress = 7
)

// NCCL data types.
const (
	ncclInt32    = 2
	ncclFloat16  = 6
	ncclFloat32  = 7
	ncclBfloat16 = 9
)

// NCCLError is a failed NCCL call.
type NCCLError struct {
	Call string
	Code int
}

func (e *NCCLError) Error() string {
	return fmt.Sprintf("%s: %s (%d)", e.Call, C.GoString(C.ebb_nccl_error_string(C.int(e.Code))), e.Code)
}

func ncclCheck(call string, r C.int) error {
	if r == ncclSuccess {
		return nil
	}
	return &NCCLError{Call: call, Code: int(r)}
}

// ErrTimeout is returned when a collective does not finish in time; the
// communicator is aborted and cannot be used again.
var ErrTimeout = errors.New("timed out")

// NCCLVersion reports the loaded library's version (e.g. 22803).
func NCCLVersion() (int, error) {
	if err := loadNCCL(); err != nil {
		return 0, err
	}
	var v C.int
	if err := ncclCheck("ncclGetVersion", C.ebb_ncclGetVersion(&v)); err != nil {
		return 0, err
	}
	return int(v), nil
}

// NCCLUniqueID makes the id rank 0 hands to the others.
func NCCLUniqueID() ([128]byte, error) {
	var id [128]byte
	if err := loadNCCL(); err != nil {
		return id, err
	}
	var uid C.ncclUniqueId
	if err := ncclCheck("ncclGetUniqueId", C.ebb_ncclGetUniqueId(&uid)); err != nil {
		return id, err
	}
	copy(id[:], C.GoBytes(unsafe.Pointer(&uid.internal[0]), 128))
	return id, nil
}

// Comm is an NCCL communicator on the context's device and stream. Calls
// that can wait on other ranks take a timeout; when it passes, the
// communicator is aborted (it is unusable afterwards) and ErrTimeout
// returned, so a peer that died never hangs the engine.
type Comm struct {
	ctx     *Context
	c       C.ncclComm_t
	Rank    int
	Size    int
	aborted bool
}

// NewComm joins the communicator id as rank of nranks, waiting at most
// timeout for the other ranks. Its calls do not block: a trainer's group
// can die at any time.
func (c *Context) NewComm(id [128]byte, nranks, rank int, timeout time.Duration) (*Comm, error) {
	cm, err := c.initComm(id, nranks, rank, false)
	if err != nil {
		return nil, err
	}
	if err := cm.wait("ncclCommInitRankConfig", timeout); err != nil {
		return nil, err
	}
	return cm, nil
}

func (c *Context) initComm(id [128]byte, nranks, rank int, blocking bool) (*Comm, error) {
	if err := loadNCCL(); err != nil {
		return nil, err
	}
	cm := &Comm{ctx: c, Rank: rank, Size: nranks}
	cid := C.CBytes(id[:])
	defer C.free(cid)
	b := C.int(0)
	if blocking {
		b = 1
	}
	r := C.ebb_nccl_init(&cm.c, C.int(nranks), (*C.char)(cid), C.int(rank), b)
	if r != ncclSuccess && r != ncclInProgress {
		return nil, ncclCheck("ncclCommInitRankConfig", r)
	}
	return cm, nil
}

// wait polls the communicator until its pending operation is done.
func (cm *Comm) wait(call string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var state C.int
		if err := ncclCheck("ncclCommGetAsyncError", C.ebb_ncclCommGetAsyncError(cm.c, &state)); err != nil {
			cm.Abort()
			return err
		}
		switch state {
		case ncclSuccess:
			return nil
		case ncclInProgress:
		default:
			cm.Abort()
			return fmt.Errorf("%s: %w", call, &NCCLError{Call: "ncclCommGetAsyncError", Code: int(state)})
		}
		if time.Now().After(deadline) {
			cm.Abort()
			return fmt.Errorf("%s: %w after %v (a rank did not take part)", call, ErrTimeout, timeout)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// Synchronize waits for the stream's work, NCCL kernels included, checking
// the communicator for errors and aborting it at the timeout.
func (cm *Comm) Synchronize(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		switch r := C.ebb_cuStreamQuery(cm.ctx.stream); r {
		case 0:
			return nil
		case 600: // CUDA_ERROR_NOT_READY
		default:
			return check("cuStreamQuery", r)
		}
		var state C.int
		if C.ebb_ncclCommGetAsyncError(cm.c, &state) != ncclSuccess || (state != ncclSuccess && state != ncclInProgress) {
			cm.Abort()
			return fmt.Errorf("NCCL: %w", &NCCLError{Call: "ncclCommGetAsyncError", Code: int(state)})
		}
		if time.Now().After(deadline) {
			cm.Abort()
			return fmt.Errorf("NCCL: %w after %v (a rank stopped taking part)", ErrTimeout, timeout)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

func ncclType(dt device.DType) (C.int, error) {
	switch dt {
	case device.F32:
		return ncclFloat32, nil
	case device.BF16:
		return ncclBfloat16, nil
	case device.F16:
		return ncclFloat16, nil
	case device.I32:
		return ncclInt32, nil
	}
	return 0, fmt.Errorf("NCCL: no type for %s", dt)
}

// Broadcast queues a broadcast of t from root (in place on every rank).
func (cm *Comm) Broadcast(t device.Tensor, root int, timeout time.Duration) error {
	dt, err := ncclType(t.DType)
	if err != nil {
		return err
	}
	r := C.ebb_nccl_broadcast(C.CUdeviceptr(t.Ptr), C.size_t(t.Numel()), dt, C.int(root), cm.c, cm.ctx.stream)
	if r == ncclInProgress {
		return cm.wait("ncclBroadcast", timeout)
	}
	return ncclCheck("ncclBroadcast", r)
}

// AllReduceSum queues an in-place sum over the ranks.
func (cm *Comm) AllReduceSum(t device.Tensor) error {
	dt, err := ncclType(t.DType)
	if err != nil {
		return err
	}
	r := C.ebb_nccl_all_reduce(C.CUdeviceptr(t.Ptr), C.CUdeviceptr(t.Ptr), C.size_t(t.Numel()), dt, 0 /* ncclSum */, cm.c, cm.ctx.stream)
	if r == ncclInProgress {
		return cm.wait("ncclAllReduce", time.Minute)
	}
	return ncclCheck("ncclAllReduce", r)
}

// AllGather queues a gather of every rank's send (n elements) into recv
// (Size*n elements, rank order).
func (cm *Comm) AllGather(send, recv device.Tensor) error {
	dt, err := ncclType(send.DType)
	if err != nil {
		return err
	}
	r := C.ebb_nccl_all_gather(C.CUdeviceptr(send.Ptr), C.CUdeviceptr(recv.Ptr), C.size_t(send.Numel()), dt, cm.c, cm.ctx.stream)
	if r == ncclInProgress {
		return cm.wait("ncclAllGather", time.Minute)
	}
	return ncclCheck("ncclAllGather", r)
}

// Abort tears the communicator down at once, ending its pending kernels.
func (cm *Comm) Abort() {
	if cm != nil && !cm.aborted {
		cm.aborted = true
		C.ebb_ncclCommAbort(cm.c)
	}
}

// Aborted reports whether the communicator was torn down by an error.
func (cm *Comm) Aborted() bool { return cm.aborted }

// Destroy frees the communicator. It aborts rather than calling
// ncclCommDestroy, which waits for the other ranks to tear down too: a
// trainer that destroys its process group only after our reply (as
// destroy_weights_update_group callers do) would wait forever.
func (cm *Comm) Destroy() error {
	cm.Abort()
	return nil
}
