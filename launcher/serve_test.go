package launcher

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"ebb/engine"
	"ebb/ioschema"
	"ebb/scheduler"
	"ebb/tinymodel"

	_ "ebb/device/cpu"
)

var (
	ebbBin   string // built once for the package
	modelDir string
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "ebb-e2e-")
	if err != nil {
		panic(err)
	}
	ebbBin, modelDir = filepath.Join(dir, "ebb"), filepath.Join(dir, "model")
	build := exec.Command("go", "build", "-o", ebbBin, "../cmd/ebb")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building ebb:", err)
		os.Exit(1)
	}
	spec, _ := tinymodel.Default("qwen3")
	spec.Tie = false
	if err := tinymodel.Write(modelDir, spec); err != nil {
		panic(err)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// server is a running `ebb serve`.
type server struct {
	cmd      *exec.Cmd
	url, zmq string
	exited   chan error
	log      *strings.Builder
}

// startServer starts `ebb serve` with extra flags and waits until it is
// healthy. freePort's ports are free only when it asks, so a server that
// finds one taken by then (other packages' tests run beside these) is
// started again on new ones.
func startServer(t *testing.T, extra ...string) *server {
	t.Helper()
	for attempt := 1; ; attempt++ {
		if s, taken := startServerOnce(t, attempt < 3, extra...); !taken {
			return s
		}
	}
}

// startServerOnce is one attempt of startServer; taken reports a port
// taken before the server bound it, where retry allows another attempt.
func startServerOnce(t *testing.T, retry bool, extra ...string) (_ *server, taken bool) {
	t.Helper()
	port, zport := freePort(t), freePort(t)
	s := &server{url: fmt.Sprintf("http://127.0.0.1:%d", port), zmq: fmt.Sprintf("tcp://127.0.0.1:%d", zport),
		exited: make(chan error, 1), log: &strings.Builder{}}
	args := append([]string{"serve", "--model", modelDir, "--device", "cpu", "--port", strconv.Itoa(port),
		"--zmq-endpoint", s.zmq, "--max-running-requests", "64", "--max-total-tokens", "16384",
		"--chunked-prefill-size", "256", "--cuda-graph-max-bs", "16", "--log-level", "warn"}, extra...)
	s.cmd = exec.Command(ebbBin, args...)
	var mu sync.Mutex
	pr, pw := io.Pipe()
	s.cmd.Stdout, s.cmd.Stderr = pw, pw
	logged := make(chan struct{})
	go func() {
		defer close(logged)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			mu.Lock()
			s.log.WriteString(sc.Text() + "\n")
			mu.Unlock()
		}
	}()
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { s.exited <- s.cmd.Wait(); pw.Close() }()
	t.Cleanup(func() {
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.exited:
		case <-time.After(15 * time.Second):
			_ = s.cmd.Process.Kill()
		}
		// Every process checks its invariants when idle and logs a breach.
		select {
		case <-logged:
			if log := s.log.String(); strings.Contains(log, "invariant violated") {
				t.Errorf("the server logged a broken invariant:\n%s", log)
			}
		case <-time.After(5 * time.Second):
		}
	})
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		// A port another process took may accept and never answer.
		if resp, err := (&http.Client{Timeout: 2 * time.Second}).Get(s.url + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return s, false
			}
		}
		select {
		case err := <-s.exited:
			s.exited <- err // for the cleanup
			<-logged
			if retry && strings.Contains(s.log.String(), "address already in use") {
				t.Logf("ebb serve found a port taken; starting it again: %s", strings.TrimSpace(s.log.String()))
				return nil, true
			}
			t.Fatalf("ebb serve exited: %v\n%s", err, s.log.String())
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Fatalf("ebb serve did not become healthy\n%s", s.log.String())
	return nil, false
}

func (s *server) post(t *testing.T, path string, body any, out any) int {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(s.url+path, "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if out != nil {
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
	}
	return resp.StatusCode
}

func (s *server) info(t *testing.T) map[string]any {
	t.Helper()
	resp, err := http.Get(s.url + "/server_info")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var info map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&info); err != nil {
		t.Fatal(err)
	}
	return info
}

type genResult struct {
	Text      string  `json:"text"`
	OutputIDs []int32 `json:"output_ids"`
	MetaInfo  struct {
		ID               string `json:"id"`
		CompletionTokens int    `json:"completion_tokens"`
		CachedTokens     int    `json:"cached_tokens"`
		RoutedExperts    string `json:"routed_experts"`
		FinishReason     struct {
			Type string `json:"type"`
		} `json:"finish_reason"`
	} `json:"meta_info"`
}

