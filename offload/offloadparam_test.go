package offload

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// offloadCase is a TestOffloadParam case: which parameters are host-held
// and the schedule of the other subgroups.
type offloadCase struct {
	name    string
	params  []Param
	opts    Options
	offload []string
	s       perfmodel.Schedule
}

func offloadCases() []offloadCase {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 0.5, SubgroupSize: 400, Threads: 2}
	f32 := base
	f32.GradDType = adam.F32
	groups := base
	groups.Groups, groups.SubgroupSize = twoGroups, 300
	loose := base
	loose.MaxGradNorm = 1e9 // clipping that never binds
	return []offloadCase{
		// The block's matrix and bias held, the embeddings and norms not.
		{"block", testParams, base, []string{"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}, perfmodel.Schedule{CPU: 1, GPU: 1, Resident: 2}},
		{"block/resident", testParams, base, []string{"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}, perfmodel.Schedule{Resident: 4}},
		{"block/streamed", testParams, base, []string{"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}, perfmodel.Schedule{GPU: 4}},
		{"block/upcast", testParams, base, []string{"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}, perfmodel.Schedule{CPU: 3, Resident: 1, UpcastOnGPU: true}},
		{"block/no-clip", testParams, loose, []string{"h.0.attn.c_attn.weight"}, perfmodel.Schedule{CPU: 1, GPU: 1, Resident: 2}},
		{"first-and-last", testParams, f32, []string{"wte.weight", "ln_f.bias"}, perfmodel.Schedule{CPU: 2, Resident: 1}},
		{"all", testParams, base, []string{"wte.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "ln_f.bias"}, perfmodel.Schedule{}},
		{"groups", groupParams, groups, []string{"w1", "b0", "b2"}, perfmodel.Schedule{CPU: 2, GPU: 1, Resident: 1}},
	}
}

// TestOffloadParam: a trainer that streams Options.OffloadParam's
// parameters (their gradients written into HostGrad, their working copy
// read from HostWorking) and keeps the others on the device (DeviceGrad,
// DeviceWorking) gets, step after step, the state and working copy of an
// optimizer with nothing host-held, bit for bit, with clipping that binds
// and that does not, a loss scale, both gradient dtypes and parameter
// groups; every subgroup is all host-held or none, CutSizes gives the
// cut before New, and the forced schedule counts the other subgroups.
func TestOffloadParam(t *testing.T) {
	for _, c := range offloadCases() {
		t.Run("sim/"+c.name, func(t *testing.T) {
			testOffloadParam(t, c, func() scheduler.Device { return scheduler.NewSim(scheduler.SimOptions{}) },
				func(t *testing.T, d scheduler.Device) deviceIO { return newStreamIO(t, d, 1<<16) })
		})
	}
	withCUDA(t, func(t *testing.T, d *cuda.Device, k *kernels.Kernels) {
		dev := scheduler.NewCUDA(d, k)
		for _, c := range offloadCases() {
			t.Run("cuda/"+c.name, func(t *testing.T) {
				testOffloadParam(t, c, func() scheduler.Device { return dev },
					func(t *testing.T, d scheduler.Device) deviceIO { return newStreamIO(t, d, 1<<16) })
			})
		}
	})
}

func testOffloadParam(t *testing.T, c offloadCase, newDev func() scheduler.Device, newIO func(*testing.T, scheduler.Device) deviceIO) {
	ropts, dopts := c.opts, c.opts
	ropts.Device, ropts.Placement = newDev(), "cpu"
	dopts.Device, dopts.Schedule, dopts.OffloadParam = newDev(), &c.s, c.offload
	ref := newWith(t, c.params, ropts)
	o := newWith(t, c.params, dopts)
	io := newIO(t, dopts.Device)
	// The cut: each subgroup of one kind, CutSizes' lengths.
	var cut []int64
	for _, sg := range o.Subgroups() {
		cut = append(cut, int64(sg.Len))
		for _, p := range o.Params() {
			if p.Len > 0 && p.Offset < sg.Offset+sg.Len && sg.Offset < p.Offset+p.Len && slices.Contains(c.offload, p.Name) != sg.HostHeld {
				t.Fatalf("subgroup %+v holds %s (offloaded %v)", sg, p.Name, slices.Contains(c.offload, p.Name))
			}
		}
	}
	if want := CutSizes(c.params, dopts); !slices.Equal(cut, want) {
		t.Fatalf("subgroups %v, CutSizes %v", cut, want)
	}
	if want := CutSubgroups(c.params, dopts); !slices.Equal(o.Subgroups(), want) {
		t.Fatalf("subgroups %+v, CutSubgroups %+v", o.Subgroups(), want)
	}
	held := make([]bool, len(o.Params()))
	grads, works := make([]DeviceTensor, len(held)), make([]DeviceTensor, len(held))
	hgrads, hworks := make([]HostTensor, len(held)), make([]HostTensor, len(held))
	for i, p := range o.Params() {
		held[i] = slices.Contains(c.offload, p.Name)
		var err error
		if held[i] {
			if hgrads[i], err = o.HostGrad(i); err != nil {
				t.Fatal(err)
			}
			if hworks[i], err = o.HostWorking(i); err != nil {
				t.Fatal(err)
			}
			if hgrads[i].Len != p.Len || len(hgrads[i].Bytes) != p.Len*dopts.GradDType.Size() || len(hworks[i].Bytes) != 2*p.Len {
				t.Fatalf("host views of %s: %d elements, %d and %d bytes", p.Name, hgrads[i].Len, len(hgrads[i].Bytes), len(hworks[i].Bytes))
			}
			if _, err := o.DeviceGrad(i); err == nil || !strings.Contains(err.Error(), "OffloadParam") {
				t.Fatalf("DeviceGrad of host-held %s: %v", p.Name, err)
			}
			continue
		}
		if grads[i], err = o.DeviceGrad(i); err != nil {
			t.Fatal(err)
		}
		if works[i], err = o.DeviceWorking(i); err != nil {
			t.Fatal(err)
		}
		if _, err := o.HostGrad(i); err == nil || !strings.Contains(err.Error(), "OffloadParam") {
			t.Fatalf("HostGrad of %s, not host-held: %v", p.Name, err)
		}
	}
	// same checks o's working copy in its two places against ref's.
	same := func(when string) {
		t.Helper()
		for i := range held {
			want := tensorBytes(ref.Working(i))
			var got []byte
			if held[i] {
				got = hworks[i].Bytes
			} else {
				got = io.get(t, works[i])
			}
			if !slices.Equal(got, want) {
				t.Fatalf("%s: the working copy of %s (host-held %v) differs from the reference's", when, o.Params()[i].Name, held[i])
			}
		}
	}
	fill(ref, 1)
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	same("after SyncDevice")
	clipped := false
	for step := int64(1); step <= 4; step++ {
		fill(ref, step)
		for i := range held {
			if held[i] {
				copy(hgrads[i].Bytes, tensorBytes(ref.Grad(i)))
			} else {
				io.put(t, grads[i], tensorBytes(ref.Grad(i)))
			}
		}
		a, err := ref.Step(StepArgs{LossScale: 8})
		if err != nil {
			t.Fatal(err)
		}
		b, err := o.Step(StepArgs{LossScale: 8, GradOnDevice: true})
		if err != nil {
			t.Fatal(err)
		}
		if a.Step != b.Step || a.Skipped || b.Skipped || a.GradNorm != b.GradNorm || a.ClipCoef != b.ClipCoef {
			t.Fatalf("step %d: reference %v, host-held %v", step, a, b)
		}
		clipped = clipped || a.ClipCoef < 1
		same(fmt.Sprintf("step %d", step))
		if step%2 == 0 {
			sameState(t, synced(t, ref), synced(t, o.workingNow(t)))
		}
	}
	if clipped != (c.opts.MaxGradNorm < 1e9) {
		t.Fatalf("clipping bound: %v, want %v", clipped, c.opts.MaxGradNorm < 1e9)
	}
	if s, ok := o.Schedule(); !ok || s != c.s {
		t.Fatalf("schedule %+v, want %+v", s, c.s)
	}
	if sim, ok := dopts.Device.(*scheduler.Sim); ok {
		if err := sim.OrderErr(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestOffloadParamRefused: OffloadParam names parameters that exist, each
// once, none in DeviceMasters, and needs a Device; a forced schedule that
// counts the host-held subgroups is refused with a message that says so.
func TestOffloadParamRefused(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 1}
	for _, c := range []struct {
		name string
		edit func(o *Options)
		want string
	}{
		{"unknown", func(o *Options) { o.OffloadParam = []string{"nope"} }, `no parameter named "nope"`},
		{"twice", func(o *Options) { o.OffloadParam = []string{"wte.weight", "wte.weight"} }, "named twice"},
		{"master", func(o *Options) {
			o.OffloadParam, o.DeviceMasters = []string{"h.0.ln_1.weight"}, []string{"h.0.ln_1.weight"}
		}, "both Options.OffloadParam and Options.DeviceMasters"},
		{"no-device", func(o *Options) { o.Device, o.OffloadParam = nil, []string{"wte.weight"} }, "OffloadParam"},
		{"counts", func(o *Options) {
			o.OffloadParam, o.Schedule = []string{"h.0.attn.c_attn.weight"}, &perfmodel.Schedule{CPU: 5}
		}, "host-held subgroups of Options.OffloadParam are not counted"},
	} {
		t.Run(c.name, func(t *testing.T) {
			o := base
			o.Device = scheduler.NewSim(scheduler.SimOptions{})
			c.edit(&o)
			opt, err := New(testParams, o)
			if err == nil {
				opt.Close()
				t.Fatalf("New accepted %s", c.name)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("%v, want an error containing %q", err, c.want)
			}
		})
	}
}

// TestOffloadParamPlanned: the performance model plans the subgroups that
// are not host-held and counts the host-held ones as CPU work before them
// (perfmodel.Workload.HostHeld): the plan places only the others, and
// with every subgroup on the CPU its CPU busy time is that of every
// parameter, as without OffloadParam; with every parameter held the plan
// is the held work alone.
func TestOffloadParamPlanned(t *testing.T) {
	prof := &perfmodel.Profile{Format: perfmodel.ProfileFormat, Version: perfmodel.ProfileVersion,
		CPU: []perfmodel.CPUFit{{Threads: 1, GradDType: adam.BF16, Fit: perfmodel.Fit{Rate: 1e6}}},
		GPU: &perfmodel.GPUProfile{Update: perfmodel.Fit{Rate: 1e11}, H2D: perfmodel.Fit{Rate: 2e10}, D2H: perfmodel.Fit{Rate: 2e10},
			H2DBoth: perfmodel.Fit{Rate: 2e10}, D2HBoth: perfmodel.Fit{Rate: 2e10}, Convert: perfmodel.Fit{Rate: 1e12}}}
	opts := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 1, Profile: prof, Placement: "cpu",
		Device: scheduler.NewSim(scheduler.SimOptions{}), GPUBudget: 1 << 30}
	held := []string{"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}
	o := newWith(t, testParams, opts)
	opts.Device, opts.OffloadParam = scheduler.NewSim(scheduler.SimOptions{}), held
	h := newWith(t, testParams, opts)
	a, _ := o.Plan()
	b, ok := h.Plan()
	if !ok || b.CPU != 4 || a.CPU != 5 {
		t.Fatalf("plans %+v (nothing held), %+v (held), want 5 and 4 CPU subgroups", a, b)
	}
	// 832 parameters in the lanes and 816 held, at 1e6 a second: all of
	// them, as without OffloadParam.
	if got, want := b.Busy[perfmodel.ResCPU], 832e-6+816e-6; math.Abs(got-want) > 1e-9 || math.Abs(a.Busy[perfmodel.ResCPU]-want) > 1e-9 {
		t.Errorf("CPU busy with %v held: %g s, want %g", held, got, want)
	}
	opts.Device, opts.OffloadParam = scheduler.NewSim(scheduler.SimOptions{}), []string{"wte.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "ln_f.bias"}
	all := newWith(t, testParams, opts)
	if p, ok := all.Plan(); !ok || p.Schedule != (perfmodel.Schedule{}) || math.Abs(p.Makespan-1648e-6) > 1e-9 {
		t.Errorf("every parameter held: plan %+v, %v; want 1648 parameters on the CPU alone", p, ok)
	}
}
