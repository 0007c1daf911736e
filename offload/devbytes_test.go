package offload

import (
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestDeviceBytes: DeviceBytes is what New allocates on the device outside
// GPUBudget (all on the CPU: exactly the device memory in use), and with
// the update phase's memory it stays within DeviceBytes + the schedule's
// perfmodel GPUMemory.
func TestDeviceBytes(t *testing.T) {
	if got := (Options{}).DeviceBytes(100); got != 600 {
		t.Errorf("DeviceBytes(100) with the defaults (fp32 gradients): %d, want 600", got)
	}
	for _, gd := range []adam.DType{adam.F32, adam.BF16} {
		for _, s := range []perfmodel.Schedule{{CPU: 5}, {CPU: 2, GPU: 2, Resident: 1}, {CPU: 3, GPU: 1, Resident: 1, UpcastOnGPU: true}} {
			opts, sim := deviceOpts(Options{GradDType: gd, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 1}, s)
			o := newTest(t, opts)
			base := opts.DeviceBytes(o.NumParams())
			w := perfmodel.Workload{Params: int64(o.NumParams()), SubgroupSize: 400, GradDType: gd, CopyBytes: 2, Threads: 1}
			if used := sim.Used(); (s.GPU == 0 && used != base) || used > base+w.GPUMemory(s) {
				t.Errorf("%v %+v: %d bytes in use, DeviceBytes %d, GPUMemory %d", gd, s, used, base, w.GPUMemory(s))
			}
		}
	}
}
