// Package launcher runs `ebb serve`: it starts the scheduler and the
// detokenizer as child processes of the same binary, waits for both to
// report ready, runs the tokenizer manager (HTTP and the external ZMQ API)
// itself, and when any part stops it stops the rest, so no process is left
// behind and a crash ends the server with the child's error.
package launcher

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"ebb/detokenizer"
	"ebb/engine"
	"ebb/scheduler"
	tm "ebb/tokenizer_manager"
)

// Config is `ebb serve`'s settings.
type Config struct {
	Engine      engine.Config
	Host        string
	Port        int
	ZMQEndpoint string // external API; "" for the default, "none" to disable
	ModelName   string
	LogLevel    string
	APIKey      string // --api-key
	SkipWarmup  bool   // --skip-server-warmup
	// LoadBalanceMethod is --load-balance-method (tm.ParseLoadBalanceMethod).
	LoadBalanceMethod string
	// AllowAutoTruncate (--allow-auto-truncate) clips prompts and
	// max_new_tokens to the context instead of refusing them.
	AllowAutoTruncate bool
	// IncrementalStreamingOutput is --incremental-streaming-output.
	IncrementalStreamingOutput bool
	// MaxRequestBodyBytes caps a generate request's body (0: sized from
	// the context length).
	MaxRequestBodyBytes int64
	// ReasoningParser and ToolCallParser are --reasoning-parser and
	// --tool-call-parser ("": none, the chat template's syntax).
	ReasoningParser, ToolCallParser string
	// Executable is the ebb binary the children run (default: this one).
	Executable string
	// Ready, if set, is called with the HTTP address once serving.
	Ready func(httpAddr, zmqEndpoint string)
}

// ChildConfig is what the children read from the runtime directory.
type ChildConfig struct {
	// Schedulers has one entry per data-parallel engine (role
	// "scheduler", or "scheduler-<i>" with several).
	Schedulers []scheduler.ProcessConfig
	// TPRanks are the tensor-parallel ranks other than 0, by role
	// ("tp-<engine>-<rank>").
	TPRanks     map[string]scheduler.ProcessConfig
	Detokenizer detokenizer.Config
	LogLevel    string
}

const childConfigFile = "config.json"

// child is a running child process.
type child struct {
	name string
	cmd  *exec.Cmd
	done chan error // the exit status, once
}

