package tokenizermanager

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"ebb/ioschema"
)

// Handler serves SGLang's HTTP API and the OpenAI endpoints.
func (m *Manager) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /health_generate", m.healthGenerate)
	mux.HandleFunc("GET /model_info", m.modelInfo)
	mux.HandleFunc("GET /get_model_info", m.modelInfo)
	mux.HandleFunc("GET /server_info", m.serverInfo)
	mux.HandleFunc("GET /get_server_info", m.serverInfo)
	mux.HandleFunc("GET /get_weight_version", m.weightVersion)
	mux.HandleFunc("GET /v1/models", m.models)
	mux.HandleFunc("GET /v1/models/{model...}", m.model)
	mux.HandleFunc("GET /v1/loads", m.loads)
	mux.HandleFunc("GET /get_load", m.getLoad)
	mux.HandleFunc("POST /generate", capped(m.maxBody, m.generate))
	mux.HandleFunc("PUT /generate", capped(m.maxBody, m.generate)) // SGLang takes both
	mux.HandleFunc("POST /v1/completions", capped(m.maxBody, m.completions))
	mux.HandleFunc("POST /v1/chat/completions", capped(m.maxBody, m.chatCompletions))
	mux.HandleFunc("POST /abort_request", capped(controlBodyLimit, m.abortRequest))
	for _, prefix := range []string{"", "/v1"} {
		mux.HandleFunc("POST "+prefix+"/tokenize", capped(m.maxBody, m.tokenize))
		mux.HandleFunc("POST "+prefix+"/detokenize", capped(m.maxBody, m.detokenize))
	}
	for path, newMsg := range map[string]func() ioschema.Message{
		"/flush_cache":                     func() ioschema.Message { return &ioschema.FlushCacheReqInput{} },
		"/pause_generation":                func() ioschema.Message { return &ioschema.PauseGenerationReqInput{} },
		"/continue_generation":             func() ioschema.Message { return &ioschema.ContinueGenerationReqInput{} },
		"/release_memory_occupation":       func() ioschema.Message { return &ioschema.ReleaseMemoryOccupationReqInput{} },
		"/resume_memory_occupation":        func() ioschema.Message { return &ioschema.ResumeMemoryOccupationReqInput{} },
		"/update_weights_from_disk":        func() ioschema.Message { return &ioschema.UpdateWeightFromDiskReqInput{} },
		"/update_weights_from_tensor":      func() ioschema.Message { return &ioschema.UpdateWeightsFromTensorReqInput{} },
		"/init_weights_update_group":       func() ioschema.Message { return &ioschema.InitWeightsUpdateGroupReqInput{} },
		"/update_weights_from_distributed": func() ioschema.Message { return &ioschema.UpdateWeightsFromDistributedReqInput{} },
		"/destroy_weights_update_group":    func() ioschema.Message { return &ioschema.DestroyWeightsUpdateGroupReqInput{} },
		"/update_weight_version":           func() ioschema.Message { return &ioschema.UpdateWeightVersionReqInput{} },
		"/get_weights_by_name":             func() ioschema.Message { return &ioschema.GetWeightsByNameReqInput{} },
		"/memory_stats":                    func() ioschema.Message { return &ioschema.GetMemoryStatsReqInput{} },
	} {
		h := capped(controlBodyLimit, m.controlHandler(newMsg))
		mux.HandleFunc("POST "+path, h)
		mux.HandleFunc("GET "+path, h)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(m.metrics.reg, promhttp.HandlerOpts{}))
	return m.authorize(mux)
}

// authorize requires --api-key as SGLang does: a Bearer token on every
// request but CORS preflights, /health* and /metrics; 401 otherwise.
func (m *Manager) authorize(next http.Handler) http.Handler {
	if m.cfg.APIKey == "" {
		return next
	}
	want := []byte("Bearer " + m.cfg.APIKey)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		open := r.Method == http.MethodOptions || strings.HasPrefix(r.URL.Path, "/health") || strings.HasPrefix(r.URL.Path, "/metrics")
		if !open && subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			writeJSON(w, http.StatusUnauthorized, map[string]any{"error": "Unauthorized"})
			return
		}
		next.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeError answers {"error": {"message": ...}}: 400 for the client's
// errors, 413 for a body past the cap, 499 when the client went away, 503
// for the server's faults (shutting down), 500 otherwise.
func writeError(w http.ResponseWriter, err error) {
	status := http.StatusInternalServerError
	var tooLarge tooLargeError
	switch {
	case IsBadRequest(err):
		status = http.StatusBadRequest
	case errors.As(err, &tooLarge):
		status = http.StatusRequestEntityTooLarge
	case IsServerFault(err):
		status = http.StatusServiceUnavailable
	case errors.Is(err, context.Canceled):
		status = 499
	}
	writeJSON(w, status, map[string]any{"error": map[string]any{"message": err.Error(), "code": status}})
}

