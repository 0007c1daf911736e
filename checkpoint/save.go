package checkpoint

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/deepstates/dos/safetensors"
)

// Tensor is one tensor to save.
type Tensor struct {
	// Name is the tensor's name in the file, unique within a Snapshot and
	// not "__metadata__".
	Name  string
	DType safetensors.DType
	// Shape is row-major, in elements; nil or [] for a scalar.
	Shape []int64
	// Data is the tensor's little-endian bytes as one or more byte ranges
	// whose concatenation is the tensor: zero-copy views of the caller's
	// memory, since a parameter may span several optimizer subgroups.
	// Their total length must be the product of Shape times DType's size
	// in bytes. Save reads them and never retains them; they must not
	// change while Save runs.
	Data [][]byte
	// Groups, when not nil, has one entry per Data range: its capture
	// group, a small integer >= 0 (an optimizer subgroup). The lazy Engine
	// captures ranges in file order and reports each group's capture
	// (Handle.WaitGroup), so that the source may change a group's memory
	// as soon as that group is captured. nil puts every range in group 0.
	// Save ignores it.
	Groups []int
}

// Snapshot is what one rank saves at one step.
type Snapshot struct {
	Step int64 // the optimizer step, at least 0; it names the directory
	// Rank is this process's rank in [0, WorldSize); WorldSize 0 means 1.
	Rank, WorldSize int
	// Tensors are written to the safetensors file in this order.
	Tensors []Tensor
	// Objects are small serialized objects, stored in the manifest:
	// "optimizer" (hyperparameters, step counter...), "trainer" (iteration,
	// data position, RNG state, model configuration). Each must be valid
	// JSON.
	Objects map[string]json.RawMessage
	// Prepare, when set, is called once before any tensor is read, on the
	// goroutine that writes (in the background for an Engine): state that
	// lives on a device moves to the host memory the tensors view, while
	// training goes on (DataStates-LLM's device-to-host capture). Its
	// error fails the save.
	Prepare func() error
	// Check, when set, sees every tensor's bytes before the checkpoint is
	// committed, so that a source can refuse to commit state its loader
	// would refuse (offload: a non-finite master weight or moment). It is
	// called for each tensor t (an index into Tensors) with consecutive
	// pieces b of its data in file order, off being the piece's offset in
	// bytes within the tensor (0 for the first piece; pieces may split an
	// element), on one goroutine: Save's, or an Engine's checksum stage
	// (the bytes being those staged for the write). A tensor without bytes
	// is not seen. Its error fails the save: nothing is committed, and the
	// previous checkpoint stays the latest.
	Check func(t int, off int64, b []byte) error
}

// Save writes s as a checkpoint under root and commits it: when Save
// returns nil, root/latest names the new directory and everything is on
// stable storage. It returns the new directory, root/step-%09d. The steps,
// in order, are those of the package documentation. Save is synchronous:
// it returns after the last fsync.
//
// Save removes stale temporary directories (.tmp-*) that crashed saves left
// in root. A directory for s.Step that exists above latest's step (left by
// a save that crashed before moving latest, or superseded when latest was
// moved back) or that is incomplete (no manifest.json) is replaced; a
// committed one (at or below latest's step, holding manifest.json) never
// is. latest always names the last successful save, even when its step is
// lower than a previous one's; List then leaves out the higher steps.
// Save holds the root's lock (Lock) while it runs: one process at a time
// may write under a root.
//
// Errors: an invalid snapshot (negative step, rank out of range, empty or
// duplicate name, unknown dtype, negative dimension, an object that is not
// valid JSON); an error wrapping fs.ErrExist when s.Step's directory is a
// committed checkpoint; an error wrapping ErrCorrupt when root is damaged
// (see Latest: Recover repairs it) or is a step directory; one wrapping
// ErrLocked when another process writes under root; or an I/O error. Each
// error names the step and the operation that failed. On error the
// temporary directory is removed (best effort) and latest still names the
// previous checkpoint, which stays loadable: Save restores latest when the
// final fsync of root fails after latest was moved.
//
// Save panics when s is nil or when a tensor's Data does not hold exactly
// its shape's bytes.
func Save(fsys FS, root string, s *Snapshot) (dir string, err error) {
	if s == nil {
		panic("checkpoint: Save of a nil *Snapshot")
	}
	p, err := newPlan(s)
	if err != nil {
		return "", fmt.Errorf("checkpoint: save step %d: %w", s.Step, err)
	}
	if s.Prepare != nil {
		if err := s.Prepare(); err != nil {
			return "", fmt.Errorf("checkpoint: save step %d: preparing the state: %w", s.Step, err)
		}
	}
	lock, err := lockRoot(fsys, root, false)
	if err != nil {
		return "", fmt.Errorf("checkpoint: save step %d: %w", s.Step, err)
	}
	defer lock.Unlock()
	if err := lock.beginWrite(); err != nil {
		return "", fmt.Errorf("checkpoint: save step %d: %w", s.Step, err)
	}
	defer lock.endWrite()
	tx, err := begin(fsys, root, p)
	if err != nil {
		return "", err
	}
	if err := tx.writeRankFile(s.Tensors, s.Check); err != nil {
		tx.abort()
		return "", err
	}
	return tx.commit()
}

