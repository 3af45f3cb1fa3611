package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// ChaosConfig is `bench serving --chaos`: the RL control requests a
// trainer sends (pause and continue, release and resume, flush, a health
// probe) sent to the server while the workload runs, each checked. It
// finds what no steady workload does: a step taken on memory just
// released, a request lost in a pause, a probe queued behind rollouts.
type ChaosConfig struct {
	Interval time.Duration // mean gap between actions; 0: no chaos
	// PauseModes are the pause_generation modes it uses. Requests a pause
	// of mode abort ends count as aborted, not failed; without it any
	// abort is a failure.
	PauseModes []string
	Seed       uint64
}

// ChaosReport is what the chaos sent and what went wrong.
type ChaosReport struct {
	Actions    map[string]int `json:"actions"`
	Failed     int            `json:"failed"`
	FirstError string         `json:"first_error,omitempty"`
}

func (c ChaosConfig) on() bool { return c.Interval > 0 }

// abortsExpected reports whether the run's own pauses abort requests.
func (cfg ServingConfig) abortsExpected() bool {
	return cfg.Chaos.on() && slices.Contains(cfg.Chaos.PauseModes, "abort")
}

// chaosRun is the goroutine that sends the actions, one at a time, each
// carried to its end (a pause continued, a release resumed) before the
// run may stop, so that the server is left serving.
type chaosRun struct {
	client *http.Client
	url    string
	key    string
	cfg    ChaosConfig
	rng    *rand.Rand
	tags   [][]string // the tag sets it releases and resumes
	// modelPath is the checkpoint the server loaded ("" where its weights
	// are dummy): updates from disk write the same weights again.
	modelPath string
	updates   int // updates sent, for their weight versions
	rep       ChaosReport
	cancel    context.CancelFunc
	done      sync.WaitGroup
}

// startChaos begins sending actions to the server at url. Weights are
// released only where the server keeps a CPU backup (ebb's cpu_backup,
// SGLang's enable_weights_cpu_backup): without one they come back stale.
func startChaos(client *http.Client, url, key string, cfg ChaosConfig) *chaosRun {
	var info struct {
		EbbBackup    bool   `json:"cpu_backup"`
		SGLangBackup bool   `json:"enable_weights_cpu_backup"`
		LoadFormat   string `json:"load_format"`
	}
	_ = getJSON(client, url+"/get_server_info", key, &info)
	var model struct {
		Path string `json:"model_path"`
	}
	if info.LoadFormat != "dummy" {
		_ = getJSON(client, url+"/model_info", key, &model)
	}
	c := &chaosRun{client: client, url: url, key: key, cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, 0xc4a05)),
		tags: [][]string{{"kv_cache"}, {"kv_cache", "cuda_graph"}}, modelPath: model.Path, rep: ChaosReport{Actions: map[string]int{}}}
	if info.EbbBackup || info.SGLangBackup {
		c.tags = append(c.tags, []string{"weights"}, nil)
	}
	if len(c.cfg.PauseModes) == 0 {
		c.cfg.PauseModes = []string{"retract", "in_place"}
	}
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel = cancel
	c.done.Add(1)
	go func() {
		defer c.done.Done()
		c.loop(ctx)
	}()
	return c
}

// stop lets the action under way finish and reports.
func (c *chaosRun) stop() *ChaosReport {
	c.cancel()
	c.done.Wait()
	return &c.rep
}

func (c *chaosRun) loop(ctx context.Context) {
	for {
		gap := time.Duration(c.rng.ExpFloat64() * float64(c.cfg.Interval))
		select {
		case <-ctx.Done():
			return
		case <-time.After(gap):
		}
		name, err := c.act()
		c.rep.Actions[name]++
		if err != nil {
			c.rep.Failed++
			if c.rep.FirstError == "" {
				c.rep.FirstError = name + ": " + err.Error()
			}
		}
	}
}

