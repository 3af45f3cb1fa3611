package memory

import (
	"fmt"
	"sort"
)

// allocAlign is the alignment of every allocation (cuBLAS and vector loads
// want at least 256 bytes).
const allocAlign = 256

// RegionOptions configure a region.
type RegionOptions struct {
	// Capacity is the address space to reserve, rounded up to the granularity.
	Capacity int64
	// GrowStep is the smallest span mapped at once (rounded to the
	// granularity); larger allocations map exactly what they need.
	GrowStep int64
	// PreserveContents marks a region whose contents matter after a resume
	// (weights): without a valid backup it comes back Stale.
	PreserveContents bool
	// CPUBackup keeps a page-locked host copy of live allocations across a
	// release, restored bit-exact on resume.
	CPUBackup bool
}

// span is a byte range of a region, as an offset from its base.
type span struct{ off, size int64 }

func (s span) end() int64 { return s.off + s.size }

// segment is one physically backed span.
type segment struct {
	span
	m      Mapping
	mapped bool
}

// Region is one tag's address range and the physical memory behind it, with
// a first-fit allocator over the mapped part (caching-allocator semantics:
// frees keep memory mapped until EmptyCache).
type Region struct {
	tag      Tag
	phys     Physical
	opts     RegionOptions
	base     uintptr
	capacity int64
	state    State

	segments []*segment // sorted by offset; unmapped ones only while Released
	allocs   []span     // live allocations, sorted by offset

	host        HostBuffer
	backupValid bool
	backedUp    int64
}

func roundUp(n, m int64) int64 { return (n + m - 1) / m * m }

func newRegion(tag Tag, p Physical, opts RegionOptions) (*Region, error) {
	g := p.Granularity()
	if opts.Capacity <= 0 {
		return nil, fmt.Errorf("region %s: capacity must be positive", tag)
	}
	opts.Capacity = roundUp(opts.Capacity, g)
	opts.GrowStep = roundUp(max(opts.GrowStep, g), g)
	va, err := p.Reserve(opts.Capacity)
	if err != nil {
		return nil, fmt.Errorf("region %s: reserve %s: %w", tag, MiB(opts.Capacity), err)
	}
	return &Region{tag: tag, phys: p, opts: opts, base: va, capacity: opts.Capacity}, nil
}

// Tag names the region.
func (r *Region) Tag() Tag { return r.tag }

// Base is the first address of the reservation.
func (r *Region) Base() uintptr { return r.base }

// State reports the region's state.
func (r *Region) State() State { return r.state }

// Alloc returns the address of size bytes of mapped memory.
func (r *Region) Alloc(size int64) (uintptr, error) {
	if r.state == Released {
		return 0, fmt.Errorf("alloc %s in %s: %w", MiB(size), r.tag, ErrReleased)
	}
	if size <= 0 {
		size = allocAlign
	}
	size = roundUp(size, allocAlign)
	off, ok := r.findFree(size)
	if !ok {
		if err := r.grow(size); err != nil {
			return 0, err
		}
		if off, ok = r.findFree(size); !ok {
			return 0, fmt.Errorf("alloc %s in %s: internal error: no fit after growing", MiB(size), r.tag)
		}
	}
	i := sort.Search(len(r.allocs), func(i int) bool { return r.allocs[i].off > off })
	r.allocs = append(r.allocs, span{})
	copy(r.allocs[i+1:], r.allocs[i:])
	r.allocs[i] = span{off, size}
	return r.base + uintptr(off), nil
}

// Free returns an allocation to the region; its memory stays mapped.
func (r *Region) Free(ptr uintptr) error {
	if ptr < r.base || ptr >= r.base+uintptr(r.capacity) {
		return fmt.Errorf("free %#x: not in region %s", ptr, r.tag)
	}
	off := int64(ptr - r.base)
	i := sort.Search(len(r.allocs), func(i int) bool { return r.allocs[i].off >= off })
	if i == len(r.allocs) || r.allocs[i].off != off {
		return fmt.Errorf("free %#x: no live allocation there in %s", ptr, r.tag)
	}
	r.allocs = append(r.allocs[:i], r.allocs[i+1:]...)
	return nil
}

