package tokenizermanager

import (
	"net/http"

	"ebb/ioschema"
)

// tokenizeRequest is SGLang's TokenizeRequest (/tokenize, /v1/tokenize):
// one prompt or a list of them. A trainer tokenizes with the server's own
// tokenizer so that its token ids and counts are the rollout's.
type tokenizeRequest struct {
	Model            string         `json:"model"`
	Prompt           ioschema.Texts `json:"prompt"`
	AddSpecialTokens *bool          `json:"add_special_tokens"` // default true
}

// detokenizeRequest is SGLang's DetokenizeRequest (/detokenize,
// /v1/detokenize): one id list or a list of them.
type detokenizeRequest struct {
	Model             string                `json:"model"`
	Tokens            ioschema.InputIDBatch `json:"tokens"`
	SkipSpecialTokens *bool                 `json:"skip_special_tokens"` // default true
}

// tokenize answers SGLang's TokenizeResponse: tokens and count, a list of
// each for a list of prompts, and max_model_len. SGLang reports the
// tokenizer's model_max_length there; ebb the context length it serves,
// which is what a client checks a prompt against.
func (m *Manager) tokenize(w http.ResponseWriter, r *http.Request) {
	var req tokenizeRequest
	if !m.tokenizerBody(w, r, &req) {
		return
	}
	if req.Prompt.Items == nil && !req.Prompt.Batch {
		writeError(w, badf("prompt is required: a string or a list of strings"))
		return
	}
	special := req.AddSpecialTokens == nil || *req.AddSpecialTokens
	tokens, counts := make([][]int32, len(req.Prompt.Items)), make([]int, len(req.Prompt.Items))
	for i, text := range req.Prompt.Items {
		tokens[i] = m.Tokenizer.Encode(text, special)
		counts[i] = len(tokens[i])
	}
	if !req.Prompt.Batch {
		writeJSON(w, http.StatusOK, map[string]any{"tokens": tokens[0], "count": counts[0], "max_model_len": m.ctxLen})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"tokens": tokens, "count": counts, "max_model_len": m.ctxLen})
}

// detokenize answers SGLang's DetokenizeResponse: text, a list of texts
// for a list of id lists. An id outside the vocabulary is a 400 (Hugging
// Face's decode would drop it silently).
func (m *Manager) detokenize(w http.ResponseWriter, r *http.Request) {
	var req detokenizeRequest
	if !m.tokenizerBody(w, r, &req) {
		return
	}
	if req.Tokens.Items == nil {
		writeError(w, badf("tokens is required: a list of token ids or a list of such lists"))
		return
	}
	skip := req.SkipSpecialTokens == nil || *req.SkipSpecialTokens
	vocab := m.Tokenizer.VocabSize()
	texts := make([]string, len(req.Tokens.Items))
	for i, ids := range req.Tokens.Items {
		for _, id := range ids {
			if id < 0 || int(id) >= vocab {
				writeError(w, badf("token id %d is outside the vocabulary (size %d)", id, vocab))
				return
			}
		}
		texts[i] = m.Tokenizer.Decode(ids, skip)
	}
	switch {
	case req.Tokens.Batch:
		writeJSON(w, http.StatusOK, map[string]any{"text": texts})
	case len(texts) == 1:
		writeJSON(w, http.StatusOK, map[string]any{"text": texts[0]})
	default:
		writeJSON(w, http.StatusOK, map[string]any{"text": ""})
	}
}

// tokenizerBody decodes a tokenizer endpoint's body into v; false (the
// error answered) where it is malformed or the model has no tokenizer.
func (m *Manager) tokenizerBody(w http.ResponseWriter, r *http.Request, v any) bool {
	err := decodeBody(r, v)
	if err == nil && m.Tokenizer == nil {
		err = badf("the model has no tokenizer")
	}
	if err != nil {
		writeError(w, err)
	}
	return err == nil
}
