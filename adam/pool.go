package adam

import (
	"runtime"
	"sync"
)

// MinChunk is the smallest number of elements a Pool gives one goroutine:
// below it, the cost of waking a worker exceeds the work.
const MinChunk = 1 << 15

// Chunk boundaries fall on multiples of MinChunk elements. That keeps two
// goroutines off each other's cache lines of p, m and v, and lets
// GradStats add per-MinChunk partial sums in one fixed order, so its result
// does not depend on the thread count.

type taskKind uint8

const (
	taskStep taskKind = iota
	taskStats
)

type task struct {
	kind    taskKind
	c       Coeffs
	s       State
	g       Grad
	out     Copy16
	unscale float32
	slot    int
	lo      int // first element of this chunk in the whole buffer
}

// slot holds one worker's reduction result, padded to its own cache lines.
type slot struct {
	finite bool
	_      [127]byte
}

// Pool runs Step and GradStats over large subgroups by splitting
// them into contiguous chunks of at least MinChunk elements, one per
// goroutine, the calling goroutine included. Workers are started once, by
// NewPool; a call allocates nothing.
//
// A Pool's methods serialize with each other (one operation at a time);
// they are safe to call from several goroutines.
type Pool struct {
	mu      sync.Mutex
	threads int
	tasks   chan task
	wg      sync.WaitGroup
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
	p := &Pool{threads: threads, tasks: make(chan task, threads), slots: make([]slot, threads), path: path}
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
	for t := range p.tasks {
		p.run(&t)
		p.wg.Done()
	}
}

func (p *Pool) run(t *task) {
	switch t.kind {
	case taskStep:
		p.path.Step(&t.c, t.s, t.g, t.out)
	case taskStats:
		ok := true
		for i, lo := t.lo/MinChunk, 0; lo < t.g.Len(); i, lo = i+1, lo+MinChunk {
			var f bool
			f, p.partial[i] = p.path.blockStats(t.g.Slice(lo, min(lo+MinChunk, t.g.Len())), t.unscale)
			ok = ok && f
		}
		p.slots[t.slot].finite = ok
	}
}

// split returns the number of chunks for n elements and the chunk size.
func (p *Pool) split(n int) (chunks, size int) {
	chunks = min(p.threads, (n+MinChunk-1)/MinChunk)
	if chunks <= 1 {
		return 1, n
	}
	size = (n + chunks - 1) / chunks
	size = (size + MinChunk - 1) / MinChunk * MinChunk
	chunks = (n + size - 1) / size
	return chunks, size
}

// dispatch runs t over [0, n) in chunks; t.s, t.g and t.out are sliced.
// Panics if the pool is closed.
func (p *Pool) dispatch(t task, n int) int {
	if p.closed {
		panic("adam: Pool used after Close")
	}
	chunks, size := p.split(n)
	if chunks > 1 {
		for i := 1; i < chunks; i++ {
			lo, hi := i*size, min((i+1)*size, n)
			c := t
			c.slot = i
			c.lo = lo
			if t.kind == taskStep {
				c.s = t.s.Slice(lo, hi)
				c.out = t.out.Slice(lo, hi)
			}
			c.g = t.g.Slice(lo, hi)
			p.wg.Add(1) // after the slicing: nothing left to panic between Add and the send
			p.tasks <- c
		}
	}
	first := t
	first.slot = 0
	hi := min(size, n)
	if t.kind == taskStep {
		first.s = t.s.Slice(0, hi)
		first.out = t.out.Slice(0, hi)
	}
	first.g = t.g.Slice(0, hi)
	p.run(&first)
	if chunks > 1 {
		p.wg.Wait()
	}
	return chunks
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
	p.dispatch(task{kind: taskStep, c: *c, s: s, g: g, out: out}, len(s.Param))
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
	chunks := p.dispatch(task{kind: taskStats, g: g, unscale: unscale}, g.Len())
	finite = true
	for i := 0; i < chunks; i++ {
		finite = finite && p.slots[i].finite
	}
	for _, x := range p.partial {
		sumSquares += x
	}
	return finite, sumSquares
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
