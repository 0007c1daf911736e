package perfmodel

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
)

// BenchmarkHostUpdate measures the CPU workers' out-of-place update
// (adam.Pool.StepTo, the speculation's: bf16 gradient and working copy,
// the new state into another pinned array, the two alternating as the
// speculation's home and slots do) over 96M parameters in pinned memory
// mapped as the engine's host state is (cuda.Device.HostRegister),
// one dispatch a subgroup of 6.25M, 25M or 50M parameters, and reports
// Gparam/s:
//
//   - alone: nothing else runs;
//   - waiter: beside a thread that waits for the device in Stream.Sync on
//     device-to-device copies (no host memory), as the trainer's Loss
//     waits for its backward while the speculation runs; under
//     DOS_CUDA_WAIT=spin (the driver's default) that thread holds a core;
//   - waiter-t1: the same with a worker fewer (a core left to the waiter);
//   - dma: beside both PCIe directions copying 128 MiB pieces, waited for
//     by polling (the host memory the streamed lane and the blocks'
//     copies share with the CPU).
//
// Run it on the GPU machine under each DOS_CUDA_WAIT (bench/issue31.sh
// PART=wait does): what waiter loses to alone under spin and not under
// sleep is what the trainer's spinning wait costs the speculation.
func BenchmarkHostUpdate(b *testing.B) {
	d, err := cuda.Open(0)
	if err != nil {
		if cuda.Available() == nil || os.Getenv("DOS_REQUIRE_GPU") == "1" {
			b.Fatalf("GPU 0: %v", err)
		}
		b.Skipf("no GPU: %v", err)
	}
	defer d.Close()
	const n = 96 << 20
	var frees []func() error
	defer func() {
		for _, f := range frees {
			f()
		}
	}()
	pinned := func(bytes int64) []byte {
		h, err := d.HostRegister(bytes) // the engine's host state's kind (huge pages unless DOS_HUGE_PAGES=off)
		if err != nil {
			b.Fatal(err)
		}
		frees = append(frees, h.Free)
		return h.Bytes()
	}
	f32 := func() []float32 { return unsafe.Slice((*float32)(unsafe.Pointer(&pinned(4 * n)[0])), n) }
	u16 := func() []uint16 { return unsafe.Slice((*uint16)(unsafe.Pointer(&pinned(2 * n)[0])), n) }
	st := [2]adam.State{{Param: f32(), ExpAvg: f32(), ExpAvgSq: f32()}, {Param: f32(), ExpAvg: f32(), ExpAvgSq: f32()}}
	g, out := u16(), u16()
	for i := range n {
		st[0].Param[i] = float32(i%1000) * 1e-3
		g[i] = adam.F32ToBF16(float32(i%777) * 1e-5)
	}
	c := adam.DefaultHyper().Coeffs(1, 1, 0.9)
	threads := runtime.GOMAXPROCS(0)
	b.Logf("%s, %d threads, host wait %v (%s), context sleeps: %v; host memory: %s", d.Name, threads, cuda.CurrentHostWait(), cuda.WaitEnv, d.Sleeps, cuda.HugePages())
	for _, sub := range []int{6_250_000, 25_000_000, 50_000_000} {
		for _, with := range []string{"alone", "waiter", "waiter-t1", "dma"} {
			b.Run(fmt.Sprintf("sub=%.2fM/%s", float64(sub)/1e6, with), func(b *testing.B) {
				w := threads
				if with == "waiter-t1" {
					w = max(1, threads-1)
				}
				pool := adam.NewPool(w)
				defer pool.Close()
				from := 0
				pass := func() { updatePass(pool, &c, &st, g, out, sub, true, &from) }
				pass() // the pages warm
				stop := background(b, d, with)
				b.ResetTimer()
				for range b.N {
					pass()
				}
				b.StopTimer()
				stop()
				b.ReportMetric(float64(b.N)*n/b.Elapsed().Seconds()/1e9, "Gparam/s")
			})
		}
	}
}

