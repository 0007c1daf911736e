package scheduler

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// problem is a host-side AdamW problem: the initial state and a gradient
// per step (fp32 values; 16-bit bit patterns when gd is 16-bit).
type problem struct {
	gd    adam.DType
	state adam.State
	g32   [][]float32
	g16   [][]uint16
}

func newProblem(n int, gd adam.DType, amsgrad bool, steps int, seed uint64) *problem {
	r := rand.New(rand.NewPCG(seed, 11))
	p := &problem{gd: gd, state: adam.State{Param: make([]float32, n), ExpAvg: make([]float32, n), ExpAvgSq: make([]float32, n)}}
	if amsgrad {
		p.state.MaxExpAvgSq = make([]float32, n)
	}
	for i := range n {
		p.state.Param[i] = float32(r.NormFloat64())
		p.state.ExpAvg[i] = float32(r.NormFloat64() * 1e-2)
		p.state.ExpAvgSq[i] = float32(r.Float64() * 1e-4)
		if amsgrad {
			p.state.MaxExpAvgSq[i] = p.state.ExpAvgSq[i] * float32(1+r.Float64())
		}
	}
	for range steps {
		g := make([]float32, n)
		u := make([]uint16, n)
		for i := range g {
			g[i] = float32(r.NormFloat64() * math.Pow(10, float64(r.IntN(5)-3)))
			switch gd {
			case adam.BF16:
				u[i] = adam.F32ToBF16(g[i])
			case adam.F16:
				u[i] = adam.F32ToF16(g[i])
			}
		}
		p.g32, p.g16 = append(p.g32, g), append(p.g16, u)
	}
	return p
}

func (p *problem) grad(step int) adam.Grad {
	if p.gd == adam.F32 {
		return adam.GradF32(p.g32[step])
	}
	return adam.Grad16(p.gd, p.g16[step])
}

func (p *problem) gradBytes(step int) []byte {
	if p.gd == adam.F32 {
		return unsafe.Slice((*byte)(unsafe.Pointer(&p.g32[step][0])), 4*len(p.g32[step]))
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&p.g16[step][0])), 2*len(p.g16[step]))
}

// reference runs the steps on the host with adam.DefaultPath over the
// whole flat state: subgroups do not change an elementwise update.
func (p *problem) reference(h adam.Hyper, od adam.DType, steps int) (adam.State, []uint16) {
	s := p.state.Clone()
	out := adam.Copy16{DType: od, Data: make([]uint16, s.Len())}
	for t := range steps {
		c := h.Coeffs(int64(t+1), 1, 1)
		adam.DefaultPath.Step(&c, s, p.grad(t), out)
	}
	return s, out.Data
}

