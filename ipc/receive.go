// Package ipc holds what ebb's processes share about their ZeroMQ sockets.
package ipc

import (
	"context"
	"errors"
	"fmt"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// pollInterval bounds how long one receive blocks, so that a loop notices
// cancellation of its context without a second goroutine touching the socket.
const pollInterval = 100 * time.Millisecond

// ReceiveEach receives messages on sock and hands each to handle, until ctx
// ends or the ZeroMQ context is terminated (both return nil). The caller's
// goroutine must be the socket's only user. An error from handle stops the
// loop and is returned as is.
func ReceiveEach(ctx context.Context, sock *zmq.Socket, handle func([]byte) error) error {
	if err := sock.SetRcvtimeo(pollInterval); err != nil {
		return err
	}
	for ctx.Err() == nil {
		b, err := sock.RecvBytes(0)
		if err != nil {
			errno := zmq.AsErrno(err)
			switch {
			case errors.Is(errno, zmq.Errno(11)): // EAGAIN: the receive timed out
				continue
			case ctx.Err() != nil, errno == zmq.ETERM:
				return nil
			}
			return fmt.Errorf("receive: %w", err)
		}
		if err := handle(b); err != nil {
			return err
		}
	}
	return nil
}
