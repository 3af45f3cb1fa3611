package cpu

import "ebb/device"

// cpuGraph emulates a CUDA graph: replay runs the recorded operations again
// on the same tensors, so CI exercises the static-buffer logic that real
// graphs rely on.
type cpuGraph struct{ record func() }

func (g cpuGraph) Replay() error  { g.record(); return nil }
func (g cpuGraph) Destroy() error { return nil }

// CaptureGraph implements device.GraphCapturer.
func (d *Device) CaptureGraph(record func()) (device.Graph, error) {
	return cpuGraph{record}, nil
}
