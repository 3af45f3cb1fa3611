package model

import (
	"fmt"
	"math"
	"unsafe"

	"ebb/device"
	"ebb/memory"
	"ebb/safetensors"
)

// Model is a loaded transformer on a device.
type Model struct {
	// Config is what this rank computes with; with tensor parallelism its
	// heads and intermediate size are this rank's share of Global's.
	Config *Config
	Global *Config
	Shard  Shard
	// Comm adds up the ranks' partial sums (nil without tensor parallelism).
	Comm device.Collective
	dev  device.Device
	W    Weights
	// KV cache: K and V of layer l are KV[2l] and KV[2l+1], each [slots, Hk, D].
	KV    []device.Tensor
	kvBuf device.Tensor
	// targetIndex maps checkpoint names to places, built on first use.
	targetIndex map[string]Target
}

// Options size the model's device state.
type Options struct {
	// ContextLen bounds positions (the rotary tables); 0 means the config's
	// max_position_embeddings.
	ContextLen int
	// CPUBackup keeps a host copy of the weights across memory releases.
	CPUBackup bool
	// Shard and Comm make the model one rank of a tensor-parallel group.
	Shard Shard
	Comm  device.Collective
}

// New allocates the model's weights (uninitialised) in the weights region,
// creating the region.
func New(dev device.Device, cfg *Config, opts Options) (*Model, error) {
	ctx := opts.ContextLen
	if ctx <= 0 || ctx > cfg.MaxPositions {
		ctx = cfg.MaxPositions
	}
	if opts.Shard.Sharded() != (opts.Comm != nil) {
		return nil, fmt.Errorf("a tensor-parallel shard needs a collective, and only a shard has one")
	}
	local, err := opts.Shard.LocalConfig(cfg)
	if err != nil {
		return nil, err
	}
	if _, ok := dev.(device.MoE); cfg.MoE != nil && !ok {
		return nil, fmt.Errorf("%s is a mixture-of-experts model and the %s device has no expert kernels", cfg.Arch, dev.Name())
	}
	m := &Model{Config: local, Global: cfg, Shard: opts.Shard, Comm: opts.Comm, dev: dev}
	size := WeightBytes(local, dev.DType(), ctx)
	_, err = dev.Memory().Create(memory.Weights, memory.RegionOptions{
		Capacity: size, GrowStep: size, PreserveContents: true, CPUBackup: opts.CPUBackup,
	})
	if err != nil {
		return nil, fmt.Errorf("weights region: %w", err)
	}
	if err := m.allocWeights(ctx); err != nil {
		return nil, fmt.Errorf("allocate weights: %w", err)
	}
	return m, nil
}

// Load reads config.json and the safetensors of dir onto dev.
func Load(dev device.Device, dir string, opts Options) (*Model, error) {
	cfg, err := LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	m, err := New(dev, cfg, opts)
	if err != nil {
		return nil, err
	}
	set, err := safetensors.OpenDir(dir)
	if err != nil {
		return nil, err
	}
	defer set.Close()
	if err := m.LoadCheckpoint(set); err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	return m, nil
}

// Device returns the device the model runs on.
func (m *Model) Device() device.Device { return m.dev }

// ContextLen is the number of positions the rotary tables cover.
func (m *Model) ContextLen() int { return m.W.RopeCos.Dim(0) }

// KVBytesPerSlot is the KV cache size of one token over all layers.
func (c *Config) KVBytesPerSlot(dt device.DType) int64 {
	return int64(2*c.Layers*c.KVHeads*c.HeadDim) * int64(dt.Size())
}

