package cuda

/*
#include "ebbcuda.h"
*/
import "C"

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"time"
	"unsafe"

	"ebb/device"
	"ebb/peerfd"
)

// The all-reduce kernel's limits and buffer sizes (allreduce.cu).
const (
	arMaxRanks   = 8
	arMaxBlocks  = 256
	arTableBytes = 256
	arThreads    = 512
	// arStageElems is one staging area in floats (8 MiB): larger sums go
	// through it in pieces. Each rank holds four (two calls in flight, each
	// with its inputs and, for two-shot, its reduced slice).
	arStageElems = 2 << 20
	arStageBytes = 4 * arStageElems * 4
	arSignalOff  = arStageBytes
	arEpochOff   = arSignalOff + arMaxBlocks*arMaxRanks*4
	arTableOff   = arEpochOff + arTableBytes
	arUsedBytes  = arTableOff + arTableBytes
	// arTwoShotBytes: from this size on, groups of more than two ranks add
	// up one slice each and exchange the sums: each rank reads 2(N-1)/N
	// times the data from its peers instead of N-1 times.
	arTwoShotBytes = 512 << 10
	// arNormMaxRows: the fused all-reduce and norm serves decode batches up
	// to this many rows (Qwen3-8B's shape, two H200s, one-batch steps in
	// ms against the separate kernels: 1 and 16 rows 3-7% faster, 24 and
	// 32 1.3-1.5% faster, 48 level, 64 1% slower, 256 3-8% slower).
	// EBB_AR_NORM_ROWS sets it for A/B runs.
	arNormMaxRows = 32
	// peerExchangeTimeout bounds the wait for the other ranks' memory, at
	// start and at every resume.
	peerExchangeTimeout = 2 * time.Minute
)

// peerIDMagic opens a collective id that names a peer-memory group rather
// than an NCCL one.
var peerIDMagic = []byte("ebb-peer-allreduce\x00")

// peerAllReduce is a tensor-parallel group's all-reduce through memory the
// ranks map from each other (NVLink or PCIe peer access), with no NCCL
// communicator: its memory is released with cuda_graph and mapped again at
// the same addresses on resume, so the graphs stay valid and a released
// rank holds nothing for it.
type peerAllReduce struct {
	d          *Device
	rank, size int
	fds        *peerfd.Group
	bytes      int64   // each rank's allocation
	va         uintptr // size*bytes of address space: rank p's memory at va+p*bytes
	handles    []C.CUmemGenericAllocationHandle
	mapped     bool
	err        error
	// normMaxRows is arNormMaxRows unless EBB_AR_NORM_ROWS sets it (A/B runs).
	normMaxRows int64
}

var (
	_ device.Collective      = (*peerAllReduce)(nil)
	_ device.AllReduceNormer = (*peerAllReduce)(nil)
)

// peerAccessible reports whether this GPU can map the memory of every other
// GPU on the host.
func (c *Context) peerAccessible() bool {
	var n C.int
	if C.ebb_cuDeviceGetCount(&n) != 0 {
		return false
	}
	for o := 0; o < int(n); o++ {
		var dev C.CUdevice
		var can C.int
		if o == c.Ordinal {
			continue
		}
		if C.ebb_cuDeviceGet(&dev, C.int(o)) != 0 || C.ebb_cuDeviceCanAccessPeer(&can, c.dev, dev) != 0 || can == 0 {
			return false
		}
	}
	return true
}

// newPeerID makes a peer group's id: the magic and a random name.
func newPeerID() ([128]byte, error) {
	var id [128]byte
	copy(id[:], peerIDMagic)
	_, err := rand.Read(id[len(peerIDMagic) : len(peerIDMagic)+16])
	return id, err
}

func isPeerID(id [128]byte) bool { return string(id[:len(peerIDMagic)]) == string(peerIDMagic) }

