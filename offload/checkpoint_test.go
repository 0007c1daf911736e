package offload

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
)

// resumeOpts exercise everything that must survive a resume: amsgrad, a
// 16-bit gradient and working copy, clipping, subgroups that cut parameters.
func resumeOpts() Options {
	h := adam.DefaultHyper()
	h.AMSGrad = true
	return Options{Hyper: h, SubgroupSize: 97, GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 0.5}
}

type trainerState struct {
	Iteration int64  `json:"iteration"`
	DataPos   int64  `json:"data_pos"`
	RNG       []byte `json:"rng"`
}

func runSteps(t *testing.T, o *Optimizer, from, to int64) {
	t.Helper()
	for s := from; s <= to; s++ {
		fill(o, s)
		if _, err := o.Step(StepArgs{LossScale: 16}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestResumeHelper is the child process of TestResumeBitwise; it does
// nothing unless DOS_RESUME_PHASE is set.
func TestResumeHelper(t *testing.T) {
	phase, dir := os.Getenv("DOS_RESUME_PHASE"), os.Getenv("DOS_RESUME_DIR")
	if phase == "" {
		t.Skip("child process of TestResumeBitwise")
	}
	switch phase {
	case "first":
		o := newTest(t, resumeOpts())
		runSteps(t, o, 1, 5)
		if _, err := o.SaveCheckpoint(checkpoint.OS, filepath.Join(dir, "run"), map[string]any{
			"trainer": trainerState{Iteration: 5, DataPos: 12345, RNG: []byte{1, 2, 3}},
		}); err != nil {
			t.Fatal(err)
		}
	case "second":
		o, err := New(testParams, resumeOpts()) // master weights zero: all must come from the checkpoint
		if err != nil {
			t.Fatal(err)
		}
		// The root: its latest checkpoint is loaded.
		loaded, objs, err := o.LoadCheckpoint(checkpoint.OS, filepath.Join(dir, "run"))
		if err != nil {
			t.Fatal(err)
		}
		if loaded != checkpoint.StepDir(filepath.Join(dir, "run"), 5) {
			t.Fatalf("loaded %s", loaded)
		}
		var ts trainerState
		if err := json.Unmarshal(objs["trainer"], &ts); err != nil || ts.Iteration != 5 || ts.DataPos != 12345 || string(ts.RNG) != "\x01\x02\x03" {
			t.Fatalf("trainer object %+v, %v", ts, err)
		}
		if o.StepCount() != 5 {
			t.Fatalf("step %d after load, want 5", o.StepCount())
		}
		runSteps(t, o, 6, 10)
		if _, err := o.SaveCheckpoint(checkpoint.OS, filepath.Join(dir, "final"), nil); err != nil {
			t.Fatal(err)
		}
	}
}

func child(t *testing.T, phase, dir string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestResumeHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), "DOS_RESUME_PHASE="+phase, "DOS_RESUME_DIR="+dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("child %s: %v\n%s", phase, err, out)
	}
}

// TestResumeBitwise: ten steps straight equal five steps, save, load into a
// fresh process, five steps, bit for bit.
func TestResumeBitwise(t *testing.T) {
	dir := t.TempDir()
	child(t, "first", dir)
	child(t, "second", dir)

	straight := newTest(t, resumeOpts())
	runSteps(t, straight, 1, 10)

	resumed, err := New(testParams, resumeOpts())
	if err != nil {
		t.Fatal(err)
	}
	defer resumed.Close()
	latest, err := checkpoint.Latest(checkpoint.OS, filepath.Join(dir, "final"))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := resumed.LoadCheckpoint(checkpoint.OS, latest); err != nil {
		t.Fatal(err)
	}
	sameState(t, straight, resumed)
}

func TestLoadCheckpointMismatch(t *testing.T) {
	dir := t.TempDir()
	o := newTest(t, resumeOpts())
	runSteps(t, o, 1, 2)
	ck, err := o.SaveCheckpoint(checkpoint.OS, dir, nil)
	if err != nil {
		t.Fatal(err)
	}

	other := append([]Param(nil), testParams...)
	other[2] = Param{Name: "h.0.attn.c_attn.weight", Shape: []int{48, 16}}
	o2, err := New(other, resumeOpts())
	if err != nil {
		t.Fatal(err)
	}
	defer o2.Close()
	if _, _, err := o2.LoadCheckpoint(checkpoint.OS, ck); err == nil || !strings.Contains(err.Error(), "h.0.attn.c_attn.weight.master") {
		t.Errorf("shape mismatch: %v", err)
	}

	opts := resumeOpts()
	opts.Hyper.AMSGrad = false
	o3, err := New(testParams, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer o3.Close()
	if _, _, err := o3.LoadCheckpoint(checkpoint.OS, ck); err == nil || !strings.Contains(err.Error(), "amsgrad") {
		t.Errorf("amsgrad mismatch: %v", err)
	}

	// A flipped bit in the data: ErrCorrupt naming the tensor, and the
	// optimizer untouched.
	before := newTest(t, resumeOpts())
	victim := newTest(t, resumeOpts())
	f := filepath.Join(ck, "rank-00000.safetensors")
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-3] ^= 0x10
	if err := os.WriteFile(f, b, 0o644); err != nil {
		t.Fatal(err)
	}
	_, _, err = victim.LoadCheckpoint(checkpoint.OS, ck)
	if !errors.Is(err, checkpoint.ErrCorrupt) || !strings.Contains(err.Error(), ".max_exp_avg_sq") {
		t.Errorf("flipped bit: %v", err)
	}
	sameState(t, before, victim)

	if _, err := o.Snapshot(map[string]any{ObjectName: 1}); err == nil {
		t.Error("reserved object name accepted")
	}
}

func TestClosed(t *testing.T) {
	o, err := New(testParams, Options{})
	if err != nil {
		t.Fatal(err)
	}
	o.Close()
	o.Close() // idempotent
	if _, err := o.Step(StepArgs{}); !errors.Is(err, ErrClosed) {
		t.Errorf("Step: %v", err)
	}
	if err := o.SetParam("ln_f.bias", make([]float32, 16)); !errors.Is(err, ErrClosed) {
		t.Errorf("SetParam: %v", err)
	}
	if err := o.SetLR(1); !errors.Is(err, ErrClosed) {
		t.Errorf("SetLR: %v", err)
	}
	if _, err := o.SaveCheckpoint(checkpoint.OS, t.TempDir(), nil); !errors.Is(err, ErrClosed) {
		t.Errorf("SaveCheckpoint: %v", err)
	}
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, t.TempDir()); !errors.Is(err, ErrClosed) {
		t.Errorf("LoadCheckpoint: %v", err)
	}
}
