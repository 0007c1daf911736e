package checkpoint

import (
	"io"
	"os"
)

// FS is the small file-system interface that all checkpoint I/O goes
// through. Tests wrap it to inject failures (ENOSPC, EIO, torn writes) at
// operation i and to simulate a crash, as pebble's vfs.FS and errorfs do.
//
// Paths are in the host's syntax (path/filepath). Implementations must be
// safe for concurrent use by several goroutines.
type FS interface {
	// MkdirAll creates path and any missing parents, as os.MkdirAll.
	MkdirAll(path string, perm os.FileMode) error
	// OpenFile opens name with os.OpenFile's flags (os.O_RDONLY,
	// os.O_WRONLY|os.O_CREATE|os.O_TRUNC, ...).
	OpenFile(name string, flag int, perm os.FileMode) (File, error)
	// Rename renames oldpath to newpath atomically, replacing newpath when
	// it is a file, as rename(2).
	Rename(oldpath, newpath string) error
	// RemoveAll removes path and everything under it; a missing path is
	// not an error, as os.RemoveAll.
	RemoveAll(path string) error
	// ReadDir lists the directory name sorted by file name, as os.ReadDir.
	ReadDir(name string) ([]os.DirEntry, error)
	// Stat describes the file or directory name, as os.Stat.
	Stat(name string) (os.FileInfo, error)
	// SyncDir makes the directory dir's entries durable (fsync(2) on the
	// directory), so that files created, renamed or removed in it survive
	// a power loss.
	SyncDir(dir string) error
}

// File is an open file of an FS. *os.File implements it.
//
// Sync makes the file's contents durable (fsync(2)). Write and WriteAt
// return a non-nil error whenever they write fewer bytes than asked.
type File interface {
	io.ReaderAt
	io.WriterAt
	io.Writer
	io.Reader
	Sync() error
	Close() error
	Stat() (os.FileInfo, error)
}

// OS is the FS of the operating system, through package os. Its SyncDir
// opens the directory read-only and calls fsync on it.
var OS FS = osFS{}

type osFS struct{}

var _ File = (*os.File)(nil)

func (osFS) MkdirAll(path string, perm os.FileMode) error { return os.MkdirAll(path, perm) }

func (osFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	f, err := os.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err // not a typed nil File
	}
	return f, nil
}

func (osFS) Rename(oldpath, newpath string) error       { return os.Rename(oldpath, newpath) }
func (osFS) RemoveAll(path string) error                { return os.RemoveAll(path) }
func (osFS) ReadDir(name string) ([]os.DirEntry, error) { return os.ReadDir(name) }
func (osFS) Stat(name string) (os.FileInfo, error)      { return os.Stat(name) }

func (osFS) SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	if err := d.Sync(); err != nil {
		d.Close()
		return err
	}
	return d.Close()
}
