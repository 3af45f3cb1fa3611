package scheduler

import (
	"errors"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"ebb/device"
	"ebb/ioschema"
	"ebb/memory"
	"ebb/safetensors"
)

// control carries out a control request and returns the reply, echoing rid. Misuse
// (releasing twice, resuming what is resident, unknown tags, an update
// while requests hold KV) gets an error reply; nothing here panics.
func (s *Server) control(m ioschema.Message, rid string) ioschema.Message {
	res := ioschema.Result{Rid: rid, Success: true}
	var reply ioschema.Message
	switch r := m.(type) {
	case *ioschema.FlushCacheReqInput:
		if err := s.core.FlushCache(); err != nil {
			res.Success, res.Message = false, "cannot flush the cache: "+err.Error()
		} else {
			res.Message = "cache flushed"
		}
		reply = &ioschema.FlushCacheReqOutput{Result: res}
	case *ioschema.PauseGenerationReqInput:
		reply = s.pause(r, res)
	case *ioschema.ContinueGenerationReqInput:
		reply = s.continueGeneration(r, res)
	case *ioschema.ReleaseMemoryOccupationReqInput:
		reply = s.release(r, res)
	case *ioschema.ResumeMemoryOccupationReqInput:
		reply = s.resume(r, res)
	case *ioschema.UpdateWeightFromDiskReqInput:
		reply = s.updateFromDisk(r, res)
	case *ioschema.GetWeightsByNameReqInput:
		reply = s.weightsByName(r, res)
	case *ioschema.GetMemoryStatsReqInput:
		reply = s.memoryStats(res)
	case *ioschema.GetServerInfoReqInput:
		reply = &ioschema.GetServerInfoReqOutput{Result: res, Info: s.Info()}
	case *ioschema.UpdateWeightsFromTensorReqInput:
		reply = s.updateFromTensor(r, res)
	case *ioschema.InitWeightsUpdateGroupReqInput:
		reply = s.initWeightsGroup(r, res)
	case *ioschema.UpdateWeightsFromDistributedReqInput:
		reply = s.updateFromDistributed(r, res)
	case *ioschema.DestroyWeightsUpdateGroupReqInput:
		reply = s.destroyWeightsGroup(r, res)
	case *ioschema.UpdateWeightVersionReqInput:
		reply = s.updateWeightVersion(r, res)
	default:
		return &ioschema.ErrorOutput{Rid: rid, Request: m.TypeName(), Message: fmt.Sprintf("the scheduler does not handle %s", m.TypeName())}
	}
	return reply
}

func (s *Server) pause(r *ioschema.PauseGenerationReqInput, res ioschema.Result) ioschema.Message {
	out := &ioschema.PauseGenerationReqOutput{Result: res}
	switch r.Mode {
	case ioschema.PauseAbort:
		events := s.core.Abort("", true, "generation paused (mode abort)")
		out.Aborted = len(events)
		s.emit(events)
	case ioschema.PauseRetract:
		out.Retracted = s.core.Retract()
	case ioschema.PauseInPlace:
	default:
		out.Success, out.Message = false, fmt.Sprintf("unknown pause mode %q (abort, retract, in_place)", r.Mode)
		return out
	}
	s.paused = true
	out.Message = "paused (" + r.Mode + ")"
	s.log.Info("generation paused", zap.String("mode", r.Mode), zap.Int("aborted", out.Aborted), zap.Int("retracted", out.Retracted))
	return out
}

func (s *Server) workspaceReserved() int64 {
	if r := s.e.Dev.Memory().Region(memory.Workspace); r != nil {
		return r.Stats().Reserved
	}
	return 0
}

func (s *Server) continueGeneration(r *ioschema.ContinueGenerationReqInput, res ioschema.Result) ioschema.Message {
	out := &ioschema.ContinueGenerationReqOutput{Result: res}
	if r.TorchEmptyCache {
		out.ReservedBefore = s.workspaceReserved()
		if _, err := s.e.Dev.Memory().EmptyCache(memory.Workspace); err != nil {
			out.Success, out.Message = false, "empty cache: "+err.Error()
			return out
		}
		out.ReservedAfter = s.workspaceReserved()
		s.log.Info("emptied the workspace cache", zap.String("reserved_before", memory.MiB(out.ReservedBefore)),
			zap.String("reserved_after", memory.MiB(out.ReservedAfter)))
	}
	s.paused = false
	out.Message = "generation continues"
	if !s.e.Dev.Memory().AllResident() {
		out.Message = "generation continues once every released tag is resumed (and stale weights are updated)"
	}
	return out
}

// callerTags are the tags SGLang's callers name; workspace is ebb's own
// and follows them (see tagsFor).
var callerTags = []memory.Tag{memory.KVCache, memory.CUDAGraph, memory.Weights}

