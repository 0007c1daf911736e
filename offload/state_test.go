package offload

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestStateRoundTrip: a second optimizer given the first one's state
// (ReadState, WriteState, SetStepCount: what a torch state dict carries)
// steps on bit for bit with it, on the host and through the simulated
// device with CPU, streamed and resident subgroups.
func TestStateRoundTrip(t *testing.T) {
	params := []Param{{Name: "a", Shape: []int{300}}, {Name: "b", Shape: []int{17, 9}}, {Name: "c", Shape: []int{5}}}
	base := Options{Hyper: adam.Hyper{Mode: adam.AdamW, LR: 1e-2, Betas: [2]float64{0.9, 0.99}, Eps: 1e-8, WeightDecay: 0.1, AMSGrad: true},
		SubgroupSize: 100, GradDType: adam.F32}
	for _, dev := range []bool{false, true} {
		mk := func() *Optimizer {
			opts := base
			if dev {
				opts, _ = deviceOpts(opts, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 1})
				opts.WorkingDType = adam.BF16
			}
			o, err := New(params, opts)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { o.Close() })
			return o
		}
		r := rand.New(rand.NewPCG(1, 2))
		grads := func(o *Optimizer, seed uint64) {
			g := rand.New(rand.NewPCG(seed, 3))
			for i := range o.Params() {
				for j := range o.Grad(i).Float32() {
					o.Grad(i).Float32()[j] = float32(g.NormFloat64())
				}
			}
		}
		a := mk()
		for i, p := range a.Params() {
			v := make([]float32, p.Len)
			for j := range v {
				v[j] = float32(r.NormFloat64())
			}
			if err := a.SetParam(params[i].Name, v); err != nil {
				t.Fatal(err)
			}
		}
		for s := range 3 {
			grads(a, uint64(s))
			if _, err := a.Step(StepArgs{}); err != nil {
				t.Fatal(err)
			}
		}
		b := mk()
		for i, p := range a.Params() {
			for _, k := range []StateKind{MasterWeights, ExpAvg, ExpAvgSq, MaxExpAvgSq} {
				v := make([]float32, p.Len)
				if err := a.ReadState(i, k, v); err != nil {
					t.Fatal(err)
				}
				if err := b.WriteState(i, k, v); err != nil {
					t.Fatal(err)
				}
			}
		}
		if err := b.SetStepCount(a.StepCount()); err != nil {
			t.Fatal(err)
		}
		for s := 3; s < 6; s++ {
			grads(a, uint64(s))
			grads(b, uint64(s))
			for _, o := range []*Optimizer{a, b} {
				if _, err := o.Step(StepArgs{}); err != nil {
					t.Fatal(err)
				}
			}
		}
		for i, p := range a.Params() {
			for _, k := range []StateKind{MasterWeights, ExpAvg, ExpAvgSq, MaxExpAvgSq} {
				x, y := make([]float32, p.Len), make([]float32, p.Len)
				if err := a.ReadState(i, k, x); err != nil {
					t.Fatal(err)
				}
				if err := b.ReadState(i, k, y); err != nil {
					t.Fatal(err)
				}
				for j := range x {
					if math.Float32bits(x[j]) != math.Float32bits(y[j]) {
						t.Fatalf("device %v: %s %v[%d]: %v, restored %v", dev, p.Name, k, j, x[j], y[j])
					}
				}
			}
		}
	}
}

func TestStateErrors(t *testing.T) {
	o, err := New([]Param{{Name: "a", Shape: []int{4}}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		err  error
		want string
	}{
		{o.ReadState(1, ExpAvg, make([]float32, 4)), "parameter 1 of 1"},
		{o.ReadState(0, ExpAvg, make([]float32, 3)), "3 elements, want 4"},
		{o.ReadState(0, MaxExpAvgSq, make([]float32, 4)), "no amsgrad"},
		{o.WriteState(0, StateKind(9), make([]float32, 4)), "unknown StateKind(9)"},
		{o.SetStepCount(-1), "want >= 0"},
	} {
		if tc.err == nil || !strings.Contains(tc.err.Error(), tc.want) {
			t.Errorf("error %v, want %q", tc.err, tc.want)
		}
	}
	o.Close()
	if err := o.ReadState(0, ExpAvg, make([]float32, 4)); err != ErrClosed {
		t.Errorf("after Close: %v, want ErrClosed", err)
	}
}
