// Command ebb is an LLM rollout engine for reinforcement learning: it serves
// a transformer, gives GPU memory back on request and takes it again.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	_ "ebb/cuda"
	_ "ebb/device/cpu"
)

func main() {
	root := &cobra.Command{
		Use:           "ebb",
		Short:         "ebb: an LLM rollout engine for RL, with SGLang's API",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(serveCmd(), childCmd(), trainerCmd(), generateCmd(), tokenizeCmd(), tinyModelCmd(), selftestCmd(), benchCmd(), kernelsCmd())
	if err := root.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "ebb:", err)
		os.Exit(1)
	}
}
