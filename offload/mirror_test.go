package offload

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// The fp32 mirror (DeviceMasters) after every path that changes
// the master weights, read through a trainer's own stream (the ordering
// check sees the reads).

var rvParams = []Param{
	{Name: "a.w", Shape: []int{30, 20}},
	{Name: "ln.b", Shape: []int{20}, Group: 1},
	{Name: "empty", Shape: []int{0, 5}, Group: 1},
	{Name: "big", Shape: []int{50, 30}},
	{Name: "ln.w", Shape: []int{20}},
	{Name: "tail", Shape: []int{40}, Group: 1},
}

var rvMasters = []string{"tail", "ln.b", "empty", "big", "ln.w"}

func rvOpts() Options {
	return Options{GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 0.5, SubgroupSize: 256, Threads: 2, Groups: twoGroups}
}

func rvSchedules() []perfmodel.Schedule {
	return []perfmodel.Schedule{
		{CPU: 10}, {GPU: 10}, {Resident: 10},
		{CPU: 4, GPU: 3, Resident: 3},
		{CPU: 5, GPU: 3, Resident: 2, UpcastOnGPU: true},
	}
}

type rvMirror struct {
	o   *Optimizer
	io  *streamIO
	sim *scheduler.Sim
	m   map[int]DeviceTensor
}

func newRvMirror(t *testing.T, o *Optimizer, sim *scheduler.Sim) *rvMirror {
	t.Helper()
	r := &rvMirror{o: o, io: newStreamIO(t, sim, 1<<16), sim: sim}
	r.views(t)
	return r
}

func (r *rvMirror) views(t *testing.T) {
	t.Helper()
	r.m = map[int]DeviceTensor{}
	for _, name := range rvMasters {
		i, _ := r.o.Index(name)
		m, err := r.o.DeviceMaster(i)
		if err != nil {
			t.Fatal(err)
		}
		if m.Len != r.o.Params()[i].Len {
			t.Fatalf("%s: %d elements", name, m.Len)
		}
		r.m[i] = m
	}
}

// check compares every DeviceMaster with want's Master bitwise (want may
// be r.o itself), and the device's ordering.
func (r *rvMirror) check(t *testing.T, when string, want *Optimizer) {
	t.Helper()
	for i, m := range r.m {
		w, err := want.Master(i)
		if err != nil {
			t.Fatal(err)
		}
		if m.Len == 0 {
			continue
		}
		got := r.io.get(t, m)
		g := unsafe.Slice((*float32)(unsafe.Pointer(&got[0])), m.Len)
		for j := range w {
			if math.Float32bits(g[j]) != math.Float32bits(w[j]) {
				t.Fatalf("%s: DeviceMaster(%s)[%d] = %g, want %g", when, m.Name, j, g[j], w[j])
			}
		}
	}
	if err := r.sim.OrderErr(); err != nil {
		t.Fatalf("%s: %v", when, err)
	}
}

func rvRandom(n int, seed uint64) []float32 {
	r := rand.New(rand.NewPCG(seed, 5))
	v := make([]float32, n)
	for j := range v {
		v[j] = float32(r.NormFloat64())
	}
	return v
}

