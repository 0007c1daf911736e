package adam

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// randomProblem returns a state and gradient of n elements with values of
// mixed magnitude.
func randomProblem(n int, gd DType, amsgrad bool, seed uint64) (State, Grad) {
	r := rand.New(rand.NewPCG(seed, 7))
	s := State{Param: make([]float32, n), ExpAvg: make([]float32, n), ExpAvgSq: make([]float32, n)}
	if amsgrad {
		s.MaxExpAvgSq = make([]float32, n)
	}
	g32 := make([]float32, n)
	for i := range n {
		s.Param[i] = float32(r.NormFloat64())
		s.ExpAvg[i] = float32(r.NormFloat64() * 1e-2)
		s.ExpAvgSq[i] = float32(r.Float64() * 1e-4)
		if amsgrad {
			s.MaxExpAvgSq[i] = s.ExpAvgSq[i] * float32(1+r.Float64())
		}
		g32[i] = float32(r.NormFloat64() * math.Pow(10, float64(r.IntN(6)-4)))
	}
	switch gd {
	case BF16, F16:
		u := make([]uint16, n)
		for i, f := range g32 {
			if gd == BF16 {
				u[i] = F32ToBF16(f)
			} else {
				u[i] = F32ToF16(f)
			}
		}
		return s, Grad16(gd, u)
	}
	return s, GradF32(g32)
}

// sameStateBits fails t unless got is want bit for bit: the master
// weights, exp_avg and exp_avg_sq, and max_exp_avg_sq with amsgrad.
func sameStateBits(t *testing.T, what string, want, got State, amsgrad bool) {
	t.Helper()
	sameBits(t, what+"param", want.Param, got.Param)
	sameBits(t, what+"exp_avg", want.ExpAvg, got.ExpAvg)
	sameBits(t, what+"exp_avg_sq", want.ExpAvgSq, got.ExpAvgSq)
	if amsgrad {
		sameBits(t, what+"max_exp_avg_sq", want.MaxExpAvgSq, got.MaxExpAvgSq)
	}
}

func sameBits(t *testing.T, what string, a, b []float32) {
	t.Helper()
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			t.Fatalf("%s[%d]: %g != %g", what, i, a[i], b[i])
		}
	}
}

// TestPoolBitwise checks that the pool's chunked step equals the serial
// reference bit for bit, at sizes around the chunk boundaries.
func TestPoolBitwise(t *testing.T) {
	pool := NewPool(4)
	defer pool.Close()
	sizes := []int{0, 1, 7, 15, 16, 17, 63, 64, 65, MinChunk - 1, MinChunk, MinChunk + 1, 3*MinChunk + 5, 1000003}
	if testing.Short() {
		sizes = sizes[:len(sizes)-1]
	}
	h := DefaultHyper()
	for _, n := range sizes {
		for _, gd := range []DType{F32, BF16, F16} {
			for _, variant := range []struct {
				mode    Mode
				amsgrad bool
				out     DType
			}{{AdamW, false, BF16}, {Adam, true, F16}, {AdamW, true, 0}} {
				name := fmt.Sprintf("n=%d/grad=%v/%s/amsgrad=%t/out=%v", n, gd, variant.mode, variant.amsgrad, variant.out)
				t.Run(name, func(t *testing.T) {
					hh := h
					hh.Mode, hh.AMSGrad = variant.mode, variant.amsgrad
					hh.Maximize = variant.amsgrad
					s, g := randomProblem(n, gd, variant.amsgrad, uint64(n))
					s2 := s.Clone()
					var o1, o2 Copy16
					if variant.out != 0 {
						o1 = Copy16{variant.out, make([]uint16, n)}
						o2 = Copy16{variant.out, make([]uint16, n)}
					}
					for step := int64(1); step <= 3; step++ {
						c := hh.Coeffs(step, 0.5, 0.75)
						Step(&c, s, g, o1)
						pool.Step(&c, s2, g, o2)
					}
					sameBits(t, "param", s.Param, s2.Param)
					sameBits(t, "exp_avg", s.ExpAvg, s2.ExpAvg)
					sameBits(t, "exp_avg_sq", s.ExpAvgSq, s2.ExpAvgSq)
					if variant.amsgrad {
						sameBits(t, "max_exp_avg_sq", s.MaxExpAvgSq, s2.MaxExpAvgSq)
					}
					for i := range o1.Data {
						if o1.Data[i] != o2.Data[i] {
							t.Fatalf("copy[%d] %#x != %#x", i, o1.Data[i], o2.Data[i])
						}
						want := F32ToBF16(s.Param[i])
						if o1.DType == F16 {
							want = F32ToF16(s.Param[i])
						}
						if o1.Data[i] != want {
							t.Fatalf("copy[%d] = %#x, want the rounded master %#x", i, o1.Data[i], want)
						}
					}
				})
			}
		}
	}
}

