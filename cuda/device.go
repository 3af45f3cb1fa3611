package cuda

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"ebb/device"
	"ebb/memory"
	"ebb/safetensors"
)

// Device implements device.Device on one GPU in bf16. It must be used from
// the goroutine that opened it (which Open locks to its OS thread).
type Device struct {
	ctx  *Context
	vmm  *VMM
	mem  *memory.Manager
	mod  *Module
	k    map[string]*Kernel
	blas *blas
	// tuner picks prefill products' cuBLASLt algorithms (nil: cublasGemmEx).
	tuner     *gemmTuner
	capturing bool // inside CaptureGraph: nothing may be timed or synchronised
	nvml      *NVML
	err       error

	partO, partML device.Tensor  // split-KV attention partials (fixed addresses, for graphs)
	counters      device.Tensor  // split-KV merge counters, zero between launches
	samplePart    device.Tensor  // per-slice row reductions for sampling
	rowSquares    device.Tensor  // MatMulAdd's per-block sums of squares, for RMSNormMatMul
	pendingNorm   pendingNorm    // what the last MatMulAdd left in rowSquares
	routeSort     device.Tensor  // moe_add_norm_route's grouping of the pairs by expert and its counts, zero between launches (routeSortLayout)
	routeSorted   routeSorted    // what the last moe_add_norm_route grouped there, for the experts after it
	pinned        []*pinned      // host staging buffers handed out by AllocPinned
	savedStack    int64          // stack limit to restore on resume (0: not shrunk)
	prefillShared int            // dynamic shared memory the prefill kernel is allowed
	mmaShared     map[int]bool   // head sizes whose tensor-core prefill kernel was allowed its shared memory
	fences        []*Event       // idle events for Fence
	peers         *peerAllReduce // the tensor-parallel group's all-reduce, released with cuda_graph
	wgmma         bool           // matmul_wg runs: the kernels were built for sm_90a
	wgMaxRows     int            // matmul_wg's most rows where EBB_MATMUL_WG_ROWS sets it (0: matMulWGMaxRows)
	wgMaxTiles    int            // the most weight tiles of a product without glu that matmul_wg takes where EBB_MATMUL_WG_TILES sets it (0: matMulWGMaxTiles)
	noPart        bool           // matmul_wg_part is not used (EBB_MATMUL_WG_PART=0): prefills split K over clusters
	noPartOne     bool           // deterministic products of one split keep a block a tile (EBB_DET_PART_ONE=0)
	wgOneTile     bool           // matmul_wg_part's blocks take one tile each (EBB_MATMUL_WG_PERSIST=0)
	wgBlock       int            // matmul_wg's threads a block (matMulWGBlock)
	wgClusters    clusterFit     // clusters of matmul_wg blocks that run at once
	fewResident   blocksByWarps  // matmul_wg_few blocks that run at once, by warps a block (0: the driver cannot say)
	wgSplits      int            // the most K splits outside deterministic inference (EBB_MATMUL_WG_SPLITS; 0: the clusters that fit)
	wgNo192       bool           // batches of 129-192 rows take the 256-row tile (EBB_MATMUL_WG_N192=0)
	noQKVEpilogue bool           // deterministic qkv products leave q, k and v to prepare_qkv16 (EBB_DET_QKV_EPILOGUE=0)
	detPartFrom   int            // deterministic qkv products run on matmul_wg_part past this many rows (EBB_DET_PART_FROM; 0: matMulWGDetPartFrom)
	noDetFold     bool           // deterministic inference runs every add_rmsnorm in a launch of its own (EBB_DET_FOLD=0)
	few           fewSettings    // the products matmul_wg_few takes (EBB_MATMUL_FEW, EBB_DET_FEW_*)
	foldTC        bool           // matmul_tc takes part in add_rmsnorm (EBB_NORM_FOLD)
	foldWG        bool           // matmul_wg takes part in add_rmsnorm (EBB_NORM_FOLD)
	rawDecode     bool           // decode attention prepares its own q, k and v (EBB_DECODE_PREPARE)
	gqaFrom       int            // the fewest query heads a kv head that decode on attn_decode_gqa (EBB_DECODE_GQA; 0: gqaDecodeFrom)
	gqaWaves      int            // attn_decode_gqa's waves where EBB_GQA_WAVES sets it (0: decodeVecGrid's)
	gqaLean       int            // when attn_decode_gqa takes its lean kernels (EBB_GQA_LEAN: leanByContext, leanAlways, leanNever)
	gqaHeads      int            // the kv heads a lean attn_decode_gqa block takes where EBB_GQA_HEADS_A_BLOCK sets them (0: gqaHeadsABlock chooses 1 or 2)
	wgFullRing    bool           // matmul_wg allocates its whole ring however few k-steps a block runs (EBB_MATMUL_WG_RING=full)
	skipKernels   kernelSet      // kernels not launched, for timing only (EBB_SKIP_KERNELS): see launch
	skipRepeats   lastLaunches   // kernels not launched again with their last launch's arguments (EBB_SKIP_KERNELS name:repeats)
	moeGemvTokens int            // MoE steps of at most this many tokens take moe_gemv_glu (EBB_MOE_GEMV_TOKENS)
	moeGluBlocks  int            // moe_gemv_glu's blocks an SM, each taking column groups in turn (EBB_MOE_GLU_BLOCKS, every step; 0: a block a group; -1, unset: moeGluBlocks for one token)
	moeTileRows   int            // moe_gemm's tile height where EBB_MOE_TILE_ROWS sets it (0: by the rows an expert averages)
	moeWG         bool           // moe_wg takes the grouped products where it can (EBB_MOE_WG=0: moe_gemm)
	moeSortedFrom int            // moe_wg's smallest row tile whose gate and up read x's rows sorted first (EBB_MOE_SORTED_FROM)
	noMoEFold     bool           // a sparse layer's norms and routing are not folded into its decode launches (EBB_MOE_FOLD=0)
	noRouteSort   bool           // moe_add_norm_route leaves the grouping by expert to moe_sort (EBB_MOE_ROUTE_SORT=0)
	moeFirstTiles int            // pairs an expert averages from which moe_wg's gate and up take experts' first tiles by block (EBB_MOE_FIRST_TILES; moeFirstTilesFrom)
	noDownFirst   bool           // moe_wg's down looks its tiles up as before, where gate and up take first tiles by block (EBB_MOE_DOWN_FIRST=0)
	moeRouteWarps int            // moe_norm_route's warps a block (MOE_ROUTE_WARPS)
	normRouteRows int            // the most tokens moe_add_norm_route takes (EBB_MOE_NORM_ROUTE_ROWS)
	routeEights   int            // the most it takes in clusters of eight tokens (moeNormRouteEights; tests change it)
	noMoEBulk     bool           // moe_down_combine reads its weights into registers, not by bulk copies (EBB_MOE_BULK=0)
	moeWGRing32   int            // moe_wg's ring at 32-row tiles (MOE_WG_RING32, which the kernels read too)
	tcLarge       bool           // matmul_tc takes 9-24 rows of large weights too (EBB_MATMUL_TC=all)
	decodeSplits  int            // attn_decode_vec's most splits where EBB_DECODE_SPLITS sets it (0: default)
	whole         int            // the longest context a balanced decode kernel takes in one split where wholeSet
	wholeSet      bool           // EBB_DECODE_WHOLE set whole
	decodeOne     int            // the most pairs whose one-split contexts take attn_decode_gqa_one (decodeOneFromEnv)
	sampleWaves   int            // sample_scan's grid in blocks per SM (EBB_SAMPLE_WAVES; sampleScanWaves)
	// det: deterministic inference (deterministic.go), with attn_det's
	// decode partials.
	det                 bool
	detPartO, detPartML device.Tensor
	detPartRows         int           // tests: fewer partial rows, for sequences whose partials do not fit
	detParts            device.Tensor // o_proj's and down_proj's split sums (detMatMulAddRMSNorm)
	noDetParts          bool          // those products keep their clusters' exchange (EBB_DET_PARTS=0)
	detPartsRows        int           // detPartsMaxRows where EBB_DET_PARTS_ROWS sets it
	detLoneSplits       int           // a decode of at most this many splits is one block's (detLoneSplits)
}

