package perfmodel

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/klauspost/cpuid/v2"
)

// ProfileFormat and ProfileVersion identify a Profile's JSON.
const (
	ProfileFormat  = "dos-profile"
	ProfileVersion = 1
)

// Machine identifies where a Profile was measured.
type Machine struct {
	CPU          string `json:"cpu"`   // model name, e.g. from klauspost/cpuid
	Cores        int    `json:"cores"` // logical CPUs
	HostMemBytes int64  `json:"host_mem_bytes,omitempty"`
	GPU          string `json:"gpu,omitempty"` // "" without a GPU
	GPUMemBytes  int64  `json:"gpu_mem_bytes,omitempty"`
	Driver       string `json:"driver,omitempty"` // CUDA driver API version, e.g. "13.0"
	// HostPages is the pages of the host memory the CPU workers update,
	// "huge" or "small" (cuda.HostPages: DOS_HUGE_PAGES and the kernel's
	// transparent huge pages), on which the CPU's rates depend; "" in
	// profiles from before it was recorded.
	HostPages string `json:"host_pages,omitempty"`
}

// CPUFit is the CPU pool's AdamW update rate at Threads goroutines for
// gradients of GradDType ("float32", "bfloat16", "float16"): Size in
// parameters, Rate in params/s (Uc).
type CPUFit struct {
	Threads   int        `json:"threads"`
	GradDType adam.DType `json:"grad_dtype"`
	Fit
	// Stats is the one-pass non-finite check and sum of squares over the
	// gradient (adam.Pool.GradStats), params/s: the CPU runs it when the
	// gradients are on the host (no GPU). Zero in older profiles.
	Stats Fit `json:"stats,omitzero"`
}

// GPUProfile holds the GPU's rates.
type GPUProfile struct {
	Update  Fit `json:"update"`     // fused AdamW, params/s (Ug)
	H2D     Fit `json:"h2d"`        // pinned host to device alone, bytes/s (Bh)
	D2H     Fit `json:"d2h"`        // device to host alone, bytes/s (Bd)
	H2DBoth Fit `json:"h2d_duplex"` // host to device while D2H runs too, bytes/s
	D2HBoth Fit `json:"d2h_duplex"` // device to host while H2D runs too, bytes/s
	Convert Fit `json:"convert"`    // 16-bit to fp32 cast, elements/s (Dc)
	// Contention is how much the CPU workers and the copies slow each
	// other down through the host memory they share. Zero in profiles
	// measured before it: no contention modelled.
	Contention Contention `json:"contention,omitzero"`
	// HostMem is the host memory's peak rate, bytes/s: the most bytes a
	// second that the calibration saw pass through it (CalibrateGPU: the
	// CPU workers' AdamW alone, counted at 28 bytes a parameter; the same
	// while both PCIe directions copy, their bytes added; all workers
	// copying memory, each byte read and written), which the update and
	// the PCIe copies share. Bound's host-memory term. Zero in profiles
	// measured before it: no such term.
	HostMem float64 `json:"host_mem_rate,omitempty"`
}

// Contention is the slow-down of the CPU workers and of the PCIe copies
// while both run (measured by CalibrateGPU): CPU is a CPU update's time
// while both PCIe directions copy over its time alone, PCIe a copy's time
// while the CPU workers update over its time with only the other
// direction copying. Both are >= 1; the model's package doc says how they
// are used.
type Contention struct {
	CPU  float64 `json:"cpu_slowdown"`
	PCIe float64 `json:"pcie_slowdown"`
}

// Profile is what dos calibrate measured on one machine.
type Profile struct {
	Format  string      `json:"format"`
	Version int         `json:"version"`
	Created time.Time   `json:"created"`
	Machine Machine     `json:"machine"`
	CPU     []CPUFit    `json:"cpu"`
	GPU     *GPUProfile `json:"gpu,omitempty"` // nil: measured without a GPU
}

// CPURate returns the fit for threads and the gradient dtype: the exact
// thread count, or else the largest measured count below it.
//
// Errors: no fit for that dtype at or below threads.
func (p *Profile) CPURate(threads int, gradDType adam.DType) (Fit, error) {
	f, err := p.cpuFit(threads, gradDType)
	return f.Fit, err
}