// tagsFor turns the tags a request names (none: all) into the regions to
// release or resume, and reports the named ones this device or
// configuration does not have (cuda_graph on the CPU or with
// --disable-cuda-graph) as absent rather than as errors. The workspace is
// never the caller's business: it goes when nothing that uses it stays
// (cuda_graph released, or every other region), and it comes back with
// whatever is resumed.
func (s *Server) tagsFor(names []string, resume bool) ([]memory.Tag, memory.Outcomes, error) {
	mem := s.e.Dev.Memory()
	named := callerTags
	if len(names) > 0 {
		named = nil
		for _, n := range names {
			t := memory.Tag(n)
			if !t.Valid() {
				return nil, nil, fmt.Errorf("unknown memory tag %q (tags: weights, kv_cache, cuda_graph)", n)
			}
			if !slices.Contains(named, t) {
				named = append(named, t)
			}
		}
	}
	var tags []memory.Tag
	var absent memory.Outcomes
	for _, t := range named {
		if mem.Region(t) == nil {
			absent = append(absent, memory.Outcome{Tag: t, State: "absent",
				Note: fmt.Sprintf("%s has no %s region: nothing to do", s.e.Dev.Name(), t)})
			continue
		}
		if t != memory.Workspace {
			tags = append(tags, t)
		}
	}
	ws := mem.Region(memory.Workspace)
	if ws == nil {
		return tags, absent, nil
	}
	switch {
	case resume:
		if ws.State() == memory.Released && (len(tags) > 0 || slices.Contains(named, memory.Workspace)) {
			tags = append([]memory.Tag{memory.Workspace}, tags...)
		}
	case ws.State() != memory.Released && (slices.Contains(named, memory.Workspace) || s.releasesAllUsers(tags)):
		tags = append(tags, memory.Workspace)
	}
	return tags, absent, nil
}

// releasesAllUsers reports whether releasing tags leaves nothing that runs
// on the workspace: cuda_graph goes (nothing can run without it), or every
// other region ends up released.
func (s *Server) releasesAllUsers(tags []memory.Tag) bool {
	if slices.Contains(tags, memory.CUDAGraph) {
		return true
	}
	mem := s.e.Dev.Memory()
	for _, t := range callerTags {
		if mem.Region(t) != nil && !slices.Contains(tags, t) && mem.State(t) != memory.Released {
			return false
		}
	}
	return true
}

func outcomesResult(res ioschema.Result, out memory.Outcomes, verb string) ioschema.MemoryResult {
	mr := ioschema.MemoryResult{Result: res, Tags: out}
	mr.Message = verb + ": " + out.Summary()
	if err := out.Err(); err != nil {
		mr.Success = false
	}
	return mr
}

func (s *Server) release(r *ioschema.ReleaseMemoryOccupationReqInput, res ioschema.Result) ioschema.Message {
	tags, absent, err := s.tagsFor(r.Tags, false)
	if err != nil {
		res.Success, res.Message = false, err.Error()
		return &ioschema.ReleaseMemoryOccupationReqOutput{MemoryResult: ioschema.MemoryResult{Result: res}}
	}
	// Requests in flight go back to the queue first; they re-prefill later.
	if n := s.core.Retract(); n > 0 {
		s.log.Info("retracted running requests before releasing memory", zap.Int("requests", n))
	}
	if slices.Contains(tags, memory.KVCache) && s.e.Dev.Memory().State(memory.KVCache) != memory.Released {
		if err := s.core.FlushCache(); err != nil {
			res.Success, res.Message = false, "cannot drop the KV cache: "+err.Error()
			return &ioschema.ReleaseMemoryOccupationReqOutput{MemoryResult: ioschema.MemoryResult{Result: res}}
		}
	}
	out := append(s.e.Dev.Memory().Release(tags), absent...)
	if hook, ok := s.e.Dev.(device.ResumeHook); ok {
		if err := hook.AfterRelease(succeeded(out)); err != nil {
			res.Success, res.Message = false, "after release: "+err.Error()
			return &ioschema.ReleaseMemoryOccupationReqOutput{MemoryResult: ioschema.MemoryResult{Result: res, Tags: out}}
		}
	}
	s.log.Info("released memory", zap.String("tags", out.Summary()))
	return &ioschema.ReleaseMemoryOccupationReqOutput{MemoryResult: outcomesResult(res, out, "released")}
}

// succeeded lists the tags an operation carried out.
func succeeded(out memory.Outcomes) []memory.Tag {
	var tags []memory.Tag
	for _, o := range out {
		if o.Err == nil && o.State != "absent" {
			tags = append(tags, o.Tag)
		}
	}
	return tags
}

func (s *Server) resume(r *ioschema.ResumeMemoryOccupationReqInput, res ioschema.Result) ioschema.Message {
	tags, absent, err := s.tagsFor(r.Tags, true)
	if err != nil {
		res.Success, res.Message = false, err.Error()
		return &ioschema.ResumeMemoryOccupationReqOutput{MemoryResult: ioschema.MemoryResult{Result: res}}
	}
	out := append(s.e.Dev.Memory().Resume(tags), absent...)
	if hook, ok := s.e.Dev.(device.ResumeHook); ok {
		if err := hook.AfterResume(succeeded(out)); err != nil {
			res.Success, res.Message = false, "after resume: "+err.Error()
			return &ioschema.ResumeMemoryOccupationReqOutput{MemoryResult: ioschema.MemoryResult{Result: res, Tags: out}}
		}
	}
	s.log.Info("resumed memory", zap.String("tags", out.Summary()))
	return &ioschema.ResumeMemoryOccupationReqOutput{MemoryResult: outcomesResult(res, out, "resumed")}
}

