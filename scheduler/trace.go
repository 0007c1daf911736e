package scheduler

import (
	"encoding/json"
	"errors"
	"io"
	"slices"
	"time"

	"github.com/deepstates/dos/perfmodel"
)

// Op is one traced operation of the last Update.
type Op struct {
	Resource perfmodel.Resource // where it ran
	What     string             // "state H2D", "AdamW", "state D2H", "upcast", "grad D2H", "CPU AdamW", "copy H2D"; SpeculativeKept, SpeculativeUndone, SpeculativeKeptGPU, SpeculativeUndoneGPU, SpeculativeRestore
	Subgroup int                // its index
	Start    time.Duration      // from the start of the update phase
	End      time.Duration
	Bytes    int64 // moved over PCIe (copies) or params updated (kernels, CPU)
}

// Op.What of a speculative update (Speculate) the last Update kept, of one
// undone before it (its scalars were not the step's), and of that undoing:
// the CPU workers', and the GPU speculation's kernel (Options.SpeculateGPU:
// its state copies keep their names, in the backward).
const (
	SpeculativeKept      = "CPU AdamW, speculative"
	SpeculativeUndone    = "CPU AdamW, speculative, undone"
	SpeculativeKeptGPU   = "AdamW, speculative"
	SpeculativeUndoneGPU = "AdamW, speculative, undone"
	SpeculativeRestore   = "restore"
)

// Trace returns the operations of the last Update with their times: the
// device's by its events (from an event recorded at the start), the CPU's
// by the host clock from the same start, sorted by start. What Prefetch
// issued for it comes first, at negative times (during the backward), and
// so do the speculative updates (Speculate): those kept, as
// SpeculativeKept (the GPU speculation's kernel as SpeculativeKeptGPU,
// after its state H2D and before its state D2H, by their events), those
// undone before the phase, as SpeculativeUndone (SpeculativeUndoneGPU:
// when its worker enqueued it, by the host clock), each followed by its
// SpeculativeRestore. Read
// it before the next Prefetch or Update, which record those events again.
// Errors: ErrNoPhase before the first Update or after a Replan; the
// device's (Elapsed).
func (e *Engine) Trace() ([]Op, error) {
	if !e.updated {
		return nil, ErrNoPhase
	}
	var ops []Op
	for i := range e.sizes {
		for _, op := range e.core.ops(i) {
			if e.done[i]&(1<<op) == 0 {
				continue
			}
			r := e.core.opSteps[i][op]
			o := Op{Resource: resource(e.core.steps[r[0]].queue), What: opNames[op], Subgroup: i}
			for k := r[0]; k <= r[1]; k++ {
				o.Bytes += e.core.steps[k].amount
			}
			var err error
			if o.Start, o.End, err = e.opSpan(i, op); err != nil {
				return nil, err
			}
			switch {
			case op == opCPU && e.preLast[i]&(1<<opCPU) != 0:
				o.What = SpeculativeKept
			case op == opKernel && e.preLast[i]&(1<<opKernel) != 0:
				o.What = SpeculativeKeptGPU
			}
			ops = append(ops, o)
		}
	}
	for _, u := range e.specUndoLast {
		res, what := perfmodel.ResCPU, SpeculativeUndone
		if u.gpu {
			res, what = perfmodel.ResGPU, SpeculativeUndoneGPU // when the worker enqueued it
		}
		ops = append(ops,
			Op{Resource: res, What: what, Subgroup: u.sub, Start: u.spec[0].Sub(e.t0), End: u.spec[1].Sub(e.t0), Bytes: e.sizes[u.sub]},
			Op{Resource: perfmodel.ResCPU, What: SpeculativeRestore, Subgroup: u.sub, Start: u.restore[0].Sub(e.t0), End: u.restore[1].Sub(e.t0), Bytes: e.sizes[u.sub]})
	}
	slices.SortStableFunc(ops, func(a, b Op) int { return int(a.Start - b.Start) })
	return ops, nil
}

// PhaseStart returns the host time at which the last Update began: the
// origin of Trace's times (the device's from the event recorded then, the
// CPU's by the host clock), to place the phase in a longer timeline.
// Errors: ErrNoPhase, as Trace.
func (e *Engine) PhaseStart() (time.Time, error) {
	if !e.updated {
		return time.Time{}, ErrNoPhase
	}
	return e.t0, nil
}

