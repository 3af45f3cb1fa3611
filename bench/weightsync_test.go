package bench

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"testing"

	"ebb/engine"
	"ebb/tinymodel"
)

// TestWeightsMismatch: the values a trainer reports sending are checked
// against /get_weights_by_name, and any difference, short answer or
// refused name is reported.
func TestWeightsMismatch(t *testing.T) {
	held := map[string][]float64{"a": {1, 2.5, -3}, "b": {0.25}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Name     string `json:"name"`
			Truncate int    `json:"truncate_size"`
		}
		if r.URL.Path != "/get_weights_by_name" || json.NewDecoder(r.Body).Decode(&req) != nil {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		v, ok := held[req.Name]
		if !ok {
			http.Error(w, `{"message":"no parameter named `+req.Name+`"}`, http.StatusBadRequest)
			return
		}
		json.NewEncoder(w).Encode(v[:min(len(v), req.Truncate)])
	}))
	defer srv.Close()
	s := &serveProc{url: srv.URL}
	for _, c := range []struct {
		name  string
		probe map[string][]float64
		want  string // "" or a substring of the mismatch
	}{
		{"equal", map[string][]float64{"a": {1, 2.5, -3}, "b": {0.25}}, ""},
		{"a prefix", map[string][]float64{"a": {1, 2.5}}, ""},
		{"a value", map[string][]float64{"a": {1, 2.5, 3}}, "a[2] = -3, sent 3"},
		{"short answer", map[string][]float64{"b": {0.25, 1}}, "gave 1 values for 2 sent"},
		{"unknown name", map[string][]float64{"c": {1}}, "no parameter named c"},
		{"nothing reported", nil, "no values to check"},
	} {
		got := weightsMismatch(s, c.probe)
		if (c.want == "") != (got == "") || !strings.Contains(got, c.want) {
			t.Errorf("%s: mismatch %q, want %q", c.name, got, c.want)
		}
	}
}

// TestWeightSyncCPU runs weight-sync against `ebb serve --device cpu` with
// Debian's python3-torch as the trainer (shared-memory tensors): the
// weights read back are the ones sent, and the server then generates as one
// started on them.
func TestWeightSyncCPU(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ebb")
	}
	if err := exec.Command("/usr/bin/python3", "-c", "import torch").Run(); err != nil {
		t.Skip("no PyTorch for /usr/bin/python3 (scripts/install-deps.sh installs python3-torch)")
	}
	exe := buildEBB(t)
	dir := tinymodel.TestDir(t, "qwen3", func(s *tinymodel.Spec) { s.Tie = false })
	other := tinymodel.TestDir(t, "qwen3", func(s *tinymodel.Spec) { s.Tie, s.Seed = false, 77 })
	rep, err := WeightSync(WeightSyncConfig{
		Engine:     engine.Config{ModelDir: dir, Device: "cpu"},
		Path:       "shm",
		NewWeights: other,
		BucketsMB:  []int{1},
		Format:     "flattened",
		Repeats:    2,
		Trainer:    "/usr/bin/python3 ../tools/weight_update_trainer.py",
		Executable: exe,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Buckets) != 1 || rep.Buckets[0].Bytes <= 0 || len(rep.Buckets[0].UpdatesMs) != 2 {
		t.Fatalf("buckets %+v", rep.Buckets)
	}
	if !rep.WeightsMatchSent || rep.OutputsMatchFresh == nil || !*rep.OutputsMatchFresh {
		t.Fatalf("weights match %v (%s), outputs match a fresh server %v", rep.WeightsMatchSent, rep.WeightsMismatch, rep.OutputsMatchFresh)
	}
}
