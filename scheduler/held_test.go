package scheduler

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// heldSizes cut adam.MinChunk (32768) blocks both ways: subgroup 1 ends on
// a block boundary (65536), the others end inside blocks, and subgroup 6
// is exactly one block long (from inside one block to inside the next).
var heldSizes = []int{40000, 25536, 30000, 1000, 70000, 2000, 32768, 5000}

// heldPatterns are Options.HostHeld over heldSizes: none, alternating runs
// (segments cut blocks 1, 2, 5 and 6), one held run ending on a block
// boundary, one run from 0 on boundaries, one subgroup inside a block's
// middle, and every subgroup.
var heldPatterns = [][]bool{
	nil,
	{true, false, false, true, true, false, false, true},
	{false, true, false, false, false, false, false, false},
	{true, true, false, false, false, false, false, false},
	{false, false, false, true, false, false, false, false},
	{true, true, true, true, true, true, true, true},
}

// heldSchedules are schedules for the d subgroups that are not held.
func heldSchedules(d int) []perfmodel.Schedule {
	switch d {
	case 0:
		return []perfmodel.Schedule{{}}
	case 1:
		return []perfmodel.Schedule{{CPU: 1}, {GPU: 1}, {Resident: 1}, {CPU: 1, UpcastOnGPU: true}}
	}
	s := []perfmodel.Schedule{{CPU: d}, {GPU: d}, {Resident: d}, {CPU: d / 2, GPU: d - d/2}, {CPU: d - 1, Resident: 1, UpcastOnGPU: true}}
	if d >= 3 {
		s = append(s, perfmodel.Schedule{CPU: 1, GPU: 1, Resident: d - 2})
	}
	return s
}

func countHeld(held []bool) (n int) {
	for _, h := range held {
		if h {
			n++
		}
	}
	return n
}

// setupHeld builds an engine on d for p over heldSizes with held and the
// schedule s over the subgroups not held, mirror spans (inside subgroups
// that are not held) and prefetch as given, and loads p's initial state.
func setupHeld(t testing.TB, d Device, p *problem, held []bool, s perfmodel.Schedule, mirror []Span, prefetch bool) *Engine {
	t.Helper()
	return newHeld(t, d, p, held, s, Options{Mirror: mirror, Prefetch: prefetch})
}

// newHeld is setupHeld with more of the Options (Mirror, Prefetch,
// Speculate) in o.
func newHeld(t testing.TB, d Device, p *problem, held []bool, s perfmodel.Schedule, o Options) *Engine {
	t.Helper()
	if held == nil {
		held = make([]bool, len(heldSizes))
	}
	plan, err := NewHeldPlan(held, s)
	if err != nil {
		t.Fatal(err)
	}
	o.Device, o.Sizes, o.GradDType, o.WorkingDType, o.Plan, o.HostHeld = d, heldSizes, p.gd, adam.BF16, plan, held
	e, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	loadProblem(t, e, p)
	return e
}

// putHeld writes the flat gradient bytes b (gb bytes per element) where a
// trainer that streams the host-held subgroups would: their part into
// HostGrad, the others' into the device gradients at DeviceOffset.
func putHeld(t testing.TB, d Device, e *Engine, b []byte) {
	t.Helper()
	gb := e.gb
	for i, n := range e.sizes {
		off := e.off[i]
		part := b[gb*off : gb*(off+int64(n))]
		if e.HostHeld(i) {
			at, ok := e.HostOffset(off)
			if !ok {
				t.Fatalf("subgroup %d is host-held but HostOffset(%d) says no", i, off)
			}
			copy(e.HostGrad().Bytes()[gb*at:], part)
			continue
		}
		at, ok := e.DeviceOffset(off)
		if !ok {
			t.Fatalf("subgroup %d is on the device but DeviceOffset(%d) says no", i, off)
		}
		put(t, d, e.grad, gb*at, part)
	}
}

