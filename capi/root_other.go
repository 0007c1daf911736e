//go:build !unix

package main

import "path/filepath"

// rootKey identifies a checkpoint root directory: its absolute path with
// links resolved (where directories have no device and inode).
type rootKey struct{ path string }

// rootID returns the identity of the directory at path.
func rootID(path string) (rootKey, error) {
	p, err := filepath.EvalSymlinks(path)
	if err != nil {
		return rootKey{}, err
	}
	if p, err = filepath.Abs(p); err != nil {
		return rootKey{}, err
	}
	return rootKey{p}, nil
}
