package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/safetensors"
	"github.com/deepstates/dos/trainer"
)

// TestMain lets the tests run this test binary as the dos command: with
// DOS_TEST_MAIN=1 it runs the CLI on its arguments and exits.
func TestMain(m *testing.M) {
	if os.Getenv("DOS_TEST_MAIN") == "1" {
		os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// dosCmd returns the dos command line args, run by this test binary.
func dosCmd(args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "DOS_TEST_MAIN=1")
	return cmd
}

// tiny is a model small enough for the race detector.
var tiny = []string{"--layers", "1", "--heads", "2", "--embd", "16", "--ctx", "16", "--batch", "4",
	"--eval-batches", "2", "--eval-every", "0", "--sample", "0", "--log-every", "0", "--decay-steps", "40", "--warmup", "4"}

func train(t *testing.T, args ...string) trainer.Summary {
	t.Helper()
	path := filepath.Join(t.TempDir(), "summary.json")
	out, err := dosCmd(append(append([]string{"train"}, tiny...), append(args, "--summary-json", path)...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("dos train %v: %v\n%s", args, err, out)
	}
	var s trainer.Summary
	b, err := os.ReadFile(path)
	if err == nil {
		err = json.Unmarshal(b, &s)
	}
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestTrainResumeBitwise: --steps 40 equals --steps 20 then --resume
// --steps 40, bit for bit.
func TestTrainResumeBitwise(t *testing.T) {
	straight := train(t, "--steps", "40", "--ckpt-dir", filepath.Join(t.TempDir(), "a"), "--ckpt-every", "10")
	dir := filepath.Join(t.TempDir(), "b")
	half := train(t, "--steps", "20", "--ckpt-dir", dir, "--ckpt-every", "10")
	resumed := train(t, "--steps", "40", "--ckpt-dir", dir, "--ckpt-every", "10", "--resume")
	t.Logf("straight %+v\nhalf %+v\nresumed %+v", straight, half, resumed)
	if resumed.FinalLoss != straight.FinalLoss || resumed.ValLoss != straight.ValLoss || resumed.Steps != 40 {
		t.Fatalf("resumed final_loss %v val_loss %v (steps %d), straight %v %v",
			resumed.FinalLoss, resumed.ValLoss, resumed.Steps, straight.FinalLoss, straight.ValLoss)
	}
	if resumed.InitialLoss != straight.InitialLoss {
		t.Errorf("initial_loss %v after resume, %v straight", resumed.InitialLoss, straight.InitialLoss)
	}
	if half.FinalLoss == straight.FinalLoss {
		t.Errorf("20 and 40 iterations give the same loss %v: the comparison cannot fail", half.FinalLoss)
	}
}

// TestTrainKilledDuringCheckpoint: SIGKILL while a checkpoint is being
// written, then --resume, continues from the last complete checkpoint and
// ends bitwise where an uninterrupted run ends.
func TestTrainKilledDuringCheckpoint(t *testing.T) {
	args := []string{"--steps", "40", "--ckpt-every", "1"}
	straight := train(t, append(args, "--ckpt-dir", filepath.Join(t.TempDir(), "a"))...)
	dir := filepath.Join(t.TempDir(), "b")
	cmd := dosCmd(append(append([]string{"train"}, tiny...), append(args, "--ckpt-dir", dir)...)...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline) && !killed; {
		entries, _ := os.ReadDir(dir)
		steps := 0
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), "step-") {
				steps++
			}
		}
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), ".tmp-") && steps >= 3 {
				cmd.Process.Signal(syscall.SIGKILL)
				killed = true
				break
			}
		}
	}
	cmd.Wait()
	if !killed {
		t.Fatal("never caught a checkpoint being written")
	}
	out, err := dosCmd(append(append([]string{"train"}, tiny...), append(args, "--ckpt-dir", dir, "--resume")...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("resume after SIGKILL: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "resume: "+dir+"/step-") {
		t.Fatalf("did not resume from a checkpoint:\n%s", out)
	}
	resumed := train(t, append(args, "--ckpt-dir", dir, "--resume")...) // already at 40: reports the state
	if resumed.FinalLoss != straight.FinalLoss || resumed.Steps != 40 {
		t.Fatalf("after SIGKILL and resume: final_loss %v at %d, straight %v", resumed.FinalLoss, resumed.Steps, straight.FinalLoss)
	}
	t.Logf("killed during a checkpoint write; %s", strings.SplitN(string(out), "\n", 3)[1])
}

// TestTrainLossScaleSkips: fp16 gradients with a loss scale high enough to
// overflow skip optimizer steps; checkpoints are named by iteration, so
// checkpointing every iteration still works, and resume stays bitwise.
func TestTrainLossScaleSkips(t *testing.T) {
	args := []string{"--grad-dtype", "float16", "--loss-scale", "1e12", "--ckpt-every", "1"}
	straight := train(t, append(args, "--steps", "40", "--ckpt-dir", filepath.Join(t.TempDir(), "a"))...)
	if straight.Skipped == 0 {
		t.Fatalf("no step was skipped: the test does not exercise the scaler (%+v)", straight)
	}
	dir := filepath.Join(t.TempDir(), "b")
	train(t, append(args, "--steps", "20", "--ckpt-dir", dir)...)
	resumed := train(t, append(args, "--steps", "40", "--ckpt-dir", dir, "--resume")...)
	if resumed.FinalLoss != straight.FinalLoss || resumed.ValLoss != straight.ValLoss {
		t.Fatalf("resumed %v/%v, straight %v/%v", resumed.FinalLoss, resumed.ValLoss, straight.FinalLoss, straight.ValLoss)
	}
	t.Logf("skipped %d steps of 40; final loss %v", straight.Skipped, straight.FinalLoss)
}

func TestTrainRefusals(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "c")
	train(t, "--steps", "5", "--ckpt-dir", dir)
	for _, tc := range []struct {
		args []string
		rc   int
		want string
	}{
		{[]string{"--steps", "5", "--ckpt-dir", dir}, 1, "pass --resume"},
		{[]string{"--steps", "9", "--ckpt-dir", dir, "--resume", "--embd", "32"}, 1, "trained with --layers 1 --heads 2 --embd 16"},
		{[]string{"--steps", "5", "--grad-dtype", "none"}, 2, "--grad-dtype none"},
		{[]string{"--steps", "5", "--ctx", "1000000", "--embd", "1024", "--heads", "1"}, 2, "--layers 1 --embd 1024 --ctx 1000000 --batch 4 need about"},
		{[]string{"--steps", "5", "--loss-scale", "1e-50"}, 2, "--loss-scale 1e-50"},
		{[]string{"--steps", "5", "--beta1", "2"}, 2, "--beta1 2"},
		{[]string{"--steps", "5", "--text", "/dev/zero"}, 1, "not a regular file"},
		{[]string{"--steps", "5", "--device", "sim", "--working-dtype", "bfloat16", "--subgroup-size", "1000", "--schedule", "3,3,3"}, 2, "make 8"},
		{[]string{"--steps", "5", "--device", "sim", "--working-dtype", "bfloat16", "--schedule", "3,x"}, 2, "CPU,GPU,RESIDENT"},
		{[]string{"--steps", "5", "--device", "sim"}, 2, "--working-dtype"},
		{[]string{"--steps", "5", "--device", "tpu", "--working-dtype", "bfloat16"}, 2, "want sim or cuda"},
		{[]string{"--steps", "5", "--schedule", "1,0,0"}, 2, "need --device"},
	} {
		out, err := dosCmd(append(append([]string{"train"}, tiny...), tc.args...)...).CombinedOutput()
		rc := 0
		if ee, ok := err.(*exec.ExitError); ok {
			rc = ee.ExitCode()
		}
		if rc != tc.rc || !strings.Contains(string(out), tc.want) {
			t.Errorf("dos train %v: rc %d, want %d with %q:\n%s", tc.args, rc, tc.rc, tc.want, out)
		}
	}
}