// ErrNoPhase is Trace's and Measure's error when there is no update phase
// to read: before the first Update, or after a Replan (the phase was the
// old plan's).
var ErrNoPhase = errors.New("scheduler: no update phase to read since New or Replan")

// Busy is the work of one update phase per resource, the performance
// model's Prediction.Busy measured: for the CPU workers, the H2D lane, the
// D2H lane and the GPU's kernels (AdamW and the upcast), the union of
// their operations' intervals; and the phase's makespan and wall time.
type Busy struct {
	CPU, H2D, D2H, GPU time.Duration
	// Makespan is from the first operation's start to the last one's end
	// (Summarize's), the performance model's Prediction.Makespan measured.
	Makespan time.Duration
	Wall     time.Duration // Update's, from its start to the last stream drained
}

// Of returns r's busy time (the GPU's for any resource but the CPU, H2D
// and D2H).
func (b Busy) Of(r perfmodel.Resource) time.Duration {
	switch r {
	case perfmodel.ResCPU:
		return b.CPU
	case perfmodel.ResH2D:
		return b.H2D
	case perfmodel.ResD2H:
		return b.D2H
	}
	return b.GPU
}

// interval is one operation's interval on its resource, for Measure.
type interval struct {
	start, end time.Duration
	res        int8 // resIndex
}

// resIndex orders the resources for Measure.
func resIndex(r perfmodel.Resource) int8 {
	switch r {
	case perfmodel.ResCPU:
		return 0
	case perfmodel.ResH2D:
		return 1
	case perfmodel.ResD2H:
		return 2
	}
	return 3
}

// opSpan returns when operation op of subgroup i ran in the last Update,
// from its base: a CPU update by the host clock, a device operation by its
// first step's start event and its last step's end event (what Prefetch
// issued through preTime, before the base).
func (e *Engine) opSpan(i, op int) (start, end time.Duration, err error) {
	if op == opCPU {
		return e.cpuT[i][0], e.cpuT[i][1], nil
	}
	r := e.core.opSteps[i][op]
	at := func(ev Event) (time.Duration, error) { return e.dev.Elapsed(e.base, ev) }
	if e.preLast[i]&(1<<op) != 0 {
		at = e.preTime
	}
	if start, err = at(e.startEv[r[0]]); err != nil {
		return 0, 0, err
	}
	end, err = at(e.endEv[r[1]])
	return start, end, err
}

// Measure returns the last Update's Busy from the same clocks as Trace
// (the device's events, the host clock for the CPU workers): each
// resource's busy time is the union of its operations' intervals, as
// Summarize counts it. What Prefetch issued before the phase is left out.
// It does not allocate: Options.Replan's refit in offload reads it after
// every phase. Errors: ErrNoPhase before the first Update or after a
// Replan; the device's (Elapsed).
func (e *Engine) Measure() (Busy, error) {
	if !e.updated {
		return Busy{}, ErrNoPhase
	}
	e.spans = e.spans[:0]
	for i := range e.sizes {
		for _, op := range e.core.ops(i) {
			if e.done[i]&(1<<op) == 0 || e.preLast[i]&(1<<op) != 0 {
				continue // not done, or Prefetch's: not in the phase
			}
			sp := interval{res: resIndex(resource(e.core.steps[e.core.opSteps[i][op][0]].queue))}
			var err error
			if sp.start, sp.end, err = e.opSpan(i, op); err != nil {
				return Busy{}, err
			}
			e.spans = append(e.spans, sp)
		}
	}
	slices.SortFunc(e.spans, func(a, b interval) int { return int(a.start - b.start) })
	var busy, lo, hi [4]time.Duration
	var open [4]bool
	var first, last time.Duration
	for k, sp := range e.spans {
		if k == 0 || sp.start < first {
			first = sp.start
		}
		last = max(last, sp.end)
		r := sp.res
		switch {
		case !open[r]:
			lo[r], hi[r], open[r] = sp.start, sp.end, true
		case sp.start > hi[r]: // a gap: close the run
			busy[r] += hi[r] - lo[r]
			lo[r], hi[r] = sp.start, sp.end
		default:
			hi[r] = max(hi[r], sp.end)
		}
	}
	for r := range busy {
		if open[r] {
			busy[r] += hi[r] - lo[r]
		}
	}
	return Busy{CPU: busy[0], H2D: busy[1], D2H: busy[2], GPU: busy[3], Makespan: last - first, Wall: e.wall}, nil
}

