package adam

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
)

// MinChunk is the smallest number of elements a Pool gives one goroutine:
// below it, the cost of waking a worker exceeds the work.
const MinChunk = 1 << 15

// MaxChunk is the largest number of elements a Pool hands out at once. The
// goroutines take chunks from a shared counter until none is left, so one
// that the OS deschedules (another thread on its core: a lane spinning on
// a CUDA event, the Go runtime) holds up the end of a call by at most one
// chunk rather than by a whole 1/threads of it. On the H200 machine's 16
// cores, 8 MinChunk (about 1 ms of one core's work) ran a 25M-parameter
// subgroup 1.14x faster than one fixed chunk per goroutine, and 1.17x with
// two threads spinning beside it (BENCHMARKS.md, "the CPU lane's lost
// time").
const MaxChunk = 8 * MinChunk

// Chunk boundaries fall on multiples of MinChunk elements. That keeps two
// goroutines off each other's cache lines of p, m and v, and lets
// GradStats add per-MinChunk partial sums in one fixed order, so its result
// does not depend on the thread count or on which goroutine took a chunk.

type taskKind uint8

const (
	taskStep taskKind = iota
	taskStats
	taskStepSave // taskStep, each chunk's state and copy saved first
	taskCopy     // save and saveOut copied into s and out
	taskStepTo   // taskStep with the new state written to save, s left as it is
	taskRound16  // s.Param rounded into out (Round16)
)

// job is one call's work, shared by the goroutines that take its chunks.
type job struct {
	kind    taskKind
	c       Coeffs
	s       State
	g       Grad
	out     Copy16
	unscale float32
	partial []float64    // taskStats: where block b's sum goes (partial[b])
	save    State        // taskStepSave: where s goes before the step; taskCopy: the source; taskStepTo: the new state
	saveOut []uint16     // the same for out.Data
	n       int          // elements in all
	size    int          // elements per chunk, a multiple of MinChunk (or n)
	workers int          // the goroutines the call runs on
	next    atomic.Int64 // the first element of the next chunk to take
}

// take claims the next chunk [lo, hi) (ok false: none is left): size
// elements while more than two per goroutine are left, then smaller ones,
// half of what is left per goroutine, down to MinChunk, so that the
// goroutines finish together: a last chunk of size elements would leave
// the others waiting up to its whole time (guided self-scheduling). Every
// chunk but the last is a multiple of MinChunk, so that GradStats' blocks
// stay whole.
func (t *job) take() (lo, hi int, ok bool) {
	for {
		at := t.next.Load()
		if at >= int64(t.n) {
			return 0, 0, false
		}
		size := int64(t.size)
		if rem, w := int64(t.n)-at, int64(t.workers); t.size < t.n && rem < 2*w*size {
			size = min(size, max(MinChunk, (rem/(2*w)+MinChunk-1)/MinChunk*MinChunk))
		}
		if t.next.CompareAndSwap(at, at+size) {
			return int(at), int(min(at+size, int64(t.n))), true
		}
	}
}

// slot holds one goroutine's reduction result, padded to its own cache
// lines.
type slot struct {
	finite bool
	_      [127]byte
}

// Pool runs Step and GradStats over large subgroups by splitting them into
// contiguous chunks of MinChunk to MaxChunk elements that its goroutines,
// the calling one included, take in turn until none is left. Workers are
// started once, by NewPool; a call allocates nothing.
//
// A Pool's methods serialize with each other (one operation at a time);
// they are safe to call from several goroutines.
type Pool struct {
	mu      sync.Mutex
	threads int
	tasks   chan int // a goroutine's slot: take chunks of job
	wg      sync.WaitGroup
	job     job
	slots   []slot
	partial []float64 // GradStats partial sums, one per MinChunk block
	path    Path
	closed  bool
}

// NewPool starts a pool of threads goroutines in all (threads-1 workers plus
// the caller) that steps on DefaultPath. threads <= 0 means
// runtime.GOMAXPROCS(0).
func NewPool(threads int) *Pool { return NewPoolPath(threads, DefaultPath) }

