package scheduler

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"time"
	"unsafe"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"

	"ebb/collective"
	"ebb/device"
	"ebb/engine"
	"ebb/ioschema"
	"ebb/ipc"
	"ebb/runner"
)

// TPConfig places one rank of a tensor-parallel engine. Rank 0 (the
// leader) schedules: it sends every step, and every control request, to
// the other ranks, which run them on their shard of the model; the ranks
// add their partial sums through the hub at HubEndpoint.
type TPConfig struct {
	Rank        int
	HubEndpoint string
	// AckEndpoint is bound by the leader (PULL) for the others' replies.
	AckEndpoint string
	// StepEndpoints are the other ranks' inputs, in rank order (leader);
	// a follower binds StepEndpoints[0].
	StepEndpoints []string
}

// tpMessage is what the leader sends its followers, in order. On GPUs the
// first one carries the collective id the ranks join with (a peer-memory
// group's or NCCL's).
type tpMessage struct {
	Seqs         []wireStep `msgpack:"seqs,omitempty"`
	Control      []byte     `msgpack:"control,omitempty"` // an ioschema message
	CollectiveID []byte     `msgpack:"collective_id,omitempty"`
}

// wireStep is a runner.SeqStep with its int32 lists as raw little-endian
// bytes: msgpack copies those in one piece, where a list of ints costs a
// call per element, and a step of 256 sequences carries every KV slot of
// each (ebb runs on little-endian machines only: x86-64 and arm64).
type wireStep struct {
	Tokens     []byte               `msgpack:"t"`
	Start      int                  `msgpack:"s"`
	Slots      []byte               `msgpack:"k"`
	Sample     bool                 `msgpack:"m"`
	Params     runner.SampleParams  `msgpack:"p"`
	Draw       int                  `msgpack:"d"`
	Adjust     []runner.LogitAdjust `msgpack:"a,omitempty"`
	NextTokens []byte               `msgpack:"n,omitempty"`
	Follows    int                  `msgpack:"f,omitempty"`
}

func toWire(seqs []runner.SeqStep) []wireStep {
	out := make([]wireStep, len(seqs))
	for i, q := range seqs {
		out[i] = wireStep{Tokens: int32Bytes(q.Tokens), Start: q.Start, Slots: int32Bytes(q.Slots), Sample: q.Sample,
			Params: q.Params, Draw: q.Draw, Adjust: q.Adjust, NextTokens: int32Bytes(q.NextTokens), Follows: q.Follows}
	}
	return out
}

func fromWire(ws []wireStep) ([]runner.SeqStep, error) {
	out := make([]runner.SeqStep, len(ws))
	for i, w := range ws {
		q := runner.SeqStep{Start: w.Start, Sample: w.Sample, Params: w.Params, Draw: w.Draw, Adjust: w.Adjust, Follows: w.Follows}
		var err error
		if q.Tokens, err = bytesInt32(w.Tokens); err == nil {
			if q.Slots, err = bytesInt32(w.Slots); err == nil {
				q.NextTokens, err = bytesInt32(w.NextTokens)
			}
		}
		if err != nil {
			return nil, fmt.Errorf("sequence %d of the step: %w", i, err)
		}
		out[i] = q
	}
	return out, nil
}

func int32Bytes(v []int32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v))
}

func bytesInt32(b []byte) ([]int32, error) {
	if len(b)%4 != 0 {
		return nil, fmt.Errorf("%d bytes of int32s", len(b))
	}
	if len(b) == 0 {
		return nil, nil
	}
	v := make([]int32, len(b)/4)
	copy(int32Bytes(v), b)
	return v, nil
}

// hubTimeout bounds waiting on the other ranks inside one step.
const hubTimeout = 10 * time.Minute

// openServer opens this process's engine and its scheduler state; the
// caller closes the engine (closeEngine). A tensor-parallel rank joins its
// group once the device is open: the CPU backend through the hub, a GPU
// through NCCL, whose id rank 0 makes and shares (share) and the others
// wait for (await).
func openServer(cfg ProcessConfig, log *zap.Logger, share func(id [128]byte) error, await func() ([128]byte, error)) (*Server, error) {
	e, err := openRank(cfg, share, await)
	if err != nil {
		return nil, err
	}
	s, err := NewServer(e, log)
	if err != nil {
		closeEngine(e, log)
		return nil, err
	}
	s.dpRank = cfg.DPRank
	if cfg.TP != nil {
		s.tpRank = cfg.TP.Rank
	}
	return s, nil
}

