package scheduler

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"

	"ebb/collective"
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

// tpMessage is what the leader sends its followers, in order.
type tpMessage struct {
	Seqs    []runner.SeqStep `msgpack:"seqs,omitempty"`
	Control []byte           `msgpack:"control,omitempty"` // an ioschema message
}

// hubTimeout bounds waiting on the other ranks inside one step.
const hubTimeout = 10 * time.Minute

// openRank opens this process's engine, joining the hub when the engine is
// tensor-parallel.
func openRank(cfg ProcessConfig) (*engine.Engine, *collective.Hub, error) {
	ec := cfg.Engine
	if ec.TPSize <= 1 {
		e, err := engine.Open(ec)
		return e, nil, err
	}
	if cfg.TP == nil {
		return nil, nil, errors.New("a tensor-parallel rank without its placement")
	}
	hub, err := collective.NewHub(cfg.TP.Rank, ec.TPSize, cfg.TP.HubEndpoint, hubTimeout)
	if err != nil {
		return nil, nil, err
	}
	ec.TPRank, ec.Comm = cfg.TP.Rank, hub
	e, err := engine.Open(ec)
	if err != nil {
		hub.Close()
		return nil, nil, err
	}
	return e, hub, nil
}

// tpLeader is rank 0's link to its followers; the scheduler loop's
// goroutine is its only user.
type tpLeader struct {
	steps []*zmq.Socket
	acks  *zmq.Socket
}

func newTPLeader(zctx *zmq.Context, cfg *TPConfig) (*tpLeader, error) {
	l := &tpLeader{}
	var err error
	if l.acks, err = zctx.NewSocket(zmq.PULL); err != nil {
		return nil, err
	}
	if err := l.acks.SetRcvtimeo(hubTimeout); err != nil {
		return nil, err
	}
	if err := l.acks.Bind(cfg.AckEndpoint); err != nil {
		return nil, fmt.Errorf("bind %s: %w", cfg.AckEndpoint, err)
	}
	for _, ep := range cfg.StepEndpoints {
		s, err := zctx.NewSocket(zmq.PUSH)
		if err != nil {
			return nil, err
		}
		l.steps = append(l.steps, s)
		if err := s.Connect(ep); err != nil {
			return nil, fmt.Errorf("connect %s: %w", ep, err)
		}
	}
	return l, nil
}

func (l *tpLeader) close() {
	for _, s := range append(l.steps, l.acks) {
		_ = s.SetLinger(0)
		s.Close()
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

// sendStep is the runner's Mirror.
func (l *tpLeader) sendStep(seqs []runner.SeqStep) error { return l.send(tpMessage{Seqs: seqs}) }

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
	e, hub, err := openRank(cfg)
	if err != nil {
		return err
	}
	defer e.Close()
	defer hub.Close()
	s, err := NewServer(e, log)
	if err != nil {
		return err
	}
	s.tpRank, s.dpRank = cfg.TP.Rank, cfg.DPRank
	replies := make(chan outgoing, 64)
	s.out = replies
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
	ready()
	return ipc.ReceiveEach(ctx, in, func(b []byte) error {
		var m tpMessage
		if err := msgpack.Unmarshal(b, &m); err != nil {
			return fmt.Errorf("a message from the leader: %w", err)
		}
		if m.Control == nil {
			// A failed step fails on the leader too (the hub sees to it).
			if p, err := e.Runner.Launch(m.Seqs); err != nil {
				log.Error("step failed", zap.Error(err))
			} else if _, err := p.Wait(); err != nil {
				log.Error("step failed", zap.Error(err))
			}
			return nil
		}
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
