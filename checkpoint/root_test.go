package checkpoint

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// TestRecover: a fresh root has nothing to recover; a first commit cut
// short between latest.tmp and its rename is finished; a missing, empty or
// garbage latest is pointed at the newest step directory that verifies,
// skipping a corrupt one; when none verifies, or latest is a directory,
// nothing is changed.
func TestRecover(t *testing.T) {
	root := filepath.Join(t.TempDir(), "r")
	if _, err := Recover(OS, root, 0); !errors.Is(err, ErrNoCheckpoint) || errors.Is(err, ErrCorrupt) {
		t.Fatalf("Recover of a missing root: %v", err)
	}
	if info, err := Inspect(OS, root); err != nil || !info.Fresh() {
		t.Fatalf("Inspect of a missing root: %+v, %v", info, err)
	}
	if _, err := os.Stat(root); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Recover created the root: %v", err)
	}

	t.Run("interrupted first commit", func(t *testing.T) {
		root := t.TempDir()
		mustSave(t, OS, root, testSnapshot(5))
		// What a kill between writing latest.tmp and renaming it leaves.
		if err := os.Rename(filepath.Join(root, LatestFile), filepath.Join(root, pendingLatest)); err != nil {
			t.Fatal(err)
		}
		if _, err := Latest(OS, root); !errors.Is(err, ErrCorrupt) || errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "latest.tmp") {
			t.Fatalf("Latest: %v", err)
		}
		if _, err := Save(OS, root, testSnapshot(6)); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("Save into the stranded root: %v", err)
		}
		rec, err := Recover(OS, root, 0)
		if err != nil || !rec.Repaired || !strings.Contains(rec.Note, "finished the interrupted commit of step-000000005") {
			t.Fatalf("Recover: %+v, %v", rec, err)
		}
		checkLatest(t, OS, root, testSnapshot(5))
		if got := rootEntries(t, OS, root); !slices.Equal(got, []string{LatestFile, "step-000000005"}) {
			t.Fatalf("root holds %v", got)
		}
		if rec, err := Recover(OS, root, 0); err != nil || rec.Repaired {
			t.Fatalf("Recover of a sound root: %+v, %v", rec, err)
		}
	})

	for _, damage := range []string{"removed", "empty", "garbage", "names a missing step"} {
		t.Run("latest "+damage, func(t *testing.T) {
			root, dir20 := twoCheckpoints(t)
			latest := filepath.Join(root, LatestFile)
			var err error
			switch damage {
			case "removed":
				err = os.Remove(latest)
			case "empty":
				err = os.WriteFile(latest, nil, 0o644)
			case "garbage":
				err = os.WriteFile(latest, []byte("\x00garbage"), 0o644)
			default:
				err = os.WriteFile(latest, []byte("step-000000099\n"), 0o644)
			}
			if err != nil {
				t.Fatal(err)
			}
			// The newest step is corrupt: Recover skips it for step 10.
			modifyFile(t, filepath.Join(dir20, rank0), func(b []byte) []byte { b[len(b)-1] ^= 1; return b })
			info, err := Inspect(OS, root)
			if err != nil || info.Fresh() || !errors.Is(info.Problem, ErrCorrupt) || len(info.Steps) != 2 {
				t.Fatalf("Inspect: %+v, %v", info, err)
			}
			rec, err := Recover(OS, root, 0)
			if err != nil || !rec.Repaired || filepath.Base(rec.Dir) != "step-000000010" || len(rec.Skipped) != 1 || !strings.Contains(rec.Skipped[0], "step-000000020") {
				t.Fatalf("Recover: %+v, %v", rec, err)
			}
			checkLatest(t, OS, root, testSnapshot(10))
			if _, err := os.Stat(dir20); err != nil {
				t.Fatalf("Recover removed the corrupt step: %v", err)
			}
		})
	}

	t.Run("nothing verifies", func(t *testing.T) {
		root, dir20 := twoCheckpoints(t)
		if err := os.Remove(filepath.Join(root, LatestFile)); err != nil {
			t.Fatal(err)
		}
		for _, d := range []string{dir20, filepath.Join(root, "step-000000010")} {
			modifyFile(t, filepath.Join(d, rank0), func(b []byte) []byte { b[len(b)-1] ^= 1; return b })
		}
		before := rootEntries(t, OS, root)
		if _, err := Recover(OS, root, 0); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "no step directory verifies") {
			t.Fatalf("Recover: %v", err)
		}
		if got := rootEntries(t, OS, root); !slices.Equal(got, before) {
			t.Fatalf("Recover changed the root: %v, was %v", got, before)
		}
	})

	t.Run("latest is a directory", func(t *testing.T) {
		root, _ := twoCheckpoints(t)
		latest := filepath.Join(root, LatestFile)
		if err := os.Remove(latest); err != nil {
			t.Fatal(err)
		}
		if err := os.Mkdir(latest, 0o755); err != nil {
			t.Fatal(err)
		}
		if _, err := Latest(OS, root); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "directory") {
			t.Fatalf("Latest: %v", err)
		}
		if _, err := Recover(OS, root, 0); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "move it away") {
			t.Fatalf("Recover: %v", err)
		}
		if st, err := os.Stat(latest); err != nil || !st.IsDir() {
			t.Fatalf("latest changed: %v", err)
		}
	})
}

