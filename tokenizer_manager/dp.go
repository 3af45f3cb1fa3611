package tokenizermanager

import (
	"fmt"
	"slices"
	"strings"

	"ebb/ioschema"
)

// controlWait gathers every data-parallel engine's reply to one control
// request; the caller gets one reply once all have answered.
type controlWait struct {
	ch      chan ioschema.Message
	need    int
	replies []ioschema.Message
}

func (t *table) answer(rid string, w *controlWait, msg ioschema.Message) {
	w.replies = append(w.replies, msg)
	if len(w.replies) < w.need {
		return
	}
	delete(t.control, rid)
	w.ch <- mergeReplies(w.replies)
}

type resultReply interface {
	ioschema.Message
	ResultPtr() *ioschema.Result
}

// mergeReplies makes one reply of the engines' replies to a control
// request: an error if any engine failed to handle it, else the first
// engine's reply, successful only if every engine's was, with each
// engine's own reply in Engines (but for weights, which are the same
// everywhere and large).
func mergeReplies(replies []ioschema.Message) ioschema.Message {
	if len(replies) == 1 {
		return replies[0]
	}
	var failed []string
	var results []resultReply
	for _, r := range replies {
		switch r := r.(type) {
		case *ioschema.ErrorOutput:
			failed = append(failed, r.Message)
		case resultReply:
			results = append(results, r)
		default:
			failed = append(failed, "an engine answered with "+r.TypeName())
		}
	}
	if len(failed) > 0 {
		rid := ""
		if c, ok := replies[0].(interface{ GetRid() string }); ok {
			rid = c.GetRid()
		}
		return &ioschema.ErrorOutput{Rid: rid, Message: fmt.Sprintf("%d of %d data-parallel engines failed: %s",
			len(failed), len(replies), strings.Join(failed, "; "))}
	}
	slices.SortFunc(results, func(a, b resultReply) int { return a.ResultPtr().DPRank - b.ResultPtr().DPRank })
	var detail []map[string]any
	if _, isWeights := results[0].(*ioschema.GetWeightsByNameReqOutput); !isWeights {
		for _, r := range results {
			detail = append(detail, engineDetail(r))
		}
	}
	base := results[0]
	merged := base.ResultPtr()
	var messages []string
	same := true
	for _, r := range results {
		res := r.ResultPtr()
		merged.Success = merged.Success && res.Success
		messages = append(messages, fmt.Sprintf("dp %d: %s", res.DPRank, res.Message))
		same = same && res.Message == merged.Message
	}
	if !same {
		merged.Message = strings.Join(messages, "; ")
	}
	if p, ok := base.(*ioschema.PauseGenerationReqOutput); ok {
		for _, r := range results[1:] {
			q := r.(*ioschema.PauseGenerationReqOutput)
			p.Aborted, p.Retracted = p.Aborted+q.Aborted, p.Retracted+q.Retracted
		}
	}
	merged.Engines = detail
	if info, ok := base.(*ioschema.GetServerInfoReqOutput); ok {
		info.Info = mergeInfo(results)
	}
	return base
}

// summedInfo are the server_info figures that add up over engines.
var summedInfo = []string{"num_running_reqs", "num_waiting_reqs", "generated_tokens", "prompt_tokens",
	"cached_prompt_tokens", "max_total_num_tokens", "kv_free_tokens", "kv_used_tokens", "kv_cached_tokens",
	"kv_evictable_tokens", "graph_steps", "eager_steps", "num_used_tokens", "num_waiting_tokens", "gen_throughput",
	"num_retracted_reqs", "retracted_input_tokens", "retracted_output_tokens", "recomputed_tokens", "forward_ct",
	"weight_updates_waiting"}

// mergeInfo is engine 0's server_info with the counts summed over every
// engine, the reasons any engine cannot generate, and each engine's own.
func mergeInfo(results []resultReply) map[string]any {
	infos := make([]map[string]any, len(results))
	for i, r := range results {
		infos[i] = r.(*ioschema.GetServerInfoReqOutput).Info
	}
	merged := map[string]any{}
	for k, v := range infos[0] {
		merged[k] = v
	}
	for _, k := range summedInfo {
		var sum float64
		all := true
		for _, in := range infos {
			v, ok := toFloat(in[k])
			all = all && ok
			sum += v
		}
		if all {
			merged[k] = sum
		}
	}
	var blocked []string
	for i, in := range infos {
		if why, _ := in["generation_blocked"].(string); why != "" {
			blocked = append(blocked, fmt.Sprintf("dp %d: %s", i, why))
		}
	}
	merged["generation_blocked"] = strings.Join(blocked, "; ")
	merged["dp_size"] = len(infos)
	merged["engines"] = infos
	return merged
}

// engineDetail is one engine's reply as its JSON fields plus its rank.
func engineDetail(r resultReply) map[string]any {
	m := ioschema.Detail(r)
	m["dp_rank"] = r.ResultPtr().DPRank
	return m
}
