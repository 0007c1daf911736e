package offload

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
)

var testParams = []Param{
	{Name: "wte.weight", Shape: []int{50, 16}},
	{Name: "h.0.ln_1.weight", Shape: []int{16}},
	{Name: "h.0.attn.c_attn.weight", Shape: []int{16, 48}},
	{Name: "h.0.attn.c_attn.bias", Shape: []int{48}},
	{Name: "ln_f.bias", Shape: []int{16}},
}

// fill writes a deterministic pseudo-random gradient for step t.
func fill(o *Optimizer, t int64) {
	r := rand.New(rand.NewPCG(uint64(t), 99))
	for i := range o.Params() {
		g := o.Grad(i)
		switch g.DType {
		case adam.F32:
			for j := range g.Float32() {
				g.Float32()[j] = float32(r.NormFloat64() * 0.1)
			}
		default:
			u := g.Uint16()
			for j := range u {
				f := float32(r.NormFloat64() * 0.1)
				if g.DType == adam.BF16 {
					u[j] = adam.F32ToBF16(f)
				} else {
					u[j] = adam.F32ToF16(f)
				}
			}
		}
	}
}

func newTest(t *testing.T, opts Options) *Optimizer {
	t.Helper()
	return newWith(t, testParams, opts)
}

func sameState(t *testing.T, a, b *Optimizer) {
	t.Helper()
	if a.StepCount() != b.StepCount() {
		t.Fatalf("step %d != %d", a.StepCount(), b.StepCount())
	}
	for _, pair := range [][2][]float32{{a.state.Param, b.state.Param}, {a.state.ExpAvg, b.state.ExpAvg}, {a.state.ExpAvgSq, b.state.ExpAvgSq}, {a.state.MaxExpAvgSq, b.state.MaxExpAvgSq}} {
		if len(pair[0]) != len(pair[1]) {
			t.Fatalf("length %d != %d", len(pair[0]), len(pair[1]))
		}
		for i := range pair[0] {
			if math.Float32bits(pair[0][i]) != math.Float32bits(pair[1][i]) {
				t.Fatalf("element %d: %g != %g", i, pair[0][i], pair[1][i])
			}
		}
	}
	for i := range a.work.Data {
		if a.work.Data[i] != b.work.Data[i] {
			t.Fatalf("working copy %d: %#x != %#x", i, a.work.Data[i], b.work.Data[i])
		}
	}
}

// TestSubgroupsBitwise: the subgroup cut does not change the result; bias
// correction and the step counter are global.
func TestSubgroupsBitwise(t *testing.T) {
	for _, gd := range []adam.DType{adam.F32, adam.BF16} {
		h := adam.DefaultHyper()
		h.AMSGrad = true
		one := newTest(t, Options{Hyper: h, GradDType: gd, WorkingDType: adam.BF16, MaxGradNorm: 1})
		many := []*Optimizer{
			newTest(t, Options{Hyper: h, GradDType: gd, WorkingDType: adam.BF16, MaxGradNorm: 1, SubgroupSize: one.NumParams()/2 + 1}),
			newTest(t, Options{Hyper: h, GradDType: gd, WorkingDType: adam.BF16, MaxGradNorm: 1, SubgroupSize: 7}),
		}
		if len(one.Subgroups()) != 1 || len(many[0].Subgroups()) != 2 || len(many[1].Subgroups()) != (one.NumParams()+6)/7 {
			t.Fatalf("subgroups: %d, %d, %d", len(one.Subgroups()), len(many[0].Subgroups()), len(many[1].Subgroups()))
		}
		for step := int64(1); step <= 6; step++ {
			for _, o := range append([]*Optimizer{one}, many...) {
				fill(o, step)
				if _, err := o.Step(StepArgs{LossScale: 4}); err != nil {
					t.Fatal(err)
				}
			}
		}
		for _, o := range many {
			sameState(t, one, o)
		}
	}
}

