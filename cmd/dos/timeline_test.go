package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// TestPlotTimeline draws a small synthetic trace (or, with
// DOS_TIMELINE_TRACE=trace.json DOS_TIMELINE_OUT=out.png, a trace dos
// bench wrote) and checks a non-empty file came out.
func TestPlotTimeline(t *testing.T) {
	ms := time.Millisecond
	ops := []scheduler.Op{
		{Resource: "h2d", What: "state H2D", Subgroup: 1, Start: 0, End: 20 * ms},
		{Resource: "gpu", What: "AdamW", Subgroup: 1, Start: 20 * ms, End: 21 * ms},
		{Resource: "d2h", What: "state D2H", Subgroup: 1, Start: 21 * ms, End: 41 * ms},
		{Resource: "d2h", What: "grad D2H", Subgroup: 0, Start: 0, End: 4 * ms},
		{Resource: "cpu", What: "CPU AdamW", Subgroup: 0, Start: 4 * ms, End: 30 * ms},
		{Resource: "h2d", What: "copy H2D", Subgroup: 0, Start: 30 * ms, End: 34 * ms},
	}
	out := filepath.Join(t.TempDir(), "timeline.png")
	if in := os.Getenv("DOS_TIMELINE_TRACE"); in != "" {
		ops = readChrome(t, in)
		out = os.Getenv("DOS_TIMELINE_OUT")
	}
	if err := plotTimeline(ops, "test", out); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(out); err != nil || st.Size() < 1000 {
		t.Fatalf("%s: %v, %v", out, st, err)
	}
}

func readChrome(t *testing.T, path string) []scheduler.Op {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		TraceEvents []struct {
			Name, Tid string
			Ts, Dur   float64
			Args      struct{ Subgroup int }
		}
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	var ops []scheduler.Op
	for _, e := range doc.TraceEvents {
		ops = append(ops, scheduler.Op{Resource: perfmodel.Resource(e.Tid), What: e.Name, Subgroup: e.Args.Subgroup,
			Start: time.Duration(e.Ts * 1e3), End: time.Duration((e.Ts + e.Dur) * 1e3)})
	}
	return ops
}

// TestTrainTimeline: dos train --timeline draws the iteration --timeline-at
// names (the last by default) and writes its Chrome trace beside the
// picture: forward, then backward, then the step, in order within the
// iteration; with --device sim the update phase's operations sit inside the
// step, after backward. Bad uses are usage errors.
func TestTrainTimeline(t *testing.T) {
	for _, tc := range []struct {
		name  string
		args  []string
		phase bool // the update phase's operations are in the trace
	}{
		{"cpu", []string{"--steps", "3"}, false},
		{"sim", []string{"--steps", "4", "--timeline-at", "2", "--device", "sim", "--working-dtype", "bf16", "--subgroup-size", "100000"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pic := filepath.Join(t.TempDir(), "it.svg")
			train(t, append(tc.args, "--timeline", pic)...)
			if st, err := os.Stat(pic); err != nil || st.Size() < 1000 {
				t.Fatalf("%s: %v, %v", pic, st, err)
			}
			b, err := os.ReadFile(filepath.Join(filepath.Dir(pic), "it.json"))
			if err != nil {
				t.Fatal(err)
			}
			var tr struct {
				TraceEvents []struct {
					Name    string  `json:"name"`
					Tid     string  `json:"tid"`
					Ts, Dur float64 // microseconds
				} `json:"traceEvents"`
			}
			if err := json.Unmarshal(b, &tr); err != nil {
				t.Fatal(err)
			}
			span := map[string][2]float64{}
			var phase [][2]float64
			for _, e := range tr.TraceEvents {
				s := [2]float64{e.Ts, e.Ts + e.Dur}
				switch e.Name {
				case "forward", "backward":
					span[e.Name] = s
				case "step":
					if x, ok := span["step"]; ok {
						s = [2]float64{min(x[0], s[0]), max(x[1], s[1])}
					}
					span["step"] = s
				default:
					phase = append(phase, s)
				}
			}
			f, b2, st := span["forward"], span["backward"], span["step"]
			if !(f[0] == 0 && f[1] > 0 && math.Abs(b2[0]-f[1]) < 0.01 && b2[1] > b2[0] && st[0] >= b2[1]-0.01 && st[1] > st[0]) { // 0.01 µs: the JSON's rounding
				t.Errorf("spans out of order: forward %v, backward %v, step %v (µs)", f, b2, st)
			}
			if tc.phase != (len(phase) > 0) {
				t.Errorf("%d update-phase operations in the trace, want them: %v", len(phase), tc.phase)
			}
			for _, p := range phase {
				if p[0] < st[0] || p[1] > st[1]+1 {
					t.Errorf("update-phase operation %v outside the step %v", p, st)
				}
			}
		})
	}
	for _, bad := range [][]string{{"--timeline", "x.txt"}, {"--timeline-at", "2"}, {"--timeline", "x.svg", "--timeline-at", "-1"},
		{"--timeline", "x.svg", "--steps", "2", "--timeline-at", "5"},
		{"--timeline", "x.svg", "--summary-json", "x.json"}, {"--timeline", "d/x.png", "--log-json", "./d/../d/x.json"},
		{"--timeline", "x.svg", "--summary-json", "x.svg"}} { // the trace or the picture over another output
		out, err := dosCmd(append(append([]string{"train"}, tiny...), bad...)...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), "timeline") {
			t.Errorf("dos train %v: %v, want a usage error naming the flag:\n%s", bad, err, out)
		}
	}
}
