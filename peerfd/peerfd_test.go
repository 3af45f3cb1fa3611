package peerfd

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// content reads what a received descriptor's file holds.
func content(t *testing.T, fd int) string {
	t.Helper()
	b := make([]byte, 64)
	n, err := syscall.Pread(fd, b, 0)
	if err != nil {
		t.Fatal(err)
	}
	return string(b[:n])
}

func TestExchange(t *testing.T) {
	for _, size := range []int{2, 4} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			name := fmt.Sprintf("ebb-peerfd-test-%d-%d", os.Getpid(), size)
			groups := make([]*Group, size)
			files := make([]*os.File, size)
			for r := range groups {
				g, err := Listen(name, r, size)
				if err != nil {
					t.Fatal(err)
				}
				defer g.Close()
				groups[r] = g
				f, err := os.CreateTemp(t.TempDir(), "peerfd")
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				files[r] = f
			}
			for round := 1; round <= 3; round++ { // the same group, again and again
				for r, f := range files {
					if _, err := f.WriteAt([]byte(fmt.Sprintf("rank %d round %d", r, round)), 0); err != nil {
						t.Fatal(err)
					}
				}
				got := make([][]int, size)
				errs := make([]error, size)
				var wg sync.WaitGroup
				for r := range groups {
					wg.Add(1)
					go func() {
						defer wg.Done()
						got[r], errs[r] = groups[r].Exchange(int(files[r].Fd()), 5*time.Second)
					}()
				}
				wg.Wait()
				for r := range groups {
					if errs[r] != nil {
						t.Fatalf("rank %d: %v", r, errs[r])
					}
					for p, fd := range got[r] {
						if p == r {
							if fd != -1 {
								t.Errorf("rank %d got a descriptor from itself", r)
							}
							continue
						}
						if want, have := fmt.Sprintf("rank %d round %d", p, round), content(t, fd); have != want {
							t.Errorf("rank %d from %d: %q, want %q", r, p, have, want)
						}
						syscall.Close(fd)
					}
				}
			}
		})
	}
}

func TestExchangeErrors(t *testing.T) {
	name := fmt.Sprintf("ebb-peerfd-err-%d", os.Getpid())
	g0, err := Listen(name, 0, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer g0.Close()
	f, err := os.CreateTemp(t.TempDir(), "peerfd")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()

	// Rank 1 never comes: a clear error once the time is up.
	if _, err := g0.Exchange(int(f.Fd()), 200*time.Millisecond); err == nil || !strings.Contains(err.Error(), "rank 1") {
		t.Fatalf("missing rank: %v", err)
	}

	// Rank 1 comes a round behind: neither side takes the other's message.
	g1, err := Listen(name, 1, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer g1.Close()
	done := make(chan error, 1)
	go func() { _, err := g1.Exchange(int(f.Fd()), time.Second); done <- err }()
	if _, err := g0.Exchange(int(f.Fd()), time.Second); err == nil || !strings.Contains(err.Error(), "round") {
		t.Errorf("rank 0, rounds apart: %v", err)
	}
	if err := <-done; err == nil {
		t.Error("rank 1, rounds apart: no error")
	}

	if _, err := Listen(name, 2, 2); err == nil {
		t.Error("rank 2 of 2 accepted")
	}
	if _, err := Listen(name, 0, 2); err == nil {
		t.Error("a second rank 0 accepted")
	}
}
