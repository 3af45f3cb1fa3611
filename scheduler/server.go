package scheduler

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/zap"

	"ebb/engine"
	"ebb/ioschema"
	"ebb/ipc"
	"ebb/memory"
)

// ProcessConfig is what the scheduler process needs.
type ProcessConfig struct {
	Engine engine.Config
	// InputEndpoint is bound (PULL) for the tokenizer manager's requests;
	// DetokenizerEndpoint and TokenizerEndpoint are connected (PUSH).
	InputEndpoint, DetokenizerEndpoint, TokenizerEndpoint string
	// DPRank is this engine's index among --dp-size engines.
	DPRank int
	// TP places this process in its tensor-parallel engine (nil: TP 1).
	TP *TPConfig
	// InvariantInterval bounds how often the idle checks run.
	InvariantInterval time.Duration
}

// destination of an outgoing message.
type destination int

const (
	toDetokenizer destination = iota
	toTokenizer
)

type outgoing struct {
	to  destination
	msg ioschema.Message
}

// RunProcess is the scheduler process. The engine lives on this goroutine,
// locked to its OS thread; one goroutine owns the input socket and one the
// two output sockets. ready is called with the server info once serving.
func RunProcess(ctx context.Context, cfg ProcessConfig, log *zap.Logger, ready func(info map[string]any)) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	zctx, err := zmq.NewContext()
	if err != nil {
		return err
	}
	// The leader's links to its followers exist before its engine: on
	// GPUs the first message carries the collective id the ranks join with.
	var leader *tpLeader
	defer func() {
		if leader != nil {
			leader.close() // before Term, which waits for every socket
		}
		zctx.Term()
	}()
	if cfg.Engine.TPSize > 1 {
		if leader, err = newTPLeader(zctx, cfg.TP); err != nil {
			return err
		}
	}
	s, err := openServer(cfg, log, leader.shareCollectiveID, nil)
	if err != nil {
		return err
	}
	e := s.e
	defer closeEngine(e, log)
	if leader != nil {
		s.tp = leader
		e.Runner.Mirror = s.tp.sendStep
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	inbox := make(chan ioschema.Message, 1024)
	outbox := make(chan outgoing, 1024)
	errs := make(chan error, 2)
	inSock, err := zctx.NewSocket(zmq.PULL)
	if err != nil {
		return err
	}
	if err := inSock.Bind(cfg.InputEndpoint); err != nil {
		inSock.Close()
		return fmt.Errorf("bind %s: %w", cfg.InputEndpoint, err)
	}
	// errs has room for both goroutines' results, whether or not the loop
	// takes one: stopping waits for the goroutines themselves.
	var sockets sync.WaitGroup
	sockets.Add(2)
	go func() { defer sockets.Done(); errs <- receive(ctx, inSock, inbox, outbox, log) }()
	go func() { defer sockets.Done(); errs <- send(ctx, zctx, cfg, outbox) }()
	defer func() {
		cancel()
		sockets.Wait()
	}()
	s.out = outbox
	startWatchdog(ctx, &s.watch, cfg.Engine.WatchdogTimeout, log)
	ready(s.Info())
	interval := cfg.InvariantInterval
	if interval <= 0 {
		interval = time.Second
	}
	return s.Loop(ctx, inbox, errs, interval)
}

// closeEngine frees the device, saying how long that took when it was
// slow: a stopping process should be gone in moments.
func closeEngine(e *engine.Engine, log *zap.Logger) {
	start := time.Now()
	err := e.Close()
	if took := time.Since(start); took > time.Second || err != nil {
		log.Warn("closing the engine", zap.Duration("took", took), zap.Error(err))
	}
}

