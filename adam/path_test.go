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
// buffer, for both lerp formulas, both weight-decay modes and amsgrad, with
// special values (NaN, ±Inf, denormals, -0) mixed in.
func TestPathsBitwise(t *testing.T) {
	sizes := []int{0, 1, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 256, 257, 1000003}
	if testing.Short() || raceEnabled {
		sizes = sizes[:len(sizes)-1]
	}
	specials := []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 1e-40, -1e-42, float32(math.Copysign(0, -1)), 0, 3e38}
	for _, path := range Paths()[1:] {
		for _, n := range sizes {
			for _, hv := range []struct {
				mode    Mode
				amsgrad bool
				beta1   float64
			}{{AdamW, false, 0.9}, {Adam, true, 0.9}, {AdamW, true, 0.3}} {
				off := n % 5
				name := fmt.Sprintf("%s/n=%d/off=%d/%s/amsgrad=%t/beta1=%g", path.Name(), n, off, hv.mode, hv.amsgrad, hv.beta1)
				t.Run(name, func(t *testing.T) {
					h := DefaultHyper()
					h.Mode, h.AMSGrad, h.Betas[0] = hv.mode, hv.amsgrad, hv.beta1
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
					c := h.Coeffs(3, 1, 1)
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
					gbuf, gview := guarded(g.F32, off)
					Generic.Step(&c, ref, g, Copy16{})
					path.Step(&c, got, GradF32(gview), Copy16{})
					for _, pair := range [][2][]float32{{ref.Param, got.Param}, {ref.ExpAvg, got.ExpAvg}, {ref.ExpAvgSq, got.ExpAvgSq}, {ref.MaxExpAvgSq, got.MaxExpAvgSq}} {
						for i := range pair[0] {
							if math.Float32bits(pair[0][i]) != math.Float32bits(pair[1][i]) {
								t.Fatalf("element %d: generic %g (%#x), %s %g (%#x)", i, pair[0][i], math.Float32bits(pair[0][i]), path.Name(), pair[1][i], math.Float32bits(pair[1][i]))
							}
						}
					}
					for _, b := range append(bufs, gbuf) {
						checkGuards(t, name, b, off, n)
					}
				})
			}
		}
	}
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
