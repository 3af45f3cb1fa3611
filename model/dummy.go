package model

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math"
	"runtime"
	"strings"
	"sync"

	"ebb/device"
)

// LoadDummy fills the weights with random values from the config alone
// (SGLang's --load-format dummy): a model too large for the disk can be
// served for benchmarks. Norm weights are one and biases zero; every
// other tensor is uniform with the spread of N(0, 1/fan_in), so that
// activations keep their scale through the layers and a router spreads
// tokens over its experts as a trained one does. The values depend only
// on seed and each tensor's name (device.UniformAt), and a device that
// draws them itself (device.UniformFiller) gives the host's bits.
func (m *Model) LoadDummy(seed uint64) error {
	filler, _ := m.dev.(device.UniformFiller)
	for _, t := range m.Targets() {
		switch {
		case strings.HasSuffix(t.Name, "norm.weight"):
			m.dev.Fill(t.Dst, 1)
			continue
		case strings.HasSuffix(t.Name, ".bias"):
			m.dev.Fill(t.Dst, 0)
			continue
		}
		h := fnv.New64a()
		h.Write([]byte(t.Name))
		s := seed ^ h.Sum64()
		step := device.UniformStep(float32(math.Sqrt(3 / float64(t.Shape[len(t.Shape)-1]))))
		if filler != nil {
			filler.FillUniform(t.Dst, s, step)
			continue
		}
		if err := m.dev.Upload(t.Dst, dummyValues(t.Dst.Numel(), s, step), device.F32); err != nil {
			return fmt.Errorf("dummy %s: %w", t.Name, err)
		}
	}
	if err := m.uploadRope(); err != nil {
		return fmt.Errorf("upload rotary tables: %w", err)
	}
	return m.dev.Sync()
}

// dummyValues encodes n float32 draws of device.UniformAt, in parallel.
func dummyValues(n int, seed uint64, step float32) []byte {
	out := make([]byte, 4*n)
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
				for i := b * block; i < min(n, (b+1)*block); i++ {
					binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(device.UniformAt(seed, uint64(i), step)))
				}
			}
		}()
	}
	wg.Wait()
	return out
}
