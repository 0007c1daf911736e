package offload

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/internal/kernels"
	"github.com/deepstates/dos/scheduler"
)

// BenchmarkCheckpointBlocking measures how long a checkpoint holds up
// training: the same loop (a simulated forward and backward of
// DOS_CKPT_COMPUTE_MS milliseconds, default 500, then Step) runs 6
// iterations without a checkpoint (4 times), with a synchronous
// SaveCheckpoint after iteration 2 (once), and with a lazy SaveAsync there
// (twice), interleaved. A loop's blocked time is the time spent in the save
// call and in the Steps after it; a save blocks training by its loops'
// excess over the loops without (the mean of each). The sleeps stand for
// the GPU's work and are left out: their jitter is not the checkpoint's. The state is DOS_CKPT_GIB GiB
// (default 1) of fp32 master weights, exp_avg and exp_avg_sq in 64
// parameters and subgroups of 8M elements, written under DOS_CKPT_DIR
// (default a temporary directory) with the lazy engine's ring holding the
// whole state (DOS_CKPT_CHUNK_MIB and DOS_CKPT_WRITERS set its chunk size
// and writer count). With DOS_CKPT_SCHEDULE=C,G,R the update runs on GPU
// 0 through the engine (Options.Device) with C CPU, G streamed and R
// resident subgroups (of 86 at 8 GiB), so the lazy save also moves the
// resident state D2H in the background. Run by bench/ckpt.sh:
//
//	go test -run '^$' -bench CheckpointBlocking -benchtime 1x ./offload/
func BenchmarkCheckpointBlocking(b *testing.B) {
	gib := envFloat("DOS_CKPT_GIB", 1)
	compute := time.Duration(envFloat("DOS_CKPT_COMPUTE_MS", 500)) * time.Millisecond
	dir := os.Getenv("DOS_CKPT_DIR")
	if dir == "" {
		dir = b.TempDir()
	}
	const nparams = 64
	per := int(gib*(1<<30)/12) / nparams
	var params []Param
	for i := range nparams {
		params = append(params, Param{Name: fmt.Sprintf("layers.%d.weight", i), Shape: []int{per}})
	}
	opts := Options{SubgroupSize: 8 << 20}
	if text := os.Getenv("DOS_CKPT_SCHEDULE"); text != "" {
		s, err := scheduler.ParseSchedule(text)
		if err != nil {
			b.Fatal(err)
		}
		d, k, release, err := kernels.Open(0)
		if err != nil {
			b.Fatalf("DOS_CKPT_SCHEDULE needs GPU 0: %v", err)
		}
		defer release()
		opts.Device, opts.Schedule = scheduler.NewCUDA(d, k), &s
		opts.WorkingDType = adam.BF16 // the working copy lives on the device
	}
	o, err := New(params, opts)
	if err != nil {
		b.Fatal(err)
	}
	defer o.Close()
	for i := range o.Params() {
		g := o.Grad(i).Float32()
		for j := range g {
			g[j] = float32(j%1000) * 1e-4
		}
	}
	state := int64(o.NumParams()) * 12
	chunk := int64(envFloat("DOS_CKPT_CHUNK_MIB", checkpoint.DefaultChunkBytes>>20)) << 20
	eo := checkpoint.EngineOptions{ChunkBytes: chunk, RingBytes: (state + 64<<20 + chunk) / chunk * chunk, Writers: int(envFloat("DOS_CKPT_WRITERS", 0))}
	e, err := checkpoint.NewEngine(checkpoint.OS, filepath.Join(dir, "lazy"), eo)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	// One loop: 6 iterations of a simulated forward and backward, then
	// Step; after the second, the save of mode. blocked is the time spent
	// in the save call and in the Steps after it: what training waits for
	// in dos's calls, without the noise of the sleeps.
	type run struct {
		total, blocked, save time.Duration
		steps                []time.Duration
		h                    *checkpoint.Handle
	}
	loop := func(mode string) run {
		var r run
		start := time.Now()
		for it := 1; it <= 6; it++ {
			time.Sleep(compute) // forward and backward on the GPU
			t0 := time.Now()
			if _, err := o.Step(StepArgs{}); err != nil {
				b.Fatal(err)
			}
			d := time.Since(t0)
			r.steps = append(r.steps, d)
			if it > 2 {
				r.blocked += d
			}
			if it != 2 {
				continue
			}
			t0 = time.Now()
			switch mode {
			case "sync":
				if _, err := o.SaveCheckpoint(checkpoint.OS, filepath.Join(dir, "sync"), nil); err != nil {
					b.Fatal(err)
				}
			case "lazy":
				if r.h, err = o.SaveAsync(e, o.StepCount(), nil); err != nil {
					b.Fatal(err)
				}
			}
			r.save = time.Since(t0)
			r.blocked += r.save
		}
		r.total = time.Since(start)
		if r.h != nil {
			if _, err := r.h.Wait(); err != nil {
				b.Fatal(err)
			}
		}
		return r
	}
	mean := func(rs []run, f func(run) time.Duration) time.Duration {
		var t time.Duration
		for _, r := range rs {
			t += f(r)
		}
		return t / time.Duration(len(rs))
	}
	ms := func(d []time.Duration) string {
		var t []string
		for _, x := range d {
			t = append(t, fmt.Sprint(x.Round(time.Millisecond)))
		}
		return strings.Join(t, " ")
	}
	where := "update on the CPU"
	if s, ok := o.Schedule(); ok {
		where = fmt.Sprintf("update on %s: %d CPU, %d streamed, %d resident subgroups", opts.Device.Name(), s.CPU, s.GPU, s.Resident)
	}
	loop("none") // warm-up: the state's pages are touched by the first steps
	for b.Loop() {
		// Interleaved, so that a drift of the machine hits both: none,
		// sync, none, lazy, none, lazy, none.
		nones := []run{loop("none")}
		syncR := loop("sync")
		var lazies []run
		for range 2 {
			nones = append(nones, loop("none"))
			lazies = append(lazies, loop("lazy"))
		}
		nones = append(nones, loop("none"))
		blocked := func(r run) time.Duration { return r.blocked }
		total := func(r run) time.Duration { return r.total }
		ref, refTotal := mean(nones, blocked), mean(nones, total)
		syncBlocked := syncR.blocked - ref
		lazyBlocked := mean(lazies, blocked) - ref
		st := lazies[len(lazies)-1].h.Stats()
		fmt.Printf("checkpoint of %.2f GiB (%d params), %s, compute %v per iteration, %s, lazy engine %+v\n", float64(st.Bytes)/(1<<30), o.NumParams(), where, compute, dir, e.Options())
		for i, r := range nones {
			fmt.Printf("  without checkpoint %d: loop %v, Steps %s\n", i+1, r.total.Round(time.Millisecond), ms(r.steps))
		}
		fmt.Printf("  synchronous save: %v (%.2f GB/s); blocked %v (loop %v longer); Steps %s\n", syncR.save.Round(time.Millisecond),
			float64(st.Bytes)/syncR.save.Seconds()/1e9, syncBlocked.Round(time.Millisecond), (syncR.total - refTotal).Round(time.Millisecond), ms(syncR.steps))
		var flush float64
		for i, r := range lazies {
			s := r.h.Stats()
			flush += float64(s.Bytes) / s.Durable.Seconds() / 1e9 / float64(len(lazies))
			fmt.Printf("  lazy save %d: SaveAsync %v, blocked %v (loop %v longer); captured in %v, durable in %v (%.2f GB/s, O_DIRECT %v); Steps %s\n", i+1,
				r.save.Round(time.Millisecond), (r.blocked - ref).Round(time.Millisecond), (r.total - refTotal).Round(time.Millisecond),
				s.Captured.Round(time.Millisecond), s.Durable.Round(time.Millisecond), float64(s.Bytes)/s.Durable.Seconds()/1e9, s.Direct, ms(r.steps))
		}
		fmt.Printf("  lazy: blocked %v on average = %.1f %% of the synchronous save's %v; flush %.2f GB/s on average\n",
			lazyBlocked.Round(time.Millisecond), 100*lazyBlocked.Seconds()/syncBlocked.Seconds(), syncBlocked.Round(time.Millisecond), flush)
		b.ReportMetric(lazyBlocked.Seconds()/syncBlocked.Seconds(), "blocked/sync")
		b.ReportMetric(flush, "flush-GB/s")
	}
}

func envFloat(name string, def float64) float64 {
	if v, err := strconv.ParseFloat(os.Getenv(name), 64); err == nil && v > 0 {
		return v
	}
	return def
}