// TestSaveNeverReplacesCommitted: a committed step directory (at or below
// latest's step) is never replaced, and a damaged root is never written.
func TestSaveNeverReplacesCommitted(t *testing.T) {
	root := t.TempDir()
	for _, step := range []int64{10, 20, 30} {
		mustSave(t, OS, root, testSnapshot(step))
	}
	s20 := testSnapshot(20)
	s20.Objects["trainer"] = []byte(`{"other": "run"}`)
	if _, err := Save(OS, root, s20); !errors.Is(err, fs.ErrExist) || !strings.Contains(err.Error(), "committed") {
		t.Fatalf("Save over the committed step 20: %v", err)
	}
	checkMatches(t, OS, filepath.Join(root, "step-000000020"), testSnapshot(20))

	// latest removed (or lost): the root's checkpoints are not marked,
	// and a save would adopt them (and retention prune them).
	if err := os.Remove(filepath.Join(root, LatestFile)); err != nil {
		t.Fatal(err)
	}
	for _, step := range []int64{5, 20, 40} {
		if _, err := Save(OS, root, testSnapshot(step)); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "damaged root") {
			t.Fatalf("Save of step %d into a root without latest: %v", step, err)
		}
	}
	if err := Retain(OS, root, 1); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Retain of a damaged root: %v", err)
	}
	for _, step := range []int64{10, 20, 30} {
		checkMatches(t, OS, StepDir(root, step), testSnapshot(step))
	}
	if got := rootEntries(t, OS, root); !slices.Equal(got, []string{"step-000000010", "step-000000020", "step-000000030"}) {
		t.Fatalf("root holds %v", got)
	}
}

