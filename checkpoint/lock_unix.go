//go:build unix

package checkpoint

import (
	"errors"
	"os"
	"syscall"
)

// fileKey identifies a file whatever path names it: device and inode.
type fileKey struct{ dev, ino uint64 }

func keyOf(st os.FileInfo) (fileKey, bool) {
	s, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return fileKey{}, false
	}
	return fileKey{uint64(s.Dev), uint64(s.Ino)}, true
}

// links is st's hard link count (1 where the system does not say).
func links(st os.FileInfo) uint64 {
	if s, ok := st.Sys().(*syscall.Stat_t); ok {
		return uint64(s.Nlink)
	}
	return 1
}

var errWouldBlock = syscall.EWOULDBLOCK

// flock takes an exclusive flock(2) on f without waiting.
func flock(f *os.File) error {
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if !errors.Is(err, syscall.EINTR) {
			return err
		}
	}
}

// funlock releases f's flock(2) lock, for every descriptor of its open
// file (a fork()ed child's copies included).
func funlock(f *os.File) error {
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		if !errors.Is(err, syscall.EINTR) {
			return err
		}
	}
}

func isReadOnly(err error) bool { return errors.Is(err, syscall.EROFS) }

// noFollow makes an open fail on a symbolic link (ELOOP).
const noFollow = syscall.O_NOFOLLOW

// tryShared takes a shared flock(2) on f without waiting: EWOULDBLOCK when
// another open file holds it exclusively.
func tryShared(f *os.File) error {
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_SH|syscall.LOCK_NB)
		if !errors.Is(err, syscall.EINTR) {
			return err
		}
	}
}
