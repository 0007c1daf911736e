package checkpoint

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
)

// errNotDir is what stat says of a path under a regular file.
var errNotDir error = syscall.ENOTDIR

// ErrNoCheckpoint is wrapped by the error of Latest, Resolve and Recover
// for a root that holds no checkpoint at all: it does not exist, or holds
// neither latest nor latest.tmp nor any step directory. It wraps
// fs.ErrNotExist. A damaged root (step directories without a usable
// latest) gives ErrCorrupt instead, never this.
var ErrNoCheckpoint error = noCheckpoint{}

type noCheckpoint struct{}

func (noCheckpoint) Error() string { return "no checkpoint" }
func (noCheckpoint) Unwrap() error { return fs.ErrNotExist }

// Latest returns the directory of the committed checkpoint that root/latest
// names, as root/step-%09d.
//
// Errors: an error wrapping ErrNoCheckpoint (and so fs.ErrNotExist) when
// root does not exist or holds no checkpoint (no latest, no latest.tmp, no
// step directory: nothing was ever committed there); an error wrapping
// ErrCorrupt when latest is not a regular file, does not hold a step
// directory's name, names a directory without manifest.json, or is missing
// while step directories or latest.tmp exist (a first commit interrupted,
// or latest removed: Recover repairs it), so that a caller never mistakes
// a damaged root for a fresh start; or an I/O error. While another live
// process holds the root's lock (Holder), a missing latest beside step
// directories is its first commit in progress: ErrNoCheckpoint, saying so.
// Temporary directories of saves that crashed are never returned.
//
// A writer may move latest and retire the checkpoint it named while Latest
// reads: Latest then reads latest again (up to 8 times) rather than report a
// sound root as damaged.
func Latest(fsys FS, root string) (string, error) {
	for try := 0; ; try++ {
		name, _, err := readLatest(fsys, root)
		if err != nil {
			return "", err
		}
		dir := filepath.Join(root, name)
		st, err := fsys.Stat(filepath.Join(dir, ManifestFile))
		if err == nil && st.Mode().IsRegular() {
			return dir, nil
		}
		if again, _, aerr := readLatest(fsys, root); try < 8 && aerr == nil && again != name {
			continue // latest moved meanwhile
		}
		switch {
		case err == nil:
			return "", fmt.Errorf("%w: %s names %s, whose %s is a %s", ErrCorrupt, filepath.Join(root, LatestFile), name, ManifestFile, FileKind(st.Mode()))
		case errors.Is(err, fs.ErrNotExist) || errors.Is(err, errNotDir):
			return "", fmt.Errorf("%w: %s names %s, which is not a complete checkpoint (%v)", ErrCorrupt, filepath.Join(root, LatestFile), name, err)
		}
		return "", fmt.Errorf("checkpoint: %w", err)
	}
}

// readLatest reads root/latest and returns the directory name it holds and
// its step.
func readLatest(fsys FS, root string) (string, int64, error) {
	if err := jobRoot(fsys, root); err != nil {
		return "", 0, err
	}
	path := filepath.Join(root, LatestFile)
	b, err := readSmallFile(fsys, path, 4096)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if damage := unmarkedCheckpoints(fsys, root); damage != "" {
				// Another live process holds the root: it is committing
				// its first checkpoint (a writer refuses a damaged root,
				// and a crashed one holds no lock). Not damage, not yet a
				// checkpoint.
				if h := Holder(fsys, root); h != "" && !strings.HasPrefix(h, fmt.Sprintf("PID %d ", os.Getpid())) {
					return "", 0, fmt.Errorf("checkpoint: %s: %s is committing its first checkpoint (%s): %w", root, h, damage, ErrNoCheckpoint)
				}
				return "", 0, fmt.Errorf("%w: %s has no %s, but holds %s: a first commit was interrupted or %s was removed; recovery (Recover: dos ckpt recover %s, or dos train --resume) points it at the newest step directory that verifies",
					ErrCorrupt, root, LatestFile, damage, LatestFile, ShellQuote(root))
			}
			return "", 0, fmt.Errorf("checkpoint: %s: %w", root, ErrNoCheckpoint)
		}
		if errors.Is(err, ErrCorrupt) {
			return "", 0, err
		}
		return "", 0, fmt.Errorf("checkpoint: reading %s: %w", path, err)
	}
	name := strings.TrimSpace(string(b))
	step, ok := parseStepDirName(name)
	if !ok {
		return "", 0, fmt.Errorf("%w: %s holds %.40q, not a step-%%09d directory name", ErrCorrupt, path, name)
	}
	return name, step, nil
}

