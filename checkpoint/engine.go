package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/deepstates/dos/pinned"
)

// DirectMode says whether the Engine writes with O_DIRECT.
type DirectMode int

const (
	// DirectAuto tries O_DIRECT and falls back to buffered writes where the
	// file system refuses it with EINVAL (tmpfs, some overlay and network
	// file systems); Handle.Stats reports which was used.
	DirectAuto DirectMode = iota
	// DirectOn requires O_DIRECT: a file system that refuses it fails the
	// save.
	DirectOn
	// DirectOff writes through the page cache.
	DirectOff
)

// DirectAlign is the alignment of O_DIRECT writes: file offset, length and
// memory address are multiples of it (4096 bytes covers the logical block
// size of every common device).
const DirectAlign = 4096

// The Engine's default write shape: DefaultWriters positioned writes of
// DefaultChunkBytes in flight. On the GPU machine's disk (ext4 on a
// virtual disk) 8 writers of 16 MiB flushed 8 GiB at 1.72-2.05 GB/s where
// 4 of 8 MiB gave 1.43-1.59 GB/s in the same calls; on the development
// machine both reach 2.1-2.3 GB/s (BENCHMARKS.md, lazy checkpoints).
const (
	DefaultChunkBytes = 16 << 20
	DefaultWriters    = 8
)

// EngineOptions configures an Engine. The zero value is usable.
type EngineOptions struct {
	// RingBytes is the staging memory between capture and flush, in bytes
	// (default 256 MiB, at least 2 chunks): a page-aligned pinned.Arena
	// (O_DIRECT needs the alignment; the capture copies host memory, so
	// the ring is not page-locked). A full ring makes capture wait for the
	// writers (backpressure); it never grows.
	RingBytes int64
	// ChunkBytes is the unit of capture and of each positioned write, a
	// multiple of DirectAlign (default DefaultChunkBytes).
	ChunkBytes int64
	// Writers is the number of writer goroutines (default DefaultWriters).
	Writers int
	// Copiers is the number of goroutines that copy the snapshot into the
	// ring (default GOMAXPROCS/2, at least 1, at most 8): the capture runs
	// at memory speed, not one core's.
	Copiers int
	// Direct chooses O_DIRECT (default DirectAuto).
	Direct DirectMode
	// Keep is how many committed checkpoints to keep under root, the
	// newest; older ones are removed after each commit (0: keep all).
	Keep int
}

// Engine is the lazy asynchronous checkpointer of DataStates-LLM (Maurya
// et al., HPDC 2024: lazy capture, a bounded host buffer, background flush,
// and the commit protocol): Save takes a snapshot whose tensors
// are views of live state and returns at once. In the background copier
// goroutines capture the file image chunk by chunk into a bounded ring of
// pinned memory (reserved in file order), a checksum stage computes every
// tensor's CRC32C from the staged bytes in file order, and writer
// goroutines write each chunk at its offset with O_DIRECT
// (fallocated file, exact tail written through the page cache), then the
// file is synced and committed by the same protocol as Save (manifest last,
// renames, parent fsyncs, latest moved only after everything is durable).
// The source learns group by group when its memory may change again
// (Handle.WaitGroup): the next update of subgroup i waits only for
// subgroup i's capture, never for the disk unless the ring is full.
//
// One save runs at a time: Save waits for the previous one to be durable.
// An error of a background save is returned by its Handle and, once, by the
// next Save. Safe for concurrent use.
type Engine struct {
	fs    FS
	root  string
	opts  EngineOptions
	lock  *RootLock // the root's, from NewEngine to Close
	arena *pinned.Arena
	ring  *pinned.Ring

	mu  sync.Mutex
	cur *Handle // the save in flight, or the last one
	// reported tells whether cur's error, if any, was returned by Save or
	// Close already. The background save never takes mu: Save and Close
	// wait for it while holding mu.
	reported bool
	closed   bool
}

