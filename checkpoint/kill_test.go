package checkpoint

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestMain lets the test binary play other processes. With
// DOS_CKPT_CHILD=ROOT it resumes under ROOT as a trainer would (Recover),
// then saves lazily, step after step, keeping 3, until it is killed: with
// DOS_CKPT_KILL_AT=N it kills itself with SIGKILL just before its file
// operation N (of those its FS sees, file reads and writes included). With
// DOS_CKPT_LOCK_CHILD=ROOT it takes ROOT's lock, says "locked" and waits.
func TestMain(m *testing.M) {
	if root := os.Getenv("DOS_CKPT_LOCK_CHILD"); root != "" {
		if _, err := Lock(OS, root); err != nil {
			os.Exit(3)
		}
		os.Stdout.WriteString("locked\n")
		select {}
	}
	if root := os.Getenv("DOS_CKPT_CHILD"); root != "" {
		var fsys FS = OS
		if n, err := strconv.Atoi(os.Getenv("DOS_CKPT_KILL_AT")); err == nil {
			efs := newErrorFS(OS)
			efs.killAt = n
			fsys = efs
		}
		start := int64(1)
		if rec, err := Recover(fsys, root, 0); err == nil {
			start, _ = parseStepDirName(filepath.Base(rec.Dir))
			start++
		} else if !errors.Is(err, ErrNoCheckpoint) {
			os.Exit(6)
		}
		e, err := NewEngine(fsys, root, EngineOptions{ChunkBytes: 1 << 16, RingBytes: 1 << 18, Writers: 3, Keep: 3})
		if err != nil {
			os.Exit(3)
		}
		for step := start; ; step++ {
			h, err := e.Save(sizedSnapshot(step, 3, 1, 4097, 100000, 300001, 7))
			if err != nil {
				os.Exit(4)
			}
			if _, err := h.Wait(); err != nil {
				os.Exit(5)
			}
		}
	}
	os.Exit(m.Run())
}

// killSnapshot is the snapshot the kill test's processes save at step.
func killSnapshot(step int64) *Snapshot { return sizedSnapshot(step, 3, 1, 4097, 100000, 300001, 7) }

// TestKill: SIGKILL a lazily checkpointing process (Keep 3, so retention
// runs after every commit) many times: at random moments, and just before
// a random one of its file operations, on roots that accumulate runs and
// on fresh roots (so that the first commit is cut too). After every kill,
// what `dos train --resume` does (Recover) gives a checkpoint that holds
// exactly its step's snapshot, never an older one than before; the next
// save (with retention) then leaves no leftover: only latest and at most 3
// complete step directories. Rounds: DOS_KILL_ROUNDS (default 20; the
// issue's figure is 200).
func TestKill(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns processes")
	}
	rounds := 20
	if s := os.Getenv("DOS_KILL_ROUNDS"); s != "" {
		rounds, _ = strconv.Atoi(s)
	}
	tmp := t.TempDir()
	killLog := filepath.Join(tmp, "killed-at")
	r := rand.New(rand.NewPCG(7, 7))
	var root string
	var commits, repaired, atOp, retention, firstCommit int
	var lastStep int64
	for i := range rounds {
		if i%5 == 0 { // a fresh root: the first commit is in reach
			root = filepath.Join(tmp, fmt.Sprintf("ckpt-%d", i))
			lastStep = 0
		}
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "DOS_CKPT_CHILD="+root, "DOS_CKPT_KILL_LOG="+killLog)
		byOp := i%2 == 1
		if byOp {
			// One save with retention takes about 60 operations: the
			// first commit, or the first saves after a resume.
			cmd.Env = append(cmd.Env, fmt.Sprintf("DOS_CKPT_KILL_AT=%d", r.IntN(200)))
		}
		os.Remove(killLog)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		if !byOp {
			time.Sleep(time.Duration(5+r.IntN(150)) * time.Millisecond)
			cmd.Process.Signal(syscall.SIGKILL)
		}
		err := cmd.Wait()
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() {
			t.Fatalf("round %d: the child ended on its own: %v", i, err)
		}
		if b, err := os.ReadFile(killLog); err == nil {
			atOp++
			switch killPhase(strings.Split(strings.TrimSpace(string(b)), "\n")) {
			case "retention":
				retention++
			case "first commit":
				firstCommit++
			}
		}
		rec, err := Recover(OS, root, 0)
		if errors.Is(err, ErrNoCheckpoint) && lastStep == 0 {
			continue // killed before the first commit
		}
		if err != nil {
			t.Fatalf("round %d: Recover: %v", i, err)
		}
		if rec.Repaired {
			repaired++
			t.Logf("round %d: %s", i, rec.Note)
		}
		step, _ := parseStepDirName(filepath.Base(rec.Dir))
		checkMatches(t, OS, rec.Dir, killSnapshot(step))
		if step < lastStep {
			t.Fatalf("round %d: latest went back from step %d to %d", i, lastStep, step)
		}
		if step > lastStep {
			commits++
		}
		// The next save, with retention: no leftover of the kill remains.
		e, err := NewEngine(OS, root, EngineOptions{ChunkBytes: 1 << 16, RingBytes: 1 << 18, Keep: 3})
		if err != nil {
			t.Fatal(err)
		}
		engineSave(t, e, killSnapshot(step+1))
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		info, err := Inspect(OS, root)
		if err != nil || info.Problem != nil || len(info.Leftovers) > 0 || info.Pending != "" || len(info.Steps) > 3 {
			t.Fatalf("round %d: after the next save: %+v, %v", i, info, err)
		}
		for _, s := range info.Steps {
			if !s.Committed {
				t.Fatalf("round %d: after the next save: %s is not a committed checkpoint", i, s.Dir)
			}
		}
		if got := rootEntries(t, OS, root); len(got) != 1+len(info.Steps) {
			t.Fatalf("round %d: after the next save the root holds %v", i, got)
		}
		lastStep = step + 1
	}
	t.Logf("%d kills (%d just before a file operation: %d during retention, %d during a first commit): Recover gave a verified checkpoint of the right step every time (repairing %d roots); latest advanced %d times; no leftover after the next save",
		rounds, atOp, retention, firstCommit, repaired, commits)
	if commits == 0 {
		t.Fatal("no checkpoint was ever committed: the test proves nothing")
	}
}

// killPhase tells from a child's operation log, whose last line is the
// operation it was killed before, whether it died during retention (after
// moving latest, before the next save's temporary directory) or during its
// first commit (a save begun, latest never moved).
func killPhase(log []string) string {
	began := false
	for i := len(log) - 2; i >= 0; i-- {
		f := strings.Fields(log[i])
		if len(f) < 3 {
			continue
		}
		switch {
		case f[1] == "rename" && filepath.Base(f[2]) == pendingLatest:
			if began || i == len(log)-2 { // a save since, or the commit's last fsync
				return ""
			}
			return "retention"
		case f[1] == "mkdirall" && strings.HasPrefix(filepath.Base(f[2]), tmpPrefix+"step-"):
			began = true
		}
	}
	if began {
		return "first commit"
	}
	return ""
}
