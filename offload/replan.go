package offload

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// Options.Replan's constants. The choice between schedules is the
// performance model's (Deep Optimizer States, section 4) on the profile
// corrected per resource; only Plan's reported time carries g.
const (
	replanMiss  = 0.05 // a predicted update phase this far off the measured one refits
	replanGain  = 0.05 // a new schedule must be predicted this much faster to move state for it
	replanEvery = 3    // steps between refits that may re-plan
	replanNew   = 0.5  // the newest phase's weight in each resource's factor
	// replanMinShare: a resource predicted busy for less of the phase
	// than this tells too little of its rate to fold in (its latencies
	// and its place among the others dominate: gpt2-xl with no cap on an
	// H100, one CPU subgroup beside 31 resident ones, re-planned
	// to a phase predicted at 16.4 ms that gave the CPU 450M parameters
	// more, 73 ms of work at the profile's rate; it ran 90.6 ms)
	replanMinShare = 0.05
)

// replanState is Options.Replan's: the profile the model started from,
// its prediction of the schedule in use, and each resource's factor, the
// measured over the predicted busy time, weighted toward recent phases.
type replanState struct {
	base     *perfmodel.Profile
	w        perfmodel.Workload // the optimizer's, fixed from New
	basePred perfmodel.Prediction
	f        map[perfmodel.Resource]float64 // 0 until measured
	// g is the measured makespan over the corrected profile's prediction
	// of it, weighted as the factors: what the model's overlap of the
	// resources misses; it scales the predictions Plan reports (not the
	// choice, which it does not change).
	g    float64
	last int64 // the step of the last refit that could re-plan
	// seen is each schedule's measured update phase (seconds, weighted
	// as the factors): a schedule measured no faster than the one in use
	// is not chosen again, so corrections that trade places cannot make
	// the plan cycle.
	seen map[perfmodel.Schedule]float64
	// laneFit holds the schedules refit once for a lane's miss: under
	// contention the corrected model cannot match every lane (its factors
	// are fitted to the base prediction's busy times), so a lane's miss
	// refits a schedule once, and after that only a makespan miss does
	// (else it refit every replanEvery steps for good, at up to 0.24 s a
	// refit for 390 subgroups).
	laneFit map[perfmodel.Schedule]bool
	// warm: the first phase since the start (or a load) has been seen; it
	// is not folded in (cold caches and page faults, cuBLAS-free but not
	// cost-free).
	warm bool
	// iter, once Optimizer.PlanIteration has chosen the schedule for the
	// iteration, holds the refits to it: they correct its prediction and
	// move nothing. (A refit sees only phases that kept no speculative
	// update, a clipped or skipped step's, where the phase's best
	// schedule is not the iteration's: moving there and back would cost
	// two moves of the resident state for each clipped step.)
	iter *perfmodel.IterationWork
	// cpuSeen counts the speculating phases observeCPU folded in.
	cpuSeen int
}

// newReplanState starts Options.Replan from the model's plan of w on
// base at step.
func newReplanState(base *perfmodel.Profile, plan perfmodel.Prediction, w perfmodel.Workload, step int64) replanState {
	return replanState{base: base, w: w, basePred: plan, last: step, seen: map[perfmodel.Schedule]float64{}, laneFit: map[perfmodel.Schedule]bool{},
		f: map[perfmodel.Resource]float64{perfmodel.ResCPU: 0, perfmodel.ResH2D: 0, perfmodel.ResD2H: 0, perfmodel.ResGPU: 0}}
}

var resources = [...]perfmodel.Resource{perfmodel.ResCPU, perfmodel.ResH2D, perfmodel.ResD2H, perfmodel.ResGPU}

// refit measures the update phase just run and passes it to
// replanState.observe; when that chooses another schedule it re-plans the
// engine (Options.Replan). A phase that may have waited on a lazy
// checkpoint's capture (held) is reported but not observed: its time is
// the checkpoint's as much as the schedule's (on the H200, gpt2-xl, the
// phase after each 18.7 GB save took 2.0-2.3 s against 0.11 s, and folding
// it in made the next 100 predictions wrong). A phase that shared the GPU
// with the caller's work (shared: StepAsync's, beside the next forward)
// is observed without the GPU's busy time (replanState.observe). It
// allocates only when it refits. The caller holds o.mu.
func (o *Optimizer) refit(res *StepResult, held, shared bool) error {
	b, err := o.eng.Measure()
	if err != nil {
		return o.engineErr(err)
	}
	res.Predicted, res.Measured = seconds(o.plan.Makespan), b.Makespan
	if held {
		return nil // a capture's waits: not the phase the model predicts
	}
	if res.Speculated > 0 || res.SpeculatedGPU > 0 {
		// Updates done before the phase (Options.Speculate), which the
		// plan counts in it: not the phase the model predicts, but its
		// CPU lane ran the rest of the CPU's work (observeCPU).
		all := o.cpuParams()
		o.re.observeCPU(b, all, all-res.Speculated)
		return nil
	}
	next, basePred, err := o.re.observe(b, o.plan, o.step, shared)
	if err != nil || next == nil {
		return err
	}
	if next.Schedule != o.plan.Schedule {
		moved, err := o.moveTo(next.Schedule)
		if err != nil || !moved {
			return err
		}
		o.re.basePred = basePred
		res.Replanned = true
	}
	o.plan = next
	return nil
}