// TestGreedyMatchesOffline: /generate through three processes returns
// exactly what the in-process engine (ebb generate) returns.
func TestGreedyMatchesOffline(t *testing.T) {
	s := startServer(t)
	prompt := "The quick brown fox jumps over the lazy dog"
	var got genResult
	if code := s.post(t, "/generate", map[string]any{"text": prompt, "sampling_params": map[string]any{"max_new_tokens": 24, "temperature": 0}}, &got); code != 200 {
		t.Fatalf("status %d", code)
	}
	e, err := engine.Open(engine.Config{ModelDir: modelDir, Device: "cpu", MaxTotalTokens: 4096, MaxRunningRequests: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	zero, n := 0.0, 24
	params, _ := (&ioschema.SamplingParams{Temperature: &zero, MaxNewTokens: &n}).Resolve(e.Defaults())
	outs, err := scheduler.Generate(e, []scheduler.Request{{Rid: "x", InputIDs: e.Tokenizer.Encode(prompt, true), Params: params, LogprobStartLen: -1}})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got.OutputIDs, outs[0].OutputIDs) {
		t.Fatalf("server %v\noffline %v", got.OutputIDs, outs[0].OutputIDs)
	}
	if want := e.Tokenizer.Decode(outs[0].OutputIDs, true); got.Text != want {
		t.Fatalf("text %q, want %q", got.Text, want)
	}
}

// streamGenerate reads a /generate SSE stream to its end and returns the
// last object.
func streamGenerate(ctx context.Context, url string, body map[string]any, stopAfter int) (genResult, int, error) {
	body["stream"] = true
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(ctx, "POST", url+"/generate", strings.NewReader(string(b)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return genResult{}, 0, err
	}
	defer resp.Body.Close()
	var last genResult
	chunks := 0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: ") || line == "data: [DONE]" {
			continue
		}
		if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &last); err != nil {
			return last, chunks, err
		}
		chunks++
		if stopAfter > 0 && chunks >= stopAfter {
			return last, chunks, nil // the caller disconnects
		}
	}
	return last, chunks, sc.Err()
}

// TestConcurrentStreamingSharedPrefix: 64 streams of mixed lengths finish
// correctly; those sharing a long prefix report cached tokens.
func TestConcurrentStreamingSharedPrefix(t *testing.T) {
	s := startServer(t)
	prefix := strings.Repeat("You are a careful assistant that answers briefly. ", 8)
	// Cache the prefix first, as an RL loop's first request does.
	var first genResult
	s.post(t, "/generate", map[string]any{"text": prefix + "Warm up.", "sampling_params": map[string]any{"max_new_tokens": 1}}, &first)
	var wg sync.WaitGroup
	results := make([]genResult, 64)
	errs := make([]error, 64)
	want := make([]int, 64)
	for i := 0; i < 64; i++ {
		want[i] = 4 + i%13
		text := fmt.Sprintf("Question %d: %s", i, strings.Repeat("why? ", i%9))
		if i%2 == 0 {
			text = prefix + text
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], _, errs[i] = streamGenerate(context.Background(), s.url, map[string]any{"text": text,
				"sampling_params": map[string]any{"max_new_tokens": want[i], "temperature": 0.8, "ignore_eos": true}}, 0)
		}()
	}
	wg.Wait()
	cachedShared := 0
	for i, r := range results {
		if errs[i] != nil {
			t.Fatalf("stream %d: %v", i, errs[i])
		}
		if r.MetaInfo.CompletionTokens != want[i] || len(r.OutputIDs) != want[i] || r.MetaInfo.FinishReason.Type != "length" {
			t.Fatalf("stream %d: %d tokens (%s), want %d", i, r.MetaInfo.CompletionTokens, r.MetaInfo.FinishReason.Type, want[i])
		}
		if i%2 == 0 && r.MetaInfo.CachedTokens > 0 {
			cachedShared++
		}
	}
	if cachedShared < 32 {
		t.Fatalf("only %d of 32 requests sharing the prefix reported cached_tokens > 0", cachedShared)
	}
	checkKVWhole(t, s)
}