// TestExportEval: a dos train checkpoint exports as a Hugging Face GPT-2
// (config.json, every parameter under its GPT-2 name and shape) and dos eval
// writes logits of the right shape. transformers itself is compared on the
// GPU machine (scripts/check_hf_export.py).
func TestExportEval(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ck")
	train(t, "--steps", "3", "--ckpt-dir", dir)
	hf := filepath.Join(t.TempDir(), "hf")
	if out, err := dosCmd("export", "--ckpt", dir, "--hf", hf).CombinedOutput(); err != nil {
		t.Fatalf("export: %v\n%s", err, out)
	}
	var cfg map[string]any
	b, err := os.ReadFile(filepath.Join(hf, "config.json"))
	if err == nil {
		err = json.Unmarshal(b, &cfg)
	}
	if err != nil || cfg["model_type"] != "gpt2" || cfg["n_embd"] != float64(16) || cfg["activation_function"] != "gelu_new" || cfg["vocab_size"] != float64(256) {
		t.Fatalf("config.json %v, %v", cfg, err)
	}
	f, err := safetensors.ReadFile(filepath.Join(hf, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	model := trainer.Config{VocabSize: 256, NCtx: 16, NLayer: 1, NHead: 2, NEmbd: 16}
	if len(f.Tensors) != len(model.Tensors()) {
		t.Fatalf("%d tensors, want %d", len(f.Tensors), len(model.Tensors()))
	}
	for _, p := range model.Tensors() {
		ti, ok := f.Find(p.Name)
		if !ok || ti.DType != safetensors.F32 || len(ti.Shape) != len(p.Shape) || ti.Shape[0] != int64(p.Shape[0]) {
			t.Fatalf("tensor %s: %+v, want F32 %v", p.Name, ti, p.Shape)
		}
	}
	lf := filepath.Join(t.TempDir(), "logits.safetensors")
	out, err := dosCmd("eval", "--ckpt", dir, "--text", "Of the Refractio", "--logits", lf).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "16 tokens") {
		t.Fatalf("eval: %v\n%s", err, out)
	}
	g, err := safetensors.ReadFile(lf)
	if err != nil {
		t.Fatal(err)
	}
	if ti, ok := g.Find("logits"); !ok || ti.DType != safetensors.F64 || ti.Shape[0] != 16 || ti.Shape[1] != 256 {
		t.Fatalf("logits %+v", ti)
	}
	if out, err := dosCmd("eval", "--ckpt", dir, "--text", "x").CombinedOutput(); err != nil || !strings.Contains(string(out), "no next-byte loss") {
		t.Fatalf("one-byte eval: %v\n%s", err, out)
	}
}

// TestTrainDevice: the main job through the interleaved engine (CPU,
// streamed and resident subgroups; clipping on) has the host run's loss
// trajectory: bitwise on the simulated device; within 1e-3 relative on a
// GPU, where forward and backward run in bf16 on the device (the host's
// model computes in fp32 from the same bf16 weights); and a device run
// resumed from its checkpoint ends bitwise where a straight one does.
func TestTrainDevice(t *testing.T) {
	args := []string{"--steps", "30", "--working-dtype", "bfloat16", "--grad-dtype", "bfloat16", "--subgroup-size", "1000", "--clip", "0.5"}
	host := train(t, args...)
	devices := []string{"sim"}
	if cuda.Available() == nil || os.Getenv("DOS_REQUIRE_GPU") == "1" {
		devices = append(devices, "cuda")
	}
	for _, dev := range devices {
		d := train(t, append(args, "--device", dev)...)
		t.Logf("%s: final %v val %v; host: final %v val %v", dev, d.FinalLoss, d.ValLoss, host.FinalLoss, host.ValLoss)
		tol := 0.0
		if dev == "cuda" {
			tol = 1e-3
		}
		if math.Abs(d.FinalLoss-host.FinalLoss) > tol*host.FinalLoss || math.Abs(d.ValLoss-host.ValLoss) > tol*host.ValLoss || math.Abs(d.InitialLoss-host.InitialLoss) > tol*host.InitialLoss {
			t.Errorf("%s: losses %v/%v/%v, host %v/%v/%v", dev, d.InitialLoss, d.FinalLoss, d.ValLoss, host.InitialLoss, host.FinalLoss, host.ValLoss)
		}
	}
	// Lazy checkpoints with resident subgroups (their D2H in the
	// background), resumed.
	for _, devName := range devices {
		dir := filepath.Join(t.TempDir(), "ck")
		dev := append(slices.Clone(args[2:]), "--device", devName, "--schedule", "3,3,2", "--ckpt-dir", dir, "--ckpt-every", "10")
		train(t, append([]string{"--steps", "20"}, dev...)...)
		resumed := train(t, append([]string{"--steps", "30", "--resume"}, dev...)...)
		straight := train(t, append([]string{"--steps", "30"}, append(slices.Clone(args[2:]), "--device", devName, "--schedule", "3,3,2")...)...)
		if resumed.FinalLoss != straight.FinalLoss || resumed.ValLoss != straight.ValLoss {
			t.Errorf("resumed on %s: %v/%v, straight %v/%v", devName, resumed.FinalLoss, resumed.ValLoss, straight.FinalLoss, straight.ValLoss)
		}
	}
}

// TestTrainReportsEveryCheckpoint: with a checkpoint at every iteration,
// each lazy checkpoint is reported once when durable, none dropped (the
// next save used to overwrite a handle not yet reported).
func TestTrainReportsEveryCheckpoint(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ck")
	args := append(append([]string{"train"}, tiny...), "--steps", "12", "--ckpt-dir", dir, "--ckpt-every", "1")
	out, err := dosCmd(args...).CombinedOutput()
	if err != nil {
		t.Fatalf("dos train: %v\n%s", err, out)
	}
	for step := 1; step <= 12; step++ {
		line := fmt.Sprintf("checkpoint %s (", filepath.Join(dir, fmt.Sprintf("step-%09d", step)))
		if n := strings.Count(string(out), line); n != 1 {
			t.Errorf("step %d reported %d times, want once\n%s", step, n, out)
		}
	}
}

// TestTrainReplan: --replan on the simulated device with a profile of this
// machine that mispredicts its CPU re-plans, trains bit for bit as the
// host does, and its --log-json records carry the measured update phase of
// every iteration and the predicted one;
// --replan without a device, or with --schedule, is refused.
func TestTrainReplan(t *testing.T) {
	p := perfmodel.Profile{Format: perfmodel.ProfileFormat, Version: perfmodel.ProfileVersion, Machine: perfmodel.Here()}
	// A profile with no latencies whose CPU update and copies take next to
	// nothing and whose fused update takes 0.2 µs a subgroup: the model puts
	// every subgroup on the CPU; the CPU is measured at microseconds a
	// subgroup, and Replan moves them to the simulated device.
	free := perfmodel.Fit{Rate: 1e15}
	for _, d := range []adam.DType{adam.F32, adam.BF16} {
		p.CPU = append(p.CPU, perfmodel.CPUFit{Threads: 1, GradDType: d, Fit: free})
	}
	p.GPU = &perfmodel.GPUProfile{Update: perfmodel.Fit{Rate: 5e9}, H2D: free, D2H: free, H2DBoth: free, D2HBoth: free, Convert: free}
	b, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	prof, log := filepath.Join(t.TempDir(), "profile.json"), filepath.Join(t.TempDir(), "log.jsonl")
	if err := os.WriteFile(prof, b, 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"--steps", "12", "--working-dtype", "bfloat16", "--grad-dtype", "bfloat16", "--subgroup-size", "1000", "--clip", "0.5"}
	host := train(t, args...)
	re := train(t, append(args, "--device", "sim", "--profile", prof, "--gpu-budget", "0.001", "--replan", "--log-json", log)...)
	if re.FinalLoss != host.FinalLoss || re.ValLoss != host.ValLoss {
		t.Errorf("--replan: losses %v/%v, host %v/%v", re.FinalLoss, re.ValLoss, host.FinalLoss, host.ValLoss)
	}
	lines, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	n, replans := 0, 0
	for _, l := range strings.Split(strings.TrimSpace(string(lines)), "\n") {
		var rec struct {
			Step       int     `json:"step"`
			PredictedS float64 `json:"predicted_s"`
			MeasuredS  float64 `json:"measured_s"`
			Replanned  bool    `json:"replanned"`
		}
		if err := json.Unmarshal([]byte(l), &rec); err != nil {
			t.Fatal(err)
		}
		if rec.Step > 0 {
			n++
			// The first plan's prediction rounds to 0 ns (picoseconds of
			// CPU work); the measured phase takes microseconds.
			if !(rec.MeasuredS > 0) || (rec.Step == 12 && !(rec.PredictedS > 0)) {
				t.Errorf("step %d: predicted %v s, measured %v s", rec.Step, rec.PredictedS, rec.MeasuredS)
			}
			if rec.Replanned {
				replans++
			}
		}
	}
	if n != 12 || replans == 0 {
		t.Errorf("%d step records (want 12), %d re-plans (want some: the CPU is far slower than the profile says)", n, replans)
	}
	for _, bad := range [][]string{{"--replan"}, {"--replan", "--device", "sim", "--working-dtype", "bfloat16", "--schedule", "1,0,0"}} {
		out, err := dosCmd(append(append([]string{"train"}, tiny...), append([]string{"--steps", "2"}, bad...)...)...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), "--replan") {
			t.Errorf("dos train %v: %v\n%s", bad, err, out)
		}
	}
}