var (
	_ device.Device            = (*Device)(nil)
	_ device.GraphCapturer     = (*Device)(nil)
	_ device.ContextDecoder    = (*Device)(nil)
	_ device.MemoryInfo        = (*Device)(nil)
	_ device.Profiler          = (*Device)(nil)
	_ device.PinnedAllocator   = (*Device)(nil)
	_ device.Streamer          = (*Device)(nil)
	_ device.ResumeHook        = (*Device)(nil)
	_ device.MemoryReporter    = (*Device)(nil)
	_ device.IPCImporter       = (*Device)(nil)
	_ device.GroupJoiner       = (*Device)(nil)
	_ device.Fused             = (*Device)(nil)
	_ device.AttentionPreparer = (*Device)(nil)
	_ device.Deterministic     = (*Device)(nil)
)

// OpenIPCMemory implements device.IPCImporter.
func (d *Device) OpenIPCMemory(handle [64]byte) (uintptr, error) { return d.ctx.OpenIPCMemory(handle) }

// CloseIPCMemory implements device.IPCImporter.
func (d *Device) CloseIPCMemory(ptr uintptr) error { return d.ctx.CloseIPCMemory(ptr) }

// WaitIPCEvent implements device.IPCImporter.
func (d *Device) WaitIPCEvent(handle [64]byte) error { return d.ctx.WaitIPCEvent(handle) }

