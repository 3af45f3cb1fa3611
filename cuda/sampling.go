package cuda

// The sampling operations of device.Device on sampling.cu's kernels:
// penalties, sampling, token resolution and logprobs.

import (
	"fmt"

	"ebb/device"
)

// ApplyPenalties implements device.Device.
func (d *Device) ApplyPenalties(logits device.Tensor, a device.PenaltyArgs) {
	d.launch("apply_penalties", D1(logits.Dim(0)), D1(256), 0, P(logits.Ptr), I(logits.Dim(-1)), P(a.RowPtr.Ptr),
		P(a.Tokens.Ptr), P(a.Counts.Ptr), P(a.Bias.Ptr), P(a.Repetition.Ptr), P(a.Frequency.Ptr), P(a.Presence.Ptr))
}

// Sample implements device.Device: a scan of each row in slices spread
// over the GPU (the row's logsumexp and its greedy or Gumbel winner), then
// one block per row that merges them and, for filtered rows, finds the
// threshold and the winner among the kept tokens.
func (d *Device) Sample(logits device.Tensor, a device.SampleArgs) {
	ntop := 0
	if a.TopIDs.Valid() {
		ntop = a.TopIDs.Dim(-1)
	}
	if ntop > 64 {
		d.fail(fmt.Errorf("sample: %d top logprobs (limit 64)", ntop))
		return
	}
	var suffix string
	switch logits.DType {
	case device.F32:
		suffix = "f32"
	case device.BF16:
		suffix = "bf16"
	default:
		d.fail(fmt.Errorf("sample: logits %v", logits))
		return
	}
	rows, v := logits.Dim(0), logits.Dim(-1)
	var parts int
	if d.det {
		var ok bool
		if parts, ok = d.sampleDet(suffix, logits, a); !ok {
			return
		}
	} else {
		parts = max(1, min(64, d.sampleWaves*d.ctx.SMs/rows, (v+2047)/2048))
		for parts > 1 && int64(rows*parts*4*4) > d.samplePart.Bytes() {
			parts--
		}
		d.launch("sample_scan_"+suffix, Dim3{uint32(rows), uint32(parts), 1}, D1(256), 0, P(logits.Ptr), I(v),
			P(a.Temperature.Ptr), P(a.TopK.Ptr), P(a.Keys.Ptr), P(d.samplePart.Ptr))
	}
	d.launch("sample_finish_"+suffix, D1(rows), D1(1024), 0, P(logits.Ptr), I(v), P(a.Temperature.Ptr),
		P(a.TopP.Ptr), P(a.TopK.Ptr), P(a.MinP.Ptr), P(a.Keys.Ptr), P(a.IDs.Ptr), P(a.Logprobs.Ptr),
		P(a.TopIDs.Ptr), P(a.TopLogprobs.Ptr), I(ntop), P(d.samplePart.Ptr), I(parts))
}

// sampleScanWaves is sample_scan's grid in blocks per SM: a row is split
// into slices until the grid has this many. The scan is bound by its
// hashes and logarithms, not by memory, so it wants every thread an SM
// holds: 4 blocks of 256 threads an SM (a batch of 256: 2 slices a row)
// sampled in 242 us, 8 in 165 us, 16 in 166 us (BenchmarkSample's flat
// rows, 256 x 151,936 bf16 logits, H200).
const sampleScanWaves = 8

// ResolveTokens implements device.Device.
func (d *Device) ResolveTokens(tokens, src, prev device.Tensor) {
	n := tokens.Numel()
	d.launch("resolve_tokens", D1((n+255)/256), D1(256), 0, P(tokens.Ptr), P(src.Ptr), P(prev.Ptr), I(n))
}

// TokenLogprobs implements device.Device.
func (d *Device) TokenLogprobs(out, logits, targets device.Tensor) {
	if d.det {
		d.tokenLogprobsDet(out, logits, targets)
		return
	}
	d.launch("token_logprobs", D1(logits.Dim(0)), D1(1024), 0, P(out.Ptr), P(logits.Ptr), P(targets.Ptr), I(logits.Dim(-1)))
}
