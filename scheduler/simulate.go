package scheduler

import (
	"container/heap"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// Machine is what Simulate needs to know of the machine: its measured
// rates (a Profile with GPU rates) and the CPU workers of the rank.
type Machine struct {
	Profile *perfmodel.Profile
	Threads int // CPU workers, >= 1
}

// SimWorkload is the update phase Simulate replays: the subgroups'
// lengths in parameters and the dtypes' sizes.
type SimWorkload struct {
	Sizes     []int64    // parameters per subgroup, > 0 each
	GradDType adam.DType // adam.F32, BF16 or F16: the gradient on the device
	AMSGrad   bool       // 16 B/param of state instead of 12
	// HostHeld marks host-held subgroups (nil, or one per subgroup:
	// Options.HostHeld): the CPU workers update them first, with no
	// copy; the plan places them as NewHeldPlan does.
	HostHeld []bool
}

// Simulate replays Engine.Update's schedule for plan in virtual time, with
// no memory and no math: the timing half of the simulated device, for
// sizes and machines one does not have (dos plan). It follows the engine's
// policy operation by operation: the GPU lane's state H2D into two slots
// (each after the slot's previous state left), the kernel, the state D2H,
// copies in CopyChunk pieces at most two deep on one stream per direction
// served in the order enqueued; the CPU lane's gradient D2H into two host
// slots, the update on the workers, the copy's H2D. Durations come from
// the profile's fits; the two PCIe directions run at their both-at-once
// rates while both carry copies, and the CPU workers and the copies slow
// each other down by the profile's contention while both run (a fluid
// model: rates change as operations start and end).
//
// Errors: a profile without GPU rates or without a CPU rate for the
// threads and dtype, sizes that do not match the plan, a bad dtype.
func Simulate(m Machine, w SimWorkload, plan *Plan) ([]Op, error) {
	p := m.Profile
	if p == nil || p.GPU == nil {
		return nil, errors.New("scheduler: Simulate needs a profile with GPU rates")
	}
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("scheduler: Simulate: %w", err)
	}
	if len(w.Sizes) == 0 || plan == nil || len(plan.Roles) != len(w.Sizes) {
		return nil, fmt.Errorf("scheduler: Simulate: the plan must place the %d subgroups (at least one)", len(w.Sizes))
	}
	for i, n := range w.Sizes {
		if n <= 0 || n > maxElems {
			return nil, fmt.Errorf("scheduler: Simulate: subgroup %d has %d parameters: want 1 to %d", i, n, int64(maxElems))
		}
	}
	var gb float64
	switch w.GradDType {
	case adam.F32, adam.BF16, adam.F16:
		gb = float64(w.GradDType.Size())
	default:
		return nil, fmt.Errorf("scheduler: Simulate: gradient dtype %v: want float32, bfloat16 or float16", w.GradDType)
	}
	cpuDType := w.GradDType // what the CPU workers read: fp32 after the upcast
	if plan.Schedule.UpcastOnGPU && gb == 2 {
		cpuDType = adam.F32
	}
	uc, err := p.CPURate(max(1, m.Threads), cpuDType)
	if err != nil {
		return nil, err
	}
	arrays := 3
	if w.AMSGrad {
		arrays = 4
	}
	held := w.HostHeld
	switch {
	case held == nil:
		held = make([]bool, len(w.Sizes))
	case len(held) != len(w.Sizes):
		return nil, fmt.Errorf("scheduler: Simulate: HostHeld has %d entries for %d subgroups", len(held), len(w.Sizes))
	}
	if err := heldPlanErr(held, plan); err != nil {
		return nil, fmt.Errorf("scheduler: Simulate: %w", err)
	}
	c := newCore(plan, shape{sizes: w.Sizes, arrays: arrays, gradBytes: int64(gb), held: held})
	times, err := replayRates(c, uc, p.GPU)
	if err != nil {
		return nil, err
	}
	// One Op per engine operation: a state copy's pieces become one.
	ops := make([]Op, 0, c.numHeads)
	at := make([]int, len(c.steps)) // each head's Op
	for k, st := range c.steps {
		t := times[k]
		if !st.first {
			o := &ops[at[st.head]]
			o.Start = min(o.Start, dur(t.start))
			o.End = max(o.End, dur(t.end))
			o.Bytes += st.amount
			continue
		}
		at[k] = len(ops)
		ops = append(ops, Op{Resource: resource(st.queue), What: opNames[st.op], Subgroup: int(st.sub), Start: dur(t.start), End: dur(t.end), Bytes: st.amount})
	}
	slices.SortStableFunc(ops, func(a, b Op) int { return int(a.Start - b.Start) })
	return ops, nil
}

// replayRates replays c with the CPU workers' fit uc and the GPU rates g:
// the two PCIe directions run at their both-at-once rates while both carry
// copies, and the CPU workers and the copies slow each other down by g's
// contention while both run.
func replayRates(c *core, uc perfmodel.Fit, g *perfmodel.GPUProfile) ([]stepTime, error) {
	fc, fl := max(1, g.Contention.CPU), max(1, g.Contention.PCIe)
	// Rates: work units per second, given what else runs.
	rate := func(r int, busy [numRes]int) float64 {
		switch r {
		case resCPU:
			r := uc.Rate
			if busy[resH2D] > 0 || busy[resD2H] > 0 {
				r /= fc
			}
			return r
		case resGPU:
			return g.Update.Rate
		case resUpcast:
			return g.Convert.Rate
		}
		both := busy[resH2D] > 0 && busy[resD2H] > 0
		x := g.H2D.Rate
		switch {
		case r == resH2D && both:
			x = g.H2DBoth.Rate
		case r == resD2H && both:
			x = g.D2HBoth.Rate
		case r == resD2H:
			x = g.D2H.Rate
		}
		if busy[resCPU] > 0 {
			x /= fl
		}
		return x
	}
	var latency [numRes]float64
	latency[resCPU], latency[resGPU], latency[resUpcast] = uc.LatencyS, g.Update.LatencyS, g.Convert.LatencyS
	latency[resH2D], latency[resD2H] = g.H2D.LatencyS, g.D2H.LatencyS
	return replay(c, rate, latency)
}

