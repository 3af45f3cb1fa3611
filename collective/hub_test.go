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
	full := make([]device.Tensor, n)
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
			if errs[r] != nil {
				return
			}
			// The logits' gather: [2, 3] per rank side by side.
			local, err := dev.Alloc(memory.Workspace, device.F32, 2, 3)
			if err == nil {
				full[r], err = dev.Alloc(memory.Workspace, device.F32, 2, 3*n)
			}
			if err != nil {
				errs[r] = err
				return
			}
			for i := range cpu.F32(local) {
				cpu.F32(local)[i] = float32(100*r + i)
			}
			h.AllGatherColumns(full[r], local)
			errs[r] = h.Err()
		}()
	}
	wg.Wait()
	for r := range n {
		if errs[r] != nil {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
		f := cpu.F32(full[r])
		for row := range 2 {
			for q := range n {
				for j := range 3 {
					if v, want := f[row*3*n+q*3+j], float32(100*q+row*3+j); v != want {
						t.Fatalf("rank %d gathered [%d, %d] = %v, want %v", r, row, q*3+j, v, want)
					}
				}
			}
		}
		for i, v := range got[r] {
			if want := float32(6 * (i + 2)); v != want {
				t.Fatalf("rank %d [%d] = %v, want %v", r, i, v, want)
			}
		}
	}
}
