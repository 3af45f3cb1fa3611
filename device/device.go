// Package device defines the operations the model needs from a compute
// backend (tensors in tagged memory regions, GEMM, normalisation, RoPE, paged
// attention, sampling) so that the same model code runs on the CPU reference
// backend and on CUDA.
//
// Operations are queued in order on one stream and may run asynchronously;
// the first failure is kept and returned by Sync, so model code reads like
// straight-line math. A Device is owned by one goroutine.
package device

import (
	"fmt"
	"strings"
	"time"

	"ebb/memory"
)

// DType is an element type.
type DType uint8

// Element types.
const (
	F32 DType = iota + 1
	BF16
	F16
	I32
)

// Size is the element size in bytes.
func (d DType) Size() int {
	switch d {
	case F32, I32:
		return 4
	case BF16, F16:
		return 2
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case F32:
		return "float32"
	case BF16:
		return "bfloat16"
	case F16:
		return "float16"
	case I32:
		return "int32"
	}
	return fmt.Sprintf("DType(%d)", int(d))
}

// ParseDType accepts safetensors and PyTorch spellings.
func ParseDType(s string) (DType, error) {
	switch strings.ToLower(strings.TrimPrefix(s, "torch.")) {
	case "f32", "float32", "float":
		return F32, nil
	case "bf16", "bfloat16":
		return BF16, nil
	case "f16", "float16", "half":
		return F16, nil
	case "i32", "int32":
		return I32, nil
	}
	return 0, fmt.Errorf("unknown dtype %q", s)
}

// Tensor is a dense row-major view of device memory.
type Tensor struct {
	Ptr   uintptr
	DType DType
	Shape []int
}

// Numel is the number of elements.
func (t Tensor) Numel() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// Bytes is the size in bytes.
func (t Tensor) Bytes() int64 { return int64(t.Numel()) * int64(t.DType.Size()) }

// Valid reports whether the tensor points at memory.
func (t Tensor) Valid() bool { return t.Ptr != 0 }

// Dim returns the size of dimension i (negative counts from the end).
func (t Tensor) Dim(i int) int {
	if i < 0 {
		i += len(t.Shape)
	}
	return t.Shape[i]
}

// RowSize is the number of elements per index of the first dimension.
func (t Tensor) RowSize() int {
	n := 1
	for _, d := range t.Shape[1:] {
		n *= d
	}
	return n
}

// Rows views rows [from, to) of the first dimension.
func (t Tensor) Rows(from, to int) Tensor {
	if from < 0 || to < from || to > t.Shape[0] {
		panic(fmt.Sprintf("Rows(%d, %d) of shape %v", from, to, t.Shape))
	}
	shape := append([]int{to - from}, t.Shape[1:]...)
	return Tensor{Ptr: t.Ptr + uintptr(from*t.RowSize()*t.DType.Size()), DType: t.DType, Shape: shape}
}

// View reinterprets the tensor with a new shape of the same size.
func (t Tensor) View(shape ...int) Tensor {
	v := Tensor{Ptr: t.Ptr, DType: t.DType, Shape: shape}
	if v.Numel() != t.Numel() {
		panic(fmt.Sprintf("View(%v) of shape %v", shape, t.Shape))
	}
	return v
}

func (t Tensor) String() string { return fmt.Sprintf("%s%v@%#x", t.DType, t.Shape, t.Ptr) }

// AttnMeta describes a ragged batch for attention over the paged KV cache.
// Sequence s owns query rows [QIndptr[s], QIndptr[s+1]) and attends to the KV
// slots KVIndices[KVIndptr[s]:KVIndptr[s+1]], in position order; its queries
// are the last tokens of that range (causal).
type AttnMeta struct {
	NumSeqs  int
	MaxQLen  int // upper bounds, for launch shapes
	MaxKVLen int
	// Decodes is how many leading sequences have one query each at their
	// last position (a mixed step's decodes, scheduled first); a backend
	// may run them with its decode kernel and the rest with prefill's.
	Decodes int
	// Sparse says some sequences have no query (QIndptr repeats): they
	// stay in the batch so that every sequence keeps its KVIndptr. Only the
	// prefill path takes such a batch.
	Sparse    bool
	QIndptr   Tensor // [NumSeqs+1] int32
	KVIndptr  Tensor // [NumSeqs+1] int32
	KVIndices Tensor // [>= total KV] int32
}

