package tokenizermanager

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

// loadSections are /v1/loads' include values (SGLang's). ebb reports the
// core figures whatever is asked: it has no speculative decoding, LoRA or
// disaggregation, and its memory figures are /memory_stats'.
var loadSections = []string{"all", "core", "disagg", "lora", "memory", "queues", "spec"}

// engineLoad is one engine's entry of /v1/loads (SGLang's GetLoadsReqOutput,
// its core section).
type engineLoad struct {
	DPRank             int     `json:"dp_rank"`
	Timestamp          float64 `json:"timestamp"`
	NumRunningReqs     int     `json:"num_running_reqs"`
	NumWaitingReqs     int     `json:"num_waiting_reqs"`
	NumTotalReqs       int     `json:"num_total_reqs"`
	NumUsedTokens      int     `json:"num_used_tokens"`
	NumTotalTokens     int     `json:"num_total_tokens"` // used plus the waiting requests' prefill
	MaxTotalNumTokens  int     `json:"max_total_num_tokens"`
	TokenUsage         float64 `json:"token_usage"`
	GenThroughput      float64 `json:"gen_throughput"`
	CacheHitRate       float64 `json:"cache_hit_rate"`
	Utilization        float64 `json:"utilization"` // token_usage, as SGLang's gateway reads it
	MaxRunningRequests int     `json:"max_running_requests"`
}

// loadOf reads an engine's entry from its server_info.
func loadOf(info map[string]any, at time.Time) engineLoad {
	num := func(k string) float64 {
		v, _ := toFloat(info[k])
		return v
	}
	l := engineLoad{
		DPRank: int(num("dp_rank")), Timestamp: float64(at.UnixNano()) / 1e9,
		NumRunningReqs: int(num("num_running_reqs")), NumWaitingReqs: int(num("num_waiting_reqs")),
		NumUsedTokens: int(num("num_used_tokens")), MaxTotalNumTokens: int(num("max_total_num_tokens")),
		TokenUsage: num("token_usage"), GenThroughput: num("gen_throughput"),
		MaxRunningRequests: int(num("max_running_requests")),
	}
	l.NumTotalReqs = l.NumRunningReqs + l.NumWaitingReqs
	l.NumTotalTokens = l.NumUsedTokens + int(num("num_waiting_tokens"))
	l.CacheHitRate, _ = cacheHitRate(info)
	l.Utilization = l.TokenUsage
	return l
}

// engineLoads asks every engine (or the one dpRank names, where it is not
// negative) for its load, in rank order.
func (m *Manager) engineLoads(ctx context.Context, dpRank int) ([]engineLoad, error) {
	infos, err := m.engineInfos(ctx)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	var loads []engineLoad
	for _, in := range infos {
		if l := loadOf(in, now); dpRank < 0 || l.DPRank == dpRank {
			loads = append(loads, l)
		}
	}
	sort.Slice(loads, func(i, j int) bool { return loads[i].DPRank < loads[j].DPRank })
	return loads, nil
}

// loadQuery is /v1/loads' query: dp_rank (-1: every engine), include and
// format.
type loadQuery struct {
	dpRank     int
	prometheus bool
}

func parseLoadQuery(r *http.Request) (loadQuery, error) {
	q := loadQuery{dpRank: -1}
	v := r.URL.Query()
	if s := v.Get("dp_rank"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			return q, badf("dp_rank %q is not an integer", s)
		}
		q.dpRank = n
	}
	if s := v.Get("include"); s != "" {
		for _, part := range strings.Split(s, ",") {
			if part = strings.TrimSpace(part); !slices.Contains(loadSections, part) {
				return q, badf("invalid include section %q: valid options are %s", part, strings.Join(loadSections, ", "))
			}
		}
	}
	switch f := v.Get("format"); f {
	case "", "json":
	case "prometheus":
		q.prometheus = true
	default:
		return q, badf("format %q: json or prometheus", f)
	}
	return q, nil
}

