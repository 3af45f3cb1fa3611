package weightsync

import (
	"errors"
	"fmt"

	"ebb/device"
)

// Sources gives access to a payload's shared storages: host bytes of
// shared-memory ones, device addresses of CUDA ones (each allocation
// opened once, its producer's event waited on once). Release gives every
// reference back; call it after the device has finished reading.
type Sources struct {
	payload *Payload
	ipc     device.IPCImporter // nil on devices without CUDA IPC
	opened  map[[64]byte]uintptr
	waited  map[*Storage]bool
	shm     map[string]*shmFile
}

// NewSources prepares to read p's storages; ipc may be nil.
func NewSources(p *Payload, ipc device.IPCImporter) *Sources {
	return &Sources{payload: p, ipc: ipc, opened: map[[64]byte]uintptr{}, waited: map[*Storage]bool{}, shm: map[string]*shmFile{}}
}

// Check reports, before anything is read, tensors this device cannot
// take: CUDA tensors without CUDA IPC, or from another GPU.
func (s *Sources) Check(t *Tensor) error {
	if !t.Storage.CUDA() {
		return nil
	}
	if s.ipc == nil {
		return fmt.Errorf("a CUDA tensor cannot be opened by this server (it runs on the CPU): share CPU tensors " +
			"with torch.multiprocessing.set_sharing_strategy(\"file_system\")")
	}
	if !s.ipc.SameDevice(t.Storage.Device) {
		return fmt.Errorf("the tensor is on GPU %s, not on this server's GPU: CUDA IPC needs the trainer and the engine on one GPU", t.Storage.Device)
	}
	return nil
}

// HostBytes returns a shared-memory tensor's data (valid until Release).
func (s *Sources) HostBytes(t *Tensor) ([]byte, error) {
	if t.Storage.CUDA() {
		return nil, errors.New("HostBytes of a CUDA tensor")
	}
	f, ok := s.shm[t.Storage.ShmName]
	if !ok {
		var err error
		if f, err = openShm(t.Storage.ShmName); err != nil {
			return nil, err
		}
		s.shm[t.Storage.ShmName] = f
	}
	off, n := t.ByteRange()
	if off+n > t.Storage.Bytes {
		return nil, fmt.Errorf("tensor runs past its storage")
	}
	return f.data(off, n)
}

// DevicePtr returns a CUDA tensor's address in this process; the device's
// stream waits for the producer's event first.
func (s *Sources) DevicePtr(t *Tensor) (uintptr, error) {
	st := t.Storage
	if !st.CUDA() || s.ipc == nil {
		return 0, errors.New("DevicePtr of a tensor that is not a CUDA one")
	}
	base, ok := s.opened[st.IPCHandle]
	if !ok {
		var err error
		if base, err = s.ipc.OpenIPCMemory(st.IPCHandle); err != nil {
			return 0, fmt.Errorf("open the trainer's CUDA memory: %w", err)
		}
		s.opened[st.IPCHandle] = base
	}
	if st.EventSync && !s.waited[st] {
		if err := s.ipc.WaitIPCEvent(st.Event); err != nil {
			return 0, fmt.Errorf("wait for the trainer's event: %w", err)
		}
		s.waited[st] = true
	}
	off, _ := t.ByteRange()
	return base + uintptr(st.IPCOffset+off), nil
}

// Release closes what was opened and gives the producer back every
// reference the payload carried, whether or not it was read, so that the
// trainer can free (torch.cuda.ipc_collect) or unlink its memory.
func (s *Sources) Release() error {
	var errs []error
	for base, p := range s.opened {
		errs = append(errs, s.ipc.CloseIPCMemory(p))
		delete(s.opened, base)
	}
	for _, st := range s.payload.Storages {
		if st.CUDA() {
			errs = append(errs, decrementCUDARefCounter(st.RefCounter, st.RefOffset))
			continue
		}
		f, ok := s.shm[st.ShmName]
		if !ok {
			var err error
			if f, err = openShm(st.ShmName); err != nil {
				errs = append(errs, err)
				continue
			}
			s.shm[st.ShmName] = f
		}
		f.dropReference()
	}
	for name, f := range s.shm {
		errs = append(errs, f.close())
		delete(s.shm, name)
	}
	return errors.Join(errs...)
}