// checkKVWhole waits for the scheduler to go idle and checks that every KV
// slot is free or cached, none held, and the idle invariant checks pass.
func checkKVWhole(t *testing.T, s *server) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	var info map[string]any
	for time.Now().Before(deadline) {
		info = s.info(t)
		if info["num_running_reqs"].(float64) == 0 && info["num_waiting_reqs"].(float64) == 0 && info["kv_used_tokens"].(float64) == 0 {
			time.Sleep(1200 * time.Millisecond) // let an idle invariant check run
			info = s.info(t)
			if info["invariants_ok"] != true {
				t.Fatalf("invariants: %v", info)
			}
			total := info["max_total_num_tokens"].(float64)
			if info["kv_free_tokens"].(float64)+info["kv_cached_tokens"].(float64) != total {
				t.Fatalf("KV pool not whole: %v", info)
			}
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("scheduler did not go idle: %v", info)
}

// TestAbortsAndDisconnectsFreeKV: clients that go away mid-stream and
// requests aborted by rid leave the KV pool whole.
func TestAbortsAndDisconnectsFreeKV(t *testing.T) {
	s := startServer(t)
	var wg sync.WaitGroup
	for i := 0; i < 16; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			body := map[string]any{"text": fmt.Sprintf("Tell me a long story number %d.", i), "rid": fmt.Sprintf("long-%d", i),
				"sampling_params": map[string]any{"max_new_tokens": 2000, "ignore_eos": true}}
			if i%2 == 0 {
				streamGenerate(ctx, s.url, body, 3) // read 3 chunks, then hang up
				return
			}
			res, _, _ := streamGenerate(ctx, s.url, body, 0)
			if res.MetaInfo.FinishReason.Type != "abort" {
				t.Errorf("request %d finished with %q, want abort", i, res.MetaInfo.FinishReason.Type)
			}
		}()
	}
	time.Sleep(1500 * time.Millisecond)
	if code := s.post(t, "/abort_request", map[string]any{"rid": "long-"}, nil); code != 200 {
		t.Fatalf("abort status %d", code)
	}
	wg.Wait()
	checkKVWhole(t, s)
}

// zmqCall sends raw bytes on a DEALER and returns the decoded reply.
func zmqCall(t *testing.T, sock *zmq.Socket, payload []byte) map[string]any {
	t.Helper()
	if _, err := sock.SendBytes(payload, 0); err != nil {
		t.Fatal(err)
	}
	b, err := sock.RecvBytes(0)
	if err != nil {
		t.Fatalf("no reply: %v", err)
	}
	var m map[string]any
	if err := msgpack.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// dealer connects a DEALER socket to the server's external API.
func (s *server) dealer(t *testing.T) *zmq.Socket {
	t.Helper()
	sock, err := zmq.NewSocket(zmq.DEALER)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sock.Close() })
	sock.SetLinger(0)
	sock.SetRcvtimeo(30 * time.Second)
	if err := sock.Connect(s.zmq); err != nil {
		t.Fatal(err)
	}
	return sock
}

func enc(v any) []byte { b, _ := msgpack.Marshal(v); return b }

func TestExternalSocketRejectsBadInputAndKeepsServing(t *testing.T) {
	s := startServer(t)
	sock := s.dealer(t)
	bad := []struct {
		name    string
		payload []byte
		rid     string
	}{
		{"not msgpack", []byte{0xc1, 0x00, 0xff}, ""},
		{"unknown type", enc(map[string]any{"type": "LaunchReqInput", "rid": "u1"}), "u1"},
		{"wrong field type", enc(map[string]any{"type": "PauseGenerationReqInput", "rid": "w1", "mode": 5}), "w1"},
		{"bad token ids", enc(map[string]any{"type": "GenerateReqInput", "rid": "g1", "input_ids": []any{"a"}}), "g1"},
		{"huge declared array", []byte{0x92, 0xa1, 0xdd, 0xdd, 0xdd, 0xdd, 0xdd, 0xdd, 0xdd, 0x30, 0x96}, ""},
		{"output type as request", enc(map[string]any{"type": "BatchStrOutput", "rid": "o1"}), "o1"},
		{"too long for the context", enc(map[string]any{"type": "GenerateReqInput", "rid": "l1", "input_ids": make([]int, 5000)}), "l1"},
	}
	for _, c := range bad {
		reply := zmqCall(t, sock, c.payload)
		if reply["type"] != "ErrorOutput" || reply["rid"] != c.rid {
			t.Fatalf("%s: got %v", c.name, reply)
		}
	}
	reply := zmqCall(t, sock, enc(map[string]any{"type": "GenerateReqInput", "rid": "ok1", "input_ids": []int{1, 2, 3},
		"sampling_params": map[string]any{"max_new_tokens": 3, "temperature": 0}}))
	if reply["type"] != "GenerateReqOutput" || reply["rid"] != "ok1" || len(reply["output_ids"].([]any)) != 3 {
		t.Fatalf("generate after bad input: %v", reply)
	}
	reply = zmqCall(t, sock, enc(map[string]any{"type": "FlushCacheReqInput", "rid": "f1"}))
	if reply["type"] != "FlushCacheReqOutput" || reply["rid"] != "f1" || reply["success"] != true {
		t.Fatalf("flush: %v", reply)
	}
}

