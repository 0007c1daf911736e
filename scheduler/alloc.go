package scheduler

// The engine's memory: what New allocates once (allocBase) and what each
// plan needs (allocPlan, freed by Close; Replan frees it too, but hands the
// pinned host buffers to the next plan where they fit: planHost).

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/deepstates/dos/adam"
)

func (e *Engine) devAlloc(list *[]any, bytes int64) (Mem, error) {
	m, err := e.dev.Alloc(bytes)
	if err != nil {
		return nil, fmt.Errorf("scheduler: %d bytes of device memory: %w", bytes, err)
	}
	*list = append(*list, m)
	return m, nil
}

func (e *Engine) hostAlloc(list *[]any, bytes int64) (Host, error) {
	h, err := e.dev.AllocHost(bytes)
	if err != nil {
		return nil, fmt.Errorf("scheduler: %d bytes of pinned host memory: %w", bytes, err)
	}
	*list = append(*list, h)
	return h, nil
}

// eventAlloc and streamAlloc return a new event and stream of the device,
// added to list (freed with it), as devAlloc and hostAlloc do memory.
func (e *Engine) eventAlloc(list *[]any) (Event, error) {
	ev, err := e.dev.NewEvent()
	if err != nil {
		return nil, err
	}
	*list = append(*list, ev)
	return ev, nil
}

func (e *Engine) streamAlloc(list *[]any) (Stream, error) {
	s, err := e.dev.NewStream()
	if err != nil {
		return nil, err
	}
	*list = append(*list, s)
	return s, nil
}

// planHost returns pinned host memory of at least bytes for the plan being
// allocated (added to e.planAllocs): the smallest of the previous plan's
// buffers that Replan kept (e.spare) that is large enough and at most
// twice that, else a new one. With last (the plan's last host buffer) the
// spares it does not take are freed before a new one is pinned, so a
// growing buffer is never pinned beside the one it replaces. A kept buffer
// holds the old plan's bytes, not zeros: the plan's host buffers are
// staging, written before they are read. Pinning is what a re-plan paid
// most for on the H200 (the prefetch buffer's 1.5 GB of cuMemHostRegister
// between two iterations of 0.3 s).
func (e *Engine) planHost(bytes int64, last bool) (Host, error) {
	best := -1
	for j, h := range e.spare {
		if n := int64(len(h.Bytes())); n >= bytes && n <= 2*bytes && (best < 0 || n < int64(len(e.spare[best].Bytes()))) {
			best = j
		}
	}
	if best >= 0 {
		h := e.spare[best]
		e.spare = append(e.spare[:best], e.spare[best+1:]...)
		e.planAllocs = append(e.planAllocs, h)
		if last {
			e.freeSpare()
		}
		return h, nil
	}
	if last {
		e.freeSpare()
	}
	return e.hostAlloc(&e.planAllocs, bytes)
}

// freeSpare frees the buffers Replan kept that the new plan did not take.
// A failure leaks pinned memory but leaves the engine working: Close
// reports it (e.leaked).
func (e *Engine) freeSpare() {
	for _, h := range e.spare {
		if err := e.dev.FreeHost(h); err != nil {
			e.leaked = errors.Join(e.leaked, fmt.Errorf("scheduler: Replan: freeing the old plan's pinned memory: %w", err))
		}
	}
	e.spare = e.spare[:0]
}

