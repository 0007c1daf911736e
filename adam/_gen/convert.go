package main

import (
	"fmt"

	. "github.com/mmcloughlin/avo/operand"
	"github.com/mmcloughlin/avo/reg"
)

// The 16-bit conversions, bitwise equal to BF16ToF32, F16ToF32, F32ToBF16
// and F32ToF16 in dtype.go.

func (k kernel) convertDoc(name, ref string) []string {
	return []string{fmt.Sprintf("%s%s is %s (dtype.go) on %d lanes; n is a multiple of %d.", name, k.suffix, ref, k.lanes, k.lanes)}
}

// widen is a widening kernel: load converts the 16-bit values at src into v.
func (k kernel) widen(name, ref string, load func(src Mem, v reg.VecVirtual)) {
	k.text(name, "func(dst *float32, src *uint16, n int)", k.convertDoc(name, ref)...)
	dst, src, n := k.param("dst"), k.param("src"), k.param("n")
	k.loop(n, k.lanes, func(i reg.GPVirtual) {
		k.PREFETCHT0(at(src, i, 2).Offset(prefetch))
		v := k.vec()
		load(at(src, i, 2), v)
		k.VMOVUPS(v, at(dst, i, 4))
	})
	k.ret()
}

func (k kernel) widenBF16() {
	k.widen("widenBF16", "BF16ToF32", func(src Mem, v reg.VecVirtual) {
		k.VPMOVZXWD(src, v)
		k.VPSLLD(U8(16), v, v)
	})
}

func (k kernel) widenF16() {
	k.widen("widenF16", "F16ToF32", func(src Mem, v reg.VecVirtual) {
		k.VCVTPH2PS(src, v)
	})
}

// roundBF16 rounds to nearest even by integer arithmetic,
// (x + 0x7fff + ((x >> 16) & 1)) >> 16; a NaN keeps its sign and top
// payload with the quiet bit set, (x >> 16) | 0x40.
func (k kernel) roundBF16() {
	k.text("roundBF16", "func(dst *uint16, src *float32, n int)", k.convertDoc("roundBF16", "F32ToBF16")...)
	dst, src, n := k.param("dst"), k.param("src"), k.param("n")
	half, one, quiet := k.broadcast32(0x7fff), k.broadcast32(1), k.broadcast32(0x40)
	k.loop(n, k.lanes, func(i reg.GPVirtual) {
		x, hi, lsb, r := k.vec(), k.vec(), k.vec(), k.vec()
		k.VMOVUPS(at(src, i, 4), x)
		k.VPSRLD(U8(16), x, hi) // x >> 16
		k.and(one, hi, lsb)     // its lowest bit
		k.VPADDD(half, x, r)    // x + 0x7fff
		k.VPADDD(lsb, r, r)     // + lsb
		k.VPSRLD(U8(16), r, r)  // rounded
		k.or(quiet, hi, hi)     // the NaN result
		k.whereNaN(x, hi, r)
		k.store16(r, at(dst, i, 2))
	})
	k.ret()
}

func (k kernel) roundF16() {
	k.text("roundF16", "func(dst *uint16, src *float32, n int)", k.convertDoc("roundF16", "F32ToF16")...)
	dst, src, n := k.param("dst"), k.param("src"), k.param("n")
	k.loop(n, k.lanes, func(i reg.GPVirtual) {
		x := k.vec()
		k.VMOVUPS(at(src, i, 4), x)
		k.VCVTPS2PH(U8(0), x, at(dst, i, 2)) // round to nearest even
	})
	k.ret()
}

// copyNT copies fp32 values with non-temporal stores (VMOVNTPS: the
// destination's lines are written to memory without being read first),
// four vectors an iteration, then fences the stores (SFENCE), so that a
// reader synchronised with the caller afterwards sees them. The source is
// read through the cache, where the caller's next pass finds it.
func (k kernel) copyNT() {
	k.text("copyNT", "func(dst, src *float32, n int)",
		fmt.Sprintf("copyNT%s copies n fp32 values from src to dst with non-temporal stores and fences them; n is a multiple of %d", k.suffix, 4*k.lanes),
		fmt.Sprintf("and dst is aligned to %d bytes (Path.copyNT handles the rest).", 4*k.lanes))
	dst, src, n := k.param("dst"), k.param("src"), k.param("n")
	k.loop(n, 4*k.lanes, func(i reg.GPVirtual) {
		var v [4]reg.VecVirtual
		for j := range v {
			if off := 4 * k.lanes * j; off%64 == 0 { // a prefetch a cache line
				k.PREFETCHT0(at(src, i, 4).Offset(prefetch + off))
			}
			v[j] = k.vec()
			k.VMOVUPS(at(src, i, 4).Offset(4*k.lanes*j), v[j])
		}
		for j := range v {
			k.VMOVNTPS(v[j], at(dst, i, 4).Offset(4*k.lanes*j))
		}
	})
	k.SFENCE()
	k.ret()
}
