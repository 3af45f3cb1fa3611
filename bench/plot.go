package bench

import (
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// plotMemory draws the server's and the whole GPU's memory over the run.
func plotMemory(rep *RLCycleReport, path string) error {
	p := plot.New()
	p.Title.Text = "ebb RL cycle: GPU memory (NVML)"
	p.X.Label.Text = "seconds"
	p.Y.Label.Text = "MiB"
	server, device := make(plotter.XYs, len(rep.Phases)), make(plotter.XYs, len(rep.Phases))
	for i, ph := range rep.Phases {
		server[i] = plotter.XY{X: ph.Seconds, Y: ph.ServerMiB}
		device[i] = plotter.XY{X: ph.Seconds, Y: ph.DeviceUsedMB}
	}
	if err := plotutil.AddLinePoints(p, "ebb scheduler process", server, "whole GPU", device); err != nil {
		return err
	}
	return p.Save(10*vg.Inch, 5*vg.Inch, path)
}
