package perfmodel

import (
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestCalibrateCPU: a quick calibration gives a usable fit per thread count
// and dtype, in a plausible range, and the progress callback counts every
// point.
func TestCalibrateCPU(t *testing.T) {
	calls := 0
	fits, err := CalibrateCPU(CPUOptions{Threads: []int{1, 2}, Sizes: []int{1 << 16, 1 << 19, 1 << 22}, Reps: 3, GradDTypes: []adam.DType{adam.F32, adam.BF16}},
		func(done, total int) {
			calls++
			if total != 12 || done != calls {
				t.Errorf("progress %d/%d at call %d", done, total, calls)
			}
		})
	if err != nil {
		t.Fatal(err)
	}
	if len(fits) != 4 || calls != 12 {
		t.Fatalf("%d fits, %d progress calls", len(fits), calls)
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
