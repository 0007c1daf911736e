package offload

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/deepstates/dos/checkpoint"
)

// BenchmarkCheckpointBlocking measures how long a checkpoint holds up
// training: the same loop (a simulated forward and backward of
// DOS_CKPT_COMPUTE_MS milliseconds, default 500, then Step) runs 6
// iterations without a checkpoint, with a synchronous SaveCheckpoint after
// iteration 2, and with a lazy SaveAsync there; the blocked time is each
// run's excess over the run without. The state is DOS_CKPT_GIB GiB
// (default 1) of fp32 master weights, exp_avg and exp_avg_sq in 64
// parameters and subgroups of 8M elements, written under DOS_CKPT_DIR
// (default a temporary directory) with the lazy engine's ring holding the
// whole state (DOS_CKPT_CHUNK_MIB and DOS_CKPT_WRITERS set its chunk size
// and writer count). Run by bench/ckpt.sh:
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
	o, err := New(params, Options{SubgroupSize: 8 << 20})
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
	chunk := int64(envFloat("DOS_CKPT_CHUNK_MIB", 8)) << 20
	eo := checkpoint.EngineOptions{ChunkBytes: chunk, RingBytes: (state + 64<<20 + chunk) / chunk * chunk, Writers: int(envFloat("DOS_CKPT_WRITERS", 0))}
	e, err := checkpoint.NewEngine(checkpoint.OS, filepath.Join(dir, "lazy"), eo)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	var syncSave time.Duration
	var handle *checkpoint.Handle
	loop := func(mode string) time.Duration {
		start := time.Now()
		for it := 1; it <= 6; it++ {
			time.Sleep(compute) // forward and backward on the GPU
			if _, err := o.Step(StepArgs{}); err != nil {
				b.Fatal(err)
			}
			if it != 2 {
				continue
			}
			switch mode {
			case "sync":
				t0 := time.Now()
				if _, err := o.SaveCheckpoint(checkpoint.OS, filepath.Join(dir, "sync"), nil); err != nil {
					b.Fatal(err)
				}
				syncSave = time.Since(t0)
			case "lazy":
				if handle, err = o.SaveAsync(e, o.StepCount(), nil); err != nil {
					b.Fatal(err)
				}
			}
		}
		return time.Since(start)
	}
	loop("none") // warm-up: the state's pages are touched by the first steps
	for b.Loop() {
		none := loop("none")
		syncT := loop("sync")
		lazy := loop("lazy")
		if _, err := handle.Wait(); err != nil {
			b.Fatal(err)
		}
		none2 := loop("none") // the reference twice, to see its noise
		ref := min(none, none2)
		st := handle.Stats()
		fmt.Printf("checkpoint of %.2f GiB (%d params), compute %v per iteration, %s, lazy engine %+v\n", float64(st.Bytes)/(1<<30), o.NumParams(), compute, dir, eo)
		fmt.Printf("  loop without checkpoint: %v and %v\n", none.Round(time.Millisecond), none2.Round(time.Millisecond))
		fmt.Printf("  synchronous save: %v (%.2f GB/s); loop blocked %v\n", syncSave.Round(time.Millisecond), float64(st.Bytes)/syncSave.Seconds()/1e9, (syncT - ref).Round(time.Millisecond))
		fmt.Printf("  lazy save: loop blocked %v = %.1f %% of the synchronous save; captured in %v, durable in %v (%.2f GB/s, O_DIRECT %v)\n",
			(lazy - ref).Round(time.Millisecond), 100*(lazy-ref).Seconds()/syncSave.Seconds(), st.Captured.Round(time.Millisecond),
			st.Durable.Round(time.Millisecond), float64(st.Bytes)/st.Durable.Seconds()/1e9, st.Direct)
		b.ReportMetric((lazy-ref).Seconds()/syncSave.Seconds(), "blocked/sync")
		b.ReportMetric(float64(st.Bytes)/st.Durable.Seconds()/1e9, "flush-GB/s")
	}
}

func envFloat(name string, def float64) float64 {
	if v, err := strconv.ParseFloat(os.Getenv(name), 64); err == nil && v > 0 {
		return v
	}
	return def
}
