package scheduler

// The global checks' partial sums of host-held gradients, taken on the
// device (Engine.HeldPartials): a trainer that streams a block's weights
// has its gradients in device memory before it copies them to HostGrad, so
// the GPU sums them there, beside the backward, and Stats reads the sums
// instead of passing over HostGrad on the CPU workers after the backward
// (4.24B with 17 of 36 blocks streamed on an H100: about 59 ms an
// iteration, 1.9B gradients). The kernel is adam.Path.GradPartials on the
// device (Device.GradPartialsTo), so the sum is the same bit for bit.

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/deepstates/dos/adam"
)

// heldParts is HeldPartials' state between a backward and its Stats.
type heldParts struct {
	dev     Mem     // a float64 sum per adam.MinChunk block of the flat space, then the int32 non-finite flag
	host    Host    // dev's pinned twin, which Stats reads
	ev      Event   // after each kernel, on its caller's stream; Stats' copy
	done    []bool  // per block: its sum is being written to dev
	on      bool    // a sum was enqueued since the last Stats or drop
	failed  bool    // their memory could not be allocated: never taken
	unscale float32 // the unscale of the sums
}

// HeldPartials enqueues on s, after the work enqueued there so far, the
// partial sums of the global checks (Stats) over the host-held gradients of
// flat elements [off, off+g.N), which g holds in device memory too
// (Options.GradDType elements, the same bits that are or will be in HostGrad):
// a GPU trainer that streams a block's weights calls it as that block's
// backward ends, on the stream that then copies its gradients to HostGrad. The
// next Stats with the same unscale takes the sum of each adam.MinChunk block
// that lies wholly inside the range from the device and passes over the rest
// on the CPU workers (Stats' order and bits are unchanged). g must not change
// until the work this call enqueues on s is done (the caller's later work on
// s, or an event recorded there after it, orders a rewrite). Calls may come on
// several streams: each waits for the one before. Stats, Update (a phase
// without Stats: the next gradients' sums are not these), ZeroGrad, SetGrad
// and DropPrefetch (and so Load, Replan and Close) forget the sums. It waits
// for nothing; its first call allocates the sums' device and pinned memory (8
// bytes a block; where that fails, no sums are ever taken and Stats sums on
// the host). Not concurrently with Stats, Update or DropPrefetch.
//
// Errors: ErrBroken; ErrEngineClosed after Close; a range that is not inside
// one run of host-held subgroups; an unscale other than the one of the sums
// since the last Stats; the device's (an event that could not be recorded
// breaks the engine: the kernel may still write).
func (e *Engine) HeldPartials(s Stream, off int64, g Vec, unscale float32) error {
	if e.broken {
		return ErrBroken
	}
	if !e.running {
		return ErrEngineClosed
	}
	if g.N <= 0 {
		return nil
	}
	sg, ok := e.segAt(off)
	if !ok || !sg.held || g.N > sg.off+sg.n-off {
		return fmt.Errorf("scheduler: HeldPartials: flat elements [%d, %d) are not all in one run of host-held subgroups", off, off+g.N)
	}
	if e.hp.on && unscale != e.hp.unscale {
		return fmt.Errorf("scheduler: HeldPartials: unscale %g, but the sums since the last Stats were taken with %g", unscale, e.hp.unscale)
	}
	const mc = adam.MinChunk
	lo, hi := (off+mc-1)/mc*mc, (off+g.N)/mc*mc
	if off+g.N == e.total {
		hi = e.total
	}
	if lo >= hi {
		return nil // no block lies wholly inside: Stats sums it on the host
	}
	if !e.allocHeldParts() {
		return nil // no memory for the sums: Stats sums on the host, as before
	}
	nb := (hi - lo + mc - 1) / mc
	flag := Vec{Mem: e.hp.dev, Off: 2 * int64(len(e.part)), N: 1} // int32 elements
	if !e.hp.on {
		if err := e.dev.Zero(s, e.hp.dev, 8*int64(len(e.part)), 4); err != nil {
			return err
		}
		e.hp.on, e.hp.unscale = true, unscale
	} else if err := e.dev.Wait(s, e.hp.ev); err != nil {
		// After the flag's zero and the last call's kernel, which
		// another stream may have run.
		return err
	}
	if err := e.dev.GradPartialsTo(s, e.o.GradDType, Vec{Mem: g.Mem, Off: g.Off + lo - off, N: hi - lo}, unscale, Vec{Mem: e.hp.dev, Off: lo / mc, N: nb}, flag); err != nil {
		return err
	}
	// Stats reads the sums on the kernel lane: it waits for this one.
	e.laneMu[sKernel].Lock()
	err := firstErr(e.dev.Record(e.hp.ev, s), e.dev.Wait(e.s[sKernel], e.hp.ev))
	e.laneMu[sKernel].Unlock()
	if err != nil {
		e.broken = true
		return err
	}
	for b := lo / mc; b < lo/mc+nb; b++ {
		e.hp.done[b] = true
	}
	return nil
}

