package trainer

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestOverlapForwardBitwise: the next iteration's forward run during the
// update phase (the default) and run after it (NoOverlapForward) give the
// same loss and gradient norm at every step and the same validation loss,
// on the host and on the simulated device, with an evaluation and a
// checkpoint in between (no overlap at those iterations: the batch order
// and the saved data position are the serial run's), and an overlapped
// run's checkpoint resumed continues the same trajectory; on the
// simulated device the resident subgroups first (ResidentFirst) too.
func TestOverlapForwardBitwise(t *testing.T) {
	setMemAvailable(t, 0, false)
	toks := make([]uint16, 6000)
	for i := range toks {
		toks[i] = uint16((i*7 + i/13) % 256)
	}
	for _, dev := range []string{"", "sim"} {
		c := DefaultTrainConfig()
		serialSchedule(&c) // the resident subgroups last; f below puts them first
		c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 2, 32, 2, 16
		c.Batch, c.Steps, c.SampleBytes, c.EvalBatches, c.LogEvery = 4, 8, 0, 1, 0
		c.EvalEvery, c.CkptEvery = 3, 5
		c.Device, c.MaxGradNorm = dev, 0.5
		if dev == "sim" {
			c.WorkingDType, c.GradDType, c.SubgroupSize = adam.BF16, adam.BF16, 1000
		}
		serial := c
		serial.NoOverlapForward = true
		serial.CkptDir = t.TempDir()
		want, wsum := zeroRun(t, serial, 1, toks)
		c.CkptDir = t.TempDir()
		got, gsum := zeroRun(t, c, 1, toks)
		if len(got) != len(want) || len(want) != c.Steps {
			t.Fatalf("device %q: %d and %d steps logged, want %d", dev, len(got), len(want), c.Steps)
		}
		for i := range want {
			if got[i] != want[i] {
				t.Errorf("device %q step %d: loss, norm %v with the forward over the update; %v after it", dev, i+1, got[i], want[i])
			}
		}
		if gsum.ValLoss != wsum.ValLoss || gsum.FinalLoss != wsum.FinalLoss {
			t.Errorf("device %q: final and validation loss %v %v overlapped, %v %v serial", dev, gsum.FinalLoss, gsum.ValLoss, wsum.FinalLoss, wsum.ValLoss)
		}
		if dev == "sim" { // the resident subgroups first (--resident-first): the same trajectory
			f := c
			n := f.subgroups()
			f.ResidentFirst, f.Schedule, f.CkptDir = true, fmt.Sprintf("%d,%d,%d", n-n/3-n/3, n/3, n/3), t.TempDir()
			first, _ := zeroRun(t, f, 1, toks)
			for i := range want {
				if first[i] != want[i] {
					t.Errorf("step %d with the resident subgroups first: loss, norm %v; %v", i+1, first[i], want[i])
				}
			}
		}
		// The overlapped run's checkpoint of step 5 (the forward of 5 ran
		// during step 4; none ran during step 5), made the latest and
		// resumed to 8.
		if err := os.WriteFile(filepath.Join(c.CkptDir, "latest"), []byte(fmt.Sprintf("step-%09d\n", c.CkptEvery)), 0o644); err != nil {
			t.Fatal(err)
		}
		r := c
		r.Resume = true
		res, rsum := zeroRun(t, r, 1, toks)
		if len(res) != c.Steps-c.CkptEvery {
			t.Fatalf("device %q: the resumed run logged %d steps, want %d", dev, len(res), c.Steps-c.CkptEvery)
		}
		for i := range res {
			if res[i] != want[c.CkptEvery+i] {
				t.Errorf("device %q step %d resumed: loss, norm %v; the serial run %v", dev, c.CkptEvery+i+1, res[i], want[c.CkptEvery+i])
			}
		}
		if rsum.ValLoss != wsum.ValLoss {
			t.Errorf("device %q: resumed validation loss %v, serial %v", dev, rsum.ValLoss, wsum.ValLoss)
		}
	}
}
