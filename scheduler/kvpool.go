package scheduler

// kvPool hands out KV cache slots (one per token).
type kvPool struct {
	free  []int32
	total int
}

func newKVPool(slots int) *kvPool {
	p := &kvPool{free: make([]int32, slots), total: slots}
	for i := range p.free {
		p.free[i] = int32(slots - 1 - i) // pop from the end: low slots first
	}
	return p
}

func (p *kvPool) available() int { return len(p.free) }

// alloc takes n slots, or none when fewer are free.
func (p *kvPool) alloc(n int) ([]int32, bool) {
	if n > len(p.free) {
		return nil, false
	}
	out := make([]int32, n)
	copy(out, p.free[len(p.free)-n:])
	p.free = p.free[:len(p.free)-n]
	return out, true
}

func (p *kvPool) release(slots []int32) {
	p.free = append(p.free, slots...)
}
