package offload

import (
	"github.com/deepstates/dos/checkpoint"
	"slices"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// TestOffloadParamEdgeEmptyOnlyOffloaded (edge cases found by an
// adversarial review): an OffloadParam parameter with no elements, and no
// other parameter held: HostGrad and HostWorking give an empty view, no
// panic.
func TestOffloadParamEdgeEmptyOnlyOffloaded(t *testing.T) {
	params := []Param{{Name: "a", Shape: []int{40}}, {Name: "empty", Shape: []int{0, 3}}, {Name: "b", Shape: []int{10}}}
	opts := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 16, Threads: 1,
		Device: scheduler.NewSim(scheduler.SimOptions{}), Placement: "cpu", OffloadParam: []string{"empty"}}
	o := newWith(t, params, opts)
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Errorf("HostGrad of an empty OffloadParam parameter panicked: %v", r)
			}
		}()
		g, err := o.HostGrad(1)
		if err != nil || g.Len != 0 {
			t.Errorf("HostGrad(empty): %+v, %v", g, err)
		}
	}()
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Errorf("HostWorking of an empty OffloadParam parameter panicked: %v", r)
			}
		}()
		if _, err := o.HostWorking(1); err != nil {
			t.Errorf("HostWorking(empty): %v", err)
		}
	}()
	fill(o, 1)
	if _, err := o.Step(StepArgs{}); err != nil {
		t.Fatal(err)
	}
}

// TestOffloadParamEdgeEmptyAfterHeld: an empty OffloadParam parameter at
// the end of the held run (its lo at the end of the held space) beside a
// real held one.
func TestOffloadParamEdgeEmptyAfterHeld(t *testing.T) {
	params := []Param{{Name: "h", Shape: []int{40}}, {Name: "empty", Shape: []int{0}}, {Name: "d", Shape: []int{10}}}
	for _, held := range [][]string{{"h", "empty"}, {"empty", "h"}, {"h"}} {
		opts := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 16, Threads: 1,
			Device: scheduler.NewSim(scheduler.SimOptions{}), Placement: "cpu", OffloadParam: held}
		o := newWith(t, params, opts)
		for i, p := range o.Params() {
			if !slices.Contains(held, p.Name) {
				if _, err := o.DeviceGrad(i); err != nil {
					t.Fatalf("%v: DeviceGrad(%s): %v", held, p.Name, err)
				}
				continue
			}
			g, err := o.HostGrad(i)
			if err != nil || g.Len != p.Len {
				t.Fatalf("%v: HostGrad(%s): %+v %v", held, p.Name, g, err)
			}
		}
		if got, want := CutSizes(params, opts), subLens(o); !slices.Equal(got, want) {
			t.Fatalf("CutSizes %v, Subgroups %v", got, want)
		}
	}
}

func subLens(o *Optimizer) []int64 {
	var s []int64
	for _, sg := range o.Subgroups() {
		s = append(s, int64(sg.Len))
	}
	return s
}

// TestOffloadParamEdgeCutSubgroups: CutSubgroups equals Subgroups with groups interleaved with OffloadParam, empty
// params between runs, params of one group separated by the other group.
func TestOffloadParamEdgeCutSubgroups(t *testing.T) {
	params := []Param{
		{Name: "w0", Shape: []int{20, 30}}, {Name: "b0", Shape: []int{30}, Group: 1},
		{Name: "e0", Shape: []int{0}}, {Name: "w1", Shape: []int{30, 25}},
		{Name: "ln", Shape: []int{25}, Group: 1}, {Name: "e1", Shape: []int{0}, Group: 1},
		{Name: "w2", Shape: []int{25, 12}}, {Name: "b2", Shape: []int{12}, Group: 1},
	}
	for _, held := range [][]string{{"w1"}, {"e0"}, {"w0", "w2"}, {"b0", "b2"}, {"e0", "e1", "w1", "ln"}, {"w0", "e0", "w1", "w2"}, {"w0", "w1", "w2", "b0", "ln", "b2", "e0", "e1"}} {
		opts := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 1, Groups: twoGroups,
			Device: scheduler.NewSim(scheduler.SimOptions{}), Placement: "cpu", OffloadParam: held}
		o := newWith(t, params, opts)
		got := CutSubgroups(params, opts)
		if !slices.Equal(got, o.Subgroups()) {
			t.Fatalf("%v: CutSubgroups %+v, Subgroups %+v", held, got, o.Subgroups())
		}
	}
}

