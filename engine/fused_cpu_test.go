package engine_test

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"ebb/device"
	"ebb/device/cpu"
	"ebb/engine"
	"ebb/memory"
)

// fusedCPU is the CPU backend with device.Fused and device.MoEFused done
// by the separate operations that define them. The GPU takes these calls
// at batch 1 (and the norm folds at up to 48 rows); here the model's
// control flow around them (a norm left to the next product, a sparse
// layer's routing folded after o_proj, its experts added into the
// residual) runs in make test, and must give the plain backend's bits.
type fusedCPU struct {
	*cpu.Device
	scratch *cpu.Device // temporaries, outside the engine's planned regions
	// Calls taken, so that the test knows the fused paths ran.
	normed, routed, added, combined atomic.Int64
}

var (
	_ device.Fused    = (*fusedCPU)(nil)
	_ device.MoEFused = (*fusedCPU)(nil)
)

var registerFusedCPU sync.Once

// openFusedCPU opens dir on fusedCPU, configured as openCPU configures the
// plain backend.
func openFusedCPU(t *testing.T, dir string) *engine.Engine {
	t.Helper()
	registerFusedCPU.Do(func() {
		device.Register("cpu-fused", func(device.OpenOptions) (device.Device, error) {
			s := cpu.New(0)
			if _, err := s.Memory().Create(memory.Workspace, memory.RegionOptions{Capacity: 1 << 30, GrowStep: 16 << 20}); err != nil {
				return nil, err
			}
			return &fusedCPU{Device: cpu.New(0), scratch: s}, nil
		}, func() error { return nil })
	})
	return openOn(t, dir, "cpu-fused")
}

// fusedMoERows: MoEFused's batch-1 folds take steps of at most this many
// rows, as the GPU takes one; MoEExpertsAddRMSNorm takes the larger ones.
const fusedMoERows = 1

// Close closes both devices.
func (d *fusedCPU) Close() error { return errors.Join(d.Device.Close(), d.scratch.Close()) }

// temp is a float32 scratch tensor; free releases it.
func (d *fusedCPU) temp(shape ...int) (device.Tensor, func()) {
	x, err := d.scratch.Alloc(memory.Workspace, device.F32, shape...)
	if err != nil {
		panic(err) // a test device: the region is far larger than any step needs
	}
	return x, func() { d.scratch.Free(memory.Workspace, x) }
}

// add is residual += y, as AddRMSNorm adds.
func add(residual, y device.Tensor) {
	r, v := cpu.F32(residual), cpu.F32(y)
	for i := range r {
		r[i] += v[i]
	}
}

// product is x @ w^T, x formed by SiLUMul when silu; free releases it.
func (d *fusedCPU) product(x, w device.Tensor, silu bool) (device.Tensor, func()) {
	m := x.Dim(0)
	in, freeIn := x, func() {}
	if silu {
		in, freeIn = d.temp(m, x.Dim(-1)/2)
		d.SiLUMul(in, x)
	}
	y, free := d.temp(m, w.Dim(0))
	d.MatMul(y, in, w, device.Tensor{})
	freeIn()
	return y, free
}

func (d *fusedCPU) MatMulAddRMSNorm(out, x, w device.Tensor, silu bool, residual, normed, normW device.Tensor, eps float32) bool {
	y, free := d.product(x, w, silu)
	defer free()
	copy(cpu.F32(out), cpu.F32(y))
	d.AddRMSNorm(residual, out, normed, normW, eps)
	return true
}

func (d *fusedCPU) MatMulAdd(x, w device.Tensor, silu bool, residual, next device.Tensor, glu bool) bool {
	y, free := d.product(x, w, silu)
	defer free()
	add(residual, y)
	return true
}

func (d *fusedCPU) RMSNormMatMul(out, residual, normW, w device.Tensor, eps float32, glu bool) bool {
	d.normed.Add(1)
	x, free := d.temp(residual.Shape...)
	defer free()
	d.RMSNorm(x, residual, normW, eps)
	if !glu {
		d.MatMul(out, x, w, device.Tensor{})
		return true
	}
	y, freeY := d.product(x, w, false)
	defer freeY()
	d.SiLUMul(out, y)
	return true
}

func (d *fusedCPU) MatMulSiLU(out, x, w device.Tensor) bool {
	y, free := d.product(x, w, false)
	defer free()
	d.SiLUMul(out, y)
	return true
}

