package main

import (
	"fmt"

	. "github.com/mmcloughlin/avo/operand"
	"github.com/mmcloughlin/avo/reg"
)

// update is the element-wise AdamW core on fp32 gradients: the same
// operations in the same order as the Go reference update() in step.go,
// none fused, so that the results are bitwise equal.
func (k kernel) update() {
	k.text("update", "func(p, m, v, vmax, grad *float32, n int, k *[9]float32, flags int)",
		fmt.Sprintf("update%s is update (step.go) on %d lanes; n is a multiple of %d.", k.suffix, k.lanes, k.lanes),
		"k holds decay, l2, w, 1-w, beta2, 1-beta2, sqrt(bias correction 2), eps,",
		"-step size (kernelArgs). flags: bit 0 L2 weight decay, bit 1 lerp with a",
		"small weight, bit 2 amsgrad (vmax is read and written only then).")
	p, m, v, vmax, g := k.param("p"), k.param("m"), k.param("v"), k.param("vmax"), k.param("grad")
	n, kp, flags := k.param("n"), k.param("k"), k.param("flags")
	k.adam(updateIO{p: p, m: m, v: v, vmax: vmax, g: g, dp: p, dm: m, dv: v, dvmax: vmax}, n, kp, flags)
	k.ret()
}

// updateTo is update out of place: it reads p, m, v (and vmax) and
// writes their new values to dp, dm, dv (and dvmax) with non-temporal
// stores, the new p to pc too, through the cache (the working copy is
// rounded from it). It does not fence the stores: its caller calls
// fenceNT once after a run of calls (a fence every call, every 256
// elements, cost the out-of-place update a third of its rate).
func (k kernel) updateTo() {
	k.text("updateTo", "func(p, m, v, vmax, grad, dp, dm, dv, dvmax, pc *float32, n int, k *[9]float32, flags int)",
		fmt.Sprintf("updateTo%s is update%s with the new p, m, v (and vmax) written to dp, dm, dv (and dvmax)", k.suffix, k.suffix),
		fmt.Sprintf("with non-temporal stores, aligned to %d bytes, and the new p to pc through the cache; p, m, v", 4*k.lanes),
		"and vmax are only read. n is a multiple of the lanes. The stores are not fenced: call fenceNT after.")
	io := updateIO{p: k.param("p"), m: k.param("m"), v: k.param("v"), vmax: k.param("vmax"), g: k.param("grad"),
		dp: k.param("dp"), dm: k.param("dm"), dv: k.param("dv"), dvmax: k.param("dvmax"), pc: k.param("pc"), nt: true}
	n, kp, flags := k.param("n"), k.param("k"), k.param("flags")
	k.adam(io, n, kp, flags)
	k.ret()
}

// updateIO is where the AdamW core reads and writes: the inputs p, m, v,
// vmax and the gradient g; the outputs dp, dm, dv, dvmax (the inputs,
// in place), with non-temporal stores when nt, and pc, when set, a copy
// of the new p through the cache.
type updateIO struct {
	p, m, v, vmax, g      reg.GPVirtual
	dp, dm, dv, dvmax, pc reg.GPVirtual
	nt                    bool
}

// store writes x to dst[i], non-temporally when io.nt.
func (k kernel) store(io updateIO, x reg.VecVirtual, dst Mem) {
	if io.nt {
		k.VMOVNTPS(x, dst)
	} else {
		k.VMOVUPS(x, dst)
	}
}

// adam is the element-wise AdamW core's loop over n elements: the same
// operations in the same order as the Go reference update() in step.go.
func (k kernel) adam(io updateIO, n, kp, flags reg.GPVirtual) {
	p, m, v, vmax, g := io.p, io.m, io.v, io.vmax, io.g
	var c [9]reg.VecVirtual
	for j := range c {
		c[j] = k.vec()
		k.VBROADCASTSS(Mem{Base: kp, Disp: 4 * j}, c[j])
	}
	decay, l2, w, w1, beta2, b2, bc2, eps, negStep := c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8]

	k.loop(n, k.lanes, func(i reg.GPVirtual) {
		for _, s := range []reg.GPVirtual{p, g, m, v} {
			k.PREFETCHT0(at(s, i, 4).Offset(prefetch))
		}
		P, G, M, V := k.vec(), k.vec(), k.vec(), k.vec()
		k.VMOVUPS(at(p, i, 4), P)
		k.VMOVUPS(at(g, i, 4), G)
		k.VMOVUPS(at(m, i, 4), M)
		k.VMOVUPS(at(v, i, 4), V)
		k.VMULPS(decay, P, P) // p *= decay
		k.ifBit(flags, 0, "nol2", func() {
			t := k.vec()
			k.VMULPS(P, l2, t) // l2*p
			k.VADDPS(t, G, G)  // g += l2*p
		})

		// m = lerp(m, g, w), as torch.lerp: m + w*(g-m) for w < 0.5, else
		// g - (g-m)*(1-w).
		d := k.vec()
		k.VSUBPS(M, G, d) // g - m
		k.BTQ(U8(1), flags)
		k.JCC(LabelRef("biglerp"))
		k.VMULPS(d, w, d) // w*(g-m)
		k.VADDPS(d, M, M) // m + w*(g-m)
		k.JMP(LabelRef("lerped"))
		k.Label("biglerp")
		k.VMULPS(w1, d, d) // (g-m)*(1-w)
		k.VSUBPS(d, G, M)  // g - (g-m)*(1-w)
		k.Label("lerped")

		vb, gg := k.vec(), k.vec()
		k.VMULPS(beta2, V, vb) // v*beta2
		k.VMULPS(G, b2, gg)    // (1-beta2)*g
		k.VMULPS(G, gg, gg)    // *g
		k.VADDPS(gg, vb, V)    // v
		den := k.vec()
		k.VMOVAPS(V, den)
		k.ifBit(flags, 2, "noams", func() {
			k.PREFETCHT0(at(vmax, i, 4).Offset(prefetch))
			vm := k.vec()
			k.VMOVUPS(at(vmax, i, 4), vm)
			k.VMAXPS(V, vm, den)    // vmax > v ? vmax : v
			k.whereNaN(vm, vm, den) // a NaN vmax wins, as torch.maximum
			k.store(io, den, at(io.dvmax, i, 4))
		})
		k.VSQRTPS(den, den)
		k.VDIVPS(bc2, den, den) // sqrt(v) / sqrt(bias correction 2)
		k.VADDPS(eps, den, den) // + eps
		u := k.vec()
		k.VMULPS(M, negStep, u) // -step size * m
		k.VDIVPS(den, u, u)     // / denom
		k.VADDPS(u, P, P)       // p + ...
		k.store(io, P, at(io.dp, i, 4))
		if io.pc != nil {
			k.VMOVUPS(P, at(io.pc, i, 4))
		}
		k.store(io, M, at(io.dm, i, 4))
		k.store(io, V, at(io.dv, i, 4))
	})
}
