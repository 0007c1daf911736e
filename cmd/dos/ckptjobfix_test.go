package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/deepstates/dos/checkpoint"
)

// The defects of the fourth job adversary's report (a hang, a linked step
// directory, steps deleted, rank roots in a single rank's root, a job that
// never committed), each as a user meets them with the CLI.

// invokeWithin is invoke, failing the test when the command has not
// returned within d (it is left running: a hang).
func invokeWithin(t *testing.T, d time.Duration, sub string, args ...string) (int, string, string) {
	t.Helper()
	type result struct {
		rc             int
		stdout, stderr string
	}
	done := make(chan result, 1)
	go func() {
		rc, stdout, stderr := invoke(t, sub, args...)
		done <- result{rc, stdout, stderr}
	}()
	select {
	case r := <-done:
		return r.rc, r.stdout, r.stderr
	case <-time.After(d):
		t.Fatalf("dos %s %v has not returned after %v", sub, args, d)
	}
	return 0, "", ""
}

// stepsIn returns the step directories (step-*) of a rank root, by name.
func stepsIn(t *testing.T, rankRoot string) []string {
	t.Helper()
	var steps []string
	for _, e := range entries(t, rankRoot) {
		if strings.HasPrefix(e, "step-") {
			steps = append(steps, e)
		}
	}
	return steps
}

// TestRecoverJobManifestNotAFile (finding 1): rank 1's manifest.json of
// the job's step 8 is a directory, or a FIFO. dos ckpt recover looped
// 65,537 times (minutes, megabytes of the same note) and said it had
// recovered the job at step 8, which still failed verify: a step whose
// manifest is no file was complete for the job and damaged for the rank
// root. Now it returns at once, the job moved to step 6, saying so once;
// verify and --resume then pass.
func TestRecoverJobManifestNotAFile(t *testing.T) {
	for _, kind := range []string{"directory", "FIFO"} {
		t.Run(kind, func(t *testing.T) {
			dir := trainJobWith(t, "8")
			m := filepath.Join(checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 8), checkpoint.ManifestFile)
			if err := os.Remove(m); err != nil {
				t.Fatal(err)
			}
			var err error
			if kind == "FIFO" {
				err = syscall.Mkfifo(m, 0o644)
			} else {
				err = os.Mkdir(m, 0o755)
			}
			if err != nil {
				t.Fatal(err)
			}
			rc, stdout, stderr := invokeWithin(t, time.Minute, "ckpt", "recover", dir)
			if rc != 0 || !strings.Contains(stdout, "now at step 6") || strings.Count(stdout, "is a "+kind) > 1 || len(stdout) > 4000 {
				t.Errorf("dos ckpt recover: rc %d, want 0, the job at step 6 (said once)\n%.4000s%s", rc, stdout, stderr)
			}
			if step, _, err := checkpoint.JobLatest(checkpoint.OS, dir); step != 6 || err != nil {
				t.Errorf("the job after recover: step %d, %v; want 6", step, err)
			}
			if rc, stdout, stderr := invokeWithin(t, time.Minute, "ckpt", "verify", dir); rc != 0 || !strings.Contains(stdout, "step 6 verifies") {
				t.Errorf("dos ckpt verify after recover: rc %d\n%s%s", rc, stdout, stderr)
			}
			if rc, stdout, stderr := invokeWithin(t, time.Minute, "train", resumeArgs(dir, "8")...); rc != 0 {
				t.Errorf("dos train --resume after recover: rc %d\n%s%s", rc, stdout, stderr)
			}
		})
	}
}