// TestStepFloat64 compares one step with a float64 evaluation of the same
// formula: a check of the arithmetic independent of PyTorch's cases.
func TestStepFloat64(t *testing.T) {
	for _, mode := range []Mode{AdamW, Adam} {
		h := Hyper{Mode: mode, LR: 1e-2, Betas: [2]float64{0.9, 0.99}, Eps: 1e-8, WeightDecay: 0.1, AMSGrad: true}
		n := 1000
		s, g := randomProblem(n, F32, true, 3)
		s0 := s.Clone()
		c := h.Coeffs(4, 1, 1)
		Step(&c, s, g, Copy16{})
		for i := range n {
			p, m, v, vm, gi := float64(s0.Param[i]), float64(s0.ExpAvg[i]), float64(s0.ExpAvgSq[i]), float64(s0.MaxExpAvgSq[i]), float64(g.F32[i])
			if mode == AdamW {
				p *= 1 - h.LR*h.WeightDecay
			} else {
				gi += h.WeightDecay * p
			}
			m = h.Betas[0]*m + (1-h.Betas[0])*gi
			v = h.Betas[1]*v + (1-h.Betas[1])*gi*gi
			vm = math.Max(vm, v)
			bc1 := 1 - math.Pow(h.Betas[0], 4)
			bc2 := 1 - math.Pow(h.Betas[1], 4)
			p -= h.LR / bc1 * m / (math.Sqrt(vm)/math.Sqrt(bc2) + h.Eps)
			for _, x := range []struct {
				name      string
				got, want float64
			}{{"param", float64(s.Param[i]), p}, {"exp_avg", float64(s.ExpAvg[i]), m}, {"exp_avg_sq", float64(s.ExpAvgSq[i]), v}, {"max_exp_avg_sq", float64(s.MaxExpAvgSq[i]), vm}} {
				if d := math.Abs(x.got - x.want); d > 2e-6*math.Max(math.Abs(x.want), 1e-3) {
					t.Fatalf("%s %s[%d] = %g, float64 gives %g", mode, x.name, i, x.got, x.want)
				}
			}
		}
	}
}

func TestNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race runtime allocates when told about assembly memory; make test runs this without -race")
	}
	pool := NewPool(2)
	defer pool.Close()
	n := 4 * MinChunk
	s, g := randomProblem(n, BF16, false, 1)
	out := Copy16{BF16, make([]uint16, n)}
	save, saveOut := s.Clone(), make([]uint16, n)
	c := DefaultHyper().Coeffs(1, 1, 1)
	for name, f := range map[string]func(){
		"Step":            func() { Step(&c, s, g, out) },
		"Pool.Step":       func() { pool.Step(&c, s, g, out) },
		"Pool.AllFinite":  func() { pool.AllFinite(g) },
		"Pool.SumSquares": func() { pool.SumSquares(g, 1) },
		"Pool.StepSave":   func() { pool.StepSave(&c, s, g, out, save, saveOut) },
		"Pool.Restore":    func() { pool.Restore(s, out.Data, save, saveOut) },
		"Pool.StepTo":     func() { pool.StepTo(&c, s, g, out, save) }, // after its first call
	} {
		f()
		if a := testing.AllocsPerRun(20, f); a != 0 {
			t.Errorf("%s allocates %v times per call", name, a)
		}
	}
}

func TestAllFinite(t *testing.T) {
	pool := NewPool(3)
	defer pool.Close()
	n := 3*MinChunk + 11
	for _, gd := range []DType{F32, BF16, F16} {
		for _, bad := range []float32{float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN())} {
			for _, at := range []int{0, 1, MinChunk, n - 1} {
				_, g := randomProblem(n, gd, false, 5)
				if !AllFinite(g) || !pool.AllFinite(g) {
					t.Fatalf("%v: finite gradient reported non-finite", gd)
				}
				switch gd {
				case F32:
					g.F32[at] = bad
				case BF16:
					g.U16[at] = F32ToBF16(bad)
				case F16:
					g.U16[at] = F32ToF16(bad)
				}
				if AllFinite(g) || pool.AllFinite(g) {
					t.Fatalf("%v: %g at %d not detected", gd, bad, at)
				}
			}
		}
		// The largest finite values are finite.
		g := Grad{DType: gd, F32: []float32{math.MaxFloat32}, U16: []uint16{0x7bff}}
		if gd == BF16 {
			g.U16[0] = 0x7f7f
		}
		if !AllFinite(g) {
			t.Fatalf("%v: max finite value reported non-finite", gd)
		}
	}
}

func TestSumSquares(t *testing.T) {
	n := 5*MinChunk + 3
	_, g := randomProblem(n, F32, false, 9)
	var want float64
	for _, f := range g.F32 {
		x := float64(float32(f * 0.25))
		want += x * x
	}
	serial := SumSquares(g, 0.25)
	if math.Abs(serial-want) > 1e-12*want {
		t.Fatalf("SumSquares = %g, want %g", serial, want)
	}
	for threads := 1; threads <= 6; threads++ {
		p := NewPool(threads)
		if got := p.SumSquares(g, 0.25); got != serial {
			t.Errorf("%d threads: %v, serial %v: not bitwise equal", threads, got, serial)
		}
		p.Close()
	}
	if got := SumSquares(Grad16(F16, []uint16{F32ToF16(3), F32ToF16(-4)}), 1); got != 25 {
		t.Errorf("fp16 [3, -4]: %g, want 25", got)
	}
}

