//go:build !noasm

package adam

import "github.com/klauspost/cpuid/v2"

// updateAVX512 is update (step.go) on 16 lanes; n is a multiple of 16.
//
//go:noescape
func updateAVX512(p, m, v, vmax, grad *float32, n int, k *[9]float32, flags int)

// updateAVX2 is update (step.go) on 8 lanes; n is a multiple of 8.
//
//go:noescape
func updateAVX2(p, m, v, vmax, grad *float32, n int, k *[9]float32, flags int)

var (
	// AVX2 is the 8-lane path (AVX2; no FMA is used, so that results
	// stay bitwise equal to the generic path).
	AVX2 = Path{name: "avx2", lanes: 8}
	// AVX512 is the 16-lane path (AVX-512F).
	AVX512 = Path{name: "avx512", lanes: 16}
)

func simdKernel(lanes int, p, m, v, vmax, g *float32, n int, k *[9]float32, flags int) {
	if lanes == 16 {
		updateAVX512(p, m, v, vmax, g, n, k, flags)
	} else {
		updateAVX2(p, m, v, vmax, g, n, k, flags)
	}
}

func simdPaths() []Path {
	var ps []Path
	if cpuid.CPU.Supports(cpuid.AVX, cpuid.AVX2) {
		ps = append(ps, AVX2)
	}
	if cpuid.CPU.Supports(cpuid.AVX512F) {
		ps = append(ps, AVX512)
	}
	return ps
}

// The 16-bit conversions on 16 lanes (AVX-512F); n is a multiple of 16.
// Bitwise equal to BF16ToF32, F16ToF32, F32ToBF16 and F32ToF16.

//go:noescape
func widenBF16AVX512(dst *float32, src *uint16, n int)

//go:noescape
func widenF16AVX512(dst *float32, src *uint16, n int)

//go:noescape
func roundBF16AVX512(dst *uint16, src *float32, n int)

//go:noescape
func roundF16AVX512(dst *uint16, src *float32, n int)

// simdWiden converts the first n (a multiple of 16) elements on the path's
// kernel and reports whether it did; paths without a conversion kernel
// (AVX2) return false.
func simdWiden(lanes int, d DType, dst []float32, src []uint16, n int) bool {
	if lanes != 16 || n == 0 {
		return false
	}
	raceRead16(src[:n])
	raceWrite32(dst[:n])
	if d == BF16 {
		widenBF16AVX512(&dst[0], &src[0], n)
	} else {
		widenF16AVX512(&dst[0], &src[0], n)
	}
	return true
}

// simdRound is simdWiden's counterpart for rounding to 16 bits.
func simdRound(lanes int, d DType, dst []uint16, src []float32, n int) bool {
	if lanes != 16 || n == 0 {
		return false
	}
	raceRead32(src[:n])
	raceWrite16(dst[:n])
	if d == BF16 {
		roundBF16AVX512(&dst[0], &src[0], n)
	} else {
		roundF16AVX512(&dst[0], &src[0], n)
	}
	return true
}