// TestLockRefusesBadRoots: a step directory, a file, a path under a file
// are refused by every writer, before anything is written.
func TestLockRefusesBadRoots(t *testing.T) {
	root, dir20 := twoCheckpoints(t)
	before := rootEntries(t, OS, dir20)
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(root, ".tmp-step-000000030-00000000")
	if err := os.Mkdir(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	emptyStep := filepath.Join(root, "step-000000040")
	if err := os.Mkdir(emptyStep, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ path, want string }{
		{dir20, "not a checkpoint root"},
		{emptyStep, "step directory of the checkpoint root"},
		{tmp, "step directory of the checkpoint root"},
		{file, "not a directory"},
		{filepath.Join(file, "sub"), "not a directory"},
	} {
		if l, err := Lock(OS, tc.path); err == nil || !strings.Contains(err.Error(), tc.want) {
			l.Unlock()
			t.Errorf("Lock(%s): %v, want %q", tc.path, err, tc.want)
		}
		if _, err := Save(OS, tc.path, testSnapshot(50)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Save(%s): %v, want %q", tc.path, err, tc.want)
		}
		if e, err := NewEngine(OS, tc.path, EngineOptions{ChunkBytes: 4096, RingBytes: 8192}); err == nil || !strings.Contains(err.Error(), tc.want) {
			e.Close()
			t.Errorf("NewEngine(%s): %v, want %q", tc.path, err, tc.want)
		}
	}
	if got := rootEntries(t, OS, dir20); !slices.Equal(got, before) {
		t.Fatalf("the step directory changed: %v, was %v", got, before)
	}
	if got := rootEntries(t, OS, emptyStep); len(got) != 0 {
		t.Fatalf("a run nested in %s: %v", emptyStep, got)
	}
	checkLatest(t, OS, root, testSnapshot(20))

	// A root that does not exist yet is created, with its parents.
	fresh := filepath.Join(t.TempDir(), "a", "b")
	l, err := Lock(OS, fresh)
	if err != nil {
		t.Fatal(err)
	}
	l.Unlock()
	if got := rootEntries(t, OS, fresh); len(got) != 0 {
		t.Fatalf("Lock left %v in a fresh root", got)
	}
}

// TestLockOneWriter: while a process holds a root's lock, every writer of
// another process is refused with the holder's PID; the kernel releases
// the lock when the holder dies. Within one process the lock is shared.
func TestLockOneWriter(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a process")
	}
	root := filepath.Join(t.TempDir(), "ckpt")
	mustSave(t, OS, root, testSnapshot(1))
	a, err := Lock(OS, root)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Lock(OS, root) // this process again: shared
	if err != nil {
		t.Fatal(err)
	}
	mustSave(t, OS, root, testSnapshot(2))
	a.Unlock()
	b.Unlock()
	b.Unlock() // a second Unlock does nothing

	cmd, pid := lockChild(t, root)
	check := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), pid) {
			t.Errorf("%s while another process holds the lock: %v (want ErrLocked naming %s)", what, err, pid)
		}
	}
	if h := Holder(OS, root); !strings.Contains(h, pid) {
		t.Errorf("Holder: %q, want %s", h, pid)
	}
	_, err = Lock(OS, root)
	check("Lock", err)
	_, err = Save(OS, root, testSnapshot(3))
	check("Save", err)
	_, err = NewEngine(OS, root, EngineOptions{ChunkBytes: 4096, RingBytes: 8192})
	check("NewEngine", err)
	check("Retain", Retain(OS, root, 1))
	checkLatest(t, OS, root, testSnapshot(2))

	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	if h := Holder(OS, root); h != "" {
		t.Errorf("Holder after the holder died: %q", h)
	}
	l, err := Lock(OS, root)
	if err != nil {
		t.Fatalf("Lock after the holder died: %v", err)
	}
	l.Unlock()
	mustSave(t, OS, root, testSnapshot(3))
}

// TestFIFOs: a FIFO in place of latest, latest.tmp, manifest.json or the
// rank file is bad contents, reported at once, never blocked on.
func TestFIFOs(t *testing.T) {
	for _, name := range []string{LatestFile, pendingLatest, ManifestFile, rank0, IndexFile} {
		t.Run(name, func(t *testing.T) {
			root, dir := twoCheckpoints(t)
			path := filepath.Join(root, name)
			if name != LatestFile && name != pendingLatest {
				path = filepath.Join(dir, name)
			}
			os.Remove(path)
			if err := syscall.Mkfifo(path, 0o644); err != nil {
				t.Skipf("mkfifo: %v", err)
			}
			done := make(chan error, 1)
			go func() {
				dir, err := Resolve(OS, root)
				if err == nil {
					err = verifyDir(OS, dir, 0, nil)
				}
				if _, ierr := Inspect(OS, root); ierr != nil && err == nil {
					err = ierr
				}
				done <- err
			}()
			select {
			case err := <-done:
				if name == pendingLatest {
					if err != nil {
						t.Fatalf("a FIFO latest.tmp beside a sound latest: %v", err)
					}
					return
				}
				if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "FIFO") {
					t.Fatalf("%s as a FIFO: %v", name, err)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("%s as a FIFO: blocked", name)
			}
		})
	}
}

