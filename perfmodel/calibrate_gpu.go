package perfmodel

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
)

// GPUOptions sets what CalibrateGPU measures.
type GPUOptions struct {
	// CopySizes are the transfer sizes in bytes (default 8, 64, 256 MiB
	// and 1 GiB).
	CopySizes []int64
	// UpdateSizes are the subgroup sizes in parameters for the fused
	// kernel and the cast (default 16M, 64M, 128M: well above the L2
	// cache, as a real subgroup is).
	UpdateSizes []int64
	// Reps is the number of timed runs per point after one warm-up; the
	// median is kept (default 5).
	Reps int
	// Threads is the CPU workers that update while the copies run, for
	// the contention (default GOMAXPROCS).
	Threads int
	// HostMemSeconds is how long that measurement copies (default 0.5).
	HostMemSeconds float64
}

func (o *GPUOptions) defaults() {
	if len(o.CopySizes) == 0 {
		o.CopySizes = []int64{8 << 20, 64 << 20, 256 << 20, 1 << 30}
	}
	if len(o.UpdateSizes) == 0 {
		o.UpdateSizes = []int64{16 << 20, 64 << 20, 128 << 20}
	}
	if o.Reps <= 0 {
		o.Reps = 5
	}
	if o.Threads <= 0 {
		o.Threads = runtime.GOMAXPROCS(0)
	}
	if o.HostMemSeconds <= 0 {
		o.HostMemSeconds = 0.5
	}
}