// receive owns the input socket: it decodes requests and forwards them; a
// message that does not decode gets an error reply and is dropped.
func receive(ctx context.Context, sock *zmq.Socket, inbox chan<- ioschema.Message, outbox chan<- outgoing, log *zap.Logger) error {
	defer sock.Close()
	if err := sock.SetLinger(0); err != nil {
		return err
	}
	err := ipc.ReceiveEach(ctx, sock, func(b []byte) error {
		m, err := ioschema.Decode(b)
		if err != nil {
			log.Warn("bad request", zap.Error(err))
			outbox <- outgoing{toTokenizer, &ioschema.ErrorOutput{Rid: ioschema.RidOf(b), Message: err.Error()}}
			return nil
		}
		select {
		case inbox <- m:
		case <-ctx.Done():
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("scheduler: %w", err)
	}
	return nil
}

// send owns both output sockets.
func send(ctx context.Context, zctx *zmq.Context, cfg ProcessConfig, outbox <-chan outgoing) error {
	socks := map[destination]*zmq.Socket{}
	for d, ep := range map[destination]string{toDetokenizer: cfg.DetokenizerEndpoint, toTokenizer: cfg.TokenizerEndpoint} {
		s, err := zctx.NewSocket(zmq.PUSH)
		if err != nil {
			return err
		}
		defer s.Close()
		if err := s.SetLinger(0); err != nil {
			return err
		}
		if err := s.Connect(ep); err != nil {
			return fmt.Errorf("connect %s: %w", ep, err)
		}
		socks[d] = s
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case o := <-outbox:
			b, err := ioschema.Encode(o.msg)
			if err != nil {
				return err
			}
			if _, err := socks[o.to].SendBytes(b, 0); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return fmt.Errorf("scheduler send: %w", err)
			}
		}
	}
}

// Server is the scheduler's state: the engine, the core, and the RL
// lifecycle around them. Its methods run on the engine's goroutine.
type Server struct {
	e      *engine.Engine
	core   *Core
	log    *zap.Logger
	out    chan<- outgoing
	flags  map[string]reqFlags // per running request, for the detokenizer
	paused bool                // by pause_generation, until continue_generation
	// weightVersion is reported with every output.
	weightVersion string
	lastCheck     time.Time
	InvariantErr  error  // the last failed idle check, if any
	blockedNoted  string // the blocker last logged while requests waited
	batches       batchLog
	watch         stepWatch // when the step in flight began (the watchdog's)
	// weight updates from a trainer
	tpRank      int
	dpRank      int
	tp          *tpLeader // rank 0 of a tensor-parallel engine
	distTimeout time.Duration
	groups      map[string]*weightGroup
	// updates wait for the requests decoding with the current weights
	// (waitForDecodes), in the order they came.
	updates []heldUpdate
}

type reqFlags struct {
	skipSpecial, spacesBetween, noStopTrim bool
	stop                                   []string
}

// NewServer wraps an engine.
func NewServer(e *engine.Engine, log *zap.Logger) (*Server, error) {
	core, err := NewCoreFor(e)
	if err != nil {
		return nil, err
	}
	timeout := e.Config.DistTimeout
	if timeout <= 0 {
		timeout = 10 * time.Minute
	}
	return &Server{e: e, core: core, log: log, flags: map[string]reqFlags{}, weightVersion: "default",
		distTimeout: timeout, groups: map[string]*weightGroup{}, batches: batchLog{interval: e.Config.DecodeLogInterval}}, nil
}

// Core exposes the scheduling core (tests, benchmarks).
func (s *Server) Core() *Core { return s.core }

// canRun reports whether generation may proceed: not paused, every region
// back and the weights not stale.
func (s *Server) canRun() bool { return !s.paused && s.e.Dev.Memory().AllResident() }

// ready reports whether the loop should take a step: generation may
// proceed and some request wants one.
func (s *Server) ready() bool { return s.canRun() && !s.core.Idle() }

// releasedTags lists the regions that are released now.
func (s *Server) releasedTags() []string {
	var tags []string
	for _, st := range s.e.Dev.Memory().Stats() {
		if st.State == memory.Released.String() {
			tags = append(tags, string(st.Tag))
		}
	}
	return tags
}

