package cuda

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"

	"ebb/device"
)

// MoEBenchSpec is one MoEExperts call to time: Tokens tokens, each routed
// to TopK distinct experts of Experts drawn uniformly (a trained router
// spreads a batch's tokens so; a model with random weights routes a decode
// batch's equal tokens alike and touches far fewer experts).
type MoEBenchSpec struct {
	Tokens, Experts, TopK, Inter, Hidden int
	Iters                                int
}

// MoEBenchResult is the median of Iters calls. Bytes counts the weights of
// the experts the routing touches, once, and the tokens in and out.
type MoEBenchResult struct {
	MoEBenchSpec
	Path    string `json:"path"`
	Touched int    `json:"touched_experts"`
	KernelTiming
}

// BenchMoE times d.MoEExperts (the experts' products and the weighted sum;
// not the router) on the spec's shape, weights from HBM: two copies of the
// layer's experts, used in turn.
func BenchMoE(d *Device, s MoEBenchSpec) (MoEBenchResult, error) {
	res := MoEBenchResult{MoEBenchSpec: s}
	if s.Tokens < 1 || s.Experts < 1 || s.TopK < 1 || s.TopK > s.Experts || s.Inter < 8 || s.Hidden < 8 || s.Iters < 1 {
		return res, fmt.Errorf("moe bench: bad shape %+v", s)
	}
	a, err := newBenchArena(d)
	if err != nil {
		return res, err
	}
	defer a.free()
	rng := rand.New(rand.NewPCG(1, 2))
	var ids, weights []byte
	touched := map[int]bool{}
	for range s.Tokens {
		for _, e := range rng.Perm(s.Experts)[:s.TopK] {
			ids = binary.LittleEndian.AppendUint32(ids, uint32(e))
			weights = binary.LittleEndian.AppendUint32(weights, math.Float32bits(1/float32(s.TopK)))
			touched[e] = true
		}
	}
	idT, wT := a.alloc(device.I32, s.Tokens, s.TopK), a.alloc(device.F32, s.Tokens, s.TopK)
	if err := d.Upload(idT, ids, device.I32); err != nil {
		return res, err
	}
	if err := d.Upload(wT, weights, device.F32); err != nil {
		return res, err
	}
	x, out := a.alloc(device.BF16, s.Tokens, s.Hidden), a.alloc(device.BF16, s.Tokens, s.Hidden)
	work := a.alloc(device.I32, int(d.MoEWorkBytes(s.Tokens, s.TopK, s.Experts, s.Inter, s.Hidden)/4)+1)
	var gateUp, down [2]device.Tensor
	for i := range gateUp {
		gateUp[i], down[i] = a.alloc(device.BF16, s.Experts, 2*s.Inter, s.Hidden), a.alloc(device.BF16, s.Experts, s.Hidden, s.Inter)
		d.Fill(gateUp[i], 0.01)
		d.Fill(down[i], 0.01)
	}
	d.Fill(x, 0.5)
	call := func(i int) { d.MoEExperts(out, x, idT, wT, gateUp[i%2], down[i%2], work) }
	call(0) // loads the functions
	if err := d.Sync(); err != nil {
		return res, err
	}
	us, err := timeLaunches(d, s.Iters, 8, call)
	if err != nil {
		return res, err
	}
	res.Path = d.moePath(s.Tokens, s.TopK, s.Experts, s.Inter, s.Hidden)
	res.Touched = len(touched)
	expert := int64(3) * int64(s.Inter) * int64(s.Hidden) * 2
	res.set(d, us, int64(res.Touched)*expert+2*int64(s.Tokens)*int64(s.Hidden)*2,
		2*3*float64(s.Tokens*s.TopK)*float64(s.Inter)*float64(s.Hidden))
	return res, d.Sync()
}

// moePath names the products MoEExperts runs for t tokens.
func (d *Device) moePath(t, k, e, inter, hidden int) string {
	p := t * k
	switch {
	case !d.det && t <= d.moeGemvTokens:
		return "moe_gemv_glu"
	case d.moeWGTile(p, e, inter, hidden) > 0:
		bn := d.moeWGTile(p, e, inter, hidden)
		if bn >= d.moeSortedFrom {
			return fmt.Sprintf("moe_wg_n%d+sorted", bn)
		}
		return fmt.Sprintf("moe_wg_n%d", bn)
	}
	kernel, _ := d.moeTiles(p, e)
	return kernel
}
