package tokenizermanager

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"ebb/ioschema"
)

// metrics are exported on /metrics under the ebb: prefix (SGLang's names
// use sglang:).
type metrics struct {
	reg        *prometheus.Registry
	prompt     prometheus.Counter
	generation prometheus.Counter
	cached     prometheus.Counter
	requests   *prometheus.CounterVec
	ttft       prometheus.Histogram
	e2e        prometheus.Histogram
}

func newMetrics(m *Manager) *metrics {
	mt := &metrics{reg: prometheus.NewRegistry()}
	mt.prompt = prometheus.NewCounter(prometheus.CounterOpts{Name: "ebb:prompt_tokens_total", Help: "Prompt tokens processed."})
	mt.generation = prometheus.NewCounter(prometheus.CounterOpts{Name: "ebb:generation_tokens_total", Help: "Tokens generated."})
	mt.cached = prometheus.NewCounter(prometheus.CounterOpts{Name: "ebb:cached_tokens_total", Help: "Prompt tokens served from the prefix cache."})
	mt.requests = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ebb:num_requests_total", Help: "Finished requests by finish reason."}, []string{"finish_reason"})
	buckets := []float64{0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60}
	mt.ttft = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ebb:time_to_first_token_seconds", Help: "Time to first token.", Buckets: buckets})
	mt.e2e = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ebb:e2e_request_latency_seconds", Help: "End-to-end request latency.", Buckets: buckets})
	mt.reg.MustRegister(mt.prompt, mt.generation, mt.cached, mt.requests, mt.ttft, mt.e2e, &schedulerCollector{m: m})
	return mt
}

func (mt *metrics) firstToken(r *reqState) { mt.ttft.Observe(time.Since(r.created).Seconds()) }

func (mt *metrics) finished(r *reqState) {
	s := r.snapshot()
	mt.prompt.Add(float64(s.PromptTokens))
	mt.generation.Add(float64(s.Completion))
	mt.cached.Add(float64(s.Cached))
	reason := "error"
	if s.Finish != nil {
		reason = s.Finish.Type
	}
	mt.requests.WithLabelValues(reason).Inc()
	mt.e2e.Observe(s.Latency.Seconds())
}

// schedulerCollector asks the scheduler for its gauges at scrape time.
type schedulerCollector struct{ m *Manager }

var gauges = map[string]string{
	"num_running_reqs": "Requests running.", "num_waiting_reqs": "Requests queued.",
	"kv_used_tokens": "KV slots held by running requests.", "kv_cached_tokens": "KV slots in the prefix cache.",
	"kv_free_tokens": "Free KV slots.", "max_total_num_tokens": "KV cache size in tokens.",
}

func (c *schedulerCollector) Describe(ch chan<- *prometheus.Desc) {
	for name, help := range gauges {
		ch <- prometheus.NewDesc("ebb:"+name, help, nil, nil)
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
	for name, help := range gauges {
		if v, ok := toFloat(info.Info[name]); ok {
			ch <- prometheus.MustNewConstMetric(prometheus.NewDesc("ebb:"+name, help, nil, nil), prometheus.GaugeValue, v)
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