// controlBodyLimit caps the bodies of the control endpoints, which carry
// no prompts.
const controlBodyLimit = 64 << 20

// capped serves h with the request body capped at limit bytes (413 past it).
func capped(limit int64, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, limit)
		h(w, r)
	}
}

// decodeBody reads a JSON body (empty means defaults) into v.
func decodeBody(r *http.Request, v any) error {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return bodyError(err)
	}
	if len(body) == 0 {
		return nil
	}
	if err := json.Unmarshal(body, v); err != nil {
		return badf("invalid JSON body: %v", err)
	}
	return nil
}

func (m *Manager) controlHandler(newMsg func() ioschema.Message) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		msg := newMsg()
		if err := decodeBody(r, msg); err != nil {
			writeError(w, err)
			return
		}
		ioschema.ApplyDefaults(msg)
		reply, err := m.Control(r.Context(), msg)
		if err != nil {
			writeError(w, err)
			return
		}
		if e, ok := reply.(*ioschema.ErrorOutput); ok {
			writeError(w, badRequest{errors.New(e.Message)})
			return
		}
		status := http.StatusOK
		if res, ok := reply.(interface{ ResultPtr() *ioschema.Result }); ok && !res.ResultPtr().Success {
			status = http.StatusBadRequest
		}
		// SGLang's /get_weights_by_name answers with the values themselves.
		if g, ok := reply.(*ioschema.GetWeightsByNameReqOutput); ok && g.Success {
			writeJSON(w, status, g.Parameter)
			return
		}
		writeJSON(w, status, reply)
	}
}

func (m *Manager) abortRequest(w http.ResponseWriter, r *http.Request) {
	var req ioschema.AbortReq
	if err := decodeBody(r, &req); err != nil {
		writeError(w, err)
		return
	}
	if req.Rid == "" && !req.AbortAll {
		writeError(w, badf("give rid or abort_all"))
		return
	}
	m.Abort(req.Rid, req.AbortAll)
	writeJSON(w, http.StatusOK, map[string]any{"success": true})
}

func (m *Manager) modelName() string {
	if m.cfg.ModelName != "" {
		return m.cfg.ModelName
	}
	return filepath.Base(filepath.Clean(m.cfg.ModelDir))
}

func (m *Manager) modelInfo(w http.ResponseWriter, r *http.Request) {
	info := map[string]any{
		"model_path": m.cfg.ModelDir, "tokenizer_path": m.cfg.ModelDir, "is_generation": true,
		"architecture": string(m.ModelCfg.Arch), "served_model_name": m.modelName(),
		"has_tokenizer": m.Tokenizer != nil, "has_chat_template": m.chat != nil,
	}
	// SGLang's has the weight version too; the rest answers without the
	// engines.
	if engines, err := m.engineInfo(r.Context()); err == nil {
		info["weight_version"] = engines["weight_version"]
	}
	writeJSON(w, http.StatusOK, info)
}

// weightVersion serves SGLang's /get_weight_version: the version the
// engines' weights carry (default until an update names one).
func (m *Manager) weightVersion(w http.ResponseWriter, r *http.Request) {
	info, err := m.engineInfo(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"weight_version": info["weight_version"]})
}

// engineInfo is the engines' server_info, merged over DP engines.
func (m *Manager) engineInfo(ctx context.Context) (map[string]any, error) {
	reply, err := m.Control(ctx, &ioschema.GetServerInfoReqInput{})
	if err != nil {
		return nil, err
	}
	info, ok := reply.(*ioschema.GetServerInfoReqOutput)
	if !ok {
		return nil, fmt.Errorf("unexpected reply %s", reply.TypeName())
	}
	return info.Info, nil
}

func (m *Manager) serverInfo(w http.ResponseWriter, r *http.Request) {
	info, err := m.engineInfo(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	info["model_path"] = m.cfg.ModelDir
	info["served_model_name"] = m.modelName()
	info["dp_size"] = m.engines
	info["load_balance_method"] = m.cfg.LoadBalanceMethod
	info["allow_auto_truncate"] = m.cfg.AllowAutoTruncate
	info["incremental_streaming_output"] = m.cfg.IncrementalStreamingOutput
	info["reasoning_parser"] = nilIfEmpty(m.cfg.ReasoningParser)
	info["tool_call_parser"] = nilIfEmpty(m.cfg.ToolCallParser)
	info["max_request_body_bytes"] = m.maxBody
	if m.cfg.ZMQEndpoint != "" {
		info["zmq_endpoint"] = m.cfg.ZMQEndpoint
	}
	writeJSON(w, http.StatusOK, info)
}

func (m *Manager) models(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{m.modelCard()}})
}

// modelCard is the served model as the OpenAI model endpoints list it.
func (m *Manager) modelCard() map[string]any {
	return map[string]any{"id": m.modelName(), "object": "model", "created": time.Now().Unix(), "owned_by": "ebb",
		"root": m.modelName(), "max_model_len": m.ctxLen}
}

