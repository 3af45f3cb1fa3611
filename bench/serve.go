package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"ebb/engine"
)

// serveProc is the server under test.
type serveProc struct {
	cmd  *exec.Cmd
	url  string
	done chan error
}

// startServe runs `exe serve` on e's model and settings, plus extra flags.
func startServe(exe string, e engine.Config, extra ...string) (*serveProc, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	args := append([]string{"serve", "--port", strconv.Itoa(port), "--zmq-endpoint", "none", "--log-level", "warn",
		"--skip-server-warmup"}, engineArgs(e)...)
	args = append(args, extra...)
	s := &serveProc{cmd: exec.Command(exe, args...), url: fmt.Sprintf("http://127.0.0.1:%d", port), done: make(chan error, 1)}
	s.cmd.Stderr = os.Stderr
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { s.done <- s.cmd.Wait() }()
	deadline := time.Now().Add(10 * time.Minute)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(s.url + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return s, nil
			}
		}
		select {
		case err := <-s.done:
			return nil, fmt.Errorf("ebb serve exited: %v", err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	s.stop()
	return nil, fmt.Errorf("ebb serve did not become healthy")
}

// engineArgs are the command-line flags that give another ebb process e's
// settings.
func engineArgs(e engine.Config) []string {
	e.Defaults()
	args := []string{"--model", e.ModelDir, "--device", e.Device,
		"--mem-fraction-static", strconv.FormatFloat(e.MemFractionStatic, 'f', -1, 64), "--base-gpu-id", strconv.Itoa(e.GPU)}
	if e.TokenizerDir != e.ModelDir {
		args = append(args, "--tokenizer-path", e.TokenizerDir)
	}
	if e.DType != "" && e.DType != "auto" {
		args = append(args, "--dtype", e.DType)
	}
	if e.RandomSeed != nil {
		args = append(args, "--random-seed", strconv.FormatUint(*e.RandomSeed, 10))
	}
	if e.MaxTotalTokens > 0 {
		args = append(args, "--max-total-tokens", strconv.Itoa(e.MaxTotalTokens))
	}
	if e.CPUBackup {
		args = append(args, "--enable-weights-cpu-backup")
	}
	if e.DistTimeout > 0 {
		args = append(args, "--dist-timeout", strconv.FormatFloat(e.DistTimeout.Seconds(), 'f', -1, 64))
	}
	if e.WatchdogTimeout > 0 {
		args = append(args, "--watchdog-timeout", strconv.FormatFloat(e.WatchdogTimeout.Seconds(), 'f', -1, 64))
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"--max-running-requests", e.MaxRunningRequests}, {"--chunked-prefill-size", e.ChunkedPrefillSize},
		{"--context-length", e.ContextLength}, {"--cuda-graph-max-bs", e.CUDAGraphMaxBS},
		{"--decode-log-interval", e.DecodeLogInterval}} {
		if f.v > 0 {
			args = append(args, f.name, strconv.Itoa(f.v))
		}
	}
	if e.DisableRadixCache {
		args = append(args, "--disable-radix-cache")
	}
	if e.DisableOverlap {
		args = append(args, "--disable-overlap-schedule")
	}
	if e.EnableMixedChunk {
		args = append(args, "--enable-mixed-chunk")
	}
	if e.EnableDeterministicInference {
		args = append(args, "--enable-deterministic-inference")
	}
	if e.EnableReturnRoutedExperts {
		args = append(args, "--enable-return-routed-experts")
	}
	if e.LoadFormat != "" && e.LoadFormat != "auto" {
		args = append(args, "--load-format", e.LoadFormat)
	}
	if e.ScheduleConservativeness > 0 && e.ScheduleConservativeness != 1 {
		args = append(args, "--schedule-conservativeness", strconv.FormatFloat(e.ScheduleConservativeness, 'f', -1, 64))
	}
	if e.SchedulePolicy != "" && e.SchedulePolicy != "fcfs" {
		args = append(args, "--schedule-policy", e.SchedulePolicy)
	}
	if e.DisableCUDAGraph {
		args = append(args, "--disable-cuda-graph")
	}
	if e.TPSize > 1 || e.DPSize > 1 {
		args = append(args, "--tp-size", strconv.Itoa(e.TPSize), "--dp-size", strconv.Itoa(e.DPSize))
	}
	return args
}

func (s *serveProc) stop() {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(20 * time.Second):
		_ = s.cmd.Process.Kill()
	}
}

func (s *serveProc) call(method, path string, body, out any) error {
	var r io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		r = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(context.Background(), method, s.url+path, r)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return fmt.Errorf("%s: %s: %s", path, resp.Status, strings.TrimSpace(string(b)))
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

func (s *serveProc) control(path string, body, out any) error { return s.call("POST", path, body, out) }

// generate runs a batch through /generate and returns the output ids.
func (s *serveProc) generate(prompts [][]int32, maxNew int, temperature float64) ([][]int32, error) {
	var res []struct {
		OutputIDs []int32 `json:"output_ids"`
	}
	body := map[string]any{"input_ids": prompts, "sampling_params": map[string]any{"max_new_tokens": maxNew, "temperature": temperature, "ignore_eos": true}}
	if err := s.call("POST", "/generate", body, &res); err != nil {
		return nil, err
	}
	out := make([][]int32, len(res))
	for i, r := range res {
		out[i] = r.OutputIDs
	}
	return out, nil
}