// put copies b to device memory m at off and waits.
func put(t testing.TB, d Device, m Mem, off int64, b []byte) {
	t.Helper()
	h, err := d.AllocHost(int64(len(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer d.FreeHost(h)
	copy(h.Bytes(), b)
	s, _ := d.NewStream()
	ev, _ := d.NewEvent()
	defer d.FreeStream(s)
	defer d.FreeEvent(ev)
	if err := firstErr(d.H2D(s, m, off, h, 0, int64(len(b))), d.Record(ev, s), d.Sync(ev)); err != nil {
		t.Fatal(err)
	}
}

// get copies n bytes of device memory m from off to the host.
func get(t testing.TB, d Device, m Mem, off, n int64) []byte {
	t.Helper()
	h, err := d.AllocHost(n)
	if err != nil {
		t.Fatal(err)
	}
	defer d.FreeHost(h)
	s, _ := d.NewStream()
	ev, _ := d.NewEvent()
	defer d.FreeStream(s)
	defer d.FreeEvent(ev)
	if err := firstErr(d.D2H(s, h, 0, m, off, n), d.Record(ev, s), d.Sync(ev)); err != nil {
		t.Fatal(err)
	}
	return slices.Clone(h.Bytes())
}

func u16sOf(b []byte) []uint16 { return unsafe.Slice((*uint16)(unsafe.Pointer(&b[0])), len(b)/2) }

// setup builds an engine on d for p with the schedule s over sizes and a
// two-span mirror (testMirror), and loads p's initial state.
func setup(t testing.TB, d Device, p *problem, sizes []int, s perfmodel.Schedule, amsgrad bool) *Engine {
	t.Helper()
	total := int64(0)
	for _, n := range sizes {
		total += int64(n)
	}
	return setupWith(t, d, p, sizes, s, amsgrad, testMirror(total))
}

// setupWith is setup with the mirror's spans given.
func setupWith(t testing.TB, d Device, p *problem, sizes []int, s perfmodel.Schedule, amsgrad bool, mirror []Span) *Engine {
	t.Helper()
	plan, err := NewPlan(len(sizes), s)
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Device: d, Sizes: sizes, GradDType: p.gd, WorkingDType: adam.BF16, AMSGrad: amsgrad, Pool: nil, Plan: plan,
		Mirror: mirror})
	if err != nil {
		t.Fatal(err)
	}
	loadProblem(t, e, p)
	return e
}

// loadProblem writes p's initial state into e's host state and loads it
// (Engine.Load).
func loadProblem(t testing.TB, e *Engine, p *problem) {
	t.Helper()
	hs := e.HostState()
	copy(hs.Param, p.state.Param)
	copy(hs.ExpAvg, p.state.ExpAvg)
	copy(hs.ExpAvgSq, p.state.ExpAvgSq)
	copy(hs.MaxExpAvgSq, p.state.MaxExpAvgSq)
	if err := e.Load(); err != nil {
		t.Fatal(err)
	}
}

// testMirror is the Options.Mirror of setup's engines: two spans, each
// across subgroup boundaries for testSizes.
func testMirror(total int64) []Span {
	return []Span{{Off: 1, N: total/7 + 1}, {Off: total / 2, N: total / 3}}
}

// check compares the engine's state (after Download), working copy and
// mirror with the reference bitwise.
func check(t testing.TB, d Device, e *Engine, want adam.State, wantCopy []uint16) {
	t.Helper()
	if err := e.Download(); err != nil {
		t.Fatal(err)
	}
	got := e.HostState()
	arrays := [][2][]float32{{got.Param, want.Param}, {got.ExpAvg, want.ExpAvg}, {got.ExpAvgSq, want.ExpAvgSq}, {got.MaxExpAvgSq, want.MaxExpAvgSq}}
	for a, x := range arrays {
		for i := range x[1] {
			if math.Float32bits(x[0][i]) != math.Float32bits(x[1][i]) {
				t.Fatalf("state array %d element %d: %g, want %g", a, i, x[0][i], x[1][i])
			}
		}
	}
	w := u16sOf(get(t, d, e.work, 0, 2*int64(len(wantCopy))))
	for i := range wantCopy {
		if w[i] != wantCopy[i] {
			t.Fatalf("working copy element %d: %#04x, want %#04x", i, w[i], wantCopy[i])
		}
	}
	checkMirror(t, d, e, want.Param)
}

// checkMirror compares the engine's mirror with the master weights want at
// Options.Mirror's spans, bitwise.
func checkMirror(t testing.TB, d Device, e *Engine, want []float32) {
	t.Helper()
	if e.mirrorN == 0 {
		t.Fatal("the engine has no mirror")
	}
	b := get(t, d, e.mirror, 0, 4*e.mirrorN)
	m := unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), e.mirrorN)
	ats, _ := MirrorLayout(e.o.Mirror)
	for k, sp := range e.o.Mirror {
		at := ats[k]
		if at%4 != 0 {
			t.Fatalf("mirror span %d at element %d: not 16-byte aligned", k, at)
		}
		for j := range sp.N {
			if math.Float32bits(m[at+j]) != math.Float32bits(want[sp.Off+j]) {
				t.Fatalf("mirror element %d (master %d): %g, want %g", at+j, sp.Off+j, m[at+j], want[sp.Off+j])
			}
		}
	}
}