// findFree is first fit over the gaps between live allocations inside each
// mapped segment. Allocations never span segments, so a segment whose
// allocations are all freed can be unmapped by EmptyCache.
func (r *Region) findFree(size int64) (int64, bool) {
	a := 0
	for _, s := range r.segments {
		if !s.mapped {
			continue
		}
		for a < len(r.allocs) && r.allocs[a].end() <= s.off {
			a++
		}
		cur := s.off
		for ; a < len(r.allocs) && r.allocs[a].off < s.end(); a++ {
			if r.allocs[a].off-cur >= size {
				return cur, true
			}
			cur = r.allocs[a].end()
		}
		if s.end()-cur >= size {
			return cur, true
		}
	}
	return 0, false
}

// grow maps a new segment big enough for size: GrowStep when that fits,
// exactly size otherwise.
func (r *Region) grow(size int64) error {
	g := r.phys.Granularity()
	for _, n := range []int64{roundUp(max(size, r.opts.GrowStep), g), roundUp(size, g)} {
		if off, ok := r.firstHole(n); ok {
			return r.mapSegment(off, n)
		}
	}
	return fmt.Errorf("alloc %s in %s (capacity %s, %s mapped): %w",
		MiB(size), r.tag, MiB(r.capacity), MiB(r.mappedBytes()), ErrOutOfMemory)
}

// holeAt reports whether [off, off+size) is inside the capacity and unmapped.
func (r *Region) holeAt(off, size int64) bool {
	if off+size > r.capacity {
		return false
	}
	for _, s := range r.segments {
		if s.off < off+size && off < s.end() {
			return false
		}
	}
	return true
}

// firstHole finds the lowest unmapped range of at least size bytes.
func (r *Region) firstHole(size int64) (int64, bool) {
	cur := int64(0)
	for _, s := range r.segments {
		if s.off-cur >= size {
			return cur, true
		}
		cur = s.end()
	}
	return cur, r.capacity-cur >= size
}

func (r *Region) mapSegment(off, size int64) error {
	m, err := r.phys.Map(r.base+uintptr(off), size)
	if err != nil {
		return fmt.Errorf("map %s in %s: %w", MiB(size), r.tag, err)
	}
	s := &segment{span: span{off, size}, m: m, mapped: true}
	i := sort.Search(len(r.segments), func(i int) bool { return r.segments[i].off > off })
	r.segments = append(r.segments, nil)
	copy(r.segments[i+1:], r.segments[i:])
	r.segments[i] = s
	return nil
}

func (r *Region) overlapsAlloc(s span) bool {
	i := sort.Search(len(r.allocs), func(i int) bool { return r.allocs[i].end() > s.off })
	return i < len(r.allocs) && r.allocs[i].off < s.end()
}

// EmptyCache unmaps every segment that holds no live allocation and returns
// the bytes given back.
func (r *Region) EmptyCache() (int64, error) {
	if r.state == Released {
		return 0, nil
	}
	var freed int64
	kept := r.segments[:0]
	var firstErr error
	for _, s := range r.segments {
		if firstErr == nil && s.mapped && !r.overlapsAlloc(s.span) {
			if err := r.phys.Unmap(r.base+uintptr(s.off), s.size, s.m); err != nil {
				firstErr = fmt.Errorf("empty cache %s: %w", r.tag, err)
				kept = append(kept, s)
				continue
			}
			freed += s.size
			continue
		}
		kept = append(kept, s)
	}
	clear(r.segments[len(kept):])
	r.segments = kept
	return freed, firstErr
}

func (r *Region) mappedBytes() int64 {
	var n int64
	for _, s := range r.segments {
		if s.mapped {
			n += s.size
		}
	}
	return n
}

func (r *Region) allocatedBytes() int64 {
	var n int64
	for _, a := range r.allocs {
		n += a.size
	}
	return n
}

// release backs up (when enabled) and unmaps everything. Every segment is
// remembered, so resume maps the region back exactly as it was (a cached
// but empty workspace segment too: emptying is EmptyCache's job).
func (r *Region) release() (int64, error) {
	if r.state == Released {
		return 0, ErrAlreadyReleased
	}
	if err := r.phys.Synchronize(); err != nil {
		return 0, fmt.Errorf("synchronize: %w", err)
	}
	r.backupValid = false
	if r.opts.CPUBackup && r.state == Resident && len(r.allocs) > 0 {
		if err := r.backupToHost(); err != nil {
			return 0, err
		}
	}
	var freed int64
	for _, s := range r.segments {
		if s.mapped {
			if err := r.phys.Unmap(r.base+uintptr(s.off), s.size, s.m); err != nil {
				return freed, fmt.Errorf("unmap: %w", err)
			}
			s.mapped, s.m = false, nil
			freed += s.size
		}
	}
	r.state = Released
	return freed, nil
}

