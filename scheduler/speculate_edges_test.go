package scheduler

import (
	"errors"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// within runs f and fails the test when it has not returned after d (a
// deadlock): the goroutine is left behind, blocked.
func within(t *testing.T, d time.Duration, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s: still blocked after %v (deadlock)", what, d)
	}
}

// TestSpeculateCloseTwice: with Options.Speculate a second Close returns
// (the worker is gone: nothing is sent to it).
func TestSpeculateCloseTwice(t *testing.T) {
	d := NewSim(SimOptions{})
	p := heldProblem(adam.BF16, 1, 3, -1)
	e := specEngine(t, d, p, heldPatterns[1], perfmodel.Schedule{CPU: 4}, 1<<20)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	within(t, 2*time.Second, "second Close", func() { _ = e.Close() })
}

// TestSpeculateDropAfterClose: DropPrefetch after Close returns.
func TestSpeculateDropAfterClose(t *testing.T) {
	d := NewSim(SimOptions{})
	p := heldProblem(adam.BF16, 1, 3, -1)
	e := specEngine(t, d, p, heldPatterns[1], perfmodel.Schedule{CPU: 4}, 1<<20)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	within(t, 2*time.Second, "DropPrefetch after Close", func() { _ = e.DropPrefetch() })
}

// eventFailing is the simulated device whose NewEvent fails from the
// failAt-th call on.
type eventFailing struct {
	*Sim
	calls, failAt int
}

var errEvent = errors.New("NewEvent refused")

func (d *eventFailing) NewEvent() (Event, error) {
	d.calls++
	if d.failAt > 0 && d.calls >= d.failAt {
		return nil, errEvent
	}
	return d.Sim.NewEvent()
}

// TestSpeculateNewEventFailure: New whose last event (allocSpec's) fails
// returns the failure, freeing what it allocated, without hanging.
func TestSpeculateNewEventFailure(t *testing.T) {
	held := heldPatterns[1]
	plan, err := NewHeldPlan(held, perfmodel.Schedule{CPU: 4})
	if err != nil {
		t.Fatal(err)
	}
	opts := func(d Device) Options {
		return Options{Device: d, Sizes: heldSizes, GradDType: adam.BF16, WorkingDType: adam.BF16, Plan: plan, HostHeld: held,
			Prefetch: true, Speculate: 1 << 20}
	}
	// Count the events New makes; allocSpec makes the last ones.
	count := &eventFailing{Sim: NewSim(SimOptions{})}
	e, err := New(opts(count))
	if err != nil {
		t.Fatal(err)
	}
	e.Close()
	d := &eventFailing{Sim: NewSim(SimOptions{}), failAt: count.calls} // the last event: allocSpec's
	within(t, 2*time.Second, "New with allocSpec's event failing", func() {
		if _, err := New(opts(d)); !errors.Is(err, errEvent) {
			t.Errorf("New: %v, want the event failure", err)
		}
	})
}

// TestSpeculateCloseTwiceControl: the same without Options.Speculate.
func TestSpeculateCloseTwiceControl(t *testing.T) {
	d := NewSim(SimOptions{})
	p := heldProblem(adam.BF16, 1, 3, -1)
	e := specEngine(t, d, p, heldPatterns[1], perfmodel.Schedule{CPU: 4}, 0)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	within(t, 2*time.Second, "second Close", func() { _ = e.Close(); _ = e.DropPrefetch() })
}