// checkHeldRun compares the engine's state, working copy (through
// GetWorking, and where it lies: HostWorking and the device's) and mirror
// with the reference bitwise.
func checkHeldRun(t testing.TB, d Device, e *Engine, want adam.State, wantCopy []uint16) {
	t.Helper()
	if err := e.Download(); err != nil {
		t.Fatal(err)
	}
	got := e.current()
	for a, x := range [][2][]float32{{got.Param, want.Param}, {got.ExpAvg, want.ExpAvg}, {got.ExpAvgSq, want.ExpAvgSq}, {got.MaxExpAvgSq, want.MaxExpAvgSq}} {
		for i := range x[1] {
			if math.Float32bits(x[0][i]) != math.Float32bits(x[1][i]) {
				t.Fatalf("state array %d element %d: %g, want %g", a, i, x[0][i], x[1][i])
			}
		}
	}
	w := make([]uint16, e.total)
	if err := e.GetWorking(w); err != nil {
		t.Fatal(err)
	}
	for i := range wantCopy {
		if w[i] != wantCopy[i] {
			t.Fatalf("working copy element %d: %#04x, want %#04x", i, w[i], wantCopy[i])
		}
	}
	var dev []uint16
	if e.devN > 0 {
		dev = u16sOf(get(t, d, e.work, 0, 2*e.devN))
	}
	for i, n := range e.sizes {
		off := e.off[i]
		var place []uint16
		if e.HostHeld(i) {
			at, _ := e.HostOffset(off)
			place = unsafe.Slice((*uint16)(unsafe.Pointer(&e.HostWorking().Bytes()[2*at])), n)
		} else {
			at, _ := e.DeviceOffset(off)
			place = dev[at : at+int64(n)]
		}
		if !slices.Equal(place, wantCopy[off:off+int64(n)]) {
			t.Fatalf("subgroup %d (host-held %v): its working copy in its own place differs from the reference", i, e.HostHeld(i))
		}
	}
	if e.mirrorN > 0 {
		checkMirror(t, d, e, want.Param)
	}
}

// heldReference runs the steps on the host over the whole flat gradient
// as a trainer does: the global checks first (a non-finite step is
// skipped, state and step count unchanged), then clipping to maxNorm (0:
// none) with torch's clip_coef, clamped to 1.
func heldReference(p *problem, h adam.Hyper, steps int, maxNorm float64) (adam.State, []uint16) {
	s := p.state.Clone()
	out := adam.Copy16{DType: adam.BF16, Data: make([]uint16, s.Len())}
	adam.Round16(adam.BF16, out.Data, s.Param)
	t := int64(0)
	for k := range steps {
		finite, sum := adam.DefaultPath.GradStats(p.grad(k), 1)
		if !finite {
			continue
		}
		t++
		c := h.Coeffs(t, 1, clipCoef(sum, maxNorm))
		adam.DefaultPath.Step(&c, s, p.grad(k), out)
	}
	return s, out.Data
}

// clipCoef is torch.nn.utils.clip_grad_norm_'s coefficient for a sum of
// squares, clamped to 1; 1 without clipping (maxNorm 0).
func clipCoef(sum, maxNorm float64) float32 {
	if maxNorm == 0 {
		return 1
	}
	return float32(min(1, maxNorm/(math.Sqrt(sum)+1e-6)))
}

// heldProblem is a problem over heldSizes whose step 1 carries an Inf in
// element inf (none when inf < 0).
func heldProblem(gd adam.DType, steps int, seed uint64, inf int) *problem {
	n := 0
	for _, s := range heldSizes {
		n += s
	}
	p := newProblem(n, gd, false, steps, seed)
	if inf >= 0 {
		p.g32[1][inf] = float32(math.Inf(1))
		p.g16[1][inf] = adam.F32ToBF16(p.g32[1][inf])
		if gd == adam.F16 {
			p.g16[1][inf] = adam.F32ToF16(p.g32[1][inf])
		}
	}
	return p
}

// runHeld steps e over p as heldReference does, asserting that each
// step's Stats equals the whole gradient's adam.DefaultPath.GradStats bit
// for bit.
func runHeld(t *testing.T, d Device, e *Engine, p *problem, h adam.Hyper, steps int, maxNorm float64) {
	t.Helper()
	step := int64(0)
	for k := range steps {
		putHeld(t, d, e, p.gradBytes(k))
		finite, sum, err := e.Stats(1)
		if err != nil {
			t.Fatal(err)
		}
		wf, ws := adam.DefaultPath.GradStats(p.grad(k), 1)
		if finite != wf || (wf && math.Float64bits(sum) != math.Float64bits(ws)) {
			t.Fatalf("step %d: Stats %v, %v (%#x); the whole gradient's GradStats %v, %v (%#x)", k, finite, sum, math.Float64bits(sum), wf, ws, math.Float64bits(ws))
		}
		if !finite {
			continue
		}
		step++
		c := h.Coeffs(step, 1, clipCoef(sum, maxNorm))
		if err := e.Update(&c); err != nil {
			t.Fatal(err)
		}
	}
}

// TestEngineHostHeld: with any subgroups host-held (their gradients
// written into HostGrad, the others' at DeviceOffset) and any schedule of
// the others, three steps give the state and working copy of the whole
// flat update, bitwise; Stats equals the whole gradient's GradStats bit
// for bit every step (blocks cut between host and device included); with
// clipping that binds and without, with a non-finite step skipped (its
// Inf in a host-held subgroup, in a device one, in a block that lies in
// both places), and with a mirror of spans on the device.
func TestEngineHostHeld(t *testing.T) { forDevices(t, testEngineHostHeld) }