// TestRetainLeftovers: Retain retires checkpoints out of the step
// namespace, removes the leftovers of interrupted retirements and the
// incomplete step directories older versions' retention left, and prunes a
// step directory that is a link (the link, not its target).
func TestRetainLeftovers(t *testing.T) {
	root := t.TempDir()
	for _, step := range []int64{1, 2, 3, 4, 5} {
		mustSave(t, OS, root, testSnapshot(step))
	}
	// Step 2 as an older retention's kill left it: no manifest.
	if err := os.Remove(filepath.Join(StepDir(root, 2), ManifestFile)); err != nil {
		t.Fatal(err)
	}
	// Step 3 as a link to a directory elsewhere.
	elsewhere := filepath.Join(t.TempDir(), "s3")
	if err := os.Rename(StepDir(root, 3), elsewhere); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(elsewhere, StepDir(root, 3)); err != nil {
		t.Fatal(err)
	}
	// A retirement cut short.
	retired := filepath.Join(root, retiredPrefix+"step-000000000-12345678")
	if err := os.MkdirAll(filepath.Join(retired, "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	dirs, err := List(OS, root)
	if err != nil || len(dirs) != 4 || dirs[2] != StepDir(root, 3) {
		t.Fatalf("List: %v, %v (want 5, 4, 3 (the link), 1)", dirs, err)
	}
	info, err := Inspect(OS, root)
	if err != nil || len(info.Leftovers) != 1 || len(info.Steps) != 5 || info.Steps[3].Complete {
		t.Fatalf("Inspect: %+v, %v", info, err)
	}
	if err := Retain(OS, root, 2); err != nil {
		t.Fatal(err)
	}
	if got := rootEntries(t, OS, root); !slices.Equal(got, []string{LatestFile, "step-000000004", "step-000000005"}) {
		t.Fatalf("after Retain 2 the root holds %v", got)
	}
	checkMatches(t, OS, elsewhere, testSnapshot(3)) // the link's target stays
}

// TestRetainCrash crashes Retain after each of its operations, and a power
// loss follows: the root then lists whole checkpoints only, each of which
// verifies, and the next save's retention leaves no leftover.
func TestRetainCrash(t *testing.T) {
	base := newMemFS()
	for _, step := range []int64{1, 2, 3, 4} {
		mustSave(t, base, memRoot, testSnapshot(step))
	}
	for i := 0; ; i++ {
		mem := base.crashClone(false)
		efs := newErrorFS(mem)
		efs.crashAt = i
		err := Retain(efs, memRoot, 2)
		if efs.ops <= i {
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("crashed Retain at each of its %d operations", i)
			return
		}
		for _, powerLoss := range []bool{false, true} {
			after := mem.crashClone(powerLoss)
			dirs, err := List(after, memRoot)
			if err != nil || len(dirs) < 2 || len(dirs) > 4 {
				t.Fatalf("crash at op %s: List %v, %v", efs.log[i], dirs, err)
			}
			for _, d := range dirs {
				step, _ := parseStepDirName(filepath.Base(d))
				checkMatches(t, after, d, testSnapshot(step))
			}
			mustSave(t, after, memRoot, testSnapshot(5))
			if err := Retain(after, memRoot, 2); err != nil {
				t.Fatal(err)
			}
			if got := rootEntries(t, after, memRoot); !slices.Equal(got, []string{LatestFile, "step-000000004", "step-000000005"}) {
				t.Fatalf("crash at op %s, then a save and Retain: root holds %v", efs.log[i], got)
			}
		}
	}
}

// TestWritersInOneProcess: writers of one root within a process (two
// goroutines saving, two engines, an engine and Save, Retain) run one
// after the other: no committed checkpoint is ever removed, and latest
// always verifies.
func TestWritersInOneProcess(t *testing.T) {
	root := filepath.Join(t.TempDir(), "ckpt")
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	saveSync := func() {
		for range 15 {
			if _, err := Save(OS, root, testSnapshot(next.Add(1))); err != nil {
				errs <- err
			}
		}
	}
	saveLazy := func() {
		e, err := NewEngine(OS, root, EngineOptions{ChunkBytes: 4096, RingBytes: 8192, Keep: 4})
		if err != nil {
			errs <- err
			return
		}
		defer e.Close()
		for range 15 {
			h, err := e.Save(testSnapshot(next.Add(1)))
			if err == nil {
				_, err = h.Wait()
			}
			if err != nil {
				errs <- err
			}
		}
	}
	wg.Go(saveSync)
	wg.Go(saveSync)
	wg.Go(saveLazy)
	wg.Go(saveLazy)
	wg.Go(func() {
		for range 30 {
			if err := Retain(OS, root, 3); err != nil && !errors.Is(err, ErrNoCheckpoint) {
				errs <- err
			}
		}
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		// A save whose step another writer passed meanwhile may be
		// refused (it would replace a committed checkpoint); nothing else.
		if !errors.Is(err, fs.ErrExist) {
			t.Errorf("a writer failed: %v", err)
		}
	}
	info, err := Inspect(OS, root)
	if err != nil || info.Problem != nil || info.Latest == "" {
		t.Fatalf("Inspect: %+v, %v", info, err)
	}
	for _, s := range info.Steps {
		if !s.Complete {
			t.Errorf("%s is incomplete", s.Dir)
			continue
		}
		if s.Committed {
			checkMatches(t, OS, s.Dir, testSnapshot(s.Step))
		}
	}
}

// TestHostileNames: a FIFO or a link where dos writes latest.tmp or holds
// .lock is never blocked on nor written through.
func TestHostileNames(t *testing.T) {
	outside := filepath.Join(t.TempDir(), "precious")
	if err := os.WriteFile(outside, []byte("precious"), 0o644); err != nil {
		t.Fatal(err)
	}
	timeout := func(what string, f func() error) error {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- f() }()
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: blocked", what)
			return nil
		}
	}
	for _, tc := range []struct {
		name string
		make func(path string) error
	}{
		{"FIFO", func(p string) error { return syscall.Mkfifo(p, 0o644) }},
		{"link outside", func(p string) error { return os.Symlink(outside, p) }},
		{"directory", func(p string) error { return os.MkdirAll(filepath.Join(p, "x"), 0o755) }},
	} {
		t.Run("latest.tmp "+tc.name, func(t *testing.T) {
			root := t.TempDir()
			mustSave(t, OS, root, testSnapshot(1))
			if err := tc.make(filepath.Join(root, pendingLatest)); err != nil {
				t.Fatal(err)
			}
			if err := timeout("Save", func() error { _, err := Save(OS, root, testSnapshot(2)); return err }); err != nil {
				t.Fatal(err)
			}
			checkLatest(t, OS, root, testSnapshot(2))
		})
		t.Run(".lock "+tc.name, func(t *testing.T) {
			root := t.TempDir()
			if err := tc.make(filepath.Join(root, LockFile)); err != nil {
				t.Fatal(err)
			}
			if h := timeout("Holder", func() error { return errors.New(Holder(OS, root)) }); h.Error() != "" {
				t.Errorf("Holder: %q", h)
			}
			err := timeout("Lock", func() error { l, err := Lock(OS, root); l.Unlock(); return err })
			if err == nil || !strings.Contains(err.Error(), "not the root's lock file") {
				t.Errorf("Lock with %s as .lock: %v", tc.name, err)
			}
		})
	}
	if b, err := os.ReadFile(outside); err != nil || string(b) != "precious" {
		t.Fatalf("the file outside the root now holds %q (%v)", b, err)
	}
}

// TestReadersBesideWriter: Latest, Inspect and OpenPath beside a writer
// that commits and retires a checkpoint every few milliseconds never call
// the sound root damaged or the checkpoint corrupt.
func TestReadersBesideWriter(t *testing.T) {
	if testing.Short() {
		t.Skip("a second of saves")
	}
	root := filepath.Join(t.TempDir(), "ckpt")
	mustSave(t, OS, root, testSnapshot(1))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		e, err := NewEngine(OS, root, EngineOptions{ChunkBytes: 4096, RingBytes: 8192, Keep: 1})
		if err != nil {
			t.Error(err)
			return
		}
		defer e.Close()
		for step := int64(2); ; step++ {
			select {
			case <-stop:
				return
			default:
			}
			h, err := e.Save(testSnapshot(step))
			if err == nil {
				_, err = h.Wait()
			}
			if err != nil {
				t.Error(err)
				return
			}
		}
	})
	var reads, bad int
	for end := time.Now().Add(time.Second); time.Now().Before(end); reads++ {
		if _, err := Latest(OS, root); err != nil {
			bad++
			t.Errorf("Latest: %v", err)
		}
		if info, err := Inspect(OS, root); err != nil || info.Problem != nil {
			bad++
			t.Errorf("Inspect: %v, %v", info.Problem, err)
		}
		c, err := OpenPath(OS, root, 0)
		if err == nil {
			err = c.Verify()
			c.Close()
		}
		if err != nil {
			bad++
			t.Errorf("OpenPath and Verify: %v", err)
		}
		if bad > 5 {
			break
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("%d reads beside the writer", reads)
}

// TestRollback: a latest checkpoint that does not verify is set aside
// whole and latest points at the newest that does; a sound root is left
// as it is; a verify function of the caller's decides too.
func TestRollback(t *testing.T) {
	root, dir20 := twoCheckpoints(t)
	if rec, err := Rollback(OS, root, 0, nil); err != nil || rec.Repaired {
		t.Fatalf("Rollback of a sound root: %+v, %v", rec, err)
	}
	modifyFile(t, filepath.Join(dir20, rank0), func(b []byte) []byte { b[len(b)-1] ^= 1; return b })
	rec, err := Rollback(OS, root, 0, nil)
	if err != nil || !rec.Repaired || filepath.Base(rec.Dir) != "step-000000010" || !strings.Contains(rec.Note, "set aside") {
		t.Fatalf("Rollback: %+v, %v", rec, err)
	}
	checkLatest(t, OS, root, testSnapshot(10))
	info, err := Inspect(OS, root)
	if err != nil || len(info.Aside) != 1 || len(info.Steps) != 1 {
		t.Fatalf("Inspect after Rollback: %+v, %v", info, err)
	}
	if _, err := Open(OS, info.Aside[0], 0); err != nil { // kept whole: its bytes are bad, not its files
		t.Fatalf("the set-aside checkpoint: %v", err)
	}
	// The caller's check refuses step 10 too: nothing verifies. Every
	// step directory is set aside whole and latest, which named one, is
	// removed: the root holds no checkpoint (a new run may start there),
	// and the error says so.
	refuse := func(c *Checkpoint) error { return fmt.Errorf("%w: refused", ErrCorrupt) }
	if _, err := Rollback(OS, root, 0, refuse); !errors.Is(err, ErrNoneLeft) || !strings.Contains(err.Error(), "holds no checkpoint now: a new run may start there") ||
		strings.Contains(err.Error(), "left as it is") {
		t.Fatalf("Rollback with nothing that verifies: %v", err)
	}
	info, err = Inspect(OS, root)
	if err != nil || len(info.Aside) != 2 || !info.Fresh() || len(info.Steps) != 0 {
		t.Fatalf("after Rollback set everything aside: %+v, %v", info, err)
	}
	if _, err := os.Stat(filepath.Join(root, LatestFile)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("latest after Rollback set everything aside: %v", err)
	}
	for _, a := range info.Aside {
		if _, err := Open(OS, a, 0); err != nil {
			t.Errorf("the set-aside %s: %v", a, err)
		}
	}
	// Latest missing too, and nothing verifies: the same.
	root2, dir20 := twoCheckpoints(t)
	os.Remove(filepath.Join(root2, LatestFile))
	modifyFile(t, filepath.Join(dir20, rank0), func(b []byte) []byte { b[len(b)-1] ^= 1; return b })
	if _, err := Rollback(OS, root2, 0, func(c *Checkpoint) error {
		if c.Manifest.Step == 10 {
			return fmt.Errorf("%w: refused", ErrCorrupt)
		}
		return c.Verify()
	}); !errors.Is(err, ErrNoneLeft) {
		t.Fatalf("Rollback of a root without latest where nothing verifies: %v", err)
	}
	if info, err := Inspect(OS, root2); err != nil || !info.Fresh() || len(info.Aside) != 2 {
		t.Fatalf("after Rollback: %+v, %v", info, err)
	}
}

// TestObjectStrict: an object decoded into a struct takes its keys exactly
// as the tags spell them, as the manifest does.
func TestObjectStrict(t *testing.T) {
	root := t.TempDir()
	s := testSnapshot(1)
	s.Objects["trainer"] = []byte(`{"iteration": 20, "Iteration": 0}`)
	dir := mustSave(t, OS, root, s)
	c, err := Open(OS, dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var st struct {
		Iteration int `json:"iteration"`
	}
	if err := c.Object("trainer", &st); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), `unknown key "Iteration"`) {
		t.Fatalf("Object with a key in another case: %v (decoded %+v)", err, st)
	}
	var m map[string]any
	if err := c.Object("trainer", &m); err != nil || len(m) != 2 {
		t.Fatalf("Object into a map: %v, %v", m, err)
	}
	var o struct {
		LR    float64    `json:"lr"`
		Betas [2]float64 `json:"betas"`
		T     int        `json:"t"`
	}
	if err := c.Object("optimizer", &o); err != nil || o.T != 1 {
		t.Fatalf("Object of a sound object: %+v, %v", o, err)
	}
}