// allocHeldParts allocates HeldPartials' memory once and reports whether
// it has it. A failure is not an error: the sums are an optimization, and a
// run under a device memory cap must not stop for their 8 bytes a block
// (the memory plan does not count them); the engine then never tries
// again and Stats sums on the host.
func (e *Engine) allocHeldParts() bool {
	if e.hp.done != nil || e.hp.failed {
		return !e.hp.failed
	}
	bytes := 8*int64(len(e.part)) + 8
	var list []any
	ok := func() bool {
		dev, err := e.devAlloc(&list, bytes)
		if err != nil {
			return false
		}
		host, err := e.hostAlloc(&list, bytes)
		if err != nil {
			return false
		}
		ev, err := e.eventAlloc(&list)
		if err != nil {
			return false
		}
		e.hp.dev, e.hp.host, e.hp.ev = dev, host, ev
		return true
	}()
	if !ok {
		e.hp.failed = true
		if err := e.free(list); err != nil {
			e.leaked = errors.Join(e.leaked, err)
		}
		return false
	}
	e.allocs = append(e.allocs, list...)
	e.hp.done = make([]bool, len(e.part))
	return true
}

// takeHeldParts brings HeldPartials' sums to the host for a Stats with
// unscale and reports whether it may use them (use) and whether every
// element they cover is finite; with sums of another unscale it only
// waits for their kernels. Either way the Stats forgets them after
// (forgetHeldParts); on an error, the engine is broken and they are
// forgotten now.
func (e *Engine) takeHeldParts(unscale float32) (use, finite bool, err error) {
	if !e.hp.on {
		return false, true, nil
	}
	s := e.s[sKernel]
	use = e.hp.unscale == unscale
	if use {
		err = e.dev.D2H(s, e.hp.host, 0, e.hp.dev, 0, 8*int64(len(e.part))+8)
	}
	if err = firstErr(err, e.dev.Record(e.hp.ev, s), e.dev.Sync(e.hp.ev)); err != nil {
		e.broken = true // the kernels may still write
		e.forgetHeldParts()
		return false, false, err
	}
	flag := *(*int32)(unsafe.Pointer(&e.hp.host.Bytes()[8*len(e.part)]))
	return use, !use || flag == 0, nil
}

// heldPart returns the sum HeldPartials took for block b.
func (e *Engine) heldPart(b int64) float64 {
	return *(*float64)(unsafe.Pointer(&e.hp.host.Bytes()[8*b]))
}

// dropHeldParts forgets HeldPartials' sums once their kernels are done
// (an update phase, DropPrefetch, Close).
func (e *Engine) dropHeldParts() error {
	if !e.hp.on {
		return nil
	}
	defer e.forgetHeldParts()
	if e.broken {
		return nil
	}
	if err := firstErr(e.dev.Record(e.hp.ev, e.s[sKernel]), e.dev.Sync(e.hp.ev)); err != nil {
		e.broken = true
		return err
	}
	return nil
}

// forgetHeldParts forgets HeldPartials' sums, whose kernels are known done
// (takeHeldParts waited for them).
func (e *Engine) forgetHeldParts() {
	e.hp.on = false
	clear(e.hp.done)
}

// heldRuns writes the partial sums of the host-held blocks that cover elements
// [lo, hi) of the flat space, in segment sg, into e.part: HeldPartials' where
// it took them, the CPU workers' for each run of the others.
func (e *Engine) heldRuns(sg segment, lo, hi int64, unscale float32) bool {
	const mc = adam.MinChunk
	finite := true
	for b, end := lo/mc, (hi+mc-1)/mc; b < end; {
		if e.hp.done[b] {
			e.part[b] = e.heldPart(b)
			b++
			continue
		}
		r := b + 1
		for r < end && !e.hp.done[r] {
			r++
		}
		a, z := b*mc, min(r*mc, hi)
		finite = e.pool.GradPartials(e.heldGrad(sg.at+a-sg.off, z-a), unscale, e.part[b:r]) && finite
		b = r
	}
	return finite
}
