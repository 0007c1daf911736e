package adam

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// guarded returns a slice of n values at offset off inside a larger buffer
// whose other elements hold a guard value, so stray writes show.
func guarded(vals []float32, off int) (buf, s []float32) {
	buf = make([]float32, len(vals)+off+19)
	for i := range buf {
		buf[i] = 1234.5
	}
	s = buf[off : off+len(vals)]
	copy(s, vals)
	return buf, s
}

func checkGuards(t *testing.T, what string, buf []float32, off, n int) {
	t.Helper()
	for i, x := range buf {
		if (i < off || i >= off+n) && x != 1234.5 {
			t.Fatalf("%s: guard at %d overwritten (%g)", what, i, x)
		}
	}
}

// TestPathsBitwise: every SIMD path equals the generic path bit for bit, at
// sizes around the lane counts, misaligned starts, with guards around every
// buffer, for both lerp formulas, both weight-decay modes and amsgrad, for
// fp32 gradients used in place and staged (unscaled, clipped, maximized),
// 16-bit gradients and 16-bit copies, with special values (NaN, ±Inf,
// denormals, -0) mixed in.
func TestPathsBitwise(t *testing.T) {
	sizes := []int{0, 1, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 256, 257, 1000003}
	if testing.Short() || raceEnabled {
		sizes = sizes[:len(sizes)-1]
	}
	specials := []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 1e-40, -1e-42, float32(math.Copysign(0, -1)), 0, 3e38}
	type gradVariant struct {
		dtype         DType
		unscale, clip float32
		maximize      bool
		out           DType
	}
	gradVariants := []gradVariant{
		{F32, 1, 1, false, 0},        // in place
		{F32, 0.5, 0.75, true, BF16}, // staged
		{BF16, 1, 0.3, false, F16},
		{F16, 1.0 / 1024, 1, true, BF16},
	}
	for _, path := range Paths()[1:] {
		for _, n := range sizes {
			for _, hv := range []struct {
				mode    Mode
				amsgrad bool
				beta1   float64
			}{{AdamW, false, 0.9}, {Adam, true, 0.9}, {AdamW, true, 0.3}} {
				for _, gv := range gradVariants {
					off := n % 5
					name := fmt.Sprintf("%s/n=%d/off=%d/%s/amsgrad=%t/beta1=%g/grad=%v/unscale=%g/clip=%g/maximize=%t/out=%v",
						path.Name(), n, off, hv.mode, hv.amsgrad, hv.beta1, gv.dtype, gv.unscale, gv.clip, gv.maximize, gv.out)
					t.Run(name, func(t *testing.T) {
						h := DefaultHyper()
						h.Mode, h.AMSGrad, h.Betas[0], h.Maximize = hv.mode, hv.amsgrad, hv.beta1, gv.maximize
						s, g := randomProblem(n, F32, true, uint64(n)+7)
						for i := 0; i < n; i += 37 { // special values, also in the state
							x := specials[(i/37)%len(specials)]
							g.F32[i] = x
							if i%3 == 0 {
								s.Param[i] = x
							}
							if i%5 == 0 {
								s.MaxExpAvgSq[i] = x
							}
						}
						if !hv.amsgrad {
							s.MaxExpAvgSq = nil
						}
						ref := s.Clone()
						c := h.Coeffs(3, gv.unscale, gv.clip)
						bufs := make([][]float32, 0, 4)
						var got State
						for k, v := range [][]float32{s.Param, s.ExpAvg, s.ExpAvgSq, s.MaxExpAvgSq} {
							if v == nil {
								continue
							}
							buf, view := guarded(v, off)
							bufs = append(bufs, buf)
							switch k {
							case 0:
								got.Param = view
							case 1:
								got.ExpAvg = view
							case 2:
								got.ExpAvgSq = view
							case 3:
								got.MaxExpAvgSq = view
							}
						}
						var refOut, gotOut Copy16
						var outBuf []uint16
						if gv.out != 0 {
							refOut = Copy16{gv.out, make([]uint16, n)}
							outBuf = make([]uint16, n+off+19)
							for i := range outBuf {
								outBuf[i] = 0xbeef
							}
							gotOut = Copy16{gv.out, outBuf[off : off+n]}
						}
						gbuf, gview := guarded(g.F32, off)
						refGrad, gotGrad := g, GradF32(gview)
						var g16buf []uint16
						if gv.dtype != F32 {
							u := make([]uint16, n)
							path.Round16(gv.dtype, u, g.F32)
							refGrad = Grad16(gv.dtype, u)
							g16buf = make([]uint16, n+off+19)
							for i := range g16buf {
								g16buf[i] = 0xbeef
							}
							copy(g16buf[off:], u)
							gotGrad = Grad16(gv.dtype, g16buf[off:off+n])
						}
						Generic.Step(&c, ref, refGrad, refOut)
						path.Step(&c, got, gotGrad, gotOut)
						for _, pair := range [][2][]float32{{ref.Param, got.Param}, {ref.ExpAvg, got.ExpAvg}, {ref.ExpAvgSq, got.ExpAvgSq}, {ref.MaxExpAvgSq, got.MaxExpAvgSq}} {
							for i := range pair[0] {
								if !sameValue(pair[0][i], pair[1][i]) {
									t.Fatalf("element %d: generic %g (%#x), %s %g (%#x)", i, pair[0][i], math.Float32bits(pair[0][i]), path.Name(), pair[1][i], math.Float32bits(pair[1][i]))
								}
							}
						}
						for i := range refOut.Data {
							if refOut.Data[i] != gotOut.Data[i] && !(isNaN16(gv.out, refOut.Data[i]) && isNaN16(gv.out, gotOut.Data[i])) {
								t.Fatalf("16-bit copy %d: generic %#04x, %s %#04x", i, refOut.Data[i], path.Name(), gotOut.Data[i])
							}
						}
						for _, b := range append(bufs, gbuf) {
							checkGuards(t, name, b, off, n)
						}
						for _, b := range [][]uint16{outBuf, g16buf} {
							for i, x := range b {
								if (i < off || i >= off+n) && x != 0xbeef {
									t.Fatalf("16-bit guard at %d overwritten (%#04x)", i, x)
								}
							}
						}
					})
				}
			}
		}
	}
}