// TestLockFileRemoved: when the lock file is removed while held (another
// process could lock a new one), the holder refuses to write.
func TestLockFileRemoved(t *testing.T) {
	root := t.TempDir()
	mustSave(t, OS, root, testSnapshot(1))
	l, err := Lock(OS, root)
	if err != nil {
		t.Fatal(err)
	}
	e, err := NewEngine(OS, root, EngineOptions{ChunkBytes: 4096, RingBytes: 8192})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(root, LockFile)); err != nil {
		t.Fatal(err)
	}
	h, err := e.Save(testSnapshot(2))
	if err == nil {
		_, err = h.Wait()
	}
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), "removed or replaced") {
		t.Fatalf("Engine save after the lock file was removed: %v", err)
	}
	checkLatest(t, OS, root, testSnapshot(1))
	// A new writer locks a new lock file; the old holders stay refused.
	mustSave(t, OS, root, testSnapshot(3))
	if err := Retain(OS, root, 1); err != nil {
		t.Fatal(err)
	}
	e.Close()
	l.Unlock()
	checkLatest(t, OS, root, testSnapshot(3))
}

func TestStatsString(t *testing.T) {
	s := Stats{Step: 20, Bytes: 12_600_000, Direct: true, Captured: 3 * time.Millisecond, Durable: 18 * time.Millisecond}
	if got, want := s.String(), "step 20, 12.6 MB, captured in 3ms, durable in 18ms, O_DIRECT"; got != want {
		t.Errorf("%q, want %q", got, want)
	}
}

