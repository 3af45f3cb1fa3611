// Package tokenizermanager is the front process of `ebb serve` (directory
// tokenizer_manager/): SGLang's HTTP API and OpenAI endpoints, the external
// ZMQ API for RL frameworks, tokenization and chat templates. It fans
// requests out to the scheduler and gathers the detokenizer's text.
package tokenizermanager

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/zap"

	"ebb/ioschema"
	"ebb/ipc"
	"ebb/model"
	"ebb/tokenizer"
)

// Config is what the tokenizer manager needs.
type Config struct {
	ModelDir     string
	TokenizerDir string // default: ModelDir
	ModelName    string // served model name (/v1/models); default: the directory
	// APIKey, when set, is required on every HTTP endpoint but /health* and
	// /metrics (Authorization: Bearer KEY, as SGLang's --api-key) and as
	// "api_key" on every message of the external ZMQ socket.
	APIKey string
	// DisableRadixCache: copies of one prompt (n > 1) cannot share a
	// prefilled prefix, so none is prepared for them.
	DisableRadixCache bool
	// SchedulerEndpoints are connected (PUSH), one per data-parallel engine
	// (--dp-size): generate requests go to the engine with the least work,
	// control requests to every engine. InputEndpoint is bound (PULL) for
	// the detokenizer's text and the schedulers' replies.
	SchedulerEndpoints []string
	InputEndpoint      string
	// ZMQEndpoint is the external ROUTER; empty disables it.
	ZMQEndpoint string
	// ControlTimeout bounds waiting for a control reply.
	ControlTimeout time.Duration
	// LoadBalanceMethod is --load-balance-method (ParseLoadBalanceMethod):
	// how a generate request that names no engine picks one.
	LoadBalanceMethod string
	// ContextLength is --context-length (0: the model's
	// max_position_embeddings); a prompt and its max_new_tokens must fit
	// in it unless AllowAutoTruncate (--allow-auto-truncate) clips them.
	ContextLength     int
	AllowAutoTruncate bool
	// IncrementalStreamingOutput (--incremental-streaming-output) makes
	// each streamed /generate and ZMQ chunk carry only what is new: text,
	// output ids and output logprobs since the last chunk (SGLang's flag;
	// by default every chunk is all of the output so far).
	IncrementalStreamingOutput bool
	// MaxRequestBodyBytes caps the body of a generate request (0: 1 KiB a
	// token of context, at least 16 MiB).
	MaxRequestBodyBytes int64
	// ReasoningParser is --reasoning-parser (reasoningParsers; "": none):
	// the chat endpoint's replies carry their reasoning apart.
	ReasoningParser string
	// ToolCallParser is --tool-call-parser (toolCallParsers; "": the chat
	// template's own syntax).
	ToolCallParser string
}

// Manager routes requests and outputs. One goroutine (loop) owns the
// request table; others reach it through channels.
type Manager struct {
	cfg       Config
	log       *zap.Logger
	Tokenizer *tokenizer.Tokenizer // nil when the model has no tokenizer
	TokConfig *tokenizer.Config
	ModelCfg  *model.Config
	chat      *chatTemplate
	reasoning *reasoningParser // nil without --reasoning-parser
	toolCalls toolFormat       // --tool-call-parser's format (0: the template's)
	metrics   *metrics
	ctxLen    int   // the most tokens a sequence holds
	maxBody   int64 // the cap on a generate request's body

	zctx    *zmq.Context
	toSched chan outbound
	engines int
	ops     chan func(*table)
	done    chan struct{}
	errs    chan error
}

// table is the state the loop goroutine owns.
type table struct {
	reqs    map[string]*reqState
	control map[string]*controlWait
	route   *router
	log     *zap.Logger
}

// forget drops a request and its load from its engine's account.
func (t *table) forget(rid string) {
	if r := t.reqs[rid]; r != nil {
		r.mu.Lock()
		t.route.finish(r.engine, r.load, r.prompt, r.outputIDs)
		r.mu.Unlock()
		delete(t.reqs, rid)
		if len(t.reqs) == 0 {
			if err := t.route.checkIdle(); err != nil {
				t.log.Error("invariant violated", zap.String("of", "router"), zap.Error(err))
			}
		}
	}
}