// Run serves until ctx ends (nil error) or a part of the server fails.
func Run(ctx context.Context, cfg Config, log *zap.Logger) error {
	// Children get SIGKILL when the thread that started them ends
	// (Pdeathsig): keep this goroutine on one thread for the server's life.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if _, err := tm.ParseLoadBalanceMethod(cfg.LoadBalanceMethod); err != nil {
		return err
	}
	if cfg.Executable == "" {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		cfg.Executable = exe
	}
	dir, err := os.MkdirTemp("", "ebb-run-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	cfg.Engine.Defaults()
	ep := func(name string) string { return "ipc://" + filepath.Join(dir, name) }
	zmqEndpoint := cfg.ZMQEndpoint
	switch zmqEndpoint {
	case "":
		zmqEndpoint = "tcp://127.0.0.1:" + strconv.Itoa(cfg.Port+1)
	case "none":
		zmqEndpoint = ""
	}
	cc := ChildConfig{
		Detokenizer: detokenizer.Config{TokenizerDir: cfg.Engine.TokenizerDir, InputEndpoint: ep("detokenizer"), OutputEndpoint: ep("tokenizer")},
		LogLevel:    cfg.LogLevel,
	}
	// Data parallelism: engine i runs on GPUs base + i*tp...; all send their
	// tokens to the one detokenizer and their replies to the one manager.
	roles := []string{"scheduler"}
	if cfg.Engine.DPSize > 1 {
		roles = roles[:0]
		for i := range cfg.Engine.DPSize {
			roles = append(roles, fmt.Sprintf("scheduler-%d", i))
		}
	}
	// Tensor parallelism: rank 0 is the engine's scheduler; ranks 1.. are
	// followers that start first and run what it sends them.
	var schedEndpoints, followers []string
	cc.TPRanks = map[string]scheduler.ProcessConfig{}
	for i, role := range roles {
		e := cfg.Engine
		e.GPU += i * e.TPSize
		pc := scheduler.ProcessConfig{Engine: e, InputEndpoint: ep(role), DPRank: i,
			DetokenizerEndpoint: ep("detokenizer"), TokenizerEndpoint: ep("tokenizer")}
		pc.TP, followers = placeTPRanks(e, i, ep, cc.TPRanks, followers)
		cc.Schedulers = append(cc.Schedulers, pc)
		schedEndpoints = append(schedEndpoints, ep(role))
	}
	b, err := json.Marshal(cc)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, childConfigFile), b, 0o600); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	children, err := startChildren(ctx, cfg.Executable, slices.Concat(followers, roles, []string{"detokenizer"}), dir, log)
	if err != nil {
		return err
	}
	defer func() { stopChildren(children, log) }()
	m, err := tm.New(tm.Config{ModelDir: cfg.Engine.ModelDir, TokenizerDir: cfg.Engine.TokenizerDir, ModelName: cfg.ModelName,
		SchedulerEndpoints: schedEndpoints, InputEndpoint: ep("tokenizer"), ZMQEndpoint: zmqEndpoint, APIKey: cfg.APIKey,
		DisableRadixCache: cfg.Engine.DisableRadixCache, LoadBalanceMethod: cfg.LoadBalanceMethod,
		ContextLength: cfg.Engine.ContextLength, AllowAutoTruncate: cfg.AllowAutoTruncate,
		IncrementalStreamingOutput: cfg.IncrementalStreamingOutput,
		MaxRequestBodyBytes:        cfg.MaxRequestBodyBytes, ReasoningParser: cfg.ReasoningParser,
		ToolCallParser: cfg.ToolCallParser}, log.Named("tokenizer_manager"))
	if err != nil {
		return err
	}
	if err := m.Start(ctx); err != nil {
		return err
	}
	defer m.Close()
	addr := net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port))
	httpErr := make(chan error, 1)
	listening := make(chan string, 1)
	go func() { httpErr <- m.Serve(ctx, addr, func(a string) { listening <- a }) }()
	exited := firstExit(children)
	warmedUp := make(chan error, 1)
	var failure error
	httpDone := false
	for failure == nil && ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case err := <-httpErr:
			failure, httpDone = fmt.Errorf("http server: %w", err), true
		case err := <-m.Errors():
			failure = fmt.Errorf("tokenizer manager: %w", err)
		case failure = <-exited:
		case a := <-listening:
			go func() { warmedUp <- warmupThenReady(ctx, cfg, m, a, zmqEndpoint, log) }()
		case failure = <-warmedUp:
		}
	}
	cancel()
	if !httpDone {
		// The requests in flight are answered (503, server shutting down)
		// before the process exits.
		<-httpErr
	}
	return failure
}

// placeTPRanks places the tensor-parallel ranks of engine i (on GPUs from
// e.GPU): it adds the followers' configs to ranks under their roles
// ("tp-<engine>-<rank>"), appends the roles to names and returns rank 0's
// placement (nil with one rank).
func placeTPRanks(e engine.Config, i int, ep func(string) string, ranks map[string]scheduler.ProcessConfig, names []string) (*scheduler.TPConfig, []string) {
	if e.TPSize <= 1 {
		return nil, names
	}
	leader := &scheduler.TPConfig{HubEndpoint: ep(fmt.Sprintf("tp-%d-hub", i)), AckEndpoint: ep(fmt.Sprintf("tp-%d-ack", i))}
	for r := 1; r < e.TPSize; r++ {
		name := fmt.Sprintf("tp-%d-%d", i, r)
		fe := e
		fe.GPU += r
		leader.StepEndpoints = append(leader.StepEndpoints, ep(name))
		ranks[name] = scheduler.ProcessConfig{Engine: fe, DPRank: i, TP: &scheduler.TPConfig{Rank: r,
			HubEndpoint: leader.HubEndpoint, AckEndpoint: leader.AckEndpoint, StepEndpoints: []string{ep(name)}}}
		names = append(names, name)
	}
	return leader, names
}

