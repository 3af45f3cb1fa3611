package tokenizermanager

import (
	"context"
	"crypto/subtle"
	"fmt"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/zap"

	"ebb/ioschema"
)

// routedReply goes back to one external client.
type routedReply struct {
	envelope [][]byte // the routing frames the request came with
	msg      ioschema.Message
}

// routerLoop owns the external ROUTER socket. Requests are msgpack maps with
// "type" (and a "rid" that every reply echoes); each is served on its own
// goroutine, whose replies come back through a channel. A message that does
// not decode gets an ErrorOutput; the server keeps serving.
func (m *Manager) routerLoop(ctx context.Context, sock *zmq.Socket) error {
	defer sock.Close()
	if err := sock.SetLinger(0); err != nil {
		return err
	}
	replies := make(chan routedReply, 1024)
	poller := zmq.NewPoller()
	poller.Add(sock, zmq.POLLIN)
	for ctx.Err() == nil {
		// Replies are produced by other goroutines; poll briefly so they
		// go out promptly while this goroutine keeps sole use of the socket.
		polled, err := poller.Poll(2 * time.Millisecond)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("external socket poll: %w", err)
		}
		if len(polled) > 0 {
			frames, err := sock.RecvMessageBytes(0)
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return fmt.Errorf("external socket receive: %w", err)
			}
			if len(frames) < 2 {
				continue // no routing identity: nothing to answer to
			}
			env, payload := frames[:len(frames)-1], frames[len(frames)-1]
			go m.serveExternal(ctx, env, payload, replies)
		}
		for drained := false; !drained; {
			select {
			case r := <-replies:
				b, err := ioschema.Encode(r.msg)
				if err != nil {
					m.log.Error("encode reply", zap.Error(err))
					continue
				}
				parts := make([]any, 0, len(r.envelope)+1)
				for _, f := range r.envelope {
					parts = append(parts, f)
				}
				parts = append(parts, b)
				if _, err := sock.SendMessage(parts...); err != nil && ctx.Err() == nil {
					m.log.Warn("external reply not delivered", zap.Error(err))
				}
			default:
				drained = true
			}
		}
	}
	return nil
}

// serveExternal answers one request from the external socket.
func (m *Manager) serveExternal(ctx context.Context, env [][]byte, payload []byte, replies chan<- routedReply) {
	send := func(msg ioschema.Message) {
		select {
		case replies <- routedReply{env, msg}:
		case <-ctx.Done():
		}
	}
	if m.cfg.APIKey != "" && subtle.ConstantTimeCompare([]byte(ioschema.APIKeyOf(payload)), []byte(m.cfg.APIKey)) != 1 {
		send(&ioschema.ErrorOutput{Rid: ioschema.RidOf(payload), Message: `unauthorized: this server needs "api_key" (its --api-key) in every message`})
		return
	}
	msg, err := ioschema.Decode(payload)
	if err != nil {
		send(&ioschema.ErrorOutput{Rid: ioschema.RidOf(payload), Message: err.Error()})
		return
	}
	switch r := msg.(type) {
	case *ioschema.GenerateReqInput:
		m.externalGenerate(ctx, r, send)
	case *ioschema.AbortReq:
		m.Abort(r.Rid, r.AbortAll)
	default:
		if _, ok := msg.(interface{ SetRid(string) }); !ok {
			rid := ioschema.RidOf(payload)
			send(&ioschema.ErrorOutput{Rid: rid, Request: msg.TypeName(), Message: msg.TypeName() + " is not a request"})
			return
		}
		reply, err := m.Control(ctx, msg)
		if err != nil {
			send(&ioschema.ErrorOutput{Rid: ioschema.RidOf(payload), Request: msg.TypeName(), Message: err.Error()})
			return
		}
		send(reply)
	}
}

// externalGenerate sends one GenerateReqOutput per prompt when it finishes,
// or, with stream, one per update and a last one with finished set.
func (m *Manager) externalGenerate(ctx context.Context, in *ioschema.GenerateReqInput, send func(ioschema.Message)) {
	firstRid := ""
	if len(in.Rid.Items) > 0 {
		firstRid = in.Rid.Items[0]
	}
	prompts, _, err := m.start(ctx, in)
	if err != nil {
		send(&ioschema.ErrorOutput{Rid: firstRid, Request: in.TypeName(), Message: err.Error()})
		return
	}
	for _, p := range prompts {
		sentIDs, sentText := 0, 0 // sent so far, where chunks are incremental
		for {
			// Unstreamed, only the finished request is looked at whole.
			if in.Stream || p.state.finished() {
				var s snapshot
				if in.Stream {
					s = nextChunk(p.state, m.cfg.IncrementalStreamingOutput, &sentIDs, &sentText)
				} else {
					s = p.state.snapshot()
				}
				if s.Err != nil {
					send(&ioschema.ErrorOutput{Rid: s.Rid, Request: in.TypeName(), Message: s.Err.Error()})
					break
				}
				res := m.generateResult(s, in.ReturnTextInLogprobs)
				out := &ioschema.GenerateReqOutput{Rid: s.Rid, OutputIDs: res["output_ids"].([]int32),
					MetaInfo: res["meta_info"].(map[string]any), Finished: s.Done}
				if text, ok := res["text"].(string); ok {
					out.Text = &text
				}
				send(out)
				if s.Done {
					break
				}
			}
			select {
			case <-p.state.notify:
			case <-ctx.Done():
				m.cancel(p.state)
				return
			}
		}
	}
}
