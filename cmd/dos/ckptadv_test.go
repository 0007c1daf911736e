package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/deepstates/dos/checkpoint"
)

// The defects an adversary found in the job roots and dos ckpt's job
// commands after issue 29's fixes, each as a user meets them.

// trainJobWith trains a small model on 2 ranks to steps, saving every 2,
// with extra flags, into a new job root it returns.
func trainJobWith(t *testing.T, steps string, extra ...string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "job")
	args := append([]string{"--gpus", "2", "--steps", steps, "--ckpt-dir", dir, "--ckpt-every", "2"}, tinyShape...)
	if rc, stdout, stderr := invoke(t, "train", append(args, extra...)...); rc != 0 {
		t.Fatalf("dos train %v: rc %d\n%s%s", args, rc, stdout, stderr)
	}
	return dir
}

// resumeArgs are dos train --resume's on dir to steps, no shape flag.
func resumeArgs(dir, steps string, extra ...string) []string {
	return append([]string{"--resume", "--ckpt-dir", dir, "--steps", steps, "--sample", "0", "--eval-batches", "1", "--max-memory", "1"}, extra...)
}

// TestJobMixedRuns (adversary 1): a job root made of job A's rank 0 and
// another run B's rank 1 is refused by verify, recover and --resume, each
// naming the two runs; nothing is changed.
func TestJobMixedRuns(t *testing.T) {
	a := trainJobWith(t, "4")
	b := trainJobWith(t, "4", "--seed", "7")
	m := filepath.Join(t.TempDir(), "mixed")
	copyTree(t, a, m)
	os.RemoveAll(checkpoint.RankRoot(m, 1))
	copyTree(t, checkpoint.RankRoot(b, 1), checkpoint.RankRoot(m, 1))
	before := treeHash(t, m)
	for _, args := range [][]string{{"verify", m}, {"recover", m}, {"ls", m}} {
		rc, stdout, stderr := invoke(t, "ckpt", args...)
		if rc != 1 || !strings.Contains(stderr, "different runs") || !strings.Contains(stderr, "Nothing was changed") {
			t.Errorf("dos ckpt %v: rc %d, want 1 naming different runs\n%s%s", args, rc, stdout, stderr)
		}
	}
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(m, "8")...); rc != 1 || !strings.Contains(stderr, "different runs") {
		t.Errorf("dos train --resume of mixed runs: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, _, stderr := invoke(t, "ckpt", "reshard", "--gpus", "1", m, filepath.Join(t.TempDir(), "re")); rc != 1 || !strings.Contains(stderr, "different runs") {
		t.Errorf("dos ckpt reshard of mixed runs: rc %d\n%s", rc, stderr)
	}
	if after := treeHash(t, m); after != before {
		t.Error("the refused job root was changed")
	}
	// A job's own resume keeps its run: it resumes, and verifies after.
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(a, "6")...); rc != 0 {
		t.Fatalf("dos train --resume of job A: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", a); rc != 0 {
		t.Errorf("dos ckpt verify of job A resumed: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestJobSymlinkedRankRoot (adversary 2): job M's rank-00001 is a link to
// job B's rank-00001: --resume --ckpt-keep 1 on M is refused and B is
// never written; verify, ls, recover and reshard refuse it too.
func TestJobSymlinkedRankRoot(t *testing.T) {
	a := trainJobWith(t, "4")
	b := trainJobWith(t, "4", "--seed", "7")
	m := filepath.Join(t.TempDir(), "m")
	copyTree(t, a, m)
	os.RemoveAll(checkpoint.RankRoot(m, 1))
	if err := os.Symlink(checkpoint.RankRoot(b, 1), checkpoint.RankRoot(m, 1)); err != nil {
		t.Fatal(err)
	}
	hb, hm := treeHash(t, b), treeHash(t, m)
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(m, "8", "--ckpt-keep", "1")...); rc != 1 || !strings.Contains(stderr, "symbolic link") {
		t.Errorf("dos train --resume through a linked rank root: rc %d\n%s%s", rc, stdout, stderr)
	}
	for _, args := range [][]string{{"verify", m}, {"recover", m}, {"ls", m}, {"reshard", "--gpus", "1", m, filepath.Join(t.TempDir(), "re")}} {
		if rc, stdout, stderr := invoke(t, "ckpt", args...); rc != 1 || !strings.Contains(stderr, "symbolic link") {
			t.Errorf("dos ckpt %v: rc %d, want 1 naming the link\n%s%s", args, rc, stdout, stderr)
		}
	}
	if treeHash(t, b) != hb {
		t.Error("job B was written through M's linked rank root")
	}
	if treeHash(t, m) != hm {
		t.Error("job M was changed by a refusal")
	}
}

// TestResumeJobRankStepMissing (adversary 3): rank 1's directory of the
// job's committed step 8 is moved away: --resume refuses, changing
// nothing and naming what is missing; put back, the job resumes from 8.
// dos ckpt recover instead moves the job to step 6, setting rank 0's
// piece of step 8 aside (kept), not deleting it.
func TestResumeJobRankStepMissing(t *testing.T) {
	dir := trainJobWith(t, "8")
	step8 := checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 8)
	away := filepath.Join(t.TempDir(), "away")
	if err := os.Rename(step8, away); err != nil {
		t.Fatal(err)
	}
	before := treeHash(t, dir)
	rc, stdout, stderr := invoke(t, "train", resumeArgs(dir, "4")...)
	if rc != 1 || !strings.Contains(stderr, step8) || !strings.Contains(stderr, "Nothing was changed") || !strings.Contains(stderr, "dos ckpt recover "+dir) {
		t.Errorf("dos train --resume with rank 1's step 8 missing: rc %d\n%s%s", rc, stdout, stderr)
	}
	if strings.Contains(stdout, "at iteration") || strings.Contains(stdout, "resume: recovered") {
		t.Errorf("dos train --resume said it resumed or recovered, which it did not:\n%s", stdout)
	}
	if treeHash(t, dir) != before {
		t.Fatal("the refused resume changed the job root")
	}
	if err := os.Rename(away, step8); err != nil {
		t.Fatal(err)
	}
	if rc, _, stderr := invoke(t, "ckpt", "verify", dir); rc != 0 {
		t.Fatalf("verify with step 8 put back: rc %d\n%s", rc, stderr)
	}
	// recover: the job moves back to 6; rank 0's step 8 is set aside.
	if err := os.Rename(step8, away); err != nil {
		t.Fatal(err)
	}
	rc, stdout, stderr = invoke(t, "ckpt", "recover", dir)
	if rc != 0 || !strings.Contains(stdout, "now at step 6") || !strings.Contains(stdout, "set aside") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if m, _ := filepath.Glob(filepath.Join(checkpoint.RankRoot(dir, 0), "damaged-unmatched-step-000000008-*")); len(m) != 1 {
		t.Errorf("rank 0's step 8 after recover: set aside as %v, want one damaged-unmatched-step-000000008-*; rank 0 holds %v", m, entries(t, checkpoint.RankRoot(dir, 0)))
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", dir); rc != 0 || !strings.Contains(stdout, "step 6 verifies") {
		t.Errorf("verify after recover: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestJobLatestNotAFile (adversary 4): a job whose latest is a directory:
// recover and --resume refuse it, saying to move it away, not with a raw
// rename error; once moved away, recover repairs the job.
func TestJobLatestNotAFile(t *testing.T) {
	dir := trainJobWith(t, "4")
	latest := filepath.Join(dir, checkpoint.LatestFile)
	os.Remove(latest)
	if err := os.Mkdir(latest, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, sub := range []string{"ckpt", "train"} {
		args := []string{"recover", dir}
		if sub == "train" {
			args = resumeArgs(dir, "6")
		}
		rc, stdout, stderr := invoke(t, sub, args...)
		if rc != 1 || !strings.Contains(stderr, "is a directory, not a file: move it away") || strings.Contains(stderr, "file exists") {
			t.Errorf("dos %s %v with latest a directory: rc %d\n%s%s", sub, args, rc, stdout, stderr)
		}
	}
	if err := os.Remove(latest); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 0 || !strings.Contains(stdout, "now at step 4") {
		t.Errorf("dos ckpt recover with latest moved away: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestJobLatestNamesUnheldStep (adversary 5): the job's latest flipped to
// a step no rank holds (4 -> 3): recover keeps step 4, which verifies in
// every rank, and points the job at it; --resume alike.
func TestJobLatestNamesUnheldStep(t *testing.T) {
	for _, sub := range []string{"ckpt", "train"} {
		dir := trainJobWith(t, "4")
		if err := os.WriteFile(filepath.Join(dir, checkpoint.LatestFile), []byte("step-000000003\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		args := []string{"recover", dir}
		if sub == "train" {
			args = resumeArgs(dir, "4")
		}
		if rc, stdout, stderr := invoke(t, sub, args...); rc != 0 || !strings.Contains(stdout, "no rank root holds") {
			t.Errorf("dos %s %v: rc %d\n%s%s", sub, args, rc, stdout, stderr)
		}
		for r := range 2 {
			if _, err := os.Stat(checkpoint.StepDir(checkpoint.RankRoot(dir, r), 4)); err != nil {
				t.Errorf("dos %s: rank %d's step 4: %v", sub, r, err)
			}
		}
		if step, _, err := checkpoint.JobLatest(checkpoint.OS, dir); step != 4 || err != nil {
			t.Errorf("dos %s: the job's latest: %d, %v; want 4", sub, step, err)
		}
	}
}

// limitedWriter fails the test's command by panicking once more than max
// bytes are written: output without end is a defect, found in bounded time.
type limitedWriter struct {
	n, max int
	b      strings.Builder
}

func (w *limitedWriter) Write(p []byte) (int, error) {
	w.n += len(p)
	if w.n > w.max {
		panic("more output than a listing of a few rank roots")
	}
	return w.b.Write(p)
}

// TestCkptLsSelfLinkedRankRoots (adversary 6): rank roots that are links
// to the job root itself: dos ckpt ls names each once, as damage, and
// does not recurse.
func TestCkptLsSelfLinkedRankRoots(t *testing.T) {
	dir := trainJobWith(t, "4")
	for r := range 2 {
		os.RemoveAll(checkpoint.RankRoot(dir, r))
		if err := os.Symlink(".", checkpoint.RankRoot(dir, r)); err != nil {
			t.Fatal(err)
		}
	}
	stdout, stderr := &limitedWriter{max: 1 << 16}, &limitedWriter{max: 1 << 16}
	rc := func() (rc int) {
		defer func() {
			if p := recover(); p != nil {
				t.Errorf("dos ckpt ls: %v (%d bytes so far)", p, stdout.n+stderr.n)
				rc = -1
			}
		}()
		return runCkpt([]string{"ls", dir}, stdout, stderr)
	}()
	if rc != 1 || !strings.Contains(stderr.b.String(), "symbolic link") || strings.Count(stdout.b.String(), "job "+dir) != 1 {
		t.Errorf("dos ckpt ls of self-linked rank roots: rc %d\n%.2000s%.2000s", rc, stdout.b.String(), stderr.b.String())
	}
}

// TestReshardLeftoverRemoved (adversary 7): a killed reshard's temporary
// directory in its destination is listed with what removes it, and the
// next dos train there removes it, as said. A --resume there (the job
// commands' adversary, F2) and dos ckpt recover are refused, leaving it,
// and say to run the reshard again: before, --resume removed it and
// trained from iteration 0 with exit status 0.
func TestReshardLeftoverRemoved(t *testing.T) {
	dst := filepath.Join(t.TempDir(), "dst")
	left := filepath.Join(dst, ".tmp-reshard-12345")
	if err := os.MkdirAll(filepath.Join(left, "rank-00000"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(left, "rank-00000", "x"), []byte("partial"), 0o644); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "ls", dst); rc != 0 || !strings.Contains(stdout, left+"  (leftover of a dos ckpt reshard killed before it committed: run that reshard again (it removes it), or a dos train here without --resume removes it and starts afresh)") {
		t.Errorf("dos ckpt ls: rc %d\n%s%s", rc, stdout, stderr)
	}
	args := append([]string{"--gpus", "2", "--steps", "2", "--ckpt-dir", dst, "--ckpt-every", "2"}, tinyShape...)
	rerun := "the leftover of a dos ckpt reshard into it that was killed before it committed (never a checkpoint): run that reshard again"
	if rc, stdout, stderr := invoke(t, "train", append(args, "--resume")...); rc != 1 || !strings.Contains(stderr, left+", "+rerun) || strings.Contains(stdout, "iteration 0") {
		t.Errorf("dos train --resume into dst: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dst); rc != 1 || !strings.Contains(stderr, left+", "+rerun) {
		t.Errorf("dos ckpt recover dst: rc %d\n%s%s", rc, stdout, stderr)
	}
	if _, err := os.Stat(filepath.Join(left, "rank-00000", "x")); err != nil {
		t.Errorf("a refused --resume or recover touched %s: %v", left, err)
	}
	if rc, stdout, stderr := invoke(t, "train", args...); rc != 0 || !strings.Contains(stdout, "removed "+left) {
		t.Errorf("dos train into dst: rc %d\n%s%s", rc, stdout, stderr)
	}
	if _, err := os.Stat(left); err == nil {
		t.Errorf("%s is still there after dos train saved into %s", left, dst)
	}
}

// editRank rewrites rank's checkpoint of step 4 in the job root dir with
// edit applied to its objects (checksums valid, as a writer writes them).
func editRank(t *testing.T, dir string, rank int, edit func(objects map[string]json.RawMessage)) {
	t.Helper()
	rr := checkpoint.RankRoot(dir, rank)
	out := rewrite(t, rr, nil, edit)
	sd := checkpoint.StepDir(rr, 4)
	if err := os.RemoveAll(sd); err != nil {
		t.Fatal(err)
	}
	copyTree(t, checkpoint.StepDir(out, 4), sd)
}

// editJSON applies f to the object name decoded as a map and encodes it
// back.
func editJSON(t *testing.T, objects map[string]json.RawMessage, name string, f func(o map[string]any)) {
	t.Helper()
	var o map[string]any
	if err := json.Unmarshal(objects[name], &o); err != nil {
		t.Fatal(err)
	}
	f(o)
	b, err := json.Marshal(o)
	if err != nil {
		t.Fatal(err)
	}
	objects[name] = b
}

// TestJobRanksDisagreeOnOptimizer (adversary 8): rank 1's checkpoint of
// the job's step holds another optimizer step, betas or weight decay than
// rank 0's: verify and --resume refuse it, naming the field.
func TestJobRanksDisagreeOnOptimizer(t *testing.T) {
	base := trainJobWith(t, "4")
	for _, tc := range []struct {
		what, field string
		edit        func(o map[string]any)
	}{
		{"step 3", `object "optimizer": step`, func(o map[string]any) { o["step"] = 3 }},
		{"betas", `object "optimizer": hyper`, func(o map[string]any) {
			o["hyper"].(map[string]any)["betas"] = []float64{0.5, 0.95}
			o["options"].(map[string]any)["hyper"].(map[string]any)["betas"] = []float64{0.5, 0.95}
		}},
		{"weight decay", `object "optimizer": hyper`, func(o map[string]any) {
			o["hyper"].(map[string]any)["weight_decay"] = 0.0
			o["options"].(map[string]any)["hyper"].(map[string]any)["weight_decay"] = 0.0
		}},
	} {
		dir := filepath.Join(t.TempDir(), "j")
		copyTree(t, base, dir)
		editRank(t, dir, 1, func(objects map[string]json.RawMessage) { editJSON(t, objects, "optimizer", tc.edit) })
		want := "disagree on " + tc.field
		if rc, stdout, stderr := invoke(t, "ckpt", "verify", dir); rc != 1 || !strings.Contains(stderr, want) {
			t.Errorf("%s: dos ckpt verify: rc %d, want 1 saying %q\n%s%s", tc.what, rc, want, stdout, stderr)
		}
		if rc, stdout, stderr := invoke(t, "train", resumeArgs(dir, "8")...); rc != 1 || !strings.Contains(stderr, want) {
			t.Errorf("%s: dos train --resume: rc %d, want 1 saying %q\n%s%s", tc.what, rc, want, stdout, stderr)
		}
	}
}

// TestResumeCheckpointConfigInvalid (adversary 9): a checkpoint whose
// trainer config holds an invalid shape or batch is named as damaged
// (manifest and field, exit 1) by a --resume given no shape flag, never
// blamed on flags not given.
func TestResumeCheckpointConfigInvalid(t *testing.T) {
	root := trainRoot(t, "2", "2")
	for _, tc := range []struct {
		field string
		edit  func(cfg map[string]any)
	}{
		{"config.model.n_layer 100000", func(c map[string]any) { c["model"].(map[string]any)["n_layer"] = 100000 }},
		{"config.model.n_head 0", func(c map[string]any) { c["model"].(map[string]any)["n_head"] = 0 }},
		{"config.batch 0", func(c map[string]any) { c["batch"] = 0 }},
	} {
		dir := rewrite(t, root, nil, func(objects map[string]json.RawMessage) {
			editJSON(t, objects, "trainer", func(o map[string]any) { tc.edit(o["config"].(map[string]any)) })
		})
		rc, stdout, stderr := invoke(t, "train", resumeArgs(dir, "4")...)
		if rc != 1 || !strings.Contains(stderr, tc.field) || !strings.Contains(stderr, checkpoint.ManifestFile) ||
			strings.Contains(stderr, "omit these flags") || strings.Contains(stderr, "--batch 0") {
			t.Errorf("%s: dos train --resume: rc %d, want 1 naming the checkpoint's %s\n%s%s", tc.field, rc, tc.field, stdout, stderr)
		}
	}
}

// TestJobFileMissing (adversary 10): a job root that lost only job.json
// is a job's root still: ls and verify say so and send to recover, which
// rewrites job.json from the rank roots' records and keeps the job's
// latest; the job then resumes.
func TestJobFileMissing(t *testing.T) {
	dir := trainJobWith(t, "4")
	if err := os.Remove(filepath.Join(dir, checkpoint.JobFile)); err != nil {
		t.Fatal(err)
	}
	want := checkpoint.JobFile + " is missing"
	for _, sub := range []string{"ls", "verify"} {
		if rc, stdout, stderr := invoke(t, "ckpt", sub, dir); rc != 1 || !strings.Contains(stderr, want) || !strings.Contains(stderr, "dos ckpt recover "+dir) {
			t.Errorf("dos ckpt %s: rc %d\n%s%s", sub, rc, stdout, stderr)
		}
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 0 || !strings.Contains(stdout, "was missing") || !strings.Contains(stdout, "step 4") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if step, world, err := checkpoint.JobLatest(checkpoint.OS, dir); step != 4 || world != 2 || err != nil {
		t.Errorf("the job after recover: step %d, %d ranks, %v; want 4 of 2", step, world, err)
	}
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(dir, "6")...); rc != 0 || !strings.Contains(stdout, "done: 6 iterations (2 this run)") {
		t.Errorf("dos train --resume after recover: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestSuggestedCommandsQuoted (adversary 11): a path with a space is
// shell-quoted in the command that reshard suggests.
func TestSuggestedCommandsQuoted(t *testing.T) {
	src := filepath.Join(t.TempDir(), "sp ace")
	copyTree(t, trainJobWith(t, "4"), src)
	dst := src + ".rs"
	rc, stdout, stderr := invoke(t, "ckpt", "reshard", "--gpus", "1", src, dst)
	if want := "dos train --resume --ckpt-dir '" + dst + "' --gpus 1"; rc != 0 || !strings.Contains(stdout, want) {
		t.Errorf("dos ckpt reshard: rc %d, want %q\n%s%s", rc, want, stdout, stderr)
	}
}

// TestVerifyChecksTrainerState: a checkpoint whose trainer state or
// configuration --resume refuses as damaged (CRCs recomputed) fails dos
// ckpt verify too, naming the manifest and the field, and dos ckpt recover
// sets it aside, so that the run resumes from the older checkpoint that
// verifies: verify and --resume agree, and recover leads somewhere.
func TestVerifyChecksTrainerState(t *testing.T) {
	root := trainRoot(t, "4", "2")
	for _, tc := range []struct {
		field string
		edit  func(o map[string]any)
	}{
		{"config.model.n_head 0", func(o map[string]any) { o["config"].(map[string]any)["model"].(map[string]any)["n_head"] = 0 }},
		{"iteration 9223372036854775807", func(o map[string]any) { o["iteration"] = int64(1<<63 - 1) }},
		{`rng "\x00\x00\x00": want math/rand/v2's PCG state`, func(o map[string]any) { o["rng"] = "AAAA" }},
		{`loader_pos`, func(o map[string]any) { o["loader_pos"] = 1e19 }},
	} {
		dir := rewrite(t, root, nil, func(objects map[string]json.RawMessage) {
			editJSON(t, objects, "trainer", tc.edit)
		})
		copyTree(t, checkpoint.StepDir(root, 2), checkpoint.StepDir(dir, 2))
		if rc, stdout, stderr := invoke(t, "ckpt", "verify", dir); rc != 1 || !strings.Contains(stderr, tc.field) || !strings.Contains(stderr, checkpoint.ManifestFile) {
			t.Errorf("%s: dos ckpt verify: rc %d, want 1 naming the field\n%s%s", tc.field, rc, stdout, stderr)
		}
		if rc, stdout, stderr := invoke(t, "train", resumeArgs(dir, "4")...); rc != 1 || !strings.Contains(stderr, tc.field) || !strings.Contains(stderr, "dos ckpt recover "+dir) {
			t.Errorf("%s: dos train --resume: rc %d, want 1 naming the field and recover\n%s%s", tc.field, rc, stdout, stderr)
		}
		if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 0 || !strings.Contains(stdout, "step-000000002") {
			t.Errorf("%s: dos ckpt recover: rc %d, want 0 moving latest to step 2\n%s%s", tc.field, rc, stdout, stderr)
		}
		if rc, stdout, stderr := invoke(t, "train", resumeArgs(dir, "4")...); rc != 0 || !strings.Contains(stdout, "done: 4 iterations") {
			t.Errorf("%s: dos train --resume after recover: rc %d\n%s%s", tc.field, rc, stdout, stderr)
		}
	}
}

// TestCheckpointCadenceSaid: every run's header says where, how often and
// how its checkpoints are written, a resumed run's too: --ckpt-every and
// --ckpt-keep are the run's own (a checkpoint does not carry them), and a
// resume without them went back to the defaults without a word. And the
// header's lr is the run's peak rate (--lr), a resumed run's too (it gave
// the schedule's rate at the checkpoint's iteration as the run's lr).
func TestCheckpointCadenceSaid(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "one")
	args := append([]string{"--steps", "4", "--ckpt-dir", dir, "--ckpt-every", "2", "--ckpt-keep", "3"}, tinyShape...)
	rc, stdout, stderr := invoke(t, "train", args...)
	if want := "checkpoints into " + dir + ": every 2 iterations and at the end, lazily, keeping the newest 3"; rc != 0 || !strings.Contains(stdout, want) {
		t.Errorf("dos train: rc %d, want %q\n%s%s", rc, want, stdout, stderr)
	}
	rc, stdout, stderr = invoke(t, "train", resumeArgs(dir, "6", "--ckpt-sync")...)
	if want := "checkpoints into " + dir + ": every 50 iterations and at the end, synchronously, keeping all (this run's"; rc != 0 || !strings.Contains(stdout, want) {
		t.Errorf("dos train --resume: rc %d, want %q\n%s%s", rc, want, stdout, stderr)
	}
	if want := "mode=adamw lr=0.003 "; !strings.Contains(stdout, want) {
		t.Errorf("dos train --resume: the header's lr is not the peak, want %q\n%s", want, stdout)
	}
}

// TestReshardKilledDuringMoves (the job commands' adversary, F7): a
// reshard killed after it moved rank-00000 into DST, job.json, rank-00001
// and latest still in its temporary directory. ls and verify told the
// user to put job.json back (it is one directory down), and recover,
// which finished the moves, said "nothing to do". Now ls, verify,
// inspect and a reshard from it name the interrupted moves and recover,
// changing nothing, and
// recover says it finished them; the job then lists and verifies.
func TestReshardKilledDuringMoves(t *testing.T) {
	job := trainJobWith(t, "4")
	done := filepath.Join(t.TempDir(), "done")
	if rc, stdout, stderr := invoke(t, "ckpt", "reshard", job, done, "--gpus", "2"); rc != 0 {
		t.Fatalf("dos ckpt reshard: rc %d\n%s%s", rc, stdout, stderr)
	}
	dst := filepath.Join(t.TempDir(), "dst")
	tmp := filepath.Join(dst, ".tmp-reshard-123")
	copyTree(t, done, tmp)
	if err := os.Rename(filepath.Join(tmp, checkpoint.LockFile), filepath.Join(dst, checkpoint.LockFile)); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(checkpoint.RankRoot(tmp, 0), checkpoint.RankRoot(dst, 0)); err != nil {
		t.Fatal(err)
	}
	before := entries(t, dst)
	for _, sub := range []string{"ls", "verify", "inspect"} {
		rc, stdout, stderr := invoke(t, "ckpt", sub, dst)
		if rc != 1 || !strings.Contains(stderr, "a dos ckpt reshard was moving into it when it was killed; the rest is in "+tmp+": dos ckpt recover "+dst) || strings.Contains(stderr, "put job.json back") {
			t.Errorf("dos ckpt %s: rc %d\n%s%s", sub, rc, stdout, stderr)
		}
	}
	if got := entries(t, dst); !slices.Equal(got, before) {
		t.Errorf("ls, verify, inspect changed %s: %v, was %v", dst, got, before)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "reshard", job, dst, "--gpus", "2"); rc != 1 || !strings.Contains(stderr, "dos ckpt recover "+dst+" finishes its moves") {
		t.Errorf("dos ckpt reshard into dst: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "reshard", dst, filepath.Join(t.TempDir(), "out"), "--gpus", "1"); rc != 1 || !strings.Contains(stderr, "the rest is in "+tmp+": dos ckpt recover "+dst+" finishes the moves, then reshard it") {
		t.Errorf("dos ckpt reshard from dst: rc %d\n%s%s", rc, stdout, stderr)
	}
	rc, stdout, stderr := invoke(t, "ckpt", "recover", dst)
	if rc != 0 || !strings.Contains(stdout, "finished the moves of a dos ckpt reshard") || !strings.Contains(stdout, "nothing else to do") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", dst); rc != 0 {
		t.Errorf("dos ckpt verify after recover: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestJobFileWorldRaised (the job commands' adversary, F1): job.json
// edited from 2 ranks to 3. ls listed a rank-00002 that is not there and,
// after the true diagnosis, a false one ("rank 2 lacks the job's latest
// step ...; put it back, or recover moves the job to an older step"),
// and inspect exited 0 describing "3 ranks" beside "rank 0 of a job of 2
// ranks". Now both give the one diagnosis, with exit status 1.
func TestJobFileWorldRaised(t *testing.T) {
	dir := trainJobWith(t, "4")
	if err := os.WriteFile(filepath.Join(dir, checkpoint.JobFile), []byte(`{"format":"dos-job","world_size":3}`), 0o644); err != nil {
		t.Fatal(err)
	}
	diag := "job.json says 3 ranks, but its 2 rank roots"
	rc, stdout, stderr := invoke(t, "ckpt", "ls", dir)
	if rc != 1 || !strings.Contains(stderr, diag) || strings.Contains(stderr, "lacks the job's latest") || strings.Contains(stdout, "rank-00002") {
		t.Errorf("dos ckpt ls: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "inspect", dir); rc != 1 || !strings.Contains(stderr, diag) {
		t.Errorf("dos ckpt inspect: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestRankRootOutsideJob (the job commands' adversary, F3): rank 1's root
// copied out of its job. --resume there told the user to re-shard "a
// single-rank run" onto 2 ranks, and reshard, refusing that, named the
// directory above it "the job's root", which holds no job. Both now say
// what it is (rank 1's pieces of a job of 2 ranks) and to put it back.
func TestRankRootOutsideJob(t *testing.T) {
	job := trainJobWith(t, "4")
	lone := filepath.Join(t.TempDir(), "lone")
	copyTree(t, checkpoint.RankRoot(job, 1), lone)
	what := lone + " holds rank 1's pieces of a job of 2 ranks (its checkpoints record it), outside its job's root: no run of its own; put it back as rank-00001 in its job's root"
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(lone, "6")...); rc != 1 || !strings.Contains(stderr, what) || strings.Contains(stderr, "single-rank run") {
		t.Errorf("dos train --resume: rc %d\n%s%s", rc, stdout, stderr)
	}
	for _, src := range []string{lone, checkpoint.StepDir(lone, 4)} {
		if rc, stdout, stderr := invoke(t, "ckpt", "reshard", src, filepath.Join(t.TempDir(), "out"), "--gpus", "1"); rc != 1 || !strings.Contains(stderr, what) || strings.Contains(stderr, "reshard the job's root") {
			t.Errorf("dos ckpt reshard %s: rc %d\n%s%s", src, rc, stdout, stderr)
		}
	}
	// In its job, a rank root is still sent to the job's root.
	if rc, stdout, stderr := invoke(t, "ckpt", "reshard", checkpoint.RankRoot(job, 0), filepath.Join(t.TempDir(), "out"), "--gpus", "1"); rc != 1 || !strings.Contains(stderr, "reshard the job's root, "+job) {
		t.Errorf("dos ckpt reshard of a rank root in its job: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestResumeRankStepDir (F3's related case): --ckpt-dir naming a step
// directory in a job's rank root was sent to "its parent", the rank
// root, which dos train refuses in turn; now to the job's root.
func TestResumeRankStepDir(t *testing.T) {
	job := trainJobWith(t, "4")
	sd := checkpoint.StepDir(checkpoint.RankRoot(job, 0), 4)
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(sd, "6", "--gpus", "2")...); rc != 1 || !strings.Contains(stderr, "pass the job's root "+job) {
		t.Errorf("dos train --resume --ckpt-dir %s: rc %d\n%s%s", sd, rc, stdout, stderr)
	}
}

// TestCkptControlCharacters (the job commands' adversary, F6): a root
// whose name holds a newline made dos ckpt ls print a forged line
// ("* forged/step-000000099: 2 ranks, ..."); ls, verify and inspect now
// refuse such a path, quoted, before reading it.
func TestCkptControlCharacters(t *testing.T) {
	job := trainJobWith(t, "2")
	evil := filepath.Join(t.TempDir(), "evil\n* forged-step-000000099")
	if err := os.Rename(job, evil); err != nil {
		t.Fatal(err)
	}
	for _, sub := range []string{"ls", "verify", "inspect"} {
		rc, stdout, stderr := invoke(t, "ckpt", sub, evil)
		if rc != 2 || stdout != "" || !strings.Contains(stderr, `\n* forged-step-000000099" holds control characters`) {
			t.Errorf("dos ckpt %s: rc %d\n%s%s", sub, rc, stdout, stderr)
		}
	}
	link := filepath.Join(t.TempDir(), "plain")
	if err := os.Symlink(evil, link); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", link); rc != 0 {
		t.Errorf("dos ckpt verify through a link: rc %d\n%s%s", rc, stdout, stderr)
	}
}