// New loads the tokenizer and configs of the model directory.
func New(cfg Config, log *zap.Logger) (*Manager, error) {
	m := &Manager{cfg: cfg, log: log, toSched: make(chan outbound, 1024), ops: make(chan func(*table), 1024),
		done: make(chan struct{}), errs: make(chan error, 4)}
	if len(cfg.SchedulerEndpoints) == 0 {
		return nil, errors.New("tokenizer manager: no scheduler endpoint")
	}
	m.engines = len(cfg.SchedulerEndpoints)
	var err error
	if m.cfg.LoadBalanceMethod, err = ParseLoadBalanceMethod(cfg.LoadBalanceMethod); err != nil {
		return nil, err
	}
	if m.reasoning, err = parseReasoningParser(cfg.ReasoningParser); err != nil {
		return nil, err
	}
	if m.toolCalls, err = parseToolCallParser(cfg.ToolCallParser); err != nil {
		return nil, err
	}
	if m.cfg.ControlTimeout <= 0 {
		m.cfg.ControlTimeout = 30 * time.Minute
	}
	if m.cfg.TokenizerDir == "" {
		m.cfg.TokenizerDir = cfg.ModelDir
	}
	if m.ModelCfg, err = model.LoadConfig(cfg.ModelDir); err != nil {
		return nil, err
	}
	m.ctxLen = contextLength(cfg.ContextLength, m.ModelCfg.MaxPositions)
	m.maxBody = requestBodyLimit(cfg.MaxRequestBodyBytes, m.ctxLen)
	if m.TokConfig, err = tokenizer.LoadConfig(m.cfg.TokenizerDir); err != nil {
		return nil, err
	}
	if tok, err := tokenizer.Load(m.cfg.TokenizerDir); err == nil {
		m.Tokenizer = tok
	} else {
		log.Warn("no tokenizer: only input_ids requests are served", zap.Error(err))
	}
	if m.TokConfig.ChatTemplate != "" {
		if m.chat, err = newChatTemplate(m.TokConfig); err != nil {
			return nil, fmt.Errorf("chat template: %w", err)
		}
	}
	m.metrics = newMetrics(m)
	return m, nil
}

// Start opens the sockets and the routing loop; it returns once they are up.
func (m *Manager) Start(ctx context.Context) error {
	zctx, err := zmq.NewContext()
	if err != nil {
		return err
	}
	m.zctx = zctx
	in, err := zctx.NewSocket(zmq.PULL)
	if err != nil {
		return err
	}
	if err := in.Bind(m.cfg.InputEndpoint); err != nil {
		in.Close()
		return fmt.Errorf("bind %s: %w", m.cfg.InputEndpoint, err)
	}
	var outs []*zmq.Socket
	for _, ep := range m.cfg.SchedulerEndpoints {
		out, err := zctx.NewSocket(zmq.PUSH)
		if err != nil {
			return err
		}
		if err := out.Connect(ep); err != nil {
			out.Close()
			return fmt.Errorf("connect %s: %w", ep, err)
		}
		outs = append(outs, out)
	}
	var router *zmq.Socket
	if m.cfg.ZMQEndpoint != "" {
		if router, err = zctx.NewSocket(zmq.ROUTER); err != nil {
			return err
		}
		if err := router.Bind(m.cfg.ZMQEndpoint); err != nil {
			router.Close()
			return fmt.Errorf("bind the external ZMQ endpoint %s: %w", m.cfg.ZMQEndpoint, err)
		}
	}
	go m.loop(ctx)
	go func() { m.errs <- m.sendLoop(ctx, outs) }()
	go func() { m.errs <- m.receiveLoop(ctx, in) }()
	if router != nil {
		go func() { m.errs <- m.routerLoop(ctx, router) }()
	}
	return nil
}

// Errors reports a socket goroutine's failure.
func (m *Manager) Errors() <-chan error { return m.errs }

// Close terminates the ZMQ context once the socket goroutines have closed
// their sockets (they stop when the context passed to Start ends).
func (m *Manager) Close() {
	if m.zctx != nil {
		m.zctx.Term()
	}
}

func (m *Manager) loop(ctx context.Context) {
	t := &table{reqs: map[string]*reqState{}, control: map[string]*controlWait{},
		route: newRouter(m.cfg.LoadBalanceMethod, m.engines, !m.cfg.DisableRadixCache), log: m.log}
	for {
		select {
		case <-ctx.Done():
			for _, r := range t.reqs {
				r.fail(errShuttingDown)
			}
			close(m.done)
			return
		case op := <-m.ops:
			op(t)
		}
	}
}

// do runs f on the loop goroutine.
func (m *Manager) do(f func(*table)) {
	select {
	case m.ops <- f:
	case <-m.done:
	}
}

// outbound is a message for one engine, or for every engine (-1).
type outbound struct {
	msg    ioschema.Message
	engine int
}

// sendLoop owns the sockets to the engines' schedulers.
func (m *Manager) sendLoop(ctx context.Context, socks []*zmq.Socket) error {
	for _, s := range socks {
		defer s.Close()
		if err := s.SetLinger(0); err != nil {
			return err
		}
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case o := <-m.toSched:
			b, err := ioschema.Encode(o.msg)
			if err != nil {
				return err
			}
			for i, s := range socks {
				if o.engine >= 0 && o.engine != i {
					continue
				}
				if _, err := s.SendBytes(b, 0); err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return fmt.Errorf("send to scheduler %d: %w", i, err)
				}
			}
		}
	}
}

