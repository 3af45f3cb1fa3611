package model

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"ebb/device"
	"ebb/safetensors"
)

// Layer holds one decoder layer's weights on the device. q/k/v and
// gate/up are stored fused, so one GEMM computes each.
type Layer struct {
	InputNorm, PostNorm device.Tensor
	QKV, QKVBias, O     device.Tensor
	OBias               device.Tensor
	QNorm, KNorm        device.Tensor
	GateUp, Down        device.Tensor // a dense MLP
	// A sparse MLP: the router [E, H], every expert's gate and up rows
	// [E, 2I, H] (as transformers 5 fuses them) and down [E, H, I].
	Router                   device.Tensor
	ExpertGateUp, ExpertDown device.Tensor
	// Qwen2-MoE's shared expert: gate and up rows [2S, H], down [H, S],
	// and its gate [1, H].
	SharedGateUp, SharedDown, SharedGate device.Tensor
}

// Sparse reports whether the layer has experts.
func (l *Layer) Sparse() bool { return l.Router.Valid() }

// Weights are the model's parameters on the device.
type Weights struct {
	Embed, Norm, LMHead device.Tensor
	Layers              []Layer
	RopeCos, RopeSin    device.Tensor // derived from the config, not from a checkpoint
}

// Target is where one checkpoint tensor lives on the device: a tensor, or a
// block of rows of a fused one.
type Target struct {
	Name  string
	Shape []int
	Dst   device.Tensor
	// Rows and Cols are this rank's part of the checkpoint tensor (a
	// tensor-parallel shard); zero is all of it.
	Rows, Cols span
}

// Whole reports whether the target takes the entire checkpoint tensor.
func (t Target) Whole() bool { return t.Rows.whole() && t.Cols.whole() }