func openRank(cfg ProcessConfig, share func(id [128]byte) error, await func() ([128]byte, error)) (*engine.Engine, error) {
	ec := cfg.Engine
	if ec.TPSize <= 1 {
		return engine.Open(ec)
	}
	if cfg.TP == nil {
		return nil, errors.New("a tensor-parallel rank without its placement")
	}
	rank := cfg.TP.Rank
	ec.TPRank = rank
	ec.Collective = func(dev device.Device) (device.Collective, error) {
		j, ok := dev.(device.CollectiveJoiner)
		if !ok {
			return collective.NewHub(rank, ec.TPSize, cfg.TP.HubEndpoint, hubTimeout)
		}
		var id [128]byte
		var err error
		if rank == 0 {
			if id, err = j.NewCollectiveID(); err == nil {
				err = share(id)
			}
		} else {
			id, err = await()
		}
		if err != nil {
			return nil, fmt.Errorf("sharing the collective id: %w", err)
		}
		return j.JoinCollective(id, ec.TPSize, rank)
	}
	return engine.Open(ec)
}

// OpenTPLeader opens rank 0 of a tensor-parallel engine without a
// scheduler loop (`ebb bench one-batch`): every step its runner launches
// goes to the followers at cfg.TP too, which run it on their shards. The
// returned func closes the engine, then the links.
func OpenTPLeader(cfg ProcessConfig) (*engine.Engine, func() error, error) {
	if cfg.TP == nil || cfg.Engine.TPSize <= 1 {
		return nil, nil, errors.New("a tensor-parallel leader needs --tp-size 2 or more and its placement")
	}
	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, nil, err
	}
	leader, err := newTPLeader(zctx, cfg.TP)
	if err != nil {
		zctx.Term()
		return nil, nil, err
	}
	e, err := openRank(cfg, leader.shareCollectiveID, nil)
	if err != nil {
		leader.close()
		zctx.Term()
		return nil, nil, err
	}
	e.Runner.Mirror = leader.sendStep
	return e, func() error {
		err := e.Close()
		leader.close()
		zctx.Term()
		return err
	}, nil
}

// tpLeader is rank 0's link to its followers; the scheduler loop's
// goroutine is its only user.
type tpLeader struct {
	steps []*zmq.Socket
	acks  *zmq.Socket
}

func newTPLeader(zctx *zmq.Context, cfg *TPConfig) (*tpLeader, error) {
	l := &tpLeader{}
	if err := l.open(zctx, cfg); err != nil {
		l.close() // the context's Term would wait for what was opened
		return nil, err
	}
	return l, nil
}

func (l *tpLeader) open(zctx *zmq.Context, cfg *TPConfig) error {
	var err error
	if l.acks, err = zctx.NewSocket(zmq.PULL); err != nil {
		return err
	}
	if err := l.acks.SetRcvtimeo(hubTimeout); err != nil {
		return err
	}
	if err := l.acks.Bind(cfg.AckEndpoint); err != nil {
		return fmt.Errorf("bind %s: %w", cfg.AckEndpoint, err)
	}
	for _, ep := range cfg.StepEndpoints {
		s, err := zctx.NewSocket(zmq.PUSH)
		if err != nil {
			return err
		}
		l.steps = append(l.steps, s)
		if err := s.Connect(ep); err != nil {
			return fmt.Errorf("connect %s: %w", ep, err)
		}
	}
	return nil
}

func (l *tpLeader) close() {
	for _, s := range append(l.steps, l.acks) {
		if s != nil {
			_ = s.SetLinger(0)
			s.Close()
		}
	}
}

func (l *tpLeader) send(m tpMessage) error {
	b, err := msgpack.Marshal(&m)
	if err != nil {
		return err
	}
	for _, s := range l.steps {
		if _, err := s.SendBytes(b, 0); err != nil {
			return err
		}
	}
	return nil
}

// shareCollectiveID sends the followers the id of the collective to join,
// their first message.
func (l *tpLeader) shareCollectiveID(id [128]byte) error {
	return l.send(tpMessage{CollectiveID: id[:]})
}

// sendStep is the runner's Mirror.
func (l *tpLeader) sendStep(seqs []runner.SeqStep) error {
	return l.send(tpMessage{Seqs: toWire(seqs)})
}

// control sends a control request to every follower.
func (l *tpLeader) control(m ioschema.Message) error {
	b, err := ioschema.Encode(m)
	if err != nil {
		return err
	}
	return l.send(tpMessage{Control: b})
}

// replies collects every follower's reply to the control request sent last.
func (l *tpLeader) replies() ([]ioschema.Message, error) {
	var out []ioschema.Message
	for range l.steps {
		b, err := l.acks.RecvBytes(0)
		if err != nil {
			return out, fmt.Errorf("a tensor-parallel rank did not answer: %w", err)
		}
		m, err := ioschema.Decode(b)
		if err != nil {
			return out, err
		}
		out = append(out, m)
	}
	return out, nil
}

