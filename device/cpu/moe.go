package cpu

import (
	"cmp"
	"fmt"
	"math"
	"slices"

	"ebb/device"
)

var _ device.MoE = (*Device)(nil)

// MoERoute implements device.MoE.
func (d *Device) MoERoute(ids, weights, logits device.Tensor, norm bool) {
	t, e, k := logits.Dim(0), logits.Dim(-1), ids.Dim(-1)
	if ids.Numel() != t*k || weights.Numel() != t*k || k > e {
		d.fail(fmt.Errorf("moe route: logits %v, ids %v, weights %v", logits, ids, weights))
		return
	}
	ls, is, ws := F32(logits), I32(ids), F32(weights)
	order := make([]int, e)
	p := make([]float32, e)
	for r := 0; r < t; r++ {
		softmax(p, ls[r*e:(r+1)*e])
		for i := range order {
			order[i] = i
		}
		// Stable: on equal probabilities the lower expert comes first.
		slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(p[b], p[a]) })
		var sum float32
		for j := 0; j < k; j++ {
			is[r*k+j] = int32(order[j])
			ws[r*k+j] = p[order[j]]
			sum += p[order[j]]
		}
		if norm {
			for j := 0; j < k; j++ {
				ws[r*k+j] /= sum
			}
		}
	}
}

// softmax writes softmax(x) into p.
func softmax(p, x []float32) {
	m := float32(math.Inf(-1))
	for _, v := range x {
		m = max(m, v)
	}
	var sum float32
	for i, v := range x {
		p[i] = float32(math.Exp(float64(v - m)))
		sum += p[i]
	}
	for i := range p {
		p[i] /= sum
	}
}

// MoEWorkBytes implements device.MoE: the CPU takes its scratch from the
// Go heap.
func (d *Device) MoEWorkBytes(t, k, experts, inter, hidden int) int64 { return 0 }

// MoEExperts implements device.MoE. Each expert's rows are gathered and
// go through its products together, as the GPU groups them.
func (d *Device) MoEExperts(out, x, ids, weights, gateUp, down, work device.Tensor) {
	t, h := x.Dim(0), x.Dim(-1)
	k := ids.Dim(-1)
	e, inter := gateUp.Dim(0), gateUp.Dim(1)/2
	if out.Numel() != t*h || ids.Numel() != t*k || weights.Numel() != t*k ||
		gateUp.Dim(2) != h || down.Dim(0) != e || down.Dim(1) != h || down.Dim(2) != inter {
		d.fail(fmt.Errorf("moe experts: out %v, x %v, ids %v, weights %v, gate_up %v, down %v", out, x, ids, weights, gateUp, down))
		return
	}
	is, xs := I32(ids), F32(x)
	for _, id := range is {
		if id < 0 || int(id) >= e {
			d.fail(fmt.Errorf("moe experts: expert %d of %d", id, e))
			return
		}
	}
	// Pairs (row, choice) grouped by expert, in row order within each.
	pairs := make([]int, t*k)
	for i := range pairs {
		pairs[i] = i
	}
	slices.SortStableFunc(pairs, func(a, b int) int { return cmp.Compare(is[a], is[b]) })
	y := make([]float32, t*k*h) // each pair's expert output, by pair index
	wgu, wd := F32(gateUp), F32(down)
	for lo := 0; lo < len(pairs); {
		ex := int(is[pairs[lo]])
		hi := lo
		for hi < len(pairs) && int(is[pairs[hi]]) == ex {
			hi++
		}
		n := hi - lo
		xe := make([]float32, n*h)
		for i, pr := range pairs[lo:hi] {
			r := pr / k
			copy(xe[i*h:(i+1)*h], xs[r*h:(r+1)*h])
		}
		g := make([]float32, n*2*inter)
		gemm(g, xe, wgu[ex*2*inter*h:(ex+1)*2*inter*h], n, 2*inter, h)
		act := make([]float32, n*inter)
		for i := 0; i < n; i++ {
			gate, up := g[i*2*inter:i*2*inter+inter], g[i*2*inter+inter:(i+1)*2*inter]
			for j := range gate {
				act[i*inter+j] = gate[j] / (1 + float32(math.Exp(float64(-gate[j])))) * up[j]
			}
		}
		ye := make([]float32, n*h)
		gemm(ye, act, wd[ex*h*inter:(ex+1)*h*inter], n, h, inter)
		for i, pr := range pairs[lo:hi] {
			copy(y[pr*h:(pr+1)*h], ye[i*h:(i+1)*h])
		}
		lo = hi
	}
	o, ws := F32(out), F32(weights)
	choice := make([]int, k)
	for r := 0; r < t; r++ {
		for j := range choice {
			choice[j] = r*k + j
		}
		slices.SortStableFunc(choice, func(a, b int) int { return cmp.Compare(is[a], is[b]) })
		acc := o[r*h : (r+1)*h]
		clear(acc)
		for _, pr := range choice {
			w, yp := ws[pr], y[pr*h:(pr+1)*h]
			for c := range acc {
				acc[c] += w * yp[c]
			}
		}
	}
}

// MoESharedAdd implements device.MoE.
func (d *Device) MoESharedAdd(out, y, gate device.Tensor) {
	t, h := y.Dim(0), y.Dim(-1)
	if out.Numel() != t*h || gate.Numel() != t {
		d.fail(fmt.Errorf("moe shared add: out %v, y %v, gate %v", out, y, gate))
		return
	}
	o, ys, gs := F32(out), F32(y), F32(gate)
	for r := 0; r < t; r++ {
		s := float32(1 / (1 + math.Exp(-float64(gs[r]))))
		for c := r * h; c < (r+1)*h; c++ {
			o[c] += s * ys[c]
		}
	}
}