// background starts what BenchmarkHostUpdate's variant with runs beside
// the update, and returns what stops it and waits for it.
func background(b *testing.B, d *cuda.Device, with string) (stop func()) {
	if with == "alone" {
		return func() {}
	}
	const piece = 128 << 20
	s1, err := d.NewStream()
	if err != nil {
		b.Fatal(err)
	}
	s2, err := d.NewStream()
	if err != nil {
		b.Fatal(err)
	}
	x, err := d.Alloc(piece)
	if err != nil {
		b.Fatal(err)
	}
	y, err := d.Alloc(piece)
	if err != nil {
		b.Fatal(err)
	}
	var h1, h2 *cuda.HostBuffer
	if with == "dma" {
		if h1, err = d.HostAlloc(piece); err != nil {
			b.Fatal(err)
		}
		if h2, err = d.HostAlloc(piece); err != nil {
			b.Fatal(err)
		}
	}
	ev, err := d.NewEvent(false)
	if err != nil {
		b.Fatal(err)
	}
	var quit atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		for !quit.Load() {
			if with == "dma" {
				// Both directions for about 50 ms, waited for by polling.
				for range 20 {
					s1.CopyHtoD(x, 0, h1, 0, piece)
					s2.CopyDtoH(h2, 0, y, 0, piece)
				}
				ev.Record(s2)
				for done, err := ev.Done(); !done && err == nil; done, err = ev.Done() {
					time.Sleep(time.Millisecond)
				}
				s1.Sync()
				continue
			}
			// About 50 ms of copies on the device, and a wait for them
			// as the trainer waits for its backward.
			for range 200 {
				s1.CopyDtoD(y, 0, x, 0, piece)
			}
			s1.Sync()
		}
	})
	return func() {
		quit.Store(true)
		wg.Wait()
		for _, f := range []func() error{ev.Free, s1.Free, s2.Free, x.Free, y.Free} {
			f()
		}
		if h1 != nil {
			h1.Free()
			h2.Free()
		}
	}
}

// BenchmarkHostPages measures the CPU workers' update in place
// (adam.Pool.Step, the phase's) and out of place (StepTo, the
// speculation's), bf16 gradient and working copy, over 64M parameters of
// memory mapped as the engine's (cuda.MapHost), on 2 MiB pages (advised)
// and on 4 KiB pages (DOS_HUGE_PAGES=off), one dispatch a subgroup of 8M
// parameters, and reports Gparam/s. It needs no GPU. The kernel gives
// huge pages only where its THP mode is madvise or always
// (cuda.HugePages says).
func BenchmarkHostPages(b *testing.B) {
	const n, sub = 64 << 20, 8 << 20
	b.Logf("host memory: %s; %d threads", cuda.HugePages(), runtime.GOMAXPROCS(0))
	for _, pages := range []string{"huge", "small"} {
		for _, op := range []string{"step", "step-to"} {
			b.Run(pages+"/"+op, func(b *testing.B) {
				if pages == "small" {
					b.Setenv(cuda.HugePagesEnv, "off")
				}
				var mem hostArrays
				defer mem.free()
				st := [2]adam.State{{Param: mem.f32(n), ExpAvg: mem.f32(n), ExpAvgSq: mem.f32(n)}, {Param: mem.f32(n), ExpAvg: mem.f32(n), ExpAvgSq: mem.f32(n)}}
				g, out := mem.u16(n), mem.u16(n)
				if mem.err != nil {
					b.Fatal(mem.err)
				}
				pool := adam.NewPool(runtime.GOMAXPROCS(0))
				defer pool.Close()
				c := adam.DefaultHyper().Coeffs(1, 1, 0.9)
				from := 0
				pass := func() { updatePass(pool, &c, &st, g, out, sub, op == "step-to", &from) }
				pass()
				pass() // both states' pages in
				b.ResetTimer()
				for range b.N {
					pass()
				}
				b.ReportMetric(float64(b.N)*n/b.Elapsed().Seconds()/1e9, "Gparam/s")
			})
		}
	}
}

// updatePass steps st[*from] over all its elements with gradient g and
// working copy out, one pool call a subgroup of sub elements: in place
// (Step), or with to out of place into the other state (StepTo), which
// then becomes *from, as the speculation's home and slots alternate.
func updatePass(pool *adam.Pool, c *adam.Coeffs, st *[2]adam.State, g, out []uint16, sub int, to bool, from *int) {
	n := len(g)
	for lo := 0; lo < n; lo += sub {
		hi := min(lo+sub, n)
		s, gr, o := st[*from].Slice(lo, hi), adam.Grad16(adam.BF16, g[lo:hi]), adam.Copy16{DType: adam.BF16, Data: out[lo:hi]}
		if to {
			pool.StepTo(c, s, gr, o, st[1-*from].Slice(lo, hi))
		} else {
			pool.Step(c, s, gr, o)
		}
	}
	if to {
		*from = 1 - *from
	}
}