// Targets maps every checkpoint tensor name to its place on the device.
// Tied embeddings have no lm_head entry.
func (m *Model) Targets() []Target {
	c, g := m.Config, m.Global
	w := &m.W
	d := c.HeadDim
	var none span
	vocab := m.Shard.vocabSpan(c)
	targets := []Target{
		{"model.embed_tokens.weight", []int{c.Vocab, c.Hidden}, w.Embed, vocab, none},
		{"model.norm.weight", []int{c.Hidden}, w.Norm, none, none},
	}
	if !c.TieEmbeddings {
		targets = append(targets, Target{"lm_head.weight", []int{c.Vocab, c.Hidden}, w.LMHead, vocab, none})
	}
	// Local row counts, the global ones of the checkpoint, and where this
	// rank's rows start in it (all zero offsets without tensor parallelism).
	qRows, kvRows, inter := c.Heads*d, c.KVHeads*d, c.Intermediate
	gqRows, gkvRows, ginter := g.Heads*d, g.KVHeads*d, g.Intermediate
	var q, kv, mlp span
	if m.Shard.Sharded() {
		q = span{m.Shard.Rank * qRows, (m.Shard.Rank + 1) * qRows}
		k0 := m.Shard.kvHead0(g) * d
		kv = span{k0, k0 + kvRows}
		mlp = span{m.Shard.Rank * inter, (m.Shard.Rank + 1) * inter}
	}
	for i, l := range w.Layers {
		p := fmt.Sprintf("model.layers.%d.", i)
		add := func(name string, shape []int, dst device.Tensor, rows, cols span) {
			targets = append(targets, Target{p + name, shape, dst, rows, cols})
		}
		add("input_layernorm.weight", []int{c.Hidden}, l.InputNorm, none, none)
		add("post_attention_layernorm.weight", []int{c.Hidden}, l.PostNorm, none, none)
		add("self_attn.q_proj.weight", []int{gqRows, c.Hidden}, l.QKV.Rows(0, qRows), q, none)
		add("self_attn.k_proj.weight", []int{gkvRows, c.Hidden}, l.QKV.Rows(qRows, qRows+kvRows), kv, none)
		add("self_attn.v_proj.weight", []int{gkvRows, c.Hidden}, l.QKV.Rows(qRows+kvRows, qRows+2*kvRows), kv, none)
		add("self_attn.o_proj.weight", []int{c.Hidden, gqRows}, l.O, none, q)
		if c.AttentionBias {
			add("self_attn.q_proj.bias", []int{gqRows}, l.QKVBias.Rows(0, qRows), q, none)
			add("self_attn.k_proj.bias", []int{gkvRows}, l.QKVBias.Rows(qRows, qRows+kvRows), kv, none)
			add("self_attn.v_proj.bias", []int{gkvRows}, l.QKVBias.Rows(qRows+kvRows, qRows+2*kvRows), kv, none)
		}
		if l.OBias.Valid() { // rank 0 only: the partial sums must add it once
			add("self_attn.o_proj.bias", []int{c.Hidden}, l.OBias, none, none)
		}
		if c.QKNorm {
			add("self_attn.q_norm.weight", []int{d}, l.QNorm, none, none)
			add("self_attn.k_norm.weight", []int{d}, l.KNorm, none, none)
		}
		if !l.Sparse() {
			add("mlp.gate_proj.weight", []int{ginter, c.Hidden}, l.GateUp.Rows(0, inter), mlp, none)
			add("mlp.up_proj.weight", []int{ginter, c.Hidden}, l.GateUp.Rows(inter, 2*inter), mlp, none)
			add("mlp.down_proj.weight", []int{c.Hidden, ginter}, l.Down, none, mlp)
			continue
		}
		mi, gmi := c.MoE.Intermediate, g.MoE.Intermediate
		var ex span
		if m.Shard.Sharded() {
			ex = span{m.Shard.Rank * mi, (m.Shard.Rank + 1) * mi}
		}
		add("mlp.gate.weight", []int{c.MoE.Experts, c.Hidden}, l.Router, none, none)
		for e := 0; e < c.MoE.Experts; e++ {
			gu := l.ExpertGateUp.Rows(e, e+1).View(2*mi, c.Hidden)
			q := fmt.Sprintf("mlp.experts.%d.", e)
			add(q+"gate_proj.weight", []int{gmi, c.Hidden}, gu.Rows(0, mi), ex, none)
			add(q+"up_proj.weight", []int{gmi, c.Hidden}, gu.Rows(mi, 2*mi), ex, none)
			add(q+"down_proj.weight", []int{c.Hidden, gmi}, l.ExpertDown.Rows(e, e+1).View(c.Hidden, mi), none, ex)
		}
		if si, gsi := c.MoE.SharedIntermediate, g.MoE.SharedIntermediate; si > 0 {
			var sh span
			if m.Shard.Sharded() {
				sh = span{m.Shard.Rank * si, (m.Shard.Rank + 1) * si}
			}
			add("mlp.shared_expert.gate_proj.weight", []int{gsi, c.Hidden}, l.SharedGateUp.Rows(0, si), sh, none)
			add("mlp.shared_expert.up_proj.weight", []int{gsi, c.Hidden}, l.SharedGateUp.Rows(si, 2*si), sh, none)
			add("mlp.shared_expert.down_proj.weight", []int{c.Hidden, gsi}, l.SharedDown, none, sh)
			add("mlp.shared_expert_gate.weight", []int{1, c.Hidden}, l.SharedGate, none, none)
		}
	}
	return targets
}

// fusedExpertTargets are the names transformers 5 gives a sparse layer's
// experts as one tensor each ([E, 2I, H] gate then up, and [E, H, I]),
// which trainers may send instead of the per-expert ones. Checkpoints keep
// per-expert tensors, so these are not part of Targets; a rank of a
// tensor-parallel group would need a block of every expert, so only an
// unsplit model takes them.
func (m *Model) fusedExpertTargets() []Target {
	if m.Shard.Sharded() {
		return nil
	}
	c := m.Config
	var out []Target
	for i, l := range m.W.Layers {
		if !l.Sparse() {
			continue
		}
		p := fmt.Sprintf("model.layers.%d.mlp.experts.", i)
		out = append(out,
			Target{Name: p + "gate_up_proj", Shape: []int{c.MoE.Experts, 2 * c.MoE.Intermediate, c.Hidden}, Dst: l.ExpertGateUp},
			Target{Name: p + "down_proj", Shape: []int{c.MoE.Experts, c.Hidden, c.MoE.Intermediate}, Dst: l.ExpertDown})
	}
	return out
}

