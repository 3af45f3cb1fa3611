package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"ebb/cuda"
	"ebb/engine"
	"ebb/ioschema"
	"ebb/memory"
	"ebb/scheduler"
)

// residualCmd measures where GPU memory outside ebb's regions comes from:
// NVML at each stage of start-up, then after releasing every region.
func residualCmd() *cobra.Command {
	var cfg engine.Config
	cmd := &cobra.Command{
		Use:   "residual --model DIR",
		Short: "Break down the memory a released engine still holds (NVML at each start-up stage)",
		RunE: func(*cobra.Command, []string) error {
			type step struct {
				Step       string  `json:"step"`
				ProcessMiB float64 `json:"process_mib"`
				RegionsMiB float64 `json:"regions_mib"`
				OtherMiB   float64 `json:"outside_regions_mib"`
			}
			var steps []step
			var e *engine.Engine
			read := func(name string, mem *memory.Manager) {
				r, _ := cuda.DeviceUsage(cfg.GPU, os.Getpid())
				var reg int64
				if mem != nil {
					for _, s := range mem.Stats() {
						reg += s.Reserved
					}
				}
				st := step{name, float64(r.ProcessBytes) / (1 << 20), float64(reg) / (1 << 20), float64(r.ProcessBytes-reg) / (1 << 20)}
				steps = append(steps, st)
				fmt.Fprintf(os.Stderr, "%-36s process %9.1f MiB  regions %9.1f MiB  outside %7.1f MiB\n", st.Step, st.ProcessMiB, st.RegionsMiB, st.OtherMiB)
			}
			ctx, err := cuda.Open(cfg.GPU)
			if err != nil {
				return err
			}
			read("bare context", nil)
			ctx.Close()
			cfg.Device = "cuda"
			if e, err = engine.Open(cfg); err != nil {
				return err
			}
			defer e.Close()
			mem := e.Dev.Memory()
			read("engine open (graphs captured)", mem)
			zero, n := 0.0, 8
			params, _ := (&ioschema.SamplingParams{Temperature: &zero, MaxNewTokens: &n}).Resolve(nil)
			var reqs []scheduler.Request
			for i := 0; i < 4; i++ {
				ids := make([]int32, 100+50*i)
				for j := range ids {
					ids[j] = int32(1000 + 37*j + i)
				}
				reqs = append(reqs, scheduler.Request{Rid: fmt.Sprint(i), InputIDs: ids, Params: params, LogprobStartLen: -1})
			}
			if _, err := scheduler.Generate(e, reqs); err != nil {
				return err
			}
			read("after prefill and decode steps", mem)
			release := mem.Release(memory.AllTags)
			if err := release.Err(); err != nil {
				return err
			}
			read("all regions released", mem)
			dev := e.Dev.(*cuda.Device)
			limit, _ := dev.Context().StackLimit()
			fmt.Fprintf(os.Stderr, "stack limit %d bytes\n", limit)
			if err := dev.AfterRelease(memory.AllTags); err != nil {
				return err
			}
			read("after the release hook (stack 0)", mem)
			if err := e.Runner.ReleaseGraphs(); err != nil {
				return err
			}
			read("graphs destroyed", mem)
			return json.NewEncoder(os.Stdout).Encode(steps)
		},
	}
	addEngineFlags(cmd.Flags(), &cfg)
	return cmd
}
