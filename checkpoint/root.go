package checkpoint

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"
)

// Latest returns the directory of the committed checkpoint that root/latest
// names, as root/step-%09d.
//
// Errors: an error wrapping fs.ErrNotExist when root or root/latest does not
// exist (nothing was ever committed there); an error wrapping ErrCorrupt
// when latest does not hold a step directory's name or names a directory
// without manifest.json (deliberately not fs.ErrNotExist, so a caller never
// mistakes a damaged root for a fresh start); or an I/O error. Temporary
// directories of saves that crashed are never returned.
func Latest(fsys FS, root string) (string, error) {
	name, _, err := readLatest(fsys, root)
	if err != nil {
		return "", err
	}
	dir := filepath.Join(root, name)
	if _, err := fsys.Stat(filepath.Join(dir, ManifestFile)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("%w: %s names %s, which is not a complete checkpoint (%v)", ErrCorrupt, filepath.Join(root, LatestFile), name, err)
		}
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	return dir, nil
}

// readLatest reads root/latest and returns the directory name it holds and
// its step.
func readLatest(fsys FS, root string) (string, int64, error) {
	path := filepath.Join(root, LatestFile)
	b, err := readSmallFile(fsys, path, 4096)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", 0, fmt.Errorf("checkpoint: no committed checkpoint in %s: %w", root, err)
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

// List returns the committed checkpoint directories under root, newest
// step first, as root/step-%09d: the directory latest names and every
// complete step directory (one holding manifest.json) of an earlier step.
// Directories of a later step than latest's are not committed (a save
// crashed before moving latest, or latest was moved back by a save of an
// earlier step) and are left out, as are temporary directories. List does
// not open or verify the checkpoints.
//
// Errors: none when root or root/latest does not exist (the list is then
// empty); those of Latest; an I/O error.
func List(fsys FS, root string) ([]string, error) {
	latest, err := Latest(fsys, root)
	if errors.Is(err, fs.ErrNotExist) && !errors.Is(err, ErrCorrupt) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	latestStep, _ := parseStepDirName(filepath.Base(latest))
	entries, err := fsys.ReadDir(root)
	if err != nil {
		return nil, fmt.Errorf("checkpoint: listing %s: %w", root, err)
	}
	type found struct {
		step int64
		dir  string
	}
	var dirs []found
	for _, e := range entries {
		step, ok := parseStepDirName(e.Name())
		if !ok || step > latestStep || !e.IsDir() {
			continue
		}
		dir := filepath.Join(root, e.Name())
		if _, err := fsys.Stat(filepath.Join(dir, ManifestFile)); err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				continue
			}
			return nil, fmt.Errorf("checkpoint: listing %s: %w", root, err)
		}
		dirs = append(dirs, found{step, dir})
	}
	slices.SortFunc(dirs, func(a, b found) int { return cmp.Compare(b.step, a.step) })
	out := make([]string, len(dirs))
	for i, d := range dirs {
		out[i] = d.dir
	}
	return out, nil
}

// StepDir returns the directory that Save commits step to under root:
// root/step-%09d.
func StepDir(root string, step int64) string { return filepath.Join(root, stepDirName(step)) }

// Resolve returns the checkpoint directory that path means: the latest
// committed checkpoint when path is a root (it holds a latest file), else
// path itself, a step directory.
//
// Errors: those of Latest when path holds a latest file; an error wrapping
// fs.ErrNotExist when path does not exist.
func Resolve(fsys FS, path string) (string, error) {
	if _, err := fsys.Stat(path); err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	if _, err := fsys.Stat(filepath.Join(path, LatestFile)); err == nil {
		return Latest(fsys, path)
	}
	return path, nil
}