// NewEngine returns an engine that saves under root through fsys. It
// takes root's lock (Lock: creating root, checking that it can hold
// checkpoints) and holds it until Close.
//
// Errors: bad options; those of Lock (ErrLocked when another process
// writes under root, a root that is a step directory or not writable); the
// ring's memory failing to map or pin.
func NewEngine(fsys FS, root string, opts EngineOptions) (*Engine, error) {
	if opts.ChunkBytes == 0 {
		opts.ChunkBytes = DefaultChunkBytes
	}
	if opts.RingBytes == 0 {
		opts.RingBytes = 256 << 20
	}
	if opts.Writers == 0 {
		opts.Writers = DefaultWriters
	}
	if opts.Copiers == 0 {
		opts.Copiers = min(max(runtime.GOMAXPROCS(0)/2, 1), 8)
	}
	switch {
	case opts.ChunkBytes < 0 || opts.ChunkBytes%DirectAlign != 0:
		return nil, fmt.Errorf("checkpoint: ChunkBytes %d: want a positive multiple of %d", opts.ChunkBytes, DirectAlign)
	case opts.RingBytes < 2*opts.ChunkBytes:
		return nil, fmt.Errorf("checkpoint: RingBytes %d: want at least two chunks (%d)", opts.RingBytes, 2*opts.ChunkBytes)
	case opts.Writers < 0 || opts.Copiers < 0:
		return nil, fmt.Errorf("checkpoint: Writers %d, Copiers %d: want > 0", opts.Writers, opts.Copiers)
	case opts.Keep < 0:
		return nil, fmt.Errorf("checkpoint: Keep %d: want >= 0", opts.Keep)
	case opts.Direct < DirectAuto || opts.Direct > DirectOff:
		return nil, fmt.Errorf("checkpoint: Direct %d: unknown mode", opts.Direct)
	}
	lock, err := Lock(fsys, root)
	if err != nil {
		return nil, err
	}
	ringBytes := opts.RingBytes / opts.ChunkBytes * opts.ChunkBytes
	arena, err := pinned.New(nil, ringBytes+DirectAlign)
	if err != nil {
		lock.Unlock()
		return nil, fmt.Errorf("checkpoint: staging ring: %w", err)
	}
	buf, err := arena.Alloc(ringBytes, DirectAlign)
	if err != nil {
		arena.Free()
		lock.Unlock()
		return nil, fmt.Errorf("checkpoint: staging ring: %w", err)
	}
	return &Engine{fs: fsys, root: root, opts: opts, lock: lock, arena: arena, ring: pinned.NewRing(buf, true)}, nil
}

// Options returns the options in effect, defaults filled in. RingBytes is
// as given; the ring uses it rounded down to whole chunks.
func (e *Engine) Options() EngineOptions { return e.opts }

// Stats describes one background save.
type Stats struct {
	Step   int64
	Bytes  int64 // the safetensors file's size
	Direct bool  // O_DIRECT was used for the full chunks
	// Captured and Durable are the times from Save's return to the end of
	// the capture and to the commit.
	Captured, Durable time.Duration
}

// String describes the save for a log line: "step 20, 12.6 MB, captured
// in 3ms, durable in 18ms, O_DIRECT" (sizes below 0.1 MB in bytes).
func (s Stats) String() string {
	mode := "buffered"
	if s.Direct {
		mode = "O_DIRECT"
	}
	size := fmt.Sprintf("%.1f MB", float64(s.Bytes)/1e6)
	if s.Bytes < 100_000 {
		size = fmt.Sprintf("%d bytes", s.Bytes)
	}
	return fmt.Sprintf("step %d, %s, captured in %v, durable in %v, %s", s.Step, size,
		s.Captured.Round(time.Millisecond), s.Durable.Round(time.Millisecond), mode)
}

// Handle is one save handed to the Engine.
type Handle struct {
	step     int64
	start    time.Time
	captured chan struct{} // closed when every byte was captured (or the save failed)
	done     chan struct{} // closed when committed (or failed)
	groups   []chan struct{}

	mu    sync.Mutex
	err   error
	dir   string
	stats Stats
}

// WaitGroup blocks until capture group g (Tensor.Groups) is captured: from
// then on the source may change that group's memory. A group the snapshot
// does not have returns at once. The error is the save's, when it failed
// (the memory is free then too).
func (h *Handle) WaitGroup(g int) error {
	if g >= 0 && g < len(h.groups) {
		<-h.groups[g]
	}
	if isClosed(h.captured) || isClosed(h.done) {
		return h.Err()
	}
	return nil
}

// WaitCaptured blocks until the whole snapshot is captured (or the save
// failed): the source may then change any of its memory.
func (h *Handle) WaitCaptured() error {
	<-h.captured
	return h.Err()
}

// Wait blocks until the checkpoint is committed and durable, and returns
// its directory, or the save's error.
func (h *Handle) Wait() (string, error) {
	<-h.done
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.dir, h.err
}