// blockedReason says why generation cannot run now ("" when it can).
func (s *Server) blockedReason() string {
	var why []string
	if s.paused {
		why = append(why, "generation is paused (continue_generation resumes it)")
	}
	if tags := s.releasedTags(); len(tags) > 0 {
		why = append(why, "memory is released: "+strings.Join(tags, ", ")+" (resume_memory_occupation brings it back)")
	}
	if s.e.Dev.Memory().State(memory.Weights) == memory.Stale {
		why = append(why, "the weights are stale (update the weights)")
	}
	return strings.Join(why, "; ")
}

// noteBlocked logs, once per distinct reason, that queued requests wait.
func (s *Server) noteBlocked() {
	if s.core.Idle() || s.canRun() {
		s.blockedNoted = ""
		return
	}
	why := s.blockedReason()
	if why == s.blockedNoted {
		return
	}
	s.blockedNoted = why
	waiting, running := s.core.Counts()
	log := s.log.Warn
	if !strings.Contains(why, "released") && !strings.Contains(why, "stale") {
		log = s.log.Info // a pause is what the caller asked for
	}
	log("requests wait", zap.Int("waiting", waiting), zap.Int("running", running), zap.String("reason", why))
}

// Loop serves until ctx ends or a socket goroutine fails.
func (s *Server) Loop(ctx context.Context, inbox <-chan ioschema.Message, errs <-chan error, interval time.Duration) error {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		s.noteBlocked()
		if s.ready() {
			// Take whatever has arrived, then step, unless what arrived
			// paused generation, released memory or ended every request:
			// a step on released weights or KV reads unmapped memory.
			for drained := false; !drained; {
				select {
				case m := <-inbox:
					s.Handle(m)
				default:
					drained = true
				}
			}
			if !s.ready() {
				continue
			}
			if err := s.Step(); err != nil {
				return err
			}
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case err := <-errs:
			if ctx.Err() != nil {
				return nil // stopping: the socket goroutines end too
			}
			if err == nil {
				err = errors.New("a socket goroutine stopped")
			}
			return err
		case m := <-inbox:
			s.Handle(m)
		case <-tick.C:
			s.checkIdle()
		}
	}
}

// Step runs one scheduling step and sends its outputs.
func (s *Server) Step() error {
	s.watch.begin()
	events, err := s.core.Step()
	s.watch.end()
	s.batches.record(s.log, s.core)
	s.emit(events)
	if err != nil {
		// A failed step has failed its batch (abort events above); the
		// device error is sticky for this step only. Keep serving.
		s.log.Error("step failed", zap.Error(err))
	}
	s.runHeldUpdates()
	return nil
}

// settle lands the step in flight so that a control message sees every
// request at rest.
func (s *Server) settle() {
	s.watch.begin()
	events, err := s.core.Settle()
	s.watch.end()
	s.emit(events)
	if err != nil {
		s.log.Error("step failed", zap.Error(err))
	}
}

// checkIdle runs the invariant checks when nothing is running.
func (s *Server) checkIdle() {
	if !s.core.Idle() || time.Since(s.lastCheck) < time.Second {
		return
	}
	s.lastCheck = time.Now()
	err := errors.Join(s.core.CheckInvariants(), s.e.Dev.Memory().CheckInvariants(), s.checkHeldUpdates())
	if err != nil && (s.InvariantErr == nil || err.Error() != s.InvariantErr.Error()) {
		s.log.Error("invariant violated", zap.Error(err))
	}
	s.InvariantErr = err
}

