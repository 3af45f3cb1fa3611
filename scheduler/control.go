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

// control carries out a control request and replies, echoing rid. Misuse
// (releasing twice, resuming what is resident, unknown tags, an update
// while requests hold KV) gets an error reply; nothing here panics.
func (s *Server) control(m ioschema.Message, rid string) {
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
	case *ioschema.UpdateWeightsFromTensorReqInput, *ioschema.InitWeightsUpdateGroupReqInput,
		*ioschema.UpdateWeightsFromDistributedReqInput:
		s.fail(rid, m.TypeName(), fmt.Errorf("%s is not supported by ebb yet: use UpdateWeightFromDiskReqInput", m.TypeName()))
		return
	default:
		s.fail(rid, m.TypeName(), fmt.Errorf("the scheduler does not handle %s", m.TypeName()))
		return
	}
	s.reply(reply)
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

// userTags are the tags a request names; none means every region the
// device has. The workspace follows cuda_graph (nothing runs without the
// graphs' buffers, and both hold scratch only).
func (s *Server) userTags(names []string) ([]memory.Tag, error) {
	tags, err := memory.ParseTags(names)
	if err != nil {
		return nil, err
	}
	mem := s.e.Dev.Memory()
	if len(names) == 0 {
		tags = slices.DeleteFunc(tags, func(t memory.Tag) bool { return mem.Region(t) == nil })
	}
	if slices.Contains(names, string(memory.CUDAGraph)) && !slices.Contains(tags, memory.Workspace) {
		tags = append(tags, memory.Workspace)
	}
	return tags, nil
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
	tags, err := s.userTags(r.Tags)
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
	out := s.e.Dev.Memory().Release(tags)
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
		if o.Err == nil {
			tags = append(tags, o.Tag)
		}
	}
	return tags
}

func (s *Server) resume(r *ioschema.ResumeMemoryOccupationReqInput, res ioschema.Result) ioschema.Message {
	tags, err := s.userTags(r.Tags)
	if err != nil {
		res.Success, res.Message = false, err.Error()
		return &ioschema.ResumeMemoryOccupationReqOutput{MemoryResult: ioschema.MemoryResult{Result: res}}
	}
	out := s.e.Dev.Memory().Resume(tags)
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
	mem := s.e.Dev.Memory()
	if mem.State(memory.Weights) == memory.Released {
		return fail(errors.New("the weights are released: resume the weights tag first"))
	}
	if _, running := s.core.Counts(); running > 0 {
		if !r.AbortAllRequests {
			return fail(fmt.Errorf("%d requests hold KV computed with the current weights: pause generation or set abort_all_requests", running))
		}
	}
	if r.AbortAllRequests {
		s.emit(s.core.Abort("", true, "aborted for a weight update"))
	}
	set, err := safetensors.OpenDir(r.ModelPath)
	if err != nil {
		return fail(err)
	}
	defer set.Close()
	if err := s.e.Model.CheckCheckpoint(set); err != nil {
		return fail(fmt.Errorf("%s does not match the model (weights unchanged): %w", r.ModelPath, err))
	}
	if err := s.e.Model.LoadCheckpoint(set); err != nil {
		return fail(fmt.Errorf("loading %s: %w", r.ModelPath, err))
	}
	if err := mem.MarkResident(memory.Weights); err != nil {
		return fail(err)
	}
	if r.FlushCache == nil || *r.FlushCache {
		if err := s.core.FlushCache(); err != nil {
			return fail(fmt.Errorf("weights updated, but the cache could not be flushed: %w", err))
		}
	}
	if r.WeightVersion != nil {
		s.weightVersion = *r.WeightVersion
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
		WeightsStale: mem.State(memory.Weights) == memory.Stale}
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
