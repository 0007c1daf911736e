package checkpoint

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestJobCommit: a two-rank job commits a step only once both ranks hold
// it; a rank that did not save leaves the job's latest where it was, named
// in the error; rewinding the rank that ran ahead makes the job's step its
// latest again, and its next save of the later step replaces what it wrote;
// job.json fixes the world size; JobFresh and JobLatest say what is there.
func TestJobCommit(t *testing.T) {
	root := filepath.Join(t.TempDir(), "job")
	if fresh, err := JobFresh(OS, root); !fresh || err != nil {
		t.Fatalf("a missing root: fresh %v, %v", fresh, err)
	}
	if _, _, err := JobLatest(OS, root); !errors.Is(err, ErrNoCheckpoint) {
		t.Fatalf("JobLatest of nothing: %v", err)
	}
	for r := range 2 {
		mustSave(t, OS, RankRoot(root, r), testSnapshot(2))
	}
	if err := CommitJob(OS, root, 2, 2); err != nil {
		t.Fatal(err)
	}
	if step, world, err := JobLatest(OS, root); step != 2 || world != 2 || err != nil {
		t.Fatalf("JobLatest: %d, %d, %v; want 2, 2", step, world, err)
	}
	if fresh, _ := JobFresh(OS, root); fresh {
		t.Error("a committed job reported fresh")
	}
	// Step 4: rank 1's save failed; rank 0's is committed in its root.
	mustSave(t, OS, RankRoot(root, 0), testSnapshot(4))
	err := CommitJob(OS, root, 2, 4)
	if err == nil || !strings.Contains(err.Error(), "rank 1 has not committed step 4") {
		t.Fatalf("CommitJob without rank 1: %v", err)
	}
	if step, _, _ := JobLatest(OS, root); step != 2 {
		t.Fatalf("after a failed rank: the job's latest is step %d, want 2", step)
	}
	// Resume: rank 0 rewinds to the job's step; its step 4 is a leftover
	// that its next save of step 4 replaces.
	if err := RewindRank(OS, RankRoot(root, 0), 2); err != nil {
		t.Fatal(err)
	}
	if dir, err := Latest(OS, RankRoot(root, 0)); err != nil || filepath.Base(dir) != "step-000000002" {
		t.Fatalf("rank 0 after RewindRank: %s, %v", dir, err)
	}
	if err := RewindRank(OS, RankRoot(root, 1), 2); err != nil { // already there
		t.Fatal(err)
	}
	again := testSnapshot(4)
	again.Objects["trainer"] = []byte(`{"iteration": 4, "again": true}`)
	for r := range 2 {
		mustSave(t, OS, RankRoot(root, r), again)
	}
	if err := CommitJob(OS, root, 2, 4); err != nil {
		t.Fatal(err)
	}
	checkMatches(t, OS, StepDir(RankRoot(root, 0), 4), again)
	if step, _, _ := JobLatest(OS, root); step != 4 {
		t.Fatalf("the job's latest is step %d, want 4", step)
	}
	// The single-rank functions refuse the job's root instead of taking
	// it for a damaged root and repairing it.
	for what, err := range map[string]error{
		"Latest":  func() error { _, err := Latest(OS, root); return err }(),
		"Inspect": func() error { _, err := Inspect(OS, root); return err }(),
		"Recover": func() error { _, err := Recover(OS, root, 0); return err }(),
		"Retain":  Retain(OS, root, 1),
		"Save":    func() error { _, err := Save(OS, root, testSnapshot(9)); return err }(),
	} {
		if !errors.Is(err, ErrJobRoot) || !strings.Contains(err.Error(), "job of 2 ranks") {
			t.Errorf("%s on a job's root: %v", what, err)
		}
	}
	if step, _, _ := JobLatest(OS, root); step != 4 {
		t.Fatalf("after the refusals the job's latest is step %d, want 4", step)
	}
	// The world size is the job's.
	if err := CommitJob(OS, root, 3, 4); err == nil || !strings.Contains(err.Error(), "rank 2 has not committed") {
		t.Errorf("CommitJob for 3 ranks: %v", err)
	}
	mustSave(t, OS, RankRoot(root, 2), testSnapshot(4))
	if err := CommitJob(OS, root, 3, 4); err == nil || !strings.Contains(err.Error(), "cut for 2 ranks, not 3") {
		t.Errorf("CommitJob for 3 ranks of a 2-rank job: %v", err)
	}
	// Pointing a rank at a step it does not hold is refused.
	if err := RewindRank(OS, RankRoot(root, 1), 6); err == nil || !strings.Contains(err.Error(), "step 6") {
		t.Errorf("RewindRank to a missing step: %v", err)
	}
	// Bad contents are ErrCorrupt, never a panic.
	if err := os.WriteFile(filepath.Join(root, JobFile), []byte("{]"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := JobLatest(OS, root); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), JobFile) {
		t.Errorf("a garbled job.json: %v", err)
	}
	if err := os.WriteFile(filepath.Join(root, LatestFile), []byte("nonsense"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := JobLatest(OS, root); !errors.Is(err, ErrCorrupt) {
		t.Errorf("a garbled latest: %v", err)
	}
	// A single-rank root is not fresh for a job.
	single := t.TempDir()
	mustSave(t, OS, single, testSnapshot(1))
	if fresh, _ := JobFresh(OS, single); fresh {
		t.Error("a single-rank root reported fresh for a job")
	}
}

// TestResumeJob: what a resume finds after each way a job's saves can end.
func TestResumeJob(t *testing.T) {
	steps := func(t *testing.T, rr string) []string {
		t.Helper()
		es, _ := os.ReadDir(rr)
		var out []string
		for _, e := range es {
			if strings.HasPrefix(e.Name(), "step-") {
				out = append(out, e.Name())
			}
		}
		return out
	}
	t.Run("first save cut short", func(t *testing.T) {
		// job.json written, rank 0 committed step 2 in its root, rank 1
		// did not: the job never committed; resuming starts over and the
		// next first save is not refused.
		root := t.TempDir()
		if err := BeginJob(OS, root, 2); err != nil {
			t.Fatal(err)
		}
		mustSave(t, OS, RankRoot(root, 0), testSnapshot(2))
		// Rank 1's run opened its root (its lock file) and was killed
		// before its save completed.
		l, err := Lock(OS, RankRoot(root, 1))
		if err != nil {
			t.Fatal(err)
		}
		l.Unlock()
		step, note, err := ResumeJob(OS, root, 2)
		if step != -1 || err != nil || !strings.Contains(note, "never committed") {
			t.Fatalf("ResumeJob: %d, %q, %v; want -1 and a note", step, note, err)
		}
		for r := range 2 {
			mustSave(t, OS, RankRoot(root, r), testSnapshot(2))
		}
		if err := CommitJob(OS, root, 2, 2); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("first save uncertain", func(t *testing.T) {
		// No job latest and no step every rank holds, as a first save
		// cut short leaves, but a rank root is missing, empty without a
		// lock file, or its latest names a step it lacks: the job may
		// have committed (adversary round 2, F1). Refused, nothing
		// changed, by ResumeJob and RecoverJob alike.
		for _, c := range []struct {
			name, want string
			damage     func(root string)
		}{
			{"rank root missing", "rank-00001 is missing", func(root string) { os.RemoveAll(RankRoot(root, 1)) }},
			{"rank root empty", "not even the lock file", func(root string) {
				os.RemoveAll(RankRoot(root, 1))
				os.Mkdir(RankRoot(root, 1), 0o755)
			}},
			{"rank latest names a step lost", "which it does not hold complete", func(root string) {
				os.RemoveAll(StepDir(RankRoot(root, 1), 4))
			}},
		} {
			t.Run(c.name, func(t *testing.T) {
				for _, recover := range []bool{false, true} {
					root := t.TempDir()
					if err := BeginJob(OS, root, 2); err != nil {
						t.Fatal(err)
					}
					for r := range 2 {
						mustSave(t, OS, RankRoot(root, r), testSnapshot(4))
					}
					if err := CommitJob(OS, root, 2, 4); err != nil {
						t.Fatal(err)
					}
					os.Remove(filepath.Join(root, LatestFile))
					c.damage(root)
					before := treeOf(t, root)
					var err error
					if recover {
						_, _, err = RecoverJob(OS, root, func(*Checkpoint) error { return nil }, func(*Checkpoint) (RankID, error) { return RankID{}, nil })
					} else {
						_, _, err = ResumeJob(OS, root, 2)
					}
					if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "Nothing was changed") {
						t.Errorf("recover %v: %v; want ErrCorrupt naming %q", recover, err, c.want)
					}
					if after := treeOf(t, root); !slices.Equal(before, after) {
						t.Errorf("recover %v changed the root:\n%v\n%v", recover, before, after)
					}
				}
			})
		}
	})
	t.Run("job latest lost", func(t *testing.T) {
		// Both ranks hold steps 2 and 4; the job's latest is gone: the
		// resume takes step 4 and commits it again, never starting over.
		root := t.TempDir()
		for _, st := range []int64{2, 4} {
			for r := range 2 {
				mustSave(t, OS, RankRoot(root, r), testSnapshot(st))
			}
			if err := CommitJob(OS, root, 2, st); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Remove(filepath.Join(root, LatestFile)); err != nil {
			t.Fatal(err)
		}
		step, note, err := ResumeJob(OS, root, 2)
		if step != 4 || err != nil || !strings.Contains(note, "no latest") {
			t.Fatalf("ResumeJob: %d, %q, %v; want 4", step, note, err)
		}
		if s, _, _ := JobLatest(OS, root); s != 4 {
			t.Errorf("the job's latest: %d, want 4", s)
		}
	})
	t.Run("stale set-aside marker", func(t *testing.T) {
		// Rank 0 set a step 6 aside an hour before the job committed
		// step 6 (again); now its step 6 is gone: that old marker is not
		// this step's, and ResumeJob refuses, changing nothing (the third
		// adversary: it moved the job back to 4 on the old marker).
		root := t.TempDir()
		for _, st := range []int64{4, 6} {
			for r := range 2 {
				mustSave(t, OS, RankRoot(root, r), testSnapshot(st))
			}
			if err := CommitJob(OS, root, 2, st); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Mkdir(filepath.Join(RankRoot(root, 0), fmt.Sprintf("damaged-step-000000006-%d", time.Now().Unix()-3600)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(StepDir(RankRoot(root, 0), 6), filepath.Join(t.TempDir(), "away")); err != nil {
			t.Fatal(err)
		}
		if step, note, err := ResumeJob(OS, root, 2); err == nil || !strings.Contains(err.Error(), "Nothing was changed") {
			t.Fatalf("ResumeJob: %d, %q, %v; want a refusal", step, note, err)
		}
		if s, _, _ := JobLatest(OS, root); s != 6 {
			t.Errorf("the job's latest: %d, want 6 (unchanged)", s)
		}
	})
	t.Run("rank rolled back", func(t *testing.T) {
		// The job committed 6, then rank 0's step 6 was set aside (a bad
		// checkpoint, dos ckpt recover on its root): the job moves back
		// to 4, the newest step every rank holds.
		root := t.TempDir()
		for _, st := range []int64{4, 6} {
			for r := range 2 {
				mustSave(t, OS, RankRoot(root, r), testSnapshot(st))
			}
			if err := CommitJob(OS, root, 2, st); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Rename(StepDir(RankRoot(root, 0), 6), filepath.Join(RankRoot(root, 0), fmt.Sprintf("damaged-step-000000006-%d", time.Now().Unix()))); err != nil {
			t.Fatal(err)
		}
		step, note, err := ResumeJob(OS, root, 2)
		if step != 4 || err != nil || note == "" {
			t.Fatalf("ResumeJob: %d, %q, %v; want 4 and a note", step, note, err)
		}
		if got := steps(t, RankRoot(root, 1)); len(got) != 1 || got[0] != "step-000000004" {
			t.Errorf("rank 1 after the resume: %v, want only step 4 (6 set aside: the job no longer commits it)", got)
		}
	})
	t.Run("a rank ran ahead", func(t *testing.T) {
		// Rank 0 committed 6 in its root, rank 1's save failed: the job
		// stays at 4, rank 0's step 6 is retired (retention would count
		// it as committed once a later save passes it).
		root := t.TempDir()
		for r := range 2 {
			mustSave(t, OS, RankRoot(root, r), testSnapshot(4))
		}
		if err := CommitJob(OS, root, 2, 4); err != nil {
			t.Fatal(err)
		}
		mustSave(t, OS, RankRoot(root, 0), testSnapshot(6))
		step, _, err := ResumeJob(OS, root, 2)
		if step != 4 || err != nil {
			t.Fatalf("ResumeJob: %d, %v; want 4", step, err)
		}
		if got := steps(t, RankRoot(root, 0)); len(got) != 1 || got[0] != "step-000000004" {
			t.Errorf("rank 0 after the resume: %v, want only step 4", got)
		}
		if d, err := Latest(OS, RankRoot(root, 0)); err != nil || filepath.Base(d) != "step-000000004" {
			t.Errorf("rank 0's latest: %s, %v", d, err)
		}
	})
	t.Run("not a job", func(t *testing.T) {
		single := t.TempDir()
		mustSave(t, OS, single, testSnapshot(3))
		if err := os.Remove(filepath.Join(single, LatestFile)); err != nil {
			t.Fatal(err)
		}
		if _, _, err := ResumeJob(OS, single, 2); err == nil || !strings.Contains(err.Error(), "one rank's checkpoints") {
			t.Errorf("ResumeJob of a single-rank root: %v", err)
		}
		if _, _, err := ResumeJob(OS, t.TempDir(), 2); err != nil {
			t.Errorf("ResumeJob of an empty root: %v", err)
		}
	})
}

// TestShellQuote: paths a shell would split or expand are single-quoted.
func TestShellQuote(t *testing.T) {
	for in, want := range map[string]string{
		"/tmp/a-b_c.d/e": "/tmp/a-b_c.d/e", "sp ace": "'sp ace'", "it's": `'it'\''s'`, "": "''", "$HOME": "'$HOME'", "a*b": "'a*b'", "-dash": "./-dash", "-a b": "'./-a b'",
	} {
		if got := ShellQuote(in); got != want {
			t.Errorf("ShellQuote(%q) = %s, want %s", in, got, want)
		}
	}
}

// TestDiffering: the ranks-disagree message shows where two JSON texts
// differ, not their first 120 bytes, which are often alike (the second
// adversary: a run_id or last_loss beyond them made both quotes equal).
func TestDiffering(t *testing.T) {
	a := `{"config":{"model":{"n_layer":1}},` + strings.Repeat(`"x":0,`, 40) + `"run_id":"aaaa"}`
	b := strings.Replace(a, "aaaa", "bbbb", 1)
	da, db := differing(a, b)
	if da == db || !strings.Contains(da, "aaaa") || !strings.Contains(db, "bbbb") || !strings.HasPrefix(da, "...") {
		t.Errorf("differing: %q, %q", da, db)
	}
	if da, db := differing(`{"a":1}`, `{"a":2}`); da != `{"a":1}` || db != `{"a":2}` {
		t.Errorf("short texts: %q, %q", da, db)
	}
}

// TestStepCompleteOneTest: rank 1's step 4 has a manifest.json that is a
// directory. The job's steps (completeSteps) and CommitJob took it for
// complete (a Stat that succeeded) while Inspect and Latest took it for
// damaged, so that dos ckpt recover moved the job back and forth between
// them forever. Now each one says it is not complete.
func TestStepCompleteOneTest(t *testing.T) {
	root := t.TempDir()
	for r := range 2 {
		for _, s := range []int64{2, 4} {
			mustSave(t, OS, RankRoot(root, r), testSnapshot(s))
		}
	}
	m := filepath.Join(StepDir(RankRoot(root, 1), 4), ManifestFile)
	if err := os.Remove(m); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(m, 0o755); err != nil {
		t.Fatal(err)
	}
	if steps, err := completeSteps(OS, RankRoot(root, 1)); err != nil || steps[4] || !steps[2] {
		t.Errorf("completeSteps: %v, %v; want step 2 alone", steps, err)
	}
	if info, err := Inspect(OS, RankRoot(root, 1)); err != nil || info.Steps[0].Step != 4 || info.Steps[0].Complete {
		t.Errorf("Inspect: %+v, %v; want step 4 incomplete", info, err)
	}
	if err := CommitJob(OS, root, 2, 4); err == nil || !strings.Contains(err.Error(), m+" is a directory, not a file") {
		t.Errorf("CommitJob of step 4: %v", err)
	}
	if err := RewindRank(OS, RankRoot(root, 1), 4); err == nil || !strings.Contains(err.Error(), "is a directory") {
		t.Errorf("RewindRank to step 4: %v", err)
	}
}

// TestResumeJobLatestBehind: the ranks hold steps 2, 4 and 6 and the
// job's latest names 2. Two steps every rank holds after the job's latest
// are no uncommitted save (a rank runs at most one ahead): ResumeJob moves
// the job to 6, deleting nothing (it retired 4 and 6). One such step is
// the save a crash left before CommitJob: it is retired, as before.
func TestResumeJobLatestBehind(t *testing.T) {
	job := func(t *testing.T, steps ...int64) string {
		root := t.TempDir()
		for r := range 2 {
			for _, s := range steps {
				mustSave(t, OS, RankRoot(root, r), testSnapshot(s))
			}
		}
		if err := CommitJob(OS, root, 2, 2); err != nil {
			t.Fatal(err)
		}
		return root
	}
	root := job(t, 2, 4, 6)
	step, note, err := ResumeJob(OS, root, 2)
	if step != 6 || err != nil || !strings.Contains(note, "holds steps 4, 6 complete after it") || strings.Contains(note, "retired") {
		t.Errorf("ResumeJob, latest 2 of 2, 4, 6: step %d, %q, %v; want 6, nothing retired", step, note, err)
	}
	for r := range 2 {
		if steps, _ := completeSteps(OS, RankRoot(root, r)); len(steps) != 3 {
			t.Errorf("rank %d after ResumeJob holds steps %v, want 2, 4, 6", r, steps)
		}
	}
	root = job(t, 2, 4)
	step, note, err = ResumeJob(OS, root, 2)
	if step != 2 || err != nil || !strings.Contains(note, "step-000000004 retired") {
		t.Errorf("ResumeJob, latest 2 of 2, 4: step %d, %q, %v; want 2, step 4 retired", step, note, err)
	}
}

// treeOf lists the paths under root (the lock files aside), in order.
func treeOf(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Name() != LockFile {
			out = append(out, p)
		}
		return nil
	})
	return out
}
