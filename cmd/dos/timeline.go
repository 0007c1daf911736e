package main

import (
	"fmt"
	"image/color"
	"math"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
	"github.com/deepstates/dos/trainer"
)

// timelineRows are the resources of an update phase, bottom to top.
var timelineRows = []perfmodel.Resource{perfmodel.ResGPU, perfmodel.ResD2H, perfmodel.ResH2D, perfmodel.ResCPU}

// opColors colours each kind of operation.
var opColors = map[string]color.Color{
	"state H2D": color.RGBA{R: 31, G: 119, B: 180, A: 255},
	"copy H2D":  color.RGBA{R: 174, G: 199, B: 232, A: 255},
	"state D2H": color.RGBA{R: 255, G: 127, B: 14, A: 255},
	"grad D2H":  color.RGBA{R: 255, G: 187, B: 120, A: 255},
	"AdamW":     color.RGBA{R: 44, G: 160, B: 44, A: 255},
	"upcast":    color.RGBA{R: 152, G: 223, B: 138, A: 255},
	"CPU AdamW": color.RGBA{R: 214, G: 39, B: 40, A: 255},
	// Speculative updates during the backward (--speculate): kept, undone
	// (the step clipped or was skipped), and the undoing.
	scheduler.SpeculativeKept:    color.RGBA{R: 255, G: 152, B: 150, A: 255},
	scheduler.SpeculativeUndone:  color.RGBA{R: 140, G: 86, B: 75, A: 255},
	scheduler.SpeculativeRestore: color.RGBA{R: 23, G: 190, B: 207, A: 255},
	"forward":                    color.RGBA{R: 148, G: 103, B: 189, A: 255},
	trainer.NextForward:          color.RGBA{R: 188, G: 189, B: 34, A: 255},
	"backward":                   color.RGBA{R: 197, G: 176, B: 213, A: 255},
	"step":                       color.RGBA{R: 127, G: 127, B: 127, A: 255},
}

// iterationRows are an iteration's rows (dos train --timeline), bottom to
// top: the update phase's resources under the step and forward/backward.
var iterationRows = []perfmodel.Resource{perfmodel.ResGPU, perfmodel.ResD2H, perfmodel.ResH2D, perfmodel.ResCPU, trainer.ResHost, trainer.ResCompute}

// gantt is a plot.Plotter of operations as bars, one row per resource of
// rows.
type gantt struct {
	ops  []scheduler.Op
	rows []perfmodel.Resource
}

func (g gantt) row(r perfmodel.Resource) float64 {
	for i, x := range g.rows {
		if x == r {
			return float64(i)
		}
	}
	return -1
}

func (g gantt) Plot(c draw.Canvas, p *plot.Plot) {
	tx, ty := p.Transforms(&c)
	for _, o := range g.ops {
		y := g.row(o.Resource)
		x0, x1 := tx(o.Start.Seconds()*1e3), tx(o.End.Seconds()*1e3)
		if x1-x0 < 0.3 {
			x1 = x0 + 0.3 // a kernel of 0.7 ms still shows
		}
		rect := vg.Path{}
		rect.Move(vg.Point{X: x0, Y: ty(y - 0.35)})
		rect.Line(vg.Point{X: x1, Y: ty(y - 0.35)})
		rect.Line(vg.Point{X: x1, Y: ty(y + 0.35)})
		rect.Line(vg.Point{X: x0, Y: ty(y + 0.35)})
		rect.Close()
		c.SetColor(opColors[o.What])
		c.Fill(rect)
		c.SetLineWidth(vg.Points(0.3))
		c.SetColor(color.White)
		c.Stroke(rect)
	}
}

func (g gantt) DataRange() (xmin, xmax, ymin, ymax float64) {
	xmax = 0
	for _, o := range g.ops {
		xmax = math.Max(xmax, o.End.Seconds()*1e3)
	}
	return 0, xmax, -0.5, float64(len(g.rows)) - 0.5
}

// plotTimeline draws ops (Engine.Trace) as a timeline to path (.svg,
// .png or .pdf): one row per resource, one bar per operation, coloured by
// kind, with the summary's busy fractions in the row labels.
func plotTimeline(ops []scheduler.Op, title, path string) error {
	return plotGantt(gantt{ops, timelineRows}, title, "time from the start of the update phase (ms)",
		[]string{"state H2D", "copy H2D", "state D2H", "grad D2H", "AdamW", "upcast", "CPU AdamW"}, path)
}

// plotIteration draws one training iteration (trainer.IterationTimeline)
// to path as plotTimeline draws an update phase, with forward, backward
// and the step's rows above the phase's, and the GPU memory in use in the
// title.
func plotIteration(tl trainer.IterationTimeline, title, path string) error {
	if len(tl.Memory) > 0 {
		title += "\nGPU memory in use (GiB):"
		for i, c := range tl.Memory {
			title += fmt.Sprintf(" %s %.2f", [...]string{"start", "after forward", "after backward", "after the step"}[min(i, 3)], c.Value)
		}
	}
	return plotGantt(gantt{tl.Ops, iterationRows}, title, fmt.Sprintf("time from the start of iteration %d (ms)", tl.Iteration),
		[]string{"forward", "backward", trainer.NextForward, "step", "state H2D", "copy H2D", "state D2H", "grad D2H", "AdamW", "upcast", "CPU AdamW"}, path)
}

// plotGantt draws g with its rows labelled by their busy fractions and a
// legend of kinds.
func plotGantt(g gantt, title, xlabel string, kinds []string, path string) error {
	pl := plot.New()
	pl.Title.Text = title
	pl.X.Label.Text = xlabel
	s := scheduler.Summarize(g.ops)
	var ticks []plot.Tick
	for i, r := range g.rows {
		ticks = append(ticks, plot.Tick{Value: float64(i), Label: fmt.Sprintf("%s %.0f%%", r, 100*s.Fraction(r))})
	}
	pl.Y.Tick.Marker = plot.ConstantTicks(ticks)
	pl.Add(plotter.NewGrid(), g)
	pl.Legend.Top = true
	for _, what := range kinds {
		b, err := plotter.NewPolygon(plotter.XYs{{X: 0, Y: 0}})
		if err != nil {
			return err
		}
		b.Color = opColors[what]
		b.LineStyle.Width = 0
		pl.Legend.Add(what, b)
	}
	pl.Legend.Left = false
	if _, xmax, _, _ := g.DataRange(); xmax > 0 {
		pl.X.Max = 1.2 * xmax // room for the legend on the right
	}
	canvas, save, err := newCanvas(path, 11*vg.Inch, 4*vg.Inch)
	if err != nil {
		return err
	}
	pl.Draw(draw.New(canvas))
	return save()
}