// SameDevice implements device.IPCImporter.
func (d *Device) SameDevice(producer string) bool { return d.ctx.SameDevice(producer) }

// JoinGroup implements device.GroupJoiner with an NCCL communicator.
func (d *Device) JoinGroup(id [128]byte, nranks, rank int, timeout time.Duration) (device.Group, error) {
	if d.err != nil {
		return nil, d.Sync()
	}
	c, err := d.ctx.NewComm(id, nranks, rank, timeout)
	if err != nil {
		// The commonest cause: NCCL refuses ranks of different versions,
		// and a trainer's PyTorch ships its own.
		if v, verr := NCCLVersion(); verr == nil {
			err = fmt.Errorf("%w (ebb runs NCCL %d.%d.%d and every rank must run the same version: "+
				"set EBB_NCCL_LIBRARY to the trainer's libnccl.so.2)", err, v/10000, v%10000/100, v%100)
		}
		return nil, err // not a nil *Comm in an interface
	}
	return c, nil
}

const (
	// MatMul on one row is a gemv, fused with the norms around it; from
	// two rows matmul_tc with separate add_rmsnorm and silu_mul is faster
	// than the fused gemvs were (H100 decode steps, batch 2, 3, 4:
	// 1.207, 1.491, 1.495 ms -> 1.140, 1.157, 1.164 ms); past 24 rows cuBLAS.
	gemvMaxRows     = 1
	cublasWorkspace = 32 << 20
	partialBytes    = 16 << 20
	graphRegionVA   = 64 << 30 // address space only; memory is mapped as used
)

func init() {
	device.Register("cuda", func(o device.OpenOptions) (device.Device, error) { return OpenDevice(o.Ordinal) },
		Available)
}

var kernelNames = []string{
	"embedding", "rmsnorm", "add_rmsnorm", "add_rmsnorm_f32x", "rmsnorm_v8", "add_rmsnorm_v8", "add_rmsnorm_f32x_v8", "add_rmsnorm_parts_v8", "add_bias", "add_bias_f32", "prepare_qkv", "prepare_qkv16", "silu_mul", "silu_mul_v8",
	"gather_rows", "fill_bf16", "fill_f32", "fill_uniform_bf16", "fill_uniform_f32", "bits_hash", "attn_prefill", "apply_penalties", "resolve_tokens",
	"token_logprobs", "bf16_to_f32", "bf16_to_f32_v8", "f32_to_bf16", "f16_to_bf16", "f16_to_f32",
	"sample_scan_f32", "sample_finish_f32", "sample_scan_bf16", "sample_finish_bf16",
	"sample_scan_det_f32", "sample_scan_det_bf16", "token_logprobs_det", "attn_det_d64", "attn_det_d128", "attn_det_dec_d64", "attn_det_dec_d128",
	"gemv_m1", "gemv2_m1", "gemv_m1_one_wave", "gemv2_m1_one_wave", "gemv_fused_m1", "attn_decode_gqa_d128", "attn_decode_gqa_raw_d128", "attn_decode_gqa_lean_d128", "attn_decode_gqa_lean_raw_d128",
	"attn_decode_gqa_one_d128", "attn_decode_gqa_one_raw_d128",
	"matmul_tc_t1", "matmul_tc_t2", "matmul_tc_t3", "matmul_wg_few_t1", "matmul_wg_few_t2", "matmul_wg_n32", "matmul_wg_n48", "matmul_wg_n64", "matmul_wg_n96",
	"matmul_wg_n128", "matmul_wg_n192", "matmul_wg_n256", "matmul_wg_part_n64", "matmul_wg_part_n128",
	"matmul_wg_part_qkv_n64", "matmul_wg_part_qkv_n128", "matmul_wg_few_qkv_t1", "matmul_wg_few_qkv_t2",
	"moe_route", "moe_norm_route", "moe_add_norm_route", "moe_add_norm_route16", "moe_sort", "moe_sorted_rows", "moe_gemm", "moe_gemm_r16", "moe_combine", "moe_combine_add_rmsnorm", "moe_gemv_glu", "moe_gemv_glu_loop", "moe_down_combine", "moe_down_bulk", "moe_shared_add",
	"moe_wg_n32", "moe_wg_n64", "moe_wg_n128",
	"allreduce_f32", "allreduce_f32_v4", "allreduce_add_rmsnorm", "allgather_cols_u16", "allgather_cols_v16", "copy_cols_u16",
}

