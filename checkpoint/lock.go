package checkpoint

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"syscall"
)

// LockFile is the file in a root that its writer holds locked: an
// exclusive flock(2) taken by Lock, released by the kernel when the
// process ends, however it ends. It holds the holder's PID and command
// line, for the message another writer gets.
const LockFile = ".lock"

// ErrLocked is wrapped by the error of Lock (and of every writer: Save,
// NewEngine, Retain, Recover) when another process holds the root's lock.
var ErrLocked = errors.New("checkpoint: root in use by another writer")

// RootLock is a held lock on a checkpoint root; see Lock.
type RootLock struct {
	root string
	held *heldLock // nil for an FS that cannot lock
	once sync.Once
}

// Lock takes the writer's lock of root, creating root (and its missing
// parents, durably) when it does not exist, and checks that root can hold
// checkpoints: it is a directory, not a step directory of another root
// (one holding manifest.json, or named step-%09d beside a latest file),
// and a directory can be created and removed in it. One process at a time
// may write under a root: Save, Engine (from NewEngine to Close), Retain
// and Recover take the lock, and a trainer takes it for its whole run, so
// that a second trainer on the same root is refused before it trains.
// Within one process the lock is shared (counted): the trainer and its
// engine hold it together; the kernel's lock is released with the last
// Unlock.
//
// Only OS locks against other processes, with flock(2) on root/.lock
// (LockFile); on another FS Lock checks root the same way and serializes
// only this process's writers (an in-memory FS has one process).
//
// Errors: an error wrapping ErrLocked that names the holder's PID and
// command line when another process holds the lock; an error naming root
// and the reason when root is a step directory, not a directory, or not
// writable (a read-only mount, a path under a file); an I/O error.
func Lock(fsys FS, root string) (*RootLock, error) { return lockRoot(fsys, root, true) }

// lockRoot is Lock; with probe it also tries creating a directory in root.
func lockRoot(fsys FS, root string, probe bool) (*RootLock, error) {
	if err := checkRootPath(fsys, root); err != nil {
		return nil, err
	}
	if err := createDurably(fsys, root); err != nil {
		return nil, fmt.Errorf("checkpoint: root %s: cannot create it: %w", root, err)
	}
	if st, err := fsys.Stat(root); err != nil {
		return nil, fmt.Errorf("checkpoint: root %s: %w", root, err)
	} else if !st.IsDir() {
		return nil, fmt.Errorf("checkpoint: root %s is not a directory", root)
	}
	l := &RootLock{root: root}
	var first bool
	var err error
	if _, ok := fsys.(osFS); ok {
		l.held, first, err = lockOS(filepath.Join(root, LockFile))
	} else {
		l.held, first = lockMem(fsys, root)
	}
	if err != nil {
		return nil, err
	}
	if !probe || !first { // a holder in this process checked root already
		return l, nil
	}
	// A save creates directories in root: try one now, not at the first
	// checkpoint hours into a run.
	dir := filepath.Join(root, fmt.Sprintf("%sprobe-%08x", tmpPrefix, rand.Uint32()))
	if err := fsys.MkdirAll(dir, 0o755); err != nil {
		l.Unlock()
		return nil, fmt.Errorf("checkpoint: root %s is not writable: %w", root, err)
	}
	if err := fsys.RemoveAll(dir); err != nil {
		l.Unlock()
		return nil, fmt.Errorf("checkpoint: root %s: removing %s: %w", root, dir, err)
	}
	return l, nil
}

// beginWrite serializes the writers of one root within this process (two
// engines, an engine and Save, ...): from a save's begin to its commit and
// retention, or a repair, no other writer of this process runs. Across
// processes the kernel's lock does.
//
// It also checks that the lock file is still the one this process locked:
// a lock file removed or replaced while held (by hand, or by a cleanup)
// lets another process lock a new one, and this process then refuses to
// write rather than mix two runs' checkpoints.
func (l *RootLock) beginWrite() error {
	h := l.held
	if h == nil {
		return nil
	}
	h.write.Lock()
	if h.f == nil {
		return nil
	}
	st, err := os.Stat(h.f.Name())
	if err == nil {
		if key, ok := keyOf(st); ok && key == h.key {
			return nil
		}
	}
	h.write.Unlock()
	return fmt.Errorf("%w: %s was removed or replaced while this process held it (%v): another process may write there now; refusing to write", ErrLocked, h.f.Name(), cmp.Or[any](err, "another file"))
}

func (l *RootLock) endWrite() {
	if l.held != nil {
		l.held.write.Unlock()
	}
}

// Unlock releases the lock (the kernel's, when no other holder in this
// process remains). Later calls do nothing.
func (l *RootLock) Unlock() {
	if l == nil {
		return
	}
	l.once.Do(func() {
		if l.held != nil {
			l.held.release()
		}
	})
}

