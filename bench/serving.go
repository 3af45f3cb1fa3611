package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"ebb/cuda"
	"ebb/engine"
	"ebb/model"
	"ebb/tokenizer_manager"
)

// ServingConfig is `ebb bench serving`: a workload sent to a server's
// /generate (SGLang's native API, so the same run measures SGLang or ebb),
// either at URL or an `ebb serve` the benchmark starts on Engine's model.
type ServingConfig struct {
	URL         string
	Engine      engine.Config
	Executable  string // ebb binary to start; default this one
	Workload    Workload
	RequestRate float64 // requests/s, Poisson; 0 or +Inf sends all at once
	MaxInFlight int     // 0: no limit
	Temperature float64
	// TopK, TopP and MinP are sent where set; unset, the server applies
	// the model's generation_config defaults (Qwen3: top_k 20, top_p 0.95).
	TopK *int
	TopP *float64
	MinP *float64
	// StopAtEOS lets requests stop at EOS (ignore_eos false), so that a
	// scheduler cannot count on their lengths; by default every request
	// runs to its output length.
	StopAtEOS bool
	// Duration, when set, keeps sending: a new draw of the workload each
	// round, as many requests in flight as MaxInFlight (or the workload's
	// size), until it has passed; then the last ones finish (a soak).
	Duration time.Duration
	// Check fails the run (Serving's error) on any failed request and,
	// once the server is idle again, on KV still held, a broken invariant,
	// or GPU memory or regions grown since before the run.
	Check  bool
	Stream bool
	APIKey string
	// FlushCache empties the server's radix cache before the run (SGLang's
	// --flush-cache), so that a workload sent before finds none of its
	// prompts cached.
	FlushCache bool
	// ModelDir gives the model's shapes for the bandwidth floor when the
	// server is at URL (default: the server's /get_model_info model_path).
	ModelDir string
	// PeakGBPerS overrides the GPU's peak bandwidth read through NVML
	// (GPU ordinal PeakGPU).
	PeakGBPerS float64
	PeakGPU    int
	PlotPath   string
	Progress   io.Writer
	// Chaos sends RL control requests while the workload runs (--chaos).
	Chaos ChaosConfig
}

// Percentiles are p50/p90/p99 and the mean, in milliseconds.
type Percentiles struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
}

// ServingReport is the run's figures.
type ServingReport struct {
	Server      string   `json:"server"`
	Workload    Workload `json:"workload"`
	RequestRate float64  `json:"request_rate"` // 0: all at once
	Temperature float64  `json:"temperature"`
	Stream      bool     `json:"stream"`
	Completed   int      `json:"completed"`
	Failed      int      `json:"failed"`
	// Aborted are the completions a chaos run's pauses of mode abort
	// ended early (elsewhere an abort is a failure).
	Aborted    int    `json:"aborted,omitempty"`
	FirstError string `json:"first_error,omitempty"`
	Samples    int    `json:"samples"` // completions asked for: requests times n
	// Retracted and Recomputed are what the server reported during the
	// run (server_info's num_retracted_reqs and recomputed_tokens).
	Retracted  int64 `json:"retracted_requests"`
	Recomputed int64 `json:"recomputed_tokens"`
	// Checks are the --check findings, "ok" or what failed.
	Checks           []string     `json:"checks,omitempty"`
	Chaos            *ChaosReport `json:"chaos,omitempty"`
	DurationS        float64      `json:"duration_s"`
	InputTokens      int          `json:"input_tokens"`
	CachedTokens     int          `json:"cached_input_tokens"` // prompt tokens the server found in its radix cache
	OutputTokens     int          `json:"output_tokens"`
	RequestPerS      float64      `json:"requests_per_s"`
	OutputTokPerS    float64      `json:"output_tokens_per_s"`
	TotalTokPerS     float64      `json:"total_tokens_per_s"`
	TTFTMs           Percentiles  `json:"ttft_ms"` // streaming only
	ITLMs            Percentiles  `json:"itl_ms"`  // streaming only: gap between chunks per token
	E2EMs            Percentiles  `json:"e2e_ms"`
	KVReadBytes      float64      `json:"kv_read_bytes"`                // the workload's least KV traffic
	WeightReadBytes  float64      `json:"weight_read_bytes"`            // weights once per decode step of each engine's longest output, over all engines
	GPUs             int          `json:"gpus"`                         // tensor- times data-parallel size
	PeakGBPerS       float64      `json:"peak_gb_per_s"`                // per GPU
	FloorTokPerS     float64      `json:"bandwidth_floor_tokens_per_s"` // output tokens/s if reads ran at peak
	FractionOfFloor  float64      `json:"fraction_of_floor"`
	ThroughputSeries []XY         `json:"throughput_series"` // output tok/s in time bins
}