// TestTrainScheduleKeywords: --schedule cpu puts every subgroup on the CPU
// and --schedule static as many resident as --gpu-budget holds (12 bytes a
// parameter each), the rest on the CPU; both train as the host does.
func TestTrainScheduleKeywords(t *testing.T) {
	args := []string{"--steps", "4", "--working-dtype", "bfloat16", "--grad-dtype", "bfloat16", "--subgroup-size", "1000"}
	host := train(t, args...)
	for _, tc := range []struct {
		flags []string
		want  string
	}{
		{[]string{"--schedule", "cpu"}, ": 8 of 8 subgroups on the CPU, 0 streamed through the GPU, 0 resident"},
		{[]string{"--schedule", "static", "--gpu-budget", "0.000028"}, ": 6 of 8 subgroups on the CPU, 0 streamed through the GPU, 2 resident"}, // 30,064 bytes: two subgroups of 12,000
	} {
		all := append(append(append([]string{"train"}, tiny...), args...), append([]string{"--device", "sim"}, tc.flags...)...)
		out, err := dosCmd(all...).CombinedOutput()
		if err != nil || !strings.Contains(string(out), tc.want) {
			t.Errorf("%v: %v, want %q in\n%s", tc.flags, err, tc.want, out)
		}
		if s := train(t, append(slices.Clone(args), append([]string{"--device", "sim"}, tc.flags...)...)...); s.FinalLoss != host.FinalLoss {
			t.Errorf("%v: final loss %v, host %v", tc.flags, s.FinalLoss, host.FinalLoss)
		}
	}
}

