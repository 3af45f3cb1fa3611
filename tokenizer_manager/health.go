package tokenizermanager

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"ebb/ioschema"
)

// healthTimeout is how long /health_generate waits for an answer
// (SGLang's HEALTH_CHECK_TIMEOUT).
const healthTimeout = 20 * time.Second

// healthPoll is how often a busy engine's step count is read again.
const healthPoll = 50 * time.Millisecond

// healthProbe is what a health check needs of the server: each engine's
// server_info, and a one-token generation on one engine.
type healthProbe interface {
	engineInfos(ctx context.Context) ([]map[string]any, error)
	generateOne(ctx context.Context, dpRank int) error
}

// checkHealth says whether every engine generates, as SGLang's
// /health_generate does. An engine with requests running is healthy once
// it finishes a step: SGLang skips the probe there too, since behind
// hundreds of queued rollouts a one-token request would time out and a
// router or a readiness probe would drop a server that is working. An idle
// engine must generate a token. An engine that cannot generate now
// (paused, memory released, stale weights) fails at once, with why.
func checkHealth(ctx context.Context, p healthProbe, poll time.Duration) error {
	infos, err := p.engineInfos(ctx)
	if err != nil {
		return err
	}
	busy := map[int]float64{} // engine -> its step count at the first look
	for _, in := range infos {
		if err := blocked(in); err != nil {
			return err
		}
		rank := infoInt(in, "dp_rank")
		if infoInt(in, "num_running_reqs") > 0 {
			busy[rank], _ = toFloat(in["forward_ct"])
			continue
		}
		if err := p.generateOne(ctx, rank); err != nil {
			return err
		}
	}
	for len(busy) > 0 {
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d engine(s) with requests running finished no step in %v", len(busy), healthTimeout)
		case <-time.After(poll):
		}
		infos, err := p.engineInfos(ctx)
		if err != nil {
			return err
		}
		for _, in := range infos {
			rank := infoInt(in, "dp_rank")
			before, ok := busy[rank]
			if !ok {
				continue
			}
			if err := blocked(in); err != nil {
				return err
			}
			if now, _ := toFloat(in["forward_ct"]); now > before {
				delete(busy, rank)
				continue
			}
			if infoInt(in, "num_running_reqs") == 0 {
				// Its requests ended (aborted, say) without a step seen.
				if err := p.generateOne(ctx, rank); err != nil {
					return err
				}
				delete(busy, rank)
			}
		}
	}
	return nil
}

// blocked is why an engine's server_info says it cannot generate now, or
// nil.
func blocked(info map[string]any) error {
	if why, _ := info["generation_blocked"].(string); why != "" {
		return fmt.Errorf("generation is blocked: %s", why)
	}
	return nil
}

func infoInt(info map[string]any, key string) int {
	v, _ := toFloat(info[key])
	return int(v)
}

// healthGenerate is SGLang's /health_generate: 200 when generation works,
// 503 with the reason otherwise.
func (m *Manager) healthGenerate(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), healthTimeout)
	defer cancel()
	if err := checkHealth(ctx, m, healthPoll); err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]any{"error": map[string]any{"message": err.Error(), "code": http.StatusServiceUnavailable}})
		return
	}
	w.WriteHeader(http.StatusOK)
}

// engineInfos is every engine's server_info, in the order the engines
// answered (each carries its dp_rank).
func (m *Manager) engineInfos(ctx context.Context) ([]map[string]any, error) {
	reply, err := m.Control(ctx, &ioschema.GetServerInfoReqInput{})
	if err != nil {
		return nil, err
	}
	info, ok := reply.(*ioschema.GetServerInfoReqOutput)
	if !ok {
		if e, isErr := reply.(*ioschema.ErrorOutput); isErr {
			return nil, errors.New(e.Message)
		}
		return nil, fmt.Errorf("unexpected reply %s", reply.TypeName())
	}
	if infos, ok := info.Info["engines"].([]map[string]any); ok {
		return infos, nil
	}
	return []map[string]any{info.Info}, nil
}

// generateOne runs a one-token greedy generation on engine dpRank.
func (m *Manager) generateOne(ctx context.Context, dpRank int) error {
	one, zero := 1, 0.0
	in := &ioschema.GenerateReqInput{InputIDs: ioschema.InputIDBatch{Items: [][]int32{{0}}},
		SamplingParams: ioschema.SamplingBatch{Items: []ioschema.SamplingParams{{MaxNewTokens: &one, Temperature: &zero}}},
		Rid:            ioschema.Rids{Items: []string{"health-" + newRid()}}}
	if m.engines > 1 {
		in.RoutedDPRank = &dpRank
	}
	_, err := m.Generate(ctx, in)
	return err
}
