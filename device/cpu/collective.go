package cpu

import (
	"fmt"
	"sync"

	"ebb/device"
)

// LocalGroup is a collective between CPU devices of one process, one per
// goroutine: each call waits until every rank has made it, then every rank
// reads all the parts (an all-reduce adds them in rank order, so all ranks
// hold the same bits). It is what tensor parallelism's arithmetic is tested
// with.
type LocalGroup struct {
	mu      sync.Mutex
	cond    *sync.Cond
	n       int
	parts   [][]float32
	arrived int
	gen     int
	taken   int
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

// round contributes part and, once every rank has, calls read with all of
// them; it returns once every rank has read, so that the caller may then
// overwrite its part.
func (l *localRank) round(part []float32, read func(parts [][]float32)) {
	g := l.g
	g.mu.Lock()
	defer g.mu.Unlock()
	for g.taken > 0 { // the previous round is still being read
		g.cond.Wait()
	}
	gen := g.gen
	g.parts[l.rank] = part
	g.arrived++
	if g.arrived == g.n {
		g.arrived, g.taken = 0, g.n
		g.gen++
		g.cond.Broadcast()
	}
	for g.gen == gen {
		g.cond.Wait()
	}
	read(g.parts)
	g.taken--
	if g.taken == 0 {
		g.cond.Broadcast()
	}
	for g.taken > 0 {
		g.cond.Wait()
	}
}

func (l *localRank) check(op string, ts ...device.Tensor) bool {
	for _, t := range ts {
		if l.err == nil && t.DType != device.F32 {
			l.err = fmt.Errorf("%s of %s: the CPU device computes in float32", op, t.DType)
		}
	}
	return l.err == nil
}

func (l *localRank) AllReduceSum(t device.Tensor) {
	if !l.check("all-reduce", t) {
		return
	}
	x := F32(t)
	sum := make([]float32, len(x))
	l.round(x, func(parts [][]float32) {
		copy(sum, parts[0])
		for _, p := range parts[1:] {
			if len(p) != len(sum) {
				l.err = fmt.Errorf("all-reduce: the ranks gave tensors of different sizes")
				return
			}
			for i, v := range p {
				sum[i] += v
			}
		}
	})
	if l.err == nil {
		copy(x, sum)
	}
}

func (l *localRank) AllGatherColumns(full, local device.Tensor) {
	if !l.check("all-gather", full, local) {
		return
	}
	rows, cols := local.Dim(0), local.Numel()/max(local.Dim(0), 1)
	if full.Numel() != l.g.n*local.Numel() || full.Dim(0) != rows {
		l.err = fmt.Errorf("all-gather of %v into %v over %d ranks", local.Shape, full.Shape, l.g.n)
		return
	}
	f := F32(full)
	l.round(F32(local), func(parts [][]float32) {
		for r, p := range parts {
			if len(p) != rows*cols {
				l.err = fmt.Errorf("all-gather: the ranks gave tensors of different sizes")
				return
			}
			for i := range rows {
				copy(f[(i*l.g.n+r)*cols:(i*l.g.n+r+1)*cols], p[i*cols:(i+1)*cols])
			}
		}
	})
}