var testSizes = []int{1000, 777, 1000, 1000, 513, 1000, 64, 1000}

// testTotal is the elements of testSizes.
func testTotal() int {
	n := 0
	for _, s := range testSizes {
		n += s
	}
	return n
}

func schedules(n int) []perfmodel.Schedule {
	return []perfmodel.Schedule{
		{CPU: n},                      // ZeRO-Offload
		{Resident: n},                 // all on the GPU
		{GPU: n},                      // all streamed
		{CPU: n / 2, GPU: n / 2},      // k = 1
		{CPU: 5, GPU: 2, Resident: 1}, // k = 2.5 and a resident one
		{CPU: 3, GPU: 2, Resident: 3},
		{CPU: 5, Resident: 3}, // a static split
		{CPU: 4, GPU: 3, Resident: 1, UpcastOnGPU: true},
		{CPU: 7, Resident: 1, UpcastOnGPU: true},
	}
}

// TestEngineMatchesCPU: every schedule, gradient dtype and amsgrad gives
// the state and working copy of adam.DefaultPath on the whole, bitwise,
// over three steps.
func TestEngineMatchesCPU(t *testing.T) {
	forDevices(t, testEngineMatchesCPU)
}

func testEngineMatchesCPU(t *testing.T, newDev func() Device) {
	h := adam.DefaultHyper()
	n := testTotal()
	for _, gd := range []adam.DType{adam.F32, adam.BF16, adam.F16} {
		for _, ams := range []bool{false, true} {
			p := newProblem(n, gd, ams, 3, 1)
			hh := h
			hh.AMSGrad = ams
			want, wantCopy := p.reference(hh, adam.BF16, 3)
			for _, s := range schedules(len(testSizes)) {
				t.Run(fmt.Sprintf("%v/amsgrad=%v/%+v", gd, ams, s), func(t *testing.T) {
					d := newDev()
					e := setup(t, d, p, testSizes, s, ams)
					defer e.Close()
					for step := range 3 {
						put(t, d, e.grad, 0, p.gradBytes(step))
						c := hh.Coeffs(int64(step+1), 1, 1)
						if err := e.Update(&c); err != nil {
							t.Fatal(err)
						}
					}
					check(t, d, e, want, wantCopy)
				})
			}
		}
	}
}

// TestEngineFaults fails the i-th copy or launch of one update phase for
// every i: the error surfaces from Update, wraps ErrInjected, and the state
// is fully advanced, bitwise.
func TestEngineFaults(t *testing.T) {
	h := adam.DefaultHyper()
	n := testTotal()
	for _, gd := range []adam.DType{adam.F32, adam.BF16} {
		p := newProblem(n, gd, false, 1, 2)
		want, wantCopy := p.reference(h, adam.BF16, 1)
		for _, s := range schedules(len(testSizes)) {
			// A clean run counts the update's operations.
			d := NewSim(SimOptions{})
			e := setup(t, d, p, testSizes, s, false)
			put(t, d, e.grad, 0, p.gradBytes(0))
			before := d.Ops()
			c := h.Coeffs(1, 1, 1)
			if err := e.Update(&c); err != nil {
				t.Fatal(err)
			}
			ops := d.Ops() - before
			e.Close()
			if ops == 0 {
				t.Fatalf("%+v: no operations", s)
			}
			for i := 1; i <= ops; i++ {
				t.Run(fmt.Sprintf("%v/%+v/op%d", gd, s, i), func(t *testing.T) {
					d := NewSim(SimOptions{})
					e := setup(t, d, p, testSizes, s, false)
					defer e.Close()
					put(t, d, e.grad, 0, p.gradBytes(0))
					d.opts.FailAt = d.Ops() + i
					err := e.Update(&c)
					var fe *FaultError
					if !errors.As(err, &fe) || !errors.Is(err, ErrInjected) {
						t.Fatalf("Update: %v, want a FaultError wrapping ErrInjected", err)
					}
					check(t, d, e, want, wantCopy)
				})
			}
		}
	}
}

