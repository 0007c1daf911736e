package scheduler

import (
	"container/heap"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

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
	Sizes     []int64 // parameters per subgroup, > 0 each
	GradDType string  // "float32", "bfloat16" or "float16": the gradient on the device
	AMSGrad   bool    // 16 B/param of state instead of 12
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
	case "float32":
		gb = 4
	case "bfloat16", "float16":
		gb = 2
	default:
		return nil, fmt.Errorf("scheduler: Simulate: gradient dtype %q", w.GradDType)
	}
	upcast := plan.Schedule.UpcastOnGPU && gb == 2
	cpuDType := w.GradDType
	cb := gb // bytes of a CPU subgroup's gradient moving D2H
	if upcast {
		cpuDType, cb = "float32", 4
	}
	uc, err := p.CPURate(max(1, m.Threads), cpuDType)
	if err != nil {
		return nil, err
	}
	g := p.GPU
	fc, fl := max(1, g.Contention.CPU), max(1, g.Contention.PCIe)

	s := &des{}
	arrays := 3
	if w.AMSGrad {
		arrays = 4
	}
	chunk := func(kind int, what string, i int, n float64, deps ...*task) []*task {
		// A state copy: each array (p, m, v, vmax) in CopyChunk pieces,
		// each after the lane's piece two before (the engine's throttle),
		// in order.
		var out []*task
		for range arrays {
			for o := 0.0; o < 4*n; o += CopyChunk {
				t := s.add(kind, what, i, min(CopyChunk, 4*n-o), deps...)
				if k := len(s.lane[kind]); k >= 2 {
					t.deps = append(t.deps, s.lane[kind][k-2])
				}
				s.lane[kind] = append(s.lane[kind], t)
				out = append(out, t)
			}
		}
		return out
	}
	// The GPU lane, in its order.
	var lastOnSlot [2]*task // the last D2H piece of each slot's previous subgroup
	var prevKernel *task
	streamed := 0
	for _, i := range plan.GPUOrder {
		n := float64(w.Sizes[i])
		if plan.Roles[i] == Resident {
			k := s.add(resGPU, "AdamW", i, n, prevKernel)
			prevKernel = k
			continue
		}
		slot := streamed % 2
		streamed++
		h2d := chunk(resH2D, "state H2D", i, n, lastOnSlot[slot])
		k := s.add(resGPU, "AdamW", i, n, h2d[len(h2d)-1], prevKernel)
		prevKernel = k
		d2h := chunk(resD2H, "state D2H", i, n, k)
		lastOnSlot[slot] = d2h[len(d2h)-1]
	}
	// The CPU lane, in its order.
	var cpuSteps, copies []*task
	var prevCPU *task
	for ci, i := range plan.CPUOrder {
		n := float64(w.Sizes[i])
		var token, slotFree *task
		if ci >= 2 {
			token, slotFree = cpuSteps[ci-2], copies[ci-2]
		}
		var gd *task
		if upcast {
			u := s.add(resUpcast, "upcast", i, n, token)
			gd = s.add(resD2H, "grad D2H", i, cb*n, u)
		} else {
			gd = s.add(resD2H, "grad D2H", i, cb*n, token)
		}
		c := s.add(resCPU, "CPU AdamW", i, n, gd, slotFree, prevCPU)
		prevCPU = c
		cp := s.add(resH2D, "copy H2D", i, 2*n, c)
		cpuSteps, copies = append(cpuSteps, c), append(copies, cp)
	}
	// Rates: work units per second, given what else runs.
	rate := func(t *task, busy [numRes]int) float64 {
		switch t.res {
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
		r := g.H2D.Rate
		switch {
		case t.res == resH2D && both:
			r = g.H2DBoth.Rate
		case t.res == resD2H && both:
			r = g.D2HBoth.Rate
		case t.res == resD2H:
			r = g.D2H.Rate
		}
		if busy[resCPU] > 0 {
			r /= fl
		}
		return r
	}
	latency := func(t *task) float64 {
		switch t.res {
		case resCPU:
			return uc.LatencyS
		case resGPU:
			return g.Update.LatencyS
		case resUpcast:
			return g.Convert.LatencyS
		case resH2D:
			return g.H2D.LatencyS
		}
		return g.D2H.LatencyS
	}
	return s.run(rate, latency)
}

// Resources of the simulation: one server each, first come first served.
const (
	resCPU = iota
	resH2D
	resD2H
	resGPU
	resUpcast
	numRes
)

var resNames = [numRes]string{"cpu", "h2d", "d2h", "gpu", "gpu"}