// moveTo re-plans the engine to schedule s (scheduler.Engine.Replan: the
// resident state downloaded, the new resident state uploaded) and reports
// whether it moved: a plan whose memory could not be had (a cap,
// fragments) leaves the engine on the old plan, synced, and with
// Options.Replan that schedule is not tried again. The caller holds o.mu,
// between phases.
func (o *Optimizer) moveTo(s perfmodel.Schedule) (bool, error) {
	plan, err := scheduler.NewHeldPlanIn(o.held(), s, o.residentLayout())
	if err != nil {
		return false, fmt.Errorf("offload: re-planning: %w", err)
	}
	// Replan writes the resident subgroups' host state: a lazy
	// checkpoint's capture must be done with it first.
	o.pending.waitCapture()
	if err := o.eng.Replan(plan); errors.Is(err, scheduler.ErrReplanRefused) {
		o.dev = devSynced
		if o.opts.Replan {
			o.re.seen[s] = math.Inf(1)
		}
		return false, nil
	} else if err != nil {
		return false, o.engineErr(err)
	}
	o.dev = devSynced // the resident state downloaded, the new one uploaded
	return true, nil
}

// PlanIteration chooses the update phase's schedule for the whole
// training iteration it (perfmodel.Profile.ChooseIteration, with the
// optimizer's speculation and layout: Optimizer.PredictIteration's) and
// re-plans the engine to it when that iteration is predicted replanGain
// (5 %) faster than the plan in use's; with Options.Replan the later
// refits then keep that schedule (issue 31 item 3: the schedule is the
// iteration's, not the phase's alone). The speculation counts only once a
// phase has kept some of its updates, at the rate they ran (specRate):
// before that, and in a run whose every step clips, the iteration's best
// schedule is the phase's. It needs Options.Device and a profile, and
// moves nothing under a forced Options.Schedule (it sets the leave below
// only), nor while the host state is
// ahead of the device's (after SetParam or a load: the next Step uploads
// it). Call it after a Step or WaitStep and before the next backward (it
// waits for a phase StepAsync began; between GradsFinal and Step it would
// throw that step's speculation away). It returns whether the schedule
// changed. With speculation it also sets, from its forward, what the
// speculation leaves to the phase (SpeculateLeave), whether or not the
// schedule changed.
//
// Errors: a closed optimizer, a device fault before (the state must be
// loaded again), the model's, the device's while it moves the resident
// state (the optimizer is then broken, as after a failed Step).
func (o *Optimizer) PlanIteration(it IterationWork) (changed bool, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case o.pool == nil:
		return false, ErrClosed
	case o.eng == nil || o.opts.Profile == nil || o.plan == nil:
		return false, nil
	case o.dev == devBroken:
		return false, errors.New("offload: PlanIteration: a device fault left the state inconsistent; LoadCheckpoint restores it")
	case o.dev == devHostAhead:
		// SetParam or a load wrote the host state the device has not
		// seen: a move now would download the device's over it. The
		// next Step uploads it; plan after that.
		return false, nil
	}
	it = o.iterationWork(it)
	o.specLeave = o.speculateLeave(it)
	o.eng.SetSpeculateLeave(o.specLeave)
	if o.opts.Schedule != nil {
		return false, nil // forced: the leave only
	}
	prof := o.opts.Profile
	if o.opts.Replan {
		prof = o.re.base.Scaled(o.re.f)
	}
	w := o.workload()
	now, err := prof.PredictIteration(w, o.plan.Schedule, it)
	if err != nil {
		return false, fmt.Errorf("offload: PlanIteration: %w", err)
	}
	best, err := prof.ChooseIteration(w, it)
	if err != nil {
		return false, fmt.Errorf("offload: PlanIteration: %w", err)
	}
	if o.opts.Replan && it.SpeculateParams > 0 {
		o.re.iter = &it
	}
	if best.Phase.Schedule == o.plan.Schedule || best.Seconds >= (1-replanGain)*now.Seconds {
		return false, nil
	}
	moved, err := o.moveTo(best.Phase.Schedule)
	if err != nil || !moved {
		return false, err
	}
	next := best.Phase
	if o.opts.Replan {
		if next, o.re.basePred, err = o.re.corrected(next.Schedule); err != nil {
			return true, err
		}
	}
	o.plan = &next
	return true, nil
}

