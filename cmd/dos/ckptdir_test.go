package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io/fs"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/safetensors"
)

// Issue 14's defects, from the command line: each test fails on the code
// before the fix.

// dos runs the dos command with the tiny model's flags for train and
// returns its exit code and output; it fails the test after timeout.
func dosRun(t *testing.T, timeout time.Duration, args ...string) (int, string) {
	t.Helper()
	if len(args) > 0 && args[0] == "train" {
		args = append(append([]string{"train"}, tiny...), args[1:]...)
	}
	cmd := dosCmd(args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		rc := 0
		if ee, ok := err.(*exec.ExitError); ok {
			rc = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return rc, out.String()
	case <-time.After(timeout):
		cmd.Process.Kill()
		<-done
		t.Fatalf("dos %v: still running after %v:\n%s", args, timeout, out.String())
		return 0, ""
	}
}

// treeHash hashes every file under dir (names and contents), .lock left
// out: what must not change.
func treeHash(t *testing.T, dir string) string {
	t.Helper()
	h := sha256.New()
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.Name() == ".lock" {
			return err
		}
		fmt.Fprintf(h, "%s %v\n", strings.TrimPrefix(p, dir), d.IsDir())
		if d.Type().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			h.Write(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%x", h.Sum(nil))
}

// TestTrainDamagedRoot (defects 1 and 2): a root whose latest is missing,
// empty or garbage, or whose first commit was cut between latest.tmp and
// its rename, is refused by a plain dos train, which changes nothing; with
// --resume it is recovered (saying how) and training continues bit for bit.
func TestTrainDamagedRoot(t *testing.T) {
	args := []string{"--steps", "20", "--ckpt-every", "5"}
	straight := train(t, append(args, "--ckpt-dir", filepath.Join(t.TempDir(), "s"))...)
	for _, damage := range []string{"removed", "empty", "garbage", "first commit cut short"} {
		t.Run(damage, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ckpt")
			steps := "10"
			if damage == "first commit cut short" {
				steps = "5"
			}
			train(t, "--steps", steps, "--ckpt-every", "5", "--decay-steps", "40", "--ckpt-dir", dir)
			latest := filepath.Join(dir, "latest")
			var err error
			switch damage {
			case "removed":
				err = os.Remove(latest)
			case "empty":
				err = os.WriteFile(latest, nil, 0o644)
			case "garbage":
				err = os.WriteFile(latest, []byte("\x00\x01garbage"), 0o644)
			default:
				err = os.Rename(latest, latest+".tmp")
			}
			if err != nil {
				t.Fatal(err)
			}
			before := treeHash(t, dir)
			rc, out := dosRun(t, time.Minute, append([]string{"train", "--seed", "5", "--ckpt-dir", dir}, args...)...)
			if rc != 1 || !strings.Contains(out, "--resume") || strings.Contains(out, "iter ") {
				t.Fatalf("a plain dos train on the damaged root: rc %d:\n%s", rc, out)
			}
			if treeHash(t, dir) != before {
				t.Fatal("the refused run changed the root")
			}
			rc, out = dosRun(t, time.Minute, append([]string{"train", "--ckpt-dir", dir, "--resume"}, args...)...)
			want := "took the newest step directory that verifies, step-000000010"
			if damage == "first commit cut short" {
				want = "finished the interrupted commit of step-000000005"
			}
			if rc != 0 || !strings.Contains(out, want) {
				t.Fatalf("--resume on the damaged root: rc %d, want %q:\n%s", rc, want, out)
			}
			resumed := train(t, append(args, "--ckpt-dir", dir, "--resume")...)
			if resumed.FinalLoss != straight.FinalLoss || resumed.Steps != 20 {
				t.Fatalf("recovered and resumed: final_loss %v at %d; straight %v", resumed.FinalLoss, resumed.Steps, straight.FinalLoss)
			}
		})
	}
}

// TestTrainCkptDirIsStepDir (defect 3): --ckpt-dir pointing into a step
// directory is refused, with or without --resume, and nothing is nested in
// the checkpoint.
func TestTrainCkptDirIsStepDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ckpt")
	train(t, "--steps", "8", "--ckpt-every", "4", "--ckpt-dir", dir)
	step := filepath.Join(dir, "step-000000004")
	before := treeHash(t, dir)
	for _, extra := range [][]string{{"--resume"}, nil} {
		rc, out := dosRun(t, time.Minute, append([]string{"train", "--steps", "12", "--ckpt-dir", step}, extra...)...)
		if rc != 1 || !strings.Contains(out, "not a checkpoint root") || !strings.Contains(out, "pass its parent "+dir) {
			t.Errorf("--ckpt-dir %s %v: rc %d:\n%s", step, extra, rc, out)
		}
	}
	if treeHash(t, dir) != before {
		t.Fatal("the root changed")
	}
}

