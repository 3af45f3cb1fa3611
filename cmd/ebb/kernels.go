package main

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"ebb/cuda"
)

func kernelsCmd() *cobra.Command {
	var arch, match string
	var source, cache bool
	cmd := &cobra.Command{
		Use:   "kernels [--arch sm_90] [--match NAME] [--source] [--cache]",
		Short: "Compile the kernels with NVRTC and print each one's registers and local memory",
		Long: `Compiles ebb's kernels (with $EBB_KERNEL_DEFINES) for a real architecture
and prints, for each kernel, the registers a thread and the bytes of local
memory a thread (its stack frame: spilled registers and local arrays), as
cuobjdump -res-usage would. It needs NVRTC only, not a GPU: registers decide
how many blocks share an SM, so a kernel change's occupancy can be read before
it runs. NVRTC before 12.0 has no sm_90a, whose kernels (matmul_wg, moe_wg)
then compile to a stub; ptxas's choices also change between versions, so
compare figures from one NVRTC.

With --source it prints the translation unit it would compile instead, for
nvcc on the GPU machine, whose ptxas says more than NVRTC's log (spills by
kernel, and wgmma instructions it serialises, C7511 and C7515):

  ebb kernels --source >k.cu
  nvcc -arch=sm_90a -cubin -std=c++17 -DEBB_NVRTC=1 --resource-usage k.cu -o /dev/null

With --cache it compiles for --arch as an engine on that GPU would (sm_90
takes sm_90a where NVRTC has it) into the kernel cache engines load from
($EBB_KERNEL_CACHE), so that the runs after it start without compiling:
tools/ab.sh compiles its settings' kernels side by side this way.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			src, err := cuda.KernelSource()
			if err != nil {
				return err
			}
			if source {
				_, err := fmt.Print(src)
				return err
			}
			target := arch
			var cubin []byte
			if cache {
				target = cuda.EngineArch(arch)
				cubin, err = cuda.CompileCached(src, target)
			} else {
				cubin, err = cuda.Compile(src, "ebb_kernels.cu", arch)
			}
			if err != nil {
				return err
			}
			res, err := cuda.KernelResources(cubin)
			if err != nil {
				return err
			}
			major, minor, _ := cuda.NVRTCVersion()
			fmt.Printf("NVRTC %d.%d, %s\n", major, minor, target)
			fmt.Printf("%-44s %9s %11s %12s\n", "kernel", "registers", "local bytes", "shared bytes")
			for _, r := range res {
				if strings.Contains(r.Name, match) {
					fmt.Printf("%-44s %9d %11d %12d\n", r.Name, r.Registers, r.Frame, r.Shared)
				}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&arch, "arch", "sm_90", "real architecture to compile for (sm_80, sm_90, sm_90a with NVRTC 12 or later)")
	cmd.Flags().StringVar(&match, "match", "", "only kernels whose name contains this")
	cmd.Flags().BoolVar(&source, "source", false, "print the kernels' translation unit (EBB_KERNEL_DEFINES applied) instead of compiling it")
	cmd.Flags().BoolVar(&cache, "cache", false, "compile as an engine on --arch would, into the kernel cache engines load from")
	return cmd
}
