package checkpoint

import (
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// memFS is an in-memory FS that models durability strictly, like pebble's
// vfs.NewStrictMem: a file's contents survive a crash only as of its last
// Sync, and a directory's entries only as of its last SyncDir. crashClone
// returns what a power loss (or a process crash) would leave.
type memFS struct {
	mu   sync.Mutex
	root *memNode
}

type memNode struct {
	dir      bool
	children map[string]*memNode // current entries (directories)
	durable  map[string]*memNode // entries as of the last SyncDir
	data     []byte              // current contents (files)
	synced   []byte              // contents as of the last Sync
}

func newDirNode() *memNode {
	return &memNode{dir: true, children: map[string]*memNode{}, durable: map[string]*memNode{}}
}

func newMemFS() *memFS { return &memFS{root: newDirNode()} }

var _ FS = (*memFS)(nil)

func splitPath(p string) []string {
	p = filepath.Clean(p)
	var out []string
	for _, s := range strings.Split(p, "/") {
		if s != "" {
			out = append(out, s)
		}
	}
	return out
}

func pathErr(op, path string, err error) error { return &fs.PathError{Op: op, Path: path, Err: err} }

// lookup returns the node at path; m.mu is held.
func (m *memFS) lookup(path string) (*memNode, error) {
	n := m.root
	for _, s := range splitPath(path) {
		if !n.dir {
			return nil, syscall.ENOTDIR
		}
		c, ok := n.children[s]
		if !ok {
			return nil, fs.ErrNotExist
		}
		n = c
	}
	return n, nil
}

// parent returns the directory holding path and path's base name.
func (m *memFS) parent(path string) (*memNode, string, error) {
	parts := splitPath(path)
	if len(parts) == 0 {
		return nil, "", syscall.EINVAL
	}
	dir, err := m.lookup("/" + strings.Join(parts[:len(parts)-1], "/"))
	if err != nil {
		return nil, "", err
	}
	if !dir.dir {
		return nil, "", syscall.ENOTDIR
	}
	return dir, parts[len(parts)-1], nil
}

func (m *memFS) MkdirAll(path string, perm os.FileMode) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := m.root
	for _, s := range splitPath(path) {
		c, ok := n.children[s]
		if !ok {
			c = newDirNode()
			n.children[s] = c
		}
		if !c.dir {
			return pathErr("mkdir", path, syscall.ENOTDIR)
		}
		n = c
	}
	return nil
}

func (m *memFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	dir, base, err := m.parent(name)
	if err != nil {
		return nil, pathErr("open", name, err)
	}
	n, ok := dir.children[base]
	switch {
	case ok && flag&os.O_CREATE != 0 && flag&os.O_EXCL != 0:
		return nil, pathErr("open", name, fs.ErrExist)
	case !ok && flag&os.O_CREATE == 0:
		return nil, pathErr("open", name, fs.ErrNotExist)
	case !ok:
		n = &memNode{}
		dir.children[base] = n
	}
	write := flag&(os.O_WRONLY|os.O_RDWR) != 0
	if n.dir && write {
		return nil, pathErr("open", name, syscall.EISDIR)
	}
	if flag&os.O_TRUNC != 0 && write {
		n.data = nil
	}
	return &memFile{fs: m, n: n, name: name, read: flag&os.O_WRONLY == 0, write: write}, nil
}

func (m *memFS) Rename(oldpath, newpath string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	od, ob, err := m.parent(oldpath)
	if err != nil {
		return pathErr("rename", oldpath, err)
	}
	n, ok := od.children[ob]
	if !ok {
		return pathErr("rename", oldpath, fs.ErrNotExist)
	}
	nd, nb, err := m.parent(newpath)
	if err != nil {
		return pathErr("rename", newpath, err)
	}
	if old, ok := nd.children[nb]; ok {
		if old.dir != n.dir || (old.dir && len(old.children) > 0) {
			return pathErr("rename", newpath, syscall.ENOTEMPTY)
		}
	}
	delete(od.children, ob)
	nd.children[nb] = n
	return nil
}

func (m *memFS) RemoveAll(path string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	dir, base, err := m.parent(path)
	if err != nil {
		return nil
	}
	delete(dir.children, base)
	return nil
}

func (m *memFS) ReadDir(name string) ([]os.DirEntry, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, err := m.lookup(name)
	if err != nil {
		return nil, pathErr("readdir", name, err)
	}
	if !n.dir {
		return nil, pathErr("readdir", name, syscall.ENOTDIR)
	}
	var out []os.DirEntry
	for _, k := range slices.Sorted(maps.Keys(n.children)) {
		out = append(out, fs.FileInfoToDirEntry(n.children[k].info(k)))
	}
	return out, nil
}

