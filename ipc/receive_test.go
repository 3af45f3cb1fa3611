package ipc

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
)

func pair(t *testing.T) (push, pull *zmq.Socket) {
	t.Helper()
	zctx, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = zctx.Term() })
	pull, err = zctx.NewSocket(zmq.PULL)
	if err != nil {
		t.Fatal(err)
	}
	push, err = zctx.NewSocket(zmq.PUSH)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []*zmq.Socket{push, pull} {
		s := s
		if err := s.SetLinger(0); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
	}
	ep := fmt.Sprintf("inproc://receive-%s", t.Name())
	if err := pull.Bind(ep); err != nil {
		t.Fatal(err)
	}
	if err := push.Connect(ep); err != nil {
		t.Fatal(err)
	}
	return push, pull
}

func TestReceiveEachDeliversInOrderAndStopsOnCancel(t *testing.T) {
	push, pull := pair(t)
	for _, m := range []string{"a", "b", "c"} {
		if _, err := push.Send(m, 0); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	var got []string
	done := make(chan error, 1)
	go func() {
		done <- ReceiveEach(ctx, pull, func(b []byte) error {
			got = append(got, string(b))
			if len(got) == 3 {
				cancel()
			}
			return nil
		})
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("ReceiveEach after cancel: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("ReceiveEach did not return after its context ended")
	}
	if fmt.Sprint(got) != "[a b c]" {
		t.Fatalf("got %v, want [a b c]", got)
	}
}

func TestReceiveEachReturnsHandlerError(t *testing.T) {
	push, pull := pair(t)
	if _, err := push.Send("x", 0); err != nil {
		t.Fatal(err)
	}
	stop := errors.New("stop")
	err := ReceiveEach(context.Background(), pull, func([]byte) error { return stop })
	if !errors.Is(err, stop) {
		t.Fatalf("got %v, want the handler's error", err)
	}
}