// TestJobSymlinkedStepDir (finding 2): rank 1's step 8 of job W is a
// link to another run's rank 1 step 8. ls passed, verify said "OK", and
// reshard joined the two runs' pieces into one checkpoint: the job's
// identity checks skipped the link (no directory) while the loads
// followed it. Now ls, verify, recover, reshard and --resume refuse it,
// naming the link; nothing is changed, the other run's root never
// written.
func TestJobSymlinkedStepDir(t *testing.T) {
	a := trainJobWith(t, "8")
	b := trainJobWith(t, "8", "--seed", "7")
	w := filepath.Join(t.TempDir(), "w")
	copyTree(t, a, w)
	link := checkpoint.StepDir(checkpoint.RankRoot(w, 1), 8)
	if err := os.RemoveAll(link); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(checkpoint.StepDir(checkpoint.RankRoot(b, 1), 8), link); err != nil {
		t.Fatal(err)
	}
	hb, hw := treeHash(t, b), treeHash(t, w)
	re := filepath.Join(t.TempDir(), "re")
	for _, args := range [][]string{{"ls", w}, {"verify", w}, {"recover", w}, {"reshard", "--gpus", "1", w, re}} {
		if rc, stdout, stderr := invoke(t, "ckpt", args...); rc != 1 || !strings.Contains(stderr, link+" is a symbolic link") {
			t.Errorf("dos ckpt %v: rc %d, want 1 naming the link %s\n%s%s", args, rc, link, stdout, stderr)
		}
	}
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(w, "9")...); rc != 1 || !strings.Contains(stderr, link+" is a symbolic link") {
		t.Errorf("dos train --resume: rc %d, want 1 naming the link\n%s%s", rc, stdout, stderr)
	}
	if _, err := os.Stat(re); err == nil {
		t.Errorf("reshard wrote %s", re)
	}
	if treeHash(t, b) != hb {
		t.Error("the other run's root was changed")
	}
	if treeHash(t, w) != hw {
		t.Error("the refused job root was changed")
	}
}

// TestRankRootLinkedStepDir (finding 2): verify and inspect of the rank
// root itself, or of the job's step in it, do not follow the link either.
func TestRankRootLinkedStepDir(t *testing.T) {
	a := trainJobWith(t, "4")
	b := trainJobWith(t, "4", "--seed", "7")
	link := checkpoint.StepDir(checkpoint.RankRoot(a, 1), 4)
	if err := os.RemoveAll(link); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(checkpoint.StepDir(checkpoint.RankRoot(b, 1), 4), link); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"verify", checkpoint.RankRoot(a, 1)}, {"inspect", checkpoint.RankRoot(a, 1)}, {"inspect", "--rank", "1", a}, {"verify", link}} {
		if rc, stdout, stderr := invoke(t, "ckpt", args...); rc != 1 || !strings.Contains(stderr, link+" is a symbolic link") {
			t.Errorf("dos ckpt %v: rc %d, want 1 naming the link\n%s%s", args, rc, stdout, stderr)
		}
	}
}

// TestJobLatestMovedBack (finding 3): the job's latest names step 2 while
// every rank root holds steps 4, 6 and 8 complete after it (an older copy
// of latest put back). --resume and recover deleted steps 4, 6 and 8 as
// "never committed for the job"; a rank runs at most one save ahead of
// the job, so these were the job's. Now both move the job to step 8, the
// newest every rank holds, deleting nothing; --resume's "resume: from"
// names step 8's directory, not step 2's.
func TestJobLatestMovedBack(t *testing.T) {
	job := trainJobWith(t, "8")
	all := []string{"step-000000002", "step-000000004", "step-000000006", "step-000000008"}
	for _, how := range []string{"recover", "resume"} {
		t.Run(how, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "jl")
			copyTree(t, job, dir)
			if err := os.WriteFile(filepath.Join(dir, checkpoint.LatestFile), []byte("step-000000002\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			var rc int
			var stdout, stderr string
			if how == "recover" {
				rc, stdout, stderr = invoke(t, "ckpt", "recover", dir)
			} else {
				rc, stdout, stderr = invoke(t, "train", resumeArgs(dir, "8")...)
			}
			if rc != 0 || strings.Contains(stdout, "retired") || !strings.Contains(stdout, "step 8") || strings.Contains(stdout, "from "+checkpoint.StepDir(checkpoint.RankRoot(dir, 0), 2)) {
				t.Errorf("dos %s: rc %d, want 0, the job at step 8, nothing retired\n%s%s", how, rc, stdout, stderr)
			}
			if step, _, err := checkpoint.JobLatest(checkpoint.OS, dir); step != 8 || err != nil {
				t.Errorf("the job after %s: step %d, %v; want 8", how, step, err)
			}
			for r := range 2 {
				if got := stepsIn(t, checkpoint.RankRoot(dir, r)); !slices.Equal(got, all) {
					t.Errorf("rank %d's root after %s holds %v, want %v", r, how, got, all)
				}
			}
		})
	}
}

