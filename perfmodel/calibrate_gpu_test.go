package perfmodel

import (
	"os"
	"testing"

	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
)

// TestCalibrateGPU: on a GPU (DOS_REQUIRE_GPU=1 makes its absence a
// failure), a quick calibration gives fits in plausible ranges, and a
// host memory peak (GPUProfile.HostMem) above the duplex copies'.
func TestCalibrateGPU(t *testing.T) {
	d, k, release, err := kernels.Open(0)
	if err != nil {
		if cuda.Available() == nil || os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("GPU 0: %v", err)
		}
		t.Skipf("no GPU: %v", err)
	}
	defer release()
	g, err := CalibrateGPU(d, k, GPUOptions{CopySizes: []int64{4 << 20, 32 << 20, 128 << 20}, UpdateSizes: []int64{16 << 20, 32 << 20, 64 << 20}, Reps: 3}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range []struct {
		name   string
		f      Fit
		lo, hi float64
	}{{"h2d", g.H2D, 1e9, 1e12}, {"d2h", g.D2H, 1e9, 1e12}, {"h2d_duplex", g.H2DBoth, 1e9, 1e12}, {"d2h_duplex", g.D2HBoth, 1e9, 1e12},
		{"update", g.Update, 1e9, 1e13}, {"convert", g.Convert, 1e9, 1e13}} {
		t.Logf("%-10s rate %.3g/s latency %.1f µs residual %.1f %%", x.name, x.f.Rate, x.f.LatencyS*1e6, 100*x.f.Residual)
		if x.f.Rate < x.lo || x.f.Rate > x.hi {
			t.Errorf("%s: rate %g outside [%g, %g]", x.name, x.f.Rate, x.lo, x.hi)
		}
	}
	// The host memory's peak: at least what the copies moved at once, at
	// most what any DRAM does.
	t.Logf("host memory %.1f GB/s", g.HostMem/1e9)
	if both := g.H2DBoth.Rate + g.D2HBoth.Rate; g.HostMem < both || g.HostMem > 5e12 {
		t.Errorf("host memory %g B/s: want at least both copy directions' %g and at most 5e12", g.HostMem, both)
	}
}