// TestTrainTrajectoryEverySchedule: the loss and the gradient norm of every
// iteration are the same bits under every placement of the update phase
// (issue 17: the update is exact on every path): the host optimizer, and on
// the simulated device all on the CPU, the static split, forced mixes with
// streamed and resident subgroups, and another subgroup size.
func TestTrainTrajectoryEverySchedule(t *testing.T) {
	args := []string{"--steps", "6", "--working-dtype", "bfloat16", "--grad-dtype", "bfloat16", "--subgroup-size", "1000"}
	trajectory := func(extra ...string) []string {
		t.Helper()
		log := filepath.Join(t.TempDir(), "steps.jsonl")
		train(t, append(append(slices.Clone(args), extra...), "--log-json", log)...)
		b, err := os.ReadFile(log)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			var rec struct {
				Loss     float64 `json:"loss"`
				GradNorm float64 `json:"grad_norm"`
			}
			if err := json.Unmarshal([]byte(line), &rec); err != nil {
				t.Fatal(err)
			}
			out = append(out, fmt.Sprintf("%x %x", math.Float64bits(rec.Loss), math.Float64bits(rec.GradNorm)))
		}
		return out
	}
	host := trajectory()
	if len(host) != 6 {
		t.Fatalf("%d records, want 6", len(host))
	}
	for _, flags := range [][]string{
		{"--schedule", "cpu"},
		{"--schedule", "static", "--gpu-budget", "0.000028"},
		{"--schedule", "3,3,2"},
		{"--schedule", "0,8,0"},
		{"--schedule", "0,0,8"},
		{"--schedule", "cpu", "--subgroup-size", "700"},
	} {
		if got := trajectory(append([]string{"--device", "sim"}, flags...)...); !slices.Equal(got, host) {
			t.Errorf("%v: trajectory (loss, grad norm bits)\n%v\nthe host's\n%v", flags, got, host)
		}
	}
}

