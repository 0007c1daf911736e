package main

import (
	"bytes"
	"encoding/json"
	"hash/crc32"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/deepstates/dos/checkpoint"
)

// The defects of issue 29 in the checkpoint roots and dos ckpt's job
// commands, each as a user meets them with the CLI.

var tinyShape = []string{"--layers", "1", "--embd", "16", "--heads", "2", "--ctx", "8", "--batch", "4", "--sample", "0", "--eval-batches", "1", "--max-memory", "1"}

// trainRoot trains a small model on one rank for steps steps, saving every
// every, into a new root it returns.
func trainRoot(t *testing.T, steps, every string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "one")
	var stdout, stderr bytes.Buffer
	args := append([]string{"--steps", steps, "--ckpt-dir", dir, "--ckpt-every", every}, tinyShape...)
	if rc := runTrain(args, &stdout, &stderr); rc != 0 {
		t.Fatalf("dos train %v: rc %d\n%s%s", args, rc, stdout.String(), stderr.String())
	}
	return dir
}

// invoke runs dos's main entry for a subcommand, returning rc, stdout and
// stderr.
func invoke(t *testing.T, sub string, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	var rc int
	switch sub {
	case "train":
		rc = runTrain(args, &stdout, &stderr)
	case "ckpt":
		rc = runCkpt(args, &stdout, &stderr)
	default:
		t.Fatalf("run %s", sub)
	}
	return rc, stdout.String(), stderr.String()
}

func copyTree(t *testing.T, from, to string) {
	t.Helper()
	if err := os.CopyFS(to, os.DirFS(from)); err != nil {
		t.Fatal(err)
	}
}

