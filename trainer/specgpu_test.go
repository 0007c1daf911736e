package trainer

import (
	"fmt"
	"testing"
)

// TestGPUSpeculateGPUBitwise: with --speculate-gpu the streamed GPU
// subgroups are speculated on during the backward as well (their state
// H2D, the kernel and the new state D2H on the GPU), beside the CPU's
// speculation and the next forward over the update phase. With clipping
// never active, active at some steps (a bound the norm crosses) and at
// every step (a tiny bound), with blocks resident and streamed, every
// step's loss and the final master weights are those of the serial run
// (no speculation, no overlapped forward, the same fixed schedule) bit
// for bit; without clipping some of the GPU's speculative updates were
// kept, and with clipping at every step none of either lane's.
func TestGPUSpeculateGPUBitwise(t *testing.T) {
	cfg, text := smallGPURun(t, 8)
	cfg.Recompute, cfg.DecaySteps = true, 8
	for _, streamed := range []int{0, 2} {
		for _, clip := range []float64{0, 0.5, 1e-9} {
			ref := cfg
			ref.StreamBlocks, ref.MaxGradNorm, ref.NoOverlapForward = streamed, clip, true
			n := ref.subgroups()
			ref.Schedule = fmt.Sprintf("%d,%d,%d", n/3, n-2*(n/3), n/3) // most streamed on the GPU
			want := runForBits(t, ref, text, nil)
			c := ref
			c.NoOverlapForward, c.ResidentFirst = false, true
			c.Speculate, c.SpeculateGPU = 1, true
			got := runForBits(t, c, text, nil)
			what := fmt.Sprintf("%d blocks streamed, --clip %g, --schedule %s", streamed, clip, ref.Schedule)
			sameBits(t, what, got, want, cfg.Steps)
			switch {
			case clip == 0 && got.specGPU == 0:
				t.Errorf("%s: no speculative update of the GPU kept in %d steps\n%s", what, cfg.Steps, got.log)
			case clip == 1e-9 && got.specGPU+got.spec != 0:
				t.Errorf("%s: clipping at every step, yet %d+%d speculated parameters kept", what, got.spec, got.specGPU)
			}
			t.Logf("%s: kept %d parameters of the CPU's and %d of the GPU's speculative updates; losses %v", what, got.spec, got.specGPU, got.losses)
		}
	}
}
