package launcher

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"ebb/safetensors"
	"ebb/tinymodel"
)

// TestWeightsFromTrainerCPU: a PyTorch process (Debian's python3-torch)
// updates a running `ebb serve --device cpu` through shared-memory tensors,
// as verl and slime send them (a list, a flattened bucket, per-rank
// LocalSerializedTensors, float32 casts), in buckets; afterwards the
// weights read back equal the sent ones and greedy output equals a server
// started on those weights. Hostile and malformed payloads are refused
// and leave the weights as they were.
func TestWeightsFromTrainerCPU(t *testing.T) {
	other, want := trainerModel(t, 77)
	s := startServer(t)
	original := s.greedy(t)
	if slices.Equal(original, want) {
		t.Fatal("the two models generate alike: the test would prove nothing")
	}
	set, err := safetensors.OpenDir(other)
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	checkWeights := func(t *testing.T, s *server, from *safetensors.Set) {
		t.Helper()
		for _, name := range []string{"model.norm.weight", "model.layers.1.self_attn.k_proj.weight", "lm_head.weight", "model.embed_tokens.weight"} {
			var got []float64
			s.post(t, "/get_weights_by_name", map[string]any{"name": name, "truncate_size": 64}, &got)
			src, _ := from.Get(name)
			vals, err := src.Float32()
			if err != nil {
				t.Fatal(err)
			}
			for i, v := range got {
				if float32(v) != vals[i] {
					t.Fatalf("%s[%d] = %v, sent %v", name, i, v, vals[i])
				}
			}
		}
	}
	for _, c := range [][]string{{"--format", "list"}, {"--format", "flattened"}, {"--format", "local", "--tp-size", "2"},
		{"--format", "list", "--dtype", "float32"}} {
		t.Run(strings.Join(c, " "), func(t *testing.T) {
			args := append([]string{"../tools/weight_update_trainer.py", "--url", s.url, "--model", other, "--transport", "shm",
				"--bucket-mb", "1", "--repeat", "2"}, c...)
			out, err := exec.Command("/usr/bin/python3", args...).CombinedOutput()
			if err != nil {
				t.Fatalf("%v\n%s\nserver:\n%s", err, out, s.log.String())
			}
			var rep struct {
				ShmRefcounts []int `json:"shm_refcounts"`
			}
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			if err := json.Unmarshal([]byte(lines[len(lines)-1]), &rep); err != nil {
				t.Fatalf("trainer: %s", out)
			}
			if !slices.Equal(rep.ShmRefcounts, []int{1}) {
				t.Fatalf("shared memory reference counts after the updates: %v (the server must give back what it was given)", rep.ShmRefcounts)
			}
			checkWeights(t, s, set)
			if got := s.greedy(t); !slices.Equal(got, want) {
				t.Fatalf("after the update: %v, a server on the same weights: %v", got, want)
			}
			if v := s.info(t)["weight_version"]; v != "shm-1" {
				t.Fatalf("weight_version %v", v)
			}
			s.mustPost(t, "/update_weights_from_disk", map[string]any{"model_path": modelDir})
			if got := s.greedy(t); !slices.Equal(got, original) {
				t.Fatal("restoring from disk did not give the original output")
			}
		})
	}
	// Refused payloads, made by one PyTorch process: nothing changes.
	before := s.greedy(t)
	script := `import base64, io, json, os, torch, torch.multiprocessing
from multiprocessing.reduction import ForkingPickler
class Evil:
    def __reduce__(self): return (os.system, ("touch /tmp/ebb-pwned",))
def shared(t): return t.share_memory_()
def raw(o):
    b = io.BytesIO(); ForkingPickler(b).dump(o); return b.getvalue()
def out(name, b): print(json.dumps({"name": name, "payload": base64.b64encode(b).decode()}))
torch.multiprocessing.set_sharing_strategy("file_system")
out("other globals", raw([("model.norm.weight", Evil())]))
out("unknown name", raw([("model.layers.9.mlp.up_proj.weight", shared(torch.ones(192, 64)))]))
out("wrong shape", raw([("model.norm.weight", shared(torch.ones(63)))]))
out("integer dtype", raw([("model.norm.weight", shared(torch.ones(64, dtype=torch.int64)))]))
out("one bad among good", raw([("model.norm.weight", shared(torch.zeros(64))), ("nope", shared(torch.ones(1)))]))
out("not contiguous", raw([("model.layers.0.self_attn.o_proj.weight", shared(torch.zeros(128, 64)).t())]))
out("truncated", raw([("model.norm.weight", shared(torch.zeros(64)))])[:40])
torch.multiprocessing.set_sharing_strategy("file_descriptor")
out("file_descriptor strategy", raw([("model.norm.weight", torch.zeros(64).share_memory_())]))
`
	out, err := exec.Command("/usr/bin/python3", "-c", script).Output()
	if err != nil {
		t.Fatalf("%v %s", err, out)
	}
	wantMsg := map[string]string{"other globals": "posix.system", "unknown name": "no parameter named", "wrong shape": "shape [63]",
		"integer dtype": "int64", "one bad among good": "nope", "not contiguous": "not contiguous", "truncated": "truncated",
		"file_descriptor strategy": "file_system"}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != len(wantMsg) {
		t.Fatalf("python printed %d payloads", len(lines))
	}
	for _, l := range lines {
		var c struct{ Name, Payload string }
		if err := json.Unmarshal([]byte(l), &c); err != nil {
			t.Fatal(err)
		}
		var res map[string]any
		code := s.post(t, "/update_weights_from_tensor", map[string]any{"serialized_named_tensors": []string{c.Payload}}, &res)
		if code != 400 || !strings.Contains(fmtJSON(res), wantMsg[c.Name]) {
			t.Errorf("%s: status %d %v (want a 400 naming %q)", c.Name, code, res, wantMsg[c.Name])
		}
	}
	if got := s.greedy(t); !slices.Equal(got, before) {
		t.Fatal("a refused update changed the weights")
	}
}