// TestEngineStats: the global checks see every subgroup whatever its role:
// a gradient of 3 on a GPU subgroup and 4 on a CPU one give a sum of
// squares of 25; an Inf on either makes the gradient non-finite.
func TestEngineStats(t *testing.T) { forDevices(t, testEngineStats) }

func testEngineStats(t *testing.T, newDev func() Device) {
	sizes := []int{4, 4, 4}
	for _, gd := range []adam.DType{adam.F32, adam.BF16} {
		p := newProblem(12, gd, false, 1, 3)
		d := newDev()
		e := setup(t, d, p, sizes, perfmodel.Schedule{CPU: 1, GPU: 1, Resident: 1}, false)
		g := make([]float32, 12)
		roles := e.Plan().Roles
		for i, r := range roles {
			switch r {
			case OnGPU:
				g[4*i] = 3
			case OnCPU:
				g[4*i+1] = 4
			}
		}
		for _, inf := range []int{-1, 0, 1, 2} {
			gg := slices.Clone(g)
			if inf >= 0 {
				gg[4*inf+2] = float32(math.Inf(1))
			}
			b := unsafe.Slice((*byte)(unsafe.Pointer(&gg[0])), 48)
			if gd == adam.BF16 {
				u := make([]uint16, 12)
				for i, f := range gg {
					u[i] = adam.F32ToBF16(f)
				}
				b = unsafe.Slice((*byte)(unsafe.Pointer(&u[0])), 24)
			}
			put(t, d, e.grad, 0, b)
			finite, ss, err := e.Stats(1)
			if err != nil {
				t.Fatal(err)
			}
			if inf < 0 && (!finite || ss != 25) {
				t.Errorf("%v: finite %v, sum of squares %g; want true, 25", gd, finite, ss)
			}
			if inf >= 0 && finite {
				t.Errorf("%v: an Inf in subgroup %d (%v) not seen", gd, inf, roles[inf])
			}
		}
		e.Close()
	}
}

// TestEngineTimeline: on the simulated device with a profile, every GPU
// subgroup's state moves H2D before its kernel, which ends before its D2H;
// a staging slot is refilled only after its previous state left; and, with
// no CPU subgroup, the second subgroup's H2D runs while the first one's
// kernel does (the two slots overlap copies and updates). With CPU
// subgroups their working copies share the H2D stream in the order the
// host enqueued them, so how early the second state H2D starts depends on
// the host's goroutine scheduling (it failed under load): the overlap is
// checked where nothing else is on that stream.
func TestEngineTimeline(t *testing.T) {
	for _, s := range []perfmodel.Schedule{{CPU: 4, GPU: 6, Resident: 2}, {GPU: 10, Resident: 2}} {
		testEngineTimeline(t, s)
	}
}

