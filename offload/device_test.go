package offload

import (
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// deviceOpts returns opts on a new simulated device with schedule s.
func deviceOpts(opts Options, s perfmodel.Schedule) (Options, *scheduler.Sim) {
	d := scheduler.NewSim(scheduler.SimOptions{})
	opts.Device, opts.Schedule = d, &s
	return opts, d
}

// synced reads the optimizer's host state after bringing resident
// subgroups back.
func synced(t *testing.T, o *Optimizer) *Optimizer {
	t.Helper()
	if err := o.syncHost(); err != nil {
		t.Fatal(err)
	}
	return o
}

// TestDeviceMatchesHost: through the engine on the simulated device, with
// CPU, streamed and resident subgroups, clipping and a loss scale, the
// state and working copy equal the host optimizer's bitwise, step after
// step; and two subgroups equal one.
func TestDeviceMatchesHost(t *testing.T) {
	for _, gd := range []adam.DType{adam.F32, adam.BF16} {
		for _, s := range []perfmodel.Schedule{{CPU: 2, GPU: 2, Resident: 1}, {GPU: 5}, {Resident: 5}, {CPU: 3, GPU: 1, Resident: 1, UpcastOnGPU: true}} {
			t.Run(fmt.Sprintf("%v/%+v", gd, s), func(t *testing.T) {
				base := Options{GradDType: gd, WorkingDType: adam.BF16, MaxGradNorm: 0.5, SubgroupSize: 400, Threads: 2}
				host := newTest(t, base)
				dopts, _ := deviceOpts(base, s)
				dev := newTest(t, dopts)
				if n := len(dev.Subgroups()); n != 5 {
					t.Fatalf("%d subgroups", n)
				}
				for step := int64(1); step <= 4; step++ {
					fill(host, step)
					fill(dev, step)
					a, err := host.Step(StepArgs{LossScale: 8})
					if err != nil {
						t.Fatal(err)
					}
					b, err := dev.Step(StepArgs{LossScale: 8})
					if err != nil {
						t.Fatal(err)
					}
					if a.ClipCoef != b.ClipCoef || a.GradNorm != b.GradNorm || a.Step != b.Step {
						t.Fatalf("step %d: host %+v, device %+v", step, a, b)
					}
					sameState(t, host, synced(t, dev))
				}
				// One subgroup on the device equals five.
				one, _ := deviceOpts(base, perfmodel.Schedule{GPU: 1})
				one.SubgroupSize = 0
				o1 := newTest(t, one)
				for step := int64(1); step <= 4; step++ {
					fill(o1, step)
					if _, err := o1.Step(StepArgs{LossScale: 8}); err != nil {
						t.Fatal(err)
					}
				}
				sameState(t, host, synced(t, o1))
			})
		}
	}
}

// TestDeviceClipSkip: the global checks span both devices: a gradient of
// 3 on a GPU subgroup and 4 on a CPU subgroup have the norm 5, and with
// max_norm 1 they step as 0.6 and 0.8 (exp_avg = 0.1 g); an Inf on either
// device skips the whole step on both.
func TestDeviceClipSkip(t *testing.T) {
	params := []Param{{Name: "a", Shape: []int{1}}, {Name: "b", Shape: []int{1}}, {Name: "c", Shape: []int{1}}}
	opts, _ := deviceOpts(Options{WorkingDType: adam.BF16, MaxGradNorm: 1, SubgroupSize: 1, Threads: 1}, perfmodel.Schedule{CPU: 1, GPU: 1, Resident: 1})
	o, err := New(params, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	roles := o.eng.Plan().Roles
	if roles[0] != scheduler.OnCPU || roles[1] != scheduler.OnGPU || roles[2] != scheduler.Resident {
		t.Fatalf("roles %v", roles)
	}
	for _, inf := range []int{0, 1, 2} {
		o.Grad(0).Float32()[0], o.Grad(1).Float32()[0], o.Grad(2).Float32()[0] = 4, 3, 0
		o.Grad(inf).Float32()[0] = float32(math.Inf(1))
		res, err := o.Step(StepArgs{})
		if err != nil || !res.Skipped || o.StepCount() != 0 {
			t.Fatalf("Inf on the %v subgroup: %+v, %v", roles[inf], res, err)
		}
		synced(t, o)
		if o.state.ExpAvg[0] != 0 || o.state.ExpAvg[1] != 0 || o.state.Param[0] != 0 {
			t.Fatalf("a skipped step changed the state: %v %v", o.state.ExpAvg, o.state.Param)
		}
	}
	o.Grad(0).Float32()[0], o.Grad(1).Float32()[0], o.Grad(2).Float32()[0] = 4, 3, 0
	res, err := o.Step(StepArgs{})
	if err != nil || res.Skipped || res.GradNorm != 5 {
		t.Fatalf("%+v, %v", res, err)
	}
	synced(t, o)
	coef := float32(res.ClipCoef)
	if want := float32(1/(float32(5)+float32(1e-6))) * 1; coef != want {
		t.Fatalf("clip coefficient %g, want %g", coef, want)
	}
	for i, g := range []float32{4, 3} {
		if want := float32(0.1) * (g * coef); math.Abs(float64(o.state.ExpAvg[i]-want)) > 1e-7 || math.Abs(float64(o.state.ExpAvg[i])-0.1*(0.8-0.2*float64(i))) > 1e-6 {
			t.Errorf("exp_avg of subgroup %d (%v): %g, want %g (0.1 x %g)", i, roles[i], o.state.ExpAvg[i], want, 0.8-0.2*float64(i))
		}
	}
}

// TestDeviceFault: the k-th copy or launch of a Step fails, for every k:
// the error surfaces from Step and the state is either untouched (the
// step not taken) or fully advanced, never mixed.
func TestDeviceFault(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 2}
	s := perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 1, UpcastOnGPU: true}
	before := newTest(t, base)
	after := newTest(t, base)
	fill(after, 1)
	if _, err := after.Step(StepArgs{}); err != nil {
		t.Fatal(err)
	}
	untouched, advanced := 0, 0
	for k := 1; ; k++ {
		opts, d := deviceOpts(base, s)
		o := newTest(t, opts)
		fill(o, 1)
		d.FailAfter(k)
		res, err := o.Step(StepArgs{})
		if err == nil {
			if k < 10 {
				t.Fatalf("no fault at operation %d", k)
			}
			break // past the last operation
		}
		if !errors.Is(err, scheduler.ErrInjected) {
			t.Fatalf("operation %d: %v", k, err)
		}
		switch res.Step {
		case 0:
			untouched++
			sameState(t, before, synced(t, o))
		case 1:
			advanced++
			if err := o.eng.GetWorking(o.work.Data); err != nil {
				t.Fatal(err)
			}
			sameState(t, after, synced(t, o))
		default:
			t.Fatalf("operation %d: step %d", k, res.Step)
		}
	}
	if untouched == 0 || advanced == 0 {
		t.Errorf("%d faults left the state untouched, %d advanced it: want both", untouched, advanced)
	}
	t.Logf("%d faults left the state untouched, %d advanced it", untouched, advanced)
}