// TestOffloadParamEdgeCheckpointResume: a checkpoint of an optimizer with
// OffloadParam, resumed without it (and the other way), continues bitwise
// as the uninterrupted reference.
func TestOffloadParamEdgeCheckpointResume(t *testing.T) {
	for _, amsgrad := range []bool{false, true} {
		for _, gd := range []adam.DType{adam.BF16, adam.F16, adam.F32} {
			h := adam.DefaultHyper()
			h.AMSGrad = amsgrad
			base := Options{Hyper: h, GradDType: gd, WorkingDType: adam.BF16, MaxGradNorm: 0.5, SubgroupSize: 400, Threads: 2}
			mk := func(off []string, s perfmodel.Schedule) *Optimizer {
				o := base
				o.Device, o.OffloadParam = scheduler.NewSim(scheduler.SimOptions{}), off
				o.Schedule = &s
				return newWith(t, testParams, o)
			}
			ref := newWith(t, testParams, base)
			held := []string{"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}
			a := mk(held, perfmodel.Schedule{CPU: 1, GPU: 1, Resident: 2})
			for step := int64(1); step <= 2; step++ {
				fill(ref, step)
				fill(a, step)
				if _, err := ref.Step(StepArgs{LossScale: 4}); err != nil {
					t.Fatal(err)
				}
				if _, err := a.Step(StepArgs{LossScale: 4}); err != nil {
					t.Fatal(err)
				}
			}
			ck, err := a.SaveCheckpoint(checkpoint.OS, t.TempDir(), nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, next := range []struct {
				off []string
				s   perfmodel.Schedule
			}{{nil, perfmodel.Schedule{CPU: 2, GPU: 1, Resident: 2}}, {held, perfmodel.Schedule{Resident: 4}}, {[]string{"wte.weight"}, perfmodel.Schedule{CPU: 2, GPU: 1}}} {
				b := mk(next.off, next.s)
				if _, _, err := b.LoadCheckpoint(checkpoint.OS, ck); err != nil {
					t.Fatalf("%v -> %v: %v", held, next.off, err)
				}
				r2 := newWith(t, testParams, base)
				if _, _, err := r2.LoadCheckpoint(checkpoint.OS, ck); err != nil {
					t.Fatal(err)
				}
				for step := int64(3); step <= 5; step++ {
					fill(r2, step)
					fill(b, step)
					if _, err := r2.Step(StepArgs{LossScale: 4}); err != nil {
						t.Fatal(err)
					}
					if _, err := b.Step(StepArgs{LossScale: 4}); err != nil {
						t.Fatal(err)
					}
				}
				sameState(t, synced(t, r2), synced(t, b))
			}
			// and the reference, uninterrupted, equals r2 after 5 steps
		}
	}
}

// TestOffloadParamEdgeSaveAsync: SaveAsync (slow flush, steps during capture) with OffloadParam through
// the GradOnDevice path, then resume without OffloadParam: bitwise the
// uninterrupted host reference.
func TestOffloadParamEdgeSaveAsync(t *testing.T) {
	h := adam.DefaultHyper()
	h.AMSGrad = true
	base := Options{Hyper: h, GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 0.5, SubgroupSize: 200, Threads: 2}
	ref := newWith(t, testParams, base)
	held := []string{"h.0.attn.c_attn.weight", "wte.weight"}
	o := base
	s := perfmodel.Schedule{CPU: 1, GPU: 1}
	o.Device, o.OffloadParam, o.Schedule = scheduler.NewSim(scheduler.SimOptions{}), held, &s
	a := newWith(t, testParams, o)
	io := newStreamIO(t, o.Device, 1<<16)
	put := func(step int64) {
		fill(ref, step)
		for i, p := range a.Params() {
			if slices.Contains(held, p.Name) {
				g, err := a.HostGrad(i)
				if err != nil {
					t.Fatal(err)
				}
				copy(g.Bytes, tensorBytes(ref.Grad(i)))
			} else {
				g, err := a.DeviceGrad(i)
				if err != nil {
					t.Fatal(err)
				}
				io.put(t, g, tensorBytes(ref.Grad(i)))
			}
		}
	}
	if err := a.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	e, err := checkpoint.NewEngine(slowOS{checkpoint.OS}, root, checkpoint.EngineOptions{ChunkBytes: 4096, RingBytes: 3 * 4096, Writers: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	var hd *checkpoint.Handle
	for step := int64(1); step <= 5; step++ {
		put(step)
		if _, err := ref.Step(StepArgs{LossScale: 2}); err != nil {
			t.Fatal(err)
		}
		if _, err := a.Step(StepArgs{LossScale: 2, GradOnDevice: true}); err != nil {
			t.Fatal(err)
		}
		if step == 2 {
			if hd, err = a.SaveAsync(e, 2, nil); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := hd.Wait(); err != nil {
		t.Fatal(err)
	}
	sameState(t, synced(t, ref), synced(t, a.workingNow(t)))
	// Resume step 2 without OffloadParam and with it, compare to a host
	// optimizer resumed from the same checkpoint.
	dir := checkpoint.StepDir(root, 2)
	for _, off := range [][]string{nil, held, {"ln_f.bias"}} {
		r := newWith(t, testParams, base)
		if _, _, err := r.LoadCheckpoint(checkpoint.OS, dir); err != nil {
			t.Fatal(err)
		}
		if r.StepCount() != 2 {
			t.Fatalf("step %d", r.StepCount())
		}
		oo := base
		oo.Device, oo.OffloadParam, oo.Placement = scheduler.NewSim(scheduler.SimOptions{}), off, "cpu"
		b := newWith(t, testParams, oo)
		if _, _, err := b.LoadCheckpoint(checkpoint.OS, dir); err != nil {
			t.Fatal(err)
		}
		for step := int64(3); step <= 5; step++ {
			fill(r, step)
			fill(b, step)
			if _, err := r.Step(StepArgs{LossScale: 2}); err != nil {
				t.Fatal(err)
			}
			if _, err := b.Step(StepArgs{LossScale: 2}); err != nil {
				t.Fatal(err)
			}
		}
		sameState(t, synced(t, r), synced(t, b))
		sameState(t, synced(t, ref), synced(t, b))
	}
}

// TestOffloadParamEdgePlanned: OffloadParam with a Profile, Replan,
// SubgroupSizes and OverlapBackward.
func TestOffloadParamEdgePlanned(t *testing.T) {
	prof := truthProfile()
	for _, held := range [][]string{{"h.0.attn.c_attn.weight"}, {"wte.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "ln_f.bias"}} {
		for _, variant := range []string{"replan", "sizes", "overlap", "static"} {
			t.Run(variant, func(t *testing.T) {
				base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 0.5, SubgroupSize: 200, Threads: 1}
				ref := newWith(t, testParams, base)
				o := base
				o.Device, o.OffloadParam, o.Profile, o.GPUBudget = scheduler.NewSim(scheduler.SimOptions{}), held, prof, 1<<20
				switch variant {
				case "replan":
					o.Replan = true
				case "sizes":
					o.SubgroupSizes = []int{100, 200, 400}
				case "overlap":
					o.OverlapBackward = true
				case "static":
					o.Placement = "static"
				}
				b, err := New(testParams, o)
				if err != nil {
					t.Fatal(err)
				}
				defer b.Close()
				for _, p := range ref.Params() {
					v, _ := ref.MasterOf(p.Name)
					if err := b.SetParam(p.Name, v); err != nil {
						t.Fatal(err)
					}
				}
				for step := int64(1); step <= 6; step++ {
					fill(ref, step)
					fill(b, step)
					if _, err := ref.Step(StepArgs{}); err != nil {
						t.Fatal(err)
					}
					if _, err := b.Step(StepArgs{}); err != nil {
						t.Fatal(err)
					}
				}
				sameState(t, synced(t, ref), synced(t, b))
				if _, ok := b.Limit(); !ok {
					t.Logf("no limit")
				}
			})
		}
	}
}

// TestOffloadParamEdgeAllHeldForcedSchedule: every parameter host-held: a
// forced Schedule that counts subgroups is refused, with a Profile or
// without (it was ignored without one).
func TestOffloadParamEdgeAllHeldForcedSchedule(t *testing.T) {
	all := []string{"wte.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "ln_f.bias"}
	o := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 1,
		Device: scheduler.NewSim(scheduler.SimOptions{}), OffloadParam: all, Schedule: &perfmodel.Schedule{CPU: 5, GPU: 2}}
	opt, err := New(testParams, o)
	if err == nil {
		defer opt.Close()
		s, _ := opt.Schedule()
		t.Errorf("forced Schedule {CPU:5 GPU:2} over 0 placeable subgroups accepted without a Profile; engine schedule %+v", s)
	}
	o.Device, o.Profile = scheduler.NewSim(scheduler.SimOptions{}), truthProfile()
	if opt, err := New(testParams, o); err == nil {
		opt.Close()
		t.Errorf("accepted with a Profile too")
	}
}

// TestOffloadParamEdgeOverlap: OverlapBackward and OffloadParam: gradients written on a trainer stream
// from the last parameter, GradsFinal after each (held ones too, their
// host gradients copied on the host), GradOnDevice steps: bitwise the
// host path, with the simulated device's ordering check.
func TestOffloadParamEdgeOverlap(t *testing.T) {
	for _, s := range []perfmodel.Schedule{{CPU: 2, GPU: 1, Resident: 1}, {CPU: 4}, {GPU: 4}, {CPU: 3, Resident: 1, UpcastOnGPU: true}} {
		base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 0.5, SubgroupSize: 400, Threads: 2}
		held := []string{"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}
		ref := newWith(t, testParams, base)
		sim := scheduler.NewSim(scheduler.SimOptions{})
		o := base
		o.Device, o.Schedule, o.OverlapBackward, o.OffloadParam = sim, &s, true, held
		b := newWith(t, testParams, o)
		io := newStreamIO(t, sim, 1<<16)
		host, err := sim.AllocHost(1 << 16)
		if err != nil {
			t.Fatal(err)
		}
		defer sim.FreeHost(host)
		if err := b.SyncDevice(); err != nil {
			t.Fatal(err)
		}
		order := []int{4, 3, 2, 1, 0}
		for step := int64(1); step <= 4; step++ {
			fill(ref, step)
			at := int64(0)
			for _, i := range order {
				src := tensorBytes(ref.Grad(i))
				if slices.Contains(held, b.Params()[i].Name) {
					hg, err := b.HostGrad(i)
					if err != nil {
						t.Fatal(err)
					}
					copy(hg.Bytes, src)
				} else {
					g, err := b.DeviceGrad(i)
					if err != nil {
						t.Fatal(err)
					}
					copy(host.Bytes()[at:], src)
					if err := sim.H2D(io.s, g.Vec.Mem, g.Vec.Off*int64(g.DType.Size()), host, at, g.Bytes()); err != nil {
						t.Fatal(err)
					}
					at += g.Bytes()
				}
				if err := b.GradsFinal(scheduler.Stream(io.s), i); err != nil {
					t.Fatal(err)
				}
			}
			if err := sim.Record(io.ev, io.s); err != nil {
				t.Fatal(err)
			}
			if err := sim.Sync(io.ev); err != nil {
				t.Fatal(err)
			}
			if _, err := ref.Step(StepArgs{}); err != nil {
				t.Fatal(err)
			}
			if _, err := b.Step(StepArgs{GradOnDevice: true}); err != nil {
				t.Fatal(err)
			}
		}
		sameState(t, synced(t, ref), synced(t, b.workingNow(t)))
		if err := sim.OrderErr(); err != nil {
			t.Fatal(err)
		}
	}
}
