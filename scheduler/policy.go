package scheduler

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
)

// SchedulePolicy orders the waiting queue before each prefill step
// (--schedule-policy, SGLang's names and meanings).
type SchedulePolicy string

const (
	// PolicyFCFS keeps arrival order (SGLang's default); retracted
	// requests go back to the head.
	PolicyFCFS SchedulePolicy = "fcfs"
	// PolicyLPM puts the requests with the longest cached prefix first.
	PolicyLPM SchedulePolicy = "lpm"
	// PolicyDFSWeight walks the radix cache depth first, the subtree under
	// which most waiting requests end first, so that requests sharing a
	// prefix run together while it is cached.
	PolicyDFSWeight SchedulePolicy = "dfs-weight"
	// PolicyLOF puts the longest max_new_tokens first.
	PolicyLOF SchedulePolicy = "lof"
	// PolicyRandom shuffles the queue.
	PolicyRandom SchedulePolicy = "random"
)

var schedulePolicies = []SchedulePolicy{PolicyFCFS, PolicyLPM, PolicyDFSWeight, PolicyLOF, PolicyRandom}

// ParseSchedulePolicy checks a --schedule-policy value; empty is fcfs.
func ParseSchedulePolicy(s string) (SchedulePolicy, error) {
	if s == "" {
		return PolicyFCFS, nil
	}
	if p := SchedulePolicy(s); slices.Contains(schedulePolicies, p) {
		return p, nil
	}
	names := make([]string, len(schedulePolicies))
	for i, p := range schedulePolicies {
		names[i] = string(p)
	}
	return "", fmt.Errorf("unknown schedule policy %q (ebb takes %s)", s, strings.Join(names, ", "))
}

// lpmQueueMax is the longest queue lpm orders: past it the matching costs
// more than it saves and the queue keeps arrival order (SGLang's 128).
const lpmQueueMax = 128

// policyRand is the shuffle's own source, so that random ordering leaves
// the sampling seeds drawn for requests (Core.rng) as they would be.
func policyRand(seed1, seed2 uint64) *rand.Rand {
	return rand.New(rand.NewPCG(seed1^0x5851f42d4c957f2d, seed2))
}

// orderWaiting applies the schedule policy to the waiting queue. The
// cache-aware policies need the radix cache and fall back to arrival order
// without it, as SGLang's do.
func (c *Core) orderWaiting() {
	if len(c.waiting) < 2 {
		return
	}
	switch c.opts.SchedulePolicy {
	case PolicyLOF:
		slices.SortStableFunc(c.waiting, func(a, b *request) int { return b.Params.MaxNewTokens - a.Params.MaxNewTokens })
	case PolicyRandom:
		c.policyRng.Shuffle(len(c.waiting), func(i, j int) { c.waiting[i], c.waiting[j] = c.waiting[j], c.waiting[i] })
	case PolicyLPM:
		if c.opts.DisableRadixCache || len(c.waiting) > lpmQueueMax {
			return
		}
		matched := make(map[*request]int, len(c.waiting))
		for _, r := range c.waiting {
			matched[r], _ = c.cache.matchLen(r.tokens()[:r.matchLimit()])
		}
		slices.SortStableFunc(c.waiting, func(a, b *request) int { return matched[b] - matched[a] })
	case PolicyDFSWeight:
		if !c.opts.DisableRadixCache {
			c.waiting = c.dfsWeightOrder()
		}
	}
}

// dfsWeightOrder is the waiting queue in SGLang's dfs-weight order: from
// the root, each node's children by how many waiting requests end under
// them (ties by which holds the earliest in the queue), and a node's own
// requests after its children's. Where SGLang's matching would split a
// node, the requests that end inside it come after those that match all of
// it, the deeper first, as they would under the split.
func (c *Core) dfsWeightOrder() []*request {
	type ending struct {
		r       *request
		matched int
	}
	type weighted struct {
		weight, first int
		children      []*radixNode
		own           []ending
	}
	nodes := map[*radixNode]*weighted{}
	at := func(n *radixNode, i int) (*weighted, bool) {
		w, ok := nodes[n]
		if !ok {
			w = &weighted{first: i}
			nodes[n] = w
		}
		return w, ok
	}
	for i, r := range c.waiting {
		matched, end := c.cache.matchLen(r.tokens()[:r.matchLimit()])
		w, seen := at(end, i)
		w.own = append(w.own, ending{r, matched})
		// Each node joins its parent's children when it is first seen.
		for n := end; ; n = n.parent {
			nodes[n].weight++
			if n == c.cache.root {
				break
			}
			p, parentSeen := at(n.parent, i)
			if !seen {
				p.children = append(p.children, n)
			}
			seen = parentSeen
		}
	}
	order := make([]*request, 0, len(c.waiting))
	var walk func(n *radixNode)
	walk = func(n *radixNode) {
		w := nodes[n]
		slices.SortFunc(w.children, func(a, b *radixNode) int {
			wa, wb := nodes[a], nodes[b]
			return cmp.Or(wb.weight-wa.weight, wa.first-wb.first)
		})
		for _, ch := range w.children {
			walk(ch)
		}
		slices.SortStableFunc(w.own, func(a, b ending) int { return b.matched - a.matched })
		for _, e := range w.own {
			order = append(order, e.r)
		}
	}
	walk(c.cache.root)
	return order
}
