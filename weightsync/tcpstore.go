package weightsync

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"
)

// TCPStore speaks the client side of PyTorch's c10d TCPStore (torch 2.x,
// the libuv server that rank 0 of torch.distributed's tcp:// rendezvous
// starts): little-endian framing of a query byte, 8-byte lengths and raw
// bytes. ebb uses it to join a trainer's process group as one more rank.
type TCPStore struct {
	conn    net.Conn
	timeout time.Duration
}

// TCPStore query types (c10d::detail::QueryType).
const (
	qValidate   = 0
	qSet        = 1
	qGet        = 3
	qAdd        = 4
	qCheck      = 5
	qGetNumKeys = 7
)

// validationMagic is c10d's validationMagicNumber.
const validationMagic = 0x3C85F7CE

// keyPrefix is what TCPStore puts before every key a Store user names
// (the rendezvous's own "init/" key is sent as it is).
const keyPrefix = "/"

// DialTCPStore connects to a store, retrying until timeout (the trainer
// may start its server after asking ebb to join).
func DialTCPStore(ctx context.Context, addr string, timeout time.Duration) (*TCPStore, error) {
	deadline := time.Now().Add(timeout)
	var conn net.Conn
	var err error
	for {
		d := net.Dialer{Timeout: time.Until(deadline)}
		conn, err = d.DialContext(ctx, "tcp", addr)
		if err == nil {
			break
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return nil, fmt.Errorf("connect to the trainer's TCPStore at %s: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	s := &TCPStore{conn: conn, timeout: timeout}
	var b frame
	b.query(qValidate)
	b.u32(validationMagic)
	if err := s.send(b); err != nil {
		conn.Close()
		return nil, err
	}
	return s, nil
}

// Close ends the connection.
func (s *TCPStore) Close() error { return s.conn.Close() }

type frame []byte

func (b *frame) query(q byte) { *b = append(*b, q) }
func (b *frame) u32(v uint32) { *b = binary.LittleEndian.AppendUint32(*b, v) }
func (b *frame) u64(v uint64) { *b = binary.LittleEndian.AppendUint64(*b, v) }
func (b *frame) bytes(v []byte) {
	b.u64(uint64(len(v)))
	*b = append(*b, v...)
}

func (s *TCPStore) send(b frame) error {
	_ = s.conn.SetDeadline(time.Now().Add(s.timeout))
	if _, err := s.conn.Write(b); err != nil {
		return fmt.Errorf("TCPStore: %w", err)
	}
	return nil
}

func (s *TCPStore) read(n int) ([]byte, error) {
	b := make([]byte, n)
	if _, err := io.ReadFull(s.conn, b); err != nil {
		return nil, fmt.Errorf("TCPStore: %w", err)
	}
	return b, nil
}

// AddRaw adds delta to the integer at key (sent without the key prefix)
// and returns the new value.
func (s *TCPStore) AddRaw(key string, delta int64) (int64, error) {
	var b frame
	b.query(qAdd)
	b.bytes([]byte(key))
	b.u64(uint64(delta))
	if err := s.send(b); err != nil {
		return 0, err
	}
	v, err := s.read(8)
	if err != nil {
		return 0, err
	}
	return int64(binary.LittleEndian.Uint64(v)), nil
}

// Set stores value at key.
func (s *TCPStore) Set(key string, value []byte) error {
	var b frame
	b.query(qSet)
	b.bytes([]byte(keyPrefix + key))
	b.bytes(value)
	return s.send(b)
}

// Check reports whether key is set.
func (s *TCPStore) Check(key string) (bool, error) {
	var b frame
	b.query(qCheck)
	b.u64(1)
	b.bytes([]byte(keyPrefix + key))
	if err := s.send(b); err != nil {
		return false, err
	}
	v, err := s.read(1)
	if err != nil {
		return false, err
	}
	return v[0] == 0, nil // READY
}

// Get returns the value at key, which must be set.
func (s *TCPStore) Get(key string) ([]byte, error) {
	var b frame
	b.query(qGet)
	b.bytes([]byte(keyPrefix + key))
	if err := s.send(b); err != nil {
		return nil, err
	}
	n, err := s.read(8)
	if err != nil {
		return nil, err
	}
	size := binary.LittleEndian.Uint64(n)
	if size > 1<<20 {
		return nil, fmt.Errorf("TCPStore: value of %d bytes", size)
	}
	return s.read(int(size))
}

// WaitAny polls until one of keys is set and returns it with its value.
func (s *TCPStore) WaitAny(ctx context.Context, keys []string, timeout time.Duration) (string, []byte, error) {
	deadline := time.Now().Add(timeout)
	for {
		for _, k := range keys {
			ok, err := s.Check(k)
			if err != nil {
				return "", nil, err
			}
			if ok {
				v, err := s.Get(k)
				return k, v, err
			}
		}
		if ctx.Err() != nil {
			return "", nil, ctx.Err()
		}
		if time.Now().After(deadline) {
			return "", nil, fmt.Errorf("none of %q was set within %v", keys, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// JoinGroup is ebb's side of init_custom_process_group (SGLang's, which
// verl, slime and AReaL copy): it counts itself into the rendezvous that
// rank 0 waits on ("init/"), and returns the store.
func JoinGroup(ctx context.Context, host string, port int, timeout time.Duration) (*TCPStore, error) {
	s, err := DialTCPStore(ctx, net.JoinHostPort(host, strconv.Itoa(port)), timeout)
	if err != nil {
		return nil, err
	}
	if _, err := s.AddRaw("init/", 1); err != nil {
		s.Close()
		return nil, fmt.Errorf("join the rendezvous: %w", err)
	}
	return s, nil
}

// NCCLIDKeys are where ProcessGroupNCCL's rank 0 publishes the unique id
// of its n-th communicator in a group made by init_custom_process_group:
// the group's PrefixStore, then _new_process_group_helper's "<group>/",
// then the backend's "<device>/" (torch 2.x; older releases lack the last).
func NCCLIDKeys(group string, n int) []string {
	k := strconv.Itoa(n)
	return []string{group + "/" + group + "//cuda//" + k, group + "/" + group + "//" + k}
}

// NCCLUniqueID waits for the trainer's first collective on the group to
// publish the NCCL unique id.
func (s *TCPStore) NCCLUniqueID(ctx context.Context, group string, timeout time.Duration) ([128]byte, error) {
	var id [128]byte
	_, v, err := s.WaitAny(ctx, NCCLIDKeys(group, 0), timeout)
	if err != nil {
		return id, fmt.Errorf("the trainer did not publish its NCCL id (it starts a collective on the group, e.g. the first broadcast): %w", err)
	}
	if len(v) != len(id) {
		return id, errors.New("the NCCL id in the store is not 128 bytes")
	}
	copy(id[:], v)
	return id, nil
}