// checkRootPath refuses a root that is a checkpoint's step directory: one
// holding manifest.json, or a step-%09d (or temporary) directory whose
// parent is a root. Saving into it would nest a run inside a checkpoint.
func checkRootPath(fsys FS, root string) error {
	switch _, err := fsys.Stat(filepath.Join(root, ManifestFile)); {
	case err == nil:
		parent := filepath.Dir(filepath.Clean(root))
		if job := filepath.Dir(parent); strings.HasPrefix(filepath.Base(parent), "rank-") && IsJob(fsys, job) {
			return fmt.Errorf("checkpoint: %s holds %s: it is one rank's checkpoint of the job %s (a step directory in its rank root %s), not a checkpoint root; pass the job's root %s", root, ManifestFile, job, parent, job)
		}
		return fmt.Errorf("checkpoint: %s holds %s: it is a checkpoint (a step directory), not a checkpoint root; pass its parent %s", root, ManifestFile, parent)
	case errors.Is(err, errNotDir):
		if st, serr := fsys.Stat(root); serr == nil && !st.IsDir() {
			return fmt.Errorf("checkpoint: root %s is a file, not a directory", root)
		}
		return fmt.Errorf("checkpoint: root %s is under a file, not a directory: %w", root, err)
	case !errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("checkpoint: root %s: %w", root, err)
	}
	base, parent := filepath.Base(filepath.Clean(root)), filepath.Dir(filepath.Clean(root))
	_, isStep := parseStepDirName(base)
	if !isStep && !strings.HasPrefix(base, tmpPrefix) {
		return nil
	}
	for _, name := range []string{LatestFile, pendingLatest} {
		switch _, err := fsys.Stat(filepath.Join(parent, name)); {
		case err == nil:
			return fmt.Errorf("checkpoint: %s is a step directory of the checkpoint root %s, not a root; pass %s", root, parent, parent)
		case !errors.Is(err, fs.ErrNotExist):
			return fmt.Errorf("checkpoint: root %s: %w", root, err)
		}
	}
	return nil
}

// Holder returns who holds root's lock ("PID n (command line)"), or ""
// when no process does, root has no lock file, or fsys cannot lock. It
// takes no lock and changes nothing: a reader (dos ckpt ls) tells a save
// in progress from a crashed one's leftover with it.
func Holder(fsys FS, root string) string {
	if _, ok := fsys.(osFS); !ok {
		return ""
	}
	forkMu.RLock() // its shared lock, until the close, is one a fork()ed child must not inherit
	defer forkMu.RUnlock()
	f, err := os.OpenFile(filepath.Join(root, LockFile), os.O_RDONLY|noFollow|syscall.O_NONBLOCK, 0)
	if err != nil {
		return ""
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		return ""
	}
	if err := tryShared(f); !errors.Is(err, errWouldBlock) {
		return "" // free (a shared lock taken is released with f)
	}
	if h, err := readHolder(f); err == nil && h != "" {
		return h
	}
	return "an unknown process"
}

// heldLock is this process's hold on one root: the kernel lock on its lock
// file (nil f for an FS that cannot lock), shared by the process's holders,
// and the mutex that serializes their writes.
type heldLock struct {
	key   any
	f     *os.File
	refs  int
	write sync.Mutex
}

var (
	locksMu sync.Mutex
	locks   = map[any]*heldLock{} // by fileKey (OS) or memKey

	// forkMu is read-held from a lock file's open to its registration in
	// locks (or its close), and across its close, and write-held by
	// PrepareFork until ForkDone: a fork() in between sees exactly the
	// descriptors HeldLockFDs lists, never one being opened or closed.
	forkMu sync.RWMutex
)

// memKey identifies a root of an FS that cannot lock.
type memKey struct {
	fs   FS
	root string
}

// lockMem is lockOS for an FS without locking: nothing is locked against
// other processes, but this process's writers of root are serialized. An
// FS that is not comparable is not serialized at all.
func lockMem(fsys FS, root string) (*heldLock, bool) {
	if !reflect.TypeOf(fsys).Comparable() {
		return nil, true
	}
	key := memKey{fsys, filepath.Clean(root)}
	locksMu.Lock()
	defer locksMu.Unlock()
	if h := locks[key]; h != nil {
		h.refs++
		return h, false
	}
	h := &heldLock{key: key, refs: 1}
	locks[key] = h
	return h, true
}

