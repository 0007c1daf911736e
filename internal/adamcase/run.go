package adamcase

import (
	"fmt"
	"math"

	"github.com/deepstates/dos/adam"
)

// Tolerances of the adam-case/v1 schema.
const (
	// MaxRelErr bounds the error metric of every fp32 state tensor.
	MaxRelErr = 1e-5
)

// Backend is one implementation of the optimizer step that cases are replayed
// on: the scalar reference, a SIMD path, a pool of CPU workers, or a device.
type Backend interface {
	// Name identifies the backend in reports, e.g. "cpu/scalar".
	Name() string
	// AllFinite reports whether g has no Inf or NaN (adam.AllFinite).
	AllFinite(g adam.Grad) (bool, error)
	// Step applies one step in place, with adam.Step's semantics.
	Step(c *adam.Coeffs, s adam.State, g adam.Grad, out adam.Copy16) error
}

// Result is the outcome of one case on one backend.
type Result struct {
	Case    string
	Backend string
	N       int     // parameters
	Calls   int     // gradients replayed
	MaxErr  float64 // max of the schema's metric over every compared fp32 tensor
	Worst   string  // the tensor where MaxErr was reached, e.g. "exp_avg_sq.3"
	Ulp16   int     // 16-bit copy elements 1 ulp off where the fp32 master differs too
	Step    int64   // step counter at the end
	Err     error   // nil when the case passed
}

// Passed reports whether the case passed.
func (r Result) Passed() bool { return r.Err == nil }

// RelErr is the schema's metric: max_i |got_i - want_i| / max(|want_i|, rms(want)).
// Two NaNs agree; a NaN against a number is +Inf. Panics if lengths differ.
func RelErr(got, want []float32) float64 {
	if len(got) != len(want) {
		panic("adamcase: RelErr length mismatch")
	}
	var ss float64
	for _, w := range want {
		if !math.IsNaN(float64(w)) && !math.IsInf(float64(w), 0) {
			ss += float64(w) * float64(w)
		}
	}
	rms := 0.0
	if len(want) > 0 {
		rms = math.Sqrt(ss / float64(len(want)))
	}
	worst := 0.0
	for i := range got {
		g, w := float64(got[i]), float64(want[i])
		var e float64
		switch {
		case math.IsNaN(g) || math.IsNaN(w):
			if !(math.IsNaN(g) && math.IsNaN(w)) {
				e = math.Inf(1)
			}
		case math.IsInf(w, 0) || math.IsInf(g, 0):
			if g != w {
				e = math.Inf(1)
			}
		default:
			d := math.Abs(g - w)
			den := math.Max(math.Abs(w), rms)
			if d == 0 {
				e = 0
			} else if den == 0 {
				e = math.Inf(1)
			} else {
				e = d / den
			}
		}
		if e > worst || math.IsNaN(e) {
			worst = e
		}
	}
	return worst
}

// check16 compares a 16-bit copy: bit-exact, except where our fp32 master
// differs from PyTorch's, where one unit in the last place is allowed. It
// returns how many elements used that allowance, and an error for the first
// element beyond it.
func check16(name string, got, want []uint16, gotMaster, wantMaster []float32) (int, error) {
	ulp := 0
	for i := range got {
		if got[i] == want[i] {
			continue
		}
		if wantMaster != nil && math.Float32bits(gotMaster[i]) != math.Float32bits(wantMaster[i]) && ordered16(got[i], want[i]) <= 1 {
			ulp++
			continue
		}
		return ulp, fmt.Errorf("%s[%d] = %#04x, want %#04x (master %g, PyTorch's %s)",
			name, i, got[i], want[i], gotMaster[i], masterStr(wantMaster, i))
	}
	return ulp, nil
}

func masterStr(m []float32, i int) string {
	if m == nil {
		return "not stored"
	}
	return fmt.Sprint(m[i])
}

// ordered16 returns the distance between two 16-bit float bit patterns in
// representable steps (sign-magnitude mapped onto a line).
func ordered16(a, b uint16) int {
	key := func(h uint16) int {
		if h&0x8000 != 0 {
			return -int(h & 0x7fff)
		}
		return int(h)
	}
	d := key(a) - key(b)
	if d < 0 {
		d = -d
	}
	return d
}

// Run replays c on b and compares every expected tensor. The case's own
// state is not modified.
func Run(c *Case, b Backend) Result {
	r := Result{Case: c.Name, Backend: b.Name(), N: c.N(), Calls: len(c.Grads)}
	r.Err = run(c, b, &r)
	return r
}

