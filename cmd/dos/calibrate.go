package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"time"

	"github.com/klauspost/cpuid/v2"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/cuda"
	"github.com/deepstates/dos/perfmodel"
)

func runCalibrate(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("dos calibrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cpuOnly := fs.Bool("cpu-only", false, "measure the CPU update rate only (no GPU needed)")
	thorough := fs.Bool("thorough", false, "more sizes and repetitions (several minutes)")
	jsonPath := fs.String("json", "", "write the measured profile to `PATH` (JSON, format dos-profile v1)")
	plotPath := fs.String("plot", "", "draw the measured points and fitted lines to `PATH` (.svg, .png or .pdf)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: dos calibrate --cpu-only [--thorough] [--json PATH] [--plot PATH]\n\n"+
			"Measures the rates the performance model needs (issue 6): today the CPU pool's AdamW\n"+
			"update rate Uc per thread count and gradient dtype, fitted as time = latency + params/Uc,\n"+
			"and prints the fits and the schedule the model picks for a few model sizes.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if rc, ok := parseNoArgs(fs, args, stderr); !ok {
		return rc
	}
	if !*cpuOnly {
		why := "GPU calibration (transfers, the fused kernel, conversions) is not built yet"
		if err := cuda.Available(); err != nil {
			why = err.Error()
		}
		fmt.Fprintf(stderr, "dos calibrate: %s; run dos calibrate --cpu-only\n", why)
		return 2
	}
	if *plotPath != "" {
		if err := checkPlotPath(*plotPath); err != nil {
			fmt.Fprintf(stderr, "dos calibrate: %v\n", err)
			return 2
		}
	}
	opts := perfmodel.CPUOptions{}
	if *thorough {
		opts.Sizes = []int{1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20}
		opts.Reps = 11
	}
	tty := isTerminal(stderr)
	start := time.Now()
	fits, err := perfmodel.CalibrateCPU(opts, func(done, total int) {
		if tty {
			w := 30
			k := done * w / total
			fmt.Fprintf(stderr, "\r\033[Kcalibrate [%s%s] %d/%d points, %s", bar(k), space(w-k), done, total, time.Since(start).Round(time.Second))
		}
	})
	if tty {
		fmt.Fprint(stderr, "\r\033[K")
	}
	if err != nil {
		fmt.Fprintf(stderr, "dos calibrate: %v\n", err)
		return 1
	}
	p := &perfmodel.Profile{Format: perfmodel.ProfileFormat, Version: perfmodel.ProfileVersion, Created: time.Now().UTC().Truncate(time.Second),
		Machine: perfmodel.Machine{CPU: cpuid.CPU.BrandName, Cores: runtime.NumCPU()}, CPU: fits}
	fmt.Fprintf(stdout, "dos calibrate: %s, %d logical CPUs, path %s, %s\n", p.Machine.CPU, p.Machine.Cores, adam.DefaultPath, time.Since(start).Round(time.Millisecond))
	fmt.Fprintf(stdout, "CPU AdamW update (bf16 working copy written), time = latency + params / Uc:\n")
	fmt.Fprintf(stdout, "  %-7s %-9s %12s %12s %9s\n", "threads", "grad", "Uc Gparam/s", "latency µs", "residual")
	for _, f := range fits {
		fmt.Fprintf(stdout, "  %-7d %-9s %12.3f %12.1f %8.1f%%\n", f.Threads, f.GradDType, f.Rate/1e9, f.LatencyS*1e6, 100*f.Residual)
	}
	fmt.Fprintf(stdout, "predicted update phase, all on the CPU (no GPU measured), %d threads, bf16 gradients, subgroups of 100M:\n", runtime.GOMAXPROCS(0))
	for _, params := range []int64{125e6, 1.3e9, 7e9} {
		w := perfmodel.Workload{Params: params, SubgroupSize: 100e6, GradDType: "bfloat16", CopyBytes: 2, Threads: runtime.GOMAXPROCS(0)}
		pr, err := p.Choose(w)
		if err != nil {
			fmt.Fprintf(stderr, "dos calibrate: %v\n", err)
			return 1
		}
		k := "inf"
		if !math.IsInf(pr.K, 1) {
			k = fmt.Sprintf("%.2f", pr.K)
		}
		fmt.Fprintf(stdout, "  %6.2fB params: %d subgroups, k = %s, %.2f s, bottleneck %s\n", float64(params)/1e9, w.Subgroups(), k, pr.Makespan, pr.Bottleneck)
	}
	if *jsonPath != "" {
		b, err := json.MarshalIndent(p, "", "  ")
		if err == nil {
			err = os.WriteFile(*jsonPath, append(b, '\n'), 0o644)
		}
		if err != nil {
			fmt.Fprintf(stderr, "dos calibrate: writing the profile: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "profile written to %s\n", *jsonPath)
	}
	if *plotPath != "" {
		if err := plotProfile(p, *plotPath); err != nil {
			fmt.Fprintf(stderr, "dos calibrate: plot: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "plot written to %s\n", *plotPath)
	}
	return 0
}

func bar(n int) string   { return repeat('#', n) }
func space(n int) string { return repeat(' ', n) }

func repeat(c byte, n int) string {
	b := make([]byte, max(n, 0))
	for i := range b {
		b[i] = c
	}
	return string(b)
}

// isTerminal reports whether w is a character device (a terminal), where
// a progress bar may redraw itself.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