// TestDeviceBroken: a fault inside the device during the update leaves the
// state unknown: Step says so (ErrBroken) and keeps saying it, nothing can
// be saved, and LoadCheckpoint of a good checkpoint makes the optimizer
// work again, bitwise on the host's path from there.
func TestDeviceBroken(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 2}
	opts, d := deviceOpts(base, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 1})
	o := newTest(t, opts)
	host := newTest(t, base)
	root := t.TempDir()
	fill(o, 1)
	fill(host, 1)
	for _, x := range []*Optimizer{o, host} {
		if _, err := x.Step(StepArgs{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := o.SaveCheckpoint(checkpoint.OS, root, nil); err != nil {
		t.Fatal(err)
	}
	fill(o, 2)
	d.FailSync(8)
	if _, err := o.Step(StepArgs{}); !errors.Is(err, scheduler.ErrBroken) {
		t.Fatalf("Step with a device fault: %v, want ErrBroken", err)
	}
	if _, err := o.Step(StepArgs{}); !errors.Is(err, scheduler.ErrBroken) {
		t.Fatalf("the next Step: %v, want ErrBroken", err)
	}
	if _, err := o.SaveCheckpoint(checkpoint.OS, t.TempDir(), nil); !errors.Is(err, scheduler.ErrBroken) {
		t.Fatalf("SaveCheckpoint of a broken state: %v", err)
	}
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	for step := int64(2); step <= 3; step++ {
		fill(o, step)
		fill(host, step)
		for _, x := range []*Optimizer{o, host} {
			if _, err := x.Step(StepArgs{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	sameState(t, host, synced(t, o))
}

// TestDeviceSaveAsync: a lazy checkpoint of an optimizer with resident
// subgroups moves their state D2H in the background (the snapshot's
// Prepare) and holds exactly the host optimizer's state of that step,
// while the next steps go on.
func TestDeviceSaveAsync(t *testing.T) {
	t.Run("sim", func(t *testing.T) {
		testDeviceSaveAsync(t, scheduler.NewSim(scheduler.SimOptions{}))
	})
	// On a GPU the D2H really is asynchronous: the capture must wait.
	d, k, release, err := kernels.Open(0)
	if err != nil {
		if cuda.Available() == nil || os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("GPU 0: %v", err)
		}
		t.Logf("cuda: skipped (%v)", err)
		return
	}
	defer release()
	t.Run("cuda", func(t *testing.T) { testDeviceSaveAsync(t, scheduler.NewCUDA(d, k)) })
}

func testDeviceSaveAsync(t *testing.T, dev scheduler.Device) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 2}
	opts := base
	opts.Device, opts.Schedule = dev, &perfmodel.Schedule{CPU: 1, GPU: 1, Resident: 3}
	o := newTest(t, opts)
	host := newTest(t, base)
	root := t.TempDir()
	// A slow flush through a small ring: steps 3 and 4 run while step 2's
	// state is captured, the engine waiting per subgroup (Engine.Hold).
	e, err := checkpoint.NewEngine(slowOS{checkpoint.OS}, root, checkpoint.EngineOptions{ChunkBytes: 4096, RingBytes: 3 * 4096, Writers: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	var h *checkpoint.Handle
	for step := int64(1); step <= 4; step++ {
		fill(o, step)
		fill(host, step)
		for _, x := range []*Optimizer{o, host} {
			if _, err := x.Step(StepArgs{}); err != nil {
				t.Fatal(err)
			}
		}
		if step == 2 {
			if o.dev != devDeviceAhead {
				t.Fatal("resident subgroups but the host state is current")
			}
			if _, err := host.SaveCheckpoint(checkpoint.OS, t.TempDir(), nil); err != nil {
				t.Fatal(err)
			}
			if h, err = o.SaveAsync(e, 2, nil); err != nil {
				t.Fatal(err)
			}
		}
	}
	if h.Done() {
		t.Log("the flush ended before steps 3 and 4: the test proves less")
	}
	if _, err := h.Wait(); err != nil {
		t.Fatal(err)
	}
	sameState(t, host, synced(t, o))
	// The checkpoint is step 2's: replay it on the host and compare.
	a := newTest(t, base)
	if _, _, err := a.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	b := newTest(t, base)
	for step := int64(1); step <= 2; step++ {
		fill(b, step)
		if _, err := b.Step(StepArgs{}); err != nil {
			t.Fatal(err)
		}
	}
	sameState(t, b, a)
}

// TestCalibrationSizes: Calibrate's GPU sizes at the full budget are the
// ones it always used (copies of 16, 64, 256 MiB, updates of 16M and
// 64M), they shrink by halves to fit a smaller one, never below the
// floor, and each set's device memory (two copy buffers, five fp32
// update buffers) is within what was given.
func TestCalibrationSizes(t *testing.T) {
	footprint := func(c, u []int64) int64 { return 2*slices.Max(c) + 5*4*slices.Max(u) }
	c, u, err := CalibrationSizes(0)
	if err != nil || !slices.Equal(c, []int64{16 << 20, 64 << 20, 256 << 20}) || !slices.Equal(u, []int64{16 << 20, 64 << 20}) || footprint(c, u) != CalibrationBytes {
		t.Fatalf("full: %v %v %v", c, u, err)
	}
	if CalibrationBytes != 1792<<20 || MinCalibrationBytes != 112<<20 {
		t.Errorf("CalibrationBytes %d, MinCalibrationBytes %d", CalibrationBytes, MinCalibrationBytes)
	}
	for _, room := range []int64{CalibrationBytes - 1, 1 << 30, 300 << 20, MinCalibrationBytes} {
		c, u, err := CalibrationSizes(room)
		if f := footprint(c, u); err != nil || f > room || 2*f <= room { // the largest that fits: twice it does not

			t.Errorf("room %d MiB: %v %v (%d MiB) %v", room>>20, c, u, footprint(c, u)>>20, err)
		}
	}
	if c, u, _ := CalibrationSizes(300 << 20); slices.Max(u) != 8<<20 || slices.Max(c) != 32<<20 {
		t.Errorf("300 MiB: %v %v, want updates up to 8M, copies up to 32 MiB", c, u)
	}
	for _, room := range []int64{MinCalibrationBytes - 1, 1, -5} {
		if _, _, err := CalibrationSizes(room); err == nil || !strings.Contains(err.Error(), "needs 112 MiB at least") {
			t.Errorf("room %d: %v, want a refusal", room, err)
		}
	}
}