// allocBase allocates what does not depend on the plan: the host state,
// the device gradients and working copy, streams and events.
func (e *Engine) allocBase() error {
	var err error
	views := []*[]float32{&e.state.Param, &e.state.ExpAvg, &e.state.ExpAvgSq, &e.state.MaxExpAvgSq}
	for a := range e.nArr {
		if e.host[a], err = e.hostAlloc(&e.allocs, 4*e.total); err != nil {
			return err
		}
		*views[a] = unsafe.Slice((*float32)(unsafe.Pointer(&e.host[a].Bytes()[0])), e.total)
	}
	// The device gradients and working copy hold the subgroups that are
	// not host-held (at least one element, for a device that refuses 0).
	if e.grad, err = e.devAlloc(&e.allocs, e.gb*max(e.devN, 1)); err != nil {
		return err
	}
	if e.work, err = e.devAlloc(&e.allocs, 2*max(e.devN, 1)); err != nil {
		return err
	}
	if e.heldN > 0 {
		if e.hgrad, err = e.hostAlloc(&e.allocs, e.gb*e.heldN); err != nil {
			return err
		}
		if e.hwork, err = e.hostAlloc(&e.allocs, 2*e.heldN); err != nil {
			return err
		}
		if e.mix, err = e.hostAlloc(&e.allocs, e.gb*adam.MinChunk); err != nil {
			return err
		}
	}
	if e.mirrorN > 0 {
		if e.mirror, err = e.devAlloc(&e.allocs, 4*e.mirrorN); err != nil {
			return err
		}
	}
	for i := range e.s {
		if e.s[i], err = e.streamAlloc(&e.allocs); err != nil {
			return err
		}
	}
	event := func() (Event, error) { return e.eventAlloc(&e.allocs) }
	if e.xfer, err = e.hostAlloc(&e.allocs, 4*min(e.maxN, xferElems)); err != nil {
		return err
	}
	if e.base, err = event(); err != nil {
		return err
	}
	for i := range e.tail {
		if e.tail[i], err = event(); err != nil {
			return err
		}
	}
	if e.dlEv, err = event(); err != nil {
		return err
	}
	if e.preEv, err = event(); err != nil {
		return err
	}
	if e.preBase, err = event(); err != nil {
		return err
	}
	e.pre, e.preLast = make([]uint8, len(e.sizes)), make([]uint8, len(e.sizes))
	return nil
}

// allocPlan places p: the schedule core's steps and their events, the
// resident state, the device staging slots, the upcast scratch, the host
// staging slots.
func (e *Engine) allocPlan(p *Plan) error {
	e.plan, e.updated = p, false
	e.core = newCore(p, shape{sizes: e.sizes, arrays: e.nArr, gradBytes: e.gb, chunk: e.o.copyChunk, held: e.held})
	nops := 0
	for i := range e.sizes {
		nops += len(e.core.ops(i))
	}
	e.spans = make([]interval, 0, nops) // Measure's scratch
	e.cpuGD = e.o.GradDType
	if e.core.upcast {
		e.cpuGD = adam.F32
	}
	e.resOff = make([]int64, len(e.o.Sizes))
	var nRes int64
	for i, n := range e.o.Sizes {
		if p.Roles[i] == Resident {
			e.resOff[i] = nRes
			nRes += int64(n)
		}
	}
	e.res, e.stage, e.scr, e.gst, e.cst = [4]Mem{}, [4]Mem{}, nil, nil, nil
	var err error
	l := &e.planAllocs
	if nRes > 0 {
		for a := range e.nArr {
			if e.res[a], err = e.devAlloc(l, 4*nRes); err != nil {
				return err
			}
		}
	}
	if p.Schedule.GPU > 0 {
		for a := range e.nArr {
			if e.stage[a], err = e.devAlloc(l, 2*4*e.maxN); err != nil {
				return err
			}
		}
	}
	prefetch := e.o.Prefetch && !e.core.upcast // CPU subgroups' gradients in gpre
	if len(p.CPUOrder) > 0 {
		if e.core.upcast {
			if e.scr, err = e.devAlloc(l, 2*4*e.maxN); err != nil {
				return err
			}
		}
		if e.gst, err = e.planHost(2*elemBytes(e.cpuGD)*e.maxN, false); err != nil {
			return err
		}
		if e.cst, err = e.planHost(2*2*e.maxN, !prefetch); err != nil {
			return err
		}
	}
	e.gpre, e.gpOff = nil, make([]int64, len(e.sizes))
	if prefetch && len(p.CPUOrder) > 0 {
		var b int64
		for _, i := range p.CPUOrder {
			e.gpOff[i] = b
			b += e.gb * e.sizes[i]
		}
		if e.gpre, err = e.planHost(b, true); err != nil {
			return err
		}
	}
	// An event at the end of every step on the device, and one at the
	// start of every operation there.
	steps := e.core.steps
	e.startEv, e.endEv = make([]Event, len(steps)), make([]Event, len(steps))
	event := func(ev *Event) error {
		var err error
		*ev, err = e.eventAlloc(l)
		return err
	}
	for k := range steps {
		if steps[k].queue == qCPU {
			continue
		}
		if err := event(&e.endEv[k]); err != nil {
			return err
		}
		if steps[k].first {
			if err := event(&e.startEv[k]); err != nil {
				return err
			}
		}
	}
	return nil
}

