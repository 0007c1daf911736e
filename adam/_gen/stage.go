package main

import (
	"fmt"

	. "github.com/mmcloughlin/avo/operand"
	"github.com/mmcloughlin/avo/reg"
)

// The gradient kernels, operation for operation the Go references scale
// and stats in stage.go.

// statLanes is stage.go's number of partial sums of squares.
const statLanes = 16

// scale multiplies a staged gradient by the unscale, then the clip factor,
// and negates it (maximize), each as flags says.
func (k kernel) scale() {
	k.text("scale", "func(x *float32, n int, a, b float32, flags int)",
		fmt.Sprintf("scale%s is scale (stage.go) on %d lanes: x[i] *= a if flags bit 0;", k.suffix, k.lanes),
		fmt.Sprintf("x[i] *= b if bit 1; x[i] = -x[i] if bit 2. n is a multiple of %d.", k.lanes))
	x, n := k.param("x"), k.param("n")
	a, b := k.vec(), k.vec()
	k.VBROADCASTSS(addr(k.Param("a")), a)
	k.VBROADCASTSS(addr(k.Param("b")), b)
	flags := k.param("flags")
	sign := k.broadcast32(0x80000000)
	k.loop(n, k.lanes, func(i reg.GPVirtual) {
		v := k.vec()
		k.VMOVUPS(at(x, i, 4), v)
		k.ifBit(flags, 0, "noa", func() { k.VMULPS(a, v, v) })
		k.ifBit(flags, 1, "nob", func() { k.VMULPS(b, v, v) })
		k.ifBit(flags, 2, "noneg", func() { k.xor(sign, v, v) })
		k.VMOVUPS(v, at(x, i, 4))
	})
	k.ret()
}

// stats adds the squares of a gradient into 16 fp64 lanes and notes
// non-finite elements. Each iteration takes 16 elements (statLanes) in
// 16/lanes fp32 vectors; each vector widens to two fp64 vectors, so the
// partial sums are 32/lanes accumulators in lane order.
func (k kernel) stats() {
	k.text("stats", "func(acc *[16]float64, x *float32, n int, unscale float32) bool",
		fmt.Sprintf("stats%s is stats (stage.go) on %d lanes: for each i < n (a multiple", k.suffix, k.lanes),
		"of 16), acc[i%16] += float64(x[i]*unscale)^2, the product rounded to fp32",
		"first. It returns whether some x[i] is an Inf or a NaN (exponent all",
		"ones), judged before scaling.")
	accp, x, n := k.param("acc"), k.param("x"), k.param("n")
	u := k.vec()
	k.VBROADCASTSS(addr(k.Param("unscale")), u)
	width := 4 * k.lanes // bytes in a vector register
	acc := make([]reg.VecVirtual, 2*statLanes/k.lanes)
	for j := range acc {
		acc[j] = k.vec()
		k.VMOVUPD(Mem{Base: accp, Disp: j * width}, acc[j])
	}
	exp := k.broadcast32(0x7f800000)
	bad := k.anyLane()

	k.loop(n, statLanes, func(i reg.GPVirtual) {
		k.PREFETCHT0(at(x, i, 4).Offset(prefetch))
		f := make([]reg.VecVirtual, statLanes/k.lanes)
		for j := range f {
			f[j] = k.vec()
			k.VMOVUPS(at(x, i, 4).Offset(j*width), f[j])
		}
		for _, v := range f {
			k.orAllOnes(bad, v, exp) // exponent all ones
		}
		for _, v := range f {
			k.VMULPS(u, v, v)
		}
		d := make([]reg.VecVirtual, len(acc))
		for j, v := range f {
			d[2*j], d[2*j+1] = k.vec(), k.vec()
			k.VCVTPS2PD(k.half(v), d[2*j])
			k.VCVTPS2PD(k.upper(v), d[2*j+1])
		}
		for _, s := range d {
			k.VMULPD(s, s, s) // exact: a 24-bit significand squared
		}
		for j, s := range d {
			k.VADDPD(s, acc[j], acc[j])
		}
	})
	for j, a := range acc {
		k.VMOVUPD(a, Mem{Base: accp, Disp: j * width})
	}
	k.testAny(bad)
	k.SETNE(addr(k.ReturnIndex(0)))
	k.ret()
}
