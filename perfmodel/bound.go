package perfmodel

import (
	"errors"
	"math"

	"github.com/deepstates/dos/adam"
)

// Bound is a lower bound on an update phase: what no schedule and no
// engine can beat on the machine a profile measured (issue 31: the
// prediction, Predict and Limit, and the bound are kept apart).
type Bound struct {
	// Seconds is the bound: over every split of the subgroups between the
	// CPU workers, the streamed GPU lane and residency (the CPU's share a
	// real number), the least of the largest per-resource time in Busy.
	Seconds float64
	// Bottleneck is the resource whose time is Seconds at the best split.
	Bottleneck Resource
	// Busy is each resource's time at that split, in seconds: the CPU
	// workers' updates, each PCIe direction's bytes, both directions'
	// bytes together (ResPCIe), the GPU's kernels, the host memory's bytes
	// (ResHostMem; 0 where the profile has no HostMem).
	Busy map[Resource]float64
	// CPU, GPU and Resident are the split, in subgroups (CPU and GPU may
	// be fractional), and UpcastOnGPU whether its CPU gradients widen on
	// the GPU.
	CPU, GPU, Resident float64
	UpcastOnGPU        bool
}

// ResPCIe is Bound's resource for both PCIe directions together: their
// bytes at the best rate the link moved them at, one direction alone or
// both at once.
const ResPCIe Resource = "pcie"

// ResHostMem is Bound's resource for the host memory, which the CPU
// workers' updates and both PCIe directions' copies share: their bytes at
// its peak rate (GPUProfile.HostMem).
const ResHostMem Resource = "host-memory"

// Bound returns a lower bound on w's update phase under p. Each resource
// does its work at the rate p measured for it alone, with no latency, no
// fill or drain and no contention: the CPU workers' updates (w.Threads of
// them; the host-held subgroups' too) at the CPU's fitted rate; the bytes
// of each PCIe direction at that lane's rate alone; both directions' bytes
// together at the fastest of the two alone and of the duplex pair's sum;
// the fused kernels (and the upcast) at the GPU's rates; and, where the
// profile measured the host memory's peak (GPUProfile.HostMem), the bytes
// that pass through it: each CPU update's (the state read and written, the
// gradient read, the 16-bit copy written) and every PCIe copy's. The work moved
// before the phase by Workload.Prefetch is left out as the model leaves it
// out. The bound is the least, over every split (the CPU's share of the
// non-resident subgroups a real number, the resident ones within the GPU
// budget, with and without the upcast), of the largest of those times. An
// engine measured under it means the profile's rates are wrong, not that
// the engine is fast: Limit, by contrast, is a prediction (it counts the
// contention the calibration measured) and was beaten. It bounds a phase
// that does all of w's work: one whose speculative updates were kept
// (scheduler.Engine.Speculate) did part of it during the backward.
//
// Errors: a nil profile, a bad workload, no CPU rate for the threads and
// dtype.
func (p *Profile) Bound(w Workload) (Bound, error) { return p.bound(w, Iteration{}) }

// Iteration is what a training iteration does besides its update phase,
// for IterationBound: the GPU's forward and backward, in seconds (measured:
// the model's compute), and the bytes its streamed weights move (each
// block slot's H2D before its forward and again before its backward, its
// gradients' D2H).
type Iteration struct {
	Compute  float64 // seconds of forward and backward on the GPU
	H2DBytes float64 // bytes host to device outside the update phase
	D2HBytes float64 // bytes device to host outside the update phase
}

// IterationBound returns a lower bound on a whole iteration of w's
// optimizer and it: Bound's, with the iteration's forward and backward
// added to the GPU's time (the update's kernels run on the same GPU) and
// its copies to the PCIe lanes' bytes. The CPU's work may hide behind the
// compute (the speculation, the overlap with backward), so the bound is
// the largest resource's time, not a sum: what an iteration with every
// overlap the exact step allows could reach (issue 31's whole-iteration
// bound). The work Workload.Prefetch moves before the phase counts here.
// Errors: Bound's; a negative field of it.
func (p *Profile) IterationBound(w Workload, it Iteration) (Bound, error) {
	if !(it.Compute >= 0 && it.H2DBytes >= 0 && it.D2HBytes >= 0) {
		return Bound{}, errors.New("perfmodel: IterationBound: the iteration's compute and bytes must be >= 0")
	}
	w.Prefetch = false // what the prefetch moves before the phase is the iteration's work all the same
	return p.bound(w, it)
}

