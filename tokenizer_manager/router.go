package tokenizermanager

import (
	"container/list"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"strings"
)

// LoadBalanceMethods are --load-balance-method's values (SGLang's flag):
// how a generate request that names no engine picks one of the --dp-size
// engines.
var LoadBalanceMethods = []string{"auto", "round_robin", "total_requests", "total_tokens", "prefix_affinity"}

// ParseLoadBalanceMethod checks a --load-balance-method value. SGLang's
// prefix_affinity is ebb's auto, which already weighs the prefix each
// engine holds; follow_bootstrap_room needs prefill/decode disaggregation,
// which ebb does not have.
func ParseLoadBalanceMethod(s string) (string, error) {
	switch s {
	case "", "auto", "prefix_affinity":
		return "auto", nil
	case "round_robin", "total_requests", "total_tokens":
		return s, nil
	case "follow_bootstrap_room":
		return "", fmt.Errorf("--load-balance-method %s routes by prefill/decode disaggregation's bootstrap room, which ebb does not have", s)
	}
	return "", fmt.Errorf("--load-balance-method %q: one of %s", s, strings.Join(LoadBalanceMethods, ", "))
}

// load is what unfinished requests hold on an engine.
type load struct {
	work   int64 // RequestWork, less the prompt tokens found cached
	tokens int64 // prompt tokens plus max_new_tokens
	reqs   int64
}

func (l *load) add(o load, sign int64) {
	l.work += sign * o.work
	l.tokens += sign * o.tokens
	l.reqs += sign * o.reqs
}

// router picks the data-parallel engine of each generate request and keeps
// every engine's load. It belongs to the manager loop's table.
type router struct {
	method  string
	engines []load
	next    int          // round_robin's
	known   *prefixIndex // the prefixes each engine's radix cache holds; nil where none is shared
}

func newRouter(method string, engines int, radixCache bool) *router {
	r := &router{method: method, engines: make([]load, engines)}
	if engines > 1 && engines <= maxIndexedEngines && radixCache {
		r.known = newPrefixIndex(prefixChunk, prefixIndexEntries)
	}
	return r
}

// pick chooses an engine for a prompt of ids and up to out new tokens, or
// takes engine where it is not negative, and charges the request to it.
func (r *router) pick(ids []int32, out, engine int) (int, load) {
	var fps []uint64
	var cached []int
	if r.known != nil {
		fps = r.known.fingerprints(ids)
		cached = r.known.matched(fps, len(r.engines))
	}
	cost := func(e int) load {
		l := load{work: RequestWork(len(ids), out), tokens: int64(len(ids) + max(out, 0)), reqs: 1}
		if cached != nil {
			// The radix cache keeps the last prompt token to compute.
			l.work -= prefillPositions * int64(min(cached[e], len(ids)-1))
		}
		return l
	}
	if engine < 0 {
		engine = r.choose(cost)
	}
	c := cost(engine)
	r.engines[engine].add(c, 1)
	if r.known != nil {
		r.known.record(fps, engine)
	}
	return engine, c
}

// choose applies the method: auto takes the engine whose unfinished work
// would be least with the request's (its prefill shortened by the prefix
// the engine holds), total_requests and total_tokens SGLang's counts.
func (r *router) choose(cost func(int) load) int {
	by := func(key func(e int) [2]int64) int {
		best := 0
		for e := 1; e < len(r.engines); e++ {
			k, b := key(e), key(best)
			if k[0] < b[0] || k[0] == b[0] && k[1] < b[1] {
				best = e
			}
		}
		return best
	}
	switch r.method {
	case "round_robin":
		e := r.next % len(r.engines)
		r.next++
		return e
	case "total_requests":
		return by(func(e int) [2]int64 { return [2]int64{r.engines[e].reqs, r.engines[e].tokens} })
	case "total_tokens":
		return by(func(e int) [2]int64 { return [2]int64{r.engines[e].tokens, r.engines[e].reqs} })
	}
	return by(func(e int) [2]int64 { return [2]int64{r.engines[e].work + cost(e).work, r.engines[e].reqs} })
}