func (d *fusedCPU) MatMulAddMoERoute(in, w, residual, x, normW, router, ids, weights device.Tensor, eps float32, norm bool) bool {
	if residual.Dim(0) > fusedMoERows {
		return false
	}
	y, free := d.product(in, w, false)
	defer free()
	d.AddRMSNorm(residual, y, x, normW, eps)
	logits, freeL := d.product(x, router, false)
	defer freeL()
	d.MoERoute(ids, weights, logits, norm)
	d.routed.Add(1)
	return true
}

func (d *fusedCPU) MoEExpertsAdd(residual, x, ids, weights, gateUp, down, work, next device.Tensor) bool {
	if x.Dim(0) > fusedMoERows {
		return false
	}
	y, free := d.temp(residual.Shape...)
	defer free()
	d.MoEExperts(y, x, ids, weights, gateUp, down, work)
	add(residual, y)
	d.added.Add(1)
	return true
}

func (d *fusedCPU) MoEExpertsAddRMSNorm(residual, x, normW, ids, weights, gateUp, down, work device.Tensor, eps float32) bool {
	if x.Dim(0) <= fusedMoERows {
		return false // as the GPU leaves the pair gemv's rows to MoEExpertsAdd
	}
	y, free := d.temp(residual.Shape...)
	defer free()
	d.MoEExperts(y, x, ids, weights, gateUp, down, work)
	d.AddRMSNorm(residual, y, x, normW, eps)
	d.combined.Add(1)
	return true
}

// TestFusedControlFlowCPU: every golden model (dense, Qwen3-MoE with and
// without dense layers, Qwen2-MoE with its shared expert) gives the same
// tokens, logprob bits and routed experts with the fused calls taken as
// without them, for its prompts together and for one prompt alone (decode
// steps of one row, where the sparse layers take MoEFused).
func TestFusedControlFlowCPU(t *testing.T) {
	for _, g := range loadGoldens(t) {
		if !strings.Contains(g.Name, "moe") && g.Name != "qwen3-default" {
			continue // one dense model is enough: the GPU tests cover the dense folds
		}
		t.Run(g.Name, func(t *testing.T) {
			dir := writeGoldenModel(t, g)
			moe := isMoE(t, dir)
			plain, fused := openCPU(t, dir), openFusedCPU(t, dir)
			dev := fused.Dev.(*fusedCPU)
			for _, alone := range []bool{false, true} {
				run := g
				if alone {
					run.Cases = g.Cases[len(g.Cases)-1:]
				}
				want, got := generateGolden(t, plain, run), generateGolden(t, fused, run)
				for i := range want {
					what := fmt.Sprintf("prompt %d (alone %v)", i, alone)
					if !slices.Equal(want[i].OutputIDs, got[i].OutputIDs) || !slices.Equal(want[i].RoutedExperts, got[i].RoutedExperts) {
						t.Fatalf("%s: fused tokens %v, plain %v (or their routing differs)", what, got[i].OutputIDs, want[i].OutputIDs)
					}
					for _, lp := range [][2][]float32{{want[i].OutputLogprobs, got[i].OutputLogprobs}, {want[i].InputLogprobs, got[i].InputLogprobs}} {
						if !slices.EqualFunc(lp[0], lp[1], func(a, b float32) bool { return math.Float32bits(a) == math.Float32bits(b) }) {
							t.Fatalf("%s: fused logprobs %v, plain %v", what, lp[1], lp[0])
						}
					}
				}
			}
			// A dense layer's gate_up normalises what o_proj added. A sparse
			// layer without a shared expert adds its experts into the
			// residual where the next qkv normalises it (one without bias:
			// not Qwen2's), and in steps of more rows combines and
			// normalises in one call.
			layers, adds, dense, combines := fused.Model.W.Layers, false, false, false
			for i, l := range layers {
				dense = dense || !l.Sparse()
				adds = adds || i+1 < len(layers) && l.Sparse() && !l.SharedGate.Valid() && !layers[i+1].QKVBias.Valid()
				combines = combines || l.Sparse() && !l.SharedGate.Valid()
			}
			if (dev.normed.Load() > 0) != (dense || adds) || moe && (dev.routed.Load() == 0 || (dev.added.Load() > 0) != adds ||
				(dev.combined.Load() > 0) != combines) {
				t.Fatalf("fused calls taken: %d normalising products, %d routings, %d expert adds, %d combines normalised",
					dev.normed.Load(), dev.routed.Load(), dev.added.Load(), dev.combined.Load())
			}
		})
	}
}
