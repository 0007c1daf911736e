package main

import (
	"bytes"
	"strings"
	"testing"
)

// TestPlan: dos plan on the H200 machine's profile for the dos bench run
// (3.91B parameters, 50M subgroups, 16 GiB) chooses that run's schedule
// (28 CPU, 25 GPU, 26 resident: the fastest measured there) and refuses
// bad flags.
func TestPlan(t *testing.T) {
	var out, errb bytes.Buffer
	rc := run([]string{"plan", "--profile", "../../testdata/profiles/h200.json", "--params", "3.91e9", "--subgroup-size", "50000000"}, &out, &errb)
	if rc != 0 {
		t.Fatalf("rc %d: %s", rc, errb.String())
	}
	if !strings.Contains(out.String(), "k = 1.12 (28 CPU, 25 GPU, 26 resident subgroups per rank), 0.542 s") {
		t.Errorf("%s", out.String())
	}
	// The fluid bound, a little below the model's choice (its fill and
	// drain, whole subgroups).
	if !strings.Contains(out.String(), "machine limit: 0.539 s, the performance model's fluid bound") {
		t.Errorf("no machine limit of 0.539 s:\n%s", out.String())
	}
	out.Reset()
	if rc := run([]string{"plan", "--profile", "../../testdata/profiles/h200.json", "--threads", "2", "--ranks", "4", "--sweep", "0"}, &out, &errb); rc != 0 ||
		!strings.Contains(out.String(), "note: 2 CPU workers over 4 ranks: 1 worker per rank, 4 in all") {
		t.Errorf("fewer threads than ranks: rc %d, no note:\n%s", rc, out.String())
	}
	for _, args := range [][]string{{"plan"}, {"plan", "--profile", "x", "--params", "-1"}, {"plan", "--profile", "../../testdata/profiles/h200.json", "--ranks", "0"},
		{"plan", "--profile", "../../testdata/profiles/h200.json", "--gpu-budget", "NaN"}, {"plan", "--profile", "../../testdata/profiles/h200.json", "--subgroup-size", "1"}} {
		out.Reset()
		errb.Reset()
		if rc := run(args, &out, &errb); rc != 2 || errb.Len() == 0 {
			t.Errorf("%v: rc %d, stderr %q", args, rc, errb.String())
		}
	}
}
