package checkpoint

import (
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
)

const memRoot = "/data/ckpt"

// bestEffort reports whether the operation logged as op may fail without
// failing Save: the listing and removal of stale temporary directories, and
// closing latest after reading it.
func bestEffort(op string) bool {
	f := strings.Fields(op)
	return len(f) == 3 && (f[1] == "readdir" ||
		f[1] == "removeall" && strings.Contains(f[2], tmpPrefix) ||
		f[1] == "close" && filepath.Base(f[2]) == LatestFile)
}

// rootEntries lists root's entries, the lock file left out.
func rootEntries(t *testing.T, fsys FS, root string) []string {
	t.Helper()
	entries, err := fsys.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		if e.Name() != LockFile {
			names = append(names, e.Name())
		}
	}
	return names
}

// TestSaveFaultInjection fails operation i of a Save, for i = 0, 1, ...
// until Save succeeds, each time on a fresh copy of a root that holds a
// committed step 10. Every failed Save must return an error naming the step
// and leave step 10 latest and intact, with nothing else left behind; a
// retry must then succeed.
func TestSaveFaultInjection(t *testing.T) {
	modes := []struct {
		name string
		err  error
		torn bool
	}{
		{"EIO", syscall.EIO, false},
		{"ENOSPC-torn", syscall.ENOSPC, true},
	}
	old, new := testSnapshot(10), testSnapshot(20)
	for _, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			base := newMemFS()
			mustSave(t, base, memRoot, old)
			for i := 0; ; i++ {
				if i > 1000 {
					t.Fatal("Save never succeeded")
				}
				mem := base.crashClone(false)
				efs := newErrorFS(mem)
				efs.failAt, efs.injectErr, efs.torn = i, mode.err, mode.torn
				_, err := Save(efs, memRoot, new)
				if efs.injected == "" {
					if err != nil {
						t.Fatalf("Save with no failure injected: %v", err)
					}
					checkLatest(t, mem, memRoot, new)
					// A committed save survives a power loss.
					checkLatest(t, mem.crashClone(true), memRoot, new)
					t.Logf("Save succeeded after failing each of its %d operations in turn", i)
					return
				}
				if err == nil {
					if !bestEffort(efs.injected) {
						t.Fatalf("op %s failed but Save succeeded", efs.injected)
					}
					checkLatest(t, mem, memRoot, new)
					continue
				}
				if !errors.Is(err, mode.err) || !strings.Contains(err.Error(), "step 20") {
					t.Fatalf("op %s failed: Save error %q does not wrap %v or name the step", efs.injected, err, mode.err)
				}
				checkLatest(t, mem, memRoot, old)
				checkLatest(t, mem.crashClone(true), memRoot, old)
				if got, want := rootEntries(t, mem, memRoot), []string{"latest", "step-000000010"}; !slices.Equal(got, want) {
					t.Fatalf("op %s failed: root holds %v, want %v", efs.injected, got, want)
				}
				mustSave(t, mem, memRoot, new)
				checkLatest(t, mem, memRoot, new)
			}
		})
	}
}

// TestSaveFaultInjectionOS does the same on the real file system, in one
// root that accumulates whatever the failed saves leave (until a save
// succeeds despite a failed best-effort operation).
func TestSaveFaultInjectionOS(t *testing.T) {
	root := t.TempDir()
	old, new := testSnapshot(10), testSnapshot(20)
	mustSave(t, OS, root, old)
	for i := 0; ; i++ {
		if i > 1000 {
			t.Fatal("Save never succeeded")
		}
		efs := newErrorFS(OS)
		efs.failAt, efs.injectErr, efs.torn = i, syscall.EIO, i%2 == 1
		_, err := Save(efs, root, new)
		if efs.injected == "" {
			if err != nil {
				t.Fatalf("Save with no failure injected: %v", err)
			}
			checkLatest(t, OS, root, new)
			return
		}
		if err == nil {
			if !bestEffort(efs.injected) {
				t.Fatalf("op %s failed but Save succeeded", efs.injected)
			}
			checkLatest(t, OS, root, new)
			root = t.TempDir() // start over from step 10
			mustSave(t, OS, root, old)
			continue
		}
		if !errors.Is(err, syscall.EIO) {
			t.Fatalf("op %s failed: Save error %v", efs.injected, err)
		}
		checkLatest(t, OS, root, old)
	}
}