// NewPoolPath is NewPool stepping on path.
func NewPoolPath(threads int, path Path) *Pool {
	if threads <= 0 {
		threads = runtime.GOMAXPROCS(0)
	}
	p := &Pool{threads: threads, tasks: make(chan int, threads), slots: make([]slot, threads), path: path}
	for i := 1; i < threads; i++ {
		go p.worker()
	}
	return p
}

// Path returns the path the pool steps on.
func (p *Pool) Path() Path { return p.path }

// Threads returns the number of goroutines a call may use.
func (p *Pool) Threads() int { return p.threads }

// Close stops the workers. A call after Close panics.
func (p *Pool) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed {
		p.closed = true
		close(p.tasks)
	}
}

func (p *Pool) worker() {
	for sl := range p.tasks {
		p.run(sl)
		p.wg.Done()
	}
}

// run takes chunks of p.job until none is left, as goroutine slot sl.
// Between two chunks, while chunks are left, it yields its P
// (runtime.Gosched): a pool of as many goroutines as GOMAXPROCS holds
// every P for a whole call otherwise, and a goroutine made runnable
// meanwhile (a trainer enqueueing the next forward beside the update, the
// engine's copy issuers, a timer) waits for the call's end or the
// runtime's 10 ms preemption. On the development VM a goroutine's wake-up
// under a busy pool took 3.9-5.2 ms (median) without the yield and
// 0.06-0.16 ms with it (BenchmarkPoolWakeup); a chunk is at most MaxChunk
// elements, about a millisecond of a worker's time. The cost: a goroutine
// that computes without blocking (a lazy checkpoint's copiers) now shares
// the Ps with the pool at that grain, where it used to wait for the call's
// end, and a worker that yielded to one may come back up to the runtime's
// 10 ms preemption later.
func (p *Pool) run(sl int) {
	t := &p.job
	ok := true
	for first := true; ; first = false {
		if !first && t.next.Load() < int64(t.n) {
			runtime.Gosched()
		}
		lo, hi, more := t.take()
		if !more {
			break
		}
		switch t.kind {
		case taskStep:
			p.path.Step(&t.c, t.s.Slice(lo, hi), t.g.Slice(lo, hi), t.out.Slice(lo, hi))
		case taskStepSave:
			// Saved and stepped saveBlock elements at a time, so that the
			// step reads the state the save's loads just brought into
			// the cache; the save's stores are non-temporal (they write
			// memory without reading it first): 40 bytes of memory
			// traffic a parameter, not 52, for a bf16 gradient and copy.
			if !saveNonTemporal {
				copyState(t.save.Slice(lo, hi), t.s.Slice(lo, hi), t.saveOut, t.out.Data, lo, hi)
				p.path.Step(&t.c, t.s.Slice(lo, hi), t.g.Slice(lo, hi), t.out.Slice(lo, hi))
				break
			}
			for b := lo; b < hi; b += saveBlock {
				e := min(b+saveBlock, hi)
				p.path.saveState(t.save.Slice(b, e), t.s.Slice(b, e), t.saveOut, t.out.Data, b, e)
				p.path.Step(&t.c, t.s.Slice(b, e), t.g.Slice(b, e), t.out.Slice(b, e))
			}
		case taskCopy:
			copyState(t.s.Slice(lo, hi), t.save.Slice(lo, hi), t.out.Data, t.saveOut, lo, hi)
		case taskStepTo:
			p.path.StepTo(&t.c, t.s.Slice(lo, hi), t.g.Slice(lo, hi), t.out.Slice(lo, hi), t.save.Slice(lo, hi))
		case taskRound16:
			p.path.Round16(t.out.DType, t.out.Data[lo:hi], t.s.Param[lo:hi])
		case taskStats:
			for b := lo; b < hi; b += MinChunk {
				var f bool
				f, t.partial[b/MinChunk] = p.path.blockStats(t.g.Slice(b, min(b+MinChunk, hi)), t.unscale)
				ok = ok && f
			}
		}
	}
	p.slots[sl].finite = ok
}

