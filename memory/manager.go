package memory

import (
	"errors"
	"fmt"
	"time"
)

// Manager owns every region of one device.
type Manager struct {
	phys    Physical
	regions map[Tag]*Region
}

// NewManager starts a manager over a physical backend.
func NewManager(p Physical) *Manager {
	return &Manager{phys: p, regions: map[Tag]*Region{}}
}

// Physical returns the backend.
func (m *Manager) Physical() Physical { return m.phys }

// Create reserves a region for tag.
func (m *Manager) Create(tag Tag, opts RegionOptions) (*Region, error) {
	if !tag.Valid() {
		return nil, fmt.Errorf("create region %q: %w", tag, ErrUnknownTag)
	}
	if _, ok := m.regions[tag]; ok {
		return nil, fmt.Errorf("region %s already exists", tag)
	}
	r, err := newRegion(tag, m.phys, opts)
	if err != nil {
		return nil, err
	}
	m.regions[tag] = r
	return r, nil
}

// Region returns the region of tag, or nil.
func (m *Manager) Region(tag Tag) *Region { return m.regions[tag] }

// Alloc allocates size bytes in tag's region.
func (m *Manager) Alloc(tag Tag, size int64) (uintptr, error) {
	r := m.regions[tag]
	if r == nil {
		return 0, fmt.Errorf("alloc in %s: no such region", tag)
	}
	return r.Alloc(size)
}

// Free releases an allocation made by Alloc in tag's region.
func (m *Manager) Free(tag Tag, ptr uintptr) error {
	r := m.regions[tag]
	if r == nil {
		return fmt.Errorf("free in %s: no such region", tag)
	}
	return r.Free(ptr)
}

// Release gives the physical memory of each tag back; addresses are kept.
// A tag that is already released is reported with ErrAlreadyReleased and
// left as it is; other tags are still processed.
func (m *Manager) Release(tags []Tag) Outcomes {
	return m.each(tags, func(r *Region) (int64, error) { return r.release() })
}

// Resume maps new physical memory at the same addresses, in the order given.
func (m *Manager) Resume(tags []Tag) Outcomes {
	return m.each(tags, func(r *Region) (int64, error) { return r.resume() })
}

func (m *Manager) each(tags []Tag, f func(*Region) (int64, error)) Outcomes {
	out := make(Outcomes, 0, len(tags))
	for _, t := range tags {
		r := m.regions[t]
		if r == nil {
			err := fmt.Errorf("no region %q: %w", t, ErrUnknownTag)
			out = append(out, Outcome{Tag: t, State: "absent", Err: err, Error: err.Error()})
			continue
		}
		start := time.Now()
		n, err := f(r)
		o := Outcome{Tag: t, Bytes: n, State: r.state.String(), Err: err, Ms: float64(time.Since(start).Microseconds()) / 1000}
		if err != nil {
			o.Error = err.Error()
		}
		switch {
		case errors.Is(err, ErrAlreadyReleased), errors.Is(err, ErrAlreadyResident):
			o.Note = "nothing done: " + err.Error()
		case err == nil && r.state == Stale:
			o.Note = "contents are stale until a weight update"
		}
		out = append(out, o)
	}
	return out
}

// MarkResident records that a stale region's contents were rewritten.
func (m *Manager) MarkResident(tag Tag) error {
	r := m.regions[tag]
	if r == nil {
		return fmt.Errorf("no region %q: %w", tag, ErrUnknownTag)
	}
	switch r.state {
	case Released:
		return fmt.Errorf("%s: %w", tag, ErrReleased)
	case Stale:
		r.state = Resident
	}
	return nil
}

// MarkStale records that a region's contents are no longer valid (a
// weight update that failed halfway): they wait for a rewrite.
func (m *Manager) MarkStale(tag Tag) error {
	r := m.regions[tag]
	if r == nil {
		return fmt.Errorf("no region %q: %w", tag, ErrUnknownTag)
	}
	if r.state == Released {
		return fmt.Errorf("%s: %w", tag, ErrReleased)
	}
	r.state = Stale
	return nil
}

// EmptyCache unmaps the unused segments of tag's region.
func (m *Manager) EmptyCache(tag Tag) (int64, error) {
	r := m.regions[tag]
	if r == nil {
		return 0, nil
	}
	return r.EmptyCache()
}

// Stats reports every region, in AllTags order.
func (m *Manager) Stats() []TagStats {
	var out []TagStats
	for _, t := range AllTags {
		if r := m.regions[t]; r != nil {
			out = append(out, r.stats())
		}
	}
	return out
}

// State returns tag's state; a missing region counts as resident (nothing to
// wait for).
func (m *Manager) State(tag Tag) State {
	if r := m.regions[tag]; r != nil {
		return r.state
	}
	return Resident
}

// AllResident reports whether every region is resident and not stale.
func (m *Manager) AllResident() bool {
	for _, r := range m.regions {
		if r.state != Resident {
			return false
		}
	}
	return true
}

// CheckInvariants verifies every region's bookkeeping.
func (m *Manager) CheckInvariants() error {
	var errs []error
	for _, r := range m.regions {
		errs = append(errs, r.checkInvariants())
	}
	return errors.Join(errs...)
}

// Close unmaps and unreserves everything.
func (m *Manager) Close() error {
	var errs []error
	for t, r := range m.regions {
		errs = append(errs, r.close())
		delete(m.regions, t)
	}
	return errors.Join(errs...)
}