// TestMirrorPaths: after every path that changes the master weights
// (SyncDevice, host and device steps, a skipped step, SetParam, WriteState,
// LoadCheckpoint, SaveAsync with its Hold gates), with two groups and
// DeviceMasters named out of the flat order, the mirror read on the
// trainer's own stream is the host-only optimizer's master weights, bit for
// bit, and the ordering check stays quiet.
func TestMirrorPaths(t *testing.T) {
	for _, s := range rvSchedules() {
		t.Run(fmt.Sprintf("%+v", s), func(t *testing.T) {
			base := rvOpts()
			ref := newWith(t, rvParams, base)
			dopts, sim := deviceOpts(base, s)
			dopts.DeviceMasters = rvMasters
			o := newWith(t, rvParams, dopts)
			if n := len(o.Subgroups()); n != 10 {
				t.Fatalf("%d subgroups", n)
			}
			mr := newRvMirror(t, o, sim)
			if err := o.SyncDevice(); err != nil {
				t.Fatal(err)
			}
			mr.check(t, "SyncDevice", ref)
			both := func(step int64, onDevice bool) {
				t.Helper()
				fill(ref, step)
				if onDevice {
					grads, _ := views(t, o)
					writeGrads(t, mr.io, grads, ref)
				} else {
					fill(o, step)
				}
				a, err := ref.Step(StepArgs{LossScale: 4})
				if err != nil {
					t.Fatal(err)
				}
				b, err := o.Step(StepArgs{LossScale: 4, GradOnDevice: onDevice})
				if err != nil {
					t.Fatal(err)
				}
				if a.Step != b.Step || a.Skipped != b.Skipped {
					t.Fatalf("step %d: %v vs %v", step, a, b)
				}
			}
			both(1, false)
			mr.check(t, "step 1", ref)
			both(2, true)
			mr.check(t, "step 2 on device", ref)
			// A skipped step.
			for _, x := range []*Optimizer{ref, o} {
				fill(x, 3)
				g := x.Grad(3)
				g.Uint16()[7] = 0x7fc0 // NaN
				res, err := x.Step(StepArgs{})
				if err != nil || !res.Skipped {
					t.Fatalf("skip: %v %v", res, err)
				}
			}
			mr.check(t, "skipped", ref)
			// SetParam then SyncDevice.
			i, _ := o.Index("big")
			v := rvRandom(o.Params()[i].Len, 9)
			for _, x := range []*Optimizer{ref, o} {
				if err := x.SetParam("big", v); err != nil {
					t.Fatal(err)
				}
			}
			if err := o.SyncDevice(); err != nil {
				t.Fatal(err)
			}
			mr.check(t, "SetParam+SyncDevice", ref)
			// WriteState, then a host-gradient Step (Load inside).
			j, _ := o.Index("tail")
			w := rvRandom(o.Params()[j].Len, 10)
			for _, x := range []*Optimizer{ref, o} {
				if err := x.WriteState(j, MasterWeights, w); err != nil {
					t.Fatal(err)
				}
			}
			both(4, false)
			mr.check(t, "WriteState+step", ref)
			// A checkpoint, more steps, and back.
			rootO, rootR := t.TempDir(), t.TempDir()
			if _, err := o.SaveCheckpoint(checkpoint.OS, rootO, nil); err != nil {
				t.Fatal(err)
			}
			if _, err := ref.SaveCheckpoint(checkpoint.OS, rootR, nil); err != nil {
				t.Fatal(err)
			}
			both(5, true)
			mr.check(t, "step 5", ref)
			if _, _, err := o.LoadCheckpoint(checkpoint.OS, rootO); err != nil {
				t.Fatal(err)
			}
			if _, _, err := ref.LoadCheckpoint(checkpoint.OS, rootR); err != nil {
				t.Fatal(err)
			}
			if err := o.SyncDevice(); err != nil {
				t.Fatal(err)
			}
			mr.check(t, "LoadCheckpoint+SyncDevice", ref)
			both(6, true)
			mr.check(t, "step 6", ref)
			// SaveAsync with a slow flush: the next steps wait per
			// subgroup (Hold).
			e, err := checkpoint.NewEngine(slowOS{checkpoint.OS}, t.TempDir(), checkpoint.EngineOptions{ChunkBytes: 4096, RingBytes: 3 * 4096, Writers: 2})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			h, err := o.SaveAsync(e, 7, nil)
			if err != nil {
				t.Fatal(err)
			}
			both(7, false)
			mr.check(t, "step 7 during SaveAsync", ref)
			both(8, true)
			mr.check(t, "step 8 during SaveAsync", ref)
			if _, err := h.Wait(); err != nil {
				t.Fatal(err)
			}
			sameState(t, synced(t, ref), synced(t, o.workingNow(t)))
			mr.check(t, "end (self)", o)
		})
	}
}

