package tokenizermanager

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"ebb/ioschema"
)

func TestMergeReplies(t *testing.T) {
	ok := func(rank int, msg string) ioschema.Result {
		return ioschema.Result{Rid: "r", Success: true, Message: msg, DPRank: rank}
	}
	cases := []struct {
		name    string
		replies []ioschema.Message
		check   func(ioschema.Message) string
	}{
		{"one engine passes through", []ioschema.Message{&ioschema.FlushCacheReqOutput{Result: ok(0, "x")}},
			func(m ioschema.Message) string {
				if r := m.(*ioschema.FlushCacheReqOutput); r.Engines != nil || r.Message != "x" {
					return "changed"
				}
				return ""
			}},
		{"an engine's error fails the call", []ioschema.Message{&ioschema.FlushCacheReqOutput{Result: ok(1, "")},
			&ioschema.ErrorOutput{Rid: "r", Message: "bad tag"}},
			func(m ioschema.Message) string {
				if e, isErr := m.(*ioschema.ErrorOutput); !isErr || !strings.Contains(e.Message, "1 of 2") || !strings.Contains(e.Message, "bad tag") {
					return "not an error naming the failure"
				}
				return ""
			}},
		{"success needs every engine, messages by rank", []ioschema.Message{
			&ioschema.FlushCacheReqOutput{Result: ioschema.Result{Success: false, Message: "busy", DPRank: 1}},
			&ioschema.FlushCacheReqOutput{Result: ok(0, "done")}},
			func(m ioschema.Message) string {
				r := m.(*ioschema.FlushCacheReqOutput)
				if r.Success || r.Message != "dp 0: done; dp 1: busy" || len(r.Engines) != 2 || r.Engines[1]["message"] != "busy" {
					return "merged wrong: " + r.Message
				}
				return ""
			}},
		{"pause counts add up", []ioschema.Message{
			&ioschema.PauseGenerationReqOutput{Result: ok(0, "paused"), Aborted: 2},
			&ioschema.PauseGenerationReqOutput{Result: ok(1, "paused"), Aborted: 3, Retracted: 1}},
			func(m ioschema.Message) string {
				if r := m.(*ioschema.PauseGenerationReqOutput); r.Aborted != 5 || r.Retracted != 1 || r.Message != "paused" {
					return "counts not summed"
				}
				return ""
			}},
		{"server_info sums counts and lists engines", []ioschema.Message{
			&ioschema.GetServerInfoReqOutput{Result: ok(0, ""), Info: map[string]any{"num_running_reqs": int64(3), "generation_blocked": "", "vocab_size": 10}},
			&ioschema.GetServerInfoReqOutput{Result: ok(1, ""), Info: map[string]any{"num_running_reqs": uint8(4), "generation_blocked": "paused", "vocab_size": 10}}},
			func(m ioschema.Message) string {
				info := m.(*ioschema.GetServerInfoReqOutput).Info
				if info["num_running_reqs"] != 7.0 || info["vocab_size"] != 10 || info["generation_blocked"] != "dp 1: paused" ||
					info["dp_size"] != 2 || len(info["engines"].([]map[string]any)) != 2 {
					return "info merged wrong"
				}
				return ""
			}},
	}
	for _, c := range cases {
		if why := c.check(mergeReplies(c.replies)); why != "" {
			t.Errorf("%s: %s", c.name, why)
		}
	}
}

func TestRequestWork(t *testing.T) {
	for _, c := range []struct {
		in, out int
		want    int64
	}{
		{0, 0, 0},
		{10, 0, 10 * prefillPositions},
		{10, 3, 10*prefillPositions + 10 + 11 + 12},
		{1, -1, prefillPositions}, // a negative max_new_tokens is rejected elsewhere; it adds nothing here
	} {
		if got := RequestWork(c.in, c.out); got != c.want {
			t.Errorf("RequestWork(%d, %d) = %d, want %d", c.in, c.out, got, c.want)
		}
	}
}

// TestRoutingBalancesKVReads routes nano-vllm's workload (256 requests,
// prompts and outputs of 100 to 1,024 tokens, all at once) as dispatch
// does, to the engine with the least RequestWork, and checks that the two
// engines' decode KV reads come out within 1% of each other (counting
// prompt plus output tokens left them 8% apart).
func TestRoutingBalancesKVReads(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var work [2]int64
	var reads [2]float64
	for range 256 {
		in, out := 100+rng.IntN(925), 100+rng.IntN(925)
		e := LeastLoaded(work[:], func(w int64) int64 { return w })
		work[e] += RequestWork(in, out)
		reads[e] += float64(out)*float64(in) + float64(out)*float64(out-1)/2
	}
	if d := math.Abs(reads[0]-reads[1]) / (reads[0] + reads[1]) * 2; d > 0.01 {
		t.Fatalf("KV reads %.4g and %.4g positions: %.1f%% apart", reads[0], reads[1], 100*d)
	}
}