// observeCPU folds the CPU's factor alone from a phase b that kept
// speculative updates: the CPU lane updated left of the all parameters
// the plan gives it (its CPU subgroups and the host-held ones), so its
// predicted busy time is basePred's scaled by left/all (the per-subgroup
// latencies, microseconds, aside). The other lanes' work is not the
// plan's (a kept subgroup's copies ran in the backward), and nothing is
// re-planned (Optimizer.PlanIteration plans such a run). Without the
// factor Optimizer.PlanIteration chose the schedule for 4.24B under 40
// GiB on an H100 at the profile's CPU rate, 6.13 Gparam/s, where the
// phase's CPU ran at 4.3 (BENCHMARKS.md, issue 31). The first phase is
// left out, as observe leaves it; one beside the caller's forward is not
// (the CPU's rate reads no GPU time).
func (re *replanState) observeCPU(b scheduler.Busy, all, left int64) {
	if !re.warm {
		re.warm = true
		return
	}
	p, m := re.basePred.Busy[perfmodel.ResCPU], b.CPU.Seconds()
	if !(p > 0) || !(m > 0) || all <= 0 || left <= 0 || left > all {
		return
	}
	if p *= float64(left) / float64(all); p < replanMinShare*re.basePred.Makespan {
		return // too little left to tell the rate (observe's rule)
	}
	re.f[perfmodel.ResCPU] = weigh(re.f[perfmodel.ResCPU], m/p)
	re.cpuSeen++
}

// weigh folds the newest measurement y into the running value x, y
// itself when x is not set yet (0): each factor, seen phase and the
// makespan's correction, weighted toward recent phases by replanNew.
func weigh(x, y float64) float64 {
	if x > 0 {
		return (1-replanNew)*x + replanNew*y
	}
	return y
}

// observe folds one measured update phase b of the schedule that cur
// predicts into the factors (all but the first phase since the start or a
// load) and, when cur missed it by more than replanMiss of the measured
// makespan (its makespan, or once per schedule any resource's busy time:
// predictionMiss, laneFit) and the last refit was replanEvery steps
// before step, refits:
// it returns the corrected prediction to plan with next (cur's schedule
// unless another is predicted replanGain faster, then that one, with the
// base profile's prediction of it); nil when nothing changes. With
// gpuShared (the caller's kernels ran beside the phase's: StepAsync and
// the next forward) the GPU's factor is left as it was: its kernels'
// busy time then counts the forward's share of the SMs, and folding it in
// made the GPU look slow (gpt2-xl on an H100 with no cap, all but one
// subgroup resident: a 23.1 ms phase against 14.4 predicted moved 9
// subgroups to the CPU, whose phase then ran 90.6 ms, and back, at about
// 0.8 s a move).
func (re *replanState) observe(b scheduler.Busy, cur *perfmodel.Prediction, step int64, gpuShared bool) (next *perfmodel.Prediction, basePred perfmodel.Prediction, err error) {
	if !re.warm {
		re.warm = true
		return nil, basePred, nil
	}
	for _, r := range resources {
		if gpuShared && r == perfmodel.ResGPU {
			continue
		}
		p, m := re.basePred.Busy[r], b.Of(r).Seconds()
		if !(p > 0) || !(m > 0) || p < replanMinShare*re.basePred.Makespan {
			continue
		}
		re.f[r] = weigh(re.f[r], m/p)
	}
	measured := b.Makespan.Seconds()
	if measured > 0 {
		re.seen[cur.Schedule] = weigh(re.seen[cur.Schedule], measured) // allocates once per schedule
	}
	if !(measured > 0) || (step > re.last && step-re.last < replanEvery) {
		return nil, basePred, nil
	}
	if back, ok := re.fasterSeen(cur.Schedule); ok {
		// A schedule already run was measured faster than the one in
		// use by replanGain: a refit moved on a prediction the machine
		// did not keep (on an H100, 4.24B under 40 GiB: 33/27/25 ran
		// 605 ms, the refit moved to 58/0/27 predicted at 590 and it
		// ran 700). Go back to what was measured.
		re.last = step
		p, basePred, err := re.corrected(back)
		if err != nil {
			return nil, basePred, err
		}
		return &p, basePred, nil
	}
	lanes := false // the refit is for a lane's miss alone
	if math.Abs(cur.Makespan-measured) <= replanMiss*measured {
		if re.laneFit[cur.Schedule] || predictionMiss(cur, b) <= replanMiss*measured {
			return nil, basePred, nil
		}
		lanes = true
	}
	re.last = step
	if lanes {
		re.laneFit[cur.Schedule] = true // allocates once per schedule
	}
	w := re.w
	scaled := re.base.Scaled(re.f)
	now, err := scaled.Predict(w, cur.Schedule)
	if err != nil {
		return nil, basePred, fmt.Errorf("offload: re-planning: %w", err)
	}
	best, err := scaled.Choose(w)
	if err != nil {
		return nil, basePred, fmt.Errorf("offload: re-planning: %w", err)
	}
	if now.Makespan > 0 {
		re.g = weigh(re.g, measured/now.Makespan)
		now.Makespan *= re.g
		best.Makespan *= re.g
	}
	if m, ok := re.seen[best.Schedule]; re.iter != nil || best.Schedule == now.Schedule || best.Makespan >= (1-replanGain)*now.Makespan ||
		(ok && m > (1-replanGain)*re.seen[cur.Schedule]) {
		return &now, basePred, nil // the same schedule (or one already measured no faster), its corrected prediction
	}
	if basePred, err = re.base.Predict(w, best.Schedule); err != nil {
		return nil, basePred, fmt.Errorf("offload: re-planning: %w", err)
	}
	return &best, basePred, nil
}

