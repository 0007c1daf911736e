package perfmodel

import (
	"errors"
	"fmt"
	"math"
)

// IterationWork is a training iteration's work besides its update phase,
// as PredictIteration takes it: the forward's and the backward's times on
// the GPU, each measured alone (recomputation and the streamed blocks'
// copies included: they are part of the compute the trainer times), and
// what overlaps the phase with them.
type IterationWork struct {
	Forward  float64 // seconds of one forward, alone
	Backward float64 // seconds of one backward, alone
	// Blocks is the model's transformer blocks, >= 1: an overlapped
	// forward runs block by block behind the phase, so at least the last
	// block's forward (Forward/Blocks) runs after the phase's last update
	// (without ResidentFirst, the resident suffix's share of it).
	Blocks int
	// OverlapForward: the next iteration's forward runs during the update
	// phase, each block once its weights are written (issue 31 item 2;
	// trainer: the default).
	OverlapForward bool
	// SpeculateParams is the parameters the CPU workers may update
	// speculatively during the backward (offload.Options.Speculate over
	// scheduler.SpeculateBytes' bytes a parameter; 0: none). Only the
	// host-held subgroups and, with Workload.Prefetch and no upcast on
	// the GPU, the CPU subgroups are speculated on; the prediction is that of an
	// iteration that keeps them (no clipping, no skip).
	SpeculateParams int64
	// SpeculateRate is the parameters a second the CPU workers speculate
	// on during the backward, measured (offload: the last phase's kept
	// speculative updates over their span; the backward's compute and
	// gradient copies share the host with them); 0: the CPU's fitted
	// rate at the workload's Threads, slowed by the profile's contention
	// (Contention.CPU: the backward's copies run beside it).
	SpeculateRate float64
	// ResidentFirst: the resident subgroups lead the flat space
	// (scheduler.Layout.ResidentFirst), so the speculation may start with
	// the backward; else they are its suffix, the last blocks, whose
	// backward runs first, and the speculation starts once the backward
	// has gone through their share of the parameters.
	ResidentFirst bool
}

// IterationPrediction is PredictIteration's whole iteration, in seconds.
type IterationPrediction struct {
	Phase Prediction // the update phase alone (Predict)
	// Speculated is the CPU workers' update work done during the
	// backward, in the phase's CPU seconds: the share of the CPU's busy
	// time in the phase of the parameters speculated on, the least of
	// SpeculateParams, the speculable ones and what SpeculateRate
	// updates in the backward after the resident share
	// (IterationWork.ResidentFirst).
	Speculated float64
	// SpeculateRate is the parameters a second Speculated was predicted
	// at (IterationWork.SpeculateRate, or the CPU's contended rate); 0
	// without speculation.
	SpeculateRate float64
	// After is the phase once the backward ends: with the CPU the
	// phase's bottleneck, the phase less Speculated, no less than its
	// other resources' busy time (and the CPU's fill and drain); else the
	// phase.
	After float64
	// Seconds is the iteration: forward, backward and After one after the
	// other, or with OverlapForward the backward, then the phase with the
	// next forward beside it (the longer of After plus the forward of
	// what follows the phase's last update, and the forward: the last
	// block with ResidentFirst, else the resident suffix, at least the
	// last block), no less than the GPU's forward, backward and phase
	// kernels one after the other.
	Seconds float64
	// Serial is the iteration with nothing overlapped: forward, backward
	// and the whole phase.
	Serial float64
}