func TestValidate(t *testing.T) {
	if err := DefaultHyper().Validate(); err != nil {
		t.Fatal(err)
	}
	nan := math.NaN()
	for _, tc := range []struct {
		mut  func(*Hyper)
		want string
	}{
		{func(h *Hyper) { h.LR = -1 }, "lr"},
		{func(h *Hyper) { h.LR = nan }, "lr"},
		{func(h *Hyper) { h.Betas[0] = 1 }, "beta1"},
		{func(h *Hyper) { h.Betas[0] = -0.1 }, "beta1"},
		{func(h *Hyper) { h.Betas[1] = 1.5 }, "beta2"},
		{func(h *Hyper) { h.Eps = 0 }, "eps"},
		{func(h *Hyper) { h.Eps = nan }, "eps"},
		{func(h *Hyper) { h.WeightDecay = -0.1 }, "weight_decay"},
		{func(h *Hyper) { h.Mode = "sgd" }, "mode"},
	} {
		h := DefaultHyper()
		tc.mut(&h)
		err := h.Validate()
		if err == nil || !errors.Is(err, ErrHyper) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want one naming %s", h, err, tc.want)
		}
	}
}

func TestLengthMismatchPanics(t *testing.T) {
	s, g := randomProblem(10, F32, false, 1)
	c := DefaultHyper().Coeffs(1, 1, 1)
	defer func() {
		if recover() == nil {
			t.Fatal("no panic on a short gradient")
		}
	}()
	Step(&c, s, g.Slice(0, 9), Copy16{})
}

// TestPoolSplit checks the pool's chunking: chunks of MinChunk to MaxChunk
// elements (a multiple of MinChunk) covering n, about four per goroutine
// and never more goroutines than threads or chunks; and that GradStats over
// many chunks per goroutine keeps the serial sum bit for bit.
func TestPoolSplit(t *testing.T) {
	for _, threads := range []int{1, 2, 3, 16} {
		p := NewPool(threads)
		for _, n := range []int{0, 1, MinChunk, 2*MinChunk - 1, 2 * MinChunk, 3*MinChunk + 5, 70 * MinChunk, 25_000_000, 100_000_000} {
			g, size := p.split(n)
			chunks := (n + size - 1) / size
			switch {
			case n < 2*MinChunk || threads == 1:
				if g != 1 || size != max(n, 1) {
					t.Errorf("threads=%d n=%d: %d goroutines, chunks of %d; want 1, %d", threads, n, g, size, max(n, 1))
				}
			case size%MinChunk != 0 || size < MinChunk || size > MaxChunk:
				t.Errorf("threads=%d n=%d: chunks of %d elements", threads, n, size)
			case g != min(threads, chunks):
				t.Errorf("threads=%d n=%d: %d goroutines for %d chunks", threads, n, g, chunks)
			case size < MaxChunk && chunks > 4*threads:
				t.Errorf("threads=%d n=%d: %d chunks of %d, more than 4 per goroutine below MaxChunk", threads, n, chunks, size)
			}
		}
		p.Close()
	}
	// 25M elements on 16 goroutines: 1,536K each, in chunks of MaxChunk.
	p := NewPool(16)
	if g, size := p.split(25_000_000); g != 16 || size != MaxChunk {
		t.Errorf("25M on 16: %d goroutines, chunks of %d; want 16, %d", g, size, MaxChunk)
	}
	p.Close()
	_, g := randomProblem(40*MinChunk+9, BF16, false, 3)
	want := SumSquares(g, 0.5)
	for _, threads := range []int{2, 3, 7} {
		p := NewPool(threads)
		if ok, got := p.GradStats(g, 0.5); !ok || got != want {
			t.Errorf("%d threads: GradStats %v, %v; serial %v", threads, ok, got, want)
		}
		p.Close()
	}
}

// TestPoolRound16: the pool's Round16 gives Round16's bits for both 16-bit
// dtypes, at sizes below one chunk, across chunks and with a tail that is
// not a multiple of 16 (NaNs, infinities and ties included), and panics
// on lengths that differ.
func TestPoolRound16(t *testing.T) {
	p := NewPool(4)
	defer p.Close()
	r := rand.New(rand.NewPCG(5, 6))
	for _, n := range []int{0, 7, MinChunk - 1, 5*MinChunk + 13} {
		src := make([]float32, n)
		for i := range src {
			src[i] = math.Float32frombits(r.Uint32())
		}
		for _, d := range []DType{BF16, F16} {
			want, got := make([]uint16, n), make([]uint16, n)
			Generic.Round16(d, want, src)
			p.Round16(d, got, src)
			if !slices.Equal(got, want) {
				t.Fatalf("%v n=%d: the pool's Round16 differs from Round16", d, n)
			}
		}
	}
	defer func() {
		if recover() == nil {
			t.Error("Round16 into a shorter destination: no panic")
		}
	}()
	p.Round16(BF16, make([]uint16, 3), make([]float32, 4))
}