// finish releases a request's load; its whole sequence (prompt and output)
// is now in that engine's radix cache.
func (r *router) finish(engine int, l load, sequence ...[]int32) {
	r.engines[engine].add(l, -1)
	if r.known != nil && len(sequence) > 0 {
		r.known.record(r.known.fingerprints(sequence...), engine)
	}
}

// checkIdle is the invariant of a manager with no request: every engine's
// load is zero. A leak would skew routing for good, so it is reported and
// cleared.
func (r *router) checkIdle() error {
	var errs []error
	for e, l := range r.engines {
		if l != (load{}) {
			errs = append(errs, fmt.Errorf("engine %d holds %+v with no request left", e, l))
			r.engines[e] = load{}
		}
	}
	return errors.Join(errs...)
}

// forgetPrefixes is for a call that may have emptied the radix caches
// (flush, a release of the KV cache, a weight update).
func (r *router) forgetPrefixes() {
	if r.known != nil {
		r.known.clear()
	}
}

const (
	prefixChunk        = 64      // tokens a fingerprint adds
	prefixIndexEntries = 1 << 18 // 16M tokens' worth of chunks, all engines together
	maxIndexedEngines  = 64      // an entry's engines are bits of a uint64
)

// prefixIndex remembers which engines were given which token prefixes, as
// SGLang's prefix_affinity does: a prefix is named by the fingerprint of its
// first k chunks for every k, and the longest known fingerprint of a prompt
// bounds what an engine's radix cache may hold of it. It is a guess (an
// engine evicts on its own); a wrong one costs a prefill, never a result.
// Least recently used entries go first.
type prefixIndex struct {
	seed  maphash.Seed
	chunk int
	limit int
	order *list.List // of *prefixEntry, most recent first
	at    map[uint64]*list.Element
}

type prefixEntry struct {
	fp      uint64
	engines uint64 // bit e: engine e was given this prefix
}

func newPrefixIndex(chunk, limit int) *prefixIndex {
	return &prefixIndex{seed: maphash.MakeSeed(), chunk: chunk, limit: limit, order: list.New(), at: map[uint64]*list.Element{}}
}

// fingerprints names each whole chunk's prefix of the tokens of parts, in
// order (parts are concatenated).
func (x *prefixIndex) fingerprints(parts ...[]int32) []uint64 {
	var h maphash.Hash
	h.SetSeed(x.seed)
	var fps []uint64
	chunk := make([]byte, 0, 4*x.chunk)
	for _, p := range parts {
		for _, t := range p {
			// A streaming hash: one write a chunk gives the sums that one a
			// token would.
			if chunk = binary.LittleEndian.AppendUint32(chunk, uint32(t)); len(chunk) == cap(chunk) {
				h.Write(chunk)
				fps = append(fps, h.Sum64())
				chunk = chunk[:0]
			}
		}
	}
	return fps
}

// matched is, per engine, how many leading tokens of the prompt whose
// fingerprints are fps it was given.
func (x *prefixIndex) matched(fps []uint64, engines int) []int {
	out := make([]int, engines)
	var seen uint64
	all := uint64(1)<<engines - 1
	for k := len(fps) - 1; k >= 0 && seen != all; k-- {
		el := x.at[fps[k]]
		if el == nil {
			continue
		}
		for e, bits := 0, el.Value.(*prefixEntry).engines&^seen; bits != 0; e, bits = e+1, bits>>1 {
			if bits&1 != 0 {
				out[e] = (k + 1) * x.chunk
			}
		}
		seen |= el.Value.(*prefixEntry).engines
	}
	return out
}

// record notes that engine was given the prefixes fps.
func (x *prefixIndex) record(fps []uint64, engine int) {
	for _, fp := range fps {
		if el := x.at[fp]; el != nil {
			el.Value.(*prefixEntry).engines |= 1 << engine
			x.order.MoveToFront(el)
			continue
		}
		x.at[fp] = x.order.PushFront(&prefixEntry{fp: fp, engines: 1 << engine})
		if x.order.Len() > x.limit {
			last := x.order.Back()
			x.order.Remove(last)
			delete(x.at, last.Value.(*prefixEntry).fp)
		}
	}
}

func (x *prefixIndex) clear() {
	x.order.Init()
	clear(x.at)
}