// TestLatestDuringAnotherFirstCommit: a root without latest but with a
// step directory and latest.tmp, while another live process holds its
// lock, is that process's first commit in progress: no checkpoint yet,
// not damage; once the holder is gone, the same root is damaged.
func TestLatestDuringAnotherFirstCommit(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a process")
	}
	root := filepath.Join(t.TempDir(), "ckpt")
	mustSave(t, OS, root, testSnapshot(1))
	if err := os.Rename(filepath.Join(root, LatestFile), filepath.Join(root, pendingLatest)); err != nil {
		t.Fatal(err)
	}
	cmd, pid := lockChild(t, root)
	_, err := Latest(OS, root)
	if !errors.Is(err, ErrNoCheckpoint) || errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), pid) {
		t.Fatalf("Latest during another process's first commit: %v", err)
	}
	if info, err := Inspect(OS, root); err != nil || info.Problem != nil {
		t.Fatalf("Inspect: %+v, %v", info, err)
	}
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	if _, err := Latest(OS, root); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Latest once the holder died: %v", err)
	}
}

// lockChild starts a process that takes root's lock (TestMain's
// DOS_CKPT_LOCK_CHILD) and returns once it holds it, with "PID n"; the
// process is killed at the test's end.
func lockChild(t *testing.T, root string) (*exec.Cmd, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "DOS_CKPT_LOCK_CHILD="+root)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "locked\n" {
		t.Fatalf("child: %q, %v", line, err)
	}
	return cmd, fmt.Sprintf("PID %d", cmd.Process.Pid)
}

