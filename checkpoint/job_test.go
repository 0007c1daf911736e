package checkpoint

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
	// Rewinding forward is refused.
	if err := RewindRank(OS, RankRoot(root, 1), 6); err == nil || !strings.Contains(err.Error(), "before the job's 6") {
		t.Errorf("RewindRank past latest: %v", err)
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
