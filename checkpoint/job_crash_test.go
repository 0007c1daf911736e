package checkpoint

import (
	"fmt"
	"testing"
)

// resumeAfterCrash is what dos train --gpus --resume does after a crash
// (trainer's openJob, then saver.save): ResumeJob finds the step every
// rank holds (-1: start at 0), then BeginJob, a save of the next step
// (from+2) by every rank and CommitJob.
func resumeAfterCrash(fsys FS, root string, world int) (from int64, err error) {
	step, _, err := ResumeJob(fsys, root, world)
	if err != nil {
		return 0, fmt.Errorf("ResumeJob: %w", err)
	}
	if step < 0 {
		step = 0
	}
	if err := BeginJob(fsys, root, world); err != nil {
		return 0, err
	}
	next := step + 2
	for r := range world {
		if _, err := Save(fsys, RankRoot(root, r), testSnapshot(next)); err != nil {
			return step, fmt.Errorf("re-save step %d rank %d: %w", next, r, err)
		}
	}
	if err := CommitJob(fsys, root, world, next); err != nil {
		return step, fmt.Errorf("CommitJob %d: %w", next, err)
	}
	return step, nil
}

// TestJobCrashEveryOp crashes a two-rank job's save at every file
// operation (its first save and a later one, either rank first, a process
// crash or a power loss: memFS's crashClone), then resumes as dos train
// does and saves the next step: the resume must start at or after the
// last committed step, and the next save and commit must succeed.
func TestJobCrashEveryOp(t *testing.T) {
	const root = "/job"
	for _, first := range []bool{true, false} {
		for _, order := range [][]int{{0, 1}, {1, 0}} {
			for _, power := range []bool{false, true} {
				fails, i := 0, 0
				for ; ; i++ {
					m := newMemFS()
					var committed int64
					if !first {
						for r := range 2 {
							if _, err := Save(m, RankRoot(root, r), testSnapshot(2)); err != nil {
								t.Fatal(err)
							}
						}
						if err := CommitJob(m, root, 2, 2); err != nil {
							t.Fatal(err)
						}
						committed = 2
					}
					target := committed + 2
					e := newErrorFS(m)
					e.crashAt = i
					var err error
					if first {
						// dos train: BeginJob before the first save.
						err = BeginJob(e, root, 2)
					}
					for _, r := range order {
						if err != nil {
							break
						}
						if _, err = Save(e, RankRoot(root, r), testSnapshot(target)); err != nil {
							break
						}
					}
					if err == nil {
						err = CommitJob(e, root, 2, target)
						if err == nil {
							committed = target
						}
					}
					done := e.ops <= i // no crash happened
					c := m.crashClone(power)
					from, rerr := resumeAfterCrash(c, root, 2)
					if rerr != nil || from < committed {
						fails++
						if fails <= 3 {
							t.Errorf("first=%v order=%v power=%v crash at op %d (%s): committed %d; resume from %d: %v",
								first, order, power, i, lastOp(e), committed, from, rerr)
						}
					}
					if done {
						break
					}
				}
				if fails > 3 {
					t.Errorf("first=%v order=%v power=%v: %d of %d crash points fail", first, order, power, fails, i+1)
				}
			}
		}
	}
}

func lastOp(e *errorFS) string {
	if len(e.log) == 0 {
		return ""
	}
	for _, l := range e.log {
		var n int
		fmt.Sscanf(l, "%d", &n)
		if n == e.crashAt {
			return l
		}
	}
	return "-"
}

// TestClearFirstSaveCrashEveryOp: a job whose first save only rank 0
// finished (rank 1 holds its lock file) is cleared by ResumeJob, which
// keeps rank 0's complete step whole beside the job; a crash at every file
// operation of that clearing (a process crash or a power loss), then a
// second ResumeJob: it clears what is left (a new run may start) and rank
// 0's step is never lost: kept beside the job or still in its root. The
// fourth job adversary's round: cut short between the step's move and the
// rank root's removal, the rank root's latest named a step no longer
// there, and every command refused it, in a circle; and a failing Stat
// made the search for a free name (freshName) loop for ever.
func TestClearFirstSaveCrashEveryOp(t *testing.T) {
	const root = "/job"
	for _, power := range []bool{false, true} {
		for i := 0; ; i++ {
			if i > 200 {
				t.Fatalf("power=%v: ResumeJob still crashing at op %d", power, i)
			}
			m := newMemFS()
			if err := BeginJob(m, root, 2); err != nil {
				t.Fatal(err)
			}
			if _, err := Save(m, RankRoot(root, 0), testSnapshot(2)); err != nil {
				t.Fatal(err)
			}
			e := newErrorFS(m)
			e.crashAt = i
			_, _, err := ResumeJob(e, root, 2)
			done := e.ops <= i
			if done && err != nil {
				t.Fatalf("ResumeJob without a crash: %v", err)
			}
			c := m.crashClone(power)
			if step, _, err := ResumeJob(c, root, 2); err != nil || step != -1 {
				t.Errorf("power=%v crash at op %d (%s): the second ResumeJob: step %d, %v; want -1 (start over)", power, i, lastOp(e), step, err)
			}
			es, _ := c.ReadDir(root)
			kept := false
			for _, en := range es {
				if len(en.Name()) > len(firstSavePrefix) && en.Name()[:len(firstSavePrefix)] == firstSavePrefix {
					if st, err := c.Stat(root + "/" + en.Name() + "/" + ManifestFile); err == nil && st.Mode().IsRegular() {
						kept = true
					}
				}
			}
			if !kept {
				t.Errorf("power=%v crash at op %d (%s): rank 0's complete step 2 is not kept beside the job: %v", power, i, lastOp(e), es)
			}
			if done {
				break
			}
		}
	}
}