// crashCheck checks the state a crash left in fsys: Latest names a
// complete checkpoint, old or new (or none when there was no old one), and
// a new Save then succeeds.
func crashCheck(t *testing.T, fsys FS, root string, old, new *Snapshot, what string) {
	t.Helper()
	// What a resuming trainer does: Recover (a first commit cut short is
	// finished; a sound latest is taken as it is).
	var dir string
	rec, err := Recover(fsys, root, 0)
	if err == nil {
		dir = rec.Dir
		if rec.Repaired && (old != nil || filepath.Base(dir) != stepDirName(new.Step)) {
			t.Fatalf("%s: Recover repaired a root whose latest was sound, or took %s: %+v", what, dir, rec)
		}
	}
	switch {
	case old == nil && errors.Is(err, ErrNoCheckpoint) && !errors.Is(err, ErrCorrupt):
		// Nothing was committed yet.
	case err != nil:
		t.Fatalf("%s: Recover: %v", what, err)
	case filepath.Base(dir) == stepDirName(new.Step):
		checkMatches(t, fsys, dir, new)
	case old != nil && filepath.Base(dir) == stepDirName(old.Step):
		checkMatches(t, fsys, dir, old)
	default:
		t.Fatalf("%s: Latest = %s", what, dir)
	}
	if dirs, err := List(fsys, root); err != nil || len(dirs) > 2 {
		t.Fatalf("%s: List = %v, %v", what, dirs, err)
	}
	// Recovery: the next save of the same step (or, when the crashed one
	// was committed, of a later step) succeeds.
	next := new
	if err == nil && filepath.Base(dir) == stepDirName(new.Step) {
		next = testSnapshot(new.Step + 1)
	}
	mustSave(t, fsys, root, next)
	checkLatest(t, fsys, root, next)
}

// TestSaveCrash stops a Save dead after operation i, for every i: no
// operation from i on takes effect, nor any cleanup. After both a process
// crash (all written data kept) and a power loss (only what was synced
// kept), Latest must give a complete, loadable checkpoint, old or new.
func TestSaveCrash(t *testing.T) {
	for _, first := range []bool{false, true} {
		name := "second save"
		if first {
			name = "first save"
		}
		t.Run(name, func(t *testing.T) {
			var old *Snapshot
			new := testSnapshot(20)
			base := newMemFS()
			if !first {
				old = testSnapshot(10)
				mustSave(t, base, memRoot, old)
			}
			sawNew := false
			for i := 0; ; i++ {
				mem := base.crashClone(false)
				efs := newErrorFS(mem)
				efs.crashAt = i
				_, err := Save(efs, memRoot, new)
				if efs.ops <= i {
					if err != nil {
						t.Fatalf("Save without a crash: %v", err)
					}
					if !sawNew {
						t.Error("no crash left the new checkpoint committed")
					}
					// A committed save survives a power loss.
					checkLatest(t, mem.crashClone(true), memRoot, new)
					t.Logf("crashed at each of %d operations", i)
					return
				}
				if err == nil {
					t.Fatalf("Save succeeded after crashing at op %d", i)
				}
				crashed := efs.log[i]
				for _, powerLoss := range []bool{false, true} {
					after := mem.crashClone(powerLoss)
					what := "process crash at op " + crashed
					if powerLoss {
						what = "power loss at op " + crashed
					}
					if dir, err := Latest(after, memRoot); err == nil && filepath.Base(dir) == stepDirName(new.Step) {
						sawNew = true
					}
					crashCheck(t, after, memRoot, old, new, what)
				}
			}
		})
	}
}

// TestSaveCrashOS crashes a Save on the real file system after each
// operation (a process crash: the kernel keeps what was written) and opens
// the result with OS.
func TestSaveCrashOS(t *testing.T) {
	old, new := testSnapshot(10), testSnapshot(20)
	for i := 0; ; i++ {
		root := filepath.Join(t.TempDir(), "ckpt")
		mustSave(t, OS, root, old)
		efs := newErrorFS(OS)
		efs.crashAt = i
		_, err := Save(efs, root, new)
		if efs.ops <= i {
			if err != nil {
				t.Fatalf("Save without a crash: %v", err)
			}
			return
		}
		if err == nil {
			t.Fatalf("Save succeeded after crashing at op %d", i)
		}
		crashCheck(t, OS, root, old, new, "crash at op "+efs.log[i])
	}
}
