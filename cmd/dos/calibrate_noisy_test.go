package main

import (
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestNoisyFits: dos calibrate warns of a CPU fit whose residual is over
// noisyResidual, naming the worst one, and says nothing of fits under it.
func TestNoisyFits(t *testing.T) {
	fit := func(threads int, r float64) perfmodel.CPUFit {
		f := perfmodel.CPUFit{Threads: threads, GradDType: adam.BF16}
		f.Residual = r
		return f
	}
	if msg := noisyFits([]perfmodel.CPUFit{fit(1, 0.03), fit(2, 0.15), fit(4, noisyResidual)}); msg != "" {
		t.Errorf("quiet fits: %q, want no warning", msg)
	}
	msg := noisyFits([]perfmodel.CPUFit{fit(1, 0.03), fit(2, 1.878), fit(4, 0.4)})
	if !strings.Contains(msg, "residual 188 % at 2 threads") || !strings.Contains(msg, "calibrate again on an idle machine") {
		t.Errorf("noisy fits: %q, want the 2 threads' 188 %% named and the advice", msg)
	}
}