// XY is one point of a series.
type XY struct {
	X float64 `json:"x"`
	Y float64 `json:"y"`
}

// requestResult is one request's timings, relative to the run's start.
type requestResult struct {
	Input, Output int
	Want          int     // the output it must produce (it runs to its length), or 0
	Cached        int     // prompt tokens found cached
	Sent, First   float64 // seconds; First < 0 when unknown (no stream)
	Done          float64
	Chunks        []chunk
	Finish        finishReason
	Err           error
}

// finishReason is meta_info.finish_reason: SGLang's type (stop, length,
// abort) and, for an abort, why.
type finishReason struct {
	Type    string `json:"type"`
	Message string `json:"message"`
}

// problem says what is wrong with a request that got a reply: the server
// aborted it (unless aborts are expected: a chaos run pausing with mode
// abort), or it stopped short of the length it had to run to. Either is
// a failure a 200 would otherwise hide: a step that fails aborts its
// batch and answers each request with finish_reason abort.
func (r requestResult) problem(abortsExpected bool) string {
	switch {
	case r.Finish.Type == "abort" && !abortsExpected:
		return "aborted by the server: " + r.Finish.Message
	case r.Finish.Type != "abort" && r.Want > 0 && r.Output != r.Want:
		return fmt.Sprintf("%d of %d output tokens (finish_reason %q)", r.Output, r.Want, r.Finish.Type)
	}
	return ""
}

type chunk struct {
	At     float64
	Tokens int // new tokens in this chunk
}

// Serving runs the workload and reports.
func Serving(cfg ServingConfig) (*ServingReport, error) {
	url := strings.TrimRight(cfg.URL, "/")
	modelDir := cfg.ModelDir
	if url == "" {
		if cfg.Executable == "" {
			exe, err := os.Executable()
			if err != nil {
				return nil, err
			}
			cfg.Executable = exe
		}
		srv, err := startServe(cfg.Executable, cfg.Engine)
		if err != nil {
			return nil, err
		}
		defer srv.stop()
		url = srv.url
		if modelDir == "" {
			modelDir = cfg.Engine.ModelDir
		}
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4096, MaxConnsPerHost: 0}}
	if modelDir == "" {
		modelDir = serverModelPath(client, url, cfg.APIKey)
	}
	var mc *model.Config
	if modelDir != "" {
		if c, err := model.LoadConfig(modelDir); err == nil {
			mc = c
		} else if cfg.ModelDir != "" {
			return nil, err
		}
	}
	vocab := 32000
	if mc != nil {
		vocab = mc.Vocab - min(512, mc.Vocab/8) // clear of special tokens at the top
	}
	reqs, err := cfg.Workload.Requests(vocab)
	if err != nil {
		return nil, err
	}
	if cfg.FlushCache {
		if err := postJSON(client, url+"/flush_cache", cfg.APIKey); err != nil {
			return nil, fmt.Errorf("flush the server's cache: %w", err)
		}
	}
	before := readServerState(client, url, cfg.APIKey)
	var chaos *chaosRun
	if cfg.Chaos.on() {
		chaos = startChaos(client, url, cfg.APIKey, cfg.Chaos)
	}
	var results []requestResult
	if cfg.Duration > 0 {
		results, reqs, err = soak(client, url, cfg, vocab, reqs)
	} else {
		results = sendAll(client, url, cfg, reqs)
	}
	var chaosRep *ChaosReport
	if chaos != nil {
		chaosRep = chaos.stop()
	}
	if err != nil {
		return nil, err
	}
	rep := summarizeServing(cfg, url, results)
	rep.Chaos = chaosRep
	rep.Samples = samples(reqs)
	after := readServerState(client, url, cfg.APIKey)
	rep.Retracted, rep.Recomputed = after.Retracted-before.Retracted, after.Recomputed-before.Recomputed
	if mc != nil {
		peak := cfg.PeakGBPerS * 1e9
		if peak == 0 {
			if p, err := cuda.PeakBandwidthOf(cfg.PeakGPU); err == nil {
				peak = p
			}
		}
		tp, dp := cfg.Engine.TPSize, cfg.Engine.DPSize
		if cfg.URL != "" {
			tp, dp = serverParallelism(client, url, cfg.APIKey)
		}
		rep.bandwidthFloor(mc, reqs, peak, tp, dp)
	}
	if cfg.PlotPath != "" {
		if err := plotServing(rep, results, cfg.PlotPath); err != nil {
			return rep, fmt.Errorf("plot: %w", err)
		}
	}
	if cfg.Check {
		rep.Checks = checkAfterRun(client, url, cfg.APIKey, rep, before)
		for _, c := range rep.Checks {
			if c != "ok" {
				return rep, fmt.Errorf("check failed: %s", strings.Join(rep.Checks, "; "))
			}
		}
	}
	return rep, nil
}