// Done reports whether the save has finished, successfully or not.
func (h *Handle) Done() bool { return isClosed(h.done) }

// Err returns the save's error so far (nil while it runs well).
func (h *Handle) Err() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// Stats returns the save's figures (complete once Wait returns).
func (h *Handle) Stats() Stats {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.stats
}

func isClosed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// Save plans s and hands it to the background: it returns once the
// snapshot is checked and laid out, before any byte is copied. s's memory
// must stay unchanged until the handle reports its group captured
// (WaitGroup, WaitCaptured).
//
// Save first waits for the previous save to finish. Errors: an invalid
// snapshot (as Save's), the previous background save's error (once; s is
// then not saved), ErrClosed... see Engine.Close. Panics as the package
// Save does.
func (e *Engine) Save(s *Snapshot) (*Handle, error) {
	if s == nil {
		panic("checkpoint: Engine.Save of a nil *Snapshot")
	}
	p, err := newPlan(s)
	if err != nil {
		return nil, fmt.Errorf("checkpoint: save step %d: %w", s.Step, err)
	}
	ngroups := 0
	for _, t := range s.Tensors {
		if t.Groups != nil && len(t.Groups) != len(t.Data) {
			return nil, fmt.Errorf("checkpoint: save step %d: tensor %q has %d groups for %d data ranges", s.Step, t.Name, len(t.Groups), len(t.Data))
		}
		for _, g := range t.Groups {
			if g < 0 || g >= MaxGroups {
				return nil, fmt.Errorf("checkpoint: save step %d: tensor %q: group %d outside [0, %d)", s.Step, t.Name, g, MaxGroups)
			}
			ngroups = max(ngroups, g+1)
		}
	}
	ngroups = max(ngroups, 1)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, errEngineClosed
	}
	if err := e.waitCur(); err != nil {
		return nil, fmt.Errorf("checkpoint: the previous save failed, step %d not saved: %w", s.Step, err)
	}
	h := &Handle{step: s.Step, start: time.Now(), captured: make(chan struct{}), done: make(chan struct{}), groups: make([]chan struct{}, ngroups),
		stats: Stats{Step: s.Step, Bytes: p.fileSize}}
	for i := range h.groups {
		h.groups[i] = make(chan struct{})
	}
	e.cur, e.reported = h, false
	go e.run(h, p, s)
	return h, nil
}

// MaxGroups bounds the capture groups of a snapshot (Tensor.Groups).
const MaxGroups = 1 << 20

// waitCur waits for the save in flight and returns its error if it failed
// and the error was not returned before. Hold e.mu.
func (e *Engine) waitCur() error {
	if e.cur == nil {
		return nil
	}
	<-e.cur.done
	if e.reported {
		return nil
	}
	e.reported = true
	return e.cur.Err()
}

var errEngineClosed = errors.New("checkpoint: engine closed")

// Close waits for the save in flight, frees the ring, and returns that
// save's error if it failed and was not yet reported. Later Saves fail.
func (e *Engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	err := e.waitCur()
	e.ring.Close()
	if ferr := e.arena.Free(); err == nil && ferr != nil {
		err = ferr
	}
	e.lock.Unlock()
	return err
}

// chunk is a captured piece of the file image on its way to a writer.
type chunk struct {
	span pinned.Span
	off  int64 // file offset
	n    int64 // bytes of the file in it (the span may be longer)
}

// piece is one Data range of the snapshot placed in the file.
type piece struct {
	data []byte
	off  int64 // file offset
}

