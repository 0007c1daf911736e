package trainer

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/offload"
)

// TestGPUPlanIterationBitwise: a run on the GPU whose schedule moves
// after a step that kept speculative updates (planIteration, forced here:
// first to the schedule of a very long backward, then, with --replan, back
// to that of none), while the next forward runs beside the update phase
// and, with --speculate-leave, the speculation leaves every other CPU
// subgroup of the model's end to the phase, with blocks resident and
// streamed, has every step's loss and the final master weights of the
// serial run (no speculation, no overlapped forward, a fixed schedule)
// bit for bit.
func TestGPUPlanIterationBitwise(t *testing.T) {
	cfg, text := smallGPURun(t, 9)
	cfg.Recompute, cfg.DecaySteps, cfg.MaxGradNorm = true, 9, 0
	cfg.GPUBudget = 0.004 // a few of the 14 subgroups resident: the CPU has some to update
	run := func(c TrainConfig, work func(int, offload.IterationWork) offload.IterationWork) bitsRun {
		t.Helper()
		return runForBits(t, c, text, work)
	}
	for _, streamed := range []int{0, 2} {
		ref := cfg
		// The serial run's fixed schedule needs more than the 4 MiB budget
		// (which shapes the other runs' plans, not the numerics).
		ref.StreamBlocks, ref.NoOverlapForward, ref.GPUBudget = streamed, true, 0
		n := ref.subgroups()
		ref.Schedule = fmt.Sprintf("%d,%d,%d", n-2*(n/3), n/3, n/3)
		want := run(ref, nil)
		moved := 0 // runs whose schedule moved
		for _, leave := range []bool{true, false} {
			c := cfg
			c.StreamBlocks, c.Speculate, c.Replan, c.ResidentFirst, c.SpeculateLeave = streamed, 1, true, true, leave
			got := run(c, func(k int, w offload.IterationWork) offload.IterationWork {
				if k == 0 {
					w.Backward *= 1000 // every CPU update hidden: the CPU takes more
				} else {
					w.Backward = 0 // nothing hidden: the phase's own schedule again
				}
				return w
			})
			streamed := fmt.Sprintf("%d (leaving some to the phase: %v)", streamed, leave)
			if strings.Contains(got.log, "planned the update phase for the iteration") {
				moved++
			}
			if leave && !strings.Contains(got.log, "the speculation leaves") {
				t.Errorf("%s blocks streamed: nothing left to the phase:\n%s", streamed, got.log)
			}
			sameBits(t, streamed+" blocks streamed", got, want, cfg.Steps)
			t.Logf("%s blocks streamed: %d moves, losses %v", streamed, strings.Count(got.log, "planned the update phase for the iteration"), got.losses)
		}
		// Whether a run moves depends on the rates its start-up
		// calibration measured (on an H100 one of the four kept 0/8/3):
		// at least one of each pair must.
		if moved == 0 {
			t.Errorf("%d blocks streamed: the schedule never moved, with the leave or without", streamed)
		}
	}
}

// bitsRun is what runForBits returns: each step's loss (from --log-json),
// the steps' kept speculative parameters, the final master weights and
// the log.
type bitsRun struct {
	losses        []float64
	specGPU, spec int64 // the parameters kept from the GPU's and the CPU's speculative updates, all steps
	masters       map[string][]float32
	log           string
}

// runForBits trains c on text (with work as the trainer's planWork when
// not nil) and returns what the bitwise tests compare.
func runForBits(t *testing.T, c TrainConfig, text []byte, work func(int, offload.IterationWork) offload.IterationWork) bitsRun {
	t.Helper()
	c.LogJSON = filepath.Join(t.TempDir(), "steps.jsonl")
	var log strings.Builder
	tr, err := New(c, text, &log)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	tr.planWork = work
	if _, err := tr.Run(); err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	r := bitsRun{masters: map[string][]float32{}, log: log.String()}
	for _, p := range tr.opt.Params() {
		if r.masters[p.Name], err = tr.opt.MasterOf(p.Name); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(c.LogJSON)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var rec struct {
			Step          int      `json:"step"`
			Loss          *float64 `json:"loss"`
			Speculated    int64    `json:"speculated"`
			SpeculatedGPU int64    `json:"speculated_gpu"`
		}
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatal(err)
		}
		if rec.Loss != nil && rec.Step > 0 {
			r.losses = append(r.losses, *rec.Loss)
		}
		r.spec += rec.Speculated
		r.specGPU += rec.SpeculatedGPU
	}
	return r
}

// sameBits fails t unless got has want's losses and master weights bit
// for bit.
func sameBits(t *testing.T, what string, got, want bitsRun, steps int) {
	t.Helper()
	if len(got.losses) != steps || len(want.losses) != steps {
		t.Fatalf("%s: %d and %d losses, want %d", what, len(got.losses), len(want.losses), steps)
	}
	for i := range want.losses {
		if math.Float64bits(got.losses[i]) != math.Float64bits(want.losses[i]) {
			t.Fatalf("%s: step %d's loss %v, the serial run's %v\n%s", what, i+1, got.losses[i], want.losses[i], got.log)
		}
	}
	for name, x := range want.masters {
		for i := range x {
			if math.Float32bits(x[i]) != math.Float32bits(got.masters[name][i]) {
				t.Fatalf("%s: %s[%d] %v, the serial run's %v\n%s", what, name, i, got.masters[name][i], x[i], got.log)
			}
		}
	}
}
