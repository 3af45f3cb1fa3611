package tokenizermanager

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"ebb/ioschema"
)

// metrics are exported on /metrics twice: under SGLang's names and types
// (sglang:..., labelled by model_name as SGLang's collectors are), so an
// existing SGLang Grafana dashboard works unchanged, and under ebb:.
type metrics struct {
	reg *prometheus.Registry
	// per request, observed as outputs arrive
	prompt, generation, cached *prometheus.CounterVec
	requests                   *prometheus.CounterVec
	ttft, itl, e2e             *prometheus.HistogramVec
	model                      string
	// ebb's own names of the same counts (kept for existing scrapers)
	ebbPrompt, ebbGeneration, ebbCached prometheus.Counter
}

var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 15, 20, 25, 30}
	itlBuckets  = []float64{0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8}
	e2eBuckets  = []float64{0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 150, 200, 250, 300, 350, 500, 1000}
)

func newMetrics(m *Manager) *metrics {
	mt := &metrics{reg: prometheus.NewRegistry(), model: m.modelName()}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, append([]string{"model_name"}, labels...))
	}
	histogram := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, []string{"model_name"})
	}
	mt.prompt = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
	mt.generation = counter("sglang:generation_tokens_total", "Number of generation tokens processed.")
	mt.cached = counter("sglang:cached_tokens_total", "Number of cached prompt tokens.")
	mt.requests = counter("sglang:num_requests_total", "Number of requests processed.", "finish_reason")
	mt.ttft = histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttftBuckets)
	mt.itl = histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itlBuckets)
	mt.e2e = histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", e2eBuckets)
	mt.ebbPrompt = prometheus.NewCounter(prometheus.CounterOpts{Name: "ebb:prompt_tokens_total", Help: "Prompt tokens processed."})
	mt.ebbGeneration = prometheus.NewCounter(prometheus.CounterOpts{Name: "ebb:generation_tokens_total", Help: "Tokens generated."})
	mt.ebbCached = prometheus.NewCounter(prometheus.CounterOpts{Name: "ebb:cached_tokens_total", Help: "Prompt tokens served from the prefix cache."})
	mt.reg.MustRegister(mt.prompt, mt.generation, mt.cached, mt.requests, mt.ttft, mt.itl, mt.e2e,
		mt.ebbPrompt, mt.ebbGeneration, mt.ebbCached, &schedulerCollector{m: m, model: mt.model})
	return mt
}

func (mt *metrics) firstToken(r *reqState) {
	mt.ttft.WithLabelValues(mt.model).Observe(time.Since(r.created).Seconds())
}

// tokens observes the inter-token latency of n tokens that arrived after gap.
func (mt *metrics) tokens(gap time.Duration, n int) {
	h := mt.itl.WithLabelValues(mt.model)
	for i := 0; i < n; i++ {
		h.Observe(gap.Seconds() / float64(n))
	}
}

func (mt *metrics) finished(r *reqState) {
	s := r.snapshot()
	mt.prompt.WithLabelValues(mt.model).Add(float64(s.PromptTokens))
	mt.generation.WithLabelValues(mt.model).Add(float64(s.Completion))
	mt.cached.WithLabelValues(mt.model).Add(float64(s.Cached))
	mt.ebbPrompt.Add(float64(s.PromptTokens))
	mt.ebbGeneration.Add(float64(s.Completion))
	mt.ebbCached.Add(float64(s.Cached))
	reason := "error"
	if s.Finish != nil {
		reason = s.Finish.Type
	}
	mt.requests.WithLabelValues(mt.model, reason).Inc()
	mt.e2e.WithLabelValues(mt.model).Observe(s.Latency.Seconds())
}

// schedulerCollector asks the scheduler for its gauges at scrape time.
type schedulerCollector struct {
	m     *Manager
	model string
}

// gauge is one scheduler figure under SGLang's name (nil sglang for none)
// and ebb's; counter marks the running totals.
type gauge struct {
	sglang, ebb, help string
	value             func(info map[string]any) (float64, bool)
	counter           bool
}

func infoField(name string) func(map[string]any) (float64, bool) {
	return func(info map[string]any) (float64, bool) { return toFloat(info[name]) }
}

