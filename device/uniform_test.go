package device

import (
	"math"
	"testing"
)

// TestUniformAt: the draws fill [-scale, scale) evenly, a seed gives the
// same values every time and another seed others.
func TestUniformAt(t *testing.T) {
	const n = 1 << 16
	step := UniformStep(0.5)
	var sum, sum2 float64
	lo, hi := float32(1), float32(-1)
	same := 0
	for i := uint64(0); i < n; i++ {
		v := UniformAt(7, i, step)
		if v != UniformAt(7, i, step) {
			t.Fatalf("draw %d differs between calls", i)
		}
		if v == UniformAt(8, i, step) {
			same++
		}
		lo, hi = min(lo, v), max(hi, v)
		sum += float64(v)
		sum2 += float64(v) * float64(v)
	}
	if lo < -0.5 || hi >= 0.5 || lo > -0.49 || hi < 0.49 {
		t.Errorf("draws span [%g, %g], want about [-0.5, 0.5)", lo, hi)
	}
	if mean := sum / n; math.Abs(mean) > 0.01 {
		t.Errorf("mean %g, want about 0", mean)
	}
	if v := sum2 / n; math.Abs(v-0.25/3) > 0.005 {
		t.Errorf("variance %g, want about %g", v, 0.25/3)
	}
	if same > 4 {
		t.Errorf("seeds 7 and 8 share %d of %d draws", same, n)
	}
}
