package scheduler

import (
	"fmt"
	"math"
	"slices"
	"testing"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestWaitReady: a reader on a stream of its own (the next forward) that
// calls WaitReady for each subgroup in turn while FinishUpdate runs on
// another goroutine, then reads that subgroup's new working copy (a copy
// D2H on its stream, or HostWorking for a host-held subgroup) and the
// mirror, sees the step's values bitwise, on every pattern of host-held
// subgroups and schedule, clipped or not; on the simulated device its
// reads are ordered after the engine's writes (a missing wait is its
// ErrOrder). The phase then ends as UpdatePer does, and WaitReady
// outside a phase returns at once.
func TestWaitReady(t *testing.T) { forDevices(t, testWaitReady) }

func testWaitReady(t *testing.T, newDev func() Device) {
	h := adam.DefaultHyper()
	for pi, held := range heldPatterns {
		p := heldProblem(adam.BF16, 1, uint64(40+pi), -1)
		for _, maxNorm := range []float64{0, 1} {
			want, wantCopy := heldReference(p, h, 1, maxNorm)
			for _, s := range heldSchedules(len(heldSizes) - countHeld(held)) {
				t.Run(fmt.Sprintf("held%d/clip=%g/%+v", pi, maxNorm, s), func(t *testing.T) {
					d := newDev()
					var mirror []Span
					if pi == 0 || pi == 2 {
						mirror = []Span{{Off: 39980, N: 20}, {Off: 166536 + 7, N: 2000}}
					}
					e := setupHeld(t, d, p, held, s, mirror, false)
					defer e.Close()
					if err := e.WaitReady(nil, 0); err != nil { // no phase: at once
						t.Fatal(err)
					}
					putHeld(t, d, e, p.gradBytes(0))
					_, sum, err := e.Stats(1)
					if err != nil {
						t.Fatal(err)
					}
					fin := startPhase(t, e, h.Coeffs(1, 1, clipCoef(sum, maxNorm)))
					rerr := readReady(d, e, want.Param, wantCopy)
					if err := <-fin; err != nil {
						t.Fatal(err)
					}
					if rerr != nil {
						t.Fatal(rerr)
					}
					if err := e.FinishUpdate(); err == nil {
						t.Fatal("a second FinishUpdate: no error")
					}
					checkHeldRun(t, d, e, want, wantCopy)
					if sim, ok := d.(*Sim); ok {
						if err := sim.OrderErr(); err != nil {
							t.Fatal(err)
						}
					}
				})
			}
		}
	}
}

// startPhase begins an update phase of e with c for every subgroup
// (StartUpdatePer) and runs FinishUpdate on a goroutine, whose error the
// channel returns.
func startPhase(t *testing.T, e *Engine, c adam.Coeffs) <-chan error {
	t.Helper()
	cs := make([]adam.Coeffs, len(e.sizes))
	for i := range cs {
		cs[i] = c
	}
	if err := e.StartUpdatePer(cs); err != nil {
		t.Fatal(err)
	}
	fin := make(chan error, 1)
	go func() { fin <- e.FinishUpdate() }()
	return fin
}

// readReady waits for each subgroup of e in order on a stream of its own
// and checks its working copy and mirror part against the step's.
func readReady(d Device, e *Engine, param []float32, wantCopy []uint16) error {
	s, _ := d.NewStream()
	ev, _ := d.NewEvent()
	defer d.FreeStream(s)
	defer d.FreeEvent(ev)
	h, err := d.AllocHost(4 * e.maxN)
	if err != nil {
		return err
	}
	defer d.FreeHost(h)
	ats, _ := MirrorLayout(e.o.Mirror)
	for i, n := range e.sizes {
		if err := e.WaitReady(s, i); err != nil {
			return err
		}
		off := e.off[i]
		want := wantCopy[off : off+int64(n)]
		var got []uint16
		if e.HostHeld(i) {
			at, _ := e.HostOffset(off)
			got = unsafe.Slice((*uint16)(unsafe.Pointer(&e.HostWorking().Bytes()[2*at])), n)
		} else {
			at, _ := e.DeviceOffset(off)
			if err := firstErr(d.D2H(s, h, 0, e.work, 2*at, 2*int64(n)), d.Record(ev, s), d.Sync(ev)); err != nil {
				return fmt.Errorf("subgroup %d: reading its working copy after WaitReady: %w", i, err)
			}
			got = u16sOf(h.Bytes()[:2*n])
		}
		if !slices.Equal(got, want) {
			return fmt.Errorf("subgroup %d (host-held %v): its working copy after WaitReady is not the step's", i, e.HostHeld(i))
		}
		for k, sp := range e.o.Mirror {
			lo, hi := max(sp.Off, off), min(sp.Off+sp.N, off+int64(n))
			if lo >= hi {
				continue
			}
			at := ats[k] + lo - sp.Off
			if err := firstErr(d.D2H(s, h, 0, e.mirror, 4*at, 4*(hi-lo)), d.Record(ev, s), d.Sync(ev)); err != nil {
				return fmt.Errorf("subgroup %d: reading its mirror part after WaitReady: %w", i, err)
			}
			m := unsafe.Slice((*float32)(unsafe.Pointer(&h.Bytes()[0])), hi-lo)
			for j := range m {
				if math.Float32bits(m[j]) != math.Float32bits(param[lo+int64(j)]) {
					return fmt.Errorf("subgroup %d: mirror element %d after WaitReady: %g, want %g", i, lo+int64(j), m[j], param[lo+int64(j)])
				}
			}
		}
	}
	return nil
}

// TestReady: Ready is true with no phase; during one it is false for a
// subgroup whose CPU update a Hold gate keeps back and true for one
// WaitReady returned for, and turns true once the gate lets it go.
func TestReady(t *testing.T) {
	d := NewSim(SimOptions{})
	h := adam.DefaultHyper()
	p := heldProblem(adam.BF16, 1, 71, -1)
	e := setupHeld(t, d, p, nil, perfmodel.Schedule{CPU: len(heldSizes)}, nil, false)
	defer e.Close()
	if !e.Ready(3) {
		t.Fatal("Ready(3) before any phase: false")
	}
	putHeld(t, d, e, p.gradBytes(0))
	release := make(chan struct{})
	e.Hold(func(i int) {
		if i == 3 {
			<-release
		}
	})
	fin := startPhase(t, e, h.Coeffs(1, 1, 1))
	err := e.WaitReady(nil, 2)
	ready2, ready3 := e.Ready(2), e.Ready(3)
	close(release)
	if ferr := <-fin; ferr != nil {
		t.Fatal(ferr)
	}
	if err != nil {
		t.Fatal(err)
	}
	if !ready2 || ready3 {
		t.Errorf("during the phase, subgroup 3's update held back: Ready(2) %v, Ready(3) %v; want true, false", ready2, ready3)
	}
	if !e.Ready(3) {
		t.Error("Ready(3) after the phase: false")
	}
}