// Resources of the replay: one server each, first come first served.
const (
	resCPU = iota
	resH2D
	resD2H
	resGPU
	resUpcast
	numRes
)

// queueRes is the resource of each queue.
var queueRes = [numQueues]int{sH2D: resH2D, sKernel: resGPU, sD2H: resD2H, sUpcast: resUpcast, qCPU: resCPU}

// stepTime is a step's virtual start and end in seconds.
type stepTime struct{ start, end float64 }

// task is a step of the replay.
type task struct {
	k          int32   // the step
	res        int     // its resource
	work, left float64 // units (bytes or params); left counts down once started
	lat        float64 // seconds of latency left
	ready      float64 // when its dependencies had all ended
	ndeps      int     // dependencies not yet ended
	next       []int32 // the tasks that wait for this one
}

// taskHeap orders ready tasks by the time they became ready, then by the
// order of the steps.
type taskHeap struct {
	t  []task
	ks []int32
}

func (h *taskHeap) Len() int { return len(h.ks) }
func (h *taskHeap) Less(i, j int) bool {
	a, b := &h.t[h.ks[i]], &h.t[h.ks[j]]
	return a.ready < b.ready || (a.ready == b.ready && a.k < b.k)
}
func (h *taskHeap) Swap(i, j int) { h.ks[i], h.ks[j] = h.ks[j], h.ks[i] }
func (h *taskHeap) Push(x any)    { h.ks = append(h.ks, x.(int32)) }
func (h *taskHeap) Pop() any {
	k := h.ks[len(h.ks)-1]
	h.ks = h.ks[:len(h.ks)-1]
	return k
}

// maxSimSeconds bounds a replay's virtual time (about 31 years).
const maxSimSeconds = 1e9

// replay runs c's steps in virtual time and returns each one's span. It
// advances from event to event: a step whose dependencies (every mode
// alike, the throttle included) have all ended becomes ready; each free
// resource starts its earliest-ready step (ties: the core's order, which
// is the order the engine enqueues); running steps progress at rate(their
// resource, which resources are busy) units per second after latency[their
// resource] seconds. Each step is pushed and popped once: O(T log T) for T
// steps.
func replay(c *core, rate func(res int, busy [numRes]int) float64, latency [numRes]float64) ([]stepTime, error) {
	ts := make([]task, len(c.steps))
	for k := range c.steps {
		st := &c.steps[k]
		ts[k] = task{k: int32(k), res: queueRes[st.queue], work: float64(st.amount), left: float64(st.amount), ndeps: int(st.nDeps)}
		for _, d := range st.waits() {
			ts[d.step].next = append(ts[d.step].next, int32(k))
		}
	}
	var queue [numRes]taskHeap
	for r := range queue {
		queue[r].t = ts
	}
	for k := range ts {
		if ts[k].ndeps == 0 {
			heap.Push(&queue[ts[k].res], int32(k))
		}
	}
	out := make([]stepTime, len(ts))
	now := 0.0
	done := 0
	var running [numRes]int32
	for r := range running {
		running[r] = -1
	}
	for done < len(ts) {
		for r := range numRes {
			if running[r] < 0 && queue[r].Len() > 0 {
				k := heap.Pop(&queue[r]).(int32)
				ts[k].lat = latency[r]
				out[k].start = now
				running[r] = k
			}
		}
		var busy [numRes]int
		for r, k := range running {
			if k >= 0 {
				busy[r] = 1
			}
		}
		if busy == ([numRes]int{}) {
			return nil, errors.New("scheduler: Simulate: the schedule deadlocks") // cannot happen for a core
		}
		// The next end at this moment's rates.
		dt := math.Inf(1)
		for r, k := range running {
			if k >= 0 {
				dt = min(dt, ts[k].lat+ts[k].left/rate(r, busy))
			}
		}
		if now+dt > maxSimSeconds {
			return nil, fmt.Errorf("scheduler: Simulate: the update phase would take over %.0f s", float64(maxSimSeconds))
		}
		var ended [numRes]int32
		nEnded := 0
		for r, k := range running {
			if k < 0 {
				continue
			}
			t := &ts[k]
			adv := dt
			if t.lat > 0 {
				l := min(t.lat, adv)
				t.lat -= l
				adv -= l
			}
			t.left -= adv * rate(r, busy)
			if t.lat <= 0 && t.left <= 1e-9*t.work+1e-9 {
				out[k].end = now + dt
				running[r] = -1
				ended[nEnded] = k
				nEnded++
				done++
			}
		}
		now += dt
		for _, k := range ended[:nEnded] {
			for _, x := range ts[k].next {
				n := &ts[x]
				if n.ndeps--; n.ndeps == 0 {
					n.ready = now
					heap.Push(&queue[n.res], x)
				}
			}
		}
	}
	return out, nil
}

func dur(s float64) time.Duration { return time.Duration(s * 1e9) }
