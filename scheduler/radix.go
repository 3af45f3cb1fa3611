package scheduler

import (
	"container/heap"
	"fmt"
)

// RadixCache maps token prefixes to the KV slots that hold them, so requests
// that share a prefix (a system prompt, GRPO's n samples of one prompt)
// share its KV. Page size is one token. Nodes in use by running requests are
// locked; unlocked leaves are evicted least recently used first.
type RadixCache struct {
	root      *radixNode
	clock     uint64
	evictable int // slots in unlocked nodes
	protected int // slots in locked nodes
}

type radixNode struct {
	key      []int32
	slots    []int32
	children map[int32]*radixNode
	parent   *radixNode
	lockRef  int
	lastUse  uint64
}

// NewRadixCache returns an empty cache.
func NewRadixCache() *RadixCache {
	return &RadixCache{root: &radixNode{children: map[int32]*radixNode{}, lockRef: 1}}
}

func (c *RadixCache) tick() uint64 { c.clock++; return c.clock }

// Size is the number of cached slots.
func (c *RadixCache) Size() int { return c.evictable + c.protected }

// Evictable is the number of slots that Evict could free.
func (c *RadixCache) Evictable() int { return c.evictable }

func commonPrefix(a, b []int32) int {
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// Match returns the slots of the longest cached prefix of tokens and the
// node where it ends (lock it to keep the prefix).
func (c *RadixCache) Match(tokens []int32) ([]int32, *radixNode) {
	now := c.tick()
	node := c.root
	var slots []int32
	for len(tokens) > 0 {
		child, ok := node.children[tokens[0]]
		if !ok {
			break
		}
		n := commonPrefix(child.key, tokens)
		child.lastUse = now
		if n < len(child.key) {
			child = c.split(child, n)
		}
		slots = append(slots, child.slots...)
		node = child
		tokens = tokens[n:]
	}
	return slots, node
}

// matchLen is how many leading tokens are cached and the node where they
// end (the one they end inside, where that is partway), without Match's
// splits and recency: the schedule policies only look.
func (c *RadixCache) matchLen(tokens []int32) (int, *radixNode) {
	node, matched := c.root, 0
	for len(tokens) > 0 {
		child, ok := node.children[tokens[0]]
		if !ok {
			break
		}
		n := commonPrefix(child.key, tokens)
		matched += n
		node = child
		if n < len(child.key) {
			break
		}
		tokens = tokens[n:]
	}
	return matched, node
}

// split cuts node after n tokens and returns the new upper part.
func (c *RadixCache) split(node *radixNode, n int) *radixNode {
	upper := &radixNode{
		key: node.key[:n:n], slots: node.slots[:n:n], parent: node.parent,
		children: map[int32]*radixNode{node.key[n]: node}, lockRef: node.lockRef, lastUse: node.lastUse,
	}
	node.parent.children[node.key[0]] = upper
	node.key, node.slots, node.parent = node.key[n:], node.slots[n:], upper
	return upper
}

// Insert adds tokens with their slots. It returns how many leading tokens
// were already cached: the caller's slots for those are duplicates and must
// be freed (the cache keeps its own).
func (c *RadixCache) Insert(tokens, slots []int32) int {
	if len(tokens) != len(slots) {
		panic(fmt.Sprintf("radix insert: %d tokens, %d slots", len(tokens), len(slots)))
	}
	now := c.tick()
	node := c.root
	matched := 0
	for len(tokens) > 0 {
		child, ok := node.children[tokens[0]]
		if !ok {
			leaf := &radixNode{
				key: append([]int32(nil), tokens...), slots: append([]int32(nil), slots...),
				parent: node, children: map[int32]*radixNode{}, lastUse: now,
			}
			node.children[tokens[0]] = leaf
			c.evictable += len(tokens)
			return matched
		}
		n := commonPrefix(child.key, tokens)
		child.lastUse = now
		if n < len(child.key) {
			child = c.split(child, n)
		}
		matched += n
		node = child
		tokens, slots = tokens[n:], slots[n:]
	}
	return matched
}

// Lock protects the path from node to the root from eviction.
func (c *RadixCache) Lock(node *radixNode) {
	for n := node; n != c.root; n = n.parent {
		if n.lockRef == 0 {
			c.evictable -= len(n.key)
			c.protected += len(n.key)
		}
		n.lockRef++
	}
}

// Unlock undoes Lock.
func (c *RadixCache) Unlock(node *radixNode) {
	for n := node; n != c.root; n = n.parent {
		n.lockRef--
		if n.lockRef == 0 {
			c.evictable += len(n.key)
			c.protected -= len(n.key)
		}
		if n.lockRef < 0 {
			panic("radix unlock below zero")
		}
	}
}

type leafHeap []*radixNode

func (h leafHeap) Len() int           { return len(h) }
func (h leafHeap) Less(i, j int) bool { return h[i].lastUse < h[j].lastUse }
func (h leafHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *leafHeap) Push(x any)        { *h = append(*h, x.(*radixNode)) }
func (h *leafHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// Evict frees at least n slots from unlocked leaves, least recently used
// first, passing them to free. It returns the number freed.
func (c *RadixCache) Evict(n int, free func([]int32)) int {
	var h leafHeap
	c.walk(func(node *radixNode) {
		if node != c.root && len(node.children) == 0 && node.lockRef == 0 {
			h = append(h, node)
		}
	})
	heap.Init(&h)
	freed := 0
	for freed < n && h.Len() > 0 {
		leaf := heap.Pop(&h).(*radixNode)
		free(leaf.slots)
		freed += len(leaf.slots)
		c.evictable -= len(leaf.slots)
		parent := leaf.parent
		delete(parent.children, leaf.key[0])
		if parent != c.root && len(parent.children) == 0 && parent.lockRef == 0 {
			heap.Push(&h, parent)
		}
	}
	return freed
}

// Reset drops everything; it refuses while any node is locked.
func (c *RadixCache) Reset(free func([]int32)) error {
	if c.protected > 0 {
		return fmt.Errorf("%d cached tokens are in use by requests", c.protected)
	}
	c.walk(func(n *radixNode) {
		if n != c.root {
			free(n.slots)
		}
	})
	c.root.children = map[int32]*radixNode{}
	c.evictable = 0
	return nil
}

func (c *RadixCache) walk(f func(*radixNode)) {
	stack := []*radixNode{c.root}
	for len(stack) > 0 {
		n := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		f(n)
		for _, ch := range n.children {
			stack = append(stack, ch)
		}
	}
}

// check verifies counters and structure.
func (c *RadixCache) check() error {
	ev, pr := 0, 0
	var err error
	c.walk(func(n *radixNode) {
		if n == c.root || err != nil {
			return
		}
		if len(n.key) == 0 || len(n.key) != len(n.slots) {
			err = fmt.Errorf("radix node with %d tokens and %d slots", len(n.key), len(n.slots))
			return
		}
		if n.parent.children[n.key[0]] != n {
			err = fmt.Errorf("radix node not reachable from its parent")
			return
		}
		if n.lockRef < 0 {
			err = fmt.Errorf("radix node lockRef %d", n.lockRef)
			return
		}
		if n.lockRef > 0 {
			pr += len(n.key)
		} else {
			ev += len(n.key)
		}
	})
	if err != nil {
		return err
	}
	if ev != c.evictable || pr != c.protected {
		return fmt.Errorf("radix counters evictable=%d protected=%d, tree has %d and %d", c.evictable, c.protected, ev, pr)
	}
	return nil
}
