package scheduler

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"ebb/ioschema"
	"ebb/runner"
)

// TestTPMessageRoundTrip: what the leader sends its followers decodes to
// the same steps and control request, and a malformed step is an error.
func TestTPMessageRoundTrip(t *testing.T) {
	ctrl, err := ioschema.Encode(&ioschema.ReleaseMemoryOccupationReqInput{Tags: []string{"kv_cache"}})
	if err != nil {
		t.Fatal(err)
	}
	steps := []runner.SeqStep{{Tokens: []int32{1, 2}, Start: 3, Slots: []int32{0, 1, 2, 3, 4}, Sample: true, Draw: 7,
		Params:     runner.SampleParams{Temperature: 0.7, TopP: 0.9, TopK: 20, Seed: 42, TopLogprobs: 2},
		Adjust:     []runner.LogitAdjust{{Token: 5, Count: 2, Bias: -1}},
		NextTokens: []int32{-1, 9}}, {Tokens: []int32{0}, Start: 0, Slots: []int32{5, -7, 1 << 30}, Sample: true, Follows: 1}}
	for _, m := range []tpMessage{
		{Seqs: toWire(steps)},
		{Control: ctrl},
		{CollectiveID: make([]byte, 128)},
	} {
		b, err := msgpack.Marshal(&m)
		if err != nil {
			t.Fatal(err)
		}
		var got tpMessage
		if err := msgpack.Unmarshal(b, &got); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Fatalf("round trip: %+v\nwant %+v", got, m)
		}
		if m.Seqs != nil {
			back, err := fromWire(got.Seqs)
			if err != nil || !reflect.DeepEqual(back, steps) {
				t.Fatalf("steps: %+v, %v\nwant %+v", back, err, steps)
			}
		}
	}
	if _, err := ioschema.Decode(ctrl); err != nil {
		t.Fatal(err)
	}
	if _, err := fromWire([]wireStep{{Slots: []byte{1, 2, 3}}}); err == nil {
		t.Fatal("a slot list of 3 bytes was accepted")
	}
}

// TestMergeRankReplies: the leader's reply fails when any rank's did, and
// lists every rank's own reply.
func TestMergeRankReplies(t *testing.T) {
	ok := &ioschema.FlushCacheReqOutput{Result: ioschema.Result{Success: true, Message: "ok"}}
	lead := func() *ioschema.FlushCacheReqOutput {
		return &ioschema.FlushCacheReqOutput{Result: ioschema.Result{Success: true, Message: "cache flushed"}}
	}
	r := mergeRankReplies(lead(), []ioschema.Message{ok, ok}, nil).(*ioschema.FlushCacheReqOutput)
	if !r.Success || r.Message != "cache flushed" || len(r.TPRanks) != 2 || r.TPRanks[1]["tp_rank"] != 2 {
		t.Fatalf("all ranks succeeded: %+v", r.Result)
	}
	bad := &ioschema.ErrorOutput{Message: "no such tag"}
	r = mergeRankReplies(lead(), []ioschema.Message{ok, bad}, nil).(*ioschema.FlushCacheReqOutput)
	if r.Success || r.Message != "cache flushed; tp rank 2: no such tag" {
		t.Fatalf("rank 2 failed: %+v", r.Result)
	}
	r = mergeRankReplies(lead(), nil, errors.New("a tensor-parallel rank did not answer")).(*ioschema.FlushCacheReqOutput)
	if r.Success || !strings.Contains(r.Message, "did not answer") {
		t.Fatalf("no answer: %+v", r.Result)
	}
}