// checkpointTargets is Targets, except that a sparse layer whose experts
// the checkpoint holds fused (transformers 5's gate_up_proj and down_proj)
// takes them from there.
func (m *Model) checkpointTargets(set *safetensors.Set) []Target {
	fused := map[string]bool{} // layer prefixes whose experts come fused
	var extra []Target
	for _, f := range m.fusedExpertTargets() {
		prefix := strings.TrimSuffix(strings.TrimSuffix(f.Name, "gate_up_proj"), "down_proj")
		if _, ok := set.Get(prefix + "gate_up_proj"); ok {
			fused[prefix] = true
			extra = append(extra, f)
		}
	}
	if len(extra) == 0 {
		return m.Targets()
	}
	var out []Target
	for _, t := range m.Targets() {
		if i := strings.Index(t.Name, "mlp.experts."); i >= 0 && fused[t.Name[:i+len("mlp.experts.")]] {
			continue
		}
		out = append(out, t)
	}
	return append(out, extra...)
}

// TargetByName finds a checkpoint tensor's place; tied lm_head resolves to
// the embedding.
func (m *Model) TargetByName(name string) (Target, bool) {
	if m.Config.TieEmbeddings && name == "lm_head.weight" {
		name = "model.embed_tokens.weight"
	}
	if m.targetIndex == nil {
		// A 128-expert model has tens of thousands of tensors, and an
		// update looks up each of them.
		m.targetIndex = map[string]Target{}
		for _, t := range append(m.Targets(), m.fusedExpertTargets()...) {
			m.targetIndex[t.Name] = t
		}
	}
	t, ok := m.targetIndex[name]
	return t, ok
}

// allocWeights creates every weight tensor in the weights region.
func (m *Model) allocWeights(ropePositions int) error {
	c, dev := m.Config, m.dev
	dt := dev.DType()
	var firstErr error
	alloc := func(dtype device.DType, shape ...int) device.Tensor {
		if firstErr != nil {
			return device.Tensor{}
		}
		t, err := dev.Alloc("weights", dtype, shape...)
		if err != nil {
			firstErr = err
		}
		return t
	}
	w := &m.W
	w.Embed = alloc(dt, c.LocalVocab(), c.Hidden)
	w.Norm = alloc(dt, c.Hidden)
	w.LMHead = w.Embed
	if !c.TieEmbeddings {
		w.LMHead = alloc(dt, c.LocalVocab(), c.Hidden)
	}
	w.Layers = make([]Layer, c.Layers)
	for i := range w.Layers {
		l := &w.Layers[i]
		l.InputNorm = alloc(dt, c.Hidden)
		l.PostNorm = alloc(dt, c.Hidden)
		l.QKV = alloc(dt, c.QKVRows(), c.Hidden)
		if c.AttentionBias {
			l.QKVBias = alloc(dt, c.QKVRows())
		}
		l.O = alloc(dt, c.Hidden, c.Heads*c.HeadDim)
		if c.OutputBias && m.Shard.Rank == 0 {
			l.OBias = alloc(dt, c.Hidden)
		}
		if c.QKNorm {
			l.QNorm = alloc(dt, c.HeadDim)
			l.KNorm = alloc(dt, c.HeadDim)
		}
		if c.Sparse(i) {
			mi := c.MoE.Intermediate
			l.Router = alloc(dt, c.MoE.Experts, c.Hidden)
			l.ExpertGateUp = alloc(dt, c.MoE.Experts, 2*mi, c.Hidden)
			l.ExpertDown = alloc(dt, c.MoE.Experts, c.Hidden, mi)
			if si := c.MoE.SharedIntermediate; si > 0 {
				l.SharedGateUp = alloc(dt, 2*si, c.Hidden)
				l.SharedDown = alloc(dt, c.Hidden, si)
				l.SharedGate = alloc(dt, 1, c.Hidden)
			}
			continue
		}
		l.GateUp = alloc(dt, 2*c.Intermediate, c.Hidden)
		l.Down = alloc(dt, c.Hidden, c.Intermediate)
	}
	w.RopeCos = alloc(device.F32, ropePositions, c.HeadDim/2)
	w.RopeSin = alloc(device.F32, ropePositions, c.HeadDim/2)
	return firstErr
}

