package model_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"ebb/device/cpu"
	"ebb/model"
	"ebb/safetensors"
	"ebb/tinymodel"
)

// TestExpertTargets: a sparse layer's per-expert checkpoint names land in
// the expert blocks of its fused tensors, the fused names transformers 5
// uses (gate_up_proj, down_proj) address the same memory whole, and a
// dense layer of the same model keeps its own MLP.
func TestExpertTargets(t *testing.T) {
	dir := tinymodel.TestDir(t, "qwen3_moe", func(s *tinymodel.Spec) { s.Layers, s.MLPOnly = 2, []int{0} })
	m, err := model.Load(cpu.New(0), dir, model.Options{ContextLen: 64})
	if err != nil {
		t.Fatal(err)
	}
	c := m.Config.MoE
	h := m.Config.Hidden
	fused, ok := m.TargetByName("model.layers.1.mlp.experts.gate_up_proj")
	if !ok || !slices.Equal(fused.Shape, []int{c.Experts, 2 * c.Intermediate, h}) {
		t.Fatalf("fused gate_up: %v %v", ok, fused.Shape)
	}
	all := cpu.F32(fused.Dst)
	for e := 0; e < c.Experts; e++ {
		for i, part := range []string{"gate_proj", "up_proj"} {
			tg, ok := m.TargetByName("model.layers.1.mlp.experts." + strconv.Itoa(e) + "." + part + ".weight")
			if !ok {
				t.Fatalf("expert %d %s has no target", e, part)
			}
			off := (e*2*c.Intermediate + i*c.Intermediate) * h
			if got := cpu.F32(tg.Dst); !slices.Equal(got, all[off:off+c.Intermediate*h]) {
				t.Fatalf("expert %d %s is not block %d of gate_up_proj", e, part, 2*e+i)
			}
		}
	}
	down, ok := m.TargetByName("model.layers.1.mlp.experts.down_proj")
	if !ok || !slices.Equal(down.Shape, []int{c.Experts, h, c.Intermediate}) {
		t.Fatalf("fused down: %v %v", ok, down.Shape)
	}
	if _, ok := m.TargetByName("model.layers.0.mlp.gate_proj.weight"); !ok {
		t.Fatal("the dense layer has no gate_proj")
	}
	if _, ok := m.TargetByName("model.layers.0.mlp.gate.weight"); ok {
		t.Fatal("the dense layer has a router")
	}
	for _, tg := range m.Targets() {
		if tg.Name == "model.layers.1.mlp.experts.gate_up_proj" {
			t.Fatal("fused names are for updates only: a checkpoint need not have them")
		}
	}
	cfg := *m.Config
	if one, many := cfg.DecodeWeightBytesAt(1), cfg.DecodeWeightBytesAt(256); one >= many {
		t.Fatalf("a step of 256 reads %d bytes of weights, one of 1 %d", many, one)
	}
}

// TestLoadDummy: random weights from the config alone are deterministic,
// ones in the norms, and spread like the checkpoint's in the products.
func TestLoadDummy(t *testing.T) {
	dir := tinymodel.TestDir(t, "qwen3_moe", nil)
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	var weights [2][]float32
	for i := range weights {
		m, err := model.New(cpu.New(0), cfg, model.Options{ContextLen: 64})
		if err != nil {
			t.Fatal(err)
		}
		if err := m.LoadDummy(1); err != nil {
			t.Fatal(err)
		}
		norm, _ := m.TargetByName("model.norm.weight")
		if v := cpu.F32(norm.Dst); slices.Max(v) != 1 || slices.Min(v) != 1 {
			t.Fatal("dummy norm weights are not ones")
		}
		tg, _ := m.TargetByName("model.layers.0.mlp.experts.3.down_proj.weight")
		weights[i] = slices.Clone(cpu.F32(tg.Dst))
	}
	if !slices.Equal(weights[0], weights[1]) {
		t.Fatal("dummy weights differ between loads")
	}
	var sum2 float64
	for _, v := range weights[0] {
		sum2 += float64(v) * float64(v)
	}
	fanIn := cfg.MoE.Intermediate
	if got := sum2 / float64(len(weights[0])) * float64(fanIn); got < 0.8 || got > 1.2 {
		t.Fatalf("dummy weights have variance %.3f/fan_in, want about 1", got)
	}
}

// TestFusedExpertCheckpoint: a checkpoint that holds a sparse layer's
// experts fused, as transformers 5 names them, loads the same weights as
// one with per-expert tensors.
func TestFusedExpertCheckpoint(t *testing.T) {
	dir := tinymodel.TestDir(t, "qwen3_moe", nil)
	want, err := model.Load(cpu.New(0), dir, model.Options{ContextLen: 64})
	if err != nil {
		t.Fatal(err)
	}
	set, err := safetensors.OpenDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	raw := func(name string) []byte {
		src, ok := set.Get(name)
		if !ok || src.DType != safetensors.F32 {
			t.Fatalf("%s: %v", name, ok)
		}
		return src.Data
	}
	c := want.Config
	var tensors []safetensors.Writable
	for _, name := range set.Names() {
		if !strings.Contains(name, "mlp.experts.") {
			src, _ := set.Get(name)
			tensors = append(tensors, safetensors.Writable{Name: name, DType: src.DType, Shape: src.Shape, Data: src.Data})
		}
	}
	for l := 0; l < c.Layers; l++ {
		p := fmt.Sprintf("model.layers.%d.mlp.experts.", l)
		var gateUp, down []byte
		for e := 0; e < c.MoE.Experts; e++ {
			q := p + strconv.Itoa(e) + "."
			gateUp = append(append(gateUp, raw(q+"gate_proj.weight")...), raw(q+"up_proj.weight")...)
			down = append(down, raw(q+"down_proj.weight")...)
		}
		tensors = append(tensors,
			safetensors.Writable{Name: p + "gate_up_proj", DType: safetensors.F32, Shape: []int{c.MoE.Experts, 2 * c.MoE.Intermediate, c.Hidden}, Data: gateUp},
			safetensors.Writable{Name: p + "down_proj", DType: safetensors.F32, Shape: []int{c.MoE.Experts, c.Hidden, c.MoE.Intermediate}, Data: down})
	}
	fusedDir := t.TempDir()
	for _, f := range []string{"config.json"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(fusedDir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := safetensors.Write(filepath.Join(fusedDir, "model.safetensors"), tensors, nil); err != nil {
		t.Fatal(err)
	}
	got, err := model.Load(cpu.New(0), fusedDir, model.Options{ContextLen: 64})
	if err != nil {
		t.Fatal(err)
	}
	for l := range got.W.Layers {
		g, w := got.W.Layers[l], want.W.Layers[l]
		if !slices.Equal(cpu.F32(g.ExpertGateUp), cpu.F32(w.ExpertGateUp)) || !slices.Equal(cpu.F32(g.ExpertDown), cpu.F32(w.ExpertDown)) {
			t.Fatalf("layer %d: fused experts load other weights", l)
		}
	}
}
