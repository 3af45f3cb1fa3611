package bench

import (
	"fmt"
	"net/http"
	"time"
)

// serverState is what `bench serving` reads of a server before and after
// a run: scheduler counters (server_info) and, from ebb, GPU memory
// (/memory_stats; zero where the server has none).
type serverState struct {
	Running, Waiting int64
	UsedTokens       int64 // KV held by requests (SGLang's num_used_tokens)
	InvariantsOK     bool
	Retracted        int64
	Recomputed       int64
	ProcessBytes     int64 // NVML, summed over the server's processes
	ReservedBytes    int64 // the memory regions' reservations
	HasMemory        bool
}

func readServerState(client *http.Client, url, key string) serverState {
	var info struct {
		Running      float64 `json:"num_running_reqs"`
		Waiting      float64 `json:"num_waiting_reqs"`
		Used         float64 `json:"num_used_tokens"`
		InvariantsOK *bool   `json:"invariants_ok"`
		Retracted    float64 `json:"num_retracted_reqs"`
		Recomputed   float64 `json:"recomputed_tokens"`
	}
	var st serverState
	if getJSON(client, url+"/get_server_info", key, &info) == nil {
		st = serverState{Running: int64(info.Running), Waiting: int64(info.Waiting), UsedTokens: int64(info.Used),
			InvariantsOK: info.InvariantsOK == nil || *info.InvariantsOK, Retracted: int64(info.Retracted), Recomputed: int64(info.Recomputed)}
	}
	var mem memoryStats
	if getJSON(client, url+"/memory_stats", key, &mem) == nil {
		st.HasMemory = true
		for _, r := range mem.ranks() {
			st.ProcessBytes += r.ProcessBytes
		}
		st.ReservedBytes = mem.reservedBytes()
	}
	return st
}

// memoryGrowthAllowed is how much more GPU memory a server's processes may
// hold after a run than before: the driver's own bookkeeping moves by a
// few MiB; anything ebb allocates is in its regions, which must not grow.
const memoryGrowthAllowed = 32 << 20

// checkAfterRun is --check: no failed request, and once the server is idle
// no KV held, the invariants intact and no memory grown since before.
func checkAfterRun(client *http.Client, url, key string, rep *ServingReport, before serverState) []string {
	var failed []string
	if rep.Failed > 0 {
		failed = append(failed, fmt.Sprintf("%d of %d requests failed (first: %s)", rep.Failed, rep.Failed+rep.Completed, rep.FirstError))
	}
	if c := rep.Chaos; c != nil && c.Failed > 0 {
		failed = append(failed, fmt.Sprintf("%d control requests of the chaos failed (first: %s)", c.Failed, c.FirstError))
	}
	var after serverState
	deadline := time.Now().Add(time.Minute)
	for {
		after = readServerState(client, url, key)
		if after.Running == 0 && after.Waiting == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if after.Running != 0 || after.Waiting != 0 {
		failed = append(failed, fmt.Sprintf("still %d running and %d waiting a minute after the run", after.Running, after.Waiting))
	}
	if after.UsedTokens != 0 {
		failed = append(failed, fmt.Sprintf("%d KV tokens held with no request left", after.UsedTokens))
	}
	if !after.InvariantsOK {
		failed = append(failed, "the server reports a broken invariant")
	}
	if before.HasMemory && after.HasMemory {
		// Less is no leak: a continue_generation with torch_empty_cache
		// hands the workspace back, and later steps may not need it all.
		if after.ReservedBytes > before.ReservedBytes {
			failed = append(failed, fmt.Sprintf("memory regions reserve %d bytes, %d before the run", after.ReservedBytes, before.ReservedBytes))
		}
		if grown := after.ProcessBytes - before.ProcessBytes; grown > memoryGrowthAllowed {
			failed = append(failed, fmt.Sprintf("GPU memory grew by %d MiB during the run", grown>>20))
		}
	}
	if len(failed) == 0 {
		return []string{"ok"}
	}
	return failed
}