var gauges = []gauge{
	{"sglang:num_running_reqs", "ebb:num_running_reqs", "The number of running requests.", infoField("num_running_reqs"), false},
	{"sglang:num_queue_reqs", "ebb:num_waiting_reqs", "The number of requests in the waiting queue.", infoField("num_waiting_reqs"), false},
	{"sglang:num_used_tokens", "ebb:kv_used_tokens", "The number of used tokens.", infoField("num_used_tokens"), false},
	{"sglang:token_usage", "", "The token usage.", func(info map[string]any) (float64, bool) {
		used, ok1 := toFloat(info["num_used_tokens"])
		total, ok2 := toFloat(info["max_total_num_tokens"])
		return used / max(total, 1), ok1 && ok2
	}, false},
	{"sglang:cache_hit_rate", "", "The prefix cache hit rate.", cacheHitRate, false},
	{"", "ebb:kv_cached_tokens", "KV slots in the prefix cache.", infoField("kv_cached_tokens"), false},
	{"", "ebb:kv_free_tokens", "Free KV slots.", infoField("kv_free_tokens"), false},
	{"", "ebb:max_total_num_tokens", "KV cache size in tokens.", infoField("max_total_num_tokens"), false},
	// The schedulers' last "Decode batch" rate, 0 once idle, summed over
	// engines: SGLang's last_gen_throughput.
	{"sglang:gen_throughput", "ebb:gen_throughput", "The generation throughput (token/s).", infoField("gen_throughput"), false},
	// KV pressure: requests retracted to make room and what they computed
	// again on return (what SGLang calls the retracted tokens, ebb finds
	// in its radix cache where it was not evicted meanwhile).
	{"sglang:num_retracted_requests_total", "ebb:retracted_requests_total", "Total number of retracted requests.", infoField("num_retracted_reqs"), true},
	{"sglang:num_retracted_input_tokens_total", "", "Total number of retracted input tokens.", infoField("retracted_input_tokens"), true},
	{"sglang:num_retracted_output_tokens_total", "", "Total number of retracted output tokens.", infoField("retracted_output_tokens"), true},
	{"", "ebb:recomputed_tokens_total", "Tokens computed again after a retraction (not found in the radix cache on return).", infoField("recomputed_tokens"), true},
	{"sglang:new_token_ratio", "ebb:new_token_ratio", "The new token ratio.", infoField("new_token_ratio"), false},
}

// cacheHitRate is the share of prompt tokens found in the prefix cache.
func cacheHitRate(info map[string]any) (float64, bool) {
	cached, ok1 := toFloat(info["cached_prompt_tokens"])
	prompt, ok2 := toFloat(info["prompt_tokens"])
	return cached / max(prompt, 1), ok1 && ok2
}

var sglangLabels = []string{"model_name", "engine_type", "tp_rank", "pp_rank"}

func (c *schedulerCollector) descs() []*prometheus.Desc {
	var out []*prometheus.Desc
	for _, g := range gauges {
		if g.sglang != "" {
			out = append(out, prometheus.NewDesc(g.sglang, g.help, sglangLabels, nil))
		}
		if g.ebb != "" {
			out = append(out, prometheus.NewDesc(g.ebb, g.help, nil, nil))
		}
	}
	return out
}

func (c *schedulerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs() {
		ch <- d
	}
}

func (c *schedulerCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	reply, err := c.m.Control(ctx, &ioschema.GetServerInfoReqInput{})
	info, ok := reply.(*ioschema.GetServerInfoReqOutput)
	if err != nil || !ok {
		return
	}
	labels := []string{c.model, "unified", "0", "0"}
	for _, g := range gauges {
		v, ok := g.value(info.Info)
		if !ok {
			continue
		}
		kind := prometheus.GaugeValue
		if g.counter {
			kind = prometheus.CounterValue
		}
		if g.sglang != "" {
			ch <- prometheus.MustNewConstMetric(prometheus.NewDesc(g.sglang, g.help, sglangLabels, nil), kind, v, labels...)
		}
		if g.ebb != "" {
			ch <- prometheus.MustNewConstMetric(prometheus.NewDesc(g.ebb, g.help, nil, nil), kind, v)
		}
	}
}

func toFloat(v any) (float64, bool) {
	switch x := v.(type) {
	case int:
		return float64(x), true
	case int8:
		return float64(x), true
	case int16:
		return float64(x), true
	case int32:
		return float64(x), true
	case int64:
		return float64(x), true
	case uint8:
		return float64(x), true
	case uint16:
		return float64(x), true
	case uint32:
		return float64(x), true
	case uint64:
		return float64(x), true
	case float64:
		return x, true
	case float32:
		return float64(x), true
	}
	return 0, false
}