// run is one background save: begin, capture and write concurrently, sync,
// commit, retention. It closes every channel of h whatever happens.
func (e *Engine) run(h *Handle, p *plan, s *Snapshot) {
	var once sync.Once
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fail := func(err error) {
		once.Do(func() {
			h.mu.Lock()
			h.err = err
			h.mu.Unlock()
			cancel()
		})
	}
	finish := func(dir string) {
		h.mu.Lock()
		if h.err == nil {
			h.dir = dir
		}
		h.stats.Durable = time.Since(h.start)
		h.mu.Unlock()
		for _, g := range h.groups {
			if !isClosed(g) {
				close(g)
			}
		}
		if !isClosed(h.captured) {
			close(h.captured)
		}
		close(h.done)
	}

	// Pieces in file order; for every chunk of the file, the groups it
	// holds a piece of, and for every group how many chunks hold one: a
	// group is captured when all its chunks are.
	C := e.opts.ChunkBytes
	nchunks := int((p.fileSize + C - 1) / C)
	var pieces []piece
	chunkGroups := make([][]int, nchunks)
	left := make([]int, len(h.groups))
	for i, t := range s.Tensors {
		off := p.manifest.Tensors[i].Offset
		for j, r := range t.Data {
			g := 0
			if t.Groups != nil {
				g = t.Groups[j]
			}
			if len(r) > 0 {
				pieces = append(pieces, piece{data: r, off: off})
				for k := off / C; k <= (off+int64(len(r))-1)/C; k++ {
					if !slices.Contains(chunkGroups[k], g) {
						chunkGroups[k] = append(chunkGroups[k], g)
						left[g]++
					}
				}
			}
			off += int64(len(r))
		}
	}
	for g, n := range left {
		if n == 0 {
			close(h.groups[g])
		}
	}

	if s.Prepare != nil {
		if err := s.Prepare(); err != nil {
			fail(fmt.Errorf("checkpoint: save step %d: preparing the state: %w", s.Step, err))
			finish("")
			return
		}
	}
	// No other writer of this process between begin and retention (the
	// kernel's lock keeps other processes out).
	if err := e.lock.beginWrite(); err != nil {
		fail(fmt.Errorf("checkpoint: save step %d: %w", s.Step, err))
		finish("")
		return
	}
	defer e.lock.endWrite()
	tx, err := begin(e.fs, e.root, p)
	if err != nil {
		fail(err)
		finish("")
		return
	}
	f, df, direct, err := e.create(tx)
	if err != nil {
		tx.abort()
		fail(err)
		finish("")
		return
	}
	h.mu.Lock()
	h.stats.Direct = direct
	h.mu.Unlock()

	// Writers: each chunk at its offset, then its span back to the ring.
	work := make(chan chunk, nchunks)
	var writers sync.WaitGroup
	for range e.opts.Writers {
		writers.Go(func() {
			for c := range work {
				if ctx.Err() == nil && c.n > 0 {
					w := f
					if c.n == C && df != nil {
						w = df // a full, aligned chunk
					}
					if err := writeFullAt(w, c.span.Bytes()[:c.n], c.off); err != nil {
						fail(tx.fail(fmt.Sprintf("write %s at %d", tx.p.fileName, c.off), err))
					}
				}
				if c.span.Len > 0 {
					_ = e.ring.Release(c.span)
				}
			}
		})
	}

	// Copiers: fill each chunk's span with its part of the file image.
	type job struct {
		k    int
		span pinned.Span
	}
	jobs := make(chan job, nchunks)
	copied := make([]chan pinned.Span, nchunks)
	for k := range copied {
		copied[k] = make(chan pinned.Span, 1)
	}
	var gmu sync.Mutex
	var copiers sync.WaitGroup
	for range e.opts.Copiers {
		copiers.Go(func() {
			for j := range jobs {
				off := int64(j.k) * C
				n := min(C, p.fileSize-off)
				buf := j.span.Bytes()[:n]
				if off < int64(len(p.header)) {
					copy(buf, p.header[off:])
				}
				// The first piece ending after off, then those starting before off+n.
				i := sort.Search(len(pieces), func(i int) bool { return pieces[i].off+int64(len(pieces[i].data)) > off })
				for ; i < len(pieces) && pieces[i].off < off+n; i++ {
					pc := pieces[i]
					lo := max(off, pc.off)
					hi := min(off+n, pc.off+int64(len(pc.data)))
					copy(buf[lo-off:hi-off], pc.data[lo-pc.off:hi-pc.off])
				}
				gmu.Lock()
				for _, g := range chunkGroups[j.k] {
					if left[g]--; left[g] == 0 {
						close(h.groups[g])
					}
				}
				gmu.Unlock()
				copied[j.k] <- j.span
			}
		})
	}

	// Checksums, in file order (CRC32C is sequential within a tensor),
	// then on to the writers.
	crcs := make([]uint32, len(s.Tensors))
	var crcDone sync.WaitGroup
	crcDone.Go(func() {
		defer close(work)
		t := 0 // the first tensor that may overlap the chunk
		for k := range nchunks {
			span := <-copied[k] // every chunk comes, an empty span after a failure
			if ctx.Err() != nil || span.Len == 0 {
				work <- chunk{span: span} // the writers give the span back unwritten
				continue
			}
			off := int64(k) * C
			n := min(C, p.fileSize-off)
			buf := span.Bytes()[:n]
			for ; t < len(crcs); t++ {
				te := &p.manifest.Tensors[t]
				lo, hi := max(off, te.Offset), min(off+n, te.Offset+te.Bytes)
				if lo < hi {
					crcs[t] = crc32.Update(crcs[t], castagnoli, buf[lo-off:hi-off])
				}
				if te.Offset+te.Bytes > off+n {
					break // continues in the next chunk
				}
			}
			work <- chunk{span: span, off: off, n: n}
		}
	})

	// Reservations, in file order: a full ring waits for the writers.
	k := 0
	for ; k < nchunks && ctx.Err() == nil; k++ {
		span, err := e.ring.Reserve(ctx, C)
		if err != nil {
			fail(tx.fail("staging ring", err))
			break
		}
		jobs <- job{k, span}
	}
	close(jobs)
	for ; k < nchunks; k++ { // after a failure: let the checksum stage finish
		copied[k] <- pinned.Span{}
	}
	copiers.Wait()
	if ctx.Err() == nil {
		h.mu.Lock()
		h.stats.Captured = time.Since(h.start)
		h.mu.Unlock()
		close(h.captured)
	}
	crcDone.Wait()
	writers.Wait()
	if ctx.Err() == nil {
		for i := range crcs {
			tx.p.manifest.Tensors[i].CRC32C = crcs[i]
		}
		err = e.syncClose(tx, f, df)
	} else {
		closeQuiet(f, df)
		err = h.Err()
	}
	if err != nil {
		tx.abort()
		fail(err)
		finish("")
		return
	}
	dir, err := tx.commit()
	if err != nil {
		fail(err)
		finish("")
		return
	}
	if e.opts.Keep > 0 {
		_ = retain(e.fs, e.root, e.opts.Keep) // housekeeping: a failure leaves old checkpoints
	}
	finish(dir)
}