// unmarkedCheckpoints describes what in root says that checkpoints were
// written there although latest is missing ("" when nothing does).
func unmarkedCheckpoints(fsys FS, root string) string {
	entries, err := fsys.ReadDir(root)
	if err != nil {
		return ""
	}
	var steps []string
	pending := false
	for _, e := range entries {
		if _, ok := parseStepDirName(e.Name()); ok {
			steps = append(steps, e.Name())
		}
		pending = pending || e.Name() == pendingLatest
	}
	var parts []string
	switch len(steps) {
	case 0:
	case 1:
		parts = append(parts, "the step directory "+steps[0])
	default:
		parts = append(parts, fmt.Sprintf("%d step directories (%s ... %s)", len(steps), steps[0], steps[len(steps)-1]))
	}
	if pending {
		parts = append(parts, pendingLatest)
	}
	return strings.Join(parts, " and ")
}

// pendingLatest is the file that moveLatest renames over latest.
const pendingLatest = LatestFile + ".tmp"

// RootInfo describes a checkpoint root as Inspect found it.
type RootInfo struct {
	Root string
	// Latest is the committed checkpoint latest names (root/step-%09d),
	// "" when there is none or latest cannot be trusted.
	Latest string
	// Problem, when not nil, says why the root is damaged (it wraps
	// ErrCorrupt, as Latest's error): latest is missing while step
	// directories exist, or it is not a regular file, or it does not name
	// a complete step directory. Recover repairs it.
	Problem error
	// Pending is the step directory that latest.tmp names, when it exists
	// and holds a step directory's name: left by a commit interrupted
	// between writing latest.tmp and renaming it over latest.
	Pending string
	// Steps are the step-%09d entries of root, newest step first.
	Steps []StepInfo
	// Leftovers are the temporary entries (.tmp-*) that crashed saves and
	// interrupted retirements left: never loaded, removed by the next save
	// or Retain.
	Leftovers []string
	// Aside are the checkpoints that Rollback set aside (damaged-step-*):
	// kept whole for inspection, never loaded or removed.
	Aside []string
}

// StepInfo is one step-%09d entry of a root.
type StepInfo struct {
	Dir  string // root/step-%09d
	Step int64
	// Complete: the entry is a directory (or a link to one) holding
	// manifest.json, which a save writes last.
	Complete bool
	// Committed: complete and not above latest's step, so List lists it.
	// A complete directory above latest was left by a save that crashed
	// before moving latest (or latest was moved back): the next save of
	// its step replaces it.
	Committed bool
}

// Fresh reports whether the root holds no checkpoint and no trace of one:
// a trainer may start there from scratch.
func (r *RootInfo) Fresh() bool { return r.Latest == "" && r.Problem == nil }

// Inspect describes root without changing it: the committed latest, why
// the root is damaged if it is, and every step directory and leftover.
// A root that does not exist is fresh.
//
// Errors: root is not a directory; an I/O error. Bad contents are not
// errors: they are RootInfo.Problem.
//
// A writer may change root while Inspect reads it: when latest moved
// meanwhile, Inspect reads root again (up to 8 times), so that a reader
// beside a trainer does not see a retired checkpoint as a leftover.
func Inspect(fsys FS, root string) (*RootInfo, error) {
	for try := 0; ; try++ {
		before, _ := readSmallFile(fsys, filepath.Join(root, LatestFile), 4096)
		info, err := inspect(fsys, root)
		after, _ := readSmallFile(fsys, filepath.Join(root, LatestFile), 4096)
		if err == nil && !bytes.Equal(before, after) && try < 8 {
			continue
		}
		return info, err
	}
}