// SampleArgs holds per-row sampling parameters on the device, one entry per
// logits row. A temperature of 0 means greedy.
type SampleArgs struct {
	Temperature Tensor // [B] float32
	TopP        Tensor // [B] float32, 1 disables
	TopK        Tensor // [B] int32, <= 0 disables
	MinP        Tensor // [B] float32, 0 disables
	Keys        Tensor // [2B] int32: each row's noise key (two 32-bit halves) for this step
	// Outputs.
	IDs      Tensor // [B] int32: sampled token
	Logprobs Tensor // [B] float32: its log-probability
	// Optional top-k alternatives: [B, K] each; K = TopIDs.Shape[1].
	TopIDs      Tensor
	TopLogprobs Tensor
}

// PenaltyArgs applies repetition, frequency and presence penalties (as
// SGLang and vLLM define them) and additive biases to logits in place, from a
// sparse list of tokens per row.
type PenaltyArgs struct {
	RowPtr     Tensor // [B+1] int32 into Tokens, Counts and Bias
	Tokens     Tensor // [nnz] int32
	Counts     Tensor // [nnz] int32: times generated (0: seen in the prompt only)
	Bias       Tensor // [nnz] float32: added last (-inf bans a token)
	Repetition Tensor // [B] float32, 1 disables
	Frequency  Tensor // [B] float32, 0 disables
	Presence   Tensor // [B] float32, 0 disables
}

// Device is the compute backend.
type Device interface {
	Name() string
	// DType is the dtype of weights and activations.
	DType() DType
	Memory() *memory.Manager

	// Alloc and Free manage tensors in a tagged region.
	Alloc(tag memory.Tag, dtype DType, shape ...int) (Tensor, error)
	Free(tag memory.Tag, t Tensor)

	// Upload converts src (raw little-endian elements of srcType) into dst.
	Upload(dst Tensor, src []byte, srcType DType) error
	// Download copies a tensor to the host, converting floats to float32.
	DownloadF32(src Tensor, dst []float32) error
	DownloadI32(src Tensor, dst []int32) error
	// Copy copies between tensors of the same dtype and size.
	Copy(dst, src Tensor)
	// Fill sets every element of a float tensor.
	Fill(dst Tensor, v float32)
	// Convert copies src into dst of the same shape, converting between
	// float dtypes (bf16 to float32 is exact).
	Convert(dst, src Tensor)

	// Embedding: out[i] = the embedding of ids[i], each id in [0, vocab).
	// The table's rows are the ids first, first+1, ...: a tensor-parallel
	// rank's part of the vocabulary; ids outside it give zero rows.
	Embedding(out, table, ids Tensor, first, vocab int)
	RMSNorm(out, x, w Tensor, eps float32)
	// AddRMSNorm: residual += x (rounded to the activation dtype), then
	// out = rmsnorm(residual) * w.
	AddRMSNorm(residual, x, out, w Tensor, eps float32)
	// MatMul: out[M,N] = x[M,K] @ w[N,K]^T (+ bias[N] when valid).
	MatMul(out, x, w, bias Tensor)
	// PrepareQKV works on the fused projection qkv [T, Hq+2Hk, D] (q heads,
	// then k heads, then v heads): per-head RMSNorm of q and k when
	// qNorm/kNorm are valid (Qwen3), rotary embedding of q and k
	// (rotate-half layout, cos/sin tables [maxPos, D/2] float32, indexed by
	// positions [T]); q is written back in place, k and v go into the caches
	// [slots,Hk,D] at slots [T] (qkv's k and v heads are left unspecified).
	PrepareQKV(qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots Tensor, eps float32)
	// Attention: out [T,Hq,D]; queries are the q heads of qkv [T,Hq+2Hk,D];
	// caches [slots,Hk,D].
	Attention(out, qkv, kCache, vCache Tensor, meta AttnMeta, scale float32)
	// SiLUMul: out[T,I] = silu(gateUp[:, :I]) * gateUp[:, I:].
	SiLUMul(out, gateUp Tensor)
	// GatherRows: out[i] = x[rows[i]].
	GatherRows(out, x, rows Tensor)
	// ApplyPenalties modifies logits [B,V] in place.
	ApplyPenalties(logits Tensor, p PenaltyArgs)
	// Sample draws one token per row of logits [B,V] (float32, or the
	// activation dtype).
	Sample(logits Tensor, args SampleArgs)
	// ResolveTokens sets tokens[i] = prev[src[i]] where src[i] >= 0: a step
	// whose inputs are the previous step's outputs, still on the device.
	ResolveTokens(tokens, src, prev Tensor)
	// TokenLogprobs: out[i] = log_softmax(logits[i])[targets[i]].
	TokenLogprobs(out, logits, targets Tensor)

	// Sync waits for queued work and returns the first error since the last Sync.
	Sync() error
	Close() error
}

