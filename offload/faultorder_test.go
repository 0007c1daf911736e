package offload

import (
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
)

// TestDownloadFaultThenLoad: a D2H of the resident state that fails after
// some copies were queued leaves none of them unordered: the load and the
// step after it never touch memory such a copy still uses (found by the
// adversarial review; the simulated device's ordering check caught it).
func TestDownloadFaultThenLoad(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 1 << 20, Threads: 2}
	opts, d := deviceOpts(base, perfmodel.Schedule{Resident: 1})
	o := newTest(t, opts)
	fill(o, 1)
	mustStep(t, o)
	good := t.TempDir()
	if _, err := o.SaveCheckpoint(checkpoint.OS, good, nil); err != nil {
		t.Fatal(err)
	}
	fill(o, 2)
	mustStep(t, o) // resident state now ahead on the device
	d.FailAfter(2) // the second of the resident subgroup's three D2H copies
	if _, err := o.Snapshot(nil); err == nil {
		t.Fatal("no fault")
	} else {
		t.Logf("Snapshot: %v", err)
	}
	d.FailAfter(0)
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, good); err != nil {
		t.Fatal(err)
	}
	fill(o, 2)
	_, err := o.Step(StepArgs{})
	t.Logf("Step after the load: %v", err)
	if err := d.OrderErr(); err != nil {
		t.Fatalf("ordering: %v", err)
	}
}
