package scheduler

import (
	"fmt"
	"unsafe"

	"github.com/deepstates/dos/adam"
)

// Transfers outside the update phase: the resident state and the working
// copy to the device (Load), the resident state back (Download,
// DownloadAsync), the gradients in and the working copy out through a
// pinned staging buffer (SetGrad, GetWorking), the gradients zeroed on the
// device (ZeroGrad).

// Load makes the device match the host state: it moves the resident
// subgroups' state H2D and writes every subgroup's working copy, rounded
// from the master weights. It waits for the copies. It drops a pending
// Prefetch and speculation first (its state copies read the host state
// before), and takes the host state as every subgroup's (HostState's
// arrays, as the caller wrote them: a state a kept speculative update
// left in a slot is forgotten, so call DropSpeculation before writing
// part of the host state).
//
// Errors: a failed copy or allocation.
func (e *Engine) Load() error {
	if e.broken {
		return ErrBroken
	}
	// A prefetched state H2D read the host state before it changed.
	if err := e.DropPrefetch(); err != nil {
		return err
	}
	for i, l := range e.loc { // nil without Options.Speculate
		if l != homeLoc {
			e.waitGate(i) // a lazy capture may read the slot (StateOf), which is free from here
			e.loc[i] = homeLoc
		}
	}
	return e.upload(true)
}

func (e *Engine) upload(working bool) error {
	s := e.s[sH2D]
	for i := range e.o.Sizes {
		if e.plan.Roles[i] != Resident {
			continue
		}
		for a := range e.nArr {
			h, off, b := e.hostVec(a, i)
			if err := e.dev.H2D(s, e.res[a], 4*e.resOff[i], h, off, b); err != nil {
				// The copies before it still read the host state.
				_ = e.drainAfterFailure(s, e.tail[sH2D])
				return err
			}
		}
	}
	if err := firstErr(e.dev.Record(e.tail[sH2D], s), e.dev.Sync(e.tail[sH2D])); err != nil {
		return err
	}
	if !working {
		return nil
	}
	// The mirror, from the host master weights (pinned).
	for i := range e.mpieces {
		if err := e.copyMirror(i, s, Vec{}); err != nil {
			_ = e.drainAfterFailure(s, e.tail[sH2D])
			return err
		}
	}
	// The working copy, all subgroups flat, rounded on the host into the
	// staging buffer piece by piece (the CPU's rounding is the kernels'),
	// the host-held subgroups' in place.
	for _, sg := range e.segs {
		p := e.state.Param[sg.off : sg.off+sg.n]
		if sg.held {
			adam.Round16(e.o.WorkingDType, e.heldWork(sg.at, sg.n), p)
			continue
		}
		if err := e.pieces(2*sg.n, e.work, 2*sg.at, true, func(st []byte, o int64) {
			u := unsafe.Slice((*uint16)(unsafe.Pointer(&st[0])), len(st)/2)
			adam.Round16(e.o.WorkingDType, u, p[o/2:o/2+int64(len(u))])
		}); err != nil {
			return err
		}
	}
	return nil
}

// Download moves the resident subgroups' state D2H into the host state and
// waits: afterwards HostState is current for every subgroup (for a
// checkpoint or a comparison) but those whose state a kept speculative
// update left in a slot (DropSpeculation brings them home).
//
// Errors: a failed copy (the device's copy stays the one that counts).
func (e *Engine) Download() error {
	wait, err := e.DownloadAsync()
	if err != nil {
		return err
	}
	return wait()
}

// xferElems bounds the pinned staging of SetGrad and GetWorking in
// elements.
const xferElems = 16 << 20

// SetGrad copies a host gradient of every subgroup, flat (total elements,
// Options.GradDType), into the device gradients (and the host-held
// subgroups' into HostGrad) and waits: what a GPU trainer's backward
// leaves there, for a trainer that computes on the host.
//
// Errors: a gradient of another dtype or length, a failed copy.
func (e *Engine) SetGrad(g adam.Grad) error {
	if e.broken {
		return ErrBroken
	}
	if g.DType != e.o.GradDType || int64(g.Len()) != e.total {
		return fmt.Errorf("scheduler: SetGrad: a %v gradient of %d elements, want %v of %d", g.DType, g.Len(), e.o.GradDType, e.total)
	}
	if err := e.DropPrefetch(); err != nil {
		return err
	}
	var src []byte
	if g.DType == adam.F32 {
		src = unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(g.F32))), 4*len(g.F32))
	} else {
		src = unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(g.U16))), 2*len(g.U16))
	}
	return e.bySegment(src, e.grad, e.hgrad, e.gb, true)
}

// bySegment copies flat host bytes b (size bytes per element) to where
// each segment is (up): device memory m through the staging buffer, or
// the host-held buffer h; or from there into b.
func (e *Engine) bySegment(b []byte, m Mem, h Host, size int64, up bool) error {
	for _, sg := range e.segs {
		part := b[size*sg.off : size*(sg.off+sg.n)]
		if sg.held {
			at := h.Bytes()[size*sg.at : size*(sg.at+sg.n)]
			if up {
				copy(at, part)
			} else {
				copy(part, at)
			}
			continue
		}
		if err := e.through(part, m, size*sg.at, up); err != nil {
			return err
		}
	}
	return nil
}

