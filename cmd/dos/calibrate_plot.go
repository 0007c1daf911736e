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
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgpdf"
	"gonum.org/v1/plot/vg/vgsvg"

	"github.com/deepstates/dos/perfmodel"
)

// series is one fit to draw: its points and its line.
type series struct {
	label string
	fit   perfmodel.Fit
}

// panel draws series as measured points and fitted lines time = latency +
// size/rate, time in milliseconds against size/unit.
func panel(title, xlabel string, unit float64, ss []series) (*plot.Plot, error) {
	pl := plot.New()
	pl.Title.Text = title
	pl.X.Label.Text = xlabel
	pl.Y.Label.Text = "time (ms)"
	pl.Legend.Top, pl.Legend.Left = true, true
	for i, s := range ss {
		col := plotutil.Color(i)
		pts := make(plotter.XYs, len(s.fit.Points))
		maxX := 0.0
		for j, q := range s.fit.Points {
			pts[j] = plotter.XY{X: q.Size / unit, Y: q.Seconds * 1e3}
			maxX = max(maxX, q.Size)
		}
		sc, err := plotter.NewScatter(pts)
		if err != nil {
			return nil, err
		}
		sc.GlyphStyle.Color = col
		sc.GlyphStyle.Shape = plotutil.Shape(i)
		f := s.fit
		line := plotter.NewFunction(func(x float64) float64 { return (f.LatencyS + x*unit/f.Rate) * 1e3 })
		line.XMin, line.XMax = 0, maxX/unit
		line.Color = col
		line.Width = vg.Points(1)
		pl.Add(sc, line)
		pl.Legend.Add(s.label, sc, line)
	}
	pl.Add(plotter.NewGrid())
	pl.X.Min, pl.Y.Min = 0, 0 // the latency is the fitted line's intercept
	return pl, nil
}

// plotProfile draws every fit of p, one panel per resource: the CPU update
// (against millions of parameters), and with a GPU the GPU kernels
// (millions of parameters or elements) and the PCIe copies (MiB). The
// format follows path's extension (.svg, .png, .pdf).
func plotProfile(p *perfmodel.Profile, path string) error {
	if err := checkPlotPath(path); err != nil {
		return err
	}
	var cpu []series
	for _, c := range p.CPU {
		cpu = append(cpu, series{fmt.Sprintf("threads=%d, %s: %.2f Gparam/s", c.Threads, c.GradDType, c.Rate/1e9), c.Fit})
	}
	pl, err := panel(fmt.Sprintf("dos calibrate: %s, CPU AdamW update", p.Machine.CPU), "subgroup (million parameters)", 1e6, cpu)
	if err != nil {
		return err
	}
	plots := []*plot.Plot{pl}
	if g := p.GPU; g != nil {
		kern, err := panel(fmt.Sprintf("%s: kernels", p.Machine.GPU), "size (million parameters or elements)", 1e6, []series{
			{fmt.Sprintf("fused AdamW: %.1f Gparam/s", g.Update.Rate/1e9), g.Update},
			{fmt.Sprintf("bf16 cast: %.1f Gelem/s", g.Convert.Rate/1e9), g.Convert}})
		if err != nil {
			return err
		}
		pcie, err := panel(fmt.Sprintf("%s: pinned copies", p.Machine.GPU), "size (MiB)", 1<<20, []series{
			{fmt.Sprintf("H2D: %.1f GB/s", g.H2D.Rate/1e9), g.H2D}, {fmt.Sprintf("D2H: %.1f GB/s", g.D2H.Rate/1e9), g.D2H},
			{fmt.Sprintf("H2D with D2H: %.1f GB/s", g.H2DBoth.Rate/1e9), g.H2DBoth}, {fmt.Sprintf("D2H with H2D: %.1f GB/s", g.D2HBoth.Rate/1e9), g.D2HBoth}})
		if err != nil {
			return err
		}
		plots = append(plots, kern, pcie)
	}
	w, h := 8*vg.Inch, 5*vg.Inch*vg.Length(len(plots))
	canvas, save, err := newCanvas(path, w, h)
	if err != nil {
		return err
	}
	tiles := draw.Tiles{Rows: len(plots), Cols: 1, PadX: vg.Millimeter, PadY: 3 * vg.Millimeter}
	grid := make([][]*plot.Plot, len(plots))
	for i, q := range plots {
		grid[i] = []*plot.Plot{q}
	}
	dc := draw.New(canvas)
	for i, cs := range plot.Align(grid, tiles, dc) {
		grid[i][0].Draw(cs[0])
	}
	return save()
}

// newCanvas returns a canvas of the format path names and the function
// that writes it there.
func newCanvas(path string, w, h vg.Length) (vg.CanvasSizer, func() error, error) {
	var c vg.CanvasSizer
	var to func(f *os.File) error
	switch strings.ToLower(filepath.Ext(path)) {
	case ".svg":
		s := vgsvg.New(w, h)
		c, to = s, func(f *os.File) error { _, err := s.WriteTo(f); return err }
	case ".pdf":
		s := vgpdf.New(w, h)
		c, to = s, func(f *os.File) error { _, err := s.WriteTo(f); return err }
	default:
		s := vgimg.New(w, h)
		png := vgimg.PngCanvas{Canvas: s}
		c, to = s, func(f *os.File) error { _, err := png.WriteTo(f); return err }
	}
	return c, func() error { return writeAtomic(path, to) }, nil
}

// checkPlotExt refuses a plot path whose extension names no format this
// command draws: a usage error.
func checkPlotExt(path string) error {
	switch strings.ToLower(filepath.Ext(path)) {
	case ".svg", ".png", ".pdf":
		return nil
	}
	return fmt.Errorf("%s: want a .svg, .png or .pdf file", path)
}

// checkPlotPath refuses, before anything is measured, a plot path whose
// extension names no format (checkPlotExt), whose directory is missing, or
// that is a directory. Its errors start with the path; callers put the
// flag's name before it.
func checkPlotPath(path string) error {
	if err := checkPlotExt(path); err != nil {
		return err
	}
	if st, err := os.Stat(filepath.Dir(path)); err != nil || !st.IsDir() {
		return fmt.Errorf("%s: no directory %s", path, filepath.Dir(path))
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return fmt.Errorf("%s is a directory", path)
	}
	return nil
}
