package scheduler

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"ebb/device"
	"ebb/ioschema"
	"ebb/memory"
	"ebb/model"
	"ebb/weightsync"
)

// The weight-update paths share their preconditions and their ending:
// the weights must be mapped (resident or stale), requests holding KV
// computed with the old weights must be paused or aborted, and after the
// write the weights are resident, the prefix cache flushed when asked and
// the version recorded.

// beginUpdate checks that weights may be written now. Requests paused in
// place may keep the KV of the old weights where the caller asks for no
// flush, as SGLang lets them (an asynchronous RL loop's interrupted
// rollouts go on under the new policy).
func (s *Server) beginUpdate(abortAll bool, flush *bool) error {
	if s.e.Dev.Memory().State(memory.Weights) == memory.Released {
		return errors.New("the weights are released: resume the weights tag first")
	}
	if _, running := s.core.Counts(); running > 0 && !abortAll {
		if s.paused && flush != nil && !*flush {
			s.log.Info("requests paused in place keep the KV of the old weights (flush_cache false)", zap.Int("running", running))
			return nil
		}
		return fmt.Errorf("%d requests hold KV computed with the current weights: pause generation (retract), set abort_all_requests, or set flush_cache false to keep their KV", running)
	}
	if abortAll {
		s.emit(s.core.Abort("", true, "aborted for a weight update"))
	}
	return nil
}

// finishUpdate records a complete write.
func (s *Server) finishUpdate(flush *bool, version *string) error {
	if err := s.e.Dev.Memory().MarkResident(memory.Weights); err != nil {
		return err
	}
	if flush == nil || *flush {
		if err := s.core.FlushCache(); err != nil {
			return fmt.Errorf("weights updated, but the cache could not be flushed: %w", err)
		}
	}
	if version != nil {
		s.weightVersion = *version
	}
	return nil
}

// weightsIncomplete marks the weights stale after a write failed halfway:
// generation is refused until an update succeeds.
func (s *Server) weightsIncomplete(err error) error {
	if e := s.e.Dev.Memory().MarkStale(memory.Weights); e != nil {
		return errors.Join(err, e)
	}
	return fmt.Errorf("%w; the weights are incomplete: generation is refused until the next successful update", err)
}

// ignoredWeight names buffers trainers send that are not weights (as
// SGLang's loaders skip them).
func ignoredWeight(name string) bool {
	return strings.Contains(name, "rotary_emb.inv_freq") || strings.Contains(name, "rotary_emb.cos_cached") ||
		strings.Contains(name, "rotary_emb.sin_cached")
}

// weightWrite is one checkpoint tensor's place on the device.
type weightWrite struct {
	name  string
	t     model.Target // with tensor parallelism, this rank's part of the tensor
	srcDT device.DType
	src   *weightsync.Tensor // the tensor path's source
}

// newPlacer places whole tensors into this rank's weights, with scratch
// from the workspace.
func (s *Server) newPlacer() *model.Placer {
	dev := s.e.Dev
	return model.NewPlacer(dev, func(dt device.DType, n int) (device.Tensor, error) { return dev.Alloc(memory.Workspace, dt, n) },
		func(t device.Tensor) { dev.Free(memory.Workspace, t) })
}

// plan finds name's target and checks the shape and dtype a sender gives.
func (s *Server) plan(name string, shape []int, dtype device.DType) (model.Target, error) {
	t, ok := s.e.Model.TargetByName(name)
	if !ok {
		return t, fmt.Errorf("no parameter named %q", name)
	}
	if !slices.Equal(shape, t.Shape) {
		return t, fmt.Errorf("%s has shape %v, want %v", name, shape, t.Shape)
	}
	switch dtype {
	case device.F32, device.BF16, device.F16:
	default:
		return t, fmt.Errorf("%s: dtype %s (float32, bfloat16 or float16)", name, dtype)
	}
	return t, nil
}

