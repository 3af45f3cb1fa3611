package ipc

import (
	"fmt"

	zmq "github.com/pebbe/zmq4"
)

// Pipe opens what a middle process of ebb needs: a PULL socket bound at
// in and a PUSH socket connected to out, neither lingering at close. The
// caller closes both (before terminating zctx).
func Pipe(zctx *zmq.Context, in, out string) (pull, push *zmq.Socket, err error) {
	if pull, err = zctx.NewSocket(zmq.PULL); err != nil {
		return nil, nil, err
	}
	if push, err = zctx.NewSocket(zmq.PUSH); err != nil {
		pull.Close()
		return nil, nil, err
	}
	fail := func(e error) (*zmq.Socket, *zmq.Socket, error) {
		pull.Close()
		push.Close()
		return nil, nil, e
	}
	for _, s := range []*zmq.Socket{pull, push} {
		if err := s.SetLinger(0); err != nil {
			return fail(err)
		}
	}
	if err := pull.Bind(in); err != nil {
		return fail(fmt.Errorf("bind %s: %w", in, err))
	}
	if err := push.Connect(out); err != nil {
		return fail(fmt.Errorf("connect %s: %w", out, err))
	}
	return pull, push, nil
}