// mergeRankReplies marks the leader's reply failed when a follower's was,
// naming the rank and its reason.
func mergeRankReplies(reply ioschema.Message, followers []ioschema.Message, err error) ioschema.Message {
	var failed []string
	if err != nil {
		failed = append(failed, err.Error())
	}
	if r, ok := reply.(interface{ ResultPtr() *ioschema.Result }); ok {
		for i, f := range followers {
			d := ioschema.Detail(f)
			d["tp_rank"] = i + 1
			r.ResultPtr().TPRanks = append(r.ResultPtr().TPRanks, d)
		}
	}
	for i, f := range followers {
		switch f := f.(type) {
		case *ioschema.ErrorOutput:
			failed = append(failed, fmt.Sprintf("tp rank %d: %s", i+1, f.Message))
		case interface{ ResultPtr() *ioschema.Result }:
			if r := f.ResultPtr(); !r.Success {
				failed = append(failed, fmt.Sprintf("tp rank %d: %s", i+1, r.Message))
			}
		}
	}
	if len(failed) == 0 {
		return reply
	}
	switch r := reply.(type) {
	case *ioschema.ErrorOutput:
		r.Message += "; " + joinStrings(failed)
	case interface{ ResultPtr() *ioschema.Result }:
		res := r.ResultPtr()
		res.Success = false
		res.Message = joinStrings(append([]string{res.Message}, failed...))
	}
	return reply
}

// joinStrings joins the non-empty ones.
func joinStrings(s []string) string {
	return strings.Join(slices.DeleteFunc(slices.Clone(s), func(x string) bool { return x == "" }), "; ")
}

// RunFollower is the body of a tensor-parallel rank other than 0: it runs
// the steps and control requests its leader sends, on its shard, and
// answers the control requests.
func RunFollower(ctx context.Context, cfg ProcessConfig, log *zap.Logger, ready func()) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if cfg.TP == nil || len(cfg.TP.StepEndpoints) != 1 {
		return errors.New("a tensor-parallel follower needs its step endpoint")
	}
	zctx, err := zmq.NewContext()
	if err != nil {
		return err
	}
	defer zctx.Term()
	in, ack, err := ipc.Pipe(zctx, cfg.TP.StepEndpoints[0], cfg.TP.AckEndpoint)
	if err != nil {
		return err
	}
	defer in.Close()
	defer ack.Close()
	s, err := openServer(cfg, log, nil, func() ([128]byte, error) { return awaitCollectiveID(in) })
	if err != nil {
		return err
	}
	e := s.e
	defer closeEngine(e, log)
	replies := make(chan outgoing, 64)
	s.out = replies
	ready()
	startWatchdog(ctx, &s.watch, cfg.Engine.WatchdogTimeout, log)
	// Steps overlap as on the leader: the next is launched before the
	// last one's results are waited for, so packing it hides behind the
	// GPU's work. Control requests wait for the step in flight.
	var inFlight *runner.Pending
	settle := func() {
		if inFlight != nil {
			s.watch.begin()
			if _, err := inFlight.Wait(); err != nil {
				log.Error("step failed", zap.Error(err)) // the leader's fails too: the collective sees to it
			}
			s.watch.end()
			inFlight = nil
		}
	}
	defer settle()
	return ipc.ReceiveEach(ctx, in, func(b []byte) error {
		var m tpMessage
		if err := msgpack.Unmarshal(b, &m); err != nil {
			return fmt.Errorf("a message from the leader: %w", err)
		}
		if m.Control == nil {
			seqs, err := fromWire(m.Seqs)
			if err != nil {
				return fmt.Errorf("a step from the leader: %w", err)
			}
			s.watch.begin()
			p, err := e.Runner.Launch(seqs)
			s.watch.end()
			if err != nil {
				log.Error("step failed", zap.Error(err))
			}
			settle()
			inFlight = p
			return nil
		}
		settle()
		msg, err := ioschema.Decode(m.Control)
		if err != nil {
			return fmt.Errorf("a control request from the leader: %w", err)
		}
		s.Handle(msg)
		for len(replies) > 0 {
			o := <-replies
			if o.to != toTokenizer {
				continue
			}
			rb, err := ioschema.Encode(o.msg)
			if err != nil {
				return err
			}
			if _, err := ack.SendBytes(rb, 0); err != nil {
				return err
			}
		}
		return nil
	})
}

// awaitCollectiveID reads the leader's first message: the collective id.
func awaitCollectiveID(in *zmq.Socket) ([128]byte, error) {
	var id [128]byte
	p := zmq.NewPoller()
	p.Add(in, zmq.POLLIN)
	polled, err := p.Poll(hubTimeout)
	if err != nil {
		return id, err
	}
	if len(polled) == 0 {
		return id, fmt.Errorf("the leader sent no collective id in %v", hubTimeout)
	}
	b, err := in.RecvBytes(0)
	if err != nil {
		return id, err
	}
	var m tpMessage
	if err := msgpack.Unmarshal(b, &m); err != nil {
		return id, fmt.Errorf("the leader's first message: %w", err)
	}
	if len(m.CollectiveID) != len(id) {
		return id, fmt.Errorf("the leader's first message has no collective id (%d bytes)", len(m.CollectiveID))
	}
	copy(id[:], m.CollectiveID)
	return id, nil
}