func (s *Server) updateFromTensor(r *ioschema.UpdateWeightsFromTensorReqInput, res ioschema.Result) ioschema.Message {
	out := &ioschema.UpdateWeightsFromTensorReqOutput{Result: res}
	fail := func(err error) ioschema.Message {
		out.Success, out.Message = false, err.Error()
		s.log.Warn("update_weights_from_tensor failed", zap.Error(err))
		return out
	}
	start := time.Now()
	// SGLang's convention: one payload per tensor-parallel rank, each with
	// whole tensors (on that rank's GPU when they are CUDA tensors).
	rank := s.tpRank
	if n, tp := len(r.SerializedNamedTensors), s.e.Config.TPSize; n < tp {
		// Every rank refuses alike, before any touches its weights.
		return fail(fmt.Errorf("serialized_named_tensors has %d payloads for %d tensor-parallel ranks (none for TP rank %d): weights unchanged", n, tp, tp-1))
	}
	format := ""
	if r.LoadFormat != nil {
		format = *r.LoadFormat
	}
	payload, decodeErr := weightsync.Decode(r.SerializedNamedTensors[rank], format, rank)
	ipc, _ := s.e.Dev.(device.IPCImporter)
	src := weightsync.NewSources(payload, ipc)
	// Every reference the payload carries goes back to the trainer, after
	// the device has finished reading, whatever happens here.
	defer func() {
		if err := errors.Join(s.e.Dev.Sync(), src.Release()); err != nil {
			s.log.Warn("giving the trainer's tensors back", zap.Error(err))
		}
	}()
	if decodeErr != nil {
		return fail(fmt.Errorf("serialized_named_tensors[%d] (weights unchanged): %w", rank, decodeErr))
	}
	// Every tensor is checked before any request is aborted for the update:
	// a wrong name, shape or handle loses nothing.
	var writes []weightWrite
	var errs []error
	for _, nt := range payload.Tensors {
		if ignoredWeight(nt.Name) {
			continue
		}
		dt, err := nt.Tensor.DeviceDType()
		if err == nil {
			var t model.Target
			if t, err = s.plan(nt.Name, nt.Tensor.Shape, dt); err == nil {
				writes = append(writes, weightWrite{name: nt.Name, t: t, srcDT: dt, src: nt.Tensor})
			}
		}
		if err == nil && !nt.Tensor.Contiguous() {
			err = fmt.Errorf("%s is not contiguous (stride %v): send .contiguous() tensors", nt.Name, nt.Tensor.Stride)
		}
		if err == nil {
			err = src.Check(nt.Tensor)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", nt.Name, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fail(fmt.Errorf("weights unchanged: %w", err))
	}
	if err := s.beginUpdate(r.AbortAllRequests, r.FlushCache); err != nil {
		return fail(err)
	}
	placer := s.newPlacer()
	for _, w := range writes {
		if err := s.writeTensor(w, src, placer); err != nil {
			_ = placer.Close()
			return fail(s.weightsIncomplete(fmt.Errorf("%s: %w", w.name, err)))
		}
		out.Tensors++
		out.Bytes += w.t.Dst.Bytes()
	}
	if err := placer.Close(); err != nil {
		return fail(s.weightsIncomplete(err))
	}
	if err := s.finishUpdate(r.FlushCache, r.WeightVersion); err != nil {
		return fail(err)
	}
	out.Message = fmt.Sprintf("updated %d tensors (%s) in %v (version %s)", out.Tensors, memory.MiB(out.Bytes),
		time.Since(start).Round(time.Microsecond), s.weightVersion)
	s.log.Info("updated weights from tensors", zap.Int("tensors", out.Tensors), zap.String("bytes", memory.MiB(out.Bytes)),
		zap.Duration("took", time.Since(start)), zap.String("weight_version", s.weightVersion))
	return out
}

// writeTensor copies (this rank's part of) one shared tensor into its
// place, converting dtype.
func (s *Server) writeTensor(w weightWrite, src *weightsync.Sources, placer *model.Placer) error {
	if !w.src.Storage.CUDA() {
		b, err := src.HostBytes(w.src)
		if err != nil {
			return err
		}
		return s.e.Dev.Upload(w.t.Dst, w.t.HostPart(b, w.srcDT.Size()), w.srcDT)
	}
	p, err := src.DevicePtr(w.src)
	if err != nil {
		return err
	}
	return placer.Place(w.t, device.Tensor{Ptr: p, DType: w.srcDT, Shape: w.t.Shape})
}

// weightGroup is a process group joined with a trainer.
type weightGroup struct {
	name        string
	store       *weightsync.TCPStore
	rank, world int
	comm        device.Group // made at the first update, when the trainer's first collective publishes the NCCL id
}

func (s *Server) initWeightsGroup(r *ioschema.InitWeightsUpdateGroupReqInput, res ioschema.Result) ioschema.Message {
	out := &ioschema.InitWeightsUpdateGroupReqOutput{Result: res}
	fail := func(err error) ioschema.Message {
		out.Success, out.Message = false, "failed to initialize the weights update group: "+err.Error()
		return out
	}
	if r.Backend != "nccl" {
		return fail(fmt.Errorf("backend %q: ebb joins NCCL groups only", r.Backend))
	}
	if _, ok := s.e.Dev.(device.GroupJoiner); !ok {
		return fail(fmt.Errorf("this server runs on %s: an NCCL group needs a GPU", s.e.Dev.Name()))
	}
	if _, exists := s.groups[r.GroupName]; exists {
		return fail(fmt.Errorf("group %q exists: destroy it first", r.GroupName))
	}
	// Each data-parallel engine takes its own ranks after the ones before.
	rank := r.RankOffset + s.dpRank*s.e.Config.TPSize + s.tpRank
	if r.WorldSize < 2 || rank < 1 || rank >= r.WorldSize {
		return fail(fmt.Errorf("rank %d (rank_offset %d + DP rank %d x TP size %d + TP rank %d) in a world of %d: the trainer is rank 0",
			rank, r.RankOffset, s.dpRank, s.e.Config.TPSize, s.tpRank, r.WorldSize))
	}
	store, err := weightsync.JoinGroup(context.Background(), r.MasterAddr, r.MasterPort, s.distTimeout)
	if err != nil {
		return fail(err)
	}
	s.groups[r.GroupName] = &weightGroup{name: r.GroupName, store: store, rank: rank, world: r.WorldSize}
	out.Message = fmt.Sprintf("joined group %q as rank %d of %d", r.GroupName, rank, r.WorldSize)
	s.log.Info("joined a weights update group", zap.String("group", r.GroupName), zap.Int("rank", rank), zap.Int("world_size", r.WorldSize))
	return out
}

func (s *Server) destroyWeightsGroup(r *ioschema.DestroyWeightsUpdateGroupReqInput, res ioschema.Result) ioschema.Message {
	out := &ioschema.DestroyWeightsUpdateGroupReqOutput{Result: res}
	g, ok := s.groups[r.GroupName]
	if !ok {
		out.Success, out.Message = false, fmt.Sprintf("the group %q does not exist", r.GroupName)
		return out
	}
	if err := s.dropGroup(g); err != nil {
		out.Success, out.Message = false, err.Error()
		return out
	}
	out.Message = fmt.Sprintf("left group %q", r.GroupName)
	return out
}

func (s *Server) dropGroup(g *weightGroup) error {
	delete(s.groups, g.name)
	var errs []error
	if g.comm != nil {
		errs = append(errs, g.comm.Destroy())
	}
	return errors.Join(append(errs, g.store.Close())...)
}

func (s *Server) updateFromDistributed(r *ioschema.UpdateWeightsFromDistributedReqInput, res ioschema.Result) ioschema.Message {
	out := &ioschema.UpdateWeightsFromDistributedReqOutput{Result: res}
	fail := func(err error) ioschema.Message {
		out.Success, out.Message = false, err.Error()
		s.log.Warn("update_weights_from_distributed failed", zap.Error(err))
		return out
	}
	start := time.Now()
	g, ok := s.groups[r.GroupName]
	if !ok {
		return fail(fmt.Errorf("no group %q: call init_weights_update_group first", r.GroupName))
	}
	if len(r.Names) != len(r.DTypes) || len(r.Names) != len(r.Shapes) {
		return fail(fmt.Errorf("%d names, %d dtypes and %d shapes", len(r.Names), len(r.DTypes), len(r.Shapes)))
	}
	flattened := r.LoadFormat != nil && *r.LoadFormat == weightsync.FormatFlattened
	if r.LoadFormat != nil && *r.LoadFormat != "" && !flattened {
		return fail(fmt.Errorf("load_format %q is not supported (none or flattened_bucket)", *r.LoadFormat))
	}
	// Check everything before receiving: a refused update still takes the
	// trainer's broadcasts (into scratch), so the group stays in step.
	writes := make([]weightWrite, len(r.Names))
	var errs []error
	for i, name := range r.Names {
		dt, err := device.ParseDType(r.DTypes[i])
		if err == nil && ignoredWeight(name) {
			writes[i] = weightWrite{name: name, srcDT: dt}
			continue
		}
		var t model.Target
		if err == nil {
			t, err = s.plan(name, r.Shapes[i], dt)
		}
		if err != nil {
			errs = append(errs, err)
		}
		writes[i] = weightWrite{name: name, t: t, srcDT: dt}
	}
	if flattened {
		for i := range writes {
			if writes[i].srcDT != writes[0].srcDT {
				errs = append(errs, fmt.Errorf("a flattened bucket has one dtype: %s is %s, %s is %s",
					r.Names[0], writes[0].srcDT, r.Names[i], writes[i].srcDT))
				break
			}
		}
	}
	refused := errors.Join(errs...)
	if refused == nil {
		if err := s.beginUpdate(r.AbortAllRequests, r.FlushCache); err != nil {
			refused = err
		}
	}
	if g.comm == nil {
		id, err := g.store.NCCLUniqueID(context.Background(), g.name, s.distTimeout)
		if err == nil {
			g.comm, err = s.e.Dev.(device.GroupJoiner).JoinGroup(id, g.world, g.rank, s.distTimeout)
		}
		if err != nil {
			_ = s.dropGroup(g)
			return fail(fmt.Errorf("joining the trainer's NCCL communicator (the group is gone; init it again): %w", err))
		}
	}
	n, bytes, err := s.receive(g, r.Shapes, writes, flattened, refused != nil)
	if err != nil {
		_ = s.dropGroup(g)
		err = fmt.Errorf("receiving from group %q (the group is gone; init it again): %w", g.name, err)
		if refused == nil {
			err = s.weightsIncomplete(err)
		}
		return fail(err)
	}
	if refused != nil {
		return fail(fmt.Errorf("weights unchanged (the broadcasts were received and dropped): %w", refused))
	}
	if err := s.finishUpdate(r.FlushCache, r.WeightVersion); err != nil {
		return fail(err)
	}
	out.Tensors, out.Bytes = n, bytes
	out.Message = fmt.Sprintf("received %d tensors (%s) in %v (version %s)", n, memory.MiB(bytes), time.Since(start).Round(time.Microsecond), s.weightVersion)
	s.log.Info("updated weights from the trainer's group", zap.String("group", g.name), zap.Int("tensors", n),
		zap.String("bytes", memory.MiB(bytes)), zap.Duration("took", time.Since(start)), zap.String("weight_version", s.weightVersion))
	return out
}

// receive takes the trainer's broadcasts: straight into the weights when
// the dtype matches, else through scratch memory and a conversion; a
// flattened bucket is one broadcast into scratch, then copied out. With
// discard, everything lands in scratch and nothing is written.
func (s *Server) receive(g *weightGroup, shapes [][]int, writes []weightWrite, flattened, discard bool) (int, int64, error) {
	dev := s.e.Dev
	mem := dev.Memory()
	wsBefore := int64(0)
	if ws := mem.Region(memory.Workspace); ws != nil {
		wsBefore = ws.Stats().Reserved
	}
	numel := func(shape []int) int {
		n := 1
		for _, d := range shape {
			n *= d
		}
		return n
	}
	// One scratch buffer, as large as the largest broadcast that cannot go
	// straight into the weights; the stream orders its reuse.
	var need int64
	for i, w := range writes {
		n := int64(numel(shapes[i])) * int64(w.srcDT.Size())
		switch {
		case flattened:
			need += n
		case discard || !w.t.Dst.Valid() || w.srcDT != w.t.Dst.DType || !w.t.Whole():
			need = max(need, n)
		}
	}
	var scratch device.Tensor
	if need > 0 {
		var err error
		if scratch, err = dev.Alloc(memory.Workspace, device.I32, int((need+3)/4)); err != nil {
			return 0, 0, fmt.Errorf("scratch for the broadcasts: %w", err)
		}
	}
	defer func() {
		dev.Free(memory.Workspace, scratch)
		// Return what a large bucket added to the workspace: the arena keeps
		// the size it was planned for.
		if ws := mem.Region(memory.Workspace); ws != nil && ws.Stats().Reserved > wsBefore {
			_, _ = mem.EmptyCache(memory.Workspace)
		}
	}()
	temp := func(dt device.DType, n int) device.Tensor {
		return device.Tensor{Ptr: scratch.Ptr, DType: dt, Shape: []int{n}}
	}
	var count int
	var bytes int64
	placer := s.newPlacer()
	defer placer.Close()
	// Each rank receives whole tensors and keeps its part.
	place := func(w weightWrite, from device.Tensor) error {
		if discard || !w.t.Dst.Valid() {
			return nil
		}
		if err := placer.Place(w.t, from); err != nil {
			return err
		}
		count++
		bytes += w.t.Dst.Bytes()
		return nil
	}
	if flattened {
		total := 0
		for _, sh := range shapes {
			total += numel(sh)
		}
		if len(writes) == 0 {
			return 0, 0, nil
		}
		buf := temp(writes[0].srcDT, total)
		if err := g.comm.Broadcast(buf, 0, s.distTimeout); err != nil {
			return 0, 0, err
		}
		off := 0
		for i, w := range writes {
			n := numel(shapes[i])
			if err := place(w, buf.Rows(off, off+n)); err != nil {
				return count, bytes, err
			}
			off += n
		}
	} else {
		for i, w := range writes {
			n := numel(shapes[i])
			if !discard && w.t.Dst.Valid() && w.srcDT == w.t.Dst.DType && w.t.Whole() {
				if err := g.comm.Broadcast(w.t.Dst, 0, s.distTimeout); err != nil {
					return count, bytes, err
				}
				count++
				bytes += w.t.Dst.Bytes()
				continue
			}
			buf := temp(w.srcDT, n)
			if err := g.comm.Broadcast(buf, 0, s.distTimeout); err != nil {
				return count, bytes, err
			}
			if err := place(w, buf); err != nil {
				return count, bytes, err
			}
		}
	}
	if err := g.comm.Synchronize(s.distTimeout); err != nil {
		return count, bytes, err
	}
	return count, bytes, dev.Sync()
}

func (s *Server) updateWeightVersion(r *ioschema.UpdateWeightVersionReqInput, res ioschema.Result) ioschema.Message {
	out := &ioschema.UpdateWeightVersionReqOutput{Result: res}
	if r.AbortAllRequests {
		s.emit(s.core.Abort("", true, "aborted for a weight version update"))
	}
	s.weightVersion = r.NewVersion
	out.Message = "weight version set to " + r.NewVersion
	return out
}

// heldUpdate is a weight update waiting for the running requests.
type heldUpdate struct {
	msg   ioschema.Message
	rid   string
	since time.Time
}

// waitForDecodes holds a weight update that arrives while requests decode
// with the current weights and generation runs, as SGLang's tokenizer
// manager holds one until the requests in flight are done (its model
// update lock): no queued request is admitted meanwhile, the running ones
// finish, then the update is carried out (runHeldUpdates) and the queue,
// prefilled with the new weights, goes on. abort_all_requests does not
// wait, and an update behind held ones waits its turn. It reports whether
// it held m.
func (s *Server) waitForDecodes(m ioschema.Message, rid string) bool {
	abortAll, ok := ioschema.WeightWrite(m)
	if d, disk := m.(*ioschema.UpdateWeightFromDiskReqInput); !ok || disk && !isDir(d.ModelPath) {
		return false // a path that is not there fails at once
	}
	if abortAll {
		if len(s.updates) > 0 {
			s.settle()
			s.emit(s.core.Abort("", true, "aborted for a weight update"))
			s.runHeldUpdates()
		}
		return false
	}
	if _, running := s.core.Counts(); len(s.updates) == 0 && (running == 0 || !s.canRun()) {
		return false
	}
	s.setHeld(append(s.updates, heldUpdate{msg: m, rid: rid, since: time.Now()}))
	waiting, running := s.core.Counts()
	s.log.Info("weight update waits for the running requests", zap.String("request", m.TypeName()),
		zap.Int("running", running), zap.Int("held_waiting", waiting), zap.Int("updates_held", len(s.updates)))
	return true
}

// runHeldUpdates carries out the held updates once no request runs, or
// at once when generation cannot run (a pause or a release came after
// them: they then get what beginUpdate says of the requests left).
func (s *Server) runHeldUpdates() {
	if len(s.updates) == 0 {
		return
	}
	if _, running := s.core.Counts(); running > 0 && s.canRun() {
		return
	}
	held := s.updates
	s.setHeld(nil)
	for _, u := range held {
		s.log.Info("weight update carried out after the running requests", zap.String("request", u.msg.TypeName()),
			zap.Duration("waited", time.Since(u.since)))
		s.carryOut(u.msg, u.rid)
	}
}

// dropHeldUpdate forgets the held update whose caller went away (the
// tokenizer manager aborts its rid): a trainer that gave up on an update
// from tensor may free the tensors its handles name. It is never carried
// out, and no reply is sent.
func (s *Server) dropHeldUpdate(rid string) {
	if rid == "" {
		return
	}
	for i, u := range s.updates {
		if u.rid == rid {
			s.log.Info("held weight update dropped: its caller went away", zap.String("request", u.msg.TypeName()),
				zap.Duration("held", time.Since(u.since)))
			s.setHeld(slices.Delete(s.updates, i, i+1))
			return
		}
	}
}

// setHeld sets the held updates: the queue is held while any is.
func (s *Server) setHeld(updates []heldUpdate) {
	s.updates = updates
	s.core.HoldWaiting(len(updates) > 0)
}

// checkHeldUpdates is the idle check of the held updates: with no request
// left none waits and the queue is not held.
func (s *Server) checkHeldUpdates() error {
	if len(s.updates) > 0 || s.core.holdWaiting {
		return fmt.Errorf("idle with %d weight updates held and the queue held %v", len(s.updates), s.core.holdWaiting)
	}
	return nil
}

func isDir(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.IsDir()
}
