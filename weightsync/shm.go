package weightsync

import (
	"errors"
	"fmt"
	"os"
	"regexp"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// torch's shared memory files (at::RefcountedMapAllocator) begin with a
// 64-byte header whose first word counts the mappings and references; the
// data follows. The process that brings the count to zero unlinks the file.
const (
	shmHeader = 64
	// CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 counters per reference file.
	refCountersPerFile = 10000
)

// shmDir is where POSIX shared memory lives on Linux.
var shmDir = "/dev/shm"

var shmNamePattern = regexp.MustCompile(`^/[A-Za-z0-9_.-]{1,200}$`)

func checkShmName(name string) error {
	if !shmNamePattern.MatchString(name) || name == "/." || name == "/.." {
		return refuse("%q is not a shared memory name", name)
	}
	return nil
}

// shmFile is one of torch's shared memory files, mapped.
type shmFile struct {
	name string
	mem  []byte
}

func openShm(name string) (*shmFile, error) {
	if err := checkShmName(name); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(shmDir+name, os.O_RDWR, 0)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("shared memory %s is gone: the trainer freed the tensor before the update finished, or runs on another host", name)
		}
		return nil, fmt.Errorf("shared memory %s: %w", name, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() < shmHeader {
		return nil, fmt.Errorf("shared memory %s holds %d bytes, less than torch's header", name, st.Size())
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map %s: %w", name, err)
	}
	return &shmFile{name: name, mem: mem}, nil
}

func (f *shmFile) refcount() *int32 { return (*int32)(unsafe.Pointer(&f.mem[0])) }

// data returns n bytes at off from the start of the storage's data.
func (f *shmFile) data(off, n int64) ([]byte, error) {
	if off < 0 || n < 0 || shmHeader+off+n > int64(len(f.mem)) {
		return nil, fmt.Errorf("shared memory %s: bytes [%d, %d) of a %d-byte storage", f.name, off, off+n, len(f.mem)-shmHeader)
	}
	return f.mem[shmHeader+off : shmHeader+off+n], nil
}

// dropReference gives back one reference: the one the sender took for us
// when it pickled the storage (torch's _shared_incref), so that the file
// goes once the trainer frees its tensor.
func (f *shmFile) dropReference() {
	if atomic.AddInt32(f.refcount(), -1) == 0 {
		_ = os.Remove(shmDir + f.name)
	}
}

func (f *shmFile) close() error { return unix.Munmap(f.mem) }

// decrementCUDARefCounter gives back the producer's count for a CUDA
// storage we received (torch's CudaIPCSentData counter): the trainer's
// torch.cuda.ipc_collect() frees a block once its counter is zero.
func decrementCUDARefCounter(name string, index int64) error {
	if index < 0 || index >= refCountersPerFile {
		return fmt.Errorf("reference counter %d of %s is outside the file", index, name)
	}
	f, err := openShm(name)
	if err != nil {
		return err
	}
	defer f.close()
	// Our mapping counts as a reference while it lasts, as torch's does.
	atomic.AddInt32(f.refcount(), 1)
	defer f.dropReference()
	b, err := f.data(8*index, 8)
	if err != nil {
		return err
	}
	atomic.AddInt64((*int64)(unsafe.Pointer(&b[0])), -1)
	return nil
}