// PredictIteration predicts one training iteration of w under schedule s
// and it (issue 31 item 3: the prediction, beside IterationBound's bound).
// The model: the phase as Predict has it; speculation takes the share of
// the CPU workers' time that the parameters it updates in the backward
// (Speculated) are of theirs out of the phase; the overlapped
// forward runs beside the rest. It leaves out the contention of the
// overlapped forward with the phase's copies and kernels (both run on the
// same GPU and PCIe link): a measured iteration over it by a few percent
// is that contention.
//
// Errors: Predict's; negative or non-finite times, Blocks < 1,
// SpeculateParams or SpeculateRate < 0.
func (p *Profile) PredictIteration(w Workload, s Schedule, it IterationWork) (IterationPrediction, error) {
	switch {
	case !(it.Forward >= 0) || !(it.Backward >= 0) || math.IsInf(it.Forward+it.Backward, 0):
		return IterationPrediction{}, fmt.Errorf("perfmodel: PredictIteration: forward %v s and backward %v s: want finite times >= 0", it.Forward, it.Backward)
	case it.Blocks < 1:
		return IterationPrediction{}, fmt.Errorf("perfmodel: PredictIteration: %d blocks: want >= 1", it.Blocks)
	case it.SpeculateParams < 0:
		return IterationPrediction{}, errors.New("perfmodel: PredictIteration: SpeculateParams must be >= 0")
	case !(it.SpeculateRate >= 0) || math.IsInf(it.SpeculateRate, 0):
		return IterationPrediction{}, fmt.Errorf("perfmodel: PredictIteration: SpeculateRate %v: want parameters a second >= 0", it.SpeculateRate)
	}
	ph, err := p.Predict(w, s)
	if err != nil {
		return IterationPrediction{}, err
	}
	return p.iteration(w, ph, it)
}

// iteration is PredictIteration's model for the phase ph of a valid w and
// it.
func (p *Profile) iteration(w Workload, ph Prediction, it IterationWork) (IterationPrediction, error) {
	s := ph.Schedule
	r := IterationPrediction{Phase: ph, After: ph.Makespan}
	// The resident subgroups' share of the parameters when they are the
	// flat space's suffix (the last blocks), else 0: the share of the
	// backward before the first speculable gradient, and of the
	// overlapped forward that waits for the phase's last update.
	suffix := 0.0
	if !it.ResidentFirst && s.Resident > 0 {
		sizes := w.Sizes
		if sizes == nil {
			sizes = SubgroupSizes(w.Params, w.SubgroupSize)
		}
		var res int64
		for _, n := range sizes[len(sizes)-min(s.Resident, len(sizes)):] {
			res += n
		}
		suffix = float64(res) / float64(w.Params+w.HostHeld)
	}
	if all, m := speculable(w, s); it.SpeculateParams > 0 && m > 0 {
		after := suffix
		rate := it.SpeculateRate
		if rate == 0 {
			cf, err := p.cpuFit(w.Threads, w.GradDType) // speculated gradients are never upcast
			if err != nil {
				return IterationPrediction{}, err
			}
			// The backward's gradient copies (and a streamed block's
			// weights) run beside the speculation: the CPU's rate as
			// the calibration's contention slows it (on an H100 host
			// 6.49/1.28 = 5.07 Gparam/s, where dos train measured 4.67
			// at 4.24B under 40 GiB).
			rate = cf.Fit.Rate
			if p.GPU != nil {
				rate /= max(1, p.GPU.Contention.CPU)
			}
		}
		hidden := min(float64(it.SpeculateParams), m, rate*it.Backward*(1-after))
		r.Speculated, r.SpeculateRate = hidden/all*ph.Busy[ResCPU], rate
		if ph.Bottleneck == ResCPU { // else less CPU work shortens nothing
			rest := ph.Fill + ph.Drain // what the CPU's work never hid
			for _, res := range Resources {
				if res != ResCPU {
					rest = max(rest, ph.Busy[res])
				}
			}
			r.After = max(ph.Makespan-r.Speculated, rest)
		}
	}
	r.Serial = it.Forward + it.Backward + ph.Makespan
	r.Seconds = it.Forward + it.Backward + r.After
	if it.OverlapForward {
		// The forward follows the phase block by block: what comes after
		// the phase's last update runs after the phase: the last block,
		// or, when the resident subgroups are the suffix, that whole
		// suffix (their updates are done first, but the forward reaches
		// them only after the blocks the CPU and the copies update; measured
		// on gpt2-xl under 24 GiB, 46 of 63 subgroups resident: 322.7 ms
		// an iteration, the serial 323.1). The phase's kernels and the
		// forward share the GPU: never less than the three one after
		// the other.
		tail := max(1/float64(it.Blocks), suffix)
		r.Seconds = max(it.Backward+max(r.After+tail*it.Forward, it.Forward), it.Forward+it.Backward+ph.Busy[ResGPU])
	}
	return r, nil
}