// act carries out one action picked at random and names it.
func (c *chaosRun) act() (string, error) {
	hold := func() { time.Sleep(time.Duration(c.rng.Float64() * float64(c.cfg.Interval))) }
	tags := c.tags[c.rng.IntN(len(c.tags))]
	tagName := strings.Join(tags, "+")
	if tags == nil {
		tagName = "all"
	}
	actions := 5
	if c.modelPath != "" {
		actions++
	}
	switch c.rng.IntN(actions) {
	case 0:
		mode := c.cfg.PauseModes[c.rng.IntN(len(c.cfg.PauseModes))]
		return "pause " + mode, c.pauseAround(mode, hold)
	case 1:
		// ebb pauses by itself (it retracts what runs) when memory is
		// released under load.
		return "release " + tagName, c.releaseAround(tags, hold)
	case 2:
		// What verl and slime send: pause, release, resume, continue.
		name := "pause, release " + tagName
		if err := c.mustSucceed("/pause_generation", map[string]any{"mode": "retract"}); err != nil {
			return name, err
		}
		err := c.releaseAround(tags, hold)
		if e := c.mustSucceed("/continue_generation", map[string]any{}); err == nil {
			err = e
		}
		return name, err
	case 3:
		// Refused while requests hold KV (SGLang's 400 too): either answer
		// is right, anything else is not.
		status, body, err := c.call("POST", "/flush_cache", map[string]any{})
		if err == nil && status != http.StatusOK && status != http.StatusBadRequest {
			err = fmt.Errorf("%d: %s", status, body)
		}
		return "flush_cache", err
	case 4:
		status, body, err := c.call("GET", "/health_generate", nil)
		if err == nil && status != http.StatusOK {
			err = fmt.Errorf("%d: %s", status, body)
		}
		return "health_generate", err
	default:
		c.updates++
		update := map[string]any{"model_path": c.modelPath, "weight_version": fmt.Sprintf("chaos-%d", c.updates)}
		if c.rng.IntN(2) == 0 {
			// As SGLang's, it waits for the running requests, then writes.
			return "update_weights_from_disk", c.mustSucceed("/update_weights_from_disk", update)
		}
		// An asynchronous loop's: the requests paused in place keep their KV.
		update["flush_cache"] = false
		var err error
		if e := c.pauseAround("in_place", func() { err = c.mustSucceed("/update_weights_from_disk", update) }); err == nil {
			err = e
		}
		return "pause in_place, update_weights_from_disk", err
	}
}

func (c *chaosRun) pauseAround(mode string, during func()) error {
	if err := c.mustSucceed("/pause_generation", map[string]any{"mode": mode}); err != nil {
		return err
	}
	during()
	return c.mustSucceed("/continue_generation", map[string]any{"torch_empty_cache": c.rng.IntN(2) == 0})
}

func (c *chaosRun) releaseAround(tags []string, during func()) error {
	body := map[string]any{}
	if tags != nil {
		body["tags"] = tags
	}
	if err := c.mustSucceed("/release_memory_occupation", body); err != nil {
		return err
	}
	during()
	return c.mustSucceed("/resume_memory_occupation", body)
}

// mustSucceed POSTs body to path and wants a 200 that does not say
// success false.
func (c *chaosRun) mustSucceed(path string, body map[string]any) error {
	status, reply, err := c.call("POST", path, body)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	var out struct {
		Success *bool `json:"success"`
	}
	_ = json.Unmarshal(reply, &out)
	if status != http.StatusOK || out.Success != nil && !*out.Success {
		return fmt.Errorf("%s: %d: %s", path, status, reply)
	}
	return nil
}

// call makes one request (a JSON body where body is not nil) and returns
// the status and the reply.
func (c *chaosRun) call(method, path string, body any) (int, []byte, error) {
	// An update waits for the running requests: long rollouts take minutes.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	return doJSON(ctx, c.client, method, c.url+path, c.key, body)
}
