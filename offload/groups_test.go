package offload

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// groupParams interleaves two groups, as a model's weights (decayed) and
// biases and norms (not).
var groupParams = []Param{
	{Name: "w0", Shape: []int{20, 30}}, {Name: "b0", Shape: []int{30}, Group: 1},
	{Name: "w1", Shape: []int{30, 25}}, {Name: "ln.weight", Shape: []int{25}, Group: 1},
	{Name: "w2", Shape: []int{25, 12}}, {Name: "b2", Shape: []int{12}, Group: 1},
}

var twoGroups = []Group{{LR: 1e-2, WeightDecay: 0.1}, {LR: 3e-3, WeightDecay: 0}}

// fillByName writes a gradient into each parameter of o that depends on
// its name and t only, and sets the initial weights likewise at t = 0.
func fillByName(t *testing.T, o *Optimizer, step int64) {
	t.Helper()
	for i, p := range o.Params() {
		var seed uint64
		for _, c := range p.Name {
			seed = seed*131 + uint64(c)
		}
		r := rand.New(rand.NewPCG(seed, uint64(step)))
		v := make([]float32, p.Len)
		for j := range v {
			v[j] = float32(r.NormFloat64() * 0.1)
		}
		if step == 0 {
			if err := o.SetParam(p.Name, v); err != nil {
				t.Fatal(err)
			}
			continue
		}
		g := o.Grad(i)
		if g.DType == adam.F32 {
			copy(g.Float32(), v)
			continue
		}
		u := g.Uint16()
		for j := range u {
			u[j] = adam.F32ToBF16(v[j])
		}
	}
}

