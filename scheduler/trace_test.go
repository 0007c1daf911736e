package scheduler

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestSummarize: busy times are unions per resource, overlap is the time
// two or more resources work at once.
func TestSummarize(t *testing.T) {
	ms := time.Millisecond
	ops := []Op{
		{Resource: "h2d", Start: 0, End: 4 * ms},
		{Resource: "h2d", Start: 2 * ms, End: 6 * ms}, // overlaps its own lane: counted once
		{Resource: "gpu", Start: 5 * ms, End: 7 * ms},
		{Resource: "cpu", Start: 1 * ms, End: 10 * ms},
	}
	s := Summarize(ops)
	if s.Makespan != 10*ms {
		t.Errorf("makespan %v, want 10ms", s.Makespan)
	}
	for r, want := range map[perfmodel.Resource]time.Duration{perfmodel.ResH2D: 6 * ms, perfmodel.ResGPU: 2 * ms, perfmodel.ResCPU: 9 * ms} {
		if s.Busy[r] != want {
			t.Errorf("%s busy %v, want %v", r, s.Busy[r], want)
		}
	}
	// Two or more busy: [1, 7) ms.
	if s.Overlap != 0.6 {
		t.Errorf("overlap %g, want 0.6", s.Overlap)
	}
	if f := s.Fraction("cpu"); f != 0.9 {
		t.Errorf("cpu fraction %g, want 0.9", f)
	}
	var b bytes.Buffer
	if err := WriteChrome(&b, ops); err != nil {
		t.Fatal(err)
	}
	var doc struct {
		TraceEvents []struct {
			Ph  string  `json:"ph"`
			Ts  float64 `json:"ts"`
			Dur float64 `json:"dur"`
			Tid string  `json:"tid"`
		} `json:"traceEvents"`
	}
	if err := json.Unmarshal(b.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.TraceEvents) != 4 || doc.TraceEvents[3].Ts != 1000 || doc.TraceEvents[3].Dur != 9000 || doc.TraceEvents[3].Tid != "cpu" || doc.TraceEvents[0].Ph != "X" {
		t.Errorf("trace events %+v", doc.TraceEvents)
	}
	if z := Summarize(nil); z.Makespan != 0 || z.Overlap != 0 {
		t.Errorf("empty trace: %+v", z)
	}
}

// TestMeasure: Measure's busy times and makespan are Summarize's of the same
// phase (the union of each resource's intervals), and it allocates nothing.
func TestMeasure(t *testing.T) {
	fit := func(rate float64) perfmodel.Fit { return perfmodel.Fit{Rate: rate, LatencyS: 1e-6} }
	e := onePhase(t, NewSim(SimOptions{Profile: &perfmodel.GPUProfile{H2D: fit(50e9), D2H: fit(50e9), Update: fit(1e9), Convert: fit(1e10)}}))
	b, err := e.Measure()
	if err != nil {
		t.Fatal(err)
	}
	ops, err := e.Trace()
	if err != nil {
		t.Fatal(err)
	}
	sum := Summarize(ops)
	for _, r := range []perfmodel.Resource{perfmodel.ResCPU, perfmodel.ResH2D, perfmodel.ResD2H, perfmodel.ResGPU} {
		if b.Of(r) != sum.Busy[r] {
			t.Errorf("%s: Measure %v, Summarize %v", r, b.Of(r), sum.Busy[r])
		}
	}
	if b.Makespan != sum.Makespan {
		t.Errorf("Measure's makespan %v, Summarize's %v", b.Makespan, sum.Makespan)
	}
	if b.H2D <= 0 || b.GPU <= 0 || b.Wall <= 0 {
		t.Errorf("Measure %+v: want H2D, GPU and wall time > 0", b)
	}
	if !raceEnabled {
		if a := testing.AllocsPerRun(10, func() { _, _ = e.Measure() }); a != 0 {
			t.Errorf("Measure allocates %v times", a)
		}
	}
}

// onePhase builds an engine on d over testSizes (3 CPU, 3 streamed and 2
// resident subgroups) and runs one update phase; Close comes with the
// test's end.
func onePhase(t *testing.T, d Device) *Engine {
	t.Helper()
	p := newProblem(testTotal(), adam.BF16, false, 1, 9)
	e := setup(t, d, p, testSizes, perfmodel.Schedule{CPU: 3, GPU: 3, Resident: 2}, false)
	t.Cleanup(func() { e.Close() })
	put(t, d, e.grad, 0, p.gradBytes(0))
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	if err := e.Update(&c); err != nil {
		t.Fatal(err)
	}
	return e
}
