package cpu

import (
	"fmt"
	"sync"

	"ebb/device"
)

// LocalGroup is a collective between CPU devices of one process, one per
// goroutine: each AllReduceSum waits until every rank has called it, then
// every rank gets the sum taken in rank order (so all ranks hold the same
// bits). It is what tensor parallelism's arithmetic is tested with.
type LocalGroup struct {
	mu       sync.Mutex
	cond     *sync.Cond
	n        int
	parts    [][]float32
	arrived  int
	gen      int
	sum      []float32
	taken    int
	mismatch bool
}

// NewLocalGroup returns the collectives of n ranks.
func NewLocalGroup(n int) []device.Collective {
	g := &LocalGroup{n: n, parts: make([][]float32, n)}
	g.cond = sync.NewCond(&g.mu)
	out := make([]device.Collective, n)
	for r := range out {
		out[r] = &localRank{g: g, rank: r}
	}
	return out
}

type localRank struct {
	g    *LocalGroup
	rank int
	err  error
}

func (l *localRank) Err() error { return l.err }

func (l *localRank) AllReduceSum(t device.Tensor) {
	if l.err != nil {
		return
	}
	if t.DType != device.F32 {
		l.err = fmt.Errorf("all-reduce of %s: the CPU device computes in float32", t.DType)
		return
	}
	g, x := l.g, F32(t)
	g.mu.Lock()
	defer g.mu.Unlock()
	for g.taken > 0 { // the previous round is still being read
		g.cond.Wait()
	}
	gen := g.gen
	g.parts[l.rank] = x
	g.arrived++
	if g.arrived == g.n {
		g.sum = append(g.sum[:0], g.parts[0]...)
		g.mismatch = false
		for _, p := range g.parts[1:] {
			if len(p) != len(g.sum) {
				g.mismatch = true
				continue
			}
			for i, v := range p {
				g.sum[i] += v
			}
		}
		g.arrived, g.taken = 0, g.n
		g.gen++
		g.cond.Broadcast()
	}
	for g.gen == gen {
		g.cond.Wait()
	}
	if g.mismatch {
		l.err = fmt.Errorf("all-reduce: the ranks gave tensors of different sizes")
	} else {
		copy(x, g.sum)
	}
	g.taken--
	if g.taken == 0 {
		g.cond.Broadcast()
	}
}