// TestSummaryProbe: --summary-json is checked before training without
// touching what is there: a run that fails keeps an earlier run's summary
// (it used to leave "{}"), and a path that cannot be written fails at once.
func TestSummaryProbe(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.json")
	if err := os.WriteFile(path, []byte(`{"final_loss": 1}`), 0o644); err != nil {
		t.Fatal(err)
	}
	// A run that fails after the probe: a checkpoint root that cannot be
	// made (under /proc).
	rc, _, errs := runCLI("train", "--steps", "1", "--ckpt-dir", "/proc/dos-no-such-root", "--summary-json", path)
	if rc == 0 {
		t.Fatalf("a run with an impossible --ckpt-dir succeeded")
	}
	if b, _ := os.ReadFile(path); string(b) != `{"final_loss": 1}` {
		t.Errorf("a failed run changed the earlier summary to %q (%s)", b, errs)
	}
	rc, _, errs = runCLI("train", "--steps", "1", "--summary-json", filepath.Join(t.TempDir(), "no", "dir", "s.json"))
	if rc == 0 || !strings.Contains(errs, "--summary-json") {
		t.Errorf("an unwritable --summary-json: rc %d, %s", rc, errs)
	}
	leftovers, _ := filepath.Glob(filepath.Join(filepath.Dir(path), ".dos-probe-*"))
	if len(leftovers) > 0 {
		t.Errorf("the probe left %v", leftovers)
	}
}