// emit sends events as one BatchTokenIDOutput.
func (s *Server) emit(events []Event) {
	if len(events) == 0 {
		return
	}
	b := &ioschema.BatchTokenIDOutput{}
	o := b.Outputs()
	o.WeightVersion = s.weightVersion
	for _, ev := range events {
		f := s.flags[ev.Rid]
		o.Rids = append(o.Rids, ev.Rid)
		o.FinishedReasons = append(o.FinishedReasons, ev.FinishReason)
		o.OutputIDs = append(o.OutputIDs, ev.NewTokens)
		o.PromptTokens = append(o.PromptTokens, ev.PromptTokens)
		o.CompletionTokens = append(o.CompletionTokens, ev.CompletionTokens)
		o.CachedTokens = append(o.CachedTokens, ev.CachedTokens)
		o.OutputTokenLogprobsVal = append(o.OutputTokenLogprobsVal, ev.OutputLogprobs)
		o.OutputTopLogprobsVal = append(o.OutputTopLogprobsVal, ev.OutputTopLogprobs)
		o.OutputTopLogprobsIdx = append(o.OutputTopLogprobsIdx, int32Lists(ev.OutputTopIDs))
		o.InputTokenLogprobsVal = append(o.InputTokenLogprobsVal, ev.InputLogprobs)
		o.InputTokenLogprobsIdx = append(o.InputTokenLogprobsIdx, ev.InputTokenIDs)
		o.InputTopLogprobsVal = append(o.InputTopLogprobsVal, ev.InputTopLogprobs)
		o.InputTopLogprobsIdx = append(o.InputTopLogprobsIdx, int32Lists(ev.InputTopIDs))
		o.RoutedExperts = append(o.RoutedExperts, ev.RoutedExperts)
		b.SkipSpecialTokens = append(b.SkipSpecialTokens, f.skipSpecial)
		b.SpacesBetweenSpecialTokens = append(b.SpacesBetweenSpecialTokens, f.spacesBetween)
		b.NoStopTrim = append(b.NoStopTrim, f.noStopTrim)
		b.Stop = append(b.Stop, f.stop)
		if ev.Finished {
			delete(s.flags, ev.Rid)
		}
	}
	s.out <- outgoing{toDetokenizer, b}
}

func (s *Server) reply(m ioschema.Message) {
	if r, ok := m.(interface{ ResultPtr() *ioschema.Result }); ok {
		r.ResultPtr().DPRank = s.dpRank
	}
	if s.out != nil {
		s.out <- outgoing{toTokenizer, m}
	}
}

func (s *Server) fail(rid, request string, err error) {
	s.reply(&ioschema.ErrorOutput{Rid: rid, Message: err.Error(), Request: request})
}

// Handle carries out one request.
func (s *Server) Handle(m ioschema.Message) {
	switch r := m.(type) {
	case *ioschema.TokenizedGenerateReqInput:
		s.addRequest(r)
	case *ioschema.AbortReq:
		s.settle()
		s.emit(s.core.Abort(r.Rid, r.AbortAll, "aborted by request"))
		s.dropHeldUpdate(r.Rid)
	default:
		c, ok := m.(interface{ GetRid() string })
		if !ok {
			s.fail("", m.TypeName(), fmt.Errorf("the scheduler does not handle %s", m.TypeName()))
		} else if !s.waitForDecodes(m, c.GetRid()) {
			s.carryOut(m, c.GetRid())
		}
	}
	s.runHeldUpdates()
}

// carryOut runs a control request with every request at rest and replies.
func (s *Server) carryOut(m ioschema.Message, rid string) {
	s.settle()
	if s.tp == nil {
		s.reply(s.control(m, rid))
		return
	}
	// Every rank carries it out on its shard; the reply says whether all
	// did.
	err := s.tp.control(m)
	reply := s.control(m, rid)
	var followers []ioschema.Message
	if err == nil {
		followers, err = s.tp.replies()
	}
	s.reply(mergeRankReplies(reply, followers, err))
}