func (s *Server) updateFromDisk(r *ioschema.UpdateWeightFromDiskReqInput, res ioschema.Result) ioschema.Message {
	out := &ioschema.UpdateWeightFromDiskReqOutput{Result: res}
	fail := func(err error) ioschema.Message {
		out.Success, out.Message = false, err.Error()
		return out
	}
	if r.LoadFormat != nil && *r.LoadFormat != "" && *r.LoadFormat != "auto" && *r.LoadFormat != "safetensors" {
		return fail(fmt.Errorf("load_format %q is not supported (auto, safetensors)", *r.LoadFormat))
	}
	if r.ModelPath == "" {
		return fail(errors.New("model_path is required"))
	}
	mem := s.e.Dev.Memory()
	// The checkpoint is checked before any request is aborted for it: a
	// wrong path or shape loses nothing.
	set, err := safetensors.OpenDir(r.ModelPath)
	if err != nil {
		return fail(err)
	}
	defer set.Close()
	if err := s.e.Model.CheckCheckpoint(set); err != nil {
		return fail(fmt.Errorf("%s does not match the model (weights unchanged): %w", r.ModelPath, err))
	}
	if err := s.beginUpdate(r.AbortAllRequests, r.FlushCache); err != nil {
		return fail(err)
	}
	if err := s.e.Model.LoadCheckpoint(set); err != nil {
		return fail(s.weightsIncomplete(fmt.Errorf("loading %s: %w", r.ModelPath, err)))
	}
	if err := s.finishUpdate(r.FlushCache, r.WeightVersion); err != nil {
		return fail(err)
	}
	if r.TorchEmptyCache {
		if _, err := mem.EmptyCache(memory.Workspace); err != nil {
			return fail(err)
		}
	}
	waiting, _ := s.core.Counts()
	out.NumPausedRequest = waiting
	out.Message = "weights updated from " + r.ModelPath + " (version " + s.weightVersion + ")"
	s.log.Info("updated weights from disk", zap.String("path", r.ModelPath), zap.String("weight_version", s.weightVersion))
	return out
}

func (s *Server) weightsByName(r *ioschema.GetWeightsByNameReqInput, res ioschema.Result) ioschema.Message {
	out := &ioschema.GetWeightsByNameReqOutput{Result: res}
	t, ok := s.e.Model.TargetByName(r.Name)
	if !ok {
		out.Success, out.Message = false, fmt.Sprintf("no parameter named %q", r.Name)
		return out
	}
	if !t.Whole() {
		out.Success, out.Message = false, r.Name+" is split over tensor-parallel ranks: reading a shard is not implemented yet"
		return out
	}
	if st := s.e.Dev.Memory().State(memory.Weights); st != memory.Resident {
		out.Success, out.Message = false, "the weights are "+st.String()
		return out
	}
	n := t.Dst.Numel()
	if r.TruncateSize > 0 {
		n = min(n, r.TruncateSize)
	}
	view := device.Tensor{Ptr: t.Dst.Ptr, DType: t.Dst.DType, Shape: []int{n}}
	out.Parameter = make([]float32, n)
	if err := s.e.Dev.DownloadF32(view, out.Parameter); err != nil {
		out.Success, out.Message = false, err.Error()
	}
	out.Shape = t.Shape
	return out
}

func (s *Server) memoryStats(res ioschema.Result) ioschema.Message {
	mem := s.e.Dev.Memory()
	out := &ioschema.GetMemoryStatsReqOutput{Result: res, Tags: mem.Stats(), NVMLProcessBytes: -1,
		WeightsStale: mem.State(memory.Weights) == memory.Stale, ReleasedTags: s.releasedTags(),
		GenerationBlocked: s.blockedReason()}
	if waiting, running := s.core.Counts(); !s.canRun() {
		out.WaitingRequests = waiting + running
	}
	if r := mem.Region(memory.Workspace); r != nil {
		st := r.Stats()
		out.WorkspaceReserved, out.WorkspaceAllocated = st.Reserved, st.Allocated
	}
	if mr, ok := s.e.Dev.(device.MemoryReporter); ok {
		if rep, err := mr.MemoryReport(); err == nil {
			out.NVMLProcessBytes, out.NVMLUsedBytes, out.NVMLTotalBytes = rep.ProcessBytes, rep.UsedBytes, rep.TotalBytes
		}
	}
	if mi, ok := s.e.Dev.(device.MemoryInfo); ok {
		if free, _, err := mi.DeviceMemory(); err == nil {
			out.DriverFreeBytes = free
		}
	}
	return out
}