// TestClipAcrossSubgroups: a gradient of 3 in one subgroup and 4 in another
// with max_norm 1 become 0.6 and 0.8 (torch.nn.utils.clip_grad_norm_).
func TestClipAcrossSubgroups(t *testing.T) {
	h := adam.DefaultHyper()
	h.Betas[0] = 0 // exp_avg becomes the clipped gradient itself
	h.WeightDecay = 0
	o, err := New([]Param{{Name: "a", Shape: []int{1}}, {Name: "b", Shape: []int{1}}}, Options{Hyper: h, SubgroupSize: 1, MaxGradNorm: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	if len(o.Subgroups()) != 2 {
		t.Fatalf("%d subgroups, want 2", len(o.Subgroups()))
	}
	o.Grad(0).Float32()[0] = 3
	o.Grad(1).Float32()[0] = 4
	res, err := o.Step(StepArgs{})
	if err != nil {
		t.Fatal(err)
	}
	if res.GradNorm != 5 {
		t.Errorf("GradNorm %v, want 5", res.GradNorm)
	}
	// torch: clip_coef = max_norm / (total_norm + 1e-6) in fp32, evaluated
	// as (total_norm + 1e-6).reciprocal() * max_norm.
	coef := float32(1/(float32(5)+float32(1e-6))) * float32(1)
	if float32(res.ClipCoef) != coef {
		t.Errorf("ClipCoef %v, want %v", res.ClipCoef, coef)
	}
	for i, want := range []float32{0.6, 0.8} {
		got := o.state.ExpAvg[i]
		if math.Abs(float64(got-want)) > 1e-6 {
			t.Errorf("clipped gradient %d = %v, want %v", i, got, want)
		}
		if exact := float32([]float32{3, 4}[i] * coef); got != exact {
			t.Errorf("clipped gradient %d = %v, want %v (torch's fp32 product)", i, got, exact)
		}
	}
}

func TestSkippedStep(t *testing.T) {
	o := newTest(t, Options{GradDType: adam.F16, WorkingDType: adam.F16, SubgroupSize: 100})
	ref := newTest(t, Options{GradDType: adam.F16, WorkingDType: adam.F16, SubgroupSize: 100})
	fill(o, 1)
	fill(ref, 1)
	o.Step(StepArgs{LossScale: 8})
	ref.Step(StepArgs{LossScale: 8})
	// An overflowed fp16 gradient in the last subgroup only.
	fill(o, 2)
	last := len(o.Params()) - 1
	o.Grad(last).Uint16()[3] = 0x7c00
	res, err := o.Step(StepArgs{LossScale: 8})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Skipped || res.Step != 1 || o.StepCount() != 1 {
		t.Fatalf("result %+v, step %d: want skipped at step 1", res, o.StepCount())
	}
	sameState(t, o, ref) // nothing changed, in any subgroup
	fill(o, 3)
	fill(ref, 3)
	o.Step(StepArgs{LossScale: 8})
	ref.Step(StepArgs{LossScale: 8})
	sameState(t, o, ref)
	if o.StepCount() != 2 {
		t.Fatalf("step %d, want 2", o.StepCount())
	}
}

func TestStepNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are checked without -race (make test runs them)")
	}
	o := newTest(t, Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, MaxGradNorm: 1})
	fill(o, 1)
	if a := testing.AllocsPerRun(10, func() { o.Step(StepArgs{LossScale: 2}) }); a != 0 {
		t.Fatalf("Step allocates %v times", a)
	}
}

func TestNewErrors(t *testing.T) {
	for _, tc := range []struct {
		params []Param
		opts   Options
		want   string
	}{
		{nil, Options{}, "no parameters"},
		{[]Param{{Name: "a", Shape: []int{2}}, {Name: "a", Shape: []int{3}}}, Options{}, `duplicate parameter name "a"`},
		{[]Param{{Name: "", Shape: []int{2}}}, Options{}, "empty name"},
		{[]Param{{Name: "w", Shape: []int{2, -1}}}, Options{}, "negative dimension"},
		{[]Param{{Name: "w", Shape: []int{2}}}, Options{SubgroupSize: -5}, "SubgroupSize"},
		{[]Param{{Name: "w", Shape: []int{2}}}, Options{MaxGradNorm: -1}, "MaxGradNorm"},
		{[]Param{{Name: "w", Shape: []int{2}}}, Options{WorkingDType: adam.F32}, "WorkingDType"},
		{[]Param{{Name: "w", Shape: []int{2}}}, Options{Hyper: adam.Hyper{Mode: adam.AdamW, LR: -1, Eps: 1e-8}}, "lr"},
	} {
		_, err := New(tc.params, tc.opts)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%v, %v): error %v, want one containing %q", tc.params, tc.opts, err, tc.want)
		}
	}
	o := newTest(t, Options{})
	if err := o.SetParam("nope", nil); err == nil || !strings.Contains(err.Error(), `"nope"`) {
		t.Errorf("SetParam of unknown name: %v", err)
	}
	if err := o.SetParam("ln_f.bias", make([]float32, 3)); err == nil || !strings.Contains(err.Error(), "3 values") {
		t.Errorf("SetParam with wrong length: %v", err)
	}
	for _, s := range []float64{-1, 1e-40, 1e46, math.NaN(), math.Inf(1)} {
		if _, err := o.Step(StepArgs{LossScale: s}); err == nil || !strings.Contains(err.Error(), "LossScale") {
			t.Errorf("loss scale %v: %v", s, err)
		}
	}
	if o.StepCount() != 0 {
		t.Errorf("refused steps advanced the counter to %d", o.StepCount())
	}
	if _, err := New([]Param{{Name: "w\xff", Shape: []int{1}}}, Options{}); err == nil || !strings.Contains(err.Error(), "UTF-8") {
		t.Errorf("invalid UTF-8 name: %v", err)
	}
}

// master returns parameter i's master weights, failing the test on error.
func master(t testing.TB, o *Optimizer, i int) []float32 {
	t.Helper()
	m, err := o.Master(i)
	if err != nil {
		t.Fatal(err)
	}
	return m
}
