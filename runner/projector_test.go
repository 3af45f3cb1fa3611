package runner

import (
	"slices"
	"testing"

	"ebb/device"
	"ebb/device/cpu"
	"ebb/tinymodel"
)

// projectingDevice is the CPU device with a QKVProjector that runs MatMul
// then PrepareQKV and counts its calls, and the PrepareQKV calls made
// outside it.
type projectingDevice struct {
	*cpu.Device
	projected, prepared int
	inside              bool
}

func (d *projectingDevice) ProjectQKV(qkv, x, normW, w, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots device.Tensor, eps float32) bool {
	if normW.Valid() {
		return false // the CPU device folds no norm into a product
	}
	d.projected++
	d.inside = true
	defer func() { d.inside = false }()
	m := x.Dim(0)
	d.MatMul(qkv.View(m, qkv.Numel()/m), x, w, device.Tensor{})
	d.PrepareQKV(qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots, eps)
	return true
}

func (d *projectingDevice) PrepareQKV(qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots device.Tensor, eps float32) {
	if !d.inside {
		d.prepared++
	}
	d.Device.PrepareQKV(qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots, eps)
}

// TestQKVProjector: a device whose qkv product prepares q, k and v itself
// (device.QKVProjector) is asked to in every layer, is not asked to
// prepare them again, and gives the logits of the plain step, with the last
// layer on the logit rows alone or on every row.
func TestQKVProjector(t *testing.T) {
	dir := tinymodel.TestDir(t, "qwen3", nil)
	run := func(dev device.Device, lastOnLogitRows bool) []float32 {
		r := smallRunner(t, dev, dir)
		seqs := []SeqStep{
			{Tokens: []int32{5}, Start: 30, Sample: true, Params: Greedy, Slots: seqSlots(0, 31)},
			{Tokens: make([]int32, 40), Sample: true, Params: Greedy, Slots: seqSlots(40, 40)},
		}
		for i := range seqs[1].Tokens {
			seqs[1].Tokens[i] = int32(i * 13 % 500)
		}
		return r.logits(t, dev, seqs, lastOnLogitRows)
	}
	for _, last := range []bool{false, true} {
		want := run(cpu.New(0), last)
		pd := &projectingDevice{Device: cpu.New(0)}
		got := run(pd, last)
		if !slices.Equal(got, want) {
			t.Fatalf("last layer on logit rows %v: logits differ with the projector", last)
		}
		if layers := 2; pd.projected != layers || pd.prepared != 0 { // tinymodel's two layers, one step
			t.Fatalf("last layer on logit rows %v: ProjectQKV %d times, PrepareQKV %d more", last, pd.projected, pd.prepared)
		}
	}
}

// seqSlots are a sequence's n cache slots from first.
func seqSlots(first, n int) []int32 {
	s := make([]int32, n)
	for i := range s {
		s[i] = int32(first + i)
	}
	return s
}