// CalibrateGPU measures the GPU's rates on d with k's kernels, timed by
// CUDA events: pinned H2D and D2H alone and both at once on two streams
// (bytes/s), the fused AdamW as the optimizer launches it most often, bf16
// gradient and bf16 copy over fp32 state (params/s, Ug), and the
// bf16-to-fp32 cast (elements/s, Dc); each fitted as time = latency +
// size/rate over its sizes. Each timing covers enough back-to-back repeats
// (at least 64 MiB or 64M parameters) that the host's launch time is
// amortized, after a warm-up that brings clocks and the PCIe link up.
// progress, when not nil, is called after every point.
//
// Errors: bad sizes (before anything runs), allocation, copy or launch
// failures (the device is synchronized and what was allocated freed), a
// fit that fails.
func CalibrateGPU(d *cuda.Device, k *kernels.Kernels, opts GPUOptions, progress func(done, total int)) (*GPUProfile, error) {
	if d == nil || k == nil {
		return nil, errors.New("perfmodel: CalibrateGPU needs a device and its kernels")
	}
	opts.defaults()
	for _, sizes := range [][]int64{opts.CopySizes, opts.UpdateSizes} {
		if len(slices.Compact(slices.Sorted(slices.Values(sizes)))) < 2 || slices.Min(sizes) <= 0 {
			return nil, fmt.Errorf("perfmodel: GPU calibration sizes %v: want at least two distinct sizes > 0", sizes)
		}
	}
	maxCopy := slices.Max(opts.CopySizes)
	maxN := slices.Max(opts.UpdateSizes)
	var frees []func() error
	defer func() {
		_ = d.Sync() // nothing may still use what is freed
		for i := len(frees) - 1; i >= 0; i-- {
			_ = frees[i]()
		}
	}()
	host := func(n int64) (*cuda.HostBuffer, error) {
		h, err := d.HostAlloc(n)
		if err == nil {
			frees = append(frees, h.Free)
		}
		return h, err
	}
	dev := func(n int64) (*cuda.Buffer, error) {
		b, err := d.Alloc(n)
		if err == nil {
			frees = append(frees, b.Free)
		}
		return b, err
	}
	s1, err := d.NewStream()
	if err != nil {
		return nil, err
	}
	frees = append(frees, s1.Free)
	s2, err := d.NewStream()
	if err != nil {
		return nil, err
	}
	frees = append(frees, s2.Free)
	var ev [4]*cuda.Event
	for i := range ev {
		if ev[i], err = d.NewEvent(true); err != nil {
			return nil, err
		}
		frees = append(frees, ev[i].Free)
	}
	h1, err := host(maxCopy)
	if err != nil {
		return nil, err
	}
	h2, err := host(maxCopy)
	if err != nil {
		return nil, err
	}
	d1, err := dev(maxCopy)
	if err != nil {
		return nil, err
	}
	d2, err := dev(maxCopy)
	if err != nil {
		return nil, err
	}
	total := 3*len(opts.CopySizes) + 2*len(opts.UpdateSizes) + 1
	done := 0
	tick := func() {
		done++
		if progress != nil {
			progress(done, total)
		}
	}
	// timed enqueues work between two events on s and returns the GPU time.
	timed := func(s *cuda.Stream, a, b *cuda.Event, work func() error) (time.Duration, error) {
		if err := a.Record(s); err != nil {
			return 0, err
		}
		if err := work(); err != nil {
			return 0, err
		}
		if err := b.Record(s); err != nil {
			return 0, err
		}
		if err := b.Sync(); err != nil {
			return 0, err
		}
		return cuda.Elapsed(a, b)
	}
	median := func(run func() (float64, error)) (float64, error) {
		if _, err := run(); err != nil { // warm-up
			return 0, err
		}
		ts := make([]float64, opts.Reps)
		for i := range ts {
			t, err := run()
			if err != nil {
				return 0, err
			}
			ts[i] = t
		}
		slices.Sort(ts)
		return ts[len(ts)/2], nil
	}
	// repeat returns how many back-to-back runs make one timing of size n:
	// at least min units in all.
	repeat := func(n, min int64) int { return int(max(1, (min+n-1)/n)) }
	rep := func(times int, op func() error) func() error {
		return func() error {
			for range times {
				if err := op(); err != nil {
					return err
				}
			}
			return nil
		}
	}
	// Warm-up: clocks and the PCIe link come up from idle.
	for t0 := time.Now(); time.Since(t0) < 200*time.Millisecond; {
		if err := firstErr(s1.CopyHtoD(d1, 0, h1, 0, maxCopy), s2.CopyDtoH(h2, 0, d2, 0, maxCopy), s1.Sync(), s2.Sync()); err != nil {
			return nil, fmt.Errorf("perfmodel: GPU warm-up: %w", err)
		}
	}
	var h2d, d2h, h2dBoth, d2hBoth []Point
	for _, n := range opts.CopySizes {
		reps := repeat(n, 64<<20)
		t, err := median(func() (float64, error) {
			el, err := timed(s1, ev[0], ev[1], rep(reps, func() error { return s1.CopyHtoD(d1, 0, h1, 0, n) }))
			return el.Seconds() / float64(reps), err
		})
		if err != nil {
			return nil, fmt.Errorf("perfmodel: H2D of %d bytes: %w", n, err)
		}
		h2d = append(h2d, Point{float64(n), t})
		tick()
		t, err = median(func() (float64, error) {
			el, err := timed(s1, ev[0], ev[1], rep(reps, func() error { return s1.CopyDtoH(h2, 0, d2, 0, n) }))
			return el.Seconds() / float64(reps), err
		})
		if err != nil {
			return nil, fmt.Errorf("perfmodel: D2H of %d bytes: %w", n, err)
		}
		d2h = append(d2h, Point{float64(n), t})
		tick()
		// Both at once: each direction timed by its own stream's events
		// while the other stream carries twice as much the other way, so
		// the timed copies overlap from start to end.
		var up, down []float64
		for r := 0; r <= opts.Reps; r++ {
			twice := 2 * reps
			if err := firstErr(rep(twice, func() error { return s2.CopyDtoH(h2, 0, d2, 0, n) })(), ev[0].Record(s1),
				rep(reps, func() error { return s1.CopyHtoD(d1, 0, h1, 0, n) })(), ev[1].Record(s1), ev[1].Sync(), s2.Sync(),
				rep(twice, func() error { return s1.CopyHtoD(d1, 0, h1, 0, n) })(), ev[2].Record(s2),
				rep(reps, func() error { return s2.CopyDtoH(h2, 0, d2, 0, n) })(), ev[3].Record(s2), ev[3].Sync(), s1.Sync()); err != nil {
				return nil, fmt.Errorf("perfmodel: H2D and D2H of %d bytes at once: %w", n, err)
			}
			a, err1 := cuda.Elapsed(ev[0], ev[1])
			b, err2 := cuda.Elapsed(ev[2], ev[3])
			if err := firstErr(err1, err2); err != nil {
				return nil, fmt.Errorf("perfmodel: H2D and D2H of %d bytes at once: %w", n, err)
			}
			if r > 0 { // the first was the warm-up
				up, down = append(up, a.Seconds()/float64(reps)), append(down, b.Seconds()/float64(reps))
			}
		}
		slices.Sort(up)
		slices.Sort(down)
		h2dBoth = append(h2dBoth, Point{float64(n), up[len(up)/2]})
		d2hBoth = append(d2hBoth, Point{float64(n), down[len(down)/2]})
		tick()
	}
	// The fused kernel: fp32 p, m, v, a bf16 gradient and a bf16 copy of
	// maxN parameters.
	var bufs [5]*cuda.Buffer
	for i := range bufs {
		if bufs[i], err = dev(4 * maxN); err != nil {
			return nil, err
		}
		if err := s1.Memset(bufs[i], 0, 4*maxN, 0x3c); err != nil { // 0x3c3c3c3c: 0.0115, a normal value
			return nil, err
		}
	}
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	var upd, conv []Point
	for _, n := range opts.UpdateSizes {
		st := kernels.State{Param: kernels.Vec{Buf: bufs[0], N: n}, ExpAvg: kernels.Vec{Buf: bufs[1], N: n}, ExpAvgSq: kernels.Vec{Buf: bufs[2], N: n}}
		g := kernels.Grad{DType: adam.BF16, Vec: kernels.Vec{Buf: bufs[3], N: n}}
		out := kernels.Copy16{DType: adam.BF16, Vec: kernels.Vec{Buf: bufs[4], N: n}}
		reps := repeat(n, 64<<20)
		t, err := median(func() (float64, error) {
			el, err := timed(s1, ev[0], ev[1], rep(reps, func() error { return k.AdamW(s1, &c, st, g, out) }))
			return el.Seconds() / float64(reps), err
		})
		if err != nil {
			return nil, fmt.Errorf("perfmodel: AdamW of %d parameters: %w", n, err)
		}
		upd = append(upd, Point{float64(n), t})
		tick()
		t, err = median(func() (float64, error) {
			el, err := timed(s1, ev[0], ev[1], rep(reps, func() error {
				return k.Widen16(s1, adam.BF16, kernels.Vec{Buf: bufs[0], N: n}, kernels.Vec{Buf: bufs[3], N: n})
			}))
			return el.Seconds() / float64(reps), err
		})
		if err != nil {
			return nil, fmt.Errorf("perfmodel: cast of %d elements: %w", n, err)
		}
		conv = append(conv, Point{float64(n), t})
		tick()
	}
	g := &GPUProfile{}
	last := func(p []Point) float64 { return p[len(p)-1].Size / p[len(p)-1].Seconds }
	duplex := (last(h2dBoth) + last(d2hBoth)) / 2
	if g.Contention, g.HostMem, err = contention(opts, s1, s2, ev[0], ev[1], ev[2], ev[3], h1, h2, d1, d2, maxCopy, duplex); err != nil {
		return nil, err
	}
	tick()
	for _, f := range []struct {
		dst  *Fit
		pts  []Point
		what string
	}{{&g.H2D, h2d, "H2D"}, {&g.D2H, d2h, "D2H"}, {&g.H2DBoth, h2dBoth, "H2D while D2H runs"}, {&g.D2HBoth, d2hBoth, "D2H while H2D runs"},
		{&g.Update, upd, "AdamW"}, {&g.Convert, conv, "bf16 cast"}} {
		fit, err := FitPoints(f.pts)
		if err != nil {
			return nil, fmt.Errorf("perfmodel: %s: %w", f.what, err)
		}
		*f.dst = fit
	}
	return g, nil
}

