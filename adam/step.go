package adam

import (
	"fmt"
	"math"
)

// State is the optimizer state of n parameters: fp32 master weights and the
// moments, each of length n. MaxExpAvgSq is used only with amsgrad and must
// then have length n too.
type State struct {
	Param       []float32 // master weights, p
	ExpAvg      []float32 // first moment, m
	ExpAvgSq    []float32 // second moment, v
	MaxExpAvgSq []float32 // running max of v (amsgrad), or nil
}

// Len returns the number of parameters, len(Param).
func (s State) Len() int { return len(s.Param) }

// Clone returns a deep copy of s (nil stays nil).
func (s State) Clone() State {
	cp := func(v []float32) []float32 {
		if v == nil {
			return nil
		}
		return append([]float32(nil), v...)
	}
	return State{Param: cp(s.Param), ExpAvg: cp(s.ExpAvg), ExpAvgSq: cp(s.ExpAvgSq), MaxExpAvgSq: cp(s.MaxExpAvgSq)}
}

// Slice returns the state of elements [lo, hi). Panics out of range.
func (s State) Slice(lo, hi int) State {
	out := State{Param: s.Param[lo:hi], ExpAvg: s.ExpAvg[lo:hi], ExpAvgSq: s.ExpAvgSq[lo:hi]}
	if s.MaxExpAvgSq != nil {
		out.MaxExpAvgSq = s.MaxExpAvgSq[lo:hi]
	}
	return out
}

// Grad is a gradient of n elements in one of three dtypes: F32 uses F32,
// BF16 and F16 use U16 (bit patterns).
type Grad struct {
	DType DType
	F32   []float32
	U16   []uint16
}

// GradF32 wraps an fp32 gradient.
func GradF32(g []float32) Grad { return Grad{DType: F32, F32: g} }

// Grad16 wraps a bf16 or fp16 gradient given as bit patterns.
func Grad16(d DType, g []uint16) Grad { return Grad{DType: d, U16: g} }

// Len returns the number of elements.
func (g Grad) Len() int {
	if g.DType == F32 {
		return len(g.F32)
	}
	return len(g.U16)
}

// Slice returns elements [lo, hi). Panics out of range.
func (g Grad) Slice(lo, hi int) Grad {
	if g.DType == F32 {
		return Grad{DType: F32, F32: g.F32[lo:hi]}
	}
	return Grad{DType: g.DType, U16: g.U16[lo:hi]}
}

// Copy16 is the optional 16-bit working copy that a step writes: the new
// master weights rounded to DType (BF16 or F16). A zero Copy16 writes
// nothing.
type Copy16 struct {
	DType DType
	Data  []uint16
}

// Slice returns elements [lo, hi) of a non-empty copy; a zero Copy16 stays
// zero. Panics out of range.
func (c Copy16) Slice(lo, hi int) Copy16 {
	if c.DType == 0 {
		return c
	}
	return Copy16{DType: c.DType, Data: c.Data[lo:hi]}
}

// block is how many elements the reference loop stages at a time: the
// gradient is upcast, unscaled and clipped into a stack buffer of this many
// fp32 values, then the moments and master weights are updated.
const block = 256

func checkLens(c *Coeffs, s State, g Grad, out Copy16) {
	n := len(s.Param)
	if len(s.ExpAvg) != n || len(s.ExpAvgSq) != n || g.Len() != n {
		panic(fmt.Sprintf("adam: length mismatch: param %d, exp_avg %d, exp_avg_sq %d, grad %d",
			n, len(s.ExpAvg), len(s.ExpAvgSq), g.Len()))
	}
	if c.AMSGrad && len(s.MaxExpAvgSq) != n {
		panic(fmt.Sprintf("adam: amsgrad needs max_exp_avg_sq of length %d, have %d", n, len(s.MaxExpAvgSq)))
	}
	if out.DType != 0 && len(out.Data) != n {
		panic(fmt.Sprintf("adam: 16-bit copy has length %d, want %d", len(out.Data), n))
	}
	switch g.DType {
	case F32, BF16, F16:
	default:
		panic(fmt.Sprintf("adam: gradient dtype %v", g.DType))
	}
	switch out.DType {
	case 0, BF16, F16:
	default:
		panic(fmt.Sprintf("adam: 16-bit copy dtype %v", out.DType))
	}
}

