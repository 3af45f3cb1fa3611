package scheduler

import (
	"context"
	"os"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// DefaultWatchdogTimeout is SGLang's --watchdog-timeout.
const DefaultWatchdogTimeout = 300 * time.Second

// ExitWatchdog is the status of a process its watchdog stopped.
const ExitWatchdog = 3

// stepWatch tells a watchdog when the step in flight began. A step that
// never ends (a GPU that hangs, a tensor-parallel peer that stopped
// answering inside an all-reduce, whose kernel waits on it forever) leaves
// the scheduler's goroutine blocked where nothing else can reach it; as
// SGLang's scheduler does, the process then stops itself, and the launcher
// stops the rest and exits with the error, instead of every client waiting.
type stepWatch struct {
	since atomic.Int64 // unix nanoseconds; 0 between steps
}

func (w *stepWatch) begin() { w.since.Store(time.Now().UnixNano()) }
func (w *stepWatch) end()   { w.since.Store(0) }

// running is how long the step in flight has run (false between steps).
func (w *stepWatch) running(now time.Time) (time.Duration, bool) {
	s := w.since.Load()
	if s == 0 {
		return 0, false
	}
	return now.Sub(time.Unix(0, s)), true
}

// watch calls fire once a step has run longer than timeout, then returns;
// it also returns when ctx ends. It looks four times a timeout (at most
// every 5 s), so a hang is reported within 1.25 timeouts.
func (w *stepWatch) watch(ctx context.Context, timeout time.Duration, fire func(took time.Duration)) {
	tick := time.NewTicker(min(max(timeout/4, time.Millisecond), 5*time.Second))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			if took, ok := w.running(now); ok && took > timeout {
				fire(took)
				return
			}
		}
	}
}

// startWatchdog stops this process (status 3) when a step runs longer than
// timeout (DefaultWatchdogTimeout when 0).
func startWatchdog(ctx context.Context, w *stepWatch, timeout time.Duration, log *zap.Logger) {
	if timeout <= 0 {
		timeout = DefaultWatchdogTimeout
	}
	go w.watch(ctx, timeout, func(took time.Duration) {
		log.Error("watchdog: a step has not finished; stopping the process",
			zap.Duration("running", took.Round(time.Millisecond)), zap.Duration("watchdog_timeout", timeout))
		_ = log.Sync()
		os.Exit(ExitWatchdog)
	})
}
