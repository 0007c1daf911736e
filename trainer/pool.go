package trainer

import (
	"runtime"
	"sync"
	"sync/atomic"
)

// pool runs fn(i, w) for i in [0, n) on the calling goroutine (w = 0) and
// up to GOMAXPROCS-1 workers (w = 1, 2, ...), each index exactly once; w
// lets a task use per-goroutine scratch. Which goroutine runs an index varies
// from call to call, so every task writes its own outputs in a fixed order,
// and reads scratch only after writing it: results then do not depend on the
// thread count.
//
// Workers are started on first need and reused; a call allocates nothing
// once they exist. A pool holds no reference to its Model between calls
// (fn is cleared), so the Model's cleanup can stop the workers.
type pool struct {
	wake    chan int
	wg      sync.WaitGroup
	next    atomic.Int64
	n       int64
	fn      func(i, w int)
	workers int
}

func newPool() *pool { return &pool{wake: make(chan int, 64)} }

// threads returns how many goroutines run would use for n tasks.
func (p *pool) threads(n int) int { return max(1, min(runtime.GOMAXPROCS(0), n)) }

// run calls fn(i, w) for every i in [0, n) on p.threads(n) goroutines and
// returns when all have returned. fn must be a func value built once (a
// stored method value), so that passing it allocates nothing.
func (p *pool) run(n int, fn func(i, w int)) { p.runOn(n, p.threads(n), fn) }

// runOn is run on the given number of goroutines (w < threads).
func (p *pool) runOn(n, threads int, fn func(i, w int)) {
	if threads <= 1 {
		for i := 0; i < n; i++ {
			fn(i, 0)
		}
		return
	}
	for p.workers < threads-1 {
		go p.worker()
		p.workers++
	}
	p.fn, p.n = fn, int64(n)
	p.next.Store(0)
	p.wg.Add(threads - 1)
	for w := 1; w < threads; w++ {
		p.wake <- w
	}
	p.loop(0)
	p.wg.Wait()
	p.fn = nil
}

func (p *pool) loop(w int) {
	for {
		i := p.next.Add(1) - 1
		if i >= p.n {
			return
		}
		p.fn(int(i), w)
	}
}

func (p *pool) worker() {
	for w := range p.wake {
		p.loop(w)
		p.wg.Done()
	}
}

// stop ends the workers; the pool must not be used afterwards.
func (p *pool) stop() { close(p.wake) }