// TestRankRootInSingleRoot (finding 4): dos train --ckpt-dir and dos ckpt
// reshard into ROOT/rank-00000 of a single rank's root ROOT succeeded,
// leaving ROOT unusable; a rank-00000 directory there sent ls and recover
// to "put job.json back" and train to "pass the --gpus it was trained
// with". Now the writes are refused, nothing created, and a stray
// rank-00000 is named with what to do: remove it.
func TestRankRootInSingleRoot(t *testing.T) {
	single := trainRoot(t, "3", "3")
	job := trainJob(t)
	slot := filepath.Join(single, "rank-00000")
	fresh := append([]string{"--ckpt-dir", slot, "--steps", "2", "--ckpt-every", "2"}, tinyShape...)
	for _, args := range [][]string{fresh, append([]string{"--gpus", "2"}, fresh...)} {
		if rc, stdout, stderr := invoke(t, "train", args...); rc == 0 || !strings.Contains(stderr, "inside "+single+", which holds a single rank's checkpoints") {
			t.Errorf("dos train %v: rc %d\n%s%s", args, rc, stdout, stderr)
		}
	}
	for _, n := range []string{"1", "2"} {
		if rc, stdout, stderr := invoke(t, "ckpt", "reshard", "--gpus", n, job, slot); rc == 0 || !strings.Contains(stderr, "inside "+single+", which holds a single rank's checkpoints") {
			t.Errorf("dos ckpt reshard --gpus %s JOB %s: rc %d\n%s%s", n, slot, rc, stdout, stderr)
		}
	}
	if _, err := os.Stat(slot); err == nil {
		t.Fatalf("%s was created", slot)
	}
	if err := os.Mkdir(slot, 0o755); err != nil {
		t.Fatal(err)
	}
	want := "remove " + slot
	for _, args := range [][]string{{"ls", single}, {"recover", single}, {"verify", single}} {
		if rc, stdout, stderr := invoke(t, "ckpt", args...); rc != 1 || !strings.Contains(stderr, want) || strings.Contains(stderr, "put job.json back") {
			t.Errorf("dos ckpt %v: rc %d, want 1 saying to %s\n%s%s", args, rc, want, stdout, stderr)
		}
	}
	resume := append([]string{"--resume", "--ckpt-dir", single, "--steps", "4"}, tinyShape...)
	if rc, stdout, stderr := invoke(t, "train", resume...); rc != 1 || !strings.Contains(stderr, want) || strings.Contains(stderr, "--gpus it was trained with") {
		t.Errorf("dos train --resume: rc %d, want 1 saying to %s\n%s%s", rc, want, stdout, stderr)
	}
	if err := os.Remove(slot); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "train", resume...); rc != 0 {
		t.Errorf("dos train --resume with %s removed: rc %d\n%s%s", slot, rc, stdout, stderr)
	}
}

