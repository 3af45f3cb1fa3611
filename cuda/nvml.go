package cuda

import (
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// NVMLReading is what NVML says about one GPU and this process.
type NVMLReading struct {
	TotalBytes   int64 `json:"total_bytes"`
	UsedBytes    int64 `json:"used_bytes"`
	FreeBytes    int64 `json:"free_bytes"`
	ProcessBytes int64 `json:"process_bytes"` // this process's use; -1 when NVML cannot tell
}

// NVML reads GPU memory through NVML, the driver's own accounting.
type NVML struct {
	dev nvml.Device
}

var (
	nvmlOnce sync.Once
	nvmlErr  error
)

// OpenNVML finds the NVML device with the context's PCI bus id.
func OpenNVML(c *Context) (*NVML, error) {
	nvmlOnce.Do(func() {
		if r := nvml.Init(); r != nvml.SUCCESS {
			nvmlErr = fmt.Errorf("nvml init: %s", nvml.ErrorString(r))
		}
	})
	if nvmlErr != nil {
		return nil, nvmlErr
	}
	d, r := nvml.DeviceGetHandleByPciBusId(c.PCIBusID)
	if r != nvml.SUCCESS {
		// NVML writes bus ids with 8 domain digits, CUDA with 4.
		d, r = nvml.DeviceGetHandleByPciBusId("0000" + c.PCIBusID)
	}
	if r != nvml.SUCCESS {
		d, r = nvml.DeviceGetHandleByIndex(c.Ordinal)
	}
	if r != nvml.SUCCESS {
		return nil, fmt.Errorf("nvml device %s: %s", c.PCIBusID, nvml.ErrorString(r))
	}
	return &NVML{dev: d}, nil
}

// Read takes a reading for this process.
func (n *NVML) Read() (NVMLReading, error) { return n.readFor(os.Getpid()) }

func (n *NVML) readFor(pid int) (NVMLReading, error) {
	mem, r := n.dev.GetMemoryInfo()
	if r != nvml.SUCCESS {
		return NVMLReading{}, fmt.Errorf("nvml memory info: %s", nvml.ErrorString(r))
	}
	out := NVMLReading{TotalBytes: int64(mem.Total), UsedBytes: int64(mem.Used), FreeBytes: int64(mem.Free), ProcessBytes: -1}
	procs, r := n.dev.GetComputeRunningProcesses()
	if r == nvml.SUCCESS {
		for _, p := range procs {
			if p.Pid == uint32(pid) {
				out.ProcessBytes = int64(p.UsedGpuMemory)
			}
		}
	}
	return out, nil
}

// String is a one-line summary.
func (r NVMLReading) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "used %d MiB of %d MiB", r.UsedBytes>>20, r.TotalBytes>>20)
	if r.ProcessBytes >= 0 {
		fmt.Fprintf(&b, ", this process %d MiB", r.ProcessBytes>>20)
	}
	return b.String()
}

// DeviceUsage reads, without a CUDA context, what NVML says about GPU index
// and process pid (ProcessBytes -1 when pid holds no memory there).
func DeviceUsage(index, pid int) (NVMLReading, error) {
	nvmlOnce.Do(func() {
		if r := nvml.Init(); r != nvml.SUCCESS {
			nvmlErr = fmt.Errorf("nvml init: %s", nvml.ErrorString(r))
		}
	})
	if nvmlErr != nil {
		return NVMLReading{}, nvmlErr
	}
	d, r := nvml.DeviceGetHandleByIndex(index)
	if r != nvml.SUCCESS {
		return NVMLReading{}, fmt.Errorf("nvml device %d: %s", index, nvml.ErrorString(r))
	}
	n := &NVML{dev: d}
	reading, err := n.readFor(pid)
	return reading, err
}

// PeakBandwidth is the memory's peak in bytes/s: two transfers per clock
// (DDR) at the maximum memory clock across the bus width.
func (n *NVML) PeakBandwidth() (float64, error) {
	clk, r := n.dev.GetMaxClockInfo(nvml.CLOCK_MEM)
	if r != nvml.SUCCESS {
		return 0, fmt.Errorf("nvml memory clock: %s", nvml.ErrorString(r))
	}
	bits, r := n.dev.GetMemoryBusWidth()
	if r != nvml.SUCCESS {
		return 0, fmt.Errorf("nvml bus width: %s", nvml.ErrorString(r))
	}
	return 2 * float64(clk) * 1e6 * float64(bits) / 8, nil
}

// PeakBandwidthOf is PeakBandwidth for the GPU NVML numbers ordinal,
// without a CUDA context (a benchmark client beside the server).
func PeakBandwidthOf(ordinal int) (float64, error) {
	nvmlOnce.Do(func() {
		if r := nvml.Init(); r != nvml.SUCCESS {
			nvmlErr = fmt.Errorf("nvml init: %s", nvml.ErrorString(r))
		}
	})
	if nvmlErr != nil {
		return 0, nvmlErr
	}
	d, r := nvml.DeviceGetHandleByIndex(ordinal)
	if r != nvml.SUCCESS {
		return 0, fmt.Errorf("nvml device %d: %s", ordinal, nvml.ErrorString(r))
	}
	return (&NVML{dev: d}).PeakBandwidth()
}