// TestGradPartials: the per-block partial sums of every path and of a pool
// at any thread count are the generic path's bit for bit; added in block
// order from 0 they give GradStats's sum; and the partials of a gradient cut
// on a MinChunk boundary into two, each taken alone, are the whole's: the
// sum does not depend on where each piece was computed. A short dst panics.
func TestGradPartials(t *testing.T) {
	n := 5*MinChunk + 123
	if testing.Short() || raceEnabled {
		n = 2*MinChunk + 123
	}
	blocks := (n + MinChunk - 1) / MinChunk
	for _, gd := range []DType{F32, BF16, F16} {
		_, g := randomProblem(n, gd, false, 11)
		const unscale = 1.0 / 3
		_, want := Generic.GradStats(g, unscale)
		ref := make([]float64, blocks)
		if !Generic.GradPartials(g, unscale, ref) {
			t.Fatalf("%v: not finite", gd)
		}
		var sum float64
		for _, x := range ref {
			sum += x
		}
		if sum != want {
			t.Fatalf("%v: partials add to %v, GradStats %v", gd, sum, want)
		}
		check := func(name string, got []float64) {
			t.Helper()
			for b := range ref {
				if got[b] != ref[b] {
					t.Fatalf("%v %s: partial %d = %v, generic %v", gd, name, b, got[b], ref[b])
				}
			}
		}
		for _, path := range Paths() {
			got := make([]float64, blocks)
			path.GradPartials(g, unscale, got)
			check(path.Name(), got)
		}
		for _, threads := range []int{1, 2, 3} {
			p := NewPoolPath(threads, Paths()[len(Paths())-1])
			got := make([]float64, blocks)
			ok := p.GradPartials(g, unscale, got)
			if _, s := p.GradStats(g, unscale); s != want || !ok {
				t.Fatalf("pool-%d %v: GradStats %v after GradPartials %v, want %v", threads, gd, s, ok, want)
			}
			p.Close()
			check(fmt.Sprintf("pool-%d", threads), got)
		}
		cut := 2 * MinChunk
		got := make([]float64, blocks)
		Generic.GradPartials(g.Slice(0, cut), unscale, got[:2])
		Generic.GradPartials(g.Slice(cut, n), unscale, got[2:])
		check("cut at 2 blocks", got)
	}
	defer func() {
		if recover() == nil {
			t.Fatal("GradPartials into too few partials did not panic")
		}
	}()
	_, g := randomProblem(MinChunk+1, F32, false, 1)
	Generic.GradPartials(g, 1, make([]float64, 1))
}

