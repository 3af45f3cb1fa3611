package peerfd

import (
	"errors"
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
			groups := listenAll(t, fmt.Sprintf("ebb-peerfd-test-%d-%d", os.Getpid(), size), size)
			files := make([]*os.File, size)
			for r := range files {
				files[r] = tempFile(t)
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

// TestExchangeWithAFailedRank: a rank with nothing to share (-1) makes the
// others fail at once with ErrPeerFailed, and the next round works.
func TestExchangeWithAFailedRank(t *testing.T) {
	const size = 3
	groups := listenAll(t, fmt.Sprintf("ebb-peerfd-failed-%d", os.Getpid()), size)
	f := tempFile(t)
	for round, failing := range []int{1, -1} {
		got := make([][]int, size)
		errs := make([]error, size)
		var wg sync.WaitGroup
		start := time.Now()
		for r := range groups {
			wg.Add(1)
			go func() {
				defer wg.Done()
				fd := int(f.Fd())
				if r == failing {
					fd = -1
				}
				got[r], errs[r] = groups[r].Exchange(fd, 10*time.Second)
			}()
		}
		wg.Wait()
		if time.Since(start) > 5*time.Second {
			t.Errorf("round %d took %v", round, time.Since(start))
		}
		for r := range groups {
			switch {
			case failing >= 0 && r != failing:
				if !errors.Is(errs[r], ErrPeerFailed) || !strings.Contains(errs[r].Error(), fmt.Sprint([]int{failing})) {
					t.Errorf("round %d, rank %d: %v, want ErrPeerFailed naming rank %d", round, r, errs[r], failing)
				}
			case errs[r] != nil:
				t.Errorf("round %d, rank %d: %v", round, r, errs[r])
			default:
				for p, fd := range got[r] {
					if (p == r) != (fd < 0) {
						t.Errorf("round %d, rank %d: descriptor %d from rank %d", round, r, fd, p)
					}
					if fd >= 0 {
						syscall.Close(fd)
					}
				}
			}
		}
	}
}

// listenAll opens every rank's end of a group, closed when the test ends.
func listenAll(t *testing.T, name string, size int) []*Group {
	t.Helper()
	groups := make([]*Group, size)
	for r := range groups {
		g, err := Listen(name, r, size)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { g.Close() })
		groups[r] = g
	}
	return groups
}

func tempFile(t *testing.T) *os.File {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "peerfd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}
