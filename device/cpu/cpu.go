// Package cpu is the reference implementation of device.Device: float32
// math in pure Go over mmap-backed regions. Every CUDA kernel is tested
// against it.
package cpu

import (
	"fmt"
	"math"
	"runtime"
	"sync"
	"unsafe"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/blas32"

	"ebb/device"
	"ebb/memory"
)

// Device computes on the CPU. Operations run synchronously.
type Device struct {
	mem *memory.Manager
	err error
}

var _ device.Device = (*Device)(nil)

// New returns a CPU device whose regions map memory in units of granularity
// bytes (0: 2 MiB).
func New(granularity int64) *Device {
	return &Device{mem: memory.NewManager(memory.NewHostPhysical(granularity))}
}

// Name implements device.Device.
func (d *Device) Name() string { return "cpu" }

// EnableDeterministic implements device.Deterministic: the CPU backend is
// batch-invariant as it stands. Each row's products, norms, attention and
// logsumexp run in one fixed order whatever the step holds (the matmul
// splits work by output rows, never along K), and a sampled token's
// logprob and a scored prompt token's come from the same logSumExp.
func (d *Device) EnableDeterministic(device.ModelShape) error { return nil }

// DType implements device.Device: the CPU computes in float32.
func (d *Device) DType() device.DType { return device.F32 }

// Memory implements device.Device.
func (d *Device) Memory() *memory.Manager { return d.mem }

func (d *Device) fail(err error) {
	if d.err == nil {
		d.err = err
	}
}

// Sync implements device.Device.
func (d *Device) Sync() error {
	err := d.err
	d.err = nil
	return err
}

// Close implements device.Device.
func (d *Device) Close() error { return d.mem.Close() }

// Alloc implements device.Device.
func (d *Device) Alloc(tag memory.Tag, dtype device.DType, shape ...int) (device.Tensor, error) {
	return device.AllocIn(d.mem, tag, dtype, shape...)
}

// Free implements device.Device.
func (d *Device) Free(tag memory.Tag, t device.Tensor) {
	if t.Ptr == 0 {
		return
	}
	if err := d.mem.Free(tag, t.Ptr); err != nil {
		d.fail(err)
	}
}

// F32 views a float32 tensor's memory.
func F32(t device.Tensor) []float32 {
	if t.DType != device.F32 {
		panic(fmt.Sprintf("cpu: %v is not float32", t))
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&memory.HostBytes(t.Ptr, 4)[0])), t.Numel())
}

// I32 views an int32 tensor's memory.
func I32(t device.Tensor) []int32 {
	if t.DType != device.I32 {
		panic(fmt.Sprintf("cpu: %v is not int32", t))
	}
	return unsafe.Slice((*int32)(unsafe.Pointer(&memory.HostBytes(t.Ptr, 4)[0])), t.Numel())
}

// Upload implements device.Device.
func (d *Device) Upload(dst device.Tensor, src []byte, srcType device.DType) error {
	n := dst.Numel()
	if len(src) != n*srcType.Size() {
		return fmt.Errorf("upload to %v: %d bytes of %s", dst, len(src), srcType)
	}
	if dst.DType == device.I32 {
		if srcType != device.I32 {
			return fmt.Errorf("upload to %v from %s", dst, srcType)
		}
		copy(memory.HostBytes(dst.Ptr, dst.Bytes()), src)
		return nil
	}
	if dst.DType != device.F32 {
		return fmt.Errorf("cpu: cannot hold %s", dst.DType)
	}
	if !device.DecodeFloats(F32(dst), src, srcType) {
		return fmt.Errorf("upload to %v from %s", dst, srcType)
	}
	return nil
}

// DownloadF32 implements device.Device.
func (d *Device) DownloadF32(src device.Tensor, dst []float32) error {
	if len(dst) != src.Numel() {
		return fmt.Errorf("download %v into %d floats", src, len(dst))
	}
	copy(dst, F32(src))
	return nil
}

// DownloadI32 implements device.Device.
func (d *Device) DownloadI32(src device.Tensor, dst []int32) error {
	if len(dst) != src.Numel() {
		return fmt.Errorf("download %v into %d ints", src, len(dst))
	}
	copy(dst, I32(src))
	return nil
}

// Copy implements device.Device.
func (d *Device) Copy(dst, src device.Tensor) {
	if dst.Bytes() != src.Bytes() || dst.DType != src.DType {
		d.fail(fmt.Errorf("copy %v to %v", src, dst))
		return
	}
	copy(memory.HostBytes(dst.Ptr, dst.Bytes()), memory.HostBytes(src.Ptr, src.Bytes()))
}