// Step applies one AdamW step with the scalars c to the state s, reading the
// gradient g and writing the 16-bit copy out when out.DType is set. All
// lengths must be equal: this is the scalar reference, on the calling
// goroutine. See the package doc for the arithmetic; it follows
// torch.optim.AdamW / torch.optim.Adam with foreach=False.
//
// Step allocates nothing. It panics on a length or dtype mismatch. It runs
// on DefaultPath; Path.Step picks another.
func Step(c *Coeffs, s State, g Grad, out Copy16) { DefaultPath.Step(c, s, g, out) }

// Step is the package-level Step on this path.
func (path Path) Step(c *Coeffs, s State, g Grad, out Copy16) {
	checkLens(c, s, g, out)
	n := len(s.Param)
	// An fp32 gradient that needs no scaling or sign change is used in
	// place: no staging copy, one kernel call for the whole range, in
	// blocks so that the 16-bit copy reads p from cache.
	direct := g.DType == F32 && c.Unscale == 1 && c.Clip == 1 && !c.Maximize
	step := block
	if direct {
		step = 16 * block
	}
	var gb [block]float32
	for lo := 0; lo < n; lo += step {
		hi := min(lo+step, n)
		gs := g.F32
		if direct {
			gs = gs[lo:hi]
		} else {
			gs = gb[:hi-lo]
			path.loadGrad(c, gs, g, lo)
		}
		var vmax []float32
		if c.AMSGrad {
			vmax = s.MaxExpAvgSq[lo:hi]
		}
		path.update(c, s.Param[lo:hi], s.ExpAvg[lo:hi], s.ExpAvgSq[lo:hi], vmax, gs)
		if out.DType != 0 {
			path.Round16(out.DType, out.Data[lo:hi], s.Param[lo:hi])
		}
	}
}

// StepTo is Step that leaves s as it is and writes the new state to to
// (s's arrays and lengths; MaxExpAvgSq only with c.AMSGrad) and the new
// 16-bit copy to out: the update out of place, for a speculative update
// that a rollback undoes by keeping s (Pool.StepTo). On a SIMD path the
// new state goes to memory with non-temporal stores (none of to's lines
// is read first: 28 bytes of memory traffic a parameter for a bf16
// gradient and copy, as Step's), fenced once when the range is done (a
// fence each block cost a third of the rate), in blocks that start on to.Param's
// vector alignment; the results are Step's bit for bit, but for a NaN
// result's sign and payload (the elements the kernel and the Go reference
// take may differ from Step's, and which NaN an operation on NaNs returns
// depends on operand order: see Path). Where to's arrays are not aligned
// alike, the Go reference takes every element (no non-temporal stores).
// to may be s itself, never a part of it. It allocates nothing. Panics as Step does,
// and on to of other lengths.
func (path Path) StepTo(c *Coeffs, s State, g Grad, out Copy16, to State) {
	checkLens(c, s, g, out)
	if !c.AMSGrad {
		s.MaxExpAvgSq, to.MaxExpAvgSq = nil, nil
	}
	checkSave(s, nil, to, nil)
	n := len(s.Param)
	// The first block ends where to.Param is aligned to 64 bytes (either
	// path's vector), so that every block after it starts aligned.
	first := block
	if a := alignHead(to.Param, 64); a > 0 {
		first = a
	}
	var gb, pc [block]float32
	for lo := 0; lo < n; {
		hi := min(lo+block, n)
		if lo == 0 {
			hi = min(first, n)
		}
		gs := gb[:hi-lo]
		path.loadGrad(c, gs, g, lo)
		var vmax, dvmax []float32
		if c.AMSGrad {
			vmax, dvmax = s.MaxExpAvgSq[lo:hi], to.MaxExpAvgSq[lo:hi]
		}
		path.updateTo(c, s.Param[lo:hi], s.ExpAvg[lo:hi], s.ExpAvgSq[lo:hi], vmax, gs, to.Param[lo:hi], to.ExpAvg[lo:hi], to.ExpAvgSq[lo:hi], dvmax, pc[:hi-lo])
		if out.DType != 0 {
			path.Round16(out.DType, out.Data[lo:hi], pc[:hi-lo])
		}
		lo = hi
	}
	if path.lanes > 1 {
		// The kernel's non-temporal stores, fenced once for the whole
		// range (not each block) before the caller says it is done. A
		// goroutine moved to another core between a block and the fence
		// left no store behind: the interrupt and the kernel's locked
		// instructions of the move drain the write-combining buffers.
		simdFenceNT()
	}
}