// MemoryInfo is implemented by devices with their own memory (GPUs).
type MemoryInfo interface {
	// DeviceMemory reports free and total bytes as the driver sees them.
	DeviceMemory() (free, total int64, err error)
}

// Graph is recorded device work that replays with the same buffers.
type Graph interface {
	Replay() error
	Destroy() error
}

// GraphCapturer is implemented by devices that can record a sequence of
// operations once and replay it cheaply (CUDA graphs). Inputs are read from,
// and outputs written to, the same tensors at every replay.
type GraphCapturer interface {
	CaptureGraph(record func()) (Graph, error)
}

// ContextDecoder is a device whose decode kernels change with a step's
// longest context: a decode step of batch sequences whose contexts are all
// at most ShortDecodeContext(hq, hk, dim, batch) positions (query heads,
// kv heads and head size of the model's attention) runs other kernels than
// a longer one, so a runner captures its decode graphs for both; 0 where
// the kernels do not change.
type ContextDecoder interface {
	ShortDecodeContext(hq, hk, dim, batch int) int
}

// Profiler is implemented by devices whose profiler can be limited to a
// region of the run (cuProfilerStart/Stop for Nsight Compute).
type Profiler interface {
	ProfilerStart() error
	ProfilerStop() error
}

// PinnedAllocator is implemented by devices whose host-to-device copies are
// faster from page-locked memory. The memory lives as long as the device.
type PinnedAllocator interface {
	AllocPinned(n int) ([]byte, error)
}

// Streamer is implemented by devices whose work runs behind the host (a
// CUDA stream): a step can be queued, its outputs copied back, and the
// host go on with the next step's preparation before they arrive.
type Streamer interface {
	// DownloadAsync queues a copy of src into dst (page-locked memory from
	// AllocPinned) after the work queued so far; dst is valid once a Fence
	// recorded after it has been waited on.
	DownloadAsync(src Tensor, dst []byte) error
	// Fence marks the work queued so far.
	Fence() (Fence, error)
}

// Fence is a point in a device's queue of work.
type Fence interface {
	// Wait blocks until the device has passed the fence and reports the
	// first error of the work before it.
	Wait() error
}

// ResumeHook is implemented by devices that keep state of their own in
// tagged regions (kernel scratch that must start zeroed) or hold memory
// outside them that can go while nothing runs: the scheduler calls it after
// tags are released and after they are mapped again.
type ResumeHook interface {
	AfterRelease(tags []memory.Tag) error
	AfterResume(tags []memory.Tag) error
}

// MemoryReport is what the driver's own accounting (NVML) says.
type MemoryReport struct {
	ProcessBytes int64 // this process; -1 when unknown
	UsedBytes    int64 // the whole device
	TotalBytes   int64
}

// MemoryReporter is implemented by devices that can read NVML.
type MemoryReporter interface {
	MemoryReport() (MemoryReport, error)
}

// IPCImporter is implemented by devices that can map memory another
// process shares with them (CUDA IPC): how a trainer on the same GPU hands
// over new weights without a copy through the host.
type IPCImporter interface {
	OpenIPCMemory(handle [64]byte) (uintptr, error)
	CloseIPCMemory(ptr uintptr) error
	WaitIPCEvent(handle [64]byte) error
	// SameDevice reports whether a producer's device (an index or a UUID)
	// can be this one.
	SameDevice(producer string) bool
}

// Group is a collective communicator with other processes (NCCL).
type Group interface {
	// Broadcast queues t's broadcast from root into t.
	Broadcast(t Tensor, root int, timeout time.Duration) error
	// Synchronize waits for queued collectives, aborting the group when
	// the timeout passes or a peer fails.
	Synchronize(timeout time.Duration) error
	Destroy() error
}

// GroupJoiner is implemented by devices that can join a group of
// processes given its unique id (NCCL).
type GroupJoiner interface {
	JoinGroup(id [128]byte, nranks, rank int, timeout time.Duration) (Group, error)
}