func (m *Manager) receiveLoop(ctx context.Context, sock *zmq.Socket) error {
	defer sock.Close()
	if err := sock.SetLinger(0); err != nil {
		return err
	}
	return ipc.ReceiveEach(ctx, sock, func(b []byte) error {
		msg, err := ioschema.Decode(b)
		if err != nil {
			m.log.Error("dropping undecodable output", zap.Error(err))
			return nil
		}
		m.do(func(t *table) { m.route(t, msg) })
		return nil
	})
}

// route delivers an output to the request or control call it answers.
func (m *Manager) route(t *table, msg ioschema.Message) {
	switch o := msg.(type) {
	case *ioschema.BatchStrOutput:
		for i, rid := range o.Rids {
			r := t.reqs[rid]
			if r == nil {
				continue // aborted and forgotten
			}
			r.absorb(o, i, m)
			if r.finished() {
				t.forget(rid)
				m.metrics.finished(r)
			}
		}
	case *ioschema.ErrorOutput:
		if r := t.reqs[o.Rid]; r != nil {
			r.fail(errors.New(o.Message))
			t.forget(o.Rid)
			return
		}
		if w := t.control[o.Rid]; w != nil {
			t.answer(o.Rid, w, o)
			return
		}
		m.log.Warn("error for an unknown request", zap.String("rid", o.Rid), zap.String("message", o.Message))
	default:
		rid := ""
		if c, ok := msg.(interface{ GetRid() string }); ok {
			rid = c.GetRid()
		}
		if w := t.control[rid]; w != nil {
			t.answer(rid, w, msg)
			return
		}
		m.log.Warn("reply for an unknown request", zap.String("type", msg.TypeName()), zap.String("rid", rid))
	}
}

// newRid returns a fresh request id.
func newRid() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Control sends a control request and waits for its reply.
func (m *Manager) Control(ctx context.Context, msg ioschema.Message) (ioschema.Message, error) {
	c, ok := msg.(interface {
		GetRid() string
		SetRid(string)
	})
	if !ok {
		return nil, fmt.Errorf("%s is not a control request", msg.TypeName())
	}
	rid := c.GetRid()
	if rid == "" {
		rid = newRid()
	}
	if _, tensors := msg.(*ioschema.UpdateWeightsFromTensorReqInput); tensors && m.engines > 1 {
		// Every engine would open the trainer's storages and give back its
		// reference counts: the trainer would free them under the others.
		return &ioschema.ErrorOutput{Rid: rid, Request: msg.TypeName(), Message: fmt.Sprintf(
			"update_weights_from_tensor with --dp-size %d is not supported yet: update from disk or over NCCL (each engine joins as its own rank)", m.engines)}, nil
	}
	// Clients may reuse their rids; the scheduler sees a unique one.
	internal := "ctl-" + newRid()
	c.SetRid(internal)
	ch := make(chan ioschema.Message, 1)
	m.do(func(t *table) { t.control[internal] = &controlWait{ch: ch, need: m.engines} })
	defer func() {
		c.SetRid(rid)
		m.do(func(t *table) { delete(t.control, internal) })
	}()
	select {
	case m.toSched <- outbound{msg, -1}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	timer := time.NewTimer(m.cfg.ControlTimeout)
	defer timer.Stop()
	select {
	case reply := <-ch:
		setReplyRid(reply, rid)
		if mayEmptyRadixCaches(msg) {
			// Even a refusal may have come from one engine of several.
			m.do(func(t *table) { t.route.forgetPrefixes() })
		}
		return reply, nil
	case <-ctx.Done():
		if _, ok := ioschema.WeightWrite(msg); ok {
			// An engine may hold it until its running requests end:
			// one the caller gave up on must not be carried out later.
			m.Abort(internal, false)
		}
		return nil, ctx.Err()
	case <-timer.C:
		if _, ok := ioschema.WeightWrite(msg); ok {
			m.Abort(internal, false)
		}
		return nil, fmt.Errorf("no reply to %s within %v", msg.TypeName(), m.cfg.ControlTimeout)
	}
}

// mayEmptyRadixCaches reports whether a control request can drop what the
// engines' radix caches hold.
func mayEmptyRadixCaches(msg ioschema.Message) bool {
	switch msg.(type) {
	case *ioschema.FlushCacheReqInput, *ioschema.ReleaseMemoryOccupationReqInput, *ioschema.UpdateWeightFromDiskReqInput,
		*ioschema.UpdateWeightsFromTensorReqInput, *ioschema.UpdateWeightsFromDistributedReqInput:
		return true
	}
	return false
}

// setReplyRid puts the client's rid back on a reply.
func setReplyRid(reply ioschema.Message, rid string) {
	switch r := reply.(type) {
	case *ioschema.ErrorOutput:
		r.Rid = rid
	case interface{ ResultPtr() *ioschema.Result }:
		r.ResultPtr().Rid = rid
	}
}

// Abort asks the scheduler to abort requests (prefix match) or all.
func (m *Manager) Abort(rid string, all bool) {
	select {
	case m.toSched <- outbound{&ioschema.AbortReq{Rid: rid, AbortAll: all}, -1}:
	case <-m.done:
	}
}