func TestPythonExampleClient(t *testing.T) {
	s := startServer(t)
	cmd := exec.Command("/usr/bin/python3", "../examples/python/rl_client.py", "--endpoint", s.zmq, "--model-path", modelDir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s\nserver log:\n%s", err, out, s.log.String())
	}
	for _, want := range []string{"p0-0:", "p1-3:", "released:", "weights updated", "malformed message -> ErrorOutput", "after the bad message: GenerateReqOutput step-1"} {
		if !strings.Contains(string(out), want) {
			t.Fatalf("output lacks %q:\n%s", want, out)
		}
	}
	t.Logf("%s", out)
}

// TestSchedulerCrashStopsServer: when any scheduler process dies (an
// engine's, one of several engines', a tensor-parallel follower) or hangs
// in a step (a follower stopped, so its leader waits inside the step's
// all-reduce), ebb serve stops every process and exits non-zero, naming
// the process and, for a hang, the watchdog.
func TestSchedulerCrashStopsServer(t *testing.T) {
	for _, tc := range []struct {
		name   string
		args   []string
		role   string // the child to kill or stop
		hang   bool   // SIGSTOP it and send a request, rather than SIGKILL it
		wantIn string // in the log
	}{
		{"scheduler killed", nil, "scheduler", false, "scheduler process stopped"},
		{"one of two engines killed", []string{"--dp-size", "2"}, "scheduler-1", false, "scheduler-1 process stopped"},
		{"tp follower killed", []string{"--tp-size", "2"}, "tp-0-1", false, "tp-0-1 process stopped"},
		{"tp follower hangs", []string{"--tp-size", "2", "--watchdog-timeout", "1"}, "tp-0-1", true,
			"scheduler process stopped: a step ran past --watchdog-timeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startServer(t, tc.args...)
			children := childrenOf(s.cmd.Process.Pid)
			pid := childWithRole(children, tc.role)
			if pid == 0 {
				t.Fatalf("no %s among the children %v", tc.role, children)
			}
			if tc.role == "scheduler" && int(s.info(t)["scheduler_pid"].(float64)) != pid {
				t.Fatalf("server_info names scheduler %v, the child is %d", s.info(t)["scheduler_pid"], pid)
			}
			inFlight := make(chan int, 1) // the status of the request in flight
			if tc.hang {
				if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
				go func() {
					body := strings.NewReader(`{"text": "hello", "sampling_params": {"max_new_tokens": 4}}`)
					resp, err := http.Post(s.url+"/generate", "application/json", body)
					if err != nil {
						inFlight <- 0
						return
					}
					resp.Body.Close()
					inFlight <- resp.StatusCode
				}()
			} else if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-s.exited:
				if err == nil {
					t.Fatal("ebb serve exited with status 0")
				}
				if !strings.Contains(s.log.String(), tc.wantIn) {
					t.Fatalf("log does not say %q:\n%s", tc.wantIn, s.log.String())
				}
				// A server fault is a 503, which clients retry, not their 400.
				if tc.hang {
					if code := <-inFlight; code != http.StatusServiceUnavailable {
						t.Errorf("the request in flight got %d, want 503", code)
					}
				}
			case <-time.After(30 * time.Second): // a stopped child takes SIGKILL after 10 s
				t.Fatalf("ebb serve still running 30 s later\n%s", s.log.String())
			}
			s.exited <- nil // for the cleanup
			time.Sleep(200 * time.Millisecond)
			for _, c := range children {
				if syscall.Kill(c, 0) == nil {
					if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", c)); !strings.Contains(string(b), ") Z ") {
						t.Fatalf("child %d is still alive", c)
					}
				}
			}
		})
	}
}

// childWithRole is the one of pids that runs `ebb __child role ...`.
func childWithRole(pids []int, role string) int {
	for _, p := range pids {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p))
		if args := strings.Split(string(b), "\x00"); len(args) > 2 && args[1] == "__child" && args[2] == role {
			return p
		}
	}
	return 0
}

// childrenOf lists the pids whose parent is pid.
func childrenOf(pid int) []int {
	var out []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		fields := strings.Fields(string(b)[strings.LastIndexByte(string(b), ')')+1:])
		if len(fields) > 1 && fields[1] == strconv.Itoa(pid) {
			out = append(out, n)
		}
	}
	return out
}