func (p *Profile) cpuFit(threads int, gradDType adam.DType) (CPUFit, error) {
	f, err := p.cpuFitExact(threads, gradDType)
	if err != nil && gradDType == adam.F16 {
		// dos calibrate measures float32 and bfloat16: a float16
		// gradient moves the same bytes as a bfloat16 one.
		if f, err2 := p.cpuFitExact(threads, adam.BF16); err2 == nil {
			return f, nil
		}
	}
	return f, err
}

func (p *Profile) cpuFitExact(threads int, gradDType adam.DType) (CPUFit, error) {
	best := -1
	for i, c := range p.CPU {
		if c.GradDType == gradDType && c.Threads <= threads && (best < 0 || c.Threads > p.CPU[best].Threads) {
			best = i
		}
	}
	if best < 0 {
		return CPUFit{}, fmt.Errorf("perfmodel: the profile has no CPU rate for %s gradients at %d threads or fewer", gradDType, threads)
	}
	return p.CPU[best], nil
}

// Validate checks the format, the version and every fit.
func (p *Profile) Validate() error {
	if p.Format != ProfileFormat {
		return fmt.Errorf("perfmodel: format %q is not a dos profile (%q)", p.Format, ProfileFormat)
	}
	if p.Version != ProfileVersion {
		return fmt.Errorf("perfmodel: profile version %d; this dos reads version %d: run dos calibrate again", p.Version, ProfileVersion)
	}
	if len(p.CPU) == 0 {
		return errors.New("perfmodel: the profile has no CPU rates")
	}
	seen := map[[2]string]bool{}
	for _, c := range p.CPU {
		if _, err := gradBytes(c.GradDType); err != nil {
			return fmt.Errorf("perfmodel: CPU rate at %d threads: %w", c.Threads, err)
		}
		if (!c.Stats.zero() && !c.Stats.Valid()) || !c.Valid() || c.Threads < 1 {
			return fmt.Errorf("perfmodel: CPU rate at %d threads for %s: invalid fit (rate %g, latency %g s, residual %g)", c.Threads, c.GradDType, c.Rate, c.LatencyS, c.Residual)
		}
		key := [2]string{fmt.Sprint(c.Threads), c.GradDType.String()}
		if seen[key] {
			return fmt.Errorf("perfmodel: two CPU rates for %d threads and %s", c.Threads, c.GradDType)
		}
		seen[key] = true
	}
	if g := p.GPU; g != nil {
		for _, x := range []struct {
			name string
			f    Fit
		}{{"update", g.Update}, {"h2d", g.H2D}, {"d2h", g.D2H}, {"h2d_duplex", g.H2DBoth}, {"d2h_duplex", g.D2HBoth}, {"convert", g.Convert}} {
			if !x.f.Valid() {
				return fmt.Errorf("perfmodel: GPU %s: invalid fit (rate %g, latency %g s, residual %g)", x.name, x.f.Rate, x.f.LatencyS, x.f.Residual)
			}
		}
		if !(g.HostMem >= 0 && g.HostMem < math.Inf(1)) {
			return fmt.Errorf("perfmodel: GPU profile host_mem_rate %v: want a rate >= 0 (bytes/s)", g.HostMem)
		}
		if c := g.Contention; c != (Contention{}) && !(c.CPU >= 1 && c.CPU <= 100 && c.PCIe >= 1 && c.PCIe <= 100) {
			return fmt.Errorf("perfmodel: GPU contention %+v: want slow-downs from 1 to 100", c)
		}
	}
	return nil
}