// warmupThenReady runs SGLang's start-up generation (unless skipped), so
// that a server that cannot generate fails at start, then announces it.
func warmupThenReady(ctx context.Context, cfg Config, m *tm.Manager, addr, zmqEndpoint string, log *zap.Logger) error {
	if !cfg.SkipWarmup {
		start := time.Now()
		if err := m.Warmup(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("warm-up generation failed: %w", err)
		}
		log.Info("warm-up generation done", zap.Duration("took", time.Since(start)))
	}
	log.Info("serving", zap.String("http", "http://"+addr), zap.String("zmq", zmqEndpoint))
	if cfg.Ready != nil {
		cfg.Ready(addr, zmqEndpoint)
	}
	return nil
}

// firstExit reports the first child to end, as an error.
func firstExit(children []*child) <-chan error {
	out := make(chan error, len(children))
	for _, c := range children {
		go func() {
			err := <-c.done
			c.done <- err // keep it readable for stopChildren
			var exit *exec.ExitError
			switch {
			case err == nil:
				err = errors.New("exited")
			case errors.As(err, &exit) && exit.ExitCode() == scheduler.ExitWatchdog:
				err = fmt.Errorf("a step ran past --watchdog-timeout (%w)", err)
			}
			out <- fmt.Errorf("%s process stopped: %w", c.name, err)
		}()
	}
	return out
}

// startChild runs `ebb __child role dir` and waits for its ready line.
func startChild(ctx context.Context, exe, role, dir string, log *zap.Logger) (*child, error) {
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer pr.Close()
	cmd := exec.Command(exe, "__child", role, dir)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.ExtraFiles = []*os.File{pw}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		pw.Close()
		return nil, fmt.Errorf("start %s: %w", role, err)
	}
	pw.Close()
	c := &child{name: role, cmd: cmd, done: make(chan error, 1)}
	go func() { c.done <- cmd.Wait() }()
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(nil, 1<<20)
		if sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	select {
	case line, ok := <-lines:
		if ok && strings.HasPrefix(line, "ready") {
			log.Info(role+" ready", zap.String("info", strings.TrimSpace(strings.TrimPrefix(line, "ready"))))
			return c, nil
		}
		stopChildren([]*child{c}, log)
		if ok && strings.HasPrefix(line, "error ") {
			return nil, fmt.Errorf("%s: %s", role, strings.TrimPrefix(line, "error "))
		}
		return nil, fmt.Errorf("%s exited before it was ready", role)
	case <-ctx.Done():
		stopChildren([]*child{c}, log)
		return nil, ctx.Err()
	}
}

