package memory

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// HostPhysical emulates device virtual memory with mmap, for the CPU backend
// and for tests: a reservation is a PROT_NONE mapping; Map replaces part of
// it with fresh zero pages at the same address; Unmap turns it back into
// PROT_NONE, which drops the pages so resident memory falls.
type HostPhysical struct {
	granularity int64
}

// NewHostPhysical returns an mmap backend mapping in units of granularity
// bytes (a multiple of the page size; 0 means 2 MiB, as CUDA uses).
func NewHostPhysical(granularity int64) *HostPhysical {
	page := int64(unix.Getpagesize())
	if granularity <= 0 {
		granularity = 2 << 20
	}
	return &HostPhysical{granularity: roundUp(granularity, page)}
}

// Granularity implements Physical.
func (h *HostPhysical) Granularity() int64 { return h.granularity }

const reserveFlags = unix.MAP_PRIVATE | unix.MAP_ANONYMOUS | unix.MAP_NORESERVE

func mmapAt(va uintptr, size int64, prot, flags int) (uintptr, error) {
	addr, _, errno := unix.Syscall6(unix.SYS_MMAP, va, uintptr(size), uintptr(prot), uintptr(flags), ^uintptr(0), 0)
	if errno != 0 {
		return 0, errno
	}
	return addr, nil
}

// Reserve implements Physical.
func (h *HostPhysical) Reserve(size int64) (uintptr, error) {
	va, err := mmapAt(0, size, unix.PROT_NONE, reserveFlags)
	if err != nil {
		return 0, fmt.Errorf("mmap reserve: %w", err)
	}
	return va, nil
}

// Unreserve implements Physical.
func (h *HostPhysical) Unreserve(va uintptr, size int64) error {
	if _, _, errno := unix.Syscall(unix.SYS_MUNMAP, va, uintptr(size), 0); errno != 0 {
		return fmt.Errorf("munmap: %w", errno)
	}
	return nil
}

// Map implements Physical.
func (h *HostPhysical) Map(va uintptr, size int64) (Mapping, error) {
	got, err := mmapAt(va, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED)
	if err != nil {
		return nil, fmt.Errorf("mmap map: %w", err)
	}
	if got != va {
		return nil, fmt.Errorf("mmap map: got %#x, want %#x", got, va)
	}
	return nil, nil
}

// Unmap implements Physical.
func (h *HostPhysical) Unmap(va uintptr, size int64, _ Mapping) error {
	if _, err := mmapAt(va, size, unix.PROT_NONE, reserveFlags|unix.MAP_FIXED); err != nil {
		return fmt.Errorf("mmap unmap: %w", err)
	}
	return nil
}

// Synchronize implements Physical; CPU work is synchronous.
func (h *HostPhysical) Synchronize() error { return nil }

type hostBuffer []byte

func (b hostBuffer) Len() int64  { return int64(len(b)) }
func (b hostBuffer) Free() error { return nil }

// AllocHost implements Physical.
func (h *HostPhysical) AllocHost(size int64) (HostBuffer, error) {
	return hostBuffer(make([]byte, size)), nil
}

// CopyToHost implements Physical.
func (h *HostPhysical) CopyToHost(dst HostBuffer, dstOff int64, src uintptr, size int64) error {
	copy(dst.(hostBuffer)[dstOff:dstOff+size], HostBytes(src, size))
	return nil
}

// CopyFromHost implements Physical.
func (h *HostPhysical) CopyFromHost(dst uintptr, src HostBuffer, srcOff int64, size int64) error {
	copy(HostBytes(dst, size), src.(hostBuffer)[srcOff:srcOff+size])
	return nil
}

// HostBytes views n bytes of mmap'd memory at addr. The memory is outside the
// Go heap, so the uintptr-to-pointer conversion cannot confuse the collector;
// it is written through a pointer cast because vet cannot know that.
func HostBytes(addr uintptr, n int64) []byte {
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&addr))), n)
}

// ResidentBytes counts the pages of [addr, addr+n) that are in memory.
func ResidentBytes(addr uintptr, n int64) (int64, error) {
	page := int64(unix.Getpagesize())
	vec := make([]byte, (n+page-1)/page)
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, addr, uintptr(n), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return 0, fmt.Errorf("mincore: %w", errno)
	}
	var resident int64
	for _, v := range vec {
		if v&1 != 0 {
			resident += page
		}
	}
	return resident, nil
}