func flipByte(t *testing.T, file string) {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-3] ^= 0xff
	if err := os.WriteFile(file, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// setAside returns dir's entries that dos ckpt recover set aside
// (damaged-*).
func setAside(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, "damaged-*"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func entries(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	return names
}

// TestRecoverJobWorldSizeBounded (issue 29, 3): a job.json whose
// world_size is 100000 makes dos ckpt recover create no rank root; the
// ranks' own records give the job's 2 ranks, and recover rewrites
// job.json from them; verify then passes. The bound is --gpus's.
func TestRecoverJobWorldSizeBounded(t *testing.T) {
	dir := trainJob(t)
	if err := os.WriteFile(filepath.Join(dir, checkpoint.JobFile), []byte(`{"format":"dos-job","world_size":100000}`), 0o644); err != nil {
		t.Fatal(err)
	}
	rc, _, stderr := invoke(t, "ckpt", "verify", dir)
	if rc != 1 || !strings.Contains(stderr, "world_size 100000: want 1..64") || !strings.Contains(stderr, "dos ckpt recover "+dir+" rewrites it for 2 ranks") {
		t.Errorf("dos ckpt verify of a job.json of 100000 ranks: rc %d\n%s", rc, stderr)
	}
	rc, stdout, stderr := invoke(t, "ckpt", "recover", dir)
	if rc != 0 || !strings.Contains(stdout, "rewritten for 2") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if got := entries(t, dir); len(got) != 5 { // .lock job.json latest rank-00000 rank-00001
		t.Errorf("the job's root after recover: %v", got)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", dir); rc != 0 || !strings.Contains(stdout, "verifies in all 2 ranks' roots") {
		t.Errorf("dos ckpt verify after recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	// No rank record to tell the world size (a job.json of 64 over two
	// rank roots whose records were removed is not what happens; a
	// world_size past the bound without ranks to say otherwise): refused
	// by name, nothing created.
	if rc, _, stderr := invoke(t, "train", "--gpus", "65", "--steps", "1"); rc != 2 || !strings.Contains(stderr, "want 0..64") {
		t.Errorf("dos train --gpus 65: rc %d\n%s", rc, stderr)
	}
}

// TestJobRankIdentity (issue 29, 4): a rank root that is a copy of, or a
// link to, another rank's is refused by verify, recover and --resume alike,
// nothing changed, with a remedy that is not the other command; a job.json
// edited to another world size is named by all of them, and recover
// rewrites it, after which --resume continues.
func TestJobRankIdentity(t *testing.T) {
	job := trainJob(t)
	for _, how := range []string{"copy", "link"} {
		dir := filepath.Join(t.TempDir(), how)
		copyTree(t, job, dir)
		rr1 := checkpoint.RankRoot(dir, 1)
		os.RemoveAll(rr1)
		if how == "copy" {
			copyTree(t, checkpoint.RankRoot(dir, 0), rr1)
		} else if err := os.Symlink("rank-00000", rr1); err != nil {
			t.Fatal(err)
		}
		want := "put rank 1's own"
		for _, args := range [][]string{{"verify", dir}, {"recover", dir}} {
			rc, stdout, stderr := invoke(t, "ckpt", args...)
			if rc != 1 || !strings.Contains(stderr, want) || !strings.Contains(stderr, "Nothing was changed") {
				t.Errorf("%s: dos ckpt %v: rc %d, want 1 saying %q\n%s%s", how, args, rc, want, stdout, stderr)
			}
		}
		rc, stdout, stderr := invoke(t, "train", append([]string{"--resume", "--ckpt-dir", dir, "--steps", "6"}, tinyShape[10:]...)...)
		if rc == 0 || !strings.Contains(stderr, want) || strings.Contains(stderr, "dos ckpt recover") {
			t.Errorf("%s: dos train --resume: rc %d, want a failure saying %q and not sending to recover\n%s%s", how, rc, want, stdout, stderr)
		}
		if got := entries(t, checkpoint.RankRoot(dir, 0)); len(got) != 4 { // .lock latest step-2 step-4
			t.Errorf("%s: rank 0's root after the refusals: %v", how, got)
		}
	}
	// job.json edited to 1 rank.
	dir := filepath.Join(t.TempDir(), "world")
	copyTree(t, job, dir)
	if err := os.WriteFile(filepath.Join(dir, checkpoint.JobFile), []byte(`{"format":"dos-job","world_size":1}`), 0o644); err != nil {
		t.Fatal(err)
	}
	want := "dos ckpt recover " + dir + " rewrites it for 2 ranks"
	if rc, _, stderr := invoke(t, "ckpt", "verify", dir); rc != 1 || !strings.Contains(stderr, want) {
		t.Errorf("dos ckpt verify of a job.json of 1 rank: rc %d\n%s", rc, stderr)
	}
	resume := append([]string{"--resume", "--ckpt-dir", dir, "--steps", "6"}, tinyShape[10:]...)
	if rc, _, stderr := invoke(t, "train", resume...); rc == 0 || !strings.Contains(stderr, want) {
		t.Errorf("dos train --resume of a job.json of 1 rank: rc %d\n%s", rc, stderr)
	}
	if rc, _, stderr := invoke(t, "ckpt", "reshard", "--gpus", "1", dir, filepath.Join(t.TempDir(), "re")); rc != 1 || !strings.Contains(stderr, want) {
		t.Errorf("dos ckpt reshard of a job.json of 1 rank: rc %d\n%s", rc, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 0 || !strings.Contains(stdout, "said 1 rank,") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "train", resume...); rc != 0 || !strings.Contains(stdout, "done: 6 iterations") {
		t.Errorf("dos train --resume after recover: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestReshardDestinations (issue 29, 5 and 6): reshard into a link to an
// empty directory writes into its target (the link kept); into ".", the
// working directory, in place; into a directory that holds something,
// refused before any work, naming what it holds.
func TestReshardDestinations(t *testing.T) {
	job := trainJob(t)
	base := t.TempDir()
	target := filepath.Join(base, "target")
	link := filepath.Join(base, "link")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("target", link); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "reshard", "--gpus", "1", job, link); rc != 0 {
		t.Fatalf("dos ckpt reshard into a link: rc %d\n%s%s", rc, stdout, stderr)
	}
	if st, err := os.Lstat(link); err != nil || st.Mode()&os.ModeSymlink == 0 {
		t.Errorf("the link after reshard: %v, %v", st, err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", target); rc != 0 || !strings.Contains(stdout, "OK "+target+"/step-000000004") {
		t.Errorf("dos ckpt verify of the link's target: rc %d\n%s%s", rc, stdout, stderr)
	}

	dot := filepath.Join(base, "dot")
	if err := os.Mkdir(dot, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Chdir(dot)
	if rc, stdout, stderr := invoke(t, "ckpt", "reshard", "--gpus", "2", target, "."); rc != 0 {
		t.Fatalf("dos ckpt reshard into .: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", "."); rc != 0 || !strings.Contains(stdout, "OK job .: step 4 verifies in all 2 ranks' roots") {
		t.Errorf("dos ckpt verify .: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, _, stderr := invoke(t, "ckpt", "reshard", "--gpus", "2", target, "."); rc != 1 || !strings.Contains(stderr, "is not empty (job.json, latest, rank-00000, rank-00001)") {
		t.Errorf("dos ckpt reshard into a full directory: rc %d\n%s", rc, stderr)
	}

	// A reshard killed before it moved anything in leaves only its
	// temporary directory (and the lock file): a rerun removes it and
	// writes the checkpoint.
	stale := filepath.Join(base, "stale")
	if err := os.MkdirAll(filepath.Join(stale, ".tmp-reshard-123", "rank-00000"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(stale, checkpoint.LockFile), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "reshard", "--gpus", "2", target, stale); rc != 0 {
		t.Fatalf("dos ckpt reshard over a killed reshard's temporary directory: rc %d\n%s%s", rc, stdout, stderr)
	}
	if got := entries(t, stale); !slices.Equal(got, []string{checkpoint.LockFile, "job.json", "latest", "rank-00000", "rank-00001"}) {
		t.Errorf("the destination after the rerun holds %v", got)
	}
}

// TestCkptLsJobOnce (issue 29, 7): a rank's step after the job's (its
// save, not committed for the job) is listed once, as such, and the job's
// step is the one marked.
func TestCkptLsJobOnce(t *testing.T) {
	dir := trainJob(t)
	if err := os.WriteFile(filepath.Join(dir, checkpoint.LatestFile), []byte("step-000000002\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	rc, stdout, stderr := invoke(t, "ckpt", "ls", dir)
	s4 := checkpoint.StepDir(checkpoint.RankRoot(dir, 0), 4)
	if rc != 0 || strings.Count(stdout, s4) != 1 || !strings.Contains(stdout, s4+"  (this rank's save, not committed for the job") ||
		!strings.Contains(stdout, "* "+checkpoint.StepDir(checkpoint.RankRoot(dir, 0), 2)) {
		t.Errorf("dos ckpt ls with the job behind its ranks: rc %d, want %s once, as not committed for the job\n%s%s", rc, s4, stdout, stderr)
	}
}

// TestResumeBoundsTrainerState (issue 29, 7): a manifest whose trainer
// iteration was set to 2^63-1, its CRC32C recomputed, is refused at
// --resume, naming the manifest and the field.
func TestResumeBoundsTrainerState(t *testing.T) {
	dir := trainRoot(t, "4", "4")
	mpath := filepath.Join(checkpoint.StepDir(dir, 4), checkpoint.ManifestFile)
	b, err := os.ReadFile(mpath)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&m); err != nil {
		t.Fatal(err)
	}
	objs := m["objects"].(map[string]any)
	objs["trainer"].(map[string]any)["iteration"] = json.Number("9223372036854775807")
	canon, _ := json.Marshal(objs["trainer"])
	m["objects_crc32c"].(map[string]any)["trainer"] = crc32.Checksum(canon, crc32.MakeTable(crc32.Castagnoli))
	if b, err = json.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(mpath, b, 0o644); err != nil {
		t.Fatal(err)
	}
	// Its CRC32C matches (no CRC error), and verify checks the trainer
	// state as --resume does.
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", dir); rc != 1 || strings.Contains(stderr, "CRC") || !strings.Contains(stderr, "iteration 9223372036854775807: want 4") {
		t.Fatalf("dos ckpt verify of the edited manifest: rc %d\n%s%s", rc, stdout, stderr)
	}
	rc, stdout, stderr := invoke(t, "train", append([]string{"--resume", "--ckpt-dir", dir, "--steps", "6"}, tinyShape[10:]...)...)
	if rc == 0 || strings.Contains(stdout, "done:") || !strings.Contains(stderr, mpath) || !strings.Contains(stderr, "iteration 9223372036854775807: want 4") {
		t.Errorf("dos train --resume from an iteration of 2^63-1: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestRecoverNothingLeft (issue 29, 8): a root whose only checkpoint has a
// byte flipped: dos ckpt recover sets it aside whole and removes latest,
// saying that no checkpoint is left and that a new run may start there
// (exit 1); ls then lists it set aside (exit 0), --resume says there is
// nothing to resume and how to start afresh, and a run without --resume
// trains there. The same for a job's root whose rank 1 has no checkpoint
// that verifies: the job's files are set aside, whole.
func TestRecoverNothingLeft(t *testing.T) {
	for _, kind := range []string{"root", "job"} {
		var dir, bad string
		var gpus []string
		if kind == "root" {
			dir = trainRoot(t, "4", "4")
			bad = checkpoint.StepDir(dir, 4)
		} else {
			dir = trainJob(t)
			gpus = []string{"--gpus", "2"}
			flipByte(t, filepath.Join(checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 2), "rank-00000.safetensors"))
			bad = checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 4)
		}
		flipByte(t, filepath.Join(bad, "rank-00000.safetensors"))
		rc, stdout, stderr := invoke(t, "ckpt", "recover", dir)
		if rc != 1 || !strings.Contains(stderr, "no checkpoint left") || !strings.Contains(stderr, dir+" holds no checkpoint now: a new run may start there") || strings.Contains(stderr, "left as it is") {
			t.Errorf("%s: dos ckpt recover: rc %d\n%s%s", kind, rc, stdout, stderr)
		}
		aside := setAside(t, dir)
		if len(aside) != 1 {
			t.Fatalf("%s: set aside: %v", kind, aside)
		}
		whole := aside[0]
		if kind == "job" {
			whole = filepath.Join(aside[0], "rank-00001")
			if len(setAside(t, whole)) != 2 {
				t.Errorf("job: rank 1's set-aside steps: %v", entries(t, whole))
			}
			whole = setAside(t, whole)[0]
		}
		if _, err := os.Stat(filepath.Join(whole, checkpoint.ManifestFile)); err != nil {
			t.Errorf("%s: the set-aside checkpoint is not whole: %v", kind, err)
		}
		if rc, stdout, stderr := invoke(t, "ckpt", "ls", dir); rc != 0 || !strings.Contains(stdout, "holds no checkpoint to resume") {
			t.Errorf("%s: dos ckpt ls after recover: rc %d\n%s%s", kind, rc, stdout, stderr)
		}
		resume := append(append([]string{"--resume", "--ckpt-dir", dir, "--steps", "6"}, gpus...), tinyShape...)
		if rc, stdout, stderr := invoke(t, "train", resume...); rc == 0 || !strings.Contains(stderr, "holds no checkpoint to resume") || !strings.Contains(stderr, "run without --resume") {
			t.Errorf("%s: dos train --resume after recover: rc %d\n%s%s", kind, rc, stdout, stderr)
		}
		fresh := append(append([]string{"--ckpt-dir", dir, "--steps", "2", "--ckpt-every", "2"}, gpus...), tinyShape...)
		if rc, stdout, stderr := invoke(t, "train", fresh...); rc != 0 || !strings.Contains(stdout, "done: 2 iterations") {
			t.Errorf("%s: dos train (fresh) after recover: rc %d\n%s%s", kind, rc, stdout, stderr)
		}
		if rc, stdout, stderr := invoke(t, "ckpt", "verify", dir); rc != 0 {
			t.Errorf("%s: dos ckpt verify of the new run: rc %d\n%s%s", kind, rc, stdout, stderr)
		}
	}
}

// TestRecoverJobRankRootMissing: a job's rank root that is missing (a disk
// not mounted, a directory moved away) is refused by dos ckpt recover with
// nothing changed, not taken as damage and set aside; once it is back, the
// job resumes.
func TestRecoverJobRankRootMissing(t *testing.T) {
	dir := trainJob(t)
	rr := checkpoint.RankRoot(dir, 1)
	away := filepath.Join(t.TempDir(), "away")
	if err := os.Rename(rr, away); err != nil {
		t.Fatal(err)
	}
	before := entries(t, dir)
	rc, stdout, stderr := invoke(t, "ckpt", "recover", dir)
	if rc != 1 || !strings.Contains(stderr, rr+" are missing: nothing was changed") || !strings.Contains(stderr, "put them back") {
		t.Errorf("dos ckpt recover with rank 1's root missing: rc %d\n%s%s", rc, stdout, stderr)
	}
	if after := entries(t, dir); !slices.Equal(before, after) {
		t.Errorf("recover changed the job's root: %v, then %v", before, after)
	}
	// An empty rank root (a mount point whose disk is not mounted) is
	// missing too: the job was set aside whole as damaged.
	if err := os.Mkdir(rr, 0o755); err != nil {
		t.Fatal(err)
	}
	rc, stdout, stderr = invoke(t, "ckpt", "recover", dir)
	if rc != 1 || !strings.Contains(stderr, rr+" (empty: an unmounted disk?) are missing: nothing was changed") {
		t.Errorf("dos ckpt recover with rank 1's root empty: rc %d\n%s%s", rc, stdout, stderr)
	}
	if len(setAside(t, dir)) != 0 {
		t.Errorf("recover set the job aside: %v", entries(t, dir))
	}
	if err := os.Remove(rr); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(away, rr); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 0 {
		t.Errorf("dos ckpt recover with the rank root back: rc %d\n%s%s", rc, stdout, stderr)
	}
	resume := append([]string{"--resume", "--ckpt-dir", dir, "--steps", "6", "--gpus", "2"}, tinyShape...)
	if rc, stdout, stderr := invoke(t, "train", resume...); rc != 0 || !strings.Contains(stdout, "done: 6 iterations") {
		t.Errorf("dos train --resume with the rank root back: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestRecoverSetsAsideEveryDamagedStep: with the two newest checkpoints
// damaged, dos ckpt recover sets both aside, whole, and points latest at
// the oldest, which verifies: the newer damaged one is no longer left
// above latest (ls called it "not committed", and the next save of its
// step replaced it); the run then resumes from step 2, both set-aside
// checkpoints kept.
func TestRecoverSetsAsideEveryDamagedStep(t *testing.T) {
	dir := trainRoot(t, "6", "2")
	for _, step := range []int64{4, 6} {
		flipByte(t, filepath.Join(checkpoint.StepDir(dir, step), "rank-00000.safetensors"))
	}
	rc, stdout, stderr := invoke(t, "ckpt", "recover", dir)
	if rc != 0 || !strings.Contains(stdout, "step-000000006 did not verify") || !strings.Contains(stdout, "step-000000004 as ") || !strings.Contains(stdout, "latest now names step-000000002") {
		t.Errorf("dos ckpt recover with steps 4 and 6 damaged: rc %d\n%s%s", rc, stdout, stderr)
	}
	aside := setAside(t, dir)
	if len(aside) != 2 {
		t.Fatalf("set aside: %v, want steps 4 and 6", aside)
	}
	for _, a := range aside {
		if _, err := os.Stat(filepath.Join(a, checkpoint.ManifestFile)); err != nil {
			t.Errorf("%s is not whole: %v", a, err)
		}
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "ls", dir); rc != 0 || strings.Contains(stdout, "above latest") || !strings.Contains(stdout, "* "+checkpoint.StepDir(dir, 2)) {
		t.Errorf("dos ckpt ls after recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(dir, "6")...); rc != 0 || !strings.Contains(stdout, "done: 6 iterations") {
		t.Errorf("dos train --resume after recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if got := setAside(t, dir); len(got) != 2 {
		t.Errorf("after the resume, set aside: %v", got)
	}
}

// TestCkptLsStepDir: dos ckpt ls of a step directory says it is one and
// names its root (it said "no committed checkpoints" and exited 0).
func TestCkptLsStepDir(t *testing.T) {
	dir := trainRoot(t, "2", "2")
	step := checkpoint.StepDir(dir, 2)
	rc, stdout, stderr := invoke(t, "ckpt", "ls", step)
	if rc != 2 || !strings.Contains(stderr, "is a checkpoint (a step directory), not a checkpoint root: dos ckpt ls "+dir) || strings.Contains(stdout, "no committed") {
		t.Errorf("dos ckpt ls STEPDIR: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestMissingLatestNamesRecover: a root whose latest was removed is
// damaged, and ls names the command that repairs it (it named the Go
// function checkpoint.Recover); recover then repairs it.
func TestMissingLatestNamesRecover(t *testing.T) {
	dir := trainRoot(t, "2", "2")
	if err := os.Remove(filepath.Join(dir, checkpoint.LatestFile)); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "ls", dir); rc != 1 || !strings.Contains(stderr+stdout, "dos ckpt recover "+dir) || strings.Contains(stderr+stdout, "checkpoint.Recover (") {
		t.Errorf("dos ckpt ls without latest: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 0 || !strings.Contains(stdout, "step-000000002") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestJobLatestLostKeepsCheckpoints (the second adversary): a job whose
// latest was removed after it committed steps 2 and 4 is not a first save
// cut short. With rank 1's root moved away too, recover and --resume
// refuse, changing nothing (they deleted rank 0's steps 2 and 4 as "what
// its ranks wrote of a first save", and --resume trained from 0); with
// rank 1 lacking step 4, recover moves the job to step 2 and sets rank
// 0's step 4 aside, kept whole (it deleted it).
func TestJobLatestLostKeepsCheckpoints(t *testing.T) {
	dir := trainJob(t)
	if err := os.Remove(filepath.Join(dir, checkpoint.LatestFile)); err != nil {
		t.Fatal(err)
	}
	rr0, rr1 := checkpoint.RankRoot(dir, 0), checkpoint.RankRoot(dir, 1)
	away := filepath.Join(t.TempDir(), "away")
	if err := os.Rename(rr1, away); err != nil {
		t.Fatal(err)
	}
	before := entries(t, rr0)
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 1 || !strings.Contains(stderr, "are missing: nothing was changed") {
		t.Errorf("recover, latest lost and rank 1's root away: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(dir, "6", "--gpus", "2")...); rc != 1 || strings.Contains(stdout, "done:") {
		t.Errorf("--resume, latest lost and rank 1's root away: rc %d\n%s%s", rc, stdout, stderr)
	}
	if after := entries(t, rr0); !slices.Equal(before, after) {
		t.Fatalf("rank 0's root changed: %v, then %v", before, after)
	}
	if err := os.Rename(away, rr1); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(checkpoint.StepDir(rr1, 4), filepath.Join(t.TempDir(), "step4")); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 0 {
		t.Errorf("recover, latest lost and rank 1 lacking step 4: rc %d\n%s%s", rc, stdout, stderr)
	}
	if step, _, err := checkpoint.JobLatest(checkpoint.OS, dir); step != 2 || err != nil {
		t.Errorf("the job after recover: step %d, %v; want 2", step, err)
	}
	kept := false
	for _, e := range entries(t, rr0) {
		if strings.HasPrefix(e, "damaged-") && strings.Contains(e, "step-000000004") {
			kept = true
		}
	}
	if !kept {
		t.Errorf("rank 0's step 4 was not kept: %v", entries(t, rr0))
	}
}

// TestRankSlotOfAnotherJobRefused (the second adversary): a fresh run or
// a reshard into rank-00002 of a healthy job of 2 ranks is refused before
// it writes (both succeeded, and the job then failed verify and resume
// for rank roots of two runs); the job still verifies.
func TestRankSlotOfAnotherJobRefused(t *testing.T) {
	job := trainJob(t)
	src := trainJob(t)
	slot := filepath.Join(job, "rank-00002")
	fresh := append([]string{"--ckpt-dir", slot, "--steps", "2", "--ckpt-every", "2"}, tinyShape...)
	if rc, stdout, stderr := invoke(t, "train", fresh...); rc == 0 || !strings.Contains(stderr, "is a rank root of the job "+job) {
		t.Errorf("dos train --ckpt-dir JOB/rank-00002: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "reshard", "--gpus", "1", src, slot); rc == 0 || !strings.Contains(stderr, "is a rank root of the job "+job) {
		t.Errorf("dos ckpt reshard SRC JOB/rank-00002: rc %d\n%s%s", rc, stdout, stderr)
	}
	if _, err := os.Stat(slot); err == nil {
		t.Errorf("%s was created", slot)
	}
	// Through a link to an empty slot, and below an absent one (the third
	// adversary: both wrote there).
	if err := os.Mkdir(filepath.Join(job, "rank-00003"), 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(filepath.Join(job, "rank-00003"), link); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{link, filepath.Join(slot, "sub")} {
		args := append([]string{"--ckpt-dir", d, "--steps", "2", "--ckpt-every", "2"}, tinyShape...)
		if rc, stdout, stderr := invoke(t, "train", args...); rc == 0 || !strings.Contains(stderr, "is a rank root of the job") {
			t.Errorf("dos train --ckpt-dir %s: rc %d\n%s%s", d, rc, stdout, stderr)
		}
	}
	if err := os.Remove(filepath.Join(job, "rank-00003")); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", job); rc != 0 {
		t.Errorf("dos ckpt verify of the job: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestJobFileDirectory (the second adversary): a job.json that is a
// directory is refused by verify, --resume and recover alike, saying to
// move it away (they sent the user to recover, which failed on a rename
// every time); once moved away, recover rewrites it and the job resumes.
func TestJobFileDirectory(t *testing.T) {
	dir := trainJob(t)
	jf := filepath.Join(dir, checkpoint.JobFile)
	if err := os.Remove(jf); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(jf, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"ckpt", "verify", dir}, {"ckpt", "recover", dir}, append([]string{"train"}, resumeArgs(dir, "6", "--gpus", "2")...)} {
		if rc, stdout, stderr := invoke(t, args[0], args[1:]...); rc == 0 || !strings.Contains(stderr, "is a directory, not a file: move it away") || strings.Contains(stderr, "file exists") {
			t.Errorf("dos %v: rc %d\n%s%s", args, rc, stdout, stderr)
		}
	}
	if err := os.Remove(jf); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 0 {
		t.Errorf("dos ckpt recover once it is moved away: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "train", resumeArgs(dir, "6", "--gpus", "2")...); rc != 0 || !strings.Contains(stdout, "done: 6 iterations") {
		t.Errorf("--resume after: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestCkptLsJobWithoutLatest (the second adversary): ls of a job whose
// latest was lost says so, lists what its rank roots hold and names
// recover (it said only "no checkpoint"); recover restores step 4.
func TestCkptLsJobWithoutLatest(t *testing.T) {
	dir := trainJob(t)
	if err := os.Remove(filepath.Join(dir, checkpoint.LatestFile)); err != nil {
		t.Fatal(err)
	}
	rc, stdout, stderr := invoke(t, "ckpt", "ls", dir)
	if rc != 1 || !strings.Contains(stderr, "has no latest, but its rank roots hold checkpoints") || !strings.Contains(stderr, "dos ckpt recover "+dir) || !strings.Contains(stdout, checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 4)) {
		t.Errorf("dos ckpt ls of a job without latest: rc %d\n%s%s", rc, stdout, stderr)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "recover", dir); rc != 0 {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	if step, _, err := checkpoint.JobLatest(checkpoint.OS, dir); step != 4 || err != nil {
		t.Errorf("the job after recover: step %d, %v; want 4", step, err)
	}
}

// TestJobExtraRankRoot (the second adversary): a rank-00002 copied into a
// job of 2 ranks is named as not one of its ranks, to move out (the
// message said to put "rank 2's own checkpoints" back; the job has no
// rank 2); moved out, the job verifies.
func TestJobExtraRankRoot(t *testing.T) {
	dir := trainJob(t)
	extra := filepath.Join(dir, "rank-00002")
	copyTree(t, checkpoint.RankRoot(dir, 1), extra)
	rc, stdout, stderr := invoke(t, "ckpt", "verify", dir)
	if rc != 1 || !strings.Contains(stderr, extra+" is not one of them") || !strings.Contains(stderr, "move "+extra+" out") || strings.Contains(stderr, "rank 2's own") {
		t.Errorf("dos ckpt verify with an extra rank root: rc %d\n%s%s", rc, stdout, stderr)
	}
	if err := os.RemoveAll(extra); err != nil {
		t.Fatal(err)
	}
	if rc, stdout, stderr := invoke(t, "ckpt", "verify", dir); rc != 0 {
		t.Errorf("dos ckpt verify once moved out: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestRecoverFinishesInterruptedJobSetAside (the second adversary): a dos
// ckpt recover killed while it set a job's files aside (one rank root
// moved into damaged-job-*.partial, the rest not) is finished by the next
// recover, which says so (it refused forever, "rank roots missing",
// never naming where they were); the root then takes a new run.
func TestRecoverFinishesInterruptedJobSetAside(t *testing.T) {
	dir := trainJob(t)
	partial := filepath.Join(dir, "damaged-job-123.partial")
	if err := os.Mkdir(partial, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(checkpoint.RankRoot(dir, 0), filepath.Join(partial, "rank-00000")); err != nil {
		t.Fatal(err)
	}
	// No run starts there before recover has finished it (a new job's
	// files would be set aside with the old one's).
	fresh := []string{"--gpus", "2", "--steps", "2", "--ckpt-dir", dir, "--ckpt-every", "2", "--layers", "1", "--embd", "16",
		"--heads", "2", "--ctx", "8", "--batch", "4", "--sample", "0", "--eval-batches", "1", "--max-memory", "1"}
	if rc, stdout, stderr := invoke(t, "train", fresh...); rc == 0 || !strings.Contains(stderr, "run dos ckpt recover "+dir+" to finish it first") {
		t.Errorf("a new job beside an interrupted set-aside: rc %d\n%s%s", rc, stdout, stderr)
	}
	rc, stdout, stderr := invoke(t, "ckpt", "recover", dir)
	final := filepath.Join(dir, "damaged-job-123")
	if rc != 1 || !strings.Contains(stderr, "an interrupted dos ckpt recover was setting the job's files aside") || !strings.Contains(stderr, final) {
		t.Errorf("dos ckpt recover after an interrupted set-aside: rc %d\n%s%s", rc, stdout, stderr)
	}
	if got := entries(t, final); !slices.Equal(got, []string{checkpoint.JobFile, checkpoint.LatestFile, "rank-00000", "rank-00001"}) {
		t.Errorf("the set-aside job holds %v", got)
	}
	if rc, stdout, stderr := invoke(t, "train", fresh...); rc != 0 {
		t.Errorf("a new job after: rc %d\n%s%s", rc, stdout, stderr)
	}
}

// TestRecoverJobVerifiesTheStepItMovesTo (the third adversary): with rank
// 0's step 4 and rank 1's step 2 damaged, recover verifies step 2 in every
// rank before leaving the job there: none is left that every rank holds,
// so it says so (it exited 0, "now at step 2", and verify then failed and
// sent the user back to recover).
func TestRecoverJobVerifiesTheStepItMovesTo(t *testing.T) {
	dir := trainJob(t)
	flipByte(t, filepath.Join(checkpoint.StepDir(checkpoint.RankRoot(dir, 0), 4), "rank-00000.safetensors"))
	flipByte(t, filepath.Join(checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 2), "rank-00000.safetensors"))
	rc, stdout, stderr := invoke(t, "ckpt", "recover", dir)
	if rc != 1 || !strings.Contains(stderr, "no step is left that every rank holds") {
		t.Errorf("dos ckpt recover: rc %d\n%s%s", rc, stdout, stderr)
	}
	fresh := []string{"--gpus", "2", "--steps", "2", "--ckpt-dir", dir, "--ckpt-every", "2", "--layers", "1", "--embd", "16",
		"--heads", "2", "--ctx", "8", "--batch", "4", "--sample", "0", "--eval-batches", "1", "--max-memory", "1"}
	if rc, stdout, stderr := invoke(t, "train", fresh...); rc != 0 {
		t.Errorf("a new job after: rc %d\n%s%s", rc, stdout, stderr)
	}
}
