package cuda

// The layer operations of device.Device on layers.cu's kernels: embedding,
// norms, q/k preparation, silu, gathering rows.

import (
	"fmt"

	"ebb/device"
)

// Embedding implements device.Device.
func (d *Device) Embedding(out, table, ids device.Tensor, first, vocab int) {
	d.launch("embedding", D1(ids.Numel()), D1(128), 0, P(out.Ptr), P(table.Ptr), P(ids.Ptr), I(table.Dim(-1)),
		I(first), I(table.Dim(0)))
}

// RMSNorm implements device.Device.
func (d *Device) RMSNorm(out, x, w device.Tensor, eps float32) {
	dim := w.Numel()
	if dim > 8*1024 {
		d.fail(fmt.Errorf("rmsnorm: dim %d above 8192", dim))
		return
	}
	d.launch("rmsnorm"+normVariant(dim, out, x, w), D1(x.Numel()/dim), D1(normThreads(dim)), 0, P(out.Ptr), P(x.Ptr), P(w.Ptr), I(dim), F(eps))
}

// AddRMSNorm implements device.Device.
func (d *Device) AddRMSNorm(residual, x, out, w device.Tensor, eps float32) {
	dim := w.Numel()
	if dim > 8*1024 {
		d.fail(fmt.Errorf("add_rmsnorm: dim %d above 8192", dim))
		return
	}
	name := "add_rmsnorm"
	if x.DType == device.F32 {
		name = "add_rmsnorm_f32x"
	}
	name += normVariant(dim, residual, x, out, w)
	d.launch(name, D1(x.Numel()/dim), D1(normThreads(dim)), 0, P(residual.Ptr), P(x.Ptr), P(out.Ptr), P(w.Ptr), I(dim), F(eps))
}

// normVariant names the 16-byte kernels ("_v8") when every row of dim
// elements starts 16-byte aligned.
func normVariant(dim int, ts ...device.Tensor) string {
	if dim%8 != 0 {
		return ""
	}
	for _, t := range ts {
		if t.Ptr%16 != 0 {
			return ""
		}
	}
	return "_v8"
}

// normThreads gives each thread at most NORM_VPT (8) values of a row.
func normThreads(dim int) int { return min(1024, max(32, ((dim+7)/8+31)/32*32)) }

// PrepareQKV implements device.Device. Deterministic inference prepares
// every step with prepare_qkv16 where it can (the two kernels add a head's
// squares in different orders, so a prompt's K and a decode's must come
// from the same one): at a long prefill it reads at bandwidth where
// prepare_qkv's 8-byte lanes do not (8k chunk, 0.6B shape, H100: 82 us a
// layer with prepare_qkv).
func (d *Device) PrepareQKV(qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots device.Tensor, eps float32) {
	t := positions.Numel()
	vec := vectorisedQKV(qkv, kCache, vCache, t)
	if d.det {
		vec = qkv16Layout(qkv, kCache, vCache)
	}
	d.prepareQKV(qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots, eps, t, 0, qkv.Dim(1), vec)
}

// qkv16Units is QKV16_UNITS in layers.cu: (token, head) units a thread.
const qkv16Units = 1

// vectorisedQKV reports whether a step of t tokens prepares its q, k and v
// with prepare_qkv16: a prefill of about a thousand tokens or more.
func vectorisedQKV(qkv, kCache, vCache device.Tensor, t int) bool {
	return t*qkv.Dim(1) >= 1<<15 && qkv16Layout(qkv, kCache, vCache)
}

// qkv16Layout reports whether prepare_qkv16 can take these tensors.
func qkv16Layout(qkv, kCache, vCache device.Tensor) bool {
	return qkv.Dim(2)%16 == 0 && qkv.Ptr%16 == 0 && kCache.Ptr%16 == 0 && vCache.Ptr%16 == 0
}

// prepareQKV prepares heads [head0, hend) of the first t tokens, with
// prepare_qkv16 when vec.
func (d *Device) prepareQKV(qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots device.Tensor, eps float32, t, head0, hend int, vec bool) {
	hk, dim := kCache.Dim(1), kCache.Dim(2)
	hq := qkv.Dim(1) - 2*hk
	if t == 0 || hend <= head0 {
		return
	}
	hasNorm := 0
	if qNorm.Valid() {
		hasNorm = 1
	}
	if dim > 256 || dim%4 != 0 {
		d.fail(fmt.Errorf("prepare_qkv: head_dim %d (a multiple of 4 up to 256)", dim))
		return
	}
	if vec {
		// (token, head) units of dim/16 lanes, qkv16Units a thread.
		units, perBlock := t*(hend-head0), qkv16Units*128/(dim/16)
		d.launch("prepare_qkv16", D1((units+perBlock-1)/perBlock), D1(128), 0,
			P(qkv.Ptr), P(qNorm.Ptr), P(kNorm.Ptr), P(positions.Ptr), P(cos.Ptr), P(sin.Ptr), P(kCache.Ptr), P(vCache.Ptr),
			P(slots.Ptr), I(hq), I(hk), I(dim), F(eps), I(hasNorm), I(head0), I(hend), I(t))
		return
	}
	d.launch("prepare_qkv", Dim3{uint32(t), uint32((hend - head0 + 3) / 4), 1}, D1(128), 0,
		P(qkv.Ptr), P(qNorm.Ptr), P(kNorm.Ptr), P(positions.Ptr), P(cos.Ptr), P(sin.Ptr),
		P(kCache.Ptr), P(vCache.Ptr), P(slots.Ptr), I(hq), I(hk), I(dim), F(eps), I(hasNorm), I(head0), I(hend))
}

// SiLUMul implements device.Device.
func (d *Device) SiLUMul(out, gateUp device.Tensor) {
	total, inter := int64(out.Numel()), out.Dim(-1)
	if inter%8 == 0 && out.Ptr%16 == 0 && gateUp.Ptr%16 == 0 {
		d.launch("silu_mul_v8", gridFor(total/8), D1(256), 0, P(out.Ptr), P(gateUp.Ptr), I(inter/8), uint64(total/8))
		return
	}
	d.launch("silu_mul", gridFor(total), D1(256), 0, P(out.Ptr), P(gateUp.Ptr), I(inter), uint64(total))
}

// GatherRows implements device.Device.
func (d *Device) GatherRows(out, x, rows device.Tensor) {
	if rows.Numel() == 0 {
		return
	}
	d.launch("gather_rows", D1(rows.Numel()), D1(256), 0, P(out.Ptr), P(x.Ptr), P(rows.Ptr), I(x.RowSize()))
}
