package adam

import (
	"fmt"
	"math"
)

// scaleFlags packs which of the gradient's scalings apply, in the order
// loadGrad applies them: bit 0 multiply by Unscale, bit 1 multiply by Clip,
// bit 2 negate (maximize).
func scaleFlags(c *Coeffs) int {
	f := 0
	if c.Unscale != 1 {
		f |= 1
	}
	if c.Clip != 1 {
		f |= 2
	}
	if c.Maximize {
		f |= 4
	}
	return f
}

// scale is the Go reference of the scale kernels: x[i] is multiplied by a
// (flag bit 0), then by b (bit 1), each product rounded to fp32, then
// negated (bit 2).
func scale(x []float32, a, b float32, flags int) {
	if flags&1 != 0 {
		for i := range x {
			x[i] = float32(x[i] * a)
		}
	}
	if flags&2 != 0 {
		for i := range x {
			x[i] = float32(x[i] * b)
		}
	}
	if flags&4 != 0 {
		for i := range x {
			x[i] = -x[i]
		}
	}
}

// scale runs scale on the path: the lane-multiple head in the kernel.
func (path Path) scale(x []float32, a, b float32, flags int) {
	if flags == 0 {
		return
	}
	head := 0
	if path.lanes > 1 {
		head = len(x) - len(x)%16
	}
	if head > 0 {
		raceWrite32(x[:head])
		simdScale(path.lanes, &x[0], head, a, b, flags)
	}
	scale(x[head:], a, b, flags)
}

// statLanes is the number of partial sums of squares: element i of a block
// adds to lane i%statLanes, and the lanes are added in order at the end.
// Fixing the order this way lets the SIMD kernels (16 fp64 lanes, in one or
// two registers per 8) give bitwise the generic path's result.
const statLanes = 16

// stats is the Go reference of the stats kernels: for every x[i],
// acc[(base+i)%16] += float64(float32(x[i]*unscale))^2. It returns whether
// some x[i] is an Inf or a NaN (judged before scaling).
func stats(acc *[statLanes]float64, x []float32, unscale float32, base int) (nonFinite bool) {
	for i, f := range x {
		if math.Float32bits(f)&0x7f800000 == 0x7f800000 {
			nonFinite = true
		}
		y := float64(float32(f * unscale))
		acc[(base+i)%statLanes] += float64(y * y) // exact: a 24-bit significand squared
	}
	return nonFinite
}

// stats runs stats on the path from lane 0: the head of a multiple of 16
// elements in the kernel, the tail in Go.
func (path Path) stats(acc *[statLanes]float64, x []float32, unscale float32) (nonFinite bool) {
	head := 0
	if path.lanes > 1 {
		head = len(x) - len(x)%statLanes
	}
	if head > 0 {
		raceRead32(x[:head])
		nonFinite = simdStats(path.lanes, acc, &x[0], head, unscale)
	}
	return stats(acc, x[head:], unscale, head) || nonFinite
}

// GradStats returns, in one pass over g, whether every element is finite
// (no Inf, no NaN, as torch.amp's _amp_foreach_non_finite_check_and_unscale_
// decides whether to skip a step) and the sum of squares of the unscaled
// elements, float32(g_i*unscale) squared in float64, whose square root over
// all subgroups is the global L2 norm torch.nn.utils.clip_grad_norm_
// computes on unscaled gradients.
//
// The order of the sum is fixed, so every path and every thread count gives
// bitwise the same result: g is cut into blocks of MinChunk elements; within
// a block element i adds to partial sum i%16, the 16 partial sums are added
// in lane order, and the block sums in block order. 16-bit elements are
// widened exactly first. GradStats allocates nothing; when g has a
// non-finite element the sum is meaningless.
func (path Path) GradStats(g Grad, unscale float32) (finite bool, sumSquares float64) {
	finite = true
	for lo := 0; lo < g.Len(); lo += MinChunk {
		ok, s := path.blockStats(g.Slice(lo, min(lo+MinChunk, g.Len())), unscale)
		finite = finite && ok
		sumSquares += s
	}
	return finite, sumSquares
}

// GradPartials is Pool.GradPartials on one goroutine: dst[b] is the sum
// of squares of g's MinChunk block b, as GradStats adds them. It panics
// when dst is shorter than g's blocks.
func (path Path) GradPartials(g Grad, unscale float32, dst []float64) (finite bool) {
	if blocks := (g.Len() + MinChunk - 1) / MinChunk; len(dst) < blocks {
		panic(fmt.Sprintf("adam: GradPartials: %d partials for %d blocks", len(dst), blocks))
	}
	finite = true
	for b, lo := 0, 0; lo < g.Len(); b, lo = b+1, lo+MinChunk {
		ok, s := path.blockStats(g.Slice(lo, min(lo+MinChunk, g.Len())), unscale)
		finite = finite && ok
		dst[b] = s
	}
	return finite
}

// blockStats is GradStats over one block of at most MinChunk elements.
func (path Path) blockStats(g Grad, unscale float32) (finite bool, sumSquares float64) {
	var acc [statLanes]float64
	bad := false
	if g.DType == F32 {
		bad = path.stats(&acc, g.F32, unscale)
	} else {
		var gb [block]float32 // block is a multiple of statLanes: lanes stay in step
		for lo := 0; lo < len(g.U16); lo += block {
			hi := min(lo+block, len(g.U16))
			path.Widen16(g.DType, gb[:hi-lo], g.U16[lo:hi])
			bad = path.stats(&acc, gb[:hi-lo], unscale) || bad
		}
	}
	for _, s := range acc {
		sumSquares += s
	}
	return !bad, sumSquares
}

// AllFinite reports whether every element of g is finite (no Inf, no NaN),
// on DefaultPath: GradStats without its sum.
func AllFinite(g Grad) bool {
	ok, _ := DefaultPath.GradStats(g, 1)
	return ok
}

// SumSquares is GradStats's sum of squares on DefaultPath.
func SumSquares(g Grad, unscale float32) float64 {
	_, s := DefaultPath.GradStats(g, unscale)
	return s
}
