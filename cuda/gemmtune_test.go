package cuda

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"ebb/device"
	"ebb/memory"
)

func TestRowBucket(t *testing.T) {
	for _, c := range []struct{ m, want int }{
		{512, 512}, {513, 768}, {768, 768}, {769, 1024}, {1000, 1024}, {1025, 1536},
		{6144, 6144}, {6145, 8192}, {8192, 8192}, {8448, 12288}, {32768, 32768},
	} {
		if got := rowBucket(c.m); got != c.want {
			t.Errorf("rowBucket(%d) = %d, want %d", c.m, got, c.want)
		}
	}
}

// TestBitsHash compares bits_hash with its CPU reference.
func TestBitsHash(t *testing.T) {
	p := newPair(t)
	if p.gpu.tuner == nil {
		t.Skip("no cuBLASLt")
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{1, 31, 4096, 1<<20 + 37} {
		words := make([]uint32, n)
		raw := make([]byte, 4*n)
		for i := range words {
			words[i] = rng.Uint32()
			binary.LittleEndian.PutUint32(raw[4*i:], words[i])
		}
		buf, err := p.gpu.Alloc(memory.Workspace, device.I32, n)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.gpu.Upload(buf, raw, device.I32); err != nil {
			t.Fatal(err)
		}
		got, err := p.gpu.outputHash(buf.Ptr, int64(4*n))
		if err != nil {
			t.Fatal(err)
		}
		if want := bitsHash(words); got != want {
			t.Errorf("%d words: bits_hash %#x, CPU %#x", n, got, want)
		}
		words[n/2]++
		if bitsHash(words) == got {
			t.Errorf("%d words: one changed word leaves the hash", n)
		}
	}
}

// TestTunedMatMul: a tuned product, the first time (while it is timed) and
// after, for the tuned rows and others of the same bucket, has the bits
// of cublasGemmEx's.
func TestTunedMatMul(t *testing.T) {
	p := newPair(t)
	if p.gpu.tuner == nil {
		t.Skip("no cuBLASLt")
	}
	for _, c := range []struct{ m, n, k int }{{600, 1024, 2048}, {8192, 6144, 1024}, {8000, 4096, 1024}, {1000, 1024, 3072}} {
		x, w := p.random(device.BF16, 1, c.m, c.k), p.random(device.BF16, 0.05, c.n, c.k)
		want := p.random(device.BF16, 1, c.m, c.n)
		p.gpu.fail(p.gpu.blas.gemm(want.g.Ptr, false, x.g.Ptr, w.g.Ptr, c.m, c.n, c.k, false))
		ref := p.bits(want.g)
		for _, m := range []int{c.m, c.m - 7} {
			for pass := 0; pass < 2; pass++ {
				got := p.random(device.BF16, 1, m, c.n)
				if !p.gpu.tunedMatMul(got.g.Ptr, false, x.g.Ptr, w.g.Ptr, m, c.n, c.k) {
					ch := p.gpu.tuner.choices[gemmShape{rowBucket(m), c.n, c.k, false}]
					if ch.lt {
						t.Fatalf("%dx%dx%d: tuned to cuBLASLt, yet not run", m, c.n, c.k)
					}
					continue
				}
				b := p.bits(got.g)
				for i := range b {
					if b[i] != ref[i] {
						t.Fatalf("%dx%dx%d pass %d: element %d differs from cublasGemmEx", m, c.n, c.k, pass, i)
					}
				}
			}
		}
	}
	if len(p.gpu.tuner.choices) == 0 {
		t.Error("nothing was tuned")
	}
}

// bits downloads a bf16 tensor's raw 16-bit values.
func (p *pair) bits(x device.Tensor) []uint16 {
	p.t.Helper()
	p.sync()
	raw := make([]byte, x.Bytes())
	if err := p.gpu.ctx.CopyDtoH(raw, x.Ptr); err != nil {
		p.t.Fatal(err)
	}
	out := make([]uint16, len(raw)/2)
	for i := range out {
		out[i] = binary.LittleEndian.Uint16(raw[2*i:])
	}
	return out
}

// TestBenchMatMulCandidates: the matmul benchmark's cuBLASLt candidates
// are listed with their configurations, timed, and the ones without
// split-K (whose bits cublasGemmEx's first choice shares on H100 and
// H200 at decode rows) include one with the product's bits.
func TestBenchMatMulCandidates(t *testing.T) {
	p := newPair(t)
	if p.gpu.tuner == nil {
		t.Skip("no cuBLASLt")
	}
	r, err := BenchMatMul(p.gpu, MatMulBenchSpec{M: 256, N: 1024, K: 2048, Iters: 3, Candidates: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.LtCandidates) == 0 {
		t.Fatal("no candidates")
	}
	same := false
	for i, c := range r.LtCandidates {
		if c.Index != i || c.SplitK < 0 || (c.MedianUs <= 0 && c.MedianUs != -1) {
			t.Fatalf("candidate %d: %+v", i, c)
		}
		same = same || c.SameBits
	}
	if !same {
		t.Errorf("no candidate gives cublasGemmEx's bits: %+v", r.LtCandidates)
	}
}
