package scheduler

import (
	"os"
	"testing"

	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
)

// forDevices runs f on the simulated device and, when there is one, on
// GPU 0 with dos's kernels (DOS_REQUIRE_GPU=1 makes its absence a
// failure).
func forDevices(t *testing.T, f func(t *testing.T, newDev func() Device)) {
	t.Run("sim", func(t *testing.T) { f(t, func() Device { return NewSim(SimOptions{}) }) })
	d, k, release, err := kernels.Open(0)
	if err != nil {
		if cuda.Available() == nil || os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("GPU 0: %v", err)
		}
		t.Logf("cuda: skipped (%v)", err)
		return
	}
	defer release()
	t.Run("cuda", func(t *testing.T) { f(t, func() Device { return NewCUDA(d, k) }) })
}
