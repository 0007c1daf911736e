package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/checkpoint"
)

// trainJob trains a small model on 2 ranks for 4 steps, saving at 2 and
// 4, and returns the job's root.
func trainJob(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "job")
	var stdout, stderr bytes.Buffer
	args := []string{"--gpus", "2", "--steps", "4", "--ckpt-dir", dir, "--ckpt-every", "2", "--layers", "1", "--embd", "16",
		"--heads", "2", "--ctx", "8", "--batch", "4", "--sample", "0", "--eval-batches", "1", "--max-memory", "1"}
	if rc := runTrain(args, &stdout, &stderr); rc != 0 {
		t.Fatalf("dos train %v: rc %d\n%s%s", args, rc, stdout.String(), stderr.String())
	}
	return dir
}

// TestCkptJob: dos ckpt ls and verify on the root of a job of ranks (dos
// train --gpus 2) list and verify its latest step in every rank's root; a
// damaged rank fails verify, naming the rank and what to do.
func TestCkptJob(t *testing.T) {
	dir := trainJob(t)
	var stdout, stderr bytes.Buffer
	stdout.Reset()
	if rc := runCkpt([]string{"ls", dir}, &stdout, &stderr); rc != 0 || !strings.Contains(stdout.String(), "2 ranks, latest step 4") ||
		!strings.Contains(stdout.String(), "* "+checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 4)) {
		t.Errorf("dos ckpt ls: rc %d\n%s%s", rc, stdout.String(), stderr.String())
	}
	stdout.Reset()
	if rc := runCkpt([]string{"verify", dir}, &stdout, &stderr); rc != 0 || !strings.Contains(stdout.String(), "OK job "+dir+": step 4 verifies in all 2 ranks' roots") ||
		!strings.Contains(stdout.String(), "step 4, rank 1 of a job of 2 ranks,") {
		t.Errorf("dos ckpt verify: rc %d\n%s%s", rc, stdout.String(), stderr.String())
	}
	stderr.Reset()
	if rc := runCkpt([]string{"verify", "--rank", "1", dir}, &stdout, &stderr); rc != 2 || !strings.Contains(stderr.String(), checkpoint.RankRoot(dir, 1)) {
		t.Errorf("dos ckpt verify --rank 1 of a job's root: rc %d, want 2 naming rank 1's root\n%s", rc, stderr.String())
	}
	for _, p := range [][]string{{"inspect", checkpoint.RankRoot(dir, 1)}, {"inspect", "--rank", "1", dir}} {
		stdout.Reset()
		if rc := runCkpt(p, &stdout, &stderr); rc != 0 || !strings.Contains(stdout.String(), "rank 1 of a job of 2 ranks") ||
			!strings.Contains(stdout.String(), checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 4)) {
			t.Errorf("dos ckpt %v: rc %d\n%s%s", p, rc, stdout.String(), stderr.String())
		}
	}
	if rc := runCkpt([]string{"inspect", "--rank", "2", dir}, &stdout, &stderr); rc != 2 {
		t.Errorf("dos ckpt inspect --rank 2 of a 2-rank job: rc %d, want 2", rc)
	}
	files, _ := filepath.Glob(filepath.Join(checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 4), "*.safetensors"))
	if len(files) != 1 {
		t.Fatalf("rank 1's files: %v", files)
	}
	b, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-3] ^= 0xff
	if err := os.WriteFile(files[0], b, 0o644); err != nil {
		t.Fatal(err)
	}
	stderr.Reset()
	if rc := runCkpt([]string{"verify", dir}, &stdout, &stderr); rc != 1 || !strings.Contains(stderr.String(), "rank 1's step 4 does not verify") {
		t.Errorf("dos ckpt verify of a damaged rank: rc %d\n%s", rc, stderr.String())
	}
	// While a writer holds the job (a running trainer, whose retention
	// removes old steps), the failure is not called damage.
	lock, err := checkpoint.Lock(checkpoint.OS, dir)
	if err != nil {
		t.Fatal(err)
	}
	stderr.Reset()
	if rc := runCkpt([]string{"verify", dir}, &stdout, &stderr); rc != 1 || !strings.Contains(stderr.String(), "holds the job (a running dos train") || strings.Contains(stderr.String(), "dos ckpt recover") {
		t.Errorf("dos ckpt verify of a held job: rc %d\n%s", rc, stderr.String())
	}
	lock.Unlock()
	stderr.Reset()
	if rc := runCkpt([]string{"verify", "--rank", "5", dir}, &stdout, &stderr); rc != 2 || !strings.Contains(stderr.String(), "has 2 ranks (0..1)") {
		t.Errorf("dos ckpt verify --rank 5 of a 2-rank job: rc %d\n%s", rc, stderr.String())
	}
	// A rank's save the job did not commit (its latest moved back, as
	// after a crash before CommitJob) is said to be so.
	if err := os.WriteFile(filepath.Join(dir, checkpoint.LatestFile), []byte("step-000000002"), 0o644); err != nil {
		t.Fatal(err)
	}
	stdout.Reset()
	runCkpt([]string{"ls", dir}, &stdout, &stderr)
	if want := checkpoint.StepDir(checkpoint.RankRoot(dir, 0), 4) + "  (this rank's save, not committed for the job"; !strings.Contains(stdout.String(), want) {
		t.Errorf("dos ckpt ls with the job behind its ranks lacks %q:\n%s", want, stdout.String())
	}
	// dos ckpt recover on the job's root: rank 1's damaged step 4 is set
	// aside, and the job and both rank roots stay at step 2, which verifies.
	stdout.Reset()
	if rc := runCkpt([]string{"recover", dir}, &stdout, &stderr); rc != 0 || !strings.Contains(stdout.String(), "now at step 2") || !strings.Contains(stdout.String(), "rank 1: step-000000004 did not verify") {
		t.Errorf("dos ckpt recover of the job: rc %d\n%s%s", rc, stdout.String(), stderr.String())
	}
	stdout.Reset()
	if rc := runCkpt([]string{"verify", dir}, &stdout, &stderr); rc != 0 || !strings.Contains(stdout.String(), "OK job "+dir+": step 2 verifies in all 2 ranks' roots") {
		t.Errorf("dos ckpt verify after the recovery: rc %d\n%s%s", rc, stdout.String(), stderr.String())
	}
	stdout.Reset()
	if rc := runCkpt([]string{"recover", dir}, &stdout, &stderr); rc != 0 || !strings.Contains(stdout.String(), "nothing to do") {
		t.Errorf("dos ckpt recover of a sound job: rc %d\n%s%s", rc, stdout.String(), stderr.String())
	}
	stdout.Reset()
	stderr.Reset()
	if rc := runCkpt([]string{"recover", "--rank", "1", dir}, &stdout, &stderr); rc != 2 || !strings.Contains(stderr.String(), checkpoint.RankRoot(dir, 1)) {
		t.Errorf("dos ckpt recover --rank 1 of a job's root: rc %d, want 2 naming rank 1's root\n%s", rc, stderr.String())
	}
}