func testEngineTimeline(t *testing.T, s perfmodel.Schedule) {
	fit := func(rate float64) perfmodel.Fit { return perfmodel.Fit{Rate: rate, LatencyS: 1e-6} }
	prof := &perfmodel.GPUProfile{H2D: fit(50e9), D2H: fit(50e9), Update: fit(1e9), Convert: fit(1e10)}
	sizes := slices.Repeat([]int{1 << 12}, 12)
	p := newProblem(12<<12, adam.BF16, false, 1, 4)
	d := NewSim(SimOptions{Profile: prof})
	e := setup(t, d, p, sizes, s, false)
	defer e.Close()
	put(t, d, e.grad, 0, p.gradBytes(0))
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	if err := e.Update(&c); err != nil {
		t.Fatal(err)
	}
	ops, err := e.Trace()
	if err != nil {
		t.Fatal(err)
	}
	by := map[[2]any]Op{}
	for _, o := range ops {
		by[[2]any{o.Subgroup, o.What}] = o
		if o.End < o.Start {
			t.Errorf("%+v: %+v ends before it starts", s, o)
		}
	}
	var streamed []int
	for _, i := range e.Plan().GPUOrder {
		if e.Plan().Roles[i] != OnGPU {
			continue
		}
		streamed = append(streamed, i)
		h2d, k, d2h := by[[2]any{i, "state H2D"}], by[[2]any{i, "AdamW"}], by[[2]any{i, "state D2H"}]
		if !(h2d.End <= k.Start && k.End <= d2h.Start) {
			t.Errorf("%+v: subgroup %d: H2D %v-%v, AdamW %v-%v, D2H %v-%v out of order", s, i, h2d.Start, h2d.End, k.Start, k.End, d2h.Start, d2h.End)
		}
	}
	for j := 2; j < len(streamed); j++ {
		if next, prev := by[[2]any{streamed[j], "state H2D"}], by[[2]any{streamed[j-2], "state D2H"}]; next.Start < prev.End {
			t.Errorf("%+v: subgroup %d refills slot %d at %v before subgroup %d's state left at %v", s, streamed[j], j%2, next.Start, streamed[j-2], prev.End)
		}
	}
	if s.CPU > 0 {
		return
	}
	// The second H2D starts while the first kernel runs: two slots overlap.
	if a, b := by[[2]any{streamed[1], "state H2D"}], by[[2]any{streamed[0], "AdamW"}]; a.Start >= b.End {
		t.Errorf("%+v: no overlap: subgroup %d's H2D starts at %v, after subgroup %d's kernel ended at %v", s, streamed[1], a.Start, streamed[0], b.End)
	}
}

// TestPlan: roles and lane orders for a few schedules.
func TestPlan(t *testing.T) {
	for _, x := range []struct {
		s     perfmodel.Schedule
		roles string
	}{
		{perfmodel.Schedule{CPU: 4}, "cccc"},
		{perfmodel.Schedule{GPU: 4}, "gggg"},
		{perfmodel.Schedule{Resident: 3}, "rrr"},
		{perfmodel.Schedule{CPU: 4, GPU: 2}, "cgccgc"[:0] + "ccgccg"},
		{perfmodel.Schedule{CPU: 3, GPU: 3}, "cgcgcg"},
		{perfmodel.Schedule{CPU: 5, GPU: 2, Resident: 2}, "cccgccgrr"},
	} {
		n := x.s.CPU + x.s.GPU + x.s.Resident
		p, err := NewPlan(n, x.s)
		if err != nil {
			t.Fatal(err)
		}
		var b []byte
		for _, r := range p.Roles {
			b = append(b, r.String()[0])
		}
		got := string(b)
		want := x.roles
		if got != want {
			t.Errorf("%+v: roles %s, want %s", x.s, got, want)
		}
		if len(p.GPUOrder)+len(p.CPUOrder) != n {
			t.Errorf("%+v: lanes %v %v", x.s, p.GPUOrder, p.CPUOrder)
		}
		if x.s.Resident > 0 && p.Roles[p.GPUOrder[0]] != Resident {
			t.Errorf("%+v: the GPU lane starts with %v", x.s, p.Roles[p.GPUOrder[0]])
		}
	}
	if _, err := NewPlan(3, perfmodel.Schedule{CPU: 1, GPU: 1}); err == nil {
		t.Error("NewPlan accepted counts that do not add up")
	}
}

// TestEngineReplan: three steps, each under another plan, give the
// reference's state.
func TestEngineReplan(t *testing.T) { forDevices(t, testEngineReplan) }

func testEngineReplan(t *testing.T, newDev func() Device) {
	h := adam.DefaultHyper()
	n := testTotal()
	p := newProblem(n, adam.BF16, false, 3, 5)
	want, wantCopy := p.reference(h, adam.BF16, 3)
	d := newDev()
	ss := []perfmodel.Schedule{{CPU: 3, GPU: 2, Resident: 3}, {CPU: 2, Resident: 6, UpcastOnGPU: true}, {GPU: 4, CPU: 4}}
	e := setup(t, d, p, testSizes, ss[0], false)
	defer e.Close()
	for step, s := range ss {
		if step > 0 {
			plan, err := NewPlan(len(testSizes), s)
			if err != nil {
				t.Fatal(err)
			}
			if err := e.Replan(plan); err != nil {
				t.Fatal(err)
			}
		}
		put(t, d, e.grad, 0, p.gradBytes(step))
		c := h.Coeffs(int64(step+1), 1, 1)
		if err := e.Update(&c); err != nil {
			t.Fatal(err)
		}
	}
	check(t, d, e, want, wantCopy)
}

