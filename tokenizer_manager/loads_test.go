package tokenizermanager

import (
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestLoadOf: an engine's /v1/loads entry from its server_info figures.
func TestLoadOf(t *testing.T) {
	info := map[string]any{"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 900,
		"num_waiting_tokens": 250, "max_total_num_tokens": 10000, "token_usage": 0.09, "gen_throughput": 1234.5,
		"prompt_tokens": int64(400), "cached_prompt_tokens": int64(100), "max_running_requests": 64}
	l := loadOf(info, time.Unix(10, 0))
	want := engineLoad{DPRank: 1, Timestamp: 10, NumRunningReqs: 3, NumWaitingReqs: 2, NumTotalReqs: 5, NumUsedTokens: 900,
		NumTotalTokens: 1150, MaxTotalNumTokens: 10000, TokenUsage: 0.09, GenThroughput: 1234.5, CacheHitRate: 0.25,
		Utilization: 0.09, MaxRunningRequests: 64}
	if l != want {
		t.Fatalf("got %+v\nwant %+v", l, want)
	}
	if l := loadOf(map[string]any{}, time.Unix(0, 0)); l != (engineLoad{}) {
		t.Fatalf("no figures: %+v", l)
	}
}

// TestAggregateLoad: sums and means over engines, SGLang's rounding.
func TestAggregateLoad(t *testing.T) {
	loads := []engineLoad{
		{NumRunningReqs: 3, NumWaitingReqs: 1, NumUsedTokens: 100, NumTotalTokens: 150, TokenUsage: 0.1, GenThroughput: 10},
		{NumRunningReqs: 1, NumUsedTokens: 20, NumTotalTokens: 20, TokenUsage: 0.02, GenThroughput: 5.555},
	}
	got := aggregateLoad(loads)
	want := map[string]any{"total_running_reqs": 4, "total_waiting_reqs": 1, "total_reqs": 5, "total_used_tokens": 120,
		"total_tokens": 170, "avg_token_usage": 0.06, "avg_throughput": 7.78, "avg_utilization": 0.06}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %v, want %v", k, got[k], v)
		}
	}
	if got := aggregateLoad(nil); got["total_reqs"] != 0 || got["avg_token_usage"] != 0.0 {
		t.Errorf("no engines: %v", got)
	}
}

func TestParseLoadQuery(t *testing.T) {
	for _, c := range []struct {
		query      string
		dpRank     int
		prometheus bool
		err        string
	}{
		{"", -1, false, ""},
		{"?dp_rank=2&include=core,%20memory&format=json", 2, false, ""},
		{"?format=prometheus&include=all", -1, true, ""},
		{"?include=core,gpu", 0, false, `invalid include section "gpu"`},
		{"?dp_rank=x", 0, false, "not an integer"},
		{"?format=yaml", 0, false, "json or prometheus"},
	} {
		q, err := parseLoadQuery(httptest.NewRequest("GET", "/v1/loads"+c.query, nil))
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) || !IsBadRequest(err) {
				t.Errorf("%s: %v, want a bad request saying %q", c.query, err, c.err)
			}
			continue
		}
		if err != nil || q.dpRank != c.dpRank || q.prometheus != c.prometheus {
			t.Errorf("%s: %+v %v", c.query, q, err)
		}
	}
}

func TestLoadsPrometheus(t *testing.T) {
	text := loadsPrometheus([]engineLoad{{DPRank: 0, NumWaitingReqs: 2, TokenUsage: 0.5}, {DPRank: 1, NumWaitingReqs: 0}})
	for _, line := range []string{"# TYPE sglang_num_waiting_reqs gauge", `sglang_num_waiting_reqs{dp_rank="0"} 2`,
		`sglang_num_waiting_reqs{dp_rank="1"} 0`, `sglang_token_usage{dp_rank="0"} 0.5`} {
		if !strings.Contains(text, line+"\n") {
			t.Errorf("no line %q in\n%s", line, text)
		}
	}
}
