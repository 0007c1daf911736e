package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/checkpoint"
)

// The defects of the second job/ckpt adversary round, each as a user
// meets them with the CLI.

// TestCommittedJobNotClearedAsFirstSave (round 2, F1): a job that
// committed, its latest lost, looked like a first save cut short (no step
// every rank holds, at most one held): dos ckpt recover and dos train
// --resume removed every rank root and job.json (rank 0's committed step
// 10 with them) and started at iteration 0. Now, with rank 1's root moved
// away (a --ckpt-keep 1 job) or rank 1's step gone while its latest names
// it, both refuse, saying what they saw, and change nothing.
func TestCommittedJobNotClearedAsFirstSave(t *testing.T) {
	keep1 := func(t *testing.T) string {
		dir := trainJobWith(t, "6", "--ckpt-keep", "1")
		os.Remove(filepath.Join(dir, checkpoint.LatestFile))
		if err := os.Rename(checkpoint.RankRoot(dir, 1), dir+"-rank1"); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	one := func(t *testing.T) string {
		dir := trainJobWith(t, "2")
		os.Remove(filepath.Join(dir, checkpoint.LatestFile))
		if err := os.RemoveAll(checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 2)); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	for _, c := range []struct {
		name, want string
		make       func(t *testing.T) string
	}{
		{"rank root moved away", "rank-00001 is missing", keep1},
		{"rank latest names a step lost", "which it does not hold complete", one},
	} {
		for _, cmd := range []string{"recover", "resume"} {
			t.Run(c.name+"/"+cmd, func(t *testing.T) {
				dir := c.make(t)
				before := treeHash(t, dir)
				var rc int
				var stdout, stderr string
				if cmd == "recover" {
					rc, stdout, stderr = invoke(t, "ckpt", "recover", dir)
				} else {
					rc, stdout, stderr = invoke(t, "train", append(resumeArgs(dir, "8"), "--gpus", "2")...)
				}
				if rc != 1 || !strings.Contains(stderr, c.want) || !strings.Contains(stderr, "Nothing was changed") ||
					!strings.Contains(stderr, "may have committed") || !strings.Contains(stderr, "first-save-* pieces kept by an earlier clearing too, stays") || strings.Contains(stdout+stderr, "never committed a checkpoint (") {
					t.Errorf("rc %d, want 1 naming %q\n%s%s", rc, c.want, stdout, stderr)
				}
				if after := treeHash(t, dir); after != before {
					t.Errorf("the job root changed")
				}
			})
		}
	}
}

// killedReshardMoves reshards a 2-rank job at step 4 to 4 ranks, then
// leaves its output as a dos ckpt reshard killed during its moves
// (reshardMove: job.json and rank roots first, latest last) leaves it:
// dst holds job.json, rank-00000 and rank-00001; dst/.tmp-reshard-123 holds
// rank-00002, rank-00003 and the latest.
func killedReshardMoves(t *testing.T) (dst, tmp string) {
	src := trainJobWith(t, "4")
	out := filepath.Join(t.TempDir(), "out")
	if rc, stdout, stderr := invoke(t, "ckpt", "reshard", "--gpus", "4", src, out); rc != 0 {
		t.Fatalf("dos ckpt reshard: rc %d\n%s%s", rc, stdout, stderr)
	}
	dst = filepath.Join(t.TempDir(), "dst")
	tmp = filepath.Join(dst, ".tmp-reshard-123")
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"rank-00002", "rank-00003", checkpoint.LatestFile} {
		if err := os.Rename(filepath.Join(out, n), filepath.Join(tmp, n)); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range []string{checkpoint.JobFile, "rank-00000", "rank-00001"} {
		if err := os.Rename(filepath.Join(out, n), filepath.Join(dst, n)); err != nil {
			t.Fatal(err)
		}
	}
	return dst, tmp
}

// TestKilledReshardMovesFinished (round 2, F2): --resume (and dos ckpt
// recover) on the output of a reshard killed during its final moves
// removed its .tmp-reshard-* ("never a checkpoint": it held the committed
// latest and ranks 2-3), then the rank roots and job.json, and started at
// iteration 0. Now both finish the moves: the job resumes at step 4.
func TestKilledReshardMovesFinished(t *testing.T) {
	dst, tmp := killedReshardMoves(t)
	rc, stdout, stderr := invoke(t, "train", append(resumeArgs(dst, "6"), "--gpus", "4")...)
	if rc != 0 || !strings.Contains(stdout, "finished the moves of a dos ckpt reshard") || !strings.Contains(stdout, "at iteration 4") || strings.Contains(stdout, "never a checkpoint") {
		t.Errorf("dos train --resume: rc %d\n%s%s", rc, stdout, stderr)
	}
	if _, err := os.Stat(tmp); err == nil {
		t.Errorf("%s still there", tmp)
	}
	dst, tmp = killedReshardMoves(t)
	rc, stdout, stderr = invoke(t, "ckpt", "recover", dst)
	if rc != 0 || !strings.Contains(stdout, "finished the moves") || !strings.Contains(stdout, "step 4") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if step, world, err := checkpoint.JobLatest(checkpoint.OS, dst); step != 4 || world != 4 || err != nil {
		t.Errorf("after recover: step %d of %d ranks, %v", step, world, err)
	}
	// An entry of the leftover that dst holds too: refused, nothing changed.
	dst, tmp = killedReshardMoves(t)
	if err := os.Mkdir(filepath.Join(tmp, "rank-00000"), 0o755); err != nil {
		t.Fatal(err)
	}
	before := treeHash(t, dst)
	rc, stdout, stderr = invoke(t, "train", append(resumeArgs(dst, "6"), "--gpus", "4")...)
	if rc != 1 || !strings.Contains(stderr, tmp) || !strings.Contains(stderr, "nothing was changed") {
		t.Errorf("dos train --resume, rank-00000 in both: rc %d\n%s%s", rc, stdout, stderr)
	}
	if treeHash(t, dst) != before {
		t.Error("dst changed")
	}
}

// TestJobRootStrayStepEntry (round 2, F4): a step-* entry in a job's root
// (a note step-notes.txt, an empty step-000000001) blocked recover and
// --resume with "holds one rank's checkpoints (its latest, ...), not a
// job's", while ls and verify said OK; nothing named the entry. Now all
// four refuse, naming it and saying to move it out; nothing is changed.
func TestJobRootStrayStepEntry(t *testing.T) {
	for _, c := range []struct {
		name string
		make func(p string) error
	}{
		{"step-notes.txt", func(p string) error { return os.WriteFile(p, []byte("hi\n"), 0o644) }},
		{"step-000000001", func(p string) error { return os.Mkdir(p, 0o755) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := trainJobWith(t, "4")
			p := filepath.Join(dir, c.name)
			if err := c.make(p); err != nil {
				t.Fatal(err)
			}
			before := treeHash(t, dir)
			for _, args := range [][]string{{"ckpt", "ls", dir}, {"ckpt", "verify", dir}, {"ckpt", "recover", dir}, append([]string{"train"}, append(resumeArgs(dir, "6"), "--gpus", "2")...)} {
				rc, stdout, stderr := invoke(t, args[0], args[1:]...)
				if rc != 1 || !strings.Contains(stderr, p) || !strings.Contains(stderr, "move "+c.name+" out of "+dir) || strings.Contains(stderr, "one rank's checkpoints") {
					t.Errorf("dos %v: rc %d, want 1 naming %s\n%s%s", args, rc, p, stdout, stderr)
				}
			}
			if treeHash(t, dir) != before {
				t.Error("the job root changed")
			}
		})
	}
}

// TestJobLatestMovedBackReadOnly (round 2, F3): with the job's latest
// moved back to step 2 while every rank holds 4, 6 and 8, --resume takes
// step 8, but ls listed 4-8 as "not committed for the job", verify and
// inspect checked step 2 and reshard exported it. Now each says the
// latest moved back and acts on step 8, the step a resume takes.
func TestJobLatestMovedBackReadOnly(t *testing.T) {
	dir := trainJobWith(t, "8")
	if err := os.WriteFile(filepath.Join(dir, checkpoint.LatestFile), []byte("step-000000002\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	const said = "dos train --resume takes step 8"
	if rc, stdout, stderr := invoke(t, "ckpt", "ls", dir); rc != 1 || !strings.Contains(stderr, said) || strings.Contains(stdout, "not committed for the job") {
		t.Errorf("dos ckpt ls: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", dir); rc != 0 || !strings.Contains(stderr, said) || !strings.Contains(stdout, "step 8 verifies") {
		t.Errorf("dos ckpt verify: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "inspect", dir); rc != 0 || !strings.Contains(stderr, said) || !strings.Contains(stdout, "latest step 8") {
		t.Errorf("dos ckpt inspect: rc %d\n%s%s", rc, stdout, stderr)
	}
	out := filepath.Join(t.TempDir(), "out")
	if rc, stdout, stderr := invoke(t, "ckpt", "reshard", "--gpus", "1", dir, out); rc != 0 || !strings.Contains(stdout, said) || !strings.Contains(stdout, "step 8 of") {
		t.Errorf("dos ckpt reshard: rc %d\n%s%s", rc, stdout, stderr)
	}
}
