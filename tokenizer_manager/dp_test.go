package tokenizermanager

import (
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