func inspect(fsys FS, root string) (*RootInfo, error) {
	if err := jobRoot(fsys, root); err != nil {
		return nil, err
	}
	info := &RootInfo{Root: root}
	entries, err := fsys.ReadDir(root)
	if errors.Is(err, fs.ErrNotExist) {
		return info, nil
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint: listing %s: %w", root, err)
	}
	latestStep := int64(-1)
	switch dir, err := Latest(fsys, root); {
	case err == nil:
		info.Latest = dir
		latestStep, _ = parseStepDirName(filepath.Base(dir))
	case errors.Is(err, ErrCorrupt):
		info.Problem = err
	case !errors.Is(err, ErrNoCheckpoint):
		return nil, err
	}
	for _, e := range entries {
		name := e.Name()
		path := filepath.Join(root, name)
		if strings.HasPrefix(name, tmpPrefix) {
			info.Leftovers = append(info.Leftovers, path)
			continue
		}
		if strings.HasPrefix(name, asidePrefix) {
			info.Aside = append(info.Aside, path)
			continue
		}
		if name == pendingLatest {
			if b, err := readSmallFile(fsys, path, 4096); err == nil {
				if _, ok := parseStepDirName(strings.TrimSpace(string(b))); ok {
					info.Pending = filepath.Join(root, strings.TrimSpace(string(b)))
				}
			}
			continue
		}
		step, ok := parseStepDirName(name)
		if !ok {
			continue
		}
		s := StepInfo{Dir: path, Step: step}
		switch err := stepComplete(fsys, path); {
		case err == nil:
			s.Complete = true
		case !errors.Is(err, errIncomplete):
			return nil, fmt.Errorf("checkpoint: listing %s: %w", root, err)
		}
		s.Committed = s.Complete && latestStep >= 0 && step <= latestStep
		info.Steps = append(info.Steps, s)
	}
	slices.SortFunc(info.Steps, func(a, b StepInfo) int { return cmp.Compare(b.Step, a.Step) })
	return info, nil
}

// List returns the committed checkpoint directories under root, newest
// step first, as root/step-%09d: the directory latest names and every
// complete step directory (one holding manifest.json, a directory or a
// link to one) of an earlier step. Directories of a later step than
// latest's are not committed (a save crashed before moving latest, or
// latest was moved back by a save of an earlier step) and are left out, as
// are temporary directories. List does not open or verify the checkpoints.
//
// Errors: none when root holds no checkpoint (ErrNoCheckpoint: the list is
// then empty); those of Latest for a damaged root; an I/O error.
func List(fsys FS, root string) ([]string, error) {
	info, err := Inspect(fsys, root)
	if err != nil {
		return nil, err
	}
	if info.Problem != nil {
		return nil, info.Problem
	}
	var out []string
	for _, s := range info.Steps {
		if s.Committed {
			out = append(out, s.Dir)
		}
	}
	return out, nil
}

// StepDir returns the directory that Save commits step to under root:
// root/step-%09d.
func StepDir(root string, step int64) string { return filepath.Join(root, stepDirName(step)) }

// Resolve returns the checkpoint directory that path means: path itself
// when it is a checkpoint (it holds manifest.json), else the latest
// committed checkpoint of path as a root.
//
// Errors: an error wrapping fs.ErrNotExist when path does not exist, or
// ErrNoCheckpoint when it is neither a checkpoint nor a root holding one;
// those of Latest for a damaged root.
func Resolve(fsys FS, path string) (string, error) {
	st, err := fsys.Stat(path)
	if err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	if !st.IsDir() {
		return "", fmt.Errorf("checkpoint: %s is not a directory (want a checkpoint root or a step directory)", path)
	}
	if _, err := fsys.Stat(filepath.Join(path, ManifestFile)); err == nil {
		return path, nil
	}
	dir, err := Latest(fsys, path)
	if errors.Is(err, ErrNoCheckpoint) {
		return "", fmt.Errorf("checkpoint: %s is neither a checkpoint (no %s) nor a root holding one (no %s): %w", path, ManifestFile, LatestFile, ErrNoCheckpoint)
	}
	return dir, err
}