// AllocKV creates the kv_cache region and a cache of slots tokens, plus one
// padding slot that padded rows of a captured batch write into.
func (m *Model) AllocKV(slots int) error {
	c := m.Config
	dt := m.dev.DType()
	slots++
	size := int64(slots) * c.KVBytesPerSlot(dt)
	if _, err := m.dev.Memory().Create(memory.KVCache, memory.RegionOptions{Capacity: size, GrowStep: size}); err != nil {
		return fmt.Errorf("kv_cache region: %w", err)
	}
	buf, err := m.dev.Alloc(memory.KVCache, dt, 2*c.Layers, slots, c.KVHeads, c.HeadDim)
	if err != nil {
		return fmt.Errorf("allocate KV cache of %d slots: %w", slots, err)
	}
	m.kvBuf = buf
	m.KV = make([]device.Tensor, 2*c.Layers)
	for i := range m.KV {
		m.KV[i] = buf.Rows(i, i+1).View(slots, c.KVHeads, c.HeadDim)
	}
	return nil
}

// KVSlots is the number of token slots in the cache that requests can use.
func (m *Model) KVSlots() int {
	if len(m.KV) == 0 {
		return 0
	}
	return m.KV[0].Dim(0) - 1
}

// PadSlot is the slot that padding rows write their K and V into.
func (m *Model) PadSlot() int32 { return int32(m.KVSlots()) }

// Inputs are one forward step's device-side inputs.
type Inputs struct {
	Tokens    device.Tensor // [T] int32
	Positions device.Tensor // [T] int32
	OutSlots  device.Tensor // [T] int32: KV slot of each new token
	Attn      device.AttnMeta
	LogitRows device.Tensor // [R] int32: rows that need next-token logits
	// LastAttn, when it has sequences, is Attn with one query per sequence
	// that has a logit row, in LogitRows' order, each the last token of its
	// sequence (sequences without are Sparse). The last layer then runs
	// attention, o_proj and the MLP for those rows alone: no other row's
	// output is read, and its K and V are written all the same.
	LastAttn device.AttnMeta
	// Routed, when valid, receives the experts each token's sparse layers
	// chose, [sparse layers, T, TopK] int32 (routing replay); every layer
	// then runs on every token.
	Routed device.Tensor
}

// ScratchBytes is the activation memory of a step with t tokens and r
// logit rows, float32 logits included (Forward).
func (m *Model) ScratchBytes(t, r int) int64 { return m.scratchBytes(t, r, true) }

// LogitsScratchBytes is ScratchBytes for ForwardLogits.
func (m *Model) LogitsScratchBytes(t, r int) int64 { return m.scratchBytes(t, r, false) }

func (m *Model) scratchBytes(t, r int, f32 bool) int64 {
	var p device.ScratchPlan
	m.scratchLayout(t, r, f32, func(dt device.DType, shape ...int) device.Tensor {
		p.Add(dt, shape...)
		return device.Tensor{}
	})
	return int64(p)
}

type activations struct {
	h, x, qkv, attn, gateUp, act, tmp, sel, rawLogits, logits device.Tensor
	localLogits                                               device.Tensor // this rank's part of the vocabulary, when split
	// Sparse layers: router logits, the chosen experts and their weights,
	// and the device's scratch for the experts; with a shared expert, its
	// gate and up columns, their silu product, its output and its gate
	// logit.
	routerLogits, expertIDs, expertWeights, moeWork device.Tensor
	sharedGateUp, sharedAct, shared, sharedGate     device.Tensor
}

