package memory

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"testing"
)

const mib = 1 << 20

func newTestManager(t *testing.T) *Manager {
	t.Helper()
	m := NewManager(NewHostPhysical(0))
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Error(err)
		}
	})
	return m
}

func fill(t *testing.T, ptr uintptr, n int64, seed uint64) []byte {
	t.Helper()
	b := HostBytes(ptr, n)
	r := rand.New(rand.NewPCG(seed, 1))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return append([]byte(nil), b...)
}

func resident(t *testing.T, r *Region) int64 {
	t.Helper()
	n, err := ResidentBytes(r.Base(), r.capacity)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestReleaseResumeKeepsAddressesAndDropsPages(t *testing.T) {
	m := newTestManager(t)
	r, err := m.Create(KVCache, RegionOptions{Capacity: 64 * mib})
	if err != nil {
		t.Fatal(err)
	}
	ptr, err := r.Alloc(48 * mib)
	if err != nil {
		t.Fatal(err)
	}
	fill(t, ptr, 48*mib, 1)
	if got := resident(t, r); got < 48*mib {
		t.Fatalf("resident %d after writing 48 MiB", got)
	}
	out := m.Release([]Tag{KVCache})
	if err := out.Err(); err != nil {
		t.Fatal(err)
	}
	if out[0].Bytes != 48*mib || r.State() != Released {
		t.Fatalf("release freed %d, state %s", out[0].Bytes, r.State())
	}
	if got := resident(t, r); got != 0 {
		t.Fatalf("resident %d after release", got)
	}
	if err := m.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	if err := m.Resume([]Tag{KVCache}).Err(); err != nil {
		t.Fatal(err)
	}
	// Same address, writable again; KV contents need not survive.
	b := HostBytes(ptr, 48*mib)
	b[0], b[len(b)-1] = 7, 9
	if r.State() != Resident {
		t.Fatalf("state %s after resume", r.State())
	}
	if err := m.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

func TestCPUBackupRestoresBitExact(t *testing.T) {
	m := newTestManager(t)
	r, _ := m.Create(Weights, RegionOptions{Capacity: 32 * mib, PreserveContents: true, CPUBackup: true})
	var ptrs []uintptr
	var want [][]byte
	for i, size := range []int64{3 * mib, 1000, 5*mib + 17} {
		p, err := r.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		ptrs = append(ptrs, p)
		want = append(want, fill(t, p, size, uint64(i)))
	}
	for cycle := 0; cycle < 3; cycle++ {
		if err := m.Release([]Tag{Weights}).Err(); err != nil {
			t.Fatal(err)
		}
		if st := m.Stats()[0]; st.BackedUp == 0 || st.Reserved != 0 {
			t.Fatalf("stats after release: %+v", st)
		}
		if err := m.Resume([]Tag{Weights}).Err(); err != nil {
			t.Fatal(err)
		}
		if r.State() != Resident {
			t.Fatalf("state %s with backup", r.State())
		}
		for i, p := range ptrs {
			if !bytes.Equal(HostBytes(p, int64(len(want[i]))), want[i]) {
				t.Fatalf("cycle %d: allocation %d differs after restore", cycle, i)
			}
		}
	}
}

func TestWithoutBackupWeightsComeBackStale(t *testing.T) {
	m := newTestManager(t)
	r, _ := m.Create(Weights, RegionOptions{Capacity: 8 * mib, PreserveContents: true})
	if _, err := r.Alloc(mib); err != nil {
		t.Fatal(err)
	}
	m.Release([]Tag{Weights})
	out := m.Resume([]Tag{Weights})
	if out.Err() != nil || r.State() != Stale || out[0].Note == "" {
		t.Fatalf("resume: %+v state %s", out, r.State())
	}
	if m.AllResident() {
		t.Fatal("AllResident with stale weights")
	}
	if err := m.MarkResident(Weights); err != nil || r.State() != Resident {
		t.Fatalf("MarkResident: %v, %s", err, r.State())
	}
}

func TestMisuseIsReportedNotFatal(t *testing.T) {
	m := newTestManager(t)
	r, _ := m.Create(CUDAGraph, RegionOptions{Capacity: 4 * mib})
	p, _ := r.Alloc(mib)
	tests := []struct {
		name string
		call func() error
		want error
	}{
		{"resume resident", func() error { return m.Resume([]Tag{CUDAGraph}).Err() }, ErrAlreadyResident},
		{"release", func() error { return m.Release([]Tag{CUDAGraph}).Err() }, nil},
		{"release twice", func() error { return m.Release([]Tag{CUDAGraph}).Err() }, ErrAlreadyReleased},
		{"alloc while released", func() error { _, err := r.Alloc(10); return err }, ErrReleased},
		{"unknown tag", func() error { return m.Release([]Tag{"activations"}).Err() }, ErrUnknownTag},
		{"mark released resident", func() error { return m.MarkResident(CUDAGraph) }, ErrReleased},
		{"resume", func() error { return m.Resume([]Tag{CUDAGraph}).Err() }, nil},
		{"free twice", func() error { r.Free(p); return r.Free(p) }, nil},
	}
	for _, tc := range tests {
		err := tc.call()
		switch {
		case tc.name == "free twice":
			if err == nil {
				t.Errorf("%s: no error", tc.name)
			}
		case tc.want == nil && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.want != nil && !errors.Is(err, tc.want):
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
		if err := m.CheckInvariants(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
	}
	if Tag("bogus").Valid() || !Tag("kv_cache").Valid() {
		t.Error("Tag.Valid")
	}
}

func TestWorkspaceCachingAllocator(t *testing.T) {
	m := newTestManager(t)
	r, _ := m.Create(Workspace, RegionOptions{Capacity: 256 * mib, GrowStep: 8 * mib})
	a, _ := r.Alloc(3 * mib)
	b, _ := r.Alloc(20 * mib)
	c, _ := r.Alloc(100)
	st := r.stats()
	if st.Allocated < 23*mib || st.Reserved < st.Allocated {
		t.Fatalf("stats %+v", st)
	}
	r.Free(b)
	if got := r.stats().Reserved; got != st.Reserved {
		t.Fatalf("free changed reserved: %d -> %d", st.Reserved, got)
	}
	freed, err := r.EmptyCache()
	if err != nil || freed == 0 {
		t.Fatalf("EmptyCache freed %d, %v", freed, err)
	}
	if after := r.stats(); after.Reserved != st.Reserved-freed || after.Allocated != st.Allocated-20*mib {
		t.Fatalf("after empty cache: %+v (freed %d)", after, freed)
	}
	// Reuse after free: the same bytes are found again without growing.
	r.Free(c)
	before := r.stats().Reserved
	if _, err := r.Alloc(100); err != nil || r.stats().Reserved != before {
		t.Fatalf("re-alloc grew the region: %v", err)
	}
	r.Free(a)
	if err := m.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

func TestOutOfMemory(t *testing.T) {
	m := newTestManager(t)
	r, _ := m.Create(KVCache, RegionOptions{Capacity: 4 * mib})
	if _, err := r.Alloc(5 * mib); !errors.Is(err, ErrOutOfMemory) {
		t.Fatalf("got %v", err)
	}
	if _, err := r.Alloc(4 * mib); err != nil {
		t.Fatalf("full-capacity alloc: %v", err)
	}
}

func TestRandomAllocFreeKeepsInvariants(t *testing.T) {
	m := newTestManager(t)
	r, _ := m.Create(Workspace, RegionOptions{Capacity: 512 * mib, GrowStep: 2 * mib})
	rng := rand.New(rand.NewPCG(7, 7))
	live := map[uintptr]bool{}
	for i := 0; i < 2000; i++ {
		switch op := rng.IntN(10); {
		case op < 5:
			p, err := r.Alloc(int64(rng.IntN(6*mib) + 1))
			if err != nil && !errors.Is(err, ErrOutOfMemory) {
				t.Fatal(err)
			}
			if err == nil {
				live[p] = true
			}
		case op < 9:
			for p := range live {
				if err := r.Free(p); err != nil {
					t.Fatal(err)
				}
				delete(live, p)
				break
			}
		default:
			if _, err := r.EmptyCache(); err != nil {
				t.Fatal(err)
			}
		}
		if err := m.CheckInvariants(); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
	}
}

// TestManyCyclesDoNotGrow is the CPU version of the 1000-cycle acceptance.
func TestManyCyclesDoNotGrow(t *testing.T) {
	m := NewManager(NewHostPhysical(64 << 10))
	defer m.Close()
	w, _ := m.Create(Weights, RegionOptions{Capacity: 16 * mib, PreserveContents: true, CPUBackup: true})
	kv, _ := m.Create(KVCache, RegionOptions{Capacity: 32 * mib})
	ws, _ := m.Create(Workspace, RegionOptions{Capacity: 64 * mib, GrowStep: 4 * mib})
	wp, _ := w.Alloc(mib)
	want := fill(t, wp, mib, 3)
	kv.Alloc(32 * mib)
	persistent, _ := ws.Alloc(mib)
	first := m.Stats()
	for cycle := 0; cycle < 1000; cycle++ {
		scratch, err := ws.Alloc(int64(1+cycle%7) * mib / 4)
		if err != nil {
			t.Fatal(err)
		}
		ws.Free(scratch)
		if err := m.Release([]Tag{KVCache, Weights}).Err(); err != nil {
			t.Fatal(err)
		}
		if _, err := ws.EmptyCache(); err != nil {
			t.Fatal(err)
		}
		if err := m.Release([]Tag{Workspace}).Err(); err != nil {
			t.Fatal(err)
		}
		if err := m.Resume([]Tag{Weights, Workspace, KVCache, CUDAGraph}).Err(); err == nil {
			t.Fatal("resuming a tag without a region should report it")
		}
		if err := m.CheckInvariants(); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(HostBytes(wp, mib), want) {
		t.Fatal("weights changed over cycles")
	}
	last := m.Stats()
	for i := range first {
		if last[i].Capacity != first[i].Capacity || last[i].Allocated != first[i].Allocated {
			t.Fatalf("%s grew: %+v -> %+v", first[i].Tag, first[i], last[i])
		}
		if last[i].Reserved > first[i].Reserved+7*mib {
			t.Fatalf("%s reserved grew: %d -> %d", first[i].Tag, first[i].Reserved, last[i].Reserved)
		}
	}
	_ = persistent
}