// TestUpdateNoAllocs: an update phase allocates nothing (all lanes, the
// upcast included), here on the simulated device.
func TestUpdateNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	n := testTotal()
	p := newProblem(n, adam.BF16, false, 1, 6)
	d := NewSim(SimOptions{})
	e := setup(t, d, p, testSizes, perfmodel.Schedule{CPU: 4, GPU: 3, Resident: 1, UpcastOnGPU: true}, false)
	defer e.Close()
	put(t, d, e.grad, 0, p.gradBytes(0))
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	if err := e.Update(&c); err != nil {
		t.Fatal(err)
	}
	if a := testing.AllocsPerRun(20, func() {
		if err := e.Update(&c); err != nil {
			t.Fatal(err)
		}
	}); a != 0 {
		t.Errorf("Update allocates %v times", a)
	}
}

// TestEngineDeviceFault: a fault inside the device (a wait that fails)
// during Update, or a copy that fails during Replan, leaves the engine
// broken: ErrBroken then and from every later call. And Update after Close
// or with the wrong amsgrad is refused.
func TestEngineDeviceFault(t *testing.T) {
	n := testTotal()
	p := newProblem(n, adam.BF16, false, 1, 7)
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	s := perfmodel.Schedule{CPU: 4, GPU: 3, Resident: 1, UpcastOnGPU: true}
	broken := 0
	for k := 1; ; k++ {
		d := NewSim(SimOptions{})
		e := setup(t, d, p, testSizes, s, false)
		d.FailSync(k)
		err := e.Update(&c)
		if err == nil {
			e.Close()
			break // past the last wait
		}
		if !errors.Is(err, ErrBroken) || !e.Broken() || !errors.Is(e.Update(&c), ErrBroken) || !errors.Is(e.Download(), ErrBroken) {
			t.Fatalf("wait %d: %v, want ErrBroken from then on", k, err)
		}
		broken++
		e.Close()
	}
	if broken < 5 {
		t.Fatalf("only %d waits", broken)
	}
	for k := 1; k <= 30; k++ {
		d := NewSim(SimOptions{})
		e := setup(t, d, p, testSizes, s, false)
		plan, _ := NewPlan(len(testSizes), perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 4})
		d.FailAfter(k)
		err := e.Replan(plan)
		switch {
		case err == nil:
		case e.Broken():
			if !errors.Is(e.Update(&c), ErrBroken) {
				t.Fatalf("Replan failing at %d: the broken engine updated", k)
			}
		default:
			// The resident state did not come back: nothing changed, the
			// old plan stands.
			if err := e.Update(&c); err != nil || e.Plan() == plan {
				t.Fatalf("Replan failing at %d (%v): then %v", k, err, e.Plan())
			}
		}
		e.Close()
	}
	d := NewSim(SimOptions{})
	e := setup(t, d, p, testSizes, s, false)
	ca := c
	ca.AMSGrad = true
	if err := e.Update(&ca); err == nil {
		t.Error("amsgrad coefficients on an engine without max_exp_avg_sq accepted")
	}
	e.Close()
	if err := e.Update(&c); !errors.Is(err, ErrEngineClosed) {
		t.Errorf("Update after Close: %v", err)
	}
}

// freeFailing is the simulated device whose FreeMem fails.
type freeFailing struct{ *Sim }

var errFree = errors.New("free refused")

func (d freeFailing) FreeMem(m Mem) error { return errors.Join(d.Sim.FreeMem(m), errFree) }