// lockOS locks the file name for this process (counted) and reports
// whether this call took the kernel's lock.
func lockOS(name string) (*heldLock, bool, error) {
	forkMu.RLock()
	defer forkMu.RUnlock()
	// Never through a link (its target would be truncated), never blocking
	// on a FIFO.
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|noFollow|syscall.O_NONBLOCK, 0o644)
	if err != nil {
		if st, lerr := os.Lstat(name); lerr == nil && !st.Mode().IsRegular() {
			kind := FileKind(st.Mode())
			if st.Mode()&fs.ModeSymlink != 0 {
				kind = "symbolic link"
			}
			return nil, false, fmt.Errorf("checkpoint: %s is a %s, not the root's lock file: remove it", name, kind)
		}
		if errors.Is(err, fs.ErrPermission) || isReadOnly(err) {
			return nil, false, fmt.Errorf("checkpoint: root %s is not writable: %w", filepath.Dir(name), err)
		}
		return nil, false, fmt.Errorf("checkpoint: root %s: %w", filepath.Dir(name), err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, false, fmt.Errorf("checkpoint: %w", err)
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, false, fmt.Errorf("checkpoint: %s is a %s, not the root's lock file: remove it", name, FileKind(st.Mode()))
	}
	key, ok := keyOf(st)
	locksMu.Lock()
	defer locksMu.Unlock()
	if h := locks[key]; ok && h != nil {
		f.Close()
		h.refs++
		return h, false, nil
	}
	if n := links(st); n > 1 {
		// One lock for two roots (a copy made with cp -al, rsnapshot):
		// a writer of either would lock both, and rewrite the other's
		// holder text.
		f.Close()
		return nil, false, fmt.Errorf("checkpoint: %s has %d hard links: another root shares this lock file (a copy made with cp -al or rsnapshot?), and a lock shared by two roots locks both; remove it (rm %s: the next writer makes its own; the checkpoints are not touched) and run again", name, n, ShellQuote(name))
	}
	if err := flock(f); err != nil {
		holder := "unknown"
		if b, rerr := readHolder(f); rerr == nil && len(b) > 0 {
			holder = b
		}
		f.Close()
		if errors.Is(err, errWouldBlock) {
			return nil, false, fmt.Errorf("%w: %s is locked by %s; one writer per root: stop it, or choose another directory", ErrLocked, filepath.Dir(name), holder)
		}
		return nil, false, fmt.Errorf("checkpoint: locking %s: %w", name, err)
	}
	// Best effort: the PID is for the other writer's message only.
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(holderLine()), 0)
	}
	h := &heldLock{key: key, f: f, refs: 1}
	if ok {
		locks[key] = h
	}
	return h, true, nil
}

func (h *heldLock) release() {
	forkMu.RLock()
	defer forkMu.RUnlock()
	locksMu.Lock()
	defer locksMu.Unlock()
	h.refs--
	if h.refs > 0 {
		return
	}
	if locks[h.key] == h {
		delete(locks, h.key)
	}
	if h.f != nil {
		// Unlocked first, not by the close alone: the kernel releases a
		// flock(2) lock at the last close of its open file, and a fork()ed
		// child shares that file until it closes its copy (the binding's
		// child does so in its after-fork hook, which may run after this
		// process has gone on: a save into the root just after a fork was
		// refused, "locked by" this process, 1 run in 10 on a busy machine).
		_ = funlock(h.f)
		_ = h.f.Close()
	}
}

// holderLine describes this process for the lock file.
func holderLine() string {
	cmd := strings.Join(os.Args, " ")
	if len(cmd) > 200 {
		cmd = cmd[:200] + "..."
	}
	return fmt.Sprintf("PID %d (%s)\n", os.Getpid(), cmd)
}

// readHolder reads the holder's line from an open lock file.
func readHolder(f *os.File) (string, error) {
	b := make([]byte, 512)
	n, err := f.ReadAt(b, 0)
	if n == 0 {
		return "", err
	}
	return strings.TrimSpace(string(b[:n])), nil
}

// HeldLockFDs returns the file descriptors of the root locks this process
// holds (Lock's, on the OS file system). flock(2) locks belong to the open
// file, which a fork()ed child shares: the last Unlock releases the lock
// for the child's copy too (LOCK_UN), but a child that never writes a root
// (a data-loader worker) would hold it past this process's end, until the
// child ends. A binding that lets its users fork closes these descriptors
// in the child (Python's os.register_at_fork), which leaves this process's
// lock as it is.
func HeldLockFDs() []int {
	locksMu.Lock()
	defer locksMu.Unlock()
	return heldLockFDs()
}

// PrepareFork returns HeldLockFDs and, until ForkDone, holds off every
// open and close of a root's lock file in this process (other goroutines'
// Lock, Unlock and Holder wait): a binding calls it just before fork()
// (Python's os.register_at_fork before hook) and ForkDone just after, in
// the parent, so that the child closes exactly the lock descriptors this
// process held at the fork, never one opened in between (which the child
// would keep, pinning the root) nor a number closed and reused meanwhile.
// The child calls neither: Go's runtime does not survive fork().
func PrepareFork() []int {
	forkMu.Lock()
	locksMu.Lock()
	defer locksMu.Unlock()
	return heldLockFDs()
}

// ForkDone ends PrepareFork's hold, in the parent after fork().
func ForkDone() { forkMu.Unlock() }

// heldLockFDs is HeldLockFDs; hold locksMu.
func heldLockFDs() []int {
	var fds []int
	for _, h := range locks {
		if h != nil && h.f != nil {
			fds = append(fds, int(h.f.Fd()))
		}
	}
	return fds
}