// TestCkptReshard: dos ckpt reshard cuts a 2-rank job's checkpoint for one
// rank; the result verifies, dos export takes it (one rank's whole
// tensors), and dos train --resume continues from it without --gpus;
// bad arguments are usage errors.
func TestCkptReshard(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "job")
	one := filepath.Join(t.TempDir(), "one")
	var stdout, stderr bytes.Buffer
	shape := []string{"--layers", "1", "--embd", "16", "--heads", "2", "--ctx", "8", "--batch", "4", "--sample", "0", "--eval-batches", "1", "--max-memory", "1"}
	args := append([]string{"--gpus", "2", "--steps", "2", "--ckpt-dir", dir, "--ckpt-every", "2"}, shape...)
	if rc := runTrain(args, &stdout, &stderr); rc != 0 {
		t.Fatalf("dos train %v: rc %d\n%s%s", args, rc, stdout.String(), stderr.String())
	}
	stdout.Reset()
	if rc := runCkpt([]string{"reshard", "--gpus", "1", dir, one}, &stdout, &stderr); rc != 0 ||
		!strings.Contains(stdout.String(), "dos train --resume --ckpt-dir "+one+" --gpus 1") {
		t.Fatalf("dos ckpt reshard: rc %d\n%s%s", rc, stdout.String(), stderr.String())
	}
	stdout.Reset()
	if rc := runCkpt([]string{"verify", one}, &stdout, &stderr); rc != 0 {
		t.Errorf("dos ckpt verify of the re-sharded root: rc %d\n%s%s", rc, stdout.String(), stderr.String())
	}
	if rc := runExport([]string{"--ckpt", one, "--hf", filepath.Join(t.TempDir(), "hf")}, &stdout, &stderr); rc != 0 {
		t.Errorf("dos export of the re-sharded root: rc %d\n%s", rc, stderr.String())
	}
	stdout.Reset()
	args = append([]string{"--steps", "4", "--ckpt-dir", one, "--resume"}, shape...)
	if rc := runTrain(args, &stdout, &stderr); rc != 0 || !strings.Contains(stdout.String(), "at iteration 2") {
		t.Errorf("dos train --resume from the re-sharded root: rc %d\n%s%s", rc, stdout.String(), stderr.String())
	}
	for _, bad := range [][]string{{"reshard", dir, one}, {"reshard", "--gpus", "2", dir}, {"reshard", "--gpus", "65", dir, one}} {
		stderr.Reset()
		if rc := runCkpt(bad, &stdout, &stderr); rc != 2 {
			t.Errorf("dos ckpt %v: rc %d, want 2 (usage)\n%s", bad, rc, stderr.String())
		}
	}
}

