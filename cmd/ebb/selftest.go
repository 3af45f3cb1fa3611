package main

import (
	"encoding/json"
	"fmt"
	"os"

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
	cmd.AddCommand(mem)
	return cmd
}
