package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/deepstates/dos/perfmodel"
)

// plotProfile draws every fit of p: its measured points and its fitted line
// time = latency + size/rate, time in milliseconds against size in millions
// of parameters, one colour per series. The format follows path's
// extension (.svg, .png, .pdf).
func plotProfile(p *perfmodel.Profile, path string) error {
	if err := checkPlotPath(path); err != nil {
		return err
	}
	pl := plot.New()
	pl.Title.Text = fmt.Sprintf("dos calibrate: %s, CPU AdamW update", p.Machine.CPU)
	pl.X.Label.Text = "subgroup (million parameters)"
	pl.Y.Label.Text = "time (ms)"
	pl.Legend.Top = true
	pl.Legend.Left = true
	for i, c := range p.CPU {
		col := plotutil.Color(i)
		pts := make(plotter.XYs, len(c.Points))
		maxX := 0.0
		for j, q := range c.Points {
			pts[j] = plotter.XY{X: q.Size / 1e6, Y: q.Seconds * 1e3}
			maxX = max(maxX, q.Size)
		}
		sc, err := plotter.NewScatter(pts)
		if err != nil {
			return err
		}
		sc.GlyphStyle.Color = col
		sc.GlyphStyle.Shape = plotutil.Shape(i)
		f := c.Fit
		line := plotter.NewFunction(func(x float64) float64 { return (f.LatencyS + x*1e6/f.Rate) * 1e3 })
		line.XMin, line.XMax = 0, maxX/1e6
		line.Color = col
		line.Width = vg.Points(1)
		pl.Add(sc, line)
		pl.Legend.Add(fmt.Sprintf("threads=%d, %s: %.2f Gparam/s", c.Threads, c.GradDType, c.Rate/1e9), sc, line)
	}
	pl.Add(plotter.NewGrid())
	pl.X.Min, pl.Y.Min = 0, 0 // the latency is the fitted line's intercept
	return pl.Save(8*vg.Inch, 5*vg.Inch, path)
}

// checkPlotPath refuses, before anything is measured, a plot path whose
// format is unknown or whose directory does not exist.
func checkPlotPath(path string) error {
	switch strings.ToLower(filepath.Ext(path)) {
	case ".svg", ".png", ".pdf":
	default:
		return fmt.Errorf("--plot %s: want a .svg, .png or .pdf file", path)
	}
	if st, err := os.Stat(filepath.Dir(path)); err != nil || !st.IsDir() {
		return fmt.Errorf("--plot %s: no directory %s", path, filepath.Dir(path))
	}
	return nil
}
