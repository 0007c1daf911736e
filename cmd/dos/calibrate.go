package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
	"github.com/deepstates/dos/perfmodel"
)

func runCalibrate(args []string, stdout, stderr io.Writer) int {
	c := newCLI("dos calibrate", "dos calibrate [--cpu-only] [--thorough] [--gpu-budget GiB] [--subgroup-size N] [--json PATH] [--plot PATH]",
		"Measures the rates the performance model needs: the CPU pool's AdamW update rate Uc per\n"+
			"thread count and gradient dtype and, unless --cpu-only, on GPU 0 the pinned H2D and D2H\n"+
			"bandwidth alone and both at once, the fused AdamW rate Ug and the bf16 cast rate Dc; each\n"+
			"fitted as time = latency + size/rate. Prints the fits and the schedule the model picks for a\n"+
			"few model sizes. Without a GPU and without --cpu-only it says so and exits 1.")
	cpuOnly := c.Bool("cpu-only", false, "measure the CPU update rate only (no GPU needed)")
	budget := c.Float64("gpu-budget", 16, "GPU memory in `GiB` the update phase may use, for the schedules printed")
	sgSize := int64(100_000_000)
	sizeVar(c, &sgSize, "subgroup-size", "parameters per subgroup `N` of the schedules printed")
	thorough := c.Bool("thorough", false, "five sizes and 11 repetitions instead of three and 5 (slower)")
	out := outputFlags(c, "the measured profile (format dos-profile v1)", "", "the measured points and fitted lines, one panel per resource,")
	jsonPath, plotPath := out.json, out.plot
	if rc, ok := c.parseNoArgs(args, stdout, stderr); !ok {
		return rc
	}
	if !(*budget >= 0) || *budget > 1<<20 {
		return c.usageError(stderr, "--gpu-budget %v: want a number of GiB from 0 to %d", *budget, 1<<20)
	}
	if sgSize <= 0 || sgSize > perfmodel.MaxParams {
		return c.usageError(stderr, "--subgroup-size %d: want 1 to %d", sgSize, int64(perfmodel.MaxParams))
	}
	if rc, ok := out.check(c, stderr); !ok {
		return rc
	}
	var dev *cuda.Device
	var kern *kernels.Kernels
	if !*cpuOnly {
		var release func()
		var err error
		if dev, kern, release, err = kernels.Open(0); err != nil {
			return c.fail(stderr, "no GPU to calibrate (%v); run dos calibrate --cpu-only", err)
		}
		defer release()
	}
	opts := perfmodel.CPUOptions{}
	if *thorough {
		// Five sizes from the default base (above the last-level cache)
		// to four times it, 11 repetitions each.
		opts.Sizes = perfmodel.CPUSizes(5)
		opts.Reps = 11
	}
	tty := isTerminal(stderr)
	start := time.Now()
	fits, err := perfmodel.CalibrateCPU(opts, func(done, total int) {
		if tty {
			w := 30
			k := done * w / total
			fmt.Fprintf(stderr, "\r\033[Kcalibrate [%s%s] %d/%d points, %s", strings.Repeat("#", k), strings.Repeat(" ", w-k), done, total, time.Since(start).Round(time.Second))
		}
	})
	if tty {
		fmt.Fprint(stderr, "\r\033[K")
	}
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	p := &perfmodel.Profile{Format: perfmodel.ProfileFormat, Version: perfmodel.ProfileVersion, Created: time.Now().UTC().Truncate(time.Second),
		Machine: perfmodel.Here(), CPU: fits}
	fmt.Fprintf(stdout, "dos calibrate: %s, %d logical CPUs, path %s, %s\n", p.Machine.CPU, p.Machine.Cores, adam.DefaultPath, time.Since(start).Round(time.Millisecond))
	fmt.Fprintf(stdout, "CPU AdamW update (bf16 working copy written), time = latency + params / Uc:\n")
	fmt.Fprintf(stdout, "  %-7s %-9s %12s %12s %9s\n", "threads", "grad", "Uc Gparam/s", "latency µs", "residual")
	for _, f := range fits {
		fmt.Fprintf(stdout, "  %-7d %-9s %12.3f %12.1f %8.1f%%\n", f.Threads, f.GradDType, f.Rate/1e9, f.LatencyS*1e6, 100*f.Residual)
	}
	if msg := noisyFits(fits); msg != "" {
		fmt.Fprintln(stderr, msg)
	}
	if dev != nil {
		g, err := perfmodel.CalibrateGPU(dev, kern, perfmodel.GPUOptions{}, func(done, total int) {
			if tty {
				fmt.Fprintf(stderr, "\r\033[Kcalibrate GPU %d/%d points, %s", done, total, time.Since(start).Round(time.Second))
			}
		})
		if tty {
			fmt.Fprint(stderr, "\r\033[K")
		}
		if err != nil {
			return c.fail(stderr, "GPU: %v", err)
		}
		p.GPU = g
		p.Machine.GPU, p.Machine.GPUMemBytes = dev.Name, dev.TotalMem
		if v, err := cuda.DriverVersion(); err == nil {
			p.Machine.Driver = fmt.Sprintf("%d.%d", v/1000, v%1000/10)
		}
		fmt.Fprintf(stdout, "GPU %s:\n", dev)
		for _, x := range []struct {
			name, unit string
			f          perfmodel.Fit
		}{{"H2D pinned", "GB/s", g.H2D}, {"D2H pinned", "GB/s", g.D2H}, {"H2D with D2H", "GB/s", g.H2DBoth}, {"D2H with H2D", "GB/s", g.D2HBoth},
			{"AdamW (Ug)", "Gparam/s", g.Update}, {"bf16 cast (Dc)", "Gelem/s", g.Convert}} {
			fmt.Fprintf(stdout, "  %-15s %9.2f %-8s latency %8.1f µs  residual %5.1f%%\n", x.name, x.f.Rate/1e9, x.unit, x.f.LatencyS*1e6, 100*x.f.Residual)
		}
		fmt.Fprintf(stdout, "  contention: the CPU update %.2fx slower while both directions copy, a copy %.2fx slower while the CPU updates\n", g.Contention.CPU, g.Contention.PCIe)
		if g.HostMem > 0 {
			fmt.Fprintf(stdout, "  host memory: %.1f GB/s at its peak (the CPU update and the copies share it: the lower bound's host-memory term)\n", g.HostMem/1e9)
		}
	}
	where := "all on the CPU (no GPU measured)"
	if p.GPU != nil {
		where = fmt.Sprintf("with a GPU budget of %g GiB", *budget)
	}
	fmt.Fprintf(stdout, "predicted update phase, %s, %d threads, bf16 gradients and copy, subgroups of %s:\n", where, runtime.GOMAXPROCS(0), formatSize(sgSize))
	for _, params := range []int64{125e6, 1.3e9, 7e9} {
		w := perfmodel.Workload{Params: params, SubgroupSize: sgSize, GradDType: adam.BF16, CopyBytes: 2, Threads: runtime.GOMAXPROCS(0)}
		if p.GPU != nil {
			w.GPUBudget = int64(*budget * (1 << 30))
		}
		pr, err := p.Choose(w)
		if err != nil {
			return c.fail(stderr, "%v", err)
		}
		k := "inf"
		if !math.IsInf(pr.K, 1) {
			k = fmt.Sprintf("%.2f", pr.K)
		}
		fmt.Fprintf(stdout, "  %6.2fB params: %d subgroups: %d CPU, %d GPU, %d resident, k = %s, upcast on GPU %v: %.3f s, bottleneck %s\n",
			float64(params)/1e9, w.Subgroups(), pr.CPU, pr.GPU, pr.Resident, k, pr.UpcastOnGPU, pr.Makespan, pr.Bottleneck)
	}
	if *jsonPath != "" {
		if err := writeJSON(*jsonPath, p); err != nil {
			return c.fail(stderr, "--json: %v", err)
		}
		fmt.Fprintf(stdout, "profile written to %s\n", *jsonPath)
	}
	if *plotPath != "" {
		if err := plotProfile(p, *plotPath); err != nil {
			return c.fail(stderr, "--plot: %v", err)
		}
		fmt.Fprintf(stdout, "plot written to %s\n", *plotPath)
	}
	return 0
}