// Fused is implemented by devices with fused kernels for the small batches
// of decode steps. The model calls it where it would call MatMul then
// AddRMSNorm (and SiLUMul before the MatMul when silu is set); a false
// return means the device does not fuse these shapes, and the model runs
// the separate operations, which define the result.
type Fused interface {
	// MatMulAddRMSNorm: out = in @ w^T, in being x, or silu(x[:, :K]) *
	// x[:, K:] when silu; then residual += out and normed =
	// rmsnorm(residual) * normW.
	MatMulAddRMSNorm(out, x, w Tensor, silu bool, residual, normed, normW Tensor, eps float32) bool
	// MatMulAdd is MatMulAddRMSNorm without normed: residual += in @ w^T,
	// rounded as AddRMSNorm rounds it, and the device keeps what
	// RMSNormMatMul needs to normalise residual as it reads it. It returns
	// false where RMSNormMatMul would not take next (with glu: as gate_up)
	// after it, so that the model never leaves a norm undone.
	MatMulAdd(x, w Tensor, silu bool, residual, next Tensor, glu bool) bool
	// RMSNormMatMul: y = (rmsnorm(residual) * normW) @ w^T, where the
	// last operation to write residual was MatMulAdd (an error otherwise);
	// out is y, or with glu (w being [gate | up] rows) SiLUMul of y. It
	// returns false only for a glu the device does not fuse, leaving the
	// residual for a call without.
	RMSNormMatMul(out, residual, normW, w Tensor, eps float32, glu bool) bool
	// MatMulSiLU: out = SiLUMul(x @ w^T), w being [gate | up] rows.
	MatMulSiLU(out, x, w Tensor) bool
}

// AttentionPreparer is implemented by devices whose attention kernels can
// normalise and rotate the queries as they load them (and, in a decode
// step, the newest K as well), so that q heads are not written back by
// PrepareQKV and read again, or a step needs one launch fewer a layer.
type AttentionPreparer interface {
	// PrepareAttention is PrepareQKV followed by Attention, with their
	// results in out and the caches (qkv is left unspecified). It returns
	// false, having done nothing, where it does not apply.
	PrepareAttention(out, qkv, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots Tensor, meta AttnMeta, scale, eps float32) bool
}

// QKVProjector is implemented by devices whose qkv product can prepare
// what it computes (PrepareQKV in the product's epilogue), so that q, k
// and v are not written and read back by another launch.
type QKVProjector interface {
	// ProjectQKV is MatMul(qkv, x, w) without bias, or with normW set
	// RMSNormMatMul(qkv, x, normW, w, eps, false) (x being the residual
	// the last MatMulAdd left), followed by PrepareQKV, with the bits of
	// the two. It returns false, having done nothing, where it does not
	// apply.
	ProjectQKV(qkv, x, normW, w, qNorm, kNorm, positions, cos, sin, kCache, vCache, slots Tensor, eps float32) bool
}

// Deterministic is implemented by devices that can compute every row of a
// step the same way whatever else is in it (batch-invariant kernels), so
// that a request's tokens and logprobs do not depend on the batch, prefix
// caching or chunking, and decode and prefill give a token the same
// logprob (SGLang's --enable-deterministic-inference).
type Deterministic interface {
	// EnableDeterministic turns the batch-invariant kernels on for a model
	// of this shape, or says why they cannot run it.
	EnableDeterministic(ModelShape) error
}

// ModelShape is what a device's kernels need to know of a model before it
// loads: its widths, heads and vocabulary (whole, not a rank's share).
type ModelShape struct {
	Hidden, Intermediate, Heads, KVHeads, HeadDim, Vocab int
	Experts                                              int // 0 for a dense model
	SharedIntermediate                                   int // Qwen2-MoE's shared expert; 0 for none
}