// OpenPath opens rank's checkpoint at path, a step directory or a root
// (Resolve), for a reader: when path is a root whose writer moves latest
// and retires the checkpoint between Resolve and Open, it resolves again
// (up to 8 times), so that a reader beside a trainer with retention is not
// told that a sound root is corrupt. Once open, the checkpoint's files
// stay readable even if retention removes them.
//
// Errors: those of Resolve and Open.
func OpenPath(fsys FS, path string, rank int) (*Checkpoint, error) {
	for try := 0; ; try++ {
		dir, err := Resolve(fsys, path)
		if err != nil {
			return nil, err
		}
		c, err := Open(fsys, dir, rank)
		if err == nil {
			return c, nil
		}
		if again, rerr := Resolve(fsys, path); try == 8 || dir == path || rerr != nil || again == dir {
			return nil, err
		}
	}
}

// Recovery is what Recover found and did.
type Recovery struct {
	// Dir is the checkpoint latest names after Recover: the one to resume.
	Dir string
	// Repaired: latest was missing or damaged and Recover pointed it at
	// Dir; Note says why and how.
	Repaired bool
	Note     string
	// Skipped are the complete step directories newer than Dir that did
	// not verify, each with the reason.
	Skipped []string
	// SetAside names the step directories Rollback set aside besides
	// latest's ("NAME as PATH"): the newer ones Skipped for damage.
	SetAside []string
}

// Recover returns the checkpoint to resume from under root, repairing a
// damaged root first. A sound root's latest is returned as it is. When
// latest is missing (a first commit interrupted between writing
// latest.tmp and renaming it, or latest removed), empty, garbage, or names
// an incomplete directory, Recover takes the newest complete step
// directory whose rank file opens and verifies (every CRC32C; rank as in
// Open) and moves latest to it by the commit protocol's own steps
// (latest.tmp written and synced, renamed, root synced): when latest.tmp
// named that directory, this finishes the interrupted commit. Nothing is
// removed. It holds the root's lock (Lock) while it repairs.
//
// Errors: ErrNoCheckpoint when root holds no checkpoint; an error wrapping
// ErrCorrupt when the root is damaged and no step directory verifies, or
// latest is not a regular file (a directory or a FIFO: Recover does not
// remove it), the root then left as it was; those of Lock; an I/O error.
func Recover(fsys FS, root string, rank int) (*Recovery, error) {
	info, err := Inspect(fsys, root)
	if err != nil {
		return nil, err
	}
	if info.Latest != "" {
		return &Recovery{Dir: info.Latest}, nil
	}
	if info.Problem == nil {
		return nil, fmt.Errorf("checkpoint: %s: %w", root, ErrNoCheckpoint)
	}
	var rec *Recovery
	err = writing(fsys, root, func() error {
		info, err := Inspect(fsys, root) // again, now that no one else writes
		if err == nil {
			rec, err = recoverLocked(fsys, root, rank, info, nil, false)
		}
		return err
	})
	return rec, err
}

// writing runs fn holding root's lock and its write (Lock, beginWrite):
// no other writer, of this process or another, runs meanwhile.
func writing(fsys FS, root string, fn func() error) error {
	lock, err := lockRoot(fsys, root, false)
	if err != nil {
		return err
	}
	defer lock.Unlock()
	if err := lock.beginWrite(); err != nil {
		return err
	}
	defer lock.endWrite()
	return fn()
}

// Rollback is Recover for a root whose latest names a checkpoint that does
// not open or verify (a bit flipped on disk, a file lost): that checkpoint
// is set aside, whole, as root/damaged-step-%09d-<unix seconds> (out of the
// step namespace: never loaded, listed or removed by dos), and latest is
// pointed at the newest complete step directory that verifies, as Recover
// does. A damaged root is recovered as Recover would; a sound root whose
// latest checkpoint verifies is left as it is (Repaired false). It holds
// the root's lock. verify checks an opened checkpoint (nil: its Verify, the
// CRC32C of every tensor; offload.VerifyCheckpoint also checks the
// optimizer state's values), for latest's and for the candidates.
//
// When no step directory verifies (every one damaged, or there is no
// other), Rollback sets every step directory aside as
// root/damaged-step-%09d-<unix seconds>, whole, and removes latest (and
// latest.tmp), which named one of them: the root then holds no checkpoint
// and a new run may start there; the error wraps ErrNoneLeft and says so.
//
// Errors: those of Recover; ErrNoneLeft (wrapped), as above; when a step
// directory could not be read (an I/O error, not damage), Recover's
// ErrCorrupt, the other step directories left where they are.
func Rollback(fsys FS, root string, rank int, verify func(*Checkpoint) error) (*Recovery, error) {
	var rec *Recovery
	err := writing(fsys, root, func() (err error) {
		rec, err = rollback(fsys, root, rank, verify)
		return err
	})
	return rec, err
}