// task is one operation of the simulation: work units (bytes or params)
// on a resource, after its dependencies end.
type task struct {
	res, sub   int
	what       string
	work, left float64 // units; left counts down once started
	lat        float64 // seconds of latency left
	deps       []*task
	ready      float64 // when its dependencies had all ended
	start, end float64
	state      int // 0 waiting, 1 ready, 2 running, 3 done
	seq        int
	ndeps      int     // dependencies not yet ended
	next       []*task // the tasks that depend on this one
}

// taskHeap orders ready tasks by the time they became ready, then by the
// order they were added.
type taskHeap []*task

func (h taskHeap) Len() int { return len(h) }
func (h taskHeap) Less(i, j int) bool {
	return h[i].ready < h[j].ready || (h[i].ready == h[j].ready && h[i].seq < h[j].seq)
}
func (h taskHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *taskHeap) Push(x any)   { *h = append(*h, x.(*task)) }
func (h *taskHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	*h = old[:len(old)-1]
	return t
}

type des struct {
	tasks []*task
	lane  [numRes][]*task // state pieces per copy lane, for the throttle
}

func (s *des) add(res int, what string, sub int, work float64, deps ...*task) *task {
	t := &task{res: res, sub: sub, what: what, work: work, left: work, seq: len(s.tasks)}
	for _, d := range deps {
		if d != nil {
			t.deps = append(t.deps, d)
		}
	}
	s.tasks = append(s.tasks, t)
	return t
}

// maxSimSeconds bounds a replay's virtual time (about 31 years).
const maxSimSeconds = 1e9

// run advances virtual time from event to event: a task whose
// dependencies have all ended becomes ready; each free resource starts its
// earliest-ready task (ties: the order added, the order the engine
// enqueues); running tasks progress at the rates of this moment. Each task
// is pushed and popped once: O(T log T) for T tasks.
func (s *des) run(rate func(*task, [numRes]int) float64, latency func(*task) float64) ([]Op, error) {
	var queue [numRes]taskHeap
	for _, t := range s.tasks {
		t.ndeps = len(t.deps)
		for _, d := range t.deps {
			d.next = append(d.next, t)
		}
	}
	for _, t := range s.tasks {
		if t.ndeps == 0 {
			t.state = 1
			heap.Push(&queue[t.res], t)
		}
	}
	now := 0.0
	done := 0
	var running [numRes]*task
	for done < len(s.tasks) {
		for r := range numRes {
			if running[r] == nil && queue[r].Len() > 0 {
				t := heap.Pop(&queue[r]).(*task)
				t.state, t.start, t.lat = 2, now, latency(t)
				running[r] = t
			}
		}
		var busy [numRes]int
		for r, t := range running {
			if t != nil {
				busy[r] = 1
			}
		}
		if busy == ([numRes]int{}) {
			return nil, errors.New("scheduler: Simulate: the schedule deadlocks") // cannot happen for a Plan
		}
		// The next end at this moment's rates.
		dt := math.Inf(1)
		for _, t := range running {
			if t != nil {
				dt = min(dt, t.lat+t.left/rate(t, busy))
			}
		}
		if now+dt > maxSimSeconds {
			return nil, fmt.Errorf("scheduler: Simulate: the update phase would take over %.0f s", float64(maxSimSeconds))
		}
		var ended []*task
		for r, t := range running {
			if t == nil {
				continue
			}
			adv := dt
			if t.lat > 0 {
				l := min(t.lat, adv)
				t.lat -= l
				adv -= l
			}
			t.left -= adv * rate(t, busy)
			if t.lat <= 0 && t.left <= 1e-9*t.work+1e-9 {
				t.state, t.end = 3, now+dt
				running[r] = nil
				ended = append(ended, t)
				done++
			}
		}
		now += dt
		for _, t := range ended {
			for _, n := range t.next {
				if n.ndeps--; n.ndeps == 0 {
					n.state, n.ready = 1, now
					heap.Push(&queue[n.res], n)
				}
			}
		}
	}
	// One Op per engine operation: a state copy's pieces become one.
	type key struct {
		sub  int
		what string
	}
	merged := map[key]int{}
	var ops []Op
	for _, t := range s.tasks {
		k := key{t.sub, t.what}
		if j, ok := merged[k]; ok {
			o := &ops[j]
			o.Start = min(o.Start, dur(t.start))
			o.End = max(o.End, dur(t.end))
			o.Bytes += int64(t.work)
			continue
		}
		merged[k] = len(ops)
		ops = append(ops, Op{Resource: resNames[t.res], What: t.what, Subgroup: t.sub, Start: dur(t.start), End: dur(t.end), Bytes: int64(t.work)})
	}
	slices.SortStableFunc(ops, func(a, b Op) int { return int(a.Start - b.Start) })
	return ops, nil
}

func dur(s float64) time.Duration { return time.Duration(s * 1e9) }