// TestJobNeverCommitted (finding 5): a job killed before its first commit
// left job.json (3 ranks) and nothing else. dos ckpt recover said "no
// step is held by every rank; " and left it; a fresh run was told to pass
// --resume, a one-rank --resume to re-shard. Now recover removes job.json,
// saying so and that a new run may start; a fresh run then starts there.
// Without recover, the refusals name it, and --resume with any --gpus
// starts over.
func TestJobNeverCommitted(t *testing.T) {
	onlyJob := func(t *testing.T) string {
		dir := filepath.Join(t.TempDir(), "onlyjob")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, checkpoint.JobFile), []byte(`{"format":"dos-job","world_size":3}`), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	fresh := func(dir string, extra ...string) []string {
		return append(append([]string{"--ckpt-dir", dir, "--steps", "2", "--ckpt-every", "2"}, tinyShape...), extra...)
	}
	dir := onlyJob(t)
	for _, args := range [][]string{fresh(dir, "--gpus", "2"), fresh(dir), fresh(dir, "--resume")} {
		if rc, stdout, stderr := invoke(t, "train", args...); rc != 1 || !strings.Contains(stderr, "never committed a checkpoint") || !strings.Contains(stderr, "dos ckpt recover "+dir) {
			t.Errorf("dos train %v: rc %d, want 1 naming dos ckpt recover\n%s%s", args, rc, stdout, stderr)
		}
	}
	rc, stdout, stderr := invoke(t, "ckpt", "recover", dir)
	if rc != 0 || !strings.Contains(stdout, "never committed a checkpoint") || !strings.Contains(stdout, "removed "+checkpoint.JobFile) ||
		!strings.Contains(stdout, "a new run may start there") || strings.Contains(stdout, "; \n") || strings.Contains(stdout, "no step is held") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if got := entries(t, dir); slices.Contains(got, checkpoint.JobFile) {
		t.Errorf("after recover the root holds %v", got)
	}
	if rc, stdout, stderr := invoke(t, "train", fresh(dir, "--gpus", "2")...); rc != 0 {
		t.Errorf("a fresh dos train --gpus 2 after recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	// --resume of another rank count starts over, as on an empty root.
	dir = onlyJob(t)
	if rc, stdout, stderr := invoke(t, "train", fresh(dir, "--resume", "--gpus", "2")...); rc != 0 || !strings.Contains(stdout, "starting at iteration 0") {
		t.Errorf("dos train --resume --gpus 2: rc %d\n%s%s", rc, stdout, stderr)
	}
	if step, world, err := checkpoint.JobLatest(checkpoint.OS, dir); step != 2 || world != 2 || err != nil {
		t.Errorf("after --resume --gpus 2: step %d of %d ranks, %v", step, world, err)
	}
}

// TestCkptLsJobNeverCommitted (finding 5): ls of such a root says what it
// is and what clears it (it said "no checkpoint").
func TestCkptLsJobNeverCommitted(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, checkpoint.JobFile), []byte(`{"format":"dos-job","world_size":1}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "ls", dir); rc != 1 || !strings.Contains(stderr, "of 1 rank never committed a checkpoint") || !strings.Contains(stderr, "dos ckpt recover "+dir) {
		t.Errorf("dos ckpt ls: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestJobMinorMessages (the report's minor items): verify --rank 1 of
// rank 1's root said it held rank 0; a rank root's latest that is a
// directory gave --resume a raw rename error; "1 ranks"; --resume of a
// rank root named its oldest step, not the one it was resuming.
func TestJobMinorMessages(t *testing.T) {
	job := trainJobWith(t, "8")
	rr1 := checkpoint.RankRoot(job, 1)
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", "--rank", "1", rr1); rc != 0 || !strings.Contains(stdout, "rank 1 of a job of 2 ranks") {
		t.Errorf("dos ckpt verify --rank 1 %s: rc %d\n%s%s", rr1, rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", "--rank", "0", rr1); rc != 1 || !strings.Contains(stderr, "holds rank 1's pieces of a job of 2 ranks, not rank 0's") {
		t.Errorf("dos ckpt verify --rank 0 %s: rc %d\n%s%s", rr1, rc, stdout, stderr)
	}

	dir := filepath.Join(t.TempDir(), "rl")
	copyTree(t, job, dir)
	latest := filepath.Join(checkpoint.RankRoot(dir, 1), checkpoint.LatestFile)
	if err := os.Remove(latest); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(latest, 0o755); err != nil {
		t.Fatal(err)
	}
	rc, stdout, stderr := invoke(t, "train", resumeArgs(dir, "9")...)
	if rc != 1 || !strings.Contains(stderr, latest+" is a directory, not a file") || strings.Contains(stderr, "rename") {
		t.Errorf("dos train --resume, rank 1's latest a directory: rc %d\n%s%s", rc, stdout, stderr)
	}
	if _, err := os.Stat(latest + ".tmp"); err == nil {
		t.Errorf("%s.tmp was left behind", latest)
	}

	dir = filepath.Join(t.TempDir(), "one")
	copyTree(t, job, dir)
	if err := os.WriteFile(filepath.Join(dir, checkpoint.JobFile), []byte(`{"format":"dos-job","world_size":1}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", dir); rc != 1 || strings.Contains(stderr, "1 ranks") || !strings.Contains(stderr, "says 1 rank") {
		t.Errorf("dos ckpt verify, job.json of 1 rank: rc %d\n%s%s", rc, stdout, stderr)
	}

	rr0 := checkpoint.RankRoot(job, 0)
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(rr0, "9")...); rc != 1 || !strings.Contains(stderr, "step-000000008") || strings.Contains(stderr, "step-000000002") {
		t.Errorf("dos train --resume --ckpt-dir %s: rc %d, want 1 naming step-000000008\n%s%s", rr0, rc, stdout, stderr)
	}
}