// rollback is Rollback for a caller that holds the root's lock and its
// write.
func rollback(fsys FS, root string, rank int, verify func(*Checkpoint) error) (*Recovery, error) {
	info, err := Inspect(fsys, root)
	if err != nil {
		return nil, err
	}
	if info.Latest == "" {
		if info.Problem == nil {
			return nil, fmt.Errorf("checkpoint: %s: %w", root, ErrNoCheckpoint)
		}
		rec, err := recoverLocked(fsys, root, rank, info, verify, true)
		var nv *noneVerifies
		if errors.As(err, &nv) {
			return nil, noneLeftIn(fsys, root, fmt.Sprintf("%v, and no step directory verifies (%s)", info.Problem, nv.why))
		}
		return rec, err
	}
	verr := verifyDir(fsys, info.Latest, rank, verify)
	if verr == nil {
		return &Recovery{Dir: info.Latest}, nil
	}
	if !errors.Is(verr, ErrCorrupt) && !errors.Is(verr, fs.ErrNotExist) {
		return nil, verr // an I/O error says nothing about the checkpoint
	}
	name := filepath.Base(info.Latest)
	aside := asideName(fsys, root, name)
	if err := fsys.Rename(info.Latest, aside); err != nil {
		return nil, fmt.Errorf("checkpoint: setting %s aside: %w", info.Latest, err)
	}
	if err := fsys.SyncDir(root); err != nil {
		return nil, fmt.Errorf("checkpoint: setting %s aside: fsync %s: %w", info.Latest, root, err)
	}
	if info, err = Inspect(fsys, root); err != nil {
		return nil, err
	}
	rec, err := recoverLocked(fsys, root, rank, info, verify, true)
	var nv *noneVerifies
	if errors.As(err, &nv) {
		why := fmt.Sprintf("%s did not verify (%v): set aside as %s", name, verr, aside)
		if len(info.Steps) > 0 {
			why += fmt.Sprintf("; and no other step directory verifies (%s)", nv.why)
		}
		return nil, noneLeftIn(fsys, root, why)
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint: %s did not verify (%v) and was set aside as %s: %w", name, verr, aside, err)
	}
	rec.Note = fmt.Sprintf("%s did not verify (%v): set aside as %s; latest now names %s, the newest step directory that verifies", name, verr, aside, filepath.Base(rec.Dir))
	if len(rec.SetAside) > 0 {
		rec.Note += fmt.Sprintf("; the newer ones that did not verify were set aside too, whole: %s", strings.Join(rec.SetAside, ", "))
	}
	return rec, nil
}

