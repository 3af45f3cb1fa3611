package model_test

import (
	"fmt"
	"slices"
	"testing"

	"ebb/device"
	"ebb/device/cpu"
	"ebb/memory"
	"ebb/model"
	"ebb/safetensors"
	"ebb/tinymodel"
)

// TestPlacerTakesEachRanksPart: whole checkpoint tensors on the device
// placed into a shard's targets give
// the weights that loading the shard from disk gives, for every target
// (row blocks of fused q/k/v and gate/up, column blocks of o_proj and
// down_proj, replicated KV heads, and each expert's blocks of a sparse
// layer).
func TestPlacerTakesEachRanksPart(t *testing.T) {
	for _, arch := range []string{"qwen3", "qwen3_moe"} {
		t.Run(arch, func(t *testing.T) { testPlacer(t, arch) })
	}
}

func testPlacer(t *testing.T, arch string) {
	dir := tinymodel.TestDir(t, arch, nil)
	set, err := safetensors.OpenDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	for _, size := range []int{2, 4} {
		// The CPU holds float32 only: conversions on the way are the GPU's Convert.
		t.Run(fmt.Sprintf("tp%d", size), func(t *testing.T) {
			rank := size - 1
			dev := cpu.New(0)
			m, err := model.Load(dev, dir, model.Options{ContextLen: 64, Shard: model.Shard{Rank: rank, Size: size},
				Comm: cpu.NewLocalGroup(size)[rank]})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := dev.Memory().Create(memory.Workspace, memory.RegionOptions{Capacity: 64 << 20, GrowStep: 1 << 20}); err != nil {
				t.Fatal(err)
			}
			alloc := func(dt device.DType, n int) (device.Tensor, error) { return dev.Alloc(memory.Workspace, dt, n) }
			free := func(x device.Tensor) { dev.Free(memory.Workspace, x) }
			p := model.NewPlacer(dev, alloc, free)
			sharded := 0
			for _, tg := range m.Targets() {
				want := slices.Clone(cpu.F32(tg.Dst))
				src, _ := set.Get(tg.Name)
				full, err := dev.Alloc(memory.Workspace, device.F32, src.Numel())
				if err != nil {
					t.Fatal(err)
				}
				if err := dev.Upload(full, src.Data, device.F32); err != nil {
					t.Fatal(err)
				}
				dev.Fill(tg.Dst, 0)
				if err := p.Place(tg, full); err != nil {
					t.Fatal(err)
				}
				if err := dev.Sync(); err != nil {
					t.Fatal(err)
				}
				if got := cpu.F32(tg.Dst); !slices.Equal(got, want) {
					t.Fatalf("%s: placed %v..., loaded %v...", tg.Name, got[:4], want[:4])
				}
				if !tg.Whole() {
					sharded++
				}
				free(full)
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			if sharded == 0 {
				t.Fatal("no target is sharded")
			}
			if err := p.Place(m.Targets()[0], device.Tensor{DType: device.F32, Shape: []int{3}}); err == nil {
				t.Fatal("a tensor of the wrong size was placed")
			}
		})
	}
}