// fasterSeen returns the schedule measured fastest (seen) when it is not
// cur and cur's measured phase is over it by more than replanGain; not
// once the schedule is the iteration's (iter: its phase is longer by
// design).
func (re *replanState) fasterSeen(cur perfmodel.Schedule) (perfmodel.Schedule, bool) {
	m, ok := re.seen[cur]
	if !ok || re.iter != nil {
		return perfmodel.Schedule{}, false
	}
	var best perfmodel.Schedule
	bt := math.Inf(1)
	for s, t := range re.seen {
		if t < bt || t == bt && scheduleLess(s, best) { // ties: a fixed order, not the map's
			best, bt = s, t
		}
	}
	if best == cur || !(m > (1+replanGain)*bt) {
		return perfmodel.Schedule{}, false
	}
	return best, true
}

// scheduleLess orders schedules by their CPU, streamed and resident
// counts, then the upcast.
func scheduleLess(a, b perfmodel.Schedule) bool {
	switch {
	case a.CPU != b.CPU:
		return a.CPU < b.CPU
	case a.GPU != b.GPU:
		return a.GPU < b.GPU
	case a.Resident != b.Resident:
		return a.Resident < b.Resident
	}
	return !a.UpcastOnGPU && b.UpcastOnGPU
}

// corrected returns the refit's prediction of schedule s (the profile
// corrected per resource, its makespan scaled by g) and the base
// profile's, which the next refit's factors are measured against.
func (re *replanState) corrected(s perfmodel.Schedule) (p, base perfmodel.Prediction, err error) {
	if p, err = re.base.Scaled(re.f).Predict(re.w, s); err != nil {
		return p, base, fmt.Errorf("offload: re-planning: %w", err)
	}
	if re.g > 0 {
		p.Makespan *= re.g
	}
	if base, err = re.base.Predict(re.w, s); err != nil {
		return p, base, fmt.Errorf("offload: re-planning: %w", err)
	}
	return p, base, nil
}

// predictionMiss is how far p missed the measured phase b, in seconds:
// the largest of its error on the makespan and on each resource's busy
// time. A prediction can hit the makespan while it misses the lanes (on
// the H200, gpt2-xl at 12 GiB: predicted 237.3 ms with the CPU the
// bottleneck, measured 234.3 ms, while the CPU lane finished 37 ms before
// the streamed lane, whose copies ran slower beside the workers than the
// calibration said): the schedule is then unbalanced although its
// makespan was foreseen, and only a refit per resource rebalances it.
func predictionMiss(p *perfmodel.Prediction, b scheduler.Busy) float64 {
	miss := math.Abs(p.Makespan - b.Makespan.Seconds())
	for _, r := range resources {
		if x, ok := p.Busy[r]; ok {
			miss = max(miss, math.Abs(x-b.Of(r).Seconds()))
		}
	}
	return miss
}

// seconds converts float seconds to a Duration.
func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