// Read reads and validates a Profile from path without asking where it
// was measured: for planning another machine (dos plan).
//
// Errors: the file unreadable, not a regular file or over 16 MiB, not a
// valid Profile (naming the path), another version.
func Read(path string) (*Profile, error) {
	// A regular file of at most maxProfile bytes: not a device, a pipe
	// or a directory.
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("perfmodel: %w", err)
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil {
		return nil, fmt.Errorf("perfmodel: %w", err)
	} else if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("perfmodel: %s is not a regular file", path)
	} else if st.Size() > maxProfile {
		return nil, fmt.Errorf("perfmodel: %s has %d bytes; a profile has at most %d", path, st.Size(), maxProfile)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxProfile+1))
	if err != nil {
		return nil, fmt.Errorf("perfmodel: %s: %w", path, err)
	}
	// The format and version first: another version may not even parse.
	var head struct {
		Format  string `json:"format"`
		Version int    `json:"version"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return nil, fmt.Errorf("perfmodel: %s: %w", path, err)
	}
	if head.Format != ProfileFormat || head.Version != ProfileVersion {
		hp := Profile{Format: head.Format, Version: head.Version}
		return nil, fmt.Errorf("%w (%s)", hp.Validate(), path)
	}
	var p Profile
	if err := json.Unmarshal(b, &p); err != nil {
		return nil, fmt.Errorf("perfmodel: %s: %w", path, err)
	}
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("%w (%s)", err, path)
	}
	return &p, nil
}

// Load reads and validates a Profile from path and checks that it was
// measured on here: its CPU model, and its GPU name when here names one.
// Rates of another machine would choose a wrong schedule.
//
// Errors: the file unreadable or not a valid Profile (naming the path),
// another version, another machine.
func Load(path string, here Machine) (*Profile, error) {
	p, err := Read(path)
	if err != nil {
		return nil, err
	}
	if p.Machine.CPU != here.CPU || (here.GPU != "" && p.Machine.GPU != here.GPU) || (here.Cores != 0 && p.Machine.Cores != here.Cores) {
		return nil, fmt.Errorf("perfmodel: %s was measured on another machine (%s; here %s): run dos calibrate here", path, p.Machine.describe(), here.describe())
	}
	if p.Machine.HostPages != "" && here.HostPages != "" && p.Machine.HostPages != here.HostPages {
		return nil, fmt.Errorf("perfmodel: %s was measured on %s pages of host memory, and the CPU workers update %s ones here (DOS_HUGE_PAGES, the kernel's transparent huge pages): run dos calibrate again", path, p.Machine.HostPages, here.HostPages)
	}
	return p, nil
}

// describe names m for a message: its CPU, its logical CPUs where known,
// its GPU or that it has none.
func (m Machine) describe() string {
	s := fmt.Sprintf("CPU %q", m.CPU)
	if m.Cores > 0 {
		s += fmt.Sprintf(", %d logical CPUs", m.Cores)
	}
	if m.GPU == "" {
		return s + ", no GPU"
	}
	return s + fmt.Sprintf(", GPU %q", m.GPU)
}

// maxProfile bounds a profile file's size in bytes (a real one has a few
// kilobytes).
const maxProfile = 16 << 20

// Here describes this machine's CPU for a Profile or for Load: the model
// name (klauspost/cpuid), the logical CPUs and the host memory's pages
// (cuda.HostPages). The caller adds the GPU's name, memory and driver
// when there is one.
func Here() Machine {
	return Machine{CPU: cpuid.CPU.BrandName, Cores: runtime.NumCPU(), HostPages: cuda.HostPages()}
}

// Scaled returns a copy of p in which resource r takes f[r] times the time
// p says (each of its fits' latency times f[r], rate over f[r]): the CPU
// update fits for ResCPU, the copies H2D (alone and duplex) for ResH2D,
// D2H for ResD2H, the fused update and the conversion for ResGPU. A
// resource missing from f, or with a factor that is not finite and > 0,
// keeps its fits. It is how measured update phases correct a profile
// (offload's Options.Replan). The fits' Points are shared with p.
func (p *Profile) Scaled(f map[Resource]float64) *Profile {
	q := *p
	scale := func(fit *Fit, r Resource) {
		x := f[r]
		if !(x > 0) || math.IsInf(x, 0) {
			return
		}
		fit.LatencyS *= x
		fit.Rate /= x
	}
	q.CPU = slices.Clone(p.CPU)
	for i := range q.CPU {
		scale(&q.CPU[i].Fit, ResCPU)
	}
	if p.GPU != nil {
		g := *p.GPU
		scale(&g.H2D, ResH2D)
		scale(&g.H2DBoth, ResH2D)
		scale(&g.D2H, ResD2H)
		scale(&g.D2HBoth, ResD2H)
		scale(&g.Update, ResGPU)
		scale(&g.Convert, ResGPU)
		q.GPU = &g
	}
	return &q
}
