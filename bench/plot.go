package bench

import (
	"image/color"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// plotMemory draws GPU memory over the run: the scheduler process, the
// whole GPU, and what the trainer stand-in held (the rest). The y axis
// leaves a band above the data for the legend, so it never covers a line.
func plotMemory(rep *RLCycleReport, path string) error {
	p := plot.New()
	p.Title.Text = "ebb RL cycle: GPU memory (NVML)"
	p.X.Label.Text = "seconds"
	p.Y.Label.Text = "MiB"
	n := len(rep.Phases)
	server, device, trainer := make(plotter.XYs, n), make(plotter.XYs, n), make(plotter.XYs, n)
	top := 0.0
	for i, ph := range rep.Phases {
		server[i] = plotter.XY{X: ph.Seconds, Y: ph.ServerMiB}
		device[i] = plotter.XY{X: ph.Seconds, Y: ph.DeviceUsedMB}
		trainer[i] = plotter.XY{X: ph.Seconds, Y: max(ph.DeviceUsedMB-ph.ServerMiB, 0)}
		top = max(top, ph.DeviceUsedMB, ph.ServerMiB)
	}
	for _, s := range []struct {
		name string
		xy   plotter.XYs
		c    color.RGBA
	}{
		{"whole GPU", device, color.RGBA{R: 90, G: 90, B: 90, A: 255}},
		{"trainer stand-in (GPU minus ebb)", trainer, color.RGBA{R: 214, G: 96, B: 26, A: 255}},
		{"ebb scheduler process", server, color.RGBA{R: 31, G: 119, B: 180, A: 255}},
	} {
		l, err := plotter.NewLine(s.xy)
		if err != nil {
			return err
		}
		l.Color, l.Width = s.c, vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(s.name, l)
	}
	p.Y.Min, p.Y.Max = 0, top*1.3
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.XOffs, p.Legend.YOffs = vg.Points(8), -vg.Points(4)
	return p.Save(10*vg.Inch, 5*vg.Inch, path)
}