// ZeroGrad sets the device gradients to zero (a memset on the device), and
// the host-held ones (HostGrad), and waits.
//
// Errors: ErrBroken, a memset that could not be enqueued, a failed wait
// (the engine is then broken).
func (e *Engine) ZeroGrad() error {
	if e.broken {
		return ErrBroken
	}
	if err := e.DropPrefetch(); err != nil {
		return err
	}
	s := e.s[sH2D]
	e.laneMu[sH2D].Lock()
	err := firstErr(e.dev.Zero(s, e.grad, 0, e.gb*e.devN), e.dev.Record(e.tail[sH2D], s))
	if e.hgrad != nil {
		clear(e.hgrad.Bytes())
	}
	e.laneMu[sH2D].Unlock()
	if serr := e.dev.Sync(e.tail[sH2D]); serr != nil {
		e.broken = true
		return firstErr(err, serr)
	}
	return err
}

// GetWorking copies the device working copy, flat (total elements), into
// dst and waits: for a trainer whose forward runs on the host. It undoes
// a speculation first (DropSpeculation): the host-held working copy it
// reads is the last step's.
//
// Errors: a dst of another length, a failed copy.
func (e *Engine) GetWorking(dst []uint16) error {
	if e.broken {
		return ErrBroken
	}
	e.dropSpec()
	if int64(len(dst)) != e.total {
		return fmt.Errorf("scheduler: GetWorking: %d elements, want %d", len(dst), e.total)
	}
	return e.bySegment(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(dst))), 2*len(dst)), e.work, e.hwork, 2, false)
}

// through copies host bytes b to device memory m from byte mOff (up) or
// from there to b, through the pinned staging buffer, piece by piece,
// waiting for each.
func (e *Engine) through(b []byte, m Mem, mOff int64, up bool) error {
	return e.pieces(int64(len(b)), m, mOff, up, func(st []byte, o int64) {
		if up {
			copy(st, b[o:])
		} else {
			copy(b[o:], st)
		}
	})
}

// pieces moves size bytes between the pinned staging buffer and device
// memory m from byte mOff, a staging buffer's worth at a time, waiting for
// each: up, host fills the piece at byte o (from mOff) before it moves
// H2D; down, it reads it after the D2H.
func (e *Engine) pieces(size int64, m Mem, mOff int64, up bool, host func(st []byte, o int64)) error {
	st := e.xfer.Bytes()
	l := sH2D
	if !up {
		l = sD2H
	}
	s := e.s[l]
	for o := int64(0); o < size; o += int64(len(st)) {
		n := min(int64(len(st)), size-o)
		if up {
			host(st[:n], o)
		}
		var err error
		e.laneMu[l].Lock()
		if up {
			err = e.dev.H2D(s, m, mOff+o, e.xfer, 0, n)
		} else {
			err = e.dev.D2H(s, e.xfer, 0, m, mOff+o, n)
		}
		err = firstErr(err, e.dev.Record(e.tail[l], s))
		e.laneMu[l].Unlock()
		if serr := e.dev.Sync(e.tail[l]); serr != nil {
			// The piece may still be moving through the staging buffer,
			// which the next transfer would reuse unordered: the engine
			// is broken (LoadCheckpoint gives a new one).
			e.broken = true
			return firstErr(err, serr)
		}
		if err != nil {
			return err
		}
		if !up {
			host(st[:n], o)
		}
	}
	return nil
}

// DownloadAsync enqueues the resident subgroups' state D2H into the host
// state and returns at once, with the function that waits for it: a lazy
// checkpoint's capture (checkpoint.Snapshot.Prepare) calls it while
// training goes on. The next Update's kernels wait for the copies on the
// device (a stream wait, no host wait); nothing else may write the
// resident subgroups' host state before wait returned.
//
// Errors: ErrBroken, a copy that cannot be enqueued (the device's copy of
// the resident state stays the one that counts: the host's was stale).
func (e *Engine) DownloadAsync() (wait func() error, err error) {
	if e.broken {
		return nil, ErrBroken
	}
	s := e.s[sD2H]
	e.laneMu[sD2H].Lock()
	defer e.laneMu[sD2H].Unlock()
copies:
	for i := range e.o.Sizes {
		if e.plan.Roles[i] != Resident {
			continue
		}
		for a := range e.nArr {
			h, off, b := e.hostVec(a, i)
			if err = e.dev.D2H(s, h, off, e.res[a], 4*e.resOff[i], b); err != nil {
				break copies
			}
		}
	}
	// The resident state may change only once it has moved: the next
	// kernels wait for the copies on the device, never on the host.
	if err != nil {
		// The copies enqueued before the failure still read the device
		// state and write the host's: wait for them here, so that neither
		// the next kernels, nor an upload, nor the host (a LoadCheckpoint)
		// touches what they use (found by the simulated device's
		// ordering check and an adversarial review). When even that wait
		// fails, the engine is broken.
		if werr := e.drainAfterFailure(s, e.dlEv); werr != nil {
			return nil, fmt.Errorf("%w (and waiting for the copies before it: %v)", err, werr)
		}
		return nil, err
	}
	if err := firstErr(e.dev.Record(e.dlEv, s), e.dev.Wait(e.s[sKernel], e.dlEv)); err != nil {
		return nil, err
	}
	ev := e.dlEv
	return func() error { return e.dev.Sync(ev) }, nil
}

// drainAfterFailure waits on the host for the work enqueued on s before a
// copy failed to enqueue (recording ev after it), so that nothing reuses
// the memory that work still uses; when even that wait fails the engine is
// broken, and its error is returned.
func (e *Engine) drainAfterFailure(s Stream, ev Event) error {
	if err := firstErr(e.dev.Record(ev, s), e.dev.Sync(ev)); err != nil {
		e.broken = true
		return err
	}
	return nil
}
