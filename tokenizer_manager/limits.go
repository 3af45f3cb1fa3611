package tokenizermanager

import (
	"errors"
	"fmt"
	"net/http"

	"go.uber.org/zap"

	"ebb/ioschema"
)

// serverFault marks errors that are the server's, not the client's (HTTP
// 503): clients that retry on server errors, as verl's adapter does, can
// then tell them from their own mistakes.
type serverFault struct{ error }

// errShuttingDown fails the requests in flight when the server stops.
var errShuttingDown = serverFault{errors.New("server shutting down")}

// IsServerFault reports whether err is the server's fault.
func IsServerFault(err error) bool {
	var f serverFault
	return errors.As(err, &f)
}

// bodyBytesPerToken sizes the default cap on a request body: room for a
// prompt of the whole context as text or input_ids many times over, while a
// body far past anything the model can take is refused before it is read.
const (
	bodyBytesPerToken = 1 << 10
	minRequestBody    = 16 << 20
)

// contextLength is the most tokens a sequence may hold: --context-length
// where it is set and within the model's max_position_embeddings, as the
// scheduler's model has it.
func contextLength(set, maxPositions int) int {
	if set <= 0 || set > maxPositions {
		return maxPositions
	}
	return set
}

// requestBodyLimit is --max-request-body-mb in bytes, or the default for a
// context of ctx tokens.
func requestBodyLimit(set int64, ctx int) int64 {
	if set > 0 {
		return set
	}
	return max(minRequestBody, int64(ctx)*bodyBytesPerToken)
}

// encode tokenizes a prompt, stopping once it is past the context: a
// refused prompt costs no more than the context to tokenize, and one that
// --allow-auto-truncate clips keeps its first tokens, as fitContext would.
func (m *Manager) encode(text string, addSpecial bool) ([]int32, error) {
	// The text's length alone may already show it past the context.
	atLeast, ids, complete := m.Tokenizer.MinTokens(text), []int32(nil), false
	if atLeast < m.ctxLen || m.cfg.AllowAutoTruncate {
		ids, complete = m.Tokenizer.EncodeLimit(text, addSpecial, m.ctxLen-1)
		atLeast = len(ids)
	}
	if !complete && !m.cfg.AllowAutoTruncate {
		return nil, badf("The input (at least %d tokens) is longer than the model's context length (%d tokens).", atLeast, m.ctxLen)
	}
	return ids, nil
}

// fitContext checks a prompt and its max_new_tokens against the context
// with SGLang's rules and messages (clients parse them): a prompt of the
// whole context or more, or a prompt and max_new_tokens past it, is the
// client's error; with --allow-auto-truncate the prompt keeps its first
// tokens and max_new_tokens what is left, as SGLang's does.
func (m *Manager) fitContext(ids []int32, sp *ioschema.SamplingParams) ([]int32, error) {
	n := len(ids)
	if n >= m.ctxLen {
		if !m.cfg.AllowAutoTruncate {
			return nil, badf("The input (%d tokens) is longer than the model's context length (%d tokens).", n, m.ctxLen)
		}
		m.log.Warn("truncating a prompt longer than the context", zap.Int("tokens", n), zap.Int("context_length", m.ctxLen))
		ids, n = ids[:m.ctxLen-1], m.ctxLen-1
	}
	if sp.MaxNewTokens != nil && *sp.MaxNewTokens > m.ctxLen-n {
		want := *sp.MaxNewTokens
		if !m.cfg.AllowAutoTruncate {
			return nil, badf("Requested token count exceeds the model's maximum context length of %d tokens. "+
				"You requested a total of %d tokens: %d tokens from the input messages and %d tokens for the completion. "+
				"Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
				m.ctxLen, want+n, n, want)
		}
		left := m.ctxLen - n
		sp.MaxNewTokens = &left
	}
	return ids, nil
}

// bodyError is the answer to a body that could not be read: 413 past the cap.
func bodyError(err error) error {
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		return tooLargeError{tooLarge.Limit}
	}
	return badf("read body: %v", err)
}

// tooLargeError is a request body past --max-request-body-mb (HTTP 413).
type tooLargeError struct{ limit int64 }

func (e tooLargeError) Error() string {
	return fmt.Sprintf("the request body is larger than %d MiB (--max-request-body-mb)", e.limit>>20)
}