// loadGrad writes into dst the fp32 gradient elements [lo, lo+len(dst)) of
// g, multiplied by c.Unscale and c.Clip and negated under maximize.
func (path Path) loadGrad(c *Coeffs, dst []float32, g Grad, lo int) {
	if g.DType == F32 {
		copy(dst, g.F32[lo:lo+len(dst)])
	} else {
		path.Widen16(g.DType, dst, g.U16[lo:lo+len(dst)])
	}
	path.scale(dst, c.Unscale, c.Clip, scaleFlags(c))
}

// update is the element-wise core on fp32 gradients g (already unscaled,
// clipped and signed). Every intermediate is rounded to fp32: the explicit
// conversions keep the compiler from fusing multiply-adds.
func update(c *Coeffs, p, m, v, vmax, g []float32) {
	p = p[:len(g)]
	m = m[:len(g)]
	v = v[:len(g)]
	w := c.Beta1Weight
	smallW := w < 0.5 // ATen's lerp picks its formula by |weight| < 0.5
	oneMinusW := float32(1 - w)
	for i, gi := range g {
		pi := p[i]
		if c.Decay != 1 {
			pi = float32(pi * c.Decay)
		}
		if c.L2 != 0 {
			gi = gi + float32(c.L2*pi)
		}
		mi := m[i]
		if smallW {
			mi = mi + float32(w*float32(gi-mi))
		} else {
			mi = gi - float32(float32(gi-mi)*oneMinusW)
		}
		vi := float32(v[i]*c.Beta2) + float32(float32(c.OneMinusB2*gi)*gi)
		vd := vi
		if vmax != nil {
			// torch.maximum: NaN propagates.
			if vmax[i] > vd || vmax[i] != vmax[i] {
				vd = vmax[i]
			}
			vmax[i] = vd
		}
		denom := float32(float32(math.Sqrt(float64(vd)))/c.BC2Sqrt) + c.Eps
		p[i] = pi + float32(float32(c.NegStepSize*mi)/denom)
		m[i] = mi
		v[i] = vi
	}
}

// Widen16 writes into dst the 16-bit values src of dtype d (BF16 or F16)
// upcast exactly to fp32 (BF16ToF32, F16ToF32), on DefaultPath. Panics if
// len(dst) < len(src).
func Widen16(d DType, dst []float32, src []uint16) { DefaultPath.Widen16(d, dst, src) }

// Widen16 is the package-level Widen16 on this path.
func (path Path) Widen16(d DType, dst []float32, src []uint16) {
	if len(dst) < len(src) {
		panic(fmt.Sprintf("adam: Widen16: destination has %d elements, source %d", len(dst), len(src)))
	}
	dst = dst[:len(src)]
	head := len(src) - len(src)%16
	if !simdWiden(path.lanes, d, dst, src, head) {
		head = 0
	}
	if d == BF16 {
		for i, h := range src[head:] {
			dst[head+i] = BF16ToF32(h)
		}
		return
	}
	for i, h := range src[head:] {
		dst[head+i] = F16ToF32(h)
	}
}

// Round16 writes into dst the fp32 values src rounded to the 16-bit dtype d
// (BF16 or F16), to nearest even (F32ToBF16, F32ToF16): the working copy of
// master weights. It runs on DefaultPath. Panics if len(dst) < len(src).
func Round16(d DType, dst []uint16, src []float32) { DefaultPath.Round16(d, dst, src) }

// Round16 is the package-level Round16 on this path.
func (path Path) Round16(d DType, dst []uint16, src []float32) {
	if len(dst) < len(src) {
		panic(fmt.Sprintf("adam: Round16: destination has %d elements, source %d", len(dst), len(src)))
	}
	dst = dst[:len(src)]
	head := len(src) - len(src)%16
	if !simdRound(path.lanes, d, dst, src, head) {
		head = 0
	}
	if d == BF16 {
		for i, f := range src[head:] {
			dst[head+i] = F32ToBF16(f)
		}
		return
	}
	for i, f := range src[head:] {
		dst[head+i] = F32ToF16(f)
	}
}
