package launcher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"go.uber.org/zap"

	"ebb/engine"
	"ebb/scheduler"
)

// Followers are ranks 1.. of a tensor-parallel engine whose rank 0 runs in
// the calling process (`ebb bench one-batch`), as child processes of the
// same binary, placed as `ebb serve` places them.
type Followers struct {
	// Leader is rank 0's placement: open it with scheduler.OpenTPLeader.
	Leader scheduler.ProcessConfig

	dir      string
	log      *zap.Logger
	cancel   context.CancelFunc
	started  chan startedFollowers
	failed   chan error
	stopping chan struct{}
	once     sync.Once
	waited   bool // started has been read
	children []*child
}

type startedFollowers struct {
	children []*child
	err      error
}

// StartFollowers starts ranks 1.. of an engine with e's settings, the
// first GPU e.GPU. They wait for rank 0 to join their collective: open it
// with Leader, then call Wait.
func StartFollowers(ctx context.Context, exe string, e engine.Config, logLevel string, log *zap.Logger) (*Followers, error) {
	e.Defaults()
	if e.TPSize <= 1 {
		return nil, errors.New("followers need --tp-size 2 or more")
	}
	dir, err := os.MkdirTemp("", "ebb-tp-")
	if err != nil {
		return nil, err
	}
	ep := func(name string) string { return "ipc://" + filepath.Join(dir, name) }
	cc := ChildConfig{TPRanks: map[string]scheduler.ProcessConfig{}, LogLevel: logLevel}
	leader, roles := placeTPRanks(e, 0, ep, cc.TPRanks, nil)
	b, err := json.Marshal(cc)
	if err == nil {
		err = os.WriteFile(filepath.Join(dir, childConfigFile), b, 0o600)
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	f := &Followers{Leader: scheduler.ProcessConfig{Engine: e, TP: leader}, dir: dir, log: log, cancel: cancel,
		started: make(chan startedFollowers, 1), failed: make(chan error, 1), stopping: make(chan struct{})}
	go func() {
		children, err := startChildren(ctx, exe, roles, dir, log)
		f.started <- startedFollowers{children, err}
	}()
	return f, nil
}

// Wait returns once every follower is ready; after that, Failed reports
// the first one to stop.
func (f *Followers) Wait() error {
	s := <-f.started
	f.waited = true
	if s.err != nil {
		return fmt.Errorf("tensor-parallel ranks: %w", s.err)
	}
	f.children = s.children
	exited := firstExit(f.children)
	go func() {
		select {
		case err := <-exited:
			f.failed <- err
		case <-f.stopping:
		}
	}()
	return nil
}

// Failed reports a follower that stopped before Stop.
func (f *Followers) Failed() <-chan error { return f.failed }

// Stop stops the followers (or their start) and removes their directory.
func (f *Followers) Stop() {
	f.once.Do(func() {
		close(f.stopping)
		f.cancel()
		if !f.waited {
			if s := <-f.started; s.err == nil {
				f.children = s.children
			}
		}
		stopChildren(f.children, f.log)
		os.RemoveAll(f.dir)
	})
}