// create makes the rank file in the temporary directory, fallocates it
// when the file system allows, and opens a second, O_DIRECT descriptor for
// the full chunks (nil when not used).
func (e *Engine) create(tx *saveTx) (f, df File, direct bool, err error) {
	name := filepath.Join(tx.tmp, tx.p.fileName)
	f, err = tx.fs.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, nil, false, tx.fail("create "+tx.p.fileName, err)
	}
	if fd, ok := f.(interface{ Fd() uintptr }); ok && tx.p.fileSize > 0 {
		// Best effort: reserve the blocks up front (ext4, xfs) without
		// changing the size, so that the size check after writing still
		// catches a missing write; a file system without fallocate simply
		// grows the file as it is written.
		preallocate(fd.Fd(), tx.p.fileSize)
	}
	if e.opts.Direct == DirectOff {
		return f, nil, false, nil
	}
	if oDirect == 0 { // no O_DIRECT on this OS
		if e.opts.Direct == DirectOn {
			f.Close()
			return nil, nil, false, tx.fail("open "+tx.p.fileName+" with O_DIRECT", errors.New("O_DIRECT is not available on this operating system"))
		}
		return f, nil, false, nil
	}
	df, err = tx.fs.OpenFile(name, os.O_WRONLY|oDirect, 0)
	if err != nil {
		if e.opts.Direct == DirectAuto && errors.Is(err, syscall.EINVAL) {
			return f, nil, false, nil // the file system refuses O_DIRECT: buffered writes
		}
		f.Close()
		return nil, nil, false, tx.fail("open "+tx.p.fileName+" with O_DIRECT", err)
	}
	return f, df, true, nil
}

// syncClose makes the file durable and closes both descriptors.
func (e *Engine) syncClose(tx *saveTx, f, df File) error {
	st, err := f.Stat()
	if err == nil && st.Size() != tx.p.fileSize {
		err = fmt.Errorf("file holds %d bytes after writing, want %d", st.Size(), tx.p.fileSize)
	}
	if err != nil {
		closeQuiet(f, df)
		return tx.fail("stat "+tx.p.fileName, err)
	}
	if err := f.Sync(); err != nil {
		closeQuiet(f, df)
		return tx.fail("fsync "+tx.p.fileName, err)
	}
	if df != nil {
		if err := df.Close(); err != nil {
			f.Close()
			return tx.fail("close "+tx.p.fileName, err)
		}
	}
	if err := f.Close(); err != nil {
		return tx.fail("close "+tx.p.fileName, err)
	}
	return nil
}

func closeQuiet(fs ...File) {
	for _, f := range fs {
		if f != nil {
			_ = f.Close()
		}
	}
}
