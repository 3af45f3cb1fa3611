package collective

import (
	"path/filepath"
	"sync"
	"testing"
	"time"

	"ebb/device"
	"ebb/device/cpu"
	"ebb/memory"
)

// TestHubSumsInRankOrder: three ranks' hubs (goroutines here, processes in
// ebb serve) each end with the sum, twice in a row: the
// hub carries any number of rounds.
func TestHubSumsInRankOrder(t *testing.T) {
	ep := "ipc://" + filepath.Join(t.TempDir(), "hub")
	const n = 3
	var wg sync.WaitGroup
	got := make([][]float32, n)
	errs := make([]error, n)
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h, err := NewHub(r, n, ep, 5*time.Second)
			if err != nil {
				errs[r] = err
				return
			}
			defer h.Close()
			dev := cpu.New(0)
			if _, err := dev.Memory().Create(memory.Workspace, memory.RegionOptions{Capacity: 1 << 20, GrowStep: 1 << 20}); err != nil {
				errs[r] = err
				return
			}
			x, err := dev.Alloc(memory.Workspace, device.F32, 4)
			if err != nil {
				errs[r] = err
				return
			}
			buf := cpu.F32(x)
			for round := range 2 {
				for i := range buf {
					buf[i] = float32(r+1) * float32(i+1+round)
				}
				h.AllReduceSum(x)
			}
			got[r], errs[r] = append([]float32(nil), buf...), h.Err()
		}()
	}
	wg.Wait()
	for r := range n {
		if errs[r] != nil {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
		for i, v := range got[r] {
			if want := float32(6 * (i + 2)); v != want {
				t.Fatalf("rank %d [%d] = %v, want %v", r, i, v, want)
			}
		}
	}
}
