package offload

import (
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// TestSubgroupSizes: with Options.SubgroupSizes New keeps the candidate
// whose plan the model predicts fastest (here the smallest: it packs a
// small budget with resident subgroups where the whole model fits none),
// reports it in Options, and the steps are bit for bit the CPU-only
// optimizer's. Without a profile, or with a forced Schedule, the first
// candidate is taken; no Device is refused.
func TestSubgroupSizes(t *testing.T) {
	prof := truthProfile()
	for i := range prof.CPU {
		prof.CPU[i].Fit.LatencyS = 1e-9 // rates, not latencies, decide at these sizes
	}
	g := prof.GPU
	for _, f := range []*perfmodel.Fit{&g.Update, &g.H2D, &g.D2H, &g.H2DBoth, &g.D2HBoth, &g.Convert} {
		f.LatencyS = 1e-9
	}
	sim := scheduler.NewSim(scheduler.SimOptions{})
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, Threads: 2, MaxGradNorm: 1}
	cands := []int{2000, 400, 100}
	budget := int64(12 * 800)
	opts := base
	opts.Device, opts.Profile, opts.GPUBudget, opts.SubgroupSizes = sim, prof, budget, cands
	o := newWith(t, testParams, opts)
	// The oracle: the model's plan at each size, directly.
	times := map[int]float64{}
	for _, c := range cands {
		w := perfmodel.Workload{Params: 1648, SubgroupSize: int64(c), GradDType: adam.BF16, CopyBytes: 2, Threads: 2, GPUBudget: budget}
		p, err := prof.Choose(w)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("size %d: %+v, %.3g s", c, p.Schedule, p.Makespan)
		times[c] = p.Makespan
	}
	fastest := min(times[cands[0]], times[cands[1]], times[cands[2]])
	want := 0
	for _, c := range cands { // the largest within 2 % of the fastest
		if times[c] <= 1.02*fastest && c > want {
			want = c
		}
	}
	if got := o.Options().SubgroupSize; got != want || want == cands[0] {
		t.Fatalf("chose subgroups of %d, want %d (the model's fastest, not the first candidate %d)", got, want, cands[0])
	}
	if s, _ := o.Schedule(); s.Resident == 0 {
		t.Errorf("schedule %+v: want resident subgroups in the %d-byte budget", s, budget)
	}
	ref := newWith(t, testParams, base)
	r := rand.New(rand.NewPCG(7, 8))
	for step := 0; step < 5; step++ {
		if a, b := stepBoth(t, ref, o, r); a.GradNorm != b.GradNorm {
			t.Fatalf("step %d: grad norm %v against the CPU's %v", step+1, b.GradNorm, a.GradNorm)
		}
	}
	sameState(t, synced(t, ref), synced(t, o))

	noProf := base
	noProf.Device, noProf.GPUBudget, noProf.SubgroupSizes = sim, budget, cands
	if got := newWith(t, testParams, noProf).Options().SubgroupSize; got != cands[0] {
		t.Errorf("without a profile: subgroups of %d, want the first candidate %d", got, cands[0])
	}
	forced := noProf
	forced.Profile, forced.Schedule = prof, &perfmodel.Schedule{CPU: 1} // counts for the first size: one subgroup
	if got := newWith(t, testParams, forced).Options().SubgroupSize; got != cands[0] {
		t.Errorf("with a forced schedule: subgroups of %d, want the first candidate %d", got, cands[0])
	}
	for _, bad := range []Options{
		{SubgroupSizes: cands, WorkingDType: adam.BF16},
		{SubgroupSizes: []int{100, 0}, WorkingDType: adam.BF16, Device: sim},
	} {
		if _, err := New(testParams, bad); err == nil {
			t.Errorf("New with SubgroupSizes %v, Device %v, Schedule %v: no error", bad.SubgroupSizes, bad.Device != nil, bad.Schedule)
		}
	}
}

