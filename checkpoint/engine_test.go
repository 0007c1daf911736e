package checkpoint

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/deepstates/dos/safetensors"
)

// bigSnapshot is a snapshot of several MiB across chunk boundaries, its
// ranges in groups: tensor i's range j in group (i+j)%groups.
func bigSnapshot(step int64, groups int) *Snapshot {
	return sizedSnapshot(step, groups, 1, 4095, 4096, 4097, 300000, 777777, 13, 1<<20)
}

// sizedSnapshot is bigSnapshot with tensors of the given element counts.
func sizedSnapshot(step int64, groups int, sizes ...int) *Snapshot {
	r := rand.New(rand.NewPCG(uint64(step), 3))
	s := &Snapshot{Step: step, Objects: map[string]json.RawMessage{"trainer": json.RawMessage(`{"it":1}`)}}
	for i, n := range sizes {
		v := make([]float32, n)
		for k := range v {
			v[k] = float32(r.NormFloat64())
		}
		b := safetensors.Float32Bytes(v)
		t := Tensor{Name: fmt.Sprintf("t%d", i), DType: safetensors.F32, Shape: []int64{int64(n)}}
		for lo := 0; lo < len(b); lo += 1 << 18 {
			t.Data = append(t.Data, b[lo:min(lo+1<<18, len(b))])
			t.Groups = append(t.Groups, (i+len(t.Groups))%groups)
		}
		s.Tensors = append(s.Tensors, t)
	}
	return s
}

