package runner

import (
	"errors"
	"fmt"

	"ebb/device"
	"ebb/model"
)

// routedStore keeps the experts each KV slot's token was routed to, by
// slot as SGLang's host cache does: a prefix found in the radix cache
// brings its routing with it, and a finished request reads its tokens'
// by their slots (routing replay, --enable-return-routed-experts).
type routedStore struct {
	layers int   // all layers, as clients reshape the result
	sparse []int // the layer of each sparse layer, in order
	k      int
	bySlot []int32 // [slots+1][sparse layers][k]
	stage  []int32 // an eager step's download, [sparse layers][T][k]
}

// EnableRoutedExperts makes every step record the experts its tokens
// chose. It must come before CaptureGraphs.
func (r *Runner) EnableRoutedExperts() error {
	c := r.Model.Config
	if c.MoE == nil {
		return fmt.Errorf("routed experts: %s has no experts", c.Arch)
	}
	if r.graphs != nil {
		return errors.New("routed experts: enable them before the decode graphs are captured")
	}
	st := &routedStore{layers: c.Layers, k: c.MoE.TopK}
	for i := 0; i < c.Layers; i++ {
		if c.Sparse(i) {
			st.sparse = append(st.sparse, i)
		}
	}
	st.bySlot = make([]int32, (r.Model.KVSlots()+1)*len(st.sparse)*st.k)
	r.routed = st
	return nil
}

// RoutedExpertsEnabled reports whether steps record their routing.
func (r *Runner) RoutedExpertsEnabled() bool { return r.routed != nil }

// RoutedExperts returns the experts chosen for the tokens in slots, as
// [len(slots), layers, k] int32 (SGLang's layout); a dense layer's entries
// are -1.
func (r *Runner) RoutedExperts(slots []int32) []int32 {
	st := r.routed
	if st == nil {
		return nil
	}
	s, k := len(st.sparse), st.k
	out := make([]int32, len(slots)*st.layers*k)
	for i := range out {
		out[i] = -1
	}
	for i, sl := range slots {
		src := st.bySlot[int(sl)*s*k : (int(sl)+1)*s*k]
		for j, layer := range st.sparse {
			copy(out[(i*st.layers+layer)*k:(i*st.layers+layer+1)*k], src[j*k:(j+1)*k])
		}
	}
	return out
}

// routedBytes is the scratch of a step's routing of t tokens, [sparse
// layers, t, k]; nothing for a dense model.
func routedBytes(c *model.Config, t int) int64 {
	if c.MoE == nil {
		return 0
	}
	return int64(4*c.SparseLayers()*c.MoE.TopK*t) + 256
}

// scatter files a step's routing, [sparse layers][t][k], under the slot of
// each of its first len(slots) tokens (the rest pad a graph's batch).
func (st *routedStore) scatter(step []int32, slots []int32, t int) {
	s, k := len(st.sparse), st.k
	for i, sl := range slots {
		dst := st.bySlot[int(sl)*s*k : (int(sl)+1)*s*k]
		for j := 0; j < s; j++ {
			copy(dst[j*k:(j+1)*k], step[(j*t+i)*k:(j*t+i+1)*k])
		}
	}
}

// stepSlots lists the KV slot of every token a step computes, in order.
func stepSlots(seqs []SeqStep) []int32 {
	var out []int32
	for _, s := range seqs {
		out = append(out, s.Slots[s.Start:s.Start+len(s.Tokens)]...)
	}
	return out
}

// takeRouted gives a step's routing its scratch, or nothing when off.
func (st *routedStore) take(s *device.Scratch, t int) device.Tensor {
	if st == nil {
		return device.Tensor{}
	}
	return s.Take(device.I32, len(st.sparse), t, st.k)
}

// collect downloads an eager step's routing and files it.
func (st *routedStore) collect(dev device.Device, routed device.Tensor, seqs []SeqStep) error {
	if st == nil {
		return nil
	}
	if cap(st.stage) < routed.Numel() {
		st.stage = make([]int32, routed.Numel())
	}
	stage := st.stage[:routed.Numel()]
	if err := dev.DownloadI32(routed, stage); err != nil {
		return fmt.Errorf("routed experts: %w", err)
	}
	st.scatter(stage, stepSlots(seqs), routed.Dim(1))
	return nil
}