func (s *server) stop(t *testing.T) {
	t.Helper()
	_ = s.cmd.Process.Kill()
	<-s.exited
	s.exited <- nil
}

// TestWeightsFromTrainerTensorParallelCPU: a two-rank server takes one
// payload per rank of whole tensors (SGLang's convention), each rank keeps
// its part, and it then generates as a server started on those weights.
func TestWeightsFromTrainerTensorParallelCPU(t *testing.T) {
	other, want := trainerModel(t, 78, "--tp-size", "2")
	s := startServer(t, "--tp-size", "2")
	defer s.stop(t)
	original := s.greedy(t)
	if slices.Equal(original, want) {
		t.Fatal("the two models generate alike: the test would prove nothing")
	}
	for _, format := range []string{"list", "flattened"} {
		out, err := exec.Command("/usr/bin/python3", "../tools/weight_update_trainer.py", "--url", s.url, "--model", other,
			"--transport", "shm", "--bucket-mb", "1", "--format", format, "--tp-size", "2").CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s\nserver:\n%s", format, err, out, s.log.String())
		}
		if got := s.greedy(t); !slices.Equal(got, want) {
			t.Fatalf("%s: after the update %v, a server on the same weights %v", format, got, want)
		}
		s.mustPost(t, "/update_weights_from_disk", map[string]any{"model_path": modelDir})
		if got := s.greedy(t); !slices.Equal(got, original) {
			t.Fatalf("%s: restoring from disk did not give the original output", format)
		}
	}
	var res map[string]any
	code := s.post(t, "/update_weights_from_tensor", map[string]any{"serialized_named_tensors": []string{"eA=="}}, &res)
	if code != 400 || !strings.Contains(fmtJSON(res), "none for TP rank 1") {
		t.Fatalf("one payload for two ranks: status %d %v", code, res)
	}
}

// trainerModel skips without PyTorch, else writes the model a trainer
// sends (seed) and returns it with the greedy output of a server started
// on it (with extra flags).
func trainerModel(t *testing.T, seed uint64, extra ...string) (string, []int32) {
	t.Helper()
	if err := exec.Command("/usr/bin/python3", "-c", "import torch").Run(); err != nil {
		t.Skip("no PyTorch for /usr/bin/python3 (scripts/install-deps.sh installs python3-torch)")
	}
	other := filepath.Join(t.TempDir(), "other")
	spec, _ := tinymodel.Default("qwen3")
	spec.Tie, spec.Seed = false, seed
	if err := tinymodel.Write(other, spec); err != nil {
		t.Fatal(err)
	}
	ref := startServer(t, append([]string{"--model-path", other}, extra...)...)
	defer ref.stop(t)
	return other, ref.greedy(t)
}