func serverModelPath(client *http.Client, url, key string) string {
	var info struct {
		ModelPath string `json:"model_path"`
	}
	if getJSON(client, url+"/get_model_info", key, &info) != nil {
		return ""
	}
	if _, err := os.Stat(filepath.Join(info.ModelPath, "config.json")); err != nil {
		return ""
	}
	return info.ModelPath
}

// serverParallelism is the tensor- and data-parallel sizes a server at url
// reports in /get_server_info (SGLang's and ebb's tp_size and dp_size), 1
// for what it does not say.
func serverParallelism(client *http.Client, url, key string) (tp, dp int) {
	var info struct {
		TP int `json:"tp_size"`
		DP int `json:"dp_size"`
	}
	if getJSON(client, url+"/get_server_info", key, &info) != nil {
		return 1, 1
	}
	return max(info.TP, 1), max(info.DP, 1)
}

// getJSON decodes the JSON body of a GET of url into v.
func getJSON(client *http.Client, url, key string, v any) error {
	return callJSON(client, "GET", url, key, v)
}

// postJSON POSTs an empty JSON object to url and wants a 200.
func postJSON(client *http.Client, url, key string) error {
	return callJSON(client, "POST", url, key, nil)
}

// callJSON makes a request without parameters and decodes the JSON of a
// 200 reply into v, where v is not nil.
func callJSON(client *http.Client, method, url, key string, v any) error {
	var body any
	if method == "POST" {
		body = map[string]any{}
	}
	status, reply, err := doJSON(context.Background(), client, method, url, key, body)
	if err != nil {
		return err
	}
	if status != http.StatusOK {
		return fmt.Errorf("%s %s: %d %s: %s", method, url, status, http.StatusText(status), strings.TrimSpace(string(reply)))
	}
	if v == nil {
		return nil
	}
	return json.Unmarshal(reply, v)
}

// doJSON makes one request, with body as its JSON where body is not nil
// and the bearer key where one is given, and returns the status and the
// reply's body.
func doJSON(ctx context.Context, client *http.Client, method, url, key string, body any) (int, []byte, error) {
	var in io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, nil, err
		}
		in = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, in)
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	reply, err := io.ReadAll(resp.Body)
	return resp.StatusCode, reply, err
}

