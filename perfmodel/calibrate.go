package perfmodel

import (
	"fmt"
	"runtime"
	"slices"
	"time"

	"github.com/klauspost/cpuid/v2"

	"github.com/deepstates/dos/adam"
)

// CPUOptions sets what CalibrateCPU measures.
type CPUOptions struct {
	// Threads are the pool sizes to measure (default 1, 2, 4, ... up to
	// GOMAXPROCS, and GOMAXPROCS itself).
	Threads []int
	// Sizes are the subgroup sizes in parameters (default: 1, 2 and 4 times
	// the larger of 8M and the parameters whose 28 B/param of traffic fill
	// the last-level cache twice, at most 16M: real subgroups never fit in a cache, and a
	// point that does would make the CPU look faster than it is).
	Sizes []int
	// Reps is the number of timed steps per point, after one warm-up; the
	// median is kept (default 5).
	Reps int
	// GradDTypes (default F32 and BF16).
	GradDTypes []adam.DType
}

// CPUSizes returns k subgroup sizes in parameters from the default base
// (the larger of 8M and the parameters whose 28 B/param fill the
// last-level cache twice, at most 16M: real subgroups never fit in a
// cache) to four times it, evenly spaced; k >= 2.
func CPUSizes(k int) []int {
	base := min(max(8<<20, 2*cpuid.CPU.Cache.L3/28), 16<<20)
	sizes := make([]int, max(k, 2))
	for i := range sizes {
		sizes[i] = base + 3*base*i/(len(sizes)-1)
	}
	return sizes
}

func (o *CPUOptions) defaults() {
	if len(o.Threads) == 0 {
		max := runtime.GOMAXPROCS(0)
		for t := 1; t < max; t *= 2 {
			o.Threads = append(o.Threads, t)
		}
		o.Threads = append(o.Threads, max)
	}
	if len(o.Sizes) == 0 {
		base := CPUSizes(2)[0]
		o.Sizes = []int{base, 2 * base, 4 * base}
	}
	if o.Reps <= 0 {
		o.Reps = 5
	}
	if len(o.GradDTypes) == 0 {
		o.GradDTypes = []adam.DType{adam.F32, adam.BF16}
	}
}

