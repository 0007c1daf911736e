package offload

import (
	"errors"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/scheduler"
)

// gradAt is a deterministic gradient element of tensor name at step.
func gradAt(name string, step, i int) float32 {
	h := 0
	for _, c := range name {
		h = h*31 + int(c)
	}
	return float32(math.Sin(float64(h%1000+7*i+13*step))) * 0.3
}

// TestStepReduce: two optimizers that each hold a shard of the model (the
// first two tensors, the rest), their sums of squares combined through
// StepArgs.Reduce, step as one optimizer over the whole model: the same
// gradient norm, clip coefficient and master weights (within float
// tolerance: the sum of squares is associated differently); a non-finite
// gradient in one shard skips the step on both; a Reduce that fails fails
// the Step with nothing changed.
func TestStepReduce(t *testing.T) {
	t.Run("host", func(t *testing.T) { testStepReduce(t, nil) })
	t.Run("sim", func(t *testing.T) {
		testStepReduce(t, func() scheduler.Device { return scheduler.NewSim(scheduler.SimOptions{}) })
	})
}

func testStepReduce(t *testing.T, dev func() scheduler.Device) {
	opts := func() Options {
		o := Options{SubgroupSize: 300, MaxGradNorm: 0.5, Threads: 2, WorkingDType: adam.BF16}
		if dev != nil {
			o.Device, o.GPUBudget = dev(), 1<<20
		}
		return o
	}
	whole := newWith(t, testParams, opts())
	shards := [2]*Optimizer{newWith(t, testParams[:2], opts()), newWith(t, testParams[2:], opts())}
	owner := func(name string) *Optimizer {
		for _, o := range shards {
			if _, err := o.Index(name); err == nil {
				return o
			}
		}
		t.Fatalf("no shard holds %s", name)
		return nil
	}
	for i, p := range whole.Params() {
		v := make([]float32, p.Len)
		for j := range v {
			v[j] = gradAt(p.Name, -1, j)
		}
		if err := whole.SetParam(p.Name, v); err != nil {
			t.Fatal(err)
		}
		if err := owner(p.Name).SetParam(p.Name, v); err != nil {
			t.Fatal(err)
		}
		_ = i
	}
	if dev != nil {
		if s, ok := shards[1].Schedule(); !ok || s.CPU+s.GPU+s.Resident == 0 {
			t.Fatalf("no device schedule: %+v %v", s, ok)
		}
	}
	// step writes step's gradients (a NaN in element 0 of ln_f.bias with
	// bad) into every optimizer, steps the whole one and the shards (one
	// goroutine each, meeting in Reduce) and returns the results.
	step := func(s int, bad bool, fail error) (StepResult, [2]StepResult, [2]error) {
		for _, o := range append([]*Optimizer{whole}, shards[:]...) {
			for i, p := range o.Params() {
				g := o.Grad(i).Float32()
				for j := range g {
					g[j] = gradAt(p.Name, s, j)
				}
				if bad && p.Name == "ln_f.bias" {
					g[0] = float32(math.NaN())
				}
			}
		}
		wr, err := whole.Step(StepArgs{})
		if err != nil {
			t.Fatal(err)
		}
		var rs [2]StepResult
		var errs [2]error
		var ss [2]float64
		var mu sync.Mutex
		var met sync.WaitGroup
		met.Add(2)
		var wg sync.WaitGroup
		for r, o := range shards {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rs[r], errs[r] = o.Step(StepArgs{Reduce: func(x float64) (float64, error) {
					mu.Lock()
					ss[r] = x
					mu.Unlock()
					met.Done()
					met.Wait()
					if fail != nil {
						return 0, fail
					}
					mu.Lock()
					defer mu.Unlock()
					return ss[0] + ss[1], nil // rank order
				}})
			}()
		}
		wg.Wait()
		return wr, rs, errs
	}
	for s := range 4 {
		wr, rs, errs := step(s, false, nil)
		for r := range 2 {
			if errs[r] != nil {
				t.Fatalf("step %d rank %d: %v", s, r, errs[r])
			}
			if math.Abs(rs[r].GradNorm-wr.GradNorm) > 1e-12*wr.GradNorm || rs[r].ClipCoef != wr.ClipCoef || rs[r].Skipped {
				t.Fatalf("step %d rank %d: norm %v coef %v skipped %v; whole %v, %v", s, r, rs[r].GradNorm, rs[r].ClipCoef, rs[r].Skipped, wr.GradNorm, wr.ClipCoef)
			}
		}
		if wr.ClipCoef >= 1 {
			t.Fatalf("step %d: clip coefficient %v: the test does not clip", s, wr.ClipCoef)
		}
	}
	for i, p := range whole.Params() {
		want := master(t, whole, i)
		o := owner(p.Name)
		j, _ := o.Index(p.Name)
		got := master(t, o, j)
		for k := range want {
			if d := math.Abs(float64(got[k] - want[k])); d > 1e-6*math.Abs(float64(want[k]))+1e-9 {
				t.Fatalf("%s[%d]: shard %v, whole %v", p.Name, k, got[k], want[k])
			}
		}
	}
	// A NaN in the second shard skips the step on both.
	before := shards[0].StepCount()
	wr, rs, errs := step(9, true, nil)
	if !wr.Skipped || errs[0] != nil || errs[1] != nil || !rs[0].Skipped || !rs[1].Skipped || shards[0].StepCount() != before {
		t.Fatalf("NaN in shard 1: whole skipped %v; shards %v %v (%v, %v); step count %d, was %d", wr.Skipped, rs[0].Skipped, rs[1].Skipped, errs[0], errs[1], shards[0].StepCount(), before)
	}
	// A Reduce that fails fails the Step, nothing changed.
	_, _, errs = step(10, false, errors.New("rank 1 lost"))
	for r := range 2 {
		if errs[r] == nil || !strings.Contains(errs[r].Error(), "StepArgs.Reduce: rank 1 lost") || shards[r].StepCount() != before {
			t.Errorf("rank %d: %v, step count %d (was %d)", r, errs[r], shards[r].StepCount(), before)
		}
	}
}