// sendAll sends every request at its arrival time and waits for all.
func sendAll(client *http.Client, url string, cfg ServingConfig, reqs []workRequest) []requestResult {
	at := arrivals(len(reqs), cfg.RequestRate, cfg.Workload.Seed)
	results := make([]requestResult, 0, samples(reqs))
	bar := newProgress(cfg.Progress, len(reqs), "requests")
	var mu sync.Mutex
	var slots chan struct{}
	if cfg.MaxInFlight > 0 {
		slots = make(chan struct{}, cfg.MaxInFlight)
	}
	start := time.Now()
	var wg sync.WaitGroup
	for i, r := range reqs {
		if d := time.Until(start.Add(time.Duration(at[i] * float64(time.Second)))); d > 0 {
			time.Sleep(d)
		}
		if slots != nil {
			slots <- struct{}{}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			res := sendOne(client, url, cfg, r, start)
			if slots != nil {
				<-slots
			}
			mu.Lock()
			results = append(results, res...)
			bar.Add(1)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return results
}

// soak sends draws of the workload (its seed advanced each round) with as
// many requests in flight as MaxInFlight, or the workload's size, until
// Duration has passed, and waits for the last ones. It returns the results
// and every request sent.
func soak(client *http.Client, url string, cfg ServingConfig, vocab int, first []workRequest) ([]requestResult, []workRequest, error) {
	inFlight := cfg.MaxInFlight
	if inFlight <= 0 {
		inFlight = len(first)
	}
	slots := make(chan struct{}, inFlight)
	var mu sync.Mutex
	var results []requestResult
	var sent []workRequest
	bar := newProgress(cfg.Progress, int(cfg.Duration.Seconds()), "seconds")
	shown := 0
	start := time.Now()
	var wg sync.WaitGroup
	round, reqs := 0, first
	for time.Since(start) < cfg.Duration {
		for _, r := range reqs {
			slots <- struct{}{}
			if time.Since(start) >= cfg.Duration {
				<-slots
				break
			}
			sent = append(sent, r)
			wg.Add(1)
			go func() {
				defer wg.Done()
				res := sendOne(client, url, cfg, r, start)
				<-slots
				mu.Lock()
				results = append(results, res...)
				if now := min(int(time.Since(start).Seconds()), int(cfg.Duration.Seconds())); now > shown {
					bar.Add(now - shown)
					shown = now
				}
				mu.Unlock()
			}()
		}
		round++
		w := cfg.Workload
		w.Seed += uint64(round)
		var err error
		if reqs, err = w.Requests(vocab); err != nil {
			return nil, nil, err
		}
	}
	wg.Wait()
	return results, sent, nil
}

// sendOne posts one /generate and times it; streams are read chunk by
// chunk, each carrying the output so far (SGLang's format, with "index"
// where the request asks for n > 1 samples). It returns a result for each
// sample.
func sendOne(client *http.Client, url string, cfg ServingConfig, r workRequest, start time.Time) []requestResult {
	since := func() float64 { return time.Since(start).Seconds() }
	n := max(r.N, 1)
	res := make([]requestResult, n)
	want := 0
	if !cfg.StopAtEOS {
		want = r.OutputLen
	}
	for i := range res {
		res[i] = requestResult{Input: len(r.Prompt), Want: want, Sent: since(), First: -1}
	}
	fail := func(err error) []requestResult {
		for i := range res {
			if res[i].Err == nil {
				res[i].Err = err
			}
		}
		return res
	}
	body, _ := json.Marshal(map[string]any{"input_ids": r.Prompt, "stream": cfg.Stream, "sampling_params": cfg.samplingParams(r)})
	req, err := http.NewRequestWithContext(context.Background(), "POST", url+"/generate", bytes.NewReader(body))
	if err != nil {
		return fail(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+cfg.APIKey)
	}
	resp, err := client.Do(req)
	if err != nil {
		return fail(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fail(fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(b))))
	}
	type reply struct {
		Index    int `json:"index"`
		MetaInfo struct {
			CompletionTokens int           `json:"completion_tokens"`
			CachedTokens     int           `json:"cached_tokens"`
			FinishReason     *finishReason `json:"finish_reason"`
		} `json:"meta_info"`
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if !cfg.Stream {
		var outs []reply
		if n == 1 {
			outs = make([]reply, 1)
			err = json.NewDecoder(resp.Body).Decode(&outs[0])
		} else {
			err = json.NewDecoder(resp.Body).Decode(&outs)
		}
		if err == nil && len(outs) != n {
			err = fmt.Errorf("%d outputs for n = %d", len(outs), n)
		}
		if err != nil {
			return fail(err)
		}
		for i, out := range outs {
			res[i].Output, res[i].Cached, res[i].Done = out.MetaInfo.CompletionTokens, out.MetaInfo.CachedTokens, since()
			if out.MetaInfo.FinishReason != nil {
				res[i].Finish = *out.MetaInfo.FinishReason
			}
		}
		return res
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if !bytes.HasPrefix(line, []byte("data:")) {
			continue
		}
		line = bytes.TrimSpace(line[5:])
		if bytes.Equal(line, []byte("[DONE]")) {
			break
		}
		var out reply
		if err := json.Unmarshal(line, &out); err != nil {
			return fail(fmt.Errorf("stream chunk: %w", err))
		}
		if out.Index < 0 || out.Index >= n {
			return fail(fmt.Errorf("stream chunk for sample %d of %d", out.Index, n))
		}
		if out.Error != nil {
			return fail(fmt.Errorf("server: %s", out.Error.Message))
		}
		now, one := since(), &res[out.Index]
		one.Cached = out.MetaInfo.CachedTokens
		if out.MetaInfo.FinishReason != nil {
			one.Finish = *out.MetaInfo.FinishReason
		}
		if k := out.MetaInfo.CompletionTokens - one.Output; k > 0 {
			if one.First < 0 {
				one.First = now
			}
			one.Chunks = append(one.Chunks, chunk{At: now, Tokens: k})
			one.Output = out.MetaInfo.CompletionTokens
		}
		one.Done = now
	}
	if err := sc.Err(); err != nil {
		return fail(err)
	}
	for i := range res {
		if res[i].Done == 0 {
			res[i].Done = since()
		}
	}
	return res
}

// samplingParams is what a request of r sends: its length, the
// temperature, and the filters given (others are left to the model's
// defaults).
func (cfg ServingConfig) samplingParams(r workRequest) map[string]any {
	sp := map[string]any{"max_new_tokens": r.OutputLen, "temperature": cfg.Temperature, "ignore_eos": !cfg.StopAtEOS}
	if r.N > 1 {
		sp["n"] = r.N
	}
	if cfg.TopK != nil {
		sp["top_k"] = *cfg.TopK
	}
	if cfg.TopP != nil {
		sp["top_p"] = *cfg.TopP
	}
	if cfg.MinP != nil {
		sp["min_p"] = *cfg.MinP
	}
	return sp
}

func summarizeServing(cfg ServingConfig, url string, results []requestResult) *ServingReport {
	rep := &ServingReport{Server: url, Workload: cfg.Workload, Temperature: cfg.Temperature, Stream: cfg.Stream}
	if !math.IsInf(cfg.RequestRate, 1) {
		rep.RequestRate = cfg.RequestRate
	}
	var ttft, itl, e2e []float64
	first, last := math.Inf(1), 0.0
	for _, r := range results {
		why := r.problem(cfg.abortsExpected())
		if r.Err != nil {
			why = r.Err.Error()
		}
		if why != "" {
			rep.Failed++
			if rep.FirstError == "" {
				rep.FirstError = why
			}
			continue
		}
		if r.Finish.Type == "abort" {
			rep.Aborted++
		}
		rep.Completed++
		rep.InputTokens += r.Input
		rep.CachedTokens += r.Cached
		rep.OutputTokens += r.Output
		first, last = min(first, r.Sent), max(last, r.Done)
		e2e = append(e2e, 1000*(r.Done-r.Sent))
		if r.First >= 0 {
			ttft = append(ttft, 1000*(r.First-r.Sent))
			for j := 1; j < len(r.Chunks); j++ {
				gap := 1000 * (r.Chunks[j].At - r.Chunks[j-1].At) / float64(r.Chunks[j].Tokens)
				for range r.Chunks[j].Tokens {
					itl = append(itl, gap)
				}
			}
		}
	}
	if rep.Completed == 0 {
		return rep
	}
	rep.DurationS = last - first
	rep.RequestPerS = float64(rep.Completed) / rep.DurationS
	rep.OutputTokPerS = float64(rep.OutputTokens) / rep.DurationS
	rep.TotalTokPerS = float64(rep.InputTokens+rep.OutputTokens) / rep.DurationS
	rep.TTFTMs, rep.ITLMs, rep.E2EMs = percentiles(ttft), percentiles(itl), percentiles(e2e)
	rep.ThroughputSeries = throughputSeries(results, rep.DurationS)
	return rep
}

func percentiles(v []float64) Percentiles {
	if len(v) == 0 {
		return Percentiles{}
	}
	sort.Float64s(v)
	at := func(q float64) float64 { return v[min(int(q*float64(len(v))), len(v)-1)] }
	sum := 0.0
	for _, x := range v {
		sum += x
	}
	return Percentiles{Mean: sum / float64(len(v)), P50: at(0.5), P90: at(0.9), P99: at(0.99)}
}

// throughputSeries bins output tokens by the time they arrived (streams)
// or by their request's end (no stream), into about 50 bins.
func throughputSeries(results []requestResult, duration float64) []XY {
	bin := max(duration/50, 0.05)
	n := int(duration/bin) + 1
	tokens := make([]float64, n)
	for _, r := range results {
		if r.Err != nil {
			continue
		}
		if len(r.Chunks) == 0 {
			tokens[min(int(r.Done/bin), n-1)] += float64(r.Output)
		}
		for _, c := range r.Chunks {
			tokens[min(int(c.At/bin), n-1)] += float64(c.Tokens)
		}
	}
	out := make([]XY, n)
	for i, t := range tokens {
		out[i] = XY{X: (float64(i) + 0.5) * bin, Y: t / bin}
	}
	return out
}

// bandwidthFloor is the throughput if the workload's unavoidable reads ran
// at the GPUs' peak: every output token's step reads the KV of its prompt
// and of the tokens before it, and each decode step reads the weights once
// (as many steps as the longest output, with every request in one batch;
// a mixture-of-experts step reads the experts its batch's tokens pick,
// more of them the more requests are still running).
// Under data parallelism the requests go to engines as ebb's router sends
// them (the least unfinished tokenizermanager.RequestWork, in order) and
// the floor is the slowest engine's; tensor parallelism splits an engine's
// weights and KV heads over its GPUs (a KV head is replicated where there
// are fewer heads than GPUs).
func (rep *ServingReport) bandwidthFloor(mc *model.Config, reqs []workRequest, peak float64, tp, dp int) {
	tp, dp = max(tp, 1), max(dp, 1)
	kvPerToken := float64(2 * mc.Layers * mc.KVHeads * mc.HeadDim * 2)
	type engineLoad struct {
		work    int64
		steps   int
		kv      float64
		outputs []int // each sequence's output length
	}
	engines := make([]engineLoad, dp)
	total := 0
	for _, r := range reqs {
		e := tokenizermanager.LeastLoaded(engines, func(l engineLoad) int64 { return l.work })
		in, out, n := float64(len(r.Prompt)), float64(r.OutputLen), max(r.N, 1)
		engines[e].work += int64(n) * tokenizermanager.RequestWork(len(r.Prompt), r.OutputLen)
		engines[e].kv += float64(n) * (in*out + out*(out-1)/2) * kvPerToken
		engines[e].steps = max(engines[e].steps, r.OutputLen)
		for range n {
			engines[e].outputs = append(engines[e].outputs, r.OutputLen)
		}
		total += n * r.OutputLen
	}
	// What one GPU of an engine reads of its KV and of its weights.
	kvShare := float64(max(mc.KVHeads/tp, 1)) / float64(mc.KVHeads)
	slowest := 0.0
	rep.KVReadBytes, rep.WeightReadBytes, rep.GPUs = 0, 0, tp*dp
	for _, e := range engines {
		weights := stepWeightBytes(mc, e.outputs)
		rep.KVReadBytes += e.kv
		rep.WeightReadBytes += weights
		slowest = max(slowest, e.kv*kvShare+weights/float64(tp))
	}
	if peak <= 0 || slowest == 0 {
		return
	}
	rep.PeakGBPerS = peak / 1e9
	rep.FloorTokPerS = float64(total) / (slowest / peak)
	if rep.OutputTokPerS > 0 {
		rep.FractionOfFloor = rep.OutputTokPerS / rep.FloorTokPerS
	}
}

// stepWeightBytes is what the decode steps of sequences with these output
// lengths, all in one batch, read of the weights: step s runs those with
// more than s tokens to go.
func stepWeightBytes(mc *model.Config, outputs []int) float64 {
	sorted := slices.Clone(outputs)
	slices.Sort(sorted)
	total, done := 0.0, 0
	for s := 0; len(sorted) > 0 && s < sorted[len(sorted)-1]; s++ {
		for done < len(sorted) && sorted[done] <= s {
			done++
		}
		total += float64(mc.DecodeWeightBytesAt(len(sorted) - done))
	}
	return total
}
