package adam

import (
	"fmt"
	"runtime"
	"testing"
)

// BenchmarkCPULane runs the CPU lane's work alone: a pool of GOMAXPROCS
// goroutines steps 400M parameters (bf16 gradient, bf16 copy, the staged
// path as the engine runs it) one subgroup after another, with spinners
// goroutines locked to OS threads and spinning meanwhile, as the engine's
// lanes do while they wait on CUDA events (cuEventSynchronize spins under
// the default context scheduling). It reports Gparam/s over the whole lane.
// What it measures: how much a thread that takes a core from the workers
// costs the lane, at the subgroup sizes dos chooses (BENCHMARKS.md, "the
// CPU lane's lost time").
//
//	go test -run '^$' -bench CPULane -benchtime 4x ./adam
func BenchmarkCPULane(b *testing.B) {
	if testing.Short() {
		b.Skip("6.4 GB of buffers")
	}
	const total = 400 << 20
	s := State{Param: make([]float32, total), ExpAvg: make([]float32, total), ExpAvgSq: make([]float32, total)}
	g := Grad16(BF16, make([]uint16, total))
	for i := range s.Param { // a pattern, not random: 400M random draws take minutes
		s.Param[i] = float32(i%1000) * 1e-3
		g.U16[i] = F32ToBF16(float32(i%777) * 1e-5)
	}
	out := Copy16{BF16, make([]uint16, total)}
	c := DefaultHyper().Coeffs(1, 1, 0.9)
	pool := NewPool(0)
	defer pool.Close()
	pool.Step(&c, s, g, out) // faults out's pages in before timing
	for _, sg := range []int{25 << 20, 100 << 20} {
		for _, spinners := range []int{0, 2} {
			b.Run(fmt.Sprintf("pool-%d/subgroup=%dM/spinners=%d", pool.Threads(), sg>>20, spinners), func(b *testing.B) {
				stop := make(chan struct{})
				for range spinners {
					go func() {
						runtime.LockOSThread()
						defer runtime.UnlockOSThread()
						for {
							select {
							case <-stop:
								return
							default:
							}
						}
					}()
				}
				defer close(stop)
				for b.Loop() {
					for lo := 0; lo < total; lo += sg {
						hi := min(lo+sg, total)
						pool.Step(&c, s.Slice(lo, hi), g.Slice(lo, hi), out.Slice(lo, hi))
					}
				}
				b.ReportMetric(float64(total)*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gparam/s")
			})
		}
	}
}
