// Package peerfd passes file descriptors among the processes of a group on
// one host: how the ranks of a tensor-parallel group hand each other the
// CUDA memory they share (exported as POSIX file descriptors), at start and
// again after every release of that memory.
package peerfd

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"
)

// Group is one process's end: a listening socket in the abstract namespace
// (nothing on disk to clean up), named after the group and the rank.
type Group struct {
	name       string
	rank, size int
	ln         *net.UnixListener
	round      uint32
}

const magic = 0x65626266 // "ebbf"

func address(name string, rank int) *net.UnixAddr {
	return &net.UnixAddr{Name: fmt.Sprintf("@%s-%d", name, rank), Net: "unix"}
}

// Listen opens rank's end of the group name of size processes.
func Listen(name string, rank, size int) (*Group, error) {
	if rank < 0 || rank >= size {
		return nil, fmt.Errorf("peerfd: rank %d of %d", rank, size)
	}
	ln, err := net.ListenUnix("unix", address(name, rank))
	if err != nil {
		return nil, fmt.Errorf("peerfd: listen as rank %d: %w", rank, err)
	}
	return &Group{name: name, rank: rank, size: size, ln: ln}, nil
}

// Close stops listening.
func (g *Group) Close() error { return g.ln.Close() }

// ErrPeerFailed marks a round in which another rank had nothing to share.
var ErrPeerFailed = errors.New("a rank could not share its memory")

// Exchange sends fd to every other rank and returns theirs, by rank (-1 at
// this rank's place); the caller closes them. Every rank calls it the same
// number of times: each call is a round, and a message from another round
// is an error. A rank that failed before it had anything to share passes
// fd -1: the others then get ErrPeerFailed at once rather than waiting for
// it until timeout, and the rounds stay in step.
func (g *Group) Exchange(fd int, timeout time.Duration) ([]int, error) {
	g.round++
	deadline := time.Now().Add(timeout)
	sent := make(chan error, 1)
	go func() { sent <- g.sendAll(fd, deadline) }()

	fds := make([]int, g.size)
	heard := make([]bool, g.size)
	for i := range fds {
		fds[i] = -1
	}
	fail := func(err error) ([]int, error) {
		CloseAll(fds)
		return nil, errors.Join(err, <-sent)
	}
	if err := g.ln.SetDeadline(deadline); err != nil {
		return fail(err)
	}
	var failed []int
	for got := 0; got < g.size-1; got++ {
		c, err := g.ln.AcceptUnix()
		if err != nil {
			return fail(fmt.Errorf("peerfd: rank %d heard from %d of %d ranks (round %d): %w", g.rank, got, g.size-1, g.round, err))
		}
		from, rfd, err := g.receive(c, deadline)
		c.Close()
		if err == nil && (from == g.rank || heard[from]) {
			err = fmt.Errorf("peerfd: rank %d sent twice in round %d", from, g.round)
			if rfd >= 0 {
				syscall.Close(rfd)
			}
		}
		if err != nil {
			return fail(err)
		}
		heard[from], fds[from] = true, rfd
		if rfd < 0 {
			failed = append(failed, from)
		}
	}
	if len(failed) > 0 {
		return fail(fmt.Errorf("peerfd: round %d: ranks %v: %w", g.round, failed, ErrPeerFailed))
	}
	if err := <-sent; err != nil {
		CloseAll(fds)
		return nil, err
	}
	return fds, nil
}

// CloseAll closes the descriptors an Exchange returned (skipping -1).
func CloseAll(fds []int) {
	for _, f := range fds {
		if f >= 0 {
			syscall.Close(f)
		}
	}
}

// sendAll connects to every other rank, retrying while it does not listen
// yet, and sends fd (or that it has none) with this rank and round.
func (g *Group) sendAll(fd int, deadline time.Time) error {
	msg := make([]byte, 16)
	binary.LittleEndian.PutUint32(msg, magic)
	binary.LittleEndian.PutUint32(msg[4:], uint32(g.rank))
	binary.LittleEndian.PutUint32(msg[8:], g.round)
	var rights []byte
	if fd >= 0 {
		binary.LittleEndian.PutUint32(msg[12:], 1)
		rights = syscall.UnixRights(fd)
	}
	var errs []error
	for p := 0; p < g.size; p++ {
		if p == g.rank {
			continue
		}
		c, err := dial(address(g.name, p), deadline)
		if err != nil {
			errs = append(errs, fmt.Errorf("peerfd: rank %d cannot reach rank %d: %w", g.rank, p, err))
			continue
		}
		if err := c.SetDeadline(deadline); err == nil {
			_, _, err = c.WriteMsgUnix(msg, rights, nil)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("peerfd: rank %d sending to rank %d: %w", g.rank, p, err))
		}
		c.Close()
	}
	return errors.Join(errs...)
}

func dial(a *net.UnixAddr, deadline time.Time) (*net.UnixConn, error) {
	for {
		c, err := net.DialUnix("unix", nil, a)
		if err == nil {
			return c, nil
		}
		if time.Now().After(deadline) {
			return nil, err
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// receive reads one message: the sender's rank and its descriptor (-1
// when it had none).
func (g *Group) receive(c *net.UnixConn, deadline time.Time) (int, int, error) {
	if err := c.SetDeadline(deadline); err != nil {
		return 0, -1, err
	}
	msg, oob := make([]byte, 20), make([]byte, syscall.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(msg, oob)
	if err != nil {
		return 0, -1, fmt.Errorf("peerfd: rank %d receiving: %w", g.rank, err)
	}
	var fds []int
	if cms, perr := syscall.ParseSocketControlMessage(oob[:oobn]); perr == nil && len(cms) == 1 {
		fds, _ = syscall.ParseUnixRights(&cms[0])
	}
	has := n == 16 && binary.LittleEndian.Uint32(msg[12:]) == 1
	if n != 16 || binary.LittleEndian.Uint32(msg) != magic || (has && len(fds) != 1) || (!has && len(fds) != 0) {
		CloseAll(fds)
		return 0, -1, fmt.Errorf("peerfd: rank %d got a malformed message (%d bytes, %d descriptors)", g.rank, n, len(fds))
	}
	from, round := int(binary.LittleEndian.Uint32(msg[4:])), binary.LittleEndian.Uint32(msg[8:])
	if from < 0 || from >= g.size || round != g.round {
		CloseAll(fds)
		return 0, -1, fmt.Errorf("peerfd: rank %d got rank %d's round %d during round %d", g.rank, from, round, g.round)
	}
	if !has {
		return from, -1, nil
	}
	return from, fds[0], nil
}