// startChildren starts every role at once and waits until all are ready:
// the ranks of a tensor-parallel engine join their NCCL group and capture
// their graphs together. If one fails, the others are stopped.
func startChildren(ctx context.Context, exe string, roles []string, dir string, log *zap.Logger) ([]*child, error) {
	type started struct {
		i   int
		c   *child
		err error
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	results := make(chan started, len(roles))
	for i, role := range roles {
		go func() {
			c, err := startChild(ctx, exe, role, dir, log)
			results <- started{i, c, err}
		}()
	}
	children := make([]*child, len(roles))
	var errs []error
	for range roles {
		r := <-results
		children[r.i] = r.c
		if r.err != nil && !errors.Is(r.err, context.Canceled) {
			errs = append(errs, r.err)
		}
		if r.err != nil {
			cancel() // the others stop waiting and stop their child
		}
	}
	if len(errs) > 0 || ctx.Err() != nil {
		stopChildren(slices.DeleteFunc(children, func(c *child) bool { return c == nil }), log)
		if len(errs) == 0 {
			errs = append(errs, ctx.Err())
		}
		return nil, errors.Join(errs...)
	}
	return children, nil
}

// stopChildren sends SIGTERM, waits a little, then SIGKILL.
func stopChildren(children []*child, log *zap.Logger) {
	for _, c := range children {
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
	}
	expired := make(chan struct{}) // closed: every later wait sees it
	timer := time.AfterFunc(10*time.Second, func() { close(expired) })
	defer timer.Stop()
	for _, c := range children {
		select {
		case err := <-c.done:
			c.done <- err
		case <-expired:
			log.Warn("child did not stop; killing it", zap.String("child", c.name))
			_ = c.cmd.Process.Kill()
		}
	}
}

// RunChild is the body of `ebb __child role dir`: it reads the config,
// reports ready (or its error) on file descriptor 3 and serves until
// SIGTERM. SIGINT is left to the parent, which shuts the children down in
// order.
func RunChild(role, dir string, newLog func(level, name string) (*zap.Logger, error)) error {
	signal := os.NewFile(3, "ready")
	report := func(s string) {
		if signal != nil {
			fmt.Fprintln(signal, s)
			signal.Close()
			signal = nil
		}
	}
	fail := func(err error) error {
		report("error " + strings.ReplaceAll(err.Error(), "\n", " "))
		return err
	}
	b, err := os.ReadFile(filepath.Join(dir, childConfigFile))
	if err != nil {
		return fail(err)
	}
	var cc ChildConfig
	if err := json.Unmarshal(b, &cc); err != nil {
		return fail(err)
	}
	log, err := newLog(cc.LogLevel, role)
	if err != nil {
		return fail(err)
	}
	defer log.Sync()
	ctx, stop := notifyTerm()
	defer stop()
	go exitIfStopStalls(ctx, log)
	switch {
	case role == "scheduler" || strings.HasPrefix(role, "scheduler-"):
		i := 0
		if n, ok := strings.CutPrefix(role, "scheduler-"); ok {
			i, err = strconv.Atoi(n)
		}
		if err != nil || i < 0 || i >= len(cc.Schedulers) {
			return fail(fmt.Errorf("unknown child role %q", role))
		}
		err = scheduler.RunProcess(ctx, cc.Schedulers[i], log, func(info map[string]any) {
			b, _ := json.Marshal(info)
			report("ready " + string(b))
		})
	case strings.HasPrefix(role, "tp-"):
		pc, ok := cc.TPRanks[role]
		if !ok {
			return fail(fmt.Errorf("unknown child role %q", role))
		}
		err = scheduler.RunFollower(ctx, pc, log, func() { report("ready") })
	case role == "detokenizer":
		err = detokenizer.Run(ctx, cc.Detokenizer, log, func() { report("ready") })
	default:
		err = fmt.Errorf("unknown child role %q", role)
	}
	if err != nil {
		log.Error("stopped", zap.Error(err))
		return fail(err)
	}
	return nil
}

// childStopGrace is how long a child may take to stop after SIGTERM:
// tearing down an NCCL communicator can wait on peers that are gone.
const childStopGrace = 5 * time.Second

// exitIfStopStalls ends the process when stopping takes longer than
// childStopGrace; the driver reclaims what it held.
func exitIfStopStalls(ctx context.Context, log *zap.Logger) {
	<-ctx.Done()
	time.Sleep(childStopGrace)
	log.Warn("still stopping; exiting", zap.Duration("after", childStopGrace))
	_ = log.Sync()
	os.Exit(1)
}

// notifyTerm is cancelled by SIGTERM and ignores SIGINT (a terminal's ^C
// reaches the whole process group; the parent shuts children down).
func notifyTerm() (context.Context, context.CancelFunc) {
	signal.Ignore(syscall.SIGINT)
	return signal.NotifyContext(context.Background(), syscall.SIGTERM)
}
