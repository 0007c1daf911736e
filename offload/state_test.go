package offload

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// refusingDevice is the simulated device whose allocations can be refused,
// as a device whose memory is taken.
type refusingDevice struct {
	*scheduler.Sim
	refuse atomic.Bool
}

var errRefused = errors.New("device memory refused")

func (d *refusingDevice) Alloc(n int64) (scheduler.Mem, error) {
	if d.refuse.Load() {
		return nil, errRefused
	}
	return d.Sim.Alloc(n)
}

func (d *refusingDevice) AllocHost(n int64) (scheduler.Host, error) {
	if d.refuse.Load() {
		return nil, errRefused
	}
	return d.Sim.AllocHost(n)
}

// TestLoadAfterFaultWithoutMemory: after a device fault breaks the
// optimizer, a LoadCheckpoint whose new engine the device refuses leaves
// it broken, never panicking: every call says so, and a later
// LoadCheckpoint recovers, bit for bit.
func TestLoadAfterFaultWithoutMemory(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2}
	opts, sim := deviceOpts(base, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2})
	d := &refusingDevice{Sim: sim}
	opts.Device = d
	o := newTest(t, opts)
	good := t.TempDir()
	for step := int64(1); step <= 2; step++ {
		fill(o, step)
		mustStep(t, o)
	}
	if _, err := o.SaveCheckpoint(checkpoint.OS, good, nil); err != nil {
		t.Fatal(err)
	}
	for k := 1; o.dev != devBroken; k++ {
		if k > 50 {
			t.Fatal("no fault broke the optimizer")
		}
		sim.FailSync(k)
		fill(o, 3)
		o.Step(StepArgs{})
	}
	sim.FailSync(0)
	d.refuse.Store(true)
	for range 2 {
		if _, _, err := o.LoadCheckpoint(checkpoint.OS, good); !errors.Is(err, errRefused) || !strings.Contains(err.Error(), "still broken") {
			t.Fatalf("LoadCheckpoint without device memory: %v", err)
		}
	}
	if _, err := o.Step(StepArgs{}); !errors.Is(err, scheduler.ErrBroken) {
		t.Errorf("Step: %v", err)
	}
	if _, err := o.Master(0); !errors.Is(err, scheduler.ErrBroken) {
		t.Errorf("Master: %v", err)
	}
	if err := o.SetParam(o.Params()[0].Name, make([]float32, o.Params()[0].Len)); !errors.Is(err, scheduler.ErrBroken) {
		t.Errorf("SetParam: %v", err)
	}
	if _, err := o.SaveCheckpoint(checkpoint.OS, t.TempDir(), nil); !errors.Is(err, scheduler.ErrBroken) {
		t.Errorf("SaveCheckpoint: %v", err)
	}
	d.refuse.Store(false)
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, good); err != nil {
		t.Fatalf("LoadCheckpoint with memory again: %v", err)
	}
	fill(o, 3)
	mustStep(t, o)
	want := newTest(t, base)
	for step := int64(1); step <= 3; step++ {
		fill(want, step)
		mustStep(t, want)
	}
	sameState(t, want, synced(t, o))
}