// WeightBytes is the size of the weights region the model needs on dev.
func WeightBytes(c *Config, dt device.DType, ropePositions int) int64 {
	perLayer := int64(2*c.Hidden + c.QKVRows()*c.Hidden + c.Hidden*c.Heads*c.HeadDim)
	if c.AttentionBias {
		perLayer += int64(c.QKVRows())
	}
	if c.OutputBias {
		perLayer += int64(c.Hidden)
	}
	if c.QKNorm {
		perLayer += int64(2 * c.HeadDim)
	}
	n := int64(c.LocalVocab()*c.Hidden+c.Hidden) + int64(c.Layers)*perLayer
	for i := 0; i < c.Layers; i++ {
		if c.Sparse(i) {
			n += int64(c.MoE.Experts) * int64(c.Hidden) * int64(1+3*c.MoE.Intermediate)
			if si := c.MoE.SharedIntermediate; si > 0 {
				n += int64(c.Hidden) * int64(1+3*si)
			}
		} else {
			n += int64(3*c.Intermediate) * int64(c.Hidden)
		}
	}
	if !c.TieEmbeddings {
		n += int64(c.LocalVocab() * c.Hidden)
	}
	tensors := int64(c.Layers*16 + 6)
	return n*int64(dt.Size()) + int64(ropePositions*c.HeadDim)*4 + tensors*512
}

// uploadRope writes the rotary tables (they live with the weights).
func (m *Model) uploadRope() error {
	cos, sin := m.Config.RopeTables(m.W.RopeCos.Dim(0))
	if err := m.dev.Upload(m.W.RopeCos, f32Bytes(cos), device.F32); err != nil {
		return err
	}
	return m.dev.Upload(m.W.RopeSin, f32Bytes(sin), device.F32)
}

// CheckCheckpoint verifies that a checkpoint has every tensor the model
// needs with the right shape and a float dtype, before anything is written.
func (m *Model) CheckCheckpoint(set *safetensors.Set) error {
	var errs []error
	for _, t := range m.checkpointTargets(set) {
		src, ok := set.Get(t.Name)
		if !ok {
			errs = append(errs, fmt.Errorf("missing tensor %s", t.Name))
			continue
		}
		if !slices.Equal(src.Shape, t.Shape) {
			errs = append(errs, fmt.Errorf("tensor %s has shape %v, want %v", t.Name, src.Shape, t.Shape))
		}
		if _, err := sourceDType(src.DType); err != nil {
			errs = append(errs, fmt.Errorf("tensor %s: %w", t.Name, err))
		}
	}
	return errors.Join(errs...)
}

func sourceDType(d safetensors.DType) (device.DType, error) {
	switch d {
	case safetensors.F32:
		return device.F32, nil
	case safetensors.BF16:
		return device.BF16, nil
	case safetensors.F16:
		return device.F16, nil
	}
	return 0, fmt.Errorf("unsupported dtype %s (need F32, BF16 or F16)", d)
}

// LoadCheckpoint checks and then uploads every tensor of a checkpoint in
// place. A mismatch leaves the device weights untouched.
func (m *Model) LoadCheckpoint(set *safetensors.Set) error {
	if err := m.CheckCheckpoint(set); err != nil {
		return err
	}
	for _, t := range m.checkpointTargets(set) {
		src, _ := set.Get(t.Name)
		dt, _ := sourceDType(src.DType)
		if err := m.dev.Upload(t.Dst, slice(src.Data, src.Shape, dt.Size(), t.Rows, t.Cols), dt); err != nil {
			return fmt.Errorf("upload %s: %w", t.Name, err)
		}
	}
	if err := m.uploadRope(); err != nil {
		return fmt.Errorf("upload rotary tables: %w", err)
	}
	return m.dev.Sync()
}