func engineSave(t testing.TB, e *Engine, s *Snapshot) string {
	t.Helper()
	h, err := e.Save(s)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := h.Wait()
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestEngineMatchesSave: the lazy engine writes the same safetensors file,
// byte for byte, as the synchronous Save, whatever the chunk size and
// number of writers, and the checkpoint loads and verifies.
func TestEngineMatchesSave(t *testing.T) {
	for _, s := range []*Snapshot{testSnapshot(10), bigSnapshot(11, 3)} {
		ref := newMemFS()
		dir := mustSave(t, ref, memRoot, s)
		want := ref.readFile(filepath.Join(dir, rankFileName(0)))
		for _, o := range []EngineOptions{{ChunkBytes: 4096, RingBytes: 8192, Writers: 1}, {ChunkBytes: 8192, RingBytes: 1 << 20, Writers: 3}, {}} {
			mem := newMemFS()
			e, err := NewEngine(mem, memRoot, o)
			if err != nil {
				t.Fatal(err)
			}
			dir := engineSave(t, e, s)
			if got := mem.readFile(filepath.Join(dir, rankFileName(0))); !bytes.Equal(got, want) {
				t.Fatalf("step %d, %+v: the engine's file (%d bytes) differs from Save's (%d bytes)", s.Step, o, len(got), len(want))
			}
			checkLatest(t, mem, memRoot, s)
			checkLatest(t, mem.crashClone(true), memRoot, s) // durable
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestEngineOS: on the real file system, with O_DIRECT where it is
// allowed; Python's safetensors reads these files too (GPU machine check).
func TestEngineOS(t *testing.T) {
	root := filepath.Join(t.TempDir(), "ckpt")
	e, err := NewEngine(OS, root, EngineOptions{ChunkBytes: 1 << 16, RingBytes: 1 << 18, Keep: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	var hs []*Handle
	for step := int64(1); step <= 4; step++ {
		h, err := e.Save(bigSnapshot(step, 2))
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	for _, h := range hs {
		if _, err := h.Wait(); err != nil {
			t.Fatal(err)
		}
	}
	st := hs[3].Stats()
	t.Logf("step %d: %d bytes, O_DIRECT %v, captured in %v, durable in %v", st.Step, st.Bytes, st.Direct, st.Captured, st.Durable)
	checkLatest(t, OS, root, bigSnapshot(4, 2))
	dirs, err := List(OS, root)
	if err != nil || len(dirs) != 2 || filepath.Base(dirs[1]) != stepDirName(3) {
		t.Fatalf("retention (Keep 2) left %v (%v)", dirs, err)
	}
	e2, _ := NewEngine(OS, root, EngineOptions{ChunkBytes: 1 << 16, RingBytes: 1 << 18, Direct: DirectOff})
	defer e2.Close()
	h, _ := e2.Save(bigSnapshot(5, 1))
	if _, err := h.Wait(); err != nil || h.Stats().Direct {
		t.Fatalf("DirectOff: %v, direct %v", err, h.Stats().Direct)
	}
}

// TestEngineFaults fails operation i of a background save, for every i,
// with EIO and with a torn ENOSPC, on a root that holds a committed step
// 10: the handle and the next Save report the error, step 10 stays latest
// and intact, and a retry succeeds. The same with a crash (power loss) at
// operation i: latest then loads and verifies, old or new.
func TestEngineFaults(t *testing.T) {
	old, new := testSnapshot(10), sizedSnapshot(20, 2, 1, 1023, 1024, 1025, 5000, 13)
	opts := EngineOptions{ChunkBytes: 4096, RingBytes: 3 * 4096, Writers: 2}
	base := newMemFS()
	mustSave(t, base, memRoot, old)
	for _, mode := range []struct {
		name  string
		err   error
		torn  bool
		crash bool
	}{{"EIO", syscall.EIO, false, false}, {"ENOSPC-torn", syscall.ENOSPC, true, false}, {"crash", nil, false, true}} {
		t.Run(mode.name, func(t *testing.T) {
			for i := 0; ; i++ {
				if i > 2000 {
					t.Fatal("the save never succeeded")
				}
				mem := base.crashClone(false)
				efs := newErrorFS(mem)
				e, err := NewEngine(efs, memRoot, opts)
				if err != nil {
					t.Fatal(err)
				}
				// Operation i of the save (NewEngine's checks of the root
				// are TestLockFaults').
				if mode.crash {
					efs.crashAt = efs.ops + i
				} else {
					efs.failAt, efs.injectErr, efs.torn = efs.ops+i, mode.err, mode.torn
				}
				h, err := e.Save(new)
				if err != nil {
					t.Fatal(err)
				}
				_, werr := h.Wait()
				cerr := e.Close()
				if mode.crash {
					after := mem.crashClone(true)
					dir, err := Latest(after, memRoot)
					if err != nil {
						t.Fatalf("crash at op %d: Latest: %v", i, err)
					}
					if filepath.Base(dir) == stepDirName(20) {
						checkMatches(t, after, dir, new)
					} else {
						checkMatches(t, after, dir, old)
					}
					if werr == nil {
						t.Logf("the save completed before op %d", i)
						return
					}
					continue
				}
				if efs.injected == "" {
					if werr != nil {
						t.Fatalf("no failure injected: %v", werr)
					}
					checkLatest(t, mem, memRoot, new)
					t.Logf("the save succeeded after failing each of its %d operations in turn", i)
					return
				}
				if werr == nil {
					if !bestEffort(efs.injected) {
						t.Fatalf("op %s failed but the save succeeded", efs.injected)
					}
					checkLatest(t, mem, memRoot, new)
					continue
				}
				if !errors.Is(werr, mode.err) || cerr == nil {
					t.Fatalf("op %s: handle error %v, Close error %v", efs.injected, werr, cerr)
				}
				checkLatest(t, mem, memRoot, old)
				if entries := rootEntries(t, mem, memRoot); len(entries) != 2 {
					t.Fatalf("op %s: root holds %v after the failure", efs.injected, entries)
				}
			}
		})
	}
}

// TestEngineErrorSurfaces: a failed background save is reported once by
// the next Save, which then does not save.
func TestEngineErrorSurfaces(t *testing.T) {
	mem := newMemFS()
	efs := newErrorFS(mem)
	e, err := NewEngine(efs, memRoot, EngineOptions{ChunkBytes: 4096, RingBytes: 8192})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	efs.failAt, efs.injectErr = efs.ops+12, syscall.EIO
	h, _ := e.Save(bigSnapshot(1, 1))
	if _, err := h.Wait(); !errors.Is(err, syscall.EIO) {
		t.Fatalf("handle: %v", err)
	}
	if _, err := e.Save(testSnapshot(2)); !errors.Is(err, syscall.EIO) {
		t.Fatalf("next Save: %v", err)
	}
	engineSave(t, e, testSnapshot(3))
	checkLatest(t, mem, memRoot, testSnapshot(3))
}

// slowFS delays every write, so that a flush takes a while.
type slowFS struct {
	FS
	delay time.Duration
}

type slowFile struct {
	File
	delay time.Duration
}

func (s slowFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	f, err := s.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return slowFile{f, s.delay}, nil
}

func (f slowFile) WriteAt(p []byte, off int64) (int, error) {
	time.Sleep(f.delay)
	return f.File.WriteAt(p, off)
}

// TestEngineSnapshotIsolation: the source overwrites each group as soon as
// WaitGroup says it may (steps t+1, t+2 running during a slow flush), and
// the checkpoint still holds exactly step t's bytes. Run it under -race:
// the capture reads and the overwrites must be ordered by WaitGroup.
func TestEngineSnapshotIsolation(t *testing.T) {
	const groups = 4
	s := bigSnapshot(7, groups)
	want := make([][]byte, len(s.Tensors))
	for i, tn := range s.Tensors {
		want[i] = concat(tn.Data)
	}
	mem := newMemFS()
	e, _ := NewEngine(slowFS{mem, 2 * time.Millisecond}, memRoot, EngineOptions{ChunkBytes: 1 << 16, RingBytes: 1 << 18, Writers: 2})
	defer e.Close()
	h, err := e.Save(s)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range groups { // the next steps update group after group
		if err := h.WaitGroup(g); err != nil {
			t.Fatal(err)
		}
		for _, tn := range s.Tensors {
			for j, r := range tn.Data {
				if tn.Groups[j] == g {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for k := range r {
							r[k] ^= 0xff
						}
					}()
				}
			}
		}
	}
	wg.Wait()
	if h.Done() {
		t.Log("the flush finished before the overwrites: the test proves less")
	}
	dir, err := h.Wait()
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(mem, dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i, tn := range s.Tensors {
		got := make([]byte, len(want[i]))
		if err := c.ReadTensor(tn.Name, got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want[i]) {
			t.Fatalf("tensor %s holds bytes written after its capture", tn.Name)
		}
	}
}

func TestEngineOptions(t *testing.T) {
	for _, o := range []EngineOptions{{ChunkBytes: 100}, {ChunkBytes: 4096, RingBytes: 4096}, {Writers: -1}, {Keep: -1}, {Direct: 7}} {
		if _, err := NewEngine(newMemFS(), memRoot, o); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
	e, _ := NewEngine(newMemFS(), memRoot, EngineOptions{ChunkBytes: 4096, RingBytes: 8192})
	s := testSnapshot(1)
	s.Tensors[0].Groups = []int{0}
	if _, err := e.Save(s); err == nil {
		t.Error("groups of the wrong length accepted")
	}
	e.Close()
	if _, err := e.Save(testSnapshot(2)); !errors.Is(err, ErrClosed) {
		t.Errorf("Save after Close: %v, want ErrClosed", err)
	}
}

// BenchmarkEngineFlush: one lazy save of DOS_FLUSH_GIB GiB (default 0.25)
// under DOS_FLUSH_DIR (default a temporary directory) with
// DOS_FLUSH_WRITERS writers and DOS_FLUSH_CHUNK_MIB-MiB chunks (defaults:
// the engine's); reports the flush rate (bytes / time to durable).
func BenchmarkEngineFlush(b *testing.B) {
	env := func(name string, def float64) float64 {
		if v, err := strconv.ParseFloat(os.Getenv(name), 64); err == nil && v > 0 {
			return v
		}
		return def
	}
	size := int64(env("DOS_FLUSH_GIB", 0.25) * (1 << 30))
	dir := os.Getenv("DOS_FLUSH_DIR")
	if dir == "" {
		dir = b.TempDir()
	}
	chunk := int64(env("DOS_FLUSH_CHUNK_MIB", 8)) << 20
	opts := EngineOptions{ChunkBytes: chunk, RingBytes: (size + 2*chunk) / chunk * chunk, Writers: int(env("DOS_FLUSH_WRITERS", 0))}
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i)
	}
	const tensors = 64
	s := &Snapshot{Step: 1}
	per := size / tensors / 4 * 4
	for i := range tensors {
		s.Tensors = append(s.Tensors, Tensor{Name: fmt.Sprintf("t%d", i), DType: safetensors.F32, Shape: []int64{per / 4}, Data: [][]byte{data[int64(i)*per : int64(i+1)*per]}})
	}
	e, err := NewEngine(OS, filepath.Join(dir, "flush"), opts)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	b.SetBytes(size)
	for b.Loop() {
		h, err := e.Save(s)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := h.Wait(); err != nil {
			b.Fatal(err)
		}
		st := h.Stats()
		fmt.Printf("flush %.2f GiB, %d writers, %d MiB chunks: durable in %v, %.2f GB/s, O_DIRECT %v\n", float64(st.Bytes)/(1<<30), e.opts.Writers, chunk>>20, st.Durable.Round(time.Millisecond), float64(st.Bytes)/st.Durable.Seconds()/1e9, st.Direct)
		s.Step++
		os.RemoveAll(filepath.Join(dir, "flush"))
	}
}

// gateFS holds every fsync of a file until gate is closed, then fails it.
type gateFS struct {
	FS
	gate chan struct{}
}

type gateFile struct {
	File
	gate chan struct{}
}

func (g gateFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	f, err := g.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return gateFile{f, g.gate}, nil
}

func (f gateFile) Sync() error {
	<-f.gate
	return syscall.EIO
}

// TestEngineFailureWhileWaiting: a background save that fails while the
// next Save (or Close) waits for it makes that call return the error; no
// deadlock (a regression: the save once took the engine's lock to record
// its error while Save held it).
func TestEngineFailureWhileWaiting(t *testing.T) {
	for _, closeIt := range []bool{false, true} {
		gate := make(chan struct{})
		e, _ := NewEngine(gateFS{newMemFS(), gate}, memRoot, EngineOptions{ChunkBytes: 4096, RingBytes: 8192})
		if _, err := e.Save(testSnapshot(1)); err != nil {
			t.Fatal(err)
		}
		got := make(chan error, 1)
		go func() {
			if closeIt {
				got <- e.Close()
				return
			}
			_, err := e.Save(testSnapshot(2))
			got <- err
		}()
		time.Sleep(20 * time.Millisecond) // let it wait
		close(gate)
		select {
		case err := <-got:
			if !errors.Is(err, syscall.EIO) {
				t.Fatalf("close=%v: %v, want the failed save's EIO", closeIt, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("close=%v: deadlock", closeIt)
		}
		e.Close()
	}
}

func TestEngineGroupBounds(t *testing.T) {
	e, _ := NewEngine(newMemFS(), memRoot, EngineOptions{ChunkBytes: 4096, RingBytes: 8192})
	defer e.Close()
	for _, g := range []int{MaxGroups, 1<<62 + 5, -1} {
		s := testSnapshot(1)
		s.Tensors[0].Groups = []int{0, 0, g}
		if _, err := e.Save(s); err == nil {
			t.Errorf("group %d accepted", g)
		}
	}
}

func TestRetain(t *testing.T) {
	mem := newMemFS()
	for _, step := range []int64{1, 2, 3, 4} {
		mustSave(t, mem, memRoot, testSnapshot(step))
	}
	if err := Retain(mem, memRoot, 0); err == nil {
		t.Error("Retain 0 accepted")
	}
	if err := Retain(mem, memRoot, 2); err != nil {
		t.Fatal(err)
	}
	dirs, _ := List(mem, memRoot)
	if len(dirs) != 2 || filepath.Base(dirs[0]) != stepDirName(4) || filepath.Base(dirs[1]) != stepDirName(3) {
		t.Fatalf("after Retain 2: %v", dirs)
	}
	checkLatest(t, mem, memRoot, testSnapshot(4))
}

// TestHandleCaptured: Captured says, without blocking, what WaitCaptured
// waits for: false while a Prepare holds the capture back, true once the
// snapshot is captured.
func TestHandleCaptured(t *testing.T) {
	e, err := NewEngine(OS, filepath.Join(t.TempDir(), "root"), EngineOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	s := testSnapshot(1)
	release := make(chan struct{})
	s.Prepare = func() error { <-release; return nil }
	h, err := e.Save(s)
	if err != nil {
		t.Fatal(err)
	}
	if h.Captured() {
		t.Error("Captured before Prepare returned")
	}
	close(release)
	if err := h.WaitCaptured(); err != nil {
		t.Fatal(err)
	}
	if !h.Captured() {
		t.Error("not Captured after WaitCaptured")
	}
	if _, err := h.Wait(); err != nil {
		t.Fatal(err)
	}
}

// TestSnapshotCheck: Save and the Engine show Check every byte of every
// tensor, in order, as it is written; a Check error commits nothing and
// leaves the previous checkpoint the latest.
func TestSnapshotCheck(t *testing.T) {
	for _, o := range []*EngineOptions{nil, {ChunkBytes: 4096, RingBytes: 8192, Writers: 2}} {
		mem := newMemFS()
		save := func(s *Snapshot) (string, error) {
			if o == nil {
				return Save(mem, memRoot, s)
			}
			e, err := NewEngine(mem, memRoot, *o)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			h, err := e.Save(s)
			if err != nil {
				return "", err
			}
			return h.Wait()
		}
		good := bigSnapshot(1, 3)
		var seen [][]byte
		good.Check = func(k int, off int64, b []byte) error {
			for len(seen) <= k {
				seen = append(seen, nil)
			}
			if off != int64(len(seen[k])) {
				t.Fatalf("tensor %d: piece at %d after %d bytes", k, off, len(seen[k]))
			}
			seen[k] = append(seen[k], b...)
			return nil
		}
		if _, err := save(good); err != nil {
			t.Fatal(err)
		}
		for k, ts := range good.Tensors {
			var got []byte
			if k < len(seen) {
				got = seen[k]
			}
			if want := concat(ts.Data); !bytes.Equal(got, want) {
				t.Fatalf("engine %v: Check saw %d bytes of tensor %q, want its %d", o != nil, len(got), ts.Name, len(want))
			}
		}
		bad := bigSnapshot(2, 3)
		last := len(bad.Tensors) - 1
		bad.Check = func(k int, off int64, b []byte) error {
			if k == last {
				return errors.New("refused")
			}
			return nil
		}
		if _, err := save(bad); err == nil || !strings.Contains(err.Error(), "save step 2: refused") {
			t.Fatalf("engine %v: a refused snapshot: %v", o != nil, err)
		}
		checkLatest(t, mem, memRoot, good)
	}
}

// TestEngineManyGroups: a snapshot of many one-element capture groups (a
// subgroup size of 1: every piece 4 bytes, a chunk holding hundreds of
// thousands of groups' pieces), in three tensors that each visit every
// group, saves and loads: every group is captured (the save ends) and the
// file is Save's, byte for byte. Laying the chunks out searched each
// chunk's groups for every piece, which made such a save quadratic in the
// groups (400k took minutes; this one would not end within the test's
// timeout).
func TestEngineManyGroups(t *testing.T) {
	const groups = 300000
	r := rand.New(rand.NewPCG(7, 7))
	s := &Snapshot{Step: 3, Objects: map[string]json.RawMessage{"trainer": json.RawMessage(`{"it":3}`)}}
	for i := range 3 {
		v := make([]float32, groups)
		for k := range v {
			v[k] = float32(r.NormFloat64())
		}
		b := safetensors.Float32Bytes(v)
		tn := Tensor{Name: fmt.Sprintf("t%d", i), DType: safetensors.F32, Shape: []int64{groups}}
		for g := range groups {
			tn.Data = append(tn.Data, b[4*g:4*g+4])
			tn.Groups = append(tn.Groups, g)
		}
		s.Tensors = append(s.Tensors, tn)
	}
	ref := newMemFS()
	want := ref.readFile(filepath.Join(mustSave(t, ref, memRoot, s), rankFileName(0)))
	mem := newMemFS()
	e, err := NewEngine(mem, memRoot, EngineOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	dir := engineSave(t, e, s)
	if got := mem.readFile(filepath.Join(dir, rankFileName(0))); !bytes.Equal(got, want) {
		t.Fatalf("the engine's file (%d bytes) differs from Save's (%d bytes)", len(got), len(want))
	}
	checkLatest(t, mem, memRoot, s)
}
