package offload

import (
	"strings"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
)

// TestAccessByName: GradOf, WorkingOf and MasterOf are Grad, Working and
// Master of the named parameter; an unknown name is an error naming it.
func TestAccessByName(t *testing.T) {
	o := newTest(t, Options{WorkingDType: adam.BF16})
	for i, p := range o.Params() {
		g, err := o.GradOf(p.Name)
		if err != nil || g.Len() != p.Len || &g.f32[0] != &o.Grad(i).f32[0] {
			t.Fatalf("GradOf(%q): %v", p.Name, err)
		}
		w, err := o.WorkingOf(p.Name)
		if err != nil || &w.u16[0] != &o.Working(i).u16[0] {
			t.Fatalf("WorkingOf(%q): %v", p.Name, err)
		}
		m, err := o.MasterOf(p.Name)
		if err != nil || m[0] != master(t, o, i)[0] {
			t.Fatalf("MasterOf(%q): %v", p.Name, err)
		}
	}
	for _, f := range []func(string) error{
		func(n string) error { _, err := o.GradOf(n); return err },
		func(n string) error { _, err := o.WorkingOf(n); return err },
		func(n string) error { _, err := o.MasterOf(n); return err },
	} {
		if err := f("nope"); err == nil || !strings.Contains(err.Error(), `"nope"`) {
			t.Errorf("an unknown name: %v", err)
		}
	}
}

func TestStepResultString(t *testing.T) {
	for _, tc := range []struct {
		r    StepResult
		want string
	}{
		{StepResult{Step: 12, GradNorm: 1.2345, ClipCoef: 0.81, Elapsed: 3200 * time.Microsecond}, "step 12 grad_norm 1.234 clip 0.81 in 3.2ms"},
		{StepResult{Step: 3, Elapsed: time.Millisecond}, "step 3 in 1ms"},
		{StepResult{Step: 11, Skipped: true, Elapsed: time.Millisecond}, "skipped (non-finite gradient) at step 11 in 1ms"},
	} {
		if got := tc.r.String(); got != tc.want {
			t.Errorf("%+v: %q, want %q", tc.r, got, tc.want)
		}
	}
}