// TestPrepareForkHoldsOffLockFiles: between PrepareFork and ForkDone (a
// binding's fork() in between) no lock file is opened or closed: another
// goroutine's Lock and Unlock wait, so the descriptors PrepareFork returned
// are exactly those held at the fork (the binding adversary's fork race:
// a lock opened in between was left open in the child, pinning its root).
func TestPrepareForkHoldsOffLockFiles(t *testing.T) {
	dir := t.TempDir()
	before := len(HeldLockFDs()) // another test's, if any
	a, err := Lock(OS, filepath.Join(dir, "a"))
	if err != nil {
		t.Fatal(err)
	}
	fds := PrepareFork()
	if !slices.Equal(fds, HeldLockFDs()) || len(fds) != before+1 {
		t.Fatalf("PrepareFork: %v, HeldLockFDs %v: want a's descriptor too", fds, HeldLockFDs())
	}
	locked, unlocked := make(chan *RootLock), make(chan struct{})
	go func() {
		b, err := Lock(OS, filepath.Join(dir, "b"))
		if err != nil {
			t.Error(err)
		}
		locked <- b
	}()
	go func() {
		a.Unlock()
		close(unlocked)
	}()
	select {
	case <-locked:
		t.Fatal("Lock of another root ran between PrepareFork and ForkDone")
	case <-unlocked:
		t.Fatal("Unlock ran between PrepareFork and ForkDone")
	case <-time.After(200 * time.Millisecond):
	}
	if got := HeldLockFDs(); !slices.Equal(got, fds) {
		t.Errorf("HeldLockFDs during the hold: %v, want %v", got, fds)
	}
	ForkDone()
	b := <-locked
	<-unlocked
	if got := HeldLockFDs(); len(got) != before+1 {
		t.Errorf("after ForkDone: HeldLockFDs %v, want b's instead of a's", got)
	}
	b.Unlock()
	if got := HeldLockFDs(); len(got) != before {
		t.Errorf("after b.Unlock: %v", got)
	}
}

