package cuda

import (
	"encoding/binary"
	"fmt"
	"math"
	"sort"
	"time"

	"ebb/memory"
)

// MemoryTestOptions size `ebb selftest memory`.
type MemoryTestOptions struct {
	KVGiB      int           // kv_cache region, released without backup
	WeightsGiB int           // weights region, with CPU backup
	Cycles     int           // release/resume cycles for the drift check
	IdleCycles int           // release, wait Idle, resume: latency with the GPU idle in between
	Idle       time.Duration // the wait
	Log        func(string)
}

// Reading is NVML's view at one step.
type Reading struct {
	Step              string  `json:"step"`
	ProcessMiB        float64 `json:"process_mib"`
	OverBaselineMiB   float64 `json:"over_baseline_mib"`
	DeviceUsedMiB     float64 `json:"device_used_mib"`
	RegionReservedMiB float64 `json:"region_reserved_mib"`
}

// MemoryReport is the selftest's result.
type MemoryReport struct {
	Device                  string             `json:"device"`
	Driver                  int                `json:"driver_version"`
	GranularityMiB          float64            `json:"granularity_mib"`
	ProcessFigure           bool               `json:"nvml_per_process_figure"` // false: device-wide used memory
	BaselineProcessMiB      float64            `json:"bare_context_process_mib"`
	Readings                []Reading          `json:"readings"`
	ResidualMiB             float64            `json:"residual_after_release_all_mib"`
	KVGiB                   int                `json:"kv_gib"`
	ReleaseMs               []float64          `json:"kv_release_ms"`
	ResumeMs                []float64          `json:"kv_resume_ms"`
	ReleaseMedianMs         float64            `json:"kv_release_median_ms"`
	ResumeMedianMs          float64            `json:"kv_resume_median_ms"`
	ResumeAfterIdleMs       []float64          `json:"kv_resume_after_idle_ms"`
	ResumeAfterIdleMedianMs float64            `json:"kv_resume_after_idle_median_ms"`
	ResumeSplitMs           map[string]float64 `json:"kv_idle_cycle_call_ms"`
	GraphReplayOK           bool               `json:"graph_replay_after_resume_ok"`
	KVWritableAfter         bool               `json:"kv_writable_after_resume"`
	WeightsGiB              int                `json:"weights_gib"`
	BackupD2HGBps           float64            `json:"backup_release_gbps"`
	BackupH2DGBps           float64            `json:"backup_resume_gbps"`
	BackupBitExact          bool               `json:"backup_bit_exact"`
	EmptyCacheFreedMiB      float64            `json:"workspace_empty_cache_freed_mib"`
	Cycles                  int                `json:"cycles"`
	CycleStartMiB           float64            `json:"cycles_process_start_mib"`
	CycleEndMiB             float64            `json:"cycles_process_end_mib"`
	CycleMaxMiB             float64            `json:"cycles_process_max_mib"`
	ReservedStartBytes      int64              `json:"cycles_reserved_start_bytes"`
	ReservedEndBytes        int64              `json:"cycles_reserved_end_bytes"`
	CycleAllOK              bool               `json:"cycles_all_bit_exact"`
	Errors                  []string           `json:"errors,omitempty"`
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s) == 0 {
		return math.NaN()
	}
	return s[len(s)/2]
}