// MoE is implemented by devices that run the sparse MLP of a
// mixture-of-experts layer (Qwen3-MoE, Qwen2-MoE).
type MoE interface {
	// MoERoute picks each row's experts from router logits [T, E] (the
	// activation dtype): a float32 softmax, its k largest probabilities in
	// descending order (the lower expert first on a tie) into ids [T, k]
	// int32 and weights [T, k] float32, the weights divided by their sum
	// when norm and then rounded to the activation dtype, as transformers
	// rounds them.
	MoERoute(ids, weights, logits Tensor, norm bool)
	// MoEExperts: out[t] = sum over j of weights[t, j] times expert
	// e = ids[t, j] applied to x[t], down_e(silu(gate_e x) * up_e x),
	// where gateUp [E, 2I, H] holds each expert's gate rows then its up
	// rows and down is [E, H, I]. The k terms are added in ascending
	// expert order, each rounded to out's dtype and the sum rounded after
	// every addition, as transformers' index_add_ does. work is scratch
	// of MoEWorkBytes.
	MoEExperts(out, x, ids, weights, gateUp, down, work Tensor)
	// MoEWorkBytes is the scratch MoEExperts needs for t rows of k
	// experts each, of experts experts of inter columns over hidden.
	MoEWorkBytes(t, k, experts, inter, hidden int) int64
	// MoESharedAdd adds a shared expert's output y [T, H] (the activation
	// dtype), gated by its row's gate logit [T, 1], into out [T, H]:
	// out[t] += sigmoid(gate[t]) * y[t], the sigmoid and the product each
	// rounded to the activation dtype and the sum to out's, as
	// transformers' Qwen2-MoE block rounds them.
	MoESharedAdd(out, y, gate Tensor)
}

// MoEFused is implemented by devices that fold a sparse layer's norms and
// routing into its launches for the few rows of a decode step, as Fused
// does for a dense layer's. Both return false, having done nothing, where
// they do not apply; the model then runs the separate operations, which
// define the result.
type MoEFused interface {
	// MatMulAddMoERoute: residual += in @ w^T, rounded as AddRMSNorm
	// rounds it, x = rmsnorm(residual) * normW, then MoERoute of
	// x @ router^T into ids and weights.
	MatMulAddMoERoute(in, w, residual, x, normW, router, ids, weights Tensor, eps float32, norm bool) bool
	// MoEExpertsAdd: residual += MoEExperts(x, ...), rounded as AddRMSNorm
	// rounds it, leaving what RMSNormMatMul needs to take next (a product
	// of residual's width) after it, as MatMulAdd does.
	MoEExpertsAdd(residual, x, ids, weights, gateUp, down, work, next Tensor) bool
	// MoEExpertsAddRMSNorm: residual += MoEExperts(x, ...) and then
	// x = rmsnorm(residual) * normW, as AddRMSNorm does both, for the
	// steps of more rows that MoEExpertsAdd does not take.
	MoEExpertsAddRMSNorm(residual, x, normW, ids, weights, gateUp, down, work Tensor, eps float32) bool
}

// Accumulating is implemented by devices that add a matmul's product into
// its output where that is cheaper than a separate add.
type Accumulating interface {
	// MatMulAccumulate: out += x @ w^T, the sum rounded once to out's
	// dtype. It returns false, having done nothing, where it does not
	// apply; AddRMSNorm's separate add (of the rounded product) then
	// defines the result.
	MatMulAccumulate(out, x, w Tensor) bool
}

// Collective adds up partial sums across the ranks of a tensor-parallel
// group. Like the device's operations it queues in order and its error is
// sticky (Err).
type Collective interface {
	// AllReduceSum replaces t on every rank with the sum of every rank's t.
	AllReduceSum(t Tensor)
	// AllGatherColumns puts every rank's local [rows, cols] side by side
	// in full [rows, ranks*cols], in rank order (vocabulary-parallel logits).
	AllGatherColumns(full, local Tensor)
	Err() error
}

// AllReduceNormer is implemented by collectives that add the ranks'
// partial sums into the residual stream and normalise it in one pass.
type AllReduceNormer interface {
	// AllReduceAddRMSNorm is AllReduceSum(partial) then the device's
	// AddRMSNorm(residual, partial, out, w, eps), the same bits, leaving
	// partial as it was. It returns false, having done nothing, where it
	// does not apply.
	AllReduceAddRMSNorm(residual, partial, out, w Tensor, eps float32) bool
}

// CollectiveJoiner is implemented by devices whose tensor-parallel ranks
// add up their partial sums among themselves (through each other's memory
// or NCCL): rank 0 makes the id, the launcher's processes hand it to the
// others, and every rank joins.
type CollectiveJoiner interface {
	NewCollectiveID() ([128]byte, error)
	JoinCollective(id [128]byte, nranks, rank int) (Collective, error)
}
