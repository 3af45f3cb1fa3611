package tokenizermanager

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

func TestParseLoadBalanceMethod(t *testing.T) {
	for _, c := range []struct{ in, want, err string }{
		{"", "auto", ""},
		{"auto", "auto", ""},
		{"prefix_affinity", "auto", ""},
		{"round_robin", "round_robin", ""},
		{"total_requests", "total_requests", ""},
		{"total_tokens", "total_tokens", ""},
		{"follow_bootstrap_room", "", "disaggregation"},
		{"shortest", "", "one of auto, round_robin"},
	} {
		got, err := ParseLoadBalanceMethod(c.in)
		if got != c.want || (err == nil) != (c.err == "") || err != nil && !strings.Contains(err.Error(), c.err) {
			t.Errorf("%q: %q, %v; want %q, an error with %q", c.in, got, err, c.want, c.err)
		}
	}
}

func seq(n, seed int) []int32 {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = int32((i*7919 + seed*104729) % 151936)
	}
	return ids
}

func TestPrefixIndex(t *testing.T) {
	x := newPrefixIndex(4, 6)
	a := seq(10, 1)
	fps := x.fingerprints(a)
	if len(fps) != 2 {
		t.Fatalf("10 tokens in chunks of 4: %d fingerprints", len(fps))
	}
	if split := x.fingerprints(a[:3], a[3:]); !slices.Equal(split, fps) {
		t.Fatal("parts fingerprint differently from their concatenation")
	}
	if other := x.fingerprints(append(slices.Clone(a[:4]), 9, 9, 9, 9)); other[0] != fps[0] || other[1] == fps[1] {
		t.Fatal("a shared first chunk should share only the first fingerprint")
	}
	x.record(fps[:1], 2)
	x.record(fps, 0)
	if got := x.matched(fps, 3); !slices.Equal(got, []int{8, 0, 4}) {
		t.Fatalf("matched %v, want [8 0 4]", got)
	}
	// Six entries at most: six more push the two oldest (a's) out.
	for i := range 3 {
		x.record(x.fingerprints(seq(8, 10+i)), 1)
	}
	if got := x.matched(fps, 3); !slices.Equal(got, []int{0, 0, 0}) {
		t.Fatalf("after eviction: matched %v", got)
	}
	x.record(fps, 1)
	x.clear()
	if got := x.matched(fps, 3); !slices.Equal(got, []int{0, 0, 0}) || x.order.Len() != 0 {
		t.Fatalf("after clear: matched %v, %d entries", got, x.order.Len())
	}
}

// TestRouterMethods: each --load-balance-method on a fixed sequence of
// requests, and a named engine taking a request whatever the method.
func TestRouterMethods(t *testing.T) {
	type req struct{ in, out, engine int }
	reqs := []req{{100, 10, -1}, {10, 1000, -1}, {10, 10, -1}, {500, 10, 0}, {10, 10, -1}}
	for _, c := range []struct {
		method string
		want   []int
	}{
		{"round_robin", []int{0, 1, 2, 0, 0}},
		// fewest requests, then fewest tokens
		{"total_requests", []int{0, 1, 2, 0, 2}},
		// fewest prompt + max_new_tokens
		{"total_tokens", []int{0, 1, 2, 0, 2}},
		// least work: the long output outweighs any prompt here
		{"auto", []int{0, 1, 2, 0, 2}},
	} {
		r := newRouter(c.method, 3, false)
		var got []int
		for _, q := range reqs {
			e, _ := r.pick(seq(q.in, len(got)), q.out, q.engine)
			got = append(got, e)
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: engines %v, want %v", c.method, got, c.want)
		}
	}
	// Finishing gives the load back.
	r := newRouter("total_tokens", 2, false)
	e, l := r.pick(seq(50, 1), 50, -1)
	r.finish(e, l)
	if r.engines[e] != (load{}) || r.checkIdle() != nil {
		t.Fatalf("after finish: %+v", r.engines[e])
	}
	// A load given back wrongly is found when idle, and cleared.
	e, l = r.pick(seq(50, 2), 50, 1)
	l.work--
	r.finish(e, l)
	if err := r.checkIdle(); err == nil || !strings.Contains(err.Error(), "engine 1 holds") {
		t.Fatalf("a leaked load: %v", err)
	}
	if r.engines[1] != (load{}) || r.checkIdle() != nil {
		t.Fatalf("not cleared: %+v", r.engines)
	}
}

// TestRouterFollowsConversations: a conversation's next turn (its prompt,
// the reply, a new message) goes to the engine that holds the turns before,
// unless that engine has more work ahead of it than the cached prefix
// saves; a flush forgets what the engines held.
func TestRouterFollowsConversations(t *testing.T) {
	turn1, reply := seq(1000, 1), seq(200, 2)
	turn2 := slices.Concat(turn1, reply, seq(30, 3))
	served := func() *router {
		r := newRouter("auto", 2, true)
		e, l := r.pick(turn1, 200, 1) // named: engine 1 now holds it
		r.finish(e, l, turn1, reply)
		return r
	}
	r := served()
	if e, _ := r.pick(turn2, 100, -1); e != 1 {
		t.Fatalf("turn 2 went to engine %d, not to the one holding turn 1", e)
	}
	// Engine 1 runs turn 2 (131,850 positions of work, its prefix cached);
	// a second conversation goes to engine 0 (94,900)...
	if e, _ := r.pick(seq(300, 4), 200, -1); e != 0 {
		t.Fatalf("a new conversation went to engine %d", e)
	}
	// ...and turn 3 of the first still goes to engine 1: its 1,216 cached
	// tokens save 60,800, more than engine 1's extra 36,950.
	turn3 := slices.Concat(turn2, seq(100, 5), seq(20, 6))
	if e, _ := r.pick(turn3, 100, -1); e != 1 {
		t.Fatalf("turn 3 went to engine %d", e)
	}
	// A cached prefix that saves less than the imbalance does not hold a
	// request on the busier engine.
	big := newRouter("auto", 2, true)
	p := seq(128, 7)
	big.pick(p, 10, 0)
	big.pick(seq(10, 8), 2000, 0) // two million positions of decode ahead
	if e, _ := big.pick(slices.Concat(p, seq(5, 9)), 10, -1); e != 1 {
		t.Fatal("a short cached prefix kept the request on the busy engine")
	}
	// After a flush the router knows no prefix: a tie goes to engine 0.
	r = served()
	r.forgetPrefixes()
	if e, _ := r.pick(turn2, 100, -1); e != 0 {
		t.Fatalf("after forgetting, turn 2 still followed its prefix to engine %d", e)
	}
}

// TestRouterWithoutSharedPrefixes: on prompts that share nothing, auto
// routes as LeastLoaded over RequestWork does (the bench's floor counts on
// it), for nano-vllm's workload.
func TestRouterWithoutSharedPrefixes(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	r := newRouter("auto", 2, true)
	var work [2]int64
	for i := range 256 {
		in, out := 100+rng.IntN(925), 100+rng.IntN(925)
		want := LeastLoaded(work[:], func(w int64) int64 { return w })
		work[want] += RequestWork(in, out)
		ids := make([]int32, in)
		for j := range ids {
			ids[j] = int32(rng.IntN(151936))
		}
		if got, _ := r.pick(ids, out, -1); got != want {
			t.Fatalf("request %d: engine %d, LeastLoaded %d", i, got, want)
		}
	}
}
