package adam

import (
	"fmt"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"
)

// benchN is 16M parameters: 448 MiB of fp32 p, g, m, v, past every cache.
const benchN = 16 << 20

// BenchmarkStep measures one AdamW step at 28 B/param (fp32 p, g, m, v read,
// p, m, v written; a 16-bit gradient moves 2 B less, a 16-bit copy 2 B more).
// BenchmarkStep/pool-N/PATH/stats reads the gradient once (GradStats: 4 or
// 2 B/param). BenchmarkStep/pool-N/PATH/subgroup is the step as
// perfmodel.CalibrateCPU times it for Uc: on the staged path (clip factor
// 0.9) writing a bf16 copy (the checks, GradStats, are timed apart). BenchmarkStep/copy moves the same 28 B/param with the built-in copy: the
// memory-bandwidth reference, measured in the same run.
func BenchmarkStep(b *testing.B) {
	if testing.Short() {
		b.Skip("large buffers")
	}
	s, g := randomProblem(benchN, F32, false, 1)
	_, g16 := randomProblem(benchN, BF16, false, 1)
	out := Copy16{BF16, make([]uint16, benchN)}
	c := DefaultHyper().Coeffs(1, 1, 1)
	report := func(b *testing.B, bytes int) {
		b.SetBytes(int64(bytes) * benchN)
		b.ReportAllocs()
		b.ReportMetric(float64(benchN)*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gparam/s")
	}
	b.Run(fmt.Sprintf("copy/n=%dM", benchN>>20), func(b *testing.B) {
		src := make([]byte, 14*benchN)
		dst := make([]byte, 14*benchN)
		copy(dst, src) // fault the pages in before timing
		for b.Loop() {
			copy(dst, src)
		}
		report(b, 28)
	})
	for _, path := range Paths() {
		b.Run(fmt.Sprintf("%s/grad=f32/n=%dM", path.Name(), benchN>>20), func(b *testing.B) {
			for b.Loop() {
				path.Step(&c, s, g, Copy16{})
			}
			report(b, 28)
		})
		pool := NewPoolPath(0, path)
		b.Run(fmt.Sprintf("pool-%d/%s/grad=f32/n=%dM", pool.Threads(), path.Name(), benchN>>20), func(b *testing.B) {
			for b.Loop() {
				pool.Step(&c, s, g, Copy16{})
			}
			report(b, 28)
		})
		b.Run(fmt.Sprintf("pool-%d/%s/grad=bf16/copy=bf16/n=%dM", pool.Threads(), path.Name(), benchN>>20), func(b *testing.B) {
			for b.Loop() {
				pool.Step(&c, s, g16, out)
			}
			report(b, 28)
		})
		b.Run(fmt.Sprintf("pool-%d/%s/stats/grad=f32/n=%dM", pool.Threads(), path.Name(), benchN>>20), func(b *testing.B) {
			pool.GradStats(g, 0.5) // sizes the partial sums before timing
			for b.Loop() {
				pool.GradStats(g, 0.5)
			}
			report(b, 4)
		})
		b.Run(fmt.Sprintf("pool-%d/%s/stats/grad=bf16/n=%dM", pool.Threads(), path.Name(), benchN>>20), func(b *testing.B) {
			for b.Loop() {
				pool.GradStats(g16, 0.5)
			}
			report(b, 2)
		})
		cc := DefaultHyper().Coeffs(1, 1, 0.9)
		for _, gr := range []struct {
			name  string
			g     Grad
			bytes int // p, m, v 24, the gradient, the copy 2
		}{{"f32", g, 30}, {"bf16", g16, 28}} {
			b.Run(fmt.Sprintf("pool-%d/%s/subgroup/grad=%s/copy=bf16/n=%dM", pool.Threads(), path.Name(), gr.name, benchN>>20), func(b *testing.B) {
				for b.Loop() {
					pool.Step(&cc, s, gr.g, out)
				}
				report(b, gr.bytes)
			})
		}
		pool.Close()
	}
	b.Run(fmt.Sprintf("copy-%d/n=%dM", 2, benchN>>20), func(b *testing.B) {
		src := make([]byte, 14*benchN)
		dst := make([]byte, 14*benchN)
		half := len(src) / 2
		copy(dst, src)
		done := make(chan struct{})
		for b.Loop() {
			go func() { copy(dst[half:], src[half:]); done <- struct{}{} }()
			copy(dst[:half], src[:half])
			<-done
		}
		report(b, 28)
	})
}

// BenchmarkStepSave measures the speculative update (Pool.StepSave, as
// scheduler.Engine's speculation runs it: a bf16 gradient, a bf16 copy,
// the fp32 state saved first) against Pool.Step on the same operands, in
// the same run: what the save costs over the phase's step ("save"), and
// what it cost with the built-in copy a chunk before the step
// ("save-copy").
func BenchmarkStepSave(b *testing.B) {
	if testing.Short() {
		b.Skip("large buffers")
	}
	s, g16 := randomProblem(benchN, BF16, false, 1)
	out := Copy16{BF16, make([]uint16, benchN)}
	save := State{Param: make([]float32, benchN), ExpAvg: make([]float32, benchN), ExpAvgSq: make([]float32, benchN)}
	copyState(save, s, nil, nil, 0, 0) // fault the pages in before timing
	for i := range out.Data {
		out.Data[i] = 1
	}
	c := DefaultHyper().Coeffs(1, 1, 1)
	pool := NewPool(0)
	defer pool.Close()
	to := State{Param: make([]float32, benchN), ExpAvg: make([]float32, benchN), ExpAvgSq: make([]float32, benchN)}
	copyState(to, s, nil, nil, 0, 0)
	for _, mode := range []string{"step", "save", "save-copy", "step-to"} {
		b.Run(fmt.Sprintf("pool-%d/%s/n=%dM", pool.Threads(), mode, benchN>>20), func(b *testing.B) {
			saveNonTemporal = mode != "save-copy"
			defer func() { saveNonTemporal = true }()
			for b.Loop() {
				switch mode {
				case "step":
					pool.Step(&c, s, g16, out)
				case "step-to":
					pool.StepTo(&c, s, g16, out, to)
				default:
					pool.StepSave(&c, s, g16, out, save, nil)
				}
			}
			b.ReportMetric(float64(benchN)*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gparam/s")
		})
	}
}

// BenchmarkPoolWakeup measures how long a goroutine that sleeps 200 µs
// waits past its timer while a pool of GOMAXPROCS goroutines steps 8M
// parameters again and again (every P busy), as the trainer's goroutine
// and the engine's copy issuers wait while the CPU workers update: the
// median and the 90th percentile of 200 sleeps, in µs. Without the
// workers' yield between chunks (Pool.run) the wake-up waited for a
// whole call.
func BenchmarkPoolWakeup(b *testing.B) {
	const n = 8 << 20
	s := State{Param: make([]float32, n), ExpAvg: make([]float32, n), ExpAvgSq: make([]float32, n)}
	g := make([]uint16, n)
	out := Copy16{DType: BF16, Data: make([]uint16, n)}
	pool := NewPool(runtime.GOMAXPROCS(0))
	defer pool.Close()
	c := DefaultHyper().Coeffs(1, 1, 0.9)
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		for !stop.Load() {
			pool.Step(&c, s, Grad16(BF16, g), out)
		}
		close(done)
	}()
	defer func() { stop.Store(true); <-done }()
	time.Sleep(50 * time.Millisecond)
	const sleep = 200 * time.Microsecond
	var lats []time.Duration
	b.ResetTimer()
	for range b.N {
		lats = lats[:0]
		for range 200 {
			t0 := time.Now()
			time.Sleep(sleep)
			lats = append(lats, time.Since(t0)-sleep)
		}
	}
	slices.Sort(lats)
	b.ReportMetric(float64(lats[100].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lats[180].Microseconds()), "p90-µs")
}