// TestJobLatestMovedBackRankLostNewest (the third round's F1): a job
// latest moved back to step 4 of steps 2, 4, 6, 8 while rank 1 lost its
// step 8: every rank holds only step 6 after the latest, but rank 0 holds
// two (6 and 8), which a rank one save ahead never does. recover and
// --resume retired steps 6 and 8 as "never committed"; now the job moves
// to step 6 and rank 0's step 8 is kept (set aside whole), nothing deleted.
func TestJobLatestMovedBackRankLostNewest(t *testing.T) {
	job := trainJobWith(t, "8")
	for _, how := range []string{"recover", "resume"} {
		t.Run(how, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "jl")
			copyTree(t, job, dir)
			if err := os.WriteFile(filepath.Join(dir, checkpoint.LatestFile), []byte("step-000000004\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.RemoveAll(checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 8)); err != nil {
				t.Fatal(err)
			}
			var rc int
			var stdout, stderr string
			if how == "recover" {
				rc, stdout, stderr = invoke(t, "ckpt", "recover", dir)
			} else {
				rc, stdout, stderr = invoke(t, "train", resumeArgs(dir, "6")...)
			}
			if rc != 0 || strings.Contains(stdout, "retired") {
				t.Errorf("dos %s: rc %d, want 0 and nothing retired\n%s%s", how, rc, stdout, stderr)
			}
			if step, _, err := checkpoint.JobLatest(checkpoint.OS, dir); step != 6 || err != nil {
				t.Errorf("the job after %s: step %d, %v; want 6", how, step, err)
			}
			for r, want := range [][]string{{"step-000000002", "step-000000004", "step-000000006"}, {"step-000000002", "step-000000004", "step-000000006"}} {
				if got := stepsIn(t, checkpoint.RankRoot(dir, r)); !slices.Equal(got, want) {
					t.Errorf("rank %d's root after %s holds %v, want %v", r, how, got, want)
				}
			}
			es, _ := os.ReadDir(checkpoint.RankRoot(dir, 0))
			kept := false
			for _, e := range es {
				if strings.Contains(e.Name(), "step-000000008") && e.IsDir() {
					if _, err := os.Stat(filepath.Join(checkpoint.RankRoot(dir, 0), e.Name(), checkpoint.ManifestFile)); err == nil {
						kept = true
					}
				}
			}
			if !kept {
				t.Errorf("rank 0's step 8 was not kept whole after %s: %v", how, es)
			}
		})
	}
}

