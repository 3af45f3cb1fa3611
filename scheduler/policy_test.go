package scheduler

import (
	"fmt"
	"slices"
	"testing"

	"ebb/engine"
)

func policyHarness(t *testing.T, policy string, seed *uint64) *harness {
	t.Helper()
	return newHarnessConfig(t, engine.Config{Device: "cpu", MaxRunningRequests: 8, ChunkedPrefillSize: 512,
		MaxTotalTokens: 4096, CUDAGraphMaxBS: 4, SchedulePolicy: policy, RandomSeed: seed})
}

func waitingRids(c *Core) []string {
	var rids []string
	for _, r := range c.waiting {
		rids = append(rids, r.Rid)
	}
	return rids
}

// TestSchedulePolicyOrder: each policy's order of one waiting queue, over a
// radix cache that holds two prompts (p1 and p2, which differ from their
// first token).
func TestSchedulePolicyOrder(t *testing.T) {
	p1, p2 := prompt(51, 100), prompt(52, 100)
	type waiting struct {
		rid    string
		ids    []int32
		maxNew int
	}
	queue := []waiting{
		{"other", prompt(53, 60), 5},
		{"half-p1", append(slices.Clone(p1[:50]), prompt(54, 30)...), 50},
		{"p2-a", append(slices.Clone(p2), 1, 2), 20},
		{"all-p1", append(slices.Clone(p1), 3), 10},
		{"p2-b", append(slices.Clone(p2[:80]), prompt(55, 10)...), 40},
	}
	for _, c := range []struct {
		policy string
		want   []string
	}{
		{"fcfs", []string{"other", "half-p1", "p2-a", "all-p1", "p2-b"}},
		{"lof", []string{"half-p1", "p2-b", "p2-a", "all-p1", "other"}},
		// Cached tokens 0, 50, 100, 100, 80; ties keep arrival order.
		{"lpm", []string{"p2-a", "all-p1", "p2-b", "half-p1", "other"}},
		// Two requests end under each cached prompt; p1's came first in
		// the queue. Under a prompt the deeper match runs first (SGLang
		// would split p1 after 50 tokens, all-p1 ending below half-p1),
		// and what shares nothing runs last.
		{"dfs-weight", []string{"all-p1", "half-p1", "p2-a", "p2-b", "other"}},
	} {
		t.Run(c.policy, func(t *testing.T) {
			h := policyHarness(t, c.policy, nil)
			h.generate("warm-p1", p1, 1)
			h.generate("warm-p2", p2, 1)
			h.runToIdle()
			h.s.core.HoldWaiting(true)
			for _, w := range queue {
				h.generate(w.rid, w.ids, w.maxNew)
			}
			h.s.core.orderWaiting()
			got := waitingRids(h.s.core)
			if !slices.Equal(got, c.want) {
				t.Fatalf("order %v, want %v", got, c.want)
			}
			h.s.core.HoldWaiting(false)
			h.runToIdle()
			for _, w := range queue {
				if n := len(h.tokens[w.rid]); n != w.maxNew {
					t.Errorf("%s: %d tokens, want %d", w.rid, n, w.maxNew)
				}
			}
			if err := h.s.core.CheckInvariants(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestSchedulePolicyRandom: the random policy permutes the queue and
// leaves the sampling seeds drawn for requests as fcfs does.
func TestSchedulePolicyRandom(t *testing.T) {
	seed := uint64(7)
	seeds := map[string][]uint64{}
	var orders [][]string
	for _, policy := range []string{"fcfs", "random"} {
		h := policyHarness(t, policy, &seed)
		h.s.core.HoldWaiting(true)
		var rids []string
		for i := range 8 {
			rid := fmt.Sprint("r", i)
			rids = append(rids, rid)
			h.generate(rid, prompt(60+i, 20), 2)
		}
		for range 3 {
			h.s.core.orderWaiting()
		}
		got := waitingRids(h.s.core)
		if !slices.Equal(slices.Sorted(slices.Values(got)), slices.Sorted(slices.Values(rids))) {
			t.Fatalf("%s: %v is not a permutation of %v", policy, got, rids)
		}
		orders = append(orders, got)
		for _, r := range h.s.core.waiting {
			seeds[policy] = append(seeds[policy], r.seed)
		}
		slices.Sort(seeds[policy])
	}
	if slices.Equal(orders[0], orders[1]) {
		t.Errorf("random kept arrival order %v", orders[1])
	}
	if !slices.Equal(seeds["fcfs"], seeds["random"]) {
		t.Errorf("random changed the requests' sampling seeds: %v against %v", seeds["random"], seeds["fcfs"])
	}
}

func TestParseSchedulePolicy(t *testing.T) {
	for _, c := range []struct {
		in   string
		want SchedulePolicy
		ok   bool
	}{
		{"", PolicyFCFS, true}, {"fcfs", PolicyFCFS, true}, {"lpm", PolicyLPM, true}, {"dfs-weight", PolicyDFSWeight, true},
		{"lof", PolicyLOF, true}, {"random", PolicyRandom, true}, {"LPM", "", false}, {"priority", "", false},
	} {
		got, err := ParseSchedulePolicy(c.in)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("%q: %q, %v; want %q (ok %v)", c.in, got, err, c.want, c.ok)
		}
	}
}

// TestRadixMatchLen: the policies' look at the cache agrees with Match on
// the length and leaves the tree as it was (no split, no recency).
func TestRadixMatchLen(t *testing.T) {
	cache := func() *RadixCache {
		c := NewRadixCache()
		c.Insert([]int32{1, 2, 3, 4}, []int32{10, 11, 12, 13})
		c.Insert([]int32{1, 2, 3, 4, 5, 6}, []int32{10, 11, 12, 13, 14, 15})
		c.Insert([]int32{9}, []int32{20})
		return c
	}
	for _, tc := range []struct {
		tokens  []int32
		matched int
		nodeKey []int32
	}{
		{nil, 0, nil},
		{[]int32{7}, 0, nil},
		{[]int32{1, 2}, 2, []int32{1, 2, 3, 4}}, // inside the first node
		{[]int32{1, 2, 3, 4}, 4, []int32{1, 2, 3, 4}},
		{[]int32{1, 2, 3, 4, 5, 8}, 5, []int32{5, 6}},
		{[]int32{9, 9}, 1, []int32{9}},
	} {
		c := cache()
		clock := c.clock
		matched, node := c.matchLen(tc.tokens)
		if matched != tc.matched || !slices.Equal(node.key, tc.nodeKey) {
			t.Errorf("%v: %d tokens ending in node %v, want %d in %v", tc.tokens, matched, node.key, tc.matched, tc.nodeKey)
		}
		if c.clock != clock || len(c.root.children[1].key) != 4 {
			t.Fatalf("%v: matchLen changed the tree", tc.tokens)
		}
		if slots, _ := c.Match(tc.tokens); len(slots) != matched {
			t.Errorf("%v: Match finds %d tokens, matchLen %d", tc.tokens, len(slots), matched)
		}
	}
}
