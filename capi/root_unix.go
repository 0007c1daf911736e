//go:build unix

package main

import (
	"fmt"
	"os"
	"syscall"
)

// rootKey identifies a checkpoint root directory: its device and inode, so
// that a relative path, a symbolic link or another spelling of the same
// directory is the same root.
type rootKey struct{ dev, ino uint64 }

// rootID returns the identity of the directory at path (following links).
func rootID(path string) (rootKey, error) {
	st, err := os.Stat(path)
	if err != nil {
		return rootKey{}, err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return rootKey{}, fmt.Errorf("%s: no device and inode", path)
	}
	return rootKey{uint64(sys.Dev), uint64(sys.Ino)}, nil
}
