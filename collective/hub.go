// Package collective adds up tensor-parallel partial sums between the rank
// processes of one engine on the CPU backend: rank 0 is a hub that gathers
// every rank's tensor over ZeroMQ, sums them in rank order (so every rank
// holds the same bits) and sends the sum back; it also gathers the ranks'
// parts of the vocabulary-parallel logits. On a GPU, cuda's all-reduce
// kernel or NCCL does this.
package collective

import (
	"encoding/binary"
	"fmt"
	"math"
	"strconv"
	"time"

	zmq "github.com/pebbe/zmq4"

	"ebb/device"
	"ebb/device/cpu"
)

// Hub is one rank's end of the hub. It is used by one goroutine (the one
// running the model) and is a device.Collective with a sticky error.
type Hub struct {
	rank, size int
	zctx       *zmq.Context
	sock       *zmq.Socket
	timeout    time.Duration
	err        error
}

// NewHub joins the hub at endpoint (rank 0 binds it, the others connect).
// A rank that waits longer than timeout for the others fails the call.
func NewHub(rank, size int, endpoint string, timeout time.Duration) (*Hub, error) {
	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, err
	}
	h := &Hub{rank: rank, size: size, zctx: zctx, timeout: timeout}
	kind := zmq.DEALER
	if rank == 0 {
		kind = zmq.ROUTER
	}
	if h.sock, err = zctx.NewSocket(kind); err == nil {
		err = h.open(endpoint)
	}
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("tensor-parallel hub %s (rank %d): %w", endpoint, rank, err)
	}
	return h, nil
}

func (h *Hub) open(endpoint string) error {
	if err := h.sock.SetLinger(0); err != nil {
		return err
	}
	if err := h.sock.SetRcvtimeo(h.timeout); err != nil {
		return err
	}
	if h.rank == 0 {
		return h.sock.Bind(endpoint)
	}
	if err := h.sock.SetIdentity(strconv.Itoa(h.rank)); err != nil {
		return err
	}
	return h.sock.Connect(endpoint)
}

// Close releases the socket.
func (h *Hub) Close() {
	if h.sock != nil {
		h.sock.Close()
	}
	h.zctx.Term()
}

// Err reports the first failure.
func (h *Hub) Err() error { return h.err }

// AllReduceSum implements device.Collective for float32 CPU tensors.
func (h *Hub) AllReduceSum(t device.Tensor) {
	if !h.check("all-reduce", t) {
		return
	}
	x := cpu.F32(t)
	h.round("all-reduce", x, x, func(parts [][]float32) error {
		for _, p := range parts[1:] {
			for i := range x {
				x[i] += p[i]
			}
		}
		return nil
	})
}

// AllGatherColumns implements device.Collective for float32 CPU tensors.
func (h *Hub) AllGatherColumns(full, local device.Tensor) {
	if !h.check("all-gather", full, local) {
		return
	}
	rows := local.Dim(0)
	cols := local.Numel() / max(rows, 1)
	if full.Numel() != h.size*local.Numel() || full.Dim(0) != rows {
		h.err = fmt.Errorf("all-gather of %v into %v over %d ranks", local.Shape, full.Shape, h.size)
		return
	}
	f := cpu.F32(full)
	h.round("all-gather", cpu.F32(local), f, func(parts [][]float32) error {
		for r, p := range parts {
			for i := range rows {
				copy(f[(i*h.size+r)*cols:(i*h.size+r+1)*cols], p[i*cols:(i+1)*cols])
			}
		}
		return nil
	})
}

func (h *Hub) check(op string, ts ...device.Tensor) bool {
	for _, t := range ts {
		if h.err == nil && t.DType != device.F32 {
			h.err = fmt.Errorf("%s of %s: the CPU backend computes in float32", op, t.DType)
		}
	}
	return h.err == nil
}

// round sends part to rank 0, which combines every rank's (parts in rank
// order, its own first) into result and sends result back to each; the
// other ranks receive it into result.
func (h *Hub) round(op string, part, result []float32, combine func(parts [][]float32) error) {
	if h.err != nil {
		return
	}
	if h.rank == 0 {
		h.err = h.gather(part, result, combine)
	} else {
		h.err = h.exchange(part, result)
	}
	if h.err != nil {
		h.err = fmt.Errorf("tensor-parallel %s (rank %d of %d): %w", op, h.rank, h.size, h.err)
	}
}

// gather is rank 0's side: every other rank's part, the result combined,
// the result back to each.
func (h *Hub) gather(part, result []float32, combine func(parts [][]float32) error) error {
	parts := make([][]float32, h.size)
	parts[0] = part
	ids := make([]string, h.size)
	for range h.size - 1 {
		msg, err := h.sock.RecvMessageBytes(0)
		if err != nil {
			return err
		}
		if len(msg) != 2 {
			return fmt.Errorf("a message of %d frames", len(msg))
		}
		r, err := strconv.Atoi(string(msg[0]))
		if err != nil || r <= 0 || r >= h.size || parts[r] != nil {
			return fmt.Errorf("a part from unknown rank %q", msg[0])
		}
		if len(msg[1]) != 4*len(part) {
			return fmt.Errorf("rank %d sent %d bytes for %d values", r, len(msg[1]), len(part))
		}
		parts[r], ids[r] = decode(msg[1]), string(msg[0])
	}
	if err := combine(parts); err != nil {
		return err
	}
	b := encode(result)
	for r := 1; r < h.size; r++ {
		if _, err := h.sock.SendMessage(ids[r], b); err != nil {
			return err
		}
	}
	return nil
}

// exchange is the other ranks' side: the part out, the result back.
func (h *Hub) exchange(part, result []float32) error {
	if _, err := h.sock.SendBytes(encode(part), 0); err != nil {
		return err
	}
	b, err := h.sock.RecvBytes(0)
	if err != nil {
		return err
	}
	if len(b) != 4*len(result) {
		return fmt.Errorf("a result of %d bytes for %d values", len(b), len(result))
	}
	copy(result, decode(b))
	return nil
}

func encode(x []float32) []byte {
	b := make([]byte, 4*len(x))
	for i, v := range x {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	return b
}

func decode(b []byte) []float32 {
	x := make([]float32, len(b)/4)
	for i := range x {
		x[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return x
}