func run(c *Case, b Backend, r *Result) error {
	s := c.Init.Clone()
	n := c.N()
	unscale := float32(1)
	if c.GradScale != 0 {
		unscale = float32(1 / c.GradScale)
	}
	var out adam.Copy16
	for _, e := range c.Expected {
		if e.ParamBF16 != nil && out.DType == 0 {
			out = adam.Copy16{DType: adam.BF16, Data: make([]uint16, n)}
		}
	}
	for _, e := range c.Expected {
		if e.ParamFP16 != nil {
			if out.DType == 0 {
				out = adam.Copy16{DType: adam.F16, Data: make([]uint16, n)}
			}
		}
	}
	conv := make([]uint16, n)
	step := c.Step0
	for i, g := range c.Grads {
		t := i + 1
		e := c.Expected[i]
		finite, err := b.AllFinite(g)
		if err != nil {
			return fmt.Errorf("call %d: non-finite check: %w", t, err)
		}
		if finite == e.Skipped {
			if e.Skipped {
				return fmt.Errorf("call %d: PyTorch skipped it (non-finite gradient) but the backend found the gradient finite", t)
			}
			return fmt.Errorf("call %d: the backend found a non-finite gradient but PyTorch did not skip", t)
		}
		if !finite {
			continue // skipped: nothing changes; the expected tensors, if any, equal the previous state
		}
		step++
		co := c.Hyper.Coeffs(step, unscale, 1)
		if err := b.Step(&co, s, g, out); err != nil {
			return fmt.Errorf("call %d: %w", t, err)
		}
		for _, x := range []struct {
			name      string
			got, want []float32
		}{{"param", s.Param, e.Param}, {"exp_avg", s.ExpAvg, e.ExpAvg}, {"exp_avg_sq", s.ExpAvgSq, e.ExpAvgSq}, {"max_exp_avg_sq", s.MaxExpAvgSq, e.MaxExpAvgSq}} {
			if x.want == nil {
				continue
			}
			if x.got == nil {
				return fmt.Errorf("call %d: %s expected but the backend keeps none", t, x.name)
			}
			if err := RelErr(x.got, x.want); err > r.MaxErr || math.IsNaN(err) {
				r.MaxErr = err
				r.Worst = fmt.Sprintf("%s.%d", x.name, t)
			}
		}
		for _, x := range []struct {
			name string
			d    adam.DType
			want []uint16
		}{{"param_bf16", adam.BF16, e.ParamBF16}, {"param_fp16", adam.F16, e.ParamFP16}} {
			if x.want == nil {
				continue
			}
			got := out.Data
			if x.d != out.DType {
				adam.Round16(x.d, conv, s.Param)
				got = conv
			}
			ulp, err := check16(fmt.Sprintf("%s.%d", x.name, t), got, x.want, s.Param, e.Param)
			r.Ulp16 += ulp
			if err != nil {
				return err
			}
		}
	}
	r.Step = step
	if r.MaxErr > MaxRelErr || math.IsNaN(r.MaxErr) {
		return fmt.Errorf("max error %.3g at %s exceeds %g", r.MaxErr, r.Worst, MaxRelErr)
	}
	if step != c.FinalStep {
		return fmt.Errorf("final step counter %d, want %d", step, c.FinalStep)
	}
	return nil
}

// Scalar is the Backend of the scalar reference, adam.Generic on the calling
// goroutine.
type Scalar struct{}

// Name returns "cpu/scalar".
func (Scalar) Name() string { return "cpu/scalar" }

// AllFinite calls adam.Generic.GradStats.
func (Scalar) AllFinite(g adam.Grad) (bool, error) {
	ok, _ := adam.Generic.GradStats(g, 1)
	return ok, nil
}

// Step calls adam.Generic.Step.
func (Scalar) Step(c *adam.Coeffs, s adam.State, g adam.Grad, out adam.Copy16) error {
	adam.Generic.Step(c, s, g, out)
	return nil
}

// PathBackend is the Backend of one adam.Path (a SIMD kernel) on the
// calling goroutine.
type PathBackend struct{ P adam.Path }

// Name returns "cpu/<path>", e.g. "cpu/avx512".
func (b PathBackend) Name() string { return "cpu/" + b.P.Name() }

// AllFinite calls the path's GradStats.
func (b PathBackend) AllFinite(g adam.Grad) (bool, error) {
	ok, _ := b.P.GradStats(g, 1)
	return ok, nil
}

// Step calls the path's Step.
func (b PathBackend) Step(c *adam.Coeffs, s adam.State, g adam.Grad, out adam.Copy16) error {
	b.P.Step(c, s, g, out)
	return nil
}

// Pool is the Backend of an adam.Pool (the pool's path across goroutines).
type Pool struct{ P *adam.Pool }

// Name returns "cpu/pool-<threads>/<path>".
func (p Pool) Name() string { return fmt.Sprintf("cpu/pool-%d/%s", p.P.Threads(), p.P.Path().Name()) }

// AllFinite calls the pool's AllFinite.
func (p Pool) AllFinite(g adam.Grad) (bool, error) { return p.P.AllFinite(g), nil }

// Step calls the pool's Step.
func (p Pool) Step(c *adam.Coeffs, s adam.State, g adam.Grad, out adam.Copy16) error {
	p.P.Step(c, s, g, out)
	return nil
}

// Backends returns every CPU backend of this machine: the scalar
// reference, each SIMD path, and a pool of threads goroutines on the
// default path; release stops the pool.
func Backends(threads int) (bs []Backend, release func()) {
	bs = []Backend{Scalar{}}
	for _, p := range adam.Paths()[1:] {
		bs = append(bs, PathBackend{P: p})
	}
	pool := adam.NewPool(threads)
	return append(bs, Pool{P: pool}), pool.Close
}