// TestResumeNothingToTrain: a run resumed at (or past) --steps says that
// the checkpoint already completed the run and how to train further, and
// exits 0 without the run's header, losses and throughput (it printed
// them, with "0 tokens/s"); --summary-json still reports the checkpoint's
// state, and --timeline says it drew nothing.
func TestResumeNothingToTrain(t *testing.T) {
	ck := filepath.Join(t.TempDir(), "ck")
	first := filepath.Join(t.TempDir(), "first.json")
	args := append([]string{"train", "--ckpt-dir", ck, "--log-every", "0"}, zeroTiny...)
	if rc, out, errs := runCLI(append(args, "--steps", "2", "--summary-json", first)...); rc != 0 {
		t.Fatalf("--steps 2: rc %d\n%s%s", rc, out, errs)
	}
	step := filepath.Join(ck, "step-000000002")
	again := filepath.Join(t.TempDir(), "again.json")
	for _, tc := range []struct {
		args []string
		last []string
	}{
		{[]string{"--steps", "2", "--resume"}, []string{
			"resume: " + step + " at iteration 2 (optimizer step 2)",
			"resume: the checkpoint at step 2 already completed this run's --steps 2: nothing to train (to train further, pass --steps M with M > 2)"}},
		{[]string{"--steps", "1", "--decay-steps", "2", "--resume", "--summary-json", again, "--timeline", filepath.Join(ck, "t.svg")}, []string{
			"resume: " + step + " at iteration 2 (optimizer step 2)",
			"resume: the checkpoint at step 2 is past this run's --steps 1: nothing to train (to train further, pass --steps M with M > 2)",
			"--timeline " + filepath.Join(ck, "t.svg") + ": not drawn: nothing trained"}},
	} {
		rc, out, errs := runCLI(append(args, tc.args...)...)
		lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
		if rc != 0 || errs != "" || len(lines) < len(tc.last) || !slices.Equal(lines[len(lines)-len(tc.last):], tc.last) ||
			strings.Contains(out, "dos train: GPT-2") || strings.Contains(out, "tokens/s") || strings.Contains(out, "val_loss") {
			t.Errorf("dos train %v: rc %d, stderr %q, stdout:\n%s\nwant it to end with:\n%s", tc.args, rc, errs, out, strings.Join(tc.last, "\n"))
		}
	}
	var a, b trainer.Summary
	for _, f := range []struct {
		path string
		s    *trainer.Summary
	}{{first, &a}, {again, &b}} {
		data, err := os.ReadFile(f.path)
		if err == nil {
			err = json.Unmarshal(data, f.s)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if b.Steps != 2 || b.FinalLoss != a.FinalLoss || b.ValLoss != a.ValLoss || b.InitialLoss != a.InitialLoss || b.TokensPerS != 0 || a.FinalLoss == 0 {
		t.Errorf("--summary-json of the run with nothing to train: %+v; the run's: %+v", b, a)
	}
	if _, err := os.Stat(filepath.Join(ck, "t.svg")); !os.IsNotExist(err) {
		t.Errorf("--timeline drawn though nothing was trained: %v", err)
	}
}

// TestReadmeHeaderCheck: the README's way to check a checkpoint's
// safetensors file without Python's safetensors package (not packaged by
// Debian 12), a python3 one-liner over the standard library, prints the
// file's header: every tensor dos ckpt verify counts, with its dtype and
// shape.
func TestReadmeHeaderCheck(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var script string
	for _, line := range strings.Split(string(readme), "\n") {
		if strings.HasPrefix(line, "python3 -c 'import json,struct,sys;") {
			script = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSuffix(line, " \\"), "python3 -c '"), "'")
		}
	}
	if script == "" {
		t.Fatal("README.md has no python3 one-liner that reads a checkpoint's safetensors header")
	}
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3")
	}
	ck := filepath.Join(t.TempDir(), "ck")
	if rc, out, errs := runCLI(append([]string{"train", "--steps", "0", "--ckpt-dir", ck}, zeroTiny...)...); rc != 0 {
		t.Fatalf("--steps 0: rc %d\n%s%s", rc, out, errs)
	}
	file := filepath.Join(ck, "step-000000000", "rank-00000.safetensors")
	out, err := exec.Command(py, "-c", script, file).Output()
	if err != nil {
		t.Fatalf("the README's one-liner on %s: %v", file, err)
	}
	var header map[string]struct {
		DType string `json:"dtype"`
		Shape []int  `json:"shape"`
	}
	if err := json.Unmarshal(out, &header); err != nil {
		t.Fatalf("the README's one-liner printed no JSON header: %v\n%s", err, out)
	}
	_, verify, _ := runCLI("ckpt", "verify", ck)
	n := len(header) - 1 // __metadata__
	if w := header["wte.weight.master"]; w.DType != "F32" || !slices.Equal(w.Shape, []int{256, 8}) || !strings.Contains(verify, fmt.Sprintf(" %d tensors,", n)) {
		t.Errorf("header: %d tensors, wte.weight.master %+v; dos ckpt verify: %s", n, w, verify)
	}
}