// Summary is what a trace says of one update phase.
type Summary struct {
	Makespan time.Duration                        // from the first start to the last end
	Busy     map[perfmodel.Resource]time.Duration // per resource: the union of its operations' intervals
	// Overlap is the fraction of the makespan during which at least two
	// resources were busy at once.
	Overlap float64
}

// Fraction returns resource r's busy time over the makespan (0 to 1).
func (s Summary) Fraction(r perfmodel.Resource) float64 {
	if s.Makespan <= 0 {
		return 0
	}
	return float64(s.Busy[r]) / float64(s.Makespan)
}

// Summarize computes the makespan, each resource's busy time and the
// overlap of ops (Engine.Trace).
func Summarize(ops []Op) Summary {
	s := Summary{Busy: map[perfmodel.Resource]time.Duration{}}
	if len(ops) == 0 {
		return s
	}
	type edge struct {
		t     time.Duration
		delta int
		res   perfmodel.Resource
	}
	var edges []edge
	lo, hi := ops[0].Start, ops[0].End
	for _, o := range ops {
		lo, hi = min(lo, o.Start), max(hi, o.End)
		edges = append(edges, edge{o.Start, 1, o.Resource}, edge{o.End, -1, o.Resource})
	}
	s.Makespan = hi - lo
	slices.SortStableFunc(edges, func(a, b edge) int {
		if a.t != b.t {
			return int(a.t - b.t)
		}
		return a.delta - b.delta // ends before starts at the same instant
	})
	count := map[perfmodel.Resource]int{}
	busyRes := 0
	var overlap time.Duration
	prev := lo
	for _, e := range edges {
		dt := e.t - prev
		for r, c := range count {
			if c > 0 {
				s.Busy[r] += dt
			}
		}
		if busyRes >= 2 {
			overlap += dt
		}
		prev = e.t
		before := count[e.res]
		count[e.res] += e.delta
		switch {
		case before == 0 && count[e.res] > 0:
			busyRes++
		case before > 0 && count[e.res] == 0:
			busyRes--
		}
	}
	if s.Makespan > 0 {
		s.Overlap = float64(overlap) / float64(s.Makespan)
	}
	return s
}

// Counter is one sample of a quantity drawn beside a trace (WriteChrome):
// Name's Value at At from the trace's origin.
type Counter struct {
	Name  string // e.g. "GPU memory (GiB)"
	At    time.Duration
	Value float64
}

// WriteChrome writes ops as Chrome trace-event JSON (the "X" complete
// events of the Trace Event Format, which Perfetto and chrome://tracing
// open): one row per resource, times in microseconds, each event's
// subgroup and bytes (or params) in its args; and counters as "C" events,
// one track per name.
func WriteChrome(w io.Writer, ops []Op, counters ...Counter) error {
	type event struct {
		Name string             `json:"name"`
		Cat  perfmodel.Resource `json:"cat"`
		Ph   string             `json:"ph"`
		Ts   float64            `json:"ts"`
		Dur  float64            `json:"dur"`
		Pid  int                `json:"pid"`
		Tid  perfmodel.Resource `json:"tid"`
		Args map[string]any     `json:"args"`
	}
	evs := make([]event, 0, len(ops)+len(counters))
	for _, o := range ops {
		unit := "bytes"
		if o.What == "AdamW" || o.What == "CPU AdamW" || o.What == "upcast" {
			unit = "params"
		}
		evs = append(evs, event{Name: o.What, Cat: o.Resource, Ph: "X", Ts: float64(o.Start) / 1e3, Dur: float64(o.End-o.Start) / 1e3,
			Pid: 1, Tid: o.Resource, Args: map[string]any{"subgroup": o.Subgroup, unit: o.Bytes}})
	}
	for _, c := range counters {
		evs = append(evs, event{Name: c.Name, Ph: "C", Ts: float64(c.At) / 1e3, Pid: 1, Args: map[string]any{"value": c.Value}})
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", " ")
	return enc.Encode(map[string]any{"traceEvents": evs, "displayTimeUnit": "ms"})
}
