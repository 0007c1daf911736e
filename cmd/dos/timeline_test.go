package main

import (
	"encoding/json"
	"os"
	"path/filepath"
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