// TestUnlockReleasesAForkedChildsCopy: a copy of the lock's descriptor
// (a fork()ed child's, which shares the open file until the child closes
// it, here a dup) does not keep the root locked after Unlock: a new Lock
// takes it at once. The binding's child closes its copies in an after-fork
// hook that may run after the parent has gone on: the parent's next save
// into the root was refused "locked by" itself (1 run in 10 of
// test_roots.py on a busy machine).
func TestUnlockReleasesAForkedChildsCopy(t *testing.T) {
	root := filepath.Join(t.TempDir(), "r")
	before := HeldLockFDs() // another test's, if any
	l, err := Lock(OS, root)
	if err != nil {
		t.Fatal(err)
	}
	var fd int
	for _, f := range HeldLockFDs() {
		if !slices.Contains(before, f) {
			fd = f
		}
	}
	child, err := syscall.Dup(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(child)
	l.Unlock()
	again, err := Lock(OS, root)
	if err != nil {
		t.Fatalf("Lock after Unlock, with a copy of the old descriptor open: %v", err)
	}
	again.Unlock()
}

// TestLockHardLinkedCopy (the job commands' adversary, F5): a root copied
// with cp -al shares its lock file's inode with the original, so a writer
// of one locked both and the copy was refused "locked by" the other's
// writer. Lock refuses such a lock file, naming it and what to do; once
// it is removed, each root has its own lock and both open at once. A
// writer that held its root's lock when the copy was made keeps it, and
// locks it again (its trainer's end of run did: the second adversary of
// the fix, F1).
func TestLockHardLinkedCopy(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	mustSave(t, OS, a, testSnapshot(1))
	held, err := Lock(OS, a)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(b, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(a, LockFile), filepath.Join(b, LockFile)); err != nil {
		t.Fatal(err)
	}
	again, err := Lock(OS, a)
	if err != nil {
		t.Errorf("Lock(%s) again while this process holds it: %v", a, err)
	} else {
		again.Unlock()
	}
	mustSave(t, OS, a, testSnapshot(2))
	held.Unlock()
	for _, root := range []string{a, b} {
		if l, err := Lock(OS, root); err == nil || !strings.Contains(err.Error(), "has 2 hard links: another root shares this lock file") {
			t.Errorf("Lock(%s): %v, want the hard link refused", root, err)
			if err == nil {
				l.Unlock()
			}
		}
	}
	if err := os.Remove(filepath.Join(b, LockFile)); err != nil {
		t.Fatal(err)
	}
	la, err := Lock(OS, a)
	if err != nil {
		t.Fatal(err)
	}
	defer la.Unlock()
	lb, err := Lock(OS, b)
	if err != nil {
		t.Fatal(err)
	}
	lb.Unlock()
	if _, err := os.Stat(filepath.Join(a, "latest")); err != nil {
		t.Errorf("a's checkpoint: %v", err)
	}
}