// split returns the goroutines a call over n elements uses and the chunk
// size: about four chunks per goroutine, MinChunk to MaxChunk elements each
// (a multiple of MinChunk), or one chunk of n when n is below 2 MinChunk.
func (p *Pool) split(n int) (goroutines, size int) {
	if n < 2*MinChunk || p.threads == 1 {
		return 1, max(n, 1)
	}
	size = (n + 4*p.threads - 1) / (4 * p.threads)
	size = min(MaxChunk, max(MinChunk, (size+MinChunk-1)/MinChunk*MinChunk))
	return min(p.threads, (n+size-1)/size), size
}

// dispatch runs p.job (its kind and operands set) over its n elements on
// the goroutines split chooses, the caller among them, and returns how many
// ran. Panics if the pool is closed.
func (p *Pool) dispatch(n int) int {
	if p.closed {
		panic("adam: Pool used after Close")
	}
	goroutines, size := p.split(n)
	p.job.n, p.job.size, p.job.workers = n, size, goroutines
	p.job.next.Store(0)
	p.wg.Add(goroutines - 1)
	for sl := 1; sl < goroutines; sl++ {
		p.tasks <- sl
	}
	p.run(0)
	p.wg.Wait()
	return goroutines
}

// Step is the parallel form of the package-level Step, with the same
// arguments, semantics and panics; results are bitwise identical to it.
func (p *Pool) Step(c *Coeffs, s State, g Grad, out Copy16) {
	checkLens(c, s, g, out)
	if !c.AMSGrad {
		s.MaxExpAvgSq = nil // unused, as by Path.Step, whatever its length
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	t := &p.job
	t.kind, t.c, t.s, t.g, t.out = taskStep, *c, s, g, out
	p.dispatch(len(s.Param))
	t.s, t.g, t.out = State{}, Grad{}, Copy16{} // keep no caller's memory alive
}

// StepSave is Step that first copies what the step overwrites: the state s
// into save and the working copy out.Data into saveOut (when saveOut is
// not empty: a working copy that is not saved is written all the same),
// each block of saveBlock elements just before its step (the fp32 state
// with non-temporal stores), so that Restore can undo the
// step exactly (the speculative update of scheduler.Engine.Speculate;
// DeepSpeed's SuperOffload calls it speculation-then-validation). save
// has s's arrays and lengths (MaxExpAvgSq only with c.AMSGrad), saveOut
// out's length or none. The step's results are Step's bit for bit. It allocates
// nothing. Panics as Step does, and on save or saveOut of other lengths.
func (p *Pool) StepSave(c *Coeffs, s State, g Grad, out Copy16, save State, saveOut []uint16) {
	checkLens(c, s, g, out)
	if !c.AMSGrad {
		s.MaxExpAvgSq, save.MaxExpAvgSq = nil, nil
	}
	checkSave(s, out.Data, save, saveOut)
	p.mu.Lock()
	defer p.mu.Unlock()
	t := &p.job
	t.kind, t.c, t.s, t.g, t.out, t.save, t.saveOut = taskStepSave, *c, s, g, out, save, saveOut
	p.dispatch(len(s.Param))
	t.s, t.g, t.out, t.save, t.saveOut = State{}, Grad{}, Copy16{}, State{}, nil // keep no caller's memory alive
}

// StepTo is the parallel form of Path.StepTo on the pool's path, with the
// same arguments, semantics and panics: Step that leaves s as it is and
// writes the new state into to (28 bytes of memory traffic a parameter,
// against StepSave's 40), results bitwise Step's (a NaN's sign and payload
// aside, as Path.StepTo says). It allocates nothing.
func (p *Pool) StepTo(c *Coeffs, s State, g Grad, out Copy16, to State) {
	checkLens(c, s, g, out)
	if !c.AMSGrad {
		s.MaxExpAvgSq, to.MaxExpAvgSq = nil, nil
	}
	checkSave(s, nil, to, nil)
	p.mu.Lock()
	defer p.mu.Unlock()
	t := &p.job
	t.kind, t.c, t.s, t.g, t.out, t.save = taskStepTo, *c, s, g, out, to
	p.dispatch(len(s.Param))
	t.s, t.g, t.out, t.save = State{}, Grad{}, Copy16{}, State{} // keep no caller's memory alive
}

// Restore copies save back into s and saveOut into out, in parallel: it
// undoes a StepSave that saved into them. out and saveOut have the same
// length (saveOut empty: the working copy is left as it is); s's MaxExpAvgSq, when nil
// (without amsgrad), is skipped, else save's must match it. It allocates
// nothing. Panics on lengths that differ.
func (p *Pool) Restore(s State, out []uint16, save State, saveOut []uint16) {
	checkSave(s, out, save, saveOut)
	p.mu.Lock()
	defer p.mu.Unlock()
	t := &p.job
	t.kind, t.s, t.out, t.save, t.saveOut = taskCopy, s, Copy16{Data: out}, save, saveOut
	p.dispatch(len(s.Param))
	t.s, t.out, t.save, t.saveOut = State{}, Copy16{}, State{}, nil
}

// Round16 is the parallel form of Path.Round16 (dst = src rounded to the
// 16-bit dtype d, BF16 or F16, round to nearest even), bitwise identical
// to it: an undone speculative update's working copy, rounded again from
// the master weights. It allocates nothing. Panics on lengths that differ
// or another dtype (as Path.Round16).
func (p *Pool) Round16(d DType, dst []uint16, src []float32) {
	if len(dst) != len(src) {
		panic(fmt.Sprintf("adam: Round16 of %d elements into %d", len(src), len(dst)))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	t := &p.job
	t.kind, t.s, t.out = taskRound16, State{Param: src}, Copy16{DType: d, Data: dst}
	p.dispatch(len(src))
	t.s, t.out = State{}, Copy16{}
}

// checkSave panics unless save has s's lengths (MaxExpAvgSq where s has
// one) and saveOut out's.
func checkSave(s State, out []uint16, save State, saveOut []uint16) {
	n := len(s.Param)
	if len(s.ExpAvg) != n || len(s.ExpAvgSq) != n || len(save.Param) != n || len(save.ExpAvg) != n || len(save.ExpAvgSq) != n ||
		(s.MaxExpAvgSq != nil && (len(s.MaxExpAvgSq) != n || len(save.MaxExpAvgSq) != n)) || (len(saveOut) != 0 && len(out) != len(saveOut)) {
		panic(fmt.Sprintf("adam: a saved state of %d/%d elements (working copy %d) for a state of %d (working copy %d)",
			len(save.Param), len(save.MaxExpAvgSq), len(saveOut), n, len(out)))
	}
}

// saveBlock is how many elements StepSave saves, then steps, at a time:
// 48 KiB of fp32 p, exp_avg and exp_avg_sq, which the step then reads
// from the core's L1 or L2 cache.
const saveBlock = 4096

// saveNonTemporal is false only in BenchmarkStepSave's reference runs:
// StepSave then copies each chunk with the built-in copy and steps it
// after (the save of before 2026-12-07), to measure both in one run.
var saveNonTemporal = true

// saveState is copyState with the fp32 arrays copied by the path's
// non-temporal kernel (copyNT).
func (path Path) saveState(to, from State, toOut, fromOut []uint16, lo, hi int) {
	path.copyNT(to.Param, from.Param)
	path.copyNT(to.ExpAvg, from.ExpAvg)
	path.copyNT(to.ExpAvgSq, from.ExpAvgSq)
	if to.MaxExpAvgSq != nil {
		path.copyNT(to.MaxExpAvgSq, from.MaxExpAvgSq)
	}
	if len(toOut) > 0 && len(fromOut) > 0 {
		copy(toOut[lo:hi], fromOut[lo:hi])
	}
}

// copyNT copies src into dst (of src's length): on a SIMD path the
// elements from dst's first vector-aligned one on, a multiple of four
// vectors, by the non-temporal kernel, the rest by the built-in copy.
// The generic path, and fewer than 64 elements, use the built-in copy.
func (path Path) copyNT(dst, src []float32) {
	n := len(src)
	if len(dst) != n {
		panic(fmt.Sprintf("adam: copyNT of %d elements into %d", n, len(dst)))
	}
	if path.lanes < 8 || n < 64 {
		copy(dst, src)
		return
	}
	a := alignHead(dst, uintptr(4*path.lanes)) // elements up to the next vector-aligned address of dst
	body := (n - a) &^ (4*path.lanes - 1)
	copy(dst[:a], src[:a])
	if body > 0 {
		raceRead32(src[a : a+body])
		raceWrite32(dst[a : a+body])
		simdCopyNT(path.lanes, &dst[a], &src[a], body)
	}
	copy(dst[a+body:], src[a+body:])
}

// copyState copies elements [lo, hi) of the working copy from to to
// (both full length; skipped when either is empty) and the chunk of state
// from into to (both already cut to the chunk; MaxExpAvgSq where to has
// one).
func copyState(to, from State, toOut, fromOut []uint16, lo, hi int) {
	copy(to.Param, from.Param)
	copy(to.ExpAvg, from.ExpAvg)
	copy(to.ExpAvgSq, from.ExpAvgSq)
	if to.MaxExpAvgSq != nil {
		copy(to.MaxExpAvgSq, from.MaxExpAvgSq)
	}
	if len(toOut) > 0 && len(fromOut) > 0 {
		copy(toOut[lo:hi], fromOut[lo:hi])
	}
}

// GradStats is the parallel form of Path.GradStats on the pool's path, with
// the same result bit for bit whatever the thread count: one pass over g
// for the non-finite check and the sum of squares. It allocates only when g
// is longer than any gradient it has seen.
func (p *Pool) GradStats(g Grad, unscale float32) (finite bool, sumSquares float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	blocks := (g.Len() + MinChunk - 1) / MinChunk
	if cap(p.partial) < blocks {
		p.partial = make([]float64, blocks)
	}
	p.partial = p.partial[:blocks]
	finite = p.partials(g, unscale, p.partial)
	for _, x := range p.partial {
		sumSquares += x
	}
	return finite, sumSquares
}

// GradPartials is GradStats without the last sum: it writes the sum of
// squares of each MinChunk block of g (block b: elements [b*MinChunk,
// (b+1)*MinChunk), the last one shorter) to dst[b], and reports whether
// every element is finite. Adding dst in block order from 0 gives
// GradStats's sum bit for bit; so does adding, in order, the partials of
// several gradients that lie end to end on MinChunk boundaries, wherever
// each one's memory is (Path.GradPartials, and the device's kernel in
// internal/kernels, compute the same bits). It allocates nothing.
//
// It panics when dst is shorter than g's blocks.
func (p *Pool) GradPartials(g Grad, unscale float32, dst []float64) (finite bool) {
	blocks := (g.Len() + MinChunk - 1) / MinChunk
	if len(dst) < blocks {
		panic(fmt.Sprintf("adam: GradPartials: %d partials for %d blocks", len(dst), blocks))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.partials(g, unscale, dst)
}

// partials runs the pool over g's blocks, block b's sum into dst[b];
// p.mu is held.
func (p *Pool) partials(g Grad, unscale float32, dst []float64) (finite bool) {
	t := &p.job
	t.kind, t.g, t.unscale, t.partial = taskStats, g, unscale, dst
	chunks := p.dispatch(g.Len())
	t.g, t.partial = Grad{}, nil // keep no caller's memory alive
	finite = true
	for i := 0; i < chunks; i++ {
		finite = finite && p.slots[i].finite
	}
	return finite
}

// AllFinite is GradStats's non-finite check.
func (p *Pool) AllFinite(g Grad) bool {
	ok, _ := p.GradStats(g, 1)
	return ok
}

// SumSquares is GradStats's sum of squares.
func (p *Pool) SumSquares(g Grad, unscale float32) float64 {
	_, s := p.GradStats(g, unscale)
	return s
}