func (m *Model) scratchLayout(t, r int, f32Logits bool, take func(device.DType, ...int) device.Tensor) activations {
	c := m.Config
	dt := m.dev.DType()
	logits := func() device.Tensor {
		if !f32Logits {
			return device.Tensor{}
		}
		return take(device.F32, r, c.Vocab)
	}
	// Tensor-parallel partial sums meet in float32, so the sum is rounded
	// once, as one GPU's matmul output is.
	partial := dt
	if m.Comm != nil {
		partial = device.F32
	}
	var local device.Tensor
	if c.LocalVocab() != c.Vocab {
		local = take(dt, r, c.LocalVocab())
	}
	var moe activations
	if c.MoE != nil {
		k := c.MoE.TopK
		moe.routerLogits = take(dt, t, c.MoE.Experts)
		moe.expertIDs = take(device.I32, t, k)
		moe.expertWeights = take(device.F32, t, k)
		if n := m.dev.(device.MoE).MoEWorkBytes(t, k, c.MoE.Experts, c.MoE.Intermediate, c.Hidden); n > 0 {
			moe.moeWork = take(device.I32, int((n+3)/4))
		}
		if si := c.MoE.SharedIntermediate; si > 0 {
			moe.sharedGateUp = take(dt, t, 2*si)
			moe.sharedAct = take(dt, t, si)
			moe.shared = take(dt, t, c.Hidden)
			moe.sharedGate = take(dt, t, 1)
		}
	}
	return activations{
		routerLogits: moe.routerLogits, expertIDs: moe.expertIDs, expertWeights: moe.expertWeights, moeWork: moe.moeWork,
		sharedGateUp: moe.sharedGateUp, sharedAct: moe.sharedAct, shared: moe.shared, sharedGate: moe.sharedGate,
		localLogits: local,
		h:           take(dt, t, c.Hidden),
		x:           take(dt, t, c.Hidden),
		qkv:         take(dt, t, c.Heads+2*c.KVHeads, c.HeadDim),
		attn:        take(dt, t, c.Heads, c.HeadDim),
		gateUp:      take(dt, t, 2*c.Intermediate),
		act:         take(dt, t, c.Intermediate),
		tmp:         take(partial, t, c.Hidden),
		sel:         take(dt, r, c.Hidden),
		rawLogits:   take(dt, r, c.Vocab),
		logits:      logits(),
	}
}

// Forward runs the decoder over the step's tokens, writing their K and V
// into the cache, and returns float32 logits [R, vocab] in scratch memory.
// Errors surface at the device's next Sync.
func (m *Model) Forward(in Inputs, s *device.Scratch) device.Tensor {
	a := m.scratchLayout(in.Tokens.Numel(), in.LogitRows.Numel(), true, s.Take)
	m.forward(in, a)
	if in.LogitRows.Numel() > 0 {
		m.dev.Convert(a.logits, a.rawLogits)
	}
	return a.logits
}

// ForwardLogits is Forward without the float32 copy: logits in the
// activation dtype, as the sampler reads them in decode graphs.
func (m *Model) ForwardLogits(in Inputs, s *device.Scratch) device.Tensor {
	a := m.scratchLayout(in.Tokens.Numel(), in.LogitRows.Numel(), false, s.Take)
	m.forward(in, a)
	return a.rawLogits
}

