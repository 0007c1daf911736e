package perfmodel

import (
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestCalibrateCPU: a quick calibration gives a usable fit per thread count
// and dtype, in a plausible range, and the progress callback counts every
// point (12, and 3 more for each series a busy machine made it measure
// again).
func TestCalibrateCPU(t *testing.T) {
	calls, last := 0, 0
	fits, err := CalibrateCPU(CPUOptions{Threads: []int{1, 2}, Sizes: []int{1 << 16, 1 << 19, 1 << 22}, Reps: 3, GradDTypes: []adam.DType{adam.F32, adam.BF16}},
		func(done, total int) {
			calls++
			if total < 12 || total%3 != 0 || done != calls || done > total {
				t.Errorf("progress %d/%d at call %d", done, total, calls)
			}
			last = total
		})
	if err != nil {
		t.Fatal(err)
	}
	if len(fits) != 4 || calls != last {
		t.Fatalf("%d fits, %d progress calls, last total %d", len(fits), calls, last)
	}
	p := &Profile{Format: ProfileFormat, Version: ProfileVersion, CPU: fits}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, f := range fits {
		if f.Rate < 1e6 || f.Rate > 1e12 {
			t.Errorf("%d threads %s: %g params/s is implausible", f.Threads, f.GradDType, f.Rate)
		}
	}
	if _, err := p.CPURate(8, adam.BF16); err != nil { // the largest measured count below 8
		t.Error(err)
	}
}

// TestFitSeriesMeasuresAgain: a series whose times fall with size (what a
// busy machine gave on the H200 when two test runs shared it) is measured
// again with twice the reps, and fits when a later measurement is sound;
// one that never fits fails after calibAttempts measurements, naming the
// part that did not fit and the attempts.
func TestFitSeriesMeasuresAgain(t *testing.T) {
	good := []Point{{1e6, 1e-3}, {2e6, 2e-3}, {4e6, 4e-3}}
	bad := []Point{{1e6, 3e-3}, {2e6, 2e-3}, {4e6, 1e-3}}
	var reps []int
	measure := func(badUntil int) func(int) ([]Point, []Point) {
		return func(r int) ([]Point, []Point) {
			reps = append(reps, r)
			if len(reps) <= badUntil {
				return good, bad // the step fits, the gradient checks do not
			}
			return good, good
		}
	}
	step, stats, err := fitSeries(measure(2), 3)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(reps, []int{3, 6, 12}) {
		t.Errorf("reps per measurement %v, want [3 6 12]", reps)
	}
	if math.Abs(step.Rate-1e9)/1e9 > 1e-9 || math.Abs(stats.Rate-1e9)/1e9 > 1e-9 {
		t.Errorf("rates %g, %g, want 1e9", step.Rate, stats.Rate)
	}
	reps = nil
	_, _, err = fitSeries(measure(calibAttempts), 5)
	if err == nil || len(reps) != calibAttempts {
		t.Fatalf("never fitting: %d measurements, err %v", len(reps), err)
	}
	for _, want := range []string{"gradient checks", "do not grow with size", "3 measurements", "20 reps"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	t.Log(err)
}