// TestFirstSaveClearingKeepsCompletePieces (the third round's F2): a job
// saved with --ckpt-keep 1 (each rank holds step 4 only) that lost its
// latest and rank 1's step is the picture of a first save cut short; the
// clearing deleted rank 0's committed step 4. Now recover and --resume
// keep it whole beside the job (first-save-rank-00000-step-000000004-*),
// and say so; the run starts over.
func TestFirstSaveClearingKeepsCompletePieces(t *testing.T) {
	job := filepath.Join(t.TempDir(), "k1")
	args := append([]string{"--gpus", "2", "--steps", "4", "--ckpt-dir", job, "--ckpt-every", "2", "--ckpt-keep", "1"}, tinyShape...)
	if rc, stdout, stderr := invoke(t, "train", args...); rc != 0 {
		t.Fatalf("dos train: rc %d\n%s%s", rc, stdout, stderr)
	}
	for _, how := range []string{"recover", "resume"} {
		t.Run(how, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "k1")
			copyTree(t, job, dir)
			r1 := checkpoint.RankRoot(dir, 1)
			for _, n := range []string{checkpoint.LatestFile, filepath.Base(checkpoint.StepDir(r1, 4))} {
				if err := os.RemoveAll(filepath.Join(r1, n)); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.Remove(filepath.Join(dir, checkpoint.LatestFile)); err != nil {
				t.Fatal(err)
			}
			var rc int
			var stdout, stderr string
			if how == "recover" {
				rc, stdout, stderr = invoke(t, "ckpt", "recover", dir)
			} else {
				rc, stdout, stderr = invoke(t, "train", resumeArgs(dir, "2", "--gpus", "2")...)
			}
			if rc != 0 || !strings.Contains(stdout, "kept whole as "+filepath.Join(dir, "first-save-rank-00000-step-000000004-")) {
				t.Errorf("dos %s: rc %d, want 0 and rank 0's step 4 kept whole\n%s%s", how, rc, stdout, stderr)
			}
			kept, _ := filepath.Glob(filepath.Join(dir, "first-save-rank-00000-step-000000004-*", checkpoint.ManifestFile))
			if len(kept) != 1 {
				t.Errorf("after %s: rank 0's step 4 is not kept whole beside the job (%v)", how, kept)
			} else if rc, stdout, stderr := invoke(t, "ckpt", "ls", dir); !strings.Contains(stdout, filepath.Dir(kept[0])+"  (a rank's complete step kept whole") {
				t.Errorf("dos ckpt ls after %s does not list the kept piece: rc %d\n%s%s", how, rc, stdout, stderr)
			}
		})
	}
}