// recoverLocked is Recover's repair, for a caller that holds the root's
// lock and its write.
// With aside (Rollback), the complete step directories newer than the one
// taken that failed to verify for damage are set aside too, whole, as
// Rollback sets latest's aside: left in place they would sit above latest,
// where the next save of their step replaces them.
func recoverLocked(fsys FS, root string, rank int, info *RootInfo, verify func(*Checkpoint) error, aside bool) (*Recovery, error) {
	if info.Latest != "" {
		return &Recovery{Dir: info.Latest}, nil
	}
	latestPath := filepath.Join(root, LatestFile)
	if st, err := fsys.Stat(latestPath); err == nil && !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s is a %s, not a file: move it away (Recover replaces only a file)", ErrCorrupt, latestPath, FileKind(st.Mode()))
	}
	rec := &Recovery{}
	var chosen *StepInfo
	damage := true       // every failure says the checkpoint is bad, not the disk
	var damaged []string // the skipped step directories that failed for damage
	for i, s := range info.Steps {
		if !s.Complete {
			continue
		}
		if err := verifyDir(fsys, s.Dir, rank, verify); err != nil {
			rec.Skipped = append(rec.Skipped, fmt.Sprintf("%s: %v", filepath.Base(s.Dir), err))
			bad := errors.Is(err, ErrCorrupt) || errors.Is(err, fs.ErrNotExist)
			damage = damage && bad
			if bad {
				damaged = append(damaged, s.Dir)
			}
			continue
		}
		chosen = &info.Steps[i]
		break
	}
	if chosen == nil {
		why := "there is none"
		if len(rec.Skipped) > 0 {
			why = strings.Join(rec.Skipped, "; ")
		}
		err := fmt.Errorf("%w (and no step directory verifies: %s); the root was left as it is", info.Problem, why)
		if damage {
			err = &noneVerifies{err: err, why: why}
		}
		return nil, err
	}
	if aside {
		to, err := setAside(fsys, root, damaged)
		if err != nil {
			return nil, err
		}
		for i, a := range to {
			rec.SetAside = append(rec.SetAside, fmt.Sprintf("%s as %s", filepath.Base(damaged[i]), a))
		}
	}
	name := filepath.Base(chosen.Dir)
	tx := &saveTx{fs: fsys, root: root}
	if err := tx.moveLatest([]byte(name + "\n")); err != nil {
		return nil, fmt.Errorf("checkpoint: recovering %s: moving %s to %s: %w", root, LatestFile, name, err)
	}
	if err := fsys.SyncDir(root); err != nil {
		return nil, fmt.Errorf("checkpoint: recovering %s: fsync: %w", root, err)
	}
	rec.Dir, rec.Repaired = chosen.Dir, true
	if info.Pending == chosen.Dir {
		rec.Note = fmt.Sprintf("finished the interrupted commit of %s (%s was missing; %s named %s, which verifies)", name, LatestFile, pendingLatest, name)
	} else {
		rec.Note = fmt.Sprintf("%v; took the newest step directory that verifies, %s, and pointed %s at it", info.Problem, name, LatestFile)
	}
	if len(rec.Skipped) > 0 {
		rec.Note += fmt.Sprintf(" (skipped %d newer that did not verify: %s)", len(rec.Skipped), strings.Join(rec.Skipped, "; "))
	}
	if len(rec.SetAside) > 0 {
		rec.Note += fmt.Sprintf("; set aside, whole: %s", strings.Join(rec.SetAside, ", "))
	}
	return rec, nil
}

// noneVerifies is recoverLocked's error when no step directory verifies
// and each failed for damage (ErrCorrupt, a file missing), not an I/O
// error: Rollback then sets them all aside.
type noneVerifies struct {
	err error
	why string // the step directories' failures, or "there is none"
}

func (e *noneVerifies) Error() string { return e.err.Error() }
func (e *noneVerifies) Unwrap() error { return e.err }

// noneLeftIn sets every step directory of root aside and removes its
// latest (setAsideAll), and returns the error, wrapping ErrNoneLeft,
// that says why (why) and what was done. The caller holds
// root's lock and its write.
func noneLeftIn(fsys FS, root, why string) error {
	moved, err := setAsideAll(fsys, root)
	if err != nil {
		return fmt.Errorf("checkpoint: %s: no checkpoint verifies (%s); setting them aside: %w", root, why, err)
	}
	if len(moved) > 0 {
		why += fmt.Sprintf("; set aside, whole: %s", strings.Join(moved, ", "))
	}
	return &noneLeftError{root: root, what: why + "; " + LatestFile + " removed"}
}

// noneLeftError is noneLeftIn's error: what was found and done in root.
type noneLeftError struct{ root, what string }

func (e *noneLeftError) Error() string {
	return fmt.Sprintf("checkpoint: %v: %s: %s. %s holds no checkpoint now: a new run may start there (dos train --ckpt-dir %s without --resume; a program saves into it afresh)", ErrNoneLeft, e.root, e.what, e.root, ShellQuote(e.root))
}
func (e *noneLeftError) Unwrap() error { return ErrNoneLeft }