// TestGroupsMatchSeparateOptimizers: an optimizer with two parameter
// groups (their own lr and weight_decay) updates each parameter bitwise as
// an optimizer holding only that parameter's group with those
// hyperparameters, on the host and through the engine on the simulated
// device; subgroups never straddle groups.
func TestGroupsMatchSeparateOptimizers(t *testing.T) {
	for _, device := range []bool{false, true} {
		t.Run(fmt.Sprintf("device=%v", device), func(t *testing.T) {
			base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2}
			opts := base
			opts.Groups = twoGroups
			if device {
				// 600+750+300 = 1650 weights: 6 subgroups; 67 others: 1.
				opts, _ = deviceOpts(opts, perfmodel.Schedule{CPU: 3, GPU: 2, Resident: 2})
			}
			o := newGrouped(t, groupParams, opts)
			for _, sg := range o.Subgroups() {
				for _, p := range o.Params() {
					if p.Offset < sg.Offset+sg.Len && sg.Offset < p.Offset+p.Len && p.Group != sg.Group {
						t.Fatalf("subgroup %+v holds %q of group %d", sg, p.Name, p.Group)
					}
				}
			}
			var refs []*Optimizer
			for g, grp := range twoGroups {
				var ps []Param
				for _, p := range groupParams {
					if p.Group == g {
						ps = append(ps, Param{Name: p.Name, Shape: p.Shape})
					}
				}
				ro := base
				ro.Hyper = adam.DefaultHyper()
				ro.Hyper.LR, ro.Hyper.WeightDecay = grp.LR, grp.WeightDecay
				refs = append(refs, newGrouped(t, ps, ro))
			}
			for step := int64(0); step <= 3; step++ {
				for _, x := range append([]*Optimizer{o}, refs...) {
					fillByName(t, x, step)
					if step > 0 {
						if _, err := x.Step(StepArgs{}); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
			for _, p := range groupParams {
				got, err := o.MasterOf(p.Name)
				if err != nil {
					t.Fatal(err)
				}
				want, err := refs[p.Group].MasterOf(p.Name)
				if err != nil {
					t.Fatal(err)
				}
				for j := range got {
					if math.Float32bits(got[j]) != math.Float32bits(want[j]) {
						t.Fatalf("%s[%d]: %v with groups, %v alone", p.Name, j, got[j], want[j])
					}
				}
			}
		})
	}
}

func newGrouped(t *testing.T, ps []Param, opts Options) *Optimizer {
	t.Helper()
	o, err := New(ps, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	return o
}

// TestGroupsCheckpoint: the groups' lr and weight_decay are saved and
// restored (SetGroupLR's change undone by LoadCheckpoint); a checkpoint of
// other groups is refused, naming the difference.
func TestGroupsCheckpoint(t *testing.T) {
	opts := Options{SubgroupSize: 300, Groups: append([]Group(nil), twoGroups...)}
	o := newGrouped(t, groupParams, opts)
	fillByName(t, o, 0)
	fillByName(t, o, 1)
	mustStep(t, o)
	root := t.TempDir()
	if _, err := o.SaveCheckpoint(checkpoint.OS, root, nil); err != nil {
		t.Fatal(err)
	}
	if err := o.SetGroupLR(1, 0.5); err != nil {
		t.Fatal(err)
	}
	if err := o.SetGroupLR(2, 0.5); err == nil {
		t.Error("SetGroupLR of a group that does not exist accepted")
	}
	if got := o.Options().Groups[1].LR; got != 0.5 {
		t.Fatalf("group 1's lr %v after SetGroupLR", got)
	}
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	if got := o.Options().Groups; got[0] != twoGroups[0] || got[1] != twoGroups[1] {
		t.Fatalf("groups after LoadCheckpoint: %+v, want %+v", got, twoGroups)
	}
	one := newGrouped(t, []Param{{Name: "w0", Shape: []int{20, 30}}, {Name: "b0", Shape: []int{30}}, {Name: "w1", Shape: []int{30, 25}},
		{Name: "ln.weight", Shape: []int{25}}, {Name: "w2", Shape: []int{25, 12}}, {Name: "b2", Shape: []int{12}}}, Options{SubgroupSize: 300})
	if _, _, err := one.LoadCheckpoint(checkpoint.OS, root); err == nil || !strings.Contains(err.Error(), "2 parameter groups") {
		t.Errorf("a checkpoint of two groups into one: %v", err)
	}
	moved := append([]Param(nil), groupParams...)
	moved[1].Group = 0
	other := newGrouped(t, moved, Options{SubgroupSize: 300, Groups: twoGroups})
	if _, _, err := other.LoadCheckpoint(checkpoint.OS, root); err == nil || !strings.Contains(err.Error(), `"b0" was in group 1`) {
		t.Errorf("a parameter in another group: %v", err)
	}
}

func TestGroupsValidate(t *testing.T) {
	for _, tc := range []struct {
		params []Param
		groups []Group
		want   string
	}{
		{[]Param{{Name: "a", Shape: []int{2}, Group: 1}}, nil, "group 1"},
		{[]Param{{Name: "a", Shape: []int{2}, Group: 2}}, twoGroups, "group 2"},
		{[]Param{{Name: "a", Shape: []int{2}}}, []Group{{LR: -1}}, "Groups[0]"},
		{[]Param{{Name: "a", Shape: []int{2}}}, []Group{{LR: 1e-3, WeightDecay: math.Inf(1)}}, "Groups[0]"},
	} {
		if _, err := New(tc.params, Options{Groups: tc.groups}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v %+v: %v, want %q", tc.params, tc.groups, err, tc.want)
		}
	}
}

// TestGroupsWithProfile: with groups, the performance model plans the
// real subgroups (each group cut apart), on the host and with a device;
// the caller's Groups slice is not the optimizer's.
func TestGroupsWithProfile(t *testing.T) {
	prof := &perfmodel.Profile{Format: perfmodel.ProfileFormat, Version: perfmodel.ProfileVersion,
		CPU: []perfmodel.CPUFit{{Threads: 1, GradDType: adam.BF16, Fit: perfmodel.Fit{Rate: 1e9}}, {Threads: 1, GradDType: adam.F32, Fit: perfmodel.Fit{Rate: 1e9}}},
		GPU: &perfmodel.GPUProfile{Update: perfmodel.Fit{Rate: 1e11}, H2D: perfmodel.Fit{Rate: 2e10}, D2H: perfmodel.Fit{Rate: 2e10},
			H2DBoth: perfmodel.Fit{Rate: 2e10}, D2HBoth: perfmodel.Fit{Rate: 2e10}, Convert: perfmodel.Fit{Rate: 1e12}}}
	gs := append([]Group(nil), twoGroups...)
	for _, device := range []bool{false, true} {
		opts := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 1, Groups: gs, Profile: prof}
		if device {
			opts.Device, opts.GPUBudget = scheduler.NewSim(scheduler.SimOptions{}), 1<<30
		}
		o := newGrouped(t, groupParams, opts)
		plan, ok := o.Plan()
		if !ok || plan.CPU+plan.GPU+plan.Resident != len(o.Subgroups()) || len(o.Subgroups()) != 7 {
			t.Fatalf("device=%v: plan %+v for %d subgroups", device, plan, len(o.Subgroups()))
		}
		if err := o.SetGroupLR(1, 0.5); err != nil {
			t.Fatal(err)
		}
	}
	if gs[1].LR != twoGroups[1].LR {
		t.Fatalf("SetGroupLR changed the caller's Groups: %+v", gs)
	}
}