// TestEngineCloseErrors: Close returns what the device could not free
// (it frees the rest), and the engine is closed afterwards.
func TestEngineCloseErrors(t *testing.T) {
	d := freeFailing{NewSim(SimOptions{})}
	plan, _ := NewPlan(3, perfmodel.Schedule{CPU: 1, GPU: 1, Resident: 1})
	e, err := New(Options{Device: d, Sizes: []int{4, 4, 4}, GradDType: adam.BF16, WorkingDType: adam.BF16, Plan: plan})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); !errors.Is(err, errFree) {
		t.Fatalf("Close: %v, want the Free errors", err)
	}
	if d.Used() != 0 {
		t.Errorf("%d bytes of device memory left", d.Used())
	}
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	if err := e.Update(&c); !errors.Is(err, ErrEngineClosed) {
		t.Errorf("Update after Close: %v", err)
	}
}

// TestEngineMirrorLoad: after Load the mirror holds the host master
// weights at its spans; spans that are unsorted, overlapping, empty or
// outside the elements are refused, naming Options.Mirror.
func TestEngineMirrorLoad(t *testing.T) {
	n := testTotal()
	p := newProblem(n, adam.BF16, false, 1, 7)
	d := NewSim(SimOptions{})
	e := setup(t, d, p, testSizes, perfmodel.Schedule{CPU: 3, GPU: 2, Resident: 3}, false)
	checkMirror(t, d, e, p.state.Param)
	if got, want := e.Mirror().N, testMirror(int64(n))[0].N+testMirror(int64(n))[1].N; got != want {
		t.Errorf("Mirror().N = %d, want %d", got, want)
	}
	e.Close()
	plan, err := NewPlan(len(testSizes), perfmodel.Schedule{CPU: len(testSizes)})
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]Span{{{Off: 5, N: 0}}, {{Off: 10, N: 5}, {Off: 12, N: 3}}, {{Off: 20, N: 5}, {Off: 10, N: 3}}, {{Off: int64(n) - 2, N: 3}}, {{Off: -1, N: 2}}} {
		e, err := New(Options{Device: d, Sizes: testSizes, GradDType: adam.BF16, WorkingDType: adam.BF16, Plan: plan, Mirror: bad})
		if err == nil || !strings.Contains(err.Error(), "Options.Mirror") {
			t.Errorf("Mirror %v: error %v, want one naming Options.Mirror", bad, err)
		}
		if e != nil {
			e.Close()
		}
	}
}

// TestEngineReplanRefused: a Replan whose plan does not fit the device's
// memory (here the simulated device's capacity) goes back to the old plan:
// ErrReplanRefused, the engine not broken, and the updates after it the
// reference's, as if nothing had been tried.
func TestEngineReplanRefused(t *testing.T) {
	h := adam.DefaultHyper()
	p := newProblem(testTotal(), adam.BF16, false, 3, 8)
	want, wantCopy := p.reference(h, adam.BF16, 3)
	s := perfmodel.Schedule{CPU: 6, GPU: 0, Resident: 2}
	probe := NewSim(SimOptions{})
	pe := setup(t, probe, p, testSizes, s, false)
	used := probe.used
	pe.Close()
	d := NewSim(SimOptions{Capacity: used + 64}) // the first plan fits, all resident does not
	e := setup(t, d, p, testSizes, s, false)
	defer e.Close()
	first := e.Plan()
	for step := range 3 {
		if step == 1 {
			plan, err := NewPlan(len(testSizes), perfmodel.Schedule{Resident: len(testSizes)})
			if err != nil {
				t.Fatal(err)
			}
			if err := e.Replan(plan); !errors.Is(err, ErrReplanRefused) || e.Broken() || e.Plan() != first {
				t.Fatalf("Replan over the capacity: %v (broken %v, plan kept %v); want ErrReplanRefused and the old plan",
					err, e.Broken(), e.Plan() == first)
			}
		}
		put(t, d, e.grad, 0, p.gradBytes(step))
		c := h.Coeffs(int64(step+1), 1, 1)
		if err := e.Update(&c); err != nil {
			t.Fatal(err)
		}
	}
	check(t, d, e, want, wantCopy)
}