func (r *Region) backupToHost() error {
	need := r.allocatedBytes()
	if r.host == nil || r.host.Len() < need {
		if r.host != nil {
			if err := r.host.Free(); err != nil {
				return fmt.Errorf("free backup: %w", err)
			}
			r.host = nil
		}
		h, err := r.phys.AllocHost(need)
		if err != nil {
			return fmt.Errorf("allocate %s host backup: %w", MiB(need), err)
		}
		r.host = h
	}
	var off int64
	for _, a := range r.allocs {
		if err := r.phys.CopyToHost(r.host, off, r.base+uintptr(a.off), a.size); err != nil {
			return fmt.Errorf("backup to host: %w", err)
		}
		off += a.size
	}
	if err := r.phys.Synchronize(); err != nil {
		return fmt.Errorf("backup to host: %w", err)
	}
	r.backupValid, r.backedUp = true, need
	return nil
}

// resume maps the remembered segments again and restores the backup.
func (r *Region) resume() (int64, error) {
	if r.state != Released {
		return 0, ErrAlreadyResident
	}
	var mapped int64
	for _, s := range r.segments {
		m, err := r.phys.Map(r.base+uintptr(s.off), s.size)
		if err != nil {
			return mapped, fmt.Errorf("map %s: %w", MiB(s.size), err)
		}
		s.m, s.mapped = m, true
		mapped += s.size
	}
	switch {
	case r.backupValid:
		var off int64
		for _, a := range r.allocs {
			if err := r.phys.CopyFromHost(r.base+uintptr(a.off), r.host, off, a.size); err != nil {
				return mapped, fmt.Errorf("restore from host: %w", err)
			}
			off += a.size
		}
		if err := r.phys.Synchronize(); err != nil {
			return mapped, fmt.Errorf("restore from host: %w", err)
		}
		r.state = Resident
	case r.opts.PreserveContents && len(r.allocs) > 0:
		r.state = Stale
	default:
		r.state = Resident
	}
	return mapped, nil
}

// Stats describes the region.
func (r *Region) Stats() TagStats { return r.stats() }

func (r *Region) stats() TagStats {
	var backed int64
	if r.backupValid {
		backed = r.backedUp
	}
	return TagStats{
		Tag: r.tag, State: r.state.String(), Capacity: r.capacity,
		Reserved: r.mappedBytes(), Allocated: r.allocatedBytes(), BackedUp: backed,
		CPUBackup: r.opts.CPUBackup, Allocations: len(r.allocs), Segments: len(r.segments),
	}
}

// checkInvariants verifies the allocator's bookkeeping.
func (r *Region) checkInvariants() error {
	for i, s := range r.segments {
		if s.off < 0 || s.end() > r.capacity || s.size <= 0 {
			return fmt.Errorf("%s: segment %d [%d,%d) outside capacity %d", r.tag, i, s.off, s.end(), r.capacity)
		}
		if i > 0 && r.segments[i-1].end() > s.off {
			return fmt.Errorf("%s: segments %d and %d overlap", r.tag, i-1, i)
		}
		if s.mapped == (r.state == Released) {
			return fmt.Errorf("%s: segment %d mapped=%v in state %s", r.tag, i, s.mapped, r.state)
		}
	}
	for i, a := range r.allocs {
		if i > 0 && r.allocs[i-1].end() > a.off {
			return fmt.Errorf("%s: allocations %d and %d overlap", r.tag, i-1, i)
		}
		inside := false
		for _, s := range r.segments {
			inside = inside || (s.off <= a.off && a.end() <= s.end())
		}
		if !inside {
			return fmt.Errorf("%s: allocation [%d,%d) not inside one segment", r.tag, a.off, a.end())
		}
	}
	return nil
}

// close unmaps everything, frees the backup and the reservation.
func (r *Region) close() error {
	var firstErr error
	keep := func(err error) {
		if err != nil && firstErr == nil {
			firstErr = err
		}
	}
	for _, s := range r.segments {
		if s.mapped {
			keep(r.phys.Unmap(r.base+uintptr(s.off), s.size, s.m))
		}
	}
	r.segments, r.allocs = nil, nil
	if r.host != nil {
		keep(r.host.Free())
		r.host = nil
	}
	keep(r.phys.Unreserve(r.base, r.capacity))
	return firstErr
}
