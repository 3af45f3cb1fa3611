package scheduler

import (
	"slices"
	"strings"
	"testing"

	"ebb/engine"
	"ebb/ioschema"
	"ebb/tinymodel"
)

// TestRoutedExperts: a request's routed experts cover every token but its
// last, in SGLang's [tokens, layers, k] layout with -1 in dense layers;
// they are the same whether its tokens were decoded, prefilled in chunks,
// or found in the radix cache; and asking without the server flag, or
// setting the flag for a dense model, is a clear error.
func TestRoutedExperts(t *testing.T) {
	dir := tinymodel.TestDir(t, "qwen3_moe", func(s *tinymodel.Spec) {
		s.Layers, s.MLPOnly, s.Vocab = 3, []int{1}, 4096
	})
	open := func(cfg engine.Config) *engine.Engine {
		cfg.ModelDir, cfg.Device, cfg.MaxTotalTokens, cfg.MaxRunningRequests = dir, "cpu", 2048, 8
		e, err := engine.Open(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		return e
	}
	e := open(engine.Config{EnableReturnRoutedExperts: true, ChunkedPrefillSize: 16, CUDAGraphMaxBS: 8})
	core, err := NewCoreFor(e)
	if err != nil {
		t.Fatal(err)
	}
	zero, maxNew := 0.0, 24
	greedy, err := (&ioschema.SamplingParams{Temperature: &zero, MaxNewTokens: &maxNew, IgnoreEOS: true}).Resolve(e.Defaults())
	if err != nil {
		t.Fatal(err)
	}
	p := prompt(5, 40)
	reqs := []Request{{Rid: "a", InputIDs: p, Params: greedy, ReturnRoutedExperts: true}}
	for i, n := range []int{3, 17, 50} { // company of other lengths
		reqs = append(reqs, Request{Rid: string(rune('b' + i)), InputIDs: prompt(10+i, n), Params: greedy})
	}
	outs, err := generateOn(core, reqs)
	if err != nil {
		t.Fatal(err)
	}
	a := outs[0]
	layers, k := e.Model.Config.Layers, e.Model.Config.MoE.TopK
	tokens := len(p) + len(a.OutputIDs) - 1
	if len(a.RoutedExperts) != tokens*layers*k {
		t.Fatalf("%d routed ids, want %d tokens x %d layers x %d", len(a.RoutedExperts), tokens, layers, k)
	}
	for tok := 0; tok < tokens; tok++ {
		for l := 0; l < layers; l++ {
			row := a.RoutedExperts[(tok*layers+l)*k : (tok*layers+l+1)*k]
			if l == 1 {
				if slices.ContainsFunc(row, func(v int32) bool { return v != -1 }) {
					t.Fatalf("token %d: dense layer 1 has experts %v", tok, row)
				}
				continue
			}
			sorted := slices.Clone(row)
			slices.Sort(sorted)
			if sorted[0] < 0 || int(sorted[k-1]) >= e.Model.Config.MoE.Experts || len(slices.Compact(sorted)) != k {
				t.Fatalf("token %d layer %d: experts %v", tok, l, row)
			}
		}
	}
	if outs[1].RoutedExperts != nil {
		t.Fatal("a request that did not ask got routed experts")
	}

	// The finished sequence as a prompt: found in the radix cache, its
	// routing comes from the slots that hold it.
	seq := append(slices.Clone(p), a.OutputIDs[:len(a.OutputIDs)-1]...)
	one := greedy
	one.MaxNewTokens = 1
	again := Request{Rid: "again", InputIDs: seq, Params: one, ReturnRoutedExperts: true}
	cached, err := generateOn(core, []Request{again})
	if err != nil {
		t.Fatal(err)
	}
	if cached[0].CachedTokens < len(p) {
		t.Fatalf("the sequence found %d cached tokens", cached[0].CachedTokens)
	}
	if !slices.Equal(cached[0].RoutedExperts, a.RoutedExperts) {
		t.Fatal("routing of a cached prefix differs from the routing computed when it was decoded")
	}
	// Prefilled afresh (no cache, one chunk): decode and prefill agree.
	fresh := open(engine.Config{EnableReturnRoutedExperts: true, DisableRadixCache: true})
	prefilled, err := Generate(fresh, []Request{again})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(prefilled[0].RoutedExperts, a.RoutedExperts) {
		t.Fatal("routing of a prefill differs from the routing of the same tokens decoded")
	}

	off := open(engine.Config{})
	if _, err := Generate(off, []Request{again}); err == nil || !strings.Contains(err.Error(), "--enable-return-routed-experts") {
		t.Fatalf("asking without the server flag: %v", err)
	}
	dense := tinymodel.TestDir(t, "qwen3", nil)
	if _, err := engine.Open(engine.Config{ModelDir: dense, Device: "cpu", MaxTotalTokens: 512, EnableReturnRoutedExperts: true}); err == nil ||
		!strings.Contains(err.Error(), "no experts") {
		t.Fatalf("the flag on a dense model: %v", err)
	}
}