// TestMirrorFaults: the k-th copy or launch of a Step fails for every
// k: after the error the mirror equals the master weights bitwise, and the
// state is either the step before or after (no update twice).
func TestMirrorFaults(t *testing.T) {
	for _, s := range rvSchedules() {
		t.Run(fmt.Sprintf("%+v", s), func(t *testing.T) {
			base := rvOpts()
			before := newWith(t, rvParams, base)
			fill(before, 1)
			if _, err := before.Step(StepArgs{}); err != nil {
				t.Fatal(err)
			}
			after := newWith(t, rvParams, base)
			for st := int64(1); st <= 2; st++ {
				fill(after, st)
				if _, err := after.Step(StepArgs{}); err != nil {
					t.Fatal(err)
				}
			}
			counts := map[string]int{}
			for k := 1; ; k++ {
				opts, d := deviceOpts(base, s)
				opts.DeviceMasters = rvMasters
				o := newWith(t, rvParams, opts)
				mr := newRvMirror(t, o, d)
				fill(o, 1)
				if _, err := o.Step(StepArgs{}); err != nil {
					t.Fatal(err)
				}
				onDevice := k%2 == 0
				fill(o, 2)
				if onDevice {
					grads, _ := views(t, o)
					writeGrads(t, mr.io, grads, o)
				}
				d.FailAfter(k)
				res, err := o.Step(StepArgs{GradOnDevice: onDevice})
				d.FailAfter(0)
				if err == nil {
					if k < 10 {
						t.Fatalf("no fault at %d", k)
					}
					break
				}
				var fe *scheduler.FaultError
				switch {
				case errors.Is(err, scheduler.ErrBroken):
					counts["broken"]++
					continue
				case errors.As(err, &fe):
					counts[fe.Op]++
				}
				switch res.Step {
				case 1:
					counts["untouched"]++
					t.Logf("op %d: %v", k, err)
					sameState(t, before, synced(t, o))
					mr.check(t, fmt.Sprintf("op %d (untouched: %v)", k, err), before)
				case 2:
					t.Logf("op %d: %v", k, err)
					_ = o.Working(0)
					sameState(t, after, synced(t, o))
					mr.check(t, fmt.Sprintf("op %d (%v)", k, err), after)
				default:
					t.Fatalf("op %d: step %d", k, res.Step)
				}
			}
			t.Logf("%v", counts)
		})
	}
}

// TestMirrorBroken: a device fault (a failed wait) in a Step, then
// LoadCheckpoint (a new engine), new views, SyncDevice: the mirror is the
// checkpoint's master weights.
func TestMirrorBroken(t *testing.T) {
	for _, s := range rvSchedules() {
		t.Run(fmt.Sprintf("%+v", s), func(t *testing.T) {
			base := rvOpts()
			ref := newWith(t, rvParams, base)
			opts, d := deviceOpts(base, s)
			opts.DeviceMasters = rvMasters
			o := newWith(t, rvParams, opts)
			fill(o, 1)
			fill(ref, 1)
			for _, x := range []*Optimizer{o, ref} {
				if _, err := x.Step(StepArgs{}); err != nil {
					t.Fatal(err)
				}
			}
			root := t.TempDir()
			if _, err := o.SaveCheckpoint(checkpoint.OS, root, nil); err != nil {
				t.Fatal(err)
			}
			mr := newRvMirror(t, o, d)
			old := mr.m
			broken := false
			for k := 1; k < 40 && !broken; k++ {
				fill(o, 2)
				d.FailSync(k)
				_, err := o.Step(StepArgs{})
				d.FailSync(0)
				broken = errors.Is(err, scheduler.ErrBroken)
				if !broken {
					// Undo: back to the checkpoint.
					if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); err != nil {
						t.Fatal(err)
					}
				}
			}
			if !broken {
				t.Fatal("never broken")
			}
			if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); err != nil {
				t.Fatal(err)
			}
			for _, m := range old {
				if err := m.Valid(); !errors.Is(err, ErrStaleView) {
					t.Fatalf("old view: %v", err)
				}
			}
			mr.views(t)
			if err := o.SyncDevice(); err != nil {
				t.Fatal(err)
			}
			mr.check(t, "after LoadCheckpoint", ref)
			for st := int64(2); st <= 3; st++ {
				fill(o, st)
				fill(ref, st)
				for _, x := range []*Optimizer{o, ref} {
					if _, err := x.Step(StepArgs{}); err != nil {
						t.Fatal(err)
					}
				}
				mr.check(t, fmt.Sprintf("step %d", st), ref)
			}
		})
	}
}

