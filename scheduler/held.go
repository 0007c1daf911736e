package scheduler

// Host-held subgroups (Options.HostHeld): their gradients and 16-bit
// working copy live in pinned host memory, where a trainer that streams
// their weights block by block (DeepSpeed ZeRO-Infinity's offload_param)
// writes and reads them; the CPU workers update them in place, first in
// every phase, with no copy. The device gradients and working copy hold the
// other subgroups, in order, without gaps.

import (
	"fmt"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// segment is a run of the flat space whose gradients are in one place: on
// the host (held) from hgrad's element at, or on the device from grad's.
type segment struct {
	off, n, at int64
	held       bool
}

// placeHeld checks Options.HostHeld and lays out the device and the host
// buffers: doff, hoff, devN, heldN and the segments.
func (e *Engine) placeHeld() error {
	n := len(e.sizes)
	switch len(e.o.HostHeld) {
	case 0:
		e.held = make([]bool, n)
	case n:
		e.held = append([]bool(nil), e.o.HostHeld...)
	default:
		return fmt.Errorf("scheduler: Options.HostHeld has %d entries for %d subgroups", len(e.o.HostHeld), n)
	}
	e.doff, e.hoff = make([]int64, n), make([]int64, n)
	e.devN, e.heldN, e.segs = 0, 0, nil
	for i, sz := range e.sizes {
		if e.held[i] && len(e.mpieces[i]) > 0 {
			return fmt.Errorf("scheduler: subgroup %d is host-held (Options.HostHeld) and in Options.Mirror: the mirror is refreshed from the device lanes", i)
		}
		at := &e.devN
		e.doff[i], e.hoff[i] = e.devN, -1
		if e.held[i] {
			at = &e.heldN
			e.doff[i], e.hoff[i] = -1, e.heldN
		}
		if k := len(e.segs) - 1; k >= 0 && e.segs[k].held == e.held[i] {
			e.segs[k].n += sz
		} else {
			e.segs = append(e.segs, segment{off: e.off[i], n: sz, at: *at, held: e.held[i]})
		}
		*at += sz
	}
	if e.heldN > 0 {
		e.part = make([]float64, (e.total+adam.MinChunk-1)/adam.MinChunk)
	}
	return nil
}

// checkHeld reports whether p places every host-held subgroup on the CPU,
// outside its lanes' orders (NewHeldPlan's plans do).
func (e *Engine) checkHeld(p *Plan) error {
	if e.heldN == 0 {
		return nil
	}
	return heldPlanErr(e.held, p)
}

// heldPlanErr is checkHeld for the subgroups held marks.
func heldPlanErr(held []bool, p *Plan) error {
	inOrder := make([]bool, len(held))
	for _, i := range p.GPUOrder {
		inOrder[i] = true
	}
	for _, i := range p.CPUOrder {
		inOrder[i] = true
	}
	for i, h := range held {
		if h && (p.Roles[i] != OnCPU || inOrder[i]) {
			return fmt.Errorf("scheduler: subgroup %d is host-held (Options.HostHeld): the plan must place it on the CPU outside its lanes' orders (NewHeldPlan), not %v", i, p.Roles[i])
		}
	}
	return nil
}

// NewHeldPlan places s on the subgroups that held does not mark, as
// NewPlan places it on that many subgroups (s counts those only), and every
// host-held subgroup on the CPU outside the lanes' orders: the engine
// updates them first (Options.HostHeld).
//
// Errors: NewPlan's, for the subgroups not held.
func NewHeldPlan(held []bool, s perfmodel.Schedule) (*Plan, error) {
	return NewHeldPlanIn(held, s, ResidentLast)
}

// NewHeldPlanIn is NewHeldPlan with the resident subgroups (among those
// not held) where l puts them (NewPlanIn).
//
// Errors: NewHeldPlan's; an unknown layout.
func NewHeldPlanIn(held []bool, s perfmodel.Schedule, l Layout) (*Plan, error) {
	var dev []int
	for i, h := range held {
		if !h {
			dev = append(dev, i)
		}
	}
	sub, err := NewPlanIn(len(dev), s, l)
	if err != nil {
		return nil, err
	}
	p := &Plan{Schedule: s, Roles: make([]Role, len(held))}
	for j, i := range dev {
		p.Roles[i] = sub.Roles[j]
	}
	for _, j := range sub.GPUOrder {
		p.GPUOrder = append(p.GPUOrder, dev[j])
	}
	for _, j := range sub.CPUOrder {
		p.CPUOrder = append(p.CPUOrder, dev[j])
	}
	return p, nil
}

// HostHeld reports whether subgroup i is host-held (Options.HostHeld).
func (e *Engine) HostHeld(i int) bool { return e.held[i] }

// DeviceOffset returns where flat element off (of a subgroup that is not
// host-held) is in Grad and Working, and false for an element of a
// host-held subgroup (HostOffset) or outside the flat space.
func (e *Engine) DeviceOffset(off int64) (int64, bool) {
	sg, ok := e.segAt(off)
	if !ok || sg.held {
		return 0, false
	}
	return sg.at + off - sg.off, true
}

// HostOffset returns where flat element off of a host-held subgroup is in
// HostGrad and HostWorking (elements), and false for any other.
func (e *Engine) HostOffset(off int64) (int64, bool) {
	sg, ok := e.segAt(off)
	if !ok || !sg.held {
		return 0, false
	}
	return sg.at + off - sg.off, true
}

// segAt returns the segment that holds flat element off.
func (e *Engine) segAt(off int64) (segment, bool) {
	if off < 0 || off >= e.total {
		return segment{}, false
	}
	lo, hi := 0, len(e.segs)
	for hi-lo > 1 {
		if m := (lo + hi) / 2; e.segs[m].off <= off {
			lo = m
		} else {
			hi = m
		}
	}
	return e.segs[lo], true
}

// HostGrad returns the host-held subgroups' gradients in pinned host
// memory, flat in order (HostOffset), Options.GradDType: the trainer writes
// them (a D2H copy after each block's backward) before Stats and Update.
// nil without host-held subgroups. The memory is the engine's from New to
// Close.
func (e *Engine) HostGrad() Host { return e.hgrad }

// HostWorking returns the host-held subgroups' 16-bit working copy in
// pinned host memory, flat in order (HostOffset), Options.WorkingDType:
// Load and Update write it (every write of a phase is complete when Update
// returns), the trainer copies it H2D before each forward and backward.
// nil without host-held subgroups.
func (e *Engine) HostWorking() Host { return e.hwork }

// heldGrad returns n elements of the host-held gradients from element at.
func (e *Engine) heldGrad(at, n int64) adam.Grad {
	return hostGrad(e.hgrad, e.o.GradDType, at, n)
}

// hostGrad views n gradient elements of dtype gd in h from element at.
func hostGrad(h Host, gd adam.DType, at, n int64) adam.Grad {
	b := h.Bytes()
	if gd == adam.F32 {
		return adam.GradF32(unsafe.Slice((*float32)(unsafe.Pointer(&b[4*at])), n))
	}
	return adam.Grad16(gd, unsafe.Slice((*uint16)(unsafe.Pointer(&b[2*at])), n))
}

// heldWork returns n elements of the host-held working copy from element
// at.
func (e *Engine) heldWork(at, n int64) []uint16 {
	return unsafe.Slice((*uint16)(unsafe.Pointer(&e.hwork.Bytes()[2*at])), n)
}

// heldStats is Stats with host-held subgroups: the partial sums of each
// MinChunk block where its gradient is, added in block order.
func (e *Engine) heldStats(unscale float32) (finite bool, sum float64, err error) {
	const mc = adam.MinChunk
	dev, finite, err := e.takeHeldParts(unscale)
	if err != nil {
		return false, 0, err
	}
	defer e.forgetHeldParts() // their kernels are done (takeHeldParts)
	// The blocks inside one segment.
	for _, sg := range e.segs {
		lo, hi := (sg.off+mc-1)/mc*mc, (sg.off+sg.n)/mc*mc
		if sg.off+sg.n == e.total {
			hi = e.total
		}
		if lo >= hi {
			continue
		}
		dst := e.part[lo/mc : (hi+mc-1)/mc]
		at := sg.at + lo - sg.off
		var ok bool
		switch {
		case sg.held && dev:
			ok = e.heldRuns(sg, lo, hi, unscale)
		case sg.held:
			ok = e.pool.GradPartials(e.heldGrad(at, hi-lo), unscale, dst)
		default:
			ok, err = e.dev.GradPartials(e.s[sKernel], e.o.GradDType, Vec{Mem: e.grad, Off: at, N: hi - lo}, unscale, dst)
			if err != nil {
				return false, 0, err
			}
		}
		finite = finite && ok
	}
	// The blocks that a change of place cuts, gathered on the host.
	last := int64(-1)
	for _, sg := range e.segs[1:] {
		b := sg.off / mc
		if sg.off%mc == 0 || b == last {
			continue
		}
		last = b
		ok, err := e.mixedBlock(b, unscale)
		if err != nil {
			return false, 0, err
		}
		finite = finite && ok
	}
	for _, x := range e.part {
		sum += x
	}
	return finite, sum, nil
}

// mixedBlock gathers block b's gradients from both places into e.mix and
// writes its partial sum.
func (e *Engine) mixedBlock(b int64, unscale float32) (bool, error) {
	const mc = adam.MinChunk
	lo, hi := b*mc, min((b+1)*mc, e.total)
	s := e.s[sD2H]
	copied := false
	var err error // a copy that could not be enqueued: wait for those that were first
	for _, sg := range e.segs {
		a, z := max(lo, sg.off), min(hi, sg.off+sg.n)
		if a >= z {
			continue
		}
		at := sg.at + a - sg.off
		if sg.held {
			copy(e.mix.Bytes()[e.gb*(a-lo):e.gb*(z-lo)], e.hgrad.Bytes()[e.gb*at:e.gb*(at+z-a)])
			continue
		}
		e.laneMu[sD2H].Lock()
		err = e.dev.D2H(s, e.mix, e.gb*(a-lo), e.grad, e.gb*at, e.gb*(z-a))
		e.laneMu[sD2H].Unlock()
		if err != nil {
			break
		}
		copied = true
	}
	if !copied && err != nil {
		return false, err
	}
	if copied {
		e.laneMu[sD2H].Lock()
		err = firstErr(err, e.dev.Record(e.tail[sD2H], s))
		e.laneMu[sD2H].Unlock()
		if serr := e.dev.Sync(e.tail[sD2H]); serr != nil {
			e.broken = true // the copy may still be writing e.mix
			return false, firstErr(err, serr)
		}
		if err != nil {
			return false, err
		}
	}
	return adam.DefaultPath.GradPartials(hostGrad(e.mix, e.o.GradDType, 0, hi-lo), unscale, e.part[b:b+1]), nil
}