// TestResumeJobWithoutLatest: a job whose latest is gone (a first commit
// cut short) or names no step (damaged) resumes with the settings of its
// checkpoints taken from rank 0's root, as a single rank's root does: no
// flag to repeat, --gpus included; dos ckpt recover repairs the damaged
// latest.
func TestResumeJobWithoutLatest(t *testing.T) {
	dir := trainJob(t)
	var stdout, stderr bytes.Buffer
	latest := filepath.Join(dir, checkpoint.LatestFile)
	if err := os.WriteFile(latest, []byte("garbage\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	stdout.Reset()
	stderr.Reset()
	if rc := runCkpt([]string{"recover", dir}, &stdout, &stderr); rc != 0 || !strings.Contains(stdout.String(), "a latest that names no step") || !strings.Contains(stdout.String(), "now at step 4") {
		t.Errorf("dos ckpt recover of a job whose latest holds garbage: rc %d\n%s%s", rc, stdout.String(), stderr.String())
	}
	for _, damage := range []string{"removed", "garbage"} {
		if damage == "removed" {
			os.Remove(latest)
		} else if err := os.WriteFile(latest, []byte("garbage\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		stdout.Reset()
		stderr.Reset()
		resume := []string{"--resume", "--ckpt-dir", dir, "--steps", "6", "--max-memory", "1", "--sample", "0", "--eval-batches", "1"}
		if rc := runTrain(resume, &stdout, &stderr); rc != 0 || !strings.Contains(stdout.String(), "--layers 1") || !strings.Contains(stdout.String(), "--gpus 2") || !strings.Contains(stdout.String(), "iter     6/6") {
			t.Errorf("latest %s: dos train %v: rc %d\n%s%s", damage, resume, rc, stdout.String(), stderr.String())
		}
		os.WriteFile(latest, []byte("step-000000004\n"), 0o644) // back to step 4 for the next round
		for r := range 2 {
			checkpoint.RewindRank(checkpoint.OS, checkpoint.RankRoot(dir, r), 4)
		}
	}
}
