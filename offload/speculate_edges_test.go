package offload

import (
	"errors"
	"slices"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// specRig is the speculation tests' set-up: ref, the host optimizer (the
// serial path), and b, the same parameters on the simulated device with
// the held ones in OffloadParam and Options.Speculate.
type specRig struct {
	ref, b *Optimizer
	sim    *scheduler.Sim
	io     *streamIO
	host   scheduler.Host
	held   []string
}

var specHeld = []string{"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}

func specBase() Options {
	return Options{GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 0.5, SubgroupSize: 400, Threads: 2}
}

// newRig makes a specRig over ps with held in OffloadParam (nil: none),
// base's DeviceMasters and ResidentFirst b's alone,
// the schedule s of the other subgroups (zero: base.Profile's choice) and
// budget bytes of saves.
func newRig(t *testing.T, ps []Param, base Options, held []string, s perfmodel.Schedule, budget int64) *specRig {
	t.Helper()
	r := &specRig{held: held}
	hb := base
	hb.DeviceMasters, hb.ResidentFirst, hb.GPUBudget, hb.Profile = nil, false, 0, nil // the device's
	r.ref = newWith(t, ps, hb)
	r.sim = scheduler.NewSim(scheduler.SimOptions{})
	o := base
	o.Device, o.OverlapBackward, o.OffloadParam, o.Speculate = r.sim, true, held, budget
	if s != (perfmodel.Schedule{}) { // else the profile's choice
		o.Schedule = &s
	}
	r.b = newWith(t, ps, o)
	r.io = newStreamIO(t, r.sim, 1<<16)
	h, err := r.sim.AllocHost(1 << 16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.sim.FreeHost(h) })
	r.host = h
	if err := r.b.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	return r
}

// newSpecRig is newRig over testParams with specHeld, speculating from the
// first backward (New pauses it until a Step that did not clip).
func newSpecRig(t *testing.T, base Options, s perfmodel.Schedule, budget int64) *specRig {
	t.Helper()
	r := newRig(t, testParams, base, specHeld, s, budget)
	r.b.specPaused = false
	return r
}

// backward writes step k's gradients (scaled by scale; a NaN in a device
// parameter's with nanDev) into ref's host buffers and b's device/host
// gradients, the last parameters first, each followed by GradsFinal, then
// waits for the trainer's stream (and, with wait, for the speculation).
func (r *specRig) backward(t *testing.T, k int64, scale float32, nanDev, wait bool) {
	t.Helper()
	fill(r.ref, k)
	scaleGrads(r.ref, scale)
	if nanDev {
		r.ref.Grad(4).Uint16()[1] = 0x7fc0 // ln_f.bias: not held
	}
	r.send(t, false, wait)
}

// send writes ref's gradients where b's trainer would, the last parameter
// first (a held one's into HostGrad, the others' H2D into DeviceGrad on the
// trainer's stream; with host, into b's host Grad too, for a Step without
// GradOnDevice), each followed by GradsFinal, then waits for the stream
// and, with wait, for the speculation.
func (r *specRig) send(t *testing.T, host, wait bool) {
	t.Helper()
	at := int64(0)
	for i := len(r.b.Params()) - 1; i >= 0; i-- {
		src := tensorBytes(r.ref.Grad(i))
		if host {
			copy(tensorBytes(r.b.Grad(i)), src)
		}
		if slices.Contains(r.held, r.b.Params()[i].Name) {
			hg, err := r.b.HostGrad(i)
			if err != nil {
				t.Fatal(err)
			}
			copy(hg.Bytes, src)
		} else {
			g, err := r.b.DeviceGrad(i)
			if err != nil {
				t.Fatal(err)
			}
			copy(r.host.Bytes()[at:], src)
			if err := r.sim.H2D(r.io.s, g.Vec.Mem, g.Vec.Off*int64(g.DType.Size()), r.host, at, g.Bytes()); err != nil {
				t.Fatal(err)
			}
			at += g.Bytes()
		}
		if err := r.b.GradsFinal(scheduler.Stream(r.io.s), i); err != nil {
			t.Fatal(err)
		}
	}
	if err := errors.Join(r.sim.Record(r.io.ev, r.io.s), r.sim.Sync(r.io.ev)); err != nil {
		t.Fatal(err)
	}
	if wait {
		r.b.eng.WaitSpeculation()
	}
}

// step steps both (b with GradOnDevice) and checks they agree on what
// happened.
func (r *specRig) step(t *testing.T, args StepArgs) (StepResult, StepResult) {
	t.Helper()
	rr, err := r.ref.Step(args)
	if err != nil {
		t.Fatal(err)
	}
	args.GradOnDevice = true
	rb, err := r.b.Step(args)
	if err != nil {
		t.Fatal(err)
	}
	if rr.Skipped != rb.Skipped || rr.ClipCoef != rb.ClipCoef || rr.Step != rb.Step {
		t.Fatalf("reference %+v, speculating %+v", rr, rb)
	}
	return rr, rb
}

// sameWorking compares Working(i) of both, bit for bit.
func sameWorking(t *testing.T, what string, ref, b *Optimizer, i int) {
	t.Helper()
	w, g := ref.Working(i).Uint16(), b.Working(i).Uint16()
	for j := range w {
		if w[j] != g[j] {
			t.Errorf("%s: Working(%d)[%d] = %#04x, serial path %#04x", what, i, j, g[j], w[j])
			return
		}
	}
}

// TestSpeculateWorkingDuring: Working of a stale host copy between the
// backward and the Step gives the last step's copy (the speculation is
// restored first), and after a skipped step too.
func TestSpeculateWorkingDuring(t *testing.T) {
	r := newSpecRig(t, specBase(), perfmodel.Schedule{CPU: 2, GPU: 1, Resident: 1}, 1<<20)
	hi, _ := r.b.Index(specHeld[0])
	// Step 1: kept, with GradOnDevice (the mirror is stale).
	r.backward(t, 1, 0.01, false, true)
	if _, rb := r.step(t, StepArgs{}); rb.Speculated == 0 {
		t.Fatal("step 1 kept nothing")
	}
	// (No Working here: the host mirror stays stale, as after any Step
	// with GradOnDevice that nobody read the copy after.)
	// Step 2: the backward speculates; the trainer reads Working (a log of
	// the weights, an EMA) between the backward and the Step; the step is
	// then skipped (a NaN in a device gradient).
	r.backward(t, 2, 0.01, true, true)
	sameWorking(t, "between GradsFinal and Step", r.ref, r.b, hi)
	if rr, _ := r.step(t, StepArgs{}); !rr.Skipped {
		t.Fatal("step 2 not skipped")
	}
	sameWorking(t, "after the skipped step", r.ref, r.b, hi)
}

// TestSpeculateWorkingRace is TestSpeculateWorkingDuring without waiting
// for the speculation (under -race: Working never reads the host-held
// copy while the worker writes it).
func TestSpeculateWorkingRace(t *testing.T) {
	r := newSpecRig(t, specBase(), perfmodel.Schedule{CPU: 4}, 1<<20)
	hi, _ := r.b.Index(specHeld[0])
	r.backward(t, 1, 0.01, false, true)
	r.step(t, StepArgs{})
	r.backward(t, 2, 0.01, false, false)
	_ = r.b.Working(hi)
	r.step(t, StepArgs{})
}

// TestSpeculateHoldRace: a lazy checkpoint's gate (Hold) set and removed
// while the worker runs (settle in the next Step): no race, the serial
// state.
func TestSpeculateHoldRace(t *testing.T) {
	r := newSpecRig(t, specBase(), perfmodel.Schedule{CPU: 4}, 1<<20)
	ce := smallEngine(t, checkpoint.OS, t.TempDir())
	r.backward(t, 1, 0.01, false, true)
	r.step(t, StepArgs{})
	h, err := r.b.SaveAsync(ce, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Wait(); err != nil { // captured and durable: the gate still set
		t.Fatal(err)
	}
	r.backward(t, 2, 0.01, false, false) // the worker reads e.gate
	r.step(t, StepArgs{})                // settle: Hold(nil)
	sameState(t, synced(t, r.ref), synced(t, r.b.workingNow(t)))
}

// TestSpeculateSaveAsyncDuring: SaveAsync between the backward and the
// Step saves the last step's state, not the speculation's.
func TestSpeculateSaveAsyncDuring(t *testing.T) {
	r := newSpecRig(t, specBase(), perfmodel.Schedule{CPU: 2, GPU: 1, Resident: 1}, 1<<20)
	root := t.TempDir()
	ce := smallEngine(t, checkpoint.OS, root)
	r.backward(t, 1, 0.01, false, true)
	r.step(t, StepArgs{})
	r.backward(t, 2, 0.01, false, true) // speculated: step 2's update of the held subgroups
	h, err := r.b.SaveAsync(ce, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Wait(); err != nil {
		t.Fatal(err)
	}
	got := loaded(t, specBase(), root)
	for _, name := range specHeld {
		i, _ := r.ref.Index(name)
		want, g := master(t, r.ref, i), master(t, got, i)
		for j := range want {
			if want[j] != g[j] {
				t.Fatalf("checkpoint of step 1 (SaveAsync between GradsFinal and Step): %s.master[%d] = %g, serial path %g", name, j, g[j], want[j])
			}
		}
	}
}

// TestSpeculateSnapshotViews: Snapshot's views stay the state's until the
// next Step: the backward after a Snapshot does not speculate.
func TestSpeculateSnapshotViews(t *testing.T) {
	r := newSpecRig(t, specBase(), perfmodel.Schedule{CPU: 4}, 1<<20)
	r.backward(t, 1, 0.01, false, true)
	r.step(t, StepArgs{})
	snap, err := r.b.Snapshot(nil)
	if err != nil {
		t.Fatal(err)
	}
	before := map[string][]byte{}
	for _, ts := range snap.Tensors {
		var b []byte
		for _, d := range ts.Data {
			b = append(b, d...)
		}
		before[ts.Name] = b
	}
	r.backward(t, 2, 0.01, false, true) // no Step, SetParam or LoadCheckpoint yet
	for _, ts := range snap.Tensors {
		var b []byte
		for _, d := range ts.Data {
			b = append(b, d...)
		}
		if !slices.Equal(b, before[ts.Name]) {
			t.Fatalf("Snapshot view %s changed before the next Step (GradsFinal's speculation wrote it)", ts.Name)
		}
	}
}

// TestSpeculateCloseDuring: Close between the backward and the Step leaves
// the Working views with the last step's copy.
func TestSpeculateCloseDuring(t *testing.T) {
	r := newSpecRig(t, specBase(), perfmodel.Schedule{CPU: 4}, 1<<20)
	hi, _ := r.b.Index(specHeld[0])
	r.backward(t, 1, 0.01, false, true)
	r.step(t, StepArgs{})
	r.backward(t, 2, 0.01, false, true)
	if err := r.b.Close(); err != nil {
		t.Fatal(err)
	}
	sameWorking(t, "after Close", r.ref, r.b, hi)
}