// speculable returns the parameters the CPU workers update under s (the
// host-held ones and the CPU subgroups', the mean subgroup's size each)
// and of those the ones the speculation may take: the host-held ones and,
// when their gradients reach the host before the phase (Workload.Prefetch
// without the upcast on the GPU: scheduler.Engine.Speculate takes those),
// the CPU subgroups'.
func speculable(w Workload, s Schedule) (all, m float64) {
	cpu := 0.0
	if k := w.Subgroups(); k > 0 {
		cpu = float64(w.Params) / float64(k) * float64(s.CPU)
	}
	all, m = float64(w.HostHeld)+cpu, float64(w.HostHeld)
	if w.Prefetch && !s.UpcastOnGPU {
		m += cpu
	}
	return all, m
}

// ChooseIteration returns the schedule of w whose whole iteration it
// (PredictIteration) is the shortest, with its phase and iteration
// predictions: issue 31's schedule chosen for the iteration, not for the
// update phase alone. Without speculation, and with the overlapped
// forward only behind the last block (ResidentFirst) or not at all, it is
// Choose's schedule (the iteration is the phase plus the same times);
// with speculation the CPU's share may grow by what the backward hides,
// and with the resident subgroups last the forward of their suffix
// follows the phase, so fewer of them may be faster. It searches the
// residencies the budget allows and the CPU counts at each, with and
// without the upcast: every pair up to 64 subgroups, else a grid of about
// 64 a side, then every pair within a grid step of the grid's best. Ties
// keep Choose's.
//
// Errors: Choose's and PredictIteration's.
func (p *Profile) ChooseIteration(w Workload, it IterationWork) (IterationPrediction, error) {
	best, err := p.Choose(w)
	if err != nil {
		return IterationPrediction{}, err
	}
	bi, err := p.PredictIteration(w, best.Schedule, it)
	if err != nil || it.SpeculateParams == 0 && (!it.OverlapForward || it.ResidentFirst) {
		return bi, err
	}
	n := w.Subgroups()
	rmax := -1
	for r := range w.residencies() {
		rmax = r
	}
	try := func(r, c int, upcast bool) error {
		s := Schedule{CPU: c, GPU: n - r - c, Resident: r, UpcastOnGPU: upcast}
		if r < 0 || r > rmax || c < 0 || s.GPU < 0 || p.GPU == nil && (s.GPU > 0 || s.Resident > 0 || upcast) || w.gpuMemory(s) > float64(w.GPUBudget) {
			return nil
		}
		ph, err := p.predict(w, s)
		if err != nil {
			return nil // as Choose: a rate the profile lacks (the upcast's fp32)
		}
		x, err := p.iteration(w, ph, it)
		if err != nil {
			return err
		}
		if x.Seconds < bi.Seconds*(1-1e-9) {
			bi = x
		}
		return nil
	}
	const side = 64
	step := max(1, (n+side)/side) // a grid step: 1 (every pair) up to 63 subgroups
	for _, upcast := range []bool{false, true} {
		for r := 0; r <= rmax; r += step {
			for c := 0; c <= n-r; c += step {
				if err := try(r, c, upcast); err != nil {
					return IterationPrediction{}, err
				}
			}
		}
	}
	if step > 1 {
		s := bi.Phase.Schedule
		for r := s.Resident - step; r <= s.Resident+step; r++ {
			for c := s.CPU - step; c <= s.CPU+step; c++ {
				if err := try(r, c, s.UpcastOnGPU); err != nil {
					return IterationPrediction{}, err
				}
			}
		}
	}
	return bi, nil
}