// SelfTestMemory exercises the memory layer on the GPU: regions written by
// a kernel, a CUDA graph captured over region memory, release and resume
// (timed), CPU backup (bandwidth, bit-exactness), and many cycles to show no
// drift. NVML measures the process at each step.
func SelfTestMemory(opts MemoryTestOptions) (*MemoryReport, error) {
	logf := func(format string, a ...any) {
		if opts.Log != nil {
			opts.Log(fmt.Sprintf(format, a...))
		}
	}
	ctx, err := Open(0)
	if err != nil {
		return nil, err
	}
	defer ctx.Close()
	nv, err := OpenNVML(ctx)
	if err != nil {
		return nil, err
	}
	rep := &MemoryReport{Device: ctx.Name, Driver: DriverVersion(), KVGiB: opts.KVGiB, WeightsGiB: opts.WeightsGiB, Cycles: opts.Cycles}
	// NVML's per-process figure can be missing (PID namespaces); the device
	// total is then the measure, which is right on a GPU no one else uses.
	usage := func(r NVMLReading) int64 {
		if r.ProcessBytes >= 0 {
			return r.ProcessBytes
		}
		return r.UsedBytes
	}
	base, err := nv.Read()
	if err != nil {
		return nil, err
	}
	rep.ProcessFigure = base.ProcessBytes >= 0
	rep.BaselineProcessMiB = mib(usage(base))
	fail := func(step string, err error) {
		if err != nil {
			rep.Errors = append(rep.Errors, step+": "+err.Error())
			logf("ERROR %s: %v", step, err)
		}
	}
	vmm, err := NewVMM(ctx)
	if err != nil {
		return nil, err
	}
	rep.GranularityMiB = mib(vmm.Granularity())
	mgr := memory.NewManager(vmm)
	defer mgr.Close()
	read := func(step string) Reading {
		r, err := nv.Read()
		fail("nvml "+step, err)
		var reserved int64
		for _, s := range mgr.Stats() {
			reserved += s.Reserved
		}
		rd := Reading{Step: step, ProcessMiB: mib(usage(r)), OverBaselineMiB: mib(usage(r) - usage(base)),
			DeviceUsedMiB: mib(r.UsedBytes), RegionReservedMiB: mib(reserved)}
		rep.Readings = append(rep.Readings, rd)
		logf("%-32s process %8.1f MiB (+%8.1f over bare context), regions %9.1f MiB", step, rd.ProcessMiB, rd.OverBaselineMiB, rd.RegionReservedMiB)
		return rd
	}
	read("bare context")
	mod, err := ctx.LoadKernels()
	if err != nil {
		return nil, err
	}
	defer mod.Unload()
	k, err := mod.Funcs("fill_pattern", "count_mismatch", "axpb")
	if err != nil {
		return nil, err
	}
	read("kernels loaded")

	kvBytes, wBytes := int64(opts.KVGiB)<<30, int64(opts.WeightsGiB)<<30
	kvR, err := mgr.Create(memory.KVCache, memory.RegionOptions{Capacity: kvBytes, GrowStep: kvBytes})
	if err != nil {
		return nil, err
	}
	wR, err := mgr.Create(memory.Weights, memory.RegionOptions{Capacity: wBytes, GrowStep: wBytes, PreserveContents: true, CPUBackup: true})
	if err != nil {
		return nil, err
	}
	gR, err := mgr.Create(memory.CUDAGraph, memory.RegionOptions{Capacity: 64 << 20, GrowStep: 64 << 20})
	if err != nil {
		return nil, err
	}
	wsR, err := mgr.Create(memory.Workspace, memory.RegionOptions{Capacity: 1 << 30, GrowStep: 64 << 20})
	if err != nil {
		return nil, err
	}
	kv, err := kvR.Alloc(kvBytes)
	if err != nil {
		return nil, err
	}
	w, err := wR.Alloc(wBytes)
	if err != nil {
		return nil, err
	}
	const n = 1 << 20 // graph vector length
	y, err := gR.Alloc(4 * n)
	if err != nil {
		return nil, err
	}
	counter, err := gR.Alloc(8)
	if err != nil {
		return nil, err
	}
	grid := D1(ctx.SMs * 8)
	fill := func(p uintptr, bytes int64, seed uint32) error {
		return ctx.LaunchKernel(k["fill_pattern"], grid, D1(256), 0, P(p), uint64(bytes/4), I(int(seed)))
	}
	mismatches := func(p uintptr, bytes int64, seed uint32) (uint64, error) {
		if err := ctx.MemsetD32(counter, 0, 2); err != nil {
			return 0, err
		}
		if err := ctx.LaunchKernel(k["count_mismatch"], grid, D1(256), 0, P(p), uint64(bytes/4), I(int(seed)), P(counter)); err != nil {
			return 0, err
		}
		var b [8]byte
		err := ctx.CopyDtoH(b[:], counter)
		return binary.LittleEndian.Uint64(b[:]), err
	}
	fail("fill kv", fill(kv, kvBytes, 1))
	fail("fill weights", fill(w, wBytes, 2))
	bad, err := mismatches(w, wBytes, 2)
	fail("check weights", err)
	if bad != 0 {
		fail("check weights", fmt.Errorf("%d words differ before any release", bad))
	}
	// The graph reads the first n words of the weights (as floats) and
	// writes y in the cuda_graph region.
	graph, err := ctx.Capture(func() error {
		return ctx.LaunchKernel(k["axpb"], D1((n+255)/256), D1(256), 0, P(y), P(w), F(2), F(1), I(n))
	})
	if err != nil {
		return nil, fmt.Errorf("capture: %w", err)
	}
	defer graph.Destroy()
	checkGraph := func() bool {
		if err := ctx.MemsetD32(y, 0, n); err != nil {
			fail("graph", err)
			return false
		}
		if err := ctx.Launch(graph); err != nil {
			fail("graph launch", err)
			return false
		}
		xs, ys := make([]byte, 4*n), make([]byte, 4*n)
		if err := ctx.CopyDtoH(xs, w); err != nil {
			fail("graph", err)
			return false
		}
		if err := ctx.CopyDtoH(ys, y); err != nil {
			fail("graph", err)
			return false
		}
		for i := 0; i < n; i++ {
			x := math.Float32frombits(binary.LittleEndian.Uint32(xs[4*i:]))
			got := math.Float32frombits(binary.LittleEndian.Uint32(ys[4*i:]))
			want := 2*x + 1
			if got != want && !(math.IsNaN(float64(got)) && math.IsNaN(float64(want))) {
				fail("graph", fmt.Errorf("y[%d] = %v, want %v", i, got, want))
				return false
			}
		}
		return true
	}
	if !checkGraph() {
		fail("graph", fmt.Errorf("graph wrong before any release"))
	}
	scratch, err := wsR.Alloc(512 << 20)
	fail("workspace alloc", err)
	fail("workspace free", wsR.Free(scratch))
	freed, err := wsR.EmptyCache()
	fail("empty cache", err)
	rep.EmptyCacheFreedMiB = mib(freed)
	read("regions resident")

	// Release everything, measure, resume, check.
	out := mgr.Release(memory.AllTags)
	fail("release all", out.Err())
	rel := read("all tags released")
	rep.ResidualMiB = rel.OverBaselineMiB
	out = mgr.Resume([]memory.Tag{memory.Weights, memory.KVCache, memory.CUDAGraph, memory.Workspace})
	fail("resume all", out.Err())
	read("all tags resumed")
	bad, err = mismatches(w, wBytes, 2)
	fail("weights after resume", err)
	rep.BackupBitExact = err == nil && bad == 0
	rep.GraphReplayOK = checkGraph()
	fail("kv fill after resume", fill(kv, kvBytes, 3))
	bad, err = mismatches(kv, kvBytes, 3)
	rep.KVWritableAfter = err == nil && bad == 0

	// Release/resume latency of the KV cache alone (no backup).
	for i := 0; i < 20; i++ {
		t0 := time.Now()
		fail("kv release", mgr.Release([]memory.Tag{memory.KVCache}).Err())
		t1 := time.Now()
		fail("kv resume", mgr.Resume([]memory.Tag{memory.KVCache}).Err())
		t2 := time.Now()
		rep.ReleaseMs = append(rep.ReleaseMs, float64(t1.Sub(t0).Microseconds())/1000)
		rep.ResumeMs = append(rep.ResumeMs, float64(t2.Sub(t1).Microseconds())/1000)
	}
	rep.ReleaseMedianMs, rep.ResumeMedianMs = median(rep.ReleaseMs), median(rep.ResumeMs)
	logf("kv_cache %d GiB: release median %.2f ms, resume median %.2f ms", opts.KVGiB, rep.ReleaseMedianMs, rep.ResumeMedianMs)
	// The same with the GPU idle between release and resume, as when a
	// trainer runs in between: the driver has time to recycle the memory.
	before := vmm.Timings
	for i := 0; i < opts.IdleCycles; i++ {
		fail("kv release", mgr.Release([]memory.Tag{memory.KVCache}).Err())
		time.Sleep(opts.Idle)
		t0 := time.Now()
		fail("kv resume", mgr.Resume([]memory.Tag{memory.KVCache}).Err())
		rep.ResumeAfterIdleMs = append(rep.ResumeAfterIdleMs, float64(time.Since(t0).Microseconds())/1000)
	}
	if opts.IdleCycles > 0 {
		rep.ResumeAfterIdleMedianMs = median(rep.ResumeAfterIdleMs)
		n := float64(opts.IdleCycles)
		tm := vmm.Timings
		rep.ResumeSplitMs = map[string]float64{
			"cuMemCreate":    float64((tm.Create - before.Create).Microseconds()) / 1000 / n,
			"cuMemMap":       float64((tm.Map - before.Map).Microseconds()) / 1000 / n,
			"cuMemSetAccess": float64((tm.SetAccess - before.SetAccess).Microseconds()) / 1000 / n,
			"cuMemUnmap":     float64((tm.Unmap - before.Unmap).Microseconds()) / 1000 / n,
			"cuMemRelease":   float64((tm.Release - before.Release).Microseconds()) / 1000 / n,
		}
		logf("kv_cache resume after %v idle: median %.2f ms; per cycle %v", opts.Idle, rep.ResumeAfterIdleMedianMs, rep.ResumeSplitMs)
	}

	// CPU backup bandwidth: the weights region's release copies to pinned
	// host memory, its resume copies back.
	t0 := time.Now()
	fail("weights release", mgr.Release([]memory.Tag{memory.Weights}).Err())
	t1 := time.Now()
	fail("weights resume", mgr.Resume([]memory.Tag{memory.Weights}).Err())
	t2 := time.Now()
	rep.BackupD2HGBps = float64(wBytes) / t1.Sub(t0).Seconds() / 1e9
	rep.BackupH2DGBps = float64(wBytes) / t2.Sub(t1).Seconds() / 1e9
	bad, err = mismatches(w, wBytes, 2)
	rep.BackupBitExact = rep.BackupBitExact && err == nil && bad == 0
	logf("weights backup %d GiB: release %.1f GB/s, resume %.1f GB/s, bit-exact %v", opts.WeightsGiB, rep.BackupD2HGBps, rep.BackupH2DGBps, rep.BackupBitExact)

	// Drift: many full cycles.
	reserved := func() int64 {
		var r int64
		for _, s := range mgr.Stats() {
			r += s.Reserved
		}
		return r
	}
	start := read("cycles start")
	rep.CycleStartMiB, rep.ReservedStartBytes = start.ProcessMiB, reserved()
	rep.CycleAllOK = true
	for i := 0; i < opts.Cycles; i++ {
		fail("cycle release", mgr.Release(memory.AllTags).Err())
		if r, err := nv.Read(); err == nil {
			rep.CycleMaxMiB = math.Max(rep.CycleMaxMiB, mib(usage(r)))
		}
		fail("cycle resume", mgr.Resume([]memory.Tag{memory.Weights, memory.KVCache, memory.CUDAGraph, memory.Workspace}).Err())
		if r, err := nv.Read(); err == nil {
			rep.CycleMaxMiB = math.Max(rep.CycleMaxMiB, mib(usage(r)))
		}
		if i%100 == 99 || i == opts.Cycles-1 {
			bad, err := mismatches(w, wBytes, 2)
			rep.CycleAllOK = rep.CycleAllOK && err == nil && bad == 0 && checkGraph()
			logf("cycle %d: bit-exact %v", i+1, rep.CycleAllOK)
		}
	}
	end := read("cycles end")
	rep.CycleEndMiB, rep.ReservedEndBytes = end.ProcessMiB, reserved()
	fail("invariants", mgr.CheckInvariants())
	return rep, nil
}