// Fill implements device.Device.
func (d *Device) Fill(dst device.Tensor, v float32) {
	f := F32(dst)
	for i := range f {
		f[i] = v
	}
}

// Convert implements device.Device; the CPU holds only float32.
func (d *Device) Convert(dst, src device.Tensor) {
	if dst.DType != device.F32 || src.DType != device.F32 || dst.Numel() != src.Numel() {
		d.fail(fmt.Errorf("convert %v to %v", src, dst))
		return
	}
	copy(F32(dst), F32(src))
}

// Embedding implements device.Device.
func (d *Device) Embedding(out, table, ids device.Tensor, first, vocab int) {
	h, rows := table.Dim(-1), table.Dim(0)
	o, tab := F32(out), F32(table)
	for i, id := range I32(ids) {
		if id < 0 || int(id) >= vocab {
			d.fail(fmt.Errorf("embedding: token id %d outside vocabulary of %d", id, vocab))
			return
		}
		if r := int(id) - first; r >= 0 && r < rows {
			copy(o[i*h:(i+1)*h], tab[r*h:(r+1)*h])
		} else {
			clear(o[i*h : (i+1)*h])
		}
	}
}

func rmsnormRow(out, x, w []float32, eps float32) {
	var ss float32
	for _, v := range x {
		ss += v * v
	}
	inv := float32(1 / math.Sqrt(float64(ss/float32(len(x))+eps)))
	for i, v := range x {
		out[i] = w[i] * (v * inv)
	}
}

// RMSNorm implements device.Device; rows are the leading dimensions.
func (d *Device) RMSNorm(out, x, w device.Tensor, eps float32) {
	dim := w.Numel()
	o, xs, ws := F32(out), F32(x), F32(w)
	for r := 0; r < len(xs)/dim; r++ {
		rmsnormRow(o[r*dim:(r+1)*dim], xs[r*dim:(r+1)*dim], ws, eps)
	}
}

// AddRMSNorm implements device.Device.
func (d *Device) AddRMSNorm(residual, x, out, w device.Tensor, eps float32) {
	res, xs := F32(residual), F32(x)
	for i := range res {
		res[i] += xs[i]
	}
	d.RMSNorm(out, residual, w, eps)
}

// matMulRowBlock is gonum's block size.
const matMulRowBlock = 64

// MatMul implements device.Device.
func (d *Device) MatMul(out, x, w, bias device.Tensor) {
	m, k := x.Dim(0), x.Dim(-1)
	n := w.Dim(0)
	if w.Dim(-1) != k || out.Numel() != m*n {
		d.fail(fmt.Errorf("matmul: x %v, w %v, out %v", x, w, out))
		return
	}
	o := F32(out)
	gemm(o, F32(x), F32(w), m, n, k)
	if bias.Valid() {
		b := F32(bias)
		for r := 0; r < m; r++ {
			row := o[r*n : (r+1)*n]
			for j := range row {
				row[j] += b[j]
			}
		}
	}
}

// gemm: o[m,n] = x[m,k] @ w[n,k]^T.
func gemm(o, xs, ws []float32, m, n, k int) {
	// gonum sums each output over K in one pass when the product has few
	// 64 x 64 blocks and in 64-wide K blocks when it has many, so the row
	// count would pick the rounding: products go to it 64 rows at a time,
	// where only the weights' shape decides (the batch-invariance that
	// deterministic inference relies on).
	var wg sync.WaitGroup
	for r0 := 0; r0 < m; r0 += matMulRowBlock {
		rows := min(matMulRowBlock, m-r0)
		wg.Add(1)
		go func() {
			defer wg.Done()
			blas32.Gemm(blas.NoTrans, blas.Trans, 1,
				blas32.General{Rows: rows, Cols: k, Stride: k, Data: xs[r0*k : (r0+rows)*k]},
				blas32.General{Rows: n, Cols: k, Stride: k, Data: ws[:n*k]},
				0, blas32.General{Rows: rows, Cols: n, Stride: n, Data: o[r0*n : (r0+rows)*n]})
		}()
	}
	wg.Wait()
}

