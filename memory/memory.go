// Package memory manages the engine's device memory as tagged regions: each
// region is a virtual address reservation whose physical backing can be
// released and re-created at the same addresses, so pointers held by kernels
// and captured graphs stay valid across a release/resume cycle.
//
// The package is backend independent: Physical does the mapping (CUDA VMM on
// a GPU, mmap on the CPU). A Manager is not safe for concurrent use; the
// goroutine that owns the device owns it.
package memory

import (
	"errors"
	"fmt"
	"strings"
)

// Tag names a region.
type Tag string

// The regions the scheduler uses.
const (
	Weights   Tag = "weights"
	KVCache   Tag = "kv_cache"
	CUDAGraph Tag = "cuda_graph"
	Workspace Tag = "workspace"
)

// AllTags lists every tag in release order; resume runs in reverse.
var AllTags = []Tag{KVCache, CUDAGraph, Weights, Workspace}

// Valid reports whether t is one of the known tags.
func (t Tag) Valid() bool {
	for _, k := range AllTags {
		if t == k {
			return true
		}
	}
	return false
}

// State is the condition of a region's contents.
type State int

// Region states.
const (
	// Resident: physical memory is mapped and holds valid contents.
	Resident State = iota
	// Released: physical memory is back with the driver; addresses are kept.
	Released
	// Stale: mapped again after a release without backup; contents are
	// undefined until rewritten (weights wait for a weight update).
	Stale
)

func (s State) String() string {
	switch s {
	case Resident:
		return "resident"
	case Released:
		return "released"
	case Stale:
		return "stale"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

// Errors that callers can test with errors.Is.
var (
	ErrAlreadyReleased = errors.New("already released")
	ErrAlreadyResident = errors.New("already resident")
	ErrReleased        = errors.New("region is released")
	ErrOutOfMemory     = errors.New("out of memory")
	ErrUnknownTag      = errors.New("unknown tag")
)

// Physical is what a backend provides: address reservations and physical
// memory mapped into them, plus host buffers for backups.
type Physical interface {
	// Granularity is the unit of reservations and mappings.
	Granularity() int64
	// Reserve reserves size bytes of address space (no physical memory).
	Reserve(size int64) (uintptr, error)
	// Unreserve returns an address range reserved by Reserve.
	Unreserve(va uintptr, size int64) error
	// Map backs [va, va+size) with new physical memory, readable and writable.
	Map(va uintptr, size int64) (Mapping, error)
	// Unmap removes the mapping and returns its physical memory.
	Unmap(va uintptr, size int64, m Mapping) error
	// Synchronize waits for all device work that may touch mapped memory.
	Synchronize() error
	// AllocHost allocates page-locked host memory for backups.
	AllocHost(size int64) (HostBuffer, error)
	// CopyToHost and CopyFromHost move bytes between device and host buffers.
	CopyToHost(dst HostBuffer, dstOff int64, src uintptr, size int64) error
	CopyFromHost(dst uintptr, src HostBuffer, srcOff int64, size int64) error
}

// Mapping is a backend's handle for one mapped span.
type Mapping any

// HostBuffer is page-locked host memory owned by a backend.
type HostBuffer interface {
	Len() int64
	Free() error
}

// TagStats describes one region.
type TagStats struct {
	Tag         Tag    `json:"tag" msgpack:"tag"`
	State       string `json:"state" msgpack:"state"`
	Capacity    int64  `json:"capacity_bytes" msgpack:"capacity_bytes"`   // reserved address space
	Reserved    int64  `json:"reserved_bytes" msgpack:"reserved_bytes"`   // physically mapped now
	Allocated   int64  `json:"allocated_bytes" msgpack:"allocated_bytes"` // held by live allocations
	BackedUp    int64  `json:"backed_up_bytes" msgpack:"backed_up_bytes"` // host backup size
	CPUBackup   bool   `json:"cpu_backup" msgpack:"cpu_backup"`           // backup enabled
	Allocations int    `json:"allocations" msgpack:"allocations"`         // live allocation count
	Segments    int    `json:"segments" msgpack:"segments"`               // mapped spans
}

// String renders bytes in MiB for logs.
func MiB(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

// Outcome says what Release or Resume did for one tag.
type Outcome struct {
	Tag   Tag     `json:"tag" msgpack:"tag"`
	Bytes int64   `json:"bytes" msgpack:"bytes"` // freed by release, mapped by resume
	Ms    float64 `json:"ms" msgpack:"ms"`       // time taken
	State string  `json:"state" msgpack:"state"` // state afterwards
	Note  string  `json:"note,omitempty" msgpack:"note,omitempty"`
	Error string  `json:"error,omitempty" msgpack:"error,omitempty"` // Err, for the wire
	Err   error   `json:"-" msgpack:"-"`
}

// Outcomes is the result of a multi-tag call.
type Outcomes []Outcome

// Err joins the per-tag errors.
func (o Outcomes) Err() error {
	var errs []error
	for _, x := range o {
		if x.Err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", x.Tag, x.Err))
		}
	}
	return errors.Join(errs...)
}

// Summary is a one-line account for logs and replies.
func (o Outcomes) Summary() string {
	parts := make([]string, 0, len(o))
	for _, x := range o {
		s := fmt.Sprintf("%s %s (%s)", x.Tag, x.State, MiB(x.Bytes))
		if x.Err != nil {
			s = fmt.Sprintf("%s: %v", x.Tag, x.Err)
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, ", ")
}
