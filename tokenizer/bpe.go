package tokenizer

import (
	"container/heap"
	"sync"
)

// merge is the result of merging a pair of token ids.
type merge struct {
	rank int32
	id   int32
}

// bpeModel holds a byte-level BPE vocabulary and its merge table.
type bpeModel struct {
	vocab        map[string]int32
	merges       map[uint64]merge
	ignoreMerges bool
	runeID       map[rune]int32 // id of each single byte-level rune

	mu    sync.Mutex
	cache map[string][]int32
}

const (
	cacheMaxEntries = 1 << 16
	cacheMaxPiece   = 256 // longer pieces are rare and not worth caching
)

func pairKey(a, b int32) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

// encodePiece tokenizes one pre-token already mapped to byte-level runes.
func (m *bpeModel) encodePiece(piece []rune, dst []int32) []int32 {
	s := string(piece)
	if m.ignoreMerges {
		if id, ok := m.vocab[s]; ok {
			return append(dst, id)
		}
	}
	cacheable := len(s) <= cacheMaxPiece
	if cacheable {
		m.mu.Lock()
		ids, ok := m.cache[s]
		m.mu.Unlock()
		if ok {
			return append(dst, ids...)
		}
	}
	start := len(dst)
	dst = m.merge(piece, dst)
	if cacheable {
		ids := append([]int32(nil), dst[start:]...)
		m.mu.Lock()
		if len(m.cache) >= cacheMaxEntries {
			clear(m.cache)
		}
		m.cache[s] = ids
		m.mu.Unlock()
	}
	return dst
}

// symbol is one node of the doubly linked list of current tokens.
type symbol struct {
	id         int32
	prev, next int32
	alive      bool
}

// candidate is a possible merge of symbols[pos] with its right neighbour.
type candidate struct {
	rank int32
	pos  int32
	id   int32
}

type candidateHeap []candidate

func (h candidateHeap) Len() int { return len(h) }
func (h candidateHeap) Less(i, j int) bool {
	if h[i].rank != h[j].rank {
		return h[i].rank < h[j].rank
	}
	return h[i].pos < h[j].pos
}
func (h candidateHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *candidateHeap) Push(x any)   { *h = append(*h, x.(candidate)) }
func (h *candidateHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// merge applies merges lowest rank first, leftmost first among equal ranks,
// as Hugging Face's BPE does. O(n log n) in the piece length.
func (m *bpeModel) merge(piece []rune, dst []int32) []int32 {
	syms := make([]symbol, len(piece))
	for i, r := range piece {
		id, ok := m.runeID[r]
		if !ok {
			id = -1 // cannot happen for byte-level vocabularies; dropped below
		}
		syms[i] = symbol{id: id, prev: int32(i - 1), next: int32(i + 1), alive: true}
	}
	syms[len(syms)-1].next = -1
	h := make(candidateHeap, 0, len(syms))
	push := func(pos int32) {
		next := syms[pos].next
		if next < 0 {
			return
		}
		if mg, ok := m.merges[pairKey(syms[pos].id, syms[next].id)]; ok {
			h = append(h, candidate{rank: mg.rank, pos: pos, id: mg.id})
		}
	}
	for i := range syms {
		push(int32(i))
	}
	heap.Init(&h)
	for h.Len() > 0 {
		c := heap.Pop(&h).(candidate)
		left := &syms[c.pos]
		if !left.alive || left.next < 0 {
			continue
		}
		right := &syms[left.next]
		if mg, ok := m.merges[pairKey(left.id, right.id)]; !ok || mg.id != c.id {
			continue // stale: a neighbour changed since this entry was pushed
		}
		left.id = c.id
		right.alive = false
		left.next = right.next
		if right.next >= 0 {
			syms[right.next].prev = c.pos
		}
		if left.prev >= 0 {
			if mg, ok := m.merges[pairKey(syms[left.prev].id, left.id)]; ok {
				heap.Push(&h, candidate{rank: mg.rank, pos: left.prev, id: mg.id})
			}
		}
		if left.next >= 0 {
			if mg, ok := m.merges[pairKey(left.id, syms[left.next].id)]; ok {
				heap.Push(&h, candidate{rank: mg.rank, pos: c.pos, id: mg.id})
			}
		}
	}
	for i := int32(0); i >= 0; i = syms[i].next {
		if syms[i].id >= 0 {
			dst = append(dst, syms[i].id)
		}
	}
	return dst
}