// TestCutSizes: CutSizes gives, before New, the lengths of the subgroups
// New cuts, with and without parameter groups.
func TestCutSizes(t *testing.T) {
	grouped := slices.Clone(testParams)
	for i := range grouped {
		grouped[i].Group = i % 2
	}
	for _, c := range []struct {
		params []Param
		opts   Options
	}{
		{testParams, Options{SubgroupSize: 300}},
		{testParams, Options{}},
		{grouped, Options{SubgroupSize: 100, Groups: []Group{{LR: 1e-3}, {LR: 1e-4}}}},
	} {
		o := newWith(t, c.params, c.opts)
		var want []int64
		for _, sg := range o.Subgroups() {
			want = append(want, int64(sg.Len))
		}
		if got := CutSizes(c.params, c.opts); !slices.Equal(got, want) {
			t.Errorf("CutSizes with %+v: %v, New cut %v", c.opts, got, want)
		}
	}
}

// TestCheckpointHyper: the hyperparameters and groups a checkpoint was
// saved with, read without loading it; a root with none is an error.
func TestCheckpointHyper(t *testing.T) {
	h := adam.DefaultHyper()
	h.Betas, h.Eps = [2]float64{0.8, 0.9}, 1e-6
	grouped := slices.Clone(testParams)
	for i := range grouped {
		grouped[i].Group = i % 2
	}
	groups := []Group{{LR: 1e-3, WeightDecay: 0.1}, {LR: 1e-4}}
	o := newWith(t, grouped, Options{Hyper: h, Groups: groups})
	root := t.TempDir()
	if _, err := o.SaveCheckpoint(checkpoint.OS, root, nil); err != nil {
		t.Fatal(err)
	}
	dir, got, gotGroups, err := CheckpointHyper(checkpoint.OS, root)
	if err != nil {
		t.Fatal(err)
	}
	if got.Betas != h.Betas || got.Eps != h.Eps || !slices.Equal(gotGroups, groups) || filepath.Dir(dir) != root {
		t.Errorf("CheckpointHyper(%s) = %s, %+v, %+v; want betas %v, eps %g, groups %+v", root, dir, got, gotGroups, h.Betas, h.Eps, groups)
	}
	if _, _, _, err := CheckpointHyper(checkpoint.OS, t.TempDir()); err == nil {
		t.Error("an empty root: no error")
	}
}

// TestPredictUpdate: PredictUpdate, which allocates nothing, gives the
// plan New makes with the same options (the candidate size it keeps,
// OffloadParam's subgroups host-held, the budget), on a device or with
// none; without a profile it is refused.
func TestPredictUpdate(t *testing.T) {
	prof := truthProfile()
	for i := range prof.CPU {
		prof.CPU[i].Fit.LatencyS = 1e-9
	}
	g := prof.GPU
	for _, f := range []*perfmodel.Fit{&g.Update, &g.H2D, &g.D2H, &g.H2DBoth, &g.D2HBoth, &g.Convert} {
		f.LatencyS = 1e-9
	}
	for _, held := range [][]string{nil, {"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}} {
		opts := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, Threads: 2, MaxGradNorm: 1, Device: scheduler.NewSim(scheduler.SimOptions{}),
			Profile: prof, GPUBudget: 12 * 800, SubgroupSizes: []int{2000, 400, 100}, OffloadParam: held}
		o := newWith(t, testParams, opts)
		want, ok := o.Plan()
		if !ok {
			t.Fatal("New made no plan")
		}
		for _, dev := range []bool{true, false} {
			po := opts
			if !dev {
				po.Device = nil
			}
			got, err := PredictUpdate(testParams, po)
			if err != nil || got.Makespan != want.Makespan || got.Schedule != want.Schedule {
				t.Errorf("held %v, device %v: %+v %v, want New's %+v", held, dev, got, err, want)
			}
		}
	}
	if _, err := PredictUpdate(testParams, Options{}); err == nil || !strings.Contains(err.Error(), "needs Options.Profile") {
		t.Errorf("no profile: %v", err)
	}
}