// TestPathGradStats: every path's one-pass non-finite check and sum of
// squares equals the generic path's bit for bit (and every pool's, at any
// thread count), the generic sum agrees with a plain serial float64 sum, and
// an Inf or NaN is found at every position.
func TestPathGradStats(t *testing.T) {
	sizes := []int{0, 1, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 256, 257, MinChunk - 1, MinChunk, MinChunk + 17, 3*MinChunk + 5, 1000003}
	if testing.Short() || raceEnabled {
		sizes = sizes[:len(sizes)-1]
	}
	for _, gd := range []DType{F32, BF16, F16} {
		for _, n := range sizes {
			for _, unscale := range []float32{1, 0.25, 3.0517578e-05} {
				_, g := randomProblem(n, gd, false, uint64(n)+3)
				off := n % 3 // misaligned start
				g = shifted(g, off)
				wantOK, want := Generic.GradStats(g, unscale)
				var serial float64
				for i := range g.Len() {
					x := float64(float32(gradAt(g, i) * unscale))
					serial += x * x
				}
				if !wantOK || math.Abs(want-serial) > 1e-12*serial {
					t.Fatalf("%v n=%d: generic GradStats = %v, %g; serial sum %g", gd, n, wantOK, want, serial)
				}
				for _, path := range Paths() {
					if ok, got := path.GradStats(g, unscale); !ok || got != want {
						t.Fatalf("%s %v n=%d unscale=%g: %v, %v; generic %v", path.Name(), gd, n, unscale, ok, got, want)
					}
				}
				if n < 1000 || n == 3*MinChunk+5 {
					for _, threads := range []int{1, 2, 3} {
						p := NewPoolPath(threads, Paths()[len(Paths())-1])
						ok, got := p.GradStats(g, unscale)
						p.Close()
						if !ok || got != want {
							t.Fatalf("pool-%d %v n=%d: %v, %v; generic %v", threads, gd, n, ok, got, want)
						}
					}
				}
			}
		}
	}
	bads := []float32{float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN())}
	for _, gd := range []DType{F32, BF16, F16} {
		for _, n := range []int{1, 15, 16, 17, 33, 64, 65, 300} {
			for at := range n {
				_, g := randomProblem(n, gd, false, 1)
				bad := bads[at%3]
				switch gd {
				case F32:
					g.F32[at] = bad
				case BF16:
					g.U16[at] = F32ToBF16(bad)
				case F16:
					g.U16[at] = F32ToF16(bad)
				}
				for _, path := range Paths() {
					if ok, _ := path.GradStats(g, 1); ok {
						t.Fatalf("%s %v n=%d: %g at %d not found", path.Name(), gd, n, bad, at)
					}
				}
			}
		}
		// The largest finite values are finite on every path.
		g := Grad{DType: gd, F32: make([]float32, 40), U16: make([]uint16, 40)}
		for i := range 40 {
			g.F32[i], g.U16[i] = math.MaxFloat32, 0x7bff
			if gd == BF16 {
				g.U16[i] = 0x7f7f
			}
		}
		for _, path := range Paths() {
			if ok, _ := path.GradStats(g, 1); !ok {
				t.Fatalf("%s %v: the largest finite value reported non-finite", path.Name(), gd)
			}
		}
	}
}

// sameValue reports whether a and b have the same bits or are both NaN:
// which NaN an operation on NaNs returns (its sign and payload) depends on
// operand order, which IEEE 754 leaves open and the Go compiler may change
// (it does under -race).
func sameValue(a, b float32) bool {
	return math.Float32bits(a) == math.Float32bits(b) || (a != a && b != b)
}

// isNaN16 reports whether h is a NaN of the 16-bit dtype d.
func isNaN16(d DType, h uint16) bool {
	if d == BF16 {
		return h&0x7f80 == 0x7f80 && h&0x7f != 0
	}
	return h&0x7c00 == 0x7c00 && h&0x3ff != 0
}

// shifted returns a copy of g starting off elements into a new buffer.
func shifted(g Grad, off int) Grad {
	if g.DType == F32 {
		return GradF32(append(make([]float32, off, off+len(g.F32)), g.F32...)[off:])
	}
	return Grad16(g.DType, append(make([]uint16, off, off+len(g.U16)), g.U16...)[off:])
}