// contention measures how much the CPU workers and the copies slow each
// other down (Contention): the workers update a 32M-parameter subgroup as
// the engine does (Step with a bf16 gradient and copy, on the staged
// path) alone for about a fifth of opts.HostMemSeconds, then again and
// again while both directions copy maxCopy-byte pieces for about
// opts.HostMemSeconds. The copies are timed by events on s1 (H2D, e1 at
// the end, a at the start) and s2 (D2H, e2, b), against duplex, the
// per-direction rate with no CPU work. It also returns the host memory's
// peak rate (GPUProfile.HostMem), bytes/s: the most of the update alone
// (28 bytes a parameter: the state read and written, the bf16 gradient
// read, the bf16 copy written), the update and both copies together, and
// opts.Threads goroutines copying 128 MiB arrays (each byte read and
// written).
func contention(opts GPUOptions, s1, s2 *cuda.Stream, a, e1, b, e2 *cuda.Event, h1, h2 *cuda.HostBuffer, d1, d2 *cuda.Buffer, maxCopy int64, duplex float64) (Contention, float64, error) {
	const n = 32 << 20
	var mem hostArrays // as the engine's host state (cuda.MapHost)
	defer mem.free()
	s := adam.State{Param: mem.f32(n), ExpAvg: mem.f32(n), ExpAvgSq: mem.f32(n)}
	g := mem.u16(n)
	out := adam.Copy16{DType: adam.BF16, Data: mem.u16(n)}
	if mem.err != nil {
		return Contention{}, 0, fmt.Errorf("perfmodel: contention: %w", mem.err)
	}
	for i := range g {
		s.Param[i] = float32(i%1000) * 1e-3
		g[i] = adam.F32ToBF16(float32(i%777) * 1e-5)
	}
	pool := adam.NewPool(opts.Threads)
	defer pool.Close()
	c := adam.DefaultHyper().Coeffs(1, 1, 0.9)
	step := func() { pool.Step(&c, s, adam.Grad16(adam.BF16, g), out) }
	step() // faults the pages in
	t0, steps := time.Now(), 0
	for time.Since(t0).Seconds() < opts.HostMemSeconds/5 || steps < 3 {
		step()
		steps++
	}
	alone := time.Since(t0).Seconds() / float64(steps)
	// Enough pieces for HostMemSeconds at the duplex rate.
	reps := int(max(2, opts.HostMemSeconds*duplex/float64(maxCopy)))
	if err := firstErr(a.Record(s1), b.Record(s2)); err != nil {
		return Contention{}, 0, err
	}
	for range reps {
		if err := firstErr(s1.CopyHtoD(d1, 0, h1, 0, maxCopy), s2.CopyDtoH(h2, 0, d2, 0, maxCopy)); err != nil {
			return Contention{}, 0, fmt.Errorf("perfmodel: contention: %w", err)
		}
	}
	if err := firstErr(e1.Record(s1), e2.Record(s2)); err != nil {
		return Contention{}, 0, err
	}
	// The steps that end while both directions still copy.
	t0, steps = time.Now(), 0
	var busy float64
	for {
		step()
		d1done, err1 := e1.Done()
		d2done, err2 := e2.Done()
		if err := firstErr(err1, err2); err != nil {
			return Contention{}, 0, err
		}
		if d1done || d2done {
			break
		}
		steps++
		busy = time.Since(t0).Seconds()
	}
	if err := firstErr(e1.Sync(), e2.Sync()); err != nil {
		return Contention{}, 0, err
	}
	up, err1 := cuda.Elapsed(a, e1)
	down, err2 := cuda.Elapsed(b, e2)
	if err := firstErr(err1, err2); err != nil {
		return Contention{}, 0, err
	}
	if steps < 3 {
		return Contention{}, 0, fmt.Errorf("perfmodel: contention: only %d CPU updates ran while the copies did; raise HostMemSeconds", steps)
	}
	loaded := float64(reps) * float64(maxCopy) / max(up.Seconds(), down.Seconds())
	const perParam = 28 // bytes of host memory an update of a parameter moves
	hostMem := max(perParam*n/alone, perParam*n*float64(steps)/busy+float64(reps)*float64(maxCopy)*(1/up.Seconds()+1/down.Seconds()),
		copyRate(opts.Threads, s.Param, s.ExpAvgSq))
	return Contention{CPU: max(1, busy/float64(steps)/alone), PCIe: max(1, duplex/loaded)}, hostMem, nil
}

// copyRate returns the host memory's rate, bytes read and written a
// second, of threads goroutines copying src into dst (equal lengths), each
// its own part, three times after one warm-up, the fastest kept.
func copyRate(threads int, src, dst []float32) float64 {
	best := 0.0
	for rep := range 4 {
		t0 := time.Now()
		var wg sync.WaitGroup
		for w := range threads {
			lo, hi := len(src)*w/threads, len(src)*(w+1)/threads
			wg.Go(func() { copy(dst[lo:hi], src[lo:hi]) })
		}
		wg.Wait()
		if el := time.Since(t0).Seconds(); rep > 0 && el > 0 {
			best = max(best, 8*float64(len(src))/el)
		}
	}
	return best
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}
