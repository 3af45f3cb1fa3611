package tokenizermanager

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
)

// fakeEngines plays a server's engines for checkHealth: each look at the
// infos advances the engines that step by one step each.
type fakeEngines struct {
	infos    []map[string]any
	stepping []bool // per engine: whether its steps advance between looks
	genErr   error
	probed   []int // engines asked for a one-token generation
	looks    int
}

func (f *fakeEngines) engineInfos(context.Context) ([]map[string]any, error) {
	if f.looks > 0 {
		for i, in := range f.infos {
			if f.stepping[i] {
				in["forward_ct"] = in["forward_ct"].(int) + 1
			}
		}
	}
	f.looks++
	out := make([]map[string]any, len(f.infos))
	for i, in := range f.infos {
		out[i] = map[string]any{}
		for k, v := range in {
			out[i][k] = v
		}
	}
	return out, nil
}

func (f *fakeEngines) generateOne(_ context.Context, rank int) error {
	f.probed = append(f.probed, rank)
	return f.genErr
}

func engine(rank, running, steps int, blocked string) map[string]any {
	return map[string]any{"dp_rank": rank, "num_running_reqs": running, "forward_ct": steps, "generation_blocked": blocked}
}

func TestCheckHealth(t *testing.T) {
	for _, c := range []struct {
		name     string
		infos    []map[string]any
		stepping []bool
		genErr   error
		probed   []int
		err      string
	}{
		{"idle: one token", []map[string]any{engine(0, 0, 5, "")}, []bool{false}, nil, []int{0}, ""},
		{"idle, generation fails", []map[string]any{engine(0, 0, 5, "")}, []bool{false}, errors.New("server shutting down"), []int{0}, "shutting down"},
		{"busy and stepping: no probe queued behind its requests", []map[string]any{engine(0, 40, 5, "")}, []bool{true}, nil, nil, ""},
		{"busy and stuck", []map[string]any{engine(0, 40, 5, "")}, []bool{false}, nil, nil, "finished no step"},
		{"blocked", []map[string]any{engine(0, 3, 5, "memory is released: kv_cache")}, []bool{true}, nil, nil, "released"},
		{"two engines, one busy, one idle", []map[string]any{engine(0, 9, 1, ""), engine(1, 0, 1, "")}, []bool{true, false}, nil, []int{1}, ""},
		{"one of two blocked", []map[string]any{engine(0, 0, 1, ""), engine(1, 0, 1, "generation is paused")}, []bool{false, false}, nil, []int{0}, "paused"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := &fakeEngines{infos: c.infos, stepping: c.stepping, genErr: c.genErr}
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			defer cancel()
			err := checkHealth(ctx, f, time.Millisecond)
			if c.err == "" && err != nil || c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)) {
				t.Fatalf("err %v, want %q", err, c.err)
			}
			if !slices.Equal(f.probed, c.probed) {
				t.Fatalf("probed engines %v, want %v", f.probed, c.probed)
			}
		})
	}
}

// TestCheckHealthProbesAnEngineThatStoppedWithoutAStep: requests that end
// without a step seen (aborted) leave an idle engine, which must generate.
func TestCheckHealthProbesAnEngineThatStoppedWithoutAStep(t *testing.T) {
	f := &fakeEngines{infos: []map[string]any{engine(0, 2, 7, "")}, stepping: []bool{false}}
	p := &stopsAfterFirstLook{fakeEngines: f}
	if err := checkHealth(context.Background(), p, time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(f.probed, []int{0}) {
		t.Fatalf("probed %v", f.probed)
	}
}

type stopsAfterFirstLook struct{ *fakeEngines }

func (s *stopsAfterFirstLook) engineInfos(ctx context.Context) ([]map[string]any, error) {
	infos, err := s.fakeEngines.engineInfos(ctx)
	if s.looks > 1 {
		infos[0]["num_running_reqs"] = 0
	}
	return infos, err
}