// TestTrainTwoWriters (defect 5): a second dos train on a root that a
// running one writes under is refused at once, naming the holder's PID.
func TestTrainTwoWriters(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ckpt")
	first := dosCmd(append(append([]string{"train"}, tiny...), "--steps", "1000000", "--ckpt-every", "1", "--ckpt-keep", "2", "--ckpt-dir", dir)...)
	if err := first.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { first.Process.Kill(); first.Wait() }()
	for deadline := time.Now().Add(time.Minute); ; {
		if _, err := os.Stat(filepath.Join(dir, "latest")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the first trainer never checkpointed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	pid := fmt.Sprintf("PID %d", first.Process.Pid)
	for _, extra := range [][]string{{"--resume"}, nil} {
		rc, out := dosRun(t, 30*time.Second, append([]string{"train", "--steps", "1000000", "--ckpt-dir", dir}, extra...)...)
		if rc != 1 || !strings.Contains(out, pid) || !strings.Contains(out, "one writer per root") {
			t.Errorf("a second dos train %v: rc %d, want 1 naming %s:\n%s", extra, rc, pid, out)
		}
	}
	rc, out := dosRun(t, 30*time.Second, "ckpt", "verify", dir)
	if rc != 0 {
		t.Errorf("dos ckpt verify while training: rc %d:\n%s", rc, out)
	}
}

// TestTrainUnusableCkptDir (defect 8): a --ckpt-dir that cannot hold
// checkpoints is refused before the first iteration, not at the first
// checkpoint.
func TestTrainUnusableCkptDir(t *testing.T) {
	tmp := t.TempDir()
	file := filepath.Join(tmp, "file")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	latestDir := filepath.Join(tmp, "latest-is-a-dir")
	if err := os.MkdirAll(filepath.Join(latestDir, "latest"), 0o755); err != nil {
		t.Fatal(err)
	}
	cases := []struct{ dir, want string }{
		{file, "not a directory"},
		{filepath.Join(file, "sub"), "not a directory"},
		{latestDir, "latest is a directory"},
	}
	// Not writable even for root: procfs.
	if st, err := os.Stat("/proc/self/fdinfo"); err == nil && st.IsDir() {
		cases = append(cases, struct{ dir, want string }{"/proc/self/fdinfo", "ckpt-dir"})
	}
	for _, tc := range cases {
		for _, extra := range [][]string{{"--resume"}, nil} {
			rc, out := dosRun(t, time.Minute, append([]string{"train", "--steps", "50", "--ckpt-every", "50", "--log-every", "1", "--ckpt-dir", tc.dir}, extra...)...)
			if rc != 1 || !strings.Contains(out, tc.want) || strings.Contains(out, "iter ") {
				t.Errorf("--ckpt-dir %s %v: rc %d, want 1 with %q before any iteration:\n%s", tc.dir, extra, rc, tc.want, out)
			}
		}
	}
}

// TestCkptFIFO (defect 6): a FIFO as latest, manifest.json or the rank
// file is reported at once by verify, train --resume and a fresh train.
func TestCkptFIFO(t *testing.T) {
	for _, name := range []string{"latest", "step-000000004/manifest.json", "step-000000004/rank-00000.safetensors"} {
		t.Run(filepath.Base(name), func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ckpt")
			train(t, "--steps", "4", "--ckpt-every", "4", "--ckpt-dir", dir)
			path := filepath.Join(dir, name)
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			if err := syscall.Mkfifo(path, 0o644); err != nil {
				t.Skipf("mkfifo: %v", err)
			}
			for _, args := range [][]string{
				{"ckpt", "verify", dir},
				{"ckpt", "inspect", dir},
				{"train", "--steps", "8", "--ckpt-dir", dir, "--resume"},
				{"train", "--steps", "8", "--ckpt-dir", dir},
			} {
				if rc, out := dosRun(t, 20*time.Second, args...); rc != 1 || !strings.Contains(out, "FIFO") && !strings.Contains(out, "--resume") {
					t.Errorf("dos %v: rc %d:\n%s", args[:2], rc, out)
				}
			}
		})
	}
}

// rewrite saves the checkpoint of root's latest again into a new root,
// with edit applied to its tensors (by name, as float32) and its objects;
// the checksums are valid, the contents what edit made them.
func rewrite(t *testing.T, root string, edit func(name string, v []float32), editObj func(objects map[string]json.RawMessage)) string {
	t.Helper()
	dir, err := checkpoint.Resolve(checkpoint.OS, root)
	if err != nil {
		t.Fatal(err)
	}
	c, err := checkpoint.Open(checkpoint.OS, dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := &checkpoint.Snapshot{Step: c.Manifest.Step, Objects: map[string]json.RawMessage{}}
	for k, v := range c.Manifest.Objects {
		s.Objects[k] = v
	}
	for _, e := range c.Manifest.Tensors {
		v := make([]float32, e.Bytes/4)
		if err := c.ReadTensor(e.Name, safetensors.Float32View(v)); err != nil {
			t.Fatal(err)
		}
		if edit != nil {
			edit(e.Name, v)
		}
		s.Tensors = append(s.Tensors, checkpoint.Tensor{Name: e.Name, DType: e.DType, Shape: e.Shape, Data: [][]byte{safetensors.Float32View(v)}})
	}
	if editObj != nil {
		editObj(s.Objects)
	}
	out := filepath.Join(t.TempDir(), "edited")
	if _, err := checkpoint.Save(checkpoint.OS, out, s); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestCkptInvalidContents (defect 9): valid checksums around NaN master
// weights or an Inf or negative exp_avg_sq are refused by verify, export,
// eval and resume; optimizer settings in the checkpoint that differ from
// the flags are listed on resume.
func TestCkptInvalidContents(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ckpt")
	train(t, "--steps", "4", "--ckpt-every", "4", "--ckpt-dir", dir)
	for _, tc := range []struct {
		what, tensor string
		value        float32
	}{
		{"NaN master", "wte.weight.master", float32(math.NaN())},
		{"Inf exp_avg_sq", "wpe.weight.exp_avg_sq", float32(math.Inf(1))},
		{"negative exp_avg_sq", "ln_f.weight.exp_avg_sq", -1},
	} {
		bad := rewrite(t, dir, func(name string, v []float32) {
			if name == tc.tensor {
				v[3] = tc.value
			}
		}, nil)
		for _, args := range [][]string{
			{"ckpt", "verify", bad},
			{"train", "--steps", "8", "--ckpt-dir", bad, "--resume"},
		} {
			if rc, out := dosRun(t, time.Minute, args...); rc != 1 || !strings.Contains(out, tc.tensor) {
				t.Errorf("%s: dos %v: rc %d, want 1 naming %s:\n%s", tc.what, args[:2], rc, tc.tensor, out)
			}
		}
		if tc.what == "NaN master" {
			for _, args := range [][]string{{"export", "--ckpt", bad, "--hf", filepath.Join(t.TempDir(), "hf")}, {"eval", "--ckpt", bad}} {
				if rc, out := dosRun(t, time.Minute, args...); rc != 1 || !strings.Contains(out, tc.tensor) {
					t.Errorf("%s: dos %s: rc %d, want 1 naming %s:\n%s", tc.what, args[0], rc, tc.tensor, out)
				}
			}
		}
	}
	// maximize and mode switched in a checkpoint with valid checksums.
	odd := rewrite(t, dir, nil, func(objects map[string]json.RawMessage) {
		var o map[string]any
		if err := json.Unmarshal(objects["optimizer"], &o); err != nil {
			t.Fatal(err)
		}
		h := o["hyper"].(map[string]any)
		h["maximize"], h["mode"] = true, "adam"
		objects["optimizer"], _ = json.Marshal(o)
	})
	rc, out := dosRun(t, time.Minute, "train", "--steps", "6", "--ckpt-dir", odd, "--resume")
	if rc != 0 || !strings.Contains(out, "resume: maximize") || !strings.Contains(out, "resume: mode") {
		t.Errorf("resume of a checkpoint with maximize and mode adam: rc %d, want both listed:\n%s", rc, out)
	}
}

// TestCkptLsLeftovers (defect 4): dos ckpt ls reports an incomplete step
// directory below latest (what a kill during the old retention left), and
// the next save's retention removes it.
func TestCkptLsLeftovers(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ckpt")
	train(t, "--steps", "10", "--ckpt-every", "5", "--ckpt-keep", "1", "--decay-steps", "40", "--ckpt-dir", dir)
	orphan := filepath.Join(dir, "step-000000003")
	if err := os.MkdirAll(orphan, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(orphan, "rank-00000.safetensors"), make([]byte, 1000), 0o644); err != nil {
		t.Fatal(err)
	}
	rc, out := dosRun(t, time.Minute, "ckpt", "ls", dir)
	if rc != 0 || !strings.Contains(out, orphan) || !strings.Contains(out, "leftover") {
		t.Fatalf("dos ckpt ls: rc %d, want the leftover %s:\n%s", rc, orphan, out)
	}
	train(t, "--steps", "15", "--ckpt-every", "5", "--ckpt-keep", "1", "--decay-steps", "40", "--ckpt-dir", dir, "--resume")
	if _, err := os.Stat(orphan); !os.IsNotExist(err) {
		t.Fatalf("the leftover is still there after the next save: %v", err)
	}
}

// TestCkptRankNegative: --rank -1 is a usage error naming the flag.
func TestCkptRankNegative(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ckpt")
	train(t, "--steps", "2", "--ckpt-every", "2", "--ckpt-dir", dir)
	for _, sub := range []string{"verify", "inspect"} {
		if rc, out := dosRun(t, time.Minute, "ckpt", sub, "--rank", "-1", dir); rc != 2 || !strings.Contains(out, "--rank -1") {
			t.Errorf("dos ckpt %s --rank -1: rc %d:\n%s", sub, rc, out)
		}
	}
}

// TestCkptRecover: when the checkpoint latest names does not verify,
// --resume says how out, dos ckpt recover sets it aside and points latest
// at the newest one that verifies, and training resumes from there, bit
// for bit.
func TestCkptRecover(t *testing.T) {
	args := []string{"--steps", "30", "--ckpt-every", "10"}
	straight := train(t, append(args, "--ckpt-dir", filepath.Join(t.TempDir(), "s"))...)
	dir := filepath.Join(t.TempDir(), "ckpt")
	train(t, "--steps", "20", "--ckpt-every", "10", "--ckpt-dir", dir)
	rank := filepath.Join(dir, "step-000000020", "rank-00000.safetensors")
	b, err := os.ReadFile(rank)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-3] ^= 0x40
	if err := os.WriteFile(rank, b, 0o644); err != nil {
		t.Fatal(err)
	}
	rc, out := dosRun(t, time.Minute, append([]string{"train", "--ckpt-dir", dir, "--resume"}, args...)...)
	if rc != 1 || !strings.Contains(out, "dos ckpt recover "+dir) {
		t.Fatalf("--resume from a corrupt latest: rc %d:\n%s", rc, out)
	}
	rc, out = dosRun(t, time.Minute, "ckpt", "recover", dir)
	if rc != 0 || !strings.Contains(out, "set aside") || !strings.Contains(out, "step-000000010") {
		t.Fatalf("dos ckpt recover: rc %d:\n%s", rc, out)
	}
	if rc, out := dosRun(t, time.Minute, "ckpt", "ls", dir); rc != 0 || !strings.Contains(out, "damaged-step-000000020") {
		t.Fatalf("dos ckpt ls after recover: rc %d:\n%s", rc, out)
	}
	resumed := train(t, append(args, "--ckpt-dir", dir, "--resume")...)
	if resumed.FinalLoss != straight.FinalLoss || resumed.Steps != 30 {
		t.Fatalf("resumed from step 10: final_loss %v at %d, straight %v", resumed.FinalLoss, resumed.Steps, straight.FinalLoss)
	}
	if rc, out := dosRun(t, time.Minute, "ckpt", "recover", dir); rc != 0 || !strings.Contains(out, "nothing to do") {
		t.Fatalf("dos ckpt recover of a sound root: rc %d:\n%s", rc, out)
	}
}

// TestResumeListsChanges: every setting of this run that differs from the
// checkpoint's is named on resume, by flag.
func TestResumeListsChanges(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ckpt")
	train(t, "--steps", "4", "--ckpt-every", "4", "--ckpt-dir", dir)
	rc, out := dosRun(t, time.Minute, "train", "--steps", "6", "--ckpt-dir", dir, "--resume",
		"--grad-dtype", "bfloat16", "--working-dtype", "bfloat16", "--subgroup-size", "1000", "--threads", "1", "--beta2", "0.99")
	if rc != 0 {
		t.Fatalf("rc %d:\n%s", rc, out)
	}
	for _, flag := range []string{"--grad-dtype", "--working-dtype", "--subgroup-size", "--threads", "--beta2"} {
		if !strings.Contains(out, "resume: "+flag+" ") {
			t.Errorf("resume did not name %s:\n%s", flag, out)
		}
	}
}
