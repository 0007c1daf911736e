package hybridcase

import (
	"os"
	"testing"

	"github.com/deepstates/dos"
	"github.com/deepstates/dos/internal/adamcase"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
	"github.com/deepstates/dos/scheduler"
)

// TestCases replays every PyTorch reference case through the hybrid
// engine (CPU, streamed and resident subgroups mixed in each step) on each
// device.
func TestCases(t *testing.T) { forDevices(t, testCases) }

func testCases(t *testing.T, newDev func() scheduler.Device) {
	cases, err := adamcase.LoadFS(dos.AdamCases, dos.AdamCasesDir)
	if err != nil {
		t.Fatal(err)
	}
	b := Backend{Label: "test", NewDevice: newDev}
	for _, c := range cases {
		r := adamcase.Run(c, b)
		if !r.Passed() {
			t.Errorf("%s (n=%d): %v", c.Name, c.N(), r.Err)
		} else {
			t.Logf("%s: n=%d calls=%d max err %.2g", c.Name, r.N, r.Calls, r.MaxErr)
		}
	}
	if len(cases) < 10 {
		t.Fatalf("only %d cases", len(cases))
	}
}

// TestCaseSchedule: the cases' schedules mix every role once there are
// five parameters.
func TestCaseSchedule(t *testing.T) {
	for _, n := range []int{1, 2, 3, 4, 5, 6, 1000, 1001} {
		sizes, s := Schedule(n)
		sum := 0
		for _, x := range sizes {
			sum += x
			if x < 1 {
				t.Fatalf("n=%d: sizes %v", n, sizes)
			}
		}
		if sum != n || s.CPU+s.GPU+s.Resident != len(sizes) {
			t.Fatalf("n=%d: sizes %v schedule %+v", n, sizes, s)
		}
		if n >= 5 && (s.CPU == 0 || s.GPU == 0 || s.Resident == 0) {
			t.Errorf("n=%d: %+v does not mix every role", n, s)
		}
	}
}

// forDevices runs f on the simulated device and, where there is one, on
// GPU 0 (DOS_REQUIRE_GPU=1 makes its absence a failure).
func forDevices(t *testing.T, f func(t *testing.T, newDev func() scheduler.Device)) {
	t.Run("sim", func(t *testing.T) { f(t, func() scheduler.Device { return scheduler.NewSim(scheduler.SimOptions{}) }) })
	d, k, release, err := kernels.Open(0)
	if err != nil {
		if cuda.Available() == nil || os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("GPU 0: %v", err)
		}
		t.Logf("cuda: skipped (%v)", err)
		return
	}
	defer release()
	t.Run("cuda", func(t *testing.T) { f(t, func() scheduler.Device { return scheduler.NewCUDA(d, k) }) })
}