// OpenDevice opens GPU ordinal: context, kernels, cuBLAS, and the cuda_graph
// region holding the fixed buffers (cuBLAS workspace, attention partials)
// that captured graphs point at.
func OpenDevice(ordinal int) (*Device, error) {
	ctx, err := Open(ordinal)
	if err != nil {
		return nil, err
	}
	d := &Device{ctx: ctx, mmaShared: map[int]bool{}}
	if err := d.init(); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

func (d *Device) init() error {
	var err error
	if d.vmm, err = NewVMM(d.ctx); err != nil {
		return err
	}
	d.mem = memory.NewManager(d.vmm)
	if d.mod, err = d.ctx.LoadKernels(); err != nil {
		return err
	}
	if d.k, err = d.mod.Funcs(kernelNames...); err != nil {
		return err
	}
	if _, err := d.mem.Create(memory.CUDAGraph, memory.RegionOptions{Capacity: graphRegionVA, GrowStep: 64 << 20}); err != nil {
		return err
	}
	ws, err := d.mem.Alloc(memory.CUDAGraph, cublasWorkspace)
	if err != nil {
		return err
	}
	if d.blas, err = newBLAS(d.ctx, ws, cublasWorkspace); err != nil {
		return err
	}
	if d.tuner, err = d.newGemmTuner(); err != nil {
		return err
	}
	if d.partO, err = d.Alloc(memory.CUDAGraph, device.F32, partialBytes/4); err != nil {
		return err
	}
	if d.partML, err = d.Alloc(memory.CUDAGraph, device.F32, partialBytes/4/64); err != nil {
		return err
	}
	if d.counters, err = d.Alloc(memory.CUDAGraph, device.I32, 1<<16); err != nil {
		return err
	}
	d.fail(d.ctx.MemsetD32(d.counters.Ptr, 0, 1<<16))
	if d.routeSort, err = d.Alloc(memory.CUDAGraph, device.I32, routeSortInts); err != nil {
		return err
	}
	d.fail(d.ctx.MemsetD32(d.routeSort.Ptr, 0, routeSortInts))
	if d.samplePart, err = d.Alloc(memory.CUDAGraph, device.F32, 1<<18); err != nil {
		return err
	}
	// Sums of squares: gemv_fused's blocks for one row, matmul_tc's
	// 16-column groups or matmul_wg's 128-column tiles for theirs (hidden
	// sizes to 8,192).
	squares := max(gemvMaxRows*8*1024, 8*matMulTCMaxTiles*8192/16, matMulWGNormRows*8192/matMulWGTileRows)
	if d.rowSquares, err = d.Alloc(memory.CUDAGraph, device.F32, squares); err != nil {
		return err
	}
	fold := os.Getenv("EBB_NORM_FOLD")
	d.foldTC, d.foldWG = fold != "0" && fold != "wg", fold != "0" && fold != "tc"
	d.rawDecode = os.Getenv("EBB_DECODE_PREPARE") != "separate"
	d.gqaFrom = gqaFromEnv(os.Getenv("EBB_DECODE_GQA"))
	switch os.Getenv("EBB_GQA_LEAN") {
	case "1":
		d.gqaLean = leanAlways
	case "0":
		d.gqaLean = leanNever
	}
	if n, err := strconv.Atoi(os.Getenv("EBB_GQA_WAVES")); err == nil && n > 0 {
		d.gqaWaves = n
	}
	if n, err := strconv.Atoi(os.Getenv("EBB_GQA_HEADS_A_BLOCK")); err == nil && n > 0 {
		d.gqaHeads = n
	}
	d.wgFullRing = os.Getenv("EBB_MATMUL_WG_RING") == "full"
	if d.skipKernels, d.skipRepeats = skipList(os.Getenv("EBB_SKIP_KERNELS")); d.skipKernels != nil || d.skipRepeats != nil {
		fmt.Fprintf(os.Stderr, "ebb: EBB_SKIP_KERNELS=%s: these kernels are not launched and every output is wrong (for timing only)\n",
			os.Getenv("EBB_SKIP_KERNELS"))
	}
	d.moeGemvTokens = moeGemvTokens
	d.noMoEFold = os.Getenv("EBB_MOE_FOLD") == "0"
	d.noRouteSort = os.Getenv("EBB_MOE_ROUTE_SORT") == "0"
	d.moeFirstTiles = moeFirstTilesFrom
	d.noDownFirst = os.Getenv("EBB_MOE_DOWN_FIRST") == "0"
	if n, err := strconv.Atoi(os.Getenv("EBB_MOE_FIRST_TILES")); err == nil {
		d.moeFirstTiles = n
	}
	d.moeRouteWarps = kernelDefineInt("MOE_ROUTE_WARPS", moeRouteWarps)
	d.normRouteRows, d.routeEights = moeNormRouteRows, moeNormRouteEights
	if n, err := strconv.Atoi(os.Getenv("EBB_MOE_NORM_ROUTE_ROWS")); err == nil && n >= 0 {
		d.normRouteRows = min(n, moeNormRouteMaxRows)
	}
	if d.ctx.CCMajor >= 9 {
		for _, k := range moeNormRouteKernels {
			if err := d.k[k.name].SetMaxDynamicShared(moeNormRouteShared(k.tokens, moeNormRouteHidden)); err != nil {
				return err
			}
		}
	}
	if n, err := strconv.Atoi(os.Getenv("EBB_MOE_GEMV_TOKENS")); err == nil && n >= 0 {
		d.moeGemvTokens = n
	}
	d.moeGluBlocks = -1
	if n, err := strconv.Atoi(os.Getenv("EBB_MOE_GLU_BLOCKS")); err == nil && n >= 0 {
		d.moeGluBlocks = n
	}
	d.moeSortedFrom = moeSortedFrom
	if n, err := strconv.Atoi(os.Getenv("EBB_MOE_SORTED_FROM")); err == nil && n > 0 {
		d.moeSortedFrom = n
	}
	if n, err := strconv.Atoi(os.Getenv("EBB_MOE_TILE_ROWS")); err == nil && (n == 16 || n == 64) {
		d.moeTileRows = n
	}
	d.noDetFold = os.Getenv("EBB_DET_FOLD") == "0"
	d.noDetParts = os.Getenv("EBB_DET_PARTS") == "0"
	if n, err := strconv.Atoi(os.Getenv("EBB_DET_PARTS_ROWS")); err == nil && n > 0 {
		d.detPartsRows = n
	}
	d.few = fewFromEnv()
	d.tcLarge = os.Getenv("EBB_MATMUL_TC") == "all"
	d.decodeOne = decodeOneFromEnv(os.Getenv("EBB_DECODE_ONE"))
	if n, err := strconv.Atoi(os.Getenv("EBB_DECODE_WHOLE")); err == nil && n >= 0 {
		d.whole, d.wholeSet = n, true
	}
	if n, err := strconv.Atoi(os.Getenv("EBB_DECODE_SPLITS")); err == nil && n > 0 {
		d.decodeSplits = min(n, decodeVecMaxSplits)
	}
	d.sampleWaves = sampleScanWaves
	if n, err := strconv.Atoi(os.Getenv("EBB_SAMPLE_WAVES")); err == nil && n > 0 {
		d.sampleWaves = n
	}
	if err := d.initMatMulWG(); err != nil {
		return err
	}
	if d.nvml, err = OpenNVML(d.ctx); err != nil {
		d.nvml = nil // reports only; the engine runs without it
	}
	return nil
}

// Context exposes the CUDA context (for benchmarks and self-tests).
func (d *Device) Context() *Context { return d.ctx }

// NVML returns the NVML reader, or nil when NVML is unavailable.
func (d *Device) NVML() *NVML { return d.nvml }

// Name implements device.Device.
func (d *Device) Name() string { return fmt.Sprintf("cuda:%d (%s)", d.ctx.Ordinal, d.ctx.Name) }

// DType implements device.Device.
func (d *Device) DType() device.DType { return device.BF16 }

// Memory implements device.Device.
func (d *Device) Memory() *memory.Manager { return d.mem }

// DeviceMemory implements device.MemoryInfo.
func (d *Device) DeviceMemory() (free, total int64, err error) { return d.ctx.MemInfo() }

func (d *Device) fail(err error) {
	if err != nil && d.err == nil {
		d.err = err
	}
}

// Sync implements device.Device.
func (d *Device) Sync() error {
	d.fail(d.ctx.SyncStream())
	err := d.err
	d.err = nil
	return err
}

// Close implements device.Device.
func (d *Device) Close() error {
	var errs []error
	if d.ctx != nil {
		errs = append(errs, d.ctx.Synchronize())
	}
	if d.blas != nil {
		errs = append(errs, d.blas.destroy())
	}
	errs = append(errs, d.tuner.destroy())
	if d.mem != nil {
		errs = append(errs, d.mem.Close())
	}
	for _, p := range d.pinned {
		errs = append(errs, p.Free())
	}
	for _, ev := range d.fences {
		errs = append(errs, ev.Destroy())
	}
	if d.mod != nil {
		errs = append(errs, d.mod.Unload())
	}
	if d.ctx != nil {
		errs = append(errs, d.ctx.Close())
	}
	return errors.Join(errs...)
}

// Alloc implements device.Device.
func (d *Device) Alloc(tag memory.Tag, dtype device.DType, shape ...int) (device.Tensor, error) {
	return device.AllocIn(d.mem, tag, dtype, shape...)
}

// Free implements device.Device.
func (d *Device) Free(tag memory.Tag, t device.Tensor) {
	if t.Ptr != 0 {
		d.fail(d.mem.Free(tag, t.Ptr))
	}
}

// Upload implements device.Device; conversions happen on the host.
func (d *Device) Upload(dst device.Tensor, src []byte, srcType device.DType) error {
	n := dst.Numel()
	if len(src) != n*srcType.Size() {
		return fmt.Errorf("upload to %v: %d bytes of %s", dst, len(src), srcType)
	}
	if dst.DType == srcType {
		return d.ctx.CopyHtoD(dst.Ptr, src)
	}
	f := decodeFloats(src, srcType)
	if f == nil {
		return fmt.Errorf("upload to %v from %s", dst, srcType)
	}
	var out []byte
	switch dst.DType {
	case device.BF16:
		out = make([]byte, 2*n)
		for i, v := range f {
			binary.LittleEndian.PutUint16(out[2*i:], safetensors.BF16Bits(v))
		}
	case device.F32:
		out = make([]byte, 4*n)
		for i, v := range f {
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
		}
	default:
		return fmt.Errorf("upload to %v from %s", dst, srcType)
	}
	return d.ctx.CopyHtoD(dst.Ptr, out)
}

func decodeFloats(src []byte, t device.DType) []float32 {
	f := make([]float32, len(src)/max(t.Size(), 1))
	if !device.DecodeFloats(f, src, t) {
		return nil
	}
	return f
}

// DownloadF32 implements device.Device.
func (d *Device) DownloadF32(src device.Tensor, dst []float32) error {
	if len(dst) != src.Numel() {
		return fmt.Errorf("download %v into %d floats", src, len(dst))
	}
	if len(dst) == 0 {
		return nil
	}
	switch src.DType {
	case device.F32:
		return d.ctx.CopyDtoH(unsafe.Slice((*byte)(unsafe.Pointer(&dst[0])), 4*len(dst)), src.Ptr)
	case device.BF16:
		raw := make([]byte, 2*len(dst))
		if err := d.ctx.CopyDtoH(raw, src.Ptr); err != nil {
			return err
		}
		copy(dst, decodeFloats(raw, device.BF16))
		return nil
	}
	return fmt.Errorf("download %v as float32", src)
}

// DownloadI32 implements device.Device.
func (d *Device) DownloadI32(src device.Tensor, dst []int32) error {
	if len(dst) != src.Numel() || src.DType != device.I32 {
		return fmt.Errorf("download %v into %d ints", src, len(dst))
	}
	if len(dst) == 0 {
		return nil
	}
	return d.ctx.CopyDtoH(unsafe.Slice((*byte)(unsafe.Pointer(&dst[0])), 4*len(dst)), src.Ptr)
}

// Copy implements device.Device.
func (d *Device) Copy(dst, src device.Tensor) {
	if dst.Bytes() != src.Bytes() || dst.DType != src.DType {
		d.fail(fmt.Errorf("copy %v to %v", src, dst))
		return
	}
	d.fail(d.ctx.CopyDtoD(dst.Ptr, src.Ptr, src.Bytes()))
}

func (d *Device) launch(name string, grid, block Dim3, shmem int, args ...uint64) {
	if d.err != nil || grid.X == 0 || grid.Y == 0 || grid.Z == 0 {
		return // an empty grid has nothing to do (a step with no logit rows)
	}
	if d.skipKernels[name] {
		return
	}
	if last, ok := d.skipRepeats[name]; ok {
		if last != nil && slices.Equal(last, args) {
			return
		}
		d.skipRepeats[name] = slices.Clone(args)
	}
	if k := d.kernel(name); k != nil {
		d.fail(d.ctx.LaunchKernel(k, grid, block, shmem, args...))
	}
}

// skipList parses EBB_SKIP_KERNELS, comma-separated kernel names that
// launch leaves out. It is for timing only, and every output after the
// first skipped kernel is wrong: what a kernel costs inside a decode step's
// CUDA graph is the step's time with it minus without it. ncu times each
// kernel alone, which overstates the small ones and cannot show what the
// step hides (decode attention at batch 1 costs 10-12 us a layer alone and
// nothing in the step).
//
// A name with ":repeats" (into repeats) is left out only where its
// arguments are its last launch's. It was written for moe_sort (sort a
// step's first sparse layer, let the later ones reuse that grouping), but
// moe_sort:repeats ends in CUDA_ERROR_ILLEGAL_ADDRESS as moe_sort does
// (H200, forty-ninth stop): a kernel whose output a later step reads in
// another form cannot be timed this way.
func skipList(env string) (always kernelSet, repeats lastLaunches) {
	for _, name := range strings.Split(env, ",") {
		name = strings.TrimSpace(name)
		if base, ok := strings.CutSuffix(name, ":repeats"); ok {
			if base != "" {
				if repeats == nil {
					repeats = lastLaunches{}
				}
				repeats[base] = nil
			}
		} else if name != "" {
			if always == nil {
				always = kernelSet{}
			}
			always[name] = true
		}
	}
	return always, repeats
}

// lastLaunches holds, for each kernel it names, the arguments of its last
// launch (nil before the first).
type lastLaunches map[string][]uint64

// kernelSet is a set of kernel names.
type kernelSet map[string]bool

// kernel looks up one of kernelNames. Names are built from shapes
// (gemv_m1, matmul_tc_t2, ...): one that is not loaded is a bug to report
// as an error naming it, never a nil function to launch.
func (d *Device) kernel(name string) *Kernel {
	k, ok := d.k[name]
	if !ok {
		d.fail(fmt.Errorf("kernel %q is not among the loaded kernels", name))
	}
	return k
}

func gridFor(n int64) Dim3 { return D1(int(min((n+255)/256, 65535))) }

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Fill implements device.Device.
func (d *Device) Fill(dst device.Tensor, v float32) {
	n := int64(dst.Numel())
	switch dst.DType {
	case device.BF16:
		d.launch("fill_bf16", gridFor(n), D1(256), 0, P(dst.Ptr), uint64(n), F(v))
	case device.F32:
		d.launch("fill_f32", gridFor(n), D1(256), 0, P(dst.Ptr), uint64(n), F(v))
	default:
		d.fail(fmt.Errorf("fill %v", dst))
	}
}

// FillUniform implements device.UniformFiller.
func (d *Device) FillUniform(dst device.Tensor, seed uint64, step float32) {
	n := int64(dst.Numel())
	switch dst.DType {
	case device.BF16:
		d.launch("fill_uniform_bf16", gridFor(n), D1(256), 0, P(dst.Ptr), uint64(n), seed, F(step))
	case device.F32:
		d.launch("fill_uniform_f32", gridFor(n), D1(256), 0, P(dst.Ptr), uint64(n), seed, F(step))
	default:
		d.fail(fmt.Errorf("fill uniform %v", dst))
	}
}

// Convert implements device.Device.
func (d *Device) Convert(dst, src device.Tensor) {
	n := int64(src.Numel())
	switch {
	case dst.Numel() != src.Numel():
		d.fail(fmt.Errorf("convert %v to %v", src, dst))
	case dst.DType == src.DType:
		d.Copy(dst, src)
	case dst.DType == device.F32 && src.DType == device.BF16 && n%8 == 0 && dst.Ptr%16 == 0 && src.Ptr%16 == 0:
		d.launch("bf16_to_f32_v8", gridFor(n/8), D1(256), 0, P(dst.Ptr), P(src.Ptr), uint64(n/8))
	case dst.DType == device.F32 && src.DType == device.BF16:
		d.launch("bf16_to_f32", gridFor(n), D1(256), 0, P(dst.Ptr), P(src.Ptr), uint64(n))
	case dst.DType == device.BF16 && src.DType == device.F32:
		d.launch("f32_to_bf16", gridFor(n), D1(256), 0, P(dst.Ptr), P(src.Ptr), uint64(n))
	case dst.DType == device.BF16 && src.DType == device.F16:
		d.launch("f16_to_bf16", gridFor(n), D1(256), 0, P(dst.Ptr), P(src.Ptr), uint64(n))
	case dst.DType == device.F32 && src.DType == device.F16:
		d.launch("f16_to_f32", gridFor(n), D1(256), 0, P(dst.Ptr), P(src.Ptr), uint64(n))
	default:
		d.fail(fmt.Errorf("convert %v to %v", src, dst))
	}
}

// MemoryReport implements device.MemoryReporter through NVML.
func (d *Device) MemoryReport() (device.MemoryReport, error) {
	if d.nvml == nil {
		return device.MemoryReport{ProcessBytes: -1}, errors.New("NVML is not available")
	}
	r, err := d.nvml.Read()
	return device.MemoryReport{ProcessBytes: r.ProcessBytes, UsedBytes: r.UsedBytes, TotalBytes: r.TotalBytes}, err
}

// AfterRelease implements device.ResumeHook. With cuda_graph released no
// kernel can run, so the context's local-memory reservation (stack size
// times every resident thread: 264 MiB on an H100) goes back too, and so
// does the tensor-parallel all-reduce's memory.
func (d *Device) AfterRelease(tags []memory.Tag) error {
	if !slices.Contains(tags, memory.CUDAGraph) {
		return nil
	}
	if d.peers != nil {
		if err := d.peers.release(); err != nil {
			return fmt.Errorf("tensor-parallel all-reduce memory: %w", err)
		}
	}
	if d.savedStack > 0 {
		return nil
	}
	limit, err := d.ctx.StackLimit()
	if err != nil {
		return err
	}
	if err := d.ctx.SetStackLimit(0); err != nil {
		return err
	}
	d.savedStack = limit
	return nil
}

// AfterResume implements device.ResumeHook: the stack reservation comes
// back, and the split-KV merge counters and moe_add_norm_route's counts
// (mapped again with undefined contents) start at zero.
func (d *Device) AfterResume(tags []memory.Tag) error {
	if !slices.Contains(tags, memory.CUDAGraph) {
		return nil
	}
	if d.savedStack > 0 {
		if err := d.ctx.SetStackLimit(d.savedStack); err != nil {
			return err
		}
		d.savedStack = 0
	}
	if d.peers != nil {
		if err := d.peers.resume(); err != nil {
			return fmt.Errorf("tensor-parallel all-reduce memory: %w", err)
		}
	}
	if err := d.ctx.MemsetD32(d.routeSort.Ptr, 0, int64(d.routeSort.Numel())); err != nil {
		return err
	}
	return d.ctx.MemsetD32(d.counters.Ptr, 0, int64(d.counters.Numel()))
}

// DownloadAsync implements device.Streamer.
func (d *Device) DownloadAsync(src device.Tensor, dst []byte) error {
	if int64(len(dst)) != src.Bytes() {
		return fmt.Errorf("download %v into %d bytes", src, len(dst))
	}
	if d.err != nil {
		return d.Sync()
	}
	return d.ctx.CopyDtoHAsync(dst, src.Ptr)
}

// Fence implements device.Streamer. Events are kept for reuse: a decode
// step takes one, and creating them is not free.
func (d *Device) Fence() (device.Fence, error) {
	var ev *Event
	if n := len(d.fences); n > 0 {
		ev, d.fences = d.fences[n-1], d.fences[:n-1]
	} else {
		var err error
		if ev, err = d.ctx.NewFence(); err != nil {
			return nil, err
		}
	}
	if err := d.ctx.Record(ev); err != nil {
		return nil, err
	}
	return &fence{d: d, ev: ev}, nil
}

type fence struct {
	d    *Device
	ev   *Event
	done bool
	err  error
}

// Wait implements device.Fence. A launch error recorded on the device
// since (sticky until the next Sync) is reported too.
func (f *fence) Wait() error {
	if f.done {
		return f.err
	}
	f.done = true
	f.err = f.ev.Synchronize()
	if f.err == nil {
		f.err, f.d.err = f.d.err, nil
	}
	f.d.fences = append(f.d.fences, f.ev)
	return f.err
}

// AllocPinned implements device.PinnedAllocator; the memory is freed with
// the device.
func (d *Device) AllocPinned(n int) ([]byte, error) {
	h, err := d.vmm.AllocHost(int64(n))
	if err != nil {
		return nil, err
	}
	p := h.(*pinned)
	d.pinned = append(d.pinned, p)
	return unsafe.Slice((*byte)(p.p), n), nil
}

// ProfilerStart implements device.Profiler.
func (d *Device) ProfilerStart() error { return d.ctx.ProfilerStart() }

// ProfilerStop implements device.Profiler.
func (d *Device) ProfilerStop() error { return d.ctx.ProfilerStop() }

// CaptureGraph implements device.GraphCapturer.
func (d *Device) CaptureGraph(record func()) (device.Graph, error) {
	if d.err != nil {
		return nil, d.err
	}
	d.capturing = true
	defer func() { d.capturing = false }()
	g, err := d.ctx.Capture(func() error {
		record()
		err := d.err
		d.err = nil
		return err
	})
	if err != nil {
		return nil, err
	}
	return &cudaGraph{d: d, g: g}, nil
}

type cudaGraph struct {
	d *Device
	g *Graph
}

func (g *cudaGraph) Replay() error  { return g.d.ctx.Launch(g.g) }
func (g *cudaGraph) Destroy() error { return g.g.Destroy() }