// CalibrateCPU measures the CPU pool's AdamW work on a subgroup as the
// optimizer does it (adam.Pool on the default SIMD path: GradStats, then
// Step writing a bf16 working copy, timed apart: CPUFit's Fit is the step,
// its Stats the checks)
// for every thread count, gradient dtype and size, and fits each (threads,
// dtype) series: time = latency + params/Uc. progress, when not nil, is
// called after every point with the points done and the total.
//
// A series whose times do not grow with size (the machine was busy with
// other work while it was measured) is measured again, up to
// calibAttempts times in all, with twice the reps each time.
//
// Errors: a series that does not fit after calibAttempts measurements.
func CalibrateCPU(opts CPUOptions, progress func(done, total int)) ([]CPUFit, error) {
	opts.defaults()
	if slices.Min(opts.Sizes) <= 0 || len(slices.Compact(slices.Sorted(slices.Values(opts.Sizes)))) < 2 {
		return nil, fmt.Errorf("perfmodel: CPU calibration sizes %v: want at least two distinct sizes > 0", opts.Sizes)
	}
	if slices.Min(opts.Threads) < 1 || len(slices.Compact(slices.Sorted(slices.Values(opts.Threads)))) != len(opts.Threads) {
		return nil, fmt.Errorf("perfmodel: CPU calibration threads %v: want distinct counts >= 1", opts.Threads)
	}
	for _, d := range opts.GradDTypes {
		if _, err := gradBytes(d); err != nil {
			return nil, fmt.Errorf("perfmodel: CPU calibration: %w", err)
		}
	}
	maxN := slices.Max(opts.Sizes)
	var mem hostArrays // the memory the engine's CPU workers update is mapped so
	defer mem.free()
	s := adam.State{Param: mem.f32(maxN), ExpAvg: mem.f32(maxN), ExpAvgSq: mem.f32(maxN)}
	g32, g16 := mem.f32(maxN), mem.u16(maxN)
	out := adam.Copy16{DType: adam.BF16, Data: mem.u16(maxN)}
	if mem.err != nil {
		return nil, fmt.Errorf("perfmodel: CPU calibration: %w", mem.err)
	}
	for i := range s.Param {
		s.Param[i] = float32(i%1000) * 1e-3
	}
	for i := range g32 {
		g32[i] = float32(i%777) * 1e-5
		g16[i] = adam.F32ToBF16(g32[i])
	}
	// A clip factor below 1 takes the staged path (gradient scaled per
	// block), the usual one in training with clipping or loss scaling and
	// the slower one for fp32 gradients.
	c := adam.DefaultHyper().Coeffs(1, 1, 0.9)
	total := len(opts.Threads) * len(opts.GradDTypes) * len(opts.Sizes)
	done := 0
	var fits []CPUFit
	for _, th := range opts.Threads {
		pool := adam.NewPool(th)
		for _, d := range opts.GradDTypes {
			calls := 0
			measure := func(reps int) (pts, spts []Point) {
				if calls++; calls > 1 {
					total += len(opts.Sizes) // a series measured again
				}
				for _, n := range opts.Sizes {
					g := adam.GradF32(g32[:n])
					if d != adam.F32 {
						g = adam.Grad16(d, g16[:n])
					}
					st, o := s.Slice(0, n), out.Slice(0, n)
					// The optimizer's CPU work per subgroup, each part timed:
					// the one-pass non-finite check and sum of squares (when
					// the gradients are on the host), then the step.
					pool.GradStats(g, 1) // warm-up
					pool.Step(&c, st, g, o)
					times := make([]float64, reps)
					stimes := make([]float64, reps)
					for r := range times {
						t0 := time.Now()
						pool.GradStats(g, 1)
						t1 := time.Now()
						pool.Step(&c, st, g, o)
						stimes[r], times[r] = t1.Sub(t0).Seconds(), time.Since(t1).Seconds()
					}
					slices.Sort(times)
					slices.Sort(stimes)
					pts = append(pts, Point{Size: float64(n), Seconds: times[len(times)/2]})
					spts = append(spts, Point{Size: float64(n), Seconds: stimes[len(stimes)/2]})
					done++
					if progress != nil {
						progress(done, total)
					}
				}
				return pts, spts
			}
			f, sf, err := fitSeries(measure, opts.Reps)
			if err != nil {
				pool.Close()
				return nil, fmt.Errorf("perfmodel: CPU at %d threads, %v gradients: %w", th, d, err)
			}
			fits = append(fits, CPUFit{Threads: th, GradDType: d, Fit: f, Stats: sf})
		}
		pool.Close()
	}
	return fits, nil
}

// calibAttempts is how many times CalibrateCPU measures one series before
// it gives up on a fit.
const calibAttempts = 3

// fitSeries fits the step times and the gradient-check times that measure
// returns (measure(reps): one point per size, each the median of reps
// timings). When either fit fails (noise from other work on the machine
// can make a larger size look faster) it measures again with twice the
// reps, up to calibAttempts times in all.
//
// Errors: the last attempt's fit error, naming the part (the step or the
// gradient checks) and the attempts made.
func fitSeries(measure func(reps int) (pts, spts []Point), reps int) (step, stats Fit, err error) {
	for a := 1; ; a++ {
		pts, spts := measure(reps)
		step, err = FitPoints(pts)
		if err == nil {
			stats, err = FitPoints(spts)
			if err == nil {
				return step, stats, nil
			}
			err = fmt.Errorf("gradient checks: %w", err)
		} else {
			err = fmt.Errorf("step: %w", err)
		}
		if a == calibAttempts {
			return Fit{}, Fit{}, fmt.Errorf("%w, in each of %d measurements (up to %d reps a point): is other work loading this machine's CPUs?", err, a, reps)
		}
		reps *= 2
	}
}