// writeJSON writes v, indented, to path atomically (writeAtomic).
func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return writeAtomic(path, func(f *os.File) error { _, err := f.Write(append(b, '\n')); return err })
}

// writeAtomic writes path through write into a temporary file next to it,
// synced and renamed over path: a failure (a full disk) leaves whatever
// was at path before untouched and no partial file. A path that exists
// and is not a regular file (a device, a pipe, a symbolic link) is written
// in place instead: renaming over it would replace it.
func writeAtomic(path string, write func(f *os.File) error) error {
	if st, err := os.Lstat(path); err == nil && !st.Mode().IsRegular() {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
		if err != nil {
			return err
		}
		err = write(f)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		return err
	}
	// Errors name path, which the user gave, not the temporary file.
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("%s: cannot create a file in its directory %s: %w", path, filepath.Dir(path), osCause(err))
	}
	tmp := f.Name()
	err = write(f)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp, 0o644)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("%s: writing it (through a temporary file beside it, removed): %w", path, osCause(err))
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("%s: replacing it: %w", path, osCause(err))
	}
	return nil
}

// osCause returns the cause of err when it is a *os.PathError or
// *os.LinkError (the errno, without the file it names: the temporary
// one), or err as it is.
func osCause(err error) error {
	switch e := err.(type) {
	case *os.PathError:
		return e.Err
	case *os.LinkError:
		return e.Err
	}
	return err
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

// noisyResidual is the fit residual over which dos calibrate warns: on an
// idle machine the CPU fits' are 1-15 %; one measured while make test ran
// was 188 % (a 5.27 Gparam/s rate at 2 threads against 0.49 at 1).
const noisyResidual = 0.25

// noisyFits returns dos calibrate's warning when a CPU fit's residual is
// over noisyResidual (the machine was busy while it measured: the
// profile's rates, and the plans made from them, are off), else "".
func noisyFits(fits []perfmodel.CPUFit) string {
	worst, at := 0.0, -1
	for i, f := range fits {
		if f.Residual > worst {
			worst, at = f.Residual, i
		}
	}
	if worst <= noisyResidual {
		return ""
	}
	return fmt.Sprintf("dos calibrate: warning: the CPU fits are noisy (residual %.0f %% at %d threads, %v gradients; an idle machine's are under %.0f %%): something else used the CPU or its memory while they ran; calibrate again on an idle machine before planning with this profile",
		100*worst, fits[at].Threads, fits[at].GradDType, 100*noisyResidual)
}
