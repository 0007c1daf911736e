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
			k.VMOVUPS(den, at(vmax, i, 4))
		})
		k.VSQRTPS(den, den)
		k.VDIVPS(bc2, den, den) // sqrt(v) / sqrt(bias correction 2)
		k.VADDPS(eps, den, den) // + eps
		u := k.vec()
		k.VMULPS(M, negStep, u) // -step size * m
		k.VDIVPS(den, u, u)     // / denom
		k.VADDPS(u, P, P)       // p + ...
		k.VMOVUPS(P, at(p, i, 4))
		k.VMOVUPS(M, at(m, i, 4))
		k.VMOVUPS(V, at(v, i, 4))
	})
	k.ret()
}
