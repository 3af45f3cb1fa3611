package scheduler

import (
	"context"
	"testing"
	"time"
)

func TestStepWatch(t *testing.T) {
	const timeout = 200 * time.Millisecond
	for _, tc := range []struct {
		name  string
		steps []time.Duration // run one after another, a millisecond apart
		fires bool
	}{
		{"idle", nil, false},
		{"short steps", []time.Duration{10 * time.Millisecond, 50 * time.Millisecond, 20 * time.Millisecond, 10 * time.Millisecond}, false},
		{"a step that never ends", []time.Duration{10 * time.Millisecond, time.Hour}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var w stepWatch
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			fired := make(chan time.Duration, 1)
			done := make(chan struct{})
			go func() { defer close(done); w.watch(ctx, timeout, func(took time.Duration) { fired <- took }) }()
			end := make(chan struct{})
			go func() {
				for _, d := range tc.steps {
					w.begin()
					select {
					case <-time.After(d):
					case <-ctx.Done():
						return
					}
					w.end()
					time.Sleep(time.Millisecond)
				}
				close(end)
			}()
			select {
			case took := <-fired:
				if !tc.fires {
					t.Fatalf("fired after %v", took)
				}
				if took <= timeout {
					t.Fatalf("fired after %v, before the %v timeout", took, timeout)
				}
				<-done // watch returns once it has fired
			case <-end:
				if tc.fires {
					t.Fatal("the steps ended")
				}
				time.Sleep(3 * timeout) // nothing runs now: it must not fire
				select {
				case took := <-fired:
					t.Fatalf("fired after %v between steps", took)
				default:
				}
				cancel()
				<-done
			case <-time.After(5 * time.Second):
				t.Fatal("neither fired nor ended")
			}
		})
	}
}
