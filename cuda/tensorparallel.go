package cuda

import (
	"errors"
	"fmt"
	"os"
	"time"

	"ebb/device"
)

var _ device.CollectiveJoiner = (*Device)(nil)

// NewCollectiveID implements device.CollectiveJoiner: rank 0 calls it.
// Where every GPU of the host can map every other's memory, the group adds
// up through peer memory (peerAllReduce: no communicator whose memory
// stays after a release); otherwise, or with EBB_TP_ALLREDUCE=nccl, it
// joins an NCCL communicator, and rank 0's process answers the other
// ranks' bootstrap until they have joined.
func (d *Device) NewCollectiveID() ([128]byte, error) {
	if os.Getenv("EBB_TP_ALLREDUCE") != "nccl" && d.ctx.peerAccessible() {
		return newPeerID()
	}
	return NCCLUniqueID()
}

// JoinCollective implements device.CollectiveJoiner. Either way the
// all-reduces are queued with the model's kernels on the device's stream
// and captured into the decode graphs with them. A rank that dies is not
// waited for here: the launcher stops the whole group.
func (d *Device) JoinCollective(id [128]byte, nranks, rank int) (device.Collective, error) {
	if isPeerID(id) {
		if d.peers != nil {
			return nil, errors.New("this GPU is in a tensor-parallel group already")
		}
		p, err := d.joinPeerAllReduce(id, nranks, rank)
		if err != nil {
			return nil, fmt.Errorf("tensor-parallel rank %d of %d: %w", rank, nranks, err)
		}
		d.peers = p
		return p, nil
	}
	cm, err := d.ctx.initComm(id, nranks, rank, true)
	if err != nil {
		if v, verr := NCCLVersion(); verr == nil {
			err = fmt.Errorf("%w (NCCL %d.%d.%d)", err, v/10000, v%10000/100, v%100)
		}
		return nil, fmt.Errorf("tensor-parallel rank %d of %d: %w", rank, nranks, err)
	}
	return &tpComm{d: d, cm: cm}, nil
}

// setNCCLDefaults keeps NVLink multicast (NVLS) off unless the user asks
// for it (NCCL reads it at each communicator's start): creating multicast
// objects can take a shared host's GPUs out of service, and the small
// all-reduces of decoding gain nothing from it.
func setNCCLDefaults() {
	if _, ok := os.LookupEnv("NCCL_NVLS_ENABLE"); !ok {
		_ = os.Setenv("NCCL_NVLS_ENABLE", "0")
	}
}

// tpComm is a tensor-parallel group's all-reduce; its error is sticky and
// also fails the device, so the step that needed the sum reports it.
type tpComm struct {
	d   *Device
	cm  *Comm
	err error
}

// AllReduceSum implements device.Collective.
func (t *tpComm) AllReduceSum(x device.Tensor) {
	if t.err != nil {
		return
	}
	if err := t.cm.AllReduceSum(x); err != nil {
		t.err = fmt.Errorf("tensor-parallel all-reduce (rank %d of %d): %w", t.cm.Rank, t.cm.Size, err)
		t.d.fail(t.err)
	}
}

// AllGatherColumns implements device.Collective: NCCL's all-gather puts
// the ranks' parts one after another, so each rank lays its part into
// zeros at its columns and the ranks add (x + 0 is x).
func (t *tpComm) AllGatherColumns(full, local device.Tensor) {
	if t.err != nil {
		return
	}
	if err := gatherShapes(full, local, t.cm.Size); err != nil {
		t.err = err
		t.d.fail(err)
		return
	}
	rows, size := int64(local.Dim(0)), int64(local.DType.Size())
	cols := int64(local.Dim(1)) * size / 2
	t.d.Fill(full, 0)
	t.d.launch("copy_cols_u16", gridFor(rows*cols), D1(256), 0, P(full.Ptr), P(local.Ptr), uint64(rows), uint64(cols),
		uint64(int64(t.cm.Size)*cols), uint64(int64(t.cm.Rank)*cols))
	t.AllReduceSum(full)
}

// Err implements device.Collective.
func (t *tpComm) Err() error { return t.err }

// Close tears the communicator down, giving up after commAbortWait: an
// abort can wait on peers that stopped first, and a stopping rank must not.
func (t *tpComm) Close() {
	done := make(chan struct{})
	go func() { // NCCL picks the device itself: no context needed here
		t.cm.Abort()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(commAbortWait):
	}
}

const commAbortWait = 2 * time.Second