// model is SGLang's retrieve_model: the served model's card by its name
// (which may hold slashes), a 404 in OpenAI's error form for another.
func (m *Manager) model(w http.ResponseWriter, r *http.Request) {
	if name := r.PathValue("model"); name != m.modelName() {
		writeJSON(w, http.StatusNotFound, map[string]any{"error": map[string]any{
			"message": fmt.Sprintf("The model '%s' does not exist", name), "type": "invalid_request_error",
			"param": "model", "code": "model_not_found"}})
		return
	}
	writeJSON(w, http.StatusOK, m.modelCard())
}

func (m *Manager) generate(w http.ResponseWriter, r *http.Request) {
	var in ioschema.GenerateReqInput
	if err := decodeBody(r, &in); err != nil {
		writeError(w, err)
		return
	}
	if !in.Stream {
		out, err := m.Generate(r.Context(), &in)
		if err != nil {
			writeError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, out)
		return
	}
	prompts, batch, err := m.start(r.Context(), &in)
	if err != nil {
		writeError(w, err)
		return
	}
	sse := newSSE(w)
	// Each chunk carries the request's whole output so far, as SGLang's
	// /generate stream does; batches add "index".
	m.stream(r.Context(), prompts, m.cfg.IncrementalStreamingOutput, func(i int, s snapshot) bool {
		if s.Err != nil {
			sse.send(map[string]any{"error": map[string]any{"message": s.Err.Error()}, "index": i})
			return false
		}
		res := m.generateResult(s, in.ReturnTextInLogprobs)
		if batch {
			res["index"] = i
		}
		return sse.send(res)
	})
	sse.done()
}

// stream calls f with every update of every prompt until all are done
// (incremental: with what is new since the last call, else all of it); if
// the client goes away the unfinished ones are aborted.
func (m *Manager) stream(ctx context.Context, prompts []*prompt, incremental bool, f func(i int, s snapshot) bool) {
	updates := make(chan int, len(prompts))
	stop := make(chan struct{})
	defer close(stop)
	for i, p := range prompts {
		go func() {
			for {
				select {
				case <-p.state.notify:
					select {
					case updates <- i:
					case <-stop:
						return
					}
				case <-stop:
					return
				}
			}
		}()
		updates <- i // an initial look, in case it finished already
	}
	remaining := len(prompts)
	finished := make([]bool, len(prompts))
	sentIDs, sentText := make([]int, len(prompts)), make([]int, len(prompts)) // sent so far, where chunks are incremental
	for remaining > 0 {
		select {
		case <-ctx.Done():
			for i, p := range prompts {
				if !finished[i] {
					m.cancel(p.state)
				}
			}
			return
		case i := <-updates:
			if finished[i] {
				continue
			}
			s := nextChunk(prompts[i].state, incremental, &sentIDs[i], &sentText[i])
			if len(s.OutputIDs) == 0 && !s.Done {
				continue
			}
			if !f(i, s) {
				for j, p := range prompts {
					if !finished[j] {
						m.cancel(p.state)
					}
				}
				return
			}
			if s.Done {
				finished[i] = true
				remaining--
			}
		}
	}
}

// nextChunk is a stream's next look at st: all of its output so far, or
// where incremental (--incremental-streaming-output) what came after the
// ids and text bytes already sent (which it advances).
func nextChunk(st *reqState, incremental bool, ids, text *int) snapshot {
	if !incremental {
		return st.snapshot()
	}
	s := st.snapshotSince(*ids, *text)
	*ids += len(s.OutputIDs)
	*text += len(s.Text)
	return s
}

// sse writes server-sent events.
type sse struct {
	w http.ResponseWriter
	f http.Flusher
}

func newSSE(w http.ResponseWriter) *sse {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	f, _ := w.(http.Flusher)
	return &sse{w: w, f: f}
}

// send writes one event; false means the client is gone.
func (s *sse) send(v any) bool {
	b, err := json.Marshal(v)
	if err != nil {
		return false
	}
	if _, err := fmt.Fprintf(s.w, "data: %s\n\n", b); err != nil {
		return false
	}
	if s.f != nil {
		s.f.Flush()
	}
	return true
}

func (s *sse) done() {
	fmt.Fprint(s.w, "data: [DONE]\n\n")
	if s.f != nil {
		s.f.Flush()
	}
}

// Serve runs the HTTP server until ctx ends.
func (m *Manager) Serve(ctx context.Context, addr string, ready func(addr string)) error {
	srv := &http.Server{Addr: addr, Handler: m.Handler(), ReadHeaderTimeout: 10 * time.Second}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	if ready != nil {
		ready(ln.Addr().String())
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case <-ctx.Done():
		shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shut)
		return nil
	case err := <-errc:
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		m.log.Error("http server", zap.Error(err))
		return err
	}
}
