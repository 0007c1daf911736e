package adam

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"
)

func isNaN32(f float32) bool { return f != f }

// TestRoundTrip16 checks, on all 2^16 inputs, that upcasting and rounding
// back is the identity (NaN stays NaN).
func TestRoundTrip16(t *testing.T) {
	for h := 0; h < 1<<16; h++ {
		x := uint16(h)
		if f := F16ToF32(x); isNaN32(f) {
			if y := F32ToF16(f); F16ToF32(y) == F16ToF32(y) {
				t.Fatalf("fp16 NaN %#04x came back as %#04x", x, y)
			}
		} else if y := F32ToF16(f); y != x {
			t.Fatalf("fp16 %#04x -> %g -> %#04x", x, f, y)
		}
		if f := BF16ToF32(x); isNaN32(f) {
			if y := F32ToBF16(f); !isNaN32(BF16ToF32(y)) {
				t.Fatalf("bf16 NaN %#04x came back as %#04x", x, y)
			}
		} else if y := F32ToBF16(f); y != x {
			t.Fatalf("bf16 %#04x -> %g -> %#04x", x, f, y)
		}
	}
}

// nearest16 is an independent reference: the representable value nearest to
// f among the finite 16-bit values vals (sorted ascending, bit patterns in
// bits), ties to the even pattern, overflow to infinity by IEEE's rule.
func nearest16(f float64, vals []float64, bits []uint16, maxFinite, halfUlpAtMax float64, posInf uint16) uint16 {
	if math.Abs(f) >= maxFinite+halfUlpAtMax {
		if f > 0 {
			return posInf
		}
		return posInf | 0x8000
	}
	i := sort.SearchFloat64s(vals, f)
	if i < len(vals) && vals[i] == f {
		return bits[i]
	}
	if i == 0 || i == len(vals) { // beyond the largest finite magnitude, within half an ulp
		return bits[min(i, len(vals)-1)]
	}
	lo, hi := i-1, i
	dl, dh := f-vals[lo], vals[hi]-f
	switch {
	case dl < dh:
		return bits[lo]
	case dh < dl:
		return bits[hi]
	case bits[lo]&1 == 0:
		return bits[lo]
	}
	return bits[hi]
}

func table16(toF32 func(uint16) float32) (vals []float64, bits []uint16) {
	type pair struct {
		v float64
		b uint16
	}
	var ps []pair
	for h := 0; h < 1<<16; h++ {
		f := float64(toF32(uint16(h)))
		if math.IsNaN(f) || math.IsInf(f, 0) || (f == 0 && h&0x8000 != 0) {
			continue
		}
		ps = append(ps, pair{f, uint16(h)})
	}
	sort.Slice(ps, func(i, j int) bool { return ps[i].v < ps[j].v })
	for _, p := range ps {
		vals = append(vals, p.v)
		bits = append(bits, p.b)
	}
	return vals, bits
}

func TestRoundingAgainstReference(t *testing.T) {
	f16v, f16b := table16(F16ToF32)
	bfv, bfb := table16(BF16ToF32)
	// The reference table has one zero, +0: a zero result is compared
	// without its sign here, and the sign is checked separately below.
	check := func(f float32) {
		if isNaN32(f) || f == 0 {
			return
		}
		want := nearest16(float64(f), f16v, f16b, 65504, 16, 0x7c00)
		if got := F32ToF16(f); got != want && !(got&0x7fff == 0 && want&0x7fff == 0) {
			t.Fatalf("F32ToF16(%g = %#08x) = %#04x, want %#04x", f, math.Float32bits(f), got, want)
		}
		maxBF := float64(BF16ToF32(0x7f7f))
		want = nearest16(float64(f), bfv, bfb, maxBF, maxBF*math.Pow(2, -8)/2, 0x7f80)
		if got := F32ToBF16(f); got != want && !(got&0x7fff == 0 && want&0x7fff == 0) {
			t.Fatalf("F32ToBF16(%g = %#08x) = %#04x, want %#04x", f, math.Float32bits(f), got, want)
		}
	}
	// Every midpoint between neighbouring 16-bit values, and its neighbours.
	for _, vals := range [][]float64{f16v, bfv} {
		for i := 1; i < len(vals); i++ {
			mid := float32((vals[i-1] + vals[i]) / 2)
			for _, f := range []float32{mid, math.Nextafter32(mid, -1e38), math.Nextafter32(mid, 1e38)} {
				check(f)
				check(-f)
			}
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 1 << 20 {
		check(math.Float32frombits(r.Uint32()))
	}
	for _, f := range []float32{65504, 65519.99, 65520, 65536, 1e-8, 5.96e-8, 2.98e-8, 2.9802322e-08, 1e-45, 3.4028235e38} {
		check(f)
		check(-f)
	}
}

func TestSignedZero16(t *testing.T) {
	for _, f := range []float32{-1e-45, -1e-30, float32(math.Copysign(0, -1))} {
		if got := F32ToF16(f); got != 0x8000 {
			t.Errorf("F32ToF16(%g) = %#04x, want -0 (0x8000)", f, got)
		}
		if got := F32ToBF16(f); f > -1e-40 && got != 0x8000 {
			t.Errorf("F32ToBF16(%g) = %#04x, want -0 (0x8000)", f, got)
		}
	}
}

func TestParseDType(t *testing.T) {
	for s, want := range map[string]DType{"float32": F32, "bf16": BF16, "float16": F16, "none": 0} {
		if got, err := ParseDType(s); err != nil || got != want {
			t.Errorf("ParseDType(%q) = %v, %v; want %v", s, got, err, want)
		}
	}
	if _, err := ParseDType("int8"); err == nil {
		t.Error("ParseDType(int8) gave no error")
	}
}
