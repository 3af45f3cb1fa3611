package bench

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// SyncLine is what a data-parallel engine of one-batch writes on stdout
// before a batch size, and waits for "go" on stdin after (--sync-stdio).
func SyncLine(batchSize int) string { return fmt.Sprintf("ready %d", batchSize) }

// oneBatchDP runs one-batch on --dp-size engines at once, each a child
// process on its own GPUs, every batch size starting on all of them
// together.
func oneBatchDP(cfg OneBatchConfig) ([]OneBatchResult, error) {
	if cfg.ProfileStep >= 0 {
		return nil, errors.New("--profile-step profiles one engine: run it with --dp-size 1")
	}
	sizes := make([]string, len(cfg.BatchSizes))
	for i, b := range cfg.BatchSizes {
		sizes[i] = strconv.Itoa(b)
	}
	n := cfg.Engine.DPSize
	var engines []*dpEngine
	defer func() {
		for _, d := range engines {
			d.kill()
		}
	}()
	for i := range n {
		e := cfg.Engine
		e.DPSize = 1
		e.GPU += i * max(e.TPSize, 1)
		args := append([]string{"bench", "one-batch", "--json", "--sync-stdio", "--batch-size", strings.Join(sizes, ","),
			"--input-len", strconv.Itoa(cfg.InputLen), "--output-len", strconv.Itoa(cfg.OutputLen),
			"--temperature", strconv.FormatFloat(cfg.Temperature, 'g', -1, 64), "--top-k", strconv.Itoa(cfg.TopK),
			"--top-p", strconv.FormatFloat(cfg.TopP, 'g', -1, 64), "--min-p", strconv.FormatFloat(cfg.MinP, 'g', -1, 64)},
			engineArgs(e)...)
		d, err := startDPEngine(cfg.Executable, args)
		if err != nil {
			return nil, fmt.Errorf("data-parallel engine %d: %w", i, err)
		}
		engines = append(engines, d)
	}
	bar := newProgress(cfg.Progress, len(cfg.BatchSizes), fmt.Sprintf("%d engines, batch sizes", n))
	for _, b := range cfg.BatchSizes {
		for i, d := range engines {
			line, err := d.out.ReadString('\n')
			if strings.TrimSpace(line) != SyncLine(b) {
				return nil, fmt.Errorf("data-parallel engine %d before batch %d: %s", i, b, d.failure(line, err))
			}
		}
		for i, d := range engines {
			if _, err := io.WriteString(d.in, "go\n"); err != nil {
				return nil, fmt.Errorf("data-parallel engine %d: %s", i, d.failure("", err))
			}
		}
		bar.Add(1)
	}
	per := make([][]OneBatchResult, n)
	for i, d := range engines {
		if err := json.NewDecoder(d.out).Decode(&per[i]); err != nil {
			return nil, fmt.Errorf("data-parallel engine %d's results: %s", i, d.failure("", err))
		}
		if err := d.cmd.Wait(); err != nil {
			return nil, fmt.Errorf("data-parallel engine %d: %s", i, d.failure("", err))
		}
		if len(per[i]) != len(cfg.BatchSizes) {
			return nil, fmt.Errorf("data-parallel engine %d gave %d results for %d batch sizes", i, len(per[i]), len(cfg.BatchSizes))
		}
	}
	out := make([]OneBatchResult, len(cfg.BatchSizes))
	for k := range out {
		rows := make([]OneBatchResult, n)
		for i := range per {
			rows[i] = per[i][k]
		}
		out[k] = combineEngines(rows)
	}
	return out, nil
}

// combineEngines is one batch size over engines that ran it together:
// times are the slowest engine's, rates the whole GPU set's.
func combineEngines(rows []OneBatchResult) OneBatchResult {
	c := rows[0]
	c.Engines = rows
	c.PrefillStepMs = nil
	c.PrefillTokPerS, c.DecodeTokPerS, c.GraphDecodeSteps, c.ShortGraphSteps = 0, 0, 0, 0
	for _, r := range rows {
		c.PrefillMs, c.PrefillSteps = max(c.PrefillMs, r.PrefillMs), max(c.PrefillSteps, r.PrefillSteps)
		c.DecodeMedianMs, c.DecodeP90Ms = max(c.DecodeMedianMs, r.DecodeMedianMs), max(c.DecodeP90Ms, r.DecodeP90Ms)
		c.TotalMs = max(c.TotalMs, r.TotalMs)
		c.PrefillTokPerS += r.PrefillTokPerS
		c.DecodeTokPerS += r.DecodeTokPerS
		c.GraphDecodeSteps += r.GraphDecodeSteps
		c.ShortGraphSteps += r.ShortGraphSteps
		if r.OutputDigest != c.OutputDigest {
			c.OutputDigest = "differs"
		}
	}
	c.OutputTokPerS = float64(len(rows)*c.BatchSize*c.OutputLen) / (c.TotalMs / 1000)
	return c
}

// dpEngine is one data-parallel engine of one-batch, a child process.
type dpEngine struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Reader
	stderr *tailWriter
}

func startDPEngine(exe string, args []string) (*dpEngine, error) {
	cmd := exec.Command(exe, args...)
	d := &dpEngine{cmd: cmd, stderr: &tailWriter{w: os.Stderr}}
	cmd.Stderr = d.stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var err error
	if d.in, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	d.out = bufio.NewReader(stdout)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return d, nil
}

// failure says why the engine did not answer as expected: its last line
// of errors when it wrote one.
func (d *dpEngine) failure(line string, err error) string {
	msg := fmt.Sprintf("unexpected output %q", strings.TrimSpace(line))
	if err != nil {
		msg = err.Error()
	}
	if last := d.stderr.lastLine(); last != "" {
		msg += ": " + last
	}
	return msg
}

func (d *dpEngine) kill() {
	if d.cmd.ProcessState == nil {
		_ = d.cmd.Process.Kill()
		_ = d.cmd.Wait()
	}
}

// tailWriter passes writes on and keeps the last ones, for error messages.
type tailWriter struct {
	w    io.Writer
	mu   sync.Mutex
	tail []byte
}

func (t *tailWriter) Write(p []byte) (int, error) {
	t.mu.Lock()
	t.tail = append(t.tail, p...)
	if len(t.tail) > 4096 {
		t.tail = t.tail[len(t.tail)-4096:]
	}
	t.mu.Unlock()
	return t.w.Write(p)
}

func (t *tailWriter) lastLine() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	lines := strings.Split(strings.TrimSpace(string(t.tail)), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}