// PrepareQKV implements device.Device.
func (d *Device) PrepareQKV(qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots device.Tensor, eps float32) {
	hk, dim := kCache.Dim(1), kCache.Dim(2)
	hq := qkv.Dim(1) - 2*hk
	half := dim / 2
	all, cs, sn := F32(qkv), F32(cos), F32(sin)
	kc, vc := F32(kCache), F32(vCache)
	maxPos, nSlots := cos.Dim(0), kCache.Dim(0)
	pos, sl := I32(positions), I32(slots)
	for i := range pos {
		p, s := int(pos[i]), int(sl[i])
		if p < 0 || p >= maxPos {
			d.fail(fmt.Errorf("rope: position %d outside table of %d", p, maxPos))
			return
		}
		if s < 0 || s >= nSlots {
			d.fail(fmt.Errorf("store kv: slot %d outside cache of %d", s, nSlots))
			return
		}
		row := all[i*(hq+2*hk)*dim : (i+1)*(hq+2*hk)*dim]
		c, sv := cs[p*half:(p+1)*half], sn[p*half:(p+1)*half]
		for h := 0; h < hq+hk; h++ {
			v := row[h*dim : (h+1)*dim]
			norm := qNorm
			if h >= hq {
				norm = kNorm
			}
			if norm.Valid() {
				rmsnormRow(v, v, F32(norm), eps)
			}
			for j := 0; j < half; j++ {
				x1, x2 := v[j], v[j+half]
				v[j] = x1*c[j] - x2*sv[j]
				v[j+half] = x2*c[j] + x1*sv[j]
			}
		}
		kvRow := hk * dim
		copy(kc[s*kvRow:(s+1)*kvRow], row[hq*dim:(hq+hk)*dim])
		copy(vc[s*kvRow:(s+1)*kvRow], row[(hq+hk)*dim:])
	}
}

// Attention implements device.Device: causal attention of each sequence's
// queries over its paged KV, with grouped query heads.
func (d *Device) Attention(out, qkv, kCache, vCache device.Tensor, meta device.AttnMeta, scale float32) {
	hk, dim := kCache.Dim(1), kCache.Dim(2)
	hq := qkv.Dim(1) - 2*hk
	stride := qkv.Dim(1) * dim
	group := hq / hk
	qs, os, kc, vc := F32(qkv), F32(out), F32(kCache), F32(vCache)
	qptr, kvptr, kvidx := I32(meta.QIndptr), I32(meta.KVIndptr), I32(meta.KVIndices)
	type job struct{ s, h int }
	jobs := make(chan job)
	var wg sync.WaitGroup
	for w := 0; w < runtime.GOMAXPROCS(0); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			scores := make([]float32, 0, meta.MaxKVLen)
			acc := make([]float32, dim)
			for j := range jobs {
				q0, q1 := int(qptr[j.s]), int(qptr[j.s+1])
				slots := kvidx[kvptr[j.s]:kvptr[j.s+1]]
				kvh := j.h / group
				for i := q0; i < q1; i++ {
					visible := len(slots) - (q1 - i) + 1 // causal: own position and before
					qv := qs[i*stride+j.h*dim : i*stride+(j.h+1)*dim]
					scores = scores[:0]
					m := float32(math.Inf(-1))
					for _, s := range slots[:visible] {
						kv := kc[(int(s)*hk+kvh)*dim : (int(s)*hk+kvh+1)*dim]
						var dot float32
						for x := range qv {
							dot += qv[x] * kv[x]
						}
						dot *= scale
						scores = append(scores, dot)
						m = max(m, dot)
					}
					var sum float32
					for x := range scores {
						scores[x] = float32(math.Exp(float64(scores[x] - m)))
						sum += scores[x]
					}
					clear(acc)
					for x, s := range slots[:visible] {
						vv := vc[(int(s)*hk+kvh)*dim : (int(s)*hk+kvh+1)*dim]
						p := scores[x] / sum
						for y := range acc {
							acc[y] += p * vv[y]
						}
					}
					copy(os[(i*hq+j.h)*dim:(i*hq+j.h+1)*dim], acc)
				}
			}
		}()
	}
	for s := 0; s < meta.NumSeqs; s++ {
		for h := 0; h < hq; h++ {
			jobs <- job{s, h}
		}
	}
	close(jobs)
	wg.Wait()
}

// SiLUMul implements device.Device.
func (d *Device) SiLUMul(out, gateUp device.Tensor) {
	inter := out.Dim(-1)
	o, gu := F32(out), F32(gateUp)
	for r := 0; r < out.Dim(0); r++ {
		g, u := gu[r*2*inter:r*2*inter+inter], gu[r*2*inter+inter:(r+1)*2*inter]
		for j := range g {
			o[r*inter+j] = g[j] / (1 + float32(math.Exp(float64(-g[j])))) * u[j]
		}
	}
}

// GatherRows implements device.Device.
func (d *Device) GatherRows(out, x, rows device.Tensor) {
	row := x.RowSize()
	o, xs := F32(out), F32(x)
	for i, r := range I32(rows) {
		copy(o[i*row:(i+1)*row], xs[int(r)*row:(int(r)+1)*row])
	}
}

func init() {
	device.Register("cpu", func(device.OpenOptions) (device.Device, error) { return New(0), nil },
		func() error { return nil })
}
