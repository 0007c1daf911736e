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
	// AVX2 is the 8-lane path (AVX2 and F16C; no FMA is used, so that
	// results stay bitwise equal to the generic path).
	AVX2 = Path{name: "avx2", lanes: 8}
	// AVX512 is the 16-lane path (AVX-512F).
	AVX512 = Path{name: "avx512", lanes: 16}
)

// The kernels prefetch each input stream 2048 bytes ahead of their loads
// (PREFETCHT0, the displacement in the .s files): one core keeps more cache
// misses in flight than the L2 streamer alone, which stops at every 4 KiB
// page. Measured on the GPU machine's host (BENCHMARKS.md): +15-20 % at 1
// and 2 threads, best of 256 to 4096 bytes.

func simdKernel(lanes int, p, m, v, vmax, g *float32, n int, k *[9]float32, flags int) {
	if lanes == 16 {
		updateAVX512(p, m, v, vmax, g, n, k, flags)
	} else {
		updateAVX2(p, m, v, vmax, g, n, k, flags)
	}
}

func simdPaths() []Path {
	var ps []Path
	if cpuid.CPU.Supports(cpuid.AVX, cpuid.AVX2, cpuid.F16C) {
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

// The same on 8 lanes (AVX2, F16C); n is a multiple of 8.

//go:noescape
func widenBF16AVX2(dst *float32, src *uint16, n int)

//go:noescape
func widenF16AVX2(dst *float32, src *uint16, n int)

//go:noescape
func roundBF16AVX2(dst *uint16, src *float32, n int)

//go:noescape
func roundF16AVX2(dst *uint16, src *float32, n int)

// simdWiden converts the first n (a multiple of 16) elements on the path's
// kernel and reports whether it did (false for the generic path).
func simdWiden(lanes int, d DType, dst []float32, src []uint16, n int) bool {
	if lanes < 8 || n == 0 { // the generic path (and the zero Path) has no kernel
		return false
	}
	raceRead16(src[:n])
	raceWrite32(dst[:n])
	switch {
	case lanes == 16 && d == BF16:
		widenBF16AVX512(&dst[0], &src[0], n)
	case lanes == 16:
		widenF16AVX512(&dst[0], &src[0], n)
	case d == BF16:
		widenBF16AVX2(&dst[0], &src[0], n)
	default:
		widenF16AVX2(&dst[0], &src[0], n)
	}
	return true
}

// simdRound is simdWiden's counterpart for rounding to 16 bits.
func simdRound(lanes int, d DType, dst []uint16, src []float32, n int) bool {
	if lanes < 8 || n == 0 {
		return false
	}
	raceRead32(src[:n])
	raceWrite16(dst[:n])
	switch {
	case lanes == 16 && d == BF16:
		roundBF16AVX512(&dst[0], &src[0], n)
	case lanes == 16:
		roundF16AVX512(&dst[0], &src[0], n)
	case d == BF16:
		roundBF16AVX2(&dst[0], &src[0], n)
	default:
		roundF16AVX2(&dst[0], &src[0], n)
	}
	return true
}

// The gradient kernels of stage_amd64.s, Go references scale and stats in
// stage.go; n is a multiple of 16.

//go:noescape
func scaleAVX512(x *float32, n int, a, b float32, flags int)

//go:noescape
func scaleAVX2(x *float32, n int, a, b float32, flags int)

//go:noescape
func statsAVX512(acc *[statLanes]float64, x *float32, n int, unscale float32) bool

//go:noescape
func statsAVX2(acc *[statLanes]float64, x *float32, n int, unscale float32) bool

func simdScale(lanes int, x *float32, n int, a, b float32, flags int) {
	if lanes == 16 {
		scaleAVX512(x, n, a, b, flags)
	} else {
		scaleAVX2(x, n, a, b, flags)
	}
}

func simdStats(lanes int, acc *[statLanes]float64, x *float32, n int, unscale float32) bool {
	if lanes == 16 {
		return statsAVX512(acc, x, n, unscale)
	}
	return statsAVX2(acc, x, n, unscale)
}