// TestJobKilledAsItBegan (the third round's F3): a run killed inside
// BeginJob leaves rank roots that hold only their lock files and no
// job.json. Every command said "job.json is missing ... put job.json back"
// (there never was one) or "pass --resume", in a circle. Now a job's run
// starts there, and one rank's run and recover say to remove them.
func TestJobKilledAsItBegan(t *testing.T) {
	mk := func(t *testing.T) string {
		dir := filepath.Join(t.TempDir(), "bj")
		for _, p := range []string{checkpoint.RankRoot(dir, 0), checkpoint.RankRoot(dir, 1)} {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(checkpoint.RankRoot(dir, 0), checkpoint.LockFile), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	dir := mk(t)
	want := "hold nothing (" + checkpoint.RankRoot(dir, 0) + ", " + checkpoint.RankRoot(dir, 1)
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc == 0 || !strings.Contains(stderr, want) || !strings.Contains(stderr, "rm -r") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	one := append([]string{"--steps", "2", "--ckpt-dir", dir}, tinyShape...)
	if rc, stdout, stderr := invoke(t, "train", one...); rc == 0 || !strings.Contains(stderr, want) {
		t.Errorf("dos train (one rank): rc %d\n%s%s", rc, stdout, stderr)
	}
	for _, extra := range [][]string{nil, {"--resume"}} {
		dir := mk(t)
		args := append(append([]string{"--gpus", "2", "--steps", "2", "--ckpt-every", "2", "--ckpt-dir", dir}, extra...), tinyShape...)
		if rc, stdout, stderr := invoke(t, "train", args...); rc != 0 || !strings.Contains(stdout, "done: 2 iterations") {
			t.Errorf("dos train --gpus 2 %v: rc %d\n%s%s", extra, rc, stdout, stderr)
		}
		if step, world, err := checkpoint.JobLatest(checkpoint.OS, dir); step != 2 || world != 2 || err != nil {
			t.Errorf("the job after dos train --gpus 2 %v: step %d of %d ranks, %v", extra, step, world, err)
		}
	}
}

// TestJobFirstSaveOneRankComplete (the job commands' adversary, F4): a
// job killed during its first save after rank 0's piece was durable and
// before rank 1's and any latest. It is no checkpoint, but ls and verify
// said "no checkpoint" listing nothing, inspect spoke of a latest there
// is none of, and a fresh run said "already holds checkpoints: pass
// --resume to continue", which continued nothing. Now every command says
// the job never committed and that recover clears it, ls lists rank 0's
// complete piece, and after recover (which keeps that piece whole) a
// fresh run starts there.
func TestJobFirstSaveOneRankComplete(t *testing.T) {
	dir := trainJobWith(t, "2")
	removeLatests(t, dir, checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 2))
	never := "job " + dir + " of 2 ranks never committed a checkpoint"
	for _, sub := range []string{"ls", "verify", "inspect"} {
		rc, stdout, stderr := invoke(t, "ckpt", sub, dir)
		if rc != 1 || !strings.Contains(stderr, never) || !strings.Contains(stderr, "dos ckpt recover "+dir+" removes what it left") {
			t.Errorf("dos ckpt %s: rc %d\n%s%s", sub, rc, stdout, stderr)
		}
		if sub == "ls" && (!strings.Contains(stdout, checkpoint.StepDir(checkpoint.RankRoot(dir, 0), 2)+"  (complete, a rank's piece of a first save that never committed") || strings.Contains(stderr, "is damaged")) {
			t.Errorf("dos ckpt ls does not list rank 0's complete piece as such:\n%s%s", stdout, stderr)
		}
	}
	fresh := append([]string{"--gpus", "2", "--steps", "2", "--ckpt-dir", dir, "--ckpt-every", "2"}, tinyShape...)
	if rc, stdout, stderr := invoke(t, "train", fresh...); rc != 1 || !strings.Contains(stderr, "never committed a checkpoint") || strings.Contains(stderr, "pass --resume to continue") {
		t.Errorf("a fresh dos train: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 0 || !strings.Contains(stdout, "a new run may start there") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if kept := checkpoint.FirstSaveKept(checkpoint.OS, dir); len(kept) != 1 {
		t.Errorf("recover kept %v, want rank 0's complete piece", kept)
	}
	if rc, stdout, stderr := invoke(t, "train", fresh...); rc != 0 {
		t.Errorf("a fresh dos train after recover: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestJobLostLatestNotFirstSave: a job that committed steps 2, 4 and 6,
// then lost its latest, its rank roots' latests and rank 1's steps (a
// directory emptied by hand). Rank 0 holding three complete steps is no
// first save (which writes one), so no command calls the job "never
// committed" (JobNeverCommitted asks firstSaveCertain), and recover
// refuses to clear it, changing nothing.
func TestJobLostLatestNotFirstSave(t *testing.T) {
	dir := trainJobWith(t, "6")
	rr1 := checkpoint.RankRoot(dir, 1)
	removeLatests(t, dir, checkpoint.StepDir(rr1, 2), checkpoint.StepDir(rr1, 4), checkpoint.StepDir(rr1, 6))
	before := entries(t, checkpoint.RankRoot(dir, 0))
	for _, sub := range []string{"ls", "verify", "inspect"} {
		if rc, stdout, stderr := invoke(t, "ckpt", sub, dir); rc != 1 || strings.Contains(stderr, "never committed") {
			t.Errorf("dos ckpt %s: rc %d\n%s%s", sub, rc, stdout, stderr)
		}
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 1 || !strings.Contains(strings.ToLower(stderr), "nothing was changed") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if got := entries(t, checkpoint.RankRoot(dir, 0)); !slices.Equal(got, before) || len(checkpoint.FirstSaveKept(checkpoint.OS, dir)) != 0 {
		t.Errorf("rank 0's root after recover: %v, was %v", got, before)
	}
}

// removeLatests removes the 2-rank job dir's latest, its rank roots'
// latests and the paths more.
func removeLatests(t *testing.T, dir string, more ...string) {
	t.Helper()
	for _, p := range append([]string{
		filepath.Join(dir, checkpoint.LatestFile),
		filepath.Join(checkpoint.RankRoot(dir, 0), checkpoint.LatestFile),
		filepath.Join(checkpoint.RankRoot(dir, 1), checkpoint.LatestFile),
	}, more...) {
		if err := os.RemoveAll(p); err != nil {
			t.Fatal(err)
		}
	}
}
