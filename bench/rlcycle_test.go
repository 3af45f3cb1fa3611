package bench

import (
	"encoding/json"
	"slices"
	"testing"
)

// TestMemoryStatsRanks reads every process's NVML figure and every
// engine's reserved regions from /memory_stats replies of one engine, of a
// tensor-parallel engine and of two such engines (data parallelism, whose
// top level repeats the first engine's).
func TestMemoryStatsRanks(t *testing.T) {
	for _, c := range []struct {
		name, reply string
		process     []int64
		reserved    int64
	}{
		{"one process", `{"nvml_process_bytes": 10, "nvml_device_used_bytes": 20, "tags": [{"reserved_bytes": 5}, {"reserved_bytes": 6}]}`,
			[]int64{10}, 11},
		{"tp 2", `{"nvml_process_bytes": 10, "tags": [{"reserved_bytes": 5}], "tp_ranks": [{"tp_rank": 1, "nvml_process_bytes": 11}]}`,
			[]int64{10, 11}, 5},
		{"tp 2 dp 2", `{"nvml_process_bytes": 10, "tags": [{"reserved_bytes": 5}], "tp_ranks": [{"nvml_process_bytes": 11}],
			"engines": [
				{"dp_rank": 0, "nvml_process_bytes": 10, "tags": [{"reserved_bytes": 5}], "tp_ranks": [{"nvml_process_bytes": 11}]},
				{"dp_rank": 1, "nvml_process_bytes": 12, "tags": [{"reserved_bytes": 7}], "tp_ranks": [{"nvml_process_bytes": 13}]}]}`,
			[]int64{10, 11, 12, 13}, 12},
	} {
		var st memoryStats
		if err := json.Unmarshal([]byte(c.reply), &st); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		var got []int64
		for _, r := range st.ranks() {
			got = append(got, r.ProcessBytes)
		}
		if !slices.Equal(got, c.process) || st.reservedBytes() != c.reserved {
			t.Errorf("%s: processes %v, reserved %d; want %v, %d", c.name, got, st.reservedBytes(), c.process, c.reserved)
		}
	}
}