// TestMirrorNoAllocs: with DeviceMasters, Step allocates nothing on every
// schedule, with and without GradOnDevice.
func TestMirrorNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	for _, s := range rvSchedules() {
		opts, _ := deviceOpts(rvOpts(), s)
		opts.DeviceMasters = rvMasters
		o := newWith(t, rvParams, opts)
		fill(o, 1)
		if _, err := o.Step(StepArgs{LossScale: 2}); err != nil {
			t.Fatal(err)
		}
		for _, onDevice := range []bool{true, false} {
			var err error
			if a := testing.AllocsPerRun(10, func() { _, err = o.Step(StepArgs{LossScale: 2, GradOnDevice: onDevice}) }); a != 0 || err != nil {
				t.Fatalf("%+v: Step (GradOnDevice %v) allocates %v times (error %v)", s, onDevice, a, err)
			}
		}
	}
}

// TestMirrorOnlyEmpty: DeviceMasters naming only a zero-length parameter
// makes no mirror; its view is valid and empty, and steps run.
func TestMirrorOnlyEmpty(t *testing.T) {
	opts, _ := deviceOpts(rvOpts(), perfmodel.Schedule{CPU: 4, GPU: 3, Resident: 3})
	opts.DeviceMasters = []string{"empty"}
	o := newWith(t, rvParams, opts)
	i, _ := o.Index("empty")
	m, err := o.DeviceMaster(i)
	if err != nil || m.Len != 0 || m.Vec.N != 0 {
		t.Fatalf("DeviceMaster(empty) = %+v, %v; want an empty view", m.Vec, err)
	}
	if err := m.Valid(); err != nil {
		t.Fatal(err)
	}
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	fill(o, 1)
	if _, err := o.Step(StepArgs{}); err != nil {
		t.Fatal(err)
	}
}

// TestDeviceMastersOwned: the optimizer keeps its own copy of
// Options.DeviceMasters (changing the caller's slice, or the one Options
// returns, changes nothing), and each DeviceMaster starts on a 16-byte
// boundary of the mirror whatever precedes it.
func TestDeviceMastersOwned(t *testing.T) {
	params := []Param{{Name: "a", Shape: []int{3}}, {Name: "b", Shape: []int{1}}, {Name: "c", Shape: []int{8}}, {Name: "d", Shape: []int{5}}}
	names := []string{"a", "c", "d"}
	o, err := New(params, Options{GradDType: adam.BF16, WorkingDType: adam.BF16, Device: scheduler.NewSim(scheduler.SimOptions{}), DeviceMasters: names})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	names[1] = "b"
	o.Options().DeviceMasters[2] = "b"
	for i, want := range []int64{0, -1, 4, 12} {
		m, err := o.DeviceMaster(i)
		if want < 0 {
			if err == nil {
				t.Errorf("DeviceMaster(%s): no error, but it is not in DeviceMasters", params[i].Name)
			}
			continue
		}
		if err != nil {
			t.Fatalf("DeviceMaster(%s): %v", params[i].Name, err)
		}
		if m.Vec.Off != want || m.Vec.Off%4 != 0 {
			t.Errorf("DeviceMaster(%s) at mirror element %d, want %d (16-byte aligned)", params[i].Name, m.Vec.Off, want)
		}
	}
}
