package device

// UniformFiller is a device that draws random weights itself
// (--load-format dummy): a 61 GB model's values made on the host and
// copied over took most of a minute to load; drawn on the device, a whole
// batch-1 bench of that model runs in about 2 s (H200).
type UniformFiller interface {
	// FillUniform sets element i of a float tensor to UniformAt(seed, i,
	// step), rounded to the tensor's dtype.
	FillUniform(dst Tensor, seed uint64, step float32)
}

// UniformStep is the step of UniformAt's draws in [-scale, scale).
func UniformStep(scale float32) float32 { return scale * 0x1p-23 }

// UniformAt is the i-th of seed's uniform draws in [-2^23, 2^23) * step:
// the top 24 bits of splitmix64's i-th output, less 2^23, times step.
// Every step but the last multiply is exact and that multiply rounds once,
// so a kernel gets the same bits as the host (no fused multiply-add can
// form).
func UniformAt(seed, i uint64, step float32) float32 {
	z := seed + (i+1)*0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	z ^= z >> 31
	return float32(int32(z>>40)-1<<23) * step
}