func (m *memFS) Stat(name string) (os.FileInfo, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, err := m.lookup(name)
	if err != nil {
		return nil, pathErr("stat", name, err)
	}
	return n.info(filepath.Base(name)), nil
}

func (m *memFS) SyncDir(dir string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, err := m.lookup(dir)
	if err != nil {
		return pathErr("fsync", dir, err)
	}
	if !n.dir {
		return pathErr("fsync", dir, syscall.ENOTDIR)
	}
	n.durable = maps.Clone(n.children)
	return nil
}

// crashClone returns the state a crash would leave: with powerLoss, only
// what was synced; without, everything written (a process crash).
func (m *memFS) crashClone(powerLoss bool) *memFS {
	m.mu.Lock()
	defer m.mu.Unlock()
	seen := map[*memNode]*memNode{}
	var clone func(n *memNode) *memNode
	clone = func(n *memNode) *memNode {
		if c, ok := seen[n]; ok {
			return c
		}
		if !n.dir {
			data := n.data
			if powerLoss {
				data = n.synced
			}
			c := &memNode{data: slices.Clone(data), synced: slices.Clone(data)}
			seen[n] = c
			return c
		}
		c := newDirNode()
		seen[n] = c
		entries := n.children
		if powerLoss {
			entries = n.durable
		}
		for k, child := range entries {
			c.children[k] = clone(child)
		}
		c.durable = maps.Clone(c.children)
		return c
	}
	return &memFS{root: clone(m.root)}
}

// readFile and writeFile give tests direct access, bypassing durability.
func (m *memFS) readFile(name string) []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, err := m.lookup(name)
	if err != nil || n.dir {
		panic("memFS: no file " + name)
	}
	return slices.Clone(n.data)
}

func (m *memFS) writeFile(name string, data []byte) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, err := m.lookup(name)
	if err != nil || n.dir {
		panic("memFS: no file " + name)
	}
	n.data, n.synced = slices.Clone(data), slices.Clone(data)
}

func (n *memNode) info(name string) os.FileInfo {
	return memInfo{name: name, size: int64(len(n.data)), dir: n.dir}
}

type memInfo struct {
	name string
	size int64
	dir  bool
}

func (i memInfo) Name() string { return i.name }
func (i memInfo) Size() int64  { return i.size }
func (i memInfo) Mode() os.FileMode {
	if i.dir {
		return fs.ModeDir | 0o755
	}
	return 0o644
}
func (i memInfo) ModTime() time.Time { return time.Time{} }
func (i memInfo) IsDir() bool        { return i.dir }
func (i memInfo) Sys() any           { return nil }

type memFile struct {
	fs          *memFS
	n           *memNode
	name        string
	read, write bool
	pos         int64
	closed      bool
}

func (f *memFile) check(op string, want bool) error {
	if f.closed {
		return pathErr(op, f.name, fs.ErrClosed)
	}
	if !want {
		return pathErr(op, f.name, syscall.EBADF)
	}
	return nil
}

func (f *memFile) ReadAt(p []byte, off int64) (int, error) {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("read", f.read); err != nil {
		return 0, err
	}
	if off < 0 {
		return 0, pathErr("read", f.name, syscall.EINVAL)
	}
	if off >= int64(len(f.n.data)) {
		return 0, io.EOF
	}
	n := copy(p, f.n.data[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (f *memFile) Read(p []byte) (int, error) {
	n, err := f.ReadAt(p, f.pos)
	f.pos += int64(n)
	if err == io.EOF && n > 0 {
		err = nil
	}
	return n, err
}

func (f *memFile) WriteAt(p []byte, off int64) (int, error) {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("write", f.write); err != nil {
		return 0, err
	}
	if off < 0 {
		return 0, pathErr("write", f.name, syscall.EINVAL)
	}
	if end := off + int64(len(p)); end > int64(len(f.n.data)) {
		f.n.data = append(f.n.data, make([]byte, end-int64(len(f.n.data)))...)
	}
	copy(f.n.data[off:], p)
	return len(p), nil
}

func (f *memFile) Write(p []byte) (int, error) {
	n, err := f.WriteAt(p, f.pos)
	f.pos += int64(n)
	return n, err
}

func (f *memFile) Sync() error {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("sync", true); err != nil {
		return err
	}
	f.n.synced = slices.Clone(f.n.data)
	return nil
}

func (f *memFile) Close() error {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("close", true); err != nil {
		return err
	}
	f.closed = true
	return nil
}

func (f *memFile) Stat() (os.FileInfo, error) {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if err := f.check("stat", true); err != nil {
		return nil, err
	}
	return f.n.info(filepath.Base(f.name)), nil
}
