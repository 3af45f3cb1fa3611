package bench

import (
	"fmt"
	"image/color"
	"os"
	"sort"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
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

// plotServing draws the serving run: output tokens/s over time above, and
// the latency distributions (TTFT when streamed, end-to-end) below.
func plotServing(rep *ServingReport, results []requestResult, path string) error {
	tp := plot.New()
	tp.Title.Text = fmt.Sprintf("%s workload, %d requests, temperature %g: %.0f output tok/s", rep.Workload.Kind,
		rep.Completed, rep.Temperature, rep.OutputTokPerS)
	tp.X.Label.Text = "seconds"
	tp.Y.Label.Text = "output tokens/s"
	series := make(plotter.XYs, len(rep.ThroughputSeries))
	for i, p := range rep.ThroughputSeries {
		series[i] = plotter.XY{X: p.X, Y: p.Y}
	}
	l, err := plotter.NewLine(series)
	if err != nil {
		return err
	}
	l.Color, l.Width = color.RGBA{R: 31, G: 119, B: 180, A: 255}, vg.Points(1.5)
	tp.Add(l)
	if rep.FloorTokPerS > 0 {
		floor, err := plotter.NewLine(plotter.XYs{{X: 0, Y: rep.FloorTokPerS}, {X: rep.DurationS, Y: rep.FloorTokPerS}})
		if err != nil {
			return err
		}
		floor.Color, floor.Dashes = color.RGBA{R: 150, G: 150, B: 150, A: 255}, []vg.Length{vg.Points(4), vg.Points(3)}
		tp.Add(floor)
		tp.Legend.Add("bandwidth floor", floor)
	}
	tp.X.Min, tp.Y.Min = 0, 0
	// Headroom above the floor and the peak keeps the legend (top right,
	// where the throughput has fallen) off the data.
	top := rep.FloorTokPerS
	for _, p := range rep.ThroughputSeries {
		top = max(top, p.Y)
	}
	tp.Y.Max = 1.2 * top
	tp.Legend.Top = true

	lp := plot.New()
	lp.Title.Text = "latency distribution"
	lp.X.Label.Text = "ms"
	lp.Y.Label.Text = "fraction of requests"
	var ttft, e2e []float64
	for _, r := range results {
		if r.Err != nil {
			continue
		}
		e2e = append(e2e, 1000*(r.Done-r.Sent))
		if r.First >= 0 {
			ttft = append(ttft, 1000*(r.First-r.Sent))
		}
	}
	for _, s := range []struct {
		name string
		v    []float64
		c    color.RGBA
	}{{"time to first token", ttft, color.RGBA{R: 214, G: 96, B: 26, A: 255}}, {"end to end", e2e, color.RGBA{R: 31, G: 119, B: 180, A: 255}}} {
		if len(s.v) == 0 {
			continue
		}
		sort.Float64s(s.v)
		xy := make(plotter.XYs, len(s.v))
		for i, v := range s.v {
			xy[i] = plotter.XY{X: v, Y: float64(i+1) / float64(len(s.v))}
		}
		l, err := plotter.NewLine(xy)
		if err != nil {
			return err
		}
		l.Color, l.Width = s.c, vg.Points(1.5)
		lp.Add(l)
		lp.Legend.Add(s.name, l)
	}
	lp.X.Min, lp.Y.Min, lp.Y.Max = 0, 0, 1
	lp.Legend.Top = false
	lp.Legend.Left = false

	img := vgimg.New(10*vg.Inch, 8*vg.Inch)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadX: vg.Millimeter, PadY: 4 * vg.Millimeter, PadTop: 2 * vg.Millimeter, PadBottom: 2 * vg.Millimeter}
	canvases := plot.Align([][]*plot.Plot{{tp}, {lp}}, tiles, dc)
	tp.Draw(canvases[0][0])
	lp.Draw(canvases[1][0])
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