func testEngineHostHeld(t *testing.T, newDev func() Device) {
	h := adam.DefaultHyper()
	for pi, held := range heldPatterns {
		// Step 1's Inf: host-held (patterns 1, 3, 5; in pattern 4 in a
		// block that lies in both places), on the device (pattern 2).
		inf := []int{-1, 5, 70000, 40001, 95600, 200000}[pi]
		for _, gd := range []adam.DType{adam.F32, adam.BF16} {
			p := heldProblem(gd, 4, uint64(10+pi), inf)
			for _, maxNorm := range []float64{0, 1} {
				want, wantCopy := heldReference(p, h, 4, maxNorm)
				for _, s := range heldSchedules(len(heldSizes) - countHeld(held)) {
					t.Run(fmt.Sprintf("held%d/%v/clip=%g/%+v", pi, gd, maxNorm, s), func(t *testing.T) {
						d := newDev()
						var mirror []Span
						if pi == 1 {
							mirror = []Span{{Off: 40003, N: 1000}, {Off: 166536 + 7, N: 2000}}
						}
						e := setupHeld(t, d, p, held, s, mirror, false)
						defer e.Close()
						// Load wrote the working copy in both places.
						w0 := make([]uint16, e.total)
						adam.Round16(adam.BF16, w0, p.state.Param)
						checkHeldRun(t, d, e, p.state, w0)
						runHeld(t, d, e, p, h, 4, maxNorm)
						checkHeldRun(t, d, e, want, wantCopy)
					})
				}
			}
		}
	}
}

// TestEngineHostHeldStats: Stats sees every element wherever it is: a 3
// in a host-held subgroup and a 4 on the device give 25 for every
// pattern; an Inf in either place makes the gradient non-finite.
func TestEngineHostHeldStats(t *testing.T) {
	d := NewSim(SimOptions{})
	p := heldProblem(adam.BF16, 1, 3, -1)
	held := heldPatterns[1]
	e := setupHeld(t, d, p, held, perfmodel.Schedule{CPU: 2, GPU: 1, Resident: 1}, nil, false)
	defer e.Close()
	n := int(e.total)
	for _, inf := range []int{-1, 3, 40000, 39999, 65536, n - 1} {
		g := make([]uint16, n)
		g[2] = adam.F32ToBF16(3)     // held
		g[50000] = adam.F32ToBF16(4) // on the device
		if inf >= 0 {
			g[inf] = adam.F32ToBF16(float32(math.Inf(-1)))
		}
		if err := e.SetGrad(adam.Grad16(adam.BF16, g)); err != nil {
			t.Fatal(err)
		}
		finite, sum, err := e.Stats(1)
		if err != nil {
			t.Fatal(err)
		}
		if inf < 0 && (!finite || sum != 25) {
			t.Errorf("finite %v, sum of squares %g; want true, 25", finite, sum)
		}
		if inf >= 0 && finite {
			t.Errorf("an Inf at element %d not seen", inf)
		}
	}
	// ZeroGrad clears both places.
	if err := e.ZeroGrad(); err != nil {
		t.Fatal(err)
	}
	if finite, sum, err := e.Stats(1); err != nil || !finite || sum != 0 {
		t.Errorf("after ZeroGrad: Stats %v, %g, %v; want true, 0, nil", finite, sum, err)
	}
}

// TestEngineHostHeldReplan: each step under another plan of the subgroups
// that are not held, the held ones staying held, gives the reference; a
// plan that puts a held subgroup on a lane is refused, by New and by
// Replan, and the engine goes on.
func TestEngineHostHeldReplan(t *testing.T) {
	h := adam.DefaultHyper()
	held := heldPatterns[1]
	p := heldProblem(adam.BF16, 3, 21, -1)
	want, wantCopy := heldReference(p, h, 3, 1)
	d := NewSim(SimOptions{})
	ss := []perfmodel.Schedule{{CPU: 1, GPU: 1, Resident: 2}, {CPU: 3, Resident: 1, UpcastOnGPU: true}, {GPU: 4}}
	e := setupHeld(t, d, p, held, ss[0], nil, false)
	defer e.Close()
	bad, err := NewPlan(len(heldSizes), perfmodel.Schedule{CPU: 4, GPU: 4})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Replan(bad); err == nil {
		t.Fatal("Replan accepted a plan with host-held subgroups in its lanes")
	}
	if _, err := New(Options{Device: d, Sizes: heldSizes, GradDType: adam.BF16, WorkingDType: adam.BF16, Plan: bad, HostHeld: held}); err == nil {
		t.Fatal("New accepted a plan with host-held subgroups in its lanes")
	}
	if _, err := New(Options{Device: d, Sizes: heldSizes, GradDType: adam.BF16, WorkingDType: adam.BF16, Plan: bad, HostHeld: held[:3]}); err == nil {
		t.Fatal("New accepted Options.HostHeld of the wrong length")
	}
	if _, err := New(Options{Device: d, Sizes: heldSizes, GradDType: adam.BF16, WorkingDType: adam.BF16, Plan: e.Plan(), HostHeld: held,
		Mirror: []Span{{Off: 10, N: 5}}}); err == nil {
		t.Fatal("New accepted a mirror span on a host-held subgroup")
	}
	step := int64(0)
	for k, s := range ss {
		if k > 0 {
			plan, err := NewHeldPlan(held, s)
			if err != nil {
				t.Fatal(err)
			}
			if err := e.Replan(plan); err != nil {
				t.Fatal(err)
			}
		}
		putHeld(t, d, e, p.gradBytes(k))
		_, sum, err := e.Stats(1)
		if err != nil {
			t.Fatal(err)
		}
		step++
		c := h.Coeffs(step, 1, clipCoef(sum, 1))
		if err := e.Update(&c); err != nil {
			t.Fatal(err)
		}
	}
	checkHeldRun(t, d, e, want, wantCopy)
}