// joinPeerAllReduce sets rank's memory up, listens for the others, and
// maps theirs.
func (d *Device) joinPeerAllReduce(id [128]byte, size, rank int) (*peerAllReduce, error) {
	if size > arMaxRanks {
		return nil, fmt.Errorf("peer all-reduce: %d ranks (at most %d)", size, arMaxRanks)
	}
	name := "ebb-allreduce-" + hex.EncodeToString(id[len(peerIDMagic):len(peerIDMagic)+16])
	fds, err := peerfd.Listen(name, rank, size)
	if err != nil {
		return nil, err
	}
	p := &peerAllReduce{d: d, rank: rank, size: size, fds: fds, handles: make([]C.CUmemGenericAllocationHandle, size),
		normMaxRows: arNormMaxRows}
	if v, err := strconv.Atoi(os.Getenv("EBB_AR_NORM_ROWS")); err == nil && v >= 0 {
		p.normMaxRows = int64(v)
	}
	p.bytes = (arUsedBytes + d.vmm.gran - 1) / d.vmm.gran * d.vmm.gran
	var va C.CUdeviceptr
	if err := check("cuMemAddressReserve", C.ebb_cuMemAddressReserve(&va, C.size_t(p.bytes*int64(size)), 0, 0, 0)); err != nil {
		fds.Close()
		return nil, err
	}
	p.va = uintptr(va)
	if err := p.mapAll(); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

func (p *peerAllReduce) base(rank int) uintptr { return p.va + uintptr(int64(rank)*p.bytes) }

// mapAll creates this rank's memory, starts its counters at zero, and maps
// every other rank's at its fixed place. A rank that cannot create its
// memory still takes part in the exchange, so that the others fail at once
// instead of waiting for it.
func (p *peerAllReduce) mapAll() error {
	fd, err := p.createOwn()
	if err != nil {
		if theirs, xerr := p.fds.Exchange(-1, peerExchangeTimeout); xerr == nil {
			peerfd.CloseAll(theirs)
		}
		return err
	}
	theirs, err := p.fds.Exchange(fd, peerExchangeTimeout)
	syscall.Close(fd)
	if err != nil {
		return fmt.Errorf("tensor-parallel rank %d: %w", p.rank, err)
	}
	var errs []error
	for r, f := range theirs {
		if r == p.rank {
			continue
		}
		if err := check("cuMemImportFromShareableHandle", C.ebb_mem_import_fd(&p.handles[r], C.int(f))); err != nil {
			errs = append(errs, fmt.Errorf("rank %d's memory: %w", r, err))
		} else if err := p.mapAt(r); err != nil {
			errs = append(errs, fmt.Errorf("rank %d's memory: %w", r, err))
		}
		syscall.Close(f)
	}
	return errors.Join(errs...)
}

// createOwn creates and maps this rank's memory, zeroes its counters,
// writes its table, and exports it as a file descriptor.
func (p *peerAllReduce) createOwn() (int, error) {
	ctx := p.d.ctx
	prop := p.d.vmm.prop
	prop.requestedHandleTypes = 1 // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
	own := &p.handles[p.rank]
	if err := check("cuMemCreate", C.ebb_cuMemCreate(own, C.size_t(p.bytes), &prop, 0)); err != nil {
		return -1, fmt.Errorf("peer all-reduce memory: %w", err)
	}
	p.mapped = true
	if err := p.mapAt(p.rank); err != nil {
		return -1, err
	}
	mine := p.base(p.rank)
	if err := errors.Join(ctx.MemsetD32(mine+arSignalOff, 0, (arTableOff-arSignalOff)/4),
		ctx.CopyHtoD(mine+arTableOff, p.table()), ctx.SyncStream()); err != nil {
		return -1, err
	}
	var fd C.int
	if err := check("cuMemExportToShareableHandle", C.ebb_cuMemExportToShareableHandle(unsafe.Pointer(&fd), *own, 1, 0)); err != nil {
		return -1, fmt.Errorf("peer all-reduce memory: %w", err)
	}
	return int(fd), nil
}

// mapAt maps rank r's memory (its handle already here) for this GPU.
func (p *peerAllReduce) mapAt(r int) error {
	va := C.CUdeviceptr(p.base(r))
	if err := check("cuMemMap", C.ebb_cuMemMap(va, C.size_t(p.bytes), 0, p.handles[r], 0)); err != nil {
		return err
	}
	access := C.CUmemAccessDesc{flags: 3} // read and write, from this GPU
	access.location = p.d.vmm.prop.location
	if err := check("cuMemSetAccess", C.ebb_cuMemSetAccess(va, C.size_t(p.bytes), &access, 1)); err != nil {
		return fmt.Errorf("%w (no peer access between these GPUs? EBB_TP_ALLREDUCE=nccl uses NCCL instead)", err)
	}
	return nil
}

// unmapAll gives every mapping and this rank's memory back; the address
// space stays for the next mapAll.
func (p *peerAllReduce) unmapAll() error {
	if !p.mapped {
		return nil
	}
	var errs []error
	for r, h := range p.handles {
		if h == 0 {
			continue
		}
		// A mapping that never happened reports an error that says nothing.
		_ = C.ebb_cuMemUnmap(C.CUdeviceptr(p.base(r)), C.size_t(p.bytes))
		errs = append(errs, check("cuMemRelease", C.ebb_cuMemRelease(h)))
		p.handles[r] = 0
	}
	p.mapped = false
	return errors.Join(errs...)
}

// table is this rank's ArPeers (allreduce.cu).
func (p *peerAllReduce) table() []byte {
	stage, signal := make([]uintptr, p.size), make([]uintptr, p.size)
	for r := range stage {
		stage[r], signal[r] = p.base(r), p.base(r)+arSignalOff
	}
	return arTable(stage, signal, p.base(p.rank)+arEpochOff, p.rank)
}

// arTable lays an ArPeers out.
func arTable(stage, signal []uintptr, epoch uintptr, rank int) []byte {
	b := make([]byte, arTableBytes)
	for r := range stage {
		binary.LittleEndian.PutUint64(b[8*r:], uint64(stage[r]))
		binary.LittleEndian.PutUint64(b[64+8*r:], uint64(signal[r]))
	}
	binary.LittleEndian.PutUint64(b[128:], uint64(epoch))
	binary.LittleEndian.PutUint32(b[136:], uint32(rank))
	binary.LittleEndian.PutUint32(b[140:], uint32(len(stage)))
	binary.LittleEndian.PutUint64(b[144:], arStageElems)
	return b
}

// AllReduceSum implements device.Collective for float32 tensors.
func (p *peerAllReduce) AllReduceSum(x device.Tensor) {
	if p.err != nil {
		return
	}
	var bad error
	if x.DType != device.F32 {
		bad = fmt.Errorf("tensor-parallel all-reduce of %s: only float32 partial sums", x.DType)
	}
	if !p.usable("all-reduce", bad) {
		return
	}
	p.d.allReduce(p.base(p.rank)+arTableOff, 1, p.size, x.Ptr, int64(x.Numel()), 0)
}

// allReduce queues the kernel over n floats at ptr (in place), in pieces
// that fit a staging area. ranksInGrid > 1 runs that many ranks in one grid
// (tests, on one GPU), their tables arTableBytes apart and their tensors
// stride elements apart.
func (d *Device) allReduce(tab uintptr, ranksInGrid, nranks int, ptr uintptr, n, stride int64) {
	for off := int64(0); off < n; off += arStageElems {
		m := min(n-off, arStageElems)
		at := ptr + uintptr(4*off)
		name, units := "allreduce_f32", m
		if m%4 == 0 && at%16 == 0 && stride%4 == 0 {
			name, units = "allreduce_f32_v4", m/4
		}
		twoShot := nranks > 2 && 4*m >= arTwoShotBytes
		d.launch(name, Dim3{d.arBlocks(units, ranksInGrid), uint32(ranksInGrid), 1}, D1(arThreads), 0,
			P(tab), P(at), P(at), uint64(m), uint64(stride), I(boolInt(twoShot)))
	}
}

// AllReduceAddRMSNorm implements device.AllReduceNormer for decode batches
// of up to normMaxRows rows that suit the 16-byte norm kernels, where the
// ranks' partials fit the call's staging (one-shot: two ranks, or a sum
// small enough that two-shot would not pay).
func (p *peerAllReduce) AllReduceAddRMSNorm(residual, partial, out, w device.Tensor, eps float32) bool {
	dim := w.Numel()
	n := int64(partial.Numel())
	switch {
	case partial.DType != device.F32 || residual.DType != device.BF16 || out.DType != device.BF16 ||
		w.DType != device.BF16 || dim%8 != 0 || dim > 8*1024 || n%int64(dim) != 0 ||
		int64(residual.Numel()) != n || int64(out.Numel()) != n:
		return false
	case n > p.normMaxRows*int64(dim) || int64(p.size-1)*n > 2*arStageElems || (p.size > 2 && 4*n >= arTwoShotBytes):
		return false
	case normVariant(dim, partial, residual, out, w) == "":
		return false
	}
	if !p.usable("all-reduce", nil) {
		return true // the group has failed; its error surfaces at the next sync
	}
	p.d.allReduceAddRMSNorm(p.base(p.rank)+arTableOff, 1, partial.Ptr, residual.Ptr, out.Ptr, w.Ptr, int(n)/dim, dim, eps, 0)
	return true
}

// allReduceAddRMSNorm queues the kernel for rows of dim; ranksInGrid and
// stride as for allReduce.
func (d *Device) allReduceAddRMSNorm(tab uintptr, ranksInGrid int, partial, residual, out, w uintptr, rows, dim int,
	eps float32, stride int64) {
	blocks := max(1, min(rows, arMaxBlocks, d.ctx.SMs/ranksInGrid))
	d.launch("allreduce_add_rmsnorm", Dim3{uint32(blocks), uint32(ranksInGrid), 1}, D1(normThreads(dim)), 0,
		P(tab), P(partial), P(residual), P(out), P(w), I(rows), I(dim), F(eps), uint64(stride))
}

// AllGatherColumns implements device.Collective.
func (p *peerAllReduce) AllGatherColumns(full, local device.Tensor) {
	if p.err != nil {
		return
	}
	if !p.usable("all-gather", gatherShapes(full, local, p.size)) {
		return
	}
	rows := local.Dim(0)
	p.d.allGatherColumns(p.base(p.rank)+arTableOff, 1, local.Ptr, full.Ptr, rows, local.Bytes()/int64(rows), p.size, 0, 0)
}

// usable fails the group (and the device) with bad, or when the memory is
// released, and reports whether the operation may be queued.
func (p *peerAllReduce) usable(op string, bad error) bool {
	if p.err == nil && bad != nil {
		p.err = bad
	} else if p.err == nil && !p.mapped {
		p.err = fmt.Errorf("tensor-parallel %s while its memory is released (resume cuda_graph first)", op)
	}
	if p.err != nil {
		p.d.fail(p.err)
		return false
	}
	return true
}

// arBlocks is the grid width for units of work: two per thread, at most
// a block per SM for each rank in the grid (all must be resident at once).
func (d *Device) arBlocks(units int64, ranksInGrid int) uint32 {
	blocks := int64(min(arMaxBlocks, d.ctx.SMs/ranksInGrid))
	return uint32(max(1, min(blocks, (units+2*arThreads-1)/(2*arThreads))))
}

// gatherShapes checks an all-gather's tensors: local [rows, cols], full
// [rows, ranks*cols], one dtype.
func gatherShapes(full, local device.Tensor, ranks int) error {
	if len(local.Shape) != 2 || len(full.Shape) != 2 || full.Dim(0) != local.Dim(0) ||
		full.Dim(1) != ranks*local.Dim(1) || full.DType != local.DType {
		return fmt.Errorf("tensor-parallel all-gather of %s %v into %s %v over %d ranks",
			local.DType, local.Shape, full.DType, full.Shape, ranks)
	}
	return nil
}

// allGatherColumns queues the gather of rows rows of rowBytes each, in
// pieces of rows that fit two staging areas. ranksInGrid and the strides
// (bytes between the ranks' tensors) are for tests, as in allReduce.
func (d *Device) allGatherColumns(tab uintptr, ranksInGrid int, local, full uintptr, rows int, rowBytes int64,
	nranks int, localStride, fullStride int64) {
	unit := int64(2)
	name := "allgather_cols_u16"
	if rowBytes%16 == 0 && local%16 == 0 && full%16 == 0 && localStride%16 == 0 && fullStride%16 == 0 {
		unit, name = 16, "allgather_cols_v16"
	}
	per := max(1, int(2*arStageElems*4/rowBytes))
	for r0 := 0; r0 < rows; r0 += per {
		n := min(per, rows-r0)
		units := int64(n) * rowBytes / unit
		d.launch(name, Dim3{d.arBlocks(units, ranksInGrid), uint32(ranksInGrid), 1}, D1(arThreads), 0,
			P(tab), P(local+uintptr(int64(r0)*rowBytes)), P(full+uintptr(int64(r0)*rowBytes*int64(nranks))),
			uint64(n), uint64(rowBytes/unit), uint64(localStride/unit), uint64(fullStride/unit))
	}
}

// Err implements device.Collective.
func (p *peerAllReduce) Err() error { return p.err }

// release gives the memory back (with cuda_graph); the peers' mappings of
// this rank's memory keep it alive until they release too.
func (p *peerAllReduce) release() error {
	if err := p.d.ctx.SyncStream(); err != nil {
		return err
	}
	return p.unmapAll()
}

// resume maps the group's memory again, at the same addresses: every rank
// does it in the same control request, and each waits for the others.
func (p *peerAllReduce) resume() error {
	if p.mapped {
		return nil
	}
	if err := p.mapAll(); err != nil {
		return errors.Join(err, p.unmapAll())
	}
	return nil
}

// Close gives everything back. It does not wait for the stream: a kernel
// waiting for a rank that died would never finish.
func (p *peerAllReduce) Close() {
	_ = p.unmapAll()
	if p.va != 0 {
		C.ebb_cuMemAddressFree(C.CUdeviceptr(p.va), C.size_t(p.bytes*int64(p.size)))
		p.va = 0
	}
	p.fds.Close()
	if p.d.peers == p {
		p.d.peers = nil
	}
}