// loads serves SGLang's /v1/loads: each engine's running and waiting
// requests and tokens, for a router or an RL driver waiting for idleness.
// A dp_rank the server does not run gives no entries, as SGLang's does.
func (m *Manager) loads(w http.ResponseWriter, r *http.Request) {
	q, err := parseLoadQuery(r)
	if err != nil {
		writeError(w, err)
		return
	}
	loads, err := m.engineLoads(r.Context(), q.dpRank)
	if err != nil {
		writeError(w, err)
		return
	}
	if q.prometheus {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_, _ = w.Write([]byte(loadsPrometheus(loads)))
		return
	}
	if loads == nil {
		loads = []engineLoad{}
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"timestamp": time.Now().UTC().Format(time.RFC3339Nano), "dp_rank_count": len(loads),
		"loads": loads, "aggregate": aggregateLoad(loads),
	})
}

// aggregateLoad is /v1/loads' aggregate: sums, and means over engines.
func aggregateLoad(loads []engineLoad) map[string]any {
	a := map[string]any{}
	var running, waiting, used, total int
	var usage, throughput float64
	for _, l := range loads {
		running, waiting, used, total = running+l.NumRunningReqs, waiting+l.NumWaitingReqs, used+l.NumUsedTokens, total+l.NumTotalTokens
		usage, throughput = usage+l.TokenUsage, throughput+l.GenThroughput
	}
	n := float64(max(len(loads), 1))
	round := func(x float64, places int) float64 {
		p := math.Pow(10, float64(places))
		return math.Round(x*p) / p
	}
	a["total_running_reqs"], a["total_waiting_reqs"], a["total_reqs"] = running, waiting, running+waiting
	a["total_used_tokens"], a["total_tokens"] = used, total
	a["avg_token_usage"], a["avg_throughput"], a["avg_utilization"] = round(usage/n, 4), round(throughput/n, 2), round(usage/n, 4)
	return a
}

// loadsPrometheus is /v1/loads?format=prometheus: a gauge per figure, a
// sample per engine.
func loadsPrometheus(loads []engineLoad) string {
	figures := []struct {
		name string
		v    func(engineLoad) float64
	}{
		{"num_running_reqs", func(l engineLoad) float64 { return float64(l.NumRunningReqs) }},
		{"num_waiting_reqs", func(l engineLoad) float64 { return float64(l.NumWaitingReqs) }},
		{"num_used_tokens", func(l engineLoad) float64 { return float64(l.NumUsedTokens) }},
		{"num_total_tokens", func(l engineLoad) float64 { return float64(l.NumTotalTokens) }},
		{"max_total_num_tokens", func(l engineLoad) float64 { return float64(l.MaxTotalNumTokens) }},
		{"token_usage", func(l engineLoad) float64 { return l.TokenUsage }},
		{"gen_throughput", func(l engineLoad) float64 { return l.GenThroughput }},
		{"cache_hit_rate", func(l engineLoad) float64 { return l.CacheHitRate }},
		{"utilization", func(l engineLoad) float64 { return l.Utilization }},
		{"max_running_requests", func(l engineLoad) float64 { return float64(l.MaxRunningRequests) }},
	}
	var b strings.Builder
	for _, f := range figures {
		fmt.Fprintf(&b, "# TYPE sglang_%s gauge\n", f.name)
		for _, l := range loads {
			fmt.Fprintf(&b, "sglang_%s{dp_rank=\"%d\"} %s\n", f.name, l.DPRank, strconv.FormatFloat(f.v(l), 'g', -1, 64))
		}
	}
	return b.String()
}

// getLoad serves SGLang's older /get_load, which sgl-model-gateway's load
// probes read: per engine, requests in all and waiting, and tokens in use
// plus those waiting to prefill.
func (m *Manager) getLoad(w http.ResponseWriter, r *http.Request) {
	loads, err := m.engineLoads(r.Context(), -1)
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]map[string]any, len(loads))
	for i, l := range loads {
		out[i] = map[string]any{"dp_rank": l.DPRank, "num_reqs": l.NumTotalReqs, "num_waiting_reqs": l.NumWaitingReqs,
			"num_tokens": l.NumTotalTokens, "num_pending_tokens": l.NumTotalTokens - l.NumUsedTokens, "ts_tic": l.Timestamp}
	}
	writeJSON(w, http.StatusOK, out)
}