func (m *Model) forward(in Inputs, a activations) {
	c, dev, w := m.Config, m.dev, &m.W
	t := in.Tokens.Numel()
	eps := float32(c.RMSNormEps)
	scale := float32(1 / math.Sqrt(float64(c.HeadDim)))
	flat := func(x device.Tensor) device.Tensor { return x.View(t, x.Numel()/t) }

	// fused is nil under tensor parallelism: the partial sums meet between
	// a matmul and its add, so no add is fused across them. A matmul
	// without one (gate_up with silu) still is, through fusedDev.
	fusedDev, _ := dev.(device.Fused)
	preparer, _ := dev.(device.AttentionPreparer)
	projector, _ := dev.(device.QKVProjector)
	accumulating, _ := dev.(device.Accumulating)
	normer, _ := m.Comm.(device.AllReduceNormer)
	fused := fusedDev
	if m.Comm != nil {
		fused = nil
	}
	moeFused, _ := fused.(device.MoEFused) // nil under tensor parallelism, as fused
	reduce := func(t device.Tensor) {
		if m.Comm != nil {
			m.Comm.AllReduceSum(t)
		}
	}
	// lazyNorm is the norm weight of an x that the last add left to the
	// next matmul, which normalises h as it reads it.
	var lazyNorm device.Tensor
	matMulX := func(out, wt, bias device.Tensor) {
		if lazyNorm.Valid() {
			fused.RMSNormMatMul(out, a.h, lazyNorm, wt, eps, false)
			lazyNorm = device.Tensor{}
			return
		}
		dev.MatMul(out, a.x, wt, bias)
	}
	// addTmp: h += tmp (the ranks' partial sums added first), x =
	// rmsnorm(h) * norm.
	addTmp := func(norm device.Tensor) {
		if normer != nil && normer.AllReduceAddRMSNorm(a.h, a.tmp, a.x, norm, eps) {
			return
		}
		reduce(a.tmp)
		dev.AddRMSNorm(a.h, a.tmp, a.x, norm, eps)
	}
	// addNorm: h += in @ wt^T (+ bias; in formed by SiLUMul when silu),
	// x = rmsnorm(h) * norm. With next set, x goes only to a product by
	// next without bias (with glu: gate_up, then silu).
	addNorm := func(in, wt, bias device.Tensor, silu bool, norm, next device.Tensor, glu bool) {
		if fused != nil && !bias.Valid() {
			if next.Valid() && fused.MatMulAdd(in, wt, silu, a.h, next, glu) {
				lazyNorm = norm
				return
			}
			if fused.MatMulAddRMSNorm(a.tmp, in, wt, silu, a.h, a.x, norm, eps) {
				return
			}
		}
		if silu {
			dev.SiLUMul(a.act, in)
			in = a.act
		}
		if accumulating != nil && m.Comm == nil && !bias.Valid() && accumulating.MatMulAccumulate(a.h, in, wt) {
			dev.RMSNorm(a.x, a.h, norm, eps)
			return
		}
		dev.MatMul(a.tmp, in, wt, bias)
		addTmp(norm)
	}
	first := m.Shard.vocabSpan(c).from
	dev.Embedding(a.h, w.Embed, in.Tokens, first, c.Vocab)
	if a.localLogits.Valid() {
		// Each token's row is on one rank and zeros on the others: their
		// sum is that row exactly.
		dev.Convert(a.tmp, a.h)
		reduce(a.tmp)
		dev.Convert(a.h, a.tmp)
	}
	dev.RMSNorm(a.x, a.h, w.Layers[0].InputNorm, eps)
	// Routing replay needs every token's choice in every layer: no layer
	// is cut short.
	capture := in.Routed.Valid()
	last, pruned := len(w.Layers)-1, m.logitRowsOnly(in, t) && !capture
	sparse := 0 // sparse layers so far
	for i, l := range w.Layers {
		k, v := m.KV[2*i], m.KV[2*i+1]
		qkvIn := a.x
		if lazyNorm.Valid() {
			qkvIn = a.h
		}
		// prepared: the product prepared q, k and v itself.
		prepared := !l.QKVBias.Valid() && projector != nil &&
			projector.ProjectQKV(a.qkv, qkvIn, lazyNorm, l.QKV, l.QNorm, l.KNorm, in.Positions, w.RopeCos, w.RopeSin, k, v, in.OutSlots, eps)
		if prepared {
			lazyNorm = device.Tensor{}
		} else {
			matMulX(flat(a.qkv), l.QKV, l.QKVBias)
		}
		prepareQKV := func() {
			if !prepared {
				dev.PrepareQKV(a.qkv, l.QNorm, l.KNorm, in.Positions, w.RopeCos, w.RopeSin, k, v, in.OutSlots, eps)
			}
		}
		if i == last && in.LogitRows.Numel() == 0 && !capture {
			// A prefill chunk that completes no sequence: the last layer's
			// K and V are all that a later step reads.
			prepareQKV()
			return
		}
		if i == last && pruned {
			prepareQKV()
			t = in.LogitRows.Numel()
			a = a.logitRows(t, in.LogitRows, dev)
			dev.Attention(a.attn, a.qkv, k, v, in.LastAttn, scale)
		} else if prepared || preparer == nil ||
			!preparer.PrepareAttention(a.attn, a.qkv, l.QNorm, l.KNorm, in.Positions, w.RopeCos, w.RopeSin, k, v, in.OutSlots, in.Attn, scale, eps) {
			prepareQKV()
			dev.Attention(a.attn, a.qkv, k, v, in.Attn, scale)
		}
		// The last layer's x goes to GatherRows, and a biased qkv is not
		// normalised on the fly.
		norm, nextQKV := w.Norm, device.Tensor{}
		if i+1 < len(w.Layers) {
			norm = w.Layers[i+1].InputNorm
			if !w.Layers[i+1].QKVBias.Valid() {
				nextQKV = w.Layers[i+1].QKV
			}
		}
		if l.Sparse() {
			ids, weights := a.expertIDs.Rows(0, t), a.expertWeights.Rows(0, t)
			if capture {
				ids = in.Routed.Rows(sparse, sparse+1).View(t, c.MoE.TopK)
			}
			sparse++
			moe := dev.(device.MoE)
			// The router and experts read x as it is.
			if moeFused == nil || l.OBias.Valid() ||
				!moeFused.MatMulAddMoERoute(flat(a.attn), l.O, a.h, a.x, l.PostNorm, l.Router, ids, weights, eps, c.MoE.NormTopK) {
				addNorm(flat(a.attn), l.O, l.OBias, false, l.PostNorm, device.Tensor{}, false)
				dev.MatMul(a.routerLogits.Rows(0, t), a.x, l.Router, device.Tensor{})
				moe.MoERoute(ids, weights, a.routerLogits.Rows(0, t), c.MoE.NormTopK)
			}
			if !l.SharedGate.Valid() && moeFused != nil {
				if nextQKV.Valid() && moeFused.MoEExpertsAdd(a.h, a.x, ids, weights, l.ExpertGateUp, l.ExpertDown, a.moeWork, nextQKV) {
					lazyNorm = norm
					continue
				}
				if moeFused.MoEExpertsAddRMSNorm(a.h, a.x, norm, ids, weights, l.ExpertGateUp, l.ExpertDown, a.moeWork, eps) {
					continue
				}
			}
			moe.MoEExperts(a.tmp, a.x, ids, weights, l.ExpertGateUp, l.ExpertDown, a.moeWork)
			if l.SharedGate.Valid() {
				m.sharedExpert(a, l, t, moe, fusedDev)
			}
			addTmp(norm)
			continue
		}
		addNorm(flat(a.attn), l.O, l.OBias, false, l.PostNorm, l.GateUp, true)
		if lazyNorm.Valid() && fused.RMSNormMatMul(a.act, a.h, lazyNorm, l.GateUp, eps, true) {
			// The product that normalised x also applied silu: each gate
			// met its up in one thread or group of warps.
			lazyNorm = device.Tensor{}
			addNorm(a.act, l.Down, device.Tensor{}, false, norm, nextQKV, false)
			continue
		}
		if !lazyNorm.Valid() && fusedDev != nil && fusedDev.MatMulSiLU(a.act, a.x, l.GateUp) {
			addNorm(a.act, l.Down, device.Tensor{}, false, norm, nextQKV, false)
			continue
		}
		matMulX(a.gateUp, l.GateUp, device.Tensor{})
		addNorm(a.gateUp, l.Down, device.Tensor{}, true, norm, nextQKV, false)
	}
	if in.LogitRows.Numel() == 0 {
		return // a chunk that completes no sequence, run whole for its routing
	}
	sel := a.x // the last layer ran on the logit rows alone
	if !pruned {
		sel = a.sel
		dev.GatherRows(sel, a.x, in.LogitRows)
	}
	// Logits are computed in the activation dtype, as transformers does (a
	// bf16 lm_head gives bf16 logits), so logprobs match the trainer's.
	if !a.localLogits.Valid() {
		dev.MatMul(a.rawLogits, sel, w.LMHead, device.Tensor{})
		return
	}
	dev.MatMul(a.localLogits, sel, w.LMHead, device.Tensor{})
	m.Comm.AllGatherColumns(a.rawLogits, a.localLogits)
}