// gradAt is element i of g in fp32.
func gradAt(g Grad, i int) float32 {
	switch g.DType {
	case BF16:
		return BF16ToF32(g.U16[i])
	case F16:
		return F16ToF32(g.U16[i])
	}
	return g.F32[i]
}

func TestPathByName(t *testing.T) {
	for _, p := range Paths() {
		got, err := PathByName(p.Name())
		if err != nil || got != p {
			t.Errorf("PathByName(%s) = %v, %v", p.Name(), got, err)
		}
	}
	if _, err := PathByName("sse9"); err == nil {
		t.Error("unknown path accepted")
	}
	t.Logf("paths here: %v; default %v", Paths(), DefaultPath)
}

// TestPathConversions: every path's Widen16 equals the reference upcast on
// all 2^16 inputs, and its Round16 equals the reference rounding on random
// bit patterns, ties, NaN, ±Inf and denormals, at a misaligned start.
func TestPathConversions(t *testing.T) {
	all := make([]uint16, 1<<16+3)
	for i := range all {
		all[i] = uint16(i)
	}
	src := make([]float32, 0, 1<<20)
	r := newRand(5)
	for range 1 << 19 {
		src = append(src, math.Float32frombits(r.Uint32()))
	}
	for _, f := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 1e-45, -1e-40, 65504, 65520, 65519.996, 5.9604645e-08, 2.9802322e-08, 3.4028235e38} {
		src = append(src, f, -f)
	}
	for h := range 1 << 16 { // ties of both 16-bit formats
		bf := math.Float32frombits(uint32(h)<<16 | 0x8000)
		f16 := F16ToF32(uint16(h))
		src = append(src, bf, math.Nextafter32(f16, 1e38), f16*(1+1.0/4096))
	}
	for _, path := range Paths() {
		for _, d := range []DType{BF16, F16} {
			got := make([]float32, len(all)+1)[1:] // misaligned
			path.Widen16(d, got, all)
			for i, h := range all {
				want := BF16ToF32(h)
				if d == F16 {
					want = F16ToF32(h)
				}
				if math.Float32bits(got[i]) != math.Float32bits(want) {
					t.Fatalf("%s Widen16 %v %#04x = %#08x, want %#08x", path.Name(), d, h, math.Float32bits(got[i]), math.Float32bits(want))
				}
			}
			out := make([]uint16, len(src)+1)[1:]
			path.Round16(d, out, src)
			for i, f := range src {
				want := F32ToBF16(f)
				if d == F16 {
					want = F32ToF16(f)
				}
				if out[i] != want {
					t.Fatalf("%s Round16 %v %g (%#08x) = %#04x, want %#04x", path.Name(), d, f, math.Float32bits(f), out[i], want)
				}
			}
		}
	}
}

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 11)) }

// TestEdgeAPI: regressions from adversarial testing. A stale
// max_exp_avg_sq without amsgrad is ignored by Pool.Step as by Path.Step;
// conversions into a too-short destination panic instead of writing past
// it; the zero Path runs the generic code.
func TestEdgeAPI(t *testing.T) {
	n := 3 * MinChunk
	s, g := randomProblem(n, F32, false, 1)
	s.MaxExpAvgSq = make([]float32, 10) // stale, wrong length, amsgrad off
	c := DefaultHyper().Coeffs(1, 1, 1)
	p := NewPool(3)
	defer p.Close()
	ref := s.Clone()
	Generic.Step(&c, ref, g, Copy16{})
	p.Step(&c, s, g, Copy16{})
	p.Step(&c, ref, g, Copy16{}) // the pool is still usable
	Generic.Step(&c, s, g, Copy16{})
	sameBits(t, "param", ref.Param, s.Param)

	backing := make([]float32, 64)
	for _, path := range Paths() {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: Widen16 into a short destination did not panic", path.Name())
				}
			}()
			path.Widen16(BF16, backing[:5], make([]uint16, 40))
		}()
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: Round16 into a short destination did not panic", path.Name())
				}
			}()
			path.Round16(F16, make([]uint16, 64)[:5], backing[:40])
		}()
	}
	var zero Path
	got, want := make([]float32, 64), make([]float32, 64)
	src := make([]uint16, 64)
	for i := range src {
		src[i] = uint16(i * 977)
	}
	zero.Widen16(F16, got, src)
	Generic.Widen16(F16, want, src)
	sameBits(t, "zero-Path Widen16", want, got)
}
