package main

import (
	"github.com/mmcloughlin/avo/attr"
	"github.com/mmcloughlin/avo/build"
	"github.com/mmcloughlin/avo/gotypes"
	. "github.com/mmcloughlin/avo/operand"
	"github.com/mmcloughlin/avo/reg"
)

// isa is what differs between the instruction sets: the vector width and
// whether opmask registers and EVEX forms exist. The kernels are written
// once; the few operations whose instructions differ are kernel methods
// below, each taking the choice from isa.
type isa struct {
	suffix string // appended to each kernel's name
	lanes  int    // fp32 lanes in a vector register
	evex   bool   // AVX-512F: zmm registers, opmask registers, EVEX-only forms
}

var (
	avx512 = isa{suffix: "AVX512", lanes: 16, evex: true}
	// avx2 also uses F16C (the fp16 conversions), and no FMA: a fused
	// multiply-add would round once where the Go reference rounds twice.
	avx2 = isa{suffix: "AVX2", lanes: 8}
)

// prefetch is how far ahead of its loads a kernel prefetches each input
// stream (PREFETCHT0): one core then keeps more cache misses in flight than
// the L2 streamer alone, which stops at every 4 KiB page. Measured on the
// GPU machine's host (BENCHMARKS.md): +15-20 % at 1 and 2 threads, best of
// 256 to 4096 bytes.
const prefetch = 2048

// kernel builds one function of one instruction set.
type kernel struct {
	*build.Context
	isa
}

// text starts the function name+suffix with the Go signature sig; doc is
// its doc comment in the generated declarations.
func (k kernel) text(name, sig string, doc ...string) {
	k.Function(name + k.suffix)
	k.Attributes(attr.NOSPLIT)
	k.SignatureExpr(sig)
	k.Pragma("noescape")
	k.Doc(doc...)
}

// vec is a new vector register of the instruction set's width.
func (k kernel) vec() reg.VecVirtual {
	if k.evex {
		return k.ZMM()
	}
	return k.YMM()
}

// half is the lower half of v: the ymm of a zmm, the xmm of a ymm.
func (k kernel) half(v reg.VecVirtual) reg.Register {
	if k.evex {
		return v.AsY()
	}
	return v.AsX()
}

// upper returns a new half-width register holding the upper half of v.
func (k kernel) upper(v reg.VecVirtual) reg.Register {
	if k.evex {
		y := k.YMM()
		k.VEXTRACTF64X4(U8(1), v, y)
		return y
	}
	x := k.XMM()
	k.VEXTRACTF128(U8(1), v, x)
	return x
}

// broadcast32 returns a vector with c in every 32-bit lane.
func (k kernel) broadcast32(c uint32) reg.VecVirtual {
	r := k.GP32()
	k.MOVL(U32(c), r)
	v := k.vec()
	if k.evex {
		k.VPBROADCASTD(r, v)
		return v
	}
	x := k.XMM()
	k.VMOVD(r, x)
	k.VPBROADCASTD(x, v)
	return v
}

// and, or and xor are the bitwise operations, Go operand order (dst last).
func (k kernel) and(a, b, dst reg.Register) {
	if k.evex {
		k.VPANDD(a, b, dst)
	} else {
		k.VPAND(a, b, dst)
	}
}

func (k kernel) or(a, b, dst reg.Register) {
	if k.evex {
		k.VPORD(a, b, dst)
	} else {
		k.VPOR(a, b, dst)
	}
}

func (k kernel) xor(a, b, dst reg.Register) {
	if k.evex {
		k.VPXORD(a, b, dst)
	} else {
		k.VPXOR(a, b, dst)
	}
}

// whereNaN sets the lanes of dst where x is a NaN to those of src: a masked
// move under an opmask on AVX-512, a blend on AVX2.
func (k kernel) whereNaN(x, src, dst reg.VecVirtual) {
	if k.evex {
		m := k.K()
		k.VCMPPS(U8(3), x, x, m) // unordered: x is NaN
		k.VMOVAPS(src, m, dst)
		return
	}
	m := k.vec()
	k.VCMPPS(U8(3), x, x, m)
	k.VBLENDVPS(m, src, dst, dst)
}

// store16 writes the low 16 bits of each 32-bit lane of v (each fits:
// nothing saturates) to dst: VPMOVDW on AVX-512; on AVX2 the upper 128
// bits extracted and packed after the lower ones.
func (k kernel) store16(v reg.VecVirtual, dst Mem) {
	if k.evex {
		k.VPMOVDW(v, dst)
		return
	}
	hi := k.XMM()
	k.VEXTRACTI128(U8(1), v, hi)
	k.VPACKUSDW(hi, v.AsX(), hi) // hi = lo lanes, then hi lanes
	k.VMOVDQU(hi, dst)
}

// anyLane is a flag set across a loop when some lane matched: an opmask
// register on AVX-512, a vector of lane masks on AVX2.
func (k kernel) anyLane() reg.Register {
	if k.evex {
		f := k.K()
		k.KXORW(f, f, f)
		return f
	}
	f := k.vec()
	k.VPXOR(f, f, f)
	return f
}

// orAllOnes sets flag f (anyLane) if some lane of x has every bit of e set.
func (k kernel) orAllOnes(f reg.Register, x, e reg.VecVirtual) {
	t := k.vec()
	k.and(e, x, t)
	if k.evex {
		m := k.K()
		k.VPCMPEQD(e, t, m)
		k.KORW(m, f, f)
		return
	}
	k.VPCMPEQD(e, t, t)
	k.VPOR(t, f, f)
}

// testAny sets ZF to whether flag f (anyLane) is clear.
func (k kernel) testAny(f reg.Register) {
	if k.evex {
		k.KORTESTW(f, f)
	} else {
		k.VPTEST(f, f)
	}
}

// loop runs body for i = 0, step, 2*step, ... while i < n (the element
// index; the loop exits at the top).
func (k kernel) loop(n reg.Register, step int, body func(i reg.GPVirtual)) {
	i := k.GP64()
	k.XORQ(i, i)
	k.Label("loop")
	k.CMPQ(i, n)
	k.JGE(LabelRef("done"))
	body(i)
	k.ADDQ(U8(step), i)
	k.JMP(LabelRef("loop"))
	k.Label("done")
}

// ret ends a kernel, clearing the upper vector halves for SSE code.
func (k kernel) ret() {
	k.VZEROUPPER()
	k.RET()
}

// at is base[i] for elements of size bytes.
func at(base, i reg.Register, size uint8) Mem {
	return Mem{Base: base, Index: i, Scale: size}
}

// param loads the pointer or integer argument name.
func (k kernel) param(name string) reg.GPVirtual {
	return k.Load(k.Param(name), k.GP64()).(reg.GPVirtual)
}

// addr is the frame address of an argument or result.
func addr(c gotypes.Component) Mem {
	b, err := c.Resolve()
	if err != nil {
		panic(err)
	}
	return b.Addr
}

// ifBit branches past body unless bit b of flags is set.
func (k kernel) ifBit(flags reg.Register, b uint8, skip string, body func()) {
	k.BTQ(U8(b), flags)
	k.JCC(LabelRef(skip))
	body()
	k.Label(skip)
}