func (p *Profile) bound(w Workload, it Iteration) (Bound, error) {
	if p == nil {
		return Bound{}, errors.New("perfmodel: nil profile")
	}
	if err := w.Validate(); err != nil {
		return Bound{}, err
	}
	n := w.Subgroups()
	best := Bound{Seconds: math.Inf(1)}
	if p.GPU == nil {
		b, err := p.boundAt(w, it, false, float64(n), 0, 0)
		if err != nil {
			return Bound{}, err
		}
		return b, nil
	}
	budget := float64(w.GPUBudget)
	// The upcast needs the CPU's fp32 rate, which a profile measured for
	// one 16-bit dtype (the trainer's start-up calibration) lacks: then
	// no schedule upcasts (Choose skips them too).
	_, err := p.cpuFit(w.Threads, adam.F32)
	f32 := err == nil
	for r, streams := range w.residencies() {
		N := float64(n - r)
		for _, upcast := range []bool{false, true} {
			if upcast && (N == 0 || w.gpuMemory(Schedule{Resident: r, CPU: 1, UpcastOnGPU: true}) > budget || !f32) {
				continue
			}
			at := func(c float64) (Bound, error) { return p.boundAt(w, it, upcast, c, N-c, float64(r)) }
			if !streams {
				b, err := at(N)
				if err != nil {
					return Bound{}, err
				}
				if b.Seconds < best.Seconds {
					best = b
				}
				continue
			}
			// Each time is linear in the CPU's share c, so their maximum is
			// convex: a ternary search finds its least.
			lo, hi := 0.0, N
			for range 100 {
				m1, m2 := lo+(hi-lo)/3, hi-(hi-lo)/3
				b1, err := at(m1)
				if err != nil {
					return Bound{}, err
				}
				b2, err := at(m2)
				if err != nil {
					return Bound{}, err
				}
				if b1.Seconds <= b2.Seconds {
					hi = m2
				} else {
					lo = m1
				}
			}
			for _, c := range []float64{0, N, (lo + hi) / 2} {
				b, err := at(c)
				if err != nil {
					return Bound{}, err
				}
				if b.Seconds < best.Seconds {
					best = b
				}
			}
		}
	}
	return best, nil
}

// boundAt is Bound's times for c CPU, gp streamed and r resident
// subgroups of the mean size, with it's work added.
func (p *Profile) boundAt(w Workload, it Iteration, upcast bool, c, gp, r float64) (Bound, error) {
	gb, err := gradBytes(w.GradDType)
	if err != nil {
		return Bound{}, err
	}
	n := float64(w.Subgroups())
	sz := 0.0
	if n > 0 {
		sz = float64(w.Params) / n
	}
	st := w.stateBytes() * sz
	cpuDType, down := w.GradDType, gb*sz
	if upcast && gb == 2 {
		cpuDType, down = adam.F32, 4*sz
	}
	rate := func(d adam.DType) (float64, error) {
		f, err := p.cpuFit(w.Threads, d)
		return f.Rate, err
	}
	uc, err := rate(cpuDType)
	if err != nil {
		return Bound{}, err
	}
	tCPU := c * sz / uc
	if w.HostHeld > 0 {
		uh, err := rate(w.GradDType) // never upcast
		if err != nil {
			return Bound{}, err
		}
		tCPU += float64(w.HostHeld) / uh
	}
	b := Bound{Busy: map[Resource]float64{ResCPU: tCPU, ResH2D: 0, ResD2H: 0, ResPCIe: 0, ResGPU: it.Compute, ResHostMem: 0}, CPU: c, GPU: gp, Resident: r, UpcastOnGPU: upcast}
	if g := p.GPU; g != nil {
		preGrad := w.Prefetch && !(upcast && gb == 2)
		preState := 0.0
		if w.Prefetch {
			preState = min(gp, 2)
		}
		up := (gp-preState)*st + c*float64(w.CopyBytes)*sz + it.H2DBytes
		dn := gp*st + it.D2HBytes
		if !preGrad {
			dn += c * down
		}
		both := max(g.H2D.Rate, g.D2H.Rate, g.H2DBoth.Rate+g.D2HBoth.Rate)
		b.Busy[ResH2D], b.Busy[ResD2H], b.Busy[ResPCIe] = up/g.H2D.Rate, dn/g.D2H.Rate, (up+dn)/both
		if g.HostMem > 0 {
			// The CPU's updates: the state read and written, the
			// gradient (as the CPU reads it) and the copy.
			cb, _ := gradBytes(cpuDType)
			hb := c * sz * (2*w.stateBytes() + cb + float64(w.CopyBytes))
			hb += float64(w.HostHeld) * (2*w.stateBytes() + gb + float64(w.CopyBytes))
			b.Busy[ResHostMem] = (hb + up + dn) / g.HostMem
		}
		b.Busy[ResGPU] += (gp + r) * sz / g.Update.Rate
		if upcast && gb == 2 {
			b.Busy[ResGPU] += c * sz / g.Convert.Rate
		}
	}
	for _, res := range []Resource{ResCPU, ResH2D, ResD2H, ResPCIe, ResGPU, ResHostMem} {
		if b.Busy[res] > b.Seconds {
			b.Seconds, b.Bottleneck = b.Busy[res], res
		}
	}
	return b, nil
}