// logitRowsOnly says whether the last layer runs on the logit rows alone:
// LastAttn has them, they are few (a quarter of the step or less: what is
// saved outweighs the gathers) and their qkv rows fit in act.
func (m *Model) logitRowsOnly(in Inputs, t int) bool {
	c := m.Config
	r := in.LogitRows.Numel()
	return in.LastAttn.NumSeqs > 0 && r > 0 && 4*r <= t && r*(c.Heads+2*c.KVHeads)*c.HeadDim <= t*c.Intermediate
}

// logitRows gathers the r logit rows' qkv and residual after the last
// layer's qkv, and returns activations of r rows for the rest of it. The
// rows land in buffers nothing reads again: h in sel (whose gather the
// pruned step skips), qkv in the front of act (free until the MLP), the
// rest in the first r rows of their own buffers.
func (a activations) logitRows(r int, rows device.Tensor, dev device.Device) activations {
	qkv := a.act.View(a.act.Numel()).Rows(0, r*a.qkv.RowSize()).View(r, a.qkv.Dim(1), a.qkv.Dim(2))
	dev.GatherRows(qkv, a.qkv, rows)
	dev.GatherRows(a.sel, a.h, rows)
	first := func(t device.Tensor) device.Tensor { // a model without a shared expert has none of its buffers
		if !t.Valid() {
			return t
		}
		return t.Rows(0, r)
	}
	return activations{
		h: a.sel, x: a.x.Rows(0, r), qkv: qkv, attn: a.attn.Rows(0, r),
		gateUp: a.gateUp.Rows(0, r), act: a.act.Rows(0, r), tmp: a.tmp.Rows(0, r),
		rawLogits: a.rawLogits, logits: a.logits, localLogits: a.localLogits,
		routerLogits: a.routerLogits, expertIDs: a.expertIDs, expertWeights: a.expertWeights, moeWork: a.moeWork,
		sharedGateUp: first(a.sharedGateUp), sharedAct: first(a.sharedAct), shared: first(a.shared), sharedGate: first(a.sharedGate),
	}
}

