//go:build !unix

package checkpoint

import (
	"errors"
	"os"
)

type fileKey struct{}

func keyOf(os.FileInfo) (fileKey, bool) { return fileKey{}, false }

// links is 1 where hard link counts are not known.
func links(os.FileInfo) uint64 { return 1 }

var errWouldBlock = errors.New("would block")

// flock locks nothing where flock(2) does not exist.
func flock(*os.File) error { return nil }

// funlock unlocks nothing where flock(2) does not exist.
func funlock(*os.File) error { return nil }

func isReadOnly(error) bool { return false }

func tryShared(*os.File) error { return nil }

const noFollow = 0