// verifyDir opens the checkpoint of rank in dir and verifies it with
// verify (nil: every tensor's CRC32C).
func verifyDir(fsys FS, dir string, rank int, verify func(*Checkpoint) error) error {
	c, err := Open(fsys, dir, rank)
	if err != nil {
		return err
	}
	defer c.Close()
	if verify == nil {
		return c.Verify()
	}
	return verify(c)
}

// FileKind names a file's type for messages: "file", "directory",
// "FIFO", "socket", "device" or "special file" (a link is followed by
// Stat, so it is named by its target's type).
func FileKind(m fs.FileMode) string {
	switch {
	case m.IsRegular():
		return "file"
	case m.IsDir():
		return "directory"
	case m&fs.ModeNamedPipe != 0:
		return "FIFO"
	case m&fs.ModeSocket != 0:
		return "socket"
	case m&fs.ModeDevice != 0:
		return "device"
	}
	return "special file"
}

// asidePrefix starts the name of a checkpoint that Rollback set aside.
const asidePrefix = "damaged-"

// retiredPrefix starts the name a checkpoint takes while Retain removes it.
const retiredPrefix = tmpPrefix + "retired-"

// Retain removes the committed checkpoints under root beyond the newest
// keep (keep >= 1), as List orders them; latest's is always among those
// kept. Step directories above latest's (uncommitted, see List) are left
// alone. A checkpoint is retired crash-safely: renamed out of the step
// namespace (root/.tmp-retired-step-%09d-<random>), root fsynced, then
// removed, so that a crash at any point leaves either the whole checkpoint
// or a leftover that the next save or Retain removes. Retain also removes
// such leftovers, and incomplete step directories (no manifest.json) below
// latest's step, which older versions' interrupted retention left. A step
// directory that is a symbolic link loses the link, not its target. It
// holds the root's lock (Lock).
//
// Errors: keep < 1, those of Lock and List, and the first removal that
// fails.
func Retain(fsys FS, root string, keep int) error {
	if keep < 1 {
		return fmt.Errorf("checkpoint: Retain %d: keep at least 1", keep)
	}
	return writing(fsys, root, func() error { return retain(fsys, root, keep) })
}

// retain is Retain for a caller that holds the root's lock and its write.
func retain(fsys FS, root string, keep int) error {
	info, err := Inspect(fsys, root)
	if err != nil {
		return err
	}
	if info.Problem != nil {
		return info.Problem
	}
	if info.Latest == "" {
		return nil
	}
	latestStep, _ := parseStepDirName(filepath.Base(info.Latest))
	kept := 0
	var victims []string
	for _, s := range info.Steps {
		switch {
		case s.Committed && kept < keep:
			kept++
		case s.Committed, !s.Complete && s.Step < latestStep:
			victims = append(victims, s.Dir)
		}
	}
	for _, d := range victims {
		if err := retire(fsys, root, d); err != nil {
			return err
		}
	}
	for _, l := range info.Leftovers {
		if strings.HasPrefix(filepath.Base(l), retiredPrefix) {
			if err := fsys.RemoveAll(l); err != nil {
				return fmt.Errorf("checkpoint: retention: removing the leftover %s: %w", l, err)
			}
		}
	}
	return nil
}

// retire renames dir out of root's step namespace, fsyncs root, and removes
// it.
func retire(fsys FS, root, dir string) error {
	tmp := filepath.Join(root, fmt.Sprintf("%s%s-%08x", retiredPrefix, filepath.Base(dir), rand.Uint32()))
	if err := fsys.Rename(dir, tmp); err != nil {
		return fmt.Errorf("checkpoint: retention: retiring %s: %w", dir, err)
	}
	if err := fsys.SyncDir(root); err != nil {
		return fmt.Errorf("checkpoint: retention: retiring %s: fsync %s: %w", dir, root, err)
	}
	if err := fsys.RemoveAll(tmp); err != nil {
		return fmt.Errorf("checkpoint: retention: removing %s (retired %s): %w", tmp, dir, err)
	}
	return nil
}
