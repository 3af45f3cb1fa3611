package detokenizer

import (
	"context"
	"fmt"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/zap"

	"ebb/ioschema"
	"ebb/ipc"
	"ebb/tokenizer"
)

// Config is what the detokenizer process needs.
type Config struct {
	// TokenizerDir holds tokenizer.json.
	TokenizerDir string
	// InputEndpoint is bound (PULL) for the scheduler's batches;
	// OutputEndpoint is connected (PUSH) to the tokenizer manager.
	InputEndpoint, OutputEndpoint string
}

// Run is the detokenizer process: one goroutine owns both sockets and the
// decode state. ready is called once the sockets are up.
func Run(ctx context.Context, cfg Config, log *zap.Logger, ready func()) error {
	var tok *tokenizer.Tokenizer
	var err error
	if tok, err = tokenizer.Load(cfg.TokenizerDir); err != nil {
		log.Warn("no tokenizer: outputs carry token ids and empty text", zap.Error(err))
		tok = nil
	}
	zctx, err := zmq.NewContext()
	if err != nil {
		return err
	}
	defer zctx.Term()
	in, out, err := ipc.Pipe(zctx, cfg.InputEndpoint, cfg.OutputEndpoint)
	if err != nil {
		return err
	}
	defer in.Close()
	defer out.Close()
	ready()
	d := New(tok)
	return ipc.ReceiveEach(ctx, in, func(b []byte) error {
		m, err := ioschema.Decode(b)
		if err != nil {
			log.Error("dropping undecodable batch", zap.Error(err))
			return nil
		}
		batch, ok := m.(*ioschema.BatchTokenIDOutput)
		if !ok {
			log.Error("unexpected message", zap.String("type", m.TypeName()))
			return nil
		}
		enc, err := ioschema.Encode(d.Process(batch))
		if err != nil {
			return err
		}
		if _, err := out.SendBytes(enc, 0); err != nil {
			return fmt.Errorf("send: %w", err)
		}
		return nil
	})
}