// TestEngineHostHeldPrefetch: with Options.Prefetch, the device subgroups'
// gradients written suffix by suffix with Prefetch after each (the
// host-held ones into HostGrad first), the run gives the reference; the
// host-held subgroups are never prefetched.
func TestEngineHostHeldPrefetch(t *testing.T) { forDevices(t, testEngineHostHeldPrefetch) }

func testEngineHostHeldPrefetch(t *testing.T, newDev func() Device) {
	h := adam.DefaultHyper()
	held := heldPatterns[1]
	p := heldProblem(adam.BF16, 3, 31, -1)
	want, wantCopy := heldReference(p, h, 3, 0)
	for _, s := range heldSchedules(len(heldSizes) - countHeld(held)) {
		t.Run(fmt.Sprintf("%+v", s), func(t *testing.T) {
			d := newDev()
			e := setupHeld(t, d, p, held, s, nil, true)
			defer e.Close()
			bwd, ev, host := backwardIO(t, d, 2*e.total)
			for k := range 3 {
				b := p.gradBytes(k)
				copy(host.Bytes(), b)
				// The last subgroups first, as a backward.
				for i := len(e.sizes) - 1; i >= 0; i-- {
					putGrad(t, d, e, bwd, host, b, i)
					if err := e.Prefetch(bwd, e.off[i]); err != nil {
						t.Fatal(err)
					}
				}
				if err := firstErr(d.Record(ev, bwd), d.Sync(ev)); err != nil {
					t.Fatal(err)
				}
				c := h.Coeffs(int64(k+1), 1, 1)
				if err := e.Update(&c); err != nil {
					t.Fatal(err)
				}
				for i := range e.sizes {
					if e.HostHeld(i) && e.preLast[i] != 0 {
						t.Fatalf("step %d: host-held subgroup %d was prefetched (%#x)", k, i, e.preLast[i])
					}
				}
			}
			checkHeldRun(t, d, e, want, wantCopy)
		})
	}
}

// TestEngineHostHeldFaults fails the i-th copy or launch of one update
// phase for every i with host-held subgroups: the error wraps ErrInjected
// and the state, the host-held working copy included, is fully advanced,
// bitwise.
func TestEngineHostHeldFaults(t *testing.T) {
	h := adam.DefaultHyper()
	held := heldPatterns[1]
	p := heldProblem(adam.BF16, 1, 41, -1)
	want, wantCopy := heldReference(p, h, 1, 0)
	for _, s := range heldSchedules(len(heldSizes) - countHeld(held)) {
		d := NewSim(SimOptions{})
		e := setupHeld(t, d, p, held, s, nil, false)
		putHeld(t, d, e, p.gradBytes(0))
		before := d.Ops()
		c := h.Coeffs(1, 1, 1)
		if err := e.Update(&c); err != nil {
			t.Fatal(err)
		}
		ops := d.Ops() - before
		e.Close()
		for i := 1; i <= ops; i++ {
			t.Run(fmt.Sprintf("%+v/op%d", s, i), func(t *testing.T) {
				d := NewSim(SimOptions{})
				e := setupHeld(t, d, p, held, s, nil, false)
				defer e.Close()
				putHeld(t, d, e, p.gradBytes(0))
				d.opts.FailAt = d.Ops() + i
				err := e.Update(&c)
				var fe *FaultError
				if !errors.As(err, &fe) || !errors.Is(err, ErrInjected) {
					t.Fatalf("Update: %v, want a FaultError wrapping ErrInjected", err)
				}
				checkHeldRun(t, d, e, want, wantCopy)
			})
		}
	}
}
