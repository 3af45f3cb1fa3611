package main

import (
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"

	"ebb/cuda"
)

func selftestCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "selftest", Short: "Check the GPU layers on this machine"}
	var opts cuda.MemoryTestOptions
	mem := &cobra.Command{
		Use:   "memory",
		Short: "Release and resume tagged GPU memory regions, with NVML readings (JSON report)",
		RunE: func(*cobra.Command, []string) error {
			opts.Log = func(s string) { fmt.Fprintln(os.Stderr, s) }
			rep, err := cuda.SelfTestMemory(opts)
			if err != nil {
				return err
			}
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			if err := enc.Encode(rep); err != nil {
				return err
			}
			if len(rep.Errors) > 0 {
				return fmt.Errorf("%d checks failed", len(rep.Errors))
			}
			return nil
		},
	}
	mem.Flags().IntVar(&opts.KVGiB, "gib", 32, "size of the kv_cache region (released without backup)")
	mem.Flags().IntVar(&opts.WeightsGiB, "weights-gib", 1, "size of the weights region (released with CPU backup)")
	mem.Flags().IntVar(&opts.Cycles, "cycles", 1000, "full release/resume cycles for the drift check")
	mem.Flags().IntVar(&opts.IdleCycles, "idle-cycles", 10, "kv_cache cycles with the GPU idle between release and resume")
	mem.Flags().DurationVar(&opts.Idle, "idle", 500*time.Millisecond, "idle time between release and resume in those cycles")
	var probeGiB int
	var probeIdle time.Duration
	probe := &cobra.Command{
		Use:   "vmm-probe",
		Short: "Time mapping one range in chunks of several sizes, back to back and after idle (JSON)",
		RunE: func(*cobra.Command, []string) error {
			ctx, err := cuda.Open(0)
			if err != nil {
				return err
			}
			defer ctx.Close()
			total := int64(probeGiB) << 30
			res, err := cuda.ProbeChunks(ctx, total, []int64{total, 4 << 30, 1 << 30, 256 << 20}, 6, probeIdle)
			if err != nil {
				return err
			}
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", " ")
			return enc.Encode(res)
		},
	}
	probe.Flags().IntVar(&probeGiB, "gib", 32, "range size")
	probe.Flags().DurationVar(&probeIdle, "idle", 500*time.Millisecond, "idle wait")
	cmd.AddCommand(mem, probe, residualCmd())
	return cmd
}
