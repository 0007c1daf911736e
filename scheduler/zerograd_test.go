package scheduler

import (
	"errors"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestEngineZeroGrad: ZeroGrad clears every byte of the device gradients
// and orders itself with the copies around it (the simulated device's
// ordering check sees a gradient written by another stream, zeroed, and
// read back).
func TestEngineZeroGrad(t *testing.T) { forDevices(t, testEngineZeroGrad) }

func testEngineZeroGrad(t *testing.T, newDev func() Device) {
	for _, gd := range []adam.DType{adam.F32, adam.BF16} {
		p := newProblem(12, gd, false, 1, 3)
		d := newDev()
		e := setup(t, d, p, []int{4, 4, 4}, perfmodel.Schedule{CPU: 1, GPU: 1, Resident: 1}, false)
		put(t, d, e.grad, 0, p.gradBytes(0))
		if err := e.ZeroGrad(); err != nil {
			t.Fatal(err)
		}
		for i, b := range get(t, d, e.grad, 0, e.gb*12) {
			if b != 0 {
				t.Fatalf("%v: byte %d of the gradients is %#x after ZeroGrad", gd, i, b)
			}
		}
		if finite, ss, err := e.Stats(1); err != nil || !finite || ss != 0 {
			t.Fatalf("%v: Stats after ZeroGrad: %v %g %v", gd, finite, ss, err)
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestEngineZeroGradFault: a memset that cannot be enqueued is ZeroGrad's
// error and leaves the engine working; a failed wait breaks it.
func TestEngineZeroGradFault(t *testing.T) {
	p := newProblem(12, adam.BF16, false, 1, 3)
	d := NewSim(SimOptions{})
	e := setup(t, d, p, []int{4, 4, 4}, perfmodel.Schedule{GPU: 3}, false)
	defer e.Close()
	d.FailAfter(1)
	if err := e.ZeroGrad(); !errors.Is(err, ErrInjected) || e.Broken() {
		t.Fatalf("ZeroGrad with its memset failing: %v (broken %v)", err, e.Broken())
	}
	if err := e.ZeroGrad(); err != nil {
		t.Fatalf("ZeroGrad after the failed one: %v", err)
	}
	d.FailSync(1)
	if err := e.ZeroGrad(); !errors.Is(err, ErrInjected) || !e.Broken() {
		t.Fatalf("ZeroGrad with its wait failing: %v (broken %v)", err, e.Broken())
	}
	if err := e.ZeroGrad(); !errors.Is(err, ErrBroken) {
		t.Fatalf("ZeroGrad of a broken engine: %v", err)
	}
}

// TestSimHostView: the simulated device's memory read and written through
// HostView is what its copies see; freed memory and another device's
// memory are errors.
func TestSimHostView(t *testing.T) {
	d := NewSim(SimOptions{})
	m, err := d.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	b, err := d.HostView(Vec{Mem: m, Off: 4, N: 8}, 2)
	if err != nil || len(b) != 16 {
		t.Fatalf("HostView: %d bytes, %v", len(b), err)
	}
	b[0], b[15] = 7, 9
	got := get(t, d, m, 0, 64)
	if got[8] != 7 || got[23] != 9 || got[7] != 0 || got[24] != 0 {
		t.Fatalf("the device's bytes 7, 8, 23, 24: %v", got[7:25])
	}
	if _, err := d.HostView(Vec{Mem: m, Off: 30, N: 4}, 2); err == nil || !strings.Contains(err.Error(), "outside") {
		t.Fatalf("a range past the end: %v", err)
	}
	if err := d.FreeMem(m); err != nil {
		t.Fatal(err)
	}
	if _, err := d.HostView(Vec{Mem: m, N: 4}, 2); err == nil || !strings.Contains(err.Error(), "freed") {
		t.Fatalf("freed memory: %v", err)
	}
	if _, err := d.HostView(Vec{Mem: otherMem{}, N: 4}, 2); err == nil || !strings.Contains(err.Error(), "not the simulated device's") {
		t.Fatalf("another device's memory: %v", err)
	}
}

type otherMem struct{}

func (otherMem) Len() int64 { return 64 }