// sharedExpert adds Qwen2-MoE's shared expert to the experts' sum in tmp
// for the step's t rows of x: tmp += sigmoid(x . gate) * down(silu(gate_proj
// x) * up_proj x). Under tensor parallelism each rank adds its columns'
// share, gated alike, to its partial sum.
func (m *Model) sharedExpert(a activations, l Layer, t int, moe device.MoE, fused device.Fused) {
	dev := m.dev
	act := a.sharedAct.Rows(0, t)
	if fused == nil || !fused.MatMulSiLU(act, a.x, l.SharedGateUp) {
		gateUp := a.sharedGateUp.Rows(0, t)
		dev.MatMul(gateUp, a.x, l.SharedGateUp, device.Tensor{})
		dev.SiLUMul(act, gateUp)
	}
	dev.MatMul(a.shared.Rows(0, t), act, l.SharedDown, device.Tensor{})
	dev.MatMul(a.sharedGate.Rows(0, t), a.x, l.SharedGate, device.Tensor{})
	moe.MoESharedAdd(a.tmp, a.shared.Rows(0, t), a.sharedGate.Rows(0, t))
}

func f32Bytes(v []float32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v))
}

// I32Bytes views int32s as little-endian bytes for Upload.
func I32Bytes(v []int32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v))
}

// F32Bytes views float32s as little-endian bytes for Upload.
func F32Bytes(v []float32) []byte { return f32Bytes(v) }