// Replan moves the engine to plan p (NewPlan over the same subgroups):
// the resident state comes back to the host, the memory of the old plan
// is freed, p's is allocated and its resident state moves to the device.
// The old plan's pinned host buffers (staging, prefetch) serve the new
// plan where they are large enough (and not more than twice), so a re-plan
// pins nothing new unless p needs more; a buffer that grows is pinned
// after the old one is freed. When p's memory cannot be allocated (the device out of memory, or a
// cap), the old plan is allocated again in the memory it just gave back
// and its resident state uploaded: Replan returns an error wrapping
// ErrReplanRefused and the engine runs the old plan as before.
//
// Errors: a plan for other subgroups; ErrReplanRefused; a failed copy,
// or an allocation that failed for the old plan too (the engine is then
// broken: Close it). A failure to free the old plan's pinned memory that
// p did not take leaves the engine on p, working, and Close returns it.
func (e *Engine) Replan(p *Plan) error {
	if e.broken {
		return ErrBroken
	}
	if p == nil || len(p.Roles) != len(e.o.Sizes) {
		return fmt.Errorf("scheduler: Replan: the plan must place the %d subgroups", len(e.o.Sizes))
	}
	if err := e.checkHeld(p); err != nil {
		return fmt.Errorf("scheduler: Replan: %w", err)
	}
	if err := firstErr(e.DropPrefetch(), e.Download()); err != nil {
		return err
	}
	e.home() // the roles change: every state where the new plan reads it
	old := e.plan
	// The old plan's pinned host buffers wait in e.spare for the new plan
	// (planHost); what it does not take is freed by then, or on the way
	// out (a plan without CPU subgroups takes none).
	defer e.freeSpare()
	if err := e.freePlan(true); err != nil {
		// What the old plan held may still be in use by the device.
		e.broken = true
		return fmt.Errorf("%w: Replan: %v", ErrBroken, err)
	}
	if err := e.allocPlan(p); err != nil {
		if ferr := e.freePlan(true); ferr == nil && old != nil && old != p {
			if rerr := e.allocPlan(old); rerr == nil {
				if uerr := e.upload(false); uerr == nil {
					return fmt.Errorf("%w: %v", ErrReplanRefused, err)
				}
			}
		}
		e.broken = true
		return err
	}
	if err := e.upload(false); err != nil {
		// The new resident state is not all on the device.
		e.broken = true
		return fmt.Errorf("%w: Replan: %v", ErrBroken, err)
	}
	return nil
}

// ErrReplanRefused is Replan's error when the new plan's memory could not
// be allocated and the engine went back to the old plan, which it runs as
// before.
var ErrReplanRefused = errors.New("scheduler: Replan refused: the new plan's memory could not be allocated; the old plan is back")

// freePlan frees what allocPlan allocated and returns the Free errors;
// with keepHost its pinned host buffers go to e.spare instead, for
// planHost.
func (e *Engine) freePlan(keepHost bool) error {
	list := e.planAllocs
	if keepHost {
		list = list[:0:0]
		for _, x := range e.planAllocs {
			if h, ok := x.(Host); ok {
				e.spare = append(e.spare, h)
			} else {
				list = append(list, x)
			}
		}
	}
	err := e.free(list)
	e.planAllocs = nil
	return err
}

// free frees list's objects (each a Stream, an Event, a Host or a Mem),
// the last allocated first, and returns the errors of those that failed.
func (e *Engine) free(list []any) error {
	var errs []error
	for i := len(list) - 1; i >= 0; i-- {
		var err error
		switch x := list[i].(type) {
		case mapped:
			err = e.dev.UnmapHost(x.h)
		case Stream:
			err = e.dev.FreeStream(x)
		case Event:
			err = e.dev.FreeEvent(x)
		case Host: // before Mem: a CUDA host buffer has a length too
			err = e.dev.FreeHost(x)
		case Mem:
			err = e.dev.FreeMem(x)
		default:
			panic(fmt.Sprintf("scheduler: freeing a %T", x))
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func elemBytes(d adam.DType) int64 {
	if d == adam.F32 {
		return 4
	}
	return 2
}

// mapped is MapHost's memory in an allocation list, which free unmaps.
type mapped struct{ h Host }

// mapAlloc maps bytes of host memory that only the CPU uses (Device.MapHost)
// and adds it to list, for free.
func (e *Engine) mapAlloc(list *[]any, bytes int64) (Host, error) {
	h, err := e.dev.MapHost(bytes)
	if err != nil {
		return nil, fmt.Errorf("scheduler: %d bytes of host memory: %w", bytes, err)
	}
	*list = append(*list, mapped{h})
	return h, nil
}