// saveTx is one save in progress: steps 1-2 of the commit protocol (see the
// package documentation) by begin, step 3 by a writer (writeRankFile here;
// a lazy engine's writers later), steps 4-11 by commit.
type saveTx struct {
	fs    FS
	root  string
	p     *plan
	tmp   string // root/.tmp-step-%09d-<random>
	final string // root/step-%09d

	prevLatest []byte // contents of latest before this save
	hadLatest  bool
}

func (tx *saveTx) fail(op string, err error) error {
	return fmt.Errorf("checkpoint: save step %d: %s: %w", tx.p.manifest.Step, op, err)
}

// begin prepares root for the save planned by p: it creates root, reads
// latest, removes stale temporary directories and a stale directory of the
// same step, and creates the temporary directory.
func begin(fsys FS, root string, p *plan) (*saveTx, error) {
	tx := &saveTx{fs: fsys, root: root, p: p, final: filepath.Join(root, p.dirName)}
	st, err := fsys.Stat(root)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := createDurably(fsys, root); err != nil {
			return nil, tx.fail("create root", err)
		}
	case err != nil:
		return nil, tx.fail("stat root", err)
	case !st.IsDir():
		return nil, tx.fail("root", fmt.Errorf("%s is not a directory", root))
	}

	// A damaged root is never written over: the checkpoints it holds are
	// not marked, and a save would adopt or replace them (Recover first).
	latestStep := int64(-1)
	switch dir, err := Latest(fsys, root); {
	case err == nil:
		latestStep, _ = parseStepDirName(filepath.Base(dir))
		tx.prevLatest, tx.hadLatest = []byte(filepath.Base(dir)+"\n"), true // what latest holds
	case errors.Is(err, ErrCorrupt):
		return nil, tx.fail("check root", fmt.Errorf("%w; refusing to save into a damaged root: recover it first (checkpoint.Recover, dos train --resume) or choose another", err))
	case !errors.Is(err, ErrNoCheckpoint):
		return nil, tx.fail("read latest", err)
	}

	// Best effort: a leftover temporary directory is never loaded, and a
	// failure to remove it must not fail this save.
	if entries, err := fsys.ReadDir(root); err == nil {
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), tmpPrefix) {
				_ = fsys.RemoveAll(filepath.Join(root, e.Name()))
			}
		}
	}

	if _, err := fsys.Stat(tx.final); err == nil {
		switch _, merr := fsys.Stat(filepath.Join(tx.final, ManifestFile)); {
		case p.manifest.Step == latestStep:
			return nil, tx.fail("check", fmt.Errorf("%s is the latest checkpoint; refusing to replace it: %w", tx.final, fs.ErrExist))
		case merr == nil && p.manifest.Step < latestStep:
			return nil, tx.fail("check", fmt.Errorf("%s is a committed checkpoint (latest is step %d); refusing to replace it: %w", tx.final, latestStep, fs.ErrExist))
		case merr != nil && !errors.Is(merr, fs.ErrNotExist) && !errors.Is(merr, errNotDir):
			return nil, tx.fail("stat "+p.dirName, merr)
		}
		// Above latest, or incomplete: never committed (a save that
		// crashed before moving latest, or a removal cut short).
		if err := fsys.RemoveAll(tx.final); err != nil {
			return nil, tx.fail("remove uncommitted "+p.dirName, err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, tx.fail("stat "+p.dirName, err)
	}

	tx.tmp = filepath.Join(root, fmt.Sprintf("%s%s-%08x", tmpPrefix, p.dirName, rand.Uint32()))
	if err := fsys.MkdirAll(tx.tmp, 0o755); err != nil {
		tx.abort()
		return nil, tx.fail("create temporary directory", err)
	}
	return tx, nil
}

// createDurably creates the directory dir and its missing parents, then
// fsyncs the parent of each directory it created, so that a commit under
// dir survives a power loss.
func createDurably(fsys FS, dir string) error {
	var missing []string
	for p := filepath.Clean(dir); ; {
		_, err := fsys.Stat(p)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		missing = append(missing, p)
		parent := filepath.Dir(p)
		if parent == p {
			break
		}
		p = parent
	}
	if err := fsys.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, p := range slices.Backward(missing) {
		if err := fsys.SyncDir(filepath.Dir(p)); err != nil {
			return err
		}
	}
	return nil
}

// abort removes the temporary directory, best effort.
func (tx *saveTx) abort() { _ = tx.fs.RemoveAll(tx.tmp) }

// writeRankFile writes the safetensors file into the temporary directory:
// the header, then each tensor's ranges at its planned offset, computing the
// tensor's CRC32C and passing the ranges to check (Snapshot.Check, when not
// nil) on the way; then it fsyncs and closes the file.
func (tx *saveTx) writeRankFile(tensors []Tensor, check func(t int, off int64, b []byte) error) error {
	name := tx.p.fileName
	f, err := tx.fs.OpenFile(filepath.Join(tx.tmp, name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return tx.fail("create "+name, err)
	}
	closed := false
	defer func() {
		if !closed {
			_ = f.Close()
		}
	}()
	if err := writeFullAt(f, tx.p.header, 0); err != nil {
		return tx.fail("write "+name+" header", err)
	}
	entries := tx.p.manifest.Tensors
	for i, t := range tensors {
		off := entries[i].Offset
		var crc uint32
		for _, r := range t.Data {
			if len(r) == 0 {
				continue
			}
			if check != nil {
				if err := check(i, off-entries[i].Offset, r); err != nil {
					return fmt.Errorf("checkpoint: save step %d: %w", tx.p.manifest.Step, err)
				}
			}
			if err := writeFullAt(f, r, off); err != nil {
				return tx.fail(fmt.Sprintf("write tensor %q to %s", t.Name, name), err)
			}
			crc = crc32.Update(crc, castagnoli, r)
			off += int64(len(r))
		}
		entries[i].CRC32C = crc
	}
	st, err := f.Stat()
	if err != nil {
		return tx.fail("stat "+name, err)
	}
	if st.Size() != tx.p.fileSize {
		return tx.fail("write "+name, fmt.Errorf("file holds %d bytes after writing, want %d", st.Size(), tx.p.fileSize))
	}
	if err := f.Sync(); err != nil {
		return tx.fail("fsync "+name, err)
	}
	closed = true
	if err := f.Close(); err != nil {
		return tx.fail("close "+name, err)
	}
	return nil
}

// commit writes index.json and manifest.json into the temporary directory,
// renames it into place and moves latest to it.
func (tx *saveTx) commit() (string, error) {
	tx.p.manifest.Created = time.Now().UTC().Truncate(time.Second)
	// Both encodings cannot fail: newPlan checked the objects.
	index, err := json.MarshalIndent(tx.p.index, "", "  ")
	if err != nil {
		tx.abort()
		return "", tx.fail("encode index", err)
	}
	manifest, err := json.MarshalIndent(tx.p.manifest, "", "  ")
	if err != nil {
		tx.abort()
		return "", tx.fail("encode manifest", err)
	}
	if err := writeFile(tx.fs, filepath.Join(tx.tmp, IndexFile), append(index, '\n')); err != nil {
		tx.abort()
		return "", tx.fail("write "+IndexFile, err)
	}
	if err := writeFile(tx.fs, filepath.Join(tx.tmp, ManifestFile), append(manifest, '\n')); err != nil {
		tx.abort()
		return "", tx.fail("write "+ManifestFile, err)
	}
	if err := tx.fs.SyncDir(tx.tmp); err != nil {
		tx.abort()
		return "", tx.fail("fsync temporary directory", err)
	}
	if err := tx.fs.Rename(tx.tmp, tx.final); err != nil {
		tx.abort()
		return "", tx.fail("rename temporary directory to "+tx.p.dirName, err)
	}
	// From here the new directory is complete but not committed: latest
	// still names the previous one.
	if err := tx.fs.SyncDir(tx.root); err != nil {
		_ = tx.fs.RemoveAll(tx.final)
		return "", tx.fail("fsync root after rename", err)
	}
	if err := tx.moveLatest([]byte(tx.p.dirName + "\n")); err != nil {
		_ = tx.fs.RemoveAll(tx.final)
		return "", tx.fail("move latest", err)
	}
	if err := tx.fs.SyncDir(tx.root); err != nil {
		// Whether the new latest reached the disk is unknown. Restore the
		// previous one, so that an error always means "not committed".
		if rerr := tx.restoreLatest(); rerr != nil {
			return "", tx.fail("fsync root after moving latest", fmt.Errorf("%w; restoring the previous latest also failed (%v), so latest may name %s or the previous checkpoint", err, rerr, tx.p.dirName))
		}
		_ = tx.fs.RemoveAll(tx.final)
		return "", tx.fail("fsync root after moving latest (previous latest restored)", err)
	}
	return tx.final, nil
}

// moveLatest replaces latest atomically with contents: write latest.tmp
// (created anew: whatever stood there, a FIFO or a link to a file outside
// the root included, is removed first, never written through), fsync it,
// rename it over latest. The caller fsyncs root.
func (tx *saveTx) moveLatest(contents []byte) error { return moveLatest(tx.fs, tx.root, contents) }

// moveLatest is saveTx.moveLatest in root.
func moveLatest(fsys FS, root string, contents []byte) error {
	return replaceFile(fsys, filepath.Join(root, pendingLatest), filepath.Join(root, LatestFile), contents)
}

// replaceFile replaces name atomically with contents through tmp: tmp is
// created anew (whatever stood there removed first, never written
// through), written, fsynced and renamed over name. The caller fsyncs the
// directory.
func replaceFile(fsys FS, tmp, name string, contents []byte) error {
	if err := fsys.RemoveAll(tmp); err != nil {
		return err
	}
	if err := writeFile(fsys, tmp, contents); err != nil {
		_ = fsys.RemoveAll(tmp)
		return err
	}
	if err := fsys.Rename(tmp, name); err != nil {
		_ = fsys.RemoveAll(tmp)
		return err
	}
	return nil
}

// restoreLatest puts back the latest file that existed before this save
// (or removes latest when there was none) and fsyncs root.
func (tx *saveTx) restoreLatest() error {
	var err error
	if tx.hadLatest {
		err = tx.moveLatest(tx.prevLatest)
	} else {
		err = tx.fs.RemoveAll(filepath.Join(tx.root, LatestFile))
	}
	if err != nil {
		return err
	}
	return tx.fs.SyncDir(tx.root)
}

// writeFullAt writes all of b at off.
func writeFullAt(f File, b []byte, off int64) error {
	n, err := f.WriteAt(b, off)
	if err == nil && n != len(b) {
		err = io.ErrShortWrite
	}
	return err
}

// writeFile creates name, which must not exist (O_EXCL: never through a
// link), writes data, fsyncs and closes it.
func writeFile(fsys FS, name string, data []byte) error {
	f, err := fsys.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	n, err := f.Write(data)
	if err == nil && n != len(data) {
		err = io.ErrShortWrite
	}
	if err == nil {
		err = f.Sync()
	}
	if err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// readSmallFile reads all of name, which must be a regular file of at most
// max bytes (see openRegular).
func readSmallFile(fsys FS, name string, max int64) ([]byte, error) {
	f, st, err := openRegular(fsys, name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if st.Size() > max {
		return nil, fmt.Errorf("%w: %s: %d bytes, larger than %d", ErrCorrupt, name, st.Size(), max)
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("%w: %s: larger than %d bytes", ErrCorrupt, name, max)
	}
	return b, nil
}

// openRegular opens name for reading only if it is a regular file (or a
// link to one): a FIFO, a device or a directory in its place is bad
// contents, never something to block on or read without end. The open
// does not block (O_NONBLOCK, which regular files ignore), and the open
// file is checked.
//
// Errors: those of OpenFile (fs.ErrNotExist when it is missing) and
// Stat; an error wrapping ErrCorrupt naming the file and its kind.
func openRegular(fsys FS, name string) (File, os.FileInfo, error) {
	f, err := fsys.OpenFile(name, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, nil, fmt.Errorf("%w: %s is a %s, not a regular file", ErrCorrupt, name, FileKind(st.Mode()))
	}
	return f, st, nil
}
