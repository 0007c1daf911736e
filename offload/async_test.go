package offload

import (
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// slowOS delays every positioned write, so that a flush outlasts the steps
// that follow it.
type slowOS struct{ checkpoint.FS }

type slowFile struct{ checkpoint.File }

func (s slowOS) OpenFile(name string, flag int, perm os.FileMode) (checkpoint.File, error) {
	f, err := s.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return slowFile{f}, nil
}

func (f slowFile) WriteAt(p []byte, off int64) (int, error) {
	time.Sleep(3 * time.Millisecond)
	return f.File.WriteAt(p, off)
}

// TestSaveAsyncIsolation: a lazy checkpoint of step t holds exactly step
// t's state while steps t+1 and t+2 run during its (slow) flush, and equals
// a synchronous checkpoint of the same state; the training itself is
// bitwise the same as without checkpoints. Run it under -race: the capture
// and the next steps' writes are ordered per subgroup.
func TestSaveAsyncIsolation(t *testing.T) {
	opts := Options{SubgroupSize: 300, GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 1}
	a, b := newTest(t, opts), newTest(t, opts)
	for s := int64(1); s <= 3; s++ {
		fill(a, s)
		fill(b, s)
		mustStep(t, a)
		mustStep(t, b)
	}
	syncDir := filepath.Join(t.TempDir(), "sync")
	if _, err := a.SaveCheckpoint(checkpoint.OS, syncDir, map[string]any{"it": 3}); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(t.TempDir(), "async")
	e, err := checkpoint.NewEngine(slowOS{checkpoint.OS}, root, checkpoint.EngineOptions{ChunkBytes: 4096, RingBytes: 3 * 4096, Writers: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	h, err := a.SaveAsync(e, 3, map[string]any{"it": 3})
	if err != nil {
		t.Fatal(err)
	}
	for s := int64(4); s <= 5; s++ { // run during the flush
		fill(a, s)
		fill(b, s)
		mustStep(t, a)
		mustStep(t, b)
	}
	if h.Done() {
		t.Log("the flush ended before the steps: the test proves less")
	}
	dir, err := h.Wait()
	if err != nil {
		t.Fatal(err)
	}
	// Training with and without the checkpoint: bitwise the same.
	for i := range a.Params() {
		ma, mb := master(t, a, i), master(t, b, i)
		for j := range ma {
			if ma[j] != mb[j] {
				t.Fatalf("param %d element %d: %g with a checkpoint, %g without", i, j, ma[j], mb[j])
			}
		}
	}
	// The lazy checkpoint holds step 3's state: the synchronous one's.
	want, err := checkpoint.Open(checkpoint.OS, filepath.Join(syncDir, "step-000000003"), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer want.Close()
	got, err := checkpoint.Open(checkpoint.OS, dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer got.Close()
	if err := got.Verify(); err != nil {
		t.Fatal(err)
	}
	for _, te := range want.Manifest.Tensors {
		x, y := make([]byte, te.Bytes), make([]byte, te.Bytes)
		if err := want.ReadTensor(te.Name, x); err != nil {
			t.Fatal(err)
		}
		if err := got.ReadTensor(te.Name, y); err != nil {
			t.Fatal(err)
		}
		if string(x) != string(y) {
			t.Fatalf("tensor %s differs from the synchronous checkpoint of the same step", te.Name)
		}
	}
	// And it loads: a fresh optimizer resumes from it.
	c := newTest(t, opts)
	if _, _, err := c.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	if c.StepCount() != 3 {
		t.Fatalf("resumed at step %d", c.StepCount())
	}
}

// TestSaveAsyncFailure: a background save that fails is reported by the
// next Step, once, without taking the step.
func TestSaveAsyncFailure(t *testing.T) {
	o := newTest(t, Options{SubgroupSize: 300})
	fill(o, 1)
	mustStep(t, o)
	root := filepath.Join(t.TempDir(), "root")
	e, err := checkpoint.NewEngine(checkpoint.OS, root, checkpoint.EngineOptions{ChunkBytes: 4096, RingBytes: 8192})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	// The root replaced by a file: the save fails in the background.
	if err := os.RemoveAll(root); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(root, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	h, err := o.SaveAsync(e, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Wait(); err == nil {
		t.Fatal("a save under a file succeeded")
	}
	fill(o, 2)
	if _, err := o.Step(StepArgs{}); err == nil {
		t.Fatal("Step did not report the failed checkpoint")
	}
	if o.StepCount() != 1 {
		t.Fatalf("the failed checkpoint's Step advanced to %d", o.StepCount())
	}
	mustStep(t, o) // reported once
	if _, err := o.SaveAsync(e, 0, nil); err == nil {
		t.Error("a step below the counter accepted")
	}
	// Acknowledged (the user saw it from the handle): the next Step is
	// taken, not failed with it again.
	root2 := filepath.Join(t.TempDir(), "root2")
	e2, err := checkpoint.NewEngine(checkpoint.OS, root2, checkpoint.EngineOptions{ChunkBytes: 4096, RingBytes: 8192})
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	if err := os.RemoveAll(root2); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(root2, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	h, err = o.SaveAsync(e2, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Wait(); err == nil {
		t.Fatal("a save under a file succeeded")
	}
	o.AcknowledgeSave(nil) // nothing: not this save
	o.AcknowledgeSave(h)
	fill(o, 3)
	mustStep(t, o)
	if o.StepCount() != 3 {
		t.Fatalf("after the acknowledged failure: step %d, want 3", o.StepCount())
	}
}

func mustStep(t *testing.T, o *Optimizer) {
	t.Helper()
	res, err := o.Step(StepArgs{})
	if err != nil || res.Skipped {
		t.Fatalf("Step: %+v %v", res, err)
	}
}

// TestPlan: with a profile the optimizer plans its update phase: all on
// the CPU, the time the CPU fit gives for its parameters.
func TestPlan(t *testing.T) {
	p := &perfmodel.Profile{Format: perfmodel.ProfileFormat, Version: perfmodel.ProfileVersion,
		CPU: []perfmodel.CPUFit{{Threads: 1, GradDType: adam.BF16, Fit: perfmodel.Fit{Rate: 1e6}}}}
	o, err := New(testParams, Options{GradDType: adam.BF16, WorkingDType: adam.BF16, Threads: 2, Profile: p})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	plan, ok := o.Plan()
	if !ok || plan.CPU != 1 || plan.GPU != 0 || math.Abs(plan.Makespan-float64(o.NumParams())/1e6) > 1e-12 {
		t.Fatalf("plan %+v (%v)", plan, ok)
	}
	// float16 gradients plan with the bfloat16 rate (the same bytes);
	// float32 ones have none.
	h, err := New(testParams, Options{GradDType: adam.F16, Threads: 2, Profile: p})
	if err != nil {
		t.Fatalf("float16 with a bfloat16 rate: %v", err)
	}
	h.Close()
	if _, err := New(testParams, Options{GradDType: adam.F32, Profile: p}); err == nil {
		t.Error("a profile without float32 rates planned a float32 optimizer")
	}
	q, _ := New(testParams, Options{})
	defer q.Close()
	if _, ok := q.Plan(); ok {
		t.Error("a plan without a profile")
	}
}

// TestPlanCalibrate: without a profile, Calibrate measures the CPU at New
// and plans with it.
func TestPlanCalibrate(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("calibration takes a second (much more under -race)")
	}
	o, err := New(testParams, Options{Calibrate: true, Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	plan, ok := o.Plan()
	if !ok || plan.CPU != 1 || !(plan.Makespan > 0) {
		t.Fatalf("plan %+v (%v)", plan, ok)
	}
	t.Logf("calibrated plan: %.3f ms for %d parameters", 1e3*plan.Makespan, o.NumParams())
}

// TestPlanCalibrateSim: Calibrate with the simulated device measures the
// CPU only (the simulated device has no rates to measure), so the model
// keeps every subgroup on the CPU; Options says what was measured; with a
// forced Schedule nothing is measured.
func TestPlanCalibrateSim(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("calibration takes a second (much more under -race)")
	}
	base := Options{Calibrate: true, Threads: 1, GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300,
		Device: scheduler.NewSim(scheduler.SimOptions{}), GPUBudget: 1 << 30}
	o, err := New(testParams, base)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	plan, ok := o.Plan()
	n := len(o.Subgroups())
	if !ok || plan.CPU != n || plan.GPU != 0 || plan.Resident != 0 || !(plan.Makespan > 0) {
		t.Fatalf("plan %+v (%v), want all %d subgroups on the CPU", plan, ok, n)
	}
	if p := o.Options().Profile; p == nil || p.GPU != nil || len(p.CPU) != 1 || p.CPU[0].Threads != 1 {
		t.Fatalf("Options().Profile = %+v, want the measured CPU rate at 1 thread and no GPU", p)
	}
	forced := base
	forced.Schedule = &perfmodel.Schedule{CPU: n - 1, Resident: 1}
	f, err := New(testParams, forced)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if s, _ := f.Schedule(); s != *forced.Schedule || f.Options().Profile != nil {
		t.Fatalf("forced schedule %+v: engine %+v, profile %v", *forced.Schedule, s, f.Options().Profile)
	}
}