func (s *Server) addRequest(r *ioschema.TokenizedGenerateReqInput) {
	if s.e.Dev.Memory().State(memory.Weights) == memory.Stale {
		s.fail(r.Rid, r.TypeName(), errors.New("the weights are stale (resumed without CPU backup): update the weights before generating"))
		return
	}
	params, err := r.SamplingParams.Resolve(s.e.Defaults())
	if err != nil {
		s.fail(r.Rid, r.TypeName(), err)
		return
	}
	req := Request{Rid: r.Rid, InputIDs: r.InputIDs, Params: params, ReturnLogprob: r.ReturnLogprob,
		LogprobStartLen: r.LogprobStartLen, TopLogprobsNum: r.TopLogprobsNum, ReturnRoutedExperts: r.ReturnRoutedExperts}
	if err := s.core.Add(req); err != nil {
		s.fail(r.Rid, r.TypeName(), err)
		return
	}
	s.flags[r.Rid] = reqFlags{skipSpecial: params.SkipSpecialTokens, spacesBetween: params.SpacesBetween,
		noStopTrim: params.NoStopTrim, stop: params.Stop}
}

// Info describes the server for /server_info and the launcher.
func (s *Server) Info() map[string]any {
	e := s.e
	waiting, running := s.core.Counts()
	total, free, cached, private := s.core.KVUsage()
	usage, used := s.core.tokenUsage()
	return map[string]any{
		"device": e.Dev.Name(), "architecture": string(e.Model.Config.Arch), "context_length": e.Model.ContextLen(),
		"max_total_num_tokens": total, "dp_rank": s.dpRank, "tp_size": e.Config.TPSize, "max_running_requests": s.core.Options().MaxRunningRequests,
		"chunked_prefill_size": s.core.Options().ChunkedPrefillSize, "enable_mixed_chunk": s.core.Options().EnableMixedChunk,
		"schedule_policy":                string(s.core.Options().SchedulePolicy),
		"enable_deterministic_inference": e.Config.EnableDeterministicInference, "cuda_graph_bs": e.Runner.GraphBatchSizes(),
		"enable_return_routed_experts": e.Runner.RoutedExpertsEnabled(), "load_format": e.Config.LoadFormat,
		"vocab_size": e.Model.Config.Vocab, "weight_version": s.weightVersion, "paused": s.paused,
		"num_waiting_reqs": waiting, "num_running_reqs": running, "kv_free_tokens": free,
		"num_used_tokens": used, "token_usage": usage, "num_waiting_tokens": s.core.waitingTokens(), "gen_throughput": s.batches.throughput,
		"kv_cached_tokens": cached, "kv_used_tokens": private, "kv_evictable_tokens": s.core.cache.Evictable(), "cpu_backup": e.Config.CPUBackup,
		"generated_tokens": s.core.Stats.GeneratedTokens, "forward_ct": s.core.Stats.Steps, "prompt_tokens": s.core.Stats.PromptTokens,
		"cached_prompt_tokens": s.core.Stats.CachedTokens, "graph_steps": e.Runner.Stats.GraphSteps,
		"short_context_graph_steps": e.Runner.Stats.ShortGraphSteps,
		"num_retracted_reqs":        s.core.Stats.Retractions, "retracted_input_tokens": s.core.Stats.RetractedInputTokens,
		"retracted_output_tokens": s.core.Stats.RetractedOutputTokens, "recomputed_tokens": s.core.Stats.RecomputedTokens,
		"new_token_ratio": s.core.ratio.value,
		"eager_steps":     e.Runner.Stats.EagerSteps, "invariants_ok": s.InvariantErr == nil,
		"generation_blocked": s.blockedReason(), "released_tags": s.releasedTags(),
		"weights_stale":          e.Dev.Memory().State(memory.Weights) == memory.Stale,
		"weight_updates_waiting": len(s.updates), "scheduler_pid": os.Getpid(),
	}
}

// int32Lists converts lists of ids to the wire's type.
func int32Lists(ids [][]int32) []ioschema.Int32s {
	out := make([]ioschema.Int32s, len(ids))
	for i, l := range ids {
		out[i] = l
	}
	return out
}
