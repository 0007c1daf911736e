package checkpoint

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
)

// errorFS wraps an FS and counts its operations (those of the FS and of
// its open files), like pebble's errorfs: it fails operation failAt with
// injectErr, or simulates a crash by failing every operation from crashAt
// on, without effect.
type errorFS struct {
	inner FS

	mu        sync.Mutex
	ops       int
	failAt    int   // -1: none
	crashAt   int   // -1: none
	killAt    int   // -1: none; else SIGKILL this process before that operation
	injectErr error // the error of the failed operation
	torn      bool  // a failed write writes its first half first
	injected  string
	log       []string
}

var errCrashed = errors.New("simulated crash")

func newErrorFS(inner FS) *errorFS {
	return &errorFS{inner: inner, failAt: -1, crashAt: -1, killAt: -1}
}

// op counts an operation and returns the error to give instead of doing
// it, and whether that error is an injected (not crash) one.
func (e *errorFS) op(name, path string) (injected bool, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	i := e.ops
	e.ops++
	e.log = append(e.log, fmt.Sprintf("%d %s %s", i, name, path))
	if i == e.killAt {
		if log := os.Getenv("DOS_CKPT_KILL_LOG"); log != "" {
			os.WriteFile(log, []byte(strings.Join(e.log, "\n")+"\n"), 0o644)
		}
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	if e.crashAt >= 0 && i >= e.crashAt {
		return false, pathErr(name, path, errCrashed)
	}
	if i == e.failAt {
		e.injected = fmt.Sprintf("%d %s %s", i, name, path)
		return true, pathErr(name, path, e.injectErr)
	}
	return false, nil
}

func (e *errorFS) MkdirAll(path string, perm os.FileMode) error {
	if _, err := e.op("mkdirall", path); err != nil {
		return err
	}
	return e.inner.MkdirAll(path, perm)
}

func (e *errorFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	if _, err := e.op("open", name); err != nil {
		return nil, err
	}
	f, err := e.inner.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return &errorFile{fs: e, f: f, name: name}, nil
}

func (e *errorFS) Rename(oldpath, newpath string) error {
	if _, err := e.op("rename", oldpath); err != nil {
		return err
	}
	return e.inner.Rename(oldpath, newpath)
}

func (e *errorFS) RemoveAll(path string) error {
	if _, err := e.op("removeall", path); err != nil {
		return err
	}
	return e.inner.RemoveAll(path)
}

func (e *errorFS) ReadDir(name string) ([]os.DirEntry, error) {
	if _, err := e.op("readdir", name); err != nil {
		return nil, err
	}
	return e.inner.ReadDir(name)
}

func (e *errorFS) Stat(name string) (os.FileInfo, error) {
	if _, err := e.op("stat", name); err != nil {
		return nil, err
	}
	return e.inner.Stat(name)
}

func (e *errorFS) SyncDir(dir string) error {
	if _, err := e.op("syncdir", dir); err != nil {
		return err
	}
	return e.inner.SyncDir(dir)
}

type errorFile struct {
	fs   *errorFS
	f    File
	name string
}

func (f *errorFile) ReadAt(p []byte, off int64) (int, error) {
	if _, err := f.fs.op("readat", f.name); err != nil {
		return 0, err
	}
	return f.f.ReadAt(p, off)
}

func (f *errorFile) Read(p []byte) (int, error) {
	if _, err := f.fs.op("read", f.name); err != nil {
		return 0, err
	}
	return f.f.Read(p)
}

func (f *errorFile) WriteAt(p []byte, off int64) (int, error) {
	if injected, err := f.fs.op("writeat", f.name); err != nil {
		if injected && f.fs.torn && len(p) > 1 {
			n, _ := f.f.WriteAt(p[:len(p)/2], off)
			return n, err
		}
		return 0, err
	}
	return f.f.WriteAt(p, off)
}

func (f *errorFile) Write(p []byte) (int, error) {
	if injected, err := f.fs.op("write", f.name); err != nil {
		if injected && f.fs.torn && len(p) > 1 {
			n, _ := f.f.Write(p[:len(p)/2])
			return n, err
		}
		return 0, err
	}
	return f.f.Write(p)
}

func (f *errorFile) Sync() error {
	if _, err := f.fs.op("sync", f.name); err != nil {
		return err
	}
	return f.f.Sync()
}

// Close always releases the inner file (a crashed process's descriptors
// are closed too), which changes nothing on disk.
func (f *errorFile) Close() error {
	_, err := f.fs.op("close", f.name)
	cerr := f.f.Close()
	if err != nil {
		return err
	}
	return cerr
}

func (f *errorFile) Stat() (os.FileInfo, error) {
	if _, err := f.fs.op("fstat", f.name); err != nil {
		return nil, err
	}
	return f.f.Stat()
}
