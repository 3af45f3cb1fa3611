package model

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"

	"ebb/device"
	"ebb/safetensors"
)

// LoadDummy fills the weights with random values from the config alone
// (SGLang's --load-format dummy): a model too large for the disk can be
// served for benchmarks. Norm weights are one and biases zero; every
// other tensor is uniform with the spread of N(0, 1/fan_in), so that
// activations keep their scale through the layers and a router spreads
// tokens over its experts as a trained one does. The values depend only
// on seed and each tensor's name.
func (m *Model) LoadDummy(seed uint64) error {
	dt := device.F32
	if m.dev.DType() == device.BF16 {
		dt = device.BF16 // half the bytes to move
	}
	for _, t := range m.Targets() {
		n := t.Dst.Numel()
		var scale float64
		switch {
		case strings.HasSuffix(t.Name, "norm.weight"):
			scale = -1 // ones
		case strings.HasSuffix(t.Name, ".bias"):
			scale = 0
		default:
			scale = math.Sqrt(3 / float64(t.Shape[len(t.Shape)-1]))
		}
		h := fnv.New64a()
		h.Write([]byte(t.Name))
		if err := m.dev.Upload(t.Dst, dummyValues(n, dt, seed^h.Sum64(), scale), dt); err != nil {
			return fmt.Errorf("dummy %s: %w", t.Name, err)
		}
	}
	if err := m.uploadRope(); err != nil {
		return fmt.Errorf("upload rotary tables: %w", err)
	}
	return m.dev.Sync()
}

// dummyValues encodes n values of dt: ones when scale < 0, else uniform
// in [-scale, scale), drawn in parallel blocks each seeded by its index.
func dummyValues(n int, dt device.DType, seed uint64, scale float64) []byte {
	size := dt.Size()
	out := make([]byte, n*size)
	const block = 1 << 16
	blocks := (n + block - 1) / block
	var wg sync.WaitGroup
	work := make(chan int, blocks)
	for b := 0; b < blocks; b++ {
		work <- b
	}
	close(work)
	for w := 0; w < min(runtime.GOMAXPROCS(0), blocks); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range work {
				rng := rand.New(rand.NewPCG(seed, uint64(b)))
				for i := b * block; i < min(n, (b+1)*block); i++ {
					v := float32(1)
					if scale >= 0 {
						v = float32((rng.Float64()*2 - 1) * scale)
					}
					if size == 2 {
						binary.LittleEndian.PutUint16(out[2*i:], safetensors.BF16Bits(v))
					} else {
						binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
					}
				}
			}
		}()
	}
	wg.Wait()
	return out
}
